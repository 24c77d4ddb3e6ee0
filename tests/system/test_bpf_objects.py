"""The shipped BPF objects are standard libbpf objects: ``bpftool prog loadall`` loads every
program of each (in a bpffs of its own, in a mount namespace made for it and gone with it),
the maps it pins by name have the shapes layout.py and podpath.py expect, and an object loaded
through the agent's libbpf binding has them too, as the kernel reports them.  A pin of another
shape is replaced, not reused; one of the same shape is reused with its contents."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from ipaddress import IPv4Network

import pytest

from agentd.dataplane.bpf import OBJECT, layout, libbpf, podpath
from agentd.dataplane.bpf.datapath import adopt_pins
from agentd.lab.twohosts import wait_for

pytestmark = pytest.mark.timeout(60)

# What each shipped object must give the kernel: its programs, and its maps' shapes
# (type, key size, value size, flags), max_entries where the Python side counts on it.
SHAPES = {
    OBJECT: ({name: (*shape, None) for name, shape in layout.EXPECTED.items()} | {
        layout.DROPS: (*layout.EXPECTED[layout.DROPS], len(layout.DROP_REASONS))}, set(layout.PROGRAMS)),
    podpath.OBJECT: ({name: (mtype, key, value, 0, len(podpath.VERDICTS) if name == podpath.STATS else None)
                      for name, (mtype, key, value) in podpath.EXPECTED.items()},
                     {podpath.PROGRAM, podpath.WIRE_PROGRAM}),
}
MAP_TYPES = {"hash": libbpf.MAP_TYPE_HASH, "array": libbpf.MAP_TYPE_ARRAY, "percpu_hash": libbpf.MAP_TYPE_PERCPU_HASH,
             "percpu_array": libbpf.MAP_TYPE_PERCPU_ARRAY, "lpm_trie": libbpf.MAP_TYPE_LPM_TRIE,
             "lru_hash": libbpf.MAP_TYPE_LRU_HASH,
             "ringbuf": libbpf.MAP_TYPE_RINGBUF}

# Runs in a new mount namespace (unshare -m, private propagation): a bpffs of its own on
# /sys/fs/bpf, where libbpf's default pin root for maps pinned by name is, then bpftool.
# The namespace, the mount and its pins end with the script.
LOADALL = """
set -eu
mount -t bpf bpf /sys/fs/bpf
bpftool prog loadall "$1" /sys/fs/bpf/progs
for p in /sys/fs/bpf/progs/*; do printf 'prog '; bpftool -j prog show pinned "$p"; done
for m in /sys/fs/bpf/agentd_*; do printf 'map '; bpftool -j map show pinned "$m"; done
"""


def live_ids(kind: str) -> set[int]:
    out = subprocess.run(["bpftool", "-j", kind, "show"], capture_output=True, text=True, check=True).stdout
    return {x["id"] for x in json.loads(out or "[]")}


@pytest.mark.parametrize("obj", list(SHAPES), ids=lambda p: p.name)
def test_bpftool_loads_every_shipped_object(obj):
    assert obj.exists(), f"{obj} is not built: run scripts/dev setup"
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", LOADALL, "loadall", str(obj)],
                          capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shown: dict[str, list[dict]] = {"prog": [], "map": []}
    for line in proc.stdout.splitlines():
        kind, _, text = line.partition(" ")
        shown[kind].append(json.loads(text))
    maps, programs = SHAPES[obj]
    assert {p["name"] for p in shown["prog"]} == programs
    assert all(p["type"] == "sched_cls" for p in shown["prog"])
    got = {m["name"]: m for m in shown["map"]}
    assert set(got) == set(maps)
    for name, (mtype, key, value, flags, entries) in maps.items():
        m = got[name]
        assert (MAP_TYPES[m["type"]], m["bytes_key"], m["bytes_value"], m["flags"]) == (mtype, key, value, flags), m
        assert entries is None or m["max_entries"] == entries
    # The namespace went with the script, the bpffs with it, and the programs with their pins.
    ids = {p["id"] for p in shown["prog"]}
    assert wait_for(lambda: ids.isdisjoint(live_ids("prog")), 10)
    assert not os.path.exists("/sys/fs/bpf/progs") and not os.path.exists(f"/sys/fs/bpf/{next(iter(maps))}")


@pytest.mark.parametrize("obj", list(SHAPES), ids=lambda p: p.name)
def test_a_libbpf_loaded_object_passes_the_layout_checks(obj, bpffs):
    """Loaded as the agent loads it (kfuncs and CO-RE of the pod fast path resolved against
    this kernel): what the kernel holds is what the Python side reads."""
    maps, programs = SHAPES[obj]
    with libbpf.BpfObject(obj) as o:
        (layout.check(o.maps, o.programs) if obj == OBJECT else podpath.check(o))
        assert adopt_pins(o, bpffs) == []  # nothing pinned there yet
        o.load()
        for name, (mtype, key, value, flags, entries) in maps.items():
            info = libbpf.map_info(o.map_fd(name))
            assert (info["type"], info["key_size"], info["value_size"], info["flags"]) == (mtype, key, value, flags)
            assert entries is None or info["max_entries"] == entries
            assert info["name"] == name and os.path.exists(os.path.join(bpffs, name))  # pinned by name
        for name in programs:
            info = libbpf.prog_info(o.prog_fd(name))
            assert info["type"] == libbpf.PROG_TYPE_SCHED_CLS and info["name"] == name
    for name in maps:
        os.unlink(os.path.join(bpffs, name))


def test_a_pin_of_another_shape_is_replaced_and_one_of_the_same_shape_reused(bpffs):
    peers = os.path.join(bpffs, layout.PEERS)
    # An older agent's peers map, with another value size: libbpf alone refuses to load over it.
    subprocess.run(["bpftool", "map", "create", peers, "type", "percpu_hash", "key", "4", "value", "8",
                    "entries", "16", "name", layout.PEERS], check=True)
    # An agent before libbpf left its ports map (no BTF, the same shape), holding an entry.
    ports = os.path.join(bpffs, layout.PORTS)
    subprocess.run(["bpftool", "map", "create", ports, "type", "hash", "key", str(layout.PORT_KEY.size), "value",
                    str(layout.PORT_VALUE.size), "entries", "4096", "name", layout.PORTS], check=True)
    port_key = layout.PORT_KEY.pack(7, b"\x02\x00\x00\x00\x00\x09")
    fd = libbpf.obj_get(ports)
    libbpf.map_update(fd, port_key, layout.PORT_VALUE.pack(12))
    os.close(fd)
    with libbpf.BpfObject(OBJECT) as plain:
        plain.pin_maps_in(bpffs)
        with pytest.raises(libbpf.BpfError, match="loading datapath.bpf.o"):
            plain.load()
    assert os.path.exists(peers) and not os.path.exists(os.path.join(bpffs, layout.ROUTES))  # nothing left half-made
    key = layout.route_key(IPv4Network("10.244.7.0/24"))
    with libbpf.BpfObject(OBJECT) as first:
        assert adopt_pins(first, bpffs) == [layout.PORTS]  # the other shape is not adopted: removed
        first.load()
        assert libbpf.map_lookup(first.map_fd(layout.PORTS), port_key, 4) == layout.PORT_VALUE.pack(12)
        assert libbpf.map_info(first.map_fd(layout.PEERS))["value_size"] == layout.PEER_STATS.size
        libbpf.map_update(first.map_fd(layout.ROUTES), key, layout.route_value("192.0.2.7", "udp"))
        routes_id = libbpf.map_info(first.map_fd(layout.ROUTES))["id"]
    with libbpf.BpfObject(OBJECT) as again:  # a restart: every map adopted, contents and all
        assert sorted(adopt_pins(again, bpffs)) == sorted(layout.MAPS)
        again.load()
        assert libbpf.map_info(again.map_fd(layout.ROUTES))["id"] == routes_id
        assert libbpf.map_lookup(again.map_fd(layout.ROUTES), key, layout.ROUTE_VALUE.size) == \
            layout.route_value("192.0.2.7", "udp")
    for name in layout.MAPS:
        os.unlink(os.path.join(bpffs, name))


# Two objects libbpf must refuse to load, each with the reason: a kfunc no kernel has, and a
# program the verifier rejects (a packet read without a bounds check).
REFUSED = {
    "kfunc": ("""
extern void bpf_agentd_no_such_kfunc(struct __sk_buff *skb) __ksym;
SEC("tc") int calls_nothing(struct __sk_buff *skb) { bpf_agentd_no_such_kfunc(skb); return 0; }
""", "extern (func ksym) 'bpf_agentd_no_such_kfunc': not found in kernel or module BTFs"),
    "verifier": ("""
SEC("tc") int unchecked(struct __sk_buff *skb) { return *(int *)(long)skb->data; }
""", "verifier on unchecked: invalid access to packet"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_the_kernel_cannot_run_is_refused_with_the_reason(case, tmp_path):
    body, reason = REFUSED[case]
    src, obj = tmp_path / f"{case}.c", tmp_path / f"{case}.bpf.o"
    src.write_text('#include <linux/bpf.h>\n#include <bpf/bpf_helpers.h>\nchar _license[] SEC("license") = "GPL";\n' + body)
    arch = subprocess.run(["gcc", "-print-multiarch"], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(["clang-16", "-O2", "-g", "-target", "bpf", "-mcpu=v3", f"-I/usr/include/{arch}", "-c", str(src),
                    "-o", str(obj)], check=True, capture_output=True)
    with libbpf.BpfObject(obj) as o, pytest.raises(libbpf.BpfError) as err:
        o.load()
    assert reason in str(err.value) and f"loading {obj.name}" in str(err.value), str(err.value)


def _elf_section(path, name: str) -> bytes:
    """The bytes of section ``name`` of a little-endian ELF64 object (a BPF object)."""
    data = path.read_bytes()
    assert data[:6] == b"\x7fELF\x02\x01", f"{path}: not a little-endian ELF64 object"
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple:  # name, type, flags, addr, offset, size, link, info, align, entsize
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)

    names = header(shstrndx)[4]
    for i in range(shnum):
        h = header(i)
        if data[names + h[0] : data.index(b"\0", names + h[0])].decode() == name:
            return data[h[4] : h[4] + h[5]]
    raise AssertionError(f"{path}: no section {name}")


BPF_STX_MEM_W, BPF_STX_ATOMIC_W, BPF_AND, BPF_FETCH, FRAME_POINTER = 0x63, 0xC3, 0x50, 0x01, 10


def test_the_data_path_clears_config_flags_atomically():
    """shrink() notes a decapsulation flag this kernel refuses by clearing its bit in the
    config, which the agent writes whole (e.g. CFG_POD_REDIRECT off before a pod is isolated):
    a plain load, AND and store racing that write could put back the bit the agent cleared,
    and decapsulated packets would skip netfilter on their way to an isolated pod.  Every
    32-bit store the programs make at the flags' offset goes through an atomic AND (BPF_STX |
    BPF_ATOMIC, imm BPF_AND); no plain store there, but to the stack (r10)."""
    flags_offset = struct.calcsize("<4s2s2s")  # struct config: local, udp_port, vxlan_port, then flags
    assert layout.CONFIG_VALUE.format == "<4s2s2sII"
    code = _elf_section(OBJECT, "tc")
    atomic_ands, plain = 0, []
    for at in range(0, len(code), 8):
        op, regs, off, imm = struct.unpack_from("<BBhi", code, at)
        if off != flags_offset:
            continue
        if op == BPF_STX_ATOMIC_W and imm & ~BPF_FETCH == BPF_AND:
            atomic_ands += 1
        elif op == BPF_STX_MEM_W and regs & 0xF != FRAME_POINTER:
            plain.append(at // 8)
    # Two per decapsulation (the L4 flags, the L3 flag); shrink() is inlined into each.
    assert atomic_ands >= 2 and plain == [], (atomic_ands, plain)
