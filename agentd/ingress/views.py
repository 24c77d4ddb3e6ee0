"""What ``/status``, ``GET /ingress`` and /metrics show of the Ingress controller.

:class:`IngressViews` reads the running :class:`agentd.ingress.controller.IngressController`
and changes nothing; it is its prometheus_client collector too.  Request counters are
HAProxy's, per backend (one backend is one Ingress's requests to one Service port), kept
monotonic across reloads and restarts by the controller.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from agentd.ingress.haproxy import address

CODES = ("1xx", "2xx", "3xx", "4xx", "5xx", "other")


class IngressViews:
    def __init__(self, controller: Any) -> None:
        self.c = controller

    def _table(self) -> Any:
        """The routing table the running proxy loaded; while none is known (the proxy not
        running, or adopted and not yet synced), the one last rendered -- what is wanted."""
        c = self.c
        return c.served if c.served is not None else c.table

    def status(self) -> dict[str, Any]:
        """The proxy in ``/status`` (and ``agentd status``)."""
        c = self.c
        worker = c.worker
        return {
            "proxy": "haproxy",
            "running": c.proxy.running,
            "pid": c.proxy.pid,
            "adopted": c.proxy.adopted,  # started by a previous agent
            "started_at": c.proxy.started_at,
            "worker": worker.pid if worker else None,
            "reloads": c.proxy.reloads,
            "restarts": c.restarts,
            "runtime_changes": c.runtime_changes,
            "addresses": list(c.listen.addresses),
            "http_port": c.listen.http_port,
            "https_port": c.listen.https_port,
            # What "ingresses", "backends" and /ingress's hosts are of: the configuration the
            # proxy runs ("served"), or -- none known: the proxy not running, or adopted from a
            # previous agent and no sync of this one loaded or found it yet -- the one wanted.
            "table": "served" if c.served is not None else "wanted",
            "ingresses": len(self._table().ingresses),
            "backends": len(self._table().backends),
            "revision": c.applied_revision,
            "last_change": c.last_change,
            "error": c.error,
            "settings_error": c.settings_error,
            "tls_errors": dict(c.tls_errors),  # Secret -> why its hosts get the default certificate
            "access_log": c.access_log_state(),  # {"to": "agent"|"off"|path, "error", "dropped"}
        }

    def view(self) -> dict[str, Any]:
        """GET /ingress: every Ingress served, its hosts, backends and their servers."""
        c, table = self.c, self._table()
        servers: dict[str, list[dict[str, Any]]] = {}
        for row in c.stats:
            if row.get("svname") not in ("FRONTEND", "BACKEND"):
                servers.setdefault(row["pxname"], []).append({"server": row["svname"], "status": row.get("status")})
        backends = []
        for name, b in sorted(table.backends.items()):
            backends.append({
                "name": name, "namespace": b.namespace, "ingress": b.ingress, "service": b.service, "port": b.port,
                "servers": sorted(address(ip, port) for ip, port in c.servers.get(name, set())),
                "requests": c.counter(name, "req_tot"),
            })  # fmt: skip
        vhosts = []
        for host, v in sorted(table.vhosts.items()):
            vhosts.append({"host": host, "default": v.default,
                           "rules": [{"path": r.path, "pathType": r.path_type, "backend": r.backend,
                                      "ingress": "/".join(r.ingress)} for r in v.rules]})  # fmt: skip
        return {
            **self.status(),
            "default_backend": table.default,
            "hosts": vhosts,
            "backends": backends,
            # "serves": false -- the host gets the default certificate.  The redirect to HTTPS is
            # per path: each follows its own Ingress's ssl-redirect ("ssl_redirect_off": those
            # with it off).
            "tls": [{"host": t.host, "secret": "/".join(t.secret) if t.secret else None, "ingress": "/".join(t.ingress),
                     "serves": t.serves} for t in table.tls],  # fmt: skip
            "ssl_redirect_off": ["/".join(i) for i in table.ingresses if i not in table.redirecting],
            "conflicts": list(table.conflicts),
            "proxy_servers": servers,
        }

    def collect(self) -> Any:
        c = self.c
        up = GaugeMetricFamily("agentd_ingress_proxy_up", "1 while the ingress proxy (HAProxy) runs")
        up.add_metric([], 1.0 if c.proxy.running else 0.0)
        yield up
        yield CounterMetricFamily("agentd_ingress_proxy_restarts", "times the proxy exited and was started again",
                                  value=c.restarts)  # fmt: skip
        yield CounterMetricFamily("agentd_ingress_proxy_reloads", "graceful reloads (rules, TLS or settings changed)",
                                  value=c.proxy.reloads)  # fmt: skip
        yield CounterMetricFamily("agentd_ingress_endpoint_changes", "servers added or removed without a reload",
                                  value=c.runtime_changes)  # fmt: skip
        conns = GaugeMetricFamily("agentd_ingress_proxy_connections", "connections the proxy holds now")
        try:
            conns.add_metric([], float(c.info.get("CurrConns", 0)))
        except ValueError:
            conns.add_metric([], 0.0)
        yield conns
        reqs = CounterMetricFamily("agentd_ingress_requests", "HTTP requests per Ingress, Service port and status class",
                                   labels=["namespace", "ingress", "service", "port", "code"])  # fmt: skip
        ready = GaugeMetricFamily("agentd_ingress_upstreams", "ready endpoints of an Ingress's Service port",
                                  labels=["namespace", "ingress", "service", "port"])  # fmt: skip
        for name, b in sorted(self._table().backends.items()):
            svc, port = b.service or "-", "-" if b.port is None else str(b.port)  # "-": a resource backend
            for code in CODES:  # per port: two ports of one Service are two backends
                reqs.add_metric([b.namespace, b.ingress, svc, port, code], float(c.counter(name, f"hrsp_{code}")))
            ready.add_metric([b.namespace, b.ingress, svc, port], float(len(c.servers.get(name, ()))))
        yield reqs
        yield ready
