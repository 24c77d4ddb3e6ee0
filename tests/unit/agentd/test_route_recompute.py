"""KernelRoutes' passes: readiness only once a pass handed its routes to the programmer (a
failed one retried), the node-dependent work done only when the nodes change, recomputes
coalesced under a large table, withdrawals, a stop, adopted routes and the tunnels' pruning."""

from ipaddress import IPv4Address, IPv4Interface, IPv4Network
from types import SimpleNamespace

import agentd.daemon.routes as R
from agentd.daemon.mesh import Peering
from agentd.daemon.routes import KernelRoutes
from agentd.datastore.store import NodeEvent, NodeRecord
from agentd.kernel.forwarding import LocalPaths
from agentd.kernel.netinfo import Underlay
from agentd.kernel.route_model import Route
from bgp import State
from proto.nlri import network_to_prefix


class Loop:
    """call_soon/call_later on a clock the test moves; a callback may move it too (its cost)."""

    def __init__(self):
        self.now = 0.0
        self.timers = []  # [when, seq, callback, handle]
        self.seq = 0

    def call_soon(self, callback):
        return self.call_later(0.0, callback)

    def call_later(self, delay, callback):
        handle = SimpleNamespace(cancelled=False)
        handle.cancel = lambda: setattr(handle, "cancelled", True)
        self.seq += 1
        self.timers.append([self.now + delay, self.seq, callback, handle])
        return handle

    def pending(self):
        return [t for t in self.timers if not t[3].cancelled]

    def advance(self, seconds):
        end = self.now + seconds
        while True:
            due = sorted((t for t in self.pending() if t[0] <= end), key=lambda t: (t[0], t[1]))
            if not due:
                break
            self.timers.remove(due[0])
            self.now = max(self.now, due[0][0])
            due[0][2]()
        self.now = max(self.now, end)


class Programmer:
    def __init__(self, kernel=()):
        self.desired, self.sets = [], 0
        self.kernel = list(kernel)
        self.reconciles_begun = self.reconciled_upto = 0

    def set_desired(self, routes):
        self.desired = list(routes)
        self.sets += 1

    def programmed(self):
        return list(self.kernel)

    def reconcile(self):  # the periodic resync, with whatever desired set it holds
        self.reconciles_begun += 1
        self.reconciled_upto = self.reconciles_begun

    def dsts(self):
        return sorted(r.dst for r in self.desired)


def node(i):
    return NodeRecord(f"n{i}", IPv4Address(f"10.0.{i // 250}.{i % 250 + 2}"), 64512,
                      IPv4Network(f"10.{128 + i // 250}.{i % 250}.0/24"), False, None, {"type": "host-gw"})


def setup(nodes=(), kernel=(), apply=None, synced=True):
    """KernelRoutes with host-gw peers ``nodes`` (all Established, End-of-RIB in when ``synced``)."""
    applied = []

    def record(*args, **kwargs):
        applied.append(kwargs)
        if apply is not None:
            apply(*args, **kwargs)

    peering = Peering("n0")
    tunnels = SimpleNamespace(paths=lambda: LocalPaths({"host-gw": "route"}), available=lambda b: None, apply=record)
    speaker = SimpleNamespace(peers={}, initial_sync_pending=lambda: [] if synced else ["x"])
    inputs = SimpleNamespace(
        cfg=SimpleNamespace(network=SimpleNamespace(backend="host-gw", encap="always")), name="n0", peering=peering,
        underlay=Underlay("eth0", 2, IPv4Interface("10.0.0.1/16"), 1500, (IPv4Network("10.0.0.0/16"),)),
        lease=object(), leases={4: SimpleNamespace(subnet=IPv4Network("10.127.0.0/24"))}, cluster=None,
        tunnels=tunnels, speaker=speaker, started_bgp=True, stopping=False, masq=None)
    r = KernelRoutes(inputs)
    loop = r.loop = Loop()
    r.clock = lambda: loop.now
    r.initial_sync_deadline = float("inf")
    prog = Programmer(kernel)
    r.adopt(prog)
    peering.apply(NodeEvent("snapshot", nodes={n.name: n for n in nodes}))
    for n in nodes:
        speaker.peers[str(n.address)] = SimpleNamespace(state=State.ESTABLISHED)
    return r, inputs, prog, applied


def best(n, withdraw=False):
    new = None if withdraw else SimpleNamespace(next_hop=n.address, source=SimpleNamespace(local=False, ibgp=True))
    return SimpleNamespace(family=(1, 1), prefix=network_to_prefix(n.subnet), new=new)


OWN = "10.127.0.0/24"


def test_a_pass_that_fails_before_its_routes_are_set_leaves_the_sync_pending_and_is_retried():
    """tunnels.apply raising in the pass that completes the initial sync: before, the sync
    counted as done with the BGP routes never handed over (readiness true at the next
    reconcile, desired empty for good, nothing retried)."""
    fail = [True]

    def apply(*_a, **_k):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("transient failure in tunnels.apply")

    n1 = node(1)
    r, _inputs, prog, _applied = setup([n1], apply=apply)
    r.on_best_paths([best(n1)])
    r.loop.advance(0)
    prog.reconcile()
    assert not r.initial_sync_done and not r.reconciled()
    assert prog.dsts() == []
    r.loop.advance(1.0)  # the retry: no best-path change needed
    assert prog.dsts() == sorted([OWN, str(n1.subnet)])
    assert r.initial_sync_done and not r.reconciled()
    prog.reconcile()
    assert r.reconciled()
    assert r.loop.pending() == []  # no retry left once it worked


def test_a_failing_pass_is_retried_with_a_growing_delay():
    def apply(*_a, **_k):
        raise RuntimeError("down")

    r, _inputs, _prog, _applied = setup([node(1)], apply=apply)
    r.schedule()
    r.loop.advance(0)
    when = []
    for _ in range(4):
        (t,) = r.loop.pending()
        when.append(t[0] - r.loop.now)
        r.loop.advance(t[0] - r.loop.now)
    assert when == [0.5, 1.0, 2.0, 4.0]


def test_best_path_changes_alone_do_not_recompute_the_node_plans(monkeypatch):
    calls = []
    real = R.node_context

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(R, "node_context", counted)
    nodes = [node(i) for i in range(1, 21)]
    r, inputs, prog, _applied = setup(nodes)
    for n in nodes:
        r.on_best_paths([best(n)])
        r.loop.advance(0)
    assert len(calls) == 1
    assert prog.dsts() == sorted([OWN] + [str(n.subnet) for n in nodes])
    # A node event: its record changed (a new object), the plans are made again.
    moved = NodeRecord("n1", IPv4Address("10.0.0.99"), 64512, nodes[0].subnet, False, None, {"type": "host-gw"})
    inputs.peering.apply(NodeEvent("put", name="n1", record=moved))
    r.schedule()
    r.loop.advance(0)
    assert len(calls) == 2
    # Its best path's next hop is no node's now: an external router's, as far as routes go.
    assert r.plans[str(nodes[0].address)].node is None and r.plans["10.0.0.99"].node == "n1"
    # Even a record changed without schedule() (a best-path change comes first) is seen.
    inputs.peering.apply(NodeEvent("put", name="n1", record=nodes[0]))
    r.on_best_paths([best(nodes[1])])
    r.loop.advance(0)
    assert len(calls) == 3
    assert r.plans[str(nodes[0].address)].node == "n1" and "10.0.0.99" not in r.plans
    # schedule() alone (a backend's paths or availability changed) also makes them again.
    r.schedule()
    r.loop.advance(0)
    assert len(calls) == 4


def test_route_changes_one_per_loop_turn_are_coalesced_when_a_recompute_is_slow(monkeypatch):
    """Each recompute costs 10 ms (the clock moves in it); 200 UPDATEs come 1 ms apart, each
    its own loop turn: far fewer than 200 passes, the loop at most about half busy, all routes in."""
    real = R.desired_routes
    holder = {}

    def slow(*a, **k):
        holder["loop"].now += 0.010
        return real(*a, **k)

    monkeypatch.setattr(R, "desired_routes", slow)
    nodes = [node(i) for i in range(1, 201)]
    r, _inputs, prog, _applied = setup(nodes)
    holder["loop"] = r.loop
    start = r.loop.now
    for n in nodes:
        r.on_best_paths([best(n)])
        r.loop.advance(0.001)
    r.loop.advance(1.0)
    assert prog.dsts() == sorted([OWN] + [str(n.subnet) for n in nodes])
    busy = prog.sets * 0.010
    assert prog.sets < 200 / 4, prog.sets
    assert busy <= 0.6 * (r.loop.now - start - 1.0) + 0.02


def test_a_withdrawn_best_path_leaves_the_desired_routes():
    n1, n2 = node(1), node(2)
    r, _inputs, prog, _applied = setup([n1, n2])
    r.on_best_paths([best(n1), best(n2)])
    r.loop.advance(0)
    assert prog.dsts() == sorted([OWN, str(n1.subnet), str(n2.subnet)])
    r.on_best_paths([best(n1, withdraw=True)])
    r.loop.advance(0)
    assert prog.dsts() == sorted([OWN, str(n2.subnet)])
    assert str(n1.subnet) not in [row["dst"] for row in r.rows]


def test_while_stopping_no_best_path_change_touches_the_kernel_routes():
    """A graceful stop leaves the kernel as it is: the peers' routes going as the sessions
    close must not be removed."""
    n1 = node(1)
    r, inputs, prog, _applied = setup([n1])
    r.on_best_paths([best(n1)])
    r.loop.advance(0)
    sets = prog.sets
    inputs.stopping = True
    r.on_best_paths([best(n1, withdraw=True)])
    r.loop.advance(1.0)
    assert prog.sets == sets and str(n1.subnet) in prog.dsts()


def test_an_adopted_route_with_no_best_path_goes_once_the_sync_is_done():
    """A route a previous run left for a node that left meanwhile: kept while the sync is
    pending, gone after it (not kept for good)."""
    n1 = node(1)
    gone = Route(dst="10.200.0.0/24", gateway="10.0.0.77", dev="eth0")
    r, inputs, prog, applied = setup([n1], kernel=[gone], synced=False)
    r.on_best_paths([best(n1)])
    r.loop.advance(0)
    assert gone.dst in prog.dsts() and not r.initial_sync_done
    assert applied[-1]["prune"] is False  # the adopted routes' tunnel state stays meanwhile
    inputs.speaker.initial_sync_pending = list
    r.loop.advance(0.5)  # the re-check
    assert r.initial_sync_done
    assert gone.dst not in prog.dsts()
    assert applied[-1]["prune"] is True
    r.on_best_paths([best(n1)])
    r.loop.advance(0)
    assert gone.dst not in prog.dsts()


def test_the_wait_for_end_of_rib_is_bounded_by_a_short_restart_time(monkeypatch):
    r, _inputs, _prog, _applied = setup()
    monkeypatch.setattr(R.time, "monotonic", lambda: 100.0)
    r.bgp_started(5.0)
    assert r.initial_sync_deadline == 105.0
    r.bgp_started(600.0)
    assert r.initial_sync_deadline == 100.0 + R.INITIAL_SYNC_MAX


def test_a_backend_failing_after_the_node_plans_were_made_is_seen_at_the_next_best_path_change():
    """Tunnels tells of a backend's recovery (on_paths), not of every failure: a peer over a
    backend that failed to come up after the node context was cached kept its plan through it
    (its routes pending, a previous run's adopted route kept) while only best paths changed
    (review s57 r16)."""
    vx = NodeRecord("n1", IPv4Address("10.0.0.3"), 64512, IPv4Network("10.128.1.0/24"), False, None,
                    {"type": "vxlan", "vtep_mac": "02:00:00:00:00:01", "vni": 1})
    failed = {}
    r, inputs, _prog, _applied = setup([vx, node(2)])
    inputs.tunnels.available = lambda b: failed.get(b)
    r.schedule()
    r.loop.advance(0)
    assert r.plans["10.0.0.3"].backend == "vxlan"
    failed["vxlan"] = "cannot bring up vxlan: EEXIST"  # no schedule(), no on_paths()
    r.on_best_paths([best(vx), best(node(2))])
    r.loop.advance(0)
    assert r.plans["10.0.0.3"].backend == "none" and "cannot bring up vxlan" in r.plans["10.0.0.3"].reason


def test_the_retry_delay_starts_over_after_a_success_is_capped_and_a_success_cancels_the_retry():
    fail = [True]

    def apply(*_a, **_k):
        if fail[0]:
            raise RuntimeError("down")

    r, _inputs, _prog, _applied = setup([node(1)], apply=apply)
    r.schedule()
    r.loop.advance(0)
    for _ in range(10):  # 0.5, 1, 2, ... capped at RETRY_MAX
        (t,) = r.loop.pending()
        last = t[0] - r.loop.now
        r.loop.advance(last)
    assert last == R.RETRY_MAX
    # A best-path pass that succeeds before the pending retry: the retry is cancelled...
    fail[0] = False
    r.on_best_paths([best(node(1))])
    r.loop.advance(0)
    assert r.loop.pending() == []
    # ... and the next failure is retried after RETRY_FIRST again.
    fail[0] = True
    r.on_best_paths([best(node(1))])
    r.loop.advance(0)
    (t,) = r.loop.pending()
    assert t[0] - r.loop.now == R.RETRY_FIRST
