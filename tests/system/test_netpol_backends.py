"""NetworkPolicy with every encapsulating backend: traffic that arrives through a kernel VXLAN
device, the user-space UDP worker's TUN or the user-space IPIP worker's TUN is judged like
host-gw traffic (test_netpol.py runs the full truth table on host-gw).  Two nodes, two
namespaces, a pod of each on each node; a few scenarios, each probed over TCP and UDP and
compared with the independent model."""

from __future__ import annotations

import pytest
from netpol_lab import check, close_grid, converged, make_grid, np

from agentd.lab.wait import auntil

SCENARIOS = [
    [np("deny", "x", {"podSelector": {}})],
    [np("p", "x", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}, "podSelector": {"matchLabels": {"pod": "b"}}}],
                                                  "ports": [{"port": "serve-80-tcp"}, {"port": 81, "protocol": "UDP"}]}]})],
    [np("out", "y", {"podSelector": {"matchLabels": {"pod": "a"}}, "policyTypes": ["Egress"],
                     "egress": [{"to": [{"ipBlock": {"cidr": "10.244.0.0/16"}}], "ports": [{"protocol": "UDP"}]}]})],
]  # fmt: skip


@pytest.mark.parametrize("backend", ["vxlan", "udp", "ipip"])
async def test_policy_is_enforced_through_every_backend(lab_factory, backend):
    # Flow records hold the BPF pod redirect too (every pod's packets through conntrack): they
    # are off here, where the hold that isolation alone makes and lifts is what is checked.
    no_flows = {f"node{i}": {"flows": {"enabled": False}} for i in (1, 2)}
    lab = await lab_factory(nodes=2, pods=0, backend=backend, extra=no_flows)
    layout = [(0, "x", "a"), (1, "x", "b"), (0, "y", "a"), (1, "y", "b")]
    grid = await make_grid(lab, layout, {"x": {"ns": "x"}, "y": {"ns": "y"}})
    try:
        for i, policies in enumerate(SCENARIOS):
            await converged(lab, await grid.res.apply(policies))
            if i == 0 and backend != "vxlan":
                # Both nodes isolate a pod: their BPF programs hand no packet to a pod past
                # netfilter (the truth table below is what shows it is judged).
                assert [redirecting(n) for n in lab.nodes] == [False, False]
            await check(grid, policies)
            for p in policies:
                await grid.res.delete("NetworkPolicy", p["metadata"]["namespace"], p["metadata"]["name"])
        if backend != "vxlan":
            # No pod isolated any more: decapsulated packets go straight to the pods again.
            await auntil(lambda: all(redirecting(n) for n in lab.nodes), 10, what="the BPF pod redirect back on")
    finally:
        await close_grid(grid)


def redirecting(node) -> bool:
    return node.api("/status")["backends"]["bpf"]["redirecting"]
