"""Lab helpers for the NetworkPolicy system tests: a grid of labelled pods with servers and
probers, convergence on the agents' applied etcd revision, and the probe matrix (over IPv4,
and over IPv6 in a dual-stack lab) compared with the independent model (tests/netpol_model.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from netpol_model import Cluster, ModelPod, allowed

from agentd.lab.lab import Lab
from agentd.lab.probe import Prober

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
            ModelPod(p.namespace, p.k8s_name, p.address(4), dict(self.labels[key]),
                     {port["name"]: (port["containerPort"], port["protocol"]) for port in p.ports}, p.address(6))
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
        views = await asyncio.gather(*(asyncio.to_thread(n.api_or_none, "/policy?view=summary") for n in lab.nodes))
        behind = [f"{n.name}={(v or {}).get('revision')}" for n, v in zip(lab.nodes, views)
                  if not v or v.get("revision", 0) < revision or v.get("error")]  # fmt: skip
        if not behind:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"policy revision {revision} not applied everywhere within {timeout}s: {', '.join(behind)}")


Cell = tuple[str, str, str, int, int]  # (source pod, destination pod, protocol, port, IP version)


async def matrix(g: Grid, timeout: float = 1.0, families: tuple[int, ...] = (4,)) -> dict[Cell, bool]:
    keys = list(g.pods)

    async def from_one(src: str) -> list[tuple[Cell, bool]]:
        cells = [(src, dst, proto, port, fam) for dst in keys if dst != src for fam in families for proto, port in PROBES]
        targets = [(g.pods[dst].address(fam), proto.lower(), port) for _, dst, proto, port, fam in cells]
        return list(zip(cells, await g.probers[src].probe(targets, timeout)))

    results = await asyncio.gather(*(from_one(src) for src in keys))
    return dict(item for batch in results for item in batch)


async def check(g: Grid, policies: list[dict[str, Any]], families: tuple[int, ...] = (4,)) -> None:
    """Probe everything over each of ``families``; compare with the model (a failed allowed
    probe is retried, slower)."""
    cluster = g.model(policies)
    by_key = {p.key: p for p in cluster.pods}
    got = await matrix(g, families=families)
    want = {c: allowed(cluster, by_key[c[0]], by_key[c[1]], c[2], c[3], c[4]) for c in got}
    for attempt in range(2):
        retry = [c for c in got if got[c] != want[c] and want[c]]
        if not retry:
            break
        for src in {c[0] for c in retry}:
            cells = [c for c in retry if c[0] == src]
            again = await g.probers[src].probe([(g.pods[c[1]].address(c[4]), c[2].lower(), c[3]) for c in cells], 3.0)
            got.update(zip(cells, again))
    wrong = sorted(f"{s}->{d} {p}/{n} IPv{f}: expected {'allowed' if want[(s, d, p, n, f)] else 'denied'}"
                   for (s, d, p, n, f), ok in got.items() if ok != want[(s, d, p, n, f)])  # fmt: skip
    assert not wrong, f"{len(wrong)} of {len(got)} probes differ from the model:\n" + "\n".join(wrong[:40])


def np(name: str, ns: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name, "namespace": ns}, "spec": spec}


def namespace(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}



async def make_grid(lab: Lab, layout: list[tuple[int, str, str]], ns_labels: dict[str, dict[str, str]]) -> Grid:
    """Pods ``(node index, namespace, name)`` labelled pod=<name>, with servers and probers."""
    pods = {}
    for index, ns, name in layout:
        pods[f"{ns}/{name}"] = await lab.add_pod(lab.nodes[index], ns, name, labels={"pod": name}, ports=PORTS)
    res = await lab.resources()
    rev = await res.apply([namespace(ns, labels) for ns, labels in ns_labels.items()])
    probers = {}
    for key, pod in pods.items():
        probers[key] = await Prober.start(pod, [(p.lower(), n) for p, n in PROBES])
    g = Grid(lab, pods, probers, res, {k: {"pod": k.split("/")[1]} for k in pods}, {k: dict(v) for k, v in ns_labels.items()})
    await converged(lab, rev)
    return g


async def close_grid(g: Grid) -> None:
    for p in g.probers.values():
        await p.close()
