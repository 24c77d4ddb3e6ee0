"""Rate-limited, deduplicated logging for problems one message at a time can cause.

A peer can make the same complaint arise for every UPDATE it sends (a duplicate attribute,
a LOCAL_PREF from an external peer) or an outsider for every connection it opens.  Logging
each one lets a single sender turn 1 MB of UPDATEs into 50 MB of log.  A
:class:`LogLimiter` logs the first occurrence of each kind of problem, counts the rest,
and says how many it held back the next time that kind is logged (at most once per
``interval`` seconds).  Every occurrence is counted in :attr:`LogLimiter.counts` so the
agent can export the totals as metrics.

Sans-IO like the rest of bgp/: the time is passed in.
"""

from __future__ import annotations

import logging
from collections import Counter

DEFAULT_INTERVAL = 60.0
#: Kinds remembered at once: keys include peer addresses, which an outsider can vary.
MAX_KEYS = 1024


class LogLimiter:
    def __init__(self, logger: logging.Logger, interval: float = DEFAULT_INTERVAL) -> None:
        self.logger = logger
        self.interval = interval
        #: Every occurrence, by ``(kind, subject)`` where subject is usually a peer.
        self.counts: Counter[tuple[str, str]] = Counter()
        self._next: dict[tuple[str, str], float] = {}  # key -> earliest time to log again
        self._held: Counter[tuple[str, str]] = Counter()

    def log(
        self, level: int, kind: str, subject: str, now: float, message: str, *args: object, exc_info: bool = False
    ) -> bool:
        """Count one occurrence; log it unless this kind was logged less than ``interval`` ago.
        Returns whether it was logged."""
        key = (kind, subject)
        if key not in self.counts and len(self.counts) >= MAX_KEYS:
            key = (kind, "*")  # too many subjects: fold the rest into one
        self.counts[key] += 1
        due = self._next.get(key)
        if due is not None and now < due:
            self._held[key] += 1
            return False
        held = self._held.pop(key, 0)
        if held:
            message += " (%d similar suppressed in the last %.0fs)"
            args = (*args, held, self.interval)
        self._next[key] = now + self.interval
        self.logger.log(level, message, *args, exc_info=exc_info)
        return True

    def forget(self, subject: str) -> None:
        """Drop the pacing state of a subject (a deconfigured peer); its counts stay."""
        for key in [k for k in self._next if k[1] == subject]:
            del self._next[key]
            self._held.pop(key, None)
