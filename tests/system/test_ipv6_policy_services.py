"""NetworkPolicy and Services over IPv6, end to end: one dual-stack lab shared by most checks,
and an IPv6-only one.

The dual-stack lab (3 nodes, host-gw, ``ip_family = "dual"``: every pod has an IPv4 and an
IPv6 address) is shared by:

* the NetworkPolicy truth table over both families: namespaces x and y with pods a, b, c on
  the three nodes (tests/netpol_lab.py's grid), a set of scenarios applied as manifests,
  every node waited for, the probe matrix over IPv4 AND IPv6 compared with the independent
  model (tests/netpol_model.py), IPv6 ipBlocks with excepts included;
* Services as an operator applies them: a PreferDualStack Service gets an address of each
  range from the store (the cluster config is dual-stack), every node translates its IPv6
  cluster IP to the endpoints' IPv6 addresses across nodes (TCP, UDP), its node port answers
  on a node's IPv6 underlay address (externalTrafficPolicy Cluster, then Local: from outside
  the node its own endpoint, from its pod every endpoint), and the
  node-local DNS answers AAAA (and A) for it, and both for a headless Service, to a pod.

The IPv6-only lab (2 nodes) checks what has no IPv4 to lean on: the Service's one family,
the IPv6 node-local DNS address pods are handed, a node port and a policy over IPv6 alone.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from typing import Any

import pytest
import pytest_asyncio
from netpol_lab import Grid, check, close_grid, converged, make_grid, np

from agentd.lab.lab import Lab, LabSpec
from agentd.lab.netns import unique_tag
from agentd.lab.svcecho import Echo
from agentd.lab.wait import auntil

pytestmark = pytest.mark.asyncio(loop_scope="module")

FAMILIES = (4, 6)
NS_LABELS = {"x": {"ns": "x"}, "y": {"ns": "y", "team": "red"}}
SVC_PORTS = [{"name": "http", "containerPort": 8080, "protocol": "TCP"}, {"name": "dns", "containerPort": 5353, "protocol": "UDP"}]
WEBS = {"web-1", "web-2", "web-3"}
DNS = "169.254.20.10"


class World:
    def __init__(self, lab: Lab, res: Any, grid: Grid | None = None) -> None:
        self.lab = lab
        self.grid = grid
        self.res = res
        self.pods: dict[str, Any] = {}
        self.echo: dict[str, Echo] = {}

    async def services_converged(self, revision: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        behind: list[str] = []
        while time.monotonic() < deadline:
            views = await asyncio.gather(*(asyncio.to_thread(n.api_or_none, "/services?view=summary") for n in self.lab.nodes))
            behind = [f"{n.name}={(v or {}).get('revision')}" for n, v in zip(self.lab.nodes, views)
                      if not v or v.get("revision", 0) < revision or v.get("error")]  # fmt: skip
            if not behind:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"services revision {revision} not applied everywhere: {', '.join(behind)}")

    async def apply(self, *objs: dict[str, Any]) -> int:
        rev = await self.res.apply(list(objs))
        await self.services_converged(rev)
        return rev

    async def delete(self, name: str) -> None:
        await self.services_converged(await self.res.delete("Service", "svc", name))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tmp_path_factory):
    lab = Lab(LabSpec(name="ds" + unique_tag("")[:6], nodes=3, pods=0, ip_family="dual"), root=tmp_path_factory.mktemp("labs"))
    grid = None
    w = None
    try:
        await lab.up(timeout=90)
        grid = await make_grid(lab, [(i, ns, name) for ns in NS_LABELS for i, name in enumerate(("a", "b", "c"))], NS_LABELS)
        assert all(p.address(4) and p.address(6) for p in grid.pods.values()), grid.pods
        w = World(lab, grid.res, grid)
        for i, node in enumerate(lab.nodes, start=1):
            w.pods[f"web-{i}"] = await lab.add_pod(node, "svc", f"web-{i}", labels={"app": "web", "pod": f"web-{i}"}, ports=SVC_PORTS)
        w.pods["client"] = await lab.add_pod(lab.nodes[0], "svc", "client", labels={"app": "client"})
        for name, pod in w.pods.items():
            w.echo[name] = await Echo.start(pod, name, [("tcp", 8080), ("udp", 5353)] if name.startswith("web") else [])
        w.echo["node3"] = await Echo.start(lab.nodes[2], "node3")
        yield w
    finally:
        if w is not None:
            for e in w.echo.values():
                await e.close()
        if grid is not None:
            await close_grid(grid)
        await lab.down(keep_files=True)


# ------------------------------------------------------------------ NetworkPolicy over both families

SCENARIOS: dict[str, Any] = {
    "no policy: everything open": lambda g: [],
    "default deny ingress": lambda g: [np("deny", "x", {"podSelector": {}})],
    "default deny both ways": lambda g: [np("deny", "y", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})],
    "pod and namespace selectors match both addresses": lambda g: [np("p", "x", {"podSelector": {}, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"team": "red"}}, "podSelector": {"matchLabels": {"pod": "b"}}},
        {"podSelector": {"matchLabels": {"pod": "c"}}}]}]})],
    "ipBlocks of both families with excepts": lambda g: [np("p", "x", {"podSelector": {}, "ingress": [{"from": [
        {"ipBlock": {"cidr": "fd00:10:244::/48", "except": [g.lab.all_subnets()["node2"][1], f"{g.pods['y/a'].address(6)}/128"]}},
        {"ipBlock": {"cidr": g.lab.all_subnets()["node3"][0]}}]}]})],
    "egress to an IPv6 block on UDP only": lambda g: [np("p", "y", {"podSelector": {"matchLabels": {"pod": "b"}}, "policyTypes": ["Egress"],
        "egress": [{"to": [{"ipBlock": {"cidr": "fd00:10:244::/48", "except": [g.lab.all_subnets()["node1"][1]]}}], "ports": [{"protocol": "UDP"}]}]})],
    "named ports over both families": lambda g: [np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"port": "serve-81-tcp"}, {"port": "serve-80-udp", "protocol": "UDP"}]}]}),
                                                 np("q", "y", {"podSelector": {}, "egress": [{"to": [{"namespaceSelector": {}}], "ports": [{"port": "serve-80-tcp"}]}]})],
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_truth_table_over_both_families(world: World, name: str):
    g = world.grid
    assert g is not None
    policies = SCENARIOS[name](g)
    try:
        if policies:
            await converged(g.lab, await g.res.apply(policies))
        await check(g, policies, FAMILIES)
    finally:
        for p in policies:
            await g.res.delete("NetworkPolicy", p["metadata"]["namespace"], p["metadata"]["name"])


# ------------------------------------------------------------------ Services over IPv6


def service(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "svc"}, "spec": spec}


WEB_PORTS = [{"name": "http", "port": 80, "targetPort": "http"}, {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": "dns"}]


async def test_a_dual_stack_service_over_ipv6_cluster_ip_node_port_and_dns(world: World):
    await world.apply(service("web", {"type": "NodePort", "selector": {"app": "web"}, "ipFamilyPolicy": "PreferDualStack",
                                      "ports": [{**WEB_PORTS[0], "nodePort": 30080}, WEB_PORTS[1]]}))  # fmt: skip
    try:
        obj = await world.res.get("Service", "svc", "web")
        v4, v6 = obj["spec"]["clusterIPs"]
        assert obj["spec"]["ipFamilies"] == ["IPv4", "IPv6"] and obj["spec"]["clusterIP"] == v4
        assert ipaddress.ip_address(v6) in ipaddress.ip_network("fd00:10:96::/112")
        # The IPv6 cluster IP, from a pod: every endpoint (two of them on other nodes), TCP and UDP.
        r = await world.echo["client"].tcp(v6, 80, count=60)
        assert r["failed"] == 0 and set(r["names"]) == WEBS, r
        names = []
        for sport in range(21000, 21100):  # new flows until every endpoint answered (24 missed one 1 in 5,000)
            names += await world.echo["client"].udp(v6, 53, sport)
            if set(names) >= WEBS:
                break
        assert set(names) == WEBS, names
        # What a node shows of it: both cluster IPs, a port per family.
        (svc,) = [s for s in world.lab.nodes[0].api("/services")["services"] if s["name"] == "web"]
        assert sorted(svc["clusterIPs"]) == sorted([v4, v6])
        assert {(p["port"], p["family"]) for p in svc["ports"]} == {(80, "IPv4"), (80, "IPv6"), (53, "IPv4"), (53, "IPv6")}
        # The node port on node1's IPv6 underlay address, from node3.
        node1 = world.lab.nodes[0]
        r = await world.echo["node3"].tcp(node1.address_v6, 30080, count=45)
        assert r["failed"] == 0 and set(r["names"]) == WEBS, r
        await world.apply(service("web", {"type": "NodePort", "selector": {"app": "web"}, "ipFamilyPolicy": "PreferDualStack",
                                          "externalTrafficPolicy": "Local", "ports": [{**WEB_PORTS[0], "nodePort": 30080}, WEB_PORTS[1]]}))  # fmt: skip
        assert await world.echo["node3"].tcp(node1.address_v6, 30080, count=10) == {"names": {"web-1": 10}, "failed": 0}
        # ... but from node1's own pod (its IPv6 pod subnet), kube-proxy's short-circuit: every endpoint.
        r = await world.echo["client"].tcp(node1.address_v6, 30080, count=30)
        assert r["failed"] == 0 and set(r["names"]) == WEBS, r
        # DNS: AAAA and A for the Service; a headless one's endpoints of both families.
        await world.apply(service("hl", {"clusterIP": "None", "selector": {"pod": "web-2"}, "ipFamilyPolicy": "RequireDualStack",
                                         "ports": WEB_PORTS}))  # fmt: skip
        client = world.echo["client"]
        r = await client.dns(DNS, "web.svc.svc.cluster.local", "AAAA")
        assert r["rcode"] == "NOERROR" and r["answer"] == [f"web.svc.svc.cluster.local. 5 IN AAAA {v6}"], r
        r = await client.dns(DNS, "web.svc.svc.cluster.local", "A")
        assert r["answer"] == [f"web.svc.svc.cluster.local. 5 IN A {v4}"], r
        web2 = world.pods["web-2"]
        r = await client.dns(DNS, "hl.svc.svc.cluster.local", "AAAA", tcp=True)
        assert r["answer"] == [f"hl.svc.svc.cluster.local. 5 IN AAAA {web2.address(6)}"], r
        r = await client.dns(DNS, "hl.svc.svc.cluster.local", "A")
        assert r["answer"] == [f"hl.svc.svc.cluster.local. 5 IN A {web2.address(4)}"], r
    finally:
        await world.res.delete("Service", "svc", "hl")
        await world.delete("web")


async def test_an_ipv6_single_stack_service(world: World):
    rev = await world.apply(service("six", {"selector": {"app": "web"}, "ipFamilies": ["IPv6"], "ports": WEB_PORTS}))
    try:
        obj = await world.res.get("Service", "svc", "six")
        (vip,) = obj["spec"]["clusterIPs"]
        assert ":" in vip and obj["spec"]["ipFamilyPolicy"] == "SingleStack" and rev
        r = await world.echo["client"].tcp(vip, 80, count=30)
        assert r["failed"] == 0 and set(r["names"]) == WEBS, r
        r = await world.echo["client"].dns(DNS, "six.svc.svc.cluster.local", "A")
        assert r["rcode"] == "NOERROR" and r["answer"] == [], r  # the name exists, without an IPv4 address
    finally:
        await world.delete("six")


# ------------------------------------------------------------------ an IPv6-only cluster


async def test_an_ipv6_only_cluster_services_dns_and_policy(lab_factory):
    """No IPv4 anywhere: a Service gets an IPv6 cluster IP (SingleStack, the cluster's one
    family), pods are handed the IPv6 node-local DNS address and resolve it there, its node
    port answers on a node's IPv6 address, and a policy isolates a pod over IPv6."""
    lab = await lab_factory(nodes=2, pods=0, ip_family="ipv6")
    node1, node2 = lab.nodes
    pods = {}
    for i, node in enumerate(lab.nodes, start=1):
        pods[f"web-{i}"] = await lab.add_pod(node, "svc", f"web-{i}", labels={"app": "web", "pod": f"web-{i}"}, ports=SVC_PORTS)
    pods["client"] = await lab.add_pod(node1, "svc", "client", labels={"app": "client"})
    echo = {name: await Echo.start(p, name, [("tcp", 8080), ("udp", 5353)] if name.startswith("web") else [])
            for name, p in pods.items()}  # fmt: skip
    echo["node1"] = await Echo.start(node1, "node1")
    res = await lab.resources()
    try:
        assert pods["client"].result["dns"]["nameservers"] == ["fd00:169:254:20::10"]
        rev = await res.apply([service("web", {"type": "NodePort", "selector": {"app": "web"},
                                               "ports": [{**WEB_PORTS[0], "nodePort": 30080}, WEB_PORTS[1]]})])  # fmt: skip
        await World(lab, res).services_converged(rev)
        obj = await res.get("Service", "svc", "web")
        assert (obj["spec"]["ipFamilies"], obj["spec"]["ipFamilyPolicy"]) == (["IPv6"], "SingleStack")
        (vip,) = obj["spec"]["clusterIPs"]
        assert ipaddress.ip_address(vip) in ipaddress.ip_network("fd00:10:96::/112")
        r = await echo["client"].tcp(vip, 80, count=30)
        assert r["failed"] == 0 and set(r["names"]) == {"web-1", "web-2"}, r
        r = await echo["client"].dns("fd00:169:254:20::10", "web.svc.svc.cluster.local", "AAAA")
        assert r["rcode"] == "NOERROR" and r["answer"] == [f"web.svc.svc.cluster.local. 5 IN AAAA {vip}"], r
        r = await echo["node1"].tcp(node2.address_v6, 30080, count=20)
        assert r["failed"] == 0 and set(r["names"]) == {"web-1", "web-2"}, r
        # NetworkPolicy over IPv6 alone: web-1 takes nothing from the client, web-2 is open.
        rev = await res.apply([np("deny", "svc", {"podSelector": {"matchLabels": {"pod": "web-1"}}})])
        await converged(lab, rev)
        assert await echo["client"].tcp(pods["web-1"].address(6), 8080, count=1, timeout=1.0) == {"names": {}, "failed": 1}
        assert await echo["client"].tcp(pods["web-2"].address(6), 8080, count=2) == {"names": {"web-2": 2}, "failed": 0}
        # A node that leaves takes its ip6 table and its IPv6 DNS address with it.
        assert "fd00:169:254:20::10" in node2.ns.ip("-6", "addr").stdout.decode()
        await node2.leave()

        def left() -> bool:
            tables = node2.ns.exec("nft", "list", "tables")
            return node2.agent_pid() is None and "agentd-services" not in tables and \
                "fd00:169:254:20::10" not in node2.ns.ip("-6", "addr").stdout.decode()

        await auntil(left, 20, what="node2's agent gone with its ip6 table and IPv6 DNS address", in_thread=True)
    finally:
        for e in echo.values():
            await e.close()
        await res.close()
