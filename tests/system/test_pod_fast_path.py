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
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from netpol_lab import converged, namespace, np

from agentd.dataplane.bpf import tc
from agentd.lab.lab import Lab, LabSpec
from agentd.lab.netns import unique_tag
from agentd.lab.runtime import binary

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
    deadline = time.monotonic() + timeout
    while True:
        carried = (await asyncio.to_thread(fast_path, node))["packets"].get("carried", 0)
        if carried > floor:
            return carried
        assert time.monotonic() < deadline, f"the fast path carried nothing more than {floor} packets"
        await asyncio.sleep(0.3)


def conntrack(node: Any, port: int) -> list[str]:
    """The node's conntrack entries of TCP connections to ``port``."""
    lines = node.ns.exec("cat", "/proc/net/nf_conntrack").splitlines()
    return [line for line in lines if " tcp " in line and f"dport={port} " in line]


async def iperf(lab: Lab, client: str, *args: str) -> dict[str, Any]:
    """One iperf3 run from x/<client> to x/server (a one-off server in the server pod)."""
    server = pod(lab, "server")
    proc = server.ns.popen(["iperf3", "-s", "-1", "-p", str(PORT)], stdout=asyncio.subprocess.DEVNULL,
                           stderr=asyncio.subprocess.DEVNULL)
    try:
        await asyncio.sleep(0.3)
        rc, out, err = await pod(lab, client).ns.aexec("iperf3", "-c", server.ip, "-p", str(PORT), "-J", *args,
                                                       check=False, timeout=60)
        result = json.loads(out or b"{}")
        assert rc == 0 and "error" not in result, f"iperf3 failed: {result.get('error') or err.decode()}"
        return result
    finally:
        proc.kill()
        proc.wait()


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
    assert result["end"]["sum_received"]["bytes"] >= 200_000_000
    # 200 MB is ~140,000 wire segments one way; most of the connection went pod to pod.
    carried = await carried_after(node1, before + 100_000)
    assert carried > before
    # FIN and RST took the stack's path: conntrack followed the connections to their end
    # (TIME_WAIT / CLOSE), instead of keeping them ESTABLISHED for days.
    deadline = time.monotonic() + 5
    while True:
        entries = await asyncio.to_thread(conntrack, node1, PORT)
        open_ = [e for e in entries if " ESTABLISHED " in e]
        if entries and not open_:
            break
        assert time.monotonic() < deadline, f"conntrack did not see the connections close: {entries}"
        await asyncio.sleep(0.2)


async def test_a_connection_with_another_nodes_pod_is_carried_on_both_nodes(lab: Lab):
    node1, node2 = lab.nodes
    before = [(await asyncio.to_thread(fast_path, n))["packets"].get("carried", 0) for n in (node1, node2)]
    result = await iperf(lab, "far", "-n", "200M")
    assert result["end"]["sum_received"]["bytes"] >= 200_000_000
    # node2 carries far's data out (routed: FIB, TTL - 1) and the server's ACKs in; node1 the
    # data in and the ACKs out.
    assert await carried_after(node2, before[1] + 50_000) > before[1]
    assert await carried_after(node1, before[0] + 50_000) > before[0]
    for node in (node1, node2):
        deadline = time.monotonic() + 5
        while True:
            entries = await asyncio.to_thread(conntrack, node, PORT)
            if entries and not [e for e in entries if " ESTABLISHED " in e]:
                break
            assert time.monotonic() < deadline, f"{node.name}: conntrack did not see the connections close: {entries}"
            await asyncio.sleep(0.2)


async def test_a_denied_pod_stays_denied(lab: Lab):
    server = pod(lab, "server")
    proc = server.ns.popen(["iperf3", "-s", "-p", str(PORT)], stdout=asyncio.subprocess.DEVNULL,
                           stderr=asyncio.subprocess.DEVNULL)
    try:
        await asyncio.sleep(0.3)
        probe = f"import socket; socket.create_connection(({server.ip!r}, {PORT}), 1.0); print('connected')"
        rc, out, _err = await pod(lab, "other").ns.aexec(sys.executable, "-c", probe, check=False, timeout=10)
        assert rc != 0 and b"connected" not in out, "a pod the policy denies connected"
        rc, out, _err = await pod(lab, "client").ns.aexec(sys.executable, "-c", probe, check=False, timeout=10)
        assert rc == 0 and b"connected" in out, "the allowed pod could not connect"
    finally:
        proc.kill()
        proc.wait()


async def test_a_connection_keeps_flowing_through_an_agent_restart(lab: Lab):
    node1 = lab.nodes[0]
    running = asyncio.ensure_future(iperf(lab, "client", "-t", "6"))
    await asyncio.sleep(1.5)
    before = (await asyncio.to_thread(fast_path, node1))["packets"]["carried"]
    await node1.kill_agent()  # SIGKILL: the program and its maps stay in the kernel
    await asyncio.sleep(1.0)
    node1.start_agent()
    await lab.ready.agents_started(60)
    result = await running
    intervals = [i["sum"]["bits_per_second"] for i in result["intervals"]]
    assert min(intervals) > 0, f"the connection stalled around the restart: {intervals}"
    view = await asyncio.to_thread(fast_path, node1)
    assert view["on"] and view["adopted_maps"] and view["pods"] == 3, view
    assert await carried_after(node1, before) > before  # the counters too were adopted


async def test_leave_takes_the_fast_path_away(lab: Lab):
    node1 = lab.nodes[0]
    pins = Path((await asyncio.to_thread(fast_path, node1))["pins"])
    await node1.leave()
    deadline = time.monotonic() + 20
    while node1.agent_pid() is not None:
        assert time.monotonic() < deadline, "the agent did not exit after leave"
        await asyncio.sleep(0.1)
    assert not list(pins.glob("agentd_pod*")) if pins.exists() else True
    liberal = await asyncio.to_thread(node1.ns.exec, "cat", "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal")
    assert liberal.strip() == "0"  # as the agent found it
    check = ("import socket; from agentd.dataplane.bpf import tc; "
             "print(sum(f.ours for i, _ in socket.if_nameindex() for f in tc.filters(i)))")
    left = await asyncio.to_thread(node1.ns.exec, sys.executable, "-c", check)
    assert left.strip() == "0", f"our programs are still on {left.strip()} hooks of node1's devices"
