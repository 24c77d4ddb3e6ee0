"""Agent-side control of the data-plane worker (asyncio).

``DataplaneProcess`` spawns ``python -m agentd.dataplane ...`` and waits until its control
socket answers; ``DataplaneClient`` speaks the worker's JSON-lines protocol over that unix
socket.  A restarted agent simply connects again: the worker keeps forwarding with its last
table while nobody is connected (and exits after its orphan timeout).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence

from agentd.dataplane._forward import unicast_ipv4

log = logging.getLogger("agentd.dataplane")

DEFAULT_CONTROL = {"udp": "/run/agentd/dataplane-udp.sock", "ipip": "/run/agentd/dataplane-ipip.sock"}


class DataplaneError(RuntimeError):
    """The worker refused a request, is unreachable, or failed to start."""


def _table(table: Mapping[str, str], what: str) -> dict[str, str]:
    """``table`` ({prefix: underlay address}) checked as the worker checks it, as JSON wants it."""
    if not isinstance(table, Mapping):
        raise DataplaneError(f"{what} must be a mapping {{prefix: underlay address}}")
    for prefix, via in table.items():
        try:
            ipaddress.ip_network(prefix, strict=True)
            unicast_ipv4(via)
        except (ValueError, TypeError) as exc:
            raise DataplaneError(f"bad next hop {prefix!r} -> {via!r}: {exc}") from None
    return {str(k): str(v) for k, v in table.items()}


class DataplaneClient:
    """One control connection to a worker.  Requests are serialised (one in flight)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str) -> None:
        self._reader = reader
        self._writer = writer
        self._lock = asyncio.Lock()
        self.path = path

    @classmethod
    async def connect(cls, path: str, timeout: float = 5.0) -> DataplaneClient:
        try:
            # Not wait_for: on Python 3.11 a cancel as the connection is made would leave it open
            # (or be dropped); under asyncio.timeout the connection and the cancel stay ours.
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(path, limit=16 << 20)
        except (OSError, asyncio.TimeoutError) as exc:
            raise DataplaneError(f"cannot connect to the data-plane worker at {path}: {exc}") from None
        return cls(reader, writer, path)

    async def _call(self, request: dict, timeout: float = 10.0) -> dict:
        async with self._lock:
            try:
                self._writer.write(json.dumps(request).encode() + b"\n")
                await self._writer.drain()
                async with asyncio.timeout(timeout):  # a cancel while the lock is held must propagate
                    line = await self._reader.readline()
            except (OSError, asyncio.TimeoutError) as exc:
                raise DataplaneError(f"data-plane worker at {self.path}: {exc or type(exc).__name__}") from None
        if not line:
            raise DataplaneError(f"data-plane worker at {self.path} closed the connection")
        try:
            resp = json.loads(line)
        except ValueError:
            raise DataplaneError(f"data-plane worker sent invalid JSON: {line[:80]!r}") from None
        if not resp.get("ok"):
            raise DataplaneError(resp.get("error", "request failed"))
        return resp

    async def set_next_hops(self, next_hops: Mapping[str, str], sources: Mapping[str, str] | None = None) -> int:
        """Replace the table: inner destination prefix (IPv4 or IPv6) -> peer underlay IPv4
        (longest prefix wins).  ``sources``: the reverse-path table the worker checks what it
        receives against -- every pod subnet this node routes to a peer node, whatever carries
        it, by that peer's address (None: the next hops; a worker that predates it ignores it).
        Returns the number of next hops."""
        request = {"op": "set_next_hops", "next_hops": _table(next_hops, "next_hops")}
        if sources is not None:
            request["sources"] = _table(sources, "sources")
        resp = await self._call(request)
        return resp["next_hops"]

    async def set_members(self, members: Iterable[str]) -> int:
        """Replace the set of underlay addresses allowed to send us encapsulated packets."""
        if isinstance(members, (str, bytes)):
            raise DataplaneError("members must be a collection of addresses, not one string")
        members = [str(m) for m in members]
        for m in members:
            try:
                unicast_ipv4(m)
            except ValueError as exc:
                raise DataplaneError(f"bad member address {m!r}: {exc}") from None
        resp = await self._call({"op": "set_members", "members": members})
        return resp["members"]

    async def stats(self) -> dict:
        return (await self._call({"op": "stats"}))["stats"]

    async def get(self) -> dict:
        """``{"config": {...}, "next_hops": {...}, "members": [...], "sources": {...}}`` as the
        worker holds them."""
        resp = await self._call({"op": "get"})
        return {"config": resp["config"], "next_hops": resp["next_hops"], "members": resp["members"],
                "sources": resp.get("sources")}  # (None from a worker that predates them)

    async def shutdown(self, remove_device: bool = False) -> None:
        """Ask the worker to exit; with ``remove_device`` its TUN device goes too."""
        await self._call({"op": "shutdown", "remove_device": bool(remove_device)})

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await self._writer.wait_closed()


class DataplaneProcess:
    """A worker process started by the agent."""

    def __init__(self, proc: asyncio.subprocess.Process, control_path: str) -> None:
        self._proc = proc
        self.control_path = control_path
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self._drain = asyncio.ensure_future(self._forward_stderr())

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def _forward_stderr(self) -> None:
        assert self._proc.stderr is not None
        while line := await self._proc.stderr.readline():
            text = line.decode(errors="replace").rstrip()
            self._stderr_tail.append(text)
            log.info("%s", text)

    @classmethod
    async def start(
        cls,
        kind: str,
        tun: str,
        mtu: int,
        local_ip: str,
        port: int = 8285,
        control_path: str | None = None,
        python: str = sys.executable,
        *,
        offload: bool = True,
        orphan_timeout: float = 120.0,
        netns: str | None = None,
        extra_args: Sequence[str] = (),
        ready_timeout: float = 15.0,
        state_path: str | None = None,
        sock: socket.socket | None = None,
    ) -> DataplaneProcess:
        """Spawn the worker and return once its control socket accepts connections.

        ``netns`` runs it through ``ip netns exec`` (the lab and tests; the agent itself
        already runs in the node's namespace).  ``state_path``: its state file (default: the
        control socket's path + ``.state``).  ``sock`` (udp): a socket bound to ``local_ip:port``
        that the worker inherits and uses instead of binding its own (the agent keeps it open).
        """
        control_path = control_path or DEFAULT_CONTROL.get(kind, f"/run/agentd/dataplane-{kind}.sock")
        argv = [python, "-m", "agentd.dataplane", kind, "--tun", tun, "--mtu", str(mtu),
                "--local-ip", local_ip, "--port", str(port), "--control", control_path,
                "--orphan-timeout", str(orphan_timeout), *extra_args]
        if state_path:
            argv += ["--state", state_path]
        if not offload:
            argv.append("--no-offload")
        pass_fds: tuple[int, ...] = ()
        if sock is not None:
            pass_fds = (sock.fileno(),)
            argv += ["--socket-fd", str(pass_fds[0])]
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, pass_fds=pass_fds,
        )
        self = cls(proc, control_path)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ready_timeout
        while True:
            if proc.returncode is not None:
                await asyncio.sleep(0.05)  # let the stderr reader catch the last line
                raise DataplaneError(f"data-plane worker exited with {proc.returncode}: "
                                     + (self._stderr_tail[-1] if self._stderr_tail else "no output"))
            try:
                client = await DataplaneClient.connect(control_path, timeout=1.0)
            except DataplaneError:
                pass
            else:
                await client.close()
                return self
            if loop.time() > deadline:
                await self.stop()
                raise DataplaneError(f"data-plane worker did not open {control_path} within {ready_timeout}s")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), 0.05)

    async def wait(self) -> int:
        """Wait for the worker to exit (e.g. after a shutdown request); its exit status."""
        return await self._proc.wait()

    async def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status."""
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self._proc.wait(), timeout)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                await self._proc.wait()
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(self._drain, 2.0)
        return self._proc.returncode
