"""The node's lifecycle (leave, restart, switching parts off): what a leave puts back is put
back or said to have failed -- with the record of what to put back kept for the next leave --
and what a restart adopts is not flushed before the agent knows what it should hold."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import struct

import pytest

from agentd.daemon import agent as agent_module
from agentd.dataplane.bpf import podpath
from agentd.flows import recorder


def test_a_sysctl_that_cannot_be_put_back_fails_and_keeps_the_record(tmp_path, monkeypatch):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "nf_conntrack_acct").write_text("1\n")
    (proc / "nf_conntrack_timestamp").mkdir()  # writing it fails (as a read-only /proc/sys would)
    monkeypatch.setattr(recorder, "SYSCTL_DIR", proc)
    state = tmp_path / recorder.SYSCTL_STATE
    state.write_text(json.dumps({"nf_conntrack_acct": 0, "nf_conntrack_timestamp": 0}) + "\n")
    with pytest.raises(OSError, match=r"could not put back net\.netfilter\.nf_conntrack_timestamp = 0"):
        recorder.restore_sysctls(tmp_path)
    assert (proc / "nf_conntrack_acct").read_text() == "0\n"
    assert json.loads(state.read_text()) == {"nf_conntrack_acct": 0, "nf_conntrack_timestamp": 0}
    # the next leave, the sysctl writable again, puts it back and then forgets the record
    (proc / "nf_conntrack_timestamp").rmdir()
    (proc / "nf_conntrack_timestamp").write_text("1\n")
    assert recorder.restore_sysctls(tmp_path) == ["net.netfilter.nf_conntrack_acct = 0",
                                                  "net.netfilter.nf_conntrack_timestamp = 0"]
    assert (proc / "nf_conntrack_timestamp").read_text() == "0\n"
    assert not state.exists()


class PinnedFastPath:
    """A pin directory of the pod fast path as a leave or a switch-off finds it, its maps plain
    files; libbpf answers from them (the config map holds ``before``, the value found)."""

    def __init__(self, tmp_path, monkeypatch, *, found: int = 0, now: int = 1, config: bytes | None = None) -> None:
        self.dir = tmp_path / "netns-1"
        self.dir.mkdir()
        for name in (podpath.IPS, podpath.STATS, podpath.CONFIG, podpath.CONFIG6):
            (self.dir / name).write_text("")
        self.liberal = tmp_path / "nf_conntrack_tcp_be_liberal"
        self.liberal.write_text(f"{now}\n")
        if config is None:
            config = podpath.CONFIG_VALUE.pack(podpath.CFG_ON, 0, found, bytes(4), bytes(4), 0, podpath.CONNS_LAYOUT)
        self.asked: list[int] = []  # the value sizes map_lookup was asked for

        def lookup(_fd, _key, size):
            self.asked.append(size)
            return config[:size].ljust(size, b"\0")  # the kernel writes the map's value_size bytes

        def obj_get(path):
            if not os.path.isfile(path) or os.path.basename(path) != podpath.CONFIG:
                raise podpath.lb.BpfError(errno.ENOENT, f"bpf_obj_get {path}")
            return os.open(path, os.O_RDONLY)

        monkeypatch.setattr(podpath, "pin_dir", lambda _bpf_dir: self.dir)
        monkeypatch.setattr(podpath, "BE_LIBERAL", self.liberal)
        monkeypatch.setattr(podpath.lb, "obj_get", obj_get)
        monkeypatch.setattr(podpath.lb, "map_info", lambda _fd: {"type": podpath.lb.MAP_TYPE_ARRAY, "key_size": 4,
                                                                  "value_size": len(config), "max_entries": 1})
        monkeypatch.setattr(podpath.lb, "map_lookup", lookup)

    def pins(self) -> list[str]:
        return sorted(p.name for p in self.dir.iterdir()) if self.dir.exists() else []


def test_a_fast_path_switched_off_keeps_conntracks_liberal_windows_and_the_value_found(tmp_path, monkeypatch):
    """Switched off ([network] bpf_pod_fast_path = false) or failing to open, the fast path's
    connections are still open: be_liberal stays 1 and the operator's value stays noted."""
    pinned = PinnedFastPath(tmp_path, monkeypatch, found=0)
    podpath.remove_pinned_fast_path(tmp_path)
    assert pinned.liberal.read_text() == "1\n"
    assert pinned.pins() == [podpath.CONFIG]  # the value found, for a next open or the leave
    # `agentd leave` (its step) puts it back and then lets go of the pin
    asyncio.run(agent_module.restore_be_liberal(tmp_path))
    assert pinned.liberal.read_text() == "0\n"
    assert pinned.pins() == []


def test_a_leave_that_cannot_put_be_liberal_back_fails_and_keeps_the_value_found(tmp_path, monkeypatch):
    pinned = PinnedFastPath(tmp_path, monkeypatch, found=0)
    pinned.liberal.unlink()
    pinned.liberal.mkdir()  # writing it fails (as a read-only /proc/sys would)
    with pytest.raises(OSError, match=r"could not put back net\.netfilter\.nf_conntrack_tcp_be_liberal = 0"):
        podpath.remove_pinned_fast_path(tmp_path, liberal=True)
    assert pinned.pins() == [podpath.CONFIG]  # the rest went; the next leave tries again
    pinned.liberal.rmdir()
    pinned.liberal.write_text("1\n")
    assert "net.netfilter.nf_conntrack_tcp_be_liberal = 0 put back" in podpath.remove_pinned_fast_path(
        tmp_path, liberal=True)
    assert pinned.liberal.read_text() == "0\n" and pinned.pins() == []


def test_a_newer_agents_larger_config_pin_is_read_at_its_own_size_and_its_value_found_put_back(tmp_path, monkeypatch):
    """A rolled-back agent meets the ``agentd_podcfg`` of a newer one, whose struct pod_config
    has grown (40 bytes): the kernel writes the whole value, so the buffer is as big as the map
    says (not this version's 28 bytes: a heap overflow); the prefix every layout shares is read."""
    newer = podpath.CONFIG_VALUE.pack(podpath.CFG_ON, 0, 0, bytes(4), bytes(4), 0, 2) + b"\xee" * 12
    pinned = PinnedFastPath(tmp_path, monkeypatch, config=newer)
    assert "net.netfilter.nf_conntrack_tcp_be_liberal = 0 put back" in podpath.remove_pinned_fast_path(
        tmp_path, liberal=True)
    assert pinned.asked == [40]
    assert pinned.liberal.read_text() == "0\n" and pinned.pins() == []


def test_an_older_agents_12_byte_config_pin_is_read_at_its_size_and_its_value_found_put_back(tmp_path, monkeypatch):
    pinned = PinnedFastPath(tmp_path, monkeypatch, config=podpath.CONFIG_NOTE.pack(podpath.CFG_ON, 0, 0))
    podpath.remove_pinned_fast_path(tmp_path, liberal=True)
    assert pinned.asked == [12]
    assert pinned.liberal.read_text() == "0\n" and pinned.pins() == []


@pytest.mark.parametrize(("key_size", "value_size"), [(4, 8), (8, 8), (4, 2)])
def test_the_pod_maps_of_another_agents_layout_are_read_at_their_own_sizes(key_size, value_size, tmp_path, monkeypatch):
    """Which veths to take the program off is read from ``agentd_podips``/``agentd_podips6``
    at the sizes those maps have (a newer agent's value of 8 bytes: the kernel writes 8; a key
    of 8 bytes asked as 8, not this version's 4: the kernel writes the whole key).  A value
    shorter than this version's (2 bytes) names no veth: that map is left, not a struct.error."""
    pinned = PinnedFastPath(tmp_path, monkeypatch)
    (pinned.dir / podpath.IPS6).write_text("")
    value = (podpath.POD_VALUE.pack(21) + b"\xee" * 4)[:value_size]
    sizes = {podpath.IPS: (key_size, value_size, {b"\x0a\0\0\x07".ljust(key_size, b"\0"): value}),
             podpath.IPS6: (16, 8, {bytes(15) + b"\x07": podpath.POD_VALUE.pack(22) + b"\xee" * 4})}
    config_info, config_lookup = podpath.lb.map_info, podpath.lb.map_lookup
    asked = []

    def obj_get(path):
        if not os.path.isfile(path):
            raise podpath.lb.BpfError(errno.ENOENT, f"bpf_obj_get {path}")
        return os.open(path, os.O_RDONLY)

    def name(fd):
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))

    def map_info(fd):
        if name(fd) not in sizes:
            return config_info(fd)
        key_size, value_size, _ = sizes[name(fd)]
        return {"type": podpath.lb.MAP_TYPE_HASH, "key_size": key_size, "value_size": value_size, "max_entries": 1}

    def map_keys(fd, key_size):
        asked.append((name(fd), "key", key_size))
        return [k[:key_size].ljust(key_size, b"\0") for k in sizes[name(fd)][2]]

    def map_lookup(fd, key, size):
        if name(fd) not in sizes:
            return config_lookup(fd, key, size)
        asked.append((name(fd), "value", size))
        value = sizes[name(fd)][2].get(key)
        return None if value is None else value[:size].ljust(size, b"\0")

    detached = []
    monkeypatch.setattr(podpath.lb, "obj_get", obj_get)
    monkeypatch.setattr(podpath.lb, "map_info", map_info)
    monkeypatch.setattr(podpath.lb, "map_keys", map_keys)
    monkeypatch.setattr(podpath.lb, "map_lookup", map_lookup)
    monkeypatch.setattr(podpath, "_detach", lambda ifindex, program, _pins: detached.append((ifindex, program)) or 1)
    podpath.remove_pinned_fast_path(tmp_path, liberal=True)
    v4 = [(podpath.IPS, "key", key_size), (podpath.IPS, "value", value_size)] if value_size >= 4 else []
    assert sorted(asked) == sorted([*v4, (podpath.IPS6, "key", 16), (podpath.IPS6, "value", 8)])
    assert ((21, podpath.PROGRAM) in detached) == (value_size >= 4) and (22, podpath.PROGRAM) in detached


def test_a_leave_that_cannot_read_the_value_found_fails_and_keeps_it(tmp_path, monkeypatch):
    """The config pin is there but cannot be read (EPERM on the pin, a map of another layout):
    the operator's value may be in it, so it stays, be_liberal is left alone, and the step fails."""
    pinned = PinnedFastPath(tmp_path, monkeypatch, found=0)

    def refused(path):
        raise podpath.lb.BpfError(errno.EPERM, f"bpf_obj_get {path}")

    monkeypatch.setattr(podpath.lb, "obj_get", refused)
    with pytest.raises(OSError, match=r"could not read .*nf_conntrack_tcp_be_liberal as it was before"):
        podpath.remove_pinned_fast_path(tmp_path, liberal=True)
    assert pinned.pins() == [podpath.CONFIG] and pinned.liberal.read_text() == "1\n"


def test_an_older_layouts_config_pin_replaced_at_open_keeps_the_operators_be_liberal(tmp_path, monkeypatch):
    """An agent from before 19135cf noted be_liberal as the operator had it (0) in a 12-byte
    ``agentd_podcfg`` and set it to 1.  This version's open replaces that pin (another shape):
    the note is read before it goes and carried into the new map, so the leave puts back 0 --
    not the 1 the old agent left, taken for the operator's."""
    fp = podpath.PodFastPath(tmp_path)
    fp.dir.mkdir()
    (fp.dir / podpath.CONFIG).write_text("an older agent's map")
    liberal = tmp_path / "nf_conntrack_tcp_be_liberal"
    liberal.write_text("1\n")
    established = tmp_path / "nf_conntrack_tcp_timeout_established"
    established.write_text("432000\n")
    old = struct.pack("<III", podpath.CFG_ON, 432000 * 1000, 0)  # flags, established_ms, liberal_before
    new: dict[str, bytes] = {}  # this version's maps as load makes them (arrays: zeros), by name

    class Map:
        pinned = True

        def shape(self):
            return (podpath.lb.MAP_TYPE_ARRAY, 4, podpath.CONFIG_VALUE.size, 1, 0)

    class Obj:
        def __init__(self):
            self.maps = {podpath.CONFIG: Map()}

        def pin_maps_in(self, _directory): pass
        def load(self): pass
        def map_fd(self, name): return name
        def prog_fd(self, _name): return 7
        def close(self): pass

    def lookup(fd, _key, size):
        if isinstance(fd, str):
            return new.get(fd, bytes(size))
        return old[:size]  # the old pin's map, opened by adopt_pins

    monkeypatch.setattr(podpath, "resolve_hook", lambda _attach: "tcx")
    monkeypatch.setattr(podpath, "open_checked", lambda _path, _check: Obj())
    monkeypatch.setattr(podpath, "ensure_dir", lambda _bpf_dir, _directory: None)
    monkeypatch.setattr(podpath, "pin", lambda *_args: None)
    monkeypatch.setattr(podpath.tc, "sweep", lambda _pins: 0)
    monkeypatch.setattr(podpath, "BE_LIBERAL", liberal)
    monkeypatch.setattr(podpath, "ESTABLISHED_TIMEOUT", established)
    monkeypatch.setattr(podpath.lb, "possible_cpus", lambda: 1)
    def obj_get(path):
        if not os.path.isfile(path):
            raise podpath.lb.BpfError(errno.ENOENT, f"bpf_obj_get {path}")
        return os.open(path, os.O_RDONLY)

    monkeypatch.setattr(podpath.lb, "obj_get", obj_get)
    monkeypatch.setattr(podpath.lb, "map_info", lambda _fd: {"type": podpath.lb.MAP_TYPE_ARRAY, "key_size": 4,
                                                              "value_size": len(old), "max_entries": 1, "flags": 0})
    monkeypatch.setattr(podpath.lb, "map_lookup", lookup)
    monkeypatch.setattr(podpath.lb, "map_update", lambda fd, _key, value: new.__setitem__(fd, value))
    monkeypatch.setattr(podpath.lb, "map_keys", lambda _fd, _size: [])
    monkeypatch.setattr(podpath.lb, "prog_info", lambda _fd: {"id": 1})
    fp.open()
    assert not (fp.dir / podpath.CONFIG).exists()  # the old pin went (libbpf pins the new map at load)
    flags, _ms, before, *_rest = podpath.CONFIG_VALUE.unpack(new[podpath.CONFIG])
    assert flags & podpath.CFG_ON and before == 0  # the operator's value, not the old agent's 1
    assert liberal.read_text() == "1\n"
