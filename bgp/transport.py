"""The one asyncio adapter: sockets and timers for a sans-IO :class:`~bgp.speaker.Speaker`.

Everything protocol-related happens in the speaker; this module only listens,
connects (with TCP MD5 signatures, RFC 2385, via Linux ``TCP_MD5SIG``; GTSM, RFC 5082,
via ``IP_TTL`` and ``IP_MINTTL``), moves bytes, and calls ``speaker.handle_timer`` when
``speaker.get_timer()`` says so.  After every input it carries out
``speaker.take_actions()``.

GTSM on accepted connections needs the listening socket's help.  RFC 5082 §3 wants every
packet of the session sent with TTL 255, and a peer that sets IP_MINTTL 255 before it
connects drops anything less, the SYN-ACK included.  Linux answers a SYN from the listening
socket's own settings (``tcp_v4_send_synack`` -> ``ip_build_and_send_pkt`` takes the
listener's IP_TTL) and makes the accepted socket a copy of the listener
(``inet_csk_clone_lock``); there is no per-peer TTL before accept().  So while any peer or
listen range has ``ttl_security``, the listener sends with TTL 255 (hop limit 255 for IPv6)
-- for every peer, since one listener serves them all -- and each accepted connection of a
peer without GTSM is set back to the system default at once: such a peer sees TTL 255 on
the SYN-ACK alone, which is harmless (a TTL only bounds how far a packet may travel; GoBGP
sends 255 on every accepted connection).  IP_MINTTL stays off the listener, where it would
drop the SYNs of the peers without GTSM; the TTL of a GTSM peer's SYN is read from
TCP_SAVED_SYN instead, and IP_MINTTL is set on its accepted socket.

It also keeps one peer from hogging the loop or the memory: a read is handed to the
speaker :data:`READ_SLICE` octets at a time with the loop's other work in between, the
speaker is told when a socket's send buffer is full or has room again (it then stops
or resumes producing UPDATEs for that peer), and output the speaker still owes is
produced in turns (:meth:`Speaker.work`) scheduled with ``call_soon``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import termios
import time
from collections.abc import Callable, Iterable
from ipaddress import IPv4Address, IPv6Address, ip_address

from proto.bfd import diag_label

from .bfd import BfdSettings, BfdStateChanged
from .bfd_transport import BfdService
from .session import Close, Connect, Send
from .settings import ListenRange, PeerSettings
from .speaker import Origination, Speaker

log = logging.getLogger("bgp.transport")

TCP_MD5SIG = 14
TCP_MD5SIG_MAXKEYLEN = 80
TCP_MD5SIG_EXT = 32  # linux/tcp.h: tcp_md5sig with flags (a key for a whole prefix)
TCP_MD5SIG_FLAG_PREFIX = 0x1
TCP_SAVE_SYN = 27  # linux/tcp.h: keep the SYN's headers of accepted connections
TCP_SAVED_SYN = 28
IP_MINTTL = 21  # linux/in.h
IPV6_MINHOPCOUNT = 73  # linux/in6.h
GTSM_TTL = 255  # RFC 5082 §3: send 255, accept 255 from a directly connected peer
READ_SLICE = 64 * 1024
WRITE_HIGH = 1024 * 1024  # a socket buffer above this pauses the peer's output ...
WRITE_LOW = 256 * 1024  # ... until it drains below this
CLOSE_LINGER = 5.0  # seconds a closing connection may spend flushing before it is aborted
STALL_CHECK = 1.0  # seconds between looks at connections whose peer has not taken all we sent
BFD_RETRY = 30.0  # seconds between tries to open BFD's sockets (or start a session) after one failed
TCP_INFO_BYTES_ACKED = 120  # linux/tcp.h struct tcp_info: __u64 tcpi_bytes_acked (Linux >= 4.1)
DEFAULT_BACKLOG = 4096


def md5sig_option(address: str, key: bytes | None, prefixlen: int | None = None) -> bytes:
    """``struct tcp_md5sig`` for setsockopt(IPPROTO_TCP, TCP_MD5SIG): ``key`` None removes it.
    With ``prefixlen`` the key covers a whole prefix (TCP_MD5SIG_EXT, TCP_MD5SIG_FLAG_PREFIX)."""
    addr = ip_address(address)
    if isinstance(addr, IPv4Address):
        sockaddr = struct.pack("=H", socket.AF_INET) + struct.pack("!H4s", 0, addr.packed)
    else:
        sockaddr = struct.pack("=H", socket.AF_INET6) + struct.pack("!HI16sI", 0, 0, addr.packed, 0)
    sockaddr = sockaddr.ljust(128, b"\0")
    key = key or b""
    if len(key) > TCP_MD5SIG_MAXKEYLEN:
        raise ValueError(f"TCP MD5 key longer than {TCP_MD5SIG_MAXKEYLEN} bytes")
    flags, plen = (0, 0) if prefixlen is None else (TCP_MD5SIG_FLAG_PREFIX, prefixlen)
    return sockaddr + struct.pack("=BBHi", flags, plen, len(key), 0) + key.ljust(TCP_MD5SIG_MAXKEYLEN, b"\0")


def _md5_peer_address(sock: socket.socket, peer: str) -> str:
    # On an AF_INET6 socket, IPv4 peers appear as IPv4-mapped addresses.
    a = ip_address(peer)
    if sock.family == socket.AF_INET6 and isinstance(a, IPv4Address):
        return f"::ffff:{a}"
    return str(a)


def set_md5(sock: socket.socket, peer: str, password: str | None) -> None:
    sock.setsockopt(
        socket.IPPROTO_TCP,
        TCP_MD5SIG,
        md5sig_option(_md5_peer_address(sock, peer), password.encode() if password else None),
    )


def set_md5_prefix(sock: socket.socket, network: str, prefixlen: int, password: str | None) -> None:
    """A TCP MD5 key for every peer in ``network/prefixlen`` (dynamic neighbours).

    An IPv4 network on an IPv6 (dual-stack) socket is given IPv4-mapped with its IPv4 prefix
    length: Linux keeps the key as an IPv4 one (tcp_v6_parse_md5_keys) and refuses a length
    over 32 for a mapped address (EINVAL)."""
    addr = _md5_peer_address(sock, network)
    sock.setsockopt(
        socket.IPPROTO_TCP, TCP_MD5SIG_EXT, md5sig_option(addr, password.encode() if password else None, prefixlen)
    )


def set_ttl(sock: socket.socket, ttl: int | None) -> None:
    """The TTL (IPv6: hop limit) ``sock`` sends with; None: the system default again."""
    value = -1 if ttl is None else ttl  # ip(7), ipv6(7): -1 means "use the route's default"
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, value)
        with contextlib.suppress(OSError):  # IPv4-mapped peers on an AF_INET6 socket
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, value)
    else:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, value)


def set_gtsm(sock: socket.socket) -> None:
    """RFC 5082 for a directly connected peer: send with TTL 255, take nothing below 255."""
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, GTSM_TTL)
        sock.setsockopt(socket.IPPROTO_IPV6, IPV6_MINHOPCOUNT, GTSM_TTL)
        # IPv4 peers on an AF_INET6 socket arrive as IPv4-mapped: the IPv4 options apply too.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, GTSM_TTL)
            sock.setsockopt(socket.IPPROTO_IP, IP_MINTTL, GTSM_TTL)
    else:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, GTSM_TTL)
        sock.setsockopt(socket.IPPROTO_IP, IP_MINTTL, GTSM_TTL)


def syn_ttl(sock: socket.socket) -> int | None:
    """The TTL (hop limit) the peer's SYN arrived with, from TCP_SAVED_SYN; None if unknown."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, TCP_SAVED_SYN, 512)
    except OSError:
        return None
    if len(raw) >= 20 and raw[0] >> 4 == 4:
        return raw[8]
    if len(raw) >= 40 and raw[0] >> 4 == 6:
        return raw[7]
    return None


class _Protocol(asyncio.Protocol):
    def __init__(self, service: SpeakerService, conn: int | None) -> None:
        self.service = service
        self.conn = conn
        self.transport: asyncio.Transport | None = None
        # Bytes can arrive before the speaker has been told about an outbound connection
        # (BIRD sends its OPEN the moment it accepts): hold them until activate().
        self.active = conn is None
        self._early: list[bytes] = []
        self._backlog = bytearray()  # received, not yet handed to the speaker (READ_SLICE at a time)
        self._paused = False  # our buffer went over WRITE_HIGH (uvloop's pause_writing)
        self._stalled = False  # the peer acknowledged nothing for a whole STALL_CHECK (_StallWatch)
        self._writable = True  # what the speaker was last told: neither of the two

    def activate(self) -> None:
        self.active = True
        early, self._early = self._early, []
        for data in early:
            self.data_received(data)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  (uvloop's transports are duck-typed)
        transport.set_write_buffer_limits(high=WRITE_HIGH, low=WRITE_LOW)  # type: ignore[attr-defined]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.conn is None:  # inbound
            self.service._inbound(self)

    def data_received(self, data: bytes) -> None:
        if not self.active:
            self._early.append(data)
            return
        if self._backlog or len(data) > READ_SLICE:
            # A big read is handed over a slice at a time, other peers' work in between.
            if not self._backlog and self.transport is not None:
                self.transport.pause_reading()
                assert self.service._loop is not None
                self.service._loop.call_soon(self._next_slice)
            self._backlog += data
            return
        if self.conn is not None:
            self.service._data(self.conn, data)

    def _next_slice(self) -> None:
        if self.conn is None or self.transport is None or self.transport.is_closing():
            self._backlog.clear()
            return
        chunk = bytes(self._backlog[:READ_SLICE])
        del self._backlog[:READ_SLICE]
        self.service._data(self.conn, chunk)
        if self._backlog:
            assert self.service._loop is not None
            self.service._loop.call_soon(self._next_slice)
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def pause_writing(self) -> None:
        self._paused = True
        self._tell()

    def resume_writing(self) -> None:
        self._paused = False
        self._tell()

    def set_stalled(self, stalled: bool) -> None:
        self._stalled = stalled
        self._tell()

    def _tell(self) -> None:
        writable = not (self._paused or self._stalled)
        if writable != self._writable:
            self._writable = writable
            if self.conn is not None:
                self.service._writable(self.conn, writable)

    def unacknowledged(self) -> tuple[int, int]:
        """(octets the peer has not acknowledged yet: our buffer and the kernel's send queue,
        octets it has acknowledged so far); (0, 0) once the connection is going."""
        t = self.transport
        sock = t.get_extra_info("socket") if t is not None and not t.is_closing() else None
        if sock is None:
            return 0, 0
        try:
            queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES_ACKED + 8)
        except OSError:
            return 0, 0
        acked = struct.unpack_from("=Q", info, TCP_INFO_BYTES_ACKED)[0] if len(info) >= TCP_INFO_BYTES_ACKED + 8 else 0
        return t.get_write_buffer_size() + queued, acked  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self.service._lost(self.conn)


class _StallWatch:
    """Is a peer taking what we send?  uvloop's pause_writing answers only once our buffer is
    over WRITE_HIGH; a peer that stops reading with less than that owed (its initial table, a
    route refresh or two) would keep its session for ever with hold time 0, or while it keeps
    sending KEEPALIVEs.  So every connection we sent on is looked at every STALL_CHECK seconds
    until the peer has acknowledged all of it (TIOCOUTQ, TCP_INFO's bytes_acked): a look that
    finds octets owed and none acknowledged since the last look marks it stalled, which the
    speaker treats like a full buffer (no more UPDATEs; Cease/Out of Resources once that lasts
    ``send_timeout``); any acknowledgement ends it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._watched: dict[_Protocol, int] = {}  # connection -> bytes acknowledged at the last look
        self._handle: asyncio.TimerHandle | None = None

    def sent(self, proto: _Protocol) -> None:
        if proto not in self._watched:
            self._watched[proto] = -1  # the first look only records
            if self._handle is None:
                self._handle = self._loop.call_later(STALL_CHECK, self._look)

    def _look(self) -> None:
        self._handle = None
        for proto, before in list(self._watched.items()):
            owed, acked = proto.unacknowledged()
            if owed == 0:
                del self._watched[proto]
                proto.set_stalled(False)
                continue
            self._watched[proto] = acked
            proto.set_stalled(before >= 0 and acked == before)
        if self._watched:
            self._handle = self._loop.call_later(STALL_CHECK, self._look)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._watched.clear()


class SpeakerService:
    """Runs a :class:`Speaker` on the asyncio loop."""

    def __init__(
        self,
        speaker: Speaker,
        *,
        listen: tuple[str, int] | None = ("0.0.0.0", 179),
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] | None = None,
        backlog: int = DEFAULT_BACKLOG,
        bfd: BfdService | None = None,
    ) -> None:
        self.speaker = speaker
        self.listen = listen
        self.backlog = backlog
        # BFD sessions for the peers that ask for one (PeerSettings.bfd); made on first need.
        self.bfd = bfd
        self._bfd_peers: dict[str, tuple[str | None, BfdSettings]] = {}
        self._bfd_version = -1  # the speaker's peers_version the BFD sessions were last synced with
        self._stopping = False
        self._bfd_error: str | None = None  # the last failure to open BFD's sockets, logged once
        self._bfd_retry: asyncio.TimerHandle | None = None  # the next try after a failure
        # peer -> the local address of its last BGP connection; kept while the peer wants BFD,
        # also when Speaker.set_peers replaces its Peer object (any change of its settings)
        self._bfd_learned: dict[str, str] = {}
        # Link-local peers (listen-range clients: configured peers cannot be link-local) wanting
        # BFD, refused and logged once; forgotten when they stop wanting it (or go).
        self._bfd_refused: set[str] = set()
        self.clock = clock
        self._wall: WallClock | None = None
        self.on_change = on_change
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._listen_sock: socket.socket | None = None
        self._protocols: dict[int, _Protocol] = {}
        self._connecting: dict[int, asyncio.Task] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._inbound_ids = _NegativeIds()
        self._md5_keys: dict[str, str] = {}  # the keys the listener has (peer or prefix -> password)
        self._md5_unfit: set[str] = set()  # wanted keys the listener's family cannot carry (logged)
        self._listener_gtsm = False  # the listener sends with TTL 255 (some peer has GTSM)
        self._work_handle: asyncio.Handle | None = None
        self._stalls: _StallWatch | None = None
        self._pumping = False
        self.internal_errors = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stalls = _StallWatch(self._loop)
        if self.listen is not None:
            host, port = self.listen
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind((host, port))
                # For GTSM: the TTL of each accepted connection's SYN (TCP_SAVED_SYN).
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, TCP_SAVE_SYN, 1)
                sock.listen(self.backlog)
                sock.setblocking(False)
                self._listen_sock = sock
                self._sync_listener()
                # create_server listens again on the socket: give it the same backlog (its default is 100).
                self._server = await self._loop.create_server(
                    lambda: _Protocol(self, None), sock=sock, backlog=self.backlog
                )
            except BaseException:
                # Nothing listens: the socket goes (it held the port, or a half-set-up listener
                # with its MD5 keys, until the process ended).
                self._listen_sock = None
                sock.close()
                raise
        self.speaker.start(self.clock())
        self._sync_bfd()
        self._pump()

    async def stop(self, *, graceful: bool) -> None:
        self._stopping = True
        self.speaker.stop(self.clock(), graceful=graceful)
        self._pump()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._work_handle is not None:
            self._work_handle.cancel()
            self._work_handle = None
        if self._bfd_retry is not None:
            self._bfd_retry.cancel()
            self._bfd_retry = None
        if self._stalls is not None:
            self._stalls.close()
        for task in list(self._connecting.values()):
            task.cancel()
        if self.bfd is not None and self.bfd.started:
            await self.bfd.stop()
        for proto in list(self._protocols.values()):
            if proto.transport is not None:
                if graceful:
                    # RFC 4724: leave without NOTIFICATION; an abort (RST) tells the peer at once.
                    proto.transport.abort()
                else:
                    proto.transport.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await asyncio.sleep(0)

    # ------------------------------------------------------------ configuration

    def set_peers(self, peers: Iterable[PeerSettings]) -> None:
        self.speaker.set_peers(list(peers), self.clock())
        self._sync_listener()
        self._pump()
        if self._loop is not None:
            self._sync_bfd()

    def _sync_bfd(self) -> None:
        """One BFD session per peer with ``bfd`` set, from our session's local address.
        Called at start, on new peers or listen ranges, and from :meth:`_pump` whenever the
        speaker added or removed a peer (a client accepted from a listen range, or forgotten)."""
        if self._stopping:
            return
        self._bfd_version = self.speaker.peers_version
        wanted: dict[str, tuple[str | None, BfdSettings]] = {}
        configured: list[tuple[str, str | None]] = []
        refused: set[str] = set()
        for key, peer in self.speaker.peers.items():
            s = peer.settings
            if s.bfd is None:
                continue
            if _link_local(key):
                self._refuse_bfd(key)
                refused.add(key)
                continue
            interval, mult = s.bfd
            explicit = str(s.local_address) if s.local_address else None
            learned = peer.local_address()
            if learned:
                self._bfd_learned[key] = learned
            else:
                # The connection went (or the Peer was replaced with new settings): its address
                # stays the session's source, so the session is not replaced (RFC 5881 §3).
                learned = self._bfd_learned.get(key)
            configured.append((key, explicit))
            wanted[key] = (
                bfd_source(explicit, learned),
                BfdSettings(desired_min_tx=interval, required_min_rx=interval, detect_mult=mult),
            )
        for key in [k for k in self._bfd_learned if k not in wanted]:
            del self._bfd_learned[key]
        self._bfd_refused &= refused
        if not wanted and (self.bfd is None or not self.bfd.started):
            return
        if self.bfd is None:
            self.bfd = BfdService(on_change=self._bfd_changed, clock=self.clock)
        addresses = bfd_listen_addresses(configured)
        try:
            if not self.bfd.started:
                self.bfd.open(addresses)
            else:
                self.bfd.set_listen(addresses)
        except OSError as err:
            # Port 3784 taken (BIRD, another agent): BGP goes on without BFD (or without
            # that receive address); tried again in BFD_RETRY s and at the next change of peers.
            self._bfd_failed(err)
            if not self.bfd.started:
                return
        else:
            self._bfd_error = None
        for key in [k for k in self._bfd_peers if k not in wanted]:
            self.bfd.remove(key)
            del self._bfd_peers[key]
        for key, (local, settings) in wanted.items():
            if self._bfd_peers.get(key) != (local, settings):
                try:
                    self.bfd.add(key, local_address=local, settings=settings)
                except OSError as err:
                    log.error("peer %s: cannot start BFD: %s", key, err.strerror or err)
                    self._retry_bfd_later()
                    continue
                self._bfd_peers[key] = (local, settings)

    def _refuse_bfd(self, key: str) -> None:
        """No BFD session for a link-local neighbour: its key (the speaker's, an address
        without its scope) names no interface to bind the session to or send it on (RFC 5881
        §3), as BIRD refuses a link-local neighbour without one.  Said once per peer."""
        if key not in self._bfd_refused:
            self._bfd_refused.add(key)
            log.warning("peer %s: no BFD for a link-local neighbour (no interface to bind it to); "
                        "its BGP session runs without BFD", key)

    def _bfd_local_known(self, remote: str, local: str | None) -> None:
        """A connection to ``remote`` has a local address now: a BFD session that was sending
        from whatever address the kernel chose moves to it; one that was sending from another
        address learned earlier (not a configured ``local_address``) is replaced by one from it."""
        cur = self._bfd_peers.get(remote)
        if cur is not None and local and cur[0] != local:
            self._sync_bfd()

    def _bfd_failed(self, err: OSError) -> None:
        why = str(err.strerror or err)
        if why != self._bfd_error:  # one line per distinct failure, not one per sync
            log.error("%s; BGP runs without BFD until it can be opened (tried again every %g s "
                      "and at each change of peers)", why, BFD_RETRY)
            self._bfd_error = why
        self._retry_bfd_later()

    def _retry_bfd_later(self) -> None:
        if self._loop is not None and self._bfd_retry is None and not self._stopping:
            self._bfd_retry = self._loop.call_later(BFD_RETRY, self._retry_bfd)

    def _retry_bfd(self) -> None:
        self._bfd_retry = None
        if not self._stopping:
            self._sync_bfd()

    def _bfd_changed(self, peer: str, change: BfdStateChanged) -> None:
        if change.failure:
            self.speaker.bfd_down(peer, diag_label(change.diag), self.clock())
            self._pump()

    def peers_configured(self) -> None:
        """Every configured peer has been added (see :meth:`Speaker.peers_configured`)."""
        self.speaker.peers_configured(self.clock())
        self._pump()

    def set_originated(self, origins: Iterable[Origination]) -> None:
        self.speaker.set_originated(origins, self.clock())
        self._pump()

    def call(self, fn: Callable[[Speaker, float], object]) -> object:
        """Run ``fn(speaker, now)`` and carry out whatever it caused."""
        result = fn(self.speaker, self.clock())
        self._sync_listener()
        self._pump()
        return result

    def _sync_listener(self) -> None:
        """The listening socket's per-peer options, after the peers or listen ranges changed."""
        if self._listen_sock is None:
            return
        self._sync_listener_ttl()
        self._sync_md5()

    def _sync_md5(self) -> None:
        wanted = {
            k: p.settings.password
            for k, p in self.speaker.peers.items()
            if p.settings.password and k not in self.speaker.dynamic  # (those have their range's key)
        }
        for r in self.speaker.listen_ranges:
            if r.template.password:
                wanted[str(r.prefix)] = r.template.password
        if self._listen_sock is not None and self._listen_sock.family == socket.AF_INET:
            # An IPv4 listener cannot carry a key for an IPv6 address (EINVAL), and no IPv6
            # peer can reach it anyway: skip those keys, said once per key.
            unfit = {k for k in wanted if ip_address(k.partition("/")[0]).version == 6}
            host, port = self.listen or ("0.0.0.0", 179)
            for key in sorted(unfit - self._md5_unfit):
                log.warning(
                    "no TCP MD5 key for %s: the BGP listener %s:%s is IPv4, no IPv6 peer can connect to it",
                    key, host, port,
                )  # fmt: skip
            self._md5_unfit = unfit
            for key in unfit:
                del wanted[key]
        applied: dict[str, str] = {}
        for key in set(self._md5_keys) - set(wanted):
            try:
                self._set_md5(key, None)
            except OSError as err:
                log.warning("could not remove the TCP MD5 key for %s from the BGP listener: %s", key, err.strerror or err)
        for key, pw in wanted.items():
            if self._md5_keys.get(key) == pw:
                applied[key] = pw
                continue
            try:
                self._set_md5(key, pw)
            except (OSError, ValueError) as err:
                log.warning("could not set the TCP MD5 key for %s on the BGP listener: %s", key, getattr(err, "strerror", None) or err)
                if key in self._md5_keys:
                    applied[key] = self._md5_keys[key]  # the kernel still has the old one
            else:
                applied[key] = pw
        self._md5_keys = applied  # only what the listener has: the rest is tried again at the next sync

    def _sync_listener_ttl(self) -> None:
        """TTL 255 on the listener while a peer or listen range has GTSM (see the module's
        docstring: the SYN-ACK leaves with the listener's TTL)."""
        assert self._listen_sock is not None
        wanted = any(p.settings.ttl_security for p in self.speaker.peers.values()) or any(
            r.template.ttl_security for r in self.speaker.listen_ranges
        )
        if wanted != self._listener_gtsm:
            set_ttl(self._listen_sock, GTSM_TTL if wanted else None)
            self._listener_gtsm = wanted

    def _set_md5(self, key: str, password: str | None) -> None:
        assert self._listen_sock is not None
        if "/" in key:
            net, _, plen = key.partition("/")
            set_md5_prefix(self._listen_sock, net, int(plen), password)
        else:
            set_md5(self._listen_sock, key, password)

    def set_listen_ranges(self, ranges: Iterable[ListenRange]) -> None:
        self.speaker.set_listen_ranges(list(ranges), self.clock())
        self._sync_listener()
        self._pump()
        if self._loop is not None:
            self._sync_bfd()

    # ------------------------------------------------------------ events from sockets

    def _inbound(self, proto: _Protocol) -> None:
        assert proto.transport is not None
        peername = proto.transport.get_extra_info("peername")
        sockname = proto.transport.get_extra_info("sockname")
        if not peername:
            # Reset before the loop set it up (a connect scan, a health check, a peer that gave
            # up): uvloop then has no peer address (getpeername: ENOTCONN).  Nobody to accept:
            # refused, not a traceback in the loop's handler for each such connection.
            self.speaker.counters["connections refused"] += 1
            log.debug("refused an inbound BGP connection that was gone before it was set up")
            proto.transport.abort()
            return
        remote = _unmap(peername[0])
        now = self.clock()
        settings = self.speaker.peer_settings(remote)
        why = None
        sock = proto.transport.get_extra_info("socket")
        if settings is not None and settings.ttl_security:
            ttl = syn_ttl(sock) if sock is not None else None
            if ttl is None or ttl < GTSM_TTL:
                why = f"GTSM: its SYN arrived with TTL {ttl}, not {GTSM_TTL} (RFC 5082)"
            else:
                try:
                    set_gtsm(sock)
                except OSError as err:
                    why = f"GTSM: {err.strerror or err}"
        elif self._listener_gtsm and sock is not None:
            with contextlib.suppress(OSError):
                set_ttl(sock, None)  # inherited from the listener: back to the default
        if why is None and _link_local(remote):
            why = self._other_link(remote, peername)
        conn = next(self._inbound_ids)
        proto.conn = conn
        self._protocols[conn] = proto
        local = _unmap(sockname[0]) if sockname else None
        if why is None:
            admission = self.speaker.accept(conn, remote, now, local)
            if not admission:
                why = admission.reason
            elif self._loop is not None:
                self._bfd_local_known(remote, local)
        if why is not None:
            self.speaker.counters["connections refused"] += 1
            self.speaker.limiter.log(
                logging.INFO, "refused", remote, now, "refused BGP connection from %s (%s)", remote, why
            )
            del self._protocols[conn]
            proto.conn = None
            proto.transport.abort()
        self._pump()

    def _other_link(self, remote: str, peername: tuple) -> str | None:
        """Why a connection from the link-local ``remote`` is refused: a connection from the
        same address on another interface is open.  A peer is keyed by its address alone (the
        %zone dropped), so two routers on two links that both use fe80::1 would be taken for
        one peer, the second connection for a collision with the first; the first one keeps it."""
        zone = _zone(peername)
        for proto in self._protocols.values():
            other = proto.transport.get_extra_info("peername") if proto.transport is not None else None
            if other and _unmap(other[0]) == remote and _zone(other) != zone:
                return (f"a connection from {remote} on {_zone_name(_zone(other))} is open, and this one is on "
                        f"{_zone_name(zone)}: peers are told apart by address, not by interface")
        return None

    def _data(self, conn: int, data: bytes) -> None:
        try:
            self.speaker.data_received(conn, data, self.clock())
        except Exception:
            # A bug must cost one session, not the agent: drop this connection (the peer
            # reconnects and the session starts clean) and keep serving everything else.
            self.internal_errors += 1
            log.exception("internal error handling BGP data on connection %s; resetting it", conn)
            proto = self._protocols.get(conn)
            if proto is not None and proto.transport is not None:
                proto.transport.abort()
        self._pump()

    def _lost(self, conn: int) -> None:
        if self._protocols.pop(conn, None) is not None:
            self.speaker.connection_lost(conn, self.clock())
            self._pump()

    def _writable(self, conn: int, writable: bool) -> None:
        if conn in self._protocols:
            self.speaker.set_writable(conn, writable, self.clock())
            if not self._pumping:  # (pause_writing is called from inside transport.write)
                self._pump()

    # ------------------------------------------------------------ actions

    def _pump(self) -> None:
        self._pumping = True
        try:
            self._carry_out(self.speaker.take_actions())
        finally:
            self._pumping = False
        if self._bfd_version != self.speaker.peers_version and self._loop is not None and not self._stopping:
            self._sync_bfd()  # peers came or went (listen ranges): their BFD sessions too
        self._schedule()
        if self._work_handle is None and self.speaker.has_work():
            assert self._loop is not None
            self._work_handle = self._loop.call_soon(self._work)
        if self.on_change is not None:
            self.on_change()

    def _carry_out(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, Send):
                proto = self._protocols.get(action.conn)
                if proto is not None and proto.transport is not None and not proto.transport.is_closing():
                    # The pieces as they are (uvloop keeps references, no copy): an update
                    # group's shared stream stays one object however many sockets wait on it.
                    proto.transport.writelines(action.chunks)
                    if self._stalls is not None:
                        self._stalls.sent(proto)
            elif isinstance(action, Close):
                task = self._connecting.pop(action.conn, None)
                if task is not None:
                    task.cancel()
                proto = self._protocols.pop(action.conn, None)
                if proto is not None and proto.transport is not None:
                    proto.conn = None  # no connection_lost back into the speaker: it asked for this
                    transport = proto.transport
                    transport.close()
                    if transport.get_write_buffer_size():
                        # A peer that does not read would keep the socket open for ever.
                        assert self._loop is not None
                        self._loop.call_later(CLOSE_LINGER, _abort, transport)
            elif isinstance(action, Connect):
                assert self._loop is not None
                self._connecting[action.conn] = self._loop.create_task(self._connect(action))

    def _work(self) -> None:
        """One turn of owed output (a large export, a route refresh, a new group's table)."""
        self._work_handle = None
        try:
            self.speaker.work(self.clock())
        except Exception:
            self.internal_errors += 1
            log.exception("internal error producing BGP output")
        self._pump()

    async def _connect(self, action: Connect) -> None:
        assert self._loop is not None
        addr = ip_address(action.address)
        family = socket.AF_INET6 if isinstance(addr, IPv6Address) else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            if action.password:
                set_md5(sock, action.address, action.password)
            if action.ttl_security:
                set_gtsm(sock)
            if action.local_address:
                sock.bind((action.local_address, 0))
            await self._loop.sock_connect(sock, (action.address, action.port))
            proto = _Protocol(self, action.conn)
            transport, _ = await self._loop.create_connection(lambda: proto, sock=sock)
        except asyncio.CancelledError:
            sock.close()
            raise
        except OSError as err:
            sock.close()
            self._connecting.pop(action.conn, None)
            log.debug("connect to %s:%s failed: %s", action.address, action.port, err)
            self.speaker.connect_failed(action.conn, self.clock())
            self._pump()
            return
        self._connecting.pop(action.conn, None)
        sockname = transport.get_extra_info("sockname")
        if not sockname:
            # Reset between the connect and the transport's setup (uvloop then has no address
            # for it): a connection that failed.
            transport.abort()
            log.debug("connect to %s:%s failed: the connection was reset at once", action.address, action.port)
            self.speaker.connect_failed(action.conn, self.clock())
            self._pump()
            return
        self._protocols[action.conn] = proto
        local = _unmap(sockname[0])
        self.speaker.connection_made(action.conn, self.clock(), local)
        self._bfd_local_known(_unmap(action.address), local)
        self._pump()
        proto.activate()

    def _schedule(self) -> None:
        assert self._loop is not None
        at = self.speaker.get_timer()
        if at == self._timer_at and self._timer is not None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is None:
            return
        delay = max(0.0, at - self.clock())
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        try:
            self.speaker.handle_timer(self.clock())
        except Exception:
            self.internal_errors += 1
            log.exception("internal error in BGP timers")
        self._pump()

    # ------------------------------------------------------------ helpers

    def wall_time(self, monotonic: float) -> float:
        """Convert one of the speaker's clock readings to a UNIX timestamp."""
        if self._wall is None:
            self._wall = WallClock(self.clock)
        return self._wall(monotonic)


def bfd_source(configured: str | None, learned: str | None) -> str | None:
    """The address a BFD session sends from: the peer's ``local_address`` when set (outbound
    BGP binds to it too), else the local address of its BGP connection once there is one, else
    None (the kernel chooses, as for an outbound connection without ``local_address``)."""
    for address in (configured, learned):
        if address and address not in ("0.0.0.0", "::"):
            return address
    return None


def bfd_listen_addresses(peers: Iterable[tuple[str, str | None]]) -> list[str]:
    """The addresses BFD receives on (UDP 3784), for ``(peer address, its local_address or
    None)`` pairs: per address family in use, the wildcard (0.0.0.0, ::) as soon as one peer of
    that family has no explicit local address -- its packets may come to any of ours; RFC 5881
    single hop checks TTL 255, so a wildcard takes nothing from afar -- else exactly the
    local addresses those peers name."""
    specific: dict[int, set[str]] = {}
    wildcard: set[int] = set()
    for peer, local in peers:
        family = ip_address(peer).version
        if local and local not in ("0.0.0.0", "::"):
            specific.setdefault(family, set()).add(str(ip_address(local)))
        else:
            wildcard.add(family)
    out: list[str] = []
    for family, any_address in ((4, "0.0.0.0"), (6, "::")):
        if family in wildcard:
            out.append(any_address)
        else:
            out.extend(sorted(specific.get(family, ())))
    return out


class WallClock:
    """Monotonic readings as UNIX times through one offset, kept while the wall clock runs steady:
    the same reading always gives the same time, so a session's ``since`` reads the same twice
    (recomputing ``time() - (clock() - reading)`` on each read made it jitter by a millisecond).
    A wall-clock step larger than ``STEP`` seconds (NTP, an operator) moves the offset."""

    STEP = 1.0

    def __init__(self, clock: Callable[[], float], wall: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.wall = wall
        self.offset: float | None = None

    def __call__(self, monotonic: float) -> float:
        offset = self.wall() - self.clock()
        if self.offset is None or abs(offset - self.offset) > self.STEP:
            self.offset = offset
        return monotonic + self.offset


class _NegativeIds:
    """Inbound connections get negative ids so they never clash with the speaker's outbound ones."""

    def __init__(self) -> None:
        self._n = 0

    def __iter__(self):
        return self

    def __next__(self) -> int:
        self._n -= 1
        return self._n


def _abort(transport: asyncio.BaseTransport) -> None:
    with contextlib.suppress(Exception):
        transport.abort()  # type: ignore[attr-defined]


def _link_local(address: str) -> bool:
    a = ip_address(address.split("%", 1)[0])
    return isinstance(a, IPv6Address) and a.is_link_local


def _zone(sockaddr: tuple) -> int | str:
    """The interface of an IPv6 socket address (its scope id; the %zone where the address text
    carries one and the scope id is not given)."""
    if len(sockaddr) > 3 and sockaddr[3]:
        return int(sockaddr[3])
    host = str(sockaddr[0])
    if "%" not in host:
        return 0
    name = host.split("%", 1)[1]
    if name.isdigit():
        return int(name)
    try:
        return socket.if_nametoindex(name)
    except OSError:
        return name


def _zone_name(zone: int | str) -> str:
    if isinstance(zone, str):
        return zone
    try:
        return socket.if_indextoname(zone)
    except OSError:
        return f"interface {zone}"


def _unmap(address: str) -> str:
    a = ip_address(address.split("%", 1)[0])
    if isinstance(a, IPv6Address) and a.ipv4_mapped is not None:
        return str(a.ipv4_mapped)
    return str(a)
