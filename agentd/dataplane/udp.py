"""flannel-compatible UDP transport: the UDP payload is exactly one inner packet, IPv4 or IPv6
(its version nibble says which; the outer header is IPv4, the underlay's).

Fast path: a batch of equal-sized inner packets leaves in ONE ``sendmsg`` carrying a
``UDP_SEGMENT`` control message (UDP GSO, Linux >= 4.18): the kernel cuts the buffer into one
datagram per ``gso_size`` bytes, so every datagram still carries exactly one inner packet.  On
receive ``UDP_GRO`` lets one ``recvmsg`` return many datagrams back to back, with their size in
a ``UDP_GRO`` control message.  DF is set (IP_PMTUDISC_DO): the underlay never fragments.
Without the offloads (``offload=False`` or refused by the kernel) it is one ``sendto`` and one
``recvfrom`` per packet, which is what flannel's C backend does.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import struct

import numpy as np

from agentd.dataplane._forward import NextHopTable
from agentd.dataplane._gro import VECTOR_MIN
from agentd.dataplane._sockopt import (
    IP_MTU_DISCOVER,
    IP_PMTUDISC_DO,
    MMSG_SIZE,
    MSG_DONTWAIT,
    MmsgBatch,
    buffer_address,
    enlarge_buffers,
    sockaddr_in,
)

SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
# Kernel limits for one GSO send: UDP_MAX_SEGMENTS (64 before 6.9) and an IP total length of
# 64 KB, i.e. 65507 bytes of UDP payload.
MAX_GSO_SEGMENTS = 64
MAX_GSO_BYTES = 65507

_pack_seg = struct.Struct("=H").pack
_GRO_ANC = socket.CMSG_SPACE(4)
_SEG_CMSG = socket.CMSG_SPACE(2)           # one UDP_SEGMENT control message per queued message
_SEG_DATA = socket.CMSG_LEN(0)             # where its 16-bit gso_size sits
_CMSG_HDR = struct.Struct("@NiiH")         # cmsg_len, cmsg_level, cmsg_type, gso_size
_IOV = struct.Struct("@PN")
_TX_QUEUE = 128
# What a UDP_SEGMENT send fails with when the device or kernel refuses GSO (EINVAL: see
# UdpTransport._gso_refused).
_GSO_REFUSED = (errno.EIO, errno.EINVAL, errno.ENOPROTOOPT, errno.EOPNOTSUPP)


def check_bound(sock: socket.socket, local_ip: str, port: int) -> None:
    """Raise OSError unless ``sock`` is an IPv4 UDP socket bound to ``local_ip:port`` (the
    socket a worker is handed: ``--socket-fd``)."""
    try:
        kind = (sock.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN), sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE))
        name = sock.getsockname() if kind[0] == socket.AF_INET else None
    except OSError as exc:
        raise OSError(exc.errno, f"the socket handed over is unusable: {exc.strerror}") from None
    if kind != (socket.AF_INET, socket.SOCK_DGRAM) or name != (local_ip, port):
        raise OSError(errno.EINVAL, f"the socket handed over is not an IPv4 UDP socket bound to {local_ip}:{port}"
                                    f" ({name or 'another kind'})")


def inner_packet_ok(v, n: int) -> bool:
    """Whether the ``n`` bytes ``v`` are exactly one IP packet: IPv4 whose header length is at
    least 20 and within the packet and whose total length is ``n``, or IPv6 whose payload
    length plus its 40-byte header is ``n`` (flannel's format: one inner packet per datagram; a
    jumbogram's payload length 0 is not one).  As the C loop's inner_ok (_fastpath.c)."""
    if n >= 20 and v[0] >> 4 == 4:
        return 5 <= (v[0] & 0x0F) <= n >> 2 and (v[2] << 8 | v[3]) == n
    return n >= 40 and v[0] >> 4 == 6 and (v[4] << 8 | v[5]) + 40 == n


def inner_source(v) -> bytes:
    """The source address of the inner packet ``v`` (a memoryview that inner_packet_ok took:
    IPv4 or IPv6), packed: what the reverse-path check (NextHopTable.source_ok) judges."""
    return v[12:16].tobytes() if v[0] >> 4 == 4 else v[8:24].tobytes()


def no_short_ipv4_header(first: np.ndarray) -> bool:
    """Whether no packet whose first byte is one of ``first`` is IPv4 with an IHL below 5
    (0x40 to 0x44): a batch's check of that part of inner_packet_ok, which the coalescer's
    batch paths leave out."""
    return not np.count_nonzero((first >= 0x40) & (first < 0x45))


class _GsoQueue:
    """Prebuilt sendmmsg messages, one iovec and one UDP_SEGMENT control message each."""

    def __init__(self, vlen: int) -> None:
        self.batch = MmsgBatch(vlen)
        self.control = (ctypes.c_char * (vlen * _SEG_CMSG))()
        base = ctypes.addressof(self.control)
        view = memoryview(self.control).cast("B")
        for i in range(vlen):
            _CMSG_HDR.pack_into(view, i * _SEG_CMSG, socket.CMSG_LEN(2), SOL_UDP, UDP_SEGMENT, 0)
            hdr = self.batch.msgs[i].msg_hdr
            hdr.msg_control = base + i * _SEG_CMSG
            hdr.msg_controllen = _SEG_CMSG
            hdr.msg_namelen = 16
        self.control_view = view
        self.msgs = self.batch.msgs
        self.iovs_view = self.batch.iovs_view
        self.meta: list[tuple[int, int, int, str]] = []   # (offset, length, gso_size, peer) per message


class UdpTransport:
    kind = "udp"
    overhead = 28  # outer IPv4 + UDP header
    holds_tx_buffer = True  # queued messages point into the staging buffer until flush()

    def __init__(self, local_ip: str, port: int, *, offload: bool, counters: dict, drops: dict,
                 buffer_bytes: int = 8 << 20, mtu: int = 1472, sock: socket.socket | None = None) -> None:
        # ``mtu`` (the TUN's) is the ipip transport's concern: a UDP GRO read takes up to 64 KB.
        # ``sock``: a UDP socket already bound to (local_ip, port) -- the agent's, which it binds
        # once and keeps for its life, so that no other user can take the port while no worker
        # runs (docs/networking.md, security notes); without it the worker binds its own.
        self.local_ip = local_ip
        self.port = port
        self.c = counters
        self.drops = drops
        self.offloads: dict[str, bool] = {"udp_gso": False, "udp_gro": False}
        self.fallbacks: dict[str, str] = {}
        self.members: frozenset[str] = frozenset()
        # The next hops: an inner source must route back to the member that sent it (set_table).
        self.table = NextHopTable()
        # Called with (packet, peer) for a packet the underlay refused as over the path MTU
        # (Transmit.too_big: frag needed / packet too big to its source).
        self.too_big = None
        given = sock is not None
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            if given:
                check_bound(sock, local_ip, port)
            else:
                # SO_REUSEPORT, not SO_REUSEADDR: a replacing worker may bind while the old one
                # still exits, but the kernel lets only a socket of the same user join the port
                # (with SO_REUSEADDR any local user could bind it too and take the peers' packets).
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
            enlarge_buffers(sock, buffer_bytes, self.fallbacks)
            if not given:
                sock.bind((local_ip, port))
            sock.setblocking(True)
        except OSError:
            sock.close()
            raise
        # Blocking sends (a full send buffer is back-pressure, not a drop); receives use
        # MSG_DONTWAIT so the worker's poll loop never blocks in them.
        self.sock = sock
        if offload:
            try:
                sock.getsockopt(SOL_UDP, UDP_SEGMENT)
                self.offloads["udp_gso"] = True
            except OSError as exc:
                self.fallbacks["udp_gso"] = f"UDP_SEGMENT unsupported: {exc.strerror}"
            try:
                sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                self.offloads["udp_gro"] = True
            except OSError as exc:
                self.fallbacks["udp_gro"] = f"UDP_GRO refused: {exc.strerror}"
        else:
            self.fallbacks["udp_gso"] = self.fallbacks["udp_gro"] = "disabled by --no-offload"
            if given:  # a previous worker on this socket may have turned GRO on
                with contextlib.suppress(OSError):
                    sock.setsockopt(SOL_UDP, UDP_GRO, 0)
        self._addr_cache: dict[str, tuple[str, int]] = {}
        self._rx_src: bytearray | None = None
        self._txq: _GsoQueue | None = None
        if self.offloads["udp_gso"]:
            try:
                self._txq = _GsoQueue(_TX_QUEUE)
            except (AttributeError, OSError) as exc:  # no sendmmsg in libc: one sendmsg per run
                self.fallbacks["sendmmsg"] = f"unavailable: {exc}"
        self._tx_base = 0
        self._tx_buf: memoryview | None = None
        self._names: dict[str, ctypes.Array] = {}
        self._forget_pending = False  # set_members came while messages were queued
        self._rx_np: np.ndarray | None = None
        self._src_rows: dict[tuple[int, int, int], np.ndarray] = {}  # a GRO read's inner sources, per geometry

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def set_table(self, table: NextHopTable) -> None:
        """The next hops, whose reverse-path check every received inner packet passes."""
        self.table = table

    def set_members(self, members: frozenset[str]) -> None:
        self.members = members
        # The departed nodes' cached addresses go, once no queued message points at their
        # sockaddr (at once if none is queued, else at the end of the next flush).
        self._forget_pending = True
        if self._txq is None or not self._txq.meta:
            self._forget_gone_peers()

    def _forget_gone_peers(self) -> None:
        """Drop the cached addresses of peers that are not members (nodes gone): one tuple
        and one sockaddr_in each, kept for the worker's life otherwise."""
        self._forget_pending = False
        members = self.members
        for cache in (self._names, self._addr_cache):
            for peer in [p for p in cache if p not in members]:
                del cache[peer]

    def peer_address(self, peer: str) -> tuple[str, int]:
        addr = self._addr_cache.get(peer)
        if addr is None:
            addr = self._addr_cache[peer] = (peer, self.port)
        return addr

    # -- transmit -----------------------------------------------------------------------------

    def send_one(self, view, peer: str) -> None:
        try:
            self.sock.sendto(view, self.peer_address(peer))
        except OSError as exc:
            self._send_failed(exc, 1, view, peer)
            return
        c = self.c
        c["tx_packets"] += 1
        c["tx_bytes"] += len(view)
        c["tx_syscalls"] += 1

    def bind_tx_buffer(self, buf: bytearray) -> None:
        """The worker's staging buffer: queued messages point into it until :meth:`flush`."""
        self._tx_base = buffer_address(buf)
        self._tx_buf = memoryview(buf)

    def _name(self, peer: str) -> int:
        sa = self._names.get(peer)
        if sa is None:
            sa = self._names[peer] = sockaddr_in(peer, self.port)
        return ctypes.addressof(sa)

    def queue_run(self, buf: memoryview, off: int, seglen: int, count: int, total: int, peer: str) -> None:
        """Send ``count`` packets laid out back to back in ``buf[off:off+total]``, each
        ``seglen`` bytes except the last: one GSO message per (at most 64 KB) chunk, queued
        until :meth:`flush` when ``buf`` is the bound staging buffer."""
        q = self._txq
        if q is not None and self.offloads["udp_gso"] and self._tx_buf is not None and buf.obj is self._tx_buf.obj:
            per_send = min(MAX_GSO_SEGMENTS, MAX_GSO_BYTES // seglen) * seglen
            name = self._name(peer)
            end = off + total
            vlen = q.batch.vlen
            while off < end:
                n = min(per_send, end - off)
                i = len(q.meta)
                if i == vlen:
                    self.flush()
                    i = 0
                _IOV.pack_into(q.iovs_view, i * 16, self._tx_base + off, n)
                q.msgs[i].msg_hdr.msg_name = name
                struct.pack_into("=H", q.control_view, i * _SEG_CMSG + _SEG_DATA, seglen)
                q.meta.append((off, n, seglen, peer))
                off += n
            return
        self._send_now(buf, off, seglen, count, total, peer)

    def flush(self) -> None:
        try:
            self._flush()
        finally:
            if self._forget_pending:  # nothing queued any more points at a sockaddr
                self._forget_gone_peers()

    def _flush(self) -> None:
        q = self._txq
        if q is None or not q.meta:
            return
        meta, q.meta = q.meta, []
        c = self.c
        start = 0
        while start < len(meta):
            sent = q.batch.sendmmsg(self.sock.fileno(), q.batch.msgs_addr + start * MMSG_SIZE, len(meta) - start, 0)
            c["tx_syscalls"] += 1
            if sent < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                off, n, seglen, peer = meta[start]
                if err in _GSO_REFUSED:
                    if self._gso_refused(err, self._tx_buf, off, n, seglen, peer):
                        for off, n, seglen, peer in meta[start + 1 :]:
                            self._send_plain(self._tx_buf, off, seglen, n, peer)
                        return
                    start += 1
                    continue
                self._send_failed(OSError(err, os.strerror(err)), -(-n // seglen),
                                  self._tx_buf[off : off + min(n, seglen)], peer)
                start += 1
                continue
            for off, n, seglen, _peer in meta[start : start + sent]:
                c["tx_packets"] += -(-n // seglen)
                c["tx_bytes"] += n
            start += sent

    def _send_now(self, buf: memoryview, off: int, seglen: int, count: int, total: int, peer: str) -> None:
        """One sendmsg per GSO-sized chunk (or one sendto per packet without GSO)."""
        addr = self.peer_address(peer)
        c = self.c
        if count == 1 or not self.offloads["udp_gso"]:
            self._send_plain(buf, off, seglen, total, peer)
            return
        per_send = min(MAX_GSO_SEGMENTS, MAX_GSO_BYTES // seglen)
        chunk = per_send * seglen
        anc = [(SOL_UDP, UDP_SEGMENT, _pack_seg(seglen))]
        sendmsg = self.sock.sendmsg
        end = off + total
        while off < end:
            n = min(chunk, end - off)
            try:
                sendmsg([buf[off : off + n]], anc, 0, addr)
            except OSError as exc:
                if exc.errno in _GSO_REFUSED:
                    if self._gso_refused(exc.errno, buf, off, n, seglen, peer):
                        if end > off + n:
                            self._send_plain(buf, off + n, seglen, end - off - n, peer)
                        return
                    off += n
                    continue
                self._send_failed(exc, -(-n // seglen), buf[off : off + min(n, seglen)], peer)
            else:
                c["tx_packets"] += -(-n // seglen)
                c["tx_bytes"] += n
                c["tx_syscalls"] += 1
            off += n

    def _send_plain(self, buf: memoryview, off: int, seglen: int, total: int, peer: str) -> int:
        """One sendto per packet of ``total`` bytes at ``off``; returns how many went out."""
        addr = self.peer_address(peer)
        c = self.c
        sendto = self.sock.sendto
        end = off + total
        sent = 0
        while off < end:
            n = min(seglen, end - off)
            try:
                sendto(buf[off : off + n], addr)
            except OSError as exc:
                self._send_failed(exc, 1, buf[off : off + n], peer)
            else:
                sent += 1
                c["tx_bytes"] += n
            off += n
        c["tx_packets"] += sent
        c["tx_syscalls"] += -(-total // seglen)
        return sent

    def _gso_refused(self, err: int, buf: memoryview, off: int, n: int, seglen: int, peer: str) -> bool:
        """A GSO send of the ``n`` bytes at ``off`` failed with ``err``: they go again one
        datagram per packet.  EINVAL is also what kernels before the upstream "return
        -EMSGSIZE" change give a message whose segments exceed the path MTU (a lower MTU to one
        peer): GSO stays on then unless a plain send of the same segments goes out (the
        kernel refused GSO itself); the packets the plain sends could not send are counted
        by them (mtu).  Other errors turn GSO off.  Returns whether GSO is off now."""
        sent = self._send_plain(buf, off, seglen, n, peer)
        if err == errno.EINVAL and not sent:
            return False
        self.offloads["udp_gso"] = False
        self.fallbacks["udp_gso"] = f"UDP_SEGMENT send failed: {os.strerror(err)}"
        return True

    def _send_failed(self, exc: OSError, packets: int, first=None, peer: str = "") -> None:
        """``packets`` not sent; ``first`` (to ``peer``) is the first of them."""
        if exc.errno == errno.EMSGSIZE:
            self.drops["mtu"] += packets
            if self.too_big is not None and first is not None:
                self.too_big(first, peer)
            return
        self.drops["send_error"] += packets

    # -- receive ------------------------------------------------------------------------------

    def receive(self, rxbuf: bytearray, coalescer, budget: int) -> None:
        """Drain up to ``budget`` reads; hand every inner packet to ``coalescer``."""
        mv = memoryview(rxbuf)
        c = self.c
        drops = self.drops
        members = self.members
        # A member's worker sends from the cluster's udp_port, which only root can hold while
        # the worker does (SO_REUSEPORT takes a socket of the same user only): a datagram
        # from another port of a member is any process of that node, not its worker.
        port = self.port
        add = coalescer.add
        source_ok, inet_aton = self.table.source_ok, socket.inet_aton
        if not self.offloads["udp_gro"]:
            recvfrom_into = self.sock.recvfrom_into
            for _ in range(budget):
                try:
                    n, addr = recvfrom_into(rxbuf, 0, MSG_DONTWAIT)
                except BlockingIOError:
                    break
                c["rx_syscalls"] += 1
                if addr[1] != port or addr[0] not in members:
                    drops["non_member"] += 1
                    continue
                v = mv[:n]
                if not inner_packet_ok(v, n):
                    drops["malformed"] += 1
                    continue
                if not source_ok(inner_source(v), inet_aton(addr[0])):
                    drops["spoofed"] += 1
                    continue
                c["rx_packets"] += 1
                c["rx_bytes"] += n
                add(v)
                coalescer.flush()
            return
        recvmsg_into = self.sock.recvmsg_into
        bufs = [rxbuf]
        if self._rx_src is not rxbuf:
            self._rx_src, self._rx_np = rxbuf, np.frombuffer(rxbuf, np.uint8)
            self._src_rows = {}
        arr = self._rx_np
        add_segments = coalescer.add_segments
        for _ in range(budget):
            try:
                n, anc, _flags, addr = recvmsg_into(bufs, _GRO_ANC, MSG_DONTWAIT)
            except BlockingIOError:
                break
            c["rx_syscalls"] += 1
            seg = n
            for level, kind, data in anc:
                if level == SOL_UDP and kind == UDP_GRO:
                    seg = int.from_bytes(data, "little") if len(data) != 2 else struct.unpack("=H", data)[0]
            if addr[1] != port or addr[0] not in members:
                drops["non_member"] += -(-n // seg) if seg else 1
                continue
            if n == 0:  # an empty datagram carries no packet
                drops["malformed"] += 1
                continue
            sender = inet_aton(addr[0])
            if n >= VECTOR_MIN * seg and no_short_ipv4_header(arr[0:n:seg]) \
                    and self._one_source(arr, seg, n, sender) and add_segments(arr, 0, seg, n):
                # One GRO read of equal-sized datagrams: checked and merged in one go.
                c["rx_packets"] += -(-n // seg)
                c["rx_bytes"] += n
                continue
            good = 0
            for off in range(0, n, seg):
                v = mv[off : off + seg] if off + seg <= n else mv[off:n]
                if not inner_packet_ok(v, len(v)):
                    drops["malformed"] += 1
                    continue
                if not source_ok(inner_source(v), sender):
                    drops["spoofed"] += 1
                    continue
                good += 1
                add(v)
            c["rx_packets"] += good
            c["rx_bytes"] += n
        # The open run goes out once the socket is drained (it may go on across reads).
        coalescer.flush()

    def _one_source(self, arr: np.ndarray, seg: int, n: int, sender: bytes) -> bool:
        """The reverse-path check of a whole GRO read (the ``n`` bytes at ``arr[0:]``, one packet
        every ``seg`` bytes): does every packet carry the first one's source, at the first one's
        family's offset, and may that source come from ``sender``?  If not, the packets are
        checked one by one (a row of another family is the coalescer's to refuse)."""
        version = arr[0] >> 4
        if version not in (4, 6):
            return False
        lo, hi = (12, 16) if version == 4 else (8, 24)
        k = -(-n // seg)
        if n - (k - 1) * seg < hi or seg < hi:
            return False
        rows = self._src_rows.get((seg, k, lo))
        if rows is None:
            if len(self._src_rows) > 256:
                self._src_rows.clear()
            rows = self._src_rows[(seg, k, lo)] = arr[: k * seg].reshape(k, seg)[:, lo:hi]
        first = rows[0]
        if np.count_nonzero(rows != first):
            return False
        return self.table.source_ok(first.tobytes(), sender)
