"""Flow records and the filters over them, as values.  Pure: no kernel, no clock.

A :class:`Flow` is one thing the kernel told the agent about traffic of the node's pods:

* ``new``: conntrack confirmed a connection (its first packet passed every hook: forwarded);
* ``end``: conntrack destroyed it (closed or timed out), with its bytes, packets and duration;
* ``drop``: a drop rule logged a packet (NFLOG), with the reason the rule stands for.

Each end is an :class:`Peer`: the address and port, and where known the pod (``ns/name``,
labels, node) or the Service whose virtual IP it was.  Addresses are text, so IPv4 and IPv6
records are the same values.  :class:`FlowFilter` is what ``agentd flows`` and ``GET /flows``
select with (like ``hubble observe``): every given criterion must hold; ``pod``, ``namespace``,
``label``, ``port`` and ``ip`` hold when either end matches, ``from_*`` / ``to_*`` for one end.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

EVENTS = ("new", "end", "drop")
VERDICTS = ("forwarded", "dropped")
# Why a packet was dropped (a bounded set: metrics are labelled with it).
REASONS = {
    "policy": "denied by NetworkPolicy",
    "spoofed": "source address is not the pod's own",
    "spoofed-mac": "source MAC, ARP sender MAC or neighbour discovery link-layer option is not the pod's own",
    "spoofed-arp": "ARP sender address is not the pod's own",
    "spoofed-nd": "neighbour advertisement's target address is not the pod's own",
    "ra-guard": "router advertisement or redirect from a pod (pods are no routers)",
    "vlan-tagged": "a VLAN-tagged frame from a pod (pods send no tagged frames)",
    "isolated": "broadcast, multicast or IPv6 (not neighbour discovery) crossing the bridge to or from an isolated pod "
                "unrouted, so unjudged by its policies (dropped)",
    "other-family": "a pod's packet of an IP family the cluster does not run (nothing would judge it)",
    "no-endpoints": "Service has no endpoints (refused)",
    "no-local-endpoints": "Service has no endpoints on this node (traffic policy Local)",
    "no-service-port": "no Service has that port of the cluster IP (refused)",
    "no-service": "no Service has that address of the service range (dropped)",
    "no-route": "no route to the destination (the kernel drops it)",
    "unknown": "a drop rule the agent does not know (its log prefix)",  # the recorder's word for the rest
}
# The drops whose record names who sent the packet (``sender``: the pod on the bridge port it came in on).
SENDER_REASONS = frozenset({"spoofed", "spoofed-mac", "spoofed-arp", "spoofed-nd", "ra-guard", "vlan-tagged", "isolated",
                            "other-family"})
ARP = 0x0806  # not an IP protocol: its ether type, for the ARP packets the bridge drops (spoofed-arp)
PROTOCOLS = {1: "ICMP", 6: "TCP", 17: "UDP", 58: "ICMPv6", 132: "SCTP", ARP: "ARP"}
# Those whose records' ends hold ports (ICMP's hold its type and code: no port filter matches them).
PORTED = frozenset({"TCP", "UDP", "SCTP"})


#: Bytes of a pod's labels one end of a record carries (keys and values, about as JSON has
#: them): the labels past them are left out, in the order the pod has them, and the end says
#: how many (``labels_dropped``).  Kubernetes caps no pod's labels in all: a pod of a thousand
#: labels made records of a MB, more than a gathering node reads as one line.
LABELS_MAX = 16 << 10


def record_labels(labels: Mapping[str, str]) -> tuple[dict[str, str], int]:
    """The labels a record carries of ``labels`` (at most :data:`LABELS_MAX` bytes), and how
    many it leaves out."""
    out: dict[str, str] = {}
    size = 0
    for key, value in labels.items():
        size += len(key) + len(value) + 8  # "key": "value", as JSON has it
        if size > LABELS_MAX:
            return out, len(labels) - len(out)
        out[key] = value
    return out, 0


def _pod_json(ident: Identity) -> dict[str, Any]:
    labels, dropped = record_labels(ident.labels)
    out = {"pod": ident.pod, "namespace": ident.namespace, "node": ident.node, "labels": labels}
    if dropped:
        out["labels_dropped"] = dropped
    return out


def protocol_name(number: int) -> str:
    """An IP protocol's name (or number)."""
    name = PROTOCOLS.get(number)
    return name if name is not None else str(number)


def ethertype_name(number: int) -> str:
    """The EtherType of a logged frame that is no IP nor ARP packet (no addresses), in hex --
    whatever its value: an 802.3 frame's is the kernel's ETH_P_802_3 (1) or ETH_P_802_2 (4),
    no IP protocol (not ICMP)."""
    return f"0x{number:04x}"


@dataclass(frozen=True, slots=True)
class Identity:
    """What is known of an address: a pod anywhere in the cluster (shared by every record of
    it, so a ring of many records of few pods costs little more than the records)."""

    pod: str  # "namespace/name"
    node: str | None
    labels: Mapping[str, str]
    local: bool  # a pod of this node

    @property
    def namespace(self) -> str:
        return self.pod.partition("/")[0]


@dataclass(frozen=True, slots=True)
class Peer:
    ip: str
    port: int = 0  # ICMP: the type (source) and code (destination)
    identity: Identity | None = None

    def json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ip": self.ip, "port": self.port}
        ident = self.identity
        if ident is not None:
            out.update(_pod_json(ident))
        return out


@dataclass(slots=True)
class Flow:
    time: float
    node: str
    event: str  # new | end | drop
    protocol: str
    src: Peer
    dst: Peer
    direction: str  # egress (from a pod of this node), ingress (to one), local (both ends here), other
    verdict: str = "forwarded"
    reason: str | None = None  # one of REASONS for drops
    policies: tuple[str, ...] = ()  # the policies isolating the pod that denied it ("ns/name")
    default_deny: bool = False  # those policies have no rule in that direction at all
    service: str | None = None  # "ns/name" when the destination was a virtual IP or node port
    # The address and port the client used (VIP, node address): set wherever the connection was
    # translated -- a Service's, named or not, or another translation's (portmap's hostPort).
    service_ip: str | None = None
    service_port: int = 0
    # Translated to an address a Service could have (the Services' ranges, one a snapshot of them
    # knew) with no Service known of it (deleted since): shown as a Service, name null.
    service_unnamed: bool = False
    bytes_sent: int | None = None  # end: original direction (from src), reply direction
    bytes_received: int | None = None
    packets_sent: int | None = None
    packets_received: int | None = None
    duration: float | None = None
    suppressed: int = 0  # drops like this one the agent folded since the last record of them
    sender: Identity | None = None  # spoofed (any spoofed-* too): the pod whose veth it came in on (src names whom it pretends to be)
    sender_interface: str | None = None  # spoofed: that veth (the node's side)
    seq: int = 0  # the ring's number for it
    # When the agent took it in, where that says more than ``time`` of where it is in the ring
    # (a recorded start keeps its SYN's time however late its answer came): not shown.
    received: float | None = field(default=None, compare=False, repr=False)

    def json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seq": self.seq, "time": round(self.time, 6), "node": self.node, "event": self.event,
            "verdict": self.verdict, "protocol": self.protocol, "direction": self.direction,
            "src": self.src.json(), "dst": self.dst.json(),
        }  # fmt: skip
        if self.reason is not None:
            out["reason"] = self.reason
            out["reason_text"] = REASONS.get(self.reason, self.reason)
            if self.reason == "policy":
                out["policies"] = list(self.policies)
                out["default_deny"] = self.default_deny
        if self.service is not None or self.service_unnamed:  # name null: a Service's address, no Service known
            out["service"] = {"name": self.service, "ip": self.service_ip, "port": self.service_port}
        if self.event == "end":
            out.update(bytes_sent=self.bytes_sent, bytes_received=self.bytes_received,
                       packets_sent=self.packets_sent, packets_received=self.packets_received,
                       duration=None if self.duration is None else round(self.duration, 6))
        if self.suppressed:
            out["suppressed"] = self.suppressed
        if self.sender_interface is not None:
            out["sender"] = {"interface": self.sender_interface}
            if self.sender is not None:
                s = self.sender
                out["sender"].update(_pod_json(s))
        return out


def direction_of(src: Identity | None, dst: Identity | None) -> str:
    s, d = bool(src and src.local), bool(dst and dst.local)
    return "local" if s and d else "egress" if s else "ingress" if d else "other"


# ------------------------------------------------------------------ filters


class FilterError(ValueError):
    """A filter that cannot be understood (one line naming it)."""


_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")  # a label's name or value
_LABEL_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # its optional DNS prefix

_KEYS = ("pod", "from_pod", "to_pod", "namespace", "label", "verdict", "protocol", "port", "node", "ip",
         "event", "reason", "service")


@dataclass(frozen=True)
class FlowFilter:
    pod: tuple[str, ...] = ()  # "ns/name", either end; several: any of them
    from_pod: tuple[str, ...] = ()
    to_pod: tuple[str, ...] = ()
    namespace: tuple[str, ...] = ()  # either end
    label: tuple[tuple[str, str | None], ...] = ()  # every one on the same end; (key, None): key exists
    verdict: tuple[str, ...] = ()
    protocol: tuple[str, ...] = ()  # upper case
    port: tuple[int, ...] = ()  # either end's port (TCP, UDP, SCTP), or the Service's
    node: tuple[str, ...] = ()
    ip: tuple[str, ...] = ()  # either end, or the Service's address
    event: tuple[str, ...] = ()
    reason: tuple[str, ...] = ()
    service: tuple[str, ...] = ()

    @classmethod
    def parse(cls, items: Iterable[tuple[str, str]]) -> FlowFilter:
        """From ``(key, value)`` pairs (query parameters, CLI options); a key may repeat."""
        got: dict[str, list[Any]] = {}
        for key, value in items:
            key = key.replace("-", "_")
            if key not in _KEYS:
                raise FilterError(f"unknown filter {key!r} (filters: {', '.join(k.replace('_', '-') for k in _KEYS)})")
            value = value.strip()
            if not value:
                raise FilterError(f"filter {key.replace('_', '-')}: empty value")
            # Labels as a selector writes them: "app=web,tier=db" is two, both on one end.
            for part in value.split(",") if key == "label" else (value,):
                got.setdefault(key, []).append(_value(key, part.strip()))
        return cls(**{k: tuple(v) for k, v in got.items()})

    def pairs(self) -> list[tuple[str, str]]:
        """Back to ``(key, value)`` pairs (to pass the filter on to another node)."""
        out = []
        for key in _KEYS:
            for v in getattr(self, key):
                if key == "label":
                    v = v[0] if v[1] is None else f"{v[0]}={v[1]}"
                out.append((key.replace("_", "-"), str(v)))
        return out

    def matches(self, f: Flow) -> bool:
        ends = (f.src, f.dst)
        if self.verdict and f.verdict not in self.verdict:
            return False
        if self.event and f.event not in self.event:
            return False
        if self.protocol and f.protocol not in self.protocol:
            return False
        if self.node and f.node not in self.node:
            return False
        if self.reason and f.reason not in self.reason:
            return False
        if self.service and f.service not in self.service:
            return False
        sender = f.sender  # a spoofed packet's sender is one of its ends too
        if self.pod and not (any(e.identity and e.identity.pod in self.pod for e in ends)
                             or (sender and sender.pod in self.pod)):  # fmt: skip
            return False
        if self.from_pod and not ((f.src.identity and f.src.identity.pod in self.from_pod)
                                  or (sender and sender.pod in self.from_pod)):  # fmt: skip
            return False
        if self.to_pod and not (f.dst.identity and f.dst.identity.pod in self.to_pod):
            return False
        if self.namespace and not (any(e.identity and e.identity.namespace in self.namespace for e in ends)
                                   or (sender and sender.namespace in self.namespace)):  # fmt: skip
            return False
        if self.label and not (any(e.identity and _labels_match(e.identity.labels, self.label) for e in ends)
                               or (sender and _labels_match(sender.labels, self.label))):  # fmt: skip
            return False
        if self.port and not ((f.protocol in PORTED and (f.src.port in self.port or f.dst.port in self.port))
                              or (f.service_ip is not None and f.service_port in self.port)):  # fmt: skip
            return False
        if self.ip and not (f.src.ip in self.ip or f.dst.ip in self.ip or f.service_ip in self.ip):
            return False
        return True


def _labels_match(labels: Mapping[str, str], wanted: tuple[tuple[str, str | None], ...]) -> bool:
    return all(k in labels and (v is None or labels[k] == v) for k, v in wanted)


def _value(key: str, value: str) -> Any:
    if key in ("pod", "from_pod", "to_pod", "service"):  # records name them "ns/name"
        ns, sep, name = value.partition("/")
        if not sep or not ns or not name:
            raise FilterError(f"filter {key.replace('_', '-')}: expected NAMESPACE/NAME, got {value!r}")
        return value
    if key == "label":
        k, sep, v = value.partition("=")
        prefix, slash, name = k.rpartition("/")
        # Kubernetes' label syntax: anything else (app!=web, app==web) could never match,
        # and would show nothing without saying why.
        if (not _LABEL_NAME.fullmatch(name) or (slash and not _LABEL_PREFIX.fullmatch(prefix))
                or (v and not _LABEL_NAME.fullmatch(v))):  # fmt: skip
            raise FilterError(f"filter label: expected KEY or KEY=VALUE (label syntax), got {value!r}")
        return (k, v if sep else None)
    # Verdicts, events and reasons in any case, as protocols (hubble's --verdict DROPPED).
    if key == "verdict":
        if value.lower() not in VERDICTS:
            raise FilterError(f"filter verdict: {value!r} is not one of {', '.join(VERDICTS)}")
        return value.lower()
    if key == "event":
        if value.lower() not in EVENTS:
            raise FilterError(f"filter event: {value!r} is not one of {', '.join(EVENTS)}")
        return value.lower()
    if key == "reason":
        if value.lower() not in REASONS:
            raise FilterError(f"filter reason: {value!r} is not one of {', '.join(REASONS)}")
        return value.lower()
    if key == "protocol":
        named = {name.upper(): name for name in PROTOCOLS.values()}.get(value.upper())
        if named is None:
            raise FilterError(f"filter protocol: {value!r} is not one of {', '.join(PROTOCOLS.values())}")
        return named
    if key == "port":
        try:
            port = int(value)
        except ValueError:
            raise FilterError(f"filter port: {value!r} is not a number") from None
        if not 0 <= port <= 65535:
            raise FilterError(f"filter port: {port} is out of range 0..65535")
        return port
    if key == "ip":
        from ipaddress import ip_address

        if "%" in value:  # records' addresses have none: it would match nothing
            raise FilterError(f"filter ip: {value!r} has a zone; give the address without it")
        try:
            return str(ip_address(value))
        except ValueError:
            raise FilterError(f"filter ip: {value!r} is not an address") from None
    return value
