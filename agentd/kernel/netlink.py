"""A small, fast rtnetlink codec, pure (bytes in, typed values out): routes, links,
neighbours and FDB entries, the attribute packer/parser, error acks and the nfnetlink
header (NETLINK_NETFILTER: nf_tables in ``agentd.nft.nfnetlink``, ctnetlink in
``netlink_ct`` and nfnetlink_log in ``netlink_log``, all framed here) -- the core of the
agent's one netlink stack.  Beside it: ``netlink_socket`` (the socket: batches, dumps, one request at a time),
``netlink_links`` (device set-up: VXLAN, MTU/up, addresses), ``netlink_tc`` (clsact,
cls_bpf) and ``rtnl`` (a blocking session for the rare requests).

Why not a netlink library (pyroute2): it builds a nested object per message and costs tens of
microseconds each, and importing it costs each agent ~0.2 s and ~10 MB; programming 100k
routes must cost a few microseconds each.  Here every message kind has one
encode function built from precompiled ``struct.Struct`` objects, and parsing checks every
length before it slices (malformed input raises :class:`NetlinkDecodeError`, nothing else).

Layout of every message (include/uapi/linux/netlink.h, rtnetlink.h)::

    struct nlmsghdr { u32 len; u16 type; u16 flags; u32 seq; u32 pid; }      16 bytes
    struct rtmsg    { u8 family, dst_len, src_len, tos, table, protocol,
                      scope, type; u32 flags; }                              12 bytes
    struct rtattr   { u16 len; u16 type; } + payload, padded to 4            TLVs

Batching (what makes this fast): the kernel runs every request of one ``send()`` in order,
synchronously, inside that syscall (``netlink_rcv_skb``).  A failing request gets an error
ack carrying its sequence number whether or not it asked for an ACK; the others go on.  So
a batch sends N requests without ``NLM_F_ACK`` and only the last with it: when that last
ack arrives, every error of the batch has arrived before it, each naming its request.
"""

from __future__ import annotations

import errno as _errno
import os
import socket
import struct
from dataclasses import dataclass
from typing import NamedTuple

# --- netlink.h -------------------------------------------------------------------------

NETLINK_ROUTE = 0
NETLINK_NETFILTER = 12  # nfnetlink: nf_tables, ctnetlink (agentd.nft.nfnetlink, agentd.services.conntrack, agentd.policy.conntrack)
NFNETLINK_V0 = 0  # nfgenmsg.version
SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP = 1
NETLINK_NO_ENOBUFS = 5
NETLINK_CAP_ACK = 10  # error acks carry only the request header, not the whole request
NETLINK_EXT_ACK = 11  # error acks carry the kernel's error message string
NETLINK_GET_STRICT_CHK = 12  # dump requests are validated and their filters honoured

NLMSG_NOOP = 1
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLMSG_OVERRUN = 4

NLM_F_REQUEST = 0x01
NLM_F_MULTI = 0x02
NLM_F_ACK = 0x04
NLM_F_ECHO = 0x08
NLM_F_DUMP_INTR = 0x10
NLM_F_DUMP_FILTERED = 0x20
NLM_F_ROOT = 0x100
NLM_F_MATCH = 0x200
NLM_F_DUMP = NLM_F_ROOT | NLM_F_MATCH
NLM_F_REPLACE = 0x100  # for NEW requests
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
NLM_F_APPEND = 0x800
NLM_F_CAPPED = 0x100  # in error acks
NLM_F_ACK_TLVS = 0x200

NLMSGERR_ATTR_MSG = 1
NLMSGERR_ATTR_OFFS = 2

NLA_F_NESTED = 0x8000  # the attribute holds attributes (include/uapi/linux/netlink.h)
NLA_TYPE_MASK = 0x3FFF  # strips NLA_F_NESTED / NLA_F_NET_BYTEORDER

# --- rtnetlink.h -----------------------------------------------------------------------

RTM_BASE = 16
RTM_NEWLINK = 16
RTM_DELLINK = 17
RTM_GETLINK = 18
RTM_NEWADDR = 20
RTM_DELADDR = 21
RTM_GETADDR = 22
RTM_NEWROUTE = 24
RTM_DELROUTE = 25
RTM_GETROUTE = 26
RTM_NEWNEIGH = 28
RTM_DELNEIGH = 29
RTM_GETNEIGH = 30

RTMGRP_LINK = 0x1
RTMGRP_NEIGH = 0x4
RTMGRP_IPV4_IFADDR = 0x10
RTMGRP_IPV4_ROUTE = 0x40
RTMGRP_IPV6_IFADDR = 0x100
RTMGRP_IPV6_ROUTE = 0x400

RT_TABLE_UNSPEC = 0
RT_TABLE_MAIN = 254
RT_TABLE_LOCAL = 255

RTPROT_UNSPEC = 0
RTPROT_KERNEL = 2
RTPROT_BOOT = 3
RTPROT_STATIC = 4
RTPROT_ZEBRA = 11
RTPROT_BIRD = 12

RT_SCOPE_UNIVERSE = 0
RT_SCOPE_LINK = 253
RT_SCOPE_HOST = 254
RT_SCOPE_NOWHERE = 255  # in a delete request: "any scope"

RTN_UNSPEC = 0
RTN_UNICAST = 1
RTN_LOCAL = 2
RTN_BROADCAST = 3
RTN_BLACKHOLE = 6
RTN_UNREACHABLE = 7
RTN_PROHIBIT = 8

RTNH_F_DEAD = 1
RTNH_F_ONLINK = 4
RTNH_F_LINKDOWN = 16

RTA_DST = 1
RTA_SRC = 2
RTA_IIF = 3
RTA_OIF = 4
RTA_GATEWAY = 5
RTA_PRIORITY = 6
RTA_PREFSRC = 7
RTA_METRICS = 8
RTA_MULTIPATH = 9
RTA_TABLE = 15
RTA_VIA = 18
RTA_NH_ID = 30
RTAX_MTU = 2  # inside RTA_METRICS

IFLA_ADDRESS = 1
IFLA_IFNAME = 3
IFLA_MTU = 4
IFLA_LINK = 5  # a veth's: the index of its other end (in the namespace IFLA_LINK_NETNSID names)
IFLA_MASTER = 10
IFLA_LINKINFO = 18
IFLA_INFO_KIND = 1  # inside IFLA_LINKINFO
IFLA_INFO_DATA = 2  # inside IFLA_LINKINFO: the kind's own attributes (agentd.kernel.netlink_links)
IFLA_LINK_NETNSID = 37  # s32: the namespace IFLA_LINK is in, where that is not the device's own
IFLA_TARGET_NETNSID = 46  # s32, in a request: answer for the namespace of this id (Linux 4.20)
IFF_UP = 0x1

NDA_DST = 1
NDA_LLADDR = 2
NDA_PORT = 6  # FDB entries of a VXLAN device: the remote's UDP port (network byte order) ...
NDA_VNI = 7  # ... and VNI, where they are not the device's own
NDA_MASTER = 9
NTF_SELF = 0x02
NTF_MASTER = 0x04
NUD_REACHABLE = 0x02
NUD_NOARP = 0x40
NUD_PERMANENT = 0x80

AF_UNSPEC = 0
AF_INET = socket.AF_INET
AF_INET6 = socket.AF_INET6
AF_BRIDGE = 7

SO_SNDBUFFORCE = 32
SO_RCVBUFFORCE = 33
SO_ATTACH_FILTER = 26

_ADDR_LEN = {AF_INET: 4, AF_INET6: 16}

_NLMSGHDR = struct.Struct("=IHHII")
_RTMSG = struct.Struct("=BBBBBBBBI")
_NLMSG_RTMSG = struct.Struct("=IHHIIBBBBBBBBI")  # nlmsghdr + rtmsg, packed in one call
_IFINFOMSG = struct.Struct("=BxHiII")
_NLMSG_IFINFOMSG = struct.Struct("=IHHIIBxHiII")
_NDMSG = struct.Struct("=BxxxiHBB")
_NLMSG_NDMSG = struct.Struct("=IHHIIBxxxiHBB")
_RTA = struct.Struct("=HH")
_RTA_U32 = struct.Struct("=HHI")
_U32 = struct.Struct("=I")
_I32 = struct.Struct("=i")
# nlmsghdr + struct nfgenmsg { u8 nfgen_family; u8 version; __be16 res_id; }, packed in one call
_NLMSG_NFGENMSG = struct.Struct("=IHHIIBBH")

NLMSG_HDRLEN = _NLMSGHDR.size
RTMSG_LEN = _RTMSG.size
IFINFOMSG_LEN = _IFINFOMSG.size
NDMSG_LEN = _NDMSG.size
NFGENMSG_LEN = 4

MESSAGE_NAMES = {
    NLMSG_ERROR: "NLMSG_ERROR", NLMSG_DONE: "NLMSG_DONE",
    RTM_NEWLINK: "RTM_NEWLINK", RTM_DELLINK: "RTM_DELLINK", RTM_GETLINK: "RTM_GETLINK",
    RTM_NEWADDR: "RTM_NEWADDR", RTM_DELADDR: "RTM_DELADDR",
    RTM_NEWROUTE: "RTM_NEWROUTE", RTM_DELROUTE: "RTM_DELROUTE", RTM_GETROUTE: "RTM_GETROUTE",
    RTM_NEWNEIGH: "RTM_NEWNEIGH", RTM_DELNEIGH: "RTM_DELNEIGH", RTM_GETNEIGH: "RTM_GETNEIGH",
}


class NetlinkDecodeError(ValueError):
    """Malformed netlink input: a length that does not fit, a wrong-sized attribute."""


class NetlinkError(OSError):
    """The kernel refused a request: ``errno`` and, with extended acks, its own message."""

    def __init__(self, errno: int, message: str | None = None, what: str = "netlink request") -> None:
        text = f"{what}: {_errno.errorcode.get(errno, str(errno))} ({os.strerror(errno)})"
        if message:
            text += f": {message}"
        super().__init__(errno, text)
        self.kernel_message = message

    def __str__(self) -> str:
        return self.strerror  # one line: "what: EEXIST (File exists): kernel message"


def describe_error(errno: int, message: str | None = None) -> str:
    """``"ENETUNREACH: Network is unreachable (Nexthop has invalid gateway)"``"""
    text = f"{_errno.errorcode.get(errno, str(errno))}: {os.strerror(errno)}"
    return f"{text} ({message})" if message else text


# --- generic framing --------------------------------------------------------------------


def attr(atype: int, value: bytes) -> bytes:
    """One rtattr, padded to 4 bytes."""
    length = 4 + len(value)
    return _RTA.pack(length, atype) + value + b"\0" * (-length & 3)


def attr_u32(atype: int, value: int) -> bytes:
    return _RTA_U32.pack(8, atype, value)


def nested(atype: int, *parts: bytes) -> bytes:
    """One attribute (NLA_F_NESTED) holding the attributes ``parts``."""
    return attr(atype | NLA_F_NESTED, b"".join(parts))


def iter_messages(buf: bytes, length: int | None = None):
    """Yield ``(type, flags, seq, pid, payload_start, payload_end)`` for each message in ``buf``."""
    end = len(buf) if length is None else length
    if end > len(buf):
        raise NetlinkDecodeError(f"length {end} exceeds buffer of {len(buf)} bytes")
    pos = 0
    unpack = _NLMSGHDR.unpack_from
    while pos < end:
        if end - pos < NLMSG_HDRLEN:
            raise NetlinkDecodeError(f"truncated netlink header: {end - pos} bytes at offset {pos}")
        mlen, mtype, mflags, seq, pid = unpack(buf, pos)
        if mlen < NLMSG_HDRLEN or pos + mlen > end:
            raise NetlinkDecodeError(f"netlink message length {mlen} at offset {pos} does not fit {end} bytes")
        yield mtype, mflags, seq, pid, pos + NLMSG_HDRLEN, pos + mlen
        pos += (mlen + 3) & ~3


def iter_attrs(buf: bytes, start: int, end: int):
    """Yield ``(type, value_start, value_end)`` for each rtattr in ``buf[start:end]``."""
    pos = start
    while end - pos >= 4:
        alen, atype = _RTA.unpack_from(buf, pos)
        if alen < 4 or pos + alen > end:
            raise NetlinkDecodeError(f"attribute length {alen} (type {atype}) at offset {pos} does not fit")
        yield atype & NLA_TYPE_MASK, pos + 4, pos + alen
        pos += (alen + 3) & ~3


def read_u32(buf: bytes, start: int, end: int, what: str) -> int:
    if end - start != 4:
        raise NetlinkDecodeError(f"{what} must be 4 bytes, got {end - start}")
    return _U32.unpack_from(buf, start)[0]


def read_address(buf: bytes, start: int, end: int, family: int, what: str) -> bytes:
    want = _ADDR_LEN.get(family)
    if want is not None and end - start != want:
        raise NetlinkDecodeError(f"{what} is {end - start} bytes, family {family} needs {want}")
    return bytes(buf[start:end])


def read_string(buf: bytes, start: int, end: int) -> str:
    return bytes(buf[start:end]).split(b"\0", 1)[0].decode("utf-8", "replace")


def decode_error(buf: bytes, start: int, end: int, flags: int = 0) -> tuple[int, str | None]:
    """Body of an NLMSG_ERROR: ``(errno, kernel message or None)``; errno 0 is a plain ACK."""
    if end - start < 4 + NLMSG_HDRLEN:
        raise NetlinkDecodeError(f"NLMSG_ERROR body is {end - start} bytes, needs {4 + NLMSG_HDRLEN}")
    error = -_I32.unpack_from(buf, start)[0]
    message = None
    if flags & NLM_F_ACK_TLVS:
        # The TLVs follow the echoed request: only its header when capped, else all of it.
        echoed = NLMSG_HDRLEN if flags & NLM_F_CAPPED else _U32.unpack_from(buf, start + 4)[0]
        tlv_start = start + 4 + ((echoed + 3) & ~3)
        if tlv_start <= end:
            for atype, vs, ve in iter_attrs(buf, tlv_start, end):
                if atype == NLMSGERR_ATTR_MSG:
                    message = read_string(buf, vs, ve)
    return error, message


_U16 = struct.Struct("=H")


def with_flags(message: bytes, extra: int) -> bytes:
    """The same message with ``extra`` ORed into its nlmsg_flags (e.g. NLM_F_ACK on the
    last request of a batch)."""
    if len(message) < NLMSG_HDRLEN:
        raise NetlinkDecodeError(f"not a netlink message: {len(message)} bytes")
    return message[:6] + _U16.pack(_U16.unpack_from(message, 6)[0] | extra) + message[8:]


# --- nfnetlink (NETLINK_NETFILTER): nf_tables, ctnetlink --------------------------------


def encode_nfgen(msg_type: int, flags: int, seq: int, family: int, body: bytes = b"", res_id: int = 0) -> bytes:
    """One nfnetlink message (include/uapi/linux/netfilter/nfnetlink.h): nlmsghdr, nfgenmsg
    (``res_id`` big-endian: the subsystem of a batch begin/end, else 0), then ``body``.
    ``msg_type`` is ``subsystem << 8 | message``."""
    return _NLMSG_NFGENMSG.pack(
        NLMSG_HDRLEN + NFGENMSG_LEN + len(body), msg_type, flags, seq, 0, family, NFNETLINK_V0, socket.htons(res_id)
    ) + body


# --- routes -------------------------------------------------------------------------------


class RouteMessage(NamedTuple):
    """An RTM_NEWROUTE / RTM_DELROUTE as the kernel says it; addresses are raw bytes.

    A NamedTuple rather than a dataclass because a 100k-route dump builds 100k of them and
    tuple construction is several times cheaper; it is just as immutable."""

    family: int
    dst_len: int
    table: int
    protocol: int
    scope: int
    type: int
    flags: int = 0
    tos: int = 0
    src_len: int = 0
    dst: bytes = b""  # empty: the default route (0.0.0.0/0, ::/0)
    gateway: bytes | None = None
    oif: int = 0
    priority: int | None = None
    prefsrc: bytes | None = None
    mtu: int | None = None
    multipath: bytes | None = None  # raw RTA_MULTIPATH, not interpreted here
    via: bytes | None = None  # raw RTA_VIA (IPv4 route through an IPv6 next hop)
    nh_id: int | None = None  # nexthop object id (RTA_NH_ID)
    src: bytes | None = None  # RTA_SRC: the source prefix of an IPv6 source-specific route (src_len > 0)


class RouteTemplate(NamedTuple):
    """Everything of a route request except its destination: the rtmsg fields and the
    encoded attributes that follow RTA_DST.  Routes through the same next hop share one,
    so encoding 100k of them is one ``pack`` and two concatenations each."""

    family: int
    table: int
    protocol: int
    scope: int
    type: int
    flags: int
    tos: int
    attributes: bytes


def route_template(
    family: int,
    *,
    table: int = RT_TABLE_MAIN,
    protocol: int = RTPROT_STATIC,
    scope: int = RT_SCOPE_UNIVERSE,
    rtype: int = RTN_UNICAST,
    rtm_flags: int = 0,
    tos: int = 0,
    gateway: bytes | None = None,
    oif: int = 0,
    priority: int | None = None,
    prefsrc: bytes | None = None,
    mtu: int | None = None,
    src: bytes | None = None,
) -> RouteTemplate:
    parts = []
    if src is not None:
        parts.append(attr(RTA_SRC, src))
    if gateway is not None:
        parts.append(attr(RTA_GATEWAY, gateway))
    if oif:
        parts.append(attr_u32(RTA_OIF, oif))
    if priority is not None:
        parts.append(attr_u32(RTA_PRIORITY, priority))
    if prefsrc is not None:
        parts.append(attr(RTA_PREFSRC, prefsrc))
    if mtu is not None:
        parts.append(attr(RTA_METRICS, attr_u32(RTAX_MTU, mtu)))
    # Tables above 255 only fit RTA_TABLE; iproute2 then puts RT_TABLE_UNSPEC in the header.
    parts.append(attr_u32(RTA_TABLE, table))
    return RouteTemplate(family, table if table < 256 else RT_TABLE_UNSPEC, protocol, scope, rtype, rtm_flags,
                         tos, b"".join(parts))


_NLMSG_RTMSG_DST = struct.Struct("=IHHIIBBBBBBBBIHH")  # nlmsghdr + rtmsg + RTA_DST header


def encode_route(msg_type: int, seq: int, flags: int, dst: bytes, dst_len: int, template: RouteTemplate,
                 src_len: int = 0) -> bytes:
    """One RTM_NEWROUTE / RTM_DELROUTE / RTM_GETROUTE request: ``dst`` (raw address bytes,
    ignored when ``dst_len`` is 0) plus everything in ``template``; ``src_len`` is rtm_src_len
    (the template then carries RTA_SRC)."""
    family, table, protocol, scope, rtype, rtm_flags, tos, attributes = template
    if dst_len:
        n = len(dst)
        return _NLMSG_RTMSG_DST.pack(
            32 + n + len(attributes), msg_type, flags, seq, 0,
            family, dst_len, src_len, tos, table, protocol, scope, rtype, rtm_flags, 4 + n, RTA_DST,
        ) + dst + attributes
    return _NLMSG_RTMSG.pack(
        28 + len(attributes), msg_type, flags, seq, 0,
        family, 0, src_len, tos, table, protocol, scope, rtype, rtm_flags,
    ) + attributes


def encode_newroute(
    seq: int,
    flags: int,
    family: int,
    dst: bytes,
    dst_len: int,
    *,
    table: int = RT_TABLE_MAIN,
    protocol: int = RTPROT_STATIC,
    scope: int = RT_SCOPE_UNIVERSE,
    rtype: int = RTN_UNICAST,
    rtm_flags: int = 0,
    tos: int = 0,
    gateway: bytes | None = None,
    oif: int = 0,
    priority: int | None = None,
    prefsrc: bytes | None = None,
    mtu: int | None = None,
) -> bytes:
    """RTM_NEWROUTE.  ``flags``: NLM_F_REQUEST plus CREATE|EXCL (add) or REPLACE (change)."""
    template = route_template(
        family, table=table, protocol=protocol, scope=scope, rtype=rtype, rtm_flags=rtm_flags, tos=tos,
        gateway=gateway, oif=oif, priority=priority, prefsrc=prefsrc, mtu=mtu,
    )
    return encode_route(RTM_NEWROUTE, seq, flags, dst, dst_len, template)


def delroute_template(family: int, *, table: int = RT_TABLE_MAIN, protocol: int = RTPROT_UNSPEC,
                      tos: int = 0, priority: int | None = None, src: bytes | None = None,
                      gateway: bytes | None = None, oif: int = 0) -> RouteTemplate:
    """What an RTM_DELROUTE names besides the destination.  A non-zero ``protocol`` makes the
    kernel delete only a route of that protocol (fib_table_delete / ip6_route_del compare
    it), which keeps a route programmer's deletes off everybody else's routes.  Type UNSPEC
    and scope NOWHERE mean "any type", "any scope".  An IPv6 delete naming a ``gateway``
    (and ``oif``) takes that one next hop of a multipath route (ip6_route_del); without
    one it takes every next hop of the route, whoever's."""
    return route_template(family, table=table, protocol=protocol, scope=RT_SCOPE_NOWHERE, rtype=RTN_UNSPEC,
                          tos=tos, priority=priority, src=src, gateway=gateway, oif=oif)


def encode_delroute(
    seq: int,
    flags: int,
    family: int,
    dst: bytes,
    dst_len: int,
    *,
    table: int = RT_TABLE_MAIN,
    protocol: int = RTPROT_UNSPEC,
    tos: int = 0,
    priority: int | None = None,
) -> bytes:
    """RTM_DELROUTE (see :func:`delroute_template` for what the fields select)."""
    template = delroute_template(family, table=table, protocol=protocol, tos=tos, priority=priority)
    return encode_route(RTM_DELROUTE, seq, flags, dst, dst_len, template)


def encode_getroute_dump(seq: int, family: int, *, table: int = 0, protocol: int = 0) -> bytes:
    """RTM_GETROUTE dump.  With NETLINK_GET_STRICT_CHK the kernel (>= 4.20) dumps only
    ``table`` and only routes of ``protocol`` when those are non-zero; callers still filter."""
    body = attr_u32(RTA_TABLE, table) if table else b""
    return _NLMSG_RTMSG.pack(
        28 + len(body), RTM_GETROUTE, NLM_F_REQUEST | NLM_F_DUMP, seq, 0,
        family, 0, 0, 0, table if 0 < table < 256 else RT_TABLE_UNSPEC,
        protocol, 0, 0, 0,
    ) + body


def encode_getroute(seq: int, family: int, dst: bytes) -> bytes:
    """RTM_GETROUTE for one address (``ip route get``): the kernel answers with the route it
    would use, an RTM_NEWROUTE (RTA_OIF, RTA_GATEWAY, RTA_PREFSRC).  No RTA_TABLE: strict
    checking refuses it in a get (inet_rtm_valid_getroute_req)."""
    body = attr(RTA_DST, dst)
    return _NLMSG_RTMSG.pack(
        28 + len(body), RTM_GETROUTE, NLM_F_REQUEST, seq, 0, family, len(dst) * 8, 0, 0, 0, 0, 0, 0, 0,
    ) + body


def decode_route(buf: bytes, start: int = 0, end: int | None = None) -> RouteMessage:
    """Parse an rtmsg and its attributes (the payload after the nlmsghdr) in ``buf[start:end]``."""
    if end is None:
        end = len(buf)
    if end > len(buf) or end - start < RTMSG_LEN:
        raise NetlinkDecodeError(f"route message body is {end - start} bytes, rtmsg needs {RTMSG_LEN}")
    family, dst_len, src_len, tos, table, protocol, scope, rtype, rflags = _RTMSG.unpack_from(buf, start)
    alen = _ADDR_LEN.get(family)
    if alen is not None and (dst_len > alen * 8 or src_len > alen * 8):
        raise NetlinkDecodeError(f"route prefix length {dst_len} too long for family {family}")
    dst = b""
    gateway = prefsrc = multipath = via = src = None
    oif = 0
    priority = mtu = nh_id = None
    unpack_rta = _RTA.unpack_from
    unpack_u32 = _U32.unpack_from
    pos = start + RTMSG_LEN
    while end - pos >= 4:
        length, atype = unpack_rta(buf, pos)
        vend = pos + length
        if length < 4 or vend > end:
            raise NetlinkDecodeError(f"route attribute length {length} (type {atype}) at offset {pos} does not fit")
        vs = pos + 4
        atype &= NLA_TYPE_MASK
        if atype <= RTA_PRIORITY or atype == RTA_TABLE:
            # The attributes every route has: address or u32, sizes checked in one place.
            if atype == RTA_DST or atype == RTA_GATEWAY:
                if alen is not None and length - 4 != alen:
                    raise NetlinkDecodeError(f"route attribute {atype} is {length - 4} bytes, family {family} needs {alen}")
                if atype == RTA_DST:
                    dst = buf[vs:vend]
                else:
                    gateway = buf[vs:vend]
            elif atype == RTA_SRC:
                src = read_address(buf, vs, vend, family, "RTA_SRC")
            elif atype == RTA_OIF or atype == RTA_PRIORITY or atype == RTA_TABLE:
                if length != 8:
                    raise NetlinkDecodeError(f"route attribute {atype} must carry 4 bytes, got {length - 4}")
                value = unpack_u32(buf, vs)[0]
                if atype == RTA_OIF:
                    oif = value
                elif atype == RTA_PRIORITY:
                    priority = value
                else:
                    table = value
        elif atype == RTA_PREFSRC:
            prefsrc = read_address(buf, vs, vend, family, "RTA_PREFSRC")
        elif atype == RTA_METRICS:
            for mtype, ms, me in iter_attrs(buf, vs, vend):
                if mtype == RTAX_MTU:
                    mtu = read_u32(buf, ms, me, "RTAX_MTU")
        elif atype == RTA_MULTIPATH:
            multipath = buf[vs:vend]
        elif atype == RTA_VIA:
            via = buf[vs:vend]
        elif atype == RTA_NH_ID:
            nh_id = read_u32(buf, vs, vend, "RTA_NH_ID")
        pos += (length + 3) & ~3
    return RouteMessage(
        family, dst_len, table, protocol, scope, rtype, rflags, tos, src_len, bytes(dst),
        None if gateway is None else bytes(gateway), oif, priority, prefsrc, mtu,
        None if multipath is None else bytes(multipath), None if via is None else bytes(via), nh_id,
        None if src is None else bytes(src),
    )


class NextHop(NamedTuple):
    """One ``struct rtnexthop`` of an RTA_MULTIPATH.  ``plain``: it carries no attribute but
    RTA_GATEWAY (no RTA_VIA, encapsulation, realm...)."""

    flags: int
    ifindex: int
    gateway: bytes | None
    plain: bool


_RTNEXTHOP = struct.Struct("=HBBi")


def decode_nexthops(family: int, multipath: bytes) -> list[NextHop]:
    """The next hops of a raw RTA_MULTIPATH value, in the kernel's order."""
    hops = []
    pos, end = 0, len(multipath)
    while end - pos >= _RTNEXTHOP.size:
        length, flags, _hops, ifindex = _RTNEXTHOP.unpack_from(multipath, pos)
        if length < _RTNEXTHOP.size or pos + length > end:
            raise NetlinkDecodeError(f"rtnexthop length {length} at offset {pos} does not fit")
        gateway = None
        plain = True
        for atype, vs, ve in iter_attrs(multipath, pos + _RTNEXTHOP.size, pos + length):
            if atype == RTA_GATEWAY:
                gateway = read_address(multipath, vs, ve, family, "RTA_GATEWAY")
            else:
                plain = False
        hops.append(NextHop(flags, ifindex, gateway, plain))
        pos += (length + 3) & ~3
    return hops


def encode_nexthops(hops: list[tuple[int, int, bytes | None]]) -> bytes:
    """An RTA_MULTIPATH value from ``(flags, ifindex, gateway)`` per next hop."""
    parts = []
    for flags, ifindex, gateway in hops:
        body = b"" if gateway is None else attr(RTA_GATEWAY, gateway)
        parts.append(_RTNEXTHOP.pack(_RTNEXTHOP.size + len(body), flags, 0, ifindex) + body)
    return b"".join(parts)


# --- links ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinkMessage:
    """An RTM_NEWLINK / RTM_DELLINK: the fields a route programmer and tunnel code need."""

    index: int
    name: str
    flags: int = 0
    mtu: int | None = None
    address: bytes | None = None
    kind: str | None = None  # IFLA_INFO_KIND: "veth", "vxlan", "bridge", ...
    master: int | None = None
    info_data: bytes | None = None  # raw IFLA_INFO_DATA (e.g. netlink_links.decode_vxlan)
    link: int | None = None  # IFLA_LINK: a veth's other end (its index)
    link_netnsid: int | None = None  # IFLA_LINK_NETNSID: that end's namespace, if not this one

    @property
    def up(self) -> bool:
        return bool(self.flags & IFF_UP)


def encode_getlink_dump(seq: int) -> bytes:
    return _NLMSG_IFINFOMSG.pack(
        NLMSG_HDRLEN + IFINFOMSG_LEN, RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, seq, 0, AF_UNSPEC, 0, 0, 0, 0
    )


def decode_link(buf: bytes, start: int = 0, end: int | None = None) -> LinkMessage:
    if end is None:
        end = len(buf)
    if end > len(buf) or end - start < IFINFOMSG_LEN:
        raise NetlinkDecodeError(f"link message body is {end - start} bytes, ifinfomsg needs {IFINFOMSG_LEN}")
    _family, _type, index, flags, _change = _IFINFOMSG.unpack_from(buf, start)
    name = ""
    mtu = address = kind = master = info_data = link = link_netnsid = None
    for atype, vs, ve in iter_attrs(buf, start + IFINFOMSG_LEN, end):
        if atype == IFLA_IFNAME:
            name = read_string(buf, vs, ve)
        elif atype == IFLA_MTU:
            mtu = read_u32(buf, vs, ve, "IFLA_MTU")
        elif atype == IFLA_ADDRESS:
            address = bytes(buf[vs:ve])
        elif atype == IFLA_MASTER:
            master = read_u32(buf, vs, ve, "IFLA_MASTER")
        elif atype == IFLA_LINK:
            link = read_u32(buf, vs, ve, "IFLA_LINK")
        elif atype == IFLA_LINK_NETNSID:
            link_netnsid = _I32.unpack(_U32.pack(read_u32(buf, vs, ve, "IFLA_LINK_NETNSID")))[0]
        elif atype == IFLA_LINKINFO:
            for itype, is_, ie in iter_attrs(buf, vs, ve):
                if itype == IFLA_INFO_KIND:
                    kind = read_string(buf, is_, ie)
                elif itype == IFLA_INFO_DATA:
                    info_data = bytes(buf[is_:ie])
    return LinkMessage(index, name, flags, mtu, address, kind, master, info_data, link, link_netnsid)


# --- neighbours and FDB entries -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NeighMessage:
    """An RTM_NEWNEIGH / RTM_DELNEIGH.  FDB entries are family AF_BRIDGE with ``lladdr`` the
    MAC and ``dst`` the remote VTEP address (how a VXLAN backend programs its peers)."""

    family: int
    ifindex: int
    state: int = NUD_PERMANENT
    flags: int = 0
    type: int = 0
    dst: bytes | None = None
    lladdr: bytes | None = None
    master: int | None = None  # NDA_MASTER: the bridge of a learned FDB entry (in dumps)
    # A VXLAN FDB entry's remote UDP port and VNI; None: the device's own (the kernel fills
    # those in, and dumps the attributes only where they differ).
    port: int | None = None
    vni: int | None = None


def encode_newneigh(seq: int, flags: int, msg: NeighMessage) -> bytes:
    """RTM_NEWNEIGH; ``flags`` e.g. NLM_F_REQUEST|NLM_F_ACK|NLM_F_CREATE|NLM_F_REPLACE."""
    return _encode_neigh(RTM_NEWNEIGH, seq, flags, msg)


def encode_delneigh(seq: int, flags: int, msg: NeighMessage) -> bytes:
    return _encode_neigh(RTM_DELNEIGH, seq, flags, msg)


def encode_getneigh_dump(seq: int, family: int) -> bytes:
    """RTM_GETNEIGH dump: neighbours of ``family``, or with AF_BRIDGE the bridges' FDB entries."""
    return _NLMSG_NDMSG.pack(NLMSG_HDRLEN + NDMSG_LEN, RTM_GETNEIGH, NLM_F_REQUEST | NLM_F_DUMP, seq, 0,
                             family, 0, 0, 0, 0)


def _encode_neigh(mtype: int, seq: int, flags: int, msg: NeighMessage) -> bytes:
    body = b""
    if msg.dst is not None:
        body += attr(NDA_DST, msg.dst)
    if msg.lladdr is not None:
        body += attr(NDA_LLADDR, msg.lladdr)
    if msg.port is not None:
        body += attr(NDA_PORT, struct.pack("!H", msg.port))
    if msg.vni is not None:
        body += attr_u32(NDA_VNI, msg.vni)
    return _NLMSG_NDMSG.pack(
        NLMSG_HDRLEN + NDMSG_LEN + len(body), mtype, flags, seq, 0,
        msg.family, msg.ifindex, msg.state, msg.flags, msg.type,
    ) + body


def decode_neigh(buf: bytes, start: int = 0, end: int | None = None) -> NeighMessage:
    if end is None:
        end = len(buf)
    if end > len(buf) or end - start < NDMSG_LEN:
        raise NetlinkDecodeError(f"neighbour message body is {end - start} bytes, ndmsg needs {NDMSG_LEN}")
    family, ifindex, state, flags, ntype = _NDMSG.unpack_from(buf, start)
    dst = lladdr = master = port = vni = None
    for atype, vs, ve in iter_attrs(buf, start + NDMSG_LEN, end):
        if atype == NDA_DST:
            # FDB entries (AF_BRIDGE) carry an IPv4 or IPv6 VTEP address here.
            dst = read_address(buf, vs, ve, family if family in _ADDR_LEN else AF_UNSPEC, "NDA_DST")
        elif atype == NDA_LLADDR:
            lladdr = bytes(buf[vs:ve])
        elif atype == NDA_MASTER:
            master = read_u32(buf, vs, ve, "NDA_MASTER")
        elif atype == NDA_PORT:
            if ve - vs != 2:
                raise NetlinkDecodeError(f"NDA_PORT is {ve - vs} bytes, expected 2")
            port = int.from_bytes(buf[vs:ve], "big")
        elif atype == NDA_VNI:
            vni = read_u32(buf, vs, ve, "NDA_VNI")
    return NeighMessage(family, ifindex, state, flags, ntype, dst, lladdr, master, port, vni)
