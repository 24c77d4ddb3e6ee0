"""Best paths -> kernel routes: what ``agentd run`` asks the route programmer to hold.

:class:`KernelRoutes` follows the speaker's Loc-RIB (best-path changes), and is told when
the node registry or a backend's paths change; each time (coalesced to one pass per loop
turn, or after a slow pass to one per as long again) it computes the wanted routes with the
pure :func:`agentd.kernel.forwarding.desired_routes` -- its node-dependent part
(:func:`~agentd.kernel.forwarding.node_context`) again only when the nodes or backends changed
-- hands the backends their peer plans and the programmer its routes.  A pass that fails is
tried again (0.5 s, doubling up to 30 s).

Graceful restart (RFC 4724): the routes a previous run left are adopted at start and stay
installed until every peer is Established with End-of-RIB received (or ``restart_time``,
at most INITIAL_SYNC_MAX, passes), so a restart never removes a route that is still used.
One re-learned by then whose data path is not up yet (a backend a peer needs, still being
brought up) keeps the adopted route until this run can route it itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import Any, Protocol

from bgp import BestPathChange, Speaker, State
from bgp.loglimit import LogLimiter
from proto.nlri import prefix_to_str

from agentd.backend_table import BACKENDS
from agentd.cni.netconf import atomic_write
from agentd.config.settings import Config
from agentd.digits import whole_number
from agentd.daemon.mesh import Peering
from agentd.dataplane.backends import Tunnels
from agentd.datastore.store import ClusterConfig, SubnetLease
from agentd.kernel.forwarding import NodeContext, PeerPlan, desired_routes, node_context
from agentd.kernel.netinfo import Underlay
from agentd.kernel.netlink import NetlinkDecodeError
from agentd.kernel.route_model import RTPROT_AGENTD, InvalidRoute, Route, canonical_dst, same_route
from agentd.kernel.routing import RouteProgrammer, remove_routes_of
from agentd.nft.masquerade import Masquerade, member_addresses

log = logging.getLogger("agentd")

BLACKHOLE_METRIC = 4000  # above the connected route of the CNI bridge, which must win
INITIAL_SYNC_MAX = 60.0  # never wait longer than this for peers' End-of-RIB after a restart
REFUSAL_MEMORY = 3600.0  # a refused route back within this is a flap: its lines paced per peer
PROTOCOL_FILE = "route-protocol"  # in [agent] state_dir: the route protocol the agent last used
COALESCE_MIN = 0.001  # a recompute cheaper than this runs at the next loop turn, not later
RETRY_FIRST, RETRY_MAX = 0.5, 30.0  # a failed recompute is tried again after this, doubling up to RETRY_MAX


async def drop_previous_protocol(
    state_dir: Path,
    protocol: int,
    pod_networks: Iterable[IPv4Network | IPv6Network],
    remove: Callable[..., Awaitable[tuple[list[str], list[str]]]] = remove_routes_of,
) -> None:
    """``[network] route_protocol`` changed since the last run (``state_dir``/route-protocol
    says which it was): the routes of the old protocol inside the cluster's pod networks are
    removed (they would keep forwarding and hold every key the new routes need, each add a
    conflict); then the file names ``protocol``.  A route of the old protocol elsewhere (an
    external next hop's) is left alone, with a warning to flush it by hand.

    Without the file (a first run, an upgrade from an agentd that did not write it, a state
    directory removed) the previous protocol is not known: with ``protocol`` the default
    (RTPROT_AGENTD), nothing is removed -- the previous run's routes, if it had the default too,
    are this run's to adopt; with another ``protocol``, the default's routes inside the pod
    networks are taken for a previous run's (what an agentd that wrote no file used unless
    told otherwise; inside the cluster's pod networks no one else's route belongs, and one
    there would make this run's add of that destination a conflict all the same)."""
    path = state_dir / PROTOCOL_FILE
    previous: int | None = None
    missing = False
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        text = None
        missing = True
    except OSError as err:
        log.warning("cannot read %s (%s): routes of an earlier route_protocol are not looked for", path, err)
        text = None
    if text is not None:
        number = whole_number(text, 3)
        if number is not None and 5 <= number <= 255:
            previous = number
        else:
            log.warning("%s holds %r, not a route protocol: ignored", path, text[:40])
    if missing and protocol != RTPROT_AGENTD:
        log.info("%s not found (a first run, or an agentd that did not write it): routes of the default "
                 "route_protocol %d in the pod network are taken for a previous run's", path, RTPROT_AGENTD)
        previous = RTPROT_AGENTD
    if previous is not None and previous != protocol:
        networks = list(pod_networks)
        try:
            removed, failed = await remove(previous, networks)
        except (OSError, NetlinkDecodeError) as err:  # the dump itself (a socket, a reply it cannot read)
            log.warning("[network] route_protocol changed from %d to %d: the proto %d routes of a previous run "
                        "could not be looked for (%s); the next start tries again", previous, protocol, previous, err)
            return
        log.warning("[network] route_protocol changed from %d to %d: removed %d proto %d routes of a previous run "
                    "in the pod network (%s); routes of proto %d elsewhere are left: `ip route flush proto %d` "
                    "removes them", previous, protocol, len(removed), previous, ", ".join(map(str, networks)),
                    previous, previous)  # fmt: skip
        if failed:
            for reason in failed:
                log.warning("could not remove a proto %d route: %s", previous, reason)
            return  # the next start tries again
    if previous != protocol:
        try:  # a new file renamed over the old: a crash or a reboot leaves the old number or the new
            atomic_write(str(path), f"{protocol}\n", mode=0o644)
        except OSError as err:
            log.warning("cannot write %s (%s): a later change of route_protocol will not remove this run's routes",
                        path, err)


class RouteInputs(Protocol):
    """What the routes are computed from (``agentd.daemon.agent.Agent`` has all of it)."""

    cfg: Config
    name: str
    peering: Peering  # the node registry as read (.nodes, .known)
    underlay: Underlay | None
    lease: SubnetLease | None
    leases: dict[int, SubnetLease]  # by IP version: both in a dual-stack cluster
    cluster: ClusterConfig | None  # the cluster record in etcd: its pod networks bound what nodes may route
    tunnels: Tunnels | None
    masq: Masquerade | None  # [network] ip_masq: its member set follows the node registry
    speaker: Speaker | None
    started_bgp: bool
    stopping: bool  # no more route changes: a graceful stop leaves the kernel as it is


class KernelRoutes:
    def __init__(self, inputs: RouteInputs) -> None:
        self.inputs = inputs
        self.programmer: RouteProgrammer | None = None
        self.plans: dict[str, PeerPlan] = {}  # per peer: how its routes are carried (GET /peers)
        self.plans_v6: dict[str, PeerPlan] = {}  # dual-stack: how its IPv6 pods are reached
        self.rows: list[dict[str, Any]] = []  # GET /routes
        self.refused: list[dict[str, Any]] = []  # GET /routes too: best paths not installed, and why
        self._logged_refusals: set[tuple[str, str, str]] = set()  # (dst, peer, reason) logged while refused
        self._logged_untrusted: set[tuple[str, str, str]] = set()  # (node, subnet, reason) logged while so
        self._logged_hops: set[tuple[str, str, str]] = set()  # (node, next hop, reason) logged while so
        # (dst, peer) -> when last seen refused; entries older than REFUSAL_MEMORY are pruned.
        self._refused_at: dict[tuple[str, str], float] = {}
        self._refusing_peers: set[str] = set()  # the peers of _refused_at
        # A refused route that comes back within REFUSAL_MEMORY (a flapping external router) is
        # logged at most once a minute per peer, with the number held back meanwhile.
        self._refusal_log = LogLimiter(log, pinned=lambda peer: peer in self._refusing_peers)
        self.clock: Callable[[], float] = time.monotonic
        self._logged_bad_bests: set[tuple[int, bytes]] = set()  # best paths not a prefix, logged while so
        self._failing: str | None = None  # the last recompute's error (logged when it changes)
        self.restarting = False  # routes of a previous run were adopted
        self.initial_sync_done = False
        self.initial_sync_deadline = 0.0
        self.synced_after = 0  # the programmer's reconciles begun when the initial sync was done
        self._bests: dict[tuple[int, bytes], Any] = {}
        self._wanted: dict[str, Route] = {}  # the routes of ``rows``, by dst
        self._adopted: list[Route] = []
        self._handle: asyncio.Handle | None = None
        self._retry: asyncio.TimerHandle | None = None  # a failed recompute tried again (backoff)
        self._retry_delay = RETRY_FIRST
        self._cost = 0.0  # how long the last recompute took (self.clock)
        self._done_at = float("-inf")  # when it ended
        # What the routes take from the registry, the underlay and the backends (every peer's
        # plan, next-hop owners, held subnets): kept while none of that changed (``schedule``
        # says it may have; a best-path change alone does not), with the inputs it came from.
        self._context: NodeContext | None = None
        self._context_key: tuple[Any, ...] | None = None
        self._nodes_changed = True
        self._tick: asyncio.TimerHandle | None = None  # the initial sync's re-check, one at a time
        # When the refusals held back in a minute are logged though no refusal followed.
        self._refusal_flush: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # None: the running loop (tests give a fake)

    def adopt(self, programmer: RouteProgrammer) -> None:
        """Start from what the (started) programmer found in the kernel: kept until BGP has
        re-learned it."""
        self.programmer = programmer
        self._adopted = programmer.programmed()
        self.restarting = bool(self._adopted)
        if self.restarting:
            log.info("adopted %d routes from a previous run: restarting gracefully", len(self._adopted))
        programmer.set_desired(self._adopted)

    def reconciled(self) -> bool:
        """The routes BGP learned are in the kernel: the initial sync is done and a reconcile
        begun after it (with what it computed) has completed -- not one that ran before etcd or
        BGP was there (the adopted routes), nor one that keeps failing."""
        return (self.initial_sync_done and self.programmer is not None
                and self.programmer.reconciled_upto > self.synced_after)

    def bgp_started(self, restart_time: float) -> None:
        """BGP is up: End-of-RIB is awaited from now for at most ``restart_time`` seconds."""
        self.initial_sync_deadline = time.monotonic() + min(INITIAL_SYNC_MAX, restart_time)
        self.schedule()

    def on_best_paths(self, changes: list[BestPathChange]) -> None:
        """The speaker's Loc-RIB listener: only the best paths changed."""
        for ch in changes:
            key = (ch.family[0], ch.prefix)
            if ch.new is None:
                self._bests.pop(key, None)
            else:
                self._bests[key] = ch.new
        self._schedule()

    def _loop(self) -> asyncio.AbstractEventLoop:
        return self.loop if self.loop is not None else asyncio.get_running_loop()

    def schedule(self) -> None:
        """The node registry, a backend's paths or anything else besides the best paths may
        have changed: recompute everything (once, however often this is called before)."""
        self._nodes_changed = True
        self._schedule()

    def _schedule(self) -> None:
        """Recompute soon: at the next loop turn, or -- the last recompute took long (a large
        table) -- once as long again has passed since it ended, so that recomputes keep the
        loop at most about half busy however fast the best paths change (a speaker hands one
        batch per UPDATE): the changes meanwhile go in one pass."""
        if self._handle is not None:
            return
        delay = self._done_at + self._cost - self.clock()
        if self._cost < COALESCE_MIN or delay < COALESCE_MIN:
            self._handle = self._loop().call_soon(self._recompute)
        else:
            self._handle = self._loop().call_later(min(delay, self._cost), self._recompute)

    def _on_tick(self) -> None:
        self._tick = None
        self.schedule()

    def _on_retry(self) -> None:
        self._retry = None
        self.schedule()

    def _recompute(self) -> None:
        """Desired kernel routes from the Loc-RIB bests, the node registry and the backends.
        A best path or a peer's record that cannot be routed is refused on its own (in
        :func:`desired_routes`); should anything else fail, the routes programmed stay as they
        are and the error is one log line (again only when it changes), not a traceback at
        every recompute."""
        self._handle = None
        i = self.inputs
        if i.stopping or self.programmer is None or i.underlay is None or i.tunnels is None or i.lease is None:
            return
        started = self.clock()
        try:
            self._program(i)
        except Exception as err:
            self._nodes_changed = True  # whatever failed: all of it again
            if repr(err) != self._failing:
                log.error("routes not recomputed (%s: %s): the routes programmed stay as they are; tried again in "
                          "%.1f s", type(err).__name__, err, self._retry_delay)
                log.debug("the failed route recompute", exc_info=err)
                self._failing = repr(err)
            if self._retry is None:
                self._retry = self._loop().call_later(self._retry_delay, self._on_retry)
                self._retry_delay = min(RETRY_MAX, self._retry_delay * 2)
        else:
            if self._failing is not None:
                log.info("routes recomputed again")
            self._failing = None
            self._retry_delay = RETRY_FIRST
            if self._retry is not None:
                self._retry.cancel()
                self._retry = None
        finally:
            self._done_at = self.clock()
            self._cost = max(0.0, self._done_at - started)

    def _bests_as_text(self) -> list[tuple[str, Any, bool, bool]]:
        """The Loc-RIB bests as (prefix, next hop, local, iBGP); one the speaker gave in a form
        that is not a prefix is left out (logged once while it stays)."""
        out, bad = [], set()
        for (afi, prefix), path in self._bests.items():
            try:
                dst = prefix_to_str(afi, prefix)
            except ValueError as err:
                bad.add((afi, prefix))
                if (afi, prefix) not in self._logged_bad_bests:
                    log.warning("best path %s (AFI %s) not routed: %s", prefix.hex(), afi, err)
                continue
            out.append((dst, path.next_hop, path.source.local, path.source.ibgp))
        self._logged_bad_bests = bad
        return out

    def _program(self, i: RouteInputs) -> None:
        assert self.programmer is not None and i.underlay is not None and i.tunnels is not None
        others = [n for n in i.peering.nodes.values() if n.name != i.name]
        bests = self._bests_as_text()
        cluster = i.cluster
        paths = i.tunnels.paths()
        args: dict[str, Any] = {
            "own_subnets": [str(lease.subnet) for _v, lease in sorted(i.leases.items())],
            "own_backend": i.cfg.network.backend, "encap": i.cfg.network.encap,
            "available": i.tunnels.available, "versions": tuple(sorted(i.leases)),
            "pod_networks": None if cluster is None else [cluster.pool(v)[0] for v in cluster.versions],
            "subnet_lens": None if cluster is None else {v: cluster.pool(v)[1] for v in cluster.versions},
        }  # fmt: skip
        # The node context again only when something it is made of changed: the records (a new
        # object per put), the underlay, the backends' paths, which backends failed to come up
        # (Tunnels tells of a recovery, not of every failure), our subnets, the cluster's pools,
        # or whatever ``schedule`` was told of.
        available = args["available"]
        failed = () if available is None else tuple((b, available(b)) for b in BACKENDS)
        key = (tuple(others), i.underlay, paths, failed,
               *(repr(args[k]) for k in sorted(args) if k != "available"))  # fmt: skip
        if self._nodes_changed or self._context is None or key != self._context_key:
            self._context = node_context(others, i.underlay, paths, **args)
            self._context_key = key
            self._nodes_changed = False
        plan = desired_routes(bests, others, i.underlay, paths, blackhole_metric=BLACKHOLE_METRIC,
                              context=self._context, **args)
        routes = plan.routes
        self.plans = plan.plans
        self.plans_v6 = plan.plans_v6
        self.rows = plan.rows
        self._log_refusals(plan.refused)
        self._log_untrusted(plan.untrusted)
        self._log_untrusted_hops(plan.untrusted_next_hops)
        self._wanted = {r.dst: r for r in routes}
        # The initial sync counts as done (readiness) only once this pass has handed its routes
        # to the programmer: one that fails before that leaves it pending, and is retried.
        synced = self.initial_sync_done or self._initial_sync_complete()
        i.tunnels.apply(
            plan.plans, plan.next_hops, i.peering.nodes, members_known=i.peering.known, prune=synced,
            plans_v6=plan.plans_v6, next_hops_v6=plan.next_hops_v6,
        )
        masq = getattr(i, "masq", None)
        if masq is not None and i.peering.known:
            masq.set_members(member_addresses(i.peering.nodes.values()))
        wanted = {r.dst for r in routes}
        adopted = self._adopted
        if synced and adopted:
            # Re-learned, but its data path not up here yet (a backend a peer needs is still
            # being brought up when the sync completes, a BPF next hop not resolved yet): the
            # previous run's route stays until this run has one to put in its place -- a
            # destination without any route meanwhile has its packets answered "net
            # unreachable".  Once this run routes it (or no longer has a best path for it) the
            # adopted route is forgotten for good.
            pending = set(plan.pending)
            adopted = [r for r in adopted if r.dst in pending and r.dst not in wanted]
            routes += adopted
        if not synced:
            # Keep what a previous run left until BGP has re-learned it (or given up waiting).
            routes += [r for r in adopted if r.dst not in wanted]
            # Re-check every 0.5 s until the sync is complete: one timer, however many
            # recomputes (each best-path change) happen meanwhile.
            if self._tick is None:
                self._tick = self._loop().call_later(0.5, self._on_tick)
        elif self._tick is not None:
            self._tick.cancel()
            self._tick = None
        self.programmer.set_desired(routes)
        self._adopted = adopted
        if synced and not self.initial_sync_done:
            self.initial_sync_done = True
            self.synced_after = self.programmer.reconciles_begun  # the routes just set: in the next one
            if self.restarting:
                log.info("initial BGP sync complete: routes from the previous run no longer pinned")

    def _log_untrusted(self, untrusted: list[dict[str, str]]) -> None:
        """Each node record subnet not held against other nodes' routes logged once while it
        stays so (not at every recompute)."""
        now = {(u["node"], u["subnet"], u["reason"]) for u in untrusted}
        for name, subnet, reason in sorted(now - self._logged_untrusted):
            log.error("node %s's record names subnet %s, %s: not taken as its subnet (its routes are held to the "
                      "pod network only, and no other node's route is refused for it)", name, subnet, reason)
        self._logged_untrusted = now

    def _log_untrusted_hops(self, untrusted: list[dict[str, str]]) -> None:
        """Each next hop a node record claims and is not taken as that node's (forwarding.
        next_hop_owners) logged once while it stays so."""
        now = {(u["node"], u["next_hop"], u["reason"]) for u in untrusted}
        for name, hop, reason in sorted(now - self._logged_hops):
            log.error("node %s's record gives next hop %s, %s: not taken as its next hop (routes through it "
                      "are refused)", name, hop, reason)
        self._logged_hops = now

    def _log_refusals(self, refused: list[dict[str, Any]]) -> None:
        """Each refused best path logged once while it stays refused (a peer may re-send it at
        every recompute).  One that comes back after being dropped is logged again: at once if
        it was not refused within REFUSAL_MEMORY, else (a flapping router's route, one line
        each per flap) at most once a minute per peer, with the number of those held back."""
        self.refused = refused
        now = {(r["dst"], r["peer"], r["reason"]) for r in refused}
        at = self.clock()
        self._refused_at = {k: t for k, t in self._refused_at.items() if at - t < REFUSAL_MEMORY}
        for dst, peer, reason in sorted(now - self._logged_refusals):
            again = (dst, str(peer)) in self._refused_at
            self._refusing_peers.add(str(peer))  # paced per peer, not with every peer
            self._refusal_log.log(logging.WARNING, "route-refused", str(peer), at,
                                  "route to %s via %s not installed: %s", dst, peer, reason, force=not again)
        for dst, peer, _reason in now:
            self._refused_at[(dst, str(peer))] = at
        self._logged_refusals = now
        peers = {peer for _dst, peer in self._refused_at}
        for peer in self._refusing_peers - peers:  # nothing refused for an hour: its count goes in one
            self._refusing_peers.discard(peer)
            self._refusal_log.forget(peer, at)
        self._refusal_log.expire(at)
        self._schedule_refusal_flush()

    def _schedule_refusal_flush(self) -> None:
        """A timer for the end of the minute in which refusals were held back: their count is
        logged then, also when no refusal comes after them to carry it."""
        due = self._refusal_log.next_flush()
        if due is not None and self._refusal_flush is None:
            self._refusal_flush = self._loop().call_later(max(0.0, due - self.clock()), self._flush_refusals)

    def _flush_refusals(self) -> None:
        self._refusal_flush = None
        self._refusal_log.flush(self.clock())
        self._schedule_refusal_flush()

    def _initial_sync_complete(self) -> bool:
        """RFC 4724 §4.1: every peer Established with End-of-RIB received, or the deadline passed."""
        i = self.inputs
        if i.speaker is None or not i.started_bgp:
            return False
        if time.monotonic() >= self.initial_sync_deadline:
            return True
        if not i.peering.known:
            return False  # no registry snapshot yet: the cluster's peers are not configured (external ones may be)
        for peer in i.speaker.peers.values():
            if peer.state is not State.ESTABLISHED:
                return False
        return not i.speaker.initial_sync_pending()

    def installed(self) -> list[dict[str, Any]]:
        """GET /routes: every wanted route, and whether the kernel has it: our route for its
        destination is the wanted one (gateway, device, metric...) and the last attempt to
        install it did not fail (a refused replace leaves the old route in place)."""
        prog = self.programmer
        if prog is None:
            return [dict(row, installed=False) for row in [*self.rows, *self.refused]]
        kernel = {r.dst: r for r in prog.programmed()}
        failures = prog.failures
        rows = []
        for row in self.rows:
            want = self._wanted.get(row["dst"])
            if want is None:
                try:
                    want = self._wanted.get(canonical_dst(row["dst"]))
                except InvalidRoute:
                    pass
            have = kernel.get(want.dst) if want is not None else None
            ok = have is not None and same_route(want, have) and want.dst not in failures
            rows.append(dict(row, installed=ok))
        return rows + [dict(row, installed=False) for row in self.refused]
