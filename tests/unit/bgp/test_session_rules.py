"""What a session does with messages that come out of turn or out of bounds, and the timers and
connections around it, sans-IO with a float clock.

- Messages the FSM does not expect in its state (RFC 4271 §8.2.2) end the session with a
  NOTIFICATION Finite State Machine Error whose subcode names the state (RFC 6608 §4).
- An over-long ROUTE-REFRESH is answered with 7/1 (RFC 7313 §5), its data cut to fit.
- The hold timer runs in OpenConfirm, the negotiated one (RFC 4271 §8.2.2); ROUTE-REFRESH
  restarts it like any message; an UPDATE sent restarts our KeepaliveTimer (§10).
- The restart backoff starts over once a session stayed up for backoff_max, not when a
  session ends right after it came up (RFC 4271 §8.1.1 DampPeerOscillations); an inbound connection that wins
  in Connect closes the connection we were making (§8.2.2, Connect state).

A speaker (10.0.0.1, AS 65000) with a passive eBGP neighbour A (10.0.0.9, AS 65001) driven
by hand (bgp.testing.RawPeer), or a bare Peer (iBGP neighbour 10.0.0.2) whose connections the
test makes and feeds.
"""

from __future__ import annotations

import itertools
import random
from ipaddress import IPv4Address, IPv6Address

import pytest

from bgp import PeerSettings, Speaker, State
from bgp.peer import Peer, PeerDown, PeerUp
from bgp.session import Close, Connect, Send
from bgp.settings import LocalSettings
from bgp.testing import RawHarness, RawPeer
from proto.capabilities import GracefulRestart, GracefulRestartFamily
from proto.errors import CeaseSubcode, ErrorCode, UpdateSubcode
from proto.messages import (
    MARKER,
    Keepalive,
    MessageReader,
    MessageType,
    Notification,
    Open,
    RouteRefresh,
)
from proto.nlri import IPV4_UNICAST, IPV6_UNICAST

LOCAL, A, REMOTE = "10.0.0.1", "10.0.0.9", "10.0.0.2"
_conns = itertools.count(-100, -1)

# An UPDATE of A's: 10.60.0.0/24, ORIGIN IGP, AS_PATH 65001, NEXT_HOP A.
UPDATE = (
    MARKER + (19 + 4 + 20 + 4).to_bytes(2, "big") + b"\x02" + b"\x00\x00\x00\x14"
    + b"\x40\x01\x01\x00" + b"\x40\x02\x06\x02\x01" + (65001).to_bytes(4, "big")
    + b"\x40\x03\x04" + IPv4Address(A).packed + b"\x18\x0a\x3c\x00"
)  # fmt: skip


def harness() -> tuple[Speaker, RawHarness]:
    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address(LOCAL)), now=0.0, rng=random.Random(1))
    sp.add_peer(PeerSettings(A, 65001, passive=True), 0.0)
    sp.start(0.0)
    return sp, RawHarness(sp, LOCAL)


def raw(**kw) -> RawPeer:
    return RawPeer(A, 65001, conn=next(_conns), **kw)


def last_notification(peer: RawPeer) -> tuple[int, int]:
    n = peer.notifications()
    assert n, "no NOTIFICATION was sent"
    return n[-1].code, n[-1].subcode


# ---------------------------------------------------------------- RFC 4271 §8.2.2 / RFC 6608


def _keepalive_before_open(h: RawHarness, a: RawPeer) -> None:
    assert h.open(a)
    h.send(a, Keepalive().encode())


def _update_between_open_and_keepalive(h: RawHarness, a: RawPeer) -> None:
    assert h.open(a)
    h.send(a, a.open_message())
    assert h.speaker.peers[A].state is State.OPEN_CONFIRM
    h.send(a, UPDATE)


def _open_again_in_open_confirm(h: RawHarness, a: RawPeer) -> None:
    assert h.open(a)
    h.send(a, a.open_message() + a.open_message())


def _open_again_once_established(h: RawHarness, a: RawPeer) -> None:
    assert h.connect(a)
    assert h.speaker.peers[A].state is State.ESTABLISHED
    h.send(a, a.open_message())


def _route_refresh_in_open_confirm(h: RawHarness, a: RawPeer) -> None:
    assert h.open(a)
    h.send(a, a.open_message() + RouteRefresh(1, 1).encode())


@pytest.mark.parametrize(
    "provoke, subcode, unexpected",
    [
        (_keepalive_before_open, 1, "KEEPALIVE_MSG in OpenSent"),
        (_update_between_open_and_keepalive, 2, "UPDATE_MSG in OpenConfirm"),
        (_open_again_in_open_confirm, 2, "BGP_OPEN in OpenConfirm"),
        (_route_refresh_in_open_confirm, 2, "ROUTE_REFRESH_MSG in OpenConfirm"),
        (_open_again_once_established, 3, "BGP_OPEN in Established"),
    ],
    ids=["keepalive-in-open-sent", "update-in-open-confirm", "open-in-open-confirm", "route-refresh-in-open-confirm",
         "open-in-established"],
)  # fmt: skip
def test_a_message_out_of_turn_is_an_fsm_error_naming_the_state(provoke, subcode, unexpected):
    sp, h = harness()
    a = raw()
    provoke(h, a)
    assert last_notification(a) == (ErrorCode.FSM, subcode)
    assert a.closed
    p = sp.peers[A]
    assert p.state is not State.ESTABLISHED and p.session.conn is None
    assert p.last_error == f"unexpected {unexpected}", p.last_error
    assert not sp.counters["internal errors"]
    # The UPDATE (in OpenConfirm) was not taken.
    assert A not in sp.rib.adj_in or not len(sp.rib.adj_in[A])


# ---------------------------------------------------------------- RFC 7606 §3 j, §4


def _update_message(attrs: bytes, nlri: bytes = b"") -> bytes:
    body = b"\x00\x00" + len(attrs).to_bytes(2, "big") + attrs + nlri
    return MARKER + (19 + len(body)).to_bytes(2, "big") + b"\x02" + body


V6_PREFIX = b"\x40\x20\x01\x0d\xb8\x00\x01\x00\x00"  # 2001:db8:1::/64
V6_NEXT_HOP = IPv6Address("2001:db8::9").packed
A_ORIGIN_PATH = b"\x40\x01\x01\x00" + b"\x40\x02\x06\x02\x01" + (65001).to_bytes(4, "big")
MP_REACH = b"\x80\x0e\x1e" + b"\x00\x02\x01\x10" + V6_NEXT_HOP + b"\x00" + V6_PREFIX
MP_UNREACH = b"\x80\x0f\x0c" + b"\x00\x02\x01" + V6_PREFIX


@pytest.mark.parametrize("hidden", [MP_REACH, MP_UNREACH], ids=["mp-reach", "mp-unreach"])
def test_a_framing_error_that_may_hide_an_mp_attribute_resets_the_session_and_no_route_stays(hidden):
    # A COMMUNITIES whose length runs one octet past the path attributes, over an
    # MP_REACH_NLRI (new attributes for 2001:db8:1::/64) or an MP_UNREACH_NLRI (its
    # withdrawal), beside an IPv4 route in the NLRI field.  Treat-as-withdraw would withdraw
    # the IPv4 route and leave the IPv6 one as it was, silently: the session is reset instead
    # (RFC 7606 §3 j), 3/1, and with it go A's routes.
    sp, h = harness()
    a = raw()
    assert h.connect(a)
    med = b"\x80\x04\x04" + (5).to_bytes(4, "big")
    h.send(a, _update_message(A_ORIGIN_PATH + med + MP_REACH))
    h.send(a, UPDATE)  # 10.60.0.0/24
    assert sp.rib.adj_in[A].count(IPV6_UNICAST) == 1 and sp.rib.adj_in[A].count(IPV4_UNICAST) == 1
    bad = A_ORIGIN_PATH + b"\x40\x03\x04" + IPv4Address(A).packed + bytes((0xC0, 8, len(hidden) + 1)) + hidden
    h.send(a, _update_message(bad, b"\x18\x0a\x3c\x00"))
    assert a.closed
    assert last_notification(a) == (ErrorCode.UPDATE_MESSAGE, UpdateSubcode.MALFORMED_ATTRIBUTE_LIST)
    assert sp.peers[A].state is not State.ESTABLISHED
    assert not list(sp.rib.bests(IPV6_UNICAST)) and not list(sp.rib.bests(IPV4_UNICAST))
    assert not sp.counters["internal errors"]


# ---------------------------------------------------------------- RFC 7313 §5


def test_an_over_long_route_refresh_is_answered_with_7_1_cut_to_fit():
    sp, h = harness()
    a = raw()
    assert h.connect(a)
    body = b"\x00\x01\x00\x01" + bytes(4073)  # a ROUTE-REFRESH of 4,096 octets
    msg = MARKER + (19 + len(body)).to_bytes(2, "big") + bytes((MessageType.ROUTE_REFRESH,)) + body
    h.send(a, msg)
    assert a.closed
    (n,) = a.notifications()
    assert (n.code, n.subcode) == (ErrorCode.ROUTE_REFRESH, 1)
    # The data is the message, as much of it as fits in a 4,096-octet NOTIFICATION.
    assert n.data == msg[: 4096 - 21]
    assert not sp.counters["internal errors"]
    assert sp.peers[A].last_error.startswith("sent NOTIFICATION ROUTE-REFRESH"), sp.peers[A].last_error


# ---------------------------------------------------------------- hold timer in OpenConfirm


def test_a_peer_silent_after_its_open_is_dropped_when_the_negotiated_hold_time_expires():
    sp, h = harness()
    a = raw(hold_time=30)  # we offer 90: 30 is negotiated
    assert h.open(a)
    h.advance(10.0)
    h.send(a, a.open_message())
    assert sp.peers[A].state is State.OPEN_CONFIRM
    h.advance(29.9)  # our KEEPALIVEs go out meanwhile; the peer says nothing more
    assert not a.closed and sp.peers[A].state is State.OPEN_CONFIRM
    h.advance(0.2)
    assert a.closed and last_notification(a) == (ErrorCode.HOLD_TIMER_EXPIRED, 0)
    assert sp.peers[A].last_error == "hold timer expired"
    # The slot is free again.
    good = raw()
    assert h.connect(good) and sp.peers[A].state is State.ESTABLISHED


# ---------------------------------------------------------------- a bare Peer


def local() -> LocalSettings:
    return LocalSettings(asn=65000, router_id=IPv4Address(LOCAL))


def bare_peer(**settings) -> Peer:
    p = Peer(local(), PeerSettings(REMOTE, 65000, **settings), conn_ids=itertools.count(1), now=0.0,
             rng=random.Random(3))  # fmt: skip
    p.start(0.0)
    return p


def their_open(hold_time: int = 90, caps=()) -> bytes:
    return Open.build(65000, hold_time, IPv4Address(REMOTE), list(caps)).encode()


def connects(actions) -> list[Connect]:
    return [a for a in actions if isinstance(a, Connect)]


def sent_types(actions) -> list[int]:
    out = []
    for a in actions:
        if isinstance(a, Send):
            reader = MessageReader()
            reader.feed(a.data)
            out.extend(t for t, _ in reader.messages())
    return out


def establish(p: Peer, now: float) -> int:
    """Complete the pending outbound connection at ``now``; return its id."""
    (c,) = connects(p.take_actions())
    p.connection_made(c.conn, now)
    p.data_received(c.conn, their_open() + Keepalive().encode(), now)
    assert p.session.state is State.ESTABLISHED
    p.take_actions()
    return c.conn


def test_the_backoff_starts_over_once_a_session_came_up():
    p = bare_peer()
    now = 0.0
    gaps = []
    for _ in range(3):
        (c,) = connects(p.take_actions())
        p.connect_failed(c.conn, now)
        t = p.get_timer()
        gaps.append(t - now)
        now = t
        p.handle_timer(now)
    assert gaps[-1] > 2 * local().backoff_initial, gaps  # it did grow
    conn = establish(p, now)
    now += 100.0
    p.connection_lost(conn, now)
    assert p.session.state is State.IDLE
    # One failure after a session that came up: the first delay again, not the fourth.
    assert p.get_timer() - now <= local().backoff_initial


@pytest.mark.parametrize(
    "end",
    [
        pytest.param(lambda p, conn, now: p.data_received(conn, Notification(ErrorCode.UPDATE_MESSAGE, UpdateSubcode.MALFORMED_ATTRIBUTE_LIST).encode(), now),
                     id="their NOTIFICATION 3/1 after our first UPDATE"),
        pytest.param(lambda p, conn, now: p.data_received(conn, their_open(), now), id="our FSM error (an OPEN once Established)"),
        pytest.param(lambda p, conn, now: p.connection_lost(conn, now), id="they reset the connection"),
    ],
)  # fmt: skip
def test_sessions_that_end_right_after_coming_up_do_not_start_the_backoff_over(end):
    # RFC 4271 §8.1.1 DampPeerOscillations: a peer whose sessions end within a second of coming
    # up is not reconnected about once a second for ever (a PeerUp and a PeerDown each time).
    p = bare_peer()
    now = 0.0
    gaps = []
    for _ in range(6):
        conn = establish(p, now)
        now += 0.5
        end(p, conn, now)
        assert p.session.state is State.IDLE
        t = p.get_timer()
        gaps.append(t - now)
        now = t
        p.handle_timer(now)
    assert p.established_count == 6
    assert gaps[-1] > 4 * local().backoff_initial, gaps
    assert gaps[-1] <= local().backoff_max, gaps
    # One session that stays up as long as the longest wait: the first delay again.
    conn = establish(p, now)
    up_until = now + local().backoff_max + 1.0
    while (t := p.get_timer()) is not None and t <= up_until:  # our KEEPALIVEs (hold time 90 s)
        p.handle_timer(t)
    assert p.session.state is State.ESTABLISHED
    now = up_until
    end(p, conn, now)
    assert p.get_timer() - now <= local().backoff_initial


NOTE_3_1 = Notification(ErrorCode.UPDATE_MESSAGE, UpdateSubcode.MALFORMED_ATTRIBUTE_LIST).encode()


def stay_up(p: Peer, until: float) -> None:
    """Run the peer's timers (our KEEPALIVEs; hold time 90 s) up to ``until``."""
    while (t := p.get_timer()) is not None and t <= until:
        p.handle_timer(t)
        p.take_actions()
    assert p.session.state is State.ESTABLISHED


def test_only_a_session_up_for_backoff_max_starts_the_backoff_over():
    # The threshold is backoff_max itself: a session that dies a second sooner (a NOTIFICATION
    # after batch_delay, a BFD detect time, a short hold time) is still a failure each time.
    p = bare_peer()
    bmax = local().backoff_max
    now = 0.0
    gaps = []
    for _ in range(6):
        conn = establish(p, now)
        stay_up(p, now + bmax - 1.0)
        now += bmax - 1.0
        p.data_received(conn, NOTE_3_1, now)
        assert p.session.state is State.IDLE
        t = p.get_timer()
        gaps.append(t - now)
        now = t
        p.handle_timer(now)
    assert gaps[-1] > 4 * local().backoff_initial, gaps
    conn = establish(p, now)
    stay_up(p, now + bmax)
    now += bmax
    p.data_received(conn, NOTE_3_1, now)
    assert p.get_timer() - now <= local().backoff_initial


def test_a_peer_whose_sessions_end_right_after_coming_up_is_refused_until_the_delay_is_over():
    # RFC 4271 §8.1.1/§8.2.2: Idle refuses connections during the IdleHoldTimer.  A peer that
    # reconnects at once after each early end is not brought up again before our restart
    # delay is over: its sessions come no closer together than our own reconnects.
    p = bare_peer()
    inbound = itertools.count(-1, -1)
    now = 0.0
    gaps = []
    for _ in range(6):
        conn = next(inbound)
        assert p.accept(conn, now)
        p.data_received(conn, their_open() + Keepalive().encode(), now)
        assert p.session.state is State.ESTABLISHED
        now += 0.5
        p.data_received(conn, NOTE_3_1, now)
        assert p.session.state is State.IDLE
        p.take_actions()
        t = p.get_timer()
        gaps.append(t - now)
        # It reconnects at once, and again just before the delay is over: refused both times.
        for when in (now + 0.1, t - 0.01):
            refused = p.accept(next(inbound), when)
            assert not refused and "held down" in refused.reason, refused
        assert p.get_timer() == t and p.session.state is State.IDLE
        now = t
        p.handle_timer(now)  # our connect goes out; theirs, next, wins
    ups = 0
    while (ev := p.next_event()) is not None:
        ups += isinstance(ev, PeerUp)
    assert ups == 6
    assert gaps[-1] > 4 * local().backoff_initial, gaps


GR_CAP = GracefulRestart(False, 120, (GracefulRestartFamily(*IPV4_UNICAST, True),))


@pytest.mark.parametrize(
    "caps, end, graceful",
    [
        pytest.param([GR_CAP], lambda p, conn, now: p.connection_lost(conn, now), True, id="a graceful restart"),
        pytest.param([], lambda p, conn, now: p.data_received(conn, Notification(ErrorCode.CEASE, CeaseSubcode.CONNECTION_COLLISION_RESOLUTION).encode(), now),
                     False, id="their Cease/Connection Collision Resolution"),
        pytest.param([], lambda p, conn, now: p.data_received(conn, Notification(ErrorCode.CEASE, CeaseSubcode.ADMINISTRATIVE_SHUTDOWN).encode(), now),
                     False, id="their Cease/Administrative Shutdown"),
        pytest.param([], lambda p, conn, now: p.data_received(conn, Notification(ErrorCode.CEASE, CeaseSubcode.ADMINISTRATIVE_RESET).encode(), now),
                     False, id="their Cease/Administrative Reset"),
        pytest.param([], lambda p, conn, now: p.data_received(conn, Notification(ErrorCode.CEASE, CeaseSubcode.OTHER_CONFIGURATION_CHANGE).encode(), now),
                     False, id="their Cease/Other Configuration Change"),
    ],
)  # fmt: skip
def test_a_peer_restarting_gracefully_or_ending_on_purpose_may_reconnect_at_once(caps, end, graceful):
    # Its operator's reset or reconfiguration, a §6.8 collision, a graceful restart: no
    # oscillation to damp, and refused it would wait its own ConnectRetry (BIRD: 120 s).
    p = bare_peer()
    assert p.accept(-1, 0.0)
    p.data_received(-1, their_open(caps=caps) + Keepalive().encode(), 0.0)
    assert p.session.state is State.ESTABLISHED
    end(p, -1, 0.5)
    assert p.session.state is State.IDLE and p.get_timer() > 0.6
    events = []
    while (ev := p.next_event()) is not None:
        events.append(ev)
    assert isinstance(events[-1], PeerDown) and events[-1].graceful is graceful, events
    assert p.accept(-2, 0.6)
    p.data_received(-2, their_open(caps=caps) + Keepalive().encode(), 0.6)
    assert p.session.state is State.ESTABLISHED


def test_an_inbound_connection_in_connect_closes_the_one_we_were_making():
    p = bare_peer()
    (c,) = connects(p.take_actions())
    assert p.session.state is State.CONNECT
    assert p.accept(-1, 0.5)
    actions = p.take_actions()
    assert Close(c.conn) in actions
    assert p.session.conn == -1 and not p.session.connecting
    # Ours completing late is refused too.
    p.connection_made(c.conn, 0.6)
    assert Close(c.conn) in p.take_actions() and p.session.conn == -1


# ---------------------------------------------------------------- timers once Established


def test_a_route_refresh_restarts_the_hold_timer():
    p = bare_peer()
    conn = establish(p, 0.0)  # hold 90 from here
    p.data_received(conn, RouteRefresh(1, 1).encode(), 60.0)
    t = p.get_timer()
    while t is not None and t < 149.0:  # our KEEPALIVEs every 30 s
        p.handle_timer(t)
        t = p.get_timer()
    assert p.session.state is State.ESTABLISHED
    assert MessageType.NOTIFICATION not in sent_types(p.take_actions())
    p.handle_timer(150.0)
    assert p.session.state is State.IDLE and p.session.last_error == "hold timer expired"


def test_sending_an_update_restarts_our_keepalive_timer():
    p = bare_peer()
    establish(p, 0.0)  # keepalive every 30 s, less up to a quarter (RFC 4271 §10 jitter)
    first = p.get_timer()
    assert 22.5 <= first <= 30.0
    update = MARKER + b"\x00\x17\x02" + bytes(4)  # an empty UPDATE (End-of-RIB)
    p.send_messages([update], 20.0)
    assert sent_types(p.take_actions()) == [MessageType.UPDATE]
    # Restarted with the jitter it had: an UPDATE sent only ever moves it later.
    assert p.get_timer() == 20.0 + first
    p.handle_timer(20.0 + first)
    assert sent_types(p.take_actions()) == [MessageType.KEEPALIVE]


def test_keepalive_and_connect_retry_timers_are_jittered_and_the_hold_timer_is_not():
    # RFC 4271 §10: a uniform 0.75-1.0 of the time, drawn each time the timer starts, so that
    # sessions that came up together (a reflector or an agent restarted) do not stay in
    # lock-step; the hold timer is the peer's due and is never shortened.
    peers = [
        Peer(local(), PeerSettings(REMOTE, 65000), conn_ids=itertools.count(1), now=0.0, rng=random.Random(seed))
        for seed in range(8)
    ]  # fmt: skip
    retries, keepalives = [], []
    for p in peers:
        p.start(0.0)
        retries.append(p.get_timer())  # ConnectRetryTimer of the first attempt
        establish(p, 0.0)
        keepalives.append(p.get_timer())
    assert len(set(retries)) == len(peers) and all(3.75 <= t <= 5.0 for t in retries), retries
    assert len(set(keepalives)) == len(peers) and all(22.5 <= t <= 30.0 for t in keepalives), keepalives
    # Drawn again for each KEEPALIVE; the hold timer (90 s, nothing heard) exactly on time.
    p = peers[0]
    sent_at = []
    while p.session.state is State.ESTABLISHED:
        t = p.get_timer()
        p.handle_timer(t)
        if MessageType.KEEPALIVE in sent_types(p.take_actions()):
            sent_at.append(t)
    assert t == 90.0 and p.session.last_error == "hold timer expired"
    gaps = [b - a for a, b in zip([0.0, *sent_at], sent_at, strict=False)]
    assert len(set(gaps)) == len(gaps) and all(22.5 <= g <= 30.0 for g in gaps), gaps
