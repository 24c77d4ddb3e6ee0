"""From BGP best paths to kernel routes: how each peer is reached, and the routes that follow.

For every peer node the agent makes a :class:`PeerPlan`: the backend that carries
traffic to it and why (host-gw needs the peer on this node's L2 segment; with
``encap = "cross-subnet"`` on-link peers are reached directly and the rest through the
tunnel).  :func:`plan_peer` decides, :func:`route_for` turns a best path into a kernel
route under that plan and the data path this node runs the backend on (:class:`LocalPaths`,
from agentd.dataplane.backends).  Both are pure.  The route shape belongs to the data path, one
function each in :data:`ROUTE_SHAPES`; the backends' facts come from agentd.backend_table.

Families.  A plan is per peer *and* per pod family (``version``): a dual-stack node has an
IPv4 plan and an IPv6 plan for each peer.  Its IPv6 pods go the way of its backend where the
backend carries IPv6 inner packets (host-gw, vxlan, udp in either data path; a backend
whose IPv6 pods only some data paths carry names them in ``Backend.ipv6_datapaths``); ipip
carries IPv4 only (``Backend.inner_families``), so toward such a peer IPv6 pods are routed
directly on a shared segment, else not at all (the reason says so).  Routed directly, an IPv6 pod subnet's next hop
is the peer's IPv6 underlay address where it is on-link, else the peer's IPv6 link-local
address on the shared segment: Linux has no IPv6 route through an IPv4 gateway (RTA_VIA and
IPv4 nexthop objects are refused for IPv6 routes, "IPv6 does not support RTA_VIA attribute";
RFC 8950 covers only the other direction), and every IPv6-enabled link has a link-local
address, which is what BGP unnumbered routes through.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from ipaddress import (
    IPv4Address,
    IPv4Network,
    IPv6Address,
    IPv6Network,
    ip_address,
    ip_network,
)
from typing import Any

from agentd.backend_table import BACKENDS, DATAPATHS, ENCAPSULATING
from agentd.datastore.store import NodeRecord
from agentd.kernel.netinfo import Underlay
from agentd.kernel.route_model import InvalidRoute, Route

HOST_GW = "host-gw"
ENCAP_BACKENDS = ENCAPSULATING
EXTERNAL = "kernel"  # the "backend" of a next hop outside the cluster: the kernel resolves it


@dataclass(frozen=True)
class PeerPlan:
    """How traffic to one peer node (or external next hop) is carried."""

    address: str
    backend: str  # a backend of agentd.backend_table, "kernel" (external next hop) or "none" (no route)
    reason: str
    node: str | None = None  # the node's name; None for a next hop outside the cluster
    extra: dict = field(default_factory=dict, compare=False)  # backend data (vtep mac/ip, ...)
    version: int = 4  # the pod family this plan carries
    via: str | None = None  # the next hop of direct (host-gw) routes; None: ``address``

    @property
    def routable(self) -> bool:
        return self.backend != "none"


@dataclass(frozen=True)
class LocalPaths:
    """How this node carries each backend right now: backend -> data path (DATAPATHS), and for
    the BPF data path, the underlay next hop toward each peer not on this node's segment."""

    datapaths: Mapping[str, str] = field(default_factory=dict)
    gateways: Mapping[str, str] = field(default_factory=dict)
    helpers: frozenset[str] = frozenset()  # bpf backends with a user-space worker up for user-space peers

    def datapath(self, plan: PeerPlan) -> str | None:
        if plan.backend == HOST_GW:
            return "route"
        if plan.backend == EXTERNAL:
            return EXTERNAL
        dp = self.datapaths.get(plan.backend)
        if dp == "bpf" and peer_in_userspace(plan):
            # Speak to it as it speaks: its worker reads our packets from a socket, which on a
            # software underlay (veth) would hand it our GSO super-packets and unfinished
            # checksums as they are; our own worker sends what a worker expects.
            return "userspace" if plan.backend in self.helpers else None
        return dp

    def label(self, plan: PeerPlan) -> str | None:
        """What `agentd status` shows as the peer's data path."""
        dp = self.datapath(plan)
        if dp == EXTERNAL:
            return "kernel route"
        return DATAPATHS[dp].label if dp in DATAPATHS else None


def peer_in_userspace(plan: PeerPlan) -> bool:
    """The peer's node record says it runs udp and ipip in its user-space worker (or, from an
    agent that predates the BPF data path, says nothing, which meant the same)."""
    return plan.node is not None and plan.extra.get("datapath", "userspace") != "bpf"


def direct_next_hop(node: NodeRecord, underlay: Underlay, version: int) -> str | None:
    """The next hop of a direct route to ``node``'s pods of IP ``version`` on a segment this
    node shares with it, or None when they share none: its address of that family where it is
    on-link; for IPv6 on an IPv4 segment, its link-local address (see the module doc)."""
    if version == 4:
        return str(node.address) if node.address is not None and underlay.on_link(node.address) else None
    if node.address_v6 is not None and underlay.on_link(node.address_v6):
        return str(node.address_v6)
    if node.link_local_v6 is not None and node.address is not None and underlay.on_link(node.address):
        return str(node.link_local_v6)
    return None


def _no_ipv6(plan: PeerPlan, paths: LocalPaths | None) -> str | None:
    """Why ``plan``'s backend does not carry the peer's IPv6 pods, or None if it does."""
    b = BACKENDS[plan.backend]
    if 6 not in b.inner_families:
        return f"{b.name} carries IPv4 pods only"
    if b.ipv6_datapaths is None:
        return None
    where = " or ".join(DATAPATHS[d].label for d in b.ipv6_datapaths)
    if plan.extra.get("datapath", "userspace") not in b.ipv6_datapaths:
        return f"{b.name} carries IPv6 pods in its {where} data path only, and the peer runs it in user space"
    if paths is None or paths.datapath(plan) not in b.ipv6_datapaths:
        return f"{b.name} carries IPv6 pods in its {where} data path only, and this node does not run it there"
    return None


def plan_peer(
    node: NodeRecord,
    underlay: Underlay,
    *,
    own_backend: str,
    encap: str,
    available: Callable[[str], str | None] = lambda b: None,
    version: int = 4,
    paths: LocalPaths | None = None,
) -> PeerPlan:
    """Decide how to reach ``node``'s pods of IP ``version``.

    The *peer's* backend says how it receives traffic, so it is the one we use toward it
    (agentd runs every backend, per peer): a host-gw peer only takes direct traffic; an
    encapsulating peer takes its own encapsulation, or direct traffic when our ``encap`` is
    cross-subnet and it shares our L2 segment.  ``available(backend)`` returns None if this
    node can run that backend, else the reason it cannot.  ``paths``: how this node carries
    each backend now (for the backends whose IPv6 pods only some data paths carry).
    """
    addr = str(node.peer_address)
    via = direct_next_hop(node, underlay, version)
    peer_backend = str(node.backend.get("type") or own_backend)

    def plan(backend: str, reason: str, extra: bool = True) -> PeerPlan:
        return PeerPlan(addr, backend, reason, node.name, dict(node.backend) if extra else {}, version,
                        via if backend == HOST_GW else None)

    if peer_backend == HOST_GW:
        if via is not None:
            return plan(HOST_GW, f"on-link via {underlay.ifname}")
        if version == 6 and node.address_v6 is None and node.link_local_v6 is None:
            return plan("none", f"peer {addr} published no IPv6 underlay or link-local address to route "
                                "its IPv6 pods through", extra=False)
        return plan(
            "none",
            f"peer {addr} is not on this node's L2 segment ({', '.join(map(str, underlay.networks))}) and uses "
            "host-gw, which needs a shared segment: use an encapsulating backend or cross-subnet",
            extra=False,
        )
    if encap == "cross-subnet" and via is not None:
        return plan(HOST_GW, f"cross-subnet: on-link via {underlay.ifname}, no encapsulation")
    if peer_backend not in BACKENDS:
        return plan("none", f"peer uses backend {peer_backend!r}, which this agent does not know", extra=False)
    no_ipv6 = _no_ipv6(plan(peer_backend, ""), paths) if version == 6 else None
    if no_ipv6 is not None:
        if via is not None:
            return plan(HOST_GW, f"{no_ipv6}: IPv6 pods routed directly, on-link via {underlay.ifname}")
        both = " and ".join(name for name in ENCAPSULATING if 6 in BACKENDS[name].inner_families)
        return plan("none", f"peer uses {peer_backend}: {no_ipv6}, and is not on this node's L2 segment: its IPv6 "
                            f"pods are unreachable from here ({both} carry both)", extra=False)
    problem = available(peer_backend)
    if problem is not None:
        return plan("none", f"peer uses {peer_backend}: {problem}", extra=False)
    why = "cross-subnet: peer on another segment" if encap == "cross-subnet" else f"peer uses {peer_backend}"
    bad = _bad_vxlan_data(node.backend, addr, underlay.family) if peer_backend == "vxlan" else None
    if bad is not None:
        return plan("none", f"peer's record: {bad}", extra=False)
    return plan(peer_backend, why)


_MAC = re.compile(r"[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}")


def _bad_vxlan_data(data: Mapping[str, Any], peer: str | None = None, family: int | None = None) -> str | None:
    """What is wrong with a VXLAN peer's published VTEP (its record is another node's word:
    one bad field must not stop the routes and tunnel entries of every other peer), or None.
    ``peer``: its underlay address, the remote of our FDB entry toward it, which must be of our
    VTEP's outer ``family`` (4 or 6; the kernel refuses another, EAFNOSUPPORT); nor does the
    kernel take an FDB entry for a multicast (broadcast) or all-zero MAC (EOPNOTSUPP)."""
    mac = data.get("vtep_mac")
    if mac is not None and not (isinstance(mac, str) and _MAC.fullmatch(mac)):
        return f"backend field 'vtep_mac' = {mac!r} is not a MAC address (aa:bb:cc:dd:ee:ff)"
    if mac is not None and (int(mac[:2], 16) & 1 or not int(mac.replace(":", ""), 16)):
        return f"backend field 'vtep_mac' = {mac!r} is not a unicast MAC address (multicast, broadcast or all zero)"
    if peer is not None and family is not None and ip_address(peer).version != family:
        return f"its underlay address {peer} is not IPv{family}, as this node's VTEP is: no VXLAN between them"
    for key, version in (("vtep_ip", 4), ("vtep_ip_v6", 6)):
        value = data.get(key)
        if value is None:
            continue
        try:
            ok = isinstance(value, str) and ip_address(value).version == version and "%" not in value
        except ValueError:
            ok = False
        if not ok:
            return f"backend field {key!r} = {value!r} is not an IPv{version} address"
    # Our FDB entry for the peer carries its VNI and port where they are not ours.
    for key, low, high in (("vni", 1, (1 << 24) - 1), ("vxlan_port", 1, 65535)):
        value = data.get(key)
        if value is not None and not (type(value) is int and low <= value <= high):
            return f"backend field {key!r} = {value!r} is not an integer {low}..{high}"
    return None


def plan_external(next_hop: str, underlay: Underlay) -> PeerPlan:
    """A next hop that is not a cluster node (a route learned from a top-of-rack router)."""
    a = ip_address(next_hop)
    if isinstance(a, IPv6Address) and a.ipv4_mapped is not None:
        return PeerPlan(next_hop, "none", "IPv4-mapped IPv6 next hop cannot be routed", version=6)
    if isinstance(a, IPv6Address) and a.is_link_local:
        # fe80::/10 is on-link on the interface it was learned on (the peer session's: the
        # underlay); Linux refuses such a gateway without a device (EINVAL).
        return PeerPlan(next_hop, HOST_GW, f"external link-local next hop on-link via {underlay.ifname}", version=6)
    if underlay.on_link(a):
        return PeerPlan(next_hop, HOST_GW, f"external next hop on-link via {underlay.ifname}", version=a.version)
    return PeerPlan(next_hop, EXTERNAL, "external next hop resolved by the kernel", version=a.version)


# ------------------------------------------------------------------ route shapes, per data path


def _direct(dst: str, plan: PeerPlan, underlay: Underlay, paths: LocalPaths) -> Route | None:
    return Route(dst=dst, gateway=plan.via or plan.address, dev=underlay.ifname)


def _external(dst: str, plan: PeerPlan, underlay: Underlay, paths: LocalPaths) -> Route | None:
    return Route(dst=dst, gateway=plan.address)


def _vxlan_device(dst: str, plan: PeerPlan, underlay: Underlay, paths: LocalPaths) -> Route | None:
    # One VTEP carries both pod families (VXLAN is L2): an IPv6 neighbour entry for the peer's
    # IPv6 VTEP address beside the IPv4 one (agentd.dataplane.backends).
    vtep_ip = plan.extra.get("vtep_ip_v6" if plan.version == 6 else "vtep_ip")
    if not vtep_ip:
        return None
    return Route(dst=dst, gateway=vtep_ip, dev=BACKENDS[plan.backend].device, onlink=True)


def _bpf(dst: str, plan: PeerPlan, underlay: Underlay, paths: LocalPaths) -> Route | None:
    """Out of the underlay device (where the egress program encapsulates) toward the next hop
    the stack routes the peer's address to, so the outer packet's link-layer header is already
    the right one; the MTU leaves room for the outer headers (the program keeps gso_size).
    An IPv6 pod subnet goes via the peer's IPv4-mapped address, onlink (Linux routes IPv6
    through IPv6 next hops only; agentd.dataplane.bpf keeps that address's neighbour entry,
    and the program gives the outer packet the real next hop's MACs).  The outer packets are
    IPv4: a peer whose record gives no IPv4 address (only an ``address_v6``) gets no route
    (InvalidRoute, which :func:`desired_routes` files as a refusal with this reason)."""
    if ip_address(plan.address).version != 4:
        raise InvalidRoute(f"peer {plan.address} has no IPv4 underlay address, which {plan.backend} in the "
                           "BPF data path carries its packets over")
    mtu = underlay.mtu - BACKENDS[plan.backend].overhead
    if plan.version == 6:
        return Route(dst=dst, gateway=f"::ffff:{plan.address}", dev=underlay.ifname, onlink=True, mtu=mtu)
    gateway = plan.address if underlay.on_link(plan.address) else paths.gateways.get(plan.address)
    if gateway is None:
        return None  # not resolved yet: agentd.dataplane.backends resolves it and asks for a recompute
    return Route(dst=dst, gateway=gateway, dev=underlay.ifname, mtu=mtu)


def _userspace(dst: str, plan: PeerPlan, underlay: Underlay, paths: LocalPaths) -> Route | None:
    return Route(dst=dst, dev=BACKENDS[plan.backend].device)  # the worker's next-hop table picks the peer


ROUTE_SHAPES: dict[str, Callable[[str, PeerPlan, Underlay, LocalPaths], Route | None]] = {
    "route": _direct,
    EXTERNAL: _external,
    "vxlan-device": _vxlan_device,
    "bpf": _bpf,
    "userspace": _userspace,
}


def route_for(dst: str, plan: PeerPlan, underlay: Underlay, paths: LocalPaths) -> Route | None:
    """The kernel route for ``dst`` under ``plan``, in the shape of the data path that carries it."""
    shape = ROUTE_SHAPES.get(paths.datapath(plan) or "")
    return shape(dst, plan, underlay, paths) if shape else None


@dataclass
class RoutePlan:
    """What the kernel should hold for a set of best paths: the routes, a row per route for
    ``GET /routes``, the plan per peer address, and the prefixes behind each next hop."""

    routes: list[Route]
    rows: list[dict[str, Any]]
    plans: dict[str, PeerPlan]  # per peer address: its plan for the node's first pod family
    next_hops: dict[str, list[str]]  # per peer address: the destinations routed by those plans
    plans_v6: dict[str, PeerPlan] = field(default_factory=dict)  # dual-stack: the IPv6 plans
    next_hops_v6: dict[str, list[str]] = field(default_factory=dict)  # dual-stack: routed by plans_v6
    # Best paths not installed because of where they lead (:func:`refusal`): a row each, as
    # ``rows`` has, with ``backend`` "refused" and the ``reason``.
    refused: list[dict[str, Any]] = field(default_factory=list)
    # Best paths through a peer that can be routed, but not yet: the data path that carries
    # them is not up here yet (a backend being brought up, a BPF next hop not resolved yet).
    # Their destinations; the agent keeps a previous run's route for them meanwhile.
    pending: list[str] = field(default_factory=list)
    # Subnets of node records not held against other nodes' routes (:func:`held_subnets`).
    untrusted: list[dict[str, str]] = field(default_factory=list)
    # Next hops of node records not taken as theirs (:func:`next_hop_owners`): a
    # ``{"node", "next_hop", "reason"}`` each.
    untrusted_next_hops: list[dict[str, str]] = field(default_factory=list)


Network = IPv4Network | IPv6Network


class HeldSubnets(Mapping[Network, str]):
    """``held`` (subnet -> node) indexed by family and prefix length, so that the subnets a
    destination overlaps are found with a look-up per length held (one, in a cluster of one
    subnet length) rather than a scan of every node's: :func:`refusal` asks it of every best
    path, so a scan made a recompute of N nodes' routes cost N^2."""

    def __init__(self, held: Mapping[Network, str]) -> None:
        self._held = dict(held)
        self._by_len: dict[tuple[int, int], dict[Network, str]] = {}
        for net, holder in self._held.items():
            self._by_len.setdefault((net.version, net.prefixlen), {})[net] = holder
        self._starts = {k: sorted((int(n.network_address), n) for n in nets) for k, nets in self._by_len.items()}

    def __getitem__(self, key: Network) -> str:
        return self._held[key]

    def __iter__(self) -> Iterator[Network]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def holding(self, dst: Network) -> Iterator[tuple[Network, str]]:
        """The subnets held that hold ``dst`` -- equal to it or shorter --, and their holders."""
        for (version, length), nets in self._by_len.items():
            if version == dst.version and length <= dst.prefixlen:
                wider = dst if length == dst.prefixlen else dst.supernet(new_prefix=length)
                if wider in nets:
                    yield wider, nets[wider]

    def overlapping(self, dst: Network) -> Iterator[tuple[Network, str]]:
        """The subnets held that overlap ``dst`` (hold it, or lie inside it), and their holders."""
        yield from self.holding(dst)
        low, high = int(dst.network_address), int(dst.broadcast_address)
        for (version, length), starts in self._starts.items():
            if version == dst.version and length > dst.prefixlen:
                i = bisect_left(starts, (low,))
                while i < len(starts) and starts[i][0] <= high:
                    net = starts[i][1]
                    yield net, self._by_len[(version, length)][net]
                    i += 1


def refusal(
    dst: Network,
    node: NodeRecord | None,
    *,
    own: Iterable[Network],
    pod_networks: Iterable[Network] | None,
    held: Mapping[Network, str],
) -> str | None:
    """Why the best path to ``dst`` through ``node`` (None: a next hop outside the cluster)
    must not be installed, or None.  A cluster node originates its pod subnets and nothing
    else (agentd announces only its leases), so what a node's next hop carries must lie in the
    cluster's pod network of its family and must not be another node's subnet (``held``:
    subnet -> node, from the node records as :func:`held_subnets` trusts them); and no next hop, external ones included, may take
    a part of this node's own subnets (``own``) -- a shorter prefix holding them, such as a
    top-of-rack router's default route, is left alone: the node's own subnet is longer.  Nor
    may a next hop outside the cluster take a part of another node's subnet: a prefix longer
    than that subnet would win the kernel's look-up for those pods over the node's own route
    (the subnet itself, as a top-of-rack router passes on another rack's routes, is taken).
    ``held`` is best a :class:`HeldSubnets` (made once for many calls)."""
    index = held if isinstance(held, HeldSubnets) else HeldSubnets(held)
    for mine in own:
        if mine.version == dst.version and dst.subnet_of(mine):  # type: ignore[arg-type]
            return f"{dst} is part of this node's own pod subnet {mine}"
    if node is None:
        for subnet, holder in index.holding(dst):
            if dst != subnet:
                return f"{dst} is part of node {holder}'s pod subnet {subnet}, announced by a next hop outside the cluster"
        return None
    if pod_networks is not None:
        pools = [n for n in pod_networks if n.version == dst.version]
        if not any(dst.subnet_of(n) for n in pools):  # type: ignore[arg-type]
            where = " or ".join(map(str, pools)) or f"no IPv{dst.version} pod network"
            return f"node {node.name} announced {dst}, outside the cluster's pod network ({where})"
    for subnet, holder in index.overlapping(dst):
        if holder != node.name:
            return f"node {node.name} announced {dst}, which overlaps node {holder}'s subnet {subnet}"
    return None


def held_subnets(
    nodes: Iterable[NodeRecord], pools: Mapping[int, tuple[Network, int | None]] | None
) -> tuple[dict[Network, str], list[dict[str, str]]]:
    """Which node holds which subnet, by the node records, for :func:`refusal`: subnet -> node
    name; and the record subnets not taken, a ``{"node", "subnet", "reason"}`` each.  A record
    is its node's own word: one naming a subnet outside the cluster's pod network of its family
    or not of the cluster's subnet length (``pools``: version -> (pod network, subnet length);
    None: not known yet, not checked) would make every node's route inside it refused; one
    naming another node's subnet would take that node's routes away.  So such a subnet is not
    held, and where records claim overlapping subnets, none of them is (the subnet leases in
    etcd have one holder each, the records may not agree)."""
    claims: list[tuple[Network, str]] = []
    untrusted: list[dict[str, str]] = []
    for n in nodes:
        for net in (n.subnet, n.subnet_v6):
            if net is None:
                continue
            pool = None if pools is None else pools.get(net.version)
            why = None
            if pools is not None and pool is None:
                why = f"the cluster has no IPv{net.version} pod network"
            elif pool is not None and not net.subnet_of(pool[0]):  # type: ignore[arg-type]
                why = f"outside the cluster's pod network {pool[0]}"
            elif pool is not None and pool[1] is not None and net.prefixlen != pool[1]:
                why = f"not a /{pool[1]}, the cluster's subnet length"
            if why is not None:
                untrusted.append({"node": n.name, "subnet": str(net), "reason": why})
            else:
                claims.append((net, n.name))
    by_net: dict[Network, list[str]] = {}
    for net, name in claims:
        by_net.setdefault(net, []).append(name)
    lengths = {(net.version, net.prefixlen) for net in by_net}
    rivals: dict[Network, set[str]] = {net: set(names) for net, names in by_net.items() if len(set(names)) > 1}
    for net, names in by_net.items():
        # Wider claims around ``net``: only at the lengths claimed (one, where pools are known).
        for version, length in lengths:
            if version == net.version and length < net.prefixlen:
                wider = net.supernet(new_prefix=length)
                if wider in by_net:
                    rivals.setdefault(net, set(names)).update(by_net[wider])
                    rivals.setdefault(wider, set(by_net[wider])).update(names)
    held: dict[Network, str] = {}
    for net, name in claims:
        others = sorted(rivals.get(net, set()) - {name})
        if others:
            untrusted.append({"node": name, "subnet": str(net),
                              "reason": f"overlaps the subnet the record of {', '.join(others)} names"})
        else:
            held[net] = name
    return held, untrusted


def next_hop_forms(node: NodeRecord) -> list[str]:
    """Every next hop under which ``node`` advertises its subnets: its IPv4 address, its IPv6
    address, and the IPv4-mapped IPv6 address (RFC 4291 §2.5.5.2) that a node without an IPv6
    underlay address gives its IPv6 routes over the IPv4 sessions."""
    forms = [str(a) for a in (node.address, node.address_v6) if a is not None]
    if node.address is not None:
        forms.append(str(IPv6Address(f"::ffff:{node.address}")))
    return forms


def next_hop_owners(nodes: Iterable[NodeRecord]) -> tuple[dict[str, NodeRecord], dict[str, str], list[dict[str, str]]]:
    """Which node each next hop (:func:`next_hop_forms`) belongs to, by the node records: next
    hop -> node; the next hops records claim that belong to no node, each with why; and the
    claims not taken, a ``{"node", "next_hop", "reason"}`` each.  A record is its node's own
    word, and the node a next hop maps to is the node whose subnets may be routed through it:
    so an IPv4-mapped next hop (``::ffff:10.0.0.9``) belongs only to the node whose IPv4
    address it embeds, and one that two records claim (the last read winning took the other
    node's routes away) belongs to neither.  A node whose peer address is not its alone (its
    plan is keyed by it) maps no next hop."""
    claims: dict[str, list[NodeRecord]] = {}
    untrusted: list[dict[str, str]] = []
    for n in nodes:
        for form in dict.fromkeys(next_hop_forms(n)):
            embedded = IPv6Address(form).ipv4_mapped if ":" in form else None
            if embedded is not None and embedded != n.address:
                untrusted.append({"node": n.name, "next_hop": form,
                                  "reason": f"IPv4-mapped: the next hop of the node at {embedded}, not of this one"})
                continue
            claims.setdefault(form, []).append(n)
    owner: dict[str, NodeRecord] = {}
    ownerless: dict[str, str] = {}
    for form, claimants in claims.items():
        if len(claimants) == 1:
            owner[form] = claimants[0]
            continue
        ownerless[form] = f"claimed by the records of nodes {', '.join(sorted(c.name for c in claimants))}"
        untrusted.extend({"node": c.name, "next_hop": form, "reason": ownerless[form]} for c in claimants)
    for form, n in list(owner.items()):
        if owner.get(str(n.peer_address)) is not n:
            del owner[form]
            ownerless[form] = f"node {n.name}'s peer address {n.peer_address} is not its alone"
            untrusted.append({"node": n.name, "next_hop": form, "reason": ownerless[form]})
    return owner, ownerless, untrusted


_VTEP_KEYS = {4: "vtep_ip", 6: "vtep_ip_v6"}


def vxlan_vtep_refusals(
    nodes: Iterable[NodeRecord], held: Mapping[Network, str], families: Iterable[int] = (4, 6)
) -> dict[str, dict[int, str]]:
    """Node name -> pod family (4, 6) -> why the VTEP its record publishes is not taken for that
    family, for the nodes reached over VXLAN (``nodes``).  A record is its node's own word, but
    the neighbour entry of a VTEP address and the FDB entry of a VTEP MAC are the kernel's by
    that address and that MAC alone: a record naming another node's address (``vtep_ip``,
    ``vtep_ip_v6``) would point that node's neighbour entry at its own MAC, one naming another
    node's MAC (``vtep_mac``) would move that MAC's FDB entry to its own underlay address --
    either way the other node's pod traffic would go to it.  So a VTEP address must be the
    network address of the subnet of its family the node holds (``held``, from
    :func:`held_subnets`; as flannel takes it from the subnet lease, never from the backend
    data), and a MAC two records publish is the one made first's (:func:`vtep_mac_holder`),
    refused to the others (both families): a record copying a node's MAC does not take that
    node off the network.  ``families``:
    the pod families this node routes; a VTEP address of another family is not used here (no
    route, no neighbour entry), so not checked: while a cluster moves from IPv4 to dual-stack,
    a node not yet restarted holds no IPv6 pod network, and the IPv6 subnets of the restarted
    ones are not taken, but their IPv4 VTEPs are.  A wrong address refuses its family only."""
    nodes = list(nodes)
    families = set(families)
    why: dict[str, dict[int, str]] = {}
    for n in nodes:
        for version, net in ((4, n.subnet), (6, n.subnet_v6)):
            key = _VTEP_KEYS[version]
            value = n.backend.get(key)
            if value is None or version not in families:
                continue
            field_ = f"backend field {key!r} = {value!r}"
            if net is None:
                reason = f"{field_}: its record holds no IPv{version} subnet whose network address it could be"
            elif held.get(net) != n.name:
                reason = f"{field_}: its record's IPv{version} subnet {net} is not taken as its (see the untrusted subnets)"
            else:
                try:
                    same = ip_address(value) == net.network_address
                except ValueError:
                    same = False
                reason = None if same else f"{field_} is not {net.network_address}, the network address of its subnet {net}"
            if reason is not None:
                why.setdefault(n.name, {})[version] = reason
    by_mac: dict[str, list[NodeRecord]] = {}
    for n in nodes:
        mac = n.backend.get("vtep_mac")
        if isinstance(mac, str):
            by_mac.setdefault(mac.lower(), []).append(n)
    for mac, claimants in by_mac.items():
        if len(claimants) < 2:
            continue
        holder = vtep_mac_holder(claimants)
        names = ", ".join(sorted(c.name for c in claimants))
        for n in claimants:
            if n is holder:
                continue
            if holder is None:
                reason = (f"backend field 'vtep_mac' = {mac!r} is claimed by the records of nodes {names}, "
                          "and which was made first is not known")
            else:
                reason = (f"backend field 'vtep_mac' = {mac!r} is claimed by the records of nodes {names}: "
                          f"it is {holder.name}'s, whose record was made first (etcd create_revision "
                          f"{holder.create_revision}, {n.name}'s {n.create_revision})")
            for version in (4, 6):
                why.setdefault(n.name, {}).setdefault(version, reason)
    return why


def vtep_mac_holder(claimants: Iterable[NodeRecord]) -> NodeRecord | None:
    """Of the records publishing one VTEP MAC, the one that keeps it: the one whose etcd key was
    made first (lowest ``create_revision``, which a put of the key -- a re-publish, a lease
    renewed or replaced -- keeps), so that a record copying a node's MAC takes nothing from it.
    None where that is not known: a record not read from etcd (``create_revision`` 0), or the
    earliest made in one transaction with another (etcd gives every key of a transaction its
    revision) -- then none keeps it."""
    claimants = list(claimants)
    if any(c.create_revision <= 0 for c in claimants):
        return None
    first = min(c.create_revision for c in claimants)
    earliest = [c for c in claimants if c.create_revision == first]
    return earliest[0] if len(earliest) == 1 else None


def _plan_or_none(node: NodeRecord, underlay: Underlay, **kwargs: Any) -> PeerPlan:
    """:func:`plan_peer`, or -- should the peer's record make it fail -- no route to that peer
    (saying why), so that one record cannot stop the routes through every other peer."""
    try:
        return plan_peer(node, underlay, **kwargs)
    except Exception as e:  # noqa: BLE001 -- whatever the record made fail: that peer only
        return PeerPlan(str(node.peer_address), "none", f"peer's record: cannot plan a route ({type(e).__name__}: {e})",
                        node.name, {}, kwargs.get("version", 4))


@dataclass(frozen=True)
class NodeContext:
    """What :func:`desired_routes` takes from the node registry, the underlay and the backends
    alone -- every peer's plan, who holds which subnet, who owns which next hop -- whatever the
    best paths are: computed once by :func:`node_context` and given again while none of that
    changed, so that a best-path change costs the work of the best paths only."""

    own_nets: list[Network]
    pools: list[Network] | None
    trusted: dict[Network, str]
    untrusted: list[dict[str, str]]
    held: HeldSubnets
    plans_by: dict[int, dict[str, PeerPlan]]
    owner: dict[str, NodeRecord]
    ownerless: dict[str, str]
    untrusted_hops: list[dict[str, str]]


def node_context(
    nodes: Iterable[NodeRecord],
    underlay: Underlay,
    paths: LocalPaths,
    *,
    own_subnets: Iterable[str],
    own_backend: str,
    encap: str,
    available: Callable[[str], str | None] = lambda b: None,
    versions: tuple[int, ...] = (4,),
    pod_networks: Iterable[str | Network] | None = None,
    subnet_lens: Mapping[int, int] | None = None,
) -> NodeContext:
    """The node-dependent part of :func:`desired_routes` (same arguments)."""
    nodes = list(nodes)
    own_nets = [ip_network(s, strict=False) for s in own_subnets]
    pools = None if pod_networks is None else [ip_network(n, strict=False) for n in pod_networks]
    trusted, untrusted = held_subnets(
        nodes, None if pools is None else {p.version: (p, (subnet_lens or {}).get(p.version)) for p in pools})
    held = HeldSubnets(trusted)  # asked of every best path: indexed once
    plans_by = {v: {str(n.peer_address): _plan_or_none(n, underlay, own_backend=own_backend, encap=encap,
                                                        available=available, version=v, paths=paths) for n in nodes}
                for v in versions}  # fmt: skip
    vxlan_peers = [n for n in nodes if any(p is not None and p.node == n.name and p.backend == "vxlan"
                                           for p in (plans_by[v].get(str(n.peer_address)) for v in versions))]
    # The families routed here: those of ``versions`` with a pod network (where those are known).
    routed = tuple(v for v in versions if pools is None or any(p.version == v for p in pools))
    refusals = vxlan_vtep_refusals(vxlan_peers, trusted, routed)
    for v in versions:
        for addr, p in plans_by[v].items():
            if p.node is None or p.backend != "vxlan":
                continue
            why = refusals.get(p.node, {})
            if v in why:
                plans_by[v][addr] = PeerPlan(addr, "none", f"peer's record: {why[v]}", p.node, {}, v)
                continue
            # Only the VTEP addresses taken go into this plan's entries (one per family the
            # VTEP here has: agentd.dataplane.backends), not one refused or not checked.
            drop = {_VTEP_KEYS[f] for f in (4, 6) if f in why or f not in routed}
            if drop & p.extra.keys():
                plans_by[v][addr] = replace(p, extra={k: x for k, x in p.extra.items() if k not in drop})
    owner, ownerless, untrusted_hops = next_hop_owners(nodes)
    return NodeContext(own_nets, pools, trusted, untrusted, held, plans_by, owner, ownerless, untrusted_hops)


def desired_routes(
    bests: Iterable[tuple[str, IPv4Address | IPv6Address | None, bool] | tuple[str, IPv4Address | IPv6Address | None, bool, bool]],
    nodes: Iterable[NodeRecord],
    underlay: Underlay,
    paths: LocalPaths,
    *,
    own_subnets: Iterable[str],
    blackhole_metric: int,
    own_backend: str,
    encap: str,
    available: Callable[[str], str | None] = lambda b: None,
    versions: tuple[int, ...] = (4,),
    pod_networks: Iterable[str | Network] | None = None,
    subnet_lens: Mapping[int, int] | None = None,
    context: NodeContext | None = None,
) -> RoutePlan:
    """The routes for ``bests`` (destination, next hop, originated here[, learned over iBGP]) through the peers of
    ``nodes`` (other nodes; any other next hop is an external router on the underlay), plus
    the blackholes of this node's own subnets.  ``versions``: the cluster's pod families;
    ``pod_networks``: the cluster's pod network of each family, which a route through a node
    must lie in (None: not checked); ``subnet_lens``: the cluster's subnet length of each
    family (None: not checked).  A node record's subnet is held against other nodes' routes
    only as :func:`held_subnets` trusts it (the others listed in ``untrusted``).  A best path :func:`refusal` refuses is left out, with a
    row in ``refused``; so is a link-local next hop learned over iBGP (RFC 2545 §3: it is
    on-link only where an external peer sent it).  A best path whose route cannot be formed yet
    (the data path that carries it is not up here yet) is left out too, its destination listed
    in ``pending``.  ``context``: :func:`node_context` of the same arguments, computed earlier (None: computed
    here).  Pure: the agent applies the result."""
    own_subnets = list(own_subnets)
    if context is None:
        context = node_context(nodes, underlay, paths, own_subnets=own_subnets, own_backend=own_backend, encap=encap,
                               available=available, versions=versions, pod_networks=pod_networks,
                               subnet_lens=subnet_lens)  # fmt: skip
    own_nets, pools, held, plans_by = context.own_nets, context.pools, context.held, context.plans_by
    owner, ownerless = context.owner, context.ownerless
    untrusted, untrusted_hops = context.untrusted, context.untrusted_hops
    refused: list[dict[str, Any]] = []
    pending: list[str] = []
    primary = versions[0]
    routes: list[Route] = []
    rows: list[dict[str, Any]] = []
    for own in own_subnets:
        routes.append(Route(dst=own, kind="blackhole", metric=blackhole_metric))
        rows.append({"dst": own, "via": None, "dev": None, "backend": "blackhole", "peer": None})
    next_hops: dict[str, list[str]] = {}
    next_hops_v6: dict[str, list[str]] = {}
    external: dict[str, PeerPlan] = {}
    for dst, next_hop, local, *internal in bests:
        if local or next_hop is None:
            continue
        nh = str(next_hop)
        version = 6 if ":" in dst else 4
        node = owner.get(nh)
        key = None if node is None else str(node.peer_address)
        try:
            why = refusal(ip_network(dst, strict=False), node, own=own_nets, pod_networks=pools, held=held)
        except ValueError:  # not a prefix (the speaker gives only prefixes)
            why = f"{dst!r} is not an IP prefix"
        if why is None and nh in ownerless:  # a node's next hop, but no one node's: not an external router's either
            why = f"next hop {nh} is no node's: {ownerless[nh]}"
        if why is None and internal and internal[0] and isinstance(next_hop, IPv6Address) and next_hop.is_link_local:
            why = f"link-local next hop {nh} learned over iBGP: it is on-link only at the node its external peer sent it to"
        if why is not None:
            refused.append({"dst": dst, "via": None, "dev": None, "backend": "refused", "peer": nh, "reason": why})
            continue
        plan = plans_by[version].get(key) if key is not None and version in plans_by else None
        if plan is None:
            plan = external.get(nh)
            if plan is None:
                plan = external[nh] = plan_external(nh, underlay)
            key = nh
        if not plan.routable:
            continue
        try:
            route = route_for(dst, plan, underlay, paths)
        except InvalidRoute as e:
            # A route the kernel could not take (a peer record's word made it): refused, with
            # the reason, rather than stopping the routes of every other peer.
            refused.append({"dst": dst, "via": None, "dev": None, "backend": "refused", "peer": nh, "reason": str(e)})
            continue
        except Exception as e:  # noqa: BLE001 -- anything else (a record no shape expected): this best path only
            refused.append({"dst": dst, "via": None, "dev": None, "backend": "refused", "peer": nh,
                            "reason": f"cannot be routed ({type(e).__name__}: {e})"})
            continue
        if route is None:
            pending.append(dst)
            continue
        routes.append(route)
        if plan.version == primary or plan.node is None:
            next_hops.setdefault(key, []).append(dst)
        else:
            next_hops_v6.setdefault(key, []).append(dst)
        rows.append({"dst": dst, "via": route.gateway, "dev": route.dev, "backend": plan.backend, "peer": nh,
                     "datapath": paths.label(plan)})  # fmt: skip
    plans = {**plans_by.get(primary, {}), **external}
    dual = primary == 4 and 6 in plans_by
    return RoutePlan(routes, rows, plans, next_hops, dict(plans_by[6]) if dual else {}, next_hops_v6 if dual else {},
                     refused, pending, untrusted, untrusted_hops)
