"""Byte builders for the proto codec tests: messages written by hand, not by the encoder,
so that the decoder is checked against the RFC layouts rather than against itself."""

from __future__ import annotations

import struct

MARKER = b"\xff" * 16


def message(msg_type: int, body: bytes, length: int | None = None, marker: bytes = MARKER) -> bytes:
    """A whole message; ``length`` overrides the header's Length field."""
    if length is None:
        length = 19 + len(body)
    return marker + struct.pack("!HB", length, msg_type) + body


def attr(flags: int, code: int, value: bytes) -> bytes:
    """One path attribute; the length field is 2 octets when flags has Extended Length."""
    if flags & 0x10:
        return bytes((flags, code)) + struct.pack("!H", len(value)) + value
    return bytes((flags, code, len(value))) + value


def segment(seg_type: int, asns: list[int], width: int = 4) -> bytes:
    code = "I" if width == 4 else "H"
    return bytes((seg_type, len(asns))) + struct.pack(f"!{len(asns)}{code}", *asns)


ORIGIN = attr(0x40, 1, b"\x00")
AS_PATH = attr(0x40, 2, segment(2, [65001, 65002]))
AS_PATH2 = attr(0x40, 2, segment(2, [65001, 65002], width=2))
NEXT_HOP = attr(0x40, 3, bytes((192, 0, 2, 1)))
MANDATORY = ORIGIN + AS_PATH + NEXT_HOP
NLRI = b"\x18\x0a\x00\x01"  # 10.0.1.0/24


def update_body(attrs: bytes = MANDATORY, nlri: bytes = NLRI, withdrawn: bytes = b"") -> bytes:
    return struct.pack("!H", len(withdrawn)) + withdrawn + struct.pack("!H", len(attrs)) + attrs + nlri


def update(attrs: bytes = MANDATORY, nlri: bytes = NLRI, withdrawn: bytes = b"") -> bytes:
    return message(2, update_body(attrs, nlri, withdrawn))


def mp_reach(afi: int = 2, safi: int = 1, next_hop: bytes = b"\x20\x01\x0d\xb8" + bytes(11) + b"\x01",
             nlri: bytes = b"\x30\x20\x01\x0d\xb8\x00\x01", nh_len: int | None = None, flags: int = 0x80) -> bytes:
    value = struct.pack("!HBB", afi, safi, len(next_hop) if nh_len is None else nh_len) + next_hop + b"\x00" + nlri
    return attr(flags, 14, value)


def mp_unreach(afi: int = 2, safi: int = 1, withdrawn: bytes = b"\x30\x20\x01\x0d\xb8\x00\x01", flags: int = 0x80) -> bytes:
    return attr(flags, 15, struct.pack("!HB", afi, safi) + withdrawn)


def capability(code: int, value: bytes = b"") -> bytes:
    return bytes((code, len(value))) + value


def open_body(
    version: int = 4,
    my_as: int = 65001,
    hold_time: int = 90,
    router_id: bytes = bytes((192, 0, 2, 1)),
    params: bytes | None = None,
    opt_len: int | None = None,
) -> bytes:
    if params is None:
        caps = capability(1, b"\x00\x01\x00\x01") + capability(65, struct.pack("!I", 65001))
        params = bytes((2, len(caps))) + caps
    if opt_len is None:
        opt_len = len(params)
    return struct.pack("!BHH", version, my_as, hold_time) + router_id + bytes((opt_len,)) + params


def open_msg(**kwargs: object) -> bytes:
    return message(1, open_body(**kwargs))  # type: ignore[arg-type]


def caps_param(*caps: bytes) -> bytes:
    joined = b"".join(caps)
    return bytes((2, len(joined))) + joined
