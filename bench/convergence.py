"""Convergence in the lab: join and leave times, idle CPU and memory per agent.

    .venv/bin/python bench/convergence.py [--nodes 3,5,10] [--modes mesh,route-reflector]
        [--families ipv4,dual,ipv6] [--rounds 3] [--backend host-gw] [--settle 10] [--idle-seconds 25]
        [--lab-timeout SECONDS]
        [--leave-via cli|light] [--keep-logs] [--no-bytecode-cache] [--quick] [--json FILE]

Large labs (BGP at pod-network scale), bounded to about 15 minutes on 2 cores:

    .venv/bin/python bench/convergence.py --nodes 10,50,100 --modes mesh,route-reflector \
        --rounds 2 --settle 5 --idle-seconds 15

For every (N, mode, family) a lab with N nodes and no pods comes up (route-reflector mode:
nodes 1 and 2 reflect; family: agentd lab --ip-family, IPv4 by default, "dual" and "ipv6"
rows beside it: a dual-stack node leases, originates and routes two subnets).  X is the last
node, never a reflector.  Each round:

  leave  t0 just before ``agentd leave`` runs in X's namespace (LabNode.leave: the CLI, which
         POSTs /leave to the running agent); t1 when X's subnet routes (both, dual-stack) are
         deleted from the kernel of the LAST other node.
  join   X's agent is gone; t0 just before ``agentd run`` is spawned (LabNode.start_agent);
         t1 when X's new subnet routes (one per family) are in the kernel of the LAST other node.

Route times come from one NETLINK_ROUTE socket per other node (RTMGRP_IPV4_ROUTE and _IPV6_, stamped
as the kernel reports the change), not from polling.  The agent's log (same wall clock,
millisecond stamps) splits the totals: for join, process start-up (Python + imports, up to
"API listening") -> subnet lease -> BGP Established -> routes; for leave, the CLI's own
start-up (up to the agent logging "shutting down") -> routes gone.  The interpreter and CLI
start-up are also timed on their own in X's namespace.  ``--leave-via light`` replaces the
CLI by a Python one-liner that imports only agentd.cli and POSTs /leave: what `agentd leave`
would cost if it did not import the daemon.

Idle: after the rounds and ``--settle`` seconds, every agent (and any other process in the
node namespaces, e.g. a user-space data-plane worker) is sampled for ``--idle-seconds``:
CPU from /proc/<pid>/stat utime+stime, memory from /proc/<pid>/status VmRSS/VmHWM.

The lab's timers (BGP hold, keepalive, connect retry, etcd lease TTL...) are read back from
X's configuration file as the agent loads it and printed with the tables: every figure
depends on them (a leave without `agentd leave` would take a hold time).

Goals of the node agent: join and leave under 1 s at 10 nodes; an idle agent under 1% CPU and 80 MB RSS.
Goal of BGP at pod-network scale: join under 2 s in a 50-node mesh.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit_json, int_list, judged, median, parse_bench_args, print_notes, print_table, require_root  # noqa: E402
from bench._lab_timing import (  # noqa: E402
    RouteWatch,
    all_times,
    first,
    log_events,
    sample_usage,
    thread_samples,
    timed_exec,
)

from agentd.backend_table import NAMES  # noqa: E402
from agentd.config.settings import ConfigError, load_config  # noqa: E402
from agentd.lab.lab import MAX_NODES, Lab, LabError, LabNode, LabSpec, stage_timeout  # noqa: E402
from agentd.lab.runtime import binary  # noqa: E402
from agentd.lab.netns import NetnsError  # noqa: E402
from agentd.kernel.route_model import RTPROT_AGENTD  # noqa: E402

MODES = ("mesh", "route-reflector")
FAMILIES = ("ipv4", "dual", "ipv6")
VERSIONS = {"ipv4": (4,), "dual": (4, 6), "ipv6": (6,)}
BACKENDS = NAMES
REFLECTORS = 2
GOAL_CPU_PERCENT = 1.0
GOAL_RSS_MB = 80.0
# (nodes, modes, what, seconds, where the goal is stated)
GOALS = (
    (10, MODES, ("join", "leave"), 1.0, "the node agent's goal"),
    (50, ("mesh",), ("join",), 2.0, "the pod-network-scale goal"),
)
WAIT = 30.0  # longest we wait for one join or leave to converge (labs up to 50 nodes)


def wait_for(nodes: int) -> float:
    """Seconds to wait for one join or leave to converge in a lab of ``nodes``."""
    return max(WAIT, 0.6 * nodes)


def default_lab_timeout(nodes: int) -> float:
    """--lab-timeout unless given: lab up, the rounds, the idle sample; 300 s up to 50 nodes."""
    return max(300.0, 6.0 * nodes)


class BenchError(RuntimeError):
    """One configuration could not be measured; the message says which step."""


# ---------------------------------------------------------------- one round


def _others(lab: Lab, x: LabNode) -> list[LabNode]:
    return [n for n in lab.nodes if n is not x]


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else t - t0


# What `agentd leave` costs when it does not import the daemon: the CLI module and one POST.
# What `agentd leave` costs when it does not import the daemon: the CLI module and one POST
# with the node's API token (argv[1]: its [api] token_file).
LIGHT_LEAVE = (
    "import agentd.cli, sys, urllib.request\n"
    "token = open(sys.argv[1]).read().strip()\n"
    "req = urllib.request.Request('http://127.0.0.1:9099/leave', method='POST', data=b'',\n"
    "                             headers={'Authorization': 'Bearer ' + token})\n"
    "urllib.request.urlopen(req, timeout=10).read()\n"
)


async def _leave(x: LabNode, via: str) -> None:
    if via == "cli":
        await x.leave()
        return
    rc, _, err = await x.ns.aexec(sys.executable, "-c", LIGHT_LEAVE, str(x.token_path), check=False, timeout=30)
    if rc != 0:
        raise LabError(f"{x.name}: POST /leave failed: {err.decode(errors='replace').strip()[-200:]}")


async def measure_leave(lab: Lab, x: LabNode, watch: RouteWatch, via: str = "cli") -> dict[str, Any]:
    wait = wait_for(len(lab.nodes))
    others = _others(lab, x)
    subnets = lab.all_subnets()[x.name]
    if len(subnets) != len(VERSIONS[lab.spec.ip_family]):
        raise BenchError(f"{x.name} reports subnets {subnets} before leave")
    subnet = " ".join(subnets)
    missing = [n.name for n in others for s in subnets if not any(line.startswith(s + " ") for line in n.kernel_routes())]
    if missing:
        raise BenchError(f"{subnet} of {x.name} not routed on {', '.join(missing)} before leave")

    cli_done: list[float] = []

    async def run_cli() -> None:
        await _leave(x, via)
        cli_done.append(time.time())

    t0 = time.time()
    cli = asyncio.create_task(run_cli())
    exit_watch = asyncio.create_task(_wait_exit(x, wait + 5))

    def gone_everywhere(events):
        dels: dict[tuple[str, str], float] = {}
        for e in events:
            if e.t >= t0 and e.kind == "del" and e.dst in subnets:
                dels.setdefault((e.node, e.dst), e.t)
        if len(dels) != len(others) * len(subnets):
            return None
        per: dict[str, float] = {}
        for (node, _dst), t in dels.items():
            per[node] = max(per.get(node, 0.0), t)  # a node is done once both subnets are gone
        return per

    gone = await watch.wait_for(gone_everywhere, wait)
    try:
        await asyncio.wait_for(cli, wait)
        exited = await exit_watch
    except LabError as err:
        raise BenchError(str(err)) from None
    finally:
        exit_watch.cancel()
    if gone is None:
        left = [n.name for n in others for s in subnets if any(line.startswith(s + " ") for line in n.kernel_routes())]
        raise BenchError(f"leave: {subnet} still routed on {', '.join(left)} after {wait:.0f}s")
    lines = log_events(x.log_path, t0)
    request = first(lines, r"^shutting down")
    t1 = max(gone.values())
    return {
        "subnet": subnet,
        "total": t1 - t0,
        "request_at_agent": _rel(request, t0),  # the CLI's start-up and its POST /leave
        "agent_side": None if request is None else t1 - request,
        "peer_down": _rel(first(lines, r"^peer \S+ down"), t0),
        "first_gone": min(gone.values()) - t0,
        "all_gone": t1 - t0,
        "etcd_released": _rel(first(lines, r"^left the cluster"), t0),
        "cli_exit": _rel(cli_done[0] if cli_done else None, t0),
        "agent_exit": _rel(exited, t0),
        "per_node": {k: v - t0 for k, v in sorted(gone.items())},
    }


async def _wait_exit(x: LabNode, timeout: float) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if x.proc is None or x.proc.poll() is not None:
            return time.time()
        await asyncio.sleep(0.01)
    return None


async def measure_join(lab: Lab, x: LabNode, watch: RouteWatch) -> dict[str, Any]:
    wait = wait_for(len(lab.nodes))
    others = _others(lab, x)
    known = {s for name, mine in lab.all_subnets().items() if name != x.name for s in mine}
    families = len(VERSIONS[lab.spec.ip_family])
    t0 = time.time()
    x.start_agent()

    def routed_everywhere(events):
        adds = [e for e in events if e.t >= t0 and e.kind == "add" and e.dst not in known]
        dsts = list(dict.fromkeys(e.dst for e in adds))[:families]  # X's new subnet of each family
        if len(dsts) < families:
            return None
        per: dict[tuple[str, str], float] = {}
        for e in adds:
            if e.dst in dsts:
                per.setdefault((e.node, e.dst), e.t)
        if len(per) != len(others) * families:
            return None
        done: dict[str, float] = {}
        for (node, _dst), t in per.items():
            done[node] = max(done.get(node, 0.0), t)
        return " ".join(dsts), done

    got = await watch.wait_for(routed_everywhere, wait)
    if got is None:
        raise BenchError(
            f"join: {x.name}'s subnet not routed on every other node within {wait:.0f}s (log {x.log_path})"
        )
    dst, per = got
    # Let X finish (every session up, ready) before reading its log for the breakdown.
    try:
        await lab.ready.established(wait, [x])
        await lab.ready.routes(wait)
    except LabError as err:
        raise BenchError(f"after join: {err}") from None
    lines = log_events(x.log_path, t0)
    holds = [ln for ln in lines if re.match(r"^node \S+ holds subnet", ln.message)]
    established = all_times(lines, r"^peer \S+ established")
    expected = lab.ready.expected_peers(x)
    t1 = max(per.values())
    api_up = first(lines, r"^API listening")
    return {
        "subnet": dst,
        "lease_subnet": holds[0].message.split()[4] if holds else None,
        "total": t1 - t0,
        "api_up": _rel(api_up, t0),  # process start-up: interpreter, imports, config, API
        "agent_side": None if api_up is None else t1 - api_up,
        "etcd_connected": _rel(first(lines, r"^etcd reachable"), t0),
        "lease_held": _rel(holds[0].t if holds else None, t0),
        "registered": _rel(first(lines, r"^registered node"), t0),
        "established_first": _rel(min(established) if established else None, t0),
        "established_last": _rel(sorted(established)[expected - 1] if len(established) >= expected else None, t0),
        "route_first": min(per.values()) - t0,
        "route_all": t1 - t0,
        "ready": _rel(first(lines, r"^ready$"), t0),
        "per_node": {k: v - t0 for k, v in sorted(per.items())},
    }


# ---------------------------------------------------------------- start-up and idle


async def startup_times(x: LabNode, repeats: int) -> dict[str, float]:
    """Median wall seconds of bare start-ups in X's namespace (``ip netns exec`` included)."""
    python = sys.executable
    commands = {
        "python -c pass": [python, "-c", "pass"],
        "agentd --version": [binary("agentd"), "--version"],
        "import agentd.daemon.agent": [python, "-c", "import agentd.daemon.agent, uvloop"],
    }
    out = {}
    for label, argv in commands.items():
        times = []
        for _ in range(repeats):
            seconds, rc = await timed_exec(x.ns, *argv)
            if rc != 0:
                raise BenchError(f"{' '.join(argv)} exited {rc} in {x.ns.name}")
            times.append(seconds)
        out[label] = median(times)
    return out


async def idle_usage(lab: Lab, seconds: float) -> dict[str, Any]:
    agents: dict[str, int] = {}
    workers: dict[str, int] = {}
    for n in lab.nodes:
        pid = n.agent_pid()
        if pid is None:
            raise BenchError(f"{n.name}: no agent running before the idle sample (log {n.log_path})")
        agents[n.name] = pid
        for other in n.ns.pids():
            if other != pid:
                workers[f"{n.name}:{other}"] = other
    busiest = lab.nodes[0].name  # a reflector in route-reflector mode, a mesh member otherwise
    threads_before = thread_samples(agents[busiest])
    usage = await sample_usage({**agents, **workers}, seconds)
    threads_after = thread_samples(agents[busiest])
    threads = []
    for tid, after in threads_after.items():
        before = threads_before.get(tid)
        if before is not None:
            threads.append({
                "tid": tid, "comm": after.comm,
                "cpu_percent": 100.0 * (after.cpu - before.cpu) / seconds,
                "wakeups_per_s": (after.ctx_switches - before.ctx_switches) / seconds,
            })  # fmt: skip
    agent_usage = {k: v.__dict__ for k, v in usage.items() if k in agents}
    if len(agent_usage) != len(agents):
        raise BenchError(f"agents exited during the idle sample: {sorted(set(agents) - set(agent_usage))}")
    return {
        "seconds": seconds,
        "agents": agent_usage,
        "workers": {k: v.__dict__ for k, v in usage.items() if k in workers},
        "threads_of": busiest,
        "threads": sorted(threads, key=lambda t: -t["cpu_percent"]),
    }


# ---------------------------------------------------------------- one configuration


async def measure_config(nodes: int, mode: str, args: argparse.Namespace, family: str = "ipv4") -> dict[str, Any]:
    name = "cv" + secrets.token_hex(3)
    root = Path(tempfile.mkdtemp(prefix=f"agentd-cv-{name}-"))
    spec = LabSpec(name=name, nodes=nodes, pods=0, bgp=mode, reflectors=REFLECTORS, backend=args.backend,
                   ip_family=family)
    lab = Lab(spec, root=root, progress=lambda line: print(line, file=sys.stderr, flush=True))
    result: dict[str, Any] = {"nodes": nodes, "mode": mode, "family": family, "backend": args.backend, "lab": name}
    print(f"== {nodes} nodes, {mode}, {family}: lab {name} (files {root})", file=sys.stderr, flush=True)
    limit = args.lab_timeout or default_lab_timeout(nodes)
    try:
        result.update(await asyncio.wait_for(_measure(lab, args, limit), limit))
    except asyncio.TimeoutError:
        result["error"] = f"did not finish within {limit:.0f}s (--lab-timeout)"
    except (BenchError, LabError, NetnsError, OSError) as err:
        result["error"] = str(err)
    finally:
        t_down = time.monotonic()
        await lab.down(keep_files=args.keep_logs)
        result["lab_down_s"] = time.monotonic() - t_down
        if args.keep_logs:
            result["files"] = str(root)
        else:
            shutil.rmtree(root, ignore_errors=True)
    if "error" in result:
        print(f"   {nodes} nodes, {mode}, {family}: FAILED: {result['error']}", file=sys.stderr, flush=True)
    return result


async def _measure(lab: Lab, args: argparse.Namespace, limit: float) -> dict[str, Any]:
    t_up = time.monotonic()
    await lab.up(timeout=min(stage_timeout(lab.spec.nodes), limit))
    up_seconds = time.monotonic() - t_up
    x = lab.nodes[-1]
    if x.reflector:
        raise BenchError(f"{x.name} is a route reflector; use more nodes than --reflectors")
    out: dict[str, Any] = {"lab_up_s": up_seconds, "node": x.name, "leave": [], "join": [],
                           "timers": lab_timers(lab, x)}
    with RouteWatch({n.name: n.ns for n in _others(lab, x)}, RTPROT_AGENTD) as watch:
        await asyncio.sleep(1.0)  # past the End-of-RIB reconciles of the start
        out["startup"] = await startup_times(x, 3)
        for r in range(args.rounds):
            leave = await measure_leave(lab, x, watch, args.leave_via)
            out["leave"].append(leave)
            await asyncio.sleep(1.0)  # the others un-peer X (etcd watch) before it comes back
            join = await measure_join(lab, x, watch)
            out["join"].append(join)
            print(
                f"   round {r + 1}: leave {leave['total']:.3f} s (agent side {_f(leave['agent_side'])}),"
                f" join {join['total']:.3f} s (after start-up {_f(join['agent_side'])})",
                file=sys.stderr,
                flush=True,
            )
            await asyncio.sleep(1.0)
        out["route_watch_overflows"] = sorted(set(watch.overflows))
    await asyncio.sleep(args.settle)
    out["idle"] = await idle_usage(lab, args.idle_seconds)
    return out


def lab_timers(lab: Lab, x: LabNode) -> dict[str, Any]:
    """The timers every figure depends on, as X's agent reads them from its configuration file."""
    try:
        cfg = load_config(x.config_path, env={}, require_file=True)
    except ConfigError as err:
        raise BenchError(f"{x.name}: cannot read back {x.config_path}: {err}") from None
    bgp = cfg.bgp
    return {
        "bgp_hold_s": bgp.hold_time,
        "bgp_keepalive_s": bgp.keepalive_time,
        "bgp_connect_retry_s": bgp.connect_retry,
        "bgp_batch_delay_s": bgp.batch_delay,
        "bgp_graceful_restart": bgp.graceful_restart,
        "bgp_restart_time_s": bgp.restart_time,
        "bfd": f"{bgp.bfd_interval:g} s x {bgp.bfd_multiplier}" if bgp.bfd else "off",
        "etcd_lease_ttl_s": cfg.etcd.lease_ttl,
        "static_neighbors": lab.static_neighbors,
    }


def timer_lines(ok: list[dict]) -> list[str]:
    lines = []
    for timers in {repr(r["timers"]): r["timers"] for r in ok if "timers" in r}.values():
        sizes = ", ".join(f"{r['nodes']} {r['mode']}" for r in ok if r.get("timers") == timers)
        lines.append(
            f"BGP hold {timers['bgp_hold_s']} s, keepalive {timers['bgp_keepalive_s']} s, connect retry "
            f"{timers['bgp_connect_retry_s']:g} s, update batch delay {timers['bgp_batch_delay_s']:g} s, graceful "
            f"restart {'on, restart time ' + str(timers['bgp_restart_time_s']) + ' s' if timers['bgp_graceful_restart'] else 'off'}"
            f", BFD {timers['bfd']}; etcd lease TTL {timers['etcd_lease_ttl_s']} s; underlay neighbours "
            f"{'permanent entries' if timers['static_neighbors'] else 'ARP'} ({sizes})"
        )
    return lines


def _f(v: float | None, unit: str = " s") -> str:
    return "-" if v is None else f"{v:.3f}{unit}"


# ---------------------------------------------------------------- report


def _mode(r: dict) -> str:
    """The mode column of the breakdown tables: the mode, and the family where it is not IPv4."""
    return r["mode"] if r.get("family", "ipv4") == "ipv4" else f"{r['mode']}, {r['family']}"


def _med(rounds: list[dict], key: str) -> float | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return median(values) if values else None


def _mm(rounds: list[dict], key: str) -> str:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return f"{median(values):.3f} / {max(values):.3f}" if values else "-"


def _avg_max(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    return f"{fmt.format(sum(values) / len(values))} / {fmt.format(max(values))}"


def report(results: list[dict], args: argparse.Namespace) -> None:
    ok = [r for r in results if "error" not in r]
    print_table(
        f"Convergence in the lab (backend {args.backend}, {args.rounds} rounds, X = last node, leave via "
        f"{'`agentd leave`' if args.leave_via == 'cli' else 'a light POST /leave'}; median / max)",
        ["nodes", "mode", "family", "join (s)", "leave (s)", "idle CPU avg / max (%)", "RSS avg / max (MB)",
         "lab up (s)", "lab down (s)"],
        [
            (r["nodes"], r["mode"], r["family"], _mm(r["join"], "total"), _mm(r["leave"], "total"),
             _avg_max([a["cpu_percent"] for a in r["idle"]["agents"].values()]),
             _avg_max([a["rss_mb"] for a in r["idle"]["agents"].values()], "{:.1f}"),
             f"{r['lab_up_s']:.1f}", f"{r['lab_down_s']:.1f}")
            for r in ok
        ] + [(r["nodes"], r["mode"], r["family"], "FAILED", r["error"][:60], "", "", "", "")
             for r in results if "error" in r],
    )  # fmt: skip
    print_notes("IPv6 beside IPv4 (median join / leave over the IPv4 row of the same size and mode)",
                family_lines(ok))
    print_table(
        "Join, seconds after `agentd run` was spawned (median); 'after start-up' = routes everywhere - API up",
        ["nodes", "mode", "API up", "lease held", "registered", "BGP est. first", "last", "route first", "route all",
         "after start-up (med / max)"],
        [
            (r["nodes"], _mode(r), *(_f(_med(r["join"], k), "") for k in (
                "api_up", "lease_held", "registered", "established_first", "established_last", "route_first",
                "route_all")), _mm(r["join"], "agent_side"))
            for r in ok
        ],
    )  # fmt: skip
    print_table(
        "Leave, seconds after the leave command was started (median); 'agent side' = routes gone everywhere - "
        "request",
        ["nodes", "mode", "request at agent", "peer down", "route first gone", "all gone", "agent side (med / max)",
         "CLI exit", "agent exit"],
        [
            (r["nodes"], _mode(r), *(_f(_med(r["leave"], k), "") for k in (
                "request_at_agent", "peer_down", "first_gone", "all_gone")), _mm(r["leave"], "agent_side"),
             _f(_med(r["leave"], "cli_exit"), ""), _f(_med(r["leave"], "agent_exit"), ""))
            for r in ok
        ],
    )  # fmt: skip
    print_table(
        "Start-up alone in X's namespace (median of 3, seconds, `ip netns exec` included)",
        ["nodes", "mode", "python -c pass", "agentd --version", "import agentd.daemon.agent, uvloop"],
        [(r["nodes"], _mode(r), *(f"{v:.3f}" for v in r["startup"].values())) for r in ok],
    )
    rows = []
    for r in ok:
        agents = list(r["idle"]["agents"].values())
        workers = list(r["idle"]["workers"].values())
        top = r["idle"]["threads"][:3]
        rows.append((
            r["nodes"], _mode(r),
            _avg_max([a["wakeups_per_s"] for a in agents], "{:.1f}"),
            _avg_max([a["hwm_mb"] for a in agents], "{:.1f}"),
            max(a["threads"] for a in agents),
            _avg_max([a["child_cpu_percent"] for a in agents]),
            f"{len(workers)}: " + _avg_max([w["cpu_percent"] for w in workers]) if workers else "none",
            ", ".join(f"{t['comm']} {t['cpu_percent']:.2f}%/{t['wakeups_per_s']:.0f}w" for t in top),
        ))  # fmt: skip
    print_table(
        f"Idle agents over {args.idle_seconds:.0f} s, {args.settle:.0f} s after the rounds (avg / max over agents)",
        ["nodes", "mode", "wakeups/s", "VmHWM (MB)", "threads", "children CPU (%)", "other processes CPU (%)",
         "node1's busiest threads (CPU %/wakeups/s)"],
        rows,
    )
    print_notes("Lab timers (X's configuration as the agent loads it)", timer_lines(ok))
    print_notes("Goals", goal_lines(results, args))
    load = os.getloadavg()
    print_notes("Conditions", [
        f"{os.cpu_count()} CPUs, load average at start {args.load[0]:.2f} / now {load[0]:.2f} (other work on the "
        "machine shifts every figure)",
        "join/leave from `ip monitor`-equivalent netlink events in every other node's namespace; breakdowns from "
        "the agent's own log (millisecond stamps)",
        "start-up times include `ip netns exec`; 'import agentd.daemon.agent, uvloop' is what `agentd run` imports "
        "before it can do anything",
        f"bytecode: {args.bytecode}",
    ])  # fmt: skip


def family_lines(ok: list[dict]) -> list[str]:
    """Join and leave of the dual-stack and IPv6-only rows against their IPv4 row: the goal is
    that they stay as they are."""
    lines = []
    for r in ok:
        if r["family"] == "ipv4":
            continue
        base = next((b for b in ok if (b["nodes"], b["mode"], b["family"]) == (r["nodes"], r["mode"], "ipv4")), None)
        if base is None:
            continue
        parts = []
        for what in ("join", "leave"):
            mine, theirs = _med(r[what], "total"), _med(base[what], "total")
            if mine is not None and theirs:
                parts.append(f"{what} {mine:.3f} s vs {theirs:.3f} s ({mine / theirs:.2f}x)")
        lines.append(f"{r['nodes']} nodes, {r['mode']}, {r['family']}: " + "; ".join(parts))
    return lines or ["no IPv6 rows in this run (--families)"]


def _below(value: float, goal: float, unit: str, decimals: int) -> tuple[str, str]:
    """``value`` against "< ``goal``" as printed and its verdict: never the goal itself beside
    PASS (0.9996 s is "0.9996 s", not "1.000 s"), nor beyond it beside FAIL (_common.judged)."""
    shown, met = judged(value, goal, at_least=False, strict=True, decimals=decimals, unit=unit)
    return shown, "PASS" if met == "met" else "FAIL"


def goal_lines(results: list[dict], args: argparse.Namespace) -> list[str]:
    """The goals' lines of every configuration run (``results``): one that failed at a goal's
    size is that goal FAILed, with the run's error, not "not measured"."""
    ok = [r for r in results if "error" not in r]
    lines = []
    for nodes, modes, whats, seconds, source in GOALS:
        here = [r for r in results if r["nodes"] == nodes and r["mode"] in modes and r["family"] == "ipv4"]
        at_goal, failed = [r for r in here if "error" not in r], [r for r in here if "error" in r]
        for r in failed:
            lines.append(f"{'/'.join(whats)} < {seconds:g} s at {nodes} nodes, {r['mode']} ({source}): "
                         f"FAIL (run failed: {r['error']})")
        if not at_goal and not failed:
            lines.append(f"{'/'.join(whats)} < {seconds:g} s at {nodes} nodes, {'/'.join(modes)} ({source}): "
                         "not measured in this run")
        for r in at_goal:
            for what in whats:
                total = max(x["total"] for x in r[what])
                agent = [x["agent_side"] for x in r[what] if x["agent_side"] is not None]
                shown, verdict = _below(total, seconds, " s", 3)
                agent_shown, agent_verdict = _below(max(agent), seconds, " s", 3) if agent else ("-", "FAIL")
                part = "after the agent's start-up" if what == "join" else "at the agent, after the CLI's start-up"
                lines.append(
                    f"{what} < {seconds:g} s at {r['nodes']} nodes, {r['mode']} ({source}): max {shown} "
                    f"(median {_med(r[what], 'total'):.3f} s): {verdict}; {part}: max {agent_shown} ({agent_verdict})"
                )
    cpu = [(a["cpu_percent"], r) for r in ok for a in r["idle"]["agents"].values()]
    rss = [(a["rss_mb"], r) for r in ok for a in r["idle"]["agents"].values()]
    if cpu:
        worst, r = max(cpu, key=lambda c: c[0])
        shown, verdict = _below(worst, GOAL_CPU_PERCENT, "%", 2)
        lines.append(f"idle agent < {GOAL_CPU_PERCENT:.0f}% CPU: worst {shown} ({r['nodes']} nodes, {r['mode']}): {verdict}")
        worst, r = max(rss, key=lambda c: c[0])
        shown, verdict = _below(worst, GOAL_RSS_MB, " MB", 1)
        lines.append(f"idle agent < {GOAL_RSS_MB:.0f} MB RSS: worst {shown} ({r['nodes']} nodes, {r['mode']}): {verdict}")
    return lines


# ---------------------------------------------------------------- command line


def warm_bytecode_cache() -> str:
    """Give the agents (our children) a bytecode cache outside the repository and fill it.

    A package installed with pip has its .pyc files; a development shell often sets
    PYTHONDONTWRITEBYTECODE, which makes every ``agentd`` start compile agentd, bgp and proto
    from source (about 0.1 s here) and would be measured as join time.
    """
    cache = tempfile.mkdtemp(prefix="agentd-cv-pyc-")
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = cache
    warm = "import agentd.daemon.agent, agentd.cli, agentd.lab.cli, uvloop"
    try:
        proc = subprocess.run([sys.executable, "-c", warm], capture_output=True, timeout=120)
    except BaseException:
        shutil.rmtree(cache, ignore_errors=True)
        raise
    if proc.returncode != 0:
        shutil.rmtree(cache, ignore_errors=True)
        why = proc.stderr.decode(errors="replace").strip()[-300:]
        raise SystemExit(f"bench/convergence.py: cannot import agentd: {why}")
    return cache


def _terminate(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {message} (see --help)\n")
        raise SystemExit(2)


def _typed(parse):
    """argparse shows an ArgumentTypeError's message (a ValueError becomes 'invalid ... value')."""

    def wrapped(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    wrapped.__name__ = parse.__name__
    return wrapped


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"expected a comma-separated list of {', '.join(MODES)}, got {text!r}")
    return modes


def _families(text: str) -> list[str]:
    families = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in families if f not in FAMILIES]
    if bad or not families:
        raise ValueError(f"expected a comma-separated list of {', '.join(FAMILIES)}, got {text!r}")
    return families


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected seconds, got {text!r}") from None
    if not 0 <= value <= 3600:
        raise ValueError(f"expected seconds between 0 and 3600, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bench/convergence.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=_typed(int_list), default=[3, 5, 10], help="lab sizes, e.g. 3,5,10 (default)")
    p.add_argument("--modes", type=_typed(_modes), default=list(MODES), help="mesh,route-reflector (default both)")
    p.add_argument("--families", type=_typed(_families), default=list(FAMILIES),
                   help="pod address families, each its own lab beside the others: ipv4,dual,ipv6 (default all)")
    p.add_argument("--rounds", type=int, default=3, help="leave+join rounds per configuration (default 3)")
    p.add_argument("--backend", choices=BACKENDS, default="host-gw", help="the lab's backend (default host-gw)")
    p.add_argument("--settle", type=_typed(_seconds), default=10.0, help="seconds before the idle sample (default 10)")
    p.add_argument("--idle-seconds", type=_typed(_seconds), default=25.0, help="idle sample window (default 25)")
    p.add_argument("--lab-timeout", type=_typed(_seconds), default=None,
                   help="limit per configuration (default 300, or 6 s per node above 50 nodes)")
    p.add_argument(
        "--leave-via",
        choices=("cli", "light"),
        default="cli",
        help="cli: `agentd leave` (default); light: python importing only agentd.cli, then POST /leave "
        "(what the CLI would cost without importing the daemon)",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep each lab's files (agent logs) and print where")
    p.add_argument(
        "--no-bytecode-cache",
        action="store_true",
        help="run the agents with this environment as it is (by default they get a private, pre-warmed "
        "bytecode cache, as an installed package has, even when PYTHONDONTWRITEBYTECODE is set here)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_bench_args(parser, argv, name="convergence", quick={
        "nodes": [3], "modes": ["mesh"], "families": ["ipv4", "dual"], "rounds": 1, "settle": 2.0,
        "idle_seconds": 5.0})
    if not 1 <= args.rounds <= 50:
        parser.error(f"--rounds must be between 1 and 50, got {args.rounds}")
    small = [n for n in args.nodes if n < 2 or n > MAX_NODES]
    if small:
        parser.error(f"--nodes must be between 2 and {MAX_NODES}, got {small[0]}")
    if "route-reflector" in args.modes and min(args.nodes) <= REFLECTORS:
        parser.error(f"route-reflector mode has {REFLECTORS} reflectors: --nodes must be at least {REFLECTORS + 1}")
    if args.idle_seconds < 1:
        parser.error("--idle-seconds must be at least 1")
    require_root("bench/convergence.py")
    args.load = os.getloadavg()
    signal.signal(signal.SIGTERM, _terminate)  # outside the event loop; inside it, the task is cancelled
    cache = None if args.no_bytecode_cache else warm_bytecode_cache()
    if cache:
        args.bytecode = f"private cache {cache}"
    elif os.environ.get("PYTHONDONTWRITEBYTECODE"):
        args.bytecode = "as inherited (PYTHONDONTWRITEBYTECODE is set: every start compiles from source)"
    else:
        args.bytecode = "as inherited"

    results: list[dict] = []

    async def run_all() -> None:
        # SIGTERM cancels like Ctrl-C does: every lab is taken down on the way out.
        main_task = asyncio.current_task()
        assert main_task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
        for nodes in args.nodes:
            for mode in args.modes:
                for family in args.families:
                    results.append(await measure_config(nodes, mode, args, family))

    interrupted = False
    try:
        asyncio.run(run_all())
    except (KeyboardInterrupt, asyncio.CancelledError):
        interrupted = True
        print("bench/convergence.py: interrupted; labs taken down; results so far:", file=sys.stderr)
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    if results:
        report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            emit_json({"args": {k: v for k, v in vars(args).items()}, "results": results}, file=f)
    if interrupted:
        return 130
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
