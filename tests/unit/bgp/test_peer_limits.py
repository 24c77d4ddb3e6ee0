"""Defects a review of the speaker found (sans-IO, time passed in): a listen-range peer's
max-prefix hold-down, a passive session connecting out, a collision of equal BGP
Identifiers, and the attribute caches' memory a peer controls."""

from __future__ import annotations

from ipaddress import IPv4Address

from bgp.session import Close, Connect, Send
from bgp.settings import ListenRange, PeerSettings
from bgp.testing import RawHarness, RawPeer, make_speaker
from proto._attrblock import Interned
from proto.attributes import AsPath, Origin, PathAttributes
from proto.packing import encode_updates

FIVE = encode_updates(1, PathAttributes((Origin(0), AsPath(()))), IPv4Address("10.0.0.9"),
                      [bytes((24, 10, 1, i)) for i in range(5)])


def test_a_listen_range_peer_over_max_prefixes_stays_held_down():
    """Held down for max_prefixes_restart: its next connection is refused, as a configured
    peer's is (forgotten, it came back as a fresh peer at once)."""
    sp = make_speaker("10.0.0.1", 65000)
    sp.set_listen_ranges([ListenRange("10.0.0.0/24", PeerSettings(address="0.0.0.0", asn=65000, max_prefixes=2,
                                                                   max_prefixes_restart=300.0))], 0.0)
    sp.start(0.0)
    h = RawHarness(sp, "10.0.0.1")
    first = RawPeer("10.0.0.9", 65000, conn=-10)
    assert h.connect(first)
    h.send(first, b"".join(FIVE))
    assert [str(n) for n in first.notifications()][-1].startswith("Cease")
    assert sp.counters["max-prefix resets"] == 1
    h.advance(1)
    assert not h.connect(RawPeer("10.0.0.9", 65000, conn=-11))  # held down
    h.advance(300)
    assert h.connect(RawPeer("10.0.0.9", 65000, conn=-12))  # the hold-down is over


def test_a_passive_peer_never_connects_out_after_losing_a_connection():
    sp = make_speaker("10.0.0.1", 65000, [PeerSettings(address="10.0.0.9", asn=65000, passive=True)])
    sp.start(0.0)
    h = RawHarness(sp, "10.0.0.1")
    assert not [a for a in sp.take_actions() if isinstance(a, Connect)]
    p = RawPeer("10.0.0.9", 65000, conn=-5)
    h.open(p)  # inbound, our OPEN sent, the peer silent
    sp.connection_lost(-5, h.now)
    h.pump()
    h.advance(30)
    assert not [a for a in h.sent if isinstance(a, Connect)]


def _crossing_opens(rid_a: str, rid_b: str) -> tuple[str, str, int]:
    """Two speakers (AS 65001, 65002) connecting to each other at once, OPENs crossing."""
    a = make_speaker("10.0.0.1", 65001, [("10.0.0.2", 65002)], router_id=rid_a)
    b = make_speaker("10.0.0.2", 65002, [("10.0.0.1", 65001)], router_id=rid_b)
    nodes = {"A": a, "B": b}
    a.start(0.0)
    b.start(0.0)
    ca = next(x for x in a.take_actions() if isinstance(x, Connect))
    cb = next(x for x in b.take_actions() if isinstance(x, Connect))
    a.connection_made(ca.conn, 0.0, "10.0.0.1")
    b.connection_made(cb.conn, 0.0, "10.0.0.2")
    b.accept(-1, "10.0.0.1", 0.0, "10.0.0.2")
    a.accept(-2, "10.0.0.2", 0.0, "10.0.0.1")
    links = {("A", ca.conn): ("B", -1), ("B", -1): ("A", ca.conn), ("B", cb.conn): ("A", -2), ("A", -2): ("B", cb.conn)}
    for _ in range(10):
        pending = [(n, act) for n, sp in nodes.items() for act in sp.take_actions()]
        if not pending:
            break
        for n, act in pending:  # a round at once: both OPENs cross on the wire
            if isinstance(act, Send) and (n, act.conn) in links:
                o = links[(n, act.conn)]
                nodes[o[0]].data_received(o[1], act.data, 0.0)
            elif isinstance(act, Close) and (n, act.conn) in links:
                o = links.pop((n, act.conn))
                links.pop(o, None)
                nodes[o[0]].connection_lost(o[1], 0.0)
    return a.peers["10.0.0.2"].state.label, b.peers["10.0.0.1"].state.label, len(links) // 2


def test_a_collision_of_equal_identifiers_keeps_the_larger_as_numbers_connection():
    """RFC 6286 §2.3: equal BGP Identifiers (legal between ASes) -- the connection initiated
    by the speaker with the larger AS number is kept, not both closed."""
    assert _crossing_opens("1.1.1.1", "2.2.2.2") == ("Established", "Established", 1)
    assert _crossing_opens("1.1.1.1", "1.1.1.1") == ("Established", "Established", 1)


def test_the_attribute_cache_is_bounded_by_octets_too():
    cache = Interned(limit=8192, max_bytes=64 * 1024)
    for i in range(1000):
        cache.put(i.to_bytes(2, "big") * 2048, (None, i))  # 4 KB each
    assert sum(map(len, cache.new)) <= 64 * 1024 and sum(map(len, cache.old)) <= 64 * 1024
    assert len(cache.new) + len(cache.old) <= 32
