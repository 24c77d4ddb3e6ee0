"""Timing helpers for benchmarks that drive the lab: route events, agent logs, process usage.

* :class:`RouteWatch` opens one NETLINK_ROUTE socket per lab node namespace (made inside
  the namespace with ``Netns.entered()``), subscribed to RTMGRP_IPV4_ROUTE and
  RTMGRP_IPV6_ROUTE, and stamps
  every add/delete of a route with our protocol number with ``time.time()`` in a thread of
  its own: millisecond timing without polling ``ip route`` and without starting a process.
* :func:`log_events` reads the timestamped lines of an agent's log (``asctime`` has
  millisecond resolution and uses the same wall clock).
* :func:`sample_usage` measures CPU (utime+stime deltas from /proc/<pid>/stat) and memory
  (VmRSS/VmHWM from /proc/<pid>/status) of a set of processes over a window.

Wall-clock ``time.time()`` is used throughout so that our stamps and the agents' log
lines can be subtracted from each other.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from agentd.lab.netns import Netns

NETLINK_ROUTE = 0
RTMGRP_IPV4_ROUTE = 0x40
RTMGRP_IPV6_ROUTE = 0x400
RTM_NEWROUTE, RTM_DELROUTE = 24, 25
RTA_DST = 1
SO_RCVBUFFORCE = 33
_NLMSGHDR = struct.Struct("=LHHLL")
_RTMSG = struct.Struct("=BBBBBBBBI")
_RTATTR = struct.Struct("=HH")


@dataclass(frozen=True)
class RouteEvent:
    node: str
    kind: str  # "add" | "del"
    dst: str  # "10.244.3.0/24", "fd00:10:244:3::/64"
    t: float  # time.time() when we read it


def parse_route_messages(data: bytes, protocol: int) -> list[tuple[str, str]]:
    """(kind, dst) for every IPv4 or IPv6 RTM_NEWROUTE/RTM_DELROUTE in ``data`` with ``protocol``."""
    out: list[tuple[str, str]] = []
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        length, mtype, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size or off + length > len(data):
            break
        if mtype in (RTM_NEWROUTE, RTM_DELROUTE) and length >= _NLMSGHDR.size + _RTMSG.size:
            body = off + _NLMSGHDR.size
            family, dst_len, _src_len, _tos, _table, proto, _scope, _rtype, _fl = _RTMSG.unpack_from(data, body)
            if family in (socket.AF_INET, socket.AF_INET6) and proto == protocol:
                size = 4 if family == socket.AF_INET else 16
                dst = socket.inet_ntop(family, bytes(size))
                a = body + _RTMSG.size
                end = off + length
                while a + _RTATTR.size <= end:
                    alen, atype = _RTATTR.unpack_from(data, a)
                    if alen < _RTATTR.size:
                        break
                    if atype == RTA_DST and alen >= _RTATTR.size + size:
                        dst = socket.inet_ntop(family, data[a + 4 : a + 4 + size])
                    a += (alen + 3) & ~3
                out.append(("add" if mtype == RTM_NEWROUTE else "del", f"{dst}/{dst_len}"))
        off += (length + 3) & ~3
    return out


class RouteWatch:
    """Route add/delete events (one protocol) in several namespaces, stamped as they arrive."""

    def __init__(self, namespaces: dict[str, Netns], protocol: int) -> None:
        self.protocol = protocol
        self.events: list[RouteEvent] = []
        self.overflows: list[str] = []  # nodes whose socket lost messages (ENOBUFS)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._socks: list[socket.socket] = []
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        for node, ns in namespaces.items():
            with ns.entered():
                sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 4 << 20)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            sock.bind((0, RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE))
            sock.setblocking(False)
            self._socks.append(sock)
            self._sel.register(sock, selectors.EVENT_READ, node)
        self._thread = threading.Thread(target=self._run, name="route-watch", daemon=True)

    def __enter__(self) -> RouteWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        for sock in self._socks:
            self._sel.unregister(sock)
            sock.close()
        self._socks.clear()
        self._sel.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.1):
                node, sock = key.data, key.fileobj
                while True:
                    try:
                        data = sock.recv(1 << 16)  # type: ignore[union-attr]
                    except BlockingIOError:
                        break
                    except OSError as err:
                        if err.errno == errno.ENOBUFS:
                            self.overflows.append(node)
                            continue
                        raise
                    now = time.time()
                    got = [RouteEvent(node, kind, dst, now) for kind, dst in parse_route_messages(data, self.protocol)]
                    if got:
                        with self._lock:
                            self.events.extend(got)
                            waiters = list(self._waiters)
                        for loop, event in waiters:
                            loop.call_soon_threadsafe(event.set)

    def snapshot(self, since: float = 0.0) -> list[RouteEvent]:
        with self._lock:
            return [e for e in self.events if e.t >= since]

    async def wait_for(self, check, timeout: float):
        """Re-run ``check(events)`` on every new event until it returns something not None."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._lock:
            self._waiters.append((loop, event))
        try:
            deadline = loop.time() + timeout
            while True:
                event.clear()
                result = check(self.snapshot())
                if result is not None:
                    return result
                left = deadline - loop.time()
                if left <= 0:
                    return None
                try:
                    await asyncio.wait_for(event.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            with self._lock:
                self._waiters.remove((loop, event))


# ---------------------------------------------------------------- agent logs

_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\w+)\s+(\S+): (.*)$")


@dataclass(frozen=True)
class LogLine:
    t: float
    logger: str
    message: str


def log_events(path: Path, since: float) -> list[LogLine]:
    """Timestamped lines of an agent log written at or after ``since`` (wall clock)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        m = _LOG_LINE.match(line)
        if not m:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if t >= since - 0.001:  # asctime truncates to the millisecond
            out.append(LogLine(t, m.group(3), m.group(4)))
    return out


def first(lines: Iterable[LogLine], pattern: str) -> float | None:
    rx = re.compile(pattern)
    for line in lines:
        if rx.search(line.message):
            return line.t
    return None


def all_times(lines: Iterable[LogLine], pattern: str) -> list[float]:
    rx = re.compile(pattern)
    return [line.t for line in lines if rx.search(line.message)]


# ---------------------------------------------------------------- process usage

CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcSample:
    cpu: float  # utime + stime, seconds
    child_cpu: float  # cutime + cstime (children it waited for, e.g. `nft`), seconds
    rss_kb: int
    hwm_kb: int
    threads: int
    ctx_switches: int  # voluntary + involuntary: how often it was woken up / switched


def proc_sample(pid: int) -> ProcSample | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): utime is field 14, stime 15, cutime 16, cstime 17.
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    values: dict[str, int] = {}
    for line in status.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0])
    return ProcSample(
        cpu=(utime + stime) / CLK_TCK,
        child_cpu=(cutime + cstime) / CLK_TCK,
        rss_kb=values.get("VmRSS", 0),
        hwm_kb=values.get("VmHWM", 0),
        threads=values.get("Threads", 0),
        ctx_switches=sum(t.ctx_switches for t in thread_samples(pid).values()),
    )


@dataclass(frozen=True)
class ThreadSample:
    comm: str
    cpu: float  # utime + stime, seconds
    ctx_switches: int


def thread_samples(pid: int) -> dict[int, ThreadSample]:
    """Per thread of ``pid``: its name, CPU seconds and context switches (what wakes it)."""
    out: dict[int, ThreadSample] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        ctx = 0
        for line in status.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                ctx += int(line.split()[1])
        out[int(tid)] = ThreadSample(comm, (int(fields[11]) + int(fields[12])) / CLK_TCK, ctx)
    return out


@dataclass(frozen=True)
class Usage:
    pid: int
    cpu_percent: float  # of one core, over the window
    child_cpu_percent: float
    rss_mb: float  # largest VmRSS seen during the window
    hwm_mb: float  # VmHWM at the end (peak since the process started)
    threads: int
    wakeups_per_s: float


async def sample_usage(pids: dict[str, int], seconds: float, interval: float = 1.0) -> dict[str, Usage]:
    """CPU and memory of each process over ``seconds``; processes that exit are left out."""
    start = {name: proc_sample(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    rss_max = {name: (s.rss_kb if s else 0) for name, s in start.items()}
    end: dict[str, ProcSample | None] = dict(start)
    while (left := seconds - (time.monotonic() - t0)) > 0:
        await asyncio.sleep(min(interval, left))
        for name, pid in pids.items():
            s = proc_sample(pid)
            end[name] = s
            if s is not None:
                rss_max[name] = max(rss_max[name], s.rss_kb)
    wall = time.monotonic() - t0
    out: dict[str, Usage] = {}
    for name, pid in pids.items():
        a, b = start[name], end[name]
        if a is None or b is None:
            continue
        out[name] = Usage(
            pid=pid,
            cpu_percent=100.0 * (b.cpu - a.cpu) / wall,
            child_cpu_percent=100.0 * (b.child_cpu - a.child_cpu) / wall,
            rss_mb=rss_max[name] / 1024,
            hwm_mb=b.hwm_kb / 1024,
            threads=b.threads,
            wakeups_per_s=(b.ctx_switches - a.ctx_switches) / wall,
        )
    return out


async def timed_exec(ns: Netns, *argv: str, timeout: float = 30) -> tuple[float, int]:
    """Wall seconds and exit status of one command run inside ``ns`` (``ip netns exec``)."""
    t0 = time.perf_counter()
    rc, _, _ = await ns.aexec(*argv, check=False, timeout=timeout)
    return time.perf_counter() - t0, rc
