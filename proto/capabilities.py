"""BGP capabilities carried in the OPEN message (RFC 5492 framing).

Each capability is a frozen dataclass with ``encode_value``/``decode_value`` for its value
and ``encode`` for the whole TLV (code, length, value).  Unknown capabilities are kept
verbatim so they can be shown and compared.  The code -> class map is the literal
:data:`CAPABILITIES` dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from proto.errors import DecodeError, ErrorCode, OpenSubcode

__all__ = [
    "Capability",
    "MultiProtocol",
    "RouteRefresh",
    "GracefulRestartFamily",
    "GracefulRestart",
    "FourOctetAs",
    "UnknownCapability",
    "CAPABILITIES",
    "decode_capability",
]


def _malformed(name: str, value: bytes, why: str) -> DecodeError:
    # RFC 4271 §6.2: a recognized optional parameter that is malformed gets subcode 0
    # (Unspecific); a capability is part of the Capabilities optional parameter.
    return DecodeError(
        ErrorCode.OPEN_MESSAGE,
        OpenSubcode.UNSPECIFIC,
        b"",
        f"malformed {name} capability ({why}): {value.hex() or 'empty'}",
    )


@dataclass(frozen=True, slots=True)
class Capability:
    """Base class: one capability TLV."""

    code: ClassVar[int]

    def encode_value(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def decode_value(cls, value: bytes) -> Capability:
        raise NotImplementedError

    def encode(self) -> bytes:
        value = self.encode_value()
        if len(value) > 255:
            raise ValueError(f"capability {self.code} value of {len(value)} octets does not fit")
        return bytes((self.code, len(value))) + value


@dataclass(frozen=True, slots=True)
class MultiProtocol(Capability):
    """Multiprotocol Extensions (RFC 4760 §8): AFI (2), reserved (1), SAFI (1)."""

    code: ClassVar[int] = 1
    afi: int
    safi: int

    def encode_value(self) -> bytes:
        return self.afi.to_bytes(2, "big") + b"\x00" + self.safi.to_bytes(1, "big")

    @classmethod
    def decode_value(cls, value: bytes) -> MultiProtocol:
        if len(value) != 4:
            raise _malformed("Multiprotocol", value, f"length {len(value)}, expected 4")
        # The reserved octet is ignored on receipt (RFC 4760 §8).
        return cls(int.from_bytes(value[0:2], "big"), value[3])


@dataclass(frozen=True, slots=True)
class RouteRefresh(Capability):
    """Route Refresh (RFC 2918 §2): no value."""

    code: ClassVar[int] = 2

    def encode_value(self) -> bytes:
        return b""

    @classmethod
    def decode_value(cls, value: bytes) -> RouteRefresh:
        if value:
            raise _malformed("Route Refresh", value, f"length {len(value)}, expected 0")
        return cls()


@dataclass(frozen=True, slots=True)
class GracefulRestartFamily:
    """One <AFI, SAFI, Flags> tuple of the Graceful Restart capability (RFC 4724 §3)."""

    afi: int
    safi: int
    forwarding_state: bool
    #: Flag bits other than F (0x80), kept for a faithful round trip.
    reserved_flags: int = 0


# Restart Flags (the top 4 bits of the first two octets): R (RFC 4724) and N (RFC 8538).
GR_RESTART_STATE = 0x8
GR_NOTIFICATION = 0x4


@dataclass(frozen=True, slots=True)
class GracefulRestart(Capability):
    """Graceful Restart (RFC 4724 §3): 4 flag bits, 12-bit restart time, families."""

    code: ClassVar[int] = 64
    restart_state: bool
    restart_time: int
    families: tuple[GracefulRestartFamily, ...] = ()
    #: N bit (RFC 8538 §2): the speaker supports graceful restart for NOTIFICATIONs.
    notification: bool = False
    #: Restart flag bits other than R and N (as the 4-bit value), kept on round trip.
    reserved_flags: int = 0

    def encode_value(self) -> bytes:
        if not 0 <= self.restart_time <= 0xFFF:
            raise ValueError(f"graceful restart time {self.restart_time} is not 0..4095")
        flags = (self.reserved_flags & 0x3) | (GR_RESTART_STATE if self.restart_state else 0)
        flags |= GR_NOTIFICATION if self.notification else 0
        out = bytearray(((flags << 4) | (self.restart_time >> 8), self.restart_time & 0xFF))
        for fam in self.families:
            out += fam.afi.to_bytes(2, "big")
            out.append(fam.safi)
            out.append((0x80 if fam.forwarding_state else 0) | (fam.reserved_flags & 0x7F))
        return bytes(out)

    @classmethod
    def decode_value(cls, value: bytes) -> GracefulRestart:
        if len(value) < 2 or (len(value) - 2) % 4:
            raise _malformed("Graceful Restart", value, f"length {len(value)} is not 2 + 4n")
        flags = value[0] >> 4
        restart_time = ((value[0] & 0x0F) << 8) | value[1]
        families = tuple(
            GracefulRestartFamily(
                int.from_bytes(value[i : i + 2], "big"),
                value[i + 2],
                bool(value[i + 3] & 0x80),
                value[i + 3] & 0x7F,
            )
            for i in range(2, len(value), 4)
        )
        return cls(
            bool(flags & GR_RESTART_STATE),
            restart_time,
            families,
            bool(flags & GR_NOTIFICATION),
            flags & 0x3,
        )


@dataclass(frozen=True, slots=True)
class FourOctetAs(Capability):
    """Support for 4-octet AS numbers (RFC 6793 §3): the speaker's 4-octet AS."""

    code: ClassVar[int] = 65
    asn: int

    def encode_value(self) -> bytes:
        return self.asn.to_bytes(4, "big")

    @classmethod
    def decode_value(cls, value: bytes) -> FourOctetAs:
        if len(value) != 4:
            raise _malformed("4-octet AS", value, f"length {len(value)}, expected 4")
        return cls(int.from_bytes(value, "big"))


@dataclass(frozen=True, slots=True)
class UnknownCapability(Capability):
    """A capability this codec does not interpret, kept verbatim."""

    code: int  # type: ignore[misc]
    value: bytes

    def encode_value(self) -> bytes:
        return self.value

    @classmethod
    def decode_value(cls, value: bytes) -> UnknownCapability:  # pragma: no cover - needs a code
        raise TypeError("UnknownCapability needs its code: use decode_capability()")


CAPABILITIES: dict[int, type[Capability]] = {
    1: MultiProtocol,
    2: RouteRefresh,
    64: GracefulRestart,
    65: FourOctetAs,
}


def decode_capability(code: int, value: bytes) -> Capability:
    """Decode one capability value by its code (unknown codes are kept verbatim)."""
    cls = CAPABILITIES.get(code)
    if cls is None:
        return UnknownCapability(code, bytes(value))
    return cls.decode_value(bytes(value))
