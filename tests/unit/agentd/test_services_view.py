"""GET /services shows a Service's addresses as its spec has them: the primary first."""

from __future__ import annotations

from typing import Any

from agentd.resources import kinds
from agentd.services import compiler, model
from agentd.services.views import ServiceViews


class _State:
    node, applied_revision, error, error_dns, syncs, sync_errors, last_sync, flushed = "n1", 1, None, None, 1, 0, None, 0
    counters: dict[str, int] = {}
    failed: dict[tuple[str, str], str] = {}
    dns_server = None

    def dns_outcomes(self) -> None:
        return None

    def __init__(self, ports: list[model.ServicePort]) -> None:
        table = compiler.Table("n1", families=(4, 6))
        for sp in ports:
            table.update((sp.namespace, sp.service), [p for p in ports if p.service == sp.service])
        self.ports = table.ports()  # as the agent lists them: ordered by family, not by the Service
        self.compiled_ports = table.compiled_ports()
        self.port_count = len(self.ports)
        self.conflicts = table.conflicts


def _service(name: str, ips: list[str], families: list[str]) -> dict[str, Any]:
    return kinds.validate({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "shop"},
        "spec": {"clusterIP": ips[0], "clusterIPs": ips, "ipFamilies": families, "ipFamilyPolicy": "RequireDualStack",
                 "selector": {"app": "web"}, "ports": [{"name": "http", "port": 80}]},
    })  # fmt: skip


def test_an_ipv6_primary_dual_stack_service_lists_its_ipv6_address_first():
    services = [_service("v6first", ["fd00:10:96::8c74", "10.96.44.88"], ["IPv6", "IPv4"]),
                _service("v4first", ["10.96.1.2", "fd00:10:96::2"], ["IPv4", "IPv6"])]
    view = ServiceViews(_State(model.build(services, [], [])))  # type: ignore[arg-type]
    shown = {s["name"]: (s["clusterIP"], s["clusterIPs"]) for s in view.view()["services"]}
    assert shown == {"v6first": ("fd00:10:96::8c74", ["fd00:10:96::8c74", "10.96.44.88"]),
                     "v4first": ("10.96.1.2", ["10.96.1.2", "fd00:10:96::2"])}


def test_a_service_refused_a_cluster_ip_another_holds_shows_it_in_errors():
    old, young = _service("old", ["10.96.1.2"], ["IPv4"]), _service("young", ["10.96.1.2"], ["IPv4"])
    old["metadata"]["creationTimestamp"], young["metadata"]["creationTimestamp"] = "2024-01-01T00:00:00Z", "2025-01-01T00:00:00Z"
    view = ServiceViews(_State(model.build([young, old], [], [])))  # type: ignore[arg-type]
    shown = {s["name"]: s["errors"] for s in view.view()["services"]}
    assert shown == {"old": [], "young": ["cluster IP 10.96.1.2 tcp/80 is shop/old's: left out"]}


def test_a_local_node_port_from_the_node_uses_no_terminating_endpoint_while_one_is_ready():
    """externalTrafficPolicy Local, this node's endpoint terminating, another node's ready:
    ``usedBy`` shows what the data path does -- from outside the node port takes the local
    terminating one, from the node and its pods (``nodePortFromNode``, the short-circuit) only
    the ready one, as the cluster IP."""
    mine = model.Endpoint("10.244.1.5", 8080, "n1", ready=False, serving=True, terminating=True)
    far = model.Endpoint("10.244.2.5", 8080, "n2")
    sp = model.ServicePort("shop", "web", "", "TCP", 80, "10.96.0.10", 30080, None, False, True, (mine, far))
    (svc,) = ServiceViews(_State([sp])).view()["services"]  # type: ignore[arg-type]
    (port,) = svc["ports"]
    assert {e["ip"]: e["usedBy"] for e in port["endpoints"]} == {
        "10.244.1.5": ["nodePort"], "10.244.2.5": ["clusterIP", "nodePortFromNode"]}
    assert port["served"] == {"clusterIP": "translated", "nodePort": "translated", "nodePortFromNode": "translated"}
