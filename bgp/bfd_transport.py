"""The asyncio adapter for BFD: sockets and timers for sans-IO :class:`~bgp.bfd.BfdSession` s.

Single-hop BFD over UDP, RFC 5881:

* Control packets arrive on UDP port 3784 (§4), IPv4 and IPv6, on the addresses the caller
  gives (:meth:`BfdService.open`, :meth:`BfdService.set_listen`; the BGP speaker uses the
  wildcard of each address family in use, see :func:`bgp.transport.bfd_listen_addresses`).
* Each session sends from its own socket, bound to the BGP session's local address (or to
  none, the kernel choosing, until that is known) and a source port in 49152-65535 that stays
  the same for the session's lifetime (§4), with a TTL / Hop Limit of 255 (§5).
* A received packet whose TTL / Hop Limit is not 255 is discarded (§5), read through
  IP_RECVTTL / IPV6_RECVHOPLIMIT ancillary data; so is every packet
  :meth:`proto.bfd.ControlPacket.decode` refuses.
* Packets are demultiplexed by Your Discriminator, or by source address when it is zero
  (RFC 5880 §6.3; RFC 5881 §3: one session per neighbour address).

Everything is non-blocking on the running loop (uvloop included): sockets are read with
``loop.add_reader`` and written with a non-blocking ``sendto``; each session has one
``call_later`` timer for :meth:`BfdSession.get_timer`.

Usage (what the BGP speaker does)::

    bfd = BfdService(listen="10.0.0.1", on_change=changed)
    await bfd.start()
    bfd.add("10.0.0.2", local_address="10.0.0.1", settings=BfdSettings(0.1, 0.1, 3))
    ...
    def changed(peer: str, change: BfdStateChanged) -> None:
        if change.failure:          # Up -> Down, neither side administratively down
            ...                     # close the BGP session: Cease, subcode 10 (RFC 9384)
    bfd.remove("10.0.0.2")          # AdminDown for a Detection Time, then closed
    await bfd.stop()                # AdminDown once to every neighbour, sockets closed
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import socket
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from ipaddress import IPv6Address, ip_address

from proto.bfd import BfdDecodeError, ControlPacket, State, diag_label

from .bfd import BfdSession, BfdSettings, BfdStateChanged

log = logging.getLogger("bgp.bfd")

CONTROL_PORT = 3784  # RFC 5881 §4
SOURCE_PORTS = (49152, 65535)  # RFC 5881 §4: "MUST be in the range 49152 through 65535"
TTL = 255  # RFC 5881 §5
TOS_INTERNETWORK_CONTROL = 0xC0  # IP precedence 6, as BIRD sends BFD
# Linux values; the socket module lacks IP_RECVTTL.
IP_RECVTTL = getattr(socket, "IP_RECVTTL", 12)
IP_TTL = socket.IP_TTL
IPV6_RECVHOPLIMIT = getattr(socket, "IPV6_RECVHOPLIMIT", 51)
IPV6_HOPLIMIT = getattr(socket, "IPV6_HOPLIMIT", 52)
_CMSG_SPACE = socket.CMSG_SPACE(4) * 4
_READ_BUDGET = 64  # datagrams per wake-up, so one busy socket cannot starve the loop
_BIND_ATTEMPTS = 64
_INT = struct.Struct("=i")

OnChange = Callable[[str, BfdStateChanged], None]


def peer_key(address: str) -> str:
    """The canonical text of a neighbour address (IPv4-mapped IPv6 unmapped, scope dropped)."""
    a = ip_address(address.split("%", 1)[0])
    if isinstance(a, IPv6Address) and a.ipv4_mapped is not None:
        return str(a.ipv4_mapped)
    return str(a)


@dataclass(eq=False)
class _Neighbour:
    address: str
    local_address: str | None
    session: BfdSession
    sock: socket.socket
    timer: asyncio.TimerHandle | None = None
    timer_at: float | None = None
    removing: bool = False
    bad_packets: int = 0  # from this neighbour's address: wrong TTL or refused by the codec
    send_errors: int = 0
    last_down_diag: int = 0

    @property
    def source_port(self) -> int:
        return self.sock.getsockname()[1]


class BfdService:
    """Runs one :class:`BfdSession` per neighbour on the asyncio loop (RFC 5881 single hop)."""

    def __init__(
        self,
        *,
        listen: str | None = None,
        on_change: OnChange | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        port: int = CONTROL_PORT,
    ) -> None:
        self.listen = listen
        self.on_change = on_change
        self.clock = clock
        self.rng = rng if rng is not None else random.Random()
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rx: dict[str, socket.socket] = {}  # receive sockets by the address they are bound to
        self._by_address: dict[str, _Neighbour] = {}
        self._by_discr: dict[int, _Neighbour] = {}
        self._draining: dict[str, _Neighbour] = {}  # removed, still sending AdminDown
        # Counters for packets no session could take.
        self.unknown_packets = 0  # no session for that discriminator / address
        self.bad_packets = 0  # wrong TTL or malformed, from an address without a session
        self.internal_errors = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the receive sockets (UDP 3784) and start serving."""
        self.open()

    @property
    def started(self) -> bool:
        return self._loop is not None

    def open(self, addresses: Iterable[str] | None = None) -> None:
        """:meth:`start` for callers already running on the loop: receive sockets on
        ``addresses`` (default: the listen address, or 0.0.0.0 and :: when that is unspecified).
        Raises OSError when one cannot be bound (port 3784 taken by another BFD daemon): then
        nothing stays open and :attr:`started` stays False, so a later call can try again."""
        loop = asyncio.get_running_loop()
        optional: set[str] = set()
        if addresses is None:
            if self.listen in (None, "", "0.0.0.0", "::"):
                addresses, optional = ["0.0.0.0", "::"], {"::"}  # a host without IPv6 still serves IPv4
            else:
                addresses = [self.listen]
        bound: dict[str, socket.socket] = {}
        try:
            for host in addresses:
                if host in bound:
                    continue
                try:
                    bound[host] = self._open_rx(host)
                except OSError as err:
                    if host not in optional:
                        raise
                    log.warning("BFD: no IPv6 listener on [::]:%d: %s", self.port, err)
        except OSError:
            for sock in bound.values():
                sock.close()
            raise
        self._loop = loop
        for host, sock in bound.items():
            self._watch_rx(host, sock)

    def set_listen(self, addresses: Iterable[str]) -> None:
        """Receive on exactly ``addresses`` from now on (after :meth:`open`): sockets no longer
        wanted are closed first (a wildcard cannot be bound beside a specific address of ours),
        then the new ones are opened.  Raises OSError for the first that cannot be bound, after
        trying the others; the caller may try again later."""
        wanted = list(dict.fromkeys(addresses))
        for host in [h for h in self._rx if h not in wanted]:
            sock = self._rx.pop(host)
            self._unwatch(sock)
            sock.close()
        error: OSError | None = None
        for host in wanted:
            if host in self._rx:
                continue
            try:
                self._watch_rx(host, self._open_rx(host))
            except OSError as err:
                error = error or err
        if error is not None:
            raise error

    async def stop(self) -> None:
        """Tell every neighbour AdminDown (once) and close all sockets."""
        for nb in list(self._by_discr.values()):
            if not nb.removing:
                nb.removing = True
                self._admin_down(nb)
            self._close(nb)
        for sock in self._rx.values():
            self._unwatch(sock)
            sock.close()
        self._rx.clear()

    @property
    def listen_addresses(self) -> list[tuple[str, int]]:
        return [s.getsockname()[:2] for s in self._rx.values()]

    # ------------------------------------------------------------ sessions

    def add(self, peer: str, local_address: str | None = None, settings: BfdSettings = BfdSettings()) -> None:
        """Watch ``peer`` (idempotent).  New settings for a watched peer go through a Poll
        Sequence; a new local address starts a new session (the old one sends AdminDown once and
        closes, with no drain beside the new one), except that a session without one (the kernel
        chose its source) keeps going from the new address.  Raises OSError when the
        session's socket cannot be bound (e.g. ``local_address`` is not on this host)."""
        if self._loop is None:
            raise RuntimeError("BfdService.add() before start()")
        key = peer_key(peer)
        local = peer_key(local_address) if local_address else None
        if (old := self._draining.get(key)) is not None:
            self._close(old)  # two sessions to one neighbour would make it flap between them
        nb = self._by_address.get(key)
        if nb is not None:
            if nb.local_address is None and local is not None:
                # The kernel was choosing the source; now it is known (the BGP connection's
                # local address): the same session moves to a socket bound to it, on the same
                # source port when free (RFC 5881 §4), without going down.
                self._move(nb, local)
            if nb.local_address == local:
                if nb.session.settings != settings:
                    nb.session.set_settings(settings, self.clock())
                    self._pump(nb)
                return
            self.remove(key, drain=False)  # (a drain would run beside the new session)
        sock = self._open_tx(key, local)
        session = BfdSession(settings, local_discriminator=self._new_discriminator(), now=self.clock(), rng=self.rng)
        nb = _Neighbour(key, local, session, sock)
        self._by_address[key] = nb
        self._by_discr[session.local_discr] = nb
        self._loop.add_reader(sock.fileno(), self._drain, sock)
        log.info("BFD session to %s (from %s, port %d): desired tx %.3f s, required rx %.3f s, multiplier %d",
                 key, local or "any", nb.source_port, settings.desired_min_tx, settings.required_min_rx,
                 settings.detect_mult)
        self._pump(nb)

    def remove(self, peer: str, *, drain: bool = True) -> None:
        """Stop watching ``peer``: the session goes AdminDown (RFC 5880 §6.8.16), which the
        neighbour does not treat as a failure (RFC 5882 §3.2).  With ``drain`` AdminDown goes
        on being sent for a Detection Time, then the socket closes; without, it is sent once.
        No ``on_change`` is called for a removed session."""
        nb = self._by_address.pop(peer_key(peer), None)
        if nb is None:
            return
        nb.removing = True
        self._draining[nb.address] = nb
        self._admin_down(nb)
        if not drain:
            self._close(nb)

    def state(self, peer: str) -> State | None:
        nb = self._by_address.get(peer_key(peer))
        return nb.session.state if nb is not None else None

    def session(self, peer: str) -> BfdSession | None:
        nb = self._by_address.get(peer_key(peer))
        return nb.session if nb is not None else None

    def peers(self) -> list[str]:
        return list(self._by_address)

    def status(self) -> list[dict]:
        """One dict per watched neighbour: the session's state, timers and counters
        (``packets_in``, ``packets_out``, ``bad_packets``, ``state_changes``,
        ``last_down_diag``, ...), JSON-ready, for /status and /metrics."""
        out = []
        for nb in self._by_address.values():
            out.append({
                "peer": nb.address,
                "local_address": nb.local_address,
                "source_port": nb.source_port,
                **nb.session.status(),
                "bad_packets": nb.bad_packets + nb.session.discarded,
                "send_errors": nb.send_errors,
                "last_down_diag": nb.last_down_diag,
                "last_down_reason": diag_label(nb.last_down_diag) if nb.last_down_diag else "",
            })
        return out

    # ------------------------------------------------------------ sockets

    def _open_rx(self, host: str) -> socket.socket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVHOPLIMIT, 1)
            else:
                sock.setsockopt(socket.IPPROTO_IP, IP_RECVTTL, 1)
            sock.bind((host, self.port))
        except OSError as err:
            sock.close()
            raise OSError(err.errno, f"BFD: cannot listen on {host} port {self.port}: {err.strerror}") from None
        return sock

    def _watch_rx(self, host: str, sock: socket.socket) -> None:
        assert self._loop is not None
        self._loop.add_reader(sock.fileno(), self._readable, sock)
        self._rx[host] = sock

    def _open_tx(self, peer: str, local: str | None, port: int | None = None) -> socket.socket:
        v6 = isinstance(ip_address(peer), IPv6Address)
        sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            if v6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, TTL)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, TOS_INTERNETWORK_CONTROL)
            else:
                sock.setsockopt(socket.IPPROTO_IP, IP_TTL, TTL)
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, TOS_INTERNETWORK_CONTROL)
            host = local or ("::" if v6 else "0.0.0.0")
            low, high = SOURCE_PORTS
            for attempt in range(_BIND_ATTEMPTS):
                try:
                    sock.bind((host, port if attempt == 0 and port else self.rng.randint(low, high)))
                    break
                except OSError as err:
                    if err.errno != errno.EADDRINUSE or attempt == _BIND_ATTEMPTS - 1:
                        raise
        except OSError as err:
            sock.close()
            raise OSError(err.errno, f"BFD: cannot open a socket to {peer} from {local or 'any'}: {err.strerror}") from None
        return sock

    def _move(self, nb: _Neighbour, local: str) -> None:
        # The old socket (bound to the wildcard) goes first: the new one wants its port.
        assert self._loop is not None
        port = nb.source_port
        self._unwatch(nb.sock)
        nb.sock.close()
        try:
            sock = self._open_tx(nb.address, local, port=port)
        except OSError:
            try:
                sock = self._open_tx(nb.address, nb.local_address, port=port)
            except OSError:
                self._close(nb)  # the caller's next add() starts a new session
                raise
            self._loop.add_reader(sock.fileno(), self._drain, sock)
            nb.sock = sock
            raise
        nb.sock = sock
        nb.local_address = local
        self._loop.add_reader(sock.fileno(), self._drain, sock)
        log.info("BFD session to %s: now from %s, port %d", nb.address, local, nb.source_port)

    def _unwatch(self, sock: socket.socket) -> None:
        if self._loop is not None and sock.fileno() >= 0:
            self._loop.remove_reader(sock.fileno())

    def _drain(self, sock: socket.socket) -> None:
        # Nothing is meant to arrive on a session's sending socket; throw it away.
        for _ in range(_READ_BUDGET):
            try:
                sock.recv(64)
            except OSError:
                return

    def _readable(self, sock: socket.socket) -> None:
        for _ in range(_READ_BUDGET):
            try:
                data, ancdata, _flags, addr = sock.recvmsg(512, _CMSG_SPACE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                log.debug("BFD: receive error: %s", err)
                return
            try:
                self._datagram(data, ancdata, addr[0])
            except Exception:
                # A bug must cost one packet, not the service.
                self.internal_errors += 1
                log.exception("BFD: internal error handling a packet from %s", addr[0])

    def _datagram(self, data: bytes, ancdata: list, source: str) -> None:
        source = peer_key(source)
        ttl = _received_ttl(ancdata)
        if ttl != TTL:
            # RFC 5881 §5: "MUST be discarded if the received TTL or Hop Limit is not equal to 255".
            self._bad(source, f"TTL/hop limit {ttl}, not 255")
            return
        try:
            packet = ControlPacket.decode(data)
        except BfdDecodeError as err:
            self._bad(source, str(err))
            return
        if packet.your_discriminator:
            nb = self._by_discr.get(packet.your_discriminator)
            if nb is None or nb.address != source:
                self.unknown_packets += 1
                return
        else:
            nb = self._by_address.get(source)
            if nb is None:
                self.unknown_packets += 1
                return
        nb.session.receive(packet, self.clock())
        self._pump(nb)

    def _bad(self, source: str, why: str) -> None:
        nb = self._by_address.get(source)
        if nb is not None:
            nb.bad_packets += 1
        else:
            self.bad_packets += 1
        log.debug("BFD: discarded a packet from %s: %s", source, why)

    # ------------------------------------------------------------ sessions <-> sockets

    def _admin_down(self, nb: _Neighbour) -> None:
        nb.session.admin_down(self.clock())
        self._pump(nb)

    def _pump(self, nb: _Neighbour) -> None:
        session = nb.session
        for packet in session.take_packets():
            try:
                nb.sock.sendto(packet.encode(), (nb.address, self.port))
            except OSError as err:  # full buffer, no route, neighbour unresolved: the next one may pass
                nb.send_errors += 1
                log.debug("BFD: send to %s failed: %s", nb.address, err)
        while (change := session.next_event()) is not None:
            self._changed(nb, change)
        if nb.removing:
            until = session.admin_down_until
            if until is None or self.clock() >= until:
                self._close(nb)
                return
        self._schedule(nb)

    def _changed(self, nb: _Neighbour, change: BfdStateChanged) -> None:
        if change.state in (State.DOWN, State.ADMIN_DOWN):
            nb.last_down_diag = int(change.diag)
        log.log(
            logging.WARNING if change.failure else logging.INFO,
            "BFD session to %s: %s -> %s (%s)%s", nb.address, change.old.label, change.state.label,
            diag_label(change.diag) if change.state is not State.UP else change.cause.value,
            ", neighbour lost" if change.failure else "",
        )
        if nb.removing or self.on_change is None:
            return
        try:
            self.on_change(nb.address, change)
        except Exception:
            self.internal_errors += 1
            log.exception("BFD: on_change callback failed for %s", nb.address)

    def _schedule(self, nb: _Neighbour) -> None:
        assert self._loop is not None
        at = nb.session.get_timer()
        if at == nb.timer_at and nb.timer is not None:
            return
        if nb.timer is not None:
            nb.timer.cancel()
            nb.timer = None
        nb.timer_at = at
        if at is not None:
            nb.timer = self._loop.call_later(max(0.0, at - self.clock()), self._on_timer, nb)

    def _on_timer(self, nb: _Neighbour) -> None:
        nb.timer = None
        nb.timer_at = None
        detect_at = nb.session.detect_at
        if detect_at is not None and self.clock() >= detect_at:
            # The Detection Time ran out -- or the loop was busy: uvloop runs due timers before
            # it reads sockets that became readable during a long callback, so the neighbour's
            # packets may be waiting unread.  Read them first; only silence is a failure.
            for sock in list(self._rx.values()):
                self._readable(sock)
            if nb.sock.fileno() < 0:
                return  # closed meanwhile (a removed session's AdminDown time ended)
        try:
            nb.session.handle_timer(self.clock())
        except Exception:
            self.internal_errors += 1
            log.exception("BFD: internal error in the timers of %s", nb.address)
        self._pump(nb)

    def _close(self, nb: _Neighbour) -> None:
        if nb.timer is not None:
            nb.timer.cancel()
            nb.timer = None
        if self._by_discr.get(nb.session.local_discr) is nb:
            del self._by_discr[nb.session.local_discr]
        if self._by_address.get(nb.address) is nb:
            del self._by_address[nb.address]
        if self._draining.get(nb.address) is nb:
            del self._draining[nb.address]
        if nb.sock.fileno() >= 0:
            self._unwatch(nb.sock)
            nb.sock.close()

    def _new_discriminator(self) -> int:
        # RFC 5880 §6.8.1: bfd.LocalDiscr "MUST be unique across all BFD sessions on this
        # system, and nonzero.  It SHOULD be set to a random (but still unique) value".
        while True:
            discr = self.rng.randint(1, 0xFFFFFFFF)
            if discr not in self._by_discr:
                return discr


def _received_ttl(ancdata: list) -> int | None:
    for level, kind, data in ancdata:
        if (level, kind) in ((socket.IPPROTO_IP, IP_TTL), (socket.IPPROTO_IPV6, IPV6_HOPLIMIT)) and len(data) >= 4:
            return _INT.unpack_from(data)[0]
    return None

