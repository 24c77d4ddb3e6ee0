"""GET /routes: "installed" is true only when the kernel holds the wanted route itself."""

from types import SimpleNamespace

import pytest

import agentd.daemon.routes as R
from agentd.daemon.routes import KernelRoutes
from agentd.kernel.route_model import Route

WANT = Route("10.244.7.0/24", gateway="10.0.0.7", dev="eth0")
WANT6 = Route("2001:db8:7::/64", gateway="fe80::7", dev="eth0")


class Programmer:
    """What KernelRoutes reads of the route programmer."""

    def __init__(self, kernel=(), failures=None):
        self.kernel = list(kernel)
        self.failures = dict(failures or {})

    def set_desired(self, routes):
        pass

    def programmed(self):
        return list(self.kernel)


@pytest.fixture
def routes(monkeypatch):
    def fake_desired(*args, **kwargs):
        rows = [{"dst": r.dst, "via": r.gateway, "dev": r.dev, "backend": "host-gw", "peer": r.gateway}
                for r in (WANT, WANT6)]
        return SimpleNamespace(routes=[WANT, WANT6], plans={}, plans_v6={}, rows=rows, next_hops={}, next_hops_v6={},
                               refused=[], untrusted=[], untrusted_next_hops=[], pending=[])

    monkeypatch.setattr(R, "desired_routes", fake_desired)
    tunnels = SimpleNamespace(paths=lambda: None, available=None, apply=lambda *a, **k: None)
    inputs = SimpleNamespace(
        cfg=SimpleNamespace(network=SimpleNamespace(backend="host-gw", encap="always")), name="n1",
        peering=SimpleNamespace(nodes={}, known=True), underlay=object(), lease=object(), leases={},
        tunnels=tunnels, speaker=None, started_bgp=False, stopping=False, cluster=None)

    def make(programmer):
        r = KernelRoutes(inputs)
        r.adopt(programmer)
        r.initial_sync_done = True
        r._recompute()
        return {row["dst"]: row["installed"] for row in r.installed()}

    return make


def test_the_wanted_routes_in_the_kernel_are_installed(routes):
    assert routes(Programmer([WANT, WANT6])) == {WANT.dst: True, WANT6.dst: True}


def test_an_older_route_for_the_destination_is_not_the_wanted_one(routes):
    # The replace by the new route was refused: the kernel still has the previous one.
    old = Route(WANT.dst, gateway="10.0.0.9", dev="eth0")
    old6 = Route(WANT6.dst, gateway="fe80::7", dev="eth0", metric=50)
    assert routes(Programmer([old, old6])) == {WANT.dst: False, WANT6.dst: False}


def test_a_refused_route_is_not_installed(routes):
    failures = {WANT.dst: "ENETUNREACH: Network is unreachable"}
    assert routes(Programmer([WANT, WANT6], failures)) == {WANT.dst: False, WANT6.dst: True}
    assert routes(Programmer([WANT6])) == {WANT.dst: False, WANT6.dst: True}


class TimerLoop:
    """call_later on a clock the test moves (KernelRoutes.loop)."""

    def __init__(self, clock):
        self.clock, self.timers = clock, []

    def call_soon(self, callback):
        return self.call_later(0.0, callback)

    def call_later(self, delay, callback):
        handle = SimpleNamespace(cancelled=False)
        handle.cancel = lambda: setattr(handle, "cancelled", True)
        self.timers.append((self.clock[0] + delay, callback, handle))
        return handle

    def run_due(self):
        due = [t for t in self.timers if t[0] <= self.clock[0]]
        self.timers = [t for t in self.timers if t[0] > self.clock[0]]
        for _, callback, handle in due:
            if not handle.cancelled:
                callback()


def _refusing_routes(monkeypatch):
    """KernelRoutes with node b's routes, one the default route (refused), on a clock and a
    loop the test moves."""
    from ipaddress import IPv4Address, IPv4Interface, IPv4Network

    from agentd.datastore.store import ClusterConfig, NodeRecord
    from agentd.kernel.forwarding import LocalPaths
    from agentd.kernel.netinfo import Underlay

    b = NodeRecord("b", IPv4Address("10.0.0.2"), 64512, IPv4Network("10.244.2.0/24"), False, None, {})
    underlay = Underlay("eth0", 2, IPv4Interface("10.0.0.3/24"), 1500, (IPv4Network("10.0.0.0/24"),))
    tunnels = SimpleNamespace(paths=LocalPaths, available=lambda b: None, apply=lambda *a, **k: None)
    inputs = SimpleNamespace(
        cfg=SimpleNamespace(network=SimpleNamespace(backend="host-gw", encap="always")), name="n1",
        peering=SimpleNamespace(nodes={"b": b}, known=True), underlay=underlay, lease=object(),
        leases={4: SimpleNamespace(subnet=IPv4Network("10.244.1.0/24"))}, tunnels=tunnels, speaker=None,
        started_bgp=False, stopping=False, cluster=ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "host-gw", "always"))
    r = KernelRoutes(inputs)
    clock = [1000.0]
    r.clock = lambda: clock[0]
    r.adopt(Programmer())
    r.initial_sync_done = True
    nh = SimpleNamespace(next_hop=IPv4Address("10.0.0.2"), source=SimpleNamespace(local=False, ibgp=True))
    r._bests = {(1, b"default"): nh, (1, b"b"): nh}
    names = {b"default": "0.0.0.0/0", b"b": "10.244.2.0/24"} | {b"x%d" % i: f"192.168.{i}.0/24" for i in range(5)}
    monkeypatch.setattr(R, "prefix_to_str", lambda afi, p: names[p])
    r.loop = TimerLoop(clock)
    return r, clock, nh


def test_a_refused_best_path_is_listed_with_its_reason_and_logged_once_and_flaps_at_most_once_a_minute_per_peer(
    monkeypatch, caplog
):
    r, clock, nh = _refusing_routes(monkeypatch)
    for _ in range(3):
        r._recompute()
    rows = {row["dst"]: row for row in r.installed()}
    assert rows["0.0.0.0/0"]["installed"] is False and rows["0.0.0.0/0"]["backend"] == "refused"
    assert "outside the cluster's pod network (10.244.0.0/16)" in rows["0.0.0.0/0"]["reason"]
    assert rows["10.244.2.0/24"]["backend"] == "host-gw"
    logged = [m for m in caplog.messages if "not installed" in m]
    assert logged == [("route to 0.0.0.0/0 via 10.0.0.2 not installed: node b announced 0.0.0.0/0, outside the "
                       "cluster's pod network (10.244.0.0/16)")]
    for _ in range(10):  # a flapping router: gone and back, again and again
        del r._bests[(1, b"default")]
        r._recompute()
        r._bests[(1, b"default")] = nh
        r._recompute()
    assert len([m for m in caplog.messages if "not installed" in m]) == 1  # at most once a minute per peer
    clock[0] += 60.0
    del r._bests[(1, b"default")]
    r._recompute()
    r._bests[(1, b"default")] = nh
    r._recompute()  # gone and back a minute later: logged again, with those held back
    logged = [m for m in caplog.messages if "not installed" in m]
    assert len(logged) == 2 and logged[1].endswith("(10 similar suppressed in the last 60s)"), logged
    # Routes newly refused are each logged at once, however many in one recompute, and though
    # that peer's flap was logged just now.
    for i in range(5):
        r._bests[(1, b"x%d" % i)] = nh
    r._recompute()
    logged = [m for m in caplog.messages if "not installed" in m][2:]
    assert logged == [f"route to 192.168.{i}.0/24 via 10.0.0.2 not installed: node b announced 192.168.{i}.0/24, "
                      "outside the cluster's pod network (10.244.0.0/16)" for i in range(5)], logged
    # What it remembers of refusals past goes an hour after they ended.
    for key in [k for k in r._bests if k != (1, b"b")]:
        del r._bests[key]
    r._recompute()
    clock[0] += 3600.0
    r._recompute()
    assert r._refused_at == {} and r._refusing_peers == set()


def test_a_recompute_that_fails_keeps_the_routes_and_is_one_log_line_until_it_changes(monkeypatch, caplog):
    """Should computing the routes fail for a reason no best path or record is refused for,
    _recompute (a loop callback) raises nothing: the programmed routes stay, one error line is
    logged (not one per recompute), and one line when it works again.  A best path the speaker
    gave in a form that is not a prefix is left out (logged once); the others are routed."""
    import logging
    from ipaddress import IPv4Address

    caplog.set_level(logging.INFO, logger="agentd")
    calls = []

    def failing(*args, **kwargs):
        raise RuntimeError("no route shape for datapath 'x'")

    monkeypatch.setattr(R, "desired_routes", failing)
    programmer = Programmer()
    programmer.set_desired = calls.append
    tunnels = SimpleNamespace(paths=lambda: None, available=None, apply=lambda *a, **k: None)
    inputs = SimpleNamespace(
        cfg=SimpleNamespace(network=SimpleNamespace(backend="host-gw", encap="always")), name="n1",
        peering=SimpleNamespace(nodes={}, known=True), underlay=object(), lease=object(), leases={},
        tunnels=tunnels, speaker=None, started_bgp=False, stopping=False, cluster=None)
    r = KernelRoutes(inputs)
    r.loop = TimerLoop([0.0])
    r.adopt(programmer)
    r.initial_sync_done = True
    calls.clear()
    for _ in range(3):
        r._recompute()
    assert calls == []  # the routes programmed stay
    errors = [m for m in caplog.messages if "routes not recomputed" in m]
    assert errors == [("routes not recomputed (RuntimeError: no route shape for datapath 'x'): the routes programmed "
                       "stay as they are; tried again in 0.5 s")]
    assert len(r.loop.timers) == 1  # one retry, however many passes failed

    seen = []

    def fake_desired(bests, *args, **kwargs):
        seen.append(list(bests))
        return SimpleNamespace(routes=[WANT], plans={}, plans_v6={}, rows=[], next_hops={}, next_hops_v6={}, refused=[], untrusted=[], untrusted_next_hops=[])

    def to_str(afi, prefix):
        if prefix == b"bad":
            raise ValueError("malformed wire prefix 626164 for AFI 1")
        return "10.244.7.0/24"

    monkeypatch.setattr(R, "desired_routes", fake_desired)
    monkeypatch.setattr(R, "prefix_to_str", to_str)
    nh = SimpleNamespace(next_hop=IPv4Address("10.0.0.7"), source=SimpleNamespace(local=False, ibgp=True))
    r._bests = {(1, b"bad"): nh, (1, b"good"): nh}
    r._recompute()
    r._recompute()
    assert calls == [[WANT], [WANT]] and seen[-1] == [("10.244.7.0/24", nh.next_hop, False, True)]
    assert caplog.messages.count("routes recomputed again") == 1
    assert len([m for m in caplog.messages if "not routed: malformed wire prefix" in m]) == 1


def test_the_count_of_refusals_held_back_is_logged_when_the_minute_ends_without_another(monkeypatch, caplog):
    r, clock, nh = _refusing_routes(monkeypatch)
    r._recompute()
    for _ in range(4):  # a flapping router, then quiet: no refusal comes to carry the count
        del r._bests[(1, b"default")]
        r._recompute()
        r._bests[(1, b"default")] = nh
        r._recompute()
    assert len([m for m in caplog.messages if "not installed" in m]) == 1
    clock[0] += 60.0
    r.loop.run_due()
    assert [m for m in caplog.messages if "routes not recomputed" in m] == []
    last = [m for m in caplog.messages if "not installed" in m][-1]
    assert last.startswith("4 similar suppressed in the last 60s, the last: route to 0.0.0.0/0 via 10.0.0.2"), last


def test_a_record_naming_a_subnet_of_another_length_refuses_no_route_and_is_logged_once(monkeypatch, caplog):
    """Node w's record names 10.244.0.0/16, inside the pod network but not a /24 (the cluster's
    subnet length): b's route inside it used to be refused as "overlaps node w's subnet"."""
    from ipaddress import IPv4Address, IPv4Network

    from agentd.datastore.store import NodeRecord

    r, _clock, _nh = _refusing_routes(monkeypatch)
    r.inputs.peering.nodes["w"] = NodeRecord("w", IPv4Address("10.0.0.5"), 64512, IPv4Network("10.244.0.0/16"),
                                             False, None, {})
    for _ in range(3):
        r._recompute()
    rows = {row["dst"]: row for row in r.installed()}
    assert rows["10.244.2.0/24"]["backend"] == "host-gw"
    logged = [m for m in caplog.messages if "record names" in m]
    assert logged == [("node w's record names subnet 10.244.0.0/16, not a /24, the cluster's subnet length: not taken "
                       "as its subnet (its routes are held to the pod network only, and no other node's route is "
                       "refused for it)")]
