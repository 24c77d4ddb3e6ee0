"""Which BGP peers a node should have, given the node registry (pure functions).

``mesh``: every node peers with every other node (iBGP full mesh, Calico's
"node-to-node mesh").  ``route-reflector``: nodes flagged ``route_reflector`` peer
with each other as ordinary iBGP peers and with every other node as RR clients
(RFC 4456); the other nodes peer only with the reflectors.  Configured external
peers (a top-of-rack router) are added in both modes.

Sessions to nodes have a prefix limit (RFC 4486 Cease/1, :func:`node_max_prefixes`): a node
announces its pod subnets, a reflector (or, while a cluster moves to reflectors, a node a
reflector still serves) every node's, and any node passes on what its own external peers
announce (eBGP-learned routes go to iBGP peers); so the bound is every subnet the pod network
holds plus ``RELAYED_PREFIXES`` -- it stops a broken or hostile node from pushing millions of
routes into every agent without cutting a legitimate one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from ipaddress import IPv4Address, IPv6Address

from bgp import PeerSettings

from agentd.config.settings import Config
from agentd.daemon.speaker import bfd_timers, peer_settings
from agentd.datastore.store import ClusterConfig, NodeEvent, NodeRecord

MESH = "node-to-node mesh"
REFLECTOR = "route reflector"
RR_CLIENT = "rr client"
EXTERNAL = "external"

RELAYED_PREFIXES = 16384  # what a node may pass on from its external peers, beyond the pod subnets
MAX_NODES = 1 << 16  # no cluster has more nodes: the pod subnets counted at most this many
NODE_RESTART = 60  # seconds until a node session reset for its prefix limit is tried again


def node_max_prefixes(cluster: ClusterConfig | None) -> int | None:
    """The prefix limit of a session to another node (per family): as many prefixes as the pod
    network of the cluster's larger family has subnets (at most MAX_NODES), plus
    RELAYED_PREFIXES; None (no limit) while the cluster record is not known."""
    if cluster is None:
        return None
    count = max(1 << (subnet_len - net.prefixlen) for net, subnet_len in map(cluster.pool, cluster.versions))
    return min(count, MAX_NODES) + RELAYED_PREFIXES


def desired_peers(
    me: str,
    nodes: Mapping[str, NodeRecord],
    *,
    mode: str,
    i_am_reflector: bool,
    password: str | None = None,
    hold_time: int | None = None,
    bfd: tuple[float, int] | None = None,
    external: Iterable[PeerSettings] = (),
    session_version: int = 4,
    max_prefixes: int | None = None,
    local_address: IPv4Address | IPv6Address | None = None,
) -> list[PeerSettings]:
    """The peer set for node ``me``.  Sessions are IPv4 (``session_version`` 4: they carry the
    IPv6 routes of a dual-stack cluster too, as BIRD's multi-channel sessions do) or IPv6 (an
    IPv6-only cluster); nodes without an address of that family are skipped, and so is ``me``.
    ``max_prefixes``: the limit of each session to a node (:func:`node_max_prefixes`), which is
    tried again NODE_RESTART seconds after it resets one.

    ``local_address``: this node's published address of the session family (its node record's
    ``address`` or ``address_v6``), the source the sessions to nodes are bound to, as Calico's
    BIRD ``source address``.  Unbound, the kernel picks the source (on a host with several
    addresses: a SLAAC or temporary IPv6 one, a secondary IPv4 one): the other node then refuses
    the connection (not the address it knows this node by), or, where it takes it, gets this
    node's pod subnets with that address as next hop -- which it cannot map to this node, so it
    routes them as an external router's, past the vxlan or udp backend.  An inbound session's
    local address is the one the other node dialled: this one."""
    out: dict[str, PeerSettings] = {}
    for name, node in sorted(nodes.items()):
        address = node.address if session_version == 4 else node.address_v6
        if name == me or address is None:
            continue
        if mode == "mesh":
            kind, client = MESH, False
        elif i_am_reflector:
            kind, client = (REFLECTOR, False) if node.route_reflector else (RR_CLIENT, True)
        elif node.route_reflector:
            kind, client = REFLECTOR, False
        else:
            continue  # clients peer only with reflectors
        ps = PeerSettings(
            address=address,
            asn=node.asn,
            rr_client=client,
            password=password,
            hold_time=hold_time,
            description=kind,
            bfd=bfd,
            max_prefixes=max_prefixes,
            max_prefixes_restart=float(NODE_RESTART) if max_prefixes is not None else None,
            local_address=local_address,
        )
        out[ps.key] = ps
    for ps in external:
        if ps.key not in out:  # a node of the cluster wins over a stale external entry
            out[ps.key] = ps
    return list(out.values())


class Peering:
    """The node registry as this agent has read it (its watch of the nodes in etcd), and the
    peer set that implies together with the configured external peers."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.nodes: dict[str, NodeRecord] = {}
        self.known = False  # the registry has been read at least once

    def apply(self, ev: NodeEvent) -> None:
        if ev.kind == "snapshot":
            self.nodes = dict(ev.nodes or {})
            self.known = True
        elif ev.kind == "put" and ev.record is not None and ev.name:
            self.nodes[ev.name] = ev.record
        elif ev.kind == "delete" and ev.name:
            self.nodes.pop(ev.name, None)

    def peers(self, cfg: Config, cluster: ClusterConfig | None = None) -> list[PeerSettings]:
        version = 6 if cfg.network.ip_family == "ipv6" else 4
        return desired_peers(
            self.me,
            self.nodes,
            mode=cfg.bgp.mode,
            i_am_reflector=cfg.node.route_reflector,
            password=cfg.bgp.password,
            hold_time=cfg.bgp.hold_time,
            bfd=bfd_timers(cfg),
            external=[peer_settings(p, cfg, description=EXTERNAL) for p in cfg.bgp.peers],
            session_version=version,
            max_prefixes=node_max_prefixes(cluster),
            local_address=cfg.node.address if version == 4 else cfg.node.address_v6,
        )
