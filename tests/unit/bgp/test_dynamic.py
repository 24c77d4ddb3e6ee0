"""Dynamic neighbours ([[bgp.listen_ranges]]): peers accepted from a prefix without an entry each."""

from __future__ import annotations

import random
from ipaddress import IPv4Address, ip_network

from bgp import ListenRange, PeerSettings, Speaker, State
from bgp.settings import LocalSettings
from bgp.testing import RawHarness, RawPeer
from proto.capabilities import (
    GracefulRestart,
    GracefulRestartFamily,
    MultiProtocol,
    RouteRefresh,
)
from proto.messages import Open
from proto.nlri import prefix_from_str, prefix_to_str

RR = "10.1.0.1"


def reflector(**kw) -> tuple[Speaker, RawHarness]:
    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address(RR), cluster_id=IPv4Address(RR), **kw), now=0.0,
                 rng=random.Random(1))
    sp.start(0.0)
    template = PeerSettings(IPv4Address("10.1.0.0"), 65000, rr_client=True)
    sp.set_listen_ranges([ListenRange(ip_network("10.1.0.0/16"), template)], 0.0)
    return sp, RawHarness(sp, RR)


def announce(h: RawHarness, peer: RawPeer, prefix: str) -> None:
    from agentd.lab.rawbgp import as_path, attr, update

    nh = attr(0x40, 3, IPv4Address(peer.address).packed)
    h.send(peer, update(attr(0x40, 1, b"\x00") + as_path([]) + nh + attr(0x40, 5, b"\x00\x00\x00\x64"),
                        prefix_from_str(prefix)[1]))


KEEPALIVE = b"\xff" * 16 + b"\x00\x13\x04"


def held(peer: RawPeer) -> set[str]:
    out: set[str] = set()
    for u in peer.updates():
        for p in u.withdrawn:
            out.discard(prefix_to_str(1, p))
        for p in u.nlri:
            out.add(prefix_to_str(1, p))
    return out


def test_clients_from_a_range_are_accepted_reflected_and_forgotten():
    sp, h = reflector()
    clients = [RawPeer(f"10.1.0.{i}", 65000, conn=-i) for i in range(2, 12)]
    for c in clients:
        assert h.connect(c), c.address
        announce(h, c, f"10.244.{c.conn * -1}.0/26")
    assert set(sp.dynamic) == {c.address for c in clients}
    for c in clients:  # every client holds every other client's route, not its own
        want = {f"10.244.{i}.0/26" for i in range(2, 12)} - {f"10.244.{-c.conn}.0/26"}
        assert held(c) == want, (c.address, held(c))
    # One client leaves: it is forgotten, and its route is withdrawn from the others.
    h.send(clients[0], b"\xff" * 16 + b"\x00\x15\x03\x06\x02")
    assert clients[0].address not in sp.peers and clients[0].address not in sp.dynamic
    assert "10.244.2.0/26" not in held(clients[1])
    # A connection from outside every range is refused.
    outsider = RawPeer("10.2.0.1", 65000, conn=-100)
    assert not h.connect(outsider)


def test_configured_peers_leave_dynamic_ones_alone_and_win_over_the_range():
    sp, h = reflector()
    c = RawPeer("10.1.0.7", 65000, conn=-7)
    assert h.connect(c)
    sp.set_peers([PeerSettings("10.9.9.9", 65000)], h.now)
    assert "10.1.0.7" in sp.peers and sp.peers["10.1.0.7"].state is State.ESTABLISHED
    # Configured explicitly now: it becomes an ordinary peer (the session restarts with it).
    sp.set_peers([PeerSettings("10.1.0.7", 65000, passive=True, rr_client=True)], h.now)
    h.pump()
    assert "10.1.0.7" not in sp.dynamic and "10.1.0.7" in sp.peers


class GracefulClient(RawPeer):
    """A raw peer whose OPEN carries Graceful Restart (restart time 120 s, forwarding state kept
    for every family it has)."""

    def open_message(self) -> bytes:
        gr = GracefulRestart(False, 120, tuple(GracefulRestartFamily(a, s, True) for a, s in self.families))
        caps = [MultiProtocol(a, s) for a, s in self.families] + [RouteRefresh(), gr]
        return Open.build(self.asn, self.hold_time, self.router_id, caps).encode()


def test_graceful_restart_keeps_a_dynamic_peer_until_its_routes_go():
    sp, h = reflector(stale_time=30.0)
    other = RawPeer("10.1.0.9", 65000, conn=-9)
    assert h.connect(other)
    c = GracefulClient("10.1.0.8", 65000, conn=-8)
    assert h.connect(c)
    announce(h, c, "10.244.8.0/26")
    assert "10.244.8.0/26" in held(other)
    # Its connection drops: graceful restart keeps the peer and its route, stale, for its
    # restart time (120 s) -- the other client is not told.
    sp.connection_lost(c.conn, h.now)
    c.closed = True
    h.pump()
    assert "10.1.0.8" in sp.peers and "10.1.0.8" in sp.dynamic
    assert sp.rib.stale_count("10.1.0.8") == 1
    assert "10.244.8.0/26" in held(other)
    for _ in range(119):  # the other client keeps its session up (hold time 90 s)
        h.advance(1.0)
        h.send(other, KEEPALIVE)
    assert "10.1.0.8" in sp.peers and "10.244.8.0/26" in held(other)
    # It never came back: its route goes, and the peer with it.
    h.advance(2.0)
    assert not other.closed
    assert "10.1.0.8" not in sp.peers and "10.1.0.8" not in sp.dynamic
    assert sp.rib.stale_count("10.1.0.8") == 0
    assert "10.244.8.0/26" not in held(other)


def test_a_dynamic_peer_without_graceful_restart_is_forgotten_when_its_connection_drops():
    sp, h = reflector(stale_time=30.0)
    other = RawPeer("10.1.0.9", 65000, conn=-9)
    assert h.connect(other)
    c = RawPeer("10.1.0.8", 65000, conn=-8)  # advertises no graceful restart
    assert h.connect(c)
    announce(h, c, "10.244.8.0/26")
    assert "10.244.8.0/26" in held(other)
    sp.connection_lost(c.conn, h.now)
    h.pump()
    assert "10.1.0.8" not in sp.peers
    assert "10.244.8.0/26" not in held(other)


def test_a_range_removed_resets_its_peers():
    sp, h = reflector()
    c = RawPeer("10.1.0.5", 65000, conn=-5)
    assert h.connect(c)
    sp.set_listen_ranges([], h.now)
    h.pump()
    assert c.closed and "10.1.0.5" not in sp.peers


def test_a_long_lived_client_group_keeps_no_count_for_clients_gone():
    # The group's per-source and per-originator counts (for each member's count of routes
    # sent) drop a client's entries once its routes are gone: a reflector whose listen-range
    # clients come and go for months does not keep an entry per client it ever had.
    sp, h = reflector()
    stay = RawPeer("10.1.0.2", 65000, conn=-2)
    assert h.connect(stay)
    announce(h, stay, "10.244.2.0/26")
    for i in range(3, 23):
        c = RawPeer(f"10.1.0.{i}", 65000, conn=-i)
        assert h.connect(c)
        announce(h, c, f"10.244.{i}.0/26")
        h.send(c, b"\xff" * 16 + b"\x00\x15\x03\x06\x02")  # Cease: it leaves, its route goes
        assert c.address not in sp.peers
    (group,) = sp.output.groups.values()
    assert dict(group._by_source) == {"10.1.0.2": 1}
    assert dict(group._by_originator) == {IPv4Address("10.1.0.2"): 1}
    assert dict(group._by_both) == {("10.1.0.2", IPv4Address("10.1.0.2")): 1}
    assert sp.adj_out_count(stay.address) == 0  # its own route only, which it is never sent
    late = RawPeer("10.1.0.99", 65000, conn=-99)
    assert h.connect(late)
    assert held(late) == {"10.244.2.0/26"} and sp.adj_out_count(late.address) == 1


def test_a_dynamic_peer_that_cannot_be_reset_is_forgotten_not_made_a_configured_one():
    """A peer whose reset itself fails (an internal error) is recreated from its settings --
    but a listen range's client is only forgotten: its next connection makes it again from the
    range, and it never turns into a configured peer that deferral waits for."""
    sp, h = reflector()
    client = RawPeer("10.1.0.5", 65000, conn=-5)
    assert h.connect(client)
    peer = sp.peers["10.1.0.5"]

    def broken(*_a: object, **_k: object) -> None:
        raise RuntimeError("broken peer")

    peer.shutdown = broken  # type: ignore[method-assign]
    sp._reset(peer, h.now, "test")
    h.pump()
    assert "10.1.0.5" not in sp.peers and "10.1.0.5" not in sp.dynamic
    assert "10.1.0.5" not in str(sp.deferral_pending())
    again = RawPeer("10.1.0.5", 65000, conn=-6)
    assert h.connect(again) and "10.1.0.5" in sp.dynamic


def test_the_most_specific_listen_range_wins_whatever_their_order():
    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1")), now=0.0, rng=random.Random(1))
    sp.start(0.0)
    wide = ListenRange(ip_network("10.0.0.0/16"), PeerSettings(IPv4Address("10.0.0.0"), 65001))
    narrow = ListenRange(ip_network("10.0.1.0/24"), PeerSettings(IPv4Address("10.0.1.0"), 65002))
    sp.set_listen_ranges([wide, narrow], 0.0)  # the wider first
    h = RawHarness(sp, "10.0.0.1")
    inner, outer = RawPeer("10.0.1.5", 65002, conn=-1), RawPeer("10.0.2.5", 65001, conn=-2)
    assert h.connect(inner) and h.connect(outer)
    assert sp.peers["10.0.1.5"].settings.asn == 65002 and sp.peers["10.0.1.5"].state is State.ESTABLISHED
    assert sp.peers["10.0.2.5"].settings.asn == 65001 and sp.peers["10.0.2.5"].state is State.ESTABLISHED


def test_a_client_whose_sessions_end_right_after_they_come_up_is_damped_across_its_peers():
    """A listen-range client's Peer goes with its session, and with it the damping of a session
    that ended early (RFC 4271 §8.1.1 DampPeerOscillations, bgp6): reconnecting at once, it came
    back at once, its routes in and out as fast as it reconnected.  Now its address is refused
    until the restart delay is over, and the next early end waits longer, as for a configured
    peer (backoff_initial 1 s: 0.75-1 s, then 1.5-2 s)."""
    sp, h = reflector()
    conn = iter(range(-1, -100, -1))

    def client() -> RawPeer:
        return RawPeer("10.1.0.8", 65000, conn=next(conn))

    def drop(c: RawPeer) -> None:  # no NOTIFICATION, no graceful restart: a failure
        sp.connection_lost(c.conn, h.now)
        c.closed = True
        h.pump()
        assert "10.1.0.8" not in sp.peers

    c = client()
    assert h.connect(c)
    drop(c)
    assert not h.connect(client())  # at once: refused, the delay runs
    h.advance(1.0)
    c = client()
    assert h.connect(c)  # the delay over
    drop(c)
    h.advance(1.2)
    assert not h.connect(client())  # the delay grew: 1.5-2 s
    h.advance(0.8)
    c = client()
    assert h.connect(c)
    h.advance(sp.local.backoff_max)  # up long enough: its end starts the backoff over
    sp.connection_lost(c.conn, h.now)
    c.closed = True
    h.pump()
    assert h.connect(client())
    assert not sp._dynamic_damping


ADMIN_RESET = b"\xff" * 16 + b"\x00\x15\x03\x06\x04"  # NOTIFICATION Cease/Administrative Reset


class Clients:
    """Listen-range clients at ``address``, each connection a new conn id; ``fail`` ends one
    without NOTIFICATION or graceful restart (a failure), right after it came up."""

    def __init__(self, sp: Speaker, h: RawHarness) -> None:
        self.sp, self.h = sp, h
        self.conn = iter(range(-1, -10_000, -1))

    def connect(self, address: str = "10.1.0.8") -> RawPeer | None:
        c = RawPeer(address, 65000, conn=next(self.conn))
        return c if self.h.connect(c) else None

    def fail(self, c: RawPeer) -> None:
        self.sp.connection_lost(c.conn, self.h.now)
        c.closed = True
        self.h.pump()
        assert c.address not in self.sp.peers

    def refused_for(self, address: str = "10.1.0.8", step: float = 0.25) -> float:
        """How long ``address`` is refused from now (advancing the clock)."""
        start = self.h.now
        while self.connect(address) is None:
            self.h.advance(step)
        return self.h.now - start


def test_a_clients_failures_are_carried_across_a_session_it_ended_on_purpose():
    """Its own Cease (an Administrative Reset) lets a client back at once, as a configured
    peer, but its failures still count: the next early end waits longer (1.5-2 s), not
    backoff_initial again -- a client alternating resets and failures was held 1 s for ever."""
    sp, h = reflector()
    cl = Clients(sp, h)
    cl.fail(cl.connect())
    h.advance(1.0)
    c = cl.connect()
    h.send(c, ADMIN_RESET)
    c.closed = True
    h.pump()
    assert "10.1.0.8" not in sp.peers
    cl.fail(cl.connect())  # let in at once after its Cease; then an early end again
    assert cl.refused_for() >= 1.5


def test_a_clients_damping_goes_when_its_range_changes():
    """A changed range resets its clients (Cease/Other Configuration Change) and a held-down
    one starts afresh under the new settings, as a reconfigured peer is let in at once."""
    sp, h = reflector()
    cl = Clients(sp, h)
    cl.fail(cl.connect())
    assert cl.connect() is None
    template = PeerSettings(IPv4Address("10.1.0.0"), 65000, rr_client=True, hold_time=30)
    sp.set_listen_ranges([ListenRange(ip_network("10.1.0.0/16"), template)], h.now)
    assert "10.1.0.8" not in sp._dynamic_damping  # not kept till it lapses
    c = cl.connect()
    assert c is not None and sp.peers["10.1.0.8"]._failures == 0


def test_a_client_configured_as_a_peer_drops_its_kept_damping():
    sp, h = reflector()
    cl = Clients(sp, h)
    cl.fail(cl.connect())
    sp.set_peers([PeerSettings(IPv4Address("10.1.0.8"), 65000, rr_client=True, passive=True)], h.now)
    assert "10.1.0.8" not in sp._dynamic_damping
    sp.set_peers([], h.now)  # back to the range: a fresh start
    assert cl.connect() is not None


def test_a_clients_kept_damping_lapses_whatever_other_clients_do(monkeypatch):
    """Kept backoff_max past its hold-down, then a client starts afresh -- whether or not other
    clients came and went meanwhile; a sweep of lapsed entries (once the table has grown) keeps
    the others' damping."""
    import bgp.speaker

    monkeypatch.setattr(bgp.speaker, "DAMPING_PRUNE_MIN", 3)
    for others in (False, True):
        sp, h = reflector()
        cl = Clients(sp, h)
        cl.fail(cl.connect())  # A: held down 0.75-1 s, failures 1
        h.advance(1.0 + sp.local.backoff_max)
        if others:
            for address in ("10.1.0.20", "10.1.0.21"):
                cl.fail(cl.connect(address))
        cl.fail(cl.connect())  # A again: a first failure, 0.75-1 s
        assert cl.refused_for() <= 1.0, others
    # The sweep: A's entry lapsed, B's and C's held down still are kept.
    sp, h = reflector()
    cl = Clients(sp, h)
    cl.fail(cl.connect())
    h.advance(1.0 + sp.local.backoff_max)
    cl.fail(cl.connect("10.1.0.20"))
    cl.fail(cl.connect("10.1.0.21"))  # the third entry: the sweep runs
    assert set(sp._dynamic_damping) == {"10.1.0.20", "10.1.0.21"}
    assert cl.connect("10.1.0.20") is None and cl.connect("10.1.0.21") is None


def test_a_client_is_told_why_it_is_refused_as_a_configured_peer():
    sp, h = reflector()
    cl = Clients(sp, h)
    cl.fail(cl.connect())
    admission = sp.accept(-999, "10.1.0.8", h.now, RR)
    assert not admission
    assert admission.reason.startswith("its last session ended 0.0s after it came up (")
    assert "held down for 1s more" in admission.reason
