"""A Service whose chosen endpoint is a pod on the client's own node, with flow records off.

Without br_netfilter handing bridged frames to the IP hooks (bridge-nf-call-iptables = 0, as on
a host without the module), the endpoint's reply goes to the client over the bridge, at layer 2,
and must still be translated back (source the VIP, not the endpoint) -- so while Services
translate, every local pod's traffic goes up through the node's IP stack, as it does with flow
records on.  (kube-proxy on a bridge needs br_netfilter for this; agentd does not.)  Isolated
by a policy allowing nothing, the endpoint still reaches itself through its Service (routed
here: the inet chains' hairpin acceptance; test_services.py has the bridged one).

With it (= 1, as on kubelet and Docker hosts), conntrack translates on the bridge (kube-proxy's
way): no pod is routed up for Services, the traffic stays bridged (the TTL each side sees is
not decremented), and a change of the sysctl at run time is followed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest
from netpol_lab import converged as policy_converged

from agentd.lab.lab import Lab, LabSpec
from agentd.lab.netns import unique_tag
from agentd.lab.svcecho import Echo
from agentd.lab.wait import auntil

pytestmark = pytest.mark.asyncio(loop_scope="function")


# What a pod's interface received: each incoming IPv4 TCP packet's source address, source and
# destination port and TTL (an AF_PACKET socket, opened before anything is sent).  ``client
# IP PORT N``: N connections to IP:PORT, each asked once (the svcecho servers answer a line
# with their name); ``listen PORT SECONDS``: what came in to PORT, for SECONDS (or until a
# line on stdin).  Prints one JSON line: {"names": [...], "seen": [[src, sport, dport, ttl], ...]}.
PROBE = r"""
import json, select, socket, struct, sys, time
ETH_P_IP, PACKET_OUTGOING = 0x0800, 4
cap = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_IP))
cap.setblocking(False)
seen = []

def drain():
    while True:
        try:
            data, addr = cap.recvfrom(65535)
        except BlockingIOError:
            return
        if addr[2] == PACKET_OUTGOING or data[9] != 6:
            continue
        ihl = (data[0] & 0x0F) * 4
        sport, dport = struct.unpack_from("!HH", data, ihl)
        seen.append([socket.inet_ntoa(data[12:16]), sport, dport, data[8]])

names = []
if sys.argv[1] == "client":
    ip, port, count = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    for _ in range(count):
        try:
            with socket.create_connection((ip, port), timeout=3) as s:
                s.sendall(b"who\n")
                names.append(s.makefile().readline().strip() or None)
        except OSError as err:
            names.append(str(err))
        drain()
    time.sleep(0.2)
else:
    print("ready", flush=True)
    deadline = time.time() + float(sys.argv[3])
    while time.time() < deadline and not select.select([sys.stdin], [], [], 0.05)[0]:
        drain()
    seen = [s for s in seen if s[2] == int(sys.argv[2])]
drain()
print(json.dumps({"names": names, "seen": seen}), flush=True)
"""


def bridge_set(node, name: str) -> set[str]:
    out = json.loads(node.ns.exec("nft", "-j", "list", "set", "bridge", "agentd-policy", name))
    return {e for item in out["nftables"] if "set" in item for e in item["set"].get("elem", [])}


async def probe_through(client, endpoint, vip: str, port: int, target: int, count: int = 3) -> tuple[dict, dict]:
    """``count`` connections from ``client`` to ``vip``:``port`` while ``endpoint`` listens to
    what comes in to ``target``: what each side's interface received."""
    listener = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", endpoint.ns.name, sys.executable, "-c", PROBE, "listen", str(target), "30",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    try:
        assert listener.stdout is not None and listener.stdin is not None
        assert (await asyncio.wait_for(listener.stdout.readline(), 10)).strip() == b"ready"
        _, out, _ = await client.ns.aexec(sys.executable, "-c", PROBE, "client", vip, str(port), str(count), timeout=30)
        listener.stdin.write(b"done\n")
        await listener.stdin.drain()
        heard = json.loads(await asyncio.wait_for(listener.stdout.readline(), 10))
        return json.loads(out), heard
    finally:
        if listener.returncode is None:
            listener.kill()
        await listener.wait()


async def web_and_client(lab, node, res, ns: str, target: int, port: int, echo: list) -> tuple:
    """Pods ``ns``/web (echoing on ``target``) and ``ns``/client on ``node``, their echo servers
    (kept in ``echo`` for the test to close), and Service ``ns``/web on ``port`` applied through
    ``res`` (the test's resources) on the node: (web, client, web's echo, client's echo)."""
    web = await lab.add_pod(node, ns, "web", labels={"app": "web"},
                            ports=[{"name": "http", "containerPort": target, "protocol": "TCP"}])
    client = await lab.add_pod(node, ns, "client", labels={"app": "client"})
    echo.append(w := await Echo.start(web, "web", [("tcp", target)]))
    echo.append(c := await Echo.start(client, "client"))
    rev = await res.apply([{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": ns},
                            "spec": {"selector": {"app": "web"}, "ports": [{"port": port, "targetPort": "http"}]}}])

    def applied() -> bool:
        v = node.api_or_none("/services?view=summary") or {}
        return v.get("revision", 0) >= rev and not v.get("error")

    await auntil(applied, 20, in_thread=True, what=f"the Service applied on {node.name}")
    return web, client, w, c


async def isolated_by_nothing(lab, res, ns: str, name: str, w, c, vip: str, port: int) -> None:
    """``ns``/web isolated both ways by NetworkPolicy ``name`` allowing nothing: web (echo
    ``w``) still reaches itself through its Service at ``vip``:``port``, the client (``c``)
    does not."""
    rev = await res.apply([{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                            "metadata": {"name": name, "namespace": ns},
                            "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress", "Egress"]}}])
    await policy_converged(lab, rev)
    assert (await w.tcp(vip, port, count=3, timeout=2.0)) == {"names": {"web": 3}, "failed": 0}
    assert (await c.tcp(vip, port, count=1, timeout=1.0)) == {"names": {}, "failed": 1}


async def close_all(echo: list, res, lab) -> None:
    """A test's echo servers, its resources (None: not opened) and its lab, in that order."""
    for e in echo:
        await e.close()
    if res is not None:
        await res.close()
    await lab.down()


async def test_a_same_node_endpoint_answers_through_its_service_without_br_netfilter(tmp_path):
    spec = LabSpec(name="sb" + unique_tag("")[:6], nodes=1, pods=0,
                   extra={"node1": {"flows": {"enabled": False}}})
    lab = Lab(spec, root=tmp_path / "labs")
    echo: list[Echo] = []
    res = None
    try:
        await lab.up(timeout=90)
        node = lab.nodes[0]
        await lab.ready.agents_ready(60)  # one node: no peer or route for lab.up to wait for
        # Off where br_netfilter is loaded (its sysctls are the namespace's); without it, off already.
        keys = node.ns.exec("ls", "/proc/sys/net/bridge", check=False).split()
        for key in ("bridge-nf-call-iptables", "bridge-nf-call-ip6tables"):
            if key in keys:
                node.ns.sysctl(f"net.bridge.{key}", 0)
        res = await lab.resources()
        web, _, w, c = await web_and_client(lab, node, res, "svc", 8080, 80, echo)
        # The agent reads the sysctls at its start (on in a new namespace) and every 10 s.
        await auntil(lambda: len(routed := bridge_set(node, "isolated-ports")) == 2 and routed == bridge_set(node, "pod-ports"),
                     30, what="every pod of node1 routed up for Services")
        vip = (await res.get("Service", "svc", "web"))["spec"]["clusterIP"]
        assert (await c.tcp(web.ip, 8080, count=3)) == {"names": {"web": 3}, "failed": 0}  # the pod itself: bridged
        start = time.monotonic()
        got = await c.tcp(vip, 80, count=10)
        assert got == {"names": {"web": 10}, "failed": 0}, (got, time.monotonic() - start)
        # Isolated by a policy allowing nothing, web still reaches itself through its Service
        # (here routed, not bridged: the inet chains' hairpin acceptance), the client does not.
        await isolated_by_nothing(lab, res, "svc", "nothing", w, c, vip, 80)
    finally:
        await close_all(echo, res, lab)


async def test_a_same_node_endpoint_answers_through_its_service_bridged_with_br_netfilter(tmp_path):
    """With bridge-nf-call-iptables = 1 in the node's namespace (br_netfilter's sysctls are per
    namespace; as on kubelet and Docker hosts), conntrack translates Service traffic on the
    bridge, so no pod of the node is routed up for Services: a same-node client reaches a
    same-node endpoint through the cluster IP over the bridge -- neither the SYN the endpoint
    gets nor the replies the client gets (from the VIP, never from the endpoint's own address)
    have lost a hop of TTL -- and the bridge table's route-up set is empty.  The sysctl turned
    off and on again at run time is followed (the agent reads it every 10 s): routed up while
    off (TTL - 1 both ways), bridged again once on.  The endpoint reaches itself through its
    Service (hairpin), also isolated by a policy allowing nothing; isolated by a policy
    admitting the client (and the client by one letting it out to the endpoint), the client
    still reaches it through the Service: br_netfilter bridges the translated SYN to the
    endpoint's port, and the inet chains, not the bridge table's isolation drops, judge it."""
    spec = LabSpec(name="sn" + unique_tag("")[:6], nodes=1, pods=0,
                   extra={"node1": {"flows": {"enabled": False}}})
    lab = Lab(spec, root=tmp_path / "labs")
    call = "bridge-nf-call-iptables"
    echo: list[Echo] = []
    res = None
    try:
        await lab.up(timeout=90)
        node = lab.nodes[0]
        await lab.ready.agents_ready(60)  # one node: no peer or route for lab.up to wait for
        if call not in node.ns.exec("ls", "/proc/sys/net/bridge", check=False).split():
            pytest.fail("br_netfilter is not loaded (scripts/dev setup loads it: modprobe br_netfilter)")
        node.ns.sysctl(f"net.bridge.{call}", 0)
        res = await lab.resources()
        web, client, w, c = await web_and_client(lab, node, res, "svcbr", 8181, 8180, echo)
        vip = (await res.get("Service", "svcbr", "web"))["spec"]["clusterIP"]
        ports = bridge_set(node, "pod-ports")
        assert len(ports) == 2

        async def through(value: int) -> None:
            node.ns.sysctl(f"net.bridge.{call}", value)
            routed = ports if value == 0 else set()
            await auntil(lambda: bridge_set(node, "isolated-ports") == routed, 30,
                         what=f"pods {'routed up' if value == 0 else 'bridged'} with {call} = {value}")
            got, heard = await probe_through(client, web, vip, 8180, 8181)
            ttl = 63 if value == 0 else 64  # (pods send with 64)
            assert got["names"] == ["web"] * 3, got
            replies = [s for s in got["seen"] if s[1] in (8180, 8181)]
            assert replies and {(s[0], s[1]) for s in replies} == {(vip, 8180)}, got  # un-DNATed
            assert {s[3] for s in replies} == {ttl}, (value, got)
            syns = [s for s in heard["seen"] if s[0] == client.ip]
            assert syns and {s[3] for s in syns} == {ttl}, (value, heard)

        await through(0)  # routed up for Services: TTL - 1
        await through(1)  # bridged: conntrack translates on the bridge
        await through(0)  # the sysctl turned off at run time: routed up again
        await through(1)
        assert (await w.tcp(vip, 8180, count=3)) == {"names": {"web": 3}, "failed": 0}  # hairpin
        # web isolated (ingress from the client only), the client too (egress to web only):
        # the client's translated SYN, bridged by br_netfilter to web's port, is judged by the
        # policies in the inet forward chains and let through, not dropped by the bridge table.
        rev = await res.apply([{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                                "metadata": {"name": "web", "namespace": "svcbr"},
                                "spec": {"podSelector": {"matchLabels": {"app": "web"}},
                                         "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}]}]}},
                               {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                                "metadata": {"name": "client", "namespace": "svcbr"},
                                "spec": {"podSelector": {"matchLabels": {"app": "client"}}, "policyTypes": ["Egress"],
                                         "egress": [{"to": [{"podSelector": {"matchLabels": {"app": "web"}}}]}]}}])
        await policy_converged(lab, rev)
        assert bridge_set(node, "isolated-ports") == ports  # both isolated: routed up for policy
        assert (await c.tcp(vip, 8180, count=3, timeout=2.0)) == {"names": {"web": 3}, "failed": 0}
        assert (await w.tcp(vip, 8180, count=3, timeout=2.0)) == {"names": {"web": 3}, "failed": 0}
        # Isolated by a policy allowing nothing, web still reaches itself (the bridge table's
        # hairpin acceptance), the client does not.
        await isolated_by_nothing(lab, res, "svcbr", "web", w, c, vip, 8180)
    finally:
        await close_all(echo, res, lab)
