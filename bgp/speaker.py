"""The BGP speaker, sans-IO: peers + RIB + origination + update groups, driven by its caller.

The transport (bgp.transport) feeds connection events, bytes, socket back-pressure and
the time, carries out the :class:`~bgp.session.Connect` / ``Send`` / ``Close`` actions it
collects from :meth:`Speaker.take_actions`, and calls :meth:`Speaker.work` while
:meth:`Speaker.has_work` says output is waiting.  The agent configures peers and the
prefixes to originate as *desired state* (``set_peers``, ``set_originated``), says once its
peer set is whole (``peers_configured``: a restart's selection deferral waits for that), and
subscribes to Loc-RIB best-path changes (``add_listener``).

Everything a peer should have is computed, not remembered as instructions: after each
batch of input the speaker takes the Loc-RIB changes and hands them to its output side
(bgp.output: update groups, bgp.export), which exports each changed prefix once per kind of
peer and logs the encoded difference; each Established peer is then given what it has not
read yet, as far as its socket takes it.  The speaker itself is the peers' switchboard:
configuration, connections (listen ranges: bgp.dynamic), timers, and handing each session's
events to bgp.channels, which says what they mean for the RIB (import: bgp.importer,
graceful restart: bgp.graceful, route refresh: bgp.refresh).

Peers are kept apart by construction: whatever goes wrong while handling one peer — a
malformed message, a route that cannot be exported to it, a bug — ends that peer's
session with a NOTIFICATION and touches nothing else (:meth:`Speaker._isolated`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address

from proto.attributes import AsPath, Origin, PathAttributes
from proto.errors import CeaseSubcode, ErrorCode
from proto.messages import Notification

from .channels import Channels
from .dynamic import DynamicPeers
from .fsm import State
from .graceful import GracefulRestarts
from .loglimit import LogLimiter
from .negotiation import Negotiated
from .output import SEND_KEY, TURN_BUDGET, Output
from .peer import (
    Admission,
    Peer,
    PeerCollisionClosed,
    PeerDown,
    PeerEvent,
    PeerFailed,
    PeerRouteRefresh,
    PeerUp,
    PeerUpdate,
)
from .refresh import RefreshPacer
from .rib import BestPathChange, Rib, Source
from .session import Action, Close, Connect
from .settings import Family, ListenRange, LocalSettings, PeerSettings, RestartState
from .timers import TimerHeap

log = logging.getLogger("bgp.speaker")

Address = IPv4Address | IPv6Address
Listener = Callable[[list[BestPathChange]], None]

LOCAL_KEY = "local"
DEFAULT_ORIGIN_ATTRIBUTES = PathAttributes((Origin(0), AsPath(())))
_MISSING = object()

DEFERRAL_KEY = "\0deferral"  # the timer of RFC 4724 §4.1 (no peer key starts with NUL)

# BFD-caused resets are damped (BIRD: bgp_update_startup_delay() from bgp_bfd_notify(), its
# error wait time of 60 s doubling to 300 s, forgotten after 300 s without an error): a link
# that passes TCP but loses BFD would otherwise reset the peer about once a second, withdrawing
# and re-announcing its routes cluster-wide each time.  The first BFD reset after a quiet
# period costs only the usual backoff (a neighbour that went and came back is back at once, as
# before); each further one within BFD_QUIET seconds of the last one's hold-down ending holds
# the peer down (no connection either way) for BFD_HOLD_INITIAL, doubling up to BFD_HOLD_MAX.
# Listen-range clients' kept damping (Speaker._dynamic_damping) is swept of lapsed entries
# once it holds this many, then whenever it has doubled since.
DAMPING_PRUNE_MIN = 256

BFD_HOLD_INITIAL = 60.0
BFD_HOLD_MAX = 300.0
BFD_QUIET = 300.0


@dataclass(frozen=True)
class Origination:
    """A prefix this speaker announces itself (``network`` in BIRD, ``global rib add`` in GoBGP)."""

    family: Family
    prefix: bytes
    attributes: PathAttributes = DEFAULT_ORIGIN_ATTRIBUTES
    next_hop: Address | None = None  # None: our own address on each session


class Speaker:
    def __init__(self, local: LocalSettings, *, now: float, rng: random.Random | None = None) -> None:
        self.local = local
        self.rib = Rib()
        self.peers: dict[str, Peer] = {}
        self.started = False
        self._rng = rng or random.Random()
        self._conn_ids = itertools.count(1)
        self._conn_owner: dict[int, Peer] = {}
        self._orphan_actions: list[Action] = []
        self._local_source = Source(
            LOCAL_KEY, None, local.asn, local.asn, local.router_id, ibgp=True, local=True
        )
        self.rib.attach(self._local_source)
        self._origins: dict[tuple[Family, bytes], Origination] = {}
        self._listeners: list[Listener] = []
        # Peers called since the last take_actions (only they can have actions): dicts keep order.
        self._touched: dict[int, Peer] = {}
        self.dynamic = DynamicPeers()  # listen ranges, and the peers accepted from one
        #: Goes up whenever a peer is added or removed (dynamic ones included) or its ``bfd``
        #: setting changes: the transport keeps its BFD sessions in step with it.
        self.peers_version = 0
        self._timers = TimerHeap()
        # Configured peers keep their problems' keys; outsiders' (refused addresses) are bounded.
        self.limiter = LogLimiter(log, pinned=lambda subject: subject in self.peers)
        #: Totals for metrics: "internal errors", "route refreshes deferred", "max-prefix resets", ...
        self.counters: Counter[str] = Counter()
        # Peer key -> (the hold-down its last BFD reset got, when that hold-down ended): see
        # BFD_HOLD_INITIAL.  Kept by address, so it outlives a listen-range client's Peer.
        self._bfd_damping: dict[str, tuple[float, float]] = {}
        # Listen-range client address -> what its next Peer takes over from its last one
        # (Peer.carried: until when it is refused, its failures, why) and the settings its range
        # gave it: a client's Peer goes with its session, and its damping (RFC 4271 §8.1.1
        # DampPeerOscillations) would go with it.  An entry lasts backoff_max past its hold-down
        # (as long as a session must stay up to start the backoff over); one of a client whose
        # range is gone or changed, or that became a configured peer, goes at once.
        self._dynamic_damping: dict[str, tuple[tuple[float, int, str], PeerSettings]] = {}
        self._damping_prune_at = DAMPING_PRUNE_MIN
        self.graceful = GracefulRestarts(self.rib, self._timers, local.stale_time)
        self.output = Output(
            local, self.rib, self.peers, self._timers, self.limiter, self.counters, sent=self._sent, reset=self._reset
        )
        self.channels = Channels(local, self.rib, self._timers, self.limiter, self.counters, self.graceful, self.output)
        self.now = now
        # RFC 4724 §4.1: back from a restart (``local.restarting``), route selection -- here,
        # the End-of-RIB that tells a peer our table is whole -- is deferred until every
        # graceful-restart peer has sent its End-of-RIB, or restart_time has passed.  A route
        # reflector that sent a returning client its partial table and End-of-RIB at once would
        # have it flush the routes of every client that is not back yet.
        self.deferring = bool(local.restarting and local.graceful_restart)
        self.output.hold_eor = self.deferring
        # The R bit of our OPENs (RFC 4724 §3): set while the restart is under way, cleared
        # when the deferral ends (End-of-RIB to every peer: the restart is complete, §4.1).
        self.restart = RestartState(self.deferring)
        self._deferral_changed = True  # a peer came, went or sent End-of-RIB since the last look
        #: The owner has said its configured peer set is known (:meth:`peers_configured`).
        #: Until then "every peer sent End-of-RIB" cannot end the deferral: an agent learns its
        #: peers from etcd after the speaker started, and with none configured yet there would
        #: be nobody to wait for -- only restart_time ends it.
        self.peers_known = False

    # ------------------------------------------------------------ configuration (desired state)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(changes)`` after every batch that changed Loc-RIB best paths."""
        self._listeners.append(listener)

    def start(self, now: float) -> None:
        self.now = now
        self.started = True
        if self.deferring:
            self._timers.set(DEFERRAL_KEY, now + self.local.restart_time)
        for peer in list(self.peers.values()):
            with self._isolated(peer, now, "starting the session"):
                peer.start(now)
            self._drain(peer, now)
        self._flush(now)

    def stop(self, now: float, *, graceful: bool) -> None:
        """Stop every session.  ``graceful``: close TCP without a NOTIFICATION so GR peers keep
        our routes (RFC 4724); otherwise Cease/Administrative Shutdown and the peers withdraw them."""
        self.now = now
        note = None if graceful else Notification.cease(CeaseSubcode.ADMINISTRATIVE_SHUTDOWN, "agentd stopping")
        self.started = False
        for peer in list(self.peers.values()):
            peer.stop(now, note)
            self._drain(peer, now)
        self._flush(now)

    def set_peers(self, peers: Iterable[PeerSettings], now: float) -> None:
        """The configured peers (dynamic ones from listen ranges are left alone)."""
        wanted = {p.key: p for p in peers}
        for key in [k for k in self._dynamic_damping if k in wanted]:
            del self._dynamic_damping[key]  # a configured peer now: its own damping from here on
        for key in [k for k in self.peers if k not in wanted and k not in self.dynamic]:
            self.remove_peer(key, now)
        for key, settings in wanted.items():
            cur = self.peers.get(key)
            if cur is not None and cur.settings == settings and key not in self.dynamic:
                self._retune(cur, settings)  # (description, bfd and tags are not compared: no restart)
                continue
            if cur is not None:
                self.remove_peer(key, now, CeaseSubcode.OTHER_CONFIGURATION_CHANGE)
            self.add_peer(settings, now)

    def peers_configured(self, now: float) -> None:
        """The owner's word that its configured peers are all added (the agent after its first
        read of the node registry, ``agentd speaker`` after those of its configuration): from
        now on a selection deferral (RFC 4724 §4.1) also ends once every peer it waits for has
        sent End-of-RIB (:meth:`deferral_pending`), not by restart_time alone.  Idempotent."""
        self.now = now
        if self.peers_known:
            return
        self.peers_known = True
        self._deferral_changed = True
        self._flush(now)

    def set_listen_ranges(self, ranges: Iterable[ListenRange], now: float) -> None:
        """Accept peers from these prefixes without configuring each (most specific first).
        Dynamic peers whose range is gone or changed are reset."""
        for key in self.dynamic.set_ranges(ranges, self.peers.get):
            self.remove_peer(key, now, CeaseSubcode.OTHER_CONFIGURATION_CHANGE)
        for key in [k for k, (_, kept_with) in self._dynamic_damping.items() if self.dynamic.settings_for(k) != kept_with]:
            del self._dynamic_damping[key]  # its range gone or changed: a fresh start, as a reconfigured peer's
        for key in list(self.dynamic):
            wanted = self.dynamic.settings_for(key)
            if wanted is not None and key in self.peers:
                self._retune(self.peers[key], wanted)

    def _retune(self, peer: Peer, settings: PeerSettings) -> None:
        """New ``settings`` for ``peer`` that differ only in fields whose change needs no new
        BGP session (``description``, ``bfd``, ``tags``): taken over in place.  A change of ``bfd`` moves
        :attr:`peers_version`, so the transport adds, removes or re-tunes the BFD session."""
        if settings is peer.settings:
            return
        if settings.bfd != peer.settings.bfd:
            self.peers_version += 1
        peer.settings = settings
        for session in peer.sessions():
            session.peer = settings  # (equal in everything a session uses)

    @property
    def listen_ranges(self) -> list[ListenRange]:
        return self.dynamic.ranges

    def add_peer(self, settings: PeerSettings, now: float) -> Peer:
        if settings.key in self.peers:
            raise ValueError(f"peer {settings.key} already configured")
        peer = Peer(self.local, settings, conn_ids=self._conn_ids, now=now, rng=self._rng, restart=self.restart)
        self.peers[settings.key] = peer
        self.peers_version += 1
        self.limiter.keep(settings.key)  # added back (a reconfiguration): its counts are a peer's again
        if self.started:
            with self._isolated(peer, now, "starting the session"):
                peer.start(now)
            self._drain(peer, now)
            self._flush(now)
        return peer

    def remove_peer(self, key: str, now: float, subcode: int = CeaseSubcode.PEER_DECONFIGURED) -> None:
        peer = self.peers.get(key)
        if peer is None:
            return
        self.dynamic.discard(key)
        state = peer.state
        note = Notification.cease(subcode)
        peer.stop(now, note)
        if self.started and State.OPEN_SENT <= state < State.ESTABLISHED:
            # The removal, not a failed session (the Cease is ours); an Established one's end is
            # logged as it goes down (Channels.down), one without a BGP connection is not.
            log.info("peer %s removed in %s: sent %s", key, state.label, note)
        self._drain(peer, now)
        self._orphan_actions.extend(peer.take_actions())
        del self.peers[key]
        self.peers_version += 1
        for conn in [c for c, p in self._conn_owner.items() if p is peer]:
            del self._conn_owner[conn]
        self.channels.forget(key)
        self.rib.drop(key)
        self._deferral_changed = True  # one fewer peer to wait for
        self.graceful.forget(key)
        self._timers.set(key, None)
        self.limiter.forget(key, now)
        self._flush(now)

    def set_originated(self, origins: Iterable[Origination], now: float) -> None:
        """The exact set of prefixes this speaker originates."""
        wanted = {(o.family, o.prefix): o for o in origins}
        adj = self.rib.adj_in[LOCAL_KEY]
        for (family, prefix), o in self._origins.items():
            if (family, prefix) not in wanted:
                self.rib.withdraw(LOCAL_KEY, family, [prefix])
        for (family, prefix), o in wanted.items():
            if self._origins.get((family, prefix)) != o:
                self.rib.announce(LOCAL_KEY, family, [prefix], adj.path(o.attributes, o.next_hop))
        self._origins = wanted
        self._flush(now)

    def peer_settings(self, remote: str) -> PeerSettings | None:
        """The configuration of the peer at ``remote``, configured or from a listen range (the
        transport's GTSM check needs it)."""
        key = _normalize(remote)
        peer = self.peers.get(key)
        if peer is not None:
            return peer.settings
        return self.dynamic.settings_for(key)

    # ------------------------------------------------------------ transport inputs

    def accept(self, conn: int, remote: str, now: float, local_address: str | None = None) -> Admission:
        """An inbound connection from ``remote``; a false answer means close it, and its
        ``reason`` says why (for the transport's log line)."""
        self.now = now
        key = _normalize(remote)
        peer = self.peers.get(key)
        if peer is None and self.started:
            settings = self.dynamic.settings_for(key)
            if settings is not None:
                carried = self._carried(key, settings, now)
                if carried is not None and now < carried[0]:
                    # RFC 4271 §8.1.1 DampPeerOscillations, as for a configured peer (Peer.accept):
                    # a client whose session ended right after it came up does not come back
                    # at once, however fast it reconnects (its Peer went with the session).
                    return Admission(False, f"{carried[2]}: held down for {carried[0] - now:.0f}s more")
                peer = self.add_peer(settings, now)
                self.dynamic.add(key)
                self._dynamic_damping.pop(key, None)
                if carried is not None:
                    peer.resume_damping(carried[1])
        if peer is None:
            if not self.started and self.dynamic.settings_for(key) is not None:
                return Admission(False, "the speaker is not running")
            return Admission(False, "not a configured peer" + (" nor in a listen range" if self.dynamic.ranges else ""))
        admission = peer.accept(conn, now, local_address)
        if not admission:
            if key in self.dynamic:
                self._forget_dynamic(peer, now)
            return admission
        if admission.displaced:
            self.counters["silent connections displaced"] += 1
            self.limiter.log(
                logging.INFO, "displaced", key, now,
                "peer %s: a new connection takes the place of %s (closed with Cease/Connection Collision Resolution)",
                key, admission.displaced,
            )  # fmt: skip
        self._conn_owner[conn] = peer
        self._after(peer, now)
        return admission

    def connection_made(self, conn: int, now: float, local_address: str | None = None) -> None:
        self.now = now
        peer = self._conn_owner.get(conn)
        if peer is None:
            self._orphan_actions.append(Close(conn))
            return
        with self._isolated(peer, now, "starting the connection"):
            peer.connection_made(conn, now, local_address)
        self._after(peer, now)

    def connect_failed(self, conn: int, now: float) -> None:
        self.now = now
        peer = self._conn_owner.pop(conn, None)
        if peer is not None:
            with self._isolated(peer, now, "a failed connection"):
                peer.connect_failed(conn, now)
            self._after(peer, now)

    def connection_lost(self, conn: int, now: float) -> None:
        self.now = now
        peer = self._conn_owner.pop(conn, None)
        if peer is not None:
            with self._isolated(peer, now, "a lost connection"):
                peer.connection_lost(conn, now)
            self._after(peer, now)

    def data_received(self, conn: int, data: bytes, now: float) -> None:
        self.now = now
        peer = self._conn_owner.get(conn)
        if peer is None:
            return
        with self._isolated(peer, now, "its messages"):
            peer.data_received(conn, data, now)
        self._after(peer, now)

    def set_writable(self, conn: int, writable: bool, now: float) -> None:
        """The connection's socket buffer went over (False) or back under (True) its limit."""
        self.now = now
        peer = self._conn_owner.get(conn)
        if peer is None:
            return
        peer.set_writable(conn, writable, now)
        self._schedule(peer)
        if writable:
            self.output.pump(peer, TURN_BUDGET, now)

    def bfd_down(self, remote: str, why: str, now: float) -> None:
        """BFD says the path to ``remote`` failed: end its session at once with Cease/BFD Down
        (RFC 9384) instead of waiting for the hold timer; it is tried again after the usual
        backoff, or, when BFD reset it before and it has not been quiet since, after a
        hold-down that grows with each such reset (see :data:`BFD_HOLD_INITIAL`)."""
        self.now = now
        peer = self.peers.get(_normalize(remote))
        if peer is None or peer.state < State.OPEN_SENT:
            return
        self.counters["bfd resets"] += 1
        hold = self._bfd_hold(peer.key, now)
        if hold:
            self.counters["bfd hold-downs"] += 1
            log.warning("peer %s: BFD down (%s): resetting the session, held down for %gs "
                        "(BFD reset it less than %gs before)", peer.key, why, hold, BFD_QUIET)
        else:
            log.warning("peer %s: BFD down (%s): resetting the session", peer.key, why)
        peer.shutdown(now, Notification(ErrorCode.CEASE, CeaseSubcode.BFD_DOWN), f"BFD down: {why}", hold=hold)
        self._after(peer, now)

    def _bfd_hold(self, key: str, now: float) -> float:
        """The hold-down for a BFD reset of ``key`` now, remembered for the next one."""
        for k, (_, ended) in list(self._bfd_damping.items()):
            if now - ended >= BFD_QUIET:
                del self._bfd_damping[k]  # quiet long enough: forgotten
        last = self._bfd_damping.get(key)
        if last is None:
            hold = 0.0
        else:
            hold = min(BFD_HOLD_MAX, 2 * last[0]) if last[0] else BFD_HOLD_INITIAL
        self._bfd_damping[key] = (hold, now + hold)
        return hold

    def get_timer(self) -> float | None:
        due = [t for t in (self._timers.next(), self.limiter.next_flush()) if t is not None]
        return min(due) if due else None

    def handle_timer(self, now: float) -> None:
        self.now = now
        self.limiter.expire(now)  # outsiders' problem counts not seen for an hour go
        self.limiter.flush(now)  # a burst of log lines held back that nothing followed: its count
        for key in self._timers.pop_due(now):
            if (gr := GracefulRestarts.peer_of(key)) is not None:
                self.graceful.timer(gr, now)
                peer = self.peers.get(gr)
                if peer is not None and gr in self.dynamic:
                    self._forget_dynamic(peer, now)
            elif RefreshPacer.is_timer(key):
                self.channels.refreshes_due(now)
            elif key == SEND_KEY:
                self.output.send_window(now)
            elif key == DEFERRAL_KEY:
                self._end_deferral(now, "its time ran out")
            else:
                peer = self.peers.get(key)
                if peer is None:
                    continue
                t = peer.get_timer()
                if t is not None and now >= t:
                    with self._isolated(peer, now, "its timers"):
                        peer.handle_timer(now)
                    self._drain(peer, now)
                    if key in self.dynamic:
                        self._forget_dynamic(peer, now)
                self._schedule(peer)
        self._flush(now)

    def take_actions(self) -> list[Action]:
        actions, self._orphan_actions = self._orphan_actions, []
        touched, self._touched = self._touched, {}
        for peer in touched.values():
            if self.peers.get(peer.key) is not peer:
                continue  # removed since: remove_peer took its last actions
            for a in peer.take_actions():
                if isinstance(a, Connect):
                    self._conn_owner[a.conn] = peer
                actions.append(a)
        for a in actions:
            if isinstance(a, Close):
                # The transport drops the connection and never reports it back.
                self._conn_owner.pop(a.conn, None)
        return actions

    def has_work(self) -> bool:
        """Output is owed to a peer whose socket has room, or a new group is being computed."""
        return self.output.has_work()

    def work(self, now: float, budget: int = 4 * TURN_BUDGET) -> bool:
        """One turn of the output still owed (see :meth:`bgp.output.Output.work`); returns
        whether more is owed."""
        self.now = now
        return self.output.work(now, budget)

    # ------------------------------------------------------------ isolation

    @contextlib.contextmanager
    def _isolated(self, peer: Peer, now: float, what: str) -> Iterator[None]:
        """Whatever fails while handling ``peer`` ends that peer's session, nothing else."""
        try:
            yield
        except Exception as err:
            self._internal_error(peer, now, what, err)

    def _internal_error(self, peer: Peer, now: float, what: str, err: Exception) -> None:
        self.counters["internal errors"] += 1
        self.limiter.log(
            logging.ERROR, "internal-error", peer.key, now,
            "peer %s: internal error while handling %s: %r; resetting its session only",
            peer.key, what, err, exc_info=True,
        )  # fmt: skip
        self._reset(peer, now, f"internal error while handling {what}")

    def _reset(self, peer: Peer, now: float, reason: str) -> None:
        try:
            peer.shutdown(now, Notification.cease(CeaseSubcode.ADMINISTRATIVE_RESET, reason[:200]), reason)
        except Exception:
            # The peer object itself is broken: replace it with a fresh one (same settings) --
            # a listen range's client is only forgotten: its next connection makes it again.
            dynamic = peer.key in self.dynamic
            log.exception("peer %s could not be reset; %s", peer.key, "forgetting it" if dynamic else "recreating it")
            self._orphan_actions.extend(Close(s.conn) for s in peer.sessions() if s.conn is not None)
            self.remove_peer(peer.key, now)
            if not dynamic:
                self.add_peer(peer.settings, now)
            return
        self._drain(peer, now)

    # ------------------------------------------------------------ peer events

    def _after(self, peer: Peer, now: float) -> None:
        self._drain(peer, now)
        if peer.key in self.dynamic:
            self._forget_dynamic(peer, now)
        self._flush(now)

    def _forget_dynamic(self, peer: Peer, now: float) -> None:
        """A peer from a listen range goes with its last connection (its routes stay, stale,
        while graceful restart keeps them; then it goes too)."""
        key = peer.key
        if self.peers.get(key) is peer and self.dynamic.finished(peer, key in self.graceful):
            carried = peer.carried(now)
            if carried is not None:
                self._dynamic_damping[key] = (carried, peer.settings)
                if len(self._dynamic_damping) >= self._damping_prune_at:
                    # The lapsed ones go, at a cost spread over as many forgets as are left.
                    for k in [k for k in self._dynamic_damping if self._carried(k, None, now) is None]:
                        del self._dynamic_damping[k]
                    self._damping_prune_at = max(DAMPING_PRUNE_MIN, 2 * len(self._dynamic_damping))
            self.remove_peer(key, now)

    def _carried(self, key: str, settings: PeerSettings | None, now: float) -> tuple[float, int, str] | None:
        """What a listen-range client at ``key`` takes over from its last Peer (see
        ``_dynamic_damping``), if anything is still kept for it: nothing once its entry lapsed,
        nor when ``settings`` (its range's now) differ from those it was kept with."""
        entry = self._dynamic_damping.get(key)
        if entry is None:
            return None
        carried, kept_with = entry
        if carried[0] + self.local.backoff_max <= now or (settings is not None and settings != kept_with):
            return None
        return carried

    def _drain(self, peer: Peer, now: float) -> None:
        self._touched[id(peer)] = peer
        ev = peer.next_event()
        while ev is not None:
            # What _isolated does, without a context manager per event (one per UPDATE).
            try:
                self._on_peer_event(peer, ev, now)
            except Exception as err:
                self._internal_error(peer, now, type(ev).__name__, err)
            ev = peer.next_event()
        self._schedule(peer)

    def _sent(self, peer: Peer) -> None:
        """The output side gave ``peer`` messages: its actions and timers changed."""
        self._touched[id(peer)] = peer
        self._schedule(peer)

    def _schedule(self, peer: Peer) -> None:
        if self.peers.get(peer.key) is peer:
            self._timers.set(peer.key, peer.get_timer())

    def _on_peer_event(self, peer: Peer, ev: PeerEvent, now: float) -> None:
        if self.deferring and (not isinstance(ev, PeerUpdate) or ev.update.end_of_rib is not None):
            self._deferral_changed = True  # looked at once per batch, not per UPDATE (_flush)
        if isinstance(ev, PeerUpdate):
            self.channels.receive(peer, ev.update, now)
        elif isinstance(ev, PeerUp):
            self.channels.up(peer, ev, now)
        elif isinstance(ev, PeerDown):
            self.channels.down(peer, ev, now, quiet=not self.started)
        elif isinstance(ev, PeerRouteRefresh):
            self.channels.route_refresh(peer, (ev.afi, ev.safi), now)
        elif isinstance(ev, PeerFailed):
            self.limiter.log(logging.WARNING, "session-failed", peer.key, now, "peer %s: %s", peer.key, ev.reason)
        elif isinstance(ev, PeerCollisionClosed):
            # RFC 4271 §6.8 decided on the peer's side; our own decisions are not logged either.
            log.debug("peer %s: it closed one of two connections (connection collision, RFC 4271 §6.8): %s",
                      peer.key, ev.reason)

    # ------------------------------------------------------------ export

    def deferral_pending(self) -> list[str]:
        """While route selection is deferred: the peers it waits for -- every configured,
        enabled peer that is not Established yet, and every Established one (configured or
        from a listen range) that offered graceful restart without the Restart State bit and
        has not sent End-of-RIB for all its families (RFC 4724 §4.1: those without graceful
        restart, and those restarting too, are not waited for).  The peers of a listen range
        that are not back yet cannot be known -- which were there before the restart, which
        will come back -- so while there are listen ranges each is listed too (as its prefix),
        and only restart_time ends the deferral.  Until :meth:`peers_configured` the deferral
        waits for restart_time whatever this says."""
        syncing = set(self.channels.sync_pending())
        out = []
        for key, peer in self.peers.items():
            if not peer.enabled:
                continue
            if peer.state is not State.ESTABLISHED:
                if key not in self.dynamic:
                    out.append(key)
                continue
            neg = self.channels.negotiated(key)
            gr = neg.peer_graceful_restart if neg is not None else None
            if gr is not None and not gr.restart_state and key in syncing:
                out.append(key)
        out.extend(str(r.prefix) for r in self.dynamic.ranges)
        return out

    def _end_deferral(self, now: float, why: str) -> None:
        self.deferring = False
        # The restart is complete: later OPENs no longer say we have just restarted (a peer
        # that restarts later must wait for our End-of-RIB in its own deferral, RFC 4724 §4.1).
        self.restart.restarting = False
        self._timers.set(DEFERRAL_KEY, None)
        log.info("route selection no longer deferred (%s): End-of-RIB to every peer", why)
        self.output.release_eor(now)

    def _flush(self, now: float) -> None:
        """Hand this batch's Loc-RIB changes to the listeners and to the output side."""
        if self.deferring and self.started and self.peers_known and self._deferral_changed:
            self._deferral_changed = False
            if not self.deferral_pending():
                self._end_deferral(now, "every peer sent End-of-RIB")
        if not self.rib.has_changes():
            return
        batch = self.rib.take_batch()
        if self._listeners:
            changes = self.rib.changes_of(batch)
            if changes:
                for listener in self._listeners:
                    try:
                        listener(changes)
                    except Exception:
                        self.counters["internal errors"] += 1
                        log.exception("a Loc-RIB listener failed")
        self.output.flush(batch, now)

    # ------------------------------------------------------------ introspection

    def initial_sync_pending(self) -> list[str]:
        """Established peers that have not yet sent End-of-RIB for every family (RFC 4724 §4.1)."""
        return self.channels.sync_pending()

    def adj_out_count(self, key: str) -> int:
        return self.output.sent_count(key)

    def negotiated(self, key: str) -> Negotiated | None:
        return self.channels.negotiated(key)

    def in_sync(self, key: str) -> bool:
        return self.output.in_sync(key)


def _normalize(address: str) -> str:
    a = ip_address(address.split("%", 1)[0])
    if isinstance(a, IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    return str(a)
