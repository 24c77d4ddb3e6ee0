"""What ``GET /services`` and /metrics show of the Services half of the agent.

:class:`ServiceViews` reads a :class:`ServiceState` (the running
:class:`agentd.services.agent.ServiceAgent`) and changes nothing; it is the agent's
prometheus_client collector and the source of its REST view.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import compiler, dns, model


class ServiceState(Protocol):
    """What the views read of the Services agent."""

    node: str
    applied_revision: int
    error: str | None
    error_dns: str | None
    dns_config: Any  # agentd.config.settings.DnsConfig; None or not enabled: no DNS
    syncs: int
    sync_errors: int
    last_sync: dict[str, Any] | None
    flushed: int
    counters: dict[str, int]
    failed: dict[tuple[str, str], str]
    dns_server: dns.DnsServer | None

    def dns_outcomes(self) -> dict[str, int] | None: ...

    @property
    def ports(self) -> list[model.ServicePort]: ...

    @property
    def compiled_ports(self) -> list[model.ServicePort]: ...

    @property
    def port_count(self) -> int: ...

    @property
    def conflicts(self) -> dict[tuple[str, str], list[str]]: ...


class ServiceViews:
    def __init__(self, agent: ServiceState, wall: Callable[[], float] = time.time) -> None:
        self.agent = agent
        self.wall = wall  # the wall clock (an upstream's "down_until")

    def view(self, summary: bool = False) -> dict[str, Any]:
        """GET /services: per service its VIP, ports and endpoints with their state
        (``summary``: only what is applied, cheap to poll)."""
        a = self.agent
        if summary:
            return {"node": a.node, "revision": a.applied_revision, "error": a.error, "syncs": a.syncs,
                    "sync_errors": a.sync_errors, "last_sync": a.last_sync, "service_ports": a.port_count, "failed": _failed(a)}  # fmt: skip
        services: dict[str, dict[str, Any]] = {}
        conflicts = a.conflicts
        # What the kernel carries of each port: its cluster IP and node port unless an older
        # Service holds them (the port as asked keeps them, under "asked").
        compiled = {sp.key: sp for sp in a.compiled_ports}
        for sp in a.ports:
            held = compiled.get(sp.key, sp)
            key = f"{sp.namespace}/{sp.service}"
            svc = services.setdefault(key, {
                "namespace": sp.namespace, "name": sp.service, "clusterIP": sp.cluster_ip or "None", "clusterIPs": [],
                "ports": [], "connections": a.counters.get(compiler.counter_name(sp.namespace, sp.service), 0),
                "errors": conflicts.get((sp.namespace, sp.service), []),
            })  # fmt: skip
            if sp.cluster_ip is not None and sp.cluster_ip not in svc["clusterIPs"]:
                # The ports come ordered by family, not by the Service's: its primary
                # address leads, as in its spec (an IPv6-primary dual-stack Service).
                if sp.primary:
                    svc["clusterIP"] = sp.cluster_ip
                    svc["clusterIPs"].insert(0, sp.cluster_ip)
                else:
                    svc["clusterIPs"].append(sp.cluster_ip)
            usable, local = held.usable(), held.usable(a.node)
            # Where the kernel sends new connections on each path (compiler.compile_port): the
            # cluster IP to this node's endpoints under internalTrafficPolicy: Local, the node
            # port from outside the node to them under externalTrafficPolicy: Local; from the
            # node itself and its pods the node port takes every usable one, the cluster IP's
            # choice (the short-circuit, its own path); none here: dropped, none anywhere: refused.
            paths = {
                "clusterIP": (held.cluster_ip, held.cluster_ip_endpoints(a.node)),
                "nodePort": (held.node_port, held.node_port_endpoints(a.node)),
                "nodePortFromNode": (held.node_port, held.short_circuit_endpoints(a.node)),
            }
            served = {
                path: None if address is None else "translated" if chosen else "dropped" if usable else "refused"
                for path, (address, chosen) in paths.items()
            }
            if sp.cluster_ip is None:
                # Headless: nothing translated; DNS answers with its ready endpoints.
                used_by = {e: ["dns"] for e in held.endpoints if e.ready}
            else:
                used_by = {e: [path for path, (address, chosen) in paths.items() if address is not None and e in chosen]
                           for e in held.endpoints}  # fmt: skip
            svc["ports"].append({
                "name": sp.port_name, "protocol": sp.protocol, "port": sp.port, "nodePort": held.node_port,
                "family": f"IPv{sp.family}", "clusterIP": held.cluster_ip,
                "asked": {"clusterIP": sp.cluster_ip, "nodePort": sp.node_port},
                "affinityTimeout": sp.affinity_timeout,
                "internalTrafficPolicy": "Local" if sp.internal_local else "Cluster",
                "externalTrafficPolicy": "Local" if sp.external_local else "Cluster",
                "served": served,
                "endpoints": [
                    {"ip": e.ip, "port": e.port, "node": e.node, "ready": e.ready, "serving": e.serving,
                     "terminating": e.terminating, "used": bool(used_by.get(e)), "usedBy": used_by.get(e, []),
                     "local": e in local}
                    for e in held.endpoints
                ],
            })  # fmt: skip
        return {
            "node": a.node, "revision": a.applied_revision, "error": a.error, "syncs": a.syncs,
            "sync_errors": a.sync_errors, "last_sync": a.last_sync, "udp_flushed": a.flushed, "failed": _failed(a),
            "dns": None if a.dns_server is None else {
                "address": a.dns_server.address, "addresses": a.dns_server.addresses, "queries": a.dns_server.queries,
                "forwarded": a.dns_server.forwarded, "servfail": a.dns_server.failed,
                "rejected": a.dns_server.rejected, "foreign": a.dns_server.outcomes["foreign"],
                # Each upstream's health (dns.Upstreams): healthy, down (skipped until
                # down_until), or retrying (its backoff over), with its failures in a row.
                "max_fails": dns.MAX_FAILS, "upstreams": a.dns_server.upstreams.status(self.wall())},
            "dns_error": a.error_dns, "services": sorted(services.values(), key=lambda s: (s["namespace"], s["name"])),
        }  # fmt: skip

    def collect(self) -> Any:
        """prometheus_client custom collector: per-service connection counters."""
        a = self.agent
        conns = CounterMetricFamily("agentd_service_connections", "new connections translated to a service's endpoints",
                                    labels=["namespace", "service"])  # fmt: skip
        ports = a.ports  # one listing per scrape
        seen = set()
        for sp in ports:
            if (sp.namespace, sp.service) in seen:
                continue
            seen.add((sp.namespace, sp.service))
            conns.add_metric([sp.namespace, sp.service], a.counters.get(compiler.counter_name(sp.namespace, sp.service), 0))
        yield conns
        eps = GaugeMetricFamily("agentd_service_endpoints", "usable endpoints per service port",
                                labels=["namespace", "service", "port"])  # fmt: skip
        usable: dict[tuple[str, str, str], int] = {}
        for sp in ports:  # a dual-stack port is one port: its endpoints (pods) are in both families
            key = (sp.namespace, sp.service, f"{sp.port}/{sp.protocol}")
            usable[key] = max(usable.get(key, 0), len(sp.usable()))
        for labels, n in usable.items():
            eps.add_metric(list(labels), n)
        yield eps
        syncs = CounterMetricFamily("agentd_services_syncs", "services table transactions sent to nftables")
        syncs.add_metric([], float(a.syncs))  # counted up (ServiceAgent.syncs), never down: a counter
        yield syncs
        errors = CounterMetricFamily("agentd_services_sync_errors", "services sync passes that failed (tried again)")
        errors.add_metric([], float(a.sync_errors))
        yield errors
        outcomes = a.dns_outcomes()  # those of the servers before too: a restarted task's counts from 0
        if outcomes is None and _dns_configured(a):
            # Before a server first runs (starting, or its address not taken yet): every
            # outcome at 0, so the series exist from the start as the other counters do.
            outcomes = dict.fromkeys(dns.OUTCOMES, 0)
        if outcomes is not None:
            q = CounterMetricFamily("agentd_dns_queries", "DNS queries to the node-local address", labels=["outcome"])
            for outcome, n in outcomes.items():  # monotonic: a query in flight is in none; rejected: over MAX_FORWARDED, SERVFAIL at once, or a TCP connection over MAX_TCP_CLIENTS; foreign: from outside the pods and the node, dropped
                q.add_metric([outcome], n)
            yield q


def _dns_configured(a: ServiceState) -> bool:
    """``[dns] enabled`` (the agent's DNS config)."""
    cfg = getattr(a, "dns_config", None)
    return cfg is not None and bool(getattr(cfg, "enabled", False))


def _failed(a: ServiceState) -> dict[str, str]:
    """The Services not translated because their records could not be built or compiled: why."""
    return {f"{ns}/{name}": line for (ns, name), line in sorted(a.failed.items())}
