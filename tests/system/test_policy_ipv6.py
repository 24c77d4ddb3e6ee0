"""NetworkPolicy over IPv6 and dual-stack, on the real kernel, in namespaces of the test's own.

One node namespace with the pod bridge ``cni0`` and three pods x/a, x/b, x/c on it (each with
an IPv4 and an IPv6 address), and y/r, a pod of "another node" reached through a routed link
(so its traffic crosses the node's forward hook, as traffic between nodes does).  The policy
engine compiles for both families and the programmer writes the node's tables; every
scenario's probe matrix (TCP and UDP, over IPv4 and over IPv6, every pod to every other)
must equal what tests/netpol_model.py - the independent model - says.  Then the IPv6 parts
only the bridge table has: a pod's foreign IPv6 source is dropped and counted, a router
advertisement from a pod reaches no other pod, and neighbour discovery works to and from an
isolated pod (caches flushed, the allowed peer still gets through).  Last, crafted frames a pod
with a raw socket can send: VLAN-tagged ones, the other family of a single-family cluster,
routed ICMPv6 of neighbour discovery's types, ARP claiming another pod's address.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
from netpol_model import Cluster, ModelPod, allowed

from agentd.lab.netns import Netns, veth
from agentd.lab.probe import Prober
from agentd.lab.wait import auntil
from agentd.nft.libnftables import Nft
from agentd.nft.programmer import NftProgrammer
from agentd.policy import compiler
from agentd.policy.engine import PolicyEngine
from agentd.policy.model import LocalPort, NamedPort, Pod, Policy
from agentd.resources import kinds

pytestmark = pytest.mark.asyncio(loop_scope="module")

PODS = {  # name -> (namespace, IPv4, IPv6, node)
    "a": ("x", "10.244.1.2", "fd00:10:244:1::2", "node1"),
    "b": ("x", "10.244.1.3", "fd00:10:244:1::3", "node1"),
    "c": ("x", "10.244.1.4", "fd00:10:244:1::4", "node1"),
    "r": ("y", "10.244.2.2", "fd00:10:244:2::2", "node2"),
}
PORTS = [{"name": "serve-80-tcp", "containerPort": 80, "protocol": "TCP"},
         {"name": "serve-81-udp", "containerPort": 81, "protocol": "UDP"}]  # fmt: skip
PROBES = [("TCP", 80), ("UDP", 81)]


class Node:
    """The node namespace, its pods, the engine and the programmer of its tables."""

    def __init__(self, ns: Netns, pods: dict[str, Netns]) -> None:
        self.ns = ns
        self.pods = pods
        self.engine = PolicyEngine("node1", families=(4, 6))
        self.nft = Nft(netns=ns.path)
        self.programmer = NftProgrammer(self.nft, compiler.TABLES, "policy")
        self.probers: dict[str, Prober] = {}

    async def sync(self) -> None:
        await self.programmer.sync(self.engine.build(), self.engine.touched())

    async def apply(self, *manifests: dict[str, Any]) -> None:
        for m in manifests:
            self.engine.upsert_policy(Policy.parse(kinds.validate(m)))
        await self.sync()

    async def clear(self) -> None:
        for key in list(self.engine.policies):
            self.engine.remove_policy(key)
        await self.sync()

    def spoofed(self) -> int:
        listing = json.loads(self.ns.exec("nft", "-j", "list", "counter", "bridge", "agentd-policy", "spoofed"))
        return next(i["counter"]["packets"] for i in listing["nftables"] if "counter" in i)


def _setup(make: Any) -> Node:
    node = make("node")
    pods = {name: make(name) for name in PODS}
    for ns in [node, *pods.values()]:
        # Addresses usable at once (no duplicate address detection wait), link-local ones too.
        ns.sysctl("net.ipv6.conf.default.accept_dad", 0)
        ns.sysctl("net.ipv6.conf.all.accept_dad", 0)
    node.sysctl("net.ipv4.ip_forward", 1)
    node.sysctl("net.ipv6.conf.all.forwarding", 1)
    if has_br_netfilter(node):  # the path agentd builds: same-node traffic handed up by the bridge table
        node.sysctl("net.bridge.bridge-nf-call-iptables", 0)
        node.sysctl("net.bridge.bridge-nf-call-ip6tables", 0)
    node.ip("link", "add", "cni0", "type", "bridge")
    node.ip("addr", "add", "10.244.1.1/24", "dev", "cni0")
    node.ip("-6", "addr", "add", "fd00:10:244:1::1/64", "dev", "cni0")
    node.ip("link", "set", "cni0", "up")
    result = Node(node, pods)
    for name, (ns_name, v4, v6, where) in PODS.items():
        pod = pods[name]
        host = f"veth{name}"
        veth(node, host, pod, "eth0")
        pod.ip("addr", "add", f"{v4}/24", "dev", "eth0")
        pod.ip("-6", "addr", "add", f"{v6}/64", "dev", "eth0")
        if where == "node1":
            node.ip("link", "set", host, "master", "cni0")
        else:  # a routed link: the node is its gateway, as it is for another node's pods
            node.ip("addr", "add", f"{v4.rsplit('.', 1)[0]}.1/24", "dev", host)
            node.ip("-6", "addr", "add", f"{v6.rsplit(':', 1)[0]}:1/64", "dev", host)
        gw4, gw6 = v4.rsplit(".", 1)[0] + ".1", v6.rsplit(":", 1)[0] + ":1"
        pod.ip("route", "add", "default", "via", gw4)
        pod.ip("-6", "route", "add", "default", "via", gw6)
        ports = tuple(NamedPort(p["name"], p["containerPort"], p["protocol"]) for p in PORTS)
        ips = (_addr(v4), _addr(v6))
        local = None
        if where == "node1":
            (link,) = json.loads(node.exec("ip", "-j", "link", "show", "dev", host))
            local = LocalPort(host, link["address"], "cni0")
        result.engine.upsert_pod(Pod(ns_name, name, where, ips, {"pod": name}, ports), local)
    return result


def _addr(text: str) -> Any:
    import ipaddress

    return ipaddress.ip_address(text)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node():
    from agentd.lab.netns import delete_matching, unique_tag

    tag = unique_tag()
    made: list[Netns] = []

    def make(role: str) -> Netns:
        ns = Netns.create(f"ad-{tag}-{role}")
        made.append(ns)
        return ns

    n = None
    try:
        n = _setup(make)
        await n.sync()
        for name, pod in n.pods.items():
            n.probers[name] = await Prober.start(SimpleNamespace(ns=pod, name=name),
                                                 [(p["protocol"].lower(), p["containerPort"]) for p in PORTS])  # fmt: skip
        yield n
    finally:
        if n is not None:
            for p in n.probers.values():
                await p.close()
            n.nft.close()
        for ns in reversed(made):
            ns.delete()
        delete_matching(f"ad-{tag}-")


def model(policies: list[dict[str, Any]]) -> Cluster:
    pods = [ModelPod(ns, name, v4, {"pod": name}, {p["name"]: (p["containerPort"], p["protocol"]) for p in PORTS}, v6)
            for name, (ns, v4, v6, _) in PODS.items()]  # fmt: skip
    return Cluster(pods, {}, policies)


async def check(node: Node, policies: list[dict[str, Any]]) -> None:
    """The whole matrix over both families equals the model; a failed allowed probe is retried."""
    cluster = model(policies)
    by_name = {p.name: p for p in cluster.pods}
    cells = [(s, d, proto, port, fam) for s in PODS for d in PODS if s != d for proto, port in PROBES for fam in (4, 6)]
    want = {c: allowed(cluster, by_name[c[0]], by_name[c[1]], c[2], c[3], c[4]) for c in cells}

    async def run(batch: list[tuple[str, str, str, int, int]], timeout: float) -> dict[Any, bool]:
        by_src: dict[str, list[Any]] = {}
        for c in batch:
            by_src.setdefault(c[0], []).append(c)
        results = await asyncio.gather(*(
            node.probers[s].probe([(PODS[c[1]][2 if c[4] == 6 else 1], c[2].lower(), c[3]) for c in cs], timeout)
            for s, cs in by_src.items()))  # fmt: skip
        return {c: ok for cs, oks in zip(by_src.values(), results) for c, ok in zip(cs, oks)}

    got = await run(cells, 1.0)
    retry = [c for c in cells if want[c] and not got[c]]
    if retry:
        got.update(await run(retry, 3.0))
    wrong = sorted(f"{s}->{d} {p}/{n} IPv{f}: expected {'allowed' if want[(s, d, p, n, f)] else 'denied'}"
                   for (s, d, p, n, f), ok in got.items() if ok != want[(s, d, p, n, f)])  # fmt: skip
    assert not wrong, f"{len(wrong)} of {len(cells)} probes differ from the model:\n" + "\n".join(wrong)


def np(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name, "namespace": "x"}, "spec": spec}


SCENARIOS = {
    "no policy": [],
    "default deny ingress": [np("deny", {"podSelector": {}})],
    "from pod b only, over both families": [np("p", {"podSelector": {"matchLabels": {"pod": "a"}},
                                                     "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}]}]})],
    "ipBlocks of both families with excepts": [np("p", {"podSelector": {}, "ingress": [{"from": [
        {"ipBlock": {"cidr": "fd00:10:244::/48", "except": ["fd00:10:244:1::3/128", "fd00:10:244:2::/64"]}},
        {"ipBlock": {"cidr": "10.244.0.0/16", "except": ["10.244.1.4/32"]}}]}]})],
    "egress to an IPv6 block on UDP only": [np("p", {"podSelector": {"matchLabels": {"pod": "a"}}, "policyTypes": ["Egress"],
        "egress": [{"to": [{"ipBlock": {"cidr": "fd00:10:244:2::/64"}}], "ports": [{"protocol": "UDP"}]}]})],
    "named ports resolve on both addresses": [np("p", {"podSelector": {}, "ingress": [{"ports": [{"port": "serve-81-udp", "protocol": "UDP"}]}],
        "egress": [{"to": [{"namespaceSelector": {}}], "ports": [{"port": "serve-80-tcp"}]}], "policyTypes": ["Ingress", "Egress"]})],
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_truth_table_over_both_families(node: Node, name: str):
    policies = SCENARIOS[name]
    try:
        await node.apply(*policies)
        await check(node, policies)
    finally:
        await node.clear()


SEND_FROM = """
import socket, sys
src, dst = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.bind((src, 0))
for _ in range(5):
    s.sendto(b"x", (dst, 81))
"""


async def test_a_foreign_ipv6_source_is_dropped_and_counted(node: Node):
    """Pod b borrows pod c's IPv6 address: what it sends with it reaches nobody."""
    b = node.pods["b"]
    before = await asyncio.to_thread(node.spoofed)
    b.ip("-6", "addr", "add", "fd00:10:244:1::4/128", "dev", "eth0", "nodad")
    try:
        await asyncio.to_thread(b.exec, sys.executable, "-c", SEND_FROM, "fd00:10:244:1::4", "fd00:10:244:2::2")
        assert await asyncio.to_thread(node.spoofed) >= before + 5
    finally:
        b.ip("-6", "addr", "del", "fd00:10:244:1::4/128", "dev", "eth0")
    # b's own address still goes everywhere (nothing isolates anyone here).
    assert await node.probers["b"].probe([("fd00:10:244:2::2", "udp", 81), ("fd00:10:244:1::2", "tcp", 80)], 3.0) == [True, True]


LISTEN = """
import socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
s.settimeout(20)
print("ready", flush=True)
seen = []
while True:
    data, addr = s.recvfrom(2048)
    seen.append(data[0])
    if data[0] == 128 and data[4:8] == b"mark":  # our echo request: everything before it has arrived
        break
print(",".join(map(str, seen)), flush=True)
"""

SEND_RA = """
import socket
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, 255)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, socket.if_nametoindex("eth0"))
# A router advertisement (type 134): hop limit 64, lifetime 1800 s: "I am your default router".
ra = bytes([134, 0, 0, 0, 64, 0]) + (1800).to_bytes(2, "big") + bytes(8)
s.sendto(ra, ("ff02::1", 0))
s.sendto(bytes([128, 0, 0, 0]) + b"mark", ("ff02::1", 0))  # an echo request after it, the marker
"""


async def test_a_router_advertisement_from_a_pod_reaches_no_other_pod(node: Node):
    a, c = node.pods["a"], node.pods["c"]
    before = await asyncio.to_thread(node.spoofed)
    listener = a.popen([sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None
        assert (await asyncio.to_thread(listener.stdout.readline)).strip() == "ready"
        await asyncio.to_thread(c.exec, sys.executable, "-c", SEND_RA)
        seen = (await asyncio.to_thread(listener.stdout.readline)).strip().split(",")
    finally:
        listener.kill()
        listener.wait()
        listener.stdout.close()  # type: ignore[union-attr]
    assert "128" in seen and "134" not in seen, seen  # the marker came, the advertisement before it did not
    assert await asyncio.to_thread(node.spoofed) >= before + 1
    routes = a.exec("ip", "-6", "route", "show", "default")
    assert "proto ra" not in routes and "fd00:10:244:1::1" in routes, routes


@pytest.mark.parametrize("br_netfilter", [0, 1])
async def test_neighbour_discovery_works_for_an_isolated_pod(node: Node, br_netfilter: int):
    """Isolated both ways, with b allowed in: after every neighbour cache is flushed, b still
    reaches a over IPv6 (b -> node, node -> a, a -> node resolved anew) and c does not.  With
    br_netfilter handing bridged frames to the IP hooks as well (kubelet hosts, Docker)."""
    if br_netfilter and not has_br_netfilter(node.ns):
        pytest.fail("br_netfilter is not loaded (scripts/dev setup loads it: modprobe br_netfilter)")
    policies = [np("p", {"podSelector": {"matchLabels": {"pod": "a"}}, "policyTypes": ["Ingress", "Egress"],
                         "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}]}]})]  # fmt: skip
    try:
        if has_br_netfilter(node.ns):
            node.ns.sysctl("net.bridge.bridge-nf-call-ip6tables", br_netfilter)
        await node.apply(*policies)
        for ns in (node.ns, node.pods["a"], node.pods["b"], node.pods["c"]):
            ns.ip("-6", "neigh", "flush", "all")
        assert await node.probers["b"].probe([("fd00:10:244:1::2", "tcp", 80)], 3.0) == [True]
        assert await node.probers["c"].probe([("fd00:10:244:1::2", "tcp", 80)], 1.0) == [False]
        for ns, peer in ((node.ns, "fd00:10:244:1::2"), (node.pods["b"], "fd00:10:244:1::2"), (node.pods["a"], "fd00:10:244:1::3")):
            neighbours = ns.exec("ip", "-6", "neigh", "show", peer)
            assert "lladdr" in neighbours and "FAILED" not in neighbours, (ns.name, neighbours)
        await check(node, policies)
    finally:
        if has_br_netfilter(node.ns):
            node.ns.sysctl("net.bridge.bridge-nf-call-ip6tables", 0)
        await node.clear()


def has_br_netfilter(ns: Netns) -> bool:
    return "bridge-nf-call-ip6tables" in ns.exec("ls", "/proc/sys/net/bridge", check=False)


# ------------------------------------------------------------------ crafted frames from a pod (raw sockets)
# What a pod with CAP_NET_RAW can send past the kernel's own stack: tagged frames, the other
# family of a single-family cluster, routed ICMPv6 of neighbour discovery's types, ARP that
# claims another pod's address.

SEND_FRAMES = """
import socket, sys
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth0", 0))
for frame in sys.argv[1:]:
    for _ in range(3):
        s.send(bytes.fromhex(frame))
"""

UDP_LISTEN = """
import socket, sys
s = socket.socket(socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
s.settimeout(10)
print("ready", flush=True)
seen = []
while True:
    data = s.recv(2048).decode()
    seen.append(data)
    if data == "mark":  # sent after everything else: what came before it has arrived
        break
print(",".join(seen), flush=True)
"""

SEND_UDP = """
import socket, sys
s = socket.socket(socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET, socket.SOCK_DGRAM)
s.sendto(sys.argv[3].encode(), (sys.argv[1], int(sys.argv[2])))
"""


def mac_of(ns: Netns, dev: str) -> bytes:
    (link,) = json.loads(ns.exec("ip", "-j", "link", "show", "dev", dev))
    return bytes.fromhex(link["address"].replace(":", ""))


def _checksum(data: bytes) -> int:
    total = sum(int.from_bytes(data[i:i + 2], "big") for i in range(0, len(data) - 1, 2)) + (data[-1] << 8 if len(data) % 2 else 0)
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def ether(dst: bytes, src: bytes, ether_type: int, body: bytes, vid: int | None = None) -> str:
    tag = b"" if vid is None else (0x8100).to_bytes(2, "big") + vid.to_bytes(2, "big")
    return (dst + src + tag + ether_type.to_bytes(2, "big") + body).hex()


def udp4(src: str, dst: str, dport: int, payload: bytes) -> bytes:
    import socket

    udp = (40000).to_bytes(2, "big") + dport.to_bytes(2, "big") + (8 + len(payload)).to_bytes(2, "big") + b"\0\0" + payload
    header = bytearray(b"\x45\x00" + (20 + len(udp)).to_bytes(2, "big") + b"\0\0\0\0\x40\x11\0\0"
                       + socket.inet_aton(src) + socket.inet_aton(dst))  # fmt: skip
    header[10:12] = _checksum(bytes(header)).to_bytes(2, "big")
    return bytes(header) + udp


async def _udp_seen(receiver: Netns, address: str, port: int, send: Any) -> list[str]:
    """What ``receiver`` gets on ``address``:``port`` of what ``send()`` makes pods send, up to
    a marker the node sends after it (the node's own traffic to a pod is never judged)."""
    listener = receiver.popen([sys.executable, "-c", UDP_LISTEN, address, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None
        assert (await asyncio.to_thread(listener.stdout.readline)).strip() == "ready"
        await send()
        return (await asyncio.to_thread(listener.stdout.readline)).strip().split(",")
    finally:
        listener.kill()
        listener.wait()
        listener.stdout.close()  # type: ignore[union-attr]


async def test_a_vlan_tagged_frame_reaches_no_isolated_pod(node: Node):
    """Pod a isolated (ingress: nothing allowed); pod c sends it UDP in a frame with a VID 0
    tag, which a's kernel takes as untagged: the bridge table must drop it (and count it) as it
    drops the untagged frame, which it hands up to be judged."""
    a, b, c = node.pods["a"], node.pods["b"], node.pods["c"]
    try:
        await node.apply(np("deny", {"podSelector": {"matchLabels": {"pod": "a"}}}))
        before = await asyncio.to_thread(node.spoofed)
        src = mac_of(c, "eth0")

        async def send() -> None:
            frames = [ether(mac_of(a, "eth0"), src, 0x0800, udp4("10.244.1.4", "10.244.1.2", 9999, b"tagged"), vid=0),
                      ether(mac_of(a, "eth0"), src, 0x0800, udp4("10.244.1.4", "10.244.1.2", 9999, b"untagged"))]  # fmt: skip
            await asyncio.to_thread(c.exec, sys.executable, "-c", SEND_FRAMES, *frames)
            await asyncio.to_thread(node.ns.exec, sys.executable, "-c", SEND_UDP, "10.244.1.2", "9999", "mark")

        assert await _udp_seen(a, "10.244.1.2", 9999, send) == ["mark"]

        async def send_b() -> None:
            await asyncio.to_thread(c.exec, sys.executable, "-c", SEND_FRAMES,
                                    ether(mac_of(b, "eth0"), src, 0x0800, udp4("10.244.1.4", "10.244.1.3", 9999, b"to-b")))  # fmt: skip
            await asyncio.to_thread(node.ns.exec, sys.executable, "-c", SEND_UDP, "10.244.1.3", "9999", "mark")

        # b is not isolated: the same crafted frame, untagged, reaches it (the control).
        assert await _udp_seen(b, "10.244.1.3", 9999, send_b) == ["to-b"] * 3 + ["mark"]
        assert await asyncio.to_thread(node.spoofed) >= before + 3
    finally:
        await node.clear()


@pytest.mark.parametrize("family", [4, 6])
async def test_the_family_a_single_family_cluster_has_not_leaves_no_pod(node: Node, family: int):
    """The node's tables as a single-family cluster's agent writes them (the family ``family``
    only), pod a isolated for egress: the other family, which no chain would judge once the
    node routed it, does not get from a to r (another node's pod) either."""
    engine = PolicyEngine("node1", families=(family,))
    for key, pod in node.engine.pods.items():
        engine.upsert_pod(pod, node.engine.local.get(key))
    engine.upsert_policy(Policy.parse(kinds.validate(
        np("deny", {"podSelector": {"matchLabels": {"pod": "a"}}, "policyTypes": ["Egress"]}))))  # fmt: skip
    own, other = (PODS["r"][1], PODS["r"][2]) if family == 4 else (PODS["r"][2], PODS["r"][1])
    try:
        await node.programmer.sync(engine.build(), None)
        assert await node.probers["a"].probe([(own, "udp", 81), (other, "udp", 81), (other, "tcp", 80)], 1.0) == [False] * 3
        if family == 6:  # neighbour discovery is IPv6's: b still gets through (nothing isolates it)
            node.pods["b"].ip("-6", "neigh", "flush", "all")
            assert await node.probers["b"].probe([(own, "tcp", 80)], 3.0) == [True]
    finally:
        await node.programmer.sync(node.engine.build(), None)


ND_LISTEN = """
import socket
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
s.settimeout(10)
print("ready", flush=True)
seen = []
while True:
    data = s.recv(2048)
    if data[0] == 128 and data[4:8] == b"mark":  # the node's echo request, sent after the rest
        break
    if data[0] in (135, 136) and data[24:29] == b"from-":
        seen.append(f"{data[0]}:{data[24:30].decode()}")
print(",".join(seen), flush=True)
"""

SEND_ND_TYPES = """
import socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)  # the kernel fills in the checksum
target = socket.inet_pton(socket.AF_INET6, sys.argv[2])  # the sender's own (what the bridge table lets an advertisement claim)
for kind in (135, 136):  # a neighbour solicitation and advertisement in form, routed (hop limit 64), any payload
    s.sendto(bytes([kind, 0, 0, 0]) + bytes(4) + target + sys.argv[3].encode(), (sys.argv[1], 0))
"""

MARK = """
import socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
s.sendto(bytes([128, 0, 0, 0]) + b"mark", (sys.argv[1], 0))
"""


async def test_routed_icmpv6_of_neighbour_discovery_types_is_judged(node: Node):
    """Pod a isolated for egress sends ICMPv6 of types 135/136 to r, another node's pod: the
    node routes it (neighbour discovery never is: hop limit 255), so a's policy judges it."""
    r = node.pods["r"]
    r6 = PODS["r"][2]
    try:
        await node.apply(np("deny", {"podSelector": {"matchLabels": {"pod": "a"}}, "policyTypes": ["Egress"]}))
        listener = r.popen([sys.executable, "-c", ND_LISTEN], stdout=subprocess.PIPE, text=True)
        try:
            assert listener.stdout is not None
            assert (await asyncio.to_thread(listener.stdout.readline)).strip() == "ready"
            for name in ("a", "b"):  # b is not isolated: its copy arrives (the control)
                await asyncio.to_thread(node.pods[name].exec, sys.executable, "-c", SEND_ND_TYPES, r6, PODS[name][2], f"from-{name}")
            await asyncio.to_thread(node.ns.exec, sys.executable, "-c", MARK, r6)
            seen = (await asyncio.to_thread(listener.stdout.readline)).strip().split(",")
        finally:
            listener.kill()
            listener.wait()
            listener.stdout.close()  # type: ignore[union-attr]
        assert sorted(seen) == ["135:from-b", "136:from-b"], seen
    finally:
        await node.clear()


def arp(op: int, sender_mac: bytes, sender_ip: str, target_ip: str) -> bytes:
    import socket

    return (b"\x00\x01\x08\x00\x06\x04" + op.to_bytes(2, "big") + sender_mac + socket.inet_aton(sender_ip)
            + bytes(6) + socket.inet_aton(target_ip))  # fmt: skip


def lladdr(ns: Netns, address: str, dev: str) -> str | None:
    entries = json.loads(ns.exec("ip", "-j", "neigh", "show", address, "dev", dev) or "[]")
    return entries[0].get("lladdr") if entries else None


async def test_arp_from_a_pod_cannot_claim_another_pods_address(node: Node):
    """Pod c announces "b's address is at my MAC" (gratuitous ARP, request and reply): the
    node's and pod a's neighbour entries for b must keep b's MAC, or traffic for b would go
    to c.  Nothing isolates anyone: the check is identity, not policy."""
    a, b, c = node.pods["a"], node.pods["b"], node.pods["c"]
    b4 = PODS["b"][1]
    b_mac, c_mac = mac_of(b, "eth0"), mac_of(c, "eth0")
    try:
        before = await asyncio.to_thread(node.spoofed)
        await asyncio.to_thread(node.ns.exec, "ping", "-c", "1", "-W", "2", b4)
        await asyncio.to_thread(a.exec, "ping", "-c", "1", "-W", "2", b4)
        assert lladdr(node.ns, b4, "cni0") == lladdr(a, b4, "eth0") == b_mac.hex(":")
        frames = [ether(b"\xff" * 6, c_mac, 0x0806, arp(op, c_mac, b4, b4)) for op in (1, 2)]
        await asyncio.to_thread(c.exec, sys.executable, "-c", SEND_FRAMES, *frames)
        assert (lladdr(node.ns, b4, "cni0"), lladdr(a, b4, "eth0")) == (b_mac.hex(":"), b_mac.hex(":"))
        assert await asyncio.to_thread(node.spoofed) >= before + 6
        # c's own address it may announce (the control: the frames are good ARP).
        await asyncio.to_thread(node.ns.exec, "ping", "-c", "1", "-W", "2", PODS["c"][1])
        await asyncio.to_thread(c.exec, sys.executable, "-c", SEND_FRAMES,
                                ether(b"\xff" * 6, c_mac, 0x0806, arp(1, b"\x02\x00\x00\x00\x00\x99", PODS["c"][1], PODS["c"][1])))  # fmt: skip
        assert lladdr(node.ns, PODS["c"][1], "cni0") == "02:00:00:00:00:99"
    finally:
        for ns, dev in ((node.ns, "cni0"), (a, "eth0")):
            ns.ip("neigh", "flush", "dev", dev, check=False)


SEND_NA = """
import socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, 255)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, socket.if_nametoindex("eth0"))
# An unsolicited advertisement with the override flag, from the link-local address, to every
# node of the link: "<target> is at <MAC>" (its target link-layer address option).
na = bytes([136, 0, 0, 0, 0x20, 0, 0, 0]) + socket.inet_pton(socket.AF_INET6, sys.argv[1]) + bytes([2, 1]) + bytes.fromhex(sys.argv[2])
for _ in range(3):
    s.sendto(na, ("ff02::1", 0))
"""


async def test_a_neighbour_advertisement_from_a_pod_cannot_claim_another_pods_address(node: Node):
    """Pod c advertises "b's IPv6 address is at my MAC": the node's and pod a's neighbour
    entries for b keep b's MAC."""
    a, b, c = node.pods["a"], node.pods["b"], node.pods["c"]
    b6, c6 = PODS["b"][2], PODS["c"][2]
    b_mac, c_mac = mac_of(b, "eth0"), mac_of(c, "eth0")
    try:
        before = await asyncio.to_thread(node.spoofed)
        await asyncio.to_thread(node.ns.exec, "ping", "-c", "1", "-W", "2", b6)
        await asyncio.to_thread(a.exec, "ping", "-c", "1", "-W", "2", b6)
        assert lladdr(node.ns, b6, "cni0") == lladdr(a, b6, "eth0") == b_mac.hex(":")
        await asyncio.to_thread(c.exec, sys.executable, "-c", SEND_NA, b6, c_mac.hex())
        assert (lladdr(node.ns, b6, "cni0"), lladdr(a, b6, "eth0")) == (b_mac.hex(":"), b_mac.hex(":"))
        assert await asyncio.to_thread(node.spoofed) >= before + 3
        # c's own address it may advertise (the control: the advertisement is a good one).
        await asyncio.to_thread(node.ns.exec, "ping", "-c", "1", "-W", "2", c6)
        await asyncio.to_thread(c.exec, sys.executable, "-c", SEND_NA, c6, "020000000099")
        assert lladdr(node.ns, c6, "cni0") == "02:00:00:00:00:99"
    finally:
        for ns, dev in ((node.ns, "cni0"), (a, "eth0")):
            ns.ip("-6", "neigh", "flush", "dev", dev, check=False)


# ------------------------------------------------------------------ neighbour discovery's link-layer address options
# Two more pods, nd/m and nd/n, whose MACs the agent knows (as agentd-cni records them): their
# ports are MAC-checked, so are the link-layer address options of their neighbour discovery.
# Their namespaces keep the kernel's defaults: duplicate address detection on, with a nonce
# (enhanced_dad).

ND_PODS = {"m": ("fd00:10:244:1::20", "vethndm"), "n": ("fd00:10:244:1::21", "vethndn")}
M_NEW = "fd00:10:244:1::22"  # an address m is given later (duplicate address detection first)

SEND_ND = """
import socket, sys
kind, source, dest, target, options = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], bytes.fromhex(sys.argv[5])
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)  # the kernel fills in the checksum
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, 255)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, 255)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, socket.if_nametoindex("eth0"))
if source != "auto":
    s.bind((source, 0))
flags = 0x20 if kind == "na" else 0  # an advertisement's override flag
msg = bytes([136 if kind == "na" else 135, 0, 0, 0, flags, 0, 0, 0]) + socket.inet_pton(socket.AF_INET6, target) + options
for _ in range(3):
    s.sendto(msg, (dest, 0))
"""

TCP_SERVE = """
import socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 8080))
s.listen()
s.settimeout(10)
print("ready", flush=True)
c, _ = s.accept()
c.sendall(b"hello from " + sys.argv[1].encode())
c.close()
"""

TCP_CONNECT = """
import socket, sys
print(socket.create_connection((sys.argv[1], 8080), timeout=5).recv(100).decode(), flush=True)
"""


def tentative(pod: Netns) -> str:
    return pod.exec("ip", "-6", "addr", "show", "dev", "eth0", "tentative")


async def _nd_pods(node: Node, pods: dict[str, Netns]) -> None:
    """nd/m and nd/n on cni0 (namespaces named as the module's, which its fixture sweeps), into
    ``pods``, programmed with their MACs, then given their addresses: duplicate address
    detection across the checked ports."""
    base = node.ns.name.rsplit("-", 1)[0]
    for name, (v6, host) in ND_PODS.items():
        pod = pods[name] = Netns.create(f"{base}-nd{name}")
        veth(node.ns, host, pod, "eth0")
        node.ns.ip("link", "set", host, "master", "cni0")
        (link,) = json.loads(node.ns.exec("ip", "-j", "link", "show", "dev", host))
        port = LocalPort(host, link["address"], "cni0", pod_mac=mac_of(pod, "eth0").hex(":"))
        node.engine.upsert_pod(Pod("nd", name, "node1", (_addr(v6), _addr(M_NEW)) if name == "m" else (_addr(v6),),
                                   {"pod": f"nd-{name}"}), port)  # fmt: skip
    await node.sync()
    for name, (v6, _) in ND_PODS.items():
        assert pods[name].exec("sysctl", "-n", "net.ipv6.conf.eth0.enhanced_dad").strip() == "1"
        pods[name].ip("-6", "addr", "add", f"{v6}/64", "dev", "eth0")
    for pod in pods.values():
        await auntil(lambda pod=pod: not tentative(pod), 10, what=f"{pod.name}'s addresses past duplicate address detection")  # type: ignore[misc]


async def _tcp(client: Netns, server: Netns, address: str) -> str:
    listener = server.popen([sys.executable, "-c", TCP_SERVE, address], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None
        assert (await asyncio.to_thread(listener.stdout.readline)).strip() == "ready"
        return (await client.aexec(sys.executable, "-c", TCP_CONNECT, address, timeout=15))[1].decode().strip()
    finally:
        listener.kill()
        listener.wait()
        listener.stdout.close()  # type: ignore[union-attr]


async def test_neighbour_discovery_from_a_pod_names_only_its_own_mac(node: Node):
    """nd/m, for its own address and from its own MAC, solicits n and the node and advertises
    to everyone with a link-layer address option naming pod a's MAC ("m is at a's MAC"), and
    once more with that option behind another (a receiving Linux kernel takes the first
    address option wherever it is): n's and the node's neighbour entries for m keep m's MAC,
    and the drops are counted.  Its own MAC passes (the control), as does everything the
    pods' kernels send themselves: duplicate address detection (with a nonce), before and
    after, and IPv6 ping and TCP between m and n, caches flushed, to an address m is given
    later too."""
    node_ns, gw = node.ns, "fd00:10:244:1::1"
    m6, n6 = ND_PODS["m"][0], ND_PODS["n"][0]
    pods: dict[str, Netns] = {}
    try:
        await _nd_pods(node, pods)
        m, n = pods["m"], pods["n"]
        m_mac, a_mac = mac_of(m, "eth0").hex(":"), mac_of(node.pods["a"], "eth0")
        await asyncio.to_thread(n.exec, "ping", "-6", "-c", "1", "-W", "2", m6)
        await asyncio.to_thread(node_ns.exec, "ping", "-6", "-c", "1", "-W", "2", m6)
        assert lladdr(n, m6, "eth0") == lladdr(node_ns, m6, "cni0") == m_mac
        before = await asyncio.to_thread(node.spoofed)
        sends = [("ns", m6, n6, n6, bytes([1, 1]) + a_mac), ("ns", m6, gw, gw, bytes([1, 1]) + a_mac),
                 ("na", "auto", "ff02::1", m6, bytes([2, 1]) + a_mac),
                 ("na", "auto", "ff02::1", m6, bytes([99, 1]) + bytes(6) + bytes([2, 1]) + a_mac)]  # fmt: skip
        for kind, source, dest, target, options in sends:
            await asyncio.to_thread(m.exec, sys.executable, "-c", SEND_ND, kind, source, dest, target, options.hex())
        for _ in range(5):  # the frames are bridged at once, or never
            assert (lladdr(n, m6, "eth0"), lladdr(node_ns, m6, "cni0")) == (m_mac, m_mac)
            await asyncio.sleep(0.1)
        assert await asyncio.to_thread(node.spoofed) >= before + 3 * len(sends)
        # Its own MAC it may name (the control: n's entry, set wrong, is corrected).
        n.ip("-6", "neigh", "replace", m6, "lladdr", "02:00:00:00:00:42", "dev", "eth0", "nud", "stale")
        await asyncio.to_thread(m.exec, sys.executable, "-c", SEND_ND, "na", "auto", "ff02::1", m6,
                                (bytes([2, 1]) + mac_of(m, "eth0")).hex())  # fmt: skip
        await auntil(lambda: lladdr(n, m6, "eth0") == m_mac, 5, what="n taking m's own advertisement")
        # Duplicate address detection crosses the checked ports: m's solicitation for n's
        # address (with its nonce) reaches n, whose answer makes m give the address up.
        m.ip("-6", "addr", "add", f"{n6}/64", "dev", "eth0")
        await auntil(lambda: "dadfailed" in m.exec("ip", "-6", "addr", "show", "dev", "eth0"), 10,
                     what="m's duplicate address detection of n's address failing")  # fmt: skip
        m.ip("-6", "addr", "del", f"{n6}/64", "dev", "eth0")
        # What the pods' kernels send passes: ping and TCP, both ways, every cache flushed,
        # and to an address m takes only now (its duplicate address detection first).
        m.ip("-6", "addr", "add", f"{M_NEW}/64", "dev", "eth0")
        await auntil(lambda: not tentative(m), 10, what="m's new address past duplicate address detection")
        for ns in (node_ns, m, n):
            ns.ip("-6", "neigh", "flush", "all")
        spoofed = await asyncio.to_thread(node.spoofed)
        for client, server, address in ((n, m, m6), (m, n, n6), (n, m, M_NEW)):
            await asyncio.to_thread(client.exec, "ping", "-6", "-c", "1", "-W", "2", address)
            assert await _tcp(client, server, address) == f"hello from {address}"
        assert lladdr(n, m6, "eth0") == lladdr(n, M_NEW, "eth0") == m_mac
        assert await asyncio.to_thread(node.spoofed) == spoofed
    finally:
        for key in [("nd", name) for name in ND_PODS]:
            node.engine.remove_pod(key)
        await node.sync()
        node_ns.ip("-6", "neigh", "flush", "dev", "cni0", check=False)
        for host in (host for _, host in ND_PODS.values()):
            node_ns.ip("link", "del", host, check=False)
        for pod in pods.values():
            pod.delete()
