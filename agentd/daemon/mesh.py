"""Which BGP peers a node should have, given the node registry (pure functions).

``mesh``: every node peers with every other node (iBGP full mesh, Calico's
"node-to-node mesh").  ``route-reflector``: nodes flagged ``route_reflector`` peer
with each other as ordinary iBGP peers and with every other node as RR clients
(RFC 4456); the other nodes peer only with the reflectors.  Configured external
peers (a top-of-rack router) are added in both modes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from bgp import PeerSettings

from agentd.config.settings import Config
from agentd.daemon.speaker import bfd_timers, peer_settings
from agentd.datastore.store import NodeEvent, NodeRecord

MESH = "node-to-node mesh"
REFLECTOR = "route reflector"
RR_CLIENT = "rr client"
EXTERNAL = "external"


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
) -> list[PeerSettings]:
    """The peer set for node ``me``.  Sessions are IPv4 (``session_version`` 4: they carry the
    IPv6 routes of a dual-stack cluster too, as BIRD's multi-channel sessions do) or IPv6 (an
    IPv6-only cluster); nodes without an address of that family are skipped, and so is ``me``."""
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

    def peers(self, cfg: Config) -> list[PeerSettings]:
        return desired_peers(
            self.me,
            self.nodes,
            mode=cfg.bgp.mode,
            i_am_reflector=cfg.node.route_reflector,
            password=cfg.bgp.password,
            hold_time=cfg.bgp.hold_time,
            bfd=bfd_timers(cfg),
            external=[peer_settings(p, cfg, description=EXTERNAL) for p in cfg.bgp.peers],
            session_version=6 if cfg.network.ip_family == "ipv6" else 4,
        )
