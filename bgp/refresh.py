"""Pacing of ROUTE-REFRESH (RFC 2918): a peer's requests for one family start a full re-send at
most once per interval; requests in between are folded into one that starts when the time
is up.  A peer that sends refreshes in a loop thus costs one re-send per interval, served a
chunk at a time by its update group, never a backlog of re-sends."""

from __future__ import annotations

from collections import Counter

from .settings import Family
from .timers import TimerHeap

_KEY = "\0refresh"
Request = tuple[str, Family]  # (peer key, family)


class RefreshPacer:
    def __init__(self, timers: TimerHeap, interval: float, counters: Counter[str]) -> None:
        self.timers = timers
        self.interval = interval
        self.counters = counters
        self._next: dict[Request, float] = {}  # earliest start of the next re-send
        self._waiting: set[Request] = set()

    @staticmethod
    def is_timer(key: str) -> bool:
        return key == _KEY

    def request(self, req: Request, now: float) -> bool:
        """A ROUTE-REFRESH arrived; True when its re-send starts now (then call :meth:`started`)."""
        if req in self._waiting:
            self.counters["route refreshes folded"] += 1
            return False
        if now >= self._next.get(req, 0.0):
            return True
        self._waiting.add(req)
        self.counters["route refreshes deferred"] += 1
        self._schedule()
        return False

    def started(self, req: Request, now: float) -> None:
        self._next[req] = now + self.interval

    def due(self, now: float) -> list[Request]:
        """The deferred requests whose time has come (the timer fired); they start now."""
        ready = [r for r in self._waiting if self._next.get(r, 0.0) <= now]
        self._waiting.difference_update(ready)
        self._schedule()
        return ready

    def forget(self, key: str) -> None:
        for r in [r for r in self._next if r[0] == key]:
            del self._next[r]
        self._waiting = {r for r in self._waiting if r[0] != key}
        self._schedule()

    def _schedule(self) -> None:
        times = [self._next.get(r, 0.0) for r in self._waiting]
        self.timers.set(_KEY, min(times) if times else None)
