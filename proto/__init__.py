"""Wire formats only: bytes in, typed values out.  No asyncio, sockets or clocks.

The BGP-4 codec: messages (:mod:`proto.messages`), path attributes
(:mod:`proto.attributes`), capabilities (:mod:`proto.capabilities`), prefixes
(:mod:`proto.nlri`) and the errors they raise (:mod:`proto.errors`); the BFD Control
packet (:mod:`proto.bfd`, its states and diagnostics there as ``proto.bfd.State``/``Diag``).
"""

from proto.attributes import (
    AS_CONFED_SEQUENCE,
    AS_CONFED_SET,
    AS_SEQUENCE,
    AS_SET,
    ATTRIBUTES,
    BLACKHOLE,
    DEFAULT_CONTEXT,
    EMPTY_ATTRIBUTES,
    EXTENDED_LENGTH,
    GRACEFUL_SHUTDOWN,
    NO_ADVERTISE,
    NO_EXPORT,
    NO_EXPORT_SUBCONFED,
    NOPEER,
    OPTIONAL,
    ORIGIN_EGP,
    ORIGIN_IGP,
    ORIGIN_INCOMPLETE,
    PARTIAL,
    TRANSITIVE,
    Aggregator,
    As4Aggregator,
    As4Path,
    AsPath,
    AsPathSegment,
    AtomicAggregate,
    ClusterList,
    CodecContext,
    Communities,
    LargeCommunities,
    LocalPref,
    MpReachNlri,
    MpUnreachNlri,
    MultiExitDisc,
    NextHop,
    Origin,
    OriginatorId,
    PathAttribute,
    PathAttributes,
    UnknownAttribute,
    community_from_str,
    community_to_str,
)
from proto.bfd import BfdDecodeError, ControlPacket
from proto.capabilities import (
    CAPABILITIES,
    Capability,
    FourOctetAs,
    GracefulRestart,
    GracefulRestartFamily,
    MultiProtocol,
    UnknownCapability,
)
from proto.capabilities import RouteRefresh as RouteRefreshCapability
from proto.errors import (
    CeaseSubcode,
    DecodeError,
    ErrorAction,
    ErrorCode,
    FsmSubcode,
    HeaderSubcode,
    OpenSubcode,
    RouteRefreshSubcode,
    UpdateError,
    UpdateSubcode,
    error_name,
)
from proto.messages import (
    AS_TRANS,
    HEADER_LEN,
    MARKER,
    MAX_MESSAGE_LEN,
    MESSAGES,
    Keepalive,
    Message,
    MessageReader,
    MessageType,
    Notification,
    Open,
    RouteRefresh,
    Update,
    decode_message,
    encode_updates,
    encode_withdrawals,
)
from proto.nlri import (
    IPV4_UNICAST,
    IPV6_UNICAST,
    Afi,
    Safi,
    decode_prefixes,
    encode_prefixes,
    network_to_prefix,
    prefix_from_str,
    prefix_len,
    prefix_to_network,
    prefix_to_str,
)

# Two things are called "RouteRefresh": the message (proto.RouteRefresh, as in
# proto.messages) and the capability (proto.RouteRefreshCapability here, RouteRefresh in
# proto.capabilities).

__all__ = [
    # errors
    "ErrorAction", "ErrorCode", "HeaderSubcode", "OpenSubcode", "UpdateSubcode", "FsmSubcode",
    "CeaseSubcode", "RouteRefreshSubcode", "error_name", "DecodeError", "UpdateError",
    # nlri
    "Afi", "Safi", "IPV4_UNICAST", "IPV6_UNICAST", "decode_prefixes", "encode_prefixes",
    "prefix_from_str", "prefix_to_str", "prefix_to_network", "prefix_len", "network_to_prefix",
    # capabilities
    "Capability", "MultiProtocol", "RouteRefreshCapability", "GracefulRestartFamily",
    "GracefulRestart", "FourOctetAs", "UnknownCapability", "CAPABILITIES",
    # attributes
    "OPTIONAL", "TRANSITIVE", "PARTIAL", "EXTENDED_LENGTH", "CodecContext", "DEFAULT_CONTEXT",
    "PathAttribute", "Origin", "ORIGIN_IGP", "ORIGIN_EGP", "ORIGIN_INCOMPLETE", "AsPathSegment",
    "AsPath", "AS_SET", "AS_SEQUENCE", "AS_CONFED_SEQUENCE", "AS_CONFED_SET", "NextHop",
    "MultiExitDisc", "LocalPref", "AtomicAggregate", "Aggregator", "Communities",
    "NO_EXPORT", "NO_ADVERTISE", "NO_EXPORT_SUBCONFED", "NOPEER", "GRACEFUL_SHUTDOWN",
    "BLACKHOLE", "community_to_str", "community_from_str", "OriginatorId", "ClusterList",
    "MpReachNlri", "MpUnreachNlri", "As4Path", "As4Aggregator", "LargeCommunities",
    "UnknownAttribute", "ATTRIBUTES", "PathAttributes", "EMPTY_ATTRIBUTES",
    # messages
    "MARKER", "HEADER_LEN", "MAX_MESSAGE_LEN", "AS_TRANS", "MessageType", "Message", "Open",
    "Update", "Notification", "Keepalive", "RouteRefresh", "MESSAGES", "MessageReader",
    "decode_message", "encode_updates", "encode_withdrawals",
    # BFD (RFC 5880 §4.1)
    "ControlPacket", "BfdDecodeError",
]
