"""Pure forwarding logic of the user-space data plane (no sockets, no clocks).

* :class:`NextHopTable` — inner destination subnet (either family) -> peer underlay address,
  longest-prefix match.
* :func:`segment_tcp` — split a TCP/IPv4 or TCP/IPv6 TSO super-packet (what a TUN with
  TUN_F_TSO4 / TUN_F_TSO6 hands us) into MSS-sized packets with correct IP and TCP checksums
  (IPv6 has no header checksum; its payload length is per segment), written back to back into one buffer,
  which is exactly the layout UDP GSO (``UDP_SEGMENT``) and ``sendmmsg`` want.  This is the
  segment-by-segment reference: the worker uses the vectorized ``_tso.TsoSegmenter``, which
  falls back to it for geometries numpy cannot view.  The receive side (GRO) is ``_gro``.
* :func:`complete_checksum` — finish a partial (NEEDS_CSUM) checksum.

The worker calls these per packet, so they work on buffers and offsets, not dataclasses.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Iterable, Mapping

from proto.packet import (
    IPPROTO_TCP,
    IPPROTO_UDP,
    TCP_CWR,
    TCP_FIN,
    TCP_PSH,
    VirtioNetHdr,
    checksum,
    ones_sum,
    pseudo_header_sum,
)


class ForwardError(ValueError):
    """A packet the fast path cannot forward; ``reason`` is the stats counter it lands in."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# --------------------------------------------------------------------------------------------
# Next hops and members

_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


def unicast_ipv4(value) -> str:
    """``value`` as a canonical dotted IPv4 address, ValueError unless it is one a packet can be
    sent to and come from: not 0.0.0.0, 255.255.255.255 or multicast.  (The C loop takes
    0.0.0.0 as "no route" and the Python loops would send to it: the same table would behave
    differently per loop.)  Next hops, members and the command line's addresses alike."""
    try:
        addr = ipaddress.IPv4Address(value)
    except (ValueError, TypeError):
        raise ValueError(f"not an IPv4 address: {value!r}") from None
    if addr.is_unspecified or addr == _BROADCAST or addr.is_multicast:
        raise ValueError(f"not a unicast IPv4 address: {value!r}")
    return str(addr)


_MISS = object()
_SOURCE_MEMO = 4096  # inner sources whose peer is remembered (forgotten all at once beyond)


class NextHopTable:
    """Longest-prefix match from inner destination (IPv4 or IPv6) to a peer's underlay address
    (IPv4: the underlay's family, whatever the inner one); and, on the receive side, the
    reverse-path check of inner sources (:meth:`source_ok`)."""

    def __init__(self, routes: Mapping[str, str] | None = None) -> None:
        by_len: dict[tuple[int, int], dict[int, str]] = {}
        canonical: dict[str, str] = {}
        for prefix, via in (routes or {}).items():
            try:
                net = ipaddress.ip_network(prefix, strict=True)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"bad next-hop prefix {prefix!r}: {exc}") from None
            try:
                hop = unicast_ipv4(via)
            except ValueError as exc:
                raise ValueError(f"bad next-hop address {via!r} for {prefix} ({exc}; an underlay address)") from None
            by_len.setdefault((net.max_prefixlen, net.prefixlen), {})[int(net.network_address)] = hop
            canonical[str(net)] = hop
        # Per family (by address length in bits), longest first; each entry carries its mask so
        # lookup is one AND and one dict get.
        self._levels: dict[int, list[tuple[int, dict[int, str]]]] = {32: [], 128: []}
        for (bits, plen), entries in sorted(by_len.items(), key=lambda kv: -kv[0][1]):
            self._levels[bits].append((((1 << bits) - 1) ^ ((1 << (bits - plen)) - 1), entries))
        self.routes: dict[str, str] = canonical
        self._source_peer: dict[bytes, bytes | None] = {}  # inner source -> its peer, packed

    def __len__(self) -> int:
        return len(self.routes)

    def lookup(self, dst: bytes | str) -> str | None:
        """The peer for ``dst`` (4 or 16 packed bytes, or an address string), or None."""
        if isinstance(dst, str):
            dst = ipaddress.ip_address(dst).packed
        addr = int.from_bytes(dst, "big")
        for mask, entries in self._levels[len(dst) * 8]:
            hop = entries.get(addr & mask)
            if hop is not None:
                return hop
        return None

    def source_ok(self, src: bytes, sender: bytes) -> bool:
        """The receive side's reverse-path check: may an inner packet whose source is ``src``
        (4 or 16 packed bytes) come from the peer whose underlay address is ``sender`` (4 packed
        bytes)?  Only where ``src`` lies in a prefix routed to that peer -- its pods, and its
        tunnel device's address, which its host's own packets and its node ports' SNAT come
        from (the kernel picks it for routes through the TUN), and which its kernel's ICMP
        errors about our pods' packets come from -- or is ``sender`` itself (its host
        answering from its underlay address).  Anything else a member sends would pose as
        another node's pods, or as this node (the TUN takes local sources: accept_local):
        dropped, counted ``spoofed``.  As _fastpath.c's source_ok."""
        peer = self._source_peer.get(src, _MISS)
        if peer is _MISS:
            if len(self._source_peer) >= _SOURCE_MEMO:
                self._source_peer.clear()
            hop = self.lookup(src)
            peer = self._source_peer[src] = None if hop is None else socket.inet_aton(hop)
        return peer == sender or src == sender


def parse_members(members: Iterable[str], own: str | None = None) -> frozenset[str]:
    """Validate underlay member addresses; returns canonical dotted strings.  ``own`` (the
    worker's own underlay address) is left out: a node never encapsulates to itself, so a
    packet from it is a local process's, which must not put forged pod packets into the TUN."""
    if isinstance(members, (str, bytes)):
        raise ValueError("members must be a collection of IPv4 addresses, not a single string")
    out = set()
    for m in members:
        try:
            out.add(unicast_ipv4(m))
        except ValueError as exc:
            raise ValueError(f"bad member address {m!r} ({exc})") from None
    if own is not None:
        out.discard(str(ipaddress.IPv4Address(own)))
    return frozenset(out)


# --------------------------------------------------------------------------------------------
# Checksum completion (VIRTIO_NET_HDR_F_NEEDS_CSUM)

_pack_H = struct.Struct("!H").pack_into
_unpack_H = struct.Struct("!H").unpack_from
_pack_I = struct.Struct("!I").pack_into
_pack_HH = struct.Struct("!HH").pack_into
_unpack_I = struct.Struct("!I").unpack_from


def complete_checksum(buf, off: int, end: int, csum_start: int, csum_offset: int) -> None:
    """Store the checksum over ``buf[off+csum_start:end]`` at ``off+csum_start+csum_offset``
    (an IPv4 or IPv6 packet at ``buf[off:end]``).

    The field already holds the folded pseudo-header sum (that is what the kernel leaves for
    CHECKSUM_PARTIAL), so summing the region with it in place gives the final value.
    """
    start = off + csum_start
    where = start + csum_offset
    v6 = buf[off] >> 4 == 6
    if csum_start < (40 if v6 else 20) or where + 2 > end:
        raise ForwardError("malformed", f"checksum offsets {csum_start}+{csum_offset} outside the packet")
    value = checksum(memoryview(buf)[start:end])
    if value == 0 and buf[off + (6 if v6 else 9)] == IPPROTO_UDP:
        value = 0xFFFF  # RFC 768 (RFC 8200 §8.1 for IPv6): a computed zero is sent as all ones
    _pack_H(buf, where, value)


# --------------------------------------------------------------------------------------------
# TSO segmentation (transmit side)


def tcp_headers(pkt) -> tuple[int, int]:
    """(IP header length, TCP header length) of a TCP/IPv4 packet or a TCP/IPv6 packet whose
    next header is TCP (no extension headers: a TSO super-packet from a TUN has none);
    ForwardError("malformed") for anything else."""
    n = len(pkt)
    version = pkt[0] >> 4 if n else 0
    if version == 4 and n >= 40 and pkt[9] == IPPROTO_TCP:
        ihl = (pkt[0] & 0x0F) << 2
    elif version == 6 and n >= 60 and pkt[6] == IPPROTO_TCP:
        ihl = 40
    else:
        raise ForwardError("malformed", "TSO super-packet is not TCP over IPv4 or IPv6")
    thl = (pkt[ihl + 12] >> 4) << 2 if ihl + 12 < n else 0
    if ihl < 20 or thl < 20 or ihl + thl > n:
        raise ForwardError("malformed", "TSO super-packet headers exceed the packet")
    return ihl, thl


def segment_tcp(pkt, gso_size: int, out: bytearray, ttl_decrement: bool = False) -> tuple[int, int, int]:
    """Segment the TCP super-packet ``pkt`` (a memoryview of exactly the packet, IPv4 or IPv6)
    into packets of at most ``gso_size`` payload bytes, written back to back from ``out[0]``.

    Mirrors Linux ``tcp_gso_segment`` with ``inet_gso_segment`` / ``ipv6_gso_segment``: IPv4
    ID increments per segment and every IPv4 header checksum is computed; IPv6 has no header
    checksum, its payload length is set per segment (RFC 8200 §3); sequence numbers advance by
    the MSS, CWR stays on the first segment only and FIN/PSH on the last, every TCP checksum is
    computed in full over its pseudo header (RFC 8200 §8.1 for IPv6): the wire carries what a
    kernel sender would put there, so kernel receivers verify it.  With ``ttl_decrement`` the
    TTL (IPv6: hop limit) is decremented once for all segments (flannel's user-space router hop).

    Returns ``(count, segment_length, total_length)``: every segment is ``segment_length``
    bytes except possibly the last, as UDP_SEGMENT requires.
    """
    n = len(pkt)
    ihl, thl = tcp_headers(pkt)
    v6 = ihl == 40 and pkt[0] >> 4 == 6
    hl = ihl + thl
    if gso_size <= 0:
        raise ForwardError("malformed", f"gso_size {gso_size}")
    plen = n - hl
    count = -(-plen // gso_size) if plen else 1
    seglen = hl + gso_size
    total = plen + count * hl
    if total > len(out):
        raise ForwardError("malformed", "super-packet too large for the segment buffer")

    hdr = bytearray(pkt[:hl])
    hop_at = 7 if v6 else 8
    ttl = hdr[hop_at]
    if ttl_decrement:
        if ttl <= 1:
            raise ForwardError("ttl_exceeded", "TTL exceeded")
        hdr[hop_at] = ttl - 1
    ident0 = 0 if v6 else (hdr[4] << 8) | hdr[5]
    seq0 = _unpack_I(hdr, ihl + 4)[0]
    flags = hdr[ihl + 13]
    mid_flags = flags & ~(TCP_FIN | TCP_PSH | TCP_CWR)
    # IPv4 header sum without total length, ID and checksum; TCP header sum (plus pseudo header
    # without the length) without sequence number and checksum, flags as in a middle segment.
    if v6:
        hdr[4] = hdr[5] = 0
        ip_base = 0
        src, dst = bytes(hdr[8:24]), bytes(hdr[24:40])
    else:
        hdr[2] = hdr[3] = hdr[4] = hdr[5] = hdr[10] = hdr[11] = 0
        ip_base = ones_sum(memoryview(hdr)[:ihl])
        src, dst = bytes(hdr[12:16]), bytes(hdr[16:20])
    hdr[ihl + 4] = hdr[ihl + 5] = hdr[ihl + 6] = hdr[ihl + 7] = 0
    hdr[ihl + 16] = hdr[ihl + 17] = 0
    hdr[ihl + 13] = mid_flags
    tcp_base = ones_sum(memoryview(hdr)[ihl:hl], pseudo_header_sum(src, dst, IPPROTO_TCP, 0))

    frombytes = int.from_bytes
    pack_HH, pack_H, pack_I = _pack_HH, _pack_H, _pack_I
    tcp_flags_at = ihl + 13
    tcp_csum_at = ihl + 16
    seq_at = ihl + 4
    o = 0
    pos = hl
    last = count - 1
    for i in range(count):
        chunk = pkt[pos : pos + gso_size]
        clen = len(chunk)
        pos += gso_size
        out[o : o + hl] = hdr
        out[o + hl : o + hl + clen] = chunk
        seg_total = hl + clen
        if v6:
            pack_H(out, o + 4, seg_total - 40)
        else:
            ident = (ident0 + i) & 0xFFFF
            s = ip_base + seg_total + ident
            r = s % 0xFFFF
            pack_HH(out, o + 2, seg_total, ident)
            pack_H(out, o + 10, 0xFFFF - r if r else 0)
        seq = (seq0 + i * gso_size) & 0xFFFFFFFF
        pack_I(out, o + seq_at, seq)
        f = mid_flags
        if i == 0:
            f |= flags & TCP_CWR
        if i == last:
            f |= flags & (TCP_FIN | TCP_PSH)
        s = tcp_base + thl + clen + (seq >> 16) + (seq & 0xFFFF) + (f - mid_flags)
        out[o + tcp_flags_at] = f
        payload = frombytes(chunk, "big")
        if clen & 1:
            payload <<= 8
        r = (s + payload) % 0xFFFF
        pack_H(out, o + tcp_csum_at, 0xFFFF - r if r else 0)
        o += seg_total
    return count, seglen if count > 1 else total, total


def segment_tcp_packets(vnet: VirtioNetHdr, pkt: bytes, ttl_decrement: bool = False) -> list[bytes]:
    """Convenience wrapper around :func:`segment_tcp` returning one bytes per segment."""
    out = bytearray(len(pkt) + (len(pkt) // max(vnet.gso_size, 1) + 1) * 120)
    count, seglen, total = segment_tcp(memoryview(pkt), vnet.gso_size, out, ttl_decrement)
    return [bytes(out[i : min(i + seglen, total)]) for i in range(0, total, seglen)][:count]
