"""The route model of the route programmer: ``Route``, its parsing and canonical forms, and
the small result types.  Kept apart from agentd.kernel.routing so that file holds the programmer.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import NamedTuple

from agentd.kernel import netlink as nl

RTPROT_AGENTD = 143
"""The route protocol number agentd's routes carry (``ip route show proto 143``)."""

ROUTE_KINDS = {"unicast": nl.RTN_UNICAST, "blackhole": nl.RTN_BLACKHOLE, "unreachable": nl.RTN_UNREACHABLE}
KIND_OF_RTN = {rtn: kind for kind, rtn in ROUTE_KINDS.items()}
AF_INET, AF_INET6 = socket.AF_INET, socket.AF_INET6
# The kernel's metric when none is given: IPv4 priority 0, IPv6 IP6_RT_PRIO_USER (1024).
DEFAULT_METRIC = {AF_INET: 0, AF_INET6: 1024}
ZERO_ADDRESS = {AF_INET: bytes(4), AF_INET6: bytes(16)}
PREFIX_LENGTHS = {AF_INET: {str(n): n for n in range(33)}, AF_INET6: {str(n): n for n in range(129)}}
PROTOCOL_NAMES = {
    nl.RTPROT_KERNEL: "kernel", nl.RTPROT_BOOT: "boot", nl.RTPROT_STATIC: "static", 9: "ra",
    nl.RTPROT_ZEBRA: "zebra", nl.RTPROT_BIRD: "bird", 16: "dhcp", 42: "babel", 186: "bgp",
    187: "isis", 188: "ospf", 189: "rip",
}
RTM_F_CLONED = 0x200

ADD, REPLACE, DELETE = "add", "replace", "delete"
BESIDE = "add beside"  # IPv6: a route added beside ours at its key (agentd.kernel.route_plan.needs_beside)
REQUEST_FLAGS = {
    ADD: nl.NLM_F_REQUEST | nl.NLM_F_CREATE | nl.NLM_F_EXCL,
    BESIDE: nl.NLM_F_REQUEST | nl.NLM_F_CREATE,
    REPLACE: nl.NLM_F_REQUEST | nl.NLM_F_REPLACE,
    DELETE: nl.NLM_F_REQUEST,
}


class InvalidRoute(ValueError):
    """A Route (or destination) that cannot be programmed; the message says which field."""


_address_cache: dict[str, tuple[int, str]] = {}  # next hops repeat: parse each once


def parse_address(text: object, what: str) -> tuple[int, str]:
    """``(family, canonical text)``; glibc's inet_pton accepts only canonical IPv4 text."""
    cached = _address_cache.get(text) if type(text) is str else None
    if cached is not None:
        return cached
    if not isinstance(text, str):
        raise InvalidRoute(f"{what} must be a string, got {text!r}")
    family = AF_INET6 if ":" in text else AF_INET
    try:
        raw = socket.inet_pton(family, text)
    except OSError:
        raise InvalidRoute(f"{what} is not an IP address: {text!r}") from None
    result = (family, text if family == AF_INET else socket.inet_ntop(family, raw))
    if len(_address_cache) > 4096:
        _address_cache.clear()
    _address_cache[text] = result
    return result


def parse_prefix(text: object) -> tuple[int, str]:
    """``"10.244.1.0/24"`` -> ``(AF_INET, "10.244.1.0/24")``; a bare address is a host route."""
    if not isinstance(text, str):
        raise InvalidRoute(f"route dst must be a string like '10.244.1.0/24', got {text!r}")
    addr, slash, plen_text = text.partition("/")
    family = AF_INET6 if ":" in addr else AF_INET
    try:
        raw = socket.inet_pton(family, addr)
    except OSError:
        raise InvalidRoute(f"route dst is not an IP prefix: {text!r}") from None
    bits = len(raw) * 8
    plen = PREFIX_LENGTHS[family].get(plen_text) if slash else bits
    if plen is None:
        raise InvalidRoute(f"route dst has a bad prefix length: {text!r}")
    if plen < bits and int.from_bytes(raw, "big") & ((1 << (bits - plen)) - 1):
        raise InvalidRoute(f"route dst has host bits set: {text!r}")
    if family == AF_INET6:
        addr = socket.inet_ntop(family, raw)
    return family, text if slash and family == AF_INET else f"{addr}/{plen}"


def canonical_dst(dst: str) -> str:
    """The form Route uses as its key: ``"2001:DB8:0::/64"`` -> ``"2001:db8::/64"``."""
    return parse_prefix(dst)[1]


def _link_local(text: str) -> bool:
    """Is this canonical IPv6 address in fe80::/10?"""
    head = text.split(":", 1)[0]
    return len(head) == 4 and head[:3] in ("fe8", "fe9", "fea", "feb")


@dataclass(frozen=True, slots=True)
class Route:
    """One kernel route as agentd wants it.  Equality is "the same route" when reconciling.

    ``dst`` and addresses are kept in canonical text form (a bare address is a host route);
    ``metric`` None is the kernel default (IPv4 0, IPv6 1024), and those defaults given
    explicitly become None.  ``dev`` None lets the kernel pick the interface from the gateway.
    """

    dst: str
    gateway: str | None = None
    dev: str | None = None
    onlink: bool = False
    kind: str = "unicast"
    metric: int | None = None
    mtu: int | None = None
    src: str | None = None

    def __post_init__(self) -> None:
        family, dst = parse_prefix(self.dst)
        if dst is not self.dst:
            object.__setattr__(self, "dst", dst)
        for name in ("gateway", "src"):
            value = getattr(self, name)
            if value is not None:
                vfamily, text = parse_address(value, f"route {name}")
                if vfamily != family:
                    raise InvalidRoute(f"route {name} {value!r} is not in the family of dst {dst!r}")
                if text is not value:
                    object.__setattr__(self, name, text)
        dev, kind = self.dev, self.kind
        if dev is not None and (type(dev) is not str or not 0 < len(dev) <= 15):
            raise InvalidRoute(f"route dev must be an interface name of 1-15 characters, got {dev!r}")
        if self.onlink is not False and self.onlink is not True:
            raise InvalidRoute(f"route onlink must be a bool, got {self.onlink!r}")
        if kind == "unicast":
            if self.gateway is None and dev is None:
                raise InvalidRoute(f"unicast route {dst} needs a gateway or a dev")
            if self.onlink and (self.gateway is None or dev is None):
                raise InvalidRoute(f"onlink route {dst} needs both gateway and dev")
            if dev is None and family == AF_INET6 and self.gateway is not None and _link_local(self.gateway):
                # Linux refuses it: "Egress device not specified" (EINVAL).
                raise InvalidRoute(f"route {dst} via link-local {self.gateway} needs a dev")
        elif kind not in ROUTE_KINDS:
            raise InvalidRoute(f"route kind must be one of {sorted(ROUTE_KINDS)}, got {kind!r}")
        elif self.gateway is not None or dev is not None or self.onlink:
            raise InvalidRoute(f"{kind} route {dst} takes no gateway, dev or onlink")
        metric, mtu = self.metric, self.mtu
        if metric is not None:
            if type(metric) is not int or not 0 <= metric <= 0xFFFFFFFF:
                raise InvalidRoute(f"route metric must be an integer 0..4294967295, got {metric!r}")
            if metric == DEFAULT_METRIC[family] or (family == AF_INET6 and metric == 0):
                object.__setattr__(self, "metric", None)  # the kernel files these as its default
        if mtu is not None:
            if type(mtu) is not int or not 0 <= mtu <= 0xFFFFFFFF:
                raise InvalidRoute(f"route mtu must be an integer 0..4294967295, got {mtu!r}")
            if mtu == 0:
                object.__setattr__(self, "mtu", None)

    @property
    def family(self) -> int:
        return AF_INET6 if ":" in self.dst else AF_INET


gateway_text: dict[bytes, str] = {}  # kernel next-hop bytes -> canonical text
new_route = object.__new__
set_field = object.__setattr__


def kernel_route(dst: str, gateway: str | None, dev: str | None, onlink: bool, kind: str,
                  metric: int | None, mtu: int | None, src: str | None) -> Route:
    """A Route from values the kernel gave (already canonical): skips validation, which a
    100k-route dump would otherwise pay 100k times."""
    route = new_route(Route)
    set_field(route, "dst", dst)
    set_field(route, "gateway", gateway)
    set_field(route, "dev", dev)
    set_field(route, "onlink", onlink)
    set_field(route, "kind", kind)
    set_field(route, "metric", metric)
    set_field(route, "mtu", mtu)
    set_field(route, "src", src)
    return route


def kernel_metric(route: Route) -> int:
    """The metric the kernel files the route under (its identity, with dst and table)."""
    if route.metric is not None:
        return route.metric
    return 1024 if ":" in route.dst else 0


def same_route(want: Route, have: Route) -> bool:
    """Does the kernel route ``have`` already do what ``want`` asks?  A desired route with no
    dev accepts whatever interface the kernel resolved the gateway to."""
    return want is have or (
        want.gateway == have.gateway
        and want.kind == have.kind
        and want.metric == have.metric
        and want.onlink == have.onlink
        and want.mtu == have.mtu
        and want.src == have.src
        and (want.dev is None or want.dev == have.dev)
    )


class Stray(NamedTuple):
    """A route of ours the Route model does not hold as the one route for its destination
    (a second metric, multipath, TOS, an IPv6 source prefix...): always deleted, by exactly
    these fields.  ``text`` is its destination.

    With a ``gateway`` it is one next hop of an IPv6 multipath route (``dev`` its device, if
    any): IPv6 keeps each next hop as a route of its own, with its own protocol, and deletes
    just the one named by gateway and device, and only if it is ours; without one, a delete
    would take the whole multipath route, other daemons' next hops too."""

    family: int
    dst: bytes
    dst_len: int
    tos: int
    priority: int | None
    text: str
    src_len: int = 0  # IPv6 source-specific ("from") routes: a key of their own beside (dst, metric)
    src: bytes | None = None
    gateway: str | None = None
    dev: str | None = None


class Group(NamedTuple):
    """An IPv6 multipath route as the kernel reports it: one message for routes sharing
    (dst, metric), with the first one's protocol and attributes.  Behind a first next hop of
    ours, the others may be ours or another daemon's (BIRD's, an operator's ``ip -6 route
    append``): nobody can tell.  ``hops``: per next hop, the Route it is (None if the Route
    model cannot say it) and the Stray that deletes just it.  (Another daemon's multipath
    route deleted whole is reported so too: with their protocol, our next hops among its.)"""

    hops: tuple[tuple[Route | None, Stray], ...]


class Unreadable(NamedTuple):
    """An IPv6 multipath route whose next hops do not decode: which are ours nobody can say,
    and a delete naming no gateway would take them all, another daemon's and our desired one
    too.  It is never deleted; a route of ours filed under its (dst, metric) is checked again."""

    text: str  # its destination
    priority: int  # its metric


def hop_of(route: Route) -> Stray:
    """The Stray that deletes just this next hop of ours (an IPv6 gateway route)."""
    return stray_of(route)._replace(gateway=route.gateway, dev=route.dev)


NO_GATEWAY = "::"  # a Stray's gateway for an IPv6 route of ours without one: deleted as that


def stray_of_own(route: Route) -> Stray:
    """The Stray that deletes just this route of ours: an IPv6 gateway route by its next hop,
    as another daemon's next hop may be appended to it; an IPv6 route without a gateway by
    gateway ``::`` (and its device), as one key may hold it and a gateway route of ours
    (ip6_route_del takes the first route of ours at the key unless the delete names a gateway,
    and compares that with the route's, ``::`` for one without); an IPv4 route by its key."""
    if ":" not in route.dst:
        return stray_of(route)
    if route.gateway is not None:
        return hop_of(route)
    return stray_of(route)._replace(gateway=NO_GATEWAY, dev=route.dev)


def real_gateway(stray: Stray) -> str | None:
    """A Stray's next hop's gateway (None for a route of ours deleted as having none)."""
    gateway = stray.gateway
    return None if gateway == NO_GATEWAY else gateway


def takes(gone: Route, current: Route) -> bool:
    """Did our route ``gone`` going (deleted by us, or reported deleted) take ``current``, our
    route filed under the same (dst, metric)?  IPv4 holds one route per key; IPv6 one per next
    hop, and one key may hold a gateway route and one without: our delete names the gateway
    (``::`` for none) and takes just that one."""
    if ":" not in gone.dst:
        return True
    if gone.gateway is None:
        return current.gateway is None
    return current.gateway == gone.gateway and (gone.dev is None or current.dev is None or gone.dev == current.dev)


def stray_of(route: Route) -> Stray:
    addr, _, plen = route.dst.partition("/")
    family = AF_INET6 if ":" in addr else AF_INET
    metric = route.metric if route.metric is not None else (1024 if family == AF_INET6 else None)
    return Stray(family, socket.inet_pton(family, addr), int(plen), 0, metric, route.dst)


def stray_of_message(msg: nl.RouteMessage) -> Stray:
    family = msg.family  # IPv4 or IPv6: callers filter the rest out
    dst = msg.dst or ZERO_ADDRESS[family]
    src = (msg.src or ZERO_ADDRESS[family]) if msg.src_len else None
    return Stray(family, dst, msg.dst_len, msg.tos, msg.priority, f"{socket.inet_ntop(family, dst)}/{msg.dst_len}",
                 msg.src_len, src)


@dataclass(frozen=True, slots=True)
class SyncResult:
    """What one reconcile did.  ``failed``/``conflicts`` are ``(dst, reason)`` pairs."""

    added: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()
    conflicts: tuple[tuple[str, str], ...] = ()
    seconds: float = 0.0
    full: bool = False

    @property
    def ok(self) -> bool:
        return not self.failed and not self.conflicts


@dataclass(slots=True)
class RouteCounters:
    """Monotonic counters for /metrics."""

    reconciles: int = 0
    full_resyncs: int = 0
    routes_added: int = 0
    routes_replaced: int = 0
    routes_removed: int = 0
    routes_restored: int = 0  # own desired routes put back after someone else removed them
    errors: int = 0
    monitor_overruns: int = 0


@dataclass(slots=True)
class Outcome:
    added: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


class Unresolved(Exception):
    pass
