"""Route planning: desired routes vs. our routes in the kernel -> the operations that close
the gap.  Pure: no sockets, no asyncio, no clock; agentd.kernel.routing runs it.

``RouteState`` is what the route programmer knows: the caller's desired routes, our routes
the kernel holds (one per destination, plus "strays": other routes of ours, always
deleted), the destinations that changed since the last reconcile, and the failures and
conflicts of earlier reconciles.  ``plan()`` turns it into adds, replaces and deletes;
``installed()``/``deleted()`` record what the kernel acknowledged; the ``*_event`` methods
record what the monitor saw others do.

The rule that makes restarts gapless lives here too: until the caller declared its whole
desired set once (``set_desired``), nothing is deleted as "not desired", only what it
``discard()``-ed and our second routes of a destination it ``upsert()``-ed.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from typing import NamedTuple

from agentd.kernel.route_adopt import file_group, file_route
from agentd.kernel.route_model import (
    Group,
    InvalidRoute,
    Route,
    RouteCounters,
    Stray,
    Unreadable,
    canonical_dst,
    hop_of,
    kernel_metric,
    real_gateway,
    same_route,
    stray_of,
    stray_of_own,
    takes,
)


class RoutePlan(NamedTuple):
    """What one reconcile sends, and the destinations nobody wants any more (their
    failures and conflicts are forgotten).  ``besides``: IPv6 routes added beside our old
    route(s) at their key, each with those old ones, deleted once it is in (``needs_beside``)."""

    adds: list[Route]
    replaces: list[Route]
    deletes: list[Route | Stray]
    stale: list[str]
    besides: list[tuple[Route, list[Route | Stray]]]


def needs_beside(want: Route, old_gateway: str | None) -> bool:
    """Must ``want`` be added beside our IPv6 route at its key rather than replace it?

    Linux's fib6_add_rt2node lets an IPv6 NLM_F_REPLACE take only a route as ECMP-able as the
    new one (rt6_qualify_for_ecmp: a gateway route, not RA-learned, no nexthop object), or
    for an ECMP-able new one the first other route.  Before Linux 4.19 a route that is not
    ECMP-able (blackhole, unreachable, a device-only route) never took an ECMP-able one
    (Linux 4.1 "ipv6: fix ECMP route replacement" to 4.18): the replace failed ENOENT, and
    the add tried then met EEXIST, at every resync, the old gateway route carrying the
    traffic meanwhile.  (Later kernels fall back to the first route at the key, whoever's,
    and its siblings.)  On every kernel such a route is added beside ours with NLM_F_CREATE
    alone (rt6_duplicate_nexthop: a gateway route is never its duplicate), and our old
    route is then deleted by its gateway and device: no gap, and no other daemon's route at
    the key touched.  The other way (an ECMP-able route where ours is not) a replace would
    take the first gateway route at the key, another daemon's one beside ours if it is there,
    else the first route at the key, whoever's: it is added beside ours too (appended; or it
    meets a route with its next hop, EEXIST), and ours deleted by gateway ``::`` and device
    (route_model.stray_of_own).  Either way it goes in only where no other daemon's route is
    at the key (agentd.kernel.routing reads the table first: route_adopt.others_at_keys);
    else it is a conflict, re-tried as others are, and ours stays."""
    return (want.gateway is None) != (old_gateway is None) and ":" in want.dst


class Work(NamedTuple):
    """The destinations one reconcile looks at (``dsts`` None: all of them), whether it
    re-reads the kernel first, and the conflicts it re-tries."""

    dsts: set[str] | None
    full: bool
    retry: set[str]


class RouteState:
    """The desired routes, our routes in the kernel, and the work pending between them."""

    def __init__(self, counters: RouteCounters | None = None) -> None:
        self.counters = counters if counters is not None else RouteCounters()
        self.desired: dict[str, Route] = {}
        self.kernel: dict[str, Route] = {}  # our route in the kernel, per dst
        self.strays: set[Stray] = set()  # our other routes there, to be deleted
        self.complete = False  # set_desired() was called: undesired own routes may go
        self.discarded: set[str] = set()  # explicit discards before that
        self.dirty: set[str] = set()
        self.retry: set[str] = set()  # conflicted dsts whose desired route changed: try again
        self.dirty_all = False
        self.full_pending = False
        self.links_gone: set[str] = set()  # links deleted or gone down since the last reconcile
        self.restoring: set[str] = set()  # own desired routes someone removed
        self.conflicts: dict[str, str] = {}  # dst -> reason
        self.failures: dict[str, str] = {}  # dst -> reason
        # Next hops in our IPv6 multipath routes whose delete met ESRCH: another daemon's (the
        # kernel deleted only a next hop of our protocol).  Not filed as strays while a full
        # re-read finds them (agentd.kernel.route_adopt.adopt drops the rest).
        self.foreign_hops: set[Stray] = set()

    # --- the caller's declarations ---------------------------------------------------------

    def set_desired(self, routes: Iterable[Route]) -> None:
        if not isinstance(routes, (list, tuple)):
            routes = list(routes)
        desired = {route.dst: route for route in routes if type(route) is Route}
        if len(desired) != len(routes):
            reject_bad(routes)
        old = self.desired
        self.retry.update(d for d in self.conflicts if desired.get(d) != old.get(d))
        if self.strays:
            # Two routes of ours for one dst were filed against the previous desired set (the
            # one now wanted may be the "stray"): re-read them before deleting anything.
            self.full_pending = True
        self.desired = desired
        self.complete = True
        self.discarded.clear()
        self.dirty_all = True

    def upsert(self, route: Route) -> None:
        if type(route) is not Route:
            raise InvalidRoute(f"upsert takes a Route, got {route!r}")
        self.desired[route.dst] = route
        self.discarded.discard(route.dst)
        self.dirty.add(route.dst)
        if self.strays and any(s.text == route.dst for s in self.strays):
            # As in set_desired(): the route now wanted may be the one filed as a stray.
            self.full_pending = True

    def discard(self, dst: str) -> None:
        dst = canonical_dst(dst)
        self.desired.pop(dst, None)
        if not self.complete:
            self.discarded.add(dst)
        self.dirty.add(dst)

    # --- one reconcile ---------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.dirty or self.dirty_all or self.full_pending or self.links_gone)

    def needs_full(self, full: bool) -> bool:
        """Start a reconcile: does it re-read the kernel first (asked, pending, or a link that
        one of our routes uses went away)?"""
        gone, self.links_gone = self.links_gone, set()
        if full or self.full_pending or (gone and self.uses_links(gone)):
            self.full_pending = False
            return True
        if gone:
            # Another's IPv4 route in our way may have gone with the link, silently too.
            self.dirty.update(dst for dst in self.conflicts if ":" not in dst)
        return False

    def link_gone(self, index: int, *names: str | None) -> None:
        """A link was deleted or went down: IPv4 flushes its routes without a notification.
        Only a link one of our routes uses makes the next reconcile re-read the kernel (a pod's
        veth going away must not re-read 100k routes)."""
        self.links_gone.add(f"if#{index}")  # how a route on a link of unknown name says it
        self.links_gone.update(name for name in names if name)

    def address_gone(self, address: str, *devices: str | None) -> None:
        """An address was removed (``devices``: the names of its device, for an IPv4 one):
        re-read the kernel at the next reconcile only if one of our routes has that source
        address or may go out of one of those devices (IPv4 flushes such routes silently)."""
        names = {name for name in devices if name}
        if any(route.src == address for route in self.kernel.values()) or (names and self.uses_links(names)):
            self.full_pending = True

    def uses_links(self, names: Set[str]) -> bool:
        """May one of our routes in the kernel go out of one of these links?  A gateway route
        we installed without a device went out of whichever the kernel chose: unknown until
        the next re-read (which files it with its device), so it may."""
        for route in self.kernel.values():
            dev = route.dev
            if dev in names or (dev is None and route.kind == "unicast"):
                return True
        return False

    def take_work(self, full: bool) -> Work:
        """What a reconcile covers (after the re-read, if ``full``); the dirty marks are cleared."""
        dsts = None if full or self.dirty_all else self.dirty
        # Conflicts are re-tried on full resyncs, and at once when the monitor saw their
        # destination change or their desired route changed.
        retry = self.dirty | self.retry
        self.dirty_all = False
        self.dirty, self.retry = set(), set()
        return Work(dsts, full, retry)

    def plan(self, dsts: Iterable[str] | None, full: bool, retry: Set[str] = frozenset()) -> RoutePlan:
        """Adds, replaces and deletes that turn kernel state into desired state."""
        desired, kernel, conflicts = self.desired, self.kernel, self.conflicts
        may_delete, discarded = self.complete, self.discarded
        adds: list[Route] = []
        replaces: list[Route] = []
        deletes: list[Route | Stray] = []
        stale: list[str] = []
        besides: list[tuple[Route, list[Route | Stray]]] = []

        def change(want: Route, have: Route) -> None:
            if kernel_metric(want) == kernel_metric(have):
                if needs_beside(want, have.gateway):
                    besides.append((want, [have]))  # then ours deleted by its gateway
                else:
                    replaces.append(want)
            else:  # a new key: add the new route first, then delete the old one
                adds.append(want)
                deletes.append(have)

        if dsts is None:
            for dst, want in desired.items():
                have = kernel.get(dst)
                if have is None:
                    # Re-checking a conflict costs a table read: only full resyncs retry them,
                    # and a conflict whose destination or desired route changed.
                    if full or dst not in conflicts or dst in retry:
                        adds.append(want)
                elif have is not want and not same_route(want, have) and (
                        full or dst not in conflicts or dst in retry):
                    # A conflict beside our route at the key (an IPv6 route to be added beside
                    # it, another daemon's route in the way) is re-tried as above.
                    change(want, have)
            if may_delete:
                deletes.extend(have for dst, have in kernel.items() if dst not in desired)
            else:  # before the first set_desired(): only what was discarded explicitly
                deletes.extend(kernel[d] for d in discarded if d in kernel and d not in desired)
            stale.extend(d for d in (*self.failures, *conflicts) if d not in desired)
        else:
            for dst in dsts:
                want, have = desired.get(dst), kernel.get(dst)
                if want is None:
                    stale.append(dst)
                    if have is not None and (may_delete or dst in discarded):
                        deletes.append(have)
                elif have is None:
                    adds.append(want)
                elif not same_route(want, have):
                    change(want, have)
        if may_delete:
            deletes.extend(self.strays)
        elif self.strays:
            # Before the first set_desired(), a destination the caller has declared (upsert)
            # or discarded is complete already: our other routes for it go, as change() and
            # the discard above delete the one filed as its route.
            deletes.extend(s for s in self.strays if s.text in desired or s.text in discarded)
        if (adds or replaces) and self.strays:
            self._replace_keyed_strays(adds, replaces, deletes, besides)
        return RoutePlan(adds, replaces, deletes, stale, besides)

    def _keyed_strays(self) -> dict[tuple[str, int], list[Stray]]:
        """Our strays by the key (dst, metric) they hold (tos 0, no source prefix): one, or
        the next hops of an IPv6 multipath route."""
        keyed: dict[tuple[str, int], list[Stray]] = {}
        for stray in self.strays:
            if not stray.tos and not stray.src_len:
                keyed.setdefault((stray.text, stray.priority or 0), []).append(stray)
        return keyed

    def _replace_keyed_strays(self, adds: list[Route], replaces: list[Route], deletes: list[Route | Stray],
                              besides: list[tuple[Route, list[Route | Stray]]]) -> None:
        """A stray of ours holding the very key (dst, tos 0, no source prefix, metric) of a route
        being added (one the Route model cannot say: multipath, a nexthop object, RTA_VIA) would
        make the add meet EEXIST and then be deleted, leaving the destination without a route:
        the desired route replaces it in place instead, and the stray's delete is dropped
        (``installed`` forgets the stray once the replace is acknowledged).

        A replace takes the whole IPv6 multipath route holding its key, every next hop: the
        deletes of those next hops are dropped too (one naming the gateway of the route put
        in their place would delete it).

        An IPv6 route no replace can put in the place of those next hops (``needs_beside``)
        is added beside them instead, and they are deleted once it is in."""
        keyed = self._keyed_strays()
        if not keyed:
            return
        taken: set[tuple[str, int]] = set()
        kept: list[Route] = []
        for want in adds:
            key = (want.dst, kernel_metric(want))
            if key not in keyed or key in taken:
                kept.append(want)
            elif any(needs_beside(want, real_gateway(stray)) for stray in keyed[key]):
                taken.add(key)
                besides.append((want, list(keyed[key])))
            else:
                taken.add(key)
                replaces.append(want)
        for want in replaces:
            key = (want.dst, kernel_metric(want))
            # Only a gateway route's replace takes the multipath route (one without takes our
            # route without one at the key, beside which our next hops stay).
            if key in keyed and want.gateway is not None and any(real_gateway(s) for s in keyed[key]):
                taken.add(key)
        if taken:
            adds[:] = kept
            gone = {stray for key in taken for stray in keyed[key]}
            deletes[:] = [d for d in deletes if d not in gone]

    def _forget_replaced_strays(self, routes: list[Route]) -> None:
        """Strays holding the key of routes just installed are gone: a replace took their place."""
        keyed = self._keyed_strays()
        if keyed:
            for route in routes:
                for stray in keyed.get((route.dst, kernel_metric(route)), ()):
                    self.strays.discard(stray)

    def forget(self, stale: Iterable[str]) -> None:
        for dst in stale:
            self.failures.pop(dst, None)
            self.conflicts.pop(dst, None)

    def record(self, failed: Iterable[tuple[str, str]], conflicts: Iterable[tuple[str, str]]) -> list[str]:
        """File a reconcile's failures and conflicts; returns the conflict reasons that are new."""
        for dst, reason in failed:
            self.failures[dst] = reason
        new = []
        for dst, reason in conflicts:
            if self.conflicts.get(dst) != reason:
                new.append(reason)
            self.conflicts[dst] = reason
        return new

    # --- what the kernel acknowledged --------------------------------------------------------

    def installed(self, routes: list[Route], report: list[str], beside: bool = False) -> None:
        """``beside``: added beside our old routes at their keys, which are deleted next."""
        kernel, strays = self.kernel, self.strays
        if strays and not beside:
            self._forget_replaced_strays(routes)
        for route in routes:
            dst = route.dst
            previous = kernel.get(dst)
            if previous is not None and kernel_metric(previous) != kernel_metric(route):
                strays.add(stray_of_own(previous))  # metric changed: deleted later in this sync
            kernel[dst] = route
            report.append(dst)
        if self.failures or self.conflicts or self.restoring:
            for route in routes:
                self.failures.pop(route.dst, None)
                self.conflicts.pop(route.dst, None)
                if route.dst in self.restoring:
                    self.restoring.discard(route.dst)
                    self.counters.routes_restored += 1

    def deleted(self, targets: list[Route | Stray], removed: list[str]) -> None:
        kernel, strays = self.kernel, self.strays
        for target in targets:
            if type(target) is Route:
                dst = target.dst
                current = kernel.get(dst)
                # The kernel deleted whatever route of ours held this dst and metric (for an
                # IPv6 gateway route: its next hop, named by gateway and device).
                if current is target or (current is not None and kernel_metric(current) == kernel_metric(target)
                                         and takes(target, current)):
                    del kernel[dst]
                elif strays:
                    strays.discard(stray_of(target))
                    strays.discard(hop_of(target))
                    strays.discard(stray_of_own(target))
            else:
                dst = target.text
                strays.discard(target)
            removed.append(dst)

    def gone(self, targets: list[Route | Stray]) -> None:
        """Deletes the kernel answered ESRCH: nothing of ours by that name is there.  A next
        hop deleted by its gateway is then another daemon's: remembered, and not deleted again
        at every full resync."""
        for target in targets:
            if type(target) is Stray and real_gateway(target) is not None:
                if len(self.foreign_hops) > 4096:
                    self.foreign_hops.clear()
                self.foreign_hops.add(target)
        self.deleted(targets, [])

    # --- what the monitor saw others do ------------------------------------------------------

    def own_route_added(self, found: Route | Stray | Group | Unreadable) -> None:
        """Someone else (or the kernel) added a route with our protocol."""
        if type(found) is Unreadable:
            self.own_route_unreadable(found)
            return
        if type(found) is Group:  # an IPv6 multipath route, maybe with others' next hops
            file_group(found, self.kernel, self.strays, self.desired, self.foreign_hops)
            dst = found.hops[0][1].text
            self.dirty.add(dst)
            want, have = self.desired.get(dst), self.kernel.get(dst)
            if dst in self.conflicts and want is not None and have is not None and same_route(want, have):
                del self.conflicts[dst]
            return
        if type(found) is Route:
            dst = found.dst
            have = self.kernel.get(dst)
            if (have is not None and ":" in dst and (have.gateway is None) != (found.gateway is None)
                    and kernel_metric(have) == kernel_metric(found)):
                # One IPv6 key holds a gateway route and one without: added beside ours (Linux
                # 4.1-4.18's replace), or put in its place?  A re-read of the kernel says.
                self.full_pending = True
                self.dirty.add(dst)
                return
            file_route(found, self.kernel, self.strays, self.desired)
            self.dirty.add(dst)
            want = self.desired.get(dst)
            if dst in self.conflicts and want is not None and kernel_metric(want) == kernel_metric(found):
                del self.conflicts[dst]  # ours holds the key now: nobody else's route is in the way
        else:
            self.strays.add(found)
            self.dirty.add(found.text)

    def own_route_removed(self, found: Route | Stray | Group | Unreadable) -> None:
        """Someone else (or the kernel) removed a route with our protocol."""
        if type(found) is Unreadable:
            self.own_route_unreadable(found)
            return
        if type(found) is Group:  # every next hop of an IPv6 multipath route went (whoever's first)
            for route, hop in found.hops:
                self.strays.discard(hop)
                self.foreign_hops.discard(hop)
                if route is not None:
                    self.own_route_removed(route)
            return
        if type(found) is not Route:
            self.strays.discard(found)
            return
        dst = found.dst
        have = self.kernel.get(dst)
        if have is not None and kernel_metric(have) == kernel_metric(found) and takes(found, have):
            del self.kernel[dst]
            if dst in self.desired:
                self.restoring.add(dst)
        else:
            self.strays.discard(stray_of(found))
            self.strays.discard(hop_of(found))
            self.strays.discard(stray_of_own(found))
        if self.foreign_hops:
            self.foreign_hops.discard(hop_of(found))
        self.dirty.add(dst)

    def own_route_unreadable(self, found: Unreadable) -> None:
        """A multipath route whose next hops do not decode changed: our route filed under its
        (dst, metric) may be among them or gone.  It is restored (an add meeting EEXIST finds
        whose route holds the key) rather than trusted."""
        dst = found.text
        have = self.kernel.get(dst)
        if have is not None and kernel_metric(have) == found.priority:
            del self.kernel[dst]
            if dst in self.desired:
                self.restoring.add(dst)
        self.dirty.add(dst)

    def other_route_replaced(self, dst: str, metric: int) -> None:
        """Another protocol's route replaced whatever held (dst, metric)."""
        have = self.kernel.get(dst)
        if have is not None and kernel_metric(have) == metric:
            del self.kernel[dst]  # someone replaced our route with theirs
            self.dirty.add(dst)

    def other_route_removed(self, dst: str) -> None:
        if dst in self.conflicts:
            self.dirty.add(dst)  # the route in our way is gone: try again
        if self.foreign_hops:
            # Maybe another daemon's next hop in our route: a next hop of ours by the same
            # gateway may follow, and must be deleted.
            self.foreign_hops = {hop for hop in self.foreign_hops if hop.text != dst}

    def retry_failures(self) -> None:
        """A device appeared or an address changed: failed routes may work now."""
        self.dirty.update(self.failures)


def dst_of(target: Route | Stray) -> str:
    return target.dst if type(target) is Route else target.text


def reject_bad(routes: Iterable[object]) -> None:
    seen: dict[str, Route] = {}
    for route in routes:
        if type(route) is not Route:
            raise InvalidRoute(f"desired routes must be Route objects, got {route!r}")
        other = seen.setdefault(route.dst, route)
        if other != route:
            raise InvalidRoute(f"two different desired routes for {route.dst}: {other} and {route}")
