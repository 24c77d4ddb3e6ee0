"""Services over IPv6 and dual-stack, on the real kernel, in namespaces of the test's own.

Two nodes joined by an underlay link with IPv4 and IPv6 addresses, each with a pod bridge;
node1 has the client pod c1 and the endpoint w1, node2 the endpoint w2 (each pod with an
IPv4 and an IPv6 address, routes between the nodes' pod subnets).  node1's ``ip`` and
``ip6 agentd-services`` tables are compiled from Service objects and pod records as an agent
compiles them (agentd.services.model / compiler, dual-stack) and written by the programmer;
traffic is real (agentd.lab.svcecho: servers that say who they are).  Checked over IPv6: a
cluster IP spreading over both endpoints (TCP and UDP) beside its IPv4 one, hairpin, a
NodePort on node1's IPv6 underlay address with externalTrafficPolicy Cluster and Local, a
Local node port whose endpoint is on node2 (from node1 itself and its pod: short-circuited to
it, over both families; from node2: dropped), ClientIP affinity, internalTrafficPolicy Local, refusal without endpoints (ICMPv6), a UDP
flow moving when its endpoint goes (ctnetlink, AF_INET6), and the service DNS answering
AAAA and A to a pod over IPv6.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio

from agentd.lab.netns import Netns, delete_matching, unique_tag, veth
from agentd.lab.svcecho import Echo
from agentd.nft.libnftables import Nft
from agentd.nft.programmer import NftProgrammer
from agentd.resources import kinds
from agentd.services import compiler, conntrack, model
from agentd.services.agent import stale_udp

pytestmark = pytest.mark.asyncio(loop_scope="module")

PODS = {  # name -> (node, IPv4, IPv6)
    "c1": ("node1", "10.244.1.2", "fd00:10:244:1::2"),
    "w1": ("node1", "10.244.1.3", "fd00:10:244:1::3"),
    "w2": ("node2", "10.244.2.2", "fd00:10:244:2::2"),
}
NODES = {"node1": ("192.168.50.1", "fd00:1::1", 1), "node2": ("192.168.50.2", "fd00:1::2", 2)}
VIP4, VIP6 = "10.96.0.10", "fd00:10:96::a"
WEBS = {"w1", "w2"}
HTTP = {"name": "http", "containerPort": 8080, "protocol": "TCP"}
DNS_PORT = {"name": "dns", "containerPort": 5353, "protocol": "UDP"}
PORTS = [{"name": "http", "port": 80, "targetPort": "http"}, {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": "dns"}]


class World:
    def __init__(self, ns: dict[str, Netns]) -> None:
        self.ns = ns
        self.nft = Nft(netns=ns["node1"].path)
        self.programmer = NftProgrammer(self.nft, compiler.TABLES, "services")
        self.table = compiler.Table("node1", families=(4, 6), pod_subnets={4: "10.244.1.0/24", 6: "fd00:10:244:1::/64"})
        self.echo: dict[str, Echo] = {}
        self.records = [pod_record(name) for name in ("w1", "w2")]
        self.ports: dict[str, list[model.ServicePort]] = {}
        self.flushed = 0  # UDP conntrack entries deleted

    async def program(self, obj: dict[str, Any], slices: list[dict[str, Any]] = ()) -> list[model.ServicePort]:
        """Compile one Service into node1's tables (as the agent does) and write them."""
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        ports = model.build([obj], list(slices), self.records)
        before = self.ports.get(key[1], [])
        touched = self.table.update(key, ports)
        await self.programmer.sync(self.table.rs, touched if self.programmer.current is not None else None)
        self.ports[key[1]] = ports
        gone = stale_udp(before, ports)
        if gone:  # as the agent: before the change counts as applied, in the node's namespace
            self.flushed += await asyncio.to_thread(self._flush, gone)
        return ports

    def _flush(self, gone: list[conntrack.Stale]) -> int:
        with self.ns["node1"].entered():
            return conntrack.flush_udp(gone)

    async def remove(self, name: str) -> None:
        self.table.update(("svc", name), [])
        await self.programmer.sync(self.table.rs)
        self.ports.pop(name, None)


def pod_record(name: str) -> dict[str, Any]:
    node, v4, v6 = PODS[name]
    return kinds.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "svc", "labels": {"app": "web", "pod": name}},
                           "spec": {"nodeName": node, "containers": [{"name": "pod", "ports": [HTTP, DNS_PORT]}]},
                           "status": {"podIPs": [{"ip": v4}, {"ip": v6}]}})  # fmt: skip


def service(name: str, spec: dict[str, Any], ips: tuple[str, ...] = (VIP4, VIP6)) -> dict[str, Any]:
    """A Service as the store keeps it: validated, with its families and cluster IPs."""
    obj = kinds.validate({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "svc"}, "spec": spec})
    families = ["IPv6" if ":" in ip else "IPv4" for ip in ips]
    obj["spec"].update(clusterIP=ips[0], clusterIPs=list(ips), ipFamilies=families,
                       ipFamilyPolicy="RequireDualStack" if len(ips) == 2 else "SingleStack")  # fmt: skip
    return obj


def _build(make: Any) -> dict[str, Netns]:
    ns = {name: make(name) for name in (*NODES, *PODS)}
    for n in ns.values():
        n.sysctl("net.ipv6.conf.default.accept_dad", 0)
        n.sysctl("net.ipv6.conf.all.accept_dad", 0)
    veth(ns["node1"], "ul", ns["node2"], "ul")
    for node, (v4, v6, index) in NODES.items():
        n = ns[node]
        n.sysctl("net.ipv4.ip_forward", 1)
        n.sysctl("net.ipv6.conf.all.forwarding", 1)
        n.ip("addr", "add", f"{v4}/24", "dev", "ul")
        n.ip("-6", "addr", "add", f"{v6}/64", "dev", "ul")
        n.ip("link", "add", "cni0", "type", "bridge")
        n.ip("addr", "add", f"10.244.{index}.1/24", "dev", "cni0")
        n.ip("-6", "addr", "add", f"fd00:10:244:{index}::1/64", "dev", "cni0")
        n.ip("link", "set", "cni0", "up")
        other = 3 - index
        peer_v4, peer_v6, _ = NODES[f"node{other}"]
        n.ip("route", "add", f"10.244.{other}.0/24", "via", peer_v4)
        n.ip("-6", "route", "add", f"fd00:10:244:{other}::/64", "via", peer_v6)
    for name, (node, v4, v6) in PODS.items():
        index = NODES[node][2]
        veth(ns[node], f"veth{name}", ns[name], "eth0")
        ns[node].ip("link", "set", f"veth{name}", "master", "cni0")
        ns[node].ip("link", "set", f"veth{name}", "type", "bridge_slave", "hairpin", "on")  # as agentd-cni's bridge conf
        ns[name].ip("addr", "add", f"{v4}/24", "dev", "eth0")
        ns[name].ip("-6", "addr", "add", f"{v6}/64", "dev", "eth0")
        ns[name].ip("route", "add", "default", "via", f"10.244.{index}.1")
        ns[name].ip("-6", "route", "add", "default", "via", f"fd00:10:244:{index}::1")
    return ns


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world():
    tag = unique_tag()
    made: list[Netns] = []

    def make(role: str) -> Netns:
        n = Netns.create(f"ad-{tag}-{role}")
        made.append(n)
        return n

    w = None
    try:
        w = World(_build(make))
        await w.programmer.adopt()
        for name in ("w1", "w2"):
            w.echo[name] = await Echo.start(SimpleNamespace(ns=w.ns[name]), name, [("tcp", 8080), ("udp", 5353)])
        for name in ("c1", "node1", "node2"):
            w.echo[name] = await Echo.start(SimpleNamespace(ns=w.ns[name]), name)
        yield w
    finally:
        if w is not None:
            for e in w.echo.values():
                await e.close()
            w.nft.close()
        for n in reversed(made):
            n.delete()
        delete_matching(f"ad-{tag}-")


async def test_a_cluster_ip_of_each_family_spreads_over_both_endpoints(world: World):
    await world.program(service("web", {"selector": {"app": "web"}, "ports": PORTS}))
    try:
        for vip in (VIP6, VIP4):
            r = await world.echo["c1"].tcp(vip, 80, count=60)
            assert r["failed"] == 0 and set(r["names"]) == WEBS and min(r["names"].values()) >= 10, (vip, r)
        names = []
        for sport in range(21000, 21024):  # each source port a new UDP flow
            names += await world.echo["c1"].udp(VIP6, 53, sport)
        assert set(names) == WEBS, names
        tables = json.loads(world.ns["node1"].exec("nft", "-j", "list", "tables"))["nftables"]
        assert {("ip", "agentd-services"), ("ip6", "agentd-services")} <= {
            (t["table"]["family"], t["table"]["name"]) for t in tables if "table" in t}
    finally:
        await world.remove("web")


async def test_hairpin_over_ipv6(world: World):
    await world.program(service("self", {"selector": {"pod": "w1"}, "ports": PORTS}))
    try:
        assert await world.echo["w1"].tcp(VIP6, 80, count=4) == {"names": {"w1": 4}, "failed": 0}
        assert await world.echo["w1"].udp(VIP6, 53, sport=23000, count=2) == ["w1", "w1"]
    finally:
        await world.remove("self")


async def test_node_port_on_the_nodes_ipv6_address_cluster_and_local(world: World):
    node1_v6 = NODES["node1"][1]
    spec = {"type": "NodePort", "selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]}
    await world.program(service("np", spec))
    try:
        r = await world.echo["node2"].tcp(node1_v6, 30080, count=40)  # from outside node1, to its underlay address
        assert r["failed"] == 0 and set(r["names"]) == WEBS, r
        # Local: node1's IPv6 address sends to node1's endpoint only.
        await world.program(service("np", {**spec, "externalTrafficPolicy": "Local"}))
        assert await world.echo["node2"].tcp(node1_v6, 30080, count=10) == {"names": {"w1": 10}, "failed": 0}
        # An IPv4-only Service has no IPv6 node port (as kube-proxy: a family's proxier serves that family's Services).
        await world.program(service("np", spec, ips=(VIP4,)))
        assert (await world.echo["node2"].tcp(node1_v6, 30080, count=1, timeout=1.0))["failed"] == 1
        assert (await world.echo["node2"].tcp(NODES["node1"][0], 30080, count=4))["failed"] == 0
    finally:
        await world.remove("np")


# The connection's outcome in 1 s: "connected", or the error's name ("TimeoutError": dropped).
CONNECT_ONCE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0).close()
    print("connected")
except OSError as err:
    print(type(err).__name__)
"""


def _reply_addresses(ns: Netns, family: int, dport: int) -> set[tuple[str, str]]:
    """(original source, reply destination) of node1's TCP conntrack entries to port ``dport``:
    the reply destination is the source the endpoint saw (another than the original: masqueraded)."""
    from agentd.kernel import netlink as nl
    from agentd.kernel.netlink_ct import IPCTNL_MSG_CT_NEW, NFNL_SUBSYS_CTNETLINK
    from agentd.kernel.netlink_socket import NetlinkSocket

    with ns.entered():
        sock = NetlinkSocket(protocol=nl.NETLINK_NETFILTER)
        try:
            answers = sock.request(conntrack.encode_dump(1, family), what="listing conntrack entries", dump=True)
        finally:
            sock.close()
    entries = [conntrack.decode_entry(buf, s, end) for t, buf, s, end in answers if t == NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW]
    return {(e.orig.src, e.reply.dst) for e in entries if e is not None and e.orig.proto == socket.IPPROTO_TCP and e.orig.dport == dport}


async def test_a_local_node_port_from_the_node_and_its_pods_goes_to_every_endpoint(world: World):
    """externalTrafficPolicy Local is for traffic from outside: node1 has no endpoint of the
    Service, yet from node1 itself and from its pod its node port answers (kube-proxy's
    short-circuit: every endpoint; the node's own connections masqueraded, the pod's keeping
    its address); from node2 it is dropped on node1.  Both families."""
    spec = {"type": "NodePort", "selector": {"pod": "w2"}, "externalTrafficPolicy": "Local",
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30081}]}  # fmt: skip
    await world.program(service("far", spec))
    try:
        node1_v4, node1_v6, _ = NODES["node1"]
        for address in (node1_v6, node1_v4):
            for client in ("c1", "node1"):
                assert await world.echo[client].tcp(address, 30081, count=4) == {"names": {"w2": 4}, "failed": 0}, (client, address)
            outcome = (await asyncio.to_thread(world.ns["node2"].exec, sys.executable, "-c", CONNECT_ONCE, address, "30081")).strip()
            assert outcome == "TimeoutError", (address, outcome)
        # node1 reaching its node port on its bridge address (the source it sends from): w2 sees
        # node1's underlay address; c1 keeps its own.
        for family, bridge, underlay, pod in ((socket.AF_INET6, "fd00:10:244:1::1", node1_v6, PODS["c1"][2]),
                                              (socket.AF_INET, "10.244.1.1", node1_v4, PODS["c1"][1])):  # fmt: skip
            for client in ("node1", "c1"):
                assert await world.echo[client].tcp(bridge, 30081, count=1) == {"names": {"w2": 1}, "failed": 0}, (client, bridge)
            seen = _reply_addresses(world.ns["node1"], family, 30081)
            assert (bridge, underlay) in seen and (pod, pod) in seen and (bridge, bridge) not in seen, seen
    finally:
        await world.remove("far")


async def test_affinity_and_internal_traffic_policy_over_ipv6(world: World):
    await world.program(service("sticky", {"selector": {"app": "web"}, "ports": PORTS, "sessionAffinity": "ClientIP",
                                           "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}}}))  # fmt: skip
    try:
        r = await world.echo["c1"].tcp(VIP6, 80, count=30)
        assert r["failed"] == 0 and len(r["names"]) == 1, r
    finally:
        await world.remove("sticky")
    await world.program(service("near", {"selector": {"app": "web"}, "ports": PORTS, "internalTrafficPolicy": "Local"}))
    try:
        assert await world.echo["c1"].tcp(VIP6, 80, count=10) == {"names": {"w1": 10}, "failed": 0}
    finally:
        await world.remove("near")


CONNECT = """
import socket, sys, time
s = socket.socket(socket.AF_INET6)
s.settimeout(5)
start = time.monotonic()
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("connected")
except OSError as err:
    print(type(err).__name__, round(time.monotonic() - start, 3))
"""


async def test_a_service_without_endpoints_is_refused_over_ipv6(world: World):
    await world.program(service("empty", {"selector": {"pod": "nobody"}, "ports": PORTS}))
    try:
        out = (await asyncio.to_thread(world.ns["c1"].exec, sys.executable, "-c", CONNECT, VIP6, "80")).split()
        # ICMPv6 port unreachable: refused at once, not left to the 5 s timeout (a first SYN may go
        # unanswered: ICMP rate limits).
        assert out[0] == "ConnectionRefusedError" and float(out[1]) < 3.5, out
    finally:
        await world.remove("empty")


def slice6(endpoints: list[str]) -> dict[str, Any]:
    return kinds.validate({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                           "metadata": {"name": "manual-6", "namespace": "svc", "labels": {"kubernetes.io/service-name": "manual"}},
                           "addressType": "IPv6", "endpoints": [{"addresses": [PODS[e][2]]} for e in endpoints],
                           "ports": [{"name": "dns", "port": 5353, "protocol": "UDP"}]})  # fmt: skip


async def test_a_removed_ipv6_endpoint_takes_its_udp_flows_with_it(world: World):
    svc = service("manual", {"ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}, ips=(VIP6,))
    await world.program(svc, [slice6(["w1", "w2"])])
    try:
        first = await world.echo["c1"].udp(VIP6, 53, sport=22000, count=3)
        assert len(set(first)) == 1 and first[0] in WEBS, first
        keep = "w2" if first[0] == "w1" else "w1"
        before = world.flushed
        await world.program(svc, [slice6([keep])])
        assert world.flushed > before  # its conntrack entry was deleted: the same flow (same source port) moves
        assert await world.echo["c1"].udp(VIP6, 53, sport=22000, count=3) == [keep] * 3
    finally:
        await world.remove("manual")


DNS_SERVER = """
import asyncio, json, sys
from agentd.services import dns
from agentd.services.model import Endpoint, ServicePort
ports = [ServicePort(*p[:10], tuple(Endpoint(*e) for e in p[10]), p[11]) for p in json.loads(sys.argv[2])]
table = dns.names(ports, "cluster.local")
async def main():
    server = dns.DnsServer(sys.argv[1], 53, lambda: table, [])
    await server.start()
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def test_service_dns_answers_aaaa_and_a_to_a_pod_over_ipv6(world: World):
    web = await world.program(service("web", {"selector": {"app": "web"}, "ports": PORTS}))
    hl = service("hl", {"clusterIP": "None", "selector": {"pod": "w2"}, "ports": PORTS})
    hl["spec"].update(clusterIP="None", clusterIPs=["None"], ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="RequireDualStack")
    headless = model.build([hl], [], world.records)
    ports = [[p.namespace, p.service, p.port_name, p.protocol, p.port, p.cluster_ip, p.node_port, p.affinity_timeout,
              p.internal_local, p.external_local, [[e.ip, e.port] for e in p.endpoints], p.family] for p in web + headless]  # fmt: skip
    server_address = "fd00:10:244:1::1"  # node1's bridge address: an IPv6 transport for the query
    proc = world.ns["node1"].popen([sys.executable, "-c", DNS_SERVER, server_address, json.dumps(ports)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and (await asyncio.to_thread(proc.stdout.readline)).strip() == "ready"
        client = world.echo["c1"]
        r = await client.dns(server_address, "web.svc.svc.cluster.local", "AAAA")
        assert r["rcode"] == "NOERROR" and r["aa"] and r["answer"] == [f"web.svc.svc.cluster.local. 5 IN AAAA {VIP6}"], r
        r = await client.dns(server_address, "web.svc.svc.cluster.local", "A", tcp=True)
        assert r["answer"] == [f"web.svc.svc.cluster.local. 5 IN A {VIP4}"], r
        r = await client.dns(server_address, "hl.svc.svc.cluster.local", "AAAA")  # headless: the endpoints
        assert r["answer"] == [f"hl.svc.svc.cluster.local. 5 IN AAAA {PODS['w2'][2]}"], r
        r = await client.dns(server_address, "_http._tcp.web.svc.svc.cluster.local", "SRV")
        assert r["additional"] == [f"web.svc.svc.cluster.local. 5 IN A {VIP4}", f"web.svc.svc.cluster.local. 5 IN AAAA {VIP6}"], r
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            stream.close()  # type: ignore[union-attr]
        await world.remove("web")
