"""Dual-stack and IPv6-only pod networks on the lab: every backend that carries IPv6 pods, mesh
and route reflectors, dual-stack on an IPv6 and on an IPv4 underlay, IPv6-only with an external
BIRD router and BFD; restart and leave of a dual-stack node.

Each test is one lab and checks everything it can while it is up (a lab costs ~10-20 s).
The nodes of a lab differ in backend (a node's backend is what its peers use toward it), so
one lab carries host-gw, vxlan, udp and ipip pod pairs at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket

from dualstack_hosts import restart_under_ping

from agentd.lab.bird import Bird
from agentd.lab.wait import auntil

DENY_ALL = """
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-all, namespace: default}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Ingress]
"""


def backends(lab_nodes: dict[str, str]) -> dict[str, dict]:
    """Per-node configuration overrides giving each node its backend."""
    return {name: {"network": {"backend": backend}} for name, backend in lab_nodes.items()}


def everything_reaches_everything(matrix: dict) -> None:
    failing = [k for k, ok in matrix.items() if not ok]
    assert not failing, failing


def v6_routes(node) -> list[str]:
    return [line for line in node.kernel_routes() if ":" in line.split()[0] or line.startswith("blackhole fd")]


def seen_as(listen_ns, address: str, client_ns) -> str:
    """Connect from ``client_ns`` to a listener on ``address`` in ``listen_ns``: the source
    address the listener saw."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with listen_ns.entered():
        server = socket.socket(family, socket.SOCK_STREAM)
    with client_ns.entered():
        client = socket.socket(family, socket.SOCK_STREAM)
    with server, client:
        server.bind((address, 0))
        server.listen(1)
        server.settimeout(10)
        client.settimeout(10)
        client.connect((address, server.getsockname()[1]))
        conn, peer = server.accept()
        conn.close()
        return peer[0]


async def test_dual_stack_every_backend_in_a_mesh_restart_and_leave(lab_factory):
    """Dual-stack pods on a dual-stack underlay, a mesh of four nodes on four backends; node1 and
    node4 masquerade what leaves the pod network ([network] ip_masq), both families."""
    extra = backends({"node2": "vxlan", "node3": "udp", "node4": "ipip"})
    for name in ("node1", "node4"):
        extra.setdefault(name, {}).setdefault("network", {})["ip_masq"] = True
    progress: list[str] = []
    lab = await lab_factory(nodes=4, pods=1, ip_family="dual", extra=extra, progress=progress.append)
    node1, node2, node3, node4 = lab.nodes
    pods = {p.node.name: p for p in lab.pods}
    matrix = await lab.ready.matrix()
    assert {v for (_a, _b, v) in matrix} == {4, 6} and len(matrix) == 24
    everything_reaches_everything(matrix)
    # `lab up` says both families: each node's two subnets, each pod's two addresses.
    said = "\n".join(progress)
    subnets = lab.all_subnets()
    assert f"node1={' '.join(subnets['node1'])}" in said, said
    assert f"{pods['node2'].name}={pods['node2'].address(4)}/{pods['node2'].address(6)}" in said, said
    assert "pod pairs over IPv4 and IPv6" in said, said
    # The etcd member has its IPv6 twin on the dual-stack underlay, like every host there.
    member = lab.etcd.members[0]
    assert member.netns is not None
    twin = "fd00:172:30::" + member.host.rsplit(".", 1)[1]
    assert f"inet6 {twin}/64" in member.netns.ip("-6", "addr", "show", "dev", "eth0").stdout.decode()
    node1.ns.exec("ping", "-6", "-c", "1", "-W", "2", twin)

    # ip_masq on a dual-stack node: a pod's traffic to an underlay address (outside the pod
    # network) arrives as its node, over IPv6 as over IPv4; pod to pod it arrives as the pod.
    tables = node1.ns.exec("nft", "list", "tables")
    assert "table ip agentd-masq" in tables and "table ip6 agentd-masq" in tables, tables
    pod1, pod2 = pods["node1"], pods["node2"]
    assert await asyncio.to_thread(seen_as, node2.ns, node2.address_v6, pod1.ns) == node1.address_v6
    assert await asyncio.to_thread(seen_as, node2.ns, node2.address, pod1.ns) == node1.address
    assert await asyncio.to_thread(seen_as, pod2.ns, pod2.address(6), pod1.ns) == pod1.address(6)
    assert await asyncio.to_thread(seen_as, pod2.ns, pod2.address(4), pod1.ns) == pod1.address(4)
    # node2 does not masquerade: its pod reaches node1's underlay as itself.
    assert "agentd-masq" not in node2.ns.exec("nft", "list", "tables")
    assert await asyncio.to_thread(seen_as, node1.ns, node1.address_v6, pod2.ns) == pod2.address(6)

    # Each family's subnet: in /status, in etcd (both leased under each node), in the kernel.
    status = node1.api("/status")["node"]
    assert status["ip_family"] == "dual" and status["address_v6"] == node1.address_v6
    subnet6 = ipaddress.ip_network(status["subnet_v6"])
    assert subnet6.prefixlen == 64 and subnet6.subnet_of(ipaddress.ip_network("fd00:10:244::/48"))
    resources = await lab.resources()
    leases = await resources.subnets()
    assert sorted(leases.values()) == sorted([n.name for n in lab.nodes] * 2), leases
    assert leases[str(subnet6)] == "node1"
    # One IPv4 session per pair carries both families; each node's IPv6 routes carry its IPv6
    # underlay address as next hop.
    peers = {p["address"]: p for p in node1.api("/peers")}
    assert set(peers) == {n.address for n in lab.nodes[1:]}
    assert all(set(p["families"]) == {"ipv4-unicast", "ipv6-unicast"} for p in peers.values()), peers
    subnets = lab.all_subnets()
    rib = {r["prefix"]: r for r in node1.api("/rib") if r["best"]}
    for n in lab.nodes[1:]:
        assert rib[subnets[n.name][1]]["next_hop"] == n.address_v6
    # The IPv6 plan per peer: host-gw, vxlan and udp (in BPF) carry IPv6 pods as they do IPv4
    # ones; ipip does not, so its IPv6 pods are routed directly on the shared segment.
    assert {a: (p["backend"], p["backend_v6"]) for a, p in peers.items()} == {
        node2.address: ("vxlan", "vxlan"), node3.address: ("udp", "udp"), node4.address: ("ipip", "host-gw")}
    assert "carries IPv4 pods only" in peers[node4.address]["backend_v6_reason"]
    routes = {r["dst"]: r for r in node1.api("/routes")}
    assert routes[subnets["node2"][1]]["dev"] == "agentd.vxlan" and routes[subnets["node2"][1]]["installed"]
    assert routes[subnets["node4"][1]]["via"] == node4.address_v6
    assert routes[subnets["node3"][1]]["via"] == f"::ffff:{node3.address}" and routes[subnets["node3"][1]]["installed"]
    # The one VTEP of node1 holds node2's IPv6 VTEP address beside its IPv4 one.
    neigh = node1.ns.ip("-6", "neigh", "show", "dev", "agentd.vxlan").stdout.decode()
    assert subnets["node2"][1].split("/")[0] in neigh and "PERMANENT" in neigh, neigh
    # Pods: both addresses, both default routes, a route to each cluster network.
    pod_routes = pods["node1"].ns.ip("-6", "route").stdout.decode()
    assert "default via" in pod_routes and "fd00:10:244::/48 via" in pod_routes, pod_routes
    assert pods["node1"].ns.ip("route").stdout.decode().startswith("default via 10.244.")

    # The node-local DNS server answers a dual-stack pod (over IPv4, its address).
    dns = await pods["node2"].ns.aexec(
        "python3", "-c",
        "import socket,struct\n"
        "q=struct.pack('!HHHHHH',7,0x100,1,0,0,0)+b'\\x07missing\\x07default\\x03svc\\x07cluster\\x05local\\x00'"
        "+struct.pack('!HH',1,1)\n"
        "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.settimeout(5);s.sendto(q,('169.254.20.10',53))\n"
        "print(s.recv(512)[:2]==q[:2])", check=False, timeout=30)
    assert dns[1].strip() == b"True", dns

    # NetworkPolicy keeps working for IPv4 in a dual-stack cluster: an isolated pod takes no
    # IPv4 from other pods, and the rest of the cluster is untouched.
    web = await lab.add_pod(node1, "default", "web", labels={"app": "web"})
    await resources.apply(DENY_ALL)

    async def web_isolated() -> bool:
        return not await lab.ping(pods["node2"], web.address(4)) and await lab.ping(pods["node2"], pods["node3"].ip)

    await auntil(web_isolated, what="web isolated over IPv4, the other pods not")
    assert node1.api("/status")["policy"].get("error") is None
    await resources.delete("networkpolicies", "default", "deny-all")
    await lab.remove_pod(web)

    # An agent killed and restarted adopts its IPv6 routes: not one is removed or replaced, and
    # IPv6 pod traffic through it flows on.
    before = v6_routes(node2)
    results, events = await restart_under_ping(
        lab, node2, [(pods["node1"], pods["node2"].address(6)), (pods["node2"], pods["node4"].address(6))])
    assert all(not missing for _sent, missing in results), results
    changed = [line for line in events if "fd00:10:244:" in line]
    assert changed == [], changed
    assert v6_routes(node2) == before

    # A node that leaves releases both its subnets and its IPv6 routes go everywhere.
    gone = subnets["node4"]
    await node4.leave()
    await auntil(lambda: not any(line.split()[0] in gone for n in lab.nodes[:3] for line in n.kernel_routes()),
                 what=f"{gone} withdrawn everywhere", in_thread=True)
    leases = await resources.subnets()
    assert not set(gone) & set(leases) and "node4" not in leases.values(), leases
    assert "agentd-masq" not in node4.ns.exec("nft", "list", "tables")  # both tables gone


async def test_dual_stack_route_reflectors_on_an_ipv4_underlay(lab_factory):
    """No IPv6 on the underlay at all: IPv6 routes carry the IPv4-mapped next hop, host-gw
    routes IPv6 pods through the peers' link-local addresses, vxlan carries them over IPv4."""
    lab = await lab_factory(nodes=4, pods=1, ip_family="dual", ipv4_underlay=True, bgp="route-reflector",
                            extra=backends({"node3": "vxlan", "node4": "udp"}))
    node1, node2, node3, node4 = lab.nodes
    everything_reaches_everything(await lab.ready.matrix())
    subnets = lab.all_subnets()
    # node4 is a client: it has sessions to the two reflectors only, over IPv4, carrying IPv6.
    peers = node4.api("/peers")
    assert {p["address"] for p in peers} == {node1.address, node2.address}
    rib = {r["prefix"]: r for r in node4.api("/rib") if r["best"]}
    assert rib[subnets["node3"][1]]["next_hop"] == str(ipaddress.IPv6Address(f"::ffff:{node3.address}"))
    assert rib[subnets["node3"][1]]["originator_id"] == node3.address  # reflected
    routes = {r["dst"]: r for r in node4.api("/routes")}
    link_local = json.loads(node1.ns.ip("-j", "-6", "addr", "show", "dev", "eth0", "scope", "link").stdout)
    ll1 = link_local[0]["addr_info"][0]["local"]
    assert routes[subnets["node1"][1]]["via"] == ll1 and routes[subnets["node1"][1]]["dev"] == "eth0"
    assert routes[subnets["node3"][1]]["dev"] == "agentd.vxlan"
    assert node1.api("/status")["node"]["address_v6"] is None


async def test_ipv6_only_mesh_with_bfd_and_an_external_bird_router(lab_factory, tmp_path):
    """IPv6 sessions between IPv6 addresses (BFD on them), host-gw and vxlan over an IPv6
    underlay, node2 masquerading what leaves the pod network; a BIRD router on the segment is
    node1's eBGP peer and gets every pod subnet."""
    bird_address = "fd00:172:30::2"  # the etcd member's namespace doubles as the top-of-rack router
    lab = await lab_factory(
        nodes=3, pods=1, ip_family="ipv6",
        extra={**backends({"node2": "vxlan", "node3": "vxlan"}),
               "node1": {"bgp": {"bfd": True, "peers": [{"address": bird_address, "asn": 65100, "bfd": False}]}},
               "node2": {"network": {"backend": "vxlan", "ip_masq": True}, "bgp": {"bfd": True}},
               "node3": {"network": {"backend": "vxlan"}, "bgp": {"bfd": True}}},
    )
    node1, node2, node3 = lab.nodes
    assert node1.address is None
    everything_reaches_everything(await lab.ready.matrix())
    # ip_masq on an IPv6-only node: its table is ip6 alone; what its pod sends out of the pod
    # network arrives as the node, pod to pod as the pod.
    tables = node2.ns.exec("nft", "list", "tables")
    assert "table ip6 agentd-masq" in tables and "table ip agentd-masq" not in tables, tables
    pods = {p.node.name: p for p in lab.pods}
    pod2, pod3 = pods["node2"], pods["node3"]
    assert await asyncio.to_thread(seen_as, node3.ns, node3.address_v6, pod2.ns) == node2.address_v6
    assert await asyncio.to_thread(seen_as, pod3.ns, pod3.address(6), pod2.ns) == pod2.address(6)
    # Sessions over IPv6 carrying IPv6 alone, BFD up on them, router IDs distinct.
    peers = {p["address"]: p for p in node2.api("/peers")}
    assert set(peers) == {node1.address_v6, node3.address_v6}
    assert all(p["families"] == ["ipv6-unicast"] for p in peers.values()), peers
    await auntil(lambda: all(p["bfd"] == "Up" for p in node2.api("/peers")), what="BFD up over IPv6",
                 in_thread=True)
    ids = {n.api("/status")["bgp"]["router_id"] for n in lab.nodes}
    assert len(ids) == 3
    # The VTEP runs over IPv6 (its MTU leaves room for an IPv6 outer header), its member
    # filter is the BPF ingress program, judging VXLAN in IPv6 by the members' IPv6 addresses.
    status = node2.api("/status")
    assert status["node"]["mtu"] == 1500 - 70
    assert status["backends"]["member_filter"] == {"bpf": ["vxlan"], "userspace": [], "missing": {}}
    assert status["backends"]["bpf"]["members"] == 3 and status["backends"]["bpf"]["carries"] == []
    link = json.loads(node2.ns.ip("-j", "-d", "link", "show", "agentd.vxlan").stdout)[0]
    assert link["linkinfo"]["info_data"]["local6"] == node2.address_v6
    subnets = lab.all_subnets()
    routes = {r["dst"]: r for r in node1.api("/routes")}
    assert routes[subnets["node2"][0]]["dev"] == "agentd.vxlan"
    # The cluster view asks the other nodes at their IPv6 addresses.

    def gathered():
        view = node1.api("/cluster", token=True)
        return view if all("status" in view["nodes"].get(n.name, {}) for n in lab.nodes) else None

    view = await auntil(gathered, in_thread=True, what="node1's cluster view to gather every node")
    assert view["nodes"]["node2"]["address"] == node2.address_v6

    # The external router: BIRD learns every pod subnet from node1 (next hop node1), node1
    # installs BIRD's prefix.
    bird_conf = "\n".join([
        "router id 10.255.0.1;",
        "protocol device { scan time 1; }",
        "protocol static { ipv6; route 2001:db8:99::/48 blackhole; }",
        "protocol bgp node1 {",
        f"  local {bird_address} as 65100;",
        f"  neighbor {node1.address_v6} as 64512;",
        "  hold time 9; connect delay time 1; connect retry time 2; error wait time 1, 5;",
        "  ipv6 { import all; export all; };",
        "}",
    ]) + "\n"
    bird = Bird(lab.etcd_ns, tmp_path / "bird", bird_conf)
    bird.start()
    try:
        bird.wait_established("node1", timeout=30)
        pod_subnets = {s for mine in subnets.values() for s in mine}
        await auntil(lambda: pod_subnets <= bird.routes("master6").keys(), what="every pod subnet at BIRD",
                     in_thread=True)
        got = bird.routes("master6")
        assert all(got[s]["via"] == node1.address_v6 for s in pod_subnets), got
        await auntil(lambda: any(line.startswith("2001:db8:99::/48 via fd00:172:30::2 dev eth0")
                                 for line in node1.kernel_routes()), what="BIRD's prefix in node1's kernel",
                     in_thread=True)
    finally:
        bird.stop()


async def test_ipv6_only_route_reflectors_across_segments(lab_factory):
    """Two L2 segments joined by an IPv6 router, two reflectors, vxlan cross-subnet: direct
    IPv6 routes inside a segment, the VTEP across."""
    lab = await lab_factory(nodes=4, pods=1, ip_family="ipv6", bgp="route-reflector", subnets=2,
                            backend="vxlan", encap="cross-subnet")
    node1, node2, node3, node4 = lab.nodes  # segments: node1, node3 on 0; node2, node4 on 1
    everything_reaches_everything(await lab.ready.matrix())
    subnets = lab.all_subnets()
    routes = {r["dst"]: r for r in node1.api("/routes")}
    assert routes[subnets["node3"][0]]["via"] == node3.address_v6 and routes[subnets["node3"][0]]["dev"] == "eth0"
    assert routes[subnets["node2"][0]]["dev"] == "agentd.vxlan" and routes[subnets["node4"][0]]["dev"] == "agentd.vxlan"
    assert {p["address"] for p in node4.api("/peers")} == {node1.address_v6, node2.address_v6}
