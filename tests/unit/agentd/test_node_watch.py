"""The agent's node watch (Agent._watch_nodes): the node registry as etcd delivers it -> the
BGP peer set.  The datastore's own watch: tests/unit/agentd/test_datastore_parts.py and
tests/system/test_datastore.py."""

import asyncio
from ipaddress import IPv4Address, IPv4Network

from agentd.config.settings import load_config
from agentd.daemon.agent import Agent
from agentd.datastore.records import NodeEvent, NodeRecord
from bgp.testing import make_speaker

CFG = load_config(None, env={}, overrides={"node.address": "10.1.1.1", "node.name": "n1"})


def _node(name: str, address: str, subnet: str) -> NodeRecord:
    return NodeRecord(name, IPv4Address(address), 64512, IPv4Network(subnet), False, None)


class _Service:
    """What the agent's node watch drives of its SpeakerService, over a real Speaker."""

    def __init__(self, speaker) -> None:
        self.speaker = speaker
        self.set_peers_calls = 0

    def set_peers(self, peers) -> None:
        self.set_peers_calls += 1
        self.speaker.set_peers(list(peers), 1.0)

    def set_listen_ranges(self, ranges) -> None:
        self.speaker.set_listen_ranges(list(ranges), 1.0)

    def peers_configured(self) -> None:
        self.speaker.peers_configured(1.0)


def test_a_node_deleted_and_put_again_in_one_batch_keeps_its_session():
    """A watch resumed after an etcd outage replays what it missed in one batch: node x's lease
    ran out while etcd was away and x registered again, "delete x, put x".  The peer set was
    applied after every event: x was removed (a Cease, its routes withdrawn) and added anew, so
    a session up all along reset when etcd healed.  Now the batch is applied, then the peer set
    once: x is a peer before and after, and its Peer (and session) stays as it was."""
    x = _node("x", "10.1.1.2", "10.244.2.0/24")
    removed: list[str] = []

    class Datastore:
        async def watch_nodes(self):
            yield NodeEvent("snapshot", nodes={"x": x})
            for _ in range(3):  # the snapshot is applied; x's session comes up meanwhile
                await asyncio.sleep(0)
            yield NodeEvent("delete", name="x")  # the resumed watch's batch: no loop turn between them
            yield NodeEvent("put", name="x", record=x)

    async def main():
        agent = Agent(CFG)
        speaker = make_speaker("10.1.1.1", 64512, peers_known=False)
        speaker.start(0.0)
        real_remove = speaker.remove_peer

        def remove_peer(key, *args, **kwargs):
            removed.append(key)
            return real_remove(key, *args, **kwargs)

        speaker.remove_peer = remove_peer
        agent.service = _Service(speaker)
        agent.datastore = Datastore()
        watch = asyncio.ensure_future(agent._watch_nodes())
        for _ in range(2):
            await asyncio.sleep(0)
        assert list(speaker.peers) == ["10.1.1.2"], "the snapshot's peer set is applied at the next loop turn"
        peer = speaker.peers["10.1.1.2"]
        calls = agent.service.set_peers_calls
        await watch
        for _ in range(3):
            await asyncio.sleep(0)
        assert removed == []
        assert speaker.peers["10.1.1.2"] is peer
        assert agent.service.set_peers_calls == calls + 1  # the batch: one reconcile

    asyncio.run(main())


def test_node_events_apart_are_each_applied():
    """Events that come apart (a loop turn between them) are each applied: a node gone is a
    peer gone, not held back until some later event."""

    gone = asyncio.Event()

    class Datastore:
        async def watch_nodes(self):
            yield NodeEvent("snapshot", nodes={"x": _node("x", "10.1.1.2", "10.244.2.0/24")})
            await gone.wait()
            yield NodeEvent("delete", name="x")
            await asyncio.Event().wait()  # the watch runs on

    async def main():
        agent = Agent(CFG)
        speaker = make_speaker("10.1.1.1", 64512, peers_known=False)
        speaker.start(0.0)
        agent.service = _Service(speaker)
        agent.datastore = Datastore()
        watch = asyncio.ensure_future(agent._watch_nodes())
        for _ in range(3):
            await asyncio.sleep(0)
        assert list(speaker.peers) == ["10.1.1.2"]
        gone.set()
        for _ in range(3):
            await asyncio.sleep(0)
        assert list(speaker.peers) == []
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)

    asyncio.run(main())


def test_a_node_event_recomputes_the_routes_with_the_new_record():
    """A node record arriving after that node's route (common behind route reflectors), or a
    changed one: the routes are recomputed, node plans included -- not left as planned for an
    external router until some unrelated best-path change."""
    x = _node("x", "10.1.1.2", "10.244.2.0/24")
    recomputes: list[bool] = []

    class Datastore:
        async def watch_nodes(self):
            yield NodeEvent("snapshot", nodes={})
            yield NodeEvent("put", name="x", record=x)

    async def main():
        agent = Agent(CFG)
        agent.datastore = Datastore()
        agent.routes._recompute = lambda: recomputes.append(agent.routes._nodes_changed)
        await agent._watch_nodes()
        await asyncio.sleep(0)
        assert "x" in agent.peering.nodes
        assert recomputes == [True]  # one pass for the batch, the node plans made again

    asyncio.run(main())


def test_no_peer_change_is_applied_while_the_agent_stops():
    """A node event during a (graceful) stop must not reconfigure the sessions being closed."""
    x = _node("x", "10.1.1.2", "10.244.2.0/24")

    class Datastore:
        async def watch_nodes(self):
            yield NodeEvent("snapshot", nodes={"x": x})

    async def main():
        agent = Agent(CFG)
        speaker = make_speaker("10.1.1.1", 64512, peers_known=False)
        speaker.start(0.0)
        agent.service = _Service(speaker)
        agent.datastore = Datastore()
        agent.stopping = True
        await agent._watch_nodes()
        for _ in range(2):
            await asyncio.sleep(0)
        assert agent.service.set_peers_calls == 0 and list(speaker.peers) == []

    asyncio.run(main())
