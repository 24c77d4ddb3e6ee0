"""IPv6 pods over the in-kernel (tc-BPF) udp data path, driven through agentd.dataplane.bpf
directly between two dual-stack hosts in namespaces (the outer header stays IPv4, the
underlay's): ping6 and TCP both ways with the documented outer headers and the real next
hop's MACs, TCP super-packets kept whole on both sides, a 64 MiB transfer intact, a re-open
that adopts the pinned maps (the IPv6 routes and the gateways' neighbour entries with them)
without losing an echo under both hooks, and remove() leaving nothing.  Then the programs on
crafted packets (BPF_PROG_TEST_RUN): decapsulation of IPv6 inner packets case by case, the
fall-back of kernels before 6.3, encapsulation with the next hop's MACs, and what is refused."""

from __future__ import annotations

import socket
import struct
from ipaddress import IPv4Network, IPv6Network

import pytest
from dualstack_hosts import (
    FLAGS,
    HOOKS,
    capture,
    csum_errors,
    iperf6,
    mac,
    pairs,
    ping6,
    refused,
    traffic_class,
    transfer6,
    usable,
)

from agentd.dataplane.bpf import BpfDatapath, Config, layout, libbpf, pin_dir
from agentd.dataplane.bpf.datapath import gateway6, gateway_neighbours
from agentd.lab.traffic import Pinger
from agentd.lab.twohosts import (
    H1_UNDERLAY,
    H2_UNDERLAY,
    P1_6,
    P2,
    P2_6,
    SUBNET1,
    SUBNET1_6,
    wait_for,
)
from proto import packet as P

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def pair6(netns_factory, bpffs):
    with pairs(netns_factory, bpffs) as make:
        yield make

@pytest.mark.parametrize("hook", HOOKS)
def test_ipv6_pods_reach_each_other_with_ipv4_outer_headers(pair6, hook):
    if not usable(hook):
        return refused(lambda: pair6(hook))
    pair = pair6(hook)
    t = pair.t
    assert "3 received" in ping6(t.p1, P2_6) and "3 received" in ping6(t.p2, P1_6)
    assert "3 received" in t.p1.exec("ping", "-n", "-c", "3", "-i", "0.2", "-W", "2", P2, check=False)  # IPv4 too
    # The underlay next hop unresolved: the first packet goes to the neighbour subsystem, which asks.
    t.h1.ip("neigh", "flush", "dev", "u1")
    assert "1 received" in ping6(t.p1, P2_6, count=1)
    assert "REACHABLE" in t.h1.exec("ip", "neigh", "show", H2_UNDERLAY, "dev", "u1")
    frames = capture(t.h2, "u2", "udp port 8285", lambda: ping6(t.p1, P2_6, count=2))
    assert len(frames) >= 4
    h1_mac, h2_mac = mac(t.h1, "u1"), mac(t.h2, "u2")
    for wire_len, eth, ip in frames:
        outer = P.split_ipv4(ip)[0]
        # Outer IPv4 + UDP to 8285, node to node, DF, TTL 64; the payload exactly the inner IPv6 packet.
        assert eth[12:14] == b"\x08\x00" and {outer.src, outer.dst} == {H1_UNDERLAY, H2_UNDERLAY}
        assert outer.ttl == 64 and outer.df and P.ipv4_header_checksum_ok(ip)
        sport, dport, length, csum = struct.unpack_from("!HHHH", ip, 20)
        inner = ip[28:]
        assert dport == 8285 and sport >= 49152 and csum == 0 and length == 8 + len(inner)
        assert inner[0] >> 4 == 6 and struct.unpack_from("!H", inner, 4)[0] + 40 == len(inner)
        src, dst = socket.inet_ntop(socket.AF_INET6, inner[8:24]), socket.inet_ntop(socket.AF_INET6, inner[24:40])
        assert (src, dst) in ((P1_6, P2_6), (P2_6, P1_6)) and inner[6] == 58  # ICMPv6
        assert outer.tos == traffic_class(inner)  # DSCP and ECN copied (RFC 6040 normal mode)
        # The real next hop's MACs (the egress program's FIB lookup), not the neighbour entry's stand-in.
        assert eth[:12] == (h2_mac + h1_mac if outer.src == H1_UNDERLAY else h1_mac + h2_mac)
    # No IPv6 pod packet travels bare on the underlay.
    assert capture(t.h2, "u2", "ip6 and net fd00::/16", lambda: ping6(t.p1, P2_6, count=2)) == []
    c1, c2 = pair.dp[1].counters(), pair.dp[2].counters()
    assert c1["peers"][H2_UNDERLAY]["tx_packets"] >= 7 and c2["peers"][H1_UNDERLAY]["rx_packets"] >= 7
    assert all(d["packets"] == 0 for d in [*c1["drops"].values(), *c2["drops"].values()]), (c1, c2)
    assert pair.dp[1].status()["routes_v6"] == 1 and pair.dp[1].status()["routes"] == 1


def test_ipv6_tcp_both_ways_in_super_packets_kept_whole(pair6):
    """TCP over IPv6 leaves the sender's underlay device as GSO super-packets encapsulated once
    each, and reaches the receiving pod still whole (decapsulation kept the TCPV6 GSO type);
    iperf3 -6 runs both ways, and a 64 MiB transfer arrives intact, with no checksum error."""
    pair = pair6()
    t = pair.t
    for args in ((), ("-R",)):
        result = iperf6(t.p1, t.p2, P2_6, *args)
        assert result["end"]["sum_received"]["bytes"] > 1 << 20, result["end"]

    sent_big, received_big = [], []

    def flow():
        sent, got = transfer6(t.p1, t.p2, P2_6, 8 << 20)
        assert sent == got

    for wire_len, _eth, _ip in capture(t.h1, "u1", f"src host {H1_UNDERLAY} and udp port 8285", flow, snap=96):
        if wire_len > t.underlay_mtu:
            sent_big.append(wire_len)
    assert len(sent_big) >= 10 and max(sent_big) > 8 * t.underlay_mtu, sent_big[:20]
    for wire_len, _eth, _ip in capture(t.p2, "eth0", f"ip6 and tcp and src host {P1_6}", flow, snap=96):
        if wire_len > pair.mtu:
            received_big.append(wire_len)
    assert len(received_big) >= 10 and max(received_big) > 8 * pair.mtu, received_big[:20]
    assert pair.dp[1].counters()["peers"][H2_UNDERLAY]["tx_packets"] >= (16 << 20) // t.underlay_mtu

    before = csum_errors(t.p2) + csum_errors(t.h2)
    sent, got = transfer6(t.p1, t.p2, P2_6, 64 << 20)
    assert sent == got and int(got[0]) == 64 << 20
    assert csum_errors(t.p2) + csum_errors(t.h2) == before
    assert all(d["packets"] == 0 for d in pair.dp[2].counters()["drops"].values())


@pytest.mark.parametrize("hook", HOOKS)
def test_ipv6_reopen_adopts_routes_and_gateways_without_losing_an_echo(pair6, bpffs, hook):
    if not usable(hook):
        return refused(lambda: pair6(hook))
    pair = pair6(hook)
    t = pair.t
    pinger = Pinger(t.p1, P2_6, interval=0.02)
    try:
        assert wait_for(lambda: pair.dp[2].counters()["peers"][H1_UNDERLAY]["rx_packets"] >= 20, 10)
        pair.dp[1].close()  # the agent dies; everything keeps running in the kernel
        with t.h1.entered():
            dp = BpfDatapath(pair.dp[1].ifindex, bpffs, attach=hook)
            dp.open(Config(H1_UNDERLAY, 8285, 4789, FLAGS, t.underlay_mtu))
        pair.dp[1] = dp
        # What the new agent found: both routes maps and the gateway's neighbour entry.
        assert layout.ROUTES6 in dp.adopted and dp.routes == pair.routes(1) and dp.gateways6 == {H2_UNDERLAY}
        with t.h1.entered():
            dp.set_gateways6({H2_UNDERLAY})
            dp.set_routes(pair.routes(1))
        before = pair.dp[2].counters()["peers"][H1_UNDERLAY]["rx_packets"]
        assert wait_for(lambda: pair.dp[2].counters()["peers"][H1_UNDERLAY]["rx_packets"] >= before + 20, 10)
        pinger.wait_replies(20, more=True)  # answers after the reopen: every echo before is checked
        sent, missing = pinger.stop()
    finally:
        pinger.close()
    # Every echo answered (those after the last answer may still have been on their way).
    assert sent > 0 and not missing, (sent, sorted(missing)[:20], pinger.trouble(), pinger.lines[-3:])
    # remove(): the neighbour entry goes with the programs and pins.
    with t.h1.entered():
        d = pin_dir(bpffs)
        pair.dp[1].remove()
        assert gateway_neighbours(pair.dp[1].ifindex) == []
    assert not d.exists()
    assert gateway6(H2_UNDERLAY) not in t.h1.exec("ip", "-6", "neigh", "show", "dev", "u1")


# ---------------------------------------------------------------- the programs on crafted packets

TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT, TC_ACT_UNSPEC = 0, 2, 7, -1
MEMBER, LOCAL = "192.168.50.1", "192.168.50.2"
MEMBER_MAC = bytes.fromhex("0200000000aa")
FAR = "192.168.70.9"  # a member no route leads to
ETH6 = b"\x02\x00\x00\x00\x00\x02" + b"\x02\x00\x00\x00\x00\x01" + b"\x86\xdd"
ETH4 = ETH6[:12] + b"\x08\x00"


@pytest.fixture
def programs6(netns_factory, bpffs):
    ns = netns_factory("h")
    ns.ip("link", "add", "u0", "type", "veth", "peer", "name", "u9")
    ns.ip("addr", "add", f"{LOCAL}/24", "dev", "u0")
    ns.ip("link", "set", "u0", "up")
    ns.ip("link", "set", "u9", "up")
    ns.ip("neigh", "replace", MEMBER, "lladdr", MEMBER_MAC.hex(":"), "dev", "u0", "nud", "permanent")
    ns.sysctl("net.ipv4.ip_forward", 1)  # a node forwards: bpf_fib_lookup answers only where it does
    with ns.entered():
        dp = BpfDatapath(int(ns.exec("cat", "/sys/class/net/u0/ifindex")), bpffs)
        dp.open(Config(LOCAL, 8285, 4789, FLAGS, 1500))
        dp.set_members({MEMBER, FAR})
        dp.set_routes({IPv6Network(SUBNET1_6): (MEMBER, "udp"), IPv6Network("fd00:10:244:9::/64"): (FAR, "udp"),
                       IPv4Network(SUBNET1): (MEMBER, "udp")})
    dp.ns = ns
    try:
        yield dp
    finally:
        dp.close()


def run(dp, program: str, packet: bytes, eth: bytes = ETH4) -> tuple[int, bytes]:
    """The program on ``packet`` behind ``eth``, as on device u0 of the namespace (its routes
    and neighbours are what bpf_fib_lookup sees)."""
    with dp.ns.entered():
        ret, out = libbpf.prog_test_run(dp.progs[program], eth + packet, ifindex=dp.ifindex)
    return (ret - (1 << 32) if ret >= 1 << 31 else ret), out


def ipv6_packet(src: str, dst: str, payload: bytes, *, tclass: int = 0, hop_limit: int = 63, nh: int = 58) -> bytes:
    first = 0x60000000 | tclass << 20 | 0x12345  # version, traffic class, a flow label
    return struct.pack("!IHBB16s16s", first, len(payload), nh, hop_limit, socket.inet_pton(socket.AF_INET6, src),
                       socket.inet_pton(socket.AF_INET6, dst)) + payload


def echo6(src=P2_6, dst=P1_6, tclass=0, size=56) -> bytes:
    return ipv6_packet(src, dst, b"\x80\x00\x00\x00\x12\x34\x00\x01" + b"x" * size, tclass=tclass)  # csum not checked


def encap(inner: bytes, src: str = MEMBER, *, tos: int = 0) -> bytes:
    """flannel UDP from ``src`` to this node, the outer TOS ``tos``."""
    pkt = bytearray(P.flannel_udp_encapsulate(inner, src, LOCAL))
    pkt[1], pkt[10:12] = tos, b"\0\0"
    pkt[10:12] = struct.pack("!H", P.checksum(bytes(pkt[:20])))
    return bytes(pkt)


def _drops(dp) -> dict:
    return {k: v["packets"] for k, v in dp.counters()["drops"].items() if v["packets"]}


def test_decap_hands_on_exactly_the_inner_ipv6_packet(programs6):
    inner = echo6(src=P1_6, dst=P2_6)
    ret, out = run(programs6, layout.INGRESS, encap(inner))
    assert (ret, out[12:14], out[14:]) == (TC_ACT_OK, b"\x86\xdd", inner)  # the Ethernet header says IPv6
    assert programs6.counters()["peers"][MEMBER]["rx_packets"] == 1 and _drops(programs6) == {}
    # RFC 6040 4.2 on the traffic class: CE over ECT(0) becomes CE; over Not-ECT it is dropped.
    ret, out = run(programs6, layout.INGRESS, encap(echo6(tclass=0x20 | 0b10), tos=0x20 | 0b11))
    assert ret == TC_ACT_OK and traffic_class(out[14:]) == 0x20 | 0b11
    assert run(programs6, layout.INGRESS, encap(echo6(tclass=0), tos=3))[0] == TC_ACT_SHOT
    assert _drops(programs6) == {"ecn": 1}


def test_decap_refuses_ipv6_that_is_not_one_inner_packet(programs6):
    inner = echo6()
    short = bytearray(inner)
    short[4:6] = struct.pack("!H", len(inner))  # a payload length longer than what is there
    cases = [
        encap(inner + inner),  # two glued (UDP GRO)
        encap(bytes(short)),
        P.ipip_encapsulate(inner, MEMBER, LOCAL),  # IPv6 in IPIP: ipip is IPv4 in IPv4 only
    ]
    for pkt in cases:
        assert run(programs6, layout.INGRESS, pkt)[0] == TC_ACT_SHOT
    assert _drops(programs6) == {"malformed": 3}
    # From a non-member: the member filter judges the outer source, whatever the inner family.
    assert run(programs6, layout.INGRESS, encap(inner, "192.168.50.77"))[0] == TC_ACT_SHOT
    assert _drops(programs6) == {"malformed": 3, "non_member_udp": 1}


def test_decap_before_linux_6_3_sends_the_ipv6_packet_in_again(programs6):
    """A kernel without BPF_F_ADJ_ROOM_DECAP_L3_IPV6 leaves skb->protocol IPv4 after the outer
    header is gone: the program sends the packet into the device again, where the stack reads
    its Ethernet header anew (eth_type_trans) and takes it as the IPv6 packet it is."""
    with programs6.ns.entered():
        cfg = programs6.config
        programs6.set_config(Config(cfg.local, cfg.udp_port, cfg.vxlan_port, cfg.flags, cfg.mtu),
                             clear=layout.CFG_DECAP_L3_FLAG)
    inner = echo6(src=P1_6, dst=P2_6)
    ret, out = run(programs6, layout.INGRESS, encap(inner))
    assert (ret, out[12:14], out[14:]) == (TC_ACT_REDIRECT, b"\x86\xdd", inner)
    assert programs6.counters()["peers"][MEMBER]["rx_packets"] == 1


def test_decap_hands_ipv6_for_a_bridged_pod_straight_to_its_port(programs6):
    """With [network] bpf_pod_redirect: a decapsulated IPv6 packet for a pod behind a local
    bridge goes to the pod's bridge port as the stack would forward it (FIB, the pod's MAC,
    hop limit - 1); one whose MAC the bridge has not learned takes the stack's path."""
    ns = programs6.ns
    ns.ip("link", "add", "br0", "type", "bridge")
    ns.ip("link", "set", "br0", "up")
    ns.ip("-6", "addr", "add", "fd00:10:244:2::1/64", "dev", "br0", "nodad")
    pod_mac = bytes.fromhex("0200000000bb")
    ns.ip("-6", "neigh", "replace", P2_6, "lladdr", pod_mac.hex(":"), "dev", "br0", "nud", "permanent")
    ns.sysctl("net.ipv6.conf.all.forwarding", 1)
    inner = echo6(src=P1_6, dst=P2_6)
    with ns.entered():
        br0 = int(ns.exec("cat", "/sys/class/net/br0/ifindex"))
        cfg = programs6.config
        programs6.set_config(Config(cfg.local, cfg.udp_port, cfg.vxlan_port, cfg.flags | layout.CFG_POD_REDIRECT,
                                    cfg.mtu))
    assert run(programs6, layout.INGRESS, encap(inner))[0] == TC_ACT_OK  # not learned: the stack's path
    with ns.entered():
        programs6.set_ports({(br0, pod_mac): programs6.ifindex})  # "learned" behind some port
    ret, out = run(programs6, layout.INGRESS, encap(inner))
    assert ret == TC_ACT_REDIRECT and out[:6] == pod_mac and out[6:12] == mac(ns, "br0")
    assert out[14:] == inner[:7] + bytes([inner[7] - 1]) + inner[8:]  # hop limit - 1, nothing else
    assert _drops(programs6) == {}


def test_egress_encapsulates_ipv6_toward_the_real_next_hop(programs6):
    inner = echo6(tclass=0xB8 | 0b10)  # EF, ECT(0)
    ret, out = run(programs6, layout.EGRESS, inner, ETH6)
    assert ret == TC_ACT_OK
    # The next hop's MACs (the stack's neighbour entry for the member), an IPv4 frame now.
    assert out[:6] == MEMBER_MAC and out[6:12] == mac(programs6.ns, "u0") and out[12:14] == b"\x08\x00"
    outer = P.split_ipv4(out[14:])[0]
    assert (outer.src, outer.dst, outer.protocol, outer.tos, outer.ttl) == (LOCAL, MEMBER, 17, 0xB8 | 0b10, 64)
    assert struct.unpack_from("!H", out, 14 + 22)[0] == 8285 and out[14 + 28 :] == inner
    assert programs6.counters()["peers"][MEMBER]["tx_packets"] == 1
    # Not a routed IPv6 pod subnet: untouched.
    other = echo6(dst="fd00:10:244:7::7")
    assert run(programs6, layout.EGRESS, other, ETH6) == (TC_ACT_UNSPEC, ETH6 + other)
    # 1473 bytes + 28 of overhead exceed the 1500-byte underlay: dropped, counted.
    big = echo6(size=1473 - 40 - 8)
    assert len(big) == 1473 and run(programs6, layout.EGRESS, big, ETH6)[0] == TC_ACT_SHOT
    # A peer no route leads to from this device: dropped, counted.
    assert run(programs6, layout.EGRESS, echo6(dst="fd00:10:244:9::7"), ETH6)[0] == TC_ACT_SHOT
    assert _drops(programs6) == {"too_big": 1, "encap_error": 1}
    # The next hop not resolved yet: handed to the neighbour subsystem, which resolves it first.
    programs6.ns.ip("neigh", "del", MEMBER, "dev", "u0")
    ret, out = run(programs6, layout.EGRESS, inner, ETH6)
    assert ret == TC_ACT_REDIRECT and out[14 + 28 :] == inner


def test_ipv6_routes_only_by_udp(programs6):
    before = dict(programs6.routes)
    with pytest.raises(ValueError, match="ipip carries IPv4 pods only"):
        programs6.set_routes({**before, IPv6Network("fd00:10:244:8::/64"): (MEMBER, "ipip")})
    assert programs6.routes == before


# ---------------------------------------------------------------- the member filter on an IPv6 underlay

LOCAL6, MEMBER6, STRANGER6 = "fd00:172:30::2", "fd00:172:30::1", "fd00:172:30::66"
SECOND6 = "fd00:172:30::12"  # another address of the node's


@pytest.fixture
def filter6(netns_factory, bpffs):
    """The data path of a node on an IPv6 underlay: no IPv4 address, VXLAN filtered.  The node
    forwards; its underlay address and a second one are on u0."""
    ns = netns_factory("h6")
    ns.ip("link", "add", "u0", "type", "veth", "peer", "name", "u9")
    for addr in (LOCAL6, SECOND6):
        ns.ip("-6", "addr", "add", f"{addr}/64", "dev", "u0", "nodad")
    for dev in ("u0", "u9"):
        ns.ip("link", "set", dev, "up")
    ns.sysctl("net.ipv6.conf.all.forwarding", 1)
    with ns.entered():
        dp = BpfDatapath(int(ns.exec("cat", "/sys/class/net/u0/ifindex")), bpffs)
        dp.open(Config("0.0.0.0", 8285, 4789, layout.CFG_FILTER_VXLAN, 1500, local6=LOCAL6))
        dp.set_members({MEMBER6})
    dp.ns = ns
    try:
        yield dp
    finally:
        dp.close()


def vxlan6(src: str, *, ext: bytes = b"", first: int = 17, dport: int = 4789, dst: str = LOCAL6) -> bytes:
    """VXLAN over IPv6 (the UDP checksum is not checked here), behind extension headers ``ext``
    whose first next-header value is ``first``."""
    frame = b"\xff" * 6 + b"\x02" * 6 + b"\x86\xdd" + echo6()
    udp = struct.pack("!HHHH", 40000, dport, 8 + 8 + len(frame), 0) + struct.pack("!II", 0x08000000, 1 << 8) + frame
    return ipv6_packet(src, dst, ext + udp, nh=first if ext else 17)


def test_vxlan_over_ipv6_from_non_members_is_dropped_and_counted(filter6):
    def verdict(pkt: bytes) -> int:
        return run(filter6, layout.INGRESS, pkt, ETH6)[0]

    dest_opts = bytes([17, 0]) + bytes([1, 4, 0, 0, 0, 0])  # next UDP, 8 bytes: a PadN option
    first_fragment = bytes([17, 0]) + struct.pack("!HI", 0x0001, 7)  # offset 0, more fragments
    later_fragment = bytes([17, 0]) + struct.pack("!HI", 0x00B9, 7)  # offset 184 (x 8 bytes)
    assert verdict(vxlan6(MEMBER6)) == TC_ACT_UNSPEC  # a member: on to the VXLAN device
    assert verdict(vxlan6(STRANGER6)) == TC_ACT_SHOT
    assert verdict(vxlan6(STRANGER6, ext=dest_opts, first=60)) == TC_ACT_SHOT  # behind an extension header
    assert verdict(vxlan6(STRANGER6, ext=first_fragment, first=44)) == TC_ACT_SHOT
    assert verdict(vxlan6(STRANGER6, ext=later_fragment, first=44)) == TC_ACT_UNSPEC  # no port: reassembly decides
    chain = bytes([60]) + dest_opts[1:]  # a destination options header followed by another
    assert verdict(vxlan6(STRANGER6, ext=chain * 6 + dest_opts, first=60)) == TC_ACT_SHOT  # more than any node sends
    for other in (vxlan6(STRANGER6, dport=4790), vxlan6(STRANGER6, dst="fd00:172:30::9"), echo6(src=STRANGER6, dst=LOCAL6)):
        assert verdict(other) == TC_ACT_UNSPEC  # another port, an address the node forwards to, not UDP
    assert _drops(filter6) == {"non_member_vxlan": 3, "malformed": 1}
    # Whatever the node takes as its own is judged alike: its other address, a multicast group
    # (the VXLAN socket is bound to the wildcard address) -- a member's still passes.
    for dst in (SECOND6, "ff02::1"):
        assert verdict(vxlan6(STRANGER6, dst=dst)) == TC_ACT_SHOT
        assert verdict(vxlan6(MEMBER6, dst=dst)) == TC_ACT_UNSPEC
    assert verdict(vxlan6(STRANGER6, ext=chain * 6 + dest_opts, first=60, dst="fd00:172:30::9")) == TC_ACT_UNSPEC
    assert _drops(filter6) == {"non_member_vxlan": 5, "malformed": 1}


def test_only_udp_behind_the_most_extension_headers_walked_is_malformed(filter6):
    """Six extension headers are walked: a packet whose seventh header is UDP's could be VXLAN,
    unseen, and is dropped as malformed; one that is known not to be UDP by then (TCP behind
    six) is no business of the filter's."""
    dest_opts = bytes([60, 0]) + bytes([1, 4, 0, 0, 0, 0])  # next another destination options header
    last = bytes([6]) + dest_opts[1:]  # ... next TCP
    tcp = P.TcpHeader(40000, 4789, 1, 0, P.TCP_ACK, 1000).encode()  # (its checksum not checked here)
    six_then_tcp = ipv6_packet(STRANGER6, LOCAL6, dest_opts * 5 + last + tcp, nh=60)
    assert run(filter6, layout.INGRESS, six_then_tcp, ETH6) == (TC_ACT_UNSPEC, ETH6 + six_then_tcp)
    assert _drops(filter6) == {}
    assert filter6.members == {MEMBER6} and filter6.status()["members"] == 1

