"""ctnetlink, the conntrack half of nfnetlink (NETLINK_NETFILTER): the codec, pure.

What the agent says to conntrack and hears from it, framed with the one netlink codec
(:mod:`agentd.kernel.netlink`: header, attribute packer and parser): dumps and deletes of
entries (Services' stale UDP flows, ``agentd.services.conntrack``; removed pods' addresses, ``agentd.policy.conntrack``) and the events conntrack
multicasts when an entry is confirmed (NEW) and when it goes (DESTROY), which are the
connection records of flow visibility (``agentd.flows``).

The messages (include/uapi/linux/netfilter/nfnetlink.h, nfnetlink_conntrack.h)::

    nlmsghdr.type = NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW (dump answers, events) / _GET / _DELETE
    struct nfgenmsg { u8 nfgen_family; u8 version; __be16 res_id; }          4 bytes
    CTA_TUPLE_ORIG / CTA_TUPLE_REPLY (nested) {
        CTA_TUPLE_IP (nested) { CTA_IP_V4_SRC/DST in_addr | CTA_IP_V6_SRC/DST in6_addr },
        CTA_TUPLE_PROTO (nested) { CTA_PROTO_NUM u8, CTA_PROTO_SRC_PORT / DST_PORT __be16,
                                   CTA_PROTO_ICMP_TYPE / CODE u8 (ICMP, ICMPv6) } }
    CTA_STATUS __be32 (IPS_* bits), CTA_ID __be32, CTA_TIMEOUT __be32 (seconds left; a DESTROY has
        it only if the entry went with a second or more left: deleted before it expired),
    CTA_COUNTERS_ORIG / REPLY (nested) { CTA_COUNTERS_PACKETS __be64, CTA_COUNTERS_BYTES __be64 }
        (only with net.netfilter.nf_conntrack_acct = 1 when the entry was made)
    CTA_TIMESTAMP (nested) { CTA_TIMESTAMP_START __be64 ns, CTA_TIMESTAMP_STOP __be64 ns }
        (only with net.netfilter.nf_conntrack_timestamp = 1 when the entry was made; an
        expired entry's STOP is its expiry, not its last packet)
    CTA_PROTOINFO (nested) { CTA_PROTOINFO_TCP (nested) { CTA_PROTOINFO_TCP_STATE u8, ... } }
        (a DESTROY of TCP carries the state alone, Linux 5.11 and later)
    CTA_TIMESTAMP_EVENT __be64 ns (Linux 6.14 and later, with nf_conntrack_timestamp: when the
        event was sent)

An event is the same message as a dump answer: type IPCTNL_MSG_CT_NEW with NLM_F_CREATE (a new
entry) or IPCTNL_MSG_CT_DELETE (an entry destroyed), sent to the multicast groups
NFNLGRP_CONNTRACK_NEW / _DESTROY a listener joins (NETLINK_ADD_MEMBERSHIP).  Addresses are
text (``str``), so IPv4 and IPv6 entries are the same values.
"""

from __future__ import annotations

import errno
import socket
import struct
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from agentd.kernel import netlink as nl

NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_NEW = 0
IPCTNL_MSG_CT_GET = 1
IPCTNL_MSG_CT_DELETE = 2
MSG_NEW = NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW
MSG_DELETE = NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_DELETE

# Multicast groups (enum nfnetlink_groups)
NFNLGRP_CONNTRACK_NEW = 1
NFNLGRP_CONNTRACK_UPDATE = 2
NFNLGRP_CONNTRACK_DESTROY = 3

CTA_TUPLE_ORIG = 1
CTA_TUPLE_REPLY = 2
CTA_STATUS = 3
CTA_PROTOINFO = 4
CTA_TIMEOUT = 7
CTA_ID = 12
CTA_COUNTERS_ORIG = 9
CTA_COUNTERS_REPLY = 10
CTA_TIMESTAMP = 20
CTA_TIMESTAMP_EVENT = 27  # __be64 ns: when the event was sent (Linux 6.14, with nf_conntrack_timestamp)
CTA_TUPLE_IP = 1  # inside a CTA_TUPLE_*
CTA_TUPLE_PROTO = 2
CTA_IP_V4_SRC = 1  # inside CTA_TUPLE_IP
CTA_IP_V4_DST = 2
CTA_IP_V6_SRC = 3
CTA_IP_V6_DST = 4
CTA_PROTO_NUM = 1  # inside CTA_TUPLE_PROTO
CTA_PROTO_SRC_PORT = 2
CTA_PROTO_DST_PORT = 3
CTA_PROTO_ICMP_ID = 4
CTA_PROTO_ICMP_TYPE = 5
CTA_PROTO_ICMP_CODE = 6
CTA_PROTO_ICMPV6_TYPE = 8
CTA_PROTO_ICMPV6_CODE = 9
CTA_COUNTERS_PACKETS = 1  # inside CTA_COUNTERS_*
CTA_COUNTERS_BYTES = 2
CTA_PROTOINFO_TCP = 1  # inside CTA_PROTOINFO
CTA_PROTOINFO_TCP_STATE = 1  # u8 inside CTA_PROTOINFO_TCP: enum tcp_conntrack (a DESTROY carries it too)
CTA_TIMESTAMP_START = 1  # inside CTA_TIMESTAMP
CTA_TIMESTAMP_STOP = 2
# The pad nla_put_be64 gives CTA_TIMESTAMP_EVENT (the kernel's choice): an empty attribute of
# this type -- CTA_STATUS's number among the event's own -- before it where needed to align it.
CTA_TIMESTAMP_PAD = 3

IPS_SRC_NAT = 1 << 4
IPS_DST_NAT = 1 << 5
IPS_CONFIRMED = 1 << 3
IPS_SEEN_REPLY = 1 << 1
IPS_ASSURED = 1 << 2
IPS_FIXED_TIMEOUT = 1 << 10
IPS_NAT_CLASH = 1 << 12

_BE16 = struct.Struct("!H")
_BE32 = struct.Struct("!I")
_BE64 = struct.Struct("!Q")
_U8 = struct.Struct("=B")
_FAMILY_OF = {4: socket.AF_INET, 16: socket.AF_INET6}


class CtTuple(NamedTuple):
    """One direction of a connection.  ``sport``/``dport`` are the ports (TCP, UDP, SCTP) or
    ICMP's type and code (ICMP, ICMPv6), as conntrack keys them; 0 where there are none."""

    src: str
    dst: str
    proto: int
    sport: int = 0
    dport: int = 0


class CtEntry(NamedTuple):
    orig: CtTuple
    reply: CtTuple


class CtEvent(NamedTuple):
    """A conntrack entry as an event or dump answer carries it."""

    destroyed: bool  # a DESTROY event (IPCTNL_MSG_CT_DELETE), else a new (or dumped) entry
    family: int
    orig: CtTuple
    reply: CtTuple
    status: int = 0
    id: int = 0
    # Each direction's counters; None where the entry has none (made before nf_conntrack_acct
    # was turned on: conntrack counts only entries made after): unknown, not 0.
    orig_packets: int | None = None
    orig_bytes: int | None = None
    reply_packets: int | None = None
    reply_bytes: int | None = None
    start_ns: int = 0  # CLOCK_REALTIME nanoseconds (nf_conntrack_timestamp), 0: not kept
    stop_ns: int = 0
    event_ns: int = 0  # when the event happened (CTA_TIMESTAMP_EVENT), 0: not said
    tcp_state: int = -1  # conntrack's TCP state (enum tcp_conntrack; TIME_WAIT 7), -1: not said
    # Whole seconds the entry had left (CTA_TIMEOUT), -1: not said -- in a DESTROY (Linux 5.11
    # and later) only if it went with a second or more left, i.e. was deleted before it expired.
    timeout_s: int = -1

    @property
    def nat(self) -> bool:
        return bool(self.status & (IPS_SRC_NAT | IPS_DST_NAT))


def message(mtype: int, seq: int, flags: int, body: bytes, family: int = nl.AF_INET) -> bytes:
    return nl.encode_nfgen(NFNL_SUBSYS_CTNETLINK << 8 | mtype, flags, seq, family, body)


def delete_entries(sock: Any, requests: Iterable[tuple[bytes, str]]) -> int:
    """Send each IPCTNL_MSG_CT_DELETE request (its message and what it deletes) on ``sock``
    (an agentd.kernel.netlink_socket.NetlinkSocket); how many entries went.  One gone
    meanwhile (ENOENT) is not counted; any other error is raised."""
    deleted = 0
    for request, what in requests:
        try:
            sock.request(request, what=f"deleting conntrack entry {what}", dump=False)
            deleted += 1
        except nl.NetlinkError as err:
            if err.errno != errno.ENOENT:
                raise
    return deleted


def holds(sock: Any, t: CtTuple, seq: int = 0) -> bool:
    """Whether conntrack holds an entry with tuple ``t`` in either direction
    (IPCTNL_MSG_CT_GET on ``sock``, a NetlinkSocket of NETLINK_NETFILTER); blocking."""
    family = socket.AF_INET6 if ":" in t.src else socket.AF_INET
    request = message(IPCTNL_MSG_CT_GET, seq, nl.NLM_F_REQUEST, encode_tuple(CTA_TUPLE_ORIG, t), family)
    try:
        sock.request(request, what="looking up a conntrack entry", dump=False)
    except nl.NetlinkError as err:
        if err.errno == errno.ENOENT:
            return False
        raise
    return True


def encode_tuple(kind: int, t: CtTuple) -> bytes:
    """CTA_TUPLE_ORIG or CTA_TUPLE_REPLY with ``t`` (addresses and ports in network byte order)."""
    if ":" in t.src:
        ip = nl.attr(CTA_IP_V6_SRC, socket.inet_pton(socket.AF_INET6, t.src)) + nl.attr(
            CTA_IP_V6_DST, socket.inet_pton(socket.AF_INET6, t.dst))
    else:
        ip = nl.attr(CTA_IP_V4_SRC, socket.inet_aton(t.src)) + nl.attr(CTA_IP_V4_DST, socket.inet_aton(t.dst))
    proto = (nl.attr(CTA_PROTO_NUM, _U8.pack(t.proto)) + nl.attr(CTA_PROTO_SRC_PORT, _BE16.pack(t.sport))
             + nl.attr(CTA_PROTO_DST_PORT, _BE16.pack(t.dport)))
    return nl.nested(kind, nl.nested(CTA_TUPLE_IP, ip), nl.nested(CTA_TUPLE_PROTO, proto))


def _read_be(buf: bytes, start: int, end: int, fmt: struct.Struct, what: str) -> int:
    if end - start != fmt.size:
        raise nl.NetlinkDecodeError(f"{what} must be {fmt.size} bytes, got {end - start}")
    return fmt.unpack_from(buf, start)[0]


def _address(buf: bytes, start: int, end: int, what: str) -> str:
    family = _FAMILY_OF.get(end - start)
    if family is None:
        raise nl.NetlinkDecodeError(f"{what} is {end - start} bytes, an address is 4 or 16")
    return socket.inet_ntop(family, bytes(buf[start:end]))


def decode_tuple(buf: bytes, start: int, end: int) -> CtTuple:
    src = dst = "0.0.0.0"
    proto = sport = dport = 0
    for atype, vs, ve in nl.iter_attrs(buf, start, end):
        if atype == CTA_TUPLE_IP:
            for itype, is_, ie in nl.iter_attrs(buf, vs, ve):
                if itype in (CTA_IP_V4_SRC, CTA_IP_V6_SRC):
                    src = _address(buf, is_, ie, "CTA_IP_SRC")
                elif itype in (CTA_IP_V4_DST, CTA_IP_V6_DST):
                    dst = _address(buf, is_, ie, "CTA_IP_DST")
        elif atype == CTA_TUPLE_PROTO:
            for ptype, ps, pe in nl.iter_attrs(buf, vs, ve):
                if ptype == CTA_PROTO_NUM:
                    proto = _read_be(buf, ps, pe, _U8, "CTA_PROTO_NUM")
                elif ptype == CTA_PROTO_SRC_PORT:
                    sport = _read_be(buf, ps, pe, _BE16, "CTA_PROTO_SRC_PORT")
                elif ptype == CTA_PROTO_DST_PORT:
                    dport = _read_be(buf, ps, pe, _BE16, "CTA_PROTO_DST_PORT")
                elif ptype in (CTA_PROTO_ICMP_TYPE, CTA_PROTO_ICMPV6_TYPE):
                    sport = _read_be(buf, ps, pe, _U8, "CTA_PROTO_ICMP_TYPE")
                elif ptype in (CTA_PROTO_ICMP_CODE, CTA_PROTO_ICMPV6_CODE):
                    dport = _read_be(buf, ps, pe, _U8, "CTA_PROTO_ICMP_CODE")
    return CtTuple(src, dst, proto, sport, dport)


def _counters(buf: bytes, start: int, end: int) -> tuple[int, int]:
    packets = nbytes = 0
    for ctype, cs, ce in nl.iter_attrs(buf, start, end):
        if ctype == CTA_COUNTERS_PACKETS:
            packets = _read_be(buf, cs, ce, _BE64, "CTA_COUNTERS_PACKETS")
        elif ctype == CTA_COUNTERS_BYTES:
            nbytes = _read_be(buf, cs, ce, _BE64, "CTA_COUNTERS_BYTES")
    return packets, nbytes


def decode_event(mtype: int, buf: bytes, start: int, end: int) -> CtEvent | None:
    """A ctnetlink message body (nfgenmsg + attributes) of type ``mtype``; None if it is not
    an entry (another message type) or lacks a tuple."""
    if mtype not in (MSG_NEW, MSG_DELETE):
        return None
    if end > len(buf) or end - start < nl.NFGENMSG_LEN:
        raise nl.NetlinkDecodeError(f"conntrack message body is {end - start} bytes, nfgenmsg needs {nl.NFGENMSG_LEN}")
    family = buf[start]
    orig = reply = None
    status = ident = t0 = t1 = te = 0
    state = left = -1
    op: int | None = None  # no CTA_COUNTERS_*: not counted (unknown)
    ob = rp = rb = op
    for atype, vs, ve in nl.iter_attrs(buf, start + nl.NFGENMSG_LEN, end):
        if atype == CTA_TUPLE_ORIG:
            orig = decode_tuple(buf, vs, ve)
        elif atype == CTA_TUPLE_REPLY:
            reply = decode_tuple(buf, vs, ve)
        elif atype == CTA_STATUS:
            if ve == vs:
                # CTA_TIMESTAMP_EVENT's pad: the kernel writes it with nla_put_be64(..,
                # CTA_TIMESTAMP_PAD), 3 -- CTA_STATUS's number at this level -- and where 64-bit
                # access must be aligned puts an empty attribute of that type before it.  The
                # kernel never sends an empty CTA_STATUS.
                continue
            status = _read_be(buf, vs, ve, _BE32, "CTA_STATUS")
        elif atype == CTA_ID:
            ident = _read_be(buf, vs, ve, _BE32, "CTA_ID")
        elif atype == CTA_COUNTERS_ORIG:
            op, ob = _counters(buf, vs, ve)
        elif atype == CTA_COUNTERS_REPLY:
            rp, rb = _counters(buf, vs, ve)
        elif atype == CTA_TIMESTAMP:
            for ttype, ts, tend in nl.iter_attrs(buf, vs, ve):
                if ttype == CTA_TIMESTAMP_START:
                    t0 = _read_be(buf, ts, tend, _BE64, "CTA_TIMESTAMP_START")
                elif ttype == CTA_TIMESTAMP_STOP:
                    t1 = _read_be(buf, ts, tend, _BE64, "CTA_TIMESTAMP_STOP")
        elif atype == CTA_TIMESTAMP_EVENT:
            te = _read_be(buf, vs, ve, _BE64, "CTA_TIMESTAMP_EVENT")
        elif atype == CTA_TIMEOUT:
            left = _read_be(buf, vs, ve, _BE32, "CTA_TIMEOUT")
        elif atype == CTA_PROTOINFO:
            for ptype, ps, pend in nl.iter_attrs(buf, vs, ve):
                if ptype == CTA_PROTOINFO_TCP:
                    for ttype, ts, tend in nl.iter_attrs(buf, ps, pend):
                        if ttype == CTA_PROTOINFO_TCP_STATE:
                            if tend - ts != 1:
                                raise nl.NetlinkDecodeError(f"CTA_PROTOINFO_TCP_STATE is {tend - ts} bytes, not 1")
                            state = buf[ts]
    if orig is None or reply is None:
        return None
    v6 = ":" in orig.src
    if (":" in orig.dst) != v6 or (":" in reply.src) != v6 or (":" in reply.dst) != v6:
        raise nl.NetlinkDecodeError(f"conntrack tuples mix IPv4 and IPv6 addresses: {orig}, {reply}")
    return CtEvent(mtype == MSG_DELETE, family, orig, reply, status, ident, op, ob, rp, rb, t0, t1, te, state, left)


def lifetime(buf: bytes, start: int, end: int) -> tuple[int, int]:
    """An entry's CTA_TIMESTAMP_START and _STOP (CLOCK_REALTIME ns; 0: not kept) from a
    ctnetlink message body, without reading the rest of it."""
    pos = start + nl.NFGENMSG_LEN
    if end - pos >= _LIFETIME_LEN and \
            int.from_bytes(buf[pos:pos + _LIFETIME_LEN], "little") & _LIFETIME_MASK == _LIFETIME_WANT:
        return _LIFETIME_FIELDS.unpack_from(buf, pos)  # type: ignore[return-value]
    t0 = t1 = 0
    for atype, vs, ve in nl.iter_attrs(buf, start + nl.NFGENMSG_LEN, end):
        if atype == CTA_TIMESTAMP:
            for ttype, ts, tend in nl.iter_attrs(buf, vs, ve):
                if ttype == CTA_TIMESTAMP_START:
                    t0 = _read_be(buf, ts, tend, _BE64, "CTA_TIMESTAMP_START")
                elif ttype == CTA_TIMESTAMP_STOP:
                    t1 = _read_be(buf, ts, tend, _BE64, "CTA_TIMESTAMP_STOP")
            break
    return t0, t1


# ------------------------------------------------------------------ events at fixed offsets

# The kernel writes an IPv4 entry's tuples first and always alike (ctnetlink_dump_tuples):
#   CTA_TUPLE_ORIG / _REPLY { CTA_TUPLE_IP { CTA_IP_V4_SRC, CTA_IP_V4_DST },
#                             CTA_TUPLE_PROTO { CTA_PROTO_NUM, then the protocol's own:
#                                 CTA_PROTO_SRC_PORT, _DST_PORT (TCP, UDP, SCTP, ...) or
#                                 CTA_PROTO_ICMP_ID, _TYPE, _CODE (ICMP) } }
# so a listener that takes many events can check both tuples' attribute headers against that
# layout at once (the bytes as one number, masked: headers in host order, the values any) and
# read addresses and ports at their offsets.  A DESTROY goes on alike (ctnetlink_conntrack_event):
# CTA_ID, CTA_STATUS, CTA_TIMEOUT, CTA_COUNTERS_ORIG and _REPLY (nf_conntrack_acct), then
# CTA_TIMESTAMP { _START, _STOP } (nf_conntrack_timestamp).  Anything else (IPv6, a zone, no
# counters) is walked attribute by attribute.
def _layout(*parts: tuple[int, int, int]) -> tuple[int, int, int]:
    """(length, mask, want) of attribute headers ``(offset, nla_len, nla_type)``: bytes whose
    little-endian number ANDed with mask equals want have those headers there."""
    size = max(off for off, _len, _type in parts) + 4
    mask, want = bytearray(size), bytearray(size)
    for off, length, atype in parts:
        mask[off:off + 4] = b"\xff" * 4
        want[off:off + 4] = struct.pack("=HH", length, atype)
    return size, int.from_bytes(mask, "little"), int.from_bytes(want, "little")


def _tuple_heads(base: int, kind: int, icmp: bool) -> list[tuple[int, int, int]]:
    heads = [(base, 60 if icmp else 52, kind | nl.NLA_F_NESTED), (base + 4, 20, CTA_TUPLE_IP | nl.NLA_F_NESTED),
             (base + 8, 8, CTA_IP_V4_SRC), (base + 16, 8, CTA_IP_V4_DST),
             (base + 24, 36 if icmp else 28, CTA_TUPLE_PROTO | nl.NLA_F_NESTED), (base + 28, 5, CTA_PROTO_NUM)]
    if icmp:
        return heads + [(base + 36, 6, CTA_PROTO_ICMP_ID), (base + 44, 5, CTA_PROTO_ICMP_TYPE),
                        (base + 52, 5, CTA_PROTO_ICMP_CODE)]
    return heads + [(base + 36, 6, CTA_PROTO_SRC_PORT), (base + 44, 6, CTA_PROTO_DST_PORT)]


_PORTS_HEADS = _tuple_heads(0, CTA_TUPLE_ORIG, False) + _tuple_heads(52, CTA_TUPLE_REPLY, False)
_PORTS_LEN, _PORTS_MASK, _PORTS_WANT = _layout(*_PORTS_HEADS)
_PORTS_LEN += 4  # the last header's value: 2 bytes of port, 2 of padding
_PORTS_FIELDS = struct.Struct("!12x4s4x4s8xB7xH6xH2x" "12x4s24xH10x")  # src dst proto sport dport, reply src sport
_ICMP_HEADS = _tuple_heads(0, CTA_TUPLE_ORIG, True) + _tuple_heads(60, CTA_TUPLE_REPLY, True)
_ICMP_LEN, _ICMP_MASK, _ICMP_WANT = _layout(*_ICMP_HEADS)
_ICMP_LEN += 4  # the code: 1 byte, 3 of padding
_ICMP_FIELDS = struct.Struct("!12x4s4x4s8xB15xB7xB3x" "12x4s32xB11x")  # src dst proto type code, reply src type
_END = _PORTS_LEN  # a DESTROY's attributes after the tuples: ID, status, timeout, counters, timestamps
_LIFETIME_LEN, _LIFETIME_MASK, _LIFETIME_WANT = _layout(
    *_PORTS_HEADS, (_END, 8, CTA_ID), (_END + 8, 8, CTA_STATUS), (_END + 16, 8, 7),  # CTA_TIMEOUT
    (_END + 24, 28, CTA_COUNTERS_ORIG | nl.NLA_F_NESTED), (_END + 52, 28, CTA_COUNTERS_REPLY | nl.NLA_F_NESTED),
    (_END + 80, 28, CTA_TIMESTAMP | nl.NLA_F_NESTED), (_END + 84, 12, CTA_TIMESTAMP_START),
    (_END + 96, 12, CTA_TIMESTAMP_STOP))
_LIFETIME_LEN += 8
_LIFETIME_FIELDS = struct.Struct(f"!{_END + 88}xQ4xQ")
assert _PORTS_FIELDS.size == _PORTS_LEN and _ICMP_FIELDS.size == _ICMP_LEN and _LIFETIME_FIELDS.size == _LIFETIME_LEN

# The flow recorder's per-event loop in C (agentd/kernel/_ctevents.c: a read of the socket and
# its events in one call), given these layouts; None where it is not built (the recorder's
# Python loop does the same then).
try:
    from agentd.kernel import _ctevents as fast_events
except ImportError:  # not built: scripts/dev setup and pip install build it
    fast_events = None
else:
    fast_events.configure(*(v.to_bytes(n, "little") for n, m, w in (
        (_PORTS_LEN, _PORTS_MASK, _PORTS_WANT), (_ICMP_LEN, _ICMP_MASK, _ICMP_WANT),
        (_LIFETIME_LEN, _LIFETIME_MASK, _LIFETIME_WANT)) for v in (m, w)))


class CtBrief(NamedTuple):
    """Who an IPv4 event is about, read without walking its attributes: addresses as the
    4 bytes of the packet, ports (ICMP: type and code) as numbers.  ``reply_src`` is where the
    replies come from: the endpoint a Service's connection was translated to."""

    destroyed: bool
    src: bytes
    dst: bytes
    proto: int
    sport: int
    dport: int
    reply_src: bytes
    reply_sport: int


def ipv4_tuples(mtype: int, buf: bytes, start: int, end: int) -> tuple[bytes, bytes, int, int, int, bytes, int] | None:
    """:func:`brief`'s fields but ``destroyed``, as a plain tuple (for a reader of many events)."""
    if (mtype != MSG_NEW and mtype != MSG_DELETE) or end > len(buf) or end - start < nl.NFGENMSG_LEN or \
            buf[start] != socket.AF_INET:
        return None
    pos = start + nl.NFGENMSG_LEN
    if end - pos >= _PORTS_LEN and int.from_bytes(buf[pos:pos + _PORTS_LEN], "little") & _PORTS_MASK == _PORTS_WANT:
        return _PORTS_FIELDS.unpack_from(buf, pos)  # type: ignore[return-value]
    if end - pos >= _ICMP_LEN and int.from_bytes(buf[pos:pos + _ICMP_LEN], "little") & _ICMP_MASK == _ICMP_WANT:
        return _ICMP_FIELDS.unpack_from(buf, pos)  # type: ignore[return-value]
    return None


_H = struct.Struct("=HH")
# rest_ok's sizes (nla_len, the header's 4 bytes and the value) by level and type; nested: the
# level of what is inside.  Level 0: the event's own attributes after its tuples.
_REST_SIZES = {0: {CTA_STATUS: 8, CTA_ID: 8, CTA_TIMEOUT: 8, CTA_TIMESTAMP_EVENT: 12},
               1: {CTA_COUNTERS_PACKETS: 12, CTA_COUNTERS_BYTES: 12},
               2: {CTA_TIMESTAMP_START: 12, CTA_TIMESTAMP_STOP: 12},
               3: {}, 4: {CTA_PROTOINFO_TCP_STATE: 5}}
_REST_NESTED = {0: {CTA_COUNTERS_ORIG: 1, CTA_COUNTERS_REPLY: 1, CTA_TIMESTAMP: 2, CTA_PROTOINFO: 3},
                1: {}, 2: {}, 3: {CTA_PROTOINFO_TCP: 4}, 4: {}}


def rest_ok(buf: bytes, pos: int, end: int, level: int = 0) -> bool:
    """Whether the attributes of an event read at fixed offsets after its tuples (``pos``) are
    framed and sized as :func:`decode_event` reads them (agentd/kernel/_ctevents.c, rest_ok,
    does the same): an event that is not is malformed, read (and counted) the long way."""
    sizes, nested = _REST_SIZES[level], _REST_NESTED[level]
    while end - pos >= 4:
        alen, atype = _H.unpack_from(buf, pos)
        atype &= nl.NLA_TYPE_MASK
        if alen < 4 or pos + alen > end:
            return False
        if level == 0 and atype in (CTA_TUPLE_ORIG, CTA_TUPLE_REPLY):
            return False
        if level == 0 and atype == CTA_TIMESTAMP_PAD and alen == 4:  # a pad, as decode_event reads it
            pos += 4
            continue
        want = sizes.get(atype)
        if want is not None and alen != want:
            return False
        inner = nested.get(atype)
        if inner is not None and not rest_ok(buf, pos + 4, pos + alen, inner):
            return False
        pos += (alen + 3) & ~3
    return True


def brief(mtype: int, buf: bytes, start: int, end: int) -> CtBrief | None:
    """The tuples of an IPv4 ctnetlink event laid out as the kernel lays them out; None for
    anything else (IPv6, a zone in a tuple, another protocol's fields): :func:`decode_event`
    reads those."""
    fields = ipv4_tuples(mtype, buf, start, end)
    return None if fields is None else CtBrief(mtype == MSG_DELETE, *fields)


# ------------------------------------------------------------------ the listener's filter

# Classic BPF (SO_ATTACH_FILTER), as conntrackd's and libnetfilter_conntrack's event filters
# are: the kernel runs it on each event before queueing it for the socket.
_LD_W_ABS, _LD_B_ABS, _LD_W_IND = 0x20, 0x30, 0x40
_TAX, _AND_K, _JEQ_K, _RET_K = 0x07, 0x54, 0x15, 0x06
_NLMSG_BODY = nl.NLMSG_HDRLEN  # where nfgenmsg starts
_NESTED = nl.NLA_F_NESTED


def _host_word(hi16: int, lo16: int, byteorder: str) -> int:
    """An attribute header (length, type: host order) as classic BPF loads it (big-endian)."""
    return int.from_bytes(hi16.to_bytes(2, byteorder) + lo16.to_bytes(2, byteorder), "big")


def event_filter(prefixes: list[tuple[int, int]], byteorder: str = sys.byteorder,
                 own: Sequence[int] = ()) -> list[tuple[int, int, int, int]]:
    """A classic BPF program (``(code, jt, jf, k)`` instructions) for a socket joined to the
    conntrack event groups: it passes an IPv4 event only when its original source or
    destination, or its reply's source, is in one of ``prefixes`` ((network, mask) as
    integers) and is none of ``own`` (the node's own addresses inside them, as integers: its
    bridge's, the pods' gateway, and its subnet's broadcast address -- no pod's); every event
    laid out otherwise (IPv6, unexpected attributes) passes, for :func:`decode_event` to read.
    So the connections of the node itself (etcd, BGP, the host's own; its bridge's IGMP
    reports, multicast and broadcast) cost the listener nothing."""
    b = _NLMSG_BODY + nl.NFGENMSG_LEN  # the original tuple's attribute
    ip_head = _host_word(20, CTA_TUPLE_IP | _NESTED, byteorder)
    src_head = _host_word(8, CTA_IP_V4_SRC, byteorder)
    dst_head = _host_word(8, CTA_IP_V4_DST, byteorder)
    len_lo, len_hi = (b, b + 1) if byteorder == "little" else (b + 1, b)
    prog: list[tuple[str, int, object, object, int]] = []  # (label, code, jt, jf, k): jumps by label

    def op(code: int, k: int = 0, jt: object = 0, jf: object = 0, label: str = "") -> None:
        prog.append((label, code, jt, jf, k))

    def in_prefixes(load: int, offset: int, then: str, label: str = "") -> None:
        """Accept if the address at ``offset`` is in a prefix and none of ``own``, else go on
        at ``then`` (``label``: this check's first instruction)."""
        for net, mask in prefixes:
            op(load, offset, label=label)
            label = ""
            op(_AND_K, mask)
            if not own:
                op(_JEQ_K, net, "accept", 0)
                continue
            op(_JEQ_K, net, 0, 1 + len(own))  # in it: the node's own, or a pod's
            op(load, offset)
            for i, address in enumerate(own):
                op(_JEQ_K, address, then, "accept" if i == len(own) - 1 else 0)

    op(_LD_B_ABS, _NLMSG_BODY)  # nfgen_family
    op(_JEQ_K, socket.AF_INET, 0, "accept")
    for offset, want in ((b + 4, ip_head), (b + 8, src_head), (b + 16, dst_head)):
        op(_LD_W_ABS, offset)
        op(_JEQ_K, want, 0, "accept")
    in_prefixes(_LD_W_ABS, b + 12, "dst")  # original source
    in_prefixes(_LD_W_ABS, b + 20, "reply", label="dst")  # original destination
    op(_LD_B_ABS, len_hi, label="reply")  # the original tuple's length (< 256 as the kernel writes it)
    op(_JEQ_K, 0, 0, "accept")
    op(_LD_B_ABS, len_lo)
    op(_TAX)
    for offset, want in ((b + 4, ip_head), (b + 8, src_head)):
        op(_LD_W_IND, offset)
        op(_JEQ_K, want, 0, "accept")
    in_prefixes(_LD_W_IND, b + 12, "drop")  # the reply's source
    op(_RET_K, 0, label="drop")
    op(_RET_K, 0xFFFFFFFF, label="accept")
    where = {label: i for i, (label, *_rest) in enumerate(prog) if label}
    out = []
    for i, (_label, code, jt, jf, k) in enumerate(prog):
        jumps = [where[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf)]
        out.append((code, jumps[0], jumps[1], k))
    return out
