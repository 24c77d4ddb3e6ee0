"""BGP-4 on the wire for the benchmarks' own peers (feeders, the route-reflector client simulator).

Written from RFC 4271 directly and on purpose independent of proto/ and bgp/: the devices
under test are measured by peers that do not share the project's codec, so a bug there
cannot hide itself (the scale work's rule that a
measuring peer shares no code with what it measures).  Only the standard library is used.

What is here: framing (RFC 4271 §4.1), OPEN with capabilities (§4.2, RFC 5492), KEEPALIVE,
NOTIFICATION (§4.5), UPDATE (§4.3) with the path attributes the benchmarks send, IPv4 prefix
encoding, and a small message splitter for session setup.  tests/unit/bench/ holds this
encoder and proto/ to the same bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from ipaddress import IPv4Address

MARKER = b"\xff" * 16
HEADER_LEN = 19
MAX_MESSAGE_LEN = 4096  # RFC 4271 §4.1 (no RFC 8654 extended messages negotiated)

OPEN, UPDATE, NOTIFICATION, KEEPALIVE, ROUTE_REFRESH = 1, 2, 3, 4, 5
TYPE_NAMES = {OPEN: "OPEN", UPDATE: "UPDATE", NOTIFICATION: "NOTIFICATION", KEEPALIVE: "KEEPALIVE",
              ROUTE_REFRESH: "ROUTE-REFRESH"}

# Path attribute type codes and flags (RFC 4271 §4.3, §5; RFC 1997; RFC 4456 §8)
ATTR_ORIGIN, ATTR_AS_PATH, ATTR_NEXT_HOP, ATTR_MED, ATTR_LOCAL_PREF = 1, 2, 3, 4, 5
ATTR_COMMUNITIES, ATTR_ORIGINATOR_ID, ATTR_CLUSTER_LIST = 8, 9, 10
ATTR_MP_REACH, ATTR_MP_UNREACH = 14, 15
F_OPTIONAL, F_TRANSITIVE, F_EXTENDED = 0x80, 0x40, 0x10
ORIGIN_IGP, ORIGIN_INCOMPLETE = 0, 2
AS_SEQUENCE = 2

# NOTIFICATION error codes (RFC 4271 §4.5) and Cease subcodes (RFC 4486), for messages only.
_ERRORS = {1: "Message Header Error", 2: "OPEN Message Error", 3: "UPDATE Message Error",
           4: "Hold Timer Expired", 5: "FSM Error", 6: "Cease"}
_CEASE = {1: "Maximum Number of Prefixes Reached", 2: "Administrative Shutdown", 3: "Peer De-configured",
          4: "Administrative Reset", 5: "Connection Rejected", 6: "Other Configuration Change",
          7: "Connection Collision Resolution", 8: "Out of Resources", 10: "BFD Down"}


def frame(msg_type: int, body: bytes = b"") -> bytes:
    """One message: marker, length, type, body (RFC 4271 §4.1)."""
    length = HEADER_LEN + len(body)
    if length > MAX_MESSAGE_LEN:
        raise ValueError(f"message of {length} bytes exceeds {MAX_MESSAGE_LEN}")
    return MARKER + struct.pack("!HB", length, msg_type) + body


def keepalive() -> bytes:
    return frame(KEEPALIVE)


def open_message(asn: int, hold_time: int, router_id: str) -> bytes:
    """OPEN with Multiprotocol IPv4 unicast (RFC 4760), Route Refresh (RFC 2918) and 4-octet AS
    (RFC 6793); 'My Autonomous System' is AS_TRANS for a 4-octet ``asn``."""
    caps = (
        bytes((1, 4)) + struct.pack("!HBB", 1, 0, 1)  # MP: AFI 1, reserved, SAFI 1
        + bytes((2, 0))  # Route Refresh
        + bytes((65, 4)) + struct.pack("!I", asn)  # 4-octet AS
    )
    params = bytes((2, len(caps))) + caps  # one Capabilities optional parameter (RFC 5492)
    my_as = asn if asn <= 0xFFFF else 23456
    body = struct.pack("!BHH", 4, my_as, hold_time) + IPv4Address(router_id).packed + bytes((len(params),)) + params
    return frame(OPEN, body)


def parse_open(body: bytes) -> tuple[int, int, str]:
    """(AS, hold time, BGP identifier) of an OPEN body; the 4-octet AS capability wins over
    'My Autonomous System'.  Raises ValueError on a body too short to hold them."""
    if len(body) < 10:
        raise ValueError(f"OPEN body of {len(body)} bytes")
    version, my_as, hold = struct.unpack_from("!BHH", body)
    if version != 4:
        raise ValueError(f"OPEN version {version}")
    router_id = str(IPv4Address(body[5:9]))
    params = body[10 : 10 + body[9]]
    i = 0
    while i + 2 <= len(params):
        ptype, plen = params[i], params[i + 1]
        value = params[i + 2 : i + 2 + plen]
        if ptype == 2:
            j = 0
            while j + 2 <= len(value):
                code, clen = value[j], value[j + 1]
                if code == 65 and clen == 4:
                    my_as = struct.unpack_from("!I", value, j + 2)[0]
                j += 2 + clen
        i += 2 + plen
    return my_as, hold, router_id


def notification(code: int, subcode: int = 0, data: bytes = b"") -> bytes:
    return frame(NOTIFICATION, bytes((code, subcode)) + data)


def describe_notification(body: bytes) -> str:
    """'Cease/Administrative Reset (4/4): text' from a NOTIFICATION body."""
    if len(body) < 2:
        return f"NOTIFICATION with a {len(body)}-byte body"
    code, subcode, data = body[0], body[1], body[2:]
    name = _ERRORS.get(code, "unknown error")
    sub = _CEASE.get(subcode, "") if code == 6 else ""
    text = f"{name}{'/' + sub if sub else ''} ({code}/{subcode})"
    if code == 6 and subcode in (2, 4) and data:  # RFC 9003 shutdown communication
        text += ": " + data[1 : 1 + data[0]].decode("utf-8", "replace")
    elif data:
        text += f" data {data[:16].hex()}"
    return text


# --------------------------------------------------------------------------- UPDATE


def prefix(net: int | str, length: int) -> bytes:
    """An IPv4 prefix in NLRI form: length octet, then the fewest octets that hold it (§4.3)."""
    address = int(IPv4Address(net)) if isinstance(net, str) else net
    return bytes((length,)) + address.to_bytes(4, "big")[: (length + 7) // 8]


def attribute(flags: int, code: int, value: bytes) -> bytes:
    """One path attribute; the Extended Length flag is set when the value needs it (§4.3)."""
    if len(value) > 255:
        return bytes((flags | F_EXTENDED, code)) + struct.pack("!H", len(value)) + value
    return bytes((flags, code, len(value))) + value


def path_attributes(
    *,
    origin: int = ORIGIN_IGP,
    as_path: Sequence[int] = (),
    next_hop: str | int | None = None,
    med: int | None = None,
    local_pref: int | None = None,
    communities: Sequence[int] = (),
) -> bytes:
    """The attributes in type-code order (as BIRD, GoBGP and agentd send them), 4-octet AS_PATH
    (both ends speak RFC 6793); an empty ``as_path`` is the empty AS_PATH of iBGP."""
    out = [attribute(F_TRANSITIVE, ATTR_ORIGIN, bytes((origin,)))]
    segs = b""
    for i in range(0, len(as_path), 255):
        chunk = as_path[i : i + 255]
        segs += bytes((AS_SEQUENCE, len(chunk))) + b"".join(struct.pack("!I", a) for a in chunk)
    out.append(attribute(F_TRANSITIVE, ATTR_AS_PATH, segs))
    if next_hop is not None:
        nh = IPv4Address(next_hop).packed
        out.append(attribute(F_TRANSITIVE, ATTR_NEXT_HOP, nh))
    if med is not None:
        out.append(attribute(F_OPTIONAL, ATTR_MED, struct.pack("!I", med)))
    if local_pref is not None:
        out.append(attribute(F_TRANSITIVE, ATTR_LOCAL_PREF, struct.pack("!I", local_pref)))
    if communities:
        value = b"".join(struct.pack("!I", c) for c in communities)
        out.append(attribute(F_OPTIONAL | F_TRANSITIVE, ATTR_COMMUNITIES, value))
    return b"".join(out)


def update(attrs: bytes = b"", nlri: bytes = b"", withdrawn: bytes = b"") -> bytes:
    """One UPDATE (§4.3); all empty is the IPv4 unicast End-of-RIB marker (RFC 4724 §2)."""
    body = struct.pack("!H", len(withdrawn)) + withdrawn + struct.pack("!H", len(attrs)) + attrs + nlri
    return frame(UPDATE, body)


def updates(attrs: bytes, prefixes: Iterable[bytes]) -> list[bytes]:
    """As many UPDATEs as ``prefixes`` need under one attribute set, each filled up to 4096 bytes."""
    room = MAX_MESSAGE_LEN - HEADER_LEN - 4 - len(attrs)
    if room < 5:
        raise ValueError("attributes leave no room for NLRI")
    out: list[bytes] = []
    pending: list[bytes] = []
    size = 0
    for p in prefixes:
        if size + len(p) > room:
            out.append(update(attrs, b"".join(pending)))
            pending, size = [], 0
        pending.append(p)
        size += len(p)
    if pending:
        out.append(update(attrs, b"".join(pending)))
    return out


END_OF_RIB = update()


# --------------------------------------------------------------------------- reading


class Splitter:
    """Whole messages out of a byte stream: ``feed(data)``, then ``messages()`` -> [(type, body)].
    Raises ValueError on a bad marker or length (the peer is then not speaking BGP)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def messages(self) -> list[tuple[int, bytes]]:
        out = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= HEADER_LEN:
            if buf[pos : pos + 16] != MARKER:
                raise ValueError("message without the all-ones marker")
            length = (buf[pos + 16] << 8) | buf[pos + 17]
            if not HEADER_LEN <= length <= MAX_MESSAGE_LEN:
                raise ValueError(f"message length {length}")
            if len(buf) - pos < length:
                break
            out.append((buf[pos + 18], bytes(buf[pos + HEADER_LEN : pos + length])))
            pos += length
        del buf[:pos]
        return out
