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
  (RFC 5880 §6.3; RFC 5881 §3: one session per neighbour address), and the source address
  must be the session's neighbour either way.
* A session is bound to an interface (RFC 5881 §3: "the session MUST be bound to the
  interface"; BIRD looks sessions up by address and interface): the one the kernel's route
  to the neighbour leaves by (RTM_GETROUTE, :func:`route_interface`), looked up when the
  session starts and again, at most once a second, when its packets come in on another
  one.  A packet for it that arrived on another interface (IP_PKTINFO / IPV6_RECVPKTINFO),
  or, once the session's local address is known, was sent to another of our addresses, is
  discarded and counted in the session's ``bad_packets``: a host on another link (a pod on
  the node's bridge) that forges the neighbour's address, with TTL 255, cannot take the
  session down.  Where the kernel cannot be asked (no netlink), sessions are not bound,
  with one warning in the log.

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
    await bfd.stop()                # AdminDown to every neighbour (3 times in <= 0.2 s), closed
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from ipaddress import IPv6Address, ip_address

from proto.bfd import BfdDecodeError, ControlPacket, State, diag_label

from .bfd import SLOW_TX_US, BfdSession, BfdSettings, BfdStateChanged

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
IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)
IPV6_RECVPKTINFO = getattr(socket, "IPV6_RECVPKTINFO", 49)
IPV6_PKTINFO = getattr(socket, "IPV6_PKTINFO", 50)
# A TTL / hop limit and a pktinfo (struct in6_pktinfo is the larger: 20 bytes), with room to spare.
_CMSG_SPACE = socket.CMSG_SPACE(4) + socket.CMSG_SPACE(20) + 64
_IN_PKTINFO = struct.Struct("=i4s4s")  # ipi_ifindex, ipi_spec_dst, ipi_addr (the header's destination)
_IN6_PKTINFO = struct.Struct("=16si")  # ipi6_addr (the destination), ipi6_ifindex
ANY_INTERFACE = 0  # a session whose interface could not be asked for: not checked
ROUTE_RECHECK = 1.0  # s: how often a session's interface may be looked up again (packets elsewhere)
# stop(): AdminDown this many times to each neighbour, at most STOP_GAP apart, all within
# min(the neighbour's Detection Time of us, STOP_BOUND) -- RFC 5880 §6.8.16 asks for a
# Detection Time of them; a process that is stopping cannot wait the 3 s a drain takes.
STOP_REPEATS = 3
STOP_GAP = 0.1
STOP_BOUND = 1.0
_READ_BUDGET = 64  # datagrams per wake-up, so one busy socket cannot starve the loop
# A receive socket's buffer (SO_RCVBUFFORCE when we may, else SO_RCVBUF, which the kernel caps
# at net.core.rmem_max): a stall of one Detection Time queues ~3 packets per neighbour.
_RCVBUF = 1 << 20
# A due detection timer reads the receive sockets until they are empty, but never more than
# one datagram per this many bytes of their buffer (no datagram takes less room in it): a flood
# arriving while it reads cannot keep it reading for ever.
_MIN_DATAGRAM_ROOM = 64
_BIND_ATTEMPTS = 64
_INT = struct.Struct("=i")

OnChange = Callable[[str, BfdStateChanged], None]
RouteLookup = Callable[[str], "int | None"]


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
    # The interface the session is bound to (RFC 5881 §3): the route's to the neighbour;
    # None: no route (every packet is refused); ANY_INTERFACE: unknown, not checked.
    ifindex: int | None = ANY_INTERFACE
    ifindex_at: float = float("-inf")  # when it was looked up
    # The neighbour as the caller wrote it: with its scope (``fe80::1%eth0``) the interface is
    # that one, looked up again by its name, never by the bare address's route.
    written: str = ""
    # From this neighbour's address: wrong TTL, refused by the codec, or arrived on another
    # interface / sent to another address of ours.
    bad_packets: int = 0
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
        route: RouteLookup | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.listen = listen
        self.on_change = on_change
        self.clock = clock
        self.rng = rng if rng is not None else random.Random()
        self.port = port
        self.route = route if route is not None else route_interface  # peer -> ifindex (tests pass theirs)
        self.sleep = sleep  # (for stop()'s AdminDown repeats; tests pass one that moves their clock)
        self._route_warned = False
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
        """Tell every neighbour AdminDown and close all sockets.

        AdminDown goes out :data:`STOP_REPEATS` times, :data:`STOP_GAP` apart at most, all
        within the neighbour's Detection Time of us (and :data:`STOP_BOUND`): one lost packet
        would otherwise leave the neighbour to notice our silence -- a failure, the BGP session
        closed with Cease/10 in the middle of a graceful restart (RFC 5880 §6.8.16: AdminDown
        "SHOULD" go on for a Detection Time).  With no session Up, Init or draining there is
        nobody to tell and it returns at once."""
        repeat: list[_Neighbour] = []
        bound = STOP_BOUND
        for nb in list(self._by_discr.values()):
            if nb.removing:
                repeat.append(nb)  # removed before: its AdminDown drain is cut short here
                continue
            if nb.session.state in (State.UP, State.INIT):
                repeat.append(nb)
                # What the neighbour waits before declaring us down (§6.8.4, its side).
                interval = nb.session.tx_interval or SLOW_TX_US / 1e6
                bound = min(bound, nb.session.settings.detect_mult * interval)
            nb.removing = True
            self._admin_down(nb)
        for nb in list(self._by_discr.values()):
            if nb not in repeat:
                self._close(nb)
        for nb in repeat:  # the repeats below are sent here, not by the sessions' timers
            self._cancel_timer(nb)
        for sock in self._rx.values():  # (nothing received now could change what is sent)
            self._unwatch(sock)
            sock.close()
        self._rx.clear()
        gap = min(STOP_GAP, bound / STOP_REPEATS)
        for _ in range(STOP_REPEATS - 1 if repeat else 0):
            await self.sleep(gap)
            for nb in repeat:
                if nb.sock.fileno() >= 0:
                    nb.session.send_now(self.clock())
                    self._send(nb)
        for nb in repeat:
            self._close(nb)

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
        self._bind_interface(nb, peer)
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
                sock.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVPKTINFO, 1)
            else:
                sock.setsockopt(socket.IPPROTO_IP, IP_RECVTTL, 1)
                sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
            _grow_rcvbuf(sock)
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

    def _readable(self, sock: socket.socket, budget: int = _READ_BUDGET) -> None:
        for _ in range(budget):
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
        ifindex, destination = _received_pktinfo(ancdata)
        if (why := self._misdelivered(nb, ifindex, destination)) is not None:
            nb.bad_packets += 1
            log.debug("BFD: discarded a packet from %s: %s", source, why)
            return
        nb.session.receive(packet, self.clock())
        self._pump(nb)

    def _misdelivered(self, nb: _Neighbour, ifindex: int | None, destination: str | None) -> str | None:
        """Why a packet for ``nb`` that arrived on ``ifindex``, sent to ``destination``, is not
        its neighbour's (None when it may be): RFC 5881 §3, the session is bound to its
        interface; and a neighbour sends to the address our session sends from."""
        if nb.local_address is not None and destination is not None and destination != nb.local_address:
            return f"sent to {destination}, not to {nb.local_address}"
        if nb.ifindex == ANY_INTERFACE:
            return None
        if ifindex is None:
            return "no interface in its ancillary data"
        if ifindex != nb.ifindex and self.clock() - nb.ifindex_at >= ROUTE_RECHECK:
            self._bind_interface(nb, nb.written or nb.address)  # the route may have moved (at most once a second)
        if ifindex == nb.ifindex or nb.ifindex == ANY_INTERFACE:
            return None
        return f"arrived on interface {ifindex}, the session's is {nb.ifindex}"

    def _bind_interface(self, nb: _Neighbour, peer: str) -> None:
        """Bind ``nb`` to the interface of the route to ``peer`` (its scope, for a link-local
        address written with one: ``fe80::1%eth0``)."""
        nb.ifindex_at = self.clock()
        nb.written = peer
        try:
            scope = peer.split("%", 1)[1] if "%" in peer else ""
            if scope:
                # ASCII digits: "²" is a name (if_nametoindex's OSError), not int()'s ValueError
                numeric = scope.isascii() and scope.isdigit() and len(scope) <= 10
                nb.ifindex = int(scope) if numeric else socket.if_nametoindex(scope)
            else:
                nb.ifindex = self.route(nb.address)
        except OSError as err:
            nb.ifindex = ANY_INTERFACE
            if not self._route_warned:
                self._route_warned = True
                log.warning("BFD: cannot look up the interface of the route to %s (%s): sessions are not "
                            "bound to their interfaces; a host on another link could forge their packets",
                            nb.address, err.strerror or err)
            return
        if nb.ifindex is None:
            log.debug("BFD: no route to %s: its packets are refused until there is one", nb.address)

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

    def _send(self, nb: _Neighbour) -> None:
        for packet in nb.session.take_packets():
            try:
                nb.sock.sendto(packet.encode(), (nb.address, self.port))
            except OSError as err:  # full buffer, no route, neighbour unresolved: the next one may pass
                nb.send_errors += 1
                log.debug("BFD: send to %s failed: %s", nb.address, err)

    def _pump(self, nb: _Neighbour) -> None:
        session = nb.session
        self._send(nb)
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
            # packets may be waiting unread.  Read them first, all of them: behind the
            # neighbour's may be any number of other neighbours' (one wildcard socket for all);
            # only silence is a failure.
            for sock in list(self._rx.values()):
                self._readable(sock, budget=_drain_limit(sock))
            if nb.sock.fileno() < 0:
                return  # closed meanwhile (a removed session's AdminDown time ended)
        try:
            nb.session.handle_timer(self.clock())
        except Exception:
            self.internal_errors += 1
            log.exception("BFD: internal error in the timers of %s", nb.address)
        self._pump(nb)

    def _cancel_timer(self, nb: _Neighbour) -> None:
        if nb.timer is not None:
            nb.timer.cancel()
            nb.timer = None
        nb.timer_at = None

    def _close(self, nb: _Neighbour) -> None:
        self._cancel_timer(nb)
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


def _grow_rcvbuf(sock: socket.socket) -> None:
    for option in (getattr(socket, "SO_RCVBUFFORCE", 33), socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, _RCVBUF)
            return
        except OSError:  # SO_RCVBUFFORCE without CAP_NET_ADMIN: EPERM
            continue


def _drain_limit(sock: socket.socket) -> int:
    """How many datagrams reading ``sock`` until it is empty may take at most."""
    try:
        room = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    except OSError:
        room = _RCVBUF
    return max(_READ_BUDGET, room // _MIN_DATAGRAM_ROOM)


def _received_ttl(ancdata: list) -> int | None:
    for level, kind, data in ancdata:
        if (level, kind) in ((socket.IPPROTO_IP, IP_TTL), (socket.IPPROTO_IPV6, IPV6_HOPLIMIT)) and len(data) >= 4:
            return _INT.unpack_from(data)[0]
    return None


def _received_pktinfo(ancdata: list) -> tuple[int | None, str | None]:
    """(the interface it arrived on, the address it was sent to) from IP_PKTINFO /
    IPV6_PKTINFO ancillary data; (None, None) without one."""
    for level, kind, data in ancdata:
        if (level, kind) == (socket.IPPROTO_IP, IP_PKTINFO) and len(data) >= _IN_PKTINFO.size:
            ifindex, _spec_dst, addr = _IN_PKTINFO.unpack_from(data)
            return ifindex, socket.inet_ntop(socket.AF_INET, addr)
        if (level, kind) == (socket.IPPROTO_IPV6, IPV6_PKTINFO) and len(data) >= _IN6_PKTINFO.size:
            addr, ifindex = _IN6_PKTINFO.unpack_from(data)
            return ifindex, peer_key(socket.inet_ntop(socket.AF_INET6, addr))
    return None, None


# rtnetlink (linux/netlink.h, linux/rtnetlink.h)
_NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, protocol, scope, type, flags
_RTATTR = struct.Struct("=HH")  # length, type
_NLMSG_ERROR = 2
_RTM_NEWROUTE = 24
_RTM_GETROUTE = 26
_NLM_F_REQUEST = 1
_RTA_DST = 1
_RTA_OIF = 4


def route_interface(peer: str) -> int | None:
    """The interface index of the kernel's route to ``peer`` (``ip route get``), None when
    there is no route.  Raises OSError when the kernel cannot be asked."""
    packed = ip_address(peer).packed
    family = socket.AF_INET6 if len(packed) == 16 else socket.AF_INET
    body = _RTMSG.pack(family, 8 * len(packed), 0, 0, 0, 0, 0, 0, 0) + _RTATTR.pack(4 + len(packed), _RTA_DST) + packed
    request = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), _RTM_GETROUTE, _NLM_F_REQUEST, 1, 0) + body
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as nl:
        nl.settimeout(1.0)  # (the kernel answers at once; never hang the loop)
        nl.sendto(request, (0, 0))
        reply = nl.recv(65536)
    if len(reply) < _NLMSGHDR.size + 4:
        raise OSError(errno.EPROTO, "short rtnetlink reply")
    length, kind = _NLMSGHDR.unpack_from(reply)[:2]
    if kind == _NLMSG_ERROR:
        return None  # unreachable, prohibited, blackhole: no interface the neighbour could be on
    if kind != _RTM_NEWROUTE:
        raise OSError(errno.EPROTO, f"unexpected rtnetlink reply {kind}")
    off = _NLMSGHDR.size + _RTMSG.size
    end = min(length, len(reply))
    while off + _RTATTR.size <= end:
        rta_len, rta_type = _RTATTR.unpack_from(reply, off)
        if rta_len < _RTATTR.size:
            break
        if rta_type == _RTA_OIF and rta_len >= 8:
            return _INT.unpack_from(reply, off + 4)[0]
        off += (rta_len + 3) & ~3
    return None

