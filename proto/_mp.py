"""MP_REACH_NLRI and MP_UNREACH_NLRI (RFC 4760 §3, §4)."""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from typing import ClassVar

from proto._attr_base import OPTIONAL, CodecContext, PathAttribute
from proto.errors import DecodeError, ErrorAction, UpdateSubcode
from proto.nlri import decode_prefixes_at

# Families whose NLRI this codec can parse: plain prefixes (RFC 4760 §5).
SUPPORTED_FAMILIES = frozenset({(1, 1), (2, 1)})


def _family_error(cls: type[PathAttribute], afi: int, safi: int, value: bytes, flags: int) -> DecodeError:
    # An AFI/SAFI we cannot parse was not negotiated (RFC 4760 §8); like BIRD we ignore
    # the attribute and keep the rest of the UPDATE, recorded as attribute-discard.
    return cls.error(
        UpdateSubcode.OPTIONAL_ATTRIBUTE_ERROR,
        value,
        flags,
        f"unsupported AFI/SAFI {afi}/{safi}",
        action=ErrorAction.ATTRIBUTE_DISCARD,
    )


def _nlri(cls: type[PathAttribute], value: bytes, start: int, afi: int, flags: int) -> tuple[bytes, ...]:
    try:
        return tuple(decode_prefixes_at(value, start, len(value), afi))
    except DecodeError as exc:
        # RFC 7606 §5.3: a syntactically wrong NLRI resets the session.
        raise DecodeError(exc.code, exc.subcode, b"", f"{cls.name}: {exc.message}") from None


@dataclass(frozen=True, slots=True)
class MpReachNlri(PathAttribute):
    """MP_REACH_NLRI (type 14, optional non-transitive).

    ``next_hop`` holds one address, or two for IPv6 (global, link-local; RFC 2545 §3).
    The reserved octet (formerly SNPAs) is written 0 and ignored on receipt.
    """

    code: ClassVar[int] = 14
    flags: ClassVar[int] = OPTIONAL
    # RFC 7606 §7.11: the NLRI cannot be located reliably once the attribute is
    # malformed, so the session is reset.
    action: ClassVar[ErrorAction] = ErrorAction.SESSION_RESET
    name: ClassVar[str] = "MP_REACH_NLRI"
    afi: int
    safi: int
    next_hop: tuple[IPv4Address | IPv6Address, ...]
    nlri: tuple[bytes, ...]

    @property
    def usable_next_hop(self) -> IPv4Address | IPv6Address:
        """The address the routes go through: the global one, or -- a 32-byte IPv6 next hop
        whose global half is ``::`` (RFC 2545 wants a global address there, but some speakers
        send none beside their link-local one; BIRD takes it so) -- the link-local one."""
        nh = self.next_hop
        if len(nh) == 2 and nh[0].is_unspecified and nh[1].is_link_local:
            return nh[1]
        return nh[0]

    def encode_value(self, ctx: CodecContext) -> bytes:
        return self.encode_header() + b"".join(self.nlri)

    def encode_header(self) -> bytes:
        """Everything up to the NLRI: AFI, SAFI, next hop, reserved octet."""
        nh = b"".join(a.packed for a in self.next_hop)
        return (
            self.afi.to_bytes(2, "big") + bytes((self.safi, len(nh))) + nh + b"\x00"
        )

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> MpReachNlri:
        if len(value) < 5:
            raise cls.error(UpdateSubcode.OPTIONAL_ATTRIBUTE_ERROR, value, flags, f"length {len(value)}")
        afi = int.from_bytes(value[0:2], "big")
        safi = value[2]
        nh_len = value[3]
        if 5 + nh_len > len(value):
            raise cls.error(
                UpdateSubcode.OPTIONAL_ATTRIBUTE_ERROR,
                value,
                flags,
                f"next hop length {nh_len} overruns the attribute",
            )
        if (afi, safi) not in SUPPORTED_FAMILIES:
            raise _family_error(cls, afi, safi, value, flags)
        nh = value[4 : 4 + nh_len]
        next_hop: tuple[IPv4Address | IPv6Address, ...]
        if afi == 1 and nh_len == 4:
            next_hop = (IPv4Address(nh),)
        elif afi == 2 and nh_len == 16:
            next_hop = (IPv6Address(nh),)
        elif afi == 2 and nh_len == 32:
            # RFC 2545 §3: global and link-local.
            next_hop = (IPv6Address(nh[:16]), IPv6Address(nh[16:]))
        else:
            # An IPv6 next hop for IPv4 NLRI needs RFC 8950's capability, which we do not
            # advertise: like any other length it is inconsistent with the AFI.
            # RFC 7606 §7.11: next hop length inconsistent with the AFI.
            raise cls.error(
                UpdateSubcode.OPTIONAL_ATTRIBUTE_ERROR,
                value,
                flags,
                f"next hop length {nh_len} is invalid for AFI {afi}",
            )
        return cls(afi, safi, next_hop, _nlri(cls, value, 5 + nh_len, afi, flags))


@dataclass(frozen=True, slots=True)
class MpUnreachNlri(PathAttribute):
    """MP_UNREACH_NLRI (type 15, optional non-transitive): withdrawn prefixes."""

    code: ClassVar[int] = 15
    flags: ClassVar[int] = OPTIONAL
    action: ClassVar[ErrorAction] = ErrorAction.SESSION_RESET  # RFC 7606 §5.3, RFC 4760 §7
    name: ClassVar[str] = "MP_UNREACH_NLRI"
    afi: int
    safi: int
    withdrawn: tuple[bytes, ...] = ()

    def encode_value(self, ctx: CodecContext) -> bytes:
        return self.afi.to_bytes(2, "big") + bytes((self.safi,)) + b"".join(self.withdrawn)

    @classmethod
    def decode_value(cls, value: bytes, flags: int, ctx: CodecContext) -> MpUnreachNlri:
        if len(value) < 3:
            raise cls.error(UpdateSubcode.OPTIONAL_ATTRIBUTE_ERROR, value, flags, f"length {len(value)}")
        afi = int.from_bytes(value[0:2], "big")
        safi = value[2]
        if (afi, safi) not in SUPPORTED_FAMILIES:
            if len(value) == 3:
                # An End-of-RIB marker needs no parsing, whatever the family (RFC 4724 §2).
                return cls(afi, safi, ())
            raise _family_error(cls, afi, safi, value, flags)
        return cls(afi, safi, _nlri(cls, value, 3, afi, flags))
