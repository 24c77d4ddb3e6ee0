"""A small supervision tree for the agent's long-running tasks.

Each child is a named coroutine *factory*.  If the coroutine raises (CancelledError too,
when nobody cancelled it: a library raising it), the supervisor
logs it with the traceback, marks the child down (``/healthz`` reports it) and starts
it again after an exponentially growing delay, reset once the child has run
``stable_after`` seconds.  A child that returns normally is done and not restarted.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger("agentd.supervisor")

Factory = Callable[[], Awaitable[None]]


@dataclass
class Child:
    name: str
    factory: Factory
    task: asyncio.Task | None = None
    restarts: int = 0
    last_error: str = ""
    last_crash: float | None = None
    started_at: float = 0.0
    down: bool = False
    done: bool = False
    _failures: int = field(default=0, repr=False)


class Supervisor:
    def __init__(
        self,
        *,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        stable_after: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        recancel_after: float = 2.0,
    ) -> None:
        self.children: dict[str, Child] = {}
        self._recancel_after = recancel_after
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._stable_after = stable_after
        self._clock = clock
        self._closing = False
        self._runners: dict[str, asyncio.Task] = {}

    def start(self, name: str, factory: Factory) -> Child:
        if name in self.children:
            raise ValueError(f"a task named {name!r} is already supervised")
        child = Child(name, factory)
        self.children[name] = child
        self._runners[name] = asyncio.get_running_loop().create_task(self._run(child), name=f"supervise:{name}")
        return child

    async def _run(self, child: Child) -> None:
        while not self._closing:
            child.started_at = self._clock()
            child.down = False
            child.task = asyncio.get_running_loop().create_task(child.factory(), name=child.name)
            try:
                await child.task
            except asyncio.CancelledError as cancelled:
                if self._closing:
                    return
                me = asyncio.current_task()
                if me is not None and me.cancelling():  # this runner itself was cancelled
                    raise
                # The child ended cancelled though nobody cancelled it (a library raising
                # CancelledError, e.g. grpc.aio on a channel closed under it): a crash.
                err: BaseException = cancelled
            except Exception as crash:  # noqa: BLE001 - a crash: log, mark down, restart later
                err = crash
            else:
                child.done = True
                return
            ran = self._clock() - child.started_at
            if ran >= self._stable_after:
                child._failures = 0
            delay = min(self._backoff_max, self._backoff_initial * (2**child._failures))
            delay *= 0.75 + 0.25 * random.random()
            child._failures += 1
            child.restarts += 1
            child.down = True
            child.last_crash = time.time()
            child.last_error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            log.error("task %s crashed (%s); restarting in %.1fs", child.name, child.last_error, delay, exc_info=err)
            await asyncio.sleep(delay)

    def health(self) -> tuple[bool, list[str]]:
        problems = []
        for c in self.children.values():
            if c.down:
                problems.append(f"task {c.name} is down after a crash ({c.last_error}); restarting")
        return not problems, problems

    def summary(self) -> list[dict]:
        return [
            {
                "name": c.name,
                # done: it returned, as it should (the watchdog without WATCHDOG_USEC, the
                # cluster token once read): not restarted, and not a problem as "down" is.
                "state": "done" if c.done else "down" if c.down else "running",
                "running": not c.down and not c.done,
                "restarts": c.restarts,
                "last_error": c.last_error or None,
                "last_crash": c.last_crash,
            }
            for c in self.children.values()
        ]

    async def stop(self) -> None:
        """Cancel every task and wait until all have ended.  Every task still running
        ``recancel_after`` seconds after it was cancelled is cancelled again, ours and those
        they started (a TaskGroup's, which it cancels once): a cancel can be lost on its way
        (Python 3.11's ``asyncio.wait_for`` drops one that lands in the loop step where the
        awaited thing completes, CPython gh-86296, and libraries wait that way), and a task
        that lost it would hold the agent's exit forever."""
        self._closing = True
        tasks = [c.task for c in self.children.values() if c.task is not None] + list(self._runners.values())
        for task in tasks:
            task.cancel()
        pending = {t for t in tasks if not t.done()}
        while pending:
            _, pending = await asyncio.wait(pending, timeout=self._recancel_after)
            if not pending:
                break
            me = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not me and task.cancelling() and not task.done():
                    log.warning("task %s did not end when cancelled; cancelling it again", task.get_name())
                    task.cancel()
        for task in tasks:  # retrieved: never "exception was never retrieved" at exit
            if not task.cancelled():
                task.exception()
