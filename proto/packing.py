"""Packing many prefixes that share attributes into as few UPDATEs as fit.

Used by the RIB to send routes: IPv4 unicast in the NLRI / Withdrawn Routes fields,
IPv6 unicast in MP_REACH_NLRI / MP_UNREACH_NLRI placed first (RFC 7606 §5.1).  Each UPDATE
carries one kind of content only (RFC 7606 §5.1: never more than one of withdrawn, NLRI,
MP_REACH_NLRI, MP_UNREACH_NLRI).
"""

from __future__ import annotations

from collections.abc import Sequence
from ipaddress import IPv4Address, IPv6Address, ip_address

from proto._attr_base import DEFAULT_CONTEXT, OPTIONAL, CodecContext, attribute_header
from proto.attributes import NextHop, PathAttributes
from proto.header import HEADER_LEN, MessageType, frame

_ATTR_HEADER_MAX = 4  # extended-length header, reserved whatever the value length


def _chunks(prefixes: Sequence[bytes], room: int) -> list[bytes]:
    """Concatenations of consecutive prefixes, each at most ``room`` octets."""
    out = []
    start = 0
    size = 0
    for i, prefix in enumerate(prefixes):
        n = len(prefix)
        if size + n > room:
            out.append(b"".join(prefixes[start:i]))
            start = i
            size = 0
        size += n
    out.append(b"".join(prefixes[start:]))
    return out


def _limit(ctx: CodecContext, max_size: int) -> int:
    return min(max_size, ctx.max_message_len)


def _ipv6_next_hop(next_hop: object) -> bytes:
    hops = next_hop if isinstance(next_hop, tuple) else (next_hop,)
    if not 1 <= len(hops) <= 2:
        raise ValueError(f"an IPv6 next hop is one or two addresses, got {len(hops)}")
    addresses = [h if isinstance(h, IPv6Address) else ip_address(h) for h in hops]  # type: ignore[arg-type]
    if any(not isinstance(a, IPv6Address) for a in addresses):
        raise ValueError(f"IPv6 routes need IPv6 next hops, got {next_hop}")
    return b"".join(a.packed for a in addresses)


def encode_updates(
    afi: int,
    attributes: PathAttributes,
    next_hop: object,
    prefixes: Sequence[bytes],
    ctx: CodecContext = DEFAULT_CONTEXT,
    max_size: int = 4096,
) -> list[bytes]:
    """Complete UPDATE messages announcing ``prefixes`` with ``attributes`` and
    ``next_hop``, each at most ``max_size`` octets, every prefix exactly once."""
    if not prefixes:
        return []
    limit = _limit(ctx, max_size)
    if afi == 1:
        nh = next_hop if isinstance(next_hop, IPv4Address) else IPv4Address(next_hop)  # type: ignore[arg-type]
        attrs = attributes.replace(NextHop(nh)).encode(ctx)
        room = limit - HEADER_LEN - 4 - len(attrs)
        if room < 5:
            raise ValueError(f"{len(attrs)} octets of attributes leave no room for a prefix in {limit} octets")
        head = b"\x00\x00" + len(attrs).to_bytes(2, "big") + attrs
        return [frame(MessageType.UPDATE, head + chunk, ctx) for chunk in _chunks(prefixes, room)]
    if afi == 2:
        attrs = attributes.without(NextHop.code).encode(ctx)
        nh = _ipv6_next_hop(next_hop)
        mp_head = b"\x00\x02\x01" + bytes((len(nh),)) + nh + b"\x00"
        room = limit - HEADER_LEN - 4 - _ATTR_HEADER_MAX - len(mp_head) - len(attrs)
        if room < 17:
            raise ValueError(f"{len(attrs)} octets of attributes leave no room for a prefix in {limit} octets")
        out = []
        for chunk in _chunks(prefixes, room):
            value_len = len(mp_head) + len(chunk)
            mp = attribute_header(OPTIONAL, 14, value_len) + mp_head + chunk
            total = len(mp) + len(attrs)
            out.append(frame(MessageType.UPDATE, b"\x00\x00" + total.to_bytes(2, "big") + mp + attrs, ctx))
        return out
    raise ValueError(f"unsupported AFI {afi}: only IPv4 (1) and IPv6 (2) unicast")


def encode_withdrawals(
    afi: int, prefixes: Sequence[bytes], ctx: CodecContext = DEFAULT_CONTEXT, max_size: int = 4096
) -> list[bytes]:
    """Complete UPDATE messages withdrawing ``prefixes``, each at most ``max_size`` octets."""
    if not prefixes:
        return []
    limit = _limit(ctx, max_size)
    if afi == 1:
        room = limit - HEADER_LEN - 4
        return [
            frame(MessageType.UPDATE, len(chunk).to_bytes(2, "big") + chunk + b"\x00\x00", ctx)
            for chunk in _chunks(prefixes, room)
        ]
    if afi == 2:
        room = limit - HEADER_LEN - 4 - _ATTR_HEADER_MAX - 3
        out = []
        for chunk in _chunks(prefixes, room):
            mp = attribute_header(OPTIONAL, 15, 3 + len(chunk)) + b"\x00\x02\x01" + chunk
            out.append(frame(MessageType.UPDATE, b"\x00\x00" + len(mp).to_bytes(2, "big") + mp, ctx))
        return out
    raise ValueError(f"unsupported AFI {afi}: only IPv4 (1) and IPv6 (2) unicast")
