"""Services on the lab: real traffic through every node's ``ip agentd-services`` table.

One lab per backend (3 nodes; host-gw, vxlan, ipip, udp; every test runs on each): pods
svc/web-1..3 (one per node, label app=web, named ports http 8080/TCP and dns 5353/UDP) and a
client pod per node, each running
agentd.lab.svcecho (servers that answer with their name, a client that counts the names).
Services are applied as manifests; every node is waited for until GET /services reports the
etcd revision of the write.  Each test asserts who answered: the distribution over 300
connections, affinity (and a changed affinity timeout), two Services claiming one cluster IP
port and node port (the older keeps them), NodePort from another node's underlay address, traffic policy Local
(and a Local node port reached from the node itself or its pod: short-circuited, to no
terminating endpoint while another is ready),
a UDP flow moving when its endpoint goes (or, after the agent restarts, when a policy turned Local
while it was down keeps it off), a held TCP connection surviving its endpoint's
terminating state, hairpin, a VIP from a node itself, refusal of a Service without endpoints,
and the table's removal on leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import sys
import time
from typing import Any

import pytest
import pytest_asyncio
from netpol_lab import converged as policy_converged
from netpol_lab import np

from agentd.lab.lab import API_URL, Lab, LabSpec
from agentd.lab.netns import unique_tag
from agentd.lab.svcecho import Echo
from agentd.lab.wait import auntil

pytestmark = pytest.mark.asyncio(loop_scope="module")

PORTS = [
    {"name": "http", "containerPort": 8080, "protocol": "TCP"},
    {"name": "dns", "containerPort": 5353, "protocol": "UDP"},
]


class World:
    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.pods: dict[str, Any] = {}
        self.echo: dict[str, Echo] = {}
        self.res: Any = None

    async def apply(self, *objs: dict[str, Any]) -> int:
        rev = await self.res.apply(list(objs))
        await self.converged(rev)
        return rev

    async def delete(self, kind: str, name: str, ns: str = "svc") -> None:
        await self.converged(await self.res.delete(kind, ns, name))

    async def converged(self, revision: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        behind: list[str] = []
        while time.monotonic() < deadline:
            views = await asyncio.gather(*(asyncio.to_thread(n.api_or_none, "/services?view=summary") for n in self.lab.nodes))
            behind = [f"{n.name}={(v or {}).get('revision')}" for n, v in zip(self.lab.nodes, views)
                      if not v or v.get("revision", 0) < revision or v.get("error")]  # fmt: skip
            if not behind:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"services revision {revision} not applied everywhere: {', '.join(behind)}")

    async def vip(self, name: str) -> str:
        obj = await self.res.get("Service", "svc", name)
        return obj["spec"]["clusterIP"]


BACKENDS = ["host-gw", "vxlan", "ipip", "udp"]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=BACKENDS)
async def world(request, tmp_path_factory):
    """The lab, once per backend: every test runs on each (translation happens before the
    packet is routed into a tunnel, or after it left one)."""
    spec = LabSpec(name="sv" + unique_tag("")[:6], nodes=3, pods=0, backend=request.param)
    lab = Lab(spec, root=tmp_path_factory.mktemp("labs"))
    w = World(lab)
    # Every node forwards names outside the cluster domain to a stand-in resolver on node3.
    for node in lab.nodes:
        lab.spec.extra[node.name] = {"dns": {"upstream": [f"{lab.nodes[2].address}:5300"]}}
    try:
        await lab.up(timeout=90)
        for i, node in enumerate(lab.nodes, start=1):
            w.pods[f"web-{i}"] = await lab.add_pod(node, "svc", f"web-{i}", labels={"app": "web", "pod": f"web-{i}"}, ports=PORTS)
            w.pods[f"client-{i}"] = await lab.add_pod(node, "svc", f"client-{i}", labels={"app": "client"})
        for name, pod in w.pods.items():
            ports = [("tcp", 8080), ("udp", 5353)] if name.startswith("web") else []
            w.echo[name] = await Echo.start(pod, name, ports)
        for node in lab.nodes:
            w.echo[node.name] = await Echo.start(node, node.name, [("dns", 5300)] if node.index == 3 else [])
        w.res = await lab.resources()
        yield w
    finally:
        for e in w.echo.values():
            await e.close()
        if w.res is not None:
            await w.res.close()
        await lab.down(keep_files=True)


def service(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "svc"}, "spec": spec}


def endpoint_slice(name: str, service_name: str, endpoints: list[dict[str, Any]], ports: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "svc", "labels": {"kubernetes.io/service-name": service_name}},
            "addressType": "IPv4", "endpoints": endpoints, "ports": ports}  # fmt: skip


WEB_PORTS = [{"name": "http", "port": 80, "targetPort": "http"}, {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": "dns"}]
WEBS = {"web-1", "web-2", "web-3"}


async def test_cluster_ip_spreads_over_every_endpoint_from_every_node(world: World):
    await world.apply(service("web", {"selector": {"app": "web"}, "ports": WEB_PORTS}))
    try:
        vip = await world.vip("web")
        results = await asyncio.gather(*(world.echo[f"client-{i}"].tcp(vip, 80, count=100) for i in (1, 2, 3)))
        total: dict[str, int] = {}
        for r in results:
            assert r["failed"] == 0, r
            for name, n in r["names"].items():
                total[name] = total.get(name, 0) + n
        # 300 connections, each endpoint chosen at random (1/3): none starved.
        assert set(total) == WEBS and sum(total.values()) == 300 and min(total.values()) >= 40, total
        # From a node itself (the nat output hook): the same VIP, every endpoint.  The host needs
        # a route covering the VIP for the socket to send at all (a default route, as with
        # kube-proxy); lab nodes have none, so node2 gets one for the check.
        node2 = world.lab.nodes[1]
        node2.ns.ip("route", "add", "default", "via", world.lab.nodes[0].address)
        try:
            r = await world.echo["node2"].tcp(vip, 80, count=30)
        finally:
            node2.ns.ip("route", "del", "default", check=False)
        assert r["failed"] == 0 and set(r["names"]) == WEBS, r
        # UDP: each new source port is a new flow; over 30 flows every endpoint answers.
        names = []
        for sport in range(21000, 21030):
            names += await world.echo["client-2"].udp(vip, 53, sport)
        assert set(names) == WEBS, names
        view = world.lab.nodes[0].api("/services")
        (svc,) = [s for s in view["services"] if s["name"] == "web"]
        assert svc["clusterIP"] == vip and {e["ip"] for p in svc["ports"] for e in p["endpoints"]} == {
            world.pods[w].ip for w in WEBS
        }
        # node1's counter (read from the kernel every 2 s): client-1's 100 connections at least.

        def counted() -> bool:
            view = world.lab.nodes[0].api("/services")
            return [s for s in view["services"] if s["name"] == "web"][0]["connections"] >= 100

        await auntil(counted, 20, what="node1's connection counter of svc/web")
        metrics = await asyncio.to_thread(world.lab.nodes[0].ns.http_get, API_URL + "/metrics")
        assert b'agentd_service_connections_total{namespace="svc",service="web"}' in metrics[1]
    finally:
        await world.delete("Service", "web")


async def test_affinity_keeps_a_client_on_one_endpoint(world: World):
    await world.apply(service("sticky", {"selector": {"app": "web"}, "ports": WEB_PORTS, "sessionAffinity": "ClientIP",
                                         "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}}}))  # fmt: skip
    try:
        vip = await world.vip("sticky")
        for client in ("client-1", "client-3"):
            r = await world.echo[client].tcp(vip, 80, count=40)
            assert r["failed"] == 0 and len(r["names"]) == 1, r
        # A changed timeout is applied on every node (new affinity sets, the chains moved to
        # them, the old sets deleted after), and Service changes after it still apply.
        await world.apply(service("sticky", {"selector": {"app": "web"}, "ports": WEB_PORTS, "sessionAffinity": "ClientIP",
                                             "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 30}}}))  # fmt: skip
        table = await asyncio.to_thread(world.lab.nodes[0].ns.exec, "nft", "list", "table", "ip", "agentd-services")
        assert "timeout 30s" in table and "timeout 1m" not in table
        r = await world.echo["client-2"].tcp(vip, 80, count=20)
        assert r["failed"] == 0 and len(r["names"]) == 1, r
        await world.apply(service("after", {"selector": {"app": "web"}, "ports": WEB_PORTS}))
        await world.delete("Service", "after")
    finally:
        await world.delete("Service", "sticky")


async def test_a_second_service_on_a_taken_cluster_ip_and_node_port_is_left_out(world: World):
    """Records allocation did not check (a hand-written etcd put, a restore): two Services with
    one cluster IP port and node port.  The older keeps them, the other is left out and shows
    it in /services; every other change still applies (the kernel refuses a whole transaction
    with two map elements of one key)."""
    node1 = world.lab.nodes[0]
    await world.apply(service("first", {"type": "NodePort", "selector": {"app": "web"},
                                        "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30082}]}))  # fmt: skip
    first = await world.res.get("Service", "svc", "first")
    second = json.loads(json.dumps(first))
    second["metadata"] = {"name": "second", "namespace": "svc"}  # no creationTimestamp: the younger
    second["spec"]["selector"] = {"pod": "web-2"}
    try:
        await world.res.put_records([second])  # as written by hand: no allocation checked
        await world.apply(service("after", {"selector": {"app": "web"}, "ports": WEB_PORTS}))  # applied after it
        vip = first["spec"]["clusterIP"]
        r = await world.echo["client-1"].tcp(vip, 80, count=60)
        assert r["failed"] == 0 and set(r["names"]) == WEBS, r
        r = await world.echo["node3"].tcp(node1.address, 30082, count=60)
        assert r["failed"] == 0 and set(r["names"]) == WEBS, r
        r = await world.echo["client-3"].tcp(await world.vip("after"), 80, count=10)
        assert r["failed"] == 0, r
        view = {s["name"]: s for s in node1.api("/services")["services"]}
        assert view["first"]["errors"] == []
        assert view["second"]["errors"] == [f"cluster IP {vip} tcp/80 is svc/first's: left out",
                                            "node port tcp/30082 (IPv4) is svc/first's: left out"]  # fmt: skip
        # Each port as compiled (what the kernel translates), and as asked.
        (port,) = view["second"]["ports"]
        assert (port["clusterIP"], port["nodePort"]) == (None, None), port
        assert port["asked"] == {"clusterIP": vip, "nodePort": 30082}, port
        assert [(p["clusterIP"], p["nodePort"]) for p in view["first"]["ports"]] == [(vip, 30082)]
    finally:
        for name in ("after", "second", "first"):
            with contextlib.suppress(Exception):
                await world.delete("Service", name)


async def test_node_port_from_the_underlay_and_traffic_policy_local(world: World):
    node1, node3 = world.lab.nodes[0], world.lab.nodes[2]
    await world.apply(service("np", {"type": "NodePort", "selector": {"app": "web"},
                                     "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]}))  # fmt: skip
    try:
        r = await world.echo["node3"].tcp(node1.address, 30080, count=60)
        assert r["failed"] == 0 and set(r["names"]) == WEBS, r
        # Local: node1's address only sends to node1's endpoint, and keeps the client's address.
        await world.apply(service("np", {"type": "NodePort", "selector": {"app": "web"}, "externalTrafficPolicy": "Local",
                                         "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30080}]}))  # fmt: skip
        r = await world.echo["node3"].tcp(node1.address, 30080, count=20)
        assert r == {"names": {"web-1": 20}, "failed": 0}, r
        r = await world.echo["node1"].tcp(node3.address, 30080, count=20)
        assert r == {"names": {"web-3": 20}, "failed": 0}, r
    finally:
        await world.delete("Service", "np")


async def test_a_local_node_port_from_the_node_and_its_pods_is_short_circuited(world: World):
    """externalTrafficPolicy Local is for traffic from outside the node: the Service's only
    endpoint is on node2, yet node1's node port answers node1 itself and its pod (kube-proxy's
    short-circuit to every endpoint); from node3 it is still dropped on node1."""
    node1, node3 = world.lab.nodes[0], world.lab.nodes[2]
    await world.apply(service("far", {"type": "NodePort", "selector": {"pod": "web-2"}, "externalTrafficPolicy": "Local",
                                      "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30081}]}))  # fmt: skip
    try:
        for client in ("client-1", "node1"):
            r = await world.echo[client].tcp(node1.address, 30081, count=5)
            assert r == {"names": {"web-2": 5}, "failed": 0}, (client, r)
        assert await _connect(node3, node1.address, 30081, timeout=1.0) == "TimeoutError"  # dropped, not refused
    finally:
        await world.delete("Service", "far")


async def test_a_local_node_ports_short_circuit_sends_no_new_connection_to_a_terminating_endpoint(world: World):
    """externalTrafficPolicy Local, node1's endpoint (web-1) terminating but serving, node2's
    (web-2) ready: from outside (node3) node1's node port still goes to web-1 (the local
    fallback, KEP-1669); from node1's pod and node1 itself, the short-circuit goes to the
    cluster policy's endpoints, web-2 only -- never the terminating one while another is
    ready, as through the cluster IP (review s57/r2: it took web-1 one time in two)."""
    node1 = world.lab.nodes[0]
    eps = _eps(world, ["web-1"], ready=False, serving=True, terminating=True) + _eps(world, ["web-2"])
    await world.apply(service("drain", {"type": "NodePort", "externalTrafficPolicy": "Local",
                                        "ports": [{"name": "http", "port": 80, "nodePort": 30083}]}),
                      endpoint_slice("drain-1", "drain", eps, [{"name": "http", "port": 8080}]))  # fmt: skip
    try:
        for client in ("client-1", "node1"):
            r = await world.echo[client].tcp(node1.address, 30083, count=30)
            assert r == {"names": {"web-2": 30}, "failed": 0}, (client, r)
        r = await world.echo["node3"].tcp(node1.address, 30083, count=10)
        assert r == {"names": {"web-1": 10}, "failed": 0}, r
        vip = await world.vip("drain")
        r = await world.echo["client-1"].tcp(vip, 80, count=10)
        assert r == {"names": {"web-2": 10}, "failed": 0}, r
    finally:
        await world.delete("EndpointSlice", "drain-1")
        await world.delete("Service", "drain")


async def test_internal_traffic_policy_local(world: World):
    await world.apply(service("near", {"selector": {"app": "web"}, "ports": WEB_PORTS, "internalTrafficPolicy": "Local"}))
    try:
        vip = await world.vip("near")
        for i in (1, 2, 3):
            r = await world.echo[f"client-{i}"].tcp(vip, 80, count=10)
            assert r == {"names": {f"web-{i}": 10}, "failed": 0}, r
    finally:
        await world.delete("Service", "near")


# A refusal is "ConnectionRefusedError"; a SYN nobody answers ends in "TimeoutError" (5 s by default).
CONNECT = """
import socket, sys
s = socket.socket()
s.settimeout(float(sys.argv[3]))
if len(sys.argv) > 4:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", int(sys.argv[4])))
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("connected")
except OSError as err:
    print(type(err).__name__)
"""


async def _connect(where: Any, ip: str, port: int, timeout: float = 5.0, sport: int | None = None) -> str:
    """Connect from ``where`` (from local port ``sport``, if given): what came of it."""
    more = () if sport is None else (str(sport),)
    return (await asyncio.to_thread(where.ns.exec, sys.executable, "-c", CONNECT, ip, str(port), str(timeout), *more)).strip()


async def test_a_service_without_endpoints_is_refused_at_once(world: World):
    """As kube-proxy: no endpoint -> ICMP port unreachable, so a client gets "connection refused"
    instead of waiting for a timeout; the refusal goes when an endpoint appears."""
    node1, node3 = world.lab.nodes[0], world.lab.nodes[2]
    spec = {"type": "NodePort", "selector": {"pod": "nobody"},
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": 30090}]}  # fmt: skip
    await world.apply(service("empty", spec))
    try:
        vip = await world.vip("empty")
        for where, ip, port in ((world.pods["client-1"], vip, 80), (node3, node1.address, 30090)):
            # Refused, not left to time out (a first SYN may go unanswered, ICMP being rate
            # limited: the client's SYN retransmission within the 5 s still gets the refusal).
            outcome = await _connect(where, ip, port)
            assert outcome == "ConnectionRefusedError", (where.name, ip, port, outcome)
        # Only a new connection is refused (ct state new, as kube-proxy): the replies to one of
        # node1's own sockets whose local port happens to be that node port get through.
        assert await _connect(node1, world.pods["web-2"].ip, 8080, timeout=3.0, sport=30090) == "connected"
        await world.apply(service("empty", {**spec, "selector": {"pod": "web-1"}}))
        assert await _connect(world.pods["client-1"], vip, 80) == "connected"
        r = await world.echo["node3"].tcp(node1.address, 30090, count=5)
        assert r == {"names": {"web-1": 5}, "failed": 0}, r
    finally:
        await world.delete("Service", "empty")


UNALLOCATED = "10.111.255.254"  # in the lab's service range (the default 10.96.0.0/12), no Service's


async def test_an_undefined_port_of_a_cluster_ip_is_refused_and_an_unallocated_address_dropped(world: World):
    """As kube-proxy's cluster-ips-check: a cluster IP's port none of its Services has is
    refused at once; an address of the service range no Service has is dropped (not sent on
    to the default route or answered "no route").  From pods: the lab's nodes have no route
    to the service range, so their own connections end before the output hook."""
    spec = {"selector": {"pod": "web-1"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}
    await world.apply(service("one-port", spec))
    try:
        vip = await world.vip("one-port")
        for where in (world.pods["client-2"], world.pods["client-1"]):
            assert await _connect(where, vip, 80, timeout=3.0) == "connected", where.name
            assert await _connect(where, vip, 81, timeout=3.0) == "ConnectionRefusedError", where.name
            assert await _connect(where, UNALLOCATED, 80, timeout=1.0) == "TimeoutError", where.name
    finally:
        await world.delete("Service", "one-port")


def _eps(world: World, names: list[str], **conditions: bool) -> list[dict[str, Any]]:
    return [{"addresses": [world.pods[n].ip], "conditions": {"ready": True, **conditions},
             "nodeName": world.pods[n].node.name} for n in names]  # fmt: skip


async def test_removed_endpoint_moves_udp_flows_and_terminating_keeps_tcp(world: World):
    ports = [{"name": "http", "port": 80}, {"name": "dns", "port": 53, "protocol": "UDP"}]
    slice_ports = [{"name": "http", "port": 8080}, {"name": "dns", "port": 5353, "protocol": "UDP"}]
    await world.apply(service("manual", {"ports": ports}),
                      endpoint_slice("manual-1", "manual", _eps(world, ["web-1", "web-2"]), slice_ports))
    try:
        vip = await world.vip("manual")
        first = await world.echo["client-3"].udp(vip, 53, sport=22000, count=3)
        assert len(set(first)) == 1 and first[0] in ("web-1", "web-2"), first
        held_by = await world.echo["client-3"].hold("h", vip, 80)
        assert held_by in ("web-1", "web-2")
        # The UDP flow's endpoint is deleted: the same flow (same source port) moves to the other.
        keep = "web-2" if first[0] == "web-1" else "web-1"
        await world.apply(endpoint_slice("manual-1", "manual", _eps(world, [keep]), slice_ports))
        moved = await world.echo["client-3"].udp(vip, 53, sport=22000, count=3)
        assert moved == [keep] * 3, (first, moved)
        # Terminating (not ready, still serving): no new connections, the established one lives on.
        both = _eps(world, [keep]) + _eps(world, ["web-3"])
        await world.apply(endpoint_slice("manual-1", "manual", both, slice_ports))
        held_by = await world.echo["client-1"].hold("t", vip, 80)
        term = held_by
        other = "web-3" if term == keep else keep
        eps = _eps(world, [term], ready=False, serving=True, terminating=True) + _eps(world, [other])
        await world.apply(endpoint_slice("manual-1", "manual", eps, slice_ports))
        r = await world.echo["client-1"].tcp(vip, 80, count=30)
        assert r == {"names": {other: 30}, "failed": 0}, r
        assert await world.echo["client-1"].ask("t") == term
    finally:
        await world.delete("EndpointSlice", "manual-1")
        await world.delete("Service", "manual")


async def test_a_node_port_turned_local_keeps_the_udp_flows_of_serving_endpoints(world: World):
    """externalTrafficPolicy Cluster -> Local: a UDP flow from node3 to node1's node port that
    went to web-2 (node2) keeps going there, as kube-proxy keeps it (its conntrack cleanup
    flushes only endpoints leaving the serving set, whatever the traffic policies); a new
    flow (another source port) goes to web-1, node1's endpoint; web-2 gone, the old flow
    moves to web-1 too."""
    node1 = world.lab.nodes[0]

    def spec(policy: str) -> dict[str, Any]:
        return {"type": "NodePort", "externalTrafficPolicy": policy,
                "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30054}]}  # fmt: skip

    slice_ports = [{"name": "dns", "port": 5353, "protocol": "UDP"}]
    await world.apply(service("turned", spec("Cluster")),
                      endpoint_slice("turned-1", "turned", _eps(world, ["web-1", "web-2"]), slice_ports))
    try:
        for sport in range(22100, 22140):  # a flow the rules sent to node2's endpoint
            first = await world.echo["node3"].udp(node1.address, 30054, sport=sport, count=2)
            if first == ["web-2", "web-2"]:
                break
        else:
            raise AssertionError("no flow went to web-2 in 40 tries")
        await world.apply(service("turned", spec("Local")))
        kept = await world.echo["node3"].udp(node1.address, 30054, sport=sport, count=3)
        assert kept == ["web-2"] * 3, kept
        fresh = await world.echo["node3"].udp(node1.address, 30054, sport=22199, count=3)
        assert fresh == ["web-1"] * 3, fresh
        await world.apply(endpoint_slice("turned-1", "turned", _eps(world, ["web-1"]), slice_ports))
        moved = await world.echo["node3"].udp(node1.address, 30054, sport=sport, count=3)
        assert moved == ["web-1"] * 3, moved
    finally:
        await world.delete("EndpointSlice", "turned-1")
        await world.delete("Service", "turned")


# node1's UDP conntrack entries whose original source port is one of those asked: a JSON list
# of [source port, reply source address, entry id].
UDP_ENTRIES = """
import json, socket, sys
from agentd.kernel import netlink as nl, netlink_ct as ct
from agentd.kernel.netlink_socket import NetlinkSocket
from agentd.services.conntrack import encode_dump
ports = set(map(int, sys.argv[1:]))
answers = NetlinkSocket(protocol=nl.NETLINK_NETFILTER).request(encode_dump(1), what="dump", dump=True)
print(json.dumps([[ev.orig.sport, ev.reply.src, ev.id] for m, b, s, e in answers
                  if (ev := ct.decode_event(m, b, s, e)) is not None
                  and ev.orig.proto == socket.IPPROTO_UDP and ev.orig.sport in ports]))
"""


async def udp_entries(node: Any, *sports: int) -> dict[int, tuple[str, int]]:
    _, out, _ = await node.ns.aexec(sys.executable, "-c", UDP_ENTRIES, *map(str, sports), timeout=30)
    return {sport: (reply_src, ident) for sport, reply_src, ident in json.loads(out)}


async def test_a_restarted_agent_flushes_the_udp_flows_a_local_policy_keeps_off(world: World):
    """Both traffic policies turned Local while node1's agent is down: the UDP flows from node3
    to node1's node port and from client-1 to the cluster IP that went to web-2 (node2) keep
    their conntrack entries; the restarted agent's first sync flushes them (each path against
    node1's endpoints only), and the same flows go to web-1 from then on.  The flows that
    went to web-1 keep their entries."""
    node1 = world.lab.nodes[0]
    web1, web2 = world.pods["web-1"].ip, world.pods["web-2"].ip

    def spec(policy: str) -> dict[str, Any]:
        return {"type": "NodePort", "externalTrafficPolicy": policy, "internalTrafficPolicy": policy,
                "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30055}]}  # fmt: skip

    async def flows(client: str, ip: str, port: int, sports: range) -> dict[str, int]:
        """A source port whose flow went to each of web-1 and web-2."""
        found: dict[str, int] = {}
        for sport in sports:
            names = await world.echo[client].udp(ip, port, sport=sport, count=2)
            if names[0] in ("web-1", "web-2") and names == [names[0]] * 2:
                found.setdefault(names[0], sport)
            if len(found) == 2:
                return found
        raise AssertionError(f"{client}: no flow to each of web-1 and web-2 in {len(sports)} tries: {found}")

    # The entries must outlive the agent's restart (UDP's 30 s would do, but not on a busy host).
    timeouts = {key: node1.ns.exec("sysctl", "-n", key).strip()
                for key in ("net.netfilter.nf_conntrack_udp_timeout", "net.netfilter.nf_conntrack_udp_timeout_stream")}  # fmt: skip
    slice_ports = [{"name": "dns", "port": 5353, "protocol": "UDP"}]
    await world.apply(service("restarted", spec("Cluster")),
                      endpoint_slice("restarted-1", "restarted", _eps(world, ["web-1", "web-2"]), slice_ports))
    try:
        for key in timeouts:
            node1.ns.sysctl(key, 600)
        vip = await world.vip("restarted")
        np_flows = await flows("node3", node1.address, 30055, range(22200, 22260))
        vip_flows = await flows("client-1", vip, 53, range(22300, 22360))
        sports = [*np_flows.values(), *vip_flows.values()]
        before = await udp_entries(node1, *sports)
        assert {before[np_flows["web-1"]][0], before[vip_flows["web-1"]][0]} == {web1}, before
        assert {before[np_flows["web-2"]][0], before[vip_flows["web-2"]][0]} == {web2}, before
        await node1.stop_agent()
        rev = await world.res.apply([service("restarted", spec("Local"))])
        node1.start_agent()
        await world.lab.ready.agents_started(60)
        await world.converged(rev, timeout=60)
        after = await udp_entries(node1, *sports)
        # node1's endpoint keeps its entries (the same ones), node2's are gone
        assert after == {np_flows["web-1"]: before[np_flows["web-1"]], vip_flows["web-1"]: before[vip_flows["web-1"]]}, (before, after)
        moved = await world.echo["node3"].udp(node1.address, 30055, sport=np_flows["web-2"], count=3)
        assert moved == ["web-1"] * 3, moved
        moved = await world.echo["client-1"].udp(vip, 53, sport=vip_flows["web-2"], count=3)
        assert moved == ["web-1"] * 3, moved
    finally:
        for key, value in timeouts.items():
            node1.ns.sysctl(key, value)
        if node1.agent_pid() is None:
            node1.start_agent()
            await world.lab.ready.agents_started(60)
        await world.delete("EndpointSlice", "restarted-1")
        await world.delete("Service", "restarted")


async def test_hairpin_a_pod_reaches_itself_through_its_service(world: World):
    await world.apply(service("self", {"selector": {"pod": "web-2"}, "ports": WEB_PORTS}))
    try:
        vip = await world.vip("self")
        r = await world.echo["web-2"].tcp(vip, 80, count=5)
        assert r == {"names": {"web-2": 5}, "failed": 0}, r
        assert await world.echo["web-2"].udp(vip, 53, sport=23000, count=2) == ["web-2", "web-2"]
    finally:
        await world.delete("Service", "self")


async def test_a_pod_reaching_its_service_on_a_sibling_keeps_its_address_for_policy(world: World):
    """An endpoint reaching its own Service and sent to a sibling endpoint on another node is
    not masqueraded (kube-proxy SNATs only the endpoint reaching itself): a policy on web-2
    and web-3 admitting ingress from app=web only lets web-1 reach them through the cluster
    IP (masqueraded, they would see node1's address and drop it), and web-1 still reaches
    itself (hairpin, masqueraded)."""
    await world.apply(service("peers", {"selector": {"app": "web"}, "ports": WEB_PORTS}))
    siblings = {"matchExpressions": [{"key": "pod", "operator": "In", "values": ["web-2", "web-3"]}]}
    rev = await world.res.apply([np("peers-only", "svc", {"podSelector": siblings,
                                                          "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}]})])  # fmt: skip
    try:
        await policy_converged(world.lab, rev)
        vip = await world.vip("peers")
        r = await world.echo["web-1"].tcp(vip, 80, count=30, timeout=2.0)
        assert r["failed"] == 0 and set(r["names"]) == WEBS, r
        # ... and the policy holds: a pod without app=web is kept out.
        r = await world.echo["client-1"].tcp(world.pods["web-2"].ip, 8080, count=1, timeout=1.0)
        assert r == {"names": {}, "failed": 1}, r
    finally:
        await policy_converged(world.lab, await world.res.delete("NetworkPolicy", "svc", "peers-only"))
        await world.delete("Service", "peers")


async def test_an_isolated_pod_still_reaches_itself_through_its_service(world: World):
    """NetworkPolicy cannot keep a pod from itself: web-2, isolated both ways by a policy that
    allows nothing, reaches itself through its Service (hairpin: DNATed to itself, TCP and
    UDP), while client-2 (its node) and client-1 (another node) are kept out through the same
    cluster IP, and web-2 cannot reach a sibling endpoint (egress denied)."""
    await world.apply(service("alone", {"selector": {"pod": "web-2"}, "ports": WEB_PORTS}),
                      service("pair", {"selector": {"app": "web"}, "ports": WEB_PORTS}))
    rev = await world.res.apply([np("nothing", "svc", {"podSelector": {"matchLabels": {"pod": "web-2"}},
                                                       "policyTypes": ["Ingress", "Egress"]})])  # fmt: skip
    try:
        await policy_converged(world.lab, rev)
        vip = await world.vip("alone")
        r = await world.echo["web-2"].tcp(vip, 80, count=5, timeout=2.0)
        assert r == {"names": {"web-2": 5}, "failed": 0}, r
        assert await world.echo["web-2"].udp(vip, 53, sport=23100, count=2, timeout=2.0) == ["web-2", "web-2"]
        for client in ("client-2", "client-1"):
            r = await world.echo[client].tcp(vip, 80, count=1, timeout=1.0)
            assert r == {"names": {}, "failed": 1}, (client, r)
        # Through a Service of the three webs, web-2 lands on itself only (its egress to the others is denied).
        r = await world.echo["web-2"].tcp(await world.vip("pair"), 80, count=12, timeout=1.0)
        assert set(r["names"]) <= {"web-2"} and r["failed"] > 0 and r["names"].get("web-2", 0) + r["failed"] == 12, r
    finally:
        await policy_converged(world.lab, await world.res.delete("NetworkPolicy", "svc", "nothing"))
        await world.delete("Service", "alone")
        await world.delete("Service", "pair")


async def test_host_port_through_the_portmap_plugin_and_gone_on_del(world: World):
    """The conflist's portmap (after agentd-cni) maps node1's 18080 to the pod; DEL removes it."""
    node1 = world.lab.nodes[0]
    pod = await world.lab.add_pod(node1, "svc", "hostport", labels={"app": "hp"}, ports=PORTS,
                                  host_ports=[{"hostPort": 18080, "containerPort": 8080, "protocol": "tcp"},
                                              {"hostPort": 18053, "containerPort": 5353, "protocol": "udp"}])  # fmt: skip
    echo = await Echo.start(pod, "hostport", [("tcp", 8080), ("udp", 5353)])
    try:
        r = await world.echo["node3"].tcp(node1.address, 18080, count=5)
        assert r == {"names": {"hostport": 5}, "failed": 0}, r
        assert await world.echo["node2"].udp(node1.address, 18053, sport=24000, count=2) == ["hostport", "hostport"]
        r = await world.echo["client-2"].tcp(node1.address, 18080, count=3)  # from a pod on another node
        assert r == {"names": {"hostport": 3}, "failed": 0}, r
    finally:
        await echo.close()
        await world.lab.remove_pod(pod)
    r = await world.echo["node3"].tcp(node1.address, 18080, count=1, timeout=1.0)
    assert r == {"names": {}, "failed": 1}, r
    rules = await asyncio.to_thread(node1.ns.exec, "nft", "list", "ruleset")
    assert "18080" not in rules


DNS = "169.254.20.10"


async def test_service_dns_answers_a_srv_headless_forwards_and_follows_changes(world: World):
    client = world.echo["client-1"]
    assert world.pods["client-1"].result["dns"] == {
        "nameservers": [DNS], "search": ["svc.svc.cluster.local", "svc.cluster.local", "cluster.local"], "options": ["ndots:5"]}  # fmt: skip
    await world.apply(service("web", {"selector": {"app": "web"}, "ports": WEB_PORTS}),
                      service("hl", {"clusterIP": "None", "selector": {"pod": "web-2"}, "ports": WEB_PORTS}))  # fmt: skip
    try:
        vip = await world.vip("web")
        r = await client.dns(DNS, "web.svc.svc.cluster.local", "A")
        assert r["rcode"] == "NOERROR" and r["aa"] and r["answer"] == [f"web.svc.svc.cluster.local. 5 IN A {vip}"], r
        r = await world.echo["client-3"].dns(DNS, "_http._tcp.web.svc.svc.cluster.local", "SRV", tcp=True)
        assert r["answer"] == ["_http._tcp.web.svc.svc.cluster.local. 5 IN SRV 0 100 80 web.svc.svc.cluster.local."], r
        assert r["additional"] == [f"web.svc.svc.cluster.local. 5 IN A {vip}"], r
        r = await client.dns(DNS, "_dns._udp.web.svc.svc.cluster.local", "SRV")
        assert r["answer"] == ["_dns._udp.web.svc.svc.cluster.local. 5 IN SRV 0 100 53 web.svc.svc.cluster.local."], r
        r = await client.dns(DNS, "hl.svc.svc.cluster.local", "A")  # headless: the endpoints
        assert r["answer"] == [f"hl.svc.svc.cluster.local. 5 IN A {world.pods['web-2'].ip}"], r
        own = f"{world.pods['web-2'].ip.replace('.', '-')}.hl.svc.svc.cluster.local."  # an endpoint's own name
        r = await client.dns(DNS, own, "A")
        assert r["rcode"] == "NOERROR" and r["answer"] == [f"{own} 5 IN A {world.pods['web-2'].ip}"], r
        r = await client.dns(DNS, "_http._tcp.hl.svc.svc.cluster.local", "SRV")  # its target: that name
        assert len(r["answer"]) == 1 and r["answer"][0].endswith(f" {own}") and r["additional"][0].startswith(own), r
        ptr = ipaddress.ip_address(vip).reverse_pointer  # reverse: the cluster IP's Service
        r = await client.dns(DNS, ptr, "PTR")
        assert r["rcode"] == "NOERROR" and r["aa"] and r["answer"] == [f"{ptr}. 5 IN PTR web.svc.svc.cluster.local."], r
        r = await client.dns(DNS, ipaddress.ip_address(world.pods["web-2"].ip).reverse_pointer, "PTR")
        assert r["answer"][0].endswith(f" 5 IN PTR {own}"), r
        r = await client.dns(DNS, "nope.svc.svc.cluster.local", "A")
        assert r["rcode"] == "NXDOMAIN" and r["aa"], r
        r = await client.dns(DNS, "svc.svc.cluster.local", "A")  # a namespace: exists, no records
        assert r["rcode"] == "NOERROR" and r["answer"] == [], r
        r = await client.dns(DNS, "www.example.org", "A")  # forwarded to the upstream stand-in
        assert r["rcode"] == "NOERROR" and r["answer"] == ["www.example.org. 30 IN A 192.0.2.99"], r
        # The upstream's health in GET /services: it answered, so healthy.
        shown = (await asyncio.to_thread(world.lab.nodes[0].api, "/services"))["dns"]
        assert shown["upstreams"] == [{"address": f"{world.lab.nodes[2].address}:5300", "state": "healthy", "fails": 0,
                                       "down_until": None, "retry_in": None}], shown
        # A change is answered once the node has applied it.
        await world.delete("Service", "web")
        r = await client.dns(DNS, "web.svc.svc.cluster.local", "A")
        assert r["rcode"] == "NXDOMAIN", r
    finally:
        await world.res.delete("Service", "svc", "hl")
        with contextlib.suppress(Exception):
            await world.res.delete("Service", "svc", "web")


async def test_service_dns_a_pods_hostname_and_subdomain_and_classes_other_than_in(world: World):
    """A pod record with ``spec.hostname`` and ``spec.subdomain`` (one of a node that runs no
    agent here, written as the lab writes such records) selected by the headless Service named
    ``subdomain`` is ``<hostname>.<subdomain>.<ns>.svc.<domain>``, the SRV target too.  A CH
    question of a cluster name is REFUSED, one of another name (version.bind) forwarded."""
    client = world.echo["client-1"]
    record = {"apiVersion": "v1", "kind": "Pod",
              "metadata": {"name": "peer-0", "namespace": "svc", "labels": {"sim": "peers"}},
              "spec": {"nodeName": "ghost", "hostname": "peer-0", "subdomain": "peers",
                       "containers": [{"name": "pod", "ports": PORTS}]},
              "status": {"podIPs": [{"ip": "10.244.250.9"}]}}  # fmt: skip
    await world.apply(service("peers", {"clusterIP": "None", "selector": {"sim": "peers"}, "ports": WEB_PORTS}))
    try:
        await world.res.put_records([record])
        own = "peer-0.peers.svc.svc.cluster.local."

        async def answered() -> dict[str, Any] | None:
            r = await client.dns(DNS, own, "A")
            return r if r["rcode"] == "NOERROR" and r["answer"] else None

        r = await auntil(answered, 20, what="the pod's own name answered")
        assert r["aa"] and r["answer"] == [f"{own} 5 IN A 10.244.250.9"], r
        r = await client.dns(DNS, "_http._tcp.peers.svc.svc.cluster.local", "SRV")
        assert r["answer"] == [f"_http._tcp.peers.svc.svc.cluster.local. 5 IN SRV 0 100 8080 {own}"], r
        assert r["additional"] == [f"{own} 5 IN A 10.244.250.9"], r
        r = await client.dns(DNS, "10-244-250-9.peers.svc.svc.cluster.local", "A")  # not its name any more
        assert r["rcode"] == "NXDOMAIN", r
        for name in (own, "peers.svc.svc.cluster.local", "nope.svc.svc.cluster.local"):
            r = await client.dns(DNS, name, "A", rdclass="CH")
            assert r["rcode"] == "REFUSED" and not r["aa"] and r["answer"] == [], (name, r)
        r = await client.dns(DNS, "version.bind", "TXT", rdclass="CH")  # forwarded: the stand-in answers
        assert r["rcode"] == "NOERROR" and r["answer"] == ["version.bind. 30 IN A 192.0.2.99"], r
    finally:
        with contextlib.suppress(Exception):
            await world.res.delete("Pod", "svc", "peer-0")
        await world.delete("Service", "peers")


def _table_handle(node: Any) -> int | None:
    listing = json.loads(node.ns.exec("nft", "-j", "list", "tables"))["nftables"]
    return next((i["table"]["handle"] for i in listing if i.get("table", {}).get("name") == "agentd-services"), None)


async def test_a_killed_agent_leaves_the_table_working_and_adopts_it(world: World):
    import signal

    node1 = world.lab.nodes[0]
    await world.apply(service("steady", {"selector": {"app": "web"}, "ports": WEB_PORTS}))
    try:
        vip = await world.vip("steady")
        before = await asyncio.to_thread(_table_handle, node1)
        await node1.stop_agent(signal.SIGKILL)
        r = await world.echo["client-1"].tcp(vip, 80, count=30)  # no agent: the kernel still translates
        assert r["failed"] == 0 and set(r["names"]) == WEBS, r
        node1.start_agent()
        await world.lab.ready.agents_started(60)
        await world.apply(service("steady", {"selector": {"app": "web"}, "ports": WEB_PORTS, "internalTrafficPolicy": "Local"}))
        assert await asyncio.to_thread(_table_handle, node1) == before  # adopted, not re-created
        r = await world.echo["client-1"].tcp(vip, 80, count=10)
        assert r == {"names": {"web-1": 10}, "failed": 0}, r
    finally:
        await world.delete("Service", "steady")


async def test_leave_removes_the_table(world: World):  # last: node3 goes
    node3 = world.lab.nodes[2]
    await world.apply(service("last", {"selector": {"app": "web"}, "ports": WEB_PORTS}))
    assert await asyncio.to_thread(_table_handle, node3) is not None
    await node3.leave()

    def gone() -> bool:
        return node3.agent_pid() is None and _table_handle(node3) is None

    await auntil(gone, 20, what="node3's agent gone with its services table")
