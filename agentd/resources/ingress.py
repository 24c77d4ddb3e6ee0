"""``networking.k8s.io/v1 Ingress`` and ``IngressClass``: validation as the API server does it.

The checks follow ``ValidateIngressSpec`` / ``ValidateIngressClass``
(pkg/apis/networking/validation/validation.go):

* either ``defaultBackend`` or ``rules`` must be given;
* a rule's ``host`` is a DNS-1123 subdomain, or a wildcard: ``*.`` then a subdomain (one
  leading wildcard label, nothing else), never an IP address;
* every path has a ``pathType`` (Exact, Prefix, ImplementationSpecific); Exact and Prefix
  paths are absolute and contain none of ``//``, ``/./``, ``/../``, ``%2f``, and do not end
  in ``/..`` or ``/.``; an ImplementationSpecific path, when given, is absolute;
* a backend is a ``service`` (name, and a port by ``number`` or by ``name``, not both) or a
  ``resource`` (an object reference), never both;
* ``tls[].hosts`` like rule hosts, ``tls[].secretName`` a DNS-1123 subdomain;
* an IngressClass names its ``controller`` (a domain-prefixed path, at most 250
  characters).

What the API server stores it stores: the spec as given, nothing defaulted (an Exact or
Prefix path that names no ``path`` is refused as not absolute, as the API server refuses it).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .validation import (
    DNS1123_SUBDOMAIN_MAX,
    Invalid,
    array,
    dns1123_label,
    dns1123_subdomain,
    iana_svc_name,
    integer,
    invalid,
    obj,
    port_number,
    required,
    string,
    unsupported,
)

PATH_TYPES = ("Exact", "Prefix", "ImplementationSpecific")
INVALID_PATH_SEQUENCES = ("//", "/./", "/../", "%2f", "%2F")
INVALID_PATH_SUFFIXES = ("/..", "/.")
DEFAULT_CLASS_ANNOTATION = "ingressclass.kubernetes.io/is-default-class"
CLASS_ANNOTATION = "kubernetes.io/ingress.class"  # the deprecated way of naming a class
CONTROLLER_MAX = 250
DEFAULT_CONTROLLER = "agentd.io/ingress-controller"
INGRESS_NODES = "ingress/nodes"  # <prefix>/ingress/nodes/<node>: the nodes serving Ingresses, under their lease
_CONTROLLER = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9/_.~%!$&'()*+,;=:@-]+")
_WILDCARD_MESSAGE = (
    "a wildcard DNS-1123 subdomain must start with '*.', followed by a valid DNS subdomain, which must consist "
    "of lower case alphanumeric characters, '-' or '.' and end with an alphanumeric character"
)


def validate_spec(raw: Any) -> dict[str, Any]:
    spec = obj(raw, "spec", ("ingressClassName", "defaultBackend", "tls", "rules"))
    out: dict[str, Any] = {}
    if "ingressClassName" in spec:
        out["ingressClassName"] = dns1123_subdomain(spec["ingressClassName"], "spec.ingressClassName")
    if "defaultBackend" in spec:
        out["defaultBackend"] = backend(spec["defaultBackend"], "spec.defaultBackend")
    rules = array(spec.get("rules"), "spec.rules")
    if not rules and "defaultBackend" not in out:
        raise invalid("spec", rules, "either `defaultBackend` or `rules` must be specified")
    if "rules" in spec:
        out["rules"] = [_rule(r, f"spec.rules[{i}]") for i, r in enumerate(rules)]
    tls = array(spec.get("tls"), "spec.tls")
    if tls:
        out["tls"] = [_tls(t, f"spec.tls[{i}]") for i, t in enumerate(tls)]
    return out


def host(value: Any, path: str) -> str:
    text = string(value, path)
    try:
        ipaddress.ip_address(text)
    except ValueError:
        pass
    else:
        raise invalid(path, text, "must be a DNS name, not an IP address")
    if "*" in text:
        rest = text[2:] if text.startswith("*.") else ""
        if not rest or "*" in rest or len(text) > DNS1123_SUBDOMAIN_MAX:
            raise invalid(path, text, _WILDCARD_MESSAGE)
        try:
            dns1123_subdomain(rest, path)
        except Invalid:
            raise invalid(path, text, _WILDCARD_MESSAGE) from None
        return text
    return dns1123_subdomain(text, path)


def _rule(raw: Any, path: str) -> dict[str, Any]:
    rule = obj(raw, path, ("host", "http"))
    out: dict[str, Any] = {}
    if rule.get("host", "") != "":
        out["host"] = host(rule["host"], f"{path}.host")
    if "http" in rule:
        http = obj(rule["http"], f"{path}.http", ("paths",))
        paths = array(http.get("paths"), f"{path}.http.paths")
        if not paths:
            raise required(f"{path}.http.paths")
        out["http"] = {"paths": [_path(p, f"{path}.http.paths[{i}]") for i, p in enumerate(paths)]}
    return out


def _path(raw: Any, where: str) -> dict[str, Any]:
    item = obj(raw, where, ("path", "pathType", "backend"))
    if "pathType" not in item:
        raise Invalid(f"{where}.pathType", "Required value: pathType must be specified")
    kind = string(item["pathType"], f"{where}.pathType")
    if kind not in PATH_TYPES:
        raise unsupported(f"{where}.pathType", kind, PATH_TYPES)
    text = string(item.get("path", ""), f"{where}.path")
    if kind in ("Exact", "Prefix"):
        if not text.startswith("/"):
            raise invalid(f"{where}.path", text, "must be an absolute path")
        for seq in INVALID_PATH_SEQUENCES:
            if seq in text:
                raise invalid(f"{where}.path", text, f"must not contain '{seq}'")
        for suffix in INVALID_PATH_SUFFIXES:
            if text.endswith(suffix):
                raise invalid(f"{where}.path", text, f"cannot end with '{suffix}'")
    elif text and not text.startswith("/"):
        raise invalid(f"{where}.path", text, "must be an absolute path")
    if "backend" not in item:
        raise required(f"{where}.backend")
    out: dict[str, Any] = {"pathType": kind, "backend": backend(item["backend"], f"{where}.backend")}
    if text:
        out["path"] = text
    return out


def backend(raw: Any, path: str) -> dict[str, Any]:
    b = obj(raw, path, ("service", "resource"))
    if "service" in b and "resource" in b:
        raise invalid(path, "", "cannot set both resource and service backends")
    if "resource" in b:
        ref = obj(b["resource"], f"{path}.resource", ("apiGroup", "kind", "name"))
        out = {}
        for key in ("kind", "name"):
            if not ref.get(key):
                raise required(f"{path}.resource.{key}")
            out[key] = string(ref[key], f"{path}.resource.{key}")
        if "apiGroup" in ref:
            out["apiGroup"] = dns1123_subdomain(ref["apiGroup"], f"{path}.resource.apiGroup")
        return {"resource": out}
    if "service" not in b:
        raise invalid(path, "", "resource or service backend is required")
    svc = obj(b["service"], f"{path}.service", ("name", "port"))
    if not svc.get("name"):
        raise required(f"{path}.service.name")
    name = dns1123_label(svc["name"], f"{path}.service.name")
    port = obj(svc.get("port"), f"{path}.service.port", ("name", "number"))
    has_name, has_number = bool(port.get("name")), bool(port.get("number"))
    if has_name and has_number:
        raise invalid(f"{path}.service.port", "", "cannot set both port name & port number")
    if has_name:
        ref: dict[str, Any] = {"name": iana_svc_name(string(port["name"], f"{path}.service.port.name"), f"{path}.service.port.name")}
    elif has_number:
        ref = {"number": port_number(integer(port["number"], f"{path}.service.port.number"), f"{path}.service.port.number")}
    else:
        raise Invalid(f"{path}.service.port", "Required value: port name or number is required")
    return {"service": {"name": name, "port": ref}}


def _tls(raw: Any, path: str) -> dict[str, Any]:
    t = obj(raw, path, ("hosts", "secretName"))
    out: dict[str, Any] = {}
    hosts = [host(h, f"{path}.hosts[{i}]") for i, h in enumerate(array(t.get("hosts"), f"{path}.hosts"))]
    if hosts:
        out["hosts"] = hosts
    if t.get("secretName"):
        out["secretName"] = dns1123_subdomain(t["secretName"], f"{path}.secretName")
    return out


# ------------------------------------------------------------------ IngressClass


def validate_class_spec(raw: Any, annotations: dict[str, str]) -> dict[str, Any]:
    spec = obj(raw, "spec", ("controller", "parameters"))
    if not spec.get("controller"):
        raise required("spec.controller")
    controller = string(spec["controller"], "spec.controller")
    if len(controller) > CONTROLLER_MAX:
        raise Invalid("spec.controller", f"Too long: may not be more than {CONTROLLER_MAX} bytes")
    if not _CONTROLLER.fullmatch(controller):
        raise invalid("spec.controller", controller, "must be a domain-prefixed path (such as \"acme.io/foo\")")
    out: dict[str, Any] = {"controller": controller}
    if "parameters" in spec:
        p = obj(spec["parameters"], "spec.parameters", ("apiGroup", "kind", "name", "namespace", "scope"))
        for key in ("kind", "name"):
            if not p.get(key):
                raise required(f"spec.parameters.{key}")
        out["parameters"] = {k: string(v, f"spec.parameters.{k}") for k, v in p.items()}
    default = annotations.get(DEFAULT_CLASS_ANNOTATION)
    if default is not None and default not in ("true", "false"):
        raise invalid(f"metadata.annotations[{DEFAULT_CLASS_ANNOTATION}]", default, 'must be "true" or "false"')
    return out


def is_default_class(doc: dict[str, Any]) -> bool:
    return (doc["metadata"].get("annotations") or {}).get(DEFAULT_CLASS_ANNOTATION) == "true"


def check_create(obj: Mapping[str, Any]) -> None:
    """The check the API server makes of an Ingress when it is created (not when it is
    replaced, nor when a stored one is read: those it took stay served): its
    ``kubernetes.io/ingress.class`` annotation, if it has one beside ``ingressClassName``, must
    name the same class -- else which one it is in is a matter of which controller reads which.
    Raises :class:`Invalid`."""
    class_name = obj["spec"].get("ingressClassName")
    annotation = (obj["metadata"].get("annotations") or {}).get(CLASS_ANNOTATION)
    if class_name is not None and annotation is not None and annotation != class_name:
        raise invalid(f"metadata.annotations.{CLASS_ANNOTATION}", annotation,
                      "must match `ingressClassName` when both are specified")  # fmt: skip


def ours(
    ingress: Mapping[str, Any], classes: Iterable[Mapping[str, Any]], controller: str = DEFAULT_CONTROLLER,
    *, without_class: bool = False,
) -> bool:  # fmt: skip
    """Whether this controller serves ``ingress``: its ``ingressClassName`` (or the deprecated
    ``kubernetes.io/ingress.class`` annotation) names an IngressClass of ``controller``; with
    neither, when an IngressClass of ``controller`` is marked default
    (``ingressclass.kubernetes.io/is-default-class: "true"``), or ``without_class`` says so."""
    classes = list(classes)
    mine = {c["metadata"]["name"] for c in classes if c["spec"]["controller"] == controller}
    name = ingress["spec"].get("ingressClassName") or (ingress["metadata"].get("annotations") or {}).get(CLASS_ANNOTATION)
    if name:
        return name in mine
    return without_class or any(is_default_class(c) and c["spec"]["controller"] == controller for c in classes)


def load_balancer(ingress: Mapping[str, Any], classes: Iterable[Mapping[str, Any]],
                  nodes: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """``status.loadBalancer.ingress`` of ``ingress``: the addresses of the nodes whose
    controller serves it (``nodes``: the records under INGRESS_NODES)."""
    classes = list(classes)
    out: list[dict[str, str]] = []
    for node in sorted(nodes, key=lambda n: str(n.get("node", ""))):
        controller = node.get("controller", DEFAULT_CONTROLLER)
        if ours(ingress, classes, controller, without_class=bool(node.get("watch_without_class"))):
            out += [{"ip": str(a)} for a in node.get("addresses", []) if {"ip": str(a)} not in out]
    return out
