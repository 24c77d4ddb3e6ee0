"""The speaker's output side, sans-IO: Loc-RIB changes -> update groups -> each peer's socket.

Peers that get the same export (same :class:`~bgp.export.GroupKey`: policy target, families,
encoding context) share one :class:`~bgp.export.UpdateGroup`.  After each batch of input the
speaker hands the batch here (:meth:`Output.flush`); each group exports the changed prefixes
once and logs the encoded difference; each member is then given what it has not read yet,
as far as its socket takes it (:meth:`Output.pump`), a turn at a time (:meth:`Output.work`),
so that a large export never keeps the loop from everything else.  With ``update_delay`` the
groups' changes are held for one window and leave as one burst (BIRD's and GoBGP's batching).

The speaker owns the peers and their sessions; this side only reads ``peers`` and calls back:
``sent(peer)`` after giving a peer messages (its actions and timers changed), and
``reset(peer, now, reason)`` when exporting to it failed (a bug: that peer's session only).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from .export import GroupKey, UpdateGroup
from .loglimit import LogLimiter
from .negotiation import Negotiated
from .peer import Peer
from .policy import ExportTarget
from .rib import Batch, Rib
from .settings import Family, LocalSettings
from .timers import TimerHeap

log = logging.getLogger("bgp.speaker")

#: Octets of UPDATEs one peer is given per turn: enough to fill a socket buffer, small enough
#: that a large export leaves the loop to everything else between turns.
TURN_BUDGET = 256 * 1024
#: Prefixes of a new update group's first computation per turn.
BUILD_BUDGET = 4096
#: The timer key of the update-delay window.
SEND_KEY = "\0send"


class Output:
    def __init__(
        self,
        local: LocalSettings,
        rib: Rib,
        peers: dict[str, Peer],
        timers: TimerHeap,
        limiter: LogLimiter,
        counters: Counter[str],
        *,
        sent: Callable[[Peer], None],
        reset: Callable[[Peer, float, str], None],
    ) -> None:
        self.local = local
        self.rib = rib
        self.peers = peers  # the speaker's own dict: read, never changed here
        self.timers = timers
        self.limiter = limiter
        self.counters = counters
        self._sent = sent
        self._reset = reset
        self.groups: dict[GroupKey, UpdateGroup] = {}
        self._group_of: dict[str, UpdateGroup] = {}
        self._owed: set[str] = set()  # peers with output waiting that their socket can take
        self._waiting: dict[GroupKey, UpdateGroup] = {}  # groups with changes held for update_delay
        self.hold_eor = False  # End-of-RIB held from every peer (Speaker: selection deferral)

    # ------------------------------------------------------------ membership

    def join(self, peer: Peer, neg: Negotiated, target: ExportTarget, now: float) -> None:
        """An Established peer joins the group of its kind (a new group computes its table)."""
        gkey = GroupKey(target, neg.families, neg.ctx)
        group = self.groups.get(gkey)
        if group is None:
            group = self.groups[gkey] = UpdateGroup(gkey, self.local, self.limiter)
            group.hold_eor = self.hold_eor
            for family in sorted(neg.families):
                group.start_build(family, list(self.rib.loc.get(family, ())))
        group.join(peer.key, neg.peer_router_id)
        for family in group.take_deferred():
            group.start_build(family, list(self.rib.loc.get(family, ())))
        self._group_of[peer.key] = group
        if group.building and sum(len(c.prefixes) for c in group.building.values()) <= BUILD_BUDGET:
            self.build(group, now)  # small tables: at once, not a turn later
        self.pump(peer, TURN_BUDGET, now)

    def leave(self, key: str) -> None:
        self._owed.discard(key)
        group = self._group_of.pop(key, None)
        if group is not None:
            group.leave(key)
            if not group.members:
                self.groups.pop(group.key, None)

    def refresh(self, key: str, family: Family, now: float) -> bool:
        """Send ``key`` its whole table of ``family`` again (ROUTE-REFRESH); False if it has no group."""
        group = self._group_of.get(key)
        if group is None:
            return False
        group.refresh(key, family)
        peer = self.peers.get(key)
        if peer is not None:
            self.pump(peer, TURN_BUDGET, now)
        return True

    # ------------------------------------------------------------ changes in

    def flush(self, batch: dict[Family, Batch], now: float) -> None:
        """Give every group the Loc-RIB changes of ``batch`` (from :meth:`Rib.take_batch`)."""
        for group in list(self.groups.values()):
            changed = False
            try:
                for family, entry in batch.items():
                    if family not in group.families:
                        continue
                    if not group.tables[family] and not group.building:
                        promoted = self.rib.promoted.get(family, ())
                        if len(group.members) == 1 and all(p.source.key in group.members for p in promoted):
                            # The only member's own routes, and the group had nothing: all of
                            # them would be held back (see UpdateGroup.apply), so hold the family.
                            if promoted:
                                group.deferred.add(family)
                            continue
                        if not any(p.source.key in group.members or group.exports(p, family) for p in promoted):
                            # Nothing this group had before and nothing new is for it (iBGP routes
                            # to iBGP peers without reflection, say): no need to look at each prefix.
                            continue
                    group.apply(family, self.rib.changed(family, entry), now)
                    changed = True
            except Exception:
                self._group_failed(group, now)
                continue
            if changed:
                if self.local.update_delay > 0:
                    if not self._waiting:
                        self.timers.set(SEND_KEY, now + self.local.update_delay)
                    self._waiting[group.key] = group
                else:
                    self._pump_group(group, now)

    def send_window(self, now: float) -> None:
        """The update-delay window is over: the groups held in it go out."""
        waiting, self._waiting = self._waiting, {}
        for group in waiting.values():
            if self.groups.get(group.key) is group:
                self._pump_group(group, now)

    # ------------------------------------------------------------ output

    def has_work(self) -> bool:
        """Output is owed to a peer whose socket has room, or a new group is being computed."""
        return bool(self._owed) or any(g.building for g in self.groups.values())

    def work(self, now: float, budget: int) -> bool:
        """One turn: each peer with room gets up to TURN_BUDGET octets (at most ``budget`` in
        all), new groups a step of their first computation.  Returns whether more is owed."""
        for group in list(self.groups.values()):
            if group.building:
                self.build(group, now)
        spent = 0
        for key in list(self._owed):
            if spent >= budget:
                break
            peer = self.peers.get(key)
            if peer is None:
                self._owed.discard(key)
                continue
            spent += self.pump(peer, min(TURN_BUDGET, budget - spent), now)
        return self.has_work()

    def build(self, group: UpdateGroup, now: float) -> None:
        try:
            group.build_step(self.rib.best, BUILD_BUDGET, now)
        except Exception:
            self._group_failed(group, now)
            return
        self._pump_group(group, now)

    def pump(self, peer: Peer, budget: int, now: float) -> int:
        """Hand ``peer`` up to ``budget`` octets of what it is owed; returns how many."""
        key = peer.key
        group = self._group_of.get(key)
        m = group.members.get(key) if group is not None else None
        if group is None or m is None or peer.established is None or not peer.writable or not group.has_work(m):
            # Nothing owed, or a full socket: set_writable(True) pumps again.
            self._owed.discard(key)
            return 0
        try:
            messages = group.pump(key, budget)
        except Exception as err:
            self.counters["internal errors"] += 1
            self.limiter.log(
                logging.ERROR, "internal-error", key, now,
                "peer %s: internal error while exporting: %r; resetting its session only", key, err, exc_info=True,
            )  # fmt: skip
            self._reset(peer, now, "internal error while exporting")
            return 0
        if group.has_work(m):
            self._owed.add(key)
        else:
            self._owed.discard(key)
        if not messages:
            return 0
        peer.send_messages(messages, now)
        self._sent(peer)
        return sum(map(len, messages))

    def release_eor(self, now: float) -> None:
        """Send the End-of-RIB held from every peer (RFC 4724 §4.1: selection deferral over)."""
        self.hold_eor = False
        for group in list(self.groups.values()):
            group.hold_eor = False
            self._pump_group(group, now)

    def _pump_group(self, group: UpdateGroup, now: float) -> None:
        for key in list(group.members):
            peer = self.peers.get(key)
            if peer is not None:
                self.pump(peer, TURN_BUDGET, now)

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

    # ------------------------------------------------------------ introspection

    def sent_count(self, key: str) -> int:
        group = self._group_of.get(key)
        return group.sent_count(key) if group is not None else 0

    def in_sync(self, key: str) -> bool:
        group = self._group_of.get(key)
        return group is not None and group.in_sync(key)
