"""The user-space data plane between two hosts in namespaces: pods reach each other over the
flannel-UDP and user-space IPIP paths, the wire carries exactly the inner packets, outsiders are
dropped and counted, unknown destinations get ICMP net-unreachable, the no-offload fallback
works, and a controller can go away and come back (a worker that died is replaced by one
that starts from its saved table; one that stops cleanly leaves no file behind)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import struct
import subprocess
import sys

import pytest

from dualstack_hosts import SINK, SOURCE, transfer

from agentd.dataplane import DataplaneClient, DataplaneError, DataplaneProcess
from agentd.lab.twohosts import (
    CLUSTER,
    DEVICE,
    H1_UNDERLAY,
    H2_UNDERLAY,
    OVERHEAD,
    P1,
    P1_6,
    P2,
    P2_6,
    SUBNET1,
    SUBNET1_6,
    SUBNET2,
    SUBNET2_6,
    X_UNDERLAY,
    build_two_hosts,
    wait_for,
)
from agentd.lab.wait import apause, auntil
from proto import packet as P

pytestmark = pytest.mark.timeout(120)
CLUSTER_6 = "fd00:10:244::/48"
# A subnet the outsider x is given as a member (and a pod of it): what it may send from.
X_SUBNET, X_POD = "10.244.7.0/24", "10.244.7.5"


class Pair:
    def __init__(self, topo, kind, procs, clients, controls):
        self.topo, self.kind, self.procs, self.clients, self.controls = topo, kind, procs, clients, controls

    async def stop(self):
        for c in self.clients.values():
            await c.close()
        for p in self.procs.values():
            await p.stop()


async def start_pair(netns_factory, tmp_path, kind, *, offload=True, extra=(), orphan_timeout=120.0,
                     ipv6=False) -> Pair:
    """Two hosts whose workers carry the pods' traffic; ``ipv6``: dual-stack pods, both
    families routed into the TUN and through the workers' next-hop tables."""
    topo = build_two_hosts(netns_factory, ipv6=ipv6)
    mtu = topo.underlay_mtu - OVERHEAD[kind]
    topo.set_pod_mtu(mtu)
    procs, clients, controls = {}, {}, {}
    for i, local, peer, peer_subnet in ((1, H1_UNDERLAY, H2_UNDERLAY, SUBNET2), (2, H2_UNDERLAY, H1_UNDERLAY, SUBNET1)):
        controls[i] = str(tmp_path / f"{kind}-{i}.sock")
        procs[i] = await DataplaneProcess.start(kind, DEVICE[kind], mtu, local, 8285, controls[i],
                                                offload=offload, netns=topo.host(i).name, extra_args=extra,
                                                orphan_timeout=orphan_timeout)
        # The agent's route programmer would do this; the whole cluster range goes to the TUN.
        topo.host(i).ip("route", "add", CLUSTER, "dev", DEVICE[kind])
        hops = {peer_subnet: peer}
        if ipv6:
            topo.host(i).ip("-6", "route", "add", CLUSTER_6, "dev", DEVICE[kind])
            hops[SUBNET1_6 if i == 2 else SUBNET2_6] = peer
        clients[i] = await DataplaneClient.connect(controls[i])
        await clients[i].set_next_hops(hops)
        await clients[i].set_members([peer])
    return Pair(topo, kind, procs, clients, controls)


def ping(ns, dst, count=3, extra=()):
    return ns.exec("ping", "-c", str(count), "-i", "0.2", "-W", "2", *extra, dst, check=False)


def tcp_transfer(src_ns, dst_ns, dst_ip, nbytes=16 << 20):
    """Send ``nbytes`` over TCP from src_ns to dst_ip (IPv4 or IPv6); both ends report length
    and SHA-256, which must agree."""
    sent, got = transfer(src_ns, dst_ns, dst_ip, nbytes)
    assert sent == got and int(got[0]) == nbytes
    return got


def read_pcap(path):
    """Packets of a pcap file (link type EN10MB or LINUX_SLL2) as IPv4 bytes."""
    with open(path, "rb") as f:
        data = f.read()
    magic, _, _, _, _, snap, linktype = struct.unpack_from("<IHHiIII", data, 0)
    assert magic == 0xA1B2C3D4
    skip = {1: 14, 276: 20, 113: 16}[linktype]
    off, out = 24, []
    while off + 16 <= len(data):
        _, _, incl, _ = struct.unpack_from("<IIII", data, off)
        frame = data[off + 16 : off + 16 + incl]
        off += 16 + incl
        if len(frame) > skip and frame[skip] >> 4 == 4:
            out.append(frame[skip:])
    return out


PYTHON_PATH = ("--fast-path", "python")
# Each user-space path with its loops in C (the default where built) and in Python (the fall-back).
BOTH_PATHS = pytest.mark.parametrize("kind, extra", [("udp", ()), ("udp", PYTHON_PATH), ("ipip", ()),
                                                     ("ipip", PYTHON_PATH)],
                                     ids=["udp", "udp-python", "ipip", "ipip-python"])


@pytest.mark.parametrize("kind, extra", [("udp", ()), ("udp", PYTHON_PATH), ("udp", ("--segmentation", "kernel")),
                                         ("ipip", ()), ("ipip", PYTHON_PATH)],
                         ids=["udp", "udp-python", "udp-kernel-segmentation", "ipip", "ipip-python"])
async def test_pods_reach_each_other_and_the_wire_carries_the_inner_packets(netns_factory, tmp_path, kind, extra):
    pair = await start_pair(netns_factory, tmp_path, kind, extra=extra)
    t = pair.topo
    try:
        pcap = str(tmp_path / "u2.pcap")
        flt = "udp port 8285" if kind == "udp" else "ip proto 4"
        dump = t.h2.popen(["tcpdump", "-i", "u2", "-n", "-U", "-s", "2000", "-c", "6", "-w", pcap, flt],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            assert "listening" in dump.stderr.readline().decode()
            out = ping(t.p1, P2)
            assert " 0% packet loss" in out, out
            assert " 0% packet loss" in ping(t.p2, P1)
            dump.wait(timeout=30)
        finally:
            if dump.poll() is None:
                dump.kill()
                dump.wait()
            dump.stderr.close()

        packets = read_pcap(pcap)
        assert packets, "tcpdump captured nothing"
        for pkt in packets:
            outer, payload = P.split_ipv4(pkt)
            assert outer.df, "the underlay must never fragment (DF set)"
            if kind == "udp":
                assert outer.protocol == P.IPPROTO_UDP
                udp = P.UdpHeader.decode(payload)
                assert 8285 in (udp.dst_port, udp.src_port)
                inner_raw = bytes(payload[8:udp.length])
            else:
                assert outer.protocol == P.IPPROTO_IPIP and outer.ttl == 64
                inner_raw = bytes(P.ipip_decapsulate(pkt)[1])
            inner, _ = P.split_ipv4(inner_raw)
            # Exactly one inner packet, nothing else in the payload.
            assert inner.total_length == len(inner_raw)
            assert {inner.src, inner.dst} == {P1, P2} and inner.protocol == P.IPPROTO_ICMP
            assert P.ipv4_header_checksum_ok(inner_raw)
            assert {outer.src, outer.dst} == {H1_UNDERLAY, H2_UNDERLAY}

        # Every inner TCP segment on the wire is complete and valid (user-space TSO computes
        # the IP and TCP checksums: a kernel ipip or flannel peer verifies them), no larger
        # than the inner MTU, one per outer datagram, DF set.
        pcap_tcp = str(tmp_path / "u2-tcp.pcap")
        dump = t.h2.popen(["tcpdump", "-i", "u2", "-n", "-U", "-s", "65535", "-c", "400", "-w", pcap_tcp, flt],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            assert "listening" in dump.stderr.readline().decode()
            tcp_transfer(t.p1, t.p2, P2)
            # A veth carries GSO sends whole, so 400 captures may be more than there were.
            if not wait_for(lambda: dump.poll() is not None, 2):
                dump.terminate()
            dump.wait(timeout=10)
        finally:
            if dump.poll() is None:
                dump.kill()
                dump.wait()
            dump.stderr.close()
        mtu = t.underlay_mtu - OVERHEAD[kind]
        data_segments = 0
        for pkt in read_pcap(pcap_tcp):
            outer, payload = P.split_ipv4(pkt)
            assert outer.df and P.ipv4_header_checksum_ok(pkt)
            if kind == "udp":
                # A veth passes a UDP GSO send unsegmented (a NIC or the kernel cuts it every
                # gso_size bytes): all inner packets but the last are exactly that long, so
                # each datagram on a real wire carries exactly one.
                stream = bytes(payload[8 : P.UdpHeader.decode(payload).length])
                inners = []
                while stream:
                    inners.append(stream[: (stream[2] << 8) | stream[3]])
                    stream = stream[len(inners[-1]) :]
                assert len({len(x) for x in inners[:-1]}) <= 1 and len(inners[-1]) <= len(inners[0])
            else:
                inners = [bytes(payload)]
            for inner_raw in inners:
                inner, seg = P.split_ipv4(inner_raw)
                assert inner.total_length == len(inner_raw) <= mtu and inner.protocol == P.IPPROTO_TCP
                assert P.ipv4_header_checksum_ok(inner_raw) and P.transport_checksum_ok(inner_raw), inner
                data_segments += len(seg) > 40
        assert data_segments > 100
        tcp_transfer(t.p2, t.p1, P1, 4 << 20)
        s1, s2 = await pair.clients[1].stats(), await pair.clients[2].stats()
        assert s1["tx_packets"] > 10000 and s2["rx_packets"] >= s1["tx_packets"] * 0.99
        assert s1["tx_syscalls"] < s1["tx_packets"] / 5, "sends must be batched"
        assert s2["coalesced_segments"] > s2["rx_packets"] / 2, "receive side must coalesce"
        fast = "c" if not extra else "python"
        assert s1["fast_path"] == s2["fast_path"] == fast and s1["offloads"]["c_fast_path"] == (fast == "c")
        if "--segmentation" not in extra:
            # Super-packets are read into segment slots and segmented by the vectorized pass;
            # GRO reads / recvmmsg batches are checked and merged as whole batches.
            assert s1["tso_segments"] > 10000 and s1["offloads"]["tun_tso"]
            assert s1["tso_batches"] > 0 and s1["tso_gathered"] <= 2 and s2["coalesced_batches"] > 0
        if kind == "udp" and "--segmentation" not in extra:
            assert s1["offloads"]["udp_gso"] and s2["offloads"]["udp_gro"]
        if kind == "ipip":
            assert s1["offloads"]["sendmmsg"] and s2["offloads"]["recvmmsg"]
        assert s1["drops"]["malformed"] == s2["drops"]["malformed"] == 0
        # Every segment a worker sent verifies where it is received (none taken for corrupted).
        assert s1["rx_csum_errors"] == s2["rx_csum_errors"] == 0
    finally:
        await pair.stop()


@BOTH_PATHS
async def test_concurrent_flows_both_ways_arrive_intact(netns_factory, tmp_path, kind, extra):
    """Several TCP flows at once, both directions, while pinging: batches then hold segments of
    different flows and super-packets side by side, which the vectorized paths must cut
    exactly where GRO would (any byte out of place fails the SHA-256 comparison)."""
    pair = await start_pair(netns_factory, tmp_path, kind, extra=extra)
    t = pair.topo
    try:
        pinger = t.p1.popen(["ping", "-c", "40", "-i", "0.05", "-s", "1200", P2],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        flows = [(t.p1, t.p2, P2, 5001, 12 << 20), (t.p1, t.p2, P2, 5002, 6 << 20), (t.p2, t.p1, P1, 5003, 8 << 20)]
        sinks = [dst.popen([sys.executable, "-c", SINK, "4", str(port)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for _src, dst, _ip, port, _n in flows]
        sources = []
        try:
            for sink in sinks:
                assert sink.stdout.readline().strip() == "ready"
            sources = [src.popen([sys.executable, "-c", SOURCE, ip, str(n), str(port)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                       for src, _dst, ip, port, n in flows]
            sent = [s.communicate(timeout=120)[0].split() for s in sources]
            got = [k.communicate(timeout=60)[0].split() for k in sinks]
            pinged = pinger.communicate(timeout=60)[0]
        finally:
            for proc in [*sinks, *sources, pinger]:
                if proc.poll() is None:
                    proc.kill()
                proc.communicate()
        assert sent == got and [int(g[0]) for g in got] == [n for *_, n in flows]
        # The pings only mix ICMP into the batches: with ~26 MB of TCP saturating the user-space
        # workers some echoes may be dropped (a full queue), which says nothing about the flows;
        # at least half of the 40 must still come back.
        received = re.search(r"(\d+) received", pinged)
        assert received and int(received.group(1)) >= 20, pinged
        s1, s2 = await pair.clients[1].stats(), await pair.clients[2].stats()
        assert s1["drops"]["malformed"] == s2["drops"]["malformed"] == 0
        assert s1["rx_csum_errors"] == s2["rx_csum_errors"] == 0
        assert s2["coalesced_batches"] > 0 and s1["tso_batches"] > 0
    finally:
        await pair.stop()


@BOTH_PATHS
async def test_outsiders_are_dropped_and_counted(netns_factory, tmp_path, kind, extra):
    pair = await start_pair(netns_factory, tmp_path, kind, extra=extra)
    t = pair.topo
    try:
        inner = P.tcp_packet(P1, P2, P.TcpHeader(40000, 9, 1, 0, P.TCP_SYN, 1000))
        with t.x.entered():
            if kind == "udp":
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.bind((X_UNDERLAY, 8285))
            else:
                s = socket.socket(socket.AF_INET, socket.SOCK_RAW, P.IPPROTO_IPIP)
        with s:
            target = (H2_UNDERLAY, 8285 if kind == "udp" else 0)
            before = await pair.clients[2].stats()
            for _ in range(5):
                s.sendto(inner, target)

            async def stats_when(check):
                async def probe():
                    stats = await pair.clients[2].stats()
                    return check(stats) and stats
                return await auntil(probe, what="the worker's counters")

            after = await stats_when(lambda st: st["drops"]["non_member"] - before["drops"]["non_member"] >= 5)
            assert after["drops"]["non_member"] - before["drops"]["non_member"] == 5
            assert after["rx_packets"] == before["rx_packets"]
            # A member may send only what routes back to it: x, made a member, still cannot pose
            # as h1's pod (P1) nor as h2 itself (its TUN takes local sources): dropped as spoofed.
            await pair.clients[2].set_members([H1_UNDERLAY, X_UNDERLAY])
            for src in (P1, H2_UNDERLAY):
                forged = P.tcp_packet(src, P2, P.TcpHeader(40000, 9, 1, 0, P.TCP_SYN, 1000))
                for _ in range(5):
                    s.sendto(forged, target)
            spoofed = await stats_when(lambda st: st["drops"]["spoofed"] - after["drops"]["spoofed"] >= 10)
            assert spoofed["drops"]["spoofed"] - after["drops"]["spoofed"] == 10
            assert spoofed["rx_packets"] == after["rx_packets"] and spoofed["drops"]["non_member"] == after["drops"]["non_member"]
            # Given a subnet of its own, its pods' packets are accepted: membership and the source
            # are the reasons.
            await pair.clients[2].set_next_hops({SUBNET1: H1_UNDERLAY, X_SUBNET: X_UNDERLAY})
            own = P.tcp_packet(X_POD, P2, P.TcpHeader(40000, 9, 1, 0, P.TCP_SYN, 1000))
            for _ in range(5):
                s.sendto(own, target)
            accepted = await stats_when(lambda st: st["rx_packets"] - after["rx_packets"] >= 5)
            assert accepted["rx_packets"] - after["rx_packets"] == 5
            assert accepted["drops"]["non_member"] == after["drops"]["non_member"]
            assert accepted["drops"]["spoofed"] == spoofed["drops"]["spoofed"]
    finally:
        await pair.stop()


def tcp_mib(ns, field: str) -> int:
    """A field of the Tcp line of ``ns``'s /proc/net/snmp (IPv4 and IPv6 count there alike)."""
    names, values = (line.split() for line in ns.exec("cat", "/proc/net/snmp").splitlines()
                     if line.startswith("Tcp:"))
    return int(values[names.index(field)])


@pytest.mark.parametrize("extra", [(), PYTHON_PATH], ids=["c", "python"])
async def test_a_segment_corrupted_on_the_way_is_not_merged_and_the_pod_drops_it(netns_factory, tmp_path, extra):
    """flannel's outer IPv4 UDP checksum may be 0: nothing checks a segment corrupted on the way
    but the receiver.  A run of eight TCP segments (IPv4, then IPv6), the fourth with one
    payload byte changed, arrives as one UDP GSO message (one GRO read): the worker merges the
    three before it and the four after it, writes it on its own without claiming a valid
    checksum and counts it, and the pod's TCP finds it bad and drops it (InCsumErrors), where a
    merged super-packet with a checksum made afresh would have passed as good data."""
    pair = await start_pair(netns_factory, tmp_path, "udp", extra=extra, ipv6=True)
    t = pair.topo
    try:
        # x sends h1's pod's segments: as a member that holds h1's subnets (the reverse-path
        # check takes an inner source only from the member its subnet routes to).
        await pair.clients[2].set_members([H1_UNDERLAY, X_UNDERLAY])
        await pair.clients[2].set_next_hops({SUBNET1: X_UNDERLAY, SUBNET1_6: X_UNDERLAY})
        with t.x.entered():
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((X_UNDERLAY, 8285))
        with s:
            before = await pair.clients[2].stats()
            errors = tcp_mib(t.p2, "InCsumErrors")
            for make, src, dst in ((P.tcp_packet, P1, P2), (P.tcp6_packet, P1_6, P2_6)):
                segs = [bytes(make(src, dst, P.TcpHeader(40000, 9, 1 + i * 1000, 1, P.TCP_ACK, 1000), bytes([i]) * 1000))
                        for i in range(8)]
                bad = bytearray(segs[3])
                bad[-5] ^= 0x40
                segs[3] = bytes(bad)
                s.setsockopt(17, 103, len(segs[0]))  # SOL_UDP, UDP_SEGMENT: one datagram per segment
                s.sendto(b"".join(segs), (H2_UNDERLAY, 8285))

            async def received():
                st = await pair.clients[2].stats()
                return st["rx_packets"] - before["rx_packets"] >= 16 and st

            after = await auntil(received, what="the worker to receive both runs")
            assert after["rx_csum_errors"] - before["rx_csum_errors"] == 2
            assert after["coalesced_segments"] - before["coalesced_segments"] == 14
            await auntil(lambda: tcp_mib(t.p2, "InCsumErrors") - errors >= 2, what="the pod's TCP to drop both")
            assert tcp_mib(t.p2, "InCsumErrors") - errors == 2
    finally:
        await pair.stop()


@BOTH_PATHS
async def test_unknown_destination_gets_net_unreachable(netns_factory, tmp_path, kind, extra):
    pair = await start_pair(netns_factory, tmp_path, kind, extra=extra)
    try:
        out = ping(pair.topo.p1, "10.244.3.5", count=2)
        assert "Destination Net Unreachable" in out, out
        stats = await pair.clients[1].stats()
        assert stats["drops"]["no_route"] >= 2 and stats["icmp_sent"] >= 2
    finally:
        await pair.stop()


@pytest.mark.parametrize("extra", [(), PYTHON_PATH], ids=["c", "python"])
async def test_udp_decrements_the_inner_ttl_and_answers_time_exceeded(netns_factory, tmp_path, extra):
    """flannel's UDP backend is a router hop: TTL 2 leaves the pod, the host's kernel makes it
    1, the worker would make it 0 and answers with ICMP time exceeded instead.  TTL 4 arrives
    (h1, the worker and h2 each take one)."""
    pair = await start_pair(netns_factory, tmp_path, "udp", extra=extra)
    try:
        out = ping(pair.topo.p1, P2, count=2, extra=("-t", "2"))
        assert "Time to live exceeded" in out, out
        assert " 0% packet loss" in ping(pair.topo.p1, P2, count=2, extra=("-t", "4"))
        stats = await pair.clients[1].stats()
        assert stats["drops"]["ttl_exceeded"] >= 2 and stats["icmp_sent"] >= 2
    finally:
        await pair.stop()


def ping6(ns, dst, count=3, extra=()):
    return ns.exec("ping", "-6", "-n", "-c", str(count), "-i", "0.2", "-W", "2", *extra, dst, check=False)


def inner_packets(pkt: bytes) -> list[bytes]:
    """The inner packets of one captured udp datagram (outer IPv4): one on a real wire; a veth
    passes a UDP GSO send whole, then they are back to back, each as long as its IP header says."""
    _outer, payload = P.split_ipv4(pkt)
    stream, out = bytes(payload[8 : P.UdpHeader.decode(payload).length]), []
    while stream:
        n = (stream[4] << 8 | stream[5]) + 40 if stream[0] >> 4 == 6 else stream[2] << 8 | stream[3]
        out.append(stream[:n])
        stream = stream[n:]
    return out


@pytest.mark.parametrize("extra", [(), PYTHON_PATH], ids=["c", "python"])
async def test_udp_worker_carries_ipv6_pods(netns_factory, tmp_path, extra):
    """Dual-stack pods over the flannel-UDP worker, its loops in C and in Python: IPv6 both
    ways beside IPv4; TCP over IPv6 segmented in user space into inner packets a kernel
    receiver takes (payload length per segment, the TCP checksum over the IPv6 pseudo header,
    no larger than the pod MTU, the hop limit decremented once), the receiving worker merging
    them back into super-packets; ICMPv6 errors for an unrouted destination and an exhausted
    hop limit, as a router sends them (RFC 4443)."""
    pair = await start_pair(netns_factory, tmp_path, "udp", extra=extra, ipv6=True)
    t = pair.topo
    mtu = t.underlay_mtu - OVERHEAD["udp"]
    try:
        for src, dst in ((t.p1, P2_6), (t.p2, P1_6), (t.p1, P2)):
            out = ping6(src, dst) if ":" in dst else ping(src, dst)
            assert " 0% packet loss" in out, out

        pcap = str(tmp_path / "u2-tcp6.pcap")
        dump = t.h2.popen(["tcpdump", "-i", "u2", "-n", "-U", "-s", "65535", "-c", "300", "-w", pcap,
                           "udp port 8285"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            assert "listening" in dump.stderr.readline().decode()
            tcp_transfer(t.p1, t.p2, P2_6)
            if not wait_for(lambda: dump.poll() is not None, 2):  # GSO sends may make 300 more than there were
                dump.terminate()
            dump.wait(timeout=10)
        finally:
            if dump.poll() is None:
                dump.kill()
                dump.wait()
            dump.stderr.close()
        data_segments = 0
        for pkt in read_pcap(pcap):
            for inner_raw in inner_packets(pkt):
                if inner_raw[0] >> 4 != 6:
                    continue
                inner, seg = P.split_ipv6(inner_raw)
                assert 40 + inner.payload_length == len(inner_raw) <= mtu and inner.next_header == P.IPPROTO_TCP
                assert P.transport_checksum_ok(inner_raw), inner
                if inner.src == P1_6:
                    assert inner.hop_limit == 62  # p1's 64: h1's kernel and the worker take one each
                    data_segments += len(seg) > 32  # more than the TCP header with timestamps
        assert data_segments > 100
        tcp_transfer(t.p2, t.p1, P1_6, 4 << 20)

        s1, s2 = await pair.clients[1].stats(), await pair.clients[2].stats()
        assert s1["tx_packets"] > 10000 and s2["rx_packets"] >= s1["tx_packets"] * 0.99
        assert s1["tso_segments"] > 10000 and s2["coalesced_segments"] > s2["rx_packets"] / 2
        assert s1["fast_path"] == ("python" if extra else "c")
        assert s1["drops"]["malformed"] == s2["drops"]["malformed"] == s1["drops"]["not_ipv4"] == 0

        out = ping6(t.p1, "fd00:10:244:9::5", count=2)
        assert "No route" in out, out
        out = ping6(t.p1, P2_6, count=2, extra=("-t", "2"))
        assert "Time exceeded: Hop limit" in out, out
        s1 = await pair.clients[1].stats()
        assert s1["drops"]["no_route"] >= 2 and s1["drops"]["ttl_exceeded"] >= 2 and s1["icmp_sent"] >= 4
    finally:
        await pair.stop()


@pytest.mark.parametrize("kind", ["udp", "ipip"])
async def test_no_offload_fallback_still_forwards_and_says_so(netns_factory, tmp_path, kind):
    pair = await start_pair(netns_factory, tmp_path, kind, offload=False)
    t = pair.topo
    try:
        assert " 0% packet loss" in ping(t.p1, P2)
        tcp_transfer(t.p1, t.p2, P2, 4 << 20)
        s1, s2 = await pair.clients[1].stats(), await pair.clients[2].stats()
        assert not any(s1["offloads"].values()) and not any(s2["offloads"].values())
        assert all("--no-offload" in reason for reason in s1["fallbacks"].values())
        assert set(s1["fallbacks"]) >= {"tun_tso", "tun_coalesce"}
        # One send per packet, one TUN write per packet: the per-packet baseline.
        assert s1["tx_syscalls"] == s1["tx_packets"] and s2["tun_writes"] >= s2["rx_packets"]
        assert s1["tso_segments"] == 0 and s2["coalesced_segments"] == 0
    finally:
        await pair.stop()


async def test_reattach_and_worker_restart_keep_the_table(netns_factory, tmp_path):
    pair = await start_pair(netns_factory, tmp_path, "udp")
    t = pair.topo
    try:
        # The agent goes away: forwarding goes on with the last table.
        for c in pair.clients.values():
            await c.close()
        assert " 0% packet loss" in ping(t.p1, P2)
        again = await DataplaneClient.connect(pair.controls[1])
        got = await again.get()
        assert got["next_hops"] == {SUBNET2: H2_UNDERLAY} and got["members"] == [H2_UNDERLAY]
        assert (await again.stats())["controllers"] == 1
        await again.close()

        # The worker dies: the persistent TUN (and the kernel route through it) stays and a new
        # worker starts from the saved table.
        state = pair.controls[1] + ".state"
        assert os.path.exists(state)
        os.killpg(pair.procs[1].pid, signal.SIGKILL)
        assert await asyncio.wait_for(pair.procs[1].wait(), 10) == -signal.SIGKILL
        assert os.path.exists(state)
        assert "agentd.udp" in t.h1.ip("-o", "link", "show", "agentd.udp").stdout.decode()
        assert CLUSTER in t.h1.ip("route", "show").stdout.decode()
        pair.procs[1] = await DataplaneProcess.start("udp", "agentd.udp", 1472, H1_UNDERLAY, 8285,
                                                     pair.controls[1], netns=t.h1.name)
        fresh = await DataplaneClient.connect(pair.controls[1])
        assert (await fresh.get())["next_hops"] == {SUBNET2: H2_UNDERLAY}
        assert " 0% packet loss" in ping(t.p1, P2)

        # Bad requests get one clear error and change nothing.
        with pytest.raises(DataplaneError, match="bad next hop"):
            await fresh.set_next_hops({"10.244.9.1/24": H2_UNDERLAY})
        with pytest.raises(DataplaneError, match="bad member"):
            await fresh.set_members(["not-an-address"])
        assert (await fresh.get())["next_hops"] == {SUBNET2: H2_UNDERLAY}

        # An explicit shutdown with remove_device takes the TUN away, and the state file.
        await fresh.shutdown(remove_device=True)
        await fresh.close()
        assert await asyncio.wait_for(pair.procs[1].wait(), 10) == 0
        assert wait_for(lambda: t.h1.ip("link", "show", "agentd.udp", check=False).returncode != 0, 5)
        assert not os.path.exists(state) and not os.path.exists(pair.controls[1])

        # A worker stopped cleanly (SIGTERM) keeps its TUN but leaves no file behind: neither
        # its control socket nor its state file.
        state2 = pair.controls[2] + ".state"
        assert os.path.exists(state2) and os.path.exists(pair.controls[2])
        pair.clients = {}
        assert await pair.procs[2].stop() == 0
        assert not os.path.exists(state2) and not os.path.exists(pair.controls[2])
        assert "agentd.udp" in t.h2.ip("-o", "link", "show", "agentd.udp").stdout.decode()
    finally:
        await pair.stop()


async def test_orphaned_worker_exits(netns_factory, tmp_path):
    h = netns_factory("h")
    h.ip("link", "add", "u1", "type", "veth", "peer", "name", "u2")
    h.ip("addr", "add", f"{H1_UNDERLAY}/24", "dev", "u1")
    h.ip("link", "set", "u1", "up")
    proc = await DataplaneProcess.start("ipip", "agentd.ipip", 1480, H1_UNDERLAY, 8285, str(tmp_path / "c.sock"),
                                        netns=h.name, orphan_timeout=1.0)
    try:
        c = await DataplaneClient.connect(proc.control_path)
        await c.set_next_hops({SUBNET2: H2_UNDERLAY})  # saved to the state file
        assert os.path.exists(proc.control_path + ".state")
        await apause(1.5, "longer than orphan_timeout (1 s): a connected controller keeps it alive")
        assert proc.returncode is None
        await c.close()
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert not os.path.exists(proc.control_path)
        assert not os.path.exists(proc.control_path + ".state")  # an exit on its own is a clean stop
    finally:
        await proc.stop()


async def test_worker_start_errors_are_one_clear_line(netns_factory, tmp_path):
    h = netns_factory("h")
    bad = [
        (["udp", "--mtu", "1472", "--local-ip", "300.1.1.1", "--control", "x"], "not an IPv4 address"),
        (["udp", "--mtu", "10", "--local-ip", "10.0.0.1", "--control", "x"], "MTU must be"),
        (["gre", "--mtu", "1400", "--local-ip", "10.0.0.1", "--control", "x"], "invalid choice"),
        (["udp", "--tun", "a-very-long-device-name", "--mtu", "1400", "--local-ip", "10.0.0.1", "--control", "x"],
         "bad interface name"),
    ]
    for args, msg in bad:
        r = subprocess.run([sys.executable, "-m", "agentd.dataplane", *args], capture_output=True, text=True)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    # The local address does not exist in the namespace: one line, exit 1, nothing left behind.
    with pytest.raises(DataplaneError, match="cannot open the udp socket on 10.9.9.9"):
        await DataplaneProcess.start("udp", "agentd.udp", 1472, "10.9.9.9", 8285, str(tmp_path / "c.sock"),
                                     netns=h.name)
