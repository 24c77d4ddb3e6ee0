"""The HAProxy process: start, check, graceful reload, runtime commands, counters, stop.

HAProxy runs in master-worker mode (``-W``) with the master CLI on a unix socket (``-S``):

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
import io
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from .haproxy import Paths

log = logging.getLogger("agentd.ingress")
access_log = logging.getLogger("agentd.ingress.access")

SOCKET_TIMEOUT = 5.0


class ProxyError(RuntimeError):
    """The proxy refused a configuration or a command, or is not running; one line."""


@dataclass(frozen=True)
class Worker:
    pid: int
    reloads: int  # 0: the current generation


async def _ask(path: Path, command: str, timeout: float = SOCKET_TIMEOUT) -> str:
    """One command on a HAProxy CLI socket (non-interactive: the answer ends at EOF)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), timeout)
    except (OSError, TimeoutError) as err:
        raise ProxyError(f"cannot reach {path.name}: {err or type(err).__name__}") from None
    try:
        writer.write(command.encode() + b"\n")
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        return (await asyncio.wait_for(reader.read(), timeout)).decode(errors="replace")
    except (OSError, TimeoutError, RuntimeError) as err:  # RuntimeError: uvloop, the peer closed (a re-exec)
        raise ProxyError(f"{path.name}: {command!r}: {err or type(err).__name__}") from None
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


class Proxy:
    def __init__(self, paths: Paths, binary: str = "haproxy") -> None:
        self.paths = paths
        self.binary = binary
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at: float | None = None
        self.reloads = 0
        self.worker_pids: set[int] = set()  # the workers of the last show proc, for cleaning up after a crash
        self._output: asyncio.Task | None = None

    # ------------------------------------------------------------------ configuration

    async def check(self, config: Path) -> None:
        """ProxyError with HAProxy's own words unless ``config`` is valid."""
        proc = await asyncio.create_subprocess_exec(
            self.binary, "-c", "-q", "-f", str(config),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            lines = [ln.strip() for ln in out.decode(errors="replace").splitlines() if "ALERT" in ln or "rror" in ln]
            raise ProxyError("; ".join(lines[:3]) or f"haproxy -c exited with {proc.returncode}")

    # ------------------------------------------------------------------ the process

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running and self.proc is not None else None

    async def start(self, timeout: float = 20.0) -> None:
        """Start the master (after ending one a previous agent left behind) and wait for its worker."""
        await asyncio.to_thread(stop_stale, self.paths)
        with contextlib.suppress(FileNotFoundError):
            self.paths.master_socket.unlink()
        self.proc = await asyncio.create_subprocess_exec(
            self.binary, "-W", "-S", f"{self.paths.master_socket},mode,600", "-f", str(self.paths.config),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        self.started_at = time.time()
        self._output = asyncio.get_running_loop().create_task(self._read_output(self.proc))
        deadline = time.monotonic() + timeout
        while True:
            if not self.running:
                await self._drain_output()
                raise ProxyError(f"haproxy exited at start with status {self.proc.returncode} (see the log above)")
            with contextlib.suppress(ProxyError):
                if await self.worker() is not None:
                    await _ask(self.paths.admin_socket, "show info")
                    return
            if time.monotonic() > deadline:
                raise ProxyError("haproxy did not start a worker in time")
            await asyncio.sleep(0.05)

    async def _read_output(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            text = line.decode(errors="replace").rstrip()
            if text.startswith("[NOTICE]") or "Reexecuting Master" in text or "Loading success" in text:
                log.debug("haproxy: %s", text)
            elif text.startswith(("[WARNING]", "[ALERT]")):
                log.warning("haproxy: %s", text)
            else:
                access_log.info("%s", text)

    async def _drain_output(self) -> None:
        if self._output is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._output), 1.0)

    async def wait(self) -> int:
        """Until the master exits; its status."""
        assert self.proc is not None
        rc = await self.proc.wait()
        await self._drain_output()
        return rc

    async def reload(self, timeout: float = 20.0) -> Worker:
        """Graceful reload (the configuration on disk was checked); the new current worker."""
        if not self.running or self.proc is None:
            raise ProxyError("haproxy is not running")
        before = await self.worker()
        self.proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(ProxyError):
                now = await self.worker()
                if now is not None and (before is None or now.pid != before.pid):
                    await _ask(self.paths.admin_socket, "show info")  # the new worker's socket answers
                    self.reloads += 1
                    return now
            if not self.running:
                raise ProxyError(f"haproxy exited during a reload with status {self.proc.returncode}")
            await asyncio.sleep(0.02)
        raise ProxyError("haproxy did not start a new worker after the reload")

    async def stop(self, timeout: float = 10.0) -> None:
        """Soft stop (requests in flight finish), then SIGTERM/SIGKILL past ``timeout``."""
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGUSR1)
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        await self._drain_output()
        if self._output is not None:
            self._output.cancel()
        self.proc = None
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
        text = await _ask(self.paths.master_socket, "show proc")
        best = None
        section = ""
        pids = set()
        for line in text.splitlines():
            if line.startswith("#"):
                section = line
                continue
            parts = line.split()
            if len(parts) >= 3 and parts[1] == "worker" and "programs" not in section:
                with contextlib.suppress(ValueError):
                    w = Worker(int(parts[0]), int(parts[2]))
                    pids.add(w.pid)
                    if best is None or w.reloads < best.reloads:
                        best = w
        self.worker_pids = pids
        return best

    async def workers(self) -> int:
        """How many workers run (old ones finishing their requests after a reload included)."""
        text = await _ask(self.paths.master_socket, "show proc")
        return sum(1 for line in text.splitlines() if len(line.split()) > 1 and line.split()[1] == "worker")

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


def stop_stale(paths: Paths) -> bool:
    """End a HAProxy master a previous agent left running on our configuration (it was killed
    without stopping it); True if there was one."""
    try:
        pid = int(paths.pidfile.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return False
    if str(paths.config).encode() not in cmdline or not any(b"haproxy" in part for part in cmdline[:1]):
        return False
    log.warning("stopping the HAProxy (pid %d) a previous agent left running", pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists() or _zombie(pid):
            break
        time.sleep(0.05)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        paths.pidfile.unlink()
    return True


def _runs(pid: int, config: Path) -> bool:
    """Whether ``pid`` is a HAProxy of ``config`` (ours: never another lab's or host's)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"haproxy" in argv[0] and str(config).encode() in argv


def _end(pids: list[int]) -> None:
    """SIGKILL ``pids`` and wait (briefly) until they are gone."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() and not _zombie(p) for p in pids):
        time.sleep(0.02)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except (OSError, IndexError):
        return True
