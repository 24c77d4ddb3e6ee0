"""The BFD Control packet (RFC 5880 §4.1): bytes in, a frozen dataclass out, and back.

::

     0                   1                   2                   3
     0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    |Vers |  Diag   |Sta|P|F|C|A|D|M|  Detect Mult  |    Length     |
    |                       My Discriminator                        |
    |                      Your Discriminator                       |
    |                    Desired Min TX Interval                    |
    |                   Required Min RX Interval                    |
    |                 Required Min Echo RX Interval                 |
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+

:meth:`ControlPacket.decode` applies every reception check of RFC 5880 §6.8.6 that is
about the packet alone and raises :class:`BfdDecodeError` (and nothing else) with one line
saying which.  The checks that need a session (which discriminator is ours, the TTL of
RFC 5881 §5) belong to the session and the transport.

Authentication (§4.2-§4.4, §6.7) is not supported: our bfd.AuthType is always zero, so
§6.8.6 ("If the Authentication Present (A) bit is set and no authentication is in use
(bfd.AuthType is zero), the packet MUST be discarded") makes every packet with the A bit
a discard.  We never set it.

Intervals are in microseconds on the wire and here, as in the RFC.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

VERSION = 1  # RFC 5880 §4.1 "This document defines protocol version 1."
CONTROL_LEN = 24  # the mandatory section
AUTH_MIN_LEN = 26  # §6.8.6: "less than the minimum correct value (24 if the A bit is clear, or 26 if set)"

# Flag bits of the second octet (after the two state bits), §4.1.
POLL = 0x20
FINAL = 0x10
CONTROL_PLANE_INDEPENDENT = 0x08
AUTH_PRESENT = 0x04
DEMAND = 0x02
MULTIPOINT = 0x01

_CONTROL = struct.Struct("!BBBBIIIII")


class BfdDecodeError(ValueError):
    """Bytes that are not an acceptable BFD Control packet; the message says which check failed."""


class State(enum.IntEnum):
    """Session states (§4.1 "Sta"), in wire order."""

    ADMIN_DOWN = 0
    DOWN = 1
    INIT = 2
    UP = 3

    @property
    def label(self) -> str:
        return _STATE_LABELS[self]


_STATE_LABELS = {State.ADMIN_DOWN: "AdminDown", State.DOWN: "Down", State.INIT: "Init", State.UP: "Up"}


class Diag(enum.IntEnum):
    """Diagnostic codes (§4.1 "Diag"); 9-31 are reserved and decoded as plain ints."""

    NONE = 0
    CONTROL_DETECTION_TIME_EXPIRED = 1
    ECHO_FUNCTION_FAILED = 2
    NEIGHBOR_SIGNALED_SESSION_DOWN = 3
    FORWARDING_PLANE_RESET = 4
    PATH_DOWN = 5
    CONCATENATED_PATH_DOWN = 6
    ADMINISTRATIVELY_DOWN = 7
    REVERSE_CONCATENATED_PATH_DOWN = 8

    @property
    def label(self) -> str:
        return _DIAG_LABELS[self]


_DIAG_LABELS = {
    Diag.NONE: "No Diagnostic",
    Diag.CONTROL_DETECTION_TIME_EXPIRED: "Control Detection Time Expired",
    Diag.ECHO_FUNCTION_FAILED: "Echo Function Failed",
    Diag.NEIGHBOR_SIGNALED_SESSION_DOWN: "Neighbor Signaled Session Down",
    Diag.FORWARDING_PLANE_RESET: "Forwarding Plane Reset",
    Diag.PATH_DOWN: "Path Down",
    Diag.CONCATENATED_PATH_DOWN: "Concatenated Path Down",
    Diag.ADMINISTRATIVELY_DOWN: "Administratively Down",
    Diag.REVERSE_CONCATENATED_PATH_DOWN: "Reverse Concatenated Path Down",
}


def diag_label(diag: int) -> str:
    """A diagnostic code as words (reserved codes as "reserved (N)")."""
    return _DIAG_LABELS.get(diag, f"reserved ({diag})")  # type: ignore[call-overload]


def _diag(value: int) -> int:
    try:
        return Diag(value)
    except ValueError:
        return value


@dataclass(frozen=True, slots=True)
class ControlPacket:
    """One BFD Control packet without authentication section (§4.1).

    ``diag`` is a :class:`Diag` (or a reserved code as int); the intervals are in
    microseconds.  The A and M bits are not fields: we never send them and
    :meth:`decode` refuses them.
    """

    state: State
    my_discriminator: int
    your_discriminator: int = 0
    diag: int = Diag.NONE
    detect_mult: int = 3
    desired_min_tx: int = 1_000_000
    required_min_rx: int = 1_000_000
    required_min_echo_rx: int = 0
    poll: bool = False
    final: bool = False
    control_plane_independent: bool = False
    demand: bool = False

    def encode(self) -> bytes:
        if not 0 <= self.diag <= 0x1F:
            raise ValueError(f"BFD diag {self.diag} does not fit in 5 bits")
        flags = (
            (self.state << 6)
            | (POLL if self.poll else 0)
            | (FINAL if self.final else 0)
            | (CONTROL_PLANE_INDEPENDENT if self.control_plane_independent else 0)
            | (DEMAND if self.demand else 0)
        )
        return _CONTROL.pack(
            (VERSION << 5) | self.diag,
            flags,
            self.detect_mult,
            CONTROL_LEN,
            self.my_discriminator,
            self.your_discriminator,
            self.desired_min_tx,
            self.required_min_rx,
            self.required_min_echo_rx,
        )

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> ControlPacket:
        """Decode the UDP payload ``data``; every packet-only check of §6.8.6, in its order."""
        if len(data) < CONTROL_LEN:
            raise BfdDecodeError(f"BFD packet of {len(data)} bytes, shorter than the {CONTROL_LEN}-byte header")
        vdiag, flags, detect_mult, length, my_discr, your_discr, des_tx, req_rx, req_echo = _CONTROL.unpack_from(data)
        version = vdiag >> 5
        if version != VERSION:
            # §6.8.6: "If the version number is not correct (1), the packet MUST be discarded."
            raise BfdDecodeError(f"BFD version {version}, only version {VERSION} is supported")
        minimum = AUTH_MIN_LEN if flags & AUTH_PRESENT else CONTROL_LEN
        if length < minimum:
            # §6.8.6: "less than the minimum correct value (24 if the A bit is clear, or 26 if set)"
            raise BfdDecodeError(f"BFD Length field {length} below the minimum {minimum}")
        if length > len(data):
            # §6.8.6: "greater than the payload of the encapsulating protocol"
            raise BfdDecodeError(f"BFD Length field {length} exceeds the {len(data)}-byte UDP payload")
        if detect_mult == 0:
            raise BfdDecodeError("BFD Detect Mult is zero")  # §6.8.6
        if flags & MULTIPOINT:
            raise BfdDecodeError("BFD Multipoint (M) bit is set")  # §6.8.6
        if flags & POLL and flags & FINAL:
            # §6.8.7: "A BFD Control packet MUST NOT have both the Poll (P) and Final (F) bits
            # set."  Discarded on receipt, as BIRD does: the answer to it would be ambiguous.
            raise BfdDecodeError("BFD Poll (P) and Final (F) bits both set")
        if my_discr == 0:
            raise BfdDecodeError("BFD My Discriminator is zero")  # §6.8.6
        state = State(flags >> 6)
        if your_discr == 0 and state not in (State.DOWN, State.ADMIN_DOWN):
            # §6.8.6: "If the Your Discriminator field is zero and the State field is not Down
            # or AdminDown, the packet MUST be discarded."
            raise BfdDecodeError(f"BFD Your Discriminator is zero in state {state.label}")
        if flags & AUTH_PRESENT:
            # §6.8.6: A bit set while bfd.AuthType is zero -> discard.  We support no authentication.
            raise BfdDecodeError("BFD authentication (A bit) is not supported")
        return cls(
            state=state,
            my_discriminator=my_discr,
            your_discriminator=your_discr,
            diag=_diag(vdiag & 0x1F),
            detect_mult=detect_mult,
            desired_min_tx=des_tx,
            required_min_rx=req_rx,
            required_min_echo_rx=req_echo,
            poll=bool(flags & POLL),
            final=bool(flags & FINAL),
            control_plane_independent=bool(flags & CONTROL_PLANE_INDEPENDENT),
            demand=bool(flags & DEMAND),
        )

    def __str__(self) -> str:
        bits = "".join(b for b, on in (("P", self.poll), ("F", self.final), ("C", self.control_plane_independent),
                                       ("D", self.demand)) if on)
        return (
            f"BFD {self.state.label}{' ' + bits if bits else ''} diag={self.diag} mult={self.detect_mult} "
            f"my={self.my_discriminator:#x} your={self.your_discriminator:#x} "
            f"tx={self.desired_min_tx}us rx={self.required_min_rx}us"
        )
