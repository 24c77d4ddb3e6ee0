"""Between each Established session and the RIB (BIRD calls this a channel): what a session
coming up, going down, sending UPDATEs or asking for a refresh means for the routes.

* Up: the peer becomes a RIB source with its own Adj-RIB-In, its import rules are set
  (bgp.importer), graceful restart learns it is back (bgp.graceful), and it joins the update
  group of its kind (bgp.output), which sends it its table.
* UPDATEs go through the importer (RFC 7606 outcomes already applied by the codec; import
  policy; max-prefix, which resets the session with Cease/1); an End-of-RIB marks that family
  in sync (RFC 4724 §2), which graceful restart and the agent's route following wait for.
* Down: its routes are withdrawn, or kept as stale while graceful restart allows.
* ROUTE-REFRESH (RFC 2918): its table again, at most once a second per family, requests in
  between folded (bgp.refresh).

The speaker owns the peers and calls in; nothing here touches a socket or a timer directly.
"""

from __future__ import annotations

import logging
from collections import Counter
from ipaddress import IPv6Address, ip_address

from proto.errors import CeaseSubcode, ErrorCode
from proto.messages import Notification, Update
from proto.nlri import IPV4_UNICAST

from .graceful import GracefulRestarts
from .importer import Importer
from .loglimit import LogLimiter
from .negotiation import Negotiated
from .output import Output
from .peer import Peer, PeerDown, PeerUp
from .policy import ExportTarget
from .refresh import RefreshPacer
from .rib import Rib, Source
from .settings import Family, LocalSettings
from .timers import TimerHeap

log = logging.getLogger("bgp.speaker")


class Channels:
    def __init__(
        self,
        local: LocalSettings,
        rib: Rib,
        timers: TimerHeap,
        limiter: LogLimiter,
        counters: Counter[str],
        graceful: GracefulRestarts,
        output: Output,
    ) -> None:
        self.local = local
        self.rib = rib
        self.graceful = graceful
        self.output = output
        self.counters = counters
        self.limiter = limiter
        self.importer = Importer(rib, local, limiter, counters)
        self.refresh = RefreshPacer(timers, local.refresh_interval, counters)
        self._negotiated: dict[str, Negotiated] = {}
        self._eor_received: dict[str, set[Family]] = {}

    def negotiated(self, key: str) -> Negotiated | None:
        return self._negotiated.get(key)

    def eor_received(self, key: str) -> set[Family]:
        return self._eor_received.get(key, set())

    def sync_pending(self) -> list[str]:
        """Established peers that have not yet sent End-of-RIB for every family (RFC 4724 §4.1)."""
        return [k for k, neg in self._negotiated.items() if not neg.families <= self._eor_received.get(k, set())]

    # ------------------------------------------------------------ session events

    def up(self, peer: Peer, ev: PeerUp, now: float) -> None:
        neg = ev.negotiated
        key = peer.key
        s = peer.settings
        source = Source(
            key, s.address, neg.peer_asn, self.local.asn, neg.peer_router_id, ibgp=neg.ibgp, rr_client=s.rr_client
        )
        self.rib.attach(source)
        self._negotiated[key] = neg
        local_address = ip_address(ev.local_address) if ev.local_address else None
        self.importer.attach(source, s, neg.families, local_address)
        self._eor_received[key] = set()
        self.graceful.came_back(key, neg, now)
        log.info("peer %s established (AS %s, router id %s, hold %ss)", key, neg.peer_asn, neg.peer_router_id, neg.hold_time)
        target = ExportTarget(
            ibgp=neg.ibgp,
            rr_client=s.rr_client,
            local_address=local_address,
            next_hop_v6=self.local.next_hop_v6,
            next_hop_v4=self.local.next_hop_v4,
        )
        if isinstance(local_address, IPv6Address) and IPV4_UNICAST in neg.families and self.local.next_hop_v4 is None:
            self.limiter.log(
                logging.WARNING, "no-ipv4-next-hop", key, now,
                "peer %s: IPv4 unicast negotiated over an IPv6 session, but we have no IPv4 next hop "
                "(next_hop_v4): routes with us as their next hop are not sent to it", key,
            )  # fmt: skip
        self.output.join(peer, neg, target, now)

    def down(self, peer: Peer, ev: PeerDown, now: float, *, quiet: bool = False) -> None:
        """``quiet``: we are the one stopping (nothing worth a log line per peer)."""
        key = peer.key
        self.forget(key)
        gr = ev.peer_graceful_restart
        if ev.graceful and gr is not None and gr.restart_time > 0:
            n = self.graceful.went_away(key, {(f.afi, f.safi) for f in gr.families}, gr.restart_time, now)
            if not quiet:
                log.info(
                    "peer %s down (%s): keeping %d routes as stale for %ss (graceful restart)",
                    key, ev.reason, n, gr.restart_time,
                )  # fmt: skip
        else:
            n = self.rib.drop(key)
            self.graceful.forget(key)
            log.info("peer %s down (%s): withdrew %d routes", key, ev.reason, n)

    def forget(self, key: str) -> None:
        self.output.leave(key)
        self._negotiated.pop(key, None)
        self.importer.detach(key)
        self._eor_received.pop(key, None)
        self.refresh.forget(key)

    def receive(self, peer: Peer, update: Update, now: float) -> None:
        """An UPDATE from ``peer``: End-of-RIB, or routes for the importer."""
        key = peer.key
        if key not in self._negotiated or peer.established is None:
            return  # the session ended later in the same read: its PeerDown follows
        eor = update.end_of_rib
        if eor is not None:
            self._eor_received.setdefault(key, set()).add(eor)
            self.graceful.end_of_rib(key, eor)
            return
        breach = self.importer.update(key, update, now)
        if breach is not None:
            hold = peer.settings.max_prefixes_restart
            reason = breach.reason()
            log.warning(
                "peer %s: %s; session reset%s", key, reason, f", restart in {hold:g}s" if hold else " until reconfigured"
            )
            self.counters["max-prefix resets"] += 1
            note = Notification(ErrorCode.CEASE, CeaseSubcode.MAXIMUM_PREFIXES_REACHED, breach.notification_data())
            peer.shutdown(now, note, reason, hold=hold)

    # ------------------------------------------------------------ route refresh

    def route_refresh(self, peer: Peer, family: Family, now: float) -> None:
        neg = self._negotiated.get(peer.key)
        if neg is None or family not in neg.families:
            return  # RFC 2918 §4: a family that was not negotiated is ignored
        if self.refresh.request((peer.key, family), now):
            self._start_refresh((peer.key, family), now)

    def refreshes_due(self, now: float) -> None:
        """The refresh pacer's timer fired: the deferred re-sends whose time has come start."""
        for req in self.refresh.due(now):
            self._start_refresh(req, now)

    def _start_refresh(self, req: tuple[str, Family], now: float) -> None:
        if self.output.refresh(*req, now):
            self.refresh.started(req, now)
