"""The Adj-RIB-Out as update groups: one computed table and one encoded stream per kind of peer.

Peers that get the same export — same iBGP/eBGP role, route-reflector client or not, our
address toward them, negotiated families and codec — form an :class:`UpdateGroup` (FRR's
update groups, GoBGP's peer groups).  The group computes each route once
(:func:`bgp.policy.export_route`), keeps it once in its table, and encodes each change
once into a log of UPDATEs that every member reads from its own position.  The two rules
that depend on the member itself (never back to the peer a route came from, never a
reflected route to its originator) travel with the route (:meth:`OutRoute.excludes`): a
member that must not have an announcement gets its withdrawal instead.  So memory grows
with routes + peers, not routes x peers.

Output is pulled, never pushed: a member is given UPDATEs only while its socket takes
them (:meth:`UpdateGroup.pump` with a byte budget), so a peer that stops reading costs a
log position, not a growing buffer.  What a member is given is the group's own objects
(an entry's messages, a send window's joined :class:`_Segment`, slices of it around the
entries that exclude the member), never a copy per member: a reflector's N clients waiting
on their sockets hold one stream between them, not N.  A member that falls more than :data:`LOG_LIMIT`
octets behind leaves the log and keeps, instead, the set of prefixes it has not been told
about; it is sent their current state from the table when it reads again, then rejoins
the log.  Full sends (after Established, on ROUTE-REFRESH) are cursors over the table,
read a chunk at a time and always after the member has caught up with the log, so
whatever a member is sent is the table's state at that moment and never older than what
it already has.

A route that cannot be encoded for a group (too large once our attributes are added, say)
is kept out of its table and logged: it is never sent, never counted as sent, and never
aborts the rest of the batch.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from ipaddress import IPv4Address

from proto.messages import CodecContext, Update, encode_updates, encode_withdrawals

from .loglimit import LogLimiter
from .policy import ExportTarget, OutRoute, export_route
from .rib import Path
from .settings import Family, LocalSettings

log = logging.getLogger("bgp.export")

#: Octets of UPDATEs a group keeps for members that have not read them yet.
LOG_LIMIT = 4 * 1024 * 1024
#: Prefixes looked at per step of a full send, a catch-up or a group's first build.
STEP_PREFIXES = 2048


@dataclass(frozen=True)
class GroupKey:
    """Everything the export of a route to a peer depends on, except the peer itself."""

    target: ExportTarget
    families: frozenset[Family]
    ctx: CodecContext


class _Entry:
    """One change in a group's log: UPDATEs announcing ``prefixes`` with ``out``, or
    withdrawing them (``out`` None).  ``before`` is what the table held for each prefix
    (what a member the announcement excludes may have had from us)."""

    __slots__ = ("family", "prefixes", "out", "messages", "size", "before")

    def __init__(
        self, family: Family, prefixes: list[bytes], out: OutRoute | None, messages: list[bytes],
        before: list[OutRoute | None] | None = None,
    ) -> None:  # fmt: skip
        self.family = family
        self.prefixes = prefixes
        self.out = out
        self.messages = messages
        self.size = sum(map(len, messages))
        self.before = before

    def messages_for(self, member: Member, ctx: CodecContext) -> list[bytes]:
        out = self.out
        if out is not None and out.excludes(member.key, member.router_id):
            # The member must not have this route: withdraw what it may have had from us before.
            key, rid = member.key, member.router_id
            had = [p for p, b in zip(self.prefixes, self.before or ()) if b is not None and not b.excludes(key, rid)]
            return encode_withdrawals(self.family[0], had, ctx) if had else []
        return self.messages


class _Segment:
    """The log entries [start, end) joined into one bytes object for every member that reads
    exactly that stretch: after a send window, all members of a group read the same stretch,
    so it is joined once instead of once per member.

    A member that some of the stretch excludes (its own route, a route it originated; in a
    route reflector's window of new client routes that is nearly every member) is given the
    same object in slices around those entries, with its replacement for each in between
    (:meth:`pieces_for`): what it holds of the stream is a few views of the shared bytes,
    never a private copy of the whole stretch."""

    __slots__ = ("start", "end", "data", "_spans", "_by_source", "_by_originator")

    def __init__(self, start: int, end: int, entries: list[_Entry], ctx: CodecContext) -> None:
        self.start = start
        self.end = end
        parts: list[bytes] = []
        #: Where each announcement sits in ``data`` (announcements are written as they are logged).
        self._spans: list[tuple[int, int, _Entry]] = []
        self._by_source: dict[str, list[int]] = {}
        self._by_originator: dict[IPv4Address, list[int]] = {}
        size = 0
        for e, msgs in _packed(entries, ctx):
            parts.extend(msgs)
            n = sum(map(len, msgs))
            if e is not None:
                out = e.out
                assert out is not None
                i = len(self._spans)
                self._spans.append((size, size + n, e))
                self._by_source.setdefault(out.source, []).append(i)
                if out.originator is not None:
                    self._by_originator.setdefault(out.originator, []).append(i)
            size += n
        self.data = b"".join(parts)

    def pieces_for(self, m: Member, ctx: CodecContext) -> list[bytes | memoryview]:
        """What member ``m`` is sent of the stretch: the shared bytes, in slices around the
        entries that exclude it, each replaced by what it gets for that entry instead."""
        excluded = self._by_source.get(m.key, [])
        if m.router_id is not None:
            excluded = excluded + self._by_originator.get(m.router_id, [])
        if not excluded:
            return [self.data]
        view = memoryview(self.data)
        pieces: list[bytes | memoryview] = []
        at = 0
        for i in sorted(set(excluded)):
            begin, end, e = self._spans[i]
            if begin > at:
                pieces.append(view[at:begin])
            pieces.extend(e.messages_for(m, ctx))
            at = end
        if at < len(self.data):
            pieces.append(view[at:])
        return pieces


def _packed(entries: list[_Entry], ctx: CodecContext) -> Iterator[tuple[_Entry | None, list[bytes]]]:
    """The entries' messages in order, each announcement as ``(entry, its messages)``; each run
    of withdrawals of one family comes as ``(None, as few UPDATEs as they fit in)``
    (withdrawals that arrived one at a time leave together)."""
    run: list[bytes] = []
    family: Family | None = None
    for e in entries:
        if e.out is None and (family is None or e.family == family):
            run.extend(e.prefixes)
            family = e.family
            continue
        if run:
            yield None, encode_withdrawals(family[0], run, ctx)  # type: ignore[index]
            run, family = [], None
        if e.out is None:
            run.extend(e.prefixes)
            family = e.family
        else:
            yield e, e.messages
    if run:
        yield None, encode_withdrawals(family[0], run, ctx)  # type: ignore[index]


class _Cursor:
    """A full send of one family: the table's prefixes as of its start, read in chunks."""

    __slots__ = ("prefixes", "index")

    def __init__(self, prefixes: list[bytes]) -> None:
        self.prefixes = prefixes
        self.index = 0


class Member:
    """One peer in a group: where it is in the log and what full sends it still needs."""

    __slots__ = ("key", "router_id", "pos", "dirty", "cursors", "eor")

    def __init__(self, key: str, router_id: IPv4Address | None) -> None:
        self.key = key
        self.router_id = router_id
        self.pos: int | None = None  # next log sequence number to send; None: detached
        self.dirty: dict[Family, dict[bytes, None]] = {}  # detached: prefixes to bring up to date
        self.cursors: dict[Family, _Cursor] = {}
        self.eor: set[Family] = set()  # End-of-RIB still owed after the initial send

    def __repr__(self) -> str:
        return f"<Member {self.key} pos={self.pos} cursors={list(self.cursors)}>"


class UpdateGroup:
    def __init__(self, key: GroupKey, local: LocalSettings, limiter: LogLimiter) -> None:
        self.key = key
        self.target = key.target
        self.ctx = key.ctx
        self.families = key.families
        self.local = local
        self.limiter = limiter
        self.tables: dict[Family, dict[bytes, OutRoute]] = {f: {} for f in key.families}
        self.members: dict[str, Member] = {}
        self._log: list[_Entry] = []
        self._base = 0  # sequence number of _log[0]
        self._log_size = 0
        self._at: Counter[int] = Counter()  # attached members per log position
        self._detached: dict[str, Member] = {}  # members that left the log (see _shed)
        self._segment: _Segment | None = None
        #: Families whose first computation from the Loc-RIB is still going on.
        self.building: dict[Family, _Cursor] = {}
        #: End-of-RIB is held from every member (RFC 4724 §4.1: a restarting speaker defers
        #: route selection, and so its End-of-RIB, until its peers' End-of-RIB or a timer).
        self.hold_eor = False
        #: Families where routes whose best path came from the group's only member were held
        #: back: nobody here could have them, so they are exported only once a second member
        #: joins (a feed of a million routes from one peer costs no export work, and no
        #: memory per prefix, for that peer's own group).  Which prefixes is not kept: the
        #: join recomputes the family from the Loc-RIB (:meth:`take_deferred`).
        self.deferred: set[Family] = set()
        # Exclusion counts, for each member's count of routes sent.
        self._by_source: Counter[str] = Counter()
        self._by_originator: Counter[IPv4Address] = Counter()
        self._by_both: Counter[tuple[str, IPv4Address]] = Counter()
        self.not_encodable = 0  # routes kept out of the table because they do not encode

    def __repr__(self) -> str:
        return f"<UpdateGroup ibgp={self.target.ibgp} rr_client={self.target.rr_client} members={len(self.members)}>"

    @property
    def head(self) -> int:
        return self._base + len(self._log)

    # ------------------------------------------------------------ membership

    def join(self, key: str, router_id: IPv4Address | None) -> Member:
        """A peer reached Established: it is sent the whole table, then End-of-RIB."""
        m = Member(key, router_id)
        self._attach(m, self.head)
        for family in sorted(self.families):
            m.cursors[family] = _Cursor(list(self.tables[family]))
            m.eor.add(family)
        self.members[key] = m
        return m

    def take_deferred(self) -> list[Family]:
        """Families with routes held back while the group had one member (see ``deferred``),
        and forgets them: once a second member joined, the caller starts a build of each
        from the Loc-RIB (the new member reads the result from the log; its End-of-RIB
        waits for it).  Prefixes the table already holds as computed cost a comparison."""
        if len(self.members) < 2 or not self.deferred:
            return []
        families = sorted(self.deferred)
        self.deferred.clear()
        return families

    def leave(self, key: str) -> None:
        m = self.members.pop(key, None)
        if m is not None:
            self._detach(m, leaving=True)
        self._trim()

    def _attach(self, m: Member, pos: int) -> None:
        m.pos = pos
        self._at[pos] += 1
        self._detached.pop(m.key, None)

    def _detach(self, m: Member, *, leaving: bool = False) -> None:
        if m.pos is not None:
            self._at[m.pos] -= 1
            if not self._at[m.pos]:
                del self._at[m.pos]
            m.pos = None
        if leaving:
            self._detached.pop(m.key, None)
        else:
            self._detached[m.key] = m

    def refresh(self, key: str, family: Family) -> None:
        """RFC 2918: send the member the table for ``family`` again (restarting any full send
        of it that is under way: the peer asked again, so it needs everything again)."""
        m = self.members.get(key)
        if m is not None and family in self.families:
            m.cursors[family] = _Cursor(list(self.tables[family]))

    def sent_count(self, key: str) -> int:
        """Routes in the table that ``key`` may have (when it is up to date: has)."""
        m = self.members.get(key)
        if m is None:
            return 0
        n = sum(len(t) for t in self.tables.values())
        rid = m.router_id
        return n - self._by_source[key] - (self._by_originator[rid] - self._by_both[(key, rid)] if rid else 0)

    def exports(self, path: Path, family: Family) -> bool:
        """Whether ``path`` is exported to peers of this group at all (before exclusions)."""
        return export_route(path, family[0], self.target, self.local) is not None

    def in_sync(self, key: str) -> bool:
        m = self.members.get(key)
        return m is not None and m.pos == self.head and not m.cursors and not m.dirty and not m.eor

    # ------------------------------------------------------------ changes

    def start_build(self, family: Family, prefixes: list[bytes]) -> None:
        """Compute the table of a new group from the Loc-RIB's prefixes, a step at a time."""
        self.building[family] = _Cursor(prefixes)

    def build_step(self, best: Callable[[Family, bytes], Path | None], budget: int, now: float) -> int:
        """One step of the first computation; returns how many prefixes it looked at."""
        done = 0
        for family, cur in list(self.building.items()):
            chunk = cur.prefixes[cur.index : cur.index + budget - done]
            cur.index += len(chunk)
            self.apply(family, [(p, best(family, p)) for p in chunk], now)
            done += len(chunk)
            if cur.index >= len(cur.prefixes):
                del self.building[family]
            if done >= budget:
                break
        return done

    def apply(self, family: Family, pairs: Iterable[tuple[bytes, Path | None]], now: float) -> None:
        """The Loc-RIB best path of these prefixes changed: update the table and log the difference."""
        table = self.tables.get(family)
        if table is None:
            return
        afi = family[0]
        target, local = self.target, self.local
        exported: dict[int, OutRoute | None] = {}
        announce: dict[OutRoute, list[tuple[bytes, OutRoute | None]]] = {}
        withdrawn: list[bytes] = []
        deferred = False
        solo = next(iter(self.members)) if len(self.members) == 1 else None
        for prefix, new in pairs:
            if solo is not None and new is not None and new.source.key == solo:
                cur = table.get(prefix)
                if cur is None or cur.source == solo:
                    # The only member's own route, where it never had one from us: defer.
                    if cur is not None:
                        del table[prefix]
                        self._count(cur, -1)
                    deferred = True
                    continue
            if new is None:
                desired = None
            else:
                k = id(new)
                if k in exported:
                    desired = exported[k]
                else:
                    desired = exported[k] = export_route(new, afi, target, local)
            cur = table.get(prefix)
            if desired is None:
                if cur is not None:
                    del table[prefix]
                    self._count(cur, -1)
                    withdrawn.append(prefix)
                continue
            if cur is not None and (cur is desired or cur == desired):
                continue
            group = announce.get(desired)
            if group is None:
                group = announce[desired] = []
            group.append((prefix, cur))
        for out, items in announce.items():
            prefixes = [p for p, _ in items]
            try:
                messages = encode_updates(afi, out.attributes, out.next_hop, prefixes, self.ctx)
            except ValueError as err:
                # Not for this group (it would not fit, say): never sent, never counted as
                # sent; whatever the group advertised before for these prefixes goes.
                self.not_encodable += len(prefixes)
                self.limiter.log(
                    logging.WARNING, "not-encodable", out.source, now,
                    "route(s) from %s not sent to %s peers: %s", out.source, _kind(self.target), err,
                )
                for prefix, cur in items:
                    if cur is not None:
                        del table[prefix]
                        self._count(cur, -1)
                        withdrawn.append(prefix)
                continue
            if len(prefixes) == 1:
                out.wire = (prefixes[0], messages)
            for prefix, cur in items:
                if cur is not None:
                    self._count(cur, -1)
                table[prefix] = out
            self._count(out, len(items))
            self._append(_Entry(family, prefixes, out, messages, [cur for _, cur in items]))
        if withdrawn:
            self._append(_Entry(family, withdrawn, None, encode_withdrawals(afi, withdrawn, self.ctx)))
        if deferred:
            self.deferred.add(family)

    def _count(self, out: OutRoute, n: int) -> None:
        # A key that reaches 0 goes: a reflector's long-lived client group sees listen-range
        # clients (sources, originators) come and go, and must not keep one entry per client
        # it ever had.  (Reading a missing key gives 0 and adds nothing: sent_count.)
        _add(self._by_source, out.source, n)
        if out.originator is not None:
            _add(self._by_originator, out.originator, n)
            _add(self._by_both, (out.source, out.originator), n)

    def _append(self, entry: _Entry) -> None:
        for m in self._detached.values():
            d = m.dirty.get(entry.family)
            if d is None:
                d = m.dirty[entry.family] = {}
            d.update(dict.fromkeys(entry.prefixes))
        if len(self._detached) == len(self.members):
            return  # nobody reads the log: it would only be trimmed away
        self._log.append(entry)
        self._log_size += entry.size
        if self._log_size > LOG_LIMIT:
            self._shed()

    # ------------------------------------------------------------ output

    def has_work(self, m: Member) -> bool:
        return bool(m.pos != self.head or m.cursors or m.dirty or (m.eor and not self._eor_blocked(m)))

    def _eor_blocked(self, m: Member) -> bool:
        return self.hold_eor or any(f in self.building or f in m.cursors for f in m.eor)

    def pump(self, key: str, budget: int) -> list[bytes | memoryview]:
        """Up to about ``budget`` octets of UPDATEs for member ``key``: the log first, then its
        catch-up, then its full sends, then End-of-RIB where one is owed and due."""
        m = self.members[key]
        out: list[bytes | memoryview] = []
        size = 0
        ctx = self.ctx
        if m.pos is not None:
            log_, base, head = self._log, self._base, self.head
            start = pos = m.pos
            seg = self._segment
            if start < head and (seg is None or seg.start != start or seg.end != head):
                if head - start > 1 and self._at.get(start, 0) > 1:
                    seg = self._segment = _Segment(start, head, log_[start - base : head - base], ctx)
            if seg is not None and seg.start == start and seg.end == head:
                out.extend(seg.pieces_for(m, ctx))
                size += len(seg.data)
                pos = head
            while pos < head:
                e = log_[pos - base]
                out.extend(e.messages_for(m, ctx))
                size += e.size
                pos += 1
                if size >= budget:
                    break
            if pos != start:
                at = self._at
                at[start] -= 1
                if not at[start]:
                    del at[start]
                at[pos] += 1
                m.pos = pos
                if start == base:
                    self._trim()
            if pos < head:
                return out
        else:
            size += self._catch_up(m, out, budget - size)
            if m.dirty:
                return out
            self._attach(m, self.head)  # up to date with the table: back in the log
        for family, cur in list(m.cursors.items()):
            if size >= budget:
                return out
            size += self._send_cursor(m, family, cur, out, budget - size)
            if cur.index >= len(cur.prefixes):
                del m.cursors[family]
        if m.eor and m.pos == self.head and not self.hold_eor:
            for family in sorted(m.eor):
                if family not in self.building and family not in m.cursors:
                    out.append(Update.end_of_rib_marker(*family).encode(ctx))
                    m.eor.discard(family)
        return out

    def _send_cursor(self, m: Member, family: Family, cur: _Cursor, out: list[bytes | memoryview], budget: int) -> int:
        table = self.tables[family]
        chunk = cur.prefixes[cur.index : cur.index + STEP_PREFIXES]
        cur.index += len(chunk)
        groups: dict[OutRoute, list[bytes]] = {}
        for p in chunk:
            r = table.get(p)
            if r is None or r.excludes(m.key, m.router_id):
                continue  # gone since (a withdrawal went through the log) or not for this member
            g = groups.get(r)
            if g is None:
                groups[r] = [p]
            else:
                g.append(p)
        return self._encode(family, groups, (), out)

    def _catch_up(self, m: Member, out: list[bytes | memoryview], budget: int) -> int:
        size = 0
        for family in list(m.dirty):
            d = m.dirty[family]
            table = self.tables[family]
            while d and size < budget:
                chunk = list(itertools.islice(d, STEP_PREFIXES))
                for p in chunk:
                    del d[p]
                groups: dict[OutRoute, list[bytes]] = {}
                gone: list[bytes] = []
                for p in chunk:
                    r = table.get(p)
                    if r is None or r.excludes(m.key, m.router_id):
                        gone.append(p)  # it may have had an older announcement: withdraw
                        continue
                    g = groups.get(r)
                    if g is None:
                        groups[r] = [p]
                    else:
                        g.append(p)
                size += self._encode(family, groups, gone, out)
            if not d:
                del m.dirty[family]
            if size >= budget:
                break
        return size

    def _encode(self, family: Family, groups: dict[OutRoute, list[bytes]], gone: Iterable[bytes], out: list[bytes | memoryview]) -> int:
        afi, ctx = family[0], self.ctx
        size = 0
        gone = list(gone)
        if gone:
            msgs = encode_withdrawals(afi, gone, ctx)
            out.extend(msgs)
            size += sum(map(len, msgs))
        for r, prefixes in groups.items():
            wire = r.wire
            if wire is not None and len(prefixes) == 1 and wire[0] == prefixes[0]:
                msgs = wire[1]
            else:
                # Routes in the table encoded once already; more prefixes per UPDATE never
                # need more room per prefix, so this cannot fail where that did not.
                msgs = encode_updates(afi, r.attributes, r.next_hop, prefixes, ctx)
            out.extend(msgs)
            size += sum(map(len, msgs))
        return size

    # ------------------------------------------------------------ the log

    def _trim(self) -> None:
        """Drop the log entries every attached member has read (O(1) when nobody moved off
        the oldest position: members are counted per position)."""
        at, head = self._at, self.head
        low = self._base
        while low < head and not at.get(low):
            low += 1
        drop = low - self._base
        if drop > 0:
            self._log_size -= sum(e.size for e in self._log[:drop])
            del self._log[:drop]
            self._base = low

    def _shed(self) -> None:
        """The log holds more than LOG_LIMIT octets: detach the members furthest behind
        (they remember which prefixes they missed instead) until it fits."""
        while self._log_size > LOG_LIMIT:
            attached = [m for m in self.members.values() if m.pos is not None]
            if not attached:
                break
            low = min(m.pos for m in attached)  # type: ignore[type-var]
            if low == self.head:
                break
            for m in attached:
                if m.pos == low:
                    for e in self._log[low - self._base :]:
                        d = m.dirty.get(e.family)
                        if d is None:
                            d = m.dirty[e.family] = {}
                        d.update(dict.fromkeys(e.prefixes))
                    self._detach(m)
            self._trim()


def _add(counter: Counter, key: object, n: int) -> None:
    v = counter[key] + n
    if v:
        counter[key] = v
    else:
        del counter[key]


def _kind(t: ExportTarget) -> str:
    if not t.ibgp:
        return "external"
    return "route-reflector-client" if t.rr_client else "internal"
