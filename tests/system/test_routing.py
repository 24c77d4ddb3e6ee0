"""The route programmer against a real kernel, in lab namespaces.

Each test builds a router namespace ``r`` whose ``v0`` (192.0.2.1/24, 2001:db8::1/64) faces a
peer namespace ``p`` (``v1``: 192.0.2.2, 2001:db8::2), so gateway routes have a real
neighbour.  Every kernel check reads ``ip`` output, not the programmer's own view.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time

import pytest

from agentd.lab import netns
from agentd.lab.wait import DEFAULT_TIMEOUT, auntil, until
from agentd.kernel.route_model import RTPROT_AGENTD, Route, SyncResult
from agentd.kernel.routing import RouteProgrammer

GW4, GW6 = "192.0.2.2", "2001:db8::2"


class Lab:
    def __init__(self, router: netns.Netns, peer: netns.Netns) -> None:
        self.r, self.p = router, peer

    async def ip(self, *args: str, check: bool = True) -> str:
        """``ip -n r ARGS`` without blocking the loop (the programmer's monitor runs in it)."""
        _rc, out, _err = await netns.arun(["ip", "-n", self.r.name, *args], check=check)
        return out.decode()

    async def own(self, family: str = "-4", table: str = "main") -> list[str]:
        out = await self.ip(family, "route", "show", "table", table, "proto", str(RTPROT_AGENTD))
        return sorted(line.strip() for line in out.splitlines() if line.strip())

    async def count_own(self) -> int:
        return len(await self.own("-4")) + len(await self.own("-6"))

    async def table_all(self) -> list[str]:
        """``ip -d route show table all`` for both families, ours (main table, proto 143) left out."""
        lines = []
        for family in ("-4", "-6"):
            out = await self.ip("-d", family, "route", "show", "table", "all")
            lines += [line.rstrip() for line in out.splitlines()
                      if f" table main proto {RTPROT_AGENTD} " not in line + " "]
        return lines


@pytest.fixture
def lab(netns_factory) -> Lab:
    router, peer = netns_factory("r"), netns_factory("p")
    netns.veth(router, "v0", peer, "v1")
    router.ip("addr", "add", "192.0.2.1/24", "dev", "v0")
    router.ip("-6", "addr", "add", "2001:db8::1/64", "dev", "v0", "nodad")
    peer.ip("addr", "add", "192.0.2.2/24", "dev", "v1")
    peer.ip("-6", "addr", "add", "2001:db8::2/64", "dev", "v1", "nodad")
    # The kernel adds v0's IPv6 link-local address (and its local route) by itself, after
    # duplicate address detection: wait for it, so that tests comparing route tables before
    # and after start from a settled table.
    until(lambda: "local fe80::" in router.ip("-6", "route", "show", "table", "local", "dev", "v0").stdout.decode(),
          what="v0's link-local route")
    return Lab(router, peer)


@pytest.fixture
async def start(lab):
    """``await start(**kwargs)`` -> a started RouteProgrammer in the lab's router namespace."""
    started: list[RouteProgrammer] = []

    async def make(**kwargs) -> RouteProgrammer:
        programmer = RouteProgrammer(netns=lab.r.name, **kwargs)
        await programmer.start()
        started.append(programmer)
        return programmer

    try:
        yield make
    finally:
        for programmer in started:
            await programmer.stop()


async def eventually(check, timeout: float = DEFAULT_TIMEOUT, what: str = "condition"):
    """Until the async ``check()`` holds (the programmer's tasks run meanwhile)."""
    return await auntil(check, timeout, what=what, interval=0.02)


class RouteMonitor:
    """``ip monitor route`` in the router namespace.  ``await mark()`` returns every event
    since the last mark: it adds a throw-away sentinel route and reads up to its event."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.marks = 0

    async def __aenter__(self) -> RouteMonitor:
        self.proc = await asyncio.create_subprocess_exec(
            "ip", "-n", self.lab.r.name, "monitor", "route", stdout=asyncio.subprocess.PIPE)
        await self.mark()
        return self

    async def __aexit__(self, *exc) -> None:
        self.proc.kill()
        await self.proc.wait()

    async def mark(self) -> list[str]:
        self.marks += 1
        sentinel = f"198.18.{self.marks}.0/24"
        lines: list[str] = []
        for _attempt in range(50):  # until the monitor is subscribed and has caught up
            await self.lab.ip("route", "add", sentinel, "via", GW4, "proto", "static")
            try:
                while True:
                    line = (await asyncio.wait_for(self.proc.stdout.readline(), 0.2)).decode()
                    if line.startswith(sentinel):
                        await self.lab.ip("route", "del", sentinel, "proto", "static")
                        return [x for x in lines if "198.18." not in x]
                    lines.append(line.strip())
            except asyncio.TimeoutError:
                await self.lab.ip("route", "del", sentinel, "proto", "static")
        raise AssertionError("ip monitor never reported the sentinel route")


# --- install, update, remove --------------------------------------------------------------------

ROUTES = [
    Route("10.10.0.0/24", gateway=GW4),
    Route("10.11.0.0/24", dev="v0"),
    Route("10.12.0.0/24", gateway="198.51.100.1", dev="v0", onlink=True),
    Route("10.13.0.0/24", kind="blackhole"),
    Route("10.14.0.0/24", kind="unreachable"),
    Route("10.15.0.0/24", gateway=GW4, metric=50, mtu=1400, src="192.0.2.1"),
    Route("2001:db8:10::/64", gateway=GW6),
    Route("2001:db8:11::/64", gateway="fe80::2", dev="v0"),
    Route("2001:db8:12::/64", kind="blackhole"),
    Route("2001:db8:13::/64", dev="v0", metric=20),
]


async def test_install_update_remove_ipv4_and_ipv6(lab, start):
    programmer = await start()
    programmer.set_desired(ROUTES)
    result = await programmer.reconcile()
    assert sorted(result.added) == sorted(r.dst for r in ROUTES) and result.ok
    assert await lab.own("-4") == sorted([
        "10.10.0.0/24 via 192.0.2.2 dev v0",
        "10.11.0.0/24 dev v0 scope link",
        "10.12.0.0/24 via 198.51.100.1 dev v0 onlink",
        "blackhole 10.13.0.0/24",
        "unreachable 10.14.0.0/24",
        "10.15.0.0/24 via 192.0.2.2 dev v0 src 192.0.2.1 metric 50 mtu 1400",
    ])
    assert await lab.own("-6") == sorted([
        "2001:db8:10::/64 via 2001:db8::2 dev v0 metric 1024 pref medium",
        "2001:db8:11::/64 via fe80::2 dev v0 metric 1024 pref medium",
        "blackhole 2001:db8:12::/64 dev lo metric 1024 pref medium",
        "2001:db8:13::/64 dev v0 metric 20 pref medium",
    ])
    assert {r.dst for r in programmer.programmed()} == {r.dst for r in ROUTES}
    assert programmer.desired() == ROUTES

    # A full re-read finds everything as wanted (a dev-less gateway route accepts the kernel's dev).
    assert await programmer.reconcile(full=True) == SyncResult(seconds=programmer.last_sync_seconds, full=True)

    # Update: new next hop (same key -> replace), new metric (new key -> add + delete), new kind.
    updated = [r for r in ROUTES if r.dst not in ("10.10.0.0/24", "10.15.0.0/24", "2001:db8:10::/64")] + [
        Route("10.10.0.0/24", gateway="198.51.100.9", dev="v0", onlink=True),
        Route("10.15.0.0/24", gateway=GW4, metric=60),
        Route("2001:db8:10::/64", kind="unreachable"),
    ]
    programmer.set_desired(updated)
    result = await programmer.reconcile()
    assert sorted(result.replaced) == ["10.10.0.0/24", "2001:db8:10::/64"]
    assert result.added == ("10.15.0.0/24",) and result.removed == ("10.15.0.0/24",)
    own4 = await lab.own("-4")
    assert "10.10.0.0/24 via 198.51.100.9 dev v0 onlink" in own4
    assert "10.15.0.0/24 via 192.0.2.2 dev v0 metric 60" in own4
    assert not any("metric 50" in line for line in own4)
    assert "unreachable 2001:db8:10::/64 dev lo metric 1024 pref medium" in await lab.own("-6")

    # Remove some, then all.
    programmer.set_desired(updated[:3])
    result = await programmer.reconcile()
    assert len(result.removed) == len(updated) - 3
    assert await lab.count_own() == 3
    programmer.set_desired([])
    await programmer.reconcile()
    assert await lab.count_own() == 0 and programmer.programmed() == []


async def test_upsert_and_discard_are_applied_by_the_reconcile_task(lab, start):
    programmer = await start()
    programmer.set_desired([])
    syncs: list[SyncResult] = []
    programmer.on_sync = syncs.append
    before = programmer.counters.reconciles
    for i in range(200):  # a burst: coalesced into few batched reconciles, not 200
        programmer.upsert(Route(f"10.20.{i}.0/24", gateway=GW4))
    await eventually(lambda: _count_is(lab, 200), what="200 upserted routes in the kernel")
    assert programmer.counters.reconciles - before <= 3
    assert sum(len(s.added) for s in syncs) == 200
    assert programmer.last_sync is not None and programmer.last_sync <= time.time()

    programmer.discard("10.20.7.0/24")
    programmer.upsert(Route("10.20.8.0/24", kind="blackhole"))
    await eventually(lambda: _count_is(lab, 199), what="discarded route gone")
    own = await lab.own("-4")
    assert "blackhole 10.20.8.0/24" in own and not any(line.startswith("10.20.7.0/24") for line in own)


async def _more_than(value: int, than: int) -> bool:
    return value > than


async def _count_is(lab: Lab, n: int) -> bool:
    return await lab.count_own() == n


# --- adoption ------------------------------------------------------------------------------------


async def test_start_adopts_own_routes_without_flushing(lab, start):
    lab.r.ip("route", "add", "10.30.1.0/24", "via", GW4, "proto", str(RTPROT_AGENTD))  # desired, exact
    lab.r.ip("route", "add", "10.30.2.0/24", "via", GW4, "proto", str(RTPROT_AGENTD))  # desired, changed
    lab.r.ip("route", "add", "10.30.3.0/24", "via", GW4, "proto", str(RTPROT_AGENTD))  # stale
    lab.r.ip("-6", "route", "add", "2001:db8:30::/64", "via", GW6, "proto", str(RTPROT_AGENTD))  # desired, exact
    lab.r.ip("-6", "route", "add", "2001:db8:31::/64", "via", GW6, "proto", str(RTPROT_AGENTD))  # stale
    async with RouteMonitor(lab) as monitor:
        programmer = await start()
        assert {r.dst for r in programmer.programmed()} == {
            "10.30.1.0/24", "10.30.2.0/24", "10.30.3.0/24", "2001:db8:30::/64", "2001:db8:31::/64"}
        # Until the complete desired set is known, nothing is removed (a restart keeps forwarding).
        await programmer.reconcile(full=True)
        assert await lab.count_own() == 5
        programmer.set_desired([
            Route("10.30.1.0/24", gateway=GW4),
            Route("10.30.2.0/24", kind="blackhole"),
            Route("2001:db8:30::/64", gateway=GW6),
        ])
        result = await programmer.reconcile()
        events = await monitor.mark()
    assert result.added == () and result.replaced == ("10.30.2.0/24",)
    assert sorted(result.removed) == ["10.30.3.0/24", "2001:db8:31::/64"]
    # The routes that were already right were never deleted, re-added or replaced.
    assert not [e for e in events if "10.30.1.0" in e or "2001:db8:30::" in e], events
    assert [e for e in events if e.startswith("Deleted 10.30.3.0/24")]
    assert [e for e in events if e.startswith("Deleted 2001:db8:31::/64")]
    assert await lab.own("-4") == ["10.30.1.0/24 via 192.0.2.2 dev v0", "blackhole 10.30.2.0/24"]
    assert await lab.own("-6") == ["2001:db8:30::/64 via 2001:db8::2 dev v0 metric 1024 pref medium"]


async def test_restart_adopts_everything_and_touches_nothing(lab, start):
    first = await start()
    routes = [Route(f"10.31.{i}.0/24", gateway=GW4) for i in range(50)] + ROUTES
    first.set_desired(routes)
    assert (await first.reconcile()).ok
    await first.stop()  # the agent goes away; its routes stay
    before = await lab.table_all() + await lab.own("-4") + await lab.own("-6")
    async with RouteMonitor(lab) as monitor:
        second = await start()
        second.set_desired(routes)
        result = await second.reconcile()
        await second.reconcile(full=True)
        events = await monitor.mark()
    assert (result.added, result.replaced, result.removed) == ((), (), ())
    assert events == []
    assert await lab.table_all() + await lab.own("-4") + await lab.own("-6") == before


# --- other people's routes ------------------------------------------------------------------------

FOREIGN = [
    ("-4", "10.40.0.0/24", "via", GW4, "proto", "boot"),
    ("-4", "10.41.0.0/24", "via", GW4, "proto", "static"),
    ("-4", "10.42.0.0/24", "dev", "v0", "proto", "kernel", "scope", "link"),
    ("-4", "10.43.0.0/24", "via", GW4, "proto", "bird"),
    ("-4", "10.44.0.0/24", "via", GW4, "proto", "zebra"),
    ("-4", "10.45.0.0/24", "via", GW4, "proto", "static", "metric", "100"),  # our dst, other metric
    ("-4", "10.46.0.0/24", "via", GW4, "proto", "static"),  # our dst, same key: a conflict
    ("-4", "10.47.0.0/24", "via", GW4, "table", "100", "proto", str(RTPROT_AGENTD)),  # our proto, other table
    ("-4", "10.46.0.0/24", "via", GW4, "table", "100", "proto", str(RTPROT_AGENTD)),
    ("-4", "10.48.0.0/24", "via", GW4, "table", "100", "proto", "static"),
    ("-6", "2001:db8:40::/64", "via", GW6, "proto", "static"),
    ("-6", "2001:db8:41::/64", "via", GW6, "proto", "bird"),  # our dst, same key: a conflict
    ("-6", "2001:db8:42::/64", "via", GW6, "table", "100", "proto", str(RTPROT_AGENTD)),
]


async def test_foreign_routes_stay_byte_for_byte_unchanged(lab, start):
    """Foreign routes: boot/static/kernel/bird/zebra routes, routes in another table (one with
    our protocol), and foreign routes for our own destinations survive many sync cycles."""
    for family, *spec in FOREIGN:
        lab.r.ip(family, "route", "add", *spec)
    before = await lab.table_all()
    assert len([line for line in before if " proto " in line]) >= len(FOREIGN)

    base = [Route(f"10.49.{i}.0/24", gateway=GW4) for i in range(20)]
    contested = [
        Route("10.45.0.0/24", gateway=GW4),  # coexists with the metric-100 static route
        Route("10.46.0.0/24", gateway="192.0.2.3"),  # held by a static route: conflict
        Route("10.47.0.0/24", gateway=GW4),  # exists in table 100 only
        Route("10.40.0.0/25", kind="blackhole"),  # more specific than a boot route
        Route("2001:db8:41::/64", gateway=GW6),  # held by a bird route: conflict
        Route("2001:db8:42::/64", kind="blackhole"),
    ]
    programmer = await start(resync_interval=0.05)
    programmer.set_desired(base + contested)
    first = await programmer.reconcile()
    assert dict(first.conflicts).keys() == {"10.46.0.0/24", "2001:db8:41::/64"}
    assert "proto static" in programmer.conflicts["10.46.0.0/24"]
    assert "proto bird" in programmer.conflicts["2001:db8:41::/64"]
    assert not first.failed

    for cycle in range(12):
        variant = base[cycle:] + contested[: 2 + cycle % 5]
        if cycle % 3 == 1:
            variant = [Route(r.dst, gateway=r.gateway, metric=cycle) if r.gateway == GW4 else r for r in variant]
        programmer.set_desired(variant)
        result = await programmer.reconcile(full=cycle % 2 == 0)
        assert not result.failed, result.failed
        resyncs = programmer.counters.full_resyncs
        await eventually(lambda: _more_than(programmer.counters.full_resyncs, resyncs), what="a periodic full resync")
    assert programmer.counters.full_resyncs >= 6 + 12  # 6 asked for + at least one periodic one per cycle
    own4 = await lab.own("-4")
    assert not any(line.startswith("10.46.0.0/24") for line in own4)  # never took the contested key
    programmer.set_desired([])
    await programmer.reconcile(full=True)
    await programmer.stop(remove_routes=True)
    assert await lab.count_own() == 0
    assert await lab.table_all() == before


async def test_foreign_replace_of_our_route_becomes_a_conflict(lab, start):
    programmer = await start()
    programmer.set_desired([Route("10.50.0.0/24", gateway=GW4), Route("10.50.1.0/24", gateway=GW4)])
    await programmer.reconcile()
    await lab.ip("route", "replace", "10.50.0.0/24", "via", GW4, "proto", "static")
    await eventually(lambda: _has_conflict(programmer, "10.50.0.0/24"), what="conflict reported")
    out = await lab.ip("-d", "route", "show", "10.50.0.0/24")
    assert "proto static" in out and f"proto {RTPROT_AGENTD}" not in out
    # Once the other route goes away, ours comes back (the monitor sees its removal).
    await lab.ip("route", "del", "10.50.0.0/24", "proto", "static")
    await eventually(lambda: _shows(lab, "10.50.0.0/24 via 192.0.2.2 dev v0"), what="own route back")
    assert "10.50.0.0/24" not in programmer.conflicts


async def test_add_meeting_an_unknown_own_route_replaces_it(lab, start):
    programmer = await start()
    programmer.set_desired([])
    await programmer.reconcile()
    # Blocking call on purpose: the monitor cannot tell the programmer before it tries the add.
    lab.r.ip("route", "add", "10.53.0.0/24", "via", GW4, "proto", str(RTPROT_AGENTD))
    lab.r.ip("route", "add", "10.54.0.0/24", "via", GW4, "proto", "static")
    programmer.set_desired([Route("10.53.0.0/24", kind="blackhole"), Route("10.54.0.0/24", kind="blackhole")])
    result = await programmer.reconcile()
    assert result.replaced == ("10.53.0.0/24",) and result.added == ()
    assert [dst for dst, _ in result.conflicts] == ["10.54.0.0/24"]
    assert await lab.own("-4") == ["blackhole 10.53.0.0/24"]
    assert "10.54.0.0/24 via 192.0.2.2 dev v0 proto static" in await lab.ip("route", "show")


async def _has_conflict(programmer: RouteProgrammer, dst: str) -> bool:
    return dst in programmer.conflicts


async def _shows(lab: Lab, line: str) -> bool:
    return line in await lab.own("-4")


async def _shows_in(lab: Lab, family: str, line: str) -> bool:
    return line in await lab.own(family)


async def test_programmer_in_another_table_leaves_main_alone(lab, start):
    lab.r.ip("route", "add", "10.51.0.0/24", "via", GW4, "proto", str(RTPROT_AGENTD))  # main: not ours here
    programmer = await start(table=100)
    programmer.set_desired([Route("10.51.0.0/24", kind="blackhole"), Route("10.52.0.0/24", gateway=GW4)])
    result = await programmer.reconcile(full=True)
    assert sorted(result.added) == ["10.51.0.0/24", "10.52.0.0/24"] and result.ok
    assert await lab.own("-4", table="100") == ["10.52.0.0/24 via 192.0.2.2 dev v0", "blackhole 10.51.0.0/24"]
    assert await lab.own("-4") == ["10.51.0.0/24 via 192.0.2.2 dev v0"]
    await programmer.stop(remove_routes=True)
    assert await lab.own("-4", table="100") == []
    assert await lab.own("-4") == ["10.51.0.0/24 via 192.0.2.2 dev v0"]


# --- the monitor -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dst, shown", [
    ("10.60.0.0/24", "10.60.0.0/24 via 192.0.2.2 dev v0"),
    ("2001:db8:60::/64", "2001:db8:60::/64 via 2001:db8::2 dev v0 metric 1024 pref medium"),
])
async def test_route_deleted_by_hand_is_put_back_by_the_monitor(lab, start, dst, shown):
    # "Back within 1 second" is a speed: bench/route_programming.py measures the delay
    # (restore row).  Here: the monitor puts it back (routes_restored counts exactly that),
    # well before the periodic full resync (30 s) could have.
    programmer = await start()
    gateway = GW6 if ":" in dst else GW4
    programmer.set_desired([Route(dst, gateway=gateway), Route("10.61.0.0/24", gateway=GW4)])
    await programmer.reconcile()
    family = "-6" if ":" in dst else "-4"
    for _round in range(3):
        await lab.ip(family, "route", "del", dst, "proto", str(RTPROT_AGENTD))
        await eventually(lambda: _shows_in(lab, family, shown), 10, what=f"{dst} put back")
    assert programmer.counters.routes_restored == 3


async def test_own_protocol_route_nobody_wants_is_removed(lab, start):
    programmer = await start()
    programmer.set_desired([Route("10.62.0.0/24", gateway=GW4)])
    await programmer.reconcile()
    await lab.ip("route", "add", "10.63.0.0/24", "via", GW4, "proto", str(RTPROT_AGENTD))
    await lab.ip("route", "add", "10.62.0.0/24", "via", GW4, "proto", str(RTPROT_AGENTD), "metric", "7")
    await lab.ip("route", "replace", "10.62.0.0/24", "via", "192.0.2.9", "proto", str(RTPROT_AGENTD))
    await eventually(lambda: _own_is(lab, ["10.62.0.0/24 via 192.0.2.2 dev v0"]), what="strays removed")
    assert programmer.counters.routes_removed >= 2 and programmer.counters.routes_replaced >= 1


async def _own_is(lab: Lab, lines: list[str], family: str = "-4") -> bool:
    return await lab.own(family) == lines


async def test_own_source_specific_route_goes_without_taking_the_desired_one(lab, start):
    # An IPv6 route of ours with a source prefix is a stray beside our route for its
    # destination: deleted by its source prefix too, or the kernel deletes the desired route
    # (no source prefix) instead, every reconcile.
    programmer = await start()
    programmer.set_desired([Route("2001:db8:50::/64", gateway=GW6)])
    await programmer.reconcile()
    await lab.ip("-6", "route", "add", "2001:db8:50::/64", "from", "2001:db8:1::/56", "via", GW6,
                 "proto", str(RTPROT_AGENTD))
    want = ["2001:db8:50::/64 via 2001:db8::2 dev v0 metric 1024 pref medium"]
    await eventually(lambda: _own_is(lab, want, "-6"), 10, what="the source-specific stray removed")
    result = await programmer.reconcile(full=True)
    assert (result.added, result.removed, result.failed) == ((), (), ())
    assert await lab.own("-6") == want


async def test_route_on_a_missing_device_is_installed_when_it_appears(lab, start):
    programmer = await start()
    programmer.set_desired([Route("10.64.0.0/24", dev="v9"), Route("10.65.0.0/24", gateway=GW4)])
    result = await programmer.reconcile()
    assert result.added == ("10.65.0.0/24",)
    assert [dst for dst, _ in result.failed] == ["10.64.0.0/24"]
    assert "no device 'v9'" in dict(result.failed)["10.64.0.0/24"]
    netns.veth(lab.r, "v9", lab.p, "v8")  # blocking is fine: events queue up in the socket
    await eventually(lambda: _shows(lab, "10.64.0.0/24 dev v9 scope link"), what="route on the new device")
    assert "10.64.0.0/24" not in programmer.failures


# --- scale and failures ---------------------------------------------------------------------------------


async def test_20000_routes_install_and_remove_exactly(lab, start):
    v4 = [Route(f"10.{64 + i // 65536}.{i // 256 % 256}.{i % 256}/32", gateway=GW4) for i in range(16000)]
    v6 = [Route(f"2001:db8:70::{i:x}/128", gateway=GW6) for i in range(4000)]
    programmer = await start()
    programmer.set_desired(v4 + v6)
    result = await programmer.reconcile()
    assert len(result.added) == 20000 and result.ok
    assert len(await lab.own("-4")) == 16000 and len(await lab.own("-6")) == 4000
    again = await programmer.reconcile(full=True)
    assert (again.added, again.replaced, again.removed) == ((), (), ())
    assert len(programmer.programmed()) == 20000
    programmer.set_desired(v4[::2])
    result = await programmer.reconcile()
    assert len(result.removed) == 12000
    assert len(await lab.own("-4")) == 8000 and len(await lab.own("-6")) == 0
    programmer.set_desired([])
    await programmer.reconcile()
    assert await lab.count_own() == 0


async def test_unreachable_gateway_fails_alone(lab, start):
    routes = [Route(f"10.66.{i // 4}.{i % 4 * 64}/26", gateway=GW4) for i in range(1000)]
    routes[500] = Route("10.69.0.0/24", gateway="203.0.113.1")  # no route to this gateway
    routes.append(Route("2001:db8:66::/64", gateway="2001:db8:ffff::1"))
    programmer = await start()
    programmer.set_desired(routes)
    result = await programmer.reconcile()
    failed = dict(result.failed)
    assert failed.keys() == {"10.69.0.0/24", "2001:db8:66::/64"}
    assert failed["10.69.0.0/24"].startswith("ENETUNREACH")
    assert len(result.added) == 999
    assert len(await lab.own("-4")) == 999
    assert programmer.failures.keys() == failed.keys()
    # Once the gateway is reachable (an address event), the failed route is retried.
    await lab.ip("addr", "add", "203.0.113.2/24", "dev", "v0")
    await eventually(lambda: _shows(lab, "10.69.0.0/24 via 203.0.113.1 dev v0"), what="retried route")
    # Not desired any more: its failure is forgotten.
    programmer.set_desired(routes[:10])
    await programmer.reconcile()
    assert "2001:db8:66::/64" not in programmer.failures


async def test_stop_can_remove_own_routes_only(lab, start):
    lab.r.ip("route", "add", "10.67.0.0/24", "via", GW4, "proto", "static")
    programmer = await start()
    programmer.set_desired([Route("10.68.0.0/24", gateway=GW4), Route("2001:db8:68::/64", kind="blackhole")])
    await programmer.reconcile()
    await programmer.stop(remove_routes=True)
    assert await lab.count_own() == 0
    assert "10.67.0.0/24 via 192.0.2.2 dev v0 proto static" in await lab.ip("route", "show")


def test_bad_programmer_arguments_raise_clear_errors():
    for kwargs, what in [
        (dict(protocol=4), "protocol"),
        (dict(protocol=256), "protocol"),
        (dict(table=255), "table"),
        (dict(table=0), "table"),
        (dict(resync_interval=0), "resync_interval"),
    ]:
        with pytest.raises(ValueError, match=what):
            RouteProgrammer(**kwargs)


async def test_addresses_are_compared_canonically(lab, start):
    programmer = await start()
    programmer.set_desired([Route("2001:0db8:0069:0000::/64", gateway="2001:db8:0:0::2")])
    await programmer.reconcile()
    assert [r.dst for r in programmer.programmed()] == [str(ipaddress.ip_network("2001:db8:69::/64"))]
    again = await programmer.reconcile(full=True)
    assert (again.added, again.replaced, again.removed) == ((), (), ())


# --- from a review of route programming -------------------------------------------------------------


@pytest.mark.parametrize("family, dst, nexthops, want", [
    ("-4", "10.55.0.0/24", ["192.0.2.2", "192.0.2.3"], "10.55.0.0/24 via 192.0.2.2 dev v0"),
])
async def test_an_own_multipath_route_holding_the_desired_key_is_replaced(lab, start, family, dst, nexthops, want):
    # A multipath route of ours (the Route model cannot say it: adopted as a stray) for a
    # destination also desired: the desired route replaces it.  The add used to meet EEXIST,
    # the stray's delete then took the multipath route, and the destination stayed without a
    # route until the next resync.  IPv4 only: an IPv4 multipath route is one route; IPv6's
    # is one route per next hop (the next test).
    hops = [arg for gw in nexthops for arg in ("nexthop", "via", gw, "dev", "v0")]
    await lab.ip(family, "route", "add", dst, "proto", str(RTPROT_AGENTD), *hops)
    programmer = await start(resync_interval=3600)
    assert programmer.programmed() == [] and len(programmer.state.strays) == 1
    programmer.set_desired([Route(dst, gateway=nexthops[0], dev="v0")])
    result = await programmer.reconcile()
    assert (result.replaced, result.failed, result.conflicts) == ((dst,), (), ())
    assert await lab.own(family) == [want]
    result = await programmer.reconcile(full=True)
    assert (result.added, result.replaced, result.removed, result.failed) == ((), (), (), ())
    assert await lab.own(family) == [want]


V6_55 = "2001:db8:55::/64"


@pytest.mark.parametrize("desired, want, removed, replaced", [
    # The desired route is one of the next hops: it stays untouched, our other one goes.
    (Route(V6_55, gateway=GW6, dev="v0"), f"{V6_55} via {GW6} dev v0 metric 1024 pref medium", (V6_55,), ()),
    (Route(V6_55, gateway="2001:db8::3", dev="v0"), f"{V6_55} via 2001:db8::3 dev v0 metric 1024 pref medium",
     (V6_55,), ()),
    # It is none of them: it replaces our first next hop (the kernel takes the others along);
    # the delete of the next hop via its gateway, dropped, would have taken it.
    (Route(V6_55, gateway="2001:db8::3", dev="v0", mtu=1400),
     f"{V6_55} via 2001:db8::3 dev v0 metric 1024 mtu 1400 pref medium", (), (V6_55,)),
])
async def test_an_own_ipv6_multipath_route_holding_the_desired_key(lab, start, desired, want, removed, replaced):
    # IPv6 keeps a multipath route as one route per next hop (each with its protocol) and
    # reports them as one: our first next hop is adopted as the route for its destination
    # (the desired one if it is there), each other one is deleted by its gateway and device.
    # This used to be adopted whole as a stray and replaced whole by the desired route.
    hops = [arg for gw in (GW6, "2001:db8::3") for arg in ("nexthop", "via", gw, "dev", "v0")]
    await lab.ip("-6", "route", "add", V6_55, "proto", str(RTPROT_AGENTD), *hops)
    programmer = await start(resync_interval=3600)
    assert programmer.programmed() == [Route(V6_55, gateway=GW6, dev="v0")] and len(programmer.state.strays) == 1
    programmer.set_desired([desired])
    result = await programmer.reconcile()
    assert (result.added, result.replaced, result.removed, result.failed, result.conflicts) == (
        (), replaced, removed, (), ())
    assert await lab.own("-6") == [want]
    assert programmer.programmed() == [desired] and programmer.state.strays == set()
    result = await programmer.reconcile(full=True)
    assert (result.added, result.replaced, result.removed, result.failed) == ((), (), (), ())
    assert await lab.own("-6") == [want]


async def test_a_pods_veth_going_away_does_not_re_read_our_routes(lab, start):
    # A pod's host-side veth is deleted: the kernel says its addresses went (RTM_DELADDR, its
    # fe80:: one at least).  None of our routes uses the device or its addresses, so no full
    # re-read of every own route follows; an address one of ours uses as source does.
    netns.veth(lab.r, "v7", lab.p, "v6")
    lab.r.ip("link", "set", "v7", "up")
    lab.r.ip("-6", "addr", "add", "fe80::77/64", "dev", "v7", "nodad")
    lab.r.ip("addr", "add", "198.51.100.1/24", "dev", "v7")
    lab.r.ip("addr", "add", "192.0.2.9/24", "dev", "v0")
    programmer = await start(resync_interval=3600)
    programmer.set_desired([Route("10.56.0.0/24", gateway=GW4, dev="v0", src="192.0.2.9"),
                            Route("2001:db8:56::/64", gateway=GW6, dev="v0")])
    await programmer.reconcile()
    full = programmer.counters.full_resyncs
    await lab.ip("link", "del", "v7")
    await eventually(lambda: _link_forgotten(programmer, "v7"), what="v7's removal seen")
    result = await programmer.reconcile()
    assert not result.full and programmer.counters.full_resyncs == full
    await lab.ip("addr", "del", "192.0.2.9/24", "dev", "v0")  # our 10.56.0.0/24's source: flushed with it
    await eventually(lambda: _own_is(lab, [], "-4"), what="the route flushed with its source address")
    await eventually(lambda: _counted_full(programmer, full), what="a re-read after the source address went")


async def _link_forgotten(programmer: RouteProgrammer, name: str) -> bool:
    return name not in programmer.netlink.ifname.values()


async def _counted_full(programmer: RouteProgrammer, before: int) -> bool:
    return programmer.counters.full_resyncs > before


async def test_routes_of_an_earlier_route_protocol_are_removed_in_the_pod_network_only(lab, start):
    # [network] route_protocol changed from 143 to 150: the agent removes proto 143 routes
    # inside the pod networks (remove_routes_of), and the new protocol's adds meet no EEXIST.
    from agentd.kernel.routing import remove_routes_of

    await lab.ip("route", "add", "10.244.1.0/24", "via", GW4, "proto", str(RTPROT_AGENTD))
    await lab.ip("route", "add", "blackhole", "10.244.0.0/24", "metric", "4000", "proto", str(RTPROT_AGENTD))
    await lab.ip("-6", "route", "add", "fd00:10:244:1::/64", "via", GW6, "proto", str(RTPROT_AGENTD))
    await lab.ip("route", "add", "198.51.100.0/24", "via", GW4, "proto", str(RTPROT_AGENTD))  # outside: stays
    await lab.ip("route", "add", "10.244.9.0/24", "via", GW4, "proto", "static")  # another's: stays
    removed, failed = await remove_routes_of(
        RTPROT_AGENTD, [ipaddress.ip_network("10.244.0.0/16"), ipaddress.ip_network("fd00:10:244::/48")],
        netns=lab.r.name)
    assert sorted(removed) == ["10.244.0.0/24", "10.244.1.0/24", "fd00:10:244:1::/64"] and failed == []
    assert await lab.own("-4") == ["198.51.100.0/24 via 192.0.2.2 dev v0"] and await lab.own("-6") == []
    assert "10.244.9.0/24 via 192.0.2.2 dev v0 proto static" in await lab.ip("route", "show")
    programmer = await start(protocol=150)
    programmer.set_desired([Route("10.244.1.0/24", gateway=GW4, dev="v0")])
    result = await programmer.reconcile()
    assert (result.added, result.conflicts) == (("10.244.1.0/24",), ())


async def test_without_the_protocol_file_a_changed_protocol_removes_the_defaults_routes_in_the_pod_network(lab, start, tmp_path):
    # An upgrade from an agentd that wrote no state_dir/route-protocol, now with route_protocol
    # 150: the default protocol's routes inside the pod networks are the previous run's and go
    # (they stayed for ever, each a conflict for the new protocol's add); outside, and other
    # protocols', they stay.
    from agentd.daemon.routes import drop_previous_protocol
    from agentd.kernel.routing import remove_routes_of

    await lab.ip("route", "add", "10.244.1.0/24", "via", GW4, "proto", str(RTPROT_AGENTD))
    await lab.ip("-6", "route", "add", "fd00:10:244:1::/64", "via", GW6, "proto", str(RTPROT_AGENTD))
    await lab.ip("route", "add", "198.51.100.0/24", "via", GW4, "proto", str(RTPROT_AGENTD))  # outside: stays
    await lab.ip("route", "add", "10.244.9.0/24", "via", GW4, "proto", "static")  # another's: stays
    pools = [ipaddress.ip_network("10.244.0.0/16"), ipaddress.ip_network("fd00:10:244::/48")]
    await drop_previous_protocol(tmp_path / "state", 150, pools,
                                 remove=lambda p, n: remove_routes_of(p, n, netns=lab.r.name))
    assert (tmp_path / "state" / "route-protocol").read_text() == "150\n"
    assert await lab.own("-4") == ["198.51.100.0/24 via 192.0.2.2 dev v0"] and await lab.own("-6") == []
    assert "10.244.9.0/24 via 192.0.2.2 dev v0 proto static" in await lab.ip("route", "show")
    programmer = await start(protocol=150)
    programmer.set_desired([Route("10.244.1.0/24", gateway=GW4, dev="v0"), Route("fd00:10:244:1::/64", gateway=GW6, dev="v0")])
    result = await programmer.reconcile()
    assert sorted(result.added) == ["10.244.1.0/24", "fd00:10:244:1::/64"] and result.conflicts == ()


# --- IPv6 next hops of other daemons in a route of ours ---------------------------------------------


async def _hops(lab: Lab, dst: str) -> list[str]:
    """The next hops of ``dst`` in the main table, whoever's: ``["via 2001:db8::2 dev v0", ...]``."""
    out = await lab.ip("-6", "route", "show", "table", "main", "exact", dst)
    lines = [line.split() for line in out.splitlines() if line.strip()]
    hops = [" ".join(words[1:5]) for words in lines if words[0] == "nexthop"]
    if not hops:
        hops = [" ".join(words[words.index("via"):words.index("via") + 4]) for words in lines if "via" in words]
    return sorted(hops)


async def test_a_foreign_ipv6_next_hop_appended_to_ours_survives_a_full_resync(lab, start):
    # IPv6 keeps a multipath route as one route per next hop sharing (dst, metric), each with
    # its own protocol, and dumps them as one message with the first one's protocol.  Another
    # daemon (BIRD, an operator) appends its next hop to our route: a full resync re-reads the
    # group as ours and used to delete it (or replace it) whole, taking the other's next hop.
    # Only our next hops may go: the kernel deletes a next hop named by gateway and device only
    # when its protocol is ours, so the other's survives.  Our extra next hop goes, the desired
    # one is never touched.
    dst, foreign, extra = "2001:db8:57::/64", "2001:db8::3", "2001:db8::4"
    programmer = await start(resync_interval=3600)
    programmer.set_desired([Route(dst, gateway=GW6, dev="v0")])
    assert (await programmer.reconcile()).added == (dst,)
    await lab.ip("-6", "route", "append", dst, "via", foreign, "dev", "v0", "proto", "bird")
    await lab.ip("-6", "route", "append", dst, "via", extra, "dev", "v0", "proto", str(RTPROT_AGENTD))
    # (The monitor saw our protocol's next hop come and may have had it deleted already: a
    # reconcile runs in the background.)
    hops = await _hops(lab, dst)
    assert hops[:2] == [f"via {gw} dev v0" for gw in (GW6, foreign)] and hops[2:] in ([], [f"via {extra} dev v0"])
    result = await programmer.reconcile(full=True)
    assert (result.added, result.replaced, result.failed, result.conflicts) == ((), (), (), ())
    assert result.removed in ((dst,), ())  # our extra next hop, unless the background reconcile took it
    assert await _hops(lab, dst) == [f"via {gw} dev v0" for gw in (GW6, foreign)]
    assert programmer.programmed() == [Route(dst, gateway=GW6, dev="v0")]
    # Nothing left to do: another full resync sends nothing that changes the table.
    again = await programmer.reconcile(full=True)
    assert (again.added, again.replaced, again.removed, again.failed) == ((), (), (), ())
    assert await _hops(lab, dst) == [f"via {gw} dev v0" for gw in (GW6, foreign)]
    # The kernel refused the foreign next hop's delete (ESRCH) once: it is not tried again.
    assert [hop.gateway for hop in programmer.state.foreign_hops] == [foreign] and not programmer.state.strays
    # Each next hop still has its owner's protocol (a delete naming a protocol takes only its routes).
    await lab.ip("-6", "route", "del", dst, "via", foreign, "dev", "v0", "proto", "bird")
    assert await _hops(lab, dst) == [f"via {GW6} dev v0"]
    assert await lab.own("-6") == [f"{dst} via {GW6} dev v0 metric 1024 pref medium"]
    # Not desired any more: our next hop goes, another's appended meanwhile stays.
    await lab.ip("-6", "route", "append", dst, "via", foreign, "dev", "v0", "proto", "bird")
    programmer.set_desired([])
    result = await programmer.reconcile(full=True)
    assert (result.removed, result.failed) == ((dst,), ())
    assert await _hops(lab, dst) == [f"via {foreign} dev v0"]
    assert await lab.own("-6") == []


async def test_our_ipv6_next_hop_deleted_with_another_daemons_multipath_route_is_restored(lab, start):
    # `ip -6 route del DST proto bird` names no gateway (BIRD's nl_delete_rte): the kernel
    # deletes every next hop of the multipath route, ours appended to BIRD's too, and says so
    # once, with BIRD's protocol.  Ours is put back at once, not at the next full resync.
    dst, foreign = "2001:db8:58::/64", "2001:db8::3"
    programmer = await start(resync_interval=3600)
    programmer.set_desired([Route(dst, gateway=GW6, dev="v0")])
    assert (await programmer.reconcile()).added == (dst,)
    await lab.ip("-6", "route", "append", dst, "via", foreign, "dev", "v0", "proto", "bird")
    assert await _hops(lab, dst) == [f"via {gw} dev v0" for gw in (GW6, foreign)]
    resyncs = programmer.counters.full_resyncs
    await lab.ip("-6", "route", "del", dst, "proto", "bird")

    async def restored():
        return programmer.counters.routes_restored == 1 and await _hops(lab, dst) == [f"via {GW6} dev v0"]

    await eventually(restored, what="our next hop put back")
    assert programmer.counters.full_resyncs == resyncs
    assert programmer.programmed() == [Route(dst, gateway=GW6, dev="v0")]


@pytest.mark.parametrize("other, shown", [
    (Route("2001:db8:59::/64", dev="v0"), "2001:db8:59::/64 dev v0 metric 1024 pref medium"),
    (Route("2001:db8:59::/64", kind="blackhole"), "blackhole 2001:db8:59::/64 dev lo metric 1024 pref medium"),
], ids=["device-only", "blackhole"])
async def test_our_ipv6_gateway_route_becomes_a_device_route_or_a_blackhole_and_back(lab, start, other, shown):
    # A peer moved to the user-space backend (forwarding: a route onto its TUN device, no
    # gateway), or its destination blackholed, and back.  Linux before 4.19 refuses an IPv6
    # replace of a gateway route by a route without one (ENOENT; route_plan.needs_beside):
    # the new route goes in beside ours and ours is deleted by its gateway after it.  The
    # kernel shows exactly the desired route after each sync, nothing filed as a failure,
    # and another daemon's route for the destination at another metric is left alone.
    gateway = Route("2001:db8:59::/64", gateway=GW6, dev="v0")
    via = "2001:db8:59::/64 via 2001:db8::2 dev v0 metric 1024 pref medium"
    await lab.ip("-6", "route", "add", "2001:db8:59::/64", "via", "2001:db8::3", "dev", "v0", "metric", "2000",
                 "proto", "bird")
    theirs = [line for line in await lab.table_all() if "2001:db8:59::" in line]
    programmer = await start(resync_interval=3600)
    for want, line in ((gateway, via), (other, shown), (gateway, via), (other, shown)):
        programmer.upsert(want)
        result = await programmer.reconcile()
        assert result.ok and result.removed == () and programmer.failures == {}, result
        assert await lab.own("-6") == [line]
        again = await programmer.reconcile(full=True)
        assert (again.added, again.replaced, again.removed, again.failed) == ((), (), (), ())
    assert [line for line in await lab.table_all() if "2001:db8:59::" in line] == theirs


async def test_a_blackhole_beside_our_ipv6_gateway_route_is_a_conflict_when_ours_becomes_one(lab, start):
    # Another daemon's blackhole sits beside our IPv6 gateway route at its key (dst, metric).
    # Our desired route becomes a blackhole: added beside ours, it meets EEXIST (the kernel's
    # rt6_duplicate_nexthop: the same device, lo, and no gateway).  That was filed as a failure
    # at every resync; it is a conflict naming the owner, and our gateway route stays.
    dst = "2001:db8:5a::/64"
    via = f"{dst} via {GW6} dev v0 metric 1024 pref medium"
    programmer = await start(resync_interval=3600)
    programmer.set_desired([Route(dst, gateway=GW6, dev="v0")])
    assert (await programmer.reconcile()).added == (dst,)
    await lab.ip("-6", "route", "append", "blackhole", dst, "proto", "bird")
    theirs = [line for line in await lab.table_all() if "2001:db8:5a::" in line]
    assert len(theirs) == 1 and "blackhole" in theirs[0], theirs
    programmer.set_desired([Route(dst, kind="blackhole")])
    for full in (False, True):
        result = await programmer.reconcile(full=full)
        assert result.failed == () and [d for d, _reason in result.conflicts] == [dst], result
        assert "proto bird" in result.conflicts[0][1]
        assert programmer.failures == {} and list(programmer.conflicts) == [dst]
        assert await lab.own("-6") == [via]
        assert [line for line in await lab.table_all() if "2001:db8:5a::" in line] == theirs
    assert programmer.counters.errors == 0
    # Theirs goes: the next full resync puts our blackhole in its place, and ours goes.
    await lab.ip("-6", "route", "del", "blackhole", dst, "proto", "bird")
    result = await programmer.reconcile(full=True)
    assert result.ok, result
    assert await lab.own("-6") == [f"blackhole {dst} dev lo metric 1024 pref medium"]


async def test_two_own_routes_at_one_ipv6_key_and_another_daemons_gateway_route_beside_ours(lab, start):
    # One IPv6 key (dst, metric) holds our gateway route and a route of ours without a
    # gateway (what `ip -6 route replace DST dev v0 proto 143` leaves on Linux 4.1-4.18;
    # `append` here).  A delete of ours by key took the first route of ours at the key, the
    # gateway route, and the other stayed; a replace by a gateway route took the first
    # gateway route at the key, another daemon's beside ours.  Now each of ours is deleted by
    # exactly its gateway (:: for none), and a gateway route goes in beside ours.
    dst = "2001:db8:5b::/64"
    via = f"{dst} via {GW6} dev v0 metric 1024 pref medium"
    gateway = Route(dst, gateway=GW6, dev="v0")
    programmer = await start(resync_interval=3600)
    programmer.set_desired([gateway])
    assert (await programmer.reconcile()).added == (dst,)
    removed = programmer.counters.routes_removed
    await lab.ip("-6", "route", "append", dst, "dev", "v0", "proto", str(RTPROT_AGENTD))
    # Ours nobody wants goes, the desired one stays: the monitor's report of the pair asks for
    # a re-read, which the programmer's own loop may make before this one (racing the test).
    result = await programmer.reconcile(full=True)
    assert result.ok, result
    await eventually(lambda: _own_is(lab, [via], "-6"), what="our route without a gateway gone")
    assert programmer.counters.routes_removed == removed + 1
    await lab.ip("-6", "route", "append", dst, "dev", "v0", "proto", str(RTPROT_AGENTD))
    await programmer.stop(remove_routes=True)
    assert await lab.own("-6") == []
    # Our device route, and another daemon's gateway route with our next hop beside it.
    programmer = await start(resync_interval=3600)
    programmer.set_desired([Route(dst, dev="v0")])
    assert (await programmer.reconcile()).added == (dst,)
    await lab.ip("-6", "route", "append", dst, "via", GW6, "dev", "v0", "proto", "bird")
    theirs = [line for line in await lab.table_all() if "2001:db8:5b::" in line and "bird" in line]
    assert len(theirs) == 1, theirs
    programmer.set_desired([gateway])
    for full in (False, True):
        result = await programmer.reconcile(full=full)
        assert result.failed == () and [d for d, _reason in result.conflicts] == [dst], result
        assert "proto bird" in result.conflicts[0][1]
        assert [line for line in await lab.table_all() if "2001:db8:5b::" in line and "bird" in line] == theirs
        assert await lab.own("-6") == [f"{dst} dev v0 metric 1024 pref medium"]
    await lab.ip("-6", "route", "del", dst, "via", GW6, "dev", "v0", "proto", "bird")
    assert (await programmer.reconcile(full=True)).ok
    assert await lab.own("-6") == [via]
