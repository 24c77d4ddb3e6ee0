"""The route programmer: desired routes -> kernel routes, reconciled continuously (Felix-like).

What it owns: exactly the routes in its table that carry its route protocol number
(``RTPROT_AGENTD`` = 143 by default).  Everything else is left alone:

* adds use NLM_F_CREATE|NLM_F_EXCL, so they never overwrite; on EEXIST the programmer reads
  the table and either finds its own route there (then replaces it) or reports a conflict
  for that destination and does not touch it;
* NLM_F_REPLACE is used only where the kernel state says our own route holds that key;
* an IPv6 route that no replace can put in the place of ours at its key is added beside
  ours (NLM_F_CREATE alone: agentd.kernel.route_plan.needs_beside), and only where a read of
  the table finds no other daemon's route at the key: a gateway route of ours beside theirs
  would be its ECMP sibling (one multipath route), and one without a gateway, behind theirs
  in the key's list, would have a later replace of ours take theirs.  Else it is a conflict,
  as an add meeting their route is;
* deletes name our protocol, and the kernel then deletes only a route of that protocol;
  an IPv6 multipath route is one route per next hop, each with its protocol (another daemon
  may append its next hop to ours): an IPv6 gateway route of ours is deleted by its gateway
  and device, so only our next hop goes (agentd.kernel.route_adopt.file_group).

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
import errno
import logging
import socket
import time
from collections.abc import Callable, Iterable
from ipaddress import IPv4Network, IPv6Network, ip_network

from agentd.kernel import netlink as nl
from agentd.kernel import netlink_links as links
from agentd.kernel.route_adopt import adopt, classify_existing, others_at_keys
from agentd.kernel.route_model import (
    ADD,
    BESIDE,
    DELETE,
    REPLACE,
    RTM_F_CLONED,
    RTPROT_AGENTD,
    ZERO_ADDRESS,
    Outcome,
    Route,
    RouteCounters,
    SyncResult,
)
from agentd.kernel.route_netlink import RouteNetlink, open_netlink_sockets
from agentd.kernel.route_plan import RouteState, dst_of, needs_beside

log = logging.getLogger("agentd.routing")  # the logger name predates the kernel package


class RouteProgrammer:
    """Programs the desired routes into one table of one namespace, tagged with ``protocol``.

    Public surface: ``start()``, ``stop(remove_routes=False)``, ``set_desired(routes)``,
    ``upsert(route)``, ``discard(dst)``, ``reconcile(full=False) -> SyncResult``,
    ``programmed()``, ``desired()``, and for REST/metrics ``last_sync`` (time.time() of the
    last completed reconcile), ``reconciles_begun`` and ``reconciled_upto`` (the number of the
    last completed one), ``last_sync_seconds``, ``conflicts`` and ``failures``
    (dst -> reason), ``counters`` and the ``on_sync`` callback.

    It is the asyncio shell around three parts: ``state`` (agentd.kernel.route_plan: what
    is desired, what the kernel holds, what to send), ``netlink`` (agentd.kernel.route_netlink:
    sockets, dumps, batched requests, the monitor) and adoption (agentd.kernel.route_adopt:
    our routes already in the kernel become ours).  ``sockets`` opens the netlink socket
    pair (tests pass a stand-in kernel's).
    """

    COALESCE_SECONDS = 0.005  # a burst of upserts becomes one reconcile
    BATCH_MESSAGES = RouteNetlink.BATCH_MESSAGES
    RETRY_SECONDS = 1.0  # back-off after a reconcile raised

    def __init__(
        self,
        *,
        protocol: int = RTPROT_AGENTD,
        table: int = nl.RT_TABLE_MAIN,
        resync_interval: float = 30.0,
        netns: str | None = None,
        sockets: Callable[[], tuple[object, object]] = open_netlink_sockets,
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
        # Reconciles numbered as they begin; the number of the last one completed: one begun
        # after a change to the desired routes has that change in the kernel once it completes.
        self.reconciles_begun = 0
        self.reconciled_upto = 0
        self.counters = RouteCounters()
        self.state = RouteState(self.counters)
        self.conflicts: dict[str, str] = self.state.conflicts
        self.failures: dict[str, str] = self.state.failures
        self.netlink = RouteNetlink(table=table, protocol=protocol, netns=netns, counters=self.counters,
                                    sockets=sockets)
        # Lost events (a monitor overrun) or lost acks: links may have changed unseen too (a
        # device deleted and re-created has a new ifindex): the full resync re-reads them first.
        self.netlink.on_resync = self._resync_links_now
        monitor = self.netlink.monitor
        monitor.on_event, monitor.on_resync, monitor.on_drained = self._on_event, self._resync_links_now, self._wake_if_work
        self._links_stale = False
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    # --- desired state -----------------------------------------------------------------------

    def set_desired(self, routes: Iterable[Route]) -> None:
        """Replace the whole desired set; the reconcile task applies it promptly."""
        self.state.set_desired(routes)
        self._wake.set()

    def upsert(self, route: Route) -> None:
        self.state.upsert(route)
        self._wake.set()

    def discard(self, dst: str) -> None:
        self.state.discard(dst)
        self._wake.set()

    def desired(self) -> list[Route]:
        return list(self.state.desired.values())

    def programmed(self) -> list[Route]:
        """Our routes in the kernel now, as far as the last reconcile and the monitor know."""
        return list(self.state.kernel.values())

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the sockets, adopt our routes already in the kernel, start monitor and resync."""
        if self.netlink.is_open:
            raise RuntimeError("RouteProgrammer already started")
        self.netlink.open()
        try:
            # The monitor subscribed before the dumps: a change made meanwhile waits there and
            # is applied after them, never lost.
            await self.netlink.dump_links()
            async with self._lock:
                await self._dump_own()
            self.netlink.monitor.resume()
        except BaseException:
            self.netlink.close()
            raise
        self._tasks = [
            asyncio.create_task(self._reconcile_loop(), name="routes-reconcile"),
            asyncio.create_task(self._resync_loop(), name="routes-resync"),
        ]
        log.info("route programmer started (proto %d, table %d): adopted %d own routes",
                 self.protocol, self.table, len(self.state.kernel))

    async def stop(self, remove_routes: bool = False) -> None:
        """Stop the tasks; with ``remove_routes`` delete every route of ours first (raises,
        after closing, saying how many stay when some could not be deleted)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        if not self.netlink.is_open:
            return
        stay = []
        try:
            if remove_routes:
                async with self._lock:
                    await self._dump_own()
                    victims = [*self.state.kernel.values(), *self.state.strays]
                    for target, err, message in await self._execute(DELETE, victims, Outcome()):
                        stay.append(f"{dst_of(target)}: {nl.describe_error(err, message)}")
                        log.warning("could not remove %s", stay[-1])
        finally:
            self.netlink.close()
        if stay:
            raise RuntimeError(f"{len(stay)} routes stay ({stay[0]}{', ...' if len(stay) > 1 else ''})")

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
            if self._lock.locked() or not self.state.has_work():
                continue  # a reconcile in progress wakes us again if work is left when it ends
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.counters.errors += 1
                log.exception("route reconcile failed; retrying in %.1fs", self.RETRY_SECONDS)
                self.state.full_pending = True
                await asyncio.sleep(self.RETRY_SECONDS)
                self._wake.set()

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resync_interval)
            self._resync_now()

    def _resync_now(self) -> None:
        self.state.full_pending = True
        self._wake.set()

    def _resync_links_now(self) -> None:
        self._links_stale = True
        self._resync_now()

    def _wake_if_work(self) -> None:
        if self.state.dirty or self.state.full_pending or self.state.links_gone:
            self._wake.set()

    # --- reconcile ---------------------------------------------------------------------------

    async def reconcile(self, full: bool = False) -> SyncResult:
        """Apply the difference between desired and kernel state now.

        ``full`` re-reads our routes from the kernel first (what the periodic resync does);
        it also happens when the monitor lost events or a link one of our routes uses went away.
        """
        if not self.netlink.is_open:
            raise RuntimeError("RouteProgrammer is not started")
        state = self.state
        async with self._lock:
            started = time.perf_counter()
            self.reconciles_begun += 1
            number = self.reconciles_begun
            full = state.needs_full(full)
            if full:
                await self._dump_own(links=self._links_stale or self.netlink.links_stale)
                self.counters.full_resyncs += 1
            work = state.take_work(full)
            plan = state.plan(work.dsts, work.full, work.retry)
            state.forget(plan.stale)
            changes = (plan.adds, plan.replaces, plan.deletes, plan.besides) if plan.besides else plan[:3]
            added, replaced, removed, failed, conflicts = await self._apply(*changes)
            seconds = time.perf_counter() - started
            result = SyncResult(added, replaced, removed, failed, conflicts, seconds, full)
            self.counters.reconciles += 1
            self.last_sync = time.time()
            self.last_sync_seconds = seconds
            self.reconciled_upto = number
            if state.has_work():
                self._wake.set()
        if self.on_sync is not None:
            try:
                self.on_sync(result)
            except Exception:
                log.exception("on_sync callback failed")
        return result

    async def _apply(self, adds: list[Route], replaces: list[Route], deletes: list,
                     besides: list[tuple[Route, list]] = ()):
        outcome = Outcome()
        failed: list[tuple[str, str]] = []
        conflicts: list[tuple[str, str]] = []
        exists: list[Route] = []
        vanished: list[Route] = []
        beside_exists: list[tuple[Route, int, str | None]] = []
        unsure: set[str] = set()  # destinations whose new route the kernel did not take outright
        held: list[Route] = []
        if besides:
            # Never beside another daemon's route at an IPv6 key: it is theirs.
            blocked = await self._others_at_keys(besides)
            if blocked:
                conflicts += blocked
                dsts = {dst for dst, _reason in blocked}
                besides = [(want, olds) for want, olds in besides if want.dst not in dsts]
        for code, targets in ((ADD, adds), (BESIDE, [want for want, _old in besides]), (REPLACE, replaces),
                              (DELETE, deletes)):
            if code == DELETE and unsure:
                # Our old route at another metric (route_plan: a metric change adds the new
                # route, then deletes the old) waits for the EEXIST reading below, and stays
                # where its replacement failed: it carries the traffic meanwhile.
                held = [t for t in targets if type(t) is Route and t.dst in unsure]
                targets = [t for t in targets if not (type(t) is Route and t.dst in unsure)]
            results = await self._execute(code, targets, outcome)
            if code != DELETE:
                unsure.update(dst_of(target) for target, _err, _message in results)
            if code == BESIDE and besides:
                # Our old routes beside which a route went in (route_plan.needs_beside) go
                # now, by their gateways: the destination's route was replaced, nothing
                # removed.  Where the add failed they stay, and carry the traffic.
                refused = {id(target) for target, _err, _message in results}
                olds = [old for want, gone in besides if id(want) not in refused for old in gone]
                # EEXIST: a route with its next hop is at the key; whose, the table read below says.
                beside_exists = [(target, err, message) for target, err, message in results if err == errno.EEXIST]
                results = [r for r in results if r[1] != errno.EEXIST]
                results = [*results, *await self._execute(DELETE, olds, Outcome())]
            for target, err, message in results:
                if code == ADD and err == errno.EEXIST:
                    exists.append(target)
                elif code == REPLACE and err == errno.ENOENT:
                    vanished.append(target)  # gone since we looked: add it instead
                else:
                    failed.append((dst_of(target), nl.describe_error(err, message)))
        again: tuple = ((), (), (), (), ())  # the adds below that go beside ours after all
        if exists or vanished or beside_exists:
            own: list[Route] = []
            beside: list[tuple[Route, list]] = []
            if exists or beside_exists:
                messages = await self.netlink.dump_table({route.family for route in exists}
                                                         | {route.family for route, _err, _msg in beside_exists})
                found = classify_existing(exists, messages, table=self.table, protocol=self.protocol,
                                          route_of=self.netlink.route_of)
                self.state.kernel.update(found.adopted)
                own = found.own
                conflicts += found.conflicts
                failed += found.unexplained
                if beside_exists:
                    f, c = self._classify_beside(beside_exists, messages)
                    failed += f
                    conflicts += c
                # Our IPv6 route found at the key is not as ECMP-able as the one wanted: a
                # replace could take another daemon's route there (route_plan.needs_beside).
                # It goes beside ours, as the plan would have sent it.
                beside = [(route, [found.adopted[route.dst]]) for route in own if route.dst in found.adopted
                          and needs_beside(route, found.adopted[route.dst].gateway)]
                if beside:
                    own = [route for route in own if not any(route is want for want, _old in beside)]
            for code, targets in ((REPLACE, own), (ADD, vanished)):
                for target, err, message in await self._execute(code, targets, outcome):
                    failed.append((target.dst, nl.describe_error(err, message)))
            if beside:
                again = await self._apply([], [], [], beside)
        if held:  # deleted unless their replacement failed (in, adopted, or another daemon's route there)
            kept = {dst for dst, _reason in (*failed, *again[3])}
            for target, err, message in await self._execute(DELETE, [t for t in held if t.dst not in kept], outcome):
                failed.append((target.dst, nl.describe_error(err, message)))
        for reason in self.state.record(failed, conflicts):
            log.warning("route conflict: %s", reason)
        self.counters.errors += len(failed)
        self.counters.routes_added += len(outcome.added)
        self.counters.routes_replaced += len(outcome.replaced)
        self.counters.routes_removed += len(outcome.removed)
        added, replaced, removed, more_failed, more_conflicts = again
        return (tuple(outcome.added) + added, tuple(outcome.replaced) + replaced, tuple(outcome.removed) + removed,
                tuple(failed) + more_failed, tuple(conflicts) + more_conflicts)

    async def _others_at_keys(self, besides: list[tuple[Route, list]]) -> list[tuple[str, str]]:
        """The IPv6 routes to be added beside ours at their key whose key holds another
        daemon's route: conflicts (route_adopt.others_at_keys), sent nothing; our routes
        there stay and carry the traffic.  Costs a read of the table, in the rare reconciles
        that turn an IPv6 route of ours with a gateway into one without, or the other way."""
        routes = [want for want, _olds in besides]
        messages = await self.netlink.dump_table({route.family for route in routes})
        return others_at_keys(routes, messages, table=self.table, protocol=self.protocol)

    def _classify_beside(self, results: list[tuple[Route, int, str | None]],
                         messages: list[nl.RouteMessage]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """Routes added beside our route(s) at their key that met EEXIST: a route with their
        next hop is there (rt6_duplicate_nexthop: the same gateway, or none, and the same
        device), not the routes of ours they go beside (gateway routes if they have none, and
        the other way).  Another daemon's is a conflict, named, as for an add; our own one
        (not known to us yet; a full resync files it) stays a failure, and so does an EEXIST
        no route in the table explains.  Returns (failed, conflicts)."""
        conflicts: list[tuple[str, str]] = []
        for gateway in (False, True):
            routes = [route for route, _err, _msg in results if (route.gateway is not None) == gateway]
            if routes:
                found = classify_existing(routes, [msg for msg in messages if (msg.gateway is not None) == gateway],
                                          table=self.table, protocol=self.protocol, route_of=self.netlink.route_of)
                conflicts += found.conflicts
        conflicting = {dst for dst, _reason in conflicts}
        failed = [(route.dst, nl.describe_error(err, message)) for route, err, message in results
                  if route.dst not in conflicting]
        return failed, conflicts

    async def _execute(self, code: str, targets: list, outcome: Outcome):
        """Send ``targets`` and record each success in the state (failures are returned)."""
        state = self.state
        if code == DELETE:
            return await self.netlink.execute(code, targets, lambda done: state.deleted(done, outcome.removed),
                                              state.gone)
        if code == BESIDE:  # the route for its destination changed: reported as replaced
            return await self.netlink.execute(code, targets,
                                              lambda done: state.installed(done, outcome.replaced, beside=True))
        report = outcome.added if code == ADD else outcome.replaced
        return await self.netlink.execute(code, targets, lambda done: state.installed(done, report))

    async def _dump_own(self, links: bool = False) -> None:
        """Re-read every route of ours (our protocol, our table) and adopt them as the kernel
        state; with ``links``, the links first (after lost events).

        The monitor is paused meanwhile: an event about a route the dump already passed would
        otherwise be applied to the old state and then lost when the new one replaces it.
        Paused, events wait in the socket and are applied on top of the new state."""
        paused = self.netlink.monitor.pause()
        try:
            if links:
                self._links_stale = False
                await self.netlink.dump_links()
            found = await self.netlink.dump_own()
            self.state.kernel, self.state.strays = adopt(found, self.state.desired, self.state.foreign_hops)
        finally:
            if paused:
                self.netlink.monitor.resume()

    # --- the monitor -------------------------------------------------------------------------

    def _on_event(self, mtype: int, mflags: int, buf: bytes, start: int, end: int) -> None:
        state, netlink = self.state, self.netlink
        if mtype == nl.RTM_NEWROUTE or mtype == nl.RTM_DELROUTE:
            msg = nl.decode_route(buf, start, end)
            if msg.table != self.table or msg.flags & RTM_F_CLONED or msg.family not in ZERO_ADDRESS:
                return
            if msg.protocol == self.protocol:
                if mtype == nl.RTM_NEWROUTE:
                    state.own_route_added(netlink.found_of(msg))
                else:
                    state.own_route_removed(netlink.found_of(msg))
                return
            dst = f"{socket.inet_ntop(msg.family, msg.dst or ZERO_ADDRESS[msg.family])}/{msg.dst_len}"
            if mtype == nl.RTM_NEWROUTE and mflags & nl.NLM_F_REPLACE:
                if not msg.tos and not msg.src_len:  # else another key than any Route of ours
                    state.other_route_replaced(dst, msg.priority or 0)
            elif mtype == nl.RTM_DELROUTE:
                if msg.family == socket.AF_INET6 and msg.multipath is not None and msg.nh_id is None and not msg.tos:
                    # A delete naming no gateway (``ip -6 route del DST proto static``, BIRD's
                    # nl_delete_rte) takes every next hop of the multipath route, ours appended
                    # to theirs too, and says so once, with the first next hop's protocol.
                    state.own_route_removed(netlink.found_of(msg))
                state.other_route_removed(dst)
        elif mtype == nl.RTM_NEWLINK or mtype == nl.RTM_DELLINK:
            link = nl.decode_link(buf, start, end)
            was_up = netlink.ifup.get(link.index)
            if mtype == nl.RTM_DELLINK:
                name = netlink.ifname.get(link.index)
                netlink.forget_link(link)
                state.link_gone(link.index, name, link.name)  # IPv4 flushes the routes of a dead link silently
            else:
                name = netlink.ifname.get(link.index)
                netlink.learn_link(link)
                if was_up and not link.up:
                    state.link_gone(link.index, name, link.name)
                state.retry_failures()  # a device may have appeared: retry
        elif mtype == nl.RTM_NEWADDR:
            state.retry_failures()  # a gateway may have become reachable
        elif mtype == nl.RTM_DELADDR:
            addr = links.decode_addr(buf, start, end)
            raw = addr.local or addr.address
            if addr.family not in ZERO_ADDRESS or raw is None:
                return
            # IPv4 flushes the routes with that source address, and a device's routes with its
            # last address, silently; IPv6 flushes none (it drops the source from routes using
            # it).  So only an address one of our routes uses, or for IPv4 its device, makes
            # the next reconcile re-read the kernel: a pod's veth going away (its fe80::
            # address) must not re-read 100k routes.
            device = (f"if#{addr.index}", netlink.ifname.get(addr.index)) if addr.family == socket.AF_INET else ()
            state.address_gone(socket.inet_ntop(addr.family, raw), *device)


async def remove_routes_of(
    protocol: int,
    networks: Iterable[IPv4Network | IPv6Network] | None,
    *,
    table: int = nl.RT_TABLE_MAIN,
    netns: str | None = None,
    sockets: Callable[[], tuple[object, object]] = open_netlink_sockets,
) -> tuple[list[str], list[str]]:
    """Delete the routes of ``protocol`` in ``table`` whose destination lies inside one of
    ``networks`` (the routes a previous run left under another ``[network] route_protocol``;
    another protocol's routes, and that protocol's routes elsewhere, are left alone); with
    ``networks`` None, every route of ``protocol`` in ``table`` (``agentd leave`` with no agent
    running: what ``RouteProgrammer.stop(remove_routes=True)`` removes).
    Returns (the destinations removed, a reason per route that could not be)."""
    wanted = None if networks is None else list(networks)

    def inside(dst: str) -> bool:
        if wanted is None:
            return True
        net = ip_network(dst, strict=False)
        return any(net.version == n.version and net.subnet_of(n) for n in wanted)  # type: ignore[arg-type]

    prog = RouteProgrammer(protocol=protocol, table=table, netns=netns, sockets=sockets)
    prog.netlink.open()
    try:
        await prog.netlink.dump_links()
        async with prog._lock:
            await prog._dump_own()
            state = prog.state
            victims = [t for t in (*state.kernel.values(), *state.strays) if inside(dst_of(t))]
            outcome = Outcome()
            errors = await prog._execute(DELETE, victims, outcome)
    finally:
        prog.netlink.close()
    return outcome.removed, [f"{dst_of(t)}: {nl.describe_error(err, message)}" for t, err, message in errors]
