"""The compose lab (compose.yaml) on a real Docker engine.

* ``scripts/dev compose up`` as README says -- here ``python -m agentd.lab.compose``, which is
  what the script runs after setup -- on a machine without a Docker engine: a private dockerd
  in a network namespace of its own, the images built without a registry (from Debian
  packages), ``docker-compose up`` (host-gw), every pod reaching every other (the printed
  matrix); the pass-through ``scripts/dev compose exec node1 agentd status`` shows both peers
  Established.  That engine is the run's shared one (agentd.lab.fixtures' ``docker_engine``:
  images built once); at the end of the run ``down --images`` must leave nothing of it: no
  namespace, process, mount, cgroup or file (checked by the fixture's teardown).
* On that engine:
  vxlan and udp, the udp backend carried by the BPF data path inside the node containers
  (bpffs mounted by the entrypoint; bpf() by CAP_SYS_ADMIN, which the kernel takes for
  CAP_BPF and Docker 20.10 cannot add); ``docker-compose exec node1 agentd status`` shows the
  peers; a node whose main process is killed (SIGKILL, as a crash or the OOM killer would:
  ``docker kill`` itself counts as a manual stop, which no restart policy undoes) is
  restarted by its restart policy with the same subnet, its routes back, its pod re-attached
  and every pod reachable again; ``docker-compose down`` leaves no container, network or
  process of the project.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from agentd.lab.compose import NODES, ComposeLab, cli
from agentd.lab.netns import unique_tag
from agentd.lab.wait import until

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_command_brings_the_lab_up(docker_engine):
    """What `scripts/dev compose up` printed and `compose exec` showed (agentd.lab.fixtures'
    ``docker_engine`` ran them); ``down --images`` runs, and is checked, at the end of the run."""
    up, status = docker_engine.up, docker_engine.status
    assert "of our own in network namespace" in up.stdout, up.stdout
    assert "building agentd:latest from" in up.stdout
    matrix = up.stdout.split("pod reachability (ICMP echo):", 1)[1].split("\n\n", 1)[0]
    rows = [line.split() for line in matrix.strip().splitlines()[1:]]
    assert [r[0] for r in rows] == [f"{n}-pod" for n in NODES], matrix
    assert all(cell in ("ok", "-") for r in rows for cell in r[1:]) and sum(r.count("ok") for r in rows) == 6, matrix
    assert status.returncode == 0, status.stdout + status.stderr
    for peer in ("172.29.0.12", "172.29.0.13"):
        assert re.search(rf"\| {re.escape(peer)} .*\| up .*\| host-gw .*Established", status.stdout), status.stdout


def test_up_uses_the_engine_the_user_runs(docker_engine):
    """With --user-engine and DOCKER_HOST set (here: the run's engine standing in for the
    user's), `up` starts no engine of its own and `down` takes only its project away, never the engine."""
    name = unique_tag("c")
    engine = docker_engine.engine
    up = cli(name, "up", "--user-engine", "--backend", "host-gw", env={"DOCKER_HOST": engine.host})
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "of our own" not in up.stdout and f"engine {engine.host} answers" in up.stdout
        assert "FAIL" not in up.stdout and up.stdout.count(" ok") == 6, up.stdout
    finally:
        down = cli(name, "down", env={"DOCKER_HOST": engine.host})
    assert down.returncode == 0, down.stdout + down.stderr
    assert engine.answers() and engine.netns.exists()
    assert engine.docker("ps", "-aq", "--filter", f"label=com.docker.compose.project=agentd{name}").stdout.strip() == ""
    assert engine.docker("image", "inspect", docker_engine.images.agent, check=False).returncode == 0


def test_down_without_a_lab_removes_nothing():
    again = cli(unique_tag("c"), "down")
    assert again.returncode == 0 and "nothing to remove" in again.stdout, again.stdout + again.stderr


@pytest.fixture
def compose_lab(docker_engine, request):
    """``docker-compose up`` of compose.yaml with AGENTD_BACKEND=<param> on the shared engine."""
    lab = ComposeLab(docker_engine.engine, f"t{unique_tag('')}",
                     docker_engine.images.compose_env() | {"AGENTD_BACKEND": request.param})  # fmt: skip
    try:
        yield lab
    finally:
        lab.down()


# The first test of a run builds the images (a cold cache: mmdebstrap, about a minute).
@pytest.mark.timeout(900)
@pytest.mark.parametrize("compose_lab", ["vxlan", "udp"], indirect=True)
def test_compose_lab_on_a_real_engine(compose_lab):
    lab = compose_lab
    backend = lab.env["AGENTD_BACKEND"]
    pods = lab.up(timeout=240)
    matrix = lab.wait_reachable(pods, timeout=120)
    assert len(matrix) == 6 and all(matrix.values()), matrix

    # `docker-compose exec node1 agentd status`: both other nodes, Established.
    text = lab.compose("exec", "-T", "node1", "agentd", "status", timeout=60).stdout
    for peer in ("172.29.0.12", "172.29.0.13"):
        assert re.search(rf"\| {re.escape(peer)} .*\| up .*\| {backend} .*Established", text), text
    status = lab.status("node1")
    active = status["backends"]["active"]
    if backend == "udp":
        # In the kernel: the bpffs the entrypoint mounted, bpf() through CAP_SYS_ADMIN.
        assert active["udp"]["datapath"] == "bpf", status["backends"]
    else:
        assert active["vxlan"]["datapath"] == "vxlan-device", status["backends"]
        assert status["backends"]["bpf"]["active"] and not status["backends"]["member_filter"]["missing"]

    if backend == "udp":
        restart_after_a_crash(lab)

    containers = {s: lab.container(s) for s in ("etcd", *NODES, *(f"{n}-pod" for n in NODES))}
    pids = [lab.engine.main_pid(c) for c in containers.values()]
    lab.down()
    project = f"label=com.docker.compose.project={lab.project}"
    assert lab.engine.docker("ps", "-aq", "--filter", project).stdout.strip() == ""
    assert lab.engine.docker("network", "ls", "-q", "--filter", project).stdout.strip() == ""
    assert not [p for p in pids if p and Path(f"/proc/{p}").exists()]


def restart_after_a_crash(lab: ComposeLab) -> None:
    """SIGKILL to node1's main process: the restart policy brings the container back; the agent
    takes the same subnet, routes come back, the pod is re-attached, every pod answers again."""
    engine, container = lab.engine, lab.container("node1")
    subnet = lab.status("node1")["node"]["subnet"]
    restarts = engine.inspect(container)[0]["RestartCount"]
    os.kill(engine.main_pid(container), signal.SIGKILL)

    def restarted() -> bool:
        state = engine.inspect(container)[0]
        return state["RestartCount"] > restarts and state["State"]["Running"]

    until(restarted, 60, what="node1 restarted by its restart policy", interval=0.2)

    def ready() -> dict | None:
        try:
            status = lab.status("node1")
        except Exception:  # the agent is not answering yet
            return None
        return status if status.get("ready") else None

    status = until(ready, 120, what="node1's agent ready again", interval=0.5)
    assert status["node"]["subnet"] == subnet
    others = {lab.status(n)["node"]["subnet"] for n in NODES if n != "node1"}

    def routes() -> bool:
        out = lab.exec("node1", "ip", "route", "show", "proto", "143").stdout
        return others <= {line.split()[0] for line in out.splitlines() if line and not line.startswith("blackhole")}

    until(routes, 60, what="node1's routes to the other nodes back", interval=0.5)
    again = lab.wait_pods(120)
    matrix = lab.wait_reachable(again, timeout=120)
    assert len(matrix) == 6 and all(matrix.values()), matrix
