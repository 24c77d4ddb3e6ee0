"""Decoding the Path Attributes field of an UPDATE under RFC 4271 §6.3 and RFC 7606.

Split in two so that identical attribute bytes can share one decoded result:

* :func:`frame_attributes` walks the attribute headers (RFC 7606 §4 framing) and finds
  MP_REACH_NLRI / MP_UNREACH_NLRI, which carry NLRI and so are decoded per UPDATE;
* :func:`decode_shared` decodes every other attribute into a :class:`SharedAttributes`,
  the part a cache may hand out again for the same bytes.
"""

from __future__ import annotations

import dataclasses
from ipaddress import IPv4Address, IPv6Address
from typing import NamedTuple

from proto._attr_base import AS_TRANS, EXTENDED_LENGTH, OPTIONAL, PARTIAL, TRANSITIVE, CodecContext
from proto.attributes import (
    ATTRIBUTES,
    Aggregator,
    As4Aggregator,
    As4Path,
    AsPath,
    ClusterList,
    LocalPref,
    MpReachNlri,
    MpUnreachNlri,
    NextHop,
    OriginatorId,
    PathAttribute,
    PathAttributes,
    UnknownAttribute,
    merge_as4_path,
    next_hop_problem,
)
from proto.errors import DecodeError, ErrorAction, ErrorCode, UpdateError, UpdateSubcode

TAW = ErrorAction.TREAT_AS_WITHDRAW
DISCARD = ErrorAction.ATTRIBUTE_DISCARD
_MP_CODES = (MpReachNlri.code, MpUnreachNlri.code)
_NEXT_HOP_CODE = NextHop.code  # bound once: tested for every attribute decoded
_AS4_CODES = (As4Path.code, As4Aggregator.code)
# Attributes an external neighbour must not send (RFC 4271 §5.1.5, RFC 4456 §8).
_INTERNAL_ONLY = (LocalPref.code, OriginatorId.code, ClusterList.code)
_SEEN_BIT = {1: 1, 2: 2, 3: 4}  # ORIGIN, AS_PATH, NEXT_HOP: the well-known mandatory ones

# (flags, type code, value start, value end, attribute start) in the UPDATE body.
Frame = tuple[int, int, int, int, int]


class SharedAttributes(NamedTuple):
    """The decoded non-MP attributes of one attribute block (cacheable)."""

    attributes: PathAttributes
    #: Outcomes that apply to every UPDATE carrying these bytes.
    errors: tuple[UpdateError, ...]
    #: Outcomes about NEXT_HOP: they only matter when the NLRI field is non-empty, since
    #: with MP_REACH_NLRI alone NEXT_HOP is ignored (RFC 4760 §3).
    next_hop_errors: tuple[UpdateError, ...]
    #: Bits for ORIGIN (1), AS_PATH (2), NEXT_HOP (4) present on the wire, malformed or not.
    seen: int


class Interned:
    """Decoded attributes by their bytes as received, for one session and codec context,
    each with its hash (a set's hash is the sum of its attributes', see PathAttributes).

    Two generations of at most ``limit`` entries and ``max_bytes`` octets as received each
    (a peer sending thousands of distinct 4 KB LARGE_COMMUNITY or CLUSTER_LIST values must not
    make the session hold a gigabyte of decoded copies): a full one becomes the old one, and
    a hit there moves back, so attributes many routes share (AS_PATH, ORIGIN, NEXT_HOP)
    stay while ones seen once (a MED per route) pass through.
    """

    __slots__ = ("new", "old", "limit", "max_bytes", "size")

    def __init__(self, limit: int, max_bytes: int = 256 * 1024) -> None:
        self.new: dict[bytes, tuple[PathAttribute, int]] = {}
        self.old: dict[bytes, tuple[PathAttribute, int]] = {}
        self.limit = limit
        self.max_bytes = max_bytes
        self.size = 0  # octets of the keys of ``new``

    def get(self, raw: bytes) -> tuple[PathAttribute, int] | None:
        hit = self.new.get(raw)
        if hit is None:
            hit = self.old.get(raw)
            if hit is not None:
                self.put(raw, hit)
        return hit

    def put(self, raw: bytes, hit: tuple[PathAttribute, int]) -> None:
        if len(self.new) >= self.limit or self.size + len(raw) > self.max_bytes:
            self.old = self.new
            self.new = {}
            self.size = 0
        self.new[raw] = hit
        self.size += len(raw)


class InternedByCode:
    """One :class:`Interned` per attribute type code, for one session and codec context.

    Apart so that attributes seen once per route (a MED, COMMUNITIES of its own) cannot
    push out the ones many routes share (a few thousand AS_PATHs, one NEXT_HOP): with
    one prefix and one attribute set per UPDATE, a shared table would turn over every few
    thousand UPDATEs and decode the same AS_PATH again and again, one copy per route.
    """

    __slots__ = ("tables", "limit")

    def __init__(self, limit: int) -> None:
        self.tables: dict[int, Interned] = {}
        self.limit = limit

    def table(self, code: int) -> Interned:
        t = self.tables.get(code)
        if t is None:
            t = self.tables[code] = Interned(self.limit)
        return t


def frame_attributes(body: bytes, start: int, end: int) -> tuple[list[Frame], UpdateError | None, bool]:
    """Walk the attribute headers.  Returns the frames, the framing error if any
    (RFC 7606 §4: treat-as-withdraw, the NLRI being located by the Total Path Attribute
    Length), and whether an MP_REACH_NLRI/MP_UNREACH_NLRI attribute is among them.

    Raises DecodeError (session reset, Malformed Attribute List) instead of returning a
    framing error when the octets left unframed could hold an MP_REACH_NLRI or
    MP_UNREACH_NLRI not found before them: see :func:`_mp_may_follow`."""
    frames: list[Frame] = []
    has_mp = False
    pos = start
    while pos < end:
        left = end - pos
        if left < 3 or (body[pos] & EXTENDED_LENGTH and left < 4):
            return frames, _framing(f"{left} octet(s) left, too few for an attribute header"), has_mp
        flags = body[pos]
        code = body[pos + 1]
        if flags & EXTENDED_LENGTH:
            vstart = pos + 4
            vend = vstart + ((body[pos + 2] << 8) | body[pos + 3])
        else:
            vstart = pos + 3
            vend = vstart + body[pos + 2]
        if vend > end:
            overrun = f"attribute {code} overruns the path attributes by {vend - end} octets"
            if code in _MP_CODES:
                # RFC 7606 §3 j: treat-as-withdraw needs the MP NLRI parsed; it cannot be.
                raise DecodeError(ErrorCode.UPDATE_MESSAGE, UpdateSubcode.MALFORMED_ATTRIBUTE_LIST, b"", overrun)
            if _mp_may_follow(frames, has_mp, end - vstart):
                raise DecodeError(
                    ErrorCode.UPDATE_MESSAGE,
                    UpdateSubcode.MALFORMED_ATTRIBUTE_LIST,
                    b"",
                    f"path attribute framing: {overrun}, and an MP_REACH_NLRI/MP_UNREACH_NLRI may be hidden after it",
                )
            return frames, _framing(overrun), has_mp
        if code in _MP_CODES:
            if has_mp and any(f[1] == code for f in frames):
                # RFC 7606 §3 g: MP_REACH_NLRI / MP_UNREACH_NLRI more than once.
                raise DecodeError(
                    ErrorCode.UPDATE_MESSAGE,
                    UpdateSubcode.MALFORMED_ATTRIBUTE_LIST,
                    b"",
                    f"{'MP_REACH_NLRI' if code == MpReachNlri.code else 'MP_UNREACH_NLRI'} appears more than once",
                )
            has_mp = True
        frames.append((flags, code, vstart, vend, pos))
        pos = vend
    return frames, None, has_mp


# The shortest MP_UNREACH_NLRI (header, AFI, SAFI: no withdrawn routes, an End-of-RIB) and
# MP_REACH_NLRI (header, AFI, SAFI, next hop length 0, reserved octet; RFC 4760 §3, §4).
_MP_SHORTEST = ((MpUnreachNlri.code, 3 + 3), (MpReachNlri.code, 3 + 5))


def _mp_may_follow(frames: list[Frame], has_mp: bool, room: int) -> bool:
    """Whether ``room`` octets left unframed, after the header of an attribute whose length
    overruns the path attributes, could hold an MP_REACH_NLRI or MP_UNREACH_NLRI that was
    not framed before it.

    RFC 7606 §4 asks treat-as-withdraw for a framing error "(unless some other, more severe
    error is encountered dictating a stronger approach)", and §3 j is one: treat-as-withdraw
    needs "the entire NLRI field and/or the MP_REACH_NLRI and MP_UNREACH_NLRI attributes" to
    be "successfully parsed"; "If this is not possible ... the 'session reset' approach ...
    MUST be followed".  An MP attribute hidden in the unframed octets can be neither parsed
    nor even seen: treat-as-withdraw would withdraw the NLRI field's routes while that
    attribute's announcements kept their old attributes and its withdrawals were lost,
    silently, on any session (IPv4 unicast itself may ride in MP_REACH_NLRI).  So reset,
    unless those octets are too few for one (a truncated attribute at the very end) or both
    MP attributes were framed already (a third would be a repeat, itself a reset by §3 g):
    then every NLRI of the UPDATE was located and treat-as-withdraw covers it all.
    """
    found = {f[1] for f in frames if f[1] in _MP_CODES} if has_mp else ()
    return any(room >= shortest for code, shortest in _MP_SHORTEST if code not in found)


def _framing(message: str) -> UpdateError:
    return UpdateError(
        TAW, ErrorCode.UPDATE_MESSAGE, UpdateSubcode.MALFORMED_ATTRIBUTE_LIST, b"", f"path attribute framing: {message}"
    )


def _flags_error(cls: type[PathAttribute], flags: int, raw: bytes) -> UpdateError:
    # RFC 7606 §3 c: conflicting Optional/Transitive bits -> treat-as-withdraw, except
    # where the attribute's own rule is attribute-discard (§3 f: ATOMIC_AGGREGATE,
    # AGGREGATOR; RFC 6793 §6: AS4_PATH, AS4_AGGREGATOR).
    action = DISCARD if cls.action is DISCARD else TAW
    return UpdateError(
        action,
        ErrorCode.UPDATE_MESSAGE,
        UpdateSubcode.ATTRIBUTE_FLAGS_ERROR,
        raw,
        f"{cls.name}: flags 0x{flags:02x} conflict with 0x{cls.flags:02x}",
        cls.code,
    )


def decode_shared(
    body: bytes, frames: list[Frame], ctx: CodecContext, interned: InternedByCode | None = None
) -> SharedAttributes:
    """Decode every non-MP attribute of ``frames``; raises DecodeError only for
    session-reset outcomes (an unrecognized well-known attribute, RFC 4271 §6.3).

    ``interned`` (owned by one session, for one ``ctx``) holds attributes by their bytes
    as received (flags, type, length, value), those that decoded without any error
    outcome: blocks that differ in one attribute (their own MED, say) share the others'
    objects instead of decoding them again.
    """
    items: dict[int, PathAttribute] = {}
    errors: list[UpdateError] = []
    nh_errors: list[UpdateError] = []
    seen_codes: set[int] = set()
    seen = 0
    hashes = 0  # the sum of the kept attributes' hashes (PathAttributes' own hash)
    last = -1
    ordered = True  # codes ascending, as RFC 4271 §5 recommends senders order them
    for flags, code, vstart, vend, astart in frames:
        if code in _MP_CODES:
            continue
        if code <= last:
            ordered = False
        last = code
        if code in seen_codes:
            # RFC 7606 §3 g: keep the first occurrence, discard the others.
            errors.append(
                UpdateError(
                    DISCARD,
                    ErrorCode.UPDATE_MESSAGE,
                    UpdateSubcode.MALFORMED_ATTRIBUTE_LIST,
                    body[astart:vend],
                    f"attribute {code} appears more than once; the repeat is discarded",
                    code,
                )
            )
            continue
        seen_codes.add(code)
        seen |= _SEEN_BIT.get(code, 0)
        if interned is not None:
            raw = body[astart:vend]
            table = interned.tables.get(code) or interned.table(code)
            hit = table.new.get(raw) or table.get(raw)
            if hit is not None:
                items[code] = hit[0]
                hashes += hit[1]
                continue
        value = body[vstart:vend]
        cls = ATTRIBUTES.get(code)
        if cls is None:
            if not flags & OPTIONAL:
                # RFC 4271 §6.3: an unrecognized well-known attribute resets the session.
                raise DecodeError(
                    ErrorCode.UPDATE_MESSAGE,
                    UpdateSubcode.UNRECOGNIZED_WELL_KNOWN_ATTRIBUTE,
                    body[astart:vend],
                    f"unrecognized well-known attribute {code}",
                )
            if flags & TRANSITIVE:
                # RFC 4271 §5: passed on with Partial set; non-transitive ones are dropped.
                attr = items[code] = UnknownAttribute(code, flags & 0xE0, value)
                hashes += hash(attr)
            continue
        if code in _AS4_CODES and ctx.four_octet_as:
            # RFC 6793 §3/§4.1: AS4_PATH/AS4_AGGREGATOR between NEW speakers are discarded.
            errors.append(
                UpdateError(
                    DISCARD,
                    ErrorCode.UPDATE_MESSAGE,
                    UpdateSubcode.OPTIONAL_ATTRIBUTE_ERROR,
                    body[astart:vend],
                    f"{cls.name} received on a 4-octet AS session is discarded",
                    code,
                )
            )
            continue
        if code in _INTERNAL_ONLY and ctx.external:
            # RFC 7606 §7.5, §7.9, §7.10: LOCAL_PREF, ORIGINATOR_ID and CLUSTER_LIST from an
            # external neighbour are attribute-discarded, well-formed or not, whatever their
            # flags (RFC 4271 §5.1.5, RFC 4456 §8: they must not have been sent); only from
            # an internal one does a bad length withdraw the routes.
            length = vend - vstart
            well_formed = length and not length % 4 if code == ClusterList.code else length == 4
            errors.append(
                UpdateError(
                    DISCARD,
                    ErrorCode.UPDATE_MESSAGE,
                    UpdateSubcode.MALFORMED_ATTRIBUTE_LIST if well_formed else UpdateSubcode.ATTRIBUTE_LENGTH_ERROR,
                    body[astart:vend],
                    f"{cls.name} from an external peer is discarded",
                    code,
                )
            )
            continue
        if (flags ^ cls.flags) & (OPTIONAL | TRANSITIVE):
            (nh_errors if code == _NEXT_HOP_CODE else errors).append(_flags_error(cls, flags, body[astart:vend]))
            continue
        try:
            attr = cls.decode_value(value, flags, ctx)
        except DecodeError as exc:
            if exc.action is ErrorAction.SESSION_RESET:
                raise
            (nh_errors if code == _NEXT_HOP_CODE else errors).append(exc.to_update_error(code))
            continue
        if code == AsPath.code and ctx.external and attr.has_confederation():  # type: ignore[attr-defined]
            # RFC 5065 §5: AS_CONFED_* from a neighbour outside our (non-existent)
            # confederation is a malformed AS_PATH, which RFC 7606 §7.2 treats as withdraw.
            errors.append(
                UpdateError(
                    TAW,
                    ErrorCode.UPDATE_MESSAGE,
                    UpdateSubcode.MALFORMED_AS_PATH,
                    b"",
                    "AS_PATH: confederation segment from an external peer (RFC 5065 §5)",
                    code,
                )
            )
            continue
        problem = None
        if code == _NEXT_HOP_CODE:
            problem = next_hop_problem(attr.address)  # type: ignore[attr-defined]
            if problem is not None:
                nh_errors.append(
                    UpdateError(
                        TAW,
                        ErrorCode.UPDATE_MESSAGE,
                        UpdateSubcode.INVALID_NEXT_HOP_ATTRIBUTE,
                        body[astart:vend],
                        f"NEXT_HOP: {problem}",
                        code,
                    )
                )
        if flags & PARTIAL and cls.flags & OPTIONAL and cls.flags & TRANSITIVE:
            if not attr.partial:
                attr = dataclasses.replace(attr, partial=True)
        items[code] = attr
        attr_hash = hash(attr)
        hashes += attr_hash
        if interned is not None and problem is None:
            # Every outcome above is a function of these bytes and ctx: no error, so the
            # same bytes decode to an equal object.
            table.put(raw, (attr, attr_hash))
    if not ctx.four_octet_as and _merge_as4(items):
        attributes = PathAttributes._of_index(items)
    else:
        attributes = PathAttributes._of_index(items, hashes, ordered)
    return SharedAttributes(attributes, tuple(errors), tuple(nh_errors), seen)


def decode_plain(body: bytes, start: int, end: int, ctx: CodecContext, interned: InternedByCode) -> SharedAttributes | None:
    """The common attribute block in one pass: framed without error, type codes strictly
    ascending (so no repeats), no MP_REACH_NLRI/MP_UNREACH_NLRI, and every attribute either
    held in ``interned`` or decoding without any RFC 7606 outcome.  Anything else returns
    None, and the caller takes the general path (:func:`frame_attributes` then
    :func:`decode_shared`), which gives the same result for such a block: this is a shortcut
    for the UPDATEs a sane speaker sends, not a second set of rules.
    """
    if not ctx.four_octet_as:
        return None  # AS4_PATH / AS4_AGGREGATOR to merge: the general path
    items: dict[int, PathAttribute] = {}
    hashes = 0
    last = -1
    pos = start
    tables = interned.tables
    while pos + 2 < end:  # an attribute header has three octets at least
        code = body[pos + 1]
        if body[pos] & EXTENDED_LENGTH:
            if pos + 3 >= end:
                return None
            vend = pos + 4 + ((body[pos + 2] << 8) | body[pos + 3])
        else:
            vend = pos + 3 + body[pos + 2]
        if vend > end or code <= last:
            return None
        apos = pos
        raw = body[pos:vend]
        pos = vend
        last = code
        table = tables.get(code) or interned.table(code)
        hit = table.new.get(raw) or table.get(raw)
        if hit is not None:
            items[code] = hit[0]
            hashes += hit[1]
            continue
        flags = body[apos]
        vstart = apos + (4 if flags & EXTENDED_LENGTH else 3)
        cls = ATTRIBUTES.get(code)
        if (
            cls is None
            or code in _MP_CODES
            or (flags ^ cls.flags) & (OPTIONAL | TRANSITIVE)
            or flags & PARTIAL
            or code in _AS4_CODES
            or (code in _INTERNAL_ONLY and ctx.external)
        ):
            return None
        try:
            attr = cls.decode_value(body[vstart:vend], flags, ctx)
        except DecodeError:
            return None
        if code == _NEXT_HOP_CODE:
            if next_hop_problem(attr.address) is not None:  # type: ignore[attr-defined]
                return None
        elif code == AsPath.code and ctx.external and attr.has_confederation():  # type: ignore[attr-defined]
            return None
        items[code] = attr
        attr_hash = hash(attr)
        hashes += attr_hash
        table.put(raw, (attr, attr_hash))
    if pos != end:
        return None  # octets left that cannot hold an attribute header
    if 3 in items and 2 in items and 1 in items:
        seen = 7
    else:
        seen = (1 in items) | (2 in items) << 1 | (3 in items) << 2
    return SharedAttributes(PathAttributes._of_index(items, hashes, True), (), (), seen)


def _merge_as4(items: dict[int, PathAttribute]) -> bool:
    """Rebuild AS_PATH/AGGREGATOR from AS4_PATH/AS4_AGGREGATOR (RFC 6793 §4.2.3);
    whether ``items`` changed."""
    as4_path = items.pop(As4Path.code, None)
    as4_aggregator = items.pop(As4Aggregator.code, None)
    if as4_path is None and as4_aggregator is None:
        return False
    aggregator = items.get(Aggregator.code)
    if isinstance(aggregator, Aggregator) and isinstance(as4_aggregator, As4Aggregator):
        if aggregator.asn != AS_TRANS:
            # Both AGGREGATOR and AS4_AGGREGATOR, and AGGREGATOR is not AS_TRANS: an OLD
            # speaker aggregated the route after the AS4 attributes were made, so both AS4
            # attributes are out of date and ignored.
            return True
        items[Aggregator.code] = Aggregator(as4_aggregator.asn, as4_aggregator.address, partial=aggregator.partial)
    as_path = items.get(AsPath.code)
    if isinstance(as4_path, As4Path) and isinstance(as_path, AsPath):
        items[AsPath.code] = merge_as4_path(as_path, as4_path)
    return True


def decode_mp(
    body: bytes, frame: Frame, ctx: CodecContext, errors: list[UpdateError]
) -> MpReachNlri | MpUnreachNlri | None:
    """Decode MP_REACH_NLRI/MP_UNREACH_NLRI; malformed ones reset the session (RFC 7606
    §7.11, §5.3), attribute-discard outcomes are appended to ``errors``."""
    flags, code, vstart, vend, astart = frame
    cls = MpReachNlri if code == MpReachNlri.code else MpUnreachNlri
    if (flags ^ cls.flags) & (OPTIONAL | TRANSITIVE):
        # RFC 7606 §3 c: treat-as-withdraw; the NLRI is still parsed to know what to withdraw.
        errors.append(_flags_error(cls, flags, body[astart:vend]))
    try:
        attr = cls.decode_value(body[vstart:vend], flags, ctx)
    except DecodeError as exc:
        if exc.action is ErrorAction.SESSION_RESET:
            raise
        errors.append(exc.to_update_error(code))
        return None
    if isinstance(attr, MpReachNlri) and attr.nlri:
        # RFC 4271 §6.3 / RFC 7606 §7.3 as for NEXT_HOP: a next hop that is no host address
        # (0.0.0.0, ::, multicast, broadcast) makes the routes treat-as-withdraw; accepted, an
        # IPv4 one would be reflected as a NEXT_HOP the neighbour must withdraw.
        problem = _mp_next_hop_problem(attr.usable_next_hop)
        if problem is not None:
            errors.append(
                UpdateError(
                    TAW,
                    ErrorCode.UPDATE_MESSAGE,
                    UpdateSubcode.INVALID_NEXT_HOP_ATTRIBUTE,
                    body[astart:vend],
                    f"MP_REACH_NLRI next hop: {problem}",
                    code,
                )
            )
    return attr


def _mp_next_hop_problem(address: IPv4Address | IPv6Address) -> str | None:
    if isinstance(address, IPv4Address):
        return next_hop_problem(address)
    if address.is_unspecified:
        return ":: is not a host address"
    if address.is_multicast:
        return f"{address} is a multicast address"
    return None


__all__ = ["Interned", "InternedByCode", "SharedAttributes", "frame_attributes", "decode_shared", "decode_mp"]
