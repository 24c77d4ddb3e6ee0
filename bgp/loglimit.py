"""Rate-limited, deduplicated logging for problems one message at a time can cause.

A peer can make the same complaint arise for every UPDATE it sends (a duplicate attribute,
a LOCAL_PREF from an external peer) or an outsider for every connection it opens.  Logging
each one lets a single sender turn 1 MB of UPDATEs into 50 MB of log.  A
:class:`LogLimiter` logs the first occurrence of each kind of problem, counts the rest,
and says how many it held back the next time that kind is logged (at most once per
``interval`` seconds) -- or, if none came by the end of the interval, in a line of its own
then (:meth:`LogLimiter.flush`, at :meth:`LogLimiter.next_flush`: a burst that ends is not
left uncounted in the log).  Every occurrence is counted in :attr:`LogLimiter.counts` so the
agent can export the totals as metrics.

Subjects the limiter is told are its own (``pinned``: the configured peers) always keep their
own keys and their own pacing.  Any other subject (an outsider's address, a connection refused
from it) is one an outsider can vary: its occurrences are counted under its own key, but logged
paced by one key per kind shared by all such subjects, ``(kind, "*")`` -- so a scan from 5,000
addresses is one line a minute, not 5,000.  At most :data:`MAX_OTHERS` such keys are kept, the
least recently seen evicted first, and a key with no occurrence for :data:`FORGET_AFTER` seconds
is dropped with its count (:attr:`LogLimiter.evicted` counts them).  A key listed so whose
subject is pinned again by then (a peer removed and added back: a reconfiguration) is only
unlisted, its count kept.

Sans-IO like the rest of bgp/: the time is passed in.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable

DEFAULT_INTERVAL = 60.0
#: Keys of subjects that are not pinned (outsiders' addresses) remembered at once.
MAX_OTHERS = 1024
#: Seconds after its last occurrence that a key of a subject not pinned is dropped.
FORGET_AFTER = 3600.0


class LogLimiter:
    def __init__(
        self, logger: logging.Logger, interval: float = DEFAULT_INTERVAL, pinned: Callable[[str], bool] | None = None
    ) -> None:
        self.logger = logger
        self.interval = interval
        #: Whether a subject keeps its keys for good (a configured peer's address).
        self.pinned: Callable[[str], bool] = pinned or (lambda subject: False)
        #: Keys of subjects not pinned -> their last occurrence, the least recent first.
        self._others: OrderedDict[tuple[str, str], float] = OrderedDict()
        #: Keys of subjects not pinned dropped (evicted for room, or not seen for FORGET_AFTER).
        self.evicted = 0
        #: Every occurrence, by ``(kind, subject)`` where subject is usually a peer.
        self.counts: Counter[tuple[str, str]] = Counter()
        # Pacing key (a pinned subject's key, or (kind, "*")) -> earliest time to log again.
        self._next: dict[tuple[str, str], float] = {}
        self._held: Counter[tuple[str, str]] = Counter()
        # Pacing key -> the last occurrence held back (level, message, args), for flush().
        self._last_held: dict[tuple[str, str], tuple[int, str, tuple[object, ...]]] = {}

    def log(
        self,
        level: int,
        kind: str,
        subject: str,
        now: float,
        message: str,
        *args: object,
        exc_info: bool = False,
        force: bool = False,
    ) -> bool:
        """Count one occurrence; log it unless this kind was logged less than ``interval`` ago
        (for this subject if it is pinned, for any subject not pinned otherwise) -- or
        ``force``: logged all the same (with the number held back), the interval restarting.
        Returns whether it was logged."""
        key = (kind, subject)
        self.expire(now)
        if not self.pinned(subject):
            self._others[key] = now
            self._others.move_to_end(key)
            self._evict()
            pace = (kind, "*")
        else:
            self._others.pop(key, None)  # became a peer: its key is kept from now on
            pace = key
        self.counts[key] += 1
        due = self._next.get(pace)
        if not force and due is not None and now < due:
            self._held[pace] += 1
            self._last_held[pace] = (level, message, args)
            return False
        held = self._held.pop(pace, 0)
        self._last_held.pop(pace, None)
        if held:
            message += " (%d similar suppressed in the last %.0fs)"
            args = (*args, held, self.interval)
        self._next[pace] = now + self.interval
        self.logger.log(level, message, *args, exc_info=exc_info)
        return True

    def next_flush(self) -> float | None:
        """When :meth:`flush` has a count to log: the end of the earliest interval in which
        occurrences were held back (None: none held)."""
        return min((self._next[pace] for pace in self._held), default=None)

    def flush(self, now: float) -> int:
        """Log the count of occurrences held back in each interval that has ended, with the
        last of them, in a line of its own (no occurrence came since to carry it); the next
        interval starts then.  Returns how many lines it logged."""
        lines = 0
        for pace in [p for p in self._held if self._next[p] <= now]:
            held = self._held.pop(pace)
            level, message, args = self._last_held.pop(pace)
            self._next[pace] = now + self.interval
            self.logger.log(level, "%d similar suppressed in the last %.0fs, the last: " + message,
                            held, self.interval, *args)  # fmt: skip
            lines += 1
        return lines

    def forget(self, subject: str, now: float | None = None) -> None:
        """Drop the pacing state of a subject (a deconfigured peer); its counts stay, from
        ``now`` on as those of a subject not pinned (dropped after FORGET_AFTER)."""
        for key in [k for k in self._next if k[1] == subject]:
            del self._next[key]
            self._held.pop(key, None)
            self._last_held.pop(key, None)
        if now is not None:
            for key in [k for k in self.counts if k[1] == subject and k not in self._others]:
                self._others[key] = now
            self._evict()

    def keep(self, subject: str) -> None:
        """``subject`` is pinned (again: a peer removed and added back): unlist its keys, so
        its counts are neither evicted nor expired."""
        for key in [k for k in self._others if k[1] == subject]:
            del self._others[key]

    def expire(self, now: float) -> None:
        """Drop the keys of subjects not pinned that had no occurrence for FORGET_AFTER."""
        while self._others:
            key, seen = next(iter(self._others.items()))
            if now - seen < FORGET_AFTER:
                return
            self._drop(key)

    def _evict(self) -> None:
        while len(self._others) > MAX_OTHERS:
            self._drop(next(iter(self._others)))

    def _drop(self, key: tuple[str, str]) -> None:
        del self._others[key]
        if self.pinned(key[1]):
            return  # pinned again since it was listed (a reconfigured peer): its count stays
        self.counts.pop(key, None)
        self._next.pop(key, None)
        self._held.pop(key, None)
        self._last_held.pop(key, None)
        self.evicted += 1
