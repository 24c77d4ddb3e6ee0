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

The lab (one per backend) and the checks are tests/policy_related_lab.py's, shared with the
same over IPv6 (ICMPv6, neighbour discovery): tests/system/test_policy_related_node6.py.
"""

from __future__ import annotations

import policy_related_lab as related
import pytest

pytestmark = pytest.mark.asyncio(loop_scope="module")

BACKENDS = ["host-gw", "vxlan", "udp", "ipip"]
SMALL_MTU = 1000  # node2's route to x/b: below every backend's pod MTU


env = related.env_fixture(4, BACKENDS)


# ------------------------------------------------------------------ related ICMP


async def test_an_isolated_pod_gets_the_port_unreachable_for_its_own_datagram(env: related.Env):
    await related.check_port_unreachable_for_own_datagram(env)


async def test_an_unrelated_echo_to_an_isolated_pod_is_dropped(env: related.Env):
    await related.check_unrelated_echo_dropped(env)


async def test_an_isolated_pod_gets_fragmentation_needed_for_a_connection_it_accepted(env: related.Env):
    """x/b (allowed) connects to x/a's port 8080 and x/a sends it 512 KB.  node2 routes to x/b
    through a route of MTU 1000: its stack answers x/a's full-size segments with ICMP
    fragmentation needed, which must reach x/a (RELATED to the accepted connection) for
    the transfer to go on at the smaller size."""
    await related.check_path_mtu_error_for_accepted_connection(env, SMALL_MTU)


# ------------------------------------------------------------------ a pod and its own node


async def test_a_pods_own_node_reaches_it_where_nothing_else_does(env: related.Env):
    await related.check_own_node_reaches_pod_where_nothing_else_does(env)


async def test_an_egress_isolated_pod_reaches_its_own_node_and_no_other(env: related.Env):
    await related.check_egress_isolated_pod_reaches_own_node_and_no_other(env)
