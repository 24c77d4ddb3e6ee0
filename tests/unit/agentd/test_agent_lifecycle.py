"""The agent's own reactions: a subnet lost to another node stops it (exit status 1), a reload
applies the whole [log] section."""

import asyncio
import logging
from ipaddress import IPv4Address, IPv4Network

from agentd.config.settings import load_config
from agentd.daemon.agent import Agent
from agentd.datastore.store import SubnetLease

CFG = load_config(None, env={}, overrides={"node.address": "10.1.1.1", "node.name": "n1"})


def _cfg(tmp_path, **overrides):
    """CFG with its files in ``tmp_path`` (a stop removes some)."""
    return load_config(None, env={}, overrides={
        "node.address": "10.1.1.1", "node.name": "n1", "cni.subnet_file": str(tmp_path / "subnet.env"),
        "api.token_file": str(tmp_path / "api.token"), "agent.state_dir": str(tmp_path / "state"),
        "agent.bpf_dir": str(tmp_path / "bpf"), **overrides})


def test_a_subnet_taken_by_another_node_stops_the_agent_with_status_1():
    async def main():
        agent = Agent(CFG)
        agent._subnet_lost(SubnetLease(IPv4Network("10.244.7.0/24"), "n1", IPv4Address("10.1.1.1"), "host-gw"))
        assert agent._stop.is_set() and agent.exit_status == 1
        ready, reasons = agent.readiness()
        assert not ready and any("10.244.7.0/24 was taken by another node" in r for r in reasons)

    asyncio.run(main())


def test_a_reload_applies_the_log_format_too(tmp_path):
    conf = tmp_path / "agentd.toml"
    conf.write_text('[node]\nname = "n1"\naddress = "10.1.1.1"\n[log]\nlevel = "debug"\nformat = "json"\n')
    applied = []

    async def main():
        agent = Agent(CFG, config_path=str(conf), set_logging=lambda level, fmt: applied.append((level, fmt)))
        agent._reload()
        assert agent.cfg.log.format == "json"

    asyncio.run(main())
    assert applied == [("debug", "json")]


class _Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def ready(self, status: str = "") -> None:
        self.sent.append(("READY=1", status))

    def status(self, status: str) -> None:
        self.sent.append(("STATUS", status))


def test_start_up_problems_leave_the_agent_ready_but_degraded(monkeypatch):
    """No libnftables, ip_masq not applied, IP forwarding not on: the agent runs on without
    them (never retried).  They made /readyz 503 for ever, so READY=1 never went to systemd
    (Type=notify, TimeoutStartSec: killed and restarted every 5 minutes) and STATUS= stayed
    "connecting to etcd".  Now: ready once lease, BGP and routes are, the problems in /status
    and STATUS=; while not ready STATUS= says why."""
    from types import SimpleNamespace

    from agentd.cli import render_status
    from agentd.daemon.views import AgentViews

    steps: asyncio.Queue = asyncio.Queue()
    real_sleep = asyncio.sleep

    async def step(_seconds):  # the loop's pause: the test says when it goes on
        await steps.get()

    async def settle():  # the loop runs until it pauses again
        for _ in range(10):
            await real_sleep(0)

    async def main():
        agent = Agent(CFG)
        agent.notifier = _Recorder()
        agent._problems += ["network policy not enforced: no libnftables", "ip_masq not applied: no libnftables"]
        monkeypatch.setattr(asyncio, "sleep", step)
        loop = asyncio.get_running_loop().create_task(agent._readiness_loop())
        await settle()
        await steps.put(None)  # a second round, the same: not sent again
        await settle()
        assert agent.readiness() == (False, ["no subnet lease yet", "BGP not started", "routes not reconciled yet"])
        assert agent.notifier.sent == [("STATUS", "not ready: no subnet lease yet; BGP not started; routes not reconciled yet")]
        agent.lease = SubnetLease(IPv4Network("10.244.7.0/24"), "n1", IPv4Address("10.1.1.1"), "host-gw")
        agent.leases = {4: agent.lease}
        agent.started_bgp = True
        agent.programmer = SimpleNamespace(last_sync=1.0, programmed=list, shadowed={}, conflicts={}, reconciled_upto=1)
        agent.routes.programmer = agent.programmer  # one reconcile since the initial sync
        agent.routes.initial_sync_done = True
        assert agent.readiness() == (True, [])
        await steps.put(None)
        await settle()
        loop.cancel()
        degraded = ("ready: subnet 10.244.7.0/24; degraded: network policy not enforced: no libnftables; "
                    "ip_masq not applied: no libnftables")
        assert agent.notifier.sent[1:] == [("READY=1", degraded)]
        status = AgentViews(agent).status()
        assert status["ready"] and status["problems"] == agent._problems
        assert render_status(status).splitlines()[:3] == [
            "agentd is running (ready, DEGRADED).",
            "PROBLEM: network policy not enforced: no libnftables",
            "PROBLEM: ip_masq not applied: no libnftables"]

    asyncio.run(main())


def test_an_agent_stopping_for_a_lost_subnet_removes_its_node_record_and_subnet_file(tmp_path):
    """close() keeps the lease (a restart finds its keys): after a lost subnet the node record
    must not stay behind it, naming the subnet another node holds now.  Nor the subnet file:
    agentd-cni hands out addresses from it, which the subnet's new holder hands out too."""
    subnet_file = tmp_path / "subnet.env"
    subnet_file.write_text("AGENTD_SUBNET=10.244.7.1/24\n")
    cfg = _cfg(tmp_path)

    class Datastore:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        async def remove_node(self, name, timeout=None):
            self.calls.append(("remove_node", name))
            return True

        async def close(self):
            self.calls.append(("close",))

    async def main():
        agent = Agent(cfg)
        agent.datastore = ds = Datastore()
        agent._subnet_lost(SubnetLease(IPv4Network("10.244.7.0/24"), "n1", IPv4Address("10.1.1.1"), "host-gw"))
        await agent._shutdown()
        return ds.calls

    assert asyncio.run(main()) == [("remove_node", "n1"), ("close",)]
    assert not subnet_file.exists()


def _stub_the_start(monkeypatch, store):
    """Agent._start with ``store`` for its datastore and none of the kernel: the route
    programmer and the tunnels do nothing, forwarding is left as it is, and the step after
    the lease (the pod fast path) is held for good."""
    from types import SimpleNamespace

    from agentd.daemon import agent as agent_module

    class Programmer:
        def __init__(self, **_):
            self.on_sync = None

        async def start(self):
            pass

    async def no_forwarding(self):
        pass

    async def fast_path(self):  # the step after the lease: held for good
        await asyncio.Event().wait()

    monkeypatch.setattr(agent_module, "RouteProgrammer", Programmer)
    monkeypatch.setattr(agent_module, "datastore_for", lambda cfg: store)
    monkeypatch.setattr(agent_module, "Tunnels", lambda *a, **kw: SimpleNamespace())
    monkeypatch.setattr(Agent, "_forwarding", no_forwarding)
    monkeypatch.setattr(Agent, "_open_fast_path", fast_path)


class _LeasingStore:
    """A datastore that connects, keeps the cluster configuration it is given and leases the
    subnet ``lease(previous)`` names (``previous``: the one the agent asked to keep)."""

    on_subnet_lost = None

    def __init__(self, lease):
        self.lease = lease

    async def connect(self):
        pass

    async def ensure_cluster_config(self, wanted):
        return wanted

    async def acquire_subnet(self, name, address, backend, data, previous=None, **_):
        return SubnetLease(self.lease(previous), name, address, backend)


async def _start_a_while(agent):
    """agent._start() with no underlay nor kernel routes, run for 50 turns of the loop, then
    cancelled."""
    from types import SimpleNamespace

    agent.underlay = SimpleNamespace()
    agent.routes.adopt = lambda programmer: None
    task = asyncio.get_running_loop().create_task(agent._start())
    for _ in range(50):
        await asyncio.sleep(0)
    task.cancel()


def test_status_names_each_start_up_step_while_it_waits(monkeypatch):
    """`systemctl status` during start-up: STATUS= names the step the agent is at -- it once
    said "connecting to etcd" until the node was started, through a subnet acquisition or a
    policy start that hung.  Each step is held here until the test lets it go on."""
    from types import SimpleNamespace

    from agentd.daemon import agent as agent_module
    from agentd.daemon.agent import START_STEPS

    gate: asyncio.Queue = asyncio.Queue()

    class Store:
        on_subnet_lost = None

        async def connect(self):
            await gate.get()

        async def ensure_cluster_config(self, wanted):
            return wanted

        async def acquire_subnet(self, name, address, backend, data, **_):
            await gate.get()
            return SubnetLease(IPv4Network("10.244.7.0/24"), name, address, backend)

    _stub_the_start(monkeypatch, Store())
    monkeypatch.setattr(agent_module.node_files, "previous_subnets", lambda cfg: {})

    async def settle():
        for _ in range(20):
            await asyncio.sleep(0)

    async def main():
        agent = Agent(CFG)
        agent.notifier = _Recorder()
        agent.underlay = SimpleNamespace()
        agent.routes.adopt = lambda programmer: None  # the kernel's routes: none here
        start = asyncio.get_running_loop().create_task(agent._start())
        seen = []
        for _ in range(3):
            await settle()
            seen.append(agent.notifier.sent[-1])
            await gate.put(None)
        start.cancel()
        return seen, agent.notifier.sent

    seen, sent = asyncio.run(main())
    assert seen == [("STATUS", "connecting to etcd"), ("STATUS", "acquiring a subnet lease"),
                    ("STATUS", "programming policy and services")]
    assert [s for _, s in sent] == list(START_STEPS[:3])


def test_the_start_after_a_lost_subnet_warns_that_the_subnet_changed(tmp_path, monkeypatch, caplog):
    """The stop after a lost subnet removed the subnet file, so the next start had no previous
    subnet, took another, and never logged the warning docs/docker.md promises (docker0 and
    the pods must move).  The record in [agent] state_dir names the lost subnet."""

    from agentd.daemon import agent as agent_module

    cfg = _cfg(tmp_path)
    lost, new = IPv4Network("10.244.7.0/24"), IPv4Network("10.244.9.0/24")
    asked = []

    class Gone:
        async def remove_node(self, name, timeout=None):
            return True

        async def close(self):
            pass

    def lease(previous):
        asked.append(previous)
        return new  # the lost one is another node's now

    _stub_the_start(monkeypatch, _LeasingStore(lease))
    monkeypatch.setattr(agent_module, "drop_previous_protocol", lambda *a, **kw: asyncio.sleep(0))

    async def main():
        first = Agent(cfg)
        first.datastore = Gone()
        first._subnet_lost(SubnetLease(lost, "n1", IPv4Address("10.1.1.1"), "host-gw"))
        await first._shutdown()  # systemd restarts it
        await _start_a_while(Agent(cfg))

    asyncio.run(main())
    assert asked == [lost]
    assert f"this node's subnet changed from {lost} to {new}" in caplog.text


def test_a_changed_pod_mtu_is_warned_about_at_start(tmp_path, monkeypatch, caplog):
    """The backend changed (host-gw -> vxlan) or the NIC's MTU did: the subnet file's
    AGENTD_MTU changed without a word, only a changed subnet was warned about, and docker0
    kept its old --mtu (docs/docker.md said only a lost subnet needs Docker restarted)."""

    from agentd.cni.netconf import SubnetFile, render_subnet_file
    from agentd.daemon import agent as agent_module

    cfg = _cfg(tmp_path)
    subnet = IPv4Network("10.244.7.0/24")
    (tmp_path / "subnet.env").write_text(render_subnet_file(
        SubnetFile(network=IPv4Network("10.244.0.0/16"), subnet=subnet, mtu=1500, backend="host-gw")))

    _stub_the_start(monkeypatch, _LeasingStore(lambda previous: subnet))  # kept
    monkeypatch.setattr(agent_module, "drop_previous_protocol", lambda *a, **kw: asyncio.sleep(0))

    async def start(mtu):
        agent = Agent(cfg)
        agent.pod_mtu = mtu  # run() takes it from the underlay and the backend
        await _start_a_while(agent)

    with caplog.at_level(logging.WARNING, logger="agentd"):
        asyncio.run(start(1500))
        assert "pod MTU changed" not in caplog.text
        asyncio.run(start(1450))
    assert ("the pod MTU changed from 1500 to 1450: pods and containers made before keep the old one until they "
            "are created again; a Docker host runs `agentd docker-opts` and restarts Docker") in caplog.text
    assert "subnet changed" not in caplog.text


# -- reload (SIGHUP): what the running configuration's restart-only keys make of it

_RR_PEER = '[[bgp.peers]]\naddress = "10.9.9.9"\nasn = 64512\npassive = true\nrr_client = true\n'


def test_a_reload_whose_peers_need_restart_only_keys_keeps_the_running_peers(tmp_path, caplog):
    """The new file turns route_reflector and [bgp] listen on (applied only by a restart) and
    adds a passive rr_client peer: valid in the file, but against the running keys it is what
    a start refuses.  The running peers stay, one error names both problems and the keys that
    need a restart; the rest of the reload ([log] level) applies."""
    conf = tmp_path / "agentd.toml"
    conf.write_text('[node]\nname = "n1"\naddress = "10.1.1.1"\n[bgp]\nlisten = ""\n'
                    '[[bgp.peers]]\naddress = "10.9.9.8"\nasn = 64513\n')
    running = load_config(conf, env={})
    conf.write_text('[node]\nname = "n1"\naddress = "10.1.1.1"\nroute_reflector = true\n[bgp]\nlisten = "0.0.0.0:179"\n'
                    '[log]\nlevel = "debug"\n' + _RR_PEER)
    load_config(conf, env={})  # valid on its own (what `agentd check-config` says)

    async def main():
        agent = Agent(running, config_path=str(conf), set_logging=lambda *_: None)
        agent.notifier = _Recorder()
        with caplog.at_level(logging.INFO, logger="agentd"):
            agent._reload()
        assert agent.cfg.bgp.peers == running.bgp.peers and agent.cfg.bgp.listen is None
        assert not agent.cfg.node.route_reflector and agent.cfg.log.level == "debug"
        (error,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
        text = error.getMessage()
        assert "rr_client: needs [node] route_reflector = true" in text and "passive" in text, text
        assert "running [node] route_reflector, [bgp] listen" in text and "restart" in text, text
        assert agent.notifier.sent[-1][0] == "STATUS" and "last reload failed: the new [[bgp.peers]]" in agent.notifier.sent[-1][1]

    asyncio.run(main())


def test_a_reload_with_the_default_route_gone_still_applies(tmp_path, monkeypatch):
    """[node] address left to the default route (as etc/agentd.toml has it), which is gone at
    the SIGHUP (a link flap, a DHCP renewal): the address is the running one (restart-only),
    not looked up again, and the reload applies the new log level."""
    import agentd.daemon.agent as agent_mod
    from agentd.kernel import netinfo

    class Host:
        route = True

        def hostname(self):
            return "n1"

        def default_address(self):
            return IPv4Address("10.1.1.1") if Host.route else None

        def default_address_v6(self, beside=None):
            return None

    monkeypatch.setattr(agent_mod, "LocalHost", Host, raising=False)
    monkeypatch.setattr(netinfo, "LocalHost", Host)
    conf = tmp_path / "agentd.toml"
    conf.write_text('[node]\nname = "n1"\n')
    running = load_config(conf, env={}, host=Host())
    conf.write_text('[node]\nname = "n1"\n[log]\nlevel = "debug"\n')
    Host.route = False

    async def main():
        agent = Agent(running, config_path=str(conf), set_logging=lambda *_: None)
        agent._reload()
        assert agent.cfg.log.level == "debug" and agent.cfg.node.address == IPv4Address("10.1.1.1")
        assert agent.reload_error is None

    asyncio.run(main())


def test_a_failed_reload_is_in_the_status_line_until_one_succeeds(tmp_path):
    """`systemctl reload` only signals: a refused file shows in STATUS= (systemctl status),
    and the next good reload clears it."""
    conf = tmp_path / "agentd.toml"
    conf.write_text('[node]\nname = "n1"\naddress = "10.1.1.1"\n[bgp]\nhold_time = 2\n')

    async def main():
        agent = Agent(CFG, config_path=str(conf), set_logging=lambda *_: None)
        agent.notifier = _Recorder()
        agent._reload()
        ((kind, line),) = agent.notifier.sent
        assert kind == "STATUS" and line.startswith("not ready: ") and "; last reload failed: " in line, line
        assert "[bgp] hold_time" in line and agent.status_line()[1] == line
        conf.write_text('[node]\nname = "n1"\naddress = "10.1.1.1"\n')
        agent._reload()
        assert agent.notifier.sent[-1][0] == "STATUS" and "reload failed" not in agent.notifier.sent[-1][1]
        assert agent.reload_error is None and "reload failed" not in agent.status_line()[1]

    asyncio.run(main())


def test_a_reload_with_the_default_file_read_at_start_gone_keeps_the_running_configuration(tmp_path, caplog):
    """Started without --config or $AGENTD_CONFIG, from the default file, which is gone for a
    moment at the SIGHUP (an editor's save, a config management run): the reload fails and
    the running peers and log level stay (the defaults would de-configure every external
    peer), and STATUS= says so.  Only a default file missing at start too may stay missing."""
    conf = tmp_path / "agentd.toml"
    conf.write_text('[node]\nname = "n1"\naddress = "10.1.1.1"\n[log]\nlevel = "debug"\n'
                    '[[bgp.peers]]\naddress = "10.9.9.8"\nasn = 64513\n')
    running = load_config(conf, env={})
    applied = []

    async def main():
        agent = Agent(running, config_path=str(conf), config_named=False,
                      set_logging=lambda level, fmt: applied.append(level))
        agent.notifier = _Recorder()
        conf.unlink()
        with caplog.at_level(logging.INFO, logger="agentd"):
            agent._reload()
        assert agent.cfg.bgp.peers == running.bgp.peers and len(agent.cfg.bgp.peers) == 1
        assert agent.cfg.log.level == "debug" and applied == []
        assert agent.reload_error is not None and "no such file" in agent.reload_error, agent.reload_error
        assert agent.notifier.sent[-1][0] == "STATUS" and "last reload failed: " in agent.notifier.sent[-1][1]
        assert "configuration reloaded" not in caplog.text

    asyncio.run(main())


def test_a_default_file_missing_at_start_may_be_missing_at_a_reload_until_it_is_read(tmp_path):
    """The default file missing at start: a reload without it is the defaults and the
    environment, as at start; once a reload has read it, it is required as if read at start."""
    conf = tmp_path / "agentd.toml"

    async def main():
        agent = Agent(CFG, config_path=str(conf), config_named=False, set_logging=lambda *_: None)
        agent.notifier = _Recorder()
        agent._reload()
        assert agent.reload_error is None and agent.cfg.bgp.peers == ()
        conf.write_text('[node]\nname = "n1"\naddress = "10.1.1.1"\n[[bgp.peers]]\naddress = "10.9.9.8"\nasn = 64513\n')
        agent._reload()
        assert agent.reload_error is None and len(agent.cfg.bgp.peers) == 1
        conf.unlink()
        agent._reload()
        assert len(agent.cfg.bgp.peers) == 1 and "no such file" in (agent.reload_error or "")

    asyncio.run(main())


def test_a_reload_gives_the_sessions_with_other_nodes_the_new_bfd_timers(tmp_path, caplog):
    """[bgp] bfd, bfd_interval, bfd_multiplier apply at a reload to the sessions with other
    nodes too (mesh or reflector sessions: Peering.peers reads the running configuration), as
    docs/bfd.md says; they waited for a restart."""
    from agentd.daemon.mesh import Peering
    from agentd.datastore.records import NodeRecord

    conf = tmp_path / "agentd.toml"
    conf.write_text('[node]\nname = "n1"\naddress = "10.1.1.1"\n[bgp]\nlisten = ""\n')
    running = load_config(conf, env={})
    conf.write_text('[node]\nname = "n1"\naddress = "10.1.1.1"\n[bgp]\nlisten = ""\nbfd = true\n'
                    'bfd_interval = 0.1\nbfd_multiplier = 5\n')

    async def main():
        agent = Agent(running, config_path=str(conf), set_logging=lambda *_: None)
        agent.notifier = _Recorder()
        with caplog.at_level(logging.INFO, logger="agentd"):
            agent._reload()
        peering = Peering("n1")
        peering.nodes = {"n2": NodeRecord(name="n2", address=IPv4Address("10.1.1.2"), asn=64512,
                                          subnet=IPv4Network("10.244.2.0/24"), route_reflector=False, cluster_id=None)}
        (node,) = peering.peers(agent.cfg)
        assert node.bfd == (0.1, 5)
        assert "applied only by a restart" not in caplog.text

    asyncio.run(main())


def test_a_lost_subnet_stops_bgp_withdrawing_not_gracefully(tmp_path):
    """graceful_restart (the default) keeps forwarding state that is still valid: a subnet
    another node took is not.  Stopped gracefully, every peer kept our route to it as stale
    (external routers sending its traffic here) and its blackhole stayed for the next run to
    adopt; the stop withdraws instead: a Cease, our routes and devices removed."""
    calls: list[tuple] = []

    class Part:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getattr__(self, method: str):
            async def call(*_a, **kw):
                calls.append((self.name, method, kw))
            return call

    async def main():
        agent = Agent(_cfg(tmp_path))
        assert agent.cfg.bgp.graceful_restart
        agent.started_bgp = True
        agent.service, agent.programmer, agent.tunnels = Part("bgp"), Part("routes"), Part("tunnels")
        agent._subnet_lost(SubnetLease(IPv4Network("10.244.7.0/24"), "n1", IPv4Address("10.1.1.1"), "host-gw"))
        await agent._shutdown()

    asyncio.run(main())
    stops = [c for c in calls if c[1] == "stop" and c[0] in ("bgp", "routes", "tunnels")]
    assert stops == [("bgp", "stop", {"graceful": False}), ("routes", "stop", {"remove_routes": True}),
                     ("tunnels", "stop", {"remove": True})]


def test_a_leave_closes_its_masquerading_before_removing_the_tables(monkeypatch):
    """The running masquerading's check (every CHECK_INTERVAL, not a supervised task) took the
    tables the leave had just removed for ones someone else deleted, and wrote them again
    before the later "closing masquerading" step: `agentd leave` said done, the tables stayed
    (review s57 r17)."""
    import agentd.daemon.agent as agent_module

    order = []

    class Masq:
        async def close(self):
            order.append("closed")

    async def remove():
        order.append("removed")
        return True

    monkeypatch.setattr(agent_module, "nft_missing", lambda: asyncio.sleep(0, None))
    monkeypatch.setattr(agent_module.masquerade, "remove", remove)

    async def main():
        agent = Agent(CFG)
        agent.masq = Masq()
        await agent._remove_masquerading()
        assert agent.masq is None  # the later "closing masquerading" step has nothing left to close

    asyncio.run(main())
    assert order == ["closed", "removed"]
