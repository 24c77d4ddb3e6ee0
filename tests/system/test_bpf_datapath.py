"""The in-kernel (tc-BPF) data path between two hosts in namespaces, driven through
agentd.dataplane.bpf directly (the agent drives the same object; test_encap covers that):
pods reach each other over udp and ipip with the documented outer headers, TCP super-packets
cross the underlay whole, a 64 MiB transfer arrives intact (also with GSO and checksum offload
off), non-members are dropped and counted, a re-open adopts the pinned maps without losing a
packet, and remove() leaves no filter, pin, program or map behind.  Traffic, the re-open and
restarts on a busy device run with both hooks ([network] bpf_attach): tcx, and the clsact
qdisc with cls_bpf filters that kernels before 6.6 get.  An open -- of the data path or the
pod fast path -- that fails part-way (a pin it cannot make or replace, a read-only bpffs, a
hook someone else holds) says why in one BpfUnavailable and leaves none of its programs on
the hooks (the pod fast path: none of an earlier agent's either)."""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import struct
import subprocess
import tempfile
from collections.abc import Callable
from ipaddress import IPv4Network
from pathlib import Path
from typing import Any

import pytest

from dualstack_hosts import TCX_REFUSED, csum_errors, transfer

from agentd.dataplane.bpf import BpfDatapath, BpfUnavailable, Config, datapath, layout, libbpf, pin_dir, tc
from agentd.lab.twohosts import (
    H1_UNDERLAY,
    H2_UNDERLAY,
    OVERHEAD,
    P1,
    P2,
    SUBNET1,
    SUBNET2,
    X_UNDERLAY,
    build_two_hosts,
    wait_for,
)
from agentd.lab.traffic import Pinger
from agentd.lab.wait import until
from proto import packet as P

pytestmark = pytest.mark.timeout(120)

WIRE = {"udp": "udp port 8285", "ipip": "ip proto 4"}
FLAGS = layout.CFG_DECAP_UDP | layout.CFG_DECAP_IPIP | layout.CFG_FILTER_VXLAN | layout.CFG_DECAP_L3_FLAG \
    | layout.CFG_DECAP_L4_FLAGS


class BpfPair:
    """Both hosts of the two-host topology with the BPF data path on their underlay veth."""

    def __init__(self, topo, kind: str, bpf_dir: str, hook: str = "auto") -> None:
        self.t, self.kind, self.bpf_dir, self.hook = topo, kind, bpf_dir, hook
        self.dp: dict[int, BpfDatapath] = {}
        mtu = topo.underlay_mtu - OVERHEAD[kind]
        topo.set_pod_mtu(mtu)
        for i, dev, peer, subnet in ((1, "u1", H2_UNDERLAY, SUBNET2), (2, "u2", H1_UNDERLAY, SUBNET1)):
            # The agent's route for a BPF peer: via the underlay next hop, with the pod MTU.
            topo.host(i).ip("route", "add", subnet, "via", peer, "dev", dev, "mtu", str(mtu))
            self.open(i, {IPv4Network(subnet): (peer, kind)}, {peer})

    def ifindex(self, i: int) -> int:
        return int(self.t.host(i).exec("cat", f"/sys/class/net/u{i}/ifindex"))

    def open(self, i: int, routes, members) -> BpfDatapath:
        host = self.t.host(i)
        local = H1_UNDERLAY if i == 1 else H2_UNDERLAY
        with host.entered():  # netlink sockets and the pin directory name come from this thread
            dp = BpfDatapath(self.ifindex(i), self.bpf_dir, attach=self.hook)
            dp.open(Config(local, 8285, 4789, FLAGS, self.t.underlay_mtu))
            dp.set_routes(routes)
            dp.set_members(members)
        self.dp[i] = dp
        return dp

    def counters(self, i: int) -> dict:
        return self.dp[i].counters()

    def close(self) -> None:
        for dp in self.dp.values():
            dp.close()


@pytest.fixture
def pair_factory(netns_factory, bpffs):
    made = []

    def make(kind: str, hook: str = "auto", **kw) -> BpfPair:
        pair = BpfPair(build_two_hosts(netns_factory, **kw), kind, bpffs, hook)
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.close()


def ping(ns, dst, count=3, extra=()):
    return ns.exec("ping", "-c", str(count), "-i", "0.2", "-W", "2", *extra, dst, check=False)


class Packet:
    """One captured IPv4 packet: the outer header decoded, the rest as bytes."""

    def __init__(self, wire_len: int, ip: bytes) -> None:
        self.wire_len = wire_len  # as the device saw it (a GSO super-packet: all of it)
        self.ip = ip
        (vihl, self.tos, self.total, _id, frag, self.ttl, self.proto, _csum, src, dst) = struct.unpack_from(
            "!BBHHHBBH4s4s", ip)
        self.ihl = (vihl & 0xF) * 4
        self.df = bool(frag & 0x4000)
        self.src, self.dst = socket.inet_ntoa(src), socket.inet_ntoa(dst)
        self.header_ok = _csum16(ip[: self.ihl]) == 0

    def udp(self) -> tuple[int, int, int, bytes]:
        sport, dport, _length, csum = struct.unpack_from("!HHHH", self.ip, self.ihl)
        return sport, dport, csum, self.ip[self.ihl + 8 :]

    def inner(self) -> Packet:
        return Packet(0, self.udp()[3] if self.proto == 17 else self.ip[self.ihl :])


def _csum16(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def capture(ns, iface: str, flt: str, action, done: Callable[[list[Packet]], Any], *, snap: int = 256,
            timeout: float = 10.0) -> list[Packet]:
    """The IPv4 packets matching ``flt`` on ``iface`` from before ``action`` runs until
    ``done(packets so far)`` holds: the test says what it must have seen (the last packet of
    what it sent, a counter that shows the rest was dropped), not how long to wait for it."""
    fd, path = tempfile.mkstemp(suffix=".pcap")
    os.close(fd)
    proc = ns.popen(["tcpdump", "-i", iface, "-nn", "-U", "--immediate-mode", "-Z", "root", "-s", str(snap), "-w", path, flt],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "listening on" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, f"tcpdump exited with status {proc.returncode} before listening"
        action()
        until(lambda: done(_read_pcap(path)), timeout, what=lambda: f"the packets on {iface}: {_read_pcap(path)}")
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
        packets = _read_pcap(path)
        os.unlink(path)
    return packets


def _read_pcap(path: str) -> list[Packet]:
    """The IPv4 packets of a pcap file tcpdump may still be writing (a partial last record is left out)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 24:
        return []
    magic, _, _, _, _, _, linktype = struct.unpack_from("<IHHiIII", data, 0)
    assert magic == 0xA1B2C3D4
    skip = {1: 14, 276: 20, 113: 16}[linktype]
    off, out = 24, []
    while off + 16 <= len(data):
        _, _, incl, orig = struct.unpack_from("<IIII", data, off)
        if off + 16 + incl > len(data):
            break
        frame = data[off + 16 : off + 16 + incl]
        off += 16 + incl
        tag = 4 if linktype == 1 and frame[12:14] == b"\x81\x00" else 0  # an 802.1Q tag: skipped
        if len(frame) > skip + tag + 20 and frame[skip + tag] >> 4 == 4:
            out.append(Packet(orig - skip - tag, frame[skip + tag :]))
    return out


def usable(hook: str) -> bool:
    """Whether ``hook`` can run on this kernel (tcx: Linux 6.6); where it cannot, the tests of
    that hook check that asking for it is refused, saying why (and
    test_tcx_is_available_from_linux_6_6 that it is there where it should be)."""
    return hook != "tcx" or tc.tcx_available()


def refused(pair_factory, hook: str) -> None:
    with pytest.raises(BpfUnavailable, match=TCX_REFUSED):
        pair_factory("udp", hook=hook)


def _kernel_config(option: str) -> str | None:
    """``option``'s value in this kernel's configuration ("y", "m", "" when not set); None
    where the configuration cannot be read."""
    import gzip

    release = os.uname().release
    for path, opener in (("/proc/config.gz", gzip.open), (f"/boot/config-{release}", open)):
        try:
            with opener(path, "rt") as f:
                text = f.read()
        except OSError:
            continue
        m = re.search(rf"^{option}=(\w+)$", text, re.MULTILINE)
        return m.group(1) if m else ""
    return None


def test_tcx_is_available_from_linux_6_6():
    """The [tcx] cases above and elsewhere only check the refusal where tc.tcx_available()
    says no: it must say yes on every kernel that has tcx (6.6 and later, CONFIG_NET_XGRESS),
    else a fault in how it asks would pass them all without running anything by tcx."""
    release = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    xgress = _kernel_config("CONFIG_NET_XGRESS")
    expected = release >= (6, 6) and xgress != ""  # (None: the configuration cannot be read)
    assert tc.tcx_available() is expected, (os.uname().release, xgress)


@pytest.mark.parametrize("hook", ["tcx", "clsact"])
@pytest.mark.parametrize("kind", ["udp", "ipip"])
def test_pods_reach_each_other_and_the_wire_shows_the_outer_headers(pair_factory, kind, hook):
    if not usable(hook):
        return refused(pair_factory, hook)
    pair = pair_factory(kind, hook=hook)
    t = pair.t
    for i, dev in ((1, "u1"), (2, "u2")):  # the hook asked for, and only that one
        assert sorted((f.direction, f.kind) for f in _filters(getattr(t, f"h{i}"), dev)) == \
            [("egress", "tcx" if hook == "tcx" else "bpf"), ("ingress", "tcx" if hook == "tcx" else "bpf")]
        assert pair.dp[i].status()["hook"] == hook
    assert "3 received" in ping(t.p1, P2)
    # Two echoes and their replies, between the pods: four encapsulated packets on the wire.
    packets = capture(t.h2, "u2", WIRE[kind], lambda: ping(t.p1, P2, count=2), lambda seen: len(seen) >= 4)
    assert len(packets) >= 4
    for pkt in packets:
        # Outer: node to node, DF, TTL 64, a valid header checksum.
        assert {pkt.src, pkt.dst} == {H1_UNDERLAY, H2_UNDERLAY}
        assert pkt.df and pkt.ttl == 64 and pkt.header_ok
        if kind == "udp":
            sport, dport, csum, payload = pkt.udp()
            # flannel UDP: to port 8285, the payload exactly the inner packet; no UDP checksum.
            assert dport == 8285 and sport >= 49152 and csum == 0
            assert pkt.proto == 17 and pkt.total == 20 + 8 + len(payload)
        else:
            assert pkt.proto == 4 and pkt.ihl == 20  # RFC 2003: one plain outer header
        inner = pkt.inner()
        assert (inner.src, inner.dst) in ((P1, P2), (P2, P1)) and inner.proto == 1 and inner.header_ok
        assert inner.total == pkt.total - (28 if kind == "udp" else 20)
        assert pkt.tos == inner.tos  # DSCP and ECN copied (RFC 6040 normal mode)
    # No pod address travels bare on the underlay: captured beside the encapsulated packets, in
    # wire order, so once the last reply has passed encapsulated a bare packet would be in too.
    seen = capture(t.h2, "u2", f"net 10.244.0.0/16 or ({WIRE[kind]})", lambda: ping(t.p1, P2, count=2),
                   lambda seen: sum(p.src in (H1_UNDERLAY, H2_UNDERLAY) for p in seen) >= 4)
    assert [p for p in seen if p.src not in (H1_UNDERLAY, H2_UNDERLAY)] == []
    c1, c2 = pair.counters(1), pair.counters(2)
    assert c1["peers"][H2_UNDERLAY]["tx_packets"] >= 7 and c2["peers"][H1_UNDERLAY]["rx_packets"] >= 7
    assert c2["peers"][H1_UNDERLAY]["tx_packets"] >= 7 and c1["peers"][H2_UNDERLAY]["rx_packets"] >= 7
    assert all(d["packets"] == 0 for d in [*c1["drops"].values(), *c2["drops"].values()]), (c1, c2)


@pytest.mark.parametrize("kind", ["udp", "ipip"])
def test_super_packets_cross_the_underlay_whole(pair_factory, kind):
    """A TCP flow leaves the sender's underlay device as GSO super-packets, encapsulated once
    each (outer length far above the 1500-byte MTU), the way kernel VXLAN sends them."""
    pair = pair_factory(kind)
    t = pair.t
    big = []

    def flow():
        sent, got = transfer(t.p1, t.p2, P2, 8 << 20)
        assert sent == got

    # The flow returns once the sink has everything: all of it crossed u1 (8 MiB and headers).
    for pkt in capture(t.h1, "u1", f"src host {H1_UNDERLAY} and {WIRE[kind]}", flow,
                       lambda seen: sum(p.wire_len for p in seen) >= 8 << 20, snap=96):
        if pkt.wire_len > t.underlay_mtu:
            big.append(pkt.wire_len)
    assert len(big) >= 10 and max(big) > 8 * t.underlay_mtu, big[:20]
    c1 = pair.counters(1)
    # Counted as wire packets: many more segments than super-packets.
    assert c1["peers"][H2_UNDERLAY]["tx_packets"] >= (8 << 20) // t.underlay_mtu


@pytest.mark.parametrize("offload", ["on", "off"])
@pytest.mark.parametrize("kind", ["udp", "ipip"])
def test_64mib_transfer_arrives_intact(pair_factory, kind, offload):
    pair = pair_factory(kind)
    t = pair.t
    if offload == "off":  # every packet on its own and checksummed in software, both ways
        for ns in (t.p1, t.p2, t.h1, t.h2):
            for dev in ns.exec("ls", "/sys/class/net").split():
                if dev != "lo":
                    ns.exec("ethtool", "-K", dev, "tso", "off", "gso", "off", "tx", "off", "gro", "off", check=False)
    before = csum_errors(t.p2) + csum_errors(t.h2)
    sent, got = transfer(t.p1, t.p2, P2, 64 << 20)
    assert sent == got and int(got[0]) == 64 << 20
    assert csum_errors(t.p2) + csum_errors(t.h2) == before
    assert all(d["packets"] == 0 for d in pair.counters(2)["drops"].values())


def _forged(kind: str, src: str) -> bytes:
    """An encapsulated TCP SYN for pod 2, as if from underlay address ``src``."""
    inner = P.tcp_packet(P1, P2, P.TcpHeader(40000, 9, 1, 0, P.TCP_SYN, 1000))
    if kind == "ipip":
        return P.ipip_encapsulate(inner, src, H2_UNDERLAY)
    if kind == "vxlan":  # RFC 7348 section 5: flags (I), VNI 1, then an inner Ethernet frame
        frame = b"\xff" * 6 + b"\x02" * 6 + b"\x08\x00" + inner
        return P.udp_datagram(src, H2_UNDERLAY, 40000, 4789, struct.pack("!II", 0x08000000, 1 << 8) + frame)
    return P.flannel_udp_encapsulate(inner, src, H2_UNDERLAY)


def _send_forged(t, kind: str, src: str, count: int = 5) -> None:
    """Send from host 1 over the underlay link, source address forged (IP_HDRINCL): the
    packets reach host 2's underlay device as a non-member's would."""
    with t.h1.entered():
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    with s:
        for _ in range(count):
            s.sendto(_forged(kind, src), (H2_UNDERLAY, 0))


@pytest.mark.parametrize("kind, reason", [("udp", "non_member_udp"), ("ipip", "non_member_ipip"),
                                          ("vxlan", "non_member_vxlan")])
def test_non_members_are_dropped_and_counted(pair_factory, kind, reason):
    pair = pair_factory("ipip" if kind == "ipip" else "udp")
    t = pair.t
    # Nothing of it reaches the pod: all five are counted as dropped at host 2's underlay device,
    # so none can still be on its way to the pod.
    dropped = lambda _seen: pair.counters(2)["drops"][reason]["packets"] >= 5  # noqa: E731
    assert capture(t.p2, "eth0", f"host {P1} and tcp", lambda: _send_forged(t, kind, X_UNDERLAY), dropped) == []
    drops = pair.counters(2)["drops"]
    assert drops[reason]["packets"] == 5, drops
    assert sum(d["packets"] for d in drops.values()) == 5, drops
    if kind == "vxlan":
        return
    # ...and the same packets go through once the sender is a member: the filter was the reason.
    pair.dp[2].set_members({H1_UNDERLAY, X_UNDERLAY})
    seen = capture(t.p2, "eth0", f"src host {P1} and tcp", lambda: _send_forged(t, kind, X_UNDERLAY),
                   lambda seen: len(seen) >= 5)
    assert len(seen) == 5, seen
    assert pair.counters(2)["peers"][X_UNDERLAY]["rx_packets"] == 5
    assert sum(d["packets"] for d in pair.counters(2)["drops"].values()) == 5


SOL_PACKET, PACKET_QDISC_BYPASS = 263, 20
STRANGER = "192.168.50.66"  # on the underlay link, not a member


def _l2_send(t, frames: list[bytes]) -> None:
    """Send whole Ethernet frames out of host 1's underlay device as someone on the link would:
    past host 1's own programs (PACKET_QDISC_BYPASS skips the device's tc hooks)."""
    with t.h1.entered():
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    with s:
        s.setsockopt(SOL_PACKET, PACKET_QDISC_BYPASS, 1)
        s.bind(("u1", 0))
        for frame in frames:
            s.send(frame)


def _mac(ns, dev: str) -> bytes:
    return bytes.fromhex(ns.exec("cat", f"/sys/class/net/{dev}/address").strip().replace(":", ""))


def _rx(ns, dev: str) -> int:
    return int(ns.exec("cat", f"/sys/class/net/{dev}/statistics/rx_packets"))


def test_vxlan_from_non_members_is_dropped_at_every_address_of_the_node(pair_factory):
    """A kernel VXLAN device on host 2 (its socket bound to the wildcard address, as the agent's
    is): VXLAN from someone on the underlay link who is no member reaches it through none of
    the addresses host 2 takes as its own -- a second underlay address, the pods' gateway, the
    link's broadcast address, the all-hosts group -- all dropped and counted; a member's does,
    and so does what host 2 only forwards (to pod 2, whose socket gets it)."""
    pair = pair_factory("udp")
    t = pair.t
    t.h2.ip("addr", "add", "192.168.50.12/24", "dev", "u2")
    t.h2.ip("link", "add", "vx0", "type", "vxlan", "id", "1", "dstport", "4789", "nolearning")
    t.h2.ip("link", "set", "vx0", "up")
    u1, u2 = _mac(t.h1, "u1"), _mac(t.h2, "u2")
    targets = [(u2, "192.168.50.12"), (u2, "10.244.2.1"), (b"\xff" * 6, "192.168.50.255"),
               (bytes.fromhex("01005e000001"), "224.0.0.1")]

    def frames(src: str, count: int = 3) -> list[bytes]:
        return [dst_mac + u1 + b"\x08\x00" + _vxlan(src, dst) for dst_mac, dst in targets for _ in range(count)]

    before = _rx(t.h2, "vx0")
    _l2_send(t, frames(STRANGER))
    assert wait_for(lambda: _drops(pair.dp[2]).get("non_member_vxlan", 0) >= 12, 5), _drops(pair.dp[2])
    _l2_send(t, frames(H1_UNDERLAY))  # a member's, the same way: through to the VXLAN device
    assert wait_for(lambda: _rx(t.h2, "vx0") >= before + 12, 5), _rx(t.h2, "vx0") - before
    assert _rx(t.h2, "vx0") == before + 12 and _drops(pair.dp[2]) == {"non_member_vxlan": 12}
    # Forwarded, not taken: VXLAN through host 2 to pod 2 is none of the filter's business.
    with t.p2.entered():
        sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with sink:
        sink.bind(("", 4789))
        sink.settimeout(5)
        _l2_send(t, [u2 + u1 + b"\x08\x00" + _vxlan(STRANGER, P2) for _ in range(3)])
        got = [sink.recvfrom(2048)[1][0] for _ in range(3)]
    assert got == [STRANGER] * 3 and _drops(pair.dp[2]) == {"non_member_vxlan": 12}


def _tagged(frame: bytes, vid: int) -> bytes:
    """``frame`` with an 802.1Q tag (VLAN ``vid``) behind its MACs."""
    return frame[:12] + struct.pack("!HH", 0x8100, vid) + frame[12:]


# Tags what host 1 sends with mark 100 (VLAN 100, in skb->vlan_tci as a VLAN device on a
# device with VLAN offload would), before the data path's program: a cls_bpf filter in front
# of it (this kernel may have no VLAN devices, CONFIG_VLAN_8021Q).
PUSH_VLAN = """
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>
char _license[] SEC("license") = "GPL";
SEC("tc") int push_vlan(struct __sk_buff *skb)
{
	if (skb->mark == 100)
		bpf_skb_vlan_push(skb, bpf_htons(ETH_P_8021Q), 100);
	return TC_ACT_UNSPEC;
}
"""


def _push_vlan_before_ours(ns, dev: str, tmp_path) -> None:
    src, obj = tmp_path / "push_vlan.c", tmp_path / "push_vlan.bpf.o"
    src.write_text(PUSH_VLAN)
    arch = subprocess.run(["gcc", "-print-multiarch"], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(["clang-16", "-O2", "-g", "-target", "bpf", "-mcpu=v3", f"-I/usr/include/{arch}", "-c", str(src),
                    "-o", str(obj)], check=True, capture_output=True)
    ns.exec("tc", "filter", "add", "dev", dev, "egress", "prio", "1", "handle", "1", "bpf", "da", "obj", str(obj),
            "sec", "tc")


def test_tagged_frames_are_neither_encapsulated_nor_decapsulated(pair_factory, tmp_path):
    """A frame of another VLAN on the underlay device (its 802.1Q tag in skb->vlan_tci by the
    time tc sees it) is the stack's: a member's flannel UDP in one is not decapsulated, a
    packet to pod 2's subnet leaving in one is not encapsulated -- and the member filter still
    judges a tagged frame (VLAN 0, a priority tag, the stack takes as untagged)."""
    pair = pair_factory("udp", hook="clsact")  # cls_bpf: a filter of the test's can go first
    t = pair.t
    u1, u2 = _mac(t.h1, "u1"), _mac(t.h2, "u2")
    rx = lambda: pair.counters(2)["peers"][H1_UNDERLAY]["rx_packets"]
    frame = u2 + u1 + b"\x08\x00" + P.flannel_udp_encapsulate(_ping_packet(src=P1, dst=P2), H1_UNDERLAY, H2_UNDERLAY)
    before = rx()
    _l2_send(t, [_tagged(frame, 5), _tagged(frame, 0), frame])  # the untagged one last: once it is counted ...
    assert wait_for(lambda: rx() > before, 5)
    assert rx() == before + 1  # ... the tagged ones were not decapsulated
    _l2_send(t, [_tagged(u2 + u1 + b"\x08\x00" + _vxlan(STRANGER, H2_UNDERLAY), 0)])
    assert wait_for(lambda: _drops(pair.dp[2]) == {"non_member_vxlan": 1}, 5), _drops(pair.dp[2])
    # Host 1 sends to an address in pod 2's subnet in VLAN 100.
    _push_vlan_before_ours(t.h1, "u1", tmp_path)
    tx = lambda: pair.counters(1)["peers"][H2_UNDERLAY]["tx_packets"]
    before = tx()
    seen = capture(t.h2, "u2", "vlan 100 and udp port 9", lambda: _send_udp(t.h1, "10.244.2.99", 3, mark=100),
                   lambda seen: len(seen) >= 3)
    assert [(p.dst, p.proto) for p in seen] == [("10.244.2.99", 17)] * 3  # bare, tagged
    assert tx() == before


def _send_udp(ns, dst: str, count: int, mark: int = 0) -> None:
    with ns.entered():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        for _ in range(count):
            s.sendto(b"x" * 32, (dst, 9))


def _filters(ns, dev):
    with ns.entered():
        return [f for f in tc.filters(int(ns.exec("cat", f"/sys/class/net/{dev}/ifindex")))]


def _bpftool(*args):
    return json.loads(subprocess.run(["bpftool", "-j", *args], capture_output=True, text=True, check=True).stdout)


@pytest.mark.parametrize("hook", ["tcx", "clsact"])
def test_reopen_adopts_the_pins_without_losing_a_packet_and_remove_leaves_nothing(pair_factory, bpffs, hook):
    if not usable(hook):
        return refused(pair_factory, hook)
    pair = pair_factory("udp", hook=hook)
    t = pair.t
    old = pair.dp[1]
    ids = {"progs": set(old.prog_ids.values()), "maps": {map_id(fd) for fd in old.maps.values()}}
    pinger = Pinger(t.p1, P2, interval=0.02)
    try:
        assert wait_for(lambda: pair.counters(2)["peers"][H1_UNDERLAY]["rx_packets"] >= 20, 10)
        # The agent dies (its file descriptors go); everything keeps running in the kernel.
        old.close()
        before = pair.counters(2)["peers"][H1_UNDERLAY]["rx_packets"]
        assert wait_for(lambda: pair.counters(2)["peers"][H1_UNDERLAY]["rx_packets"] >= before + 20, 10)
        # A new agent adopts the pinned maps (routes, members, counters) and swaps in new programs.
        new = pair.open(1, {IPv4Network(SUBNET2): (H2_UNDERLAY, "udp")}, {H2_UNDERLAY})
        assert sorted(new.adopted) == sorted(layout.EXPECTED)
        assert new.counters()["peers"][H2_UNDERLAY]["tx_packets"] >= 40  # the counters went on
        assert set(new.prog_ids.values()).isdisjoint(ids["progs"])
        before = pair.counters(2)["peers"][H1_UNDERLAY]["rx_packets"]
        assert wait_for(lambda: pair.counters(2)["peers"][H1_UNDERLAY]["rx_packets"] >= before + 20, 10)
        pinger.wait_replies(20, more=True)  # answers after the swap: every echo before is checked
        sent, missing = pinger.stop()
    finally:
        pinger.close()
    # Every echo answered (those after the last answer may still have been on their way).
    assert sent > 0 and not missing, (sent, sorted(missing)[:20], pinger.trouble(), pinger.lines[-3:])
    # The old programs are gone once replaced; the pinned maps are the same objects.
    live_progs = {p["id"] for p in _bpftool("prog", "show")}
    assert ids["progs"].isdisjoint(live_progs)
    assert ids["maps"] <= {m["id"] for m in _bpftool("map", "show")}
    # remove(): no filter, no pin, no program, no map.
    with t.h1.entered():
        d = pin_dir(bpffs)
        pair.dp[1].remove()
    assert _filters(t.h1, "u1") == []
    assert "clsact" not in t.h1.exec("tc", "qdisc", "show", "dev", "u1")  # ours, and only ours was on it
    assert not d.exists()
    # The kernel frees a map an RCU grace period after its last program: wait for it.
    gone = set(pair.dp[1].prog_ids.values())
    assert wait_for(lambda: gone.isdisjoint({p["id"] for p in _bpftool("prog", "show")})
                    and ids["maps"].isdisjoint({m["id"] for m in _bpftool("map", "show")}), 10)
    # Host 2 is untouched.
    assert {f.name for f in _filters(t.h2, "u2")} == {"agentd_egress", "agentd_ingress"}


def map_id(fd: int) -> int:
    return libbpf.map_info(fd)["id"]


# ---------------------------------------------------------------- the programs on crafted packets
# BPF_PROG_TEST_RUN runs a loaded program on a packet we make, without a device: the decap and
# encap rules case by case, where traffic between namespaces cannot easily produce the case.

TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC = 0, 2, -1
ETH = b"\x02\x00\x00\x00\x00\x02" + b"\x02\x00\x00\x00\x00\x01" + b"\x08\x00"
MEMBER, LOCAL, PEER = "192.168.50.1", "192.168.50.2", "192.168.50.2"


@pytest.fixture
def programs(netns_factory, bpffs):
    """The data path on u0 of a node that forwards (as every node with pods does), its
    underlay address on u0: the member filter asks the node's routing (bpf_fib_lookup) what
    it takes as its own, and the packets run as on u0 (see run)."""
    ns = netns_factory("h")
    ns.ip("link", "add", "u0", "type", "veth", "peer", "name", "u9")
    ns.ip("addr", "add", f"{LOCAL}/24", "dev", "u0")
    for dev in ("u0", "u9"):
        ns.ip("link", "set", dev, "up")
    ns.ip("neigh", "replace", MEMBER, "lladdr", "02:00:00:00:00:aa", "dev", "u0", "nud", "permanent")
    ns.sysctl("net.ipv4.ip_forward", 1)
    with ns.entered():
        dp = BpfDatapath(int(ns.exec("cat", "/sys/class/net/u0/ifindex")), bpffs)
        dp.open(Config(LOCAL, 8285, 4789, FLAGS, 1500))
        dp.set_members({MEMBER})
        dp.set_routes({IPv4Network(SUBNET1): (MEMBER, "udp"), IPv4Network("10.244.9.0/24"): (MEMBER, "ipip")})
    dp.ns = ns
    try:
        yield dp
    finally:
        dp.close()


def test_a_full_ports_map_takes_what_fits_and_recovers_once_the_flood_is_gone(programs):
    """Pods flooding their bridge with source MACs fill agentd_ports (the kernel says E2BIG for
    a new key): what fits is written, the rest counted, and once the flood's MACs are gone
    from the bridge the next sync removes theirs and writes the new pod's."""
    size = libbpf.map_info(programs.maps[layout.PORTS])["max_entries"]
    share = datapath.PORT_MACS_MAX
    flooding = size // share + 2  # ports, each flooding its share: more than the map holds
    flood = {(7, (0x020000000000 + i).to_bytes(6, "big")): 100 + i // share for i in range(flooding * share)}
    programs.set_ports(flood)
    keys = libbpf.map_keys(programs.maps[layout.PORTS], layout.PORT_KEY.size)
    assert len(keys) == size and programs.status()["bridge_ports_refused"] == flooding * share - size
    pod = {(7, bytes.fromhex("0a0000000001")): 12}
    programs.set_ports(pod)
    keys = libbpf.map_keys(programs.maps[layout.PORTS], layout.PORT_KEY.size)
    assert keys == [layout.PORT_KEY.pack(7, bytes.fromhex("0a0000000001"))]
    assert programs.status()["bridge_ports_refused"] == 0 and programs.status()["bridge_ports"] == 1


def test_one_pod_flooding_its_bridge_leaves_room_for_the_other_pods_macs(programs):
    """One port's flood of made-up source MACs, more than the whole map: only its share gets
    in, so a new pod's MAC behind another port is on the direct path while the flood lasts."""
    size = libbpf.map_info(programs.maps[layout.PORTS])["max_entries"]
    flood = {(7, (0x020000000000 + i).to_bytes(6, "big")): 11 for i in range(size + 100)}
    pod = (7, bytes.fromhex("0a0000000001"))
    programs.set_ports({**flood, pod: 12})
    keys = set(libbpf.map_keys(programs.maps[layout.PORTS], layout.PORT_KEY.size))
    assert layout.PORT_KEY.pack(*pod) in keys and len(keys) == datapath.PORT_MACS_MAX + 1
    assert programs.status()["bridge_ports_refused"] == size + 100 - datapath.PORT_MACS_MAX


def run(dp, program: str, packet: bytes) -> tuple[int, bytes]:
    """The program on ``packet``, as on u0 of the fixture's namespace (its addresses and
    routes are what bpf_fib_lookup sees)."""
    with dp.ns.entered():
        ret, out = libbpf.prog_test_run(dp.progs[program], ETH + packet, ifindex=dp.ifindex)
    return (ret - (1 << 32) if ret >= 1 << 31 else ret), out[14:]


def _ping_packet(src=P1, dst=P2, tos=0, size=56) -> bytes:
    icmp = P.icmp_message(8, 0, 0x12340001, b"x" * size)
    return P.ipv4_packet(P.IPv4Header(src=src, dst=dst, protocol=1, ttl=63, tos=tos), icmp)


def _drops(dp) -> dict:
    return {k: v["packets"] for k, v in dp.counters()["drops"].items() if v["packets"]}


def test_decap_hands_on_exactly_the_inner_packet(programs):
    inner = _ping_packet()
    for outer in (P.flannel_udp_encapsulate(inner, MEMBER, LOCAL), P.ipip_encapsulate(inner, MEMBER, LOCAL)):
        assert run(programs, layout.INGRESS, outer) == (TC_ACT_OK, inner)
    # Outer IPv4 options (ihl 6) are stripped with the header.
    hdr = bytearray(P.ipip_encapsulate(inner, MEMBER, LOCAL)[:20])
    hdr[0], hdr[2:4], hdr[10:12] = 0x46, struct.pack("!H", 24 + len(inner)), b"\0\0"
    hdr += b"\x01\x01\x01\x00"  # NOP NOP NOP EOL
    hdr[10:12] = struct.pack("!H", _csum16(bytes(hdr)))
    assert run(programs, layout.INGRESS, bytes(hdr) + inner) == (TC_ACT_OK, inner)
    assert programs.counters()["peers"][MEMBER]["rx_packets"] == 3 and _drops(programs) == {}
    # The first decapsulation told the program which of the newer flags this kernel takes:
    # BPF_F_ADJ_ROOM_DECAP_L3_IPV4 since Linux 6.3; DECAP_L4_UDP / DECAP_IPXIP4 are newer still.
    kernel = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    assert programs.counters()["kernel"]["decap_l3_flag"] == (kernel >= (6, 3))


def test_decap_carries_congestion_experienced_over_rfc6040(programs):
    ect0, ce = 0b10, 0b11
    outer = bytearray(P.ipip_encapsulate(_ping_packet(tos=0x20 | ect0), MEMBER, LOCAL, tos=0x20 | ce))
    ret, out = run(programs, layout.INGRESS, bytes(outer))
    assert ret == TC_ACT_OK and out[1] == 0x20 | ce and _csum16(out[:20]) == 0
    # Not-ECT inner with CE outer: dropped (RFC 6040 section 4.2).
    outer = P.ipip_encapsulate(_ping_packet(tos=0), MEMBER, LOCAL, tos=ce)
    assert run(programs, layout.INGRESS, outer)[0] == TC_ACT_SHOT
    assert _drops(programs) == {"ecn": 1}


def test_decap_refuses_what_is_not_one_inner_packet(programs):
    inner = _ping_packet()
    glued = P.flannel_udp_encapsulate(inner + inner, MEMBER, LOCAL)  # e.g. UDP GRO of two datagrams
    truncated = P.ipip_encapsulate(inner[:-10], MEMBER, LOCAL)
    bad_inner = P.ipip_encapsulate(b"\x60" + inner[1:], MEMBER, LOCAL)  # IPv6 version nibble
    fragment = bytearray(P.flannel_udp_encapsulate(inner, MEMBER, LOCAL))
    fragment[6] = 0x20  # MF, no DF
    fragment[10:12] = b"\0\0"
    fragment[10:12] = struct.pack("!H", _csum16(bytes(fragment[:20])))
    for pkt in (glued, bad_inner, bytes(fragment)):
        assert run(programs, layout.INGRESS, pkt)[0] == TC_ACT_SHOT
    truncated = bytearray(truncated)
    truncated[22:24] = struct.pack("!H", len(inner))  # inner length claims more than is there
    assert run(programs, layout.INGRESS, bytes(truncated))[0] == TC_ACT_SHOT
    assert _drops(programs) == {"malformed": 4}


def test_ingress_leaves_everything_else_alone(programs):
    others = [
        _ping_packet(src=MEMBER, dst=LOCAL),  # plain traffic to the node
        P.udp_datagram(X_UNDERLAY, LOCAL, 5353, 53, b"query"),  # another UDP port, from anyone
        P.ipip_encapsulate(_ping_packet(), X_UNDERLAY, "192.168.50.77"),  # IPIP not addressed to us
        _ping_packet(),  # a pod packet being forwarded
    ]
    for pkt in others:
        assert run(programs, layout.INGRESS, pkt) == (TC_ACT_UNSPEC, pkt)
    assert _drops(programs) == {}


def _vxlan(src: str, dst: str) -> bytes:
    """VXLAN (RFC 7348: flags I, VNI 1) carrying an Ethernet frame with a TCP SYN to pod 2."""
    inner = P.tcp_packet(P1, P2, P.TcpHeader(40000, 9, 1, 0, P.TCP_SYN, 1000))
    frame = b"\xff" * 6 + b"\x02" * 6 + b"\x08\x00" + inner
    return P.udp_datagram(src, dst, 40000, 4789, struct.pack("!II", 0x08000000, 1 << 8) + frame)


def test_non_members_are_judged_at_every_address_the_node_takes_as_its_own(programs):
    """The kernel's VXLAN socket is bound to the wildcard address and UDP hands it whatever the
    node takes as its own: the member filter judges VXLAN, flannel UDP and IPIP to any local
    address (a second one, a pod gateway on a bridge), a broadcast address and a multicast
    group alike -- and leaves what the node forwards alone, from anyone."""
    ns, stranger = programs.ns, X_UNDERLAY
    ns.ip("addr", "add", "192.168.77.2/32", "dev", "u0")  # a secondary address (a VIP)
    ns.ip("link", "add", "br0", "type", "bridge")
    ns.ip("addr", "add", "10.244.2.1/24", "dev", "br0")  # the pods' gateway
    ns.ip("link", "set", "br0", "up")
    ns.ip("route", "add", "198.51.100.0/24", "via", MEMBER, "dev", "u0")
    inner = _ping_packet()
    kinds = {"non_member_vxlan": lambda src, dst: _vxlan(src, dst),
             "non_member_udp": lambda src, dst: P.flannel_udp_encapsulate(inner, src, dst),
             "non_member_ipip": lambda src, dst: P.ipip_encapsulate(inner, src, dst)}
    taken = ("192.168.77.2", "10.244.2.1", "192.168.50.255", "255.255.255.255", "224.0.0.1", LOCAL)
    forwarded = ("10.244.2.7", "192.168.50.77", "198.51.100.9")  # a pod; on the link; routed on
    for reason, make in kinds.items():
        for dst in taken:
            assert run(programs, layout.INGRESS, make(stranger, dst))[0] == TC_ACT_SHOT, (reason, dst)
        for dst in forwarded:
            pkt = make(stranger, dst)
            assert run(programs, layout.INGRESS, pkt) == (TC_ACT_UNSPEC, pkt), (reason, dst)
        # A member's: to the underlay address decapsulated (not VXLAN: the device's), to
        # another address left to the stack as it is.
        for dst in taken[:-1] + forwarded:
            pkt = make(MEMBER, dst)
            assert run(programs, layout.INGRESS, pkt) == (TC_ACT_UNSPEC, pkt), (reason, dst)
    assert _drops(programs) == {reason: len(taken) for reason in kinds}
    assert programs.counters()["peers"][MEMBER]["rx_packets"] == 0


def test_egress_encapsulates_by_route_and_refuses_oversized(programs):
    inner = _ping_packet(src=P2, dst=P1)  # to SUBNET1: udp
    ret, out = run(programs, layout.EGRESS, inner)
    outer = Packet(len(out), out)
    assert ret == TC_ACT_OK and (outer.src, outer.dst, outer.proto) == (LOCAL, MEMBER, 17) and outer.header_ok
    assert outer.udp()[1] == 8285 and outer.udp()[3] == inner
    inner = _ping_packet(src=P2, dst="10.244.9.7")  # ipip
    ret, out = run(programs, layout.EGRESS, inner)
    assert ret == TC_ACT_OK and out[9] == 4 and out[20:] == inner
    # Not a routed pod subnet: untouched.
    other = _ping_packet(src=P2, dst="10.244.7.7")
    assert run(programs, layout.EGRESS, other) == (TC_ACT_UNSPEC, other)
    # 1473 bytes + 28 of overhead exceed the 1500-byte underlay: dropped, counted.
    big = _ping_packet(src=P2, dst=P1, size=1473 - 28)
    assert len(big) == 1473 and run(programs, layout.EGRESS, big)[0] == TC_ACT_SHOT
    assert _drops(programs) == {"too_big": 1}



def _tx_dropped(ns, dev: str) -> int:
    return int(ns.exec("cat", f"/sys/class/net/{dev}/statistics/tx_dropped"))


@pytest.mark.parametrize("hook", ["tcx", "clsact"])
def test_restarts_on_a_busy_device_lose_nothing(pair_factory, hook):
    """The pods' bridge gets the member filter while pods talk through it (the CNI plugin made
    it a moment ago), and a restarted agent swaps the programs on a busy underlay.  Neither may
    cost a packet.  By tcx nothing is grafted at all: a clsact qdisc grafted onto a live device
    stops its transmit queues for an RCU grace period (every packet sent out of it meanwhile is
    dropped, QDISC_DROP), which is why "auto" takes tcx where the kernel has it.  By clsact the
    qdisc is grafted once per device, when the first program goes on; the swaps after it are
    filter replacements in place, which lose nothing either.  Ours on the other kind of hook (an
    older agent's cls_bpf filter; an agent that ran with tcx before) is taken over: removed
    once ours is on, the qdisc left alone; and so is an agent before links' tcx programs, which
    it recognises by its program pins (tc.Pins) and takes off by their position."""
    from agentd.kernel import netlink_tc as tcm
    from agentd.kernel.rtnl import Rtnl

    if not usable(hook):
        return refused(pair_factory, hook)
    pair = pair_factory("udp", hook=hook)
    t = pair.t
    name = "agentd_ingress"
    vp2 = int(t.h2.exec("cat", "/sys/class/net/vp2/ifindex"))  # stands for a pods' bridge: no qdisc
    u2 = pair.dp[2].ifindex
    if hook == "tcx":
        with t.h2.entered(), Rtnl() as rt:  # an older agent's filter on the underlay, as it left it
            rt.request(tcm.encode_add_clsact(rt.next_seq(), u2), "clsact")
            rt.request(tcm.encode_replace_bpf_filter(rt.next_seq(), u2, tc.PARENTS["ingress"], tc.PRIO, tc.HANDLE,
                                                     tc.ETH_P_ALL, pair.dp[2].progs[layout.INGRESS], name), "filter")
            # ... and an agent before links: its programs on tcx without one, pinned by name.
            tc.remove_links(pair.dp[2].pins, tc.OURS)
            for prog, direction in ((layout.EGRESS, libbpf.TCX_EGRESS), (layout.INGRESS, libbpf.TCX_INGRESS)):
                libbpf.tcx_attach(u2, direction, pair.dp[2].progs[prog])
            assert [f.link_id for f in _filters(t.h2, "u2") if f.kind == "tcx"] == [0, 0]
    else:
        with t.h2.entered():
            tc.attach(vp2, "ingress", pair.dp[2].progs[layout.INGRESS], name, "clsact", pair.dp[2].pins)  # the one graft
            if tc.tcx_available():  # an agent that ran with tcx before, as it left its program
                libbpf.tcx_attach(u2, libbpf.TCX_INGRESS, pair.dp[2].progs[layout.INGRESS])
    qdiscs_before = t.h2.exec("tc", "qdisc", "show")
    drops_before = {dev: _tx_dropped(t.h2, dev) for dev in ("vp2", "u2")}
    pinger = Pinger(t.p1, P2, interval=0.005)
    try:
        assert wait_for(lambda: pair.counters(2)["peers"][H1_UNDERLAY]["rx_packets"] >= 20, 10)
        for _ in range(5):  # an agent restarting on a busy node: new programs in place of the old
            pair.dp[2].close()
            dp = pair.open(2, {IPv4Network(SUBNET1): (H1_UNDERLAY, "udp")}, {H1_UNDERLAY})
            with t.h2.entered():
                tc.attach(vp2, "ingress", dp.progs[layout.INGRESS], name, hook, dp.pins)  # the pods' bridge guarded
        before = pair.counters(2)["peers"][H1_UNDERLAY]["rx_packets"]
        assert wait_for(lambda: pair.counters(2)["peers"][H1_UNDERLAY]["rx_packets"] >= before + 20, 10)
        pinger.wait_replies(20, more=True)  # answers after the restarts: every echo before is checked
        sent, missing = pinger.stop()
    finally:
        pinger.close()
    # Every echo answered (at 5 ms apart, several after the last answer may still have been on their way).
    assert sent > 0 and not missing, (sent, sorted(missing)[:20], pinger.trouble(), pinger.lines[-3:])
    assert {dev: _tx_dropped(t.h2, dev) for dev in ("vp2", "u2")} == drops_before
    assert t.h2.exec("tc", "qdisc", "show") == qdiscs_before  # no qdisc came or went
    # Ours is on each hook once, by the hook asked for; the other kind's is gone.
    kind = "tcx" if hook == "tcx" else "bpf"
    assert [(f.direction, f.kind, f.name) for f in _filters(t.h2, "vp2")] == [("ingress", kind, name)]
    assert sorted((f.direction, f.kind) for f in _filters(t.h2, "u2")) == [("egress", kind), ("ingress", kind)]
    if hook == "tcx":  # each held by a pinned link of ours: none left without one
        assert all(f.link_id for f in _filters(t.h2, "u2") + _filters(t.h2, "vp2"))


# ---------------------------------------------------------------- an open that fails part-way
# What an agent meets in the pin directory or on the hooks can make open() fail after some of
# its programs are on the device.  It must say why in one BpfUnavailable (the agent then falls
# back to the user-space worker, or runs without the pod fast path, and /status says why) --
# never another exception, which would end the agent's start in a traceback -- and take off
# what it put on: a program left on a hook with maps no agent keeps goes on deciding packets.


def _ours(ns, dev: str) -> list[tuple[str, str]]:
    """(direction, name) of every program of ours on the device (this test names them by id)."""
    return sorted((f.direction, f.name) for f in _filters(ns, dev) if f.name in tc.PROGRAMS)


def _veths(ns, *names: str) -> dict[str, int]:
    for name in names:
        ns.ip("link", "add", name, "type", "veth", "peer", "name", name[:-1] + "9")
    return {name: int(ns.exec("cat", f"/sys/class/net/{name}/ifindex")) for name in names}


def _foreign_filter(ns, dev: str) -> None:
    """Someone else's filter (classic BPF, accepting all) at the place agentd's cls_bpf filter
    takes on the device's ingress hook."""
    ns.exec("tc", "qdisc", "replace", "dev", dev, "clsact")
    ns.exec("tc", "filter", "add", "dev", dev, "ingress", "prio", str(tc.PRIO), "handle", "1", "bpf", "bytecode",
            "1,6 0 0 4294967295,")


class OneDevice:
    """A namespace with one veth, u0, for a BpfDatapath to open on by ``hook``."""

    def __init__(self, netns_factory, bpffs: str, hook: str) -> None:
        self.ns, self.bpffs, self.hook = netns_factory("h"), bpffs, hook
        self.u0 = _veths(self.ns, "u0")["u0"]
        with self.ns.entered():
            self.dir = pin_dir(bpffs)

    def open(self) -> BpfDatapath:
        with self.ns.entered():
            dp = BpfDatapath(self.u0, self.bpffs, attach=self.hook)
            dp.open(Config(LOCAL, 8285, 4789, FLAGS, 1500))
        return dp

    def open_fails(self) -> str:
        """Why open() failed: a BpfUnavailable's reason (anything else fails the test)."""
        with pytest.raises(BpfUnavailable) as err:
            self.open()
        return str(err.value)

    def ours(self) -> list[tuple[str, str]]:
        return _ours(self.ns, "u0")


@pytest.mark.parametrize("hook", ["tcx", "clsact"])
def test_pins_that_cannot_be_made_or_replaced_fail_the_data_path_with_a_reason(netns_factory, bpffs, hook):
    if not usable(hook):  # asking for tcx is refused, saying why
        assert re.match(TCX_REFUSED, OneDevice(netns_factory, bpffs, hook).open_fails())
        return
    dev = OneDevice(netns_factory, bpffs, hook)
    d = dev.dir
    # Something that is not a program where the ingress program's pin goes: both programs
    # were on the device by then, and come off again.
    d.mkdir(parents=True)
    (d / layout.INGRESS).mkdir()
    assert dev.open_fails() == f"cannot pin {layout.INGRESS} as {d / layout.INGRESS}: Is a directory"
    assert dev.ours() == []
    (d / layout.INGRESS).rmdir()
    # A restart on a bpffs that went read-only: the maps' pins can be neither opened for writing
    # nor replaced.  Nothing of this open's is on the device by then, but the previous agent's
    # programs are, with maps nobody keeps now: they come off too (the user-space worker takes
    # over) -- by clsact; a tcx link is detached through its pin, which the kernel opens for
    # reading and writing only, so there the reason says they stay.
    dev.open()
    subprocess.run(["mount", "-o", "remount,ro", bpffs], check=True)
    try:
        why = dev.open_fails()
        maps = rf"the pin {re.escape(str(d))}/agentd_\w+ cannot be opened as a map \(Read-only file system\) " \
               r"nor removed: Read-only file system"
        if hook == "clsact":
            assert re.fullmatch(maps, why), why
            assert dev.ours() == []
        else:
            link = re.escape(str(d / tc.LINKS / f"{layout.EGRESS}-{dev.u0}"))
            assert re.fullmatch(rf"{maps}; and {layout.EGRESS} could not be taken off device {dev.u0} again: "
                                rf"\[Errno 30\] opening pinned {link}: Read-only file system", why), why
            assert dev.ours() == [("egress", layout.EGRESS), ("ingress", layout.INGRESS)]
    finally:
        subprocess.run(["mount", "-o", "remount,rw", bpffs], check=True)
    # The same when the object itself cannot be had (a broken install): the previous agent's
    # programs, which this open never reached, are taken off.
    dev.open()
    assert dev.ours() == [("egress", layout.EGRESS), ("ingress", layout.INGRESS)]
    with dev.ns.entered():
        dp = BpfDatapath(dev.u0, dev.bpffs, attach=dev.hook)
        dp.object_path = Path("/nonexistent/missing.bpf.o")
        with pytest.raises(BpfUnavailable, match="no BPF object at"):
            dp.open(Config(LOCAL, 8285, 4789, FLAGS, 1500))
    assert dev.ours() == []


@pytest.mark.parametrize("hook", ["tcx", "clsact"])
def test_an_ingress_hook_that_cannot_be_had_takes_the_egress_program_off_again(netns_factory, bpffs, hook):
    """Egress is attached first: the data path fails with the ingress hook's reason and leaves
    neither on the device.  The hook is taken by someone's filter at our cls_bpf place; by
    tcx, by something that is not our link where the link's pin goes."""
    if not usable(hook):  # asking for tcx is refused, saying why
        assert re.match(TCX_REFUSED, OneDevice(netns_factory, bpffs, hook).open_fails())
        return
    dev = OneDevice(netns_factory, bpffs, hook)
    if hook == "clsact":
        _foreign_filter(dev.ns, "u0")
        why = dev.open_fails()
        assert why.startswith(f"device {dev.u0} ingress: priority {tc.PRIO:#x} handle 1 holds a bpf filter") \
            and why.endswith("not replacing it"), why
        assert [(f.direction, f.kind, f.name) for f in _filters(dev.ns, "u0")] == [("ingress", "bpf", None)]  # theirs
    else:
        link = dev.dir / tc.LINKS / f"{layout.INGRESS}-{dev.u0}"
        link.mkdir(parents=True)
        assert dev.open_fails() == f"device {dev.u0} ingress: cannot attach {layout.INGRESS}: opening pinned {link}: " \
                                   "Permission denied"
        assert dev.ours() == []


@pytest.mark.parametrize("hook", ["tcx", "clsact"])
def test_a_pod_fast_path_that_fails_part_way_is_off_and_gone_from_every_hook(netns_factory, bpffs, hook):
    """The pod fast path off means off: when open() fails, none of it stays on a veth or the
    underlay device -- neither what this open put there nor what an earlier agent left (its
    map of pods no agent keeps any more)."""
    from agentd.dataplane.bpf.podpath import PodFastPath

    ns = netns_factory("h")
    dev = _veths(ns, "u0", "pa0", "pb0")
    pods = {"10.244.1.2": "pa0", "10.244.1.3": "pb0"}

    def opened() -> PodFastPath:
        return PodFastPath(bpffs, cluster=IPv4Network("10.244.0.0/16"), wire_ifindex=dev["u0"], attach=hook)

    if not usable(hook):  # asking for tcx is refused, saying why
        with ns.entered(), pytest.raises(BpfUnavailable, match=TCX_REFUSED):
            opened().open()
        return

    def running() -> None:
        """The fast path as an agent left it: on both pods' veths and the underlay."""
        with ns.entered():
            fast = opened()
            fast.open()
            fast.set_pods(pods)
            fast.close()
        assert [_ours(ns, d) for d in dev] == [[("ingress", tc.POD_WIRE)], [("ingress", tc.POD_FAST_PATH)],
                                               [("ingress", tc.POD_FAST_PATH)]]

    def open_fails() -> str:
        with ns.entered(), pytest.raises(BpfUnavailable) as err:
            opened().open()
        assert [_ours(ns, d) for d in dev] == [[], [], []]
        return str(err.value)

    running()
    with ns.entered():
        d = pin_dir(bpffs)
    # The wire program cannot be pinned: the veths have this open's program by then.
    (d / tc.POD_WIRE).unlink()
    (d / tc.POD_WIRE).mkdir()
    assert open_fails() == f"cannot pin {tc.POD_WIRE} as {d / tc.POD_WIRE}: Is a directory"
    (d / tc.POD_WIRE).rmdir()
    # One pod's veth cannot be had: the other's has this open's program or the earlier one.
    running()
    if hook == "clsact":
        ns.exec("tc", "filter", "del", "dev", "pb0", "ingress", "prio", str(tc.PRIO), "handle", "1", "bpf")
        _foreign_filter(ns, "pb0")
        why = open_fails()
        assert why.startswith(f"device {dev['pb0']} ingress: priority {tc.PRIO:#x} handle 1 holds a bpf filter"), why
    else:
        link = d / tc.LINKS / f"{tc.POD_FAST_PATH}-{dev['pb0']}"
        link.unlink()  # (the link goes with its last reference: the program is off pb0)
        link.mkdir()
        assert open_fails() == f"device {dev['pb0']} ingress: cannot attach {tc.POD_FAST_PATH}: opening pinned " \
                               f"{link}: Permission denied"


def test_a_reopened_pod_fast_path_records_as_the_last_agent_said_until_told(netns_factory, bpffs):
    """A restarted agent's pod fast path keeps recording connections as the previous agent told
    it (POD_CFG_RECORD in the pinned config) until its flow recorder says otherwise, and then
    drops what they recorded; a recorded connection the sweep took is put back only where the
    programs made no entry since."""
    from agentd.dataplane.bpf.podpath import (
        CFG_RECORD,
        CFG_RECORD_REMOTE,
        CONFIG,
        CONFIG_VALUE,
        CONN_VALUE,
        CONNS,
        U32,
        PodFastPath,
    )

    ns = netns_factory("r")
    dev = _veths(ns, "u0")
    both = CFG_RECORD | CFG_RECORD_REMOTE

    def opened() -> PodFastPath:
        fast = PodFastPath(bpffs, cluster=IPv4Network("10.244.0.0/16"), wire_ifindex=dev["u0"])
        fast.open()
        return fast

    def recording(fast: PodFastPath) -> int:
        raw = libbpf.map_lookup(fast.maps[CONFIG], U32.pack(0), CONFIG_VALUE.size)
        return CONFIG_VALUE.unpack(raw)[0] & both

    with ns.entered():
        fast = opened()
        try:
            assert recording(fast) == 0
            fast.set_recording(True, True)
            assert recording(fast) == both and fast.records_remote()
            key = socket.inet_aton("10.244.1.2") + socket.inet_aton("10.244.2.3") + bytes([156, 64, 0, 80])
            taken, fresh = (CONN_VALUE.pack(1, 1, 60, 60, first, first, 2, 0, 0) for first in (5, 7))
            assert fast.put_recorded(key, taken) and fast.take_recorded(key) == taken
            assert fast.put_recorded(key, fresh) and not fast.put_recorded(key, taken)  # the programs' stays
            assert fast.take_recorded(key) == fresh
            # podconns full (a preallocated hash: the programs took the slot a take freed): it
            # cannot go back, and says so rather than returning as if the programs' had stayed.
            conns = fast.maps[CONNS]
            for i in range(libbpf.map_info(conns)["max_entries"]):
                libbpf.map_update(conns, key[:8] + i.to_bytes(4, "big"), fresh, libbpf.BPF_NOEXIST)
            with pytest.raises(OSError, match="agentd_podconns is full") as err:
                fast.put_recorded(socket.inet_aton("10.244.9.9") + key[4:], taken)
            assert err.value.errno == errno.E2BIG
        finally:
            fast.close()
        again = opened()
        try:
            assert recording(again) == both  # the earlier agent's word stands ...
            again.set_counting(True)
            assert recording(again) == both
            assert len(again.recorded_open()) == libbpf.map_info(again.maps[CONNS])["max_entries"]
            again.set_recording(False)  # ... until the recorder's
            assert recording(again) == 0 and not again.records_remote()
            assert again.recorded_open() == [] and again.recorded() == []  # nobody records them now
        finally:
            again.remove()
