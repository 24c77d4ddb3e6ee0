"""Two dual-stack hosts (agentd.lab.twohosts with IPv6 pods) with the BPF data path carrying
both pod families by udp, routed as the agent routes them, and what the IPv6 tests of the
data path and the pod fast path do with them: ping6, captures of IPv4 and IPv6 frames, TCP
transfers checked end to end, iperf3 -6."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from ipaddress import IPv4Network, IPv6Network

import pytest

from agentd.dataplane.bpf import BpfDatapath, BpfUnavailable, Config, layout, tc
from agentd.dataplane.bpf.datapath import gateway6
from agentd.lab.twohosts import (
    H1_UNDERLAY,
    H2_UNDERLAY,
    OVERHEAD,
    P1_6,
    P2_6,
    SUBNET1,
    SUBNET1_6,
    SUBNET2,
    SUBNET2_6,
    build_two_hosts,
    wait_for,
)

FLAGS = layout.CFG_DECAP_UDP | layout.CFG_DECAP_IPIP | layout.CFG_FILTER_VXLAN | layout.CFG_DECAP_L3_FLAG \
    | layout.CFG_DECAP_L4_FLAGS
HOOKS = ["tcx", "clsact"]


def usable(hook: str) -> bool:
    """Whether ``hook`` can run on this kernel (tcx: Linux 6.6); where it cannot, the tests of
    that hook check that asking for it is refused, saying why (:func:`refused`).  That tcx is
    there where it should be is test_bpf_datapath's test_tcx_is_available_from_linux_6_6."""
    return hook != "tcx" or tc.tcx_available()


TCX_REFUSED = r'^\[network\] bpf_attach = "tcx": this kernel has no tcx hooks \(Linux 6\.6 '


def refused(make: Callable[[], object]) -> None:
    """``make()`` (which asks for tcx on a kernel without it) fails with the reason."""
    with pytest.raises(BpfUnavailable, match=TCX_REFUSED):
        make()


class Pair6:
    """Both hosts with dual-stack pods and the BPF data path carrying both families by udp,
    routed as the agent routes them: IPv4 via the underlay next hop, IPv6 via the peer's
    IPv4-mapped address (onlink), whose neighbour entry the data path keeps."""

    def __init__(self, topo, bpf_dir: str, hook: str) -> None:
        self.t, self.bpf_dir, self.hook = topo, bpf_dir, hook
        self.dp: dict[int, BpfDatapath] = {}
        self.mtu = topo.underlay_mtu - OVERHEAD["udp"]
        topo.set_pod_mtu(self.mtu)
        for i, dev, peer, s4, s6 in ((1, "u1", H2_UNDERLAY, SUBNET2, SUBNET2_6), (2, "u2", H1_UNDERLAY, SUBNET1, SUBNET1_6)):
            host = topo.host(i)
            self.open(i)
            host.ip("route", "add", s4, "via", peer, "dev", dev, "mtu", str(self.mtu))
            host.ip("-6", "route", "add", s6, "via", gateway6(peer), "dev", dev, "onlink", "mtu", str(self.mtu))
        # Until the new links' IPv6 link-local addresses are past duplicate address detection
        # (about a second), neighbour discovery between pods and hosts waits: start after it.
        for src, dst in ((topo.p1, P2_6), (topo.p2, P1_6)):
            assert wait_for(lambda src=src, dst=dst: "1 received" in ping6(src, dst, count=1), 15), f"no IPv6 to {dst}"

    def routes(self, i: int) -> dict:
        peer, s4, s6 = (H2_UNDERLAY, SUBNET2, SUBNET2_6) if i == 1 else (H1_UNDERLAY, SUBNET1, SUBNET1_6)
        return {IPv4Network(s4): (peer, "udp"), IPv6Network(s6): (peer, "udp")}

    def open(self, i: int) -> BpfDatapath:
        host = self.t.host(i)
        local, peer = (H1_UNDERLAY, H2_UNDERLAY) if i == 1 else (H2_UNDERLAY, H1_UNDERLAY)
        with host.entered():
            dp = BpfDatapath(int(host.exec("cat", f"/sys/class/net/u{i}/ifindex")), self.bpf_dir, attach=self.hook)
            dp.open(Config(local, 8285, 4789, FLAGS, self.t.underlay_mtu))
            dp.set_gateways6({peer})
            dp.set_routes(self.routes(i))
            dp.set_members({peer})
        self.dp[i] = dp
        return dp

    def close(self) -> None:
        for dp in self.dp.values():
            dp.close()


@contextlib.contextmanager
def pairs(netns_factory, bpf_dir: str):
    """``make(hook)`` -> a new :class:`Pair6`; every pair's file descriptors closed at the end
    (the namespaces, and all in them, go with ``netns_factory``)."""
    made: list[Pair6] = []

    def make(hook: str = "auto") -> Pair6:
        pair = Pair6(build_two_hosts(netns_factory, ipv6=True), bpf_dir, hook)
        made.append(pair)
        return pair

    try:
        yield make
    finally:
        for pair in made:
            pair.close()


def ping6(ns, dst, count=3, interval="0.2"):
    return ns.exec("ping", "-6", "-n", "-c", str(count), "-i", interval, "-W", "2", dst, check=False)


def capture(ns, iface: str, flt: str, action, *, snap: int = 256, settle: float = 0.5) -> list[tuple[int, bytes, bytes]]:
    """(length on the wire, Ethernet header, IP packet) of every frame matching ``flt`` on
    ``iface`` while ``action`` runs, IPv4 and IPv6 alike."""
    fd, path = tempfile.mkstemp(suffix=".pcap")
    os.close(fd)
    proc = ns.popen(["tcpdump", "-i", iface, "-nn", "-U", "--immediate-mode", "-Z", "root", "-s", str(snap), "-w", path,
                     flt], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line, t0 = "", time.monotonic()
        while "listening on" not in line and time.monotonic() - t0 < 10:
            line = proc.stderr.readline()
        action()
        time.sleep(settle)  # what is still in flight
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
    try:
        with open(path, "rb") as f:
            data = f.read()
    finally:
        os.unlink(path)
    assert struct.unpack_from("<I", data)[0] == 0xA1B2C3D4 and struct.unpack_from("<I", data, 20)[0] == 1  # Ethernet
    off, out = 24, []
    while off + 16 <= len(data):
        _, _, incl, orig = struct.unpack_from("<IIII", data, off)
        frame = data[off + 16 : off + 16 + incl]
        off += 16 + incl
        out.append((orig - 14, frame[:14], frame[14:]))
    return out


def traffic_class(ip6: bytes) -> int:
    return (ip6[0] & 0x0F) << 4 | ip6[1] >> 4


def mac(ns, dev: str) -> bytes:
    return bytes.fromhex(ns.exec("cat", f"/sys/class/net/{dev}/address").strip().replace(":", ""))


# A transfer whose bytes are checked end to end (sha256 of what was sent and what arrived),
# over IPv4 or IPv6 by the destination address: SINK [4|6] [PORT], SOURCE ADDRESS BYTES [PORT].
SINK = """
import hashlib, socket, sys
family = socket.AF_INET6 if sys.argv[1] == "6" else socket.AF_INET
port = int(sys.argv[2]) if len(sys.argv) > 2 else 5001
s = socket.socket(family); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); h = hashlib.sha256(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    h.update(b); n += len(b)
print(n, h.hexdigest(), flush=True)
"""

SOURCE = """
import hashlib, os, socket, sys
n = int(sys.argv[2]); port = int(sys.argv[3]) if len(sys.argv) > 3 else 5001
h = hashlib.sha256(); s = socket.create_connection((sys.argv[1], port), timeout=30)
seed = os.urandom(1 << 16); sent = 0
while sent < n:
    chunk = hashlib.sha256(seed + sent.to_bytes(8, "big")).digest() * 2048   # 64 KB, never the same
    chunk = chunk[: n - sent]; s.sendall(chunk); h.update(chunk); sent += len(chunk)
s.close(); print(sent, h.hexdigest(), flush=True)
"""


def transfer(src_ns, dst_ns, dst_ip, nbytes):
    """``nbytes`` from ``src_ns`` to a sink on port 5001 in ``dst_ns`` at ``dst_ip``:
    (sent, got), each [count, sha256]."""
    version = "6" if ":" in dst_ip else "4"
    sink = dst_ns.popen([sys.executable, "-c", SINK, version], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        sent = src_ns.exec(sys.executable, "-c", SOURCE, dst_ip, str(nbytes), timeout=90).split()
        got = sink.communicate(timeout=60)[0].split()
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.communicate()
    return sent, got


transfer6 = transfer  # the name the IPv6 tests use


def csum_errors(ns) -> int:
    out = ns.exec("nstat", "-az", "TcpInCsumErrors", "Udp6InCsumErrors", "UdpInCsumErrors", "Ip6InHdrErrors",
                  "IpInHdrErrors")
    return sum(int(x.split()[1]) for x in out.splitlines()[1:] if x.split())


def iperf6(client, server, dst: str, *extra: str) -> dict:
    proc = server.popen(["iperf3", "-s", "-1", "-B", dst, "-p", "5201"], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: ":1451 " in server.exec("cat", "/proc/net/tcp6"), 10)  # 5201 = 0x1451, listening
        out = client.exec("iperf3", "-6", "-c", dst, "-p", "5201", "-t", "1", "-J", *extra, check=False, timeout=60)
    finally:
        proc.kill()
        proc.wait()
    result = json.loads(out or "{}")
    assert "error" not in result, result.get("error")
    return result


async def restart_under_ping(lab, node, pairs) -> tuple[list, list[str]]:
    """Kill ``node``'s agent and start it again while pings run between each (source pod,
    destination address) of ``pairs`` (each answering before); wait until the lab's sessions
    are back and the node is ready, and the pings answer again.  Returns each pinger's
    (sent, missing) and the lines ``ip -6 monitor route`` printed in the node meanwhile."""
    import asyncio

    from agentd.lab.traffic import Pinger
    from agentd.lab.wait import auntil

    monitor = await asyncio.create_subprocess_exec("ip", "-n", node.ns.name, "-6", "monitor", "route",
                                                   stdout=asyncio.subprocess.PIPE)
    pingers = [Pinger(src.ns, dst) for src, dst in pairs]
    try:
        for p in pingers:
            await asyncio.to_thread(p.wait_replies, 10)
        await node.kill_agent()
        node.start_agent()
        await lab.ready.established(60)
        await auntil(lambda: node.api("/status")["ready"], what=f"{node.name} ready again",
                     ignore=(OSError, ValueError), in_thread=True)
        for p in pingers:
            await asyncio.to_thread(p.wait_replies, 20, more=True)
        results = [p.stop() for p in pingers]
    finally:
        for p in pingers:
            p.close()
        monitor.kill()
        events, _ = await monitor.communicate()
    return results, events.decode().splitlines()


# A sink that takes exactly the given sizes, one connection each, and closes first (so the
# client's port is free again at once); a source that sends them from one source port.  The
# family is the address's: the sink listens on argv[1] ("0.0.0.0" or "::").  The sink greets
# each connection with one byte and the source sends only once it has it: by then the
# handshake's last ACK has reached the sink, so conntrack on every node between has the
# connection ESTABLISHED and the pod fast path carries every segment of the payload.  Sent
# straight after connect(), the first segments could overtake that ACK (it leaves from the
# core that took the SYN-ACK, the data from the sender's) and go the stack's way, counted by
# conntrack instead of the fast path.
SIZES_SINK = """
import socket, sys
fam = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
s = socket.socket(fam); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
print("ready", flush=True)
for size in map(int, sys.argv[3:]):
    c, _ = s.accept(); c.sendall(b"g"); got = 0
    while got < size:
        b = c.recv(1 << 20)
        if not b: break
        got += len(b)
    c.close(); print(got, flush=True)
"""
SIZES_SOURCE = """
import socket, sys
ip, port, sport = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for size in map(int, sys.argv[4:]):
    c = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET); c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    c.bind(("::" if ":" in ip else "0.0.0.0", sport))
    c.connect((ip, port)); assert c.recv(1) == b"g"; c.sendall(b"x" * size)
    while c.recv(65536): pass
    c.close()
"""
