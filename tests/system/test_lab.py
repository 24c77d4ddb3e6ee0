"""The node agent on the lab (issue 3, item 8): 3 nodes x 2 pods, mesh and route reflectors.

Everything here is real: etcd, three `agentd run` processes in their own network
namespaces peering over BGP, kernel routes, pods attached through agentd-cni and the
reference bridge/host-local plugins.
"""

import asyncio
import re
import signal
import subprocess
import time

import pytest

MODES = ["mesh", "route-reflector"]


async def tcp_exchange(server_pod, client_pod, payload_size=1_000_000):
    """Send payload_size bytes from client to server and get a SHA-256 back; True if it matches."""
    port = 5201
    server = server_pod.ns.popen(
        [
            "python3",
            "-c",
            "import socket,hashlib\n"
            f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('{server_pod.ip}',{port}));s.listen(1)\n"
            "c,_=s.accept();h=hashlib.sha256()\n"
            "while True:\n  d=c.recv(65536)\n  if not d: break\n  h.update(d)\n"
            "c.sendall(h.hexdigest().encode());c.close()",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        code = (
            "import socket,hashlib,os,time\n"
            f"data=os.urandom({payload_size})\n"
            "for i in range(50):\n"
            "  try:\n"
            f"    c=socket.create_connection(('{server_pod.ip}',{port}),timeout=5);break\n"
            "  except OSError: time.sleep(0.1)\n"
            "c.sendall(data);c.shutdown(socket.SHUT_WR)\n"
            "got=c.recv(100).decode()\n"
            "print('OK' if got==hashlib.sha256(data).hexdigest() else 'BAD')"
        )
        rc, out, _ = await client_pod.ns.aexec("python3", "-c", code, check=False, timeout=30)
        return out.strip() == b"OK"
    finally:
        server.kill()
        server.wait()


def route_monitor(ns):
    """Start `ip monitor route` in ns; returns the process (stdout=PIPE)."""
    return subprocess.Popen(
        ["ip", "-n", ns.name, "monitor", "route"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )


def stop_monitor(proc):
    proc.terminate()
    out, _ = proc.communicate(timeout=5)
    return out


class Pinger:
    """ping -i 0.05 from one pod to another for a while, then count what was lost."""

    def __init__(self, src, dst_ip, interval=0.05):
        self.proc = src.ns.popen(
            ["ping", "-n", "-i", str(interval), "-W", "1", dst_ip], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        out, _ = self.proc.communicate(timeout=10)
        m = re.search(r"(\d+) packets transmitted, (\d+) received", out)
        assert m, out
        return int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize("mode", MODES)
async def test_every_pod_reaches_every_other_pod(lab_factory, mode):
    lab = await lab_factory(nodes=3, pods=2, bgp=mode)
    matrix = await lab.reachability()
    assert len(matrix) == 30 and all(matrix.values()), [k for k, v in matrix.items() if not v]
    # A TCP exchange between pods on different nodes, both directions of the mesh.
    p = {x.name: x for x in lab.pods}
    assert await tcp_exchange(p["node2-pod1"], p["node1-pod1"])
    assert await tcp_exchange(p["node1-pod2"], p["node3-pod2"])
    # The kernel routes carry agentd's protocol number and point at the right nodes.
    subnets = lab.subnets()
    for n in lab.nodes:
        lines = n.kernel_routes()
        assert any(line.startswith(f"blackhole {subnets[n.name]}") for line in lines), lines
        for other in lab.nodes:
            if other is not n:
                assert any(line.startswith(subnets[other.name]) and f"via {other.address}" in line for line in lines), lines
    status = lab.nodes[0].api("/status")
    assert status["ready"] and status["datastore"]["connected"]
    assert status["bgp"]["mode"] == mode


@pytest.mark.parametrize("mode", MODES)
async def test_leave_removes_the_node_everywhere_within_5s(lab_factory, mode):
    lab = await lab_factory(nodes=3, pods=1, bgp=mode)
    node1, node2, node3 = lab.nodes
    gone = lab.subnets()["node3"]
    t0 = time.monotonic()
    await node3.leave()

    def still_there():
        return [n.name for n in (node1, node2) if any(line.startswith(gone) for line in n.kernel_routes())]

    while still_there():
        assert time.monotonic() - t0 < 5.0, f"{gone} still routed on {still_there()} after 5 s"
        await asyncio.sleep(0.05)
    elapsed = time.monotonic() - t0
    # node3's agent exited, its own routes are gone, its node and subnet are released in etcd.
    deadline = time.monotonic() + 10
    while node3.agent_pid() is not None:
        assert time.monotonic() < deadline, "node3's agent did not exit after leaving"
        await asyncio.sleep(0.05)
    assert node3.kernel_routes() == []
    for n in (node1, node2):
        peers = {p["address"] for p in n.api("/peers")}
        assert node3.address not in peers
    print(f"leave: routes gone from nodes 1 and 2 after {elapsed:.2f}s")


@pytest.mark.parametrize("mode", MODES)
async def test_agent_killed_and_restarted_loses_nothing(lab_factory, mode):
    lab = await lab_factory(nodes=3, pods=1, bgp=mode)
    node1, node2, node3 = lab.nodes
    pods = {p.node.name: p for p in lab.pods}
    subnet2 = lab.subnets()["node2"]
    mon1, mon2 = route_monitor(node1.ns), route_monitor(node2.ns)
    pingers = [Pinger(pods["node1"], pods["node2"].ip), Pinger(pods["node2"], pods["node3"].ip)]
    await asyncio.sleep(1.0)
    await node2.kill_agent()  # SIGKILL: no goodbye to anyone
    await asyncio.sleep(2.0)
    node2.start_agent()
    await lab.wait_established(30)
    await asyncio.sleep(2.0)  # past End-of-RIB and the reconcile that follows
    results = [p.stop() for p in pingers]
    deleted1, deleted2 = stop_monitor(mon1), stop_monitor(mon2)
    assert lab.subnets()["node2"] == subnet2  # the same subnet back
    for sent, received in results:
        assert sent > 50 and received == sent, results
    # Kernel routes were never removed: not on the restarted node, not on its peers.
    assert "Deleted" not in deleted2, deleted2
    assert not [line for line in deleted1.splitlines() if line.startswith("Deleted") and subnet2 in line], deleted1
    # The other nodes kept node2's route through the restart with graceful restart.
    rib = node1.api("/rib")
    entry = [r for r in rib if r["prefix"] == subnet2 and r["best"]]
    assert entry and not entry[0]["stale"]
    print(f"restart: pings {results}")


@pytest.mark.parametrize("mode", MODES)
async def test_etcd_down_for_30s_changes_nothing_and_agents_recover(lab_factory, mode):
    lab = await lab_factory(nodes=3, pods=1, bgp=mode)
    before = {n.name: sorted(n.kernel_routes()) for n in lab.nodes}
    pods = lab.pods
    pingers = [Pinger(pods[0], pods[1].ip, interval=0.2), Pinger(pods[2], pods[0].ip, interval=0.2)]
    await lab.etcd.stop()
    t0 = time.monotonic()
    saw_down = set()
    while time.monotonic() - t0 < 30:
        for n in lab.nodes:
            st = n.api("/status")
            if not st["datastore"]["connected"]:
                saw_down.add(n.name)
            assert sorted(n.kernel_routes()) == before[n.name]
        await asyncio.sleep(1.0)
    assert saw_down == {n.name for n in lab.nodes}
    await lab.etcd.start()
    t1 = time.monotonic()
    while not all(n.api("/status")["datastore"]["connected"] for n in lab.nodes):
        assert time.monotonic() - t1 < 30, "agents did not reconnect to etcd"
        await asyncio.sleep(0.5)
    for p in pingers:
        sent, received = p.stop()
        assert received == sent, (sent, received)
    for n in lab.nodes:
        assert sorted(n.kernel_routes()) == before[n.name]
        assert n.agent_pid() is not None
    assert all((await lab.reachability()).values())


@pytest.mark.parametrize("mode", MODES)
async def test_route_deleted_by_hand_is_back_within_1s(lab_factory, mode):
    lab = await lab_factory(nodes=3, pods=0, bgp=mode)
    node1 = lab.nodes[0]
    subnet2 = lab.subnets()["node2"]
    node1.ns.ip("route", "del", subnet2, "proto", "143")
    t0 = time.monotonic()
    while not any(line.startswith(subnet2) for line in node1.kernel_routes()):
        assert time.monotonic() - t0 < 1.0, "route not restored within 1 s"
        await asyncio.sleep(0.01)
    print(f"route restored after {time.monotonic() - t0:.3f}s")


async def test_route_reflector_killed_keeps_every_pod_pair_connected(lab_factory):
    lab = await lab_factory(nodes=3, pods=1, bgp="route-reflector", reflectors=2)
    assert [n.reflector for n in lab.nodes] == [True, True, False]
    pods = lab.pods
    pingers = [Pinger(a, b.ip, interval=0.1) for a in pods for b in pods if a is not b]
    await asyncio.sleep(1.0)
    await lab.nodes[0].kill_agent()
    await asyncio.sleep(5.0)
    # The client still has both other nodes' routes, through the surviving reflector.
    client = lab.nodes[2]
    peers = {p["address"]: p["state"] for p in client.api("/peers")}
    assert peers[lab.nodes[1].address] == "Established"
    results = [p.stop() for p in pingers]
    for sent, received in results:
        assert sent > 30 and received == sent, results
    assert all((await lab.reachability()).values())
