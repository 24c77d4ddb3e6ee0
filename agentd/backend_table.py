"""Every backend in one table: what it puts on the wire, what it costs, how this node carries it.

A *backend* is what a node advertises in its node record (``backend.type``) and what its peers
must send it: a wire format.  A *data path* is how one node produces and consumes that format
(a plain kernel route, the kernel VXLAN device, the tc-BPF programs, the user-space worker).
The backend says which data paths can carry it, best first; the node uses the first that
runs here and says why it fell back (agentd.dataplane.backends).

Everything that used to repeat these facts -- the configuration's choices and MTU overhead,
the datastore's record check, the route shapes (agentd.kernel.forwarding), the devices and member
filters (agentd.dataplane.backends), the user-space worker, the test bed, the lab -- reads them here, so
a new backend is one :class:`Backend` record plus its implementation.  Pure data, no imports
beyond the standard library: the configuration reads it before anything else is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Datapath:
    """One way a node carries a backend's traffic."""

    name: str
    label: str  # what `agentd status` shows per peer
    kernel: bool  # the per-packet work happens in the kernel (no process of ours on the path)


DATAPATHS = {
    d.name: d
    for d in (
        Datapath("route", "kernel route", True),  # plain routes via the peer: host-gw
        Datapath("vxlan-device", "vxlan device", True),  # the kernel VTEP agentd.vxlan
        Datapath("bpf", "bpf", True),  # tc-BPF on the underlay device (agentd.dataplane.bpf)
        Datapath("userspace", "user space", False),  # the TUN worker (agentd.dataplane)
    )
}


@dataclass(frozen=True)
class Backend:
    name: str
    overhead: int  # bytes of encapsulation per packet: pod MTU = underlay MTU - overhead
    wire: str  # what crosses the underlay, for docs and /status
    datapaths: tuple[str, ...]  # the data paths that can carry it here, best first
    device: str | None = None  # the tunnel device of the device-based data paths
    member_filter: str | None = None  # what the BPF member filter drops from non-members
    port_key: str | None = None  # the [network] key holding its UDP port
    ttl_decrement: bool = False  # the user-space worker decrements the inner TTL (flannel UDP does)
    node_data: tuple[str, ...] = ()  # keys it publishes in the node record's "backend" object
    # The pod families it carries between nodes (the inner packets), and whether it runs over
    # an IPv6 underlay (outer IPv6 headers; ip_family = ipv6 has no other).
    inner_families: tuple[int, ...] = (4, 6)
    outer_ipv6: bool = True
    # The data paths that carry its IPv6 pods, where not all of ``datapaths`` do: both nodes
    # of a pair must run it on one of them.
    ipv6_datapaths: tuple[str, ...] | None = None

    @property
    def encapsulates(self) -> bool:
        return self.overhead > 0


BACKENDS = {
    b.name: b
    for b in (
        Backend(
            "host-gw",
            overhead=0,
            wire="the pod packets themselves, routed via the peer (same L2 segment only)",
            datapaths=("route",),
        ),
        # RFC 2003 section 3.1: an outer IPv4 header, protocol 4.
        Backend(
            "ipip",
            overhead=20,
            wire="IP in IP (RFC 2003): outer IPv4, protocol 4",
            datapaths=("bpf", "userspace"),
            device="agentd.ipip",
            member_filter="ipip",
            # Calico's IPIP is IPv4 only as well; IPv6 in IPv4 would be protocol 41 (RFC 4213).
            inner_families=(4,),
            outer_ipv6=False,
        ),
        # RFC 7348 section 5: outer IPv4 + UDP + VXLAN header + inner Ethernet = 50 bytes.
        Backend(
            "vxlan",
            overhead=50,
            wire="VXLAN (RFC 7348): outer IPv4 + UDP to vxlan_port + VXLAN + inner Ethernet",
            datapaths=("vxlan-device",),
            device="agentd.vxlan",
            member_filter="vxlan",
            port_key="vxlan_port",
            node_data=("vtep_mac", "vtep_ip", "vni", "vxlan_port"),
        ),
        # flannel's UDP backend: outer IPv4 + UDP whose payload is exactly the inner packet.
        Backend(
            "udp",
            overhead=28,
            wire="flannel UDP: outer IPv4 + UDP to udp_port, payload the inner packet (IPv4 or IPv6)",
            datapaths=("bpf", "userspace"),
            device="agentd.udp",
            member_filter="udp",
            port_key="udp_port",
            ttl_decrement=True,
            node_data=("udp_port",),
            # Outer headers IPv4 (the BPF programs and the worker build no other).  The payload
            # is the inner packet, of either family, in both data paths: a BPF node and a
            # user-space one speak the same format for IPv6 pods as for IPv4 ones.
            inner_families=(4, 6),
            outer_ipv6=False,
        ),
    )
}
NAMES = tuple(BACKENDS)  # "host-gw", "ipip", "vxlan", "udp": the configuration's choices
ENCAPSULATING = tuple(name for name, b in BACKENDS.items() if b.encapsulates)
USERSPACE = tuple(name for name, b in BACKENDS.items() if "userspace" in b.datapaths)
BPF = tuple(name for name, b in BACKENDS.items() if "bpf" in b.datapaths)


def backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; one of {', '.join(NAMES)}") from None


IPV6_EXTRA = 20  # an IPv6 header (RFC 8200: 40 bytes) is 20 bytes longer than an IPv4 one


def mtu_overhead(name: str, underlay_family: int = 4) -> int:
    """Bytes of encapsulation backend ``name`` adds to every pod packet on an underlay of
    ``underlay_family`` (4 or 6): VXLAN is 50 over IPv4, 70 over IPv6."""
    b = backend(name)
    return b.overhead + (IPV6_EXTRA if underlay_family == 6 and b.encapsulates else 0)
