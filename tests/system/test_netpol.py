"""NetworkPolicy on the real kernel: a truth table in the style of the upstream e2e suite.

One lab for the module (3 nodes, host-gw): namespaces x, y, z with pods a, b, c each (a on
node1, b on node2, c on node3, so every pair is tested on one node and across nodes), each
serving TCP 80/81 and UDP 80/81 with named ports.  For every scenario the policies are
applied as Kubernetes manifests (through the same validation as ``agentd apply``), every
node is waited for until it reports the etcd revision applied (GET /policy), the full probe
matrix runs from every pod to every other on every port, and the result must equal what
tests/netpol_model.py - an independent model of the v1 rules - says.  Then the scenario's
objects are deleted and the next one runs on the same lab.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import pytest_asyncio
from netpol_model import Cluster, ModelPod, allowed

from agentd.lab.lab import Lab, LabSpec
from agentd.lab.netns import unique_tag
from agentd.lab.probe import Prober

pytestmark = pytest.mark.asyncio(loop_scope="module")

NAMESPACES = ("x", "y", "z")
NAMES = ("a", "b", "c")
PORTS = [
    {"name": "serve-80-tcp", "containerPort": 80, "protocol": "TCP"},
    {"name": "serve-81-tcp", "containerPort": 81, "protocol": "TCP"},
    {"name": "serve-80-udp", "containerPort": 80, "protocol": "UDP"},
    {"name": "serve-81-udp", "containerPort": 81, "protocol": "UDP"},
]
PROBES = [("TCP", 80), ("TCP", 81), ("UDP", 80), ("UDP", 81)]
NS_LABELS = {"x": {"ns": "x"}, "y": {"ns": "y", "team": "red"}, "z": {"ns": "z"}}


@dataclass
class Grid:
    lab: Lab
    pods: dict[str, Any]  # "x/a" -> LabPod
    probers: dict[str, Prober]
    res: Any  # LabResources
    labels: dict[str, dict[str, str]] = field(default_factory=dict)  # current pod labels
    ns_labels: dict[str, dict[str, str]] = field(default_factory=dict)

    def model(self, policies: list[dict[str, Any]]) -> Cluster:
        pods = [
            ModelPod(p.namespace, p.k8s_name, p.ip, dict(self.labels[key]),
                     {port["name"]: (port["containerPort"], port["protocol"]) for port in p.ports})
            for key, p in self.pods.items()
        ]  # fmt: skip
        return Cluster(pods, {ns: dict(labels) for ns, labels in self.ns_labels.items()}, policies)

    def subnet_of(self, node: str) -> str:
        return self.lab.subnets()[node]


async def converged(lab: Lab, revision: int, timeout: float = 20.0) -> None:
    """Every node has programmed etcd's state up to ``revision`` into its kernel."""
    deadline = time.monotonic() + timeout
    behind: list[str] = []
    while time.monotonic() < deadline:
        views = await asyncio.gather(*(asyncio.to_thread(n.api_or_none, "/policy") for n in lab.nodes))
        behind = [f"{n.name}={(v or {}).get('revision')}" for n, v in zip(lab.nodes, views)
                  if not v or v.get("revision", 0) < revision or v.get("error")]  # fmt: skip
        if not behind:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"policy revision {revision} not applied everywhere within {timeout}s: {', '.join(behind)}")


async def matrix(g: Grid, timeout: float = 1.0) -> dict[tuple[str, str, str, int], bool]:
    keys = list(g.pods)

    async def from_one(src: str) -> list[tuple[tuple[str, str, str, int], bool]]:
        cells = [(src, dst, proto, port) for dst in keys if dst != src for proto, port in PROBES]
        targets = [(g.pods[dst].ip, proto.lower(), port) for _, dst, proto, port in cells]
        return list(zip(cells, await g.probers[src].probe(targets, timeout)))

    results = await asyncio.gather(*(from_one(src) for src in keys))
    return dict(item for batch in results for item in batch)


async def check(g: Grid, policies: list[dict[str, Any]]) -> None:
    """Probe everything; compare with the model (a failed allowed probe is retried, slower)."""
    cluster = g.model(policies)
    by_key = {p.key: p for p in cluster.pods}
    want = {c: allowed(cluster, by_key[c[0]], by_key[c[1]], c[2], c[3]) for c in await matrix(g)}
    got = await matrix(g)
    for attempt in range(2):
        retry = [c for c in got if got[c] != want[c] and want[c]]
        if not retry:
            break
        for src in {c[0] for c in retry}:
            cells = [c for c in retry if c[0] == src]
            again = await g.probers[src].probe([(g.pods[c[1]].ip, c[2].lower(), c[3]) for c in cells], 3.0)
            got.update(zip(cells, again))
    wrong = sorted(f"{s}->{d} {p}/{n}: expected {'allowed' if want[(s, d, p, n)] else 'denied'}"
                   for (s, d, p, n), ok in got.items() if ok != want[(s, d, p, n)])  # fmt: skip
    assert not wrong, f"{len(wrong)} of {len(got)} probes differ from the model:\n" + "\n".join(wrong[:40])


def np(name: str, ns: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name, "namespace": ns}, "spec": spec}


def namespace(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def grid(tmp_path_factory):
    lab = Lab(LabSpec(name="np" + unique_tag("")[:6], nodes=3, pods=0), root=tmp_path_factory.mktemp("labs"))
    probers: dict[str, Prober] = {}
    try:
        await lab.up(timeout=90)
        pods = {}
        for ns in NAMESPACES:
            for i, name in enumerate(NAMES):
                pods[f"{ns}/{name}"] = await lab.add_pod(lab.nodes[i], ns, name, labels={"pod": name}, ports=PORTS)
        res = await lab.resources()
        rev = await res.apply([namespace(ns, labels) for ns, labels in NS_LABELS.items()])
        for key, pod in pods.items():
            probers[key] = await Prober.start(pod, [(p.lower(), n) for p, n in PROBES])
        g = Grid(lab, pods, probers, res, {k: {"pod": k.split("/")[1]} for k in pods}, {k: dict(v) for k, v in NS_LABELS.items()})
        await converged(lab, rev)
        yield g
    finally:
        for p in probers.values():
            await p.close()
        await lab.down(keep_files=True)


# ------------------------------------------------------------------ the scenarios

Spec = Callable[[Grid], list[dict[str, Any]]]


def fixed(*policies: dict[str, Any]) -> Spec:
    return lambda g: list(policies)


SCENARIOS: dict[str, Spec] = {
    # isolation and the defaults of policyTypes
    "no policy: everything open": fixed(),
    "default deny ingress": fixed(np("deny", "x", {"podSelector": {}})),
    "default deny egress": fixed(np("deny", "x", {"podSelector": {}, "policyTypes": ["Egress"]})),
    "default deny both ways": fixed(np("deny", "y", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})),
    "deny ingress to one pod only": fixed(np("deny-a", "x", {"podSelector": {"matchLabels": {"pod": "a"}}})),
    # empty rules vs absent rules
    "empty ingress rule allows everything": fixed(np("all", "x", {"podSelector": {}, "ingress": [{}]})),
    "empty egress list is not an Egress policy": fixed(np("p", "x", {"podSelector": {}, "egress": [], "ingress": [{"ports": [{"port": 81}]}]})),
    "empty egress rule allows all egress": fixed(np("p", "x", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"], "egress": [{}]})),
    "empty from list means every source": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"from": [], "ports": [{"port": 80, "protocol": "UDP"}]}]})),
    "policyTypes Ingress ignores egress rules": fixed(np("p", "x", {"podSelector": {}, "policyTypes": ["Ingress"], "egress": [{"ports": [{"port": 81}]}]})),
    # peers
    "podSelector peer: own namespace only": fixed(np("p", "x", {"podSelector": {"matchLabels": {"pod": "a"}},
                                                                "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}]}]})),
    "namespaceSelector peer": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}]}]})),
    "namespace and pod selector in one peer": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"ns": "y"}}, "podSelector": {"matchLabels": {"pod": "c"}}}]}]})),
    "namespace and pod selector as two peers": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"ns": "y"}}}, {"podSelector": {"matchLabels": {"pod": "c"}}}]}]})),
    "matchExpressions In and NotIn": fixed(np("p", "x", {"podSelector": {"matchExpressions": [{"key": "pod", "operator": "In", "values": ["a", "b"]}]},
        "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": {"matchExpressions": [{"key": "pod", "operator": "NotIn", "values": ["c"]}]}}]}]})),
    "matchExpressions Exists and DoesNotExist": fixed(np("p", "z", {"podSelector": {"matchExpressions": [{"key": "pod", "operator": "Exists"}]},
        "ingress": [{"from": [{"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "DoesNotExist"}]}}]}]})),
    "namespace name label": fixed(np("p", "z", {"podSelector": {}, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "x"}}}]}]})),
    "ipBlock": lambda g: [np("p", "x", {"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": g.subnet_of("node2")}}]}]})],
    "ipBlock with except": lambda g: [np("p", "x", {"podSelector": {}, "ingress": [{"from": [{"ipBlock": {
        "cidr": "10.244.0.0/16", "except": [g.subnet_of("node3"), f"{g.pods['y/a'].ip}/32"]}}]}]})],
    "egress podSelector and namespaceSelector": fixed(np("p", "x", {"podSelector": {}, "egress": [{"to": [
        {"namespaceSelector": {"matchLabels": {"ns": "z"}}, "podSelector": {"matchLabels": {"pod": "b"}}}, {"podSelector": {"matchLabels": {"pod": "a"}}}]}]})),
    "egress ipBlock with except": lambda g: [np("p", "y", {"podSelector": {"matchLabels": {"pod": "b"}}, "policyTypes": ["Egress"], "egress": [
        {"to": [{"ipBlock": {"cidr": "10.244.0.0/16", "except": [g.subnet_of("node1")]}}]}]})],
    # ports
    "TCP port 80 only": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"port": 80}]}]})),
    "UDP port 81 only": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"port": 81, "protocol": "UDP"}]}]})),
    "port range with endPort": fixed(np("p", "y", {"podSelector": {}, "ingress": [{"ports": [{"port": 79, "endPort": 80, "protocol": "TCP"}, {"port": 81, "endPort": 90, "protocol": "UDP"}]}]})),
    "protocol without port": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"protocol": "UDP"}]}]})),
    "SCTP only allows no TCP or UDP": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"protocol": "SCTP", "port": 80}]}]})),
    "named port ingress": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"port": "serve-81-tcp"}, {"port": "serve-80-udp", "protocol": "UDP"}]}]})),
    "named port with the wrong protocol matches nothing": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"port": "serve-80-udp", "protocol": "TCP"}]}]})),
    "named port egress": fixed(np("p", "z", {"podSelector": {}, "egress": [{"to": [{"namespaceSelector": {}}], "ports": [{"port": "serve-81-udp", "protocol": "UDP"}]}]})),
    "peers and ports together": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}, "namespaceSelector": {}}],
                                                                                 "ports": [{"port": 80}, {"port": 80, "protocol": "UDP"}]}]})),
    # several policies
    "policies are a union": fixed(
        np("p1", "x", {"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}], "ports": [{"port": 80}]}]}),
        np("p2", "x", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "z"}}}]}]}),
        np("p3", "x", {"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [{"ports": [{"port": 81, "protocol": "UDP"}]}]}),
    ),
    "ingress and egress policies in several namespaces": fixed(
        np("in", "y", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "x"}}}]}]}),
        np("out", "x", {"podSelector": {"matchLabels": {"pod": "c"}}, "policyTypes": ["Egress"], "egress": [{"to": [{"namespaceSelector": {"matchLabels": {"team": "red"}}}]}]}),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_truth_table(grid: Grid, name: str):
    policies = SCENARIOS[name](grid)
    try:
        if policies:
            await converged(grid.lab, await grid.res.apply(policies))
        await check(grid, policies)
    finally:
        for p in policies:
            await grid.res.delete("NetworkPolicy", p["metadata"]["namespace"], p["metadata"]["name"])


# ------------------------------------------------------------------ selector changes, cluster-wide


async def test_a_label_added_takes_effect_everywhere(grid: Grid):
    policy = np("p", "x", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"role": "client"}}}]}]})
    await converged(grid.lab, await grid.res.apply(policy))
    try:
        await check(grid, [policy])
        rev = await grid.res.label("Pod", "z", "b", {"role": "client"})  # z/b lives on node2, x/* everywhere
        grid.labels["z/b"]["role"] = "client"
        await converged(grid.lab, rev)
        await check(grid, [policy])
    finally:
        await grid.res.label("Pod", "z", "b", {"role": None})
        grid.labels["z/b"].pop("role", None)
        await grid.res.delete("NetworkPolicy", "x", "p")


async def test_a_namespace_relabelled_takes_effect_everywhere(grid: Grid):
    policy = np("p", "y", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"trusted": "yes"}}}]}]})
    await converged(grid.lab, await grid.res.apply(policy))
    try:
        rev = await grid.res.apply(namespace("z", {**NS_LABELS["z"], "trusted": "yes"}))
        grid.ns_labels["z"]["trusted"] = "yes"
        await converged(grid.lab, rev)
        await check(grid, [policy])
    finally:
        await grid.res.apply(namespace("z", NS_LABELS["z"]))
        grid.ns_labels["z"] = dict(NS_LABELS["z"])
        await grid.res.delete("NetworkPolicy", "y", "p")


async def test_a_new_pod_on_another_node_is_allowed_and_its_delete_removes_it(grid: Grid):
    policy = np("p", "x", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "client"}}}]}]})
    await converged(grid.lab, await grid.res.apply(policy))
    new = await grid.lab.add_pod("node3", "y", "client", labels={"app": "client"})
    prober = await Prober.start(new, [])
    try:
        record = await grid.res.get("Pod", "y", "client")
        assert record is not None and record["spec"]["nodeName"] == "node3" and record["status"]["podIP"] == new.ip
        assert record["metadata"]["labels"] == {"app": "client"}
        await converged(grid.lab, int(record["metadata"]["resourceVersion"]))
        targets = [(p.ip, "tcp", 80) for p in grid.pods.values()]
        ok = await prober.probe(targets, 2.0)
        assert all(ok), ok  # x's pods allow it now; y's and z's are open
        # Removed (CNI DEL): the record goes, and x's pods no longer know its address.
        await grid.lab.remove_pod(new)
        deadline = time.monotonic() + 10
        while await grid.res.get("Pod", "y", "client") is not None:
            assert time.monotonic() < deadline, "the record of a deleted pod stayed in etcd"
            await asyncio.sleep(0.05)
        view = await asyncio.to_thread(grid.lab.nodes[0].api, "/policy?pod=x/a")
        (rule,) = view["pods"][0]["ingress"]
        assert new.ip not in rule["peer_addresses"]
    finally:
        await prober.close()
        if new in grid.lab.pods:
            await grid.lab.remove_pod(new)
        await grid.res.delete("NetworkPolicy", "x", "p")


# ------------------------------------------------------------------ visibility


async def test_policy_view_metrics_and_status(grid: Grid):
    policy = np("deny-a", "x", {"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}], "ports": [{"port": "serve-80-tcp"}]}]})
    await converged(grid.lab, await grid.res.apply(policy))
    try:
        node1 = grid.lab.nodes[0]
        assert not any(await grid.probers["y/a"].probe([(grid.pods["x/a"].ip, "tcp", 81)] * 3, 0.5))
        view = await asyncio.to_thread(node1.api, "/policy?pod=x/a")
        (pod,) = view["pods"]
        assert pod["policies"] == ["x/deny-a"] and pod["isolated"] == {"ingress": True, "egress": False}
        (rule,) = pod["ingress"]
        assert rule["peer_addresses"] == [grid.pods["x/b"].ip]
        assert rule["named_ports"] == [f"{grid.pods['x/a'].ip} tcp/80"]
        deadline = time.monotonic() + 10
        while True:
            view = await asyncio.to_thread(node1.api, "/policy?pod=x/a")
            if view["pods"][0]["dropped"]["ingress"] >= 3:
                break
            assert time.monotonic() < deadline, view["pods"][0]["dropped"]
            await asyncio.sleep(0.2)
        text = await asyncio.to_thread(lambda: node1.ns.http_get("http://127.0.0.1:9099/metrics")[1].decode())
        assert 'agentd_policy_dropped_packets_total{direction="ingress",namespace="x",pod="a"}' in text
        assert 'agentd_policy_isolated_pods{direction="ingress"} 1.0' in text
        rc, out, _ = await node1.ns.aexec(str(Path(sys.executable).parent / "agentd"), "status")
        assert "Policy" in out.decode() and "isolated 1 (ingress 1, egress 0)" in out.decode(), out.decode()
    finally:
        await grid.res.delete("NetworkPolicy", "x", "deny-a")
