"""The pod fast path (agentd/dataplane/bpf/podpath.c) for IPv6 TCP, between two dual-stack
hosts built by hand (tests/dualstack_hosts.py) with conntrack on (an nftables forward chain
that reads ct state, as the policy tables do), with both hooks:

* over the BPF udp data path: an accepted IPv6 connection is carried pod to pod on one node
  (bpf_redirect_peer) and toward the other node's pod (bpf_fib_lookup with AF_INET6, hop
  limit - 1, then the data path's encapsulation), counted apart from IPv4's; a translated
  (DNAT, as a Service) IPv6 connection stays on the stack's path, counted "nat"; every
  transfer arrives intact and conntrack sees each connection close;
* routed directly (host-gw over the peer's link-local address): the underlay's program
  (agentd_pod_wire) carries the other node's packets into the pod;
* counting per connection (flow records on): what is carried of each IPv6 connection is in
  agentd_podflow6 by its two ends, and a connection reusing a tuple hands the one before's
  counts to the agent through the ring.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from ipaddress import IPv4Network, IPv6Network

import pytest
from dualstack_hosts import (
    HOOKS,
    SIZES_SINK,
    SIZES_SOURCE,
    pairs,
    ping6,
    refused,
    transfer6,
    usable,
)

from agentd.dataplane.bpf.podpath import FLOWS6, PodFastPath
from agentd.flows.recorder import carried_key
from agentd.lab.netns import veth
from agentd.lab.twohosts import P1, P1_6, P2_6, SUBNET2_6, build_two_hosts, wait_for

pytestmark = pytest.mark.timeout(180)

P3_6 = "fd00:10:244:5::2"  # a second pod on host 1
SERVICE_6 = "fd00:10:244:99::1"  # translated to pod 2, as a Service's address would be
RULES = f"""
table inet adfp {{
  chain forward {{ type filter hook forward priority 0; policy accept; ct state established,related accept; }}
}}
table ip6 adfpnat {{
  chain pre {{ type nat hook prerouting priority -100; ip6 daddr {SERVICE_6} tcp dport 5001 dnat to [{P2_6}]:5001; }}
}}
"""


def conntrack_on(ns) -> None:
    ns.exec("nft", "-f", "-", input=RULES.encode())


def add_pod3(t, make, mtu: int):
    p3 = make("p3")
    veth(t.h1, "vp3", p3, "eth0")
    t.h1.ip("-6", "addr", "add", "fd00:10:244:5::1/64", "dev", "vp3", "nodad")
    p3.ip("-6", "addr", "add", f"{P3_6}/64", "dev", "eth0", "nodad")
    p3.ip("-6", "route", "add", "default", "via", "fd00:10:244:5::1")
    for ns, dev in ((p3, "eth0"), (t.h1, "vp3")):
        ns.ip("link", "set", dev, "mtu", str(mtu))
    return p3


def fast_path(host, bpf_dir: str, hook: str, dev: str) -> PodFastPath:
    with host.entered():
        fp = PodFastPath(bpf_dir, cluster=IPv4Network("10.244.0.0/16"), cluster_v6=IPv6Network("fd00:10:244::/48"),
                         wire_ifindex=int(host.exec("cat", f"/sys/class/net/{dev}/ifindex")), attach=hook)
        fp.open()
    return fp


def v6(fp: PodFastPath, verdict: str, what: str = "packets") -> int:
    counts = fp.counters()  # both families' counters
    assert counts["ipv4"]["carried"]["packets"] == 0  # only IPv6 flows here: IPv4's stay at 0
    return counts["ipv6"][verdict][what]


def closed(host) -> list[str]:
    """The IPv6 connections to port 5001 conntrack saw close."""
    lines = host.exec("cat", "/proc/net/nf_conntrack").splitlines()
    return [x for x in lines if x.startswith("ipv6") and " tcp " in x and "dport=5001 " in x
            and ("TIME_WAIT" in x or "CLOSE" in x)]


@pytest.fixture
def setup(netns_factory, bpffs):
    made: list[PodFastPath] = []
    with pairs(netns_factory, bpffs) as make:
        def build(hook: str):
            pair = make(hook)
            t = pair.t
            p3 = add_pod3(t, netns_factory, pair.mtu)
            for host in (t.h1, t.h2):
                conntrack_on(host)
            fp1 = fast_path(t.h1, bpffs, hook, "u1")
            fp2 = fast_path(t.h2, bpffs, hook, "u2")
            made.extend((fp1, fp2))
            with t.h1.entered():
                fp1.set_pods({P1: "vp1", P1_6: "vp1", P3_6: "vp3"})
            with t.h2.entered():
                fp2.set_pods({P2_6: "vp2"})
            assert wait_for(lambda: "1 received" in ping6(t.p1, P3_6, count=1), 15)
            return pair, p3, fp1, fp2

        try:
            yield build
        finally:
            for fp in made:
                fp.close()


@pytest.mark.parametrize("hook", HOOKS)
def test_ipv6_connections_are_carried_and_translated_ones_are_not(setup, hook):
    if not usable(hook):
        return refused(lambda: setup(hook))
    pair, p3, fp1, fp2 = setup(hook)
    t = pair.t
    assert fp1.status()["ipv6"] | {"packets": None} == {"pods": 2, "cluster": "fd00:10:244::/48", "packets": None}
    assert fp1.status()["pods"] == 2 and fp1.status()["between_nodes"]["on"]  # two veths, three addresses

    # Same node: pod to pod.
    sent, got = transfer6(t.p1, p3, P3_6, 8 << 20)
    assert sent == got
    carried = v6(fp1, "carried", "bytes")
    assert carried > 4 << 20, fp1.last

    # To the other node's pod: routed by the fast path into the data path's encapsulation.
    sent, got = transfer6(t.p1, t.p2, P2_6, 8 << 20)
    assert sent == got
    assert v6(fp1, "carried", "bytes") > carried + (4 << 20), fp1.last
    assert v6(fp2, "carried") > 10, fp2.last  # pod 2's acknowledgements, toward node 1 (as many as it sends)

    # Translated: the stack's path, which translates.
    nat = v6(fp1, "nat")
    sent, got = transfer6(t.p1, t.p2, SERVICE_6, 2 << 20)
    assert sent == got
    assert v6(fp1, "nat") > nat + 50, fp1.last
    # Conntrack saw the FINs (they take the stack's path): every connection closed.
    assert wait_for(lambda: len(closed(t.h1)) >= 3, 10), t.h1.exec("cat", "/proc/net/nf_conntrack")
    assert len(closed(t.h2)) >= 2


@pytest.mark.parametrize("hook", HOOKS)
def test_ipv6_from_the_wire_into_the_pod_when_routed_directly(netns_factory, bpffs, hook):
    """host-gw for IPv6: the other node's pod packets arrive plain on the underlay, where
    agentd_pod_wire carries those of accepted connections into the pod."""
    t = build_two_hosts(netns_factory, ipv6=True)
    if not usable(hook):
        return refused(lambda: fast_path(t.h1, bpffs, hook, "u1"))
    for host, dev, other, other_dev, subnet in ((t.h1, "u1", t.h2, "u2", SUBNET2_6),
                                                (t.h2, "u2", t.h1, "u1", "fd00:10:244:1::/64")):
        ll = other.exec("ip", "-6", "-br", "addr", "show", "dev", other_dev).split()[2].split("/")[0]
        host.ip("-6", "route", "add", subnet, "via", ll, "dev", dev)
        conntrack_on(host)
    fp1, fp2 = fast_path(t.h1, bpffs, hook, "u1"), fast_path(t.h2, bpffs, hook, "u2")
    try:
        with t.h1.entered():
            fp1.set_pods({P1_6: "vp1"})
        with t.h2.entered():
            fp2.set_pods({P2_6: "vp2"})
        assert wait_for(lambda: "1 received" in ping6(t.p1, P2_6, count=1), 15)
        sent, got = transfer6(t.p1, t.p2, P2_6, 8 << 20)
        assert sent == got
        # Node 2 carried pod 1's data in from the wire; node 1 carried it out of pod 1's veth.
        assert v6(fp2, "carried", "bytes") > 4 << 20, fp2.last
        assert v6(fp1, "carried", "bytes") > 4 << 20, fp1.last
    finally:
        fp1.close()
        fp2.close()


def send_sizes(src, dst, dst_ip: str, sport: int, sizes: list[int]) -> None:
    args = [str(n) for n in sizes]
    sink = dst.popen([sys.executable, "-c", SIZES_SINK, "::", "5001", *args], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        src.exec(sys.executable, "-c", SIZES_SOURCE, dst_ip, "5001", str(sport), *args, timeout=60)
        assert sink.communicate(timeout=30)[0].split() == args
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.communicate()


def test_ipv6_connections_are_counted_per_connection_and_a_reused_tuple_hands_its_counts_on(setup, bpffs):
    """With counting on, each carried IPv6 connection's bytes are in the IPv6 map under its
    two ends (the lower first), on one node and on both nodes between them; a second
    connection from the same port moves the first's counts to the ring at its SYN.  An agent
    that finds the pins of one from before the IPv6 map adopts the others and makes it."""
    hook = next(h for h in HOOKS if usable(h))  # the programs count alike under either hook
    pair, p3, fp1, fp2 = setup(hook)
    t = pair.t
    for host, fp in ((t.h1, fp1), (t.h2, fp2)):
        with host.entered():
            fp.set_counting(True)

    def within(counts, size: int) -> bool:  # the payload and at most 80 octets of headers per 1,000
        return size <= counts[2] <= size + 80 * (size // 1000)  # bytes sent by the lower end (pod 1)

    six = {a: socket.inet_pton(socket.AF_INET6, a) for a in (P1_6, P2_6, P3_6)}
    local, _ = carried_key(six[P1_6], 41201, six[P3_6], 5001)
    remote, _ = carried_key(six[P1_6], 41202, six[P2_6], 5001)
    assert six[P1_6] < six[P3_6] and six[P1_6] < six[P2_6]  # pod 1 is the lower end of both
    send_sizes(t.p1, p3, P3_6, 41201, [3_000_000, 1_000_000])
    send_sizes(t.p1, t.p2, P2_6, 41202, [2_000_000])

    (moved,) = [c for k, c in fp1.carried_restarts() if k == local]  # by the second connection's SYN
    assert within(moved, 3_000_000) and moved[4] > 0, moved
    second = fp1.take_carried(local)
    assert second is not None and within(second, 1_000_000) and second[4] > moved[4], second
    # Node 1 carried the data out of pod 1's veth (into the data path's encapsulation); node 2
    # pod 2's acknowledgements out of its veth (the higher end's count; the data came in by the
    # data path, past this program: conntrack counts it there).
    out, acks = fp1.take_carried(remote), fp2.take_carried(remote)
    assert out is not None and within(out, 2_000_000), out
    assert acks is not None and acks[0] == 0 and acks[1] > 10 and acks[3] > 0, acks
    assert fp1.take_carried(remote) is None  # taken

    fp1.close()
    (fp1.dir / FLOWS6).unlink()  # as an older agent left its pins
    again = fast_path(t.h1, bpffs, hook, "u1")
    try:
        assert again.adopted and (again.dir / FLOWS6).exists() and again.pods == fp1.pods
        with t.h1.entered():
            again.set_counting(True)
        send_sizes(t.p1, p3, P3_6, 41203, [1_000_000])
        counts = again.take_carried(carried_key(six[P1_6], 41203, six[P3_6], 5001)[0])
        assert counts is not None and within(counts, 1_000_000), counts
    finally:
        again.close()
