"""Malformed messages, one table row each, with the RFC clause in the case id.

Every row is a whole message fed through MessageReader and decode_message.  ``Reset``
rows expect DecodeError with the exact code, subcode and data (a session reset);
``Outcome`` rows expect an Update whose ``errors`` hold the exact RFC 7606 outcome.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from codec_build import (
    AS_PATH,
    AS_PATH2,
    MANDATORY,
    NEXT_HOP,
    NLRI,
    ORIGIN,
    attr,
    capability,
    caps_param,
    message,
    mp_reach,
    mp_unreach,
    open_body,
    open_msg,
    segment,
    update,
)

from proto import (
    CodecContext,
    DecodeError,
    ErrorAction,
    MessageReader,
    Update,
    decode_message,
)

TAW = ErrorAction.TREAT_AS_WITHDRAW
DISCARD = ErrorAction.ATTRIBUTE_DISCARD
OLD = CodecContext(four_octet_as=False)
EXT = CodecContext(external=True)


@dataclass(frozen=True)
class Reset:
    code: int
    subcode: int
    data: bytes = b""


@dataclass(frozen=True)
class Outcome:
    action: ErrorAction
    code: int
    subcode: int
    data: bytes = b""
    #: type code that must be absent from the decoded attributes (discarded / malformed)
    absent: int | None = None


def decode_stream(raw: bytes, ctx: CodecContext) -> object:
    reader = MessageReader()
    reader.feed(raw)
    got = reader.next_message()
    assert got is not None, "the message is complete, the reader must return it"
    return decode_message(got[0], got[1], ctx, {})


def hdr(length: int, msg_type: int) -> bytes:
    return message(msg_type, bytes(max(0, length - 19)), length=length)


BAD_ORIGIN = attr(0x40, 1, b"\x03")
MED = attr(0x80, 4, b"\x00\x00\x00\x05")
V6_NH = b"\x20\x01\x0d\xb8" + bytes(11) + b"\x01"
UNSUPPORTED_UNREACH = mp_unreach(afi=25, safi=70, withdrawn=b"\x01\x02\x03\x04")

CASES = [
    # ---------------------------------------------------------------- header, RFC 4271 §6.1
    pytest.param(b"\xff" * 15 + b"\xfe" + b"\x00\x13\x04", Reset(1, 1), id="rfc4271-6.1-marker-not-all-ones"),
    pytest.param(b"\x00" * 16 + b"\x00\x13\x04", Reset(1, 1), id="rfc4271-6.1-marker-all-zero"),
    pytest.param(hdr(18, 4) + b"\x00", Reset(1, 2, b"\x00\x12"), id="rfc4271-6.1-length-below-19"),
    pytest.param(hdr(4097, 2), Reset(1, 2, b"\x10\x01"), id="rfc4271-6.1-length-above-4096"),
    pytest.param(hdr(28, 1), Reset(1, 2, b"\x00\x1c"), id="rfc4271-6.1-open-below-29"),
    pytest.param(hdr(22, 2), Reset(1, 2, b"\x00\x16"), id="rfc4271-6.1-update-below-23"),
    pytest.param(hdr(20, 3), Reset(1, 2, b"\x00\x14"), id="rfc4271-6.1-notification-below-21"),
    pytest.param(hdr(20, 4), Reset(1, 2, b"\x00\x14"), id="rfc4271-6.1-keepalive-not-19"),
    pytest.param(hdr(22, 5), Reset(1, 2, b"\x00\x16"), id="rfc2918-3-route-refresh-below-23"),
    pytest.param(hdr(19, 6), Reset(1, 3, b"\x06"), id="rfc4271-6.1-unknown-type-6"),
    pytest.param(hdr(19, 0), Reset(1, 3, b"\x00"), id="rfc4271-6.1-unknown-type-0"),
    pytest.param(
        message(5, b"\x00\x01\x01\x01\x00"),
        Reset(7, 1, message(5, b"\x00\x01\x01\x01\x00")),
        id="rfc7313-5-route-refresh-length-24",
    ),
    # Subtype 0 (a plain RFC 2918 request) too: RFC 2918 / RFC 4271 §6.1 define no other error.
    pytest.param(
        message(5, b"\x00\x01\x00\x01\x00"),
        Reset(7, 1, message(5, b"\x00\x01\x00\x01\x00")),
        id="rfc7313-5-route-refresh-subtype-0-length-24",
    ),
    # ---------------------------------------------------------------- OPEN, RFC 4271 §6.2
    pytest.param(open_msg(version=3), Reset(2, 1, b"\x00\x04"), id="rfc4271-6.2-version-3-unsupported"),
    pytest.param(open_msg(version=5), Reset(2, 1, b"\x00\x04"), id="rfc4271-6.2-version-5-unsupported"),
    pytest.param(open_msg(my_as=0), Reset(2, 2), id="rfc7607-2-my-as-zero"),
    pytest.param(
        open_msg(params=caps_param(capability(65, b"\x00\x00\x00\x00"))), Reset(2, 2), id="rfc7607-2-as4-capability-zero"
    ),
    pytest.param(open_msg(hold_time=1), Reset(2, 6), id="rfc4271-6.2-hold-time-1"),
    pytest.param(open_msg(hold_time=2), Reset(2, 6), id="rfc4271-6.2-hold-time-2"),
    pytest.param(open_msg(router_id=b"\x00\x00\x00\x00"), Reset(2, 3), id="rfc6286-2.2-bgp-identifier-zero"),
    pytest.param(open_msg(params=b"\x01\x02\xab\xcd"), Reset(2, 4), id="rfc4271-6.2-optional-parameter-type-1"),
    pytest.param(
        open_msg(params=caps_param(capability(2)) + b"\x03\x00"), Reset(2, 4), id="rfc5492-5-second-parameter-type-3"
    ),
    pytest.param(
        message(1, open_body(params=caps_param(capability(2)), opt_len=10)),
        Reset(2, 0),
        id="rfc4271-6.2-optional-parameters-length-overrun",
    ),
    pytest.param(
        message(1, open_body(params=caps_param(capability(2))) + b"\x00"),
        Reset(2, 0),
        id="rfc4271-6.2-octets-after-optional-parameters",
    ),
    pytest.param(open_msg(params=b"\x02"), Reset(2, 0), id="rfc4271-6.2-truncated-parameter-header"),
    pytest.param(open_msg(params=b"\x02\x05\x02\x00"), Reset(2, 0), id="rfc4271-6.2-parameter-overruns-parameters"),
    pytest.param(open_msg(params=b"\x02\x03\x02\x00\x41"), Reset(2, 0), id="rfc5492-4-truncated-capability-header"),
    pytest.param(
        open_msg(params=b"\x02\x04\x41\x04\x00\x00"), Reset(2, 0), id="rfc5492-4-capability-overruns-parameter"
    ),
    pytest.param(
        open_msg(params=caps_param(capability(1, b"\x00\x01\x01"))), Reset(2, 0), id="rfc4760-8-multiprotocol-length-3"
    ),
    pytest.param(
        open_msg(params=caps_param(capability(65, b"\xfd\xe9"))), Reset(2, 0), id="rfc6793-3-as4-capability-length-2"
    ),
    pytest.param(
        open_msg(params=caps_param(capability(64, b"\x00\x78\x00\x01\x01"))),
        Reset(2, 0),
        id="rfc4724-3-graceful-restart-length-5",
    ),
    pytest.param(
        open_msg(params=caps_param(capability(2, b"\x00"))), Reset(2, 0), id="rfc2918-2-route-refresh-cap-with-value"
    ),
    pytest.param(
        message(1, open_body(params=b"\xff\x00", opt_len=255)), Reset(2, 0), id="rfc9072-2-truncated-extended-length"
    ),
    pytest.param(
        message(1, open_body(params=b"\xff\x00\x06\x02\x00\x02\x02\x00", opt_len=255)),
        Reset(2, 0),
        id="rfc9072-2-extended-length-mismatch",
    ),
    # ---------------------------------------------------------------- UPDATE: session reset
    pytest.param(message(2, b"\x00\x05\x00\x00"), Reset(3, 1), id="rfc4271-6.3-withdrawn-length-overrun"),
    # Withdrawn Routes Length leaving no room for the Total Path Attribute Length field.
    pytest.param(message(2, b"\x00\x02\x18\x0a"), Reset(3, 1), id="rfc4271-6.3-withdrawn-length-leaves-no-attribute-length"),
    pytest.param(message(2, b"\x00\x01\x00\x00"), Reset(3, 1), id="rfc4271-6.3-withdrawn-length-leaves-half-an-attribute-length"),
    pytest.param(message(2, b"\x00\x00\x00\x09" + ORIGIN), Reset(3, 1), id="rfc7606-3b-total-attribute-length-overrun"),
    pytest.param(update(withdrawn=b"\x21\x0a\x00\x00\x00\x00"), Reset(3, 10), id="rfc7606-3i-withdrawn-length-33"),
    pytest.param(update(withdrawn=b"\x18\x0a\x00"), Reset(3, 10), id="rfc7606-3i-withdrawn-truncated-prefix"),
    pytest.param(update(nlri=b"\x21\x0a\x00\x00\x00\x00"), Reset(3, 10), id="rfc7606-5.3-nlri-length-33"),
    pytest.param(update(nlri=NLRI + b"\x18\x0a"), Reset(3, 10), id="rfc7606-5.3-nlri-truncated-prefix"),
    pytest.param(
        update(ORIGIN + AS_PATH + mp_reach() + mp_reach(), b""), Reset(3, 1), id="rfc7606-3g-mp-reach-twice"
    ),
    pytest.param(
        update(mp_unreach() + ORIGIN + mp_unreach(), b""), Reset(3, 1), id="rfc7606-3g-mp-unreach-twice"
    ),
    pytest.param(
        update(ORIGIN + AS_PATH + mp_reach(next_hop=V6_NH[:5]), b""),
        Reset(3, 9, mp_reach(next_hop=V6_NH[:5])),
        id="rfc7606-7.11-mp-reach-next-hop-length-5",
    ),
    # RFC 4760 §3, RFC 2545 §3: an IPv6 next hop is 16 or 32 octets, nothing else.
    pytest.param(
        update(ORIGIN + AS_PATH + mp_reach(next_hop=V6_NH + bytes(8)), b""),
        Reset(3, 9, mp_reach(next_hop=V6_NH + bytes(8))),
        id="rfc7606-7.11-mp-reach-ipv6-next-hop-length-24",
    ),
    pytest.param(
        update(ORIGIN + AS_PATH + mp_reach(next_hop=b""), b""),
        Reset(3, 9, mp_reach(next_hop=b"")),
        id="rfc7606-7.11-mp-reach-ipv6-next-hop-length-0",
    ),
    pytest.param(
        update(ORIGIN + AS_PATH + mp_reach(next_hop=V6_NH[:4]), b""),
        Reset(3, 9, mp_reach(next_hop=V6_NH[:4])),
        id="rfc7606-7.11-mp-reach-ipv6-next-hop-length-4",
    ),
    pytest.param(
        update(ORIGIN + AS_PATH + mp_reach(afi=1, next_hop=b"\x0a\x00\x00\x01\x00\x00", nlri=NLRI), b""),
        Reset(3, 9, mp_reach(afi=1, next_hop=b"\x0a\x00\x00\x01\x00\x00", nlri=NLRI)),
        id="rfc7606-7.11-mp-reach-ipv4-next-hop-length-6",
    ),
    pytest.param(
        update(ORIGIN + AS_PATH + attr(0x80, 14, b"\x00\x02\x01\x10"), b""),
        Reset(3, 9, attr(0x80, 14, b"\x00\x02\x01\x10")),
        id="rfc4760-7-mp-reach-length-4",
    ),
    pytest.param(
        update(ORIGIN + AS_PATH + attr(0x80, 14, b"\x00\x02\x01\x20" + V6_NH), b""),
        Reset(3, 9, attr(0x80, 14, b"\x00\x02\x01\x20" + V6_NH)),
        id="rfc4760-7-mp-reach-next-hop-overruns",
    ),
    pytest.param(
        update(attr(0x80, 15, b"\x00\x02"), b""), Reset(3, 9, attr(0x80, 15, b"\x00\x02")), id="rfc4760-7-mp-unreach-length-2"
    ),
    pytest.param(
        update(ORIGIN + AS_PATH + mp_reach(nlri=b"\x81" + bytes(17)), b""),
        Reset(3, 10),
        id="rfc7606-5.3-mp-reach-prefix-length-129",
    ),
    pytest.param(
        update(mp_unreach(withdrawn=b"\x40\x20\x01"), b""), Reset(3, 10), id="rfc7606-5.3-mp-unreach-truncated-prefix"
    ),
    pytest.param(
        update(ORIGIN + b"\x80\x0e\x30\x00\x02\x01\x10" + V6_NH + b"\x00\x30\x20\x01\x0d\xb8\x00\x01", b""),
        Reset(3, 1),
        id="rfc7606-3j-mp-reach-overruns-attributes",
    ),
    pytest.param(update(MANDATORY + attr(0x40, 77, b"x")), Reset(3, 2, attr(0x40, 77, b"x")), id="rfc4271-6.3-unrecognized-well-known"),
    pytest.param(
        update(ORIGIN + AS_PATH + mp_reach(afi=1, next_hop=V6_NH, nlri=NLRI), b""),
        Reset(3, 9, mp_reach(afi=1, next_hop=V6_NH, nlri=NLRI)),
        id="rfc7606-7.11-ipv4-nlri-with-ipv6-next-hop-without-rfc8950",
    ),
    pytest.param(
        update(ORIGIN + AS_PATH + b"\x40\x03", b"", withdrawn=NLRI), Reset(3, 1), id="rfc7606-5.2-framing-error-without-nlri"
    ),
    # RFC 7606 §3 j over §4: an attribute whose length runs past the path attributes may hide an
    # MP_REACH_NLRI / MP_UNREACH_NLRI in the octets after its header, whose routes
    # treat-as-withdraw could not cover; the NLRI field being non-empty changes nothing.
    pytest.param(update(MANDATORY + bytes((0xC0, 8, len(mp_reach()) + 1)) + mp_reach()), Reset(3, 1), id="rfc7606-3j-framing-error-may-hide-mp-reach"),
    pytest.param(update(MANDATORY + bytes((0xC0, 8, len(mp_unreach()) + 1)) + mp_unreach()), Reset(3, 1), id="rfc7606-3j-framing-error-may-hide-mp-unreach"),
    pytest.param(update(mp_reach() + MANDATORY + bytes((0xC0, 8, 7)) + mp_unreach(withdrawn=b"")), Reset(3, 1), id="rfc7606-3j-framing-error-after-mp-reach-may-hide-mp-unreach"),
    # After an MP_UNREACH_NLRI: the room left is weighed against the shortest MP_REACH_NLRI (8
    # octets: header, AFI, SAFI, next hop length 0, reserved), both sides of that boundary.
    pytest.param(update(mp_unreach(withdrawn=b"\x30\x20\x01\x0d\xb8\x00\x02") + MANDATORY + bytes((0xC0, 8, len(mp_reach()) + 1)) + mp_reach()), Reset(3, 1), id="rfc7606-3j-framing-error-after-mp-unreach-may-hide-mp-reach"),
    pytest.param(update(mp_unreach(withdrawn=b"\x30\x20\x01\x0d\xb8\x00\x02") + MANDATORY + bytes((0xC0, 8, 9)) + bytes(8)), Reset(3, 1), id="rfc7606-3j-framing-error-after-mp-unreach-room-for-mp-reach"),
    # ---------------------------------------------------------------- UPDATE: treat-as-withdraw / attribute-discard
    # RFC 7606 §5.2 once the attributes were framed: the NLRI fields were all parsed, so the
    # error withdraws nothing and the session stays (FRR after CVE-2023-47235).
    pytest.param(update(BAD_ORIGIN + AS_PATH + NEXT_HOP, b"", withdrawn=NLRI), Outcome(TAW, 3, 6, BAD_ORIGIN, 1), id="rfc7606-5.2-treat-as-withdraw-without-nlri-withdraws-nothing"),
    pytest.param(update(BAD_ORIGIN + AS_PATH + NEXT_HOP, b""), Outcome(TAW, 3, 6, BAD_ORIGIN, 1), id="rfc7606-5.2-end-of-rib-shaped-with-malformed-origin"),
    pytest.param(update(MANDATORY + attr(0x40, 5, b"\x00\x00\x00\x64")), Outcome(DISCARD, 3, 1, attr(0x40, 5, b"\x00\x00\x00\x64"), 5), EXT, id="rfc7606-7.5-local-pref-from-external-discarded"),
    pytest.param(update(MANDATORY + attr(0x40, 5, b"\x00\x01\x02")), Outcome(DISCARD, 3, 5, attr(0x40, 5, b"\x00\x01\x02"), 5), EXT, id="rfc7606-7.5-malformed-local-pref-from-external-discarded"),
    pytest.param(update(ORIGIN + attr(0x40, 2, segment(3, [65010]) + segment(2, [65001])) + NEXT_HOP), Outcome(TAW, 3, 11, b"", 2), EXT, id="rfc5065-5-confed-sequence-from-external"),
    pytest.param(update(ORIGIN + attr(0x40, 2, segment(4, [65010, 65011])) + NEXT_HOP), Outcome(TAW, 3, 11, b"", 2), EXT, id="rfc5065-5-confed-set-from-external"),
    pytest.param(update(attr(0x40, 1, b"\x00\x00") + AS_PATH + NEXT_HOP), Outcome(TAW, 3, 5, attr(0x40, 1, b"\x00\x00"), 1), id="rfc7606-7.1-origin-length-2"),
    pytest.param(update(BAD_ORIGIN + AS_PATH + NEXT_HOP), Outcome(TAW, 3, 6, BAD_ORIGIN, 1), id="rfc7606-7.1-origin-value-3"),
    pytest.param(update(attr(0xC0, 1, b"\x00") + AS_PATH + NEXT_HOP), Outcome(TAW, 3, 4, attr(0xC0, 1, b"\x00"), 1), id="rfc7606-3c-origin-optional-bit"),
    pytest.param(update(ORIGIN + attr(0x00, 2, segment(2, [1])) + NEXT_HOP), Outcome(TAW, 3, 4, attr(0x00, 2, segment(2, [1])), 2), id="rfc7606-3c-as-path-transitive-bit-clear"),
    pytest.param(update(ORIGIN + attr(0x40, 2, b"\x02\x03\x00\x00\xfd\xe9") + NEXT_HOP), Outcome(TAW, 3, 11, b"", 2), id="rfc7606-7.2-as-path-segment-overrun"),
    pytest.param(update(ORIGIN + attr(0x40, 2, b"\x02\x00") + NEXT_HOP), Outcome(TAW, 3, 11, b"", 2), id="rfc7606-7.2-as-path-zero-length-segment"),
    pytest.param(update(ORIGIN + attr(0x40, 2, segment(2, [1]) + b"\x02") + NEXT_HOP), Outcome(TAW, 3, 11, b"", 2), id="rfc7606-7.2-as-path-one-octet-underrun"),
    pytest.param(update(ORIGIN + attr(0x40, 2, segment(5, [1])) + NEXT_HOP), Outcome(TAW, 3, 11, b"", 2), id="rfc7606-7.2-as-path-segment-type-5"),
    pytest.param(update(ORIGIN + attr(0x40, 2, segment(2, [65001, 0])) + NEXT_HOP), Outcome(TAW, 3, 11, b"", 2), id="rfc7607-2-as-path-contains-as0"),
    pytest.param(update(ORIGIN + attr(0x40, 2, segment(2, [65001, 65002])) + NEXT_HOP), Outcome(TAW, 3, 11, b"", 2), OLD, id="rfc7606-7.2-as-path-4-octet-on-2-octet-session"),
    pytest.param(update(ORIGIN + AS_PATH + attr(0x40, 3, b"\x0a\x00\x00\x01\x00")), Outcome(TAW, 3, 5, attr(0x40, 3, b"\x0a\x00\x00\x01\x00"), 3), id="rfc7606-7.3-next-hop-length-5"),
    pytest.param(update(ORIGIN + AS_PATH + attr(0x40, 3, bytes(4))), Outcome(TAW, 3, 8, attr(0x40, 3, bytes(4))), id="rfc4271-6.3-next-hop-0.0.0.0"),
    pytest.param(update(ORIGIN + AS_PATH + attr(0x40, 3, bytes((224, 0, 0, 5)))), Outcome(TAW, 3, 8, attr(0x40, 3, bytes((224, 0, 0, 5)))), id="rfc4271-6.3-next-hop-multicast"),
    pytest.param(update(ORIGIN + AS_PATH + attr(0x40, 3, b"\xff" * 4)), Outcome(TAW, 3, 8, attr(0x40, 3, b"\xff" * 4)), id="rfc4271-6.3-next-hop-broadcast"),
    pytest.param(update(MANDATORY + attr(0x80, 4, b"\x00\x00\x05")), Outcome(TAW, 3, 5, attr(0x80, 4, b"\x00\x00\x05"), 4), id="rfc7606-7.4-med-length-3"),
    pytest.param(update(MANDATORY + attr(0x40, 5, b"")), Outcome(TAW, 3, 5, attr(0x40, 5, b""), 5), id="rfc7606-7.5-local-pref-length-0"),
    pytest.param(update(MANDATORY + attr(0x40, 6, b"\x01")), Outcome(DISCARD, 3, 5, attr(0x40, 6, b"\x01"), 6), id="rfc7606-7.6-atomic-aggregate-length-1"),
    pytest.param(update(MANDATORY + attr(0xC0, 7, b"\x00\x00\xfd\xe9\x0a\x00\x00")), Outcome(DISCARD, 3, 5, attr(0xC0, 7, b"\x00\x00\xfd\xe9\x0a\x00\x00"), 7), id="rfc7606-7.7-aggregator-length-7"),
    pytest.param(update(MANDATORY + attr(0xC0, 7, b"\xfd\xe9\x0a\x00\x00\x01")), Outcome(DISCARD, 3, 5, attr(0xC0, 7, b"\xfd\xe9\x0a\x00\x00\x01"), 7), id="rfc7606-7.7-aggregator-length-6-on-4-octet-session"),
    pytest.param(update(MANDATORY + attr(0xC0, 7, bytes(4) + b"\x0a\x00\x00\x01")), Outcome(DISCARD, 3, 9, attr(0xC0, 7, bytes(4) + b"\x0a\x00\x00\x01"), 7), id="rfc7607-2-aggregator-as0"),
    pytest.param(update(MANDATORY + attr(0x40, 7, b"\x00\x00\xfd\xe9\x0a\x00\x00\x01")), Outcome(DISCARD, 3, 4, attr(0x40, 7, b"\x00\x00\xfd\xe9\x0a\x00\x00\x01"), 7), id="rfc7606-3f-aggregator-flags-discard"),
    pytest.param(update(MANDATORY + attr(0xC0, 8, b"\x00\x01\x00")), Outcome(TAW, 3, 5, attr(0xC0, 8, b"\x00\x01\x00"), 8), id="rfc7606-7.8-communities-length-3"),
    pytest.param(update(MANDATORY + attr(0xC0, 8, b"")), Outcome(TAW, 3, 5, attr(0xC0, 8, b""), 8), id="rfc7606-7.8-communities-length-0"),
    pytest.param(update(MANDATORY + attr(0x40, 8, b"\x00\x01\x00\x02")), Outcome(TAW, 3, 4, attr(0x40, 8, b"\x00\x01\x00\x02"), 8), id="rfc7606-3c-communities-well-known-flags"),
    pytest.param(update(MANDATORY + attr(0x80, 9, b"\x0a\x00\x00")), Outcome(TAW, 3, 5, attr(0x80, 9, b"\x0a\x00\x00"), 9), id="rfc7606-7.9-originator-id-length-3"),
    pytest.param(update(MANDATORY + attr(0x80, 10, b"\x0a\x00\x00\x01\x0a\x00")), Outcome(TAW, 3, 5, attr(0x80, 10, b"\x0a\x00\x00\x01\x0a\x00"), 10), id="rfc7606-7.10-cluster-list-length-6"),
    pytest.param(update(MANDATORY + attr(0x80, 9, b"\x01\x02\x03")), Outcome(DISCARD, 3, 5, attr(0x80, 9, b"\x01\x02\x03"), 9), EXT, id="rfc7606-7.9-malformed-originator-id-from-external-discarded"),
    pytest.param(update(MANDATORY + attr(0x80, 9, b"\x0a\x00\x00\x09")), Outcome(DISCARD, 3, 1, attr(0x80, 9, b"\x0a\x00\x00\x09"), 9), EXT, id="rfc7606-7.9-originator-id-from-external-discarded"),
    pytest.param(update(MANDATORY + attr(0xC0, 9, b"\x0a\x00\x00\x0a")), Outcome(DISCARD, 3, 1, attr(0xC0, 9, b"\x0a\x00\x00\x0a"), 9), EXT, id="rfc7606-7.9-originator-id-bad-flags-from-external-discarded"),
    pytest.param(update(MANDATORY + attr(0x80, 10, b"\x01\x02\x03\x04\x05")), Outcome(DISCARD, 3, 5, attr(0x80, 10, b"\x01\x02\x03\x04\x05"), 10), EXT, id="rfc7606-7.10-malformed-cluster-list-from-external-discarded"),
    pytest.param(update(MANDATORY + attr(0x80, 10, b"")), Outcome(DISCARD, 3, 5, attr(0x80, 10, b""), 10), EXT, id="rfc7606-7.10-empty-cluster-list-from-external-discarded"),
    pytest.param(update(MANDATORY + attr(0xC0, 32, bytes(13))), Outcome(TAW, 3, 5, attr(0xC0, 32, bytes(13)), 32), id="rfc8092-6-large-communities-length-13"),
    pytest.param(update(MANDATORY + attr(0xC0, 32, b"")), Outcome(TAW, 3, 5, attr(0xC0, 32, b""), 32), id="rfc8092-6-large-communities-length-0"),
    pytest.param(update(AS_PATH + NEXT_HOP), Outcome(TAW, 3, 3, b"\x01", 1), id="rfc7606-3d-missing-origin"),
    pytest.param(update(ORIGIN + NEXT_HOP), Outcome(TAW, 3, 3, b"\x02", 2), id="rfc7606-3d-missing-as-path"),
    pytest.param(update(ORIGIN + AS_PATH), Outcome(TAW, 3, 3, b"\x03", 3), id="rfc7606-3d-missing-next-hop"),
    pytest.param(update(b"\x40\x01"), Outcome(TAW, 3, 1), id="rfc7606-4-attribute-header-truncated"),
    pytest.param(update(MANDATORY + b"\x80\x04\x09\x00\x00\x00\x05"), Outcome(TAW, 3, 1), id="rfc7606-4-attribute-overruns-total-length"),
    # Both MP attributes framed before the overrun (a third would be a repeat): every NLRI was located.
    pytest.param(update(mp_reach() + mp_unreach(withdrawn=b"\x30\x20\x01\x0d\xb8\x00\x02") + MANDATORY + bytes((0xC0, 8, 30)) + bytes(12)), Outcome(TAW, 3, 1), id="rfc7606-4-framing-error-after-both-mp-attributes"),
    pytest.param(update(mp_unreach(withdrawn=b"\x30\x20\x01\x0d\xb8\x00\x02") + MANDATORY + bytes((0xC0, 8, 8)) + bytes(7)), Outcome(TAW, 3, 1), id="rfc7606-4-framing-error-after-mp-unreach-no-room-for-mp-reach"),
    pytest.param(update(MANDATORY + b"\x90\x04\x00"), Outcome(TAW, 3, 1), id="rfc7606-4-extended-header-truncated"),
    pytest.param(update(MANDATORY + MED + attr(0x80, 4, b"\x00\x00\x00\x09")), Outcome(DISCARD, 3, 1, attr(0x80, 4, b"\x00\x00\x00\x09")), id="rfc7606-3g-duplicate-med-discarded"),
    pytest.param(update(ORIGIN + AS_PATH2 + NEXT_HOP + attr(0xC0, 17, b"\x02\x01\x00\x00")), Outcome(DISCARD, 3, 5, attr(0xC0, 17, b"\x02\x01\x00\x00"), 17), OLD, id="rfc6793-6-as4-path-length-4-discarded"),
    pytest.param(update(ORIGIN + AS_PATH2 + NEXT_HOP + attr(0xC0, 17, b"\x02\x00" + bytes(4))), Outcome(DISCARD, 3, 9, attr(0xC0, 17, b"\x02\x00" + bytes(4)), 17), OLD, id="rfc6793-6-as4-path-zero-length-segment"),
    pytest.param(update(ORIGIN + AS_PATH2 + NEXT_HOP + attr(0xC0, 18, bytes(7))), Outcome(DISCARD, 3, 5, attr(0xC0, 18, bytes(7)), 18), OLD, id="rfc6793-6-as4-aggregator-length-7"),
    pytest.param(update(MANDATORY + attr(0xC0, 17, segment(2, [65001]))), Outcome(DISCARD, 3, 9, attr(0xC0, 17, segment(2, [65001])), 17), id="rfc6793-3-as4-path-on-4-octet-session"),
    pytest.param(update(ORIGIN + AS_PATH + mp_reach(flags=0xC0), b""), Outcome(TAW, 3, 4, mp_reach(flags=0xC0)), id="rfc7606-3c-mp-reach-transitive-bit"),
    pytest.param(
        update(ORIGIN + AS_PATH + mp_reach(afi=1, next_hop=bytes((227, 0, 0, 1)), nlri=NLRI), b""),
        Outcome(TAW, 3, 8, mp_reach(afi=1, next_hop=bytes((227, 0, 0, 1)), nlri=NLRI)),
        id="rfc4271-6.3-mp-reach-ipv4-next-hop-multicast",
    ),
    pytest.param(
        update(ORIGIN + AS_PATH + mp_reach(afi=1, next_hop=bytes(4), nlri=NLRI), b""),
        Outcome(TAW, 3, 8, mp_reach(afi=1, next_hop=bytes(4), nlri=NLRI)),
        id="rfc4271-6.3-mp-reach-ipv4-next-hop-0.0.0.0",
    ),
    pytest.param(
        update(ORIGIN + AS_PATH + mp_reach(next_hop=bytes(16)), b""),
        Outcome(TAW, 3, 8, mp_reach(next_hop=bytes(16))),
        id="rfc4271-6.3-mp-reach-ipv6-next-hop-unspecified",
    ),
    pytest.param(
        update(ORIGIN + AS_PATH + mp_reach(next_hop=b"\xff\x02" + bytes(13) + b"\x01"), b""),
        Outcome(TAW, 3, 8, mp_reach(next_hop=b"\xff\x02" + bytes(13) + b"\x01")),
        id="rfc4271-6.3-mp-reach-ipv6-next-hop-multicast",
    ),
    pytest.param(update(mp_reach(afi=25, safi=70, next_hop=b"\x01\x02\x03\x04") + MANDATORY), Outcome(DISCARD, 3, 9, mp_reach(afi=25, safi=70, next_hop=b"\x01\x02\x03\x04"), 14), id="rfc4760-8-mp-reach-unsupported-family"),
    pytest.param(update(UNSUPPORTED_UNREACH, b""), Outcome(DISCARD, 3, 9, UNSUPPORTED_UNREACH), id="rfc4760-8-mp-unreach-unsupported-family-with-withdrawals"),
]


@pytest.mark.parametrize(("raw", "expected", "ctx"), [
    pytest.param(p.values[0], p.values[1], p.values[2] if len(p.values) > 2 else CodecContext(), id=p.id) for p in CASES
])
def test_malformed(raw: bytes, expected: Reset | Outcome, ctx: CodecContext) -> None:
    if isinstance(expected, Reset):
        with pytest.raises(DecodeError) as info:
            decode_stream(raw, ctx)
        err = info.value
        assert (err.code, err.subcode, err.data) == (expected.code, expected.subcode, expected.data), str(err)
        assert err.action is ErrorAction.SESSION_RESET
        assert "\n" not in str(err) and str(err)
        return
    msg = decode_stream(raw, ctx)
    assert isinstance(msg, Update)
    matching = [
        e for e in msg.errors if (e.action, e.code, e.subcode, e.data) == (expected.action, expected.code, expected.subcode, expected.data)
    ]
    assert matching, f"expected {expected} in {msg.errors}"
    assert msg.treat_as_withdraw == any(e.action is TAW for e in msg.errors)
    if expected.action is TAW:
        assert msg.treat_as_withdraw
    if expected.absent == 14:
        assert msg.mp_reach is None
    elif expected.absent is not None:
        # A malformed, discarded or missing attribute is not in the decoded set.
        assert expected.absent not in msg.attributes


def test_case_count() -> None:
    """At least 40 distinct malformed messages: every RFC 7606 outcome, several ways each."""
    raws = {p.values[0] for p in CASES}
    assert len(raws) == len(CASES) >= 40


def test_a_framing_error_after_both_mp_attributes_withdraws_their_routes_too() -> None:
    # The one overrun of a long tail that keeps treat-as-withdraw: MP_REACH_NLRI and
    # MP_UNREACH_NLRI were both framed (RFC 7606 §5.1 puts them first), so their NLRI are
    # in the Update for the receiver to withdraw with the NLRI field's.
    unreach = mp_unreach(withdrawn=b"\x30\x20\x01\x0d\xb8\x00\x02")
    msg = decode_stream(update(mp_reach() + unreach + MANDATORY + bytes((0xC0, 8, 30)) + bytes(12)), CodecContext())
    assert isinstance(msg, Update) and msg.treat_as_withdraw
    assert msg.nlri == (NLRI,)
    assert msg.mp_reach is not None and msg.mp_reach.nlri == (b"\x30\x20\x01\x0d\xb8\x00\x01",)
    assert msg.mp_unreach is not None and msg.mp_unreach.withdrawn == (b"\x30\x20\x01\x0d\xb8\x00\x02",)


def test_an_unsupported_family_mp_unreach_with_withdrawals_is_discarded_not_an_end_of_rib() -> None:
    # RFC 4760 §8: a family we cannot parse was not negotiated; its withdrawals are
    # attribute-discarded, and the UPDATE, whose only attribute that was, is no End-of-RIB:
    # only an MP_UNREACH_NLRI without withdrawn routes is one (RFC 4724 §2).
    for cache in (None, {}, {}):
        msg = Update.decode(update(UNSUPPORTED_UNREACH, b"")[19:], CodecContext(), cache)
        assert [(e.action, e.code, e.subcode, e.data) for e in msg.errors] == [(DISCARD, 3, 9, UNSUPPORTED_UNREACH)]
        assert msg.mp_unreach is None and msg.end_of_rib is None and not msg.treat_as_withdraw
