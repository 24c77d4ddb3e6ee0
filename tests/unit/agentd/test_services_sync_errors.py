"""The Services agent's sync pass survives a Service it cannot build or compile: that one is
left out and said so (a log line, GET /services, /status), the others are programmed, and a
change to it tries it again -- not an exception out of the loop, whose restart met the same
records and died again, so that no Service change reached any node."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from agentd.config.settings import load_config
from agentd.daemon.agent import Agent
from agentd.daemon.views import AgentViews
from agentd.datastore.store import Datastore
from agentd.nft.libnftables import NftError
from agentd.resources import kinds, manifests
from agentd.resources.store import ResourceEvent
from agentd.services import compiler, conntrack, dns
from agentd.services.agent import ServiceAgent


def _service(name: str, vip: str) -> str:
    return f"""\
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: shop, creationTimestamp: "2024-01-01T00:00:00Z"}}
spec:
  clusterIP: {vip}
  ports:
  - {{port: 5432, protocol: TCP, targetPort: 5432}}
"""


def _slice(name: str, service: str, endpoints: str) -> str:
    return f"""\
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}, namespace: shop, labels: {{kubernetes.io/service-name: {service}}}}}
addressType: IPv4
endpoints:
{endpoints}
ports: [{{name: "", port: 5432, protocol: TCP}}]
"""


def objects(*texts: str) -> dict:
    out = {}
    for text in texts:
        (obj,) = manifests.validate_all(manifests.read(text, "f.yaml"), "f.yaml")
        out[kinds.identity(obj)] = obj
    return out


# One address twice, with its node and without (the API allows it): sorting the two raised.
TWICE = "- addresses: [10.244.2.7]\n  nodeName: node2\n- addresses: [10.244.2.7]"
ONCE = "- addresses: [10.244.3.7]\n  nodeName: node3"


class Programmer:
    def __init__(self) -> None:
        self.error: NftError | None = None

    async def sync(self, rs, keys):
        if self.error is not None:
            raise self.error
        return SimpleNamespace(commands=1, full=keys is None)


def _agent() -> ServiceAgent:
    agent = ServiceAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"))
    agent.programmer = Programmer()
    return agent


async def _step(agent: ServiceAgent, task: asyncio.Task, ev: ResourceEvent) -> None:
    syncs, errors = agent.syncs, agent.sync_errors
    agent._on_resource(ev)
    agent._wake.set()
    while agent.syncs == syncs and agent.sync_errors == errors:
        assert not task.done(), task.exception()
        await asyncio.sleep(0)


def _vips(agent: ServiceAgent) -> dict[str, str | None]:
    return {sp.service: sp.cluster_ip for sp in agent.compiled_ports}


async def test_an_address_listed_twice_with_and_without_its_node_is_programmed():
    agent = _agent()
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        snapshot = objects(_service("db", "10.96.0.20"), _slice("db-1", "db", TWICE))
        await _step(agent, task, ResourceEvent("snapshot", 5, objects=snapshot, leases={}))
        (db,) = agent.compiled_ports
        assert [(e.ip, e.node) for e in db.endpoints] == [("10.244.2.7", "node2")]
        assert agent.failed == {} and agent.applied_revision == 5
    finally:
        task.cancel()


async def test_a_service_that_cannot_be_built_is_left_out_and_the_others_programmed(monkeypatch):
    agent = _agent()
    real = agent._build

    def build(key):
        if key == ("shop", "bad"):
            raise KeyError("spec")
        return real(key)

    monkeypatch.setattr(agent, "_build", build)
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        snapshot = objects(_service("db", "10.96.0.20"), _service("bad", "10.96.0.21"), _slice("db-1", "db", ONCE))
        await _step(agent, task, ResourceEvent("snapshot", 5, objects=snapshot, leases={}))
        assert _vips(agent) == {"db": "10.96.0.20"} and agent.applied_revision == 5
        assert agent.failed == {("shop", "bad"): "cannot be read, not translated: KeyError: 'spec'"}
        assert agent.views.view()["failed"] == {"shop/bad": "cannot be read, not translated: KeyError: 'spec'"}
        # Another Service's change is applied; the failed one's records changing try it again.
        (svc,) = objects(_service("web", "10.96.0.22")).items()
        await _step(agent, task, ResourceEvent("put", 6, key=svc[0], obj=svc[1]))
        assert _vips(agent) == {"db": "10.96.0.20", "web": "10.96.0.22"}
        monkeypatch.setattr(agent, "_build", real)
        (bad,) = objects(_service("bad", "10.96.0.23")).items()
        await _step(agent, task, ResourceEvent("put", 7, key=bad[0], obj=bad[1]))
        assert _vips(agent) == {"db": "10.96.0.20", "web": "10.96.0.22", "bad": "10.96.0.23"} and agent.failed == {}
    finally:
        task.cancel()


async def test_a_service_that_cannot_be_compiled_is_left_out_of_a_table_built_again(monkeypatch):
    """A failure inside the table's update may leave it half-changed: it is built again at
    once without that Service, which stays out until its records change."""
    agent = _agent()
    real = compiler.compile_port

    def compile_port(sp, node, *more):
        if sp.service == "bad":
            raise ValueError("a bug")
        return real(sp, node, *more)

    monkeypatch.setattr(compiler, "compile_port", compile_port)
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        snapshot = objects(_service("db", "10.96.0.20"), _slice("db-1", "db", ONCE))
        await _step(agent, task, ResourceEvent("snapshot", 5, objects=snapshot, leases={}))
        (bad,) = objects(_service("bad", "10.96.0.21")).items()
        await _step(agent, task, ResourceEvent("put", 6, key=bad[0], obj=bad[1]))
        assert _vips(agent) == {"db": "10.96.0.20"} and agent.applied_revision == 6
        assert agent.failed == {("shop", "bad"): "cannot be compiled, not translated: ValueError: a bug"}
        # A snapshot of the same records: tried once more, left out again, the loop alive.
        snapshot[bad[0]] = bad[1]
        await _step(agent, task, ResourceEvent("snapshot", 7, objects=snapshot, leases={}))
        assert _vips(agent) == {"db": "10.96.0.20"} and "shop/bad" in agent.views.view(summary=True)["failed"]
        monkeypatch.setattr(compiler, "compile_port", real)
        await _step(agent, task, ResourceEvent("put", 8, key=bad[0], obj=bad[1]))
        assert _vips(agent) == {"db": "10.96.0.20", "bad": "10.96.0.21"} and agent.failed == {}
    finally:
        task.cancel()


async def test_a_kernel_refusing_reject_in_prerouting_shows_in_status():
    """Before Linux 5.9 a reject in a chain on the prerouting hook is refused: the reason is
    in GET /status (services.error), not only in a log line a second."""
    agent = _agent()
    agent.programmer.error = NftError("Error: Could not process rule: Operation not supported")
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        snapshot = objects(_service("db", "10.96.0.20"), _slice("db-1", "db", ONCE))
        await _step(agent, task, ResourceEvent("snapshot", 5, objects=snapshot, leases={}))
    finally:
        task.cancel()
    node = Agent(load_config(None, env={}, overrides={"node.address": "10.1.1.1", "node.name": "node1"}))
    node.services = agent
    status = AgentViews(node).status()["services"]
    assert status["error"].endswith("(a reject in a prerouting chain needs Linux 5.9 or later)")
    assert status["revision"] == 0 and status["failed"] == {}


# -- any other step of a pass: logged, counted, shown, retried; the loop never ends ----------

UDP_SERVICE = """\
apiVersion: v1
kind: Service
metadata: {name: dns, namespace: shop, creationTimestamp: "2024-01-01T00:00:00Z"}
spec:
  clusterIP: 10.96.0.53
  ports:
  - {port: 53, protocol: UDP, targetPort: 53}
"""


def _udp_slice(addresses: str) -> str:
    return f"""\
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: dns-1, namespace: shop, labels: {{kubernetes.io/service-name: dns}}}}
addressType: IPv4
endpoints:
- addresses: [{addresses}]
  nodeName: node2
ports: [{{name: "", port: 53, protocol: UDP}}]
"""


def _retrying_agent() -> ServiceAgent:
    agent = _agent()
    agent.retry_delay = 0.0  # the failed pass is tried again at once (no sleep in a unit test)
    return agent


async def _synced(agent: ServiceAgent, task: asyncio.Task, syncs: int) -> None:
    """Until the loop has completed ``syncs`` passes (a retry needs no new event)."""
    while agent.syncs < syncs:
        assert not task.done(), task.exception()
        await asyncio.sleep(0)


async def test_a_dns_renaming_error_is_counted_shown_and_retried_and_later_changes_apply(monkeypatch, caplog):
    agent = _retrying_agent()
    real = dns.names
    faults = [ValueError("a bug in naming")]

    def names(ports, domain):
        ports = list(ports)
        if faults and any(sp.service == "web" for sp in ports):
            raise faults.pop()
        return real(ports, domain)

    monkeypatch.setattr(dns, "names", names)
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        snapshot = objects(_service("db", "10.96.0.20"), _slice("db-1", "db", ONCE))
        await _step(agent, task, ResourceEvent("snapshot", 5, objects=snapshot, leases={}))
        assert "db.shop.svc.cluster.local." in agent.names.a and agent.syncs == 1
        (web,) = objects(_service("web", "10.96.0.22")).items()
        await _step(agent, task, ResourceEvent("put", 6, key=web[0], obj=web[1]))
        # The pass failed: one line, counted, shown; revision 6 is not applied yet.
        assert agent.sync_errors == 1 and agent.applied_revision == 5 and not task.done()
        summary = agent.views.view(summary=True)
        assert summary["sync_errors"] == 1
        assert summary["error"] == "a services sync pass failed (tried again): ValueError: a bug in naming"
        lines = [r.getMessage() for r in caplog.records if r.name == "agentd.services" and r.levelname == "ERROR"]
        assert lines == ["a services sync pass failed (tried again): ValueError: a bug in naming"], lines
        # Tried again with no new event: applied, names whole, the error gone.
        await _synced(agent, task, 2)
        assert agent.applied_revision == 6 and agent.error is None
        assert {"db.shop.svc.cluster.local.", "web.shop.svc.cluster.local."} <= set(agent.names.a)
        # A later change still applies.
        (api,) = objects(_service("api", "10.96.0.23")).items()
        await _step(agent, task, ResourceEvent("put", 7, key=api[0], obj=api[1]))
        assert _vips(agent) == {"db": "10.96.0.20", "web": "10.96.0.22", "api": "10.96.0.23"}
        assert agent.applied_revision == 7 and "api.shop.svc.cluster.local." in agent.names.a
        assert agent.views.view()["sync_errors"] == 1
    finally:
        task.cancel()


async def test_a_udp_flush_error_keeps_the_flows_to_flush_and_the_loop_alive(monkeypatch):
    """Not only an OSError: whatever the conntrack flush raises, the flows it was to flush are
    tried again, and the loop goes on."""
    agent = _retrying_agent()
    flushed: list[list] = []
    faults = [RuntimeError("a bug in the conntrack dump")]

    def flush_udp(stale):
        stale = list(stale)
        if faults:
            raise faults.pop()
        flushed.append(stale)
        return len(stale)

    monkeypatch.setattr(conntrack, "flush_udp", flush_udp)
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        snapshot = objects(UDP_SERVICE, _udp_slice("10.244.2.7"))
        await _step(agent, task, ResourceEvent("snapshot", 5, objects=snapshot, leases={}))
        assert agent.sync_errors == 1 and agent.applied_revision == 0 and not task.done()
        assert agent.views.view(summary=True)["error"].endswith("RuntimeError: a bug in the conntrack dump")
        await _synced(agent, task, 1)  # the retry: the first sync's check of every UDP port's flows, done
        assert agent.applied_revision == 5 and agent.error is None
        assert [{type(f).__name__ for f in call} for call in flushed] == [{"Unusable"}]
        # A later change: the endpoint replaced, its flows flushed.
        (sl,) = objects(_udp_slice("10.244.2.8")).items()
        await _step(agent, task, ResourceEvent("put", 6, key=sl[0], obj=sl[1]))
        assert agent.applied_revision == 6 and agent.sync_errors == 1
        (db,) = agent.compiled_ports
        assert [e.ip for e in db.endpoints] == ["10.244.2.8"]
        assert any(isinstance(f, conntrack.Stale) and f.ip == "10.244.2.7" for f in flushed[-1]), flushed
    finally:
        task.cancel()
