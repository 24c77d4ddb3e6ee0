"""Route reflector at pod-network scale: N iBGP clients, one /26 each, against agentd, BIRD and GoBGP.

    .venv/bin/python bench/rr_scale.py [--n 100,300,1000,2000] [--only agentd,bird,gobgp]
         [--rounds R] [--clients agentd=peers,...] [--in-flight 8] [--withdraw 0.1]
         [--timeout S] [--until PHASE] [--profile DIR] [--quick] [--json FILE]

For every N, round and speaker (the route-reflector goals of BGP at pod-network scale): fresh namespaces -- the reflector's and
the clients', joined by one veth pair: the reflector at 10.1.0.1/16, the N clients at
10.1.1.1, 10.1.1.2, ... on one interface (250 per /24), with permanent neighbour entries
both ways, so no ARP and the kernel's global neighbour-table limit (gc_thresh3, 1024 by
default) does not drop packets at N = 2,000 -- and a fresh reflector process configured
for the clients (bench/_rr_speakers.py).  The client simulator (bench/_rrsim.py) runs as
its own process in the clients' namespace; client i announces 10.192.0.0 + 64 i / 26 with
NEXT_HOP = its own address, LOCAL_PREF 100, empty AS_PATH, as a pod-network node does.

Phases, each bounded by a timeout (a phase that exceeds it ends the run, reported as such):

    establish  paced connects: at most --in-flight connections between connect() and
               Established at once, until all N sessions are Established as the clients
               see them (OPEN and KEEPALIVE received, KEEPALIVE sent)
    converge   every client sends its UPDATE (and End-of-RIB) at once; from before the
               first send until every client holds exactly the N-1 prefixes of the others
    withdraw   --withdraw (10 %) of the clients, spread evenly, withdraw their prefix;
               until every client holds exactly the prefixes still announced, less its own

Between phases the benchmark waits (at most 30 s) for the reflector to go idle.  A session
that ends after Established (NOTIFICATION, reset, close) fails the run.  Readings:

    ready s      reflector process start -> port 179 listening (config load included)
    establish s  first connect() -> the last session Established (clients' clock)
    converge s   first UPDATE sent -> the last client holds all N-1 routes
    withdraw s   first withdrawal sent -> the last client has removed all of them
    UPDATEs      UPDATE messages all clients received in the phase, counted until no
                 UPDATE came for 1 s after the end (late duplicates included); the least
                 possible for convergence is N(N-1) when every route has its own
                 attributes (own NEXT_HOP and ORIGINATOR_ID), as here
    RR peak RSS  VmHWM of the reflector process at the end (peak over the whole run), MB
    RR cpu s     user + system CPU of the reflector in each phase (establish/converge/withdraw);
                 less sensitive to other load than wall time ("conv cpu vs ..." compares it)
    RR waiting   share of the convergence time the reflector was runnable but waiting for a
                 CPU (/proc schedstat, all threads): high means other load stretched the times
    sim cpu s    the client simulator's own CPU over the three phases (all N clients in one
                 process; it must stay well under the wall time, or it would be what is measured)
    silence s    the longest time any session went without a message from the reflector
                 while Established (its KEEPALIVE duty: under hold time / 3 is healthy)
    backlog      the listening socket's accept queue as the kernel has it (ss Send-Q)
    other load   busy CPU of the rest of the machine during the run, in cores (of 2 here)
    vs GoBGP / vs BIRD   this speaker's value / that speaker's (time, CPU and RSS: < 1 is better)

The table shows the fastest round per (N, speaker) by convergence time; --json has every round.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from ipaddress import IPv4Address
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentd.lab.netns import Netns, NetnsError, unique_tag, veth
from bench import _rrscan
from bench._common import int_list, judged, parse_bench_args, print_notes, print_table, require_root
from bench._rr_speakers import (
    REFLECTORS,
    RR_ADDR,
    RR_AS,
    Reflector,
    default_style,
    parse_styles,
)
from bench._speakers import (
    LABELS,
    BenchError,
    CpuMeter,
    SystemLoad,
    cpu_seconds,
    status_kb,
    tool,
)

SPEAKERS = ("agentd", "bird", "gobgp")
PHASES = ("establish", "converge", "withdraw")  # the steps below, in order
PREFIX_BASE = "10.192.0.0"
MAX_CLIENTS = 16_000  # 10.1.1.1 .. 10.1.64.250
READY_TIMEOUT = 180.0
IDLE_LIMIT = 30.0
SIM = Path(__file__).with_name("_rrsim.py")
# Issue 11's goals for agentd as the reflector: (metric, N values, other speaker, ratio at most).
GOALS = (
    ("converge", (1000, 2000), "gobgp", 1.0),
    ("converge", (1000, 2000), "bird", 3.0),
    ("rss", (2000,), "gobgp", 1.0),
    ("rss", (2000,), "bird", 4.0),
    ("establish", (2000,), "gobgp", 1.0),
)


def client_address(i: int) -> str:
    return f"10.1.{1 + i // 250}.{1 + i % 250}"


@dataclass
class RunResult:
    n: int
    speaker: str
    round: int
    style: str
    status: str = "error"  # ok, timeout, dropped, failed, error
    detail: str = ""
    ready: float | None = None
    listen_backlog: int | None = None
    establish: float | None = None
    converge: float | None = None
    withdraw: float | None = None
    withdrawn_clients: int | None = None
    updates_converge: int | None = None
    updates_withdraw: int | None = None
    prefixes_converge: int | None = None  # NLRI entries received in convergence
    peak_rss_mb: float | None = None
    rss_mb: float | None = None
    rr_cpu: dict[str, float] = field(default_factory=dict)  # per phase
    rr_waiting: dict[str, float] = field(default_factory=dict)  # s runnable but off a CPU, per phase
    sim_cpu: dict[str, float] = field(default_factory=dict)
    idle_waits: dict[str, float] = field(default_factory=dict)
    max_silence: float | None = None
    drops: int = 0
    connect_errors: int = 0
    other_load_cores: float | None = None
    replies: dict[str, dict] = field(default_factory=dict)

    @property
    def rr_cpu_total(self) -> float | None:
        return round(sum(self.rr_cpu.values()), 2) if self.rr_cpu else None

    @property
    def sim_cpu_total(self) -> float | None:
        return round(sum(self.sim_cpu.values()), 2) if self.sim_cpu else None


# --------------------------------------------------------------------------- the simulator process


class Simulator:
    """The client simulator process (bench/_rrsim.py) and its line protocol."""

    def __init__(self, ns: Netns, workdir: Path, n: int, lib: str) -> None:
        cfg = {"rr": RR_ADDR, "asn": RR_AS, "hold": 90, "base": int(IPv4Address(PREFIX_BASE)),
               "clients": [client_address(i) for i in range(n)], "scanner_lib": lib, "eor": True}
        path = workdir / "sim.json"
        path.write_text(json.dumps(cfg))
        self.log = workdir / "sim.log"
        with open(self.log, "wb") as log:
            self.proc = ns.popen([sys.executable, str(SIM), str(path)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=log)
        self.sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.buf = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"the client simulator did not answer within {timeout:.0f} s")
            if self.sel.select(min(left, 1.0)):
                assert self.proc.stdout is not None
                data = os.read(self.proc.stdout.fileno(), 65536)
                if not data:
                    raise BenchError(f"the client simulator exited: {self.log_tail()}")
                self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def command(self, cmd: dict, timeout: float) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self.read(timeout)

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.command({"cmd": "quit"}, 10)
            except (BenchError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.sel.close()


# --------------------------------------------------------------------------- one run


def build_namespaces(tag: str, n: int, made: list[Netns]) -> tuple[Netns, Netns]:
    rr_ns = Netns.create(f"ad-{tag}-rr")
    made.append(rr_ns)
    cl_ns = Netns.create(f"ad-{tag}-cl")
    made.append(cl_ns)
    veth(rr_ns, "rr0", cl_ns, "cl0")
    rr_ns.ip("addr", "add", f"{RR_ADDR}/16", "dev", "rr0")
    cl_mac = json.loads(cl_ns.ip("-j", "link", "show", "cl0").stdout)[0]["address"]
    rr_mac = json.loads(rr_ns.ip("-j", "link", "show", "rr0").stdout)[0]["address"]
    addrs = [client_address(i) for i in range(n)]
    # One ip -batch per namespace: N addresses on the clients' side, N permanent neighbours on
    # the reflector's (no ARP; permanent entries do not count against gc_thresh3).
    batch_cl = "".join(f"addr add {a}/16 dev cl0\n" for a in addrs)
    batch_cl += f"neigh replace {RR_ADDR} lladdr {rr_mac} dev cl0 nud permanent\n"
    batch_rr = "".join(f"neigh replace {a} lladdr {cl_mac} dev rr0 nud permanent\n" for a in addrs)
    for ns, batch in ((cl_ns, batch_cl), (rr_ns, batch_rr)):
        proc = subprocess.run(["ip", "-n", ns.name, "-batch", "-"], input=batch.encode(), check=False,
                              capture_output=True, timeout=120)
        if proc.returncode != 0:
            raise BenchError(f"ip -n {ns.name} -batch failed: {proc.stderr.decode(errors='replace').strip()[:300]}")
    got = cl_ns.ip("-4", "-o", "addr", "show", "dev", "cl0").stdout.decode().count("\n")
    if got != n:
        raise BenchError(f"the clients' namespace holds {got} addresses, not {n}")
    return rr_ns, cl_ns


def wait_idle(pid: int, limit: float) -> float:
    """Wait until the reflector used < 5 % of a CPU over 0.3 s (at most ``limit`` s); returns the wait."""
    meter = CpuMeter(pid)
    start = time.monotonic()
    prev_t, prev = start, meter.read()[0]
    while time.monotonic() - start < limit:
        time.sleep(0.3)
        now, run = time.monotonic(), meter.read()[0]
        if run - prev < 0.05 * (now - prev_t) * 1e9:
            break
        prev_t, prev = now, run
    return round(time.monotonic() - start, 2)


def timeouts(n: int, override: float | None) -> dict[str, float]:
    if override:
        return {"establish": override, "announce": override, "withdraw": override}
    routes = max(60.0, n * n * 3e-4)  # 300 s at N = 1,000, 1,200 s at 2,000
    return {"establish": max(60.0, n * 0.05), "announce": routes, "withdraw": routes}


def run_one(key: str, n: int, rnd: int, args: argparse.Namespace, lib: str) -> RunResult:
    style = args.clients.get(key) or default_style(key)
    r = RunResult(n, key, rnd, style)
    tag = unique_tag("rr")
    made: list[Netns] = []
    workdir = Path(tempfile.mkdtemp(prefix=f"ad-rr-scale-{key}-"))
    speaker: Reflector | None = None
    sim: Simulator | None = None
    profiler: subprocess.Popen | None = None
    limits = timeouts(n, args.timeout)
    try:
        rr_ns, cl_ns = build_namespaces(tag, n, made)
        speaker = REFLECTORS[key](rr_ns, workdir, [client_address(i) for i in range(n)], style)
        t_start = time.monotonic()
        speaker.start()
        while not speaker.listening():
            if not speaker.alive():
                raise BenchError(f"{speaker.label} exited at start: {speaker.log_tail()}")
            if time.monotonic() - t_start > READY_TIMEOUT:
                raise BenchError(f"{speaker.label} not listening on port 179 after {READY_TIMEOUT:.0f} s")
            time.sleep(0.05)
        r.ready = round(time.monotonic() - t_start, 2)
        r.listen_backlog = speaker.listen_backlog()
        pid = speaker.pid
        sim = Simulator(cl_ns, workdir, n, lib)
        hello = sim.read(60)
        if not hello.get("ready"):
            raise BenchError(f"the client simulator did not start: {hello}")
        if args.profile and key == "agentd":
            profiler = start_profiler(pid, Path(args.profile) / f"agentd-n{n}-r{rnd}")
        meter = CpuMeter(pid)
        busy0, self0 = SystemLoad.busy_seconds(), own_cpu()
        sim_cpu0 = cpu_seconds(sim.pid)
        t_run0 = time.monotonic()
        steps = [
            ("establish", {"cmd": "establish", "in_flight": args.in_flight}),
            ("announce", {"cmd": "announce", "quiet": 1.0, "quiet_max": 10.0}),
            ("withdraw", {"cmd": "withdraw", "fraction": args.withdraw, "quiet": 1.0, "quiet_max": 10.0}),
        ][: PHASES.index(args.until) + 1]
        for name, cmd in steps:
            if name != "establish":
                r.idle_waits[name] = wait_idle(pid, IDLE_LIMIT)
            cpu0, sched0 = sum(cpu_seconds(pid)), meter.read()
            limit = limits[name]
            reply = sim.command(dict(cmd, timeout=limit), limit + 60)
            r.replies[name] = reply
            if not speaker.alive():
                raise BenchError(f"{speaker.label} exited during {name}: {speaker.log_tail()}")
            r.rr_cpu[name] = round(sum(cpu_seconds(pid)) - cpu0, 2)
            sched1 = meter.read()
            r.rr_waiting[name] = round(((sched1[1] - sched1[0]) - (sched0[1] - sched0[0])) / 1e9, 2)
            r.sim_cpu[name] = reply.get("sim_cpu", 0.0)
            r.drops = reply.get("n_drops", 0)
            record(r, name, reply)
            if reply.get("status") != "ok":
                r.status = reply.get("status", "error")
                r.detail = describe_failure(name, reply, limit)
                break
        else:
            r.status = "ok"
        t_run1 = time.monotonic()
        stats = sim.command({"cmd": "stats"}, 60)
        r.replies["stats"] = stats
        r.max_silence = (stats.get("max_silence") or {}).get("seconds")
        r.connect_errors = stats.get("connect_errors", 0)
        if stats.get("n_drops"):
            first = stats["drops"][0]
            when = f"in {first['phase']}" if first.get("phase") else "between phases"
            why = (f"{stats['n_drops']} sessions dropped, first {when}: {first['why']}, "
                   f"{first['established_for']:.0f} s after Established, our last KEEPALIVE "
                   f"{first['last_keepalive_sent']:.0f} s before")
            repeated = "not Established" in r.detail or "session dropped" in r.detail
            r.detail = why + (f"; {r.detail}" if r.detail and not repeated else "")
            r.status = "dropped"
        if speaker.alive():
            r.peak_rss_mb = round(status_kb(pid, "VmHWM") / 1024, 1)
            r.rss_mb = round(status_kb(pid, "VmRSS") / 1024, 1)
            rr_all = sum(r.rr_cpu.values())
            sim_all = sum(cpu_seconds(sim.pid)) - sum(sim_cpu0)
            other = SystemLoad.busy_seconds() - busy0 - rr_all - sim_all - (own_cpu() - self0)
            r.other_load_cores = round(max(0.0, other) / max(1e-3, t_run1 - t_run0), 2)
    except (BenchError, NetnsError, OSError, ValueError, subprocess.SubprocessError) as err:
        tail = speaker.log_tail() if speaker is not None else ""
        r.detail = f"{err}" + (f"; log: {tail}" if tail and tail not in str(err) else "")
    finally:
        if profiler is not None:
            stop_profiler(profiler)
        if sim is not None:
            sim.stop()
        if speaker is not None:
            speaker.stop()
        for ns in reversed(made):
            ns.delete()
        shutil.rmtree(workdir, ignore_errors=True)
    return r


def record(r: RunResult, name: str, reply: dict) -> None:
    if name == "establish":
        if reply.get("t_end") is not None and reply.get("status") == "ok":
            r.establish = round(reply["t_end"] - reply["t_start"], 3)
        return
    done = reply.get("t_done")
    seconds = round(done - reply["t_start"], 3) if done is not None and reply.get("status") == "ok" else None
    if name == "announce":
        r.converge, r.updates_converge, r.prefixes_converge = seconds, reply.get("updates"), reply.get("announced")
    else:
        r.withdraw, r.updates_withdraw, r.withdrawn_clients = seconds, reply.get("updates"), reply.get("movers")
    if reply.get("mismatched"):
        r.detail += f"{name}: {reply['mismatched']} clients hold the wrong set; "
    if reply.get("foreign"):
        r.detail += f"{name}: {reply['foreign']} foreign prefixes; "


def describe_failure(name: str, reply: dict, limit: float) -> str:
    status = reply.get("status")
    if status == "timeout":
        if name == "establish":
            return f"establish: {reply.get('established')} of N Established after {limit:.0f} s"
        return (f"{name}: {reply.get('done')} clients complete after {limit:.0f} s "
                f"(held min {reply.get('min_held')}, max {reply.get('max_held')})")
    if status == "dropped":
        return f"{name}: session dropped: {(reply.get('drops') or [{}])[0]}"
    return f"{name}: {status}: {reply.get('detail') or reply}"


def own_cpu() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        u = resource.getrusage(who)
        total += u.ru_utime + u.ru_stime
    return total


def start_profiler(pid: int, out: Path) -> subprocess.Popen:
    exe = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if exe is None:
        raise BenchError("py-spy not found: `.venv/bin/pip install py-spy` (only --profile needs it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.log", "wb") as log:
        return subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", "50", "--format", "speedscope",
                                 "--output", f"{out}.speedscope.json", "--nonblocking"], stdout=log, stderr=log)


def stop_profiler(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- report


def summarize(results: list[RunResult]) -> dict[tuple[int, str], RunResult]:
    best: dict[tuple[int, str], RunResult] = {}
    for r in results:
        cur = best.get((r.n, r.speaker))
        if cur is None or (r.status == "ok" and (cur.status != "ok" or (r.converge or 1e9) < (cur.converge or 1e9))):
            best[(r.n, r.speaker)] = r
    return best


def metric(r: RunResult | None, name: str) -> float | None:
    """A phase's reading; set only when that phase completed (a later failure keeps it)."""
    if r is None:
        return None
    return {"establish": r.establish, "converge": r.converge, "withdraw": r.withdraw, "rss": r.peak_rss_mb,
            "cpu": r.rr_cpu_total, "converge_cpu": r.rr_cpu.get("announce")}[name]


def ratio(best, n: int, key: str, other: str, name: str) -> float | None:
    a, b = metric(best.get((n, key)), name), metric(best.get((n, other)), name)
    return a / b if a is not None and b else None


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def report(best: dict[tuple[int, str], RunResult], ns: list[int], keys: list[str], args: argparse.Namespace) -> None:
    rows1, rows2 = [], []
    for n in ns:
        for key in keys:
            r = best.get((n, key))
            if r is None:
                continue
            note = "" if r.status == "ok" else f"{r.status.upper()}: "
            note += r.detail.strip()
            if r.other_load_cores is not None and r.other_load_cores > 0.3:
                note += f"{'; ' if note else ''}other load {r.other_load_cores:.1f} cores"
            rows1.append([
                n, LABELS[key], r.style, fmt(r.ready, ".2f"), fmt(r.establish, ".2f"), fmt(r.converge, ".2f"),
                fmt(r.withdraw, ".2f"),
                fmt(ratio(best, n, key, "gobgp", "establish"), ".2f", "x"),
                fmt(ratio(best, n, key, "gobgp", "converge"), ".2f", "x"),
                fmt(ratio(best, n, key, "bird", "converge"), ".2f", "x"),
                fmt(ratio(best, n, key, "gobgp", "withdraw"), ".2f", "x"),
                fmt(ratio(best, n, key, "bird", "withdraw"), ".2f", "x"),
                note,
            ])
            conv_wall = r.converge or (r.replies.get("announce", {}).get("t_reply", 0)
                                       - r.replies.get("announce", {}).get("t_start", 0))
            waiting = r.rr_waiting.get("announce")
            rows2.append([
                n, LABELS[key], fmt(r.updates_converge, ",d"), fmt(r.updates_withdraw, ",d"),
                fmt(r.peak_rss_mb, ".0f"), fmt(ratio(best, n, key, "gobgp", "rss"), ".2f", "x"),
                fmt(ratio(best, n, key, "bird", "rss"), ".2f", "x"),
                "/".join(fmt(r.rr_cpu.get(p), ".1f") for p in ("establish", "announce", "withdraw")),
                fmt(ratio(best, n, key, "gobgp", "converge_cpu"), ".2f", "x"),
                fmt(ratio(best, n, key, "bird", "converge_cpu"), ".2f", "x"),
                fmt(100 * waiting / conv_wall if waiting is not None and conv_wall and conv_wall > 0 else None,
                    ".0f", "%"),
                fmt(r.sim_cpu_total, ".2f"), fmt(r.max_silence, ".1f"), r.listen_backlog or "-",
                fmt(r.other_load_cores, ".2f"),
            ])
    how = f"fastest of {args.rounds} rounds" if args.rounds > 1 else "one round"
    print_table(
        f"Route reflector, N clients one /26 each: times in seconds ({how})",
        ["N", "speaker", "clients", "ready", "establish", "converge", "withdraw", "est vs GoBGP",
         "conv vs GoBGP", "conv vs BIRD", "wd vs GoBGP", "wd vs BIRD", "note"],
        rows1,
    )
    print_table(
        "Route reflector: work and resources (same runs)",
        ["N", "speaker", "UPDATEs conv", "UPDATEs wd", "RR peak RSS MB", "RSS vs GoBGP", "RSS vs BIRD",
         "RR cpu s est/conv/wd", "conv cpu vs GoBGP", "conv cpu vs BIRD", "RR waiting", "sim cpu s",
         "silence s", "backlog", "other load"],
        rows2,
    )
    print_notes("method", [
        f"establish: {args.in_flight} connects in flight; withdraw: {args.withdraw:.0%} of the clients",
        ("UPDATEs: received by all clients together, until 1 s without one; least possible for "
         "convergence N(N-1) (every route has its own NEXT_HOP and ORIGINATOR_ID)"),
        "ratios: this speaker's time (or RSS) / the other's; < 1 is better",
        ("sim cpu s: the client simulator's CPU over the three phases, all N clients in one process "
         "(C receive path, bench/_rrscan.c)"),
    ])
    if "agentd" in keys:
        lines = []
        for name, n_values, other, limit in GOALS:
            for n in n_values:
                if n not in ns or other not in keys:
                    continue
                got = ratio(best, n, "agentd", other, name)
                shown, verdict = ("no result", "n/a") if got is None else judged(got, limit, at_least=False, decimals=2)
                failed = [k for k in ("agentd", other) if best[(n, k)].status != "ok"]
                if got is not None and failed:
                    verdict = f"NOT met ({' and '.join(LABELS[k] for k in failed)} run failed later)"
                lines.append(f"N={n}: agentd {name} <= {limit:.1f}x {LABELS[other]}: {shown}  {verdict}")
        if lines:
            print_notes("goals (BGP at pod-network scale)", lines)


# --------------------------------------------------------------------------- main


def _counts(text: str) -> list[int]:
    try:
        values = int_list(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if any(v < 2 or v > MAX_CLIENTS for v in values):
        raise argparse.ArgumentTypeError(f"client counts must be 2..{MAX_CLIENTS}, got {text!r}")
    return values


def _speaker_list(text: str) -> list[str]:
    keys = [k.strip().lower() for k in text.split(",") if k.strip()]
    if not keys or any(k not in SPEAKERS for k in keys):
        raise argparse.ArgumentTypeError(f"expected a list of {','.join(SPEAKERS)}, got {text!r}")
    return [k for k in SPEAKERS if k in keys]


def _styles(text: str) -> dict[str, str]:
    try:
        return parse_styles(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text!r}")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rr_scale", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=_counts, default=[100, 300, 1000, 2000], help="client counts (default 100,300,1000,2000)")
    p.add_argument("--only", type=_speaker_list, default=list(SPEAKERS), help="subset of agentd,bird,gobgp")
    p.add_argument("--rounds", type=int, default=1, choices=range(1, 11), metavar="R",
                   help="run every (N, speaker) R times, speakers interleaved; the table shows the fastest")
    p.add_argument("--clients", type=_styles, default={},
                   help="how each reflector is told about its clients: SPEAKER=range|peers,... "
                   "(default: range; agentd peers until it has [[bgp.listen_ranges]])")
    p.add_argument("--in-flight", type=int, default=8, choices=range(1, 1025), metavar="K",
                   help="connections between connect() and Established at once (default 8)")
    p.add_argument("--withdraw", type=_fraction, default=0.1, help="share of the clients that withdraw (default 0.1)")
    p.add_argument("--timeout", type=_positive,
                   help="seconds per phase (default: establish max(60, 0.05 N), routes max(60, 3e-4 N^2))")
    p.add_argument("--until", choices=PHASES, default="withdraw",
                   help="stop after this phase (e.g. establish: session setup alone; default withdraw)")
    p.add_argument("--profile", metavar="DIR", help="py-spy record agentd during its runs into DIR (speedscope)")
    p.add_argument("--report", metavar="JSON", nargs="+",
                   help="print the tables of earlier --json files (merged; nothing is run)")
    return parse_bench_args(p, argv, name="rr_scale", quick={"n": [100]})


def _progress(r: RunResult) -> None:
    print(
        f"  N={r.n} round {r.round} {LABELS[r.speaker]:<7} [{r.style}] {r.status}: ready {fmt(r.ready, '.2f')} s, "
        f"establish {fmt(r.establish, '.2f')} s, converge {fmt(r.converge, '.2f')} s, withdraw "
        f"{fmt(r.withdraw, '.2f')} s; UPDATEs {fmt(r.updates_converge, ',d')}/{fmt(r.updates_withdraw, ',d')}; "
        f"RR peak {fmt(r.peak_rss_mb, '.0f')} MB, cpu {r.rr_cpu}; sim cpu {r.sim_cpu}; "
        f"silence {fmt(r.max_silence, '.1f')} s; other load {fmt(r.other_load_cores, '.2f')}"
        + (f"; {r.detail}" if r.detail else ""),
        flush=True,
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def load_runs(paths: list[str]) -> list[RunResult]:
    names = {f.name for f in fields(RunResult)}
    runs = []
    for path in paths:
        for raw in json.loads(Path(path).read_text())["runs"]:
            runs.append(RunResult(**{k: v for k, v in raw.items() if k in names}))
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        try:
            results = load_runs(args.report)
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"rr_scale: cannot read {' '.join(args.report)}: {err}", file=sys.stderr)
            return 2
        ns = sorted({r.n for r in results})
        keys = [k for k in SPEAKERS if any(r.speaker == k for r in results)]
        args.rounds = max(r.round for r in results) if results else 1
        report(summarize(results), ns, keys, args)
        return 0
    require_root("bench/rr_scale.py")
    try:
        for key in args.only:
            for name in {"bird": ("bird",), "gobgp": ("gobgpd",)}.get(key, ()):
                tool(name)
            if args.clients.get(key) == "range" and key == "agentd" and default_style("agentd") != "range":
                raise BenchError("this agentd has no [[bgp.listen_ranges]] yet: use --clients agentd=peers")
        lib = _rrscan.build()
    except (BenchError, _rrscan.ScanBuildError) as err:
        print(f"rr_scale: {err}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    with open("/proc/loadavg") as f:
        print(f"load average before: {' '.join(f.read().split()[:3])} on {os.cpu_count()} CPUs", flush=True)
    results: list[RunResult] = []
    try:
        for n in args.n:
            for rnd in range(1, args.rounds + 1):
                for key in args.only:
                    r = run_one(key, n, rnd, args, lib)
                    results.append(r)
                    _progress(r)
    except KeyboardInterrupt:
        print("interrupted; the run in progress removed its namespaces", file=sys.stderr)
        return 130
    best = summarize(results)
    report(best, args.n, args.only, args)
    with open("/proc/loadavg") as f:
        print(f"\nload average after: {' '.join(f.read().split()[:3])}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"argv": sys.argv[1:], "runs": [dict(asdict(r), rr_cpu_total=r.rr_cpu_total) for r in results]},
            indent=1))
    return 0 if best and all(r.status == "ok" for r in best.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
