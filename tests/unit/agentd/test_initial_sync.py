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


# --- the re-check timer while the initial sync is pending -------------------------------------


class FakeLoop:
    """call_soon/call_later on a clock the test moves (``advance``)."""

    def __init__(self):
        self.now = 0.0
        self.timers = []  # [when, seq, callback, handle]
        self.seq = 0

    def _add(self, when, callback):
        handle = SimpleNamespace(cancelled=False)
        handle.cancel = lambda: setattr(handle, "cancelled", True)
        self.seq += 1
        self.timers.append([when, self.seq, callback, handle])
        return handle

    def call_soon(self, callback):
        return self._add(self.now, callback)

    def call_later(self, delay, callback):
        return self._add(self.now + delay, callback)

    def pending(self):
        return [t for t in self.timers if not t[3].cancelled]

    def advance(self, seconds):
        end = self.now + seconds
        while True:
            due = sorted(t for t in self.pending() if t[0] <= end)
            if not due:
                break
            when, _seq, callback, _handle = due[0]
            self.timers.remove(due[0])
            self.now = max(self.now, when)
            callback()
        self.now = end


def recomputing(monkeypatch):
    """KernelRoutes on a fake loop with the route computation counted, BGP not synced."""
    import agentd.daemon.routes as R

    calls = []

    def fake_desired(*args, **kwargs):
        calls.append(1)
        return SimpleNamespace(routes=[], plans={}, plans_v6={}, rows=[], next_hops={}, next_hops_v6={}, refused=[], untrusted=[], untrusted_next_hops=[])

    monkeypatch.setattr(R, "desired_routes", fake_desired)
    tunnels = SimpleNamespace(paths=lambda: None, available=None, apply=lambda *a, **k: None)
    inputs = SimpleNamespace(
        cfg=SimpleNamespace(network=SimpleNamespace(backend="vxlan", encap="always")), name="n1",
        peering=SimpleNamespace(nodes={}, known=False), underlay=object(), lease=object(), leases={},
        tunnels=tunnels, speaker=Speaker(), started_bgp=True, stopping=False, cluster=None)
    r = KernelRoutes(inputs)
    r.loop = FakeLoop()
    r.initial_sync_deadline = float("inf")
    r.adopt(SimpleNamespace(set_desired=lambda routes: None, programmed=list, reconciles_begun=0))
    return r, inputs, calls


def test_best_path_changes_during_the_initial_sync_share_one_recheck_timer(monkeypatch):
    r, _inputs, calls = recomputing(monkeypatch)
    for _ in range(20):  # a peer's updates, 50 ms apart
        r.on_best_paths([])
        r.loop.advance(0.05)
    calls.clear()
    r.loop.advance(2.0)
    assert len(calls) == 4  # one re-check per 0.5 s, not one chain per change
    assert len(r.loop.pending()) == 1


def test_the_recheck_timer_is_cancelled_once_the_initial_sync_is_done(monkeypatch):
    r, inputs, calls = recomputing(monkeypatch)
    r.schedule()
    r.loop.advance(0.0)
    assert len(r.loop.pending()) == 1
    inputs.peering.known = True  # a lone node, its registry read: done
    r.on_best_paths([])
    r.loop.advance(0.0)
    assert r.initial_sync_done
    assert r.loop.pending() == []
    calls.clear()
    r.loop.advance(5.0)
    assert calls == []


def test_the_speakers_selection_deferral_ends_by_end_of_rib_only_once_the_registry_is_read():
    # RFC 4724 §4.1 on the speaker's side: the agent starts its speaker before it has read its
    # peers from etcd; with none configured yet "every peer sent End-of-RIB" is no reason to
    # end the deferral.  The agent says when the peer set is known: the registry read.
    from agentd.daemon.agent import Agent
    from bgp.testing import make_speaker

    sp = make_speaker("10.0.0.1", 64512, restarting=True, peers_known=False)
    sp.start(0.0)

    class Service:
        def set_peers(self, peers):
            sp.set_peers(list(peers), 1.0)

        def set_listen_ranges(self, ranges):
            sp.set_listen_ranges(list(ranges), 1.0)

        def peers_configured(self):
            sp.peers_configured(1.0)

    agent = SimpleNamespace(service=Service(), peering=SimpleNamespace(known=False, peers=lambda cfg, cluster: []),
                            cfg=SimpleNamespace(bgp=SimpleNamespace(listen_ranges=[])), cluster=None)
    Agent._apply_peers(agent)  # a reload before the registry was read: external peers only
    assert sp.deferring
    agent.peering.known = True  # the snapshot: no other node, nobody to wait for
    Agent._apply_peers(agent)
    assert not sp.deferring


# --- a route re-learned before the data path that carries it is up ---------------------------


def test_a_previous_runs_route_stays_until_the_data_path_for_it_is_up():
    # A restart under load: BGP re-learns the peer's subnet and completes the initial sync
    # before the backend that peer needs (its VXLAN device here) is up again.  The route the
    # previous run left stays meanwhile; without it the node has no route to the peer's pods
    # and answers their packets "net unreachable" until the backend is up (CI: one ping lost
    # across a restart).  Once this run routes the subnet itself, the adopted route is gone for good.
    from ipaddress import IPv4Address, IPv4Interface, IPv4Network

    from agentd.kernel.forwarding import LocalPaths
    from agentd.kernel.netinfo import Underlay
    from agentd.kernel.route_model import Route
    from proto.nlri import network_to_prefix

    subnet = "10.244.2.0/24"
    peer = NodeRecord("n2", IPv4Address("10.0.0.2"), 64512, IPv4Network(subnet), False, None,
                      {"type": "vxlan", "vtep_mac": "aa:bb:cc:dd:ee:02", "vtep_ip": "10.244.2.0"})
    left = Route(dst=subnet, gateway="10.244.2.0", dev="agentd.vxlan", onlink=True)  # the previous run's
    desired = []
    paths = LocalPaths({"udp": "bpf"})  # our own backend is up; vxlan, which n2 needs, not yet
    tunnels = SimpleNamespace(paths=lambda: paths, available=lambda backend: None, apply=lambda *a, **k: None)
    inputs = SimpleNamespace(
        cfg=SimpleNamespace(network=SimpleNamespace(backend="udp", encap="always")), name="n1",
        peering=Peering("n1"), underlay=Underlay("eth0", 2, IPv4Interface("10.0.0.1/24"), 1500, (IPv4Network("10.0.0.0/24"),)),
        lease=object(), leases={4: SimpleNamespace(subnet=IPv4Network("10.244.1.0/24"))}, cluster=None,
        tunnels=tunnels, speaker=Speaker(), started_bgp=True, stopping=False)
    r = KernelRoutes(inputs)
    r.loop = FakeLoop()
    r.initial_sync_deadline = float("inf")
    r.adopt(SimpleNamespace(set_desired=desired.append, programmed=lambda: [left], reconciles_begun=0))
    inputs.peering.apply(NodeEvent("snapshot", nodes={"n2": peer}))
    inputs.speaker.peers["10.0.0.2"] = SimpleNamespace(state=State.ESTABLISHED)  # End-of-RIB in: synced
    r._bests[(1, network_to_prefix(IPv4Network(subnet)))] = SimpleNamespace(
        next_hop=IPv4Address("10.0.0.2"), source=SimpleNamespace(local=False, ibgp=True))

    r._program(inputs)
    assert r.initial_sync_done
    assert {x.dst: x for x in desired[-1]}.get(subnet) == left  # kept: nothing routes it yet

    paths = LocalPaths({"udp": "bpf", "vxlan": "vxlan-device"})  # the VXLAN device is up
    r._program(inputs)
    assert {x.dst: x for x in desired[-1]}[subnet] == Route(dst=subnet, gateway="10.244.2.0", dev="agentd.vxlan",
                                                            onlink=True)
    assert r._adopted == []
    paths = LocalPaths({"udp": "bpf"})  # should the data path go again later: no stale route comes back
    r._program(inputs)
    assert subnet not in {x.dst for x in desired[-1]}
