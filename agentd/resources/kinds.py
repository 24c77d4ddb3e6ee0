"""The kinds of resource agentd stores, as a table: one :class:`Kind` per kind.

A kind says how it is written in a manifest (``apiVersion``, ``kind``), how the command line
names it (``networkpolicies``, ``netpol``...), whether it lives in a namespace, how its
fields are validated, how ``agentd get`` prints it as a table, and whether people may write
it (pods are written by the agents, from what agentd-cni tells them).  Adding a kind (Service
and EndpointSlice; Ingress, IngressClass, Secret and ConfigMap for the Ingress controller) is
one more entry in :data:`KINDS`.

:func:`validate` is the API server's admission for one object: apiVersion/kind, metadata
(names, labels, annotations), then the kind's own spec checks and defaults.  It raises
:class:`~agentd.resources.validation.Invalid` naming the field; nothing is written.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import ingress, networkpolicy, pod, secret, service
from .validation import (
    Invalid,
    annotations,
    dns1123_label,
    dns1123_subdomain,
    labels,
    obj,
    required,
    show,
    string,
)

DEFAULT_NAMESPACE = "default"
# Set on every namespace by the API server since Kubernetes 1.21; namespaceSelectors use it.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"

# Fields the API server sets: accepted (so that `get -o yaml | apply -f -` round-trips) and dropped.
_SERVER_METADATA = (
    "uid",
    "resourceVersion",
    "creationTimestamp",
    "generation",
    "managedFields",
    "selfLink",
    "finalizers",
    "ownerReferences",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
)


@dataclass(frozen=True)
class Kind:
    kind: str
    api_version: str
    plural: str  # also the etcd key segment: <prefix>/resources/<plural>/...
    short_names: tuple[str, ...]
    namespaced: bool
    name_check: Callable[[Any, str], str]
    # Validates and defaults everything but apiVersion, kind and metadata; returns those fields.
    body: Callable[[Mapping[str, Any], dict[str, Any]], dict[str, Any]]
    columns: tuple[str, ...]
    row: Callable[[Mapping[str, Any]], list[str]]
    writer: str | None = None  # who writes it, if not people (apply/delete refuse then)
    fields: tuple[str, ...] = ("spec", "status")  # top-level fields beside apiVersion/kind/metadata

    @property
    def names(self) -> tuple[str, ...]:
        return (self.kind.lower(), self.plural, *self.short_names)


# ------------------------------------------------------------------ the kinds


def _namespace_body(doc: Mapping[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    obj(doc.get("spec"), "spec", ("finalizers",))
    # The API server labels every namespace with its own name.
    meta["labels"] = {**meta.get("labels", {}), NAMESPACE_NAME_LABEL: meta["name"]}
    return {}


def _networkpolicy_body(doc: Mapping[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    if "spec" not in doc:
        raise required("spec")
    return {"spec": networkpolicy.validate_spec(doc["spec"])}


def _pod_body(doc: Mapping[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    if "spec" not in doc:
        raise required("spec")
    return {"spec": pod.validate_spec(doc["spec"]), "status": pod.validate_status(doc.get("status"))}


def _service_body(doc: Mapping[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    return {"spec": service.validate_spec(doc.get("spec"))}


def _slice_body(doc: Mapping[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    return service.validate_slice(dict(doc))


def _ingress_body(doc: Mapping[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    if "spec" not in doc:
        raise required("spec")
    return {"spec": ingress.validate_spec(doc["spec"])}  # status is the controller's (filled in when read)


def _ingress_class_body(doc: Mapping[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    return {"spec": ingress.validate_class_spec(doc.get("spec"), meta.get("annotations", {}))}


def _secret_body(doc: Mapping[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    return secret.validate_secret(dict(doc))


def _configmap_body(doc: Mapping[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    return secret.validate_configmap(dict(doc))


def _ingress_hosts(spec: Mapping[str, Any]) -> str:
    hosts = list(dict.fromkeys(r["host"] for r in spec.get("rules", []) if r.get("host")))
    more = f" + {len(hosts) - 4} more..." if len(hosts) > 4 else ""
    return ",".join(hosts[:4]) + more if hosts else "*"


def _ingress_address(doc: Mapping[str, Any]) -> str:
    lb = ((doc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    return ",".join(e.get("ip") or e.get("hostname", "") for e in lb)


def _service_ports(spec: Mapping[str, Any]) -> str:
    parts = []
    for p in spec.get("ports", []):
        node = f":{p['nodePort']}" if p.get("nodePort") else ""
        parts.append(f"{p['port']}{node}/{p['protocol']}")
    return ",".join(parts) or "<none>"


def _slice_endpoints(doc: Mapping[str, Any]) -> str:
    addrs = [e["addresses"][0] for e in doc.get("endpoints", [])]
    more = f" + {len(addrs) - 3} more..." if len(addrs) > 3 else ""
    return ",".join(addrs[:3]) + more if addrs else "<unset>"


def _labels_text(meta: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted((meta.get("labels") or {}).items())) or "<none>"


def _selector_text(sel: Mapping[str, Any] | None) -> str:
    if sel is None:
        return "<none>"
    parts = [f"{k}={v}" for k, v in sorted((sel.get("matchLabels") or {}).items())]
    for e in sel.get("matchExpressions") or []:
        op, key = e["operator"], e["key"]
        if op == "Exists":
            parts.append(key)
        elif op == "DoesNotExist":
            parts.append(f"!{key}")
        else:
            parts.append(f"{key} {'in' if op == 'In' else 'notin'} ({','.join(e.get('values', []))})")
    return ",".join(parts) or "<none>"


def _age(meta: Mapping[str, Any], now: float | None = None) -> str:
    stamp = meta.get("creationTimestamp")
    try:
        created = calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))
    except (TypeError, ValueError):
        return "<unknown>"
    seconds = max(0, int((time.time() if now is None else now) - created))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _pod_ip(doc: Mapping[str, Any]) -> str:
    return (doc.get("status") or {}).get("podIP") or "<none>"


NAMESPACE = Kind(
    kind="Namespace",
    api_version="v1",
    plural="namespaces",
    short_names=("ns",),
    namespaced=False,
    name_check=dns1123_label,
    body=_namespace_body,
    columns=("NAME", "LABELS", "AGE"),
    row=lambda d: [d["metadata"]["name"], _labels_text(d["metadata"]), _age(d["metadata"])],
)

NETWORK_POLICY = Kind(
    kind="NetworkPolicy",
    api_version="networking.k8s.io/v1",
    plural="networkpolicies",
    short_names=("netpol",),
    namespaced=True,
    name_check=dns1123_subdomain,
    body=_networkpolicy_body,
    columns=("NAMESPACE", "NAME", "POD-SELECTOR", "TYPES", "AGE"),
    row=lambda d: [
        d["metadata"]["namespace"],
        d["metadata"]["name"],
        _selector_text(d["spec"].get("podSelector")),
        ",".join(d["spec"].get("policyTypes", [])),
        _age(d["metadata"]),
    ],
)

POD = Kind(
    kind="Pod",
    api_version="v1",
    plural="pods",
    short_names=("po",),
    namespaced=True,
    name_check=dns1123_subdomain,
    body=_pod_body,
    columns=("NAMESPACE", "NAME", "IP", "NODE", "LABELS"),
    row=lambda d: [
        d["metadata"]["namespace"],
        d["metadata"]["name"],
        _pod_ip(d),
        d["spec"].get("nodeName", ""),
        _labels_text(d["metadata"]),
    ],
    writer="the agent of the pod's node (from agentd-cni); change labels with `agentd label pod`",
)

SERVICE = Kind(
    kind="Service",
    api_version="v1",
    plural="services",
    short_names=("svc",),
    namespaced=True,
    name_check=dns1123_label,  # a Service name is a DNS label (it is one in <svc>.<ns>.svc)
    body=_service_body,
    columns=("NAMESPACE", "NAME", "TYPE", "CLUSTER-IP", "PORT(S)", "SELECTOR", "AGE"),
    row=lambda d: [
        d["metadata"]["namespace"],
        d["metadata"]["name"],
        d["spec"]["type"],
        d["spec"].get("clusterIP") or "<pending>",
        _service_ports(d["spec"]),
        _selector_text({"matchLabels": d["spec"]["selector"]}) if d["spec"].get("selector") else "<none>",
        _age(d["metadata"]),
    ],
)

ENDPOINT_SLICE = Kind(
    kind="EndpointSlice",
    api_version="discovery.k8s.io/v1",
    plural="endpointslices",
    short_names=(),
    namespaced=True,
    name_check=dns1123_subdomain,
    body=_slice_body,
    columns=("NAMESPACE", "NAME", "ADDRESSTYPE", "PORTS", "ENDPOINTS", "AGE"),
    row=lambda d: [
        d["metadata"]["namespace"],
        d["metadata"]["name"],
        d["addressType"],
        ",".join(str(p.get("port", "<unset>")) for p in d["ports"]) or "<unset>",
        _slice_endpoints(d),
        _age(d["metadata"]),
    ],
    fields=("addressType", "endpoints", "ports"),
)

INGRESS = Kind(
    kind="Ingress",
    api_version="networking.k8s.io/v1",
    plural="ingresses",
    short_names=("ing",),
    namespaced=True,
    name_check=dns1123_subdomain,
    body=_ingress_body,
    columns=("NAMESPACE", "NAME", "CLASS", "HOSTS", "ADDRESS", "PORTS", "AGE"),
    row=lambda d: [
        d["metadata"]["namespace"],
        d["metadata"]["name"],
        d["spec"].get("ingressClassName") or (d["metadata"].get("annotations") or {}).get(ingress.CLASS_ANNOTATION)
        or "<none>",
        _ingress_hosts(d["spec"]),
        _ingress_address(d),
        "80, 443" if d["spec"].get("tls") else "80",
        _age(d["metadata"]),
    ],
)

INGRESS_CLASS = Kind(
    kind="IngressClass",
    api_version="networking.k8s.io/v1",
    plural="ingressclasses",
    short_names=(),
    namespaced=False,
    name_check=dns1123_subdomain,
    body=_ingress_class_body,
    columns=("NAME", "CONTROLLER", "PARAMETERS", "AGE"),
    row=lambda d: [
        d["metadata"]["name"] + (" (default)" if ingress.is_default_class(d) else ""),
        d["spec"]["controller"],
        "<none>" if "parameters" not in d["spec"] else f"{d['spec']['parameters']['kind']}/{d['spec']['parameters']['name']}",
        _age(d["metadata"]),
    ],
)

SECRET = Kind(
    kind="Secret",
    api_version="v1",
    plural="secrets",
    short_names=(),
    namespaced=True,
    name_check=dns1123_subdomain,
    body=_secret_body,
    columns=("NAMESPACE", "NAME", "TYPE", "DATA", "AGE"),
    row=lambda d: [d["metadata"]["namespace"], d["metadata"]["name"], d["type"], str(len(d.get("data", {}))),
                   _age(d["metadata"])],
    fields=("type", "data", "stringData", "immutable"),
)

CONFIG_MAP = Kind(
    kind="ConfigMap",
    api_version="v1",
    plural="configmaps",
    short_names=("cm",),
    namespaced=True,
    name_check=dns1123_subdomain,
    body=_configmap_body,
    columns=("NAMESPACE", "NAME", "DATA", "AGE"),
    row=lambda d: [d["metadata"]["namespace"], d["metadata"]["name"],
                   str(len(d.get("data", {})) + len(d.get("binaryData", {}))), _age(d["metadata"])],
    fields=("data", "binaryData", "immutable"),
)

KINDS: dict[str, Kind] = {
    k.kind: k
    for k in (NAMESPACE, NETWORK_POLICY, POD, SERVICE, ENDPOINT_SLICE, INGRESS, INGRESS_CLASS, SECRET, CONFIG_MAP)
}
BY_PLURAL: dict[str, Kind] = {k.plural: k for k in KINDS.values()}


def lookup(name: str) -> Kind:
    """A kind by any name the command line accepts (``netpol``, ``NetworkPolicy``, ``pods``...)."""
    wanted = name.lower()
    for kind in KINDS.values():
        if wanted in kind.names:
            return kind
    # kubectl also takes "networkpolicy.networking.k8s.io"
    base, _, group = wanted.partition(".")
    for kind in KINDS.values():
        if group and base in kind.names and kind.api_version.startswith(group + "/"):
            return kind
    known = ", ".join(k.plural for k in KINDS.values())
    raise Invalid("", f"the server doesn't have a resource type {show(name)} (known: {known})")


# ------------------------------------------------------------------ admission


def validate(doc: Any, *, default_namespace: str = DEFAULT_NAMESPACE) -> dict[str, Any]:
    """Check and default one object; returns it as it will be stored (without server fields).

    Raises :class:`Invalid` naming the field.  The message is prefixed by the caller with
    the object's identity (:func:`describe`).
    """
    if not isinstance(doc, dict):
        raise Invalid("", f"a manifest must be an object, not {show(doc)}")
    for key in ("apiVersion", "kind"):
        if key not in doc or doc[key] in (None, ""):
            raise required(key)
        string(doc[key], key)
    kind = KINDS.get(doc["kind"])
    if kind is None:
        raise Invalid("kind", f"Unsupported value: {show(doc['kind'])}: supported kinds: {', '.join(KINDS)}")
    if doc["apiVersion"] != kind.api_version:
        raise Invalid(
            "apiVersion", f"Unsupported value: {show(doc['apiVersion'])}: {kind.kind} is {show(kind.api_version)}"
        )
    allowed = ("apiVersion", "kind", "metadata", *kind.fields)
    top = obj(doc, "", allowed)
    meta = metadata(top.get("metadata"), kind, default_namespace)
    body = kind.body(top, meta)
    return {"apiVersion": kind.api_version, "kind": kind.kind, "metadata": meta, **body}


def metadata(raw: Any, kind: Kind, default_namespace: str) -> dict[str, Any]:
    meta = obj(raw, "metadata", ("name", "namespace", "labels", "annotations", "generateName"), ignored=_SERVER_METADATA)
    if "generateName" in meta:
        raise Invalid("metadata.generateName", "Forbidden: not supported; give metadata.name")
    if "name" not in meta or meta["name"] == "":
        raise required("metadata.name")
    out: dict[str, Any] = {"name": kind.name_check(meta["name"], "metadata.name")}
    if kind.namespaced:
        ns = meta.get("namespace") or default_namespace
        out["namespace"] = dns1123_label(ns, "metadata.namespace")
    elif "namespace" in meta and meta["namespace"] != "":
        raise Invalid("metadata.namespace", f"Forbidden: {kind.kind} is not namespaced")
    if "labels" in meta:
        out["labels"] = labels(meta["labels"], "metadata.labels")
    if "annotations" in meta:
        out["annotations"] = annotations(meta["annotations"], "metadata.annotations")
    return out


def identity(doc: Mapping[str, Any]) -> tuple[str, str, str]:
    """``(kind, namespace or "", name)`` of a validated object."""
    meta = doc["metadata"]
    return doc["kind"], meta.get("namespace", ""), meta["name"]


def describe(kind: str, namespace: str, name: str) -> str:
    """``NetworkPolicy default/allow-web`` (``Namespace prod`` for cluster-scoped kinds)."""
    return f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}"
