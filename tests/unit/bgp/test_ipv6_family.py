"""IPv6 unicast (AFI 2) through the speaker's machinery: the two transports a pod network uses
(IPv6 NLRI over an IPv4 session with an IPv6 next hop, and IPv6 sessions between IPv6
addresses), graceful restart, max-prefix, route reflection and update groups.  Sans-IO, in
memory, with a float clock."""

from __future__ import annotations

import struct
from ipaddress import IPv4Address, IPv6Address

from bgp import Origination, PeerSettings, State
from bgp.testing import MemoryNetwork, RawHarness, RawPeer, make_speaker
from proto.errors import CeaseSubcode, ErrorCode
from proto.nlri import IPV4_UNICAST, IPV6_UNICAST, prefix_from_str, prefix_to_str


def origin(*texts):
    return [Origination((prefix_from_str(t)[0], 1), prefix_from_str(t)[1]) for t in texts]


def table(sp, family=IPV6_UNICAST):
    return {prefix_to_str(family[0], p): str(path.next_hop) for p, path in sp.rib.bests(family)}


def v4_pair_with_v6_next_hops(restart_time=120):
    """Two nodes of a dual-stack cluster: one IPv4 session, both families, each node's IPv6
    underlay address as the next hop of its IPv6 routes."""
    net = MemoryNetwork()
    a = net.add("10.0.0.1", make_speaker("10.0.0.1", 65000, [("10.0.0.2", 65000)], restart_time=restart_time,
                                         next_hop_v6=IPv6Address("2001:db8::1")))
    b = net.add("10.0.0.2", make_speaker("10.0.0.2", 65000, [("10.0.0.1", 65000)], restart_time=restart_time,
                                         next_hop_v6=IPv6Address("2001:db8::2")))
    a.start(0.0)
    b.start(0.0)
    net.run(duration=1)
    return net, a, b


def test_ipv6_routes_ride_the_ipv4_session_with_the_nodes_ipv6_next_hop():
    net, a, b = v4_pair_with_v6_next_hops()
    b.set_originated(origin("10.244.2.0/24", "fd00:10:244:2::/64"), net.now)
    net.run(duration=1)
    assert table(a, IPV4_UNICAST) == {"10.244.2.0/24": "10.0.0.2"}
    assert table(a) == {"fd00:10:244:2::/64": "2001:db8::2"}
    assert a.channels.eor_received("10.0.0.2") == {IPV4_UNICAST, IPV6_UNICAST}


def test_ipv6_sessions_between_ipv6_addresses_carry_ipv6_only():
    """An IPv6-only cluster: sessions between the nodes' IPv6 addresses; the next hop is our
    end of the session.  An IPv4 route has no next hop on such a session and is not sent."""
    net = MemoryNetwork()
    a = net.add("2001:db8::1", make_speaker("2001:db8::1", 65000, [("2001:db8::2", 65000)], router_id="0.0.0.1",
                                            families=(IPV6_UNICAST,)))
    b = net.add("2001:db8::2", make_speaker("2001:db8::2", 65000, [("2001:db8::1", 65000)], router_id="0.0.0.2"))
    a.start(0.0)
    b.start(0.0)
    net.run(duration=1)
    assert a.peers["2001:db8::2"].state is State.ESTABLISHED
    b.set_originated(origin("fd00:10:244:2::/64", "10.244.2.0/24"), net.now)
    net.run(duration=1)
    assert table(a) == {"fd00:10:244:2::/64": "2001:db8::2"}
    assert table(a, IPV4_UNICAST) == {}  # not negotiated (a offers IPv6 alone)


def v6_session_both_families(**kw):
    """A dual-stack node (2001:db8::1) and an external peer at an IPv6 address, one IPv6
    session offering both families; ``kw`` goes to the node's LocalSettings."""
    net = MemoryNetwork()
    a = net.add("2001:db8::1", make_speaker("2001:db8::1", 65000, [("2001:db8::2", 65001)], router_id="0.0.0.1", **kw))
    b = net.add("2001:db8::2", make_speaker("2001:db8::2", 65001, [("2001:db8::1", 65000)], router_id="0.0.0.2"))
    a.start(0.0)
    b.start(0.0)
    net.run(duration=1)
    assert a.peers["2001:db8::2"].state is State.ESTABLISHED
    assert a.channels.negotiated("2001:db8::2").families == {IPV4_UNICAST, IPV6_UNICAST}
    a.set_originated(origin("10.244.1.0/24", "fd00:10:244:1::/64"), net.now)
    net.run(duration=1)
    return a, b


def test_ipv4_routes_ride_an_ipv6_session_with_the_nodes_ipv4_next_hop():
    """A dual-stack node's IPv4 pod subnet reaches an external peer at an IPv6 address: its
    next hop is the node's IPv4 address (next_hop_v4), the IPv6 subnet's our end of the session."""
    _, b = v6_session_both_families(next_hop_v4=IPv4Address("192.0.2.1"))
    assert table(b, IPV4_UNICAST) == {"10.244.1.0/24": "192.0.2.1"}
    assert table(b) == {"fd00:10:244:1::/64": "2001:db8::1"}


def test_ipv4_routes_without_an_ipv4_next_hop_are_not_sent_over_an_ipv6_session_and_it_is_logged(caplog):
    with caplog.at_level("WARNING", logger="bgp"):
        _, b = v6_session_both_families()
    assert table(b, IPV4_UNICAST) == {}
    assert table(b) == {"fd00:10:244:1::/64": "2001:db8::1"}
    # (b, without next_hop_v4 either, says the same of its peer.)
    expected = ("peer 2001:db8::2: IPv4 unicast negotiated over an IPv6 session, but we have no IPv4 next hop "
                "(next_hop_v4): routes with us as their next hop are not sent to it")
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("peer 2001:db8::2:")] == [expected]


def test_graceful_restart_keeps_ipv6_routes_stale_until_the_ipv6_end_of_rib():
    net, a, b = v4_pair_with_v6_next_hops()
    b.set_originated(origin("10.244.2.0/24", "fd00:10:244:2::/64", "fd00:10:244:22::/64"), net.now)
    net.run(duration=1)
    changes = []
    a.add_listener(changes.extend)
    net.crash("10.0.0.2")
    net.run(duration=5)
    assert set(table(a)) == {"fd00:10:244:2::/64", "fd00:10:244:22::/64"}
    assert all(path.stale for _, path in a.rib.bests(IPV6_UNICAST))
    assert not [c for c in changes if c.new is None]
    b2 = make_speaker("10.0.0.2", 65000, [("10.0.0.1", 65000)], now=net.now, restarting=True,
                      next_hop_v6=IPv6Address("2001:db8::2"))
    net.replace("10.0.0.2", b2)
    b2.set_originated(origin("10.244.2.0/24", "fd00:10:244:2::/64"), net.now)
    b2.start(net.now)
    net.run(duration=10)
    assert table(a) == {"fd00:10:244:2::/64": "2001:db8::2"}
    assert not any(path.stale for _, path in a.rib.bests(IPV6_UNICAST))
    assert [prefix_to_str(2, c.prefix) for c in changes if c.new is None and c.family == IPV6_UNICAST] == [
        "fd00:10:244:22::/64"]


def test_a_reflector_reflects_ipv6_routes_with_their_next_hop_to_every_client():
    """Route reflection (RFC 4456) of AFI 2: the originator's IPv6 next hop is left alone, and
    the clients form one update group (the same UPDATE bytes for both)."""
    net = MemoryNetwork()
    rr = net.add("10.0.0.1", make_speaker("10.0.0.1", 65000, [PeerSettings("10.0.0.2", 65000, rr_client=True),
                                                               PeerSettings("10.0.0.3", 65000, rr_client=True),
                                                               PeerSettings("10.0.0.4", 65000, rr_client=True)],
                                          cluster_id=IPv4Address("10.0.0.1")))
    clients = {}
    for i in (2, 3, 4):
        addr = f"10.0.0.{i}"
        clients[addr] = net.add(addr, make_speaker(addr, 65000, [("10.0.0.1", 65000)],
                                                   next_hop_v6=IPv6Address(f"2001:db8::{i}")))
    for sp in (rr, *clients.values()):
        sp.start(0.0)
    net.run(duration=1)
    clients["10.0.0.2"].set_originated(origin("fd00:10:244:2::/64"), net.now)
    net.run(duration=1)
    for addr in ("10.0.0.3", "10.0.0.4"):
        assert table(clients[addr]) == {"fd00:10:244:2::/64": "2001:db8::2"}
        (path,) = [p for _, p in clients[addr].rib.bests(IPV6_UNICAST)]
        assert str(path.attributes.originator_id) == "10.0.0.2"
    groups = [g for g in rr.output.groups.values() if g.members]
    assert any({"10.0.0.3", "10.0.0.4"} <= set(g.members) for g in groups), [sorted(g.members) for g in groups]


def _mp_reach_v6(prefixes: list[str], next_hop: str | tuple[str, str] = "2001:db8::9") -> bytes:
    """MP_REACH_NLRI (RFC 4760 §3) for IPv6 unicast; two next hops: global and link-local (32 bytes)."""
    nlri = b"".join(prefix_from_str(p)[1] for p in prefixes)
    nh = b"".join(IPv6Address(a).packed for a in ((next_hop,) if isinstance(next_hop, str) else next_hop))
    value = struct.pack("!HBB", 2, 1, len(nh)) + nh + b"\x00" + nlri
    flags = 0x90 if len(value) > 255 else 0x80
    length = struct.pack("!H", len(value)) if flags & 0x10 else bytes((len(value),))
    return bytes((flags, 14)) + length + value


def _v6_update(prefixes: list[str]) -> bytes:
    attrs = b"\x40\x01\x01\x00" + b"\x40\x02\x06\x02\x01" + (65001).to_bytes(4, "big") + _mp_reach_v6(prefixes)
    body = struct.pack("!H", 0) + struct.pack("!H", len(attrs)) + attrs
    return b"\xff" * 16 + struct.pack("!HB", 19 + len(body), 2) + body


def test_max_prefixes_counts_ipv6_prefixes_and_resets_with_cease_1_naming_afi_2():
    import random

    from bgp import Speaker
    from bgp.settings import LocalSettings

    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1")), now=0.0, rng=random.Random(1))
    sp.add_peer(PeerSettings("10.0.0.9", 65001, passive=True, max_prefixes=3), 0.0)
    sp.start(0.0)
    h = RawHarness(sp, "10.0.0.1")
    a = RawPeer("10.0.0.9", 65001, conn=-1)
    assert h.connect(a)
    h.send(a, _v6_update(["fd00:1::/64", "fd00:2::/64", "fd00:3::/64"]))
    assert not a.closed and len(table(sp)) == 3
    h.send(a, _v6_update(["fd00:4::/64"]))
    assert a.closed
    n = a.notifications()[-1]
    # RFC 4486 §4: AFI (2), SAFI (1), the limit.
    assert (n.code, n.subcode, n.data) == (ErrorCode.CEASE, CeaseSubcode.MAXIMUM_PREFIXES_REACHED,
                                           b"\x00\x02\x01" + (3).to_bytes(4, "big"))
    assert table(sp) == {}


def _v6_update_via(prefixes: list[str], next_hop: str | tuple[str, str], asn: int = 65001) -> bytes:
    as_path = b"\x40\x02\x06\x02\x01" + asn.to_bytes(4, "big") if asn != 65000 else b"\x40\x02\x00"
    attrs = b"\x40\x01\x01\x00" + as_path + _mp_reach_v6(prefixes, next_hop)
    if asn == 65000:
        attrs += b"\x40\x05\x04" + (100).to_bytes(4, "big")  # LOCAL_PREF
    body = struct.pack("!H", 0) + struct.pack("!H", len(attrs)) + attrs
    return b"\xff" * 16 + struct.pack("!HB", 19 + len(body), 2) + body


def _next_hops_sent(peer: RawPeer) -> dict[str, list[str]]:
    return {prefix_to_str(2, p): [str(a) for a in u.mp_reach.next_hop] for u in peer.updates() if u.mp_reach
            for p in u.mp_reach.nlri}


def test_a_link_local_next_hop_is_replaced_by_ours_toward_ibgp_peers_and_clients():
    """RFC 2545 §3: a link-local next hop is only good on the link it was learned on.  A route
    from an external peer (or a reflector's client) with next hop fe80::2 reaches the other
    nodes with our IPv6 next hop instead; a global next hop is passed on as it is."""
    import random

    from bgp import Speaker
    from bgp.settings import LocalSettings

    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1"), next_hop_v6=IPv6Address("2001:db8::1"),
                               cluster_id=IPv4Address("10.0.0.1")), now=0.0, rng=random.Random(1))
    sp.add_peer(PeerSettings("10.0.0.9", 65001, passive=True), 0.0)
    sp.add_peer(PeerSettings("10.0.0.2", 65000, passive=True, rr_client=True), 0.0)
    sp.add_peer(PeerSettings("10.0.0.3", 65000, passive=True, rr_client=True), 0.0)
    sp.start(0.0)
    h = RawHarness(sp, "10.0.0.1")
    ext = RawPeer("10.0.0.9", 65001, conn=-1)
    client = RawPeer("10.0.0.2", 65000, conn=-2)
    other = RawPeer("10.0.0.3", 65000, conn=-3)
    for p in (ext, client, other):
        assert h.connect(p)
    h.send(ext, _v6_update_via(["2001:db8:99::/48"], "fe80::2"))
    h.send(ext, _v6_update_via(["2001:db8:98::/48"], "2001:db8::9"))
    h.send(client, _v6_update_via(["fd00:10:244:2::/64"], "fe80::22", asn=65000))
    h.advance(5)
    assert _next_hops_sent(other) == {
        "2001:db8:99::/48": ["2001:db8::1"],
        "2001:db8:98::/48": ["2001:db8::9"],
        "fd00:10:244:2::/64": ["2001:db8::1"],
    }


def test_a_next_hop_of_no_global_address_beside_a_link_local_one_is_the_link_local_one():
    """A 32-byte next hop whose global half is :: (some speakers send no global address):
    the routes go through the link-local one, as BIRD takes them, not withdrawn; :: alone, or
    beside an address that is not link-local, still is no next hop (treat-as-withdraw)."""
    import random

    from bgp import Speaker
    from bgp.settings import LocalSettings

    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1")), now=0.0, rng=random.Random(1))
    sp.add_peer(PeerSettings("10.0.0.9", 65001, passive=True), 0.0)
    sp.start(0.0)
    h = RawHarness(sp, "10.0.0.1")
    ext = RawPeer("10.0.0.9", 65001, conn=-1)
    assert h.connect(ext)
    h.send(ext, _v6_update_via(["2001:db8:99::/48"], ("::", "fe80::2")))
    h.send(ext, _v6_update_via(["2001:db8:98::/48"], "::"))
    h.send(ext, _v6_update_via(["2001:db8:97::/48"], ("::", "2001:db8::7")))
    h.send(ext, _v6_update_via(["2001:db8:96::/48"], ("2001:db8::6", "fe80::6")))  # global and link-local: the global
    h.advance(1)
    assert not ext.closed
    assert table(sp) == {"2001:db8:99::/48": "fe80::2", "2001:db8:96::/48": "2001:db8::6"}
