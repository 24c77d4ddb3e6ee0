"""Address families and prefixes in their wire form (RFC 4271 §4.3, RFC 4760 §5).

A prefix is a plain ``bytes`` object exactly as it sits in an UPDATE: one length octet,
then ceil(length/8) address octets with the host bits zeroed.  ``10.1.0.0/16`` is
``b"\\x10\\x0a\\x01"`` and ``0.0.0.0/0`` is ``b"\\x00"``.  Such a value is hashable, is
sliced straight out of a received UPDATE, and re-encodes by concatenation, which is what
makes a million-route table cheap.  The address family travels alongside, never inside.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from enum import IntEnum
from ipaddress import IPv4Network, IPv6Network

from proto.errors import DecodeError, ErrorCode, UpdateSubcode


class Afi(IntEnum):
    """Address Family Identifiers used here (IANA address family numbers)."""

    IPV4 = 1
    IPV6 = 2


class Safi(IntEnum):
    """Subsequent Address Family Identifiers used here (RFC 4760 §6)."""

    UNICAST = 1


IPV4_UNICAST = (Afi.IPV4, Safi.UNICAST)
IPV6_UNICAST = (Afi.IPV6, Safi.UNICAST)

#: Address size in bits and octets per AFI.
MAX_PREFIX_LEN = {Afi.IPV4: 32, Afi.IPV6: 128}
ADDRESS_OCTETS = {Afi.IPV4: 4, Afi.IPV6: 16}


def _steps(max_len: int) -> tuple[int, ...]:
    # Bytes a prefix of each possible length octet occupies (0 marks an invalid length).
    return tuple(1 + ((n + 7) >> 3) if n <= max_len else 0 for n in range(256))


_STEP = {1: _steps(32), 2: _steps(128)}
# Mask of the host bits in the last address octet, by prefix length (0: none).
_HOST_MASK = tuple((0xFF >> (n & 7)) if n & 7 else 0 for n in range(256))
_NET_MASK = tuple((0xFF << (8 - (n & 7))) & 0xFF if n & 7 else 0xFF for n in range(256))


def _wire_pattern(max_len: int, common: tuple[int, ...]) -> re.Pattern[bytes]:
    # One alternative per prefix length: the length octet, the address octets, and for a
    # length that ends inside an octet a last octet with its host bits clear.  A field
    # findall() tiles completely is exactly what the octet-by-octet walk would accept
    # (the alternatives are told apart by their first octet, which sre tests before
    # entering one), and it is cut into bytes objects without a Python-level loop.  The
    # common lengths go first: sre tries the alternatives in order.
    alts = []
    for plen in common + tuple(n for n in range(max_len + 1) if n not in common):
        octets = (plen + 7) >> 3
        host = _HOST_MASK[plen]
        alt = re.escape(bytes((plen,)))
        if octets:
            alt += b".{%d}" % (octets - 1) if octets > 1 else b""
            if host:
                alt += b"[" + b"".join(re.escape(bytes((o,))) for o in range(256) if not o & host) + b"]"
            else:
                alt += b"."
        alts.append(alt)
    return re.compile(b"|".join(alts), re.DOTALL)


_WIRE = {
    1: _wire_pattern(32, (24, 22, 23, 21, 20, 19, 16, 18, 17)),
    2: _wire_pattern(128, (48, 32, 44, 40, 36, 29, 64, 56, 47, 46)),
}


def _bad_network(message: str) -> DecodeError:
    # RFC 4271 §6.3 / RFC 7606 §5.3: a syntactically wrong NLRI (or Withdrawn Routes,
    # RFC 7606 §3 i) field resets the session; the subcode carries no data.
    return DecodeError(ErrorCode.UPDATE_MESSAGE, UpdateSubcode.INVALID_NETWORK_FIELD, b"", message)


def decode_prefixes_at(data: bytes, start: int, end: int, afi: int) -> list[bytes]:
    """Decode the prefixes in ``data[start:end]`` without copying the field first."""
    step = _STEP.get(afi)
    if step is None:
        raise _bad_network(f"unsupported AFI {afi}")
    # Fast path, in C: a well-formed field whose host bits are clear (every field a sane
    # speaker sends) is cut by one regular-expression pass.  Anything else (a bad length,
    # an overrun, host bits set) leaves octets unmatched and takes the walk below, which
    # says what is wrong or repairs the host bits.
    out = _WIRE[afi].findall(data, start, end)
    if sum(map(len, out)) == end - start:
        return out
    out = []
    append = out.append
    mask = _HOST_MASK
    pos = start
    while pos < end:
        plen = data[pos]
        size = step[plen]
        if not size:
            raise _bad_network(f"prefix length {plen} exceeds {32 if afi == 1 else 128}")
        nxt = pos + size
        if nxt > end:
            raise _bad_network(f"prefix of length {plen} overruns the field by {nxt - end} octets")
        if data[nxt - 1] & mask[plen]:
            # Host bits set: keep the prefix, clear the bits (RFC 4271 §4.3 says they are
            # irrelevant), so equal routes have equal keys.
            append(data[pos : nxt - 1] + bytes((data[nxt - 1] & _NET_MASK[plen],)))
        else:
            append(data[pos:nxt])
        pos = nxt
    return out


def decode_prefixes(data: bytes | bytearray | memoryview, afi: int) -> list[bytes]:
    """Split an NLRI / Withdrawn Routes field into wire-form prefixes.

    Raises DecodeError(3, 10) when a length exceeds the family's maximum or a prefix
    overruns the data; host bits beyond the length are zeroed.
    """
    if not isinstance(data, bytes):
        data = bytes(data)
    return decode_prefixes_at(data, 0, len(data), afi)


def encode_prefixes(prefixes: Iterable[bytes]) -> bytes:
    """Concatenate wire-form prefixes into an NLRI field."""
    return b"".join(prefixes)


def prefix_len(prefix: bytes) -> int:
    """The prefix length in bits."""
    return prefix[0]


def _check(afi: int, prefix: bytes) -> int:
    octets = ADDRESS_OCTETS.get(afi)  # type: ignore[call-overload]
    if octets is None:
        raise ValueError(f"unsupported address family {afi}")
    if not prefix:
        raise ValueError("empty prefix")
    plen = prefix[0]
    if plen > octets * 8 or len(prefix) != 1 + ((plen + 7) >> 3):
        raise ValueError(f"malformed wire prefix {prefix.hex()} for AFI {afi}")
    return octets


def prefix_to_network(afi: int, prefix: bytes) -> IPv4Network | IPv6Network:
    """The ``ipaddress`` network for a wire-form prefix."""
    octets = _check(afi, prefix)
    address = prefix[1:] + bytes(octets - (len(prefix) - 1))
    if afi == Afi.IPV4:
        return IPv4Network((address, prefix[0]))
    return IPv6Network((address, prefix[0]))


def prefix_to_str(afi: int, prefix: bytes) -> str:
    """``"10.1.0.0/16"`` for ``(Afi.IPV4, b"\\x10\\x0a\\x01")``."""
    return str(prefix_to_network(afi, prefix))


def network_to_prefix(network: IPv4Network | IPv6Network) -> bytes:
    """The wire form of an ``ipaddress`` network."""
    plen = network.prefixlen
    return bytes((plen,)) + network.network_address.packed[: (plen + 7) >> 3]


def prefix_from_str(text: str) -> tuple[Afi, bytes]:
    """Parse ``"10.1.0.0/16"`` or ``"2001:db8::/32"``; host bits set is an error."""
    if not isinstance(text, str):
        raise ValueError(f"a prefix must be text like '10.1.0.0/16', not {type(text).__name__}")
    try:
        network = ipaddress.ip_network(text.strip(), strict=True)
    except ValueError as exc:
        raise ValueError(f"invalid prefix {text!r}: {exc}") from None
    afi = Afi.IPV4 if network.version == 4 else Afi.IPV6
    return afi, network_to_prefix(network)
