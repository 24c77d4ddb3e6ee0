"""Encapsulation backends on the lab: VXLAN, IPIP and flannel's UDP, in the kernel, in BPF
and in user space.

Three nodes, real agents, real kernel devices, BPF programs and user-space workers; captures
on the underlay show what actually crosses the wire.  udp and ipip run in BPF here (the lab
mounts a bpffs for its nodes), except where a test asks for the user-space worker.
"""

import asyncio
import errno
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
from ipaddress import ip_address, ip_network
from pathlib import Path

import pytest

from dualstack_hosts import SINK, SOURCE

from agentd.dataplane import DataplaneClient
from agentd.dataplane.backends import control_path, state_path
from agentd.dataplane.bpf import layout, podpath, tc
from agentd.dataplane.bpf import libbpf as bpf
from agentd.lab.lab import ETCD_ADDRESS
from agentd.lab.netns import Netns, veth
from agentd.lab.runtime import binary
from agentd.lab.traffic import Pinger
from agentd.lab.wait import DEFAULT_TIMEOUT, apause, auntil

BACKENDS = ["host-gw", "ipip", "vxlan", "udp"]
# The data path each backend runs on in the lab, as /peers names it.
DATAPATH = {"host-gw": "kernel route", "ipip": "bpf", "vxlan": "vxlan device", "udp": "bpf"}
MODES = ["mesh", "route-reflector"]
# What a pod-to-pod packet between two nodes looks like on the underlay.
WIRE = {
    "host-gw": "net 10.244.0.0/16",
    "ipip": "ip proto 4",
    "vxlan": "udp port 4789",
    "udp": "udp port 8285",
}


SENTINEL_PORT = 9  # discard: nobody listens, the datagram only has to cross the interface


async def capture(ns: Netns, iface: str, flt: str, action, sentinel: tuple[Netns, str], *,
                  verbose: bool = False) -> list[str]:
    """tcpdump's records (one per packet) for the packets matching ``flt`` on ``iface`` (in
    ``ns``) while ``action()`` runs.

    No settling time: once the action is done, ``sentinel`` = (namespace, address) sends UDP
    datagrams to ``address`` port 9, across ``iface``, until tcpdump prints one; a capture
    sees an interface's packets in order, so everything the action put on the wire is in by
    then.  ``verbose``: ``-v -s 96`` (the IP header's fields; a record is then the header
    line and its continuation, joined).
    """
    src_ns, dst = sentinel
    mark = f"> {dst}.{SENTINEL_PORT}:"
    args = ["-v", "-s", "96"] if verbose else ["-q"]
    proc = ns.popen(["tcpdump", "-l", "--immediate-mode", "-nn", *args, "-i", iface,
                     f"({flt}) or (udp and dst port {SENTINEL_PORT} and dst host {dst})"],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, name=f"tcpdump {iface}", daemon=True)
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
        send = (f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
                f".sendto(b'end', ('{dst}', {SENTINEL_PORT}))")

        async def sentinel_seen() -> bool:
            if any(mark in line for line in list(lines)):
                return True
            await src_ns.aexec("python3", "-c", send)
            return False

        await auntil(sentinel_seen, interval=0.2, what=f"the sentinel datagram to {dst} on {iface}")
    finally:
        proc.terminate()
        proc.wait(10)
        if reader.ident is not None:
            reader.join(10)
        proc.stdout.close()
        proc.stderr.close()
    records: list[str] = []
    for line in lines:
        if line[:1].isspace() and records:
            records[-1] += " " + line.strip()
        elif line.strip():
            records.append(line)
    return [r for r in records if mark not in r]


async def count_on_wire(ns: Netns, iface: str, flt: str, action, sentinel: tuple[Netns, str]) -> int:
    """Packets matching ``flt`` on ``iface`` (in ``ns``) while ``action()`` runs."""
    return len(await capture(ns, iface, flt, action, sentinel))


def pods_by_node(lab):
    out = {}
    for p in lab.pods:
        out.setdefault(p.node.name, []).append(p)
    return out


async def ping_all(lab, src, dsts, count=3):
    return await asyncio.gather(*(lab.ping(src, d.ip, count=count, wait=1) for d in dsts))


async def iperf(server, client, seconds=10) -> float:
    """A ``seconds`` iperf3 TCP run from pod ``client`` to pod ``server``; asserts it completed
    and moved data, returns Gbit/s for the log (how fast is bench/dataplane.py's business)."""
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
        if rc == 0 and received and received["bytes"] > 0:
            return received["bits_per_second"] / 1e9
        raise AssertionError(f"iperf3 failed (rc {rc}): {result.get('error') or json.dumps(result)[-800:]}")
    finally:
        srv.kill()
        srv.wait()


# ------------------------------------------------------------------ helpers


def pin_dir(node):
    """Where the node's agent pins its BPF maps and programs (the lab's bpffs, netns-<inode>)."""
    return node.lab.bpffs / f"netns-{os.stat(node.ns.path).st_ino}"


def bpf_maps(node) -> dict:
    """What the node's pinned BPF maps hold now: routes {dst: (peer, kind)} and members."""
    d = pin_dir(node)
    rfd = bpf.obj_get(str(d / layout.ROUTES))
    pfd = bpf.obj_get(str(d / layout.PEERS))
    try:
        routes = {}
        for key in bpf.map_keys(rfd, layout.ROUTE_KEY.size):
            value = bpf.map_lookup(rfd, key, layout.ROUTE_VALUE.size)
            if value is not None:
                dst, peer, kind = layout.decode_route(key, value)
                routes[dst] = (peer, kind)
        members = {socket.inet_ntoa(k) for k in bpf.map_keys(pfd, layout.PEER_KEY.size)}
    finally:
        os.close(rfd)
        os.close(pfd)
    return {"routes": routes, "members": members}


def bpf_object_ids(node) -> dict[str, set[int]]:
    """The kernel ids of the programs and maps pinned for ``node``."""
    ids: dict[str, set[int]] = {"progs": set(), "maps": set()}
    for p in pin_dir(node).iterdir():
        if p.is_dir():
            continue  # links/: the tcx links (the programs they hold are pinned by name too)
        fd = bpf.obj_get(str(p))
        try:
            if p.name in layout.MAPS or p.name in podpath.MAPS:  # the pod fast path pins here too
                ids["maps"].add(bpf.map_info(fd)["id"])
            else:
                ids["progs"].add(bpf.prog_info(fd)["id"])
        finally:
            os.close(fd)
    return ids


def live_bpf_ids() -> dict[str, set[int]]:
    out = {}
    for kind in ("prog", "map"):
        proc = subprocess.run(["bpftool", "-j", kind, "show"], capture_output=True, text=True, check=True)
        out[kind + "s"] = {x["id"] for x in json.loads(proc.stdout or "[]")}
    return out


async def wait_freed(ids: dict[str, set[int]], what: str) -> None:
    """Wait until none of these programs and maps exists any more (the kernel frees a map
    after an RCU grace period once its last program is gone, so this takes a moment)."""
    left: dict[str, set[int]] = {}

    def gone() -> bool:
        live = live_bpf_ids()
        left.update(progs=ids["progs"] & live["progs"], maps=ids["maps"] & live["maps"])
        return not left["progs"] and not left["maps"]

    await auntil(gone, in_thread=True, interval=0.2, what=lambda: f"{what}'s programs and maps freed (left: {left})")


def tc_filters(node) -> str:
    """Every tc filter (``tc filter show``) and every tcx program (BPF_PROG_QUERY: ``tc`` does not
    show those) on the node's underlay device and on its bridges (the pods' bridge gets the
    member filter too)."""
    bridges = re.findall(r"^\d+: ([^:@]+)", node.ns.exec("ip", "-o", "link", "show", "type", "bridge"), re.MULTILINE)
    devices = ("eth0", *bridges)
    legacy = "".join(
        node.ns.exec("tc", "filter", "show", "dev", dev, d, check=False)
        for dev in devices
        for d in ("ingress", "egress")
    )
    query = ("import socket, sys; from agentd.dataplane.bpf import tc\n"
             "for dev in sys.argv[1:]:\n"
             "    for f in tc.filters(socket.if_nametoindex(dev)):\n"
             "        if f.kind == 'tcx': print(dev, f.direction, 'tcx bpf', f.name, f.prog_id)\n")
    return legacy + node.ns.exec(sys.executable, "-c", query, *devices)


async def transfer(src, dst, nbytes=64 << 20):
    """``nbytes`` of TCP from pod ``src`` to pod ``dst``: (sent, received), each (length, sha256)."""
    sink = dst.ns.popen([sys.executable, "-c", SINK, "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert (await asyncio.to_thread(sink.stdout.readline)).strip() == "ready"
        _, out, _ = await src.ns.aexec(sys.executable, "-c", SOURCE, dst.ip, str(nbytes), timeout=120)
        got, _ = await asyncio.to_thread(sink.communicate, timeout=60)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.communicate()
    return out.decode().split(), got.split()


async def outer_lengths(ns, iface: str, flt: str, action, sentinel: tuple[Netns, str]) -> list[int]:
    """IP lengths of the packets matching ``flt`` on ``iface`` while ``action`` runs."""
    records = await capture(ns, iface, flt, action, sentinel, verbose=True)
    return [int(m) for r in records for m in re.findall(r"proto \w+ \(\d+\), length (\d+)\)", r)]


# ------------------------------------------------------------------ every backend, both BGP modes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_backend_carries_pod_traffic(lab_factory, backend, mode):
    lab = await lab_factory(nodes=3, pods=2, bgp=mode, backend=backend)
    # a. every pod reaches every other pod
    matrix = await lab.ready.reachability()
    assert all(matrix.values()), [k for k, v in matrix.items() if not v]
    # /status and /routes say which backend and data path carry each peer and route.
    node1 = lab.nodes[0]
    peers = node1.api("/peers")
    assert {p["backend"] for p in peers} == {backend}, peers
    assert {p["datapath"] for p in peers} == {DATAPATH[backend]}, peers
    routes = [r for r in node1.api("/routes") if r["backend"] != "blackhole"]
    assert len(routes) == 2 and {r["backend"] for r in routes} == {backend}
    assert all(r["installed"] for r in routes)
    # b. the underlay carries the expected encapsulation, and only that.
    by_node = pods_by_node(lab)
    src, dsts = by_node["node1"][0], by_node["node2"] + by_node["node3"]

    async def traffic():
        assert all(await ping_all(lab, src, dsts))

    sentinel = (node1.ns, ETCD_ADDRESS)  # node1 -> etcd crosses n1 too
    encap = await count_on_wire(lab.underlay, "n1", WIRE[backend], traffic, sentinel)
    assert encap >= 2 * len(dsts), encap
    if backend != "host-gw":
        plain = await count_on_wire(lab.underlay, "n1", WIRE["host-gw"], traffic, sentinel)
        assert plain == 0, "pod addresses visible on the underlay: traffic was not encapsulated"
        status = node1.api("/status")["backends"]
        assert backend in status["active"], status
    if DATAPATH[backend] == "bpf":
        # The BPF maps hold both peers' subnets and every member; the peers' counters moved.
        maps = bpf_maps(node1)
        subnets = lab.subnets()
        assert maps["routes"] == {subnets[n.name]: (n.address, backend) for n in lab.nodes[1:]}
        assert maps["members"] == {n.address for n in lab.nodes}
        # /peers shows the BPF maps' per-peer counters (read every 2 s): they moved for both.
        peers = []

        def counted() -> bool:
            peers[:] = node1.api("/peers")
            return all(p["counters"] and p["counters"]["tx_packets"] > 0 and p["counters"]["rx_packets"] > 0
                       for p in peers)

        await auntil(counted, in_thread=True, interval=0.2, what=lambda: f"both peers' counters moved: {peers}")
    if mode == "mesh":
        # c. 64 MiB between pods on different nodes arrive intact; with encapsulation, TCP
        # super-packets cross the underlay whole (outer lengths far above its 1500-byte MTU).
        result = {}
        dst = by_node["node2"][0]

        async def transfer_():
            result["sent"], result["got"] = await transfer(by_node["node1"][0], dst)

        async def flow():
            result["pod"] = await outer_lengths(dst.ns, "eth0", "tcp and dst port 5001", transfer_,
                                                (dst.node.ns, dst.ip))

        outgoing = WIRE[backend] if backend == "host-gw" else f"src host {node1.address} and {WIRE[backend]}"
        lengths = await outer_lengths(lab.underlay, "n1", outgoing, flow, sentinel)
        assert result["sent"] == result["got"] and int(result["got"][0]) == 64 << 20, result
        assert lengths and result["pod"], "nothing captured"
        if backend in ("udp", "ipip"):
            assert max(lengths) > 8 * 1500, max(lengths)
            # ...and reach the pod whole: decapsulated and, with flow records on (the default),
            # handed to the pod fast path's judgement, which takes TCP that conntrack accepted
            # straight into the pod (the bridge would cut them, see deliver_local and
            # deliver_gated in datapath.c)...
            assert max(result["pod"]) > 8 * 1500, max(result["pod"])
            assert dst.node.api("/status")["backends"]["bpf"]["delivery"] == "gated"
            # ...while conntrack there still saw the connection start: node2's flow record.
            _, out, _ = await dst.node.ns.aexec(binary("agentd"), "flows", "-o", "json", "--event", "new",
                                                "--to-pod", f"{dst.namespace}/{dst.k8s_name}", "--port", "5001")
            new = [json.loads(x) for x in out.decode().splitlines()]
            assert new and new[-1]["direction"] == "ingress", new
        # Forwarded like any routed packet: one TTL decrement per node, whatever the backend
        # (one reply; ping probes once a second for up to 10 s, a lost probe is no failure).
        _, out, _ = await src.ns.aexec("ping", "-n", "-c", "1", "-w", "10", dst.ip, check=False, timeout=30)
        assert re.search(r"ttl=62 ", out.decode()), out.decode()
        # d. a 3 s iperf3 run completes (its speed is bench/dataplane.py's business).
        gbps = await iperf(by_node["node2"][0], by_node["node1"][0], seconds=3)
        print(f"{backend}: iperf3 pod to pod {gbps:.2f} Gbit/s, largest outer packet {max(lengths)} bytes")


@pytest.mark.parametrize("backend", ["ipip", "vxlan", "udp"])
async def test_cross_subnet_encapsulates_only_across_segments(lab_factory, backend):
    # node1 and node3 share segment 0; node2 is on segment 1 behind the router. node2 hands
    # decapsulated packets to the stack's forwarding path ([network] bpf_pod_redirect = false).
    lab = await lab_factory(nodes=3, pods=1, backend=backend, encap="cross-subnet", subnets=2,
                            extra={"node2": {"network": {"bpf_pod_redirect": False}}})
    assert [n.segment for n in lab.nodes] == [0, 1, 0]
    assert all((await lab.ready.reachability()).values())
    node1 = lab.nodes[0]
    plans = {p["address"]: p["backend"] for p in node1.api("/peers")}
    assert plans == {lab.nodes[1].address: backend, lab.nodes[2].address: "host-gw"}
    pods = pods_by_node(lab)
    src = pods["node1"][0]

    async def to_same_segment():
        assert all(await ping_all(lab, src, pods["node3"]))

    async def to_other_segment():
        assert all(await ping_all(lab, src, pods["node2"]))

    sentinel = (node1.ns, ETCD_ADDRESS)  # node1 -> etcd crosses n1 too
    # Same segment: plain pod packets, no encapsulation.
    assert await count_on_wire(lab.underlay, "n1", WIRE[backend], to_same_segment, sentinel) == 0
    assert await count_on_wire(lab.underlay, "n1", WIRE["host-gw"], to_same_segment, sentinel) >= 6
    # Other segment: encapsulated, and no pod address on the wire.
    assert await count_on_wire(lab.underlay, "n1", WIRE[backend], to_other_segment, sentinel) >= 6
    assert await count_on_wire(lab.underlay, "n1", WIRE["host-gw"], to_other_segment, sentinel) == 0
    if DATAPATH[backend] == "bpf":
        # Behind the router: the route leads to the router, the outer packet to the peer.
        (line,) = [r for r in node1.kernel_routes() if r.startswith(lab.subnets()["node2"])]
        assert "via 172.30.0.1 dev eth0 mtu" in line, line
        # (node1 -> node2's address crosses the router's eth1 too)
        seen = await capture(lab.router, "eth1", WIRE[backend], to_other_segment, (node1.ns, lab.nodes[1].address))
        assert any(f"IP {node1.address}" in x and f"> {lab.nodes[1].address}" in x for x in seen), seen
    # A 3 s iperf3 run across the segments completes (its speed is bench/dataplane.py's business).
    gbps = await iperf(pods["node2"][0], src, seconds=3)
    print(f"cross-subnet {backend}: iperf3 across segments {gbps:.2f} Gbit/s")


async def test_vxlan_peers_with_their_own_vni_and_port_and_entries_the_kernel_lost_put_back(lab_factory):
    """node2 runs VXLAN with another VNI and port ([network] vxlan_vni, vxlan_port): each side's
    FDB entry toward the other carries the other's, so pods reach each other both ways.  Then
    node1's VTEP is set down and up (the kernel flushes its permanent neighbour entries with
    its routes): the routes come back at once, the entries at the next re-read (VXLAN_REREAD),
    and traffic with them."""
    from agentd.dataplane.backends import VXLAN_REREAD

    lab = await lab_factory(nodes=2, pods=1, backend="vxlan",
                            extra={"node2": {"network": {"vxlan_vni": 7, "vxlan_port": 8472}}})
    node1, node2 = lab.nodes
    await lab.ready.reachable(60)
    assert re.search(rf"dst {node2.address} port 8472 vni 7 self permanent", _fdb(node1.ns, "agentd.vxlan"))
    assert re.search(rf"dst {node1.address} port 4789 vni 1 self permanent", _fdb(node2.ns, "agentd.vxlan"))
    vtep2 = lab.subnets()["node2"].split("/")[0]
    assert vtep2 in _neighbours(node1.ns, "agentd.vxlan")
    node1.ns.ip("link", "set", "agentd.vxlan", "down")
    node1.ns.ip("link", "set", "agentd.vxlan", "up")
    assert vtep2 not in _neighbours(node1.ns, "agentd.vxlan")  # flushed, permanent or not
    await auntil(lambda: vtep2 in _neighbours(node1.ns, "agentd.vxlan"), in_thread=True,
                 timeout=VXLAN_REREAD + 10, what="node1's neighbour entry for node2's VTEP put back")
    await lab.ready.reachable(10)
    assert "lost the neighbour or FDB entries of 1 peers" in node1.log_path.read_text()
    # bridge fdb del: the FDB entry is put back too.
    mac2 = json.loads(node2.ns.ip("-j", "link", "show", "agentd.vxlan").stdout)[0]["address"]
    node1.ns.exec("bridge", "fdb", "del", mac2, "dev", "agentd.vxlan", "self")
    assert node2.address not in _fdb(node1.ns, "agentd.vxlan")
    await auntil(lambda: node2.address in _fdb(node1.ns, "agentd.vxlan"), in_thread=True,
                 timeout=VXLAN_REREAD + 10, what="node1's FDB entry for node2 put back")
    await lab.ready.reachable(10)


async def test_a_record_copying_a_nodes_vtep_mac_takes_nothing_from_it(lab_factory):
    """A node record (node3, no agent behind it) publishing node2's VTEP MAC: node2's record
    was made first (lower etcd create_revision), so node2 keeps its MAC, its FDB entry and its
    pods' traffic on node1, and only node3 is refused, the reason naming both.  Restarting
    node2's agent puts its record again (same key, same create_revision): still node2's."""
    lab = await lab_factory(nodes=2, pods=1, backend="vxlan")
    node1, node2 = lab.nodes
    await lab.ready.reachable(60)
    mac2 = json.loads(node2.ns.ip("-j", "link", "show", "agentd.vxlan").stdout)[0]["address"]
    copy = (
        "import asyncio, json, aetcd\n"
        "async def main():\n"
        f"    async with aetcd.Client('{ETCD_ADDRESS}', 2379) as c:\n"
        "        rec = json.loads((await c.get(b'/agentd/nodes/node2')).value)\n"
        "        rec.update(name='node3', address='172.30.0.99', subnet='10.244.250.0/24')\n"
        "        rec['backend'] = {**rec['backend'], 'vtep_ip': '10.244.250.0'}\n"
        "        await c.put(b'/agentd/nodes/node3', json.dumps(rec).encode())\n"
        "        print(rec['backend']['vtep_mac'])\n"
        "asyncio.run(main())\n"
    )
    assert lab.etcd_ns.exec(sys.executable, "-c", copy).strip().lower() == mac2.lower()

    def decided():
        peers = {p["address"]: p for p in node1.api("/peers")}
        three, two = peers.get("172.30.0.99"), peers.get(node2.address)
        return three is not None and three["backend"] == "none" and two is not None and two["backend"] == "vxlan" \
            and (three, two)

    three, _two = await auntil(decided, in_thread=True, what="node3 refused, node2 kept on node1")
    assert "node2, node3" in three["backend_reason"] and "it is node2's" in three["backend_reason"]
    assert re.search(rf"{mac2} dst {node2.address} self permanent", _fdb(node1.ns, "agentd.vxlan"))
    assert "172.30.0.99" not in _fdb(node1.ns, "agentd.vxlan")
    await lab.ready.reachable(10)
    # node2's agent restarted: its record put again, under the same key -- still made first.
    await node2.stop_agent(signal.SIGTERM)
    node2.start_agent()
    await lab.ready.established(60)
    await lab.ready.reachable(60)
    three, two = decided() or (None, None)
    assert two is not None and two["backend"] == "vxlan" and three["backend"] == "none", (three, two)
    assert re.search(rf"{mac2} dst {node2.address} self permanent", _fdb(node1.ns, "agentd.vxlan"))


async def test_node_changes_backend_by_config_and_restart(lab_factory):
    lab = await lab_factory(nodes=3, pods=1, backend="vxlan")
    node3 = lab.nodes[2]
    await node3.stop_agent()
    node3.backend = "udp"
    node3.start_agent()
    await lab.ready.established(60)
    await lab.ready.reachable(60)
    # node1 now reaches node3 with udp (node3's backend) and node2 still with vxlan.
    plans = {p["address"]: p["backend"] for p in lab.nodes[0].api("/peers")}
    assert plans == {lab.nodes[1].address: "vxlan", node3.address: "udp"}
    assert lab.nodes[2].api("/status")["node"]["backend"] == "udp"
    # node3 still speaks VXLAN to the others: its VTEP stays.
    assert b"agentd.vxlan" in node3.ns.ip("-o", "link").stdout
    # The others change too; then node1 restarts once more, with no peer on VXLAN left: once
    # its routes are re-learned it removes the VTEP its previous run made (left up, unused,
    # it would take VXLAN from anyone).
    for node in lab.nodes[:2]:
        await node.stop_agent()
        node.backend = "udp"
        node.start_agent()
        await lab.ready.established(60)
    node1 = lab.nodes[0]
    assert b"agentd.vxlan" in node1.ns.ip("-o", "link").stdout  # node2 was on VXLAN when node1 came back
    await node1.stop_agent()
    node1.start_agent()
    await lab.ready.established(60)
    await lab.ready.reachable(60)
    await auntil(lambda: b"agentd.vxlan" not in node1.ns.ip("-o", "link").stdout, in_thread=True, timeout=60,
                 what="node1's unused VXLAN device to go")
    # (logged once the removal has returned: a moment after the device is gone)
    await auntil(lambda: "removed what a previous run left of backends no peer uses now: agentd.vxlan"
                 in node1.log_path.read_text(), in_thread=True, timeout=10, what="node1 to log the removal")
    # node1 changes to the user-space data path: its previous run's BPF programs (member list
    # and flags as they were then) leave the underlay, and pods still reach each other.
    assert "agentd_ingress" in tc_filters(node1)
    await node1.stop_agent()
    lab.spec.extra.setdefault("node1", {}).setdefault("network", {})["datapath"] = "userspace"
    node1.start_agent()
    await lab.ready.established(60)
    await lab.ready.reachable(60)
    assert "agentd_ingress" not in tc_filters(node1)
    assert "datapath = userspace: removed the BPF data path a previous run left" in node1.log_path.read_text()
    assert node1.api("/status")["backends"]["active"]["udp"]["datapath"] == "userspace"


SQUAT = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
try:
    s.bind((sys.argv[1], int(sys.argv[2])))
except OSError as exc:
    print(exc.errno)
else:
    print("bound")
"""


async def _no_squatting(node, dead_pid: int, port: int = 8285) -> None:
    """With node's worker ``dead_pid`` gone (its socket closed), an unprivileged user still
    cannot bind udp_port there: the agent holds it."""
    def gone() -> bool:
        try:
            return "\tZ" in Path(f"/proc/{dead_pid}/status").read_text()
        except OSError:
            return True

    await auntil(gone, in_thread=True, timeout=10, what=f"worker {dead_pid} to be gone")
    _, out, _ = await node.ns.aexec("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                    "/usr/bin/python3", "-c", SQUAT, node.address, str(port))
    assert out.decode().strip() == str(errno.EADDRINUSE), out


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


async def _tunnel_state(node, backend, subnet, address) -> tuple[bool, bool]:
    """(route to ``subnet`` in the backend's tables, ``address`` a member) on ``node``."""
    if backend == "vxlan":
        vtep = subnet.split("/")[0]
        return vtep in _neighbours(node.ns, "agentd.vxlan"), address in _fdb(node.ns, "agentd.vxlan")
    if DATAPATH[backend] == "bpf":
        maps = bpf_maps(node)
        return maps["routes"].get(subnet) == (address, backend), address in maps["members"]
    table = await _worker_table(node, backend)
    return table["next_hops"].get(subnet) == address, address in table["members"]


def _ipv4_header(src: str, dst: str, proto: int, payload: bytes, ttl: int = 64) -> bytes:
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), 1, 0x4000, ttl, proto, 0,
                      socket.inet_aton(src), socket.inet_aton(dst))  # fmt: skip
    s = sum(struct.unpack("!10H", hdr))
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return hdr[:10] + struct.pack("!H", ~s & 0xFFFF) + hdr[12:] + payload


def _inner_ping(src: str, dst: str) -> bytes:
    icmp = struct.pack("!BBHHH", 8, 0, 0, 0x1234, 1) + b"forged"
    s = sum(struct.unpack(f"!{len(icmp) // 2}H", icmp))
    s = (s & 0xFFFF) + (s >> 16)
    icmp = icmp[:2] + struct.pack("!H", ~s & 0xFFFF) + icmp[4:]
    return _ipv4_header(src, dst, 1, icmp)


def _inner_ping6(src: str, dst: str) -> bytes:
    icmp = struct.pack("!BBHHH", 128, 0, 0, 0x1234, 1) + b"forged"
    pseudo = socket.inet_pton(socket.AF_INET6, src) + socket.inet_pton(socket.AF_INET6, dst) + struct.pack("!I3xB", len(icmp), 58)
    s = sum(struct.unpack(f"!{(len(pseudo) + len(icmp)) // 2}H", pseudo + icmp))
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    icmp = icmp[:2] + struct.pack("!H", ~s & 0xFFFF) + icmp[4:]
    return struct.pack("!IHBB", 6 << 28, len(icmp), 58, 64) + socket.inet_pton(socket.AF_INET6, src) \
        + socket.inet_pton(socket.AF_INET6, dst) + icmp


def _forged(backend: str, inner: bytes, address: str, vtep_mac: str = "ff:ff:ff:ff:ff:ff") -> str:
    """Python that sends 5 of ``inner`` to ``address`` encapsulated as ``backend`` (VXLAN: in a
    frame to ``vtep_mac``; the kernel forwards only a frame addressed to its VTEP, never a
    broadcast one)."""
    if backend == "udp":
        return f"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nfor _ in range(5): s.sendto({inner!r}, ('{address}', 8285))"
    if backend == "vxlan":
        vx = struct.pack("!II", 0x08000000, 1 << 8) + bytes.fromhex(vtep_mac.replace(":", "")) + b"\x02" * 6 + b"\x08\x00" + inner
        return f"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nfor _ in range(5): s.sendto({vx!r}, ('{address}', 4789))"
    return f"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_RAW, 4)\nfor _ in range(5): s.sendto({inner!r}, ('{address}', 0))"


def non_member_drops(node, backend: str) -> int:
    """``backend`` packets from non-members the node's BPF member filter dropped (its counters
    are read every 2 s)."""
    st = node.api("/status")["backends"]["bpf"]
    assert st["active"], st
    return (st.get("drops") or {}).get(f"non_member_{backend}", 0)


# The forged pings' inner sources: outside the lab's pod network (a node's random /24 of it
# could be 10.244.250.0/24, and then its pod's own address matched the capture).
FORGED_FROM_OUTSIDER, FORGED_FROM_POD = "192.0.2.1", "192.0.2.2"


async def _forged_seen(lab, backend: str, target, sender: Netns, inner_src: str, drops: int) -> list[str]:
    """``sender`` sends 5 pings from ``inner_src`` to ``target``'s pod, encapsulated as
    ``backend`` and addressed to ``target``; returns tcpdump's records of those that reached
    that pod.  The
    capture ends once ``target`` counts ``drops`` non-member drops in all: it is done with the
    five by then (the sentinel closes the capture behind anything they caused)."""
    pod = pods_by_node(lab)[target.name][0]
    vtep = json.loads(target.ns.ip("-j", "link", "show", "agentd.vxlan").stdout)[0]["address"] if backend == "vxlan" else ""
    code = _forged(backend, _inner_ping(inner_src, pod.ip), target.address, vtep)

    async def send():
        await sender.aexec("python3", "-c", code)
        await auntil(lambda: non_member_drops(target, backend) >= drops, in_thread=True, interval=0.2,
                     what=lambda: f"{target.name} to count {drops} non_member_{backend} drops "
                                  f"(has {non_member_drops(target, backend)})")

    return await capture(pod.ns, "eth0", f"icmp[icmptype] == icmp-echo and src host {inner_src} and dst host {pod.ip}",
                         send, (target.ns, pod.ip))


async def _forge_from_pod(lab, backend: str, target, drops: int) -> list[str]:
    """``target``'s own pod sends 5 encapsulated pings to its node's address (in by the pods'
    bridge, not the underlay); returns tcpdump's records of those that came back out to that
    pod."""
    pod = pods_by_node(lab)[target.name][0]
    return await _forged_seen(lab, backend, target, pod.ns, FORGED_FROM_POD, drops)


async def _forge_from_outsider(lab, backend: str, target, drops: int) -> list[str]:
    """An outsider on the underlay segment sends 5 encapsulated pings for ``target``'s pod;
    returns tcpdump's records of those that reached that pod."""
    name = f"ad-{lab.spec.name}-outsider"
    outsider = Netns(name) if Netns(name).exists() else Netns.create(name)  # removed by lab.down()
    if "out0" not in lab.underlay.ip("-o", "link").stdout.decode():
        veth(outsider, "eth0", lab.underlay, "out0")
        lab.underlay.ip("link", "set", "out0", "master", "br0")
        outsider.ip("addr", "add", "172.30.0.99/24", "dev", "eth0")
    return await _forged_seen(lab, backend, target, outsider, FORGED_FROM_OUTSIDER, drops)


def _worker_status(node, backend: str) -> dict:
    return node.api("/status")["backends"]["active"][backend]


def _spoofed(node, backend: str) -> int:
    """Inner packets ``node``'s user-space worker dropped as spoofed (its counters are read
    every 2 s)."""
    return (_worker_status(node, backend).get("drops") or {}).get("spoofed", 0)


def _from_member(backend: str, inner: bytes, member: str, target: str) -> str:
    """Python that sends 5 of ``inner`` to ``target``, encapsulated as ``backend`` by the member
    ``member`` itself: ipip from a raw socket (the kernel puts the member's address on it);
    udp from the member's address and ``udp_port`` (8285, which its agent holds: built with
    IP_HDRINCL, no socket bound), as its worker sends."""
    if backend == "ipip":
        return f"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_RAW, 4)\nfor _ in range(5): s.sendto({inner!r}, ('{target}', 0))"
    udp = struct.pack("!HHHH", 8285, 8285, 8 + len(inner), 0) + inner  # checksum 0: flannel's
    outer = _ipv4_header(member, target, socket.IPPROTO_UDP, udp)
    return (f"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)\n"
            f"for _ in range(5): s.sendto({outer!r}, ('{target}', 0))")


@pytest.mark.parametrize("backend, family", [("udp", "dual"), ("ipip", "ipv4")])
async def test_user_space_workers_carry_what_peers_send_and_drop_a_members_spoofed_sources(lab_factory, backend, family):
    """Three nodes, each running the backend in its user-space worker, whose receive side now
    takes an inner packet only from an address that routes back to the member that sent it
    (its pod subnets: its pods, and its tunnel device's address, which its host's packets and
    its kernel's ICMP errors come from) or the member's own address:

    a. every pod reaches every other (IPv4, and IPv6 over udp) and TCP crosses intact;
    b. a peer's host reaches our pods (from its TUN's address; IPv6 from its pods' bridge);
    c. an ICMP error a peer's kernel sends about our pod's packet (time exceeded, from its TUN's
       address; IPv6: hop limit, from the address it picks) reaches our pod;
    d. a member's encapsulated packet from another node's pod or from the receiving node's own
       address is dropped and counted ``spoofed`` on the real data path; the same packet from
       the member's own pod passes (the harness can forge at all)."""
    lab = await lab_factory(nodes=3, pods=1, backend=backend, datapath="userspace", ip_family=family)
    node1, node2, node3 = lab.nodes
    pods = {p.node.name: p for p in lab.pods}
    pod1, pod2, pod3 = pods["node1"], pods["node2"], pods["node3"]
    assert {(p["backend"], p["datapath"]) for p in node1.api("/peers")} == {(backend, "user space")}
    # a.
    matrix = await lab.ready.matrix()
    assert all(matrix.values()), [k for k, ok in matrix.items() if not ok]
    sent, got = await transfer(pod2, pod1, 8 << 20)
    assert sent == got and int(got[0]) == 8 << 20
    # b. node2's host to node1's pod (each family it has).
    for address in [pod1.ip] + ([pod1.address(6)] if family == "dual" else []):
        assert await lab.ping(node2, address, count=2), f"node2's host could not reach {address}"
    if family == "dual":
        # IPv6 from node2's host: by default from its TUN's address (one in its IPv6 pod
        # subnet, as the kernel prefers the outgoing interface's); from its node address
        # (address_v6: a host with no such address, a reply with ip_masq off) it passes too.
        tun = json.loads(node2.ns.ip("-6", "-j", "addr", "show", "dev", "agentd.udp").stdout)[0]["addr_info"]
        tun_v6 = [a["local"] for a in tun if a.get("scope") == "global"]
        picked = json.loads(node2.ns.ip("-6", "-j", "route", "get", pod1.address(6)).stdout)[0].get("prefsrc")
        assert len(tun_v6) == 1 and picked == tun_v6[0], (tun, picked)
        subnet2_v6 = next(ip_network(n) for n in lab.all_subnets()["node2"] if ":" in n)
        assert tun_v6 == [str(subnet2_v6.network_address)], (tun_v6, subnet2_v6)
        assert node2.address_v6 is not None
        for source in (tun_v6[0], node2.address_v6):
            rc, out, _ = await node2.ns.aexec("ping", "-6", "-n", "-q", "-c", "2", "-w", "4", "-I", source,
                                              pod1.address(6), check=False, timeout=15)
            assert rc == 0, f"node2's host could not reach {pod1.address(6)} from {source}: {out.decode()}"
    # c. Time exceeded from node2's kernel: the TTL runs out where node2 forwards to its pod
    # (node1's kernel takes one, udp's worker another: flannel's router hop).
    ttl = "3" if backend == "udp" else "2"
    _, out, _ = await pod1.ns.aexec("ping", "-n", "-c", "2", "-W", "2", "-t", ttl, pod2.ip, check=False, timeout=30)
    subnet2 = ip_network(lab.subnets()["node2"])
    seen = re.findall(r"From (\S+) icmp_seq=\d+ Time to live exceeded", out.decode())
    assert seen and all(ip_address(a) in subnet2 for a in seen), out.decode()
    if family == "dual":
        _, out, _ = await pod1.ns.aexec("ping", "-6", "-n", "-c", "2", "-W", "2", "-t", ttl, pod2.address(6),
                                        check=False, timeout=30)
        assert "Time exceeded: Hop limit" in out.decode(), out.decode()
    # Nothing legitimate was taken for spoofed on the way.
    await apause(2.5, "the workers' counters are read every 2 s")
    assert [_spoofed(n, backend) for n in lab.nodes] == [0, 0, 0]

    # d. node2 (a member) forges pings to node1's pod: from node3's pod, from node1 itself.
    def counted(name: str) -> int:
        w = _worker_status(node1, backend)
        return (w.get("drops") or {}).get(name, 0) if name == "spoofed" else (w.get("counters") or {}).get(name, 0)

    async def forged(inner_src: str, *, dropped: bool) -> list[str]:
        """tcpdump's records of node2's five forged pings from ``inner_src`` that reached node1's
        pod; once node1's worker has counted the five (dropped as spoofed, or received)."""
        counter = "spoofed" if dropped else "rx_packets"
        before = counted(counter)
        code = _from_member(backend, _inner_ping(inner_src, pod1.ip), node2.address, node1.address)

        async def send():
            await node2.ns.aexec("python3", "-c", code)
            await auntil(lambda: counted(counter) >= before + 5, in_thread=True, interval=0.2,
                         what=lambda: f"node1's worker to count 5 {counter} from {inner_src} "
                                      f"(has {counted(counter) - before})")

        return await capture(pod1.ns, "eth0", f"icmp[icmptype] == icmp-echo and src host {inner_src} and dst host {pod1.ip}",
                             send, (node1.ns, pod1.ip))

    assert await forged(pod3.ip, dropped=True) == []
    assert await forged(node1.address, dropped=True) == []
    # The same from node2's own pod reaches node1's pod: the source is the reason, not the forging.
    assert len(await forged(pod2.ip, dropped=False)) == 5
    forged_sources = 10
    if family == "dual":
        # node2 posing as node3's host over IPv6 (node3's address_v6, accepted from node3 alone).
        before = counted("spoofed")
        await node2.ns.aexec("python3", "-c", _from_member(backend, _inner_ping6(node3.address_v6, pod1.address(6)),
                                                             node2.address, node1.address))
        await auntil(lambda: counted("spoofed") >= before + 5, in_thread=True, interval=0.2,
                     what=lambda: f"node1's worker to count 5 spoofed from {node3.address_v6} (has {counted('spoofed') - before})")
        forged_sources += 5
    await apause(2.5, "the workers' counters are read every 2 s")
    assert _spoofed(node1, backend) == forged_sources and [_spoofed(n, backend) for n in (node2, node3)] == [0, 0]


async def test_a_new_pods_bridge_is_guarded_before_its_first_pod_is_acknowledged(lab_factory):
    """With ``bpf_attach = "clsact"``, the pods' bridge that the first pod's CNI ADD makes has
    the member filter, and so its clsact qdisc, by the time ADD returns -- not only at the
    agent's next refresh, up to 2 s later.  Adding a qdisc stops a device's transmit queues for
    a moment: an agent killed before that refresh left it to the next agent, whose first
    refresh then added it to a bridge in use, and a ping across the restart was lost."""
    lab = await lab_factory(nodes=2, pods=0, backend="udp",
                            extra={f"node{i}": {"network": {"bpf_attach": "clsact"}} for i in (1, 2)})
    node1 = lab.nodes[0]
    assert not re.findall(r"^\d+: ([^:@]+)", node1.ns.exec("ip", "-o", "link", "show", "type", "bridge"), re.MULTILINE)
    await lab.add_pod(node1, "default", "first")
    bridges = re.findall(r"^\d+: ([^:@]+)", node1.ns.exec("ip", "-o", "link", "show", "type", "bridge"), re.MULTILINE)
    assert bridges
    for bridge in bridges:
        shown = node1.ns.exec("tc", "filter", "show", "dev", bridge, "ingress", check=False)
        assert "agentd_ingress" in shown, (bridge, shown)


# ------------------------------------------------------------------ the life of a node, per backend


@pytest.mark.parametrize("backend, hook", [("vxlan", "auto"), ("udp", "auto"), ("ipip", "auto"), ("udp", "clsact")])
async def test_restart_outsiders_leave_and_down(lab_factory, backend, hook):
    """One lab per encapsulating backend (and the udp one again with ``bpf_attach = "clsact"``,
    the hook kernels before 6.6 get; "auto" is tcx on this kernel), four checks in turn:

    a. SIGKILL of an agent and a restart lose no ping (the kernel state -- BPF programs and
       maps, VXLAN device, user-space worker -- outlives the agent; the next one adopts it);
    b. encapsulated packets from a non-member are dropped and counted;
    c. a node that leaves is removed from every other node's tunnel state, and leaves none of
       its own behind (no tc filter, pin, program or map); and `agentd leave` with no agent
       running (after a SIGKILL) removes what the killed agent left;
    d. lab down leaves no program, pin or map of any node behind.
    """
    lab = await lab_factory(nodes=3, pods=1, backend=backend,
                            extra={f"node{i}": {"network": {"bpf_attach": hook}} for i in (1, 2, 3)})
    node1, node2, node3 = lab.nodes
    pods = pods_by_node(lab)
    for node in lab.nodes:  # the hook asked for, and the programs on it
        assert node.api("/status")["backends"]["bpf"]["hook"] == tc.resolve(hook)
        assert ("tcx bpf agentd_ingress" in tc_filters(node)) == (tc.resolve(hook) == "tcx")

    # a. SIGKILL node2's agent and start it again while pods ping through it.
    before = bpf_object_ids(node2) if DATAPATH[backend] == "bpf" else None
    pingers = [
        Pinger(pods["node1"][0].ns, pods["node2"][0].ip),
        Pinger(pods["node2"][0].ns, pods["node3"][0].ip),
        Pinger(pods["node3"][0].ns, pods["node1"][0].ip),
    ]
    try:
        for p in pingers:  # traffic flows before the kill
            await asyncio.to_thread(p.wait_replies, 10)
        await node2.kill_agent()
        at_kill = [p.replies() for p in pingers]
        await apause(2.0, "node2's agent stays dead for a while: its kernel state must keep forwarding")
        # ...and it does: every pair (each goes through node2) is answered with no agent there.
        await auntil(lambda: all(p.replies() >= n + 20 for p, n in zip(pingers, at_kill)),
                     what=lambda: f"20 replies per pair with node2's agent dead "
                                  f"(have {[p.replies() - n for p, n in zip(pingers, at_kill)]})")
        node2.start_agent()
        await lab.ready.established(60)
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
        # Echoes sent after the last answer may still be on their way when ping stops counting
        # (Pinger.stop leaves them out); every earlier one must have been answered.
        assert sent > 0 and not missing, (p.dst_ip, sent, sorted(missing)[:20], p.trouble(), p.lines[-3:])
    if before is not None:
        # The new agent adopted the pinned maps and swapped in programs of its own.
        after = bpf_object_ids(node2)
        assert after["maps"] == before["maps"] and after["progs"].isdisjoint(before["progs"])
        assert sorted(node2.api("/status")["backends"]["bpf"]["adopted_maps"]) == sorted(layout.EXPECTED)

    # b. An outsider's encapsulated packets never reach the pod, and are counted (all five,
    # and nothing else).
    assert non_member_drops(node1, backend) == 0
    assert await _forge_from_outsider(lab, backend, node1, drops=5) == []
    assert non_member_drops(node1, backend) == 5
    # b'. So are those a pod sends to its own node (they come in by the pods' bridge).
    # (the records, if any, say which: the inner ping decapsulated and delivered to the pod)
    seen = await _forge_from_pod(lab, backend, node1, drops=10)
    assert seen == [], (seen, node1.api("/status")["backends"]["bpf"])
    assert non_member_drops(node1, backend) == 10

    # c. node3 leaves while node1's agent is stopped (gracefully: its kernel state stays): gone
    # from node2's tables at once, and from node1's once its next run has re-learned the routes
    # (what the previous run left of node3 -- VTEP entries, BPF routes and members, the
    # worker's table -- is pruned then); nothing of node3's own is left.
    gone_subnet = lab.subnets()["node3"]
    ids3 = bpf_object_ids(node3)
    for n in (node1, node2):
        assert await _tunnel_state(n, backend, gone_subnet, node3.address) == (True, True)
    await node1.stop_agent()
    await node3.leave()
    node1.start_agent()
    await auntil(lambda: node1.api("/status")["ready"], ignore=(OSError, ValueError), in_thread=True,
                 what="node1's new agent ready")
    for n in (node1, node2):

        async def cleaned(n=n) -> bool:
            routed = any(line.startswith(gone_subnet) for line in n.kernel_routes())
            return not routed and await _tunnel_state(n, backend, gone_subnet, node3.address) == (False, False)

        await auntil(cleaned, interval=0.2, what=f"{n.name} to drop its tunnel state for node3")
    assert f"agentd.{backend}" not in node3.ns.ip("-o", "link").stdout.decode()
    assert not pin_dir(node3).exists() and "bpf" not in tc_filters(node3)
    await wait_freed(ids3, "node3")

    # c'. node2's agent is SIGKILLed, then `agentd leave` runs with no agent: it removes what
    # the killed agent left of the BPF data path too.
    ids2 = bpf_object_ids(node2)
    await node2.kill_agent()
    assert pin_dir(node2).exists() and "agentd_ingress" in tc_filters(node2)
    await node2.leave()
    assert not pin_dir(node2).exists() and "bpf" not in tc_filters(node2)
    await wait_freed(ids2, "node2")

    # d. lab down: every node's programs and maps go with it, and the bpffs is unmounted.
    ids1 = bpf_object_ids(node1)
    assert ids1["progs"] and ids1["maps"]  # every node runs the BPF member filter
    await lab.down(keep_files=True)
    await wait_freed(ids1, "node1")
    assert not os.path.ismount(lab.bpffs)


@pytest.mark.parametrize("backend", ["udp", "ipip"])
async def test_mixed_bpf_and_userspace_pair(lab_factory, tmp_path, backend):
    """node1 runs the backend in BPF; node2 cannot (its bpf_dir is no BPF file system) and
    falls back to the user-space worker, saying why.  node1 speaks to node2 through a worker
    of its own (a BPF sender's GSO super-packets and unfinished checksums would reach node2's
    socket as they are on this veth underlay), and its BPF programs pass node2's packets to
    that worker.  Traffic flows both ways, intact."""
    no_bpffs = tmp_path / "not-a-bpffs"
    lab = await lab_factory(nodes=2, pods=1, backend=backend,
                            extra={"node2": {"agent": {"bpf_dir": str(no_bpffs)}}})
    node1, node2 = lab.nodes
    st = node2.api("/status")["backends"]
    assert st["active"][backend]["datapath"] == "userspace"
    assert "no BPF file system" in st["active"][backend]["fallback"], st
    # One cause for every BPF part (the data path, the pod fast path): logged once this run.
    log = node2.log_path.read_text()
    assert log.count("no BPF file system") == 1 and "its BPF pin directory cannot be made" in log, log[-3000:]
    st = node1.api("/status")["backends"]
    assert st["active"][backend]["datapath"] == "bpf" and backend in st["userspace_peers_worker"], st
    assert [p["datapath"] for p in node1.api("/peers")] == ["user space"]
    assert [p["datapath"] for p in node2.api("/peers")] == ["user space"]
    # node1's BPF filter still holds node2 as a member, flagged for the worker.
    assert node2.address in bpf_maps(node1)["members"]
    pods = pods_by_node(lab)
    for src, dst in ((pods["node1"][0], pods["node2"][0]), (pods["node2"][0], pods["node1"][0])):
        sent, got = await transfer(src, dst, 16 << 20)
        assert sent == got and int(got[0]) == 16 << 20
    # Both workers carried both transfers (their statistics are refreshed every 2 s; none are
    # shown before the first refresh).
    def worker(node) -> dict:
        st = node.api("/status")["backends"]
        return st["userspace_peers_worker"].get(backend) or st["active"][backend]

    def carried(node) -> dict | None:
        w = worker(node)
        return w if min(w["counters"].get("rx_bytes", 0), w["counters"].get("tx_bytes", 0)) > 16 << 20 else None

    for node in (node1, node2):
        w = await auntil(lambda node=node: carried(node), in_thread=True, interval=0.2,
                         what=lambda node=node: f"{node.name}'s worker to count both transfers: {worker(node)['counters']}")
        assert w["drops"]["malformed"] == 0
        assert w["counters"]["rx_csum_errors"] == 0  # what the other side sent verifies here

    # node2's worker dies: its TUN and the routes through it stay, so the agent must notice
    # (its next refresh), start another and give it its table.
    dead = worker(node2)["worker_pid"]
    os.kill(dead, signal.SIGKILL)
    if backend == "udp":  # meanwhile the agent holds udp_port: no other user can take it
        await _no_squatting(node2, dead)
    await auntil(lambda: worker(node2)["worker_pid"] not in (None, dead), in_thread=True, timeout=30,
                 what="node2's agent to start another worker")
    for src, dst in ((pods["node1"][0], pods["node2"][0]), (pods["node2"][0], pods["node1"][0])):
        sent, got = await transfer(src, dst, 1 << 20)
        assert sent == got and int(got[0]) == 1 << 20
    if backend == "udp":
        assert (await _worker_table(node2, backend))["config"]["socket"] == "inherited"
        # A graceful restart: the next run takes the worker over, and its socket with it (the
        # previous run bound it); the worker dies again and the port is still held.
        kept = worker(node2)["worker_pid"]
        await node2.stop_agent()
        node2.start_agent()
        await lab.ready.established(60)
        await auntil(lambda: "re-attached to the running udp data-plane worker" in node2.log_path.read_text(),
                     in_thread=True, timeout=30, what="node2's new agent to take the worker over")
        assert (await _worker_table(node2, backend))["config"]["pid"] == kept
        assert "cannot take the udp socket" not in node2.log_path.read_text()
        os.kill(kept, signal.SIGKILL)
        await _no_squatting(node2, kept)
        await auntil(lambda: worker(node2)["worker_pid"] not in (None, kept), in_thread=True, timeout=30,
                     what="node2's agent to start another worker")
        for src, dst in ((pods["node1"][0], pods["node2"][0]), (pods["node2"][0], pods["node1"][0])):
            sent, got = await transfer(src, dst, 1 << 20)
            assert sent == got and int(got[0]) == 1 << 20
        # A graceful restart with another udp_port: the running worker (on the old port) is
        # not taken over but replaced.  (The port is the cluster's: node1 still sends to the
        # old one, so no traffic is checked from here on.)
        old = worker(node2)["worker_pid"]
        await node2.stop_agent()
        assert old in node2.ns.pids()  # a graceful stop leaves the worker forwarding
        lab.spec.extra.setdefault("node2", {}).setdefault("network", {})["udp_port"] = 8473
        node2.start_agent()
        await lab.ready.established(60)
        await auntil(lambda: worker(node2)["worker_pid"] not in (None, old), in_thread=True, timeout=30,
                     what="node2's new worker")
        assert old not in node2.ns.pids()
        assert (await _worker_table(node2, backend))["config"]["port"] == 8473

    # node2's agent is SIGKILLed (its worker forwards on, orphaned), then `agentd leave` runs
    # with no agent: the worker is shut down and takes its TUN device, its control socket and
    # its state file along.
    pid = worker(node2)["worker_pid"]
    control, state = control_path(node2.dir / "state", backend), state_path(node2.dir / "state", backend)
    assert os.path.exists(control) and os.path.exists(state)
    await node2.kill_agent()
    assert pid in node2.ns.pids()
    await node2.leave()
    await auntil(lambda: pid not in node2.ns.pids(), in_thread=True, what=f"node2's worker (pid {pid}) to exit")
    assert not os.path.exists(control) and not os.path.exists(state)
    assert f"agentd.{backend}" not in node2.ns.ip("-o", "link").stdout.decode()
