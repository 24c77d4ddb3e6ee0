"""The Services agent's sync pass flushes the UDP flows of endpoints a change took away (their
conntrack entries would keep a client on a dead pod) -- also when the change comes with a
rebuild of the whole table (a snapshot after etcd compacted, an error)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from agentd.datastore.store import Datastore
from agentd.resources import kinds, manifests
from agentd.resources.store import ResourceEvent
from agentd.services import agent as services_agent
from agentd.services import model
from agentd.services.agent import ServiceAgent, unusable_udp
from agentd.services.conntrack import (
    CtEntry,
    CtTuple,
    Stale,
    Unusable,
    entries_to_delete,
)

SERVICE = """\
apiVersion: v1
kind: Service
metadata: {name: stats, namespace: shop}
spec:
  clusterIP: 10.96.0.20
  ports:
  - {name: statsd, port: 8125, protocol: UDP, targetPort: 8125}
"""

SLICE = """\
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: stats-1, namespace: shop, labels: {kubernetes.io/service-name: stats}}
addressType: IPv4
endpoints:
%s
ports: [{name: statsd, port: 8125, protocol: UDP}]
"""


def objects(*ips: str) -> dict:
    endpoints = "\n".join(f"- addresses: [{ip}]\n  conditions: {{ready: true}}" for ip in ips)
    out = {}
    for text in (SERVICE, SLICE % endpoints):
        (obj,) = manifests.validate_all(manifests.read(text, "f.yaml"), "f.yaml")
        out[kinds.identity(obj)] = obj
    return out


class Programmer:
    async def sync(self, rs, keys):
        return SimpleNamespace(commands=1, full=keys is None)


async def test_an_endpoint_gone_in_a_snapshot_has_its_udp_flows_flushed(monkeypatch):
    flushed: list = []
    monkeypatch.setattr(services_agent.conntrack, "flush_udp", lambda gone: flushed.extend(gone) or len(gone))
    agent = ServiceAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"))
    agent.programmer = Programmer()
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        for revision, ips in ((5, ("10.244.1.2", "10.244.2.2")), (9, ("10.244.1.2",))):
            syncs = agent.syncs
            agent._on_resource(ResourceEvent("snapshot", revision, objects=objects(*ips), leases={}))
            agent._wake.set()
            while agent.syncs == syncs:
                await asyncio.sleep(0)
    finally:
        task.cancel()
    # The second snapshot rebuilt the table: 10.244.2.2's flows are flushed all the same.
    stale = [s for s in flushed if isinstance(s, Stale)]
    assert [(s.ip, s.port, s.vip, s.service_port) for s in stale] == [("10.244.2.2", 8125, "10.96.0.20", 8125)]


UDP = 17


def entry(src: str, sport: int, dst: str, dport: int, reply_src: str, reply_sport: int) -> CtEntry:
    return CtEntry(CtTuple(src, dst, UDP, sport, dport), CtTuple(reply_src, src, UDP, reply_sport, sport))


async def _sync(agent: ServiceAgent, revision: int, objs: dict) -> None:
    syncs = agent.syncs
    agent._on_resource(ResourceEvent("snapshot", revision, objects=objs, leases={}))
    agent._wake.set()
    while agent.syncs == syncs:
        await asyncio.sleep(0)


async def test_flows_older_than_the_agent_or_the_translation_go_unless_to_a_usable_endpoint(monkeypatch):
    """The first sync after start checks every UDP flow of a service port against its usable
    endpoints (one removed while the agent was down still has flows); so does a port going
    from no endpoint to some (a flow sent before this node translated it stays untranslated)."""
    flushed: list = []
    monkeypatch.setattr(services_agent.conntrack, "flush_udp", lambda gone: flushed.extend(gone) or len(gone))
    agent = ServiceAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"))
    agent.programmer = Programmer()
    vip = "10.96.0.20"
    to_live = entry("10.244.3.9", 40000, vip, 8125, "10.244.1.2", 8125)
    to_gone = entry("10.244.3.9", 40001, vip, 8125, "10.244.2.2", 8125)  # removed while the agent was down
    untranslated = entry("10.244.3.9", 40002, vip, 8125, vip, 8125)
    elsewhere = entry("10.244.3.9", 40003, "10.96.0.30", 8125, "10.96.0.30", 8125)
    entries = [to_live, to_gone, untranslated, elsewhere]
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        await _sync(agent, 5, objects("10.244.1.2"))  # the first sync after start
        assert [u for u in flushed if isinstance(u, Unusable)] == [Unusable(vip, 8125, None, 4, frozenset({("10.244.1.2", 8125)}))]
        assert entries_to_delete(entries, flushed) == [to_gone, untranslated]
        flushed.clear()
        await _sync(agent, 6, objects("10.244.1.2"))  # nothing changed: nothing checked
        assert flushed == []
        await _sync(agent, 7, objects())  # no endpoint: its removed one's flows go (Stale)
        assert [(s.ip, s.port) for s in flushed] == [("10.244.1.2", 8125)]
        flushed.clear()
        await _sync(agent, 8, objects("10.244.2.2"))  # from none to some: every other flow goes
        assert entries_to_delete(entries, flushed) == [to_live, untranslated]
    finally:
        task.cancel()


LOCAL_SERVICE = """\
apiVersion: v1
kind: Service
metadata: {name: stats, namespace: shop}
spec:
  type: NodePort
  clusterIP: 10.96.0.20
  %s
  ports:
  - {name: statsd, port: 8125, protocol: UDP, targetPort: 8125, nodePort: 30125}
"""


async def _first_sync(monkeypatch, policies: tuple[str, ...], mine: str, far: str, **agent_kw) -> list:
    """node1's first sync after start of LOCAL_SERVICE with ``policies`` Local and endpoints
    ``mine`` (node1) and ``far`` (node2): what it asked to flush."""
    flushed: list = []
    monkeypatch.setattr(services_agent.conntrack, "flush_udp", lambda gone: flushed.extend(gone) or len(gone))
    agent = ServiceAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"), **agent_kw)
    agent.programmer = Programmer()
    objs = {}
    endpoints = f"- addresses: [{mine}]\n  nodeName: node1\n- addresses: [{far}]\n  nodeName: node2"
    for text in (LOCAL_SERVICE % "\n  ".join(f"{p}: Local" for p in policies), SLICE % endpoints):
        (obj,) = manifests.validate_all(manifests.read(text, "f.yaml"), "f.yaml")
        objs[kinds.identity(obj)] = obj
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        await _sync(agent, 5, objs)  # the first sync after start
    finally:
        task.cancel()
    return flushed


@pytest.mark.parametrize("policies", [("externalTrafficPolicy",), ("internalTrafficPolicy",),
                                      ("externalTrafficPolicy", "internalTrafficPolicy"), ()])  # fmt: skip
async def test_the_first_sync_flushes_a_local_paths_flows_to_the_other_nodes_endpoints(monkeypatch, policies):
    """A policy turned Local while the agent was down (or before it restarted): on its first
    sync, node1 judges each path on its own, a Local one against node1's endpoints only.  The
    flows to node2's endpoint through a Local node port (from outside) or cluster IP go, those
    through a Cluster path and those to node1's endpoint stay; other ports' flows are left."""
    vip, node1, mine, far = "10.96.0.20", "192.168.50.1", "10.244.1.2", "10.244.2.2"
    flushed = await _first_sync(monkeypatch, policies, mine, far)
    vip_mine = entry("10.244.1.9", 40000, vip, 8125, mine, 8125)
    vip_far = entry("10.244.1.9", 40001, vip, 8125, far, 8125)
    np_mine = entry("192.168.50.3", 40002, node1, 30125, mine, 8125)
    np_far = entry("192.168.50.3", 40003, node1, 30125, far, 8125)
    others = [entry("10.244.1.9", 40004, "10.96.0.30", 8125, far, 8125), entry("192.168.50.3", 40005, node1, 30126, far, 8125)]
    expected = [vip_far] * ("internalTrafficPolicy" in policies) + [np_far] * ("externalTrafficPolicy" in policies)
    assert entries_to_delete([vip_mine, vip_far, np_mine, np_far, *others], flushed, {node1}) == expected


def two_services(a_ips: tuple[str, ...], b_ips: tuple[str, ...]) -> dict:
    """Services a (older) and b asking for one cluster IP and UDP port (a record allocation did
    not check): a has it, b is compiled without it."""
    out = {}
    for name, ips in (("a", a_ips), ("b", b_ips)):
        endpoints = "\n".join(f"- addresses: [{ip}]\n  conditions: {{ready: true}}" for ip in ips)
        service = SERVICE.replace("name: stats,", f"name: {name},").replace(
            "namespace: shop}", f"namespace: shop, creationTimestamp: '2026-01-0{1 if name == 'a' else 2}T00:00:00Z'}}")
        eps = SLICE.replace("stats-1", f"{name}-1").replace("service-name: stats", f"service-name: {name}") % endpoints
        for text in (service, eps):
            (obj,) = manifests.validate_all(manifests.read(text, "f.yaml"), "f.yaml")
            out[kinds.identity(obj)] = obj
    return out


async def test_a_refused_service_getting_endpoints_leaves_the_vip_owners_flows(monkeypatch):
    """b's endpoints coming (0 -> some) or going say nothing of the flows to the VIP: a has it.
    b's Unusable and Stale follow b's ports as compiled (no VIP), not as asked."""
    flushed: list = []
    monkeypatch.setattr(services_agent.conntrack, "flush_udp", lambda gone: flushed.extend(gone) or len(gone))
    agent = ServiceAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"))
    agent.programmer = Programmer()
    vip = "10.96.0.20"
    a_flow = entry("10.244.3.9", 40000, vip, 8125, "10.244.1.2", 8125)
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        await _sync(agent, 5, two_services(("10.244.1.2",), ()))
        assert agent.conflicts.keys() == {("shop", "b")}
        flushed.clear()
        await _sync(agent, 6, two_services(("10.244.1.2",), ("10.244.2.9",)))  # b: 0 -> some endpoints
        assert entries_to_delete([a_flow], flushed) == []
        await _sync(agent, 7, two_services(("10.244.1.2",), ()))  # and some -> 0
        assert entries_to_delete([a_flow], flushed) == []
        flushed.clear()
        await _sync(agent, 8, two_services(("10.244.1.2",), ("10.244.2.9",)))
        # a goes: b has the VIP now (compiled anew without an update of its own), with an
        # endpoint: a's flows go (Stale) and every flow not to b's endpoint (Unusable)
        objs = {k: v for k, v in two_services((), ("10.244.2.9",)).items() if k[2] != "a" and k[2] != "a-1"}
        await _sync(agent, 9, objs)
        assert Unusable(vip, 8125, None, 4, frozenset({("10.244.2.9", 8125)})) in flushed
        assert entries_to_delete([a_flow], flushed) == [a_flow]
    finally:
        task.cancel()


async def test_after_an_etcd_restore_the_applied_revision_follows_etcd_back(monkeypatch):
    """etcd restored from a backup (revision 1000 -> 900): the snapshot's revision is taken,
    not kept below the old one; a sync that began before it does not count as applying it."""
    monkeypatch.setattr(services_agent.conntrack, "flush_udp", lambda gone: len(gone))
    agent = ServiceAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"))
    agent.programmer = Programmer()
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        await _sync(agent, 1000, objects("10.244.1.2"))
        assert agent.applied_revision == 1000
        agent._on_resource(ResourceEvent("snapshot", 900, objects=objects("10.244.1.2"), leases={}))
        assert agent.revision == 900 and agent.applied_revision <= 900
        await _sync(agent, 900, objects("10.244.1.2"))
        assert agent.applied_revision == 900
        agent._on_resource(ResourceEvent("put", 901, key=("Namespace", "", "x"), obj={}))
        assert agent.revision == 901
    finally:
        task.cancel()


async def test_the_first_sync_keeps_a_local_node_ports_flows_from_this_nodes_pods(monkeypatch):
    """The review's case: a Local node port takes every usable endpoint for this node's own
    pods (the short-circuit), so their flows to node2's endpoint are the node's own choice and
    stay after a restart; the same through the node port from outside go."""
    node1, mine, far = "192.168.50.1", "10.244.1.2", "10.244.2.2"
    flushed = await _first_sync(monkeypatch, ("externalTrafficPolicy",), mine, far, pod_subnets={4: "10.244.1.0/24"})
    from_pod_far = entry("10.244.1.9", 40010, node1, 30125, far, 8125)
    from_pod_mine = entry("10.244.1.9", 40011, node1, 30125, mine, 8125)
    from_outside_far = entry("192.168.50.3", 40012, node1, 30125, far, 8125)
    from_pod_gone = entry("10.244.1.9", 40013, node1, 30125, "10.244.3.3", 8125)  # no endpoint now
    got = entries_to_delete([from_pod_far, from_pod_mine, from_outside_far, from_pod_gone], flushed, {node1})
    assert got == [from_outside_far, from_pod_gone]


async def test_the_agents_table_drops_the_service_ranges_unallocated_addresses(monkeypatch):
    """The agent hands its table the cluster's service range (the daemon's cluster record):
    a new connection to an address of it no Service has is dropped there."""
    monkeypatch.setattr(services_agent.conntrack, "flush_udp", lambda gone: len(gone))
    agent = ServiceAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"), service_ranges={4: "10.96.0.0/12"})
    agent.programmer = Programmer()
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        await _sync(agent, 5, objects("10.244.1.2"))
    finally:
        task.cancel()
    assert agent._table is not None
    chain = agent._table.rs.objects[("ip", "agentd-services", "chain", "filter-prerouting")]
    _new, in_range, verdict = json.loads(chain.rules[-1])
    assert in_range["match"]["right"] == {"prefix": {"addr": "10.96.0.0", "len": 12}} and verdict == {"goto": {"target": "no-service"}}
    assert "10.96.0.20" in agent._table.elements[("ip", "cluster-ips")]


def test_the_first_sync_flushes_the_flows_of_a_udp_port_with_no_usable_endpoint():
    """After a start every UDP port's flows are checked, also one with no usable endpoint
    now (its only endpoint stopped serving while the agent was down): all its flows go."""
    gone = model.Endpoint("10.244.9.9", 53, "node2", ready=False, serving=False)
    sp = model.ServicePort("kube-system", "dns", "", "UDP", 53, "10.96.0.10", None, None, False, False, (gone,))
    assert sp.usable() == ()
    assert unusable_udp([], [sp], "node1", first=True) == [Unusable("10.96.0.10", 53, None, 4, frozenset())]
    assert unusable_udp([], [sp], "node1", first=False) == []
    to_gone = entry("10.244.1.9", 40000, "10.96.0.10", 53, "10.244.9.9", 53)
    assert entries_to_delete([to_gone], unusable_udp([], [sp], "node1", first=True)) == [to_gone]


def test_the_first_sync_keeps_short_circuited_flows_to_the_ready_endpoints_only():
    """A Local node port whose endpoints on this node are all terminating (serving) while
    another node's is ready: the short-circuit (this node's pods) takes the ready one only,
    as the cluster IP does (kube-proxy's cluster policy chain), so after a start a pod's flow
    to the local terminating one through the node port goes (as one through the cluster IP
    would), one to the ready one stays; from outside, the local terminating one is the node
    port's choice and keeps its flows."""
    node1 = "192.168.0.1"
    mine = model.Endpoint("10.244.1.5", 53, "node1", ready=False, serving=True, terminating=True)
    far = model.Endpoint("10.244.2.5", 53, "node2")
    sp = model.ServicePort("ns", "dns", "", "UDP", 53, "10.96.0.10", 30053, None, False, True, (mine, far))
    assert [e.ip for e in sp.short_circuit_endpoints("node1")] == ["10.244.2.5"]
    flushes = unusable_udp([], [sp], "node1", first=True, short_circuit=("10.244.1.0/24",))
    from_pod_mine = entry("10.244.1.9", 40000, node1, 30053, "10.244.1.5", 53)
    from_pod_far = entry("10.244.1.9", 40001, node1, 30053, "10.244.2.5", 53)
    from_pod_gone = entry("10.244.1.9", 40002, node1, 30053, "10.244.3.5", 53)
    from_outside_mine = entry("192.0.2.7", 40003, node1, 30053, "10.244.1.5", 53)
    from_outside_far = entry("192.0.2.7", 40004, node1, 30053, "10.244.2.5", 53)
    entries = [from_pod_mine, from_pod_far, from_pod_gone, from_outside_mine, from_outside_far]
    assert entries_to_delete(entries, flushes, {node1}) == [from_pod_mine, from_pod_gone, from_outside_far]


async def test_an_etcd_restore_landing_during_a_pass_is_not_counted_applied_by_it(monkeypatch):
    """etcd restored (revision 1001 -> 900) while a pass is sending revision 1001 to the
    kernel: that pass does not count 1001 applied (the restore's snapshot left it at 900:
    nothing above is); the next pass, a full one from the snapshot, applies 900."""
    monkeypatch.setattr(services_agent.conntrack, "flush_udp", lambda gone: len(gone))
    agent = ServiceAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"))
    restore: list[ResourceEvent] = []

    class Restoring(Programmer):
        async def sync(self, rs, keys):
            while restore:
                agent._on_resource(restore.pop())
            return await super().sync(rs, keys)

    agent.programmer = Restoring()
    agent._on_resource(ResourceEvent("snapshot", 1000, objects=objects("10.244.1.2"), leases={}))
    assert await agent._sync_pass()
    assert agent.applied_revision == 1000
    agent._on_resource(ResourceEvent("put", 1001, key=("Namespace", "", "x"), obj={}))
    restore.append(ResourceEvent("snapshot", 900, objects=objects("10.244.1.3"), leases={}))
    assert await agent._sync_pass()
    assert agent.revision == 900 and agent.applied_revision == 900 and agent._dirty is None
    assert await agent._sync_pass()
    assert agent.applied_revision == 900
    assert [e.ip for sp in agent.compiled_ports for e in sp.endpoints] == ["10.244.1.3"]
