"""route_services waits for a build begun after its change: a sync under way when it came was
built without it (the Services agent would translate while local pods are still bridged)."""

import asyncio
import contextlib
from ipaddress import IPv4Address
from types import SimpleNamespace

from agentd.policy.agent import PolicyAgent
from agentd.policy.engine import PolicyEngine
from agentd.policy.model import LocalPort, Pod, Policy


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


def test_a_failed_sync_is_retried_though_nothing_changed_since(tmp_path, monkeypatch):
    """The engine counts a change as built once it built it: after a sync that failed (nft
    refused, a netlink error) the loop took "nothing changed" and marked the revision applied,
    and the kernel kept the old tables until some other change."""
    from agentd.nft.libnftables import NftError

    real_sleep = asyncio.sleep
    monkeypatch.setattr(asyncio, "sleep", lambda delay, *a, **k: real_sleep(0, *a, **k))  # the retry's backoff

    class Programmer:
        current = None
        calls = 0

        async def sync(self, desired, keys):
            self.calls += 1
            if self.calls == 2:
                raise NftError("refused")
            self.current = desired
            return SimpleNamespace(commands=1, seconds=0.0, full=True)

    async def main():
        agent = PolicyAgent("n1", SimpleNamespace(prefix="/x"), str(tmp_path))
        agent.programmer = prog = Programmer()
        agent._have_snapshot = agent.publisher.have_local = True
        loop = asyncio.create_task(agent._sync_loop())
        try:

            async def until(done):  # the loop hands file work to threads: polled, bounded
                async with asyncio.timeout(5):
                    while not done():
                        await real_sleep(0.001)

            agent._wake.set()
            await until(lambda: agent.syncs >= 1)
            agent.engine.set_route_services(True)  # a change: its sync fails once
            agent._wake.set()
            with contextlib.suppress(TimeoutError):
                await until(lambda: agent.syncs >= 2)
            return prog.calls, agent.syncs, agent.error
        finally:
            loop.cancel()

    calls, syncs, error = asyncio.run(main())
    assert (calls, syncs, error) == (3, 2, None), "the failed sync was not retried"


def test_services_route_every_pod_up_only_where_conntrack_would_not_see_it_bridged():
    """While Services translate, every local pod's unicast is handed up to the IP stack so that
    an endpoint's reply to a client of its own node is un-DNATed -- but not where br_netfilter
    hands bridged frames of every pod family to the IP hooks (kube-proxy's way on a bridge):
    conntrack un-DNATs them on the bridge, and only isolated pods are routed up, for policy.
    A change of the sysctl (read every 10 s) rebuilds, as it does for flow records."""
    engine = PolicyEngine("node2")
    engine.upsert_pod(Pod("shop", "web", "node2", (IPv4Address("10.244.2.3"),), {"app": "web"}),
                      LocalPort("veth1", "02:00:00:00:00:01", "cni0"))
    engine.upsert_pod(Pod("lobby", "a", "node2", (IPv4Address("10.244.2.4"),), {}),
                      LocalPort("veth2", "02:00:00:00:00:02", "cni0"))
    engine.upsert_policy(Policy.parse({"metadata": {"namespace": "shop", "name": "deny"}, "spec": {"podSelector": {}}}))

    def handed_up() -> tuple[set[str], set[str]]:
        objects = engine.build().objects
        return (set(objects[("bridge", "agentd-policy", "set", "isolated-ports")].elements),
                set(objects[("bridge", "agentd-policy", "set", "isolated-addrs")].elements))

    everyone = ({"veth1", "veth2"}, {"10.244.2.3", "10.244.2.4"})
    isolated = ({"veth1"}, {"10.244.2.3"})  # shop/web: routed up for policy all the same
    assert handed_up() == isolated
    assert engine.set_route_services(True) and engine.dirty
    assert handed_up() == everyone
    assert engine.set_bridged_to_ip(True) and engine.dirty  # br_netfilter turned on at run time
    assert handed_up() == isolated
    assert not engine.set_bridged_to_ip(True)
    assert engine.set_bridged_to_ip(False) and engine.dirty  # ... and off again
    assert handed_up() == everyone
    assert engine.set_bridged_to_ip(True)
    assert handed_up() == isolated
    assert engine.set_route_services(False)  # Services stop translating: as without them
    assert handed_up() == isolated
    assert engine.set_route_services(True)  # ... and start again, br_netfilter still on
    assert handed_up() == isolated
    assert engine.set_bridged_to_ip(False)
    assert handed_up() == everyone


def test_a_drop_is_explained_by_the_policies_of_the_build_last_programmed(tmp_path, monkeypatch):
    """A policy drop's record names the policies the kernel's logging rules were built from:
    after a policy is deleted (or an allow-all one added) and before that is programmed -- the
    sync retried for seconds after a refusal -- a drop is still the old rules', not "no policy,
    default deny" (nor the new allowing policy named as the denier)."""
    from agentd.nft.expr import DropLog
    from agentd.nft.libnftables import NftError

    real_sleep = asyncio.sleep
    monkeypatch.setattr(asyncio, "sleep", lambda delay, *a, **k: real_sleep(0, *a, **k))

    class Programmer:
        current = None
        refuse = False

        async def sync(self, desired, keys):
            if self.refuse:
                raise NftError("refused")
            self.current = desired
            return SimpleNamespace(commands=1, seconds=0.0, full=False)

    some = {"metadata": {"namespace": "shop", "name": "allow-some"},
            "spec": {"podSelector": {}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"a": "b"}}}]}]}}

    async def main():
        agent = PolicyAgent("n1", SimpleNamespace(prefix="/x"), str(tmp_path))
        agent.engine.drop_log = DropLog(143)
        agent.engine.upsert_pod(Pod("shop", "web", "n1", (IPv4Address("10.244.1.3"),), {"app": "web"}),
                                LocalPort("veth1", "02:00:00:00:00:01", "cni0"))
        agent.engine.upsert_policy(Policy.parse(some))
        agent.programmer = prog = Programmer()
        agent._have_snapshot = agent.publisher.have_local = True
        loop = asyncio.create_task(agent._sync_loop())

        async def until(done):
            async with asyncio.timeout(5):
                while not done():
                    await real_sleep(0.001)

        try:
            agent._wake.set()
            await until(lambda: agent.syncs >= 1)
            programmed = ("ingress", ("shop", "web"), ["shop/allow-some"], False)
            assert agent.explain_drop("pod-in/shop/web") == programmed
            prog.refuse = True  # the kernel refuses the next syncs: it keeps the old rules
            agent.engine.remove_policy(("shop", "allow-some"))
            agent._wake.set()
            await until(lambda: agent.sync_errors >= 1)
            assert agent.explain_drop("pod-in/shop/web") == programmed
            agent.engine.upsert_policy(Policy.parse({"metadata": {"namespace": "shop", "name": "allow-all"},
                                                     "spec": {"podSelector": {}, "ingress": [{}]}}))
            assert agent.explain_drop("pod-in/shop/web") == programmed
            prog.refuse = False
            agent._wake.set()
            await until(lambda: agent.syncs >= 2)
            assert agent.explain_drop("pod-in/shop/web") == ("ingress", ("shop", "web"), ["shop/allow-all"], False)
            agent.engine.remove_policy(("shop", "allow-all"))
            agent._wake.set()
            await until(lambda: agent.syncs >= 3)
            assert agent.explain_drop("pod-in/shop/web") is None  # no chain logs it any more
        finally:
            loop.cancel()

    asyncio.run(main())
    # Never "default deny" with no policy at all.
    engine = PolicyEngine("n1")
    engine.upsert_pod(Pod("shop", "web", "n1", (IPv4Address("10.244.1.3"),), {}), LocalPort("veth1", "02:00:00:00:00:01", "cni0"))
    assert engine.denying(("shop", "web"), "in") == ([], False)
