"""Peer sets (mesh, route reflectors) and per-peer forwarding plans are pure functions."""

from ipaddress import IPv4Address, IPv4Interface, IPv4Network, IPv6Address, IPv6Interface, IPv6Network

import pytest

from agentd.datastore.store import NodeRecord
from agentd.kernel.forwarding import (
    LocalPaths,
    desired_routes,
    peer_in_userspace,
    plan_external,
    plan_peer,
    route_for,
)
from agentd.daemon.mesh import desired_peers
from agentd.kernel.netinfo import Underlay
from bgp import PeerSettings


def node(name, addr, rr=False, backend=None, subnet=None):
    return NodeRecord(name, IPv4Address(addr), 64512, IPv4Network(subnet) if subnet else None, rr, None, backend or {})


NODES = {
    "n1": node("n1", "10.0.0.1", rr=True),
    "n2": node("n2", "10.0.0.2", rr=True),
    "n3": node("n3", "10.0.0.3"),
    "n4": node("n4", "10.0.0.4"),
}


def test_mesh_peers_with_every_other_node():
    peers = desired_peers("n3", NODES, mode="mesh", i_am_reflector=False)
    assert sorted(p.key for p in peers) == ["10.0.0.1", "10.0.0.2", "10.0.0.4"]
    assert all(not p.rr_client and p.description == "node-to-node mesh" for p in peers)


def test_reflector_peers_with_reflectors_and_clients():
    peers = {p.key: p for p in desired_peers("n1", NODES, mode="route-reflector", i_am_reflector=True)}
    assert set(peers) == {"10.0.0.2", "10.0.0.3", "10.0.0.4"}
    assert not peers["10.0.0.2"].rr_client and peers["10.0.0.2"].description == "route reflector"
    assert peers["10.0.0.3"].rr_client and peers["10.0.0.4"].rr_client


def test_client_peers_only_with_reflectors():
    peers = desired_peers("n4", NODES, mode="route-reflector", i_am_reflector=False)
    assert sorted(p.key for p in peers) == ["10.0.0.1", "10.0.0.2"]


def test_external_peers_are_added_but_nodes_win():
    ext = [PeerSettings("192.0.2.1", 65100, description="external"), PeerSettings("10.0.0.2", 1)]
    peers = {p.key: p for p in desired_peers("n3", NODES, mode="mesh", i_am_reflector=False, external=ext)}
    assert peers["192.0.2.1"].asn == 65100
    assert peers["10.0.0.2"].asn == 64512


UNDERLAY = Underlay("eth0", 2, IPv4Interface("10.0.0.3/24"), 1500, (IPv4Network("10.0.0.0/24"),))


def test_host_gw_peer_on_link_is_routed_directly():
    plan = plan_peer(node("n1", "10.0.0.1", backend={"type": "host-gw"}), UNDERLAY, own_backend="host-gw", encap="always")
    assert plan.backend == "host-gw"
    r = route_for("10.244.1.0/24", plan, UNDERLAY, LocalPaths())
    assert (r.gateway, r.dev, r.onlink) == ("10.0.0.1", "eth0", False)
    assert LocalPaths().label(plan) == "kernel route"


def test_host_gw_peer_off_link_has_no_route_and_says_why():
    plan = plan_peer(node("far", "10.9.0.1", backend={"type": "host-gw"}), UNDERLAY, own_backend="host-gw", encap="always")
    assert not plan.routable and "not on this node's L2 segment" in plan.reason


def test_the_peers_backend_decides_and_cross_subnet_goes_direct_on_link():
    vx = {"type": "vxlan", "vtep_ip": "10.244.9.0", "vtep_mac": "aa:bb:cc:dd:ee:ff"}
    on, off = node("on", "10.0.0.1", backend=vx), node("off", "10.9.0.1", backend=vx)
    assert plan_peer(on, UNDERLAY, own_backend="udp", encap="always").backend == "vxlan"
    assert plan_peer(on, UNDERLAY, own_backend="udp", encap="cross-subnet").backend == "host-gw"
    plan = plan_peer(off, UNDERLAY, own_backend="udp", encap="cross-subnet")
    assert plan.backend == "vxlan"
    paths = LocalPaths({"vxlan": "vxlan-device"})
    r = route_for("10.244.9.0/24", plan, UNDERLAY, paths)
    assert (r.gateway, r.dev, r.onlink) == ("10.244.9.0", "agentd.vxlan", True)
    assert paths.label(plan) == "vxlan device"


def test_a_backend_this_node_cannot_run_is_reported():
    plan = plan_peer(
        node("x", "10.0.0.1", backend={"type": "ipip"}),
        UNDERLAY,
        own_backend="vxlan",
        encap="always",
        available=lambda b: "no ipip" if b == "ipip" else None,
    )
    assert not plan.routable and "no ipip" in plan.reason


@pytest.mark.parametrize("backend, overhead", [("ipip", 20), ("udp", 28)])
def test_the_route_form_depends_on_the_data_path(backend, overhead):
    plan = plan_peer(node("x", "10.0.0.1", backend={"type": backend, "datapath": "bpf"}), UNDERLAY,
                     own_backend=backend, encap="always")
    bpf = route_for("10.244.1.0/24", plan, UNDERLAY, LocalPaths({backend: "bpf"}))
    user = route_for("10.244.1.0/24", plan, UNDERLAY, LocalPaths({backend: "userspace"}))
    # BPF: out of the underlay device to the peer, room left for the outer headers.
    assert (bpf.gateway, bpf.dev, bpf.mtu, bpf.onlink) == ("10.0.0.1", "eth0", 1500 - overhead, False)
    assert (user.gateway, user.dev) == (None, f"agentd.{backend}")
    assert LocalPaths({backend: "bpf"}).label(plan) == "bpf"
    assert LocalPaths({backend: "userspace"}).label(plan) == "user space"
    # Not carried here (yet): no route.
    assert route_for("10.244.1.0/24", plan, UNDERLAY, LocalPaths()) is None


def test_bpf_routes_to_a_peer_behind_a_router_go_via_the_underlay_next_hop():
    plan = plan_peer(node("far", "10.9.0.1", backend={"type": "udp", "datapath": "bpf"}), UNDERLAY, own_backend="udp",
                     encap="always")
    assert route_for("10.244.1.0/24", plan, UNDERLAY, LocalPaths({"udp": "bpf"})) is None  # next hop unknown
    r = route_for("10.244.1.0/24", plan, UNDERLAY, LocalPaths({"udp": "bpf"}, {"10.9.0.1": "10.0.0.254"}))
    assert (r.gateway, r.dev, r.mtu) == ("10.0.0.254", "eth0", 1472)


@pytest.mark.parametrize("data", [{"datapath": "userspace"}, {}])  # {}: an agent from before the BPF data path
def test_a_bpf_node_speaks_to_a_user_space_peer_through_its_own_worker(data):
    assert peer_in_userspace(plan_peer(node("x", "10.0.0.1", backend={"type": "udp", **data}), UNDERLAY,
                                       own_backend="udp", encap="always"))
    plan = plan_peer(node("x", "10.0.0.1", backend={"type": "udp", **data}), UNDERLAY, own_backend="udp",
                     encap="always")
    # No worker up yet for such peers: no route rather than one the peer cannot read.
    assert route_for("10.244.1.0/24", plan, UNDERLAY, LocalPaths({"udp": "bpf"})) is None
    paths = LocalPaths({"udp": "bpf"}, helpers=frozenset({"udp"}))
    r = route_for("10.244.1.0/24", plan, UNDERLAY, paths)
    assert (r.gateway, r.dev) == (None, "agentd.udp") and paths.label(plan) == "user space"


def test_a_backend_this_agent_does_not_know_is_not_routed():
    plan = plan_peer(node("x", "10.0.0.1", backend={"type": "geneve"}), UNDERLAY, own_backend="udp", encap="always")
    assert not plan.routable and "'geneve'" in plan.reason


def test_external_next_hops():
    assert plan_external("10.0.0.254", UNDERLAY).backend == "host-gw"
    assert plan_external("192.0.2.1", UNDERLAY).backend == "kernel"
    assert not plan_external("::ffff:10.0.0.9", UNDERLAY).routable


def test_an_external_link_local_next_hop_is_routed_through_the_underlay():
    # An external IPv6 peer (BGP unnumbered, or a router giving its link-local next hop):
    # fe80::/10 is not in the underlay's prefixes, but on-link there; Linux refuses a
    # link-local gateway without a device.
    plan = plan_external("fe80::2", UNDERLAY)
    assert (plan.backend, plan.version) == ("host-gw", 6)
    r = route_for("2001:db8:99::/48", plan, UNDERLAY, LocalPaths())
    assert (r.gateway, r.dev) == ("fe80::2", "eth0")
    underlay = Underlay("eth0", 2, IPv4Interface("10.0.0.1/24"), 1500,
                        (IPv4Network("10.0.0.0/24"), IPv6Network("2001:db8::/64")),
                        interface_v6=IPv6Interface("2001:db8::1/64"), link_local=IPv6Address("fe80::1"))
    plan = desired_routes([("2001:db8:99::/48", IPv6Address("fe80::2"), False)], [], underlay, LocalPaths(),
                          own_subnets=["10.244.0.0/24"], blackhole_metric=4000, own_backend="vxlan",
                          encap="always", versions=(4, 6))
    assert [(r.dst, r.gateway, r.dev) for r in plan.routes if r.kind == "unicast"] == [
        ("2001:db8:99::/48", "fe80::2", "eth0")]
    assert plan_external("2001:db8:ff::1", underlay).backend == "kernel"  # off-link: resolved by the kernel


def test_a_link_local_next_hop_learned_over_ibgp_is_refused():
    # RFC 2545 §3: fe80::2 is on-link at the node whose external peer sent it, not here; a
    # node passing it on unchanged (an agent without next-hop-self for it) must not make this
    # node route into its own segment.  From our own external peer (not iBGP) it is installed.
    bests = [("2001:db8:99::/48", IPv6Address("fe80::2"), False, True),
             ("2001:db8:98::/48", IPv6Address("fe80::3"), False, False),
             ("2001:db8:97::/48", IPv6Address("2001:db8::9"), False, True)]
    plan = desired_routes(bests, [], UNDERLAY, LocalPaths(), own_subnets=["10.244.0.0/24"], blackhole_metric=4000,
                          own_backend="vxlan", encap="always", versions=(4, 6))
    assert [(r.dst, r.gateway) for r in plan.routes if r.kind == "unicast"] == [
        ("2001:db8:98::/48", "fe80::3"), ("2001:db8:97::/48", "2001:db8::9")]
    assert [(r["dst"], r["peer"], r["backend"], r["reason"]) for r in plan.refused] == [
        ("2001:db8:99::/48", "fe80::2", "refused",
         "link-local next hop fe80::2 learned over iBGP: it is on-link only at the node its external peer sent it to")]


def test_desired_routes_for_best_paths():
    """Best paths -> the kernel routes: the own subnet's blackhole first, one route per learned
    prefix through its peer's plan, nothing for our own prefix or an unroutable peer, and an
    unknown next hop on the underlay treated as an external router."""
    from agentd.kernel.forwarding import desired_routes

    peers = [node("n2", "10.0.0.4"), node("n3", "192.0.2.9")]  # n3: host-gw but off this segment
    bests = [
        ("10.244.1.0/24", None, True),  # ours
        ("10.244.2.0/24", IPv4Address("10.0.0.4"), False),
        ("10.244.3.0/24", IPv4Address("192.0.2.9"), False),
        ("198.51.100.0/24", IPv4Address("10.0.0.1"), False),  # an external router on the segment
    ]
    plan = desired_routes(bests, peers, UNDERLAY, LocalPaths(), own_subnets=["10.244.1.0/24"], blackhole_metric=4000,
                          own_backend="host-gw", encap="always")  # fmt: skip
    assert [(r.dst, r.kind, r.gateway) for r in plan.routes] == [
        ("10.244.1.0/24", "blackhole", None),
        ("10.244.2.0/24", "unicast", "10.0.0.4"),
        ("198.51.100.0/24", "unicast", "10.0.0.1"),
    ]
    assert plan.routes[0].metric == 4000
    assert plan.next_hops == {"10.0.0.4": ["10.244.2.0/24"], "10.0.0.1": ["198.51.100.0/24"]}
    assert set(plan.plans) == {"10.0.0.4", "192.0.2.9", "10.0.0.1"} and not plan.plans["192.0.2.9"].routable
    assert [r["dst"] for r in plan.rows] == ["10.244.1.0/24", "10.244.2.0/24", "198.51.100.0/24"]
    assert plan.pending == []  # the off-segment host-gw peer cannot be routed at all: not pending


def test_a_best_path_whose_data_path_is_not_up_yet_is_pending():
    # The peer needs VXLAN, which this node has not brought up yet (a restart, the backend
    # being ensured): no route, and its destination listed as pending (the agent keeps a
    # previous run's route for it meanwhile); once the device is up, the route.
    peer = node("n2", "10.0.0.4", backend={"type": "vxlan", "vtep_mac": "aa:bb:cc:dd:ee:02", "vtep_ip": "10.244.2.0"},
                subnet="10.244.2.0/24")
    bests = [("10.244.2.0/24", IPv4Address("10.0.0.4"), False)]
    kwargs = {"own_subnets": ["10.244.1.0/24"], "blackhole_metric": 4000, "own_backend": "udp", "encap": "always"}
    plan = desired_routes(bests, [peer], UNDERLAY, LocalPaths({"udp": "bpf"}), **kwargs)
    assert [r.dst for r in plan.routes] == ["10.244.1.0/24"] and plan.pending == ["10.244.2.0/24"]
    plan = desired_routes(bests, [peer], UNDERLAY, LocalPaths({"udp": "bpf", "vxlan": "vxlan-device"}), **kwargs)
    assert [r.dst for r in plan.routes] == ["10.244.1.0/24", "10.244.2.0/24"] and plan.pending == []


# -- dual-stack and IPv6-only ---------------------------------------------------------------------

DUAL_UNDERLAY = Underlay("eth0", 2, IPv4Interface("10.0.0.3/24"), 1500,
                         (IPv4Network("10.0.0.0/24"), IPv6Network("2001:db8::/64")),
                         IPv6Interface("2001:db8::3/64"), IPv6Address("fe80::3"))
V4_ONLY_SEGMENT = Underlay("eth0", 2, IPv4Interface("10.0.0.3/24"), 1500, (IPv4Network("10.0.0.0/24"),),
                           None, IPv6Address("fe80::3"))
V6_UNDERLAY = Underlay("eth0", 2, IPv6Interface("2001:db8::3/64"), 1500, (IPv6Network("2001:db8::/64"),),
                       IPv6Interface("2001:db8::3/64"), IPv6Address("fe80::3"))


def dual(name, addr, v6=None, ll=None, backend=None):
    return NodeRecord(name, IPv4Address(addr), 64512, None, False, None, backend or {},
                      address_v6=IPv6Address(v6) if v6 else None, link_local_v6=IPv6Address(ll) if ll else None)


def v6only(name, v6, backend=None):
    return NodeRecord(name, None, 64512, None, False, None, backend or {}, address_v6=IPv6Address(v6))


def test_ipv6_pods_go_direct_via_the_peers_ipv6_address_or_its_link_local_one():
    plan = plan_peer(dual("n1", "10.0.0.1", "2001:db8::1", "fe80::1"), DUAL_UNDERLAY, own_backend="host-gw",
                     encap="always", version=6)
    r = route_for("fd00:10:244:1::/64", plan, DUAL_UNDERLAY, LocalPaths())
    assert (plan.backend, r.gateway, r.dev) == ("host-gw", "2001:db8::1", "eth0")
    # No IPv6 addresses on the segment: Linux has no IPv6 route via an IPv4 gateway, so the
    # peer's link-local address on the shared segment is the next hop.
    plan = plan_peer(dual("n1", "10.0.0.1", None, "fe80::1"), V4_ONLY_SEGMENT, own_backend="host-gw",
                     encap="always", version=6)
    r = route_for("fd00:10:244:1::/64", plan, V4_ONLY_SEGMENT, LocalPaths())
    assert (plan.backend, r.gateway, r.dev) == ("host-gw", "fe80::1", "eth0")
    plan = plan_peer(dual("n1", "10.0.0.1"), V4_ONLY_SEGMENT, own_backend="host-gw", encap="always", version=6)
    assert not plan.routable and "no IPv6 underlay or link-local address" in plan.reason
    far = plan_peer(dual("far", "10.9.0.1", None, "fe80::9"), V4_ONLY_SEGMENT, own_backend="host-gw",
                    encap="always", version=6)
    assert not far.routable and "not on this node's L2 segment" in far.reason


def test_vxlan_carries_ipv6_pods_through_the_one_vtep():
    vx = {"type": "vxlan", "vtep_ip": "10.244.9.0", "vtep_ip_v6": "fd00:10:244:9::", "vtep_mac": "aa:bb:cc:dd:ee:ff"}
    far = dual("far", "10.9.0.1", backend=vx)
    plan = plan_peer(far, V4_ONLY_SEGMENT, own_backend="vxlan", encap="always", version=6)
    r = route_for("fd00:10:244:9::/64", plan, V4_ONLY_SEGMENT, LocalPaths({"vxlan": "vxlan-device"}))
    assert (plan.backend, r.gateway, r.dev, r.onlink) == ("vxlan", "fd00:10:244:9::", "agentd.vxlan", True)


def test_ipip_carries_ipv4_pods_only():
    on = dual("on", "10.0.0.1", None, "fe80::1", backend={"type": "ipip", "datapath": "bpf"})
    off = dual("off", "10.9.0.1", None, "fe80::9", backend={"type": "ipip", "datapath": "bpf"})
    paths = LocalPaths({"ipip": "bpf"})
    plan = plan_peer(on, V4_ONLY_SEGMENT, own_backend="ipip", encap="always", version=6, paths=paths)
    assert plan.backend == "host-gw" and "ipip carries IPv4 pods only: IPv6 pods routed directly" in plan.reason
    assert plan_peer(on, V4_ONLY_SEGMENT, own_backend="ipip", encap="always").backend == "ipip"  # IPv4 as always
    plan = plan_peer(off, V4_ONLY_SEGMENT, own_backend="ipip", encap="always", version=6, paths=paths)
    assert not plan.routable and "its IPv6 pods are unreachable from here (vxlan and udp carry both)" in plan.reason


def test_udp_carries_ipv6_pods_in_either_data_path():
    bpf = dual("far", "10.9.0.1", None, "fe80::9", backend={"type": "udp", "datapath": "bpf"})
    plan = plan_peer(bpf, V4_ONLY_SEGMENT, own_backend="udp", encap="always", version=6,
                     paths=LocalPaths({"udp": "bpf"}))
    assert plan.backend == "udp"
    # Linux routes IPv6 through IPv6 next hops only: via the peer's IPv4-mapped address, onlink.
    r = route_for("fd00:10:244:9::/64", plan, V4_ONLY_SEGMENT, LocalPaths({"udp": "bpf"}))
    assert (r.gateway, r.dev, r.onlink, r.mtu) == ("::ffff:10.9.0.1", "eth0", True, 1500 - 28)
    # This node in user space: into the worker's TUN, whose next-hop table picks the peer.
    plan = plan_peer(bpf, V4_ONLY_SEGMENT, own_backend="udp", encap="always", version=6,
                     paths=LocalPaths({"udp": "userspace"}))
    assert plan.backend == "udp"
    r = route_for("fd00:10:244:9::/64", plan, V4_ONLY_SEGMENT, LocalPaths({"udp": "userspace"}))
    assert (r.dst, r.gateway, r.dev) == ("fd00:10:244:9::/64", None, "agentd.udp")
    # The peer in user space, this node in BPF: spoken to through this node's worker, as for
    # IPv4 (no route until that worker is up).
    user = dual("far", "10.9.0.1", None, "fe80::9", backend={"type": "udp", "datapath": "userspace"})
    plan = plan_peer(user, V4_ONLY_SEGMENT, own_backend="udp", encap="always", version=6,
                     paths=LocalPaths({"udp": "bpf"}))
    assert plan.backend == "udp" and plan.routable
    assert route_for("fd00:10:244:9::/64", plan, V4_ONLY_SEGMENT, LocalPaths({"udp": "bpf"})) is None
    r = route_for("fd00:10:244:9::/64", plan, V4_ONLY_SEGMENT, LocalPaths({"udp": "bpf"}, helpers=frozenset({"udp"})))
    assert (r.gateway, r.dev) == (None, "agentd.udp")


def test_ipv6_only_peers_and_routes():
    vx = {"type": "vxlan", "vtep_ip_v6": "fd00:10:244:9::", "vtep_mac": "aa:bb:cc:dd:ee:ff"}
    nodes = {"n1": v6only("n1", "2001:db8::1", backend=vx), "n3": v6only("n3", "2001:db8::3", backend=vx)}
    peers = desired_peers("n3", nodes, mode="mesh", i_am_reflector=False, session_version=6)
    assert [p.key for p in peers] == ["2001:db8::1"]
    assert desired_peers("n3", nodes, mode="mesh", i_am_reflector=False) == []  # no IPv4 sessions to make
    plan = plan_peer(nodes["n1"], V6_UNDERLAY, own_backend="vxlan", encap="cross-subnet", version=6)
    assert (plan.address, plan.backend, plan.via) == ("2001:db8::1", "host-gw", "2001:db8::1")


def test_node_sessions_are_bound_to_the_published_address(tmp_path):
    """The sessions to other nodes leave from this node's published address of their family
    (the address the others know it by and map its next hops to), not the one the kernel picks
    on a host with several; external peers keep their own local_address (unset: unbound)."""
    from agentd.config.settings import load_config
    from agentd.daemon.mesh import Peering
    from agentd.datastore.store import NodeEvent

    class Host:
        def hostname(self):
            return "b"

        def default_address(self):
            return IPv4Address("192.0.2.11")

        def default_address_v6(self, beside=None):
            return IPv6Address("2001:db8::b")

    toml = tmp_path / "agentd.toml"
    toml.write_text('[[bgp.peers]]\naddress = "2001:db8:ff::1"\nasn = 65000\n')
    vx = {"type": "vxlan", "vtep_ip_v6": "fd00:10:244:1::", "vtep_mac": "0a:00:00:00:00:01"}
    peering = Peering("b")
    peering.apply(NodeEvent("snapshot", nodes={"a": v6only("a", "2001:db8::a", backend=vx),
                                               "b": v6only("b", "2001:db8::b", backend=vx)}))
    cfg = load_config(toml, env={"AGENTD_NETWORK_IP_FAMILY": "ipv6", "AGENTD_NETWORK_BACKEND": "vxlan"}, host=Host(),
                      check_files=False)
    peers = {p.key: p for p in peering.peers(cfg)}
    assert peers["2001:db8::a"].local_address == IPv6Address("2001:db8::b")
    assert peers["2001:db8:ff::1"].local_address is None
    # Dual stack: the IPv4 sessions from the IPv4 address.
    dual_nodes = {"a": dual("a", "192.0.2.10", "2001:db8::a", "fe80::a"), "b": dual("b", "192.0.2.11", "2001:db8::b", "fe80::b")}
    peering.apply(NodeEvent("snapshot", nodes=dual_nodes))
    cfg = load_config(env={"AGENTD_NETWORK_IP_FAMILY": "dual"}, host=Host(), check_files=False)
    assert [(p.key, p.local_address) for p in peering.peers(cfg)] == [("192.0.2.10", IPv4Address("192.0.2.11"))]


def test_desired_routes_of_a_dual_stack_node():
    """Each family's routes through the peer its next hop names: the IPv6 address, or the
    IPv4-mapped one a peer without an IPv6 underlay address gives its IPv6 routes."""
    from agentd.kernel.forwarding import desired_routes

    peers = [dual("n1", "10.0.0.1", "2001:db8::1", "fe80::1"), dual("n2", "10.0.0.2", None, "fe80::2")]
    bests = [
        ("10.244.1.0/24", IPv4Address("10.0.0.1"), False),
        ("fd00:10:244:1::/64", IPv6Address("2001:db8::1"), False),
        ("10.244.2.0/24", IPv4Address("10.0.0.2"), False),
        ("fd00:10:244:2::/64", IPv6Address("::ffff:10.0.0.2"), False),
        ("2001:db8:ff::/48", IPv6Address("2001:db8::fe"), False),  # an external router on the segment
    ]
    plan = desired_routes(bests, peers, DUAL_UNDERLAY, LocalPaths(), own_subnets=["10.244.3.0/24", "fd00:10:244:3::/64"],
                          blackhole_metric=4000, own_backend="host-gw", encap="always", versions=(4, 6))
    assert [(r.dst, r.kind, r.gateway) for r in plan.routes] == [
        ("10.244.3.0/24", "blackhole", None), ("fd00:10:244:3::/64", "blackhole", None),
        ("10.244.1.0/24", "unicast", "10.0.0.1"), ("fd00:10:244:1::/64", "unicast", "2001:db8::1"),
        ("10.244.2.0/24", "unicast", "10.0.0.2"), ("fd00:10:244:2::/64", "unicast", "fe80::2"),
        ("2001:db8:ff::/48", "unicast", "2001:db8::fe"),
    ]
    assert set(plan.plans) == {"10.0.0.1", "10.0.0.2", "2001:db8::fe"} and set(plan.plans_v6) == {"10.0.0.1", "10.0.0.2"}
    assert plan.next_hops["10.0.0.1"] == ["10.244.1.0/24"]  # the IPv4 plans' routes (the tunnels' tables)


@pytest.mark.parametrize("bad", [
    {"vtep_mac": "zz:bb:cc:dd:ee:ff"},
    {"vtep_mac": "aa:bb:cc:dd:ee"},
    {"vtep_mac": 7},
    {"vtep_ip": "bogus"},
    {"vtep_ip": 10},
    {"vtep_ip": "fd00::1"},
    {"vtep_ip_v6": "10.244.9.0"},
    {"vtep_ip_v6": "fd00::1%eth0"},
    # The kernel takes no FDB entry for these (EOPNOTSUPP): the peer's, not every peer's, problem.
    {"vtep_mac": "01:00:5e:00:00:01"},
    {"vtep_mac": "ff:ff:ff:ff:ff:ff"},
    {"vtep_mac": "00:00:00:00:00:00"},
    # Another node's VTEP address (n2's) or one that is not its subnet's network address.
    {"vtep_ip": "10.244.2.0"},
    {"vtep_ip": "10.244.3.1"},
    # Another node's VTEP MAC (n2's): its FDB entry would move to n3's underlay address.
    {"vtep_mac": "aa:bb:cc:dd:ee:02"},
])
def test_a_peers_bad_vxlan_data_makes_that_peer_unroutable_not_the_rest(bad):
    """A peer's record is another node's word: one bad VTEP field gives that peer no route (and
    says why); the best paths through every other peer are still routed."""
    from agentd.kernel.forwarding import desired_routes

    good = {"type": "vxlan", "vtep_ip": "10.244.2.0", "vtep_mac": "aa:bb:cc:dd:ee:02"}
    broken = {"type": "vxlan", "vtep_ip": "10.244.3.0", "vtep_mac": "aa:bb:cc:dd:ee:03", **bad}
    peers = [node("n2", "10.9.0.2", backend=good, subnet="10.244.2.0/24"),
             node("n3", "10.9.0.3", backend=broken, subnet="10.244.3.0/24")]
    bests = [("10.244.2.0/24", IPv4Address("10.9.0.2"), False), ("10.244.3.0/24", IPv4Address("10.9.0.3"), False)]
    plan = desired_routes(bests, peers, UNDERLAY, LocalPaths({"vxlan": "vxlan-device"}), own_subnets=[],
                          blackhole_metric=4000, own_backend="vxlan", encap="always")  # fmt: skip
    n3 = plan.plans["10.9.0.3"]
    assert not n3.routable and "peer's record" in n3.reason and n3.extra == {}
    if bad.get("vtep_mac") == good["vtep_mac"]:
        # A MAC two records publish is neither's: both refused, each naming both.
        n2 = plan.plans["10.9.0.2"]
        assert not n2.routable and "n2, n3" in n2.reason and "n2, n3" in n3.reason
        assert [r.dst for r in plan.routes] == []
        return
    assert [(r.dst, r.gateway, r.dev) for r in plan.routes] == [("10.244.2.0/24", "10.244.2.0", "agentd.vxlan")]
    assert plan.plans["10.9.0.2"].backend == "vxlan"
    # cross-subnet, on-link: no VTEP needed, so its bad VTEP data does not matter
    direct = plan_peer(node("n3", "10.0.0.9", backend=broken), UNDERLAY, own_backend="vxlan", encap="cross-subnet")
    assert direct.backend == "host-gw"


@pytest.mark.parametrize("first", ["n2", "n3"])
def test_a_vtep_mac_two_records_publish_stays_with_the_record_made_first(first):
    """A record copying another node's VTEP MAC (n3 publishing n2's) must not take that node off
    the network: the record whose etcd key was made first (lower create_revision) keeps its
    MAC and its route, only the other is refused, the reason naming both.  Whichever that is:
    the order is etcd's, not the names'."""
    import dataclasses

    from agentd.kernel.forwarding import desired_routes

    mac = "aa:bb:cc:dd:ee:02"
    peers = [node("n2", "10.9.0.2", subnet="10.244.2.0/24",
                  backend={"type": "vxlan", "vtep_ip": "10.244.2.0", "vtep_mac": mac}),
             node("n3", "10.9.0.3", subnet="10.244.3.0/24",
                  backend={"type": "vxlan", "vtep_ip": "10.244.3.0", "vtep_mac": mac.upper()})]
    made = {first: 5, ({"n2", "n3"} - {first}).pop(): 9}
    peers = [dataclasses.replace(p, create_revision=made[p.name]) for p in peers]
    later = "n3" if first == "n2" else "n2"
    bests = [("10.244.2.0/24", IPv4Address("10.9.0.2"), False), ("10.244.3.0/24", IPv4Address("10.9.0.3"), False)]
    plan = desired_routes(bests, peers, UNDERLAY, LocalPaths({"vxlan": "vxlan-device"}), own_subnets=[],
                          blackhole_metric=4000, own_backend="vxlan", encap="always")  # fmt: skip
    by_name = {p.node: p for p in plan.plans.values()}
    assert by_name[first].backend == "vxlan" and by_name[first].extra["vtep_mac"].lower() == mac
    refused = by_name[later]
    assert not refused.routable and refused.extra == {}
    assert "n2, n3" in refused.reason and f"it is {first}'s, whose record was made first" in refused.reason
    assert [r.dst for r in plan.routes] == [f"10.244.{first[1]}.0/24"]


def test_a_vtep_mac_two_records_made_at_once_is_neithers():
    """Records made in one etcd transaction share its revision: which came first is not known,
    so the MAC is neither's (as it is for records whose revision is not known)."""
    import dataclasses

    from agentd.kernel.forwarding import vxlan_vtep_refusals

    vx = {"type": "vxlan", "vtep_mac": "aa:bb:cc:dd:ee:02"}
    tied = [dataclasses.replace(node(n, a, backend=vx), create_revision=7) for n, a in (("n2", "10.9.0.2"), ("n3", "10.9.0.3"))]
    why = vxlan_vtep_refusals(tied, {})
    assert set(why) == {"n2", "n3"} and all("not known" in r[4] and "n2, n3" in r[4] for r in why.values())


def test_a_dual_stack_peer_reached_over_vxlan_for_ipv6_only_gets_its_vtep_entries():
    """cross-subnet, on-link for IPv4 but without an IPv6 next hop on the segment: the IPv6 plan
    is VXLAN, so the peer's neighbour and FDB entries are wanted although its IPv4 plan is direct."""
    import asyncio
    from types import SimpleNamespace

    from agentd.dataplane.backends import _Vxlan

    vx = {"type": "vxlan", "vtep_ip": "10.244.9.0", "vtep_ip_v6": "fd00:10:244:9::", "vtep_mac": "aa:bb:cc:dd:ee:ff"}
    peer = dual("n9", "10.0.0.9", backend=vx)
    v4 = plan_peer(peer, V4_ONLY_SEGMENT, own_backend="vxlan", encap="cross-subnet", version=4)
    v6 = plan_peer(peer, V4_ONLY_SEGMENT, own_backend="vxlan", encap="cross-subnet", version=6)
    assert (v4.backend, v6.backend) == ("host-gw", "vxlan")

    class Tunnels:
        plans_v6 = {"10.0.0.9": v6}
        cfg = SimpleNamespace(network=SimpleNamespace(vxlan_vni=1, vxlan_port=4789))

    vtep = _Vxlan.__new__(_Vxlan)
    vtep.t, vtep.vtep_ip, vtep.vtep_ip_v6 = Tunnels(), "10.244.1.0", "fd00:10:244:1::"
    wanted = {}

    async def _sync(w, prune):
        wanted.update(w)

    vtep._sync = _sync
    asyncio.run(vtep.sync({"10.0.0.9": v4}, {}, prune=True))
    assert wanted == {"10.0.0.9": (("10.244.9.0", "fd00:10:244:9::"), "aa:bb:cc:dd:ee:ff", None, None)}


def _dual_vxlan_peer(name, addr, i, **backend):
    vx = {"type": "vxlan", "vtep_mac": f"aa:bb:cc:dd:ee:0{i}", "vtep_ip": f"10.244.{i}.0",
          "vtep_ip_v6": f"fd00:10:244:{i}::", **backend}
    return NodeRecord(name, IPv4Address(addr), 64512, IPv4Network(f"10.244.{i}.0/24"), False, None, vx,
                      subnet_v6=IPv6Network(f"fd00:10:244:{i}::/64"))


def test_a_node_not_yet_dual_stack_keeps_the_ipv4_vxlan_route_to_a_restarted_one():
    """IPv4 -> dual-stack, nodes restarted one at a time: a node not yet restarted routes IPv4
    only (its pod networks are IPv4), so the IPv6 subnet and VTEP address a restarted node's
    record publishes are not taken -- and not checked: its IPv4 VTEP still is, and pod traffic
    old -> new goes on (the whole peer refused had stopped it until every node was restarted)."""
    n2 = _dual_vxlan_peer("n2", "10.9.0.2", 2)
    plan = desired_routes([("10.244.2.0/24", IPv4Address("10.9.0.2"), False)], [n2], UNDERLAY,
                          LocalPaths({"vxlan": "vxlan-device"}), own_subnets=["10.244.1.0/24"], blackhole_metric=4000,
                          own_backend="vxlan", encap="always", pod_networks=["10.244.0.0/16"], subnet_lens={4: 24})
    assert [(r.dst, r.gateway) for r in plan.routes] == [("10.244.1.0/24", None), ("10.244.2.0/24", "10.244.2.0")]
    p = plan.plans["10.9.0.2"]
    assert p.backend == "vxlan" and p.extra["vtep_ip"] == "10.244.2.0" and "vtep_ip_v6" not in p.extra
    assert [u["subnet"] for u in plan.untrusted] == ["fd00:10:244:2::/64"]  # still said


@pytest.mark.parametrize("family, bad", [
    (6, {"vtep_ip_v6": "fd00:10:244:3::"}),  # n3's IPv6 VTEP address
    (6, {"vtep_ip_v6": "fd00:10:244:2::1"}),  # not its subnet's network address
    (4, {"vtep_ip": "10.244.3.0"}),
    (4, {"vtep_ip": "10.244.2.1"}),
])
def test_a_wrong_vtep_address_of_one_family_refuses_that_familys_plan_only(family, bad):
    """On a dual-stack node a VXLAN peer's VTEP address wrong in one family takes that family's
    plan (and routes) away, not the other's; the plan kept carries no refused address, so no
    neighbour entry is made for it."""
    n2, n3 = _dual_vxlan_peer("n2", "10.9.0.2", 2, **bad), _dual_vxlan_peer("n3", "10.9.0.3", 3)
    bests = [("10.244.2.0/24", IPv4Address("10.9.0.2"), False), ("fd00:10:244:2::/64", IPv6Address("::ffff:10.9.0.2"), False),
             ("10.244.3.0/24", IPv4Address("10.9.0.3"), False), ("fd00:10:244:3::/64", IPv6Address("::ffff:10.9.0.3"), False)]
    plan = desired_routes(bests, [n2, n3], DUAL_UNDERLAY, LocalPaths({"vxlan": "vxlan-device"}), own_subnets=[],
                          blackhole_metric=4000, own_backend="vxlan", encap="always", versions=(4, 6),
                          pod_networks=["10.244.0.0/16", "fd00:10:244::/48"], subnet_lens={4: 24, 6: 64})
    refused, kept = (plan.plans_v6, plan.plans) if family == 6 else (plan.plans, plan.plans_v6)
    key, other = ("vtep_ip_v6", "vtep_ip") if family == 6 else ("vtep_ip", "vtep_ip_v6")
    assert not refused["10.9.0.2"].routable and f"backend field {key!r}" in refused["10.9.0.2"].reason
    assert kept["10.9.0.2"].backend == "vxlan" and key not in kept["10.9.0.2"].extra and other in kept["10.9.0.2"].extra
    dsts = [r.dst for r in plan.routes]
    assert ("10.244.2.0/24" in dsts) == (family == 6) and ("fd00:10:244:2::/64" in dsts) == (family == 4)
    assert {"10.244.3.0/24", "fd00:10:244:3::/64"} <= set(dsts)  # n3 untouched
    assert plan.plans["10.9.0.3"].extra["vtep_ip_v6"] == "fd00:10:244:3::"


# -- what a node may route: its pod subnets, never ours (security review) -----------------------

POD_NET = ["10.244.0.0/16"]


def _hostile_b_plan(pod_networks=POD_NET, nodes=None):
    b = node("b", "10.0.0.2", subnet="10.244.2.0/24")
    c = node("c", "10.0.0.4", subnet="10.244.5.0/24")
    bests = [("10.244.2.0/24", IPv4Address("10.0.0.2"), False),  # b's own: fine
             ("0.0.0.0/0", IPv4Address("10.0.0.2"), False),
             ("10.244.1.0/25", IPv4Address("10.0.0.2"), False),  # part of our own pods' /24
             ("10.0.0.9/32", IPv4Address("10.0.0.2"), False),  # etcd on the underlay
             ("10.244.5.0/24", IPv4Address("10.0.0.2"), False),  # node c's subnet
             ("10.244.9.0/24", IPv4Address("10.0.0.2"), False)]  # in the pod network, nobody's
    return desired_routes(bests, nodes if nodes is not None else [b, c], UNDERLAY, LocalPaths(),
                          own_subnets=["10.244.1.0/24"], blackhole_metric=4000, own_backend="host-gw",
                          encap="always", pod_networks=pod_networks)


def test_a_node_routes_only_pod_subnets_that_are_neither_ours_nor_another_nodes():
    plan = _hostile_b_plan()
    assert [(r.dst, r.kind) for r in plan.routes] == [
        ("10.244.1.0/24", "blackhole"), ("10.244.2.0/24", "unicast"), ("10.244.9.0/24", "unicast")]
    assert [r["dst"] for r in plan.rows] == ["10.244.1.0/24", "10.244.2.0/24", "10.244.9.0/24"]
    assert plan.next_hops == {"10.0.0.2": ["10.244.2.0/24", "10.244.9.0/24"]}
    why = {r["dst"]: r["reason"] for r in plan.refused}
    assert set(why) == {"0.0.0.0/0", "10.244.1.0/25", "10.0.0.9/32", "10.244.5.0/24"}
    assert all(r["backend"] == "refused" and r["peer"] == "10.0.0.2" for r in plan.refused)
    assert why["0.0.0.0/0"] == "node b announced 0.0.0.0/0, outside the cluster's pod network (10.244.0.0/16)"
    assert why["10.0.0.9/32"].startswith("node b announced 10.0.0.9/32, outside")
    assert why["10.244.1.0/25"] == "10.244.1.0/25 is part of this node's own pod subnet 10.244.1.0/24"
    assert why["10.244.5.0/24"] == "node b announced 10.244.5.0/24, which overlaps node c's subnet 10.244.5.0/24"


def _routes_through(plan):
    return {r.dst: r.gateway for r in plan.routes if r.kind == "unicast"}


def test_a_node_record_naming_a_subnet_not_of_the_cluster_takes_no_other_nodes_routes_away():
    """A record is its node's own word: one naming 10.0.0.0/8 (or a /22 where nodes lease
    /24s) made every other node's route inside it refused as "overlaps node b's subnet"."""
    c = node("c", "10.0.0.4", subnet="10.244.5.0/24")
    bests = [("10.244.5.0/24", IPv4Address("10.0.0.4"), False)]
    for wide in ("10.0.0.0/8", "10.244.4.0/22", "10.244.5.0/25"):
        b = node("b", "10.0.0.2", subnet=wide)
        plan = desired_routes(bests, [b, c], UNDERLAY, LocalPaths(), own_subnets=["10.244.1.0/24"],
                              blackhole_metric=4000, own_backend="host-gw", encap="always", pod_networks=POD_NET,
                              subnet_lens={4: 24})  # fmt: skip
        assert _routes_through(plan) == {"10.244.5.0/24": "10.0.0.4"} and plan.refused == [], wide
        assert [(u["node"], u["subnet"]) for u in plan.untrusted] == [("b", wide)]
    assert plan.untrusted[0]["reason"] == "not a /24, the cluster's subnet length"
    plan = desired_routes(bests, [node("b", "10.0.0.2", subnet="10.0.0.0/8"), c], UNDERLAY, LocalPaths(),
                          own_subnets=["10.244.1.0/24"], blackhole_metric=4000, own_backend="host-gw", encap="always",
                          pod_networks=POD_NET, subnet_lens={4: 24})  # fmt: skip
    assert plan.untrusted[0]["reason"] == "outside the cluster's pod network 10.244.0.0/16"


def test_a_node_record_naming_another_nodes_subnet_does_not_steal_it():
    """An impostor's record naming c's /24: it used to take c's entry (c's own route refused,
    the impostor's taken).  Two records claiming one subnet: neither is held against the
    other's routes."""
    c = node("c", "10.0.0.4", subnet="10.244.5.0/24")
    x = node("x", "10.0.0.6", subnet="10.244.5.0/24")
    kwargs = {"own_subnets": ["10.244.1.0/24"], "blackhole_metric": 4000, "own_backend": "host-gw",
              "encap": "always", "pod_networks": POD_NET, "subnet_lens": {4: 24}}
    for order in ([c, x], [x, c]):
        plan = desired_routes([("10.244.5.0/24", IPv4Address("10.0.0.4"), False)], order, UNDERLAY, LocalPaths(),
                              **kwargs)
        assert _routes_through(plan) == {"10.244.5.0/24": "10.0.0.4"} and plan.refused == []
        assert sorted((u["node"], u["reason"]) for u in plan.untrusted) == [
            ("c", "overlaps the subnet the record of x names"), ("x", "overlaps the subnet the record of c names")]
    # Without the cluster's subnet length: a wider claim around c's is a rival too.
    w = node("w", "10.0.0.7", subnet="10.244.4.0/22")
    plan = desired_routes([("10.244.5.0/24", IPv4Address("10.0.0.4"), False)], [w, c], UNDERLAY, LocalPaths(),
                          **{**kwargs, "subnet_lens": None})
    assert _routes_through(plan) == {"10.244.5.0/24": "10.0.0.4"}
    assert sorted(u["node"] for u in plan.untrusted) == ["c", "w"]


@pytest.mark.parametrize(("log", "bad", "first"), [
    ("_log_untrusted", {"node": "b", "subnet": "10.0.0.0/8", "reason": "outside the cluster's pod network 10.244.0.0/16"},
     "node b's record names subnet 10.0.0.0/8, outside the cluster's"),
    ("_log_untrusted_hops", {"node": "m", "next_hop": "::ffff:10.0.0.9",
                             "reason": "IPv4-mapped: the next hop of the node at 10.0.0.9, not of this one"},
     "node m's record gives next hop ::ffff:10.0.0.9, IPv4-mapped"),
])  # fmt: skip
def test_a_record_subnet_or_next_hop_not_taken_is_logged_once_while_it_stays(log, bad, first):
    import logging

    from agentd.daemon.routes import KernelRoutes

    routes = KernelRoutes(None)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("agentd").addHandler(handler)
    try:
        for _ in range(3):
            getattr(routes, log)([bad])
        getattr(routes, log)([])
        getattr(routes, log)([bad])  # back: logged again
    finally:
        logging.getLogger("agentd").removeHandler(handler)
    lines = [r.getMessage() for r in records if r.levelno == logging.ERROR]
    assert len(lines) == 2 and lines[0].startswith(first)


def test_without_the_pod_network_a_node_still_cannot_take_ours_or_anothers():
    plan = _hostile_b_plan(pod_networks=None)
    why = {r["dst"]: r["reason"] for r in plan.refused}
    assert set(why) == {"10.244.1.0/25", "10.244.5.0/24", "0.0.0.0/0"}  # the default route holds c's subnet
    assert why["0.0.0.0/0"] == "node b announced 0.0.0.0/0, which overlaps node c's subnet 10.244.5.0/24"


def test_an_external_peer_cannot_take_our_pods_but_keeps_its_other_routes():
    bests = [("10.244.1.0/24", IPv4Address("10.0.0.1"), False),  # our pod subnet, from the ToR
             ("10.244.1.128/25", IPv4Address("192.0.2.1"), False),
             ("0.0.0.0/0", IPv4Address("10.0.0.1"), False),  # a default route holds ours: kept
             ("198.51.100.0/24", IPv4Address("10.0.0.1"), False)]
    plan = desired_routes(bests, [], UNDERLAY, LocalPaths(), own_subnets=["10.244.1.0/24"], blackhole_metric=4000,
                          own_backend="host-gw", encap="always", pod_networks=POD_NET)
    assert [(r.dst, r.gateway) for r in plan.routes if r.kind == "unicast"] == [
        ("0.0.0.0/0", "10.0.0.1"), ("198.51.100.0/24", "10.0.0.1")]
    assert [r["dst"] for r in plan.refused] == ["10.244.1.0/24", "10.244.1.128/25"]


def test_an_external_peer_cannot_take_part_of_another_nodes_subnet_but_may_pass_it_on_whole():
    """A more-specific of node c's subnet through a router outside the cluster would win the
    kernel's look-up for half of c's pods on every other node: refused.  c's subnet itself
    through that router (a top-of-rack router passing on another rack's routes), a part of the
    pod network no node holds, and a shorter prefix holding c's subnet are taken."""
    c = NodeRecord("c", IPv4Address("10.0.0.4"), 64512, IPv4Network("10.244.5.0/24"), False, None, {"type": "host-gw"},
                   subnet_v6=IPv6Network("fd00:10:244:5::/64"))  # fmt: skip
    tor = IPv4Address("10.0.0.1")
    bests = [("10.244.5.0/25", tor, False), ("10.244.5.0/24", tor, False), ("10.244.200.0/24", tor, False),
             ("10.244.0.0/16", tor, False), ("fd00:10:244:5::/80", IPv6Address("::ffff:10.0.0.1"), False)]
    plan = desired_routes(bests, [c], UNDERLAY, LocalPaths(), own_subnets=["10.244.1.0/24"], blackhole_metric=4000,
                          own_backend="host-gw", encap="always", versions=(4, 6),
                          pod_networks=["10.244.0.0/16", "fd00:10:244::/56"])  # fmt: skip
    assert {r["dst"]: r["reason"] for r in plan.refused} == {
        "10.244.5.0/25": "10.244.5.0/25 is part of node c's pod subnet 10.244.5.0/24, announced by a next hop outside the cluster",
        "fd00:10:244:5::/80": "fd00:10:244:5::/80 is part of node c's pod subnet fd00:10:244:5::/64, announced by a next hop "
                              "outside the cluster"}  # fmt: skip
    assert sorted(r.dst for r in plan.routes if r.kind == "unicast") == ["10.244.0.0/16", "10.244.200.0/24", "10.244.5.0/24"]


def test_ipv6_routes_of_a_node_are_held_to_the_ipv6_pod_network():
    b = NodeRecord("b", IPv4Address("10.0.0.2"), 64512, IPv4Network("10.244.2.0/24"), False, None, {},
                   subnet_v6=IPv6Network("fd00:10:244:2::/64"), link_local_v6=IPv6Address("fe80::2"))
    mapped = IPv6Address("::ffff:10.0.0.2")
    bests = [("fd00:10:244:2::/64", mapped, False), ("::/0", mapped, False),
             ("fd00:10:244:3::/80", mapped, False)]
    plan = desired_routes(bests, [b], UNDERLAY, LocalPaths(), own_subnets=["10.244.1.0/24", "fd00:10:244:3::/64"],
                          blackhole_metric=4000, own_backend="host-gw", encap="always", versions=(4, 6),
                          pod_networks=["10.244.0.0/16", "fd00:10:244::/56"])
    assert {r["dst"] for r in plan.refused} == {"::/0", "fd00:10:244:3::/80"}
    assert [r.dst for r in plan.routes if r.kind == "unicast"] == ["fd00:10:244:2::/64"]


def _forged(record, **fields):
    """A record as another writer may have put it in etcd (NodeRecord refuses these now)."""
    for name, value in fields.items():
        object.__setattr__(record, name, value)
    return record


V6_KWARGS = {"own_subnets": ["10.244.1.0/24", "fd00:10:244:1::/64"], "blackhole_metric": 4000, "own_backend": "host-gw",
             "encap": "always", "versions": (4, 6), "pod_networks": ["10.244.0.0/16", "fd00:10:244::/48"],
             "subnet_lens": {4: 24, 6: 64}}  # fmt: skip


def test_a_record_claiming_another_nodes_ipv4_mapped_next_hop_does_not_take_its_routes():
    """Node m's record giving address_v6 = ::ffff:10.0.0.9 (node a's IPv6 next hop over IPv4
    sessions): the last record read owned the next hop, so with m last, a's IPv6 route was refused
    as "node m announced ..., which overlaps node a's subnet" on every node."""
    a = NodeRecord("a", IPv4Address("10.0.0.9"), 64512, IPv4Network("10.244.9.0/24"), False, None, {},
                   subnet_v6=IPv6Network("fd00:10:244:9::/64"), link_local_v6=IPv6Address("fe80::9"))
    m = _forged(NodeRecord("m", IPv4Address("10.0.0.7"), 64512, IPv4Network("10.244.7.0/24"), False, None, {},
                           address_v6=IPv6Address("2001:db8::7")), address_v6=IPv6Address("::ffff:10.0.0.9"))
    bests = [("fd00:10:244:9::/64", IPv6Address("::ffff:10.0.0.9"), False)]
    for order in ([a, m], [m, a]):
        plan = desired_routes(bests, order, UNDERLAY, LocalPaths(), **V6_KWARGS)
        assert _routes_through(plan) == {"fd00:10:244:9::/64": "fe80::9"} and plan.refused == [], order
        assert plan.untrusted_next_hops == [
            {"node": "m", "next_hop": "::ffff:a00:9", "reason": "IPv4-mapped: the next hop of the node at 10.0.0.9, not of this one"}]


def test_a_next_hop_two_records_claim_is_neither_nodes():
    """Two records giving one address_v6: whichever was read last took the next hop (and the
    other node's routes through it were refused as overlapping).  Now neither owns it: a best
    path through it is refused with the claimants, in either order, and the claims reported."""
    a = NodeRecord("a", IPv4Address("10.0.0.9"), 64512, None, False, None, {},
                   address_v6=IPv6Address("2001:db8::9"), subnet_v6=IPv6Network("fd00:10:244:9::/64"))
    m = NodeRecord("m", IPv4Address("10.0.0.7"), 64512, None, False, None, {}, address_v6=IPv6Address("2001:db8::9"))
    underlay = Underlay("eth0", 2, IPv4Interface("10.0.0.3/24"), 1500, (IPv4Network("10.0.0.0/24"), IPv6Network("2001:db8::/64")),
                        IPv6Interface("2001:db8::3/64"))  # fmt: skip
    bests = [("fd00:10:244:9::/64", IPv6Address("2001:db8::9"), False), ("fd00:10:244:9::/64", IPv6Address("::ffff:10.0.0.9"), False)]
    for order in ([a, m], [m, a]):
        plan = desired_routes(bests[:1], order, underlay, LocalPaths(), **V6_KWARGS)
        assert _routes_through(plan) == {} and [r["reason"] for r in plan.refused] == [
            "next hop 2001:db8::9 is no node's: claimed by the records of nodes a, m"], order
        assert sorted((u["node"], u["next_hop"]) for u in plan.untrusted_next_hops) == [("a", "2001:db8::9"), ("m", "2001:db8::9")]
        # a's other next hop is still a's alone (routed as a's record says: a's word on its own subnet).
        plan = desired_routes(bests[1:], order, underlay, LocalPaths(), **V6_KWARGS)
        assert _routes_through(plan) == {"fd00:10:244:9::/64": "2001:db8::9"} and plan.refused == [], order
    # Two records with one IPv4 address: neither maps any next hop (their plans are one key).
    twin = NodeRecord("twin", IPv4Address("10.0.0.9"), 64512, None, False, None, {}, address_v6=IPv6Address("2001:db8::99"))
    plan = desired_routes([("fd00:10:244:9::/64", IPv6Address("2001:db8::9"), False)], [a, twin], underlay, LocalPaths(),
                          **V6_KWARGS)  # fmt: skip
    assert _routes_through(plan) == {} and [r["reason"] for r in plan.refused] == [
        "next hop 2001:db8::9 is no node's: node a's peer address 10.0.0.9 is not its alone"]
    assert sorted((u["node"], u["next_hop"]) for u in plan.untrusted_next_hops) == [
        ("a", "10.0.0.9"), ("a", "2001:db8::9"), ("a", "::ffff:a00:9"),
        ("twin", "10.0.0.9"), ("twin", "2001:db8::99"), ("twin", "::ffff:a00:9")]


def test_sessions_to_nodes_are_bounded_by_the_pod_networks_subnets():
    from agentd.daemon.mesh import RELAYED_PREFIXES, node_max_prefixes
    from agentd.datastore.store import ClusterConfig

    v4 = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "vxlan", "always")
    assert node_max_prefixes(v4) == 256 + RELAYED_PREFIXES
    dual = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "vxlan", "always", ip_family="dual",
                         cidr_v6=IPv6Network("fd00:10:244::/48"), subnet_len_v6=64)
    assert node_max_prefixes(dual) == 65536 + RELAYED_PREFIXES
    huge = ClusterConfig(IPv4Network("10.0.0.0/8"), 28, "vxlan", "always")  # 2^20 subnets: at most 65536 nodes
    assert node_max_prefixes(huge) == 65536 + RELAYED_PREFIXES
    assert node_max_prefixes(None) is None
    for mode, me, reflector in (("mesh", "n3", False), ("route-reflector", "n1", True),
                                ("route-reflector", "n4", False)):
        peers = desired_peers(me, NODES, mode=mode, i_am_reflector=reflector, max_prefixes=node_max_prefixes(v4),
                              external=[PeerSettings("192.0.2.1", 65100, description="external")])
        limits = {p.key: (p.max_prefixes, p.max_prefixes_restart) for p in peers}
        assert limits.pop("192.0.2.1") == (None, None)  # an external peer's limit is its own configuration
        assert limits and set(limits.values()) == {(256 + RELAYED_PREFIXES, 60.0)}


def test_a_bpf_peer_record_without_an_ipv4_address_is_refused_not_the_rest():
    """A dual-stack node record with ``address`` null beside an ``address_v6``, running udp in BPF: the programs encapsulate over IPv4, so its IPv6 subnet gets no route -- a
    refusal with the reason -- and the best paths through every other peer are still routed
    (the route used to be ``via ::ffff:fd00::2``, which raised and stopped all route updates)."""
    u = Underlay("eth0", 2, IPv4Interface("10.0.0.3/24"), 1500, (IPv4Network("10.0.0.0/24"), IPv6Network("fd00::/64")),
                 IPv6Interface("fd00::3/64"))
    backend, data = "udp", {"type": "udp", "datapath": "bpf"}
    bad = NodeRecord("n2", None, 64512, None, False, None, data, address_v6=IPv6Address("fd00::2"),
                     subnet_v6=IPv6Network("fd00:10:244:1::/64"))
    good = node("n3", "10.0.0.4", backend=data, subnet="10.244.2.0/24")
    bests = [("fd00:10:244:1::/64", IPv6Address("fd00::2"), False, True),
             ("10.244.2.0/24", IPv4Address("10.0.0.4"), False, True)]
    plan = desired_routes(bests, [bad, good], u, LocalPaths({backend: "bpf"}), own_subnets=["10.244.0.0/24"],
                          blackhole_metric=4000, own_backend=backend, encap="always", versions=(4, 6))
    assert [(r.dst, r.gateway) for r in plan.routes if r.kind == "unicast"] == [("10.244.2.0/24", "10.0.0.4")]
    [row] = plan.refused
    assert (row["dst"], row["peer"], row["backend"]) == ("fd00:10:244:1::/64", "fd00::2", "refused")
    assert "no IPv4 underlay address" in row["reason"]


def test_any_route_the_kernel_could_not_take_is_refused_not_raised(monkeypatch):
    """Whatever route shape a peer's record makes impossible (InvalidRoute) is a refusal of that
    best path, not an exception that stops every other route."""
    import agentd.kernel.forwarding as fwd
    from agentd.kernel.route_model import Route

    def shape(dst, plan, underlay, paths):
        return Route(dst=dst, gateway="not-an-address", dev=underlay.ifname)

    monkeypatch.setitem(fwd.ROUTE_SHAPES, "route", shape)
    peers = [node("n1", "10.0.0.1", backend={"type": "host-gw"})]
    bests = [("10.244.1.0/24", IPv4Address("10.0.0.1"), False), ("10.244.7.0/24", IPv4Address("192.0.2.1"), False)]
    plan = desired_routes(bests, peers, UNDERLAY, LocalPaths(), own_subnets=[], blackhole_metric=4000,
                          own_backend="host-gw", encap="always")
    assert [r.dst for r in plan.routes] == ["10.244.7.0/24"]  # the external next hop's route
    assert [(r["dst"], r["backend"]) for r in plan.refused] == [("10.244.1.0/24", "refused")]
    assert "not an IP address" in plan.refused[0]["reason"]


def test_an_unexpected_failure_of_one_route_or_one_peers_plan_is_refused_not_raised(monkeypatch):
    """Not only InvalidRoute: whatever one best path's route shape or one peer's record makes
    fail (an unexpected record) is that best path's refusal, or that peer's "none" plan, with
    the reason; the routes through every other peer are still computed."""
    import agentd.kernel.forwarding as fwd

    real_shape, real_bad = fwd.ROUTE_SHAPES["route"], fwd._bad_vxlan_data

    def shape(dst, plan, underlay, paths):
        if dst == "10.244.1.0/24":
            raise KeyError("gateway")
        return real_shape(dst, plan, underlay, paths)

    def bad_vxlan_data(data, *args):
        if data.get("vtep_ip") == "10.244.3.0":
            raise TypeError("unhashable type: 'list'")
        return real_bad(data, *args)

    monkeypatch.setitem(fwd.ROUTE_SHAPES, "route", shape)
    monkeypatch.setattr(fwd, "_bad_vxlan_data", bad_vxlan_data)
    vx = {"type": "vxlan"}
    peers = [node("n1", "10.0.0.1", backend={"type": "host-gw"}), node("n2", "10.0.0.2", backend={"type": "host-gw"}),
             node("n3", "10.9.0.3", backend={**vx, "vtep_ip": "10.244.3.0", "vtep_mac": "aa:bb:cc:dd:ee:03"},
                  subnet="10.244.3.0/24"),
             node("n4", "10.9.0.4", backend={**vx, "vtep_ip": "10.244.4.0", "vtep_mac": "aa:bb:cc:dd:ee:04"},
                  subnet="10.244.4.0/24")]
    bests = [(f"10.244.{i}.0/24", IPv4Address(a), False) for i, a in
             ((1, "10.0.0.1"), (2, "10.0.0.2"), (3, "10.9.0.3"), (4, "10.9.0.4"))]
    plan = desired_routes(bests, peers, UNDERLAY, LocalPaths({"vxlan": "vxlan-device"}), own_subnets=[],
                          blackhole_metric=4000, own_backend="vxlan", encap="always")
    assert [r.dst for r in plan.routes] == ["10.244.2.0/24", "10.244.4.0/24"]
    assert [(r["dst"], r["reason"]) for r in plan.refused] == [("10.244.1.0/24", "cannot be routed (KeyError: 'gateway')")]
    n3 = plan.plans["10.9.0.3"]
    assert not n3.routable and n3.reason == "peer's record: cannot plan a route (TypeError: unhashable type: 'list')"


def test_the_held_subnets_index_finds_what_a_scan_of_every_subnet_finds():
    """HeldSubnets answers refusal's two questions -- which held subnets hold a destination,
    which overlap it -- as a scan of every node's subnet does (it looks up only the lengths
    held), both families mixed, any lengths."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from agentd.kernel.forwarding import HeldSubnets

    def corner(net, base: int, bits: int, lengths: tuple[int, int]):
        """Networks inside one /(bits-16) of the space (``base``), so that they overlap often."""
        def make(offset: int, length: int):
            value = base | offset
            return net((value >> (bits - length) << (bits - length), length))

        return st.builds(make, st.integers(0, 0xFFFF), st.integers(*lengths))

    v4 = corner(IPv4Network, 0x0AF40000, 32, (16, 28))
    v6 = corner(IPv6Network, 0xFD << 120, 128, (112, 124))

    @settings(max_examples=400, deadline=None)
    @given(st.dictionaries(st.one_of(v4, v6), st.sampled_from(["a", "b", "c"]), max_size=12), st.one_of(v4, v6))
    def check(held, dst):
        index = HeldSubnets(held)
        holding = {(n, h) for n, h in held.items() if n.version == dst.version and dst.subnet_of(n)}
        overlapping = {(n, h) for n, h in held.items() if n.version == dst.version and dst.overlaps(n)}
        assert set(index.holding(dst)) == holding
        assert set(index.overlapping(dst)) == overlapping
        assert len(list(index.overlapping(dst))) == len(overlapping)  # each once
        assert dict(index) == held

    check()
