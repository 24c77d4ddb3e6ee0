"""The member maps (agentd_peers, agentd_peers6): every node of the largest cluster the docs
plan for fits (65,536: an IPv6 /48 of /64 node subnets), a map that is full all the same keeps
what fits and says so once instead of failing every sync, and a member map of an older
agent's size is replaced with its members carried over before the new programs run.  The
maps are modelled as the kernel's hash maps behave (a new key past ``max_entries`` is E2BIG),
their sizes read from the object file (opened, not loaded)."""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct

import pytest

from agentd.dataplane.bpf import OBJECT, datapath, layout, libbpf


class _Map:
    """A BPF hash map of ``size`` entries, as the kernel's: a new key beyond that is E2BIG."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: dict[bytes, bytes] = {}


class _Kernel:
    """The member maps by fd (3: agentd_peers, 4: agentd_peers6)."""

    def __init__(self, monkeypatch, sizes: dict[int, int]) -> None:
        self.maps = {fd: _Map(size) for fd, size in sizes.items()}
        monkeypatch.setattr(datapath.lb, "map_update", self.update)
        monkeypatch.setattr(datapath.lb, "map_lookup", lambda fd, key, size: self.maps[fd].entries.get(key))
        monkeypatch.setattr(datapath.lb, "map_delete", lambda fd, key: self.maps[fd].entries.pop(key, None) is not None)
        monkeypatch.setattr(datapath.lb, "map_keys", lambda fd, size: list(self.maps[fd].entries))

    def update(self, fd, key, value, flags=0):
        m = self.maps[fd]
        if flags == libbpf.BPF_NOEXIST and key in m.entries:
            raise libbpf.BpfError(errno.EEXIST, "map update")
        if key not in m.entries and len(m.entries) >= m.size:
            raise libbpf.BpfError(errno.E2BIG, "map update")
        m.entries[key] = value


@pytest.fixture(scope="module")
def sizes():
    assert OBJECT.exists(), f"{OBJECT} is not built: run scripts/dev setup"
    with libbpf.BpfObject(OBJECT) as obj:
        return {name: obj.maps[name].max_entries for name in (layout.PEERS, layout.PEERS6, layout.ROUTES)}


def _dp(ncpus: int = 2) -> datapath.BpfDatapath:
    dp = datapath.BpfDatapath(1, "/nonexistent")
    dp.ncpus = ncpus
    dp.maps = {layout.PEERS: 3, layout.PEERS6: 4}
    return dp


def _v4(i: int) -> str:
    return socket.inet_ntoa((0x0A000000 + i).to_bytes(4, "big"))


def _v6(i: int) -> str:
    return f"fd00:1::{i >> 16:x}:{i & 0xFFFF:x}"


def test_the_member_maps_hold_the_largest_cluster_the_docs_plan_for(sizes):
    # As many nodes as the IPv6 pod network's /64s in its /48 (docs/networking.md), and no
    # fewer than the routes trie's pod subnets.
    assert sizes[layout.PEERS] == sizes[layout.PEERS6] == layout.MEMBERS_MAX == 65536
    assert sizes[layout.PEERS] >= sizes[layout.ROUTES]


@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_every_node_of_a_5000_node_cluster_is_a_member(monkeypatch, sizes, family):
    kernel = _Kernel(monkeypatch, {3: sizes[layout.PEERS], 4: sizes[layout.PEERS6]})
    dp = _dp()
    addr = _v4 if family == "ipv4" else _v6
    members = {addr(i) for i in range(1, 5001)}  # Kubernetes' largest supported cluster
    dp.set_members(members)
    fd = 3 if family == "ipv4" else 4
    assert len(kernel.maps[fd].entries) == 5000 and dp.members == members
    assert dp.status()["members_refused"] == 0


def test_a_full_member_map_keeps_what_fits_and_says_so_once(monkeypatch, caplog):
    kernel = _Kernel(monkeypatch, {3: 100, 4: 100})
    dp = _dp()
    members = {_v4(i) for i in range(1, 151)}
    with caplog.at_level(logging.INFO, "agentd.bpf"):
        dp.set_members(members)  # no exception: the sync loop goes on with the rest
        dp.set_members(members)  # still full: not logged again
    assert len(kernel.maps[3].entries) == 100 and len(dp.members) == 100
    assert dp.status()["members_refused"] == 50
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "at most 65536 nodes" in lines[0] and "50 cluster members are left out" in lines[0], lines
    # Nodes leave: those left out get in (members that go are taken out first).
    caplog.clear()
    fewer = set(sorted(members)[50:])
    with caplog.at_level(logging.INFO, "agentd.bpf"):
        dp.set_members(fewer)
    assert dp.members == fewer and {socket.inet_ntoa(k) for k in kernel.maps[3].entries} == fewer
    assert dp.status()["members_refused"] == 0
    assert [r.getMessage() for r in caplog.records] == ["BPF: every cluster member is in the member maps again"]


def test_an_older_member_map_is_replaced_with_its_members(monkeypatch):
    # An older agent's agentd_peers (4,096 entries: another shape), its members and a flag.
    kernel = _Kernel(monkeypatch, {3: 65536, 4: 65536, 13: 4096, 14: 4096})
    slot = (layout.PEER_STATS.size + 7) & ~7
    old = kernel.maps[13].entries
    for i in range(1, 4097):
        flags = layout.PEER_F_UDP_TO_WORKER if i == 7 else 0
        old[layout.peer_key(_v4(i))] = layout.PEER_STATS.pack(flags, 5, 500, 6, 600) * 2
    kernel.maps[14].entries[socket.inet_pton(socket.AF_INET6, _v6(9))] = layout.PEER6_VALUE.pack(1)
    dp = _dp()
    info = {"key_size": 4, "value_size": layout.PEER_STATS.size, "max_entries": 4096}
    dp._replacing(layout.PEERS, 13, info)
    dp._replacing(layout.PEERS6, 14, {"key_size": 16, "value_size": 4, "max_entries": 4096})
    dp._replacing(layout.ROUTES, 15, {"key_size": 8, "value_size": 8, "max_entries": 16384})  # not ours to carry
    dp._carry_members()  # after the load, before the programs go on the device
    new = kernel.maps[3].entries
    assert {socket.inet_ntoa(k) for k in new} == {_v4(i) for i in range(1, 4097)}
    assert struct.unpack_from("<Q", new[layout.peer_key(_v4(7))], slot)[0] == layout.PEER_F_UDP_TO_WORKER
    assert layout.sum_percpu(new[layout.peer_key(_v4(8))], layout.PEER_STATS) == (0, 0, 0, 0, 0)
    assert list(kernel.maps[4].entries) == [socket.inet_pton(socket.AF_INET6, _v6(9))]


class _Shape:
    pinned = True

    def __init__(self, shape: tuple) -> None:
        self._shape = shape

    def shape(self) -> tuple:
        return self._shape


def test_an_upgrade_over_older_member_maps_has_their_members_in_the_new_ones_before_the_first_attach(
        monkeypatch, tmp_path):
    # BpfDatapath.open over an older agent's agentd_peers and agentd_peers6 (4,096 entries):
    # the new programs must not go on the device with empty member maps (every member's packets
    # dropped until the first sync).  Pins are files, their maps kept by inode; the maps the
    # load makes are known by name.
    dp = datapath.BpfDatapath(1, tmp_path / "bpf")
    dp.dir.mkdir(parents=True)
    pinned: dict[int, tuple[dict, dict[bytes, bytes]]] = {}
    new: dict[str, dict[bytes, bytes]] = {}

    def entries(fd):
        return new.setdefault(fd, {}) if isinstance(fd, str) else pinned[os.fstat(fd).st_ino][1]

    def obj_get(path):
        if not os.path.isfile(path):
            raise libbpf.BpfError(errno.ENOENT, f"bpf_obj_get {path}")
        return os.open(path, os.O_RDONLY)

    def update(fd, key, value, flags=0):
        if flags == libbpf.BPF_NOEXIST and key in entries(fd):
            raise libbpf.BpfError(errno.EEXIST, "map update")
        entries(fd)[key] = value

    def pin_old(name, key_size, value_size, old):
        path = dp.dir / name
        path.write_text("a pinned map")
        pinned[os.stat(path).st_ino] = ({"type": libbpf.MAP_TYPE_HASH, "key_size": key_size, "value_size": value_size,
                                         "max_entries": 4096, "flags": 0}, old)

    slot = (layout.PEER_STATS.size + 7) & ~7
    pin_old(layout.PEERS, 4, layout.PEER_STATS.size,
            {layout.peer_key(_v4(i)): layout.PEER_STATS.pack(layout.PEER_F_UDP_TO_WORKER if i == 7 else 0, 5, 500, 6, 600)
             .ljust(slot, b"\0") * 2 for i in range(1, 9)})
    pin_old(layout.PEERS6, 16, 4, {socket.inet_pton(socket.AF_INET6, _v6(9)): layout.PEER6_VALUE.pack(1)})

    class Obj:
        def __init__(self):
            self.maps = {name: _Shape((libbpf.MAP_TYPE_HASH, 4, 8, 65536, 0)) for name in layout.MAPS}

        def pin_maps_in(self, _directory): pass
        def load(self): pass
        def map_fd(self, name): return name
        def prog_fd(self, _name): return 7
        def close(self): pass

    at_attach = []

    def attach(_ifindex, direction, _fd, name, _hook, _pins, last=False):
        at_attach.append((name, {k: dict(v) for k, v in new.items()}))
        return []

    for name, value in (("resolve_hook", lambda _attach: "tcx"), ("open_checked", lambda _path, _check: Obj()),
                        ("ensure_dir", lambda *_args: None), ("pin", lambda *_args: None),
                        ("gateway_neighbours", lambda _ifindex: [])):
        monkeypatch.setattr(datapath, name, value)
    monkeypatch.setattr(datapath.tc, "sweep", lambda _pins: 0)
    monkeypatch.setattr(datapath.tc, "attach", attach)
    for name, value in (("possible_cpus", lambda: 2), ("obj_get", obj_get),
                        ("map_info", lambda fd: pinned[os.fstat(fd).st_ino][0]),
                        ("map_keys", lambda fd, _size: list(entries(fd))),
                        ("map_lookup", lambda fd, key, _size: entries(fd).get(key)),
                        ("map_update", update), ("prog_info", lambda _fd: {"id": 1})):
        monkeypatch.setattr(datapath.lb, name, value)
    dp.open(layout.Config("192.0.2.1", 4790, 4789, 0, 1450))
    assert [name for name, _maps in at_attach] == list(layout.PROGRAMS)
    first = at_attach[0][1]
    assert {socket.inet_ntoa(k) for k in first.get(layout.PEERS, {})} == {_v4(i) for i in range(1, 9)}
    assert struct.unpack_from("<Q", first[layout.PEERS][layout.peer_key(_v4(7))], slot)[0] == layout.PEER_F_UDP_TO_WORKER
    assert struct.unpack_from("<Q", first[layout.PEERS][layout.peer_key(_v4(8))])[0] == 0
    assert list(first.get(layout.PEERS6, {})) == [socket.inet_pton(socket.AF_INET6, _v6(9))]
    assert not (dp.dir / layout.PEERS).exists()  # replaced: the load makes it afresh
