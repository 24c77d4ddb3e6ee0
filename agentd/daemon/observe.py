"""How ``agentd run`` sets up what shows traffic: the flow recorder and the cluster view.

:class:`Observability` is the agent's part for both: it opens the flow recorder
(agentd/flows) with a directory over the policy and services agents, its metrics, and the
cluster view (agentd/daemon/cluster.py) with the read token (kept in step with etcd) and the
read-only listener on the node's address.  Neither is needed for the node to route: a failure turns the part off
with one line saying why (``GET /status`` -> ``flows``), the agent carries on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Any

from prometheus_client import CollectorRegistry

from agentd.config.settings import Config
from agentd.daemon.auth import new_token, read_line_token
from agentd.daemon.cluster import ClusterView
from agentd.daemon.flow_directory import FlowDirectory, kernel_local_networks
from agentd.datastore.store import ClusterConfig, Datastore
from agentd.flows.recorder import (
    CarriedCounts,
    ConntrackTimeouts,
    FlowRecorder,
    restore_sysctls,
)
from agentd.flows.views import FlowViews
from agentd.nft.expr import DropLog
from agentd.nft.flowmask import FlowMask, remove_quietly
from agentd.policy.agent import PolicyAgent
from agentd.services.agent import ServiceAgent

log = logging.getLogger("agentd")

TOKEN_RETRY_FIRST = 1.0  # seconds before the read token is tried again; doubled each time, up to
TOKEN_RETRY_MAX = 15.0


def drop_log(cfg: Config) -> DropLog | None:
    """How the policy and services tables log drops: None with flows off."""
    f = cfg.flows
    return DropLog(f.log_group, f.log_rate, f.log_rate) if f.enabled else None


def own_addresses(subnets: Iterable[IPv4Network | IPv6Network]) -> list[IPv4Address | IPv6Address]:
    """The node's own addresses in its pod subnets, which no pod has: the bridge's (the pods'
    gateway, the subnet's first host: agentd.cni.netconf) and, IPv4, the subnet's broadcast
    address.  What the node sends from them to no pod (its bridge's IGMP reports) is no pod's
    connection."""
    out: list[IPv4Address | IPv6Address] = []
    for subnet in subnets:
        out.append(subnet.network_address + 1)
        if subnet.version == 4:
            out.append(subnet.broadcast_address)
    return out


class Observability:
    def __init__(self, cfg: Config, name: str, nodes: Any) -> None:
        """``nodes()``: node name -> address, from the node registry the agent watches."""
        self.cfg = cfg
        self.name = name
        self.recorder: FlowRecorder | None = None
        self.views: FlowViews | None = None
        self.error: str | None = None if cfg.flows.enabled else "switched off ([flows] enabled = false)"
        self.cluster = ClusterView(name, nodes, cfg.api.cluster_port)

    async def open_flows(self, policy: PolicyAgent | None, services: ServiceAgent | None,
                         registry: CollectorRegistry, carried: CarriedCounts | None = None, *,
                         cluster: ClusterConfig | None = None, address_v6: object | None = None,
                         subnets: Iterable[IPv4Network | IPv6Network] = ()) -> None:
        """``carried``: the pod fast path, which counts what it carries past conntrack.
        ``cluster``: the cluster record the agent follows (etcd's: it wins over this node's
        [network] settings), whose pod networks and Service ranges of its families say which
        connections are pods'; None: this node's own settings.  ``address_v6``: the node's
        IPv6 address where it knows one ([node] address_v6 else).  ``subnets``: the node's pod
        subnets (its leases), whose gateway -- the bridge's address -- and IPv4 broadcast address
        are the node's own, no pod's (:func:`own_addresses`)."""
        cfg = self.cfg
        if not cfg.flows.enabled:
            if hasattr(carried, "set_recording"):  # an earlier agent may have told the programs to record
                try:
                    await asyncio.to_thread(carried.set_recording, False)  # type: ignore[union-attr]
                except (OSError, RuntimeError) as err:  # RuntimeError: BpfUnavailable (conntrack's sysctls)
                    log.warning("the pod programs may go on recording connections: %s", err)
            try:
                gone = await asyncio.to_thread(restore_sysctls, cfg.agent.state_dir)
            except OSError as err:  # the state file stays: `agentd leave` tries again
                log.warning("flow records switched off: %s", err)
                gone = []
            await asyncio.to_thread(remove_quietly)  # nothing masks conntrack's events then
            if gone:
                log.info("flow records switched off: put back %s", ", ".join(gone))
            return
        if cluster is not None:
            pods = [cluster.pool(v)[0] for v in cluster.versions]
            ranges = list(cluster.service_ranges().values())
        else:
            six = 6 in cfg.network.families
            pods = [cfg.network.cidr, *([cfg.network.cidr_v6] if six else [])]
            ranges = [cfg.network.service_cidr, *([cfg.network.service_cidr_v6] if six else [])]
        directory = FlowDirectory(policy, services, (cfg.node.address, address_v6 or cfg.node.address_v6),
                                  local_networks=kernel_local_networks)
        recorder = FlowRecorder(self.name, directory, cfg.agent.state_dir, group=cfg.flows.log_group,
                                ring_size=cfg.flows.ring_size, agent_rate=cfg.flows.record_rate,
                                agent_burst=max(1, int(cfg.flows.record_rate * 2)),
                                pods=pods, services=ranges,
                                carried=carried,
                                connections=cfg.flows.connections,
                                # every packet from other nodes' pods passes the wire program
                                record_remote=cfg.network.backend == "host-gw", mask=FlowMask(),
                                own=own_addresses(subnets),
                                # the ends of conntrack's entries at their last packet, not their expiry
                                ct_timeouts=ConntrackTimeouts())
        try:
            await asyncio.to_thread(recorder.open)
        except (OSError, RuntimeError) as err:  # RuntimeError: BpfUnavailable (conntrack's sysctls)
            self.error = f"flow records off: {err}"
            log.warning("%s", self.error)
            if hasattr(carried, "set_counting") and cfg.flows.connections:  # nobody reads what it would count
                try:
                    await asyncio.to_thread(carried.set_counting, False)  # type: ignore[union-attr]
                except (OSError, RuntimeError) as err2:
                    log.warning("the pod fast path may go on counting connections: %s", err2)
            return

        def kernel_suppressed() -> int:
            return (policy.log_suppressed if policy else 0) + (services.counters.get("flow-log-suppressed", 0)
                                                                if services else 0)

        self.recorder = recorder
        self.views = FlowViews(recorder, kernel_suppressed)
        registry.register(self.views)
        log.info("flow records on: %s logged to NFLOG group %d, %d records kept",
                 "conntrack events and drops" if cfg.flows.connections else "drops only ([flows] connections = false)",
                 cfg.flows.log_group, cfg.flows.ring_size)

    async def keep_read_token(self, datastore: Datastore, on_token: Callable[[], Awaitable[None]]) -> None:
        """The cluster read token, got and kept (a supervised task): ``[api] read_token_file``
        (read again until it can be), else the cluster's in etcd, followed there -- a token
        deleted there is replaced (one agent stores a new one, the others take it: first writer
        wins), a changed one taken.  ``on_token()`` once there is one (it starts the read-only
        listener).  While there is none -- etcd unreachable at start, a record that is no
        token -- the node routes as ever, and this says so once and keeps trying."""
        path = self.cfg.api.read_token_file
        delay, said = TOKEN_RETRY_FIRST, None
        while True:
            try:
                if path is not None:
                    self._use(await asyncio.to_thread(read_line_token, path))
                    await on_token()
                    return  # a file: the operator's, read at start
                async for stored in datastore.watch_read_token():
                    if stored is None:  # none (deleted, or never stored): ours, unless another agent's came first
                        stored = await datastore.ensure_read_token(new_token())
                    self._use(stored)
                    await on_token()
                    delay, said = TOKEN_RETRY_FIRST, None
            except Exception as err:  # noqa: BLE001 - etcd unreachable, the file unreadable, the port taken
                if str(err) != said:
                    log.warning("the cluster view is off here for now: %s (trying again)", err)
                    said = str(err)
                await asyncio.sleep(delay)
                delay = min(TOKEN_RETRY_MAX, delay * 2)

    def _use(self, token: str) -> None:
        if token != self.cluster.token:
            if self.cluster.token is not None:
                log.info("the cluster read token changed: other nodes are asked with the new one")
            self.cluster.token = token

    def status(self) -> dict[str, Any]:
        if self.views is None:
            return {"on": False, "error": self.error}
        return {**self.views.status(), "error": None}

    async def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
        await self.cluster.close()
