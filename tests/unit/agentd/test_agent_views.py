"""The parts split out of the policy and Services agents, each tested alone: the presenters
(agentd/policy/views.py, agentd/services/views.py) on the agents' own state -- what GET
/policy, GET /services, /metrics and ``agentd status`` show, with no etcd, kernel or event
loop behind them -- and the pod publisher's endpoint-file side (agentd/policy/publisher.py)."""

from __future__ import annotations

from dataclasses import replace

from ipaddress import IPv4Address

import pytest

from agentd.datastore.store import Datastore
from agentd.cni import endpoints
from agentd.policy.agent import PolicyAgent
from agentd.policy.model import LocalPort, Pod, Policy
from agentd.policy.publisher import PodPublisher, container_of, record_for
from agentd.resources import kinds
from agentd.resources.store import ResourceStore
from agentd.services import compiler
from agentd.services.agent import ServiceAgent
from agentd.services.model import Endpoint, ServicePort

NODE = "node1"


def datastore() -> Datastore:
    # Never connected: the agents only keep it for their watches, which do not run here.
    return Datastore(["http://127.0.0.1:2379"], "/agentd")


def metric_values(collector: object) -> dict[tuple[str, tuple[str, ...]], float]:
    out = {}
    for family in collector.collect():  # type: ignore[attr-defined]
        for sample in family.samples:
            out[(sample.name, tuple(sample.labels.values()))] = sample.value
    return out


def policy_agent() -> PolicyAgent:
    agent = PolicyAgent(NODE, datastore(), "/nonexistent")
    eng = agent.engine
    eng.set_namespace("x", {})
    eng.upsert_pod(Pod("x", "a", NODE, (IPv4Address("10.244.1.2"),), {"app": "a"}, ()), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    eng.upsert_pod(Pod("x", "b", NODE, (IPv4Address("10.244.1.3"),), {"app": "b"}, ()), LocalPort("veth1", "02:00:00:00:00:02", "cni0"))
    eng.upsert_pod(Pod("x", "c", "node2", (IPv4Address("10.244.2.2"),), {"app": "c"}, ()))
    manifest = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "deny", "namespace": "x"},
                "spec": {"podSelector": {"matchLabels": {"app": "a"}}}}  # fmt: skip
    eng.upsert_policy(Policy.parse(kinds.validate(manifest)))
    agent.policy_count = len(eng.policies)
    eng.build()
    agent.dropped = {(("x", "a"), "ingress"): 7}
    agent.spoofed = 2
    agent.applied_revision = 42
    return agent


def test_policy_status_counts_local_and_isolated_pods():
    status = policy_agent().views.status()
    assert status["pods"] == 3 and status["local_pods"] == 2
    assert status["isolated"] == {"ingress": 1, "egress": 0, "any": 1}
    assert status["policies"] == 1 and status["revision"] == 42
    assert status["ruleset"] == {}  # nothing programmed: no programmer yet


def test_policy_view_per_local_pod_and_one_pod_and_summary():
    views = policy_agent().views
    full = views.view()
    assert [p["pod"] for p in full["pods"]] == ["x/a", "x/b"]  # one row per local pod
    (a,) = views.view("x/a")["pods"]
    assert a["policies"] == ["x/deny"] and a["isolated"] == {"ingress": True, "egress": False}
    assert a["dropped"] == {"ingress": 7, "egress": 0}
    assert views.view("x/c")["pods"] == []  # not on this node
    summary = views.view(summary=True)
    assert summary["revision"] == 42 and summary["pods"] == 3 and "ruleset" not in summary


def _tenant(local: int, pods: int, rules: int) -> PolicyAgent:
    """A tenant's namespace ``t`` of ``pods`` pods, ``local`` of them here, and one policy
    selecting every pod with ``rules`` ingress rules, each allowing every pod of the namespace."""
    agent = PolicyAgent(NODE, datastore(), "/nonexistent")
    eng = agent.engine
    eng.set_namespace("t", {"kubernetes.io/metadata.name": "t"})
    for i in range(pods):
        here = i < local
        eng.upsert_pod(Pod("t", f"p{i}", NODE if here else "node2", (IPv4Address(f"10.244.{i >> 8}.{i & 255}"),),
                           {"app": "x"}, ()),
                       LocalPort(f"veth{i}", f"02:00:00:00:{i >> 8:02x}:{i & 255:02x}", "cni0") if here else None)
    manifest = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "t", "name": "all"},
                "spec": {"podSelector": {}, "policyTypes": ["Ingress"],
                         "ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": 1000 + k}]} for k in range(rules)]}}
    eng.upsert_policy(Policy.parse(kinds.validate(manifest)))
    agent.policy_count = 1
    return agent


def test_policy_view_resolves_each_rule_once_not_once_per_local_pod(monkeypatch):
    """A namespace-wide policy of 20 rules over 2000 pods, 50 of them here: each rule's peers
    were resolved (and 2000 addresses sorted) again for every local pod it applies to -- 1000
    resolutions, 11.6 s on the agent's event loop for one GET /policy (the browser view's node
    page asked it).  Once per rule now, and the answer lists at most LISTED_MAX addresses,
    saying how many it left out."""
    from agentd.policy import views as policy_views

    agent = _tenant(50, 2000, 20)
    calls = []
    resolve = agent.engine.rule_members

    def spy(policy, direction, rule):
        calls.append((policy.key, direction, rule))
        return resolve(policy, direction, rule)

    monkeypatch.setattr(agent.engine, "rule_members", spy)
    full = agent.views.view()
    assert len(full["pods"]) == 50 and len(calls) == 20  # each rule once, not 50 x 20
    entries = [r for p in full["pods"] for r in p["ingress"]]
    assert len(entries) == 50 * 20
    listed = sum(len(r["peer_addresses"]) for r in entries)
    assert listed == policy_views.LISTED_MAX  # not 2,000,000 addresses
    assert listed + sum(r.get("left_out", 0) for r in entries) == 50 * 20 * 2000  # what is not listed is counted
    first = full["pods"][0]["ingress"][0]
    assert "left_out" not in first and first["peer_addresses"][:3] == ["10.244.0.0", "10.244.0.1", "10.244.0.2"]
    assert len(first["peer_addresses"]) == 2000
    calls.clear()
    (one,) = agent.views.view("t/p7")["pods"]  # one pod: its rules alone, in full
    assert len(calls) == 20 and all(len(r["peer_addresses"]) == 2000 and "left_out" not in r for r in one["ingress"])


def test_policy_view_of_pods_is_the_full_view_without_allow_lists(monkeypatch):
    """?view=pods (the browser view's node page): every local pod's row as the full view has
    it, without its allow-lists, and no rule resolved at all."""
    agent = policy_agent()
    full = agent.views.view()
    monkeypatch.setattr(agent.engine, "rule_members", lambda *a: pytest.fail("a rule resolved for view=pods"))
    pods = agent.views.view(allow_lists=False)
    assert pods == {**full, "pods": [{k: v for k, v in p.items() if k not in ("ingress", "egress")} for p in full["pods"]]}
    assert [sorted(p) for p in pods["pods"]] == [["dropped", "interface", "ip", "ips", "isolated", "labels", "pod", "policies"]] * 2


def test_policy_views_allow_lists_are_as_before_within_the_budget_and_cut_past_it():
    """Below LISTED_MAX an answer's allow-lists are what each pod's alone would be (the same as
    before rules were resolved once per answer); past it, each rule says how many it left out."""
    from agentd.policy.views import AllowLists, pod_view

    agent = _tenant(3, 10, 2)
    eng = agent.engine
    alone = [pod_view(eng, ("t", f"p{i}")) for i in range(3)]
    shared = AllowLists(eng)
    assert [pod_view(eng, ("t", f"p{i}"), shared) for i in range(3)] == alone
    assert alone[0]["ingress"][1] == {"policy": "t/all", "rule": 1, "peers": [{"namespace": "t", "pods": "<all>"}],
                                      "peer_addresses": [f"10.244.0.{i}" for i in range(10)],
                                      "ports": [{"protocol": "TCP", "port": 1001}], "named_ports": None}
    cut = AllowLists(eng, listed_max=25)  # 2 rules x 10 addresses per pod: the second pod's second rule is cut
    got = [pod_view(eng, ("t", f"p{i}"), cut)["ingress"] for i in range(3)]
    assert [[(len(r["peer_addresses"]), r.get("left_out")) for r in rules] for rules in got] == [
        [(10, None), (10, None)], [(5, 5), (0, 10)], [(0, 10), (0, 10)]]
    assert got[1][0]["peer_addresses"] == [f"10.244.0.{i}" for i in range(5)]


def test_policy_metrics():
    got = metric_values(policy_agent().views)
    assert got[("agentd_policy_dropped_packets_total", ("x", "ingress"))] == 7
    assert got[("agentd_policy_spoofed_packets_total", ())] == 2
    assert got[("agentd_policy_isolated_pods", ("ingress",))] == 1
    assert got[("agentd_policy_local_pods", ())] == 2
    assert got[("agentd_policy_policies", ())] == 1


def service_agent() -> ServiceAgent:
    agent = ServiceAgent(NODE, datastore())
    port = ServicePort(
        "x", "web", "http", "TCP", 80, "10.96.0.10", node_port=None, affinity_timeout=None,
        internal_local=False, external_local=False,
        endpoints=(Endpoint("10.244.1.2", 8080, NODE), Endpoint("10.244.2.2", 8080, "node2", ready=False, serving=False)),
    )  # fmt: skip
    agent._table = compiler.Table(NODE)  # what the agent's sync builds from etcd
    agent._table.update(("x", "web"), [port])
    agent.counters = {compiler.counter_name("x", "web"): 5}
    agent.applied_revision = 9
    return agent


def test_services_view_and_summary():
    views = service_agent().views
    (svc,) = views.view()["services"]
    assert (svc["namespace"], svc["name"], svc["clusterIP"], svc["connections"]) == ("x", "web", "10.96.0.10", 5)
    (port,) = svc["ports"]
    used = {(e["ip"], e["used"], e["local"]) for e in port["endpoints"]}
    assert used == {("10.244.1.2", True, True), ("10.244.2.2", False, False)}
    summary = views.view(summary=True)
    assert summary["revision"] == 9 and summary["service_ports"] == 1 and "services" not in summary


def test_services_view_shows_each_port_as_compiled_and_as_asked():
    """A cluster IP port and node port two Services claim are the older one's: the younger's
    port shows none (the kernel translates neither to it), and what it asked under "asked"."""
    agent = service_agent()
    port = ServicePort(
        "x", "copy", "http", "TCP", 80, "10.96.0.10", node_port=30080, affinity_timeout=None,
        internal_local=False, external_local=False, endpoints=(Endpoint("10.244.1.3", 8080, NODE),),
    )  # fmt: skip
    older = replace(port, service="web", created=1.0, endpoints=(Endpoint("10.244.1.2", 8080, NODE),))
    agent._table.update(("x", "web"), [older])
    agent._table.update(("x", "copy"), [port])
    view = {s["name"]: s for s in agent.views.view()["services"]}
    (copy,) = view["copy"]["ports"]
    assert (copy["clusterIP"], copy["nodePort"]) == (None, None)
    (web,) = view["web"]["ports"]
    assert (web["clusterIP"], web["nodePort"]) == ("10.96.0.10", 30080) and web["asked"] == {"clusterIP": "10.96.0.10", "nodePort": 30080}
    assert copy["asked"] == {"clusterIP": "10.96.0.10", "nodePort": 30080}
    assert view["copy"]["clusterIP"] == "10.96.0.10" and len(view["copy"]["errors"]) == 2  # the Service's address, refused
    # Its endpoint is usable, but neither address is translated to it here.
    assert [(e["ip"], e["port"], e["used"]) for e in copy["endpoints"]] == [("10.244.1.3", 8080, False)]
    assert copy["served"] == {"clusterIP": None, "nodePort": None, "nodePortFromNode": None}


def test_services_metrics():
    got = metric_values(service_agent().views)
    assert got[("agentd_service_connections_total", ("x", "web"))] == 5
    assert got[("agentd_service_endpoints", ("x", "web", "80/TCP"))] == 1


def test_services_syncs_is_a_counter():
    """ServiceAgent.syncs only counts up: a gauge without _total (as it was) tells Prometheus
    to take each value as it is, so rate() and increase() were not meant for it."""
    agent = service_agent()
    agent.syncs = 7
    (family,) = [f for f in agent.views.collect() if f.name == "agentd_services_syncs"]
    assert family.type == "counter" and [(s.name, s.value) for s in family.samples] == [("agentd_services_syncs_total", 7.0)]


def test_policy_drops_are_counted_per_namespace_and_never_go_down():
    """A pod label made a series per pod ever run (unbounded over rollouts), and a pod's counts
    went with it.  Per (namespace, direction): what a gone pod (or a counter made again) had
    counted is kept, so the sum never goes down (a counter reset to Prometheus)."""
    agent = policy_agent()

    def drops() -> dict:
        got = metric_values(agent.views)
        assert not any(name.startswith("agentd_policy_dropped") and len(labels) != 2 for name, labels in got), got
        return {labels: v for (name, labels), v in got.items() if name == "agentd_policy_dropped_packets_total"}

    assert drops() == {("x", "ingress"): 7}
    families = {f.name: f for f in agent.views.collect()}
    samples = families["agentd_policy_dropped_packets"].samples
    assert all(set(s.labels) == {"namespace", "direction"} for s in samples), samples
    agent.dropped = {(("x", "a"), "ingress"): 9, (("x", "b"), "ingress"): 4, (("x", "b"), "egress"): 1,
                     (("y", "p"), "ingress"): 2}  # fmt: skip
    assert drops() == {("x", "ingress"): 13, ("x", "egress"): 1, ("y", "ingress"): 2}
    agent.dropped = {(("x", "b"), "ingress"): 6, (("y", "p"), "ingress"): 1}  # x/a gone, b's egress gone, y/p reset
    assert drops() == {("x", "ingress"): 15, ("x", "egress"): 1, ("y", "ingress"): 3}
    assert agent.views.view("x/b")["pods"][0]["dropped"] == {"ingress": 6, "egress": 0}  # per pod: /policy


def test_policy_drops_of_a_pod_made_again_under_its_name_are_kept():
    """A StatefulSet pod deleted and made again (same namespace and name) between two scrapes
    gets a new counter, from zero; by the next scrape it may have counted past the old one's
    count, which looked like the same counter going up: the old pod's drops were lost.  The
    counter's identity (the sync that created it) tells them apart."""
    from types import SimpleNamespace

    from agentd.nft.ruleset import applied
    from agentd.policy import compiler as pcompiler

    agent = policy_agent()
    eng = agent.engine
    agent.programmer = SimpleNamespace(current=None)  # the tables hold nothing yet
    chain = (pcompiler.INET, pcompiler.pod_chain("in", "x", "a"))
    web0 = Pod("x", "a", NODE, (IPv4Address("10.244.1.2"),), {"app": "a"}, ())
    port = LocalPort("veth0", "02:00:00:00:00:01", "cni0")

    def sync() -> None:  # what the sync loop does around NftProgrammer.sync
        desired = eng.build()
        agent._note_new_counters(desired)
        agent.programmer.current = applied(desired)

    def drops() -> int:
        got = metric_values(agent.views)
        return got[("agentd_policy_dropped_packets_total", ("x", "ingress"))]

    def made_again() -> None:
        eng.remove_pod(web0.key)
        sync()  # its chain and counter go
        eng.upsert_pod(web0, port)
        sync()  # and come again, the counter from zero

    sync()
    agent.take_counters({chain: 100})
    assert drops() == 100
    made_again()
    agent.take_counters({chain: 150})  # the new pod's counter: 150 since it was made
    assert drops() == 250
    agent.take_counters({chain: 170})
    assert drops() == 270
    sync()  # nothing changed: the same counter
    agent.take_counters({chain: 180})
    assert drops() == 280
    made_again()
    agent.take_counters({chain: 40})
    assert drops() == 320


# ------------------------------------------------------------------ the publisher's files side
# (Publishing to etcd is exercised by tests/system/test_netpol.py on a real etcd.)


def publisher(tmp_path) -> PodPublisher:
    ds = datastore()
    return PodPublisher(NODE, str(tmp_path), ds, ResourceStore(ds), {}, {})


def endpoint(cid: str, name: str) -> endpoints.Endpoint:
    return endpoints.Endpoint(cid, "x", name, {"app": name}, [], ["10.244.1.5"], f"veth-{cid}", "02:00:00:00:00:02", "cni0")


def test_publisher_reports_the_pods_whose_files_came_changed_or_went(tmp_path):
    pub = publisher(tmp_path)
    assert pub.rescan() == set() and pub.have_local  # read once: nothing there
    assert pub.rescan() is None
    endpoints.write(tmp_path, endpoint("c1", "a"))
    endpoints.write(tmp_path, endpoint("c2", "b"))
    assert pub.rescan() == {("x", "a"), ("x", "b")} and pub.wake.is_set()
    assert pub.local(("x", "a")) == endpoint("c1", "a") and pub.local(("x", "z")) is None
    endpoints.remove(tmp_path, "c1")
    assert pub.rescan() == {("x", "a"), ("x", "b")}  # every pod it knew or knows: the agent re-feeds them
    assert pub.local(("x", "a")) is None


def test_an_endpoint_file_that_cannot_be_read_keeps_its_pod(tmp_path, monkeypatch):
    """A read error (EMFILE, EIO) or a damaged file is no pod gone: taking it out of policy
    would open an isolated pod.  Only the file gone is."""
    import builtins
    import errno
    import os

    pub = publisher(tmp_path)
    endpoints.write(tmp_path, endpoint("c1", "a"))
    endpoints.write(tmp_path, endpoint("c2", "b"))
    assert pub.rescan() == {("x", "a"), ("x", "b")}
    real_open = builtins.open

    def failing(path, *args, **kwargs):
        if str(path).endswith("c1.json"):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(endpoints, "open", failing, raising=False)
    assert pub.rescan() is None and pub.local(("x", "a")) == endpoint("c1", "a")
    monkeypatch.undo()
    path = os.path.join(endpoints.endpoints_dir(tmp_path), "c2.json")
    with open(path, "w") as f:
        f.write("{not json")
    assert pub.rescan() is None and pub.local(("x", "b")) == endpoint("c2", "b")
    monkeypatch.setattr(endpoints.os, "listdir", lambda _: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    assert pub.rescan() is None and set(pub.endpoints) == {"c1", "c2"}  # the directory unreadable: the same
    monkeypatch.undo()
    os.unlink(path)
    assert pub.rescan() == {("x", "a"), ("x", "b")} and pub.local(("x", "b")) is None  # gone is gone
    assert pub.local(("x", "a")) == endpoint("c1", "a")


def test_endpoint_files_that_failed_to_read_are_not_remembered_after_they_read_or_go(tmp_path, caplog, monkeypatch):
    """Each file that once could not be read (caught half-written, say) was remembered for the
    agent's lifetime -- one entry per container the node ever ran -- and a later problem with the
    same file was never logged.  Remembered only while it still fails; the directory too."""
    import errno
    import os

    pub = publisher(tmp_path)
    directory = endpoints.endpoints_dir(tmp_path)
    os.makedirs(directory, exist_ok=True)
    for i in range(1000):
        path = os.path.join(directory, f"{i:064x}{endpoints.SUFFIX}")
        with open(path, "w") as f:
            f.write('{"container_id": "')  # torn
        pub.rescan()
        os.unlink(path)  # the pod's DEL
        pub.rescan()
    assert sum(len(v) for v in vars(pub).values() if isinstance(v, set)) == 0  # nothing remembered
    # A file that reads again and later fails again: both failures logged.
    endpoints.write(tmp_path, endpoint("c1", "a"))
    pub.rescan()
    path = os.path.join(directory, "c1.json")
    caplog.clear()
    with caplog.at_level("WARNING"):
        for _ in range(2):
            with open(path, "w") as f:
                f.write("{torn")
            pub.rescan()
            pub.rescan()  # still failing: not logged again
            endpoints.write(tmp_path, endpoint("c1", "a"))
            pub.rescan()
    assert sum("cannot read endpoint file" in r.getMessage() for r in caplog.records) == 2
    # The directory unreadable, then readable, then unreadable again: each time said.
    caplog.clear()
    with caplog.at_level("ERROR"):
        for _ in range(2):
            monkeypatch.setattr(endpoints.os, "listdir", lambda _: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
            assert pub.rescan() is None
            assert pub.rescan() is None
            monkeypatch.undo()
            pub.rescan()
    assert sum("cannot read the endpoint files" in r.getMessage() for r in caplog.records) == 2
    assert pub._reported == set()


def test_a_pod_record_conflict_is_not_remembered_once_it_is_over(tmp_path, caplog):
    """A pod of this node recorded for another node is logged once while that lasts; once the
    pod is gone the tag goes too (not one per pod name for ever), and a new conflict is logged."""
    import asyncio

    records: dict = {}
    pub = publishing(tmp_path, FakeStore(), records)
    with caplog.at_level("ERROR"):
        for i in range(50):
            ep = endpoint(f"c{i}", f"p{i}")
            rec = record_for(ep, "other-node", {})
            rec["metadata"]["resourceVersion"] = "5"
            records[ep.key] = rec
            pub.endpoints, pub.have_local = {ep.container_id: ep}, True
            asyncio.run(pub.publish())
            asyncio.run(pub.publish())  # still in conflict: not logged again
            del records[ep.key]
            pub.endpoints = {}
            asyncio.run(pub.publish())
    assert pub._reported == set()
    assert sum("not overwriting it" in r.getMessage() for r in caplog.records) == 50


def test_a_del_and_add_within_one_mtime_tick_is_a_change_to_the_rescan(tmp_path):
    """DEL then ADD of one container ID within one tick of the file system's clock: the new
    file has the old one's mtime (and here its content).  The rescan judged by content and
    mtime and saw nothing; the new file's ident differs."""
    import os

    pub = publisher(tmp_path)
    path = os.path.join(endpoints.endpoints_dir(tmp_path), "c1.json")
    endpoints.write(tmp_path, endpoint("c1", "a"))
    os.utime(path, ns=(1_000, 1_000))
    assert pub.rescan() == {("x", "a")}
    first = pub.endpoints["c1"]
    assert pub.rescan() is None
    endpoints.remove(tmp_path, "c1")
    endpoints.write(tmp_path, endpoint("c1", "a"))
    os.utime(path, ns=(1_000, 1_000))
    assert pub.rescan() == {("x", "a")}
    assert pub.endpoints["c1"].ident != first.ident and pub.endpoints["c1"].written == first.written
    assert pub.rescan() is None


def test_endpoint_files_carry_their_time_and_the_newer_of_two_is_the_pods(tmp_path):
    """A stale file (its DEL stopped after the delegate released the address) and the pod's new
    one: the newer is the pod's; relabelling keeps a file's time (it is the attach time)."""
    import os

    pub = publisher(tmp_path)
    endpoints.write(tmp_path, endpoint("c1", "a"))
    endpoints.write(tmp_path, endpoint("c2", "a"))
    directory = endpoints.endpoints_dir(tmp_path)
    os.utime(os.path.join(directory, "c1.json"), ns=(2_000, 2_000))
    os.utime(os.path.join(directory, "c2.json"), ns=(1_000, 1_000))
    pub.rescan()
    assert pub.endpoints["c1"].written == 2_000 and pub.local(("x", "a")).container_id == "c1"
    endpoints.relabel(tmp_path, pub.endpoints["c2"], {"app": "b"})
    assert os.stat(os.path.join(directory, "c2.json")).st_mtime_ns == 1_000
    with open(os.path.join(directory, "c2.json")) as f:
        assert "written" not in f.read()


def test_a_pod_record_is_made_from_its_endpoint_file():
    record = record_for(endpoint("c1", "a"), NODE, {"app": "a", "tier": "web"})
    assert record["kind"] == "Pod" and record["spec"]["nodeName"] == NODE
    assert record["metadata"]["labels"] == {"app": "a", "tier": "web"}
    assert record["status"]["podIP"] == "10.244.1.5"
    assert container_of(record) == "c1"


def test_policy_drop_counters_of_a_pod_whose_chain_name_is_hashed():
    """A pod chain named past 200 characters is hashed (pod-in/#<sha1>): its counter was read
    as namespace "#<sha1>", pod "" (the text after the first '/', split), and the pod showed 0.
    The engine says whose chain it is."""
    from agentd.policy import compiler as pcompiler

    ns, pod = "team-payments-production", "a" * 63 + "." + "b" * 63 + "." + "c" * 60
    agent = policy_agent()
    agent.engine.upsert_pod(Pod(ns, pod, NODE, (IPv4Address("10.244.1.9"),), {}, ()),
                            LocalPort("veth9", "02:00:00:00:00:09", "cni0"))  # fmt: skip
    chain = pcompiler.pod_chain("in", ns, pod)
    assert chain.startswith("pod-in/#")
    agent.take_counters({(pcompiler.INET, chain): 5, (pcompiler.INET, pcompiler.pod_chain("out", "x", "a")): 3,
                         (pcompiler.INET, pcompiler.pod_chain("in", "x", "gone")): 9,  # not a local pod (now)
                         (pcompiler.BRIDGE, pcompiler.SPOOFED): 4})  # fmt: skip
    got = metric_values(agent.views)
    dropped = {labels: v for (name, labels), v in got.items() if name == "agentd_policy_dropped_packets_total"}
    assert dropped == {(ns, "ingress"): 5, ("x", "egress"): 3}
    assert got[("agentd_policy_spoofed_packets_total", ())] == 4
    (row,) = agent.views.view(f"{ns}/{pod}")["pods"]
    assert row["dropped"] == {"ingress": 5, "egress": 0}
    assert agent.views.view("x/a")["pods"][0]["dropped"] == {"ingress": 0, "egress": 3}


def test_service_connection_counters_never_go_down():
    """agentd_service_connections_total adds up the ip and ip6 tables' counters of a Service:
    a dual-stack Service made single-stack lost one family's counter and the sum went down
    (a counter reset to Prometheus).  What a gone (or re-created) counter had counted is kept."""
    agent = service_agent()
    name = compiler.counter_name("x", "web")
    other = compiler.counter_name("x", "db")
    v4, v6 = ("ip", "agentd-services"), ("ip6", "agentd-services")

    def total() -> int:
        return metric_values(agent.views)[("agentd_service_connections_total", ("x", "web"))]

    agent.take_counters({(*v4, name): 10, (*v6, name): 4, (*v4, other): 1})
    assert total() == 14
    agent.take_counters({(*v4, name): 12, (*v4, other): 1})  # made IPv4-only: the ip6 counter is gone
    assert total() == 16 and agent.counters[other] == 1
    agent.take_counters({(*v4, name): 3, (*v4, other): 2})  # the ip counter re-created: from zero
    assert total() == 19
    agent.take_counters({(*v4, name): 5, (*v6, name): 1, (*v4, other): 2})  # dual-stack again
    assert total() == 22
    agent.take_counters({(*v4, other): 2})  # the Service gone: forgotten
    assert name not in agent.counters and agent._counted_before == {}
    agent.take_counters({(*v4, name): 1, (*v4, other): 2})
    assert agent.counters[name] == 1


class FakeStore:
    """ResourceStore's writes, recorded; ``during_put`` runs while a write awaits etcd."""

    def __init__(self, during_put=None) -> None:
        self.puts: list[dict] = []
        self.during_put = during_put

    async def put_owned(self, obj, *, lease, expect):
        self.puts.append(obj)
        if self.during_put is not None:
            self.during_put(obj)
        return True

    async def delete_owned(self, kind, namespace, name, *, expect):
        return True


def publishing(tmp_path, store, records=None) -> PodPublisher:
    class Leased:
        lease_id = 7  # publish() needs the node's lease, nothing else of the datastore

    return PodPublisher(NODE, str(tmp_path), Leased(), store, records if records is not None else {}, {})  # type: ignore[arg-type]


def test_of_two_files_of_one_pod_etcd_gets_the_newer_as_the_tables_do(tmp_path):
    """A sandbox recreated on this node after a DEL that never came: two files for one pod.
    The record in etcd (what other nodes enforce against) is the newer one's, as local() is,
    whichever order the directory lists them in."""
    import asyncio
    import dataclasses

    store = FakeStore()
    pub = publishing(tmp_path, store)
    new = dataclasses.replace(endpoint("c-new", "a"), ips=["10.244.1.9"], written=2_000)
    old = dataclasses.replace(endpoint("c-old", "a"), written=1_000)
    pub.endpoints = {"c-new": new, "c-old": old}  # the stale file listed last
    pub.have_local = True
    assert pub.local(("x", "a")) is new
    asyncio.run(pub.publish())
    (record,) = store.puts
    assert container_of(record) == "c-new" and record["status"]["podIP"] == "10.244.1.9"


def test_relabelling_does_not_bring_back_the_file_of_a_pod_deleted_meanwhile(tmp_path):
    """publish() awaits etcd pod by pod; the DEL of a later pod in that round removes its file
    meanwhile: writing labels set with `agentd label pod` back must not write the file again
    (no second DEL would ever remove it) nor publish the pod."""
    import asyncio
    import os

    endpoints.write(tmp_path, endpoint("c1", "a"))
    endpoints.write(tmp_path, endpoint("c2", "b"))
    records = {}
    for cid, name in (("c1", "a"), ("c2", "b")):
        rec = record_for(endpoint(cid, name), NODE, {"app": name, "set": "later"})
        rec["metadata"]["resourceVersion"] = "5"
        records[("x", name)] = rec

    def delete_the_other(obj):
        other = "c2" if obj["metadata"]["name"] == "a" else "c1"
        endpoints.remove(tmp_path, other)

    store = FakeStore(delete_the_other)
    pub = publishing(tmp_path, store, records)
    pub.rescan()
    asyncio.run(pub.publish())
    assert len(store.puts) == 1  # the first pod's; the other is gone
    left = sorted(os.listdir(endpoints.endpoints_dir(tmp_path)))
    assert [n for n in left if n.endswith(endpoints.SUFFIX)] == [f"{container_of(store.puts[0])}.json"]
    assert pub.rescan() is not None and len(pub.endpoints) == 1


def test_relabel_writes_only_the_file_it_read(tmp_path):
    import dataclasses
    import os

    directory = endpoints.endpoints_dir(tmp_path)
    endpoints.write(tmp_path, endpoint("c1", "a"))
    os.utime(os.path.join(directory, "c1.json"), ns=(1_000, 1_000))
    (read,) = endpoints.read_all(tmp_path).values()
    relabelled = endpoints.relabel(tmp_path, read, {"app": "z"})
    assert relabelled is not None and endpoints.read(tmp_path, "c1").labels == {"app": "z"}
    # a DEL and ADD of the same container since it was read: the new attachment's file stays
    endpoints.write(tmp_path, dataclasses.replace(endpoint("c1", "a"), ips=["10.244.1.9"]))
    os.utime(os.path.join(directory, "c1.json"), ns=(2_000, 2_000))
    assert endpoints.relabel(tmp_path, read, {"app": "y"}) is None
    assert endpoints.read(tmp_path, "c1").ips == ["10.244.1.9"] and endpoints.read(tmp_path, "c1").labels == {"app": "a"}
    endpoints.remove(tmp_path, "c1")  # the pod's DEL: relabelling writes nothing
    assert endpoints.relabel(tmp_path, read, {"app": "y"}) is None
    assert endpoints.read_all(tmp_path) == {}


def test_the_agents_checks_exclude_the_plugins_changes(tmp_path):
    """relabel and acknowledge check a file and act on it under endpoints/.lock, exclusive;
    the plugin writes and removes under it, shared (plugins do not wait for each other)."""
    import fcntl
    import os

    import pytest

    endpoints.write(tmp_path, endpoint("c1", "a"))
    path = os.path.join(endpoints.endpoints_dir(tmp_path), endpoints.LOCK)
    fd = os.open(path, os.O_RDONLY)
    try:
        with endpoints._locked(tmp_path, exclusive=True), pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        with endpoints._locked(tmp_path, exclusive=False):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # another plugin's
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    assert endpoints.read_all(tmp_path).keys() == {"c1"}  # the lock file is no endpoint file


def _holding_the_lock(tmp_path, mode):
    """Another process's hold of endpoints/.lock (flock locks are per open file: this fd's
    lock excludes the module's own); released after 5 s so a blocking caller fails, not hangs."""
    import fcntl
    import os
    import threading

    fd = os.open(os.path.join(endpoints.endpoints_dir(tmp_path), endpoints.LOCK), os.O_RDONLY)
    fcntl.flock(fd, mode)
    timer = threading.Timer(5.0, fcntl.flock, (fd, fcntl.LOCK_UN))
    timer.start()
    return fd, timer


def _returns_within(seconds, fn, *args):
    import threading

    out: list = []

    def run():
        try:
            out.append(("ok", fn(*args)))
        except Exception as err:  # noqa: BLE001
            out.append(("raised", err))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return out[0] if out else None


def test_the_agent_never_waits_for_a_lock_someone_else_holds(tmp_path, monkeypatch):
    """A process holding endpoints/.lock (even shared) must not stop the agent: acknowledge
    and relabel try a few times and raise Busy, having changed nothing."""
    import fcntl
    import os

    monkeypatch.setattr(endpoints, "AGENT_LOCK_PAUSE", 0.0, raising=False)
    endpoints.write(tmp_path, endpoint("c1", "a"))
    (read,) = endpoints.read_all(tmp_path).values()
    fd, timer = _holding_the_lock(tmp_path, fcntl.LOCK_SH)
    try:
        got = _returns_within(2.0, endpoints.acknowledge, tmp_path, {("c1", read.ident)}, set())
        assert got is not None, "acknowledge waited for the lock"
        assert got[0] == "raised" and isinstance(got[1], endpoints.Busy)
        assert endpoints.unacknowledged(tmp_path, {"c1"}) == {"c1"}
        got = _returns_within(2.0, endpoints.relabel, tmp_path, read, {"app": "z"})
        assert got is not None, "relabel waited for the lock"
        assert got[0] == "raised" and isinstance(got[1], endpoints.Busy)
        assert endpoints.read(tmp_path, "c1").labels == {"app": "a"}
    finally:
        timer.cancel()
        os.close(fd)
    assert endpoints.acknowledge(tmp_path, {("c1", read.ident)}, set()) == {("c1", read.ident)}


def test_the_plugin_goes_on_without_a_lock_held_too_long(tmp_path, monkeypatch, caplog):
    import fcntl
    import os

    monkeypatch.setattr(endpoints, "PLUGIN_LOCK_WAIT", 0.0, raising=False)
    endpoints.write(tmp_path, endpoint("c1", "a"))
    fd, timer = _holding_the_lock(tmp_path, fcntl.LOCK_EX)
    try:
        got = _returns_within(2.0, endpoints.write, tmp_path, endpoint("c2", "b"))
        assert got == ("ok", None), "ADD waited for the lock"
        assert _returns_within(2.0, endpoints.remove, tmp_path, "c1") == ("ok", None), "DEL waited for the lock"
    finally:
        timer.cancel()
        os.close(fd)
    assert endpoints.read_all(tmp_path).keys() == {"c2"}
    assert "going on without it" in caplog.text


def test_only_the_agents_user_and_root_can_open_the_lock(tmp_path):
    """0600, whoever makes it first; one an earlier version left 0644 is made 0600.  Root (the
    plugin under the runtime) gives it to the directory's owner: the agent of its own user."""
    import os
    import stat as stat_mod

    import pytest

    directory = endpoints.endpoints_dir(tmp_path)
    lock = os.path.join(directory, endpoints.LOCK)
    endpoints.write(tmp_path, endpoint("c1", "a"))  # the plugin first
    assert stat_mod.S_IMODE(os.stat(lock).st_mode) == 0o600
    os.chmod(lock, 0o644)
    endpoints.acknowledge(tmp_path, {("c1", endpoints._ident(tmp_path, "c1"))}, set())  # the agent, later
    assert stat_mod.S_IMODE(os.stat(lock).st_mode) == 0o600
    os.unlink(lock)
    endpoints.relabel(tmp_path, endpoints.read_all(tmp_path)["c1"], {"app": "z"})  # the agent first
    assert stat_mod.S_IMODE(os.stat(lock).st_mode) == 0o600
    if os.geteuid() != 0:
        pytest.skip("giving the lock to the agent's user needs root")
    os.chown(directory, 4242, 4243)  # the agent's own user has the directory
    endpoints.remove(tmp_path, "c1")  # root's plugin
    st = os.stat(lock)
    assert (st.st_uid, st.st_gid, stat_mod.S_IMODE(st.st_mode)) == (4242, 4243, 0o600)


def test_a_new_file_of_the_same_container_with_the_same_content_is_a_change(tmp_path):
    """A DEL and ADD of one container ID that wrote the same content: the file is new (its time),
    so the tables and the acknowledgement (keyed by the file's ident) must hear of it."""
    import os

    pub = publisher(tmp_path)
    path = os.path.join(endpoints.endpoints_dir(tmp_path), "c1.json")
    endpoints.write(tmp_path, endpoint("c1", "a"))
    os.utime(path, ns=(1_000, 1_000))
    pub.rescan()
    endpoints.write(tmp_path, endpoint("c1", "a"))
    os.utime(path, ns=(2_000, 2_000))
    assert pub.rescan() == {("x", "a")} and pub.endpoints["c1"].written == 2_000
    assert pub.rescan() is None


def test_after_an_etcd_restore_the_policy_revision_follows_etcd_back():
    """etcd restored from a backup (revision 1000 -> 900), a new policy at 901: GET /policy's
    revision is what was applied after the restore, not the old 1000 (a waiter for >= 901
    passed before the policy was enforced); a build begun before the restore does not count."""
    from agentd.resources.store import ResourceEvent

    agent = PolicyAgent(NODE, datastore(), "/nonexistent")
    agent._on_resource(ResourceEvent("snapshot", 1000))
    agent._applied(agent.revision)
    assert agent.views.status()["revision"] == 1000
    agent._on_resource(ResourceEvent("snapshot", 900))
    assert agent.revision == 900 and agent.views.status()["revision"] <= 900
    agent._applied(1000)  # a build that took its revision before the snapshot came
    assert agent.applied_revision <= 900
    manifest = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "deny", "namespace": "x"},
                "spec": {"podSelector": {}}}  # fmt: skip
    agent._on_resource(ResourceEvent("put", 901, key=("NetworkPolicy", "x", "deny"), obj=kinds.validate(manifest)))
    assert agent.revision == 901
    agent._applied(agent.revision)
    assert agent.views.status()["revision"] == 901 and [r for r, _ in agent.history] == [1000, 901]


def test_an_endpoint_file_never_read_is_said_in_status_metrics_and_the_log(tmp_path, caplog):
    """A file whose pod policy cannot know (never readable: permissions, damaged from its first
    write) names neither the pod nor its bridge port, so nothing can be isolated for it: the
    agent says so -- one log line, /status ``unknown_endpoints``, a gauge, `agentd status` --
    until the file can be read. A file read before and unreadable now keeps its pod (not unknown)."""
    import os

    from agentd.cli import _unknown_endpoints

    agent = PolicyAgent(NODE, datastore(), str(tmp_path))
    pub = agent.publisher
    endpoints.write(tmp_path, endpoint("c1", "a"))
    os.makedirs(endpoints.endpoints_dir(tmp_path), exist_ok=True)
    bad = os.path.join(endpoints.endpoints_dir(tmp_path), "c9.json")
    with open(bad, "w") as f:
        f.write("{damaged")
    with caplog.at_level("WARNING"):
        pub.rescan()
        pub.rescan()
    assert sum("c9 has never been readable" in r.getMessage() for r in caplog.records) == 1
    assert agent.views.status()["unknown_endpoints"] == ["c9"]
    assert metric_values(agent.views)[("agentd_policy_unknown_endpoint_files", ())] == 1
    assert "UNKNOWN PODS 1 (endpoint files never read: c9)" in _unknown_endpoints(["c9"])
    endpoints.write(tmp_path, endpoint("c9", "z"))  # readable now: a pod like any other
    pub.rescan()
    assert agent.views.status()["unknown_endpoints"] == [] and pub.local(("x", "z")) is not None
    assert metric_values(agent.views)[("agentd_policy_unknown_endpoint_files", ())] == 0
    with open(os.path.join(endpoints.endpoints_dir(tmp_path), "c1.json"), "w") as f:
        f.write("{damaged later")
    pub.rescan()
    assert agent.views.status()["unknown_endpoints"] == [] and pub.local(("x", "a")) is not None
    assert _unknown_endpoints([]) == ""


def test_services_view_says_a_local_node_port_without_an_endpoint_here_drops():
    """externalTrafficPolicy: Local on a node without an endpoint of its own: the kernel drops
    the node port's traffic from outside (the cluster IP still reaches the other node's), so the
    node port from outside is not shown as served and the endpoint as not used by it; from
    the node itself and its pods (the short-circuit, ``nodePortFromNode``) it is, to every
    usable endpoint."""
    agent = service_agent()
    remote = Endpoint("10.244.2.3", 8080, "node2")
    local_np = ServicePort(
        "x", "edge", "http", "TCP", 80, "10.96.0.11", node_port=30081, affinity_timeout=None,
        internal_local=False, external_local=True, endpoints=(remote,),
    )  # fmt: skip
    internal = replace(local_np, service="inner", cluster_ip="10.96.0.12", node_port=None, internal_local=True, external_local=False)
    agent._table.update(("x", "edge"), [local_np])
    agent._table.update(("x", "inner"), [internal])
    view = {s["name"]: s for s in agent.views.view()["services"]}
    (edge,) = view["edge"]["ports"]
    assert edge["served"] == {"clusterIP": "translated", "nodePort": "dropped", "nodePortFromNode": "translated"}
    ((ep),) = edge["endpoints"]
    assert ep["used"] and ep["usedBy"] == ["clusterIP", "nodePortFromNode"]
    (inner,) = view["inner"]["ports"]
    assert inner["served"] == {"clusterIP": "dropped", "nodePort": None, "nodePortFromNode": None}
    ((ep),) = inner["endpoints"]
    assert not ep["used"] and ep["usedBy"] == []
    here = Endpoint("10.244.1.4", 8080, NODE)
    agent._table.update(("x", "edge"), [replace(local_np, endpoints=(remote, here))])
    (edge,) = next(s for s in agent.views.view()["services"] if s["name"] == "edge")["ports"]
    assert edge["served"] == {"clusterIP": "translated", "nodePort": "translated", "nodePortFromNode": "translated"}
    assert {e["ip"]: e["usedBy"] for e in edge["endpoints"]} == {
        "10.244.2.3": ["clusterIP", "nodePortFromNode"], "10.244.1.4": ["clusterIP", "nodePort", "nodePortFromNode"]
    }
    (web,) = view["web"]["ports"]  # Cluster policies, an endpoint here and one not ready elsewhere
    assert web["served"] == {"clusterIP": "translated", "nodePort": None, "nodePortFromNode": None}
    assert [(e["ip"], e["used"], e["usedBy"]) for e in web["endpoints"]] == [
        ("10.244.1.2", True, ["clusterIP"]), ("10.244.2.2", False, [])
    ]


def test_services_view_says_a_port_without_any_endpoint_is_refused():
    agent = service_agent()
    none = ServicePort(
        "x", "empty", "http", "TCP", 80, "10.96.0.13", node_port=30083, affinity_timeout=None,
        internal_local=False, external_local=True, endpoints=(),
    )  # fmt: skip
    agent._table.update(("x", "empty"), [none])
    view = {s["name"]: s for s in agent.views.view()["services"]}
    assert view["empty"]["ports"][0]["served"] == {"clusterIP": "refused", "nodePort": "refused", "nodePortFromNode": "refused"}


async def test_a_pod_whose_endpoint_file_names_no_mac_is_checked_with_its_interfaces(tmp_path, caplog):
    """An endpoint file without ``pod_mac`` (an older agentd-cni's, a delegate that named no
    MAC) leaves the pod MAC-checked all the same: the agent reads the MAC of the other end
    of its veth (off the event loop: agentd/policy/podmacs.py, tests/unit/agentd/test_policy_podmacs.py),
    once per file.  Where that cannot be read, the pod is listed in /status (``unchecked_macs``),
    `agentd status` and the log -- once -- rather than silently unchecked."""
    from agentd.cli import _refused_macs, _unchecked_macs
    from agentd.policy import compiler as policy_compiler

    asked: list[str] = []
    macs = {"veth-c1": "0a:58:0a:f4:01:05"}

    def peer_mac(interface: str) -> str:
        asked.append(interface)
        if interface not in macs:
            raise LookupError(f"no device {interface}")
        return macs[interface]

    def checked(agent: PolicyAgent) -> set[tuple[str, str]]:
        rs = agent.engine.build()
        s = rs.objects[("bridge", policy_compiler.TABLE, "set", policy_compiler.POD_MACS)]
        return {tuple(map(str, e)) for e in s.elements}  # type: ignore[union-attr]

    agent = PolicyAgent(NODE, datastore(), str(tmp_path), peer_mac=peer_mac)
    endpoints.write(tmp_path, endpoint("c1", "a"))
    endpoints.write(tmp_path, replace(endpoint("c2", "b"), ips=["10.244.1.6"]))
    with caplog.at_level("INFO"):
        agent._rescan()
        await agent._read_pod_macs(retry=False)  # the sync loop's, before it builds
        agent._rescan()
        await agent._read_pod_macs(retry=False)
        agent._feed_pod(("x", "a"))  # fed again (a record changed): not read again
        agent._feed_pod(("x", "b"))
    assert sorted(asked) == ["veth-c1", "veth-c2"]
    assert checked(agent) == {("veth-c1", "0a:58:0a:f4:01:05")}
    assert agent.engine.local[("x", "a")].pod_mac == "0a:58:0a:f4:01:05"
    status = agent.views.status()["unchecked_macs"]
    assert status == {"x/b": "no device veth-c2"}
    assert sum("cannot be read (no device veth-c2)" in r.getMessage() for r in caplog.records) == 1
    assert "MAC UNCHECKED 1 (x/b)" in _unchecked_macs(status) and _unchecked_macs({}) == ""
    assert "MAC REFUSED 1 (x/c)" in _refused_macs({"x/c": "why"}) and _refused_macs({}) == ""
    # A file naming the MAC is taken as it is, without asking.
    endpoints.write(tmp_path, replace(endpoint("c2", "b"), ips=["10.244.1.6"], pod_mac="0a:58:0a:f4:01:06"))
    agent._rescan()
    await agent._read_pod_macs(retry=True)
    assert sorted(asked) == ["veth-c1", "veth-c2"] and agent.views.status()["unchecked_macs"] == {}
    assert ("veth-c2", "0a:58:0a:f4:01:06") in checked(agent)
    # The MAC check off: nothing is read, nothing is unchecked that should be.
    off = PolicyAgent(NODE, datastore(), str(tmp_path), peer_mac=peer_mac, check_source_mac=False)
    asked.clear()
    off._rescan()
    await off._read_pod_macs(retry=True)
    assert asked == [] and off.views.status()["unchecked_macs"] == {} and checked(off) == set()


def test_a_policy_too_large_to_program_is_named_in_status_and_in_get_policy(monkeypatch):
    # A refused policy isolates its pods and allows nothing: an operator must see which one
    # and why where they look (agentd status, GET /policy), not only in the log.
    from agentd.policy import compiler as policy_compiler

    monkeypatch.setattr(policy_compiler, "MAX_POLICY_RULES", 1)
    agent = policy_agent()
    manifest = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "big", "namespace": "x"},
                "spec": {"podSelector": {"matchLabels": {"app": "b"}},
                         "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "c"}}}]},
                                     {"from": [{"podSelector": {"matchLabels": {"app": "a"}}}]}]}}  # fmt: skip
    agent.engine.upsert_policy(Policy.parse(kinds.validate(manifest)))
    agent.engine.build()
    assert set(agent.engine.too_large) == {("x", "big")}
    for shown in (agent.views.status(), agent.views.view(), agent.views.view(summary=True)):
        assert list(shown["too_large"]) == ["x/big"] and shown["too_large"]["x/big"]
    assert policy_agent().views.status()["too_large"] == {}


def _crowded_policy(pods: int, rules: int, build: bool):  # type: ignore[no-untyped-def]
    """``pods`` dual-stack pods of namespace t (t/p0 here), every other one app=x, each with
    "http" on 8000-8002; one policy selecting them all, ``rules`` ingress rules each allowing
    every pod, a rule of two selectors, an ingress and two egress rules of named ports."""
    from ipaddress import IPv6Address

    from agentd.policy.engine import PolicyEngine
    from agentd.policy.model import NamedPort

    eng = PolicyEngine(NODE, families=(4, 6))
    eng.set_namespace("t", {})
    for i in range(pods):
        eng.upsert_pod(Pod("t", f"p{i}", NODE if i == 0 else "node2",
                           (IPv4Address(f"10.244.{i >> 8}.{i & 255}"), IPv6Address(f"fd00::{i:x}")),
                           {"app": "x"} if i % 2 else {}, (NamedPort("http", 8000 + i % 3, "TCP"),)),
                       LocalPort("veth0", "02:00:00:00:00:01", "cni0") if i == 0 else None)  # fmt: skip
    ingress = [{"from": [{"podSelector": {}}], "ports": [{"port": 1000 + k}]} for k in range(rules)]
    ingress += [{"from": [{"podSelector": {"matchLabels": {"app": "x"}}}, {"namespaceSelector": {}}]},
                {"ports": [{"port": "http"}]}]  # fmt: skip
    egress = [{"to": [{"podSelector": {"matchLabels": {"app": "x"}}}, {"ipBlock": {"cidr": "10.244.0.0/24"}}],
               "ports": [{"port": "http"}]}, {"ports": [{"port": "http"}]}]  # fmt: skip
    eng.upsert_policy(Policy.parse(kinds.validate({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"namespace": "t", "name": "all"},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"], "ingress": ingress, "egress": egress}})))  # fmt: skip
    if build:
        eng.build()
    calls: list = []
    resolve = eng.rule_members

    def spy(policy, direction, rule):  # type: ignore[no-untyped-def]
        calls.append(rule)
        return resolve(policy, direction, rule)

    eng.rule_members = spy  # type: ignore[method-assign]
    return eng, calls


def test_an_answer_resolves_only_the_rules_it_lists_and_counts_the_rest():
    """5,000 pods, 200 rules each allowing all of them: an answer of at most 10 addresses
    resolved and sorted every rule's 5,000 (1.7 s at 5,000 pods, 22 s at 10,000, on the event
    loop: review r9 item 3).  The rules past the cap are counted, from the sets kept for the
    compiled policy."""
    from agentd.policy import views as policy_views

    eng, calls = _crowded_policy(5000, 198, build=True)
    got = policy_views.pod_view(eng, ("t", "p0"), policy_views.AllowLists(eng, 10))
    assert len(calls) == 1  # the first rule's lists fill the answer: the 201 others counted
    assert got["ingress"][0]["peer_addresses"] == [f"10.244.0.{i}" for i in range(10)]
    assert got["ingress"][0]["left_out"] == 2 * 5000 - 10
    # (the union of two selectors counted once; ingress named ports resolve on the pod selected)
    assert [r["left_out"] for r in got["ingress"][1:]] == [2 * 5000] * 197 + [2 * 5000, 2]
    assert [r["left_out"] for r in got["egress"]] == [2 * 2500 + 128 + 2 * 2500, 2 * 5000]
    assert all(r["peer_addresses"] == [] and r["named_ports"] is None for r in got["ingress"][1:-1] + got["egress"][:1])
    assert got["ingress"][-1]["peer_addresses"] is got["egress"][1]["peer_addresses"] is None  # (any peer)


@pytest.mark.parametrize("build", [True, False])
@pytest.mark.parametrize("listed_max", [0, 10, 1500, 100_000])
def test_an_answer_counting_rules_is_the_answer_resolving_them_all(build, listed_max):
    """Counted from the sets kept for the compiled policy, or worked out for one not compiled
    yet (a view asked between an event and the build): the answer is the one resolving every
    rule gives, however much of it is cut."""
    from agentd.policy import views as policy_views

    class Resolving(policy_views.AllowLists):  # every rule resolved, as answers were made before
        def _listed(self, rule):  # type: ignore[no-untyped-def]
            rule.resolve()
            return super()._listed(rule)

    eng, calls = _crowded_policy(600, 8, build)
    got = policy_views.pod_view(eng, ("t", "p0"), policy_views.AllowLists(eng, listed_max))
    assert len(calls) == {0: 0, 10: 1, 1500: 2, 100_000: 12}[listed_max]
    assert got == policy_views.pod_view(eng, ("t", "p0"), Resolving(eng, listed_max))
