"""A pod's servers and prober for the lab's reachability matrices (NetworkPolicy tests and benches).

Run inside a pod's namespace (``python -m agentd.lab.probe NAME tcp:80,tcp:81,udp:80,udp:81``),
it serves the given TCP and UDP ports (answering with its name) and reads probe requests,
one JSON line each, on stdin::

    {"targets": [["10.244.1.2", "tcp", 80], ...], "timeout": 1.0}

and answers one JSON line: ``[true, false, ...]`` in the same order.  All probes of a
request run at once.  ``{"hammer": {"targets": [...], "seconds": 5, "interval": 0.01,
"timeout": 0.5}}`` instead starts a probe of every target every ``interval`` seconds (without
waiting for the previous one) for ``seconds`` and answers ``{"ok": [...], "failed": [...]}``,
counts per target: traffic that runs while something else changes.  Meanwhile it writes a
line ``{"progress": {"started": [...], "ok": [...], "failed": [...]}}`` whenever probes have
ended (at most every 50 ms), and ``{"stop": true}`` ends it early (what was started still
ends).  More probes of a target ended than had started at some moment means one started
after that moment has ended: :meth:`Prober.wait_probed` waits for that.  A TCP probe
succeeds when a connection is made and the server's name comes back; a UDP probe when a datagram sent (again every 200 ms) is echoed with its nonce.
A probe that is dropped by policy fails after ``timeout`` seconds.  Servers listen on IPv4
and IPv6 (where the namespace has IPv6); a target is probed over the family of its address.

:class:`Prober` is the test side: it starts the process in a pod's namespace and asks it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from typing import Any


# ------------------------------------------------------------------ in the pod


class _Echo(asyncio.DatagramProtocol):
    def __init__(self, name: bytes) -> None:
        self.name = name
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        assert self.transport is not None
        self.transport.sendto(self.name + b" " + data, addr)


async def _tcp_probe(ip: str, port: int, timeout: float) -> bool:
    try:
        async with asyncio.timeout(timeout):  # not wait_for: the connection must not escape a cancel
            reader, writer = await asyncio.open_connection(ip, port)
    except (OSError, TimeoutError):
        return False
    try:
        data = await asyncio.wait_for(reader.read(100), timeout)
        return bool(data)
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()


class _UdpClient(asyncio.DatagramProtocol):
    def __init__(self, nonce: bytes) -> None:
        self.nonce = nonce
        self.done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if data.endswith(self.nonce) and not self.done.done():
            self.done.set_result(True)

    def error_received(self, exc: Exception) -> None:
        pass


# UDP probes take their source ports in turn from a range below the kernel's ephemeral ports,
# so a probe never reuses the 5-tuple of an earlier one: conntrack keeps a UDP flow for 30 s
# (120 s once answered), and a later probe on the same tuple would ride that old flow -
# allowed then, maybe denied now - instead of being judged as the new flow it is.
_SOURCE_PORTS = range(20000, 32000)
_next_port = [20000 + int.from_bytes(os.urandom(2), "big") % len(_SOURCE_PORTS)]


def _udp_socket(ip: str) -> socket.socket:
    v6 = ":" in ip
    sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(len(_SOURCE_PORTS)):
        port = _next_port[0]
        _next_port[0] = port + 1 if port + 1 < _SOURCE_PORTS.stop else _SOURCE_PORTS.start
        try:
            sock.bind(("::" if v6 else "0.0.0.0", port))
            return sock
        except OSError:
            continue
    sock.close()
    raise OSError("no free UDP source port for a probe")


async def _udp_probe(ip: str, port: int, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    nonce = os.urandom(8).hex().encode()
    sock = _udp_socket(ip)
    sock.connect((ip, port))
    transport, proto = await loop.create_datagram_endpoint(lambda: _UdpClient(nonce), sock=sock)
    try:
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            transport.sendto(nonce)
            try:
                return await asyncio.wait_for(asyncio.shield(proto.done), min(0.2, max(0.01, deadline - loop.time())))
            except TimeoutError:
                continue
        return False
    finally:
        transport.close()


PROGRESS_EVERY = 0.05  # seconds between two progress lines of a hammer, at most


async def _hammer(targets: list[list[Any]], seconds: float, interval: float = 0.01, timeout: float = 0.5, *,
                  stop: asyncio.Event | None = None) -> dict[str, list[int]]:
    loop = asyncio.get_running_loop()
    ok = [0] * len(targets)
    failed = [0] * len(targets)
    started = [0] * len(targets)
    tasks: set[asyncio.Task] = set()
    told = [-1.0, 0]  # when the last progress line went, and how many probes had ended then

    def progress() -> None:
        ended = sum(ok) + sum(failed)
        if ended != told[1] and loop.time() - told[0] >= PROGRESS_EVERY:
            told[:] = [loop.time(), ended]
            _say({"progress": {"started": started, "ok": ok, "failed": failed}})

    async def one(i: int, ip: str, proto: str, port: int) -> None:
        good = await (_tcp_probe if proto == "tcp" else _udp_probe)(ip, int(port), timeout)
        if good:
            ok[i] += 1
        else:
            failed[i] += 1
        progress()

    end = loop.time() + seconds
    while loop.time() < end and not (stop is not None and stop.is_set()):
        for i, (ip, proto, port) in enumerate(targets):
            started[i] += 1
            task = loop.create_task(one(i, ip, proto, port))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.sleep(interval)
    if tasks:
        await asyncio.gather(*tasks)
    return {"ok": ok, "failed": failed}


def wildcards() -> list[str]:
    """The wildcard addresses to listen on: IPv4's, and IPv6's where the namespace has IPv6."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.bind(("::", 0))
    except OSError:
        return ["0.0.0.0"]
    return ["0.0.0.0", "::"]


def udp_server(host: str, port: int) -> socket.socket:
    """A UDP socket bound to ``host``:``port``; an IPv6 one for IPv6 alone, beside the IPv4 one."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    if ":" in host:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((host, port))
    return sock


def _say(message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def _serve(name: str, ports: list[tuple[str, int]]) -> None:
    loop = asyncio.get_running_loop()
    label = name.encode()

    async def on_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(label)
            await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    servers: list[Any] = []
    for proto, port in ports:
        for host in wildcards():
            if proto == "tcp":
                servers.append(await asyncio.start_server(on_tcp, host, port, reuse_address=True))
            else:
                transport, _ = await loop.create_datagram_endpoint(lambda: _Echo(label), sock=udp_server(host, port))
                servers.append(transport)
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    _say("ready")
    stop = asyncio.Event()
    hammering: set[asyncio.Task] = set()

    async def hammer(args: dict[str, Any]) -> None:
        stop.clear()
        _say(await _hammer(**args, stop=stop))

    while line := await reader.readline():
        req = json.loads(line)
        if "hammer" in req:  # runs on while this reads on: a "stop" may come
            task = loop.create_task(hammer(req["hammer"]))
            hammering.add(task)
            task.add_done_callback(hammering.discard)
            continue
        if "stop" in req:
            stop.set()
            continue
        timeout = float(req.get("timeout", 1.0))
        probes = [
            (_tcp_probe if proto == "tcp" else _udp_probe)(ip, int(port), timeout)
            for ip, proto, port in req["targets"]
        ]
        results = await asyncio.gather(*probes)
        _say(list(results))
    if hammering:
        await asyncio.gather(*hammering)


# ------------------------------------------------------------------ the test side


class Prober:
    """The servers and prober of one lab pod (a process inside its namespace)."""

    def __init__(self, pod: Any, proc: asyncio.subprocess.Process) -> None:
        self.pod = pod
        self.proc = proc
        self._lock = asyncio.Lock()
        self.progress: dict[str, list[int]] = {"started": [], "ok": [], "failed": []}  # of the hammer running now
        self.updates = 0  # progress lines read
        self._updated = asyncio.Event()  # set at each

    @classmethod
    async def start(cls, pod: Any, ports: list[tuple[str, int]]) -> Prober:
        spec = ",".join(f"{p}:{n}" for p, n in ports)
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", pod.ns.name, sys.executable, "-m", "agentd.lab.probe", pod.name, spec,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            limit=1 << 24,
        )  # fmt: skip
        self = cls(pod, proc)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if json.loads(line or b"null") != "ready":
            raise RuntimeError(f"prober of {pod.name} did not start")
        return self

    async def probe(self, targets: list[tuple[str, str, int]], timeout: float = 1.0) -> list[bool]:
        if not targets:
            return []
        async with self._lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps({"targets": targets, "timeout": timeout}).encode() + b"\n")
            await self.proc.stdin.drain()
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout * 3 + 30)
        if not line:
            raise RuntimeError(f"prober of {self.pod.name} exited")
        return json.loads(line)

    async def hammer(
        self, targets: list[tuple[str, str, int]], seconds: float, *, interval: float = 0.01, timeout: float = 0.5
    ) -> dict[str, list[int]]:
        """Probe every target every ``interval`` s for ``seconds`` (or until :meth:`stop_hammer`);
        counts of ok and failed per target.  Meanwhile :attr:`progress` and :meth:`ended` say
        how many probes of each target have started and ended so far."""
        async with self._lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.progress = {"started": [0] * len(targets), "ok": [0] * len(targets), "failed": [0] * len(targets)}
            req = {"hammer": {"targets": targets, "seconds": seconds, "interval": interval, "timeout": timeout}}
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            await self.proc.stdin.drain()
            deadline = asyncio.get_running_loop().time() + seconds + timeout + 60
            while True:
                line = await asyncio.wait_for(self.proc.stdout.readline(), deadline - asyncio.get_running_loop().time())
                if not line:
                    raise RuntimeError(f"prober of {self.pod.name} exited (status {await self.proc.wait()})")
                answer = json.loads(line)
                if "progress" not in answer:
                    return answer
                self.progress = answer["progress"]
                self.updates += 1
                self._updated.set()

    def ended(self) -> list[int]:
        """Probes of each target of the running hammer that have ended, ok or failed."""
        return [a + b for a, b in zip(self.progress["ok"], self.progress["failed"])]

    async def wait_probed(self, what: str, timeout: float = 30.0) -> None:
        """Until the running hammer has ended, for every target, a probe it started after
        now: the next progress line says how many had started (at least as many as now),
        and more than that must have ended."""
        deadline = asyncio.get_running_loop().time() + timeout
        seen = self.updates
        while self.updates == seen:
            await self._next_progress(deadline, what)
        started = list(self.progress["started"])
        while not all(e > s for e, s in zip(self.ended(), started)):
            await self._next_progress(deadline, what)

    async def _next_progress(self, deadline: float, what: str) -> None:
        """Until the next progress line (hammer() reads them)."""
        self._updated.clear()
        try:
            await asyncio.wait_for(self._updated.wait(), max(0.0, deadline - asyncio.get_running_loop().time()))
        except TimeoutError:
            raise AssertionError(f"{self.pod.name}: timed out waiting for {what} (progress {self.progress})") from None

    def stop_hammer(self) -> None:
        """End the running hammer now (its answer then comes as usual)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b'{"stop": true}\n')

    async def close(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def main(argv: list[str]) -> None:
    name, spec = argv[0], argv[1]
    ports = [(p.split(":")[0], int(p.split(":")[1])) for p in spec.split(",") if p]
    socket.setdefaulttimeout(None)
    asyncio.run(_serve(name, ports))


if __name__ == "__main__":
    main(sys.argv[1:])
