"""Encapsulation backends on the lab (issue 4, item 6).

Three nodes, real agents, real kernel devices and user-space workers; captures on the
underlay show what actually crosses the wire.
"""

import asyncio
import json
import re
import socket
import struct
import subprocess
import threading

import pytest

from agentd.backends import control_path
from agentd.dataplane import DataplaneClient
from agentd.lab.lab import ETCD_ADDRESS
from agentd.lab.netns import Netns, veth
from agentd.lab.traffic import Pinger
from agentd.lab.wait import DEFAULT_TIMEOUT, apause, auntil

BACKENDS = ["host-gw", "ipip", "vxlan", "udp"]
MODES = ["mesh", "route-reflector"]
# What a pod-to-pod packet between two nodes looks like on the underlay.
WIRE = {
    "host-gw": "net 10.244.0.0/16",
    "ipip": "ip proto 4",
    "vxlan": "udp port 4789",
    "udp": "udp port 8285",
}


SENTINEL_PORT = 9  # discard: nobody listens, the datagram only has to cross the interface


async def count_on_wire(ns: Netns, iface: str, bpf: str, action, sentinel: tuple[Netns, str]) -> int:
    """Packets matching ``bpf`` on ``iface`` (in ``ns``) while ``action()`` runs.

    No settling time: once the action is done, ``sentinel`` = (namespace, address) sends UDP
    datagrams across ``iface`` until tcpdump prints one; packets are captured in order, so
    everything the action put on the wire has been counted by then.
    """
    src_ns, dst = sentinel
    flt = f"({bpf}) or (udp and dst port {SENTINEL_PORT} and dst host {dst})"
    proc = ns.popen(["tcpdump", "-l", "--immediate-mode", "-nn", "-q", "-i", iface, flt],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    try:
        # tcpdump says "listening on" once its capture is open (after a line about verbosity).
        def open_capture() -> str:
            line = ""
            while "listening on" not in line:
                line = proc.stderr.readline()
                assert line, "tcpdump exited before it was listening"
            return line

        await asyncio.wait_for(asyncio.to_thread(open_capture), DEFAULT_TIMEOUT)
        reader.start()
        await action()
        send = f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'end', ('{dst}', {SENTINEL_PORT}))"

        mark = f"{dst}.{SENTINEL_PORT}:"

        async def sentinel_seen() -> bool:
            if any(mark in line for line in lines):
                return True
            await src_ns.aexec("python3", "-c", send)
            return False

        await auntil(sentinel_seen, interval=0.2, what=f"the sentinel datagram on {iface}")
    finally:
        proc.terminate()
        proc.wait(10)
        if reader.ident is not None:
            reader.join(10)
        proc.stdout.close()
        proc.stderr.close()
    return len([x for x in lines if x.strip() and f"{dst}.{SENTINEL_PORT}:" not in x])


def pods_by_node(lab):
    out = {}
    for p in lab.pods:
        out.setdefault(p.node.name, []).append(p)
    return out


async def ping_all(lab, src, dsts, count=3):
    return await asyncio.gather(*(lab.ping(src, d.ip, count=count, wait=1) for d in dsts))


async def iperf(server, client, seconds=10):
    srv = server.ns.popen(["iperf3", "-s", "-1", "-B", server.ip], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # The server listens (port 5201) before the client connects: no retry on "refused".
        await auntil(lambda: f"{server.ip}:5201" in server.ns.exec("ss", "-Hltn", check=False), in_thread=True,
                     what="iperf3 -s listening")
        rc, out, err = await client.ns.aexec(
            "iperf3", "-c", server.ip, "-t", str(seconds), "-J", check=False, timeout=seconds + 60
        )
        try:
            result = json.loads(out)
        except ValueError:
            result = {"error": (out + err).decode(errors="replace")[-300:]}
        received = result.get("end", {}).get("sum_received")
        if rc == 0 and received:
            return received["bits_per_second"] / 1e9
        raise AssertionError(f"iperf3 failed (rc {rc}): {result.get('error') or json.dumps(result)[-800:]}")
    finally:
        srv.kill()
        srv.wait()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_backend_carries_pod_traffic(lab_factory, backend, mode):
    lab = await lab_factory(nodes=3, pods=2, bgp=mode, backend=backend)
    # a. every pod reaches every other pod
    matrix = await lab.reachability()
    assert all(matrix.values()), [k for k, v in matrix.items() if not v]
    # /status and /routes say which backend carries each peer and route.
    node1 = lab.nodes[0]
    peers = node1.api("/peers")
    assert {p["backend"] for p in peers} == {backend}, peers
    routes = [r for r in node1.api("/routes") if r["backend"] != "blackhole"]
    assert len(routes) == 2 and {r["backend"] for r in routes} == {backend}
    assert all(r["installed"] for r in routes)
    # b. the underlay carries the expected encapsulation, and only that.
    by_node = pods_by_node(lab)
    src, dsts = by_node["node1"][0], by_node["node2"] + by_node["node3"]

    async def traffic():
        assert all(await ping_all(lab, src, dsts))

    sentinel = (lab.nodes[0].ns, ETCD_ADDRESS)  # node1 -> etcd crosses n1 too
    encap = await count_on_wire(lab.underlay, "n1", WIRE[backend], traffic, sentinel)
    assert encap >= 2 * len(dsts), encap
    if backend != "host-gw":
        plain = await count_on_wire(lab.underlay, "n1", WIRE["host-gw"], traffic, sentinel)
        assert plain == 0, "pod addresses visible on the underlay: traffic was not encapsulated"
        status = node1.api("/status")["backends"]
        assert backend in status["active"], status
    # c. a 10 s TCP transfer between pods on different nodes completes (its speed is
    #    bench/dataplane.py's business).
    if mode == "mesh":
        gbps = await iperf(by_node["node2"][0], by_node["node1"][0], seconds=10)
        print(f"{backend}: iperf3 pod to pod {gbps:.2f} Gbit/s")


@pytest.mark.parametrize("backend", ["ipip", "vxlan", "udp"])
async def test_cross_subnet_encapsulates_only_across_segments(lab_factory, backend):
    # node1 and node3 share segment 0; node2 is on segment 1 behind the router.
    lab = await lab_factory(nodes=3, pods=1, backend=backend, encap="cross-subnet", subnets=2)
    assert [n.segment for n in lab.nodes] == [0, 1, 0]
    assert all((await lab.reachability()).values())
    node1 = lab.nodes[0]
    plans = {p["address"]: p["backend"] for p in node1.api("/peers")}
    assert plans == {lab.nodes[1].address: backend, lab.nodes[2].address: "host-gw"}
    pods = pods_by_node(lab)
    src = pods["node1"][0]

    async def to_same_segment():
        assert all(await ping_all(lab, src, pods["node3"]))

    async def to_other_segment():
        assert all(await ping_all(lab, src, pods["node2"]))

    sentinel = (node1.ns, ETCD_ADDRESS)
    # Same segment: plain pod packets, no encapsulation.
    assert await count_on_wire(lab.underlay, "n1", WIRE[backend], to_same_segment, sentinel) == 0
    assert await count_on_wire(lab.underlay, "n1", WIRE["host-gw"], to_same_segment, sentinel) >= 6
    # Other segment: encapsulated, and no pod address on the wire.
    assert await count_on_wire(lab.underlay, "n1", WIRE[backend], to_other_segment, sentinel) >= 6
    assert await count_on_wire(lab.underlay, "n1", WIRE["host-gw"], to_other_segment, sentinel) == 0
    gbps = await iperf(pods["node2"][0], src, seconds=10)
    print(f"cross-subnet {backend}: iperf3 across segments {gbps:.2f} Gbit/s")


async def test_node_changes_backend_by_config_and_restart(lab_factory):
    lab = await lab_factory(nodes=3, pods=1, backend="vxlan")
    node3 = lab.nodes[2]
    await node3.stop_agent()
    node3.backend = "udp"
    node3.start_agent()
    await lab.wait_established(60)
    await lab.wait_reachable(60)
    # node1 now reaches node3 with udp (node3's backend) and node2 still with vxlan.
    plans = {p["address"]: p["backend"] for p in lab.nodes[0].api("/peers")}
    assert plans == {lab.nodes[1].address: "vxlan", node3.address: "udp"}
    assert lab.nodes[2].api("/status")["node"]["backend"] == "udp"


def _neighbours(ns: Netns, dev: str) -> str:
    return ns.ip("neigh", "show", "dev", dev, check=False).stdout.decode()


def _fdb(ns: Netns, dev: str) -> str:
    return ns.exec("bridge", "fdb", "show", "dev", dev, check=False)


async def _worker_table(node, kind):
    client = await DataplaneClient.connect(control_path(node.dir / "state", kind))
    try:
        return await client.get()
    finally:
        await client.close()


@pytest.mark.parametrize("backend", ["ipip", "vxlan", "udp"])
async def test_leaving_node_tunnel_state_removed_everywhere(lab_factory, backend):
    lab = await lab_factory(nodes=3, pods=0, backend=backend)
    node1, node2, node3 = lab.nodes
    gone_subnet = lab.subnets()["node3"]
    gone_vtep = gone_subnet.split("/")[0]
    for n in (node1, node2):
        if backend == "vxlan":
            assert gone_vtep in _neighbours(n.ns, "agentd.vxlan")
            assert node3.address in _fdb(n.ns, "agentd.vxlan")
        else:
            table = await _worker_table(n, backend)
            assert table["next_hops"].get(gone_subnet) == node3.address
            assert node3.address in table["members"]
    await node3.leave()
    for n in (node1, node2):

        async def cleaned(n=n) -> bool:
            routed = any(line.startswith(gone_subnet) for line in n.kernel_routes())
            if backend == "vxlan":
                left = gone_vtep in _neighbours(n.ns, "agentd.vxlan") or node3.address in _fdb(n.ns, "agentd.vxlan")
            else:
                table = await _worker_table(n, backend)
                left = gone_subnet in table["next_hops"] or node3.address in table["members"]
            return not routed and not left

        await auntil(cleaned, interval=0.2, what=f"{n.name} to drop its tunnel state for node3")
    # node3 removed its own tunnel device when it left.
    assert "agentd." + ("ipip" if backend == "ipip" else backend) not in node3.ns.ip("-o", "link").stdout.decode()


def _ipv4_header(src: str, dst: str, proto: int, payload: bytes, ttl: int = 64) -> bytes:
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), 1, 0x4000, ttl, proto, 0,
                      socket.inet_aton(src), socket.inet_aton(dst))  # fmt: skip
    s = sum(struct.unpack("!10H", hdr))
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return hdr[:10] + struct.pack("!H", ~s & 0xFFFF) + hdr[12:] + payload


def _inner_ping(src: str, dst: str) -> bytes:
    icmp = struct.pack("!BBHHH", 8, 0, 0, 0x1234, 1) + b"forged"
    s = sum(struct.unpack("!%dH" % (len(icmp) // 2), icmp))
    s = (s & 0xFFFF) + (s >> 16)
    icmp = icmp[:2] + struct.pack("!H", ~s & 0xFFFF) + icmp[4:]
    return _ipv4_header(src, dst, 1, icmp)


@pytest.mark.parametrize("backend", ["ipip", "udp", "vxlan"])
async def test_encapsulated_packets_from_non_members_are_dropped_and_counted(lab_factory, backend):
    lab = await lab_factory(nodes=2, pods=1, backend=backend)
    node1 = lab.nodes[0]
    pod1 = pods_by_node(lab)["node1"][0]
    outsider = Netns.create(f"ad-{lab.spec.name}-outsider")  # removed by lab.down()
    veth(outsider, "eth0", lab.underlay, "out0")
    lab.underlay.ip("link", "set", "out0", "master", "br0")
    outsider.ip("addr", "add", "172.30.0.99/24", "dev", "eth0")
    inner = _inner_ping("10.244.250.1", pod1.ip)
    if backend == "udp":
        code = f"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nfor _ in range(5): s.sendto({inner!r}, ('{node1.address}', 8285))"
    elif backend == "vxlan":
        vx = struct.pack("!II", 0x08000000, 1 << 8) + b"\xff" * 6 + b"\x02" * 6 + b"\x08\x00" + inner
        code = f"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nfor _ in range(5): s.sendto({vx!r}, ('{node1.address}', 4789))"
    else:
        code = f"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_RAW, 4)\nfor _ in range(5): s.sendto({inner!r}, ('{node1.address}', 0))"

    def dropped() -> int:
        if backend == "vxlan":
            out = node1.ns.exec("nft", "list", "counter", "inet", "agentd", "vxlan_dropped")
            m = re.search(r"packets (\d+)", out)
            assert m, out
            return int(m.group(1))
        st = node1.api("/status")["backends"]["active"][backend]
        return (st.get("drops") or {}).get("non_member", 0)

    async def send():
        await outsider.aexec("python3", "-c", code)
        # The drops are counted where the backend enforces membership: once all five are,
        # node1 is done with them (the sentinel then closes the capture behind them).
        await auntil(lambda: dropped() >= 5, interval=0.2, in_thread=True, what="5 drops counted")

    # Nothing forged reaches the pod...
    seen = await count_on_wire(pod1.ns, "eth0", "icmp and src host 10.244.250.1", send, (node1.ns, pod1.ip))
    assert seen == 0
    # ...and the five forged packets were dropped (the kernel's counter sees nothing else).
    assert dropped() == 5 if backend == "vxlan" else dropped() >= 5


@pytest.mark.parametrize("backend", ["vxlan", "udp", "ipip"])
async def test_agent_restart_loses_no_packet_on_tunnels(lab_factory, backend):
    # The kernel tunnel state and the user-space workers outlive the agent process; the new
    # agent adopts them (and must not narrow the member filters before it has read etcd).
    lab = await lab_factory(nodes=3, pods=1, backend=backend)
    pods = pods_by_node(lab)
    node2 = lab.nodes[1]
    pingers = [
        Pinger(pods["node1"][0].ns, pods["node2"][0].ip),
        Pinger(pods["node2"][0].ns, pods["node3"][0].ip),
        Pinger(pods["node3"][0].ns, pods["node1"][0].ip),
    ]
    try:
        for p in pingers:  # traffic flows before the kill
            await asyncio.to_thread(p.wait_replies, 10)
        await node2.kill_agent()
        await apause(2.0, "node2's agent stays dead for a while: the tunnels must keep forwarding")
        node2.start_agent()
        await lab.wait_established(60)
        # Past the new agent's first complete sync (ready), and traffic after it.
        await auntil(lambda: node2.api("/status")["ready"], ignore=(OSError, ValueError), in_thread=True,
                     what="node2's new agent ready")
        for p in pingers:
            await asyncio.to_thread(p.wait_replies, 20, more=True)
        results = [p.stop() for p in pingers]
    finally:
        for p in pingers:
            p.close()
    for p, (sent, missing) in zip(pingers, results):
        assert sent > 0 and not missing, (p.dst_ip, sent, sorted(missing)[:20])
