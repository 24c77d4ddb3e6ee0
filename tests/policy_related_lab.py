"""The lab and the checks of tests/system/test_policy_related_node.py (over IPv4) and
test_policy_related_node6.py (the same over IPv6, in a dual-stack lab), written once for
either family: the family a socket, a route or a command goes over is the one of the address
it is given (or ``Env.family``).

One lab per backend: node1 holds the isolated pods x/a (ingress: TCP 80 from x/b only) and
x/out (egress: TCP 80 to x/b only) and the unlisted x/c; node2 the allowed peer x/b and the
unlisted x/d.  node2 has the pod fast path off, so that what comes to its pods is routed by
its stack (where a lower route MTU makes the fragmentation needed, or the packet too big);
node1 keeps the default.  x/a listens on TCP 80 and 81, each node's namespace on NODE_PORT.

What is asserted is what the pods' sockets see (ECONNREFUSED from the port unreachable, the
path MTU the ICMP error taught, connect() completing or not), not rule text.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import pathlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest_asyncio
from netpol_lab import converged, namespace, np

from agentd.lab.lab import Lab, LabSpec
from agentd.lab.netns import unique_tag

CLOSED_UDP = 9  # nothing listens there, anywhere
NODE_PORT = 18081  # a listener in each node's namespace
# The path MTU of a connected socket: IP_MTU of <linux/in.h>, IPV6_MTU of <linux/in6.h>.
PATH_MTU_OPTION = {4: (socket.IPPROTO_IP, 14), 6: (socket.IPPROTO_IPV6, 24)}

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
    family: int  # 4 or 6: what the tests go over
    pods: dict[str, Any]  # "a" -> LabPod of x/a
    addr: dict[str, str]  # "a" -> x/a's address of ``family``
    listeners: list[socket.socket]

    def node_address(self, index: int) -> str:
        """The underlay address of ``lab.nodes[index]`` of ``family``."""
        node = self.lab.nodes[index]
        address = node.address_v6 if self.family == 6 else node.address
        assert address, node
        return address

    def ip(self, *args: str) -> list[str]:
        """An ``ip`` command over ``family``."""
        return ["ip", "-6", *args] if self.family == 6 else ["ip", *args]


def family_of(address: str) -> int:
    return ipaddress.ip_address(address).version


def socket_in(ns: Any, family: int, kind: int = socket.SOCK_STREAM) -> socket.socket:
    with ns.entered():
        return socket.socket(socket.AF_INET6 if family == 6 else socket.AF_INET, kind)


def listen_in(ns: Any, family: int, port: int) -> socket.socket:
    s = socket_in(ns, family)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == 6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind(("::" if family == 6 else "0.0.0.0", port))
    s.listen(64)
    return s


def _connects(ns: Any, address: str, port: int, timeout: float, bind: str | None = None) -> bool:
    """Whether a TCP connect from namespace ``ns`` completes within ``timeout``."""
    s = socket_in(ns, family_of(address))
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


def udp_refused(ns: Any, address: str, timeout: float) -> str:
    """A datagram to ``address``'s closed port from a connected UDP socket in ``ns``: what the
    socket reports (``refused``: the ICMP or ICMPv6 port unreachable reached it; ``silence``:
    nothing)."""
    s = socket_in(ns, family_of(address), socket.SOCK_DGRAM)
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


def route_mtu(node: Any, address: str, mtu: int | None) -> None:
    """node's route to ``address`` with path MTU ``mtu`` (None: the /32 or /128 taken away
    again), through the gateway of the route it has now if that one has one."""
    ip = ["ip", "-6"] if family_of(address) == 6 else ["ip"]
    host = f"{address}/{128 if family_of(address) == 6 else 32}"
    if mtu is None:
        node.ns.exec(*ip, "route", "del", host, check=False)
        return
    (route,) = json.loads(node.ns.exec(*ip, "-j", "route", "get", address))
    via = ["via", route["gateway"]] if route.get("gateway") else []
    node.ns.exec(*ip, "route", "replace", host, *via, "dev", route["dev"], "src", route["prefsrc"], "mtu", str(mtu))


def transfer(server: socket.socket, client: socket.socket, size: int, timeout: float) -> tuple[int, int | None]:
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
            mtu: int | None = conn.getsockopt(*PATH_MTU_OPTION[6 if conn.family == socket.AF_INET6 else 4])
        except OSError:  # ENOTCONN: no route cached (retransmissions timed out reset it)
            mtu = None
        return got, mtu
    finally:
        conn.close()


@contextlib.asynccontextmanager
async def related_lab(backend: str, family: int, root: pathlib.Path) -> AsyncIterator[Env]:
    """The lab above on ``backend`` (dual-stack for ``family`` 6), its policies in force."""
    spec = LabSpec(name=("r6" if family == 6 else "rn") + unique_tag("")[:6], nodes=2, pods=0, backend=backend,
                   ip_family="dual" if family == 6 else "ipv4",
                   extra={"node2": {"network": {"bpf_pod_fast_path": False}}})  # fmt: skip
    lab = Lab(spec, root=root)
    listeners: list[socket.socket] = []
    try:
        await lab.up(timeout=90)
        pods = {}
        for node, name in ((0, "a"), (1, "b"), (0, "c"), (1, "d"), (0, "out")):
            pods[name] = await lab.add_pod(lab.nodes[node], "x", name, labels={"pod": name})
        addr = {name: pod.address(family) for name, pod in pods.items()}
        e = Env(lab, backend, family, pods, addr, listeners)  # type: ignore[arg-type]  # every one is there: asserted
        assert all(addr.values()) and all(e.node_address(i) for i in range(len(lab.nodes))), (addr, lab.nodes)
        for port in (80, 81):
            listeners.append(await asyncio.to_thread(listen_in, pods["a"].ns, family, port))
        for node in lab.nodes:
            listeners.append(await asyncio.to_thread(listen_in, node.ns, family, NODE_PORT))
        res = await lab.resources()
        await converged(lab, await res.apply(namespace("x", {"ns": "x"})))
        # Before any policy, everything below that is denied later goes through: what is
        # refused later is the policy's doing, not the lab's.
        a = addr["a"]
        assert await lab.ping(pods["c"], a) and await lab.ping(pods["d"], a)
        assert await connects(lab.nodes[1].ns, a, 81, 3.0) and await connects(pods["b"].ns, a, 81, 3.0)
        assert await connects(pods["out"].ns, e.node_address(1), NODE_PORT, 3.0)
        await converged(lab, await res.apply(POLICIES))
        yield e
    finally:
        for s in listeners:
            s.close()
        await lab.down(keep_files=True)


def env_fixture(family: int, backends: list[str]) -> Any:
    """The module-scoped fixture ``env``: ``related_lab`` over ``family``, one per backend of
    ``backends`` (a test file binds it as ``env = env_fixture(...)``)."""

    @pytest_asyncio.fixture(scope="module", loop_scope="module", params=backends)
    async def env(request: Any, tmp_path_factory: Any) -> AsyncIterator[Env]:
        async with related_lab(request.param, family, tmp_path_factory.mktemp("labs")) as e:
            yield e

    return env


# ------------------------------------------------------------------ related ICMP / ICMPv6


async def check_port_unreachable_for_own_datagram(env: Env) -> None:
    # x/a is isolated for ingress and no rule allows UDP or ICMP into it: the answers below
    # come in only as RELATED to the datagram it sent.
    targets = {"a pod on another node": env.addr["b"], "a pod on its own node": env.addr["c"],
               "another node": env.node_address(1)}  # fmt: skip
    a = env.pods["a"]
    got = {what: await asyncio.to_thread(udp_refused, a.ns, address, 3.0) for what, address in targets.items()}
    assert got == dict.fromkeys(targets, "refused"), got


async def check_unrelated_echo_dropped(env: Env) -> None:
    a = env.addr["a"]
    # The same pods pinged x/a before the policy (the fixture); x/a still pings out (its
    # echo replies are related, in fact established).
    assert not await env.lab.ping(env.pods["c"], a), "an echo from an unlisted pod of the same node"
    assert not await env.lab.ping(env.pods["d"], a), "an echo from an unlisted pod of another node"
    assert await env.lab.ping(env.pods["a"], env.addr["d"])


async def check_path_mtu_error_for_accepted_connection(env: Env, small_mtu: int) -> None:
    """x/b (allowed) connects to x/a's port 8080 and x/a sends it 512 KB.  node2 routes to x/b
    through a route of MTU ``small_mtu``: its stack answers x/a's full-size segments with an
    ICMP error, which must reach x/a (RELATED to the accepted connection) for the transfer to
    go on, and teaches x/a's socket that path MTU."""
    a, node2 = env.pods["a"], env.lab.nodes[1]
    server = await asyncio.to_thread(listen_in, a.ns, env.family, 8080)
    client = await asyncio.to_thread(socket_in, env.pods["b"].ns, env.family)
    await converged(env.lab, await (await env.lab.resources()).apply(
        np("a-in-8080", "x", {"podSelector": {"matchLabels": {"pod": "a"}},
                              "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}], "ports": [{"port": 8080}]}]})))  # fmt: skip
    await asyncio.to_thread(route_mtu, node2, env.addr["b"], small_mtu)
    try:
        client.settimeout(3.0)
        await asyncio.to_thread(client.connect, (env.addr["a"], 8080))
        size = 512 * 1024
        got, mtu = await asyncio.to_thread(transfer, server, client, size, 10.0)
        assert (got, mtu) == (size, small_mtu), f"received {got} of {size} bytes; x/a's path MTU to x/b {mtu}"
    finally:
        client.close()
        server.close()
        await asyncio.to_thread(route_mtu, node2, env.addr["b"], None)
        await (await env.lab.resources()).delete("NetworkPolicy", "x", "a-in-8080")


# ------------------------------------------------------------------ a pod and its own node


async def check_own_node_reaches_pod_where_nothing_else_does(env: Env) -> None:
    a, node1, node2 = env.addr["a"], env.lab.nodes[0], env.lab.nodes[1]
    # Port 81: no rule allows it to anybody.  x/a's node reaches it (kubelet's probes), from
    # the address it picks (the bridge's) and from its underlay address.
    assert await connects(node1.ns, a, 81, 3.0), "x/a's own node, from the bridge's address"
    assert await connects(node1.ns, a, 81, 3.0, bind=env.node_address(0)), "x/a's own node, from its underlay address"
    # Nobody else does: another node, the allowed peer (on port 81), an unlisted pod of the same node.
    assert not await connects(node2.ns, a, 81), "another node"
    assert not await connects(node2.ns, a, 80), "another node, on the allowed port"
    assert not await connects(env.pods["b"].ns, a, 81), "the allowed peer, on another port"
    assert not await connects(env.pods["c"].ns, a, 81), "an unlisted pod of x/a's node"
    # The allowed peer on the allowed port: the policy is in force, not just closed.
    assert await connects(env.pods["b"].ns, a, 80, 3.0)


async def check_egress_isolated_pod_reaches_own_node_and_no_other(env: Env) -> None:
    out = env.pods["out"]
    gateway = json.loads(out.ns.exec(*env.ip("-j", "route", "get", env.node_address(1))))[0]["gateway"]
    assert await connects(out.ns, gateway, NODE_PORT, 3.0), "its own node, at the bridge's address"
    assert await connects(out.ns, env.node_address(0), NODE_PORT, 3.0), "its own node, at its underlay address"
    assert not await connects(out.ns, env.node_address(1), NODE_PORT), "another node"
    assert not await connects(out.ns, env.addr["a"], 81), "a pod the policy does not list"
