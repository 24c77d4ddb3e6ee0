"""Services (the nftables tables that replace kube-proxy), pure: endpoints from pod records and
EndpointSlices, which of them take new connections, the tables the compiler makes for a node
(IPv4, and IPv6 beside it for dual-stack Services), and the UDP entries to flush."""

from __future__ import annotations

import json
import tracemalloc
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentd.nft import expr
from agentd.nft.ruleset import NftChain, NftSet, Ruleset, applied, plan
from agentd.resources import kinds
from agentd.services import compiler, model
from agentd.services.agent import stale_udp, unusable_udp
from agentd.services.conntrack import Stale, Unusable


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


def test_an_unset_serving_condition_counts_as_serving():
    """EndpointConditions: an unset ``serving`` is serving, whatever ``ready`` says (the API's
    "nil should be interpreted as true"; kube-proxy: Serving == nil || *Serving): an endpoint
    not ready and terminating, ``serving`` left out, takes new connections when none is ready."""
    s = svc("ext", {"ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]})
    sl = eps_slice("ext-1", "ext", [{"addresses": ["192.0.2.2"], "conditions": {"ready": False, "terminating": True}}],
                   [{"name": "dns", "port": 5353, "protocol": "UDP"}])  # fmt: skip
    (dns,) = model.build([s], [sl], [])
    (e,) = dns.endpoints
    assert (e.ready, e.serving, e.terminating) == (False, True, True)
    assert [x.ip for x in dns.usable()] == ["192.0.2.2"]


def test_a_named_target_port_takes_the_pods_port_of_the_service_ports_protocol_only():
    """Kubernetes' FindPort: a pod's ``dns`` port of UDP is not the ``dns`` target of a TCP
    service port (that port has no endpoint in the pod); the UDP service port has it."""
    dns_pod = pod("dns", "n1", "10.244.1.9", {"app": "dns"}, [{"name": "dns", "containerPort": 53, "protocol": "UDP"}])
    s = svc("dns", {"selector": {"app": "dns"}, "ports": [
        {"name": "tcp", "port": 53, "protocol": "TCP", "targetPort": "dns"},
        {"name": "udp", "port": 53, "protocol": "UDP", "targetPort": "dns"}]})  # fmt: skip
    tcp, udp = model.build([s], [], [dns_pod])
    assert (tcp.protocol, tcp.endpoints) == ("TCP", ())
    assert [(e.ip, e.port) for e in udp.endpoints] == [("10.244.1.9", 53)]


def test_an_address_listed_twice_keeps_its_serving_copy():
    """One address twice, neither ready: the serving terminating copy is kept, not the one
    that is not serving (nor terminating), so it still takes new connections."""
    s = svc("ext", {"ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]})
    for order in (1, -1):
        copies = [{"addresses": ["192.0.2.2"], "conditions": {"ready": False, "serving": True, "terminating": True}},
                  {"addresses": ["192.0.2.2"], "conditions": {"ready": False, "serving": False}}][::order]  # fmt: skip
        sl = eps_slice("ext-1", "ext", copies, [{"name": "dns", "port": 5353, "protocol": "UDP"}])
        (dns,) = model.build([s], [sl], [])
        (e,) = dns.endpoints
        assert (e.ready, e.serving, e.terminating) == (False, True, True)
        assert [x.ip for x in dns.usable()] == ["192.0.2.2"]


def _chain(rs: Ruleset, name: str) -> list[list[dict]]:
    obj = rs.objects[(compiler.FAMILY, compiler.TABLE, "chain", name)]
    assert isinstance(obj, NftChain)
    return [json.loads(r) for r in obj.rules]


def _map(rs: Ruleset, name: str) -> frozenset:
    obj = rs.objects[(compiler.FAMILY, compiler.TABLE, "set", name)]
    assert isinstance(obj, NftSet)
    return obj.elements


VIP = ("10.96.0.10", "tcp", 80)


def test_the_table_one_map_lookup_per_service_and_endpoints_as_map_elements():
    s = svc("web", {"type": "NodePort", "selector": {"app": "web"},
                    "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]})  # fmt: skip
    rs = compiler.compile_services(model.build([s], [], PODS), "n1")
    # Two endpoints: the VIP goes to the shared chain choosing one of two, the node port
    # (externalTrafficPolicy Cluster) to the one that also marks for SNAT.
    assert _map(rs, compiler.SERVICE_IPS) == {(VIP, ("goto", "pick/2"))}
    assert _map(rs, compiler.NODE_PORTS) == {(("tcp", 30080), ("goto", "np-pick/2"))}
    assert _map(rs, "addr/0") == {(VIP, "10.244.1.2")} and _map(rs, "port/0") == {(VIP, 8080)}
    assert _map(rs, "addr/1") == {(VIP, "10.244.2.2")} and _map(rs, "port/1") == {(VIP, 8080)}
    assert _map(rs, "np-addr/1") == {(("tcp", 30080), "10.244.2.2")}
    assert _map(rs, compiler.SVC_COUNTERS) == {(VIP, "svc/shop/web")}
    assert _map(rs, compiler.NP_COUNTERS) == {(("tcp", 30080), "svc/shop/web")}
    # Hairpin: decided after the endpoint is chosen -- only an endpoint of this node (n1)
    # that the choice sent back to itself is SNATed (kube-proxy's); one that reaches a
    # sibling, here or on n2, keeps its address (the sibling's NetworkPolicy sees the pod).
    assert _map(rs, compiler.HAIRPIN) == {("10.244.1.2", "10.244.1.2")}
    _mark, count, choose = _chain(rs, "pick/2")
    assert count == [{"counter": {"map": {"key": compiler.VIP_KEY, "data": "@" + compiler.SVC_COUNTERS}}}]
    vmap = choose[0]["vmap"]
    assert vmap["key"] == {"numgen": {"mode": "random", "mod": 2, "offset": 0}}
    assert vmap["data"]["set"] == [[0, {"goto": {"target": "slot/0"}}], [1, {"goto": {"target": "slot/1"}}]]
    (dnat,) = _chain(rs, "slot/1")
    assert dnat[-1]["dnat"]["addr"]["map"] == {"key": compiler.VIP_KEY, "data": "@addr/1"}
    assert dnat[-1]["dnat"]["port"]["map"] == {"key": compiler.VIP_KEY, "data": "@port/1"}
    assert _chain(rs, "np-pick/2")[0] == [compiler.MARK_MASQ]
    # No chain of the service's own: its endpoints are elements only.
    assert not [k for k in rs.objects if k[3].startswith(("svc/", "ep/", "ext/")) and k[2] == "chain"]
    # One endpoint: the chain for one, no numgen.
    (one,) = model.build([s], [], PODS[:1])
    rs1 = compiler.compile_services([one], "n1")
    assert _map(rs1, compiler.SERVICE_IPS) == {(VIP, ("goto", "pick/1"))}
    assert _chain(rs1, "pick/1")[-1] == [{"goto": {"target": "slot/0"}}]


def test_hairpin_snat_is_decided_after_the_choice_for_an_endpoint_reaching_itself_only():
    """A pod reaching its own Service is masqueraded only when the choice sent it back to
    itself (kube-proxy's): not when it lands on a sibling endpoint, here or on another node,
    whose NetworkPolicy must see the pod's address.  So nothing marks before the choice;
    postrouting masquerades a translated connection whose source and destination are one of
    this node's endpoints (an element E . E), kept while any Service has that endpoint."""
    from agentd.services.model import Endpoint, ServicePort

    def port(name: str, vip: str, *eps: tuple[str, str], node_port: int | None = None, local: bool = False) -> ServicePort:
        return ServicePort("db", name, "", "TCP", 5432, vip, node_port, None, False, local,
                           tuple(Endpoint(ip, 5432, node) for ip, node in eps))

    table = compiler.Table("node1")
    table.update(("db", "db"), [port("db", "10.96.0.20", ("10.244.1.2", "node1"), ("10.244.2.2", "node2"))])
    rs = table.rs
    postrouting = _chain(rs, "postrouting")
    assert postrouting[0] == [
        {"match": {"op": "in", "left": {"ct": {"key": "status"}}, "right": "dnat"}},
        {"match": {"op": "==", "left": {"concat": [compiler.SADDR, expr.payload("ip", "daddr")]}, "right": "@" + compiler.HAIRPIN}},
        compiler.MASQUERADE]  # fmt: skip
    assert _map(rs, compiler.HAIRPIN) == {("10.244.1.2", "10.244.1.2")}  # node2's endpoint is node2's to match
    for n in (1, 2):  # no mark before the choice (but for the node's own connections: test_cluster_ip_masquerades_...)
        assert [r for r in _chain(rs, f"pick/{n}") if compiler.MARK_MASQ in r] == [[compiler.FROM_NODE, compiler.MARK_MASQ]]
        assert [r for r in _chain(rs, f"np-local/{n}") if compiler.MARK_MASQ in r] == [[compiler.FROM_NODE, compiler.MARK_MASQ]]
    # Another Service with the same endpoint (a Local node port too): one element, which stays
    # while either has the endpoint.
    table.update(("db", "ro"), [port("ro", "10.96.0.21", ("10.244.1.2", "node1"), node_port=30432, local=True)])
    assert _map(table.rs, compiler.HAIRPIN) == {("10.244.1.2", "10.244.1.2")}
    table.update(("db", "db"), [])
    assert _map(table.rs, compiler.HAIRPIN) == {("10.244.1.2", "10.244.1.2")}
    table.update(("db", "ro"), [port("ro", "10.96.0.21", ("10.244.2.2", "node2"), node_port=30432, local=True)])
    assert _map(table.rs, compiler.HAIRPIN) == frozenset()
    assert table.rs.objects == compiler.compile_services(
        [port("ro", "10.96.0.21", ("10.244.2.2", "node2"), node_port=30432, local=True)], "node1").objects


def test_cluster_ip_masquerades_what_does_not_come_from_this_nodes_pods():
    """kube-proxy marks a connection to a cluster IP for masquerading unless it comes from the
    pods (detect-local; here NodeCIDR, this node's pod subnet): the node's own and its
    hostNetwork pods' connections, whose source the route to the VIP chose (the underlay
    address, not the tunnel's), would reach another node's endpoint over vxlan and have its
    reply cross the underlay unencapsulated.  The shared pick chains and an affinity Service's
    chain alike, both families; without a pod subnet known, the node's own traffic."""
    s = svc("web", {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]})
    sticky = svc("sticky", {"clusterIP": "10.96.0.11", "selector": {"app": "web"}, "sessionAffinity": "ClientIP",
                            "ports": [{"port": 80, "targetPort": 8080}]})  # fmt: skip
    pods = [pod("b", "n2", "10.244.2.2", {"app": "web"})]
    rs = compiler.compile_services(model.build([s, sticky], [], pods), "n1", pod_subnets={4: "10.244.1.0/24"})
    off_pods = [expr.match(compiler.SADDR, {"prefix": {"addr": "10.244.1.0", "len": 24}}, "!="), compiler.MARK_MASQ]
    assert _chain(rs, "pick/1")[0] == off_pods
    assert _chain(rs, "pick/1")[-1] == [{"goto": {"target": "slot/0"}}]
    assert _chain(rs, "svc/shop/sticky/tcp/80")[0] == off_pods
    assert _chain(compiler.compile_services([], "n1"), "pick/3")[0] == [compiler.FROM_NODE, compiler.MARK_MASQ]
    # Above the prepared counts too (chains made as the endpoint count grows).
    many = [pod(f"p{i}", "n2", f"10.244.2.{i + 10}", {"app": "web"}) for i in range(compiler.SLOTS_MIN + 2)]
    table = compiler.Table("n1", pod_subnets={4: "10.244.1.0/24"})
    table.update(("shop", "web"), model.build([s], [], many))
    assert _chain(table.rs, f"pick/{compiler.SLOTS_MIN + 2}")[0] == off_pods
    # IPv6: the IPv6 pod subnet in the ip6 table.
    v6 = compiler.compile_services([], "n1", (4, 6), pod_subnets={4: "10.244.1.0/24", 6: "fd00:10:244:1::/64"})
    first = json.loads(v6.objects[("ip6", compiler.TABLE, "chain", "pick/2")].rules[0])
    assert first == [expr.match(expr.payload("ip6", "saddr"), {"prefix": {"addr": "fd00:10:244:1::", "len": 64}}, "!="),
                     compiler.MARK_MASQ]  # fmt: skip


def test_local_traffic_policies():
    s = svc("web", {"type": "NodePort", "selector": {"app": "web"}, "externalTrafficPolicy": "Local",
                    "internalTrafficPolicy": "Local",
                    "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]})  # fmt: skip
    rs = compiler.compile_services(model.build([s], [], PODS), "n1")
    np = ("tcp", 30080)
    # From outside: only n1's endpoint, and the node port keeps the client address (no SNAT mark).
    assert _map(rs, compiler.SERVICE_IPS) == {(VIP, ("goto", "pick/1"))}
    assert _map(rs, compiler.NODE_PORTS) == {(np, ("goto", "np-local/1"))}
    assert _map(rs, compiler.HAIRPIN) == {("10.244.1.2", "10.244.1.2")}  # reaching itself: SNAT in postrouting
    from_node, _count, _choose = _chain(rs, "np-local/1")
    # The node's own traffic (reaching np-local only short-circuited) is masqueraded, as kube-proxy does.
    assert from_node == [compiler.FROM_NODE, compiler.MARK_MASQ]
    assert compiler.FROM_NODE == {"match": {"op": "==", "left": {"fib": {"result": "type", "flags": ["saddr"]}}, "right": "local"}}
    # From n1 itself or its pods: kube-proxy's short-circuit, every endpoint.  The slots hold
    # n1's endpoint first: np-local/1 picks it alone, np-local/2 both.
    assert _map(rs, compiler.NP_SHORT_CIRCUIT) == {(np, ("goto", "np-local/2"))}
    assert _map(rs, "np-addr/0") == {(np, "10.244.1.2")} and _map(rs, "np-addr/1") == {(np, "10.244.2.2")}
    assert _map(rs, compiler.NP_UNAVAILABLE) == frozenset()
    # A node without local endpoints: no element for traffic from outside, so no translation there...
    rs3 = compiler.compile_services(model.build([s], [], PODS), "n3")
    assert _map(rs3, compiler.SERVICE_IPS) == frozenset() and _map(rs3, compiler.NODE_PORTS) == frozenset()
    # ... and dropped there (kube-proxy: the endpoints elsewhere are not for traffic from outside;
    # internalTrafficPolicy Local has no short-circuit: the cluster IP is dropped for every client).
    assert _map(rs3, compiler.UNAVAILABLE) == {(VIP, ("goto", compiler.DROP_CHAIN))}
    assert _map(rs3, compiler.NP_UNAVAILABLE) == {(np, ("goto", compiler.DROP_CHAIN))}
    assert _map(rs, compiler.UNAVAILABLE) == frozenset()
    # ... but its own traffic and its pods' goes to every endpoint (no hairpin: no endpoint of its own).
    assert _map(rs3, compiler.NP_SHORT_CIRCUIT) == {(np, ("goto", "np-local/2"))}
    assert {a for i in (0, 1) for _, a in _map(rs3, f"np-addr/{i}")} == {"10.244.1.2", "10.244.2.2"}
    assert _map(rs3, compiler.HAIRPIN) == frozenset()
    # externalTrafficPolicy Cluster: nothing to short-circuit, every client gets every endpoint.
    cluster = compiler.compile_services(model.build([svc("web", {**s["spec"], "externalTrafficPolicy": "Cluster"})], [], PODS), "n3")
    assert _map(cluster, compiler.NP_SHORT_CIRCUIT) == frozenset()
    assert _map(cluster, compiler.NODE_PORTS) == {(np, ("goto", "np-pick/2"))}


def test_local_node_ports_short_circuit_this_nodes_traffic_and_its_pods():
    """The services chain hands a node port to a chain that asks where it came from: from this
    node's pod subnet or the node itself, a Local node port's short-circuit; else its policy."""
    rs = compiler.compile_services([], "n3", pod_subnets={4: "10.244.3.0/24"})
    services = _chain(rs, "services")
    assert services[1][-1] == {"goto": {"target": "nodeports"}}
    assert services[1][0]["match"]["left"] == {"fib": {"result": "type", "flags": ["daddr"]}}
    short = {"vmap": {"key": compiler.NP_KEY, "data": "@" + compiler.NP_SHORT_CIRCUIT}}
    from_pods, from_node, policy = _chain(rs, "nodeports")
    assert from_pods == [expr.match(compiler.SADDR, {"prefix": {"addr": "10.244.3.0", "len": 24}}), short]
    assert from_node == [compiler.FROM_NODE, short]
    assert policy == [{"vmap": {"key": compiler.NP_KEY, "data": "@" + compiler.NODE_PORTS}}]
    # Without a pod subnet (none leased yet): the node's own traffic only.
    assert len(_chain(compiler.compile_services([], "n3"), "nodeports")) == 2
    # This node's endpoints all terminating while others are ready: from outside, the
    # terminating local one (KEP-1669); short-circuited, only the ready one elsewhere
    # (test_a_local_node_ports_short_circuit_takes_no_terminating_endpoint_while_one_is_ready).
    sl = eps_slice("web-1", "web", [
        {"addresses": ["10.244.3.5"], "nodeName": "n3", "conditions": {"ready": False, "serving": True, "terminating": True}},
        {"addresses": ["10.244.1.5"], "nodeName": "n1"},
    ], [{"name": "http", "port": 8080}])  # fmt: skip
    s = svc("web", {"type": "NodePort", "externalTrafficPolicy": "Local",
                    "ports": [{"name": "http", "port": 80, "nodePort": 30080}]})  # fmt: skip
    rs = compiler.compile_services(model.build([s], [sl], []), "n3")
    assert _map(rs, compiler.NODE_PORTS) == {(("tcp", 30080), ("goto", "np-local/1"))}
    assert _map(rs, "np-addr/0") == {(("tcp", 30080), "10.244.3.5")}
    assert _map(rs, compiler.NP_SHORT_CIRCUIT) == {(("tcp", 30080), ("goto", "short-circuit/shop/web/tcp/80"))}
    assert _chain(rs, "short-circuit/shop/web/tcp/80")[-1] == [{"goto": {"target": "np-slot/1"}}]
    assert _map(rs, "np-addr/1") == {(("tcp", 30080), "10.244.1.5")}


def _slots(rs: Ruleset, key: tuple, first: int, n: int) -> list[tuple[str, int]]:
    """The endpoints of node port ``key`` in slots ``first`` to ``first + n - 1``."""
    return [(dict(_map(rs, f"np-addr/{i}"))[key], dict(_map(rs, f"np-port/{i}"))[key]) for i in range(first, first + n)]


def _choice(rule: list[dict]) -> tuple[int, int]:
    """The slots a pick rule chooses among: (first, count)."""
    (stmt,) = rule
    if "goto" in stmt:
        return int(stmt["goto"]["target"].split("/")[1]), 1
    numgen = stmt["vmap"]["key"]["numgen"]
    targets = [int(t["goto"]["target"].split("/")[1]) for _, t in stmt["vmap"]["data"]["set"]]
    assert targets == list(range(numgen["offset"], numgen["offset"] + numgen["mod"])) and numgen["mode"] == "random"
    return numgen["offset"], numgen["mod"]


def test_a_local_node_ports_short_circuit_takes_no_terminating_endpoint_while_one_is_ready():
    """externalTrafficPolicy Local, this node's one endpoint terminating (still serving), one
    ready on another node: from outside the node port goes to the local terminating one
    (np-local/1, KEP-1669's fallback per node, as kube-proxy's local policy chain); from this
    node's pods and the node itself, kube-proxy's short-circuit goes to its cluster policy
    chain, the ready endpoints only (as the cluster IP does): never the terminating one while
    another is ready (review s57/r2: it took it 1 time in 2)."""
    mine = model.Endpoint("10.244.1.5", 8080, "n1", ready=False, serving=True, terminating=True)
    far = model.Endpoint("10.244.2.5", 8080, "n2")
    sp = model.ServicePort("shop", "web", "", "TCP", 80, "10.96.0.10", 30080, None, False, True, (mine, far))
    assert sp.short_circuit_endpoints("n1") == sp.cluster_ip_endpoints("n1") == (far,)
    table = compiler.Table("n1", pod_subnets={4: "10.244.1.0/24"})
    table.update(("shop", "web"), [sp])
    rs, key = table.rs, ("tcp", 30080)
    # From outside: np-local/1 over slot 0, the local terminating endpoint.
    assert _map(rs, compiler.NODE_PORTS) == {(key, ("goto", "np-local/1"))}
    assert _choice(_chain(rs, "np-local/1")[-1]) == (0, 1) and _slots(rs, key, 0, 1) == [("10.244.1.5", 8080)]
    # Short-circuited: the Service's own chain, choosing among the slots after the local ones.
    (short,) = [v for k, v in _map(rs, compiler.NP_SHORT_CIRCUIT) if k == key]
    assert short == ("goto", compiler.short_circuit_chain(sp))
    mark, count, choose = _chain(rs, compiler.short_circuit_chain(sp))
    assert mark == [compiler.FROM_NODE, compiler.MARK_MASQ]  # the node's own traffic masqueraded
    assert count == json.loads(compiler.NP_COUNT)
    first, n = _choice(choose)
    assert _slots(rs, key, first, n) == [("10.244.2.5", 8080)]
    # Two ready elsewhere, two terminating here: a random choice among the two ready ones.
    mine2, far2 = replace(mine, ip="10.244.1.6"), replace(far, ip="10.244.3.5", node="n3")
    table.update(("shop", "web"), [replace(sp, endpoints=(mine, mine2, far, far2))])
    rs = table.rs
    assert _choice(_chain(rs, "np-local/2")[-1]) == (0, 2) and _map(rs, compiler.NODE_PORTS) == {(key, ("goto", "np-local/2"))}
    assert sorted(_slots(rs, key, 0, 2)) == [("10.244.1.5", 8080), ("10.244.1.6", 8080)]
    first, n = _choice(_chain(rs, compiler.short_circuit_chain(sp))[-1])
    assert (first, n) == (2, 2) and sorted(_slots(rs, key, first, n)) == [("10.244.2.5", 8080), ("10.244.3.5", 8080)]
    # This node's endpoint ready again: the shared slots serve both (np-local/1 from outside,
    # np-local/2 short-circuited), the own chain goes.
    table.update(("shop", "web"), [replace(sp, endpoints=(replace(mine, ready=True, terminating=False), far))])
    rs = table.rs
    assert _map(rs, compiler.NP_SHORT_CIRCUIT) == {(key, ("goto", "np-local/2"))}
    assert (compiler.FAMILY, compiler.TABLE, "chain", compiler.short_circuit_chain(sp)) not in rs.objects
    # Nothing ready anywhere: the terminating ones everywhere, the shared slots again (KEP-1669).
    far_t = replace(far, ready=False, serving=True, terminating=True)
    table.update(("shop", "web"), [replace(sp, endpoints=(mine, far_t))])
    rs = table.rs
    assert _map(rs, compiler.NP_SHORT_CIRCUIT) == {(key, ("goto", "np-local/2"))}
    assert _slots(rs, key, 0, 2) == [("10.244.1.5", 8080), ("10.244.2.5", 8080)]


def test_a_local_node_port_whose_endpoints_are_all_here_short_circuits_to_the_shared_slots():
    """externalTrafficPolicy Local with every usable endpoint on this node (the common case):
    the short-circuit is np-local/N over the shared slots, no chain of the Service's own --
    one over the slots after the local ones (which hold nothing here) reached no endpoint
    (a mutant of the shared-slots test, ``set(local) < set(every)``, survived: review s57 r15)."""
    a = model.Endpoint("10.244.1.5", 8080, "n1")
    b = model.Endpoint("10.244.1.6", 8080, "n1")
    sp = model.ServicePort("shop", "web", "", "TCP", 80, "10.96.0.10", 30080, None, False, True, (a, b))
    table = compiler.Table("n1", pod_subnets={4: "10.244.1.0/24"})
    table.update(("shop", "web"), [sp])
    rs, key = table.rs, ("tcp", 30080)
    assert _map(rs, compiler.NP_SHORT_CIRCUIT) == {(key, ("goto", "np-local/2"))}
    assert _map(rs, compiler.NODE_PORTS) == {(key, ("goto", "np-local/2"))}
    assert (compiler.FAMILY, compiler.TABLE, "chain", compiler.short_circuit_chain(sp)) not in rs.objects
    assert _choice(_chain(rs, "np-local/2")[-1]) == (0, 2)
    assert sorted(_slots(rs, key, 0, 2)) == [("10.244.1.5", 8080), ("10.244.1.6", 8080)]


def test_a_local_node_ports_own_short_circuit_has_the_slots_it_picks_from():
    """Above the prepared slots: this node's L terminating endpoints and N ready elsewhere
    take L + N slots, made for it (without pick chains of that count); gone with it."""
    n_local, n_far = 6, compiler.SLOTS_MIN
    eps = tuple(model.Endpoint(f"10.244.1.{i + 10}", 80, "n1", ready=False, serving=True, terminating=True)
                for i in range(n_local)) + tuple(model.Endpoint(f"10.244.2.{i + 10}", 80, "n2") for i in range(n_far))
    sp = model.ServicePort("shop", "web", "", "TCP", 80, "10.96.0.10", 30080, None, False, True, eps)
    table = compiler.Table("n1")
    table.update(("shop", "web"), [sp])
    rs, key = table.rs, ("tcp", 30080)
    first, n = _choice(_chain(rs, compiler.short_circuit_chain(sp))[-1])
    assert (first, n) == (n_local, n_far)
    assert sorted(_slots(rs, key, first, n)) == sorted((e.ip, e.port) for e in eps[n_local:])
    assert table.slots == n_local + n_far and table.picks == set()
    assert (compiler.FAMILY, compiler.TABLE, "chain", f"np-local/{n_local + n_far}") not in rs.objects
    table.update(("shop", "web"), [])
    assert table.slots == compiler.SLOTS_MIN and (compiler.FAMILY, compiler.TABLE, "set", "np-addr/16") not in table.rs.objects


def test_a_service_without_endpoints_is_refused():
    s = svc("web", {"type": "NodePort", "selector": {"app": "none"},
                    "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]})  # fmt: skip
    rs = compiler.compile_services(model.build([s], [], PODS), "n1")
    assert _map(rs, compiler.SERVICE_IPS) == frozenset()
    assert _map(rs, compiler.UNAVAILABLE) == {(VIP, ("goto", compiler.REJECT_CHAIN))}
    assert _map(rs, compiler.NP_UNAVAILABLE) == {(("tcp", 30080), ("goto", compiler.REJECT_CHAIN))}
    assert _chain(rs, compiler.REJECT_CHAIN) == [[{"reject": None}]]
    pre = rs.objects[(compiler.FAMILY, compiler.TABLE, "chain", "filter-prerouting")]
    assert isinstance(pre, NftChain) and pre.hook == ("filter", "prerouting", compiler.DSTNAT + 1, "accept")
    # An endpoint appearing: the refusal goes and the VIP is translated, elements only.
    after = compiler.compile_services(model.build([s], [], [pod("z", "n1", "10.244.1.9", {"app": "none"}, [HTTP])]), "n1")
    assert _map(after, compiler.UNAVAILABLE) == frozenset()
    assert {next(iter(c)) + " " + next(iter(next(iter(c.values())))) for c in plan(rs, after)} == {"delete element", "add element"}


def test_refusals_look_at_a_connections_first_packet_only():
    # As kube-proxy: only ct state new pays the lookups, and a reply to a node's own socket
    # whose port is a node port without endpoints (an established flow) is not refused.
    s = svc("web", {"type": "NodePort", "selector": {"app": "none"},
                    "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]})  # fmt: skip
    rs = compiler.compile_services(model.build([s], [], PODS), "n1", families=(4, 6))
    for fam, table in ((4, compiler.FAMILY), (6, "ip6")):
        for hook in ("prerouting", "output"):
            chain = rs.objects[(table, compiler.TABLE, "chain", f"filter-{hook}")]
            assert isinstance(chain, NftChain)
            rules = [json.loads(r) for r in chain.rules]
            assert len(rules) == 3 and all(r[0] == {"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": "new"}}
                                           for r in rules), (fam, hook, rules)  # fmt: skip
            assert [r[-1]["vmap"]["data"] for r in rules[:2]] == ["@" + compiler.UNAVAILABLE, "@" + compiler.NP_UNAVAILABLE]


def test_a_cluster_ips_undefined_port_is_refused_and_an_unallocated_address_dropped():
    # As kube-proxy's cluster-ips-check, after the translations and for new connections only:
    # still to a cluster IP (a port none of its Services has), reject; still to an address
    # of the service range, drop.  Every cluster IP is in the set (without endpoints, with
    # affinity), for as long as a port of it is; headless Services have none.
    web = svc("web", {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"},
                                                            {"name": "raw", "port": 81, "targetPort": 9000}]})  # fmt: skip
    sticky = svc("sticky", {"clusterIP": "10.96.0.11", "selector": {"app": "web"}, "sessionAffinity": "ClientIP",
                            "ports": [{"name": "http", "port": 80, "targetPort": "http"}]})  # fmt: skip
    empty = svc("empty", {"clusterIP": "10.96.0.12", "selector": {"app": "none"}, "ports": [{"name": "http", "port": 80}]})
    headless = svc("headless", {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"name": "http", "port": 80}]})
    table = compiler.Table("n1", families=(4, 6), service_ranges={4: "10.96.0.0/12", 6: "fd00:10:96::/112"})
    for s_ in (web, sticky, empty, headless):
        table.update(("shop", s_["metadata"]["name"]), model.build([s_], [], PODS))
    rs = table.rs
    assert _map(rs, compiler.CLUSTER_IPS) == {"10.96.0.10", "10.96.0.11", "10.96.0.12"}
    new = {"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": "new"}}
    for table_family, addr, net in (("ip", "ip", {"prefix": {"addr": "10.96.0.0", "len": 12}}),
                                    ("ip6", "ip6", {"prefix": {"addr": "fd00:10:96::", "len": 112}})):  # fmt: skip
        for hook in ("prerouting", "output"):
            chain = rs.objects[(table_family, compiler.TABLE, "chain", f"filter-{hook}")]
            assert isinstance(chain, NftChain)
            *_, port, unallocated = [json.loads(r) for r in chain.rules]
            daddr = {"payload": {"protocol": addr, "field": "daddr"}}
            assert port == [new, {"match": {"op": "==", "left": daddr, "right": "@" + compiler.CLUSTER_IPS}},
                            {"goto": {"target": compiler.NO_PORT_CHAIN}}]  # fmt: skip
            assert unallocated == [new, {"match": {"op": "==", "left": daddr, "right": net}},
                                   {"goto": {"target": compiler.NO_SERVICE_CHAIN}}]  # fmt: skip
    assert _chain(rs, compiler.NO_PORT_CHAIN) == [[{"reject": None}]]
    assert _chain(rs, compiler.NO_SERVICE_CHAIN) == [[{"drop": None}]]
    # One port of web going leaves its address; web gone takes it, elements only.
    table.update(("shop", "web"), [p for p in model.build([web], [], PODS) if p.port == 80])
    assert "10.96.0.10" in _map(table.rs, compiler.CLUSTER_IPS)
    before = applied(table.rs)
    keys = table.update(("shop", "web"), [])
    assert _map(table.rs, compiler.CLUSTER_IPS) == {"10.96.0.11", "10.96.0.12"}
    assert {next(iter(c)) + " " + next(iter(next(iter(c.values())))) for c in plan(before, table.rs, keys)} <= {
        "delete element", "add element", "delete counter"}  # its counter goes with it
    # Without a range (a Table not told it): no drop rule, the undefined ports still refused.
    plain = compiler.compile_services(model.build([web], [], PODS), "n1")
    assert [json.loads(r)[-1] for r in plain.objects[("ip", compiler.TABLE, "chain", "filter-output")].rules][2:] == [
        {"goto": {"target": compiler.NO_PORT_CHAIN}}]


def test_affinity_keeps_a_chain_per_endpoint():
    s = svc("web", {"type": "NodePort", "selector": {"app": "web"}, "externalTrafficPolicy": "Local",
                    "internalTrafficPolicy": "Local", "sessionAffinity": "ClientIP",
                    "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]})  # fmt: skip
    rs = compiler.compile_services(model.build([s], [], PODS), "n1")
    assert _map(rs, compiler.SERVICE_IPS) == {(VIP, ("goto", "svc/shop/web/tcp/80"))}
    ext = _chain(rs, "ext/shop/web/tcp/80")
    assert compiler.MARK_MASQ not in ext[-1]  # Local: the client address is kept
    assert ext[-1][-1] == {"goto": {"target": "ep/shop/web/tcp/80/10.244.1.2/8080"}}
    hairpin, update, dnat = _chain(rs, "ep/shop/web/tcp/80/10.244.1.2/8080")  # affinity: a chain per endpoint
    assert hairpin[1] == compiler.MARK_MASQ and dnat[-1] == {"dnat": {"addr": "10.244.1.2", "port": 8080}}
    aff = rs.objects[(compiler.FAMILY, compiler.TABLE, "set", "aff/shop/web/tcp/80/10.244.1.2/8080/10800")]
    assert isinstance(aff, NftSet) and aff.timeout == 10800 and aff.dynamic
    assert update == [{"set": {"op": "update", "elem": compiler.SADDR, "set": "@aff/shop/web/tcp/80/10.244.1.2/8080/10800"}}]
    rs3 = compiler.compile_services(model.build([s], [], PODS), "n3")
    assert _map(rs3, compiler.SERVICE_IPS) == frozenset() and _map(rs3, compiler.NODE_PORTS) == frozenset()
    # From n3 itself or its pods: short-circuited to every endpoint (the cluster IP's chain has
    # only this node's: a choice of its own), the node's own traffic masqueraded; from outside, dropped.
    assert _map(rs3, compiler.NP_SHORT_CIRCUIT) == {(("tcp", 30080), ("goto", "short-circuit/shop/web/tcp/80"))}
    mark, *choice = _chain(rs3, "short-circuit/shop/web/tcp/80")
    assert mark == [compiler.FROM_NODE, compiler.MARK_MASQ]
    assert {stmt["goto"]["target"] for rule in choice for stmt in rule if "goto" in stmt} == {
        "ep/shop/web/tcp/80/10.244.1.2/8080", "ep/shop/web/tcp/80/10.244.2.2/8080"}
    assert _map(rs3, compiler.NP_UNAVAILABLE) == {(("tcp", 30080), ("goto", compiler.DROP_CHAIN))}
    # internalTrafficPolicy Cluster: the cluster IP's chain has every endpoint, the short-circuit goes there.
    s2 = svc("web", {**s["spec"], "internalTrafficPolicy": "Cluster"})
    rs3 = compiler.compile_services(model.build([s2], [], PODS), "n3")
    assert _chain(rs3, "short-circuit/shop/web/tcp/80")[1:] == [[{"goto": {"target": "svc/shop/web/tcp/80"}}]]


def test_a_changed_affinity_timeout_is_a_new_set_the_old_one_deleted_after_the_chains_leave_it():
    # A set's timeout cannot change in place, and a set a rule still uses cannot be deleted:
    # the new timeout is a new set, the chains rewritten to it, the old set deleted after them.
    def spec(timeout: int) -> dict:
        return {"selector": {"app": "web"}, "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": timeout}},
                "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}  # fmt: skip

    table = compiler.Table("n1")
    table.update(("shop", "web"), model.build([svc("web", spec(10800))], [], PODS))
    current = applied(table.rs)
    keys = table.update(("shop", "web"), model.build([svc("web", spec(60))], [], PODS))
    cmds = plan(current, table.rs, keys)
    eps = ("10.244.1.2/8080", "10.244.2.2/8080")
    sets = [(verb, body["set"]["name"]) for c in cmds for verb, body in c.items() if "set" in body]
    assert sets == [("add", f"aff/shop/web/tcp/80/{e}/60") for e in eps] + [
        ("delete", f"aff/shop/web/tcp/80/{e}/10800") for e in eps], sets  # never flushed, deleted while in use
    assert table.rs.objects[(compiler.FAMILY, compiler.TABLE, "set", "aff/shop/web/tcp/80/10.244.1.2/8080/60")].timeout == 60
    # The chains using the sets are rewritten to the new ones before the old ones go.
    rules = [i for i, c in enumerate(cmds) if "add" in c and "rule" in c["add"] and "@aff/" in json.dumps(c)]
    assert rules and all("/60" in json.dumps(cmds[i]) and "/10800" not in json.dumps(cmds[i]) for i in rules)
    first_delete = min(i for i, c in enumerate(cmds) if "delete" in c and "set" in c["delete"])
    assert max(rules) < first_delete
    chains = [o for o in table.rs.objects.values() if isinstance(o, NftChain)]
    assert not any("/10800" in r for o in chains for r in o.rules)


def test_two_services_claiming_one_vip_or_node_port_the_older_has_it():
    # Records allocation did not check (a hand-written put, a restore): two elements of one key
    # would make the kernel refuse the whole transaction, so the younger Service is left out.
    def claimant(name: str, created: str, node_port: int) -> dict:
        s = svc(name, {"type": "NodePort", "clusterIP": "10.96.0.10", "selector": {"app": name},
                       "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53, "nodePort": node_port}]})  # fmt: skip
        s["metadata"]["creationTimestamp"] = created
        return s

    pods = [pod("x1", "n1", "10.244.1.5", {"app": "x"}), pod("y1", "n1", "10.244.1.6", {"app": "y"}),
            pod("y2", "n1", "10.244.1.7", {"app": "y"})]  # fmt: skip
    x, y = claimant("x", "2024-05-01T00:00:00Z", 30001), claimant("y", "2024-01-01T00:00:00Z", 30001)
    y_only_vip = claimant("y", "2024-01-01T00:00:00Z", 30002)
    dns_vip = ("10.96.0.10", "udp", 53)
    key = (dns_vip, ("goto", "pick/2"))
    for order in ([x, y], [y, x]):  # the older (y) has them whichever comes first
        table = compiler.Table("n1")
        for s in order:
            table.update(("shop", s["metadata"]["name"]), model.build([s], [], pods))
        rs = table.rs
        assert _map(rs, compiler.SERVICE_IPS) == {key}
        assert _map(rs, compiler.NODE_PORTS) == {(("udp", 30001), ("goto", "np-pick/2"))}
        assert {k for k, _ in _map(rs, "addr/0")} == {dns_vip}
        assert table.conflicts == {("shop", "x"): ["cluster IP 10.96.0.10 udp/53 is shop/y's: left out",
                                                  "node port udp/30001 (IPv4) is shop/y's: left out"]}  # fmt: skip
        assert [sp.cluster_ip for sp in table.ports() if sp.service == "x"] == ["10.96.0.10"]  # as asked (DNS, /services)
    # y's node port changes: x keeps only the node port; y goes: x has its VIP back.
    table.update(("shop", "y"), model.build([y_only_vip], [], pods))
    assert table.conflicts == {("shop", "x"): ["cluster IP 10.96.0.10 udp/53 is shop/y's: left out"]}
    assert _map(table.rs, compiler.NODE_PORTS) == {(("udp", 30001), ("goto", "np-pick/1")), (("udp", 30002), ("goto", "np-pick/2"))}
    table.update(("shop", "y"), [])
    assert table.conflicts == {}
    assert _map(table.rs, compiler.SERVICE_IPS) == {(dns_vip, ("goto", "pick/1"))}
    assert _map(table.rs, compiler.NODE_PORTS) == {(("udp", 30001), ("goto", "np-pick/1"))}


def test_a_node_port_only_short_circuited_here_counts_as_translating():
    # Local node port whose endpoints are all on other nodes: this node's pods reaching it are
    # DNATed (short-circuit) without SNAT, so replies must pass conntrack (on_translating(True)).
    for affinity in ("None", "ClientIP"):
        s = svc("web", {"type": "NodePort", "selector": {"app": "web"}, "externalTrafficPolicy": "Local",
                        "internalTrafficPolicy": "Local", "sessionAffinity": affinity,
                        "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]})  # fmt: skip
        table = compiler.Table("n3", pod_subnets={4: "10.244.3.0/24"})
        table.update(("shop", "web"), model.build([s], [], PODS))
        assert not table.elements.get((compiler.FAMILY, compiler.SERVICE_IPS))
        assert not table.elements.get((compiler.FAMILY, compiler.NODE_PORTS))
        assert table.elements.get((compiler.FAMILY, compiler.NP_SHORT_CIRCUIT))
        assert table.translating(), affinity
        table.update(("shop", "web"), [])
        assert not table.translating()


def test_an_endpoint_change_is_element_commands_only():
    s = svc("web", {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]})
    before = compiler.compile_services(model.build([s], [], PODS), "n1")
    after = compiler.compile_services(model.build([s], [], PODS[:1] + PODS[2:]), "n1")
    cmds = plan(before, after)
    verbs = {(next(iter(c)), next(iter(next(iter(c.values()))))) for c in cmds}
    # pick/2 -> pick/1 (a map element replaced), slot 1 emptied, one hairpin address gone:
    # no rule, no chain, nothing that makes libnftables read the table.
    assert verbs == {("delete", "element"), ("add", "element")}
    assert plan(after, after) == []
    # More endpoints than slots prepared: the slots and pick chains grow with them, once.
    many = eps_slice("web-1", "web", [{"addresses": [f"10.244.3.{i}"]} for i in range(1, 21)], [{"name": "http", "port": 8080}])
    s2 = svc("web", {"ports": [{"name": "http", "port": 80}]})
    big = compiler.compile_services(model.build([s2], [many], []), "n1")
    assert _map(big, compiler.SERVICE_IPS) == {(VIP, ("goto", "pick/20"))}
    assert {addr for i in range(20) for _, addr in _map(big, f"addr/{i}")} == {f"10.244.3.{i}" for i in range(1, 21)}
    assert (compiler.FAMILY, compiler.TABLE, "chain", "pick/21") not in big.objects


def _big(n: int, local: bool = False, name: str = "big") -> model.ServicePort:
    eps = tuple(model.Endpoint(f"10.{244 + i // 65025}.{(i // 255) % 255}.{i % 255 + 1}", 8080, "n1" if i % 4 == 0 else "n2")
                for i in range(n))  # fmt: skip
    return model.ServicePort("shop", name, "", "TCP", 80, "10.96.0.1", 30080, None, False, local, eps)


def _vmap_entries(rs: Ruleset) -> int:
    """The numgen choices of every pick chain: what the kernel holds per endpoint count."""
    out = 0
    for obj in rs.objects.values():
        if isinstance(obj, NftChain):
            for rule in obj.rules:
                out += sum(len(e["vmap"]["data"]["set"]) for e in json.loads(rule) if "vmap" in e and "numgen" in e["vmap"]["key"])
    return out


@pytest.mark.parametrize("local", [False, True])
def test_a_service_of_a_thousand_endpoints_costs_rules_linear_in_them(local):
    """The review's case: a chain per count from 17 to the largest was ~1.5 N^2 vmap entries
    (1,000 endpoints: 1.5 million, 62 MB of rules).  Now: the prepared counts, and the counts
    in use (n1's 250 and all 1,000 for a Local node port), each spread evenly over its slots."""
    table = compiler.Table("n1")
    before = applied(table.rs)
    keys = table.update(("shop", "big"), [_big(1000, local)])
    rs = table.rs
    prepared = 3 * sum(range(1, compiler.SLOTS_MIN + 1))
    counts = {1000, 250} if local else {1000}
    assert _vmap_entries(rs) <= prepared + 3 * sum(counts)
    assert len(rs.objects) <= 60 + 3 * (compiler.SLOTS_MIN + len(counts)) + 6 * 1000
    text = sum(len(json.dumps(c)) for c in plan(before, rs, keys))
    assert text < 4_000_000, text  # was 62 MB
    for n in counts:  # every endpoint equally likely: numgen mod n, slot i once each
        choose = _chain(rs, compiler.np_pick_chain(n, local) if local else compiler.pick_chain(n))[-1]
        vmap = choose[0]["vmap"]
        assert vmap["key"]["numgen"]["mod"] == n
        assert [i for i, _ in vmap["data"]["set"]] == list(range(n))
        assert [g["goto"]["target"] for _, g in vmap["data"]["set"]] == [f"{'np-' if local else ''}slot/{i}" for i in range(n)]
    assert not any(k[3] == "pick/999" or k[3] == "pick/17" for k in rs.objects)


def _goto_targets(table: compiler.Table) -> set[str]:
    """Every chain a rule or a map element of ``table`` jumps or goes to."""
    out: set[str] = set()

    def walk(x) -> None:
        if isinstance(x, dict):
            for verb in ("goto", "jump"):
                if isinstance(x.get(verb), dict):
                    out.add(x[verb]["target"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple):
            if len(x) == 2 and x[0] in ("goto", "jump") and isinstance(x[1], str):
                out.add(x[1])
            for v in x:
                walk(v)

    for obj in table.rs.objects.values():
        if isinstance(obj, NftChain):
            for rule in obj.rules:
                walk(json.loads(rule))
    for elems in table.elements.values():
        walk(list(elems))
    return out


@pytest.mark.parametrize("internal", [False, True])
def test_every_chain_a_map_element_goes_to_exists_for_local_policies_above_the_prepared_counts(internal):
    """externalTrafficPolicy Local with 40 endpoints, 10 of them here: the node port's short
    circuit goes to np-local/40 -- a count no cluster IP's pick makes when internalTrafficPolicy
    is Local too (that one picks among the 10); nft refuses a whole batch with one missing chain."""
    eps = tuple(model.Endpoint(f"10.244.{i // 250}.{i % 250 + 1}", 8080, "n1" if i % 4 == 0 else "n2") for i in range(40))
    sp = model.ServicePort("shop", "big", "", "TCP", 80, "10.96.0.1", 30080, None, internal, True, eps)
    table = compiler.Table("n1")
    table.update(("shop", "big"), [sp])
    chains = {k[3] for k in table.rs.objects if k[2] == "chain"}
    targets = _goto_targets(table)
    assert compiler.np_pick_chain(40, True) in targets
    assert targets <= chains, sorted(targets - chains)


def test_a_rolling_update_back_and_forth_changes_rules_once_per_count():
    """Endpoints 1,000 -> 1,001 (a new pod ready) -> 1,000 (an old one gone) -> 1,001 ...:
    the chains of a count just left stay while near one in use, so only the first visit of
    a count is a rule change; the others are elements only.  Gone far below: they go."""
    table = compiler.Table("n1")
    table.update(("shop", "big"), [_big(1000)])
    cur = applied(table.rs)

    def step(n: int) -> set:
        nonlocal cur
        keys = table.update(("shop", "big"), [_big(n)])
        kinds = {k[2] for k in keys if k in table.rs.objects or k in cur.objects} - {"set"}
        verbs = {next(iter(c)) + " " + next(iter(next(iter(c.values())))) for c in plan(cur, table.rs, keys)}
        cur = applied(table.rs)
        return kinds | ({"rules"} if verbs - {"add element", "delete element"} else set())

    assert "rules" in step(1001)  # a new count: its chains
    for n in (1000, 1001, 1000, 1001):
        assert step(n) == set(), n
    assert (compiler.FAMILY, compiler.TABLE, "chain", "pick/1000") in table.rs.objects
    step(10)
    assert not [k for k in table.rs.objects if k[3] in ("pick/1000", "pick/1001", "slot/16")]
    assert table.rs.objects == compiler.compile_services([_big(10)], "n1").objects
    # At most RETAIN unused counts kept, near one in use: linear still.
    table.update(("shop", "big"), [_big(1000)])
    for n in range(1001, 1011):
        table.update(("shop", "big"), [_big(n)])
    assert len(table.picks) == 1 + compiler.RETAIN
    assert table.picks == {1010, *range(1010 - compiler.RETAIN, 1010)}  # the most recent ones


def test_stale_udp_endpoints_are_those_no_longer_serving():
    s = svc("dns", {"type": "NodePort", "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053}]})
    sl = eps_slice("dns-1", "dns", [{"addresses": ["192.0.2.1"]}, {"addresses": ["192.0.2.2"]}],
                   [{"name": "dns", "port": 5353, "protocol": "UDP"}])  # fmt: skip
    before = model.build([s], [sl], [])
    sl["endpoints"][1]["conditions"] = {"ready": False}  # serving unset: serving (the API's nil, kube-proxy's)
    assert stale_udp(before, model.build([s], [sl], [])) == []
    sl["endpoints"][1]["conditions"] = {"ready": False, "serving": False}
    after = model.build([s], [sl], [])
    (stale,) = stale_udp(before, after)
    assert stale == Stale("192.0.2.2", 5353, "10.96.0.10", 53, 30053)
    assert stale.matches("10.96.0.10", 53, "192.0.2.2", 5353) and stale.matches("192.0.2.50", 30053, "192.0.2.2", 5353, {"192.0.2.50"})
    assert not stale.matches("10.96.0.11", 53, "192.0.2.2", 5353) and not stale.matches("10.96.0.10", 53, "192.0.2.1", 5353)
    assert stale_udp(after, after) == [] and stale_udp(before, []) != []



def test_an_endpoint_still_used_after_turning_terminating_keeps_its_udp_flows():
    # The only endpoint going from ready to serving+terminating is still used (KEP-1669): its flows stay.
    s = svc("stats", {"ports": [{"name": "", "port": 8125, "protocol": "UDP"}]})

    def built(conditions: dict) -> list:
        sl = eps_slice("stats-1", "stats", [{"addresses": ["10.244.1.2"], "conditions": conditions}],
                       [{"name": "", "port": 8125, "protocol": "UDP"}])  # fmt: skip
        return model.build([s], [sl], [])

    ready, terminating = built({"ready": True}), built({"ready": False, "serving": True, "terminating": True})
    assert [(e.ip, e.port) for e in terminating[0].usable()] == [("10.244.1.2", 8125)]
    assert stale_udp(ready, terminating) == []
    assert stale_udp(terminating, ready) == []
    gone = built({"ready": False, "serving": False, "terminating": True})
    assert stale_udp(terminating, gone) == [Stale("10.244.1.2", 8125, "10.96.0.10", 8125, None)]


def test_one_change_touches_that_service_and_the_maps_it_is_in():
    services = [svc(f"s{i}", {"type": "NodePort", "ports": [{"name": "http", "port": 80, "nodePort": 30000 + i}]}) for i in range(20)]
    for i, s in enumerate(services):
        s["spec"]["clusterIP"] = f"10.96.1.{i + 1}"
    slices = [eps_slice(f"s{i}-1", f"s{i}", [{"addresses": [f"10.244.1.{i + 1}"]}, {"addresses": [f"10.244.2.{i + 1}"]}],
                        [{"name": "http", "port": 8080}]) for i in range(20)]  # fmt: skip
    table = compiler.Table("n1")

    def build(i: int, with_slice: bool = True) -> list:
        return model.build([services[i]], [slices[i]] if with_slice else [], [])

    for i in range(20):
        table.update(("shop", f"s{i}"), build(i))
    whole = compiler.compile_services(model.build(services, slices, []), "n1")
    assert table.rs.objects == whole.objects
    # s3 loses an endpoint, s4 goes, s5 is the same again.
    before = dict(table.rs.objects)
    slices[3]["endpoints"].pop()
    touched = table.update(("shop", "s3"), build(3))
    touched |= table.update(("shop", "s4"), [])
    assert table.update(("shop", "s5"), build(5)) == set()
    names = {k[3] for k in touched}
    assert names == {compiler.SERVICE_IPS, compiler.NODE_PORTS, compiler.HAIRPIN, compiler.SVC_COUNTERS, compiler.NP_COUNTERS, compiler.CLUSTER_IPS,
                     "addr/0", "port/0", "addr/1", "port/1", "np-addr/0", "np-port/0", "np-addr/1", "np-port/1",
                     "svc/shop/s4"}, names  # fmt: skip
    whole = compiler.compile_services(model.build(services[:4] + services[5:], slices[:4] + slices[5:], []), "n1")
    assert table.rs.objects == whole.objects

    def same(cmds: list) -> list:
        return sorted(json.dumps(c, sort_keys=True) for c in cmds)

    assert same(plan(Ruleset(table.rs.tables, before), table.rs, touched)) == same(plan(Ruleset(table.rs.tables, before), table.rs))
    # The maps carry their exact difference (no pass over their elements in plan); it is the
    # difference a full comparison finds.
    ips = table.rs.objects[(compiler.FAMILY, compiler.TABLE, "set", compiler.SERVICE_IPS)]
    assert isinstance(ips, NftSet) and ips.delta is not None and ips.delta[0] is before[ips.key]
    plain = Ruleset(table.rs.tables, {k: replace(v, delta=None) if isinstance(v, NftSet) else v for k, v in table.rs.objects.items()})
    assert same(plan(Ruleset(table.rs.tables, before), table.rs)) == same(plan(Ruleset(table.rs.tables, before), plain))
    # Growing past the prepared slots adds slot maps and the pick chains of that count (not
    # of every count up to it); shrinking back removes them.
    wide = eps_slice("s6-1", "s6", [{"addresses": [f"10.244.3.{i}"]} for i in range(1, 19)], [{"name": "http", "port": 8080}])
    grown = table.update(("shop", "s6"), model.build([services[6]], [wide], []))
    assert {"pick/18", "np-pick/18", "np-local/18", "slot/16", "slot/17", "addr/17"} <= {k[3] for k in grown}
    assert "pick/17" not in {k[3] for k in grown}
    shrunk = table.update(("shop", "s6"), build(6))
    assert (compiler.FAMILY, compiler.TABLE, "set", "addr/17") in shrunk
    assert (compiler.FAMILY, compiler.TABLE, "chain", "pick/18") not in table.rs.objects
    assert table.rs.objects == compiler.compile_services(table.ports(), "n1").objects


def test_a_service_that_keeps_changing_keeps_one_version_of_each_map_back():
    """Each read of the table builds the changed maps anew with their difference from the
    version read before (plan() takes it when the kernel holds that version).  Only that one
    version stays reachable: a chain of every version, each holding the one before, kept all
    of them -- with 2000 Services, tens of KB per endpoint change, for as long as the agent ran."""
    services = [svc(f"s{i}", {"type": "NodePort", "ports": [{"name": "http", "port": 80, "nodePort": 30000 + i}]}) for i in range(40)]
    for i, s in enumerate(services):
        s["spec"]["clusterIP"] = f"10.96.1.{i + 1}"
    table = compiler.Table("n1")

    def build(i: int, change: int = 0) -> list:
        sl = eps_slice(f"s{i}-1", f"s{i}", [{"addresses": [f"10.244.1.{i + 1}"]}, {"addresses": [f"10.244.{2 + change % 200}.{i + 1}"]}],
                       [{"name": "http", "port": 8080}])  # fmt: skip
        return model.build([services[i]], [sl], [])

    for i in range(40):
        table.update(("shop", f"s{i}"), build(i))
    current = applied(table.rs)  # what the kernel holds, as the programmer keeps it

    def depth(obj: NftSet) -> int:
        n = 0
        while obj.delta is not None:
            n, obj = n + 1, obj.delta[0]
        return n

    def change(n: int) -> None:
        nonlocal current
        touched = table.update(("shop", "s7"), build(7, n))
        rs = table.rs
        # plan()'s fast path: each changed map's delta is from the very object the kernel holds.
        changed = [rs.objects[k] for k in touched if isinstance(rs.objects.get(k), NftSet) and rs.objects[k] != current.objects.get(k)]
        assert changed and all(o.delta is not None and o.delta[0] is current.objects[o.key] for o in changed)
        cmds = plan(current, rs, touched)
        # Element by element, from the delta: no flush, nothing but the endpoint that went and came.
        assert cmds and all(next(iter(c.values())).keys() == {"element"} for c in cmds), cmds
        assert not any("flush" in c for c in cmds)
        assert sum(len(next(iter(c.values()))["element"]["elem"]) for c in cmds) <= 8, cmds
        current = applied(rs)
        assert all(depth(o) <= 1 for o in rs.objects.values() if isinstance(o, NftSet))

    tracemalloc.start()
    try:
        for n in range(1, 51):
            change(n)
        half = tracemalloc.get_traced_memory()[0]
        for n in range(51, 101):
            change(n)
        grown = tracemalloc.get_traced_memory()[0] - half
    finally:
        tracemalloc.stop()
    # Kept: a few KB at most (the last versions' own sizes differ a little), not 50 more
    # versions of each slot map.
    assert grown < 20_000, grown
    assert table.rs.objects == compiler.compile_services(table.ports(), "n1").objects


# ------------------------------------------------------------------ IPv6 and dual-stack


def pod2(name: str, node: str, v4: str | None, v6: str | None, labels: dict, ports=(), ns: str = "shop") -> dict:
    ips = [{"ip": ip} for ip in (v4, v6) if ip]
    return kinds.validate({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "pod", "ports": list(ports)}]}, "status": {"podIPs": ips},
    })  # fmt: skip


DUAL_PODS = [
    pod2("a", "n1", "10.244.1.2", "fd00:10:244:1::2", {"app": "web"}, [HTTP]),
    pod2("b", "n2", "10.244.2.2", "fd00:10:244:2::2", {"app": "web"}, [HTTP]),
    pod2("c", "n2", None, "fd00:10:244:2::3", {"app": "web"}, [HTTP]),  # IPv6 only
]
VIP6 = ("fd00:10:96::a", "tcp", 80)


def dual(name: str, spec: dict, ips: list[str], families: list[str]) -> dict:
    obj = svc(name, spec)
    obj["spec"].update(clusterIP=ips[0], clusterIPs=ips, ipFamilies=families, ipFamilyPolicy="RequireDualStack")
    return obj


def _map6(rs: Ruleset, name: str) -> frozenset:
    obj = rs.objects[("ip6", compiler.TABLE, "set", name)]
    assert isinstance(obj, NftSet)
    return obj.elements


def test_a_dual_stack_service_is_a_port_per_family_each_with_its_family_of_endpoints():
    s = dual("web", {"type": "NodePort", "selector": {"app": "web"},
                     "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]},
             ["10.96.0.10", "fd00:10:96::a"], ["IPv4", "IPv6"])  # fmt: skip
    v4, v6 = model.build([s], [], DUAL_PODS)
    assert (v4.family, v4.cluster_ip, [e.ip for e in v4.endpoints]) == (4, "10.96.0.10", ["10.244.1.2", "10.244.2.2"])
    assert (v6.family, v6.cluster_ip) == (6, "fd00:10:96::a")
    assert [e.ip for e in v6.endpoints] == ["fd00:10:244:1::2", "fd00:10:244:2::2", "fd00:10:244:2::3"]
    assert v4.key != v6.key and v4.node_port == v6.node_port == 30080
    # Single-stack IPv6: the IPv6 port alone.
    (only,) = model.build([dual("six", {"selector": {"app": "web"}, "ports": [{"port": 80}]}, ["fd00:10:96::b"], ["IPv6"])], [], DUAL_PODS)
    assert only.family == 6 and len(only.endpoints) == 3
    # A headless dual-stack Service: a port per family without a cluster IP.
    hl = svc("hl", {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 80}]})
    hl["spec"].update(clusterIPs=["None"], ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="RequireDualStack")
    a, b = model.build([hl], [], DUAL_PODS)
    assert (a.cluster_ip, a.family, len(a.endpoints), b.cluster_ip, b.family, len(b.endpoints)) == (None, 4, 2, None, 6, 3)


def test_slices_count_for_the_family_of_their_address_type():
    s = dual("ext", {"ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}, ["10.96.0.10", "fd00:10:96::a"], ["IPv4", "IPv6"])
    v4_slice = eps_slice("ext-1", "ext", [{"addresses": ["192.0.2.1"]}], [{"name": "dns", "port": 5353, "protocol": "UDP"}])
    v6_slice = eps_slice("ext-2", "ext", [], [{"name": "dns", "port": 5353, "protocol": "UDP"}])
    v6_slice.update(addressType="IPv6", endpoints=[{"addresses": ["2001:db8::1"], "conditions": {}}])
    v4, v6 = model.build([s], [v4_slice, v6_slice], [])
    assert [e.ip for e in v4.endpoints] == ["192.0.2.1"] and [e.ip for e in v6.endpoints] == ["2001:db8::1"]


def test_the_ipv6_table_is_the_ipv4_one_with_ipv6_addresses():
    s = dual("web", {"type": "NodePort", "selector": {"app": "web"},
                     "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]},
             ["10.96.0.10", "fd00:10:96::a"], ["IPv4", "IPv6"])  # fmt: skip
    ports = model.build([s], [], DUAL_PODS)
    rs = compiler.compile_services(ports, "n1", (4, 6))
    assert rs.tables == {("ip", compiler.TABLE), ("ip6", compiler.TABLE)}
    assert _map(rs, compiler.SERVICE_IPS) == {(VIP, ("goto", "pick/2"))}  # the IPv4 table as it was
    assert _map6(rs, compiler.SERVICE_IPS) == {(VIP6, ("goto", "pick/3"))}
    assert _map6(rs, "addr/2") == {(VIP6, "fd00:10:244:2::3")} and _map6(rs, "port/2") == {(VIP6, 8080)}
    assert _map6(rs, compiler.NODE_PORTS) == {(("tcp", 30080), ("goto", "np-pick/3"))}
    assert _map6(rs, compiler.HAIRPIN) == {("fd00:10:244:1::2", "fd00:10:244:1::2")}  # n1's endpoint only
    sets = {k[3]: o for k, o in rs.objects.items() if k[0] == "ip6" and isinstance(o, NftSet)}
    assert sets[compiler.SERVICE_IPS].type == ("ipv6_addr", "inet_proto", "inet_service")
    assert sets["addr/0"].map == "ipv6_addr" and sets[compiler.HAIRPIN].type[:2] == ("ipv6_addr", "ipv6_addr")
    (dnat,) = [json.loads(r) for r in rs.objects[("ip6", compiler.TABLE, "chain", "slot/0")].rules]
    assert dnat[-1]["dnat"]["family"] == "ip6" and dnat[-1]["dnat"]["addr"]["map"]["key"] == compiler.vip_key(expr.IPV6)
    services = [json.loads(r) for r in rs.objects[("ip6", compiler.TABLE, "chain", "services")].rules]
    assert {"match": {"op": "!=", "left": {"payload": {"protocol": "ip6", "field": "daddr"}}, "right": "::1"}} in services[1]
    # An IPv4-only node leaves the IPv6 ports out and has no ip6 table.
    rs4 = compiler.compile_services(ports, "n1")
    assert rs4.tables == {("ip", compiler.TABLE)} and not [k for k in rs4.objects if k[0] == "ip6"]
    assert rs4.objects == compiler.compile_services([p for p in ports if p.family == 4], "n1").objects


def test_ipv6_affinity_and_local_policies():
    s = dual("web", {"type": "NodePort", "selector": {"app": "web"}, "externalTrafficPolicy": "Local",
                     "sessionAffinity": "ClientIP",
                     "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]},
             ["10.96.0.10", "fd00:10:96::a"], ["IPv4", "IPv6"])  # fmt: skip
    rs = compiler.compile_services(model.build([s], [], DUAL_PODS), "n2", (4, 6))
    chain = "ep/shop/web/tcp/80/fd00:10:244:2::3/8080"
    hairpin, update, dnat = [json.loads(r) for r in rs.objects[("ip6", compiler.TABLE, "chain", chain)].rules]
    saddr6 = {"payload": {"protocol": "ip6", "field": "saddr"}}
    assert hairpin[0]["match"] == {"op": "==", "left": saddr6, "right": "fd00:10:244:2::3"}
    assert update == [{"set": {"op": "update", "elem": saddr6, "set": "@aff/shop/web/tcp/80/fd00:10:244:2::3/8080/10800"}}]
    assert dnat[-1] == {"dnat": {"addr": "fd00:10:244:2::3", "port": 8080}}
    aff = rs.objects[("ip6", compiler.TABLE, "set", "aff/shop/web/tcp/80/fd00:10:244:2::3/8080/10800")]
    assert isinstance(aff, NftSet) and aff.type == ("ipv6_addr",) and aff.timeout == 10800
    ext = [json.loads(r) for r in rs.objects[("ip6", compiler.TABLE, "chain", "ext/shop/web/tcp/80")].rules]
    targets = {stmt["goto"]["target"] for rule in ext for stmt in rule if "goto" in stmt}
    assert targets == {"ep/shop/web/tcp/80/fd00:10:244:2::2/8080", "ep/shop/web/tcp/80/fd00:10:244:2::3/8080"}  # n2's own


def test_ipv6_local_node_port_short_circuit():
    s = dual("web", {"type": "NodePort", "selector": {"app": "web"}, "externalTrafficPolicy": "Local",
                     "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]},
             ["10.96.0.10", "fd00:10:96::a"], ["IPv4", "IPv6"])  # fmt: skip
    subnets = {4: "10.244.3.0/24", 6: "fd00:10:244:3::/64"}
    rs = compiler.compile_services(model.build([s], [], DUAL_PODS), "n3", (4, 6), subnets)
    # n3 has no endpoint: from outside dropped, from n3 or its pods every endpoint of the family.
    assert _map6(rs, compiler.NODE_PORTS) == frozenset()
    assert _map6(rs, compiler.NP_UNAVAILABLE) == {(("tcp", 30080), ("goto", compiler.DROP_CHAIN))}
    assert _map6(rs, compiler.NP_SHORT_CIRCUIT) == {(("tcp", 30080), ("goto", "np-local/3"))}
    assert _map(rs, compiler.NP_SHORT_CIRCUIT) == {(("tcp", 30080), ("goto", "np-local/2"))}
    assert {a for i in range(3) for _, a in _map6(rs, f"np-addr/{i}")} == {"fd00:10:244:1::2", "fd00:10:244:2::2", "fd00:10:244:2::3"}
    from_pods, from_node, _ = [json.loads(r) for r in rs.objects[("ip6", compiler.TABLE, "chain", "nodeports")].rules]
    assert from_pods[0] == expr.match(expr.payload("ip6", "saddr"), {"prefix": {"addr": "fd00:10:244:3::", "len": 64}})
    assert from_node[0] == compiler.FROM_NODE
    (from_node6, *_) = [json.loads(r) for r in rs.objects[("ip6", compiler.TABLE, "chain", "np-local/3")].rules]
    assert from_node6 == [compiler.FROM_NODE, compiler.MARK_MASQ]


def test_stale_ipv6_udp_endpoints():
    s = dual("dns", {"ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}, ["10.96.0.10", "fd00:10:96::a"], ["IPv4", "IPv6"])
    sl = eps_slice("dns-6", "dns", [], [{"name": "dns", "port": 5353, "protocol": "UDP"}])
    sl.update(addressType="IPv6", endpoints=[{"addresses": ["2001:db8::1"]}, {"addresses": ["2001:db8::2"]}])
    before = model.build([s], [sl], [])
    sl["endpoints"] = sl["endpoints"][:1]
    assert stale_udp(before, model.build([s], [sl], [])) == [Stale("2001:db8::2", 5353, "fd00:10:96::a", 53, None)]


def test_ingress_proxies_to_the_primary_familys_endpoints():
    from agentd.ingress.controller import backend_servers

    spec = {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}
    v4_first = model.build([dual("web", spec, ["10.96.0.10", "fd00:10:96::a"], ["IPv4", "IPv6"])], [], DUAL_PODS)
    assert backend_servers(v4_first, 80) == {("10.244.1.2", 8080), ("10.244.2.2", 8080)}
    v6_first = model.build([dual("web", spec, ["fd00:10:96::a", "10.96.0.10"], ["IPv6", "IPv4"])], [], DUAL_PODS)
    assert backend_servers(v6_first, "http") == {("fd00:10:244:1::2", 8080), ("fd00:10:244:2::2", 8080), ("fd00:10:244:2::3", 8080)}
    assert backend_servers(v4_first, 81) == set()


@pytest.mark.parametrize("policy", ["externalTrafficPolicy", "internalTrafficPolicy"])
def test_a_traffic_policy_turned_local_keeps_the_udp_flows_of_serving_endpoints(policy):
    # Cluster -> Local: the other nodes' endpoints take no new connections through that path
    # here, but they still serve: their flows stay, as kube-proxy keeps them (its cleanup does
    # not take traffic policies into account).
    def built(local: bool) -> list:
        spec = {"type": "NodePort", "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053}]}
        if local:
            spec[policy] = "Local"
        sl = eps_slice("dns-1", "dns", [{"addresses": ["192.0.2.1"], "nodeName": "n1"}, {"addresses": ["192.0.2.2"], "nodeName": "n2"}],
                       [{"name": "dns", "port": 5353, "protocol": "UDP"}])  # fmt: skip
        return model.build([svc("dns", spec)], [sl], [])

    cluster, local = built(False), built(True)
    assert stale_udp(cluster, local) == [] and stale_udp(local, cluster) == []


def test_udp_flows_are_flushed_when_their_endpoint_leaves_the_serving_set_only():
    """The review's case: an endpoint going from ready to serving and terminating while
    another is ready takes no new flow, but its flows stay (graceful drain of stateful UDP);
    they go when it stops serving or leaves -- every node's endpoint, through the cluster IP
    and the node port alike, from any source (kube-proxy's cleanup)."""
    from agentd.services.model import Endpoint, ServicePort

    a, b = Endpoint("10.244.1.2", 53, "n1"), Endpoint("10.244.2.2", 53, "n2")
    sp = ServicePort("kube-system", "dns", "dns", "UDP", 53, "10.96.0.10", 30053, None, False, True, (a, b))
    draining = replace(sp, endpoints=(replace(a, ready=False, serving=True, terminating=True), b))
    assert [e.ip for e in draining.usable()] == ["10.244.2.2"]
    assert stale_udp([sp], [draining]) == []
    done = replace(sp, endpoints=(replace(a, ready=False, serving=False, terminating=True), b))
    assert stale_udp([draining], [done]) == [Stale("10.244.1.2", 53, "10.96.0.10", 53, 30053)]
    assert stale_udp([sp], [replace(sp, endpoints=(a,))]) == [Stale("10.244.2.2", 53, "10.96.0.10", 53, 30053)]
    # Not serving before: it took no traffic, nothing to flush.
    assert stale_udp([done], [replace(done, endpoints=(b,))]) == []
    # A cluster IP this port no longer has here (taken by an older Service): its flows to
    # every endpoint go, the node port's stay.
    assert stale_udp([sp], [replace(sp, cluster_ip=None)]) == [
        Stale("10.244.1.2", 53, "10.96.0.10", 53, None), Stale("10.244.2.2", 53, "10.96.0.10", 53, None)]
    # Likewise a node port that changed or went: its flows to every endpoint go (no longer
    # translated through it), the cluster IP's stay.
    for node_port in (30054, None):
        assert stale_udp([sp], [replace(sp, node_port=node_port)]) == [
            Stale("10.244.1.2", 53, None, 53, 30053), Stale("10.244.2.2", 53, None, 53, 30053)]


@pytest.mark.parametrize("policy", ["externalTrafficPolicy", "internalTrafficPolicy"])
def test_a_local_path_is_checked_against_this_nodes_endpoints_after_a_restart(policy):
    # The first sync after start (nothing applied before): each path its own Unusable, a
    # Local one with this node's endpoints only (the policy may have turned Local while the
    # agent was down), the other with every usable one.
    spec = {"type": "NodePort", "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053}], policy: "Local"}
    sl = eps_slice("dns-1", "dns", [{"addresses": ["192.0.2.1"], "nodeName": "n1"}, {"addresses": ["192.0.2.2"], "nodeName": "n2"}],
                   [{"name": "dns", "port": 5353, "protocol": "UDP"}])  # fmt: skip
    ports = model.build([svc("dns", spec)], [sl], [])
    mine, every = frozenset({("192.0.2.1", 5353)}), frozenset({("192.0.2.1", 5353), ("192.0.2.2", 5353)})
    local_vip, local_np = policy == "internalTrafficPolicy", policy == "externalTrafficPolicy"
    assert unusable_udp([], ports, "n1", first=True) == [
        Unusable("10.96.0.10", 53, None, 4, mine if local_vip else every),
        Unusable(None, 53, 30053, 4, mine if local_np else every),
    ]


def test_an_address_listed_twice_is_one_endpoint_with_or_without_its_node():
    """The API allows one address in two endpoints (one slice or two), one naming its node
    and one not: kube-proxy keeps one per address and port, the ready one; so does the model
    (sorting a node against none raised, and the sync loop died on it)."""
    s = svc("db", {"ports": [{"name": "", "port": 5432, "targetPort": 5432}]})
    ports = [{"name": "", "port": 5432, "protocol": "TCP"}]
    sl = eps_slice("db-1", "db", [{"addresses": ["10.244.2.7"], "nodeName": "n2"}, {"addresses": ["10.244.2.7"]},
                                  {"addresses": ["10.244.2.8"], "conditions": {"ready": False}, "nodeName": "n2"}], ports)
    other = eps_slice("db-2", "db", [{"addresses": ["10.244.2.8"]}], ports)  # ready, without its node
    (db,) = model.build([s], [sl, other], [])
    assert [(e.ip, e.node, e.ready) for e in db.endpoints] == [("10.244.2.7", "n2", True), ("10.244.2.8", "n2", True)]
    assert [e.ip for e in db.usable("n2")] == ["10.244.2.7", "10.244.2.8"]
    # A ServicePort made otherwise (two copies of an address, one without a node) still orders its endpoints.
    mixed = replace(db, endpoints=(model.Endpoint("10.244.2.7", 5432, "n2"), model.Endpoint("10.244.2.7", 5432)))
    assert len(mixed.usable()) == 2
    assert compiler.compile_services([db], "n1").objects[(compiler.FAMILY, compiler.TABLE, "set", "addr/1")].elements


def test_masquerading_clears_the_mark_before_the_packet_is_encapsulated():
    """kube-proxy clears its masquerade bit in postrouting (kubernetes#92035): vxlan and ipip
    keep the skb mark on the encapsulated packet, which would be masqueraded too."""
    rs = compiler.compile_services([], "n1", families=(4, 6))
    for table in (compiler.FAMILY, "ip6"):
        rules = [json.loads(r) for r in rs.objects[(table, compiler.TABLE, "chain", "postrouting")].rules]
        mark = expr.meta("mark")
        assert rules[1:] == [
            [{"match": {"op": "==", "left": {"&": [mark, compiler.MASQ_MARK]}, "right": 0}}, {"return": None}],
            [{"mangle": {"key": mark, "value": {"^": [mark, compiler.MASQ_MARK]}}}],
            [{"masquerade": {"flags": ["fully-random"]}}],
        ]  # fmt: skip
        assert rules[0][-1] == {"masquerade": {"flags": ["fully-random"]}}  # the hairpin, as the agent's other masquerading


def test_a_node_port_without_endpoints_is_not_refused_on_loopback():
    """As the nat chain (and kube-proxy's noLocalhost): 127.0.0.0/8 and ::1 are no node port's."""
    s = svc("web", {"type": "NodePort", "selector": {"app": "none"},
                    "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]})  # fmt: skip
    rs = compiler.compile_services(model.build([s], [], PODS), "n1", families=(4, 6))
    for table, proto, loopback in ((compiler.FAMILY, "ip", {"prefix": {"addr": "127.0.0.0", "len": 8}}), ("ip6", "ip6", "::1")):
        not_loopback = {"match": {"op": "!=", "left": expr.payload(proto, "daddr"), "right": loopback}}
        for hook in ("prerouting", "output"):
            rules = [json.loads(r) for r in rs.objects[(table, compiler.TABLE, "chain", f"filter-{hook}")].rules]
            (np_rule,) = [r for r in rules if r[-1].get("vmap", {}).get("data") == "@" + compiler.NP_UNAVAILABLE]
            assert not_loopback in np_rule, (table, hook, np_rule)
        services = [json.loads(r) for r in rs.objects[(table, compiler.TABLE, "chain", "services")].rules]
        assert not_loopback in services[1]


def _port(name: str, created: float, vip: str | None = "10.96.0.50", node_port: int | None = None,
          eps: tuple[model.Endpoint, ...] = (model.Endpoint("10.244.2.5", 8080, "n2"),)) -> model.ServicePort:
    return model.ServicePort("ns", name, "", "TCP", 80, vip, node_port, None, False, False, eps, created=created)


def test_a_service_taking_a_vip_over_keeps_the_elements_it_shares_with_the_holder():
    """The VIP's holder gone, the Service that claimed it too has it: its map elements, the
    same as the holder's (same endpoints), stay in the maps (the holder's removal took them)."""
    table = compiler.Table("n1")
    table.update(("ns", "z-old"), [_port("z-old", 10)])
    table.update(("ns", "a-new"), [_port("a-new", 20)])  # left out: z-old holds the VIP
    _ = table.rs
    table.update(("ns", "z-old"), [])
    assert [p.cluster_ip for p in table.compiled(("ns", "a-new"))] == ["10.96.0.50"]
    assert table.translating()
    assert table.rs.objects == compiler.compile_services([_port("a-new", 20)], "n1").objects
    # One batch: the younger claims a node port, then the older claims it too (it takes it over).
    table = compiler.Table("n1")
    table.update(("ns", "d"), [_port("d", 20, "10.96.0.60", 30001)])
    table.update(("ns", "a"), [_port("a", 10, "10.96.0.61", 30001)])
    want = compiler.compile_services([_port("d", 20, "10.96.0.60", 30001), _port("a", 10, "10.96.0.61", 30001)], "n1")
    assert _map(table.rs, compiler.NODE_PORTS) == _map(want, compiler.NODE_PORTS) != frozenset()
    assert table.rs.objects == want.objects


NODES = ("n1", "n2", None)


@st.composite
def _service_ports(draw: st.DrawFn, name: str, created: float) -> list[model.ServicePort]:
    endpoint = st.builds(
        lambda n, host, port, node, ready, serving, terminating: model.Endpoint(
            f"10.244.{n}.{host}", port, node, ready=ready, serving=serving, terminating=terminating),
        st.integers(1, 3), st.integers(1, 6), st.sampled_from([80, 8080]), st.sampled_from(NODES),
        st.booleans(), st.booleans(), st.booleans(),
    )  # fmt: skip
    eps = model.unique(draw(st.lists(endpoint, max_size=20)))
    vip = draw(st.sampled_from(["10.96.0.1", "10.96.0.2", None]))
    out = []
    for port in draw(st.lists(st.sampled_from([53, 80, 443]), min_size=1, max_size=2, unique=True)):
        out.append(model.ServicePort(
            "ns", name, str(port), draw(st.sampled_from(["TCP", "UDP"])), port, vip,
            draw(st.sampled_from([None, 30000, 30001, 30100 + port])), draw(st.sampled_from([None, None, 30])),
            draw(st.booleans()), draw(st.booleans()), eps, created=created))  # fmt: skip
    seen: set[tuple[str, int | None]] = set()  # one Service's node ports are its own (allocation checks those)
    for i, sp in enumerate(out):
        if (sp.protocol, sp.node_port) in seen:
            out[i] = replace(sp, node_port=None)
        seen.add((sp.protocol, sp.node_port))
    return out


@st.composite
def _steps(draw: st.DrawFn) -> list[list[tuple[str, list[model.ServicePort]]]]:
    """Batches of Service changes (a Service's new ports, or none: gone)."""
    names = {"a": 1.0, "b": 2.0, "c": 3.0}
    batches = []
    for _ in range(draw(st.integers(1, 12))):
        batch = []
        for name in draw(st.lists(st.sampled_from(sorted(names)), min_size=1, max_size=3)):
            batch.append((name, [] if draw(st.integers(0, 4)) == 0 else draw(_service_ports(name, names[name]))))
        batches.append(batch)
    return batches


def _elements(rs: Ruleset) -> dict:
    return {k: o.elements for k, o in rs.objects.items() if isinstance(o, NftSet) and o.elements}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps())
def test_incremental_updates_hold_the_elements_of_a_fresh_compile(batches):
    """Property: whatever Services come, change, claim each other's VIPs and node ports and go,
    the table kept service by service holds the elements a fresh compile of what is there now
    gives, and each map's delta is one the kernel takes (nothing added twice, nothing
    deleted that is not there)."""
    table = compiler.Table("n1", pod_subnets={4: "10.244.1.0/24"}, service_ranges={4: "10.96.0.0/12"})
    state: dict[str, list[model.ServicePort]] = {}
    applied: dict = {}  # per map, as last read (what plan() takes a delta from)
    for batch in batches:
        for name, ports in batch:
            table.update(("ns", name), ports)
            state[name] = ports
        rs = table.rs
        for key, obj in rs.objects.items():
            if not isinstance(obj, NftSet):
                continue
            before = applied.get(key)
            if obj.delta is not None and before is not None and obj.delta[0] is before:
                _, added, removed = obj.delta
                assert removed <= before.elements and not (added & before.elements), key
                assert (before.elements - removed) | added == obj.elements, key
        applied = {k: o for k, o in rs.objects.items() if isinstance(o, NftSet)}
        fresh = compiler.compile_services([p for ps in state.values() for p in ps], "n1",
                                          pod_subnets={4: "10.244.1.0/24"}, service_ranges={4: "10.96.0.0/12"})  # fmt: skip
        assert _elements(rs) == _elements(fresh)
