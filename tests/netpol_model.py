"""An independent model of Kubernetes NetworkPolicy v1, for expected reachability in tests.

Written from the API reference (networking.k8s.io/v1 NetworkPolicySpec) and the upstream e2e
suite's reachability model, on raw manifests as a user writes them (its own defaulting:
policyTypes, protocol TCP) and NOT on agentd's parsed types, so that the enforcement code is
checked against something it does not share.  Traffic between a pod and itself is not
modelled (it never leaves the pod).

Pods may have an address of each family (dual-stack): a connection runs over one family,
from the source's address of that family to the destination's.  Selectors do not look at
addresses at all; an ipBlock holds addresses of its own family only.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass
class ModelPod:
    namespace: str
    name: str
    ip: str | None  # its IPv4 address (None: an IPv6-only pod)
    labels: dict[str, str] = field(default_factory=dict)
    ports: dict[str, tuple[int, str]] = field(default_factory=dict)  # named container ports
    ip6: str | None = None  # its IPv6 address, if it has one

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def addr(self, family: int) -> str | None:
        return self.ip6 if family == 6 else self.ip


@dataclass
class Cluster:
    pods: list[ModelPod]
    namespaces: dict[str, dict[str, str]] = field(default_factory=dict)  # Namespace object labels
    policies: list[dict[str, Any]] = field(default_factory=list)  # manifests

    def ns_labels(self, ns: str) -> dict[str, str]:
        return {**self.namespaces.get(ns, {}), NAME_LABEL: ns}


def selector_matches(sel: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """metav1.LabelSelector semantics; an empty selector matches everything."""
    sel = sel or {}
    for k, v in (sel.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in sel.get("matchExpressions") or []:
        op, key, values = e["operator"], e["key"], e.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def policy_types(policy: dict[str, Any]) -> list[str]:
    spec = policy["spec"]
    if spec.get("policyTypes"):
        return spec["policyTypes"]
    return ["Ingress"] + (["Egress"] if spec.get("egress") else [])


def _ns(policy: dict[str, Any]) -> str:
    return policy["metadata"].get("namespace") or "default"


def _selects(policy: dict[str, Any], pod: ModelPod) -> bool:
    return _ns(policy) == pod.namespace and selector_matches(policy["spec"].get("podSelector"), pod.labels)


def _sloppy_network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A CIDR as Kubernetes' ParseCIDRSloppy reads it: IPv4 octets in decimal, leading zeros
    and all (010 is 10)."""
    address, _, length = text.partition("/")
    if ":" not in address:
        address = ".".join(str(int(octet, 10)) for octet in address.split("."))
    return ipaddress.ip_network(f"{address}/{length}", strict=False)


def _peer_matches(cluster: Cluster, policy: dict[str, Any], peer: dict[str, Any], other: ModelPod | str,
                  family: int) -> bool:
    if "ipBlock" in peer:
        text = other.addr(family) if isinstance(other, ModelPod) else other
        if text is None:
            return False
        ip = ipaddress.ip_address(text)
        block = peer["ipBlock"]
        net = _sloppy_network(block["cidr"])
        if ip.version != net.version or ip not in net:
            return False
        return not any(ip in _sloppy_network(e) for e in block.get("except") or [])
    if not isinstance(other, ModelPod):
        return False  # selectors only ever match pods
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], cluster.ns_labels(other.namespace)):
            return False
    elif other.namespace != _ns(policy):
        return False
    return selector_matches(peer.get("podSelector"), other.labels)


def _port_matches(ports: list[dict[str, Any]] | None, dst: ModelPod, proto: str, port: int) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != proto:
            continue
        if "port" not in p:
            return True
        value = p["port"]
        if isinstance(value, str):
            if dst.ports.get(value) == (port, proto):
                return True
        elif value <= port <= p.get("endPort", value):
            return True
    return False


def _direction_allows(cluster: Cluster, target: ModelPod, other: ModelPod | str, dst: ModelPod, proto: str,
                      port: int, direction: str, family: int) -> bool:
    field_name, peer_field = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [p for p in cluster.policies if _selects(p, target) and direction in policy_types(p)]
    if not selecting:
        return True  # not isolated in this direction
    for policy in selecting:
        for rule in policy["spec"].get(field_name) or []:
            peers = rule.get(peer_field)
            if peers and not any(_peer_matches(cluster, policy, peer, other, family) for peer in peers):
                continue
            if _port_matches(rule.get("ports"), dst, proto, port):
                return True
    return False


def egress_allowed(cluster: Cluster, src: ModelPod, dst: ModelPod, proto: str, port: int, family: int = 4) -> bool:
    """What ``src``'s node decides: may ``src`` open this connection (over IP ``family``)?"""
    return _direction_allows(cluster, src, dst, dst, proto, port, "Egress", family)


def ingress_allowed(cluster: Cluster, src: ModelPod, dst: ModelPod, proto: str, port: int, family: int = 4) -> bool:
    """What ``dst``'s node decides: may ``dst`` accept this connection (over IP ``family``)?"""
    return _direction_allows(cluster, dst, src, dst, proto, port, "Ingress", family)


def allowed(cluster: Cluster, src: ModelPod, dst: ModelPod, proto: str, port: int, family: int = 4) -> bool:
    """Whether a new connection from ``src`` to ``dst`` on ``proto``/``port`` over IP
    ``family`` (from the one's address of that family to the other's) is allowed."""
    return (egress_allowed(cluster, src, dst, proto, port, family)
            and ingress_allowed(cluster, src, dst, proto, port, family))  # fmt: skip
