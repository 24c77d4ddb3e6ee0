"""The VXLAN backend's neighbour and FDB entries against a stand-in for the kernel's tables
(no kernel: the netlink requests and dumps of agentd.dataplane.backends are answered by
``FakeNeighbours``): entries the kernel lost are put back at the next re-read, and a peer's
own VNI and UDP port go on its FDB entry.  tests/system/test_dataplane.py checks the same in a
namespace with a real VTEP."""

import asyncio
import socket
from ipaddress import IPv4Interface, IPv4Network

import pytest

from agentd.config.settings import load_config
from agentd.dataplane import backends as backends_mod
from agentd.dataplane.backends import VXLAN_REREAD, Tunnels, _Vxlan
from agentd.kernel import netlink as nl
from agentd.kernel.forwarding import PeerPlan, plan_peer
from agentd.kernel.netinfo import Underlay

CFG = load_config(None, env={}, overrides={"node.address": "10.0.0.3", "node.name": "n3", "network.backend": "vxlan"})
UNDERLAY = Underlay("eth0", 2, IPv4Interface("10.0.0.3/24"), 1500, (IPv4Network("10.0.0.0/24"),))
VTEP_INDEX = 7
PEER = "10.0.0.4"
MAC = "aa:bb:cc:dd:ee:04"


class FakeNeighbours:
    """The kernel's neighbour tables and the VXLAN device's FDB: (family, dst) -> entry."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, bytes], nl.NeighMessage] = {}
        self.requests: list[tuple[str, nl.NeighMessage]] = []

    async def neigh_request(self, sock, code: str, entry: nl.NeighMessage, seq: int) -> None:
        self.requests.append((code, entry))
        if code == "replace":
            self.entries[(entry.family, entry.dst)] = entry
        else:
            have = self.entries.get((entry.family, entry.dst))
            # vxlan_fdb_delete: a port and VNI not given are the device's own, and a remote
            # with others is not found (ENOENT): the entry stays.
            if have is not None and (have.port, have.vni) == (entry.port, entry.vni):
                del self.entries[(entry.family, entry.dst)]

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


@pytest.fixture
def kernel(monkeypatch):
    k = FakeNeighbours()
    monkeypatch.setattr(backends_mod, "_neigh_request", k.neigh_request)
    monkeypatch.setattr(backends_mod, "Rtnl", k.rtnl())
    monkeypatch.setattr(backends_mod, "NetlinkSocket", lambda *a, **kw: type("S", (), {"close": lambda self: None})())
    monkeypatch.setattr(backends_mod.socket, "if_nametoindex", lambda name: VTEP_INDEX)
    return k


def _tunnels_with_vtep(clock: list) -> tuple[Tunnels, _Vxlan]:
    t = Tunnels(CFG, UNDERLAY, "n3")
    vx = _Vxlan(t)
    vx.vtep_ip, vx.index, vx.read_at = "10.244.3.0", VTEP_INDEX, clock[0]
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


def test_a_vtep_with_another_index_is_re_read_at_once(kernel, monkeypatch):
    """The device deleted and made again (its entries gone with it): no waiting for the timer."""
    clock = [1000.0]
    monkeypatch.setattr(backends_mod.time, "monotonic", lambda: clock[0])

    async def main():
        _t, vx = _tunnels_with_vtep(clock)
        plans = {PEER: _plan()}
        await vx.sync(plans, {}, prune=True)
        kernel.entries.clear()
        monkeypatch.setattr(backends_mod.socket, "if_nametoindex", lambda name: VTEP_INDEX + 1)
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
        assert (kernel.entries[(nl.AF_BRIDGE, socket.inet_aton(PEER))].port, vx.installed[PEER][2:]) == (None, (None, None))
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
