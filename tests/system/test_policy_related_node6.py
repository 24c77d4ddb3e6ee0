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

The lab (one per backend, laid out as the IPv4 test's) and the checks but neighbour discovery's
are tests/policy_related_lab.py's, run here over IPv6.
"""

from __future__ import annotations

import json
from typing import Any

import policy_related_lab as related
import pytest

pytestmark = pytest.mark.asyncio(loop_scope="module")

BACKENDS = ["host-gw", "vxlan", "udp"]
SMALL_MTU = 1280  # node2's route to x/b: IPv6's minimum, below every backend's pod MTU


env = related.env_fixture(6, BACKENDS)


# ------------------------------------------------------------------ related ICMPv6


async def test_an_isolated_pod_gets_the_port_unreachable_for_its_own_datagram(env: related.Env):
    await related.check_port_unreachable_for_own_datagram(env)


async def test_an_unrelated_echo_to_an_isolated_pod_is_dropped(env: related.Env):
    await related.check_unrelated_echo_dropped(env)


def _neighbours(ns: Any) -> dict[str, dict[str, Any]]:
    return {n["dst"]: n for n in json.loads(ns.exec("ip", "-6", "-j", "neigh", "show"))}


async def test_neighbour_discovery_to_and_from_an_isolated_pod_keeps_working(env: related.Env):
    """Caches flushed in x/a, x/c and node1's bridge: x/a resolves x/c (a pod of its node: its
    solicitation out, the unicast advertisement in) and its gateway, node1 resolves x/a, and
    the traffic that needs them goes through -- and what the policy drops is still dropped."""
    a, c, node1 = env.pods["a"], env.pods["c"], env.lab.nodes[0]
    gateway = json.loads(a.ns.exec("ip", "-6", "-j", "route", "get", env.addr["b"]))[0]["gateway"]
    for ns in (a.ns, c.ns):
        ns.exec("ip", "-6", "neigh", "flush", "dev", "eth0")
    node1.ns.exec("ip", "-6", "neigh", "flush", "dev", "cni0")  # its pods' entries only (not the underlay's)
    assert env.addr["c"] not in _neighbours(a.ns) and env.addr["a"] not in _neighbours(node1.ns)
    assert await env.lab.ping(a, env.addr["c"]), "x/a to a pod of its node, its caches empty"
    assert await related.connects(env.pods["b"].ns, env.addr["a"], 80, 3.0), "the allowed peer, x/a's and node1's caches empty"
    known = _neighbours(a.ns)
    c_mac = json.loads(c.ns.exec("ip", "-j", "link", "show", "dev", "eth0"))[0]["address"]
    assert known.get(env.addr["c"], {}).get("lladdr") == c_mac, known
    assert known.get(gateway, {}).get("lladdr"), known
    assert _neighbours(node1.ns).get(env.addr["a"], {}).get("lladdr"), "node1 resolved x/a"
    assert not await env.lab.ping(c, env.addr["a"]), "an echo from an unlisted pod: still dropped"


async def test_an_isolated_pod_gets_packet_too_big_for_a_connection_it_accepted(env: related.Env):
    """x/b (allowed) connects to x/a's port 8080 over IPv6 and x/a sends it 512 KB.  node2
    routes to x/b through a route of MTU 1280: its stack answers x/a's full-size segments with
    ICMPv6 packet too big (no router fragments IPv6), which must reach x/a (RELATED to the
    accepted connection) for the transfer to go on at all."""
    await related.check_path_mtu_error_for_accepted_connection(env, SMALL_MTU)


# ------------------------------------------------------------------ a pod and its own node


async def test_a_pods_own_node_reaches_it_where_nothing_else_does(env: related.Env):
    await related.check_own_node_reaches_pod_where_nothing_else_does(env)


async def test_an_egress_isolated_pod_reaches_its_own_node_and_no_other(env: related.Env):
    await related.check_egress_isolated_pod_reaches_own_node_and_no_other(env)
