"""Socket options and the ``sendmmsg``/``recvmmsg`` batch calls (through ctypes) shared by
the transports."""

from __future__ import annotations

import ctypes
import socket
import struct

IP_MTU_DISCOVER = 10
IP_PMTUDISC_DO = 2
SO_SNDBUFFORCE = 32
SO_RCVBUFFORCE = 33
MSG_DONTWAIT = 0x40
MSG_TRUNC = 0x20


def enlarge_buffers(sock: socket.socket, size: int, fallbacks: dict[str, str]) -> None:
    """Ask for ``size``-byte socket buffers; the *FORCE variants ignore net.core.[rw]mem_max
    (we run as root); otherwise the kernel clamps, which we report."""
    for force, plain, name in ((SO_SNDBUFFORCE, socket.SO_SNDBUF, "sndbuf"),
                               (SO_RCVBUFFORCE, socket.SO_RCVBUF, "rcvbuf")):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, size)
        except OSError as exc:
            sock.setsockopt(socket.SOL_SOCKET, plain, size)
            fallbacks[name] = f"SO_{name.upper()}FORCE refused ({exc.strerror}); clamped to rmem/wmem_max"


class iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class msghdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.POINTER(iovec)),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


class mmsghdr(ctypes.Structure):
    _fields_ = [("msg_hdr", msghdr), ("msg_len", ctypes.c_uint)]


MMSG_SIZE = ctypes.sizeof(mmsghdr)
IOV_SIZE = ctypes.sizeof(iovec)
MSG_LEN_OFFSET = mmsghdr.msg_len.offset
MSG_FLAGS_OFFSET = msghdr.msg_flags.offset
_PTR = struct.Struct("@P")
_IOV = struct.Struct("@PN")


def buffer_address(buf: bytearray) -> int:
    """Address of a bytearray's storage (the bytearray must never be resized afterwards)."""
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


class MmsgBatch:
    """A reusable array of ``vlen`` single-iovec messages for sendmmsg/recvmmsg.

    The arrays are built once; per batch only the iovecs (base, len) and, for sends, the
    msg_name pointers are rewritten (through numpy views of the arrays, a whole run at a time)
    — no Python objects per packet.
    """

    def __init__(self, vlen: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.sendmmsg = libc.sendmmsg
        self.sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
        self.recvmmsg = libc.recvmmsg
        self.recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
        self.vlen = vlen
        self.msgs = (mmsghdr * vlen)()
        self.iovs = (iovec * vlen)()
        for i in range(vlen):
            self.msgs[i].msg_hdr.msg_iov = ctypes.pointer(self.iovs[i])
            self.msgs[i].msg_hdr.msg_iovlen = 1
        self.msgs_addr = ctypes.addressof(self.msgs)
        self.msgs_view = memoryview(self.msgs).cast("B")
        self.iovs_view = memoryview(self.iovs).cast("B")

    def set_iov(self, i: int, base: int, length: int) -> None:
        _IOV.pack_into(self.iovs_view, i * IOV_SIZE, base, length)


def sockaddr_in(ip: str, port: int = 0) -> ctypes.Array:
    """A ``struct sockaddr_in`` in a ctypes buffer (keep a reference while it is in use)."""
    raw = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(ip) + b"\0" * 8
    return ctypes.create_string_buffer(raw, len(raw))
