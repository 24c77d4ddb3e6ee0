"""ICMP echo from many lab namespaces at once, in this process: the lab's reachability matrix.

``ping`` once per ordered pod pair is N*(N-1) processes: 9,900 at 100 pods, all started at
once.  Instead, :func:`sweep` opens one raw ICMP socket inside each source namespace (a
socket stays in the namespace it was made in, so one thread can hold sockets of many
namespaces), and a raw ICMPv6 socket where it has IPv6 targets, sends an echo request
(RFC 792; ICMPv6, RFC 4443 §4.1: type 128, the kernel fills in its checksum, RFC 3542 §3.1)
from every source to each of its targets,
re-sends to the targets that have not answered every ``resend`` seconds, and stops when
every pair has answered or at ``deadline``.  A reply counts when it comes from the target's
address to the source's socket with our identifier and our token in its data, so other
pings in the same namespaces (a test's own ``ping``) do not confuse it.

The answer per pair is what ``ping -c 1 -w DEADLINE`` from the source's namespace would
say: did one echo reply come back before the deadline.  At most ``max_sockets`` source
namespaces are swept at once (file descriptors); larger labs are swept in batches.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import os
import select
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

from agentd.kernel.netns import entered

ICMP_ECHO_REPLY = 0
ICMP_ECHO_REQUEST = 8
ICMP6_ECHO_REQUEST = 128  # RFC 4443 §4.1
ICMP6_ECHO_REPLY = 129  # RFC 4443 §4.2
SOL_RAW = 255
ICMP_FILTER = 1  # linux/icmp.h: a bit set for every ICMP type the raw socket must NOT get
ICMP6_FILTER = 1  # linux/icmpv6.h (level IPPROTO_ICMPV6): the same, 256 bits
SO_RCVBUFFORCE = 33
DATA_LEN = 56  # what ping sends by default
BURST = 64  # echo requests sent before the sockets are drained (queues of veths and bridges are finite)
_ICMP = struct.Struct("!BBHHH")


@dataclass(frozen=True)
class Source:
    """One sender: a key for the result (a pod name), its namespace path and target addresses."""

    key: str
    netns_path: str
    targets: tuple[str, ...]


def checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071): one's complement of the one's complement sum."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def echo_request(ident: int, seq: int, data: bytes, version: int = 4) -> bytes:
    if version == 6:  # the kernel computes an ICMPv6 socket's checksum (over its pseudo-header)
        return _ICMP.pack(ICMP6_ECHO_REQUEST, 0, 0, ident, seq) + data
    header = _ICMP.pack(ICMP_ECHO_REQUEST, 0, 0, ident, seq)
    return _ICMP.pack(ICMP_ECHO_REQUEST, 0, checksum(header + data), ident, seq) + data


def parse_echo_reply(packet: bytes, version: int = 4) -> tuple[int, int, bytes] | None:
    """(identifier, sequence, data) of an echo reply: an IPv4 packet holding an ICMP one, or
    (``version`` 6) the ICMPv6 message itself (raw IPv6 sockets get no IP header); else None."""
    if version == 6:
        offset, want = 0, ICMP6_ECHO_REPLY
    else:
        if len(packet) < 20:
            return None
        offset, want = (packet[0] & 0x0F) * 4, ICMP_ECHO_REPLY
    if len(packet) < offset + _ICMP.size:
        return None
    kind, code, _sum, ident, seq = _ICMP.unpack_from(packet, offset)
    if kind != want or code != 0:
        return None
    return ident, seq, packet[offset + _ICMP.size :]


def _open(netns_path: str, version: int = 4) -> socket.socket:
    with entered(netns_path):
        if version == 6:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    try:
        sock.setblocking(False)
        # Only echo replies reach us, not the requests other sources send to this pod.
        if version == 6:
            blocked = [0xFFFFFFFF] * 8
            blocked[ICMP6_ECHO_REPLY >> 5] &= ~(1 << (ICMP6_ECHO_REPLY & 31))
            sock.setsockopt(socket.IPPROTO_ICMPV6, ICMP6_FILTER, struct.pack("8I", *blocked))
        else:
            sock.setsockopt(SOL_RAW, ICMP_FILTER, struct.pack("I", ~(1 << ICMP_ECHO_REPLY) & 0xFFFFFFFF))
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 1 << 20)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    except BaseException:
        sock.close()
        raise
    return sock


def sweep(
    sources: Sequence[Source], *, deadline: float = 3.0, resend: float = 0.5, max_sockets: int = 256
) -> dict[tuple[str, str], bool]:
    """{(source key, target address): answered} for every target of every source.  Blocking:
    the caller runs it in a thread (it moves only the calling thread between namespaces)."""
    out: dict[tuple[str, str], bool] = {}
    for i in range(0, len(sources), max_sockets):
        out.update(_sweep_batch(sources[i : i + max_sockets], deadline, resend))
    return out


def _sweep_batch(sources: Sequence[Source], deadline: float, resend: float) -> dict[tuple[str, str], bool]:
    ident = int.from_bytes(os.urandom(2), "big")
    token = os.urandom(8)
    data = token + bytes(DATA_LEN - len(token))
    # socks[i][version]: source i's socket of that IP version (only for the versions it targets).
    socks: list[dict[int, socket.socket]] = []
    # The targets as the kernel writes a reply's source address (one spelling of each IPv6 one).
    canonical = [[str(ipaddress.ip_address(t)) for t in src.targets] for src in sources]
    try:
        for src, targets in zip(sources, canonical):
            mine: dict[int, socket.socket] = {}
            try:
                for version in sorted({6 if ":" in t else 4 for t in targets}):
                    mine[version] = _open(src.netns_path, version)
            except FileNotFoundError:  # no such namespace (a pod not attached yet): nothing answers it
                for sock in mine.values():
                    sock.close()
                mine = {}
            socks.append(mine)
        # pending[i]: target indexes of source i (the echo sequence number) still unanswered.
        pending = [set(range(len(src.targets))) for src in sources]
        live = [i for i, s in enumerate(socks) if s]
        by_fd = {sock.fileno(): (i, v) for i in live for v, sock in socks[i].items()}
        poller = select.poll()
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        end = time.monotonic() + deadline
        next_send = 0.0
        while any(pending[i] for i in live) and (now := time.monotonic()) < end:
            if now >= next_send:
                next_send = now + resend
                sent = 0
                for i in live:
                    for seq in sorted(pending[i]):
                        target = canonical[i][seq]
                        version = 6 if ":" in target else 4
                        try:
                            socks[i][version].sendto(echo_request(ident, seq, data, version), (target, 0))
                        except OSError as err:  # no route yet, a full queue: the next round re-sends
                            if err.errno not in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENOBUFS,
                                                 errno.EAGAIN, errno.EPERM, errno.EACCES, errno.EADDRNOTAVAIL):
                                raise
                        sent += 1
                        if sent % BURST == 0:
                            _drain(poller, by_fd, socks, canonical, pending, ident, token, 0)
            wait = max(0.0, min(next_send, end) - time.monotonic())
            _drain(poller, by_fd, socks, canonical, pending, ident, token, wait)
        return {
            (src.key, target): seq not in pending[i]
            for i, src in enumerate(sources)
            for seq, target in enumerate(src.targets)
        }
    finally:
        for mine in socks:
            for sock in mine.values():
                sock.close()


def _drain(poller, by_fd, socks, canonical, pending, ident: int, token: bytes, wait: float) -> None:
    """Read every reply waiting (up to ``wait`` seconds for the first) and strike its pair off."""
    for fd, _ in poller.poll(math.ceil(wait * 1000)):
        i, version = by_fd[fd]
        while True:
            try:
                packet, peer = socks[i][version].recvfrom(2048)
            except BlockingIOError:
                break
            reply = parse_echo_reply(packet, version)
            if reply is None:
                continue
            got_ident, seq, body = reply
            targets = canonical[i]
            if got_ident == ident and body.startswith(token) and seq < len(targets) and targets[seq] == peer[0]:
                pending[i].discard(seq)
