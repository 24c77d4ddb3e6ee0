"""Typed, read-only views of a speaker for whoever presents them (the agent's REST API renders
them as JSON; bgp/ knows nothing of JSON or HTTP)."""

from __future__ import annotations

from dataclasses import dataclass

from . import bestpath
from .rib import Path
from .settings import Family


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
