"""Waiting on a condition with a deadline: how the tests, the lab and the benches synchronise.

A fixed sleep is a guess about how fast something happens; on a shared, loaded 2-core
machine the guess is sometimes wrong and the test flakes (too short) or crawls (too long).
So every wait here names its condition and its deadline::

    until(lambda: bird.protocol_state("spk") == "Established", 20, what="BIRD Established")
    routes = await auntil(lambda: node.kernel_routes() or None, 30, what="routes", in_thread=True)

The deadline only bounds a failure: a condition that holds is seen within one ``interval``,
however long the deadline.  Deadlines are therefore generous; how fast something converges
is measured by the benches (bench/), never asserted by a test.

Two helpers are for the cases where time passing *is* the point:

* :func:`holds` / :func:`aholds`: a condition must stay true for a whole interval ("no route
  flaps for 2 s", "the session never comes up"); it is checked throughout.
* :func:`pause` / :func:`apause`: let an interval pass on purpose, where nothing can be
  checked meanwhile (an outage that must last past a timer).  Never to wait for something.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT = 30.0
INTERVAL = 0.05

What = str | Callable[[], str]


def _text(what: What) -> str:
    return what() if callable(what) else what


def _check_timeout(timeout: float) -> None:
    """A deadline must be a finite number of seconds, 0 or more: ``nan`` compares false with
    everything, so a wait with it would never end (and ``inf`` would not either)."""
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout >= 0):
        raise ValueError(f"timeout must be a finite number of seconds, 0 or more, not {timeout!r}")


def _timed_out(error: type[Exception], timeout: float, what: What, last: BaseException | None) -> Exception:
    text = f"timed out after {timeout:.0f}s waiting for {_text(what)}"
    if last is not None:
        text += f" (last attempt: {type(last).__name__}: {last})"
    return error(text)


def until(
    predicate: Callable[[], Any],
    timeout: float = DEFAULT_TIMEOUT,
    *,
    what: What = "condition",
    interval: float = INTERVAL,
    ignore: tuple[type[BaseException], ...] = (),
    abort: Callable[[], str | None] | None = None,
    error: type[Exception] = AssertionError,
) -> Any:
    """Call ``predicate()`` until it returns something truthy, and return that.

    ``ignore``: exception types the predicate may raise meanwhile (e.g. OSError while a
    daemon's API is not up); they count as "not yet".  ``abort``: called before each try;
    a message from it ends the wait at once (e.g. "the daemon exited").  On timeout (the
    predicate is always tried once more after the deadline), ``error`` is raised with
    ``what`` (a string, or a function giving one, evaluated only then).
    """
    _check_timeout(timeout)
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        if abort is not None and (reason := abort()):
            raise error(f"{reason} (while waiting for {_text(what)})")
        try:
            result = predicate()
        except ignore as exc:
            result, last = None, exc
        if result:
            return result
        if time.monotonic() > deadline:
            raise _timed_out(error, timeout, what, last)
        time.sleep(interval)


async def auntil(
    predicate: Callable[[], Any],
    timeout: float = DEFAULT_TIMEOUT,
    *,
    what: What = "condition",
    interval: float = INTERVAL,
    ignore: tuple[type[BaseException], ...] = (),
    abort: Callable[[], str | None] | None = None,
    error: type[Exception] = AssertionError,
    in_thread: bool = False,
) -> Any:
    """:func:`until` for a running event loop.  ``predicate`` may return an awaitable (an
    ``async def`` function); ``in_thread`` runs a blocking one in a worker thread so the
    loop (and whatever it serves, e.g. an agent's API in the same process) keeps running."""
    _check_timeout(timeout)
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        if abort is not None and (reason := abort()):
            raise error(f"{reason} (while waiting for {_text(what)})")
        try:
            result = await asyncio.to_thread(predicate) if in_thread else predicate()
            if inspect.isawaitable(result):
                result = await result
        except ignore as exc:
            result, last = None, exc
        if result:
            return result
        if time.monotonic() > deadline:
            raise _timed_out(error, timeout, what, last)
        await asyncio.sleep(interval)


def holds(
    predicate: Callable[[], Any],
    seconds: float,
    *,
    what: What,
    interval: float = 0.1,
    error: type[Exception] = AssertionError,
) -> None:
    """Assert that ``predicate()`` stays truthy for ``seconds`` (checked every ``interval``,
    and at the end): for tests whose point is that something does *not* happen."""
    start = time.monotonic()
    end = start + seconds
    while True:
        if not predicate():
            raise error(f"{_text(what)} stopped holding {time.monotonic() - start:.1f}s into {seconds:.1f}s")
        now = time.monotonic()
        if now >= end:
            return
        time.sleep(min(interval, end - now))


async def aholds(
    predicate: Callable[[], Any],
    seconds: float,
    *,
    what: What,
    interval: float = 0.1,
    error: type[Exception] = AssertionError,
    in_thread: bool = False,
) -> None:
    """:func:`holds` for a running event loop (``predicate`` may be async; ``in_thread`` as
    in :func:`auntil`)."""
    start = time.monotonic()
    end = start + seconds
    while True:
        result = await asyncio.to_thread(predicate) if in_thread else predicate()
        if inspect.isawaitable(result):
            result = await result
        if not result:
            raise error(f"{_text(what)} stopped holding {time.monotonic() - start:.1f}s into {seconds:.1f}s")
        now = time.monotonic()
        if now >= end:
            return
        await asyncio.sleep(min(interval, end - now))


def pause(seconds: float, why: str) -> None:
    """Let ``seconds`` pass on purpose (``why`` says what must elapse: an outage that lasts,
    a timer that must run out).  Not a way to wait for something: use :func:`until`."""
    if not why:
        raise ValueError("pause() needs a reason")
    time.sleep(seconds)


async def apause(seconds: float, why: str) -> None:
    """:func:`pause` for a running event loop."""
    if not why:
        raise ValueError("apause() needs a reason")
    await asyncio.sleep(seconds)
