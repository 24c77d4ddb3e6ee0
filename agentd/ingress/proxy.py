"""The HAProxy process: start, adopt, check, graceful reload, runtime commands, counters, stop.

HAProxy runs as a daemon in master-worker mode (``-W -D``) with the master CLI on a unix
socket (``-S``), the way its packages run it, so that it outlives the agent:

* **start**: the launcher checks the configuration, binds the listeners and forks the master
  into a session of its own (stdin/stdout/stderr on /dev/null; what the launcher printed is
  kept in ``haproxy.log``); the master writes the pidfile and forks the worker.  It is not
  the agent's child: the agent notices its exit through a pidfd, whoever its parent is, and
  a restarted agent can do the same;
* **adopt**: a restarted agent takes over the master its pidfile names once it has checked
  that the process is a HAProxy of this configuration and that its master CLI answers with
  that PID (never another program that got the PID, never another node's proxy);
* **reload** is SIGUSR2 to the master: it re-executes itself with the new configuration,
  the new worker takes the listening sockets over from the old one (the stats socket's
  ``expose-fd listeners``), and the old worker stops accepting, finishes its requests in
  flight and closes its keep-alive connections as their current response ends (soft stop);
* the **runtime API** (the worker's admin socket) adds, enables, disables and deletes
  servers, and answers ``show stat`` / ``show info``;
* ``show proc`` on the master CLI names the current worker: its PID and generation
  (reloads) are what tests and ``/status`` read to tell a reload from a runtime change.

A configuration is checked (``haproxy -c``) before it is used; a bad one is never loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import grp
import io
import logging
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .access_log import FileWriter
from .haproxy import Paths

log = logging.getLogger("agentd.ingress")
access_log = logging.getLogger("agentd.ingress.access")

SOCKET_TIMEOUT = 5.0
OUTPUT_LIMIT = 1 << 20  # haproxy.log (the launcher's output) is started anew past this size
PROXY_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}  # HAProxy's whole environment


MDWE_DROP_IN = """[Service]
MemoryDenyWriteExecute=no
"""
MDWE_HELP = ("HAProxy compiles its regular expressions to machine code (PCRE2's JIT), which needs memory "
             "both writable and executable, and this process may not have any (systemd's "
             "MemoryDenyWriteExecute=yes, as the shipped unit sets it): on a node with [ingress] enabled add "
             "the drop-in /etc/systemd/system/agentd.service.d/ingress.conf with 'MemoryDenyWriteExecute=no' "
             "under [Service] (docs/ingress.md)")


def writable_executable_denied() -> bool:
    """Whether this process (and so HAProxy, its child, which inherits it) is refused memory
    that is writable and executable at once: systemd's MemoryDenyWriteExecute (a seccomp filter,
    or the kernel's PR_SET_MDWE)."""
    import mmap

    try:
        m = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except OSError:  # EPERM (seccomp) or EACCES (PR_SET_MDWE)
        return True
    m.close()
    return False


class ProxyError(RuntimeError):
    """The proxy refused a configuration or a command, or is not running; one line."""


AUTO_USER = "haproxy"  # [ingress] user when not set, where it can be used (the Debian package's)


@dataclass(frozen=True)
class RunAs:
    """The user and group HAProxy's workers run as (``user``/``group`` in its global section);
    its master stays root: it re-executes itself on a reload, reads the certificates and maps,
    and binds the listeners, which the workers inherit."""

    user: str
    group: str
    uid: int
    gid: int


# What the drop-in of a node with [ingress] enabled adds to the shipped unit besides
# MemoryDenyWriteExecute=no (docs/ingress.md, "Under the systemd unit").
RUN_AS_DROP_IN = """CapabilityBoundingSet=CAP_SETUID CAP_SETGID CAP_KILL
SystemCallFilter=@setuid
SupplementaryGroups={group}
"""
_SWITCH = "import os, sys; os.setgroups([]); os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[2]))"


def unsearchable(directory: Path, uid: int, gid: int) -> Path | None:
    """The first directory above ``directory`` that user ``uid`` (group ``gid``) may not
    pass through (no search permission), or None: where HAProxy's workers could not reach
    the access log's socket."""
    for d in reversed(Path(directory).absolute().parents):
        try:
            st = d.stat()
        except OSError:
            return d
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
        if not st.st_mode & bit:
            return d
    return None


def resolve_user(name: str) -> RunAs | None:
    """Who HAProxy's workers run as: ``[ingress] user`` (its primary group), checked the way
    HAProxy's master will use it -- a child of this process drops its groups and switches to
    that group and user, under the same capabilities, seccomp filter and no-new-privileges as
    HAProxy, the agent's child, gets.  None: no switch -- ``root`` named (the workers keep
    root and the agent's capabilities, as before), or this process is not root (HAProxy runs
    as its user: it could not switch).  ProxyError saying what to do when it cannot be used."""
    if name == "root" or os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise ProxyError(f"[ingress] user {name}: no such user; create it (the Debian haproxy package does: "
                         f"useradd --system --no-create-home --shell /usr/sbin/nologin {name}) or name another "
                         "(docs/ingress.md)") from None  # fmt: skip
    if pw.pw_uid == 0:
        raise ProxyError(f"[ingress] user {name}: uid 0 is root; name a user of its own (or root, to run the "
                         "workers as root on purpose)")  # fmt: skip
    try:
        group = grp.getgrgid(pw.pw_gid).gr_name
    except KeyError:
        group = str(pw.pw_gid)
    try:
        out = subprocess.run([sys.executable, "-I", "-c", _SWITCH, str(pw.pw_gid), str(pw.pw_uid)], env=PROXY_ENV,
                             capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ProxyError(f"[ingress] user {name}: checking that this process may switch to it failed: {err}") from None
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or [f"status {out.returncode}"])[-1]
        raise ProxyError(f"HAProxy's workers cannot switch to [ingress] user {name} ({why}): under the systemd unit "
                         "add to the drop-in /etc/systemd/system/agentd.service.d/ingress.conf, under [Service]: "
                         + "; ".join(RUN_AS_DROP_IN.format(group=group).splitlines()) + " (docs/ingress.md)")  # fmt: skip
    return RunAs(name, group, pw.pw_uid, pw.pw_gid)


class ConfigRefused(ProxyError):
    """``haproxy -c`` judged the configuration and refused it (its ALERT lines): not a check
    that failed by itself (killed, or ended without a word)."""


@dataclass(frozen=True)
class Worker:
    pid: int
    reloads: int  # 0: the current generation


async def _ask(path: Path, command: str, timeout: float = SOCKET_TIMEOUT) -> str:
    """One command on a HAProxy CLI socket (non-interactive: the answer ends at EOF)."""
    try:
        # Not wait_for: on Python 3.11 a cancel as the connection is made would leave it open
        # (or be dropped); under asyncio.timeout the connection and the cancel stay ours.
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_unix_connection(str(path))
    except (OSError, TimeoutError) as err:
        raise ProxyError(f"cannot reach {path.name}: {err or type(err).__name__}") from None
    try:
        writer.write(command.encode() + b"\n")
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(timeout):
            return (await reader.read()).decode(errors="replace")
    except (OSError, TimeoutError, RuntimeError) as err:  # RuntimeError: uvloop, the peer closed (a re-exec)
        raise ProxyError(f"{path.name}: {command!r}: {err or type(err).__name__}") from None
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def parse_proc(text: str) -> tuple[tuple[int, int] | None, list[Worker]]:
    """The master CLI's ``show proc``: (master PID, its reloads) and the workers."""
    master = None
    workers = []
    section = ""
    for line in text.splitlines():
        if line.startswith("#"):
            section = line
            continue
        parts = line.split()
        if len(parts) < 3 or "programs" in section:
            continue
        with contextlib.suppress(ValueError):
            if parts[1] == "master":
                master = (int(parts[0]), int(parts[2]))
            elif parts[1] == "worker":
                workers.append(Worker(int(parts[0]), int(parts[2])))
    return master, workers


class Proxy:
    def __init__(self, paths: Paths, binary: str = "haproxy") -> None:
        self.paths = paths
        self.binary = binary
        self.pid: int | None = None  # the master's
        self.started_at: float | None = None
        self.reloads = 0
        self.adopted = False  # a previous agent started it
        self.worker_pids: set[int] = set()  # the workers of the last show proc, for cleaning up after a crash
        self._pidfd: int | None = None
        self._exited: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ configuration

    async def check(self, config: Path) -> None:
        """ProxyError with HAProxy's own words unless ``config`` is valid."""
        proc = await asyncio.create_subprocess_exec(
            self.binary, "-c", "-f", str(config),  # (not -q: that silences the ALERT lines too)
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env=PROXY_ENV,  # not the agent's (its BGP password may be there): the ALERTs become settings_error
        )  # fmt: skip
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            text = out.decode(errors="replace")
            if "jit compilation failed" in text and writable_executable_denied():
                raise ProxyError(MDWE_HELP)
            lines = [ln.strip() for ln in text.splitlines() if "ALERT" in ln or "rror" in ln]
            if proc.returncode > 0 and any("ALERT" in ln for ln in lines):
                raise ConfigRefused("; ".join(lines[:3]))
            raise ProxyError("; ".join(lines[:3]) or f"haproxy -c exited with {proc.returncode}")

    # ------------------------------------------------------------------ the process

    @property
    def running(self) -> bool:
        return self.pid is not None and self._exited is not None and not self._exited.done()

    async def start(self, timeout: float = 20.0) -> None:
        """Start the master (after ending one a previous agent left that could not be
        adopted) and wait for its worker."""
        await asyncio.to_thread(stop_stale, self.paths)
        for path in (self.paths.master_socket, self.paths.pidfile):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        rc, output = await asyncio.to_thread(self._launch, timeout)
        for line in output.splitlines():
            if "[WARNING]" in line:
                log.warning("haproxy: %s", line.strip())
        if rc != 0:
            alerts = [ln.strip() for ln in output.splitlines() if "[ALERT]" in ln]
            raise ProxyError("; ".join(alerts[:3]) or f"haproxy exited at start with status {rc}")
        pid = _read_pid(self.paths.pidfile)
        if pid is None or not _runs(pid, self.paths.config):
            raise ProxyError("haproxy started, but its pidfile names no running master")
        self._watch(pid)
        self.started_at = time.time()
        self.reloads = 0
        self.adopted = False
        deadline = time.monotonic() + timeout
        while True:
            if not self.running:
                raise ProxyError(f"haproxy (pid {pid}) exited at start (see {self.paths.output})")
            with contextlib.suppress(ProxyError):
                if await self.worker() is not None:
                    await _ask(self.paths.admin_socket, "show info")
                    return
            if time.monotonic() > deadline:
                raise ProxyError("haproxy did not start a worker in time")
            await asyncio.sleep(0.05)

    def _launch(self, timeout: float) -> tuple[int, str]:
        """Run the launcher, which returns once the master runs in the background: its
        status and what it printed.  A blocking Popen (in a thread) rather than the loop's:
        close_fds, so that the daemon holds none of the agent's descriptors (uvloop's
        subprocesses inherit every one not marked close-on-exec, libnftables' netlink
        sockets among them)."""
        out_path = self.paths.output
        with contextlib.suppress(OSError):
            if out_path.stat().st_size > OUTPUT_LIMIT:
                out_path.unlink()
        fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} agentd starts HAProxy\n".encode())
            out.flush()
            offset = os.fstat(fd).st_size
            argv = [self.binary, "-W", "-D", "-S", f"{self.paths.master_socket},mode,600", "-f", str(self.paths.config)]
            try:
                # Not the agent's environment (AGENTD_* may hold its BGP password): HAProxy needs none.
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, close_fds=True,
                                        cwd=self.paths.dir, env=PROXY_ENV)  # fmt: skip
            except OSError as err:
                return 127, f"[ALERT] cannot run {self.binary}: {err}"
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        with open(out_path, "rb") as f:
            f.seek(offset)
            return rc, f.read().decode(errors="replace")

    async def adopt(self) -> Worker | None:
        """Take over the master a previous agent started (its pidfile in our directory), if
        it is a HAProxy of our configuration whose master CLI answers with that PID; its
        current worker, or None (nothing adopted)."""
        pid = _read_pid(self.paths.pidfile)
        if pid is None or not _runs(pid, self.paths.config):
            return None
        try:
            pidfd = os.pidfd_open(pid)  # from here on the PID cannot name another process
        except OSError:
            return None
        try:
            master, workers = parse_proc(await _ask(self.paths.master_socket, "show proc"))
            if master is None or master[0] != pid:
                raise ProxyError(f"its master CLI names master {master[0] if master else None}")
            if not workers:
                raise ProxyError("it has no worker")
            await _ask(self.paths.admin_socket, "show info")
        except ProxyError as err:
            os.close(pidfd)
            log.warning("ingress: cannot adopt the HAProxy (pid %d) a previous agent left: %s", pid, err)
            return None
        self._watch(pid, pidfd)
        self.worker_pids = {w.pid for w in workers}
        self.reloads = master[1]
        self.adopted = True
        self.started_at = _start_time(pid)
        return min(workers, key=lambda w: w.reloads)

    def _watch(self, pid: int, fd: int | None = None) -> None:
        """Follow ``pid``'s exit through a pidfd (it need not be our child)."""
        self.detach()
        if fd is None:
            fd = os.pidfd_open(pid)
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def on_exit() -> None:
            if self._pidfd == fd:
                loop.remove_reader(fd)
                os.close(fd)
                self._pidfd = None
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(fd, on_exit)
        self.pid, self._pidfd, self._exited = pid, fd, exited

    def detach(self) -> None:
        """Stop following the master and leave it running (the agent stops; the next adopts it)."""
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._exited is not None and not self._exited.done():
            self._exited.cancel()
        self.pid = None

    async def wait(self) -> None:
        """Until the master exits."""
        assert self._exited is not None
        await asyncio.shield(self._exited)

    async def _exit_within(self, timeout: float) -> bool:
        if self._exited is None:
            return True
        try:
            async with asyncio.timeout(timeout):  # not wait_for: a cancel as the proxy exits must not be lost
                await asyncio.shield(self._exited)
        except TimeoutError:
            return False
        return True

    async def reload(self, timeout: float = 20.0) -> Worker:
        """Graceful reload (the configuration on disk was checked); the new current worker."""
        if not self.running or self.pid is None:
            raise ProxyError("haproxy is not running")
        before = await self.worker()
        os.kill(self.pid, signal.SIGUSR2)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(ProxyError):
                now = await self.worker()
                if now is not None and (before is None or now.pid != before.pid):
                    await _ask(self.paths.admin_socket, "show info")  # the new worker's socket answers
                    self.reloads += 1
                    return now
            if not self.running:
                raise ProxyError("haproxy exited during a reload")
            await asyncio.sleep(0.02)
        raise ProxyError("haproxy did not start a new worker after the reload")

    async def stop(self, timeout: float = 10.0) -> None:
        """Soft stop (requests in flight finish), then SIGKILL past ``timeout``; its sockets
        and pidfile removed."""
        pid = self.pid
        if pid is not None and self.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
            if not await self._exit_within(timeout) and _runs(pid, self.paths.config):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                await self._exit_within(5.0)
        self.detach()
        # A master that died (killed) leaves its workers running on the listening sockets, where
        # they would take connections from the next master's worker and refuse them.
        pids, self.worker_pids = self.worker_pids, set()
        await asyncio.to_thread(_end, [p for p in pids if _runs(p, self.paths.config)])
        for path in (self.paths.master_socket, self.paths.admin_socket, self.paths.pidfile):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    # ------------------------------------------------------------------ the CLIs

    async def worker(self) -> Worker | None:
        """The current worker (master CLI ``show proc``)."""
        _, workers = parse_proc(await _ask(self.paths.master_socket, "show proc"))
        self.worker_pids = {w.pid for w in workers}
        return min(workers, key=lambda w: w.reloads, default=None)

    async def workers(self) -> int:
        """How many workers run (old ones finishing their requests after a reload included)."""
        return len(parse_proc(await _ask(self.paths.master_socket, "show proc"))[1])

    async def command(self, command: str) -> str:
        return (await _ask(self.paths.admin_socket, command)).strip()

    async def stats(self) -> list[dict[str, str]]:
        """``show stat``: one row per frontend, backend and server."""
        text = await _ask(self.paths.admin_socket, "show stat")
        if not text.startswith("# "):
            raise ProxyError(f"show stat: unexpected answer {text[:60]!r}")
        return list(csv.DictReader(io.StringIO(text[2:])))

    async def info(self) -> dict[str, str]:
        text = await _ask(self.paths.admin_socket, "show info")
        out = {}
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                out[key.strip()] = value.strip()
        return out


class AccessLog:
    """The unix datagram socket HAProxy sends its access log to (``log <path> format raw``),
    drained into the ``agentd.ingress.access`` logger, or, given a ``writer``
    (``[ingress] access_log`` a file), handed to it in batches: its thread writes the file
    (agentd.ingress.access_log), the event loop only reads the socket.  A datagram socket
    because HAProxy's log sends never block: while no agent listens (a restart), lines are
    dropped, never queued in front of requests."""

    def __init__(self, path: Path, writer: FileWriter | None = None) -> None:
        self.path = path
        self.writer = writer
        self.sock: socket.socket | None = None
        # 0o622 when HAProxy's workers run as another user: the directory (0710, its group's) keeps others out.
        self.mode = 0o600

    def open(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(str(self.path))
        os.chmod(self.path, self.mode)
        if self.writer is not None:
            self.writer.start()
        asyncio.get_running_loop().add_reader(sock.fileno(), self._drain)
        self.sock = sock

    def _drain(self) -> None:
        assert self.sock is not None
        lines = []
        for _ in range(256):  # then back to the loop
            try:
                lines.append(self.sock.recv(65536))
            except OSError:  # BlockingIOError: none left
                break
        if not lines:
            return
        if self.writer is not None:
            self.writer.put(lines)
            return
        for line in lines:
            access_log.info("%s", line.decode(errors="replace").rstrip("\n"))

    def reopen(self) -> None:
        """SIGHUP: the file (if any) is closed and opened again (logrotate's postrotate)."""
        if self.writer is not None:
            self.writer.reopen()

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    async def aclose(self) -> None:
        """close(), and the file's lines still queued written before the file is closed."""
        self.close()
        if self.writer is not None:
            await asyncio.to_thread(self.writer.stop)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _start_time(pid: int) -> float | None:
    """When ``pid`` started (wall clock), from /proc."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def stop_stale(paths: Paths) -> bool:
    """End a HAProxy master of our configuration that its pidfile names and that no agent
    follows (it could not be adopted); True if there was one."""
    pid = _read_pid(paths.pidfile)
    if pid is None or not _runs(pid, paths.config):
        return False
    log.warning("stopping the HAProxy (pid %d) a previous agent left running", pid)
    workers = _children(pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists() or _zombie(pid):
            break
        time.sleep(0.05)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    # Workers of a master that had to be killed would go on taking connections on the
    # listening sockets (SO_REUSEPORT) beside the next master's.
    _end([w for w in workers if _runs(w, paths.config)])
    with contextlib.suppress(FileNotFoundError):
        paths.pidfile.unlink()
    return True


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _runs(pid: int, config: Path) -> bool:
    """Whether ``pid`` is a HAProxy of ``config`` (ours: never another lab's or host's)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"haproxy" in os.path.basename(argv[0]) and str(config).encode() in argv


def _end(pids: list[int]) -> None:
    """SIGKILL ``pids`` and wait (briefly) until they are gone."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:  # a worker of [ingress] user, and no CAP_KILL: it ends with its master
            log.warning("ingress: cannot end HAProxy worker %d (no CAP_KILL: docs/ingress.md); it exits once "
                        "it sees its master gone", pid)  # fmt: skip
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() and not _zombie(p) for p in pids):
        time.sleep(0.02)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except (OSError, IndexError):
        return True
