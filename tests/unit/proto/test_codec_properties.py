"""Property tests: encode∘decode round trips, and hostile bytes only ever raise DecodeError."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address

import pytest
from codec_build import MANDATORY, NLRI, attr, mp_reach, segment, update, update_body
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import (
    AS_CONFED_SEQUENCE,
    AS_CONFED_SET,
    AS_SEQUENCE,
    AS_SET,
    CAPABILITIES,
    ATTRIBUTES,
    Aggregator,
    AsPath,
    AsPathSegment,
    AtomicAggregate,
    ClusterList,
    CodecContext,
    Communities,
    DecodeError,
    FourOctetAs,
    GracefulRestart,
    GracefulRestartFamily,
    Keepalive,
    LargeCommunities,
    LocalPref,
    MessageReader,
    MpReachNlri,
    MpUnreachNlri,
    MultiExitDisc,
    MultiProtocol,
    NextHop,
    Notification,
    Open,
    Origin,
    OriginatorId,
    PathAttributes,
    RouteRefresh,
    RouteRefreshCapability,
    UnknownAttribute,
    UnknownCapability,
    Update,
    decode_message,
    decode_prefixes,
    encode_updates,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NEW = CodecContext()
OLD = CodecContext(four_octet_as=False)

u8 = st.integers(0, 255)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
asn = st.integers(1, 0xFFFFFFFF)
ipv4 = st.builds(IPv4Address, u32)
unicast_v4 = st.builds(IPv4Address, st.integers(0x01000000, 0xDFFFFFFF))
# Neither :: nor multicast (ff00::/8): the global next hop of MP_REACH_NLRI is a host address.
unicast_v6 = st.builds(IPv6Address, st.integers(1, (0xFF << 120) - 1))


@st.composite
def prefixes(draw: st.DrawFn, afi: int) -> bytes:
    bits = 32 if afi == 1 else 128
    plen = draw(st.integers(0, bits))
    value = draw(st.integers(0, (1 << bits) - 1)) >> (bits - plen) << (bits - plen) if plen else 0
    return bytes((plen,)) + value.to_bytes(bits // 8, "big")[: (plen + 7) // 8]


def segments(confed: bool) -> st.SearchStrategy[tuple[AsPathSegment, ...]]:
    types = [AS_SEQUENCE, AS_SET] + ([AS_CONFED_SEQUENCE, AS_CONFED_SET] if confed else [])
    seg = st.builds(AsPathSegment, st.sampled_from(types), st.lists(asn, min_size=1, max_size=12).map(tuple))
    return st.lists(seg, max_size=4).map(tuple)


@st.composite
def attributes(draw: st.DrawFn, with_next_hop: bool, old: bool = False) -> PathAttributes:
    """Path attributes that round-trip.  For a 2-octet session only leading
    confederation segments survive AS4_PATH reconstruction (RFC 6793 §4.2.3), and their
    AS numbers must fit in 2 octets since AS4_PATH never carries them (RFC 6793 §3)."""
    if old:
        member = st.integers(1, 0xFFFF)
        lead = draw(st.lists(st.builds(AsPathSegment, st.just(AS_CONFED_SEQUENCE), st.lists(member, min_size=1, max_size=3).map(tuple)), max_size=1))
        segs = tuple(lead) + draw(segments(False))
    else:
        segs = draw(segments(True))
    items = [Origin(draw(st.integers(0, 2))), AsPath(segs)]
    if with_next_hop:
        items.append(NextHop(draw(unicast_v4)))
    optional = [
        st.builds(MultiExitDisc, u32),
        st.builds(LocalPref, u32),
        st.just(AtomicAggregate()),
        st.builds(Aggregator, asn, ipv4),
        st.builds(Communities, st.lists(u32, min_size=1, max_size=80).map(tuple)),
        st.builds(OriginatorId, ipv4),
        st.builds(ClusterList, st.lists(ipv4, min_size=1, max_size=5).map(tuple)),
        st.builds(LargeCommunities, st.lists(st.tuples(u32, u32, u32), min_size=1, max_size=5).map(tuple)),
        st.builds(
            UnknownAttribute,
            st.integers(19, 255).filter(lambda c: c not in ATTRIBUTES),
            st.just(0xE0),
            st.binary(max_size=300),
        ),
    ]
    for strategy in optional:
        if draw(st.booleans()):
            items.append(draw(strategy))
    return PathAttributes(tuple(items))


@st.composite
def updates(draw: st.DrawFn, old: bool = False) -> Update:
    family = draw(st.sampled_from(["ipv4", "ipv6", "withdraw6", "eor"]))
    if family == "eor":
        return Update.end_of_rib_marker(*draw(st.sampled_from([(1, 1), (2, 1)])))
    withdrawn = tuple(draw(st.lists(prefixes(1), max_size=30)))
    if family == "ipv4":
        nlri = tuple(draw(st.lists(prefixes(1), min_size=1, max_size=60)))
        return Update(withdrawn, draw(attributes(True, old)), nlri)
    if family == "withdraw6":
        return Update(withdrawn, mp_unreach=MpUnreachNlri(2, 1, tuple(draw(st.lists(prefixes(2), max_size=40)))))
    hops = [draw(unicast_v6), *draw(st.lists(st.builds(IPv6Address, st.integers(0, (1 << 128) - 1)), max_size=1))]
    reach = MpReachNlri(2, 1, tuple(hops), tuple(draw(st.lists(prefixes(2), min_size=1, max_size=40))))
    return Update(withdrawn, draw(attributes(False, old)), (), reach)


def roundtrip(msg: object, ctx: CodecContext) -> object:
    try:
        wire = msg.encode(ctx)  # type: ignore[attr-defined]
    except ValueError:
        return msg  # larger than 4096 octets: nothing to send, nothing to check
    reader = MessageReader()
    reader.feed(wire)
    msg_type, body = reader.next_message()  # type: ignore[misc]
    return decode_message(msg_type, body, ctx)


@FAST
@given(updates())
def test_update_round_trip(u: Update) -> None:
    assert roundtrip(u, NEW) == u


@FAST
@given(updates(old=True))
def test_update_round_trip_on_a_2_octet_session(u: Update) -> None:
    assert roundtrip(u, OLD) == u


capabilities = st.one_of(
    st.builds(MultiProtocol, u16, u8),
    st.just(RouteRefreshCapability()),
    st.builds(FourOctetAs, asn),
    st.builds(
        GracefulRestart,
        st.booleans(),
        st.integers(0, 4095),
        st.lists(st.builds(GracefulRestartFamily, u16, u8, st.booleans(), st.integers(0, 0x7F)), max_size=4).map(tuple),
        st.booleans(),
        st.integers(0, 3),
    ),
    st.builds(UnknownCapability, u8.filter(lambda c: c not in CAPABILITIES), st.binary(max_size=60)),
)


@FAST
@given(
    st.integers(1, 0xFFFF),
    st.one_of(st.just(0), st.integers(3, 0xFFFF)),
    st.integers(1, 0xFFFFFFFF).map(IPv4Address),
    st.lists(capabilities, max_size=12).map(tuple),
)
def test_open_round_trip(my_as: int, hold: int, router_id: IPv4Address, caps: tuple) -> None:
    msg = Open(my_as, hold, router_id, caps)
    assert roundtrip(msg, NEW) == msg


@FAST
@given(u8, u8, st.binary(max_size=200))
def test_notification_round_trip(code: int, subcode: int, data: bytes) -> None:
    msg = Notification(code, subcode, data)
    assert roundtrip(msg, NEW) == msg
    str(msg)  # never raises, whatever the data


@FAST
@given(u16, u8, u8)
def test_route_refresh_and_keepalive_round_trip(afi: int, safi: int, subtype: int) -> None:
    assert roundtrip(RouteRefresh(afi, safi, subtype), NEW) == RouteRefresh(afi, safi, subtype)
    assert roundtrip(Keepalive(), NEW) == Keepalive()


@FAST
@given(st.lists(prefixes(2), min_size=1, max_size=700), st.integers(200, 4096))
def test_encode_updates_covers_every_prefix_within_the_size(prefix_list: list[bytes], max_size: int) -> None:
    attrs = PathAttributes.of(Origin(0), AsPath(), LocalPref(100))
    messages = encode_updates(2, attrs, IPv6Address("2001:db8::1"), prefix_list, NEW, max_size)
    assert all(len(m) <= max_size for m in messages)
    got = [p for m in messages for p in Update.decode(m[19:]).mp_reach.nlri]  # type: ignore[union-attr]
    assert got == prefix_list


def feed_everything(data: bytes, ctx: CodecContext) -> None:
    """Feed ``data`` to a reader and decode every message; only DecodeError may escape."""
    reader = MessageReader()
    reader.feed(data)
    cache: dict = {}
    try:
        for _ in range(len(data) // 19 + 1):  # each message consumes >= 19 octets: bounded
            got = reader.next_message()
            if got is None:
                return
            msg = decode_message(got[0], got[1], ctx, cache)
            str(msg)
    except DecodeError as exc:
        assert str(exc)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200), st.booleans())
def test_random_bytes_only_raise_decode_error(data: bytes, four_octet: bool) -> None:
    ctx = CodecContext(four_octet_as=four_octet)
    feed_everything(data, ctx)
    # Also behind a valid header, so the body decoders see the random bytes.
    for msg_type in (1, 2, 3, 4, 5):
        feed_everything(b"\xff" * 16 + (19 + len(data)).to_bytes(2, "big") + bytes((msg_type,)) + data, ctx)
    try:
        decode_prefixes(data, 1 + four_octet)
    except DecodeError:
        pass


SEEDS = [
    update(MANDATORY + attr(0x80, 4, b"\x00\x00\x00\x05") + attr(0xC0, 8, b"\x00\x01\x00\x02") + attr(0xC0, 32, bytes(12))),
    update(MANDATORY + attr(0xC0, 7, bytes(8)) + attr(0xC0, 17, bytes(6)) + attr(0x80, 9, bytes(4)), NLRI * 3, NLRI),
    Update(
        attributes=PathAttributes.of(Origin(0), AsPath()),
        mp_reach=MpReachNlri(2, 1, (IPv6Address("2001:db8::1"), IPv6Address("fe80::1")), (b"\x00", b"\x40" + bytes(8))),
    ).encode(),
    Update(mp_unreach=MpUnreachNlri(2, 1, (b"\x30" + bytes(6),))).encode(),
    Open.build(4200000001, 90, "10.0.0.1", [MultiProtocol(1, 1), GracefulRestart(True, 120, (GracefulRestartFamily(1, 1, True),))]).encode(),
    Notification.cease(2, "bye").encode(),
    RouteRefresh(1, 1, 2).encode(),
    Keepalive().encode(),
]


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from(SEEDS),
    st.lists(st.tuples(st.integers(0, 4096), u8, st.sampled_from(["set", "cut", "insert"])), min_size=1, max_size=4),
    st.booleans(),
)
def test_mutated_messages_only_raise_decode_error(seed: bytes, edits: list, four_octet: bool) -> None:
    data = bytearray(seed)
    for pos, value, op in edits:
        pos %= len(data) + 1
        if op == "set" and pos < len(data):
            data[pos] = value
        elif op == "cut":
            del data[pos:]
        else:
            data[pos:pos] = bytes((value,))
        if not data:
            data = bytearray(b"\xff")
    feed_everything(bytes(data), CodecContext(four_octet_as=four_octet))


@FAST
@given(st.binary(max_size=300))
def test_decode_prefixes_output_is_normalized(data: bytes) -> None:
    try:
        out = decode_prefixes(data, 2)
    except DecodeError as exc:
        assert (exc.code, exc.subcode) == (3, 10)
        return
    assert b"".join(out) == data or len(b"".join(out)) == len(data)
    for p in out:
        assert p[0] <= 128 and len(p) == 1 + (p[0] + 7) // 8
        if p[0] % 8:
            assert p[-1] & (0xFF >> (p[0] % 8)) == 0


@FAST
@given(st.integers(0, 128), st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=80), st.booleans())
def test_decode_prefixes_same_length_fields(plen: int, addresses: list[bytes], mix: bool) -> None:
    """Fields where every prefix has one length take a fast path: it must agree with the
    general walk, host bits included (they are set on purpose here)."""
    size = (plen + 7) // 8
    raw = [bytes((plen,)) + a[:size] for a in addresses]
    if mix and plen % 8 not in (0, 1):
        raw[len(raw) // 2] = bytes((plen - 1,)) + raw[len(raw) // 2][1:]  # same size, other length
    expected = []
    for p in raw:
        n = p[0]
        value = int.from_bytes(p[1:].ljust(16, b"\x00"), "big") >> (128 - n) << (128 - n) if n else 0
        expected.append(bytes((n,)) + value.to_bytes(16, "big")[: (n + 7) // 8])
    assert decode_prefixes(b"".join(raw), 2) == expected


def _walk_prefixes(data: bytes, afi: int) -> list[bytes] | None:
    """The octet-by-octet reading of an NLRI field (RFC 4271 §4.3), host bits cleared; None if invalid."""
    max_len, pos, out = (32 if afi == 1 else 128), 0, []
    while pos < len(data):
        n = data[pos]
        size = (n + 7) // 8
        if n > max_len or pos + 1 + size > len(data):
            return None
        value = int.from_bytes(data[pos + 1 : pos + 1 + size].ljust(16, b"\x00"), "big") >> (128 - n) << (128 - n) if n else 0
        out.append(bytes((n,)) + value.to_bytes(16, "big")[:size])
        pos += 1 + size
    return out


@FAST
@given(
    st.sampled_from([1, 2]),
    st.lists(st.tuples(st.integers(0, 130), st.binary(min_size=16, max_size=16)), max_size=60),
    st.integers(0, 3),
)
def test_decode_prefixes_mixed_fields_agree_with_the_walk(afi: int, items: list, trim: int) -> None:
    """The one-pass regular-expression cut must give what the walk gives, for every mix of
    lengths, host bits set or clear, and for invalid lengths and overruns the same error."""
    data = b"".join(bytes((n,)) + a[: (n + 7) // 8] for n, a in items)
    data = data[: len(data) - trim] if trim < len(data) else data
    expected = _walk_prefixes(data, afi)
    if expected is None:
        with pytest.raises(DecodeError) as info:
            decode_prefixes(data, afi)
        assert (info.value.code, info.value.subcode) == (3, 10)
    else:
        assert decode_prefixes(data, afi) == expected


# Attributes for the cached-vs-plain equivalence below, by type code: well-formed ones and
# every kind of outcome the general path knows (a bad NEXT_HOP, wrong flags, Partial,
# Extended Length, an unknown optional one, AS4_PATH, LOCAL_PREF, a confederation segment,
# MP_REACH_NLRI, a truncated header), so blocks fall on both sides of decode()'s shortcut.
_VARIANTS = {
    1: [attr(0x40, 1, b"\x00"), attr(0x40, 1, b"\x02"), attr(0x40, 1, b"\x07")],  # the last out of range
    2: [
        attr(0x40, 2, segment(2, [65001, 65002])),
        attr(0x40, 2, segment(2, [65003])),
        attr(0x40, 2, segment(3, [65010, 65011])),  # confederation: malformed from an external peer
        attr(0x50, 2, segment(2, [65001, 65002])),  # Extended Length
        attr(0x40, 2, segment(2, [65001, 23456], width=2)),  # for a 2-octet session, AS_TRANS
    ],
    3: [
        attr(0x40, 3, bytes((192, 0, 2, 1))),
        attr(0x40, 3, bytes((192, 0, 2, 2))),
        attr(0x40, 3, bytes((0, 0, 0, 0))),  # not a host address
        attr(0x40, 3, bytes((224, 0, 0, 1))),  # multicast
        attr(0xC0, 3, bytes((192, 0, 2, 1))),  # flags conflict
    ],
    4: [attr(0x80, 4, b"\x00\x00\x00\x05"), attr(0x80, 4, b"\x00\x00\x00\x06"), attr(0x80, 4, b"\x00\x05")],
    5: [attr(0x40, 5, b"\x00\x00\x00\x64")],
    8: [attr(0xC0, 8, b"\xfd\xe9\x00\x01"), attr(0xE0, 8, b"\xfd\xe9\x00\x02"), attr(0xC0, 8, b"\xfd\xe9\x00")],
    14: [mp_reach()],
    17: [attr(0xC0, 17, segment(2, [70000])), attr(0xC0, 17, segment(2, [65001, 70000]))],  # AS4_PATH
    97: [attr(0x40, 97, b"x")],  # unknown well-known: session reset
    98: [attr(0x80, 98, b"x")],  # unknown optional non-transitive
    99: [attr(0xC0, 99, b"opaque")],  # unknown optional transitive
}
_COMMON = (1, 2, 3, 4, 8, 17)


@st.composite
def _attribute_blocks(draw: st.DrawFn) -> bytes:
    """Mostly what speakers send (ORIGIN, AS_PATH, NEXT_HOP, maybe MED and COMMUNITIES, in
    code order), otherwise any codes, shuffled or repeated, maybe cut short."""
    codes = [c for c in _COMMON if c < 4 or draw(st.booleans())]
    if draw(st.integers(0, 3)) == 0:
        codes = draw(st.lists(st.sampled_from(sorted(_VARIANTS)), max_size=6))
    if draw(st.integers(0, 4)) == 0:
        codes = draw(st.permutations(codes))
    block = b"".join(draw(st.sampled_from(_VARIANTS[c])) for c in codes)
    if draw(st.integers(0, 9)) == 0:
        block += b"\x40\x01"  # a header cut short
    return block


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(_attribute_blocks(), min_size=1, max_size=8),
    st.booleans(),
    st.booleans(),
    st.sampled_from([NLRI, b"", NLRI + b"\x10\x0a\x01", b"\x21\x00"]),
    st.sampled_from([b"", b"\x18\x0a\x00\x02"]),
)
def test_decoding_with_a_cache_gives_what_decoding_without_one_gives(
    blocks: list[bytes], four_octet: bool, external: bool, nlri: bytes, withdrawn: bytes
) -> None:
    """The session's cache (whole blocks, interned single attributes, and decode()'s shortcut
    for plain UPDATEs) never changes a result: each body, decoded twice through one cache,
    equals the body decoded alone, or raises the same error."""
    ctx = CodecContext(four_octet_as=four_octet, external=external)
    cache: dict = {}
    bodies = [update_body(block, nlri, withdrawn) for block in blocks]

    def outcome(body: bytes, with_cache: dict | None) -> object:
        try:
            return Update.decode(body, ctx, with_cache)
        except DecodeError as exc:
            return ("error", exc.code, exc.subcode, str(exc))

    for _ in range(2):
        for body in bodies:
            assert outcome(body, cache) == outcome(body, None)
