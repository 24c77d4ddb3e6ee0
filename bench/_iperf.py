"""iperf3 between lab namespaces, the way every throughput bench runs it: the server is
started and the client begins only once the server's socket is listening (polled with
``ss``, no sleep), and a run that fails is a :class:`bench._common.BenchError`, never
0 Gbit/s (bench/_common.py ``iperf3_result``).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator, Sequence

from bench._common import BenchError, Iperf3Run, iperf3_result

from agentd.lab.netns import Netns
from agentd.lab.wait import auntil

PORT = 5201


def listening(ns: Netns, port: int) -> bool:
    """Is a TCP socket listening on ``port`` in ``ns``?"""
    return bool(ns.exec("ss", "-Hltn", f"sport = :{port}", check=False).strip())


@contextlib.asynccontextmanager
async def server(ns: Netns, *, port: int = PORT, bind: str | None = None, once: bool = False,
                 prefix: Sequence[str] = (), what: str = "iperf3 server") -> AsyncIterator[None]:
    """``iperf3 -s`` in ``ns`` (``prefix``: e.g. ``taskset -c 1``), listening before the
    body runs; stopped after it (:func:`serving`)."""
    args = [*prefix, "iperf3", "-s", "-p", str(port)]
    if bind:
        args += ["-B", bind]
    if once:
        args.append("-1")
    async with serving(ns, args, port, what):
        yield


@contextlib.asynccontextmanager
async def serving(ns: Netns, args: Sequence[str], port: int, what: str, *, new_session: bool = False) -> AsyncIterator[None]:
    """A server (``args``) started in ``ns`` -- in a session of its own with ``new_session`` --,
    listening on TCP ``port`` before the body runs; stopped after it.  A server that exits or
    does not listen within 10 s is a BenchError with what it said."""
    proc = ns.popen(list(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=new_session)
    try:
        def exited() -> str | None:
            if proc.poll() is None:
                return None
            said = proc.stderr.read().decode(errors="replace").strip()[-300:] if proc.stderr else ""
            return f"{what} exited ({proc.returncode}): {said or 'no reason given'}"

        await auntil(lambda: listening(ns, port), 10, interval=0.01, abort=exited, in_thread=True,
                     what=f"{what} to listen on port {port}", error=BenchError)
        yield
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stderr:
            proc.stderr.close()


async def client(ns: Netns, dst: str, seconds: float, *, port: int = PORT, prefix: Sequence[str] = (),
                 what: str = "iperf3") -> Iperf3Run:
    """One TCP stream from ``ns`` to ``dst`` for ``seconds`` (whole seconds, at least 1)."""
    secs = max(1, int(seconds))
    rc, out, err = await ns.aexec(*prefix, "iperf3", "-c", dst, "-p", str(port), "-t", str(secs), "-J",
                                  check=False, timeout=secs + 30)
    return iperf3_result(rc, out, err, what)


async def run(client_ns: Netns, server_ns: Netns, dst: str, seconds: float, *, port: int = PORT,
              bind: str | None = None, client_prefix: Sequence[str] = (), server_prefix: Sequence[str] = (),
              what: str = "iperf3") -> Iperf3Run:
    """A one-off server (``-1``) in ``server_ns`` and one client run against it."""
    async with server(server_ns, port=port, bind=bind, once=True, prefix=server_prefix, what=f"{what}: the server"):
        return await client(client_ns, dst, seconds, port=port, prefix=client_prefix, what=what)
