"""The pod fast path (agentd/dataplane/bpf/podpath.c) on the real kernel, through the lab.

One lab (2 nodes, host-gw); on node1 pods x/server, x/client and x/other, on node2 x/far,
with a policy that isolates the server and lets only pods labelled pod=client (x/client and
x/far) reach it on TCP 5201.  The fast path must carry the accepted connections pod to pod --
on one node, and between the nodes on both of them -- let conntrack see the connections
close, leave the other pod denied, keep carrying across an agent restart (adopted maps,
programs swapped in place) and be gone -- from the veths, the underlay device, the pins and
the conntrack setting -- after a leave.  All of it twice: with ``[network] bpf_attach = "auto"``
(tcx on this kernel) and with "clsact", the hook kernels before 6.6 get (the wire program then
a cls_bpf filter of its own beside the data path's on the underlay device).
(The truth table of test_netpol.py runs with the fast path on as well: its probes' replies are
carried packets.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from netpol_lab import converged, namespace, np

from agentd.dataplane.bpf import tc
from agentd.lab.lab import Lab, LabSpec
from agentd.lab.netns import unique_tag
from agentd.lab.runtime import binary
from agentd.lab.wait import apause, auntil

pytestmark = pytest.mark.asyncio(loop_scope="module")

PORT = 5201
GUARD = np("guard", "x", {
    "podSelector": {"matchLabels": {"pod": "server"}},
    "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "client"}}}], "ports": [{"protocol": "TCP", "port": PORT}]}],
})  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["auto", "clsact"])
async def lab(request, tmp_path_factory):
    extra = {name: {"network": {"bpf_attach": request.param}} for name in ("node1", "node2")}
    lab = Lab(LabSpec(name="fp" + unique_tag("")[:6], nodes=2, pods=0, extra=extra), root=tmp_path_factory.mktemp("labs"))
    try:
        await lab.up(timeout=90)
        for name in ("server", "client", "other"):
            await lab.add_pod(lab.nodes[0], "x", name, labels={"pod": name})
        await lab.add_pod(lab.nodes[1], "x", "far", labels={"pod": "client"})
        res = await lab.resources()
        await converged(lab, await res.apply([namespace("x", {"ns": "x"}), GUARD]))
        yield lab
    finally:
        await lab.down(keep_files=True)


def pod(lab: Lab, name: str) -> Any:
    return next(p for p in lab.pods if p.name == f"x/{name}")


def hook(lab: Lab) -> str:
    """The hook the lab's agents attach by: what their bpf_attach means on this kernel."""
    return tc.resolve(lab.spec.extra["node1"]["network"]["bpf_attach"])


def programs_on(node: Any, device: str) -> list[tuple[str, str, str]]:
    """(direction, kind, name) of every program on ``device`` of ``node``: tcx or cls_bpf."""
    query = ("import socket, sys; from agentd.dataplane.bpf import tc\n"
             "for f in tc.filters(socket.if_nametoindex(sys.argv[1])): print(f.direction, f.kind, f.name)")
    return [tuple(line.split()) for line in node.ns.exec(sys.executable, "-c", query, device).splitlines()]


def fast_path(node: Any) -> dict[str, Any]:
    return node.api("/status")["policy"]["fast_path"]


async def carried_after(node: Any, floor: int, timeout: float = 10.0) -> int:
    """The carried packets counter once it is above ``floor`` (the agent reads it every 2 s)."""
    return await auntil(lambda: (c := fast_path(node)["packets"].get("carried", 0)) > floor and c, timeout,
                        interval=0.3, in_thread=True, what=f"the fast path to carry more than {floor} packets")


def conntrack(node: Any, port: int) -> list[str]:
    """The node's conntrack entries of TCP connections to ``port``."""
    lines = node.ns.exec("cat", "/proc/net/nf_conntrack").splitlines()
    return [line for line in lines if " tcp " in line and f"dport={port} " in line]


async def conntrack_saw_them_close(node: Any, port: int) -> None:
    """FIN and RST took the stack's path: conntrack followed the connections to ``port`` to
    their end (TIME_WAIT / CLOSE), instead of keeping them ESTABLISHED for days."""
    def closed() -> bool:
        entries = conntrack(node, port)
        return bool(entries) and not [e for e in entries if " ESTABLISHED " in e]

    await auntil(closed, 5, interval=0.2, in_thread=True,
                 what=lambda: f"{node.name}: conntrack to see the connections close: {conntrack(node, port)}")


def listening(ns: Any, port: int) -> bool:
    return bool(ns.exec("ss", "-Hltn", f"sport = :{port}").strip())


@contextlib.asynccontextmanager
async def iperf_server(lab: Lab, *args: str):
    """iperf3 -s in x/server, once it listens on PORT."""
    server = pod(lab, "server")
    proc = server.ns.popen(["iperf3", "-s", "-p", str(PORT), *args], stdout=asyncio.subprocess.DEVNULL,
                           stderr=asyncio.subprocess.DEVNULL)
    try:
        await auntil(lambda: listening(server.ns, PORT), 10, in_thread=True, what="iperf3 listening in x/server",
                     abort=lambda: proc.poll() is not None and f"iperf3 -s exited with status {proc.returncode}")
        yield server
    finally:
        proc.kill()
        proc.wait()


async def iperf(lab: Lab, client: str, *args: str) -> dict[str, Any]:
    """One iperf3 run from x/<client> to x/server (a one-off server in the server pod)."""
    async with iperf_server(lab, "-1") as server:
        rc, out, err = await pod(lab, client).ns.aexec("iperf3", "-c", server.ip, "-p", str(PORT), "-J", *args,
                                                       check=False, timeout=60)
        result = json.loads(out or b"{}")
        assert rc == 0 and "error" not in result, f"iperf3 failed: {result.get('error') or err.decode()}"
        return result


# What connecting to a port gives, as a pod sees it: a policy drop is a timeout; a refusal means
# nothing listens there (and says nothing about policy).
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), float(sys.argv[3]))
except TimeoutError:
    print("timed out")
except OSError as err:
    print(type(err).__name__)
else:
    print("connected")
"""


async def connect_outcome(src: Any, ip: str, port: int, timeout: float = 1.0) -> str:
    """"connected", "timed out" (dropped) or the error (``ConnectionRefusedError``: no listener)."""
    _rc, out, _err = await src.ns.aexec(sys.executable, "-c", CONNECT, ip, str(port), str(timeout), timeout=30)
    return out.decode().strip()


async def test_the_fast_path_is_on_for_every_pod(lab: Lab):
    view = await asyncio.to_thread(fast_path, lab.nodes[0])
    assert view["on"] and view["error"] is None, view
    assert view["pods"] == 3 and view["hook"] == hook(lab)
    assert view["between_nodes"]["on"] and view["between_nodes"]["why_not"] is None, view
    kind = "tcx" if hook(lab) == "tcx" else "bpf"
    wire = await asyncio.to_thread(programs_on, lab.nodes[0], "eth0")
    assert ("ingress", kind, tc.POD_WIRE) in wire and all(k == kind for _d, k, _n in wire), wire
    liberal = await asyncio.to_thread(lab.nodes[0].ns.exec, "cat", "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal")
    assert liberal.strip() == "1"
    text = await asyncio.to_thread(lab.nodes[0].ns.exec, binary("agentd"), "status")
    assert "Pod fast path on, same node and between nodes" in text, text


async def test_an_accepted_connection_is_carried_and_conntrack_sees_it_close(lab: Lab):
    node1 = lab.nodes[0]
    before = (await asyncio.to_thread(fast_path, node1))["packets"].get("carried", 0)
    result = await iperf(lab, "client", "-n", "200M")
    # All of it sent and the run ended cleanly (rc 0): TCP delivered it.  (The server's own
    # count can stop short of it: iperf3 ends its tally when the control channel says so.)
    assert result["end"]["sum_sent"]["bytes"] >= 200_000_000 and result["end"]["sum_received"]["bytes"] > 0
    # 200 MB is ~140,000 wire segments one way; most of the connection went pod to pod.
    carried = await carried_after(node1, before + 100_000)
    assert carried > before
    await conntrack_saw_them_close(node1, PORT)


async def test_a_connection_with_another_nodes_pod_is_carried_on_both_nodes(lab: Lab):
    node1, node2 = lab.nodes
    before = [(await asyncio.to_thread(fast_path, n))["packets"].get("carried", 0) for n in (node1, node2)]
    result = await iperf(lab, "far", "-n", "200M")
    assert result["end"]["sum_sent"]["bytes"] >= 200_000_000 and result["end"]["sum_received"]["bytes"] > 0
    # node2 carries far's data out (routed: FIB, TTL - 1) and the server's ACKs in; node1 the
    # data in and the ACKs out.
    assert await carried_after(node2, before[1] + 50_000) > before[1]
    assert await carried_after(node1, before[0] + 50_000) > before[0]
    for node in (node1, node2):
        await conntrack_saw_them_close(node, PORT)


async def test_a_denied_pod_stays_denied(lab: Lab):
    async with iperf_server(lab) as server:
        # Dropped by the policy (a timeout), not refused: the server listens, as the allowed
        # pod's connection shows.
        assert await connect_outcome(pod(lab, "other"), server.ip, PORT) == "timed out"
        assert await connect_outcome(pod(lab, "client"), server.ip, PORT) == "connected"
        # Where nothing listens and no policy drops (x/client is not isolated), the same probe
        # says refused: the two outcomes are told apart.
        assert await connect_outcome(pod(lab, "other"), pod(lab, "client").ip, PORT) == "ConnectionRefusedError"


# An idle connection x/client -> x/server on PORT, from source port FORGED_SPORT: the server
# accepts and waits, the client connects and waits.
HOLD_SERVER = """
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("", int(sys.argv[1])))
s.listen()
conn, _ = s.accept()
time.sleep(float(sys.argv[2]))
"""
HOLD_CLIENT = """
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("", int(sys.argv[3])))
s.connect((sys.argv[1], int(sys.argv[2])))
time.sleep(float(sys.argv[4]))
"""
# One TCP segment (ACK, PSH, a marked payload) of src:sport -> dst:dport, sent as a frame to
# MAC ``to`` out of ``device`` (an AF_PACKET socket: no route or rp_filter of the sender's).
FORGE = """
import socket, struct, sys
device, to, src, dst, sport, dport, marker = sys.argv[1:8]
def csum(b):
    b += bytes(len(b) % 2)
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    s = (s >> 16) + (s & 0xFFFF)
    return ~(s + (s >> 16)) & 0xFFFF
payload = marker.encode()
tcp = struct.pack("!HHIIBBHHH", int(sport), int(dport), 1, 1, 5 << 4, 0x18, 65535, 0, 0) + payload
pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(tcp))
tcp = tcp[:16] + struct.pack("!H", csum(pseudo + tcp)) + tcp[18:]
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0x4242, 0, 64, 6, 0, socket.inet_aton(src), socket.inet_aton(dst))
ip = ip[:10] + struct.pack("!H", csum(ip)) + ip[12:]
frame = bytes.fromhex(to.replace(":", "")) + bytes.fromhex("02aaaaaaaa010800") + ip + tcp
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((device, 0))
for _ in range(int(sys.argv[8])):
    s.send(frame)
"""
# How many frames carrying ``marker`` reach this namespace (any device) within ``seconds``.
SNIFF = """
import socket, sys, time
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
s.settimeout(0.1)
marker, end = sys.argv[1].encode(), time.monotonic() + float(sys.argv[2])
print("listening", flush=True)
seen = 0
while time.monotonic() < end:
    try:
        frame, addr = s.recvfrom(65535)
    except TimeoutError:
        continue
    seen += addr[2] != socket.PACKET_OUTGOING and marker in frame
print(seen)
"""
FORGED_SPORT = 40123


async def forged_frames_delivered(lab: Lab, marker: str, count: int = 5) -> int:
    """Frames x/server gets of ``count`` sent from the underlay (its bridge, to node1's eth0)
    with x/client's address and port as source, within its connection to x/server."""
    node1, server, client = lab.nodes[0], pod(lab, "server"), pod(lab, "client")
    mac = (await asyncio.to_thread(node1.ns.exec, "cat", "/sys/class/net/eth0/address")).strip()
    sniff = server.ns.popen([sys.executable, "-c", SNIFF, marker, "2"], stdout=asyncio.subprocess.PIPE)
    try:
        assert (await asyncio.to_thread(sniff.stdout.readline)).strip() == b"listening"
        await asyncio.to_thread(lab.underlay.exec, sys.executable, "-c", FORGE, f"br{node1.segment}", mac,
                                client.ip, server.ip, str(FORGED_SPORT), str(PORT), marker, str(count))
        out, _ = await asyncio.to_thread(sniff.communicate, timeout=10)
    finally:
        if sniff.poll() is None:
            sniff.kill()
            sniff.wait()
    return int(out)


async def test_a_frame_from_the_underlay_with_a_local_pods_source_is_left_to_the_stack(lab: Lab):
    """A host on the underlay forges x/client's address into x/client's established connection
    to x/server (same node).  The stack drops it under strict reverse-path filtering (x/client
    is reached by its veth, not the underlay); the wire program must leave it to the stack, not
    carry it into x/server past rp_filter (review s56 r2 #3)."""
    node1, server, client = lab.nodes[0], pod(lab, "server"), pod(lab, "client")
    held = server.ns.popen([sys.executable, "-c", HOLD_SERVER, str(PORT), "30"])
    holding = None
    try:
        await auntil(lambda: listening(server.ns, PORT), 10, in_thread=True, what="the listener in x/server")
        holding = client.ns.popen([sys.executable, "-c", HOLD_CLIENT, server.ip, str(PORT), str(FORGED_SPORT), "30"])
        await auntil(lambda: [e for e in conntrack(node1, PORT) if " ESTABLISHED " in e and f"sport={FORGED_SPORT} " in e],
                     10, in_thread=True, what="x/client's connection established")
        # With reverse-path filtering off the stack takes them in (conntrack: established): the
        # probe sees what arrives.
        assert await forged_frames_delivered(lab, "forged-loose") == 5
        await asyncio.to_thread(node1.ns.sysctl, "net.ipv4.conf.all.rp_filter", 1)
        try:
            assert await forged_frames_delivered(lab, "forged-strict") == 0
        finally:
            await asyncio.to_thread(node1.ns.sysctl, "net.ipv4.conf.all.rp_filter", 0)
    finally:
        for proc in (holding, held):
            if proc is not None:
                proc.kill()
                proc.wait()


async def test_a_connection_keeps_flowing_through_an_agent_restart(lab: Lab):
    node1 = lab.nodes[0]
    running = asyncio.ensure_future(iperf(lab, "client", "-t", "6"))
    await auntil(lambda: [e for e in conntrack(node1, PORT) if " ESTABLISHED " in e], 10, in_thread=True,
                 what="the iperf3 connection established")
    # (no count before the policy agent's first read of the counters: none carried, as far as it knows)
    before = (await asyncio.to_thread(fast_path, node1))["packets"].get("carried", 0)
    await node1.kill_agent()  # SIGKILL: the program and its maps stay in the kernel
    await apause(1.0, "no agent at all for a while: the programs and maps carry the connection alone")
    node1.start_agent()
    await lab.ready.agents_started(60)
    result = await running
    intervals = [i["sum"]["bits_per_second"] for i in result["intervals"]]
    assert min(intervals) > 0, f"the connection stalled around the restart: {intervals}"
    # The API answers before the policy agent is up again: /status has no "policy" until then.
    await auntil(lambda: (node1.api("/status").get("policy") or {}).get("fast_path", {}).get("on"), 30,
                 interval=0.3, in_thread=True, what="the restarted policy agent's fast path in /status")
    view = await asyncio.to_thread(fast_path, node1)
    assert view["on"] and view["adopted_maps"] and view["pods"] == 3, view
    assert await carried_after(node1, before) > before  # the counters too were adopted


async def test_leave_takes_the_fast_path_away(lab: Lab):
    node1 = lab.nodes[0]
    pins = Path((await asyncio.to_thread(fast_path, node1))["pins"])
    # node1's own pin directory (the lab's bpffs holds one per node): its fast-path pins are
    # there before the leave, so that their absence after it means something.
    pinned = lambda: [p.name for p in pins.glob("agentd_pod*")] if pins.exists() else []  # noqa: E731
    assert pinned(), f"no pins of the fast path in {pins} to begin with"
    await node1.leave()
    await auntil(lambda: node1.agent_pid() is None, 20, what="the agent to exit after leave")
    assert not pinned(), f"pins left behind: {pinned()}"
    liberal = await asyncio.to_thread(node1.ns.exec, "cat", "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal")
    assert liberal.strip() == "0"  # as the agent found it
    check = ("import socket; from agentd.dataplane.bpf import tc; "
             "print(sum(f.ours for i, _ in socket.if_nameindex() for f in tc.filters(i)))")
    left = await asyncio.to_thread(node1.ns.exec, sys.executable, "-c", check)
    assert left.strip() == "0", f"our programs are still on {left.strip()} hooks of node1's devices"
