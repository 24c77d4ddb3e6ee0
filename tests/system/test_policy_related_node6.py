"""The promises of tests/system/test_policy_related_node.py over IPv6, on the backends that carry
IPv6 pods (docs/networking.md: host-gw, vxlan and udp; ipip routes a dual-stack lab's IPv6
pods as host-gw does), each a dual-stack lab:

* an isolated pod still gets the ICMPv6 errors RELATED to its connections: a destination
  unreachable (port unreachable) answering its own UDP datagram to a closed port (on another
  node's pod, on its own node's pod, on another node), and a packet too big from another node's
  router for a TCP connection it accepted -- while an unrelated echo request from a peer no
  policy allows is dropped;
* neighbour discovery keeps working to and from the isolated pod (caches flushed: it resolves
  a pod of its node and its gateway, its node resolves it), so the drops above are the
  policy's, not a lost neighbour;
* traffic between a pod and its own node is always allowed over IPv6 too: the node reaches an
  ingress-isolated pod on a port no rule allows, another node does not; an egress-isolated pod
  reaches its own node, not another node.

What is asserted is what the pods' sockets see (ECONNREFUSED from the port unreachable, the
path MTU the packet too big taught, connect() completing or not), not rule text.

One lab per backend, laid out as the IPv4 test's: node1 holds the isolated pods x/a (ingress:
TCP 80 from x/b only) and x/out (egress: TCP 80 to x/b only) and the unlisted x/c; node2 the
allowed peer x/b and the unlisted x/d.  node2 has the pod fast path off, so that what comes
to its pods is routed by its stack (where a lower route MTU makes the packet too big).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from netpol_lab import converged, namespace, np

from agentd.lab.lab import Lab, LabSpec
from agentd.lab.netns import unique_tag

pytestmark = pytest.mark.asyncio(loop_scope="module")

BACKENDS = ["host-gw", "vxlan", "udp"]
CLOSED_UDP = 9  # nothing listens there, anywhere
NODE_PORT = 18081  # a listener in each node's namespace
SMALL_MTU = 1280  # node2's route to x/b: IPv6's minimum, below every backend's pod MTU
IPV6_MTU = 24  # <linux/in6.h>: the path MTU of a connected socket

POLICIES = [
    np("a-in", "x", {"podSelector": {"matchLabels": {"pod": "a"}}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}], "ports": [{"port": 80}]}]}),
    np("out-eg", "x", {"podSelector": {"matchLabels": {"pod": "out"}}, "policyTypes": ["Egress"],
                       "egress": [{"to": [{"podSelector": {"matchLabels": {"pod": "b"}}}], "ports": [{"port": 80}]}]}),
]  # fmt: skip


@dataclass
class Env:
    lab: Lab
    backend: str
    pods: dict[str, Any]  # "a" -> LabPod of x/a
    six: dict[str, str]  # "a" -> x/a's IPv6 address
    listeners: list[socket.socket]


def _socket_in(ns: Any, kind: int = socket.SOCK_STREAM) -> socket.socket:
    with ns.entered():
        return socket.socket(socket.AF_INET6, kind)


def _listen_in(ns: Any, port: int) -> socket.socket:
    s = _socket_in(ns)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind(("::", port))
    s.listen(64)
    return s


def _connects(ns: Any, address: str, port: int, timeout: float, bind: str | None = None) -> bool:
    """Whether a TCP connect over IPv6 from namespace ``ns`` completes within ``timeout``."""
    s = _socket_in(ns)
    try:
        if bind is not None:
            s.bind((bind, 0))
        s.settimeout(timeout)
        s.connect((address, port))
        return True
    except (TimeoutError, ConnectionRefusedError, OSError):
        return False
    finally:
        s.close()


async def connects(ns: Any, address: str, port: int, timeout: float = 1.0, bind: str | None = None) -> bool:
    return await asyncio.to_thread(_connects, ns, address, port, timeout, bind)


def _udp_refused(ns: Any, address: str, timeout: float) -> str:
    """A datagram to ``address``'s closed port from a connected UDP socket in ``ns``: what the
    socket reports (``refused``: the ICMPv6 port unreachable reached it; ``silence``: nothing)."""
    s = _socket_in(ns, socket.SOCK_DGRAM)
    try:
        s.connect((address, CLOSED_UDP))
        s.settimeout(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s.send(b"anyone?")
            try:
                s.recv(100)
                return "answered"
            except ConnectionRefusedError:
                return "refused"
            except TimeoutError:
                return "silence"
        return "silence"
    finally:
        s.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=BACKENDS)
async def env(request, tmp_path_factory):
    backend = request.param
    spec = LabSpec(name="r6" + unique_tag("")[:6], nodes=2, pods=0, backend=backend, ip_family="dual",
                   extra={"node2": {"network": {"bpf_pod_fast_path": False}}})  # fmt: skip
    lab = Lab(spec, root=tmp_path_factory.mktemp("labs"))
    listeners: list[socket.socket] = []
    try:
        await lab.up(timeout=90)
        pods = {}
        for node, name in ((0, "a"), (1, "b"), (0, "c"), (1, "d"), (0, "out")):
            pods[name] = await lab.add_pod(lab.nodes[node], "x", name, labels={"pod": name})
        six = {name: pod.address(6) for name, pod in pods.items()}
        assert all(six.values()) and all(n.address_v6 for n in lab.nodes), (six, lab.nodes)
        for port in (80, 81):
            listeners.append(await asyncio.to_thread(_listen_in, pods["a"].ns, port))
        for node in lab.nodes:
            listeners.append(await asyncio.to_thread(_listen_in, node.ns, NODE_PORT))
        res = await lab.resources()
        await converged(lab, await res.apply(namespace("x", {"ns": "x"})))
        e = Env(lab, backend, pods, six, listeners)  # type: ignore[arg-type]  # every one is there: asserted
        # Before any policy, everything below that is denied later goes through over IPv6:
        # what is refused later is the policy's doing, not the lab's.
        a = six["a"]
        assert await lab.ping(pods["c"], a) and await lab.ping(pods["d"], a)
        assert await connects(lab.nodes[1].ns, a, 81, 3.0) and await connects(pods["b"].ns, a, 81, 3.0)
        assert await connects(pods["out"].ns, lab.nodes[1].address_v6, NODE_PORT, 3.0)  # type: ignore[arg-type]
        await converged(lab, await res.apply(POLICIES))
        yield e
    finally:
        for s in listeners:
            s.close()
        await lab.down(keep_files=True)


# ------------------------------------------------------------------ related ICMPv6


async def test_an_isolated_pod_gets_the_port_unreachable_for_its_own_datagram(env: Env):
    # x/a is isolated for ingress and no rule allows UDP or ICMPv6 into it: the answers below
    # come in only as RELATED to the datagram it sent.
    targets = {"a pod on another node": env.six["b"], "a pod on its own node": env.six["c"],
               "another node": env.lab.nodes[1].address_v6}  # fmt: skip
    a = env.pods["a"]
    got = {what: await asyncio.to_thread(_udp_refused, a.ns, address, 3.0) for what, address in targets.items()}
    assert got == dict.fromkeys(targets, "refused"), got


async def test_an_unrelated_echo_to_an_isolated_pod_is_dropped(env: Env):
    a = env.six["a"]
    # The same pods pinged x/a over IPv6 before the policy (the fixture); x/a still pings out
    # (its echo replies are established).
    assert not await env.lab.ping(env.pods["c"], a), "an echo from an unlisted pod of the same node"
    assert not await env.lab.ping(env.pods["d"], a), "an echo from an unlisted pod of another node"
    assert await env.lab.ping(env.pods["a"], env.six["d"])


def _neighbours(ns: Any) -> dict[str, dict[str, Any]]:
    return {n["dst"]: n for n in json.loads(ns.exec("ip", "-6", "-j", "neigh", "show"))}


async def test_neighbour_discovery_to_and_from_an_isolated_pod_keeps_working(env: Env):
    """Caches flushed in x/a, x/c and node1's bridge: x/a resolves x/c (a pod of its node: its
    solicitation out, the unicast advertisement in) and its gateway, node1 resolves x/a, and
    the traffic that needs them goes through -- and what the policy drops is still dropped."""
    a, c, node1 = env.pods["a"], env.pods["c"], env.lab.nodes[0]
    gateway = json.loads(a.ns.exec("ip", "-6", "-j", "route", "get", env.six["b"]))[0]["gateway"]
    for ns in (a.ns, c.ns):
        ns.exec("ip", "-6", "neigh", "flush", "dev", "eth0")
    node1.ns.exec("ip", "-6", "neigh", "flush", "dev", "cni0")  # its pods' entries only (not the underlay's)
    assert env.six["c"] not in _neighbours(a.ns) and env.six["a"] not in _neighbours(node1.ns)
    assert await env.lab.ping(a, env.six["c"]), "x/a to a pod of its node, its caches empty"
    assert await connects(env.pods["b"].ns, env.six["a"], 80, 3.0), "the allowed peer, x/a's and node1's caches empty"
    known = _neighbours(a.ns)
    c_mac = json.loads(c.ns.exec("ip", "-j", "link", "show", "dev", "eth0"))[0]["address"]
    assert known.get(env.six["c"], {}).get("lladdr") == c_mac, known
    assert known.get(gateway, {}).get("lladdr"), known
    assert _neighbours(node1.ns).get(env.six["a"], {}).get("lladdr"), "node1 resolved x/a"
    assert not await env.lab.ping(c, env.six["a"]), "an echo from an unlisted pod: still dropped"


def _route_mtu(node: Any, address: str, mtu: int | None) -> None:
    """node's route to ``address`` with path MTU ``mtu`` (None: the /128 taken away again)."""
    if mtu is None:
        node.ns.exec("ip", "-6", "route", "del", f"{address}/128", check=False)
        return
    (route,) = json.loads(node.ns.exec("ip", "-6", "-j", "route", "get", address))
    via = ["via", route["gateway"]] if route.get("gateway") else []
    node.ns.exec("ip", "-6", "route", "replace", f"{address}/128", *via, "dev", route["dev"], "src", route["prefsrc"],
                 "mtu", str(mtu))


def _transfer(server: socket.socket, client: socket.socket, size: int, timeout: float) -> tuple[int, int | None]:
    """``size`` bytes from the accepting end of ``server`` to ``client``: (bytes received, the
    sender's path MTU when it is done, None if it has no route cached)."""
    server.settimeout(timeout)
    conn, _ = server.accept()
    try:
        conn.settimeout(timeout)
        client.settimeout(0.2)
        payload = b"\xa5" * size
        sent, got = 0, 0
        deadline = time.monotonic() + timeout
        conn.setblocking(False)
        while got < size and time.monotonic() < deadline:
            if sent < size:
                try:
                    sent += conn.send(payload[sent:])
                except BlockingIOError:
                    pass
            try:
                chunk = client.recv(1 << 16)
            except TimeoutError:
                continue
            if not chunk:
                break
            got += len(chunk)
        try:
            mtu: int | None = conn.getsockopt(socket.IPPROTO_IPV6, IPV6_MTU)
        except OSError:  # ENOTCONN: no route cached
            mtu = None
        return got, mtu
    finally:
        conn.close()


async def test_an_isolated_pod_gets_packet_too_big_for_a_connection_it_accepted(env: Env):
    """x/b (allowed) connects to x/a's port 8080 over IPv6 and x/a sends it 512 KB.  node2
    routes to x/b through a route of MTU 1280: its stack answers x/a's full-size segments with
    ICMPv6 packet too big (no router fragments IPv6), which must reach x/a (RELATED to the
    accepted connection) for the transfer to go on at all."""
    a, b, node2 = env.pods["a"], env.pods["b"], env.lab.nodes[1]
    server = await asyncio.to_thread(_listen_in, a.ns, 8080)
    client = await asyncio.to_thread(_socket_in, b.ns)
    await converged(env.lab, await (await env.lab.resources()).apply(
        np("a-in-8080", "x", {"podSelector": {"matchLabels": {"pod": "a"}},
                              "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}], "ports": [{"port": 8080}]}]})))  # fmt: skip
    await asyncio.to_thread(_route_mtu, node2, env.six["b"], SMALL_MTU)
    try:
        client.settimeout(3.0)
        await asyncio.to_thread(client.connect, (env.six["a"], 8080))
        size = 512 * 1024
        got, mtu = await asyncio.to_thread(_transfer, server, client, size, 10.0)
        assert (got, mtu) == (size, SMALL_MTU), f"received {got} of {size} bytes; x/a's path MTU to x/b {mtu}"
    finally:
        client.close()
        server.close()
        await asyncio.to_thread(_route_mtu, node2, env.six["b"], None)
        await (await env.lab.resources()).delete("NetworkPolicy", "x", "a-in-8080")


# ------------------------------------------------------------------ a pod and its own node


async def test_a_pods_own_node_reaches_it_where_nothing_else_does(env: Env):
    a, node1, node2 = env.six["a"], env.lab.nodes[0], env.lab.nodes[1]
    # Port 81: no rule allows it to anybody.  x/a's node reaches it (kubelet's probes), from
    # the address it picks (the bridge's) and from its underlay address.
    assert await connects(node1.ns, a, 81, 3.0), "x/a's own node, from the bridge's address"
    assert await connects(node1.ns, a, 81, 3.0, bind=node1.address_v6), "x/a's own node, from its underlay address"
    assert not await connects(node2.ns, a, 81), "another node"
    assert not await connects(node2.ns, a, 80), "another node, on the allowed port"
    assert not await connects(env.pods["b"].ns, a, 81), "the allowed peer, on another port"
    assert not await connects(env.pods["c"].ns, a, 81), "an unlisted pod of x/a's node"
    assert await connects(env.pods["b"].ns, a, 80, 3.0)  # the policy is in force, not just closed


async def test_an_egress_isolated_pod_reaches_its_own_node_and_no_other(env: Env):
    out, node1, node2 = env.pods["out"], env.lab.nodes[0], env.lab.nodes[1]
    gateway = json.loads(out.ns.exec("ip", "-6", "-j", "route", "get", node2.address_v6))[0]["gateway"]
    assert await connects(out.ns, gateway, NODE_PORT, 3.0), "its own node, at the bridge's address"
    assert await connects(out.ns, node1.address_v6, NODE_PORT, 3.0), "its own node, at its underlay address"
    assert not await connects(out.ns, node2.address_v6, NODE_PORT), "another node"
    assert not await connects(out.ns, env.six["a"], 81), "a pod the policy does not list"
