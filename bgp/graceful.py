"""Graceful restart, receiving side (RFC 4724 §4.2): the routes of a peer that went away
without a NOTIFICATION are kept, marked stale, until it comes back and sends End-of-RIB
(or its restart time, then our stale time, runs out)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .negotiation import Negotiated
from .rib import Rib
from .settings import Family
from .timers import TimerHeap

log = logging.getLogger("bgp.speaker")

_KEY = "\0graceful"


@dataclass
class _State:
    restart_deadline: float | None  # the peer must be back by then
    stale_deadline: float | None = None  # and must have sent End-of-RIB by then
    families: set[Family] = field(default_factory=set)  # families still stale


class GracefulRestarts:
    """Every peer whose routes are being kept across its restart, with their deadlines on the
    speaker's timer heap (keys :func:`timer_key`)."""

    def __init__(self, rib: Rib, timers: TimerHeap, stale_time: float) -> None:
        self.rib = rib
        self.timers = timers
        self.stale_time = stale_time
        self._peers: dict[str, _State] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._peers

    @staticmethod
    def timer_key(key: str) -> str:
        return _KEY + key

    @staticmethod
    def peer_of(timer_key: str) -> str | None:
        return timer_key[len(_KEY) :] if timer_key.startswith(_KEY) else None

    def went_away(self, key: str, families: set[Family], restart_time: float, now: float) -> int:
        """The peer left gracefully: keep its routes of ``families`` as stale; returns how many."""
        n = self.rib.mark_stale(key, families)
        self._peers[key] = _State(now + restart_time, None, families)
        self._schedule(key)
        return n

    def forget(self, key: str) -> None:
        """The peer's routes went another way (dropped, deconfigured)."""
        self._peers.pop(key, None)
        self._schedule(key)

    def came_back(self, key: str, neg: Negotiated, now: float) -> None:
        """RFC 4724 §4.2: the peer is back.  Families it no longer preserves forwarding state for
        are flushed now; the rest wait for its End-of-RIB (bounded by our stale timer)."""
        gr = self._peers.get(key)
        if gr is None:
            return
        kept = {f for f, fwd in neg.peer_gr_families().items() if fwd}
        for family in list(gr.families):
            if family not in kept or family not in neg.families:
                self.rib.purge_stale(key, family)
                gr.families.discard(family)
        gr.restart_deadline = None
        gr.stale_deadline = now + self.stale_time
        if not gr.families:
            del self._peers[key]
        self._schedule(key)

    def end_of_rib(self, key: str, family: Family) -> None:
        gr = self._peers.get(key)
        if gr is not None and family in gr.families:
            n = self.rib.purge_stale(key, family)
            gr.families.discard(family)
            log.info("peer %s sent End-of-RIB for %s: removed %d stale routes", key, family, n)
            if not gr.families:
                del self._peers[key]
            self._schedule(key)

    def timer(self, key: str, now: float) -> None:
        gr = self._peers.get(key)
        if gr is None:
            return
        if gr.restart_deadline is not None and now >= gr.restart_deadline:
            log.info("peer %s did not return within its restart time: dropping its stale routes", key)
            self.rib.purge_stale(key)
            del self._peers[key]
        elif gr.stale_deadline is not None and now >= gr.stale_deadline:
            log.info("peer %s sent no End-of-RIB in time: dropping its stale routes", key)
            self.rib.purge_stale(key)
            del self._peers[key]
        self._schedule(key)

    def _schedule(self, key: str) -> None:
        gr = self._peers.get(key)
        times = [] if gr is None else [t for t in (gr.restart_deadline, gr.stale_deadline) if t is not None]
        self.timers.set(_KEY + key, min(times) if times else None)
