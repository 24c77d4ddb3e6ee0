"""The VXLAN backend's neighbour and FDB entries against a stand-in for the kernel's tables
(no kernel: the netlink requests and dumps of agentd.dataplane.backends are answered by
``FakeNeighbours``): entries the kernel lost are put back at the next re-read, and a peer's
own VNI and UDP port go on its FDB entry.  tests/system/test_dataplane.py checks the same in a
namespace with a real VTEP."""

import asyncio
import dataclasses
import errno
import socket
from ipaddress import IPv4Interface, IPv4Network, ip_address, ip_network

import pytest

from agentd.config.settings import load_config
from agentd.dataplane import backends as backends_mod
from agentd.dataplane.backends import VXLAN_REREAD, Tunnels, _Vxlan
from agentd.datastore.store import NodeRecord
from agentd.kernel import netlink as nl
from agentd.kernel.forwarding import LocalPaths, PeerPlan, desired_routes, plan_peer
from agentd.kernel.netinfo import Underlay
from agentd.kernel.netlink_links import (
    Vxlan,
    decode_vxlan,
    encode_newlink_vxlan,
    vxlan_info_data,
)

CFG = load_config(None, env={}, overrides={"node.address": "10.0.0.3", "node.name": "n3", "network.backend": "vxlan"})
UNDERLAY = Underlay("eth0", 2, IPv4Interface("10.0.0.3/24"), 1500, (IPv4Network("10.0.0.0/24"),))
VTEP_INDEX = 7
PEER = "10.0.0.4"
MAC = "aa:bb:cc:dd:ee:04"


class FakeNeighbours:
    """The kernel's neighbour tables, (family, dst) -> entry, and the VXLAN device's FDB,
    (AF_BRIDGE, MAC) -> entry: the VXLAN driver keys its FDB by MAC, so a replace for a MAC
    another peer's entry has moves that entry to the new remote (vxlan_fdb_update)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, bytes], nl.NeighMessage] = {}
        self.requests: list[tuple[str, nl.NeighMessage]] = []

    @staticmethod
    def key(entry: nl.NeighMessage) -> tuple[int, bytes]:
        return (entry.family, entry.lladdr if entry.family == nl.AF_BRIDGE else entry.dst)

    def fdb(self) -> dict[str, str]:
        """MAC -> remote (its underlay address), as ``bridge fdb show`` has them."""
        return {backends_mod._mac(e.lladdr): socket.inet_ntop(socket.AF_INET6 if len(e.dst) == 16 else socket.AF_INET,
                                                              e.dst)
                for (family, _k), e in self.entries.items() if family == nl.AF_BRIDGE}

    async def neigh_request(self, sock, code: str, entry: nl.NeighMessage, seq: int) -> None:
        self.requests.append((code, entry))
        if code == "replace":
            if entry.family == nl.AF_BRIDGE and (entry.lladdr[0] & 1 or not any(entry.lladdr)):
                raise nl.NetlinkError(errno.EOPNOTSUPP, None, "replace FDB entry")  # vxlan_fdb_update_create
            if entry.family == nl.AF_BRIDGE and len(entry.dst) != 4:
                raise nl.NetlinkError(errno.EAFNOSUPPORT, None, "replace FDB entry")  # an IPv4 VTEP: vxlan_fdb_add
            self.entries[self.key(entry)] = entry
        else:
            have = self.entries.get(self.key(entry))
            # vxlan_fdb_delete: a port and VNI not given are the device's own, and a remote
            # with others is not found (ENOENT): the entry stays.
            if have is not None and (have.port, have.vni) == (entry.port, entry.vni) and (
                    entry.family != nl.AF_BRIDGE or have.dst == entry.dst):
                del self.entries[self.key(entry)]

    def flush(self, family: int) -> None:
        """``ip neigh flush dev agentd.vxlan`` (AF_INET), ``bridge fdb del`` (AF_BRIDGE)."""
        for key in [k for k in self.entries if k[0] == family]:
            del self.entries[key]

    def rtnl(self):
        kernel = self

        class Rtnl:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                pass

            def next_seq(self):
                return 1

            def request(self, message, what):
                family = message[16]  # the dump request's ndmsg family
                out = []
                for entry in kernel.entries.values():
                    if entry.family == family:
                        wire = nl.encode_newneigh(1, nl.NLM_F_MULTI, entry)
                        out.append((nl.RTM_NEWNEIGH, wire, 16, len(wire)))
                return out

        return Rtnl


OWN_MAC = "02:00:00:00:00:03"


@pytest.fixture
def kernel(monkeypatch):
    k = FakeNeighbours()
    # The VTEP as RTM_GETLINK has it (None: there is none).
    k.link = nl.LinkMessage(VTEP_INDEX, "agentd.vxlan", nl.IFF_UP, 1450, bytes.fromhex(OWN_MAC.replace(":", "")), "vxlan")
    monkeypatch.setattr(backends_mod, "_neigh_request", k.neigh_request)
    monkeypatch.setattr(backends_mod, "Rtnl", k.rtnl())
    monkeypatch.setattr(backends_mod, "NetlinkSocket", lambda *a, **kw: type("S", (), {"close": lambda self: None})())
    monkeypatch.setattr(backends_mod, "_link_named", lambda name: k.link)
    return k


def _tunnels_with_vtep(clock: list) -> tuple[Tunnels, _Vxlan]:
    t = Tunnels(CFG, UNDERLAY, "n3")
    vx = _Vxlan(t)
    vx.vtep_ip, vx.index, vx.read_at, vx.mac = "10.244.3.0", VTEP_INDEX, clock[0], OWN_MAC
    t.active["vxlan"] = vx
    return t, vx


def _plan(**backend) -> PeerPlan:
    data = {"type": "vxlan", "vtep_ip": "10.244.4.0", "vtep_mac": MAC, "vni": 1, "vxlan_port": 4789, **backend}
    return PeerPlan(PEER, "vxlan", "test", "n4", data)


def test_entries_the_kernel_lost_are_put_back_at_the_next_re_read(kernel, monkeypatch):
    """``ip link set agentd.vxlan down; up`` flushes even permanent neighbour entries, as does
    ``ip neigh flush``; ``bridge fdb del`` removes the FDB entry.  The routes come back (the
    route programmer re-reads them): the entries must too, or VXLAN traffic goes nowhere."""
    clock = [1000.0]
    monkeypatch.setattr(backends_mod.time, "monotonic", lambda: clock[0])

    async def main():
        t, vx = _tunnels_with_vtep(clock)
        plans = {PEER: _plan()}
        await vx.sync(plans, {}, prune=True)
        assert {k[0] for k in kernel.entries} == {socket.AF_INET, nl.AF_BRIDGE}
        kernel.flush(socket.AF_INET)
        kernel.flush(nl.AF_BRIDGE)
        kernel.requests.clear()
        clock[0] += 2.0
        await t.refresh()
        await vx.sync(plans, {}, prune=True)
        assert kernel.requests == [], "re-read before VXLAN_REREAD"
        clock[0] += VXLAN_REREAD
        await t.refresh()
        assert vx.reread and t._dirty.is_set()
        await vx.sync(plans, {}, prune=True)
        assert sorted(e.family for code, e in kernel.requests if code == "replace") == [socket.AF_INET, nl.AF_BRIDGE]
        assert {k[0] for k in kernel.entries} == {socket.AF_INET, nl.AF_BRIDGE}
        assert not vx.reread and vx.read_at == clock[0]
        kernel.requests.clear()
        await vx.sync(plans, {}, prune=True)  # the next re-read finds them: nothing sent
        assert kernel.requests == []

    asyncio.run(main())


def test_a_record_spelling_its_vtep_non_canonically_is_installed_once(kernel, caplog):
    """A record's VTEP address and MAC in another valid spelling (upper case, a zero group
    written out) are compared with the kernel's entries as the kernel spells them: sent once,
    not again at every sync, and never reported lost at a re-read."""
    async def main():
        _t, vx = _tunnels_with_vtep([0.0])
        vx.vtep_ip_v6 = "fd00:10:244:3::"
        plans = {PEER: _plan(vtep_mac=MAC.upper(), vtep_ip="10.244.4.0",
                             vtep_ip_v6="FD00:10:244:4:0::")}
        await vx.sync(plans, {}, prune=True)
        assert vx.installed[PEER] == (("10.244.4.0", "fd00:10:244:4::"), MAC, None, None)
        kernel.requests.clear()
        await vx.sync(plans, {}, prune=True)
        assert kernel.requests == []
        vx.reread = True  # what the kernel holds, read back (inet_ntop, lower-case MAC)
        with caplog.at_level("WARNING"):
            await vx.sync(plans, {}, prune=True)
        assert kernel.requests == [] and "lost" not in caplog.text
        assert vx.installed[PEER] == (("10.244.4.0", "fd00:10:244:4::"), MAC, None, None)

    asyncio.run(main())


def test_a_vtep_with_another_index_is_re_read_at_once(kernel, monkeypatch):
    """The device deleted and made again (its entries gone with it): no waiting for the timer."""
    clock = [1000.0]
    monkeypatch.setattr(backends_mod.time, "monotonic", lambda: clock[0])

    async def main():
        _t, vx = _tunnels_with_vtep(clock)
        plans = {PEER: _plan()}
        await vx.sync(plans, {}, prune=True)
        kernel.entries.clear()
        kernel.link = dataclasses.replace(kernel.link, index=VTEP_INDEX + 1)
        await vx.sync(plans, {}, prune=True)
        assert {(k[0], e.ifindex) for k, e in kernel.entries.items()} == {(socket.AF_INET, 8), (nl.AF_BRIDGE, 8)}

    asyncio.run(main())


def test_a_peers_own_vni_and_port_go_on_its_fdb_entry(kernel):
    """A peer whose [network] vxlan_vni / vxlan_port differ from ours listens on its port for
    its VNI: our FDB entry toward it carries both (NDA_PORT, NDA_VNI), or its traffic is
    dropped there.  A peer with ours gets neither (the kernel uses the device's)."""
    async def main():
        _t, vx = _tunnels_with_vtep([0.0])
        await vx.sync({PEER: _plan(vni=2, vxlan_port=8472), "10.0.0.5": PeerPlan(
            "10.0.0.5", "vxlan", "test", "n5", {"vtep_ip": "10.244.5.0", "vtep_mac": "aa:bb:cc:dd:ee:05", "vni": 1,
                                                "vxlan_port": 4789})}, {}, prune=True)
        fdb = {socket.inet_ntoa(e.dst): e for (family, _d), e in kernel.entries.items() if family == nl.AF_BRIDGE}
        assert (fdb[PEER].port, fdb[PEER].vni) == (8472, 2)
        assert (fdb["10.0.0.5"].port, fdb["10.0.0.5"].vni) == (None, None)
        assert vx.status()["peers"][PEER]["vni"] == 2 and "vni" not in vx.status()["peers"]["10.0.0.5"]
        # Re-read, the kernel's entries are what was installed: nothing sent again.
        kernel.requests.clear()
        vx.reread = True
        await vx.sync({PEER: _plan(vni=2, vxlan_port=8472)}, {}, prune=False)
        assert kernel.requests == []
        # The peer moves to our port and VNI: its entry is replaced without them.
        await vx.sync({PEER: _plan()}, {}, prune=True)
        assert (kernel.entries[(nl.AF_BRIDGE, bytes.fromhex(MAC.replace(":", "")))].port,
                vx.installed[PEER][2:]) == (None, (None, None))
        # and back; then it leaves: its FDB entry's delete names its port and VNI, or it would stay.
        await vx.sync({PEER: _plan(vni=2, vxlan_port=8472)}, {}, prune=True)
        await vx.sync({}, {}, prune=True)
        assert kernel.entries == {} and vx.installed == {}

    asyncio.run(main())


def test_the_fdb_entrys_port_and_vni_on_the_wire():
    entry = nl.NeighMessage(nl.AF_BRIDGE, 5, nl.NUD_PERMANENT, nl.NTF_SELF, 0, socket.inet_aton("192.0.2.7"),
                            bytes.fromhex("02005e000001"), port=8472, vni=2)
    wire = nl.encode_newneigh(3, nl.NLM_F_REQUEST, entry)
    attrs = {t: wire[s:e] for t, s, e in nl.iter_attrs(wire, 16 + nl.NDMSG_LEN, len(wire))}
    # What iproute2's ``bridge fdb add ... port 8472 vni 2`` sends: the port big-endian, the VNI host order.
    assert attrs[nl.NDA_PORT] == (8472).to_bytes(2, "big") and attrs[nl.NDA_VNI] == (2).to_bytes(4, "little")
    assert nl.decode_neigh(wire, 16) == entry


@pytest.mark.parametrize("bad", [{"vni": "2"}, {"vni": 0}, {"vni": 1 << 24}, {"vni": True},
                                 {"vxlan_port": 0}, {"vxlan_port": 65536}, {"vxlan_port": 8472.0}])
def test_a_peers_bad_vni_or_port_makes_it_unroutable_with_the_reason(bad):
    from ipaddress import ip_address, ip_network

    from agentd.datastore.store import NodeRecord

    peer = NodeRecord(name="n4", address=ip_address(PEER), asn=64512, subnet=ip_network("10.244.4.0/24"),
                      route_reflector=False, cluster_id=None,
                      backend={"type": "vxlan", "vtep_ip": "10.244.4.0", "vtep_mac": MAC, **bad})
    plan = plan_peer(peer, UNDERLAY, own_backend="vxlan", encap="always")
    assert plan.backend == "none" and next(iter(bad)) in plan.reason


# -- review r6: what one peer's record, or the kernel, may do to the VTEP ----------------------

MAC1, MAC2 = "aa:bb:cc:dd:ee:01", "aa:bb:cc:dd:ee:02"


def _node(name: str, addr: str, i: int, **backend) -> NodeRecord:
    return NodeRecord(name=name, address=ip_address(addr), asn=64512, subnet=ip_network(f"10.244.{i}.0/24"),
                      route_reflector=False, cluster_id=None,
                      backend={"type": "vxlan", "vtep_ip": f"10.244.{i}.0", "vni": 1, "vxlan_port": 4789, **backend})


def _routes(nodes):
    bests = [(str(n.subnet), n.address, False) for n in nodes]
    return desired_routes(bests, nodes, UNDERLAY, LocalPaths({"vxlan": "vxlan-device"}), own_subnets=["10.244.3.0/24"],
                          blackhole_metric=4000, own_backend="vxlan", encap="always")


def _neighbour(kernel, vtep_ip: str) -> str | None:
    e = kernel.entries.get((socket.AF_INET, socket.inet_aton(vtep_ip)))
    return backends_mod._mac(e.lladdr) if e is not None else None


def test_a_peer_whose_entries_the_kernel_refuses_leaves_the_other_peers_entries_made(kernel):
    """The kernel takes no FDB entry for a multicast MAC (EOPNOTSUPP) nor a remote of the other
    family than the VTEP's (EAFNOSUPPORT): that peer gets no entries (its neighbour entry, sent
    first, taken away again), is listed as refused, and the peers after it get theirs."""
    async def main():
        _t, vx = _tunnels_with_vtep([0.0])
        plans = {"10.0.0.1": PeerPlan("10.0.0.1", "vxlan", "test", "n1", {"vtep_ip": "10.244.1.0", "vtep_mac": "01:00:5e:00:00:01"}),
                 "fd00::2": PeerPlan("fd00::2", "vxlan", "test", "n2", {"vtep_ip": "10.244.2.0", "vtep_mac": MAC2}),
                 PEER: _plan()}
        await vx.sync(plans, {}, prune=True)
        assert kernel.fdb() == {MAC: PEER} and _neighbour(kernel, "10.244.4.0") == MAC
        assert _neighbour(kernel, "10.244.1.0") is None and _neighbour(kernel, "10.244.2.0") is None
        assert list(vx.installed) == [PEER] and sorted(vx.status()["refused"]) == ["10.0.0.1", "fd00::2"]
        await vx.sync({PEER: _plan()}, {}, prune=True)  # the bad ones gone: no longer listed
        assert "refused" not in vx.status()

    asyncio.run(main())


def test_the_plan_refuses_a_vtep_the_kernel_would_not_take():
    for backend, address, word in (({"vtep_mac": "01:00:5e:00:00:01"}, "10.0.0.1", "unicast"),
                                   ({"vtep_mac": "00:00:00:00:00:00"}, "10.0.0.1", "unicast"),
                                   ({"vtep_mac": MAC1}, None, "IPv4")):
        peer = NodeRecord(name="n1", address=ip_address(address) if address else None,
                          address_v6=None if address else ip_address("fd00::1"), asn=64512,
                          subnet=ip_network("10.244.1.0/24"), route_reflector=False, cluster_id=None,
                          backend={"type": "vxlan", "vtep_ip": "10.244.1.0", "vtep_mac": MAC1, **backend})
        plan = plan_peer(peer, UNDERLAY, own_backend="vxlan", encap="always")
        assert plan.backend == "none" and word in plan.reason, plan.reason


def test_a_failing_backend_sync_does_not_stop_the_bpf_member_filter_sync(kernel, monkeypatch):
    """One backend's sync raising leaves the BPF maps (the member filter a new node must join,
    or its encapsulated packets are dropped) synced all the same; the pass still fails (retried)."""
    async def main():
        t, _vx = _tunnels_with_vtep([0.0])

        class Broken:
            datapath = "vxlan-device"

            async def sync(self, plans, next_hops, prune):
                raise nl.NetlinkError(errno.EOPNOTSUPP, None, "replace FDB entry")

        t.active["vxlan"] = Broken()
        calls = []

        async def bpf_sync(routes, members, flags, prune):
            calls.append(sorted(members))

        monkeypatch.setattr(t.bpf, "sync", bpf_sync)
        t._leftovers_removed = True
        t.apply({PEER: _plan()}, {PEER: ["10.244.4.0/24"]}, {"n4": _node("n4", PEER, 4, vtep_mac=MAC)})
        with pytest.raises(nl.NetlinkError):
            await t._pass()
        assert calls == [["10.0.0.3", PEER]]

    asyncio.run(main())


def test_a_record_naming_another_nodes_vtep_address_is_refused_and_the_victim_keeps_its_entry(kernel):
    """n2's record names n1's VTEP address: the neighbour entry of that address is the kernel's
    by the address alone, so n2's would point n1's pod traffic at n2's MAC.  The VTEP address
    must be the network address of the subnet the node holds (as flannel takes it from the
    lease): n2 planned "none" with the reason, n1's neighbour keeps n1's MAC."""
    n1, n2 = _node("n1", "10.0.0.1", 1, vtep_mac=MAC1), _node("n2", "10.0.0.2", 2, vtep_mac=MAC2, vtep_ip="10.244.1.0")
    plan = _routes([n1, n2])
    assert plan.plans["10.0.0.1"].backend == "vxlan"
    assert plan.plans["10.0.0.2"].backend == "none" and "10.244.2.0" in plan.plans["10.0.0.2"].reason
    assert [r.dst for r in plan.routes if r.kind != "blackhole"] == ["10.244.1.0/24"]

    async def main():
        _t, vx = _tunnels_with_vtep([0.0])
        await vx.sync(plan.plans, plan.next_hops, prune=True)
        assert _neighbour(kernel, "10.244.1.0") == MAC1 and kernel.fdb() == {MAC1: "10.0.0.1"}

    asyncio.run(main())
    # Two records naming the same subnet (and so the same VTEP address): neither's.
    twin = _node("n2", "10.0.0.2", 1, vtep_mac=MAC2)
    plan = _routes([n1, twin])
    assert [plan.plans[a].backend for a in ("10.0.0.1", "10.0.0.2")] == ["none", "none"]


def test_a_record_naming_another_nodes_vtep_mac_is_refused_and_that_nodes_fdb_entry_stays(kernel):
    """The VXLAN FDB is keyed by MAC: a record publishing n1's MAC would have our replace move
    n1's FDB entry to n2's underlay address (n1's traffic to n2), and n2's prune delete it.  A
    MAC two records publish is neither's (each plan names both); nor is one equal to our own."""
    n1 = _node("n1", "10.0.0.1", 1, vtep_mac=MAC1)

    async def main():
        _t, vx = _tunnels_with_vtep([0.0])
        plan = _routes([n1])
        await vx.sync(plan.plans, plan.next_hops, prune=True)
        assert kernel.fdb() == {MAC1: "10.0.0.1"}
        plan = _routes([n1, _node("n2", "10.0.0.2", 2, vtep_mac=MAC1.upper())])
        for addr in ("10.0.0.1", "10.0.0.2"):
            assert plan.plans[addr].backend == "none" and "n1, n2" in plan.plans[addr].reason
        await vx.sync(plan.plans, plan.next_hops, prune=False)  # (a restart's: nothing removed)
        assert kernel.fdb() == {MAC1: "10.0.0.1"}
        # Our own MAC in a peer's record: our FDB entry would send our own frames to it.
        kernel.entries.clear()
        vx.installed.clear()
        await vx.sync({PEER: _plan(vtep_mac=OWN_MAC)}, {}, prune=True)
        assert kernel.fdb() == {} and "this node's own" in vx.status()["refused"][PEER]

    asyncio.run(main())


def test_a_neighbour_entry_a_re_addressed_peer_still_uses_stays(kernel):
    """A peer re-addressed (its VTEP address and MAC kept): the old peer's FDB entry goes at the
    prune, but not the neighbour entry of the VTEP address the new one uses (the kernel's by
    address alone: deleting the old peer's would delete the new one's)."""
    async def main():
        _t, vx = _tunnels_with_vtep([0.0])
        await vx.sync({"10.0.0.9": _plan()}, {}, prune=True)
        await vx.sync({PEER: _plan()}, {}, prune=False)
        assert _neighbour(kernel, "10.244.4.0") == MAC and kernel.fdb() == {MAC: PEER}
        await vx.sync({PEER: _plan()}, {}, prune=True)
        assert _neighbour(kernel, "10.244.4.0") == MAC and kernel.fdb() == {MAC: PEER}
        assert list(vx.installed) == [PEER]

    asyncio.run(main())


def test_the_vtep_is_made_with_a_stable_locally_administered_unicast_mac():
    """Given at creation (IFLA_ADDRESS), the kernel marks the MAC set, not random: systemd's
    MACAddressPolicy=persistent leaves it alone (flannel #1155)."""
    mac = backends_mod.vtep_mac("n3", 1)
    assert len(mac) == 6 and mac[0] & 0x02 and not mac[0] & 0x01
    assert mac == backends_mod.vtep_mac("n3", 1) != backends_mod.vtep_mac("n4", 1) != backends_mod.vtep_mac("n4", 2)
    wire = encode_newlink_vxlan(1, "agentd.vxlan", Vxlan(1, 4789, bytes(4), 2, address=mac))
    attrs = {t: wire[s:e] for t, s, e in nl.iter_attrs(wire, 16 + 16, len(wire))}
    assert attrs[nl.IFLA_ADDRESS] == mac
    wire = encode_newlink_vxlan(1, "agentd.vxlan", Vxlan(1, 4789, bytes(4), 2))
    assert nl.IFLA_ADDRESS not in {t for t, _s, _e in nl.iter_attrs(wire, 16 + 16, len(wire))}


def test_a_vtep_mac_changed_behind_our_back_is_published(kernel):
    """The device's MAC changed after we published it (systemd-udev rewrote a random one, ``ip
    link set address``): the next sync (the periodic re-read's) publishes the new one."""
    published = []

    async def main():
        t, vx = _tunnels_with_vtep([0.0])
        t.on_node_data = lambda: published.append(t.node_data()["vtep_mac"])
        await vx.sync({PEER: _plan()}, {}, prune=True)
        assert published == []
        kernel.link = dataclasses.replace(kernel.link, address=bytes.fromhex("020000000099"))
        await vx.sync({PEER: _plan()}, {}, prune=True)
        assert vx.data()["vtep_mac"] == "02:00:00:00:00:99" and published == ["02:00:00:00:00:99"]

    asyncio.run(main())


def test_a_vtep_deleted_or_set_down_is_brought_back_or_reported(kernel, monkeypatch):
    """``ip link del agentd.vxlan`` (a network restart, its underlay device removed) or ``ip link
    set down`` while the agent runs: brought back as at start (its MAC republished, routes
    recomputed: the kernel took those through it away); while that fails, /healthz's problems
    name it and it is tried again with back-off."""
    clock = [1000.0]
    monkeypatch.setattr(backends_mod.time, "monotonic", lambda: clock[0])
    ups, calls = [], []

    async def main():
        t, vx = _tunnels_with_vtep(clock)
        t.subnet = IPv4Network("10.244.3.0/24")
        t.on_node_data, t.on_paths = (lambda: calls.append("node data")), (lambda: calls.append("paths"))
        up = dataclasses.replace(kernel.link)

        def _up(subnet):
            ups.append(subnet)
            if fail:
                raise nl.NetlinkError(errno.ENODEV, None, "creating vxlan device agentd.vxlan")
            kernel.link = up

        monkeypatch.setattr(vx, "_up", _up)
        for gone in (None, dataclasses.replace(kernel.link, flags=0)):
            fail = False
            kernel.link, ups[:], calls[:] = gone, [], []
            await vx.sync({PEER: _plan()}, {}, prune=True)
            assert ups == [t.subnet] and calls == ["node data", "paths"] and kernel.fdb() == {MAC: PEER}
            assert t.problems() == []
        fail = True
        kernel.link, ups[:] = None, []
        await vx.sync({PEER: _plan()}, {}, prune=True)
        assert len(ups) == 1 and "agentd.vxlan is gone" in t.problems()[0] and vx.status()["error"]
        clock[0] += 1.0
        await vx.sync({PEER: _plan()}, {}, prune=True)
        assert len(ups) == 1  # backing off
        clock[0] += backends_mod.RETRY_FIRST
        await t.refresh()
        assert t._dirty.is_set()
        fail = False
        await vx.sync({PEER: _plan()}, {}, prune=True)
        assert len(ups) == 2 and t.problems() == [] and kernel.fdb() == {MAC: PEER}

    asyncio.run(main())


class _LinkRtnl:
    """Just enough of Rtnl for _Vxlan._up: one device, what was asked of it."""

    def __init__(self, link):
        self.have, self.calls = link, []

    def __call__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def link(self, name):
        return self.have

    def delete_link(self, index):
        self.calls.append(("delete", index))
        self.have = None

    def create_vxlan(self, name, vxlan):
        self.calls.append(("create", vxlan))
        self.have = nl.LinkMessage(9, name, 0, 1500, vxlan.address, "vxlan", None, vxlan_info_data(vxlan))

    def set_link(self, index, **kw):
        self.calls.append(("set", index))

    def next_seq(self):
        return 1

    def request(self, message, what):
        return []

    def addresses(self, index, family):
        return []

    def add_address(self, index, addr, plen):
        pass


def test_a_previous_runs_vtep_with_learning_on_is_replaced(monkeypatch):
    """Adopted only with the settings this run would make it with: learning on would let any
    sender of VXLAN rewrite the FDB (the docs say: no learning)."""
    t = Tunnels(CFG, UNDERLAY, "n3")
    t.subnets = {4: IPv4Network("10.244.3.0/24")}
    ours = Vxlan(CFG.network.vxlan_vni, CFG.network.vxlan_port, UNDERLAY.interface.ip.packed, UNDERLAY.ifindex)
    for learning, replaced in ((False, False), (True, True)):
        rt = _LinkRtnl(nl.LinkMessage(5, "agentd.vxlan", 0, 1450, bytes(6), "vxlan", None,
                                      vxlan_info_data(ours._replace(learning=learning))))
        monkeypatch.setattr(backends_mod, "Rtnl", rt)
        _Vxlan(t)._up(t.subnets[4])
        assert (("delete", 5) in rt.calls) == replaced
    made = next(v for what, v in rt.calls if what == "create")
    assert not decode_vxlan(vxlan_info_data(made)).learning and made.address == backends_mod.vtep_mac("n3", made.vni)
