"""``agentd leave`` reports every step of the leave with its result (agentd/daemon/leave_report.py):
the report as text and exit status, the file a leaving agent writes, what the running agent's
stop records, what the CLI prints from GET /leave and the file, and the leave with no agent."""

from __future__ import annotations

import asyncio
import io
import json
import os
import stat
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import pytest
from agent_config import agent_cfg as _cfg

from agentd import cli
from agentd.cni import netconf as agentd_netconf
from agentd.daemon import agent as agent_module
from agentd.daemon import node_files
from agentd.daemon.agent import (
    BE_LIBERAL_STEP,
    CONFLIST_STEP,
    ETCD_STEP,
    KEPT_SUBNETS_STEP,
    POD_MACS_STEP,
    SUBNET_FILE_STEP,
    TOKEN_STEP,
    Agent,
)
from agentd.daemon.leave_report import (
    DONE,
    FAILED,
    SKIPPED,
    LeaveReport,
    LeaveStep,
    ReportError,
    exit_code,
    read_report,
    render,
    summary,
    write_report,
)
from agentd.datastore.records import ClusterConfig, SubnetLease
from agentd.policy.agent import PolicyAgent
from agentd.policy.podmacs import STATE_FILE, PodMacs

# ------------------------------------------------------------------ the report, pure


def _report(*steps: tuple[str, str, str], finished: bool = True) -> LeaveReport:
    return LeaveReport("n1", "abc", steps=[LeaveStep(*s) for s in steps], finished=finished)


def test_each_step_is_one_line_with_its_result_and_reason():
    assert LeaveStep("leaving etcd", DONE).line() == "leaving etcd: done"
    assert LeaveStep("removing the policy tables", FAILED, "Operation not permitted").line() == \
        "removing the policy tables: failed: Operation not permitted"
    assert LeaveStep("stopping the ingress proxy", SKIPPED, "Ingress is not enabled here").line() == \
        "stopping the ingress proxy: skipped: Ingress is not enabled here"


def test_exit_status_is_0_only_when_every_step_ran_and_none_failed():
    done = _report(("a", DONE, ""), ("b", SKIPPED, "not here"))
    assert exit_code(done) == 0
    assert summary(done) == "node n1 left the cluster and this host is cleaned up (1 done, 1 skipped)"
    failed = _report(("a", DONE, ""), ("b", FAILED, "boom"), ("c", FAILED, "bang"))
    assert exit_code(failed) == 1
    assert summary(failed).startswith("node n1 left, but not cleanly: b, c failed (1 done, 2 failed)")
    unfinished = _report(("a", DONE, ""), finished=False)
    assert exit_code(unfinished) == 1
    assert summary(unfinished) == "node n1: the leave did not finish (1 done; last step: a)"
    assert exit_code(_report(finished=False)) == 1
    assert render(failed).splitlines() == ["a: done", "b: failed: boom", "c: failed: bang", summary(failed)]


def test_the_report_file_is_written_whole_and_readable_by_all(tmp_path):
    path = tmp_path / "state" / "leave.json"  # the state directory is made if it is missing
    report = _report(("a", DONE, ""), ("b", FAILED, "boom"))
    old = os.umask(0o077)
    try:
        write_report(path, report)
    finally:
        os.umask(old)
    assert read_report(path) == report
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # `agentd leave` as a token_group member reads it
    assert sorted(p.name for p in path.parent.iterdir()) == ["leave.json"]  # no temporary file left


@pytest.mark.parametrize("content, message", [
    (None, "there is no leave report at"),
    ("{", "not JSON"),
    ("[]", "not a leave report"),
    ('{"node": "n1", "id": "x", "finished": true}', "not a leave report"),
    ('{"node": "n1", "id": "x", "finished": true, "steps": [{"name": "a", "result": "maybe"}]}',
     "a step's result is 'maybe'"),
])
def test_a_bad_report_file_is_one_clear_error(tmp_path, content, message):
    path = tmp_path / "leave.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ReportError, match=message) as err:
        read_report(path)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ the running agent's leave


class Part:
    """A built part of the agent: ``fail`` names a call that raises."""

    def __init__(self, fail: str | None = None, error: Exception | None = None) -> None:
        self.fail, self.error = fail, error

    def __getattr__(self, method):
        async def call(*args, **kwargs):
            if method == self.fail:
                raise self.error or OSError(f"{method} failed")
        return call


class Store:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    async def release(self, name, timeout=None):
        if self.fail:
            raise TimeoutError("etcd did not answer within 10 s")
        return ["10.244.1.0/24"]

    async def remove_node(self, name, timeout=None):
        pass

    async def connect(self, timeout=None):
        pass

    async def close(self):
        pass


@pytest.fixture
def host(monkeypatch):
    """What the leave removes from the host without a built part: nothing to do here."""
    async def nothing(*_a, **_kw):
        return []

    for name in ("remove_policy_tables", "remove_services_table", "remove_worker_leftovers"):
        monkeypatch.setattr(agent_module, name, nothing)
    for name in ("remove_bpf_leftovers", "remove_vxlan_leftover", "remove_ingress_proxy", "restore_sysctls"):
        monkeypatch.setattr(agent_module, name, lambda *_a, **_kw: [])
    monkeypatch.setattr(agent_module.flowmask, "remove", lambda: None)
    monkeypatch.setattr(agent_module.masquerade, "remove", nothing)
    monkeypatch.setattr(agent_module, "nft_missing", lambda: asyncio.sleep(0, None))

    async def remove_routes_of(protocol, networks):
        return [], []
    monkeypatch.setattr(agent_module, "remove_routes_of", remove_routes_of)


def test_a_leaving_agent_reports_every_step_with_its_result(tmp_path, host):
    """POST /leave answered once the node had left etcd, and nothing said whether the routes,
    tables, BPF data path and devices went: now every step is in the report, GET /leave serves
    it while the API is up, and the file in the state directory has its end."""
    cfg = _cfg(tmp_path, **{"bgp.graceful_restart": False})
    seen = {}

    async def main():
        agent = Agent(cfg)
        agent.started_bgp = True
        agent.service = Part()
        agent.programmer = Part()
        agent.tunnels = Part(fail="stop", error=RuntimeError("the BPF data path: cannot detach agentd_tc: EPERM"))
        agent.policy = Part(fail="leave", error=RuntimeError("the policy tables stay: Operation not permitted"))
        agent.datastore = Store()
        agent.request_leave()
        seen["first"] = json.loads((await agent.api._leave_progress(None)).body)
        answering = asyncio.ensure_future(agent.api._leave(None))  # the leave under way: the same one
        await agent._shutdown()
        seen["answer"] = json.loads((await answering).body)
        return agent

    agent = asyncio.run(main())
    report = read_report(tmp_path / "state" / "leave.json")
    assert report.finished and report.node == "n1" and report.agent
    assert seen["first"] == {"node": "n1", "id": report.id, "agent": True, "finished": False, "steps": []}
    assert seen["answer"]["id"] == report.id and seen["answer"]["report"] == str(tmp_path / "state" / "leave.json")
    results = {s.name: (s.result, s.reason) for s in report.steps}
    assert results[ETCD_STEP] == (DONE, "")
    assert results["closing the BGP sessions with a Cease (the peers withdraw our routes)"] == (DONE, "")
    assert results["removing this node's kernel routes"] == (DONE, "")
    assert results["removing the tunnel devices and the BPF data path"] == \
        (FAILED, "the BPF data path: cannot detach agentd_tc: EPERM")
    assert results["removing the policy tables and the pod fast path"] == \
        (FAILED, "the policy tables stay: Operation not permitted")
    assert results["removing the services table"][0] == SKIPPED  # services never started here
    assert results["stopping the ingress proxy"] == \
        (SKIPPED, ("Ingress is not enabled here ([ingress] enabled = false; the host clean-up below stops a proxy "
                   "a previous run left)"))
    assert results["removing the subnet file"] == (DONE, "")
    assert exit_code(report) == 1 and agent.exit_status == 0  # exits 0: Restart=on-failure must not rejoin


def _subnets_kept(cfg) -> None:
    """The files a running agent wrote that name its subnet: the subnet file, and its record in
    [agent] state_dir (which survives a reboot)."""
    node_files.write_cni_files(cfg, ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "host-gw", "always"),
                               {4: SubnetLease(IPv4Network("10.244.3.0/24"), "n1", IPv4Address("10.1.1.1"),
                                               "host-gw")}, 1450)
    assert node_files.previous_subnets(cfg)


@pytest.mark.parametrize("agent_running", [True, False])
def test_a_left_node_does_not_take_its_old_subnet_back(tmp_path, host, monkeypatch, agent_running):
    """A node that left, started again (by hand, or at boot by docker.service's Wants=), would
    ask for its old subnet first: the leave removes the record of it in [agent] state_dir, and
    the subnet file -- a leave without an agent too."""
    cfg = _cfg(tmp_path, **{"cni.write_conflist": False})
    _subnets_kept(cfg)
    if agent_running:
        async def main():
            agent = Agent(cfg)
            agent.datastore = Store()
            agent.request_leave()
            await agent._shutdown()
        asyncio.run(main())
        report = read_report(tmp_path / "state" / "leave.json")
    else:
        monkeypatch.setattr(agent_module, "datastore_for", lambda cfg: Store())
        report = asyncio.run(agent_module.leave(cfg))
    assert LeaveStep(KEPT_SUBNETS_STEP, DONE) in report.steps and LeaveStep(SUBNET_FILE_STEP, DONE) in report.steps
    assert node_files.previous_subnets(cfg) == {}
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["leave.json"]


class Policy(Part):
    """A built policy agent whose pod MACs file (agentd/policy/podmacs.py) is real."""

    remove_pod_macs = PolicyAgent.remove_pod_macs

    def __init__(self, state_dir: Path) -> None:
        super().__init__()
        self.pod_macs = PodMacs(state_dir)


PODS = {"c1": {"ident": "g:1", "mac": "0a:58:0a:f4:01:05"}}


@pytest.mark.parametrize("policy_built", [True, False])
def test_a_leaving_agent_removes_the_pod_macs_file(tmp_path, host, policy_built):
    """`agentd leave` left <state_dir>/pod-macs.json behind, the MACs read of the departed
    node's pods: a step of the leave removes it now -- the policy agent's (which writes it no
    more), or, before network policy started, the file a previous run left."""
    state = tmp_path / "state"

    async def main():
        agent = Agent(_cfg(tmp_path))
        agent.datastore = Store()
        agent.policy = Policy(state) if policy_built else None
        PodMacs(state).write(PODS)
        agent.request_leave()
        await agent._shutdown()
        return agent

    agent = asyncio.run(main())
    report = read_report(state / "leave.json")
    assert LeaveStep(POD_MACS_STEP, DONE) in report.steps
    assert sorted(p.name for p in state.iterdir()) == ["leave.json"]
    if policy_built:  # a write after the leave (a cancelled task's thread) writes nothing
        assert agent.policy.pod_macs.write(PODS) and not (state / STATE_FILE).exists()


def test_a_pod_macs_file_that_cannot_be_removed_fails_its_step(tmp_path, host):
    state = tmp_path / "state"
    (state / STATE_FILE).mkdir(parents=True)  # (EISDIR: a file the leave cannot remove)

    async def main():
        agent = Agent(_cfg(tmp_path))
        agent.datastore = Store()
        agent.request_leave()
        await agent._shutdown()

    asyncio.run(main())
    steps = {s.name: s for s in read_report(state / "leave.json").steps}
    assert steps[POD_MACS_STEP].result == FAILED and "Is a directory" in steps[POD_MACS_STEP].reason


def test_a_leave_whose_etcd_step_failed_reports_it_failed(tmp_path, host):
    """The etcd step caught its own error: the report said done while POST /leave said why not."""
    async def main():
        agent = Agent(_cfg(tmp_path))
        agent.datastore = Store(fail=True)
        left = agent.request_leave()
        await agent._shutdown()
        return left.result()

    etcd_error = asyncio.run(main())
    report = read_report(tmp_path / "state" / "leave.json")
    assert etcd_error == "etcd did not answer within 10 s"
    assert LeaveStep(ETCD_STEP, FAILED, "etcd did not answer within 10 s") in report.steps
    assert exit_code(report) == 1


def test_get_leave_says_when_no_leave_is_under_way(tmp_path):
    async def main():
        return await Agent(_cfg(tmp_path)).api._leave_progress(None)

    answer = asyncio.run(main())
    assert answer.status == 404 and b"not leaving" in answer.body


# ------------------------------------------------------------------ the leave with no agent


def test_a_leave_with_no_agent_reports_each_part_of_the_host(tmp_path, host, monkeypatch):
    """`agentd leave` with no agent exited 1 or 0 and said only that in its log."""
    monkeypatch.setattr(agent_module, "datastore_for", lambda cfg: Store(fail=True))

    async def policy_fails():
        raise agent_module.NftError("Could not process rule: Operation not permitted")
    monkeypatch.setattr(agent_module, "remove_policy_tables", policy_fails)
    monkeypatch.setattr(agent_module, "nft_missing", lambda: asyncio.sleep(0, None))
    PodMacs(tmp_path / "state").write(PODS)
    printed = []
    report = asyncio.run(agent_module.leave(_cfg(tmp_path), on_step=printed.append))
    assert printed == report.steps and report.finished and not report.agent
    results = {s.name: (s.result, s.reason) for s in report.steps}
    assert results[ETCD_STEP] == (FAILED, "etcd did not answer within 10 s")
    assert results["removing the policy tables"] == (FAILED, "Could not process rule: Operation not permitted")
    for name in ("removing what is left of the BPF data path, the pod fast path and the tunnels",
                 "removing the services table and the DNS address", "stopping the ingress proxy a previous run left",
                 "removing the kernel routes of proto 143", POD_MACS_STEP, "putting back the flow records' sysctls",
                 "removing the flow mask table", "removing the masquerading tables"):
        assert results[name] == (DONE, ""), name
    assert not (tmp_path / "state" / STATE_FILE).exists()  # the MACs read of the node's pods
    assert read_report(tmp_path / "state" / "leave.json") == report
    assert exit_code(report) == 1


def test_without_libnftables_the_table_steps_are_skipped_saying_why(tmp_path, host, monkeypatch):
    monkeypatch.setattr(agent_module, "datastore_for", lambda cfg: Store())
    monkeypatch.setattr(agent_module, "nft_missing", lambda: asyncio.sleep(0, "cannot load libnftables"))
    report = asyncio.run(agent_module.leave(_cfg(tmp_path)))
    skipped = {s.name: s.reason for s in report.steps if s.result == SKIPPED}
    assert set(skipped) == {"removing the policy tables", "removing the flow mask table",
                            "removing the masquerading tables"}
    assert all("cannot load libnftables" in why for why in skipped.values())
    assert exit_code(report) == 0


# ------------------------------------------------------------------ what `agentd leave` prints


class Answer(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _agent_api(monkeypatch, answer: dict, progress: list):
    """An agent's API: POST /leave answers ``answer``; each GET /leave the next of
    ``progress`` (a report's JSON, or an exception: the API has stopped)."""
    def api_open(req, timeout, deadline=None):
        if getattr(req, "method", None) == "POST":
            return Answer(json.dumps(answer).encode())
        nxt = progress.pop(0) if progress else OSError("connection refused")
        if isinstance(nxt, Exception):
            raise nxt
        return Answer(json.dumps(nxt).encode())
    monkeypatch.setattr(cli, "api_open", api_open)
    monkeypatch.setattr(cli, "LEAVE_POLL", 0)


def test_the_cli_prints_every_step_once_from_the_api_then_the_file(tmp_path, monkeypatch):
    path = tmp_path / "leave.json"
    steps = [("leaving etcd", DONE, ""), ("removing the policy tables", FAILED, "Operation not permitted"),
             ("stopping the ingress proxy", SKIPPED, "Ingress is not enabled here")]
    running = _report(*steps[:1], finished=False)
    write_report(path, _report(*steps))
    _agent_api(monkeypatch, {"leaving": True, "etcd_error": None, "id": "abc", "report": str(path)},
               [running.to_json(), running.to_json()])
    out = io.StringIO()
    code = cli.leave_running_agent("127.0.0.1", 9, tmp_path / "api.token", out=out)
    assert code == 1
    assert out.getvalue().splitlines() == ["leaving etcd: done", "removing the policy tables: failed: Operation not permitted",
                                           "stopping the ingress proxy: skipped: Ingress is not enabled here",
                                           summary(_report(*steps))]


def test_the_cli_exits_0_when_every_step_was_done_or_skipped(tmp_path, monkeypatch):
    path = tmp_path / "leave.json"
    write_report(path, _report(("leaving etcd", DONE, ""), ("stopping the ingress proxy", SKIPPED, "off")))
    _agent_api(monkeypatch, {"leaving": True, "etcd_error": None, "id": "abc", "report": str(path)}, [])
    out = io.StringIO()
    assert cli.leave_running_agent("127.0.0.1", 9, tmp_path / "api.token", out=out) == 0
    assert out.getvalue().splitlines()[-1].startswith("node n1 left the cluster and this host is cleaned up")


def test_the_cli_does_not_take_an_older_leaves_report_for_this_one(tmp_path, monkeypatch, capsys):
    path = tmp_path / "leave.json"
    old = _report(("leaving etcd", DONE, ""))
    old.id = "older"
    write_report(path, old)
    _agent_api(monkeypatch, {"leaving": True, "etcd_error": None, "id": "abc", "report": str(path)}, [])
    out = io.StringIO()
    code = cli.leave_running_agent("127.0.0.1", 9, tmp_path / "api.token", timeout=0.05, out=out)
    err = capsys.readouterr().err
    assert code == 1 and out.getvalue() == ""
    assert err.startswith("agentd leave: the agent had not finished leaving after 0.05 s") and "another leave" in err
    assert len(err.splitlines()) == 1


def test_the_cli_says_at_once_when_the_report_cannot_be_read(tmp_path, monkeypatch, capsys):
    path = tmp_path / "leave.json"
    path.write_text("{")  # (unreadable alike: a permission error is a ReportError that is not `missing`)
    _agent_api(monkeypatch, {"leaving": True, "etcd_error": None, "id": "abc", "report": str(path)}, [])
    code = cli.leave_running_agent("127.0.0.1", 9, tmp_path / "api.token", timeout=3600, out=io.StringIO())
    err = capsys.readouterr().err
    assert code == 1 and err == f"agentd leave: the agent's API has stopped, and {path}: not JSON\n"


def test_the_cli_with_no_wait_returns_after_the_etcd_step(tmp_path, monkeypatch):
    path = tmp_path / "leave.json"
    _agent_api(monkeypatch, {"leaving": True, "etcd_error": "etcd did not answer within 10 s", "id": "abc",
                             "report": str(path)}, [])
    out = io.StringIO()
    assert cli.leave_running_agent("127.0.0.1", 9, tmp_path / "api.token", wait=False, out=out) == 1
    lines = out.getvalue().splitlines()
    assert lines[0] == "leaving etcd: failed: etcd did not answer within 10 s" and str(path) in lines[1]


def test_the_cli_facing_an_older_agent_says_what_it_knows(tmp_path, monkeypatch):
    """An agent from before leave reports answers the etcd step only; `agentd leave` returns
    once it has exited (its API no longer answers)."""
    asked = []
    _agent_api(monkeypatch, {"leaving": True, "etcd_error": "etcd did not answer within 10 s"},
               [{"ok": False}, OSError("connection refused")])
    api_open = cli.api_open
    monkeypatch.setattr(cli, "api_open", lambda req, timeout, deadline=None: asked.append(getattr(req, "method", req)) or
                        api_open(req, timeout, deadline=deadline))
    out = io.StringIO()
    assert cli.leave_running_agent("127.0.0.1", 9, Path("/nonexistent/api.token"), out=out) == 1
    assert out.getvalue().splitlines()[0] == "leaving etcd: failed: etcd did not answer within 10 s"
    assert asked == ["POST", "http://127.0.0.1:9/healthz", "http://127.0.0.1:9/healthz"]


def test_the_cli_refuses_an_answer_that_is_no_leave(tmp_path, monkeypatch):
    _agent_api(monkeypatch, {"error": "something else listens here"}, [])
    with pytest.raises(cli.LeaveRefused, match="not as an agent taking a leave"):
        cli.leave_running_agent("127.0.0.1", 9, tmp_path / "api.token")



def test_a_leave_tells_systemd_before_each_step_that_the_stop_takes_longer(tmp_path, host):
    """STOPPING=1 starts systemd's TimeoutStopSec (30 s): a leave's steps on an unreachable etcd
    and an ingress proxy took longer, systemd killed the agent and Restart=on-failure started
    it again -- into the cluster it was leaving.  Each step now extends the timeout first."""
    sent = []

    async def main():
        agent = Agent(_cfg(tmp_path, **{"bgp.graceful_restart": False}))
        agent.notifier.notify = lambda *lines: sent.extend(lines) or True
        agent.started_bgp = True
        agent.service = Part()
        agent.programmer = Part()
        agent.tunnels = Part()
        agent.datastore = Store()
        agent.request_leave()
        await agent._shutdown()

    asyncio.run(main())
    steps = read_report(tmp_path / "state" / "leave.json").steps
    extends = [line for line in sent if line.startswith("EXTEND_TIMEOUT_USEC=")]
    ran = [s for s in steps if s.result != SKIPPED]
    assert sent.index("STOPPING=1") < sent.index(extends[0])
    assert len(extends) >= len(ran) and set(extends) == {f"EXTEND_TIMEOUT_USEC={agent_module.LEAVE_STEP_SECONDS * 10**6}"}


def test_a_stop_that_is_no_leave_extends_nothing(tmp_path, host):
    sent = []

    async def main():
        agent = Agent(_cfg(tmp_path))
        agent.notifier.notify = lambda *lines: sent.extend(lines) or True
        agent.service = Part()
        await agent._shutdown()

    asyncio.run(main())
    assert "STOPPING=1" in sent and not [line for line in sent if line.startswith("EXTEND_TIMEOUT_USEC=")]


def test_the_cli_facing_an_older_agent_with_no_wait_returns_after_the_etcd_step(monkeypatch):
    asked = []
    _agent_api(monkeypatch, {"leaving": True, "etcd_error": None}, [{"ok": False}])
    api_open = cli.api_open
    monkeypatch.setattr(cli, "api_open", lambda req, timeout, deadline=None: asked.append(getattr(req, "method", req)) or
                        api_open(req, timeout, deadline=deadline))
    out = io.StringIO()
    assert cli.leave_running_agent("127.0.0.1", 9, Path("/nonexistent/api.token"), wait=False, out=out) == 0
    assert asked == ["POST"] and out.getvalue().splitlines()[0] == "leaving etcd: done"


def test_a_leave_not_answered_in_time_says_it_may_be_under_way(tmp_path, monkeypatch):
    # "did not answer" read as a refusal while the agent, which had taken the request, left.
    def api_open(req, timeout, deadline=None):
        raise TimeoutError("timed out")

    monkeypatch.setattr(cli, "api_open", api_open)
    with pytest.raises(cli.LeaveRefused, match=r"took the request .* it may be leaving; see GET .*/leave while it runs, "
                                               r"then .*leave\.json"):
        cli.leave_running_agent("127.0.0.1", 9, Path("/nonexistent/api.token"), timeout=1,
                                report_path=tmp_path / "leave.json")


# ------------------------------------------------------------------ the CNI conflist, the token file


def _write_conflist(cfg, mtu: int = 1450, **changed) -> Path:
    """The conflist the agent writes ([cni] write_conflist), ``changed`` an operator's own."""
    from agentd.daemon import node_files

    settings = {**node_files._conflist_settings(cfg), **changed}
    return Path(agentd_netconf.write_conflist(cfg.cni.conf_dir, mtu=mtu, **settings))


@pytest.mark.parametrize("agent", [True, False])
def test_a_leave_removes_the_conflist_the_agent_wrote(tmp_path, host, monkeypatch, agent):
    """Left, the runtime kept choosing agentd (10-agentd.conflist sorts first) and every new
    pod's ADD failed with "agent not running" instead of falling through to another network."""
    cfg = _cfg(tmp_path)
    conflist = _write_conflist(cfg)
    if agent:
        async def main():
            a = Agent(cfg)
            a.datastore = Store()
            a.request_leave()
            await a._shutdown()
        asyncio.run(main())
        report = read_report(tmp_path / "state" / "leave.json")
    else:
        monkeypatch.setattr(agent_module, "datastore_for", lambda cfg: Store())
        report = asyncio.run(agent_module.leave(cfg))
    assert LeaveStep(CONFLIST_STEP, DONE) in report.steps
    assert LeaveStep(BE_LIBERAL_STEP, DONE) in report.steps
    assert not conflist.exists() and exit_code(report) == 0


def test_a_leave_keeps_an_operators_own_file_of_that_name(tmp_path, host, monkeypatch):
    cfg = _cfg(tmp_path)
    conflist = _write_conflist(cfg)
    conflist.write_text(json.dumps({"cniVersion": "1.0.0", "name": "mine", "plugins": [{"type": "bridge"}]}))
    monkeypatch.setattr(agent_module, "datastore_for", lambda cfg: Store())
    report = asyncio.run(agent_module.leave(cfg))
    steps = {s.name: s for s in report.steps}
    assert steps[CONFLIST_STEP].result == SKIPPED and "not one agentd writes" in steps[CONFLIST_STEP].reason
    assert conflist.exists()
    conflist.write_text("{not json")
    report = asyncio.run(agent_module.leave(cfg))
    assert conflist.exists() and {s.name: s.result for s in report.steps}[CONFLIST_STEP] == SKIPPED


def test_without_write_conflist_the_leave_has_no_conflist_step(tmp_path, host, monkeypatch):
    cfg = _cfg(tmp_path, **{"cni.write_conflist": False})
    conflist = _write_conflist(cfg)
    monkeypatch.setattr(agent_module, "datastore_for", lambda cfg: Store())
    report = asyncio.run(agent_module.leave(cfg))
    assert CONFLIST_STEP not in {s.name for s in report.steps} and conflist.exists()


def test_the_leave_without_an_agent_removes_a_killed_agents_token_file(tmp_path, host, monkeypatch):
    cfg = _cfg(tmp_path)
    cfg.api.token_file.write_text("a-killed-agents-token\n")
    monkeypatch.setattr(agent_module, "datastore_for", lambda cfg: Store())
    report = asyncio.run(agent_module.leave(cfg))
    assert LeaveStep(TOKEN_STEP, DONE) in report.steps and not cfg.api.token_file.exists()
    report = asyncio.run(agent_module.leave(cfg))  # none there: nothing to do
    assert LeaveStep(TOKEN_STEP, DONE) in report.steps


def test_a_missing_etcd_tls_file_fails_the_etcd_step_alone(tmp_path, host):
    """`agentd leave` without an agent loads etcd's TLS files unchecked (agentd/cli.py): the
    etcd step names the missing one, and the host's steps all run."""
    (tmp_path / "ca.pem").write_text("")
    cfg = _cfg(tmp_path, **{"etcd.ca": str(tmp_path / "ca.pem"), "etcd.endpoints": "https://192.0.2.2:2379"})
    (tmp_path / "ca.pem").unlink()  # there when loaded, gone at the leave
    report = asyncio.run(agent_module.leave(cfg))
    results = {s.name: (s.result, s.reason) for s in report.steps}
    assert results[ETCD_STEP] == (FAILED, f"etcd TLS ca file '{tmp_path}/ca.pem': No such file or directory")
    assert [s.name for s in report.steps if s.result == FAILED] == [ETCD_STEP]
    assert results["removing the kernel routes of proto 143"] == (DONE, "")
