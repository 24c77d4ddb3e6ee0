"""The supervision tree restarts crashed tasks and reports them in health (no real sleeps)."""

import asyncio

from agentd.daemon.supervisor import Supervisor


async def test_crashed_task_is_restarted_with_its_error_recorded():
    runs = []
    done = asyncio.Event()

    async def flaky():
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError(f"boom {len(runs)}")
        done.set()
        await asyncio.Event().wait()

    sup = Supervisor(backoff_initial=0.0, backoff_max=0.0)
    child = sup.start("flaky", flaky)
    await asyncio.wait_for(done.wait(), 5)
    assert child.restarts == 2 and child.last_error == "RuntimeError: boom 2"
    assert sup.health() == (True, [])
    await sup.stop()


async def turns_until(condition, turns: int = 1000) -> None:
    """Give the loop turns (no wall clock) until ``condition()`` holds."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"still not so after {turns} turns of the loop")


async def test_health_reports_a_task_that_is_down():
    crashed = asyncio.Event()

    async def broken():
        crashed.set()
        raise ValueError("no etcd")

    sup = Supervisor(backoff_initial=3600.0, backoff_max=3600.0)  # stays down until stopped
    sup.start("watch", broken)
    await asyncio.wait_for(crashed.wait(), 5)
    await turns_until(lambda: not sup.health()[0])
    ok, problems = sup.health()
    assert not ok and "watch" in problems[0] and "no etcd" in problems[0]
    assert sup.summary()[0]["running"] is False
    await sup.stop()


async def test_a_task_that_returns_is_not_restarted():
    calls = []

    async def once():
        calls.append(1)

    sup = Supervisor(backoff_initial=0.0)
    child = sup.start("once", once)
    await turns_until(lambda: child.done)
    assert calls == [1] and child.done and sup.health()[0]
    await sup.stop()


async def test_stop_cancels_again_a_task_that_lost_its_cancel():
    """A task whose cancel was lost on its way (as Python 3.11's wait_for loses one that lands
    when the awaited thing completes) and that goes on waiting is cancelled again, a child
    task of a TaskGroup (which cancels its tasks once) too: stop() returns, they have ended."""
    lost, started = [], []

    async def loses_one_cancel():
        started.append(1)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            lost.append(1)  # swallowed, as wait_for would: the task goes on
        await asyncio.Event().wait()

    async def group():
        async with asyncio.TaskGroup() as tg:
            tg.create_task(loses_one_cancel())

    sup = Supervisor(recancel_after=0.0)
    children = [sup.start("watch", loses_one_cancel), sup.start("group", group)]
    await turns_until(lambda: len(started) == 2)  # the group's task too
    stopping = asyncio.ensure_future(sup.stop())
    done, _ = await asyncio.wait({stopping}, timeout=5)  # not wait_for: it would wait for stop() to end
    assert done, "stop() waits for ever for a task that lost its cancel"
    assert lost == [1, 1] and all(c.task is not None and c.task.cancelled() for c in children)


async def test_a_task_ending_cancelled_when_nobody_cancelled_it_is_a_crash_and_restarted():
    """A library that raises CancelledError (grpc.aio on a channel closed under it): the
    runner re-raised it and ended -- the task dead for good, /healthz 200, "running"."""
    others: list[asyncio.Future] = []

    async def child():
        others.append(asyncio.get_running_loop().create_future())
        await others[-1]  # a future someone else cancels

    sup = Supervisor(backoff_initial=0.0, backoff_max=0.0)
    c = sup.start("c", child)
    await turns_until(lambda: len(others) == 1)
    others[0].cancel()
    await turns_until(lambda: len(others) == 2)  # started again
    assert c.restarts == 1 and c.last_error == "CancelledError"
    assert not sup._runners["c"].done()
    await sup.stop()
    assert sup._runners["c"].done()


async def test_a_cancelled_runner_still_ends():
    async def child():
        await asyncio.Event().wait()

    sup = Supervisor(backoff_initial=0.0, backoff_max=0.0)
    c = sup.start("c", child)
    await turns_until(lambda: c.task is not None)
    sup._runners["c"].cancel()
    await turns_until(lambda: sup._runners["c"].done())
    assert sup._runners["c"].cancelled() and c.restarts == 0
    await sup.stop()


# -- the restart delay: what keeps a crash-looping task from a tight loop, and one that crashed
# often from waiting for days (agentd.daemon.supervisor's docstring).  The sleeps are recorded,
# not slept; the clock is passed in.

class _Asyncio:
    """The supervisor's asyncio, whose sleep records the delay and, once ``until`` delays are
    recorded, waits until stopped (the runner restarts nothing more)."""

    def __init__(self, until: int) -> None:
        self.delays: list[float] = []
        self.until = until

    def __getattr__(self, name):
        return getattr(asyncio, name)

    async def sleep(self, delay: float) -> None:
        self.delays.append(delay)
        if len(self.delays) >= self.until:
            await asyncio.Event().wait()
        await asyncio.sleep(0)


async def _delays(monkeypatch, runs_for: list[float], jitter: float = 1.0) -> list[float]:
    """The delays before each restart of a task that runs ``runs_for[i]`` seconds (by the
    supervisor's clock) the i-th time, then crashes."""
    from agentd.daemon import supervisor

    fake = _Asyncio(until=len(runs_for))
    monkeypatch.setattr(supervisor, "asyncio", fake)
    monkeypatch.setattr(supervisor.random, "random", lambda: jitter)
    now = [1000.0]
    runs = []

    async def crashes():
        now[0] += runs_for[len(runs)]
        runs.append(1)
        raise RuntimeError("boom")

    sup = Supervisor(backoff_initial=1, backoff_max=8, stable_after=60, clock=lambda: now[0])
    sup.start("c", crashes)
    await turns_until(lambda: len(fake.delays) == len(runs_for))
    await sup.stop()
    return fake.delays


async def test_a_task_crashing_at_once_waits_twice_as_long_each_time_up_to_backoff_max(monkeypatch):
    assert await _delays(monkeypatch, [0, 0, 0, 0, 0]) == [1, 2, 4, 8, 8]


async def test_the_restart_delay_has_up_to_a_quarter_off_at_random(monkeypatch):
    assert await _delays(monkeypatch, [0, 0, 0, 0, 0], jitter=0.0) == [0.75, 1.5, 3, 6, 6]


async def test_the_restart_delay_starts_again_after_a_run_of_stable_after_seconds(monkeypatch):
    assert await _delays(monkeypatch, [0, 0, 0, 60, 0]) == [1, 2, 4, 1, 2]


async def test_a_run_just_short_of_stable_after_keeps_the_delay_growing(monkeypatch):
    assert await _delays(monkeypatch, [0, 0, 59, 0, 0]) == [1, 2, 4, 8, 8]
