"""One bad peer must never hurt another session, sans-IO with a float clock.

A speaker (10.0.0.1, AS 65000) has an eBGP neighbour A (10.0.0.9, AS 65001) driven by
hand (bgp.testing.RawPeer: it sends whatever bytes a test gives it) and an iBGP neighbour
B (10.0.0.2, AS 65000) that reads what the speaker exports.  Each test has A misbehave
the way a broken or hostile peer does and checks that B's session, B's routes and what B
is told stay right.
"""

from __future__ import annotations

import logging
import random
import struct
from ipaddress import IPv4Address

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bgp import Origination, PeerSettings, Speaker, State
from bgp.session import Send
from bgp.settings import LocalSettings
from bgp.testing import RawHarness, RawPeer
from bgp.views import peer_views
from proto.errors import CeaseSubcode, ErrorCode
from proto.messages import MessageType, RouteRefresh
from proto.nlri import IPV4_UNICAST, prefix_from_str, prefix_to_str

LOCAL = "10.0.0.1"
A_ADDR, B_ADDR = "10.0.0.9", "10.0.0.2"


def attr(flags: int, code: int, value: bytes) -> bytes:
    if len(value) > 255:
        return bytes((flags | 0x10, code)) + struct.pack("!H", len(value)) + value
    return bytes((flags, code, len(value))) + value


def seg(asns: list[int], width: int = 4, kind: int = 2) -> bytes:
    return bytes((kind, len(asns))) + b"".join(a.to_bytes(width, "big") for a in asns)


def update(attrs: bytes, nlri: bytes = b"", withdrawn: bytes = b"") -> bytes:
    body = struct.pack("!H", len(withdrawn)) + withdrawn + struct.pack("!H", len(attrs)) + attrs + nlri
    return b"\xff" * 16 + struct.pack("!HB", 19 + len(body), 2) + body


def wire(prefix: str) -> bytes:
    return prefix_from_str(prefix)[1]


ORIGIN = attr(0x40, 1, b"\x00")
NH_A = attr(0x40, 3, IPv4Address(A_ADDR).packed)


def as_path(asns: list[int], width: int = 4) -> bytes:
    return attr(0x40, 2, b"".join(seg(asns[i : i + 255], width) for i in range(0, len(asns), 255)))


def ok_update(prefix: str, extra: bytes = b"") -> bytes:
    return update(ORIGIN + as_path([65001]) + NH_A + extra, wire(prefix))


def speaker(**local) -> Speaker:
    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address(LOCAL), **local), now=0.0, rng=random.Random(1))
    return sp


def setup(*, a_asn: int = 65001, a_four_octet: bool = True, a_settings: dict | None = None, **local):
    sp = speaker(**local)
    sp.add_peer(PeerSettings(A_ADDR, a_asn, passive=True, **(a_settings or {})), 0.0)
    sp.add_peer(PeerSettings(B_ADDR, 65000, passive=True), 0.0)
    sp.start(0.0)
    sp.set_originated([Origination(IPV4_UNICAST, wire("10.244.1.0/24"))], 0.0)
    h = RawHarness(sp, LOCAL)
    b = RawPeer(B_ADDR, 65000, conn=-2)
    a = RawPeer(A_ADDR, a_asn, conn=-1, four_octet=a_four_octet)
    assert h.connect(b) and h.connect(a)
    assert sp.peers[A_ADDR].state is State.ESTABLISHED and sp.peers[B_ADDR].state is State.ESTABLISHED
    return sp, h, a, b


def b_holds(b: RawPeer) -> set[str]:
    """The IPv4 prefixes B holds from the speaker, replaying every UPDATE it was sent."""
    held: set[str] = set()
    for u in b.updates():
        for p in u.withdrawn:
            held.discard(prefix_to_str(1, p))
        for p in u.nlri:
            held.add(prefix_to_str(1, p))
    return held


def b_intact(sp: Speaker, h: RawHarness, b: RawPeer) -> None:
    assert not b.closed and not b.notifications(), b.notifications()
    assert sp.peers[B_ADDR].state is State.ESTABLISHED
    h.advance(0.0)
    assert sp.adj_out_count(B_ADDR) == len(b_holds(b))


# ---------------------------------------------------------------- routes that cannot be exported


def test_route_too_big_for_ibgp_export_is_not_sent_and_the_batch_goes_on():
    sp, h, a, b = setup()
    # 1,011 communities: 4,095 octets from A; LOCAL_PREF for iBGP makes it too big for B.
    communities = attr(0xC0, 8, b"".join((65001 << 16 | i).to_bytes(4, "big") for i in range(1011)))
    big = update(ORIGIN + as_path([65001]) + NH_A + communities, wire("10.50.0.0/24"))
    assert len(big) == 4095
    h.send(a, big + ok_update("10.51.0.0/24"))
    assert not a.closed
    assert sp.rib.best(IPV4_UNICAST, wire("10.50.0.0/24")) is not None  # accepted on import
    b_intact(sp, h, b)
    assert "10.51.0.0/24" in b_holds(b) and "10.50.0.0/24" not in b_holds(b)
    assert sp.adj_out_count(B_ADDR) == 2  # our own /24 and 10.51.0.0/24, not the one never sent


def test_long_as_path_from_a_2_octet_peer_that_doubles_is_not_sent():
    sp, h, a, b = setup(a_asn=65001, a_four_octet=False)
    big = update(ORIGIN + as_path([65001] + [64000 + i % 500 for i in range(1099)], width=2) + NH_A, wire("10.60.0.0/24"))
    assert len(big) < 4096
    h.send(a, big + update(ORIGIN + as_path([65001], 2) + NH_A, wire("10.61.0.0/24")))
    assert not a.closed
    b_intact(sp, h, b)
    assert b_holds(b) >= {"10.61.0.0/24"} and "10.60.0.0/24" not in b_holds(b)


def test_ipv4_nlri_with_an_ipv6_next_hop_resets_only_the_sender():
    sp, h, a, b = setup()
    v6nh = bytes.fromhex("20010db8000000000000000000000001")
    mp = attr(0x80, 14, struct.pack("!HBB", 1, 1, 16) + v6nh + b"\x00" + wire("10.70.0.0/24"))
    h.send(a, update(ORIGIN + as_path([65001]) + mp))
    assert a.closed and a.notifications()[-1].code == ErrorCode.UPDATE_MESSAGE
    assert sp.rib.best(IPV4_UNICAST, wire("10.70.0.0/24")) is None
    b_intact(sp, h, b)


def test_an_unencodable_route_that_was_sent_before_is_withdrawn():
    sp, h, a, b = setup()
    h.send(a, ok_update("10.52.0.0/24"))
    assert "10.52.0.0/24" in b_holds(b)
    communities = attr(0xC0, 8, b"".join((65001 << 16 | i).to_bytes(4, "big") for i in range(1011)))
    h.send(a, update(ORIGIN + as_path([65001]) + NH_A + communities, wire("10.52.0.0/24")))
    assert "10.52.0.0/24" not in b_holds(b)
    b_intact(sp, h, b)


# ---------------------------------------------------------------- refresh flood, back-pressure


def test_route_refresh_flood_is_folded_and_paced():
    sp, h, a, b = setup(refresh_interval=1.0)
    for i in range(200):
        h.send(a, ok_update(f"10.{80 + i // 256}.{i % 256}.0/24"))
    before = len(a.updates())
    flood = RouteRefresh(1, 1).encode() * 3000
    h.send(a, flood)
    assert not a.closed
    sent = len(a.updates()) - before
    # One full re-send (our own /24 is all A gets: its own routes are not sent back), not 3,000.
    assert 1 <= sent <= 2, sent
    assert sp.counters["route refreshes deferred"] == 1
    assert sp.counters["route refreshes folded"] >= 2990
    h.advance(1.0)
    assert len(a.updates()) - before == sent * 2  # the folded ones: one more re-send, a second later
    h.advance(5.0)
    assert len(a.updates()) - before == sent * 2
    b_intact(sp, h, b)


def test_a_peer_that_does_not_read_is_not_fed_and_is_reset_after_the_send_timeout():
    sp, h, a, b = setup(send_timeout=30.0)
    h.set_writable(a, False)
    start = len(h.sent)
    for i in range(300):
        sp.set_originated(
            [Origination(IPV4_UNICAST, wire(f"10.90.{j}.0/24")) for j in range(i % 7 + 1)], h.now
        )
        h.send(a, RouteRefresh(1, 1).encode())  # keeps A's hold timer happy
    h.advance(10.0)
    # Nothing but KEEPALIVEs was handed to A's connection while its socket was full ...
    to_a = [x.data for x in h.sent[start:] if isinstance(x, Send) and x.conn == a.conn]
    assert all(d[18] == MessageType.KEEPALIVE and len(d) == 19 for d in to_a), to_a
    # ... while B, reading, followed every change.
    assert not a.closed
    h.set_writable(a, True)  # it reads again: it is brought up to date from the table
    assert a.updates()
    held = set()
    for u in a.updates():
        for p in u.withdrawn:
            held.discard(p)
        held.update(u.nlri)
    assert {prefix_to_str(1, p) for p in held} == {f"10.90.{j}.0/24" for j in range(299 % 7 + 1)}
    h.set_writable(a, False)
    h.advance(29.0)
    assert not a.closed
    h.advance(2.0)
    assert a.closed
    n = a.notifications()[-1]
    assert (n.code, n.subcode) == (ErrorCode.CEASE, CeaseSubcode.OUT_OF_RESOURCES)
    assert "send timeout" in sp.peers[A_ADDR].last_error
    b_intact(sp, h, b)


# ---------------------------------------------------------------- connections


def test_silent_connection_superseded_by_a_second_one_is_closed():
    sp = speaker()
    sp.add_peer(PeerSettings(A_ADDR, 65001, passive=True), 0.0)
    sp.start(0.0)
    h = RawHarness(sp, LOCAL)
    for round_ in range(50):
        silent = RawPeer(A_ADDR, 65001, conn=-1000 - 2 * round_)
        h.peers[silent.conn] = silent
        assert sp.accept(silent.conn, A_ADDR, h.now, LOCAL)
        h.pump()
        second = RawPeer(A_ADDR, 65001, conn=-1001 - 2 * round_)
        assert h.connect(second)
        assert sp.peers[A_ADDR].state is State.ESTABLISHED
        assert silent.closed, f"round {round_}: the silent connection is still open"
        n = silent.notifications()
        assert n and (n[-1].code, n[-1].subcode) == (ErrorCode.CEASE, CeaseSubcode.CONNECTION_COLLISION_RESOLUTION)
        h.send(second, b"\xff" * 16 + b"\x00\x15\x03\x06\x02")  # Cease, to start the next round clean
        assert second.closed or sp.peers[A_ADDR].state is not State.ESTABLISHED
        h.advance(60.0)
    # Connections the speaker closed itself are not remembered.
    assert len(sp._conn_owner) <= 1, sp._conn_owner


# ---------------------------------------------------------------- logs


def test_per_message_problems_are_logged_once_and_counted(caplog):
    sp, h, a, b = setup()
    dup = attr(0x80, 4, b"\x00\x00\x00\x05") * 2
    with caplog.at_level(logging.INFO, logger="bgp"):
        for i in range(2000):
            h.send(a, ok_update(f"10.{100 + i // 256}.{i % 256}.0/24", dup))
    lines = [r for r in caplog.records if "UPDATE error" in r.getMessage()]
    assert len(lines) == 1, len(lines)
    assert sp.counters["update errors attribute-discard"] == 2000
    assert sp.limiter.counts[("update-error attribute-discard 3/1", A_ADDR)] == 2000
    b_intact(sp, h, b)


def test_failure_before_established_is_logged(caplog):
    sp = speaker()
    sp.add_peer(PeerSettings(A_ADDR, 65001, passive=True), 0.0)
    sp.start(0.0)
    h = RawHarness(sp, LOCAL)
    wrong = RawPeer(A_ADDR, 65099, conn=-1)  # not the configured AS
    with caplog.at_level(logging.WARNING, logger="bgp"):
        h.connect(wrong)
    assert wrong.closed and wrong.notifications()[-1].code == ErrorCode.OPEN_MESSAGE
    assert any("65099" in r.getMessage() and A_ADDR in r.getMessage() for r in caplog.records), caplog.text


# ---------------------------------------------------------------- RFC deviations


def test_as_confed_sequence_from_ebgp_is_treat_as_withdraw():
    sp, h, a, b = setup()
    h.send(a, ok_update("10.110.0.0/24"))
    confed = attr(0x40, 2, seg([65010], kind=3) + seg([65001]))
    h.send(a, update(ORIGIN + confed + NH_A, wire("10.110.0.0/24")))
    assert not a.closed
    assert sp.rib.best(IPV4_UNICAST, wire("10.110.0.0/24")) is None
    assert "10.110.0.0/24" not in b_holds(b)
    b_intact(sp, h, b)


def test_next_hop_equal_to_our_own_address_is_ignored():
    sp, h, a, b = setup()
    own = attr(0x40, 3, IPv4Address(LOCAL).packed)
    h.send(a, update(ORIGIN + as_path([65001]) + own, wire("10.111.0.0/24")) + ok_update("10.112.0.0/24"))
    assert not a.closed
    assert sp.rib.best(IPV4_UNICAST, wire("10.111.0.0/24")) is None
    assert sp.rib.best(IPV4_UNICAST, wire("10.112.0.0/24")) is not None
    b_intact(sp, h, b)


def test_local_pref_from_ebgp_is_discarded_even_when_malformed():
    sp, h, a, b = setup()
    h.send(a, ok_update("10.113.0.0/24", attr(0x40, 5, b"\x00\x01")))
    assert not a.closed
    best = sp.rib.best(IPV4_UNICAST, wire("10.113.0.0/24"))
    assert best is not None and best.attributes.local_pref is None


def test_malformed_attribute_without_nlri_keeps_the_session():
    sp, h, a, b = setup()
    h.send(a, ok_update("10.114.0.0/24"))
    bad_origin = attr(0x40, 1, b"\x07")
    h.send(a, update(bad_origin + as_path([65001]) + NH_A, b""))
    assert not a.closed and sp.peers[A_ADDR].state is State.ESTABLISHED
    assert sp.rib.best(IPV4_UNICAST, wire("10.114.0.0/24")) is not None


# ---------------------------------------------------------------- max-prefix (RFC 4486)


def test_max_prefixes_resets_with_cease_1_and_restarts_after_the_interval(caplog):
    sp, h, a, b = setup(a_settings={"max_prefixes": 10, "max_prefixes_restart": 30.0})
    with caplog.at_level(logging.WARNING, logger="bgp"):
        for i in range(8):
            h.send(a, ok_update(f"10.120.{i}.0/24"))
    assert any("limit 10" in r.getMessage() for r in caplog.records)  # the 75 % warning
    assert not a.closed
    h.send(a, ok_update("10.120.8.0/24") + ok_update("10.120.9.0/24") + ok_update("10.120.10.0/24"))
    assert a.closed
    n = a.notifications()[-1]
    assert (n.code, n.subcode) == (ErrorCode.CEASE, CeaseSubcode.MAXIMUM_PREFIXES_REACHED)
    assert n.data == b"\x00\x01\x01" + (10).to_bytes(4, "big")
    assert sp.rib.adj_in.get(A_ADDR) is None or len(sp.rib.adj_in[A_ADDR]) == 0
    b_intact(sp, h, b)
    assert not {f"10.120.{i}.0/24" for i in range(11)} & b_holds(b)
    # Held down: a new connection is refused until the restart interval is over.
    again = RawPeer(A_ADDR, 65001, conn=-10)
    assert not h.connect(again)
    h.advance(31.0)
    again = RawPeer(A_ADDR, 65001, conn=-11)
    assert h.connect(again) and sp.peers[A_ADDR].state is State.ESTABLISHED


def test_max_prefixes_without_restart_stays_down_until_reconfigured():
    sp, h, a, b = setup(a_settings={"max_prefixes": 2})
    h.send(a, ok_update("10.121.0.0/24") + ok_update("10.121.1.0/24") + ok_update("10.121.2.0/24"))
    assert a.closed
    h.advance(3600.0)
    assert not h.connect(RawPeer(A_ADDR, 65001, conn=-20))
    assert [v.held_down for v in peer_views(sp) if v.address == A_ADDR] == [True]
    sp.set_peers([PeerSettings(A_ADDR, 65001, passive=True, max_prefixes=5), PeerSettings(B_ADDR, 65000, passive=True)], h.now)
    assert h.connect(RawPeer(A_ADDR, 65001, conn=-21))


# ---------------------------------------------------------------- internal errors stay with their peer


def test_a_bug_while_importing_from_one_peer_resets_only_that_peer(monkeypatch):
    sp, h, a, b = setup()
    import bgp.importer as speaker_mod

    real = speaker_mod.import_attributes

    def broken(attributes, source, local):
        if source.key == A_ADDR:
            raise RuntimeError("boom")
        return real(attributes, source, local)

    monkeypatch.setattr(speaker_mod, "import_attributes", broken)
    h.send(a, ok_update("10.130.0.0/24"))
    assert a.closed
    n = a.notifications()[-1]
    assert (n.code, n.subcode) == (ErrorCode.CEASE, CeaseSubcode.ADMINISTRATIVE_RESET)
    assert sp.counters["internal errors"] == 1
    b_intact(sp, h, b)


def test_a_bug_while_exporting_resets_only_the_peers_of_that_group(monkeypatch):
    sp, h, a, b = setup()
    import bgp.export as export_mod

    real = export_mod.UpdateGroup.pump

    def broken(self, key, budget):
        if key == A_ADDR:
            raise RuntimeError("boom")
        return real(self, key, budget)

    monkeypatch.setattr(export_mod.UpdateGroup, "pump", broken)
    sp.set_originated([Origination(IPV4_UNICAST, wire("10.131.0.0/24"))], h.now)
    h.pump()
    assert a.closed
    b_intact(sp, h, b)
    assert "10.131.0.0/24" in b_holds(b)


# ---------------------------------------------------------------- the property: arbitrary UPDATEs from A


_attr_codes = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 14, 15, 16, 17, 18, 32, 35, 99, 255])
_flags = st.sampled_from([0x00, 0x40, 0x80, 0xC0, 0xE0, 0x50, 0x90, 0xD0])


@st.composite
def _attribute(draw) -> bytes:
    code = draw(_attr_codes)
    flags = draw(_flags)
    if draw(st.booleans()):
        value = draw(st.binary(max_size=40))
    elif code == 2:
        n = draw(st.integers(1, 1100))
        value = seg([65001] * min(n, 255)) * max(1, n // 255)
    elif code == 8:
        value = bytes(4 * draw(st.integers(1, 1020)))
    else:
        value = draw(st.binary(min_size=0, max_size=300))
    if flags & 0x10 or len(value) > 255:
        return bytes((flags | 0x10, code)) + struct.pack("!H", len(value)) + value
    return bytes((flags, code, len(value))) + value


_prefix = st.builds(
    lambda n, a, b: bytes((n,)) + bytes((10, a, b))[: (n + 7) // 8], st.integers(8, 24), st.integers(0, 255), st.integers(0, 255)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=st.lists(
        st.tuples(
            st.lists(_attribute(), max_size=6),
            st.lists(_prefix, max_size=5),
            st.lists(_prefix, max_size=3),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_arbitrary_updates_from_one_peer_never_hurt_the_other(messages):
    sp, h, a, b = setup()
    h.send(b, update(ORIGIN + as_path([]) + attr(0x40, 3, IPv4Address(B_ADDR).packed) + attr(0x40, 5, b"\x00\x00\x00\x64"),
                     wire("10.200.0.0/24")))
    b_routes = {p for p in sp.rib.adj_in[B_ADDR].table(IPV4_UNICAST)}
    for attrs, nlri, withdrawn, with_mandatory in messages:
        raw = b"".join(attrs)
        if with_mandatory:
            raw = ORIGIN + as_path([65001]) + NH_A + raw
        body_attrs = raw[:4000]
        msg = update(body_attrs, b"".join(nlri), b"".join(withdrawn))
        if len(msg) > 4096:
            continue
        h.send(a, msg)
        if a.closed:
            # Whatever ended A's session, it was told why.
            assert a.notifications(), "A's session ended without a NOTIFICATION"
            break
    b_intact(sp, h, b)
    assert {p for p in sp.rib.adj_in[B_ADDR].table(IPV4_UNICAST)} == b_routes
    for u in b.updates():  # everything B was sent decodes cleanly
        assert not u.errors, u.errors
    assert sp.counters["internal errors"] == 0
    if a.closed:
        assert not sp.rib.adj_in.get(A_ADDR) or len(sp.rib.adj_in[A_ADDR]) == 0


def test_second_connection_with_open_and_keepalive_in_one_read_leaves_the_first_session_alone():
    """Found by fuzz/session.py: the OPEN and KEEPALIVE of a second connection from an
    Established peer arrive in one read; the collision check closes the newcomer, and the
    session that was Established stays the one in use."""
    sp, h, a, b = setup()
    second = RawPeer(A_ADDR, 65001, conn=-30)
    assert not h.connect(second) or second.closed
    assert second.closed and second.notifications()[-1].subcode == CeaseSubcode.CONNECTION_COLLISION_RESOLUTION
    assert not a.closed and sp.peers[A_ADDR].state is State.ESTABLISHED
    h.send(a, ok_update("10.140.0.0/24"))
    assert sp.rib.best(IPV4_UNICAST, wire("10.140.0.0/24")) is not None
    assert sp._conn_owner.get(a.conn) is sp.peers[A_ADDR]
    b_intact(sp, h, b)
