"""``agentd run``: the node agent.

Start-up order (nothing on the system is touched before the configuration, already
validated by the CLI, and the underlay interface check pass):

1. the API (so /healthz and /readyz answer while the rest comes up), then its token file
   (so a second agent on this host, which cannot have the API, stops before it replaces it);
2. the route programmer, which ADOPTS the kernel routes a previous run left (no flush);
   finding some means we are restarting, so BGP advertises Restart State (RFC 4724);
3. etcd: cluster config (first writer wins), our subnets -- one per pod family of the
   cluster, IPv4 and/or IPv6 (the ones we had, from the subnet file or etcd) --, the CNI
   files, our node record under a liveness lease;
4. the blackhole routes for our subnets and our backend's devices;
5. BGP: we originate our subnets; the peer set follows the node registry (mesh or route
   reflectors) plus configured external peers; Loc-RIB changes become kernel routes.

Until every peer has sent End-of-RIB (or ``restart_time`` passes) routes adopted at start
stay installed even if not yet re-learned, so a restart never removes a route.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from bgp import Origination, Speaker
from bgp.transport import SpeakerService
from proto.nlri import network_to_prefix


from agentd.cni import netconf as cni_netconf
from agentd.daemon import auth, mesh, node_files
from agentd.daemon.api import ApiServer, Conflict
from agentd.daemon.leave_report import REPORT_FILE, LeaveReport, LeaveStep, StepSkipped, write_report
from agentd.daemon.observe import Observability, drop_log
from agentd.daemon.routes import KernelRoutes, drop_previous_protocol
from agentd.daemon.views import AgentViews
from agentd.dataplane.backends import (
    Tunnels,
    dataplane_metrics,
    remove_bpf_leftovers,
    remove_vxlan_leftover,
    remove_worker_leftovers,
)
from agentd.dataplane.bpf.datapath import BpfUnavailable, for_log
from agentd.dataplane.bpf.podpath import WIRE_PROGRAM, PodFastPath, remove_pinned_fast_path
from agentd.config.settings import IPV6_MIN_MTU, Config, ConfigError, RunningHost, load_config, reloaded
from agentd.flows.recorder import restore_sysctls
from agentd.nft import flowmask
from agentd.datastore.store import ClusterConfig, Datastore, NodeRecord, SubnetLease
from agentd.kernel import sysctl
from agentd.kernel.netinfo import NetInfoError, Underlay, underlay_for
from agentd.policy import podmacs
from agentd.policy.agent import PolicyAgent, remove_policy_tables  # NetworkPolicy
from agentd.nft import masquerade
from agentd.nft import libnftables
from agentd.nft.libnftables import NftError
from agentd.services.agent import ServiceAgent, remove_services_table  # Services
from agentd.ingress import remove_ingress_proxy  # Ingress (the controller is imported when enabled)
from agentd.kernel.route_model import SyncResult
from agentd.kernel.routing import RouteProgrammer, remove_routes_of
from agentd.daemon.sdnotify import Notifier
from agentd.daemon.speaker import SpeakerMetrics, listen_ranges, local_settings
from agentd.daemon.supervisor import Supervisor

if TYPE_CHECKING:
    from agentd.ingress.controller import IngressController

log = logging.getLogger("agentd")

AFI = {4: 1, 6: 2}  # IANA address family numbers: IPv4, IPv6 (RFC 4760 §3)
# A leave's step may take this long, told to systemd before each (EXTEND_TIMEOUT_USEC): the
# etcd step waits up to 10 + 10 s on an unreachable etcd, the ingress proxy's stop up to 15 s
# and its unpublishing 5 s -- past the unit's TimeoutStopSec of 30 s, after which systemd kills
# the agent and Restart=on-failure starts it again, to join the cluster it was leaving.
LEAVE_STEP_SECONDS = 60
SAFI_UNICAST = 1
# systemd's STATUS= through start-up, in order (docs/operations.md, "Type=notify"); then the
# readiness loop's "not ready: ..." or READY=1 with "ready: ...".
START_STEPS = (
    "connecting to etcd",  # and reading (or writing) the cluster's configuration there
    "acquiring a subnet lease",
    "programming policy and services",  # the pod fast path, NetworkPolicy, Services, flow records, Ingress
    "setting up the tunnels",  # the backends, the CNI files, masquerading
    "registering the node in etcd",
    "starting BGP",
)


def renew_flow_mask(mask: Any = flowmask) -> None:
    """An earlier agent's pod programs may still record, beside its mask table (blocking): the
    table as this version writes it, before this version's programs -- which record a connection
    only where the rule marked its conntrack entry -- load.  Where it cannot be remade (no
    conntrack marks in the kernel, libnftables gone), it is removed: an older rule that masks
    without marking would leave connections recorded by nobody, while with no rule conntrack's
    events tell of every connection until the recorder opens."""
    try:
        if mask.renew():
            log.info("flow records: the mask table an earlier run left renewed before the pod programs load")
    except (OSError, NftError) as err:
        mask.remove_quietly()
        log.warning("flow records: the mask table an earlier run left could not be renewed (%s): removed, "
                    "so that conntrack's events tell of every connection until the recorder opens", err)


class AgentError(RuntimeError):
    """A start-up problem that stops the agent with one clear line."""


class Agent:
    def __init__(self, cfg: Config, *, config_path: str | None = None, overrides: dict | None = None,
                 config_named: bool = True, set_logging: Callable[[str, str], None] | None = None) -> None:
        """``config_named``: the file was named (``--config``, ``AGENTD_CONFIG``), so it must be
        there at every reload; the default file may be missing (defaults and environment) until
        it has been read (``cfg.source``): from then on it must be there too.
        ``set_logging(level, format)``: how a reload applies ``[log]`` (the CLI's set-up)."""
        self.cfg = cfg
        self.set_logging = set_logging
        self.config_path = config_path
        self.config_named = config_named
        self.config_read = cfg.source is not None  # a file read once is required at a reload
        self.overrides = overrides or {}
        self.name = cfg.node.name or "node"
        # The node's primary underlay address: IPv4, or IPv6 in an IPv6-only cluster.
        self.address: IPv4Address | IPv6Address = cfg.node.address or cfg.node.address_v6  # type: ignore[assignment]
        self.notifier = Notifier()
        self.supervisor = Supervisor()
        self.registry = CollectorRegistry()
        self.sync_histogram = Histogram(
            "agentd_route_sync_seconds", "time to reconcile kernel routes", registry=self.registry
        )
        self.registry.register(SpeakerMetrics(lambda: self.service))
        self.registry.register(_AgentMetrics(self))
        views = AgentViews(self)
        self.api = ApiServer(views, cfg.api.listen.host, cfg.api.listen.port)
        # Flow records and the cluster view (agentd/daemon/observe.py); the read-only listener
        # other nodes gather from starts once the read token is known.
        self.observe = Observability(cfg, self.name, self._node_addresses)
        self.read_api: ApiServer | None = None
        if cfg.api.cluster_port:
            self.read_api = ApiServer(views, str(self.address), cfg.api.cluster_port,
                                      read_token=lambda: self.observe.cluster.token,
                                      nodes=self._registered_addresses)
        self.underlay: Underlay | None = None
        self.programmer: RouteProgrammer | None = None
        self.datastore: Datastore | None = None
        self.speaker: Speaker | None = None
        self.service: SpeakerService | None = None
        self.tunnels: Tunnels | None = None
        self.masq: masquerade.Masquerade | None = None  # [network] ip_masq's tables; their member set follows the nodes
        self.cluster: ClusterConfig | None = None
        self.policy: PolicyAgent | None = None  # NetworkPolicy
        self.services: ServiceAgent | None = None  # Services
        self.ingress: IngressController | None = None  # Ingress
        self.lease: SubnetLease | None = None  # the first of ``leases`` (IPv4 where the node has one)
        self.leases: dict[int, SubnetLease] = {}  # by IP version: both in a dual-stack cluster
        self.peering = mesh.Peering(self.name)  # the node registry as read, and the peers it implies
        self.routes = KernelRoutes(self)  # best paths -> kernel routes (agentd/daemon/routes.py)
        self._peers_handle: asyncio.Handle | None = None  # the node events' peer set, applied once a batch
        self.started_bgp = False
        self._stop = asyncio.Event()
        self.stopping = False  # no more route changes: a graceful stop leaves the kernel as it is
        self.reload_error: str | None = None  # why the last reload failed (STATUS=), None once one succeeds
        self._leaving = False
        self._publishing: set[asyncio.Task] = set()  # node data being published (_node_data_changed)
        # `agentd leave`'s answer: None once the node has left etcd, else why it has not.
        self._left: asyncio.Future[str | None] | None = None
        # Every step of that leave and its result (agentd/daemon/leave_report.py).
        self._leave_report: LeaveReport | None = None
        self._leave_report_unwritable = False
        # What runs degraded, never retried (no libnftables, ip_masq, IP forwarding): shown in
        # /status "problems" and systemd's STATUS=, not a reason to be unready (DESIGN: ready
        # once the lease is held, BGP started and routes reconciled).
        self._problems: list[str] = []
        self._fatal: str | None = None  # why the agent stops itself: not ready
        self._subnet_taken = False  # our subnet was lost: _shutdown removes our node record
        self._lost: dict[int, IPv4Network | IPv6Network] = {}  # the subnets lost, by IP version
        self.exit_status = 0  # 1 when the agent stops itself (its subnet lost)
        self.pod_mtu = 1500

    # ================================================================ lifecycle

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        try:
            # `ip -json address show` in a subprocess: blocking, keep it off our loop.
            v6 = self.cfg.node.address_v6 if self.cfg.network.ip_family != "ipv4" else None
            self.underlay = await asyncio.to_thread(underlay_for, self.address, v6)
        except NetInfoError as err:
            log.error("%s", err)
            return 1
        self.pod_mtu = self.cfg.network.mtu or self.cfg.network.pod_mtu(self.underlay.mtu, self.underlay.family)
        if 6 in self.cfg.network.families and self.pod_mtu < IPV6_MIN_MTU:
            log.error("the pod MTU would be %d (underlay %s: %d, less the %s overhead), below %d, the least every "
                      "IPv6 link must carry (RFC 8200 §5)", self.pod_mtu, self.underlay.ifname, self.underlay.mtu,
                      self.cfg.network.backend, IPV6_MIN_MTU)
            return 1
        # The API first: an agent that cannot have it (another agent runs here) stops before it
        # touches anything, that agent's token file included.  Until the token is written the
        # API accepts no changes (auth.guard: no token, no POST).
        try:
            await self.api.start()
        except OSError as err:  # the port is taken, the address is not ours
            log.error("cannot serve the API on %s ([api] listen): %s%s", self.cfg.api.listen, err.strerror or err,
                      api_port_holder(self.cfg.api.listen.host, self.cfg.api.listen.port) if err.errno == errno.EADDRINUSE else "")
            return 1
        try:  # a new API token for this run: POST /leave needs it (agentd/daemon/auth.py)
            self.api.token = await asyncio.to_thread(auth.write_token_file, self.cfg.api.token_file, self.cfg.api.token_group)
        except auth.TokenFileError as err:
            log.error("%s", err)
            await self.api.stop()
            return 1
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        self.supervisor.start("watchdog", self.notifier.watchdog_loop)
        try:
            # Start-up can wait a long time (etcd unreachable): a SIGTERM meanwhile must still stop us.
            start = asyncio.ensure_future(self._start())
            stop = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not start.done():
                log.info("stopping during start-up")
                start.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await start
            else:
                stop.cancel()
                await self._run_started(start)
        except AgentError as err:
            log.error("%s", err)
            self.exit_status = 1
        finally:
            status = await self._stop_and_say(loop)  # the status the stop settles (a leave's etcd step)
        return status

    async def _run_started(self, start: asyncio.Future) -> None:
        """Start-up ended: its error, or the supervised tasks until the agent is told to stop."""
        try:
            start.result()
        except (AgentError, asyncio.CancelledError):
            raise
        except Exception as err:  # a bad record in etcd, a full pool, etcd refusing us, a file not written
            log.debug("start-up failed", exc_info=True)
            raise AgentError(f"cannot start: {str(err) or type(err).__name__}") from err
        self.supervisor.start("node-watch", self._watch_nodes)
        if self.policy is not None:
            self.supervisor.start("policy", self.policy.run)
        if self.services is not None:
            self.supervisor.start("services", self.services.run)
        if self.observe.recorder is not None:
            self.supervisor.start("flows", self.observe.recorder.run)
        if self.datastore is not None:  # the read token; then the read-only listener
            self.supervisor.start("cluster-token",
                                  lambda: self.observe.keep_read_token(self.datastore, self._start_read_api))
        if self.ingress is not None:
            self.supervisor.start("ingress", self.ingress.run)
        self.supervisor.start("readiness", self._readiness_loop)
        await self._stop.wait()

    async def _stop_and_say(self, loop: asyncio.AbstractEventLoop) -> int:
        """``_shutdown``, then the exit status.  A second Ctrl-C, SIGTERM or SIGHUP must not
        abort the stop midway (the default handlers would): said, and ignored, until it is done."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._already_stopping, sig)
        try:
            await self._shutdown()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            # Ignored, not its default action (what removing the handler leaves): death by SIGHUP
            # is a clean exit to systemd, and an exit 1 so ended would not be restarted.
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        return self.exit_status

    @staticmethod
    def _already_stopping(sig: signal.Signals) -> None:
        log.warning("%s: already stopping", signal.Signals(sig).name)

    async def _start(self) -> None:
        cfg = self.cfg
        assert self.underlay is not None
        self.programmer = RouteProgrammer(
            protocol=cfg.network.route_protocol, resync_interval=cfg.agent.route_resync
        )
        self.programmer.on_sync = self._on_sync
        await self.programmer.start()
        self.routes.adopt(self.programmer)  # until BGP has re-learned everything, keep what we found

        self.datastore = datastore_for(cfg)
        self.datastore.on_subnet_lost = self._subnet_lost
        self._starting("connecting to etcd")
        await self.datastore.connect()
        self.cluster = await self.datastore.ensure_cluster_config(wanted_cluster(cfg))
        check_cluster(cfg, self.cluster)
        # A previous run under another [network] route_protocol: its routes go (their keys
        # would make every add a conflict), before this run installs any.
        await drop_previous_protocol(Path(cfg.agent.state_dir), cfg.network.route_protocol,
                                     [self.cluster.pool(v)[0] for v in self.cluster.versions])
        if 6 in self.cluster.versions and self.pod_mtu < IPV6_MIN_MTU:  # pods get IPv6 as the cluster says
            raise AgentError(f"the cluster in etcd is {self.cluster.ip_family}: pods get IPv6, but the pod MTU would be "
                             f"{self.pod_mtu}, below {IPV6_MIN_MTU}, the least every IPv6 link must carry (RFC 8200 §5)")
        previous = node_files.previous_subnets(cfg)
        previous_mtu = node_files.previous_mtu(cfg)
        self.tunnels = Tunnels(cfg, self.underlay, self.name, on_node_data=self._node_data_changed,
                               on_paths=self.routes.schedule)
        self._starting("acquiring a subnet lease")
        for version in self.cluster.versions:
            lease = await self.datastore.acquire_subnet(
                self.name, self.address, cfg.network.backend, {}, cluster=self.cluster, previous=previous.get(version),
                version=version,
            )  # fmt: skip
            self.leases[version] = lease
            log.info("node %s holds subnet %s%s", self.name, lease.subnet,
                     " (kept from before)" if lease.subnet == previous.get(version) else "")
            if previous.get(version) is not None and lease.subnet != previous[version]:
                log.warning("this node's subnet changed from %s to %s: pods and containers on the old subnet "
                            "must be created again; a Docker host runs `agentd docker-opts` and restarts Docker",
                            previous[version], lease.subnet)
        if previous_mtu is not None and previous_mtu != self.pod_mtu:
            log.warning("the pod MTU changed from %d to %d: pods and containers made before keep the old one until "
                        "they are created again; a Docker host runs `agentd docker-opts` and restarts Docker",
                        previous_mtu, self.pod_mtu)
        self.lease = next(iter(self.leases.values()))
        await self._forwarding()
        # NetworkPolicy: adopt the policy tables as they are; they change only once
        # the resources in etcd have been read (the "policy" task).  Until its first sync says
        # no pod here is isolated, the BPF data path hands no packet to a pod past netfilter.
        self._starting("programming policy and services")
        fast_path, fast_path_error = await self._open_fast_path()
        if fast_path is not None:
            if fast_path.routed and fast_path.wire is None:
                self.tunnels.bpf.gate = WIRE_PROGRAM  # decapsulated packets meet it while the redirect is held
            if cfg.flows.enabled and cfg.flows.connections:  # what it carries counts in the connections' end records
                try:
                    await asyncio.to_thread(fast_path.set_counting, True)
                except OSError as err:
                    log.warning("flow records will miss what the pod fast path carries: %s", err)
        if cfg.flows.enabled and cfg.flows.connections:  # conntrack must see every connection start and end
            self.tunnels.bpf.holders.add("flows")
        self.policy = PolicyAgent(self.name, self.datastore, str(cfg.cni.data_dir), registry=self.registry,
                                  on_isolation=self.tunnels.bpf.hold_redirect, fast_path=fast_path,
                                  before_ack=self.tunnels.bpf.guard_bridges,
                                  fast_path_error=fast_path_error, drop_log=drop_log(cfg),
                                  route_all=cfg.flows.enabled and cfg.flows.connections,
                                  families=self.cluster.versions,  # the cluster's pod families (its record wins)
                                  check_source_mac=cfg.policy.check_source_mac,
                                  state_dir=cfg.agent.state_dir,  # the MACs read of pods' interfaces
                                  service_ranges=self.cluster.service_ranges().values())
        try:
            await self.policy.start()
            self.registry.register(self.policy.views)
            self.tunnels.bpf.holders.add("policy")
        except NftError as err:  # no libnftables: pods are routed, but policy is not enforced
            log.error("network policy is not enforced on this node: %s", err)
            self._problems.append(f"network policy not enforced: {err}")
            self.policy = None
            if fast_path is not None:  # nothing would keep its pods up to date: it goes
                await self._remove_fast_path(fast_path)
                self.tunnels.bpf.gate = None
                fast_path = None
        # Services: adopt the services table as it is; it changes once etcd is read.
        self.services = ServiceAgent(self.name, self.datastore, dns_config=cfg.dns, drop_log=drop_log(cfg),
                                     on_translating=self._services_translating,
                                     families=self.cluster.versions,
                                     pod_subnets={v: str(lease.subnet) for v, lease in self.leases.items()},
                                     pod_networks=[str(self.cluster.pool(v)[0]) for v in self.cluster.versions],
                                     service_ranges={r.version: str(r) for r in self.cluster.service_ranges().values()})
        try:
            await self.services.start()
            self.registry.register(self.services.views)
            self.tunnels.bpf.holders.add("services")  # until its first sync says what it translates
        except NftError as err:
            log.error("services are not translated on this node: %s", err)
            self._problems.append(f"services not translated: {err}")
            self.services = None
        v6_here = getattr(self.underlay, "interface_v6", None)
        await self.observe.open_flows(self.policy, self.services, self.registry, carried=fast_path, cluster=self.cluster,
                                      address_v6=v6_here.ip if v6_here is not None else cfg.node.address_v6,
                                      subnets=[lease.subnet for lease in self.leases.values()])
        if cfg.flows.enabled and cfg.flows.connections and self.observe.recorder is None:
            # The recorder could not open: nothing needs conntrack to see every connection.
            # Before the policy agent's first sync (its task starts after start-up): as with flows off.
            if self.policy is not None:
                self.policy.engine.route_all = False
            await self.tunnels.bpf.hold_redirect(False, who="flows")
        if cfg.ingress.enabled:  # Ingress: the proxy starts once the resources are read
            # Default: the node's underlay addresses, both families on a dual-stack node.
            v6 = cfg.node.address_v6 if cfg.network.ip_family != "ipv4" else None
            addresses = [str(a) for a in cfg.ingress.addresses] or [str(a) for a in dict.fromkeys((self.address, v6)) if a]
            from agentd.ingress.controller import IngressController  # off by default: ~1 MB not loaded

            self.ingress = IngressController(self.name, self.datastore, cfg.ingress, addresses, cfg.agent.state_dir)
            self.registry.register(self.ingress.views)
        elif await asyncio.to_thread(remove_ingress_proxy, cfg.agent.state_dir):  # switched off: a previous run's goes
            log.info("[ingress] is off: stopped the proxy a previous agent left and removed its files")
        self._starting("setting up the tunnels")
        try:
            await self.tunnels.start({v: lease.subnet for v, lease in self.leases.items()})
        except RuntimeError as err:
            raise AgentError(str(err)) from None
        node_files.write_cni_files(cfg, self.cluster, self.leases, self.pod_mtu)
        await self._masquerade()
        self._starting("registering the node in etcd")
        await self.datastore.register_node(self._node_record())
        await self.datastore.set_subnet_backend_data(self.tunnels.node_data())

        # BGP.
        self._starting("starting BGP")
        self.speaker = Speaker(local_settings(cfg, restarting=self.routes.restarting), now=time.monotonic())
        self.speaker.add_listener(self.routes.on_best_paths)
        listen = (cfg.bgp.listen.host, cfg.bgp.listen.port) if cfg.bgp.listen else None
        self.service = SpeakerService(self.speaker, listen=listen, backlog=cfg.bgp.listen_backlog)
        await self.service.start()
        self.started_bgp = True
        # One route per pod subnet: AFI 1 for IPv4, AFI 2 for IPv6 (RFC 4760 MP_REACH_NLRI).
        self.service.set_originated([Origination((AFI[version], SAFI_UNICAST), network_to_prefix(lease.subnet))
                                     for version, lease in sorted(self.leases.items())])
        self.routes.bgp_started(float(cfg.bgp.restart_time))

    def _starting(self, step: str) -> None:
        """systemd's STATUS= while start-up is at ``step`` (one of START_STEPS, as
        docs/operations.md lists them): `systemctl status` shows where a slow start waits."""
        assert step in START_STEPS, step
        self.notifier.status(step)

    async def _forwarding(self) -> None:
        """IP forwarding on for each pod family (agentd.kernel.sysctl): before the subnet file
        is written, so a Docker daemon started after the agent finds it on."""
        try:
            changed = await asyncio.to_thread(sysctl.enable_forwarding, self.leases)
        except OSError as err:
            log.error("IP forwarding could not be turned on: pods of other hosts cannot be reached: %s", err)
            self._problems.append(f"IP forwarding not on: {err}")
            return
        if changed:
            log.info("turned on %s: this host routes the pods' traffic", " and ".join(changed))
        if "net.ipv6.conf.all.forwarding" in changed:
            ignoring = await asyncio.to_thread(sysctl.ra_ignored)
            if ignoring:
                log.warning("with IPv6 forwarding on, %s ignore router advertisements (accept_ra = 1); "
                            "set net.ipv6.conf.IFACE.accept_ra = 2 where the host learns its IPv6 routes from them",
                            ", ".join(ignoring))

    async def _masquerade(self) -> None:
        """[network] ip_masq: the masquerading tables for the node's pod subnets, one per family
        (ip and ip6 agentd-masq), or none (agentd.nft.masquerade)."""
        assert self.cluster is not None
        cluster = {4: self.cluster.cidr, 6: self.cluster.cidr_v6}
        try:
            if self.cfg.network.ip_masq:
                net = self.cfg.network
                bgp_port = self.cfg.bgp.listen.port if self.cfg.bgp.listen is not None else 179
                self.masq = masquerade.Masquerade({v: (cluster[v], lease.subnet) for v, lease in self.leases.items()},
                                                  masquerade.Guarded(bgp_port, net.udp_port, net.vxlan_port))
                if self.peering.known:  # else the adopted member sets keep what they hold until it is
                    self.masq.set_members(masquerade.member_addresses(self.peering.nodes.values()))
                await self.masq.program(retry=True)  # refused: tried again, in problems() meanwhile
            elif await masquerade.remove():
                log.info("masquerading switched off: removed the tables %s", masquerade.TABLE)
        except NftError as err:  # no libnftables: nothing to try again with
            log.error("traffic leaving the pod network is not masqueraded: %s", err)
            self._problems.append(f"ip_masq not applied: {err}")

    def _node_record(self) -> NodeRecord:
        assert self.lease is not None and self.tunnels is not None and self.underlay is not None
        return node_files.node_record(self.cfg, self.name, self.underlay, self.leases, self.tunnels.node_data())

    def _node_data_changed(self) -> None:
        """A backend came up: publish its data (e.g. our VTEP MAC) and recompute routes."""
        self.routes.schedule()
        if self.datastore is None or self.lease is None or self._stop.is_set():
            return
        record = self._node_record()
        loop = asyncio.get_running_loop()
        for job in (self.datastore.update_node(record), self.datastore.set_subnet_backend_data(record.backend)):
            task = loop.create_task(job)
            self._publishing.add(task)  # cancelled by a stop or leave: they retry while etcd is unreachable
            task.add_done_callback(self._published)

    def _published(self, task: asyncio.Task) -> None:
        self._publishing.discard(task)
        if task.cancelled():
            return  # a stop or leave
        # The datastore retries what etcd fails transiently, without a deadline, and logs
        # nothing of what it raises: said here, or the node's new data is dropped unseen.
        err = task.exception()
        if err is not None:
            log.error("publishing this node's data in etcd failed: %s; the other nodes keep its earlier data "
                      "until it changes again", f"{type(err).__name__}: {err}")

    async def _cancel_publishing(self) -> None:
        """Stop the node data's publications still retrying (they hold the datastore's lease
        lock, which the leave's release and node removal wait for)."""
        tasks = list(self._publishing)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _shutdown(self) -> None:
        # A lost subnet is no restart: the prefix we advertised is another node's now, and the
        # forwarding state kept for it would be wrong (RFC 4724 §4 keeps only state still valid).
        # A graceful stop would have every peer keep our route to it as stale (restart_time, and
        # past our restart until our End-of-RIB) and leave its blackhole for the next run to
        # adopt: the stop is a withdrawing one (Cease, our routes and devices removed), which the
        # next run, with another subnet, builds again.
        graceful = self.cfg.bgp.graceful_restart and not self._leaving and not self._subnet_taken
        # A start that stops before BGP started (SIGTERM while etcd is unreachable, a failed
        # start) leaves the kernel as it found it: the routes adopted from the previous run
        # and the devices stay, whatever graceful_restart says (docs/operations.md).
        remove = not graceful and (self.started_bgp or self._leaving)
        self.stopping = True
        self.notifier.stopping()
        log.info(
            "shutting down: %s",
            "graceful restart (routes stay in the kernel and at the peers)"
            if graceful
            else "withdrawing routes (Cease to every peer)" if remove
            else "start-up did not finish: routes and devices stay as they are",
        )
        failed: list[str] = []
        report = self._leave_report  # a leave: every step's result, for `agentd leave` (leave_report.py)

        async def step(what: str, job: Callable[[], object]) -> None:
            """One step of the stop: a failure is one line, and the steps after it still run."""
            if self._leaving:  # systemd's TimeoutStopSec (30 s) bounds a stop, not a leave of many steps
                self.notifier.extend_timeout(LEAVE_STEP_SECONDS)
            try:
                result = job()
                if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                    await result
            except StepSkipped as why:
                skip(what, str(why))
                return
            except Exception as err:  # every later step must still run
                reason = str(err) or type(err).__name__
                log.error("stopping: %s failed: %s", what, reason)
                log.debug("stopping: %s failed", what, exc_info=True)
                failed.append(what)
                if report is not None:
                    report.failed(what, reason)
                    self._write_leave_report()
                return
            if report is not None:
                report.done(what)
                self._write_leave_report()

        def skip(what: str, why: str) -> None:
            """A leave's step this run has nothing to do for: in the report, with why."""
            if report is not None:
                report.skipped(what, why)
                self._write_leave_report()

        if self.service is not None:
            await step("closing the BGP sessions" + (" with a Cease (the peers withdraw our routes)" if remove else ""),
                       lambda: self.service.stop(graceful=graceful))
        else:
            skip("closing the BGP sessions", "BGP had not started")
        await step("stopping the tasks", self.supervisor.stop)
        if self.ingress is not None and not self._leaving:  # the proxy goes on serving; the next agent adopts it
            await step("stopping the ingress controller", self.ingress.stop)
        if self._leaving:
            await self._leave_cleanup(step, skip)
        if self.programmer is not None:
            await step("removing this node's kernel routes" if remove else "stopping the route programmer",
                       lambda: self.programmer.stop(remove_routes=remove))
        else:
            skip("removing this node's kernel routes", "the route programmer had not started (the host clean-up "
                 "below removes the routes of our protocol)")
        if self.tunnels is not None:
            await step("removing the tunnel devices and the BPF data path" if remove else "stopping the tunnels",
                       lambda: self.tunnels.stop(remove=remove))
        else:
            skip("removing the tunnel devices and the BPF data path", "the tunnels had not started (the host "
                 "clean-up below removes what a previous run left)")
        if self._leaving:  # what this run had not built (or not yet started) of the host's state
            await self._leave_leftovers(step)
        if self.policy is not None:  # the policy tables stay in force unless the node leaves
            await step("closing network policy", self.policy.close)
        if self.services is not None:  # so does the services table
            await step("closing services", self.services.close)
        if self.masq is not None:  # and the masquerading tables
            await step("closing masquerading", self.masq.close)
        await step("closing flow records", self.observe.close)
        if self.read_api is not None:
            await step("stopping the cluster listener", self.read_api.stop)
        if self._subnet_taken and not self._leaving:
            # The next start warns that the subnet changed (pods and containers on it must be
            # created again): the record in [agent] state_dir names the lost one...
            await step("keeping the lost subnet in " + str(node_files.kept_subnets_path(self.cfg)),
                       self._keep_lost_subnets)
        if self._subnet_taken:
            # ...while the subnet file must not name the subnet another node holds now: agentd-cni
            # hands out its addresses from it (until the next run writes the new one, ADD says
            # the agent is not running).
            await step(SUBNET_FILE_STEP, self._remove_subnet_file)
        if self.datastore is not None:
            await self._cancel_publishing()
            if self._subnet_taken:
                # Our node record (under our lease, which close() keeps) must not outlive us:
                # it may still name the subnet another node holds now.
                try:
                    await self.datastore.remove_node(self.name, timeout=5)
                except Exception as err:  # noqa: BLE001 - etcd unreachable: the lease expiry removes it
                    log.warning("could not remove node %s from etcd (%s); it goes with its lease", self.name, err)
            with contextlib.suppress(Exception):
                await self.datastore.close()
        await step("stopping the API", self.api.stop)
        if self.api.token is not None:
            await step("removing the API token file",
                       lambda: auth.remove_token_file(self.cfg.api.token_file, self.api.token))
        if self._left is not None and not self._left.done():  # never reached the etcd step
            self._left.set_result("the agent stopped before it reached etcd")
        self.notifier.close()
        if report is not None:
            report.finished = True
            self._write_leave_report()
        if failed:
            log.error("stopped, but not cleanly: %s failed (above)", ", ".join(failed))
            # A leave exits 0 all the same: 1 would have Restart=on-failure start the agent
            # again, which would join the cluster it was asked to leave (`agentd leave` prints
            # every step's result from the leave report).
            if not self._leaving:
                self.exit_status = 1

    def _write_leave_report(self) -> None:
        """The leave report as it stands, for `agentd leave` to read once the agent is gone;
        a failure to write it is logged once (the leave goes on)."""
        if self._leave_report is None:
            return
        try:
            write_report(self.leave_report_path, self._leave_report)
        except OSError as err:
            if not self._leave_report_unwritable:
                log.error("cannot write the leave report %s: %s", self.leave_report_path, err.strerror or err)
            self._leave_report_unwritable = True

    @property
    def leave_report_path(self) -> Path:
        return Path(self.cfg.agent.state_dir) / REPORT_FILE

    def leave_progress(self) -> dict | None:
        """GET /leave: the report of the leave under way, None when none is."""
        return self._leave_report.to_json() if self._leave_report is not None else None

    def _remove_subnet_file(self) -> None:
        remove_subnet_file(self.cfg)

    def _keep_lost_subnets(self) -> None:
        """The subnets this run held (the lost one among them) as the record of this node's."""
        node_files.keep_subnets(self.cfg, {**{v: lease.subnet for v, lease in self.leases.items()}, **self._lost})

    async def _start_read_api(self) -> None:
        """The read-only listener other nodes gather from, once there is a read token."""
        if self.read_api is None or self.read_api.running:
            return
        try:
            await self.read_api.start()
        except OSError as err:
            raise OSError(f"cannot serve the cluster listener on {self.address}:{self.cfg.api.cluster_port}: "
                          f"{err.strerror or err}") from None

    def _node_addresses(self) -> dict[str, str]:
        """The nodes of the registry as this agent read it, by name (the cluster view asks them)."""
        out = {name: str(rec.peer_address) for name, rec in self.peering.nodes.items()}  # IPv6 in an IPv6-only cluster
        out[self.name] = str(self.address)
        return out

    def _registered_addresses(self) -> frozenset[str]:
        """Every address of the nodes of the registry as this agent read it (the cluster
        listener counts their connections per address, not per IPv6 /64): read at each accept."""
        return frozenset(str(a) for rec in self.peering.nodes.values() for a in (rec.address, rec.address_v6)
                         if a is not None)

    def request_leave(self) -> asyncio.Future[str | None]:
        """``agentd leave`` against a running agent: withdraw, release, remove, exit.  The
        future says how the etcd step went (None: left; else why not); POST /leave answers
        with it and the leave report's id (every step's result: GET /leave while the API is up,
        then ``leave_report_path``).  Refused (:class:`api.Conflict`) once the agent is
        stopping: a stop under way (graceful restart) keeps the routes and devices a leave must
        take away."""
        if self.stopping and not self._leaving:
            raise Conflict("the agent is already stopping: run `agentd leave` again once it has stopped "
                           "(it then cleans etcd and this host up itself)")
        if self._left is None:
            self._left = asyncio.get_running_loop().create_future()
        if self._leave_report is None:
            self._leave_report = LeaveReport(self.name, secrets.token_hex(8))
            self._write_leave_report()  # replaces an older leave's report at once
        self._leaving = True
        self._stop.set()
        return self._left

    async def _services_translating(self, on: bool) -> None:
        """Services start (``on``, before their first translation) or stop translating: the BPF
        data path hands decapsulated packets to netfilter while they do, and every local pod's
        traffic is routed (an endpoint's reply to a client on its own node must be translated
        back even where the bridge would hand it over at layer 2) -- unless br_netfilter hands
        bridged frames to conntrack, which translates them there (PolicyEngine.bridged_to_ip)."""
        assert self.tunnels is not None
        await self.tunnels.bpf.hold_redirect(on, who="services")
        if self.policy is not None:
            await self.policy.route_services(on)

    async def _remove_masquerading(self) -> None:
        """A leave's removal of the masquerading tables, this run's closed first: its check
        (every CHECK_INTERVAL, unsupervised) took the tables removed here for ones someone
        else deleted and wrote them again before the later "closing masquerading" step."""
        if self.masq is not None:
            masq, self.masq = self.masq, None
            await masq.close()
        await nft_part(masquerade.remove)

    async def _leave_cleanup(self, step: Callable[[str, Callable[[], object]], Awaitable[None]],
                             skip: Callable[[str, str], None]) -> None:
        """The node leaves: etcd first (``agentd leave`` is answered with how that went), then
        what this host keeps for it; each ``step`` on its own (one failing skips none after it);
        a part this run had not built is ``skip``ped here and removed by ``_leave_leftovers``."""
        await step(ETCD_STEP, self._leave_etcd_and_say)
        await step(SUBNET_FILE_STEP, self._remove_subnet_file)
        await step(KEPT_SUBNETS_STEP, lambda: node_files.forget_subnets(self.cfg))
        if self.cfg.cni.write_conflist:
            await step(CONFLIST_STEP, lambda: remove_conflist(self.cfg))
        not_built = "not running in this agent (the host clean-up below removes what a previous run left)"
        if self.policy is not None:  # NetworkPolicy; pod records went with the lease
            await step("removing the policy tables and the pod fast path", self.policy.leave)
        else:
            skip("removing the policy tables and the pod fast path", f"network policy {not_built}")
        if self.services is not None:  # Services
            await step("removing the services table", self.services.leave)
        else:
            skip("removing the services table", f"services {not_built}")
        # The MACs read of pods' interfaces (the policy agent's; a previous run's where it is not running).
        await step(POD_MACS_STEP, lambda: remove_pod_macs(self.cfg.agent.state_dir, self.policy))
        await step("putting back the flow records' sysctls", self._restore_sysctls)
        await step(BE_LIBERAL_STEP, lambda: restore_be_liberal(self.cfg.agent.bpf_dir))
        # The table masking conntrack's events of what the pod programs recorded (gone with policy.leave).
        await step("removing the flow mask table", lambda: nft_part(lambda: asyncio.to_thread(flowmask.remove)))
        await step("removing the masquerading tables", self._remove_masquerading)
        if self.ingress is not None:  # Ingress: the proxy and its files
            await step("stopping the ingress proxy", self.ingress.leave)
        elif not self.cfg.ingress.enabled:
            skip("stopping the ingress proxy", "Ingress is not enabled here ([ingress] enabled = false; the host "
                 "clean-up below stops a proxy a previous run left)")
        else:
            skip("stopping the ingress proxy", f"the ingress controller {not_built}")

    async def _leave_etcd_and_say(self) -> None:
        error = None
        try:
            released = await self._leave_etcd()
            log.info("left the cluster: released %s, removed node %s", ", ".join(map(str, released)) or "-", self.name)
        except Exception as err:  # etcd down: the lease expiry removes us later
            error = str(err) or type(err).__name__
            log.error("could not remove this node from etcd (%s); its lease will expire", error)
            raise
        finally:
            if self._left is not None and not self._left.done():
                self._left.set_result(error)

    async def _restore_sysctls(self) -> None:
        restored = await asyncio.to_thread(restore_sysctls, self.cfg.agent.state_dir)  # flow records
        if restored:
            log.info("put back %s", ", ".join(restored))

    async def _leave_etcd(self) -> list:
        """Release the node's subnets and remove its record; asked before this run reached
        etcd, with a connection of its own (a previous run's keys go all the same)."""
        await self._cancel_publishing()
        if self.datastore is not None:
            released = await self.datastore.release(self.name, timeout=10)
            await self.datastore.remove_node(self.name, timeout=10)
            return released
        ds = datastore_for(self.cfg)
        try:
            await ds.connect(timeout=10)
            released = await ds.release(self.name, timeout=10)
            await ds.remove_node(self.name, timeout=10)
            return released
        finally:
            with contextlib.suppress(Exception):
                await ds.close()

    async def _leave_leftovers(self, step: Callable[[str, Callable[[], object]], Awaitable[None]]) -> None:
        """What the standalone ``agentd leave`` removes, for each part this run had not built
        (a leave during start-up): the BPF data path, the pod fast path and the tunnel workers
        and devices (always: idempotent, after the tunnels' own stop), the policy and services
        tables, the ingress proxy, the routes of our protocol (without a route programmer);
        each its own ``step``."""
        for what, job in host_state_parts(self.cfg, data_path=True, policy=self.policy is None,
                                          services=self.services is None, ingress=self.ingress is None,
                                          routes=self.programmer is None):  # (else its stop removed them)
            await step(what, job)

    async def _remove_fast_path(self, fast_path: PodFastPath) -> None:
        """Off the veths and the underlay device, unpinned: with no policy agent to update it,
        it would steer by pods that may have gone, their addresses reused
        (podpath.PodFastPath.open).  Conntrack's liberal windows stay, for the connections it
        carried, until ``agentd leave`` (podpath.remove_pinned_fast_path)."""
        try:
            gone = await asyncio.to_thread(fast_path.remove)
        except OSError as err:
            log.error("could not remove the pod fast path: %s", err)
            return
        log.warning("pod fast path off (network policy is not running to keep its pods): removed %s",
                    ", ".join(gone) or "-")

    async def _open_fast_path(self) -> tuple[PodFastPath | None, str | None]:
        """The pod fast path ([network] bpf_pod_fast_path), or None and why not; switched off,
        a previous run's is removed."""
        bpf_dir = self.cfg.agent.bpf_dir
        if not self.cfg.network.bpf_pod_fast_path:
            gone = await asyncio.to_thread(remove_pinned_fast_path, bpf_dir)
            if gone:
                log.info("pod fast path switched off: removed %s", ", ".join(gone))
            return None, "switched off ([network] bpf_pod_fast_path = false)"
        assert self.cluster is not None and self.underlay is not None
        versions = self.cluster.versions  # the pod networks of the cluster's families, each carried
        fast_path = PodFastPath(bpf_dir, cluster=self.cluster.cidr if 4 in versions else None,
                                cluster_v6=self.cluster.cidr_v6 if 6 in versions else None,
                                wire_ifindex=self.underlay.ifindex, attach=self.cfg.network.bpf_attach)
        await asyncio.to_thread(renew_flow_mask)
        try:
            await asyncio.to_thread(fast_path.open)
        except BpfUnavailable as err:
            log.warning("pod fast path off (pod traffic takes the stack's path): %s", for_log(str(err)))
            return None, str(err)
        log.info("pod fast path on: accepted TCP between pods of this node goes pod to pod%s (%d pods adopted)",
                 "" if fast_path.wire else ", and between them and other nodes' pods too", len(fast_path.pods))
        if fast_path.wire:
            log.info("pod fast path: connections with other nodes' pods take the stack's path: %s", fast_path.wire)
        return fast_path, None

    def _reload(self) -> None:
        """SIGHUP: re-read the configuration; external peers and the log level change live.
        An ingress access log file is opened again (logrotate's postrotate), whatever the file says.
        A reload that fails, or whose peers are not applied, is said in systemd's STATUS= line
        (``; last reload failed: ...``) until a reload succeeds: ``systemctl reload`` itself
        only sends the signal (its ExecReload= runs ``agentd check-config`` first)."""
        if self.ingress is not None:
            self.ingress.reopen_access_log()
        if self.config_path is None:
            return
        # A file named at start (flag, AGENTD_CONFIG), or the default file once it has been
        # read (at start or a reload), that is gone now (an editor's save, a config management
        # run) is a failed reload, not the defaults: those would de-configure every external peer.
        require_file = self.config_named or self.config_read
        try:
            # [node] name, address and address_v6 change only with a restart: their defaults are
            # the running ones, not the host's now (a default route gone must not fail a reload).
            read = load_config(self.config_path, overrides=self.overrides, require_file=require_file,
                               host=RunningHost(self.cfg))
        except ConfigError as err:
            log.error("reload failed, keeping the running configuration: %s", err)
            self._reload_failed(str(err))
            return
        self.config_read = self.config_read or read.source is not None
        cfg, pending, refused = reloaded(self.cfg, read)
        if self.set_logging is not None:
            self.set_logging(cfg.log.level, cfg.log.format)
        else:
            logging.getLogger().setLevel(cfg.log.level.upper())
        self.cfg = cfg
        if refused is None:
            self._apply_peers()
        log.info("configuration reloaded: %d external peers, log level %s, format %s", len(cfg.bgp.peers),
                 cfg.log.level, cfg.log.format)
        if pending:
            log.warning("changed but applied only by a restart: %s", ", ".join(pending))
        if refused is not None:
            log.error("reload: %s", refused)
        self._reload_failed(refused)
        log.debug("debug logging is on")

    def _reload_failed(self, why: str | None) -> None:
        """The last reload's failure (None: it succeeded), in STATUS= at once."""
        if why == self.reload_error:
            return
        self.reload_error = why
        if not self.stopping:
            self.notifier.status(self.status_line()[1])

    # ================================================================ node registry -> peers

    async def _watch_nodes(self) -> None:
        assert self.datastore is not None
        async for ev in self.datastore.watch_nodes():
            self.peering.apply(ev)
            self._schedule_peers()
            self.routes.schedule()

    def _schedule_peers(self) -> None:
        """Apply the peer set at the next loop turn, once for all the node events delivered
        together.  A watch resumed after an outage replays what it missed in one batch: a node
        whose lease ran out and that registered again is "delete X, put X".  Applied event by
        event, X's BGP session (up all along) was reset with a Cease and its routes withdrawn;
        applied once, X is in the peer set before and after, and its session stays."""
        if self._peers_handle is None:
            self._peers_handle = asyncio.get_running_loop().call_soon(self._apply_scheduled_peers)

    def _apply_scheduled_peers(self) -> None:
        self._peers_handle = None
        if not self.stopping:
            self._apply_peers()

    def _apply_peers(self) -> None:
        if self.service is not None:
            self.service.set_peers(self.peering.peers(self.cfg, self.cluster))
            self.service.set_listen_ranges(listen_ranges(self.cfg))
            if self.peering.known:
                # The registry has been read: the peer set is whole, and a selection deferral
                # (RFC 4724 §4.1) may end once they all sent End-of-RIB, not only by restart_time.
                self.service.peers_configured()

    # ================================================================ route programmer

    def _on_sync(self, result: SyncResult) -> None:
        self.sync_histogram.observe(result.seconds)
        if result.failed:
            for dst, err in result.failed[:5]:
                log.warning("route %s not installed: %s", dst, err)

    # ================================================================ readiness & datastore

    async def _readiness_loop(self) -> None:
        ready_sent, shown = False, None
        failing, logged_at = None, 0.0  # the data paths' refresh: its error, logged once a minute
        while True:
            ok, line = self.status_line()
            if ok and not ready_sent:
                self.notifier.ready(line)
                ready_sent, shown = True, line
                log.info("%s", line)
            elif line != shown and not self.stopping:  # systemctl status shows why it is not ready, or degraded
                self.notifier.status(line)
                shown = line
            if self.tunnels is not None:
                try:
                    await self.tunnels.refresh()
                    failing = None
                except Exception as err:  # readiness (and READY=1) must not go with it: logged, tried again
                    now = time.monotonic()
                    if repr(err) != failing or now - logged_at >= 60:
                        log.error("refreshing the data paths failed: %s; trying again", err, exc_info=err)
                        failing, logged_at = repr(err), now
            await asyncio.sleep(0.5 if not ready_sent else 2.0)

    def _subnet_lost(self, lease: SubnetLease) -> None:
        """As flanneld does: stop (exit status 1), so that the service manager's restart leases
        another subnet.  Running on, this node would keep originating the subnet and handing
        out its addresses to new pods beside the node that holds it now."""
        msg = f"subnet {lease.subnet} was taken by another node while etcd was unreachable"
        log.error("%s: stopping, to start again with another subnet; this node's pods keep addresses of %s, which "
                  "that node hands out now: re-create them", msg, lease.subnet)
        self._problems.append(msg)
        self._fatal = msg
        self._subnet_taken = True
        self._lost[lease.subnet.version] = lease.subnet
        self.exit_status = 1
        self._stop.set()

    # ================================================================ health (AgentViews shows the rest)

    def health(self) -> tuple[bool, list[str]]:
        """/healthz (liveness): the supervised tasks and the data-plane workers alive.  Service
        DNS not served is no reason (it is in ``problems()``, retried): the agent routes pods
        all the same, and a liveness probe must not restart it for that."""
        _, problems = self.supervisor.health()
        problems += self.tunnels.problems() if self.tunnels is not None else []  # a dead data-plane worker
        return not problems, problems

    def problems(self) -> list[str]:
        """What this agent runs without: start-up failures it does not retry, and service DNS
        while it cannot be served, masquerading tables while the kernel refuses them (tried
        again until they are)."""
        return (list(self._problems) + (self.services.problems() if self.services is not None else [])
                + (self.masq.problems() if self.masq is not None else []))  # fmt: skip

    def readiness(self) -> tuple[bool, list[str]]:
        """/readyz: the lease held, BGP started, routes reconciled; ``problems()`` are not
        reasons (the agent runs degraded), but a subnet lost (the agent stops) is."""
        reasons = [self._fatal] if self._fatal else []
        if self.lease is None:
            reasons.append("no subnet lease yet")
        if not self.started_bgp:
            reasons.append("BGP not started")
        if self.programmer is None or self.programmer.last_sync is None:
            reasons.append("routes not reconciled yet")
        elif not self.routes.initial_sync_done:
            reasons.append("waiting for peers' End-of-RIB")
        elif not self.routes.reconciled():  # what BGP learned: in the kernel (READY=1 says routable)
            reasons.append("routes not reconciled yet")
        return not reasons, reasons

    def status_line(self) -> tuple[bool, str]:
        """Ready, and systemd's STATUS=: "ready: subnet S" (with "; degraded: ..." after it
        while ``problems()``), else "not ready: REASONS"."""
        ok, reasons = self.readiness()
        if not ok:
            return False, f"not ready: {'; '.join(reasons)}" + self._reload_status()
        problems = self.problems()
        return True, f"ready: subnet {self.lease.subnet if self.lease else '-'}" + (
            f"; degraded: {'; '.join(problems)}" if problems else "") + self._reload_status()

    def _reload_status(self) -> str:
        return f"; last reload failed: {self.reload_error}" if self.reload_error else ""


class _AgentMetrics:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self):
        a = self.agent
        routes = GaugeMetricFamily("agentd_routes_programmed", "own routes in the kernel")
        routes.add_metric([], float(len(a.programmer.programmed())) if a.programmer else 0.0)
        up = GaugeMetricFamily("agentd_datastore_up", "1 while etcd is reachable")
        up.add_metric([], 1.0 if a.datastore is not None and a.datastore.connected else 0.0)
        renew = CounterMetricFamily("agentd_subnet_lease_renewals", "etcd lease keepalives sent")
        renew.add_metric([], float(getattr(a.datastore, "lease_renewals", 0) if a.datastore else 0))
        ready = GaugeMetricFamily("agentd_ready", "1 when /readyz is 200")
        ready.add_metric([], 1.0 if a.readiness()[0] else 0.0)
        restarts = CounterMetricFamily("agentd_task_restarts", "supervised task restarts", labels=["task"])
        for c in a.supervisor.children.values():
            restarts.add_metric([c.name], float(c.restarts))
        yield from (routes, up, renew, ready, restarts)
        if a.tunnels is not None:
            yield from dataplane_metrics(a.tunnels)


def api_port_holder(host: object, port: int) -> str:
    """"; held by <uid>, ..." when what listens on the API's address is neither root's nor this
    agent's user's (a local user took the unprivileged port while no agent ran), else ""."""
    from agentd.daemon.listeners import untrusted_owner, user_name

    uid = untrusted_owner(str(host), port, os.geteuid())
    if uid is None:
        return ""
    return (f"; a process of {user_name(uid)} listens there, neither root nor this agent's user: another user "
            "took the agent's port (end that process; `agentd leave` refuses to send it the API token)")


def wanted_cluster(cfg: Config) -> ClusterConfig:
    """The cluster config this node would store (the first node's is kept: agentd.datastore)."""
    net = cfg.network
    v6 = net.ip_family != "ipv4"
    return ClusterConfig(net.cidr, net.subnet_len, net.backend, net.encap, net.service_cidr, ip_family=net.ip_family,
                         cidr_v6=net.cidr_v6 if v6 else None, subnet_len_v6=net.subnet_len_v6 if v6 else None,
                         service_cidr_v6=net.service_cidr_v6 if v6 else None)


def check_cluster(cfg: Config, cluster: ClusterConfig) -> None:
    if cluster.cidr is not None and cluster.service_cidr.overlaps(cluster.cidr):
        log.warning("the cluster's service range %s overlaps its pod network %s (both from etcd): cluster IPs "
                    "inside a node's pod subnet are routed to that node's pods; a new cluster sets [network] "
                    "service_cidr outside cidr before its first agent starts", cluster.service_cidr, cluster.cidr)
    """The stored cluster config wins; say where it differs from ours, and stop where this node
    cannot follow it (pods of a family it has no underlay address for)."""
    net = cfg.network
    if (cluster.cidr, cluster.subnet_len) != (net.cidr, net.subnet_len) and 4 in cluster.versions:
        log.warning("cluster network is %s/%d in etcd (first writer wins); our configuration says %s/%d",
                    cluster.cidr, cluster.subnet_len, net.cidr, net.subnet_len)
    if 6 in cluster.versions and (cluster.cidr_v6, cluster.subnet_len_v6) != (net.cidr_v6, net.subnet_len_v6) \
            and net.ip_family != "ipv4":
        log.warning("cluster IPv6 network is %s/%s in etcd (first writer wins); our configuration says %s/%d",
                    cluster.cidr_v6, cluster.subnet_len_v6, net.cidr_v6, net.subnet_len_v6)
    if cluster.ip_family != net.ip_family:
        log.warning("the cluster is %s in etcd (first writer wins); our configuration says %s: following the cluster",
                    cluster.ip_family, net.ip_family)
    if 4 in cluster.versions and cfg.node.address is None:
        raise AgentError(f"the cluster in etcd is {cluster.ip_family}: its pods have IPv4 addresses, and this node "
                         "(ip_family = ipv6) has no IPv4 underlay address to route them by")
    if cluster.ip_family == "ipv6" and cfg.node.address_v6 is None:
        raise AgentError("the cluster in etcd is ipv6: this node needs an IPv6 underlay address ([node] address_v6, "
                         "[network] ip_family = ipv6)")
    if cluster.ip_family == "ipv6" and net.ip_family != "ipv6":
        # Its BGP sessions, listen address and next hops follow its own setting: it would peer
        # with none of the cluster's IPv6-only nodes (they have no IPv4 address), silently.
        raise AgentError(f"the cluster in etcd is ipv6, and this node is configured {net.ip_family}: set "
                         "[network] ip_family = ipv6 to join it")


def datastore_for(cfg: Config) -> Datastore:
    e = cfg.etcd
    return Datastore(
        e.endpoints,
        e.prefix,
        lease_ttl=e.lease_ttl,
        ca=str(e.ca) if e.ca else None,
        cert=str(e.cert) if e.cert else None,
        key=str(e.key) if e.key else None,
    )


async def run_agent(cfg: Config, *, config_path: str | None = None, overrides: dict | None = None,
                    config_named: bool = True, set_logging: Callable[[str, str], None] | None = None) -> int:
    agent = Agent(cfg, config_path=config_path, overrides=overrides, config_named=config_named,
                  set_logging=set_logging)
    return await agent.run()


ETCD_STEP = "leaving etcd (releasing the subnets, removing the node record)"
POD_MACS_STEP = "removing the file of the MACs read from pods' interfaces"
BE_LIBERAL_STEP = "putting back conntrack's TCP window setting (nf_conntrack_tcp_be_liberal)"
CONFLIST_STEP = "removing the CNI network configuration file (10-agentd.conflist)"
TOKEN_STEP = "removing the API token file a stopped agent left"
SUBNET_FILE_STEP = "removing the subnet file"
KEPT_SUBNETS_STEP = f"removing the record of this node's subnets ({node_files.KEPT_FILE})"


def remove_subnet_file(cfg: Config) -> None:
    """A leave's step (and a lost subnet's): ``[cni] subnet_file`` goes."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(cfg.cni.subnet_file)
        log.info("removed %s", cfg.cni.subnet_file)


async def restore_be_liberal(bpf_dir: str | os.PathLike[str]) -> None:
    """A leave's step: ``nf_conntrack_tcp_be_liberal`` put back as the pod fast path found it
    (kept 1 while it was only switched off: connections it carried were open), with what is left
    of the fast path; an OSError (the value noted in its pin, for the next leave) fails it."""
    gone = await asyncio.to_thread(remove_pinned_fast_path, bpf_dir, liberal=True)
    if gone:
        log.info("removed the pod fast path's leftovers: %s", ", ".join(gone))


async def remove_conflist(cfg: Config) -> None:
    """A leave's step (``[cni] write_conflist``): the conflist the agent wrote goes, so that the
    runtime falls through to another network; an operator's own file of that name is skipped."""
    try:
        gone = await asyncio.to_thread(node_files.remove_conflist, cfg)
    except ValueError as err:
        raise StepSkipped(str(err)) from None
    if gone:
        log.info("removed %s", Path(cfg.cni.conf_dir) / cni_netconf.CONFLIST_NAME)


async def remove_stale_token(path: Path) -> None:
    """The leave without an agent: the API token file of an agent that was killed (one that
    stops removes its own); no agent answered with it."""
    try:
        path.unlink()
    except FileNotFoundError:
        return  # the usual case: the agent stopped and took it
    log.info("removed %s", path)


async def remove_pod_macs(state_dir: str | os.PathLike[str], policy: PolicyAgent | None = None) -> None:
    """A leave's step: ``<state_dir>/pod-macs.json`` (agentd/policy/podmacs.py) goes, as the
    node's other state does -- by ``policy``, the running policy agent, which removes it after a
    write under way and writes it no more; else (no agent, or its network policy not started)
    directly.  An OSError (the file stays) fails the step."""
    if policy is not None:
        gone = await policy.remove_pod_macs()
    else:
        gone = await asyncio.to_thread(podmacs.remove_state, state_dir)
    if gone:
        log.info("removed %s", Path(state_dir) / podmacs.STATE_FILE)


async def nft_missing() -> str | None:
    """Why libnftables cannot be loaded here, or None.  The agent makes its tables with it:
    without it, none of them can be here."""
    try:
        await asyncio.to_thread(libnftables.load)
    except NftError as err:
        return str(err)
    return None


async def nft_part(job: Callable[[], object]) -> None:
    """An nftables step of a leave: skipped where libnftables cannot be loaded, else ``job``
    (its NftError: the step failed)."""
    missing = await nft_missing()
    if missing is not None:
        raise StepSkipped(f"no nftables table of the agent's can be here ({missing})")
    result = job()
    if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
        await result


async def leave(cfg: Config, on_step: Callable[[LeaveStep], None] | None = None) -> LeaveReport:
    """``agentd leave`` when no agent is running here: remove the node from etcd directly.
    (With an agent running, the CLI asks it over ``POST /leave`` instead.)  The host is
    cleaned up even when etcd cannot be reached (a node being taken out of service); the
    report then says the etcd step failed.  ``on_step``: called with each step as it ends.
    The report is also written to ``<state_dir>/leave.json``, as a leaving agent's is."""
    name = cfg.node.name or "node"
    report = LeaveReport(name, secrets.token_hex(8), agent=False)

    async def step(what: str, job: Callable[[], object]) -> None:
        try:
            result = job()
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                await result
        except StepSkipped as why:
            report.skipped(what, str(why))
        except Exception as err:  # the other steps still run
            log.debug("leave: %s failed", what, exc_info=True)
            report.failed(what, str(err) or type(err).__name__)
        else:
            report.done(what)
        if on_step is not None:
            on_step(report.steps[-1])

    async def leave_etcd() -> None:
        ds = datastore_for(cfg)
        try:
            await ds.connect(timeout=10)
            released = await ds.release(name, timeout=10)
            await ds.remove_node(name, timeout=10)
            log.info("node %s removed from etcd (no agent was running); released %s", name,
                     ", ".join(map(str, released)) or "-")
        finally:
            with contextlib.suppress(Exception):
                await ds.close()

    async def sysctls() -> None:
        restored = await asyncio.to_thread(restore_sysctls, cfg.agent.state_dir)  # flow records
        if restored:
            log.info("put back %s", ", ".join(restored))

    await step(ETCD_STEP, leave_etcd)
    # Neither names the node's subnet for a later start to take back.
    await step(SUBNET_FILE_STEP, lambda: remove_subnet_file(cfg))
    await step(KEPT_SUBNETS_STEP, lambda: node_files.forget_subnets(cfg))
    for what, job in host_state_parts(cfg, data_path=True, policy=True, services=True, ingress=True, routes=True):
        await step(what, job)
    await step(POD_MACS_STEP, lambda: remove_pod_macs(cfg.agent.state_dir))
    await step("putting back the flow records' sysctls", sysctls)
    await step(BE_LIBERAL_STEP, lambda: restore_be_liberal(cfg.agent.bpf_dir))
    if cfg.cni.write_conflist:
        await step(CONFLIST_STEP, lambda: remove_conflist(cfg))
    await step(TOKEN_STEP, lambda: remove_stale_token(Path(cfg.api.token_file)))
    # The table masking conntrack's events of what the pod programs recorded.
    await step("removing the flow mask table", lambda: nft_part(lambda: asyncio.to_thread(flowmask.remove)))
    await step("removing the masquerading tables", lambda: nft_part(masquerade.remove))
    report.finished = True
    try:
        write_report(Path(cfg.agent.state_dir) / REPORT_FILE, report)
    except OSError as err:
        log.warning("cannot write the leave report to %s: %s", cfg.agent.state_dir, err.strerror or err)
    return report


def host_state_parts(
    cfg: Config, *, data_path: bool, policy: bool, services: bool, ingress: bool, routes: bool
) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
    """What an agent leaves on the host, as steps that remove it without the agent (``agentd
    leave`` with no agent running, or for the parts a leaving agent had not built): each
    part named, on its own (one failing, the others still go), raising when it could not.
    ``routes``: the kernel routes of ``[network] route_protocol`` in the main table (ours: the
    agent changes no other protocol's), as the agent's own stop with removal deletes them."""

    async def own_routes() -> None:
        protocol = cfg.network.route_protocol
        removed, errors = await remove_routes_of(protocol, None)
        if removed:
            log.info("removed %d routes of proto %d the agent left", len(removed), protocol)
        if errors:
            for reason in errors:
                log.warning("could not remove a proto %d route: %s", protocol, reason)
            raise RuntimeError(f"{len(errors)} of proto {protocol}'s routes stay: {errors[0]}")

    async def data_path_state() -> None:
        # What a killed agent left in the kernel: the BPF programs, filters and pins.
        gone = await asyncio.to_thread(remove_bpf_leftovers, cfg)
        if gone:
            log.info("removed the BPF data path a previous agent left: %s", ", ".join(gone))
        gone = await remove_worker_leftovers(Path(cfg.agent.state_dir))  # the user-space data path
        gone += await asyncio.to_thread(remove_vxlan_leftover)  # the kernel VXLAN device
        if gone:
            log.info("removed the tunnel devices and workers a previous agent left: %s", ", ".join(gone))

    async def ingress_proxy() -> None:
        await asyncio.to_thread(remove_ingress_proxy, cfg.agent.state_dir)

    async def services_state() -> None:
        await remove_services_table(str(cfg.dns.address_v6), table=await nft_missing() is None)

    parts = (("removing what is left of the BPF data path, the pod fast path and the tunnels", data_path,
              data_path_state),
             ("removing the policy tables", policy, lambda: nft_part(remove_policy_tables)),  # NetworkPolicy
             ("removing the services table and the DNS address", services, services_state),  # Services
             ("stopping the ingress proxy a previous run left", ingress, ingress_proxy),  # Ingress
             (f"removing the kernel routes of proto {cfg.network.route_protocol}", routes, own_routes))
    return [(what, job) for what, wanted, job in parts if wanted]
