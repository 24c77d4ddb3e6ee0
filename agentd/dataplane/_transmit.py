"""TUN -> underlay in Python: the reference and fall-back for the C loop (``_fastpath.c``).

The worker moves packets from its TUN device to the underlay one of four ways, chosen by one
table (:data:`LOOPS`, keyed by ``--offload`` and ``--segmentation``) and by whether the C file
is built and wanted; the backend (udp, ipip) is the transport's business, not the loop's:

=========  =========================================================================================
c          offloads on, user segmentation, C built: ``_fast.FastPath.run`` (the worker's poll loop)
blocks     offloads on, user segmentation, in Python: :class:`BlocksLoop` -- TSO
           super-packets read into blocks, segmented by one vectorized pass (``_tso``)
batched    offloads on, the kernel segments: :class:`BatchedLoop` -- runs of equal-sized
           packets to one peer, one UDP-GSO sendmsg or one sendmmsg batch each
plain      no offloads: :class:`PlainLoop` -- one read, one send (flannel's model, the
           honest per-packet baseline)
=========  =========================================================================================

Inner packets are IPv4, and IPv6 where the backend carries it (udp: flannel's payload is the
inner packet, whatever its family; ipip is IPv4 in IPv4 only): TCPv6 super-packets are
segmented as TCPv4 ones are, the hop limit is decremented where the TTL is, and the ICMP
errors are ICMPv6 ones (RFC 4443).

The loops differ in how they read and batch, which is where their speed comes from, and each
keeps its per-packet checks inline (a shared per-packet function would cost the Python loops
a call per packet); what they share -- the next-hop table and its cache, ICMP errors, the TUN
writes, the counters -- lives once, here.  ``tests/unit/agentd/test_fastpath.py`` holds the C
loop to the bytes the reference segmenter makes; the system tests run every loop.
"""

from __future__ import annotations

import os
import socket
import struct
import time

from agentd.dataplane._forward import ForwardError, NextHopTable, complete_checksum
from agentd.dataplane._tso import TsoSegmenter
from proto.packet import (
    VIRTIO_NET_HDR_F_NEEDS_CSUM,
    VIRTIO_NET_HDR_GSO_NONE,
    VIRTIO_NET_HDR_GSO_TCPV4,
    VIRTIO_NET_HDR_GSO_TCPV6,
    VNET_HDR_NONE,
    decrement_hop_limit,
    decrement_ttl,
    icmp6_hop_limit_exceeded,
    icmp6_no_route,
    icmp6_packet_too_big,
    icmp_frag_needed,
    icmp_net_unreachable,
    icmp_time_exceeded,
)

_VNET = struct.Struct("<BBHHHH")
_TUN_BUF = 65536 + 64
_TSO_BLOCKS = 16  # super-packets read (into their own blocks) before one vectorized segmentation
_OUT_BUF = 3 << 20  # the blocks (~70 KB each), then room for plain packets and the copied path
_OUT_HEADROOM = 256 << 10  # a 64 KB super-packet with a tiny MSS still fits after this
_SINGLES = 1 << 20  # out[-_SINGLES:]: plain packets waiting (in order) for the blocks' segmentation
BUDGET = 64  # packets (reads) per loop call before the poll loop looks at the other sockets
# The ICMP error a drop answers, by reason and the offender's IP version (RFC 792, RFC 4443).
ICMP_ERRORS = {
    ("no_route", 4): icmp_net_unreachable,
    ("no_route", 6): icmp6_no_route,
    ("ttl_exceeded", 4): icmp_time_exceeded,
    ("ttl_exceeded", 6): icmp6_hop_limit_exceeded,
}
# ICMP errors a second and the burst: as the kernel's net.ipv4.icmp_msgs_per_sec / icmp_msgs_burst
# (_fastpath.c's ICMP_RATE / ICMP_BURST).
ICMP_RATE = 1000
ICMP_BURST = 50


class IcmpRateLimit:
    """A token bucket for the worker's ICMP errors (RFC 4443 §2.4 (f) requires one for ICMPv6;
    the kernel limits its own ICMP errors alike): ``burst`` at once, ``rate`` a second after.
    Time is passed in (seconds, monotonic)."""

    def __init__(self, rate: float = ICMP_RATE, burst: int = ICMP_BURST) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.last: float | None = None

    def allow(self, now: float) -> bool:
        if self.last is not None:
            self.tokens = min(self.burst, self.tokens + max(0.0, now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1 - 1e-9:  # float sums of elapsed times fall a hair short
            return False
        self.tokens -= 1
        return True


IP_MTU = 14  # linux/in.h: a connected socket's path MTU


def path_mtu(peer: str) -> int | None:
    """The kernel's path MTU to ``peer`` (its route's, lowered by what ICMP frag needed taught
    it), read from a connected UDP socket (IP_MTU); None when it cannot be told."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((peer, 9))
        return s.getsockopt(socket.IPPROTO_IP, IP_MTU)
    except OSError:
        return None
    finally:
        s.close()


# The TSO kind of each IP version (what a TUN with TUN_F_TSO4 / TUN_F_TSO6 hands over).
GSO_TCP = {4: VIRTIO_NET_HDR_GSO_TCPV4, 6: VIRTIO_NET_HDR_GSO_TCPV6}


class Transmit:
    """The TUN -> underlay half of a worker that every loop shares: the next-hop table and its
    cache, ICMP errors, TUN writes, the counters.  Used as is beside the C loop (which hands
    back the packets that need an ICMP error); the Python loops are its subclasses below."""

    loop = "c"
    tso_blocks = 0  # TUN super-packets segmented per vectorized pass (the blocks loop only)
    from_tun = None  # the Python loop: TUN readable -> read, check, route, send

    def __init__(self, *, tun_fd: int, transport, mtu: int, ttl_decrement: bool,
                 icmp_source: str | None, counters: dict[str, int], drops: dict[str, int],
                 families: tuple[int, ...] = (4,), icmp_source_v6: str | None = None) -> None:
        self.tun_fd = tun_fd
        self.transport = transport
        self.mtu = mtu
        self.ttl_decrement = ttl_decrement
        self.icmp_source = icmp_source
        self.icmp_source_v6 = icmp_source_v6
        self.v6 = 6 in families  # the backend carries IPv6 inner packets (udp), else they are dropped
        self.c = counters
        self.drops = drops
        drops.setdefault("icmp_ratelimited", 0)
        self.icmp_limit = IcmpRateLimit()
        if transport is not None:  # what the underlay refuses as over the path MTU comes back here
            transport.too_big = self.too_big
        self.table = NextHopTable()
        self.route_cache: dict[bytes, str | None] = {}
        self.segmenter: TsoSegmenter | None = None
        if self.from_tun is not None:  # a Python loop: its buffers and the segmenter
            self.tunbuf = bytearray(_TUN_BUF)
            self.out = bytearray(_OUT_BUF)
            if hasattr(transport, "bind_tx_buffer"):
                transport.bind_tx_buffer(self.out)
            self.segmenter = TsoSegmenter(self.tunbuf, self.out, mtu=mtu,
                                          blocks=self.tso_blocks,
                                          block_area=_OUT_BUF - _SINGLES)

    def set_table(self, table: NextHopTable) -> None:
        self.table = table
        self.route_cache = {}

    def tun_write(self, parts) -> None:
        try:
            os.writev(self.tun_fd, parts)
        except OSError:
            self.drops["tun_write_error"] += 1
            return
        self.c["tun_writes"] += 1

    def resolve(self, dst: bytes) -> str | None:
        cache = self.route_cache
        if len(cache) > 65536:
            cache.clear()
        peer = cache[dst] = self.table.lookup(dst)
        return peer

    def icmp(self, reason: str, offender) -> None:
        """The ICMP (ICMPv6) error for a packet dropped for ``reason``, unless over the rate
        limit (counted ``icmp_ratelimited``): see :meth:`send_icmp`."""
        if not self.icmp_limit.allow(time.monotonic()):
            self.drops["icmp_ratelimited"] += 1
            return
        self.send_icmp(reason, offender)

    def send_icmp(self, reason: str, offender) -> None:
        """The ICMP (ICMPv6) error for a packet dropped for ``reason``, written to the TUN: from
        the worker's source address of the offender's family where it has one, else from the
        offender's destination (routed through the TUN: any reverse-path check passes).  No
        rate limit: the C loop's own bucket let this one through."""
        try:
            if offender[0] >> 4 == 6:
                src = self.icmp_source_v6 or bytes(offender[24:40])
                build = ICMP_ERRORS[(reason, 6)]
            else:
                src = self.icmp_source or bytes(offender[16:20])
                build = ICMP_ERRORS[(reason, 4)]
            self.tun_write([VNET_HDR_NONE, build(offender, src)])
        except ValueError:  # too short to answer, or an error about an error (proto.packet.DecodeError too)
            return
        self.c["icmp_sent"] += 1

    def too_big(self, offender, peer: str) -> None:
        """A packet to ``peer`` the underlay refused (EMSGSIZE: longer than the path MTU): its
        source is told the MTU it can use, unless over the rate limit (see :meth:`send_too_big`)."""
        if len(offender) < 20 or (offender[0] >> 4 == 4 and not offender[6] & 0x40):
            return  # (IPv4 without DF: a router would fragment it; we do not)
        if not self.icmp_limit.allow(time.monotonic()):
            self.drops["icmp_ratelimited"] += 1
            return
        self.send_too_big(offender, peer)

    def send_too_big(self, offender, peer: str) -> None:
        """Frag needed (RFC 1191 §4; IPv4 with DF) or packet too big (RFC 4443 §3.2; IPv6) to
        the source of ``offender``, with the path MTU to ``peer`` less the encapsulation's
        overhead, as a kernel tunnel device answers (without it TCP on that path stalls until
        its black-hole detection).  No rate limit: the caller's."""
        if len(offender) < 20 or (offender[0] >> 4 == 4 and not offender[6] & 0x40):
            return
        pmtu = path_mtu(peer)
        overhead = getattr(self.transport, "overhead", 0)
        if pmtu is None or pmtu - overhead < 68:
            return
        mtu = min(pmtu - overhead, self.mtu)
        try:
            if offender[0] >> 4 == 6:
                pkt = icmp6_packet_too_big(offender, self.icmp_source_v6 or bytes(offender[24:40]), mtu)
            else:
                pkt = icmp_frag_needed(offender, self.icmp_source or bytes(offender[16:20]), mtu)
        except ValueError:
            return
        self.tun_write([VNET_HDR_NONE, pkt])
        self.c["icmp_sent"] += 1

    # The drops that answer the sender with an ICMP error (only on the drop path: no cost per forwarded packet).

    def no_route(self, pkt) -> None:
        self.drops["no_route"] += 1
        self.icmp("no_route", pkt)

    def ttl_exceeded(self, pkt) -> None:
        self.drops["ttl_exceeded"] += 1
        self.icmp("ttl_exceeded", pkt)


class BlocksLoop(Transmit):
    loop = "blocks"
    tso_blocks = _TSO_BLOCKS

    def from_tun(self) -> None:
        """TUN -> underlay with TSO super-packets.

        Each super-packet is read straight into its own block of segment slots; up to
        ``_TSO_BLOCKS`` of them are segmented by one vectorized pass, then everything read
        goes out in the order it was read (plain packets wait in a side area meanwhile: a
        flow's packets must not overtake each other)."""
        seg = self.segmenter
        fd = self.tun_fd
        read = seg.read
        fits = seg.fits
        vnet = seg.vnet
        out = self.out
        omv = memoryview(out)
        unpack = _VNET.unpack_from
        cache = self.route_cache
        drops = self.drops
        mtu = self.mtu
        ttl_dec = self.ttl_decrement
        v6 = self.v6
        singles_start = len(out) - _SINGLES
        so = singles_start
        order: list[tuple] = []  # ("block", j, n, peer) or ("one", offset, length, peer), as read
        lengths: list[int] = []  # bytes read per block, for the vectorized pass
        j = 0
        reads = 0
        for _ in range(BUDGET):
            try:
                n = read(fd, j)
            except BlockingIOError:
                break
            reads += 1
            b = j * seg.block_bytes
            version = out[b] >> 4
            if n < 30 or version == 6 and n < 50:
                drops["malformed"] += 1
                continue
            if version == 4:
                dst = bytes(out[b + 16 : b + 20])
                hop_at = 8
            elif version == 6 and v6:
                dst = bytes(out[b + 24 : b + 40])
                hop_at = 7
            else:
                drops["not_ipv4"] += 1
                continue
            flags, gso_type, _hl, gso_size, cs, co = unpack(vnet, j * 10)
            peer = cache.get(dst, 0)
            if peer == 0:
                peer = self.resolve(dst)
            if peer is None:
                self.no_route(omv[b : b + min(n - 10, seg.geometry.stride)])
                continue
            gso_type &= 0x7F
            if gso_type == GSO_TCP[version] and fits(j, n, gso_size):
                if ttl_dec and out[b + hop_at] <= 1:
                    self.ttl_exceeded(omv[b : b + seg.geometry.stride])
                    continue
                if seg.geometry.stride > mtu:
                    drops["mtu"] += -(-(n - 10 - seg.geometry.hl) // gso_size)
                    continue
                order.append(("block", j, n, peer))
                lengths.append(n)
                j += 1
                if j == seg.blocks:
                    self._send_in_order(order, lengths)
                    order, lengths, j, so = [], [], 0, singles_start
                continue
            if gso_type == VIRTIO_NET_HDR_GSO_NONE:
                pkt = seg.packet(j, n)
                if pkt is None:
                    pkt = seg.gather(j, n)  # longer than a segment slot: beyond the MTU anyway
                total = len(pkt)
                if total > mtu:
                    drops["mtu"] += 1
                    continue
                if so + total > len(out):
                    self._send_in_order(order, lengths)
                    order, lengths, j, so = [], [], 0, singles_start
                out[so : so + total] = pkt
                try:
                    if flags & VIRTIO_NET_HDR_F_NEEDS_CSUM:
                        complete_checksum(out, so, so + total, cs, co)
                except ForwardError:
                    drops["malformed"] += 1
                    continue
                if ttl_dec and not (decrement_ttl(out, so) if version == 4 else decrement_hop_limit(out, so)):
                    self.ttl_exceeded(omv[so : so + total])
                    continue
                order.append(("one", so, total, peer))
                so += total
                continue
            # A super-packet the blocks do not fit (another MSS, header length or IP version, IPv4
            # options, one segment) or a GSO kind we never enable: after everything before it, copied.
            self._send_in_order(order, lengths)
            order, lengths, so = [], [], singles_start
            if gso_type != GSO_TCP[version]:
                drops["malformed"] += 1  # GSO kinds we never enable (UDP), or not the packet's family
                j = 0
                continue
            pkt = seg.gather(j, n)
            j = 0
            try:
                count, seglen, total = seg.segment(10, n - 10, gso_size, 0, ttl_dec)
            except ForwardError as exc:
                drops[exc.reason] += 1
                if exc.reason == "ttl_exceeded":
                    self.icmp("ttl_exceeded", pkt)
                continue
            if seglen > mtu:
                drops["mtu"] += count
                continue
            self.c["tso_frames"] += 1
            self.c["tso_segments"] += count
            self.transport.queue_run(omv, 0, seglen, count, total, peer)
            self.transport.flush()
        self._send_in_order(order, lengths)
        self.c["tun_reads"] += reads

    def _send_in_order(self, order: list[tuple], lengths: list[int]) -> None:
        """Segment the pending blocks in one vectorized pass, then hand every pending run to
        the transport in the order it was read, and flush (the blocks are reused next)."""
        if not order:
            return
        c = self.c
        runs = iter(self.segmenter.segment_blocks(len(lengths), lengths, self.ttl_decrement)) if lengths else None
        queue_run = self.transport.queue_run
        out = memoryview(self.out)
        block_bytes = self.segmenter.block_bytes
        segs = 0
        for kind, where, size, peer in order:
            if kind == "block":
                count, stride, total = next(runs)
                queue_run(out, where * block_bytes, stride, count, total, peer)
                segs += count
            else:
                queue_run(out, where, size, 1, size, peer)
        self.transport.flush()
        if lengths:
            c["tso_batches"] += 1
        c["tso_frames"] += len(lengths)
        c["tso_segments"] += segs


class BatchedLoop(Transmit):
    loop = "batched"

    def from_tun(self) -> None:
        """TUN -> underlay without TUN offloads: the kernel segments and checksums (in C), we
        read packet by packet straight into the staging buffer and send runs of equal-sized
        packets to one peer with one UDP-GSO sendmsg (or one sendmmsg batch)."""
        fd = self.tun_fd
        readv = os.readv
        scratch = bytearray(10)
        out = memoryview(self.out)
        ob = self.out
        limit = len(out) - _OUT_HEADROOM
        cache = self.route_cache
        transport = self.transport
        queue_run = transport.queue_run
        drops = self.drops
        mtu = self.mtu
        ttl_dec = self.ttl_decrement
        v6 = self.v6
        wo = 0
        reads = 0
        run_peer = None
        run_off = run_len = run_count = run_total = 0
        run_open = False
        for _ in range(BUDGET * 4):
            try:
                n = readv(fd, [scratch, out[wo : wo + 65536]]) - 10
            except BlockingIOError:
                break
            reads += 1
            version = ob[wo] >> 4 if n > 0 else 0
            if n < 20 or version == 6 and n < 40:
                drops["malformed"] += 1
                continue
            if version == 4:
                dst = bytes(ob[wo + 16 : wo + 20])
            elif version == 6 and v6:
                dst = bytes(ob[wo + 24 : wo + 40])
            else:
                drops["not_ipv4"] += 1
                continue
            peer = cache.get(dst, 0)
            if peer == 0:
                peer = self.resolve(dst)
            if peer is None:
                self.no_route(out[wo : wo + n])
                continue
            if scratch[0] & VIRTIO_NET_HDR_F_NEEDS_CSUM:
                try:
                    cs, co = struct.unpack_from("<HH", scratch, 6)
                    complete_checksum(ob, wo, wo + n, cs, co)
                except ForwardError:
                    drops["malformed"] += 1
                    continue
            if ttl_dec and not (decrement_ttl(ob, wo) if version == 4 else decrement_hop_limit(ob, wo)):
                self.ttl_exceeded(out[wo : wo + n])
                continue
            if n > mtu:
                drops["mtu"] += 1
                continue
            if run_open and peer == run_peer and n <= run_len:
                run_count += 1
                run_total += n
                if n < run_len:
                    run_open = False  # a shorter packet can only be the last of a GSO run
            else:
                if run_count:
                    queue_run(out, run_off, run_len, run_count, run_total, run_peer)
                run_peer, run_off, run_len, run_count, run_total, run_open = peer, wo, n, 1, n, True
            wo += n
            if wo > limit:
                queue_run(out, run_off, run_len, run_count, run_total, run_peer)
                run_count = 0
                run_open = False
                transport.flush()
                wo = 0
        if run_count:
            queue_run(out, run_off, run_len, run_count, run_total, run_peer)
        transport.flush()
        self.c["tun_reads"] += reads


class PlainLoop(Transmit):
    loop = "plain"

    def from_tun(self) -> None:
        """TUN -> underlay, one read and one send per packet (the per-packet baseline)."""
        fd = self.tun_fd
        readv = os.readv
        bufs = [self.tunbuf]
        tb = self.tunbuf
        mv = memoryview(tb)
        cache = self.route_cache
        send_one = self.transport.send_one
        drops = self.drops
        mtu = self.mtu
        ttl_dec = self.ttl_decrement
        v6 = self.v6
        reads = 0
        for _ in range(BUDGET):
            try:
                n = readv(fd, bufs)
            except BlockingIOError:
                break
            reads += 1
            version = tb[10] >> 4 if n > 10 else 0
            if n < 30 or version == 6 and n < 50:
                drops["malformed"] += 1
                continue
            if version == 4:
                dst = bytes(tb[26:30])
            elif version == 6 and v6:
                dst = bytes(tb[34:50])
            else:
                drops["not_ipv4"] += 1
                continue
            peer = cache.get(dst, 0)
            if peer == 0:
                peer = self.resolve(dst)
            if peer is None:
                self.no_route(mv[10:n])
                continue
            if ttl_dec and not (decrement_ttl(tb, 10) if version == 4 else decrement_hop_limit(tb, 10)):
                self.ttl_exceeded(mv[10:n])
                continue
            if n - 10 > mtu:
                drops["mtu"] += 1
                continue
            send_one(mv[10:n], peer)
        self.c["tun_reads"] += reads


# The TUN -> underlay loop by (offload, segmentation); the C loop replaces BlocksLoop where it runs.
LOOPS: dict[tuple[bool, str], type[Transmit]] = {
    (True, "user"): BlocksLoop,
    (True, "kernel"): BatchedLoop,
    (False, "user"): PlainLoop,
    (False, "kernel"): PlainLoop,
}
