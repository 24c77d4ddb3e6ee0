"""route_services waits for a build begun after its change: a sync under way when it came was
built without it (the Services agent would translate while local pods are still bridged)."""

import asyncio
from types import SimpleNamespace

from agentd.policy.agent import PolicyAgent


class _GatedProgrammer:
    """A programmer whose sync waits until the test lets it finish; notes whether each build
    routed every pod for Services."""

    def __init__(self, agent: PolicyAgent) -> None:
        self.agent = agent
        self.current = None
        self.programmed: list[bool] = []
        self.started = asyncio.Event()
        self.go = asyncio.Event()

    async def sync(self, desired, keys):
        routed = self.agent.engine.route_services
        self.started.set()
        await self.go.wait()
        self.go.clear()
        self.current = desired
        self.programmed.append(routed)
        return SimpleNamespace(commands=1, seconds=0.0, full=False)


def test_route_services_waits_past_a_sync_built_before_it(tmp_path):
    async def main():
        agent = PolicyAgent("n1", SimpleNamespace(prefix="/x"), str(tmp_path))
        built = []
        build = agent.engine.build
        agent.engine.build = lambda: (built.append(agent.engine.route_services), build())[1]
        agent.programmer = prog = _GatedProgrammer(agent)
        agent._have_snapshot = agent.publisher.have_local = True
        loop = asyncio.create_task(agent._sync_loop())
        try:
            agent._wake.set()
            await prog.started.wait()  # a sync under way, built without routing for Services
            assert built == [False]
            waiter = asyncio.create_task(agent.route_services(True))
            await asyncio.sleep(0)
            prog.started.clear()
            prog.go.set()  # the sync built before the change is programmed
            await prog.started.wait()  # ... and the next one, built with it, is under way
            assert prog.programmed == [False] and built == [False, True]
            assert not waiter.done(), "route_services returned after a sync built without it"
            prog.go.set()
            await asyncio.wait_for(waiter, 5)
            assert prog.programmed == [False, True]
        finally:
            loop.cancel()

    asyncio.run(main())


def test_route_services_before_the_first_build_returns_at_once(tmp_path):
    async def main():
        agent = PolicyAgent("n1", SimpleNamespace(prefix="/x"), str(tmp_path))
        await asyncio.wait_for(agent.route_services(True), 1)  # the first build takes it in
        assert agent.engine.route_services

    asyncio.run(main())
