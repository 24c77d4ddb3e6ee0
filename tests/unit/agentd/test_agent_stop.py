"""How the agent stops (agentd/daemon/agent.py, ``_shutdown``): a leave during start-up
cleans the host up as a leave with no agent does, a leave while stopping is refused, one step
failing skips no other, a start that stops before BGP keeps the kernel as it found it."""

import asyncio
import signal
from ipaddress import IPv4Network
from types import SimpleNamespace

import pytest
from agent_config import agent_cfg as _cfg

from agentd.daemon import agent as agent_module
from agentd.daemon.agent import Agent, AgentError
from agentd.daemon.api import ApiServer, Conflict
from agentd.daemon.leave_report import exit_code
from agentd.datastore.store import SubnetLease
from agentd.nft.libnftables import NftError


class Part:
    """A built part of the agent: records its calls; ``fail`` names a call that raises."""

    def __init__(self, calls: list, name: str, fail: str | None = None) -> None:
        self.calls, self.name, self.fail = calls, name, fail

    def __getattr__(self, method):
        async def call(*args, **kwargs):
            self.calls.append((self.name, method, *args, *sorted(kwargs.items())))
            if method == self.fail:
                raise OSError(f"{self.name} {method} failed")
        return call


@pytest.fixture
def host(monkeypatch):
    """The standalone leave's host clean-up, recorded instead of done."""
    done: list[str] = []

    def record(name, result=()):
        def sync(*_a, **_kw):
            done.append(name)
            return list(result)

        async def coro(*_a, **_kw):
            done.append(name)
            return list(result)
        return sync, coro

    for name, kind in (("remove_bpf_leftovers", 0), ("remove_vxlan_leftover", 0), ("remove_ingress_proxy", 0),
                       ("restore_sysctls", 0), ("remove_worker_leftovers", 1),
                       ("remove_policy_tables", 1), ("remove_services_table", 1)):
        monkeypatch.setattr(agent_module, name, record(name)[kind])
    monkeypatch.setattr(agent_module.flowmask, "remove", record("unmask")[0])
    monkeypatch.setattr(agent_module.masquerade, "remove", record("masquerade.remove")[1])

    async def nft_missing():
        return None  # libnftables can be had
    monkeypatch.setattr(agent_module, "nft_missing", nft_missing)

    async def remove_routes_of(protocol, networks):
        done.append(("remove_routes_of", protocol, networks))
        return ["10.244.1.0/24"], []
    monkeypatch.setattr(agent_module, "remove_routes_of", remove_routes_of)
    return done


class Unreachable:
    """etcd as it is while unreachable: every request times out."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def release(self, name, timeout=None):
        self.calls.append("release")
        raise TimeoutError("etcd did not answer within 10 s")

    async def remove_node(self, name, timeout=None):
        self.calls.append("remove_node")
        raise TimeoutError("etcd did not answer within 10 s")

    async def close(self):
        self.calls.append("close")


def test_a_leave_during_start_up_cleans_the_host_up_and_says_etcd_was_not_left(tmp_path, host):
    """`agentd leave` while the agent waits for etcd: tunnels, policy, services, ingress were
    never built, so their leave steps were skipped -- the BPF data path, the pod fast path,
    the worker, the devices, the nft tables, HAProxy stayed -- and the exit was 0."""
    calls: list = []

    async def main():
        agent = Agent(_cfg(tmp_path))
        agent.programmer = Part(calls, "programmer")
        agent.datastore = Unreachable()
        left = agent.request_leave()
        await agent._shutdown()
        return agent, left.result()

    agent, etcd_error = asyncio.run(main())
    assert set(host) >= {"remove_bpf_leftovers", "remove_worker_leftovers", "remove_vxlan_leftover",
                         "remove_policy_tables", "remove_services_table", "remove_ingress_proxy"}
    assert ("programmer", "stop", ("remove_routes", True)) in calls  # leaving: its routes go
    assert etcd_error == "etcd did not answer within 10 s"
    assert agent.exit_status == 0  # a leave: Restart=on-failure must not start it again


def test_a_leave_before_etcd_was_reached_releases_a_previous_runs_keys(tmp_path, host, monkeypatch):
    store = Unreachable()
    store.connect = lambda timeout=None: asyncio.sleep(0)
    monkeypatch.setattr(agent_module, "datastore_for", lambda cfg: store)

    async def main():
        agent = Agent(_cfg(tmp_path))
        left = agent.request_leave()
        await agent._shutdown()
        return agent, left.result()

    agent, etcd_error = asyncio.run(main())
    assert store.calls == ["release", "close"] and etcd_error and agent.exit_status == 0
    assert "remove_bpf_leftovers" in host


def test_a_leave_with_no_agent_removes_the_routes_of_our_protocol_only(tmp_path, host, monkeypatch):
    """`agentd leave` with no agent running: the kernel routes of [network] route_protocol
    (every one in the main table, as the agent's own stop removes them) go with the rest of
    the host's state; a leave whose agent built its route programmer leaves that to its stop."""
    store = Unreachable()
    store.connect = lambda timeout=None: asyncio.sleep(0)
    monkeypatch.setattr(agent_module, "datastore_for", lambda cfg: store)
    report = asyncio.run(agent_module.leave(_cfg(tmp_path, **{"network.route_protocol": 150})))
    assert ("remove_routes_of", 150, None) in host and exit_code(report) == 1  # (etcd could not be left)
    host.clear()

    async def main():
        agent = Agent(_cfg(tmp_path))
        agent.programmer = Part([], "programmer")
        agent.datastore = Unreachable()
        agent.request_leave()
        await agent._shutdown()

    asyncio.run(main())
    assert "remove_bpf_leftovers" in host and not [d for d in host if d[0] == "remove_routes_of"]


def test_a_leave_while_stopping_is_refused_with_409(tmp_path):
    """SIGTERM with graceful restart on: the stop keeps routes, devices, worker, BPF data path
    (computed once); a leave accepted then released the subnet and left them all behind."""

    async def main():
        agent = Agent(_cfg(tmp_path))
        agent.stopping = True
        with pytest.raises(Conflict, match="already stopping"):
            agent.request_leave()
        assert not agent._leaving
        api = ApiServer(SimpleNamespace(request_leave=agent.request_leave), "127.0.0.1", 0)
        answer = await api._leave(None)
        return answer

    answer = asyncio.run(main())
    assert answer.status == 409 and b"already stopping" in answer.body


def test_an_accepted_leave_is_answered_once_etcd_was_left(tmp_path):
    async def main():
        future = asyncio.get_running_loop().create_future()
        api = ApiServer(SimpleNamespace(request_leave=lambda: future), "127.0.0.1", 0)
        answering = asyncio.ensure_future(api._leave(None))
        await asyncio.sleep(0)
        assert not answering.done()
        future.set_result(None)
        return await answering

    answer = asyncio.run(main())
    assert answer.status == 202 and b'"etcd_error": null' in answer.body


def test_a_failing_stop_step_skips_none_after_it(tmp_path):
    """The route programmer's stop raising (a netlink error) skipped the tunnels, policy,
    services, the API's stop and the token file, and ended in a traceback."""
    calls: list = []
    cfg = _cfg(tmp_path, **{"bgp.graceful_restart": False})
    token = tmp_path / "api.token"

    async def main():
        agent = Agent(cfg)
        agent.started_bgp = True
        agent.programmer = Part(calls, "programmer", fail="stop")
        agent.tunnels = Part(calls, "tunnels")
        agent.api = Part(calls, "api")
        agent.api.token = "t0ken"
        token.write_text("t0ken\n")
        await agent._shutdown()
        return agent

    agent = asyncio.run(main())
    assert ("tunnels", "stop", ("remove", True)) in calls and ("api", "stop") in calls
    assert not token.exists()
    assert agent.exit_status == 1


@pytest.mark.parametrize("started_bgp", [False, True])
def test_a_start_stopped_before_bgp_leaves_the_adopted_routes(tmp_path, started_bgp):
    """graceful_restart = false, SIGTERM while waiting for etcd: the routes adopted from the
    killed agent were deleted, though the docs say the kernel state is left as it was."""
    calls: list = []

    async def main():
        agent = Agent(_cfg(tmp_path, **{"bgp.graceful_restart": False}))
        agent.started_bgp = started_bgp
        agent.programmer = Part(calls, "programmer")
        agent.tunnels = Part(calls, "tunnels")
        await agent._shutdown()

    asyncio.run(main())
    assert ("programmer", "stop", ("remove_routes", started_bgp)) in calls
    assert ("tunnels", "stop", ("remove", started_bgp)) in calls


def test_a_second_signal_does_not_abort_the_stop(tmp_path, monkeypatch):
    """The handlers were removed before the stop: a second Ctrl-C or SIGTERM (the default
    handlers) killed the agent midway through it."""
    seen = {}

    async def underlay(*_):
        return SimpleNamespace(mtu=1500, family=4, ifname="eth0", ifindex=2)

    async def nothing(*_a, **_kw):
        return None

    async def failing_start(self):
        raise AgentError("etcd refused us")

    async def shutdown(self):
        loop = asyncio.get_running_loop()
        seen["during"] = {sig: loop._signal_handlers.get(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    monkeypatch.setattr(agent_module.asyncio, "to_thread", lambda f, *a: underlay() if f is agent_module.underlay_for
                        else asyncio.sleep(0, "token"))
    monkeypatch.setattr(Agent, "_start", failing_start)
    monkeypatch.setattr(Agent, "_shutdown", shutdown)

    async def main():
        agent = Agent(_cfg(tmp_path))
        agent.api = SimpleNamespace(start=nothing, stop=nothing, token=None)
        agent.supervisor = SimpleNamespace(start=lambda *a: None)
        code = await agent.run()
        loop = asyncio.get_running_loop()
        return code, {sig: loop._signal_handlers.get(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    before = signal.getsignal(signal.SIGHUP)
    try:
        code, after = asyncio.run(main())
        # Ignored after the stop, not SIGHUP's default action: that would end the agent as
        # systemd's clean exit, and its exit 1 (a restart wanted) would not be restarted.
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
    assert code == 1
    for sig, handle in seen["during"].items():
        assert handle is not None and handle._callback.__name__ == "_already_stopping", sig
    assert after == {signal.SIGINT: None, signal.SIGTERM: None, signal.SIGHUP: None}


def test_a_fast_path_with_no_policy_agent_to_keep_it_is_removed(tmp_path, monkeypatch):
    """libnftables missing: the policy agent is gone, and with it whatever would update the
    pod fast path's pods; it stayed attached, steering by pods that may have gone."""
    calls: list = []

    class FastPath:
        routed, wire = False, None

        def remove(self):
            calls.append("fast_path.remove")
            return ["agentd_pod_fast"]

    class Policy:
        def __init__(self, *a, **kw):
            pass

        async def start(self):
            raise NftError("no libnftables")

    class Services(Policy):
        pass

    class Store:
        on_subnet_lost = None

        async def connect(self):
            pass

        async def ensure_cluster_config(self, wanted):
            return wanted

        async def acquire_subnet(self, name, address, backend, data, **_):
            return SubnetLease(IPv4Network("10.244.7.0/24"), name, address, backend)

    class Tunnels:
        def __init__(self, *a, **kw):
            self.bpf = SimpleNamespace(gate=None, holders=set(), hold_redirect=None, guard_bridges=None)

        async def start(self, subnets):
            raise RuntimeError("stop here")

    async def open_fast_path(self):
        return FastPath(), None

    async def noop(*_a, **_kw):
        return None

    monkeypatch.setattr(agent_module, "RouteProgrammer", lambda **_: SimpleNamespace(start=noop, on_sync=None))
    monkeypatch.setattr(agent_module, "datastore_for", lambda cfg: Store())
    monkeypatch.setattr(agent_module, "Tunnels", Tunnels)
    monkeypatch.setattr(agent_module, "PolicyAgent", Policy)
    monkeypatch.setattr(agent_module, "ServiceAgent", Services)
    monkeypatch.setattr(agent_module, "drop_previous_protocol", noop)
    monkeypatch.setattr(agent_module, "remove_ingress_proxy", lambda *_: False)
    monkeypatch.setattr(agent_module.node_files, "previous_subnets", lambda cfg: {})
    monkeypatch.setattr(Agent, "_forwarding", noop)
    monkeypatch.setattr(Agent, "_open_fast_path", open_fast_path)

    async def main():
        agent = Agent(_cfg(tmp_path, **{"flows.enabled": False}))
        agent.underlay = SimpleNamespace(mtu=1500, family=4, ifname="eth0", ifindex=2)
        agent.routes.adopt = lambda programmer: None

        async def opened(policy, services, registry, carried=None, **_kw):
            calls.append(("open_flows", carried))
        agent.observe.open_flows = opened
        with pytest.raises(AgentError, match="stop here"):
            await agent._start()

    asyncio.run(main())
    assert calls == ["fast_path.remove", ("open_flows", None)]


def test_a_leave_during_start_up_exits_with_the_status_the_stop_settles(tmp_path, monkeypatch):
    """The start-up-cancelled path returned the exit status before the stop ran: a leave whose
    etcd step failed still exited 0."""

    async def underlay():
        return SimpleNamespace(mtu=1500, family=4, ifname="eth0", ifindex=2)

    async def nothing(*_a, **_kw):
        return None

    async def waiting_for_etcd(self):
        await asyncio.Event().wait()

    async def shutdown(self):  # the etcd step failed
        self.exit_status = 1

    monkeypatch.setattr(agent_module.asyncio, "to_thread", lambda f, *a: underlay() if f is agent_module.underlay_for
                        else asyncio.sleep(0, "token"))
    monkeypatch.setattr(Agent, "_start", waiting_for_etcd)
    monkeypatch.setattr(Agent, "_shutdown", shutdown)

    async def main():
        agent = Agent(_cfg(tmp_path))
        agent.api = SimpleNamespace(start=nothing, stop=nothing, token=None)
        agent.supervisor = SimpleNamespace(start=lambda *a: None)
        asyncio.get_running_loop().call_soon(agent.request_leave)
        return await agent.run()

    assert asyncio.run(main()) == 1


def test_a_leave_cancels_the_node_data_publications_first(tmp_path):
    """A publication of node data (started when a backend came up) retries without a deadline
    while etcd is unreachable, holding the datastore's lease lock: the leave's release waited
    for it for ever.  The leave cancels it before it releases."""
    async def main():
        agent = Agent(_cfg(tmp_path))
        calls: list = []
        publication = asyncio.ensure_future(asyncio.get_running_loop().create_future())  # never done
        agent._publishing.add(publication)
        publication.add_done_callback(agent._published)

        class Store:
            async def release(self, name, timeout):
                calls.append(("release", publication.cancelled()))
                return []

            async def remove_node(self, name, timeout):
                calls.append(("remove_node", publication.cancelled()))

        agent.datastore = Store()
        await agent._leave_etcd()
        return calls, agent._publishing

    calls, publishing = asyncio.run(main())
    assert calls == [("release", True), ("remove_node", True)] and not publishing
