"""The route programmer when the kernel refuses a route: the old route of ours for the
destination stays and carries the traffic, and the refusal is reported, not dropped.

Scenarios over the stand-in kernel of test_route_model (FakeKernel: an add through a device it
does not have fails ENODEV, as fib_check_nh / ip6_route_info_create do).
"""

from __future__ import annotations

import errno
import importlib.util
import pathlib

import pytest

from agentd.kernel import netlink as nl
from agentd.kernel.route_model import Route

# The stand-in and its scenarios, from test_route_model (pytest imports test modules with
# --import-mode=importlib: loaded by path, as a helper, its tests not collected here).
_spec = importlib.util.spec_from_file_location("route_model_harness",
                                               pathlib.Path(__file__).with_name("test_route_model.py"))
assert _spec is not None and _spec.loader is not None
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)
LINKS, OURS, X, entry_of_route, key_of, scenario = (harness.LINKS, harness.OURS, harness.X, harness.entry_of_route,
                                                    harness.key_of, harness.scenario)

MAIN = nl.RT_TABLE_MAIN
X6 = "2001:db8::/64"


def own_routes(m) -> list[str]:
    return sorted(e.describe() for e in m.own_entries())


# --- a metric change: the new route is added, then the old one deleted ---------------------------


@pytest.mark.parametrize("dev", ["vxlan0", "eth1"], ids=["device-unknown-to-us", "device-gone-from-the-kernel"])
def test_a_metric_change_whose_add_is_refused_keeps_the_old_route(monkeypatch, dev):
    # Our own subnet's blackhole (metric 4000) gives way to a peer's route (metric 0) through
    # a device that is not there: the add fails ENODEV.  The blackhole was deleted all the
    # same, and the subnet's traffic followed the default route out to the underlay.
    blackhole = Route(X, kind="blackhole", metric=4000)
    peer = Route(X, gateway="192.0.2.2", dev=dev, onlink=True)
    with scenario(own=[blackhole]) as m:
        before = own_routes(m)
        if dev == "eth1":
            monkeypatch.delitem(LINKS, 3)  # the programmer still knows it: the kernel refuses
        m.set_desired([peer])
        n = len(m.kernel.requests)
        result = m.run(m.p.reconcile())
        assert [dst for dst, _reason in result.failed] == [X] and "ENODEV" in result.failed[0][1]
        assert (result.added, result.removed, result.conflicts) == ((), (), ())
        assert own_routes(m) == before, "the old route went with its replacement refused"
        assert all(op != "delete" for op, _target, _err in m.kernel.requests[n:])
        assert list(m.p.failures) == [X]
        if dev == "eth1":
            # The device comes back (a link event retries failures): the peer's route goes in,
            # and only then the blackhole goes.
            monkeypatch.setitem(LINKS, 3, "eth1")
            m.p.state.retry_failures()
            n = len(m.kernel.requests)
            result = m.run(m.p.reconcile())
            assert [(op, err) for op, _target, err in m.kernel.requests[n:]] == [("add", 0), ("delete", 0)]
            assert (result.added, result.removed, result.failed) == ((X,), (X,), ())
            assert own_routes(m) == [entry_of_route(peer, table=MAIN, protocol=OURS).describe()]
            assert m.p.failures == {}


def test_a_metric_change_meeting_another_daemons_route_deletes_ours():
    # The new key holds another daemon's route (EEXIST, a conflict naming it): it carries the
    # destination's traffic, and our old route, wanted no more, goes as before.
    blackhole = Route(X, kind="blackhole", metric=4000)
    peer = Route(X, gateway="192.0.2.2", dev="eth0")
    theirs = entry_of_route(Route(X, dev="eth1"), table=MAIN, protocol=nl.RTPROT_STATIC)
    with scenario(own=[blackhole], others=[theirs]) as m:
        m.set_desired([peer])
        result = m.run(m.p.reconcile())
        assert [dst for dst, _reason in result.conflicts] == [X] and result.failed == ()
        assert result.removed == (X,) and own_routes(m) == []
        assert m.kernel.leaf(theirs.key) == [theirs]


def test_a_metric_change_whose_add_is_refused_then_wanted_no_more_is_deleted(monkeypatch):
    # The kept old route is still ours and filed as the destination's: dropped from the
    # desired set, it is deleted (and the failure forgotten).
    blackhole = Route(X, kind="blackhole", metric=4000)
    with scenario(own=[blackhole]) as m:
        m.set_desired([Route(X, gateway="192.0.2.2", dev="vxlan0", onlink=True)])
        assert m.run(m.p.reconcile()).failed
        m.set_desired([])
        result = m.run(m.p.reconcile())
        assert (result.removed, result.failed) == ((X,), ()) and own_routes(m) == [] and m.p.failures == {}


# --- an IPv6 route added beside ours (route_plan.needs_beside) meeting EEXIST ----------------------


def _beside_scenario():
    """Our IPv6 gateway route at X6, and the desired route becoming a device route through
    the same device; the programmer does not know the own-protocol device route put beside
    ours at the key (a full resync would file it)."""
    gateway = Route(X6, gateway="2001:db8:ff::2", dev="eth0")
    device = Route(X6, dev="eth0")
    s = scenario(own=[gateway])
    m = s.__enter__()
    key = key_of(gateway, MAIN)
    mine = entry_of_route(device, table=MAIN, protocol=OURS)
    m.kernel.set_leaf(key, [*m.kernel.leaf(key), mine])
    return s, m, key, device, mine


def test_a_route_added_beside_ours_meeting_our_own_next_hop_stays_a_failure():
    s, m, key, device, _mine = _beside_scenario()
    try:
        leaf = m.kernel.leaf(key)
        m.set_desired([device])
        n = len(m.kernel.requests)
        result = m.run(m.p.reconcile())
        assert [(op, err) for op, _target, err in m.kernel.requests[n:]] == [("beside", errno.EEXIST)]
        assert [dst for dst, _reason in result.failed] == [X6] and result.failed[0][1].startswith("EEXIST")
        assert result.conflicts == () and list(m.p.failures) == [X6] and m.p.conflicts == {}
        assert m.kernel.leaf(key) == leaf, "our gateway route must stay: it carries the traffic"
    finally:
        s.__exit__(None, None, None)


def test_a_route_added_beside_ours_meeting_an_eexist_nothing_explains_stays_a_failure():
    # The route in the way is gone by the time the table is read (deleted meanwhile).
    s, m, key, device, mine = _beside_scenario()
    try:
        def watch(op, err):
            if (op, err) == ("beside", errno.EEXIST):
                m.kernel.remove(mine)

        m.set_desired([device])
        m.kernel.watch = watch
        result = m.run(m.p.reconcile())
        m.kernel.watch = None
        assert [dst for dst, _reason in result.failed] == [X6] and result.failed[0][1].startswith("EEXIST")
        assert result.conflicts == () and list(m.p.failures) == [X6] and m.p.conflicts == {}
        assert [e.gateway is not None for e in m.kernel.leaf(key)] == [True]
    finally:
        s.__exit__(None, None, None)


# --- a metric change whose add finds our route at the new key, put beside it after all ----------


@pytest.mark.parametrize("then", ["goes-in", "refused", "blocked"])
def test_a_metric_change_going_beside_our_unknown_route_at_the_new_key(monkeypatch, then):
    # Our blackhole at metric 4000 is X6's route as the programmer knows it; at the new key
    # (metric 1024) is a gateway route of ours it does not know (a full resync would file it).
    # The desired device route's add meets EEXIST, the table read finds ours there, and a
    # replace could not put it in that route's place (route_plan.needs_beside): it goes beside
    # it, in a second pass.  That pass's outcome is the reconcile's: reported in its result,
    # and the old blackhole deleted only once the device route is in.  Refused there (eth1
    # gone from the kernel meanwhile: ENODEV), the blackhole stays and the refusal is reported.
    # Blocked (BIRD's blackhole is at the key too: route_adopt.others_at_keys), it is a
    # conflict, reported; the blackhole goes, as where an add meets another daemon's route
    # (test_a_metric_change_meeting_another_daemons_route_deletes_ours), our gateway route
    # carrying the traffic.
    blackhole = Route(X6, kind="blackhole", metric=4000)
    gateway = Route(X6, gateway="2001:db8:ff::2", dev="eth0")
    device = Route(X6, dev="eth1")
    with scenario(own=[blackhole]) as m:
        unknown = entry_of_route(gateway, table=MAIN, protocol=OURS)
        theirs = entry_of_route(Route(X6, kind="blackhole"), table=MAIN, protocol=nl.RTPROT_BIRD)
        m.kernel.set_leaf(unknown.key, [unknown, theirs] if then == "blocked" else [unknown])
        assert m.p.programmed() == [blackhole]

        def watch(op, err):
            if then == "refused" and (op, err) == ("add", errno.EEXIST):
                monkeypatch.delitem(LINKS, 3)  # the programmer still knows eth1: the kernel refuses

        m.set_desired([device])
        n = len(m.kernel.requests)
        m.kernel.watch = watch
        result = m.run(m.p.reconcile())
        m.kernel.watch = None
        sent = [(op, err) for op, _target, err in m.kernel.requests[n:]]
        if then == "goes-in":
            assert sent == [("add", errno.EEXIST), ("beside", 0), ("delete", 0), ("delete", 0)]
            assert (result.replaced, result.removed, result.failed, result.conflicts) == ((X6,), (X6,), (), ())
            assert own_routes(m) == [entry_of_route(device, table=MAIN, protocol=OURS).describe()]
            assert m.p.failures == {} and m.p.programmed() == [device]
        elif then == "refused":
            assert sent == [("add", errno.EEXIST), ("add", errno.ENODEV)]  # the stand-in's name for the refused beside
            assert [dst for dst, _reason in result.failed] == [X6] and "ENODEV" in result.failed[0][1]
            assert (result.added, result.replaced, result.removed, result.conflicts) == ((), (), (), ())
            assert own_routes(m) == sorted([entry_of_route(blackhole, table=MAIN, protocol=OURS).describe(),
                                            unknown.describe()]), "the blackhole went with its replacement refused"
            assert list(m.p.failures) == [X6] and m.p.conflicts == {}
        else:
            assert sent == [("add", errno.EEXIST), ("delete", 0)]
            assert [dst for dst, _reason in result.conflicts] == [X6] and "proto bird" in result.conflicts[0][1]
            assert (result.added, result.replaced, result.removed, result.failed) == ((), (), (X6,), ())
            assert own_routes(m) == [unknown.describe()] and m.kernel.leaf(unknown.key) == [unknown, theirs]
            assert list(m.p.conflicts) == [X6] and m.p.failures == {}
