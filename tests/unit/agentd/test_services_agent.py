"""The Services agent's inputs: pod records indexed by namespace and label, so a full rebuild
of the table costs the pods, not Services x pods (and gives the event loop back while it
runs); pod events marking the Services they feed, before and after the change."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentd.datastore.store import Datastore
from agentd.resources.store import ResourceEvent
from agentd.services import agent as services_agent
from agentd.services import model
from agentd.services.agent import ServiceAgent


class Programmer:
    async def sync(self, rs, keys):
        return SimpleNamespace(commands=1, full=keys is None)


def _agent() -> ServiceAgent:
    agent = ServiceAgent("n1", Datastore(["http://127.0.0.1:2379"], "/agentd"))
    agent.programmer = Programmer()
    return agent


def service(ns: str, name: str, vip: str, selector: dict[str, Any] | None, target: int | str = 8080,
            protocol: str = "TCP") -> dict[str, Any]:
    spec: dict[str, Any] = {"type": "ClusterIP", "clusterIP": vip, "clusterIPs": [vip], "ipFamilies": ["IPv4"],
                            "ports": [{"name": "", "protocol": protocol, "port": 80, "targetPort": target}],
                            "sessionAffinity": "None", "internalTrafficPolicy": "Cluster"}  # fmt: skip
    if selector is not None:
        spec["selector"] = selector
    return {"metadata": {"namespace": ns, "name": name, "creationTimestamp": "2024-01-01T00:00:00Z"}, "spec": spec}


def pod(ns: str, name: str, ip: str, labels: Any, node: str | None = "n1", ports: tuple[tuple[str, int, str], ...] = ()) -> dict[str, Any]:
    return {"metadata": {"namespace": ns, "name": name, "labels": labels},
            "spec": {"nodeName": node, "containers": [{"ports": [{"name": n, "containerPort": p, "protocol": proto}
                                                                 for n, p, proto in ports]}]},
            "status": {"podIP": ip, "podIPs": [{"ip": ip}]}}  # fmt: skip


def _old_build(agent: ServiceAgent, key: tuple[str, str]) -> list[model.ServicePort]:
    """The build before the index: every pod record of the Service's namespace."""
    svc = agent.objects["Service"].get(key)
    if svc is None:
        return []
    pods = [p for (ns, _), p in agent.objects["Pod"].items() if ns == key[0]] if svc["spec"].get("selector") else []
    return model.build([svc], list(agent._slices.get(key, {}).values()), pods)


def _old_fed(agent: ServiceAgent, ns: str, name: str) -> set[tuple[str, str]]:
    """The Services a pod record (as it is now) feeds, found as before the index: every Service."""
    p = agent.objects["Pod"].get((ns, name))
    if p is None:
        return set()
    labels = p["metadata"].get("labels") or {}
    return {k for k, svc in agent.objects["Service"].items()
            if k[0] == ns and svc["spec"].get("selector") and model.matches(svc["spec"]["selector"], labels)}  # fmt: skip


NAMESPACES = ("a", "b")
KEYS, VALUES = ("app", "tier"), ("web", "db")
# Labels that are not strings (a record no selector should match as such): indexed nowhere,
# candidates of every selector, matched as before.
ODD_LABELS = ({"app": 1}, {"app": "web", "tier": 1})


def _labels(rnd: random.Random) -> Any:
    roll = rnd.random()
    if roll < 0.1:
        return rnd.choice((None, *ODD_LABELS))
    return {k: rnd.choice(VALUES) for k in KEYS if k == "app" and roll < 0.7 or rnd.random() < 0.5}


def _op(rnd: random.Random) -> tuple[Any, ...]:
    """A random record change: a pod put (labels, address -- three only, so shared --, node,
    a named port of either protocol), a Service put (selector or none, numbered or named
    targetPort, protocol), a deletion, or a snapshot (of the records, some gone)."""
    roll, ns = rnd.random(), rnd.choice(NAMESPACES)
    if roll < 0.5:
        name = rnd.choice(("p1", "p2", "p3", "p4", "p5", "p6"))
        ports = rnd.choice(((), (("http", 8081, "TCP"),), (("http", 8082, "UDP"),)))
        return ("put", "Pod", ns, name, pod(ns, name, f"10.244.1.{rnd.randint(1, 3)}", _labels(rnd),
                                            rnd.choice(("n1", "n2", None)), ports))  # fmt: skip
    if roll < 0.7:
        name = rnd.choice(("s1", "s2", "s3"))
        selector = {k: rnd.choice(VALUES) for k in rnd.sample(KEYS, rnd.randint(1, 2))} if rnd.random() < 0.85 else None
        return ("put", "Service", ns, name, service(ns, name, f"10.96.0.{name[1]}", selector,
                                                    rnd.choice((8080, 8080, "http")), rnd.choice(("TCP", "UDP"))))  # fmt: skip
    if roll < 0.95:
        kind = "Pod" if rnd.random() < 0.7 else "Service"
        return ("delete", kind, ns, rnd.choice(("p1", "p2", "p3")) if kind == "Pod" else rnd.choice(("s1", "s2")), None)
    return ("snapshot",)


@settings(max_examples=100)
@given(st.integers(0, 2**32))
def test_the_indexed_build_and_marks_are_those_of_a_walk_over_every_pod(seed):
    """200 random record changes (pods put, relabelled, deleted, sharing addresses; Services
    put and deleted; snapshots between): every Service's ports are those built from every pod
    of its namespace (the same endpoints, a shared address kept the same way), and a pod
    event marks the Services whose selector picks it before or after, as the walk over every
    Service did."""
    rnd = random.Random(seed)
    agent = _agent()
    agent._on_resource(ResourceEvent("snapshot", 1, objects={}))
    endpoints = 0
    for revision in range(2, 202):
        op = _op(rnd)
        agent._dirty = set()
        if op[0] == "snapshot":
            objects = {(kind, ns, name): obj for kind in ("Service", "Pod") for (ns, name), obj in agent.objects[kind].items()
                       if rnd.random() < 0.7}  # some gone meanwhile  # fmt: skip
            agent._on_resource(ResourceEvent("snapshot", revision, objects=objects))
            continue
        what, kind, ns, name, obj = op
        expected = _old_fed(agent, ns, name) if kind == "Pod" else set()
        agent._on_resource(ResourceEvent(what, revision, key=(kind, ns, name), obj=obj))
        if kind == "Pod":
            expected |= _old_fed(agent, ns, name)
            assert agent._dirty == expected
        for key in agent.objects["Service"]:
            built = agent._build(key)
            assert built == _old_build(agent, key)
            endpoints += sum(len(sp.endpoints) for sp in built)
    assert endpoints > 0


def test_the_candidates_keep_the_order_records_were_put_in():
    """An unindexed pod (a label that is not a string) is a candidate of every selector, in
    the order of the records (a shared address's copies are merged in that order)."""
    index = model.PodIndex()
    plain1, odd, plain2 = (pod("a", "p1", "10.244.1.1", {"app": "web"}),
                           pod("a", "p2", "10.244.1.1", {"app": "web", "tier": 1}),
                           pod("a", "p3", "10.244.1.1", {"app": "web"}))  # fmt: skip
    for p in (plain1, odd, plain2):
        index.put("a", p["metadata"]["name"], p)
    index.put("a", "p4", pod("a", "p4", "10.244.1.4", {"app": "db"}))
    assert index.candidates("a", {"app": "web"}) == [plain1, odd, plain2]
    assert index.candidates("a", {"app": "web", "tier": "x"}) == [odd]
    assert index.candidates("b", {"app": "web"}) == []
    index.drop("a", "p1")
    index.put("a", "p1", plain1)  # put again: last
    assert index.candidates("a", {"app": "web"}) == [odd, plain2, plain1]
    assert index.namespace("a") == [odd, plain2, index.namespace("a")[2], plain1]


def _cluster(services: int, pods: int, namespaces: int = 50) -> dict:
    """The review's probe (agentd/services probe_build.py): each Service selects app=a<i>,
    pod j carries app=a<j % services>, spread over ``namespaces``."""
    objs = {}
    for i in range(services):
        ns = f"ns{i % namespaces}"
        objs[("Service", ns, f"s{i}")] = service(ns, f"s{i}", f"10.96.{i // 250}.{i % 250 + 1}", {"app": f"a{i}"})
    for j in range(pods):
        ns = f"ns{j % namespaces}"
        objs[("Pod", ns, f"p{j}")] = pod(ns, f"p{j}", f"10.244.{j // 250}.{j % 250 + 1}", {"app": f"a{j % services}"})
    return objs


async def test_a_full_rebuild_matches_each_pod_about_once_not_once_per_service(monkeypatch):
    """2,000 selector Services and 5,000 pods in 50 namespaces: a full rebuild matched every
    pod of a Service's namespace against its selector (200,000 matches, seconds of a blocked
    event loop at 4,000 x 8,000); now only the pods carrying one of its labels."""
    calls = 0
    real = model.matches

    def counted(selector, labels):
        nonlocal calls
        calls += 1
        return real(selector, labels)

    monkeypatch.setattr(model, "matches", counted)
    agent = _agent()
    agent._on_resource(ResourceEvent("snapshot", 7, objects=_cluster(2000, 5000)))
    assert await agent._sync_pass()
    assert sum(len(sp.endpoints) for sp in agent.compiled_ports) == 5000
    assert calls <= 2 * 5000


async def test_a_full_rebuild_gives_the_event_loop_back_and_shows_no_half_built_table():
    """A full rebuild of 250 Services lets other tasks (BGP, BFD, the API, DNS) run after
    every COMPILE_STEP Services it compiles, judges for UDP flows and names; meanwhile the
    agent shows a whole table and whole DNS names, the ones before until the new ones are."""
    agent = _agent()
    objs = {("Service", "ns", f"s{i}"): service("ns", f"s{i}", f"10.96.{i // 250}.{i % 250 + 1}", None) for i in range(250)}
    agent._on_resource(ResourceEvent("snapshot", 3, objects=objs))
    assert await agent._sync_pass()
    table, names = agent._table, agent.names
    whole = (agent.port_count, len(names.a))
    assert whole[0] == 250 and whole[1] >= 250
    agent._dirty = None  # a full rebuild (as after a snapshot or a failed pass)
    seen: list[Any] = []

    async def tick() -> None:
        while True:
            seen.append((agent._table, agent.names, agent.port_count, len(agent.names.a)))
            await asyncio.sleep(0)

    ticker = asyncio.get_running_loop().create_task(tick())
    await asyncio.sleep(0)
    seen.clear()
    try:
        assert await agent._sync_pass()
    finally:
        ticker.cancel()
    steps = 250 // services_agent.COMPILE_STEP
    assert len(seen) >= 3 * steps  # compiling, judging the UDP flows, naming
    assert all((c, a) == whole for _, _, c, a in seen)
    assert sum(t is table for t, *_ in seen) >= steps  # the table before, while the new one is compiled
    assert all(n is names for _, n, *_ in seen)  # the names before, while the new ones are made
    assert agent._table is not table and agent.names is not names
    assert (agent.port_count, len(agent.names.a)) == whole


async def test_a_pod_relabelled_or_deleted_leaves_the_services_that_selected_it():
    """A pod event marks the Services its record fed before the change as well as after: a
    pod relabelled away from a selector, or deleted, stops being an endpoint at the next
    (incremental) pass, not at the next full rebuild."""
    agent = _agent()
    objs = {("Service", "shop", "web"): service("shop", "web", "10.96.0.10", {"app": "web"}),
            ("Pod", "shop", "web-1"): pod("shop", "web-1", "10.244.1.1", {"app": "web"}),
            ("Pod", "shop", "web-2"): pod("shop", "web-2", "10.244.1.2", {"app": "web"})}  # fmt: skip
    agent._on_resource(ResourceEvent("snapshot", 5, objects=objs))
    assert await agent._sync_pass()

    def endpoints() -> list[str]:
        (sp,) = agent.compiled_ports
        return [e.pod for e in sp.endpoints]

    assert endpoints() == ["shop/web-1", "shop/web-2"]
    agent._on_resource(ResourceEvent("put", 6, key=("Pod", "shop", "web-1"),
                                     obj=pod("shop", "web-1", "10.244.1.1", {"app": "other"})))  # fmt: skip
    assert await agent._sync_pass()
    assert agent.last_sync is not None and not agent.last_sync["full"]
    assert endpoints() == ["shop/web-2"]
    agent._on_resource(ResourceEvent("delete", 7, key=("Pod", "shop", "web-2")))
    assert await agent._sync_pass()
    assert endpoints() == []
    assert agent.applied_revision == 7


def _state(agent: ServiceAgent) -> tuple[Any, ...]:
    """What the agent made of its records: compiled ports, applied ports, DNS names, conflicts, failures."""
    table = agent._table
    assert table is not None
    keys = set(agent.objects["Service"]) | set(agent._applied)
    compiled = {k: repr(list(table.compiled(k))) for k in keys if list(table.compiled(k))}
    applied = {k: repr(v) for k, v in agent._applied.items()}
    names = (dict(agent.names.a), dict(agent.names.aaaa), {k: repr(v) for k, v in agent.names.srv.items()})
    return compiled, applied, names, {k: repr(v) for k, v in agent.conflicts.items()}, dict(agent.failed)


def _fresh_state(objects: dict, revision: int) -> Any:
    fresh = _agent()
    fresh._on_resource(ResourceEvent("snapshot", revision, objects=dict(objects)))
    return fresh


async def test_records_changed_during_a_full_rebuild_are_compiled_at_the_next_pass(monkeypatch):
    """A full rebuild gives the event loop back every COMPILE_STEP Services: a Service deleted
    after its step was compiled, one deleted before its step, a pod relabelled away from a
    compiled Service's selector, all meanwhile, are marked for the next (incremental) pass,
    which leaves the agent as a fresh one fed the final records (review r14 #1)."""
    monkeypatch.setattr(services_agent, "COMPILE_STEP", 3)
    objs: dict[Any, Any] = {("Service", "a", f"s{i}"): service("a", f"s{i}", f"10.96.0.{i + 1}", {"app": "web"} if i == 0 else None)
                            for i in range(9)}  # fmt: skip
    objs[("Pod", "a", "p0")] = pod("a", "p0", "10.244.0.5", {"app": "web"})
    agent = _agent()
    agent._on_resource(ResourceEvent("snapshot", 1, objects=dict(objs)))
    assert await agent._sync_pass()
    old = agent._table
    agent._dirty = None  # a full rebuild
    events = [ResourceEvent("delete", 2, key=("Service", "a", "s1")),  # compiled in the first step
              ResourceEvent("delete", 3, key=("Service", "a", "s7")),  # in the last step
              ResourceEvent("put", 4, key=("Pod", "a", "p0"), obj=pod("a", "p0", "10.244.0.5", {"app": "db"}))]  # fmt: skip
    during: list[bool] = []

    async def tick() -> None:  # runs at the first step's end: s0-s2 compiled, s3-s8 not yet
        during.append(agent._table is old)  # the rebuild still under way
        for ev in events:
            agent._on_resource(ev)
            if ev.kind == "delete":
                objs.pop(ev.key)
            else:
                objs[ev.key] = ev.obj

    ticker = asyncio.get_running_loop().create_task(tick())
    try:
        assert await agent._sync_pass()
    finally:
        ticker.cancel()
    assert during == [True]
    assert agent._dirty  # marked for the next pass
    assert await agent._sync_pass()
    assert agent.last_sync is not None and not agent.last_sync["full"]
    assert ("a", "s1") not in agent._applied and ("a", "s7") not in agent._applied
    assert all(not sp.endpoints for sp in agent.compiled_ports)
    fresh = _fresh_state(objs, 4)
    assert await fresh._sync_pass()
    assert _state(agent) == _state(fresh)


def _random_record(rnd: random.Random) -> tuple[Any, Any]:
    ns = rnd.choice(NAMESPACES)
    if rnd.random() < 0.45:
        i = rnd.randrange(12)
        s = service(ns, f"s{i}", f"10.96.0.{rnd.randrange(1, 8)}",  # shared cluster IPs: conflicts
                    rnd.choice([None, {"app": "web"}, {"app": "db"}, {"tier": "x"}]), protocol=rnd.choice(["TCP", "UDP"]))  # fmt: skip
        s["metadata"]["creationTimestamp"] = f"2024-01-0{rnd.randrange(1, 4)}T00:00:00Z"
        return ("Service", ns, f"s{i}"), s
    j = rnd.randrange(10)
    labels = rnd.choice([{"app": "web"}, {"app": "db", "tier": "x"}, {}])
    return ("Pod", ns, f"p{j}"), pod(ns, f"p{j}", f"10.244.0.{rnd.randrange(1, 30)}", labels)


@pytest.mark.parametrize("seed", range(40))
async def test_changes_during_full_rebuilds_end_as_a_fresh_agent_fed_the_final_records(monkeypatch, seed):
    """Random puts, deletes and snapshots between the steps of full rebuilds (COMPILE_STEP=3),
    then incremental passes: compiled and applied ports, DNS names, conflicts and failures are
    those of a fresh agent fed the final records (the review's fuzz_svc.py, r14 #1)."""
    monkeypatch.setattr(services_agent, "COMPILE_STEP", 3)
    rnd = random.Random(seed)
    cur = dict(_random_record(rnd) for _ in range(25))
    agent = _agent()
    revision = 1
    agent._on_resource(ResourceEvent("snapshot", revision, objects=dict(cur)))
    assert await agent._sync_pass()

    async def tick() -> None:
        nonlocal revision
        while True:
            await asyncio.sleep(0)
            roll = rnd.random()
            revision += 1
            if roll < 0.05:
                cur.clear()
                cur.update(_random_record(rnd) for _ in range(25))
                agent._on_resource(ResourceEvent("snapshot", revision, objects=dict(cur)))
            elif roll < 0.35:
                key, obj = _random_record(rnd)
                cur[key] = obj
                agent._on_resource(ResourceEvent("put", revision, key=key, obj=obj))
            elif roll < 0.5 and cur:
                key = rnd.choice(sorted(cur))
                del cur[key]
                agent._on_resource(ResourceEvent("delete", revision, key=key))

    for _ in range(3):
        agent._dirty = None
        ticker = asyncio.get_running_loop().create_task(tick())
        try:
            await agent._sync_pass()
        finally:
            ticker.cancel()
        for _ in range(5):  # until quiet
            await agent._sync_pass()
    fresh = _fresh_state(cur, revision)
    await fresh._sync_pass()
    assert _state(agent) == _state(fresh)


async def test_a_services_table_found_gone_wakes_a_pass_that_writes_it_again():
    """The counters read of a table this agent wrote finds it gone (deleted by someone else:
    ``nft flush ruleset``): a pass is woken, whose sync writes it again (the programmer in
    doubt); a table never written wakes nothing (review s57 r17: the wake was unpinned)."""
    from agentd.nft.nfnetlink import TableAbsent

    agent = _agent()
    believed: list[tuple[str, str]] = []

    class Nft:
        async def acounters(self, family, table):
            return TableAbsent()

    agent.nft = Nft()
    agent.programmer.table_absent = lambda family, table: (family, table) in believed
    await agent.refresh_counters()
    assert not agent._wake.is_set()
    believed.append(("ip", "agentd-services"))
    await agent.refresh_counters()
    assert agent._wake.is_set()
