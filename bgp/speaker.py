"""The BGP speaker, sans-IO: peers + RIB + origination + Adj-RIB-Out, driven by its caller.

The transport (bgp.transport) feeds connection events, bytes and the time, and
carries out the :class:`~bgp.session.Connect` / ``Send`` / ``Close`` actions it
collects from :meth:`Speaker.take_actions`.  The agent configures peers and the
prefixes to originate as *desired state* (``set_peers``, ``set_originated``) and
subscribes to Loc-RIB best-path changes (``add_listener``).

Everything a peer should have is computed, not remembered as instructions: after
each batch of input the speaker takes the Loc-RIB changes, exports each changed
prefix for each Established peer, diffs against that peer's Adj-RIB-Out and sends
only the difference, packing prefixes that share attributes into one UPDATE.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address, ip_address

from proto.attributes import AsPath, Origin, PathAttributes
from proto.errors import CeaseSubcode
from proto.messages import Notification, Update, encode_updates, encode_withdrawals
from proto.nlri import IPV4_UNICAST, Afi

from . import bestpath
from .peer import Peer, PeerDown, PeerEvent, PeerRouteRefresh, PeerUp, PeerUpdate
from .policy import ExportTarget, export_route, import_attributes
from .rib import BestPathChange, Path, Rib, Source
from .session import Action, Close, Connect, Negotiated
from .settings import Family, LocalSettings, PeerSettings

log = logging.getLogger("bgp.speaker")

Address = IPv4Address | IPv6Address
OutRoute = tuple[PathAttributes, Address]
Listener = Callable[[list[BestPathChange]], None]

LOCAL_KEY = "local"
DEFAULT_ORIGIN_ATTRIBUTES = PathAttributes((Origin(0), AsPath(())))
_MISSING = object()


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
        self._targets: dict[str, ExportTarget] = {}
        self._adj_out: dict[str, dict[Family, dict[bytes, OutRoute]]] = {}
        self._import_cache: dict[str, dict[PathAttributes, PathAttributes | None]] = {}
        self._graceful: dict[str, _GracefulState] = {}
        self._eor_received: dict[str, set[Family]] = {}
        self._listeners: list[Listener] = []
        self.now = now

    # ------------------------------------------------------------ configuration (desired state)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(changes)`` after every batch that changed Loc-RIB best paths."""
        self._listeners.append(listener)

    def start(self, now: float) -> None:
        self.now = now
        self.started = True
        for peer in self.peers.values():
            peer.start(now)
            self._drain(peer, now)
        self._flush(now)

    def stop(self, now: float, *, graceful: bool) -> None:
        """Stop every session.  ``graceful``: close TCP without a NOTIFICATION so GR peers keep
        our routes (RFC 4724); otherwise Cease/Administrative Shutdown and the peers withdraw them."""
        self.now = now
        note = None if graceful else Notification.cease(CeaseSubcode.ADMINISTRATIVE_SHUTDOWN, "agentd stopping")
        self.started = False
        for peer in self.peers.values():
            peer.stop(now, note)
            self._drain(peer, now)
        self._flush(now)

    def set_peers(self, peers: Iterable[PeerSettings], now: float) -> None:
        wanted = {p.key: p for p in peers}
        for key in [k for k in self.peers if k not in wanted]:
            self.remove_peer(key, now)
        for key, settings in wanted.items():
            cur = self.peers.get(key)
            if cur is not None and cur.settings == settings:
                continue
            if cur is not None:
                self.remove_peer(key, now, CeaseSubcode.OTHER_CONFIGURATION_CHANGE)
            self.add_peer(settings, now)

    def add_peer(self, settings: PeerSettings, now: float) -> Peer:
        if settings.key in self.peers:
            raise ValueError(f"peer {settings.key} already configured")
        peer = Peer(self.local, settings, conn_ids=self._conn_ids, now=now, rng=self._rng)
        self.peers[settings.key] = peer
        if self.started:
            peer.start(now)
            self._drain(peer, now)
            self._flush(now)
        return peer

    def remove_peer(self, key: str, now: float, subcode: int = CeaseSubcode.PEER_DECONFIGURED) -> None:
        peer = self.peers.get(key)
        if peer is None:
            return
        peer.stop(now, Notification.cease(subcode))
        self._drain(peer, now)
        self._orphan_actions.extend(peer.take_actions())
        del self.peers[key]
        for conn in [c for c, p in self._conn_owner.items() if p is peer]:
            del self._conn_owner[conn]
        self._forget_peer(key)
        self.rib.drop(key)
        self._graceful.pop(key, None)
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

    # ------------------------------------------------------------ transport inputs

    def accept(self, conn: int, remote: str, now: float, local_address: str | None = None) -> bool:
        """An inbound connection from ``remote``; False means close it (unknown or unwilling peer)."""
        self.now = now
        peer = self.peers.get(_normalize(remote))
        if peer is None or not peer.accept(conn, now, local_address):
            return False
        self._conn_owner[conn] = peer
        self._drain(peer, now)
        self._flush(now)
        return True

    def connection_made(self, conn: int, now: float, local_address: str | None = None) -> None:
        self.now = now
        peer = self._conn_owner.get(conn)
        if peer is None:
            self._orphan_actions.append(Close(conn))
            return
        peer.connection_made(conn, now, local_address)
        self._drain(peer, now)
        self._flush(now)

    def connect_failed(self, conn: int, now: float) -> None:
        self.now = now
        peer = self._conn_owner.pop(conn, None)
        if peer is not None:
            peer.connect_failed(conn, now)
            self._drain(peer, now)
            self._flush(now)

    def connection_lost(self, conn: int, now: float) -> None:
        self.now = now
        peer = self._conn_owner.pop(conn, None)
        if peer is not None:
            peer.connection_lost(conn, now)
            self._drain(peer, now)
            self._flush(now)

    def data_received(self, conn: int, data: bytes, now: float) -> None:
        self.now = now
        peer = self._conn_owner.get(conn)
        if peer is None:
            return
        peer.data_received(conn, data, now)
        self._drain(peer, now)
        self._flush(now)

    def get_timer(self) -> float | None:
        times = [t for t in (p.get_timer() for p in self.peers.values()) if t is not None]
        for gr in self._graceful.values():
            times.extend(t for t in (gr.restart_deadline, gr.stale_deadline) if t is not None)
        return min(times) if times else None

    def handle_timer(self, now: float) -> None:
        self.now = now
        for peer in list(self.peers.values()):
            t = peer.get_timer()
            if t is not None and now >= t:
                peer.handle_timer(now)
                self._drain(peer, now)
        for key, gr in list(self._graceful.items()):
            if gr.restart_deadline is not None and now >= gr.restart_deadline:
                log.info("peer %s did not return within its restart time: dropping its stale routes", key)
                self.rib.purge_stale(key)
                del self._graceful[key]
            elif gr.stale_deadline is not None and now >= gr.stale_deadline:
                log.info("peer %s sent no End-of-RIB in time: dropping its stale routes", key)
                self.rib.purge_stale(key)
                del self._graceful[key]
        self._flush(now)

    def take_actions(self) -> list[Action]:
        actions, self._orphan_actions = self._orphan_actions, []
        for peer in self.peers.values():
            for a in peer.take_actions():
                if isinstance(a, Connect):
                    self._conn_owner[a.conn] = peer
                actions.append(a)
        return actions

    # ------------------------------------------------------------ peer events

    def _drain(self, peer: Peer, now: float) -> None:
        ev = peer.next_event()
        while ev is not None:
            self._on_peer_event(peer, ev, now)
            ev = peer.next_event()

    def _on_peer_event(self, peer: Peer, ev: PeerEvent, now: float) -> None:
        if isinstance(ev, PeerUpdate):
            self._import(peer.key, ev.update)
        elif isinstance(ev, PeerUp):
            self._peer_up(peer, ev, now)
        elif isinstance(ev, PeerDown):
            self._peer_down(peer, ev, now)
        elif isinstance(ev, PeerRouteRefresh):
            family = (ev.afi, ev.safi)
            neg = self._negotiated.get(peer.key)
            if neg is not None and family in neg.families:
                # RFC 2918: send the whole Adj-RIB-Out for the family again.
                self._adj_out[peer.key].pop(family, None)
                self._send_full(peer, [family], now, end_of_rib=False)

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
        self._targets[key] = ExportTarget(
            key=key,
            asn=neg.peer_asn,
            ibgp=neg.ibgp,
            rr_client=s.rr_client,
            router_id=neg.peer_router_id,
            local_address=local_address,
            next_hop_v6=self.local.next_hop_v6,
        )
        self._adj_out[key] = {}
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
        log.info("peer %s established (AS %s, router id %s, hold %ss)", key, neg.peer_asn, neg.peer_router_id, neg.hold_time)
        self._send_full(peer, sorted(neg.families), now, end_of_rib=True)

    def _peer_down(self, peer: Peer, ev: PeerDown, now: float) -> None:
        key = peer.key
        self._forget_peer(key)
        gr = ev.peer_graceful_restart
        if ev.graceful and gr is not None and gr.restart_time > 0:
            families = {(f.afi, f.safi) for f in gr.families}
            n = self.rib.mark_stale(key, families)
            self._graceful[key] = _GracefulState(now + gr.restart_time, None, families)
            if self.started:  # (when we are the one stopping, there is nothing to tell)
                log.info(
                    "peer %s down (%s): keeping %d routes as stale for %ss (graceful restart)",
                    key, ev.reason, n, gr.restart_time,
                )  # fmt: skip
        else:
            n = self.rib.drop(key)
            self._graceful.pop(key, None)
            log.info("peer %s down (%s): withdrew %d routes", key, ev.reason, n)

    def _forget_peer(self, key: str) -> None:
        self._targets.pop(key, None)
        self._adj_out.pop(key, None)
        self._negotiated.pop(key, None)
        self._import_cache.pop(key, None)
        self._eor_received.pop(key, None)

    # ------------------------------------------------------------ import

    def _import(self, key: str, update: Update) -> None:
        neg = self._negotiated.get(key)
        if neg is None:
            return
        rib = self.rib
        families = neg.families
        eor = update.end_of_rib
        if eor is not None:
            self._end_of_rib(key, eor)
            return
        if update.withdrawn:
            rib.withdraw(key, IPV4_UNICAST, update.withdrawn)
        mp_un = update.mp_unreach
        if mp_un is not None and (mp_un.afi, mp_un.safi) in families:
            rib.withdraw(key, (mp_un.afi, mp_un.safi), mp_un.withdrawn)
        mp = update.mp_reach
        if not update.nlri and mp is None:
            return
        if update.errors:
            for err in update.errors:
                log.warning("peer %s: UPDATE error (%s): %s", key, err.action.value, err.message)
        attrs = None if update.treat_as_withdraw else self._imported(key, update.attributes)
        if update.nlri:
            if attrs is None or IPV4_UNICAST not in families:
                rib.withdraw(key, IPV4_UNICAST, update.nlri)
            else:
                adj = rib.adj_in[key]
                rib.announce(key, IPV4_UNICAST, update.nlri, adj.path(attrs, attrs.next_hop))
        if mp is not None and mp.nlri:
            family = (mp.afi, mp.safi)
            if family not in families:
                return
            if attrs is None:
                rib.withdraw(key, family, mp.nlri)
            else:
                adj = rib.adj_in[key]
                rib.announce(key, family, mp.nlri, adj.path(attrs, mp.next_hop[0] if mp.next_hop else None))

    def _imported(self, key: str, attributes: PathAttributes) -> PathAttributes | None:
        cache = self._import_cache[key]
        got = cache.get(attributes, _MISSING)
        if got is _MISSING:
            if len(cache) > 8192:
                cache.clear()
            got = cache[attributes] = import_attributes(attributes, self._sources[key], self.local)
        return got  # type: ignore[return-value]

    def _end_of_rib(self, key: str, family: Family) -> None:
        self._eor_received.setdefault(key, set()).add(family)
        gr = self._graceful.get(key)
        if gr is not None and family in gr.families:
            n = self.rib.purge_stale(key, family)
            gr.families.discard(family)
            log.info("peer %s sent End-of-RIB for %s: removed %d stale routes", key, family, n)
            if not gr.families:
                del self._graceful[key]

    # ------------------------------------------------------------ export

    def _flush(self, now: float) -> None:
        if not self.rib.has_changes():
            return
        batch = self.rib.take_batch()
        if self._listeners:
            changes = self.rib.changes_of(batch)
            if changes:
                for listener in self._listeners:
                    listener(changes)
        for key, target in self._targets.items():
            peer = self.peers.get(key)
            neg = self._negotiated.get(key)
            if peer is None or neg is None or peer.established is None:
                continue
            for family, entry in batch.items():
                if family not in neg.families:
                    continue
                if not self._adj_out[key].get(family) and not any(
                    export_route(p, family[0], target, self.local) for p in self.rib.promoted.get(family, ())
                ):
                    # Nothing sent to this peer before and nothing new is for it (its own routes,
                    # split horizon): no need to look at each prefix.
                    continue
                self._export(peer, target, neg, family, self.rib.changed(family, entry), now)

    def _export(
        self,
        peer: Peer,
        target: ExportTarget,
        neg: Negotiated,
        family: Family,
        pairs: Iterable[tuple[bytes, Path | None]],
        now: float,
    ) -> None:
        """Send ``peer`` what changed for ``family``: ``pairs`` are (prefix, new best path)."""
        out = self._adj_out[peer.key]
        table = out.get(family)
        if table is None:
            table = out[family] = {}
        cache: dict[int, OutRoute | None] = {}
        groups: dict[int, tuple[OutRoute, list[bytes]]] = {}
        withdrawn: list[bytes] = []
        local, afi = self.local, family[0]
        for prefix, new in pairs:
            if new is None:
                desired = None
            else:
                desired = cache.get(id(new), _MISSING)  # type: ignore[arg-type]
                if desired is _MISSING:
                    desired = cache[id(new)] = export_route(new, afi, target, local)
            if desired is None:
                # Not for this peer (split horizon, its own route, ...): withdraw if we had sent it.
                if table and prefix in table:
                    del table[prefix]
                    withdrawn.append(prefix)
                continue
            cur = table.get(prefix)
            if cur is None or (cur is not desired and cur != desired):
                table[prefix] = desired
                g = groups.get(id(desired))
                if g is None:
                    g = groups[id(desired)] = (desired, [])
                g[1].append(prefix)
        messages: list[bytes] = []
        ctx = neg.ctx
        if withdrawn:
            messages.extend(encode_withdrawals(afi, withdrawn, ctx))
        for (attrs, next_hop), prefixes in groups.values():
            messages.extend(encode_updates(afi, attrs, next_hop, prefixes, ctx))
        # The session may have ended earlier in the same read (a NOTIFICATION behind a
        # ROUTE-REFRESH or an UPDATE): its PeerDown comes next; nothing is sent any more.
        if messages and peer.established is not None:
            peer.send_messages(messages, now)

    def _send_full(self, peer: Peer, families: list[Family], now: float, *, end_of_rib: bool) -> None:
        target = self._targets[peer.key]
        neg = self._negotiated[peer.key]
        for family in families:
            self._export(peer, target, neg, family, self.rib.bests(family), now)
        if end_of_rib and peer.established is not None:
            peer.send_messages([Update.end_of_rib_marker(*f).encode(neg.ctx) for f in families], now)

    # ------------------------------------------------------------ introspection

    def initial_sync_pending(self) -> list[str]:
        """Established peers that have not yet sent End-of-RIB for every family (RFC 4724 §4.1)."""
        return [
            k for k, neg in self._negotiated.items() if not neg.families <= self._eor_received.get(k, set())
        ]

    def adj_out_count(self, key: str) -> int:
        return sum(len(t) for t in self._adj_out.get(key, {}).values())

    def peer_status(self) -> list[dict]:
        out = []
        for key, peer in self.peers.items():
            s = peer.settings
            neg = self._negotiated.get(key) or peer.session.negotiated
            ibgp = s.asn == self.local.asn
            kind = "ibgp" if ibgp else "ebgp"
            if ibgp and s.rr_client:
                kind = "ibgp rr-client"
            adj = self.rib.adj_in.get(key)
            out.append(
                {
                    "address": key,
                    "asn": s.asn,
                    "type": kind,
                    "state": peer.state.label,
                    "since": peer.since,
                    "prefixes_received": len(adj) if adj is not None else 0,
                    "prefixes_sent": self.adj_out_count(key),
                    "stale": self.rib.stale_count(key) if key in self._graceful else 0,
                    "router_id": str(neg.peer_router_id) if neg else None,
                    "hold_time": neg.hold_time if neg else None,
                    "families": sorted(f"{_afi_name(a)}-unicast" for a, _ in neg.families) if neg else [],
                    "graceful_restart": key in self._graceful,
                    "info": peer.last_error,
                    "flaps": max(0, peer.established_count - (1 if peer.established else 0)),
                    "description": s.description,
                }
            )
        return out

    def rib_entries(self) -> list[dict]:
        from proto.nlri import prefix_to_str

        out = []
        for family in sorted(self.rib.families()):
            for prefix in sorted(self.rib.loc[family], key=lambda p: (len(p), p)):
                for i, (path, reason) in enumerate(bestpath.rank(self.rib.candidates(family, prefix))):
                    a = path.attributes
                    out.append(
                        {
                            "prefix": prefix_to_str(family[0], prefix),
                            "next_hop": str(path.next_hop) if path.next_hop is not None else None,
                            "as_path": str(a.as_path),
                            "origin": a.origin,
                            "local_pref": a.local_pref,
                            "med": a.med,
                            "communities": [f"{c >> 16}:{c & 0xFFFF}" for c in a.communities],
                            "large_communities": [":".join(map(str, c)) for c in a.large_communities],
                            "originator_id": str(a.originator_id) if a.originator_id else None,
                            "cluster_list": [str(c) for c in a.cluster_list],
                            "peer": path.source.key,
                            "best": i == 0,
                            "reason": reason.value if i == 0 else None,
                            "stale": path.stale,
                        }
                    )
        return out


def _afi_name(afi: int) -> str:
    return "ipv4" if afi == Afi.IPV4 else "ipv6"


def _normalize(address: str) -> str:
    a = ip_address(address.split("%", 1)[0])
    if isinstance(a, IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    return str(a)
