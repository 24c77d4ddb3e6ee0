"""Data-plane wire formats: IPv4, IPv6 (and its extension headers' chain), UDP, TCP, ICMP, ICMPv6,
SCTP's common header, IPIP, VXLAN and the TUN virtio-net header.

Bytes in, typed values out; no sockets, no clocks.  Besides the frozen dataclass codecs
(``decode(buf)`` / ``encode()``) this module offers the few buffer-level helpers the
user-space fast path calls per packet (checksums, in-place TTL decrement), written for speed:
CPython adds 16-bit words slowly one by one, so the internet checksum is computed on the whole
buffer as one big integer (RFC 1071 §2(B): the one's-complement sum is byte-order independent
and equals the value modulo 2**16-1, because 2**16 ≡ 1 mod 0xFFFF).
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass, field

IPPROTO_ICMP = 1
IPPROTO_IPIP = 4
IPPROTO_TCP = 6
IPPROTO_UDP = 17
IPPROTO_ICMPV6 = 58
IPPROTO_SCTP = 132
# RFC 8200 §4.1: the IPv6 extension headers an upper-layer header may sit behind
IPPROTO_HOPOPTS = 0
IPPROTO_ROUTING = 43
IPPROTO_FRAGMENT = 44
IPPROTO_AH = 51
IPPROTO_DSTOPTS = 60

FLANNEL_UDP_PORT = 8285
VXLAN_PORT = 4789

IPV4_HEADER_LEN = 20
IPV6_HEADER_LEN = 40
UDP_HEADER_LEN = 8
TCP_HEADER_LEN = 20
VXLAN_HEADER_LEN = 8
ICMP_HEADER_LEN = 8
SCTP_HEADER_LEN = 12

IP_DF = 0x4000
IP_MF = 0x2000
IP_OFFSET_MASK = 0x1FFF

TCP_FIN = 0x01
TCP_SYN = 0x02
TCP_RST = 0x04
TCP_PSH = 0x08
TCP_ACK = 0x10
TCP_URG = 0x20
TCP_ECE = 0x40
TCP_CWR = 0x80

# RFC 792 / RFC 1812 §5.2.7.1
ICMP_ECHO_REPLY = 0
ICMP_DEST_UNREACH = 3
ICMP_ECHO_REQUEST = 8
ICMP_TIME_EXCEEDED = 11
ICMP_NET_UNREACH = 0
ICMP_HOST_UNREACH = 1
ICMP_PROT_UNREACH = 2
ICMP_FRAG_NEEDED = 4
ICMP_EXC_TTL = 0
# RFC 4443 §3: ICMPv6 error messages (types below 128; informational ones are 128 and up)
ICMPV6_DEST_UNREACH = 1
ICMPV6_PACKET_TOO_BIG = 2
ICMPV6_TIME_EXCEEDED = 3
ICMPV6_NO_ROUTE = 0
ICMPV6_EXC_HOPLIMIT = 0
IPV6_MIN_MTU = 1280  # RFC 8200 §5

# include/uapi/linux/virtio_net.h
VIRTIO_NET_HDR_LEN = 10
VIRTIO_NET_HDR_MRG_RXBUF_LEN = 12
VIRTIO_NET_HDR_F_NEEDS_CSUM = 1
VIRTIO_NET_HDR_F_DATA_VALID = 2
VIRTIO_NET_HDR_GSO_NONE = 0
VIRTIO_NET_HDR_GSO_TCPV4 = 1
VIRTIO_NET_HDR_GSO_UDP = 3
VIRTIO_NET_HDR_GSO_TCPV6 = 4
VIRTIO_NET_HDR_GSO_UDP_L4 = 5
VIRTIO_NET_HDR_GSO_ECN = 0x80

_IPV4 = struct.Struct("!BBHHHBBH4s4s")
_IPV6 = struct.Struct("!IHBB16s16s")
_SCTP = struct.Struct("!HHII")
_UDP = struct.Struct("!HHHH")
_TCP = struct.Struct("!HHIIBBHHH")
_ICMP = struct.Struct("!BBHI")
_VXLAN = struct.Struct("!B3xI")
# The virtio-net header is in the host's byte order (little-endian on every target we run on;
# TUN's TUNSETVNETLE/BE exist for cross-endian guests, which we never are).
_VNET = struct.Struct("<BBHHHH")
_VNET_MRG = struct.Struct("<BBHHHHH")
_H = struct.Struct("!H")
_WORDS16 = struct.Struct("!8H")


class DecodeError(ValueError):
    """Bytes that are not a valid instance of the format; the message says what is wrong."""


# --------------------------------------------------------------------------------------------
# Internet checksum (RFC 1071), incremental update (RFC 1624)


def ones_sum(data, initial: int = 0) -> int:
    """The 16-bit one's-complement sum of ``data`` (odd length padded with a zero byte), plus
    ``initial`` (any non-negative int, e.g. a pseudo-header sum); folded to 0..0xFFFF.

    A non-zero sum never folds to 0 (one's-complement arithmetic has no carry-out to 0),
    so 0 means every word was zero.
    """
    n = len(data)
    value = int.from_bytes(data, "big")
    if n & 1:
        value <<= 8
    value += initial
    if value == 0:
        return 0
    r = value % 0xFFFF
    return r or 0xFFFF


def checksum(data, initial: int = 0) -> int:
    """The internet checksum of ``data``: the complement of :func:`ones_sum`."""
    return ~ones_sum(data, initial) & 0xFFFF


def checksum_naive(data, initial: int = 0) -> int:
    """RFC 1071 §4.1 reference: add 16-bit words with end-around carry.  Slow; for tests."""
    data = bytes(data)
    if len(data) & 1:
        data += b"\0"
    total = initial
    for i in range(0, len(data), 2):
        total += (data[i] << 8) | data[i + 1]
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def pseudo_header_sum(src: bytes, dst: bytes, protocol: int, length: int) -> int:
    """Unfolded sum of the pseudo header's 16-bit words (RFC 793 §3.1, RFC 768) of IPv4
    (4-byte addresses) or IPv6 (16-byte ones; RFC 8200 §8.1: the upper-layer length and the
    next header are 32-bit words there, which sum as IPv4's 16-bit fields do)."""
    if len(src) == 4:
        s = int.from_bytes(src, "big")
        d = int.from_bytes(dst, "big")
        return (s >> 16) + (s & 0xFFFF) + (d >> 16) + (d & 0xFFFF) + protocol + length
    return sum(_WORDS16.unpack(src)) + sum(_WORDS16.unpack(dst)) + protocol + (length >> 16) + (length & 0xFFFF)


def fold(value: int) -> int:
    """Fold an unfolded non-negative sum to 16 bits with end-around carry (0 stays 0)."""
    if value == 0:
        return 0
    return value % 0xFFFF or 0xFFFF


def checksum_update16(old_checksum: int, old_word: int, new_word: int) -> int:
    """RFC 1624 eqn. 3: HC' = ~(~HC + ~m + m'), for one changed 16-bit word."""
    s = (~old_checksum & 0xFFFF) + (~old_word & 0xFFFF) + new_word
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def decrement_ttl(buf, off: int = 0) -> int:
    """Decrement the TTL of the IPv4 header at ``buf[off:]`` in place and patch its checksum
    incrementally (RFC 1624; RFC 1812 §5.3.1).  Returns the new TTL; when the TTL would reach
    0 the buffer is left unchanged and 0 is returned (the caller drops the packet)."""
    ttl = buf[off + 8]
    if ttl <= 1:
        return 0
    word = (ttl << 8) | buf[off + 9]
    old = (buf[off + 10] << 8) | buf[off + 11]
    new = checksum_update16(old, word, word - 0x100)
    buf[off + 8] = ttl - 1
    buf[off + 10] = new >> 8
    buf[off + 11] = new & 0xFF
    return ttl - 1


def ipv4_header_checksum_ok(buf, off: int = 0) -> bool:
    ihl = (buf[off] & 0x0F) * 4
    return ones_sum(memoryview(buf)[off : off + ihl]) == 0xFFFF


# --------------------------------------------------------------------------------------------
# IPv4


def _addr(value: str | bytes | ipaddress.IPv4Address) -> bytes:
    if isinstance(value, bytes):
        if len(value) != 4:
            raise ValueError(f"IPv4 address must be 4 bytes, got {len(value)}")
        return value
    return ipaddress.IPv4Address(value).packed


@dataclass(frozen=True)
class IPv4Header:
    """RFC 791 §3.1.  ``src``/``dst`` are dotted strings; ``total_length`` 0 means "compute"."""

    src: str
    dst: str
    protocol: int
    ttl: int = 64
    tos: int = 0
    total_length: int = 0
    identification: int = 0
    df: bool = True
    mf: bool = False
    fragment_offset: int = 0
    checksum: int = 0
    options: bytes = b""

    @property
    def header_length(self) -> int:
        return IPV4_HEADER_LEN + len(self.options)

    @classmethod
    def decode(cls, buf) -> IPv4Header:
        if len(buf) < IPV4_HEADER_LEN:
            raise DecodeError(f"IPv4 header needs 20 bytes, got {len(buf)}")
        vihl, tos, total, ident, frag, ttl, proto, csum, src, dst = _IPV4.unpack_from(buf, 0)
        if vihl >> 4 != 4:
            raise DecodeError(f"IP version {vihl >> 4}, expected 4")
        ihl = (vihl & 0x0F) * 4
        if ihl < IPV4_HEADER_LEN:
            raise DecodeError(f"IPv4 header length {ihl} < 20")
        if len(buf) < ihl:
            raise DecodeError(f"IPv4 header length {ihl} exceeds the {len(buf)} bytes given")
        if total < ihl:
            raise DecodeError(f"IPv4 total length {total} < header length {ihl}")
        return cls(
            src=str(ipaddress.IPv4Address(src)),
            dst=str(ipaddress.IPv4Address(dst)),
            protocol=proto,
            ttl=ttl,
            tos=tos,
            total_length=total,
            identification=ident,
            df=bool(frag & IP_DF),
            mf=bool(frag & IP_MF),
            fragment_offset=frag & IP_OFFSET_MASK,
            checksum=csum,
            options=bytes(buf[IPV4_HEADER_LEN:ihl]),
        )

    def encode(self, payload_length: int | None = None) -> bytes:
        """Header bytes with a correct checksum; total length from ``payload_length`` if given."""
        if len(self.options) % 4 or len(self.options) > 40:
            raise ValueError("IPv4 options must be a multiple of 4 bytes, at most 40")
        hl = self.header_length
        total = hl + payload_length if payload_length is not None else (self.total_length or hl)
        frag = (IP_DF if self.df else 0) | (IP_MF if self.mf else 0) | self.fragment_offset
        raw = bytearray(
            _IPV4.pack(0x40 | hl // 4, self.tos, total, self.identification, frag, self.ttl,
                       self.protocol, 0, _addr(self.src), _addr(self.dst))
        )
        raw += self.options
        _H.pack_into(raw, 10, checksum(raw))
        return bytes(raw)


def ipv4_packet(header: IPv4Header, payload: bytes) -> bytes:
    return header.encode(len(payload)) + bytes(payload)


def split_ipv4(packet) -> tuple[IPv4Header, memoryview]:
    """Parse an IPv4 packet: header and a view of the payload (bounded by total length)."""
    header = IPv4Header.decode(packet)
    if header.total_length > len(packet):
        raise DecodeError(f"IPv4 total length {header.total_length} exceeds the {len(packet)} bytes given")
    return header, memoryview(packet)[header.header_length : header.total_length]


# --------------------------------------------------------------------------------------------
# IPv6 (RFC 8200)


def _addr6(value: str | bytes | ipaddress.IPv6Address) -> bytes:
    if isinstance(value, bytes):
        if len(value) != 16:
            raise ValueError(f"IPv6 address must be 16 bytes, got {len(value)}")
        return value
    return ipaddress.IPv6Address(value).packed


def _addr_any(value: str | bytes) -> bytes:
    """4 or 16 packed bytes of an address of either family."""
    if isinstance(value, bytes):
        if len(value) not in (4, 16):
            raise ValueError(f"an address is 4 or 16 bytes, got {len(value)}")
        return value
    return ipaddress.ip_address(value).packed


@dataclass(frozen=True)
class IPv6Header:
    """RFC 8200 §3.  ``src``/``dst`` are strings; ``payload_length`` 0 means "compute"."""

    src: str
    dst: str
    next_header: int
    hop_limit: int = 64
    traffic_class: int = 0
    flow_label: int = 0
    payload_length: int = 0

    @classmethod
    def decode(cls, buf) -> IPv6Header:
        if len(buf) < IPV6_HEADER_LEN:
            raise DecodeError(f"IPv6 header needs 40 bytes, got {len(buf)}")
        first, plen, nh, hops, src, dst = _IPV6.unpack_from(buf, 0)
        if first >> 28 != 6:
            raise DecodeError(f"IP version {first >> 28}, expected 6")
        return cls(src=str(ipaddress.IPv6Address(src)), dst=str(ipaddress.IPv6Address(dst)), next_header=nh,
                   hop_limit=hops, traffic_class=(first >> 20) & 0xFF, flow_label=first & 0xFFFFF,
                   payload_length=plen)

    def encode(self, payload_length: int | None = None) -> bytes:
        plen = self.payload_length if payload_length is None else payload_length
        if not 0 <= plen <= 0xFFFF or not 0 <= self.flow_label < 1 << 20:
            raise ValueError("IPv6 payload length or flow label out of range")
        first = 6 << 28 | (self.traffic_class & 0xFF) << 20 | self.flow_label
        return _IPV6.pack(first, plen, self.next_header, self.hop_limit, _addr6(self.src), _addr6(self.dst))


def ipv6_packet(header: IPv6Header, payload: bytes) -> bytes:
    return header.encode(len(payload)) + bytes(payload)


def split_ipv6(packet) -> tuple[IPv6Header, memoryview]:
    """Parse an IPv6 packet: header and a view of its payload (bounded by the payload length)."""
    header = IPv6Header.decode(packet)
    if IPV6_HEADER_LEN + header.payload_length > len(packet):
        raise DecodeError(f"IPv6 payload length {header.payload_length} exceeds the {len(packet) - 40} bytes given")
    return header, memoryview(packet)[IPV6_HEADER_LEN : IPV6_HEADER_LEN + header.payload_length]


def decrement_hop_limit(buf, off: int = 0) -> int:
    """Decrement the hop limit of the IPv6 header at ``buf[off:]`` in place (RFC 8200 §3: no
    header checksum to patch).  Returns the new hop limit; at 1 or 0 the buffer is left
    unchanged and 0 is returned (the caller drops the packet, RFC 4443 §3.3)."""
    hops = buf[off + 7]
    if hops <= 1:
        return 0
    buf[off + 7] = hops - 1
    return hops - 1


# Extension headers with RFC 8200 §4's length field (8-octet units, not counting the first 8),
# and the two laid out otherwise: Fragment (§4.5, always 8 octets) and AH (RFC 4302 §2.2,
# 4-octet units, not counting the first 2).  Mobility (135), HIP (139) and Shim6 (140) use the
# uniform format (RFC 6564).
_EXTENSION_HEADERS = frozenset({IPPROTO_HOPOPTS, IPPROTO_ROUTING, IPPROTO_FRAGMENT, IPPROTO_AH, IPPROTO_DSTOPTS,
                                135, 139, 140})


@dataclass(frozen=True)
class UpperLayer:
    """Where an IPv6 packet's upper-layer header is (:func:`ipv6_upper_layer`).

    ``offset`` None: its header is not in the bytes -- they end inside the extension headers
    (``protocol`` is then the type of the header they end in), or this is a fragment other
    than the first (``protocol`` is the fragmented packet's, RFC 8200 §4.5)."""

    protocol: int
    offset: int | None


def ipv6_upper_layer(packet, next_header: int, offset: int = IPV6_HEADER_LEN) -> UpperLayer:
    """Walk the extension headers of the IPv6 packet in ``packet`` from ``offset`` (whose type
    is ``next_header``) to its upper-layer header (RFC 8200 §4.1: they are chained by their
    Next Header fields).  Never raises: bytes that end early give ``offset`` None."""
    n = len(packet)
    while next_header in _EXTENSION_HEADERS:
        if n - offset < 8:  # every extension header is at least 8 octets
            return UpperLayer(next_header, None)
        following = packet[offset]
        if next_header == IPPROTO_FRAGMENT:
            if _H.unpack_from(packet, offset + 2)[0] >> 3:  # fragment offset: a later fragment
                return UpperLayer(following, None)
            size = 8
        elif next_header == IPPROTO_AH:
            size = (packet[offset + 1] + 2) * 4
        else:
            size = (packet[offset + 1] + 1) * 8
        next_header, offset = following, offset + size
    return UpperLayer(next_header, offset if offset <= n else None)


# --------------------------------------------------------------------------------------------
# UDP (RFC 768)


@dataclass(frozen=True)
class UdpHeader:
    src_port: int
    dst_port: int
    length: int = 0
    checksum: int = 0

    @classmethod
    def decode(cls, buf) -> UdpHeader:
        if len(buf) < UDP_HEADER_LEN:
            raise DecodeError(f"UDP header needs 8 bytes, got {len(buf)}")
        sport, dport, length, csum = _UDP.unpack_from(buf, 0)
        if length < UDP_HEADER_LEN:
            raise DecodeError(f"UDP length {length} < 8")
        return cls(sport, dport, length, csum)

    def encode(self) -> bytes:
        return _UDP.pack(self.src_port, self.dst_port, self.length, self.checksum)


def udp_datagram(src: str, dst: str, src_port: int, dst_port: int, payload: bytes, *, ttl: int = 64,
                 identification: int = 0) -> bytes:
    """A full IPv4/UDP datagram with a correct UDP checksum (0 is sent as 0xFFFF, RFC 768)."""
    length = UDP_HEADER_LEN + len(payload)
    s, d = _addr(src), _addr(dst)
    csum = checksum(_UDP.pack(src_port, dst_port, length, 0) + bytes(payload),
                    pseudo_header_sum(s, d, IPPROTO_UDP, length)) or 0xFFFF
    udp = _UDP.pack(src_port, dst_port, length, csum) + bytes(payload)
    return ipv4_packet(IPv4Header(src=src, dst=dst, protocol=IPPROTO_UDP, ttl=ttl,
                                  identification=identification), udp)


def flannel_udp_encapsulate(inner: bytes, src: str, dst: str, *, port: int = FLANNEL_UDP_PORT,
                            src_port: int = FLANNEL_UDP_PORT) -> bytes:
    """flannel's UDP backend: the UDP payload is exactly the inner IPv4 packet."""
    return udp_datagram(src, dst, src_port, port, inner)


# --------------------------------------------------------------------------------------------
# IPIP (RFC 2003)


def ipip_encapsulate(inner: bytes, src: str, dst: str, *, ttl: int = 64, identification: int = 0,
                     df: bool = True, tos: int = 0) -> bytes:
    """RFC 2003 §3.1: an outer IPv4 header with protocol 4, then the inner packet unchanged."""
    outer = IPv4Header(src=src, dst=dst, protocol=IPPROTO_IPIP, ttl=ttl, tos=tos,
                       identification=identification, df=df)
    return ipv4_packet(outer, inner)


def ipip_decapsulate(packet) -> tuple[IPv4Header, memoryview]:
    outer, inner = split_ipv4(packet)
    if outer.protocol != IPPROTO_IPIP:
        raise DecodeError(f"outer protocol {outer.protocol}, expected 4 (IPIP)")
    if len(inner) < IPV4_HEADER_LEN or inner[0] >> 4 != 4:
        raise DecodeError("IPIP payload is not an IPv4 packet")
    return outer, inner


# --------------------------------------------------------------------------------------------
# TCP (RFC 793 §3.1): the fields segmentation and coalescing touch


@dataclass(frozen=True)
class TcpHeader:
    src_port: int
    dst_port: int
    seq: int
    ack: int
    flags: int
    window: int
    checksum: int = 0
    urgent: int = 0
    options: bytes = b""

    @property
    def header_length(self) -> int:
        return TCP_HEADER_LEN + len(self.options)

    @classmethod
    def decode(cls, buf) -> TcpHeader:
        if len(buf) < TCP_HEADER_LEN:
            raise DecodeError(f"TCP header needs 20 bytes, got {len(buf)}")
        sport, dport, seq, ack, doff, flags, window, csum, urg = _TCP.unpack_from(buf, 0)
        hl = (doff >> 4) * 4
        if hl < TCP_HEADER_LEN or hl > len(buf):
            raise DecodeError(f"TCP data offset {hl} invalid for {len(buf)} bytes")
        return cls(sport, dport, seq, ack, flags, window, csum, urg, bytes(buf[TCP_HEADER_LEN:hl]))

    def encode(self, src: str | bytes = b"", dst: str | bytes = b"", payload: bytes = b"") -> bytes:
        """Header bytes; with ``src``/``dst`` the checksum is computed over pseudo header,
        header and ``payload`` (which is not included in the result)."""
        if len(self.options) % 4 or len(self.options) > 40:
            raise ValueError("TCP options must be a multiple of 4 bytes, at most 40")
        raw = bytearray(_TCP.pack(self.src_port, self.dst_port, self.seq, self.ack,
                                  (self.header_length // 4) << 4, self.flags, self.window,
                                  self.checksum if not src else 0, self.urgent))
        raw += self.options
        if src:
            length = len(raw) + len(payload)
            _H.pack_into(raw, 16, checksum(bytes(raw) + bytes(payload),
                                           pseudo_header_sum(_addr_any(src), _addr_any(dst), IPPROTO_TCP, length)))
        return bytes(raw)


def tcp_packet(src: str, dst: str, tcp: TcpHeader, payload: bytes = b"", *, ttl: int = 64,
               identification: int = 0, tos: int = 0) -> bytes:
    """A full IPv4/TCP packet with correct IP and TCP checksums."""
    seg = tcp.encode(src, dst, payload) + bytes(payload)
    return ipv4_packet(IPv4Header(src=src, dst=dst, protocol=IPPROTO_TCP, ttl=ttl, tos=tos,
                                  identification=identification), seg)


def tcp6_packet(src: str, dst: str, tcp: TcpHeader, payload: bytes = b"", *, hop_limit: int = 64,
                traffic_class: int = 0, flow_label: int = 0) -> bytes:
    """A full IPv6/TCP packet (no extension headers) with a correct TCP checksum."""
    seg = tcp.encode(src, dst, payload) + bytes(payload)
    return ipv6_packet(IPv6Header(src=src, dst=dst, next_header=IPPROTO_TCP, hop_limit=hop_limit,
                                  traffic_class=traffic_class, flow_label=flow_label), seg)


def transport_checksum_ok(packet) -> bool:
    """Verify the TCP/UDP (or ICMPv6) checksum of an IPv4 or IPv6 packet without extension
    headers (an IPv4 UDP checksum 0 means "none"; RFC 8200 §8.1: never in IPv6)."""
    if len(packet) and packet[0] >> 4 == 6:
        h6, payload = split_ipv6(packet)
        src, dst, protocol = _addr6(h6.src), _addr6(h6.dst), h6.next_header
    else:
        header, payload = split_ipv4(packet)
        if header.protocol == IPPROTO_UDP and len(payload) >= 8 and payload[6:8] == b"\0\0":
            return True
        src, dst, protocol = _addr(header.src), _addr(header.dst), header.protocol
    return ones_sum(payload, pseudo_header_sum(src, dst, protocol, len(payload))) == 0xFFFF


# --------------------------------------------------------------------------------------------
# ICMP (RFC 792)


def icmp_message(type_: int, code: int, rest: int, body: bytes) -> bytes:
    raw = bytearray(_ICMP.pack(type_, code, 0, rest) + bytes(body))
    _H.pack_into(raw, 2, checksum(raw))
    return bytes(raw)


# RFC 1122 §3.2.2: destination unreachable, source quench, redirect, time exceeded, parameter problem.
_ICMP_ERROR_TYPES = frozenset((3, 4, 5, 11, 12))


def icmp_error(offender, type_: int, code: int, src: str | bytes, *, ttl: int = 64,
               rest: int = 0) -> bytes:
    """An ICMP error about ``offender`` (an IPv4 packet), addressed to its source.

    RFC 792 quotes the offender's IP header plus 64 bits of its data; RFC 1812 §4.3.2.3 allows
    more, which helps nobody here, so we quote exactly that (as flannel does).

    RFC 1122 §3.2.2 and RFC 1812 §4.3.2.7: never about an ICMP error message, a fragment other
    than the first, a packet to a multicast or broadcast address, nor one whose source is not a
    single host (0/8, loopback, multicast, broadcast, class E) (ValueError: the caller sends
    nothing), as ``icmp6_error`` does for ICMPv6.
    """
    off = memoryview(offender)
    if len(off) < IPV4_HEADER_LEN:
        raise DecodeError("offending packet shorter than an IPv4 header")
    ihl = (off[0] & 0x0F) * 4
    if (off[6] << 8 | off[7]) & 0x1FFF:
        raise ValueError("no ICMP error about a fragment other than the first (RFC 1122 §3.2.2)")
    if off[9] == IPPROTO_ICMP and len(off) > ihl and off[ihl] in _ICMP_ERROR_TYPES:
        raise ValueError("no ICMP error about an ICMP error (RFC 1122 §3.2.2)")
    if off[16] >= 224 or bytes(off[16:20]) == b"\xff\xff\xff\xff":
        raise ValueError("no ICMP error about a multicast or broadcast packet (RFC 1122 §3.2.2)")
    if off[12] in (0, 127) or off[12] >= 224:
        raise ValueError("no ICMP error to a source that is not a single host (RFC 1812 §4.3.2.7)")
    quote = bytes(off[: ihl + 8])
    dst = bytes(off[12:16])
    body = icmp_message(type_, code, rest, quote)
    return ipv4_packet(IPv4Header(src=str(ipaddress.IPv4Address(_addr(src))),
                                  dst=str(ipaddress.IPv4Address(dst)),
                                  protocol=IPPROTO_ICMP, ttl=ttl, df=False), body)


def icmp_net_unreachable(offender, src: str | bytes) -> bytes:
    return icmp_error(offender, ICMP_DEST_UNREACH, ICMP_NET_UNREACH, src)


def icmp_time_exceeded(offender, src: str | bytes) -> bytes:
    return icmp_error(offender, ICMP_TIME_EXCEEDED, ICMP_EXC_TTL, src)


def icmp_frag_needed(offender, src: str | bytes, mtu: int) -> bytes:
    """RFC 1191 §4: next-hop MTU in the low 16 bits of the second word."""
    return icmp_error(offender, ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED, src, rest=mtu & 0xFFFF)


def icmp6_error(offender, type_: int, code: int, src: str | bytes, *, hop_limit: int = 64, rest: int = 0) -> bytes:
    """An ICMPv6 error about ``offender`` (an IPv6 packet), addressed to its source.

    RFC 4443 §2.4 (c): the body quotes as much of the offender as fits in the minimum IPv6
    MTU; (e): never about an ICMPv6 error message, nor about a packet to a multicast address
    or from an unspecified one (ValueError: the caller sends nothing).  The checksum covers
    the IPv6 pseudo header (§2.3)."""
    off = memoryview(offender)
    if len(off) < IPV6_HEADER_LEN:
        raise DecodeError("offending packet shorter than an IPv6 header")
    source, dst = bytes(off[8:24]), bytes(off[24:40])
    if off[6] == IPPROTO_ICMPV6 and len(off) > IPV6_HEADER_LEN and off[IPV6_HEADER_LEN] < 128:
        raise ValueError("no ICMPv6 error about an ICMPv6 error (RFC 4443 §2.4 (e))")
    if dst[0] == 0xFF or source == bytes(16):
        raise ValueError("no ICMPv6 error about multicast or from the unspecified address (RFC 4443 §2.4 (e))")
    quote = bytes(off[: IPV6_MIN_MTU - IPV6_HEADER_LEN - ICMP_HEADER_LEN])
    me = _addr6(src)
    body = bytearray(_ICMP.pack(type_, code, 0, rest) + quote)
    _H.pack_into(body, 2, checksum(body, pseudo_header_sum(me, source, IPPROTO_ICMPV6, len(body))))
    return ipv6_packet(IPv6Header(src=str(ipaddress.IPv6Address(me)), dst=str(ipaddress.IPv6Address(source)),
                                  next_header=IPPROTO_ICMPV6, hop_limit=hop_limit), bytes(body))


def icmp6_no_route(offender, src: str | bytes) -> bytes:
    """RFC 4443 §3.1: destination unreachable, no route to destination."""
    return icmp6_error(offender, ICMPV6_DEST_UNREACH, ICMPV6_NO_ROUTE, src)


def icmp6_hop_limit_exceeded(offender, src: str | bytes) -> bytes:
    """RFC 4443 §3.3: time exceeded, hop limit exceeded in transit."""
    return icmp6_error(offender, ICMPV6_TIME_EXCEEDED, ICMPV6_EXC_HOPLIMIT, src)


def icmp6_packet_too_big(offender, src: str | bytes, mtu: int) -> bytes:
    """RFC 4443 §3.2: packet too big, the next-hop MTU in the second word."""
    return icmp6_error(offender, ICMPV6_PACKET_TOO_BIG, 0, src, rest=mtu & 0xFFFFFFFF)


@dataclass(frozen=True)
class IcmpHeader:
    type: int
    code: int
    checksum: int
    rest: int

    @classmethod
    def decode(cls, buf) -> IcmpHeader:
        if len(buf) < ICMP_HEADER_LEN:
            raise DecodeError(f"ICMP header needs 8 bytes, got {len(buf)}")
        return cls(*_ICMP.unpack_from(buf, 0))


# --------------------------------------------------------------------------------------------
# SCTP's common header (RFC 9260 §3.1), and the ports of a transport header


@dataclass(frozen=True)
class SctpHeader:
    src_port: int
    dst_port: int
    verification_tag: int
    checksum: int

    @classmethod
    def decode(cls, buf) -> SctpHeader:
        if len(buf) < SCTP_HEADER_LEN:
            raise DecodeError(f"SCTP common header needs 12 bytes, got {len(buf)}")
        return cls(*_SCTP.unpack_from(buf, 0))


def transport_ports(protocol: int, segment) -> tuple[int, int]:
    """(source port, destination port) of the TCP, UDP or SCTP header at the start of
    ``segment``, (type, code) of an ICMP or ICMPv6 one (RFC 4443 §2.1: the same first octets);
    (0, 0) for other protocols, and where the header is not whole or not valid."""
    try:
        if protocol == IPPROTO_TCP:
            tcp = TcpHeader.decode(segment)
            return tcp.src_port, tcp.dst_port
        if protocol == IPPROTO_UDP:
            udp = UdpHeader.decode(segment)
            return udp.src_port, udp.dst_port
        if protocol == IPPROTO_SCTP:
            sctp = SctpHeader.decode(segment)
            return sctp.src_port, sctp.dst_port
        if protocol in (IPPROTO_ICMP, IPPROTO_ICMPV6):
            icmp = IcmpHeader.decode(segment)
            return icmp.type, icmp.code
    except DecodeError:
        pass
    return 0, 0


# --------------------------------------------------------------------------------------------
# VXLAN (RFC 7348 §5)


@dataclass(frozen=True)
class VxlanHeader:
    vni: int

    @classmethod
    def decode(cls, buf) -> VxlanHeader:
        if len(buf) < VXLAN_HEADER_LEN:
            raise DecodeError(f"VXLAN header needs 8 bytes, got {len(buf)}")
        flags, word = _VXLAN.unpack_from(buf, 0)
        if not flags & 0x08:
            raise DecodeError("VXLAN I flag not set (RFC 7348 §5: VNI must be valid)")
        return cls(word >> 8)

    def encode(self) -> bytes:
        if not 0 <= self.vni < 1 << 24:
            raise ValueError(f"VNI {self.vni} out of range 0..16777215")
        return _VXLAN.pack(0x08, self.vni << 8)


# --------------------------------------------------------------------------------------------
# TUN virtio-net header (include/uapi/linux/virtio_net.h, struct virtio_net_hdr[_mrg_rxbuf])


@dataclass(frozen=True)
class VirtioNetHdr:
    """What precedes each packet on a TUN fd opened with IFF_VNET_HDR.

    ``csum_start``/``csum_offset``: with NEEDS_CSUM the checksum over ``packet[csum_start:]``
    is still to be stored at ``csum_start + csum_offset`` (the field holds the pseudo-header
    sum).  ``gso_size`` is the segment payload size (the TCP MSS) of a GSO super-packet.
    ``num_buffers`` is present only in the 12-byte mrg_rxbuf variant.
    """

    flags: int = 0
    gso_type: int = VIRTIO_NET_HDR_GSO_NONE
    hdr_len: int = 0
    gso_size: int = 0
    csum_start: int = 0
    csum_offset: int = 0
    num_buffers: int | None = field(default=None)

    @property
    def size(self) -> int:
        return VIRTIO_NET_HDR_LEN if self.num_buffers is None else VIRTIO_NET_HDR_MRG_RXBUF_LEN

    @classmethod
    def decode(cls, buf, size: int = VIRTIO_NET_HDR_LEN) -> VirtioNetHdr:
        if size not in (VIRTIO_NET_HDR_LEN, VIRTIO_NET_HDR_MRG_RXBUF_LEN):
            raise ValueError(f"virtio-net header size must be 10 or 12, not {size}")
        if len(buf) < size:
            raise DecodeError(f"virtio-net header needs {size} bytes, got {len(buf)}")
        if size == VIRTIO_NET_HDR_LEN:
            return cls(*_VNET.unpack_from(buf, 0))
        return cls(*_VNET_MRG.unpack_from(buf, 0))

    def encode(self) -> bytes:
        values = (self.flags, self.gso_type, self.hdr_len, self.gso_size, self.csum_start, self.csum_offset)
        if self.num_buffers is None:
            return _VNET.pack(*values)
        return _VNET_MRG.pack(*values, self.num_buffers)


VNET_HDR_NONE = VirtioNetHdr().encode()
