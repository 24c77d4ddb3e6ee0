"""AS_PATH and AS4_PATH (RFC 4271 §4.3, §5.1.2; RFC 6793; RFC 5065 segment types)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

from proto._attr_base import AS_TRANS, OPTIONAL, TRANSITIVE, CodecContext, PathAttribute
from proto.errors import ErrorAction, UpdateSubcode

AS_SET = 1
AS_SEQUENCE = 2
AS_CONFED_SEQUENCE = 3  # RFC 5065 §3
AS_CONFED_SET = 4
_CONFED = (AS_CONFED_SEQUENCE, AS_CONFED_SET)
MAX_SEGMENT_ASNS = 255


@dataclass(frozen=True, slots=True)
class AsPathSegment:
    """One path segment: its type and its AS numbers in order."""

    type: int
    asns: tuple[int, ...]

    def __str__(self) -> str:
        inner = " ".join(map(str, self.asns))
        if self.type == AS_SEQUENCE:
            return inner
        if self.type == AS_SET:
            return "{" + ",".join(map(str, self.asns)) + "}"
        if self.type == AS_CONFED_SEQUENCE:
            return f"({inner})"
        return f"[{inner}]"


_UNPACKERS: dict[tuple[int, str], object] = {}


def _unpacker(count: int, code: str):  # -> struct.Struct.unpack_from
    """``struct.Struct(f"!{count}{code}").unpack_from``, made once per shape (at most 510)."""
    u = _UNPACKERS.get((count, code))
    if u is None:
        u = _UNPACKERS[(count, code)] = struct.Struct(f"!{count}{code}").unpack_from
    return u


def _parse_segments(value: bytes, width: int) -> tuple[AsPathSegment, ...] | str:
    """Segments of an AS_PATH-shaped value, or the reason it is malformed (RFC 7606 §7.2)."""
    segments = []
    pos = 0
    end = len(value)
    code = "H" if width == 2 else "I"
    while pos < end:
        if end - pos < 2:
            return "a single octet left where a segment header should be"
        seg_type = value[pos]
        count = value[pos + 1]
        if seg_type not in (AS_SET, AS_SEQUENCE, AS_CONFED_SEQUENCE, AS_CONFED_SET):
            return f"unrecognized segment type {seg_type}"
        if count == 0:
            return "a segment of length zero"
        nxt = pos + 2 + count * width
        if nxt > end:
            return f"segment of {count} AS numbers overruns the attribute"
        asns = _unpacker(count, code)(value, pos + 2)
        if 0 in asns:
            # RFC 7607 §2: AS 0 in AS_PATH / AS4_PATH makes the attribute malformed.
            return "AS number 0"
        segments.append(AsPathSegment(seg_type, asns))
        pos = nxt
    return tuple(segments)


def _encode_segments(segments: tuple[AsPathSegment, ...], width: int) -> bytes:
    out = bytearray()
    for seg in segments:
        asns = seg.asns
        if width == 2:
            asns = tuple(a if a <= 0xFFFF else AS_TRANS for a in asns)
        chunks = [asns[i : i + MAX_SEGMENT_ASNS] for i in range(0, len(asns), MAX_SEGMENT_ASNS)]
        if len(chunks) > 1 and seg.type != AS_SEQUENCE and seg.type != AS_CONFED_SEQUENCE:
            raise ValueError(f"an AS_SET of {len(asns)} AS numbers cannot be encoded (max 255)")
        for chunk in chunks:
            out.append(seg.type)
            out.append(len(chunk))
            out += struct.pack(f"!{len(chunk)}{'H' if width == 2 else 'I'}", *chunk)
    return bytes(out)


class _PathMethods:
    """Helpers shared by AS_PATH and AS4_PATH."""

    __slots__ = ()
    segments: tuple[AsPathSegment, ...]

    def path_length(self) -> int:
        """Length for route selection (RFC 4271 §9.1.2.2 a): an AS_SET counts 1, and
        confederation segments count 0 (RFC 5065 §5.3)."""
        n = 0
        for seg in self.segments:
            if seg.type == AS_SEQUENCE:
                n += len(seg.asns)
            elif seg.type == AS_SET:
                n += 1
        return n

    def has_confederation(self) -> bool:
        """Whether any segment is AS_CONFED_SEQUENCE or AS_CONFED_SET (RFC 5065 §3)."""
        for seg in self.segments:
            if seg.type >= AS_CONFED_SEQUENCE:  # 3 and 4, the only types above AS_SEQUENCE
                return True
        return False

    def first_asn(self) -> int | None:
        """Leftmost AS of the first AS_SEQUENCE, skipping leading confederation segments;
        None when the path is empty or the first non-confederation segment is an AS_SET."""
        for seg in self.segments:
            if seg.type in _CONFED:
                continue
            if seg.type == AS_SEQUENCE and seg.asns:
                return seg.asns[0]
            return None
        return None

    def contains(self, asn: int) -> bool:
        """Whether ``asn`` appears anywhere in the path (loop detection, RFC 4271 §9.1.2)."""
        for seg in self.segments:  # (a loop, not any(): this runs once per imported set)
            if asn in seg.asns:
                return True
        return False

    def asns(self) -> tuple[int, ...]:
        """Every AS number in the path, left to right."""
        return tuple(a for seg in self.segments for a in seg.asns)

    def __str__(self) -> str:
        return " ".join(str(seg) for seg in self.segments)


@dataclass(frozen=True, slots=True)
class AsPath(_PathMethods, PathAttribute):
    """AS_PATH (type 2, well-known mandatory, RFC 4271 §5.1.2)."""

    code: ClassVar[int] = 2
    flags: ClassVar[int] = TRANSITIVE
    action: ClassVar[ErrorAction] = ErrorAction.TREAT_AS_WITHDRAW  # RFC 7606 §7.2
    name: ClassVar[str] = "AS_PATH"
    segments: tuple[AsPathSegment, ...] = ()

    def prepend(self, asn: int) -> AsPath:
        """A path with ``asn`` added in front, into the leading AS_SEQUENCE when it has room
        (at most 255 AS numbers per segment, RFC 4271 §4.3)."""
        segs = self.segments
        if segs and segs[0].type == AS_SEQUENCE and len(segs[0].asns) < MAX_SEGMENT_ASNS:
            first = AsPathSegment(AS_SEQUENCE, (asn, *segs[0].asns))
            return AsPath((first, *segs[1:]))
        return AsPath((AsPathSegment(AS_SEQUENCE, (asn,)), *segs))

    def has_four_octet_asns(self) -> bool:
        return any(a > 0xFFFF for seg in self.segments for a in seg.asns)

    def encode_value(self, ctx: CodecContext) -> bytes:
        return _encode_segments(self.segments, 4 if ctx.four_octet_as else 2)

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> AsPath:
        segments = _parse_segments(value, 4 if ctx.four_octet_as else 2)
        if isinstance(segments, str):
            # RFC 4271 §6.3 gives Malformed AS_PATH no data.
            raise cls.error(UpdateSubcode.MALFORMED_AS_PATH, value, flags, segments, with_data=False)
        return cls(segments)


@dataclass(frozen=True, slots=True)
class As4Path(_PathMethods, PathAttribute):
    """AS4_PATH (type 17, optional transitive, RFC 6793 §3): always 4-octet AS numbers.

    Malformed AS4_PATH is discarded, never withdrawn (RFC 6793 §6).
    """

    code: ClassVar[int] = 17
    flags: ClassVar[int] = OPTIONAL | TRANSITIVE
    action: ClassVar[ErrorAction] = ErrorAction.ATTRIBUTE_DISCARD
    name: ClassVar[str] = "AS4_PATH"
    segments: tuple[AsPathSegment, ...] = ()

    def encode_value(self, ctx: CodecContext) -> bytes:
        return _encode_segments(self.segments, 4)

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> As4Path:
        if len(value) < 6 or len(value) % 2:
            # RFC 6793 §6: too short to carry one AS number, or not a multiple of two.
            raise cls.error(UpdateSubcode.ATTRIBUTE_LENGTH_ERROR, value, flags, f"length {len(value)}")
        segments = _parse_segments(value, 4)
        if isinstance(segments, str):
            raise cls.error(UpdateSubcode.OPTIONAL_ATTRIBUTE_ERROR, value, flags, segments)
        # Confederation segments are invalid in AS4_PATH: they are dropped and the rest is
        # used (RFC 6793 §6).
        return cls(tuple(s for s in segments if s.type not in _CONFED))


def merge_as4_path(as_path: AsPath, as4_path: As4Path) -> AsPath:
    """Rebuild the 4-octet AS path from AS_PATH and AS4_PATH (RFC 6793 §4.2.3).

    When AS_PATH counts fewer AS numbers than AS4_PATH, AS4_PATH is ignored.  Otherwise
    the leading part of AS_PATH that makes up the difference is put in front of AS4_PATH;
    confederation segments go with it when leading or adjacent to a taken segment.
    """
    need = as_path.path_length() - as4_path.path_length()
    if need < 0:
        return as_path
    taken: list[AsPathSegment] = []
    for seg in as_path.segments:
        if seg.type in _CONFED:
            taken.append(seg)
            continue
        if need <= 0:
            break
        if seg.type == AS_SET:
            taken.append(seg)
            need -= 1
        elif len(seg.asns) <= need:
            taken.append(seg)
            need -= len(seg.asns)
        else:
            taken.append(AsPathSegment(AS_SEQUENCE, seg.asns[:need]))
            need = 0
    rest = list(as4_path.segments)
    if (
        taken
        and rest
        and taken[-1].type == AS_SEQUENCE
        and rest[0].type == AS_SEQUENCE
        and len(taken[-1].asns) + len(rest[0].asns) <= MAX_SEGMENT_ASNS
    ):
        # One sequence split in two by the reconstruction is still one sequence.
        rest[0] = AsPathSegment(AS_SEQUENCE, taken.pop().asns + rest[0].asns)
    return AsPath(tuple(taken + rest))


def as4_path_for(as_path: AsPath) -> As4Path | None:
    """The AS4_PATH to send an OLD speaker with ``as_path`` (RFC 6793 §4.2.2): only when
    some AS number does not fit in 2 octets, and without confederation segments."""
    if not as_path.has_four_octet_asns():
        return None
    segments = tuple(s for s in as_path.segments if s.type not in _CONFED)
    return As4Path(segments) if segments else None
