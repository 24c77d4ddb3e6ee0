"""BGP path attributes (RFC 4271 §4.3, §5) and the immutable attribute set of a route.

One frozen dataclass per attribute type, each with ``encode_value``/``decode_value`` and
its RFC 7606 error action as data (``action``).  :data:`ATTRIBUTES` is the literal type
code -> class map.  :class:`PathAttributes` is what the RIB stores per route: hashable,
sorted by type code, at most one attribute per code, with O(1) lookups.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from functools import partial
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from typing import Any, ClassVar

from proto._attr_base import (
    AS_TRANS,
    DEFAULT_CONTEXT,
    EXTENDED_LENGTH,
    OPTIONAL,
    PARTIAL,
    TRANSITIVE,
    CodecContext,
    PathAttribute,
    attribute_header,
    raw_attribute,
)
from proto._aspath import (
    AS_CONFED_SEQUENCE,
    AS_CONFED_SET,
    AS_SEQUENCE,
    AS_SET,
    As4Path,
    AsPath,
    AsPathSegment,
    as4_path_for,
    merge_as4_path,
)
from proto._mp import MpReachNlri, MpUnreachNlri
from proto.errors import ErrorAction, UpdateSubcode

__all__ = [
    "OPTIONAL", "TRANSITIVE", "PARTIAL", "EXTENDED_LENGTH", "AS_TRANS",
    "CodecContext", "DEFAULT_CONTEXT", "PathAttribute", "attribute_header", "raw_attribute",
    "ORIGIN_IGP", "ORIGIN_EGP", "ORIGIN_INCOMPLETE", "Origin",
    "AS_SET", "AS_SEQUENCE", "AS_CONFED_SEQUENCE", "AS_CONFED_SET", "AsPathSegment", "AsPath",
    "NextHop", "MultiExitDisc", "LocalPref", "AtomicAggregate", "Aggregator",
    "NO_EXPORT", "NO_ADVERTISE", "NO_EXPORT_SUBCONFED", "NOPEER", "GRACEFUL_SHUTDOWN",
    "BLACKHOLE", "Communities", "community_to_str", "community_from_str",
    "OriginatorId", "ClusterList", "MpReachNlri", "MpUnreachNlri", "As4Path", "As4Aggregator",
    "LargeCommunities", "UnknownAttribute", "ATTRIBUTES", "PathAttributes", "EMPTY_ATTRIBUTES",
    "merge_as4_path", "next_hop_problem",
]

ORIGIN_IGP = 0
ORIGIN_EGP = 1
ORIGIN_INCOMPLETE = 2
_ORIGIN_NAMES = {0: "IGP", 1: "EGP", 2: "INCOMPLETE"}


_u32 = partial(int.from_bytes, byteorder="big")


@dataclass(frozen=True, slots=True)
class Origin(PathAttribute):
    """ORIGIN (type 1, well-known mandatory)."""

    code: ClassVar[int] = 1
    flags: ClassVar[int] = TRANSITIVE
    action: ClassVar[ErrorAction] = ErrorAction.TREAT_AS_WITHDRAW  # RFC 7606 §7.1
    name: ClassVar[str] = "ORIGIN"
    value: int

    def __str__(self) -> str:
        return _ORIGIN_NAMES.get(self.value, str(self.value))

    def encode_value(self, ctx: CodecContext) -> bytes:
        return bytes((self.value,))

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> Origin:
        if len(value) != 1:
            raise cls.error(UpdateSubcode.ATTRIBUTE_LENGTH_ERROR, value, flags, f"length {len(value)}, expected 1")
        if value[0] > ORIGIN_INCOMPLETE:
            raise cls.error(UpdateSubcode.INVALID_ORIGIN_ATTRIBUTE, value, flags, f"undefined value {value[0]}")
        return cls(value[0])


@dataclass(frozen=True, slots=True)
class NextHop(PathAttribute):
    """NEXT_HOP (type 3, well-known mandatory for NLRI-field routes)."""

    code: ClassVar[int] = 3
    flags: ClassVar[int] = TRANSITIVE
    action: ClassVar[ErrorAction] = ErrorAction.TREAT_AS_WITHDRAW  # RFC 7606 §7.3
    name: ClassVar[str] = "NEXT_HOP"
    address: IPv4Address

    def encode_value(self, ctx: CodecContext) -> bytes:
        return self.address.packed

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> NextHop:
        if len(value) != 4:
            raise cls.error(UpdateSubcode.ATTRIBUTE_LENGTH_ERROR, value, flags, f"length {len(value)}, expected 4")
        return cls(IPv4Address(value))


def next_hop_problem(address: IPv4Address) -> str | None:
    """Why ``address`` is not a valid IP host address for NEXT_HOP (RFC 4271 §6.3), or None.

    0.0.0.0, multicast (224/4) and the limited broadcast address are rejected; whether
    the address is the receiver's own is the session's semantic check.
    """
    if address.packed == b"\x00\x00\x00\x00":
        return "0.0.0.0 is not a host address"
    if address.is_multicast:
        return f"{address} is a multicast address"
    if address.packed == b"\xff\xff\xff\xff":
        return "255.255.255.255 is the broadcast address"
    return None


@dataclass(frozen=True, slots=True)
class MultiExitDisc(PathAttribute):
    """MULTI_EXIT_DISC (type 4, optional non-transitive)."""

    code: ClassVar[int] = 4
    flags: ClassVar[int] = OPTIONAL
    action: ClassVar[ErrorAction] = ErrorAction.TREAT_AS_WITHDRAW  # RFC 7606 §7.4
    name: ClassVar[str] = "MULTI_EXIT_DISC"
    value: int

    def encode_value(self, ctx: CodecContext) -> bytes:
        return self.value.to_bytes(4, "big")

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> MultiExitDisc:
        if len(value) != 4:
            raise cls.error(UpdateSubcode.ATTRIBUTE_LENGTH_ERROR, value, flags, f"length {len(value)}, expected 4")
        return cls(_u32(value))


@dataclass(frozen=True, slots=True)
class LocalPref(PathAttribute):
    """LOCAL_PREF (type 5, well-known; iBGP only - dropping it from eBGP peers,
    RFC 7606 §7.5, is the session's business)."""

    code: ClassVar[int] = 5
    flags: ClassVar[int] = TRANSITIVE
    action: ClassVar[ErrorAction] = ErrorAction.TREAT_AS_WITHDRAW  # RFC 7606 §7.5
    name: ClassVar[str] = "LOCAL_PREF"
    value: int

    def encode_value(self, ctx: CodecContext) -> bytes:
        return self.value.to_bytes(4, "big")

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> LocalPref:
        if len(value) != 4:
            raise cls.error(UpdateSubcode.ATTRIBUTE_LENGTH_ERROR, value, flags, f"length {len(value)}, expected 4")
        return cls(_u32(value))


@dataclass(frozen=True, slots=True)
class AtomicAggregate(PathAttribute):
    """ATOMIC_AGGREGATE (type 6, well-known discretionary, no value)."""

    code: ClassVar[int] = 6
    flags: ClassVar[int] = TRANSITIVE
    action: ClassVar[ErrorAction] = ErrorAction.ATTRIBUTE_DISCARD  # RFC 7606 §7.6
    name: ClassVar[str] = "ATOMIC_AGGREGATE"

    def encode_value(self, ctx: CodecContext) -> bytes:
        return b""

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> AtomicAggregate:
        if value:
            raise cls.error(UpdateSubcode.ATTRIBUTE_LENGTH_ERROR, value, flags, f"length {len(value)}, expected 0")
        return cls()


def _aggregator(cls: Any, value: bytes, flags: int, size: int) -> tuple[int, IPv4Address]:
    if len(value) != size:
        raise cls.error(UpdateSubcode.ATTRIBUTE_LENGTH_ERROR, value, flags, f"length {len(value)}, expected {size}")
    asn = int.from_bytes(value[: size - 4], "big")
    if asn == 0:
        # RFC 7607 §2: AS 0 in AGGREGATOR / AS4_AGGREGATOR is malformed.
        raise cls.error(UpdateSubcode.OPTIONAL_ATTRIBUTE_ERROR, value, flags, "AS number 0")
    return asn, IPv4Address(value[size - 4 :])


@dataclass(frozen=True, slots=True)
class Aggregator(PathAttribute):
    """AGGREGATOR (type 7, optional transitive): 2- or 4-octet AS per the session."""

    code: ClassVar[int] = 7
    flags: ClassVar[int] = OPTIONAL | TRANSITIVE
    action: ClassVar[ErrorAction] = ErrorAction.ATTRIBUTE_DISCARD  # RFC 7606 §7.7
    name: ClassVar[str] = "AGGREGATOR"
    asn: int
    address: IPv4Address

    def encode_value(self, ctx: CodecContext) -> bytes:
        if ctx.four_octet_as:
            return self.asn.to_bytes(4, "big") + self.address.packed
        asn = self.asn if self.asn <= 0xFFFF else AS_TRANS
        return asn.to_bytes(2, "big") + self.address.packed

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> Aggregator:
        return cls(*_aggregator(cls, value, flags, 8 if ctx.four_octet_as else 6))


# Well-known communities (RFC 1997 §3, RFC 3765, RFC 8326, RFC 7999).
NO_EXPORT = 0xFFFFFF01
NO_ADVERTISE = 0xFFFFFF02
NO_EXPORT_SUBCONFED = 0xFFFFFF03
NOPEER = 0xFFFFFF04
GRACEFUL_SHUTDOWN = 0xFFFF0000
BLACKHOLE = 0xFFFF029A
_COMMUNITY_NAMES = {
    NO_EXPORT: "no-export",
    NO_ADVERTISE: "no-advertise",
    NO_EXPORT_SUBCONFED: "no-export-subconfed",
    NOPEER: "nopeer",
    GRACEFUL_SHUTDOWN: "graceful-shutdown",
    BLACKHOLE: "blackhole",
}
_COMMUNITY_VALUES = {v: k for k, v in _COMMUNITY_NAMES.items()}


def community_to_str(value: int) -> str:
    """``"65000:100"`` (high 16 bits : low 16 bits)."""
    return f"{value >> 16}:{value & 0xFFFF}"


def community_from_str(text: str) -> int:
    """Parse ``"65000:100"`` or a well-known name such as ``"no-export"``."""
    text = text.strip().lower()
    if text in _COMMUNITY_VALUES:
        return _COMMUNITY_VALUES[text]
    high, sep, low = text.partition(":")
    # ASCII digits ("٣" is no 3), not so many that int() refuses them
    if sep and all(p.isascii() and p.isdigit() and len(p) <= 5 for p in (high, low)) \
            and int(high) <= 0xFFFF and int(low) <= 0xFFFF:
        return (int(high) << 16) | int(low)
    raise ValueError(f"invalid community {text!r}: expected ASN:VALUE with both parts 0..65535")


@dataclass(frozen=True, slots=True, init=False, repr=False)
class Communities(PathAttribute):
    """COMMUNITIES (type 8, optional transitive, RFC 1997): 32-bit values in order.

    Built from the values (``Communities((0xFDE80064, NO_EXPORT))``); kept as the value
    octets (``raw``, 4 per community, as on the wire), ``values`` unpacks them: a route of
    its own with its own communities then costs one bytes object, not a tuple of ints.
    """

    code: ClassVar[int] = 8
    flags: ClassVar[int] = OPTIONAL | TRANSITIVE
    action: ClassVar[ErrorAction] = ErrorAction.TREAT_AS_WITHDRAW  # RFC 7606 §7.8
    name: ClassVar[str] = "COMMUNITIES"
    raw: bytes

    def __init__(self, values: Iterable[int] = (), *, partial: bool = False) -> None:
        values = tuple(values)
        object.__setattr__(self, "raw", struct.pack(f"!{len(values)}I", *values))
        object.__setattr__(self, "partial", partial)

    @property
    def values(self) -> tuple[int, ...]:
        return struct.unpack(f"!{len(self.raw) >> 2}I", self.raw)

    def __repr__(self) -> str:
        return f"Communities({self.values!r})"

    def __str__(self) -> str:
        return " ".join(community_to_str(v) for v in self.values)

    def encode_value(self, ctx: CodecContext) -> bytes:
        return self.raw

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> Communities:
        if not value or len(value) % 4:
            raise cls.error(
                UpdateSubcode.ATTRIBUTE_LENGTH_ERROR, value, flags, f"length {len(value)} is not a non-zero multiple of 4"
            )
        self = object.__new__(cls)
        object.__setattr__(self, "raw", bytes(value))
        object.__setattr__(self, "partial", bool(flags & PARTIAL))  # RFC 4271 §5, as the decoder would
        return self


@dataclass(frozen=True, slots=True)
class OriginatorId(PathAttribute):
    """ORIGINATOR_ID (type 9, optional non-transitive, RFC 4456 §8)."""

    code: ClassVar[int] = 9
    flags: ClassVar[int] = OPTIONAL
    action: ClassVar[ErrorAction] = ErrorAction.TREAT_AS_WITHDRAW  # RFC 7606 §7.9
    name: ClassVar[str] = "ORIGINATOR_ID"
    address: IPv4Address

    def encode_value(self, ctx: CodecContext) -> bytes:
        return self.address.packed

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> OriginatorId:
        if len(value) != 4:
            raise cls.error(UpdateSubcode.ATTRIBUTE_LENGTH_ERROR, value, flags, f"length {len(value)}, expected 4")
        return cls(IPv4Address(value))


@dataclass(frozen=True, slots=True)
class ClusterList(PathAttribute):
    """CLUSTER_LIST (type 10, optional non-transitive, RFC 4456 §8)."""

    code: ClassVar[int] = 10
    flags: ClassVar[int] = OPTIONAL
    action: ClassVar[ErrorAction] = ErrorAction.TREAT_AS_WITHDRAW  # RFC 7606 §7.10
    name: ClassVar[str] = "CLUSTER_LIST"
    ids: tuple[IPv4Address, ...]

    def encode_value(self, ctx: CodecContext) -> bytes:
        return b"".join(a.packed for a in self.ids)

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> ClusterList:
        if not value or len(value) % 4:
            raise cls.error(
                UpdateSubcode.ATTRIBUTE_LENGTH_ERROR, value, flags, f"length {len(value)} is not a non-zero multiple of 4"
            )
        return cls(tuple(IPv4Address(value[i : i + 4]) for i in range(0, len(value), 4)))


@dataclass(frozen=True, slots=True)
class As4Aggregator(PathAttribute):
    """AS4_AGGREGATOR (type 18, optional transitive, RFC 6793 §3); discarded when
    malformed (RFC 6793 §6)."""

    code: ClassVar[int] = 18
    flags: ClassVar[int] = OPTIONAL | TRANSITIVE
    action: ClassVar[ErrorAction] = ErrorAction.ATTRIBUTE_DISCARD
    name: ClassVar[str] = "AS4_AGGREGATOR"
    asn: int
    address: IPv4Address

    def encode_value(self, ctx: CodecContext) -> bytes:
        return self.asn.to_bytes(4, "big") + self.address.packed

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> As4Aggregator:
        return cls(*_aggregator(cls, value, flags, 8))


@dataclass(frozen=True, slots=True)
class LargeCommunities(PathAttribute):
    """LARGE_COMMUNITY (type 32, optional transitive, RFC 8092): (global, local1, local2)."""

    code: ClassVar[int] = 32
    flags: ClassVar[int] = OPTIONAL | TRANSITIVE
    action: ClassVar[ErrorAction] = ErrorAction.TREAT_AS_WITHDRAW  # RFC 8092 §6
    name: ClassVar[str] = "LARGE_COMMUNITY"
    values: tuple[tuple[int, int, int], ...]

    def __str__(self) -> str:
        return " ".join(f"{a}:{b}:{c}" for a, b, c in self.values)

    def encode_value(self, ctx: CodecContext) -> bytes:
        return b"".join(a.to_bytes(4, "big") + b.to_bytes(4, "big") + c.to_bytes(4, "big") for a, b, c in self.values)

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> LargeCommunities:
        if not value or len(value) % 12:
            raise cls.error(
                UpdateSubcode.ATTRIBUTE_LENGTH_ERROR, value, flags, f"length {len(value)} is not a non-zero multiple of 12"
            )
        return cls(
            tuple(
                (_u32(value[i : i + 4]), _u32(value[i + 4 : i + 8]), _u32(value[i + 8 : i + 12]))
                for i in range(0, len(value), 12)
            )
        )


@dataclass(frozen=True, slots=True)
class UnknownAttribute(PathAttribute):
    """An optional transitive attribute this codec does not interpret, passed on as is
    with the Partial bit set (RFC 4271 §5; §9 says unrecognized non-transitive ones are
    dropped, which the UPDATE decoder does)."""

    action: ClassVar[ErrorAction] = ErrorAction.ATTRIBUTE_DISCARD
    name: ClassVar[str] = "unrecognized attribute"
    code: int  # type: ignore[misc]
    flags: int  # type: ignore[misc]
    value: bytes

    def send_flags(self) -> int:
        if self.flags & TRANSITIVE:
            return (self.flags | PARTIAL) & 0xE0
        return self.flags & 0xE0

    def encode_value(self, ctx: CodecContext) -> bytes:
        return self.value

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> UnknownAttribute:  # pragma: no cover
        raise TypeError("UnknownAttribute needs its type code: it is built by the UPDATE decoder")


ATTRIBUTES: dict[int, type[PathAttribute]] = {
    1: Origin,
    2: AsPath,
    3: NextHop,
    4: MultiExitDisc,
    5: LocalPref,
    6: AtomicAggregate,
    7: Aggregator,
    8: Communities,
    9: OriginatorId,
    10: ClusterList,
    14: MpReachNlri,
    15: MpUnreachNlri,
    17: As4Path,
    18: As4Aggregator,
    32: LargeCommunities,
}

_EMPTY_PATH = AsPath()
_NLRI_CODES = (MpReachNlri.code, MpUnreachNlri.code)


# The type codes of a PathAttributes, in order, as one bytes object (``codes.find(c)`` is
# the position of code ``c`` in ``items``).  Shared: a table holds a handful of distinct
# code lists, so a set of attributes pays a pointer for its index, not a dict per set.
_CODE_LISTS: dict[bytes, bytes] = {}
# A set's hash is the sum of its attributes' hashes (order does not matter, as the codes
# are unique), so the decoder can add up hashes it keeps beside interned attributes
# instead of hashing every attribute of every set again.  It is cut to 30 bits: an int
# below 2**30 is one digit (28 octets), a full 64-bit hash three (36), and a table holds
# one set per route.
_HASH_MASK = (1 << 30) - 1


def _codes_of(items: tuple[PathAttribute, ...]) -> bytes:
    return _shared_codes(bytes([a.code for a in items]))


def _shared_codes(codes: bytes) -> bytes:
    shared = _CODE_LISTS.get(codes)
    if shared is None:
        if len(_CODE_LISTS) >= 4096:  # bounded even if a peer sends every combination
            _CODE_LISTS.clear()
        shared = _CODE_LISTS[codes] = codes
    return shared


@dataclass(frozen=True, slots=True, eq=False)
class PathAttributes:
    """The path attributes of a route: immutable, hashable, sorted by type code.

    Never holds MP_REACH_NLRI/MP_UNREACH_NLRI (they live on the Update).  Lookups by
    code go through ``_codes``, the items' type codes as bytes (a shared object: one
    attribute set per route must not cost a dict per route).
    """

    items: tuple[PathAttribute, ...] = ()
    _codes: bytes = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[int, PathAttribute] = {}
        for attr in self.items:
            code = attr.code
            if code in index:
                raise ValueError(f"two attributes with type code {code}")
            if code in _NLRI_CODES:
                raise ValueError("MP_REACH_NLRI/MP_UNREACH_NLRI belong on the Update, not in PathAttributes")
            index[code] = attr
        items = tuple(index[c] for c in sorted(index))
        object.__setattr__(self, "items", items)
        object.__setattr__(self, "_codes", _codes_of(items))
        object.__setattr__(self, "_hash", sum(map(hash, items)) & _HASH_MASK)

    @classmethod
    def _of_index(
        cls, index: dict[int, PathAttribute], item_hashes: int | None = None, ordered: bool = False
    ) -> PathAttributes:
        """Built from a code -> attribute dict that is already valid (one per code, no MP
        attributes): the decoder's and replace()/without()'s way, skipping the checks.

        ``item_hashes``: the sum of ``hash(a)`` over the attributes, when the caller has it
        (the decoder keeps each interned attribute's hash beside it); ``ordered``: the
        dict's codes are known to be ascending.
        """
        self = object.__new__(cls)
        if not ordered:
            codes = list(index)
            if codes != sorted(codes):
                index = {c: index[c] for c in sorted(codes)}
        items = tuple(index.values())
        object.__setattr__(self, "items", items)
        object.__setattr__(self, "_codes", _shared_codes(bytes(index)))
        if item_hashes is None:
            item_hashes = sum(map(hash, items))
        object.__setattr__(self, "_hash", item_hashes & _HASH_MASK)
        return self

    def _index(self) -> dict[int, PathAttribute]:
        return dict(zip(self._codes, self.items))

    @classmethod
    def of(cls, *attrs: PathAttribute) -> PathAttributes:
        return cls(attrs)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, PathAttributes):
            return NotImplemented
        return self._hash == other._hash and self.items == other.items

    def __getstate__(self) -> tuple[PathAttribute, ...]:
        return self.items

    def __setstate__(self, state: tuple[PathAttribute, ...]) -> None:
        object.__setattr__(self, "items", state)
        self.__post_init__()

    def get(self, code: int) -> PathAttribute | None:
        i = self._codes.find(code) if type(code) is int and 0 <= code < 256 else -1
        return self.items[i] if i >= 0 else None

    def __contains__(self, code: object) -> bool:
        return type(code) is int and 0 <= code < 256 and code in self._codes  # type: ignore[operator]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[PathAttribute]:
        return iter(self.items)

    @property
    def origin(self) -> int | None:
        i = self._codes.find(1)
        attr = self.items[i] if i >= 0 else None
        return attr.value if attr is not None else None  # type: ignore[attr-defined]

    @property
    def as_path(self) -> AsPath:
        i = self._codes.find(2)
        return self.items[i] if i >= 0 else _EMPTY_PATH  # type: ignore[return-value]

    @property
    def next_hop(self) -> IPv4Address | None:
        i = self._codes.find(3)
        attr = self.items[i] if i >= 0 else None
        return attr.address if attr is not None else None  # type: ignore[attr-defined]

    @property
    def med(self) -> int | None:
        i = self._codes.find(4)
        attr = self.items[i] if i >= 0 else None
        return attr.value if attr is not None else None  # type: ignore[attr-defined]

    @property
    def local_pref(self) -> int | None:
        i = self._codes.find(5)
        attr = self.items[i] if i >= 0 else None
        return attr.value if attr is not None else None  # type: ignore[attr-defined]

    @property
    def atomic_aggregate(self) -> bool:
        return 6 in self._codes

    @property
    def aggregator(self) -> Aggregator | None:
        i = self._codes.find(7)
        return self.items[i] if i >= 0 else None  # type: ignore[return-value]

    @property
    def communities(self) -> tuple[int, ...]:
        i = self._codes.find(8)
        attr = self.items[i] if i >= 0 else None
        return attr.values if attr is not None else ()  # type: ignore[attr-defined]

    @property
    def large_communities(self) -> tuple[tuple[int, int, int], ...]:
        i = self._codes.find(32)
        attr = self.items[i] if i >= 0 else None
        return attr.values if attr is not None else ()  # type: ignore[attr-defined]

    @property
    def originator_id(self) -> IPv4Address | None:
        i = self._codes.find(9)
        attr = self.items[i] if i >= 0 else None
        return attr.address if attr is not None else None  # type: ignore[attr-defined]

    @property
    def cluster_list(self) -> tuple[IPv4Address, ...]:
        i = self._codes.find(10)
        attr = self.items[i] if i >= 0 else None
        return attr.ids if attr is not None else ()  # type: ignore[attr-defined]

    def replace(self, *attrs: PathAttribute) -> PathAttributes:
        """A copy with each of ``attrs`` added, or replacing the one with its code."""
        index = self._index()
        for attr in attrs:
            if attr.code in _NLRI_CODES:
                raise ValueError("MP_REACH_NLRI/MP_UNREACH_NLRI belong on the Update, not in PathAttributes")
            index[attr.code] = attr
        return PathAttributes._of_index(index)

    def without(self, *codes: int) -> PathAttributes:
        """A copy without the attributes of the given type codes."""
        own = self._codes
        if frozenset(codes).isdisjoint(own):  # (bytes iterate as ints)
            return self
        return PathAttributes._of_index({c: a for c, a in zip(own, self.items) if c not in codes})

    def encode(self, ctx: CodecContext = DEFAULT_CONTEXT) -> bytes:
        """All attributes, ordered by type code.

        Towards an OLD (2-octet) speaker, AS numbers above 65535 are written as AS_TRANS
        in AS_PATH/AGGREGATOR and the real ones travel in AS4_PATH/AS4_AGGREGATOR
        (RFC 6793 §4.2.2).
        """
        items = self.items
        if not ctx.four_octet_as:
            index = self._index()
            extra: dict[int, PathAttribute] = {}
            as_path = index.get(2)
            if isinstance(as_path, AsPath):
                as4 = as4_path_for(as_path)
                if as4 is not None:
                    extra[17] = as4
            aggregator = index.get(7)
            if isinstance(aggregator, Aggregator) and aggregator.asn > 0xFFFF:
                extra[18] = As4Aggregator(aggregator.asn, aggregator.address)
            if extra:
                merged = {**index, **extra}
                items = tuple(merged[c] for c in sorted(merged))
        return b"".join([attr.encode(ctx) for attr in items])


EMPTY_ATTRIBUTES = PathAttributes()
