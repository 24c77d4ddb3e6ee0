"""The receive path of the route-reflector client simulator: count messages, keep held prefixes.

:func:`scan_py` is the reference; bench/_rrscan.c is the same function in C, built here on
first use (``cc -O2 -shared``) and called through ctypes (:class:`Scanner`), because at
N = 2,000 clients a reflector sends ~4 million one-prefix UPDATEs and a Python loop over
them (~1-2 us each) would make the simulator the bottleneck.  tests/unit/bench/ holds the
two equal.

The simulated clients announce prefix i as ``BASE + i * 64`` / 26.  A client's state is a
bitmap of N bits (bit i: it holds client i's prefix) and the counters named in ``C_*``.
Standard library only (this runs inside the simulator process).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile

# Counter slots, in the order of the C enum.
C_UPDATES, C_KEEPALIVES, C_ANNOUNCED, C_WITHDRAWN, C_HELD, C_FOREIGN, C_EOR, C_OWN, C_BYTES = range(9)
N_COUNTERS = 9
COUNTER_NAMES = ("updates", "keepalives", "announced", "withdrawn", "held", "foreign", "eor", "own", "bytes")

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rrscan.c")


# --------------------------------------------------------------------------- reference


def _valid(p: bytes | memoryview, start: int, end: int) -> bool:
    i = start
    while i < end:
        if p[i] > 32:
            return False
        i += 1 + (p[i] + 7) // 8
    return i == end


def _apply(p, start: int, end: int, bitmap: bytearray, nbits: int, base: int, own: int, ctr: list[int],
           announce: bool) -> None:
    i = start
    while i < end:
        plen = p[i]
        octets = (plen + 7) // 8
        addr = int.from_bytes(bytes(p[i + 1 : i + 1 + octets]).ljust(4, b"\0"), "big")
        off = (addr - base) & 0xFFFFFFFF
        if plen == 26 and addr >= base and off & 63 == 0 and off >> 6 < nbits:
            idx = off >> 6
            if idx == own:
                ctr[C_OWN] += 1
            else:
                bit = 1 << (idx & 7)
                if announce:
                    ctr[C_ANNOUNCED] += 1
                    if not bitmap[idx >> 3] & bit:
                        bitmap[idx >> 3] |= bit
                        ctr[C_HELD] += 1
                else:
                    ctr[C_WITHDRAWN] += 1
                    if bitmap[idx >> 3] & bit:
                        bitmap[idx >> 3] &= ~bit & 0xFF
                        ctr[C_HELD] -= 1
        else:
            ctr[C_FOREIGN] += 1
        i += 1 + octets


def _update(b, s: int, e: int, bitmap: bytearray, nbits: int, base: int, own: int, ctr: list[int]) -> bool:
    n = e - s
    if n < 4:
        return False
    wlen = (b[s] << 8) | b[s + 1]
    if 4 + wlen > n:
        return False
    alen = (b[s + 2 + wlen] << 8) | b[s + 3 + wlen]
    if 4 + wlen + alen > n:
        return False
    w = (s + 2, s + 2 + wlen)
    a, a_end = s + 4 + wlen, s + 4 + wlen + alen
    nlri = (a_end, e)
    mp_reach = mp_unreach = None
    other_attrs = mp_unreach_v4 = False
    i = a
    while i < a_end:
        if i + 3 > a_end:
            return False
        flags, code = b[i], b[i + 1]
        if flags & 0x10:
            if i + 4 > a_end:
                return False
            vlen, hdr = (b[i + 2] << 8) | b[i + 3], 4
        else:
            vlen, hdr = b[i + 2], 3
        if i + hdr + vlen > a_end:
            return False
        v = i + hdr
        if code in (14, 15):
            if vlen < 3:
                return False
            v4 = ((b[v] << 8) | b[v + 1]) == 1 and b[v + 2] == 1
            if code == 14:
                if vlen < 5 or 5 + b[v + 3] > vlen:
                    return False
                if v4:
                    mp_reach = (v + 5 + b[v + 3], v + vlen)
                other_attrs = True
            elif v4:
                mp_unreach = (v + 3, v + vlen)
                mp_unreach_v4 = True
            else:
                other_attrs = True
        else:
            other_attrs = True
        i += hdr + vlen
    lists = [(w, False), (mp_unreach, False), (nlri, True), (mp_reach, True)]
    if not all(_valid(b, *span) for span, _ in lists if span is not None):
        return False
    for span, announce in lists:
        if span is not None:
            _apply(b, *span, bitmap, nbits, base, own, ctr, announce)
    mp_eor = mp_unreach_v4 and mp_unreach is not None and mp_unreach[0] == mp_unreach[1] and not other_attrs
    if wlen == 0 and nlri[0] == nlri[1] and (alen == 0 or mp_eor):
        ctr[C_EOR] += 1
    ctr[C_UPDATES] += 1
    return True


def scan_py(buf: bytes | bytearray | memoryview, bitmap: bytearray, nbits: int, base: int, own: int,
            ctr: list[int]) -> int:
    """Bytes consumed: a run of whole, well-formed UPDATE and KEEPALIVE messages from the start
    of ``buf``, applied to ``bitmap`` and ``ctr``; stops before a partial message, another
    message type, or a malformed message (see bench/_rrscan.c)."""
    pos, end = 0, len(buf)
    while end - pos >= 19:
        if bytes(buf[pos : pos + 16]) != b"\xff" * 16:
            return pos
        mlen = (buf[pos + 16] << 8) | buf[pos + 17]
        if mlen < 19 or mlen > 4096 or mlen > end - pos:
            return pos
        mtype = buf[pos + 18]
        if mtype == 4:
            if mlen != 19:
                return pos
            ctr[C_KEEPALIVES] += 1
        elif mtype == 2:
            if not _update(buf, pos + 19, pos + mlen, bitmap, nbits, base, own, ctr):
                return pos
        else:
            return pos
        ctr[C_BYTES] += mlen
        pos += mlen
    return pos


# --------------------------------------------------------------------------- the C build


class ScanBuildError(RuntimeError):
    """The C scanner could not be built; the message has the compiler's output."""


def build(out_dir: str | None = None) -> str:
    """Compile bench/_rrscan.c into a shared object (reused while newer than the source)."""
    out_dir = out_dir or tempfile.gettempdir()
    lib = os.path.join(out_dir, f"agentd-bench-rrscan-{os.getuid()}.so")
    if os.path.exists(lib) and os.path.getmtime(lib) >= os.path.getmtime(_SOURCE):
        return lib
    tmp = f"{lib}.{os.getpid()}"
    cc = os.environ.get("CC", "cc")
    try:
        proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wall", "-o", tmp, _SOURCE], check=False,
                              capture_output=True, text=True, timeout=120)
    except OSError as err:
        raise ScanBuildError(f"{cc}: {err}") from None
    if proc.returncode != 0:
        raise ScanBuildError(f"{cc} failed on {_SOURCE}: {proc.stderr.strip()}")
    os.replace(tmp, lib)
    return lib


LEFTOVER = 4096


class RrClient(ctypes.Structure):
    """``struct rr_client`` of bench/_rrscan.c: one client's counters and receive state."""

    _fields_ = [
        ("ctr", ctypes.c_int64 * N_COUNTERS),
        ("target", ctypes.c_int64),
        ("last_rx", ctypes.c_double),
        ("max_gap", ctypes.c_double),
        ("own", ctypes.c_int32),
        ("done", ctypes.c_int32),
        ("left", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("leftover", ctypes.c_ubyte * LEFTOVER),
    ]


class RrState(ctypes.Structure):
    """``struct rr_state`` of bench/_rrscan.c: what rr_pump needs and what it reports."""

    _fields_ = [
        ("nbits", ctypes.c_int64),
        ("base", ctypes.c_int64),
        ("bitmaps", ctypes.c_void_p),
        ("stride", ctypes.c_int64),
        ("clients", ctypes.c_void_p),
        ("fd2idx", ctypes.c_void_p),
        ("nfds", ctypes.c_int64),
        ("rbuf", ctypes.c_void_p),
        ("rbuf_size", ctypes.c_int64),
        ("recv_max", ctypes.c_int64),
        ("done_count", ctypes.c_int64),
        ("want_done", ctypes.c_int64),
        ("t_done", ctypes.c_double),
        ("last_update", ctypes.c_double),
        ("recvs", ctypes.c_int64),
        ("ev_client", ctypes.c_int64),
        ("ev_kind", ctypes.c_int64),
        ("ev_pos", ctypes.c_int64),
        ("ev_len", ctypes.c_int64),
        ("ev_errno", ctypes.c_int64),
    ]


EV_MESSAGE, EV_CLOSED, EV_ERROR = 1, 2, 3


class Scanner:
    """The C receive path for ``nbits`` clients: their states, bitmaps and one receive buffer.

    ``scan(address, length, client)`` is ``rr_scan`` on one client's state;
    ``pump(epoll_fd, budget)`` is ``rr_pump`` (reads every ready Established socket).
    """

    def __init__(self, nbits: int, base: int, lib_path: str | None = None, *, recv_max: int = 256 * 1024,
                 max_fds: int = 65536) -> None:
        lib = ctypes.CDLL(lib_path or build())
        scan = lib.rr_scan
        scan.restype = ctypes.c_long
        scan.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_uint32,
                         ctypes.c_long, ctypes.c_void_p]
        pump = lib.rr_pump
        pump.restype = ctypes.c_long
        pump.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_double]
        self._scan, self._pump = scan, pump
        self.nbits, self.base = nbits, base
        self.stride = (nbits + 7) // 8
        self.clients = (RrClient * max(1, nbits))()
        self.bitmaps = (ctypes.c_ubyte * max(1, nbits * self.stride))()
        self.fd2idx = (ctypes.c_int32 * max_fds)(*([-1] * max_fds))
        self.rbuf = (ctypes.c_ubyte * (recv_max + 2 * LEFTOVER))()
        self.rbuf_address = ctypes.addressof(self.rbuf)
        st = self.state = RrState()
        st.nbits, st.base, st.stride = nbits, base, self.stride
        st.bitmaps, st.clients = ctypes.addressof(self.bitmaps), ctypes.addressof(self.clients)
        st.fd2idx, st.nfds = ctypes.addressof(self.fd2idx), max_fds
        st.rbuf, st.rbuf_size, st.recv_max = self.rbuf_address, len(self.rbuf), recv_max
        self._state_ref = ctypes.byref(st)
        self._bitmap0 = ctypes.addressof(self.bitmaps)
        self._client0 = ctypes.addressof(self.clients)
        self._client_size = ctypes.sizeof(RrClient)
        for i in range(nbits):
            self.clients[i].own = i
            self.clients[i].target = -1

    def bitmap_address(self, i: int) -> int:
        return self._bitmap0 + i * self.stride

    def bitmap(self, i: int) -> bytes:
        return ctypes.string_at(self.bitmap_address(i), self.stride)

    def scan(self, address: int, length: int, i: int) -> int:
        return self._scan(address, length, self._bitmap0 + i * self.stride, self.nbits, self.base, i,
                          self._client0 + i * self._client_size)

    def pump(self, epoll_fd: int, budget: float) -> int:
        return self._pump(self._state_ref, epoll_fd, budget)
