"""A hand-driven BGP neighbour on a real socket, for the robustness tests: it sends what a
test tells it to (malformed, oversized, endless), reads what it is sent, or stops reading.

    peer = RawBgpPeer.connect(ns, "10.0.0.9", "10.0.0.1", asn=65001)   # OPEN/KEEPALIVE done
    peer.send(update_bytes)
    peer.read(1.0)                      # messages that arrived within a second, framed
    peer.closed, peer.notifications()   # whether the speaker ended the session, and why

The socket is made inside the namespace (``Netns.connect``) and used from the test's own
thread; nothing here runs in the background.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from ipaddress import IPv4Address

from proto.capabilities import GracefulRestart, GracefulRestartFamily, MultiProtocol, RouteRefresh
from proto.messages import Keepalive, MessageReader, MessageType, Notification, Open

from .netns import Netns

IP_MINTTL = 21  # linux/in.h


def attr(flags: int, code: int, value: bytes) -> bytes:
    """One path attribute, with the extended length flag when the value needs it."""
    if len(value) > 255:
        return bytes((flags | 0x10, code)) + struct.pack("!H", len(value)) + value
    return bytes((flags, code, len(value))) + value


def as_path(asns: list[int], width: int = 4, kind: int = 2) -> bytes:
    segs = b"".join(
        bytes((kind, len(chunk))) + b"".join(a.to_bytes(width, "big") for a in chunk)
        for chunk in (asns[i : i + 255] for i in range(0, len(asns), 255))
    )
    return attr(0x40, 2, segs)


def update(attrs: bytes, nlri: bytes = b"", withdrawn: bytes = b"") -> bytes:
    body = struct.pack("!H", len(withdrawn)) + withdrawn + struct.pack("!H", len(attrs)) + attrs + nlri
    return b"\xff" * 16 + struct.pack("!HB", 19 + len(body), 2) + body


def route_refresh(afi: int = 1, safi: int = 1) -> bytes:
    return b"\xff" * 16 + struct.pack("!HBHBB", 23, 5, afi, 0, safi)


def prefix(text: str) -> bytes:
    net, _, length = text.partition("/")
    n = int(length)
    return bytes((n,)) + IPv4Address(net).packed[: (n + 7) // 8]


class RawBgpPeer:
    def __init__(self, sock: socket.socket, asn: int, four_octet: bool, graceful_restart: bool = False) -> None:
        self.sock = sock
        self.asn = asn
        self.four_octet = four_octet
        self.graceful_restart = graceful_restart
        self.reader = MessageReader()
        self.messages: list[tuple[int, bytes]] = []
        self.closed = False

    @classmethod
    def connect(
        cls, ns: Netns, local: str, remote: str, *, asn: int, port: int = 179, four_octet: bool = True,
        handshake: bool = True, timeout: float = 10.0, hold_time: int = 90, graceful_restart: bool = False,
        ttl: int | None = None, min_ttl: int | None = None, rcvbuf: int | None = None,
    ) -> RawBgpPeer:  # fmt: skip
        """``ttl``: IP_TTL of everything it sends; ``min_ttl``: IP_MINTTL, set before connecting
        (RFC 5082 GTSM as a strict peer does it: from the SYN-ACK on, nothing below it is taken);
        ``rcvbuf``: SO_RCVBUF before connecting (a peer with a small window from the start)."""
        with ns.entered():
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if ttl is not None:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, ttl)
        if min_ttl is not None:
            sock.setsockopt(socket.IPPROTO_IP, IP_MINTTL, min_ttl)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        try:
            sock.bind((local, 0))
            sock.settimeout(timeout)
            sock.connect((remote, port))
            peer = cls(sock, asn, four_octet, graceful_restart)
            if handshake:
                peer.handshake(local, hold_time, timeout)
        except BaseException:
            sock.close()
            raise
        return peer

    @classmethod
    def listen(cls, ns: Netns, local: str, *, port: int = 179, ttl: int | None = None,
               min_ttl: int | None = None) -> socket.socket:
        """A listening socket at ``local`` in ``ns`` for a speaker to connect to (accept it and
        wrap the connection: ``RawBgpPeer(conn, asn, True)``); ``ttl``/``min_ttl`` as in
        :meth:`connect`, set before listen() so the SYN-ACK and the accepted socket have them."""
        with ns.entered():
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if ttl is not None:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, ttl)
            if min_ttl is not None:
                sock.setsockopt(socket.IPPROTO_IP, IP_MINTTL, min_ttl)
            sock.bind((local, port))
            sock.listen(4)
        except BaseException:
            sock.close()
            raise
        return sock

    def open_message(self, router_id: str, hold_time: int = 90) -> bytes:
        """Our OPEN, encoded."""
        caps: list = [MultiProtocol(1, 1), RouteRefresh()]
        if self.graceful_restart:
            # RFC 4724: the speaker keeps our routes as stale for up to 4095 s if we vanish.
            caps.append(GracefulRestart(False, 4095, (GracefulRestartFamily(1, 1, True),)))
        if self.four_octet:
            return Open.build(self.asn, hold_time, router_id, caps).encode()
        return Open(self.asn, hold_time, IPv4Address(router_id), tuple(caps)).encode()

    def handshake(self, router_id: str, hold_time: int = 90, timeout: float = 10.0) -> None:
        self.send(self.open_message(router_id, hold_time) + Keepalive().encode())
        deadline = time.monotonic() + timeout
        while not any(t == MessageType.KEEPALIVE for t, _ in self.messages):
            if self.closed or time.monotonic() > deadline:
                raise ConnectionError(f"no session: {self.notifications() or 'closed' if self.closed else 'timeout'}")
            self.read(0.2)

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            self.closed = True

    def read(self, seconds: float) -> list[tuple[int, bytes]]:
        """What arrives within ``seconds`` (framed); sets ``closed`` at end of stream."""
        got: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + seconds
        while not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([self.sock], [], [], left)
            if not ready:
                break
            try:
                data = self.sock.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            self.reader.feed(data)
            got.extend(self.reader.messages())
        self.messages.extend(got)
        return got

    def wait_closed(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.closed and time.monotonic() < deadline:
            self.read(min(0.5, deadline - time.monotonic()))
        return self.closed

    def notifications(self) -> list[Notification]:
        return [Notification.decode(body) for t, body in self.messages if t == MessageType.NOTIFICATION]

    def close(self) -> None:
        self.closed = True
        self.sock.close()

    stop = close  # so test fixtures that stop processes can close these too

    def __enter__(self) -> RawBgpPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
