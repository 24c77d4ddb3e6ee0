"""ctnetlink, the conntrack half of nfnetlink (NETLINK_NETFILTER): the codec, pure.

What the agent says to conntrack and hears from it, framed with the one netlink codec
(:mod:`agentd.kernel.netlink`: header, attribute packer and parser): dumps and deletes of
entries (Services' stale UDP flows, ``agentd.services.conntrack``) and the events conntrack
multicasts when an entry is confirmed (NEW) and when it goes (DESTROY), which are the
connection records of flow visibility (``agentd.flows``).

The messages (include/uapi/linux/netfilter/nfnetlink.h, nfnetlink_conntrack.h)::

    nlmsghdr.type = NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW (dump answers, events) / _GET / _DELETE
    struct nfgenmsg { u8 nfgen_family; u8 version; __be16 res_id; }          4 bytes
    CTA_TUPLE_ORIG / CTA_TUPLE_REPLY (nested) {
        CTA_TUPLE_IP (nested) { CTA_IP_V4_SRC/DST in_addr | CTA_IP_V6_SRC/DST in6_addr },
        CTA_TUPLE_PROTO (nested) { CTA_PROTO_NUM u8, CTA_PROTO_SRC_PORT / DST_PORT __be16,
                                   CTA_PROTO_ICMP_TYPE / CODE u8 (ICMP, ICMPv6) } }
    CTA_STATUS __be32 (IPS_* bits), CTA_ID __be32,
    CTA_COUNTERS_ORIG / REPLY (nested) { CTA_COUNTERS_PACKETS __be64, CTA_COUNTERS_BYTES __be64 }
        (only with net.netfilter.nf_conntrack_acct = 1 when the entry was made)
    CTA_TIMESTAMP (nested) { CTA_TIMESTAMP_START __be64 ns, CTA_TIMESTAMP_STOP __be64 ns }
        (only with net.netfilter.nf_conntrack_timestamp = 1 when the entry was made)

An event is the same message as a dump answer: type IPCTNL_MSG_CT_NEW with NLM_F_CREATE (a new
entry) or IPCTNL_MSG_CT_DELETE (an entry destroyed), sent to the multicast groups
NFNLGRP_CONNTRACK_NEW / _DESTROY a listener joins (NETLINK_ADD_MEMBERSHIP).  Addresses are
text (``str``), so IPv4 and IPv6 entries are the same values.
"""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple

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
CTA_ID = 12
CTA_COUNTERS_ORIG = 9
CTA_COUNTERS_REPLY = 10
CTA_TIMESTAMP = 20
CTA_TUPLE_IP = 1  # inside a CTA_TUPLE_*
CTA_TUPLE_PROTO = 2
CTA_IP_V4_SRC = 1  # inside CTA_TUPLE_IP
CTA_IP_V4_DST = 2
CTA_IP_V6_SRC = 3
CTA_IP_V6_DST = 4
CTA_PROTO_NUM = 1  # inside CTA_TUPLE_PROTO
CTA_PROTO_SRC_PORT = 2
CTA_PROTO_DST_PORT = 3
CTA_PROTO_ICMP_TYPE = 5
CTA_PROTO_ICMP_CODE = 6
CTA_PROTO_ICMPV6_TYPE = 8
CTA_PROTO_ICMPV6_CODE = 9
CTA_COUNTERS_PACKETS = 1  # inside CTA_COUNTERS_*
CTA_COUNTERS_BYTES = 2
CTA_TIMESTAMP_START = 1  # inside CTA_TIMESTAMP
CTA_TIMESTAMP_STOP = 2

IPS_SRC_NAT = 1 << 4
IPS_DST_NAT = 1 << 5
IPS_CONFIRMED = 1 << 3

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
    orig_packets: int = 0
    orig_bytes: int = 0
    reply_packets: int = 0
    reply_bytes: int = 0
    start_ns: int = 0  # CLOCK_REALTIME nanoseconds (nf_conntrack_timestamp), 0: not kept
    stop_ns: int = 0

    @property
    def nat(self) -> bool:
        return bool(self.status & (IPS_SRC_NAT | IPS_DST_NAT))


def message(mtype: int, seq: int, flags: int, body: bytes, family: int = nl.AF_INET) -> bytes:
    return nl.encode_nfgen(NFNL_SUBSYS_CTNETLINK << 8 | mtype, flags, seq, family, body)


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
    status = ident = op = ob = rp = rb = t0 = t1 = 0
    for atype, vs, ve in nl.iter_attrs(buf, start + nl.NFGENMSG_LEN, end):
        if atype == CTA_TUPLE_ORIG:
            orig = decode_tuple(buf, vs, ve)
        elif atype == CTA_TUPLE_REPLY:
            reply = decode_tuple(buf, vs, ve)
        elif atype == CTA_STATUS:
            status = _read_be(buf, vs, ve, _BE32, "CTA_STATUS")
        elif atype == CTA_ID:
            ident = _read_be(buf, vs, ve, _BE32, "CTA_ID")
        elif atype == CTA_COUNTERS_ORIG:
            op, ob = _counters(buf, vs, ve)
        elif atype == CTA_COUNTERS_REPLY:
            rp, rb = _counters(buf, vs, ve)
        elif atype == CTA_TIMESTAMP:
            for ttype, ts, te in nl.iter_attrs(buf, vs, ve):
                if ttype == CTA_TIMESTAMP_START:
                    t0 = _read_be(buf, ts, te, _BE64, "CTA_TIMESTAMP_START")
                elif ttype == CTA_TIMESTAMP_STOP:
                    t1 = _read_be(buf, ts, te, _BE64, "CTA_TIMESTAMP_STOP")
    if orig is None or reply is None:
        return None
    return CtEvent(mtype == MSG_DELETE, family, orig, reply, status, ident, op, ob, rp, rb, t0, t1)
