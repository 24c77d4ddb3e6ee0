"""The policy agent's pod fast path after a set_pods that failed part-way (review s56 r10 #4):
set_pods applies what it can (other veths; a moved address taken off its old veth) before it
raises, so what the fast path has is not what it was last told.  The pods going back to that
(the failed pod deleted) must still reach set_pods: the older pod's address back in the map,
the error cleared -- not skipped as "unchanged", with a stale error for ever."""

from __future__ import annotations

import asyncio
import types

from agentd.policy.agent import PolicyAgent

from .test_podpath_pods import NEW, OLD, Kernel, _fast_path


def _endpoint(ips: list[str], interface: str, written: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(ips=ips, interface=interface, written=written, key=interface)


def _agent(fast_path, endpoints: dict) -> types.SimpleNamespace:
    """What _update_fast_path reads of a PolicyAgent, after a set_pods of P1's 10.0.0.7 on vethOLD."""
    return types.SimpleNamespace(fast_path=fast_path, _fast_pods={"10.0.0.7": "vethOLD"}, fast_path_error=None,
                                 publisher=types.SimpleNamespace(endpoints=endpoints), _cut_off=lambda ep: False)


def test_a_failed_pod_deleted_gives_the_older_pod_its_address_back_and_clears_the_error(tmp_path, monkeypatch):
    kernel = Kernel(monkeypatch, busy={NEW})
    fp = _fast_path(tmp_path, kernel, {"10.0.0.7": OLD})
    pods = {"p1": _endpoint(["10.0.0.7"], "vethOLD", 1)}
    agent = _agent(fp, pods)

    def sync() -> None:
        asyncio.run(PolicyAgent._update_fast_path(agent))  # type: ignore[arg-type]

    pods["p2"] = _endpoint(["10.0.0.7"], "vethNEW", 2)  # a new pod given the address; its veth's attach fails
    sync()
    assert kernel.veth_of("10.0.0.7") is None and "vethNEW" in agent.fast_path_error  # on no veth: the normal path
    del pods["p2"]  # its ADD failed: the runtime deletes it
    sync()
    assert kernel.veth_of("10.0.0.7") == OLD and fp.pods == {"10.0.0.7": OLD}
    assert agent.fast_path_error is None and agent._fast_pods == {"10.0.0.7": "vethOLD"}


def test_a_pod_added_on_a_failing_veth_then_deleted_leaves_no_error(tmp_path, monkeypatch):
    kernel = Kernel(monkeypatch, busy={NEW})
    fp = _fast_path(tmp_path, kernel, {"10.0.0.7": OLD})
    pods = {"p1": _endpoint(["10.0.0.7"], "vethOLD", 1)}
    agent = _agent(fp, pods)
    pods["c"] = _endpoint(["10.0.0.9"], "vethNEW", 2)
    asyncio.run(PolicyAgent._update_fast_path(agent))  # type: ignore[arg-type]
    assert agent.fast_path_error is not None and kernel.veth_of("10.0.0.7") == OLD
    del pods["c"]
    asyncio.run(PolicyAgent._update_fast_path(agent))  # type: ignore[arg-type]
    assert agent.fast_path_error is None and kernel.veth_of("10.0.0.7") == OLD
