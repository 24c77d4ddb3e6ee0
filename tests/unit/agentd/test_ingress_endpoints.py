"""The endpoints of the Ingress controller's backends (agentd/ingress/controller.py): worked
out with one model.build over the backends' Services per render, not one per Service over
the whole cluster (review r11 #1), and the same servers as that did."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

from agentd.config.settings import load_config
from agentd.datastore.store import Datastore
from agentd.ingress import controller as ctl_mod
from agentd.ingress import routing
from agentd.ingress.controller import IngressController, backend_servers
from agentd.services import model


class FakeProxy:
    running, pid, adopted, started_at = True, 1, False, None

    async def check(self, path: Path) -> None:
        pass

    async def reload(self) -> None:
        pass

    async def stats(self) -> list:
        return []

    async def info(self) -> dict:
        return {}

    async def command(self, command: str) -> str:
        return "New server registered" if command.startswith("add server") else ""


def controller(tmp_path: Path) -> IngressController:
    cfg = load_config(None, env={}, overrides={"node.address": "10.1.1.1", "node.name": "n1"})
    ctl = IngressController("n1", Datastore(["http://127.0.0.1:2379"], "/agentd"), cfg.ingress, ["10.1.1.1"], tmp_path)
    ctl.paths.certs.mkdir(parents=True)
    ctl.proxy = FakeProxy()  # type: ignore[assignment]
    return ctl


CLASS = {"metadata": {"name": "agentd", "annotations": {"ingressclass.kubernetes.io/is-default-class": "true"}},
         "spec": {"controller": "agentd.io/ingress-controller"}}  # fmt: skip


def ingress(ns: str, name: str, backends: list[dict[str, Any]]) -> dict[str, Any]:
    paths = [{"path": f"/p{i}", "pathType": "Prefix", "backend": b} for i, b in enumerate(backends)]
    return {"metadata": {"namespace": ns, "name": name, "creationTimestamp": "2024-01-01T00:00:00Z"},
            "spec": {"rules": [{"host": f"{name}.{ns}.example", "http": {"paths": paths}}]}}  # fmt: skip


def service(ns: str, name: str, selector: dict[str, str] | None, ports: list[dict[str, Any]], *,
            dual: bool = False, n: int = 1) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": "ClusterIP", "ports": ports, "clusterIP": f"10.96.{n // 250}.{n % 250 + 1}",
                            "ipFamilies": ["IPv4", "IPv6"] if dual else ["IPv4"]}  # fmt: skip
    spec["clusterIPs"] = [spec["clusterIP"]] + ([f"fd00::{n:x}"] if dual else [])
    if selector is not None:
        spec["selector"] = selector
    return {"metadata": {"namespace": ns, "name": name}, "spec": spec}


def pod(ns: str, name: str, labels: dict[str, str], ips: list[str], ports: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"namespace": ns, "name": name, "labels": labels},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "ports": ports or []}]},
            "status": {"podIP": ips[0], "podIPs": [{"ip": ip} for ip in ips]}}  # fmt: skip


def want_servers(ctl: IngressController) -> dict[str, set]:
    """The ready endpoints of every backend of ``ctl``'s table, in one go (servers_in_steps,
    which a sync runs giving the loop back between steps, run to its end)."""
    steps = ctl_mod.servers_in_steps(ctl.table.backends, ctl.objects)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def one_per_namespace(n: int) -> dict[str, dict[tuple[str, str], dict[str, Any]]]:
    objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {k: {} for k in ctl_mod.KINDS}
    objects["IngressClass"][("", "agentd")] = CLASS
    for i in range(n):
        ns = f"n{i}"
        objects["Ingress"][(ns, "i")] = ingress(ns, "i", [{"service": {"name": "s", "port": {"number": 80}}}])
        objects["Service"][(ns, "s")] = service(ns, "s", {"app": "a"}, [{"port": 80, "targetPort": 8080, "protocol": "TCP"}], n=i)
        objects["Pod"][(ns, "p")] = pod(ns, "p", {"app": "a"}, [f"10.244.{i // 250}.{i % 250 + 1}"])
    return objects


def test_one_model_build_per_render_shared_with_the_sync(tmp_path, monkeypatch):
    """50 backends in 50 namespaces: one model.build per render (was one per Service, each
    over every pod and EndpointSlice of the cluster, twice per sync: 100)."""
    ctl = controller(tmp_path)
    ctl.objects = one_per_namespace(50)
    calls = []
    build = model.build

    def counting(services, slices, pods):
        calls.append(1)
        return build(services, slices, pods)

    monkeypatch.setattr(model, "build", counting)

    async def main():
        await ctl._sync()
        assert len(calls) == 1  # the render's, given to the proxy by the sync
        assert sum(len(s) for s in ctl.servers.values()) == 50
        calls.clear()
        await ctl._render()
        want_servers(ctl)
        assert len(calls) == 2

    asyncio.run(main())


def test_many_backends_are_worked_out_in_steps_giving_the_loop_back(tmp_path, monkeypatch):
    ctl = controller(tmp_path)
    ctl.objects = one_per_namespace(10)
    slept = []
    sleep = asyncio.sleep

    async def counting(delay, *args):
        if delay == 0:
            slept.append(1)
        return await sleep(delay, *args)

    monkeypatch.setattr(ctl_mod.asyncio, "sleep", counting)
    asyncio.run(ctl._render())
    assert slept == []  # a few: in one go
    assert sum(len(s) for s in ctl._want.values()) == 10
    # Steps of 3 Services, of 6 pods (a Service costs 2 pods' worth): pods 6 | 4 | Services
    # 3 | 3 | 3 | 1, the loop given back between them.
    monkeypatch.setattr(ctl_mod, "ENDPOINT_STEP", 3)
    monkeypatch.setattr(ctl_mod, "INDEX_STEP", 6)
    ctl._want = {}
    asyncio.run(ctl._render())
    assert len(slept) == 5
    assert sum(len(s) for s in ctl._want.values()) == 10
    assert ctl._want == want_servers(ctl)


def old_want_servers(table: routing.RouteTable, objects) -> dict[str, set]:
    """What the controller did before (per Service, over every pod and slice): the reference."""
    out: dict[str, set] = {}
    for name, b in table.backends.items():
        out[name] = set()
        if b.service is None:
            continue
        svc = objects["Service"].get((b.namespace, b.service))
        if svc is None:
            continue
        ns = b.namespace
        slices = [s for (sns, _), s in objects["EndpointSlice"].items()
                  if sns == ns and (s["metadata"].get("labels") or {}).get("kubernetes.io/service-name") == b.service]  # fmt: skip
        pods = [p for (pns, _), p in objects["Pod"].items() if pns == ns] if svc["spec"].get("selector") else []
        out[name] = backend_servers(model.build([svc], slices, pods), b.port)
    return out


def varied(rng: random.Random) -> dict[str, dict[tuple[str, str], dict[str, Any]]]:
    """Ingresses to Services of several namespaces: selectors (shared labels, several labels,
    named target ports some pods lack, dual-stack), slices (named ports, not ready,
    terminating, another family, labelled for a Service of another namespace), Services
    without endpoints, missing Services, resource backends."""
    objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {k: {} for k in ctl_mod.KINDS}
    objects["IngressClass"][("", "agentd")] = CLASS
    namespaces = [f"ns{i}" for i in range(rng.randint(1, 4))]
    n = 0
    for ns in namespaces:
        for s in range(rng.randint(0, 6)):
            n += 1
            name = f"s{s}"
            ports = [{"name": "http", "port": 80, "targetPort": rng.choice([8080, "web"]), "protocol": "TCP"},
                     {"name": "alt", "port": 81, "targetPort": rng.choice([9090, "metrics"]), "protocol": "TCP"},
                     {"name": "dns", "port": 53, "targetPort": 53, "protocol": "UDP"}]  # fmt: skip
            kind = rng.choice(["selector", "selector", "slices", "none"])
            selector = {"app": f"a{rng.randint(0, 3)}"} if kind == "selector" else None
            if selector is not None and rng.random() < 0.3:
                selector["tier"] = rng.choice(["web", "db"])
            objects["Service"][(ns, name)] = service(ns, name, selector, ports, dual=rng.random() < 0.2, n=n)
            if kind == "slices":
                for k in range(rng.randint(0, 2)):
                    family = rng.choice(["IPv4", "IPv4", "IPv6"])
                    eps = []
                    for e in range(rng.randint(0, 3)):
                        ip = f"10.1.{n}.{k * 10 + e}" if family == "IPv4" else f"fd01::{n:x}:{k * 10 + e:x}"
                        conditions = {"ready": rng.random() < 0.7, "serving": rng.random() < 0.8,
                                      "terminating": rng.random() < 0.3}  # fmt: skip
                        eps.append({"addresses": [ip], "conditions": conditions, "nodeName": "n1"})
                    where = ns if rng.random() < 0.9 else rng.choice(namespaces)
                    objects["EndpointSlice"][(where, f"{name}-{k}")] = {
                        "metadata": {"namespace": where, "name": f"{name}-{k}",
                                     "labels": {"kubernetes.io/service-name": name}},
                        "addressType": family, "endpoints": eps,
                        "ports": [{"name": "http", "port": 8080 + k, "protocol": "TCP"},
                                  {"name": "alt", "port": 9090, "protocol": "TCP"}][: rng.randint(0, 2)]}  # fmt: skip
        for p in range(rng.randint(0, 16)):
            n += 1
            labels = {"app": f"a{rng.randint(0, 3)}", "tier": rng.choice(["web", "db"])}
            ips = [f"10.244.{n // 250}.{n % 250}"] + ([f"fd02::{n:x}"] if rng.random() < 0.3 else [])
            named = [{"name": "web", "containerPort": 8000 + p, "protocol": "TCP"}] if rng.random() < 0.6 else []
            if rng.random() < 0.4:
                named.append({"name": "metrics", "containerPort": 9100, "protocol": rng.choice(["TCP", "UDP"])})
            objects["Pod"][(ns, f"p{p}")] = pod(ns, f"p{p}", labels, ips, named)
    for ns in namespaces:
        for i in range(rng.randint(0, 4)):
            backends = []
            for _ in range(rng.randint(1, 3)):
                if rng.random() < 0.15:
                    backends.append({"resource": {"apiGroup": "k8s.example.com", "kind": "Bucket", "name": "b"}})
                    continue
                port = rng.choice([{"number": 80}, {"number": 80}, {"number": 81}, {"number": 53}, {"number": 99},
                                   {"name": "http"}, {"name": "http"}, {"name": "alt"}, {"name": "nope"}])  # fmt: skip
                backends.append({"service": {"name": f"s{rng.randint(0, 6)}", "port": port}})
            objects["Ingress"][(ns, f"i{i}")] = ingress(ns, f"i{i}", backends)
    return objects


def test_the_servers_are_those_worked_out_per_service_before(monkeypatch):
    monkeypatch.setattr(ctl_mod, "ENDPOINT_STEP", 3)  # several steps, Services of a namespace in more than one
    monkeypatch.setattr(ctl_mod, "INDEX_STEP", 7)
    rng = random.Random(11)
    seen = {"servers": 0, "empty": 0, "resource": 0, "named": 0, "steps": 0}
    for _ in range(300):
        objects = varied(rng)
        ctl = IngressController.__new__(IngressController)
        ctl.objects = objects
        ctl.table = routing.build(objects["Ingress"].values())
        want = want_servers(ctl)
        assert want == old_want_servers(ctl.table, objects)
        seen["servers"] += sum(len(s) for s in want.values())
        seen["empty"] += sum(1 for s in want.values() if not s)
        seen["resource"] += sum(1 for b in ctl.table.backends.values() if b.service is None)
        seen["named"] += sum(1 for name, b in ctl.table.backends.items() if isinstance(b.port, str) and want[name])
        seen["steps"] += len({(b.namespace, b.service) for b in ctl.table.backends.values() if b.service}) > 3
    assert seen["servers"] > 400 and all(v > 50 for v in seen.values()), seen  # the cases above all came up
