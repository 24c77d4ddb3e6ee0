"""nfnetlink_log (NFLOG), the packet-logging half of nfnetlink: the codec, pure.

An nftables ``log group N prefix "..."`` statement hands a copy of the packet it sees to the
nfnetlink_log instance of group N in its network namespace; a process that has bound the
group (NFULNL_CFG_CMD_BIND) receives it as an NFULNL_MSG_PACKET, unicast to its socket.  The
agent's drop records (``agentd.flows``) come from here: each drop rule logs with a prefix
that says which rule it is.

The messages (include/uapi/linux/netfilter/nfnetlink_log.h), framed with the one netlink
codec (:mod:`agentd.kernel.netlink`)::

    nlmsghdr.type = NFNL_SUBSYS_ULOG << 8 | NFULNL_MSG_CONFIG / NFULNL_MSG_PACKET
    struct nfgenmsg { u8 family; u8 version; __be16 res_id = the group }
    config: NFULA_CFG_CMD { u8 command }, NFULA_CFG_MODE { __be32 copy_range; u8 copy_mode; u8 pad },
            NFULA_CFG_TIMEOUT __be32 (1/100 s), NFULA_CFG_QTHRESH __be32, NFULA_CFG_NLBUFSIZ __be32,
            NFULA_CFG_FLAGS __be16
    packet: NFULA_PACKET_HDR { __be16 hw_protocol; u8 hook; u8 pad }, NFULA_PREFIX (string),
            NFULA_IFINDEX_INDEV / OUTDEV __be32, NFULA_TIMESTAMP { __be64 sec; __be64 usec },
            NFULA_SEQ __be32 (with NFULNL_CFG_F_SEQ), NFULA_PAYLOAD (the packet from its
            network header, up to copy_range bytes)

The kernel queues packets per instance and sends them when ``qthresh`` are queued or
``timeout`` passed, many to a datagram: the agent sets both (a drop must show within a
second, a drop storm must not cost a datagram per packet).
"""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple

from agentd.kernel import netlink as nl

NFNL_SUBSYS_ULOG = 4
NFULNL_MSG_PACKET = 0
NFULNL_MSG_CONFIG = 1
MSG_PACKET = NFNL_SUBSYS_ULOG << 8 | NFULNL_MSG_PACKET
MSG_CONFIG = NFNL_SUBSYS_ULOG << 8 | NFULNL_MSG_CONFIG

NFULA_CFG_CMD = 1
NFULA_CFG_MODE = 2
NFULA_CFG_NLBUFSIZ = 3
NFULA_CFG_TIMEOUT = 4
NFULA_CFG_QTHRESH = 5
NFULA_CFG_FLAGS = 6
NFULNL_CFG_CMD_BIND = 1
NFULNL_CFG_CMD_UNBIND = 2
NFULNL_COPY_PACKET = 2
NFULNL_CFG_F_SEQ = 0x0001

NFULA_PACKET_HDR = 1
NFULA_TIMESTAMP = 3
NFULA_IFINDEX_INDEV = 4
NFULA_IFINDEX_OUTDEV = 5
NFULA_PAYLOAD = 9
NFULA_PREFIX = 10
NFULA_SEQ = 12

_BE16 = struct.Struct("!H")
_BE32 = struct.Struct("!I")
_MODE = struct.Struct("!IBx")
_TIMESTAMP = struct.Struct("!QQ")
_PORTS = struct.Struct("!HH")


def _config(group: int, seq: int, body: bytes, family: int = nl.AF_UNSPEC) -> bytes:
    return nl.encode_nfgen(MSG_CONFIG, nl.NLM_F_REQUEST, seq, family, body, res_id=group)


def encode_bind(group: int, seq: int) -> bytes:
    """Bind this socket to ``group`` (EBUSY: another socket has it)."""
    return _config(group, seq, nl.attr(NFULA_CFG_CMD, bytes([NFULNL_CFG_CMD_BIND])))


def encode_unbind(group: int, seq: int) -> bytes:
    return _config(group, seq, nl.attr(NFULA_CFG_CMD, bytes([NFULNL_CFG_CMD_UNBIND])))


def encode_settings(group: int, seq: int, *, copy_range: int, timeout_cs: int, qthresh: int,
                    bufsize: int = 0) -> bytes:
    """Copy ``copy_range`` bytes of each packet, send when ``qthresh`` packets are queued or
    ``timeout_cs`` hundredths of a second passed, number the packets (NFULA_SEQ: lost ones
    show as gaps)."""
    body = (nl.attr(NFULA_CFG_MODE, _MODE.pack(copy_range, NFULNL_COPY_PACKET))
            + nl.attr(NFULA_CFG_TIMEOUT, _BE32.pack(timeout_cs))
            + nl.attr(NFULA_CFG_QTHRESH, _BE32.pack(qthresh))
            + nl.attr(NFULA_CFG_FLAGS, _BE16.pack(NFULNL_CFG_F_SEQ) + b"\0\0"))
    if bufsize:
        body += nl.attr(NFULA_CFG_NLBUFSIZ, _BE32.pack(bufsize))
    return _config(group, seq, body)


class Packet(NamedTuple):
    """What the agent keeps of one logged packet: where and when, and its headers' summary."""

    prefix: str
    family: int  # nfgenmsg family: AF_INET, AF_INET6, AF_BRIDGE (7) ...
    time: float  # seconds since the epoch (0.0: the kernel sent no timestamp)
    indev: int
    outdev: int
    seq: int | None
    src: str
    dst: str
    proto: int
    sport: int  # ports, or ICMP type and code
    dport: int


def decode_packet(buf: bytes, start: int, end: int) -> Packet | None:
    """An NFULNL_MSG_PACKET body (nfgenmsg + attributes); None if its payload is no IPv4 or
    IPv6 packet the agent can read (too short, another protocol)."""
    if end > len(buf) or end - start < nl.NFGENMSG_LEN:
        raise nl.NetlinkDecodeError(f"log message body is {end - start} bytes, nfgenmsg needs {nl.NFGENMSG_LEN}")
    family = buf[start]
    prefix = ""
    when = 0.0
    indev = outdev = 0
    seq = None
    payload = None
    for atype, vs, ve in nl.iter_attrs(buf, start + nl.NFGENMSG_LEN, end):
        if atype == NFULA_PREFIX:
            prefix = nl.read_string(buf, vs, ve)
        elif atype == NFULA_PAYLOAD:
            payload = (vs, ve)
        elif atype == NFULA_IFINDEX_INDEV:
            indev = _be32(buf, vs, ve, "NFULA_IFINDEX_INDEV")
        elif atype == NFULA_IFINDEX_OUTDEV:
            outdev = _be32(buf, vs, ve, "NFULA_IFINDEX_OUTDEV")
        elif atype == NFULA_SEQ:
            seq = _be32(buf, vs, ve, "NFULA_SEQ")
        elif atype == NFULA_TIMESTAMP:
            if ve - vs != _TIMESTAMP.size:
                raise nl.NetlinkDecodeError(f"NFULA_TIMESTAMP must be {_TIMESTAMP.size} bytes, got {ve - vs}")
            sec, usec = _TIMESTAMP.unpack_from(buf, vs)
            when = sec + usec / 1e6
    if payload is None:
        return None
    headers = ip_summary(buf, *payload)
    if headers is None:
        return None
    return Packet(prefix, family, when, indev, outdev, seq, *headers)


def _be32(buf: bytes, start: int, end: int, what: str) -> int:
    if end - start != 4:
        raise nl.NetlinkDecodeError(f"{what} must be 4 bytes, got {end - start}")
    return _BE32.unpack_from(buf, start)[0]


_L4_PORTS = (socket.IPPROTO_TCP, socket.IPPROTO_UDP, 132)  # 132: SCTP
_ICMP = (socket.IPPROTO_ICMP, socket.IPPROTO_ICMPV6)


def ip_summary(buf: bytes, start: int, end: int) -> tuple[str, str, int, int, int] | None:
    """(source, destination, protocol, source port or ICMP type, destination port or ICMP code)
    of the IP packet in ``buf[start:end]``; None if it is not one (or too short to say)."""
    n = end - start
    if n < 1:
        return None
    version = buf[start] >> 4
    if version == 4:
        if n < 20:
            return None
        ihl = (buf[start] & 0x0F) * 4
        proto = buf[start + 9]
        src = socket.inet_ntop(socket.AF_INET, bytes(buf[start + 12:start + 16]))
        dst = socket.inet_ntop(socket.AF_INET, bytes(buf[start + 16:start + 20]))
        fragment_offset = _BE16.unpack_from(buf, start + 6)[0] & 0x1FFF
        l4 = start + ihl if ihl >= 20 and not fragment_offset else end  # a later fragment has no ports
    elif version == 6:
        if n < 40:
            return None
        proto = buf[start + 6]  # extension headers are not walked: their protocol is what is shown
        src = socket.inet_ntop(socket.AF_INET6, bytes(buf[start + 8:start + 24]))
        dst = socket.inet_ntop(socket.AF_INET6, bytes(buf[start + 24:start + 40]))
        l4 = start + 40
    else:
        return None
    sport = dport = 0
    if end - l4 >= 4 and proto in _L4_PORTS:
        sport, dport = _PORTS.unpack_from(buf, l4)
    elif end - l4 >= 2 and proto in _ICMP:
        sport, dport = buf[l4], buf[l4 + 1]
    return src, dst, proto, sport, dport
