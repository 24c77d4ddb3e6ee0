"""A Docker engine of the lab's own: ``dockerd`` in a network namespace, with paths of its own.

Docker creates ``docker0`` (or one bridge per user network) and iptables rules in the network
namespace it runs in.  The lab never lets it near the host's: every engine it starts runs in a
namespace of its own (the compose lab's ``ad-<name>-docker``) or in a lab node's namespace
(``agentd lab up --docker``), entered with ``nsenter --net`` -- not ``ip netns exec``, which
also remounts /sys and so hides the cgroup hierarchies dockerd needs ("Devices cgroup isn't
mounted").  Each engine has its own data root, exec root (where its managed containerd keeps
its state and socket), API socket, pid file and cgroup parent, so several can run at once,
beside other people's::

    engine = DockerEngine("compose", netns=Netns.create("ad-compose-docker"))
    engine.start()
    engine.docker("run", "--rm", "agentd:latest", "agentd", "--version")
    engine.stop()          # containers, the daemon, its containerd and shims, its mounts

:meth:`DockerEngine.existing` wraps an engine the user already runs (``DOCKER_HOST`` or the
default socket): nothing is started, and ``stop`` leaves it running.

The client is Debian's ``/usr/bin/docker`` (20.10, the engine's own version), named by path:
a newer client earlier on PATH would negotiate the API down, but its flags are not the ones
this engine understands.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentd.lab.errors import LabError
from agentd.lab.netns import Netns, tied
from agentd.lab.wait import until

DOCKER = os.environ.get("AGENTD_DOCKER_CLIENT", "/usr/bin/docker")
COMPOSE = os.environ.get("AGENTD_COMPOSE", "/usr/bin/docker-compose")
DEFAULT_SOCKET = "/var/run/docker.sock"
# runc with CAP_BPF and CAP_PERFMON added (docker/runc-bpf-caps says why):
# `docker run --runtime runc-bpf-caps`.
BPF_CAPS_RUNTIME = "runc-bpf-caps"
BPF_CAPS_RUNC = Path(__file__).resolve().parents[2] / "docker" / "runc-bpf-caps"
# Short paths: containerd's socket lives under the exec root, and AF_UNIX paths end at 107 bytes.
RUN_ROOT = Path(os.environ.get("AGENTD_DOCKER_RUN", "/run/ad-docker"))
DATA_ROOT = Path(os.environ.get("AGENTD_DOCKER_DATA", "/var/lib/ad-docker"))


class DockerTimeout(LabError):
    """A ``docker`` or ``docker-compose`` command that did not finish in its time."""


def run_client(argv: list[str], what: str, *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv)``, its output captured as text; a client that cannot be run
    (missing, not executable) is a :class:`LabError`, one that runs out of time a
    :class:`DockerTimeout` -- never a traceback out of ``scripts/dev compose`` or ``agentd lab up``."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    except subprocess.TimeoutExpired:
        raise DockerTimeout(f"{what}: timed out after {timeout:g}s") from None
    except OSError as err:
        raise LabError(f"{what}: cannot run {argv[0]}: {err.strerror or err}") from None


class DockerEngine:
    """One dockerd (see the module doc).  ``daemon_args`` are added to its command line
    (``--bip``, ``--mtu``, ``--ip-masq=false`` for a lab node's engine)."""

    def __init__(
        self,
        name: str,
        *,
        netns: Netns | None = None,
        run_root: Path | None = None,
        data_root: Path | None = None,
        daemon_args: Sequence[str] = (),
        host: str | None = None,
        shared_netns: bool = False,
    ) -> None:
        self.name = name
        self.netns = netns
        self.shared_netns = shared_netns  # a lab node's: other processes live there too
        self.run_root = Path(run_root) if run_root else RUN_ROOT / name
        self.data_root = Path(data_root) if data_root else DATA_ROOT / name
        self.daemon_args = list(daemon_args)
        self.socket = self.run_root / "docker.sock"
        self.host = host or f"unix://{self.socket}"
        self.owned = host is None  # False: the user's engine, never started or stopped here
        self.proc: subprocess.Popen | None = None

    @classmethod
    def existing(cls, host: str | None = None) -> DockerEngine:
        """The engine the user runs: ``host``, else ``DOCKER_HOST``, else the default socket."""
        return cls("user", host=host or os.environ.get("DOCKER_HOST") or f"unix://{DEFAULT_SOCKET}")

    def __repr__(self) -> str:
        return f"<DockerEngine {self.name} {self.host}>"

    # ------------------------------------------------------------ paths

    @property
    def exec_root(self) -> Path:
        return self.run_root / "exec"

    @property
    def pidfile(self) -> Path:
        return self.run_root / "docker.pid"

    @property
    def log_path(self) -> Path:
        return self.run_root / "dockerd.log"

    @property
    def config_file(self) -> Path:
        """Its own daemon.json (``{}``): never the host engine's /etc/docker/daemon.json, whose
        keys would conflict with this engine's flags (``bip``, ``data-root``: dockerd refuses
        to start) or change the lab (``iptables``, ``userns-remap``, a cgroup driver)."""
        return self.run_root / "daemon.json"

    @property
    def cgroup_parent(self) -> str:
        """A path, not a systemd slice: the engine runs with the cgroupfs driver (``start``)."""
        return f"/ad-docker-{self.name}"

    # ------------------------------------------------------------ the client

    def env(self) -> dict[str, str]:
        """The environment for ``docker`` and ``docker-compose`` talking to this engine."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
        env["DOCKER_HOST"] = self.host
        return env

    def docker(
        self, *args: str, check: bool = True, timeout: float = 300, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``docker ARGS...`` against this engine; raises LabError with its stderr on failure,
        :class:`DockerTimeout` (a LabError) when it does not finish in ``timeout`` seconds, and
        LabError when the client cannot be run at all (no /usr/bin/docker)."""
        what = f"docker {' '.join(args)} ({self.name})"
        proc = run_client([DOCKER, *args], what, env=self.env(), timeout=timeout, input=input)
        if check and proc.returncode != 0:
            raise LabError(f"docker {' '.join(args)} ({self.name}) exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def answers(self) -> bool:
        try:
            return self.docker("version", "--format", "{{.Server.Version}}", check=False, timeout=10).returncode == 0
        except DockerTimeout:
            return False

    def inspect(self, *names: str) -> list[dict]:
        return json.loads(self.docker("inspect", *names).stdout)

    def main_pid(self, container: str) -> int:
        """The host PID of a container's main process (0 when it is not running)."""
        return int(self.docker("inspect", "-f", "{{.State.Pid}}", container).stdout.strip() or 0)

    # ------------------------------------------------------------ start, stop

    def running_pid(self) -> int | None:
        """The dockerd of this engine, if one runs (from its pid file)."""
        try:
            pid = int(self.pidfile.read_text())
        except (OSError, ValueError):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return None
        return pid if cmdline and cmdline[0].endswith(b"dockerd") and str(self.socket).encode() in b" ".join(cmdline) else None

    def start(self, timeout: float = 60.0) -> None:
        """Start dockerd (detached: it outlives this process until :meth:`stop`; in a test run,
        started from the main thread, it dies with the run: agentd.lab.netns.tied) and wait until
        it answers.  A no-op for the user's engine, or when this engine already runs."""
        if not self.owned or self.running_pid() is not None:
            self._wait(timeout)
            return
        if self.netns is None:
            raise LabError(f"engine {self.name}: a private engine needs a network namespace")
        for d in (self.run_root, self.exec_root, self.data_root):
            d.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text("{}\n")
        argv = [
            "nsenter", f"--net={self.netns.path}", "dockerd",
            "--data-root", str(self.data_root),
            "--exec-root", str(self.exec_root),
            "--host", self.host,
            "--pidfile", str(self.pidfile),
            "--config-file", str(self.config_file),
            "--cgroup-parent", self.cgroup_parent,
            # The cgroupfs driver, which takes a path parent: on a cgroup-v2 host booted with
            # systemd, dockerd 20.10 picks the systemd driver by itself, and that one refuses
            # any parent but a "xxx.slice" ("cgroup-parent for systemd cgroup should be a valid
            # slice"): the engine would not start.
            "--exec-opt", "native.cgroupdriver=cgroupfs",
            # No DNS of the host's to copy into containers: the lab has no outside world.
            "--dns", "127.0.0.1",
            *([f"--add-runtime={BPF_CAPS_RUNTIME}={BPF_CAPS_RUNC}"] if BPF_CAPS_RUNC.exists() else []),
            *self.daemon_args,
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            # tied(): in a test run, and started from the main thread, it dies with the run.
            self.proc = subprocess.Popen(
                argv, **tied({"stdin": subprocess.DEVNULL, "stdout": log, "stderr": subprocess.STDOUT, "start_new_session": True})
            )
        try:
            self._wait(timeout)
        except LabError as err:
            try:
                self.stop()
            except LabError as stop_err:
                raise LabError(f"{err}; and stopping it: {stop_err}") from None
            raise

    def _wait(self, timeout: float) -> None:
        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise LabError(f"dockerd ({self.name}) exited {self.proc.returncode}; log {self.log_path}:\n{self._tail()}")
            return self.answers()

        until(up, timeout, what=f"the Docker engine at {self.host} to answer", interval=0.2, error=LabError)

    def _tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def remove_containers(self, label: str | None = None) -> None:
        """``docker rm -f`` every container (with ``label``, else all of them: a private engine)."""
        filters = ["--filter", f"label={label}"] if label else []
        ids = self.docker("ps", "-aq", *filters, check=False, timeout=60).stdout.split()
        if ids:
            self.docker("rm", "-f", "-v", *ids, check=False, timeout=120)

    def stop(self, *, remove_data: bool = True, timeout: float = 30.0) -> None:
        """Remove every container, stop dockerd (its containerd and shims with it), kill what is
        left in its containers' cgroups, unmount what it left mounted, and delete its files (the
        data root too, unless ``remove_data`` is False: images kept for the next start).
        Idempotent; never touches the user's engine.  A dockerd that outlives SIGKILL, or
        container processes that do, are a :class:`LabError` once the rest is done (the stuck
        dockerd's files kept, for a later stop to find it)."""
        if not self.owned:
            return
        pid = self.running_pid() or (self.proc.pid if self.proc is not None and self.proc.poll() is None else None)
        stuck: LabError | None = None  # a dockerd that outlived SIGKILL (stuck in the kernel)
        if pid is not None:
            with contextlib.suppress(LabError):
                self.remove_containers()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            try:
                until(lambda: not _alive(pid), timeout, what=f"dockerd {pid} to exit", interval=0.1, error=LabError)
            except LabError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                try:
                    until(lambda: not _alive(pid), 10, what=f"dockerd {pid} to exit after SIGKILL", interval=0.1,
                          error=LabError)  # fmt: skip
                except LabError as err:
                    stuck = err
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        self._kill_leftovers()
        for root in (self.exec_root, self.data_root):
            unmount_under(root)
        if self.netns is not None and not self.shared_netns and self.netns.exists():
            self.netns.kill_all()  # containerd or a shim that outlived dockerd
        # Containers whose dockerd was gone already (killed, crashed) were not removed through
        # the API, and their processes, in namespaces of their own, outlive the shims killed
        # above: their cgroups (the engine's cgroup parent) find them.
        survivors = kill_cgroup_processes(engine_cgroups(self.cgroup_parent))
        if stuck is None:  # a stuck dockerd's pid file and data stay: a later stop finds them
            shutil.rmtree(self.run_root, ignore_errors=True)
            if remove_data and self.data_root.exists():
                # rm(1): an image store is a hundred thousand files, several times faster than rmtree
                subprocess.run(["rm", "-rf", "--one-file-system", str(self.data_root)], capture_output=True, check=False)
                shutil.rmtree(self.data_root, ignore_errors=True)
        _remove_cgroups(self.cgroup_parent)
        if stuck is not None:
            raise LabError(f"engine {self.name}: {stuck}; its files are kept ({self.run_root})")
        if survivors:
            raise LabError(f"engine {self.name}: processes {', '.join(map(str, survivors))} of its containers "
                           f"outlived SIGKILL (cgroup {self.cgroup_parent})")

    def _kill_leftovers(self) -> None:
        """containerd and its shims, which a killed dockerd leaves behind: found by the paths of
        this engine on their command lines (their network namespace may be a node's, shared
        with other processes that must live)."""
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if mentions(cmdline, (self.exec_root, self.data_root)) and b"containerd" in cmdline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry), signal.SIGKILL)


def mentions(cmdline: bytes, paths: Sequence[Path]) -> bool:
    """Does a /proc/PID/cmdline name one of ``paths`` or a file below it?  A path counts only
    up to a "/", the end of an argument or of the line: ``/var/lib/ad-docker/compose-lab`` is
    not in the ``--data-root /var/lib/ad-docker/compose-lab2`` of another lab's dockerd."""
    for path in paths:
        mark = str(path).rstrip("/").encode()
        if re.search(re.escape(mark) + rb"(?:/|\0|$)", cmdline):
            return True
    return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    if state == "Z":  # exited, waiting to be reaped by its parent (us, if we started it)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return True


MOUNTINFO = Path("/proc/self/mountinfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def mount_point(field: str) -> str:
    """A mount point as /proc/self/mountinfo writes it, decoded: the kernel writes space, tab,
    newline and backslash as octal escapes (``\\040``, ``\\011``, ``\\012``, ``\\134``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_points(mountinfo: Path | None = None) -> list[str]:
    """Every mount point of this process's mount namespace, decoded ([] where it cannot be read)."""
    try:
        text = (mountinfo or MOUNTINFO).read_text()
    except OSError:
        return []
    return [mount_point(line.split()[4]) for line in text.splitlines() if len(line.split()) > 4]


def unmount_under(root: Path, mountinfo: Path | None = None) -> None:
    """Lazily unmount everything mounted at or below ``root`` (deepest first): overlay layers,
    the shm of containers, the bind mount dockerd makes of its data root."""
    prefix = str(root).rstrip("/")
    points = [p for p in mount_points(mountinfo) if p == prefix or p.startswith(prefix + "/")]
    for point in sorted(set(points), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def engine_cgroups(parent: str, root: Path | None = None) -> list[Path]:
    """An engine's cgroup parent (``--cgroup-parent``) where it is: ``<root>/<parent>`` on
    cgroup v2 (the unified hierarchy at /sys/fs/cgroup), ``<root>/<hierarchy>/<parent>`` in
    every v1 hierarchy (``cpu``, ``memory``, ...; a hierarchy's alias, ``cpu`` for
    ``cpu,cpuacct``, counted once)."""
    base = CGROUP_ROOT if root is None else root
    rel = parent.strip("/")
    candidates = [base / rel]
    with contextlib.suppress(OSError):
        # a hierarchy before its aliases (symbolic links): the name said is the real one
        candidates += [d / rel for d in sorted(base.iterdir(), key=lambda d: (d.is_symlink(), d.name)) if d.is_dir()]
    found: dict[Path, Path] = {}
    for top in candidates:
        with contextlib.suppress(OSError):
            if top.is_dir():
                found.setdefault(top.resolve(), top)
    return list(found.values())


def cgroup_pids(tops: Sequence[Path]) -> list[int]:
    """The processes in the cgroups ``tops`` and every cgroup below them (their ``cgroup.procs``)."""
    pids: set[int] = set()
    for top in tops:
        with contextlib.suppress(OSError):
            for procs in [top / "cgroup.procs", *top.rglob("*/cgroup.procs")]:
                with contextlib.suppress(OSError, ValueError):
                    pids.update(int(w) for w in procs.read_text().split())
    return sorted(pids)


def kill_cgroup_processes(tops: Sequence[Path], timeout: float = 10.0) -> list[int]:
    """SIGKILL every process of the cgroups ``tops`` (and below; cgroup v2's ``cgroup.kill``
    where there is one) and wait until they are gone; the pids still there after ``timeout``."""
    if not cgroup_pids(tops):
        return []
    for top in tops:
        with contextlib.suppress(OSError):
            if (top / "cgroup.kill").exists():
                (top / "cgroup.kill").write_text("1")
    for pid in cgroup_pids(tops):
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    try:
        until(lambda: not cgroup_pids(tops), timeout, what="the containers' processes to exit", interval=0.1,
              error=LabError)  # fmt: skip
    except LabError:
        return cgroup_pids(tops)
    return []


def _remove_cgroups(parent: str, root: Path | None = None) -> None:
    """The engine's cgroup parent in every v1 hierarchy (and v2), once its containers are gone."""
    for top in engine_cgroups(parent, root):
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def compose(
    engine: DockerEngine,
    *args: str,
    project: str,
    file: Path,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """``docker-compose -p PROJECT -f FILE ARGS...`` against ``engine``."""
    full_env = engine.env() | (env or {})
    full_env["COMPOSE_PROJECT_NAME"] = project
    proc = run_client([COMPOSE, "--ansi", "never", "-p", project, "-f", str(file), *args],
                      f"docker-compose {' '.join(args)}", env=full_env, cwd=file.parent, timeout=timeout)
    if check and proc.returncode != 0:
        raise LabError(f"docker-compose {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()[-3000:]}")
    return proc


def ensure_netns(name: str) -> Netns:
    """The namespace ``name``, made if missing."""
    ns = Netns(name)
    return ns if ns.exists() else Netns.create(name)
