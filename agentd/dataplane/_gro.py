"""GRO in user space: consecutive in-order TCP segments of one flow become one TSO
super-packet written to the TUN (virtio-net header GSO_TCPV4 or GSO_TCPV6 + NEEDS_CSUM),
following the rules of Linux ``tcp_gro_receive`` (with ``inet_gro_receive`` /
``ipv6_gro_receive``): identical IP/TCP headers except length, IPv4 ID and checksums and
sequence number; contiguous sequence numbers; every segment but the last exactly ``gso_size``
(a shorter one, or one with PSH, ends the run); only ACK (and PSH) set; no IPv4 options or
fragments, no IPv6 extension headers; at most 64 KB.  IPv6 differs only in where things are:
a 40-byte header, a payload length (not counting it) instead of a total length, no ID, no
header checksum; the TCP checksum's pseudo header has the 16-byte addresses (RFC 8200 §8.1).

Checksums are validated first, as ``tcp4_gro_receive`` / ``tcp6_gro_receive`` do
(``skb_gro_checksum_validate``): the merged packet goes to the TUN as CHECKSUM_PARTIAL, with a
checksum made afresh, so a segment corrupted on the way (the outer UDP checksum of flannel's
IPv4 packets is 0: nothing else checks it) would otherwise reach the pod as good data.  A segment
whose IPv4 header checksum or TCP checksum (pseudo header included) fails is never merged: it
ends the open run and goes to the TUN on its own, as it came, with a virtio-net header that
claims nothing (flags 0), so the pod's stack checks it, drops it and counts it
(TcpInCsumErrors); ``csum_errors`` counts it here.

The open run lives in one staging buffer laid out exactly as the TUN write wants it (virtio-net
header, the first segment's headers, then the payloads back to back), so a flush is one
``write`` and a run can go on across receive calls.  Packets arrive either one by one
(:meth:`Coalescer.add`) or as a batch of equally spaced packets (:meth:`Coalescer.add_batch`:
a UDP GRO read, a recvmmsg batch), which is checked with a handful of numpy calls over all
headers at once and copied with one strided copy per run.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Iterable

import numpy as np

from proto.packet import (
    IPPROTO_TCP,
    TCP_ACK,
    TCP_PSH,
    VIRTIO_NET_HDR_F_NEEDS_CSUM,
    VIRTIO_NET_HDR_GSO_TCPV4,
    VIRTIO_NET_HDR_GSO_TCPV6,
    VNET_HDR_NONE,
    VirtioNetHdr,
    checksum,
    pseudo_header_sum,
)

VNET_LEN = 10
MAX_IP_TOTAL = 0xFFFF
VECTOR_MIN = 6  # below this many packets the per-packet path is cheaper than numpy's call overhead

_VNET = struct.Struct("<BBHHHH")
_unpack_I = struct.Struct("!I").unpack_from
_pack_H = struct.Struct("!H").pack_into
_ZERO4 = b"\0\0\0\0"


def tcp_family(v) -> int:
    """The IP header length of a packet GRO may merge (IPv4 without options: 20; IPv6 whose
    next header is TCP: 40), or 0."""
    b = v[0]
    if b == 0x45 and v[9] == IPPROTO_TCP:
        return 20
    if b >> 4 == 6 and v[6] == IPPROTO_TCP:
        return 40
    return 0


# RFC 1071 §2(B): the sum is the same in either byte order, up to a byte swap, and a swap is a
# multiplication by 256 modulo 0xFFFF (2**16 = 1 there).  So sums of native-order words verify
# where they are 0 mod 0xFFFF (what folds to 0xFFFF, every sum here being non-zero), once the
# big-endian values added to them (protocol, TCP length) are multiplied by _BE, and a trailing
# odd byte (the high byte of a big-endian word padded with zero) by _ODD.
_BE, _ODD = (256, 1) if sys.byteorder == "little" else (1, 256)
_IPV4_PARTS = np.array([0, 6, 10], np.intp)  # in words: bytes 0-11, 12-19 (the addresses), 20-


def csum_ok(v, ihl: int) -> bool:
    """Do the checksums of the TCP packet ``v`` (exactly the packet; IP header length ``ihl``:
    20 for IPv4, 40 for IPv6) verify: IPv4's header checksum, and the TCP checksum over the
    pseudo header and the segment (RFC 9293 §3.1; RFC 8200 §8.1)?  The pseudo header's
    addresses are the bytes just before the TCP header (IPv4 12..20, IPv6 8..40), so one sum
    from there covers them and the segment; the protocol and the TCP length are added."""
    n = len(v)
    w = np.frombuffer(v, np.uint16, n >> 1)
    if ihl == 20:
        head, addrs, rest = np.add.reduceat(w, _IPV4_PARTS, dtype=np.uint32).tolist()
        if (head + addrs) % 0xFFFF:
            return False
        tcp = addrs + rest
    else:
        tcp = int(np.add.reduce(w[4:], dtype=np.uint32))
    if n & 1:
        tcp += v[n - 1] * _ODD
    return (tcp + (n - ihl + IPPROTO_TCP) * _BE) % 0xFFFF == 0


def batch_csum_failures(arr: np.ndarray, offs: np.ndarray, lens: np.ndarray, ihl: int,
                        idx: np.ndarray) -> np.ndarray:
    """:func:`csum_ok` for the packets at ``arr[offs[i]:][:lens[i]]`` (increasing even offsets,
    all read as TCP over IPv4 or IPv6 as ``ihl`` says): non-zero where a packet fails.  One
    ``np.add.reduceat`` over native 16-bit words sums, per packet, the IPv4 header's two halves
    (bytes 0-11 and 12-19, the addresses, which belong to the pseudo header too) and the rest,
    then the gap to the next packet (ignored).  ``idx``: scratch of ``len(offs)`` * 4 (IPv4) or
    * 2 (IPv6) word indices, the starts already in place (:class:`_BatchViews`)."""
    ends = offs + lens
    np.right_shift(ends, 1, out=idx[3::4] if ihl == 20 else idx[1::2])
    top = int(idx[-1])
    # Each part's sum fits 32 bits (at most 32 K words); the last part (no gap) ends the view.
    s = np.add.reduceat(arr[: 2 * top].view(np.uint16), idx[:-1], dtype=np.uint32)
    if ihl == 20:
        tcp = s[1::4] + s[2::4]
    else:
        tcp = s[0::2]
    tcp = tcp + (lens + (IPPROTO_TCP - ihl)) * _BE
    odd = lens & 1
    if odd.any():
        tcp += arr[ends - 1] * odd * _ODD
    bad = tcp % 0xFFFF
    if ihl == 20:
        bad |= (s[0::4] + s[1::4]) % 0xFFFF
    return bad


def _ip_length(h, ihl: int) -> int:
    """The packet length the IP header says: IPv4's total length, IPv6's payload length + 40."""
    return (h[2] << 8 | h[3]) if ihl == 20 else (h[4] << 8 | h[5]) + 40


def _flow_key(h, ihl: int = 20) -> bytes:
    """The header bytes that must match for two segments to merge: everything but the IP
    length, the IPv4 ID and checksum, sequence number, TCP checksum and PSH."""
    k = bytearray(h)
    if ihl == 20:
        k[2:6] = _ZERO4
        k[10] = k[11] = 0
    else:
        k[4] = k[5] = 0
    k[ihl + 4 : ihl + 8] = _ZERO4
    k[ihl + 13] &= ~TCP_PSH & 0xFF
    k[ihl + 16] = k[ihl + 17] = 0
    return bytes(k)


_MASKS: dict[tuple[int, int], np.ndarray] = {}


def _mask(hl: int, ihl: int = 20) -> np.ndarray:
    m = _MASKS.get((hl, ihl))
    if m is None:
        m = np.full(hl, 0xFF, np.uint8)
        if ihl == 20:
            m[2:6] = m[10:12] = 0
        else:
            m[4:6] = 0
        m[ihl + 4 : ihl + 8] = m[ihl + 16 : ihl + 18] = 0
        m[ihl + 13] = ~TCP_PSH & 0xFF
        m = _MASKS[(hl, ihl)] = m
    return m


def _packets_of_family(vw: _BatchViews, lens: np.ndarray) -> bool:
    """Is every row of a batch a packet of the batch's family, as the receive loops' inner
    check (_fastpath.c inner_ok, udp.inner_packet_ok) has one: IPv6 in an IPv6 batch; IPv4 in
    an IPv4 batch, with an IHL of at least 5 and a header within the packet (``lens``)?  The
    batch paths check this themselves, not trusting their callers to have: a row that fails
    is written as it came by the per-packet path, and another family's IP length is not the
    one the batch checks.  (The IP lengths: the caller's check of ``tot``.)"""
    first = vw.first.tobytes()  # (bytes' count: a tenth of a numpy comparison's cost here)
    if vw.ihl == 40:
        return first.translate(_VERSION).count(6) == len(first)
    if first.count(0x45) == len(first):
        return True  # no options: all there is to check
    ihl = (vw.first & 0x0F).astype(np.intp) << 2
    return first.translate(_VERSION).count(4) == len(first) and not np.count_nonzero((ihl < 20) | (ihl > lens))


_VERSION = bytes(b >> 4 for b in range(256))  # an IP header's first byte -> its version


class _BatchViews:
    """numpy views and scratch arrays for one batch geometry (made once: making a view costs
    about as much as using it)."""

    __slots__ = ("hl", "ihl", "base", "offs", "csum_idx", "grid", "first", "h_next", "h_prev", "flags_head", "tot", "tot_head", "seq_next",
                 "seq_prev", "diff", "headers", "run_mask", "masked", "expect", "expect_seq", "expect_tot")

    def __init__(self, arr: np.ndarray, base: int, stride: int, k: int, hl: int, ihl: int = 20) -> None:
        self.hl = hl
        self.ihl = ihl
        # What the length field leaves out: 0 for IPv4's total length, the header for IPv6's
        # payload length (``tot`` + ``base`` is the packet length either way).
        self.base = 0 if ihl == 20 else 40
        length = slice(2, 4) if ihl == 20 else slice(4, 6)
        self.offs = base + stride * np.arange(k, dtype=np.intp)   # where each packet starts in arr
        # batch_csum_failures' word indices, where they do not depend on the lengths; None where
        # an offset is odd (no word view: packet by packet).
        self.csum_idx = None
        if not (base | stride) & 1:
            w = self.offs >> 1
            self.csum_idx = idx = np.empty(k * (4 if ihl == 20 else 2), np.intp)
            if ihl == 20:
                idx[0::4], idx[1::4], idx[2::4] = w, w + 6, w + 10
            else:
                idx[0::2] = w + 4
        self.grid = grid = arr[base : base + k * stride].reshape(k, stride)
        self.first = grid[:, 0]  # version and IHL (IPv4)
        # One run, checked in one go: every header equals the first but for the IPv4 ID,
        # checksums and PSH on the last packet, with the length and sequence number predicted.
        self.headers = grid[:, :hl]
        self.run_mask = np.full((k, hl), 0xFF, np.uint8)
        if ihl == 20:
            self.run_mask[:, 4:6] = self.run_mask[:, 10:12] = 0
        self.run_mask[:, ihl + 16 : ihl + 18] = 0
        self.run_mask[k - 1, ihl + 13] = ~TCP_PSH & 0xFF
        self.masked = np.empty((k, hl), np.uint8)
        self.expect = np.empty((k, hl), np.uint8)
        self.expect_seq = self.expect[:, ihl + 4 : ihl + 8].view(">u4")[:, 0]
        self.expect_tot = self.expect[:, length].view(">u2")[:, 0]
        # Otherwise: where the runs start.
        self.h_next = grid[1:, :hl]
        self.h_prev = grid[:-1, :hl]
        self.flags_head = grid[:-1, ihl + 13]
        self.tot = grid[:, length].view(">u2")[:, 0]
        self.tot_head = self.tot[:-1]
        seqs = grid[:, ihl + 4 : ihl + 8].view(">u4")[:, 0]
        self.seq_next = seqs[1:]
        self.seq_prev = seqs[:-1]
        self.diff = np.empty((k - 1, hl), np.uint8)


class Coalescer:
    """Merge consecutive in-order TCP segments (IPv4 or IPv6) of one flow into super-packets.

    ``write(parts)`` receives a list of buffers whose concatenation is one TUN write (a
    virtio-net header and a packet).  Call :meth:`flush` when no more packets are at hand.
    """

    def __init__(self, write: Callable[[list], object], max_segments: int = 64) -> None:
        self.write = write
        self.max_segments = max_segments
        self.stage = bytearray(VNET_LEN + MAX_IP_TOTAL + 64)
        self._stage_mv = memoryview(self.stage)
        self._stage_np = np.frombuffer(self.stage, np.uint8)
        self._n = 0          # segments in the open run (0: none)
        self._hl = 0
        self._ihl = 20       # the run's IP header: 20 (IPv4), 40 (IPv6)
        self._mss = 0
        self._end = 0        # stage offset just past the last payload byte
        self._next_seq = 0
        self._key = b""
        self._open = False   # may the run still grow (no PSH, no short segment, room left)?
        self._psh = False
        self._cap = 0        # segments this run may hold
        self.merged = 0      # segments that went out inside a super-packet
        self.written = 0     # TUN writes issued
        self.batches = 0     # batches taken whole by the vectorized path
        self.csum_errors = 0  # segments whose checksums failed: written alone, flags 0
        self._views: dict[tuple, _BatchViews] = {}
        self._steps: dict[int, np.ndarray] = {}

    # -- one packet -----------------------------------------------------------------------------

    def add(self, v) -> None:
        """One IPv4 or IPv6 packet (a memoryview of exactly the packet)."""
        n = len(v)
        ihl = tcp_family(v) if n >= 40 else 0
        if not ihl or n < ihl + 20:
            self._single(v)
            return
        hl = ihl + ((v[ihl + 12] >> 4) << 2)
        plen = n - hl
        fl = v[ihl + 13]
        if _ip_length(v, ihl) != n or plen <= 0 or (fl & ~TCP_PSH) != TCP_ACK or hl < ihl + 20 \
                or ihl == 20 and ((v[6] & 0x3F) or v[7]):
            self._single(v)
            return
        if not csum_ok(v, ihl):
            self._bad(v)
            return
        seq = _unpack_I(v, ihl + 4)[0]
        if self._open and seq == self._next_seq and hl == self._hl and ihl == self._ihl and plen <= self._mss \
                and self._run_key() == _flow_key(v[:hl], ihl):
            end = self._end
            self.stage[end : end + plen] = v[hl:]
            self._end = end + plen
            self._n += 1
        else:
            self.flush()
            self._start(v, hl, plen, ihl)
        self._next_seq = (seq + plen) & 0xFFFFFFFF
        if fl & TCP_PSH:
            self._psh = True
        if fl & TCP_PSH or plen < self._mss or self._n >= self._cap:
            self.flush()

    def _start(self, v, hl: int, plen: int, ihl: int) -> None:
        n = hl + plen
        self.stage[VNET_LEN : VNET_LEN + n] = v[:n]
        self._n = 1
        self._hl = hl
        self._ihl = ihl
        self._mss = plen
        self._end = VNET_LEN + n
        self._key = _flow_key(v[:hl], ihl)
        self._open = True
        self._psh = False
        self._cap = min(self.max_segments, (MAX_IP_TOTAL - hl) // plen)

    def _run_key(self) -> bytes:
        key = self._key
        if key is None:
            key = self._key = _flow_key(self._stage_mv[VNET_LEN : VNET_LEN + self._hl], self._ihl)
        return key

    def _single(self, v) -> None:
        self.flush()
        self.written += 1
        self.write([VNET_HDR_NONE, v])

    def _bad(self, v) -> None:
        """A segment whose checksums fail: as it came, after the open run, claiming nothing."""
        self.csum_errors += 1
        self._single(v)

    # -- a batch of equally spaced packets ------------------------------------------------------

    def add_segments(self, arr: np.ndarray, base: int, seg: int, n: int) -> bool:
        """A UDP GRO read: ``n`` bytes at ``arr[base:]`` holding packets of ``seg`` bytes each
        (the last may be shorter).  As :meth:`add_batch`; a read is mostly one run (one UDP GSO
        send of one TSO super-packet), which is checked with half a dozen numpy calls."""
        if seg <= 0 or n <= 0:
            return False  # nothing to take (an empty datagram): the caller counts it
        k = -(-n // seg)
        vw = self._batch_views(arr, base, seg, k)
        if vw is None:
            return False
        hl, ihl, base = vw.hl, vw.ihl, vw.base
        mss = seg - hl
        last = n - (k - 1) * seg
        lens = [seg] * (k - 1) + [last]
        h0 = vw.grid[0, : ihl + 8].tobytes()
        steps = self._steps.get(mss)
        if steps is None:
            steps = self._steps[mss] = np.arange(1024, dtype=np.uint32) * np.uint32(mss)
        if mss > 0 and last > hl and _ip_length(h0, ihl) == seg and k <= len(steps):
            masked = np.bitwise_and(vw.headers, vw.run_mask, out=vw.masked)
            expect = vw.expect
            expect[...] = masked[0]
            vw.expect_seq[...] = steps[:k] + np.uint32(_unpack_I(h0, ihl + 4)[0])
            vw.expect_tot[k - 1] = last - base
            # (Byte 0 is compared too: every row of the run is of the first's family and IHL.)
            if not np.count_nonzero(np.bitwise_xor(masked, expect, out=expect)):
                bad = self._csum_failures(arr, vw, np.array(lens))
                if not len(bad):
                    self._cut(vw, mss, [], lens)
                    return True
                self._cut(vw, mss, _around(bad, k), lens, bad)
                return True
        if mss <= 0 or last <= hl or int(vw.tot[k - 1]) + base != last or np.count_nonzero(vw.tot_head != seg - base):
            return False          # an IP length that is not the packet length, pure ACKs, ...
        lens_np = np.array(lens)
        if not _packets_of_family(vw, lens_np):
            return False
        starts = self._header_changes(vw)
        starts |= (vw.seq_next - vw.seq_prev) != mss
        starts |= vw.flags_head & TCP_PSH
        self._cut_checked(arr, vw, mss, starts, lens, lens_np)
        return True

    def add_batch(self, arr: np.ndarray, base: int, stride: int, lens: np.ndarray) -> bool:
        """Take the ``len(lens)`` packets at ``arr[base + i*stride:][:lens[i]]`` (IPv4 or IPv6,
        as the first says).

        The batch is checked in one go: every packet must be of the first's family, an IPv4
        header (IHL) at least 20 bytes and within the packet, every IP length the packet length
        (otherwise nothing is taken and False returned: the caller checks and counts packet by
        packet), then it is cut where GRO would cut it (another flow or header, a gap in
        sequence numbers, after PSH or a short segment) and each piece is copied into a run
        with one strided copy; what cannot be merged at all goes through :meth:`add`."""
        k = len(lens)
        vw = self._batch_views(arr, base, stride, k)
        if vw is None or np.count_nonzero(vw.tot != lens - vw.base) or not _packets_of_family(vw, lens):
            return False          # an IP length that is not the packet length, a bad IHL: malformed
        hl = vw.hl
        plens = lens - hl
        if np.minimum.reduce(plens) <= 0:
            return False          # pure ACKs, other header lengths: per packet
        mss = int(np.maximum.reduce(plens))
        if hl + mss > stride:
            return False
        starts = self._header_changes(vw)
        starts |= (vw.seq_next - vw.seq_prev) != plens[:-1]
        starts |= vw.flags_head & TCP_PSH
        starts |= plens[:-1] < mss
        self._cut_checked(arr, vw, mss, starts, lens.tolist(), lens)
        return True

    def _batch_views(self, arr: np.ndarray, base: int, stride: int, k: int) -> _BatchViews | None:
        if k < VECTOR_MIN or base + k * stride > len(arr):
            return None
        h0 = arr[base : base + min(stride, 60)].tobytes()
        ihl = tcp_family(h0) if len(h0) >= 40 else 0
        if not ihl or len(h0) < ihl + 20:
            return None
        hl = ihl + ((h0[ihl + 12] >> 4) << 2)
        if hl < ihl + 20 or hl > stride:
            return None
        key = (id(arr), base, stride, k, hl, ihl)  # a cached view keeps its array alive: ids stay unique
        vw = self._views.get(key)
        if vw is None:
            if len(self._views) > 1024:
                self._views.clear()
            vw = self._views[key] = _BatchViews(arr, base, stride, k, hl, ihl)
        return vw

    @staticmethod
    def _header_changes(vw: _BatchViews) -> np.ndarray:
        """Per packet after the first: does its header differ from the previous packet's in
        anything but ID, length, checksums, sequence number and PSH?  (Where a run must
        start; uint8, non-zero for yes.)"""
        diff = np.bitwise_xor(vw.h_next, vw.h_prev, out=vw.diff)
        np.bitwise_and(diff, _mask(vw.hl, vw.ihl), out=diff)
        return np.bitwise_or.reduce(diff, axis=1)

    @staticmethod
    def _csum_failures(arr: np.ndarray, vw: _BatchViews, lens: np.ndarray) -> list[int]:
        """The rows whose checksums do not verify as TCP of the batch's family (corrupted
        segments; also any packet that is not such TCP: :meth:`add` sorts those out)."""
        if vw.csum_idx is None:  # odd offsets (an odd GRO segment size): row by row
            grid, ihl = vw.grid, vw.ihl
            return [i for i in range(len(lens)) if not csum_ok(memoryview(grid[i, : lens[i]]), ihl)]
        bad = batch_csum_failures(arr, vw.offs, lens, vw.ihl, vw.csum_idx)
        return bad.nonzero()[0].tolist() if bad.any() else []

    def _cut_checked(self, arr: np.ndarray, vw: _BatchViews, mss: int, starts: np.ndarray, lens: list[int],
                     lens_np: np.ndarray) -> None:
        """:meth:`_cut` at ``starts`` (per packet after the first: does it start a run?) and
        around every row whose checksums fail."""
        bad = self._csum_failures(arr, vw, lens_np)
        cuts = starts.nonzero()[0].tolist()
        if bad:
            cuts = sorted(set(cuts).union(_around(bad, len(lens))))
        self._cut(vw, mss, cuts, lens, bad)

    def _cut(self, vw: _BatchViews, mss: int, cuts: list[int], lens: list[int],
             bad: list[int] | None = None) -> None:
        """Add the runs the batch falls into: a run ends at each cut (the next packet must
        start a run) and at the last packet.  A row in ``bad`` (cut on both sides: alone) goes
        through :meth:`add`, which checks it again and writes it on its own."""
        self.batches += 1
        grid, hl, ihl = vw.grid, vw.hl, vw.ihl
        a = 0
        for e in cuts + [len(lens) - 1]:
            if bad and a == e and a in bad:
                self.add(memoryview(grid[a, : lens[a]]))
                a = e + 1
                continue
            # A run that ended (PSH, a short segment) must not go on, even with the same flow.
            ended = bool(grid[e, ihl + 13] & TCP_PSH) or lens[e] - hl < mss
            self._add_run(grid, hl, ihl, mss, a, e + 1, ended, lens)
            a = e + 1

    def _add_run(self, grid: np.ndarray, hl: int, ihl: int, mss: int, a: int, e: int, ended: bool,
                 lens: list[int]) -> None:
        """Rows ``a..e-1`` share their headers (but IPv4 ID, length, checksums, sequence number,
        PSH) and follow on in sequence space; all but the last are ``mss`` long."""
        h = grid[a, : ihl + 20].tobytes()
        if tcp_family(h) != ihl or ihl + ((h[ihl + 12] >> 4) << 2) != hl or (h[ihl + 13] & ~TCP_PSH) != TCP_ACK \
                or ihl == 20 and (h[6] & 0x3F or h[7]) or lens[a] - hl < mss:
            # Not TCP of the batch's family and header length (a ping among the segments, a
            # flow with other options), not mergeable (flags, fragments), or it starts with a
            # short segment: packet by packet (the rows of a run share all these bytes).
            for i in range(a, e):
                self.add(memoryview(grid[i, : lens[i]]))
            return
        while a < e:
            if self._open:
                if self._mss == mss and self._hl == hl and self._ihl == ihl \
                        and self._next_seq == _unpack_I(grid[a, ihl + 4 : ihl + 8].tobytes(), 0)[0] \
                        and self._run_key() == _flow_key(grid[a, :hl].tobytes(), ihl):
                    a = self._extend(grid, hl, a, e, ended, lens)
                    continue
                self.flush()
            self._start_row(grid[a], hl, mss, ihl)
            a = self._extend(grid, hl, a, e, ended, lens)

    def _start_row(self, row: np.ndarray, hl: int, mss: int, ihl: int) -> None:
        self._stage_np[VNET_LEN : VNET_LEN + hl] = row[:hl]
        self._n = 0
        self._hl = hl
        self._ihl = ihl
        self._mss = mss
        self._end = VNET_LEN + hl
        self._key = None     # made from the staged header when a packet asks to join
        self._open = True
        self._psh = False
        self._cap = min(self.max_segments, (MAX_IP_TOTAL - hl) // mss)

    def _extend(self, grid: np.ndarray, hl: int, start: int, e: int, ended: bool, lens: list[int]) -> int:
        """Append rows ``start..e-1`` (as many as the open run has room for) to the open run;
        returns the first row not taken.  The run is flushed when full or when row ``e-1``,
        which ended it, went in."""
        mss = self._mss
        stop = min(e, start + self._cap - self._n)   # exclusive
        full = stop - start - 1       # rows before the last are exactly mss long
        end = self._end
        if full > 0:
            self._stage_np[end : end + full * mss].reshape(full, mss)[...] = grid[start : start + full, hl : hl + mss]
            end += full * mss
        last = stop - 1
        tail = lens[last] - hl
        self._stage_np[end : end + tail] = grid[last, hl : hl + tail]
        self._end = end + tail
        self._n += stop - start
        ihl = self._ihl
        row = grid[last, : ihl + 20].tobytes()
        self._next_seq = (_unpack_I(row, ihl + 4)[0] + tail) & 0xFFFFFFFF
        if row[ihl + 13] & TCP_PSH:
            self._psh = True
        if (ended and stop == e) or self._n >= self._cap:
            self.flush()
        return stop

    # -- output ---------------------------------------------------------------------------------

    def flush(self) -> None:
        n = self._n
        if not n:
            return
        self._n = 0
        self._open = False
        stage = self.stage
        end = self._end
        hl = self._hl
        self.written += 1
        if n == 1:
            # Unchanged: the first segment's own header is in the stage.
            stage[:VNET_LEN] = VNET_HDR_NONE
            self.write([self._stage_mv[:end]])
            return
        total = end - VNET_LEN
        h = VNET_LEN
        ihl = self._ihl
        if ihl == 20:
            _pack_H(stage, h + 2, total)
            stage[h + 10] = stage[h + 11] = 0
            _pack_H(stage, h + 10, checksum(self._stage_mv[h : h + 20]))
            src, dst, gso_type = bytes(stage[h + 12 : h + 16]), bytes(stage[h + 16 : h + 20]), VIRTIO_NET_HDR_GSO_TCPV4
        else:
            _pack_H(stage, h + 4, total - 40)  # RFC 8200 §3: the payload length, no header checksum
            src, dst, gso_type = bytes(stage[h + 8 : h + 24]), bytes(stage[h + 24 : h + 40]), VIRTIO_NET_HDR_GSO_TCPV6
        if self._psh:
            stage[h + ihl + 13] |= TCP_PSH
        # CHECKSUM_PARTIAL convention: the TCP checksum field holds the folded pseudo-header sum.
        ps = pseudo_header_sum(src, dst, IPPROTO_TCP, total - ihl)
        _pack_H(stage, h + ihl + 16, ps % 0xFFFF or 0xFFFF)
        _VNET.pack_into(stage, 0, VIRTIO_NET_HDR_F_NEEDS_CSUM, gso_type, hl, self._mss, ihl, 16)
        self.merged += n
        self.write([self._stage_mv[:end]])


def _around(rows: list[int], k: int) -> list[int]:
    """The cuts (a run ends after this row) that leave each of ``rows`` alone among ``k``."""
    cuts = set()
    for r in rows:
        if r > 0:
            cuts.add(r - 1)
        if r < k - 1:
            cuts.add(r)
    return sorted(cuts)


def coalesce_packets(packets: Iterable[bytes], max_segments: int = 64,
                     batch: bool = False) -> list[tuple[VirtioNetHdr, bytes]]:
    """Convenience wrapper: coalesce ``packets`` and return (virtio header, packet) per write.
    With ``batch`` the packets go through :meth:`Coalescer.add_batch` (laid out in 2 KB slots)
    where it takes them, else one by one."""
    writes: list[tuple[VirtioNetHdr, bytes]] = []

    def write(parts: list) -> None:
        blob = b"".join(bytes(p) for p in parts)
        writes.append((VirtioNetHdr.decode(blob), blob[10:]))

    c = Coalescer(write, max_segments)
    packets = [bytes(p) for p in packets]
    stride = max([len(p) for p in packets] + [2048])
    if batch and packets:
        buf = bytearray(stride * len(packets))
        for i, p in enumerate(packets):
            buf[i * stride : i * stride + len(p)] = p
        arr = np.frombuffer(buf, np.uint8)
        if c.add_batch(arr, 0, stride, np.array([len(p) for p in packets], np.int64)):
            c.flush()
            return writes
    for p in packets:
        c.add(memoryview(p))
    c.flush()
    return writes
