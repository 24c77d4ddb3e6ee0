"""What /healthz, /readyz, /status and /metrics say must be what runs: a dead data-plane
worker, a bridge the member filter cannot guard, routes not yet reconciled after the initial
sync, a proxy that is gone, a restarted services task and a task that ended as it should."""

from __future__ import annotations

import asyncio
import logging
from ipaddress import IPv4Address, IPv4Network
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from agentd.config.settings import load_config
from agentd.daemon.agent import Agent
from agentd.daemon.routes import KernelRoutes
from agentd.daemon.supervisor import Supervisor
from agentd.dataplane import backends
from agentd.dataplane.bpf import datapath, layout, tc
from agentd.dataplane.control import DataplaneError
from agentd.datastore.store import SubnetLease
from agentd.kernel.routing import RouteProgrammer

CFG = load_config(None, env={}, overrides={"node.address": "10.1.1.1", "node.name": "n1"})
LEASE = SubnetLease(IPv4Network("10.244.7.0/24"), "n1", IPv4Address("10.1.1.1"), "host-gw")


# --- a user-space worker that died and cannot be started again ---------------------------------


class _WorkerClient:
    def __init__(self, pid: int, drops: dict[str, int]) -> None:
        self.pid, self.drops, self.dead = pid, drops, False

    async def stats(self) -> dict:
        if self.dead:
            raise DataplaneError("connection closed")
        # As the worker answers (worker.py stats(): its describe() at the top, pid among it).
        return {"pid": self.pid, "kind": "udp", "drops": dict(self.drops), "offloads": {}, "fallbacks": {}, "rx": 100}

    async def close(self) -> None:
        pass


def _tunnels(worker: backends._Worker) -> backends.Tunnels:
    t = backends.Tunnels.__new__(backends.Tunnels)
    t.active, t.helpers, t.bpf = {"udp": worker}, {}, SimpleNamespace(counters={})
    t.worker_drops = {}
    return t


def _userspace_drops(t: backends.Tunnels) -> dict[str, float]:
    return {s.labels["reason"]: s.value for fam in backends.dataplane_metrics(t) for s in fam.samples
            if s.name == "agentd_dataplane_drops_total" and s.labels["datapath"] == "userspace"}


async def test_a_dead_worker_that_cannot_be_started_again_is_down_in_status_and_healthz():
    t = SimpleNamespace(cfg=SimpleNamespace(agent=SimpleNamespace(state_dir="/nonexistent")), resync=lambda: None)
    w = backends._Worker(t, "udp")
    w.client, w.process = _WorkerClient(4242, {"no_route": 7}), SimpleNamespace(pid=4242)
    await w.refresh_stats()
    assert w.status()["worker_pid"] == 4242
    tunnels = _tunnels(w)
    agent = Agent(CFG)
    agent.tunnels = tunnels
    assert agent.health() == (True, [])

    w.client.dead = True  # the worker died; a new one cannot bind its UDP port

    async def cannot_start() -> None:
        w.client = None
        raise OSError(98, "Address already in use")

    w._reconnect = cannot_start
    for _ in range(3):
        await w.refresh_stats()
    status = w.status()
    assert status["worker_pid"] is None  # not the dead worker's, as if it ran
    assert status["drops"] is None and status["counters"] == {}
    ok, problems = agent.health()
    assert not ok and len(problems) == 1 and "udp data-plane worker is down" in problems[0]
    assert status["running"] is False and "Address already in use" in status["error"]
    assert _userspace_drops(tunnels) == {"no_route": 7}  # a counter: what it counted stays

    async def started() -> None:  # the port free again: a new worker, counting from 0
        w.client, w.process = _WorkerClient(5000, {"no_route": 2}), SimpleNamespace(pid=5000)

    w._reconnect = started
    await w.refresh_stats()
    await w.refresh_stats()
    assert w.status()["running"] and w.status()["worker_pid"] == 5000 and w.status()["error"] is None
    assert agent.health() == (True, [])
    assert _userspace_drops(tunnels) == {"no_route": 9}


async def test_one_failing_part_of_the_data_path_refresh_leaves_the_others_refreshed_and_is_logged_once(caplog):
    t = SimpleNamespace(cfg=SimpleNamespace(agent=SimpleNamespace(state_dir="/nonexistent")), resync=lambda: None)
    bad, helper = backends._Worker(t, "udp"), backends._Worker(t, "udp")
    bad.client = _WorkerClient(1, {"no_route": 1})
    bad.client.drops = {"no_route": "many"}  # an unexpected stats record: not a DataplaneError
    helper.client = _WorkerClient(2, {"no_route": 3})
    bpf_refreshes = []

    async def bpf_refresh() -> None:
        bpf_refreshes.append(1)

    tunnels = backends.Tunnels.__new__(backends.Tunnels)
    tunnels.active, tunnels.helpers = {"udp": bad}, {"ipip": helper}
    tunnels.bpf, tunnels._plans, tunnels._refresh_failing = SimpleNamespace(refresh=bpf_refresh), {}, {}
    tunnels._retries = backends._Retries()
    with caplog.at_level(logging.INFO, logger="agentd.backends"):
        for _ in range(3):
            await tunnels.refresh()
        assert helper.last_stats["drops"] == {"no_route": 3} and len(bpf_refreshes) == 3  # the later parts too
        failed = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(failed) == 1 and "refreshing the udp data-plane worker failed" in failed[0].getMessage()
        bad.client.drops = {"no_route": 4}  # it works again: said once
        await tunnels.refresh()
        await tunnels.refresh()
    assert bad.last_stats["drops"] == {"no_route": 4}
    assert [r.getMessage() for r in caplog.records].count("refreshing the udp data-plane worker works again") == 1


# --- a bridge the member filter cannot be put on -----------------------------------------------


class _Rtnl:
    def __init__(self, bridges: set[int]) -> None:
        self._bridges = bridges

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def bridges(self) -> set[int]:
        return set(self._bridges)


def test_a_bridge_that_cannot_be_guarded_does_not_stop_the_others_and_is_logged_once(monkeypatch, caplog):
    dp = datapath.BpfDatapath(1, "/nonexistent")
    dp.progs, dp.hook = {layout.INGRESS: 99}, "tcx"
    monkeypatch.setattr(datapath, "Rtnl", lambda: _Rtnl({5, 6, 7}))
    attached = []

    def attach(ifindex, direction, fd, name, hook, pins):
        attached.append(ifindex)
        if ifindex == 6:  # gone since listed, or a foreign filter where ours goes
            raise tc.TcError("device 6 ingress: cannot attach agentd_ingress: No such device")
        return []

    monkeypatch.setattr(tc, "attach", attach)
    monkeypatch.setattr(tc, "sweep", lambda pins: None)
    with caplog.at_level(logging.WARNING, logger="agentd.bpf"):
        for _ in range(3):
            assert dp.guard_bridges() == {5, 7}
    assert attached == [5, 6, 7, 6, 6]  # the others once; the failing one tried again each refresh
    assert [r.getMessage() for r in caplog.records].count(
        "bridge 6 not guarded by the member filter: device 6 ingress: cannot attach agentd_ingress: "
        "No such device; trying again") == 1
    assert dp.status()["unguarded_bridges"] == {"6": "device 6 ingress: cannot attach agentd_ingress: No such device"}


async def test_a_failing_data_path_refresh_does_not_crash_the_readiness_loop(monkeypatch):
    agent = Agent(CFG)
    sent = []
    agent.notifier = SimpleNamespace(ready=lambda s: sent.append(("READY", s)), status=lambda s: sent.append(("STATUS", s)))
    agent.lease, agent.leases, agent.started_bgp = LEASE, {4: LEASE}, True
    agent.programmer = SimpleNamespace(last_sync=1.0, programmed=list, shadowed={}, conflicts={}, reconciled_upto=1)
    agent.routes.programmer, agent.routes.initial_sync_done = agent.programmer, True
    refreshes = []

    async def refresh() -> None:
        refreshes.append(1)
        raise tc.TcError("device 12 ingress: cannot attach agentd_ingress: No such device")

    agent.tunnels = SimpleNamespace(refresh=refresh, problems=list)
    steps: asyncio.Queue = asyncio.Queue()
    real_sleep = asyncio.sleep

    async def step(_seconds):
        await steps.get()

    monkeypatch.setattr(asyncio, "sleep", step)
    loop = asyncio.get_running_loop().create_task(agent._readiness_loop())
    for _ in range(3):
        for _ in range(10):
            await real_sleep(0)
        await steps.put(None)
    for _ in range(10):
        await real_sleep(0)
    assert not loop.done() and len(refreshes) >= 3
    assert sent == [("READY", "ready: subnet 10.244.7.0/24")]  # once: the loop never started again
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop


# --- readiness: a reconcile after the initial sync -------------------------------------------


class _Outcome(Exception):
    pass


async def test_readiness_waits_for_a_reconcile_after_the_initial_sync(monkeypatch):
    import agentd.daemon.routes as R

    monkeypatch.setattr(R, "desired_routes", lambda *a, **k: SimpleNamespace(
        routes=[], plans={}, plans_v6={}, rows=[], next_hops={}, next_hops_v6={}, refused=[], untrusted=[], untrusted_next_hops=[]))
    programmer = RouteProgrammer()
    programmer.netlink = SimpleNamespace(is_open=True)  # the kernel's side stubbed: reconcile() itself runs
    failing = [False]

    async def dump_own(links=False) -> None:
        pass

    async def apply(adds, replaces, deletes):
        if failing[0]:
            raise _Outcome("netlink: no buffer space")
        return (), (), (), (), ()

    programmer._dump_own, programmer._apply = dump_own, apply
    agent = Agent(CFG)
    inputs = SimpleNamespace(
        cfg=SimpleNamespace(network=SimpleNamespace(backend="vxlan", encap="always")), name="n1",
        peering=SimpleNamespace(nodes={}, known=False), underlay=object(), lease=LEASE, leases={4: LEASE},
        tunnels=SimpleNamespace(paths=lambda: None, available=None, apply=lambda *a, **k: None),
        speaker=SimpleNamespace(peers={}, initial_sync_pending=list), started_bgp=True, stopping=False, cluster=None)
    agent.routes = KernelRoutes(inputs)
    agent.routes.initial_sync_deadline = float("inf")
    agent.programmer = programmer
    agent.routes.adopt(programmer)
    await programmer.reconcile()  # right after start: before etcd, before BGP
    agent.lease, agent.leases, agent.started_bgp = LEASE, {4: LEASE}, True
    assert agent.readiness() == (False, ["waiting for peers' End-of-RIB"])

    inputs.peering.known = True  # the registry read, no peers: the initial sync is done
    agent.routes.schedule()
    await asyncio.sleep(0)
    assert agent.routes.initial_sync_done
    assert agent.readiness() == (False, ["routes not reconciled yet"])  # what it computed is not in yet

    failing[0] = True
    with pytest.raises(_Outcome):
        await programmer.reconcile()
    assert agent.readiness() == (False, ["routes not reconciled yet"])  # a reconcile that fails: not yet

    failing[0] = False
    await programmer.reconcile()
    assert agent.readiness() == (True, [])


# --- the ingress proxy gone ------------------------------------------------------------------


async def test_a_proxy_that_is_gone_shows_no_connections_nor_server_states():
    from agentd.ingress.controller import IngressController
    from agentd.ingress.routing import Backend
    from agentd.ingress.views import IngressViews

    c = IngressController.__new__(IngressController)
    c.proxy = SimpleNamespace(running=False, reloads=0)  # HAProxy exited, not started again (yet)
    c._reloading = False
    c.stats = [{"pxname": "be", "svname": "srv1", "status": "UP"},
               {"pxname": "be", "svname": "BACKEND", "status": "UP", "req_tot": "40"}]
    c.info = {"CurrConns": "250"}  # as last read while it ran
    c.restarts, c.runtime_changes = 1, 0
    c.table = SimpleNamespace(backends={"be": Backend("shop", "web", "api", 80)})  # its counts are kept
    c.served = None  # none known: the table last rendered is shown
    c.servers = {}
    c.counter_base, c._last_counts = {}, {("be", "req_tot"): 40}
    await c.refresh_stats()  # the stats loop
    samples = {s.name: s.value for fam in IngressViews(c).collect() for s in fam.samples}
    assert samples["agentd_ingress_proxy_up"] == 0 and samples["agentd_ingress_proxy_connections"] == 0
    assert c.stats == [] and c.info == {}
    assert c.counter("be", "req_tot") == 40  # counted: kept


def test_the_proxy_exit_path_forgets_what_the_proxy_showed():
    from agentd.ingress.controller import IngressController

    c = IngressController.__new__(IngressController)
    c.stats, c.info = [{"pxname": "be", "svname": "srv1", "status": "UP"}], {"CurrConns": "250"}
    c.table = SimpleNamespace(backends={"be": None})
    c.counter_base, c._last_counts = {}, {("be", "req_tot"): 3}
    c._fold_counters()
    c._forget_proxy()
    assert (c.stats, c.info, c.counter("be", "req_tot")) == ([], {}, 3)


# --- DNS counters across a restart of the services task --------------------------------------


async def test_dns_query_counts_survive_a_restart_of_the_services_task(monkeypatch):
    from agentd.services import dns as sdns
    from agentd.services.agent import ServiceAgent
    from agentd.services.views import ServiceViews

    servers = []
    started = asyncio.Event()  # (the address is put on in a thread)

    class Server:
        def __init__(self, *a, **k) -> None:
            self.outcomes = dict.fromkeys(sdns.OUTCOMES, 0)
            servers.append(self)

        async def start(self) -> None:
            started.set()

        async def stop(self) -> None:
            pass

    monkeypatch.setattr(sdns, "DnsServer", Server)
    monkeypatch.setattr(sdns, "add_address", lambda address: "agentd-dns")
    monkeypatch.setattr(sdns, "upstream_pairs", lambda upstream: [("192.0.2.1", 53)])
    agent = ServiceAgent.__new__(ServiceAgent)
    agent.dns_config = SimpleNamespace(enabled=True, address=IPv4Address("169.254.20.10"), address_v6=None,
                                       upstream=["192.0.2.1:53"], cluster_domain="cluster.local")
    agent.families, agent.dns_server, agent.dns_counted, agent.error_dns = (4,), None, {}, None
    agent.pod_networks, agent.service_ranges = ("10.244.0.0/16",), {4: "10.96.0.0/12"}
    agent.programmer = object()
    crash = asyncio.Event()

    async def watch() -> None:
        await crash.wait()
        raise RuntimeError("etcd watch broke")

    async def idle() -> None:
        await asyncio.Event().wait()

    agent._watch, agent._sync_loop, agent._counters_loop = watch, idle, idle
    agent.counters, agent.node, agent.syncs, agent.sync_errors, agent._table = {}, "n1", 0, 0, None
    registry = CollectorRegistry()
    registry.register(ServiceViews(agent))

    def answered() -> float | None:
        return registry.get_sample_value("agentd_dns_queries_total", {"outcome": "answered"})

    task = asyncio.create_task(agent.run())
    await asyncio.wait_for(started.wait(), 10)
    servers[0].outcomes["answered"] = 5
    assert answered() == 5
    crash.set()
    with pytest.raises(ExceptionGroup):
        await task  # the supervisor would start it again after a while
    assert agent.dns_server is None and answered() == 5  # meanwhile: still there, not gone
    crash.clear()
    started.clear()
    task = asyncio.create_task(agent.run())
    await asyncio.wait_for(started.wait(), 10)
    await turns_until(lambda: agent.dns_server is not None)
    assert len(servers) == 2 and answered() == 5
    servers[1].outcomes["answered"] = 2
    assert answered() == 7
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert answered() == 7


async def test_service_dns_that_cannot_start_is_a_problem_and_tried_again_until_served(monkeypatch):
    """The DNS address cannot be put on (or port 53 is taken): the agent says so in its
    problems (/status, /healthz, systemd's STATUS=) with the reason, tries again with a
    backoff, and once served the problem is gone."""
    from agentd.kernel import netlink as nl
    from agentd.services import agent as services_agent
    from agentd.services import dns as sdns
    from agentd.services.agent import ServiceAgent

    started = []

    class Server:
        def __init__(self, *a, **k) -> None:
            self.outcomes = dict.fromkeys(sdns.OUTCOMES, 0)

        async def start(self) -> None:
            started.append(self)

        async def stop(self) -> None:
            pass

    taken = [True]
    tries = []

    def add_address(address: str) -> str:
        tries.append(address)
        if taken[0]:
            raise nl.NetlinkError(13, None, "adding an address")
        return "agentd-dns"

    monkeypatch.setattr(sdns, "DnsServer", Server)
    monkeypatch.setattr(sdns, "add_address", add_address)
    monkeypatch.setattr(services_agent, "DNS_RETRY_INITIAL", 0.001)
    monkeypatch.setattr(services_agent, "DNS_RETRY_MAX", 0.002)
    svc = ServiceAgent.__new__(ServiceAgent)
    svc.dns_config = SimpleNamespace(enabled=True, address=IPv4Address("169.254.20.10"), address_v6=None,
                                     upstream=["192.0.2.1:53"], cluster_domain="cluster.local")
    svc.families, svc.dns_server, svc.dns_counted, svc.error_dns = (4,), None, {}, None
    svc.pod_networks, svc.service_ranges = ("10.244.0.0/16",), {4: "10.96.0.0/12"}
    svc.programmer = object()

    async def idle() -> None:
        await asyncio.Event().wait()

    svc._watch, svc._sync_loop, svc._counters_loop = idle, idle, idle
    agent = Agent(CFG)
    agent.services = svc
    assert agent.problems() == [] and agent.health() == (True, [])
    task = asyncio.create_task(svc.run())
    try:
        async with asyncio.timeout(10):
            while len(tries) < 3:  # failed, and tried again (twice: a loop, not once)
                await asyncio.sleep(0.001)
            assert svc.dns_server is None and started == []
            problem = "service DNS not served: cannot put 169.254.20.10 on this node: "
            assert len(agent.problems()) == 1 and agent.problems()[0].startswith(problem), agent.problems()
            assert "trying again" in agent.problems()[0]
            # /healthz is liveness (DESIGN: 200 while the event loop and every supervised task
            # are alive): an agent routing pods fine is not to be restarted for its DNS.
            assert agent.health() == (True, [])
            taken[0] = False  # freed: the next try serves it
            while svc.dns_server is None:
                await asyncio.sleep(0.001)
        assert len(started) == 1 and svc.error_dns is None
        assert agent.problems() == [] and agent.health() == (True, [])
        count = len(tries)
        for _ in range(20):
            await asyncio.sleep(0.002)
        assert len(tries) == count  # served: no more tries
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def turns_until(condition, turns: int = 1000) -> None:
    """Give the loop turns (no wall clock) until ``condition()`` holds."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"still not so after {turns} turns of the loop")


# --- a task that ended as it should ----------------------------------------------------------


async def test_a_task_that_ended_as_it_should_is_done_not_down():
    sup = Supervisor(backoff_initial=3600.0, backoff_max=3600.0)

    async def returns() -> None:  # the watchdog without WATCHDOG_USEC
        pass

    async def crashes() -> None:
        raise ValueError("no etcd")

    async def runs() -> None:
        await asyncio.Event().wait()

    sup.start("watchdog", returns)
    sup.start("node-watch", crashes)
    sup.start("readiness", runs)
    for _ in range(100):
        await asyncio.sleep(0)
    states = {t["name"]: (t["state"], t["running"]) for t in sup.summary()}
    assert states == {"watchdog": ("done", False), "node-watch": ("down", False), "readiness": ("running", True)}
    await sup.stop()


async def test_an_adopted_workers_pid_is_shown_and_its_counts_kept_when_another_takes_over():
    """A worker this agent did not start (adopted after a graceful restart: no process of
    ours) is shown by the pid its stats give; a new worker (another pid) counts from 0, and
    what the one before counted is kept."""
    t = SimpleNamespace(cfg=SimpleNamespace(agent=SimpleNamespace(state_dir="/nonexistent")), resync=lambda: None)
    w = backends._Worker(t, "udp")
    w.client, w.process = _WorkerClient(4242, {"no_route": 7}), None
    await w.refresh_stats()
    assert w.status()["worker_pid"] == 4242
    w.client = _WorkerClient(4343, {"no_route": 2})
    await w.refresh_stats()
    assert w.status()["worker_pid"] == 4343
    assert _userspace_drops(_tunnels(w))["no_route"] == 9
