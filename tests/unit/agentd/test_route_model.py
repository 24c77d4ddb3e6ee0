"""Model-based tests of the route programmer's reconciliation (agentd.kernel.routing.RouteProgrammer).

The decisions (what to add, replace and delete: agentd.kernel.route_plan) have their own
unit tests (test_route_plan.py); these run the whole programmer, planning, adoption and its
netlink I/O (agentd.kernel.route_netlink) together, reacting to the kernel's answers (EEXIST
-> read the table, ENOENT -> add, ESRCH -> gone).  They use the seam the programmer offers,
its two sockets (``RouteProgrammer(sockets=...)``):

``FakeKernel`` is an in-memory STAND-IN for the kernel's route tables, not the kernel.  It
decodes the programmer's real netlink requests and applies them the way fib_table_insert /
fib_table_delete and fib6_add_rt2node / ip6_route_del do: a route's key is (family, table,
dst/plen, tos, priority); NLM_F_EXCL on an existing key -> EEXIST; NLM_F_REPLACE replaces
whatever route holds the key, whoever owns it, and without NLM_F_CREATE fails ENOENT; a
delete names table, dst, tos and protocol, an absent or zero priority matches any, the
lowest-priority match goes, none -> ESRCH; a gateway route without a device gets eth0.
IPv6 keeps a list of routes per key (the fib6 leaf, in insertion order; no two gateway
routes in it here: nobody appends, and the programmer never adds a gateway route beside
another, which Linux would make its ECMP sibling -- the stand-in asserts it): NLM_F_CREATE
without NLM_F_EXCL adds beside them (EEXIST for a duplicate next hop: same gateway and
device), a delete takes the first match (one
naming a gateway matches only that gateway, ``::`` a route without one: ip6_route_del
compares it with fib_nh_gw6), and
NLM_F_REPLACE takes the first route as ECMP-able as the new one (rt6_qualify_for_ecmp: a
gateway route), else for a gateway route the first route; for one that is not ECMP-able,
Linux 4.1-4.18 add it beside (NLM_F_CREATE) or fail ENOENT, later kernels take the first
route (``old_replace``, drawn).  It
answers dumps (filtered like NETLINK_GET_STRICT_CHK, or not: drawn), tells the monitor socket
about changes other people make (never about the programmer's own, which the real monitor's
BPF filter drops), and flushes IPv4 routes silently when a link flaps, followed by the link
events, as Linux does.

Properties, over random sequences of desired-set changes, changes by others (our routes
deleted or replaced, own-protocol routes and other protocols' routes added for the same or
overlapping destinations and metrics, in our table and others), link flaps, monitor
overruns, restarts and full resyncs:

a) after each sync our routes in the table are exactly the desired set, except destinations
   whose key another protocol's route holds (those are reported as conflicts; for IPv6 also
   one where the desired route would go beside ours and another protocol's route is there:
   see RouteModel.blocked);
b) routes of other protocols, and all routes in other tables, are never changed or deleted;
c) a second sync with an unchanged desired set sends no requests (a full resync only
   re-tries the adds of conflicting routes, which fail EEXIST and change nothing, or are
   not sent after a read of the table);
d) no gap: a desired destination that has a route of ours when a sync (or a start) begins
   has one after every single request; an own route that already is the desired one is
   never touched (adoption at start).

The full model found four bugs, and three more around bug 4 (4b-4d: two routes of ours for
one destination; 4b and 4c turned up in the model once bug 4's xfail was lifted); all are
fixed and their minimal scenarios at the end are regression tests; the random run later found
bug 5 (a conflict kept after our own-protocol route took the key back), four more
(7a-7d) around one IPv6 key holding a gateway route and a route without one, and bug 8 (a
gateway route to go beside our device route at a key holding another daemon's gateway
route: sent again at every idle sync, or made its ECMP sibling; 8c, a route without a
gateway put beside another daemon's such route, which a later replace of ours then took),
and bug 9 (another protocol's replace at another TOS taken for a replace of our route).
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import struct
from collections import deque
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)

from agentd.kernel import netlink as nl
from agentd.kernel.route_model import ROUTE_KINDS, RTPROT_AGENTD, Route
from agentd.kernel.routing import RouteProgrammer

AF4, AF6 = socket.AF_INET, socket.AF_INET6
OURS = RTPROT_AGENTD
LINKS = {1: "lo", 2: "eth0", 3: "eth1"}
IFINDEX = {name: index for index, name in LINKS.items()}
ZERO = {AF4: bytes(4), AF6: bytes(16)}
DEFAULT_OIF = 2  # the stand-in resolves a gateway without a device to eth0

DSTS4 = ["10.0.0.0/24", "10.0.0.0/16", "10.0.1.0/24", "10.0.0.7/32", "0.0.0.0/0"]
DSTS6 = ["2001:db8::/64", "2001:db8:1::/64", "::/0"]
GATEWAYS = {AF4: ["192.0.2.2", "192.0.2.3"], AF6: ["2001:db8:ff::2", "2001:db8:ff::3"]}
SOURCES = {AF4: "192.0.2.1", AF6: "2001:db8:ff::1"}
OTHER_PROTOCOLS = [nl.RTPROT_KERNEL, nl.RTPROT_BOOT, nl.RTPROT_STATIC, nl.RTPROT_BIRD, 186]
TABLES = [nl.RT_TABLE_MAIN, 100, 1000]


# --- the kernel stand-in -------------------------------------------------------------------


class Entry(NamedTuple):
    """One route in the stand-in's tables, as the kernel holds it."""

    family: int
    table: int
    dst: bytes  # full-length address, zeros for the default route
    dst_len: int
    tos: int
    priority: int  # as the kernel files it: IPv4 default 0, IPv6 default (and 0) 1024
    protocol: int
    scope: int
    type: int
    flags: int  # rtm_flags (RTNH_F_ONLINK)
    gateway: bytes | None
    oif: int
    prefsrc: bytes | None
    mtu: int | None

    @property
    def key(self) -> tuple:
        return (self.family, self.table, self.dst, self.dst_len, self.tos, self.priority)

    @property
    def text(self) -> str:
        return f"{socket.inet_ntop(self.family, self.dst)}/{self.dst_len}"

    def describe(self) -> str:
        gw = "" if self.gateway is None else f" via {socket.inet_ntop(self.family, self.gateway)}"
        dev = f" dev {LINKS.get(self.oif, self.oif)}" if self.oif else ""
        return (f"{self.text}{gw}{dev} table {self.table} proto {self.protocol} metric {self.priority}"
                f" tos {self.tos} type {self.type} flags {self.flags} mtu {self.mtu}")


def entry_order(entry: Entry) -> tuple:
    """A sort key for entries: one IPv6 key can hold a gateway route and a route without one
    (the fib6 leaf), and None does not compare with bytes (nor with an int: prefsrc, mtu)."""
    return tuple((value is not None, value) for value in entry)


def kernel_priority(family: int, priority: int | None) -> int:
    if family == AF6:
        return priority or 1024  # IP6_RT_PRIO_USER for none and for 0
    return priority or 0


def ecmp_entry(entry: Entry) -> bool:
    """rt6_qualify_for_ecmp: an IPv6 gateway route."""
    return entry.family == AF6 and entry.gateway is not None


def entry_message(entry: Entry, mtype: int, seq: int, flags: int) -> bytes:
    """How the kernel reports a route (dump answer or notification)."""
    # IPv4 reports RTA_PRIORITY only when non-zero, IPv6 always.
    priority = entry.priority if entry.family == AF6 or entry.priority else None
    template = nl.route_template(
        entry.family, table=entry.table, protocol=entry.protocol, scope=entry.scope, rtype=entry.type,
        rtm_flags=entry.flags, tos=entry.tos, gateway=entry.gateway, oif=entry.oif, priority=priority,
        prefsrc=entry.prefsrc, mtu=entry.mtu)
    return nl.encode_route(mtype, seq, flags, entry.dst, entry.dst_len, template)


_IFINFO = struct.Struct("=IHHIIBxHiII")


def link_message(mtype: int, seq: int, flags: int, index: int, up: bool) -> bytes:
    name = nl.attr(nl.IFLA_IFNAME, LINKS[index].encode() + b"\0")
    return _IFINFO.pack(32 + len(name), mtype, flags, seq, 0, nl.AF_UNSPEC, 1, index,
                        nl.IFF_UP if up else 0, 0) + name


class FakeKernel:
    """The stand-in: route tables, links, and the monitor socket of whoever listens."""

    def __init__(self, strict_dumps: bool, old_replace: bool = True) -> None:
        self.routes: dict[tuple, Entry] = {}  # the first route per key
        self.beside: dict[tuple, list[Entry]] = {}  # IPv6: the key's other routes, in leaf order
        self.old_replace = old_replace  # Linux 4.1-4.18's IPv6 replace (fib6_add_rt2node)
        self.strict_dumps = strict_dumps
        self.monitor: FakeMonitorSocket | None = None
        self.requests: list[tuple[str, Entry | nl.RouteMessage, int]] = []  # (op, target, errno)
        self.watch = None  # called after every request of the programmer

    # requests from the programmer (its request socket) ------------------------------------

    def request(self, mtype: int, flags: int, buf: bytes, start: int, end: int) -> int:
        msg = nl.decode_route(buf, start, end)
        assert msg.family in (AF4, AF6), msg
        if mtype == nl.RTM_NEWROUTE and msg.oif and msg.oif not in LINKS:
            self.requests.append(("add", msg, errno.ENODEV))  # fib_check_nh/ip6_route_info_create
            return errno.ENODEV
        if mtype == nl.RTM_NEWROUTE:
            entry = self._entry_of(msg)
            if flags & nl.NLM_F_REPLACE:
                op = "replace"
                err = self._replace(entry, flags & nl.NLM_F_CREATE)[0]
            elif flags & nl.NLM_F_CREATE and not flags & nl.NLM_F_EXCL:
                assert entry.family == AF6, "only IPv6 routes go beside"
                op = "beside"
                err = self._add(entry, beside=True)
            else:
                assert flags & nl.NLM_F_CREATE and flags & nl.NLM_F_EXCL, "adds must never overwrite"
                op = "add"
                err = self._add(entry)
            self.requests.append((op, entry, err))
        elif mtype == nl.RTM_DELROUTE:
            op = "delete"
            err = 0 if self._delete(msg) is not None else errno.ESRCH
            self.requests.append((op, msg, err))
        else:
            raise AssertionError(f"unexpected request type {mtype}")
        if self.watch is not None:
            self.watch(op, err)
        return err

    def _entry_of(self, msg: nl.RouteMessage) -> Entry:
        oif = msg.oif
        if not oif and msg.gateway is not None and msg.type == nl.RTN_UNICAST:
            oif = DEFAULT_OIF
        assert not oif or oif in LINKS
        return Entry(msg.family, msg.table, msg.dst or ZERO[msg.family], msg.dst_len,
                     msg.tos, kernel_priority(msg.family, msg.priority), msg.protocol, msg.scope, msg.type,
                     msg.flags, msg.gateway, oif, msg.prefsrc, msg.mtu)

    # the fib6 leaf of a key -------------------------------------------------------------

    def leaf(self, key: tuple) -> list[Entry]:
        first = self.routes.get(key)
        return [] if first is None else [first, *self.beside.get(key, ())]

    def set_leaf(self, key: tuple, leaf: list[Entry]) -> None:
        if leaf:
            self.routes[key] = leaf[0]
        else:
            self.routes.pop(key, None)
        if leaf[1:]:
            self.beside[key] = list(leaf[1:])
        else:
            self.beside.pop(key, None)

    def entries(self) -> list[Entry]:
        return [e for key in sorted(self.routes) for e in self.leaf(key)]

    def remove(self, entry: Entry) -> None:
        leaf = self.leaf(entry.key)
        leaf.remove(entry)
        self.set_leaf(entry.key, leaf)

    def _add(self, entry: Entry, beside: bool = False) -> int:
        leaf = self.leaf(entry.key)
        if leaf and not beside:
            return errno.EEXIST  # NLM_F_EXCL
        if any(e.gateway == entry.gateway and e.oif == entry.oif for e in leaf):
            return errno.EEXIST  # rt6_duplicate_nexthop, whoever's
        # Linux makes an IPv6 gateway route added beside another one its ECMP sibling: the
        # programmer never adds one beside another daemon's (their route), nor beside one of its
        # own (it replaces that), and nobody else here appends.
        assert not (ecmp_entry(entry) and any(ecmp_entry(e) for e in leaf)), \
            f"{entry.describe()} would be an ECMP sibling of {[e.describe() for e in leaf if ecmp_entry(e)]}"
        self.set_leaf(entry.key, [*leaf, entry])
        return 0

    def _replace(self, entry: Entry, create: bool) -> tuple[int, Entry | None]:
        leaf = self.leaf(entry.key)
        if not leaf:
            if not create:
                return errno.ENOENT, None
            self.set_leaf(entry.key, [entry])
            return 0, None
        # fib6_add_rt2node: the first route as ECMP-able as the new one, else (fallback_ins)
        # the first one -- before Linux 4.19 only for an ECMP-able new route: one that is not
        # is then added (NLM_F_CREATE) or refused.  IPv4 has one route per key.
        i = next((i for i, e in enumerate(leaf) if ecmp_entry(e) == ecmp_entry(entry)), None)
        if i is None:
            if self.old_replace and not ecmp_entry(entry):
                if not create:
                    return errno.ENOENT, None
                self.set_leaf(entry.key, [*leaf, entry])
                return 0, None
            i = 0
        old = leaf[i]
        self.set_leaf(entry.key, [*leaf[:i], entry, *leaf[i + 1:]])
        return 0, old

    def _delete(self, msg: nl.RouteMessage) -> Entry | None:
        dst = msg.dst or ZERO[msg.family]
        candidates = sorted(
            (e for e in self.entries()
             if e.family == msg.family and e.table == msg.table and e.dst == dst and e.dst_len == msg.dst_len
             and e.tos == msg.tos
             and (not msg.priority or e.priority == msg.priority)
             and (not msg.protocol or e.protocol == msg.protocol)
             and (not msg.type or e.type == msg.type)
             and (msg.scope == nl.RT_SCOPE_NOWHERE or e.scope == msg.scope)
             and (msg.gateway is None or (e.gateway or ZERO[e.family]) == msg.gateway)
             and (not msg.oif or e.oif == msg.oif)),
            key=lambda e: e.priority)
        if not candidates:
            return None
        self.remove(candidates[0])
        return candidates[0]

    def dump(self, request: bytes, seq: int) -> bytes:
        ((mtype, _flags, _seq, _pid, start, end),) = list(nl.iter_messages(request))
        if mtype == nl.RTM_GETLINK:
            return b"".join(link_message(nl.RTM_NEWLINK, seq, nl.NLM_F_MULTI, index, True) for index in LINKS)
        assert mtype == nl.RTM_GETROUTE, mtype
        want = nl.decode_route(request, start, end)
        out = []
        for entry in self.entries():
            if entry.family != want.family:
                continue
            if self.strict_dumps and ((want.table and entry.table != want.table)
                                      or (want.protocol and entry.protocol != want.protocol)):
                continue
            out.append(entry_message(entry, nl.RTM_NEWROUTE, seq, nl.NLM_F_MULTI))
        return b"".join(out)

    # changes made by other people ---------------------------------------------------------

    def notify(self, message: bytes) -> None:
        if self.monitor is not None:
            self.monitor.queue.append(message)

    def others_add(self, entry: Entry, replace: bool) -> None:
        """``ip route add`` (EXCL) or ``ip route replace`` (CREATE|REPLACE) by someone else."""
        if replace:
            _err, old = self._replace(entry, True)
            flags = nl.NLM_F_REPLACE if old is not None else nl.NLM_F_CREATE | nl.NLM_F_EXCL
        elif self._add(entry):
            return  # EEXIST: nothing changed, nothing to tell
        else:
            flags = nl.NLM_F_CREATE | nl.NLM_F_EXCL
        self.notify(entry_message(entry, nl.RTM_NEWROUTE, 0, flags))

    def others_delete(self, entry: Entry) -> None:
        self.remove(entry)
        self.notify(entry_message(entry, nl.RTM_DELROUTE, 0, 0))

    def flap(self, index: int) -> None:
        """A link goes down and up: its IPv4 routes are flushed without a route notification."""
        for entry in [e for e in self.routes.values() if e.family == AF4 and e.oif == index]:
            self.remove(entry)
        self.notify(link_message(nl.RTM_NEWLINK, 0, 0, index, False))
        self.notify(link_message(nl.RTM_NEWLINK, 0, 0, index, True))

    def overrun(self) -> None:
        if self.monitor is not None:
            self.monitor.queue.clear()
            self.monitor.queue.append(OSError(errno.ENOBUFS, os.strerror(errno.ENOBUFS)))


class FakeRequestSocket:
    portid = 4711
    sndbuf = 1 << 20

    def __init__(self, kernel: FakeKernel) -> None:
        self.kernel = kernel
        self.interrupted_link_dumps = 0  # so many link dumps skip eth1 and say NLM_F_DUMP_INTR
        self.link_dumps = 0

    async def send_batch(self, data: bytes, first_seq: int, last_seq: int, *, timeout: float = 10.0):
        errors = []
        messages = list(nl.iter_messages(data))
        assert [m[2] for m in messages] == list(range(first_seq, last_seq + 1))
        assert messages[-1][1] & nl.NLM_F_ACK
        for mtype, mflags, seq, _pid, start, end in messages:
            err = self.kernel.request(mtype, mflags & ~nl.NLM_F_ACK, data, start, end)
            if err:
                errors.append((seq, err, None))
        return errors, True

    async def dump(self, request: bytes, seq: int, handle, *, timeout: float = 30.0, what: str = "dump") -> bool:
        chunk = self.kernel.dump(request, seq)
        links = next(nl.iter_messages(request))[0] == nl.RTM_GETLINK
        interrupted = links and self.link_dumps < self.interrupted_link_dumps
        self.link_dumps += links
        for mtype, _flags, _seq, _pid, start, end in nl.iter_messages(chunk):
            if interrupted and nl.decode_link(chunk, start, end).name == "eth1":
                continue  # a link created mid-dump moved the kernel's cursor past it
            handle(mtype, chunk, start, end)
        return not interrupted

    def close(self) -> None:
        pass


class FakeMonitorSocket:
    """Queued notifications; the fd is a pipe nobody writes, so the loop never calls the
    reader by itself: the test delivers the queue (``netlink.monitor.read()``) when it chooses."""

    def __init__(self, kernel: FakeKernel) -> None:
        self.kernel = kernel
        self.queue: deque[bytes | OSError] = deque()
        self._r, self._w = os.pipe()
        kernel.monitor = self

    def fileno(self) -> int:
        return self._r

    def recv(self) -> bytes | None:
        if not self.queue:
            return None
        item = self.queue.popleft()
        if isinstance(item, OSError):
            raise item
        return item

    def close(self) -> None:
        if self.kernel.monitor is self:
            self.kernel.monitor = None
        os.close(self._r)
        os.close(self._w)


class StandInProgrammer(RouteProgrammer):
    """The real programmer, its sockets swapped for the stand-in's."""

    def __init__(self, kernel: FakeKernel, **kwargs) -> None:
        super().__init__(sockets=lambda: (FakeRequestSocket(kernel), FakeMonitorSocket(kernel)), **kwargs)
        self.fake_kernel = kernel


# --- routes and the expected kernel state ----------------------------------------------------


def family_of(dst: str) -> int:
    return AF6 if ":" in dst else AF4


def pton(family: int, text: str | None) -> bytes | None:
    return None if text is None else socket.inet_pton(family, text)


def key_of(route: Route, table: int) -> tuple:
    family = family_of(route.dst)
    addr, _, plen = route.dst.partition("/")
    return (family, table, socket.inet_pton(family, addr), int(plen), 0, kernel_priority(family, route.metric))


def entry_of_route(route: Route, *, table: int, protocol: int, tos: int = 0) -> Entry:
    """What ``ip route add ROUTE table T proto P tos X`` leaves in the kernel."""
    family = family_of(route.dst)
    addr, _, plen = route.dst.partition("/")
    rtype = ROUTE_KINDS[route.kind]
    oif = IFINDEX[route.dev] if route.dev else (DEFAULT_OIF if route.gateway else 0)
    scope = nl.RT_SCOPE_LINK if (family == AF4 and rtype == nl.RTN_UNICAST and route.gateway is None) else 0
    return Entry(family, table, socket.inet_pton(family, addr), int(plen), tos,
                 kernel_priority(family, route.metric), protocol, scope, rtype,
                 nl.RTNH_F_ONLINK if route.onlink else 0, pton(family, route.gateway), oif,
                 pton(family, route.src), route.mtu)


def satisfies(entry: Entry, want: Route) -> bool:
    """Does the kernel route do what the desired one asks (a desired route without a device
    takes whichever the kernel chose)?"""
    family = family_of(want.dst)
    return (entry.tos == 0 and entry.type == ROUTE_KINDS[want.kind]
            and entry.priority == kernel_priority(family, want.metric)
            and entry.gateway == pton(family, want.gateway)
            and (want.dev is None or entry.oif == IFINDEX[want.dev])
            and bool(entry.flags & nl.RTNH_F_ONLINK) == want.onlink
            and entry.mtu == want.mtu and entry.prefsrc == pton(family, want.src))


def route_of_entry(entry: Entry, keep_dev: bool) -> Route | None:
    """A desired Route that this (own) kernel route already is."""
    kind = {v: k for k, v in ROUTE_KINDS.items()}.get(entry.type)
    if kind is None or entry.tos:
        return None
    gateway = None if entry.gateway is None else socket.inet_ntop(entry.family, entry.gateway)
    dev = LINKS[entry.oif] if entry.oif and (keep_dev or gateway is None or entry.flags & nl.RTNH_F_ONLINK) else None
    return Route(entry.text, gateway, dev, bool(entry.flags & nl.RTNH_F_ONLINK), kind, entry.priority, entry.mtu,
                 None if entry.prefsrc is None else socket.inet_ntop(entry.family, entry.prefsrc))


@st.composite
def routes(draw, dst: str | None = None) -> Route:
    dst = dst or draw(st.sampled_from(DSTS4 + DSTS6))
    family = family_of(dst)
    kind = draw(st.sampled_from(["unicast", "unicast", "unicast", "blackhole", "unreachable"]))
    metric = draw(st.sampled_from([None, None, 5, 100, 1024 if family == AF6 else 0]))
    mtu = draw(st.sampled_from([None, None, 1400]))
    src = draw(st.sampled_from([None, None, SOURCES[family]]))
    gateway = dev = None
    onlink = False
    if kind == "unicast":
        gateway = draw(st.sampled_from([None, *GATEWAYS[family]]))
        dev = draw(st.sampled_from([None, "eth0", "eth1"] if gateway else ["eth0", "eth1"]))
        onlink = bool(gateway and dev and draw(st.booleans()))
    return Route(dst, gateway, dev, onlink, kind, metric, mtu, src)


@st.composite
def desired_sets(draw) -> list[Route]:
    dsts = draw(st.lists(st.sampled_from(DSTS4 + DSTS6), unique=True, max_size=6))
    return [draw(routes(dst)) for dst in dsts]


@st.composite
def external_entries(draw, table: int) -> Entry:
    """A route someone else adds: our protocol or another, our table or another, maybe TOS."""
    route = draw(routes())
    protocol = draw(st.sampled_from([OURS, OURS, *OTHER_PROTOCOLS]))
    in_table = draw(st.sampled_from([table, table, table, *TABLES]))
    tos = draw(st.sampled_from([0, 0, 0, 0x10])) if family_of(route.dst) == AF4 else 0
    return entry_of_route(route, table=in_table, protocol=protocol, tos=tos)


# --- the model -------------------------------------------------------------------------------


class RouteModel(RuleBasedStateMachine):
    """Drives one StandInProgrammer against the stand-in and checks a)-d) at every sync."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.kernel: FakeKernel | None = None
        self.p: StandInProgrammer | None = None

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            if self.p is not None:
                self.run(self.p.stop())
        finally:
            self.loop.close()

    # the model of the caller's declarations
    def _reset_caller(self) -> None:
        self.desired: dict[str, Route] = {}
        self.complete = False
        self.discarded: set[str] = set()

    def _start(self) -> None:
        self._reset_caller()
        self.p = StandInProgrammer(self.kernel, table=self.table)
        before_routes = self.kernel.entries()
        before_requests = len(self.kernel.requests)
        self.run(self.p.start())
        tasks, self.p._tasks = self.p._tasks, []
        for task in tasks:  # the test drives reconcile() itself
            task.cancel()
        self.run(asyncio.gather(*tasks, return_exceptions=True))
        assert self.kernel.requests[before_requests:] == [], "start() must only read (adoption)"
        assert self.kernel.entries() == before_routes

    @initialize(table=st.sampled_from([nl.RT_TABLE_MAIN, 1000]), strict=st.booleans(), old_replace=st.booleans(),
                data=st.data())
    def setup(self, table, strict, old_replace, data) -> None:
        # What a previous run of agentd and everybody else left in the tables.
        previous = data.draw(st.lists(routes(), max_size=6), label="own routes left by a previous run")
        others = data.draw(st.lists(external_entries(table), max_size=5), label="other routes")
        self.setup_with(table, strict, [entry_of_route(r, table=table, protocol=OURS) for r in previous] + others,
                        old_replace)

    def setup_with(self, table: int, strict: bool, entries: list[Entry], old_replace: bool = True) -> None:
        self.table = table
        self.kernel = FakeKernel(strict_dumps=strict, old_replace=old_replace)
        for entry in entries:
            if entry.key not in self.kernel.routes:
                self.kernel.routes[entry.key] = entry
        self._start()

    # --- views of the stand-in --------------------------------------------------------------

    def ours(self, entry: Entry) -> bool:
        return entry.protocol == OURS and entry.table == self.table

    def own_entries(self) -> list[Entry]:
        return [e for e in self.kernel.entries() if self.ours(e)]

    def not_ours(self) -> list[Entry]:
        return sorted((e for e in self.kernel.entries() if not self.ours(e)), key=entry_order)

    def blocked(self, want: Route) -> bool:
        """Another protocol's route holds the key of this desired route in our table, and no
        route of ours is there beside it, or, IPv6, none as ECMP-able as the desired one (a
        gateway route, or one without), which a replace would take: the desired route would
        go beside ours, and never goes beside another daemon's route (a gateway route would
        be its ECMP sibling; their key, as for IPv4).  Our old routes at the key stay, and
        carry the traffic."""
        leaf = self.kernel.leaf(key_of(want, self.table))
        if not any(e.protocol != OURS for e in leaf):
            return False
        mine = [e for e in leaf if e.protocol == OURS]
        hop = entry_of_route(want, table=self.table, protocol=OURS)
        return not mine or hop.family == AF6 and not any(ecmp_entry(e) == ecmp_entry(hop) for e in mine)

    def own_at(self, want: Route) -> list[Entry]:
        return [e for e in self.kernel.leaf(key_of(want, self.table)) if self.ours(e)]

    def dump_state(self) -> str:
        return "\n".join(e.describe() for e in sorted(self.kernel.entries(), key=entry_order))

    # --- the caller (plain methods: the scenario tests below call them too) -------------------

    def set_desired(self, routes: list[Route]) -> None:
        self.p.set_desired(routes)
        self.desired = {r.dst: r for r in routes}
        self.complete = True
        self.discarded.clear()

    def upsert(self, route: Route) -> None:
        self.p.upsert(route)
        self.desired[route.dst] = route
        self.discarded.discard(route.dst)

    def discard(self, dst: str) -> None:
        self.p.discard(dst)
        self.desired.pop(dst, None)
        if not self.complete:
            self.discarded.add(dst)

    def then(self, sync: bool | None) -> None:
        """Most steps are followed by a sync (``None``: not yet; else non-full or full)."""
        if sync is not None:
            self.sync(sync)

    THEN = st.sampled_from([None, False, True])

    @rule(routes=desired_sets(), then=THEN)
    def set_desired_rule(self, routes, then) -> None:
        self.set_desired(routes)
        self.then(then)

    @rule(data=st.data(), then=THEN)
    def desire_what_is_there(self, data, then) -> None:
        """The caller relearns (some of) the routes already in the kernel: the adoption case."""
        chosen = []
        for entry in sorted(self.own_entries(), key=entry_order):
            route = route_of_entry(entry, keep_dev=data.draw(st.booleans()))
            if route is not None and route.dst not in {r.dst for r in chosen} and data.draw(st.booleans()):
                chosen.append(route)
        if data.draw(st.booleans(), label="whole set (else upserts)"):
            taken = {r.dst for r in chosen}
            self.set_desired(chosen + [r for r in data.draw(desired_sets(), label="and") if r.dst not in taken][:2])
        else:
            for route in chosen:
                self.upsert(route)
        self.then(then)

    @rule(route=routes(), then=THEN)
    def upsert_rule(self, route, then) -> None:
        self.upsert(route)
        self.then(then)

    @rule(dst=st.sampled_from(DSTS4 + DSTS6), then=THEN)
    def discard_rule(self, dst, then) -> None:
        self.discard(dst)
        self.then(then)

    # --- everybody else -----------------------------------------------------------------------

    def others_add(self, entry: Entry, replace: bool) -> None:
        self.kernel.others_add(entry, replace)

    @rule(data=st.data(), replace=st.booleans(), then=THEN)
    def others_add_rule(self, data, replace, then) -> None:
        self.others_add(data.draw(external_entries(self.table)), replace)
        self.then(then)

    @rule(pick=st.integers(0, 1 << 16), then=THEN)
    def others_delete(self, pick, then) -> None:
        entries = sorted(self.kernel.entries(), key=entry_order)
        if entries:
            self.kernel.others_delete(entries[pick % len(entries)])
        self.then(then)

    @rule(pick=st.integers(0, 1 << 16), protocol=st.sampled_from([OURS, *OTHER_PROTOCOLS]), then=THEN)
    def others_replace_ours(self, pick, protocol, then) -> None:
        """Someone replaces one of our routes with theirs (or with another own-protocol one)."""
        own = sorted(self.own_entries(), key=entry_order)
        if own:
            victim = own[pick % len(own)]
            self.kernel.others_add(victim._replace(protocol=protocol, mtu=None if victim.mtu else 1300), True)
        self.then(then)

    @rule(index=st.sampled_from([2, 3]), then=THEN)
    def link_flap(self, index, then) -> None:
        self.kernel.flap(index)
        self.then(then)

    @rule(then=THEN)
    def monitor_overrun(self, then) -> None:
        self.kernel.overrun()
        self.then(then)

    @rule()
    def deliver_events(self) -> None:
        self.p.netlink.monitor.read()

    @rule(remove_routes=st.booleans(), then=THEN)
    def restart(self, remove_routes, then) -> None:
        self.deliver_events()
        others = self.not_ours()
        self.run(self.p.stop(remove_routes=remove_routes))
        self.p = None
        assert self.not_ours() == others, "stop() touched routes that are not ours"
        if remove_routes:
            assert self.own_entries() == [], "stop(remove_routes=True) left own routes:\n" + self.dump_state()
        self._start()
        self.then(then)

    # --- syncs and the properties ----------------------------------------------------------------

    @rule(full=st.booleans())
    def sync(self, full: bool) -> None:
        self.deliver_events()  # the loop reads the monitor before the coalesced reconcile runs
        others = self.not_ours()
        # d) no gap: desired destinations that have a route of ours now keep one throughout;
        #    an own route that already is the desired one is never touched.
        keep = {dst for dst, want in self.desired.items()
                if not self.blocked(want) and any(e.text == dst for e in self.own_entries())}
        untouched = [entry for want in self.desired.values() for entry in self.own_at(want)
                     if satisfies(entry, want)]

        def watch(op, err) -> None:
            have = {e.text for e in self.own_entries()}
            gone = keep - have
            assert not gone, f"gap: {sorted(gone)} had a route of ours and lost it ({op}, errno {err})"
            for entry in untouched:
                assert entry in self.kernel.leaf(entry.key), f"touched adopted {entry.describe()} ({op})"

        self.kernel.watch = watch
        try:
            result = self.run(self.p.reconcile(full=full))
        finally:
            self.kernel.watch = None
        # b)
        assert self.not_ours() == others, "a sync changed routes that are not ours"
        # a)
        self.check_converged(result)
        # c)
        self.check_idempotent()

    def check_converged(self, result) -> None:
        state = f"\nkernel:\n{self.dump_state()}\nresult: {result}\nfailures: {self.p.failures}"
        for dst, want in self.desired.items():
            if self.blocked(want):
                assert dst in self.p.conflicts, f"{dst} conflicts but is not reported" + state
                continue
            mine = self.own_at(want)
            assert len(mine) == 1 and satisfies(mine[0], want), f"desired {want} is not in the kernel" + state
            assert dst not in self.p.failures, f"{dst} installed but filed as a failure" + state
            assert dst not in self.p.conflicts, f"{dst} installed but reported as a conflict" + state
        own = self.own_entries()
        if self.complete:
            # At a key another daemon's route blocks, our old routes may stay (see blocked()).
            expected = {key_of(w, self.table) for w in self.desired.values()}
            extra = [e.describe() for e in own if e.key not in expected]
            assert not extra, f"own routes nobody wants: {extra}" + state
        else:
            left = [e.describe() for e in own if e.text in self.discarded]
            assert not left, f"discarded destinations still routed: {left}" + state

    def check_idempotent(self) -> None:
        routes = self.kernel.entries()
        n = len(self.kernel.requests)
        syncs = [lambda: self.p.reconcile()]
        if self.complete:
            def same_again():
                self.p.set_desired(list(self.desired.values()))
                return self.p.reconcile()
            syncs.append(same_again)
        for again in syncs:
            result = self.run(again())
            assert self.kernel.requests[n:] == [], f"second sync sent requests: {self.kernel.requests[n:]}"
            assert (result.added, result.replaced, result.removed) == ((), (), ())
        # A full resync re-reads the kernel and re-tries conflicting adds only.
        self.run(self.p.reconcile(full=True))
        conflicting = {key_of(w, self.table) for w in self.desired.values() if self.blocked(w)}
        for op, target, err in self.kernel.requests[n:]:
            assert op in ("add", "beside") and target.key in conflicting and err == errno.EEXIST, \
                f"full resync of an unchanged set sent {op} {target} (errno {err})"
        assert self.kernel.entries() == routes


# --- the tests -----------------------------------------------------------------------------------

SETTINGS = {"stateful_step_count": 30, "deadline": None,
            "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much]}


def test_route_programmer_model():
    # Derandomized, without the example database and without shrinking: the same sequences
    # every run (they found the bugs below); the scenario tests show those minimal.
    run_state_machine_as_test(RouteModel, settings=settings(
        max_examples=300, derandomize=True, database=None, phases=[Phase.generate], report_multiple_bugs=False,
        **SETTINGS))


def test_route_programmer_model_random():
    # New sequences every run (ROUTE_MODEL_EXAMPLES of them), with shrinking.
    run_state_machine_as_test(RouteModel, settings=settings(
        max_examples=int(os.environ.get("ROUTE_MODEL_EXAMPLES", "150")), **SETTINGS))


# --- adoption at start, on its own --------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(previous=st.lists(routes(), max_size=6, unique_by=lambda r: r.dst),
       others=st.lists(external_entries(nl.RT_TABLE_MAIN), max_size=4),
       keep=st.lists(st.booleans(), min_size=6, max_size=6), new=desired_sets(), full=st.booleans())
def test_adoption_at_start(previous, others, keep, new, full):
    """d) A restarted programmer finds its routes of the previous run; the caller declares
    (some of) them again, with new ones: nothing desired that is already there is touched,
    no destination routed by us is ever unrouted, and a)-c) hold after the first sync."""
    m = RouteModel()
    try:
        m.setup_with(nl.RT_TABLE_MAIN, True,
                     [entry_of_route(r, table=nl.RT_TABLE_MAIN, protocol=OURS) for r in previous] + others)
        again = [r for r, k in zip(previous, keep) if k]
        taken = {r.dst for r in again}
        m.set_desired(again + [r for r in new if r.dst not in taken])
        n = len(m.kernel.requests)
        m.sync(full)  # checks a), b), c) and d)
        touched = {key for op, target, _err in m.kernel.requests[n:] if op != "delete" for key in [target.key]}
        assert not touched & {key_of(r, nl.RT_TABLE_MAIN) for r in again}
    finally:
        m.teardown()


# --- the bugs it found, minimal -------------------------------------------------------------------------

X = "10.0.0.0/24"


class scenario:
    """A RouteModel (all properties checked at every sync) over a kernel holding ``own``
    routes of a previous run and ``others``; the programmer already started."""

    def __init__(self, own=(), others=()) -> None:
        self.own, self.others = own, others

    def __enter__(self) -> RouteModel:
        self.m = RouteModel()
        self.m.setup_with(nl.RT_TABLE_MAIN, True, [entry_of_route(r, table=nl.RT_TABLE_MAIN, protocol=OURS)
                                                   for r in self.own] + list(self.others))
        return self.m

    def __exit__(self, *exc) -> None:
        self.m.teardown()


def test_bug1_discard_before_set_desired_lost_by_a_full_sync():
    with scenario(own=[Route(X, dev="eth0")]) as m:
        m.discard(X)
        m.sync(True)  # a) discarded destinations still routed


def test_bug2_set_desired_sync_skips_recorded_conflicts():
    theirs = entry_of_route(Route(X, dev="eth1"), table=nl.RT_TABLE_MAIN, protocol=nl.RTPROT_STATIC)
    with scenario(others=[theirs]) as m:
        m.set_desired([Route(X, dev="eth0")])
        m.sync(False)  # a conflict, reported: right
        m.kernel.others_delete(theirs)  # the monitor tells the programmer
        m.set_desired([Route(X, dev="eth0")])
        m.sync(False)  # a) the desired route is not in the kernel


def test_bug3_adopted_stray_that_is_desired_is_deleted():
    desired = Route(X, kind="blackhole", metric=100)
    with scenario(own=[Route(X, dev="eth0"), desired]) as m:
        m.set_desired([desired])
        m.sync(False)  # d) gap: X had a route of ours and lost it


def test_bug4_full_resync_of_unchanged_set_deletes():
    with scenario(own=[Route(X, dev="eth0"), Route(X, kind="blackhole", metric=5)]) as m:
        mine = m.kernel.routes[key_of(Route(X, dev="eth0"), nl.RT_TABLE_MAIN)]
        m.kernel.others_add(mine._replace(protocol=nl.RTPROT_KERNEL), True)
        m.upsert(Route(X, dev="eth0"))
        m.sync(False)  # c) the full resync that follows deletes the metric-5 route


def test_bug4b_discard_before_set_desired_leaves_a_second_own_route():
    with scenario(own=[Route(X, dev="eth0"), Route(X, kind="blackhole", metric=5)]) as m:
        m.discard(X)
        m.sync(False)  # a) discarded destinations still routed: the one filed as a stray stays


def test_bug4c_second_own_route_holding_the_desired_key_is_replaced_not_deleted():
    # Filed in metric order, the metric-5 route became X's route and the metric-100 one a
    # stray: the add of the desired route met the stray (EEXIST, ours: replaced), then the
    # stray's delete, by key, took the desired route away.
    with scenario(own=[Route(X, kind="blackhole", metric=5), Route(X, gateway="192.0.2.3", metric=100)]) as m:
        m.set_desired([Route(X, gateway="192.0.2.2", metric=100)])
        m.sync(False)  # d) gap: X had a route of ours and lost it


def test_bug4d_upsert_of_the_route_filed_as_a_stray():
    wanted = Route(X, kind="blackhole", metric=5)
    with scenario() as m:
        m.set_desired([Route(X, dev="eth0")])
        m.sync(False)
        m.kernel.others_add(entry_of_route(wanted, table=nl.RT_TABLE_MAIN, protocol=OURS), False)
        m.deliver_events()  # the monitor files it as a stray, to be deleted
        m.upsert(wanted)
        m.sync(False)  # d) gap: the stray's delete took the route now wanted



def test_bug5_conflict_kept_after_someone_puts_our_route_in_its_place():
    # Another protocol's route held our key (a conflict); someone replaced it with a route
    # of our protocol that is the desired one: the conflict stayed reported forever (a).
    # Found by test_route_programmer_model_random.
    want = Route(X, dev="eth0")
    with scenario() as m:
        m.upsert(want)
        m.sync(False)
        m.others_replace_ours(0, nl.RTPROT_BOOT, None)
        m.upsert(want)
        m.sync(False)  # a conflict, reported: right
        m.others_add(entry_of_route(want, table=nl.RT_TABLE_MAIN, protocol=OURS), True)
        m.upsert(want)
        m.sync(False)  # a) installed but reported as a conflict


@pytest.mark.parametrize("old_replace", [True, False], ids=["linux-4.1-4.18", "later"])
@pytest.mark.parametrize("other", [Route("2001:db8::/64", dev="eth1"), Route("2001:db8::/64", kind="blackhole"),
                                   Route("2001:db8::/64", kind="unreachable", mtu=1400)],
                         ids=["dev-only", "blackhole", "unreachable"])
def test_bug6_ipv6_gateway_route_becomes_one_no_replace_can_put_in_its_place(old_replace, other):
    # A peer moved to the user-space backend (a device-only route), or a blackhole: before
    # Linux 4.19 an IPv6 replace takes no gateway route for such a route (ENOENT), the add
    # then meets EEXIST, and the destination is filed as a failure at every resync while
    # the old gateway route carries the traffic.  And back: a gateway route replaces it.
    gateway = Route("2001:db8::/64", gateway="2001:db8:ff::2", dev="eth0")
    with scenario() as m:
        m.kernel.old_replace = old_replace
        for want in (gateway, other, gateway, other):
            m.upsert(want)
            m.sync(False)  # a) exactly the desired route, nothing filed as a failure; d) no gap
            assert m.p.failures == {} and len(m.own_entries()) == 1
        m.set_desired([gateway])
        m.sync(True)
        assert m.p.failures == {} and [e.gateway for e in m.own_entries()] == [pton(AF6, "2001:db8:ff::2")]


@pytest.mark.parametrize("old_replace", [True, False], ids=["linux-4.1-4.18", "later"])
def test_a_route_added_beside_ours_meeting_another_daemons_next_hop_is_a_conflict(old_replace):
    # Our desired IPv6 route becomes a blackhole: it goes beside our gateway route at its key.
    # Another daemon's blackhole comes in there (on 4.1-4.18 what `ip -6 route replace
    # blackhole` leaves) just after the programmer read the table: the add meets EEXIST
    # (rt6_duplicate_nexthop).  It was filed as a failure at every resync, the errors counter
    # bumped each time; it is a conflict naming the owner, and our gateway route stays (it
    # carries the traffic).  Later syncs find their route in the table read and send nothing.
    gateway = Route("2001:db8::/64", gateway="2001:db8:ff::2", dev="eth0")
    blackhole = Route("2001:db8::/64", kind="blackhole")
    theirs = entry_of_route(blackhole, table=nl.RT_TABLE_MAIN, protocol=nl.RTPROT_BIRD)
    with scenario(own=[gateway]) as m:
        m.kernel.old_replace = old_replace
        key = key_of(gateway, nl.RT_TABLE_MAIN)
        read = m.p.netlink.dump_table

        async def read_then_bird_comes(families):
            messages = await read(families)
            if theirs not in m.kernel.leaf(key):
                m.kernel.set_leaf(key, [*m.kernel.leaf(key), theirs])
            return messages

        m.p.netlink.dump_table = read_then_bird_comes
        m.set_desired([blackhole])
        for full, sent in ((False, [("beside", errno.EEXIST)]), (True, []), (True, [])):
            n = len(m.kernel.requests)
            result = m.run(m.p.reconcile(full=full))
            assert [(op, err) for op, _target, err in m.kernel.requests[n:]] == sent
            assert result.failed == () and [dst for dst, _reason in result.conflicts] == [blackhole.dst]
            assert "proto bird" in result.conflicts[0][1]
            assert m.p.failures == {} and list(m.p.conflicts) == [blackhole.dst]
            assert [e.protocol for e in m.kernel.leaf(key)] == [OURS, nl.RTPROT_BIRD]
        del m.p.netlink.dump_table
        assert m.p.counters.errors == 0
        n = len(m.kernel.requests)
        m.run(m.p.reconcile())  # nothing changed: nothing sent
        m.set_desired([blackhole])
        m.run(m.p.reconcile())
        assert m.kernel.requests[n:] == []
        m.kernel.others_delete(theirs)  # it goes: the next full resync puts ours in its place
        m.run(m.p.reconcile(full=True))
        assert [(e.protocol, e.type) for e in m.kernel.leaf(key)] == [(OURS, nl.RTN_BLACKHOLE)]
        assert m.p.conflicts == {} and m.p.failures == {}


def test_two_own_routes_at_one_ipv6_key_do_not_break_the_harness():
    # Someone (with our protocol, as others_add_rule draws) "replaces" our IPv6 gateway route
    # by a device route: Linux 4.1-4.18 add it beside, so one key holds a route with a gateway
    # and one without.  The harness sorted such entries with sorted(): None < bytes raised
    # TypeError before any property was checked (found by test_route_programmer_model_random).
    gateway = Route("2001:db8::/64", gateway="2001:db8:ff::2", dev="eth0")
    with scenario(own=[gateway]) as m:
        m.kernel.old_replace = True
        m.others_add(entry_of_route(Route("2001:db8::/64", dev="eth0"), table=nl.RT_TABLE_MAIN, protocol=OURS), True)
        assert [e.gateway is None for e in m.kernel.leaf(key_of(gateway, nl.RT_TABLE_MAIN))] == [False, True]
        m.sync(False)  # a)-d), with both routes in the dumps and views
        assert "via 2001:db8:ff::2" in m.dump_state()


def _gateway_and_device_route_of_ours(m: RouteModel, dst: str) -> Route:
    """Our IPv6 gateway route, and beside it at its key a device route of our protocol (what
    someone's ``ip -6 route replace DST dev eth0 proto 143`` leaves on Linux 4.1-4.18)."""
    gateway = Route(dst, gateway="2001:db8:ff::2", dev="eth0")
    m.kernel.old_replace = True
    m.upsert(gateway)
    m.sync(False)
    m.others_add(entry_of_route(Route(dst, dev="eth0"), table=nl.RT_TABLE_MAIN, protocol=OURS), True)
    assert [e.gateway is None for e in m.kernel.leaf(key_of(gateway, nl.RT_TABLE_MAIN))] == [False, True]
    return gateway


def test_bug7a_two_own_routes_at_one_ipv6_key_nobody_wants_both_go():
    # Filed under one dst, the device route took the gateway route's place in the state; its
    # delete, by key, took the first route of ours at the key: the gateway route.  The device
    # route stayed, at every resync (found by test_route_programmer_model_random).
    with scenario() as m:
        _gateway_and_device_route_of_ours(m, "::/0")
        m.set_desired([])
        m.kernel.overrun()
        m.sync(False)  # a) own routes nobody wants: the device route


def test_bug7b_a_replace_never_takes_another_daemons_gateway_route_beside_ours():
    # Another daemon replaced our gateway route (same next hop); our device route beside it
    # became our route for the dst, and the desired gateway route "replaced" it: an IPv6
    # replace by a gateway route takes the first gateway route at the key, theirs.
    with scenario() as m:
        gateway = _gateway_and_device_route_of_ours(m, "2001:db8::/64")
        theirs = entry_of_route(gateway, table=nl.RT_TABLE_MAIN, protocol=nl.RTPROT_BOOT)._replace(mtu=1300)
        m.others_add(theirs, True)
        m.sync(True)  # b) a sync changed routes that are not ours
        assert list(m.p.conflicts) == [gateway.dst] and theirs in m.kernel.entries()


def test_bug7c_stop_removing_routes_removes_both_own_routes_at_one_ipv6_key():
    with scenario() as m:
        _gateway_and_device_route_of_ours(m, "2001:db8::/64")
        m.restart(True, None)  # stop(remove_routes=True) left own routes


def test_bug7d_own_route_added_beside_ours_at_its_ipv6_key_goes():
    # The monitor's report of the device route made it our route for the dst; the desired
    # gateway route then "replaced" it, in fact itself: the device route stayed beside it.
    with scenario() as m:
        gateway = _gateway_and_device_route_of_ours(m, "2001:db8::/64")
        m.sync(False)  # a) desired route is not in the kernel (two of ours at its key)
        assert [e.gateway for e in m.own_entries()] == [pton(AF6, gateway.gateway)]


def _device_route_of_ours_beside_another_daemons_gateway_route(m: RouteModel, dst: str, gateway: str) -> tuple:
    """Our IPv6 device route, and beside it at its key BIRD's gateway route through
    ``gateway`` (what ``ip -6 route append DST via GW proto bird`` leaves: a route that is
    not ECMP-able and one that is are no siblings).  Returns (its key, the leaf)."""
    theirs = entry_of_route(Route(dst, gateway=gateway, dev="eth0"), table=nl.RT_TABLE_MAIN, protocol=nl.RTPROT_BIRD)
    key = theirs.key
    m.kernel.set_leaf(key, [*m.kernel.leaf(key), theirs])
    assert [(e.protocol, e.gateway is None) for e in m.kernel.leaf(key)] == [(OURS, True), (nl.RTPROT_BIRD, False)]
    return key, m.kernel.leaf(key)


@pytest.mark.parametrize("old_replace", [True, False], ids=["linux-4.1-4.18", "later"])
@pytest.mark.parametrize("gateway", ["2001:db8:ff::2", "2001:db8:ff::3"], ids=["their-next-hop", "another-next-hop"])
def test_bug8_a_gateway_route_never_goes_beside_another_daemons_gateway_route(old_replace, gateway):
    # Our device route becomes a gateway route: it is added beside ours (needs_beside).  At
    # the key is BIRD's gateway route.  (a) Through our next hop: the add met EEXIST, a
    # conflict, and was sent again at every idle sync (set_desired of the same set).  (b)
    # Through another one: the kernel makes the two one ECMP route, our next hop merged into
    # BIRD's (the stand-in asserted "siblings are not modelled").  Both are conflicts now, the
    # key left to BIRD (our device route stays), and retried on full resyncs and when the key
    # changes.  Found by test_route_programmer_model_random.
    # Then BIRD replaces its route: the monitor cannot say which route at the key went, the
    # add of ours met EEXIST, the table read found our device route, and the replace by our
    # gateway route took BIRD's (b); it goes beside ours, and is a conflict again.
    dst = "2001:db8::/64"
    want = Route(dst, gateway="2001:db8:ff::2", dev="eth0")
    with scenario(own=[Route(dst, dev="eth0")]) as m:
        m.kernel.old_replace = old_replace
        key, leaf = _device_route_of_ours_beside_another_daemons_gateway_route(m, dst, gateway)
        m.set_desired([want])
        m.sync(False)  # c) a second sync sent the add again; (b) the stand-in's assert
        assert list(m.p.conflicts) == [dst] and "proto bird" in m.p.conflicts[dst]
        assert m.p.failures == {} and m.p.counters.errors == 0
        reads = []
        read = m.p.netlink.dump_table

        async def counted(families):
            reads.append(families)
            return await read(families)

        m.p.netlink.dump_table = counted
        m.set_desired([want])
        m.run(m.p.reconcile())
        assert reads == [], "an idle sync re-tried the conflict (a table read)"
        del m.p.netlink.dump_table
        m.sync(True)
        assert m.kernel.leaf(key) == leaf and list(m.p.conflicts) == [dst]
        theirs = leaf[1]._replace(mtu=1300)
        m.others_add(theirs, True)
        m.sync(False)  # b) a sync changed routes that are not ours
        assert m.kernel.leaf(key) == [leaf[0], theirs] and list(m.p.conflicts) == [dst]
        m.kernel.others_delete(theirs)  # BIRD's route goes: ours takes the key at once
        m.sync(False)
        assert [e.gateway for e in m.kernel.leaf(key)] == [pton(AF6, want.gateway)] and m.p.conflicts == {}


def test_bug8c_a_route_never_goes_beside_another_daemons_route_without_a_gateway():
    # BIRD's `ip -6 route replace DST blackhole` on Linux 4.1-4.18 went beside our gateway
    # route.  Our desired route became a device route: added beside ours, after BIRD's in the
    # key's list, and our gateway route deleted.  Then it changed device: the replace by it
    # took the first route without a gateway at the key, BIRD's blackhole (b).  A route of
    # ours goes beside ours only where no other daemon's route is at the key: a conflict,
    # our gateway route stays.  (Found while fixing bug 8.)
    dst = "2001:db8::/64"
    gateway = Route(dst, gateway="2001:db8:ff::2", dev="eth0")
    theirs = entry_of_route(Route(dst, kind="blackhole"), table=nl.RT_TABLE_MAIN, protocol=nl.RTPROT_BIRD)
    with scenario(own=[gateway]) as m:
        m.kernel.old_replace = True
        m.upsert(gateway)
        m.sync(False)
        m.others_add(theirs, True)
        key = theirs.key
        leaf = m.kernel.leaf(key)
        assert [e.protocol for e in leaf] == [OURS, nl.RTPROT_BIRD]
        for dev in ("eth0", "eth1"):
            m.upsert(Route(dst, dev=dev))
            m.sync(False)  # b) a sync changed routes that are not ours
            assert m.kernel.leaf(key) == leaf and list(m.p.conflicts) == [dst]
        m.kernel.others_delete(theirs)
        m.sync(False)
        assert [e.oif for e in m.kernel.leaf(key)] == [IFINDEX["eth1"]] and m.p.conflicts == {}


def test_bug9_another_protocols_replace_at_another_tos_leaves_our_route_known():
    # Another protocol replaced its TOS route for our destination (another key): the monitor
    # took it for a replace of our route (dst and metric alike), and the programmer forgot
    # ours, which then stayed when nobody wanted it (found by test_route_programmer_model_random).
    theirs = entry_of_route(Route(X, kind="blackhole"), table=nl.RT_TABLE_MAIN, protocol=nl.RTPROT_BOOT, tos=0x10)
    with scenario() as m:
        m.set_desired([Route(X, dev="eth0")])
        m.sync(False)
        m.others_add(theirs, False)
        m.others_add(theirs._replace(mtu=1300), True)
        m.deliver_events()
        assert m.p.programmed() == [Route(X, dev="eth0")]
        m.set_desired([])
        m.sync(False)  # a) own routes nobody wants


def test_another_protocols_replace_of_a_source_specific_route_leaves_our_route_known():
    # As bug 9, for IPv6's other key: BIRD replaces its source-specific route (from
    # 2001:db8:ff::/48, rtm_src_len 48) to our destination at our metric.  Linux files it in
    # the destination's source subtree (CONFIG_IPV6_SUBTREES), another key than our route's
    # (source ::/0): ours is untouched, and the programmer must still know it, or a route
    # nobody wants any more stays.  (The stand-in has no source prefixes: the monitor is
    # told, as the kernel tells it.)
    ours = Route("2001:db8::/64", gateway="2001:db8:ff::2", dev="eth0")
    with scenario() as m:
        m.set_desired([ours])
        m.sync(False)
        template = nl.route_template(AF6, table=nl.RT_TABLE_MAIN, protocol=nl.RTPROT_BIRD,
                                     gateway=pton(AF6, "2001:db8:ff::3"), oif=IFINDEX["eth0"], priority=1024,
                                     src=pton(AF6, "2001:db8:ff::"))
        m.kernel.notify(nl.encode_route(nl.RTM_NEWROUTE, 0, nl.NLM_F_REPLACE, pton(AF6, "2001:db8::"), 64, template,
                                        src_len=48))
        m.deliver_events()
        assert m.p.programmed() == [ours]
        m.set_desired([])
        m.sync(False)  # a) own routes nobody wants
        assert m.own_entries() == []


# --- after lost monitor events ------------------------------------------------------------------


def test_overrun_re_reads_links_a_device_recreated_meanwhile(monkeypatch):
    # eth1 is deleted (its routes with it) and created again while the monitor's buffer
    # overflowed: it has a new ifindex, and no route of ours names the old one any more.
    # The full resync must re-read the links, or every add of the route fails ENODEV.
    want = Route(X, dev="eth1")
    with scenario() as m:
        m.set_desired([want])
        m.sync(False)
        for key, entry in list(m.kernel.routes.items()):
            if entry.oif == 3:
                del m.kernel.routes[key]
        monkeypatch.delitem(LINKS, 3)
        monkeypatch.setitem(LINKS, 4, "eth1")
        monkeypatch.setitem(IFINDEX, "eth1", 4)
        m.kernel.overrun()
        m.sync(False)  # a) the desired route is in the kernel
        assert m.kernel.routes[key_of(want, nl.RT_TABLE_MAIN)].oif == 4
        assert m.p.failures == {}


def _programmer_with_interrupted_link_dumps(interrupted: int):
    kernel = FakeKernel(strict_dumps=True)
    req = FakeRequestSocket(kernel)
    req.interrupted_link_dumps = interrupted
    return kernel, req, RouteProgrammer(sockets=lambda: (req, FakeMonitorSocket(kernel)))


@pytest.mark.parametrize("interrupted", [1, 2])
def test_an_interrupted_link_dump_is_read_again(interrupted):
    """NLM_F_DUMP_INTR on the link dump (a veth created meanwhile): the dump is read again, or
    the links it skipped stay unknown and a route through one fails ENODEV at every reconcile."""
    kernel, req, p = _programmer_with_interrupted_link_dumps(interrupted)
    want = Route("10.244.1.0/24", gateway="192.0.2.2", dev="eth1")

    async def main():
        await p.start()
        try:
            p.set_desired([want])
            result = await p.reconcile(full=True)
            assert (result.added, result.failed) == ((want.dst,), ())
            assert p.failures == {} and p.netlink.ifindex["eth1"] == 3
            assert req.link_dumps == interrupted + 1
        finally:
            await p.stop()
    asyncio.run(main())
    assert satisfies(kernel.routes[key_of(want, nl.RT_TABLE_MAIN)], want)


def test_links_interrupted_at_every_try_are_read_again_at_the_next_full_resync():
    kernel, req, p = _programmer_with_interrupted_link_dumps(3)
    want = Route("10.244.1.0/24", gateway="192.0.2.2", dev="eth1")

    async def main():
        await p.start()
        try:
            p.set_desired([want])
            result = await p.reconcile()
            assert result.added == () and [dst for dst, _ in result.failed] == [want.dst]
            assert req.link_dumps == 3
            result = await p.reconcile(full=True)
            assert (result.added, result.failed) == ((want.dst,), ())
            assert p.failures == {} and req.link_dumps == 4
            await p.reconcile(full=True)
            assert req.link_dumps == 4, "links read again though nothing said they may be stale"
        finally:
            await p.stop()
    asyncio.run(main())
    assert satisfies(kernel.routes[key_of(want, nl.RT_TABLE_MAIN)], want)


def test_a_route_through_a_device_we_do_not_know_re_reads_the_links_at_the_next_full_resync(monkeypatch):
    """The device exists but its link event never reached us (our table lacks it): the route
    fails ENODEV; the next full resync reads the links again and installs it."""
    monkeypatch.delitem(LINKS, 3)
    _kernel, _req, p = _programmer_with_interrupted_link_dumps(0)
    want = Route("10.244.1.0/24", gateway="192.0.2.2", dev="eth1")

    async def main():
        await p.start()
        try:
            p.set_desired([want])
            assert [dst for dst, _ in (await p.reconcile()).failed] == [want.dst]
            monkeypatch.setitem(LINKS, 3, "eth1")  # created; its event lost
            result = await p.reconcile(full=True)
            assert (result.added, result.failed) == ((want.dst,), ()) and p.failures == {}
        finally:
            await p.stop()
    asyncio.run(main())


def test_a_link_none_of_our_routes_uses_does_not_re_read_the_kernel():
    with scenario() as m:
        m.set_desired([Route(X, dev="eth0")])
        m.sync(False)
        m.kernel.notify(link_message(nl.RTM_DELLINK, 0, 0, 3, False))  # eth1: none of ours on it
        m.deliver_events()
        assert not m.run(m.p.reconcile()).full
        m.kernel.flap(2)  # eth0: ours flushed silently, put back after a re-read
        m.deliver_events()
        result = m.run(m.p.reconcile())
        assert result.full and result.added == (X,)


@pytest.mark.parametrize("family, dst, gateway", [(AF4, "10.244.1.0/24", "192.0.2.2"),
                                                  (AF6, "2001:db8:1::/64", "2001:db8:ff::2")])
def test_an_own_route_the_model_cannot_say_holding_the_desired_key_is_replaced(family, dst, gateway):
    """An own-protocol route the Route model cannot represent (a stand-in for multipath, a
    nexthop object, RTA_VIA: no gateway, no device) holds the key of a desired route: it is
    replaced in place.  It used to meet the add with EEXIST, then be deleted as a stray, and the
    table read found nothing: the destination stayed without a route until the next resync."""
    addr, _, plen = dst.partition("/")
    odd = Entry(family, nl.RT_TABLE_MAIN, socket.inet_pton(family, addr), int(plen), 0,
                kernel_priority(family, None), OURS, 0, nl.RTN_UNICAST, 0, None, 0, None, None)
    with scenario(others=[odd]) as m:
        assert m.p.state.kernel == {} and len(m.p.state.strays) == 1
        want = Route(dst, gateway=gateway, dev="eth0")
        m.set_desired([want])
        result = m.run(m.p.reconcile())
        assert (result.replaced, result.failed, result.conflicts) == ((dst,), (), ())
        [entry] = m.kernel.routes.values()
        assert satisfies(entry, want) and entry.protocol == OURS
        assert m.p.state.strays == set() and m.p.programmed() == [want]
        assert m.run(m.p.reconcile(full=True)).failed == ()  # a re-read finds the desired route, nothing else
        assert list(m.kernel.routes.values()) == [entry]


def test_an_address_none_of_our_routes_uses_going_away_does_not_re_read_the_kernel():
    """A pod's host-side veth going away: the kernel says its fe80:: address went (and an IPv4
    address on a device none of our routes uses).  IPv6 flushes no route with its addresses,
    IPv4 only routes with that source address or on that device: only those re-read the
    kernel (each pod deletion used to re-read every own route)."""
    from agentd.kernel import netlink_links as links

    def gone(index, family, address):
        m.kernel.notify(links.encode_addr(nl.RTM_DELADDR, 0, index, socket.inet_pton(family, address), 64))
        m.deliver_events()
        return m.run(m.p.reconcile()).full

    with scenario() as m:
        m.set_desired([Route(X, dev="eth0"), Route("10.0.9.0/24", gateway="192.0.2.2", dev="eth1", src="192.0.2.1"),
                       Route("2001:db8::/64", dev="eth0", src="2001:db8:ff::1")])
        m.sync(False)
        assert not gone(99, AF6, "fe80::1")  # a veth's link-local address
        assert not gone(2, AF6, "2001:db8:ff::7")  # an IPv6 address on eth0, which ours use
        assert not gone(99, AF4, "198.51.100.1")  # an IPv4 address on a device of none of ours
        assert gone(2, AF4, "198.51.100.2")  # on eth0: its last address may have taken our route
        assert gone(99, AF4, "192.0.2.1")  # the source address of one of ours
        assert gone(99, AF6, "2001:db8:ff::1")  # the same for IPv6 (the kernel drops it from our route)


def test_routes_of_an_earlier_route_protocol_in_the_pod_network_are_removed(tmp_path):
    """[network] route_protocol changed (143 -> 150) across a graceful restart: the new agent
    removes the old protocol's routes inside the pod network, so its own adds meet no EEXIST
    (each was a permanent conflict, and the old routes kept forwarding).  Another protocol's
    routes, and the old protocol's outside the pod network, are left alone."""
    from ipaddress import ip_network

    from agentd.daemon.routes import drop_previous_protocol
    from agentd.kernel.routing import remove_routes_of

    kernel = FakeKernel(strict_dumps=True)
    old = [Route("10.244.1.0/24", gateway="192.0.2.2", dev="eth0"), Route("10.244.0.0/24", kind="blackhole", metric=4000),
           Route("fd00:10:244:1::/64", gateway="2001:db8:ff::2", dev="eth0"), Route("0.0.0.0/0", gateway="192.0.2.9")]
    kept = [entry_of_route(old[3], table=nl.RT_TABLE_MAIN, protocol=OURS),
            entry_of_route(Route("10.244.7.0/24", dev="eth1"), table=nl.RT_TABLE_MAIN, protocol=nl.RTPROT_BIRD)]
    for entry in [entry_of_route(r, table=nl.RT_TABLE_MAIN, protocol=OURS) for r in old[:3]] + kept:
        kernel.routes[entry.key] = entry
    (tmp_path / "route-protocol").write_text("143\n")
    pools = [ip_network("10.244.0.0/16"), ip_network("fd00:10:244::/48")]

    def sockets():
        return FakeRequestSocket(kernel), FakeMonitorSocket(kernel)

    async def main():
        await drop_previous_protocol(tmp_path, 150, pools, remove=lambda p, n: remove_routes_of(p, n, sockets=sockets))
        assert sorted(kernel.routes.values(), key=entry_order) == sorted(kept, key=entry_order)
        assert (tmp_path / "route-protocol").read_text() == "150\n"
        new = StandInProgrammer(kernel, protocol=150)
        await new.start()
        for task in new._tasks:
            task.cancel()
        new.set_desired([Route("10.244.1.0/24", gateway="192.0.2.3", dev="eth0")])
        result = await new.reconcile()
        assert (result.added, result.conflicts, result.failed) == (("10.244.1.0/24",), (), ())
        await new.stop()

    asyncio.run(main())


def test_the_route_protocol_is_remembered_and_an_old_one_looked_for_only_when_it_changed(tmp_path, caplog):
    from ipaddress import ip_network

    from agentd.daemon.routes import drop_previous_protocol

    calls = []
    failed: list[str] = []

    async def remove(protocol, networks):
        calls.append((protocol, networks))
        return ["10.244.1.0/24"], list(failed)

    pools = [ip_network("10.244.0.0/16")]
    path = tmp_path / "state" / "route-protocol"
    asyncio.run(drop_previous_protocol(tmp_path / "state", 143, pools, remove))  # first run: nothing to look for
    assert calls == [] and path.read_text() == "143\n"
    asyncio.run(drop_previous_protocol(tmp_path / "state", 143, pools, remove))  # unchanged
    assert calls == []
    failed.append("10.244.2.0/24: EPERM")
    asyncio.run(drop_previous_protocol(tmp_path / "state", 150, pools, remove))  # changed, one delete failed
    assert calls == [(143, pools)] and path.read_text() == "143\n"  # the next start tries again
    failed.clear()
    asyncio.run(drop_previous_protocol(tmp_path / "state", 150, pools, remove))
    assert calls[1:] == [(143, pools)] and path.read_text() == "150\n"
    assert "route_protocol changed from 143 to 150: removed 1 proto 143 routes" in caplog.text
    path.write_text("bogus")
    asyncio.run(drop_previous_protocol(tmp_path / "state", 150, pools, remove))
    assert len(calls) == 2 and path.read_text() == "150\n" and "not a route protocol" in caplog.text
    # Digits int() refuses ("²", over 4300 of them: the agent did not start) or reads ("١٤٣" as 143).
    for junk in ("\u00b2", "\u0661\u0664\u0663", "1" * 5000):
        path.write_text(junk)
        asyncio.run(drop_previous_protocol(tmp_path / "state", 150, pools, remove))
        assert len(calls) == 2 and path.read_text() == "150\n"


def test_the_route_protocol_file_is_replaced_whole_never_rewritten_in_place(tmp_path):
    """It was truncated and rewritten in place: a crash or a power cut between the two left an
    empty file, and the next start no longer knew which protocol's routes were its own.  Now
    a new file is written and renamed over the old (the old inode stays whole for a reader)."""
    from ipaddress import ip_network

    from agentd.daemon.routes import drop_previous_protocol

    async def remove(protocol, networks):
        return [], []

    path = tmp_path / "route-protocol"
    path.write_text("143\n")
    old = path.stat().st_ino
    with open(path) as reader:  # a reader that opened the old file keeps its whole content
        asyncio.run(drop_previous_protocol(tmp_path, 150, [ip_network("10.244.0.0/16")], remove))
        assert reader.read() == "143\n"
    assert path.read_text() == "150\n" and path.stat().st_ino != old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["route-protocol"]  # no temporary file left


def test_without_the_protocol_file_the_default_protocols_routes_in_the_pod_network_go(tmp_path, caplog):
    """No state_dir/route-protocol (an upgrade from an agentd that did not write it, a state
    directory removed) and route_protocol set to other than the default: the default's routes
    inside the pod networks are a previous run's and go (they stayed for ever); the default's
    elsewhere and other protocols' stay.  With the default configured, nothing is looked for."""
    from ipaddress import ip_network

    from agentd.daemon.routes import drop_previous_protocol
    from agentd.kernel.routing import remove_routes_of

    kernel = FakeKernel(strict_dumps=True)
    gone = [Route("10.244.1.0/24", gateway="192.0.2.2", dev="eth0"), Route("10.244.0.0/24", kind="blackhole", metric=4000)]
    kept = [entry_of_route(Route("0.0.0.0/0", gateway="192.0.2.9"), table=nl.RT_TABLE_MAIN, protocol=OURS),
            entry_of_route(Route("10.244.7.0/24", dev="eth1"), table=nl.RT_TABLE_MAIN, protocol=nl.RTPROT_BIRD)]
    for entry in [entry_of_route(r, table=nl.RT_TABLE_MAIN, protocol=OURS) for r in gone] + kept:
        kernel.routes[entry.key] = entry
    pools = [ip_network("10.244.0.0/16")]
    path = tmp_path / "route-protocol"

    def remove(p, n):
        return remove_routes_of(p, n, sockets=lambda: (FakeRequestSocket(kernel), FakeMonitorSocket(kernel)))

    asyncio.run(drop_previous_protocol(tmp_path, OURS, pools, remove))  # the default: the routes are its own
    assert len(kernel.routes) == 4 and path.read_text() == f"{OURS}\n"
    path.unlink()
    asyncio.run(drop_previous_protocol(tmp_path, 150, pools, remove))
    assert sorted(kernel.routes.values(), key=entry_order) == sorted(kept, key=entry_order) and path.read_text() == "150\n"
    assert f"route_protocol changed from {OURS} to 150: removed 2 proto {OURS} routes" in caplog.text


def test_a_failure_to_look_for_the_old_protocols_routes_does_not_stop_the_start(tmp_path, caplog):
    """remove_routes_of failing as a whole (the netlink socket, a dump it cannot decode) is
    logged; the file keeps the old protocol, so the next start tries again."""
    from ipaddress import ip_network

    from agentd.daemon.routes import drop_previous_protocol
    from agentd.kernel.netlink import NetlinkDecodeError, NetlinkError

    pools = [ip_network("10.244.0.0/16")]
    path = tmp_path / "route-protocol"
    path.write_text("143\n")
    for err in (OSError(24, "Too many open files"), NetlinkError(1, None, "dumping routes"), NetlinkDecodeError("truncated attribute")):
        async def remove(protocol, networks, err=err):
            raise err

        asyncio.run(drop_previous_protocol(tmp_path, 150, pools, remove))
        assert path.read_text() == "143\n" and "could not be looked for" in caplog.text

