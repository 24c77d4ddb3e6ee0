"""Timeouts that keep a cancel: ``asyncio.timeout()`` rather than ``asyncio.wait_for()``.

On Python 3.11, ``wait_for`` runs a coroutine as a task of its own; when the caller is
cancelled in the loop step where that task completes, it returns the result and drops the
cancel (CPython gh-86296, rewritten in 3.12), and when the task completes while being
cancelled its result -- a connection -- is dropped.  Under ``asyncio.timeout()`` the awaited
work runs in the caller's own task: the cancel reaches it, and what it made is its own.
Pure: the loop is stepped with ``sleep(0)``, nothing waits on the clock.
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

from agentd.services import dns as sdns

ROOT = Path(__file__).resolve().parents[3]


async def _steps(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _race(wait) -> tuple[bool, object]:
    """A task awaiting ``wait(fut)``; ``fut`` completes, one loop step later the task is
    cancelled: did the task end cancelled, and what did it return otherwise?"""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    async def inner() -> str:
        await done
        return "connection"

    async def caller() -> str:
        got = await wait(inner())
        await _steps(50)  # what the caller does next: a cancel must have stopped it before
        return got

    task = asyncio.create_task(caller())
    await _steps()
    done.set_result(None)
    await asyncio.sleep(0)  # the inner work completes in this step ...
    task.cancel()  # ... and the caller is cancelled in it
    await _steps()
    return task.cancelled(), (None if task.cancelled() or not task.done() else task.result())


async def _with_wait_for(aw):
    return await asyncio.wait_for(aw, 10)


async def _with_timeout(aw):
    async with asyncio.timeout(10):
        return await aw


def test_a_cancel_that_comes_as_the_work_completes_is_kept_by_timeout():
    cancelled, _ = asyncio.run(_race(_with_timeout))
    assert cancelled
    if sys.version_info < (3, 12):  # why agentd does not use wait_for where a cancel matters
        cancelled, _ = asyncio.run(_race(_with_wait_for))
        assert not cancelled


class _Transport:
    def get_write_buffer_size(self) -> int:
        return 0  # nothing left to send: the handler closes (aborts only with answers unsent)


class _Writer:
    def __init__(self) -> None:
        self.closed = False
        self.transport = _Transport()

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_the_dns_tcp_handler_ends_when_cancelled_as_a_query_arrives():
    # The server closing cancels its connections' handlers; a handler whose length prefix
    # arrived in that step must end, not go on to wait for the query's bytes.
    async def main() -> tuple[bool, bool]:
        server = sdns.DnsServer("127.0.0.1", 53, lambda: sdns.Names("cluster.local."), [])
        reader, writer = asyncio.StreamReader(), _Writer()
        task = asyncio.create_task(server._tcp_client(reader, writer))  # type: ignore[arg-type]
        await _steps()
        reader.feed_data(b"\x00\x1c")  # a 28-byte query follows (it never comes)
        await asyncio.sleep(0)
        task.cancel()
        await _steps()
        ended = task.done()
        if not ended:
            task.cancel()
            await _steps()
        return ended, writer.closed

    assert asyncio.run(main()) == (True, True)


# Where agentd (outside the datastore, which wraps its calls in cancel_kept) still uses
# wait_for, and why that is safe there: what it returns owns nothing (a line, bytes, an exit
# status), and a lost cancel only lets a short, bounded wait of a lab tool or a stopping
# worker finish.  A new use belongs here with its reason, or under asyncio.timeout().
WAIT_FOR_KEPT = {
    "agentd/datastore/connection.py": 2,  # cancel_kept(wait_for(...)), and closing a client
    "agentd/datastore/liveness.py": 1,  # cancel_kept(wait_for(...))
    "agentd/datastore/watches.py": 2,  # cancel_kept(wait_for(...)): the snapshot, the revision check on resuming
    "agentd/dataplane/control.py": 3,  # proc.wait() while starting/stopping the worker, its output drain: exit status
    "agentd/lab/resources.py": 2,  # a lab tool's reply line, its process exit
    "agentd/lab/runtime.py": 1,  # a CNI plugin's output (the process is waited for either way)
    "agentd/lab/etcd.py": 3,  # a socket the caller owns and closes, a reply's bytes, wait_closed
    "agentd/lab/netns.py": 1,  # a command's output (communicate)
    "agentd/lab/svcecho.py": 3,  # reply lines
    "agentd/lab/httpecho.py": 1,  # the server's ready line
    "agentd/lab/probe.py": 7,  # reply bytes and lines, a shielded future, process exits
}


def test_wait_for_is_left_only_where_a_lost_result_or_cancel_costs_nothing():
    found = {}
    for top in ("agentd", "bgp"):
        for path in sorted((ROOT / top).rglob("*.py")):
            n = len(re.findall(r"\basyncio\.wait_for\(", path.read_text()))
            if n:
                found[str(path.relative_to(ROOT))] = n
    assert found == WAIT_FOR_KEPT
