"""When a restarted agent stops pinning the routes a previous run left (RFC 4724 §4.1): only
once it knows its peers -- the node registry read -- and each has sent End-of-RIB."""

from types import SimpleNamespace

from agentd.daemon.mesh import Peering
from agentd.daemon.routes import KernelRoutes
from agentd.datastore.store import NodeEvent, NodeRecord
from bgp import State


class Speaker:
    def __init__(self, peers=(), pending=()):
        self.peers = {p: SimpleNamespace(state=s) for p, s in peers}
        self.pending = list(pending)

    def initial_sync_pending(self):
        return self.pending


def routes(speaker, external=("tor",)):
    cfg = SimpleNamespace(bgp=SimpleNamespace(peers=list(external)))
    inputs = SimpleNamespace(cfg=cfg, peering=Peering("n1"), speaker=speaker, started_bgp=True)
    r = KernelRoutes(inputs)
    r.initial_sync_deadline = float("inf")
    return r, inputs


def n2():
    from ipaddress import IPv4Address

    return NodeRecord("n2", IPv4Address("10.0.0.2"), 64512, None, False, None, {})


def test_external_peers_do_not_end_the_wait_before_the_registry_is_read():
    # The first pass after BGP starts: external peers configured, the node registry not read
    # yet (no cluster peer configured): the adopted routes stay pinned.
    r, inputs = routes(Speaker())
    assert not r._initial_sync_complete()
    inputs.peering.apply(NodeEvent("snapshot", nodes={"n2": n2()}))
    # Now the cluster's peers are known; n2 is configured but not Established yet.
    inputs.speaker.peers["10.0.0.2"] = SimpleNamespace(state=State.CONNECT)
    assert not r._initial_sync_complete()
    inputs.speaker.peers["10.0.0.2"].state = State.ESTABLISHED
    inputs.speaker.pending = ["10.0.0.2"]
    assert not r._initial_sync_complete()
    inputs.speaker.pending = []
    assert r._initial_sync_complete()


def test_a_lone_node_is_done_once_the_registry_is_read():
    r, inputs = routes(Speaker(), external=())
    assert not r._initial_sync_complete()
    inputs.peering.apply(NodeEvent("snapshot", nodes={}))
    assert r._initial_sync_complete()


def test_the_deadline_ends_the_wait():
    r, inputs = routes(Speaker())
    r.initial_sync_deadline = 0.0
    assert r._initial_sync_complete()
