"""IPv6 pods over the udp backend in the user-space worker, through the agent (the lab,
dual-stack): node2 and node3 run udp in their workers, node1 in BPF.  One lab checks both
the worker-to-worker pairs and a BPF node speaking the same wire format to worker nodes
(through a worker of its own, as for IPv4): the reachability matrix over both families, what
/peers and /routes say, IPv6 TCP intact in every direction, and the workers' counters."""

from __future__ import annotations

import asyncio

from dualstack_hosts import transfer6

from agentd.lab.wait import auntil

USERSPACE = {"network": {"datapath": "userspace"}}


async def test_udp_in_user_space_carries_ipv6_pods_and_speaks_with_bpf_nodes(lab_factory):
    lab = await lab_factory(nodes=3, pods=1, ip_family="dual", backend="udp", extra={"node2": USERSPACE,
                                                                                      "node3": USERSPACE})
    node1, node2, node3 = lab.nodes
    pods = {p.node.name: p for p in lab.pods}
    matrix = await lab.ready.matrix()
    assert {v for (_a, _b, v) in matrix} == {4, 6} and len(matrix) == 12
    assert all(matrix.values()), [k for k, ok in matrix.items() if not ok]

    # Both families by udp between every pair; the worker nodes in user space, node1 in BPF
    # but speaking to them through its own worker.
    assert node1.api("/status")["backends"]["active"]["udp"]["datapath"] == "bpf"
    subnets = lab.all_subnets()
    for node in lab.nodes:
        peers = node.api("/peers")
        assert {(p["backend"], p["backend_v6"], p["datapath"]) for p in peers} == {("udp", "udp", "user space")}, peers
        routes = {r["dst"]: r for r in node.api("/routes")}
        for other in lab.nodes:
            if other is not node:
                r = routes[subnets[other.name][1]]
                assert (r["dev"], r["installed"]) == ("agentd.udp", True), r

    # IPv6 TCP, worker to worker and both ways between a worker node and the BPF node.
    for src, dst in (("node2", "node3"), ("node3", "node1"), ("node1", "node2")):
        sent, got = await asyncio.to_thread(transfer6, pods[src].ns, pods[dst].ns, pods[dst].address(6), 8 << 20)
        assert sent == got and int(got[0]) == 8 << 20, (src, dst, sent, got)

    def worker(node) -> dict:
        st = node.api("/status")["backends"]
        return st["userspace_peers_worker"].get("udp") or st["active"]["udp"]

    # Every worker carried its transfers (statistics are refreshed every 2 s), dropping nothing
    # as malformed or of the wrong family.
    for node, at_least in ((node1, 16 << 20), (node2, 16 << 20), (node3, 16 << 20)):
        w = await auntil(lambda node=node, at_least=at_least: (
            lambda w: w if w["counters"].get("rx_bytes", 0) + w["counters"].get("tx_bytes", 0) > at_least else None
        )(worker(node)), in_thread=True, interval=0.2, what=lambda node=node: f"{node.name}'s worker's counters")
        assert w["drops"]["malformed"] == w["drops"]["not_ipv4"] == 0, (node.name, w["drops"])
