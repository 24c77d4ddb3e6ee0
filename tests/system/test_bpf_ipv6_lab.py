"""IPv6 pods over the udp backend in BPF, through the agent (the lab, dual-stack, the nodes on
two L2 segments joined by the lab's router, so that every pair is encapsulated and routed):
the reachability matrix over both families, what /peers, /routes and /status say, the
kernel's IPv6 routes via the peers' IPv4-mapped addresses and their neighbour entries, IPv6
TCP in super-packets that reach the pod whole and carried by the sending node's pod fast
path once a policy has conntrack track it (and counted in /metrics under family ipv6), an
agent restart that loses no IPv6 echo and changes no IPv6 route, and a leave that takes its
routes and entries along.  node1 attaches
by clsact, the others by tcx (where the kernel has it): one lab, both hooks."""

from __future__ import annotations

import asyncio

from dualstack_hosts import capture, restart_under_ping, transfer6
from netpol_lab import converged, np

from agentd.dataplane.bpf import tc
from agentd.lab.wait import auntil


def mapped_neighbours(node) -> set[str]:
    """The IPv4-mapped permanent neighbour entries on the node's underlay device."""
    out = node.ns.ip("-6", "neigh", "show", "dev", "eth0", "nud", "permanent").stdout.decode()
    return {line.split()[0].removeprefix("::ffff:") for line in out.splitlines() if line.startswith("::ffff:")}


def fast_path_metrics(node) -> dict[tuple[str, str], float]:
    """agentd_pod_fast_path_packets_total from the node's /metrics: (family, verdict) -> value."""
    _status, text = node.ns.http_get("http://127.0.0.1:9099/metrics")
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("agentd_pod_fast_path_packets_total{"):
            labels, value = line[len("agentd_pod_fast_path_packets_total{"):].split("} ")
            pairs = dict(kv.split("=", 1) for kv in labels.split(","))
            out[(pairs["family"].strip('"'), pairs["verdict"].strip('"'))] = float(value)
    return out


async def test_udp_in_bpf_carries_ipv6_pods_across_segments(lab_factory):
    # Flow records off: they route every pod packet through netfilter, which keeps decapsulated
    # packets off the direct way into the pods' bridge ports (bpf_pod_redirect) measured here.
    extra = {f"node{i}": {"flows": {"enabled": False}} for i in (1, 2, 3)}
    extra["node1"]["network"] = {"bpf_attach": "clsact"}
    lab = await lab_factory(nodes=3, pods=1, ip_family="dual", backend="udp", datapath="bpf", subnets=2, extra=extra)
    node1, node2, node3 = lab.nodes
    pods = {p.node.name: p for p in lab.pods}
    matrix = await lab.ready.matrix()
    assert {v for (_a, _b, v) in matrix} == {4, 6} and len(matrix) == 12
    assert all(matrix.values()), [k for k, ok in matrix.items() if not ok]

    # Both families of every peer by udp in BPF; IPv6 routes via the peers' IPv4-mapped
    # addresses, onlink, with the pod MTU; one permanent neighbour entry per peer.
    subnets = lab.all_subnets()
    for node in lab.nodes:
        others = [n for n in lab.nodes if n is not node]
        peers = node.api("/peers")
        assert {(p["backend"], p["backend_v6"], p["datapath"]) for p in peers} == {("udp", "udp", "bpf")}, peers
        routes = {r["dst"]: r for r in node.api("/routes")}
        for other in others:
            r = routes[subnets[other.name][1]]
            assert (r["via"], r["dev"], r["installed"]) == (f"::ffff:{other.address}", "eth0", True), r
        assert mapped_neighbours(node) == {n.address for n in others}
        bpf = node.api("/status")["backends"]["bpf"]
        assert (bpf["routes"], bpf["routes_v6"], bpf["families"]) == (2, 2, {"udp": [4, 6]}), bpf
        assert bpf["hook"] == ("clsact" if node is node1 or not tc.tcx_available() else "tcx")
        assert node.api("/status")["policy"]["fast_path"]["ipv6"]["pods"] == 1
    line = next(x for x in node1.kernel_routes() if x.startswith(subnets["node2"][1]))
    assert f"via ::ffff:{node2.address} dev eth0" in line and "onlink" in line and "mtu 1472" in line, line

    # IPv6 TCP across the router: intact, and the super-packets reach the pod whole (decapsulated
    # and handed to the pod's bridge port).
    src, dst = pods["node1"], pods["node2"]
    result = {}
    await auntil(lambda: (lambda b: b["redirecting"] and b["bridge_ports"] >= 1)(node2.api("/status")["backends"]["bpf"]),
                 in_thread=True, what="node2 hands decapsulated packets to its pod's bridge port (its policy agent "
                                      "synced, the pod's MAC learned)")

    def flow():
        result["sent"], result["got"] = transfer6(src.ns, dst.ns, dst.address(6), 16 << 20)

    frames = await asyncio.to_thread(capture, dst.ns, "eth0", "ip6 and tcp and dst port 5001", flow, snap=96)
    assert result["sent"] == result["got"], result
    assert max(length for length, _eth, _ip in frames) > 8 * 1500
    # With a policy in force conntrack tracks the pods' connections (and the redirect into the
    # pods' bridge ports is held): node1's pod fast path then carries the IPv6 connection.
    res = await lab.resources()
    await converged(lab, await res.apply([np("allow-all", "default", {"podSelector": {}, "ingress": [{}]})]))
    await asyncio.to_thread(flow)
    assert result["sent"] == result["got"], result
    await auntil(lambda: node1.api("/status")["policy"]["fast_path"]["ipv6"]["packets"].get("carried", 0) > 100,
                 what="node1's pod fast path carried the IPv6 connection", in_thread=True)
    # /metrics counts it too, under its family (IPv4's series beside it, as many as IPv6's).
    metrics = fast_path_metrics(node1)
    assert metrics[("ipv6", "carried")] > 100, metrics
    assert {v for (_f, v) in metrics if _f == "ipv4"} == {v for (_f, v) in metrics if _f == "ipv6"}, metrics
    await res.delete("networkpolicies", "default", "allow-all")

    # A killed and restarted agent adopts its maps and routes: no IPv6 echo lost, no IPv6 route
    # replaced.
    results, events = await restart_under_ping(
        lab, node2, [(pods["node1"], pods["node2"].address(6)), (pods["node2"], pods["node3"].address(6))])
    assert all(not missing for _sent, missing in results), results
    assert [x for x in events if "fd00:10:244:" in x or "::ffff:" in x] == []
    assert "agentd_routes6" in node2.api("/status")["backends"]["bpf"]["adopted_maps"]

    # A node that leaves takes its BPF state along, and the others drop its IPv6 route and entry.
    await node3.leave()
    assert mapped_neighbours(node3) == set()
    await auntil(lambda: node3.address not in mapped_neighbours(node1)
                 and not any(x.startswith(subnets["node3"][1]) for x in node1.kernel_routes()),
                 what="node3's IPv6 route and neighbour entry gone from node1", in_thread=True)
    assert mapped_neighbours(node1) == {node2.address}
