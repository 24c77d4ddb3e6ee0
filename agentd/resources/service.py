"""``v1 Service`` and ``discovery.k8s.io/v1 EndpointSlice``: validation and defaults, as the API server does them.

The checks follow ``ValidateService`` / ``ValidateEndpointSlice`` (pkg/apis/core/validation,
pkg/apis/discovery/validation) for the subset agentd implements, and the defaults
``SetDefaults_Service``: a port's protocol is TCP, its targetPort the port; sessionAffinity
None (ClientIP: timeout 10800 s); internalTrafficPolicy Cluster, externalTrafficPolicy Cluster
for NodePort services.  Types ClusterIP and NodePort; headless (``clusterIP: None``).
LoadBalancer and ExternalName Services are validated with their own fields, then refused by
type; so are ``externalIPs``.
The IP family fields (``clusterIPs``, ``ipFamilies``, ``ipFamilyPolicy``) are
:mod:`agentd.resources.ipfamilies`'s; an EndpointSlice's ``addressType`` is IPv4 or IPv6, and
every address in it of that family.

What is not pure - the families a Service gets from the cluster's service ranges, the cluster
IPs and node ports it gets when it names none - is the store's (:mod:`agentd.resources.store`,
one etcd transaction with the object).
"""

from __future__ import annotations

import ipaddress
from typing import Any

from agentd.digits import ascii_digits, whole_number

from . import ipfamilies
from .validation import (
    Invalid,
    array,
    dns1123_label,
    dns1123_subdomain,
    iana_svc_name,
    integer,
    invalid,
    labels,
    obj,
    port_number,
    protocol,
    qualified_name,
    required,
    string,
    unsupported,
    wrong_type,
)

SERVICE_TYPES = ("ClusterIP", "NodePort")
UNSUPPORTED_TYPES = ("LoadBalancer", "ExternalName")
AFFINITIES = ("None", "ClientIP")
TRAFFIC_POLICIES = ("Cluster", "Local")
DEFAULT_AFFINITY_TIMEOUT = 10800  # SetDefaults_Service: 3 hours
MAX_AFFINITY_TIMEOUT = 86400
NODE_PORT_RANGE = (30000, 32767)  # the API server's --service-node-port-range default
HEADLESS = "None"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # an EndpointSlice's Service
ADDRESS_TYPES = ("IPv4", "IPv6")
MAX_ENDPOINTS = 1000  # ValidateEndpointSlice: maxEndpoints
MAX_PORTS = 20000

_SPEC_FIELDS = (
    "type", "clusterIP", "clusterIPs", "ports", "selector", "sessionAffinity", "sessionAffinityConfig",
    "externalTrafficPolicy", "internalTrafficPolicy", "ipFamilies", "ipFamilyPolicy", "publishNotReadyAddresses",
    # The fields of the types agentd refuses (and externalIPs, which it does not implement):
    # checked as the API server checks them, so that a manifest written for a cluster is
    # refused for what agentd lacks, not for a field it has never heard of.
    "externalName", "externalIPs", "loadBalancerIP", "loadBalancerSourceRanges", "loadBalancerClass",
    "allocateLoadBalancerNodePorts", "healthCheckNodePort",
)  # fmt: skip
LOAD_BALANCER_ONLY = ("loadBalancerSourceRanges", "allocateLoadBalancerNodePorts", "loadBalancerClass")


def validate_spec(raw: Any) -> dict[str, Any]:
    """The spec, validated and defaulted.  A LoadBalancer or ExternalName Service is checked
    field by field first (ValidateService), then refused by its type, in one line."""
    spec = obj(raw, "spec", _SPEC_FIELDS)
    kind = string(spec.get("type", "ClusterIP"), "spec.type")
    if kind not in SERVICE_TYPES + UNSUPPORTED_TYPES:
        raise unsupported("spec.type", kind, SERVICE_TYPES)
    out: dict[str, Any] = {"type": kind}
    if kind == "ExternalName":
        _external_name(spec)
    # clusterIP ("" until the store allocates one), clusterIPs, ipFamilies, ipFamilyPolicy: the
    # last two are defaulted by the store, from the cluster's service ranges (ipfamilies.py).
    out.update(ipfamilies.validate(spec))
    cluster_ip = out["clusterIP"]
    if cluster_ip == HEADLESS and kind != "ClusterIP":
        raise invalid("spec.clusterIP", cluster_ip, "may be 'None' only when `type` is 'ClusterIP'")
    if "selector" in spec:
        out["selector"] = labels(spec["selector"], "spec.selector")
    ports = array(spec.get("ports"), "spec.ports")
    if not ports and cluster_ip != HEADLESS and kind != "ExternalName":
        raise required("spec.ports")
    out["ports"] = _ports(ports, kind)
    out.update(_affinity(spec))
    out["internalTrafficPolicy"] = _choice(spec, "internalTrafficPolicy", TRAFFIC_POLICIES)
    external_ips = _external_ips(spec)
    if kind in ("NodePort", "LoadBalancer") or (kind == "ClusterIP" and external_ips):  # externally accessible
        out["externalTrafficPolicy"] = _choice(spec, "externalTrafficPolicy", TRAFFIC_POLICIES)
    elif "externalTrafficPolicy" in spec:
        raise invalid(
            "spec.externalTrafficPolicy", spec["externalTrafficPolicy"], "may only be set for externally-accessible services"
        )
    if "publishNotReadyAddresses" in spec:
        if not isinstance(spec["publishNotReadyAddresses"], bool):
            raise wrong_type("spec.publishNotReadyAddresses", spec["publishNotReadyAddresses"], "a boolean")
        out["publishNotReadyAddresses"] = spec["publishNotReadyAddresses"]
    _load_balancer(spec, kind, out.get("externalTrafficPolicy"))
    if kind in UNSUPPORTED_TYPES:
        raise Invalid("spec.type", f'Unsupported value: "{kind}": agentd implements ClusterIP and NodePort services')
    if external_ips:
        raise Invalid("spec.externalIPs", "Unsupported value: agentd does not implement external IPs")
    # Fields the API server keeps but ignores for these types (a warning there, stored here).
    for key in ("externalName", "loadBalancerIP"):
        if spec.get(key):
            out[key] = spec[key]
    return out


def _external_name(spec: dict[str, Any]) -> None:
    """ExternalName: a CNAME, and no address of its own (ValidateService)."""
    if spec.get("clusterIP") or spec.get("clusterIPs"):
        raise Invalid("spec.clusterIPs", "Forbidden: may not be set for ExternalName services")
    for key in ("ipFamilies", "ipFamilyPolicy"):
        if spec.get(key):
            raise Invalid(f"spec.{key}", "Forbidden: may not be set for ExternalName services")
    cname = string(spec.get("externalName", ""), "spec.externalName").removesuffix(".")  # a dot: fully qualified
    if not cname:
        raise required("spec.externalName")
    dns1123_subdomain(cname, "spec.externalName")


def _external_ips(spec: dict[str, Any]) -> list[str]:
    out = []
    for i, item in enumerate(array(spec.get("externalIPs"), "spec.externalIPs")):
        out.append(_ip_address(item, f"spec.externalIPs[{i}]"))
    return out


def _ip_address(value: Any, path: str) -> str:
    text = string(value, path)
    try:
        if "%" in text:  # a zone: the API server's net.ParseIP refuses it
            raise ValueError(text)
        addr = ipaddress.ip_address(text)
    except ValueError:
        raise invalid(path, text, "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)") from None
    if mapped_v4(addr) is not None:  # one address, one spelling (the API server's strict IP validation)
        raise invalid(path, text, "must not be an IPv4-mapped IPv6 address")
    return str(addr)


def mapped_v4(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv4-mapped IPv6 address (``::ffff:a.b.c.d``) stands for; None for any
    other.  Go's net.IP judges such an address as its IPv4 one, Python's ipaddress does not
    (``IPv6Address("::ffff:127.0.0.1").is_loopback`` is False), and a socket on ``::`` that
    connects to it reaches the IPv4 address."""
    return addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None


def _load_balancer(spec: dict[str, Any], kind: str, external_policy: str | None) -> None:
    """The LoadBalancer fields, where they may appear and what they hold (ValidateService)."""
    if spec.get("loadBalancerIP"):
        _ip_address(spec["loadBalancerIP"], "spec.loadBalancerIP")
    ranges = array(spec.get("loadBalancerSourceRanges"), "spec.loadBalancerSourceRanges")
    for key in LOAD_BALANCER_ONLY:
        present = bool(ranges) if key == "loadBalancerSourceRanges" else key in spec
        if present and kind != "LoadBalancer":
            raise Invalid(f"spec.{key}", "Forbidden: may only be used when `type` is 'LoadBalancer'")
    for i, item in enumerate(ranges):
        text = string(item, f"spec.loadBalancerSourceRanges[{i}]").strip()
        try:
            ipaddress.ip_network(text if "/" in text else "-", strict=False)  # a range, not an address
        except ValueError:
            raise invalid("spec.loadBalancerSourceRanges", ranges,
                          "must be a list of IP ranges. For example, 10.240.0.0/24,10.250.0.0/24") from None  # fmt: skip
    if "allocateLoadBalancerNodePorts" in spec and not isinstance(spec["allocateLoadBalancerNodePorts"], bool):
        raise wrong_type("spec.allocateLoadBalancerNodePorts", spec["allocateLoadBalancerNodePorts"], "a boolean")
    if "loadBalancerClass" in spec:
        qualified_name(spec["loadBalancerClass"], "spec.loadBalancerClass")
    if spec.get("healthCheckNodePort"):
        if kind != "LoadBalancer" or external_policy != "Local":
            raise invalid("spec.healthCheckNodePort", spec["healthCheckNodePort"],
                          "may only be set when `type` is 'LoadBalancer' and `externalTrafficPolicy` is 'Local'")  # fmt: skip
        port_number(spec["healthCheckNodePort"], "spec.healthCheckNodePort")


def _ports(raw: list[Any], kind: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    seen: set[tuple[int, str]] = set()
    node_ports: set[tuple[int, str]] = set()
    for i, item in enumerate(raw):
        path = f"spec.ports[{i}]"
        p = obj(item, path, ("name", "protocol", "port", "targetPort", "nodePort", "appProtocol"))
        port: dict[str, Any] = {}
        if "name" in p and p["name"] != "":
            port["name"] = dns1123_label(p["name"], f"{path}.name")
        elif len(raw) > 1:
            raise required(f"{path}.name")
        if port.get("name") in names:
            raise Invalid(f"{path}.name", f'Duplicate value: "{port["name"]}"')
        names.add(port.get("name", ""))
        port["protocol"] = protocol(p.get("protocol", "TCP"), f"{path}.protocol")
        if "port" not in p:
            raise required(f"{path}.port")
        port["port"] = port_number(p["port"], f"{path}.port")
        if (port["port"], port["protocol"]) in seen:
            raise Invalid(f"{path}", f'Duplicate value: {{"port":{port["port"]},"protocol":"{port["protocol"]}"}}')
        seen.add((port["port"], port["protocol"]))
        # Kubernetes' SetDefaults_Service: a targetPort absent, 0 or "" is the port (a headless
        # Service's too: its endpoints and DNS SRV records carry it).
        target = p.get("targetPort")
        if target is None or target == "" or (type(target) is int and target == 0):
            target = port["port"]
        port["targetPort"] = target_port(target, f"{path}.targetPort")
        if "nodePort" in p and p["nodePort"] not in (0, None):
            if kind == "ClusterIP":
                raise Invalid(f"{path}.nodePort", "Forbidden: may not be used when `type` is 'ClusterIP'")
            number = port_number(p["nodePort"], f"{path}.nodePort")
            low, high = NODE_PORT_RANGE
            if not low <= number <= high:
                raise invalid(f"{path}.nodePort", number, f"provided port is not in the valid range. The range of valid ports is {low}-{high}")
            if (number, port["protocol"]) in node_ports:
                raise Invalid(f"{path}.nodePort", f"Duplicate value: {number}")
            node_ports.add((number, port["protocol"]))
            port["nodePort"] = number
        if "appProtocol" in p:
            port["appProtocol"] = string(p["appProtocol"], f"{path}.appProtocol")
        out.append(port)
    return out


def target_port(value: Any, path: str) -> int | str:
    if isinstance(value, str):
        # An IntOrString written as a string of ASCII digits, however many zeros lead ("²" and
        # "٣" are names, refused as the API server refuses them).
        if ascii_digits(value):
            number = whole_number(value, 5, zeros=True)
            if number is None:
                raise invalid(path, value, "must be between 1 and 65535, inclusive")
            return port_number(number, path)
        return iana_svc_name(value, path)
    return port_number(integer(value, path), path)


def _affinity(spec: dict[str, Any]) -> dict[str, Any]:
    affinity = _choice(spec, "sessionAffinity", AFFINITIES)
    raw = obj(spec.get("sessionAffinityConfig"), "spec.sessionAffinityConfig", ("clientIP",))
    client = obj(raw.get("clientIP"), "spec.sessionAffinityConfig.clientIP", ("timeoutSeconds",))
    if affinity == "None":
        if raw:
            raise Invalid("spec.sessionAffinityConfig", "Forbidden: must not be set when `sessionAffinity` is None")
        return {"sessionAffinity": "None"}
    timeout = integer(client.get("timeoutSeconds", DEFAULT_AFFINITY_TIMEOUT), "spec.sessionAffinityConfig.clientIP.timeoutSeconds")
    if not 0 < timeout <= MAX_AFFINITY_TIMEOUT:
        raise invalid(
            "spec.sessionAffinityConfig.clientIP.timeoutSeconds", timeout,
            f"must be greater than 0 and less than or equal to {MAX_AFFINITY_TIMEOUT}",
        )  # fmt: skip
    return {"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": timeout}}}


def _choice(spec: dict[str, Any], key: str, values: tuple[str, ...]) -> str:
    value = spec.get(key, values[0])
    if value not in values:
        raise unsupported(f"spec.{key}", value, values)
    return str(value)


# ------------------------------------------------------------------ EndpointSlice


def validate_slice(doc: dict[str, Any]) -> dict[str, Any]:
    """The body of an EndpointSlice (its fields are at the top level, beside metadata)."""
    if "addressType" not in doc:
        raise required("addressType")
    address_type = string(doc["addressType"], "addressType")
    if address_type not in ADDRESS_TYPES:
        raise unsupported("addressType", address_type, ADDRESS_TYPES)
    endpoints = array(doc.get("endpoints"), "endpoints")
    if len(endpoints) > MAX_ENDPOINTS:
        raise Invalid("endpoints", f"Too many: {len(endpoints)}: must have at most {MAX_ENDPOINTS} items")
    out: dict[str, Any] = {"addressType": address_type,
                           "endpoints": [_endpoint(e, f"endpoints[{i}]", address_type) for i, e in enumerate(endpoints)]}
    ports = []
    names: set[str] = set()
    for i, item in enumerate(array(doc.get("ports"), "ports")):
        path = f"ports[{i}]"
        p = obj(item, path, ("name", "protocol", "port", "appProtocol"))
        port: dict[str, Any] = {"name": string(p.get("name", ""), f"{path}.name")}
        if port["name"]:
            dns1123_label(port["name"], f"{path}.name")
        if port["name"] in names:
            raise Invalid(f"{path}.name", f'Duplicate value: "{port["name"]}"')
        names.add(port["name"])
        port["protocol"] = protocol(p.get("protocol", "TCP"), f"{path}.protocol")
        if "port" in p:
            port["port"] = port_number(p["port"], f"{path}.port")
        if "appProtocol" in p:
            port["appProtocol"] = string(p["appProtocol"], f"{path}.appProtocol")
        ports.append(port)
    out["ports"] = ports
    return out


_LINK_LOCAL_MULTICAST = (ipaddress.ip_network("224.0.0.0/24"), ipaddress.ip_network("ff02::/16"))


def special_address(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why an endpoint may not have this address, as the API server's ValidateEndpointIP says
    (None: it may).  Such an endpoint would be the node itself: a Service or an Ingress
    backend on 127.0.0.1 or 169.254.169.254 hands outsiders the node's loopback services
    (its API, etcd) or the cloud's metadata service.  An IPv4-mapped IPv6 address is judged
    as the IPv4 address it embeds (as Go's net.IP does): ``::ffff:127.0.0.1`` is loopback."""
    addr = mapped_v4(addr) or addr
    if addr.is_unspecified:
        return "may not be unspecified (0.0.0.0, ::)"
    if addr.is_loopback:
        return "may not be in the loopback range (127.0.0.0/8, ::1/128)"
    if addr.is_link_local:
        return "may not be in the link-local range (169.254.0.0/16, fe80::/10)"
    if any(addr in net for net in _LINK_LOCAL_MULTICAST if net.version == addr.version):
        return "may not be in the link-local multicast range (224.0.0.0/24, ff02::/16)"
    return None


def _endpoint(raw: Any, path: str, address_type: str) -> dict[str, Any]:
    e = obj(raw, path, ("addresses", "conditions", "nodeName", "targetRef", "zone", "hostname", "hints", "deprecatedTopology"))
    addrs = array(e.get("addresses"), f"{path}.addresses")
    if len(addrs) != 1:
        # ValidateEndpointSlice: addresses must have 1..100 items; kube-proxy uses the first only.
        raise Invalid(f"{path}.addresses", f"Required value: must contain exactly one address (agentd: {address_type})")
    text = string(addrs[0], f"{path}.addresses[0]")
    try:  # the slice's addressType decides the family of every address in it
        if "%" in text:  # a zone: the API server's net.ParseIP refuses it
            raise ValueError(text)
        addr = (ipaddress.IPv4Address if address_type == "IPv4" else ipaddress.IPv6Address)(text)
        if mapped_v4(addr) is not None:  # IsValidIPv6Address: an IPv4-mapped address is IPv4 (To4() != nil)
            raise ValueError(text)
    except ValueError:
        raise invalid(f"{path}.addresses[0]", text, f"must be a valid {address_type} address") from None
    special = special_address(addr)
    if special:
        raise invalid(f"{path}.addresses[0]", text, special)
    out: dict[str, Any] = {"addresses": [str(addr)]}
    cond = obj(e.get("conditions"), f"{path}.conditions", ("ready", "serving", "terminating"))
    conditions = {}
    for key in ("ready", "serving", "terminating"):
        if key in cond:
            if not isinstance(cond[key], bool):
                raise wrong_type(f"{path}.conditions.{key}", cond[key], "a boolean")
            conditions[key] = cond[key]
    out["conditions"] = conditions
    for key in ("nodeName", "zone", "hostname"):
        if key in e:
            out[key] = string(e[key], f"{path}.{key}")
    if "hostname" in out:
        dns1123_label(out["hostname"], f"{path}.hostname")
    if "targetRef" in e:
        ref = obj(e["targetRef"], f"{path}.targetRef", ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath"))
        out["targetRef"] = {k: string(v, f"{path}.targetRef.{k}") for k, v in ref.items()}
    return out


def endpoint_ready(e: dict[str, Any]) -> bool:
    """EndpointConditions: an unset ``ready`` means ready (the API's "unknown state" is ready)."""
    return bool(e.get("conditions", {}).get("ready", True))


def endpoint_serving(e: dict[str, Any]) -> bool:
    """EndpointConditions: an unset ``serving`` means serving, whatever ``ready`` says (the
    API's "nil should be interpreted as true"; kube-proxy: Serving == nil || *Serving)."""
    return bool(e.get("conditions", {}).get("serving", True))


def endpoint_terminating(e: dict[str, Any]) -> bool:
    return bool(e.get("conditions", {}).get("terminating", False))
