"""Inbound connections from a configured peer, sans-IO with a float clock: the two connection
slots a peer has (RFC 4271 §6.8), the silent connections that must not hold them, the reason
a refused connection is given, and sessions that come up and end within one read.

A speaker (10.0.0.1, AS 65000) has a passive eBGP neighbour A (10.0.0.9, AS 65001) whose
connections are driven by hand (bgp.testing.RawPeer): a test opens them, sends whatever
bytes it likes on them, or lets them sit silent.
"""

from __future__ import annotations

import itertools
import logging
import random
import struct
from ipaddress import IPv4Address, IPv4Network

import pytest

from bgp import ListenRange, PeerSettings, Speaker, State
from bgp.peer import Peer
from bgp.session import Close, Connect
from bgp.settings import LocalSettings
from bgp.testing import RawHarness, RawPeer
from bgp.views import peer_views
from proto.errors import CeaseSubcode, ErrorCode
from proto.messages import Keepalive, Notification
from proto.nlri import IPV4_UNICAST, prefix_from_str

LOCAL, A = "10.0.0.1", "10.0.0.9"
_conns = itertools.count(-100, -1)


def harness(**peer) -> tuple[Speaker, RawHarness]:
    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address(LOCAL)), now=0.0, rng=random.Random(1))
    sp.add_peer(PeerSettings(A, 65001, passive=True, **peer), 0.0)
    sp.start(0.0)
    return sp, RawHarness(sp, LOCAL)


def raw(address: str = A, **kw) -> RawPeer:
    return RawPeer(address, 65001, conn=next(_conns), **kw)


def view(sp: Speaker):
    return next(v for v in peer_views(sp) if v.address == A)


def told_collision(peer: RawPeer) -> bool:
    """``peer`` was closed with Cease/Connection Collision Resolution."""
    n = peer.notifications()
    return peer.closed and bool(n) and (n[-1].code, n[-1].subcode) == (
        ErrorCode.CEASE, CeaseSubcode.CONNECTION_COLLISION_RESOLUTION)  # fmt: skip


def update(prefix: str) -> bytes:
    origin = bytes((0x40, 1, 1, 0))
    as_path = bytes((0x40, 2, 6, 2, 1)) + (65001).to_bytes(4, "big")
    next_hop = bytes((0x40, 3, 4)) + IPv4Address(A).packed
    attrs = origin + as_path + next_hop
    body = struct.pack("!HH", 0, len(attrs)) + attrs + prefix_from_str(prefix)[1]
    return b"\xff" * 16 + struct.pack("!HB", 19 + len(body), 2) + body


# ---------------------------------------------------------------- silent connections and the two slots


def test_two_silent_connections_do_not_lock_the_peer_out(caplog):
    sp, h = harness()
    first, second = raw(), raw()
    assert h.open(first)
    h.advance(10.0)
    assert h.open(second)
    h.advance(10.0)
    # Both slots hold a connection on which A said nothing.  A well-behaved third one gets in:
    # it takes the place of the oldest silent one, which is told why.
    good = raw(hold_time=0)
    with caplog.at_level(logging.INFO, logger="bgp"):
        admission = h.open(good)
    assert admission, admission.reason
    assert admission.displaced == "an inbound connection on which it had sent nothing for 20s"
    assert told_collision(first) and not second.closed
    assert f"peer {A}: a new connection takes the place of {admission.displaced}" in caplog.text
    assert sp.counters["silent connections displaced"] == 1
    h.send(good, good.open_message() + Keepalive().encode())
    assert sp.peers[A].state is State.ESTABLISHED and sp.peers[A].session.conn == good.conn
    # The other silent one ends at its OpenSent hold time (RFC 4271 §8.2.2); the session stays.
    h.advance(240.0)
    assert second.closed and second.notifications()[-1].code == ErrorCode.HOLD_TIMER_EXPIRED
    assert not good.closed and sp.peers[A].state is State.ESTABLISHED


def test_silent_connections_never_displace_one_that_is_exchanging_opens():
    sp, h = harness()
    good = raw(hold_time=0)
    assert h.open(good)
    h.send(good, good.open_message())
    assert sp.peers[A].state is State.OPEN_CONFIRM
    silent = []
    for _ in range(20):  # a stream of silent connections: each new one displaces the last
        s = raw()
        assert h.open(s)
        silent.append(s)
        h.advance(1.0)
    assert all(told_collision(s) for s in silent[:-1]) and not silent[-1].closed
    assert not good.closed
    h.send(good, Keepalive().encode())
    assert sp.peers[A].state is State.ESTABLISHED and sp.peers[A].session.conn == good.conn


def test_a_silent_connection_of_ours_is_displaced_like_one_of_theirs():
    local = LocalSettings(asn=65000, router_id=IPv4Address(LOCAL))
    peer = Peer(local, PeerSettings(A, 65001), conn_ids=itertools.count(1), now=0.0)
    peer.start(0.0)
    (connect,) = peer.take_actions()
    assert isinstance(connect, Connect)
    peer.connection_made(connect.conn, 0.0, LOCAL)  # ours is up: OpenSent, and A says nothing on it
    assert peer.accept(-1, 1.0, LOCAL)  # theirs arrives too: the second slot (RFC 4271 §6.8)
    peer.take_actions()
    admission = peer.accept(-2, 5.0, LOCAL)
    assert admission and admission.displaced == "an outbound connection on which it had sent nothing for 5s"
    assert [a.conn for a in peer.take_actions() if isinstance(a, Close)] == [connect.conn]
    assert {s.conn for s in peer.sessions()} == {-1, -2}


def test_a_third_connection_is_refused_while_two_have_spoken_and_says_so():
    sp, h = harness()
    one, two = raw(), raw()
    assert h.open(one) and h.open(two)
    h.send(one, one.open_message())  # OpenConfirm
    h.send(two, two.open_message()[:10])  # the start of an OPEN: not silent any more
    third = raw()
    admission = h.open(third)
    assert not admission and third.closed
    assert admission.reason == "two connections from this peer are already exchanging OPENs (RFC 4271 §6.8)"
    assert not one.closed and not two.closed


def test_refused_connections_say_why():
    sp, h = harness(max_prefixes=1, max_prefixes_restart=30)
    assert h.open(raw("10.0.0.77")).reason == "not a configured peer"
    sp.set_listen_ranges([ListenRange(IPv4Network("10.1.0.0/16"), PeerSettings("10.1.0.0", 65001))], h.now)
    assert h.open(raw("10.0.0.77")).reason == "not a configured peer nor in a listen range"
    # Held down after max-prefix (RFC 4486 Cease/1) until the restart interval is over.
    a = raw()
    assert h.connect(a)
    h.send(a, update("10.50.0.0/24") + update("10.51.0.0/24"))
    assert a.closed
    h.advance(10.0)
    refused = h.open(raw())
    assert not refused and refused.reason.startswith("the peer is held down after maximum prefixes"), refused
    assert refused.reason.endswith("for 20s more"), refused
    sp.stop(h.now, graceful=False)
    assert h.open(raw()).reason == "the peer is not enabled (the speaker is not running)"


# ---------------------------------------------------------------- a session that comes and goes in one read


MALFORMED_UPDATE = b"\xff" * 16 + struct.pack("!HB", 23, 2) + struct.pack("!HH", 0, 5)  # attributes overrun


@pytest.mark.parametrize(
    "ending, error",
    [
        # A's NOTIFICATION (and an UPDATE before it, whose route must not stay).
        (update("10.60.0.0/24") + Notification(ErrorCode.CEASE, CeaseSubcode.ADMINISTRATIVE_SHUTDOWN).encode(),
         "received NOTIFICATION Cease/Administrative Shutdown"),
        # A malformed UPDATE: we end it (RFC 4271 §6.3).
        (MALFORMED_UPDATE, "sent NOTIFICATION UPDATE Message Error"),
    ],
    ids=["their-notification", "our-notification"],
)
@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside-a-silent-connection"])
def test_a_session_that_comes_up_and_ends_in_one_read_is_logged_and_counted(caplog, ending, error, beside):
    sp, h = harness()
    if beside:
        silent = raw()
        assert h.open(silent)
    assert view(sp).flaps == 0
    a = raw()
    assert h.open(a)
    h.advance(5.0)
    with caplog.at_level(logging.INFO, logger="bgp"):
        h.send(a, a.open_message() + Keepalive().encode() + ending)
    assert a.closed
    v = view(sp)
    assert v.flaps == 1 and v.since == 5.0 and v.state != "Established", v
    assert v.last_error.startswith(error), v.last_error
    assert f"peer {A} established" in caplog.text
    assert f"peer {A} down ({error}" in caplog.text
    assert sp.rib.best(IPV4_UNICAST, prefix_from_str("10.60.0.0/24")[1]) is None
    assert A not in sp.rib.adj_in or not len(sp.rib.adj_in[A])
    # Nothing of it is left holding a slot: the next connection comes up as usual -- after a
    # session that ended right after it came up on an error, once the restart delay is over
    # (RFC 4271 §8.1.1 DampPeerOscillations, its connections refused meanwhile); at once after
    # A's Administrative Shutdown, or beside another connection (which goes on).
    good = raw(hold_time=0)
    if not beside and ending is MALFORMED_UPDATE:
        refused = h.open(good)
        assert not refused and "held down" in refused.reason, refused
        h.advance(sp.local.backoff_initial)
        good = raw(hold_time=0)
    assert h.connect(good)
    assert sp.peers[A].state is State.ESTABLISHED and view(sp).flaps == 1
