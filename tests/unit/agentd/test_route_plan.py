"""The route programmer's parts alone: planning (agentd.kernel.route_plan), adoption
(agentd.kernel.route_adopt) and the pure side of its netlink I/O (agentd.kernel.route_netlink:
kernel messages -> Routes, Routes -> requests).  No sockets: the whole programmer against a
stand-in kernel is test_route_model.py, against the real one tests/system/test_routing.py."""

from __future__ import annotations

import socket

from agentd.kernel import netlink as nl
from agentd.kernel.route_adopt import (
    adopt,
    classify_existing,
    file_route,
    others_at_keys,
)
from agentd.kernel.route_model import (
    ADD,
    BESIDE,
    DELETE,
    REQUEST_FLAGS,
    RTM_F_CLONED,
    RTPROT_AGENTD,
    Route,
    stray_of,
)
from agentd.kernel.route_netlink import RouteNetlink
from agentd.kernel.route_plan import RouteState, dst_of
from agentd.kernel.routing import RouteProgrammer

A = Route("10.0.1.0/24", gateway="192.0.2.2")
A_OTHER_GW = Route("10.0.1.0/24", gateway="192.0.2.3")
A_METRIC5 = Route("10.0.1.0/24", gateway="192.0.2.2", metric=5)
B = Route("10.0.2.0/24", dev="eth0")
C = Route("2001:db8::/64", kind="blackhole")


def adopted(*routes: Route, desired: dict | None = None) -> RouteState:
    """A state that found ``routes`` of ours in the kernel at start."""
    state = RouteState()
    state.kernel, state.strays = adopt(routes, desired or {})
    return state


def full_plan(state: RouteState):
    work = state.take_work(state.needs_full(True))
    return state.plan(work.dsts, work.full, work.retry)


# --- planning ------------------------------------------------------------------------------


def test_plan_adds_what_the_kernel_lacks():
    state = RouteState()
    state.set_desired([A, B, C])
    work = state.take_work(state.needs_full(False))
    assert work.dsts is None and not work.full  # set_desired: every destination is looked at
    plan = state.plan(work.dsts, work.full, work.retry)
    assert (plan.adds, plan.replaces, plan.deletes, plan.stale) == ([A, B, C], [], [], [])
    assert not state.has_work()


def test_plan_leaves_the_desired_route_alone_and_replaces_a_different_one():
    state = adopted(A, B)
    state.set_desired([A, Route(B.dst, dev="eth1")])
    plan = full_plan(state)
    assert plan.adds == [] and plan.deletes == []
    assert plan.replaces == [Route(B.dst, dev="eth1")]


def test_a_new_metric_is_a_new_key_added_before_the_old_is_deleted():
    state = adopted(A)
    state.set_desired([A_METRIC5])
    plan = full_plan(state)
    assert (plan.adds, plan.replaces, plan.deletes) == ([A_METRIC5], [], [A])


def test_nothing_is_deleted_before_the_first_complete_desired_set():
    """Restart without a gap: routes a previous run left stay until the caller says."""
    state = adopted(A, B)
    state.upsert(C)
    plan = full_plan(state)
    assert plan.adds == [C] and plan.deletes == []
    state.discard(B.dst)
    work = state.take_work(False)
    assert work.dsts == {B.dst}
    plan = state.plan(work.dsts, work.full, work.retry)
    assert plan.deletes == [B] and plan.stale == [B.dst]
    state.set_desired([C])
    assert full_plan(state).deletes == [A, B]


def test_strays_go_once_the_destination_is_declared():
    state = adopted(A, A_METRIC5, desired={A.dst: A})
    assert state.kernel == {A.dst: A} and state.strays == {stray_of(A_METRIC5)}
    assert full_plan(state).deletes == []  # undeclared: kept for now
    state.upsert(A)
    assert state.full_pending  # the stray might be the route now wanted: re-read first
    assert full_plan(state).deletes == [stray_of(A_METRIC5)]


def test_conflicts_are_retried_on_full_resyncs_or_when_their_route_changes():
    state = RouteState()
    state.set_desired([A])
    state.take_work(False)
    assert state.record([], [(A.dst, "in the way")]) == ["in the way"]
    assert state.record([], [(A.dst, "in the way")]) == []  # not new: not logged again
    state.dirty_all = True
    work = state.take_work(False)
    assert state.plan(work.dsts, work.full, work.retry).adds == []
    assert full_plan(state).adds == [A]
    state.set_desired([A_OTHER_GW])  # its desired route changed: retried at once
    work = state.take_work(False)
    assert state.plan(work.dsts, work.full, work.retry).adds == [A_OTHER_GW]
    state.other_route_removed(A.dst)  # the route in the way went
    assert state.dirty == {A.dst}


def test_a_conflict_beside_our_route_at_its_key_is_retried_like_any_other():
    """An IPv6 route to go beside ours at its key (needs_beside) that another daemon's route
    blocked: our route stays, and the change is re-tried only on full resyncs, or when the
    desired route or the key changed, not at every set_desired of the same set."""
    device, gateway = Route(V6, dev="eth0"), Route(V6, gateway=HOP2, dev="eth0")
    state = adopted(device)
    state.set_desired([gateway])
    assert full_plan(state).besides == [(gateway, [device])]
    state.record([], [(V6, "BIRD's gateway route there")])
    state.set_desired([gateway])
    work = state.take_work(state.needs_full(False))
    assert work.dsts is None and state.plan(work.dsts, work.full, work.retry).besides == []
    assert full_plan(state).besides == [(gateway, [device])]
    other = Route(V6, gateway=HOP3, dev="eth0")
    state.set_desired([other])  # its desired route changed: at once
    work = state.take_work(state.needs_full(False))
    assert state.plan(work.dsts, work.full, work.retry).besides == [(other, [device])]
    state.other_route_removed(V6)  # the route in the way went
    work = state.take_work(state.needs_full(False))
    assert state.plan(work.dsts, work.full, work.retry).besides == [(other, [device])]


def test_destinations_nobody_wants_forget_their_failures():
    state = RouteState()
    state.set_desired([A, B])
    state.record([(B.dst, "no device")], [(A.dst, "in the way")])
    state.set_desired([])
    plan = full_plan(state)
    assert sorted(plan.stale) == [A.dst, B.dst]
    state.forget(plan.stale)
    assert state.failures == {} and state.conflicts == {}


def test_acknowledged_changes_update_the_kernel_view():
    state = adopted(A)
    state.record([(B.dst, "no device")], [])
    added: list[str] = []
    state.installed([A_METRIC5, B], added)
    assert added == [A.dst, B.dst]
    assert state.kernel == {A.dst: A_METRIC5, B.dst: B}
    assert state.strays == {stray_of(A)}  # the old key, deleted later in the same sync
    assert state.failures == {}
    removed: list[str] = []
    state.deleted([stray_of(A), B], removed)
    assert removed == [A.dst, B.dst] and state.kernel == {A.dst: A_METRIC5} and not state.strays


def test_a_desired_route_someone_deleted_is_restored_and_counted():
    state = adopted(A)
    state.set_desired([A])
    state.take_work(False)
    state.own_route_removed(A)
    assert state.kernel == {} and state.dirty == {A.dst} and state.restoring == {A.dst}
    work = state.take_work(False)
    plan = state.plan(work.dsts, work.full, work.retry)
    assert plan.adds == [A]
    state.installed(plan.adds, [])
    assert state.counters.routes_restored == 1 and not state.restoring


def test_own_routes_others_add_are_filed_and_others_replacing_ours_are_noticed():
    state = RouteState()
    state.set_desired([A])
    state.take_work(False)
    state.own_route_added(A_OTHER_GW)
    assert state.kernel == {A.dst: A_OTHER_GW} and state.dirty == {A.dst}
    work = state.take_work(False)
    assert state.plan(work.dsts, work.full, work.retry).replaces == [A]
    state.other_route_replaced(A.dst, 7)  # another key: ours is still there
    assert state.kernel == {A.dst: A_OTHER_GW}
    state.other_route_replaced(A.dst, 0)
    assert state.kernel == {} and state.dirty == {A.dst}


def test_an_own_ipv6_route_without_a_gateway_at_our_gateway_routes_key_makes_the_kernel_be_re_read():
    """Another own-protocol client's ``ip -6 route replace fd00:1::/64 dev eth1``: on Linux
    4.1-4.18 added beside our gateway route, from 4.19 in its place.  The monitor cannot tell
    which: the kernel is re-read, and meanwhile nothing of that key is deleted (deleting the
    device route as a stray would leave the destination unrouted if ours is gone; review r14 #2)."""
    ours = Route("fd00:1::/64", gateway="fd00::1", dev="eth0")
    theirs = Route("fd00:1::/64", dev="eth1")
    state = RouteState()
    state.set_desired([ours])
    state.kernel[ours.dst] = ours  # programmed
    state.take_work(False)
    state.own_route_added(theirs)
    assert state.full_pending
    assert ours.dst in state.dirty
    assert state.kernel == {ours.dst: ours} and not state.strays  # filed by the re-read, not guessed
    work = state.take_work(False)
    plan = state.plan(work.dsts, work.full, work.retry)
    assert plan.deletes == [] and plan.replaces == [] and plan.adds == []


def test_dst_of_names_routes_and_strays():
    assert dst_of(A) == dst_of(stray_of(A)) == A.dst


# --- adoption ------------------------------------------------------------------------------


def test_two_own_routes_for_one_destination_file_the_desired_key_as_the_route():
    kernel: dict = {}
    strays: set = set()
    file_route(A, kernel, strays, {A.dst: A_METRIC5})
    file_route(A_METRIC5, kernel, strays, {A.dst: A_METRIC5})
    assert kernel == {A.dst: A_METRIC5} and strays == {stray_of(A)}


def route_message(route: Route, protocol: int, **fields) -> nl.RouteMessage:
    addr, _, plen = route.dst.partition("/")
    family = route.family
    return nl.RouteMessage(family, int(plen), nl.RT_TABLE_MAIN, protocol, 0, nl.RTN_UNICAST,
                           dst=socket.inet_pton(family, addr),
                           gateway=None if route.gateway is None else socket.inet_pton(family, route.gateway),
                           oif=2, priority=route.metric, **fields)


def test_classify_existing_adopts_ours_and_reports_the_others():
    netlink = RouteNetlink(table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD)
    netlink.ifname[2] = "eth0"
    messages = [
        route_message(A_OTHER_GW, RTPROT_AGENTD),  # ours, another gateway: replace
        route_message(B, nl.RTPROT_BIRD),  # BIRD's: a conflict
        route_message(A, nl.RTPROT_BIRD, tos=0x10),  # another key (TOS): not in the way
    ]
    result = classify_existing([A, B, C], messages, table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD,
                               route_of=netlink.route_of)
    assert result.own == [A]
    assert result.adopted == {A.dst: Route(A.dst, gateway="192.0.2.3", dev="eth0")}
    assert [dst for dst, _reason in result.conflicts] == [B.dst]
    assert "proto bird" in result.conflicts[0][1]
    assert [dst for dst, _reason in result.unexplained] == [C.dst]


def test_classify_existing_finds_our_route_a_replace_takes_at_an_ipv6_key():
    """One IPv6 key may hold a gateway route of ours and one without: the one as ECMP-able as
    the wanted route is its holder (a replace by it takes that one), whatever the dump order."""
    netlink = RouteNetlink(table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD)
    netlink.ifname[2] = "eth0"
    gateway, device = Route(V6, gateway=HOP2, dev="eth0"), Route(V6, dev="eth0")
    messages = [route_message(r, RTPROT_AGENTD)._replace(priority=1024) for r in (gateway, device)]
    for order in (messages, messages[::-1]):
        for want, holder in ((Route(V6, gateway=HOP3, dev="eth0"), gateway), (Route(V6, dev="eth0", mtu=1400), device)):
            result = classify_existing([want], order, table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD,
                                       route_of=netlink.route_of)
            assert (result.own, result.adopted, result.conflicts) == ([want], {V6: holder}, [])


def test_classify_existing_leaves_a_source_specific_route_of_ours_out_of_the_key():
    """A route of ours at a source prefix (rtm_src_len 48) is another kernel key than ours
    (source ::/0): not the holder of our EEXIST.  Taken for it ("ours wins"), the add became
    a replace, which took BIRD's route that holds the key."""
    netlink = RouteNetlink(table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD)
    netlink.ifname[2] = "eth0"
    want = Route(V6, gateway=HOP2, dev="eth0")
    bird = route_message(Route(V6, gateway=HOP3), nl.RTPROT_BIRD)._replace(priority=1024)
    ours_at_source = route_message(Route(V6, gateway=HOP4), RTPROT_AGENTD)._replace(
        priority=1024, src_len=48, src=bytes(16))
    for order in ([bird, ours_at_source], [ours_at_source, bird]):
        result = classify_existing([want], order, table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD,
                                   route_of=netlink.route_of)
        assert (result.own, result.adopted) == ([], {})
        assert [dst for dst, _reason in result.conflicts] == [V6] and "proto bird" in result.conflicts[0][1]


def test_a_route_to_go_beside_ours_at_an_ipv6_key_another_daemon_holds_is_a_conflict():
    """Beside their gateway route ours would be its ECMP sibling; beside one without, ours
    would come after it, and a later replace of ours take theirs.  Another key (metric,
    table), or our own route, are not in the way."""
    gateway, blackhole = Route(V6, gateway=HOP2, dev="eth0"), Route(V6, kind="blackhole")
    bird = nl.RTPROT_BIRD

    def conflicts(routes, *messages):
        return others_at_keys(routes, messages, table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD)

    def v6(route, protocol, **fields):
        return route_message(route, protocol)._replace(priority=1024, **fields)

    for theirs in (v6(Route(V6, gateway=HOP3), bird), multipath_message(V6, bird, [HOP3, HOP4]),
                   v6(Route(V6, dev="eth0"), bird, nh_id=7)):
        [(dst, reason)] = conflicts([gateway], theirs)
        assert dst == V6 and "proto bird gateway route" in reason and "ECMP" in reason
        [(dst, reason)] = conflicts([blackhole], theirs)
        assert dst == V6 and "proto bird route" in reason
    [(dst, reason)] = conflicts([gateway], v6(Route(V6, dev="eth0"), bird), multipath_message(V6, bird, [HOP3]))
    assert "gateway route" in reason  # the ECMP sibling is the one named
    [(dst, reason)] = conflicts([gateway], v6(blackhole, bird, type=nl.RTN_BLACKHOLE))
    assert dst == V6 and "proto bird route" in reason
    assert conflicts([gateway, blackhole], multipath_message(V6, bird, [HOP3], priority=100),
                     multipath_message(V6, bird, [HOP3])._replace(table=100),
                     multipath_message(V6, RTPROT_AGENTD, [HOP3]), v6(blackhole, RTPROT_AGENTD)) == []
    # Nor another key of the same destination and metric: another TOS, a source prefix (a
    # source-specific route), a cached clone (review r12's surviving mutants).
    assert conflicts([gateway, blackhole], v6(Route(V6, gateway=HOP3), bird, tos=0x10),
                     v6(Route(V6, gateway=HOP3), bird, src_len=48, src=bytes(16)),
                     v6(Route(V6, gateway=HOP3), bird, flags=RTM_F_CLONED)) == []


# --- the pure side of the netlink I/O --------------------------------------------------------


def test_route_of_reads_our_kernel_routes_and_leaves_other_shapes_as_strays():
    netlink = RouteNetlink(table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD)
    netlink.ifname[2] = "eth0"
    assert netlink.route_of(route_message(A, RTPROT_AGENTD)) == Route(A.dst, gateway=A.gateway, dev="eth0")
    multipath = route_message(A, RTPROT_AGENTD, multipath=b"\0" * 8)
    assert netlink.route_of(multipath) is None
    assert netlink.found_of(multipath).text == A.dst


def test_requests_decode_to_the_route_they_were_encoded_from():
    netlink = RouteNetlink(table=100, protocol=RTPROT_AGENTD)
    netlink.learn_link(nl.LinkMessage(index=2, name="eth0", flags=nl.IFF_UP))
    msg = nl.decode_route(netlink.encode_route(Route(B.dst, dev="eth0", mtu=1400), 7, REQUEST_FLAGS[ADD]), nl.NLMSG_HDRLEN)
    assert (msg.table, msg.protocol, msg.oif, msg.mtu, msg.scope) == (100, RTPROT_AGENTD, 2, 1400, nl.RT_SCOPE_LINK)
    delete = nl.decode_route(netlink.encode_delete(A_METRIC5, 8, REQUEST_FLAGS[DELETE]), nl.NLMSG_HDRLEN)
    assert (delete.table, delete.protocol, delete.priority, delete.dst_len) == (100, RTPROT_AGENTD, 5, 24)


def test_a_route_on_a_gone_link_of_unknown_name_is_deleted_by_that_links_index():
    netlink = RouteNetlink(table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD)
    routes = [Route("2001:db8:7::/64", gateway="2001:db8::2", dev=dev) for dev in ("if#9", "if#\u0663", "if#\u00b2", "eth9")]
    sent = [nl.decode_route(netlink.encode_delete(r, 1, REQUEST_FLAGS[DELETE]), nl.NLMSG_HDRLEN).oif for r in routes]
    # A link once named "if#٣" is no index 3 (int() reads it so), "if#²" none (int() refuses it).
    assert sent == [9, 0, 0, 0]


def test_a_source_specific_route_of_ours_is_deleted_by_its_source_prefix_too():
    # An IPv6 route of ours with a source prefix ("from 2001:db8:1::/56") is a stray beside
    # our route for the destination; its delete must name the source prefix, or the kernel
    # deletes the route without one -- the desired route.
    netlink = RouteNetlink(table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD)
    netlink.ifname[2] = "eth0"
    want = Route("2001:db8:7::/64", gateway="2001:db8::2")
    source = socket.inet_pton(socket.AF_INET6, "2001:db8:1::")
    request = netlink.encode_route(want, 1, REQUEST_FLAGS[ADD])
    found = nl.decode_route(request, nl.NLMSG_HDRLEN)._replace(src_len=56, src=source, oif=2)
    stray = netlink.found_of(found)
    assert (stray.text, stray.src_len, stray.src) == (want.dst, 56, source)
    assert stray != stray_of(want)
    delete = nl.decode_route(netlink.encode_delete(stray, 9, REQUEST_FLAGS[DELETE]), nl.NLMSG_HDRLEN)
    assert (delete.dst_len, delete.src_len, delete.src, delete.protocol) == (64, 56, source, RTPROT_AGENTD)
    plain = nl.decode_route(netlink.encode_delete(want, 10, REQUEST_FLAGS[DELETE]), nl.NLMSG_HDRLEN)
    assert (plain.src_len, plain.src) == (0, None)


V6 = "2001:db8:57::/64"
HOP2, HOP3, HOP4 = "2001:db8::2", "2001:db8::3", "2001:db8::4"


def multipath_message(dst: str, protocol: int, gateways: list[str], oif: int = 2,
                      priority: int = 1024) -> nl.RouteMessage:
    """An IPv6 multipath route as the kernel reports it: one message with RTA_MULTIPATH and
    the first next hop's protocol (each next hop is a route of its own, its own protocol)."""
    addr, _, plen = dst.partition("/")
    hops = nl.encode_nexthops([(0, oif, socket.inet_pton(socket.AF_INET6, gw)) for gw in gateways])
    return nl.RouteMessage(socket.AF_INET6, int(plen), nl.RT_TABLE_MAIN, protocol, 0, nl.RTN_UNICAST,
                           dst=socket.inet_pton(socket.AF_INET6, addr), priority=priority, multipath=hops)


def deletes_sent(netlink: RouteNetlink, targets: list) -> list[tuple]:
    """What each delete request names: (gateway text or None, oif, protocol, metric)."""
    out = []
    for target in targets:
        msg = nl.decode_route(netlink.encode_delete(target, 1, REQUEST_FLAGS[DELETE]), nl.NLMSG_HDRLEN)
        gateway = None if msg.gateway is None else socket.inet_ntop(msg.family, msg.gateway)
        out.append((gateway, msg.oif, msg.protocol, msg.priority))
    return sorted(out, key=str)


def test_an_ipv6_multipath_route_of_ours_loses_only_our_next_hops():
    # Another daemon appended its next hop (HOP3) to our IPv6 route (HOP2), and so did an
    # operator with our protocol (HOP4): the kernel reports one route with our protocol and
    # three next hops.  A full resync used to adopt it whole as a stray and replace it (or
    # delete it) whole, the other daemon's next hop with it.  Now our next hop is the route,
    # and each other next hop is deleted by its gateway and device with our protocol, which
    # the kernel does only for a next hop of ours: HOP3 stays (ESRCH), HOP4 goes.
    netlink = RouteNetlink(table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD)
    netlink.learn_link(nl.LinkMessage(index=2, name="eth0", flags=nl.IFF_UP))
    want = Route(V6, gateway=HOP2, dev="eth0")
    state = RouteState()
    state.set_desired([want])
    state.kernel, state.strays = adopt([netlink.found_of(multipath_message(V6, RTPROT_AGENTD, [HOP2, HOP3, HOP4]))],
                                       state.desired)
    plan = full_plan(state)
    assert (plan.adds, plan.replaces) == ([], [])
    assert deletes_sent(netlink, plan.deletes) == [(HOP3, 2, RTPROT_AGENTD, 1024), (HOP4, 2, RTPROT_AGENTD, 1024)]
    removed: list[str] = []
    state.deleted([t for t in plan.deletes if t.gateway == HOP4], removed)
    state.deleted([t for t in plan.deletes if t.gateway == HOP3], [])  # ESRCH: not ours
    assert removed == [V6] and state.kernel == {V6: want} and state.strays == set()
    # Not desired any more: our next hop goes by its gateway and device, HOP3 stays.
    state.set_desired([])
    plan = full_plan(state)
    assert plan.deletes == [want]
    assert deletes_sent(netlink, plan.deletes) == [(HOP2, 2, RTPROT_AGENTD, 1024)]
    state.deleted(plan.deletes, [])
    assert state.kernel == {}
    # An IPv4 multipath route is one route: deleted by its key, as before.
    assert deletes_sent(netlink, [A]) == [(None, 0, RTPROT_AGENTD, None)]


def test_an_ipv6_multipath_route_of_ours_files_the_desired_next_hop_as_the_route():
    netlink = RouteNetlink(table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD)
    netlink.learn_link(nl.LinkMessage(index=2, name="eth0", flags=nl.IFF_UP))
    group = netlink.found_of(multipath_message(V6, RTPROT_AGENTD, [HOP2, HOP3]))
    # The desired route is the second next hop: it is the route, the first goes by its gateway.
    want = Route(V6, gateway=HOP3, dev="eth0")
    kernel, strays = adopt([group], {V6: want})
    assert kernel == {V6: want} and [s.gateway for s in strays] == [HOP2]
    # None is the desired one: the first (certainly ours) is the route, replaced by the desired
    # one in place -- which takes every next hop of the key, so no delete follows: the one via
    # HOP3 would take the route just put there.
    state = RouteState()
    want = Route(V6, gateway=HOP3, dev="eth0", mtu=1400)
    state.set_desired([want])
    state.kernel, state.strays = adopt([group], state.desired)
    assert state.kernel == {V6: Route(V6, gateway=HOP2, dev="eth0")}
    plan = full_plan(state)
    assert (plan.adds, plan.replaces, plan.deletes) == ([], [want], [])
    state.installed([want], [])
    assert state.kernel == {V6: want} and state.strays == set()
    # Someone deleting one next hop of ours that is not the route: the route stays ours.
    state = RouteState()
    state.set_desired([Route(V6, gateway=HOP2, dev="eth0")])
    state.kernel, state.strays = adopt([group], state.desired)
    state.own_route_removed(netlink.found_of(route_message(Route(V6, gateway=HOP3), RTPROT_AGENTD)._replace(priority=1024)))
    assert state.kernel == {V6: Route(V6, gateway=HOP2, dev="eth0")} and state.strays == set()


def test_an_ipv6_gateway_route_becoming_one_that_is_not_ecmp_able_is_added_beside_then_deleted():
    # Before Linux 4.19 an IPv6 replace by a blackhole, unreachable or device-only route takes
    # no gateway route (ENOENT): the new route goes in beside ours (NLM_F_CREATE alone), and
    # ours is then deleted by its gateway and device.
    netlink = RouteNetlink(table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD)
    netlink.learn_link(nl.LinkMessage(index=2, name="eth0", flags=nl.IFF_UP))
    have = Route(V6, gateway=HOP2, dev="eth0")
    for want in (Route(V6, kind="blackhole"), Route(V6, kind="unreachable"), Route(V6, dev="eth0")):
        state = adopted(have)
        state.set_desired([want])
        plan = full_plan(state)
        assert (plan.adds, plan.replaces, plan.deletes, plan.besides) == ([], [], [], [(want, [have])])
        assert REQUEST_FLAGS[BESIDE] == nl.NLM_F_REQUEST | nl.NLM_F_CREATE
        assert deletes_sent(netlink, plan.besides[0][1]) == [(HOP2, 2, RTPROT_AGENTD, 1024)]
        report: list[str] = []
        state.installed([want], report, beside=True)
        state.deleted([have], [])
        assert report == [V6] and state.kernel == {V6: want}
        # Back to a gateway route: added beside ours too (a replace would take the first
        # gateway route at the key, another daemon's if one is there), and ours deleted by
        # gateway :: (none) and its device.
        state.set_desired([have])
        plan = full_plan(state)
        assert (plan.replaces, plan.besides) == ([], [(have, [want])])
        assert deletes_sent(netlink, [want]) == [("::", 2 if want.dev else 0, RTPROT_AGENTD, 1024)]
    # IPv4 has one route per key: replaced whatever its kind.
    state = adopted(A)
    state.set_desired([Route(A.dst, kind="blackhole")])
    plan = full_plan(state)
    assert (plan.replaces, plan.besides) == ([Route(A.dst, kind="blackhole")], [])


def test_our_ipv6_multipath_route_becoming_a_blackhole_is_added_beside_its_next_hops():
    netlink = RouteNetlink(table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD)
    netlink.learn_link(nl.LinkMessage(index=2, name="eth0", flags=nl.IFF_UP))
    group = netlink.found_of(multipath_message(V6, RTPROT_AGENTD, [HOP2, HOP3]))
    want = Route(V6, kind="blackhole")
    # Filed as our route (HOP2) and a next hop to delete (HOP3): the blackhole goes in beside
    # them, HOP2 goes after it, HOP3 by its gateway as any stray.
    state = RouteState()
    state.set_desired([want])
    state.kernel, state.strays = adopt([group], state.desired)
    plan = full_plan(state)
    assert plan.adds == plan.replaces == [] and [w for w, _old in plan.besides] == [want]
    assert deletes_sent(netlink, [*plan.deletes, *plan.besides[0][1]]) == [(HOP2, 2, RTPROT_AGENTD, 1024),
                                                                            (HOP3, 2, RTPROT_AGENTD, 1024)]
    # Both next hops strays (our route for V6 filed at another metric): the blackhole is no
    # replace of them but goes in beside them, and they are deleted after it.
    state = RouteState()
    state.set_desired([want])
    key = stray_of(want)
    state.kernel, state.strays = {}, {key._replace(gateway=gw, dev="eth0") for gw in (HOP2, HOP3)}
    plan = full_plan(state)
    assert (plan.adds, plan.replaces, plan.deletes) == ([], [], [])
    assert [w for w, _old in plan.besides] == [want]
    assert deletes_sent(netlink, plan.besides[0][1]) == [(HOP2, 2, RTPROT_AGENTD, 1024), (HOP3, 2, RTPROT_AGENTD, 1024)]


def test_our_ipv6_next_hop_at_a_second_metric_goes_by_its_gateway():
    # Our route moved to metric 100; at the old metric our old next hop (HOP4) still has
    # another daemon's (HOP3) appended.  The old one is filed as a stray of a second metric:
    # deleted by its gateway, or the delete would take the whole multipath route, HOP3 too.
    netlink = RouteNetlink(table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD)
    netlink.learn_link(nl.LinkMessage(index=2, name="eth0", flags=nl.IFF_UP))
    single = route_message(Route(V6, gateway=HOP2, dev="eth0", metric=100), RTPROT_AGENTD)
    group = multipath_message(V6, RTPROT_AGENTD, [HOP4, HOP3])
    for desired_metric, order in ((100, (single, group)), (100, (group, single)), (None, (group, single))):
        want = Route(V6, gateway=HOP2, dev="eth0", metric=desired_metric)
        messages = order if desired_metric == 100 else (group._replace(priority=100), single._replace(priority=1024))
        state = RouteState()
        state.set_desired([want])
        state.kernel, state.strays = adopt([netlink.found_of(m) for m in messages], state.desired)
        assert state.kernel == {V6: want}
        plan = full_plan(state)
        assert (plan.adds, plan.replaces) == ([], [])
        old = 1024 if desired_metric == 100 else 100
        assert deletes_sent(netlink, plan.deletes) == [(HOP3, 2, RTPROT_AGENTD, old), (HOP4, 2, RTPROT_AGENTD, old)]
    # Our route changing metric: the old next hop is deleted by its gateway too.
    state = RouteState()
    old = Route(V6, gateway=HOP2, dev="eth0")
    state.kernel = {V6: old}
    new = Route(V6, gateway=HOP2, dev="eth0", metric=100)
    state.set_desired([new])
    plan = full_plan(state)
    assert (plan.adds, plan.deletes) == ([new], [old])
    state.installed([new], [])
    assert deletes_sent(netlink, list(state.strays)) == [(HOP2, 2, RTPROT_AGENTD, 1024)]
    state.deleted(plan.deletes, [])
    assert state.kernel == {V6: new} and state.strays == set()


def test_another_protocols_ipv6_multipath_route_deleted_whole_takes_our_next_hop_with_it():
    # `ip -6 route del V6 proto static` (BIRD's nl_delete_rte) names no gateway: the kernel
    # deletes every next hop of the multipath route, ours appended to theirs too, and says so
    # in one RTM_DELROUTE with their protocol and RTA_MULTIPATH [theirs, ours].  Our route is
    # gone: it is restored, not kept in the kernel view until the next full resync.
    def delroute(gateways: list[str], protocol: int = nl.RTPROT_STATIC) -> bytes:
        msg = multipath_message(V6, protocol, gateways)
        attrs = (nl.attr(nl.RTA_MULTIPATH, msg.multipath) + nl.attr_u32(nl.RTA_PRIORITY, 1024)
                 + nl.attr_u32(nl.RTA_TABLE, nl.RT_TABLE_MAIN))
        template = nl.RouteTemplate(socket.AF_INET6, nl.RT_TABLE_MAIN, protocol, 0, nl.RTN_UNICAST, 0, 0, attrs)
        return nl.encode_route(nl.RTM_DELROUTE, 0, 0, msg.dst, 64, template)

    for theirs, gone in (([HOP3, HOP2], True), ([HOP3, HOP4], False)):
        prog = RouteProgrammer()
        prog.netlink.learn_link(nl.LinkMessage(index=2, name="eth0", flags=nl.IFF_UP))
        want = Route(V6, gateway=HOP2, dev="eth0")
        state = prog.state
        state.set_desired([want])
        state.take_work(state.needs_full(True))
        state.kernel = {V6: want}
        buf = delroute(theirs)
        prog._on_event(nl.RTM_DELROUTE, 0, buf, nl.NLMSG_HDRLEN, len(buf))
        if gone:
            assert state.kernel == {} and state.restoring == {V6} and state.has_work()
            plan = state.plan(*state.take_work(state.needs_full(False)))
            assert plan.adds == [want]
        else:  # their multipath route without our next hop: ours stays
            assert state.kernel == {V6: want} and state.restoring == set()


def test_an_undecodable_ipv6_multipath_route_of_ours_is_never_deleted_whole_and_ours_is_checked(caplog):
    # RTA_MULTIPATH that does not decode (its last rtnexthop cut short): which next hops it
    # holds nobody can say.  A delete of the whole would take every one, our desired next hop
    # (which the state would still hold) and another daemon's: nothing is deleted, the route of
    # ours it may hold is checked again (restored), and the dst is logged once.
    netlink = RouteNetlink(table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD)
    netlink.learn_link(nl.LinkMessage(index=2, name="eth0", flags=nl.IFF_UP))
    good = multipath_message(V6, RTPROT_AGENTD, [HOP4, HOP2])
    bad = good._replace(multipath=good.multipath[:-3])
    want = Route(V6, gateway=HOP2, dev="eth0")
    caplog.set_level("INFO", logger="agentd.routing")
    for event in ("added", "removed"):
        state = RouteState()
        state.set_desired([want])
        state.take_work(state.needs_full(True))
        state.kernel = {V6: want}
        found = netlink.found_of(bad)
        getattr(state, f"own_route_{event}")(found)
        assert V6 not in state.kernel and state.restoring == {V6}
        plan = state.plan(*state.take_work(state.needs_full(False)))
        assert (plan.adds, plan.deletes) == ([want], [])
    # A full re-read files nothing for it: the desired route is added (EEXIST then shows whose
    # route holds the key), nothing deleted.
    state = RouteState()
    state.set_desired([want])
    state.kernel, state.strays = adopt([netlink.found_of(bad)], state.desired)
    assert (state.kernel, state.strays) == ({}, set())
    plan = full_plan(state)
    assert (plan.adds, plan.deletes) == ([want], [])
    errors = [r.getMessage() for r in caplog.records if "RTA_MULTIPATH" in r.getMessage()]
    assert len(errors) == 1 and V6 in errors[0]


def test_another_daemons_next_hop_whose_delete_met_esrch_is_not_deleted_again():
    # Another daemon's next hop (HOP3) appended to ours: the first full resync cannot tell it
    # from ours and deletes it by gateway, which the kernel refuses (ESRCH: not our protocol).
    # Later resyncs leave it alone while it keeps appearing, and it is no stray: upserts of its
    # dst need no re-read of the kernel.
    netlink = RouteNetlink(table=nl.RT_TABLE_MAIN, protocol=RTPROT_AGENTD)
    netlink.learn_link(nl.LinkMessage(index=2, name="eth0", flags=nl.IFF_UP))
    want = Route(V6, gateway=HOP2, dev="eth0")
    state = RouteState()
    state.set_desired([want])
    dump = [netlink.found_of(multipath_message(V6, RTPROT_AGENTD, [HOP2, HOP3]))]
    state.kernel, state.strays = adopt(dump, state.desired, state.foreign_hops)
    plan = full_plan(state)
    assert deletes_sent(netlink, plan.deletes) == [(HOP3, 2, RTPROT_AGENTD, 1024)]
    state.gone(plan.deletes)  # ESRCH
    assert state.strays == set()
    for _resync in range(2):
        state.kernel, state.strays = adopt(dump, state.desired, state.foreign_hops)
        assert state.strays == set()
        assert full_plan(state) == ([], [], [], [], [])
    state.upsert(Route(V6, gateway=HOP2, dev="eth0", mtu=1400))
    assert not state.full_pending
    state.set_desired([want])
    assert not state.full_pending
    # Reported by the monitor again (a next hop appended to the route): still left alone.
    state.own_route_added(netlink.found_of(multipath_message(V6, RTPROT_AGENTD, [HOP2, HOP3, HOP4])))
    assert [s.gateway for s in state.strays] == [HOP4]
    # Gone from the kernel: forgotten, so a next hop of ours by that gateway later is deleted.
    state.kernel, state.strays = adopt([netlink.found_of(route_message(want, RTPROT_AGENTD)._replace(priority=1024))],
                                       state.desired, state.foreign_hops)
    assert state.foreign_hops == set()
    state.kernel, state.strays = adopt(dump, state.desired, state.foreign_hops)
    assert [s.gateway for s in state.strays] == [HOP3]
    # Another protocol's route for the dst deleted (their next hop, maybe): forgotten too.
    state.gone(list(state.strays))
    assert state.foreign_hops and not state.strays
    state.other_route_removed(V6)
    assert state.foreign_hops == set()


def test_only_a_link_our_routes_use_makes_the_kernel_be_re_read():
    # IPv4 flushes a dead link's routes silently: a link one of ours goes out of must re-read
    # the kernel; a pod's veth going away (pod churn) must not re-read every route.
    state = adopted(Route(A.dst, gateway="192.0.2.2", dev="eth0"), B, C)
    state.link_gone(17, "veth1a2b")
    assert state.has_work()
    assert not state.needs_full(False)
    assert not state.has_work()  # looked at once
    state.link_gone(2, None, "eth0")
    assert state.needs_full(False)
    state.link_gone(9)  # a link we knew no name of: routes on it say "if#9"
    assert not state.needs_full(False)
    state.kernel["10.0.9.0/24"] = Route("10.0.9.0/24", dev="if#9")
    state.link_gone(9)
    assert state.needs_full(False)
    # A gateway route we installed without a device: the kernel chose one, which we learn
    # at the next re-read; until then any link may be its.
    state.installed([Route("10.0.8.0/24", gateway="192.0.2.2")], [])
    state.link_gone(18, "veth3c4d")
    assert state.needs_full(False)
    # Another's IPv4 route in our way may have been flushed with its link: retried.
    state = adopted(B)
    state.record([], [("10.0.3.0/24", "in the way"), ("2001:db8:3::/64", "in the way")])
    state.link_gone(19, "veth5e6f")
    assert not state.needs_full(False)
    assert state.take_work(False).dsts == {"10.0.3.0/24"}
