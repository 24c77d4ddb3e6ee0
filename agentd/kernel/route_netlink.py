"""The route programmer's netlink I/O: its two sockets, the links it needs to name devices,
reading our routes, and sending route requests in batches.  No decisions: the programmer
(agentd.kernel.routing) plans with agentd.kernel.route_plan and tells this what to send.

Batching: requests go out in batches of up to ``batch`` messages (their error acks must fit
the receive buffer); agentd.kernel.netlink explains why one ack per batch is enough.
"""

from __future__ import annotations

import asyncio
import errno as _errno
import logging
import os
import socket
from collections.abc import Callable

from agentd.digits import whole_number
from agentd.kernel import netlink as nl
from agentd.kernel.netlink_socket import NetlinkSocket
from agentd.kernel.netns import entered, netns_path
from agentd.kernel.route_model import (
    AF_INET,
    AF_INET6,
    DEFAULT_METRIC,
    DELETE,
    KIND_OF_RTN,
    REQUEST_FLAGS,
    ROUTE_KINDS,
    RTM_F_CLONED,
    ZERO_ADDRESS,
    Group,
    Route,
    RouteCounters,
    Stray,
    Unreadable,
    Unresolved,
    gateway_text,
    kernel_route,
    stray_of_message,
    stray_of_own,
)

log = logging.getLogger("agentd.routing")

MONITOR_GROUPS = (nl.RTMGRP_IPV4_ROUTE | nl.RTMGRP_IPV6_ROUTE | nl.RTMGRP_LINK
                  | nl.RTMGRP_IPV4_IFADDR | nl.RTMGRP_IPV6_IFADDR)

Failure = tuple[object, int, "str | None"]  # (target, errno, the kernel's message)


def open_netlink_sockets() -> tuple[NetlinkSocket, NetlinkSocket]:
    """A request socket and a monitor socket for route, link and address events."""
    req = NetlinkSocket()
    try:
        # Our own changes cause one notification each; the filter drops them in the kernel.
        return req, NetlinkSocket(MONITOR_GROUPS, ignore_pid=req.portid)
    except BaseException:
        req.close()
        raise


class RouteMonitor:
    """The monitor socket's reader: route, link and address events (others cause: the
    kernel drops our own) go to ``on_event(mtype, mflags, buf, start, end)``; when events
    were lost ``on_resync()`` is called, and ``on_drained()`` after each read."""

    def __init__(self, counters: RouteCounters) -> None:
        self.counters = counters
        self.sock = None
        self.on_event: Callable[[int, int, bytes, int, int], None] = lambda *args: None
        self.on_resync: Callable[[], None] = lambda: None
        self.on_drained: Callable[[], None] = lambda: None
        self._reading = False  # the socket is registered with the loop

    def close(self) -> None:
        if self.sock is not None:
            if self._reading:
                self._reading = False
                try:
                    asyncio.get_running_loop().remove_reader(self.sock.fileno())
                except (RuntimeError, ValueError, OSError):
                    pass
            self.sock.close()
        self.sock = None

    def pause(self) -> bool:
        if not self._reading:
            return False
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self._reading = False
        return True

    def resume(self) -> None:
        if self.sock is not None and not self._reading:
            asyncio.get_running_loop().add_reader(self.sock.fileno(), self.read)
            self._reading = True
            self.read()

    def read(self) -> None:
        """Hand what the socket holds to ``on_event`` (the loop calls this)."""
        mon = self.sock
        if mon is None:
            return
        for _chunk in range(256):  # a flood of other people's events must not hog the loop
            try:
                chunk = mon.recv()
            except OSError as exc:
                if exc.errno == _errno.ENOBUFS:
                    # The kernel dropped events for us: only a full re-read is trustworthy now.
                    self.counters.monitor_overruns += 1
                    self.on_resync()
                    continue
                log.error("route monitor socket failed: %s", exc)
                self.on_resync()
                break
            if chunk is None:
                break
            try:
                for mtype, mflags, _seq, _pid, start, end in nl.iter_messages(chunk):
                    self.on_event(mtype, mflags, chunk, start, end)
            except nl.NetlinkDecodeError as exc:
                log.error("undecodable netlink event (%s); scheduling a full resync", exc)
                self.on_resync()
        self.on_drained()


class RouteNetlink:
    """Netlink I/O for one table of one namespace, tagged with ``protocol``.

    ``sockets`` opens the (request, monitor) pair; tests pass a stand-in kernel's.  When
    acks were lost, so the kernel view can no longer be trusted, ``on_resync()`` is called.
    ``monitor`` is the monitor socket's reader.
    """

    BATCH_MESSAGES = 4096  # requests per send(); their error acks must fit the receive buffer

    def __init__(self, *, table: int, protocol: int, netns: str | None = None,
                 counters: RouteCounters | None = None,
                 sockets: Callable[[], tuple[object, object]] = open_netlink_sockets) -> None:
        self.table = table
        self.protocol = protocol
        self.netns = netns
        self.counters = counters if counters is not None else RouteCounters()
        self.sockets = sockets
        self.on_resync: Callable[[], None] = lambda: None
        self.monitor = RouteMonitor(self.counters)
        self.batch = self.BATCH_MESSAGES
        self.ifindex: dict[str, int] = {}
        self.ifname: dict[int, str] = {}
        self.ifup: dict[int, bool] = {}
        # The links known may be incomplete (an interrupted dump, a route naming a device we do
        # not know): the next full resync re-reads them.
        self.links_stale = False
        self.req = None
        self._seq = 0
        self._templates: dict[tuple, nl.RouteTemplate] = {}
        self._seen: dict[bytes, Route] = {}  # message bytes of the last dump -> Route
        self._unreadable: set[str] = set()  # dsts whose undecodable RTA_MULTIPATH was logged

    # --- sockets -------------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self.req is not None

    def open(self) -> None:
        if self.netns is None:
            self.req, self.monitor.sock = self.sockets()
            return
        path = netns_path(self.netns)
        if not os.path.exists(path):
            raise FileNotFoundError(f"network namespace {self.netns!r} does not exist ({path})")
        with entered(path):
            self.req, self.monitor.sock = self.sockets()

    def close(self) -> None:
        self.monitor.close()
        if self.req is not None:
            self.req.close()
        self.req = None

    def next_seq(self) -> int:
        self._seq = self._seq + 1 if self._seq < 0xFFFF0000 else 1
        return self._seq

    # --- links -----------------------------------------------------------------------------

    async def dump_links(self) -> bool:
        """Re-read the links; False when every try was interrupted (NLM_F_DUMP_INTR: a link
        came or went mid-dump, and the table read may lack some): ``links_stale`` then stays
        set, so the next full resync reads them again."""
        def handle(mtype: int, buf: bytes, start: int, end: int) -> None:
            if mtype == nl.RTM_NEWLINK:
                self.learn_link(nl.decode_link(buf, start, end))

        names = dict(self.ifname)
        consistent = False
        for _attempt in range(3):
            self.ifindex.clear()
            self.ifname.clear()
            self.ifup.clear()
            self._templates.clear()
            seq = self.next_seq()
            if await self.req.dump(nl.encode_getlink_dump(seq), seq, handle, what="link dump"):
                consistent = True
                break
        if not consistent:
            log.warning("the link dump was interrupted three times; reading the links again at the next full resync")
        self.links_stale = not consistent
        if self.ifname != names:
            self._seen = {}  # its Routes hold interface names
        return consistent

    def learn_link(self, link: nl.LinkMessage) -> None:
        old = self.ifname.get(link.index)
        if old != link.name:
            if old is not None and self.ifindex.get(old) == link.index:
                del self.ifindex[old]
            self._templates.clear()  # they hold interface indexes
            self._seen = {}  # its Routes hold interface names
        self.ifname[link.index] = link.name
        self.ifindex[link.name] = link.index
        self.ifup[link.index] = link.up

    def forget_link(self, link: nl.LinkMessage) -> None:
        self.ifname.pop(link.index, None)
        self.ifup.pop(link.index, None)
        if self.ifindex.get(link.name) == link.index:
            del self.ifindex[link.name]
        self._templates.clear()
        self._seen = {}

    # --- reading routes --------------------------------------------------------------------

    def route_of(self, msg: nl.RouteMessage) -> Route | None:
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
                dev = self.ifname.get(msg.oif) or f"if#{msg.oif}"
            if (gateway is None and dev is None) or (onlink and (gateway is None or dev is None)):
                return None
        metric = msg.priority
        if metric == DEFAULT_METRIC[family]:
            metric = None
        return kernel_route(
            f"{ntop(family, msg.dst or ZERO_ADDRESS[family])}/{msg.dst_len}", gateway, dev, onlink, kind, metric,
            msg.mtu or None, None if msg.prefsrc is None else ntop(family, msg.prefsrc),
        )

    def found_of(self, msg: nl.RouteMessage) -> Route | Stray | Group | Unreadable:
        """A route of ours as a Route, or as a Stray when Route cannot say it; an IPv6
        multipath route as a Group of its next hops (each may be another daemon's), or as
        Unreadable if they do not decode."""
        route = self.route_of(msg)
        if route is not None:
            return route
        if msg.family == AF_INET6 and msg.multipath is not None and msg.nh_id is None and not msg.tos:
            whole = stray_of_message(msg)
            try:
                hops = nl.decode_nexthops(msg.family, msg.multipath)
            except nl.NetlinkDecodeError as exc:
                if whole.text not in self._unreadable:  # a dump a minute must not log it a minute
                    if len(self._unreadable) > 1024:
                        self._unreadable.clear()
                    self._unreadable.add(whole.text)
                    log.error("%s: undecodable RTA_MULTIPATH (%s): left alone, our route for it checked", whole.text, exc)
                return Unreadable(whole.text, msg.priority or 0)
            group = self.group_of(msg, whole, hops)
            if group is not None:
                return group
        return stray_of_message(msg)

    def group_of(self, msg: nl.RouteMessage, whole: Stray, hops: list[nl.NextHop]) -> Group | None:
        """An IPv6 multipath message's next hops (None if one has no gateway: then it is no
        group of sibling routes, and only a delete of the whole can name it)."""
        if not hops or any(hop.gateway is None for hop in hops):
            return None
        dst, family, ntop = whole.text, msg.family, socket.inet_ntop
        kind = KIND_OF_RTN.get(msg.type)
        metric = None if msg.priority == DEFAULT_METRIC[family] else msg.priority
        prefsrc = None if msg.prefsrc is None else ntop(family, msg.prefsrc)
        group = []
        for hop in hops:
            gateway = ntop(family, hop.gateway)
            dev = (self.ifname.get(hop.ifindex) or f"if#{hop.ifindex}") if hop.ifindex else None
            route = None
            if hop.plain and kind == "unicast" and not msg.src_len and msg.via is None:
                # The message's attributes (metrics, source) are the first next hop's: the
                # others' may differ, and then they are merely not filed as the desired route.
                route = kernel_route(dst, gateway, dev, bool(hop.flags & nl.RTNH_F_ONLINK), kind, metric,
                                     msg.mtu or None, prefsrc)
            group.append((route, whole._replace(gateway=gateway, dev=dev)))
        return Group(tuple(group))

    async def dump_own(self) -> list[Route | Stray | Group | Unreadable]:
        """Every route of ours (our protocol, our table) in the kernel.

        A route whose message bytes are exactly those of the last dump is the same Route
        again: the periodic resync of 100k unchanged routes then costs a dict lookup each,
        not a parse (the price is the bytes kept, ~80-130 per route)."""
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
                seq = self.next_seq()
                request = nl.encode_getroute_dump(seq, family, table=table, protocol=protocol)
                consistent &= await self.req.dump(request, seq, handle, what="route dump")
            if consistent:
                break
        if any(msg.oif and msg.oif not in self.ifname for _body, msg in fresh):
            await self.dump_links()
        found: list[Route | Stray | Group | Unreadable] = list(known)
        for count, (body, msg) in enumerate(fresh, 1):
            item = self.found_of(msg)
            if type(item) is Route:
                seen[body] = item
            found.append(item)
            if count % 8192 == 0:
                await asyncio.sleep(0)  # parsing 100k routes takes a while: let the loop run
        self._seen = seen
        return found

    async def dump_table(self, families: set[int]) -> list[nl.RouteMessage]:
        """Every route in our table, whoever's, of the given families."""
        messages: list[nl.RouteMessage] = []

        def handle(mtype: int, buf: bytes, start: int, end: int) -> None:
            if mtype == nl.RTM_NEWROUTE:
                messages.append(nl.decode_route(buf, start, end))

        for family in families:
            seq = self.next_seq()
            await self.req.dump(nl.encode_getroute_dump(seq, family, table=self.table), seq, handle,
                                what="route table dump")
        return messages

    # --- sending routes --------------------------------------------------------------------

    async def execute(self, code: str, targets: list, done: Callable[[list], None],
                      gone: Callable[[list], None] | None = None) -> list[Failure]:
        """Send one kind of request for every target, batched; ``done(targets)`` after each
        batch with the ones that succeeded (``gone(targets)``: deletes of routes already
        gone).  Returns the failures ``(target, errno, kernel message)``."""
        failures: list[Failure] = []
        flags = REQUEST_FLAGS[code]
        encode = self.encode_delete if code == DELETE else self.encode_route
        max_bytes = min(self.req.sndbuf // 2, 4 << 20)
        n, i = len(targets), 0
        while i < n:
            if self._seq > 0xFFFF0000:
                self._seq = 0  # nlmsg_seq is 32 bits
            batch: list = []
            parts: list[bytes] = []
            size = 0
            first = seq = self._seq + 1
            while i < n and len(parts) < self.batch and size < max_bytes:
                target = targets[i]
                i += 1
                try:
                    message = encode(target, seq, flags)
                except Unresolved as exc:
                    # The device may exist and our link table lack it (its event lost while
                    # the monitor was paused, say): the next full resync reads the links again.
                    self.links_stale = True
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
            errors, complete = await self.req.send_batch(b"".join(parts), first, last)
            if not complete:
                # Error acks overflowed the receive buffer (it could not be raised?): re-read
                # the kernel, and send smaller batches from now on.
                self.batch = max(64, self.batch // 2)
                log.warning("netlink acks lost; re-reading kernel routes, batches now %d requests", self.batch)
                self.on_resync()
            if errors:
                by_seq = {s: (err, message) for s, err, message in errors}
                ok = []
                for k, target in enumerate(batch):
                    error = by_seq.get(first + k)
                    if error is None:
                        ok.append(target)
                    elif code == DELETE and error[0] == _errno.ESRCH and gone is not None:
                        gone([target])
                    else:
                        failures.append((target, *error))
            else:
                ok = batch
            done(ok)
            if i < n:
                await asyncio.sleep(0)  # let the loop breathe between batches
        return failures

    def encode_route(self, route: Route, seq: int, flags: int) -> bytes:
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
            oif = self.ifindex.get(route.dev, 0)
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

    def encode_delete(self, target: Route | Stray, seq: int, flags: int) -> bytes:
        if type(target) is Route:
            # An IPv6 gateway route may share its (dst, metric) with other daemons' next hops
            # (a multipath route is one route per next hop there): naming ours by its gateway
            # and device deletes just it.  An IPv4 multipath route is one route: by its key.
            target = stray_of_own(target)
        family, raw, plen, tos, priority, _text, src_len, src, gateway, dev = target
        key = ("delete", family, tos, priority, src_len, src, gateway, dev)
        template = self._templates.get(key)
        if template is None:
            oif = 0
            if dev is not None:
                oif = self.ifindex.get(dev, 0)
                # a link named "if#٣" (gone now) is no index 3, "if#²" none at all
                if not oif and dev.startswith("if#"):
                    oif = whole_number(dev[3:], 10) or 0
            # A source-specific route is deleted by its source prefix too: without it the
            # kernel would delete our route for (dst, metric) with no source prefix.  Without
            # the device's index the gateway alone names the next hop (unless link-local).
            if len(self._templates) > 8192:
                self._templates.clear()
            template = self._templates[key] = nl.delroute_template(
                family, table=self.table, protocol=self.protocol, tos=tos, priority=priority, src=src,
                gateway=None if gateway is None else socket.inet_pton(family, gateway), oif=oif)
        return nl.encode_route(nl.RTM_DELROUTE, seq, flags, raw, plen, template, src_len)
