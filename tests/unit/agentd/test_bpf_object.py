"""The BPF object files scripts/dev setup builds, as libbpf reads them (opened, not loaded: no
root, no kernel): their maps agree with layout.py and podpath.py (the Python side of
datapath.h and podpath.h), every map is pinned by name, every program is a tc program, and a
difference on either side -- or a file that is no BPF object -- is refused before anything is
loaded.  And the attach layer's parts that need no kernel: the bpf() attributes of the two
commands made directly, a detach by position, the names of the link pins."""

import ctypes
import dataclasses
import struct
from ipaddress import IPv4Network, IPv6Network

import pytest

from agentd.dataplane.bpf import OBJECT, layout, libbpf, podpath, tc
from agentd.dataplane.bpf.datapath import BpfUnavailable, open_checked, resolve_hook


@pytest.fixture(scope="module")
def obj():
    assert OBJECT.exists(), f"{OBJECT} is not built: run scripts/dev setup"
    with libbpf.BpfObject(OBJECT) as o:
        yield o


@pytest.fixture(scope="module")
def pod_obj():
    assert podpath.OBJECT.exists(), f"{podpath.OBJECT} is not built: run scripts/dev setup"
    with libbpf.BpfObject(podpath.OBJECT) as o:
        yield o


def test_the_object_matches_layout(obj):
    layout.check(obj.maps, obj.programs)
    assert set(obj.maps) == set(layout.EXPECTED) == set(layout.MAPS)
    assert set(obj.programs) == set(layout.PROGRAMS) == set(tc.OURS)
    assert all(m.pinned for m in obj.maps.values())
    assert {p.section for p in obj.programs.values()} == {"tc"}
    assert obj.maps[layout.DROPS].max_entries == len(layout.DROP_REASONS)


def test_the_pod_fast_path_matches_its_layout(pod_obj):
    podpath.check(pod_obj)
    assert set(pod_obj.maps) == set(podpath.MAPS)  # the compiler's .rodata is libbpf's, not listed
    assert set(pod_obj.programs) == {podpath.PROGRAM, podpath.WIRE_PROGRAM} == {tc.POD_FAST_PATH, tc.POD_WIRE}
    assert all(p.type == libbpf.PROG_TYPE_SCHED_CLS for p in pod_obj.programs.values())


def test_a_layout_difference_is_refused(obj):
    maps = dict(obj.maps)
    maps[layout.ROUTES] = dataclasses.replace(maps[layout.ROUTES], value_size=maps[layout.ROUTES].value_size + 4)
    with pytest.raises(ValueError, match="agentd_routes"):
        layout.check(maps, obj.programs)


def test_a_map_that_is_not_pinned_would_not_survive_a_restart(obj):
    maps = {**obj.maps, layout.PEERS: dataclasses.replace(obj.maps[layout.PEERS], pinned=False)}
    with pytest.raises(ValueError, match="agentd_peers is not pinned"):
        layout.check(maps, obj.programs)


def test_a_program_libbpf_would_not_load_as_tc_is_refused(obj):
    programs = {**obj.programs, layout.EGRESS: dataclasses.replace(obj.programs[layout.EGRESS], section="tc/egress",
                                                                   type=0)}
    with pytest.raises(ValueError, match=r"agentd_egress is in section 'tc/egress'"):
        layout.check(obj.maps, programs)
    with pytest.raises(ValueError, match="no program agentd_ingress"):
        layout.check(obj.maps, {layout.EGRESS: obj.programs[layout.EGRESS]})


@pytest.mark.parametrize("data, message", [
    (b"not an elf at all", "BPF object format invalid"),
    (b"\x7fELF\x01\x01" + bytes(64), "BPF object format invalid"),
])  # fmt: skip
def test_what_is_not_a_bpf_object_is_refused(tmp_path, data, message):
    path = tmp_path / "x.bpf.o"
    path.write_bytes(data)
    with pytest.raises(libbpf.BpfError, match=message):
        libbpf.BpfObject(path)
    with pytest.raises(BpfUnavailable, match=message):
        open_checked(path, lambda o: None)


def test_an_object_for_another_machine_is_refused(tmp_path):
    data = bytearray(OBJECT.read_bytes())
    struct.pack_into("<H", data, 18, 62)  # e_machine = x86-64
    path = tmp_path / "x86.o"
    path.write_bytes(bytes(data))
    with pytest.raises(libbpf.BpfError, match="not a valid eBPF object file|format invalid"):
        libbpf.BpfObject(path)


def test_a_missing_object_says_how_it_is_built(tmp_path):
    with pytest.raises(BpfUnavailable, match="scripts/dev setup"):
        open_checked(tmp_path / "nothing.bpf.o", lambda o: None)


def test_the_attach_setting_resolves_by_what_the_kernel_has(monkeypatch):
    monkeypatch.setattr(tc, "_tcx", False)  # a kernel before 6.6 (Debian 12's 6.1)
    assert tc.resolve("auto") == "clsact" and tc.resolve("clsact") == "clsact"
    with pytest.raises(tc.TcError, match=r'bpf_attach = "tcx": this kernel has no tcx hooks \(Linux 6.6'):
        tc.resolve("tcx")
    monkeypatch.setattr(tc, "_tcx", True)
    assert tc.resolve("auto") == "tcx" and tc.resolve("tcx") == "tcx" and tc.resolve("clsact") == "clsact"
    with pytest.raises(tc.TcError, match="not one of auto, tcx, clsact"):
        tc.resolve("xdp")


def test_each_program_has_its_own_cls_bpf_place():
    """The underlay's ingress hook holds the data path's program and the pod fast path's wire
    program: under clsact each needs a place (priority, handle) of its own."""
    assert tc.handle(tc.POD_WIRE) != tc.handle(layout.INGRESS)
    assert len({tc.handle(n) for n in (layout.INGRESS, tc.POD_WIRE)}) == 2


def test_map_values_round_trip():
    cfg = layout.Config("192.168.50.2", 8285, 4789, layout.CFG_DECAP_UDP | layout.CFG_FILTER_VXLAN, 1500)
    assert layout.Config.unpack(cfg.pack()) == cfg
    assert cfg.pack()[4:8] == b"\x20\x5d\x12\xb5"  # ports in network order
    key, value = layout.route_key(IPv4Network("10.244.3.0/24")), layout.route_value("172.30.0.12", "ipip")
    assert layout.decode_route(key, value) == ("10.244.3.0/24", "172.30.0.12", "ipip")
    assert key == struct.pack("<I", 24) + bytes([10, 244, 3, 0])


def test_ipv6_routes_have_a_map_of_their_own_and_only_udp_carries_them():
    subnet = IPv6Network("fd00:10:244:3::/64")
    key, value = layout.route_key(subnet), layout.route_value("172.30.0.12", "udp")
    assert layout.routes_map(subnet) == layout.ROUTES6 and layout.routes_map(IPv4Network("10.0.0.0/8")) == layout.ROUTES
    assert key == struct.pack("<I", 64) + subnet.network_address.packed and len(key) == layout.ROUTE6_KEY.size
    assert layout.decode_route(key, value) == ("fd00:10:244:3::/64", "172.30.0.12", "udp")
    layout.check_route(subnet, "172.30.0.12", "udp")
    with pytest.raises(ValueError, match="ipip carries IPv4 pods only"):
        layout.check_route(subnet, "172.30.0.12", "ipip")
    with pytest.raises(ValueError, match="not an IPv4 underlay address"):
        layout.check_route(subnet, "fd00::1", "udp")  # the outer header is IPv4


def test_an_ipv6_routes_gateway_is_the_peers_ipv4_mapped_address():
    from agentd.dataplane.bpf.datapath import gateway6

    assert gateway6("192.0.2.7") == "::ffff:192.0.2.7"  # as the kernel prints it (inet_ntop)


def test_per_cpu_values_are_summed():
    raw = b"".join(layout.PEER_STATS.pack(0, i, 10 * i, 100 * i, 1000 * i) for i in (1, 2, 3))
    assert layout.sum_percpu(raw, layout.PEER_STATS) == (0, 6, 60, 600, 6000)
    raw = b"".join(layout.DROP_STATS.pack(i, i) for i in (4, 5))
    assert layout.sum_percpu(raw, layout.DROP_STATS) == (9, 9)


def test_without_libbpf_the_bpf_parts_say_what_to_install(monkeypatch):
    real = libbpf.ctypes.CDLL

    def cdll(name, *args, **kwargs):
        if name == "libbpf.so.1":
            raise OSError(f"{name}: cannot open shared object file")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(libbpf, "_lib", None)
    monkeypatch.setattr(libbpf.ctypes, "CDLL", cdll)
    with pytest.raises(BpfUnavailable, match=r"libbpf.so.1 is not installed \(Debian: apt-get install libbpf1\)"):
        open_checked(OBJECT, lambda o: None)
    monkeypatch.setattr(tc, "_tcx", None)
    with pytest.raises(BpfUnavailable, match="libbpf.so.1 is not installed"):
        resolve_hook("auto")


def test_the_bpf_attr_of_the_commands_made_directly_is_the_kernels():
    """union bpf_attr for BPF_PROG_DETACH and BPF_PROG_QUERY as include/uapi/linux/bpf.h lays
    it out since Linux 6.6 (the fields libbpf 1.1 does not pass: relative id, revision, link ids)."""
    mprog, query = libbpf._MprogAttr, libbpf._QueryAttr
    assert (mprog.attach_flags.offset, mprog.relative_id.offset, mprog.expected_revision.offset) == (12, 20, 24)
    assert ctypes.sizeof(mprog) == 32
    assert (query.prog_ids.offset, query.count.offset, query.prog_attach_flags.offset, query.link_ids.offset,
            query.revision.offset) == (16, 24, 32, 40, 56)
    assert ctypes.sizeof(query) == 64


@pytest.mark.parametrize(("index", "flags", "relative"), [
    (0, libbpf.BPF_F_BEFORE | libbpf.BPF_F_ID, 12),  # the first of three: before the second
    (1, libbpf.BPF_F_BEFORE | libbpf.BPF_F_ID, 13),
    (2, libbpf.BPF_F_AFTER | libbpf.BPF_F_ID, 12),  # the last: after the one before it
])  # fmt: skip
def test_a_program_is_detached_by_its_neighbour_and_the_revision(monkeypatch, index, flags, relative):
    asked = []
    monkeypatch.setattr(libbpf, "_sys_bpf", lambda cmd, attr: asked.append((cmd, bytes(attr))) or 0)
    libbpf.tcx_detach_at(7, libbpf.TCX_INGRESS, libbpf.TcxHook((11, 12, 13), (0, 0, 0), 42), index)
    ((cmd, raw),) = asked
    attr = libbpf._MprogAttr.from_buffer_copy(raw)
    assert cmd == libbpf._BPF_PROG_DETACH and attr.attach_bpf_fd == 0  # no file descriptor of it
    assert (attr.target_ifindex, attr.attach_type, attr.attach_flags, attr.relative_id, attr.expected_revision) == (
        7, libbpf.TCX_INGRESS, flags, relative, 42)


def test_the_only_program_is_detached_as_the_first(monkeypatch):
    asked = []
    monkeypatch.setattr(libbpf, "_sys_bpf", lambda cmd, attr: asked.append(bytes(attr)) or 0)
    libbpf.tcx_detach_at(7, libbpf.TCX_EGRESS, libbpf.TcxHook((11,), (0,), 3), 0)
    attr = libbpf._MprogAttr.from_buffer_copy(asked[0])
    assert (attr.attach_flags, attr.relative_id, attr.expected_revision) == (libbpf.BPF_F_BEFORE, 0, 3)


def test_link_pins_are_named_by_program_and_device(tmp_path):
    pins = tc.Pins(tmp_path)
    assert pins.links() == {}  # no links directory yet
    (tmp_path / tc.LINKS).mkdir()
    # (and "-²", which str.isdigit() takes and int() refuses)
    for name in ("agentd_pod_fast-17", "agentd_egress-2", "agentd_pod_wire-2", "someone-3", "agentd_ingress-x",
                 "agentd_ingress-\u00b2"):
        (tmp_path / tc.LINKS / name).touch()
    assert pins.link("agentd_pod_fast", 17) == tmp_path / "links" / "agentd_pod_fast-17"
    assert {p.name: v for p, v in pins.links().items()} == {
        "agentd_pod_fast-17": ("agentd_pod_fast", 17), "agentd_egress-2": ("agentd_egress", 2),
        "agentd_pod_wire-2": ("agentd_pod_wire", 2)}


def test_a_pin_directory_the_agent_may_not_make_is_one_clear_reason(tmp_path, monkeypatch):
    """An agent that is not root under systemd: /sys/fs/bpf is root's, mode 0700, so neither
    looking into it nor making [agent] bpf_dir there works. The reason names the directory in
    the way, its owner and mode, and where the docs show the fix; never a bare OSError."""
    from pathlib import Path

    from agentd.dataplane.bpf import datapath

    bpffs = tmp_path / "bpf"
    bpffs.mkdir(mode=0o700)
    bpf_dir = bpffs / "agentd"
    real_stat = Path.stat

    def stat(self, **kw):  # what a user other than the owner meets below a 0700 directory
        if self.is_relative_to(bpffs) and self != bpffs:
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, **kw)

    def mkdir(self, *a, **kw):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(libbpf, "is_bpffs", lambda path: True)
    monkeypatch.setattr(Path, "stat", stat)
    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(BpfUnavailable) as err:
        datapath.ensure_dir(bpf_dir, datapath.pin_dir(bpf_dir))
    reason = str(err.value)
    assert f"{bpffs} is uid {bpffs.stat().st_uid}'s, mode 0700" in reason, reason
    assert "Permission denied" in reason and "docs/operations.md" in reason and str(bpf_dir) in reason


def test_a_pin_directory_made_before_the_agent_starts_is_used(tmp_path, monkeypatch):
    """The dedicated user's drop-in makes [agent] bpf_dir before the agent starts."""
    from agentd.dataplane.bpf import datapath

    bpf_dir = tmp_path / "agentd"
    bpf_dir.mkdir(mode=0o700)
    monkeypatch.setattr(libbpf, "is_bpffs", lambda path: True)
    datapath.ensure_dir(bpf_dir, datapath.pin_dir(bpf_dir))
    assert datapath.pin_dir(bpf_dir).is_dir() and datapath.pin_dir(bpf_dir).parent == bpf_dir


def test_a_pin_directory_that_cannot_be_made_is_logged_once_per_run(tmp_path):
    """One cause (no bpffs at [agent] bpf_dir) stops every BPF part: the data path, each
    member filter, the pod fast path.  /status keeps the reason for each; the log gives it in
    full once, the other parts' lines refer to it."""
    from agentd.dataplane.bpf.datapath import PIN_DIR_LOGGED_ABOVE, ensure_dir, for_log

    bpf_dir = tmp_path / "not-a-bpffs"
    reasons = []
    for _part in ("data path", "pod fast path"):
        with pytest.raises(BpfUnavailable) as err:
            ensure_dir(bpf_dir, bpf_dir / "netns-1")
        reasons.append(str(err.value))
    assert reasons[0] == reasons[1] and reasons[0].startswith(f"no BPF file system at {bpf_dir}")
    assert for_log(reasons[0]) == reasons[0]
    assert for_log(f"BPF: {reasons[1]}") == f"BPF: {PIN_DIR_LOGGED_ABOVE}"
    assert for_log(reasons[0]) == PIN_DIR_LOGGED_ABOVE
    # Other reasons, and another bpf_dir's, are logged as they are.
    assert for_log("the kernel cannot run the pod fast path: EINVAL") == "the kernel cannot run the pod fast path: EINVAL"
    other = tmp_path / "another"
    with pytest.raises(BpfUnavailable) as err:
        ensure_dir(other, other / "netns-1")
    assert for_log(str(err.value)) == str(err.value)
