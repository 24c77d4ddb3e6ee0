"""``networking.k8s.io/v1 NetworkPolicy``: validation and defaulting, as the API server does them.

The checks follow ``ValidateNetworkPolicySpec`` (pkg/apis/networking/validation) and the
defaults ``SetDefaults_NetworkPolicy``: a port's protocol defaults to TCP; without
``policyTypes`` a policy is an Ingress policy, and an Egress policy as well when it has
egress rules.  The spec is stored as given plus those defaults, so ``agentd get -o yaml``
shows what is enforced.
"""

from __future__ import annotations

from typing import Any

from .validation import (
    Invalid,
    array,
    cidr,
    iana_svc_name,
    integer,
    invalid,
    label_selector,
    obj,
    port_number,
    protocol,
    required,
    show,
    unsupported,
)

POLICY_TYPES = ("Ingress", "Egress")

# The API server takes any number of excepts in an ipBlock; agentd refuses more than this.
# A block is programmed as prefixes (its cidr minus its excepts), and one except costs up to
# (its prefix length - the cidr's) of them: a /128 except in ::/0 is 128 prefixes, each a
# rule per port match of the rule.  64 excepts keep one block within ~8,000 prefixes;
# thousands would stall the agent's event loop and the kernel's table for minutes.
IPBLOCK_EXCEPT_MAX = 64


def validate_spec(raw: Any) -> dict[str, Any]:
    spec = obj(raw, "spec", ("podSelector", "ingress", "egress", "policyTypes"))
    if "podSelector" not in spec:
        raise required("spec.podSelector")
    out: dict[str, Any] = {"podSelector": label_selector(spec["podSelector"], "spec.podSelector")}
    for direction, peers in (("ingress", "from"), ("egress", "to")):
        if direction in spec:
            rules = array(spec[direction], f"spec.{direction}")
            out[direction] = [_rule(r, f"spec.{direction}[{i}]", peers) for i, r in enumerate(rules)]
    types = array(spec.get("policyTypes"), "spec.policyTypes")
    if len(types) > len(POLICY_TYPES):
        raise Invalid("spec.policyTypes", f"Invalid value: {show(types)}: may not specify more than two policyTypes")
    for i, t in enumerate(types):
        if t not in POLICY_TYPES:
            raise unsupported(f"spec.policyTypes[{i}]", t, POLICY_TYPES)
    if not types:
        # SetDefaults_NetworkPolicy: Ingress always; Egress when there are egress rules.
        types = ["Ingress"] + (["Egress"] if out.get("egress") else [])
    out["policyTypes"] = [t for t in POLICY_TYPES if t in types]
    return out


def _rule(raw: Any, path: str, peers_field: str) -> dict[str, Any]:
    rule = obj(raw, path, (peers_field, "ports"))
    out: dict[str, Any] = {}
    if peers_field in rule:
        peers = array(rule[peers_field], f"{path}.{peers_field}")
        out[peers_field] = [_peer(p, f"{path}.{peers_field}[{i}]") for i, p in enumerate(peers)]
    if "ports" in rule:
        out["ports"] = [_port(p, f"{path}.ports[{i}]") for i, p in enumerate(array(rule["ports"], f"{path}.ports"))]
    return out


def _port(raw: Any, path: str) -> dict[str, Any]:
    port = obj(raw, path, ("protocol", "port", "endPort"))
    out: dict[str, Any] = {"protocol": protocol(port["protocol"], f"{path}.protocol") if "protocol" in port else "TCP"}
    if "port" in port:
        value = port["port"]
        if isinstance(value, str):
            out["port"] = iana_svc_name(value, f"{path}.port")
            if "endPort" in port:
                raise invalid(f"{path}.endPort", port["endPort"], "may not be specified when `port` is non-numeric")
        else:
            out["port"] = port_number(value, f"{path}.port")
            if "endPort" in port:
                end = integer(port["endPort"], f"{path}.endPort")
                if end < out["port"]:
                    raise invalid(f"{path}.endPort", end, "must be greater than or equal to `port`")
                out["endPort"] = port_number(end, f"{path}.endPort")
    elif "endPort" in port:
        raise invalid(f"{path}.endPort", port["endPort"], "may not be specified when `port` is not specified")
    return out


def _peer(raw: Any, path: str) -> dict[str, Any]:
    peer = obj(raw, path, ("podSelector", "namespaceSelector", "ipBlock"))
    if not peer:
        raise Invalid(path, "Required value: must specify a peer")
    if "ipBlock" in peer and len(peer) > 1:
        raise Invalid(path, "Forbidden: may not specify both ipBlock and another peer")
    out: dict[str, Any] = {}
    for key in ("podSelector", "namespaceSelector"):
        if key in peer:
            out[key] = label_selector(peer[key], f"{path}.{key}")
    if "ipBlock" in peer:
        out["ipBlock"] = _ip_block(peer["ipBlock"], f"{path}.ipBlock")
    return out


def _ip_block(raw: Any, path: str) -> dict[str, Any]:
    block = obj(raw, path, ("cidr", "except"))
    if "cidr" not in block or block["cidr"] == "":
        raise required(f"{path}.cidr")
    net = cidr(block["cidr"], f"{path}.cidr")
    out: dict[str, Any] = {"cidr": block["cidr"]}
    excepts = []
    items = array(block.get("except"), f"{path}.except")
    if len(items) > IPBLOCK_EXCEPT_MAX:
        raise Invalid(f"{path}.except", f"Too many: {len(items)}: must have at most {IPBLOCK_EXCEPT_MAX} items (an agentd limit)")
    for i, item in enumerate(items):
        where = f"{path}.except[{i}]"
        exc = cidr(item, where)
        if exc.version != net.version or exc.prefixlen <= net.prefixlen or not exc.subnet_of(net):  # type: ignore[arg-type]
            raise invalid(where, item, "must be a strict subset of `cidr`")
        excepts.append(item)
    if "except" in block:
        out["except"] = excepts
    return out
