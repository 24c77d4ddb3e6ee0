"""The compose lab (compose.yaml) brought up for real: ``scripts/dev compose up|down|...``.

    python -m agentd.lab.compose up [--backend B] [--name NAME] [--user-engine] [--timeout S]
    python -m agentd.lab.compose down [--name NAME] [--images]
    python -m agentd.lab.compose ps|logs|exec|top ... [--name NAME]   docker-compose, pointed at the lab

``up`` starts a Docker engine of its own in a network namespace (agentd.lab.dockerd:
``ad-compose_<name>-docker``, its docker0 and iptables rules in there: nothing of the lab in
the root network namespace); only with ``--user-engine`` does it use the engine the user runs
(``DOCKER_HOST``, else the default socket), whose networks are bridges, addresses, routes and
iptables rules in the root namespace.  ``--private``, the default, is still accepted.  It
builds the images (agentd.lab.images: from the registry's slim Python image, or, without a
registry, from Debian packages), runs ``docker-compose up -d``, waits until every node has
attached its pod, and prints the pod reachability matrix: one ICMP echo per ordered pod pair,
sent from raw sockets opened in the pod containers' network namespaces (agentd.lab.sweep).

``down`` removes what ``up`` made: the containers and networks (``docker-compose down``), the
images it built if asked (``--images``), and a private engine with its namespace, mounts and
files (its images go with its data root only with ``--images``: kept, the next ``up`` does not
build from scratch).  What ``up`` made is recorded in /run/agentd-compose/<name>/state.json.
On the user's engine (``--user-engine``), ``down`` with that engine not answering removes
nothing, keeps the record and exits 1: its containers and networks are still there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from agentd.cli import seconds_arg  # `agentd lab`'s and `agentd leave`'s: a finite number in 1..3600
from agentd.lab.dockerd import (COMPOSE, DockerEngine, cgroup_pids, compose, engine_cgroups, ensure_netns, mentions,
                                 mount_points)
from agentd.lab.errors import LabError
from agentd.lab.images import AGENT_IMAGE, LOCAL_BASE, ROOT, Images, build_images, has_image
from agentd.lab.netns import Netns, record_owner
from agentd.lab.sweep import Source, sweep
from agentd.lab.wait import until

COMPOSE_FILE = ROOT / "compose.yaml"
STATE_ROOT = Path(os.environ.get("AGENTD_COMPOSE_STATE", "/run/agentd-compose"))
NODES = ("node1", "node2", "node3")
PROC = Path("/proc")


@dataclass
class ComposeState:
    """What ``up`` made, for ``down`` (and the pass-through commands) to find."""

    name: str
    project: str
    host: str  # the engine's DOCKER_HOST
    private: bool  # an engine started by ``up``: stopped by ``down``
    netns: str | None
    backend: str
    images: list[str]  # built or imported by ``up`` (removed by ``down --images``)
    env: dict[str, str]  # compose.yaml's variables

    @property
    def path(self) -> Path:
        return STATE_ROOT / self.name / "state.json"

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, name: str) -> ComposeState | None:
        try:
            return cls(**json.loads((STATE_ROOT / name / "state.json").read_text()))
        except (OSError, ValueError, TypeError):
            return None

    @classmethod
    def all(cls) -> list[ComposeState]:
        """Every compose lab up now (as the states kept say)."""
        try:
            names = sorted(p.name for p in STATE_ROOT.iterdir() if p.is_dir())
        except OSError:
            return []
        return [s for s in map(cls.load, names) if s is not None]


def private_engine(name: str) -> DockerEngine:
    """The compose lab's own engine (netns ``ad-compose_<name>-docker``: no ``agentd lab`` name
    makes that prefix, so neither tool takes the other's namespace for its own), not started."""
    return DockerEngine(f"compose-{name}", netns=Netns(f"ad-compose_{name}-docker"))


def user_engine() -> DockerEngine | None:
    """The engine the user runs, if it answers."""
    engine = DockerEngine.existing()
    return engine if engine.answers() else None


class ComposeLab:
    """compose.yaml on one engine: up, wait, the matrix, down."""

    def __init__(self, engine: DockerEngine, project: str, env: dict[str, str]) -> None:
        self.engine = engine
        self.project = project
        self.env = dict(env)
        self._ids: dict[str, str] = {}

    def compose(self, *args: str, check: bool = True, timeout: float = 600):
        return compose(self.engine, *args, project=self.project, file=COMPOSE_FILE, env=self.env, check=check,
                       timeout=timeout)  # fmt: skip

    def container(self, service: str) -> str:
        """The container ID of ``service`` ("" when it has none).  A restarted container keeps it."""
        if service not in self._ids:
            self._ids[service] = self.compose("ps", "-q", service, timeout=60).stdout.strip()
        return self._ids[service]

    def exec(self, service: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``docker exec`` in ``service``'s container: what ``docker-compose exec -T`` does, without
        starting docker-compose (a Python program: a second per call) for every poll."""
        return self.engine.docker("exec", self.container(service), *argv, check=check, timeout=60)

    def up(self, timeout: float = 180.0, progress: Callable[[str], None] = lambda line: None) -> dict[str, str]:
        """``docker-compose up -d`` (images must exist), then wait until every node published its
        pod; returns {node: pod address}."""
        self.compose("up", "-d", "--no-build")
        progress("containers started; waiting for the agents and their pods")
        return self.wait_pods(timeout)

    def pods(self) -> dict[str, str]:
        """{node: its pod's address} as the nodes published them ({} before etcd answers)."""
        for node in NODES:
            try:
                proc = self.exec(node, "agentd-node", "pods", check=False)
            except LabError:  # no container yet
                continue
            if proc.returncode == 0:
                with contextlib.suppress(ValueError):
                    return json.loads(proc.stdout)
        return {}

    def wait_pods(self, timeout: float) -> dict[str, str]:
        """Every node's pod attached and published: the address in etcd is the one on the pod's
        eth0 (after a node's restart the old one stays published until the pod is re-attached)."""

        def ready() -> dict[str, str] | None:
            pods = self.pods()
            if set(pods) >= set(NODES) and all(self.pod_address(n) == pods[n] for n in NODES):
                return pods
            return None

        return until(ready, timeout, what="every node to attach and publish its pod", interval=0.5, error=LabError)

    def pod_address(self, node: str) -> str | None:
        """The IPv4 address on ``node``'s pod's eth0, as the pod sees it (None: no eth0)."""
        proc = subprocess.run(
            ["nsenter", f"--net={self.pod_netns(node)}", "ip", "-4", "-o", "addr", "show", "dev", "eth0"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        words = proc.stdout.split()
        return words[words.index("inet") + 1].split("/")[0] if "inet" in words else None

    def status(self, node: str) -> dict:
        """``agentd status --json`` in ``node``'s container."""
        return json.loads(self.exec(node, "agentd", "status", "--json").stdout)

    def pod_netns(self, node: str) -> str:
        """The network namespace file of ``node``'s pod container."""
        pid = self.engine.main_pid(self.container(f"{node}-pod"))
        if not pid:
            raise LabError(f"{node}-pod is not running")
        return f"/proc/{pid}/ns/net"

    def reachability(self, pods: dict[str, str], deadline: float = 3.0) -> dict[tuple[str, str], bool]:
        """{(from pod, to pod): an echo reply came back} for every ordered pair of pods."""
        by_ip = {ip: f"{node}-pod" for node, ip in pods.items()}
        sources = [Source(f"{node}-pod", self.pod_netns(node), tuple(ip for n, ip in pods.items() if n != node))
                   for node in sorted(pods)]  # fmt: skip
        got = sweep(sources, deadline=deadline)
        return {(src, by_ip[ip]): ok for (src, ip), ok in got.items()}

    def wait_reachable(self, pods: dict[str, str], timeout: float) -> dict[tuple[str, str], bool]:
        matrix: dict[tuple[str, str], bool] = {}

        def ok() -> bool:
            nonlocal matrix
            matrix = self.reachability(pods)
            return bool(matrix) and all(matrix.values())

        until(ok, timeout, what=lambda: f"every pod reachable ({failing(matrix)})", interval=0.5, error=LabError)
        return matrix

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "20", check=False)
        self._ids.clear()


def failing(matrix: dict[tuple[str, str], bool]) -> str:
    bad = [f"{a}->{b}" for (a, b), ok in sorted(matrix.items()) if not ok]
    return "failing: " + ", ".join(bad) if bad else "all answer"


def render_matrix(matrix: dict[tuple[str, str], bool]) -> str:
    names = sorted({a for a, _ in matrix} | {b for _, b in matrix})
    width = max([len(n) for n in names] + [4])
    lines = ["pod reachability (ICMP echo):", " " * (width + 2) + " ".join(n.rjust(width) for n in names)]
    for a in names:
        cells = ["-" if a == b else ("ok" if matrix.get((a, b)) else "FAIL") for b in names]
        lines.append(f"{a.ljust(width)}  " + " ".join(c.rjust(width) for c in cells))
    return "\n".join(lines)


# ---------------------------------------------------------------- the tests' shared engine


@dataclass
class SharedEngine:
    """A private engine brought up by the command line, for tests (agentd.lab.fixtures)."""

    name: str
    engine: DockerEngine
    images: Images
    up: subprocess.CompletedProcess  # `up --private`
    status: subprocess.CompletedProcess  # `exec -T node1 agentd status`, while that lab was up


def cli(name: str, *args: str, timeout: float = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m agentd.lab.compose --name NAME ARGS...``, with no DOCKER_HOST of the caller's
    (``env`` adds to the environment)."""
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"} | (env or {})
    return subprocess.run([sys.executable, "-m", "agentd.lab.compose", "--name", name, *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)  # fmt: skip


def leftovers(engine: DockerEngine) -> list[str]:
    """What of a private engine is still there: namespace, processes, mounts, cgroups, files."""
    left = [f"namespace {engine.netns.name}"] if engine.netns is not None and engine.netns.exists() else []
    for entry in os.listdir(PROC):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                cmdline = (PROC / entry / "cmdline").read_bytes()
                if mentions(cmdline, (engine.run_root, engine.data_root)):  # not compose-lab2's for compose-lab
                    args = cmdline.replace(b"\0", b" ").decode(errors="replace")
                    left.append(f"process {entry}: {args}")
    for point in mount_points():
        if any(point == str(r) or point.startswith(f"{r}/") for r in (engine.run_root, engine.data_root)):
            left.append(f"mount {point}")
    for top in engine_cgroups(engine.cgroup_parent):  # cgroup v2's place and every v1 hierarchy's
        pids = cgroup_pids([top])
        left.append(f"cgroup {top}" + (f" (processes {', '.join(map(str, pids))})" if pids else ""))
    left += [f"directory {d}" for d in (engine.run_root, engine.data_root) if d.exists()]
    return left


@contextlib.contextmanager
def shared_engine(name: str):
    """``up --private`` through the command line, the systemd image on top; ``down --images`` at
    the end, and an AssertionError if it left anything (see :func:`leftovers`)."""
    from agentd.lab.images import SYSTEMD_IMAGE, build_systemd_image

    engine = private_engine(name)
    # The command makes the engine's namespace, never recorded (its engine outlives it): this
    # run records it as its own, so that the next run stops the engine and deletes it if this
    # one is killed (agentd.lab.netns.sweep_dead_owners, agentd.lab.fixtures.stop_engine_in).
    assert engine.netns is not None
    record_owner(engine.netns.name)
    try:
        up = cli(name, "up", "--private")
        if up.returncode != 0:
            raise LabError(f"compose up failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}")
        status = cli(name, "exec", "-T", "node1", "agentd", "status", timeout=120)
        state = ComposeState.load(name)
        assert state is not None
        ComposeLab(engine, state.project, state.env).down()
        env = state.env
        images = Images(agent=AGENT_IMAGE, etcd=env["ETCD_IMAGE"], systemd=SYSTEMD_IMAGE, base=env["AGENTD_BASE_IMAGE"],
                        offline=env["AGENTD_PIP_OFFLINE"] == "1")  # fmt: skip
        build_systemd_image(engine)
        yield SharedEngine(name, engine, images, up, status)
    finally:
        down = cli(name, "down", "--images", timeout=300)
    left = leftovers(engine)
    assert down.returncode == 0 and not left, f"compose down --images: {down.stdout}{down.stderr}; left: {left}"


# ---------------------------------------------------------------- the command line


def cmd_up(args: argparse.Namespace) -> int:
    say = lambda line: print(f"[compose {args.name}] {line}", flush=True)
    if ComposeState.load(args.name) is not None:
        raise LabError(f"compose lab {args.name} is up already (`scripts/dev compose down` removes it)")
    t0 = time.monotonic()
    engine = user_engine() if args.user_engine else None
    if args.user_engine and engine is None:
        raise LabError("--user-engine: no Docker engine answers (DOCKER_HOST, else /var/run/docker.sock); "
                       "without --user-engine, up starts one of its own")
    if engine is not None:
        # compose.yaml's underlay network and addresses are fixed: two projects on one engine collide.
        others = [s.name for s in ComposeState.all() if s.name != args.name and not s.private and s.host == engine.host]
        if others:
            raise LabError(f"compose lab {others[0]} is up on your Docker engine already, and two cannot share it "
                           f"(compose.yaml's underlay network is fixed): take it down first, or leave out --user-engine")
    private = engine is None
    if private:
        engine = private_engine(args.name)
        say(f"starting a Docker engine of our own in network namespace {engine.netns.name}")
        ensure_netns(engine.netns.name)
    state = ComposeState(
        name=args.name, project=f"agentd{args.name}", host=engine.host, private=private,
        netns=engine.netns.name if private else None, backend=args.backend, images=[], env={},
    )  # fmt: skip
    state.save()
    engine.start()
    say(f"engine {engine.host} answers")
    had = {i for i in (AGENT_IMAGE, LOCAL_BASE) if has_image(engine, i)}
    images = build_images(engine, progress=say)
    state.images = sorted({images.agent, images.base} - had - {"python:3.11-slim-bookworm"})
    state.env = images.compose_env() | {"AGENTD_BACKEND": args.backend}
    state.save()
    lab = ComposeLab(engine, state.project, state.env)
    say(f"docker-compose up (backend {args.backend})")
    pods = lab.up(args.timeout, progress=say)
    matrix = lab.wait_reachable(pods, args.timeout)
    say(f"up in {time.monotonic() - t0:.0f}s")
    print()
    print(render_matrix(matrix))
    print()
    cmd = "scripts/dev compose" + (f" --name {args.name}" if args.name != "lab" else "")
    print("Try:")
    print(f"  {cmd} exec node1 agentd status")
    print(f"  {cmd} exec node1 ip route show proto 143")
    print(f"  {cmd} exec node1 agentd-node ping")
    print(f"  {cmd} logs node1")
    print(f"  {cmd} down            (--images: the images too)")
    if private:
        print(f"(the engine: DOCKER_HOST={engine.host} /usr/bin/docker ps; docker-compose -p {state.project})")
    return 0


def engine_of(state: ComposeState) -> DockerEngine:
    if state.private:
        return private_engine(state.name)
    return DockerEngine.existing(state.host)


def cmd_down(args: argparse.Namespace) -> int:
    state = ComposeState.load(args.name)
    if state is None:
        # Nothing recorded: still remove a private engine and namespace a failed `up` left.
        engine = private_engine(args.name)
        if engine.netns.exists() or engine.run_root.exists() or (args.images and engine.data_root.exists()):
            engine.stop(remove_data=args.images)
            engine.netns.delete()
            print(f"compose lab {args.name}: removed a private engine left behind")
        else:
            print(f"compose lab {args.name}: nothing to remove")
        return 0
    engine = engine_of(state)
    lab = ComposeLab(engine, state.project, state.env)
    if engine.answers():
        lab.down()
        if args.images and not state.private:
            for image in state.images:
                engine.docker("rmi", image, check=False)
    elif not state.private:
        # Your engine (down, restarting): its containers, networks and images are still there,
        # and so is the record that finds them for the next `down`.
        print(f"compose lab {args.name}: the Docker engine at {state.host} does not answer: nothing removed "
              f"(project {state.project}); start it and run down again", file=sys.stderr)
        return 1
    if state.private:
        engine.stop(remove_data=args.images)
        Netns(state.netns).delete()
    shutil.rmtree(state.path.parent, ignore_errors=True)
    print(f"compose lab {args.name}: removed" + (" (images too)" if args.images else ""))
    return 0


def cmd_passthrough(args: argparse.Namespace, argv: list[str]) -> int:
    state = ComposeState.load(args.name)
    if state is None:
        raise LabError(f"no compose lab {args.name} (`scripts/dev compose up` makes one)")
    lab = ComposeLab(engine_of(state), state.project, state.env)
    env = lab.engine.env() | lab.env | {"COMPOSE_PROJECT_NAME": lab.project}
    cmd = [COMPOSE, "-p", lab.project, "-f", str(COMPOSE_FILE), *argv]  # up's docker-compose, by path
    if not os.access(COMPOSE, os.X_OK):  # spawnv's child would exit 127 without a word
        raise LabError(f"cannot run {COMPOSE}: not an executable file (apt-get install docker-compose)")
    return os.spawnve(os.P_WAIT, cmd[0], cmd, env)


def _name(text: str) -> str:
    if not re.fullmatch(r"[a-z0-9]{1,12}", text):
        raise argparse.ArgumentTypeError(f"invalid lab name {text!r}: 1-12 lowercase letters or digits")
    return text


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="scripts/dev compose", description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="lab", type=_name, help="the lab's name, 1-12 lowercase letters or digits")
    sub = p.add_subparsers(dest="command", required=True, metavar="up|down|<docker-compose command>")
    up = sub.add_parser("up", help="engine, images, docker-compose up, wait, the reachability matrix")
    up.add_argument("--backend", choices=["host-gw", "vxlan", "udp", "ipip"], default="host-gw")
    which = up.add_mutually_exclusive_group()
    which.add_argument("--user-engine", action="store_true",
                       help="use the Docker engine you run (DOCKER_HOST, else the default socket): its networks "
                            "change the root network namespace (bridge, address, route, iptables rules)")
    which.add_argument("--private", action="store_true",
                       help="an engine of its own in a network namespace (the default; kept for old scripts)")
    up.add_argument("--timeout", type=seconds_arg, default=240.0,
                    help="seconds to wait for the pods, 1..3600 (default 240)")
    down = sub.add_parser("down", help="remove everything up made")
    down.add_argument("--images", action="store_true", help="the images it built too")
    i = 0  # the first word that is not --name or its value: the command
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] == "--name" else 1
    try:
        if i < len(argv) and argv[i] not in ("up", "down"):
            args, _ = p.parse_known_args(argv[:i] + ["down"])
            return cmd_passthrough(args, argv[i:])
        args = p.parse_args(argv)
        return cmd_up(args) if args.command == "up" else cmd_down(args)
    except (LabError, OSError, subprocess.SubprocessError) as err:
        # OSError, SubprocessError: a command that could not run or ran out of time (those of
        # docker and docker-compose are LabErrors already): one line, never a traceback.
        print(f"scripts/dev compose: {err}", file=sys.stderr)
        if argv[i:i + 1] == ["up"] and ComposeState.load(args.name) is not None:
            print("(left as it is for a look; `scripts/dev compose down` removes what was made)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
