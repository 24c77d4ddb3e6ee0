"""Services over the encapsulating backends: the masquerade mark does not reach the tunnel.

A node port with externalTrafficPolicy Cluster marks a connection for masquerading (the
0x4000 bit of the packet mark, as kube-proxy).  vxlan keeps the packet mark on the
encapsulated packet, so the outer packet, sent by the node itself, met the services table's
postrouting chain with the bit still set and was masqueraded too (with fully random ports,
its source port rewritten; without, a null binding while its port was free, which the
conntrack entry does not show: the bit on the outer packet is what tells).  The chain clears the bit before
masquerading (kubernetes#92035).  Here node2 reaches node1's node port whose only endpoint is
on node2: node1 translates, masquerades the inner connection and sends it through the tunnel
to node2; a probe table in node1's namespace (a filter chain after SRCNAT, on the postrouting
hook) counts the tunnel's outer packets, those still carrying the bit and those whose
conntrack entry was source-NATed: the last two stay 0.

vxlan runs on the kernel's vxlan device; ipip (no kernel ipip module here) on its user-space
TUN path, whose outer packets a raw socket sends: they too pass node1's postrouting hook, but
without the inner packet's mark (the raw socket's is 0), so ipip holds even without the fix:
the check guards that path against a change that would carry the mark over (in
BPF, the outer header is pushed at tc egress, after netfilter: the probe would see no outer
packet, so that data path is not the one checked here).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import pytest_asyncio

from agentd.lab.lab import Lab, LabSpec
from agentd.lab.netns import unique_tag
from agentd.lab.svcecho import Echo
from agentd.lab.wait import auntil

pytestmark = pytest.mark.asyncio(loop_scope="module")

NODE_PORT = 30090
# The tunnel's outer packets as node1 sends them on the underlay.
OUTER = {"vxlan": ["udp", "dport", "4789"], "ipip": ["ip", "protocol", "4"]}
PROBE = "svcprobe"  # node1's probe table (ip family): counters only, after the services table's SRCNAT
MASQ_MARK = "0x00004000"


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[("vxlan", "auto"), ("ipip", "userspace")], ids=["vxlan", "ipip"])
async def lab(request, tmp_path_factory):
    backend, datapath = request.param
    spec = LabSpec(name="se" + unique_tag("")[:6], nodes=2, pods=0, backend=backend, datapath=datapath)
    lab = Lab(spec, root=tmp_path_factory.mktemp("labs"))
    echo: Echo | None = None
    try:
        await lab.up(timeout=90)
        web = await lab.add_pod(lab.nodes[1], "svc", "web-2", labels={"app": "web"},
                                ports=[{"name": "http", "containerPort": 8080, "protocol": "TCP"}])  # fmt: skip
        echo = await Echo.start(web, "web-2", [("tcp", 8080)])
        lab.web = web  # type: ignore[attr-defined]
        yield lab
    finally:
        if echo is not None:
            await echo.close()
        await lab.down(keep_files=True)


def _probe(lab: Lab) -> None:
    """node1's probe table: named counters of the tunnel's outer packets after SRCNAT (and of
    the inner connections' packets to web-2, source-NATed)."""
    outer = " ".join(OUTER[lab.spec.backend])
    web = lab.web.ip  # type: ignore[attr-defined]
    rules = f"""
table ip {PROBE} {{
    counter outer {{ }}
    counter marked {{ }}
    counter natted {{ }}
    counter inner {{ }}
    chain postrouting {{
        type filter hook postrouting priority srcnat + 10; policy accept;
        {outer} counter name outer
        {outer} meta mark & {MASQ_MARK} != 0 counter name marked
        {outer} ct status snat counter name natted
        ip daddr {web} tcp dport 8080 ct status snat counter name inner
    }}
}}
"""
    ns = lab.nodes[0].ns
    ns.exec("nft", "delete", "table", "ip", PROBE, check=False)
    ns.exec("nft", "-f", "-", input=rules.encode())


def _counters(lab: Lab) -> dict[str, int]:
    out = json.loads(lab.nodes[0].ns.exec("nft", "-j", "list", "counters", "table", "ip", PROBE))
    return {item["counter"]["name"]: item["counter"]["packets"] for item in out["nftables"] if "counter" in item}


async def _converged(lab: Lab, revision: int) -> None:
    def applied() -> bool:
        views = [n.api_or_none("/services?view=summary") or {} for n in lab.nodes]
        return all(v.get("revision", 0) >= revision and not v.get("error") for v in views)

    await auntil(applied, 20, what=f"services revision {revision} on every node")


async def test_a_node_port_to_another_nodes_endpoint_does_not_masquerade_the_tunnel(lab: Lab):
    node1, node2 = lab.nodes
    res = await lab.resources()
    svc: dict[str, Any] = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "np", "namespace": "svc"},
                           "spec": {"type": "NodePort", "selector": {"app": "web"},
                                    "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": NODE_PORT}]}}  # fmt: skip
    client = await Echo.start(node2, "node2")
    try:
        await _converged(lab, await res.apply([svc]))
        _probe(lab)
        try:
            # node2's underlay address -> node1's node port -> web-2 on node2: translated and
            # masqueraded on node1 (the endpoint's reply must come back through it), over the tunnel.
            r = await client.tcp(node1.address, NODE_PORT, count=20)
            assert r == {"names": {"web-2": 20}, "failed": 0}, r
            counted = _counters(lab)
            # Not vacuous: the connections crossed the tunnel from node1, past the probe.
            assert counted["outer"] >= 20 * 3, counted
            # The outer packets kept node1's own source address and port, and the bit was cleared.
            assert counted["marked"] == 0 and counted["natted"] == 0, counted
            # The inner connections were masqueraded all the same (web-2 saw node1, not node2).
            assert counted["inner"] >= 20 * 3, counted
        finally:
            node1.ns.exec("nft", "delete", "table", "ip", PROBE, check=False)
    finally:
        await client.close()
        await _converged(lab, await res.delete("Service", "svc", "np"))
        # (res is the lab's, which lab.down closes: the next test uses it too)


SEEN = "svcseen"  # node2's probe table: the sources web-2's connections arrive with


async def test_a_nodes_own_connection_to_a_cluster_ip_is_masqueraded_to_its_tunnel_address(lab: Lab):
    """The node itself (or a hostNetwork pod) reaching a cluster IP whose endpoint is on
    another node: its source, chosen by the route to the VIP before the translation, is its
    underlay address; unmasqueraded, the endpoint's reply would cross the underlay
    unencapsulated with the pod's source address, which strict reverse-path filtering drops
    (as a cloud's source/destination check).  As kube-proxy, the connection (not from this
    node's pods) is marked for masquerading: the endpoint sees node1's tunnel address, in its
    pod subnet.  node1 runs with strict rp_filter on the vxlan backend (the user-space ipip
    path's TUN needs it off), and a route covering the VIP (lab nodes have no default route)."""
    node1, node2 = lab.nodes
    res = await lab.resources()
    svc: dict[str, Any] = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "vip", "namespace": "svc"},
                           "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}  # fmt: skip
    client = await Echo.start(node1, "node1")
    strict = lab.spec.backend == "vxlan"
    subnet = (node1.api("/status").get("node") or {}).get("subnet")
    web = lab.web.ip  # type: ignore[attr-defined]
    assert subnet, node1.api("/status")
    try:
        await _converged(lab, await res.apply([svc]))
        vip = (await res.get("Service", "svc", "vip"))["spec"]["clusterIP"]
        node2.ns.exec("nft", "-f", "-", input=f"""
table ip {SEEN} {{
    counter underlay {{ }}
    counter tunnel {{ }}
    chain forward {{
        type filter hook forward priority filter - 10; policy accept;
        ip daddr {web} tcp dport 8080 tcp flags syn ip saddr {node1.address} counter name underlay
        ip daddr {web} tcp dport 8080 tcp flags syn ip saddr {subnet} counter name tunnel
    }}
}}
""".encode())
        node1.ns.ip("route", "add", "default", "via", node2.address)
        if strict:
            node1.ns.sysctl("net.ipv4.conf.all.rp_filter", 1)
        try:
            r = await client.tcp(vip, 80, count=20)
        finally:
            node1.ns.sysctl("net.ipv4.conf.all.rp_filter", 0)
            node1.ns.ip("route", "del", "default", check=False)
        out = json.loads(node2.ns.exec("nft", "-j", "list", "counters", "table", "ip", SEEN))
        seen = {item["counter"]["name"]: item["counter"]["packets"] for item in out["nftables"] if "counter" in item}
        assert r == {"names": {"web-2": 20}, "failed": 0}, (r, seen)
        assert seen["underlay"] == 0 and seen["tunnel"] >= 20, seen
    finally:
        node2.ns.exec("nft", "delete", "table", "ip", SEEN, check=False)
        await client.close()
        await _converged(lab, await res.delete("Service", "svc", "vip"))
