"""The BGP speaker, sans-IO: peers + RIB + origination + update groups, driven by its caller.

The transport (bgp.transport) feeds connection events, bytes, socket back-pressure and
the time, carries out the :class:`~bgp.session.Connect` / ``Send`` / ``Close`` actions it
collects from :meth:`Speaker.take_actions`, and calls :meth:`Speaker.work` while
:meth:`Speaker.has_work` says output is waiting.  The agent configures peers and the
prefixes to originate as *desired state* (``set_peers``, ``set_originated``) and subscribes
to Loc-RIB best-path changes (``add_listener``).

Everything a peer should have is computed, not remembered as instructions: after each
batch of input the speaker takes the Loc-RIB changes and hands them to the update groups
(bgp.export), which export each changed prefix once per kind of peer and log the encoded
difference; each Established peer is then given what it has not read yet, as far as its
socket takes it.

Peers are kept apart by construction: whatever goes wrong while handling one peer — a
malformed message, a route that cannot be exported to it, a bug — ends that peer's
session with a NOTIFICATION and touches nothing else (:meth:`Speaker._isolated`).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address, ip_address

from proto.attributes import AsPath, Origin, PathAttributes
from proto.errors import CeaseSubcode, ErrorCode
from proto.messages import Notification, Update
from proto.nlri import IPV4_UNICAST

from . import bestpath
from .export import GroupKey, UpdateGroup
from .fsm import State
from .loglimit import LogLimiter
from .peer import Peer, PeerDown, PeerEvent, PeerFailed, PeerRouteRefresh, PeerUp, PeerUpdate
from .policy import ExportTarget, Rejected, import_attributes
from .rib import BestPathChange, Path, Rib, Source
from .session import Action, Close, Connect, Negotiated
from .settings import Family, ListenRange, LocalSettings, PeerSettings

log = logging.getLogger("bgp.speaker")

Address = IPv4Address | IPv6Address
Listener = Callable[[list[BestPathChange]], None]

LOCAL_KEY = "local"
DEFAULT_ORIGIN_ATTRIBUTES = PathAttributes((Origin(0), AsPath(())))
_MISSING = object()
#: Octets of UPDATEs one peer is given per turn: enough to fill a socket buffer, small enough
#: that a large export leaves the loop to everything else between turns.
TURN_BUDGET = 256 * 1024
#: Prefixes of a new update group's first computation per turn.
BUILD_BUDGET = 4096
_GRACE_KEY = "\0graceful"
_REFRESH_KEY = "\0refresh"


@dataclass(frozen=True)
class Origination:
    """A prefix this speaker announces itself (``network`` in BIRD, ``global rib add`` in GoBGP)."""

    family: Family
    prefix: bytes
    attributes: PathAttributes = DEFAULT_ORIGIN_ATTRIBUTES
    next_hop: Address | None = None  # None: our own address on each session


@dataclass
class _GracefulState:
    """A peer whose routes we keep across its restart (RFC 4724 §4.2)."""

    restart_deadline: float | None  # the peer must be back by then
    stale_deadline: float | None = None  # and must have sent End-of-RIB by then
    families: set[Family] = field(default_factory=set)  # families still stale


@dataclass(frozen=True)
class PeerView:
    """One neighbour as the speaker sees it (the agent renders it as /peers JSON)."""

    address: str
    asn: int
    kind: str  # "ibgp", "ibgp rr-client", "ebgp"
    state: str
    since: float  # on the speaker's clock
    prefixes_received: int
    prefixes_sent: int
    stale: int
    router_id: str | None
    hold_time: int | None
    families: tuple[str, ...]
    graceful_restart: bool
    last_error: str
    flaps: int
    description: str
    in_sync: bool  # everything owed has been handed to the socket
    max_prefixes: int | None
    held_down: bool  # down after Cease/1 until its restart time or reconfiguration


@dataclass(frozen=True)
class RibPathView:
    """One candidate path of one prefix, ranked (the agent renders it as /rib JSON)."""

    family: Family
    prefix: bytes
    path: Path
    best: bool
    reason: bestpath.Reason | None  # why the best path won


class _Timers:
    """One heap of due times for every peer and speaker-wide deadline (lazy deletion: an
    entry counts only while it equals the owner's current due time)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._due: dict[str, float] = {}
        self._seq = itertools.count()

    def set(self, key: str, at: float | None) -> None:
        if at is None:
            self._due.pop(key, None)
            return
        if self._due.get(key) == at:
            return
        self._due[key] = at
        heapq.heappush(self._heap, (at, next(self._seq), key))

    def next(self) -> float | None:
        heap, due = self._heap, self._due
        while heap:
            at, _, key = heap[0]
            if due.get(key) == at:
                return at
            heapq.heappop(heap)
        return None

    def pop_due(self, now: float) -> list[str]:
        heap, due = self._heap, self._due
        out = []
        while heap and heap[0][0] <= now:
            at, _, key = heapq.heappop(heap)
            if due.get(key) == at:
                del due[key]
                out.append(key)
        return out


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
        self._sources: dict[str, Source] = {}
        self._negotiated: dict[str, Negotiated] = {}
        self._local_address: dict[str, Address | None] = {}
        self.groups: dict[GroupKey, UpdateGroup] = {}
        self._group_of: dict[str, UpdateGroup] = {}
        self._import_cache: dict[str, dict[PathAttributes, PathAttributes | Rejected]] = {}
        self._graceful: dict[str, _GracefulState] = {}
        self._eor_received: dict[str, set[Family]] = {}
        self._refresh_next: dict[tuple[str, Family], float] = {}  # earliest start of the next full re-send
        self._refresh_waiting: set[tuple[str, Family]] = set()
        self._prefix_warned: set[tuple[str, Family]] = set()
        self._listeners: list[Listener] = []
        self._owed: set[str] = set()  # peers with output waiting that their socket can take
        self._ranges: list[ListenRange] = []
        self.dynamic: set[str] = set()  # peers accepted from a listen range, gone with their session
        self._timers = _Timers()
        self.limiter = LogLimiter(log)
        #: Totals for metrics: "internal errors", "refreshes deferred", "max-prefix resets", ...
        self.counters: Counter[str] = Counter()
        self.now = now

    # ------------------------------------------------------------ configuration (desired state)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(changes)`` after every batch that changed Loc-RIB best paths."""
        self._listeners.append(listener)

    def start(self, now: float) -> None:
        self.now = now
        self.started = True
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
        for key in [k for k in self.peers if k not in wanted and k not in self.dynamic]:
            self.remove_peer(key, now)
        for key, settings in wanted.items():
            cur = self.peers.get(key)
            if cur is not None and cur.settings == settings and key not in self.dynamic:
                continue
            if cur is not None:
                self.remove_peer(key, now, CeaseSubcode.OTHER_CONFIGURATION_CHANGE)
            self.add_peer(settings, now)

    def set_listen_ranges(self, ranges: Iterable[ListenRange], now: float) -> None:
        """Accept peers from these prefixes without configuring each (most specific first).
        Dynamic peers whose range is gone or changed are reset."""
        self._ranges = sorted(ranges, key=lambda r: r.prefix.prefixlen, reverse=True)
        for key in list(self.dynamic):
            peer = self.peers.get(key)
            rng = self._range_for(key)
            if peer is None or rng is None or rng.settings_for(peer.settings.address) != peer.settings:
                self.remove_peer(key, now, CeaseSubcode.OTHER_CONFIGURATION_CHANGE)

    @property
    def listen_ranges(self) -> list[ListenRange]:
        return list(self._ranges)

    def _range_for(self, key: str) -> ListenRange | None:
        addr = ip_address(key)
        for r in self._ranges:
            if addr.version == r.prefix.version and addr in r.prefix:
                return r
        return None

    def add_peer(self, settings: PeerSettings, now: float) -> Peer:
        if settings.key in self.peers:
            raise ValueError(f"peer {settings.key} already configured")
        peer = Peer(self.local, settings, conn_ids=self._conn_ids, now=now, rng=self._rng)
        self.peers[settings.key] = peer
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
        peer.stop(now, Notification.cease(subcode))
        self._drain(peer, now)
        self._orphan_actions.extend(peer.take_actions())
        del self.peers[key]
        for conn in [c for c, p in self._conn_owner.items() if p is peer]:
            del self._conn_owner[conn]
        self._forget_peer(key)
        self.rib.drop(key)
        self._graceful.pop(key, None)
        self._timers.set(key, None)
        self._timers.set(_GRACE_KEY + key, None)
        self.limiter.forget(key)
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
        rng = self._range_for(key) if self._ranges else None
        return rng.settings_for(ip_address(key)) if rng is not None else None

    # ------------------------------------------------------------ transport inputs

    def accept(self, conn: int, remote: str, now: float, local_address: str | None = None) -> bool:
        """An inbound connection from ``remote``; False means close it (unknown or unwilling peer)."""
        self.now = now
        key = _normalize(remote)
        peer = self.peers.get(key)
        if peer is None and self._ranges and self.started:
            rng = self._range_for(key)
            if rng is not None:
                peer = self.add_peer(rng.settings_for(ip_address(key)), now)
                self.dynamic.add(key)
        if peer is None or not peer.accept(conn, now, local_address):
            if peer is not None and key in self.dynamic:
                self._forget_dynamic(peer, now)
            return False
        self._conn_owner[conn] = peer
        self._after(peer, now)
        return True

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
            self._pump(peer, TURN_BUDGET, now)

    def bfd_down(self, remote: str, why: str, now: float) -> None:
        """BFD says the path to ``remote`` failed: end its session at once with Cease/BFD Down
        (RFC 9384) instead of waiting for the hold timer; it is tried again after the usual
        backoff."""
        self.now = now
        peer = self.peers.get(_normalize(remote))
        if peer is None or peer.state < State.OPEN_SENT:
            return
        self.counters["bfd resets"] += 1
        log.warning("peer %s: BFD down (%s): resetting the session", peer.key, why)
        peer.shutdown(now, Notification(ErrorCode.CEASE, CeaseSubcode.BFD_DOWN), f"BFD down: {why}")
        self._after(peer, now)

    def get_timer(self) -> float | None:
        return self._timers.next()

    def handle_timer(self, now: float) -> None:
        self.now = now
        for key in self._timers.pop_due(now):
            if key.startswith(_GRACE_KEY):
                self._graceful_timer(key[len(_GRACE_KEY) :], now)
            elif key.startswith(_REFRESH_KEY):
                self._refresh_timer(now)
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
        for peer in self.peers.values():
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
        return bool(self._owed) or any(g.building for g in self.groups.values())

    def work(self, now: float, budget: int = 4 * TURN_BUDGET) -> bool:
        """One turn of the output still owed: each peer with room gets up to TURN_BUDGET octets
        (at most ``budget`` in all), new groups a step of their first computation.  Returns
        whether more is owed."""
        self.now = now
        for group in list(self.groups.values()):
            if group.building:
                self._build(group, now)
        spent = 0
        for key in list(self._owed):
            if spent >= budget:
                break
            peer = self.peers.get(key)
            if peer is None:
                self._owed.discard(key)
                continue
            spent += self._pump(peer, min(TURN_BUDGET, budget - spent), now)
        return self.has_work()

    def _build(self, group: UpdateGroup, now: float) -> None:
        try:
            group.build_step(self.rib.best, BUILD_BUDGET, now)
        except Exception:
            self._group_failed(group, now)
            return
        for key in list(group.members):
            peer = self.peers.get(key)
            if peer is not None:
                self._pump(peer, TURN_BUDGET, now)

    # ------------------------------------------------------------ isolation

    @contextlib.contextmanager
    def _isolated(self, peer: Peer, now: float, what: str) -> Iterator[None]:
        """Whatever fails while handling ``peer`` ends that peer's session, nothing else."""
        try:
            yield
        except Exception as err:
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
            # The peer object itself is broken: replace it with a fresh one (same settings).
            log.exception("peer %s could not be reset; recreating it", peer.key)
            self._orphan_actions.extend(Close(s.conn) for s in peer.sessions() if s.conn is not None)
            self.remove_peer(peer.key, now)
            self.add_peer(peer.settings, now)
            return
        self._drain(peer, now)

    def _group_failed(self, group: UpdateGroup, now: float) -> None:
        """An update group failed (a bug): reset its members, who start over in a new group."""
        self.counters["internal errors"] += 1
        log.exception("internal error in an update group of %d peers; resetting them", len(group.members))
        self.groups.pop(group.key, None)
        for key in list(group.members):
            self._group_of.pop(key, None)
            peer = self.peers.get(key)
            if peer is not None:
                self._reset(peer, now, "internal error while exporting")

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
        if self.peers.get(key) is peer and peer.state <= State.ACTIVE and key not in self._graceful and not any(
            s.conn is not None or s._pending_connect is not None for s in peer.sessions()
        ):
            self.remove_peer(key, now)

    def _drain(self, peer: Peer, now: float) -> None:
        ev = peer.next_event()
        while ev is not None:
            with self._isolated(peer, now, type(ev).__name__):
                self._on_peer_event(peer, ev, now)
            ev = peer.next_event()
        self._schedule(peer)

    def _schedule(self, peer: Peer) -> None:
        if self.peers.get(peer.key) is peer:
            self._timers.set(peer.key, peer.get_timer())

    def _on_peer_event(self, peer: Peer, ev: PeerEvent, now: float) -> None:
        if isinstance(ev, PeerUpdate):
            self._import(peer, ev.update, now)
        elif isinstance(ev, PeerUp):
            self._peer_up(peer, ev, now)
        elif isinstance(ev, PeerDown):
            self._peer_down(peer, ev, now)
        elif isinstance(ev, PeerRouteRefresh):
            self._route_refresh(peer, (ev.afi, ev.safi), now)
        elif isinstance(ev, PeerFailed):
            self.limiter.log(logging.WARNING, "session-failed", peer.key, now, "peer %s: %s", peer.key, ev.reason)

    def _peer_up(self, peer: Peer, ev: PeerUp, now: float) -> None:
        neg = ev.negotiated
        key = peer.key
        s = peer.settings
        source = Source(
            key, s.address, neg.peer_asn, self.local.asn, neg.peer_router_id, ibgp=neg.ibgp, rr_client=s.rr_client
        )
        self._sources[key] = source
        self.rib.attach(source)
        self._negotiated[key] = neg
        self._import_cache[key] = {}
        local_address = ip_address(ev.local_address) if ev.local_address else None
        self._local_address[key] = local_address
        self._eor_received[key] = set()
        gr = self._graceful.get(key)
        if gr is not None:
            # RFC 4724 §4.2: the peer is back.  Families it no longer preserves forwarding state for
            # are flushed now; the rest wait for its End-of-RIB (bounded by our stale timer).
            kept = {f for f, fwd in neg.peer_gr_families().items() if fwd}
            for family in list(gr.families):
                if family not in kept or family not in neg.families:
                    self.rib.purge_stale(key, family)
                    gr.families.discard(family)
            gr.restart_deadline = None
            gr.stale_deadline = now + self.local.stale_time
            if not gr.families:
                del self._graceful[key]
            self._schedule_graceful(key)
        log.info("peer %s established (AS %s, router id %s, hold %ss)", key, neg.peer_asn, neg.peer_router_id, neg.hold_time)
        target = ExportTarget(
            ibgp=neg.ibgp,
            rr_client=s.rr_client,
            local_address=local_address,
            next_hop_v6=self.local.next_hop_v6,
        )
        gkey = GroupKey(target, neg.families, neg.ctx)
        group = self.groups.get(gkey)
        if group is None:
            group = self.groups[gkey] = UpdateGroup(gkey, self.local, self.limiter)
            for family in sorted(neg.families):
                group.start_build(family, list(self.rib.loc.get(family, ())))
        group.join(key, neg.peer_router_id)
        self._group_of[key] = group
        if group.building and sum(len(c.prefixes) for c in group.building.values()) <= BUILD_BUDGET:
            self._build(group, now)  # small tables: at once, not a turn later
        self._pump(peer, TURN_BUDGET, now)

    def _peer_down(self, peer: Peer, ev: PeerDown, now: float) -> None:
        key = peer.key
        self._forget_peer(key)
        gr = ev.peer_graceful_restart
        if ev.graceful and gr is not None and gr.restart_time > 0:
            families = {(f.afi, f.safi) for f in gr.families}
            n = self.rib.mark_stale(key, families)
            self._graceful[key] = _GracefulState(now + gr.restart_time, None, families)
            self._schedule_graceful(key)
            if self.started:  # (when we are the one stopping, there is nothing to tell)
                log.info(
                    "peer %s down (%s): keeping %d routes as stale for %ss (graceful restart)",
                    key, ev.reason, n, gr.restart_time,
                )  # fmt: skip
        else:
            n = self.rib.drop(key)
            self._graceful.pop(key, None)
            self._schedule_graceful(key)
            log.info("peer %s down (%s): withdrew %d routes", key, ev.reason, n)

    def _forget_peer(self, key: str) -> None:
        self._owed.discard(key)
        group = self._group_of.pop(key, None)
        if group is not None:
            group.leave(key)
            if not group.members:
                self.groups.pop(group.key, None)
        self._negotiated.pop(key, None)
        self._local_address.pop(key, None)
        self._import_cache.pop(key, None)
        self._eor_received.pop(key, None)
        for k in [k for k in self._refresh_next if k[0] == key]:
            del self._refresh_next[k]
        self._refresh_waiting = {k for k in self._refresh_waiting if k[0] != key}
        self._prefix_warned = {k for k in self._prefix_warned if k[0] != key}

    # ------------------------------------------------------------ graceful restart timers

    def _schedule_graceful(self, key: str) -> None:
        gr = self._graceful.get(key)
        times = [] if gr is None else [t for t in (gr.restart_deadline, gr.stale_deadline) if t is not None]
        self._timers.set(_GRACE_KEY + key, min(times) if times else None)

    def _graceful_timer(self, key: str, now: float) -> None:
        gr = self._graceful.get(key)
        if gr is None:
            return
        if gr.restart_deadline is not None and now >= gr.restart_deadline:
            log.info("peer %s did not return within its restart time: dropping its stale routes", key)
            self.rib.purge_stale(key)
            del self._graceful[key]
        elif gr.stale_deadline is not None and now >= gr.stale_deadline:
            log.info("peer %s sent no End-of-RIB in time: dropping its stale routes", key)
            self.rib.purge_stale(key)
            del self._graceful[key]
        self._schedule_graceful(key)
        peer = self.peers.get(key)
        if peer is not None and key in self.dynamic:
            self._forget_dynamic(peer, now)

    # ------------------------------------------------------------ route refresh

    def _route_refresh(self, peer: Peer, family: Family, now: float) -> None:
        neg = self._negotiated.get(peer.key)
        if neg is None or family not in neg.families:
            return  # RFC 2918 §4: a family that was not negotiated is ignored
        k = (peer.key, family)
        due = self._refresh_next.get(k, 0.0)
        if now >= due and k not in self._refresh_waiting:
            self._start_refresh(k, now)
        elif k not in self._refresh_waiting:
            self._refresh_waiting.add(k)
            self.counters["route refreshes deferred"] += 1
            self._schedule_refresh()
        else:
            self.counters["route refreshes folded"] += 1

    def _start_refresh(self, k: tuple[str, Family], now: float) -> None:
        group = self._group_of.get(k[0])
        if group is not None:
            group.refresh(*k)
            self._refresh_next[k] = now + self.local.refresh_interval
            peer = self.peers.get(k[0])
            if peer is not None:
                self._pump(peer, TURN_BUDGET, now)

    def _schedule_refresh(self) -> None:
        times = [self._refresh_next.get(k, 0.0) for k in self._refresh_waiting]
        self._timers.set(_REFRESH_KEY, min(times) if times else None)

    def _refresh_timer(self, now: float) -> None:
        for k in [k for k in self._refresh_waiting if self._refresh_next.get(k, 0.0) <= now]:
            self._refresh_waiting.discard(k)
            self._start_refresh(k, now)
        self._schedule_refresh()

    # ------------------------------------------------------------ import

    def _import(self, peer: Peer, update: Update, now: float) -> None:
        key = peer.key
        neg = self._negotiated.get(key)
        if neg is None or peer.established is None:
            return  # the session ended later in the same read: its PeerDown follows
        rib = self.rib
        families = neg.families
        eor = update.end_of_rib
        if eor is not None:
            self._end_of_rib(key, eor)
            return
        if update.errors:
            for err in update.errors:
                self.counters[f"update errors {err.action.value}"] += 1
                self.limiter.log(
                    logging.WARNING, f"update-error {err.action.value} {err.code}/{err.subcode}", key, now,
                    "peer %s: UPDATE error (%s): %s", key, err.action.value, err.message,
                )  # fmt: skip
        if update.withdrawn:
            rib.withdraw(key, IPV4_UNICAST, update.withdrawn)
        mp_un = update.mp_unreach
        if mp_un is not None and (mp_un.afi, mp_un.safi) in families:
            rib.withdraw(key, (mp_un.afi, mp_un.safi), mp_un.withdrawn)
        mp = update.mp_reach
        if not update.nlri and (mp is None or not mp.nlri):
            return
        attrs = None if update.treat_as_withdraw else self._imported(key, update.attributes, now)
        if update.nlri:
            self._announce(peer, IPV4_UNICAST, update.nlri, attrs, attrs.next_hop if attrs else None, now)
        if mp is not None and mp.nlri and (mp.afi, mp.safi) in families:
            self._announce(peer, (mp.afi, mp.safi), mp.nlri, attrs, mp.next_hop[0] if mp.next_hop else None, now)

    def _announce(
        self, peer: Peer, family: Family, prefixes: tuple[bytes, ...], attrs: PathAttributes | None,
        next_hop: Address | None, now: float,
    ) -> None:  # fmt: skip
        key = peer.key
        rib = self.rib
        if family not in self._negotiated[key].families:
            rib.withdraw(key, family, prefixes)
            return
        if attrs is not None and next_hop is not None and next_hop == self._local_address.get(key):
            # RFC 4271 §6.3: a NEXT_HOP that is the receiving speaker's own address is
            # semantically incorrect; the route is ignored.
            self.counters["routes ignored"] += len(prefixes)
            self.limiter.log(
                logging.WARNING, "own-next-hop", key, now,
                "peer %s: route(s) with our own address %s as next hop ignored (RFC 4271 §6.3)", key, next_hop,
            )  # fmt: skip
            attrs = None
        if attrs is None:
            rib.withdraw(key, family, prefixes)
            return
        rib.announce(key, family, prefixes, rib.adj_in[key].path(attrs, next_hop))
        self._check_max_prefixes(peer, family, now)

    def _imported(self, key: str, attributes: PathAttributes, now: float) -> PathAttributes | None:
        cache = self._import_cache[key]
        got = cache.get(attributes, _MISSING)
        if got is _MISSING:
            if len(cache) > 8192:
                cache.clear()
            got = cache[attributes] = import_attributes(attributes, self._sources[key], self.local)
        if isinstance(got, Rejected):
            self.counters["routes ignored"] += 1
            self.limiter.log(logging.INFO, "import-rejected", key, now, "peer %s: route(s) ignored: %s", key, got.reason)
            return None
        return got  # type: ignore[return-value]

    def _check_max_prefixes(self, peer: Peer, family: Family, now: float) -> None:
        limit = peer.settings.max_prefixes
        if limit is None:
            return
        n = self.rib.adj_in[peer.key].count(family)
        k = (peer.key, family)
        if n > limit:
            # RFC 4486 §4: Cease/1 with AFI, SAFI and the upper bound.
            data = family[0].to_bytes(2, "big") + bytes((family[1],)) + limit.to_bytes(4, "big")
            hold = peer.settings.max_prefixes_restart
            reason = f"maximum prefixes reached: more than {limit} for AFI {family[0]} SAFI {family[1]}"
            log.warning(
                "peer %s: %s; session reset%s", peer.key, reason,
                f", restart in {hold:g}s" if hold else " until reconfigured",
            )  # fmt: skip
            self.counters["max-prefix resets"] += 1
            peer.shutdown(now, Notification(ErrorCode.CEASE, CeaseSubcode.MAXIMUM_PREFIXES_REACHED, data), reason, hold=hold)
        elif n >= limit * peer.settings.max_prefixes_warning:
            if k not in self._prefix_warned:
                self._prefix_warned.add(k)
                log.warning("peer %s: %d prefixes of AFI %s SAFI %s, limit %d", peer.key, n, family[0], family[1], limit)
        else:
            self._prefix_warned.discard(k)

    def _end_of_rib(self, key: str, family: Family) -> None:
        self._eor_received.setdefault(key, set()).add(family)
        gr = self._graceful.get(key)
        if gr is not None and family in gr.families:
            n = self.rib.purge_stale(key, family)
            gr.families.discard(family)
            log.info("peer %s sent End-of-RIB for %s: removed %d stale routes", key, family, n)
            if not gr.families:
                del self._graceful[key]
            self._schedule_graceful(key)

    # ------------------------------------------------------------ export

    def _flush(self, now: float) -> None:
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
        for group in list(self.groups.values()):
            changed = False
            try:
                for family, entry in batch.items():
                    if family not in group.families:
                        continue
                    if not group.tables[family] and not group.building and not any(
                        p.source.key in group.members or group.exports(p, family)
                        for p in self.rib.promoted.get(family, ())
                    ):
                        # Nothing this group had before and nothing new is for it (iBGP routes
                        # to iBGP peers without reflection, say): no need to look at each prefix.
                        # (A member's own routes are deferred by the group itself, cheaply.)
                        continue
                    group.apply(family, self.rib.changed(family, entry), now)
                    changed = True
            except Exception:
                self._group_failed(group, now)
                continue
            if changed:
                for key in list(group.members):
                    peer = self.peers.get(key)
                    if peer is not None:
                        self._pump(peer, TURN_BUDGET, now)

    def _pump(self, peer: Peer, budget: int, now: float) -> int:
        """Hand ``peer`` up to ``budget`` octets of what it is owed; returns how many."""
        key = peer.key
        group = self._group_of.get(key)
        m = group.members.get(key) if group is not None else None
        if m is None or peer.established is None or not peer.writable or not group.has_work(m):  # type: ignore[union-attr]
            # Nothing owed, or a full socket: set_writable(True) pumps again.
            self._owed.discard(key)
            return 0
        try:
            messages = group.pump(key, budget)  # type: ignore[union-attr]
        except Exception as err:
            self.counters["internal errors"] += 1
            self.limiter.log(
                logging.ERROR, "internal-error", key, now,
                "peer %s: internal error while exporting: %r; resetting its session only", key, err, exc_info=True,
            )  # fmt: skip
            self._reset(peer, now, "internal error while exporting")
            return 0
        if group.has_work(m):  # type: ignore[union-attr]
            self._owed.add(key)
        else:
            self._owed.discard(key)
        if not messages:
            return 0
        peer.send_messages(messages, now)
        self._schedule(peer)
        return sum(map(len, messages))

    # ------------------------------------------------------------ introspection

    def initial_sync_pending(self) -> list[str]:
        """Established peers that have not yet sent End-of-RIB for every family (RFC 4724 §4.1)."""
        return [
            k for k, neg in self._negotiated.items() if not neg.families <= self._eor_received.get(k, set())
        ]

    def adj_out_count(self, key: str) -> int:
        group = self._group_of.get(key)
        return group.sent_count(key) if group is not None else 0

    def peer_views(self) -> list[PeerView]:
        out = []
        for key, peer in self.peers.items():
            s = peer.settings
            neg = self._negotiated.get(key) or peer.session.negotiated
            ibgp = s.asn == self.local.asn
            kind = "ibgp" if ibgp else "ebgp"
            if ibgp and s.rr_client:
                kind = "ibgp rr-client"
            adj = self.rib.adj_in.get(key)
            group = self._group_of.get(key)
            out.append(
                PeerView(
                    address=key,
                    asn=s.asn,
                    kind=kind,
                    state=peer.state.label,
                    since=peer.since,
                    prefixes_received=len(adj) if adj is not None else 0,
                    prefixes_sent=self.adj_out_count(key),
                    stale=self.rib.stale_count(key) if key in self._graceful else 0,
                    router_id=str(neg.peer_router_id) if neg else None,
                    hold_time=neg.hold_time if neg else None,
                    families=tuple(sorted(f"{_afi_name(a)}-unicast" for a, _ in neg.families)) if neg else (),
                    graceful_restart=key in self._graceful,
                    last_error=peer.last_error,
                    flaps=max(0, peer.established_count - (1 if peer.established else 0)),
                    description=s.description,
                    in_sync=group is not None and group.in_sync(key),
                    max_prefixes=s.max_prefixes,
                    held_down=peer.held_until is not None and peer.held_until > self.now,
                )
            )
        return out

    def rib_prefixes(self) -> list[tuple[Family, bytes]]:
        """Every Loc-RIB prefix, in the order /rib lists them (a snapshot to page through)."""
        out: list[tuple[Family, bytes]] = []
        for family in sorted(self.rib.families()):
            out.extend((family, p) for p in sorted(self.rib.loc[family]))  # by length, then address
        return out

    def rib_paths(self, family: Family, prefix: bytes) -> list[RibPathView]:
        """The candidate paths of one prefix, best first (empty if it is gone by now)."""
        return [
            RibPathView(family, prefix, path, i == 0, reason if i == 0 else None)
            for i, (path, reason) in enumerate(bestpath.rank(self.rib.candidates(family, prefix)))
        ]


def _afi_name(afi: int) -> str:
    return "ipv4" if afi == 1 else "ipv6"


def _normalize(address: str) -> str:
    a = ip_address(address.split("%", 1)[0])
    if isinstance(a, IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    return str(a)
