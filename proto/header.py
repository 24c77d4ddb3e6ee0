"""The BGP message header (RFC 4271 §4.1): marker, length, type, and framing a body with it.

Kept apart from :mod:`proto.messages` so the UPDATE packer (:mod:`proto.packing`) frames its
messages without importing the message classes that re-export it.
"""

from __future__ import annotations

from enum import IntEnum

from proto._attr_base import DEFAULT_CONTEXT, CodecContext

__all__ = ["MARKER", "HEADER_LEN", "MAX_MESSAGE_LEN", "MessageType", "frame"]

MARKER = b"\xff" * 16
HEADER_LEN = 19
MAX_MESSAGE_LEN = 4096


class MessageType(IntEnum):
    OPEN = 1
    UPDATE = 2
    NOTIFICATION = 3
    KEEPALIVE = 4
    ROUTE_REFRESH = 5  # RFC 2918


def frame(msg_type: int, body: bytes, ctx: CodecContext = DEFAULT_CONTEXT) -> bytes:
    """Prefix ``body`` with the 19-octet header (RFC 4271 §4.1)."""
    length = HEADER_LEN + len(body)
    if length > ctx.max_message_len:
        raise ValueError(f"message of {length} octets exceeds the {ctx.max_message_len}-octet limit")
    return MARKER + length.to_bytes(2, "big") + bytes((msg_type,)) + body
