"""The routing information bases (RFC 4271 §3.2): Adj-RIB-In per peer, the Loc-RIB, Adj-RIB-Out.

Sized for a million prefixes in Python:

* A prefix is its wire form (``bytes``, see proto.nlri), so tables are plain dicts.
* A :class:`Path` is one set of attributes from one source and is *shared* by every
  prefix announced with it (an UPDATE with 800 prefixes makes one Path), so a prefix
  costs a dict slot in its peer's Adj-RIB-In and one in the Loc-RIB.
* A Loc-RIB slot holds the single candidate Path itself, or a tuple of candidates with
  the best first when several sources have the prefix.  Nothing else is stored per prefix:
  the reason a path won is recomputed on demand for /rib.

Changes are collected per batch (``take_changes``) so the speaker tells its listeners and
its peers about each prefix once, with the best path before and after the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple
from ipaddress import IPv4Address, IPv6Address

from proto.attributes import PathAttributes

from . import bestpath
from .settings import Family

Address = IPv4Address | IPv6Address
# Paths an Adj-RIB-In remembers by their attributes (then it starts afresh).  What repeats
# arrives as the same PathAttributes object (proto.messages caches the decoded sets of a
# session), so this only needs to span that cache; with a set per route (a pod network's
# one-prefix UPDATEs) every entry is one more dict slot per route, not a saving.
INTERNED_PATHS = 16384


class Source:
    """Where paths come from: one peer's session, or this speaker itself (``local``)."""

    __slots__ = ("key", "address", "asn", "local_asn", "router_id", "ibgp", "rr_client", "local")

    def __init__(
        self,
        key: str,
        address: Address | None,
        asn: int,
        local_asn: int,
        router_id: IPv4Address,
        *,
        ibgp: bool,
        rr_client: bool = False,
        local: bool = False,
    ) -> None:
        self.key = key
        self.address = address
        self.asn = asn
        self.local_asn = local_asn
        self.router_id = router_id
        self.ibgp = ibgp
        self.rr_client = rr_client
        self.local = local

    def __repr__(self) -> str:
        kind = "local" if self.local else ("ibgp" if self.ibgp else "ebgp")
        return f"<Source {self.key} {kind} as{self.asn}>"


class Path:
    """A set of path attributes and a next hop from one source, shared by many prefixes.

    ``stale`` is set when the source's session went down gracefully (RFC 4724 §4.2)
    and the path is kept only until the peer refreshes or the restart timer runs out.
    """

    __slots__ = ("source", "attributes", "next_hop", "stale")

    def __init__(self, source: Source, attributes: PathAttributes, next_hop: Address | None) -> None:
        self.source = source
        self.attributes = attributes
        self.next_hop = next_hop
        self.stale = False

    def __repr__(self) -> str:
        return f"<Path from {self.source.key} nh={self.next_hop}{' stale' if self.stale else ''}>"


class BestPathChange(NamedTuple):
    """The Loc-RIB best path of ``prefix`` changed: added (old None), replaced, or withdrawn (new None).

    A NamedTuple, not a dataclass: a million of these are made when a full table arrives."""

    family: Family
    prefix: bytes
    old: Path | None
    new: Path | None


Batch = tuple[dict[bytes, "Path | None"], list[list[bytes]]]


class AdjRibIn:
    """Routes one peer (or the local origination) gave us, per family: prefix -> Path."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.tables: dict[Family, dict[bytes, Path]] = {}
        # Keyed by the attributes alone when the next hop is theirs (NEXT_HOP, the IPv4 NLRI
        # field's case): no key tuple per path when every route has its own attribute set.
        self._interned: dict[PathAttributes | tuple[PathAttributes, Address | None], Path] = {}

    def own_path(self, attributes: PathAttributes, next_hop: Address | None) -> Path:
        """path() when ``next_hop`` is known to be the attributes' own NEXT_HOP (the IPv4 NLRI's
        case), which keys the path by the attributes alone."""
        return self._shared(attributes, attributes, next_hop)

    def path(self, attributes: PathAttributes, next_hop: Address | None) -> Path:
        """The shared Path for these attributes from this source (fresh, not stale)."""
        own = attributes.next_hop
        key = attributes if next_hop is own or (next_hop is not None and next_hop == own) else (attributes, next_hop)
        return self._shared(key, attributes, next_hop)

    def _shared(self, key: PathAttributes | tuple[PathAttributes, Address | None], attributes: PathAttributes,
                next_hop: Address | None) -> Path:  # fmt: skip
        p = self._interned.get(key)
        if p is None or p.stale:
            p = Path(self.source, attributes, next_hop)
            if len(self._interned) > INTERNED_PATHS:
                self._interned.clear()
            self._interned[key] = p
        return p

    def table(self, family: Family) -> dict[bytes, Path]:
        t = self.tables.get(family)
        if t is None:
            t = self.tables[family] = {}
        return t

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables.values())

    def count(self, family: Family) -> int:
        return len(self.tables.get(family, ()))


class Rib:
    """Adj-RIBs-In for every source plus the Loc-RIB, with per-batch change tracking."""

    def __init__(self) -> None:
        self.adj_in: dict[str, AdjRibIn] = {}
        self.loc: dict[Family, dict[bytes, Path | tuple[Path, ...]]] = {}
        self._changes: dict[Family, dict[bytes, Path | None]] = {}
        # Prefix lists announced fresh (no best before) in this batch, not yet in _changes.
        self._fresh: dict[Family, list[list[bytes]]] = {}
        self._new_best: dict[Family, set[Path]] = {}
        self.promoted: dict[Family, set[Path]] = {}

    # ------------------------------------------------------------ sources

    def attach(self, source: Source) -> AdjRibIn:
        """Start (or continue, after a graceful restart) taking routes from ``source.key``."""
        adj = self.adj_in.get(source.key)
        if adj is None:
            adj = self.adj_in[source.key] = AdjRibIn(source)
        else:
            adj.source = source
            adj._interned.clear()
        return adj

    # ------------------------------------------------------------ updates

    def announce(self, key: str, family: Family, prefixes: Iterable[bytes], path: Path) -> None:
        # (The helpers table(), _loc() and _promoted() written out: this runs once per UPDATE.)
        tables = self.adj_in[key].tables
        adj = tables.get(family)
        if adj is None:
            adj = tables[family] = {}
        loc = self.loc.get(family)
        if loc is None:
            loc = self.loc[family] = {}
        promoted = self._new_best.get(family)
        if promoted is None:
            promoted = self._new_best[family] = set()
        promoted.add(path)
        if not isinstance(prefixes, (list, tuple)):
            prefixes = list(prefixes)
        # The common case when a table arrives: prefixes nobody had.  Then dict operations in
        # C do it all, no Python loop per prefix, and the batch remembers the list itself ("best
        # was None").  Every Adj-RIB-In prefix is in the Loc-RIB, so equal sizes mean this
        # source holds every Loc-RIB prefix (a single feed, or the first one): then whether the
        # prefixes were new shows in how much this Adj-RIB-In grew, and they need no lookup
        # in the Loc-RIB beforehand.  Otherwise the Loc-RIB is asked first.
        fresh = dict.fromkeys(prefixes, path)
        if len(loc) == len(adj):
            before = len(adj)
            adj.update(fresh)
            if len(adj) - before == len(fresh):
                loc.update(fresh)
                lists = self._fresh.get(family)
                if lists is None:
                    lists = self._fresh[family] = []
                # The list itself, unless it named a prefix twice (then the deduplicated keys).
                lists.append(prefixes if len(fresh) == len(prefixes) else list(fresh))
                return
            adj_done = True  # some were known: merged one by one below (adj already holds path)
        elif not loc or loc.keys().isdisjoint(fresh):
            adj.update(fresh)
            loc.update(fresh)
            self._remember_fresh(family, prefixes, fresh)
            return
        else:
            adj_done = False
        changes = self._changes_for(family)
        for prefix in prefixes:
            if not adj_done:
                if adj.get(prefix) is path:
                    continue  # the same announcement again
                adj[prefix] = path
            cur = loc.get(prefix)
            if cur is None:
                loc[prefix] = path
                if prefix not in changes:
                    changes[prefix] = None
            elif type(cur) is Path:
                if prefix not in changes:
                    changes[prefix] = cur
                if cur.source.key == key:
                    loc[prefix] = path
                else:
                    loc[prefix] = new = _ordered((cur, path))
                    promoted.add(new[0])
            else:
                if prefix not in changes:
                    changes[prefix] = cur[0]
                # An implicit withdraw (RFC 4271 §3.1) can make another source's path the best:
                # that path is a new best of this batch too (Output.flush looks at promoted).
                loc[prefix] = new = _ordered([c for c in cur if c.source.key != key] + [path])
                promoted.add(new[0])

    def _remember_fresh(self, family: Family, prefixes: list[bytes] | tuple[bytes, ...], fresh: dict) -> None:
        # The list itself, unless it named a prefix twice (then the deduplicated keys).
        self._fresh.setdefault(family, []).append(prefixes if len(fresh) == len(prefixes) else list(fresh))

    def withdraw(self, key: str, family: Family, prefixes: Iterable[bytes]) -> None:
        adj_rib = self.adj_in.get(key)
        if adj_rib is None:
            return
        adj = adj_rib.table(family)
        loc = self._loc(family)
        changes = self._changes_for(family)
        for prefix in prefixes:
            if adj.pop(prefix, None) is None:
                continue
            self._remove_candidate(loc, changes, prefix, key, family)

    def _remove_candidate(self, loc: dict, changes: dict, prefix: bytes, key: str, family: Family) -> None:
        cur = loc.get(prefix)
        if cur is None:
            return
        if type(cur) is Path:
            if cur.source.key == key:
                if prefix not in changes:
                    changes[prefix] = cur
                del loc[prefix]
            return
        rest = [c for c in cur if c.source.key != key]
        if len(rest) == len(cur):
            return
        if prefix not in changes:
            changes[prefix] = cur[0]
        loc[prefix] = new = rest[0] if len(rest) == 1 else _ordered(rest)
        self._promoted(family).add(new if type(new) is Path else new[0])

    def drop(self, key: str) -> int:
        """Withdraw everything from ``key`` (session down without graceful restart); returns count."""
        adj_rib = self.adj_in.pop(key, None)
        if adj_rib is None:
            return 0
        n = 0
        for family, table in adj_rib.tables.items():
            loc = self._loc(family)
            changes = self._changes_for(family)
            for prefix in table:
                self._remove_candidate(loc, changes, prefix, key, family)
            n += len(table)
        return n

    def mark_stale(self, key: str, families: Iterable[Family] | None = None) -> int:
        """RFC 4724 §4.2: keep ``key``'s routes but mark them stale; returns how many."""
        adj_rib = self.adj_in.get(key)
        if adj_rib is None:
            return 0
        n = 0
        keep = set(families) if families is not None else set(adj_rib.tables)
        for family in list(adj_rib.tables):
            if family not in keep:
                self.purge_stale(key, family, all_routes=True)
                continue
            table = adj_rib.tables[family]
            for path in {id(p): p for p in table.values()}.values():
                path.stale = True
            n += len(table)
            # A stale path now loses to fresh ones: re-rank prefixes that have competitors.
            loc = self._loc(family)
            changes = self._changes_for(family)
            for prefix in table:
                cur = loc.get(prefix)
                if type(cur) is tuple:
                    new = _ordered(cur)
                    if new[0] is not cur[0]:
                        self._promoted(family).add(new[0])
                        if prefix not in changes:
                            changes[prefix] = cur[0]
                    loc[prefix] = new
        adj_rib._interned.clear()
        return n

    def purge_stale(self, key: str, family: Family | None = None, *, all_routes: bool = False) -> int:
        """Remove ``key``'s routes still stale (End-of-RIB received or restart timer expired)."""
        adj_rib = self.adj_in.get(key)
        if adj_rib is None:
            return 0
        families = [family] if family is not None else list(adj_rib.tables)
        n = 0
        for fam in families:
            table = adj_rib.tables.get(fam)
            if not table:
                continue
            gone = [p for p, path in table.items() if all_routes or path.stale]
            self.withdraw(key, fam, gone)
            n += len(gone)
        return n

    def stale_count(self, key: str) -> int:
        adj_rib = self.adj_in.get(key)
        if adj_rib is None:
            return 0
        return sum(1 for t in adj_rib.tables.values() for p in t.values() if p.stale)

    # ------------------------------------------------------------ reading

    def best(self, family: Family, prefix: bytes) -> Path | None:
        cur = self.loc.get(family, {}).get(prefix)
        if cur is None or type(cur) is Path:
            return cur
        return cur[0]

    def candidates(self, family: Family, prefix: bytes) -> tuple[Path, ...]:
        cur = self.loc.get(family, {}).get(prefix)
        if cur is None:
            return ()
        return (cur,) if type(cur) is Path else cur

    def bests(self, family: Family) -> Iterator[tuple[bytes, Path]]:
        for prefix, cur in self.loc.get(family, {}).items():
            yield prefix, (cur if type(cur) is Path else cur[0])

    def families(self) -> list[Family]:
        return [f for f, t in self.loc.items() if t]

    def count(self, family: Family | None = None) -> int:
        if family is not None:
            return len(self.loc.get(family, ()))
        return sum(len(t) for t in self.loc.values())

    # ------------------------------------------------------------ batching

    def take_batch(self) -> dict[Family, Batch]:
        """This batch's changes, raw, and resets the batch.  Per family: a dict prefix -> the best
        path before the batch, and lists of prefixes that had no best before (a table arriving);
        the current best is in ``loc``.  Nothing is allocated per prefix, which matters for a full
        table; :meth:`changes_of` makes the readable form.  :attr:`promoted` then holds, per
        family, every path that became a best in the batch."""
        batch = {
            family: (self._changes.get(family) or {}, self._fresh.get(family) or [])
            for family in set(self._changes) | set(self._fresh)
        }
        self._changes, self._fresh = {}, {}
        self.promoted, self._new_best = self._new_best, {}
        return batch

    def changed(self, family: Family, entry: Batch) -> Iterator[tuple[bytes, Path | None]]:
        """``(prefix, new best)`` for the prefixes of one family whose best path really changed."""
        changes, fresh = entry
        get = self.loc.get(family, {}).get
        for prefix, old in changes.items():
            cur = get(prefix)
            new = cur if cur is None or type(cur) is Path else cur[0]
            if new is not old:
                yield prefix, new
        for prefixes in fresh:
            for prefix in prefixes:
                # A prefix changed earlier in the batch and then announced fresh was reported
                # (or found unchanged) by the loop above.
                if changes and prefix in changes:
                    continue
                cur = get(prefix)
                if cur is not None:
                    yield prefix, (cur if type(cur) is Path else cur[0])

    def changes_of(self, batch: dict[Family, Batch]) -> list[BestPathChange]:
        make = BestPathChange._make
        out: list[BestPathChange] = []
        for family, entry in batch.items():
            changes = entry[0]
            out.extend(make((family, prefix, changes.get(prefix), new)) for prefix, new in self.changed(family, entry))
        return out

    def take_changes(self) -> list[BestPathChange]:
        """Prefixes whose best path differs from what it was before the batch; resets the batch."""
        return self.changes_of(self.take_batch())

    def has_changes(self) -> bool:
        return any(self._changes.values()) or any(self._fresh.values())

    def _loc(self, family: Family) -> dict[bytes, Path | tuple[Path, ...]]:
        t = self.loc.get(family)
        if t is None:
            t = self.loc[family] = {}
        return t

    def _promoted(self, family: Family) -> set[Path]:
        p = self._new_best.get(family)
        if p is None:
            p = self._new_best[family] = set()
        return p

    def _changes_for(self, family: Family) -> dict[bytes, Path | None]:
        """The batch's prefix -> old-best dict, with fresh lists folded in first (any change
        other than a fresh announcement may touch a prefix that was fresh in this batch)."""
        c = self._changes.get(family)
        if c is None:
            c = self._changes[family] = {}
        fresh = self._fresh.pop(family, None)
        if fresh:
            if c:
                # A prefix can be fresh after an earlier change in this batch (withdrawn, then
                # announced again): its entry already holds the best from before the batch.
                setdefault = c.setdefault
                for prefixes in fresh:
                    for prefix in prefixes:
                        setdefault(prefix, None)
            else:
                for prefixes in fresh:
                    c.update(dict.fromkeys(prefixes))
        return c


def _ordered(candidates: Iterable[Path]) -> tuple[Path, ...]:
    cands = list(candidates)
    best, _ = bestpath.select(cands)
    return (best, *[c for c in cands if c is not best])
