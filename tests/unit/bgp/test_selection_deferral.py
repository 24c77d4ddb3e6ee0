"""RFC 4724 §4.1, the restarting speaker: back from a restart (``restarting``), it defers route
selection -- here, the End-of-RIB that tells a peer our table is whole -- until every graceful-
restart peer has sent its own End-of-RIB, or its restart time runs out.  A route reflector
that sent the first client back its partial table and End-of-RIB at once would have that
client flush the routes of every client not back yet.  Sans-IO, float clock."""

from __future__ import annotations

import struct
from ipaddress import IPv4Address, ip_network

from bgp import ListenRange, PeerSettings
from bgp.testing import MemoryNetwork, RawHarness, RawPeer, make_speaker
from proto.capabilities import (
    GracefulRestart,
    GracefulRestartFamily,
    MultiProtocol,
    RouteRefresh,
)
from proto.messages import MessageType, Open
from proto.nlri import IPV4_UNICAST, IPV6_UNICAST

RR, C1, C2, C3 = "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"


class Client(RawPeer):
    """An iBGP client whose OPEN offers graceful restart (``restarting``: with the R bit), or
    none (``graceful=False``)."""

    def __init__(self, address: str, conn: int, *, graceful: bool = True, restarting: bool = False) -> None:
        super().__init__(address, 65000, conn=conn, hold_time=0)  # no hold timer: the test lets minutes pass
        self.graceful, self.restarting = graceful, restarting

    def open_message(self) -> bytes:
        caps = [MultiProtocol(a, s) for a, s in self.families] + [RouteRefresh()]
        if self.graceful:
            caps.append(GracefulRestart(self.restarting, 120, tuple(GracefulRestartFamily(a, s, True)
                                                                    for a, s in self.families)))
        return Open.build(self.asn, self.hold_time, self.router_id, caps).encode()

    def end_of_ribs(self) -> set:
        return {u.end_of_rib for u in self.updates() if u.end_of_rib is not None}


def end_of_rib() -> bytes:
    mp = bytes((0x80, 15, 3)) + struct.pack("!HB", 2, 1)
    bodies = (struct.pack("!HH", 0, 0), struct.pack("!HH", 0, len(mp)) + mp)
    return b"".join(b"\xff" * 16 + struct.pack("!HB", 19 + len(b), 2) + b for b in bodies)


def reflector(*clients: str, restarting: bool = True) -> tuple:
    sp = make_speaker(RR, 65000, [PeerSettings(c, 65000, passive=True, rr_client=True) for c in clients],
                      cluster_id=IPv4Address(RR), restarting=restarting)
    sp.start(0.0)
    return sp, RawHarness(sp, RR)


BOTH = {IPV4_UNICAST, IPV6_UNICAST}


def first_client_back() -> tuple:
    """A restarted reflector of C1 and C2, C1 back and its End-of-RIB sent, C2 not back yet."""
    sp, h = reflector(C1, C2)
    c1 = Client(C1, -1)
    assert h.connect(c1)
    h.send(c1, end_of_rib())
    return sp, h, c1


def test_end_of_rib_waits_for_every_graceful_peers_end_of_rib():
    sp, h, c1 = first_client_back()
    h.advance(5.0)
    assert c1.end_of_ribs() == set() and sp.deferring and sp.deferral_pending() == [C2]
    c2 = Client(C2, -2)
    assert h.connect(c2)
    h.advance(1.0)
    assert c1.end_of_ribs() == set()  # c2 is back, but has not said its table is whole
    h.send(c2, end_of_rib())
    h.advance(1.0)
    assert c1.end_of_ribs() == BOTH and c2.end_of_ribs() == BOTH and not sp.deferring


def test_the_deferral_ends_with_the_restart_time():
    sp, h, c1 = first_client_back()
    h.advance(119.0)
    assert c1.end_of_ribs() == set()
    h.advance(2.0)  # restart_time (120 s) is up: c2 is not waited for any longer
    assert c1.end_of_ribs() == BOTH and not sp.deferring


def test_peers_without_graceful_restart_or_restarting_too_are_not_waited_for():
    sp, h = reflector(C1, C2, C3)
    c1, c2, c3 = Client(C1, -1), Client(C2, -2, graceful=False), Client(C3, -3, restarting=True)
    for c in (c2, c3, c1):
        assert h.connect(c)
    h.advance(1.0)
    assert sp.deferral_pending() == [C1] and c2.end_of_ribs() == set()
    h.send(c1, end_of_rib())
    h.advance(1.0)
    assert all(c.end_of_ribs() == BOTH for c in (c1, c2, c3))


def test_a_speaker_not_back_from_a_restart_sends_end_of_rib_at_once():
    sp, h = reflector(C1, C2, restarting=False)
    c1 = Client(C1, -1)
    assert h.connect(c1)
    h.advance(1.0)
    assert c1.end_of_ribs() == BOTH and not sp.deferring


def test_a_peer_removed_while_awaited_is_not_waited_for():
    sp, h, c1 = first_client_back()
    h.advance(1.0)
    assert c1.end_of_ribs() == set() and sp.deferral_pending() == [C2]
    sp.remove_peer(C2, h.now)
    h.advance(1.0)
    assert c1.end_of_ribs() == BOTH and not sp.deferring


def our_gr(c: RawPeer) -> GracefulRestart:
    """The Graceful Restart capability of the OPEN the speaker sent ``c``."""
    (body,) = [b for t, b in c.inbox if t == MessageType.OPEN]
    gr = Open.decode(body).capability(GracefulRestart)
    assert gr is not None
    return gr


def test_the_restart_state_bit_is_cleared_once_the_deferral_is_over():
    # RFC 4724 §3: R=1 says "I have just restarted".  Sessions opened while the restart is
    # under way carry it; once route selection is no longer deferred (End-of-RIB sent to every
    # peer) the restart is complete, and a session that comes up later says R=0 -- else a
    # peer that restarts later skips us in its own deferral and flushes what it has from us.
    sp, h, c1 = first_client_back()
    assert our_gr(c1).restart_state
    h.advance(121.0)  # the restart time is up: c2 is not waited for any longer
    assert not sp.deferring
    c2 = Client(C2, -2, restarting=True)  # c2 restarts, hours later
    h.advance(3600.0)
    assert h.connect(c2)
    gr = our_gr(c2)
    assert not gr.restart_state
    # F still says what our restart preserved (it does not follow R).
    assert all(f.forwarding_state for f in gr.families)
    assert sp.deferral_pending() == []


def test_a_peer_that_reconnects_long_after_our_restart_is_told_we_did_not_just_restart():
    # The reviewer's sequence: A restarts, B is up; A's deferral ends with B's End-of-RIB;
    # B restarts an hour later and must see A's OPEN without the R bit.
    net = MemoryNetwork()
    a = net.add("10.0.0.1", make_speaker("10.0.0.1", 65000, [("10.0.0.2", 65000)], restarting=True))
    b = net.add("10.0.0.2", make_speaker("10.0.0.2", 65000, [("10.0.0.1", 65000)]))
    a.start(0.0)
    b.start(0.0)
    net.run(duration=10)
    assert not a.deferring
    assert b.negotiated("10.0.0.1").peer_graceful_restart.restart_state  # opened during A's restart
    net.crash("10.0.0.2")
    net.run(duration=1)
    b2 = make_speaker("10.0.0.2", 65000, [("10.0.0.1", 65000)], now=net.now)
    net.replace("10.0.0.2", b2)
    b2.start(net.now)
    net.run(duration=3600)
    gr = b2.negotiated("10.0.0.1").peer_graceful_restart
    assert gr is not None and not gr.restart_state
    assert all(f.forwarding_state for f in gr.families)


# ---------------------------------------------------------------- the peer set not known yet


def test_the_deferral_does_not_end_before_the_owner_knows_its_peers():
    # The agent starts its speaker, then learns its peers from etcd.  With no peer configured
    # yet nobody is left to wait for -- which must not end the deferral: C1 (an external peer
    # of the configuration) is back with its End-of-RIB before the node registry adds C2.
    sp = make_speaker(RR, 65000, [PeerSettings(C1, 65000, passive=True, rr_client=True)],
                      cluster_id=IPv4Address(RR), restarting=True, peers_known=False)
    sp.start(0.0)
    h = RawHarness(sp, RR)
    c1 = Client(C1, -1)
    assert h.connect(c1)
    h.send(c1, end_of_rib())
    h.advance(5.0)
    assert sp.deferring and c1.end_of_ribs() == set()
    sp.set_peers([PeerSettings(c, 65000, passive=True, rr_client=True) for c in (C1, C2)], h.now)
    h.advance(1.0)
    assert sp.deferring and c1.end_of_ribs() == set()
    sp.peers_configured(h.now)  # the registry has been read: C2 is the one still awaited
    assert sp.deferring and sp.deferral_pending() == [C2]
    c2 = Client(C2, -2)
    assert h.connect(c2)
    h.send(c2, end_of_rib())
    h.advance(1.0)
    assert c1.end_of_ribs() == BOTH and c2.end_of_ribs() == BOTH and not sp.deferring


def test_a_speaker_started_with_no_peers_defers_until_told_or_its_time_is_up():
    sp = make_speaker(RR, 65000, cluster_id=IPv4Address(RR), restarting=True, peers_known=False)
    sp.start(0.0)
    h = RawHarness(sp, RR)
    h.advance(1.0)
    assert sp.deferring and sp.restart.restarting  # nobody to wait for is not "everybody sent End-of-RIB"
    h.advance(120.0)
    assert not sp.deferring and not sp.restart.restarting
    told = make_speaker(RR, 65000, cluster_id=IPv4Address(RR), restarting=True, peers_known=False)
    told.start(0.0)
    told.peers_configured(1.0)  # no peers after all: nothing to wait for
    assert not told.deferring


# ---------------------------------------------------------------- peers from listen ranges


RANGE = "10.0.0.0/24"


def dynamic_reflector() -> tuple:
    """A restarted reflector whose clients come from RANGE, its configuration applied."""
    sp = make_speaker(RR, 65000, cluster_id=IPv4Address(RR), restarting=True, peers_known=False)
    sp.start(0.0)
    template = PeerSettings(IPv4Address("10.0.0.0"), 65000, passive=True, rr_client=True)
    sp.set_listen_ranges([ListenRange(ip_network(RANGE), template)], 0.0)
    sp.peers_configured(0.0)
    return sp, RawHarness(sp, RR)


def test_a_reflector_with_listen_ranges_defers_until_its_time_is_up():
    # Which clients of a range were there before the restart, and which will come back, cannot
    # be known: the first one back must not get End-of-RIB with the others' routes missing.
    sp, h = dynamic_reflector()
    assert sp.deferring and sp.deferral_pending() == [RANGE]
    c1 = Client(C1, -1)
    assert h.connect(c1)
    h.send(c1, end_of_rib())
    h.advance(60.0)
    assert sp.deferring and c1.end_of_ribs() == set()
    h.advance(61.0)
    assert not sp.deferring and c1.end_of_ribs() == BOTH


def test_established_clients_from_a_listen_range_are_waited_for_like_configured_ones():
    sp, h = dynamic_reflector()
    c1, c2 = Client(C1, -1), Client(C2, -2)
    assert h.connect(c1) and h.connect(c2)
    assert set(sp.dynamic) == {C1, C2}
    h.send(c1, end_of_rib())  # C1 is whole; C2, back too, has not sent its table yet
    h.advance(1.0)
    assert sp.deferral_pending() == [C2, RANGE]
    h.send(c2, end_of_rib())
    h.advance(1.0)
    assert sp.deferral_pending() == [RANGE]
