"""The route programmer: desired routes -> kernel routes, reconciled continuously (Felix-like).

What it owns: exactly the routes in its table that carry its route protocol number
(``RTPROT_AGENTD`` = 143 by default).  Everything else is left alone:

* adds use NLM_F_CREATE|NLM_F_EXCL, so they never overwrite; on EEXIST the programmer reads
  the table and either finds its own route there (then replaces it) or reports a conflict
  for that destination and does not touch it;
* NLM_F_REPLACE is used only where the kernel state says our own route holds that key;
* deletes name our protocol, and the kernel then deletes only a route of that protocol.

Desired state, not events (MetalLB ``Session.Set``, Felix's route table): callers give the set
of routes they want (``set_desired``) or edit it (``upsert``/``discard``); a reconcile task
diffs it against what the kernel holds and applies the difference in batched netlink
requests (agentd.kernel.netlink explains the batching).  A monitor socket watches the kernel: an
own route someone deletes is put back, an own-protocol route nobody wants is removed, and a
periodic full resync re-reads the kernel for whatever the monitor cannot see (IPv4 sends no
notification when a link going down flushes its routes).

Restart without a gap: ``start()`` adopts the own routes already in the kernel.  Nothing is
deleted as "not desired" until the caller has once declared its complete desired set with
``set_desired()`` (before that, only what it ``discard()``-ed, and our second routes of a
destination it ``upsert()``-ed), so a restarted agent keeps forwarding while BGP relearns its
routes.
"""

from __future__ import annotations

import asyncio
import errno as _errno
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Set

from agentd.kernel import netlink as nl
from agentd.kernel.netns import entered, netns_path
from agentd.kernel.route_model import (
    RTPROT_AGENTD,
    ROUTE_KINDS,
    KIND_OF_RTN,
    DEFAULT_METRIC,
    ZERO_ADDRESS,
    PROTOCOL_NAMES,
    RTM_F_CLONED,
    REQUEST_FLAGS,
    InvalidRoute,
    canonical_dst,
    Route,
    kernel_route,
    kernel_metric,
    same_route,
    Stray,
    stray_of,
    stray_of_message,
    SyncResult,
    RouteCounters,
    Outcome,
    Unresolved,
    AF_INET,
    AF_INET6,
    ADD,
    REPLACE,
    DELETE,
    gateway_text,
)

log = logging.getLogger("agentd.routing")  # the logger name predates the kernel package

class RouteProgrammer:
    """Programs the desired routes into one table of one namespace, tagged with ``protocol``.

    Public surface: ``start()``, ``stop(remove_routes=False)``, ``set_desired(routes)``,
    ``upsert(route)``, ``discard(dst)``, ``reconcile(full=False) -> SyncResult``,
    ``programmed()``, ``desired()``, and for REST/metrics ``last_sync`` (time.time() of the
    last completed reconcile), ``last_sync_seconds``, ``conflicts`` and ``failures``
    (dst -> reason), ``counters`` and the ``on_sync`` callback.
    """

    COALESCE_SECONDS = 0.005  # a burst of upserts becomes one reconcile
    BATCH_MESSAGES = 4096  # requests per send(); their error acks must fit the receive buffer
    RETRY_SECONDS = 1.0  # back-off after a reconcile raised

    def __init__(
        self,
        *,
        protocol: int = RTPROT_AGENTD,
        table: int = nl.RT_TABLE_MAIN,
        resync_interval: float = 30.0,
        netns: str | None = None,
    ) -> None:
        if type(protocol) is not int or not nl.RTPROT_STATIC < protocol <= 255:
            # 0-4 are unspec/redirect/kernel/boot/static: other people's routes by definition.
            raise ValueError(f"route protocol must be an integer 5..255, got {protocol!r}")
        if type(table) is not int or not 0 < table <= 0xFFFFFFFF or table == nl.RT_TABLE_LOCAL:
            raise ValueError(f"route table must be an integer 1..4294967295 other than 255 (local), got {table!r}")
        if not (isinstance(resync_interval, (int, float)) and resync_interval > 0):
            raise ValueError(f"resync_interval must be a positive number of seconds, got {resync_interval!r}")
        self.protocol = protocol
        self.table = table
        self.resync_interval = float(resync_interval)
        self.netns = netns
        self.on_sync: Callable[[SyncResult], None] | None = None
        self.last_sync: float | None = None
        self.last_sync_seconds: float | None = None
        self.conflicts: dict[str, str] = {}
        self.failures: dict[str, str] = {}
        self.counters = RouteCounters()

        self._desired: dict[str, Route] = {}
        self._kernel: dict[str, Route] = {}  # our route in the kernel, per dst
        self._strays: set[Stray] = set()  # our other routes there, to be deleted
        self._complete = False  # set_desired() was called: undesired own routes may go
        self._discarded: set[str] = set()  # explicit discards before that
        self._dirty: set[str] = set()
        self._retry: set[str] = set()  # conflicted dsts whose desired route changed: try again
        self._dirty_all = False
        self._full_pending = False
        self._restoring: set[str] = set()
        self._templates: dict[tuple, nl.RouteTemplate] = {}
        self._seen: dict[bytes, Route] = {}  # message bytes of the last dump -> Route
        self._ifindex: dict[str, int] = {}
        self._ifname: dict[int, str] = {}
        self._ifup: dict[int, bool] = {}
        self._seq = 0
        self._batch = self.BATCH_MESSAGES
        self._req: nl.NetlinkSocket | None = None
        self._mon: nl.NetlinkSocket | None = None
        self._reading = False  # the monitor socket is registered with the loop
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    # --- desired state -----------------------------------------------------------------------

    def set_desired(self, routes: Iterable[Route]) -> None:
        """Replace the whole desired set; the reconcile task applies it promptly."""
        if not isinstance(routes, (list, tuple)):
            routes = list(routes)
        desired = {route.dst: route for route in routes if type(route) is Route}
        if len(desired) != len(routes):
            _reject_bad(routes)
        old = self._desired
        self._retry.update(d for d in self.conflicts if desired.get(d) != old.get(d))
        if self._strays:
            # Two routes of ours for one dst were filed against the previous desired set (the
            # one now wanted may be the "stray"): re-read them before deleting anything.
            self._full_pending = True
        self._desired = desired
        self._complete = True
        self._discarded.clear()
        self._dirty_all = True
        self._wake.set()

    def upsert(self, route: Route) -> None:
        if type(route) is not Route:
            raise InvalidRoute(f"upsert takes a Route, got {route!r}")
        self._desired[route.dst] = route
        self._discarded.discard(route.dst)
        self._dirty.add(route.dst)
        if self._strays and any(s.text == route.dst for s in self._strays):
            # As in set_desired(): the route now wanted may be the one filed as a stray.
            self._full_pending = True
        self._wake.set()

    def discard(self, dst: str) -> None:
        dst = canonical_dst(dst)
        self._desired.pop(dst, None)
        if not self._complete:
            self._discarded.add(dst)
        self._dirty.add(dst)
        self._wake.set()

    def desired(self) -> list[Route]:
        return list(self._desired.values())

    def programmed(self) -> list[Route]:
        """Our routes in the kernel now, as far as the last reconcile and the monitor know."""
        return list(self._kernel.values())

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the sockets, adopt our routes already in the kernel, start monitor and resync."""
        if self._req is not None:
            raise RuntimeError("RouteProgrammer already started")
        if self.netns is None:
            self._open_sockets()
        else:
            path = netns_path(self.netns)
            if not os.path.exists(path):
                raise FileNotFoundError(f"network namespace {self.netns!r} does not exist ({path})")
            with entered(path):
                self._open_sockets()
        try:
            # The monitor subscribed before the dumps: a change made meanwhile waits there and
            # is applied after them, never lost.
            await self._dump_links()
            async with self._lock:
                await self._dump_own()
            self._resume_monitor()
        except BaseException:
            self._close_sockets()
            raise
        self._tasks = [
            asyncio.create_task(self._reconcile_loop(), name="routes-reconcile"),
            asyncio.create_task(self._resync_loop(), name="routes-resync"),
        ]
        log.info("route programmer started (proto %d, table %d): adopted %d own routes",
                 self.protocol, self.table, len(self._kernel))

    def _open_sockets(self) -> None:
        groups = (nl.RTMGRP_IPV4_ROUTE | nl.RTMGRP_IPV6_ROUTE | nl.RTMGRP_LINK
                  | nl.RTMGRP_IPV4_IFADDR | nl.RTMGRP_IPV6_IFADDR)
        self._req = nl.NetlinkSocket()
        try:
            # Our own changes cause one notification each; the filter drops them in the kernel.
            self._mon = nl.NetlinkSocket(groups, ignore_pid=self._req.portid)
        except BaseException:
            self._req.close()
            self._req = None
            raise

    def _close_sockets(self) -> None:
        if self._mon is not None:
            if self._reading:
                self._reading = False
                try:
                    asyncio.get_running_loop().remove_reader(self._mon.fileno())
                except (RuntimeError, ValueError, OSError):
                    pass
            self._mon.close()
        if self._req is not None:
            self._req.close()
        self._req = self._mon = None

    async def stop(self, remove_routes: bool = False) -> None:
        """Stop the tasks; with ``remove_routes`` delete every route of ours first."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        if self._req is None:
            return
        try:
            if remove_routes:
                async with self._lock:
                    await self._dump_own()
                    victims = [*self._kernel.values(), *self._strays]
                    for target, err, message in await self._execute(DELETE, victims, Outcome()):
                        log.warning("could not remove %s: %s", _dst_of(target), nl.describe_error(err, message))
        finally:
            self._close_sockets()

    async def __aenter__(self) -> RouteProgrammer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _reconcile_loop(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.COALESCE_SECONDS)
            self._wake.clear()
            if self._lock.locked() or not (self._dirty or self._dirty_all or self._full_pending):
                continue  # a reconcile in progress wakes us again if work is left when it ends
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.counters.errors += 1
                log.exception("route reconcile failed; retrying in %.1fs", self.RETRY_SECONDS)
                self._full_pending = True
                await asyncio.sleep(self.RETRY_SECONDS)
                self._wake.set()

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resync_interval)
            self._full_pending = True
            self._wake.set()

    # --- reconcile ---------------------------------------------------------------------------

    async def reconcile(self, full: bool = False) -> SyncResult:
        """Apply the difference between desired and kernel state now.

        ``full`` re-reads our routes from the kernel first (what the periodic resync does);
        it also happens when the monitor lost events or a link went away.
        """
        if self._req is None:
            raise RuntimeError("RouteProgrammer is not started")
        async with self._lock:
            started = time.perf_counter()
            full = full or self._full_pending
            if full:
                self._full_pending = False
                await self._dump_own()
                self.counters.full_resyncs += 1
            dsts = None if full or self._dirty_all else self._dirty
            # Conflicts are re-tried on full resyncs, and at once when the monitor saw their
            # destination change or their desired route changed.
            retry = self._dirty | self._retry
            self._dirty_all = False
            self._dirty, self._retry = set(), set()
            adds, replaces, deletes, stale = self._plan(dsts, full, retry)
            for dst in stale:
                self.failures.pop(dst, None)
                self.conflicts.pop(dst, None)
            added, replaced, removed, failed, conflicts = await self._apply(adds, replaces, deletes)
            seconds = time.perf_counter() - started
            result = SyncResult(added, replaced, removed, failed, conflicts, seconds, full)
            self.counters.reconciles += 1
            self.last_sync = time.time()
            self.last_sync_seconds = seconds
            if self._dirty or self._dirty_all or self._full_pending:
                self._wake.set()
        if self.on_sync is not None:
            try:
                self.on_sync(result)
            except Exception:
                log.exception("on_sync callback failed")
        return result

    def _plan(self, dsts: Iterable[str] | None, full: bool, retry: Set[str] = frozenset()):
        """Adds, replaces and deletes that turn kernel state into desired state, and the
        destinations nobody wants any more (their failures and conflicts are forgotten)."""
        desired, kernel, conflicts = self._desired, self._kernel, self.conflicts
        may_delete, discarded = self._complete, self._discarded
        adds: list[Route] = []
        replaces: list[Route] = []
        deletes: list[Route | Stray] = []
        stale: list[str] = []

        def change(want: Route, have: Route) -> None:
            if kernel_metric(want) == kernel_metric(have):
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
                elif have is not want and not same_route(want, have):
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
            deletes.extend(self._strays)
        elif self._strays:
            # Before the first set_desired(), a destination the caller has declared (upsert)
            # or discarded is complete already: our other routes for it go, as change() and
            # the discard above delete the one filed as its route.
            deletes.extend(s for s in self._strays if s.text in desired or s.text in discarded)
        return adds, replaces, deletes, stale

    async def _apply(self, adds: list[Route], replaces: list[Route], deletes: list[Route | Stray]):
        outcome = Outcome()
        failed: list[tuple[str, str]] = []
        conflicts: list[tuple[str, str]] = []
        exists: list[Route] = []
        vanished: list[Route] = []
        for code, targets in ((ADD, adds), (REPLACE, replaces), (DELETE, deletes)):
            for target, err, message in await self._execute(code, targets, outcome):
                if code == ADD and err == _errno.EEXIST:
                    exists.append(target)
                elif code == REPLACE and err == _errno.ENOENT:
                    vanished.append(target)  # gone since we looked: add it instead
                else:
                    failed.append((_dst_of(target), nl.describe_error(err, message)))
        if exists or vanished:
            own: list[Route] = []
            if exists:
                own, found, unexplained = await self._classify_existing(exists)
                conflicts += found
                failed += unexplained
            for code, targets in ((REPLACE, own), (ADD, vanished)):
                for target, err, message in await self._execute(code, targets, outcome):
                    failed.append((target.dst, nl.describe_error(err, message)))
        for dst, reason in failed:
            self.failures[dst] = reason
        for dst, reason in conflicts:
            if self.conflicts.get(dst) != reason:
                log.warning("route conflict: %s", reason)
            self.conflicts[dst] = reason
        self.counters.errors += len(failed)
        self.counters.routes_added += len(outcome.added)
        self.counters.routes_replaced += len(outcome.replaced)
        self.counters.routes_removed += len(outcome.removed)
        return tuple(outcome.added), tuple(outcome.replaced), tuple(outcome.removed), tuple(failed), tuple(conflicts)

    async def _execute(self, code: str, targets: list, outcome: Outcome) -> list[tuple[object, int, str | None]]:
        """Send one kind of request for every target, batched, and apply each success to the
        kernel state.  Returns the failures ``(target, errno, kernel message)``; deleting a
        route that is already gone counts as done."""
        failures: list[tuple[object, int, str | None]] = []
        flags = REQUEST_FLAGS[code]
        encode = self._encode_delete if code == DELETE else self._encode_route
        max_bytes = min(self._req.sndbuf // 2, 4 << 20)
        n, i = len(targets), 0
        while i < n:
            if self._seq > 0xFFFF0000:
                self._seq = 0  # nlmsg_seq is 32 bits
            batch: list = []
            parts: list[bytes] = []
            size = 0
            first = seq = self._seq + 1
            while i < n and len(parts) < self._batch and size < max_bytes:
                target = targets[i]
                i += 1
                try:
                    message = encode(target, seq, flags)
                except Unresolved as exc:
                    failures.append((target, _errno.ENODEV, str(exc)))
                    continue
                batch.append(target)
                parts.append(message)
                size += len(message)
                seq += 1
            if not parts:
                continue
            last = seq - 1
            parts[-1] = nl.with_flags(parts[-1], nl.NLM_F_ACK)  # its ack closes the batch
            self._seq = last
            errors, complete = await self._req.send_batch(b"".join(parts), first, last)
            if not complete:
                # Error acks overflowed the receive buffer (it could not be raised?): re-read
                # the kernel, and send smaller batches from now on.
                self._batch = max(64, self._batch // 2)
                log.warning("netlink acks lost; re-reading kernel routes, batches now %d requests", self._batch)
                self._full_pending = True
                self._wake.set()
            if errors:
                by_seq = {s: (err, message) for s, err, message in errors}
                done = []
                for k, target in enumerate(batch):
                    error = by_seq.get(first + k)
                    if error is None:
                        done.append(target)
                    elif code == DELETE and error[0] == _errno.ESRCH:
                        self._deleted([target], Outcome())  # already gone: nothing to report
                    else:
                        failures.append((target, *error))
            else:
                done = batch
            if code == DELETE:
                self._deleted(done, outcome)
            else:
                self._installed(done, outcome.added if code == ADD else outcome.replaced)
            if i < n:
                await asyncio.sleep(0)  # let the loop breathe between batches
        return failures

    def _encode_route(self, route: Route, seq: int, flags: int) -> bytes:
        addr, _, plen = route.dst.partition("/")
        family = AF_INET6 if ":" in addr else AF_INET
        key = (family, route.gateway, route.dev, route.onlink, route.kind, route.metric, route.mtu, route.src)
        template = self._templates.get(key)
        if template is None:
            template = self._template(family, route)
            if len(self._templates) > 8192:
                self._templates.clear()
            self._templates[key] = template
        return nl.encode_route(nl.RTM_NEWROUTE, seq, flags, socket.inet_pton(family, addr), int(plen), template)

    def _template(self, family: int, route: Route) -> nl.RouteTemplate:
        oif = 0
        if route.dev is not None:
            oif = self._ifindex.get(route.dev, 0)
            if not oif:
                raise Unresolved(f"no device {route.dev!r} in the route programmer's namespace")
        rtype = ROUTE_KINDS[route.kind]
        gateway = route.gateway
        return nl.route_template(
            family,
            table=self.table,
            protocol=self.protocol,
            # iproute2's choice: an IPv4 route straight onto a link is link-scoped.
            scope=nl.RT_SCOPE_LINK if gateway is None and rtype == nl.RTN_UNICAST and family == AF_INET else nl.RT_SCOPE_UNIVERSE,
            rtype=rtype,
            rtm_flags=nl.RTNH_F_ONLINK if route.onlink else 0,
            gateway=None if gateway is None else socket.inet_pton(family, gateway),
            oif=oif,
            priority=route.metric,
            prefsrc=None if route.src is None else socket.inet_pton(family, route.src),
            mtu=route.mtu,
        )

    def _encode_delete(self, target: Route | Stray, seq: int, flags: int) -> bytes:
        if type(target) is Route:
            target = stray_of(target)
        family, raw, plen, tos, priority, _text = target
        key = (family, tos, priority)
        template = self._templates.get(key)
        if template is None:
            template = self._templates[key] = nl.delroute_template(
                family, table=self.table, protocol=self.protocol, tos=tos, priority=priority)
        return nl.encode_route(nl.RTM_DELROUTE, seq, flags, raw, plen, template)

    def _installed(self, routes: list[Route], report: list[str]) -> None:
        kernel, strays = self._kernel, self._strays
        for route in routes:
            dst = route.dst
            previous = kernel.get(dst)
            if previous is not None and kernel_metric(previous) != kernel_metric(route):
                strays.add(stray_of(previous))  # metric changed: deleted later in this sync
            kernel[dst] = route
            report.append(dst)
        if self.failures or self.conflicts or self._restoring:
            for route in routes:
                self.failures.pop(route.dst, None)
                self.conflicts.pop(route.dst, None)
                if route.dst in self._restoring:
                    self._restoring.discard(route.dst)
                    self.counters.routes_restored += 1

    def _deleted(self, targets: list[Route | Stray], outcome: Outcome) -> None:
        kernel, strays, removed = self._kernel, self._strays, outcome.removed
        for target in targets:
            if type(target) is Route:
                dst = target.dst
                current = kernel.get(dst)
                # The kernel deleted whatever route of ours held this dst and metric.
                if current is target or (current is not None and kernel_metric(current) == kernel_metric(target)):
                    del kernel[dst]
                elif strays:
                    strays.discard(stray_of(target))
            else:
                dst = target.text
                strays.discard(target)
            removed.append(dst)

    async def _classify_existing(self, routes: list[Route]):
        """An add met EEXIST: read the table and see whose route holds each key.
        Ours (we had not heard of it) -> replace it; anyone else's -> a conflict, left alone."""
        wanted = {}
        for route in routes:
            stray = stray_of(route)
            wanted[(stray.family, stray.dst, stray.dst_len, kernel_metric(route))] = route
        holders: dict[Route, nl.RouteMessage] = {}

        def handle(mtype: int, buf: bytes, start: int, end: int) -> None:
            if mtype != nl.RTM_NEWROUTE:
                return
            msg = nl.decode_route(buf, start, end)
            if msg.table != self.table or msg.tos or msg.flags & RTM_F_CLONED or msg.family not in ZERO_ADDRESS:
                return
            key = (msg.family, msg.dst or ZERO_ADDRESS[msg.family], msg.dst_len, msg.priority or 0)
            route = wanted.get(key)
            if route is not None and (route not in holders or msg.protocol == self.protocol):
                holders[route] = msg

        for family in {route.family for route in routes}:
            seq = self._next_seq()
            await self._req.dump(nl.encode_getroute_dump(seq, family, table=self.table), seq, handle,
                                 what="route table dump")
        own: list[Route] = []
        conflicts: list[tuple[str, str]] = []
        unexplained: list[tuple[str, str]] = []
        for route in routes:
            msg = holders.get(route)
            if msg is None:
                unexplained.append((route.dst, "EEXIST, but no route with this destination and metric was found"))
            elif msg.protocol == self.protocol:
                adopted = self._route_of(msg)
                if adopted is not None:
                    self._kernel[route.dst] = adopted
                if adopted is None or not same_route(route, adopted):
                    own.append(route)
            else:
                name = PROTOCOL_NAMES.get(msg.protocol, str(msg.protocol))
                conflicts.append((route.dst, f"{route.dst}: table {self.table} already has a proto {name} route "
                                              "with this destination and metric; left alone"))
        return own, conflicts, unexplained

    # --- reading the kernel ------------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq = self._seq + 1 if self._seq < 0xFFFF0000 else 1
        return self._seq

    async def _dump_links(self) -> None:
        def handle(mtype: int, buf: bytes, start: int, end: int) -> None:
            if mtype == nl.RTM_NEWLINK:
                self._learn_link(nl.decode_link(buf, start, end))

        self._ifindex.clear()
        self._ifname.clear()
        self._templates.clear()
        seq = self._next_seq()
        await self._req.dump(nl.encode_getlink_dump(seq), seq, handle, what="link dump")

    def _learn_link(self, link: nl.LinkMessage) -> None:
        old = self._ifname.get(link.index)
        if old != link.name:
            if old is not None and self._ifindex.get(old) == link.index:
                del self._ifindex[old]
            self._templates.clear()  # they hold interface indexes
            self._seen = {}  # its Routes hold interface names
        self._ifname[link.index] = link.name
        self._ifindex[link.name] = link.index
        self._ifup[link.index] = link.up

    async def _dump_own(self) -> None:
        """Re-read every route of ours (our protocol, our table) into the kernel state.

        A route whose message bytes are exactly those of the last dump is the same Route
        again: the periodic resync of 100k unchanged routes then costs a dict lookup each,
        not a parse (the price is the bytes kept, ~80-130 per route).

        The monitor is paused meanwhile: an event about a route the dump already passed would
        otherwise be applied to the old state and then lost when the new one replaces it.
        Paused, events wait in the socket and are applied on top of the new state."""
        paused = self._pause_monitor()
        try:
            await self._read_own()
        finally:
            if paused:
                self._resume_monitor()

    async def _read_own(self) -> None:
        protocol, table = self.protocol, self.table
        for _attempt in range(3):
            known: list[Route] = []
            fresh: list[tuple[bytes, nl.RouteMessage]] = []
            previous, seen = self._seen, {}

            def handle(mtype: int, buf: bytes, start: int, end: int) -> None:
                if mtype != nl.RTM_NEWROUTE or end - start < nl.RTMSG_LEN or buf[start + 5] != protocol:
                    return  # rtmsg byte 5 is rtm_protocol: skip others' routes unparsed
                body = buf[start:end]
                route = previous.get(body)
                if route is not None:
                    seen[body] = route
                    known.append(route)
                    return
                try:
                    msg = nl.decode_route(body)
                except nl.NetlinkDecodeError as exc:
                    log.error("skipping undecodable route in dump: %s", exc)
                    return
                if msg.table == table and not msg.flags & RTM_F_CLONED and msg.family in ZERO_ADDRESS:
                    fresh.append((body, msg))

            consistent = True
            for family in (AF_INET, AF_INET6):
                seq = self._next_seq()
                request = nl.encode_getroute_dump(seq, family, table=table, protocol=protocol)
                consistent &= await self._req.dump(request, seq, handle, what="route dump")
            if consistent:
                break
        if any(msg.oif and msg.oif not in self._ifname for _body, msg in fresh):
            await self._dump_links()
        kernel: dict[str, Route] = {}
        strays: set[Stray] = set()
        file_route = self._file_route
        for route in known:
            file_route(route, kernel, strays)
        for count, (body, msg) in enumerate(fresh, 1):
            route = self._route_of(msg)
            if route is None:
                strays.add(stray_of_message(msg))
            else:
                seen[body] = route
                file_route(route, kernel, strays)
            if count % 8192 == 0:
                await asyncio.sleep(0)  # parsing 100k routes takes a while: let the loop run
        self._kernel, self._strays, self._seen = kernel, strays, seen

    def _pause_monitor(self) -> bool:
        if not self._reading:
            return False
        asyncio.get_running_loop().remove_reader(self._mon.fileno())
        self._reading = False
        return True

    def _resume_monitor(self) -> None:
        if self._mon is not None and not self._reading:
            asyncio.get_running_loop().add_reader(self._mon.fileno(), self._on_monitor_readable)
            self._reading = True
            self._on_monitor_readable()

    def _route_of(self, msg: nl.RouteMessage) -> Route | None:
        """The Route a kernel route of ours is, or None if it has a shape Route cannot say
        (multipath, nexthop objects, TOS, source prefix): such a route is a stray."""
        family = msg.family
        kind = KIND_OF_RTN.get(msg.type)
        if (kind is None or msg.multipath is not None or msg.via is not None
                or msg.nh_id is not None or msg.tos or msg.src_len):
            return None
        ntop = socket.inet_ntop
        gateway = msg.gateway
        if gateway is not None:  # next hops repeat: one shared string each
            text = gateway_text.get(gateway)
            if text is None:
                if len(gateway_text) > 4096:
                    gateway_text.clear()
                text = gateway_text[gateway] = ntop(family, gateway)
            gateway = text
        dev = None
        onlink = bool(msg.flags & nl.RTNH_F_ONLINK)
        if kind == "unicast":
            if msg.oif:
                dev = self._ifname.get(msg.oif) or f"if#{msg.oif}"
            if (gateway is None and dev is None) or (onlink and (gateway is None or dev is None)):
                return None
        metric = msg.priority
        if metric == DEFAULT_METRIC[family]:
            metric = None
        return kernel_route(
            f"{ntop(family, msg.dst or ZERO_ADDRESS[family])}/{msg.dst_len}", gateway, dev, onlink, kind, metric,
            msg.mtu or None, None if msg.prefsrc is None else ntop(family, msg.prefsrc),
        )

    def _file_own(self, msg: nl.RouteMessage, kernel: dict[str, Route], strays: set[Stray]) -> str:
        """File one of our kernel routes: the route for its dst, or a stray."""
        route = self._route_of(msg)
        if route is None:
            stray = stray_of_message(msg)
            strays.add(stray)
            return stray.text
        self._file_route(route, kernel, strays)
        return route.dst

    def _file_route(self, route: Route, kernel: dict[str, Route], strays: set[Stray]) -> None:
        dst = route.dst
        have = kernel.get(dst)
        if have is None or kernel_metric(have) == kernel_metric(route):
            kernel[dst] = route
            return
        # Two routes of ours for one dst (different metrics): the one holding the desired
        # route's key is its route (replaced in place if it differs); the other is a stray.
        want = self._desired.get(dst)
        if want is not None and kernel_metric(want) == kernel_metric(route):
            kernel[dst], route = route, have
        strays.add(stray_of(route))

    # --- the monitor -------------------------------------------------------------------------

    def _on_monitor_readable(self) -> None:
        mon = self._mon
        if mon is None:
            return
        for _chunk in range(256):  # a flood of other people's events must not hog the loop
            try:
                chunk = mon.recv()
            except OSError as exc:
                if exc.errno == _errno.ENOBUFS:
                    # The kernel dropped events for us: only a full re-read is trustworthy now.
                    self.counters.monitor_overruns += 1
                    self._full_pending = True
                    continue
                log.error("route monitor socket failed: %s", exc)
                self._full_pending = True
                break
            if chunk is None:
                break
            try:
                for mtype, mflags, _seq, _pid, start, end in nl.iter_messages(chunk):
                    self._on_event(mtype, mflags, chunk, start, end)
            except nl.NetlinkDecodeError as exc:
                log.error("undecodable netlink event (%s); scheduling a full resync", exc)
                self._full_pending = True
        if self._dirty or self._full_pending:
            self._wake.set()

    def _on_event(self, mtype: int, mflags: int, buf: bytes, start: int, end: int) -> None:
        if mtype == nl.RTM_NEWROUTE or mtype == nl.RTM_DELROUTE:
            msg = nl.decode_route(buf, start, end)
            if msg.table != self.table or msg.flags & RTM_F_CLONED or msg.family not in ZERO_ADDRESS:
                return
            if msg.protocol == self.protocol:
                self._on_own_route_event(mtype, msg)
                return
            dst = f"{socket.inet_ntop(msg.family, msg.dst or ZERO_ADDRESS[msg.family])}/{msg.dst_len}"
            have = self._kernel.get(dst)
            if mtype == nl.RTM_NEWROUTE and mflags & nl.NLM_F_REPLACE and have is not None:
                if kernel_metric(have) == (msg.priority or 0):
                    del self._kernel[dst]  # someone replaced our route with theirs
                    self._dirty.add(dst)
            elif mtype == nl.RTM_DELROUTE and dst in self.conflicts:
                self._dirty.add(dst)  # the route in our way is gone: try again
        elif mtype == nl.RTM_NEWLINK or mtype == nl.RTM_DELLINK:
            link = nl.decode_link(buf, start, end)
            was_up = self._ifup.get(link.index)
            if mtype == nl.RTM_DELLINK:
                self._ifname.pop(link.index, None)
                self._ifup.pop(link.index, None)
                if self._ifindex.get(link.name) == link.index:
                    del self._ifindex[link.name]
                self._templates.clear()
                self._seen = {}
                self._full_pending = True  # IPv4 flushes the routes of a dead link silently
            else:
                self._learn_link(link)
                if was_up and not link.up:
                    self._full_pending = True
                self._dirty.update(self.failures)  # a device may have appeared: retry
        elif mtype == nl.RTM_NEWADDR:
            self._dirty.update(self.failures)  # a gateway may have become reachable
        elif mtype == nl.RTM_DELADDR:
            self._full_pending = True  # routes with that source address were flushed

    def _on_own_route_event(self, mtype: int, msg: nl.RouteMessage) -> None:
        """Someone else (or the kernel) added or removed a route with our protocol."""
        if mtype == nl.RTM_NEWROUTE:
            self._dirty.add(self._file_own(msg, self._kernel, self._strays))
            return
        route = self._route_of(msg)
        if route is None:
            self._strays.discard(stray_of_message(msg))
            return
        dst = route.dst
        have = self._kernel.get(dst)
        if have is not None and kernel_metric(have) == kernel_metric(route):
            del self._kernel[dst]
            if dst in self._desired:
                self._restoring.add(dst)
        else:
            self._strays.discard(stray_of(route))
        self._dirty.add(dst)


def _dst_of(target: Route | Stray) -> str:
    return target.dst if type(target) is Route else target.text


def _reject_bad(routes: Iterable[object]) -> None:
    seen: dict[str, Route] = {}
    for route in routes:
        if type(route) is not Route:
            raise InvalidRoute(f"desired routes must be Route objects, got {route!r}")
        other = seen.setdefault(route.dst, route)
        if other != route:
            raise InvalidRoute(f"two different desired routes for {route.dst}: {other} and {route}")
