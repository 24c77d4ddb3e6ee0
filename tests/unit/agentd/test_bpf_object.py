"""The BPF object file scripts/dev setup builds, as the agent's loader reads it: its maps agree
with layout.py (the Python side of datapath.h), every map reference is an ld_imm64 the loader can
point at a map, and what the loader does not understand is refused, not half-loaded."""

import struct
from ipaddress import IPv4Network

import pytest

from agentd.dataplane.bpf import OBJECT, elf, layout


@pytest.fixture(scope="module")
def obj():
    assert OBJECT.exists(), f"{OBJECT} is not built: run scripts/dev setup"
    return elf.read_object(OBJECT.read_bytes())


def test_the_object_matches_layout(obj):
    layout.check(obj.maps, obj.programs)
    assert set(obj.maps) == set(layout.EXPECTED)
    assert {p.name for p in obj.programs.values()} == {"agentd_egress", "agentd_ingress"}
    assert obj.maps[layout.DROPS].max_entries == len(layout.DROP_REASONS)


def test_every_map_reference_is_relocated(obj):
    fds = {name: 100 + i for i, name in enumerate(sorted(obj.maps))}
    for prog in obj.programs.values():
        assert prog.map_refs, prog.section
        code = prog.relocated(fds)
        for index, name in prog.map_refs:
            op, regs, _off, imm = struct.unpack_from("<BBhi", code, index * 8)
            assert op == elf.LD_IMM64 and regs >> 4 == elf.PSEUDO_MAP_FD and imm == fds[name]
        # Nothing else changed.
        untouched = {i for i, _ in prog.map_refs}
        for i in range(len(code) // 8):
            if i not in untouched:
                assert code[i * 8 : i * 8 + 8] == prog.insns[i * 8 : i * 8 + 8]


def test_a_layout_difference_is_refused(obj):
    maps = dict(obj.maps)
    m = maps[layout.ROUTES]
    maps[layout.ROUTES] = elf.MapDef(m.name, m.type, m.key_size, m.value_size + 4, m.max_entries, m.flags)
    with pytest.raises(ValueError, match="agentd_routes"):
        layout.check(maps, obj.programs)


@pytest.mark.parametrize("data, message", [
    (b"not an elf at all", "not an ELF"),
    (b"\x7fELF\x01\x01" + bytes(64), "ELF64"),
])
def test_what_is_not_a_bpf_object_is_refused(data, message):
    with pytest.raises(elf.ObjectError, match=message):
        elf.read_object(data)


def test_an_object_for_another_machine_is_refused(obj):
    data = bytearray(OBJECT.read_bytes())
    struct.pack_into("<H", data, 18, 62)  # e_machine = x86-64
    with pytest.raises(elf.ObjectError, match="not BPF"):
        elf.read_object(bytes(data))


def test_map_values_round_trip():
    cfg = layout.Config("192.168.50.2", 8285, 4789, layout.CFG_DECAP_UDP | layout.CFG_FILTER_VXLAN, 1500)
    assert layout.Config.unpack(cfg.pack()) == cfg
    assert cfg.pack()[4:8] == b"\x20\x5d\x12\xb5"  # ports in network order
    key, value = layout.route_key(IPv4Network("10.244.3.0/24")), layout.route_value("172.30.0.12", "ipip")
    assert layout.decode_route(key, value) == ("10.244.3.0/24", "172.30.0.12", "ipip")
    assert key == struct.pack("<I", 24) + bytes([10, 244, 3, 0])


def test_per_cpu_values_are_summed():
    raw = b"".join(layout.PEER_STATS.pack(0, i, 10 * i, 100 * i, 1000 * i) for i in (1, 2, 3))
    assert layout.sum_percpu(raw, layout.PEER_STATS) == (0, 6, 60, 600, 6000)
    raw = b"".join(layout.DROP_STATS.pack(i, i) for i in (4, 5))
    assert layout.sum_percpu(raw, layout.DROP_STATS) == (9, 9)


# ------------------------------------------------------------------ the pod fast path (podpath.c)


@pytest.fixture(scope="module")
def pod_obj():
    from agentd.dataplane.bpf import podpath

    assert podpath.OBJECT.exists(), f"{podpath.OBJECT} is not built: run scripts/dev setup"
    return elf.read_object(podpath.OBJECT.read_bytes())


def test_the_pod_fast_path_matches_its_layout(pod_obj):
    from agentd.dataplane.bpf import podpath

    podpath.check(pod_obj)
    assert set(pod_obj.maps) == set(podpath.MAPS)
    assert {s: p.name for s, p in pod_obj.programs.items()} == {
        podpath.SECTION: podpath.PROGRAM, podpath.WIRE_SECTION: podpath.WIRE_PROGRAM}
    for prog in pod_obj.programs.values():
        assert prog.kfuncs == {"bpf_skb_ct_lookup", "bpf_ct_release", "bpf_ct_change_timeout"}
        assert prog.fields == {("nf_conn", ("status",)), ("nf_conn", ("proto", "tcp", "state"))}


def test_kfunc_calls_and_field_reads_are_relocated(pod_obj):
    fds = {name: 100 + i for i, name in enumerate(sorted(pod_obj.maps))}
    for prog in pod_obj.programs.values():
        ids = {name: 70000 + i for i, name in enumerate(sorted(prog.kfuncs))}
        offsets = {f: 200 + 8 * i for i, f in enumerate(sorted(prog.fields))}
        code = prog.relocated(fds, ids, offsets)
        for index, name in prog.kfunc_refs:
            op, regs, off, imm = struct.unpack_from("<BBhi", code, index * 8)
            assert op == elf.CALL and regs >> 4 == elf.PSEUDO_KFUNC_CALL and off == 0 and imm == ids[name]
        for index, root, path in prog.field_refs:
            op, _regs, off, _imm = struct.unpack_from("<BBhi", code, index * 8)
            assert op & 0x07 == elf.LDX and off == offsets[(root, path)]
        touched = {i for i, _ in prog.kfunc_refs} | {i for i, *_ in prog.field_refs} | {i for i, _ in prog.map_refs}
        for i in range(len(code) // 8):
            if i not in touched:
                assert code[i * 8 : i * 8 + 8] == prog.insns[i * 8 : i * 8 + 8]


def test_a_call_of_an_unknown_symbol_that_is_not_a_call_is_refused(pod_obj):
    from agentd.dataplane.bpf import podpath

    data = bytearray(podpath.OBJECT.read_bytes())
    prog = pod_obj.programs[podpath.SECTION]
    index = prog.kfunc_refs[0][0]
    start = bytes(data).find(prog.insns)
    data[start + index * 8] = 0xB7  # mov r, imm where the call was
    with pytest.raises(elf.ObjectError, match="is not a call"):
        elf.read_object(bytes(data))
