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

from agentd.datastore.store import NodeRecord

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
) -> list[PeerSettings]:
    """The peer set for node ``me``.  Nodes without an address are skipped; so is ``me``."""
    out: dict[str, PeerSettings] = {}
    others = [n for name, n in sorted(nodes.items()) if name != me and n.address is not None]
    for node in others:
        if mode == "mesh":
            kind, client = MESH, False
        elif i_am_reflector:
            kind, client = (REFLECTOR, False) if node.route_reflector else (RR_CLIENT, True)
        elif node.route_reflector:
            kind, client = REFLECTOR, False
        else:
            continue  # clients peer only with reflectors
        ps = PeerSettings(
            address=node.address,
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


def peer_kind(settings: PeerSettings) -> str:
    return settings.description or EXTERNAL
