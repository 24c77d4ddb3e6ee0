"""Services (issue 14), pure: endpoints from pod records and EndpointSlices, which of them take
new connections, the table the compiler makes for a node, and the UDP entries to flush."""

from __future__ import annotations

import json

from agentd.policy.ruleset import NftChain, NftSet, Ruleset, plan
from agentd.resources import kinds
from agentd.services import compiler, model
from agentd.services.agent import stale_udp
from agentd.services.conntrack import Stale


def svc(name: str, spec: dict, ns: str = "shop") -> dict:
    obj = kinds.validate({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns}, "spec": spec})
    obj["spec"]["clusterIP"] = obj["spec"]["clusterIP"] or "10.96.0.10"
    return obj


def pod(name: str, node: str, ip: str, labels: dict, ports=(), ns: str = "shop") -> dict:
    return kinds.validate({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "pod", "ports": list(ports)}]}, "status": {"podIP": ip},
    })  # fmt: skip


def eps_slice(name: str, service: str, endpoints: list, ports: list, ns: str = "shop") -> dict:
    return kinds.validate({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": ns, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4", "endpoints": endpoints, "ports": ports,
    })  # fmt: skip


HTTP = {"name": "http", "containerPort": 8080, "protocol": "TCP"}
PODS = [
    pod("a", "n1", "10.244.1.2", {"app": "web"}, [HTTP]),
    pod("b", "n2", "10.244.2.2", {"app": "web", "tier": "x"}, [HTTP]),
    pod("c", "n2", "10.244.2.3", {"app": "web"}),  # no port named http
    pod("d", "n1", "10.244.1.3", {"app": "db"}, [HTTP]),
    pod("e", "n1", "10.244.1.4", {"app": "web"}, [HTTP], ns="other"),
]


def test_selector_endpoints_resolve_named_target_ports():
    s = svc("web", {"selector": {"app": "web"}, "ports": [
        {"name": "http", "port": 80, "targetPort": "http"}, {"name": "raw", "port": 81, "targetPort": 9000}]})  # fmt: skip
    http, raw = model.build([s], [], PODS)
    assert [(e.ip, e.port, e.node) for e in http.endpoints] == [("10.244.1.2", 8080, "n1"), ("10.244.2.2", 8080, "n2")]
    assert [(e.ip, e.port) for e in raw.endpoints] == [("10.244.1.2", 9000), ("10.244.2.2", 9000), ("10.244.2.3", 9000)]
    assert [e.ip for e in http.usable("n2")] == ["10.244.2.2"]


def test_slices_give_conditions_and_terminating_fallback():
    s = svc("ext", {"ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]})
    sl = eps_slice("ext-1", "ext", [
        {"addresses": ["192.0.2.1"], "conditions": {"ready": True}, "nodeName": "n1"},
        {"addresses": ["192.0.2.2"], "conditions": {"ready": False, "serving": True, "terminating": True}},
        {"addresses": ["192.0.2.3"], "conditions": {"ready": False, "serving": False, "terminating": True}},
    ], [{"name": "dns", "port": 5353, "protocol": "UDP"}, {"name": "other", "port": 1}])  # fmt: skip
    other = eps_slice("x-1", "unrelated", [{"addresses": ["192.0.2.9"]}], [{"name": "dns", "port": 53, "protocol": "UDP"}])
    (dns,) = model.build([s], [sl, other], [])
    assert [e.ip for e in dns.endpoints] == ["192.0.2.1", "192.0.2.2", "192.0.2.3"]
    assert [e.ip for e in dns.usable()] == ["192.0.2.1"]
    # Nothing ready: the serving terminating ones take new connections (KEP-1669).
    sl["endpoints"][0]["conditions"]["ready"] = False
    (dns,) = model.build([s], [sl], [])
    assert [e.ip for e in dns.usable()] == ["192.0.2.2"]


def _chain(rs: Ruleset, name: str) -> list[list[dict]]:
    obj = rs.objects[(compiler.FAMILY, compiler.TABLE, "chain", name)]
    assert isinstance(obj, NftChain)
    return [json.loads(r) for r in obj.rules]


def _map(rs: Ruleset, name: str) -> frozenset:
    obj = rs.objects[(compiler.FAMILY, compiler.TABLE, "set", name)]
    assert isinstance(obj, NftSet)
    return obj.elements


def test_the_table_one_map_lookup_per_service_and_numgen_per_connection():
    s = svc("web", {"type": "NodePort", "selector": {"app": "web"},
                    "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]})  # fmt: skip
    rs = compiler.compile_services(model.build([s], [], PODS), "n1")
    assert _map(rs, compiler.SERVICE_IPS) == {(("10.96.0.10", "tcp", 80), ("goto", "svc/shop/web/tcp/80"))}
    assert _map(rs, compiler.NODE_PORTS) == {(("tcp", 30080), ("goto", "ext/shop/web/tcp/80"))}
    hairpin, rule = _chain(rs, "svc/shop/web/tcp/80")
    # Without affinity the service chain translates itself: no chain per endpoint.
    assert hairpin == [{"match": {"op": "==", "left": compiler.SADDR, "right": {"set": ["10.244.1.2", "10.244.2.2"]}}},
                       compiler.MARK_MASQ]  # fmt: skip
    assert rule[1] == {"counter": "svc/shop/web"}
    nat = rule[2]["dnat"]["addr"]["map"]
    assert nat["key"] == {"numgen": {"mode": "random", "mod": 2, "offset": 0}}
    assert nat["data"]["set"] == [[0, {"concat": ["10.244.1.2", 8080]}], [1, {"concat": ["10.244.2.2", 8080]}]]
    assert not [k for k in rs.objects if k[3].startswith("ep/")]
    # Cluster node port: SNAT (the endpoint may be elsewhere), then the service chain.
    assert _chain(rs, "ext/shop/web/tcp/80") == [[compiler.MARK_MASQ, {"goto": {"target": "svc/shop/web/tcp/80"}}]]
    # One endpoint: a plain dnat.
    (one,) = model.build([s], [], PODS[:1])
    rs1 = compiler.compile_services([one], "n1")
    assert _chain(rs1, "svc/shop/web/tcp/80")[1][-1] == {"dnat": {"addr": "10.244.1.2", "port": 8080}}


def test_local_policies_and_affinity():
    s = svc("web", {"type": "NodePort", "selector": {"app": "web"}, "externalTrafficPolicy": "Local",
                    "internalTrafficPolicy": "Local", "sessionAffinity": "ClientIP",
                    "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]})  # fmt: skip
    rs = compiler.compile_services(model.build([s], [], PODS), "n1")
    ext = _chain(rs, "ext/shop/web/tcp/80")
    assert compiler.MARK_MASQ not in ext[-1]  # Local: the client address is kept
    assert ext[-1][-1] == {"goto": {"target": "ep/shop/web/tcp/80/10.244.1.2/8080"}}
    hairpin, update, dnat = _chain(rs, "ep/shop/web/tcp/80/10.244.1.2/8080")  # affinity: a chain per endpoint
    assert hairpin[1] == compiler.MARK_MASQ and dnat[-1] == {"dnat": {"addr": "10.244.1.2", "port": 8080}}
    aff = rs.objects[(compiler.FAMILY, compiler.TABLE, "set", "aff/shop/web/tcp/80/10.244.1.2/8080")]
    assert isinstance(aff, NftSet) and aff.timeout == 10800 and aff.dynamic
    assert _chain(rs, "ep/shop/web/tcp/80/10.244.1.2/8080")[1] == [
        {"set": {"op": "update", "elem": compiler.SADDR, "set": "@aff/shop/web/tcp/80/10.244.1.2/8080"}}]  # fmt: skip
    # A node without local endpoints: no element, so no translation there.
    rs3 = compiler.compile_services(model.build([s], [], PODS), "n3")
    assert _map(rs3, compiler.SERVICE_IPS) == frozenset() and _map(rs3, compiler.NODE_PORTS) == frozenset()


def test_an_endpoint_change_is_one_incremental_transaction():
    s = svc("web", {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]})
    before = compiler.compile_services(model.build([s], [], PODS), "n1")
    after = compiler.compile_services(model.build([s], [], PODS[:1] + PODS[2:]), "n1")
    cmds = plan(before, after)
    verbs = [(next(iter(c)), next(iter(next(iter(c.values()))))) for c in cmds]
    # The service chain refilled (one endpoint now), in the same transaction.
    assert verbs == [("flush", "chain"), ("add", "rule"), ("add", "rule")]
    assert not any(v == ("delete", "table") or v == ("add", "table") for v in verbs)
    assert plan(after, after) == []


def test_stale_udp_endpoints_are_those_no_longer_usable():
    s = svc("dns", {"type": "NodePort", "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053}]})
    sl = eps_slice("dns-1", "dns", [{"addresses": ["192.0.2.1"]}, {"addresses": ["192.0.2.2"]}],
                   [{"name": "dns", "port": 5353, "protocol": "UDP"}])  # fmt: skip
    before = model.build([s], [sl], [])
    sl["endpoints"][1]["conditions"] = {"ready": False}
    after = model.build([s], [sl], [])
    (stale,) = stale_udp(before, after)
    assert stale == Stale("192.0.2.2", 5353, "10.96.0.10", 53, 30053)
    assert stale.matches("10.96.0.10", 53, "192.0.2.2", 5353) and stale.matches("192.0.2.50", 30053, "192.0.2.2", 5353)
    assert not stale.matches("10.96.0.11", 53, "192.0.2.2", 5353) and not stale.matches("10.96.0.10", 53, "192.0.2.1", 5353)
    assert stale_udp(after, after) == [] and stale_udp(before, []) != []


def test_recompiling_after_one_change_touches_only_that_service():
    services = [svc(f"s{i}", {"ports": [{"name": "http", "port": 80}]}) for i in range(50)]
    for i, s in enumerate(services):
        s["spec"]["clusterIP"] = f"10.96.1.{i + 1}"
    slices = [eps_slice(f"s{i}-1", f"s{i}", [{"addresses": [f"10.244.1.{i + 1}"]}, {"addresses": [f"10.244.2.{i + 1}"]}],
                        [{"name": "http", "port": 8080}]) for i in range(50)]  # fmt: skip
    cache: dict = {}
    before = compiler.compile_services(model.build(services, slices, []), "n1", cache)
    assert compiler.changed(None, before) is None
    slices[7]["endpoints"].pop()
    after = compiler.compile_services(model.build(services, slices, []), "n1", cache)
    keys = compiler.changed(before, after)
    # Only s7's objects (recompiled), the maps and the fixed base chains are looked at again.
    assert {k[3] for k in keys if k[3].startswith(("svc/", "ep/"))} == {"svc/shop/s7/tcp/80"}
    assert len(keys) < 15
    assert plan(before, after, keys) == plan(before, after)  # the keys miss nothing
    assert len(cache) == 50


def test_the_table_kept_service_by_service_equals_the_whole_compile():
    services = [svc(f"s{i}", {"type": "NodePort", "ports": [{"name": "http", "port": 80, "nodePort": 30000 + i}]}) for i in range(20)]
    for i, s in enumerate(services):
        s["spec"]["clusterIP"] = f"10.96.1.{i + 1}"
    slices = [eps_slice(f"s{i}-1", f"s{i}", [{"addresses": [f"10.244.1.{i + 1}"]}], [{"name": "http", "port": 8080}])
              for i in range(20)]  # fmt: skip
    table = compiler.Table("n1")
    for s in services:
        key = (s["metadata"]["namespace"], s["metadata"]["name"])
        table.update(key, model.build([s], [sl for sl in slices if sl["metadata"]["labels"]["kubernetes.io/service-name"] == key[1]], []))
    whole = compiler.compile_services(model.build(services, slices, []), "n1")
    assert table.rs.objects == whole.objects
    # s3 loses its endpoint, s4 goes: only their objects and the two maps are touched.
    before = dict(table.rs.objects)
    touched = table.update(("shop", "s3"), model.build([services[3]], [], []))
    touched |= table.update(("shop", "s4"), [])
    assert table.update(("shop", "s5"), model.build([services[5]], [slices[5]], [])) == set()  # unchanged
    names = {k[3] for k in touched}
    assert names == {"svc/shop/s3/tcp/80", "ext/shop/s3/tcp/80", "svc/shop/s4/tcp/80", "ext/shop/s4/tcp/80",
                     "svc/shop/s4", compiler.SERVICE_IPS, compiler.NODE_PORTS}, names  # fmt: skip
    whole = compiler.compile_services(model.build(services[:3] + services[5:] + [services[3]], slices[:3] + slices[5:], []), "n1")
    assert table.rs.objects == whole.objects
    def same(cmds: list) -> list:
        return sorted(json.dumps(c, sort_keys=True) for c in cmds)

    assert same(plan(Ruleset(compiler.TABLES, before), table.rs, touched)) == same(plan(Ruleset(compiler.TABLES, before), table.rs))
