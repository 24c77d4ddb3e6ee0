"""The path attribute base class, attribute flags and the codec context (RFC 4271 §4.3)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from proto.errors import DecodeError, ErrorAction, ErrorCode

# Attribute Flags (RFC 4271 §4.3).
OPTIONAL = 0x80
TRANSITIVE = 0x40
PARTIAL = 0x20
EXTENDED_LENGTH = 0x10

AS_TRANS = 23456  # RFC 6793 §9


@dataclass(frozen=True)
class CodecContext:
    """What the session negotiated that changes the wire format (GoBGP's MarshallingOption).

    One context per session; it does not change while the session is up.
    """

    #: Both sides advertised the 4-octet AS capability (RFC 6793 §3): AS_PATH and
    #: AGGREGATOR carry 4-octet AS numbers, AS4_PATH/AS4_AGGREGATOR are not used.
    four_octet_as: bool = True
    #: Largest message the peer accepts (4096, RFC 4271 §4.1; RFC 8654 raises it).
    max_message_len: int = 4096
    #: The session is with an external peer (eBGP).  Two receive rules depend on it:
    #: LOCAL_PREF is attribute-discarded (RFC 7606 §7.5) and AS_CONFED_* segments make the
    #: AS_PATH malformed, since we are in no confederation (RFC 5065 §5).
    external: bool = False


DEFAULT_CONTEXT = CodecContext()


def attribute_header(flags: int, code: int, length: int) -> bytes:
    """Flags, type code and length; the extended-length flag is set exactly when needed."""
    if length > 255:
        if length > 0xFFFF:
            raise ValueError(f"attribute {code} value of {length} octets does not fit")
        return bytes(((flags | EXTENDED_LENGTH) & 0xF0, code, length >> 8, length & 0xFF))
    return bytes((flags & 0xE0, code, length))


def raw_attribute(flags: int, code: int, value: bytes) -> bytes:
    """The attribute as received (type, length, value): the data RFC 4271 §6.3 asks for."""
    if flags & EXTENDED_LENGTH:
        return bytes((flags, code, len(value) >> 8, len(value) & 0xFF)) + value
    return bytes((flags, code, len(value) & 0xFF)) + value


@dataclass(frozen=True, slots=True)
class PathAttribute:
    """Base class of every path attribute.

    ``flags`` are the flags we send (and, for Optional/Transitive, the ones a received
    attribute must carry, RFC 7606 §3 c); ``action`` is the RFC 7606 approach when the
    attribute is malformed.
    """

    code: ClassVar[int]
    flags: ClassVar[int]
    action: ClassVar[ErrorAction] = ErrorAction.TREAT_AS_WITHDRAW
    name: ClassVar[str] = "attribute"

    #: The Partial bit as received on a recognized optional transitive attribute: once set
    #: by some AS it must stay set when the attribute is passed on (RFC 4271 §5).  Part of
    #: equality and the hash: sets that differ only in it must not share one interned or
    #: cached object, or a route passed on would carry another's Partial bit.
    partial: bool = field(default=False, kw_only=True, repr=False)

    def encode_value(self, ctx: CodecContext) -> bytes:
        raise NotImplementedError

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> PathAttribute:
        raise NotImplementedError

    def send_flags(self) -> int:
        if self.partial and self.flags & OPTIONAL and self.flags & TRANSITIVE:
            return self.flags | PARTIAL
        return self.flags

    def encode(self, ctx: CodecContext = DEFAULT_CONTEXT) -> bytes:
        value = self.encode_value(ctx)
        return attribute_header(self.send_flags(), self.code, len(value)) + value

    @classmethod
    def error(
        cls,
        subcode: int,
        value: bytes,
        flags: int,
        message: str,
        *,
        with_data: bool = True,
        action: ErrorAction | None = None,
    ) -> DecodeError:
        """A DecodeError for this attribute, carrying the attribute itself as data."""
        data = raw_attribute(flags, cls.code, value) if with_data else b""
        return DecodeError(
            ErrorCode.UPDATE_MESSAGE,
            subcode,
            data,
            f"{cls.name}: {message}",
            cls.action if action is None else action,
        )
