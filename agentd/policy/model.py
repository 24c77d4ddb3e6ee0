"""NetworkPolicy, pods and namespaces as typed values, parsed from validated resources.

Pure: frozen dataclasses built from objects :mod:`agentd.resources` has already validated.
A :class:`Selector` is a Kubernetes label selector (matchLabels AND every matchExpression);
it is hashable, so that the engine can keep one membership per distinct selector.
"""

from __future__ import annotations

import bisect
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Any

from agentd.resources import pod as podres
from agentd.resources.kinds import NAMESPACE_NAME_LABEL
from agentd.resources.validation import cidr

Labels = Mapping[str, str]
PodKey = tuple[str, str]  # (namespace, name)

PROTOCOLS = ("TCP", "UDP", "SCTP")
VERSIONS = (4, 6)  # the IP versions a pod may have an address of (one address each)

Address = IPv4Address | IPv6Address
Network = IPv4Network | IPv6Network


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # In | NotIn | Exists | DoesNotExist
    values: frozenset[str] = frozenset()

    def matches(self, labels: Labels) -> bool:
        # k8s.io/apimachinery/pkg/labels Requirement.Matches
        if self.operator == "In":
            return labels.get(self.key) in self.values
        if self.operator == "NotIn":
            return labels.get(self.key) not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels  # DoesNotExist


@dataclass(frozen=True)
class Selector:
    """A label selector; the empty selector matches everything."""

    match_labels: frozenset[tuple[str, str]] = frozenset()
    requirements: frozenset[Requirement] = frozenset()

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> Selector:
        raw = raw or {}
        return cls(
            frozenset((raw.get("matchLabels") or {}).items()),
            frozenset(
                Requirement(e["key"], e["operator"], frozenset(e.get("values") or ()))
                for e in raw.get("matchExpressions") or ()
            ),
        )

    @property
    def empty(self) -> bool:
        return not self.match_labels and not self.requirements

    def matches(self, labels: Labels) -> bool:
        for key, value in self.match_labels:
            if labels.get(key) != value:
                return False
        return all(r.matches(labels) for r in self.requirements)

    def __str__(self) -> str:
        parts = [f"{k}={v}" for k, v in sorted(self.match_labels)]
        for r in sorted(self.requirements, key=lambda r: (r.key, r.operator)):
            if r.operator == "Exists":
                parts.append(r.key)
            elif r.operator == "DoesNotExist":
                parts.append(f"!{r.key}")
            else:
                parts.append(f"{r.key} {'in' if r.operator == 'In' else 'notin'} ({','.join(sorted(r.values))})")
        return ",".join(parts) or "<all>"


@dataclass(frozen=True)
class PeerSelector:
    """The pods a podSelector / namespaceSelector peer means.

    ``namespace`` set: pods of that namespace (a podSelector alone is relative to the
    policy's own namespace); None: pods of every namespace ``namespaces`` matches."""

    pods: Selector
    namespace: str | None
    namespaces: Selector | None

    def matches(self, pod: Pod, ns_labels: Labels) -> bool:
        if self.namespace is not None:
            if pod.namespace != self.namespace:
                return False
        elif self.namespaces is not None and not self.namespaces.matches(ns_labels):
            return False
        return self.pods.matches(pod.labels)


@dataclass(frozen=True)
class IPBlock:
    """A range minus its excepts.  One family: the API server refuses an except of the other
    family, so an IPv4 block never matches an IPv6 address and the other way round."""

    cidr: Network
    excepts: tuple[Network, ...] = ()

    def ranges(self, version: int = 4) -> list[Network]:
        """The networks of IP ``version`` the block covers (cidr minus its excepts): the fewest
        non-overlapping prefixes, in address order.

        The excepts are collapsed, then the cidr is halved only where an except lies below:
        the work is about (number of excepts) x (prefix length), whatever their number (an
        except per piece, as before, was pieces x excepts: minutes for thousands of them)."""
        if self.cidr.version != version:
            return []
        cidr = self.cidr
        inside: list[Network] = []
        for exc in self.excepts:
            if exc.version != version or not cidr.overlaps(exc):  # type: ignore[arg-type]
                continue
            if cidr.subnet_of(exc):  # type: ignore[arg-type]
                return []
            inside.append(exc)
        bits = cidr.max_prefixlen
        holes = [(int(e.network_address), e.prefixlen) for e in ipaddress.collapse_addresses(inside)]  # type: ignore[arg-type]
        out: list[tuple[int, int]] = []
        _complement(int(cidr.network_address), cidr.prefixlen, bits, holes, 0, len(holes), out)
        make = ipaddress.IPv4Network if version == 4 else ipaddress.IPv6Network
        return [make((address, length)) for address, length in out]

    def contains(self, ip: Address) -> bool:
        if ip.version != self.cidr.version:
            return False
        return ip in self.cidr and not any(ip in e for e in self.excepts if e.version == ip.version)


def _complement(
    address: int, length: int, bits: int, holes: list[tuple[int, int]], lo: int, hi: int, out: list[tuple[int, int]]
) -> None:
    """Append to ``out`` the prefix (``address``/``length``) minus ``holes[lo:hi]``: sorted,
    disjoint prefixes, each inside it, as the fewest prefixes, in address order."""
    if lo == hi:
        out.append((address, length))
        return
    if holes[lo][1] == length:  # the hole is the whole prefix (the only one: they are disjoint)
        return
    upper = address | (1 << (bits - length - 1))  # the upper half's first address
    mid = bisect.bisect_left(holes, (upper, 0), lo, hi)
    _complement(address, length + 1, bits, holes, lo, mid, out)
    _complement(upper, length + 1, bits, holes, mid, hi, out)


@dataclass(frozen=True)
class Peer:
    selector: PeerSelector | None = None
    block: IPBlock | None = None


@dataclass(frozen=True)
class Port:
    protocol: str  # TCP | UDP | SCTP
    port: int | str | None = None  # number, a named port, or None: every port
    end_port: int | None = None


@dataclass(frozen=True)
class Rule:
    """One ingress or egress rule.  ``peers`` None: every peer (``from``/``to`` absent or
    empty); ``ports`` None: every port and protocol."""

    peers: tuple[Peer, ...] | None
    ports: tuple[Port, ...] | None


@dataclass(frozen=True)
class Policy:
    namespace: str
    name: str
    pod_selector: Selector
    ingress: tuple[Rule, ...] | None  # None: not an Ingress policy
    egress: tuple[Rule, ...] | None  # None: not an Egress policy

    @property
    def key(self) -> PodKey:
        return (self.namespace, self.name)

    def selects(self, pod: Pod) -> bool:
        return pod.namespace == self.namespace and self.pod_selector.matches(pod.labels)

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> Policy:
        meta, spec = obj["metadata"], obj["spec"]
        types = spec.get("policyTypes") or ["Ingress"]
        ns = meta["namespace"]
        return cls(
            namespace=ns,
            name=meta["name"],
            pod_selector=Selector.parse(spec.get("podSelector")),
            ingress=_rules(spec.get("ingress") or [], "from", ns) if "Ingress" in types else None,
            egress=_rules(spec.get("egress") or [], "to", ns) if "Egress" in types else None,
        )


def _rules(raw: list[Mapping[str, Any]], field: str, namespace: str) -> tuple[Rule, ...]:
    out = []
    for r in raw:
        peers = tuple(_peer(p, namespace) for p in r.get(field) or ())
        ports = tuple(
            Port(p.get("protocol", "TCP"), p.get("port"), p.get("endPort")) for p in r.get("ports") or ()
        )
        out.append(Rule(peers or None, ports or None))
    return tuple(out)


def _peer(raw: Mapping[str, Any], namespace: str) -> Peer:
    if "ipBlock" in raw:
        b = raw["ipBlock"]
        return Peer(
            block=IPBlock(  # read as validation read it (leading zeros of IPv4 octets, as the API server)
                cidr(b["cidr"], "ipBlock.cidr"),
                tuple(cidr(e, "ipBlock.except") for e in b.get("except") or ()),
            )
        )
    pods = Selector.parse(raw.get("podSelector"))
    if "namespaceSelector" in raw:
        return Peer(PeerSelector(pods, None, Selector.parse(raw["namespaceSelector"])))
    return Peer(PeerSelector(pods, namespace, None))


@dataclass(frozen=True)
class NamedPort:
    name: str
    port: int
    protocol: str


@dataclass(frozen=True)
class Pod:
    """A pod anywhere in the cluster, as its record in etcd describes it.

    ``ips`` are its addresses as ``status.podIPs`` lists them (the primary first; at most one
    of each family, as Kubernetes allows): a selector that matches the pod matches every one
    of them, an ipBlock only those of its own family."""

    namespace: str
    name: str
    node: str
    ips: tuple[Address, ...]
    labels: Mapping[str, str]
    ports: tuple[NamedPort, ...] = ()
    # Its record's creationTimestamp (RFC 3339 UTC, to the second: ordered as text; "" none):
    # of two pods of other nodes claiming one address the newer names it (PolicyEngine.by_ip),
    # as their node's tables give it to the newer endpoint file's pod.
    created: str = ""

    @property
    def key(self) -> PodKey:
        return (self.namespace, self.name)

    @property
    def ip(self) -> Address | None:
        """The primary address (``status.podIP``)."""
        return self.ips[0] if self.ips else None

    def address(self, version: int) -> Address | None:
        """Its address of IP ``version``, if it has one."""
        return next((ip for ip in self.ips if ip.version == version), None)

    def named_port(self, name: str, protocol: str) -> int | None:
        for p in self.ports:
            if p.name == name and p.protocol == protocol:
                return p.port
        return None

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> Pod:
        meta, spec, status = obj["metadata"], obj["spec"], obj.get("status") or {}
        ips: list[Address] = []
        for entry in status.get("podIPs") or ():
            addr = ipaddress.ip_address(entry["ip"])
            if all(a.version != addr.version for a in ips):  # one per family (the first)
                ips.append(addr)
        ports = tuple(
            NamedPort(p["name"], p["containerPort"], p.get("protocol", "TCP"))
            for c in spec.get("containers") or ()
            for p in c.get("ports") or ()
            if "name" in p
        )
        created = meta.get("creationTimestamp")
        return cls(meta["namespace"], meta["name"], spec["nodeName"], tuple(ips), dict(meta.get("labels") or {}), ports,
                   created if isinstance(created, str) else "")


@dataclass(frozen=True)
class LocalPort:
    """Where a pod of this node is attached: the host side of its veth and its bridge."""

    interface: str  # host-side veth
    mac: str  # its MAC: an address the bridge delivers to the host (a local FDB entry)
    bridge: str
    # When agentd-cni attached it (its endpoint file's mtime, ns): of two local pods with one
    # address the newer has it (PolicyEngine.conflicts)
    since: int = 0
    # The MAC of the pod's own interface: the only source MAC taken from this port ("":
    # unknown, not checked -- unless ``mac_refused``)
    pod_mac: str = ""
    # Its endpoint file names no MAC and the one read from its interface was refused (a group
    # address, the bridge's, another port's: agentd/policy/podmacs.py): no source MAC is
    # taken from this port, every frame is dropped
    mac_refused: bool = False


def namespace_labels(name: str, labels: Labels | None) -> dict[str, str]:
    """A namespace's labels: its object's, plus the name label every namespace carries."""
    return {**(labels or {}), NAMESPACE_NAME_LABEL: name}


CONTAINER_ID = podres.CONTAINER_ID
INTERFACE = podres.INTERFACE
