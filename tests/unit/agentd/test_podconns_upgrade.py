"""An upgrade over a pinned ``agentd_podconns``: one whose entries an older agent's programs laid
out or meant otherwise -- the same size (2446ab4 gave bits of ``fins`` new meanings) or another
-- is replaced, not adopted, and the connections it holds come to the recorder as ends (GONE,
with what they counted): conntrack tells nobody of their end (their events were masked at the
SYN) and the new programs do not know them.  One of this layout (noted in ``agentd_podcfg``) is
adopted.  The kernel is modelled: pins are files, their maps kept by inode."""

from __future__ import annotations

import errno
import os
import socket
import struct

from agentd.dataplane.bpf import podpath
from agentd.flows import recorder

LIVE_SIZE = podpath.CONN_VALUE.size  # 64 since c59688f
OLD_SIZE = 56  # 3dd750c..c59688f: ..., state, client, fins (a byte), pad[2]
PREFIX = struct.Struct("<QQQQQQIB")  # every layout's first fields: counts, first and last, state, client


def _key(a: str, b: str, pa: int, pb: int) -> bytes:
    return socket.inet_aton(a) + socket.inet_aton(b) + pa.to_bytes(2, "big") + pb.to_bytes(2, "big")


OPEN = _key("10.244.1.2", "10.244.1.3", 40000, 80)
CLOSING = _key("10.244.1.2", "10.244.2.9", 40001, 443)
SYN = _key("10.244.1.4", "10.244.1.3", 40002, 80)


def _entry(size: int, state: int, client: int, n: int, fins: int = 0) -> bytes:
    head = PREFIX.pack(n, n + 1, 100 * n, 100 * n + 50, 1_000_000, 9_000_000, state, client)
    tail = (bytes([fins]) if size == OLD_SIZE else bytes(3) + fins.to_bytes(4, "little"))
    return (head + tail).ljust(size, b"\0")


class Kernel:
    """Pinned maps (files in the pin directory, known by inode) and the maps the load makes
    (by name: the fake object's map_fd)."""

    def __init__(self, monkeypatch, directory) -> None:
        self.dir = directory
        self.pinned: dict[int, tuple[dict, dict[bytes, bytes]]] = {}  # inode -> (map_info, entries)
        self.new: dict[str, dict[bytes, bytes]] = {}
        for name, value in (
            ("resolve_hook", lambda _attach: "tcx"),
            ("ensure_dir", lambda _bpf_dir, _directory: None),
            ("pin", lambda *_args: None),
        ):
            monkeypatch.setattr(podpath, name, value)
        monkeypatch.setattr(podpath.tc, "sweep", lambda _pins: 0)
        lb = podpath.lb
        monkeypatch.setattr(lb, "possible_cpus", lambda: 1)
        monkeypatch.setattr(lb, "obj_get", self.obj_get)
        monkeypatch.setattr(lb, "map_info", lambda fd: self._pin(fd)[0])
        monkeypatch.setattr(lb, "map_keys", lambda fd, _size: list(self._entries(fd)))
        monkeypatch.setattr(lb, "map_lookup", lambda fd, key, size: self._lookup(fd, key, size))
        monkeypatch.setattr(lb, "map_update", lambda fd, key, value, flags=0: self._entries(fd).__setitem__(key, value))
        monkeypatch.setattr(lb, "prog_info", lambda _fd: {"id": 1})
        liberal = directory.parent / "be_liberal"
        liberal.write_text("1\n")
        established = directory.parent / "established"
        established.write_text("432000\n")
        monkeypatch.setattr(podpath, "BE_LIBERAL", liberal)
        monkeypatch.setattr(podpath, "ESTABLISHED_TIMEOUT", established)

    def pin(self, name: str, info: dict, entries: dict[bytes, bytes]) -> None:
        path = self.dir / name
        path.write_text("a pinned map")
        self.pinned[os.stat(path).st_ino] = (info, entries)

    def obj_get(self, path: str) -> int:
        if not os.path.isfile(path):
            raise podpath.lb.BpfError(errno.ENOENT, f"bpf_obj_get {path}")
        return os.open(path, os.O_RDONLY)

    def _pin(self, fd: int) -> tuple[dict, dict[bytes, bytes]]:
        return self.pinned[os.fstat(fd).st_ino]  # an fd adopt_pins opened, or a dup of it

    def _entries(self, fd) -> dict[bytes, bytes]:
        if isinstance(fd, str):  # a map the load made
            return self.new.setdefault(fd, {})
        return self._pin(fd)[1]

    def _lookup(self, fd, key: bytes, size: int) -> bytes | None:
        if isinstance(fd, str) and fd not in self.new and fd in (podpath.CONFIG, podpath.CONFIG6):
            return bytes(size)  # an array: zeros
        value = self._entries(fd).get(key)
        return None if value is None else value[:size].ljust(size, b"\0")


def _info(value_size: int) -> dict:
    return {"type": podpath.lb.MAP_TYPE_HASH, "key_size": podpath.FLOW_KEY.size, "value_size": value_size,
            "max_entries": 65536, "flags": 0}


def _config_info(value_size: int) -> dict:
    return {"type": podpath.lb.MAP_TYPE_ARRAY, "key_size": 4, "value_size": value_size, "max_entries": 1, "flags": 0}


class Map:
    pinned = True

    def __init__(self, shape: tuple) -> None:
        self._shape = shape

    def shape(self):
        return self._shape


class Obj:
    """This version's object: podcfg and podconns (the rest of its maps play no part here)."""

    def __init__(self):
        conns = _info(LIVE_SIZE)
        cfg = _config_info(podpath.CONFIG_VALUE.size)
        self.maps = {podpath.CONFIG: Map(tuple(cfg[k] for k in ("type", "key_size", "value_size", "max_entries", "flags"))),
                     podpath.CONNS: Map(tuple(conns[k] for k in ("type", "key_size", "value_size", "max_entries", "flags")))}

    def pin_maps_in(self, _directory): pass
    def load(self): pass
    def map_fd(self, name): return name
    def prog_fd(self, _name): return 7
    def close(self): pass


class Ring:
    def drain_fixed(self, _size):
        return b"", 0, 0, set()


def _open(monkeypatch, tmp_path, config: bytes, conns_size: int) -> tuple[podpath.PodFastPath, Kernel, dict]:
    fp = podpath.PodFastPath(tmp_path / "bpf")
    fp.dir.mkdir(parents=True)
    kernel = Kernel(monkeypatch, fp.dir)
    monkeypatch.setattr(podpath, "open_checked", lambda _path, _check: Obj())
    kernel.pin(podpath.CONFIG, _config_info(len(config)), {bytes(4): config})
    entries = {OPEN: _entry(conns_size, podpath.CONN_OPEN, 1, 3, fins=16),  # fins 16: FIN_HELD_LO (e53e2cb), NEW_SYN_LO now
               CLOSING: _entry(conns_size, podpath.CONN_CLOSING, 0, 7, fins=3),
               SYN: _entry(conns_size, podpath.CONN_SYN, 1, 1)}
    kernel.pin(podpath.CONNS, _info(conns_size), entries)
    fp.open()
    return fp, kernel, entries


def _ends(fp: podpath.PodFastPath) -> list[tuple[bytes, int, tuple]]:
    fp.recs = Ring()  # the recorder opened: it reads the ring
    blob, count, others, addresses = fp.recorded_batch()
    assert others == 0 and count * podpath.CONN_RECORD.size == len(blob)
    out = []
    for i in range(count):
        key, kind, value = podpath.CONN_RECORD.unpack_from(blob, i * podpath.CONN_RECORD.size)
        assert key[0:4] in addresses and key[4:8] in addresses
        out.append((key, kind, podpath.CONN_VALUE.unpack(value)[:8]))
    return sorted(out)


# An agent of e53e2cb..2446ab4's podcfg: 24 bytes, no note of the podconns layout.
OLDER_CONFIG = struct.pack("<III4s4sI", podpath.CFG_ON | podpath.CFG_RECORD, 0, 0, bytes(4), bytes(4), 0)


def test_a_podconns_of_the_same_size_but_an_older_layout_is_replaced_and_its_connections_end(monkeypatch, tmp_path):
    fp, kernel, _entries = _open(monkeypatch, tmp_path, OLDER_CONFIG, LIVE_SIZE)
    assert not (fp.dir / podpath.CONNS).exists()  # replaced: libbpf makes it afresh at load
    assert fp.replaced_conns is None  # read once the new programs were on, its fd closed
    ends = _ends(fp)
    # An end per connection past its SYN, as the sweep's GONE, with what it counted; the
    # unanswered SYN, whose start was never recorded, has none.
    assert ends == sorted([
        (OPEN, podpath.REC_GONE, (3, 4, 300, 350, 1_000_000, 9_000_000, podpath.CONN_OPEN, 1)),
        (CLOSING, podpath.REC_GONE, (7, 8, 700, 750, 1_000_000, 9_000_000, podpath.CONN_CLOSING, 0)),
    ])
    assert _ends(fp) == []  # handed over once
    # The new podcfg notes this layout: the next agent adopts the map.
    assert podpath.CONFIG_VALUE.unpack(kernel.new[podpath.CONFIG][bytes(4)])[6] == podpath.CONNS_LAYOUT
    # ... as the recorder makes them: ends, when found, the client's side sent what it counted.
    blob = podpath.CONN_RECORD.pack(OPEN, podpath.REC_GONE, podpath.CONN_VALUE.pack(3, 4, 300, 350, 1_000_000,
                                                                                      9_000_000, 2, 1, 0))
    flow = recorder.recorded_flow("node1", blob, None, None, 0, 1234.0)
    assert flow.event == "end" and flow.time == 1234.0 and (flow.packets_sent, flow.bytes_sent) == (4, 350)


def test_a_podconns_of_another_size_is_replaced_and_its_connections_end(monkeypatch, tmp_path):
    fp, _kernel, _entries = _open(monkeypatch, tmp_path, OLDER_CONFIG, OLD_SIZE)
    assert [(key, kind, v[6]) for key, kind, v in _ends(fp)] == sorted([
        (OPEN, podpath.REC_GONE, podpath.CONN_OPEN), (CLOSING, podpath.REC_GONE, podpath.CONN_CLOSING)])


def test_a_podconns_of_this_layout_is_adopted_with_its_connections(monkeypatch, tmp_path):
    config = podpath.CONFIG_VALUE.pack(podpath.CFG_ON | podpath.CFG_RECORD, 0, 0, bytes(4), bytes(4), 0,
                                       podpath.CONNS_LAYOUT)
    fp, _kernel, _entries = _open(monkeypatch, tmp_path, config, LIVE_SIZE)
    assert (fp.dir / podpath.CONNS).exists() and fp.adopted  # libbpf reuses it at load
    assert _ends(fp) == []


def test_ends_of_a_replaced_podconns_are_dropped_when_the_programs_stop_recording(monkeypatch, tmp_path):
    fp, _kernel, _entries = _open(monkeypatch, tmp_path, OLDER_CONFIG, LIVE_SIZE)
    monkeypatch.setattr(podpath.lb, "RingBuffer", lambda _fd: type("R", (), {"drain": lambda s: [],
                                                                                "close": lambda s: None})())
    fp.set_recording(False)  # flows off: nobody records; a later recorder must not take them
    assert _ends(fp) == []


# An agent of e53e2cb..2446ab4's podcfg as the operator's be_liberal = 0 left it noted.
NOTED_ZERO = struct.pack("<III4s4sI", podpath.CFG_ON, 0, 0, bytes(4), bytes(4), 0)


def test_an_upgrade_whose_programs_fail_to_load_keeps_the_operators_be_liberal_for_a_leave(monkeypatch, tmp_path):
    class Rejected(Obj):
        def load(self):  # the verifier, a kfunc: libbpf removes the pins it made
            raise podpath.lb.BpfError(errno.EINVAL, "bpf_object__load")

    fp = podpath.PodFastPath(tmp_path / "bpf")
    fp.dir.mkdir(parents=True)
    kernel = Kernel(monkeypatch, fp.dir)
    monkeypatch.setattr(podpath, "open_checked", lambda _path, _check: Rejected())
    kernel.pin(podpath.CONFIG, _config_info(len(NOTED_ZERO)), {bytes(4): NOTED_ZERO})
    try:
        fp.open()
    except podpath.BpfUnavailable:
        pass
    else:
        raise AssertionError("the open did not fail")
    # The older agent's pin is back in place (the fast path stays off, be_liberal 1).
    assert (fp.dir / podpath.CONFIG).exists() and not (fp.dir / podpath.CONFIG_ASIDE).exists()
    assert podpath.BE_LIBERAL.read_text() == "1\n"
    removed = podpath.remove_pinned_fast_path(tmp_path / "bpf", liberal=True)  # agentd leave
    assert podpath.BE_LIBERAL.read_text() == "0\n"
    assert "net.netfilter.nf_conntrack_tcp_be_liberal = 0 put back" in removed
    assert not (fp.dir / podpath.CONFIG).exists()


def test_an_older_podcfg_an_open_set_aside_and_did_not_get_to_remove_is_what_a_leave_puts_back(monkeypatch, tmp_path):
    # An agent killed in its open between setting the old pin aside and noting its value.
    directory = podpath.pin_dir(tmp_path / "bpf")
    directory.mkdir(parents=True)
    kernel = Kernel(monkeypatch, directory)
    kernel.pin(podpath.CONFIG_ASIDE, _config_info(len(NOTED_ZERO)), {bytes(4): NOTED_ZERO})
    podpath.remove_pinned_fast_path(tmp_path / "bpf", liberal=True)
    assert podpath.BE_LIBERAL.read_text() == "0\n"
    assert not (directory / podpath.CONFIG_ASIDE).exists() and not (directory / podpath.CONFIG).exists()


def test_an_upgrade_that_opens_notes_the_older_podcfgs_value_and_removes_the_old_pin(monkeypatch, tmp_path):
    fp, kernel, _entries = _open(monkeypatch, tmp_path, NOTED_ZERO, LIVE_SIZE)
    assert not (fp.dir / podpath.CONFIG_ASIDE).exists()
    flags, _ms, before = podpath.CONFIG_NOTE.unpack_from(kernel.new[podpath.CONFIG][bytes(4)])
    assert flags & podpath.CFG_ON and before == 0


def test_an_open_after_one_killed_with_the_old_pin_set_aside_notes_the_operators_value(monkeypatch, tmp_path):
    """An agent killed between setting the older agentd_podcfg aside and its load left
    agentd_podcfg_old alone (the operator's be_liberal 0 noted in it; 1 now, the older agent
    set it).  The next open settles that pin first: its new map notes 0, not the 1 it finds,
    and the aside pin (the only record of the 0) goes only then (review s55 r1 #3)."""
    fp = podpath.PodFastPath(tmp_path / "bpf")
    fp.dir.mkdir(parents=True)
    kernel = Kernel(monkeypatch, fp.dir)
    monkeypatch.setattr(podpath, "open_checked", lambda _path, _check: Obj())
    kernel.pin(podpath.CONFIG_ASIDE, _config_info(len(NOTED_ZERO)), {bytes(4): NOTED_ZERO})
    fp.open()
    _flags, _ms, before = podpath.CONFIG_NOTE.unpack_from(kernel.new[podpath.CONFIG][bytes(4)])
    assert not (fp.dir / podpath.CONFIG_ASIDE).exists()
    assert before == 0, f"the new map notes be_liberal {before}, not the operator's 0"


def test_a_handed_over_connections_end_comes_after_its_start_the_old_programs_recorded(monkeypatch, tmp_path):
    # agentd_podrecs is adopted with what the old programs wrote while no agent ran: the
    # START of a connection still in the replaced agentd_podconns among it.
    fp, _kernel, entries = _open(monkeypatch, tmp_path, OLDER_CONFIG, LIVE_SIZE)
    start = podpath.CONN_RECORD.pack(OPEN, podpath.REC_START, entries[OPEN])

    class Adopted:
        def drain_fixed(self, _size):
            return start, 1, 0, {OPEN[0:4], OPEN[4:8]}

        def drain(self):
            return [start]

    fp.recs = Adopted()
    blob, count, _others, _addresses = fp.recorded_batch()
    records = [podpath.CONN_RECORD.unpack_from(blob, i * podpath.CONN_RECORD.size)[:2] for i in range(count)]
    assert [kind for key, kind in records if key == OPEN] == [podpath.REC_START, podpath.REC_GONE]
    # recorded(), the same.
    fp, _kernel, _entries = _open(monkeypatch, tmp_path / "again", OLDER_CONFIG, LIVE_SIZE)
    fp.recs = Adopted()
    kinds = [podpath.CONN_RECORD.unpack(raw)[1] for raw in fp.recorded() if podpath.CONN_RECORD.unpack(raw)[0] == OPEN]
    assert kinds == [podpath.REC_START, podpath.REC_GONE]


def test_the_replaced_podconns_is_read_only_once_every_new_program_is_on(monkeypatch, tmp_path):
    # Its connections' ends are read once the old programs are off every hook: the pods'
    # veths and the underlay device (what they recorded till then included).
    timeline = []
    fp = podpath.PodFastPath(tmp_path / "bpf", cluster=podpath.IPv4Network("10.244.0.0/16"), wire_ifindex=2)
    fp.dir.mkdir(parents=True)
    kernel = Kernel(monkeypatch, fp.dir)
    monkeypatch.setattr(podpath, "open_checked", lambda _path, _check: Obj())
    kernel.pin(podpath.CONFIG, _config_info(len(OLDER_CONFIG)), {bytes(4): OLDER_CONFIG})
    kernel.pin(podpath.CONNS, _info(LIVE_SIZE), {OPEN: _entry(LIVE_SIZE, podpath.CONN_OPEN, 1, 3)})
    kernel.new[podpath.IPS] = {socket.inet_aton("10.244.1.2"): podpath.POD_VALUE.pack(11),
                               socket.inet_aton("10.244.1.3"): podpath.POD_VALUE.pack(12)}
    old_conns = next(entries for info, entries in kernel.pinned.values() if info["key_size"] == podpath.FLOW_KEY.size)
    keys = podpath.lb.map_keys

    def map_keys(fd, size):
        if not isinstance(fd, str) and kernel._entries(fd) is old_conns:
            timeline.append("old podconns read")
        return keys(fd, size)

    def attach(ifindex, direction, _fd, name, _hook, _pins, last=False):
        timeline.append(f"{name} on {ifindex}")
        return []

    monkeypatch.setattr(podpath.lb, "map_keys", map_keys)
    monkeypatch.setattr(podpath.tc, "attach", attach)
    fp.open()
    assert timeline == [f"{podpath.PROGRAM} on 11", f"{podpath.PROGRAM} on 12", f"{podpath.WIRE_PROGRAM} on 2",
                        "old podconns read"]
    assert [(key, kind) for key, kind, _value in _ends(fp)] == [(OPEN, podpath.REC_GONE)]
