"""kube-proxy's ``ct state invalid drop`` on the forward hook while conntrack's TCP window check
is strict (nf_conntrack_tcp_be_liberal not 1): an endpoint's out-of-window reply, which
conntrack would not translate back, reaching the client from the endpoint's own address made
the client reset a long or busy connection.  The rule follows the sysctl as the agent reads it
(the pod fast path sets it when it opens, and may fail to), and is there only while the table
translates (then the BPF data path hands conntrack both directions of the pods' flows)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from agentd.datastore.store import Datastore
from agentd.nft import expr
from agentd.resources.store import ResourceEvent
from agentd.services import compiler
from agentd.services.agent import ServiceAgent

from .test_services_sync_errors import ONCE, _service, _slice, objects

FORWARD = ("ip", compiler.TABLE, "chain", compiler.FORWARD_CHAIN)
FORWARD6 = ("ip6", compiler.TABLE, "chain", compiler.FORWARD_CHAIN)


def test_the_forward_chain_drops_invalid_tcp_only():
    objs = {o.key: o for o in compiler.base_objects(drop_invalid=True)}
    chain = objs[FORWARD]
    assert chain.hook == ("filter", "forward", compiler.DSTNAT + 1, "accept")
    assert [json.loads(r) for r in chain.rules] == [[
        expr.match(expr.meta("l4proto"), "tcp"), expr.match({"ct": {"key": "state"}}, "invalid", "in"), {"drop": None}]]
    assert FORWARD not in {o.key for o in compiler.base_objects()}
    table = compiler.Table("n1", families=(4, 6))
    assert not table.dropping_invalid and FORWARD not in table.rs.objects
    assert table.drop_invalid(True) == {FORWARD, FORWARD6} and table.dropping_invalid
    assert table.drop_invalid(True) == set()
    assert table.drop_invalid(False) == {FORWARD, FORWARD6} and FORWARD6 not in table.rs.objects


class Programmer:
    def __init__(self) -> None:
        self.rs = None

    async def sync(self, rs, keys):
        self.rs, self.keys = rs, keys
        return SimpleNamespace(commands=1, full=keys is None)


async def test_the_rule_follows_the_sysctl_while_translating():
    liberal = [False]
    translating: list[bool] = []

    async def on_translating(on: bool) -> None:
        translating.append(on)

    agent = ServiceAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"), tcp_liberal=lambda: liberal[0],
                         on_translating=on_translating)  # fmt: skip
    agent.programmer = programmer = Programmer()
    # Nothing translated: no rule (the BPF data path may hand pods packets past conntrack).
    agent._on_resource(ResourceEvent("snapshot", 5, objects={}, leases={}))
    assert await agent._sync_pass()
    assert FORWARD not in programmer.rs.objects
    # A Service translated, be_liberal 0 (no pod fast path, or it failed to load): dropped.
    agent._on_resource(ResourceEvent("snapshot", 6, objects=objects(_service("db", "10.96.0.20"), _slice("db-1", "db", ONCE)),
                                     leases={}))  # fmt: skip
    assert await agent._sync_pass()
    assert FORWARD in programmer.rs.objects and translating[-1] is True
    # The pod fast path (or the operator) made it liberal: the next pass takes the rule out,
    # with no Service changed (the counters' loop wakes it).
    liberal[0] = True
    assert await agent._sync_pass()
    assert FORWARD not in programmer.rs.objects and FORWARD in programmer.keys
    liberal[0] = False
    assert await agent._sync_pass()
    assert FORWARD in programmer.rs.objects and FORWARD in programmer.keys
    # The last Service gone: out again, in the transaction before the redirect is released.
    agent._on_resource(ResourceEvent("snapshot", 7, objects={}, leases={}))
    assert await agent._sync_pass()
    assert FORWARD not in programmer.rs.objects and translating[-1] is False


async def test_a_changed_sysctl_wakes_a_pass(monkeypatch):
    """With no Service changing, the counters' loop (every COUNTERS_INTERVAL) sees the sysctl
    change and wakes the sync loop, whose pass puts the rule in or takes it out."""
    import asyncio

    from agentd.services import agent as services_agent

    class Nft:
        async def acounters(self, family, table):
            return {}

    monkeypatch.setattr(services_agent, "COUNTERS_INTERVAL", 0)
    liberal = [False]
    agent = ServiceAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"), tcp_liberal=lambda: liberal[0])
    agent.programmer, agent.nft = Programmer(), Nft()
    agent._liberal = False  # as the last pass read it
    task = asyncio.get_running_loop().create_task(agent._counters_loop())
    try:
        for _ in range(5):
            await asyncio.sleep(0)
        assert not agent._wake.is_set()
        liberal[0] = True
        for _ in range(5):
            await asyncio.sleep(0)
        assert agent._wake.is_set()
    finally:
        task.cancel()
