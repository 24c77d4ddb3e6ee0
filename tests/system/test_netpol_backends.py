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
    # Flow records are on (the default): they hold the BPF pod redirect from the start, and
    # isolation holds it as well while it lasts.
    lab = await lab_factory(nodes=2, pods=0, backend=backend)
    layout = [(0, "x", "a"), (1, "x", "b"), (0, "y", "a"), (1, "y", "b")]
    grid = await make_grid(lab, layout, {"x": {"ns": "x"}, "y": {"ns": "y"}})
    try:
        for i, policies in enumerate(SCENARIOS):
            await converged(lab, await grid.res.apply(policies))
            if i == 0 and backend != "vxlan":
                # Both nodes isolate a pod: their BPF programs hand a decapsulated packet to a
                # pod past netfilter only once conntrack holds its connection as accepted (the
                # truth table below is what shows every connection is judged).
                assert [delivery(n) for n in lab.nodes] == [("gated", ["flows", "policy"])] * 2
            await check(grid, policies)
            for p in policies:
                await grid.res.delete("NetworkPolicy", p["metadata"]["namespace"], p["metadata"]["name"])
        if backend != "vxlan":
            # No pod isolated any more: only the flow records hold the redirect.
            await auntil(lambda: all(delivery(n) == ("gated", ["flows"]) for n in lab.nodes), 10,
                         what="isolation's hold of the BPF pod redirect lifted")
    finally:
        await close_grid(grid)


def delivery(node) -> tuple[str, list[str]]:
    bpf = node.api("/status")["backends"]["bpf"]
    return bpf["delivery"], bpf["held_by"]
