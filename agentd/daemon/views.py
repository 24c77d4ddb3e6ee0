"""The agent as the REST API and ``agentd status`` see it: its state turned into JSON rows.

``AgentViews`` is the :class:`agentd.daemon.api.StatusProvider` of ``agentd run``; it reads
the running agent (what it reads is :class:`AgentState`) and never changes it
(``request_leave`` passes the request on).  BGP rows come from :mod:`agentd.daemon.speaker`
(``peer_rows``), the speaker's JSON from :mod:`agentd.daemon.bgp_json`.
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry

from bgp import Speaker
from bgp.transport import SpeakerService

from agentd.config.settings import Config
from agentd.daemon.routes import KernelRoutes
from agentd.daemon.speaker import peer_rows
from agentd.daemon.supervisor import Supervisor
from agentd.dataplane.backends import Tunnels
from agentd.datastore.store import Datastore, SubnetLease
from agentd.kernel.netinfo import Underlay
from agentd.kernel.routing import RouteProgrammer
from agentd.daemon.cluster import ClusterView
from agentd.daemon.observe import Observability
from agentd.flows.views import FlowViews
from agentd.policy.agent import PolicyAgent
from agentd.services.agent import ServiceAgent

if TYPE_CHECKING:  # the controller is imported only when [ingress] enabled
    from agentd.ingress.controller import IngressController


class AgentState(Protocol):
    """What the views read of the agent (``agentd.daemon.agent.Agent`` has all of it)."""

    cfg: Config
    name: str
    address: IPv4Address | IPv6Address
    pod_mtu: int
    registry: CollectorRegistry
    supervisor: Supervisor
    underlay: Underlay | None
    lease: SubnetLease | None
    leases: dict[int, SubnetLease]
    programmer: RouteProgrammer | None
    datastore: Datastore | None
    speaker: Speaker | None
    service: SpeakerService | None
    tunnels: Tunnels | None
    policy: PolicyAgent | None
    services: ServiceAgent | None
    ingress: IngressController | None
    routes: KernelRoutes
    observe: Observability

    def health(self) -> tuple[bool, list[str]]: ...

    def readiness(self) -> tuple[bool, list[str]]: ...

    def problems(self) -> list[str]: ...

    def request_leave(self) -> Any: ...

    def leave_progress(self) -> dict[str, Any] | None: ...

    @property
    def leave_report_path(self) -> Any: ...


class AgentViews:
    """What ``GET /status``, ``/peers``, ``/routes``, ``/policy``, ``/services`` and ``/rib``
    show of one agent."""

    def __init__(self, agent: AgentState) -> None:
        self.agent = agent

    @property
    def registry(self) -> CollectorRegistry:
        return self.agent.registry

    def health(self) -> tuple[bool, list[str]]:
        return self.agent.health()

    def readiness(self) -> tuple[bool, list[str]]:
        return self.agent.readiness()

    def request_leave(self) -> Any:
        """The agent's answer to wait for (api.Conflict if it refuses)."""
        return self.agent.request_leave()

    def leave_progress(self) -> dict[str, Any] | None:
        """GET /leave: the leave report so far (None: no leave under way)."""
        return self.agent.leave_progress()

    @property
    def leave_report_path(self) -> str:
        return str(self.agent.leave_report_path)

    def status(self) -> dict[str, Any]:
        a = self.agent
        prog = a.programmer
        v6 = a.leases.get(6)
        return {
            "node": {
                "name": a.name,
                "address": str(a.address),
                # Dual-stack and IPv6-only: the IPv6 underlay address and subnet ("subnet" is
                # the first one: IPv4, or the IPv6 one of an IPv6-only node).
                "address_v6": str(a.cfg.node.address_v6) if a.cfg.node.address_v6 else None,
                "ip_family": a.cfg.network.ip_family,
                "asn": a.cfg.node.asn,
                "subnet": str(a.lease.subnet) if a.lease else None,
                "subnet_v6": str(v6.subnet) if v6 else None,
                "backend": a.cfg.network.backend,
                "encap": a.cfg.network.encap,
                "route_reflector": a.cfg.node.route_reflector,
                "mtu": a.pod_mtu,
                "underlay": a.underlay.ifname if a.underlay else None,
            },
            "bgp": {
                "router_id": str(a.speaker.local.router_id) if a.speaker else None,
                "mode": a.cfg.bgp.mode,
                "peers": self.peers(),
            },
            "routes": {
                "programmed": len(prog.programmed()) if prog else 0,
                "last_sync": prog.last_sync if prog else None,
                "conflicts": dict(prog.conflicts) if prog else {},
            },
            "datastore": {
                "connected": bool(a.datastore and a.datastore.connected),
                "endpoints": list(a.cfg.etcd.endpoints),
                "endpoint": a.datastore.endpoint if a.datastore else None,
            },
            "backends": a.tunnels.status() if a.tunnels else {},
            "policy": a.policy.views.status() if a.policy else None,
            # Services: applied revision, the last programming error (the kernel refused the
            # table: a reject needs Linux 5.9 in prerouting), Services left out (GET /services).
            "services": a.services.views.view(summary=True) if a.services else None,
            "flows": a.observe.status(),
            "ingress": a.ingress.views.status() if a.ingress else None,
            "tasks": a.supervisor.summary(),
            "ready": a.readiness()[0],
            "problems": a.problems(),  # what runs degraded (some of it tried again meanwhile): ready all the same
        }

    def peers(self) -> list[dict[str, Any]]:
        a = self.agent
        if a.service is None:
            return []
        rows = peer_rows(a.service)
        paths = a.tunnels.paths() if a.tunnels else None
        for row in rows:
            plan = a.routes.plans.get(row["address"])
            row["backend"] = plan.backend if plan else None
            row["backend_reason"] = plan.reason if plan else None
            if a.routes.plans_v6:  # dual-stack: how the peer's IPv6 pods are reached (ipip: directly)
                v6 = a.routes.plans_v6.get(row["address"])
                row["backend_v6"] = v6.backend if v6 else None
                row["backend_v6_reason"] = v6.reason if v6 else None
            # The data path carrying it here, and its packet counters where the kernel keeps them.
            row["datapath"] = paths.label(plan) if plan and paths else None
            row["counters"] = a.tunnels.bpf.peer_counters(row["address"]) \
                if a.tunnels and row["datapath"] == "bpf" else None
        return rows

    def bgp_speaker(self) -> Speaker | None:
        return self.agent.speaker

    def services_view(self, summary: bool = False) -> dict[str, Any] | None:
        """GET /services."""
        services = self.agent.services
        return services.views.view(summary) if services else None

    def ingress_view(self) -> dict[str, Any] | None:
        """GET /ingress."""
        ingress = self.agent.ingress
        return ingress.views.view() if ingress else None

    def policy_view(self, pod: str | None = None, summary: bool = False,
                    allow_lists: bool = True) -> dict[str, Any] | None:
        """GET /policy."""
        policy = self.agent.policy
        return policy.views.view(pod, summary=summary, allow_lists=allow_lists) if policy else None

    def routes(self) -> list[dict[str, Any]]:
        return self.agent.routes.installed()

    def node_name(self) -> str:
        return self.agent.name

    def flows_view(self) -> FlowViews | None:
        """GET /flows (agentd/daemon/observe_api.py); None where flow records are off."""
        return self.agent.observe.views

    def cluster_view(self) -> ClusterView | None:
        """How this agent gathers from the others (agentd/daemon/cluster.py)."""
        return self.agent.observe.cluster
