"""One configured neighbour, sans-IO: its FSM sessions, restarts with backoff, collisions.

A :class:`Peer` owns a main :class:`~bgp.session.Session` and, while two TCP
connections race, a second one (RFC 4271 §6.8 connection collision).  It restarts
a failed session after an exponentially growing, jittered delay (the IdleHoldTimer
of RFC 4271 §8.1.1) and tells the speaker what happened as :class:`PeerEvent` s.  The
delay starts over only after a session that stayed Established for ``backoff_max``
seconds (DampPeerOscillations): one that the peer, or we, end right after it came up
counts as a failure like one that never came up, and until the delay after it is over the
peer's own connections are refused too (Idle refuses them during the IdleHoldTimer, RFC
4271 §8.2.2), or a peer that reconnects at once would flap as fast as it reconnects.

Two connections at a time is all a peer gets, and §6.8 only decides between connections
that have both carried an OPEN.  A connection on which the peer has said nothing yet
(a half-open socket, a prober, a crashed peer's last attempt) would otherwise keep its
slot for the whole OpenSent hold time (240 s) and lock the peer out: so a newer
connection from the same address takes the slot of the oldest silent one, which is
closed with Cease/Connection Collision Resolution (:meth:`Peer.accept`).
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from proto.capabilities import GracefulRestart
from proto.errors import CeaseSubcode, ErrorCode
from proto.messages import Notification, Update

from .fsm import State
from .session import (
    Action,
    Close,
    Established,
    Negotiated,
    OpenReceived,
    RouteRefreshReceived,
    Session,
    SessionDown,
    UpdateReceived,
)
from .settings import LocalSettings, PeerSettings, RestartState

COLLISION_CEASE = (ErrorCode.CEASE, CeaseSubcode.CONNECTION_COLLISION_RESOLUTION)
# A received Cease that ends a session on purpose, the peer meaning to come back (its operator
# reset or re-enabled it, changed its configuration; a §6.8 collision resolved): its own
# reconnect is taken at once even when the session had just come up (see _ended_early).
DELIBERATE_CEASES = frozenset(
    (ErrorCode.CEASE, sub)
    for sub in (
        CeaseSubcode.ADMINISTRATIVE_SHUTDOWN,
        CeaseSubcode.ADMINISTRATIVE_RESET,
        CeaseSubcode.OTHER_CONFIGURATION_CHANGE,
        CeaseSubcode.CONNECTION_COLLISION_RESOLUTION,
    )
)


@dataclass(frozen=True)
class PeerUp:
    negotiated: Negotiated
    local_address: str | None


@dataclass(frozen=True)
class PeerUpdate:
    update: Update


@dataclass(frozen=True)
class PeerRouteRefresh:
    afi: int
    safi: int


@dataclass(frozen=True)
class PeerDown:
    reason: str
    # The peer's routes may be kept (RFC 4724 §4.2): the session ended without a NOTIFICATION
    # and the peer had advertised graceful restart.
    graceful: bool
    peer_graceful_restart: GracefulRestart | None


@dataclass(frozen=True)
class PeerFailed:
    """A session that never reached Established ended with a NOTIFICATION (either way)."""

    reason: str


@dataclass(frozen=True)
class PeerCollisionClosed:
    """The peer closed one of our connections with Cease/Connection Collision Resolution: it
    resolved an RFC 4271 §6.8 collision (the other connection goes on), which is no failure."""

    reason: str


PeerEvent = PeerUp | PeerUpdate | PeerRouteRefresh | PeerDown | PeerFailed | PeerCollisionClosed


@dataclass(frozen=True)
class Admission:
    """What became of an inbound connection (:meth:`Peer.accept`, ``Speaker.accept``); true
    when it was taken.  ``reason``: why it was refused; ``displaced``: the silent connection
    it took the place of, if any, said for the log."""

    accepted: bool
    reason: str = ""
    displaced: str = ""

    def __bool__(self) -> bool:
        return self.accepted


class Peer:
    def __init__(
        self,
        local: LocalSettings,
        settings: PeerSettings,
        *,
        conn_ids: Iterator[int],
        now: float,
        rng: random.Random | None = None,
        restart: RestartState | None = None,
    ) -> None:
        self.local = local
        self.settings = settings
        self._conn_ids = conn_ids
        self._rng = rng or random.Random()
        # The speaker's Restart State (the R bit of every session's OPEN; see RestartState).
        self.restart = restart if restart is not None else RestartState(local.restarting)
        self.session = Session(local, settings, conn_ids=conn_ids, now=now, restart=self.restart, rng=self._rng)
        self.collisions: list[Session] = []
        self.enabled = False
        self._restart_at: float | None = None
        # Until then the peer stays down and refuses connections (max-prefix, RFC 4486 §4);
        # infinity: until it is reconfigured.
        self.held_until: float | None = None
        self._failures = 0
        # When the session the speaker was told is up (``_up``) reached Established.
        self._up_at = 0.0
        # The last session ended on the peer's Cease/Connection Collision Resolution: the next
        # restart waits the current delay without growing it (see _on_session_event).
        self._collision_ended = False
        # The last session ended less than backoff_max after it came up (and not gracefully):
        # the restart delay it starts is a damped one (see _process).
        self._ended_early = False
        # Until then (the end of that delay) the peer's own connections are refused too.
        self._damped_until: float | None = None
        self._actions: list[Action] = []
        self._events: collections.deque[PeerEvent] = collections.deque()
        self._local_addresses: dict[int, str] = {}
        self._up: Session | None = None  # the session the speaker was told is up (PeerUp)
        self.established_count = 0
        self.last_error = ""
        self.since = now

    def __repr__(self) -> str:
        return f"<Peer {self.settings.key} {self.state.label}>"

    @property
    def key(self) -> str:
        return self.settings.key

    @property
    def state(self) -> State:
        return max([self.session.state, *(s.state for s in self.collisions)])

    @property
    def established(self) -> Session | None:
        return self.session if self.session.state is State.ESTABLISHED else None

    def sessions(self) -> list[Session]:
        return [self.session, *self.collisions]

    def owns(self, conn: int) -> Session | None:
        for s in self.sessions():
            if s.uses(conn):
                return s
        return None

    # ------------------------------------------------------------ administrative

    def start(self, now: float) -> None:
        if self.enabled:
            return
        self.enabled = True
        self._failures = 0
        self._damped_until = None
        self.session.start(now)
        self._process(now)

    def carried(self, now: float) -> tuple[float, int, str] | None:
        """What the next Peer at this address takes over from this one, when this one goes (a
        listen-range client's Peer goes with its session): until when its connections are
        refused after a session that ended early (DampPeerOscillations; ``now`` when they are
        not), the failures its next delay grows from, and why it is refused.  None without
        failures (nothing to carry: a session that stayed up backoff_max started over)."""
        if self._failures == 0:
            return None
        damped = self._damped_until is not None and now < self._damped_until
        return (self._damped_until if damped else now), self._failures, self._ended_early_reason()

    def resume_damping(self, failures: int) -> None:
        """Carry on the failures of an earlier Peer at this address (a listen-range client's
        last one): its next failure waits longer, as a configured peer's would."""
        self._failures = min(max(failures, 0), 16)

    def _ended_early_reason(self) -> str:
        return f"its last session ended {self.since - self._up_at:.1f}s after it came up ({self.last_error or 'a reset'})"

    def stop(self, now: float, notification: Notification | None) -> None:
        self.enabled = False
        self._restart_at = None
        for s in self.sessions():
            s.stop(now, notification)
        self._process(now)

    def shutdown(self, now: float, notification: Notification, reason: str, *, hold: float | None = 0.0) -> None:
        """End every session ourselves (AutomaticStop) and stay enabled: the peer is tried again
        after the usual backoff (``hold`` 0), after ``hold`` seconds, or (``hold`` None) not
        until it is reconfigured."""
        if hold is None:
            self.held_until = math.inf
        elif hold > 0:
            self.held_until = now + hold
        self._restart_at = None
        for s in self.sessions():
            s.stop(now, notification, reason=reason)
        self.last_error = reason
        self._process(now)

    @property
    def writable(self) -> bool:
        return self.session.writable

    def set_writable(self, conn: int, writable: bool, now: float) -> None:
        s = self.owns(conn)
        if s is not None:
            s.set_writable(writable, now)

    # ------------------------------------------------------------ transport inputs

    def accept(self, conn: int, now: float, local_address: str | None = None) -> Admission:
        """An inbound TCP connection from this peer's address arrived."""
        if not self.enabled:
            return Admission(False, "the peer is not enabled (the speaker is not running)")
        if self.held_until is not None and now < self.held_until:
            until = "until it is reconfigured" if self.held_until == math.inf else f"for {self.held_until - now:.0f}s more"
            return Admission(False, f"the peer is held down after {self.last_error or 'a reset'}, {until}")
        if self._damped_until is not None and now < self._damped_until:
            # RFC 4271 §8.1.1 DampPeerOscillations: the IdleHoldTimer runs, and Idle refuses
            # connections (§8.2.2) -- ours wait for it too.
            return Admission(False, f"{self._ended_early_reason()}: held down for {self._damped_until - now:.0f}s more")
        main = self.session
        displaced = ""
        if not self._free(main) and len(self.collisions) >= 1:
            # Both slots taken.  RFC 4271 §6.8 decides only between connections that carried
            # an OPEN; one on which the peer said nothing yet is the one to drop.
            silent = [s for s in self.sessions() if s.silent]
            if not silent:
                return Admission(False, "two connections from this peer are already exchanging OPENs (RFC 4271 §6.8)")
            victim = min(silent, key=lambda s: s.since)
            displaced = (
                f"an {'outbound' if victim.outbound else 'inbound'} connection on which it had sent "
                f"nothing for {now - victim.since:.0f}s"
            )
            fresh = Session(self.local, self.settings, conn_ids=self._conn_ids, now=now, restart=self.restart, rng=self._rng)
            if victim is main:
                self.session = main = fresh
            else:
                self.collisions[self.collisions.index(victim)] = fresh
            victim.stop(
                now,
                Notification(ErrorCode.CEASE, CeaseSubcode.CONNECTION_COLLISION_RESOLUTION),
                reason="displaced by a newer connection before it sent anything",
            )
            self._actions.extend(victim.take_actions())  # its Cease and close; it never came up
        if local_address:
            self._local_addresses[conn] = local_address
        if self._free(main):
            if main.state is State.IDLE:
                main.start(now, passive=True)
            self._restart_at = None
            main.connection_made(conn, now, outbound=False)
        else:
            if not self.collisions:
                self.collisions.append(Session(self.local, self.settings, conn_ids=self._conn_ids, now=now, restart=self.restart, rng=self._rng))
            s = self.collisions[0]  # new, or the fresh one in a displaced connection's place
            assert s.state is State.IDLE and s.conn is None, s
            s.start(now, passive=True)
            s.connection_made(conn, now, outbound=False)
        self._process(now)
        return Admission(True, displaced=displaced)

    @staticmethod
    def _free(s: Session) -> bool:
        """``s`` can take an inbound connection: it has none, and is not past Active."""
        return s.state in (State.IDLE, State.CONNECT, State.ACTIVE) and s.conn is None

    def connection_made(self, conn: int, now: float, local_address: str | None = None) -> None:
        s = self.owns(conn)
        if s is None:
            self._actions.append(Close(conn))
            return
        if local_address:
            self._local_addresses[conn] = local_address
        s.connection_made(conn, now, outbound=True)
        self._process(now)

    def connect_failed(self, conn: int, now: float) -> None:
        s = self.owns(conn)
        if s is not None:
            s.connect_failed(conn, now)
            self._process(now)

    def connection_lost(self, conn: int, now: float) -> None:
        s = self.owns(conn)
        if s is not None:
            s.connection_lost(conn, now)
            self._process(now)

    def data_received(self, conn: int, data: bytes, now: float) -> None:
        s = self.owns(conn)
        if s is not None:
            s.receive_data(data, now)
            self._process(now)

    def local_address(self) -> str | None:
        conn = self.session.conn
        return self._local_addresses.get(conn) if conn is not None else None

    # ------------------------------------------------------------ time

    def get_timer(self) -> float | None:
        times = [t for t in (s.get_timer() for s in self.sessions()) if t is not None]
        if self._restart_at is not None:
            times.append(self._restart_at)
        return min(times) if times else None

    def handle_timer(self, now: float) -> None:
        if self._restart_at is not None and now >= self._restart_at:
            self._restart_at = None
            self.held_until = None
            self._damped_until = None
            if self.enabled and self.session.state is State.IDLE:
                self.session.start(now)
        for s in self.sessions():
            t = s.get_timer()
            if t is not None and now >= t:
                s.handle_timer(now)
        self._process(now)

    # ------------------------------------------------------------ outputs

    def take_actions(self) -> list[Action]:
        actions, self._actions = self._actions, []
        for s in self.sessions():
            actions.extend(s.take_actions())
        return actions

    def next_event(self) -> PeerEvent | None:
        return self._events.popleft() if self._events else None

    def send_messages(self, messages: list[bytes | memoryview], now: float) -> None:
        self.session.send_messages(messages, now)

    # ------------------------------------------------------------ the logic

    def _process(self, now: float) -> None:
        """Drain every session's events, resolve collisions, schedule restarts."""
        progress = True
        while progress:
            progress = False
            for s in self.sessions():
                ev = s.next_event()
                while ev is not None:
                    progress = True
                    self._on_session_event(s, ev, now)
                    ev = s.next_event()
        # Forget collision sessions that lost or lost their connection (a second FSM exists only
        # for one TCP connection); keep their last actions (the Cease, the close).
        for s in [s for s in self.collisions if s.state is State.IDLE or s.conn is None]:
            s.stop(now)
            self._actions.extend(s.take_actions())
            self.collisions.remove(s)
        if self.session.state is State.IDLE and self.collisions:
            # The main session lost the race: the survivor becomes the main one.
            self._actions.extend(self.session.take_actions())
            self.session = self.collisions.pop(0)
        if self.enabled and self.session.state is State.IDLE and self._restart_at is None:
            held = self.held_until
            if held is None or held <= now:
                self._restart_at = now + self._backoff(grow=not self._collision_ended)
                if self._ended_early:
                    self._damped_until = self._restart_at
            elif held != math.inf:
                self._restart_at = held
        self._collision_ended = False
        self._ended_early = False
        for conn in [c for c in self._local_addresses if all(s.conn != c for s in self.sessions())]:
            del self._local_addresses[conn]

    def _on_session_event(self, s: Session, ev, now: float) -> None:
        if isinstance(ev, UpdateReceived):
            if s is self.session:
                self._events.append(PeerUpdate(ev.update))
        elif isinstance(ev, OpenReceived):
            self._resolve_collision(s, ev, now)
        elif isinstance(ev, Established):
            if s.collision_lost:
                # Its OPEN and KEEPALIVE came in one read, and the collision check that ran on the
                # OPEN has closed it since (the main session is Established): nothing came up.
                return
            # Otherwise it did come up, even if it has ended since (OPEN, KEEPALIVE and a
            # NOTIFICATION or a bad UPDATE in one read): it is counted, logged and reported
            # like any session, and its SessionDown, next in the queue, takes it down again.
            if s is not self.session and s.state is State.ESTABLISHED:
                # A second connection reached Established while the main one had not (it sits in
                # OpenSent: a silent peer, or a dead race).  It becomes the main session; the old
                # one is closed with Cease/7 (RFC 4271 §6.8) rather than forgotten with its socket.
                old = self.session
                self.collisions.remove(s)
                self.session = s
                if old.state is not State.IDLE:
                    old.stop(
                        now,
                        Notification(ErrorCode.CEASE, CeaseSubcode.CONNECTION_COLLISION_RESOLUTION),
                        reason="connection collision resolution",
                    )
                self._actions.extend(old.take_actions())
            self._up = s
            # Not a reason to forget past failures yet: see the SessionDown branch.
            self._up_at = now
            self.established_count += 1
            self.since = now
            self.last_error = ""
            self._events.append(PeerUp(ev.negotiated, self._local_addresses.get(s.conn or -1)))
        elif isinstance(ev, RouteRefreshReceived):
            if s is self.session:
                self._events.append(PeerRouteRefresh(ev.afi, ev.safi))
        elif isinstance(ev, SessionDown):
            if ev.reason and ev.reason != "stopped":
                self.last_error = ev.reason
            note = ev.notification
            if ev.was_established or note is None or ev.manual:
                # An Established one's end is PeerDown, below; one without NOTIFICATION is no
                # event; nor is our own ManualStop's Cease (a peer removed or reconfigured, the
                # speaker stopping): no failure (Speaker.remove_peer logs a removal).
                pass
            elif not ev.sent and (note.code, note.subcode) == COLLISION_CEASE and self._another_open(s):
                # The peer resolved a §6.8 collision and keeps the other connection (the one it
                # opened, or ours): a resolved collision, whichever of our sessions it closed.
                # With no other connection left it is a failure like any: a peer that kept a
                # stale Established session (we restarted without graceful restart) answers
                # each of our OPENs so until its hold timer expires -- never, at hold time 0.
                self._events.append(PeerCollisionClosed(ev.reason))
            elif s is self.session:
                self._events.append(PeerFailed(ev.reason))
                if not ev.sent and (note.code, note.subcode) == COLLISION_CEASE:
                    # Still, the peer did not misbehave: it keeps (or believes it keeps) another
                    # session with us.  Like BIRD, which grows its error delay only for a
                    # received NOTIFICATION that is no Cease (bgp_rx_notification), and GoBGP,
                    # whose IdleHoldTime does not grow at all, the restart waits the current
                    # delay without doubling it: the stale session goes when the peer's hold
                    # timer expires, and the reconnect then should not be minutes away.
                    self._collision_ended = True
            if ev.was_established and s is self._up:
                # (A session that reached Established only to lose a collision was never up.)
                self._up = None
                self.since = now
                if now - self._up_at >= self.local.backoff_max:
                    # RFC 4271 §8.1.1 DampPeerOscillations: only a session that stayed up at
                    # least as long as the longest wait between attempts starts the backoff
                    # over.  One that ended sooner (a NOTIFICATION answering our first UPDATE,
                    # an FSM error, a peer that keeps resetting us) is a failure like any, so
                    # that the peer's routes are not installed and withdrawn across the
                    # cluster once a second for ever: in the long run no peer costs more
                    # than one PeerUp and PeerDown per backoff_max.  (BIRD forgets its error
                    # wait after error_forget_time, 300 s, without errors.)
                    self._failures = 0
                gr = s.negotiated.peer_graceful_restart if s.negotiated else None
                graceful = ev.graceful and gr is not None and self.local.graceful_restart
                # Refusing its connections meanwhile, too, is for a peer that ends its sessions
                # (or gets them ended) right after they come up.  One that restarts gracefully
                # (RFC 4724: we keep its routes as stale) is let back at once, or its routes
                # would wait for the delay; so is one that closed it with a deliberate Cease
                # (DELIBERATE_CEASES: BIRD grows its error wait for no received Cease either).
                # Its session still counts as a failure for our own reconnects.
                deliberate = note is not None and not ev.sent and (note.code, note.subcode) in DELIBERATE_CEASES
                self._ended_early = now - self._up_at < self.local.backoff_max and not graceful and not deliberate
                self._events.append(PeerDown(ev.reason, graceful, gr))

    def _resolve_collision(self, s: Session, ev: OpenReceived, now: float) -> None:
        """RFC 4271 §6.8, run when ``s`` has just received the peer's OPEN.

        The check runs on the queued OpenReceived, after the whole read: by then ``s`` may have
        ended already (its OPEN and a NOTIFICATION or a bad message came together).  Only live
        connections take part: a dead one is neither dumped (no transition from Idle) nor wins
        (the good connection must not be closed for it)."""
        if not self._alive(s):
            return
        for other in self.sessions():
            if other is s or not self._alive(other):
                continue
            if other.state is State.ESTABLISHED:
                if self._graceful_agreed(other):
                    # RFC 4724 §4.2: a new connection from a peer that advertised graceful
                    # restart on the session we believe is Established (and we did too) means
                    # the peer restarted and the old session is gone: it goes, its routes stay
                    # stale.  As BIRD (bgp_incoming_connection: the restart path when
                    # graceful restart was agreed on the Established session, p->gr_ready),
                    # the new OPEN's Restart State bit is not asked for: a peer that rebooted
                    # with no routes to keep (ours: none adopted; a helper-only one) sends
                    # R=0, and refused it would stay cut off until our hold timer expires.
                    # Without GR agreed, it is a plain collision with an Established session
                    # (RFC 4271 §6.8): the new connection goes -- the old session's end would
                    # withdraw all its routes.
                    old_conn = other.conn
                    other.connection_lost(old_conn, now)
                    # Its SessionDown now, before anything of the new session: with the peer's
                    # first KEEPALIVE in this read, the new one is Established next, and the old
                    # one's end would then come after it and not count (no PeerDown: the routes
                    # would not be marked stale, nor flushed by the End-of-RIB).
                    ev = other.next_event()
                    while ev is not None:
                        self._on_session_event(other, ev, now)
                        ev = other.next_event()
                    self._actions.append(Close(old_conn))
                    self._promote(s)
                else:
                    s.collision_dump(now)
                return
            if other.state is State.OPEN_CONFIRM:
                # Keep the connection opened by the speaker with the higher BGP Identifier; equal
                # ones (legal between ASes, RFC 6286 §2.2): the one with the larger AS number.
                if (int(self.local.router_id), self.local.asn) < (int(ev.open.router_id), ev.open.asn):
                    loser = s if s.outbound else other  # close the one we initiated
                else:
                    loser = other if not other.outbound else s  # close the one they initiated
                loser.collision_dump(now)
                if loser is self.session:
                    self._promote(s)
                return

    def _another_open(self, s: Session) -> bool:
        """Another session than ``s`` has its connection and has sent or received an OPEN."""
        return any(
            o is not s and o.conn is not None and o.state in (State.OPEN_SENT, State.OPEN_CONFIRM, State.ESTABLISHED)
            for o in self.sessions()
        )

    def _graceful_agreed(self, s: Session) -> bool:
        """Graceful restart was agreed both ways on ``s``: we offer it and the peer's OPEN on
        ``s`` carried the capability (as PeerDown's ``graceful`` reads it)."""
        neg = s.negotiated
        return self.local.graceful_restart and neg is not None and neg.peer_graceful_restart is not None

    @staticmethod
    def _alive(s: Session) -> bool:
        """``s`` still has its connection and has received the peer's OPEN."""
        return s.conn is not None and s.state in (State.OPEN_CONFIRM, State.ESTABLISHED)

    def _promote(self, s: Session) -> None:
        if s is self.session:
            return
        self.collisions.remove(s)
        self.collisions.append(self.session)
        self.session = s

    def _backoff(self, *, grow: bool = True) -> float:
        delay = min(self.local.backoff_max, self.local.backoff_initial * (2**self._failures))
        if grow:
            self._failures = min(self._failures + 1, 16)
        return delay * (0.75 + 0.25 * self._rng.random())

