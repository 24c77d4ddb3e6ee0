"""BGP error codes (RFC 4271 §4.5, §6) and the one exception the codec raises.

Every decode function in :mod:`proto` raises :class:`DecodeError` and nothing else on bad
input.  A ``DecodeError`` carries exactly what the NOTIFICATION to send needs (code, subcode,
data) plus the RFC 7606 action that applies.  Outcomes of RFC 7606 that do *not* reset the
session (treat-as-withdraw, attribute-discard) are not raised: they are recorded on the
decoded UPDATE as :class:`UpdateError` values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ErrorAction(enum.Enum):
    """The error-handling approaches of RFC 7606 §2, strongest first."""

    SESSION_RESET = "session-reset"
    TREAT_AS_WITHDRAW = "treat-as-withdraw"
    ATTRIBUTE_DISCARD = "attribute-discard"


class ErrorCode(enum.IntEnum):
    """NOTIFICATION error codes (RFC 4271 §4.5, RFC 7313 §5)."""

    MESSAGE_HEADER = 1
    OPEN_MESSAGE = 2
    UPDATE_MESSAGE = 3
    HOLD_TIMER_EXPIRED = 4
    FSM = 5
    CEASE = 6
    ROUTE_REFRESH = 7


class HeaderSubcode(enum.IntEnum):
    """Message Header Error subcodes (RFC 4271 §6.1)."""

    CONNECTION_NOT_SYNCHRONIZED = 1
    BAD_MESSAGE_LENGTH = 2
    BAD_MESSAGE_TYPE = 3


class OpenSubcode(enum.IntEnum):
    """OPEN Message Error subcodes (RFC 4271 §6.2, RFC 5492 §5, RFC 9234 §4.2)."""

    UNSPECIFIC = 0
    UNSUPPORTED_VERSION = 1
    BAD_PEER_AS = 2
    BAD_BGP_IDENTIFIER = 3
    UNSUPPORTED_OPTIONAL_PARAMETER = 4
    UNACCEPTABLE_HOLD_TIME = 6
    UNSUPPORTED_CAPABILITY = 7
    ROLE_MISMATCH = 11


class UpdateSubcode(enum.IntEnum):
    """UPDATE Message Error subcodes (RFC 4271 §6.3)."""

    MALFORMED_ATTRIBUTE_LIST = 1
    UNRECOGNIZED_WELL_KNOWN_ATTRIBUTE = 2
    MISSING_WELL_KNOWN_ATTRIBUTE = 3
    ATTRIBUTE_FLAGS_ERROR = 4
    ATTRIBUTE_LENGTH_ERROR = 5
    INVALID_ORIGIN_ATTRIBUTE = 6
    INVALID_NEXT_HOP_ATTRIBUTE = 8
    OPTIONAL_ATTRIBUTE_ERROR = 9
    INVALID_NETWORK_FIELD = 10
    MALFORMED_AS_PATH = 11


class FsmSubcode(enum.IntEnum):
    """Finite State Machine Error subcodes (RFC 6608 §3)."""

    UNSPECIFIED = 0
    OPEN_SENT = 1
    OPEN_CONFIRM = 2
    ESTABLISHED = 3


class CeaseSubcode(enum.IntEnum):
    """Cease subcodes (RFC 4486 §4, RFC 8538 §5 Hard Reset, RFC 9384 BFD Down)."""

    MAXIMUM_PREFIXES_REACHED = 1
    ADMINISTRATIVE_SHUTDOWN = 2
    PEER_DECONFIGURED = 3
    ADMINISTRATIVE_RESET = 4
    CONNECTION_REJECTED = 5
    OTHER_CONFIGURATION_CHANGE = 6
    CONNECTION_COLLISION_RESOLUTION = 7
    OUT_OF_RESOURCES = 8
    HARD_RESET = 9
    BFD_DOWN = 10


class RouteRefreshSubcode(enum.IntEnum):
    """ROUTE-REFRESH Message Error subcodes (RFC 7313 §5)."""

    INVALID_MESSAGE_LENGTH = 1


_CODE_NAMES: dict[int, str] = {
    1: "Message Header Error",
    2: "OPEN Message Error",
    3: "UPDATE Message Error",
    4: "Hold Timer Expired",
    5: "Finite State Machine Error",
    6: "Cease",
    7: "ROUTE-REFRESH Message Error",
}

_SUBCODE_NAMES: dict[int, dict[int, str]] = {
    1: {1: "Connection Not Synchronized", 2: "Bad Message Length", 3: "Bad Message Type"},
    2: {
        0: "Unspecific",
        1: "Unsupported Version Number",
        2: "Bad Peer AS",
        3: "Bad BGP Identifier",
        4: "Unsupported Optional Parameter",
        6: "Unacceptable Hold Time",
        7: "Unsupported Capability",
        11: "Role Mismatch",
    },
    3: {
        1: "Malformed Attribute List",
        2: "Unrecognized Well-known Attribute",
        3: "Missing Well-known Attribute",
        4: "Attribute Flags Error",
        5: "Attribute Length Error",
        6: "Invalid ORIGIN Attribute",
        8: "Invalid NEXT_HOP Attribute",
        9: "Optional Attribute Error",
        10: "Invalid Network Field",
        11: "Malformed AS_PATH",
    },
    5: {
        0: "Unspecified Error",
        1: "Unexpected Message in OpenSent State",
        2: "Unexpected Message in OpenConfirm State",
        3: "Unexpected Message in Established State",
    },
    6: {
        1: "Maximum Number of Prefixes Reached",
        2: "Administrative Shutdown",
        3: "Peer De-configured",
        4: "Administrative Reset",
        5: "Connection Rejected",
        6: "Other Configuration Change",
        7: "Connection Collision Resolution",
        8: "Out of Resources",
        9: "Hard Reset",
        10: "BFD Down",
    },
    7: {1: "Invalid Message Length"},
}


def error_name(code: int, subcode: int) -> str:
    """``"Cease/Administrative Shutdown"``; unknown values are shown as numbers."""
    name = _CODE_NAMES.get(code, f"Error {code}")
    sub = _SUBCODE_NAMES.get(code, {}).get(subcode)
    if sub is None:
        # Hold Timer Expired and friends are normally sent with subcode 0: leave it out.
        if subcode == 0 and code in _CODE_NAMES:
            return name
        sub = f"Subcode {subcode}"
    return f"{name}/{sub}"


class DecodeError(Exception):
    """Bytes that cannot be accepted, with the NOTIFICATION that answers them.

    ``action`` is the RFC 7606 approach; decode functions only *raise* for
    ``SESSION_RESET``, but attribute decoders raise the other actions too and the
    UPDATE decoder turns those into :class:`UpdateError` records.
    """

    def __init__(
        self,
        code: int,
        subcode: int,
        data: bytes = b"",
        message: str = "",
        action: ErrorAction = ErrorAction.SESSION_RESET,
    ) -> None:
        super().__init__(code, subcode, data, message, action)
        self.code = code
        self.subcode = subcode
        self.data = bytes(data)
        self.message = message
        self.action = action

    def __str__(self) -> str:
        text = error_name(self.code, self.subcode)
        if self.message:
            text += f": {self.message}"
        if self.data:
            shown = self.data[:32].hex()
            text += f" (data {shown}{'...' if len(self.data) > 32 else ''})"
        if self.action is not ErrorAction.SESSION_RESET:
            text += f" [{self.action.value}]"
        return text

    def __repr__(self) -> str:
        return (
            f"DecodeError(code={self.code}, subcode={self.subcode}, data={self.data!r}, "
            f"message={self.message!r}, action={self.action})"
        )

    def to_update_error(self, attribute: int | None = None) -> UpdateError:
        return UpdateError(self.action, self.code, self.subcode, self.data, self.message, attribute)


@dataclass(frozen=True, slots=True)
class UpdateError:
    """An RFC 7606 outcome that did not reset the session, recorded on the Update.

    ``attribute`` is the type code of the attribute concerned (None for errors that are
    not about one attribute).
    """

    action: ErrorAction
    code: int
    subcode: int
    data: bytes
    message: str
    attribute: int | None = None

    def __str__(self) -> str:
        return f"{error_name(self.code, self.subcode)}: {self.message} [{self.action.value}]"
