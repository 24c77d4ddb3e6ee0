"""The NETLINK_ROUTE socket of agentd's one netlink stack: the I/O half beside the pure codec
in :mod:`agentd.kernel.netlink`.

Bulk work (the route programmer) sends batches and dumps from the event loop
(:meth:`NetlinkSocket.send_batch`, :meth:`NetlinkSocket.dump`); the rare requests (device
set-up, tc, ``ip route get``) go one at a time through :meth:`NetlinkSocket.request`, blocking
(``agentd.kernel.rtnl``, run off the loop); nf_tables batches, acked request by request,
through :meth:`NetlinkSocket.transact`, blocking (``agentd.nft.nfnetlink``, run off the
loop).  Kernel refusals raise ``nl.NetlinkError``.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno as _errno
import mmap
import os
import select
import socket
import struct
import sys
from collections.abc import Callable, Iterable, Iterator

from agentd.kernel import netlink as nl

_NLMSGHDR = struct.Struct("=IHHII")

class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _drop_pid_filter(pid: int) -> tuple[bytes, object]:
    """Classic BPF: drop messages whose nlmsg_pid is ``pid``.  A listener then never sees
    the notifications its own requests cause (100k of them during a bulk install), so they
    cannot overrun it.  BPF loads words big-endian; nlmsg_pid is host order."""
    k = int.from_bytes(pid.to_bytes(4, sys.byteorder), "big")
    prog = (_SockFilter * 4)(
        _SockFilter(0x20, 0, 0, 12),  # A = word at offset 12 (nlmsg_pid)
        _SockFilter(0x15, 0, 1, k),  # if A == k goto drop else goto accept
        _SockFilter(0x06, 0, 0, 0),  # drop
        _SockFilter(0x06, 0, 0, 0xFFFFFFFF),  # accept
    )
    fprog = _SockFprog(4, prog)
    return bytes(fprog), prog  # keep ``prog`` alive across setsockopt


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32), ("iov", ctypes.POINTER(_Iovec)),
                ("iovlen", ctypes.c_size_t), ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("hdr", _Msghdr), ("len", ctypes.c_uint)]


# One mmsghdr as recvmmsg leaves it: its msg_len (the bytes received).
_MMSG_LEN = struct.Struct(f"={_Mmsghdr.len.offset}xI{ctypes.sizeof(_Mmsghdr) - _Mmsghdr.len.offset - 4}x")
_libc = ctypes.CDLL(None, use_errno=True)
_recvmmsg = _libc.recvmmsg
_recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
_recvmmsg.restype = ctypes.c_int


class _Batch:
    """recvmmsg(2)'s vector over ``buf``, cut into ``count`` slots of ``size`` bytes, made once."""

    def __init__(self, buf: mmap.mmap, count: int) -> None:
        self.size = len(buf) // count
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        self.iovs = (_Iovec * count)(*(_Iovec(base + i * self.size, self.size) for i in range(count)))
        self.msgs = (_Mmsghdr * count)()
        for i in range(count):
            self.msgs[i].hdr.iov = ctypes.pointer(self.iovs[i])
            self.msgs[i].hdr.iovlen = 1
        self.results = memoryview(self.msgs).cast("B")  # type: ignore[arg-type]
        self.count = count


class NetlinkSocket:
    """A non-blocking nl.NETLINK_ROUTE socket with the options a bulk programmer wants
    (``protocol=nl.NETLINK_NETFILTER``: the same framing for nfnetlink, e.g. ctnetlink).

    Open it inside the target namespace (``Netns.entered()``); it stays bound there.
    ``groups`` subscribes to multicast (RTMGRP_*); ``ignore_pid`` drops notifications caused
    by that port id (pass the request socket's ``portid`` to a monitor socket).
    """

    RECV_SIZE = 1 << 20

    def __init__(
        self,
        groups: int = 0,
        *,
        rcvbuf: int = 32 << 20,
        sndbuf: int = 8 << 20,
        ignore_pid: int | None = None,
        protocol: int = nl.NETLINK_ROUTE,
    ) -> None:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC, protocol)
        try:
            _set_buffer(sock, nl.SO_RCVBUFFORCE, socket.SO_RCVBUF, rcvbuf)
            _set_buffer(sock, nl.SO_SNDBUFFORCE, socket.SO_SNDBUF, sndbuf)
            for option in (nl.NETLINK_CAP_ACK, nl.NETLINK_EXT_ACK, nl.NETLINK_GET_STRICT_CHK):
                try:
                    sock.setsockopt(nl.SOL_NETLINK, option, 1)
                except OSError:
                    pass  # older kernels: acks are longer, dumps unfiltered; both still parse
            if ignore_pid is not None:
                fprog, _keep = _drop_pid_filter(ignore_pid)
                sock.setsockopt(socket.SOL_SOCKET, nl.SO_ATTACH_FILTER, fprog)
            sock.bind((0, groups))
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.portid: int = sock.getsockname()[0]
        self.sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        # Anonymous memory, not a bytearray: a bytearray is zeroed by the process, so every
        # socket's whole buffer would count in the agent's RSS from the start; the kernel's
        # zero pages are only made real where a datagram is written, and an idle agent's
        # replies are a few kB.
        self._buf = mmap.mmap(-1, self.RECV_SIZE)
        self._view = memoryview(self._buf)
        self._batch: _Batch | None = None

    def fileno(self) -> int:
        return self.sock.fileno()

    def attach_filter(self, program: list[tuple[int, int, int, int]]) -> None:
        """Have the kernel run a classic BPF program, ``(code, jt, jf, k)`` instructions, on
        every message before it queues it for this socket (SO_ATTACH_FILTER): what the program
        returns 0 for is never queued.  The kernel copies the program."""
        prog = (_SockFilter * len(program))(*(_SockFilter(*ins) for ins in program))
        self.sock.setsockopt(socket.SOL_SOCKET, nl.SO_ATTACH_FILTER, bytes(_SockFprog(len(program), prog)))

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.send(data)

    def recv(self) -> bytes | None:
        """One datagram (one kernel skb, possibly many messages), or None if none is queued.
        Raises OSError(ENOBUFS) when the kernel had to drop messages for us."""
        try:
            n = self.sock.recv_into(self._buf)
        except BlockingIOError:
            return None
        return bytes(self._view[:n])

    BATCH = 64  # datagrams :meth:`recv_many` takes in one system call at most

    def recv_many(self) -> list[bytes]:
        """The datagrams queued, up to :attr:`BATCH` of them, in one system call (recvmmsg(2)):
        for a listener of many small multicast messages (conntrack's events), whose reads one
        datagram at a time would cost a system call each.  Each has ``RECV_SIZE // BATCH``
        bytes at most (netlink cuts a longer one, for its decoder to refuse).  [] if none is
        queued; raises OSError(ENOBUFS) when the kernel had to drop messages for us."""
        batch = self._batch
        if batch is None:
            batch = self._batch = _Batch(self._buf, self.BATCH)
        n = _recvmmsg(self.sock.fileno(), batch.msgs, batch.count, socket.MSG_DONTWAIT, None)
        if n < 0:
            err = ctypes.get_errno()
            if err in (_errno.EAGAIN, _errno.EINTR):
                return []
            raise OSError(err, os.strerror(err))
        view, size = self._view, batch.size
        return [bytes(view[i * size:i * size + length])
                for i, (length,) in enumerate(_MMSG_LEN.iter_unpack(batch.results[:n * _MMSG_LEN.size]))]

    async def wait_readable(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(True)

        loop.add_reader(self.sock.fileno(), ready)
        try:
            async with asyncio.timeout(timeout):  # not wait_for: a cancel as the socket turns readable must not be lost
                return await fut
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(self.sock.fileno())

    def request(
        self, message: bytes, *, what: str, timeout: float = 10.0, dump: bool | None = None
    ) -> list[tuple[int, bytes, int, int]]:
        """Blocking: send one request and return its answers as ``(type, buf, start, end)``.

        For the few, rare requests that are not bulk work (device set-up, tc, ``ip route
        get``; callers run them off the event loop).  A dump (nl.NLM_F_DUMP) ends at nl.NLMSG_DONE;
        anything else is sent with nl.NLM_F_ACK and ends at its ACK.  The kernel's refusal raises
        :class:`nl.NetlinkError` naming ``what``.  ``dump`` says which it is where the rtnetlink
        rule below does not apply (another netlink family)."""
        mtype, flags, seq = _NLMSGHDR.unpack_from(message)[1:4]
        if dump is None:
            # The kernel's own test (rtnetlink_rcv_msg): a GET kind ((type - nl.RTM_BASE) & 3 == 2)
            # with either dump bit set is a dump.
            dump = bool((mtype - nl.RTM_BASE) & 3 == 2 and flags & nl.NLM_F_DUMP)
        if not dump:
            message = nl.with_flags(message, nl.NLM_F_ACK)
        self.send(message)
        answers: list[tuple[int, bytes, int, int]] = []
        for rtype, rflags, rseq, chunk, start, end in self._blocking_messages(what, timeout):
            if rseq != seq:
                continue  # a late answer to an earlier request
            if rtype == nl.NLMSG_DONE:
                return answers
            if rtype == nl.NLMSG_ERROR:
                err, kernel_message = nl.decode_error(chunk, start, end, rflags)
                if err:
                    raise nl.NetlinkError(err, kernel_message, what)
                return answers  # the ACK
            answers.append((rtype, chunk, start, end))
        raise AssertionError("unreachable")  # _blocking_messages ends only by raising

    def transact(
        self, data: bytes, first_seq: int, last_seq: int, *, acked: Iterable[int], what: str, timeout: float = 10.0
    ) -> None:
        """Blocking: send concatenated requests numbered ``first_seq`` .. ``last_seq`` and return
        once each of ``acked`` (those that ask for an ACK, nl.NLM_F_ACK) is acknowledged; an
        error ack for any of them raises :class:`nl.NetlinkError` naming ``what``.

        For nfnetlink batches (NFNL_MSG_BATCH_BEGIN, requests, NFNL_MSG_BATCH_END): the kernel
        commits their requests as one transaction or none and acks each of them either way
        (nfnetlink_rcv_batch), so the first error is the fate of the batch; a refused batch
        begin (EPERM, an unknown subsystem) is answered under its own number.  Answers outside
        the range (the rest of an earlier, refused batch) are skipped."""
        pending = set(acked)
        if not pending:
            return
        self.send(data)
        for rtype, rflags, rseq, chunk, start, end in self._blocking_messages(what, timeout):
            if rtype != nl.NLMSG_ERROR or not first_seq <= rseq <= last_seq:
                continue
            err, kernel_message = nl.decode_error(chunk, start, end, rflags)
            if err:
                raise nl.NetlinkError(err, kernel_message, what)
            pending.discard(rseq)
            if not pending:
                return

    def _blocking_messages(self, what: str, timeout: float) -> Iterator[tuple[int, int, int, bytes, int, int]]:
        """``(type, flags, seq, buf, start, end)`` of every message received, waiting up to
        ``timeout`` seconds for each datagram (then nl.NetlinkError ETIMEDOUT naming ``what``)."""
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        while True:
            chunk = self.recv()
            if chunk is None:
                if not poller.poll(timeout * 1000):
                    raise nl.NetlinkError(_errno.ETIMEDOUT, None, what)
                continue
            for rtype, rflags, rseq, _pid, start, end in nl.iter_messages(chunk):
                yield rtype, rflags, rseq, chunk, start, end

    async def send_batch(self, data: bytes, first_seq: int, last_seq: int, *, timeout: float = 10.0) -> tuple[list[tuple[int, int, str | None]], bool]:
        """Send concatenated requests (only the last asks for an ACK) and collect the errors.

        Returns ``([(seq, errno, kernel message), ...], complete)``.  ``complete`` is False when
        the kernel overran our receive buffer or the final ACK never came: some errors may be
        missing and the caller must re-read kernel state.
        """
        self.send(data)
        errors: list[tuple[int, int, str | None]] = []
        complete = True
        while True:
            try:
                chunk = self.recv()
            except OSError as exc:
                if exc.errno != _errno.ENOBUFS:
                    raise
                complete = False
                continue
            if chunk is None:
                if not await self.wait_readable(timeout):
                    return errors, False
                continue
            for mtype, mflags, seq, _pid, start, end in nl.iter_messages(chunk):
                if mtype != nl.NLMSG_ERROR or not first_seq <= seq <= last_seq:
                    continue  # a late answer to an earlier, abandoned batch
                err, message = nl.decode_error(chunk, start, end, mflags)
                if err:
                    errors.append((seq, err, message))
                if seq == last_seq:
                    return errors, complete

    async def dump(
        self,
        request: bytes,
        seq: int,
        handle: Callable[[int, bytes, int, int], None],
        *,
        timeout: float = 30.0,
        what: str = "dump",
    ) -> bool:
        """Send a dump request and call ``handle(type, buf, start, end)`` per answer message.

        Returns False if the kernel flagged the dump inconsistent (nl.NLM_F_DUMP_INTR: the table
        changed mid-dump); callers usually dump again.  Kernel errors raise nl.NetlinkError.
        """
        self.send(request)
        consistent = True
        chunks = 0
        while True:
            chunk = self.recv()
            if chunk is None:
                if not await self.wait_readable(timeout):
                    raise nl.NetlinkError(_errno.ETIMEDOUT, None, what)
                continue
            for mtype, mflags, mseq, _pid, start, end in nl.iter_messages(chunk):
                if mseq != seq:
                    continue
                if mflags & nl.NLM_F_DUMP_INTR:
                    consistent = False
                if mtype == nl.NLMSG_DONE:
                    return consistent
                if mtype == nl.NLMSG_ERROR:
                    err, message = nl.decode_error(chunk, start, end, mflags)
                    raise nl.NetlinkError(err, message, what)
                handle(mtype, chunk, start, end)
            chunks += 1
            if chunks % 16 == 0:
                await asyncio.sleep(0)  # a 100k-route dump must not starve the loop


def _set_buffer(sock: socket.socket, force: int, plain: int, size: int) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, force, size)  # needs CAP_NET_ADMIN, ignores rmem_max
    except PermissionError:
        sock.setsockopt(socket.SOL_SOCKET, plain, size)
