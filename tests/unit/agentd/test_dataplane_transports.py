"""The user-space workers' sockets on loopback (agentd/dataplane/udp.py, ipip.py and the C fast
path's receive and send loops): who may share the udp port, empty datagrams, jumbo-frame ipip
packets, what a refused UDP GSO send turns off; and the agent's side of the workers
(agentd/dataplane/backends.py): their member lists, what a previous run's worker leaves.

No root, no devices: the "TUN" of the C loops is a SOCK_SEQPACKET socket, the ipip transport's
raw socket a UDP socket whose payload is what the raw socket would read (outer header first).
"""

import contextlib
import errno
import select
import socket
import struct
import time
import types
from pathlib import Path

import pytest

from agentd.dataplane import _fast, backends
from agentd.dataplane import ipip as ipip_mod
from agentd.dataplane._forward import NextHopTable, parse_members
from agentd.dataplane._gro import Coalescer
from agentd.dataplane._transmit import IcmpRateLimit, Transmit
from agentd.dataplane.udp import UDP_GRO, UdpTransport
from agentd.dataplane.worker import _RX_BUF, COUNTERS, DROP_REASONS
from proto import packet as P

SO_NO_CHECK = 11  # a UDP socket without checksums: the kernel refuses UDP GSO on it (EINVAL)
LOCAL = "127.0.0.1"
# The member every test sends from (LOCAL) holds the pod subnet of tcp()'s source, as a peer
# holds its own: the receive side's reverse-path check takes its packets.
PEER_SUBNETS = {"10.244.1.0/24": LOCAL, "fd00:10:244:1::/64": LOCAL}


def counters():
    return dict.fromkeys(COUNTERS, 0), dict.fromkeys(DROP_REASONS, 0)


def tcp(payload: bytes, src="10.244.1.2", dst="10.244.2.2") -> bytes:
    return bytes(P.tcp_packet(src, dst, P.TcpHeader(40000, 5201, 1000, 777, P.TCP_ACK, 502), payload))


@contextlib.contextmanager
def udp_transport(**kw):
    c, d = counters()
    t = UdpTransport(LOCAL, 0, counters=c, drops=d, **kw)
    t.set_table(NextHopTable(PEER_SUBNETS))
    try:
        yield t, c, d
    finally:
        t.close()


class Collect:
    """A coalescer that keeps what it is handed, packet by packet."""

    def __init__(self):
        self.packets = []

    def add(self, v):
        self.packets.append(bytes(v))

    def add_batch(self, *_a):
        return False

    def add_segments(self, *_a):
        return False

    def flush(self):
        pass


def _ready(sock):
    assert select.select([sock], [], [], 2)[0], "nothing arrived"


# -- the udp port -------------------------------------------------------------------------------


def test_no_other_socket_can_join_the_udp_workers_port_with_so_reuseaddr():
    """With SO_REUSEADDR on the worker's socket any local user could bind the port too (the
    kernel checks no UID for it) and would get the peers' packets; SO_REUSEPORT, which a
    replacing worker uses, is for sockets of the same user only."""
    with udp_transport(offload=False) as (t, _c, _d):
        port = t.sock.getsockname()[1]
        thief = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError) as exc:
                thief.bind((LOCAL, port))
            assert exc.value.errno == errno.EADDRINUSE
        finally:
            thief.close()
        # A successor worker (same user) may still bind while this one exits.
        c2, d2 = counters()
        successor = UdpTransport(LOCAL, port, offload=False, counters=c2, drops=d2)
        successor.close()


# -- members ------------------------------------------------------------------------------------


def test_a_worker_leaves_its_own_address_out_of_its_members():
    """A node never encapsulates to itself: a datagram from its own underlay address is a local
    process's, which must not put forged pod packets into the TUN."""
    assert parse_members(["192.168.50.1", "192.168.50.2"], own="192.168.50.1") == {"192.168.50.2"}
    assert parse_members(["192.168.50.2"], own="192.168.50.1") == {"192.168.50.2"}


class _FakeClient:
    def __init__(self):
        self.members = None
        self.next_hops = None
        self.sources = None

    async def set_next_hops(self, table, sources=None):
        self.next_hops = table
        self.sources = sources

    async def set_members(self, members):
        self.members = set(members)


async def test_the_agent_gives_its_workers_the_members_but_its_own_address():
    own = "192.168.50.1"
    t = types.SimpleNamespace(
        cfg=types.SimpleNamespace(agent=types.SimpleNamespace(state_dir="/nonexistent")),
        underlay=types.SimpleNamespace(interface=types.SimpleNamespace(ip=own)),
        members={own, "192.168.50.2", "192.168.50.3"},
        plans_v6={}, next_hops_v6={}, hosts_v6={}, subnets={},
        paths=lambda: None,
    )
    worker = backends._Worker(t, "udp")
    worker.client = _FakeClient()
    await worker.sync({}, {}, prune=True)
    assert worker.client.members == {"192.168.50.2", "192.168.50.3"}


async def test_the_agent_gives_its_workers_every_peer_nodes_subnets_as_their_reverse_path_table():
    """The worker's next hops are its backend's peers in user space; what it receives may come
    from any peer node whatever carries our packets to it: a host-gw peer (a node whose own
    backend is host-gw, with a udp worker of its own to reach us), one over VXLAN.  Each peer node's
    subnets, both families, by its address, are the table the worker checks inner sources
    against; an external next hop's prefixes are no peer's."""
    from agentd.kernel.forwarding import LocalPaths, PeerPlan

    own, user, gw, vx, ext = "192.168.50.1", "192.168.50.2", "192.168.50.3", "192.168.50.4", "192.168.50.254"
    plans = {user: PeerPlan(user, "udp", "", "n2", {"datapath": "userspace"}),
             gw: PeerPlan(gw, "host-gw", "", "n3"),
             vx: PeerPlan(vx, "vxlan", "", "n4"),
             ext: PeerPlan(ext, "kernel", "", None)}
    next_hops = {user: ["10.244.2.0/24"], gw: ["10.244.3.0/24"], vx: ["10.244.4.0/24"], ext: ["0.0.0.0/0"]}
    t = types.SimpleNamespace(
        cfg=types.SimpleNamespace(agent=types.SimpleNamespace(state_dir="/nonexistent")),
        underlay=types.SimpleNamespace(interface=types.SimpleNamespace(ip=own)),
        members={own, user, gw, vx},
        plans_v6={gw: PeerPlan(gw, "host-gw", "", "n3", version=6)}, next_hops_v6={gw: ["fd00:10:244:3::/64"]},
        hosts_v6={}, subnets={},
        paths=lambda: LocalPaths(datapaths={"udp": "userspace", "vxlan": "vxlan-device"}),
    )
    worker = backends._Worker(t, "udp")
    worker.client = _FakeClient()
    await worker.sync(plans, next_hops, prune=True)
    assert worker.client.next_hops == {"10.244.2.0/24": user}
    assert worker.client.sources == {"10.244.2.0/24": user, "10.244.3.0/24": gw, "fd00:10:244:3::/64": gw,
                                     "10.244.4.0/24": vx}
    # After a restart, until BGP has re-learned every route, a re-attached worker's tables stay.
    worker.base, worker.base_sources = {"10.244.9.0/24": user}, {"10.244.8.0/24": gw}
    await worker.sync(plans, next_hops, prune=False)
    assert worker.client.next_hops == {"10.244.2.0/24": user, "10.244.9.0/24": user}
    assert worker.client.sources["10.244.8.0/24"] == gw and worker.client.sources["10.244.9.0/24"] == user


def _record(name, address, n, address_v6=None):
    from ipaddress import ip_address, ip_network

    from agentd.datastore.records import NodeRecord

    return NodeRecord(name=name, address=ip_address(address), asn=64512, subnet=ip_network(f"10.244.{n}.0/24"),
                      route_reflector=False, cluster_id=None, subnet_v6=ip_network(f"fd00:10:244:{n}::/64"),
                      address_v6=None if address_v6 is None else ip_address(address_v6))


async def test_a_peer_hosts_ipv6_node_address_is_a_source_of_that_peer_alone():
    """A dual-stack peer's host sends IPv6 from its node address where it picks no address of
    its subnet (a reply to a pod that connected to it with ip_masq off; a host whose TUN or
    bridge has no IPv6 address yet): as its IPv4 underlay address, that address is accepted
    from that peer -- and only from it.  An address_v6 two records claim, or one inside another
    node's pod subnet or ours, is no one's (a record must not let its node pose as pods)."""
    from ipaddress import ip_network

    from agentd.kernel.forwarding import LocalPaths, PeerPlan

    own, b, c = "192.168.50.1", "192.168.50.2", "192.168.50.3"
    nodes = [_record("n1", own, 1, "2001:db8::1"), _record("n2", b, 2, "2001:db8::2"),
             _record("n3", c, 3, "2001:db8::3"),
             _record("n4", "192.168.50.4", 4, "2001:db8::1"),          # claims ours: no one's
             _record("n5", "192.168.50.5", 5, "fd00:10:244:2::5"),     # inside n2's pod subnet
             _record("n6", "192.168.50.6", 6, "fd00:10:244:1::6"),     # inside ours
             _record("n7", "192.168.50.7", 7)]                         # no IPv6 node address
    hosts = backends.host_addresses_v6(nodes, "n1")
    assert hosts == {"2001:db8::2": b, "2001:db8::3": c}
    hosts.update({"fd00:10:244:2::5": "192.168.50.5", "fd00:10:244:1::6": "192.168.50.6"})  # (_host_sources refuses them itself too)
    plans = {p: PeerPlan(p, "udp", "", f"n{p[-1]}") for p in (b, c)}
    plans_v6 = {p: PeerPlan(p, "udp", "", f"n{p[-1]}", version=6) for p in (b, c)}
    t = types.SimpleNamespace(
        cfg=types.SimpleNamespace(agent=types.SimpleNamespace(state_dir="/nonexistent")),
        underlay=types.SimpleNamespace(interface=types.SimpleNamespace(ip=own)),
        members={own, b, c, "192.168.50.5", "192.168.50.6"},
        plans_v6=plans_v6, next_hops_v6={b: ["fd00:10:244:2::/64"], c: ["fd00:10:244:3::/64"]},
        hosts_v6=hosts, subnets={4: ip_network("10.244.1.0/24"), 6: ip_network("fd00:10:244:1::/64")},
        paths=lambda: LocalPaths(datapaths={"udp": "userspace"}),
    )
    worker = backends._Worker(t, "udp")
    worker.client = _FakeClient()
    await worker.sync(plans, {b: ["10.244.2.0/24"], c: ["10.244.3.0/24"]}, prune=True)
    sources = worker.client.sources
    assert sources["2001:db8::2/128"] == b and sources["2001:db8::3/128"] == c
    assert not {"2001:db8::1/128", "fd00:10:244:2::5/128", "fd00:10:244:1::6/128"} & set(sources)
    check = NextHopTable(sources)
    B, C = socket.inet_aton(b), socket.inet_aton(c)
    v6 = lambda a: socket.inet_pton(socket.AF_INET6, a)
    assert check.source_ok(v6("2001:db8::2"), B)          # B's host, from its node address
    assert check.source_ok(v6("fd00:10:244:2::"), B)      # B's host, from its TUN's address
    assert not check.source_ok(v6("2001:db8::3"), B)      # C's node address forged by B
    assert not check.source_ok(v6("2001:db8::2"), C)      # B's forged by C
    assert not check.source_ok(v6("2001:db8::1"), B)      # ours
    assert not check.source_ok(v6("fd00:10:244:2::5"), socket.inet_aton("192.168.50.5"))  # n5 as n2's pod


def test_a_peers_node_address_inside_a_pod_subnet_not_routed_here_is_no_ones():
    """A record's address_v6 inside another node's pod subnet is refused while that node's route
    is not (yet) in the reverse-path table -- pending, refused, not learned from BGP yet --, and
    one inside the IPv6 pod network that no record holds yet (a subnet a later node leases): the
    claimant would pass as that node's pods.  A genuine one beside them is still its node's."""
    from ipaddress import ip_network

    nodes = [_record("n1", "192.168.50.1", 1, "2001:db8::1"), _record("n2", "192.168.50.2", 2, "2001:db8::2"),
             _record("n3", "192.168.50.3", 3, "2001:db8::3"),
             _record("n4", "192.168.50.4", 4, "fd00:10:244:3::5"),      # inside n3's pod subnet
             _record("n5", "192.168.50.5", 5, "fd00:10:244:ff::5")]     # inside the pod network, no one's yet
    # n3's route is not in sources: only n2's and n4's are routed here.
    sources = {"fd00:10:244:2::/64": "192.168.50.2", "fd00:10:244:4::/64": "192.168.50.4"}
    ours = [ip_network("10.244.1.0/24"), ip_network("fd00:10:244:1::/64")]
    hosts = backends.host_addresses_v6(nodes, "n1", [ip_network("fd00:10:244::/48")])
    assert backends._host_sources(hosts, sources, ours) == {"2001:db8::2/128": "192.168.50.2",
                                                            "2001:db8::3/128": "192.168.50.3"}
    # Without the pod network given, a record's subnet alone still refuses n4's claim.
    hosts = backends.host_addresses_v6(nodes, "n1")
    assert "fd00:10:244:3::5" not in hosts and hosts["fd00:10:244:ff::5"] == "192.168.50.5"


async def test_a_peers_node_address_cannot_be_one_of_this_nodes_own():
    """No record's address_v6 passes as this node's own addresses that lie outside its pod
    subnets: its node address (also while its own record is missing from the node set: a lapsed
    lease, a deleted key), its underlay's, the node-local DNS address (the same on every node),
    its Ingress addresses, or a cluster IP of the IPv6 Service range -- pods would take packets
    from their DNS server or from this host itself.  A peer's genuine node address still passes."""
    from ipaddress import ip_address, ip_interface, ip_network

    from agentd.config.settings import load_config
    from agentd.kernel.netinfo import Underlay

    cfg = load_config(None, env={}, overrides={"node.address": "192.168.50.1", "node.name": "n1",
                                               "node.address_v6": "2001:db8::1", "network.ip_family": "dual",
                                               "ingress.addresses": "2001:db8:1::80"})
    underlay = Underlay("eth0", 2, ip_interface("192.168.50.1/24"), 1500, (ip_network("192.168.50.0/24"),),
                        interface_v6=ip_interface("2001:db8::9/64"), link_local=ip_address("fe80::1"))
    claims = {"n2": "2001:db8::1",            # our node address; our record (n1) is not in the set
              "n3": "fd00:169:254:20::10",    # the node-local DNS address
              "n4": "fd00:10:96::5",          # a cluster IP
              "n5": "2001:db8:1::80",         # our Ingress address
              "n6": "2001:db8::9",            # our underlay's
              "n8": "fd00:10:244:c8::5",      # the IPv6 pod network, in no record's subnet (yet)
              "n7": "2001:db8::7"}            # its own: passes
    nodes = {name: _record(name, f"192.168.50.{name[1:]}", int(name[1:]), a) for name, a in claims.items()}
    t = backends.Tunnels(cfg, underlay, "n1")
    t.apply({}, {}, nodes)
    assert t.hosts_v6 == {"2001:db8::7": "192.168.50.7"}
    ours = [ip_network("10.244.1.0/24"), ip_network("fd00:10:244:1::/64")]
    assert backends._host_sources(t.hosts_v6, {}, ours) == {"2001:db8::7/128": "192.168.50.7"}


async def test_the_udp_tun_gets_an_address_in_each_pod_subnet_the_ipip_tun_the_ipv4_one(tmp_path):
    """A peer's host sources its packets through the TUN from the TUN's address (RFC 6724:
    the outgoing interface's), which the receiver accepts as within that peer's subnet: the
    udp TUN, which carries both families, needs one of each (without an IPv6 one the host
    picks its node address, or any other); ipip carries IPv4 alone."""
    from ipaddress import ip_network

    subnets = {4: ip_network("10.244.2.0/24"), 6: ip_network("fd00:10:244:2::/64")}
    given = {}
    for kind in ("udp", "ipip"):
        t = types.SimpleNamespace(
            cfg=types.SimpleNamespace(agent=types.SimpleNamespace(state_dir=str(tmp_path)),
                                      network=types.SimpleNamespace(udp_port=8285)),
            underlay=types.SimpleNamespace(interface=types.SimpleNamespace(ip="192.168.50.2"), mtu=1500),
            subnets=subnets,
        )
        worker = backends._Worker(t, kind)

        async def attach(_wanted, worker=worker):
            worker.client = _FakeClient()

        worker._attach = attach
        worker._address = lambda *a, kind=kind: given.__setitem__(kind, a)
        await worker.up(subnets[4])
    assert given == {"udp": ("10.244.2.0", "fd00:10:244:2::"), "ipip": ("10.244.2.0",)}


class _HeldWorker(_FakeClient):
    """A previous run's worker, as DataplaneClient.get() reads it."""

    def __init__(self, held):
        super().__init__()
        self.held = held

    async def get(self):
        return self.held


async def test_a_reattached_workers_reverse_path_table_stays_until_routes_are_relearned(monkeypatch):
    """After a restart the agent re-attaches to the running worker and keeps its next hops and
    its sources until BGP has re-learned every route: a peer reached by host-gw (in sources,
    not in the next hops) whose route is not back yet still has its pods' packets taken."""
    from agentd.kernel.forwarding import LocalPaths, PeerPlan

    own, user, gw = "192.168.50.1", "192.168.50.2", "192.168.50.3"
    wanted = {"local_ip": own, "port": 8285, "mtu": 1472}
    held = {"config": dict(wanted), "next_hops": {"10.244.2.0/24": user}, "members": [user, gw],
            "sources": {"10.244.2.0/24": user, "10.244.8.0/24": gw}}
    client = _HeldWorker(held)

    async def connect(path, timeout=5.0):
        return client

    monkeypatch.setattr(backends.DataplaneClient, "connect", connect)
    t = types.SimpleNamespace(
        cfg=types.SimpleNamespace(agent=types.SimpleNamespace(state_dir="/nonexistent")),
        underlay=types.SimpleNamespace(interface=types.SimpleNamespace(ip=own)),
        members={own, user, gw},
        plans_v6={}, next_hops_v6={}, hosts_v6={}, subnets={},
        paths=lambda: LocalPaths(datapaths={"udp": "userspace"}),
    )
    worker = backends._Worker(t, "udp")
    await worker._attach(wanted)
    assert worker.client is client
    # BGP has re-learned the udp peer's route so far, not the host-gw peer's.
    await worker.sync({user: PeerPlan(user, "udp", "", "n2")}, {user: ["10.244.2.0/24"]}, prune=False)
    assert client.sources["10.244.8.0/24"] == gw and client.sources["10.244.2.0/24"] == user
    assert client.next_hops == {"10.244.2.0/24": user}
    # Once every route is back, what no plan gives any more goes.
    await worker.sync({user: PeerPlan(user, "udp", "", "n2")}, {user: ["10.244.2.0/24"]}, prune=True)
    assert client.sources == {"10.244.2.0/24": user}


# -- a previous run's worker --------------------------------------------------------------------


@pytest.mark.parametrize(("active", "helpers", "removed"), [
    ({"udp": "bpf"}, (), ["udp", "ipip"]),             # udp moved from the worker into BPF
    ({"udp": "bpf"}, ("udp",), ["ipip"]),              # ... with a worker beside it: kept
    ({"udp": "userspace"}, (), ["ipip"]),
    ({"ipip": "bpf", "vxlan": "vxlan-device"}, (), ["udp", "ipip"]),
])
async def test_a_previous_runs_worker_goes_when_no_worker_runs_its_backend_now(monkeypatch, active, helpers, removed):
    """A previous run with datapath = "userspace" left its udp worker running (graceful stop);
    this run carries udp in BPF: the old worker (and its TUN) must go, not linger."""
    asked = []

    async def leftovers(state_dir, kinds):
        asked.append(list(kinds))
        return []

    monkeypatch.setattr(backends, "remove_worker_leftovers", leftovers)
    monkeypatch.setattr(backends, "remove_vxlan_leftover", list)
    fake = types.SimpleNamespace(
        active={b: types.SimpleNamespace(datapath=dp) for b, dp in active.items()},
        helpers=dict.fromkeys(helpers, object()),
        cfg=types.SimpleNamespace(agent=types.SimpleNamespace(state_dir=Path("/nonexistent"))),
    )
    await backends.Tunnels._remove_unused(fake)
    assert asked == [removed]


# -- empty datagrams ----------------------------------------------------------------------------


@pytest.mark.parametrize("offload", [True, False])
def test_an_empty_datagram_is_counted_malformed_not_a_crash(offload):
    with udp_transport(offload=offload) as (t, c, d):
        t.set_members(frozenset({LOCAL}))
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind((LOCAL, 0))
            t.port = s.getsockname()[1]  # a member's worker: from the cluster's udp_port
            s.sendto(b"", t.sock.getsockname())
            _ready(t.sock)
            t.receive(bytearray(1 << 20), Coalescer(lambda parts: None), 64)
        finally:
            s.close()
        assert d["malformed"] == 1 and c["rx_packets"] == 0


@contextlib.contextmanager
def c_path(kind: str, sock: socket.socket, *, mtu: int, udp_gso=False, udp_gro=False, port=0):
    """A FastPath on ``sock``, its TUN a SOCK_SEQPACKET socket; yields (fastpath, writes)."""
    lib, why = _fast.load()
    assert lib is not None, why
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.setblocking(False)
    a.setblocking(False)
    fp = _fast.FastPath(lib, kind, tun_fd=a.fileno(), sock_fd=sock.fileno(), mtu=mtu, ttl_decrement=True,
                        port=port, udp_gso=udp_gso, udp_gro=udp_gro, ipv6=kind == "udp")
    fp.set_routes(NextHopTable(PEER_SUBNETS))

    def writes():
        out = []
        while True:
            try:
                out.append(b.recv(1 << 17)[10:])  # after the virtio-net header
            except BlockingIOError:
                return out

    try:
        yield fp, writes, b
    finally:
        fp.close()
        a.close()
        b.close()


@contextlib.contextmanager
def _member_sockets():
    """Our tunnel socket and a second UDP socket, both on LOCAL, closed at the end.  The second's
    port is the one to give the path as udp_port: a member's worker sends from it (one port
    for both ends on loopback), and what the path sends to LOCAL arrives there."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind((LOCAL, 0))
        s.bind((LOCAL, 0))
        yield sock, s
    finally:
        sock.close()
        s.close()


def test_the_c_udp_loop_counts_an_empty_datagram_malformed_as_python_does():
    with _member_sockets() as (sock, s):
        sock.setsockopt(17, UDP_GRO, 1)
        with c_path("udp", sock, mtu=1472, udp_gro=True, port=s.getsockname()[1]) as (fp, writes, _tun):
            fp.set_members({LOCAL})
            s.sendto(b"", sock.getsockname())
            _ready(sock)
            assert fp.run((), 0) == 0
            assert writes() == []
            assert fp.counters()["drop:malformed"] == 1


# -- a member's other processes ------------------------------------------------------------------


@pytest.mark.parametrize("offload", [True, False])
def test_a_members_datagram_from_another_port_than_udp_port_is_dropped(offload):
    """A member's worker sends from the cluster's udp_port, which no unprivileged process of
    that node can bind while the worker holds it: from any other port of a member address a
    datagram is another process (forged inner packets), dropped as non_member."""
    with udp_transport(offload=offload) as (t, c, d):
        t.set_members(frozenset({LOCAL}))
        worker, other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            worker.bind((LOCAL, 0))
            t.port = worker.getsockname()[1]  # (on a node: both ends' udp_port; one port on loopback)
            forged, real = tcp(b"forged", src="10.244.9.9"), tcp(b"real")
            other.sendto(forged, t.sock.getsockname())
            worker.sendto(real, t.sock.getsockname())
            got = Collect()
            for _ in range(2):
                _ready(t.sock)
                t.receive(bytearray(1 << 20), got, 64)
                if got.packets:
                    break
            assert got.packets == [real] and d["non_member"] == 1 and c["rx_packets"] == 1
        finally:
            worker.close()
            other.close()


def test_the_c_udp_loop_drops_a_members_datagram_from_another_port_too():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    worker, other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind((LOCAL, 0))
        worker.bind((LOCAL, 0))
        with c_path("udp", sock, mtu=1472, port=worker.getsockname()[1]) as (fp, writes, _tun):
            fp.set_members({LOCAL})
            forged, real = tcp(b"forged", src="10.244.9.9"), tcp(b"real")
            other.sendto(forged, sock.getsockname())
            worker.sendto(real, sock.getsockname())
            got = []
            for _ in range(2):
                _ready(sock)
                assert fp.run((), 0) == 0
                got += writes()
                if got:
                    break
            assert got == [real] and fp.counters()["drop:non_member"] == 1
    finally:
        for s in (sock, worker, other):
            s.close()


# -- ipip on a jumbo-frame underlay -------------------------------------------------------------


JUMBO_MTU = 8980  # a 9000-byte underlay


def test_the_ipip_receive_slot_holds_an_underlay_packet_of_the_mtu():
    assert ipip_mod.rx_slot(1480) == ipip_mod.RX_SLOT
    assert ipip_mod.rx_slot(JUMBO_MTU) > JUMBO_MTU + 60 and ipip_mod.rx_slot(JUMBO_MTU) % 64 == 0
    assert ipip_mod.rx_slot(65000) > 65060


def _udp_as_raw(monkeypatch):
    """The ipip transport on a UDP socket (a raw one needs root): its payload is what the raw
    socket would read."""
    shim = types.SimpleNamespace(**{k: getattr(socket, k) for k in dir(socket) if not k.startswith("__")})
    shim.socket = lambda family, _type, _proto: socket.socket(family, socket.SOCK_DGRAM, 0)
    monkeypatch.setattr(ipip_mod, "socket", shim)


@pytest.mark.parametrize("offload", [True, False])
def test_the_ipip_worker_takes_packets_of_a_jumbo_frame_mtu(monkeypatch, offload):
    _udp_as_raw(monkeypatch)
    c, d = counters()
    t = ipip_mod.IpipTransport(LOCAL, offload=offload, counters=c, drops=d, mtu=JUMBO_MTU)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        t.set_members(frozenset({LOCAL}))
        t.set_table(NextHopTable(PEER_SUBNETS))
        inner = tcp(b"j" * (JUMBO_MTU - 40))
        s.sendto(P.ipip_encapsulate(inner, LOCAL, LOCAL), t.sock.getsockname())
        _ready(t.sock)
        got = Collect()
        t.receive(bytearray(_RX_BUF), got, 64)
        assert got.packets == [inner], d
        assert c["rx_packets"] == 1 and d["mtu"] == 0 and d["malformed"] == 0
    finally:
        t.close()
        s.close()


def test_the_c_ipip_loop_takes_packets_of_a_jumbo_frame_mtu():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind((LOCAL, 0))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        with c_path("ipip", sock, mtu=JUMBO_MTU) as (fp, writes, tun):
            tun.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            fp.set_members({LOCAL})
            inner = [tcp(bytes([i]) * (JUMBO_MTU - 40 - i)) for i in range(3)]
            for pkt in inner:
                s.sendto(P.ipip_encapsulate(pkt, LOCAL, LOCAL), sock.getsockname())
            _ready(sock)
            assert fp.run((), 0) == 0
            assert writes() == inner
            counters_ = fp.counters()
            assert counters_["drop:malformed"] == 0 and counters_["rx_packets"] == 3
    finally:
        sock.close()
        s.close()


# -- an inner IPv4 header shorter than 20 bytes -------------------------------------------------


def _python_receive(kind: str, offload: bool, datagram: bytes, monkeypatch):
    """What the Python worker's transport hands its coalescer of ``datagram`` from a member,
    and its malformed count."""
    c, d = counters()
    if kind == "ipip":
        _udp_as_raw(monkeypatch)
        t = ipip_mod.IpipTransport(LOCAL, offload=offload, counters=c, drops=d, mtu=1480)
    else:
        t = UdpTransport(LOCAL, 0, offload=offload, counters=c, drops=d)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind((LOCAL, 0))
        if kind == "udp":
            t.port = s.getsockname()[1]  # a member's worker sends from the cluster's udp_port
        t.set_members(frozenset({LOCAL}))
        t.set_table(NextHopTable(PEER_SUBNETS))
        s.sendto(datagram, t.sock.getsockname())
        _ready(t.sock)
        got = Collect()
        t.receive(bytearray(_RX_BUF), got, 64)
        return got.packets, d["malformed"]
    finally:
        t.close()
        s.close()


def _c_receive(kind: str, datagram: bytes):
    """What the C loop writes to the TUN of ``datagram`` from a member, and its malformed count."""
    with _member_sockets() as (sock, s), \
            c_path(kind, sock, mtu=1480 if kind == "ipip" else 1472, port=s.getsockname()[1]) as (fp, writes, _t):
        fp.set_members({LOCAL})
        s.sendto(datagram, sock.getsockname())
        _ready(sock)
        assert fp.run((), 0) == 0
        return writes(), fp.counters()["drop:malformed"]


@pytest.mark.parametrize("ihl", range(6))
@pytest.mark.parametrize("kind", ["udp", "ipip"])
def test_an_inner_ipv4_header_shorter_than_20_bytes_is_malformed_on_every_path(monkeypatch, kind, ihl):
    """An inner IPv4 packet whose IHL says less than 5 words (its total length right): the C
    loop's inner_ok drops it as malformed, and so do the Python workers (udp's inner_packet_ok,
    ipip's _one), with offloads or without; IHL 5 goes through on all of them."""
    inner = bytearray(tcp(b"h" * 100))
    inner[0] = 0x40 | ihl
    inner = bytes(inner)
    datagram = P.ipip_encapsulate(inner, LOCAL, LOCAL) if kind == "ipip" else inner
    want = ([inner], 0) if ihl == 5 else ([], 1)
    assert _c_receive(kind, datagram) == want
    for offload in (True, False):
        assert _python_receive(kind, offload, datagram, monkeypatch) == want, offload


@pytest.mark.parametrize("ihl", [6, 15])
@pytest.mark.parametrize("kind", ["udp", "ipip"])
def test_an_inner_ipv4_header_longer_than_its_packet_is_malformed_on_every_path(monkeypatch, kind, ihl):
    """An inner IPv4 packet of 20 bytes whose IHL says more (its total length right): a header
    past the packet's end, malformed on the C loop (inner_ok) and the Python workers alike."""
    inner = bytearray(tcp(b"")[:20])
    inner[0] = 0x40 | ihl
    inner[2:4] = (20).to_bytes(2, "big")
    inner = bytes(inner)
    datagram = P.ipip_encapsulate(inner, LOCAL, LOCAL) if kind == "ipip" else inner
    assert _c_receive(kind, datagram) == ([], 1)
    for offload in (True, False):
        assert _python_receive(kind, offload, datagram, monkeypatch) == ([], 1), offload


def _short_header_run() -> list[bytes]:
    """Eight segments of one flow; the fourth's IHL is 4 (its header checksum made right for
    20 bytes, so only the IHL is wrong)."""
    run = [bytearray(P.tcp_packet("10.244.1.2", "10.244.2.2", P.TcpHeader(40000, 5201, 1000 + i * 1000, 777,
                                                                          P.TCP_ACK, 502), bytes([i]) * 1000))
           for i in range(8)]
    run[3][0] = 0x44
    run[3][10:12] = b"\0\0"
    run[3][10:12] = P.checksum(bytes(run[3][:20])).to_bytes(2, "big")
    return [bytes(p) for p in run]


def _send_run(kind: str, s: socket.socket, to, run: list[bytes]) -> None:
    """The run as one recvmmsg batch (ipip) or one UDP GRO read (udp: one UDP GSO send)."""
    if kind == "ipip":
        for pkt in run:
            s.sendto(P.ipip_encapsulate(pkt, LOCAL, LOCAL), to)
    else:
        s.sendmsg([b"".join(run)], [(17, 103, struct.pack("=H", len(run[0])))], 0, to)  # UDP_SEGMENT


@pytest.mark.parametrize("kind", ["udp", "ipip"])
def test_an_inner_ipv4_header_shorter_than_20_bytes_in_a_batch_is_malformed_on_every_path(monkeypatch, kind):
    """The same in a batch the Python worker takes in one go (a recvmmsg of ipip packets, a
    UDP GRO read): that packet is counted malformed and the rest written as the C loop writes
    them."""
    run = _short_header_run()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind((LOCAL, 0))
        s.bind((LOCAL, 0))
        sock.setsockopt(17, UDP_GRO, 1)
        with c_path(kind, sock, mtu=1480 if kind == "ipip" else 1472, udp_gro=True,
                    port=s.getsockname()[1]) as (fp, writes, _tun):
            fp.set_members({LOCAL})
            _send_run(kind, s, sock.getsockname(), run)
            _ready(sock)
            assert fp.run((), 0) == 0
            c_writes, c_malformed = writes(), fp.counters()["drop:malformed"]
    finally:
        sock.close()
    c, d = counters()
    if kind == "ipip":
        _udp_as_raw(monkeypatch)
        t = ipip_mod.IpipTransport(LOCAL, offload=True, counters=c, drops=d, mtu=1480)
    else:
        t = UdpTransport(LOCAL, 0, offload=True, counters=c, drops=d)
        t.port = s.getsockname()[1]
    try:
        t.set_members(frozenset({LOCAL}))
        t.set_table(NextHopTable(PEER_SUBNETS))
        _send_run(kind, s, t.sock.getsockname(), run)
        _ready(t.sock)
        py_writes = []
        coalescer = Coalescer(lambda parts: py_writes.append(b"".join(bytes(p) for p in parts)[10:]))
        t.receive(bytearray(_RX_BUF), coalescer, 64)
        assert c["rx_syscalls"] == 1  # one batch
    finally:
        t.close()
        s.close()
    assert (c_malformed, d["malformed"]) == (1, 1)
    assert py_writes == c_writes and run[3] not in c_writes and len(c_writes) >= 2


# -- a member's inner sources: the reverse-path check (NextHopTable.source_ok, _fastpath.c) -------


OTHER = "127.0.0.2"  # another member, holding 10.244.2.0/24
THIS_NODE = "192.168.50.1"  # the receiving node's own underlay address (its TUN takes local sources)
RPF_ROUTES = {**PEER_SUBNETS, "10.244.2.0/24": OTHER, "fd00:10:244:2::/64": OTHER}


def _to_our_pod(src: str, payload: bytes = b"p" * 100, seq: int = 1000) -> bytes:
    if ":" in src:
        return bytes(P.tcp6_packet(src, "fd00:10:244:3::2", P.TcpHeader(40000, 5201, seq, 777, P.TCP_ACK, 502), payload))
    return bytes(P.tcp_packet(src, "10.244.3.2", P.TcpHeader(40000, 5201, seq, 777, P.TCP_ACK, 502), payload))


# From member LOCAL: what routes back to it -- its pods, its TUN's address (its subnet's network
# address: its host's own packets, its node ports' SNAT, its kernel's ICMP errors), its own
# underlay address -- and what does not: another member's pods, this node, anyone else, this
# node's own pods.  (ipip carries IPv4 only.)
KEPT = ["10.244.1.5", "10.244.1.0", LOCAL, "fd00:10:244:1::5"]
SPOOFED = ["10.244.2.7", THIS_NODE, "8.8.8.8", "10.244.3.9", "fd00:10:244:2::7", "fd00:10:244:3::9", "::1"]


def _source(pkt: bytes) -> str:
    return socket.inet_ntop(socket.AF_INET6, pkt[8:24]) if pkt[0] >> 4 == 6 else socket.inet_ntoa(pkt[12:16])


def _rpf_c(kind: str, datagrams: list[bytes], *, gso_run: bool = False) -> tuple[list[bytes], dict]:
    """What the C loop writes to the TUN of ``datagrams`` from member LOCAL (udp: from its
    udp_port; ``gso_run``: as one UDP GSO send, one GRO read here), and its counters."""
    with _member_sockets() as (sock, s):
        sock.setsockopt(17, UDP_GRO, 1)
        with c_path(kind, sock, mtu=1480 if kind == "ipip" else 1472, udp_gro=True,
                    port=s.getsockname()[1]) as (fp, writes, tun):
            tun.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            fp.set_members(parse_members([LOCAL, OTHER]))
            fp.set_routes(NextHopTable(RPF_ROUTES))
            if gso_run:
                _send_run(kind, s, sock.getsockname(), datagrams)
            else:
                for d in datagrams:
                    s.sendto(P.ipip_encapsulate(d, LOCAL, LOCAL) if kind == "ipip" else d, sock.getsockname())
            _ready(sock)
            got = []
            while fp.run((), 0) == 0 and (w := writes()):
                got += w
            return got, fp.counters()


def _rpf_python(kind: str, offload: bool, datagrams: list[bytes], monkeypatch, *,
                gso_run: bool = False) -> tuple[list[bytes], dict, dict, Coalescer]:
    """The same through the Python worker's transport, into a real Coalescer: (TUN writes,
    counters, drops, the coalescer)."""
    c, d = counters()
    if kind == "ipip":
        _udp_as_raw(monkeypatch)
        t = ipip_mod.IpipTransport(LOCAL, offload=offload, counters=c, drops=d, mtu=1480)
    else:
        t = UdpTransport(LOCAL, 0, offload=offload, counters=c, drops=d)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind((LOCAL, 0))
        t.port = s.getsockname()[1]  # (udp: a member's worker sends from the cluster's udp_port)
        t.set_members(parse_members([LOCAL, OTHER]))
        t.set_table(NextHopTable(RPF_ROUTES))
        if gso_run:
            _send_run(kind, s, t.sock.getsockname(), datagrams)
        else:
            for dg in datagrams:
                s.sendto(P.ipip_encapsulate(dg, LOCAL, LOCAL) if kind == "ipip" else dg, t.sock.getsockname())
        writes: list[bytes] = []
        coalescer = Coalescer(lambda parts: writes.append(b"".join(bytes(p) for p in parts)[10:]))
        while select.select([t.sock], [], [], 0.5 if not writes and not any(d.values()) else 0)[0]:
            t.receive(bytearray(_RX_BUF), coalescer, 64)
        return writes, c, d, coalescer
    finally:
        t.close()
        s.close()


@pytest.mark.parametrize("kind", ["udp", "ipip"])
def test_a_members_inner_packet_must_come_from_an_address_that_routes_back_to_it(monkeypatch, kind):
    """Review r2 #1: the receive side wrote any inner source to the TUN -- a member (or anyone
    spoofing its underlay address and port) could pose as another node's pods, or as this node
    itself (accept_local is on for the TUN: host-to-pod traffic, which policies let through,
    reaches any pod).  Now an inner source must lie in a prefix routed to the member that sent
    it, or be that member's own address; the rest is dropped and counted ``spoofed``, by the C
    loop and the Python paths (with offloads and without) alike."""
    sent = [_to_our_pod(src) for src in KEPT + SPOOFED if kind == "udp" or ":" not in src]
    kept = [p for p in sent if _source(p) in KEPT]
    spoofed = len(sent) - len(kept)
    c_writes, c_counters = _rpf_c(kind, sent)
    assert [_source(w) for w in c_writes] == [_source(p) for p in kept], c_counters
    assert c_writes == kept
    assert c_counters["drop:spoofed"] == spoofed and c_counters["rx_packets"] == len(kept)
    for offload in (True, False):
        writes, c, d, _ = _rpf_python(kind, offload, sent, monkeypatch)
        assert writes == kept, (offload, [_source(w) for w in writes])
        assert d["spoofed"] == spoofed and c["rx_packets"] == len(kept) and d["malformed"] == 0, (offload, d)


def _rpf_run(src: str, bad_row: int | None = None, bad_src: str = "10.244.2.7") -> list[bytes]:
    """Eight in-sequence segments of one flow from ``src`` (a UDP GSO run, a recvmmsg batch);
    row ``bad_row`` carries ``bad_src`` instead."""
    return [_to_our_pod(bad_src if i == bad_row else src, bytes([i]) * 1000, 1000 + i * 1000) for i in range(8)]


@pytest.mark.parametrize("kind, src", [("udp", "10.244.1.2"), ("udp", "fd00:10:244:1::2"), ("ipip", "10.244.1.2")])
def test_a_members_batch_from_its_own_subnet_is_still_taken_in_one_go(monkeypatch, kind, src):
    """The batch check costs the vectorized paths nothing they had: a clean run from the
    member's own subnet is still taken whole (one batch, one super-packet), as the C loop
    writes it."""
    run = _rpf_run(src)
    c_writes, c_counters = _rpf_c(kind, run, gso_run=True)
    writes, c, d, coalescer = _rpf_python(kind, True, run, monkeypatch, gso_run=True)
    assert writes == c_writes and len(writes) == 1 and coalescer.batches == 1 and coalescer.merged == 8
    assert c_counters["drop:spoofed"] == d["spoofed"] == 0 and c["rx_packets"] == c_counters["rx_packets"] == 8


@pytest.mark.parametrize("kind, src", [("udp", "10.244.2.7"), ("udp", "fd00:10:244:2::7"), ("ipip", "10.244.2.7"),
                                       ("ipip", THIS_NODE)])
def test_a_batch_of_spoofed_inner_packets_is_dropped_whole(monkeypatch, kind, src):
    """A UDP GRO read / recvmmsg batch (the Python paths check a batch's first source and that
    every row shares it, the C loop every packet) from another member's subnet or this node:
    nothing written, every packet counted."""
    run = _rpf_run(src)
    c_writes, c_counters = _rpf_c(kind, run, gso_run=True)
    writes, c, d, _ = _rpf_python(kind, True, run, monkeypatch, gso_run=True)
    assert c_writes == writes == []
    assert c_counters["drop:spoofed"] == d["spoofed"] == 8 and c["rx_packets"] == c_counters["rx_packets"] == 0


@pytest.mark.parametrize("kind, src, bad", [("udp", "10.244.1.2", "10.244.2.7"), ("udp", "fd00:10:244:1::2", "fd00:10:244:2::7"),
                                            ("ipip", "10.244.1.2", "10.244.2.7"), ("ipip", "10.244.1.2", THIS_NODE)])
def test_one_spoofed_packet_in_a_batch_is_dropped_and_the_rest_merged_as_the_c_loop_does(monkeypatch, kind, src, bad):
    """One row of a member's batch with a source that does not route back to it (another
    member's pod, this node): the Python path's batch check sees two sources and checks packet
    by packet; that one is dropped and counted, the rest written as the C loop writes them."""
    run = _rpf_run(src, bad_row=5, bad_src=bad)
    c_writes, c_counters = _rpf_c(kind, run, gso_run=True)
    writes, c, d, _ = _rpf_python(kind, True, run, monkeypatch, gso_run=True)
    assert writes == c_writes and run[5] not in c_writes and len(c_writes) == 2  # rows 0-4 and 6-7, merged
    assert c_counters["drop:spoofed"] == d["spoofed"] == 1 and c["rx_packets"] == c_counters["rx_packets"] == 7


@pytest.mark.parametrize("kind", ["udp", "ipip"])
def test_the_c_loop_checks_sources_against_the_reverse_path_table_not_the_next_hops(kind):
    """The worker gives the C loop both tables (set_routes(next hops, sources)): a member's
    packet passes by the second alone."""
    pkt = _to_our_pod("10.244.1.5")
    datagram = P.ipip_encapsulate(pkt, LOCAL, LOCAL) if kind == "ipip" else pkt
    for hops, sources, want in (({}, PEER_SUBNETS, [pkt]), (PEER_SUBNETS, {"10.244.2.0/24": OTHER}, [])):
        with _member_sockets() as (sock, s), \
                c_path(kind, sock, mtu=1480, port=s.getsockname()[1]) as (fp, writes, _tun):
            fp.set_members({LOCAL})
            fp.set_routes(NextHopTable(hops), NextHopTable(sources))
            s.sendto(datagram, sock.getsockname())
            _ready(sock)
            assert fp.run((), 0) == 0
            assert writes() == want and fp.counters()["drop:spoofed"] == 1 - len(want)


def test_the_reverse_path_check_follows_the_table_and_remembers_sources():
    t = NextHopTable(RPF_ROUTES)
    local, other = socket.inet_aton(LOCAL), socket.inet_aton(OTHER)
    assert t.source_ok(socket.inet_aton("10.244.1.9"), local) and not t.source_ok(socket.inet_aton("10.244.1.9"), other)
    assert t.source_ok(socket.inet_aton("10.244.2.9"), other) and not t.source_ok(socket.inet_aton("10.244.2.9"), local)
    assert t.source_ok(local, local) and not t.source_ok(local, other)  # a member's own address: its own only
    assert not t.source_ok(socket.inet_aton(THIS_NODE), local) and not t.source_ok(socket.inet_aton(THIS_NODE), other)
    v6 = socket.inet_pton(socket.AF_INET6, "fd00:10:244:2::7")
    assert t.source_ok(v6, other) and not t.source_ok(v6, local)
    assert not NextHopTable().source_ok(socket.inet_aton("10.244.1.9"), local)  # no table: no peer's pods
    for i in range(5000):  # the memo stays bounded
        t.source_ok(i.to_bytes(4, "big"), local)
    assert len(t._source_peer) <= 4096


# -- a refused UDP GSO send ---------------------------------------------------------------------


class _PlainTooBig:
    """The worker's socket with a path MTU below the segments: plain sends fail EMSGSIZE."""

    def __init__(self, sock):
        self._sock = sock

    def sendto(self, *_a):
        raise OSError(errno.EMSGSIZE, "Message too long")

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _gso_sender(t, rx, queued: bool):
    """Send 3 segments of 1000 bytes to ``rx`` as one GSO run (queued and flushed, or sent now)."""
    t.port = rx.getsockname()[1]
    buf = bytearray(1 << 16)
    t.bind_tx_buffer(buf)
    view = memoryview(buf) if queued else memoryview(bytearray(buf))
    t.queue_run(view, 0, 1000, 3, 3000, LOCAL)
    t.flush()


@pytest.mark.parametrize("queued", [True, False])
def test_an_einval_gso_send_whose_plain_sends_fail_too_leaves_gso_on(queued):
    """Kernels before the upstream "return -EMSGSIZE" change refuse a GSO send whose segments
    exceed the path MTU (a lower MTU to one peer) with EINVAL: that message's packets are
    dropped (mtu), GSO stays on for every other peer."""
    with udp_transport(offload=True) as (t, c, d):
        assert t.offloads["udp_gso"]
        t.sock.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)  # the kernel answers the GSO send EINVAL
        t.sock = _PlainTooBig(t.sock)
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            rx.bind((LOCAL, 0))
            _gso_sender(t, rx, queued)
        finally:
            rx.close()
        assert t.offloads["udp_gso"] and "udp_gso" not in t.fallbacks
        assert d["mtu"] == 3 and c["tx_packets"] == 0


@pytest.mark.parametrize("queued", [True, False])
def test_an_einval_gso_send_whose_plain_sends_go_turns_gso_off(queued):
    with udp_transport(offload=True) as (t, c, d):
        t.sock.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)  # GSO refused, plain sends fine
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            rx.bind((LOCAL, 0))
            _gso_sender(t, rx, queued)
            _ready(rx)
            rx.setblocking(False)
            got = []
            with contextlib.suppress(BlockingIOError):
                while True:
                    got.append(len(rx.recv(1 << 16)))
        finally:
            rx.close()
        assert not t.offloads["udp_gso"] and "Invalid argument" in t.fallbacks["udp_gso"]
        assert got == [1000, 1000, 1000] and c["tx_packets"] == 3 and d["mtu"] == 0


@contextlib.contextmanager
def c_gso_sender(sock):
    with c_path("udp", sock, mtu=1472, udp_gso=True, port=8285) as (fp, _writes, tun):
        fp.set_routes(NextHopTable({"10.244.0.0/16": LOCAL}))
        yield fp, tun


def _tso_frame(mss=1000, segments=3):
    sp = tcp(b"s" * (mss * segments))
    hl = 40
    return P.VirtioNetHdr(flags=1, gso_type=1, hdr_len=hl, gso_size=mss, csum_start=20, csum_offset=16).encode() + sp


def test_the_c_loop_leaves_gso_on_when_the_plain_sends_of_an_einval_message_fail_too():
    """As the Python path: EINVAL turns GSO off only if the same segments go out one by one.
    (An AF_UNIX socket answers both sends EINVAL: an IPv4 address is none of its.)"""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        with c_gso_sender(sock) as (fp, tun):
            tun.send(_tso_frame())
            assert fp.run((), 0) == 0
            got = fp.counters()
            assert fp.udp_gso and fp.gso_failed_errno == 0
            assert got["drop:send_error"] == 3 and got["tx_packets"] == 0
    finally:
        sock.close()


def test_the_c_loop_turns_gso_off_when_the_kernel_refuses_it():
    with _member_sockets() as (sock, rx):
        sock.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)
        with c_path("udp", sock, mtu=1472, udp_gso=True, port=rx.getsockname()[1]) as (fp, _w, tun):
            fp.set_routes(NextHopTable({"10.244.0.0/16": LOCAL}))
            tun.send(_tso_frame())
            assert fp.run((), 0) == 0
            assert not fp.udp_gso and fp.gso_failed_errno == errno.EINVAL
            assert fp.counters()["tx_packets"] == 3



# -- ICMP errors are rate-limited (RFC 4443 section 2.4 (f); the kernel's icmp_msgs_per_sec) -------


def test_the_icmp_token_bucket_allows_a_burst_then_the_rate():
    bucket = IcmpRateLimit(rate=1000, burst=50)
    assert [bucket.allow(10.0) for _ in range(51)] == [True] * 50 + [False]
    assert bucket.allow(10.0005) is False  # half a token
    assert bucket.allow(10.001) is True  # one a millisecond
    assert bucket.allow(10.001) is False
    assert sum(bucket.allow(20.0) for _ in range(100)) == 50  # full again, never more than the burst
    assert bucket.allow(19.0) is False  # a clock that goes back adds nothing


def test_the_python_paths_rate_limit_their_icmp_errors():
    """icmp_flood.py's shape on the Python paths: 2000 TTL-1 packets in a row get the burst and
    the rate's share of ICMP errors, the rest are counted icmp_ratelimited."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    b.setblocking(False)
    c, d = counters()
    try:
        t = Transmit(tun_fd=a.fileno(), transport=None, mtu=1472, ttl_decrement=True, icmp_source="192.168.50.1",
                     counters=c, drops=d, families=(4, 6))
        pkt = bytearray(tcp(b"x" * 20))
        pkt[8] = 1
        n, start = 2000, time.monotonic()
        for i in range(n):
            (t.ttl_exceeded if i % 2 else t.no_route)(memoryview(bytes(pkt)))
        elapsed_ms = (time.monotonic() - start) * 1000
        written = 0
        with contextlib.suppress(BlockingIOError):
            while b.recv(1 << 16):
                written += 1
    finally:
        a.close()
        b.close()
    assert written == c["icmp_sent"] <= 50 + elapsed_ms + 1 < n / 4
    assert d["icmp_ratelimited"] == n - c["icmp_sent"]
    assert d["ttl_exceeded"] + d["no_route"] == n


# -- over the path MTU: the source is told (frag needed / packet too big) ---------------------------

# The path MTU over loopback is 65535 (IP_MAX_MTU): an inner packet of 65535 bytes with the 28
# bytes of outer headers is over it (EMSGSIZE), as a packet over a lower path MTU is on a real
# underlay.
_PATH_MTU = 65535


def _big(version: int = 4, df: bool = True) -> bytes:
    if version == 6:
        return bytes(P.ipv6_packet(P.IPv6Header("fd00:10:244:1::2", "fd00:10:244:2::2", 17), bytes(65535 - 40)))
    return bytes(P.ipv4_packet(P.IPv4Header(src="10.244.1.2", dst="10.244.2.2", protocol=17, ttl=64, df=df),
                               bytes(65535 - 20)))


@contextlib.contextmanager
def _transmit_over(transport):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.setblocking(False)
    c, d = counters()
    try:
        t = Transmit(tun_fd=a.fileno(), transport=transport, mtu=65535, ttl_decrement=True,
                     icmp_source="192.168.50.1", counters=c, drops=d, families=(4, 6), icmp_source_v6="fd00::1")

        def written():
            out = []
            with contextlib.suppress(BlockingIOError):
                while True:
                    out.append(b.recv(1 << 17)[10:])
            return out

        yield t, written, c, d
    finally:
        a.close()
        b.close()


def test_a_packet_over_the_path_mtu_gets_its_source_told_on_the_python_paths():
    free = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    free.bind((LOCAL, 0))
    port = free.getsockname()[1]
    free.close()
    uc, ud = counters()
    u = UdpTransport(LOCAL, port, offload=False, counters=uc, drops=ud)  # sends to its own port
    with contextlib.closing(u), _transmit_over(u) as (_t, written, c, _d):
        u.send_one(memoryview(_big()), LOCAL)
        u.send_one(memoryview(_big(df=False)), LOCAL)  # no DF: a router would fragment it; nothing
        u.send_one(memoryview(_big(6)), LOCAL)
        got = written()
        assert ud["mtu"] == 3 and c["icmp_sent"] == 2 and len(got) == 2
        ip, body = P.split_ipv4(got[0])
        h = P.IcmpHeader.decode(body)
        assert (ip.dst, h.type, h.code, h.rest) == ("10.244.1.2", 3, 4, _PATH_MTU - 28)
        assert bytes(body[8:]) == _big()[:28]
        ip6, body6 = P.split_ipv6(got[1])
        assert (ip6.dst, body6[0], body6[1], struct.unpack_from("!I", body6, 4)[0]) == (
            "fd00:10:244:1::2", 2, 0, _PATH_MTU - 28)  # RFC 4443 section 3.2
        assert P.transport_checksum_ok(got[1])


def test_the_c_udp_loop_hands_back_a_packet_over_the_path_mtu():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((LOCAL, 0))
    sock.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER, IP_PMTUDISC_DO (the worker's)
    try:
        with c_path("udp", sock, mtu=65535, port=sock.getsockname()[1]) as (fp, _writes, tun), \
                _transmit_over(types.SimpleNamespace(overhead=28)) as (t, written, _c, _d):
            fp.set_routes(NextHopTable({"10.244.0.0/16": LOCAL}))
            tun.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            tun.send(P.VNET_HDR_NONE + _big(df=False))
            tun.send(P.VNET_HDR_NONE + _big())
            assert fp.run((), 0) == 1
            kind, pkt = fp.slow_packet()
            assert kind == _fast.SLOW_FRAG_NEEDED and fp.slow_peer() == LOCAL and len(pkt) == _fast.SLOW_MAX
            assert pkt[:8] == _big()[:8] and pkt[12 : _fast.SLOW_MAX] == _big()[12 : _fast.SLOW_MAX]  # TTL-1 (udp)
            assert fp.counters()["drop:mtu"] == 2
            t.send_too_big(memoryview(pkt), fp.slow_peer())
            (icmp,) = written()
            h = P.IcmpHeader.decode(P.split_ipv4(icmp)[1])
            assert (h.type, h.code, h.rest) == (3, 4, _PATH_MTU - 28)
            assert fp.run((), 0) == 0
    finally:
        sock.close()


def test_a_packet_over_the_path_mtu_kept_by_a_hand_backs_flush_is_handed_back_with_nothing_more_to_read():
    """The flush before a hand-back (here a TTL of 1) finds the packet queued before it over the
    path MTU: the loop keeps it and hands it back on the next call -- even when the TUN has
    nothing more to read (a TCP sender whose window was all dropped sends nothing until its
    retransmission timeout; a lone DF datagram never would)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((LOCAL, 0))
    sock.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER, IP_PMTUDISC_DO (the worker's)
    expiring = bytes(P.ipv4_packet(P.IPv4Header(src="10.244.1.2", dst="10.244.2.2", protocol=17, ttl=1), bytes(8)))
    try:
        with c_path("udp", sock, mtu=65535, port=sock.getsockname()[1]) as (fp, _writes, tun):
            fp.set_routes(NextHopTable({"10.244.0.0/16": LOCAL}))
            tun.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            tun.send(P.VNET_HDR_NONE + _big())
            tun.send(P.VNET_HDR_NONE + expiring)
            assert fp.run((), 0) == 1
            assert fp.slow_packet()[0] == _fast.SLOW_TIME_EXCEEDED
            assert fp.run((), 0) == 1  # nothing on the TUN: the kept one all the same
            kind, pkt = fp.slow_packet()
            assert kind == _fast.SLOW_FRAG_NEEDED and pkt[:8] == _big()[:8]
            assert fp.run((), 0) == 0
    finally:
        sock.close()


def _cycle_peers(t, peers: int) -> None:
    """Nodes come and go: each a member for a while, sent to (queued and flushed), then gone."""
    buf = bytearray(1 << 16)
    t.bind_tx_buffer(buf)
    for i in range(peers):
        peer = f"127.0.{i // 250}.{i % 250 + 2}"
        t.set_members(frozenset({LOCAL, peer}))
        t.queue_run(memoryview(buf), 0, 100, 1, 100, peer)
        t.flush()
    t.set_members(frozenset({LOCAL}))


def test_the_udp_workers_peer_caches_forget_the_nodes_that_went():
    # Every underlay address ever sent to kept a tuple and a sockaddr_in for the worker's
    # life (455 B a departed node): months of node churn.
    with udp_transport(offload=True) as (t, _c, _d):
        t.port = 9  # (discard: nothing listens, the sends go nowhere)
        _cycle_peers(t, 600)
        assert set(t._names) <= {LOCAL} and set(t._addr_cache) <= {LOCAL}


def test_the_ipip_workers_peer_caches_forget_the_nodes_that_went(monkeypatch):
    _udp_as_raw(monkeypatch)
    c, d = counters()
    t = ipip_mod.IpipTransport(LOCAL, offload=True, counters=c, drops=d, mtu=1480)
    try:
        _cycle_peers(t, 600)
        assert set(t._names) <= {LOCAL} and set(t._name_ptr) <= {LOCAL}
    finally:
        t.close()
