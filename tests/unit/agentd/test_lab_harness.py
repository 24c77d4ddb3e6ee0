"""The lab harness's own logic (agentd.lab): what a killed run leaves, pod names, waits, replies,
hung plugins, the compose lab's engine -- pure, no root, no namespaces."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest

from agentd.lab import compose, netns, runtime
from agentd.lab.errors import LabError
from agentd.lab.lab import Lab, LabPod, LabSpec
from agentd.lab.readiness import Readiness
from agentd.lab.wait import auntil, until

# ------------------------------------------------------------------ a killed run


def test_this_run_ends_with_its_teardown_on_sigterm_and_ties_its_daemons():
    """tests/conftest.py's pytest_configure, in this very process (an xdist worker or not)."""
    from agentd.lab.fixtures import on_sigterm

    assert signal.getsignal(signal.SIGTERM) is on_sigterm
    assert "preexec_fn" in netns.tied({"stdin": subprocess.DEVNULL})


def test_sigterm_runs_the_fixture_finalizers(tmp_path):
    """A run sent SIGTERM tears down (a KeyboardInterrupt), once; without the handler pytest
    dies at once and the finalizer -- a lab's down -- never runs."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        def pytest_configure(config):
            from agentd.lab.fixtures import end_run_on_sigterm
            end_run_on_sigterm()
    """))
    (tmp_path / "test_killed.py").write_text(textwrap.dedent("""
        import os, pathlib, signal, pytest

        @pytest.fixture
        def lab(tmp_path_factory):
            yield
            os.kill(os.getpid(), signal.SIGTERM)  # a second one: the teardown goes on
            pathlib.Path(os.environ["DOWN_MARK"]).write_text("down")

        def test_runs(lab):
            os.kill(os.getpid(), signal.SIGTERM)
    """))
    mark = tmp_path / "down"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(tmp_path / "test_killed.py")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False, env={"DOWN_MARK": str(mark), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert mark.read_text() == "down", proc.stdout + proc.stderr
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stdout + proc.stderr


def test_tied_children_get_the_parent_death_signal_from_the_main_thread_only(monkeypatch):
    monkeypatch.setattr(netns, "_tie_children", True)
    kwargs = netns.tied({"start_new_session": True})
    out = subprocess.run(
        [sys.executable, "-c", ("import ctypes, signal; s = ctypes.c_int(); "
                                "ctypes.CDLL(None).prctl(2, ctypes.byref(s), 0, 0, 0); print(s.value)")],  # PR_GET_PDEATHSIG
        capture_output=True, text=True, check=True, timeout=60, **kwargs,
    ).stdout  # fmt: skip
    assert int(out) == signal.SIGKILL
    got = []
    # From another thread (asyncio.to_thread): the signal would come when that thread ends.
    t = threading.Thread(target=lambda: got.append(netns.tied({"start_new_session": True})))
    t.start()
    t.join()
    assert got == [{"start_new_session": True}]
    monkeypatch.setattr(netns, "_tie_children", False)  # `agentd lab up`: its daemons outlive it
    assert netns.tied({"start_new_session": True}) == {"start_new_session": True}


def test_the_next_run_deletes_only_the_namespaces_of_runs_that_died(tmp_path, monkeypatch):
    monkeypatch.setattr(netns, "OWNERS_DIR", str(tmp_path))
    monkeypatch.setattr(netns, "_tie_children", True)
    netns._record_owner("ad-live-node1")  # this run: still going
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()  # fmt: skip
    (tmp_path / "ad-dead-node1").write_text(f"{dead} 12345\n")  # a process gone
    (tmp_path / "ad-gone-node1").write_text(f"{dead} 12345\n")  # ... and its namespace already deleted
    (tmp_path / "ad-reused-node1").write_text(f"{os.getpid()} 1\n")  # a PID another process has now
    (tmp_path / "other-ns").write_text(f"{dead} 12345\n")  # not a name of ours: never touched
    deleted = []
    monkeypatch.setattr(netns.Netns, "exists", lambda self: self.name != "ad-gone-node1")
    monkeypatch.setattr(netns.Netns, "delete", lambda self: deleted.append(self.name) or netns._forget_owner(self.name))
    assert netns.sweep_dead_owners() == ["ad-dead-node1", "ad-reused-node1"]
    assert deleted == ["ad-dead-node1", "ad-reused-node1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ad-live-node1", "other-ns"]
    monkeypatch.setattr(netns, "_tie_children", False)  # `agentd lab up`'s namespaces: never recorded
    netns._record_owner("ad-cli-node1")
    assert not (tmp_path / "ad-cli-node1").exists()


def test_a_dead_runs_docker_engine_is_stopped_before_its_namespace_goes(tmp_path, monkeypatch):
    """A killed run's recorded namespace with a Docker engine in it (the compose lab's, a
    Docker-host node's): the engine is stopped first (its containers live in namespaces of
    their own, which killing the namespace's processes would leave); a failing stop does not
    keep the namespace."""
    from agentd.lab import dockerd, fixtures

    monkeypatch.setattr(netns, "OWNERS_DIR", str(tmp_path / "owners"))
    monkeypatch.setattr(dockerd, "RUN_ROOT", tmp_path / "run")
    (tmp_path / "owners").mkdir()
    (tmp_path / "run" / "lab-t1-node2").mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()  # fmt: skip
    for name in ("ad-compose_c1-docker", "ad-t1-node2", "ad-t1-node1"):
        (tmp_path / "owners" / name).write_text(f"{dead} 12345\n")
    engine = fixtures.engine_of_namespace("ad-compose_c1-docker")
    assert engine.name == "compose-c1" and engine.netns.name == "ad-compose_c1-docker"
    engine = fixtures.engine_of_namespace("ad-t1-node2")
    assert engine.name == "lab-t1-node2" and engine.run_root == tmp_path / "run" / "lab-t1-node2" and engine.shared_netns
    assert fixtures.engine_of_namespace("ad-t1-node1") is None  # no engine ran there
    assert fixtures.engine_of_namespace("ad-t1-node2-pod1") is None
    events = []

    def stop(self, **kwargs):
        events.append(("stop", self.name))
        if self.name == "compose-c1":
            raise OSError("dockerd is gone")

    monkeypatch.setattr(dockerd.DockerEngine, "stop", stop)
    monkeypatch.setattr(netns.Netns, "exists", lambda self: True)
    monkeypatch.setattr(netns.Netns, "delete", lambda self: events.append(("delete", self.name)))
    assert netns.sweep_dead_owners(before_delete=fixtures.stop_engine_in) == [
        "ad-compose_c1-docker", "ad-t1-node1", "ad-t1-node2"]
    assert events == [("stop", "compose-c1"), ("delete", "ad-compose_c1-docker"), ("delete", "ad-t1-node1"),
                      ("stop", "lab-t1-node2"), ("delete", "ad-t1-node2")]  # fmt: skip


def test_the_shared_compose_engine_namespace_is_recorded_as_the_runs(tmp_path, monkeypatch):
    """The test run's compose engine is made by the ``compose up`` command (which records
    nothing: its engine outlives it); the run records its namespace as its own first."""
    monkeypatch.setattr(netns, "OWNERS_DIR", str(tmp_path))
    monkeypatch.setattr(netns, "_tie_children", True)

    def cli(name, *args, **kwargs):
        assert (tmp_path / "ad-compose_c2-docker").exists()  # recorded before up makes it
        return SimpleNamespace(returncode=1, stdout="", stderr="no")

    monkeypatch.setattr(compose, "cli", cli)
    monkeypatch.setattr(compose, "leftovers", lambda engine: [])
    with pytest.raises(LabError, match="compose up failed"), compose.shared_engine("c2"):
        pass
    assert (tmp_path / "ad-compose_c2-docker").read_text().split()[0] == str(os.getpid())


# ------------------------------------------------------------------ pods


def _node(lab: str = "t"):
    return SimpleNamespace(name="node1", lab=SimpleNamespace(spec=SimpleNamespace(name=lab)))


def test_added_pods_never_share_a_namespace_or_container_id():
    node = _node()
    pairs = [(("a-b", "c"), ("a", "b-c")), (("a", "b-c.d"), ("a-b", "c.d")), (("x" * 30, "y" * 40), ("x" * 31, "y" * 39))]
    for one, other in pairs:
        a = LabPod(node, namespace=one[0], name=one[1])
        b = LabPod(node, namespace=other[0], name=other[1])
        assert a.ns.name != b.ns.name and a.container_id != b.container_id, (one, other)
    # Nor an added pod a node's (node1-pod1 is default/node1-pod1 too).
    assert LabPod(node, namespace="default", name="node1-pod1").ns.name != LabPod(node, 1).ns.name
    assert LabPod(node, namespace="a", name="b").ns.name == "ad-t-p-a_b"
    long = LabPod(node, namespace="n" * 63, name="m" * 200)
    assert len(long.ns.name) <= 255 and netns.NAME_PREFIX in long.ns.name and len(long.container_id) <= 200


async def test_add_pod_refuses_a_namespace_that_exists(tmp_path, monkeypatch):
    lab = Lab(LabSpec(name="t", nodes=1, pods=0), root=tmp_path)
    attached = []

    async def attach(pod):
        attached.append(pod)

    monkeypatch.setattr(lab, "attach_pod", attach)
    monkeypatch.setattr(netns.Netns, "exists", lambda self: self.name == "ad-t-p-a_b-c")
    with pytest.raises(LabError, match="ad-t-p-a_b-c exists already"):
        await lab.add_pod("node1", "a", "b-c")
    assert attached == [] and lab.pods == []
    with pytest.raises(LabError, match="namespace"):
        await lab.add_pod("node1", "a_b", "c")
    pod = await lab.add_pod("node1", "a-b", "c")
    assert attached == [pod] and pod.ns.name == "ad-t-p-a-b_c"


# ------------------------------------------------------------------ replies, plugins


class _Reply:
    def __init__(self, data: bytes) -> None:
        self.data = [data, b""]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def sendall(self, data: bytes) -> None:
        pass

    def recv(self, n: int) -> bytes:
        return self.data.pop(0)


@pytest.mark.parametrize("reply", [b"", b"garbage", b"\r\n\r\n"])
def test_an_empty_or_foreign_reply_is_none_for_api_or_none(monkeypatch, tmp_path, reply):
    monkeypatch.setattr(netns.Netns, "connect", lambda self, host, port, timeout=5.0: _Reply(reply))
    with pytest.raises(ValueError, match="not an HTTP reply"):
        netns.Netns("ad-x").http_get("http://127.0.0.1:9099/status")
    node = Lab(LabSpec(name="t", nodes=1, pods=0), root=tmp_path).nodes[0]
    assert node.api_or_none("/status") is None


def test_an_http_reply_still_parses(monkeypatch):
    monkeypatch.setattr(netns.Netns, "connect",
                        lambda self, host, port, timeout=5.0: _Reply(b"HTTP/1.0 200 OK\r\nA: b\r\n\r\n{}"))
    assert netns.Netns("ad-x").http_get("http://127.0.0.1:9099/status") == (200, b"{}")


class _HungPlugin:
    def __init__(self) -> None:
        self.killed = self.reaped = False
        self.returncode = None

    async def communicate(self, data: bytes):
        await asyncio.Event().wait()  # never answers

    def kill(self) -> None:
        self.killed = True

    async def wait(self) -> int:
        self.reaped = True
        self.returncode = -9
        return -9


async def test_a_hung_cni_plugin_is_killed_and_said_in_one_line(monkeypatch):
    proc = _HungPlugin()

    async def spawn(*argv, **kw):
        return proc

    monkeypatch.setattr(runtime.asyncio, "create_subprocess_exec", spawn)
    monkeypatch.setattr(runtime, "PLUGIN_TIMEOUT", 0.01)
    pod = SimpleNamespace(container_id="c", ns=SimpleNamespace(path="/run/netns/x"), namespace="a", k8s_name="b",
                          name="a/b", node=SimpleNamespace(ns=SimpleNamespace(name="ad-t-node1")))  # fmt: skip
    with pytest.raises(LabError) as err:
        await runtime._plugin(pod, "agentd-cni", {}, "ADD")
    assert str(err.value) == "agentd-cni ADD for a/b timed out after 0s"
    assert proc.killed and proc.reaped


# ------------------------------------------------------------------ readiness, waits


class _Node:
    def __init__(self, name: str, status, routes: list[str]) -> None:
        self.name, self.status, self.routes = name, status, routes
        self.log_path = f"/nonexistent/{name}.log"

    def agent_pid(self):
        return 1

    def api_or_none(self, path: str):
        return self.status

    def kernel_routes(self) -> list[str]:
        return self.routes


async def test_routes_are_not_ready_while_a_node_does_not_answer():
    """node2's /status did not answer this poll: its subnet is unknown, so node1 (which has no
    route to it) is not done, even though every subnet known is routed."""
    node1 = _Node("node1", {"node": {"subnet": "10.244.1.0/24"}}, [])
    node2 = _Node("node2", None, ["10.244.1.0/24 via 172.30.0.11 dev eth0"])
    lab = SimpleNamespace(nodes=[node1, node2], pods=[], spec=SimpleNamespace(bgp="mesh"))
    with pytest.raises(LabError, match="node2 not answering"):
        await Readiness(lab).routes(0)
    node2.status = {"node": {"subnet": "10.244.2.0/24"}}
    with pytest.raises(LabError, match="node1 has no route for 10.244.2.0/24"):
        await Readiness(lab).routes(0)
    node1.routes = ["10.244.2.0/24 via 172.30.0.12 dev eth0"]
    await Readiness(lab).routes(0)


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0])
async def test_waits_refuse_a_timeout_that_never_or_already_ended(timeout):
    with pytest.raises(ValueError, match="timeout"):
        until(lambda: False, timeout)
    with pytest.raises(ValueError, match="timeout"):
        await auntil(lambda: False, timeout)


@pytest.mark.parametrize("text", ["nan", "inf", "-5", "0", "x"])
def test_compose_up_refuses_a_timeout_the_lab_cli_refuses(text, capsys, monkeypatch):
    def cmd_up(args):  # never for real here: it would start an engine
        raise AssertionError(f"up ran with --timeout {args.timeout}")

    monkeypatch.setattr(compose, "cmd_up", cmd_up)
    with pytest.raises(SystemExit) as exit_:
        compose.main(["up", "--timeout", text])
    assert exit_.value.code == 2 and "--timeout" in capsys.readouterr().err


# ------------------------------------------------------------------ the compose lab's engine


def test_compose_up_starts_its_own_engine_unless_told(monkeypatch):
    """A Docker engine that answers is not used without --user-engine: its networks would change
    the root network namespace."""
    asked = []

    class Stop(Exception):
        pass

    def private(name):
        raise Stop(name)

    def user():  # never for real here: the test stops where the engine is chosen
        asked.append(1)
        raise Stop("user")

    monkeypatch.setattr(compose.ComposeState, "load", classmethod(lambda cls, name: None))
    monkeypatch.setattr(compose, "user_engine", user)
    monkeypatch.setattr(compose, "private_engine", private)
    for argv in (["up"], ["up", "--private"]):
        with pytest.raises(Stop, match="lab"):
            compose.main(argv)
    assert asked == []
    monkeypatch.setattr(compose, "user_engine", lambda: None)
    assert compose.main(["up", "--user-engine"]) == 1  # none answers: one line, no fallback


def test_compose_user_engine_and_private_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        compose.main(["up", "--user-engine", "--private"])
    assert "not allowed with" in capsys.readouterr().err


def test_a_lab_saved_before_the_injective_slugs_finds_its_added_pods(tmp_path, monkeypatch):
    """A lab made by an older agentd (added pods under p-NS-NAME, no slug in lab.json): its
    pods are found under the name their namespace has; the next save records it."""
    import dataclasses
    import hashlib
    import json

    lab = Lab(LabSpec(name="t", nodes=1, pods=0), root=tmp_path)
    lab.dir.mkdir(parents=True, exist_ok=True)
    long_name = "m" * 70
    state = {"spec": dataclasses.asdict(lab.spec), "pods": {}, "pod_ips": {},
             "added_pods": [{"node": "node1", "namespace": ns, "name": name, "labels": {}, "ports": [], "host_ports": [],
                             "result": None} for ns, name in (("a", "b-c"), ("a", long_name), ("x", "y"))]}  # fmt: skip
    (lab.dir / "lab.json").write_text(json.dumps(state))
    old_long = f"p-a-{long_name}"
    old_long = f"{old_long[:40]}-{hashlib.sha1(old_long.encode()).hexdigest()[:12]}"
    existing = {"ad-t-p-a-b-c", f"ad-t-{old_long}"}  # x/y: no namespace under either name
    monkeypatch.setattr(netns.Netns, "exists", lambda self: self.name in existing)
    loaded = Lab.load("t", root=tmp_path)
    assert [(p.name, p.ns.name, p.container_id) for p in loaded.pods] == [
        ("a/b-c", "ad-t-p-a-b-c", "t-p-a-b-c"),
        (f"a/{long_name}", f"ad-t-{old_long}", f"t-{old_long}"),
        ("x/y", "ad-t-p-x_y", "t-p-x_y"),
    ]
    loaded._save()
    monkeypatch.setattr(netns.Netns, "exists", lambda self: False)  # saved: no looking any more
    assert [p.ns.name for p in Lab.load("t", root=tmp_path).pods] == ["ad-t-p-a-b-c", f"ad-t-{old_long}", "ad-t-p-x_y"]
    # A pod whose new-scheme namespace exists keeps it, even when an old one is there too.
    (lab.dir / "lab.json").write_text(json.dumps(state))
    existing = {"ad-t-p-a_b-c", "ad-t-p-a-b-c"}
    monkeypatch.setattr(netns.Netns, "exists", lambda self: self.name in existing)
    assert Lab.load("t", root=tmp_path).pods[0].ns.name == "ad-t-p-a_b-c"
