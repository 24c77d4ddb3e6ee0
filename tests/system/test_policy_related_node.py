"""Two promises of docs/policy.md (Semantics) on the real kernel, on every backend the policy
system tests cover (host-gw as tests/system/test_netpol.py, vxlan, udp and ipip as
test_netpol_backends.py):

* an isolated pod still gets the ICMP errors RELATED to its connections (replies of an
  allowed connection pass, conntrack): a port unreachable answering its own UDP datagram to
  a closed port (on another node, on its own node), and a fragmentation needed from another
  node's router for a TCP connection it accepted -- while an unrelated echo request from a
  peer no policy allows is dropped;
* traffic between a pod and its own node is always allowed (kubelet's probes): the node
  reaches an ingress-isolated pod on a port no rule allows, another node and other pods do
  not; an egress-isolated pod reaches its own node, not another node.

What is asserted is what the pods' sockets see (ECONNREFUSED from the port unreachable,
the path MTU the fragmentation needed taught, connect() completing or not), not rule text.

One lab per backend: node1 holds the isolated pods x/a (ingress: TCP 80 from x/b only) and
x/out (egress: TCP 80 to x/b only) and the unlisted x/c; node2 the allowed peer x/b and the
unlisted x/d.  node2 has the pod fast path off, so that what comes to its pods is routed by
its stack (where a lower route MTU makes the fragmentation needed); node1 keeps the default.
The same over IPv6 (ICMPv6, neighbour discovery): tests/system/test_policy_related_node6.py.
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

BACKENDS = ["host-gw", "vxlan", "udp", "ipip"]
CLOSED_UDP = 9  # nothing listens there, anywhere
NODE_PORT = 18081  # a listener in each node's namespace
SMALL_MTU = 1000  # node2's route to x/b: below every backend's pod MTU
IP_MTU = 14  # <linux/in.h>: the path MTU of a connected socket

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
    listeners: list[socket.socket]


def _socket_in(ns: Any, kind: int = socket.SOCK_STREAM) -> socket.socket:
    with ns.entered():
        return socket.socket(socket.AF_INET, kind)


def _listen_in(ns: Any, port: int) -> socket.socket:
    s = _socket_in(ns)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    return s


def _connects(ns: Any, address: str, port: int, timeout: float, bind: str | None = None) -> bool:
    """Whether a TCP connect from namespace ``ns`` completes within ``timeout``."""
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
    socket reports (``refused``: the ICMP port unreachable reached it; ``silence``: nothing)."""
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
    spec = LabSpec(name="rn" + unique_tag("")[:6], nodes=2, pods=0, backend=backend,
                   extra={"node2": {"network": {"bpf_pod_fast_path": False}}})  # fmt: skip
    lab = Lab(spec, root=tmp_path_factory.mktemp("labs"))
    listeners: list[socket.socket] = []
    try:
        await lab.up(timeout=90)
        pods = {}
        for node, name in ((0, "a"), (1, "b"), (0, "c"), (1, "d"), (0, "out")):
            pods[name] = await lab.add_pod(lab.nodes[node], "x", name, labels={"pod": name})
        for port in (80, 81):
            listeners.append(await asyncio.to_thread(_listen_in, pods["a"].ns, port))
        for node in lab.nodes:
            listeners.append(await asyncio.to_thread(_listen_in, node.ns, NODE_PORT))
        res = await lab.resources()
        await converged(lab, await res.apply(namespace("x", {"ns": "x"})))
        e = Env(lab, backend, pods, listeners)
        # Before any policy, everything below that is denied later goes through: what is
        # refused later is the policy's doing, not the lab's.
        a = pods["a"].ip
        assert await lab.ping(pods["c"], a) and await lab.ping(pods["d"], a)
        assert await connects(lab.nodes[1].ns, a, 81, 3.0) and await connects(pods["b"].ns, a, 81, 3.0)
        assert await connects(pods["out"].ns, lab.nodes[1].address, NODE_PORT, 3.0)
        await converged(lab, await res.apply(POLICIES))
        yield e
    finally:
        for s in listeners:
            s.close()
        await lab.down(keep_files=True)


# ------------------------------------------------------------------ related ICMP


async def test_an_isolated_pod_gets_the_port_unreachable_for_its_own_datagram(env: Env):
    a, b, c = env.pods["a"], env.pods["b"], env.pods["c"]
    # x/a is isolated for ingress and no rule allows UDP or ICMP into it: the answers below
    # come in only as RELATED to the datagram it sent.
    targets = {"a pod on another node": b.ip, "a pod on its own node": c.ip,
               "another node": env.lab.nodes[1].address}  # fmt: skip
    got = {what: await asyncio.to_thread(_udp_refused, a.ns, address, 3.0) for what, address in targets.items()}
    assert got == dict.fromkeys(targets, "refused"), got


async def test_an_unrelated_echo_to_an_isolated_pod_is_dropped(env: Env):
    a = env.pods["a"].ip
    # The same pods pinged x/a before the policy (the fixture); x/a still pings out (its
    # echo replies are related, in fact established).
    assert not await env.lab.ping(env.pods["c"], a), "an echo from an unlisted pod of the same node"
    assert not await env.lab.ping(env.pods["d"], a), "an echo from an unlisted pod of another node"
    assert await env.lab.ping(env.pods["a"], env.pods["d"].ip)


def _route_mtu(node: Any, address: str, mtu: int | None) -> None:
    """node's route to ``address`` with path MTU ``mtu`` (None: the /32 taken away again)."""
    if mtu is None:
        node.ns.exec("ip", "route", "del", f"{address}/32", check=False)
        return
    (route,) = json.loads(node.ns.exec("ip", "-j", "route", "get", address))
    node.ns.exec("ip", "route", "replace", f"{address}/32", "dev", route["dev"], "src", route["prefsrc"], "mtu", str(mtu))


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
            mtu: int | None = conn.getsockopt(socket.IPPROTO_IP, IP_MTU)
        except OSError:  # ENOTCONN: no route cached (retransmissions timed out reset it)
            mtu = None
        return got, mtu
    finally:
        conn.close()


async def test_an_isolated_pod_gets_fragmentation_needed_for_a_connection_it_accepted(env: Env):
    """x/b (allowed) connects to x/a's port 80 and x/a sends it 512 KB.  node2 routes to x/b
    through a route of MTU 1000: its stack answers x/a's full-size segments with ICMP
    fragmentation needed, which must reach x/a (RELATED to the accepted connection) for
    the transfer to go on at the smaller size."""
    a, b, node2 = env.pods["a"], env.pods["b"], env.lab.nodes[1]
    server = await asyncio.to_thread(_listen_in, a.ns, 8080)
    client = await asyncio.to_thread(_socket_in, b.ns)
    await converged(env.lab, await (await env.lab.resources()).apply(
        np("a-in-8080", "x", {"podSelector": {"matchLabels": {"pod": "a"}},
                              "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}], "ports": [{"port": 8080}]}]})))  # fmt: skip
    await asyncio.to_thread(_route_mtu, node2, b.ip, SMALL_MTU)
    try:
        client.settimeout(3.0)
        await asyncio.to_thread(client.connect, (a.ip, 8080))
        size = 512 * 1024
        got, mtu = await asyncio.to_thread(_transfer, server, client, size, 10.0)
        assert (got, mtu) == (size, SMALL_MTU), f"received {got} of {size} bytes; x/a's path MTU to x/b {mtu}"
    finally:
        client.close()
        server.close()
        await asyncio.to_thread(_route_mtu, node2, b.ip, None)
        await (await env.lab.resources()).delete("NetworkPolicy", "x", "a-in-8080")


# ------------------------------------------------------------------ a pod and its own node


async def test_a_pods_own_node_reaches_it_where_nothing_else_does(env: Env):
    a, node1, node2 = env.pods["a"].ip, env.lab.nodes[0], env.lab.nodes[1]
    # Port 81: no rule allows it to anybody.  x/a's node reaches it (kubelet's probes), from
    # the address it picks (the bridge's) and from its underlay address.
    assert await connects(node1.ns, a, 81, 3.0), "x/a's own node, from the bridge's address"
    assert await connects(node1.ns, a, 81, 3.0, bind=node1.address), "x/a's own node, from its underlay address"
    # Nobody else does: another node, the allowed peer (on port 81), an unlisted pod of the same node.
    assert not await connects(node2.ns, a, 81), "another node"
    assert not await connects(node2.ns, a, 80), "another node, on the allowed port"
    assert not await connects(env.pods["b"].ns, a, 81), "the allowed peer, on another port"
    assert not await connects(env.pods["c"].ns, a, 81), "an unlisted pod of x/a's node"
    # The allowed peer on the allowed port: the policy is in force, not just closed.
    assert await connects(env.pods["b"].ns, a, 80, 3.0)


async def test_an_egress_isolated_pod_reaches_its_own_node_and_no_other(env: Env):
    out, node1, node2 = env.pods["out"], env.lab.nodes[0], env.lab.nodes[1]
    gateway = json.loads(out.ns.exec("ip", "-j", "route", "get", node2.address))[0]["gateway"]
    assert await connects(out.ns, gateway, NODE_PORT, 3.0), "its own node, at the bridge's address"
    assert await connects(out.ns, node1.address, NODE_PORT, 3.0), "its own node, at its underlay address"
    assert not await connects(out.ns, node2.address, NODE_PORT), "another node"
    assert not await connects(out.ns, env.pods["a"].ip, 81), "a pod the policy does not list"
