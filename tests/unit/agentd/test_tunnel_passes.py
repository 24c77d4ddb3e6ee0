"""How often the tunnels' sync loop makes a whole pass, and the BPF redirect's hold written
again after a write that failed or was cancelled (no kernel: the data path's writes stubbed)."""

import asyncio
from ipaddress import IPv4Interface, IPv4Network
from types import SimpleNamespace
from typing import ClassVar

import pytest

from agentd.config.settings import load_config
from agentd.dataplane import backends as backends_mod
from agentd.dataplane.backends import GATEWAY_REFRESH, Tunnels
from agentd.dataplane.bpf_backend import BpfPath, InBpf
from agentd.kernel.forwarding import PeerPlan
from agentd.kernel.netinfo import Underlay

CFG = load_config(None, env={}, overrides={"node.address": "10.0.0.3", "node.name": "n3"})
UNDERLAY = Underlay("eth0", 2, IPv4Interface("10.0.0.3/24"), 1500, (IPv4Network("10.0.0.0/24"),))


def _on_link_plans() -> dict:
    return {a: PeerPlan(a, "udp", "test", node=n) for a, n in (("10.0.0.4", "n4"), ("10.0.0.5", "n5"))}


def test_a_cluster_on_one_segment_gets_a_whole_tunnel_pass_every_gateway_refresh_not_every_refresh(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(backends_mod.time, "monotonic", lambda: clock[0])

    async def main():
        t = Tunnels(CFG, UNDERLAY, "n3")
        t.bpf.carried.add("udp")
        t._plans = plans = _on_link_plans()  # every peer on this segment: no next hop to re-read
        await t._resolve_gateways(plans)  # what the sync loop's pass does
        t._dirty.clear()
        for _ in range(5):  # the readiness loop, every 2 s
            clock[0] += 2.0
            await t.refresh()
            assert not t._dirty.is_set(), "a whole tunnel pass asked for at a readiness tick"
        clock[0] += GATEWAY_REFRESH
        await t.refresh()
        assert t._dirty.is_set()  # the periodic pass is still made, every GATEWAY_REFRESH

    asyncio.run(main())


class _Failing(Exception):
    pass


def _bpf_with_stub_datapath(writes: list, fail: list) -> BpfPath:
    bpf = BpfPath(CFG, UNDERLAY)

    def set_config(config, *, keep, clear):
        if fail:
            raise fail.pop()
        writes.append(bpf.redirect_held)

    bpf.dp = SimpleNamespace(set_config=set_config)
    bpf._written_held = False  # as the data path's first config wrote it (nobody holding)
    return bpf


def test_a_failed_hold_write_is_made_by_the_retry():
    writes: list = []

    async def main():
        bpf = _bpf_with_stub_datapath(writes, [_Failing("map update failed")])
        with pytest.raises(_Failing):
            await bpf.hold_redirect(True, "policy")
        assert writes == []
        await bpf.hold_redirect(True, "policy")  # the policy agent's retry
        assert writes == [True]
        await bpf.hold_redirect(True, "policy")  # nothing new: no write
        assert writes == [True]

    asyncio.run(main())


def test_a_hold_cancelled_while_waiting_for_the_lock_is_written_by_the_next_call():
    writes: list = []

    async def main():
        bpf = _bpf_with_stub_datapath(writes, [])
        await bpf._lock.acquire()  # a tunnel pass writing meanwhile
        waiting = asyncio.ensure_future(bpf.hold_redirect(True, "services"))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        bpf._lock.release()
        assert writes == [] and bpf.redirect_held
        await bpf.hold_redirect(True, "services")
        assert writes == [True]
        await bpf.hold_redirect(False, "services")
        assert writes == [True, False]

    asyncio.run(main())


class _Flaky:
    """A data path whose ``up`` fails the first ``fails`` times, half-making its device."""

    datapath = "vxlan-device"
    fails = 2
    ups: ClassVar[list] = []
    discarded: ClassVar[list] = []

    def __init__(self, t, name):
        self.name = name

    async def up(self, subnet):
        _Flaky.ups.append(self)
        if len(_Flaky.ups) <= _Flaky.fails:
            raise OSError(17, "creating vxlan device agentd.vxlan: File exists (another device holds VNI 1 on its port)")

    async def discard(self):
        _Flaky.discarded.append(self)

    def data(self):
        return {}


def test_a_backend_that_failed_to_come_up_is_tried_again_with_back_off_and_then_runs(monkeypatch):
    """flannel.1 holds VNI 1 during a migration: agentd.vxlan cannot be made (EEXIST).  Once it
    is gone the backend comes up -- it used to stay failed (its peers unroutable) until a restart;
    what each failed try made is taken away."""
    clock = [1000.0]
    monkeypatch.setattr(backends_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setitem(backends_mod.IMPLEMENTATIONS, "vxlan-device", _Flaky)
    monkeypatch.setattr(_Flaky, "ups", [])
    monkeypatch.setattr(_Flaky, "discarded", [])
    paths = []

    async def main():
        t = Tunnels(CFG, UNDERLAY, "n3", on_paths=lambda: paths.append(1))
        t.subnet = IPv4Network("10.244.3.0/24")

        async def bpf_up(**kw):
            pass

        t.bpf.up = bpf_up
        await t._ensure("vxlan")
        assert "File exists" in t.available("vxlan") and _Flaky.discarded == _Flaky.ups
        await t._ensure("vxlan")  # the sync loop's next pass, at once: not tried again yet
        assert len(_Flaky.ups) == 1
        clock[0] += backends_mod.RETRY_FIRST
        t._dirty.clear()
        await t.refresh()
        assert t._dirty.is_set(), "a retry due does not wake the sync loop"
        await t._ensure("vxlan")
        assert len(_Flaky.ups) == 2 and t.available("vxlan") is not None
        clock[0] += backends_mod.RETRY_FIRST  # the delay doubled: not yet
        await t._ensure("vxlan")
        assert len(_Flaky.ups) == 2
        clock[0] += backends_mod.RETRY_FIRST
        await t._ensure("vxlan")
        assert len(_Flaky.ups) == 3 and t.available("vxlan") is None and t.failed == {}
        assert t.active["vxlan"] is _Flaky.ups[-1] and len(_Flaky.discarded) == 2
        assert paths == [1], "the routes of its peers are not recomputed"

    asyncio.run(main())


def test_the_retry_delay_doubles_up_to_its_limit_and_a_success_resets_it():
    r = backends_mod._Retries()
    delays = [r.failed("vxlan", 0.0) for _ in range(9)]
    assert delays[:3] == [backends_mod.RETRY_FIRST, 2 * backends_mod.RETRY_FIRST, 4 * backends_mod.RETRY_FIRST]
    assert max(delays) == delays[-1] == backends_mod.RETRY_MAX
    assert not r.due("vxlan", 1.0) and r.due("vxlan", backends_mod.RETRY_MAX)
    r.succeeded("vxlan")
    assert r.due("vxlan", 0.0) and r.failed("vxlan", 0.0) == backends_mod.RETRY_FIRST


# The sync loop's passes (Tunnels._pass), the plans made as the route computation makes them --
# a peer whose backend failed here planned "none" (Tunnels.available) -- and the kernel's parts
# stubbed: the BPF data path's writes, a previous run's leftovers (never looked for here).

MAC4 = "02:00:00:00:00:04"


def _record(name: str, address: str, n: int, **backend):
    from ipaddress import ip_address, ip_network

    from agentd.datastore.store import NodeRecord

    return NodeRecord(name=name, address=ip_address(address), asn=64512, subnet=ip_network(f"10.244.{n}.0/24"),
                      route_reflector=False, cluster_id=None, backend=backend)


def _vxlan_peer():
    return _record("n4", "10.0.0.4", 4, type="vxlan", vtep_ip="10.244.4.0", vtep_mac=MAC4, datapath="bpf")


def _udp_peers():
    """n4 runs udp in its user-space worker (a BPF node needs a worker of its own to speak to
    it), n5 in BPF."""
    return [_record("n4", "10.0.0.4", 4, type="udp", datapath="userspace"),
            _record("n5", "10.0.0.5", 5, type="udp", datapath="bpf")]


def _apply(t: Tunnels, records) -> dict:
    """What the route computation hands the tunnels for ``records`` (every node but this one)."""
    from agentd.kernel.forwarding import plan_peer

    plans = {str(r.address): plan_peer(r, UNDERLAY, own_backend=t.cfg.network.backend, encap=t.cfg.network.encap,
                                       available=t.available, paths=t.paths()) for r in records}
    t.apply(plans, {}, {r.name: r for r in records})
    return plans


def _stubbed_tunnels(paths: list, cfg=CFG) -> Tunnels:
    t = Tunnels(cfg, UNDERLAY, "n3", on_paths=lambda: paths.append(1))
    t.subnet = IPv4Network("10.244.3.0/24")
    t._leftovers_removed = True

    async def nothing(*args, **kw):
        pass

    t.bpf.up = t.bpf.sync = t.bpf.refresh = nothing
    return t


class _Vtep(_Flaky):
    async def sync(self, plans, next_hops, prune):
        pass


def test_a_failed_backend_whose_peers_are_planned_none_is_tried_again_by_the_sync_loop(monkeypatch):
    """Its peers are planned "none" while it is failed (no plan names it): the pass tries it
    again all the same once its retry is due, and their routes are recomputed when it is up."""
    clock = [1000.0]
    monkeypatch.setattr(backends_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setitem(backends_mod.IMPLEMENTATIONS, "vxlan-device", _Vtep)
    monkeypatch.setattr(_Flaky, "fails", 1)
    monkeypatch.setattr(_Flaky, "ups", [])
    monkeypatch.setattr(_Flaky, "discarded", [])
    paths: list = []

    async def main():
        t = _stubbed_tunnels(paths)
        assert _apply(t, [_vxlan_peer()])["10.0.0.4"].backend == "vxlan"
        await t._pass()
        assert len(_Flaky.ups) == 1 and t.available("vxlan") is not None
        plans = _apply(t, [_vxlan_peer()])  # the routes recomputed: the peer has none now
        assert plans["10.0.0.4"].backend == "none" and "File exists" in plans["10.0.0.4"].reason
        await t._pass()
        assert len(_Flaky.ups) == 1  # not due yet
        clock[0] += backends_mod.RETRY_FIRST
        t._dirty.clear()
        await t.refresh()
        assert t._dirty.is_set()
        await t._pass()
        assert len(_Flaky.ups) == 2, "the failed backend is not tried again"
        assert t.active["vxlan"] is _Flaky.ups[-1] and t.failed == {} and paths == [1]
        assert _apply(t, [_vxlan_peer()])["10.0.0.4"].backend == "vxlan"

    asyncio.run(main())


def _worker_up_fails(monkeypatch, times: int) -> list:
    """_Worker.up fails its first ``times`` calls (the port taken), then succeeds."""
    ups: list = []

    async def up(self, subnet):
        ups.append(self)
        if len(ups) <= times:
            raise OSError(98, "binding udp port 8285: Address already in use")

    async def nothing(self, *args):
        pass

    monkeypatch.setattr(backends_mod._Worker, "up", up)
    for name in ("discard", "sync", "refresh_stats"):
        monkeypatch.setattr(backends_mod._Worker, name, nothing)
    return ups


def test_a_user_space_worker_that_failed_to_start_is_tried_again_by_the_sync_loop(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(backends_mod.time, "monotonic", lambda: clock[0])
    ups = _worker_up_fails(monkeypatch, 1)
    paths: list = []

    async def main():
        t = _stubbed_tunnels(paths)
        t.active["udp"] = InBpf(t, "udp")
        _apply(t, _udp_peers())
        await t._pass()
        assert len(ups) == 1 and "Address already in use" in t.helper_failed["udp"]
        await t._pass()
        assert len(ups) == 1  # not due yet
        clock[0] += backends_mod.RETRY_FIRST
        t._dirty.clear()
        await t.refresh()
        assert t._dirty.is_set()
        await t._pass()
        assert len(ups) == 2, "the worker is not tried again"
        assert t.helpers["udp"] is ups[-1] and t.helper_failed == {} and paths == [1]

    asyncio.run(main())


def _ticks_asking_for_a_pass(t: Tunnels, clock: list, seconds: float) -> list:
    """The readiness loop's refresh every 2 s for ``seconds``: the times it asked for a whole pass."""
    async def ticks():
        asked = []
        t._dirty.clear()
        for _ in range(int(seconds // 2)):
            clock[0] += 2.0
            await t.refresh()
            if t._dirty.is_set():
                asked.append(clock[0])
                t._dirty.clear()
                await t._pass()
        return asked

    return ticks()


def test_a_worker_no_peer_needs_any_more_is_not_tried_again(monkeypatch):
    """The peer that needed the worker leaves while the worker cannot start: it is no longer
    tried nor reported, and the readiness ticks stop asking for whole passes (they asked for
    one each time its retry fell due, forever)."""
    clock = [1000.0]
    monkeypatch.setattr(backends_mod.time, "monotonic", lambda: clock[0])
    ups = _worker_up_fails(monkeypatch, 1000)

    async def main():
        t = _stubbed_tunnels([])
        t.active["udp"] = InBpf(t, "udp")
        _apply(t, _udp_peers())
        await t._pass()
        assert t.helper_failed
        _apply(t, _udp_peers()[1:])  # n4 leaves: n5 runs udp in BPF, no worker needed
        await t._pass()
        assert await _ticks_asking_for_a_pass(t, clock, GATEWAY_REFRESH - 1) == []
        assert t.helper_failed == {} and t.status()["userspace_peers_worker_failed"] == {}
        assert len(ups) == 1

    asyncio.run(main())


def test_a_failed_backend_no_peer_names_any_more_is_forgotten(monkeypatch):
    """Its last peer leaves while it is failed: no longer tried (a success would make a device
    nobody uses) nor reported; a peer that names it later has it tried at once."""
    clock = [1000.0]
    monkeypatch.setattr(backends_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setitem(backends_mod.IMPLEMENTATIONS, "vxlan-device", _Vtep)
    monkeypatch.setattr(_Flaky, "fails", 1000)
    monkeypatch.setattr(_Flaky, "ups", [])
    monkeypatch.setattr(_Flaky, "discarded", [])

    async def main():
        t = _stubbed_tunnels([])
        _apply(t, [_vxlan_peer()])
        await t._pass()
        assert t.available("vxlan") is not None
        _apply(t, [])  # it leaves
        await t._pass()
        assert await _ticks_asking_for_a_pass(t, clock, backends_mod.RETRY_MAX + 10) == []
        assert len(_Flaky.ups) == 1
        assert t.available("vxlan") is None and t.status()["failed"] == {}
        assert _apply(t, [_vxlan_peer()])["10.0.0.4"].backend == "vxlan"  # it comes back
        await t._pass()
        assert len(_Flaky.ups) == 2

    asyncio.run(main())


def test_a_failed_backend_named_only_by_peers_reached_directly_is_forgotten(monkeypatch):
    """cross-subnet: n4 (another segment) needs VXLAN, n5 (on this segment) names it too but is
    reached directly.  VXLAN cannot come up; n4 leaves: nothing needs VXLAN any more, so it is
    no longer tried (n5's record still naming it kept it tried, and reported, forever); n4
    back has it tried at once."""
    clock = [1000.0]
    monkeypatch.setattr(backends_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setitem(backends_mod.IMPLEMENTATIONS, "vxlan-device", _Vtep)
    monkeypatch.setattr(_Flaky, "fails", 1000)
    monkeypatch.setattr(_Flaky, "ups", [])
    monkeypatch.setattr(_Flaky, "discarded", [])
    cfg = load_config(None, env={}, overrides={"node.address": "10.0.0.3", "node.name": "n3",
                                               "network.backend": "udp", "network.encap": "cross-subnet"})
    far = _record("n4", "10.0.1.4", 4, type="vxlan", vtep_ip="10.244.4.0", vtep_mac=MAC4, datapath="bpf")
    near = _record("n5", "10.0.0.5", 5, type="vxlan", vtep_ip="10.244.5.0", vtep_mac="02:00:00:00:00:05",
                   datapath="bpf")

    async def main():
        t = _stubbed_tunnels([], cfg)
        assert _apply(t, [far, near])["10.0.1.4"].backend == "vxlan"
        await t._pass()
        assert t.available("vxlan") is not None and len(_Flaky.ups) == 1
        assert _apply(t, [near])["10.0.0.5"].backend == "host-gw"  # n4 leaves
        await t._pass()
        # (the passes asked for are GATEWAY_REFRESH's periodic ones only: n5 has a plan)
        asked = await _ticks_asking_for_a_pass(t, clock, backends_mod.RETRY_MAX + 10)
        assert len(asked) <= (backends_mod.RETRY_MAX + 10) // GATEWAY_REFRESH
        assert len(_Flaky.ups) == 1, "a backend only a peer reached directly names is tried again"
        assert t.available("vxlan") is None and t.status()["failed"] == {}
        assert _apply(t, [far, near])["10.0.1.4"].backend == "vxlan"  # n4 comes back
        await t._pass()
        assert len(_Flaky.ups) == 2

    asyncio.run(main())


# A user-space worker no peer needs any more stops (its process, socket and TUN device go) and
# starts again when a peer needs one.  The workers' process side stubbed: what was started and
# stopped is recorded.

USERSPACE = load_config(None, env={}, overrides={"node.address": "10.0.0.3", "node.name": "n3",
                                                 "network.datapath": "userspace"})


class _PortSocket:
    closed = False

    def close(self):
        self.closed = True


class _AnsweringClient:
    async def stats(self):
        return {}


def _recorded_workers(monkeypatch, stubbed=("sync", "refresh_stats")) -> SimpleNamespace:
    seen = SimpleNamespace(ups=[], downs=[], leftovers=[], ports=[])

    async def up(self, subnet):
        seen.ups.append(self)
        seen.ports.append(self.port_socket)
        self.port_socket = self.port_socket or _PortSocket()
        self.client = _AnsweringClient()

    async def down(self, remove, *, keep_port=False):
        seen.downs.append((self, remove))
        self.client = None

    async def nothing(self, *args):
        pass

    async def leftovers(state_dir, kinds=("udp", "ipip")):
        seen.leftovers.append(list(kinds))
        return []

    monkeypatch.setattr(backends_mod._Worker, "up", up)
    monkeypatch.setattr(backends_mod._Worker, "down", down)
    for name in stubbed:
        monkeypatch.setattr(backends_mod._Worker, name, nothing)
    monkeypatch.setattr(backends_mod, "remove_worker_leftovers", leftovers)
    return seen


def _udp_peer(name="n4", address="10.0.0.4", n=4):
    return _record(name, address, n, type="udp", datapath="userspace")


def _apply_pruning(t: Tunnels, records, *, prune=True) -> dict:
    from agentd.kernel.forwarding import plan_peer

    plans = {str(r.address): plan_peer(r, UNDERLAY, own_backend=t.cfg.network.backend, encap=t.cfg.network.encap,
                                       available=t.available, paths=t.paths()) for r in records}
    t.apply(plans, {}, {r.name: r for r in records}, prune=prune)
    return plans


def test_a_user_space_worker_stops_once_its_last_peer_leaves_and_starts_again_when_one_comes_back(monkeypatch):
    """A host-gw node reaches its udp peers through a worker of its own: once they have all
    left, the worker stops -- its process, its TUN device and its files go, the port is
    released (it ran on for nothing) -- and the routes are recomputed; a udp peer back has one
    started again.  Not before BGP has re-learned every route after a restart (prune False)."""
    seen = _recorded_workers(monkeypatch)
    paths: list = []

    async def main():
        t = _stubbed_tunnels(paths, USERSPACE)
        _apply_pruning(t, [_udp_peer(), _udp_peer("n5", "10.0.0.5", 5)])
        await t._pass()
        assert len(seen.ups) == 1 and t.active["udp"] is seen.ups[0]
        _apply_pruning(t, [_udp_peer("n5", "10.0.0.5", 5)])  # n4 leaves: n5 still needs it
        await t._pass()
        assert seen.downs == [] and "udp" in t.active
        _apply_pruning(t, [], prune=False)  # (a restart's first passes: nothing removed)
        await t._pass()
        assert seen.downs == [] and "udp" in t.active
        paths.clear()
        _apply_pruning(t, [])  # n5 leaves too
        await t._pass()
        assert seen.downs == [(seen.ups[0], True)], "the worker no peer needs runs on"
        assert seen.leftovers == [["udp"]]  # (what a worker that had died would have left)
        assert "udp" not in t.active and "udp" not in t.status()["active"] and paths
        assert seen.ups[0].retired
        await t._pass()
        assert len(seen.downs) == 1
        _apply_pruning(t, [_udp_peer()])  # n4 comes back
        await t._pass()
        assert len(seen.ups) == 2 and t.active["udp"] is seen.ups[1] and not seen.ups[1].retired

    asyncio.run(main())


def test_a_worker_is_kept_when_a_peer_leaves_and_another_arrives_in_one_pass(monkeypatch):
    """n4 leaves and n6 (udp too) arrives in the same recompute, or in one made while the pass
    runs: the worker n6 needs is not stopped under it."""
    seen = _recorded_workers(monkeypatch)

    async def main():
        t = _stubbed_tunnels([], USERSPACE)
        _apply_pruning(t, [_udp_peer()])
        await t._pass()
        _apply_pruning(t, [_udp_peer("n6", "10.0.0.6", 6)])
        await t._pass()
        assert seen.downs == [] and t.active["udp"] is seen.ups[0]
        # n6 leaves, and n7 arrives while the pass that would stop the worker is under way.
        _apply_pruning(t, [])
        ensure_helpers = t._ensure_helpers

        async def recompute_meanwhile(plans):
            await ensure_helpers(plans)
            _apply_pruning(t, [_udp_peer("n7", "10.0.0.7", 7)])

        t._ensure_helpers = recompute_meanwhile
        await t._pass()
        assert seen.downs == [] and t.active["udp"] is seen.ups[0] and len(seen.ups) == 1

    asyncio.run(main())


def test_our_own_backends_worker_stays_without_peers(monkeypatch):
    """Peers must be able to reach us: our own backend's worker runs while we do (flannel0
    stays while flanneld runs), whoever our peers are."""
    seen = _recorded_workers(monkeypatch)
    cfg = load_config(None, env={}, overrides={"node.address": "10.0.0.3", "node.name": "n3",
                                               "network.backend": "udp", "network.datapath": "userspace"})

    async def main():
        t = _stubbed_tunnels([], cfg)
        await t._ensure("udp")  # (what start does)
        _apply_pruning(t, [_udp_peer()])
        await t._pass()
        _apply_pruning(t, [])
        await t._pass()
        assert seen.downs == [] and t.active["udp"] is seen.ups[0]

    asyncio.run(main())


def test_a_worker_beside_bpf_stops_once_no_peer_receives_in_user_space(monkeypatch):
    """udp runs in BPF here; n4 runs it in user space, so a worker speaks to it.  n4 leaves
    (n5, in BPF, stays): the worker stops and the BPF peers' routes are recomputed; n4 back
    has one started again."""
    seen = _recorded_workers(monkeypatch)
    paths: list = []

    async def main():
        t = _stubbed_tunnels(paths)
        t.active["udp"] = InBpf(t, "udp")
        _apply_pruning(t, _udp_peers())
        await t._pass()
        assert t.helpers["udp"] is seen.ups[0]
        paths.clear()
        _apply_pruning(t, _udp_peers()[1:])
        await t._pass()
        assert seen.downs == [(seen.ups[0], True)] and t.helpers == {} and paths
        assert t.status()["userspace_peers_worker"] == {} and t.paths().helpers == frozenset()
        assert isinstance(t.active["udp"], InBpf)  # (our own backend, in BPF, stays)
        _apply_pruning(t, _udp_peers())
        await t._pass()
        assert len(seen.ups) == 2 and t.helpers["udp"] is seen.ups[1]

    asyncio.run(main())


def test_a_stopped_workers_refresh_does_not_start_it_again_and_its_drops_stay_counted(monkeypatch):
    """The readiness loop's refresh may hold a worker the pass has just stopped: it must not
    take the worker for dead and start another (one nobody would ever stop).  What the stopped
    worker dropped stays in agentd_dataplane_drops, and the next worker counts on from it."""
    _recorded_workers(monkeypatch, stubbed=("sync",))  # the real refresh_stats
    reconnects: list = []

    async def reconnect(self):
        reconnects.append(self)

    monkeypatch.setattr(backends_mod._Worker, "_reconnect", reconnect)

    async def main():
        t = _stubbed_tunnels([], USERSPACE)
        _apply_pruning(t, [_udp_peer()])
        await t._pass()
        worker = t.active["udp"]
        worker._counted = (1234, {"not_member": 7})
        _apply_pruning(t, [])
        await t._pass()
        assert "udp" not in t.active
        await worker.refresh_stats()  # (the refresh's copy of the workers held it)
        assert reconnects == [], "a worker stopped for want of peers is started again"

        def drops() -> dict:
            (family,) = [f for f in backends_mod.dataplane_metrics(t) if f.name == "agentd_dataplane_drops"]
            return {tuple(s.labels.values()): s.value for s in family.samples if s.labels["datapath"] == "userspace"}

        assert drops() == {("userspace", "udp", "not_member"): 7.0}
        _apply_pruning(t, [_udp_peer()])
        await t._pass()
        t.active["udp"]._counted = (5678, {"not_member": 2})
        assert drops() == {("userspace", "udp", "not_member"): 9.0}

    asyncio.run(main())


def test_the_udp_port_stays_held_while_no_worker_runs_and_goes_to_the_next_one(monkeypatch):
    """The agent holds udp_port for as long as it runs, with or without a worker
    (docs/networking.md: no local user may take it and send members forged pod packets from
    it): a worker stopped for want of peers leaves it to the agent, the next worker takes it,
    a stop of the agent closes it."""
    seen = _recorded_workers(monkeypatch)

    async def main():
        t = _stubbed_tunnels([], USERSPACE)
        _apply_pruning(t, [_udp_peer()])
        await t._pass()
        port = seen.ups[0].port_socket
        _apply_pruning(t, [])
        await t._pass()
        assert "udp" not in t.active and not port.closed and seen.ups[0].port_socket is None
        _apply_pruning(t, [_udp_peer()])
        await t._pass()
        assert seen.ports == [None, port] and t.active["udp"].port_socket is port
        _apply_pruning(t, [])
        await t._pass()
        await t.stop(remove=False)
        assert port.closed

    asyncio.run(main())


def test_a_worker_retired_while_it_was_being_started_again_is_stopped_and_its_port_held(monkeypatch):
    """The readiness loop finds the worker not answering and starts it again; while that start
    runs, a pass retires the worker (its last peer left) -- too early to stop what the start is
    making.  Once the start is done the worker it started is stopped (not left running with no
    one to stop it), and its udp port socket goes to the agent to hold for the next worker."""
    from agentd.dataplane import DataplaneError

    seen = _recorded_workers(monkeypatch, stubbed=("sync",))  # the real refresh_stats and _reconnect

    class _DeadClient:
        async def stats(self):
            raise DataplaneError("connection refused")

        async def close(self):
            pass

    async def main():
        t = _stubbed_tunnels([], USERSPACE)
        _apply_pruning(t, [_udp_peer()])
        await t._pass()
        worker = t.active["udp"]
        port = worker.port_socket
        worker.client = _DeadClient()  # the worker died
        up = backends_mod._Worker.up

        async def up_while_retired(self, subnet):
            await up(self, subnet)
            self.retired = True  # a pass retired it meanwhile

        monkeypatch.setattr(backends_mod._Worker, "up", up_while_retired)
        await worker.refresh_stats()
        assert len(seen.ups) == 2 and seen.ups[1] is worker
        assert seen.downs == [(worker, True)], "the worker started for nothing runs on"
        assert worker.client is None and worker.port_socket is None
        assert t._held_ports == {"udp": port} and not port.closed

    asyncio.run(main())
