"""BGP-4 messages (RFC 4271 §4) and sans-IO message framing.

Every message is a frozen dataclass with ``encode(ctx)`` (the complete message, header
included) and ``decode(body, ctx)`` (``body`` = the bytes after the 19-octet header).
:class:`MessageReader` cuts a byte stream into messages and applies the header checks of
RFC 4271 §6.1; :func:`decode_message` decodes one body by type via :data:`MESSAGES`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from typing import ClassVar, Union

from proto._attr_base import AS_TRANS, DEFAULT_CONTEXT, CodecContext
from proto._attrblock import (
    InternedByCode,
    SharedAttributes,
    decode_mp,
    decode_plain,
    decode_shared,
    frame_attributes,
)
from proto.attributes import EMPTY_ATTRIBUTES, MpReachNlri, MpUnreachNlri, PathAttributes
from proto.capabilities import Capability, FourOctetAs, decode_capability
from proto.errors import (
    CeaseSubcode,
    DecodeError,
    ErrorAction,
    ErrorCode,
    HeaderSubcode,
    OpenSubcode,
    RouteRefreshSubcode,
    UpdateError,
    UpdateSubcode,
    error_name,
)
from proto.header import HEADER_LEN, MARKER, MAX_MESSAGE_LEN, MessageType, frame
from proto.nlri import decode_prefixes_at
from proto.packing import encode_updates, encode_withdrawals


__all__ = [
    "MARKER", "HEADER_LEN", "MAX_MESSAGE_LEN", "AS_TRANS", "MessageType", "Message",
    "Open", "Update", "Notification", "Keepalive", "RouteRefresh", "MESSAGES",
    "MessageReader", "decode_message", "frame", "encode_updates", "encode_withdrawals",
    "CodecContext", "DEFAULT_CONTEXT", "ATTRIBUTE_CACHE_SIZE", "trim_cache",
]


# Smallest legal message of each type, header included (RFC 4271 §6.1, RFC 2918 §3).
_MIN_LEN = {1: 29, 2: 23, 3: 21, 4: 19, 5: 23}

def _bad_length(body: bytes, why: str) -> DecodeError:
    # RFC 4271 §6.1: Bad Message Length carries the erroneous Length field.
    length = min(HEADER_LEN + len(body), 0xFFFF)
    return DecodeError(ErrorCode.MESSAGE_HEADER, HeaderSubcode.BAD_MESSAGE_LENGTH, length.to_bytes(2, "big"), why)


def _open_error(subcode: int, message: str, data: bytes = b"") -> DecodeError:
    return DecodeError(ErrorCode.OPEN_MESSAGE, subcode, data, message)


# --------------------------------------------------------------------------- OPEN


@dataclass(frozen=True, slots=True)
class Open:
    """OPEN (RFC 4271 §4.2) with its capabilities (RFC 5492)."""

    type: ClassVar[int] = MessageType.OPEN
    my_as: int
    hold_time: int
    router_id: IPv4Address
    capabilities: tuple[Capability, ...] = ()
    version: int = 4

    @property
    def asn(self) -> int:
        """The speaker's AS: the 4-octet AS capability when present (RFC 6793 §4.1)."""
        cap = self.capability(FourOctetAs)
        return cap.asn if cap is not None else self.my_as  # type: ignore[attr-defined]

    def capability(self, cls: type[Capability]) -> Capability | None:
        for cap in self.capabilities:
            if isinstance(cap, cls):
                return cap
        return None

    def capabilities_of(self, cls: type[Capability]) -> tuple[Capability, ...]:
        return tuple(cap for cap in self.capabilities if isinstance(cap, cls))

    @classmethod
    def build(
        cls, asn: int, hold_time: int, router_id: IPv4Address | str, capabilities: Iterable[Capability] = ()
    ) -> Open:
        """An OPEN for ``asn``: My AS is AS_TRANS when ``asn`` needs 4 octets, and a
        FourOctetAs(asn) capability is always present (RFC 6793 §3, §4.1)."""
        caps = [c for c in capabilities if not isinstance(c, FourOctetAs)]
        caps.append(FourOctetAs(asn))
        return cls(asn if asn <= 0xFFFF else AS_TRANS, hold_time, IPv4Address(router_id), tuple(caps))

    def encode(self, ctx: CodecContext = DEFAULT_CONTEXT) -> bytes:
        joined = b"".join(c.encode() for c in self.capabilities)
        if not joined:
            opt = b"\x00"
        elif 2 + len(joined) <= 255:
            # One Capabilities parameter (RFC 5492 §4).  Splitting them over several would
            # not help: Optional Parameters Length would still exceed 255.
            opt = bytes((2 + len(joined), 2, len(joined))) + joined
        else:
            # RFC 9072 §2: extended format, one Capabilities parameter with a 2-octet length.
            # Also what carries a single capability of 254 or 255 octets of value, whose
            # 256 or 257 octets no parameter with a 1-octet length can hold.
            ext = bytes((2,)) + len(joined).to_bytes(2, "big") + joined
            opt = b"\xff\xff" + len(ext).to_bytes(2, "big") + ext
        body = (
            bytes((self.version,))
            + self.my_as.to_bytes(2, "big")
            + self.hold_time.to_bytes(2, "big")
            + self.router_id.packed
            + opt
        )
        return frame(MessageType.OPEN, body, ctx)

    @classmethod
    def decode(cls, body: bytes, ctx: CodecContext = DEFAULT_CONTEXT) -> Open:
        if not isinstance(body, bytes):
            body = bytes(body)
        if len(body) < 10:
            raise _bad_length(body, f"OPEN body of {len(body)} octets, at least 10 needed")
        version = body[0]
        if version != 4:
            # RFC 4271 §6.2: the data is the version we do support (2 octets).
            raise _open_error(OpenSubcode.UNSUPPORTED_VERSION, f"version {version}, only 4 is supported", b"\x00\x04")
        my_as = (body[1] << 8) | body[2]
        if my_as == 0:
            raise _open_error(OpenSubcode.BAD_PEER_AS, "My Autonomous System is 0 (RFC 7607)")
        hold_time = (body[3] << 8) | body[4]
        if hold_time in (1, 2):
            raise _open_error(OpenSubcode.UNACCEPTABLE_HOLD_TIME, f"hold time {hold_time} (must be 0 or >= 3)")
        if body[5:9] == b"\x00\x00\x00\x00":
            # RFC 6286 §2.2: the BGP Identifier is any non-zero 32-bit value.
            raise _open_error(OpenSubcode.BAD_BGP_IDENTIFIER, "BGP Identifier 0")
        router_id = IPv4Address(body[5:9])
        capabilities = _decode_optional_parameters(body)
        for cap in capabilities:
            if isinstance(cap, FourOctetAs) and cap.asn == 0:
                raise _open_error(OpenSubcode.BAD_PEER_AS, "4-octet AS capability carries AS 0 (RFC 7607)")
        return cls(my_as, hold_time, router_id, capabilities, version)


def _decode_optional_parameters(body: bytes) -> tuple[Capability, ...]:
    """Optional Parameters (RFC 4271 §4.2), extended when RFC 9072 says so."""
    opt_len = body[9]
    pos = 10
    extended = False
    if opt_len == 255 and len(body) > 10 and body[10] == 255:
        # RFC 9072 §2: Non-Ext OP Type 255 announces the Extended Optional Parameters Length.
        if len(body) < 13:
            raise _open_error(OpenSubcode.UNSPECIFIC, "truncated extended optional parameters length")
        opt_len = (body[11] << 8) | body[12]
        pos = 13
        extended = True
    end = pos + opt_len
    if end != len(body):
        raise _open_error(
            OpenSubcode.UNSPECIFIC,
            f"optional parameters length {opt_len} does not match the {len(body) - pos} octets present",
        )
    header = 3 if extended else 2
    caps: list[Capability] = []
    while pos < end:
        if end - pos < header:
            raise _open_error(OpenSubcode.UNSPECIFIC, "truncated optional parameter header")
        ptype = body[pos]
        plen = ((body[pos + 1] << 8) | body[pos + 2]) if extended else body[pos + 1]
        pstart = pos + header
        pend = pstart + plen
        if pend > end:
            raise _open_error(OpenSubcode.UNSPECIFIC, f"optional parameter {ptype} overruns the parameters")
        if ptype != 2:
            # RFC 4271 §6.2 / RFC 5492 §5: only Capabilities (2) is supported.
            raise _open_error(OpenSubcode.UNSUPPORTED_OPTIONAL_PARAMETER, f"optional parameter type {ptype}")
        p = pstart
        while p < pend:
            if pend - p < 2:
                raise _open_error(OpenSubcode.UNSPECIFIC, "truncated capability header")
            code = body[p]
            clen = body[p + 1]
            if p + 2 + clen > pend:
                raise _open_error(OpenSubcode.UNSPECIFIC, f"capability {code} overruns its optional parameter")
            caps.append(decode_capability(code, body[p + 2 : p + 2 + clen]))
            p += 2 + clen
        pos = pend
    return tuple(caps)


# --------------------------------------------------------------------------- UPDATE

#: Bound on the decoded-attribute cache passed to Update.decode (oldest evicted first).
ATTRIBUTE_CACHE_SIZE = 8192
_CTX_KEY = object()  # the cache remembers the context its entries were decoded with
_ATTR_KEY = object()  # ... and holds single attributes by their bytes (decode_shared's ``interned``)
INTERNED_ATTRIBUTES = 8192  # per generation and type code of those single attributes (see InternedByCode)
_TAW = ErrorAction.TREAT_AS_WITHDRAW
_MISSING_NAMES = ((1, 1, "ORIGIN"), (2, 2, "AS_PATH"), (4, 3, "NEXT_HOP"))


@dataclass(frozen=True, slots=True)
class Update:
    """UPDATE (RFC 4271 §4.3).  ``withdrawn``/``nlri`` are IPv4 unicast wire prefixes.

    ``errors`` records RFC 7606 outcomes that did not reset the session.  When any is
    treat-as-withdraw, the receiver treats ``nlri`` and ``mp_reach.nlri`` as withdrawn.

    ``other_attributes`` (set by :meth:`decode`) says the UPDATE as received carried a path
    attribute besides MP_UNREACH_NLRI, kept or not: decoding drops an unrecognized optional
    non-transitive one (RFC 4271 §5) and may discard a malformed one (RFC 7606), and such an
    UPDATE is still no End-of-RIB.  A fact about the wire, not the content: not compared.
    """

    type: ClassVar[int] = MessageType.UPDATE
    withdrawn: tuple[bytes, ...] = ()
    attributes: PathAttributes = EMPTY_ATTRIBUTES
    nlri: tuple[bytes, ...] = ()
    mp_reach: MpReachNlri | None = None
    mp_unreach: MpUnreachNlri | None = None
    errors: tuple[UpdateError, ...] = ()
    other_attributes: bool = field(default=False, compare=False)

    @property
    def treat_as_withdraw(self) -> bool:
        return bool(self.errors) and any(e.action is _TAW for e in self.errors)

    @property
    def end_of_rib(self) -> tuple[int, int] | None:
        """The family this End-of-RIB marker is for (RFC 4724 §2), else None: an UPDATE with
        no withdrawn routes, NLRI or path attributes (IPv4 unicast), or one whose only path
        attribute is an MP_UNREACH_NLRI without withdrawn routes (any family), as received."""
        if (
            self.withdrawn
            or self.nlri
            or self.mp_reach is not None
            or self.other_attributes
            or len(self.attributes)
            or self.errors
        ):
            return None
        if self.mp_unreach is None:
            return (1, 1)
        if not self.mp_unreach.withdrawn:
            return (self.mp_unreach.afi, self.mp_unreach.safi)
        return None

    @staticmethod
    def end_of_rib_marker(afi: int, safi: int) -> Update:
        if (afi, safi) == (1, 1):
            return Update()
        return Update(mp_unreach=MpUnreachNlri(afi, safi, ()))

    def encode(self, ctx: CodecContext = DEFAULT_CONTEXT) -> bytes:
        withdrawn = b"".join(self.withdrawn)
        # RFC 7606 §5.1: MP_REACH_NLRI / MP_UNREACH_NLRI go first.
        parts = []
        if self.mp_reach is not None:
            parts.append(self.mp_reach.encode(ctx))
        if self.mp_unreach is not None:
            parts.append(self.mp_unreach.encode(ctx))
        parts.append(self.attributes.encode(ctx))
        attrs = b"".join(parts)
        body = b"".join(
            (len(withdrawn).to_bytes(2, "big"), withdrawn, len(attrs).to_bytes(2, "big"), attrs, *self.nlri)
        )
        return frame(MessageType.UPDATE, body, ctx)

    @classmethod
    def _decode_plain(cls, body: bytes, aend: int, ctx: CodecContext, cache: dict) -> Update | None:
        """decode()'s shortcut for an UPDATE of NLRI and attributes only, whose attributes
        are cached or decode by :func:`decode_plain` with every mandatory one present and no
        error outcome; None sends the caller down the general path."""
        held = cache.get(_CTX_KEY)
        interned = cache.get(_ATTR_KEY)
        if interned is None or (held is not ctx and held != ctx):
            return None
        key = body[4:aend]
        shared = cache.get(key)
        if shared is None:
            shared = decode_plain(body, 4, aend, ctx, interned)
            if shared is None:
                return None
            if len(cache) > ATTRIBUTE_CACHE_SIZE:
                _evict(cache)
            cache[key] = shared
        if shared.seen != 7 or shared.errors or shared.next_hop_errors:
            return None
        # RFC 7606 §3 i, §5.3: the NLRI field must be syntactically correct.
        return cls((), shared.attributes, tuple(decode_prefixes_at(body, aend, len(body), 1)), None, None, (), True)

    @classmethod
    def decode(cls, body: bytes, ctx: CodecContext = DEFAULT_CONTEXT, cache: dict | None = None) -> Update:
        """Decode an UPDATE body applying RFC 4271 §6.3 and RFC 7606.

        Raises DecodeError only for session-reset outcomes.  With ``cache`` (a dict owned
        by one session), identical attribute bytes yield the same PathAttributes object.
        """
        if not isinstance(body, bytes):
            body = bytes(body)
        n = len(body)
        if cache is not None and n > 4 and not body[0] and not body[1]:
            # The UPDATE nearly every speaker sends: no withdrawn routes, attributes, NLRI.
            aend = 4 + ((body[2] << 8) | body[3])
            if 4 < aend < n:
                fast = cls._decode_plain(body, aend, ctx, cache)
                if fast is not None:
                    return fast
        if n < 4:
            raise _malformed_list(f"UPDATE body of {n} octets cannot hold its two length fields")
        wlen = (body[0] << 8) | body[1]
        if 2 + wlen + 2 > n:
            # RFC 4271 §6.3, RFC 7606 §3 b: Withdrawn Routes Length too large.
            raise _malformed_list(f"Withdrawn Routes Length {wlen} overruns the message")
        astart = 4 + wlen
        alen = (body[astart - 2] << 8) | body[astart - 1]
        aend = astart + alen
        if aend > n:
            raise _malformed_list(f"Total Path Attribute Length {alen} overruns the message")
        # RFC 7606 §3 i, §5.3: both prefix fields must be syntactically correct.
        withdrawn = tuple(decode_prefixes_at(body, 2, 2 + wlen, 1)) if wlen else ()
        nlri = tuple(decode_prefixes_at(body, aend, n, 1)) if aend < n else ()
        if not alen:
            # No attributes at all: fine for withdrawals and End-of-RIB; NLRI without
            # them is missing all three mandatory attributes (RFC 7606 §3 d).
            return cls(withdrawn, EMPTY_ATTRIBUTES, nlri, None, None, tuple(_missing(7)) if nlri else ())

        shared: SharedAttributes | None = None
        if cache is not None:
            held = cache.get(_CTX_KEY)
            if held is not ctx and held != ctx:
                cache.clear()
                cache[_CTX_KEY] = ctx
            shared = cache.get(body[astart:aend])
        mp_reach = mp_unreach = None
        errors: list[UpdateError] = []
        other_attrs = True
        framing_failed = False
        if shared is None and cache is not None:
            interned = cache.get(_ATTR_KEY)
            if interned is None:
                interned = cache[_ATTR_KEY] = InternedByCode(INTERNED_ATTRIBUTES)
            shared = decode_plain(body, astart, aend, ctx, interned)
            if shared is not None:
                if len(cache) > ATTRIBUTE_CACHE_SIZE:  # type: ignore[arg-type]
                    _evict(cache)  # type: ignore[arg-type]
                cache[body[astart:aend]] = shared  # type: ignore[index]
        if shared is None:
            frames, framing_error, has_mp = frame_attributes(body, astart, aend)
            key = None
            if cache is not None and framing_error is None:
                if has_mp:
                    key = b"".join([body[f[4] : f[3]] for f in frames if f[1] not in (14, 15)])
                    shared = cache.get(key)
                else:
                    key = body[astart:aend]
            if shared is None:
                interned = None
                if cache is not None:
                    interned = cache.get(_ATTR_KEY)
                    if interned is None:
                        interned = cache[_ATTR_KEY] = InternedByCode(INTERNED_ATTRIBUTES)
                shared = decode_shared(body, frames, ctx, interned)
                if key is not None:
                    if len(cache) > ATTRIBUTE_CACHE_SIZE:  # type: ignore[arg-type]
                        _evict(cache)  # type: ignore[arg-type]
                    cache[key] = shared  # type: ignore[index]
            if has_mp:
                for f in frames:
                    if f[1] == 14:
                        mp_reach = decode_mp(body, f, ctx, errors)
                    elif f[1] == 15:
                        mp_unreach = decode_mp(body, f, ctx, errors)
                other_attrs = framing_error is not None or any(f[1] != 15 for f in frames)
            if framing_error is not None:
                errors.append(framing_error)
                framing_failed = True
        errors[:0] = shared.errors
        if nlri and shared.next_hop_errors:
            errors.extend(shared.next_hop_errors)
        has_reach = bool(nlri) or (mp_reach is not None and bool(mp_reach.nlri))
        if has_reach:
            # RFC 7606 §3 d: well-known mandatory attributes matter only with NLRI;
            # NEXT_HOP only for the NLRI field (RFC 4760 §3).
            required = 7 if nlri else 3
            if shared.seen & required != required:
                errors.extend(_missing(required & ~shared.seen))
        elif other_attrs and framing_failed and any(e.action is _TAW for e in errors):
            # RFC 7606 §5.2: path attributes but nothing reachable, and the attributes could
            # not even be framed: the NLRI may not have been located correctly, so reset.
            # When framing succeeded, every NLRI field was parsed in full (RFC 7606 §5.3
            # checks them all), so there is nothing to doubt: treat-as-withdraw withdraws
            # nothing and the session stays up.  (FRR settled on the same after
            # CVE-2023-47235: an End-of-RIB-shaped UPDATE with a malformed attribute must
            # not cost the session.)
            first = next(e for e in errors if e.action is _TAW)
            raise DecodeError(
                first.code, first.subcode, first.data, f"{first.message}; and the UPDATE has no reachable NLRI"
            )
        return cls(withdrawn, shared.attributes, nlri, mp_reach, mp_unreach, tuple(errors), other_attrs)


def _malformed_list(message: str) -> DecodeError:
    return DecodeError(ErrorCode.UPDATE_MESSAGE, UpdateSubcode.MALFORMED_ATTRIBUTE_LIST, b"", message)


def _missing(bits: int) -> list[UpdateError]:
    # RFC 4271 §6.3: the data is the type code of the missing attribute.
    return [
        UpdateError(
            _TAW,
            ErrorCode.UPDATE_MESSAGE,
            UpdateSubcode.MISSING_WELL_KNOWN_ATTRIBUTE,
            bytes((code,)),
            f"missing well-known attribute {name}",
            code,
        )
        for bit, code, name in _MISSING_NAMES
        if bits & bit
    ]


def trim_cache(cache: dict) -> None:
    """Forget the attribute sets of an Update.decode cache, keeping its single attributes
    (bounded on their own): a session's bound on the sets it remembers."""
    interned = cache.get(_ATTR_KEY)
    ctx = cache.get(_CTX_KEY)
    cache.clear()
    if interned is not None and ctx is not None:
        cache[_CTX_KEY] = ctx
        cache[_ATTR_KEY] = interned


def _evict(cache: dict) -> None:
    # Oldest first (dicts keep insertion order); a quarter at a time keeps this rare.
    drop = [k for _, k in zip(range(ATTRIBUTE_CACHE_SIZE // 4), cache) if k is not _CTX_KEY and k is not _ATTR_KEY]
    for k in drop:
        del cache[k]


# --------------------------------------------------------------------------- others


@dataclass(frozen=True, slots=True)
class Notification:
    """NOTIFICATION (RFC 4271 §4.5)."""

    type: ClassVar[int] = MessageType.NOTIFICATION
    code: int
    subcode: int
    data: bytes = b""

    def __str__(self) -> str:
        text = error_name(self.code, self.subcode)
        message = self.shutdown_message
        if message is not None:
            return f"{text}: {message!r}"
        if self.data:
            text += f" (data {self.data[:32].hex()}{'...' if len(self.data) > 32 else ''})"
        return text

    @classmethod
    def cease(cls, subcode: int, message: str = "") -> Notification:
        """A Cease; for Administrative Shutdown/Reset with the shutdown communication of
        RFC 9003 §2 (length octet + UTF-8, at most 255 octets, cut at a character)."""
        data = b""
        if message and subcode in (CeaseSubcode.ADMINISTRATIVE_SHUTDOWN, CeaseSubcode.ADMINISTRATIVE_RESET):
            raw = message.encode("utf-8")[:255].decode("utf-8", "ignore").encode("utf-8")
            data = bytes((len(raw),)) + raw
        return cls(ErrorCode.CEASE, subcode, data)

    @property
    def shutdown_message(self) -> str | None:
        """The shutdown communication (RFC 8203/9003), decoded leniently, or None."""
        if self.code != ErrorCode.CEASE or self.subcode not in (2, 4) or not self.data:
            return None
        return self.data[1 : 1 + self.data[0]].decode("utf-8", "replace")

    def encode(self, ctx: CodecContext = DEFAULT_CONTEXT) -> bytes:
        # RFC 4271 §4.5: the data is of variable length, but the message must fit the maximum
        # (§4.1; RFC 8654 once negotiated).  Data carrying what the peer sent (a whole
        # ROUTE-REFRESH, RFC 7313 §5; an attribute) is cut to fit, so that no peer can make
        # a NOTIFICATION of ours impossible to send.
        room = ctx.max_message_len - HEADER_LEN - 2
        return frame(MessageType.NOTIFICATION, bytes((self.code, self.subcode)) + self.data[:room], ctx)

    @classmethod
    def decode(cls, body: bytes, ctx: CodecContext = DEFAULT_CONTEXT) -> Notification:
        if len(body) < 2:
            raise _bad_length(body, f"NOTIFICATION body of {len(body)} octets, at least 2 needed")
        return cls(body[0], body[1], bytes(body[2:]))


@dataclass(frozen=True, slots=True)
class Keepalive:
    """KEEPALIVE (RFC 4271 §4.4): the header alone."""

    type: ClassVar[int] = MessageType.KEEPALIVE

    def encode(self, ctx: CodecContext = DEFAULT_CONTEXT) -> bytes:
        return frame(MessageType.KEEPALIVE, b"", ctx)

    @classmethod
    def decode(cls, body: bytes, ctx: CodecContext = DEFAULT_CONTEXT) -> Keepalive:
        if body:
            raise _bad_length(body, f"KEEPALIVE with a {len(body)}-octet body")
        return cls()


@dataclass(frozen=True, slots=True)
class RouteRefresh:
    """ROUTE-REFRESH (RFC 2918 §3; subtype: RFC 7313 §3, 0 normal, 1 BoRR, 2 EoRR)."""

    type: ClassVar[int] = MessageType.ROUTE_REFRESH
    afi: int
    safi: int
    subtype: int = 0

    def encode(self, ctx: CodecContext = DEFAULT_CONTEXT) -> bytes:
        body = self.afi.to_bytes(2, "big") + bytes((self.subtype, self.safi))
        return frame(MessageType.ROUTE_REFRESH, body, ctx)

    @classmethod
    def decode(cls, body: bytes, ctx: CodecContext = DEFAULT_CONTEXT) -> RouteRefresh:
        if len(body) != 4:
            # RFC 7313 §5: ROUTE-REFRESH Message Error / Invalid Message Length, the data the
            # complete message.  §5 names it for subtypes 1 and 2; RFC 2918 and RFC 4271 §6.1
            # define no length error for a ROUTE-REFRESH of subtype 0 (ORF, RFC 5291, which
            # lengthens it, is not advertised), so the one error defined for it answers every
            # subtype, as BIRD's bgp_rx_route_refresh does.  A shorter one never gets here:
            # MessageReader answers a length below 23 with Bad Message Length (1/2).
            length = min(HEADER_LEN + len(body), 0xFFFF)
            raise DecodeError(
                ErrorCode.ROUTE_REFRESH,
                RouteRefreshSubcode.INVALID_MESSAGE_LENGTH,
                MARKER + length.to_bytes(2, "big") + bytes((MessageType.ROUTE_REFRESH,)) + bytes(body),
                f"ROUTE-REFRESH body of {len(body)} octets, expected 4",
            )
        return cls((body[0] << 8) | body[1], body[3], body[2])


Message = Union[Open, Update, Notification, Keepalive, RouteRefresh]

MESSAGES: dict[int, type] = {
    1: Open,
    2: Update,
    3: Notification,
    4: Keepalive,
    5: RouteRefresh,
}


def decode_message(
    msg_type: int, body: bytes, ctx: CodecContext = DEFAULT_CONTEXT, cache: dict | None = None
) -> Message:
    """Decode one message body of the given type (as returned by MessageReader)."""
    if not isinstance(body, bytes):
        body = bytes(body)
    if msg_type == 2:
        return Update.decode(body, ctx, cache)
    cls = MESSAGES.get(msg_type)
    if cls is None:
        raise DecodeError(ErrorCode.MESSAGE_HEADER, HeaderSubcode.BAD_MESSAGE_TYPE, bytes((msg_type & 0xFF,)))
    return cls.decode(body, ctx)  # type: ignore[no-any-return]


class MessageReader:
    """Sans-IO framing: ``feed`` bytes as they arrive, take messages with ``next_message``.

    Header errors (RFC 4271 §6.1) raise DecodeError; the stream is then unusable and the
    session closes.  Consumed bytes are dropped lazily so that a 64 KB read holding many
    messages costs one copy per message, not one per byte left.
    """

    def __init__(self, max_message_len: int = MAX_MESSAGE_LEN) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._max = max_message_len

    @property
    def buffered(self) -> int:
        """Octets received and not yet returned as messages."""
        return len(self._buf) - self._pos

    def feed(self, data: bytes) -> None:
        if self._pos and self._pos * 2 >= len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next_message(self) -> tuple[int, bytes] | None:
        buf = self._buf
        pos = self._pos
        if len(buf) - pos < HEADER_LEN:
            return None
        if not buf.startswith(MARKER, pos):
            raise DecodeError(
                ErrorCode.MESSAGE_HEADER, HeaderSubcode.CONNECTION_NOT_SYNCHRONIZED, b"", "marker is not all ones"
            )
        length = (buf[pos + 16] << 8) | buf[pos + 17]
        msg_type = buf[pos + 18]
        if msg_type == 2 and 23 <= length <= self._max:
            pass  # an UPDATE of a sane length: the checks below would all pass
        elif length < HEADER_LEN or length > self._max:
            raise DecodeError(
                ErrorCode.MESSAGE_HEADER,
                HeaderSubcode.BAD_MESSAGE_LENGTH,
                bytes(buf[pos + 16 : pos + 18]),
                f"length {length} outside {HEADER_LEN}..{self._max}",
            )
        else:
            minimum = _MIN_LEN.get(msg_type)
            if minimum is None:
                raise DecodeError(
                    ErrorCode.MESSAGE_HEADER,
                    HeaderSubcode.BAD_MESSAGE_TYPE,
                    bytes((msg_type,)),
                    f"message type {msg_type}",
                )
            if length < minimum or (msg_type == MessageType.KEEPALIVE and length != HEADER_LEN):
                raise DecodeError(
                    ErrorCode.MESSAGE_HEADER,
                    HeaderSubcode.BAD_MESSAGE_LENGTH,
                    bytes(buf[pos + 16 : pos + 18]),
                    f"length {length} is wrong for a {MessageType(msg_type).name} message",
                )
        end = pos + length
        if end > len(buf):
            return None
        body = bytes(buf[pos + HEADER_LEN : end])
        self._pos = end
        return msg_type, body

    def messages(self) -> list[tuple[int, bytes]]:
        """Every complete message buffered so far."""
        out = []
        while (msg := self.next_message()) is not None:
            out.append(msg)
        return out


