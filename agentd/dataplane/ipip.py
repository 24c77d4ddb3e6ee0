"""User-space IPIP (RFC 2003) over a raw IP-protocol-4 socket.

The kernel builds the outer header for ``socket(AF_INET, SOCK_RAW, IPPROTO_IPIP)`` sends
(source = the bound underlay address, protocol 4, TTL 64, DF from IP_PMTUDISC_DO), and the
payload is the inner packet unchanged — byte for byte what a kernel ``ipip`` device sends, so
user-space and kernel-ipip nodes interoperate.  Receives return outer header + inner packet.

There is no GSO for raw sockets, so the batch unit is the syscall: ``sendmmsg``/``recvmmsg``
(through ctypes, with prebuilt reusable mmsghdr/iovec arrays whose iovecs and names are set a
whole run at a time through numpy views) move up to ``batch`` packets per call.  Without them
(``offload=False`` or libc lacks them) it is one sendto/recvfrom per packet.

The kernel's own cost per packet dominates this path: ~6 µs of CPU per 1.5 KB packet on the
development VM for raw_sendmsg plus the receiving side's softirq (which runs in the sender's
context on a veth underlay).  Building the outer header ourselves (IPPROTO_RAW, IP_HDRINCL,
which skips ip_append_data) measured the same, so the simpler socket stays.

Note (kernel without an ipip module): an inbound proto-4 packet for which no protocol handler
exists is answered with ICMP protocol-unreachable *unless a raw socket took it*
(``ip_local_deliver_finish``); while this worker runs it always does, so no nft rule is needed.
"""

from __future__ import annotations

import ctypes
import errno
import socket

import numpy as np

from agentd.dataplane._forward import NextHopTable
from agentd.dataplane._gro import VECTOR_MIN
from agentd.dataplane._sockopt import (
    IOV_SIZE,
    IP_MTU_DISCOVER,
    IP_PMTUDISC_DO,
    MMSG_SIZE,
    MSG_DONTWAIT,
    MSG_FLAGS_OFFSET,
    MSG_LEN_OFFSET,
    MSG_TRUNC,
    MmsgBatch,
    buffer_address,
    enlarge_buffers,
    sockaddr_in,
)
from proto.packet import IPPROTO_IPIP

RX_SLOT = 2048  # the smallest receive slot (one underlay packet of a 1500-byte underlay, with room)


def rx_slot(mtu: int) -> int:
    """The receive slot for a TUN of ``mtu``: one underlay packet (``mtu`` plus the largest outer
    header, 60 bytes) and then some, so that a packet that fills its slot was cut (a jumbo-frame
    underlay's packets are not); at least :data:`RX_SLOT`.  As _fastpath.c's rx_slot."""
    return max(RX_SLOT, (mtu + 60 + 64) & ~63)


# Outer header bytes that must be equal for a whole recvmmsg batch to be taken in one go:
# everything but total length, ID and checksum (same source, protocol 4, no options, ...).
_OUTER_MASK = np.full(20, 0xFF, np.uint8)
_OUTER_MASK[2:6] = _OUTER_MASK[10:12] = 0


class IpipTransport:
    kind = "ipip"
    overhead = 20  # outer IPv4 header
    holds_tx_buffer = True  # queued iovecs point into the staging buffer until flush()

    def __init__(self, local_ip: str, port: int = 0, *, offload: bool, counters: dict, drops: dict,
                 buffer_bytes: int = 8 << 20, batch: int = 256, ttl: int = 64, mtu: int = 1480) -> None:
        self.local_ip = local_ip
        self.slot = rx_slot(mtu)
        self.c = counters
        self.drops = drops
        self.offloads: dict[str, bool] = {"sendmmsg": False, "recvmmsg": False}
        self.fallbacks: dict[str, str] = {}
        self.members: frozenset[bytes] = frozenset()
        # The next hops: an inner source must route back to the member that sent it (set_table).
        self.table = NextHopTable()
        # Called with (packet, peer) for a packet the underlay refused as over the path MTU
        # (Transmit.too_big: frag needed to its source).
        self.too_big = None
        self._tx_buf: memoryview | None = None
        sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, IPPROTO_IPIP)
        try:
            sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, ttl)
            enlarge_buffers(sock, buffer_bytes, self.fallbacks)
            # Bound: sends carry our underlay address, receives only what is addressed to it.
            sock.bind((local_ip, 0))
        except OSError:
            sock.close()
            raise
        self.sock = sock
        self.fd = sock.fileno()
        self._names: dict[str, ctypes.Array] = {}
        self._name_ptr: dict[str, int] = {}
        self._peer_of: dict[int, str] = {}  # a sockaddr's address -> its peer (a refused message's)
        self._member_texts: frozenset[str] = frozenset()
        self._forget_pending = False  # set_members came while messages were queued
        self._tx = self._rx = None
        self._q = 0
        self._tx_base = 0
        if offload:
            try:
                self._tx = MmsgBatch(batch)
                self._rx = MmsgBatch(batch)
                self.offloads["sendmmsg"] = self.offloads["recvmmsg"] = True
            except (AttributeError, OSError) as exc:
                self.fallbacks["sendmmsg"] = self.fallbacks["recvmmsg"] = f"unavailable: {exc}"
        else:
            self.fallbacks["sendmmsg"] = self.fallbacks["recvmmsg"] = "disabled by --no-offload"
        self._rxbuf: bytearray | None = None
        if self._tx is not None:
            # numpy views of the prebuilt arrays: a whole run's iovecs are set in a few calls.
            self._tx_iov = np.frombuffer(self._tx.iovs_view, np.uint64).reshape(batch, IOV_SIZE // 8)
            self._tx_msg = np.frombuffer(self._tx.msgs_view, np.uint64).reshape(batch, MMSG_SIZE // 8)
            self._rx_msg = np.frombuffer(self._rx.msgs_view, np.uint8).reshape(batch, MMSG_SIZE)
            self._rx_lens = self._rx_msg[:, MSG_LEN_OFFSET : MSG_LEN_OFFSET + 4].view(np.uint32)[:, 0]
            for i in range(batch):
                self._tx.msgs[i].msg_hdr.msg_namelen = 16
        self._ar = np.arange(1 << 16, dtype=np.uint64)

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        self.sock.close()

    def set_table(self, table: NextHopTable) -> None:
        """The next hops, whose reverse-path check every received inner packet passes."""
        self.table = table

    def set_members(self, members: frozenset[str]) -> None:
        self.members = frozenset(socket.inet_aton(m) for m in members)
        self._member_texts = frozenset(members)
        # The departed nodes' sockaddrs go once no queued message points at them (at once if
        # none is queued, else at the end of the next flush).
        self._forget_pending = True
        if not self._q:
            self._forget_gone_peers()

    def _forget_gone_peers(self) -> None:
        """Drop the sockaddr of peers that are not members (nodes gone), kept for the
        worker's life otherwise."""
        self._forget_pending = False
        members = self._member_texts
        for peer in [p for p in self._names if p not in members]:
            del self._names[peer]
            self._peer_of.pop(self._name_ptr.pop(peer), None)

    def bind_tx_buffer(self, buf: bytearray) -> None:
        """The worker's staging buffer: queued iovecs point into it until :meth:`flush`."""
        self._tx_base = buffer_address(buf)
        self._tx_buf = memoryview(buf)

    def _name(self, peer: str) -> int:
        ptr = self._name_ptr.get(peer)
        if ptr is None:
            sa = self._names[peer] = sockaddr_in(peer)
            ptr = self._name_ptr[peer] = ctypes.addressof(sa)
            self._peer_of[ptr] = peer
        return ptr

    # -- transmit -----------------------------------------------------------------------------

    def send_one(self, view, peer: str) -> None:
        try:
            self.sock.sendto(view, (peer, 0))
        except OSError as exc:
            self.drops["mtu" if exc.errno == errno.EMSGSIZE else "send_error"] += 1
            if exc.errno == errno.EMSGSIZE and self.too_big is not None:
                self.too_big(view, peer)
            return
        c = self.c
        c["tx_packets"] += 1
        c["tx_bytes"] += len(view)
        c["tx_syscalls"] += 1

    def queue_run(self, buf: memoryview, off: int, seglen: int, count: int, total: int, peer: str) -> None:
        tx = self._tx
        if tx is None:
            end = off + total
            while off < end:
                n = min(seglen, end - off)
                self.send_one(buf[off : off + n], peer)
                off += n
            return
        name = self._name(peer)
        vlen = tx.vlen
        base = self._tx_base + off
        iov, msg, ar = self._tx_iov, self._tx_msg, self._ar
        last = total - (count - 1) * seglen
        done = 0
        while done < count:
            q = self._q
            if q == vlen:
                self.flush()
                q = 0
            m = min(count - done, vlen - q)
            iov[q : q + m, 0] = ar[:m] * seglen + (base + done * seglen)
            iov[q : q + m, 1] = seglen
            msg[q : q + m, 0] = name
            done += m
            if done == count:
                iov[q + m - 1, 1] = last
            self._q = q + m

    def flush(self) -> None:
        try:
            self._flush()
        finally:
            if self._forget_pending:  # nothing queued any more points at a sockaddr
                self._forget_gone_peers()

    def _flush(self) -> None:
        q = self._q
        if not q:
            return
        self._q = 0
        tx = self._tx
        c = self.c
        start = 0
        while start < q:
            sent = tx.sendmmsg(self.fd, tx.msgs_addr + start * MMSG_SIZE, q - start, 0)
            c["tx_syscalls"] += 1
            if sent < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                # The message at ``start`` failed; count it and go on with the rest.
                self.drops["mtu" if err == errno.EMSGSIZE else "send_error"] += 1
                if err == errno.EMSGSIZE and self.too_big is not None and self._tx_buf is not None:
                    self._refused(start)
                start += 1
                continue
            c["tx_bytes"] += int(np.add.reduce(self._tx_iov[start : start + sent, 1]))
            c["tx_packets"] += sent
            start += sent

    def _refused(self, i: int) -> None:
        """Queued message ``i`` is over the path MTU: hand it to ``too_big`` with its peer."""
        off, n = int(self._tx_iov[i, 0]) - self._tx_base, int(self._tx_iov[i, 1])
        name = int(self._tx_msg[i, 0])
        peer = self._peer_of.get(name)
        if peer is not None and 0 <= off and off + n <= len(self._tx_buf):
            self.too_big(self._tx_buf[off : off + n], peer)

    # -- receive ------------------------------------------------------------------------------

    def receive(self, rxbuf: bytearray, coalescer, budget: int) -> None:
        mv = memoryview(rxbuf)
        c = self.c
        drops = self.drops
        members = self.members
        add = coalescer.add
        source_ok = self.table.source_ok
        rx = self._rx
        if rx is None:
            recvfrom_into = self.sock.recvfrom_into
            for _ in range(budget):
                try:
                    n, _addr = recvfrom_into(rxbuf, 0, MSG_DONTWAIT)
                except BlockingIOError:
                    break
                c["rx_syscalls"] += 1
                self._one(mv, 0, n, members, add, c, drops, source_ok)
                coalescer.flush()
            return
        if self._rxbuf is not rxbuf:
            # Point iovec i at slot i of the receive buffer once.
            base = buffer_address(rxbuf)
            slot = self.slot
            for i in range(min(rx.vlen, len(rxbuf) // slot)):
                rx.set_iov(i, base + i * slot, slot)
            self._rxbuf = rxbuf
            self._rx_slots = min(rx.vlen, len(rxbuf) // slot)
            self._rx_np = np.frombuffer(rxbuf, np.uint8)
            self._rx_outer: dict[int, np.ndarray] = {}
            self._rx_inner_src: dict[int, np.ndarray] = {}
        view = rx.msgs_view
        arr = self._rx_np
        msg = self._rx_msg
        add_batch = coalescer.add_batch
        slot = self.slot
        for _ in range(budget):
            got = rx.recvmmsg(self.fd, rx.msgs_addr, self._rx_slots, MSG_DONTWAIT, None)
            if got <= 0:
                if got < 0 and ctypes.get_errno() == errno.EINTR:
                    continue
                break
            c["rx_syscalls"] += 1
            if got >= VECTOR_MIN and self._batch(arr, msg, got, members, add_batch):
                continue
            for i in range(got):
                m = i * MMSG_SIZE
                if view[m + MSG_FLAGS_OFFSET] & MSG_TRUNC:
                    drops["mtu"] += 1
                    continue
                n = int.from_bytes(view[m + MSG_LEN_OFFSET : m + MSG_LEN_OFFSET + 4], "little")
                self._one(mv, i * slot, n, members, add, c, drops, source_ok)
            if got < self._rx_slots:
                break
        # The open run goes out once the socket is drained (it may go on across reads).
        coalescer.flush()

    def _batch(self, arr: np.ndarray, msg: np.ndarray, got: int, members, add_batch) -> bool:
        """A whole recvmmsg batch from one member, none truncated, all IPIP without outer
        options: the inner packets go to the coalescer in one call (which may still refuse)."""
        lens = self._rx_lens[:got]
        slot = self.slot
        # A packet that filled its slot may have been cut (MSG_TRUNC): per packet, which counts it.
        if np.minimum.reduce(lens) < 40 or np.maximum.reduce(lens) >= slot:
            return False
        outer = self._rx_outer.get(got)
        if outer is None:
            outer = self._rx_outer[got] = arr[: got * slot].reshape(got, slot)[:, :20]
        first = outer[0].tobytes()
        if first[0] != 0x45 or first[9] != IPPROTO_IPIP or first[12:16] not in members:
            return False
        if np.count_nonzero((outer ^ outer[0]) & _OUTER_MASK):
            return False
        # One inner source for the whole batch, which routes back to its sender (else packet by
        # packet, each checked: _one).  The inner header starts at 20 (no outer options).
        src = self._rx_inner_src.get(got)
        if src is None:
            src = self._rx_inner_src[got] = arr[: got * slot].reshape(got, slot)[:, 32:36]
        if np.count_nonzero(src != src[0]) or not self.table.source_ok(src[0].tobytes(), first[12:16]):
            return False
        # IPv4 inside only (RFC 2003); the coalescer would take IPv6 too (udp carries it), and
        # an IHL below 5 (_one counts it malformed).  Version and IHL: 0x45 to 0x4F.
        first = arr[20 : got * slot : slot]
        if np.count_nonzero((first < 0x45) | (first > 0x4F)):
            return False
        inner = np.subtract(lens, 20, dtype=np.int64)
        if not add_batch(arr, 20, slot, inner):
            return False
        self.c["rx_packets"] += got
        self.c["rx_bytes"] += int(np.add.reduce(inner))
        return True

    @staticmethod
    def _one(mv, off, n, members, add, c, drops, source_ok) -> None:
        if n < 40:
            drops["malformed"] += 1
            return
        ihl = (mv[off] & 0x0F) << 2
        if mv[off + 9] != IPPROTO_IPIP or ihl < 20:
            drops["malformed"] += 1
            return
        sender = mv[off + 12 : off + 16].tobytes()
        if sender not in members:
            drops["non_member"] += 1
            return
        v = mv[off + ihl : off + n]
        ln = n - ihl
        if ln < 20 or v[0] >> 4 != 4 or not 5 <= (v[0] & 0x0F) <= ln >> 2 or ((v[2] << 8) | v[3]) != ln:  # as _fastpath.c's inner_ok
            drops["malformed"] += 1
            return
        if not source_ok(v[12:16].tobytes(), sender):  # the reverse-path check (NextHopTable.source_ok)
            drops["spoofed"] += 1
            return
        c["rx_packets"] += 1
        c["rx_bytes"] += ln
        add(v)
