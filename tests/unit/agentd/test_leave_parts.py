"""Each part's leave says what it could not remove (raises), so that ``agentd leave`` can report
the step failed: they logged or suppressed it, and the leave said nothing was wrong."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from agentd.dataplane.backends import Tunnels
from agentd.kernel.routing import RouteProgrammer
from agentd.nft.libnftables import NftError
from agentd.policy import agent as policy_agent
from agentd.policy.agent import PolicyAgent
from agentd.services import agent as services_agent
from agentd.services.agent import ServiceAgent


class Refusing:
    """An NftProgrammer whose table removal libnftables refuses."""

    async def remove(self):
        raise NftError("Could not process rule: Operation not permitted")


class FastPath:
    def remove(self):
        raise OSError(1, "Operation not permitted")


def test_the_policy_leave_raises_what_stays_after_trying_both_parts():
    policy = object.__new__(PolicyAgent)
    policy.programmer, policy.nft, policy.fast_path = Refusing(), None, FastPath()
    with pytest.raises(RuntimeError) as err:
        asyncio.run(policy.leave())
    assert str(err.value) == ("the policy tables stay: Could not process rule: Operation not permitted; "
                              "the pod fast path stays: [Errno 1] Operation not permitted")
    assert policy.fast_path is None


def test_the_services_leave_raises_when_the_table_stays():
    services = object.__new__(ServiceAgent)
    services.programmer, services.nft, services.dns_config = Refusing(), None, None
    with pytest.raises(RuntimeError, match="the services table stays: Could not process rule"):
        asyncio.run(services.leave())


def test_the_standalone_table_removals_raise(monkeypatch):
    class Nft:
        def close(self):
            pass

    monkeypatch.setattr(policy_agent, "Nft", Nft)
    monkeypatch.setattr(policy_agent, "NftProgrammer", lambda *a: Refusing())
    with pytest.raises(NftError, match="Operation not permitted"):
        asyncio.run(policy_agent.remove_policy_tables())
    monkeypatch.setattr(services_agent, "Nft", Nft)
    monkeypatch.setattr(services_agent, "NftProgrammer", lambda *a: Refusing())

    def dns_address_stays(*_a):
        raise OSError(1, "Operation not permitted")
    monkeypatch.setattr(services_agent.dns, "remove_address", dns_address_stays)
    with pytest.raises(RuntimeError) as err:
        asyncio.run(services_agent.remove_services_table("fd00::a"))
    assert str(err.value) == ("the DNS address stays: Operation not permitted; "
                              "the services table stays: Could not process rule: Operation not permitted")


def test_the_route_programmer_raises_how_many_routes_stay():
    closed = []
    programmer = object.__new__(RouteProgrammer)
    programmer._tasks, programmer._lock = [], None
    programmer.netlink = SimpleNamespace(is_open=True, close=lambda: closed.append(True))
    programmer.state = SimpleNamespace(kernel={"a": SimpleNamespace(text="10.244.2.0/24")},
                                       strays=[SimpleNamespace(text="10.244.3.0/24")])

    async def dump_own():
        pass

    async def execute(op, victims, outcome):
        return [(v, 1, None) for v in victims]  # EPERM, every one

    programmer._dump_own, programmer._execute = dump_own, execute

    async def main():
        programmer._lock = asyncio.Lock()
        await programmer.stop(remove_routes=True)

    with pytest.raises(RuntimeError, match=r"^2 routes stay \(10.244.2.0/24: EPERM: Operation not permitted, \.\.\.\)$"):
        asyncio.run(main())
    assert closed == [True]


class Backend:
    def __init__(self, fail: bool) -> None:
        self.fail, self.downs = fail, []

    async def down(self, remove):
        self.downs.append(remove)
        if self.fail:
            raise OSError(16, "Device or resource busy")


def _tunnels(backend: Backend, bpf: Backend) -> Tunnels:
    tunnels = object.__new__(Tunnels)
    tunnels._task, tunnels.active, tunnels.helpers, tunnels.bpf = None, {"vxlan": backend}, {}, bpf
    tunnels._retiring, tunnels._held_ports = set(), {}
    return tunnels


def test_the_tunnels_removal_raises_what_stays_after_trying_them_all():
    vxlan, bpf = Backend(fail=True), Backend(fail=False)
    with pytest.raises(RuntimeError, match=r"^vxlan: \[Errno 16\] Device or resource busy$"):
        asyncio.run(_tunnels(vxlan, bpf).stop(remove=True))
    assert bpf.downs == [True]  # tried after the one that failed


def test_a_stop_that_keeps_the_tunnels_stays_quiet():
    vxlan, bpf = Backend(fail=True), Backend(fail=True)
    asyncio.run(_tunnels(vxlan, bpf).stop(remove=False))
    assert vxlan.downs == [False] and bpf.downs == [False]
