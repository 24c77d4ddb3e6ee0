"""One heap of due times for every peer and speaker-wide deadline (O(log n) per change)."""

from __future__ import annotations

import heapq
import itertools


class TimerHeap:
    """One heap of due times for every peer and speaker-wide deadline.

    A keepalive timer moves later with every UPDATE sent, thousands of times a second on a
    busy reflector: moving a time later only records it, and the heap entry it leaves
    behind, found early, is pushed again for the new time.  Only an earlier time is pushed
    at once.  So the heap holds about one entry per key."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._due: dict[str, float] = {}  # the time each key is really due
        self._queued: dict[str, float] = {}  # the time of each key's live heap entry (<= due)
        self._seq = itertools.count()

    def set(self, key: str, at: float | None) -> None:
        if at is None:
            self._due.pop(key, None)
            return
        self._due[key] = at
        queued = self._queued.get(key)
        if queued is None or at < queued:
            self._queued[key] = at
            heapq.heappush(self._heap, (at, next(self._seq), key))

    def next(self) -> float | None:
        heap = self._heap
        while heap:
            at, _, key = heap[0]
            if self._queued.get(key) != at:
                heapq.heappop(heap)  # an entry superseded by an earlier one
                continue
            due = self._due.get(key)
            if due is None:
                heapq.heappop(heap)
                del self._queued[key]
                continue
            if due > at:  # moved later since: queue it for its real time
                heapq.heapreplace(heap, (due, next(self._seq), key))
                self._queued[key] = due
                continue
            return at
        return None

    def pop_due(self, now: float) -> list[str]:
        out = []
        while (at := self.next()) is not None and at <= now:
            _, _, key = heapq.heappop(self._heap)
            del self._queued[key]
            del self._due[key]
            out.append(key)
        return out
