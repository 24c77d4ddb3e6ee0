"""Two or more sans-IO speakers against each other in memory, with a float clock.

No sockets, no sleeps, no mocks: MemoryNetwork delivers the bytes each speaker
writes to the other and advances time to the next timer.
"""

from ipaddress import IPv4Address

import pytest

from bgp import Origination, PeerSettings, State
from bgp.testing import MemoryNetwork, make_speaker
from bgp.testing import speaker_pair as pair
from proto.errors import ErrorCode
from proto.messages import MessageReader, Notification, MessageType
from proto.nlri import IPV4_UNICAST, IPV6_UNICAST, prefix_from_str, prefix_to_str


def origin(*texts):
    out = []
    for t in texts:
        afi, p = prefix_from_str(t)
        out.append(Origination((afi, 1), p))
    return out


def table(sp, family=IPV4_UNICAST):
    """prefix -> next hop of the speaker's Loc-RIB best paths."""
    return {prefix_to_str(family[0], p): str(path.next_hop) for p, path in sp.rib.bests(family)}


def peer_state(sp, addr):
    return sp.peers[addr].state


def test_ibgp_session_establishes_and_stays_up_on_keepalives():
    net, a, b = pair(hold_time=9)
    net.run(duration=1)
    assert peer_state(a, "10.0.0.2") is State.ESTABLISHED
    assert peer_state(b, "10.0.0.1") is State.ESTABLISHED
    neg = a.peers["10.0.0.2"].session.negotiated
    assert neg.hold_time == 9 and neg.keepalive_time == 3 and neg.ibgp
    assert neg.families == {IPV4_UNICAST, IPV6_UNICAST}
    assert neg.ctx.four_octet_as
    net.run(duration=3600)  # an hour of simulated time: keepalives keep it up
    assert a.peers["10.0.0.2"].established_count == 1
    assert peer_state(a, "10.0.0.2") is State.ESTABLISHED


def test_hold_time_is_the_smaller_and_zero_disables_keepalives():
    net = MemoryNetwork()
    a = net.add("10.0.0.1", make_speaker("10.0.0.1", 65000, [("10.0.0.2", 65000)], hold_time=30))
    b = net.add("10.0.0.2", make_speaker("10.0.0.2", 65000, [("10.0.0.1", 65000)], hold_time=0))
    a.start(0)
    b.start(0)
    net.run(duration=1)
    assert a.peers["10.0.0.2"].session.negotiated.hold_time == 0
    sent = net.bytes_sent
    net.run(duration=10_000)
    assert net.bytes_sent == sent  # no KEEPALIVEs at all with hold time 0
    assert peer_state(a, "10.0.0.2") is State.ESTABLISHED


def test_routes_propagate_and_withdraw_in_ibgp_mesh():
    addrs = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    net = MemoryNetwork()
    sps = {}
    for me in addrs:
        sps[me] = net.add(me, make_speaker(me, 65000, [(o, 65000) for o in addrs if o != me]))
        sps[me].start(0)
    net.run(duration=1)
    sps["10.0.0.1"].set_originated(origin("10.244.1.0/24"), net.now)
    sps["10.0.0.2"].set_originated(origin("10.244.2.0/24"), net.now)
    net.run(duration=1)
    assert table(sps["10.0.0.3"]) == {"10.244.1.0/24": "10.0.0.1", "10.244.2.0/24": "10.0.0.2"}
    assert table(sps["10.0.0.1"])["10.244.2.0/24"] == "10.0.0.2"
    sps["10.0.0.1"].set_originated([], net.now)
    net.run(duration=1)
    for me in ("10.0.0.2", "10.0.0.3"):
        assert "10.244.1.0/24" not in table(sps[me])


def test_ibgp_split_horizon_without_reflection():
    # A - B - C in a line (A and C not peered): B must not pass A's route to C (RFC 4271 §9.2).
    net = MemoryNetwork()
    a = net.add("10.0.0.1", make_speaker("10.0.0.1", 65000, [("10.0.0.2", 65000)]))
    b = net.add("10.0.0.2", make_speaker("10.0.0.2", 65000, [("10.0.0.1", 65000), ("10.0.0.3", 65000)]))
    c = net.add("10.0.0.3", make_speaker("10.0.0.3", 65000, [("10.0.0.2", 65000)]))
    for s in (a, b, c):
        s.start(0)
    net.run(duration=1)
    a.set_originated(origin("10.244.1.0/24"), net.now)
    net.run(duration=1)
    assert "10.244.1.0/24" in table(b)
    assert table(c) == {}


def test_route_reflector_sets_originator_id_and_cluster_list():
    net = MemoryNetwork()
    rr = net.add(
        "10.0.0.1",
        make_speaker(
            "10.0.0.1",
            65000,
            [PeerSettings("10.0.0.2", 65000, rr_client=True), PeerSettings("10.0.0.3", 65000, rr_client=True)],
            cluster_id=IPv4Address("1.1.1.1"),
        ),
    )
    b = net.add("10.0.0.2", make_speaker("10.0.0.2", 65000, [("10.0.0.1", 65000)]))
    c = net.add("10.0.0.3", make_speaker("10.0.0.3", 65000, [("10.0.0.1", 65000)]))
    for s in (rr, b, c):
        s.start(0)
    net.run(duration=1)
    b.set_originated(origin("10.244.2.0/24"), net.now)
    net.run(duration=1)
    _, p = prefix_from_str("10.244.2.0/24")
    path = c.rib.best(IPV4_UNICAST, p)
    assert path is not None
    assert str(path.next_hop) == "10.0.0.2"  # reflection leaves the next hop alone
    assert path.attributes.originator_id == IPv4Address("10.0.0.2")
    assert path.attributes.cluster_list == (IPv4Address("1.1.1.1"),)
    # The client that originated it does not get it back (RFC 4456 §8).
    assert b.rib.candidates(IPV4_UNICAST, p)[0].source.local
    assert len(b.rib.candidates(IPV4_UNICAST, p)) == 1


def test_reflector_ignores_routes_carrying_its_own_cluster_id():
    net = MemoryNetwork()
    cl = IPv4Address("9.9.9.9")
    r1 = net.add("10.0.0.1", make_speaker("10.0.0.1", 65000, [PeerSettings("10.0.0.2", 65000), PeerSettings("10.0.0.3", 65000, rr_client=True)], cluster_id=cl))
    r2 = net.add("10.0.0.2", make_speaker("10.0.0.2", 65000, [PeerSettings("10.0.0.1", 65000), PeerSettings("10.0.0.3", 65000, rr_client=True)], cluster_id=cl))
    c = net.add("10.0.0.3", make_speaker("10.0.0.3", 65000, [("10.0.0.1", 65000), ("10.0.0.2", 65000)]))
    for s in (r1, r2, c):
        s.start(0)
    net.run(duration=1)
    c.set_originated(origin("10.244.3.0/24"), net.now)
    net.run(duration=1)
    _, p = prefix_from_str("10.244.3.0/24")
    # Each reflector has the client's route directly, and drops the copy reflected by the other
    # (same cluster id in CLUSTER_LIST).
    for r in (r1, r2):
        cands = r.rib.candidates(IPV4_UNICAST, p)
        assert [x.source.key for x in cands] == ["10.0.0.3"]


def test_ebgp_prepends_as_and_sets_next_hop_self_with_four_octet_asns():
    net, a, b = pair(asn_a=4200000001, asn_b=65001)
    net.run(duration=1)
    assert not a.peers["10.0.0.2"].session.negotiated.ibgp
    a.set_originated(origin("192.0.2.0/24"), net.now)
    net.run(duration=1)
    _, p = prefix_from_str("192.0.2.0/24")
    path = b.rib.best(IPV4_UNICAST, p)
    assert str(path.next_hop) == "10.0.0.1"
    assert path.attributes.as_path.asns() == (4200000001,)
    assert path.attributes.local_pref is None


def test_ebgp_loop_is_dropped():
    net, a, b = pair(asn_a=65001, asn_b=65002)
    net.run(duration=1)
    a.set_originated(origin("192.0.2.0/24"), net.now)
    net.run(duration=1)
    # b does not send it back to a: a's only candidate is its own.
    _, p = prefix_from_str("192.0.2.0/24")
    assert [x.source.key for x in a.rib.candidates(IPV4_UNICAST, p)] == ["local"]


def test_peer_as_mismatch_is_refused_with_notification_and_backs_off():
    net = MemoryNetwork()
    a = net.add("10.0.0.1", make_speaker("10.0.0.1", 65000, [("10.0.0.2", 65099)]))
    b = net.add("10.0.0.2", make_speaker("10.0.0.2", 65000, [("10.0.0.1", 65000)]))
    a.start(0)
    b.start(0)
    net.run(duration=60)
    assert peer_state(a, "10.0.0.2") is not State.ESTABLISHED
    assert "2/2" in a.peers["10.0.0.2"].last_error or "Bad Peer AS" in a.peers["10.0.0.2"].last_error
    # Exponential backoff: within 60 s, a handful of attempts (1, 2, 4, 8, 16, 30 s apart),
    # not one per second: each attempt sends one OPEN and one NOTIFICATION.
    assert a.peers["10.0.0.2"].session.messages_out <= 2 * 8


def test_connect_failures_back_off_exponentially():
    net = MemoryNetwork()
    a = net.add("10.0.0.1", make_speaker("10.0.0.1", 65000, [("10.0.0.9", 65000)], backoff_initial=1, backoff_max=16))
    a.start(0)
    net.run(duration=120)
    times = [float(t.split()[0]) for t in net.trace if "connect failed" in t]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps[0] < 1.01 and gaps[3] > 4 * 0.74
    assert max(gaps) <= 16.0 and max(gaps) > 11.9  # capped at backoff_max (with jitter)


def test_simultaneous_start_ends_with_one_connection():
    net, a, b = pair()
    net.run(duration=5)
    pa, pb = a.peers["10.0.0.2"], b.peers["10.0.0.1"]
    assert pa.state is State.ESTABLISHED and pb.state is State.ESTABLISHED
    assert not pa.collisions and not pb.collisions
    assert len(net.links) == 2  # one TCP connection, seen from both ends
    assert pa.session.outbound != pb.session.outbound


def _open_from(asn, router_id):
    from proto.capabilities import MultiProtocol
    from proto.messages import Open

    return Open.build(asn, 90, IPv4Address(router_id), [MultiProtocol(1, 1)]).encode()


@pytest.mark.parametrize(
    "local_id, remote_id, survivor",
    [
        # RFC 4271 §6.8: keep the connection initiated by the speaker with the higher BGP Identifier.
        ("10.0.0.1", "10.0.0.2", "inbound"),
        ("10.0.0.3", "10.0.0.2", "outbound"),
    ],
)
def test_connection_collision_is_resolved_by_router_id(local_id, remote_id, survivor):
    from bgp.peer import Peer
    from bgp.session import Close, Connect
    from bgp.settings import LocalSettings
    import itertools

    local = LocalSettings(asn=65000, router_id=IPv4Address(local_id))
    peer = Peer(local, PeerSettings("10.0.0.2", 65000), conn_ids=itertools.count(1), now=0.0)
    peer.start(0.0)
    (connect,) = peer.take_actions()
    assert isinstance(connect, Connect)
    peer.connection_made(connect.conn, 0.0, "10.0.0.1")  # our connection is up: OpenSent
    assert peer.accept(-1, 0.0, "10.0.0.1")  # and theirs arrives too: a second FSM
    assert len(peer.collisions) == 1
    peer.take_actions()
    peer.data_received(connect.conn, _open_from(65000, remote_id), 0.1)  # OpenConfirm on ours...
    peer.data_received(-1, _open_from(65000, remote_id), 0.2)  # ...then their OPEN on the other
    closed = [a.conn for a in peer.take_actions() if isinstance(a, Close)]
    loser = connect.conn if survivor == "inbound" else -1
    winner = -1 if survivor == "inbound" else connect.conn
    assert closed == [loser]
    assert peer.session.conn == winner
    from proto.messages import Keepalive

    peer.data_received(winner, Keepalive().encode(), 0.3)
    assert peer.state is State.ESTABLISHED
    assert not peer.collisions


def test_hold_timer_drops_a_frozen_peer_and_withdraws_its_routes():
    net, a, b = pair(hold_time=9, graceful_restart=True)
    net.run(duration=1)
    b.set_originated(origin("10.244.2.0/24"), net.now)
    net.run(duration=1)
    assert "10.244.2.0/24" in table(a)
    net.freeze("10.0.0.2")  # SIGSTOP: no keepalives, no FIN
    dt = net.run_until(lambda: peer_state(a, "10.0.0.2") is not State.ESTABLISHED, timeout=30, step=0.1)
    assert 8.0 < dt <= 9.2
    assert "hold timer expired" in a.peers["10.0.0.2"].last_error
    # Hold timer expiry sends a NOTIFICATION, so no graceful restart: the routes go at once.
    assert table(a) == {}


def _capture_notifications(net):
    seen = []

    def tamper(src, dst, data):
        r = MessageReader()
        r.feed(data)
        while (m := r.next_message()) is not None:
            if m[0] == MessageType.NOTIFICATION:
                seen.append((src, Notification.decode(m[1], None)))
        return data

    net.tamper = tamper
    return seen


def test_graceful_restart_keeps_routes_until_end_of_rib():
    net, a, b = pair(restart_time=120)
    net.run(duration=1)
    b.set_originated(origin("10.244.2.0/24", "10.244.22.0/24"), net.now)
    net.run(duration=1)
    assert set(table(a)) == {"10.244.2.0/24", "10.244.22.0/24"}
    changes = []
    a.add_listener(changes.extend)
    net.crash("10.0.0.2")  # process killed: TCP reset, no NOTIFICATION
    net.run(duration=5)
    # Routes kept (stale), and nothing was withdrawn toward the agent.
    assert set(table(a)) == {"10.244.2.0/24", "10.244.22.0/24"}
    assert all(path.stale for _, path in a.rib.bests(IPV4_UNICAST))
    assert not [c for c in changes if c.new is None]
    # The restarted speaker comes back announcing only one of the two prefixes.
    b2 = make_speaker("10.0.0.2", 65000, [("10.0.0.1", 65000)], now=net.now, restarting=True)
    net.replace("10.0.0.2", b2)
    b2.set_originated(origin("10.244.2.0/24"), net.now)
    b2.start(net.now)
    net.run(duration=10)
    assert peer_state(a, "10.0.0.2") is State.ESTABLISHED
    # End-of-RIB arrived: the refreshed prefix is fresh, the forgotten one is gone.
    assert table(a) == {"10.244.2.0/24": "10.0.0.2"}
    assert not any(path.stale for _, path in a.rib.bests(IPV4_UNICAST))
    assert [prefix_to_str(1, c.prefix) for c in changes if c.new is None] == ["10.244.22.0/24"]


def test_graceful_restart_gives_up_after_restart_time():
    net, a, b = pair(restart_time=30)
    net.run(duration=1)
    b.set_originated(origin("10.244.2.0/24"), net.now)
    net.run(duration=1)
    net.crash("10.0.0.2")
    net.run(duration=29)
    assert "10.244.2.0/24" in table(a)
    net.run(duration=2)
    assert table(a) == {}


def test_administrative_shutdown_withdraws_at_once():
    net, a, b = pair()
    net.run(duration=1)
    seen = _capture_notifications(net)
    b.set_originated(origin("10.244.2.0/24"), net.now)
    net.run(duration=1)
    b.stop(net.now, graceful=False)
    net.run(duration=1)
    assert table(a) == {}
    assert seen and seen[0][1].code == ErrorCode.CEASE and seen[0][1].subcode == 2


def test_graceful_stop_closes_without_notification_and_peer_keeps_routes():
    net, a, b = pair()
    net.run(duration=1)
    seen = _capture_notifications(net)
    b.set_originated(origin("10.244.2.0/24"), net.now)
    net.run(duration=1)
    b.stop(net.now, graceful=True)
    net.run(duration=1)
    assert not seen
    assert "10.244.2.0/24" in table(a)


def test_end_of_rib_is_sent_and_recognised():
    net, a, b = pair()
    assert a.initial_sync_pending() == []
    net.run(duration=1)
    assert a.initial_sync_pending() == [] and b.initial_sync_pending() == []
    assert a.channels.eor_received("10.0.0.2") == {IPV4_UNICAST, IPV6_UNICAST}


def test_ipv6_routes_use_mp_reach_and_mapped_next_hop():
    net, a, b = pair(asn_a=65001, asn_b=65002)
    net.run(duration=1)
    a.set_originated(origin("2001:db8:1::/48"), net.now)
    net.run(duration=1)
    assert table(b, IPV6_UNICAST) == {"2001:db8:1::/48": "::ffff:a00:1"}


def test_families_follow_capabilities():
    net = MemoryNetwork()
    a = net.add("10.0.0.1", make_speaker("10.0.0.1", 65000, [("10.0.0.2", 65000)]))
    b = net.add("10.0.0.2", make_speaker("10.0.0.2", 65000, [("10.0.0.1", 65000)], families=(IPV4_UNICAST,)))
    a.start(0)
    b.start(0)
    net.run(duration=1)
    a.set_originated(origin("10.244.1.0/24", "2001:db8::/32"), net.now)
    net.run(duration=1)
    assert table(b) == {"10.244.1.0/24": "10.0.0.1"}
    assert table(b, IPV6_UNICAST) == {}


def test_many_prefixes_are_packed_into_few_updates():
    net, a, b = pair()
    net.run(duration=1)
    prefixes = [f"10.{i // 256}.{i % 256}.0/24" for i in range(10_000)]
    sent_before = a.peers["10.0.0.2"].session.updates_out
    a.set_originated(origin(*prefixes), net.now)
    net.run(duration=1)
    assert len(table(b)) == 10_000
    n = a.peers["10.0.0.2"].session.updates_out - sent_before
    # 10,000 /24s at 4 bytes each in 4096-byte UPDATEs with ~30 bytes of attributes: ~10 messages.
    assert n <= 12


def test_route_refresh_resends_the_table():
    net, a, b = pair()
    net.run(duration=1)
    a.set_originated(origin("10.244.1.0/24"), net.now)
    net.run(duration=1)
    before = a.peers["10.0.0.2"].session.updates_out
    from proto.messages import RouteRefresh

    net.inject("10.0.0.2", "10.0.0.1", RouteRefresh(1, 1).encode())
    net.run(duration=1)
    assert a.peers["10.0.0.2"].session.updates_out == before + 1
    # RFC 7313 §5: other subtypes are ignored (BoRR and EoRR too: no Enhanced Route Refresh here).
    for subtype in (1, 2, 3, 255):
        net.inject("10.0.0.2", "10.0.0.1", RouteRefresh(1, 1, subtype).encode())
        net.run(duration=2)
    assert a.peers["10.0.0.2"].session.updates_out == before + 1
    assert peer_state(a, "10.0.0.2") is State.ESTABLISHED


def test_malformed_update_resets_the_session_with_the_rfc_notification():
    net, a, b = pair()
    net.run(duration=1)
    seen = _capture_notifications(net)
    # An UPDATE whose withdrawn-routes length overruns the message: RFC 4271 §6.3 3/1.
    bad = b"\xff" * 16 + (19 + 6).to_bytes(2, "big") + b"\x02" + b"\x00\x10" + b"\x00\x00\x00\x00"
    net.inject("10.0.0.2", "10.0.0.1", bad)
    net.run(duration=0.5)
    assert seen and seen[0][0] == "10.0.0.1"
    assert (seen[0][1].code, seen[0][1].subcode) == (3, 1)
    net.run(duration=60)
    assert peer_state(a, "10.0.0.2") is State.ESTABLISHED  # and it comes back by itself


def test_removing_a_peer_sends_cease_and_withdraws_its_routes():
    net, a, b = pair()
    net.run(duration=1)
    b.set_originated(origin("10.244.2.0/24"), net.now)
    net.run(duration=1)
    seen = _capture_notifications(net)
    a.remove_peer("10.0.0.2", net.now)
    net.run(duration=1)
    assert table(a) == {}
    assert seen[0][1].code == ErrorCode.CEASE and seen[0][1].subcode == 3


@pytest.mark.parametrize("forwarding", [True, False])
def test_forwarding_state_bit_decides_whether_stale_routes_survive_the_return(forwarding):
    # RFC 4724 §4.2: a returning peer whose OPEN has F=0 for a family gets its stale routes
    # flushed at once; with F=1 they stay until its End-of-RIB.
    net, a, b = pair(restart_time=120)
    net.run(duration=1)
    b.set_originated(origin("10.244.2.0/24"), net.now)
    net.run(duration=1)
    changes = []
    a.add_listener(changes.extend)
    net.crash("10.0.0.2")
    net.run(duration=2)
    b2 = make_speaker("10.0.0.2", 65000, [("10.0.0.1", 65000)], now=net.now, forwarding_preserved=forwarding)
    net.replace("10.0.0.2", b2)
    b2.set_originated(origin("10.244.2.0/24"), net.now)
    b2.start(net.now)
    net.run(duration=5)
    assert table(a) == {"10.244.2.0/24": "10.0.0.2"}
    withdrawn = [c for c in changes if c.new is None]
    assert (withdrawn == []) is forwarding


def test_a_new_description_for_a_peer_keeps_its_session_and_routes():
    """A reload that only edits a peer's description (BIRD's and GoBGP's take it over in place)
    closed the session with Cease/6 and withdrew everything learned from the peer."""
    net, a, b = pair()
    b.set_originated(origin("10.244.2.0/24"), 0)
    net.run(duration=2)
    pa = a.peers["10.0.0.2"]
    assert pa.established_count == 1 and a.rib.count() == 1
    a.set_peers([PeerSettings(address="10.0.0.2", asn=65000, description="tor-1 rack 7")], net.now)
    assert a.peers["10.0.0.2"] is pa and pa.settings.description == "tor-1 rack 7"
    net.run(duration=5)
    assert pa.established_count == 1 and pa.state.label == "Established" and a.rib.count() == 1
