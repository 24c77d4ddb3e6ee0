"""From BGP best paths to kernel routes: how each peer is reached, and the routes that follow.

For every peer node the agent makes a :class:`PeerPlan`: the backend that carries
traffic to it and why (host-gw needs the peer on this node's L2 segment; with
``encap = "cross-subnet"`` on-link peers are reached directly and the rest through the
tunnel).  :func:`plan_peer` decides, :func:`route_for` turns a best path into a kernel
route under that plan.  Both are pure; the tunnel backends that need devices, FDB
entries or user-space next hops live in agentd.backends and are driven by the agent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address, ip_address

from .datastore import NodeRecord
from .netinfo import Underlay
from .routing import Route

HOST_GW = "host-gw"
ENCAP_BACKENDS = ("ipip", "vxlan", "udp")


@dataclass(frozen=True)
class PeerPlan:
    """How traffic to one peer node (or external next hop) is carried."""

    address: str
    backend: str  # "host-gw", "ipip", "vxlan", "udp", or "none" (no route possible)
    reason: str
    node: str | None = None  # the node's name; None for a next hop outside the cluster
    extra: dict = field(default_factory=dict, compare=False)  # backend data (vtep mac/ip, ...)

    @property
    def routable(self) -> bool:
        return self.backend != "none"


def plan_peer(
    node: NodeRecord,
    underlay: Underlay,
    *,
    own_backend: str,
    encap: str,
    available: Callable[[str], str | None] = lambda b: None,
) -> PeerPlan:
    """Decide how to reach ``node``.

    The *peer's* backend says how it receives traffic, so it is the one we use toward it
    (agentd runs every backend, per peer): a host-gw peer only takes direct traffic; an
    encapsulating peer takes its own encapsulation, or direct traffic when our ``encap`` is
    cross-subnet and it shares our L2 segment.  ``available(backend)`` returns None if this
    node can run that backend, else the reason it cannot.
    """
    addr = str(node.address)
    on_link = underlay.on_link(node.address)
    peer_backend = str(node.backend.get("type") or own_backend)
    if peer_backend == HOST_GW:
        if on_link:
            return PeerPlan(addr, HOST_GW, f"on-link via {underlay.ifname}", node.name)
        return PeerPlan(
            addr,
            "none",
            f"peer {addr} is not on this node's L2 segment ({', '.join(map(str, underlay.networks))}) and uses "
            "host-gw, which needs a shared segment: use an encapsulating backend or cross-subnet",
            node.name,
        )
    if encap == "cross-subnet" and on_link:
        return PeerPlan(addr, HOST_GW, f"cross-subnet: on-link via {underlay.ifname}, no encapsulation", node.name)
    problem = available(peer_backend)
    if problem is not None:
        return PeerPlan(addr, "none", f"peer uses {peer_backend}: {problem}", node.name)
    why = "cross-subnet: peer on another segment" if encap == "cross-subnet" else f"peer uses {peer_backend}"
    return PeerPlan(addr, peer_backend, why, node.name, dict(node.backend))


def plan_external(next_hop: str, underlay: Underlay) -> PeerPlan:
    """A next hop that is not a cluster node (a route learned from a top-of-rack router)."""
    a = ip_address(next_hop)
    if isinstance(a, IPv4Address) and underlay.on_link(a):
        return PeerPlan(next_hop, HOST_GW, f"external next hop on-link via {underlay.ifname}")
    if isinstance(a, IPv6Address) and a.ipv4_mapped is not None:
        return PeerPlan(next_hop, "none", "IPv4-mapped IPv6 next hop cannot be routed")
    return PeerPlan(next_hop, "kernel", "external next hop resolved by the kernel")


def route_for(dst: str, plan: PeerPlan, underlay: Underlay, devices: dict[str, str]) -> Route | None:
    """The kernel route for ``dst`` under ``plan``; ``devices`` maps backend -> tunnel device name."""
    if plan.backend == HOST_GW:
        return Route(dst=dst, gateway=plan.address, dev=underlay.ifname)
    if plan.backend == "kernel":
        return Route(dst=dst, gateway=plan.address)
    if plan.backend == "ipip":
        dev = devices["ipip"]
        if devices.get("ipip_path") == "userspace":
            return Route(dst=dst, dev=dev)  # the user-space next-hop table picks the peer
        return Route(dst=dst, gateway=plan.address, dev=dev, onlink=True)
    if plan.backend == "udp":
        return Route(dst=dst, dev=devices["udp"])
    if plan.backend == "vxlan":
        vtep_ip = plan.extra.get("vtep_ip")
        if not vtep_ip:
            return None
        return Route(dst=dst, gateway=vtep_ip, dev=devices["vxlan"], onlink=True)
    return None
