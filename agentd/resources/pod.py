"""``v1 Pod``: the workload-endpoint record an agent keeps for each pod attached by agentd-cni.

Only agents write these (the agent of ``spec.nodeName``, under its node lease); ``agentd get
pods`` shows them and ``agentd label pod`` changes their labels.  The record is a small
subset of a Kubernetes Pod::

    apiVersion: v1
    kind: Pod
    metadata:
      namespace: default                 # CNI_ARGS K8S_POD_NAMESPACE
      name: web-1                        # CNI_ARGS K8S_POD_NAME
      labels: {app: web}                 # CNI args/runtimeConfig labels, then `agentd label pod`
      annotations:
        agentd.io/container-id: 3f2a...  # CNI_CONTAINERID
        agentd.io/interface: veth1a2b3c  # the host side of the pod's veth
    spec:
      nodeName: node1
      hostname: db-0                     # optional: with subdomain, a DNS name of its own
      subdomain: db                      # optional: (below)
      containers:
      - name: pod
        ports: [{name: http, containerPort: 8080, protocol: TCP}]   # named ports, if given
    status:
      podIP: 10.244.1.5
      podIPs: [{ip: 10.244.1.5}]

``spec.hostname`` and ``spec.subdomain`` (optional, DNS labels, as in a Kubernetes Pod): a pod
with both is, as an endpoint of the headless Service of its namespace named ``subdomain``,
``<hostname>.<subdomain>.<namespace>.svc.<domain>`` in DNS (the hostname the EndpointSlice
controller gives its endpoint; agentd.services.model).  Nothing agentd-cni is given says them
(kubelet's runtimes pass neither to CNI), so the records agents write carry none; a record
written otherwise (``put_owned``: the lab's records of simulated nodes) may.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from .validation import (
    Invalid,
    array,
    dns1123_label,
    dns1123_subdomain,
    iana_svc_name,
    obj,
    port_number,
    protocol,
    required,
    string,
)

CONTAINER_ID = "agentd.io/container-id"
INTERFACE = "agentd.io/interface"
CONTAINER_NAME = "pod"


def validate_spec(raw: Any) -> dict[str, Any]:
    spec = obj(raw, "spec", ("nodeName", "hostname", "subdomain", "containers"))
    if "nodeName" not in spec:
        raise required("spec.nodeName")
    out: dict[str, Any] = {"nodeName": dns1123_subdomain(spec["nodeName"], "spec.nodeName")}
    for key in ("hostname", "subdomain"):  # optional DNS labels ("": none), as the API server checks them
        if spec.get(key) not in (None, ""):
            out[key] = dns1123_label(spec[key], f"spec.{key}")
    out["containers"] = []
    seen: set[str] = set()
    for i, raw_c in enumerate(array(spec.get("containers"), "spec.containers")):
        where = f"spec.containers[{i}]"
        c = obj(raw_c, where, ("name", "ports"))
        container: dict[str, Any] = {"name": string(c.get("name", CONTAINER_NAME), f"{where}.name"), "ports": []}
        for j, raw_p in enumerate(array(c.get("ports"), f"{where}.ports")):
            container["ports"].append(container_port(raw_p, f"{where}.ports[{j}]", seen))
        out["containers"].append(container)
    return out


def container_port(raw: Any, path: str, seen: set[str], *, ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """A named container port as the record keeps it; ``ignored`` fields are dropped unchecked."""
    p = obj(raw, path, ("name", "containerPort", "protocol"), ignored=ignored)
    if "containerPort" not in p:
        raise required(f"{path}.containerPort")
    port: dict[str, Any] = {
        "containerPort": port_number(p["containerPort"], f"{path}.containerPort"),
        "protocol": protocol(p.get("protocol", "TCP"), f"{path}.protocol"),
    }
    if "name" in p:
        name = iana_svc_name(string(p["name"], f"{path}.name"), f"{path}.name")
        if name in seen:
            raise Invalid(f"{path}.name", f'Duplicate value: "{name}"')
        seen.add(name)
        port["name"] = name
    return port


def validate_status(raw: Any) -> dict[str, Any]:
    status = obj(raw, "status", ("podIP", "podIPs", "phase"))
    ips = []
    for i, item in enumerate(array(status.get("podIPs"), "status.podIPs")):
        entry = obj(item, f"status.podIPs[{i}]", ("ip",))
        ips.append(_ip(entry.get("ip"), f"status.podIPs[{i}].ip"))
    if "podIP" in status:
        first = _ip(status["podIP"], "status.podIP")
        if first not in ips:
            ips.insert(0, first)
    out: dict[str, Any] = {"phase": "Running"}
    if ips:
        out["podIP"] = ips[0]
        out["podIPs"] = [{"ip": ip} for ip in ips]
    return out


def _ip(value: Any, path: str) -> str:
    text = string(value, path)
    try:
        if "%" in text:  # a zone: the API server's net.ParseIP refuses it
            raise ValueError(text)
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise Invalid(path, f'Invalid value: "{text}": must be a valid IP address') from None
