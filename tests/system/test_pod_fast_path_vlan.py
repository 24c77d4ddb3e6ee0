"""The pod fast path and 802.1Q tags: a pod with CAP_NET_RAW can send a tagged frame whose
addresses and ports are those of one of its accepted connections.  At tc ingress on the pod's
veth the tag is already out of the frame (skb->vlan_tci), so the frame looks like the
connection's next segment; the stack would drop it (no VLAN device for it on the veth), and the
fast path must leave it to the stack -- carried, it would leave by the underlay device still
tagged, into another VLAN.  Between two hosts built by hand (tests/dualstack_hosts.py) with the
BPF udp data path and conntrack on, IPv4 and IPv6 alike.
"""

from __future__ import annotations

import socket
import sys
from ipaddress import IPv4Network, IPv6Network

import pytest
from dualstack_hosts import capture, mac, pairs

from agentd.dataplane.bpf.podpath import PodFastPath
from agentd.lab.twohosts import P1, P1_6, P2, P2_6, wait_for
from proto import packet as P

pytestmark = pytest.mark.timeout(120)

PORT, CLIENT_PORT = 5003, 40123
RULES = """
table inet adfpv {
  chain forward { type filter hook forward priority 0; policy accept; ct state established,related accept; }
}
"""
SERVER = """
import socket, sys
s = socket.socket(socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
c, _ = s.accept()
print("accepted", flush=True)
c.recv(1)
"""
CLIENT = """
import socket, sys
s = socket.socket(socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET)
s.bind(("", int(sys.argv[3])))
s.connect((sys.argv[1], int(sys.argv[2])))
print("connected", flush=True)
s.recv(1)
"""


@pytest.fixture
def hosts(netns_factory, bpffs):
    """Two hosts, pod 1 and pod 2 on them, the pod fast path on both."""
    with pairs(netns_factory, bpffs) as make:
        pair = make()
        t = pair.t
        made = []
        try:
            for host, dev, pods in ((t.h1, "u1", {P1: "vp1", P1_6: "vp1"}), (t.h2, "u2", {P2: "vp2", P2_6: "vp2"})):
                host.exec("nft", "-f", "-", input=RULES.encode())
                with host.entered():
                    fp = PodFastPath(bpffs, cluster=IPv4Network("10.244.0.0/16"),
                                     cluster_v6=IPv6Network("fd00:10:244::/48"),
                                     wire_ifindex=int(host.exec("cat", f"/sys/class/net/{dev}/ifindex")))
                    fp.open()
                    made.append(fp)
                    fp.set_pods(pods)
            yield pair, made[0]
        finally:
            for fp in made:
                fp.close()


def carried(fp: PodFastPath, family: str) -> int:
    return fp.counters()[family]["carried"]["packets"]


@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_a_tagged_frame_of_an_accepted_connection_is_not_carried(hosts, family):
    pair, fp1 = hosts
    t = pair.t
    src, dst = (P1, P2) if family == "ipv4" else (P1_6, P2_6)
    server = t.p2.popen([sys.executable, "-c", SERVER, dst, str(PORT)], stdout=-1, text=True)
    client = None
    try:
        assert wait_for(lambda: t.p2.exec("ss", "-Hltn", f"sport = :{PORT}").strip(), 10)
        client = t.p1.popen([sys.executable, "-c", CLIENT, dst, str(PORT), str(CLIENT_PORT)], stdout=-1, text=True)
        assert client.stdout.readline().strip() == "connected" and server.stdout.readline().strip() == "accepted"
        # The connection is established in host 1's conntrack (the fast path asks it).
        assert wait_for(lambda: any(" ESTABLISHED " in line and f"sport={CLIENT_PORT} " in line
                                    for line in t.h1.exec("cat", "/proc/net/nf_conntrack").splitlines()), 10)
        # The connection's next segment (a pure ACK, its numbers not checked by the fast path)
        # from pod 1 to host 1's side of its veth: tagged (VLAN 5), then untagged.
        segment = P.TcpHeader(CLIENT_PORT, PORT, 1, 1, P.TCP_ACK, 1000)
        ip = P.tcp_packet(src, dst, segment) if family == "ipv4" else P.tcp6_packet(src, dst, segment)
        ethertype = b"\x08\x00" if family == "ipv4" else b"\x86\xdd"
        macs = mac(t.h1, "vp1") + mac(t.p1, "eth0")
        tagged, untagged = macs + b"\x81\x00\x00\x05" + ethertype + ip, macs + ethertype + ip
        before = carried(fp1, family)

        def send() -> None:
            with t.p1.entered():
                s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
            with s:
                s.bind(("eth0", 0))
                s.send(tagged)
                s.send(untagged)  # carried: the fast path was there for the connection

        # Nothing tagged leaves host 1 by its underlay device.
        assert [eth for _len, eth, _ip in capture(t.h1, "u1", "vlan", send, settle=1.0)] == []
        assert carried(fp1, family) >= before + 1
    finally:
        for proc in (client, server):
            if proc is not None:
                proc.kill()
                proc.wait()
                proc.stdout.close()
