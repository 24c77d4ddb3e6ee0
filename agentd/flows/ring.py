"""The node's flow records in a bounded ring, its followers, and the drop limiter.  Pure.

:class:`FlowRing` keeps the last ``size`` records, numbered; ``GET /flows`` reads the last N
that match a filter (:class:`LastSearch`: step by step, so a large ring never holds the
event loop for long) and then, following, gets every new one through a bounded queue: a
follower that does not keep up loses records (counted, and told) rather than holding memory.

:class:`DropLimiter` is the agent's half of drop rate limiting (the kernel's is an nft
``limit`` on each log rule): at most ``rate`` records a second per (reason, source,
destination, protocol, port) key, with a burst; what goes over is counted and the next record
of that key says how many were folded into it.  Its table of keys is bounded: a storm of
spoofed sources cannot grow it without limit.  Time is passed in: the recorder passes when
the kernel logged the drop (NFULA_TIMESTAMP), so a backlog read late is judged by when its
drops happened, not by when the agent got round to them.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from .model import Flow, FlowFilter


class Deferred:
    """A record kept as the kernel's bytes until someone reads it (the recorder's conntrack
    events: most are never read before the ring drops them, and reading costs more than
    keeping).  :meth:`flow` makes the record, once."""

    __slots__ = ("seq",)
    verdict = "forwarded"

    def flow(self) -> Flow:
        raise NotImplementedError


class Batch:
    """Records the kernel laid out side by side, kept as its bytes until someone reads one (the
    pod programs' records of connections: thousands a second, most never read before the ring
    drops them).  The ring holds the batch once in each of its records' slots -- at C speed,
    no object per record -- and knows each slot's number; :meth:`flow_at` makes the record of
    number ``seq`` (the ring then keeps it in the slot, where the batch was: a batch holds
    nothing made, so a record the ring has dropped is not kept by one).  ``first``: the number
    of its first record, set by the ring."""

    __slots__ = ("count", "first")
    verdict = "forwarded"

    def __init__(self, count: int) -> None:
        self.count = count
        self.first = 0

    def flow_at(self, seq: int) -> Flow:
        flow = self.make(seq - self.first)
        flow.seq = seq
        return flow

    def make(self, index: int) -> Flow:
        raise NotImplementedError


Entry = Flow | Deferred | Batch
# Records are in the ring in the order the agent took them in (``Flow.received``: the recorder
# sets it on every record it takes in -- drops, conntrack's events, the programs' records --;
# ``Flow.time`` stands in for it where it is not set): ``since`` stops at the first record
# taken in this far before it.  A record's ``time`` alone does not order the ring: a start the
# pod programs recorded keeps its first SYN's time, up to the SYN's timeout before its answer
# let it be recorded, and a drop its kernel time, however late a busy agent read it.
SINCE_SLACK = 1.0


def record(entry: Entry, seq: int = 0) -> Flow:
    """The record an entry stands for; ``seq``: its number (read only for a :class:`Batch`)."""
    if type(entry) is Flow:
        return entry
    if isinstance(entry, Batch):
        return entry.flow_at(seq)
    return entry.flow()  # type: ignore[union-attr]


class Follower:
    """One ``--follow`` reader: new records that match its filter, in a bounded queue."""

    def __init__(self, flt: FlowFilter, limit: int, pool: str = "open") -> None:
        self.filter = flt
        self.pool = pool
        self.queue: asyncio.Queue[Flow] = asyncio.Queue(limit)
        self.lost = 0

    def offer(self, flow: Flow) -> None:
        if not self.filter.matches(flow):
            return
        try:
            self.queue.put_nowait(flow)
        except asyncio.QueueFull:
            self.lost += 1


class LastSearch:
    """The last ``n`` records of a snapshot that match a filter, newest first, ``step(k)``
    records at a time: a large ring (``[flows] ring_size`` up to a million) is searched with
    the event loop free in between, and what the ring takes in meanwhile is not in it."""

    def __init__(self, records: list[Entry], flt: FlowFilter, n: int, since: float | None, last_seq: int = 0,
                 keep: Callable[[int, Entry, Flow], None] | None = None, after: int | None = None,
                 held: int | None = None) -> None:
        """``keep(seq, entry, flow)``: told of each record made from a :class:`Batch` (the ring
        keeps it in its slot if the slot still holds the batch).  ``after``: only records
        numbered after it (a reader that had the records up to it).  ``held``: how many
        records the ring held (``len(records)`` unless they were not copied: none asked for)."""
        self.records = records  # a copy: the ring moves on while this searches
        self.first_seq = last_seq - (len(records) if held is None else held) + 1  # records[i] is number first_seq + i
        self.keep = keep
        self.filter = flt
        self.n = n
        self.since = since
        # records[i] for i < stop_at are numbered ``after`` or less
        self.stop_at = 0 if after is None else min(len(records), max(0, after - self.first_seq + 1))
        # Records numbered after ``after`` that the ring no longer holds (it wrapped since): the
        # reader is told how many (matching its filter or not), never left to think it has all.
        self.scrolled = 0 if after is None else max(0, self.first_seq - after - 1)
        # Matching records after ``after`` older than the last ``n`` (a reader more than ``n``
        # behind): counted on down to the cursor, so the reader is told how many it does not get.
        self.counting = after is not None
        self.left_out = 0
        self.found: list[Flow] = []
        self.index = len(records)  # records[index:] are searched
        self.done = n <= 0

    def step(self, k: int) -> bool:
        """Search the next ``k`` records (older ones); True once the search is over."""
        if self.done:  # the last 0 (a follower's start) is none: no record is looked at
            return True
        stop = max(self.stop_at, self.index - k)
        flt, since, found, first, keep = self.filter, self.since, self.found, self.first_seq, self.keep
        start = self.index
        if len(found) >= self.n:  # the last n found after a cursor: the older ones only counted
            self._count_left_out(start, stop)
            start = stop
        for i in range(start - 1, stop - 1, -1):
            entry = self.records[i]
            flow = record(entry, first + i)
            if keep is not None and isinstance(entry, Batch):
                keep(first + i, entry, flow)
            if since is not None and flow.time < since:
                if self._past_since(flow):
                    self.done = True
                    break
                continue
            if flt.matches(flow):
                found.append(flow)
                if len(found) >= self.n:
                    if self.counting:
                        self._count_left_out(i, stop)
                    else:
                        self.done = True
                    break
        self.index = stop
        if stop == self.stop_at:
            self.done = True
        return self.done

    def _count_left_out(self, start: int, stop: int) -> None:
        """Count the matching records of ``records[stop:start]`` into ``left_out``, up to where
        ``since`` ends the search (made to be matched, not kept made: a reader far behind would
        otherwise fill the ring with made records)."""
        flt, since, first = self.filter, self.since, self.first_seq
        for i in range(start - 1, stop - 1, -1):
            flow = record(self.records[i], first + i)
            if since is not None and flow.time < since:
                if self._past_since(flow):
                    self.done = True
                    return
                continue
            if flt.matches(flow):
                self.left_out += 1

    def _past_since(self, flow: Flow) -> bool:
        """Whether a record timed before ``since`` ends the search (``SINCE_SLACK``): it was
        received more than the slack before ``since``; else it is only skipped."""
        assert self.since is not None
        return (flow.time if flow.received is None else flow.received) < self.since - SINCE_SLACK

    def result(self) -> list[Flow]:
        """What was found, oldest first."""
        return self.found[::-1]


MAX_FOLLOWERS = 64  # followed streams of one node's records at once, in each pool (FOLLOWER_POOLS)
# A follower with a credential (another node's gatherer with the cluster read token, a local
# reader with the API token or the browser key) never waits for a place that readers without
# one hold: each pool has its own MAX_FOLLOWERS.
FOLLOWER_POOLS = ("open", "trusted")


class TooManyFollowers(Exception):
    pass


class FlowRing:
    def __init__(self, size: int, on_records: Callable[[list[Entry]], None] | None = None) -> None:
        """``on_records(entries)``: told of what each :meth:`add` or :meth:`extend` took in."""
        self.size = size
        # A fixed circle of slots (a deferred entry read is replaced by its record in place).
        self._slots: list[Entry | None] = [None] * size
        self._next = 0  # the slot the next record takes
        self._count = 0
        self.seq = 0
        # Which ring numbers its records (a node's new one after a restart numbers from 1 again):
        # a reader's ``after`` cursor holds it, and is not taken for this ring's if it is another's.
        self.id = secrets.token_hex(6)
        self.followers: set[Follower] = set()
        self.on_records = on_records
        self.on_batch: Callable[[Batch], None] | None = None  # told of a batch :meth:`extend_batch` took in whole

    def add(self, entry: Entry) -> None:
        """A record, or a :class:`Deferred` one (made when it is first read: by a follower
        at once, else by :meth:`last`, if it is still here then)."""
        self.seq += 1
        entry.seq = self.seq
        if self.followers:
            flow = record(entry)
            entry = flow
            for f in self.followers:
                f.offer(flow)
        self._slots[self._next] = entry
        self._next = (self._next + 1) % self.size
        self._count = min(self._count + 1, self.size)
        if self.on_records is not None:
            self.on_records([entry])

    def extend(self, entries: list[Entry]) -> None:
        """Records in the order given: :meth:`add` of each, in one step (a read of many events)."""
        if self.followers:
            for entry in entries:
                self.add(entry)
            return
        slots, size, slot, seq = self._slots, self.size, self._next, self.seq
        for entry in entries:
            seq += 1
            entry.seq = seq
            slots[slot] = entry
            slot += 1
            if slot == size:
                slot = 0
        self.seq, self._next = seq, slot
        self._count = min(self._count + len(entries), size)
        if self.on_records is not None and entries:
            self.on_records(entries)

    def _newest_first(self) -> Iterator[int]:
        return ((self._next - 1 - k) % self.size for k in range(self._count))

    def _record(self, slot: int) -> Flow:
        entry = self._slots[slot]
        if type(entry) is Flow:
            return entry
        flow = record(entry, self._seq_of(slot))  # type: ignore[arg-type]
        self._slots[slot] = flow
        return flow

    def extend_batch(self, batch: Batch) -> None:
        """A :class:`Batch`'s records in the order they lie: its ``count`` slots hold it (a
        follower gets each record made at once, as :meth:`add` gives it)."""
        n = batch.count
        if n <= 0:
            return
        batch.first = self.seq + 1
        if self.followers or n > self.size:
            for i in range(n):
                self.add(batch.make(i))  # told on_records of each
            return
        slots, size, slot = self._slots, self.size, self._next
        end = slot + n
        if end <= size:
            slots[slot:end] = [batch] * n
        else:
            slots[slot:] = [batch] * (size - slot)
            slots[: end - size] = [batch] * (end - size)
        self.seq += n
        self._next = end % size
        self._count = min(self._count + n, size)
        if self.on_batch is not None:
            self.on_batch(batch)

    def _seq_of(self, slot: int) -> int:
        return self.seq - (self._next - 1 - slot) % self.size

    @property
    def records(self) -> list[Entry]:
        """What the ring holds, oldest first (deferred entries as they are): two list slices,
        at C speed, however large the ring (a search starts with this copy, taken in one
        step of the event loop)."""
        if self._count < self.size:  # never wrapped: the first _next slots, in order
            return self._slots[: self._next]  # type: ignore[return-value]
        return self._slots[self._next :] + self._slots[: self._next]  # type: ignore[operator]

    def last(self, flt: FlowFilter, n: int, *, since: float | None = None) -> list[Flow]:
        """The last ``n`` records matching ``flt`` (oldest first); ``since``: only newer ones."""
        search = self.search(flt, n, since=since)
        while not search.step(self._count + 1):
            pass
        return search.result()

    def search(self, flt: FlowFilter, n: int, *, since: float | None = None, after: int | None = None) -> LastSearch:
        """The same, a step at a time (:class:`LastSearch`) over the ring as it is now;
        ``after``: only records numbered after it."""
        return LastSearch(self.records if n > 0 else [], flt, n, since, self.seq, self._keep, after, self._count)

    def _keep(self, seq: int, entry: Entry, flow: Flow) -> None:
        """A record made from ``entry`` by a search, into its slot if the slot still holds it."""
        if seq > self.seq - self._count:  # still in the ring: record ``seq`` is in slot (seq - 1) % size
            slot = (seq - 1) % self.size
            if self._slots[slot] is entry:
                self._slots[slot] = flow

    def follow(self, flt: FlowFilter, limit: int = 10_000, pool: str = "open") -> Follower:
        """A new :class:`Follower` of what comes; :class:`TooManyFollowers` past
        ``MAX_FOLLOWERS`` in its ``pool`` (each one costs every record a filter match and a decode)."""
        assert pool in FOLLOWER_POOLS, pool
        held = self.following(pool)
        if held >= MAX_FOLLOWERS:
            raise TooManyFollowers(f"{held} streams already follow this node's flow records "
                                   f"(at most {MAX_FOLLOWERS})")
        follower = Follower(flt, limit, pool)
        self.followers.add(follower)
        return follower

    def following(self, pool: str) -> int:
        """The followers of ``pool``."""
        return sum(1 for f in self.followers if f.pool == pool)

    def unfollow(self, follower: Follower) -> None:
        self.followers.discard(follower)

    def __iter__(self) -> Iterator[Flow]:
        return (self._record(slot) for slot in reversed(list(self._newest_first())))

    def __len__(self) -> int:
        return self._count


class DropLimiter:
    """Token buckets per drop key: ``allow(key, now)`` -> None (over the limit: folded) or the
    number folded since the last allowed record of ``key``.

    ``now`` is the drop's own time.  Drops logged on different CPUs may reach the agent a little
    out of order: an earlier time than the bucket's last one refills nothing (and does not move
    the bucket back), rather than taking tokens away.  One more than ``STEP`` seconds earlier is
    the wall clock stepped back (NTP, a resumed VM), not a drop out of order: the bucket's time
    goes back with it, or the key would stay folded for as long as the step.

    At ``max_keys`` a new key evicts a bucket: among the ``EVICT_SCAN`` least recently seen,
    the first that folds nothing and has refilled (forgetting it changes nothing), else the
    first that folds nothing (it comes back with a full burst), else the least recently seen,
    whose folded drops no record will show: they are counted in ``evicted``."""

    EVICT_SCAN = 32  # buckets looked at for one eviction: bounded work per new key in a storm
    STEP = 2.0  # seconds: a time this much before a bucket's is a clock step, not a drop out of order

    def __init__(self, rate: float, burst: int, max_keys: int = 4096) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self.buckets: OrderedDict[Any, list[float]] = OrderedDict()  # key -> [tokens, last, folded]
        self.suppressed = 0  # over the limit, since start
        self.evicted = 0  # of those, folded into a bucket evicted before its next record: in no record

    def _evict(self, now: float) -> None:
        buckets, burst, rate = self.buckets, float(self.burst), self.rate
        empty = None
        for n, (key, bucket) in enumerate(buckets.items()):
            if n >= self.EVICT_SCAN:
                break
            if bucket[2] == 0.0:
                if bucket[0] + max(0.0, now - bucket[1]) * rate >= burst:
                    del buckets[key]
                    return
                if empty is None:
                    empty = key
        if empty is not None:
            del buckets[empty]
            return
        _key, bucket = buckets.popitem(last=False)  # every one looked at folds drops
        self.evicted += int(bucket[2])

    def allow(self, key: Any, now: float) -> int | None:
        bucket = self.buckets.get(key)
        if bucket is None:
            if len(self.buckets) >= self.max_keys:
                self._evict(now)
            bucket = self.buckets[key] = [float(self.burst), now, 0.0]
        else:
            self.buckets.move_to_end(key)
            if now > bucket[1]:
                bucket[0] = min(float(self.burst), bucket[0] + (now - bucket[1]) * self.rate)
                bucket[1] = now
            elif now < bucket[1] - self.STEP:  # the clock stepped back: refill from now on
                bucket[1] = now
        if bucket[0] < 1.0:
            bucket[2] += 1
            self.suppressed += 1
            return None
        bucket[0] -= 1.0
        folded, bucket[2] = int(bucket[2]), 0.0
        return folded
