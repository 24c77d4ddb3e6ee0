"""A user-space worker runs while a peer needs it (the lab): node1 (host-gw, user-space data
path) reaches node2 (udp) through a udp worker of its own.  Once node2 has left, nothing
needs that worker: its process and its TUN device go from node1's namespace (they ran on
for nothing before).  node2 back, node1 starts one again and carries node1's pod's traffic
to node2 with it."""

from __future__ import annotations

from ipaddress import ip_network

from agentd.lab.wait import auntil


def _worker(node) -> dict | None:
    return node.api("/status")["backends"]["active"].get("udp")


def _tun(node) -> bool:
    return "agentd.udp" in node.ns.ip("-o", "link").stdout.decode()


async def test_a_user_space_worker_goes_when_its_last_peer_leaves_and_comes_back_with_one(lab_factory):
    lab = await lab_factory(nodes=2, pods=1, backend="host-gw", extra={
        "node1": {"network": {"datapath": "userspace"}},
        "node2": {"network": {"backend": "udp"}},
    })
    node1, node2 = lab.nodes
    assert [(p["backend"], p["datapath"]) for p in node1.api("/peers")] == [("udp", "user space")]
    # (refreshed every 2 s: the worker's pid shows after the first refresh)
    w = await auntil(lambda: (_worker(node1) or {}).get("worker_pid") and _worker(node1), in_thread=True,
                     timeout=10, what="node1's udp worker to report its pid")
    pid = w["worker_pid"]
    assert w["datapath"] == "userspace" and w["running"] and pid in node1.ns.pids() and _tun(node1)

    await node2.leave()
    await auntil(lambda: node2.agent_pid() is None, in_thread=True, timeout=30, what="node2's agent to exit")
    await auntil(lambda: _worker(node1) is None, in_thread=True, timeout=30,
                 what="node1 to stop the udp worker no peer needs")
    await auntil(lambda: pid not in node1.ns.pids(), in_thread=True, timeout=10,
                 what=f"node1's udp worker (pid {pid}) to exit")
    assert not _tun(node1), "the worker's TUN device stayed in node1's namespace"
    assert "no peer needs the user-space worker any more: stopped, agentd.udp removed" in node1.log_path.read_text()
    assert node1.agent_pid() is not None and node1.api("/status")["ready"]

    node2.start_agent()
    await lab.ready.established(60)
    w = await auntil(lambda: (_worker(node1) or {}).get("worker_pid") and _worker(node1), in_thread=True,
                     timeout=30, what="node1 to start a udp worker again")
    assert w["worker_pid"] != pid and w["worker_pid"] in node1.ns.pids() and _tun(node1)
    # node2 left, so it came back with another subnet (its pod keeps the old one): an address
    # of the new subnet on node2 answers node1's pod through the new worker.
    subnet = node2.api("/status")["node"]["subnet"]
    await lab.ready.routes(60)
    address = str(ip_network(subnet)[1])
    node2.ns.ip("addr", "add", f"{address}/32", "dev", "lo")
    pod1 = next(p for p in lab.pods if p.node is node1)
    assert await auntil(lambda: lab.ping(pod1, address), timeout=30, what=f"node1's pod to reach {address}")
    assert _worker(node1)["worker_pid"] == w["worker_pid"]
