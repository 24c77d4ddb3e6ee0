"""A graceful-restart peer that comes back on a new connection while we still hold the old
one Established (RFC 4724 §4.2): the old session goes, its routes are kept as stale, and the
peer's End-of-RIB on the new session flushes the ones it no longer announces -- whether its
OPEN and first KEEPALIVE come in separate reads or in one.  A second connection is taken so
when graceful restart was agreed both ways on the old session, whatever the new OPEN's Restart
State bit (as BIRD: a peer that rebooted with no routes to keep sends R=0); without that, an
OPEN on a second connection is a collision with an Established session (RFC 4271 §6.8), the
new connection closed with Cease/7.  Sans-IO, float clock."""

from __future__ import annotations

import itertools
import random
import struct
from ipaddress import IPv4Address

import pytest

from bgp import PeerSettings, Speaker, State
from bgp.peer import Peer, PeerDown, PeerUp
from bgp.session import Close, Connect, Send
from bgp.settings import LocalSettings
from bgp.testing import RawHarness, RawPeer
from proto.capabilities import (
    GracefulRestart,
    GracefulRestartFamily,
    MultiProtocol,
    RouteRefresh,
)
from proto.messages import Keepalive, Open
from proto.nlri import IPV4_UNICAST, prefix_from_str

# update: an UPDATE from A (AS 65001) of one prefix
from .test_connections import A, told_collision, update

LOCAL = "10.0.0.1"


class GracefulPeer(RawPeer):
    """A raw peer whose OPEN carries Graceful Restart for IPv4 and IPv6 unicast, forwarding
    state kept (F) -- and the R bit once it is back from a restart."""

    def __init__(self, conn: int, restarted: bool = False) -> None:
        super().__init__(A, 65001, conn=conn)
        self.restarted = restarted

    def open_message(self) -> bytes:
        gr = GracefulRestart(self.restarted, 120, tuple(GracefulRestartFamily(a, s, True) for a, s in self.families))
        caps = [MultiProtocol(a, s) for a, s in self.families] + [RouteRefresh(), gr]
        return Open.build(self.asn, self.hold_time, self.router_id, caps).encode()


def end_of_rib(*families: int) -> bytes:
    """End-of-RIB for IPv4 unicast (an empty UPDATE) and IPv6 unicast (an empty MP_UNREACH),
    or for the AFIs named (4, 6)."""
    v4 = struct.pack("!HH", 0, 0)
    mp = bytes((0x80, 15, 3)) + struct.pack("!HB", 2, 1)
    v6 = struct.pack("!HH", 0, len(mp)) + mp
    bodies = {4: v4, 6: v6}
    return b"".join(b"\xff" * 16 + struct.pack("!HB", 19 + len(bodies[f]), 2) + bodies[f] for f in (families or (4, 6)))


def held(sp: Speaker, prefix: str) -> bool:
    return sp.rib.best(IPV4_UNICAST, prefix_from_str(prefix)[1]) is not None


def connected(*, local_gr: bool = True, peer_gr: bool = True) -> tuple[Speaker, RawHarness, RawPeer]:
    """A speaker with peer A connected to it (its first connection): graceful (``peer_gr``) or
    not; the speaker offering graceful restart (``local_gr``) or not."""
    local = LocalSettings(asn=65000, router_id=IPv4Address(LOCAL), graceful_restart=local_gr)
    sp = Speaker(local, now=0.0, rng=random.Random(1))
    sp.add_peer(PeerSettings(A, 65001, passive=True), 0.0)
    sp.start(0.0)
    h = RawHarness(sp, LOCAL)
    before = GracefulPeer(conn=-1) if peer_gr else RawPeer(A, 65001, conn=-1)
    assert h.connect(before)
    return sp, h, before


@pytest.mark.parametrize("restarted", [True, False])
@pytest.mark.parametrize("one_read", [False, True])
def test_a_peer_back_from_a_restart_on_a_new_connection_has_its_stale_routes_flushed(one_read, restarted):
    """With or without the Restart State bit: a peer that rebooted (no FIN on the old connection)
    with no routes to keep -- an agentd that adopted none, a helper-only router -- sends R=0,
    and is let in at once (not refused with Cease/7 until our hold timer expires)."""
    sp, h, before = connected()
    h.send(before, update("10.244.1.0/24") + update("10.244.9.0/24"))
    assert held(sp, "10.244.1.0/24") and held(sp, "10.244.9.0/24")

    h.advance(1.0)
    after = GracefulPeer(conn=-2, restarted=restarted)  # the old connection is not closed: the peer just came back
    assert h.open(after)
    if one_read:
        h.send(after, after.open_message() + Keepalive().encode())
    else:
        h.send(after, after.open_message())
        h.send(after, Keepalive().encode())
    assert before.closed and not after.closed and not told_collision(after)
    assert not before.notifications()  # closed without NOTIFICATION
    assert sp.peers[A].session.state is State.ESTABLISHED
    assert A in sp.graceful, "the old session's routes were not kept as stale"
    assert held(sp, "10.244.1.0/24") and held(sp, "10.244.9.0/24")
    h.send(after, update("10.244.1.0/24") + end_of_rib())
    h.advance(1.0)
    assert held(sp, "10.244.1.0/24")
    assert not held(sp, "10.244.9.0/24"), "a route the restarted peer no longer announces outlived its End-of-RIB"
    assert A not in sp.graceful


def test_an_ipv4_end_of_rib_leaves_the_stale_ipv6_routes_until_the_ipv6_one():
    """RFC 4724 4.2: each family's stale routes go with that family's End-of-RIB, not with the
    first to come."""
    from proto.nlri import IPV6_UNICAST

    from .test_ipv6_family import _v6_update

    def held6(prefix: str) -> bool:
        return sp.rib.best(IPV6_UNICAST, prefix_from_str(prefix)[1]) is not None

    sp, h, before = connected()
    h.send(before, _v6_update(["fd00:9::/64"]) + update("10.244.9.0/24"))
    h.advance(1.0)
    assert held6("fd00:9::/64") and held(sp, "10.244.9.0/24")
    after = GracefulPeer(conn=-2, restarted=True)
    assert h.open(after)
    h.send(after, after.open_message() + Keepalive().encode())
    h.send(after, end_of_rib(4))
    h.advance(1.0)
    assert not held(sp, "10.244.9.0/24")
    assert held6("fd00:9::/64"), "the IPv4 End-of-RIB swept the stale IPv6 routes"
    h.send(after, end_of_rib(6))
    h.advance(1.0)
    assert not held6("fd00:9::/64")


def test_a_peer_back_without_an_end_of_rib_has_its_stale_routes_purged_after_stale_time():
    """RFC 4724 §4.2: the peer returns but never sends End-of-RIB: our stale timer (stale_time)
    ends the wait -- its routes not announced again go, and the other peers are told."""
    from proto.nlri import prefix_to_str

    b = "10.0.0.10"
    keepalive = Keepalive().encode()

    def held_by(peer: RawPeer) -> set[str]:
        out: set[str] = set()
        for u in peer.updates():
            out.difference_update(prefix_to_str(1, p) for p in u.withdrawn)
            out.update(prefix_to_str(1, p) for p in u.nlri)
        return out

    def wait(seconds: int, *peers: RawPeer) -> None:  # keeping the sessions up (hold time 90 s)
        for _ in range(seconds):
            h.advance(1.0)
            for p in peers:
                h.send(p, keepalive)

    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address(LOCAL), stale_time=30.0), now=0.0, rng=random.Random(1))
    sp.add_peer(PeerSettings(A, 65001, passive=True), 0.0)
    sp.add_peer(PeerSettings(b, 65002, passive=True), 0.0)
    sp.start(0.0)
    h = RawHarness(sp, LOCAL)
    other = RawPeer(b, 65002, conn=-10)
    assert h.connect(other)
    before = GracefulPeer(conn=-1)
    assert h.connect(before)
    h.send(before, update("10.244.1.0/24") + update("10.244.9.0/24"))
    assert held_by(other) == {"10.244.1.0/24", "10.244.9.0/24"}

    sp.connection_lost(before.conn, h.now)  # gracefully: its routes stay, stale
    before.closed = True
    h.pump()
    assert sp.rib.stale_count(A) == 2
    wait(10, other)
    after = GracefulPeer(conn=-2, restarted=True)
    assert h.connect(after)
    h.send(after, update("10.244.1.0/24"))  # ... and never an End-of-RIB
    assert sp.rib.stale_count(A) == 1
    wait(29, other, after)
    assert held(sp, "10.244.9.0/24") and held_by(other) == {"10.244.1.0/24", "10.244.9.0/24"}
    wait(2, other, after)
    assert sp.rib.stale_count(A) == 0
    assert not held(sp, "10.244.9.0/24"), "a stale route outlived stale_time without End-of-RIB"
    assert held(sp, "10.244.1.0/24")
    assert not other.closed and not after.closed
    assert held_by(other) == {"10.244.1.0/24"}
    assert A not in sp.graceful


# ---------------------------------------------------------------- no restart: a collision with the Established session


@pytest.mark.parametrize(
    ("local_gr", "peer_gr", "restarted"),
    [
        (False, True, True),  # we do not offer graceful restart
        (True, False, True),  # the peer's OPEN on the Established session had none
        (False, True, False),
        (True, False, False),
    ],
)
def test_a_second_open_without_an_agreed_restart_is_a_collision_and_the_session_stays(local_gr, peer_gr, restarted):
    """RFC 4271 §6.8: a connection colliding with an Established one is closed (Cease/7).  The
    RFC 4724 §4.2 reading (the peer restarted: the old session goes) is for a peer that
    advertised graceful restart on that session to a speaker that did too -- the old session's
    end then keeps its routes stale; without it, it would withdraw them all."""
    sp, h, before = connected(local_gr=local_gr, peer_gr=peer_gr)
    h.send(before, update("10.244.1.0/24"))
    peer = sp.peers[A]
    old_conn = peer.session.conn
    h.advance(1.0)

    after = GracefulPeer(conn=-2, restarted=restarted)
    assert h.open(after)
    h.send(after, after.open_message() + Keepalive().encode())

    assert told_collision(after), "the new connection was not closed with Cease/7"
    assert not before.closed, "the Established session's connection was closed"
    assert not before.notifications()
    assert peer.session.conn == old_conn and peer.session.state is State.ESTABLISHED
    assert peer.established_count == 1
    assert A not in sp.graceful and held(sp, "10.244.1.0/24"), "the Established session's routes were touched"
    h.send(before, update("10.244.2.0/24"))  # ... and it still works
    assert held(sp, "10.244.2.0/24")


def test_a_late_open_of_a_simultaneous_connect_is_a_graceful_reconnect_and_withdraws_nothing():
    """Two graceful speakers connect to each other at once.  One connection comes up (b dumps
    its own, still unanswered, with Cease/7); b's OPEN on that connection reaches a only when a
    accepts it, late.  With graceful restart agreed on the Established session, a takes it for
    the peer's restart (as BIRD does at the accept): the good session goes, and the Cease/7
    behind the OPEN ends the new one.  Both sides' sessions end gracefully -- routes kept stale,
    none withdrawn -- and both are Established again after the connect retry."""
    la = LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1"))
    lb = LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.2"))
    a = Peer(la, PeerSettings("10.0.0.2", 65000), conn_ids=itertools.count(1), now=0.0, rng=random.Random(1))
    b = Peer(lb, PeerSettings("10.0.0.1", 65000), conn_ids=itertools.count(100), now=0.0, rng=random.Random(1))
    peers = {"a": a, "b": b}
    now = 0.0
    a.start(now)
    b.start(now)
    ca = next(x for x in a.take_actions() if isinstance(x, Connect)).conn
    cb = next(x for x in b.take_actions() if isinstance(x, Connect)).conn
    a.connection_made(ca, now)
    b.connection_made(cb, now)
    b.accept(1001, now)  # a's connection, as b sees it
    link = {("a", ca): ("b", 1001), ("b", 1001): ("a", ca), ("b", cb): ("a", 2001), ("a", 2001): ("b", cb)}
    accepted = {("a", ca), ("b", 1001), ("b", cb)}  # a accepts b's connection (2001) late
    inbound = itertools.count(3001)
    queue: list = []
    held_back: list = []
    events: list = []

    def collect(name: str) -> None:
        for x in peers[name].take_actions():
            if isinstance(x, (Send, Close)):
                queue.append((name, x))
            elif isinstance(x, Connect):  # the reconnect: accepted at once
                other = "b" if name == "a" else "a"
                far = next(inbound)
                link[(name, x.conn)], link[(other, far)] = (other, far), (name, x.conn)
                accepted.update({(name, x.conn), (other, far)})
                peers[name].connection_made(x.conn, now)
                assert peers[other].accept(far, now).accepted
                collect(other)
                collect(name)
        while (ev := peers[name].next_event()) is not None:
            events.append((name, ev))

    def deliver() -> None:
        while queue:
            name, x = queue.pop(0)
            dst = link.get((name, x.conn))
            if dst is None:
                continue
            if dst not in accepted:
                held_back.append((name, x))
                continue
            if isinstance(x, Send):
                peers[dst[0]].data_received(dst[1], x.data, now)
            else:
                del link[(name, x.conn)], link[dst]
                peers[dst[0]].connection_lost(dst[1], now)
            collect("a")
            collect("b")

    collect("a")
    collect("b")
    deliver()
    assert a.session.state is State.ESTABLISHED and b.session.state is State.ESTABLISHED
    assert held_back, "b's OPEN on its own connection was not held back"
    a.accept(2001, now)
    accepted.add(("a", 2001))
    collect("a")
    queue[:0] = held_back
    deliver()
    downs = [(name, ev) for name, ev in events if isinstance(ev, PeerDown)]
    assert sorted(name for name, _ in downs) == ["a", "b"]
    assert all(ev.graceful for _, ev in downs), "a session ended without graceful restart: its routes withdrawn"

    while not (a.session.state is State.ESTABLISHED and b.session.state is State.ESTABLISHED):
        now = min(t for t in (a.get_timer(), b.get_timer()) if t is not None)
        assert now < 10.0, "the two did not come back up after the connect retry"
        for name, p in peers.items():
            if (t := p.get_timer()) is not None and t <= now:
                p.handle_timer(now)
                collect(name)
        deliver()
    assert not a.collisions and not b.collisions
    assert [type(ev) for _, ev in events if isinstance(ev, (PeerUp, PeerDown))] == [PeerUp, PeerUp, PeerDown, PeerDown,
                                                                                    PeerUp, PeerUp]
    assert all(ev.graceful for _, ev in events if isinstance(ev, PeerDown))


# ---------------------------------------------------------------- RFC 4724 §4.2: the peer back after a TCP drop


def held6(sp: Speaker, prefix: str) -> bool:
    from proto.nlri import IPV6_UNICAST

    return sp.rib.best(IPV6_UNICAST, prefix_from_str(prefix)[1]) is not None


def dropped(sp: Speaker, h: RawHarness, peer: RawPeer) -> None:
    """The peer's connection ends without a NOTIFICATION (it restarted)."""
    sp.connection_lost(peer.conn, h.now)
    peer.closed = True
    h.pump()


class IPv4OnlyNow(GracefulPeer):
    """Back from its restart negotiating IPv4 unicast only (no Multiprotocol capability for
    IPv6), while its Graceful Restart capability still lists IPv6 with its forwarding state."""

    def open_message(self) -> bytes:
        gr = GracefulRestart(True, 120, tuple(GracefulRestartFamily(a, s, True) for a, s in self.families))
        caps = [MultiProtocol(*IPV4_UNICAST), RouteRefresh(), gr]
        return Open.build(self.asn, self.hold_time, self.router_id, caps).encode()


def test_stale_routes_of_a_family_the_peer_no_longer_negotiates_go_when_it_is_back():
    """RFC 4724 §4.2: no End-of-RIB can come for a family not negotiated on the new session,
    so its stale routes go at once, not after stale_time."""
    from .test_ipv6_family import _v6_update

    sp, h, before = connected()
    h.send(before, _v6_update(["fd00:9::/64"]) + update("10.244.9.0/24"))
    dropped(sp, h, before)
    assert sp.rib.stale_count(A) == 2
    h.advance(10.0)
    after = IPv4OnlyNow(conn=-2, restarted=True)
    assert h.connect(after)
    assert sp.peers[A].session.state is State.ESTABLISHED
    assert not held6(sp, "fd00:9::/64"), "stale IPv6 routes kept for a session that does not carry IPv6"
    assert held(sp, "10.244.9.0/24") and sp.rib.stale_count(A) == 1  # IPv4: until its End-of-RIB
    h.send(after, end_of_rib(4))
    assert not held(sp, "10.244.9.0/24") and A not in sp.graceful


def test_once_the_peer_is_back_its_restart_time_no_longer_flushes_the_stale_routes():
    """The restart time (120 s, from its capability) bounds only its coming back; once back, the
    stale routes wait for End-of-RIB or our stale_time (360 s), counted from its return."""
    sp, h, before = connected()
    h.send(before, update("10.244.9.0/24"))
    dropped(sp, h, before)  # at t = 0
    h.advance(10.0)
    after = GracefulPeer(conn=-2, restarted=True)
    assert h.connect(after)  # back at t = 10, and no End-of-RIB
    while h.now < 130.0:  # past went_away + restart time; its KEEPALIVEs keep the session up
        h.advance(10.0)
        h.send(after, Keepalive().encode())
    assert held(sp, "10.244.9.0/24") and sp.rib.stale_count(A) == 1, "flushed at the restart time once back"
    while h.now < 360.0:
        h.advance(10.0)
        h.send(after, Keepalive().encode())
    assert held(sp, "10.244.9.0/24")
    h.advance(11.0)  # t = 371: stale_time after its return
    assert not held(sp, "10.244.9.0/24") and A not in sp.graceful
    assert sp.peers[A].session.state is State.ESTABLISHED


def test_without_our_own_graceful_restart_a_graceful_peer_that_drops_has_its_routes_withdrawn():
    """Helper behaviour is for a speaker that offers graceful restart: with it turned off, a
    peer's Graceful Restart capability keeps nothing (RFC 4724 §4.2 needs it both ways)."""
    sp, h, before = connected(local_gr=False)
    h.send(before, update("10.244.9.0/24"))
    events = []
    peer = sp.peers[A]
    next_event = peer.next_event

    def spy():
        ev = next_event()
        events.append(ev)
        return ev

    peer.next_event = spy  # type: ignore[method-assign]
    dropped(sp, h, before)
    (down,) = [e for e in events if isinstance(e, PeerDown)]
    assert down.peer_graceful_restart is not None and not down.graceful
    assert not held(sp, "10.244.9.0/24") and A not in sp.graceful and sp.rib.stale_count(A) == 0
