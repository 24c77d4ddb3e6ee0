"""/metrics of the ingress: one series per Ingress backend (an Ingress -> Service *port*)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from agentd.ingress.routing import Backend
from agentd.ingress.views import IngressViews


def test_request_counters_have_a_series_per_service_port():
    """Two ports of one Service behind one Ingress are two backends: without a port label
    their agentd_ingress_requests_total were two samples of one series (Prometheus keeps one)."""
    b80, b8080, res = Backend("shop", "web", "api", 80), Backend("shop", "web", "api", 8080), Backend("shop", "web", None, None)
    counts = {(b80.name, "hrsp_2xx"): 100, (b8080.name, "hrsp_2xx"): 7}
    controller = SimpleNamespace(proxy=SimpleNamespace(running=True, reloads=0), restarts=0, runtime_changes=0, info={}, served=None,
                                 table=SimpleNamespace(backends={b.name: b for b in (b80, b8080, res)}), servers={},
                                 counter=lambda name, key: counts.get((name, key), 0))  # fmt: skip
    registry = CollectorRegistry()
    registry.register(IngressViews(controller))  # type: ignore[arg-type]
    samples = [s for m in registry.collect() if m.name == "agentd_ingress_requests" for s in m.samples
               if s.name.endswith("_total") and s.labels["code"] == "2xx"]  # fmt: skip
    keys = [(s.labels["service"], s.labels["port"]) for s in samples]
    assert len(keys) == len(set(keys)) == 3
    got = {(s.labels["service"], s.labels["port"]): s.value for s in samples}
    assert got == {("api", "80"): 100, ("api", "8080"): 7, ("-", "-"): 0}
    upstreams = registry.get_sample_value("agentd_ingress_upstreams", {"namespace": "shop", "ingress": "web", "service": "-", "port": "-"})
    assert upstreams == 0


def test_an_ipv6_server_is_named_in_brackets():
    b = Backend("shop", "web", "api", 80)
    controller = SimpleNamespace(proxy=SimpleNamespace(running=True, reloads=0), restarts=0, runtime_changes=0, info={}, served=None,
                                 table=SimpleNamespace(backends={b.name: b}, vhosts={}, default=None, tls=[], conflicts=[],
                                                      ingresses=[], redirecting=set()),
                                 servers={b.name: {("fd00:10:244:1::5", 8080), ("10.244.1.5", 8080)}}, stats=[],
                                 applied_revision=1, last_change=None, error=None, settings_error=None, tls_errors={},
                                 counter=lambda name, key: 0)  # fmt: skip
    views = IngressViews(controller)  # type: ignore[arg-type]
    views.status = dict  # type: ignore[method-assign]  # the proxy's state: not what is asked here
    view = views.view()
    assert view["backends"][0]["servers"] == ["10.244.1.5:8080", "[fd00:10:244:1::5]:8080"]


def test_the_ingress_view_says_which_secret_serves_each_tls_host_and_which_ingresses_do_not_redirect():
    """Review s57/r12 #4: GET /ingress's ``tls[].serves`` and ``ssl_redirect_off`` (docs/ingress.md)
    were pinned by no test."""
    from agentd.ingress import routing

    def ing(name: str, host: str, secret: str, created: str, **annotations: str) -> dict:
        return {"metadata": {"namespace": "shop", "name": name, "creationTimestamp": created, "annotations": annotations},
                "spec": {"rules": [{"host": host, "http": {"paths": [{"path": "/", "pathType": "Prefix",
                                                                      "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}],
                         "tls": [{"hosts": [host], "secretName": secret}]}}  # fmt: skip

    table = routing.build([ing("a", "a.example", "good", "2024-01-01T00:00:00Z"),
                           ing("b", "b.example", "gone", "2024-02-01T00:00:00Z", **{routing.REDIRECT_ANNOTATION: "false"})],
                          usable=lambda s: s == ("shop", "good"), cert_names=lambda s: ("a.example",))  # fmt: skip
    controller = SimpleNamespace(table=table, served=None, servers={}, stats=[], counter=lambda name, key: 0)
    views = IngressViews(controller)  # type: ignore[arg-type]
    views.status = dict  # type: ignore[method-assign]  # the proxy's state: not what is asked here
    view = views.view()
    assert view["tls"] == [{"host": "a.example", "secret": "shop/good", "ingress": "shop/a", "serves": True},
                           {"host": "b.example", "secret": "shop/gone", "ingress": "shop/b", "serves": False}]
    assert view["ssl_redirect_off"] == ["shop/b"]
