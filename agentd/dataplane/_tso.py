"""TSO segmentation in user space, vectorized over all segments of many super-packets (numpy).

A TUN with TUN_F_TSO4 / TUN_F_TSO6 hands over one TCP packet of up to 64 KB; the wire needs ~45
packets of at most the MTU, each with its own IPv4 total length, ID and checksum (IPv6: its own
payload length, and no header checksum) and its own TCP sequence number and checksum (Linux
``tcp_gso_segment`` with ``inet_gso_segment`` / ``ipv6_gso_segment``).  Packet by
packet in CPython that costs ~5 µs a segment, mostly the TCP checksum.  Here:

* **No copy.**  The TUN is read with ``readv`` straight into a *block* laid out as the wire
  wants it: row ``i`` of the block is segment ``i`` (``hl + gso_size`` bytes, the stride UDP GSO
  and the sendmmsg iovecs want); the first iovec takes the headers and the first payload, the
  next ones each later payload, leaving room for a header in front of it.  That needs the
  header length and MSS (and the IP version) in advance: the segmenter keeps the last ones seen
  (a TCP flow keeps them), and a super-packet that does not match is gathered and segmented
  from a copy.
* **Whole batches.**  All super-packets read in one go (up to ``blocks``) are segmented with
  the same ~20 numpy calls: the output is a ``(frames, rows, stride)`` array; the header
  template is one broadcast; per-row fields (IPv4 ID, sequence number, checksums) are columns of it;
  the payload checksums are one ``add.reduce`` over 32-bit little-endian words into 64-bit
  accumulators.  RFC 1071 §2: the one's-complement sum is the value modulo 0xFFFF (2**16 ≡ 1),
  so 32-bit words sum to the same value as 16-bit ones, and little-endian words give the
  byte-swapped sum, i.e. the big-endian one times 256 modulo 0xFFFF.  The complement is then
  ``(-s) mod 0xFFFF``: 0xFFFF - r for r != 0 and 0 for r == 0, exactly the folded value.

Rows past a super-packet's last segment hold junk that is computed on and never sent.
Geometries numpy cannot view this way (an odd MSS, a single segment, IPv4 options) go to the
scalar :func:`segment_tcp`, which is also the reference the tests compare against.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass

import numpy as np

from agentd.dataplane._forward import ForwardError, segment_tcp, tcp_headers
from agentd.dataplane._sockopt import iovec
from proto.packet import (
    IPPROTO_TCP,
    TCP_CWR,
    TCP_FIN,
    TCP_PSH,
    VIRTIO_NET_HDR_GSO_TCPV4,
    VIRTIO_NET_HDR_GSO_TCPV6,
    VIRTIO_NET_HDR_LEN,
    ones_sum,
    pseudo_header_sum,
)

MAX_VECTOR_SEGMENTS = 1024  # beyond this (a tiny MSS) the scalar path is as good
MAX_TUN_PACKET = 0xFFFF + VIRTIO_NET_HDR_LEN
_K_IP = np.uint64(0xFFFF << 24)   # multiples of 0xFFFF above any sum they are subtracted from
_K_TCP = np.uint64(0xFFFF << 48)
_unpack_I = struct.Struct("!I").unpack_from
_pack_H = struct.Struct("!H").pack_into


def _complement(s: int) -> int:
    return (-s) % 0xFFFF


_libc = ctypes.CDLL(None, use_errno=True)
_readv = _libc.readv
_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_readv.restype = ctypes.c_ssize_t


def _address(view: memoryview) -> int:
    """Address of the first byte of a (writable) memoryview; its bytearray is never resized."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class _Grid:
    """numpy views of ``frames`` x ``rows`` segments of ``hl + gso`` bytes at ``out[off:]``,
    made once per geometry: making a view costs about as much as using it.  IPv6 (``ihl`` 40)
    has no ID or header checksum column: its payload length is the template's but in the last
    row."""

    __slots__ = ("rows", "headers", "ids", "seqs", "ipsum", "tcpsum", "words", "payload")

    def __init__(self, out: np.ndarray, off: int, frames: int, rows: int, ihl: int, hl: int, gso: int,
                 v4: bool = True) -> None:
        stride = hl + gso
        g = out[off : off + frames * rows * stride].reshape(frames, rows, stride)
        self.rows = rows
        self.headers = g[:, :, :hl]
        self.ids = g[:, :, 4:6].view(">u2")[..., 0] if v4 else None
        self.seqs = g[:, :, ihl + 4 : ihl + 8].view(">u4")[..., 0]
        self.ipsum = g[:, :, 10:12].view(">u2")[..., 0] if v4 else None
        self.tcpsum = g[:, :, ihl + 16 : ihl + 18].view(">u2")[..., 0]
        self.words = g[:, :, hl:].view("<u4" if gso & 3 == 0 else "<u2")
        self.payload = g[0, :, hl:]


@dataclass(frozen=True)
class Geometry:
    """Header length, MSS and IP version of the super-packets a block layout expects (the
    layout itself depends on the first two; a vectorized pass takes one version)."""

    hl: int
    gso: int
    version: int = 4

    @property
    def ihl(self) -> int:
        return 40 if self.version == 6 else 20

    @property
    def stride(self) -> int:
        return self.hl + self.gso


class TsoSegmenter:
    """Segments super-packets into ``out`` (a bytearray that is never resized).

    Block mode (the worker's fast path): :meth:`read` reads a super-packet into block ``j``
    (:meth:`read_iovecs`: the buffers that readv fills); :meth:`fits` says whether what arrived
    can be segmented in place; :meth:`segment_blocks` segments blocks ``0..k-1`` at once.  Anything else:
    :meth:`gather` makes the packet contiguous in ``inbuf`` and :meth:`segment` segments it
    from there (copying), or the caller handles it as a plain packet.
    """

    def __init__(self, inbuf: bytearray, out: bytearray, *, mtu: int = 1500, blocks: int = 0,
                 block_area: int | None = None) -> None:
        self.inbuf = inbuf
        self.out = out
        self._in = memoryview(inbuf)
        self._out = memoryview(out)
        self._src = np.frombuffer(inbuf, np.uint8)
        self._dst = np.frombuffer(out, np.uint8)
        self._zeros = memoryview(bytes(65536))
        self._ar16 = np.arange(MAX_VECTOR_SEGMENTS, dtype=np.uint16)
        self._ar32 = np.arange(MAX_VECTOR_SEGMENTS, dtype=np.uint32)
        self._steps: dict[int, np.ndarray] = {}
        self._grids: dict[tuple, _Grid] = {}
        self.vectorized = 0  # super-packets segmented with numpy (the rest went scalar)
        self.gathered = 0    # super-packets that did not match the block layout
        # Block mode: blocks of `rows` segment slots at out[j * block_bytes:], a virtio-net
        # header per block, an overflow area for what a wrong guess does not fit.
        self.blocks = blocks
        self.block_area = len(out) if block_area is None else block_area
        self.vnet = bytearray(VIRTIO_NET_HDR_LEN * max(blocks, 1))
        self._vnet = memoryview(self.vnet)
        self._overflow_buf = bytearray(MAX_TUN_PACKET)
        self._overflow = memoryview(self._overflow_buf)
        self._iovecs: dict[Geometry, list[list[memoryview]]] = {}
        self._raw_iovecs: dict[Geometry, list] = {}  # the same as ctypes arrays, for readv(2) itself
        self.geometry = Geometry(52, mtu - 52)  # IPv4 + TCP with timestamps, the common case
        self.block_bytes = 0
        if blocks:
            self._set_geometry(self.geometry)

    # -- block mode ------------------------------------------------------------------------------

    def rows_for(self, geometry: Geometry) -> int:
        return -(-(0xFFFF - geometry.hl) // geometry.gso) + 1

    def _set_geometry(self, geometry: Geometry) -> None:
        rows = self.rows_for(geometry)
        need = self.blocks * rows * geometry.stride
        if geometry.gso <= 0 or geometry.gso & 1 or rows > MAX_VECTOR_SEGMENTS or need > self.block_area:
            return  # not one numpy can take: keep the previous layout
        self.geometry = geometry
        self.block_bytes = rows * geometry.stride

    def read_iovecs(self, j: int) -> list[memoryview]:
        """The buffers for one ``readv`` of a super-packet into block ``j``."""
        geo = self.geometry
        lists = self._iovecs.get(geo)
        if lists is None:
            if len(self._iovecs) > 8:
                self._iovecs.clear()
            lists = self._iovecs[geo] = [None] * self.blocks
        iov = lists[j]
        if iov is None:
            out, stride, hl = self._out, geo.stride, geo.hl
            b = j * self.block_bytes
            iov = [self._vnet[j * VIRTIO_NET_HDR_LEN : (j + 1) * VIRTIO_NET_HDR_LEN], out[b : b + stride]]
            iov += [out[b + i * stride + hl : b + (i + 1) * stride] for i in range(1, self.rows_for(geo))]
            iov.append(self._overflow)
            lists[j] = iov
        return iov

    def read(self, fd: int, j: int) -> int:
        """``readv`` one packet from ``fd`` into block ``j`` (libc's readv on a prebuilt iovec
        array: os.readv would build ~50 buffer objects per call).  Returns the bytes read,
        raises BlockingIOError when there is nothing to read."""
        geo = self.geometry
        lists = self._raw_iovecs.get(geo)
        if lists is None:
            if len(self._raw_iovecs) > 8:
                self._raw_iovecs.clear()
            lists = self._raw_iovecs[geo] = [None] * self.blocks
        raw = lists[j]
        if raw is None:
            views = self.read_iovecs(j)
            arr = (iovec * len(views))()
            for i, v in enumerate(views):
                arr[i].iov_base = _address(v)
                arr[i].iov_len = len(v)
            raw = lists[j] = (arr, ctypes.addressof(arr), len(views))
        while True:
            n = _readv(fd, raw[1], raw[2])
            if n >= 0:
                return n
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue  # as os.readv does (PEP 475)
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise BlockingIOError(err, os.strerror(err))
            raise OSError(err, os.strerror(err))

    def packet(self, j: int, n: int) -> memoryview:
        """Block ``j``'s packet (``n`` bytes were read, virtio-net header included) if it lies
        contiguous in the first row, else None."""
        size = n - VIRTIO_NET_HDR_LEN
        if size > self.geometry.stride:
            return None
        b = j * self.block_bytes
        return self._out[b : b + size]

    def fits(self, j: int, n: int, gso_size: int) -> bool:
        """Whether block ``j`` holds a TCP super-packet of the block geometry (IPv4 without
        options, or IPv6 whose next header is TCP) with at least two segments (then
        :meth:`segment_blocks` can take it in place)."""
        geo = self.geometry
        if gso_size != geo.gso:
            return False
        b = j * self.block_bytes
        out = self.out
        if geo.version == 4:
            if out[b] != 0x45 or out[b + 9] != IPPROTO_TCP or 20 + ((out[b + 32] >> 4) << 2) != geo.hl:
                return False
        elif out[b] >> 4 != 6 or out[b + 6] != IPPROTO_TCP or 40 + ((out[b + 52] >> 4) << 2) != geo.hl:
            return False
        plen = n - VIRTIO_NET_HDR_LEN - geo.hl
        return geo.gso < plen and -(-plen // geo.gso) < self.rows_for(geo)

    def gather(self, j: int, n: int) -> memoryview:
        """Copy what ``readv`` scattered into block ``j`` to ``inbuf[10:n]`` (contiguous) and
        return it; the next super-packets of this kind are expected in their layout."""
        pieces = self.read_iovecs(j)
        self.inbuf[:VIRTIO_NET_HDR_LEN] = pieces[0]
        pos, left = VIRTIO_NET_HDR_LEN, n - VIRTIO_NET_HDR_LEN
        for piece in pieces[1:]:
            take = min(left, len(piece))
            self.inbuf[pos : pos + take] = piece[:take]
            pos += take
            left -= take
            if not left:
                break
        self.gathered += 1
        pkt = self._in[VIRTIO_NET_HDR_LEN:n]
        flags, gso_type, _, gso_size, _, _ = struct.unpack_from("<BBHHHH", self.inbuf, 0)
        gso_type &= 0x7F
        if gso_size and gso_type == VIRTIO_NET_HDR_GSO_TCPV4 and len(pkt) > 40 and pkt[0] == 0x45 \
                and pkt[9] == IPPROTO_TCP:
            self._set_geometry(Geometry(20 + ((pkt[32] >> 4) << 2), gso_size))
        elif gso_size and gso_type == VIRTIO_NET_HDR_GSO_TCPV6 and len(pkt) > 60 and pkt[0] >> 4 == 6 \
                and pkt[6] == IPPROTO_TCP:
            self._set_geometry(Geometry(40 + ((pkt[52] >> 4) << 2), gso_size, 6))
        return pkt

    def segment_blocks(self, k: int, lengths: list[int], ttl_decrement: bool) -> list[tuple[int, int, int]]:
        """Segment the super-packets in blocks ``0..k-1`` (``lengths``: bytes read, virtio-net
        header included; every block :meth:`fits`) in place.  Returns ``(count, stride, total)``
        per block; raises nothing: the caller dropped TTL-expired ones before."""
        geo = self.geometry
        hl, gso, stride, ihl = geo.hl, geo.gso, geo.stride, geo.ihl
        key = ("blocks", geo, self.blocks)
        grid = self._grids.get(key)
        if grid is None:
            grid = self._grids[key] = _Grid(self._dst, 0, self.blocks, self.rows_for(geo), ihl, hl, gso,
                                            geo.version == 4)
        frames = []
        out = self._out
        for j in range(k):
            b = j * self.block_bytes
            plen = lengths[j] - VIRTIO_NET_HDR_LEN - hl
            count = -(-plen // gso)
            last = plen - (count - 1) * gso
            end = b + (count - 1) * stride + hl + last
            out[end : b + count * stride] = self._zeros[: gso - last]  # row sums and odd lengths
            frames.append((b, count, last, *_template(out[b : b + hl], ihl, hl, gso, ttl_decrement)))
        return self._fill(grid, k, frames, hl, ihl, gso)

    # -- one super-packet, copied ------------------------------------------------------------------

    def segment(self, start: int, n: int, gso_size: int, off: int,
                ttl_decrement: bool = False) -> tuple[int, int, int]:
        """Segment the super-packet ``inbuf[start:start+n]`` into ``out[off:]``; same contract
        and result as :func:`segment_tcp`: ``(count, segment_length, total_length)``,
        segments back to back, all but the last ``segment_length`` long."""
        pkt = self._in[start : start + n]
        ihl, thl = tcp_headers(pkt)
        v4 = pkt[0] >> 4 == 4
        hl = ihl + thl
        plen = n - hl
        if gso_size <= 0 or gso_size & 1 or plen <= gso_size or -(-plen // gso_size) > MAX_VECTOR_SEGMENTS:
            return segment_tcp(pkt, gso_size, self._out[off:], ttl_decrement)
        count = -(-plen // gso_size)
        stride = hl + gso_size
        if off + count * stride > len(self.out):
            raise ForwardError("malformed", "super-packet too large for the segment buffer")
        if ttl_decrement and pkt[8 if v4 else 7] <= 1:
            raise ForwardError("ttl_exceeded", "TTL exceeded")
        key = (off, ihl, hl, gso_size, count, v4)
        grid = self._grids.get(key)
        if grid is None:
            if len(self._grids) > 512:
                self._grids.clear()
            grid = self._grids[key] = _Grid(self._dst, off, 1, count, ihl, hl, gso_size, v4)
        full = count - 1
        last = plen - full * gso_size
        src = self._src[start + hl : start + hl + full * gso_size]
        grid.payload[:full] = src.reshape(full, gso_size)
        out = self._out
        lo = off + full * stride
        out[lo + hl : lo + hl + last] = pkt[hl + full * gso_size :]
        out[lo + hl + last : lo + stride] = self._zeros[: gso_size - last]
        frame = (off, count, last, *_template(pkt[:hl], ihl, hl, gso_size, ttl_decrement))
        return self._fill(grid, 1, [frame], hl, ihl, gso_size)[0]

    # -- the vectorized part -------------------------------------------------------------------------

    def _fill(self, grid: _Grid, k: int, frames: list, hl: int, ihl: int, gso: int) -> list[tuple[int, int, int]]:
        rows = grid.rows
        stride = hl + gso
        v4 = grid.ids is not None
        grid.headers[:k] = np.frombuffer(b"".join([f[3] for f in frames]), np.uint8).reshape(k, 1, hl)
        if v4:
            ids = self._ar16[:rows] + np.array([f[4] for f in frames], np.uint16)[:, None]   # wraps mod 2**16
            grid.ids[:k] = ids
        steps = self._steps.get(gso)
        if steps is None:
            steps = self._steps[gso] = self._ar32 * np.uint32(gso)
        seqs = steps[:rows] + np.array([f[5] for f in frames], np.uint32)[:, None]       # wraps mod 2**32
        grid.seqs[:k] = seqs
        if v4:
            s = ids + np.array([f[8] for f in frames], np.uint64)[:, None]
            np.subtract(_K_IP, s, out=s)
            np.remainder(s, 0xFFFF, out=s)
            grid.ipsum[:k] = s
        t = np.add.reduce(grid.words[:k], axis=2, dtype=np.uint64)
        t *= np.uint64(256)       # little-endian word sum -> big-endian, modulo 0xFFFF
        t += seqs                 # a 32-bit value is its two 16-bit halves modulo 0xFFFF
        t += np.array([f[9] for f in frames], np.uint64)[:, None]
        firsts = t[:, 0].tolist()
        lasts = t[np.arange(k), np.array([f[1] - 1 for f in frames])].tolist()
        np.subtract(_K_TCP, t, out=t)
        np.remainder(t, 0xFFFF, out=t)
        grid.tcpsum[:k] = t

        # First and last segments differ in flags (and the last in length): patch them.
        out = self.out
        results = []
        for i, (off, count, last, _tpl, ident0, _seq0, flags, mid, ip_base, _tcp_base) in enumerate(frames):
            f_first = mid | (flags & TCP_CWR)
            if f_first != mid:
                out[off + ihl + 13] = f_first
                _pack_H(out, off + ihl + 16, _complement(firsts[i] + f_first - mid))
            full = count - 1
            lo = off + full * stride
            f_last = mid | (flags & (TCP_FIN | TCP_PSH))
            last_total = hl + last
            if v4:
                _pack_H(out, lo + 2, last_total)
                _pack_H(out, lo + 10, _complement(ip_base - stride + last_total + ((ident0 + full) & 0xFFFF)))
            else:
                _pack_H(out, lo + 4, last_total - 40)  # the IPv6 payload length
            out[lo + ihl + 13] = f_last
            _pack_H(out, lo + ihl + 16, _complement(lasts[i] - gso + last + f_last - mid))
            results.append((count, stride, full * stride + last_total))
        self.vectorized += k
        return results


def _template(header, ihl: int, hl: int, gso: int, ttl_decrement: bool) -> tuple:
    """The header every segment starts from: the length of a full segment (IPv4 total length,
    IPv6 payload length), fields that differ per segment zeroed, flags as in a middle segment
    (CWR only on the first, FIN/PSH only on the last: tcp_gso_segment); with the sums the
    checksums start from (IPv6: no header checksum, its ID fields 0)."""
    hdr = bytearray(header)
    v6 = hdr[0] >> 4 == 6
    hop_at = 7 if v6 else 8
    if ttl_decrement:
        if hdr[hop_at] <= 1:
            raise ForwardError("ttl_exceeded", "TTL exceeded")
        hdr[hop_at] -= 1
    seq0 = _unpack_I(hdr, ihl + 4)[0]
    flags = hdr[ihl + 13]
    mid = flags & ~(TCP_FIN | TCP_PSH | TCP_CWR)
    if v6:
        _pack_H(hdr, 4, hl - 40 + gso)
        ident0 = ip_base = 0
        src, dst = bytes(hdr[8:24]), bytes(hdr[24:40])
    else:
        ident0 = (hdr[4] << 8) | hdr[5]
        _pack_H(hdr, 2, hl + gso)
        hdr[4] = hdr[5] = hdr[10] = hdr[11] = 0
        ip_base = ones_sum(memoryview(hdr)[:ihl])
        src, dst = bytes(hdr[12:16]), bytes(hdr[16:20])
    hdr[ihl + 4 : ihl + 8] = b"\0\0\0\0"
    hdr[ihl + 16] = hdr[ihl + 17] = 0
    hdr[ihl + 13] = mid
    tcp_base = ones_sum(memoryview(hdr)[ihl:hl], pseudo_header_sum(src, dst, IPPROTO_TCP, hl - ihl + gso))
    return bytes(hdr), ident0, seq0, flags, mid, ip_base, tcp_base
