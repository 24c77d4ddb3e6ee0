"""The pod fast path of one node (podpath.c): load or adopt, put it on the pods' veths and the
underlay device, count, remove.

Pins, next to the data path's in this namespace's directory (see datapath.py)::

    <bpf_dir>/netns-<inode>/
        agentd_podips  agentd_podstat  agentd_podcfg      the maps (IPv4)
        agentd_podips6  agentd_podstat6  agentd_podcfg6   the maps (IPv6)
        agentd_podflows  agentd_podflow6  agentd_podends  per-connection counts (flow records)
        agentd_podconns  agentd_podrecs  agentd_podlost   connections the programs record (flow records)
        agentd_podrsts                                    ... those a RST passed (hints: ended 2 s later)
        agentd_pod_fast  agentd_pod_wire                  the programs
        links/agentd_pod_fast-<ifindex>  links/agentd_pod_wire-<ifindex>    the tcx links (tc.py)

``agentd_pod_fast`` sits on the ingress hook of the host side of every local pod's veth,
``agentd_pod_wire`` on the underlay device's (tcx or cls_bpf as ``[network] bpf_attach``
says, see tc.py; under cls_bpf the wire program has a filter place of its own beside the data
path's); the ``agentd_podips`` map holds each local pod's address and the ifindex of its
veth, ``agentd_podips6`` each IPv6 address (IPv6 has maps of its own, counters included, so
that the IPv4 ones keep their shapes).  A restarted agent's libbpf reuses the pinned maps, loads the programs afresh (the
kfuncs and nf_conn's field offsets resolved against this kernel's BTF) and the agent swaps
them in place: into the pinned links, or the cls_bpf filters, as the data path does.

The program needs conntrack's TCP tracking to be liberal about windows in this namespace (it
does not see the packets it carries: see podpath.c), so :meth:`PodFastPath.open` sets
``net.netfilter.nf_conntrack_tcp_be_liberal`` to 1 and notes the value it found, which
:func:`remove_pinned_fast_path` puts back (in ``agentd_podcfg``: a pin of an older layout,
replaced at open, has its note read first and carried into the new map; till the open has
done so it stays, as ``agentd_podcfg_old``, and an open that fails puts it back).
Blocking calls: run them off the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import struct
from collections.abc import Mapping
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path

from . import libbpf as lb
from . import tc
from .datapath import (
    DEFAULT_BPF_DIR,
    BpfUnavailable,
    adopt_pins,
    ensure_dir,
    explain,
    open_checked,
    pin,
    pin_dir,
    resolve_hook,
)
from .layout import check_programs, sum_percpu

log = logging.getLogger("agentd.bpf")
OBJECT = Path(__file__).with_name("podpath.bpf.o")
IPS, STATS, CONFIG = "agentd_podips", "agentd_podstat", "agentd_podcfg"
# An older agent's agentd_podcfg (another layout) while an open replaces it: renamed, not
# removed, till the open has noted its be_liberal value in the new map (or failed: renamed back).
CONFIG_ASIDE = "agentd_podcfg_old"  # bpffs refuses names with a dot
IPS6, STATS6, CONFIG6 = "agentd_podips6", "agentd_podstat6", "agentd_podcfg6"
FLOWS, FLOWS6, ENDS = "agentd_podflows", "agentd_podflow6", "agentd_podends"  # per-connection counts (flow records)
CONNS, RECS, LOST = "agentd_podconns", "agentd_podrecs", "agentd_podlost"  # connections the programs record
RESETS = "agentd_podrsts"  # ... those a RST passed (struct podconn_hint)
MAPS = (IPS, STATS, CONFIG, IPS6, STATS6, CONFIG6, FLOWS, FLOWS6, ENDS, CONNS, RECS, LOST, RESETS)
PROGRAM, WIRE_PROGRAM = tc.POD_FAST_PATH, tc.POD_WIRE
POD_VALUE = struct.Struct("<I")  # struct pod_value: ifindex
STATS_VALUE = struct.Struct("<QQ")  # struct pod_stats: packets, bytes
# struct pod_config: flags, established_ms, liberal_before, cluster_net, cluster_mask, wire_ifindex,
# conns_layout
CONFIG_VALUE = struct.Struct("<III4s4sII")
CONFIG6_VALUE = struct.Struct("<16s16s")  # struct pod_config6: cluster_net, cluster_mask
# What every layout struct pod_config has had first (12 bytes before 19135cf, 24 since):
# flags (CFG_ON the one flag they all mean alike), established_ms, liberal_before.
CONFIG_NOTE = struct.Struct("<III")
U32 = struct.Struct("<I")
VERDICTS = ("carried", "no_conntrack", "not_established", "nat", "no_route")  # enum pod_verdict, in order
CFG_ON, CFG_ROUTE, CFG_COUNT, CFG_RECORD, CFG_RECORD_REMOTE = 1, 2, 4, 8, 16
FLOW_KEY = struct.Struct("<4s4s2s2s")  # struct podflow_key: the two ends, the lower (address, port) first
# struct podflow_value: packets sent by each end, bytes sent by each end, CLOCK_TAI ns of the first
FLOW_VALUE = struct.Struct("<QQQQQ")
FLOW_END = struct.Struct("<12s4x40s")  # struct podflow_end: key, value
FLOW6_KEY = struct.Struct("<16s16s2s2s")  # struct podflow6_key: as FLOW_KEY, IPv6 addresses
FLOW6_END = struct.Struct("<36s4x40s")  # struct podflow6_end: key, value (the ring tells it by its size)
# struct podconn_value: packets sent by each end, bytes sent by each end, CLOCK_TAI ns of the SYN
# and of the last packet, state, the client's side, FIN bits
CONN_VALUE = struct.Struct("<QQQQQQIB3xI4x")  # and podpath.h's fin_ack_hi, client_seq: not read here
CONN_RECORD = struct.Struct("<12sI64s")  # struct podconn_record: key, kind, value
# podpath.h PODCONN_LAYOUT: the layout (and meaning) of struct podconn_value that this agent's
# programs use, noted in agentd_podcfg (conns_layout); a pinned agentd_podconns whose note
# differs (an older agent's: none) is replaced at open, its connections ended (GONE).
CONNS_LAYOUT = 1
# What every layout of struct podconn_value has had first: packets sent by each end, bytes
# sent by each end, CLOCK_TAI ns of the SYN and of the last packet, state, the client's side.
CONN_PREFIX = struct.Struct("<QQQQQQIB")
CONN_SYN, CONN_OPEN, CONN_CLOSING, CONN_RESET_LO, CONN_RESET_HI = 1, 2, 3, 4, 5  # enum podconn_state
REC_START, REC_FIN, REC_RST, REC_REUSED = 1, 2, 3, 4  # enum podconn_kind
REC_GONE = 5  # not the programs': the agent's sweep found conntrack no longer holds it
CONN_HINT = struct.Struct("<12s4xQ")  # struct podconn_hint: key, CLOCK_TAI ns of the RST
EXPECTED = {
    IPS: (lb.MAP_TYPE_HASH, 4, POD_VALUE.size),
    STATS: (lb.MAP_TYPE_PERCPU_ARRAY, 4, STATS_VALUE.size),
    CONFIG: (lb.MAP_TYPE_ARRAY, 4, CONFIG_VALUE.size),
    IPS6: (lb.MAP_TYPE_HASH, 16, POD_VALUE.size),
    STATS6: (lb.MAP_TYPE_PERCPU_ARRAY, 4, STATS_VALUE.size),
    CONFIG6: (lb.MAP_TYPE_ARRAY, 4, CONFIG6_VALUE.size),
    FLOWS: (lb.MAP_TYPE_LRU_HASH, FLOW_KEY.size, FLOW_VALUE.size),
    FLOWS6: (lb.MAP_TYPE_LRU_HASH, FLOW6_KEY.size, FLOW_VALUE.size),
    ENDS: (lb.MAP_TYPE_RINGBUF, 0, 0),
    CONNS: (lb.MAP_TYPE_HASH, FLOW_KEY.size, CONN_VALUE.size),
    RECS: (lb.MAP_TYPE_RINGBUF, 0, 0),
    LOST: (lb.MAP_TYPE_PERCPU_ARRAY, 4, 8),
    RESETS: (lb.MAP_TYPE_RINGBUF, 0, 0),
}
CAP_SYS_ADMIN, CAP_PERFMON = 21, 38
NEEDS_PERFMON = ("the pod fast path needs CAP_PERFMON, which this agent lacks: it reads conntrack's struct nf_conn, "
                 "which the verifier lets only CAP_PERFMON (or CAP_SYS_ADMIN) read; systemd/agentd.service gives it "
                 "unless a drop-in takes it away (docs/operations.md); [network] bpf_pod_fast_path = false turns "
                 "the fast path off without this message")
BE_LIBERAL = Path("/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal")
ESTABLISHED_TIMEOUT = Path("/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established")


def check(obj: lb.BpfObject) -> None:
    """Raise ValueError naming the first difference between podpath.h and this module."""
    for name, (mtype, key, value) in EXPECTED.items():
        m = obj.maps.get(name)
        if m is None:
            raise ValueError(f"the object file has no map {name}")
        if (m.type, m.key_size, m.value_size) != (mtype, key, value):
            raise ValueError(f"map {name} is (type, key, value) {(m.type, m.key_size, m.value_size)} in the "
                             f"object file, {(mtype, key, value)} in podpath.py")
    for name in (STATS, STATS6):
        if obj.maps[name].max_entries != len(VERDICTS):
            raise ValueError(f"the object file counts {obj.maps[name].max_entries} verdicts in {name}, "
                             f"podpath.py {len(VERDICTS)}")
    for name in MAPS:
        if not obj.maps[name].pinned:
            raise ValueError(f"map {name} is not pinned by name in the object file: a restart would lose it")
    check_programs(obj.programs, (PROGRAM, WIRE_PROGRAM))


def _may_read_kernel_structs() -> bool:
    """Whether this process has CAP_PERFMON or CAP_SYS_ADMIN (its effective set)."""
    try:
        status = Path("/proc/self/status").read_text()
        eff = int(next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), 16)
    except (OSError, StopIteration, ValueError):
        return True  # not known: the kernel's own words are the better message
    return bool(eff & (1 << CAP_PERFMON | 1 << CAP_SYS_ADMIN))


_END_OF_SIZE = {FLOW_END.size: FLOW_END, FLOW6_END.size: FLOW6_END}


def config_flags(found: int, *, route: bool, counting: bool, recording: tuple[bool, bool] | None) -> int:
    """The programs' flags (struct pod_config): ``found`` those the pinned config holds,
    ``recording`` (on, with other nodes' pods too) as the flow recorder said, None before it
    said: the programs then record as an earlier agent told them (their records wait in the
    ring for this agent, conntrack's events of them masked by the table it left) -- turned off
    until the recorder opens, a handshake they marked would be recorded by nobody."""
    if recording is None:
        recording = (bool(found & CFG_RECORD), bool(found & CFG_RECORD_REMOTE))
    on, remote = recording
    return (CFG_ON | (CFG_ROUTE if route else 0) | (CFG_COUNT if counting or on else 0) | (CFG_RECORD if on else 0)
            | (CFG_RECORD_REMOTE if on and remote and route else 0))


def _read_int(path: Path) -> int:
    return int(path.read_text().split()[0])


def _ips_map(address: str) -> str:
    return IPS6 if ":" in address else IPS


def _pod_key(address: str) -> bytes:
    return socket.inet_pton(socket.AF_INET6, address) if ":" in address else socket.inet_aton(address)


class PodFastPath:
    """The program, its maps and the veths it is on, for this network namespace."""

    def __init__(self, bpf_dir: str | os.PathLike = DEFAULT_BPF_DIR, object_path: Path = OBJECT, *,
                 cluster: IPv4Network | None = None, wire_ifindex: int | None = None, attach: str = "auto",
                 cluster_v6: IPv6Network | None = None) -> None:
        """``cluster``, ``cluster_v6``: the pod networks (IPv4, IPv6); with ``wire_ifindex``
        (the underlay device) connections between this node's pods and other nodes' pods of
        those networks are carried too.  ``attach``: ``[network] bpf_attach``."""
        self.bpf_dir = Path(bpf_dir)
        self.cluster = cluster
        self.cluster_v6 = cluster_v6
        self.last: dict[str, dict[str, dict[str, int]]] = {}  # counters() as last read, by family
        self.wire_ifindex = wire_ifindex
        self.wire: str | None = None  # why the underlay device has no program, if it has none
        self.dir = pin_dir(bpf_dir)
        self.object_path = object_path
        self.attach = attach
        self.hook: str | None = None  # "tcx" | "clsact", once open
        self.obj: lb.BpfObject | None = None
        self.maps: dict[str, int] = {}
        self.prog_fd: int | None = None
        self.prog_id: int | None = None
        self.wire_fd: int | None = None
        self.wire_id: int | None = None
        self.counting = False  # per-connection counts of what is carried (flow records)
        self.ends: lb.RingBuffer | None = None
        self.recording = False  # the programs record pods' IPv4 TCP connections (flow records)
        self.recording_remote = False  # ... with other nodes' pods too
        self.recording_told = False  # set_recording was called: till then an earlier agent's word stands
        self.recs: lb.RingBuffer | None = None
        self.resets: lb.RingBuffer | None = None  # agentd_podrsts
        self.pods: dict[str, int] = {}  # pod address (IPv4 or IPv6) -> ifindex of its veth's host side, as in the maps
        self.attached: set[int] = set()  # veths our program is on (this run)
        self.adopted = False
        # (flags, liberal_before) an agentd_podcfg of another layout (an older agent's) held
        # when open replaced it: the be_liberal value it noted goes on being the one noted.
        self.replaced_config: tuple[int, int] | None = None
        # An agentd_podconns of another layout open replaced (its fd and map_info), read once
        # the new programs are on, and its connections' ends (REC_GONE records, CONN_RECORD)
        # for the recorder: handed over with the first records it reads (recorded_batch).
        self.replaced_conns: tuple[int, dict] | None = None
        self.replaced_ends: list[bytes] = []
        self.ncpus = 0
        self.pins = tc.Pins(self.dir)  # read at open: how our programs on the hooks are known
        self.unidentified: set[str] = set()  # programs on our hooks we could not take over, and why

    # ------------------------------------------------------------------ open / close

    def open(self) -> None:
        """Adopt or create the maps, load the programs, turn conntrack's liberal windows on and
        put the program back on the veths of the pods the maps hold.  Raises
        :class:`BpfUnavailable` with the reason when any of it cannot be done; the fast path is
        then off, and what this call or an earlier agent put of it in the kernel is removed
        (:func:`remove_pinned_fast_path`): programs left on the hooks with maps no agent keeps
        would go on steering packets by pods that may have gone, their addresses reused."""
        obj: lb.BpfObject | None = None
        try:
            self.hook = resolve_hook(self.attach)
            obj = open_checked(self.object_path, check)
            ensure_dir(self.bpf_dir, self.dir)
            self.pins = tc.Pins.read(self.dir)  # the previous agent's programs, before ours replace the pins
            tc.sweep(self.pins)  # links of veths that went while no agent ran
            self.ncpus = lb.possible_cpus()
            settle_config_aside(self.dir)  # an open killed before it could
            stale = () if pinned_conns_layout(self.dir) == CONNS_LAYOUT else (CONNS,)
            self._set_config_aside(obj.maps[CONFIG].shape())
            self.adopted = bool(adopt_pins(obj, self.dir, self._replacing, stale))
            try:
                obj.load()
            except lb.BpfError as err:  # a kfunc, nf_conn's fields, or the verifier
                if err.errno in (errno.EPERM, errno.EACCES) and not _may_read_kernel_structs():
                    raise BpfUnavailable(NEEDS_PERFMON) from None
                raise BpfUnavailable(f"the kernel cannot run the pod fast path: {explain(err)}") from None
            self.obj = obj
            self.maps = {name: obj.map_fd(name) for name in MAPS}
            for name, family, size in ((IPS, socket.AF_INET, 4), (IPS6, socket.AF_INET6, 16)):
                for key in lb.map_keys(self.maps[name], size):
                    value = lb.map_lookup(self.maps[name], key, POD_VALUE.size)
                    if value is not None:
                        self.pods[socket.inet_ntop(family, key)] = POD_VALUE.unpack(value)[0]
            self._configure()
            self.prog_fd = obj.prog_fd(PROGRAM)
            self.prog_id = lb.prog_info(self.prog_fd)["id"]
            pin(self.dir, self.prog_fd, PROGRAM)
            for address, ifindex in list(self.pods.items()):  # a previous run's veths: the new program
                if not self._attach(ifindex):
                    self._forget(address)
            if self.routed:
                self.wire_fd = obj.prog_fd(WIRE_PROGRAM)
                self.wire_id = lb.prog_info(self.wire_fd)["id"]
                pin(self.dir, self.wire_fd, WIRE_PROGRAM)
                self._attach_wire()
            else:
                self.wire = "no cluster network or underlay device given"
            self._end_replaced_conns()
            with contextlib.suppress(OSError):  # noted in the new map (else the next open removes it)
                (self.dir / CONFIG_ASIDE).unlink()
        except (OSError, tc.TcError, BpfUnavailable) as err:  # lb.BpfError is an OSError
            if isinstance(err, lb.BpfError):
                reason = explain(err)
            else:  # an OSError names its file (a pin, a link's pin) or its netlink request
                reason = str(err)
            if obj is not None:
                obj.close()
            self.close()
            try:
                removed = remove_pinned_fast_path(self.bpf_dir)
            except OSError as cleanup:
                reason += f"; and what there is of it in the kernel could not be removed: {cleanup}"
            else:
                if removed:
                    log.warning("pod fast path off: removed %s", ", ".join(removed))
            raise BpfUnavailable(reason) from None

    @property
    def routed(self) -> bool:
        return (self.cluster is not None or self.cluster_v6 is not None) and self.wire_ifindex is not None

    def _attach_wire(self) -> None:
        assert self.wire_fd is not None and self.wire_ifindex is not None and self.hook is not None
        try:  # after the data path's program there, whenever either comes (datapath.c deliver_gated)
            self.unidentified.update(tc.attach(self.wire_ifindex, "ingress", self.wire_fd, WIRE_PROGRAM, self.hook,
                                               self.pins, last=True))
        except tc.TcError as err:  # pods of this node keep their fast path between them
            self.wire = str(err)
            self._configure(route=False)
            return
        self.wire = None

    def _set_config_aside(self, shape: tuple) -> None:
        """A pinned ``agentd_podcfg`` of another shape than ``shape`` (the object's: an older
        agent's) renamed to ``agentd_podcfg_old``, its note read (:meth:`_replacing`): libbpf
        makes the map afresh at load, and until :meth:`_configure` has noted the operator's
        be_liberal value in it, the old pin is the only record of it -- an open that fails
        before (the programs rejected at load, say) puts it back (:func:`settle_config_aside`)."""
        path = self.dir / CONFIG
        try:
            fd = lb.obj_get(str(path))
        except lb.BpfError:
            return  # none (or not a map: adopt_pins replaces it)
        try:
            info = lb.map_info(fd)
            if (info["type"], info["key_size"], info["value_size"], info["max_entries"], info["flags"]) == shape:
                return
            self._replacing(CONFIG, fd, info)
        finally:
            os.close(fd)
        os.rename(path, self.dir / CONFIG_ASIDE)

    def _replacing(self, name: str, fd: int, info: dict) -> None:
        """A pin of another shape or layout :func:`adopt_pins` is about to remove: an older agent's
        ``agentd_podcfg`` is the only record of ``nf_conntrack_tcp_be_liberal`` as the operator
        had it (the agent set it to 1), read here before it goes; :meth:`_configure` notes
        it in the new map, which a leave puts back.  An older agent's ``agentd_podconns`` holds
        the connections its programs record, whose conntrack events are masked: kept open
        (a duplicate of ``fd``) until the new programs are on, then read
        (:meth:`_end_replaced_conns`)."""
        if name == CONNS and info["key_size"] == FLOW_KEY.size and info["value_size"] >= CONN_PREFIX.size:
            if self.replaced_conns is None:
                self.replaced_conns = (os.dup(fd), info)
            return
        if name != CONFIG or info["value_size"] < CONFIG_NOTE.size:
            return
        try:
            raw = lb.map_lookup(fd, U32.pack(0), info["value_size"])
        except lb.BpfError as err:
            log.warning("could not read %s of an older layout (%s): net.netfilter.nf_conntrack_tcp_be_liberal "
                        "as it was before the agent is not known", self.dir / CONFIG, explain(err))
            return
        if raw:
            flags, _ms, before = CONFIG_NOTE.unpack_from(raw)
            self.replaced_config = (flags, before)

    def _end_replaced_conns(self) -> None:
        """The connections an older agent's ``agentd_podconns`` (replaced at open) holds once
        the old programs are off the hooks (what they recorded until then included), as ends
        the recorder takes with its first read (:attr:`replaced_ends`): REC_GONE, with what
        they counted -- the new programs do not know them, and conntrack tells nobody of their
        end (their events were masked at the SYN).  An unanswered SYN, whose start was never
        recorded, has no end."""
        if self.replaced_conns is None:
            return
        fd, info = self.replaced_conns
        self.replaced_conns = None
        ends = []
        try:
            for key in lb.map_keys(fd, FLOW_KEY.size):
                raw = lb.map_lookup(fd, key, info["value_size"])
                if raw is None:
                    continue
                p_lo, p_hi, b_lo, b_hi, first, last, state, client = CONN_PREFIX.unpack_from(raw)
                if state == CONN_SYN:
                    continue
                value = CONN_VALUE.pack(p_lo, p_hi, b_lo, b_hi, first, last, state, client, 0)
                ends.append(CONN_RECORD.pack(key, REC_GONE, value))
        except lb.BpfError as err:
            log.warning("could not read the recorded connections of %s of an older layout (%s): their ends are not "
                        "recorded", self.dir / CONNS, explain(err))
        finally:
            os.close(fd)
        if ends:
            log.info("flows: %d connections the pod programs recorded in %s of an older layout end here (gone)",
                     len(ends), self.dir / CONNS)
        self.replaced_ends.extend(ends)

    def _configure(self, route: bool | None = None) -> None:
        """Liberal TCP windows in this namespace (noting what was there), and the programs' config."""
        key = U32.pack(0)
        raw = lb.map_lookup(self.maps[CONFIG], key, CONFIG_VALUE.size)
        flags, _ms, before, _net, _mask, _wire, _layout = CONFIG_VALUE.unpack(raw) if raw else (0, 0, 0, b"", b"", 0, 0)
        if not flags & CFG_ON and self.replaced_config is not None and self.replaced_config[0] & CFG_ON:
            # Made afresh (the pin had an older layout): that pin's note stands.  Only CFG_ON
            # is taken of its flags; the others meant other things in other layouts.
            flags, before = CFG_ON, self.replaced_config[1]
        try:
            liberal = _read_int(BE_LIBERAL)
            if not flags & CFG_ON:  # not set by an earlier run: what we find is the operator's
                before = liberal
            if liberal != 1:
                BE_LIBERAL.write_text("1\n")
            established_ms = min(_read_int(ESTABLISHED_TIMEOUT) * 1000, 0xFFFFFFFF)
        except OSError as err:
            raise BpfUnavailable(f"conntrack settings: {err}") from None
        if route is None:
            route = self.routed and self.wire is None
        net = self.cluster or IPv4Network("255.255.255.255/32")  # matches no pod
        net6 = self.cluster_v6 or IPv6Network(f"{'ffff:' * 7}ffff/128")  # matches no pod either
        lb.map_update(self.maps[CONFIG6], key, CONFIG6_VALUE.pack(net6.network_address.packed, net6.netmask.packed))
        lb.map_update(self.maps[CONFIG], key, CONFIG_VALUE.pack(
            config_flags(flags, route=route, counting=self.counting,
                         recording=(self.recording, self.recording_remote) if self.recording_told else None),
            established_ms, before, net.network_address.packed, net.netmask.packed, self.wire_ifindex or 0,
            CONNS_LAYOUT))

    def set_counting(self, on: bool) -> None:
        """Count what the programs carry per connection (``agentd_podflows``, IPv6's in
        ``agentd_podflow6``; flow records add it to conntrack's counts of the connection), or stop."""
        if on and self.ends is None:
            self.ends = lb.RingBuffer(self.maps[ENDS])
        self.counting = on
        self._configure()

    def set_recording(self, on: bool, remote: bool = False) -> None:
        """Record pods' IPv4 TCP connections in the programs (podconns, their starts and ends
        through the ring ``agentd_podrecs``), or stop.  ``remote``: connections with other
        nodes' pods too -- only where every packet from them passes the wire program.  The
        caller masks conntrack's events of what the programs mark first (agentd.flows.mask).
        Off: once the programs are told, what they recorded is dropped (:meth:`_drop_recorded`)."""
        if on and self.recs is None:
            self.recs = lb.RingBuffer(self.maps[RECS])
        if on and self.resets is None:
            self.resets = lb.RingBuffer(self.maps[RESETS])
        self.recording, self.recording_remote, self.recording_told = on, remote, True
        self._configure()
        if not on:
            self._drop_recorded()

    def _drop_recorded(self) -> None:
        """Every entry of podconns deleted and every record in podrecs (and podrsts) read and dropped: nobody
        reads them while the programs do not record, and whoever records next (a later agent,
        flows switched on again) would take stale starts and ends from the ring for new ones,
        end stale entries by its sweep as GONE at the time it finds them, and count a later
        connection of a tuple with a stale entry there (its conntrack events not masked: two
        ends).  (A program that read the flags just before they changed may still make one in
        that moment.)"""
        self.replaced_ends.clear()
        fd = self.maps.get(CONNS)
        if fd is None:
            return
        for key in lb.map_keys(fd, FLOW_KEY.size):
            lb.map_delete(fd, key)
        for held, name in ((self.recs, RECS), (self.resets, RESETS)):
            ring = held if held is not None else lb.RingBuffer(self.maps[name])
            try:
                ring.drain()
            finally:
                if ring is not held:
                    ring.close()

    def records_remote(self) -> bool:
        """Whether the programs record connections with other nodes' pods too, as their config
        says (set_recording's ``remote`` is dropped where the wire program is not on)."""
        fd = self.maps.get(CONFIG)
        if fd is None:
            return False
        try:
            raw = lb.map_lookup(fd, U32.pack(0), CONFIG_VALUE.size)
        except OSError:
            return False
        return bool(raw) and CONFIG_VALUE.unpack(raw)[0] & (CFG_RECORD | CFG_RECORD_REMOTE) == CFG_RECORD | CFG_RECORD_REMOTE

    def recorded(self) -> list[bytes]:
        """Starts and ends of recorded connections since the last call, oldest first, as the
        ring holds them (struct podconn_record, CONN_RECORD: read when a record is made)."""
        if self.recs is None:
            return []
        drained = self.recs.drain()  # first: see recorded_batch
        replaced, self.replaced_ends = self.replaced_ends, []
        return drained + replaced

    def recorded_left(self) -> list[bytes]:
        """:meth:`recorded` whether or not this process told the programs to record: the ring
        opened for this read where :meth:`set_recording` did not open it (an earlier agent
        told them to record; this one cannot have them), then let go.  What an earlier
        agent's programs wrote and nobody read, and the ends handed over at open
        (:attr:`replaced_ends`), for a recorder to keep before :meth:`set_recording` (False)
        drops them."""
        if self.recs is not None:
            return self.recorded()
        drained: list[bytes] = []
        fd = self.maps.get(RECS)
        if fd is not None:
            ring = lb.RingBuffer(fd)
            try:
                drained = ring.drain()
            finally:
                ring.close()
        replaced, self.replaced_ends = self.replaced_ends, []
        return drained + replaced

    def recorded_batch(self) -> tuple[bytes, int, int, set[bytes]]:
        """:meth:`recorded` in one object: the records side by side, how many, how many were
        not a struct podconn_record (left out), the addresses their keys hold, each once
        (agentd.dataplane.bpf.libbpf.RingBuffer.drain_fixed)."""
        if self.recs is None:
            return b"", 0, 0, set()
        blob, count, others, addresses = self.recs.drain_fixed(CONN_RECORD.size)
        if self.replaced_ends:
            # After the ring: agentd_podrecs is adopted with what the old programs wrote and no
            # agent read, the starts of these very connections among it (those answered while no
            # agent ran).
            replaced, self.replaced_ends = self.replaced_ends, []
            addresses |= {raw[i : i + 4] for raw in replaced for i in (0, 4)}
            blob, count = blob + b"".join(replaced), count + len(replaced)
        return blob, count, others, addresses

    def reset_hints(self) -> list[tuple[bytes, int]]:
        """Connections a RST passed since the last call (podrsts: struct podconn_hint), oldest
        first: (key, CLOCK_TAI ns of the RST).  Hints, not records: the caller looks at the
        entry itself (anything but a podconn_hint -- none is -- left out)."""
        if self.resets is None:
            return []
        size = CONN_HINT.size
        return [CONN_HINT.unpack(raw) for raw in self.resets.drain() if len(raw) == size]

    def recorded_lost(self) -> int:
        """Starts and ends the ring could not take (full) since the map was made."""
        fd = self.maps.get(LOST)
        if fd is None:
            return 0
        raw = lb.map_lookup(fd, U32.pack(0), 8 * self.ncpus)
        return sum(struct.unpack(f"<{self.ncpus}Q", raw)) if raw else 0

    def recorded_open(self) -> list[tuple[bytes, bytes]]:
        """Every connection the programs hold (podconns): (key, value as the map holds it)."""
        fd = self.maps.get(CONNS)
        if fd is None:
            return []
        out = []
        for key in lb.map_keys(fd, FLOW_KEY.size):
            raw = lb.map_lookup(fd, key, CONN_VALUE.size)
            if raw is not None:
                out.append((key, raw))
        return out

    def recorded_entry(self, key: bytes) -> bytes | None:
        """A recorded connection's value as podconns holds it now, None if it has none."""
        fd = self.maps.get(CONNS)
        if fd is None:
            return None
        return lb.map_lookup(fd, key, CONN_VALUE.size)

    def take_recorded(self, key: bytes) -> bytes | None:
        """A recorded connection out of podconns in one step (its value), None if gone."""
        fd = self.maps.get(CONNS)
        if fd is None:
            return None
        return lb.map_take(fd, key, CONN_VALUE.size)

    def put_recorded(self, key: bytes, value: bytes) -> bool:
        """A connection :meth:`take_recorded` took put back into podconns, unless the programs
        made an entry of that tuple since (which stays: False).  Raises OSError where it
        cannot be put back at all -- E2BIG: podconns, a preallocated hash, is full (the
        programs took the freed slot meanwhile) -- and the caller must say what became of it."""
        fd = self.maps.get(CONNS)
        if fd is None:
            raise OSError(errno.ENOENT, "the pod programs' map agentd_podconns is not open")
        try:
            lb.map_update(fd, key, value, lb.BPF_NOEXIST)
        except OSError as err:
            if err.errno == errno.EEXIST:
                return False
            if err.errno == errno.E2BIG:
                raise OSError(err.errno, "agentd_podconns is full") from None
            raise
        return True

    def carried_restarts(self) -> list[tuple[bytes, tuple[int, int, int, int, int]]]:
        """What the programs carried of connections whose tuple a new connection took since the
        last call (the ring ``agentd_podends``), oldest first: (podflow key -- 12 bytes for
        IPv4, 36 for IPv6 --, (packets sent by the lower end, by the other, bytes sent by the
        lower end, by the other, CLOCK_TAI ns of the first packet carried))."""
        if self.ends is None:
            return []
        out = []
        for raw in self.ends.drain():
            end = _END_OF_SIZE.get(len(raw))  # both families' ends share the ring
            if end is not None:
                key, value = end.unpack(raw)
                out.append((key, FLOW_VALUE.unpack(value)))
        return out

    def take_carried(self, key: bytes) -> tuple[int, int, int, int, int] | None:
        """What the programs carry of podflow key ``key`` (as :meth:`carried_restarts` gives
        it), removed from its family's map in one step; None if nothing."""
        fd = self.maps.get(FLOWS6 if len(key) == FLOW6_KEY.size else FLOWS)
        if fd is None:
            return None
        raw = lb.map_take(fd, key, FLOW_VALUE.size)
        return FLOW_VALUE.unpack(raw) if raw else None

    def close(self) -> None:
        """Let go of the file descriptors; the program stays on the veths."""
        if self.replaced_conns is not None:  # an open that failed before reading it
            os.close(self.replaced_conns[0])
            self.replaced_conns = None
        if self.ends is not None:
            self.ends.close()
            self.ends = None
        for ring in (self.recs, self.resets):
            if ring is not None:
                ring.close()
        self.recs = self.resets = None
        if self.obj is not None:
            self.obj.close()
            self.obj = None
        self.maps.clear()
        self.prog_fd = self.wire_fd = None

    def remove(self) -> list[str]:
        """Take the program off every veth, remove the pins, put conntrack's setting back."""
        self.close()
        return remove_pinned_fast_path(self.bpf_dir)

    # ------------------------------------------------------------------ desired state

    def set_pods(self, wanted: Mapping[str, str]) -> None:
        """This node's pods: address (IPv4 or IPv6: each goes to its family's map) -> the host
        side of its veth (a device name).  Pods whose veth is not (or no longer) here are left out."""
        resolved: dict[str, int] = {}
        for address, device in wanted.items():
            try:
                resolved[address] = socket.if_nametoindex(device)
            except OSError:
                continue
        gone = [a for a in self.pods if a not in resolved]
        for address in gone:
            self._forget(address)
        if gone:
            tc.sweep(self.pins)  # the links of the veths that went with their pods
        failed: dict[int, str] = {}  # veth -> why its program could not go on
        unwritten: dict[str, str] = {}  # address -> why the pod map did not take it
        for address, ifindex in resolved.items():
            if self.pods.get(address) == ifindex:
                continue
            if address in self.pods:  # moved to another veth: off the old one's before anything can fail
                self._forget(address)
            if ifindex in failed:
                continue
            try:
                if ifindex not in self.attached and not self._attach(ifindex):
                    continue
            except BpfUnavailable as err:  # the other pods' updates go on; this one is retried
                failed[ifindex] = str(err)
                continue
            try:
                lb.map_update(self.maps[_ips_map(address)], _pod_key(address), POD_VALUE.pack(ifindex))
            except lb.BpfError as err:  # the map full (E2BIG), no memory: this address is retried, the others go on
                unwritten[address] = str(err)
                continue
            self.pods[address] = ifindex
        self.attached &= set(self.pods.values())
        if failed or unwritten:  # one error naming them all (the policy agent retries at its next rescan)
            device = {resolved[a]: d for a, d in wanted.items() if a in resolved}
            why = [f"{device[i]}: {err}" for i, err in sorted(failed.items())]
            why += [f"{wanted[a]} ({a}): pod map: {err}" for a, err in sorted(unwritten.items())]
            on = [f"{len(failed)} veths"] if failed else []
            on += [f"{len(unwritten)} addresses"] if unwritten else []
            raise BpfUnavailable(f"pod fast path not on {' nor '.join(on)} (their pods take the normal path): "
                                 + "; ".join(why))

    def _attach(self, ifindex: int) -> bool:
        assert self.prog_fd is not None and self.hook is not None
        try:
            self.unidentified.update(tc.attach(ifindex, "ingress", self.prog_fd, PROGRAM, self.hook, self.pins))
        except tc.TcError as err:
            if "No such device" in str(err):
                return False  # the pod went between the name lookup and now
            raise BpfUnavailable(str(err)) from None
        self.attached.add(ifindex)
        return True

    def _forget(self, address: str) -> None:
        lb.map_delete(self.maps[_ips_map(address)], _pod_key(address))
        self.pods.pop(address, None)

    # ------------------------------------------------------------------ observation

    def counters(self) -> dict[str, dict[str, dict[str, int]]]:
        """Pod TCP packets and bytes by what the programs did with them, since the maps were
        made, per family (``ipv4``, ``ipv6``: each has its counters map); kept in ``last``
        (:meth:`status` shows IPv6's from there)."""
        self.last = {"ipv4": self._verdicts(STATS), "ipv6": self._verdicts(STATS6)}
        return self.last

    def _verdicts(self, name: str) -> dict[str, dict[str, int]]:
        out = {}
        size = ((STATS_VALUE.size + 7) & ~7) * self.ncpus
        for i, verdict in enumerate(VERDICTS):
            raw = lb.map_lookup(self.maps[name], U32.pack(i), size)
            packets, nbytes = sum_percpu(raw, STATS_VALUE) if raw else (0, 0)
            out[verdict] = {"packets": packets, "bytes": nbytes}
        return out

    def status(self) -> dict:
        return {
            "pins": str(self.dir),
            "program": {"id": self.prog_id},
            "hook": self.hook,  # tcx or clsact ([network] bpf_attach)
            "between_nodes": {"on": self.wire_id is not None and self.wire is None, "program": {"id": self.wire_id},
                              "device": self.wire_ifindex, "cluster": str(self.cluster) if self.cluster else None,
                              "why_not": self.wire},
            "pods": len(set(self.pods.values())),  # veths: a dual-stack pod has an address of each family
            "adopted_maps": self.adopted,
            # Programs on our tcx hooks we could not tell ours or anyone's (tc.py): they stay.
            "unidentified_programs": sorted(self.unidentified),
            # IPv6 TCP: the same programs and rules, its own pods and counters (``packets`` above is IPv4's).
            "ipv6": {"pods": sum(1 for a in self.pods if ":" in a),
                     "cluster": str(self.cluster_v6) if self.cluster_v6 else None,
                     "packets": {verdict: c["packets"] for verdict, c in self.last.get("ipv6", {}).items()}},
        }


def pinned_conns_layout(directory: Path) -> int:
    """The layout of struct podconn_value the pinned ``agentd_podcfg`` in ``directory`` notes
    (:data:`CONNS_LAYOUT`, as the agent that pinned it ran): 0 for none -- no such pin, one of
    an agent from before the note (a smaller value), or one that cannot be read."""
    try:
        fd = lb.obj_get(str(directory / CONFIG))
    except lb.BpfError:
        return 0
    try:
        size = lb.map_info(fd)["value_size"]
        if size < CONFIG_VALUE.size:
            return 0
        raw = lb.map_lookup(fd, U32.pack(0), size)
        return CONFIG_VALUE.unpack_from(raw)[6] if raw else 0
    except lb.BpfError:
        return 0
    finally:
        os.close(fd)


def _notes_liberal(path: Path) -> bool:
    """Whether the pinned ``agentd_podcfg`` at ``path`` is of this layout and notes the value
    found of be_liberal (CFG_ON); False where it cannot be read."""
    try:
        fd = lb.obj_get(str(path))
    except lb.BpfError:
        return False
    try:
        if lb.map_info(fd)["value_size"] != CONFIG_VALUE.size:
            return False
        raw = lb.map_lookup(fd, U32.pack(0), CONFIG_VALUE.size)
        return bool(raw) and bool(CONFIG_VALUE.unpack(raw)[0] & CFG_ON)
    except (lb.BpfError, OSError, struct.error):
        return False
    finally:
        os.close(fd)


def settle_config_aside(directory: Path) -> None:
    """An ``agentd_podcfg_old`` an open set aside (:meth:`PodFastPath._set_config_aside`) and
    did not get to remove: removed where the ``agentd_podcfg`` beside it notes be_liberal (the
    open noted the old pin's value there, or the operator's where the old one noted none), else
    put back in its place -- the value it notes is then the only record of the operator's."""
    aside = directory / CONFIG_ASIDE
    if not aside.exists():
        return
    if _notes_liberal(directory / CONFIG):
        aside.unlink()
    else:
        os.replace(aside, directory / CONFIG)


def remove_pinned_fast_path(bpf_dir: str | os.PathLike, *, liberal: bool = False) -> list[str]:
    """Detach the pod fast path from the veths its pinned map names and remove its pins.
    Works without the agent that made them; idempotent.  Returns what was removed.

    ``nf_conntrack_tcp_be_liberal`` is put back as it was found only with ``liberal``
    (``agentd leave``): where the fast path is only switched off or fails to open, connections
    it carried are still open, conntrack having seen none of their packets since their
    handshake -- judged by windows again, their FINs would be out of window and their entries
    stay ESTABLISHED for days (docs/policy.md).  The setting then stays 1 and the value found
    is kept in the ``agentd_podcfg`` pin (a next open adopts it, a leave puts it back).  A
    value that cannot be written raises OSError (one line), the pin kept for the next leave."""
    d = pin_dir(bpf_dir)
    settle_config_aside(d)  # an open that failed (or was killed) replacing an older agent's
    pins = tc.Pins.read(d)
    removed: list[str] = []
    devices: set[int] = set()
    for name in (IPS, IPS6):
        if not (d / name).exists():
            continue
        with contextlib.suppress(lb.BpfError):
            fd = lb.obj_get(str(d / name))
            try:  # of the sizes the map has (the kernel writes that many): another agent's may differ
                info = lb.map_info(fd)
                if info["value_size"] < POD_VALUE.size:
                    continue
                for key in lb.map_keys(fd, info["key_size"]):
                    value = lb.map_lookup(fd, key, info["value_size"])
                    if value is not None:
                        devices.add(POD_VALUE.unpack_from(value)[0])
            finally:
                os.close(fd)
    devices |= {i for name, i in pins.links().values() if name == PROGRAM}
    n = sum(_detach(i, PROGRAM, pins) for i in sorted(devices))
    if n:
        removed.append(f"the pod fast path from {n} veths")
    cfg = d / CONFIG
    keep = not liberal  # the pin holding the value found, while be_liberal is not put back
    failed = None
    values = None
    if cfg.exists():
        try:
            fd = lb.obj_get(str(cfg))
            try:  # as big as the map's value (a newer agent's is larger): the kernel writes all of it
                raw = lb.map_lookup(fd, U32.pack(0), lb.map_info(fd)["value_size"])
            finally:
                os.close(fd)
            # every layout begins alike (CONFIG_NOTE); an older, shorter one has none of the rest
            values = CONFIG_VALUE.unpack(raw[: CONFIG_VALUE.size].ljust(CONFIG_VALUE.size, b"\0")) if raw else None
        except (lb.BpfError, OSError, struct.error) as err:
            if liberal:  # the operator's value may be in there: kept, and the step fails
                keep = True
                failed = (f"could not read {cfg}, which holds net.netfilter.nf_conntrack_tcp_be_liberal "
                          f"as it was before ({getattr(err, 'strerror', None) or err}); kept")
    if values is not None:
        flags, _ms, before, _net, _mask, wire, _layout = values
        if wire and _detach(wire, WIRE_PROGRAM, pins):
            removed.append("the pod fast path from the underlay device")
        if not flags & CFG_ON:
            keep = False  # nothing noted: no run of the fast path set be_liberal
        elif liberal:
            try:
                if _read_int(BE_LIBERAL) != before:
                    BE_LIBERAL.write_text(f"{before}\n")
                    removed.append(f"net.netfilter.nf_conntrack_tcp_be_liberal = {before} put back")
            except (OSError, ValueError, IndexError) as err:
                keep = True
                failed = (f"could not put back net.netfilter.nf_conntrack_tcp_be_liberal = {before} "
                          f"({getattr(err, 'strerror', None) or err}; noted in {cfg})")
    with contextlib.suppress(OSError):
        tc.remove_links(pins, (PROGRAM, WIRE_PROGRAM))  # those of devices that went
    for name in (*MAPS, PROGRAM, f"{PROGRAM}_new", WIRE_PROGRAM, f"{WIRE_PROGRAM}_new"):
        if name == CONFIG and keep:
            continue
        with contextlib.suppress(OSError):  # one that cannot go (a read-only bpffs) holds what no hook runs
            (d / name).unlink()
            removed.append(str(d / name))
    with contextlib.suppress(OSError):
        d.rmdir()  # only when the data path's pins are gone too
        Path(bpf_dir).rmdir()  # and no other namespace's agent pins there (the last of a leave)
    if failed is not None:
        raise OSError(failed)
    return removed


def _detach(ifindex: int, name: str, pins: tc.Pins) -> int:
    """Program ``name`` off one device; a veth that is gone (its pod with it) has nothing to remove."""
    with contextlib.suppress(OSError, tc.TcError):
        return tc.detach(ifindex, (name,), pins)
    return 0
