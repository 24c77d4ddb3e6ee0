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
            NFULA_IFINDEX_INDEV / OUTDEV __be32, NFULA_IFINDEX_PHYSINDEV __be32 (a bridged
            packet's bridge port, where INDEV is the bridge: nfnetlink_log.c with
            CONFIG_BRIDGE_NETFILTER), NFULA_TIMESTAMP { __be64 sec; __be64 usec },
            NFULA_SEQ __be32 (with NFULNL_CFG_F_SEQ), NFULA_PAYLOAD (the packet from its
            network header, up to copy_range bytes), NFULA_CT (with NFULNL_CFG_F_CONNTRACK:
            the packet's conntrack entry, nested as ctnetlink's CTA_* attributes:
            CTA_TUPLE_ORIG, CTA_STATUS, ...)

A packet DNATed before it was dropped (a Service's connection that NetworkPolicy denies at
the endpoint) no longer carries the Service's address; its conntrack entry's original tuple
does: with IPS_DST_NAT set, :attr:`Packet.orig_dst` is that destination.

The kernel queues packets per instance and sends them when ``qthresh`` are queued or
``timeout`` passed, many to a datagram: the agent sets both (a drop must show within a
second, a drop storm must not cost a datagram per packet).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from agentd.kernel import netlink as nl
from agentd.kernel import netlink_ct as ct
from proto import packet as P

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
NFULNL_CFG_F_CONNTRACK = 0x0004  # NFULA_CT with each packet (needs nf_conntrack_netlink: EOPNOTSUPP without)

NFULA_PACKET_HDR = 1
NFULA_TIMESTAMP = 3
NFULA_IFINDEX_INDEV = 4
NFULA_IFINDEX_OUTDEV = 5
NFULA_IFINDEX_PHYSINDEV = 6
NFULA_PAYLOAD = 9
NFULA_PREFIX = 10
NFULA_SEQ = 12
NFULA_CT = 18

_BE16 = struct.Struct("!H")
_BE32 = struct.Struct("!I")
_MODE = struct.Struct("!IBx")
_TIMESTAMP = struct.Struct("!QQ")


def _config(group: int, seq: int, body: bytes, family: int = nl.AF_UNSPEC) -> bytes:
    return nl.encode_nfgen(MSG_CONFIG, nl.NLM_F_REQUEST, seq, family, body, res_id=group)


def encode_bind(group: int, seq: int) -> bytes:
    """Bind this socket to ``group`` (EBUSY: another socket has it)."""
    return _config(group, seq, nl.attr(NFULA_CFG_CMD, bytes([NFULNL_CFG_CMD_BIND])))


def encode_unbind(group: int, seq: int) -> bytes:
    return _config(group, seq, nl.attr(NFULA_CFG_CMD, bytes([NFULNL_CFG_CMD_UNBIND])))


def encode_settings(group: int, seq: int, *, copy_range: int, timeout_cs: int, qthresh: int,
                    bufsize: int = 0, conntrack: bool = False) -> bytes:
    """Copy ``copy_range`` bytes of each packet, send when ``qthresh`` packets are queued or
    ``timeout_cs`` hundredths of a second passed, number the packets (NFULA_SEQ: lost ones
    show as gaps); with ``conntrack``, each packet's conntrack entry too (NFULA_CT)."""
    flags = NFULNL_CFG_F_SEQ | (NFULNL_CFG_F_CONNTRACK if conntrack else 0)
    body = (nl.attr(NFULA_CFG_MODE, _MODE.pack(copy_range, NFULNL_COPY_PACKET))
            + nl.attr(NFULA_CFG_TIMEOUT, _BE32.pack(timeout_cs))
            + nl.attr(NFULA_CFG_QTHRESH, _BE32.pack(qthresh))
            + nl.attr(NFULA_CFG_FLAGS, _BE16.pack(flags) + b"\0\0"))
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
    physindev: int = 0  # the bridge port it came in on (a bridge family hook's packet), 0: none
    orig_dst: tuple[str, int] | None = None  # a DNATed packet's destination before (address, port): its conntrack entry's
    ct_malformed: bool = False  # NFULA_CT was there but could not be read (the rest of the packet could)
    # A DNATed packet's conntrack entry, (original, reply) direction: an ICMP error the node sends
    # for a translated connection's dropped first packet carries it (the pod, the endpoint).
    dnat: tuple[ct.CtTuple, ct.CtTuple] | None = None
    # An ICMP or ICMPv6 destination-unreachable error's quoted packet, as :func:`ip_summary`
    # gives it (the packet the error is about, where the kernel has no conntrack glue for NFLOG).
    quoted: tuple[str, str, int, int, int] | None = None
    # An ICMPv6 neighbour advertisement's target: the address it claims (as :func:`nd_target`).
    claimed: str | None = None
    # False: a payload the agent cannot read (no IP nor ARP packet: a frame of another EtherType
    # from a pod with a MAC not its own, a QinQ frame's inner tag, one too short), decoded with
    # ``headerless``: no addresses nor ports, its EtherType (NFULA_PACKET_HDR) as ``proto``.
    read: bool = True

    @property
    def port(self) -> int:
        """The interface it came in on: the bridge port if bridged, else the input device."""
        return self.physindev or self.indev


def decode_packet(buf: bytes, start: int, end: int, *, headerless: bool = False) -> Packet | None:
    """An NFULNL_MSG_PACKET body (nfgenmsg + attributes); None if its payload is no IPv4 or
    IPv6 packet, nor an ARP one (its hardware protocol, NFULA_PACKET_HDR, ETH_P_ARP: the
    bridge table's spoofed-arp drops), that the agent can read (too short, another protocol)
    -- or, with ``headerless``, a Packet of what the message says all the same (``read``
    False: no addresses, the hardware protocol, an EtherType, as its protocol)."""
    if end > len(buf) or end - start < nl.NFGENMSG_LEN:
        raise nl.NetlinkDecodeError(f"log message body is {end - start} bytes, nfgenmsg needs {nl.NFGENMSG_LEN}")
    family = buf[start]
    prefix = ""
    when = 0.0
    indev = outdev = physindev = 0
    seq = None
    payload = None
    conntrack = None
    hw_protocol = 0
    for atype, vs, ve in nl.iter_attrs(buf, start + nl.NFGENMSG_LEN, end):
        if atype == NFULA_PACKET_HDR and ve - vs >= 2:
            hw_protocol = _BE16.unpack_from(buf, vs)[0]
        elif atype == NFULA_PREFIX:
            prefix = nl.read_string(buf, vs, ve)
        elif atype == NFULA_PAYLOAD:
            payload = (vs, ve)
        elif atype == NFULA_IFINDEX_INDEV:
            indev = _be32(buf, vs, ve, "NFULA_IFINDEX_INDEV")
        elif atype == NFULA_IFINDEX_OUTDEV:
            outdev = _be32(buf, vs, ve, "NFULA_IFINDEX_OUTDEV")
        elif atype == NFULA_IFINDEX_PHYSINDEV:
            physindev = _be32(buf, vs, ve, "NFULA_IFINDEX_PHYSINDEV")
        elif atype == NFULA_SEQ:
            seq = _be32(buf, vs, ve, "NFULA_SEQ")
        elif atype == NFULA_CT:
            conntrack = (vs, ve)
        elif atype == NFULA_TIMESTAMP:
            if ve - vs != _TIMESTAMP.size:
                raise nl.NetlinkDecodeError(f"NFULA_TIMESTAMP must be {_TIMESTAMP.size} bytes, got {ve - vs}")
            sec, usec = _TIMESTAMP.unpack_from(buf, vs)
            when = sec + usec / 1e6
    headers = None
    if payload is not None:
        headers = arp_summary(buf, *payload) if hw_protocol == ETH_P_ARP else ip_summary(buf, *payload)
    if headers is None:
        if not headerless:
            return None
        return Packet(prefix, family, when, indev, outdev, seq, "", "", hw_protocol, 0, 0, physindev=physindev, read=False)
    orig_dst, ct_malformed, dnat = None, False, None
    if conntrack is not None:
        try:
            dnat = dnat_tuples(buf, *conntrack)
        except nl.NetlinkDecodeError:
            ct_malformed = True
        if dnat is not None:
            orig_dst = dnat[0].dst, dnat[0].dport
    quoted = quoted_summary(buf, *payload) if headers[2] in (1, 58) and headers[3] in (3, 1) else None
    claimed = nd_target(buf, *payload) if headers[2] == 58 and headers[3] == ND_NEIGHBOR_ADVERT else None
    return Packet(prefix, family, when, indev, outdev, seq, *headers, physindev=physindev, orig_dst=orig_dst,
                  ct_malformed=ct_malformed, dnat=dnat if dnat is not None and dnat[1] is not None else None,
                  quoted=quoted, claimed=claimed)


def packet_seq(buf: bytes, start: int, end: int) -> int | None:
    """The NFULA_SEQ of an NFULNL_MSG_PACKET body :func:`decode_packet` could not read, if
    it can be found (the attributes before it well formed, it four bytes), else None: the
    packet was logged and numbered all the same, so the next one's number shows no gap."""
    if end > len(buf) or end - start < nl.NFGENMSG_LEN:
        return None
    try:
        for atype, vs, ve in nl.iter_attrs(buf, start + nl.NFGENMSG_LEN, end):
            if atype == NFULA_SEQ:
                return _be32(buf, vs, ve, "NFULA_SEQ")
    except nl.NetlinkDecodeError:
        pass
    return None


def dnat_origin(buf: bytes, start: int, end: int) -> tuple[str, int] | None:
    """The original destination (address, port) of the conntrack entry in NFULA_CT's
    ``buf[start:end]`` (ctnetlink's attributes) if the entry is DNATed (IPS_DST_NAT), else
    None; :class:`~agentd.kernel.netlink.NetlinkDecodeError` if it is malformed."""
    tuples = dnat_tuples(buf, start, end)
    return None if tuples is None else (tuples[0].dst, tuples[0].dport)


def dnat_tuples(buf: bytes, start: int, end: int) -> tuple[ct.CtTuple, ct.CtTuple | None] | None:
    """The original and reply tuples (the reply's None if it has none) of the conntrack entry
    in NFULA_CT if it is DNATed, else None (as :func:`dnat_origin`)."""
    orig = reply = None
    status = 0
    for atype, vs, ve in nl.iter_attrs(buf, start, end):
        if atype == ct.CTA_TUPLE_ORIG:
            orig = ct.decode_tuple(buf, vs, ve)
        elif atype == ct.CTA_TUPLE_REPLY:
            reply = ct.decode_tuple(buf, vs, ve)
        elif atype == ct.CTA_STATUS:
            status = _be32(buf, vs, ve, "CTA_STATUS")
    if orig is None or not status & ct.IPS_DST_NAT:
        return None
    return orig, reply


def _be32(buf: bytes, start: int, end: int, what: str) -> int:
    if end - start != 4:
        raise nl.NetlinkDecodeError(f"{what} must be 4 bytes, got {end - start}")
    return _BE32.unpack_from(buf, start)[0]


ETH_P_ARP = 0x0806
_ARP_IPV4 = struct.Struct("!HHBBH6s4s6s4s")


def arp_summary(buf: bytes, start: int, end: int) -> tuple[str, str, int, int, int] | None:
    """An ARP packet (Ethernet, IPv4) as :func:`ip_summary` gives an IP one: (sender address,
    target address, ETH_P_ARP as the protocol, the operation, 0); None if it is not one."""
    if end - start < _ARP_IPV4.size:
        return None
    htype, ptype, hlen, plen, op, _sha, spa, _tha, tpa = _ARP_IPV4.unpack_from(buf, start)
    if (htype, ptype, hlen, plen) != (1, 0x0800, 6, 4):
        return None
    import socket

    return socket.inet_ntoa(spa), socket.inet_ntoa(tpa), ETH_P_ARP, op, 0


ND_NEIGHBOR_ADVERT = 136


def nd_target(buf: bytes, start: int, end: int) -> str | None:
    """The target address of the ICMPv6 neighbour advertisement in ``buf[start:end]`` (an
    IPv6 packet): the address it says is at its sender's link-layer address; None if it is no
    such advertisement or too short."""
    packet = memoryview(buf)[start:end]
    try:
        if not packet[:1] or packet[0] >> 4 != 6:
            return None
        ip6 = P.IPv6Header.decode(packet)
        upper = P.ipv6_upper_layer(packet, ip6.next_header)
    except P.DecodeError:
        return None
    at = upper.offset
    if upper.protocol != 58 or at is None or len(packet) < at + 24 or packet[at] != ND_NEIGHBOR_ADVERT:
        return None
    import ipaddress

    return str(ipaddress.IPv6Address(bytes(packet[at + 8:at + 24])))


def quoted_summary(buf: bytes, start: int, end: int) -> tuple[str, str, int, int, int] | None:
    """The packet an ICMP destination-unreachable (or ICMPv6's) error in ``buf[start:end]``
    quotes, as :func:`ip_summary` gives it; None if it is no such error or too short."""
    packet = memoryview(buf)[start:end]
    try:
        if packet[:1] and packet[0] >> 4 == 4:
            ip4 = P.IPv4Header.decode(packet)
            if ip4.protocol != 1 or ip4.fragment_offset:
                return None
            l4, unreachable = ip4.header_length, 3
        elif packet[:1] and packet[0] >> 4 == 6:
            ip6 = P.IPv6Header.decode(packet)
            upper = P.ipv6_upper_layer(packet, ip6.next_header)
            if upper.protocol != 58 or upper.offset is None:  # a cut chain or a later fragment: no ICMPv6 here
                return None
            l4, unreachable = upper.offset, 1
        else:
            return None
    except P.DecodeError:
        return None
    if len(packet) < l4 + 8 or packet[l4] != unreachable:
        return None
    return ip_summary(buf, start + l4 + 8, end)


def ip_summary(buf: bytes, start: int, end: int) -> tuple[str, str, int, int, int] | None:
    """(source, destination, protocol, source port or ICMP type, destination port or ICMP code)
    of the IP packet in ``buf[start:end]``, read with the data path's own codecs
    (:mod:`proto.packet`); None if it is not one or too short for its IP header.

    The bytes are the first ``copy_range`` of the packet, so a header may end early: then what
    is known is given (ports 0 when the transport header is not whole; an IPv6 packet whose
    bytes end in its extension headers shows the type of the one they end in).  A fragment
    other than the first has no transport header: its protocol, ports 0."""
    packet = memoryview(buf)[start:end]
    if not packet:
        return None
    try:
        if packet[0] >> 4 == 4:
            ip4 = P.IPv4Header.decode(packet)
            src, dst, proto = ip4.src, ip4.dst, ip4.protocol
            l4: int | None = None if ip4.fragment_offset else ip4.header_length
        elif packet[0] >> 4 == 6:
            ip6 = P.IPv6Header.decode(packet)
            src, dst = ip6.src, ip6.dst
            upper = P.ipv6_upper_layer(packet, ip6.next_header)
            proto, l4 = upper.protocol, upper.offset
        else:
            return None
    except P.DecodeError:
        return None
    sport, dport = P.transport_ports(proto, packet[l4:]) if l4 is not None else (0, 0)
    return src, dst, proto, sport, dport
