"""One BGP session, sans-IO (RFC 4271 §8): bytes and the time in, bytes, actions and events out.

A :class:`Session` is one instance of the RFC 4271 finite state machine.  It never
opens sockets or reads a clock: the caller feeds it

* ``start(now)`` / ``stop(now, ...)`` (ManualStart / ManualStop),
* ``connection_made(conn, now, outbound=...)``, ``connect_failed(conn, now)``,
  ``connection_lost(conn, now)`` (the TCP events),
* ``receive_data(data, now)`` (bytes from the peer),
* ``handle_timer(now)`` whenever ``get_timer()`` is due,

and collects ``take_actions()`` (Connect / Send / Close for the transport) and
``next_event()`` (Established, UpdateReceived, ... for the speaker).  Where the
session ends up after each event is decided by :mod:`bgp.fsm`'s table.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from proto.errors import DecodeError, ErrorAction, ErrorCode
from proto.messages import (
    CodecContext,
    Keepalive,
    MessageReader,
    MessageType,
    Notification,
    Open,
    RouteRefresh,
    Update,
    trim_cache,
)

from .fsm import Event, State, fsm_error_subcode, transition
from .negotiation import Negotiated, negotiate, our_open
from .settings import LocalSettings, PeerSettings, RestartState

# RFC 4271 §8.2.2: "the HoldTimer to a large value ... A HoldTimer value of 4 minutes is suggested"
OPEN_HOLD_TIME = 240.0
# Bound on the per-session cache of decoded attribute sets (proto's Update.decode cache).
ATTRIBUTE_CACHE_SIZE = 4096


# ---------------------------------------------------------------- actions (for the transport)


@dataclass(frozen=True, slots=True)
class Connect:
    conn: int
    address: str
    port: int
    local_address: str | None
    password: str | None
    ttl_security: bool = False  # RFC 5082: TTL 255 out, at least 254 in


@dataclass(frozen=True, slots=True)
class Send:
    """Bytes for connection ``conn``, as the pieces they were queued in (never joined: a piece
    is often the same object for many peers, an update group's shared stream, and a transport
    that writes the pieces as they are holds no private copy of it, see bgp.export)."""

    conn: int
    chunks: tuple[bytes | memoryview, ...]

    @property
    def data(self) -> bytes:
        """The pieces as one bytes object (a copy when there is more than one)."""
        c = self.chunks
        return c[0] if len(c) == 1 and isinstance(c[0], bytes) else b"".join(c)


@dataclass(frozen=True, slots=True)
class Close:
    conn: int


Action = Connect | Send | Close


# ---------------------------------------------------------------- events (for the speaker)


@dataclass(frozen=True)
class OpenReceived:
    open: Open


@dataclass(frozen=True)
class Established:
    negotiated: Negotiated


@dataclass(frozen=True)
class UpdateReceived:
    update: Update


@dataclass(frozen=True)
class RouteRefreshReceived:
    afi: int
    safi: int


@dataclass(frozen=True)
class SessionDown:
    """The session left OpenSent/OpenConfirm/Established (or a connect attempt failed).

    ``graceful`` says the session ended without a NOTIFICATION in either direction,
    which is when RFC 4724 §4.2 lets a receiving speaker keep the peer's routes.
    """

    reason: str
    was_established: bool
    graceful: bool
    notification: Notification | None = None
    sent: bool = False  # True: we sent the NOTIFICATION; False: we received it
    # ManualStop (Session.stop without a reason): the owner ended it -- the peer removed or
    # reconfigured, the speaker stopping -- which is no failure of the session.
    manual: bool = False


SessionEvent = OpenReceived | Established | UpdateReceived | RouteRefreshReceived | SessionDown


class Session:
    """One BGP FSM instance (RFC 4271 §8) for one neighbour."""

    def __init__(
        self,
        local: LocalSettings,
        peer: PeerSettings,
        *,
        conn_ids: Iterator[int],
        now: float,
        restart: RestartState | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.local = local
        self.peer = peer
        self._conn_ids = conn_ids
        # RFC 4271 §10 jitter on the KeepaliveTimer and the ConnectRetryTimer: each started
        # for a uniform 0.75-1.0 of its time, so that sessions that came up (or a speaker's
        # retries toward peers that went away) together do not stay in lock-step.  None: no
        # jitter (the hold timer never has any).
        self._rng = rng
        # The speaker's, read at each OPEN (the R bit); a session of its own: local.restarting.
        self.restart = restart if restart is not None else RestartState(local.restarting)
        self.state = State.IDLE
        self.since = now
        self.conn: int | None = None  # the TCP connection this FSM uses, if any
        self.outbound: bool | None = None
        self._pending_connect: int | None = None
        self._reader = MessageReader()
        self._out: list[bytes | memoryview] = []  # queued for the next Send (as pieces, never joined)
        self._actions: list[Action] = []
        self._events: collections.deque[SessionEvent] = collections.deque()
        self._connect_retry_at: float | None = None
        self._hold_at: float | None = None
        self._keepalive_at: float | None = None
        self._blocked_at: float | None = None  # the send timeout, while the socket takes nothing
        self.writable = True  # the transport's socket buffer has room (set_writable)
        # Whether the peer has sent anything at all on this connection: one that has not is
        # the connection a newer one from the same peer displaces (bgp.peer, Peer.accept).
        self.heard = False
        # Set when connection collision resolution closed it (RFC 4271 §6.8): an Established
        # event still queued from the same read then means nothing came up.
        self.collision_lost = False
        self._hold_time = float(OPEN_HOLD_TIME)
        self._keepalive_time = 0.0
        # The jitter factor of the running KeepaliveTimer: drawn when it starts after a
        # KEEPALIVE (or the OPEN), kept when an UPDATE sent restarts it, so that those restarts,
        # thousands a second on a busy reflector, only ever move it later (TimerHeap).
        self._keepalive_jitter = 1.0
        self._cache: dict = {}
        self.open_sent: Open | None = None
        self.open_received: Open | None = None
        self.negotiated: Negotiated | None = None
        self.ctx = CodecContext()
        self.last_error: str = ""
        # Counters for status and tests.
        self.messages_in = 0
        self.messages_out = 0
        self.updates_in = 0
        self.updates_out = 0

    def __repr__(self) -> str:
        return f"<Session {self.peer.key} {self.state.label} conn={self.conn}>"

    # ------------------------------------------------------------ outputs

    def take_actions(self) -> list[Action]:
        self._flush()
        actions, self._actions = self._actions, []
        return actions

    def next_event(self) -> SessionEvent | None:
        return self._events.popleft() if self._events else None

    def get_timer(self) -> float | None:
        times = [
            t for t in (self._connect_retry_at, self._hold_at, self._keepalive_at, self._blocked_at) if t is not None
        ]
        return min(times) if times else None

    @property
    def has_connection(self) -> bool:
        return self.conn is not None

    @property
    def connecting(self) -> bool:
        """An outbound connection of ours is being made."""
        return self._pending_connect is not None

    @property
    def silent(self) -> bool:
        """Our OPEN is out on a connection on which the peer has sent nothing yet."""
        return self.conn is not None and self.state is State.OPEN_SENT and not self.heard

    def uses(self, conn: int) -> bool:
        """``conn`` is this session's connection, or the one it is making."""
        return self.conn == conn or self._pending_connect == conn

    # ------------------------------------------------------------ inputs: administrative

    def start(self, now: float, *, passive: bool | None = None) -> None:
        """ManualStart (outbound) or ManualStart_with_PassiveTcpEstablishment."""
        passive = self.peer.passive if passive is None else passive
        self._go(Event.MANUAL_START_PASSIVE if passive else Event.MANUAL_START, now)
        if self.state is State.CONNECT:
            self._begin_connect(now)

    def stop(self, now: float, notification: Notification | None = None, *, reason: str | None = None) -> None:
        """ManualStop: send ``notification`` if a connection exists (None: close silently,
        which is how a graceful restart leaves its peers), then go Idle.  With ``reason`` it is
        an AutomaticStop (RFC 4271 §8.1.2): we end the session for that reason, not an operator."""
        if self.state is State.IDLE:
            return
        was_established = self.state is State.ESTABLISHED
        # A NOTIFICATION goes out only on a connection that carries BGP (OpenSent or later);
        # in Connect or Active there is none to send it on, and the session's end says none
        # was sent (no "session failed" for a peer removed or reconfigured while down).
        if notification is not None and self.state >= State.OPEN_SENT:
            self._send(notification.encode(self.ctx))
        else:
            notification = None
        self._drop_connection()
        manual = reason is None
        self._go(Event.MANUAL_STOP if manual else Event.AUTOMATIC_STOP, now)
        if manual:
            reason = f"stopped: {notification}" if notification else "stopped"
        else:
            self.last_error = reason
        self._events.append(
            SessionDown(reason, was_established, graceful=notification is None, notification=notification, sent=True,
                        manual=manual)
        )

    def set_writable(self, writable: bool, now: float) -> None:
        """The transport's socket buffer is over (False) or back under (True) its limit.  While it
        stays full for ``send_timeout`` the peer is not reading: Cease/Out of Resources."""
        self.writable = writable or self.conn is None
        if self.writable:
            self._blocked_at = None
        elif self._blocked_at is None:
            self._blocked_at = now + self.local.send_timeout

    # ------------------------------------------------------------ inputs: TCP

    def connection_made(self, conn: int, now: float, *, outbound: bool) -> None:
        """A TCP connection is ready: ours completed (TcpCRAcked) or theirs arrived (TcpConnectionConfirmed)."""
        if outbound and conn != self._pending_connect:
            raise ValueError(f"connection {conn} was not requested by {self!r}")
        if not outbound and self._pending_connect is not None:
            # The peer reached us first; our own attempt is abandoned (RFC 4271 §8.2.2, Connect state).
            self._actions.append(Close(self._pending_connect))
        self._pending_connect = None
        self._connect_retry_at = None
        self.conn = conn
        self.outbound = outbound
        self.collision_lost = False
        self._go(Event.TCP_CR_ACKED if outbound else Event.TCP_CONNECTION_CONFIRMED, now)
        self._send_open(now)

    def connect_failed(self, conn: int, now: float) -> None:
        if conn != self._pending_connect:
            return  # an attempt we already abandoned
        self._pending_connect = None
        self._connect_retry_at = None
        self.last_error = "connection failed"
        self._go(Event.TCP_CONNECTION_FAILS, now)
        self._events.append(SessionDown("connect failed", False, graceful=False))

    def connection_lost(self, conn: int, now: float) -> None:
        if conn != self.conn:
            return
        was_established = self.state is State.ESTABLISHED
        self.conn = None
        self._reset_connection_state()
        self.last_error = "connection closed by peer" if self.state >= State.OPEN_SENT else "connection lost"
        self._go(Event.TCP_CONNECTION_FAILS, now)
        if self.state is State.ACTIVE and not self.peer.passive:
            # OpenSent + TcpConnectionFails -> Active: keep listening, retry after ConnectRetryTime
            # (a passive peer only listens: it never connects out, RFC 4271 §8.1.1 option 5).
            # The peer's setting, not how this session was started: an active peer's session
            # that took an inbound connection (started passive, Peer.accept) must go on
            # connecting out once that connection is gone, or nothing would ever restart it.
            # A collision session (passive-started too) is stopped and forgotten by Peer._process.
            self._connect_retry_at = now + self._jitter(self.local.connect_retry_time)
        self._events.append(SessionDown(self.last_error, was_established, graceful=True))

    # ------------------------------------------------------------ inputs: bytes

    def receive_data(self, data: bytes, now: float) -> None:
        if self.conn is None or self.state < State.OPEN_SENT:
            return
        self.heard = self.heard or bool(data)
        self._reader.feed(data)
        while self.conn is not None:
            try:
                item = self._reader.next_message()
            except DecodeError as err:
                self._fail(err, Event.BGP_HEADER_ERR, now)
                return
            if item is None:
                return
            msg_type, body = item
            self.messages_in += 1
            try:
                self._dispatch(msg_type, body, now)
            except DecodeError as err:
                event = {
                    MessageType.OPEN: Event.BGP_OPEN_MSG_ERR,
                    MessageType.UPDATE: Event.UPDATE_MSG_ERR,
                }.get(msg_type, Event.BGP_HEADER_ERR)
                self._fail(err, event, now)
                return

    def _dispatch(self, msg_type: int, body: bytes, now: float) -> None:
        if msg_type == MessageType.UPDATE:
            if self.state is not State.ESTABLISHED:
                self._fsm_error(Event.UPDATE_MSG, now)
                return
            update = Update.decode(body, self.ctx, self._cache)
            if len(self._cache) > ATTRIBUTE_CACHE_SIZE:
                trim_cache(self._cache)
            self.updates_in += 1
            self._restart_hold_timer(now)
            self._events.append(UpdateReceived(update))
        elif msg_type == MessageType.KEEPALIVE:
            self._on_keepalive(now)
        elif msg_type == MessageType.OPEN:
            self._on_open(Open.decode(body, self.ctx), now)
        elif msg_type == MessageType.NOTIFICATION:
            self._on_notification(Notification.decode(body, self.ctx), now)
        elif msg_type == MessageType.ROUTE_REFRESH:
            refresh = RouteRefresh.decode(body, self.ctx)
            if self.state is not State.ESTABLISHED:
                self._fsm_error(Event.ROUTE_REFRESH_MSG, now)
                return
            self._restart_hold_timer(now)
            self._go(Event.ROUTE_REFRESH_MSG, now)
            # RFC 7313 §5: subtypes other than 0-2 MUST be ignored; BoRR (1) and EoRR (2) mean
            # something only with Enhanced Route Refresh, which we do not advertise.
            if refresh.subtype == 0:
                self._events.append(RouteRefreshReceived(refresh.afi, refresh.safi))

    # ------------------------------------------------------------ inputs: time

    def handle_timer(self, now: float) -> None:
        if self._blocked_at is not None and now >= self._blocked_at:
            self._blocked_at = None
            # RFC 4486 §4 Cease/8: we will not hold what the peer does not read for ever.  The
            # NOTIFICATION is queued behind everything else, so it is a courtesy at best.
            self.stop(
                now,
                Notification(ErrorCode.CEASE, 8),
                reason=f"send timeout: the peer read nothing for {self.local.send_timeout:g}s",
            )
            return
        if self._connect_retry_at is not None and now >= self._connect_retry_at:
            self._connect_retry_at = None
            if self._pending_connect is not None:
                self._actions.append(Close(self._pending_connect))
                self._pending_connect = None
            self._go(Event.CONNECT_RETRY_TIMER_EXPIRES, now)
            if self.state is State.CONNECT:
                self._begin_connect(now)
        if self._hold_at is not None and now >= self._hold_at:
            self._hold_at = None
            self.last_error = "hold timer expired"
            was_established = self.state is State.ESTABLISHED
            notification = Notification(ErrorCode.HOLD_TIMER_EXPIRED, 0)
            self._send(notification.encode(self.ctx))
            self._drop_connection()
            self._go(Event.HOLD_TIMER_EXPIRES, now)
            self._events.append(
                SessionDown("hold timer expired", was_established, graceful=False, notification=notification, sent=True)
            )
            return
        if self._keepalive_at is not None and now >= self._keepalive_at:
            self._send(Keepalive().encode(self.ctx))
            self._start_keepalive_timer(now)
            self._go(Event.KEEPALIVE_TIMER_EXPIRES, now)

    # ------------------------------------------------------------ outbound routes

    def send_messages(self, messages: Iterable[bytes | memoryview], now: float) -> None:
        """Queue already-encoded UPDATE (or ROUTE-REFRESH) messages; only when Established."""
        if self.state is not State.ESTABLISHED:
            raise RuntimeError(f"cannot send routes in state {self.state.label}")
        n = 0
        for m in messages:
            self._out.append(m)
            n += 1
        if n:
            self.messages_out += n
            self.updates_out += n
            # RFC 4271 §10: the KeepaliveTimer restarts whenever an UPDATE is sent.
            if self._keepalive_time:
                self._keepalive_at = now + self._keepalive_time * self._keepalive_jitter

    def collision_dump(self, now: float) -> None:
        """Lose connection collision resolution (RFC 4271 §6.8): Cease/7 and Idle."""
        was_established = self.state is State.ESTABLISHED
        notification = Notification(ErrorCode.CEASE, 7)
        if self.conn is not None:
            self._send(notification.encode(self.ctx))
        self._drop_connection()
        self._go(Event.OPEN_COLLISION_DUMP, now)
        self.collision_lost = True
        self.last_error = "connection collision resolution"
        self._events.append(
            SessionDown(self.last_error, was_established, graceful=False, notification=notification, sent=True)
        )

    # ------------------------------------------------------------ internals

    def _go(self, event: Event, now: float) -> None:
        new = transition(self.state, event)
        if new is not self.state:
            self.state = new
            self.since = now
            if new is State.IDLE:
                self._connect_retry_at = self._hold_at = self._keepalive_at = None

    def _begin_connect(self, now: float) -> None:
        conn = next(self._conn_ids)
        self._pending_connect = conn
        self._connect_retry_at = now + self._jitter(self.local.connect_retry_time)
        self._actions.append(
            Connect(
                conn,
                str(self.peer.address),
                self.peer.port,
                str(self.peer.local_address) if self.peer.local_address else None,
                self.peer.password,
                self.peer.ttl_security,
            )
        )

    def _jitter(self, seconds: float) -> float:
        return seconds * self._rng.uniform(0.75, 1.0) if self._rng is not None else seconds

    def _start_keepalive_timer(self, now: float) -> None:
        if not self._keepalive_time:  # hold time 0: no KEEPALIVEs
            self._keepalive_at = None
            return
        self._keepalive_jitter = self._rng.uniform(0.75, 1.0) if self._rng is not None else 1.0
        self._keepalive_at = now + self._keepalive_time * self._keepalive_jitter

    def _send_open(self, now: float) -> None:
        self.open_sent = our_open(self.local, self.peer, restarting=self.restart.restarting)
        self._send(self.open_sent.encode(self.ctx))
        self._hold_time = OPEN_HOLD_TIME
        self._hold_at = now + OPEN_HOLD_TIME

    def _on_open(self, open_: Open, now: float) -> None:
        if self.state is not State.OPEN_SENT:
            self._fsm_error(Event.BGP_OPEN, now)
            return
        assert self.open_sent is not None
        neg = self.negotiated = negotiate(self.open_sent, open_, self.local, self.peer)  # DecodeError: Notification
        self.open_received = open_
        self.ctx = neg.ctx
        hold = neg.hold_time
        self._hold_time = float(hold)
        self._keepalive_time = neg.keepalive_time
        self._go(Event.BGP_OPEN, now)
        self._send(Keepalive().encode(self.ctx))
        self._hold_at = now + hold if hold else None
        self._start_keepalive_timer(now)
        self._events.append(OpenReceived(open_))

    def _on_keepalive(self, now: float) -> None:
        if self.state is State.OPEN_CONFIRM:
            self._go(Event.KEEPALIVE_MSG, now)
            self._restart_hold_timer(now)
            assert self.negotiated is not None
            self._events.append(Established(self.negotiated))
        elif self.state is State.ESTABLISHED:
            self._go(Event.KEEPALIVE_MSG, now)
            self._restart_hold_timer(now)
        else:
            self._fsm_error(Event.KEEPALIVE_MSG, now)

    def _on_notification(self, notification: Notification, now: float) -> None:
        was_established = self.state is State.ESTABLISHED
        version_error = notification.code == ErrorCode.OPEN_MESSAGE and notification.subcode == 1
        self.last_error = f"received NOTIFICATION {notification}"
        self._drop_connection()
        self._go(Event.NOTIF_MSG_VER_ERR if version_error else Event.NOTIF_MSG, now)
        self._events.append(
            SessionDown(self.last_error, was_established, graceful=False, notification=notification, sent=False)
        )

    def _restart_hold_timer(self, now: float) -> None:
        if self._hold_time:
            self._hold_at = now + self._hold_time

    def _fail(self, err: DecodeError, event: Event, now: float) -> None:
        """A message was malformed in a way that resets the session (RFC 4271 §6, RFC 7606)."""
        assert err.action is ErrorAction.SESSION_RESET, err
        was_established = self.state is State.ESTABLISHED
        notification = Notification(err.code, err.subcode, err.data)
        self.last_error = f"sent NOTIFICATION {notification}: {err.message}" if err.message else str(notification)
        self._send(notification.encode(self.ctx))
        self._drop_connection()
        self._go(event, now)
        self._events.append(
            SessionDown(self.last_error, was_established, graceful=False, notification=notification, sent=True)
        )

    def _fsm_error(self, event: Event, now: float) -> None:
        """An event the current state does not expect: NOTIFICATION 5/<state> (RFC 6608), Idle."""
        was_established = self.state is State.ESTABLISHED
        notification = Notification(ErrorCode.FSM, fsm_error_subcode(self.state))
        self.last_error = f"unexpected {event.name} in {self.state.label}"
        self._send(notification.encode(self.ctx))
        self._drop_connection()
        self._go(event, now)
        self._events.append(
            SessionDown(self.last_error, was_established, graceful=False, notification=notification, sent=True)
        )

    def _send(self, data: bytes) -> None:
        if self.conn is None:
            return
        self._out.append(data)
        self.messages_out += 1

    def _flush(self) -> None:
        out = self._out
        if out and self.conn is not None:
            self._actions.append(Send(self.conn, tuple(out)))
        out.clear()

    def _drop_connection(self) -> None:
        """Close our TCP connection (after flushing what is queued) and forget per-connection state."""
        if self._pending_connect is not None:
            self._actions.append(Close(self._pending_connect))
            self._pending_connect = None
        if self.conn is not None:
            self._flush()
            self._actions.append(Close(self.conn))
            self.conn = None
        self._reset_connection_state()

    def _reset_connection_state(self) -> None:
        self._out.clear()
        self._reader = MessageReader()
        self._cache = {}
        self._hold_at = self._keepalive_at = self._blocked_at = None
        self.writable = True
        self.heard = False
        self.ctx = CodecContext()
