"""The C fast path (``_fastpath.c``) as the worker sees it, through ctypes.

The C side polls, moves packets and counts; this side sets it up, gives it the next-hop table and the
member list, answers what it hands back (a packet that needs an ICMP error) and reads its
counters.  :func:`load` says why the fast path is not available (not built, or built from
another version of the C file); the worker then runs the Python path instead and says so.
"""

from __future__ import annotations

import ctypes
import importlib.util
import ipaddress
import socket
import sys

from agentd.dataplane._forward import NextHopTable

# The C file's counter slots, in order: forwarding counters, then drop reasons ("drop:").
COUNTERS = (
    "tx_packets", "tx_bytes", "tx_syscalls", "rx_packets", "rx_bytes", "rx_syscalls",
    "tun_reads", "tun_writes", "tso_frames", "tso_segments", "tso_batches", "coalesced_segments",
    "coalesced_batches", "rx_csum_errors",
    "drop:non_member", "drop:no_route", "drop:ttl_exceeded", "drop:malformed", "drop:mtu", "drop:not_ipv4",
    "drop:send_error", "drop:tun_write_error", "drop:icmp_ratelimited", "drop:spoofed",
)
SLOW_NET_UNREACHABLE = 1
SLOW_TIME_EXCEEDED = 2
SLOW_FRAG_NEEDED = 3  # over the path MTU to slow_peer: frag needed / packet too big
KINDS = {"udp": 0, "ipip": 1}
SLOW_MAX = 1600


class _State(ctypes.Structure):
    """The leading fields of ``struct fp_state`` (the rest is private to C)."""

    _fields_ = [
        ("tun_fd", ctypes.c_int), ("sock_fd", ctypes.c_int), ("kind", ctypes.c_int), ("mtu", ctypes.c_int),
        ("ttl_decrement", ctypes.c_int), ("udp_gso", ctypes.c_int), ("udp_gro", ctypes.c_int),
        ("ipv6", ctypes.c_int), ("port", ctypes.c_uint16),
        ("counters", ctypes.c_uint64 * len(COUNTERS)),
        ("slow_kind", ctypes.c_int), ("slow_len", ctypes.c_int), ("slow", ctypes.c_uint8 * SLOW_MAX),
        ("gso_failed_errno", ctypes.c_int), ("slow_peer", ctypes.c_uint32),
    ]


_lib: ctypes.CDLL | None = None


def layout_mismatch(lib: ctypes.CDLL) -> str:
    """How ``_State`` differs from ``struct fp_state`` as the library exports it (every field:
    name, order, offset, size), or "" when they agree."""
    c_fields = [
        (lib.fp_field_name(i).decode(), lib.fp_field_offset(i), lib.fp_field_size(i))
        for i in range(lib.fp_field_count())
    ]
    py_fields = [(name, getattr(_State, name).offset, getattr(_State, name).size) for name, _ in _State._fields_]
    for c, py in zip(c_fields, py_fields):
        if c != py:
            return f"field {py[0]} at {py[1]} size {py[2]} in _fast.py, {c[0]} at {c[1]} size {c[2]} in C"
    if len(c_fields) != len(py_fields):
        return f"{len(py_fields)} fields in _fast.py, {len(c_fields)} in C"
    return ""


def load() -> tuple[ctypes.CDLL | None, str]:
    """The shared library, or None and the reason it cannot be used."""
    global _lib
    if _lib is not None:
        return _lib, ""
    spec = importlib.util.find_spec("agentd.dataplane._fastpath")
    if spec is None or not spec.origin:
        return None, "agentd/dataplane/_fastpath.c is not built (scripts/dev setup or pip install build it)"
    try:
        lib = ctypes.CDLL(spec.origin, use_errno=True)
    except OSError as exc:
        return None, f"cannot load {spec.origin}: {exc}"
    lib.fp_new.restype = ctypes.POINTER(_State)
    lib.fp_free.argtypes = [ctypes.POINTER(_State)]
    lib.fp_run.argtypes = [ctypes.POINTER(_State), ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.fp_run.restype = ctypes.c_int
    lib.fp_set_routes.argtypes = [ctypes.POINTER(_State), ctypes.c_void_p, ctypes.c_int]
    lib.fp_set_routes6.argtypes = [ctypes.POINTER(_State), ctypes.c_char_p, ctypes.c_int]
    lib.fp_set_sources.argtypes = [ctypes.POINTER(_State), ctypes.c_void_p, ctypes.c_int]
    lib.fp_set_sources6.argtypes = [ctypes.POINTER(_State), ctypes.c_char_p, ctypes.c_int]
    lib.fp_set_members.argtypes = [ctypes.POINTER(_State), ctypes.c_void_p, ctypes.c_int]
    lib.fp_segment.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                               ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    lib.fp_write_packets.argtypes = [ctypes.POINTER(_State), ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int]
    lib.fp_field_name.restype = ctypes.c_char_p
    mismatch = layout_mismatch(lib)
    if lib.fp_counter_count() != len(COUNTERS) or mismatch:
        return None, f"{spec.origin} does not match this agentd ({mismatch or 'counters'}; rebuild it: scripts/dev setup)"
    _lib = lib
    return lib, ""


class FastPath:
    """One worker's C state; :meth:`run` is the worker's poll loop."""

    def __init__(self, lib: ctypes.CDLL, kind: str, *, tun_fd: int, sock_fd: int, mtu: int, ttl_decrement: bool,
                 port: int, udp_gso: bool, udp_gro: bool, ipv6: bool = False) -> None:
        self._lib = lib
        ptr = lib.fp_new()
        if not ptr:
            raise MemoryError("fp_new")
        self._ptr = ptr
        st = self.state = ptr.contents
        st.tun_fd, st.sock_fd, st.kind, st.mtu = tun_fd, sock_fd, KINDS[kind], mtu
        st.ttl_decrement, st.udp_gso, st.udp_gro = int(ttl_decrement), int(udp_gso), int(udp_gro)
        st.ipv6 = int(ipv6)  # IPv6 inner packets carried (udp), else dropped as not_ipv4
        st.port = int.from_bytes(port.to_bytes(2, "big"), sys.byteorder)  # network byte order
        self._run = lib.fp_run
        self._other: tuple[int, ...] = ()
        self._other_arr = (ctypes.c_int * 0)()

    def run(self, other_fds: tuple[int, ...], timeout_ms: int) -> int:
        """Move packets in C until Python is needed: 0 (one of ``other_fds`` is readable, or
        ``timeout_ms`` passed), 1 (a packet waits for an ICMP error: :meth:`slow_packet`),
        2 (interrupted by a signal), -1 (error; errno)."""
        if other_fds != self._other:
            self._other = other_fds
            self._other_arr = (ctypes.c_int * len(other_fds))(*other_fds)
        return self._run(self._ptr, self._other_arr, len(other_fds), timeout_ms)

    def close(self) -> None:
        if self._ptr:
            self._lib.fp_free(self._ptr)
            self._ptr = None

    def set_routes(self, table: NextHopTable, sources: NextHopTable | None = None) -> None:
        """The next hops (the transmit side's), and the reverse-path table: the receive side
        takes an inner source only from the member ``sources`` routes it to, or that member's
        own address (None: the next hops are that table too, as the worker's protocol has it)."""
        self._set(table, self._lib.fp_set_routes, self._lib.fp_set_routes6)
        self._set(table if sources is None else sources, self._lib.fp_set_sources, self._lib.fp_set_sources6)

    def _set(self, table: NextHopTable, set4, set6) -> None:
        rows, rows6 = [], []
        for prefix, via in table.routes.items():
            net = ipaddress.ip_network(prefix)
            peer = ipaddress.IPv4Address(via).packed
            if net.version == 6:  # prefix and mask as in the header, the peer in network byte order
                rows6.append((net.prefixlen, net.network_address.packed + net.netmask.packed + peer))
                continue
            rows.append((net.prefixlen, int(net.network_address), int(net.netmask), int.from_bytes(peer, "big")))
        rows.sort(key=lambda r: -r[0])  # longest prefix first
        rows6.sort(key=lambda r: -r[0])
        flat = (ctypes.c_uint32 * (3 * len(rows)))()
        for i, (_plen, net, mask, via) in enumerate(rows):
            # network byte order in a native uint32: the C side compares raw header words
            flat[3 * i] = int.from_bytes(net.to_bytes(4, "big"), sys.byteorder)
            flat[3 * i + 1] = int.from_bytes(mask.to_bytes(4, "big"), sys.byteorder)
            flat[3 * i + 2] = int.from_bytes(via.to_bytes(4, "big"), sys.byteorder)
        if set4(self._ptr, flat, len(rows)):
            raise MemoryError(set4.__name__)
        if set6(self._ptr, b"".join(entry for _plen, entry in rows6), len(rows6)):
            raise MemoryError(set6.__name__)

    def set_members(self, members) -> None:
        addrs = sorted(int(ipaddress.IPv4Address(m)) for m in members)
        arr = (ctypes.c_uint32 * len(addrs))(*addrs)
        if self._lib.fp_set_members(self._ptr, arr, len(addrs)):
            raise MemoryError("fp_set_members")

    def write_packets(self, packets: list[bytes]) -> int:
        """The receive side's last step (checked, merged, written to the TUN fd) on these
        inner packets; for tests.  Returns how many passed the checks."""
        lens = (ctypes.c_int * len(packets))(*map(len, packets))
        return self._lib.fp_write_packets(self._ptr, b"".join(packets), lens, len(packets))

    def slow_packet(self) -> tuple[int, bytes]:
        st = self.state
        return st.slow_kind, bytes(st.slow[: st.slow_len])

    def slow_peer(self) -> str:
        """The peer a SLOW_FRAG_NEEDED packet was for."""
        return socket.inet_ntoa(self.state.slow_peer.to_bytes(4, sys.byteorder))

    def counters(self) -> dict[str, int]:
        return dict(zip(COUNTERS, self.state.counters, strict=True))

    @property
    def udp_gso(self) -> bool:
        return bool(self.state.udp_gso)

    @property
    def gso_failed_errno(self) -> int:
        return self.state.gso_failed_errno


def segment(pkt: bytes, gso_size: int, ttl_decrement: bool = False) -> tuple[int, int, int, bytes]:
    """The C segmenter on one super-packet, IPv4 or IPv6 (for tests): ``(count, seglen, total,
    segments)``; count < 0 as ``fp_segment`` returns it (-1 malformed, -2 TTL exceeded)."""
    lib, why = load()
    if lib is None:
        raise RuntimeError(why)
    out = ctypes.create_string_buffer(len(pkt) + (len(pkt) // max(gso_size, 1) + 2) * 120)
    seglen, total = ctypes.c_int(), ctypes.c_int()
    count = lib.fp_segment(pkt, len(pkt), gso_size, out, len(out), int(ttl_decrement),
                           ctypes.byref(seglen), ctypes.byref(total))
    if count < 0:
        return count, 0, 0, b""
    return count, seglen.value, total.value, out.raw[: total.value]
