"""Typed, read-only views of a speaker for whoever presents them (the agent's REST API renders
them as JSON; bgp/ knows nothing of JSON or HTTP): :func:`peer_views` (GET /peers),
:func:`rib_prefixes` and :func:`rib_paths` (GET /rib, a page at a time)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from . import bestpath
from .graceful import GracefulRestarts
from .negotiation import Negotiated
from .peer import Peer
from .rib import Path, Rib
from .settings import Family, LocalSettings


@dataclass(frozen=True)
class PeerView:
    """One neighbour as the speaker sees it."""

    address: str
    asn: int
    kind: str  # "ibgp", "ibgp rr-client", "ebgp"
    state: str
    since: float  # on the speaker's clock
    prefixes_received: int
    prefixes_sent: int
    stale: int
    router_id: str | None
    hold_time: int | None
    families: tuple[str, ...]
    graceful_restart: bool
    last_error: str
    flaps: int
    description: str
    in_sync: bool  # everything owed has been handed to the socket
    max_prefixes: int | None
    held_down: bool  # down after Cease/1 until its restart time or reconfiguration
    dynamic: bool  # accepted from a listen range


@dataclass(frozen=True)
class RibPathView:
    """One candidate path of one prefix, ranked."""

    family: Family
    prefix: bytes
    path: Path
    best: bool
    reason: bestpath.Reason | None  # why the best path won


class SpeakerState(Protocol):
    """What the views read of a speaker (bgp.speaker.Speaker)."""

    local: LocalSettings
    rib: Rib
    peers: dict[str, Peer]
    graceful: GracefulRestarts
    dynamic: set[str]
    now: float

    def negotiated(self, key: str) -> Negotiated | None: ...

    def adj_out_count(self, key: str) -> int: ...

    def in_sync(self, key: str) -> bool: ...


def peer_views(speaker: SpeakerState) -> list[PeerView]:
    """Every configured or dynamic neighbour, as GET /peers and ``agentd status`` show them."""
    out = []
    for key, peer in speaker.peers.items():
        s = peer.settings
        neg = speaker.negotiated(key) or peer.session.negotiated
        ibgp = s.asn == speaker.local.asn
        kind = "ibgp" if ibgp else "ebgp"
        if ibgp and s.rr_client:
            kind = "ibgp rr-client"
        adj = speaker.rib.adj_in.get(key)
        graceful = key in speaker.graceful
        families = tuple(sorted(f"{_afi_name(a)}-unicast" for a, _ in neg.families)) if neg else ()
        out.append(
            PeerView(
                address=key,
                asn=s.asn,
                kind=kind,
                state=peer.state.label,
                since=peer.since,
                prefixes_received=len(adj) if adj is not None else 0,
                prefixes_sent=speaker.adj_out_count(key),
                stale=speaker.rib.stale_count(key) if graceful else 0,
                router_id=str(neg.peer_router_id) if neg else None,
                hold_time=neg.hold_time if neg else None,
                families=families,
                graceful_restart=graceful,
                last_error=peer.last_error,
                flaps=max(0, peer.established_count - (1 if peer.established else 0)),
                description=s.description,
                in_sync=speaker.in_sync(key),
                max_prefixes=s.max_prefixes,
                held_down=peer.held_until is not None and peer.held_until > speaker.now,
                dynamic=key in speaker.dynamic,
            )
        )
    return out


def rib_prefixes(rib: Rib) -> list[tuple[Family, bytes]]:
    """Every Loc-RIB prefix, in the order /rib lists them (a snapshot to page through)."""
    out: list[tuple[Family, bytes]] = []
    for family in sorted(rib.families()):
        out.extend((family, p) for p in sorted(rib.loc[family]))  # by length, then address
    return out


def rib_paths(rib: Rib, family: Family, prefix: bytes) -> list[RibPathView]:
    """The candidate paths of one prefix, best first (empty if it is gone by now)."""
    return [
        RibPathView(family, prefix, path, i == 0, reason if i == 0 else None)
        for i, (path, reason) in enumerate(bestpath.rank(rib.candidates(family, prefix)))
    ]


def _afi_name(afi: int) -> str:
    return "ipv4" if afi == 1 else "ipv6"
