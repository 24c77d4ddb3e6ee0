"""Hand-written round trips and byte vectors for every message, capability and attribute."""

from __future__ import annotations

import struct
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

import pytest
from codec_build import AS_PATH, AS_PATH2, MANDATORY, NEXT_HOP, NLRI, ORIGIN, attr, capability, message, segment, update_body

from proto import (
    AS_CONFED_SEQUENCE,
    AS_CONFED_SET,
    AS_SEQUENCE,
    AS_SET,
    AS_TRANS,
    DEFAULT_CONTEXT,
    EMPTY_ATTRIBUTES,
    NO_EXPORT,
    Aggregator,
    As4Aggregator,
    As4Path,
    AsPath,
    AsPathSegment,
    AtomicAggregate,
    CeaseSubcode,
    ClusterList,
    CodecContext,
    Communities,
    DecodeError,
    ErrorAction,
    FourOctetAs,
    GracefulRestart,
    GracefulRestartFamily,
    Keepalive,
    LargeCommunities,
    LocalPref,
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
    community_from_str,
    community_to_str,
    decode_message,
    decode_prefixes,
    encode_prefixes,
    encode_updates,
    encode_withdrawals,
    error_name,
    prefix_from_str,
    prefix_len,
    prefix_to_network,
    prefix_to_str,
)
from proto.capabilities import decode_capability

OLD = CodecContext(four_octet_as=False)
NEW = DEFAULT_CONTEXT
A = IPv4Address


def p4(text: str) -> bytes:
    return prefix_from_str(text)[1]


def body(msg: bytes) -> bytes:
    return msg[19:]


# ------------------------------------------------------------------ prefixes


def test_prefix_wire_form() -> None:
    assert prefix_from_str("10.1.0.0/16") == (1, b"\x10\x0a\x01")
    assert prefix_from_str("0.0.0.0/0") == (1, b"\x00")
    assert prefix_from_str("2001:db8::/32") == (2, b"\x20\x20\x01\x0d\xb8")
    assert prefix_from_str("192.0.2.1/32")[1] == b"\x20\xc0\x00\x02\x01"
    assert prefix_to_str(1, b"\x10\x0a\x01") == "10.1.0.0/16"
    assert prefix_to_str(2, b"\x00") == "::/0"
    assert prefix_to_network(1, b"\x14\x0a\x01\x10") == IPv4Network("10.1.16.0/20")
    assert prefix_to_network(2, b"\x80" + bytes(15) + b"\x01") == IPv6Network("::1/128")
    assert prefix_len(b"\x14\x0a\x01\x10") == 20
    assert encode_prefixes([b"\x00", b"\x08\x0a"]) == b"\x00\x08\x0a"


@pytest.mark.parametrize("text", ["10.1.0.1/16", "300.1.0.0/16", "10.0.0.0/33", "nonsense", "", "2001:db8::1/32"])
def test_prefix_from_str_rejects_bad_text(text: str) -> None:
    with pytest.raises(ValueError, match="invalid prefix"):
        prefix_from_str(text)


def test_prefix_to_str_rejects_malformed_wire_prefix() -> None:
    with pytest.raises(ValueError):
        prefix_to_str(1, b"\x18\x0a")
    with pytest.raises(ValueError):
        prefix_to_str(3, b"\x00")


def test_decode_prefixes_zeroes_host_bits_and_handles_edges() -> None:
    # 10.1.31.255/20 -> 10.1.16.0/20; /0; /32; IPv6 /127
    data = b"\x14\x0a\x01\x1f" + b"\x00" + b"\x20\x01\x02\x03\x04"
    assert decode_prefixes(data, 1) == [b"\x14\x0a\x01\x10", b"\x00", b"\x20\x01\x02\x03\x04"]
    assert decode_prefixes(memoryview(b"\x7f" + b"\xff" * 16), 2) == [b"\x7f" + b"\xff" * 15 + b"\xfe"]
    assert decode_prefixes(b"", 1) == []
    with pytest.raises(DecodeError) as info:
        decode_prefixes(b"\x81" + bytes(17), 2)
    assert (info.value.code, info.value.subcode) == (3, 10)


# ------------------------------------------------------------------ capabilities


@pytest.mark.parametrize(
    ("cap", "wire"),
    [
        (MultiProtocol(1, 1), b"\x01\x04\x00\x01\x00\x01"),
        (MultiProtocol(2, 1), b"\x01\x04\x00\x02\x00\x01"),
        (RouteRefreshCapability(), b"\x02\x00"),
        (FourOctetAs(4200000001), b"\x41\x04\xfa\x56\xea\x01"),
        (GracefulRestart(False, 120), b"\x40\x02\x00\x78"),
        (
            GracefulRestart(True, 4095, (GracefulRestartFamily(1, 1, True), GracefulRestartFamily(2, 1, False)), True),
            b"\x40\x0a\xcf\xff\x00\x01\x01\x80\x00\x02\x01\x00",
        ),
        (GracefulRestart(False, 1, (), False, 0x3), b"\x40\x02\x30\x01"),
        (UnknownCapability(70, b""), b"\x46\x00"),
        (UnknownCapability(73, b"\x04host\x00"), b"\x49\x06\x04host\x00"),
    ],
)
def test_capability_round_trip(cap: object, wire: bytes) -> None:
    assert cap.encode() == wire  # type: ignore[attr-defined]
    assert decode_capability(wire[0], wire[2:]) == cap


def test_multiprotocol_ignores_reserved_octet() -> None:
    assert MultiProtocol.decode_value(b"\x00\x02\xff\x01") == MultiProtocol(2, 1)


# ------------------------------------------------------------------ attributes


ATTRIBUTE_VECTORS = [
    (Origin(2), NEW, b"\x40\x01\x01\x02"),
    (AsPath(), NEW, b"\x40\x02\x00"),
    (AsPath((AsPathSegment(AS_SEQUENCE, (65001, 4200000001)),)), NEW, b"\x40\x02\x0a\x02\x02\x00\x00\xfd\xe9\xfa\x56\xea\x01"),
    (AsPath((AsPathSegment(AS_SEQUENCE, (65001,)), AsPathSegment(AS_SET, (1, 2)))), OLD, b"\x40\x02\x0a\x02\x01\xfd\xe9\x01\x02\x00\x01\x00\x02"),
    (NextHop(A("192.0.2.1")), NEW, b"\x40\x03\x04\xc0\x00\x02\x01"),
    (MultiExitDisc(5), NEW, b"\x80\x04\x04\x00\x00\x00\x05"),
    (LocalPref(100), NEW, b"\x40\x05\x04\x00\x00\x00\x64"),
    (AtomicAggregate(), NEW, b"\x40\x06\x00"),
    (Aggregator(65001, A("10.0.0.1")), NEW, b"\xc0\x07\x08\x00\x00\xfd\xe9\x0a\x00\x00\x01"),
    (Aggregator(65001, A("10.0.0.1")), OLD, b"\xc0\x07\x06\xfd\xe9\x0a\x00\x00\x01"),
    (Communities((0xFDE80064, NO_EXPORT)), NEW, b"\xc0\x08\x08\xfd\xe8\x00\x64\xff\xff\xff\x01"),
    (OriginatorId(A("10.0.0.9")), NEW, b"\x80\x09\x04\x0a\x00\x00\x09"),
    (ClusterList((A("10.0.0.1"), A("10.0.0.2"))), NEW, b"\x80\x0a\x08\x0a\x00\x00\x01\x0a\x00\x00\x02"),
    (
        MpReachNlri(2, 1, (IPv6Address("2001:db8::1"),), (b"\x30\x20\x01\x0d\xb8\x00\x01",)),
        NEW,
        b"\x80\x0e\x1c\x00\x02\x01\x10\x20\x01\x0d\xb8" + bytes(11) + b"\x01\x00\x30\x20\x01\x0d\xb8\x00\x01",
    ),
    (MpReachNlri(1, 1, (A("192.0.2.1"),), (NLRI,)), NEW, b"\x80\x0e\x0d\x00\x01\x01\x04\xc0\x00\x02\x01\x00" + NLRI),
    (MpUnreachNlri(2, 1, ()), NEW, b"\x80\x0f\x03\x00\x02\x01"),
    (MpUnreachNlri(2, 1, (b"\x00",)), NEW, b"\x80\x0f\x04\x00\x02\x01\x00"),
    (As4Path((AsPathSegment(AS_SEQUENCE, (4200000001,)),)), OLD, b"\xc0\x11\x06\x02\x01\xfa\x56\xea\x01"),
    (As4Aggregator(4200000001, A("10.0.0.1")), OLD, b"\xc0\x12\x08\xfa\x56\xea\x01\x0a\x00\x00\x01"),
    (LargeCommunities(((4200000001, 1, 2),)), NEW, b"\xc0\x20\x0c\xfa\x56\xea\x01\x00\x00\x00\x01\x00\x00\x00\x02"),
]


@pytest.mark.parametrize(
    ("attribute", "ctx", "wire"),
    ATTRIBUTE_VECTORS,
    ids=[f"{type(a).__name__}-{'4' if c.four_octet_as else '2'}-octet-{i}" for i, (a, c, _) in enumerate(ATTRIBUTE_VECTORS)],
)
def test_attribute_round_trip(attribute: object, ctx: CodecContext, wire: bytes) -> None:
    assert attribute.encode(ctx) == wire  # type: ignore[attr-defined]
    cls = type(attribute)
    assert cls.decode_value(wire[3:], wire[0], ctx) == attribute  # type: ignore[attr-defined]


def test_extended_length_is_used_exactly_above_255_octets() -> None:
    short = Communities(tuple(range(63)))  # 252 octets
    edge = Communities(tuple(range(64)))  # 256 octets
    assert short.encode(NEW)[:3] == b"\xc0\x08\xfc"
    assert edge.encode(NEW)[:4] == b"\xd0\x08\x01\x00"
    assert Communities.decode_value(edge.encode(NEW)[4:], 0xD0, NEW) == edge
    # A received attribute with Extended Length for a short value decodes the same.
    raw = update_body(MANDATORY + attr(0xD0, 8, b"\x00\x01\x00\x02"))
    assert Update.decode(raw).attributes.communities == (0x00010002,)


def test_community_text() -> None:
    assert community_to_str(0xFDE80064) == "65000:100"
    assert community_from_str("65000:100") == 0xFDE80064
    assert community_from_str("no-export") == NO_EXPORT
    assert str(Communities((0xFDE80064, NO_EXPORT))) == "65000:100 65535:65281"
    assert str(LargeCommunities(((1, 2, 3),))) == "1:2:3"
    # "٣" is no 3 and "²" no digit to int(); 5000 digits are more than int() reads
    for bad in ("65536:1", "1:", "x:y", "1:2:3", "٣:1", "1:٣", "²:1", "1:" + "9" * 5000, "0" * 5000 + "1:1"):
        with pytest.raises(ValueError, match="invalid community"):
            community_from_str(bad)


def test_as_path_helpers() -> None:
    path = AsPath(
        (
            AsPathSegment(AS_CONFED_SEQUENCE, (64512,)),
            AsPathSegment(AS_SEQUENCE, (65001, 65002)),
            AsPathSegment(AS_SET, (65003, 65004)),
            AsPathSegment(AS_CONFED_SET, (64513,)),
        )
    )
    assert path.path_length() == 3
    assert path.first_asn() == 65001
    assert path.contains(65004) and path.contains(64512) and not path.contains(1)
    assert path.asns() == (64512, 65001, 65002, 65003, 65004, 64513)
    assert str(path) == "(64512) 65001 65002 {65003,65004} [64513]"
    assert str(AsPath((AsPathSegment(AS_SEQUENCE, (65001, 65002)), AsPathSegment(AS_SET, (65003, 65004))))) == (
        "65001 65002 {65003,65004}"
    )
    assert AsPath().first_asn() is None and AsPath().path_length() == 0 and str(AsPath()) == ""
    assert AsPath((AsPathSegment(AS_SET, (1, 2)),)).first_asn() is None
    assert AsPath().prepend(65001) == AsPath((AsPathSegment(AS_SEQUENCE, (65001,)),))
    assert path.prepend(7).segments[0] == AsPathSegment(AS_SEQUENCE, (7,))
    full = AsPath((AsPathSegment(AS_SEQUENCE, tuple(range(1, 256))),))
    assert full.prepend(9).segments == (AsPathSegment(AS_SEQUENCE, (9,)), full.segments[0])
    assert AsPath((AsPathSegment(AS_SEQUENCE, (2,)),)).prepend(1).segments == (AsPathSegment(AS_SEQUENCE, (1, 2)),)


def test_long_sequence_is_split_into_255_asn_segments() -> None:
    path = AsPath((AsPathSegment(AS_SEQUENCE, tuple(range(1, 301))),))
    decoded = AsPath.decode_value(path.encode_value(NEW), 0x50, NEW)
    assert [len(s.asns) for s in decoded.segments] == [255, 45]
    assert decoded.asns() == path.asns() and decoded.path_length() == 300


# ------------------------------------------------------------------ PathAttributes


def test_path_attributes_set_semantics() -> None:
    attrs = PathAttributes((LocalPref(5), Origin(0), AsPath()))
    assert [a.code for a in attrs] == [1, 2, 5]
    assert len(attrs) == 3 and 5 in attrs and 4 not in attrs
    assert attrs.get(5) == LocalPref(5) and attrs.get(4) is None
    assert (attrs.origin, attrs.local_pref, attrs.med, attrs.next_hop) == (0, 5, None, None)
    assert attrs.as_path == AsPath() and EMPTY_ATTRIBUTES.as_path == AsPath()
    assert (attrs.communities, attrs.large_communities, attrs.cluster_list) == ((), (), ())
    assert attrs.atomic_aggregate is False and attrs.aggregator is None and attrs.originator_id is None
    same = PathAttributes((Origin(0), AsPath(), LocalPref(5)))
    assert same == attrs and hash(same) == hash(attrs)
    assert {attrs: 1}[same] == 1
    changed = attrs.replace(LocalPref(7), MultiExitDisc(3))
    assert changed.local_pref == 7 and changed.med == 3 and attrs.local_pref == 5
    assert changed.without(4, 5) == PathAttributes((Origin(0), AsPath()))
    assert attrs.without(99) is attrs
    with pytest.raises(ValueError, match="two attributes"):
        PathAttributes((Origin(0), Origin(1)))
    with pytest.raises(ValueError, match="belong on the Update"):
        PathAttributes((MpUnreachNlri(2, 1),))
    full = PathAttributes.of(
        NextHop(A("1.2.3.4")), AtomicAggregate(), Aggregator(1, A("1.1.1.1")), Communities((1,)),
        LargeCommunities(((1, 2, 3),)), OriginatorId(A("2.2.2.2")), ClusterList((A("3.3.3.3"),)),
    )
    assert full.next_hop == A("1.2.3.4") and full.atomic_aggregate and full.aggregator == Aggregator(1, A("1.1.1.1"))
    assert full.communities == (1,) and full.large_communities == ((1, 2, 3),)
    assert full.originator_id == A("2.2.2.2") and full.cluster_list == (A("3.3.3.3"),)


# ------------------------------------------------------------------ RFC 6793: 2-octet sessions


def as2(*segments: bytes) -> bytes:
    return attr(0x40, 2, b"".join(segments))


def as4(*segments: bytes) -> bytes:
    return attr(0xC0, 17, b"".join(segments))


def decode_old(attrs: bytes) -> Update:
    return Update.decode(update_body(attrs), OLD)


def test_as4_path_fills_in_as_trans() -> None:
    # RFC 6793 §4.2.3: AS_PATH counts 4, AS4_PATH 3: one leading AS from AS_PATH.
    u = decode_old(
        ORIGIN + as2(segment(2, [65001, AS_TRANS, AS_TRANS, 65002], 2)) + NEXT_HOP
        + as4(segment(2, [4200000001, 4200000002, 65002]))
    )
    assert u.errors == ()
    assert u.attributes.as_path == AsPath((AsPathSegment(AS_SEQUENCE, (65001, 4200000001, 4200000002, 65002)),))
    assert 17 not in u.attributes


def test_as4_path_with_as_set() -> None:
    u = decode_old(
        ORIGIN + as2(segment(2, [65001, AS_TRANS], 2), segment(1, [65010, AS_TRANS], 2)) + NEXT_HOP
        + as4(segment(2, [4200000001]), segment(1, [65010, 4200000002]))
    )
    assert u.attributes.as_path.segments == (
        AsPathSegment(AS_SEQUENCE, (65001, 4200000001)),
        AsPathSegment(AS_SET, (65010, 4200000002)),
    )


def test_as4_path_longer_than_as_path_is_ignored() -> None:
    u = decode_old(ORIGIN + as2(segment(2, [AS_TRANS], 2)) + NEXT_HOP + as4(segment(2, [4200000001, 4200000002])))
    assert u.attributes.as_path == AsPath((AsPathSegment(AS_SEQUENCE, (AS_TRANS,)),))
    assert u.errors == ()


def test_as4_path_keeps_leading_confederation_segment_and_drops_its_own() -> None:
    u = decode_old(
        ORIGIN + as2(segment(3, [64512], 2), segment(2, [AS_TRANS, 65002], 2)) + NEXT_HOP
        + as4(segment(4, [64999]), segment(2, [4200000001, 65002]))
    )
    assert u.attributes.as_path.segments == (
        AsPathSegment(AS_CONFED_SEQUENCE, (64512,)),
        AsPathSegment(AS_SEQUENCE, (4200000001, 65002)),
    )


def test_aggregator_as_trans_is_replaced_by_as4_aggregator() -> None:
    agg2 = attr(0xC0, 7, struct.pack("!H", AS_TRANS) + b"\x0a\x00\x00\x01")
    agg4 = attr(0xC0, 18, struct.pack("!I", 4200000009) + b"\x0a\x00\x00\x01")
    u = decode_old(ORIGIN + as2(segment(2, [AS_TRANS], 2)) + NEXT_HOP + agg2 + as4(segment(2, [4200000001])) + agg4)
    assert u.attributes.aggregator == Aggregator(4200000009, A("10.0.0.1"))
    assert u.attributes.as_path.asns() == (4200000001,)
    assert 18 not in u.attributes and 17 not in u.attributes


def test_aggregator_without_as_trans_makes_as4_attributes_ignored() -> None:
    agg2 = attr(0xC0, 7, struct.pack("!H", 65005) + b"\x0a\x00\x00\x01")
    agg4 = attr(0xC0, 18, struct.pack("!I", 4200000009) + b"\x0a\x00\x00\x01")
    u = decode_old(ORIGIN + as2(segment(2, [AS_TRANS], 2)) + NEXT_HOP + agg2 + as4(segment(2, [4200000001])) + agg4)
    assert u.attributes.aggregator == Aggregator(65005, A("10.0.0.1"))
    assert u.attributes.as_path.asns() == (AS_TRANS,)


def test_aggregator_alone_does_not_stop_as4_path() -> None:
    # The "ignore" rule needs both AGGREGATOR and AS4_AGGREGATOR (RFC 6793 §4.2.3).
    agg2 = attr(0xC0, 7, struct.pack("!H", 65005) + b"\x0a\x00\x00\x01")
    u = decode_old(ORIGIN + as2(segment(2, [AS_TRANS], 2)) + NEXT_HOP + agg2 + as4(segment(2, [4200000001])))
    assert u.attributes.as_path.asns() == (4200000001,)
    assert u.attributes.aggregator == Aggregator(65005, A("10.0.0.1"))


def test_encoding_for_an_old_speaker_adds_as4_attributes() -> None:
    attrs = PathAttributes.of(
        Origin(0),
        AsPath((AsPathSegment(AS_CONFED_SEQUENCE, (64512,)), AsPathSegment(AS_SEQUENCE, (65001, 4200000001)))),
        Aggregator(4200000009, A("10.0.0.1")),
    )
    wire = attrs.encode(OLD)
    assert wire == (
        ORIGIN
        + as2(segment(3, [64512], 2), segment(2, [65001, AS_TRANS], 2))
        + attr(0xC0, 7, struct.pack("!H", AS_TRANS) + b"\x0a\x00\x00\x01")
        + as4(segment(2, [65001, 4200000001]))
        + attr(0xC0, 18, struct.pack("!I", 4200000009) + b"\x0a\x00\x00\x01")
    )
    back = Update.decode(update_body(wire + NEXT_HOP), OLD).attributes
    assert back.as_path == attrs.as_path and back.aggregator == attrs.aggregator
    # Only 2-octet AS numbers: no AS4_PATH (RFC 6793 §4.2.2 SHOULD NOT).
    small = PathAttributes.of(Origin(0), AsPath((AsPathSegment(AS_SEQUENCE, (65001,)),)))
    assert small.encode(OLD) == ORIGIN + as2(segment(2, [65001], 2))


# ------------------------------------------------------------------ unknown attributes, Partial


def test_unknown_optional_transitive_is_kept_with_partial_set() -> None:
    u = Update.decode(update_body(MANDATORY + attr(0xC0, 99, b"hi")))
    assert u.attributes.get(99) == UnknownAttribute(99, 0xC0, b"hi")
    assert u.attributes.encode(NEW).endswith(attr(0xE0, 99, b"hi"))
    assert u.errors == ()


def test_unknown_optional_non_transitive_is_dropped() -> None:
    u = Update.decode(update_body(MANDATORY + attr(0x80, 99, b"hi")))
    assert 99 not in u.attributes and u.errors == ()


def test_received_partial_bit_stays_set_on_known_optional_transitive() -> None:
    u = Update.decode(update_body(MANDATORY + attr(0xE0, 8, b"\x00\x01\x00\x02")))
    assert u.attributes.get(8).encode(NEW) == attr(0xE0, 8, b"\x00\x01\x00\x02")  # type: ignore[union-attr]
    assert u.attributes.get(8) == Communities((0x00010002,), partial=True)


@pytest.mark.parametrize(
    ("code", "value", "decoded"),
    [
        pytest.param(7, b"\x00\x00\xfd\xe9\x0a\x00\x00\x01", Aggregator(65001, A("10.0.0.1"), partial=True), id="aggregator"),
        pytest.param(32, struct.pack("!III", 65001, 1, 2), LargeCommunities(((65001, 1, 2),), partial=True), id="large-community"),
    ],
)
def test_received_partial_bit_stays_set_on_other_known_optional_transitive(code: int, value: bytes, decoded: object) -> None:
    # RFC 4271 §5: once set, Partial stays set as the attribute is passed on.
    # (COMMUNITIES keeps it in its own decode_value; these rely on decode_shared.)
    for cache in (None, {}):
        u = Update.decode(update_body(MANDATORY + attr(0xE0, code, value)), NEW, cache)
        got = u.attributes.get(code)
        assert got == decoded and got.partial  # type: ignore[union-attr]
        assert got.encode(NEW) == attr(0xE0, code, value)  # type: ignore[union-attr]
        assert u.attributes.encode(NEW).endswith(attr(0xE0, code, value))


def test_mp_reach_alone_needs_no_next_hop_and_ignores_a_bad_one() -> None:
    mp = MpReachNlri(2, 1, (IPv6Address("2001:db8::1"), IPv6Address("fe80::1")), (b"\x00",))
    u = Update.decode(update_body(mp.encode(NEW) + ORIGIN + AS_PATH + attr(0x40, 3, bytes(4)), b""))
    assert u.errors == () and u.mp_reach == mp


def test_unsupported_family_end_of_rib_is_kept() -> None:
    u = Update.decode(update_body(attr(0x80, 15, b"\x00\x01\x80"), b""))
    assert u.end_of_rib == (1, 128)


# ------------------------------------------------------------------ messages


def test_open_round_trip_and_build() -> None:
    msg = Open.build(
        4200000001, 90, "192.0.2.1",
        [MultiProtocol(1, 1), RouteRefreshCapability(), FourOctetAs(1), GracefulRestart(True, 120)],
    )
    assert msg.my_as == AS_TRANS and msg.asn == 4200000001
    assert msg.capabilities_of(FourOctetAs) == (FourOctetAs(4200000001),)
    assert msg.capability(MultiProtocol) == MultiProtocol(1, 1) and msg.capability(UnknownCapability) is None
    wire = msg.encode()
    caps = b"".join(c.encode() for c in msg.capabilities)
    assert wire == message(1, b"\x04\x5b\xa0\x00\x5a\xc0\x00\x02\x01" + bytes((len(caps) + 2, 2, len(caps))) + caps)
    assert decode_message(1, body(wire)) == msg
    assert Open.build(65001, 0, A("10.0.0.1"), []).my_as == 65001
    assert Open(65001, 90, A("10.0.0.1")).asn == 65001
    assert Open.decode(body(Open(65001, 90, A("10.0.0.1")).encode())) == Open(65001, 90, A("10.0.0.1"))


def test_open_several_parameters_and_several_capabilities_per_parameter() -> None:
    params = (
        bytes((2, 8)) + capability(1, b"\x00\x01\x00\x01") + capability(2)
        + bytes((2, 6)) + capability(65, struct.pack("!I", 65001))
    )
    raw = struct.pack("!BHH", 4, 65001, 180) + b"\x0a\x00\x00\x01" + bytes((len(params),)) + params
    msg = Open.decode(raw)
    assert msg.capabilities == (MultiProtocol(1, 1), RouteRefreshCapability(), FourOctetAs(65001))


def test_open_rfc9072_extended_optional_parameters() -> None:
    caps = tuple(UnknownCapability(200 + i, bytes(40)) for i in range(8))  # 336 octets of capabilities
    msg = Open(65001, 90, A("10.0.0.1"), caps)
    wire = msg.encode()
    assert wire[28:30] == b"\xff\xff"  # Non-Ext OP Len 255, Non-Ext OP Type 255
    assert Open.decode(body(wire)) == msg
    # Several extended parameters, each with a 2-octet length, decode too.
    one = b"".join(c.encode() for c in caps[:4])
    two = b"".join(c.encode() for c in caps[4:])
    params = b"\x02" + struct.pack("!H", len(one)) + one + b"\x02" + struct.pack("!H", len(two)) + two
    raw = struct.pack("!BHH", 4, 65001, 90) + b"\x0a\x00\x00\x01\xff\xff" + struct.pack("!H", len(params)) + params
    assert Open.decode(raw) == msg


@pytest.mark.parametrize(
    "caps",
    [
        pytest.param((UnknownCapability(70, bytes(255)),), id="one-257-octet-capability"),
        pytest.param((UnknownCapability(70, bytes(254)),), id="one-256-octet-capability"),
        pytest.param((UnknownCapability(70, bytes(253)),), id="one-255-octet-capability-alone-too-long-a-parameter"),
        pytest.param((MultiProtocol(1, 1), UnknownCapability(70, bytes(255)), FourOctetAs(65001)), id="long-one-between-short-ones"),
    ],
)
def test_open_with_a_capability_no_parameter_can_hold_uses_rfc9072(caps: tuple) -> None:
    # A capability TLV of 256 or 257 octets (RFC 5492 allows a 255-octet value) fits no
    # 1-octet-length parameter: RFC 9072 §2's extended format carries it, never an empty
    # Capabilities parameter ahead of it.
    msg = Open(65001, 90, A("10.0.0.1"), caps)
    wire = msg.encode()
    joined = b"".join(c.encode() for c in caps)
    ext = b"\x02" + struct.pack("!H", len(joined)) + joined
    assert wire[19:] == struct.pack("!BHH", 4, 65001, 90) + b"\x0a\x00\x00\x01\xff\xff" + struct.pack("!H", len(ext)) + ext
    assert Open.decode(body(wire)) == msg
    # As a peer may send it, decoded and encoded again.
    assert Open.decode(body(Open.decode(body(wire)).encode())) == msg


@pytest.mark.parametrize(("size", "extended"), [(253, False), (254, True)])
def test_open_is_extended_exactly_when_one_parameter_cannot_hold_the_capabilities(size: int, extended: bool) -> None:
    # One Capabilities parameter of at most 255 octets, or RFC 9072's format.
    caps = (UnknownCapability(70, bytes(200)), UnknownCapability(71, bytes(size - 210)), FourOctetAs(65001))
    msg = Open(65001, 90, A("10.0.0.1"), caps)
    wire = msg.encode()
    joined = b"".join(c.encode() for c in caps)
    assert len(joined) == size
    if extended:
        assert wire[28:] == b"\xff\xff" + struct.pack("!HBH", size + 3, 2, size) + joined
    else:
        assert wire[28:] == bytes((size + 2, 2, size)) + joined
    assert Open.decode(body(wire)) == msg


def test_update_round_trip_with_every_attribute() -> None:
    attrs = PathAttributes.of(
        Origin(1), AsPath((AsPathSegment(AS_SEQUENCE, (65001, 4200000001)),)), NextHop(A("192.0.2.1")),
        MultiExitDisc(5), LocalPref(200), AtomicAggregate(), Aggregator(65001, A("10.0.0.1")),
        Communities((0xFDE80064,)), OriginatorId(A("10.0.0.9")), ClusterList((A("10.0.0.1"),)),
        LargeCommunities(((1, 2, 3),)), UnknownAttribute(99, 0xE0, b"x"),
    )
    u = Update(withdrawn=(p4("10.9.0.0/16"),), attributes=attrs, nlri=(p4("10.1.0.0/16"), p4("10.2.3.0/24")))
    wire = u.encode()
    assert decode_message(2, body(wire)) == u
    mp = Update(
        attributes=attrs.without(3),
        mp_reach=MpReachNlri(2, 1, (IPv6Address("2001:db8::1"),), (prefix_from_str("2001:db8:1::/48")[1],)),
        mp_unreach=MpUnreachNlri(2, 1, (prefix_from_str("2001:db8:2::/48")[1],)),
    )
    wire = mp.encode()
    assert wire[23:25] == b"\x80\x0e"  # MP_REACH_NLRI first (RFC 7606 §5.1)
    assert Update.decode(body(wire)) == mp


def test_end_of_rib() -> None:
    assert Update().end_of_rib == (1, 1)
    assert Update.end_of_rib_marker(1, 1).encode() == message(2, b"\x00\x00\x00\x00")
    marker = Update.end_of_rib_marker(2, 1)
    assert marker.encode() == message(2, b"\x00\x00\x00\x06\x80\x0f\x03\x00\x02\x01")
    assert Update.decode(body(marker.encode())).end_of_rib == (2, 1)
    assert Update(withdrawn=(b"\x00",)).end_of_rib is None
    assert Update(mp_unreach=MpUnreachNlri(2, 1, (b"\x00",))).end_of_rib is None
    assert Update(attributes=PathAttributes.of(Origin(0)), mp_unreach=MpUnreachNlri(2, 1)).end_of_rib is None


# RFC 4724 §2: the IPv4 unicast End-of-RIB is an UPDATE with no withdrawn routes and no path
# attributes (Total Path Attribute Length 0); another family's is an UPDATE whose only
# attribute is an MP_UNREACH_NLRI with no withdrawn routes.  Whatever decoding keeps of an
# attribute, one on the wire makes the UPDATE no End-of-RIB.
EMPTY_MP_UNREACH = attr(0x80, 15, b"\x00\x02\x01")
NOT_END_OF_RIB = [
    # An unrecognized optional non-transitive attribute, dropped silently (RFC 4271 §5).
    pytest.param(attr(0x80, 99, b"\x00"), id="unknown-optional-non-transitive-only"),
    pytest.param(EMPTY_MP_UNREACH + attr(0x80, 99, b"\x00"), id="empty-mp-unreach-and-unknown-optional-non-transitive"),
    pytest.param(attr(0x80, 99, b"\x00") + EMPTY_MP_UNREACH, id="unknown-optional-non-transitive-and-empty-mp-unreach"),
    # A malformed ATOMIC_AGGREGATE, attribute-discarded (RFC 7606 §7.6).
    pytest.param(attr(0x40, 6, b"\x01"), id="discarded-atomic-aggregate-only"),
    pytest.param(EMPTY_MP_UNREACH + attr(0x40, 6, b"\x01"), id="empty-mp-unreach-and-discarded-atomic-aggregate"),
    # The only attribute an MP_UNREACH_NLRI, but one that was not kept as an empty one: an
    # unsupported family's with withdrawn routes (attribute-discard, RFC 4760 §8) ...
    pytest.param(attr(0x80, 15, b"\x00\x19\x46\x01\x02\x03\x04"), id="unsupported-family-mp-unreach-with-withdrawals"),
    # ... or an empty one whose flags are wrong (treat-as-withdraw, RFC 7606 §3 c).
    pytest.param(attr(0xC0, 15, b"\x00\x02\x01"), id="empty-mp-unreach-with-transitive-bit"),
]


@pytest.mark.parametrize("attrs", NOT_END_OF_RIB)
@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "cached"])
def test_an_update_with_another_attribute_on_the_wire_is_no_end_of_rib(attrs: bytes, cached: bool) -> None:
    cache: dict | None = {} if cached else None
    for _ in range(2 if cached else 1):  # with a cache, the second decode finds the attributes there
        assert Update.decode(update_body(attrs, b""), NEW, cache).end_of_rib is None


@pytest.mark.parametrize(
    ("attrs", "family"),
    [
        pytest.param(b"", (1, 1), id="ipv4-no-attributes"),
        pytest.param(EMPTY_MP_UNREACH, (2, 1), id="ipv6-empty-mp-unreach"),
        pytest.param(attr(0x90, 15, b"\x00\x02\x01"), (2, 1), id="ipv6-empty-mp-unreach-extended-length"),
        pytest.param(attr(0x80, 15, b"\x00\x01\x01"), (1, 1), id="ipv4-empty-mp-unreach"),
    ],
)
@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "cached"])
def test_an_end_of_rib_is_recognized(attrs: bytes, family: tuple[int, int], cached: bool) -> None:
    cache: dict | None = {} if cached else None
    for _ in range(2 if cached else 1):
        u = Update.decode(update_body(attrs, b""), NEW, cache)
        assert u.end_of_rib == family and u.errors == ()
    assert Update.decode(body(Update.end_of_rib_marker(*family).encode())).end_of_rib == family


def test_notification_and_shutdown_communication() -> None:
    n = Notification(4, 0)
    assert n.encode() == message(3, b"\x04\x00") and str(n) == "Hold Timer Expired"
    cease = Notification.cease(CeaseSubcode.ADMINISTRATIVE_SHUTDOWN, "maintenance")
    assert cease.data == b"\x0bmaintenance"
    back = Notification.decode(body(cease.encode()))
    assert back == cease and back.shutdown_message == "maintenance"
    assert str(back) == "Cease/Administrative Shutdown: 'maintenance'"
    long = Notification.cease(4, "é" * 200)  # 400 octets of UTF-8, cut at a character
    assert long.data[0] == 254 and long.shutdown_message == "é" * 127
    assert Notification.cease(5, "ignored").data == b""
    assert Notification(6, 2, b"\x05\xff\xfeab").shutdown_message == "\ufffd\ufffdab"
    assert Notification(6, 2, b"\x40abc").shutdown_message == "abc"  # length beyond data: lenient
    assert Notification(6, 3, b"\x01a").shutdown_message is None
    assert str(Notification(3, 11, b"\x01\x02")) == "UPDATE Message Error/Malformed AS_PATH (data 0102)"


def test_keepalive_and_route_refresh() -> None:
    assert Keepalive().encode() == message(4, b"")
    assert decode_message(4, b"") == Keepalive()
    rr = RouteRefresh(2, 1, 1)
    assert rr.encode() == message(5, b"\x00\x02\x01\x01")
    assert decode_message(5, b"\x00\x02\x01\x01") == rr
    assert RouteRefresh(1, 1).subtype == 0


def test_direct_decode_of_too_short_bodies() -> None:
    for msg_type, raw in ((1, b"\x04"), (3, b"\x06"), (4, b"\x00"), (2, b"\x00")):
        with pytest.raises(DecodeError) as info:
            decode_message(msg_type, raw)
        assert info.value.code in (1, 3)


def test_encode_refuses_messages_over_4096_octets() -> None:
    u = Update(withdrawn=tuple(bytes((24, 10, i >> 8, i & 255)) for i in range(1100)))
    with pytest.raises(ValueError, match="exceeds"):
        u.encode()


def test_notification_data_is_cut_to_fit_the_maximum_message_length() -> None:
    # RFC 7313 §5 puts the whole over-long ROUTE-REFRESH into the data of 7/1; whatever a peer
    # sends, the NOTIFICATION answering it must still be sendable (RFC 4271 §4.1, §4.5).
    with pytest.raises(DecodeError) as info:
        decode_message(5, bytes(4073))  # a 4,092-octet ROUTE-REFRESH
    err = info.value
    assert (err.code, err.subcode) == (7, 1) and len(err.data) == 4092
    wire = Notification(err.code, err.subcode, err.data).encode()
    assert len(wire) == 4096
    assert Notification.decode(body(wire)) == Notification(7, 1, err.data[:4075])
    extended = CodecContext(max_message_len=65535)  # RFC 8654
    assert len(Notification(7, 1, bytes(70000)).encode(extended)) == 65535
    assert len(Notification(7, 1, bytes(4075)).encode(extended)) == 4096  # cut only what does not fit
    assert Notification(7, 1, b"\x01\x02").encode() == message(3, b"\x07\x01\x01\x02")


def test_error_names() -> None:
    assert error_name(6, 2) == "Cease/Administrative Shutdown"
    assert error_name(1, 3) == "Message Header Error/Bad Message Type"
    assert error_name(6, 99) == "Cease/Subcode 99"
    assert error_name(42, 1) == "Error 42/Subcode 1"
    err = DecodeError(3, 6, b"\x40\x01\x01\x05", "bad", ErrorAction.TREAT_AS_WITHDRAW)
    assert str(err) == "UPDATE Message Error/Invalid ORIGIN Attribute: bad (data 40010105) [treat-as-withdraw]"
    assert err.action is ErrorAction.TREAT_AS_WITHDRAW and err.data == b"\x40\x01\x01\x05"


# ------------------------------------------------------------------ packing


def _decode_all(messages: list[bytes]) -> list[Update]:
    out = []
    for m in messages:
        assert len(m) <= 4096
        assert m[:16] == b"\xff" * 16 and int.from_bytes(m[16:18], "big") == len(m)
        out.append(Update.decode(body(m)))
    return out


def test_encode_updates_ipv4_packs_every_prefix_once() -> None:
    prefixes = [bytes((24, 10, i >> 8, i & 255)) for i in range(3000)] + [b"\x00", p4("192.0.2.1/32")]
    attrs = PathAttributes.of(Origin(0), AsPath((AsPathSegment(AS_SEQUENCE, (65001,)),)), Communities((1, 2)))
    msgs = encode_updates(1, attrs, A("192.0.2.1"), prefixes)
    assert len(msgs) == 3
    updates = _decode_all(msgs)
    got = [p for u in updates for p in u.nlri]
    assert got == prefixes
    for u in updates:
        assert u.errors == () and u.attributes == attrs.replace(NextHop(A("192.0.2.1")))
    # A smaller limit means more, smaller messages.
    small = encode_updates(1, attrs, "192.0.2.1", prefixes, max_size=512)
    assert all(len(m) <= 512 for m in small) and len(small) > 20
    assert [p for u in _decode_all(small) for p in u.nlri] == prefixes
    assert encode_updates(1, attrs, A("192.0.2.1"), []) == []


def test_encode_updates_ipv6_uses_mp_reach_and_drops_next_hop_attribute() -> None:
    prefixes = [bytes((64,)) + bytes((0x20, 0x01, 0x0D, 0xB8, 0, 0, i >> 8, i & 255)) for i in range(1000)]
    attrs = PathAttributes.of(Origin(0), AsPath(), LocalPref(100), NextHop(A("192.0.2.1")))
    hops = (IPv6Address("2001:db8::1"), IPv6Address("fe80::1"))
    msgs = encode_updates(2, attrs, hops, prefixes)
    assert len(msgs) == 3
    updates = _decode_all(msgs)
    assert [p for u in updates for p in u.mp_reach.nlri] == prefixes  # type: ignore[union-attr]
    for u in updates:
        assert u.mp_reach.next_hop == hops and u.nlri == () and 3 not in u.attributes  # type: ignore[union-attr]
        assert u.errors == ()
    single = encode_updates(2, attrs, IPv6Address("2001:db8::1"), prefixes[:3])
    assert _decode_all(single)[0].mp_reach.next_hop == (IPv6Address("2001:db8::1"),)  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        encode_updates(2, attrs, A("192.0.2.1"), prefixes)
    with pytest.raises(ValueError):
        encode_updates(3, attrs, A("192.0.2.1"), prefixes)


def test_encode_withdrawals_both_families() -> None:
    v4 = [bytes((24, 10, i >> 8, i & 255)) for i in range(2500)]
    msgs = encode_withdrawals(1, v4)
    assert len(msgs) == 3
    assert [p for u in _decode_all(msgs) for p in u.withdrawn] == v4
    v6 = [bytes((48, 0x20, 0x01, 0x0D, 0xB8, i >> 8, i & 255)) for i in range(1200)]
    msgs = encode_withdrawals(2, v6)
    updates = _decode_all(msgs)
    assert len(msgs) == 3 and all(u.mp_unreach.afi == 2 for u in updates)  # type: ignore[union-attr]
    assert [p for u in updates for p in u.mp_unreach.withdrawn] == v6  # type: ignore[union-attr]
    assert encode_withdrawals(2, []) == []


# ------------------------------------------------------------------ attribute cache


def test_cache_shares_decoded_attributes() -> None:
    cache: dict = {}
    a = Update.decode(update_body(MANDATORY, NLRI), NEW, cache)
    b = Update.decode(update_body(MANDATORY, b"\x18\x0a\x00\x02"), NEW, cache)
    assert a.attributes is b.attributes and b.nlri == (b"\x18\x0a\x00\x02",)
    c = Update.decode(update_body(MANDATORY + attr(0x80, 4, b"\x00\x00\x00\x01"), NLRI), NEW, cache)
    assert c.attributes is not a.attributes and c.attributes.med == 1
    # MP updates share the non-MP part; their NLRI is per message.
    mp1 = MpReachNlri(2, 1, (IPv6Address("2001:db8::1"),), (b"\x00",)).encode(NEW)
    mp2 = MpReachNlri(2, 1, (IPv6Address("2001:db8::2"),), (b"\x08\x20",)).encode(NEW)
    d = Update.decode(update_body(mp1 + ORIGIN + AS_PATH, b""), NEW, cache)
    e = Update.decode(update_body(mp2 + ORIGIN + AS_PATH, b""), NEW, cache)
    assert d.attributes is e.attributes and e.mp_reach.nlri == (b"\x08\x20",)  # type: ignore[union-attr]
    # Errors recorded for cached bytes are reported again, and missing mandatory
    # attributes depend on the NLRI of each message.
    bad = update_body(ORIGIN + AS_PATH + attr(0x40, 3, bytes(4)), NLRI)
    assert Update.decode(bad, NEW, cache).treat_as_withdraw
    assert Update.decode(bad, NEW, cache).treat_as_withdraw
    # A different context must not reuse entries decoded under another.
    old = Update.decode(update_body(ORIGIN + AS_PATH2 + NEXT_HOP, NLRI), OLD, cache)
    assert old.attributes.as_path.asns() == (65001, 65002) and old.errors == ()


def test_cache_is_bounded() -> None:
    from proto.messages import ATTRIBUTE_CACHE_SIZE

    cache: dict = {}
    for i in range(ATTRIBUTE_CACHE_SIZE + 500):
        med = attr(0x80, 4, struct.pack("!I", i))
        Update.decode(update_body(MANDATORY + med, NLRI), NEW, cache)
    assert len(cache) <= ATTRIBUTE_CACHE_SIZE + 2


def test_cache_interns_single_attributes() -> None:
    # Blocks that differ in one attribute (a MED per route) share the others' objects.
    cache: dict = {}
    a = Update.decode(update_body(MANDATORY + attr(0x80, 4, b"\x00\x00\x00\x01"), NLRI), NEW, cache)
    b = Update.decode(update_body(MANDATORY + attr(0x80, 4, b"\x00\x00\x00\x02"), NLRI), NEW, cache)
    assert a.attributes is not b.attributes and (a.attributes.med, b.attributes.med) == (1, 2)
    for code in (1, 2, 3):
        assert a.attributes.get(code) is b.attributes.get(code)
    assert a.attributes == Update.decode(update_body(MANDATORY + attr(0x80, 4, b"\x00\x00\x00\x01"), NLRI)).attributes
    # The Partial bit is part of the bytes: it is kept per occurrence (RFC 4271 §5).
    comm = b"\xfd\xe8\x00\x01"
    p = Update.decode(update_body(MANDATORY + attr(0xE0, 8, comm), NLRI), NEW, cache)
    q = Update.decode(update_body(MANDATORY + attr(0xC0, 8, comm) + attr(0x80, 4, bytes(4)), NLRI), NEW, cache)
    assert p.attributes.get(8).partial and not q.attributes.get(8).partial  # type: ignore[union-attr]


def test_cache_never_interns_an_attribute_with_an_error() -> None:
    # Every UPDATE carrying a malformed attribute reports it, also when the rest of its block
    # differs (no set-cache hit) and the attribute's bytes were seen before.
    cache: dict = {}
    bad_next_hop = attr(0x40, 3, bytes(4))  # 0.0.0.0 (RFC 4271 §6.3)
    bad_origin = attr(0x40, 1, b"\x07")
    for i in range(3):
        med = attr(0x80, 4, struct.pack("!I", i))
        u = Update.decode(update_body(ORIGIN + AS_PATH + bad_next_hop + med, NLRI), NEW, cache)
        assert u.treat_as_withdraw and [e.attribute for e in u.errors] == [3]
        v = Update.decode(update_body(bad_origin + AS_PATH + NEXT_HOP + med, NLRI), NEW, cache)
        assert v.treat_as_withdraw and [e.attribute for e in v.errors] == [1]
    # Without NLRI a NEXT_HOP problem does not matter; with NLRI again it does.
    mp = MpReachNlri(2, 1, (IPv6Address("2001:db8::1"),), (b"\x00",)).encode(NEW)
    assert not Update.decode(update_body(mp + ORIGIN + AS_PATH + bad_next_hop, b""), NEW, cache).errors
    assert Update.decode(update_body(ORIGIN + AS_PATH + bad_next_hop, NLRI), NEW, cache).treat_as_withdraw


def test_interned_attributes_follow_the_context_and_survive_a_trim() -> None:
    from proto.messages import trim_cache

    cache: dict = {}
    a = Update.decode(update_body(MANDATORY + attr(0x80, 4, bytes(4)), NLRI), NEW, cache)
    trim_cache(cache)
    b = Update.decode(update_body(MANDATORY + attr(0x80, 4, b"\x00\x00\x00\x05"), NLRI), NEW, cache)
    assert b.attributes.get(2) is a.attributes.get(2)
    # The same AS_PATH bytes mean other AS numbers between OLD speakers (2-octet, RFC 6793).
    old = Update.decode(update_body(MANDATORY, NLRI), OLD, cache)
    assert old.attributes.as_path != a.attributes.as_path
    assert old.attributes.as_path == Update.decode(update_body(MANDATORY, NLRI), OLD).attributes.as_path


def test_interned_generations_keep_what_is_used() -> None:
    from proto._attrblock import Interned
    from proto.attributes import MultiExitDisc

    interned = Interned(2)
    x, y, z = MultiExitDisc(1), MultiExitDisc(2), MultiExitDisc(3)
    interned.put(b"x", x)
    interned.put(b"y", y)
    interned.put(b"z", z)  # the full generation becomes the old one
    assert interned.get(b"x") is x  # found in the old one and kept in the new one
    interned.put(b"w", MultiExitDisc(4))  # full again: {x, z} is old, {w} new
    assert interned.get(b"y") is None
    assert interned.get(b"x") is x and interned.get(b"z") is z


def test_path_attributes_look_up_by_code_without_a_dict_per_set() -> None:
    # An attribute set's index is its type codes as one shared bytes object (no dict per set).
    from proto.attributes import Communities, MultiExitDisc, Origin, PathAttributes

    a = PathAttributes.of(Communities((1, 2)), Origin(0), MultiExitDisc(7))
    b = PathAttributes.of(Origin(2), MultiExitDisc(9), Communities((3,)))
    assert [x.code for x in a] == [1, 4, 8]
    assert a._codes is b._codes  # one object for every set with these codes
    assert a.get(4) == MultiExitDisc(7) and a.med == 7 and a.communities == (1, 2)
    assert a.get(2) is None and a.get(300) is None and a.get(-1) is None and a.get("4") is None  # type: ignore[arg-type]
    assert 8 in a and 2 not in a and 300 not in a and "x" not in a
    assert a.without(300, 2) is a
    assert a.without(8) == PathAttributes.of(Origin(0), MultiExitDisc(7))
    assert a.replace(MultiExitDisc(1)).med == 1 and a.med == 7


def test_communities_are_kept_as_their_octets() -> None:
    from proto.attributes import Communities

    c = Communities((0xFDE80064, NO_EXPORT))
    assert c.raw == b"\xfd\xe8\x00\x64\xff\xff\xff\x01" and c.values == (0xFDE80064, NO_EXPORT)
    assert c == Communities.decode_value(c.raw, 0xC0, NEW) and hash(c) == hash(Communities([0xFDE80064, NO_EXPORT]))
    assert repr(c) == f"Communities({(0xFDE80064, NO_EXPORT)!r})"
    assert Communities.decode_value(c.raw, 0xE0, NEW).partial  # Partial as received (RFC 4271 §5)


def test_interned_attributes_per_code_keep_shared_ones_while_others_churn() -> None:
    # A pod network: one prefix per UPDATE, each with a MED of its own, AS_PATHs from a pool
    # of 6,000.  One MED per route must not push the pool out of the table: the second pass
    # over the pool gets the first pass's objects (with one table for all codes, the MEDs
    # turned it over every ~4,000 UPDATEs and each route decoded its AS_PATH again).
    from proto.messages import trim_cache

    cache: dict = {}
    first: dict[int, object] = {}
    med = 0
    for rnd in range(2):
        for i in range(6000):
            med += 1
            path = attr(0x40, 2, segment(2, [65001, 70000 + i]))
            body = update_body(ORIGIN + path + NEXT_HOP + attr(0x80, 4, med.to_bytes(4, "big")), NLRI)
            as_path = Update.decode(body, NEW, cache).attributes.get(2)
            trim_cache(cache)  # the sets are all distinct anyway: only single attributes count
            if rnd == 0:
                first[i] = as_path
            else:
                assert as_path is first[i], i
