"""[network] ip_masq keeps pods from posing as their node (root, a lab): masqueraded, a pod's
packet to another node's underlay address comes from its node's address, which that node's
BGP listener, udp worker, VXLAN device and IPIP tunnel take as a member's.  node1 masquerades:

* its ``members`` set holds the nodes' underlay addresses;
* a pod's UDP to node2's ``udp_port`` and ``vxlan_port``, and TCP to its BGP port, never arrive;
* a pod's UDP and TCP to another port of node2 arrive as node1 (masqueraded, as before): pods
  keep reaching other nodes' host services.
"""

from __future__ import annotations

import socket

from agentd.lab.wait import auntil

UDP_PORT, VXLAN_PORT = 8285, 4789  # [network] defaults


def _udp_from(pod, listen_ns, address: str, port: int) -> str | None:
    """Send a datagram from ``pod`` to ``address:port``, bound in ``listen_ns``: the source it
    came from there, None when nothing came within 2 s."""
    with listen_ns.entered():
        server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with pod.ns.entered():
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with server, client:
        server.bind((address, port))
        server.settimeout(2)
        for _ in range(3):
            client.sendto(b"forged", (address, port))
        try:
            _data, (source, _port) = server.recvfrom(2048)
        except TimeoutError:
            return None
        return source


def _tcp_from(pod, listen_ns, address: str, port: int) -> str | None:
    with pod.ns.entered():
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server = None
    if port != 179:
        with listen_ns.entered():
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind((address, port))
        server.listen(1)
        server.settimeout(5)
    with client:
        client.settimeout(2)
        try:
            client.connect((address, port))
        except (TimeoutError, OSError):
            return None
        if server is None:
            return "connected"
        with server:
            conn, (source, _port) = server.accept()
            conn.close()
            return source


async def test_a_masquerading_nodes_pods_cannot_reach_the_members_agent_ports_as_their_node(lab_factory):
    lab = await lab_factory(nodes=2, pods=1, backend="host-gw", extra={"node1": {"network": {"ip_masq": True}}})
    node1, node2 = lab.nodes
    pod1 = next(p for p in lab.pods if p.node is node1)

    def members() -> bool:
        listing = node1.ns.exec("nft", "list", "set", "ip", "agentd-masq", "members")
        return node1.address in listing and node2.address in listing

    await auntil(members, 30, what="node1's members set to hold both nodes")
    # Another port of node2: masqueraded as before (pods reach other nodes' host services).
    assert _udp_from(pod1, node2.ns, node2.address, 40123) == node1.address
    assert _tcp_from(pod1, node2.ns, node2.address, 40124) == node1.address
    # The agent's own ports on a member: dropped, never arriving as node1.
    assert _udp_from(pod1, node2.ns, node2.address, UDP_PORT) is None
    assert _udp_from(pod1, node2.ns, node2.address, VXLAN_PORT) is None
    assert _tcp_from(pod1, node2.ns, node2.address, 179) is None  # node2's BGP listener
    # node2 does not masquerade: no guard there, its pod reaches node1's BGP port as itself.
    pod2 = next(p for p in lab.pods if p.node is node2)
    assert _tcp_from(pod2, node1.ns, node1.address, 179) == "connected"


async def test_the_masquerading_table_leaves_services_marks_and_comes_back_when_deleted(lab_factory):
    """The chain runs after the Services table's postrouting chain (srcnat + 10, whichever table
    was made first), returning what kube-proxy's bit marks (the Services table masquerades it,
    clearing the bit first); deleted by someone else (``nft flush ruleset``, a firewall's
    restart), the table is written again within a few seconds (CHECK_INTERVAL), whole."""
    from agentd.nft.masquerade import CHECK_INTERVAL

    lab = await lab_factory(nodes=1, pods=0, backend="host-gw", extra={"node1": {"network": {"ip_masq": True}}})
    node1 = lab.nodes[0]

    def listing() -> str:
        return node1.ns.exec("nft", "list", "table", "ip", "agentd-masq", check=False)

    await auntil(lambda: node1.address in listing(), 30, what="node1's masquerading table with its members")
    before = listing()
    chain = before[before.index("chain postrouting"):]
    lines = [line.strip() for line in chain.splitlines()[1:3]]
    assert lines == ["type nat hook postrouting priority srcnat + 10; policy accept;",
                     "meta mark & 0x00004000 == 0x00004000 return"], chain  # fmt: skip
    node1.ns.exec("nft", "delete", "table", "ip", "agentd-masq")
    assert listing() == ""
    await auntil(lambda: listing() == before, 3 * CHECK_INTERVAL, what="the masquerading table written again")
