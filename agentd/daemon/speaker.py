"""``agentd speaker``: the BGP speaker alone (a dedicated route reflector, interop tests).

Also the conversions from agentd's configuration to the speaker's settings, which the
node agent reuses, and the speaker's Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import time
from collections.abc import Callable
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from bgp import ListenRange, LocalSettings, Origination, PeerSettings, Speaker, State
from bgp.transport import SpeakerService
from bgp.views import peer_views
from proto.nlri import IPV4_UNICAST, IPV6_UNICAST, prefix_from_str

from agentd.daemon.api import ApiServer
from agentd.daemon.bgp_json import peer_row
from agentd.config.settings import BgpPeerConfig, Config, ConfigError, reloaded

log = logging.getLogger("agentd.speaker")


def local_settings(
    cfg: Config, *, restarting: bool = False, forwarding_preserved: bool | None = None
) -> LocalSettings:
    bgp = cfg.bgp
    router_id = bgp.router_id or cfg.node.address
    if router_id is None:
        raise ConfigError(
            "not set and [node] address unknown", source="default", key="bgp.router_id", where="[bgp] router_id"
        )
    cluster_id = None
    if cfg.node.route_reflector:
        cluster_id = cfg.node.cluster_id or router_id
    return LocalSettings(
        asn=bgp.asn,
        router_id=IPv4Address(router_id),
        hold_time=bgp.hold_time,
        keepalive_time=bgp.keepalive_time or None,
        connect_retry_time=float(bgp.connect_retry),
        cluster_id=cluster_id,
        graceful_restart=bgp.graceful_restart,
        restart_time=bgp.restart_time,
        restarting=restarting,
        forwarding_preserved=forwarding_preserved,
        next_hop_v6=getattr(bgp, "next_hop_v6", None),
        # IPv4 routes over an IPv6 session (an external peer at an IPv6 address in a dual-stack
        # cluster): the node's IPv4 address.  An IPv6-only node has none, and offers no IPv4.
        next_hop_v4=cfg.node.address if cfg.network.ip_family != "ipv6" else None,
        # An IPv6-only cluster's sessions carry IPv6 alone; the others offer both families
        # (a dual-stack cluster's IPv6 routes ride the IPv4 sessions).
        families=(IPV6_UNICAST,) if cfg.network.ip_family == "ipv6" else (IPV4_UNICAST, IPV6_UNICAST),
        send_timeout=bgp.send_timeout,
        update_delay=bgp.batch_delay,
    )


def bfd_timers(cfg: Config, enabled: bool | None = None) -> tuple[float, int] | None:
    """The BFD (interval, multiplier) of a session, or None when it has no BFD."""
    on = cfg.bgp.bfd if enabled is None else enabled
    return (cfg.bgp.bfd_interval, cfg.bgp.bfd_multiplier) if on else None


def peer_settings(p: BgpPeerConfig, cfg: Config, *, description: str = "") -> PeerSettings:
    return PeerSettings(
        address=p.address,
        asn=p.asn,
        port=p.port,
        passive=p.passive,
        rr_client=p.rr_client,
        password=p.password,  # its own key only: [bgp] password is for the node-to-node sessions
        hold_time=cfg.bgp.hold_time if p.hold_time is None else p.hold_time,
        local_address=p.local_address,
        description=p.description or description,
        max_prefixes=p.max_prefixes,
        max_prefixes_warning=p.max_prefixes_warning / 100,
        max_prefixes_restart=float(p.max_prefixes_restart) if p.max_prefixes_restart else None,
        ttl_security=p.ttl_security,
        bfd=bfd_timers(cfg, p.bfd),
    )


def listen_ranges(cfg: Config) -> list[ListenRange]:
    """[[bgp.listen_ranges]] as the speaker's dynamic-neighbour ranges."""
    out = []
    for r in cfg.bgp.listen_ranges:
        template = PeerSettings(
            address=r.prefix.network_address,  # replaced by each peer's own address
            asn=r.asn,
            passive=True,
            rr_client=r.rr_client,
            password=r.password,
            hold_time=cfg.bgp.hold_time if r.hold_time is None else r.hold_time,
            description=r.description or "dynamic",
            max_prefixes=r.max_prefixes,
            max_prefixes_warning=r.max_prefixes_warning / 100,
            max_prefixes_restart=float(r.max_prefixes_restart) if r.max_prefixes_restart else None,
            ttl_security=r.ttl_security,
            bfd=bfd_timers(cfg, r.bfd),
        )
        out.append(ListenRange(r.prefix, template))
    return out


def originations(cfg: Config) -> list[Origination]:
    out = []
    for net in cfg.bgp.originate:
        afi, prefix = prefix_from_str(str(net))
        out.append(Origination((afi, 1), prefix))
    return out


class SpeakerMetrics:
    """Prometheus collector for a speaker: peer state, prefix counts, BFD, and the totals of the
    problems the speaker logs only once a minute (bgp.loglimit)."""

    def __init__(self, service: Callable[[], SpeakerService | None]) -> None:
        self._service = service

    def collect(self):
        up = GaugeMetricFamily("agentd_bgp_peer_up", "1 when the BGP session is Established", labels=["peer"])
        state = GaugeMetricFamily(
            "agentd_bgp_peer_state", "RFC 4271 FSM state (1 Idle .. 6 Established)", labels=["peer"]
        )
        received = GaugeMetricFamily(
            "agentd_bgp_prefixes_received", "prefixes in the peer's Adj-RIB-In", labels=["peer"]
        )
        sent = GaugeMetricFamily("agentd_bgp_prefixes_sent", "prefixes in the peer's Adj-RIB-Out", labels=["peer"])
        loc = GaugeMetricFamily("agentd_bgp_loc_rib_prefixes", "prefixes in the Loc-RIB")
        events = CounterMetricFamily(
            "agentd_bgp_events", "speaker-wide events: resets for max-prefix, BFD or internal errors, "
            "route refreshes deferred or folded, routes ignored, connections refused", labels=["event"],
        )  # fmt: skip
        problems = CounterMetricFamily(
            "agentd_bgp_problems", "per-message problems by kind and peer (each logged at most once a minute)",
            labels=["kind", "peer"],
        )  # fmt: skip
        bfd_up = GaugeMetricFamily("agentd_bfd_session_up", "1 while the BFD session is Up", labels=["peer"])
        bfd_changes = CounterMetricFamily("agentd_bfd_state_changes", "BFD session state changes", labels=["peer"])
        service = self._service()
        sp = service.speaker if service is not None else None
        if sp is not None:
            for key, peer in sp.peers.items():
                st = peer.state
                up.add_metric([key], 1.0 if st is State.ESTABLISHED else 0.0)
                state.add_metric([key], float(int(st)))
                adj = sp.rib.adj_in.get(key)
                received.add_metric([key], float(len(adj) if adj is not None else 0))
                sent.add_metric([key], float(sp.adj_out_count(key)))
            loc.add_metric([], float(sp.rib.count()))
            for event, n in sorted(sp.counters.items()):
                events.add_metric([event], float(n))
            for (kind, subject), n in sorted(sp.limiter.counts.items()):
                problems.add_metric([kind, subject], float(n))
        if service is not None and service.bfd is not None:
            for row in service.bfd.status():
                bfd_up.add_metric([row["peer"]], 1.0 if row["state"] == "Up" else 0.0)
                bfd_changes.add_metric([row["peer"]], float(row.get("state_changes", 0)))
        yield from (up, state, received, sent, loc, events, problems, bfd_up, bfd_changes)


def peer_rows(service: SpeakerService) -> list[dict[str, Any]]:
    """The speaker's peer table with ``since`` as a UNIX timestamp (README.md "REST": /peers)."""
    bfd = {r["peer"]: r["state"] for r in service.bfd.status()} if service.bfd is not None else {}
    return [dict(peer_row(v, service.wall_time), bfd=bfd.get(v.address)) for v in peer_views(service.speaker)]


RUNNING_FILE = "speaker.running"  # in [agent] state_dir


class RunMarker:
    """How ``agentd speaker`` knows it is restarting, as the agent knows it from the kernel
    routes a previous run left: a file in ``[agent] state_dir`` that says a speaker with
    graceful restart ran here and did not withdraw its routes (RFC 4724).  Written once the
    speaker is up, kept by a graceful stop and by a crash, removed by a stop that withdraws
    (Cease to every peer: nobody keeps our routes) or a start without graceful restart.
    Found at start: the peers may hold our routes as stale, so the OPENs carry Restart State
    and route selection is deferred (§4.1).  A failure to read or write it is logged; the
    speaker then starts as if fresh."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / RUNNING_FILE

    def found(self) -> bool:
        try:
            return self.path.exists()
        except OSError as err:
            log.warning("cannot read %s (%s): starting as if no speaker ran before", self.path, err.strerror or err)
            return False

    def write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(f"{os.getpid()}\n")
        except OSError as err:
            log.warning("cannot write %s (%s): a restart after a crash will not be known as one", self.path,
                        err.strerror or err)

    def remove(self) -> None:
        try:
            self.path.unlink(missing_ok=True)
        except OSError as err:
            log.warning("cannot remove %s (%s): the next start will say it restarted", self.path, err.strerror or err)


def _holder(host: object, port: int, err: OSError, key: str) -> str:
    """What an address in use is taken by, for the error line: a process of another user
    than root or ours, named; else the likely one (the speaker's defaults are the agent's)."""
    if err.errno != errno.EADDRINUSE:
        return ""
    from agentd.daemon.listeners import untrusted_owner, user_name

    uid = untrusted_owner(str(host), port, os.geteuid())
    if uid is not None:
        return f"; a process of {user_name(uid)} listens there, neither root nor this speaker's user"
    return f" (an agent or another speaker on this node? give this speaker its own {key})"


class SpeakerRuntime:
    """The status provider and lifecycle of ``agentd speaker``."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.set_logging: Callable[[str, str], None] | None = None
        self.registry = CollectorRegistry()
        self.marker = RunMarker(cfg.agent.state_dir)
        restarting = cfg.bgp.graceful_restart and self.marker.found()
        if restarting:
            log.info("%s is there: a previous speaker did not withdraw its routes, restarting gracefully "
                     "(Restart State, route selection deferred)", self.marker.path)
        # The speaker's routes come from its configuration, so they survive any restart: tell
        # GR peers to keep them until our End-of-RIB (RFC 4724 §4.2, the F bit).
        self.speaker = Speaker(local_settings(cfg, restarting=restarting, forwarding_preserved=True),
                               now=time.monotonic())
        self.registry.register(SpeakerMetrics(lambda: self.service))
        listen = (cfg.bgp.listen.host, cfg.bgp.listen.port) if cfg.bgp.listen else None
        self.service = SpeakerService(self.speaker, listen=listen, backlog=cfg.bgp.listen_backlog)
        self.api = ApiServer(self, cfg.api.listen.host, cfg.api.listen.port)
        self._stop = asyncio.Event()
        self._started = False

    # ------------------------------------------------------------ StatusProvider

    def health(self) -> tuple[bool, list[str]]:
        return True, []

    def readiness(self) -> tuple[bool, list[str]]:
        return (True, []) if self._started else (False, ["speaker not started"])

    def status(self) -> dict[str, Any]:
        local = self.speaker.local
        return {
            "node": {
                "name": self.cfg.node.name,
                "address": str(self.cfg.node.address) if self.cfg.node.address else None,
                "asn": local.asn,
                "subnet": None,
                "backend": None,
                "route_reflector": local.is_route_reflector,
            },
            "bgp": {
                "router_id": str(local.router_id),
                "cluster_id": str(local.cluster_id) if local.cluster_id else None,
                "peers": self.peers(),
                "loc_rib_prefixes": self.speaker.rib.count(),
            },
            "routes": {"programmed": 0, "last_sync": None},
            "datastore": {"connected": False, "endpoints": [], "endpoint": None},
            "ready": self._started,
        }

    def peers(self) -> list[dict[str, Any]]:
        return peer_rows(self.service)

    def bgp_speaker(self) -> Speaker | None:
        return self.speaker

    def routes(self) -> list[dict[str, Any]]:
        return []

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, config_path: str | None = None, reload: Callable[[], Config] | None = None,
                  set_logging: Callable[[str, str], None] | None = None) -> int:
        """Serve until SIGTERM or SIGINT: 0; 1 if the API or the BGP listener cannot have its
        address (one error line, nothing left running, no speaker.running written).  A stop
        during start-up ends it after the step under way: no peer configured, speaker.running
        as a previous run left it (nothing of ours was announced), 0."""
        self.set_logging = set_logging  # how a reload applies [log] (the CLI's set-up)
        loop = asyncio.get_running_loop()
        # Before the first await: a SIGTERM during start-up stops us once started, not Python's default.
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        try:
            if not await self._start():
                return 1
            if reload is not None:
                loop.add_signal_handler(signal.SIGHUP, lambda: self._reload(reload))
            await self._stop.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            if loop.remove_signal_handler(signal.SIGHUP):
                signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as before the handler (agentd.entry), not its default
            if self._started:
                graceful = self.cfg.bgp.graceful_restart
                log.info("stopping (%s)", "graceful restart: peers keep our routes" if graceful else "withdrawing")
                await self.service.stop(graceful=graceful)
                if not graceful:
                    self.marker.remove()  # the peers dropped our routes: the next start is a fresh one
                await self.api.stop()
            else:
                # A start cut short, by a stop or an exception: nothing is left serving, and the
                # marker is left alone (no session of ours came up to keep our routes).
                if self._stop.is_set():
                    log.info("stopping before start-up completed: no peer configured")
                if self.speaker.started:
                    await self.service.stop(graceful=True)
                await self.api.stop()
        return 0

    async def _start(self) -> bool:
        """The API first, as the agent's (a second daemon on the node stops before it touches
        anything), then the BGP listener and the sessions; speaker.running once all is up.
        False, after one error line naming the key, if either address cannot be had."""
        api = self.cfg.api.listen
        try:
            await self.api.start()
        except OSError as err:  # the port is taken (an agent on this node: the same default), the address not ours
            log.error("cannot serve the API on %s ([api] listen): %s%s", api, err.strerror or err,
                      _holder(api.host, api.port, err, "[api] listen"))
            return False
        if self._stop.is_set():  # SIGTERM meanwhile (run stops the API)
            return True
        try:
            await self.service.start()
        except OSError as err:
            bgp = self.cfg.bgp.listen
            log.error("cannot listen for BGP on %s ([bgp] listen): %s%s", bgp, err.strerror or err,
                      _holder(bgp.host, bgp.port, err, "[bgp] listen") if bgp is not None else "")
            await self.api.stop()
            return False
        if self._stop.is_set():  # neither peers nor speaker.running (run stops the listener)
            return True
        self.service.set_peers(peer_settings(p, self.cfg) for p in self.cfg.bgp.peers)
        self.service.set_listen_ranges(listen_ranges(self.cfg))
        self.service.set_originated(originations(self.cfg))
        self.service.peers_configured()  # its peers are those of its configuration
        if self.cfg.bgp.graceful_restart:
            self.marker.write()
        else:
            self.marker.remove()
        self._started = True
        log.info(
            "speaker AS %s router id %s: %d peers, %d prefixes originated",
            self.speaker.local.asn,
            self.speaker.local.router_id,
            len(self.cfg.bgp.peers),
            len(self.cfg.bgp.originate),
        )
        return True

    def stop(self) -> None:
        self._stop.set()

    def _reload(self, reload: Callable[[], Config]) -> None:
        """SIGHUP: re-read the configuration; the peers, listen ranges, originated prefixes and
        [log] change live, everything else (``[bgp] hold_time``...) waits for a restart, as in
        the agent's reload (agentd.config.settings.reloaded): a peer without a hold_time of its own
        keeps offering the running [bgp] hold_time, so its session is left alone."""
        try:
            read = reload()
        except ConfigError as err:
            log.error("reload failed, keeping the running configuration: %s", err)
            return
        cfg, pending, refused = reloaded(self.cfg, read, also=("originate",))
        self.cfg = cfg
        if self.set_logging is not None:
            self.set_logging(cfg.log.level, cfg.log.format)
        else:
            logging.getLogger().setLevel(cfg.log.level.upper())
        if refused is None:  # else the running peers and ranges stay, as they are
            self.service.set_peers(peer_settings(p, cfg) for p in cfg.bgp.peers)
            self.service.set_listen_ranges(listen_ranges(cfg))
        self.service.set_originated(originations(cfg))
        log.info("configuration reloaded: %d peers, %d prefixes originated", len(cfg.bgp.peers), len(cfg.bgp.originate))
        if pending:
            log.warning("changed but applied only by a restart: %s", ", ".join(pending))
        if refused is not None:
            log.error("reload: %s", refused)
