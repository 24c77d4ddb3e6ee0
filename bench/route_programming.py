"""Kernel route programming: agentd's RouteProgrammer against ``ip -batch`` and pyroute2, side by side.

    .venv/bin/python bench/route_programming.py [--n 10000,100000] [--repeat 3] [--family 4|6]
                                                [--pyroute2-upto 10000] [--quick] [--json FILE]

Defaults: N = 10,000 and 100,000, 3 repetitions, IPv4, pyroute2 up to N = 10,000;
``--quick``: N = 1,000, 1 repetition.

For every N and every repetition, each tool gets a fresh pair of lab namespaces (router ``r``
with ``v0`` 192.0.2.1/24 + 2001:db8::1/64, peer ``p`` behind it) and:

  install  N unique host routes via the peer (10.0.0.0 + i /32, or fd00:1::i/128), proto 143
  remove   all of them

agentd only, with the N routes installed: ``restore``, a route deleted by hand (``ip route
del``, timed from when ``ip`` has returned) until the programmer's monitor has put it back (the
add acknowledged: ``counters.routes_restored``), RESTORE_ROUNDS times; the goal is under 1 s.
The system tests check that the monitor does it; the delay is measured here.

agentd: ``set_desired(routes)`` + ``await reconcile()``, timed end to end including every ack
(the Route objects are built before the clock starts, as the file is written before ``ip``
runs; their construction cost is reported separately).  ip -batch: ``ip -n r -batch FILE``
with ``route add DST via GW proto 143`` lines, then ``route del DST proto 143`` lines.
pyroute2 (the Python netlink library, a bench dependency: ``pip install -e '.[bench]'``),
two ways, up to ``--pyroute2-upto`` routes (it is slow enough that 100,000 would take minutes
per run): ``IPRoute(netns=r).route("add", ...)`` once per route, each waiting for its ack
(the library's ordinary use), and ``IPBatch``, every request encoded into one buffer
first and written to the kernel in 64 KiB writes (the kernel applies a write's messages
before the write returns; the route count is checked after).
The kernel's route count is checked with ``ip route show proto 143`` after every step.
The table shows the median of the repetitions; the CPU table splits each median run of agentd
and ip -batch into user (the tool's own work) and sys (the kernel's route work, syscalls).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import (  # noqa: E402
    BenchError,
    Stopwatch,
    Timing,
    fmt_rate,
    fmt_ratio,
    int_list,
    median,
    parse_bench_args,
    print_notes,
    print_table,
    rate,
    require_root,
    run_main,
    write_json,
)

from agentd.lab import netns  # noqa: E402
from agentd.lab.wait import auntil  # noqa: E402
from agentd.kernel.route_model import RTPROT_AGENTD, Route  # noqa: E402
from agentd.kernel.routing import RouteProgrammer  # noqa: E402

NOTES = [
    "ip -batch (iproute2) and pyroute2 are measured above, in the same namespaces, on the same machine, interleaved",
    "not measured here: FRR zebra, and Calico Felix's route programming (neither runs on this machine)",
    "goal: agentd >= 1.0x ip -batch for installs and removals",
]
PYROUTE2 = ("pyroute2 route()", "pyroute2 IPBatch")
CHUNK = 64 * 1024
GATEWAY = {4: "192.0.2.2", 6: "2001:db8::2"}
RESTORE_ROUNDS = 5


def destinations(n: int, family: int) -> list[str]:
    if family == 4:
        return [f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}/32" for i in range(n)]
    return [f"fd00:1::{i >> 16:x}:{i & 0xFFFF:x}/128" for i in range(n)]


class Namespaces:
    """A fresh router/peer pair; removed on exit, also on failure."""

    def __enter__(self) -> netns.Netns:
        tag = netns.unique_tag("b")
        self.router = netns.Netns.create(f"ad-{tag}-r")
        try:
            self.peer = netns.Netns.create(f"ad-{tag}-p")
            netns.veth(self.router, "v0", self.peer, "v1")
            self.router.ip("addr", "add", "192.0.2.1/24", "dev", "v0")
            self.router.ip("-6", "addr", "add", "2001:db8::1/64", "dev", "v0", "nodad")
        except BaseException:
            self.__exit__()
            raise
        return self.router

    def __exit__(self, *exc: object) -> None:
        netns.delete_matching(self.router.name.rsplit("-", 1)[0] + "-")


def own_route_count(router: netns.Netns, family: int) -> int:
    out = router.ip(f"-{family}", "route", "show", "proto", str(RTPROT_AGENTD)).stdout
    return out.count(b"\n")


def check_count(router: netns.Netns, family: int, want: int, step: str) -> None:
    got = own_route_count(router, family)
    if got != want:
        raise BenchError(f"{step}: the kernel holds {got} proto {RTPROT_AGENTD} routes, expected {want}")


async def run_agentd(n: int, family: int) -> dict[str, object]:
    with Namespaces() as router:
        started = time.perf_counter()
        routes = [Route(dst, gateway=GATEWAY[family]) for dst in destinations(n, family)]
        construct = time.perf_counter() - started
        programmer = RouteProgrammer(netns=router.name)
        await programmer.start()
        try:
            with Stopwatch() as install:
                programmer.set_desired(routes)
                result = await programmer.reconcile()
            if result.failed or len(result.added) != n:
                raise BenchError(f"agentd install: {len(result.added)} added, failures {result.failed[:3]}")
            check_count(router, family, n, "agentd install")
            with Stopwatch() as cold:  # first re-read: every route parsed
                resync = await programmer.reconcile(full=True)
            with Stopwatch() as warm:  # later re-reads: unchanged routes recognised by their bytes
                await programmer.reconcile(full=True)
            if resync.added or resync.replaced or resync.removed:
                raise BenchError(f"agentd full resync changed routes: {resync}")
            restore = await measure_restore(programmer, router, routes, family)
            with Stopwatch() as remove:
                programmer.set_desired([])
                result = await programmer.reconcile()
            if result.failed or len(result.removed) != n:
                raise BenchError(f"agentd remove: {len(result.removed)} removed, failures {result.failed[:3]}")
            check_count(router, family, 0, "agentd remove")
        finally:
            await programmer.stop()
    return {"install": install.timing, "remove": remove.timing, "construct": construct,
            "resync_cold": cold.timing, "resync_warm": warm.timing, "restore": restore}


async def measure_restore(programmer: RouteProgrammer, router: netns.Netns, routes: list[Route],
                          family: int) -> list[float]:
    """Seconds from a by-hand ``ip route del`` of one of our routes until the monitor-driven
    reconcile has put it back, for RESTORE_ROUNDS routes spread over the table."""
    delays = []
    for i in range(RESTORE_ROUNDS):
        dst = routes[i * len(routes) // RESTORE_ROUNDS].dst
        restored = programmer.counters.routes_restored
        # Blocking on purpose: the loop (and so the monitor) waits until the route is gone.
        router.ip(f"-{family}", "route", "del", dst, "proto", str(RTPROT_AGENTD))
        gone = time.perf_counter()
        await auntil(lambda: programmer.counters.routes_restored > restored, 60, interval=0.0005,
                     what=f"{dst} put back")
        delays.append(time.perf_counter() - gone)
    return delays


def run_ip_batch(n: int, family: int) -> dict[str, object]:
    dsts = destinations(n, family)
    with Namespaces() as router, tempfile.TemporaryDirectory() as tmp:
        add_file, del_file = os.path.join(tmp, "add"), os.path.join(tmp, "del")
        with open(add_file, "w") as f:
            f.writelines(f"route add {dst} via {GATEWAY[family]} proto {RTPROT_AGENTD}\n" for dst in dsts)
        with open(del_file, "w") as f:
            f.writelines(f"route del {dst} proto {RTPROT_AGENTD}\n" for dst in dsts)
        timings = {}
        for step, path, want in (("install", add_file, n), ("remove", del_file, 0)):
            with Stopwatch(children=True) as sw:
                proc = subprocess.run(["ip", "-n", router.name, "-batch", path], capture_output=True)
            if proc.returncode != 0:
                raise BenchError(f"ip -batch {step} failed: {proc.stderr.decode(errors='replace').strip()[:300]}")
            check_count(router, family, want, f"ip -batch {step}")
            timings[step] = sw.timing
    return timings


def run_pyroute2(n: int, family: int) -> dict[str, float]:
    """Wall seconds of install and remove, per pyroute2 way (PYROUTE2), in fresh namespaces."""
    try:
        from pyroute2 import IPBatch, IPRoute
    except ImportError:
        raise BenchError("pyroute2 is not installed (a bench dependency): .venv/bin/pip install -e '.[bench]'") from None
    dsts = destinations(n, family)
    out: dict[str, float] = {}
    for way in PYROUTE2:
        with Namespaces() as router:
            ipr = IPRoute(netns=router.name)
            try:
                for op in ("install", "remove"):
                    extra = {"gateway": GATEWAY[family]} if op == "install" else {}
                    verb = "add" if op == "install" else "del"
                    with Stopwatch() as sw:
                        if way == "pyroute2 route()":
                            for dst in dsts:
                                ipr.route(verb, dst=dst, proto=RTPROT_AGENTD, **extra)
                        else:
                            batch = IPBatch()
                            chunks = []
                            for dst in dsts:
                                batch.route(verb, dst=dst, proto=RTPROT_AGENTD, **extra)
                                if len(batch.batch) >= CHUNK:
                                    chunks.append(bytes(batch.batch))
                                    batch.reset()
                            chunks.append(bytes(batch.batch))
                            for chunk in chunks:
                                ipr.sendto(chunk, (0, 0))
                    check_count(router, family, n if op == "install" else 0, f"{way} {op}")
                    out[f"{way} {op}"] = sw.timing.wall
            finally:
                ipr.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int_list, default=[10000, 100000], help="route counts, e.g. 10000,100000")
    parser.add_argument("--repeat", type=int, default=3, help="runs per N and tool; the median is shown")
    parser.add_argument("--family", type=int, choices=(4, 6), default=4)
    parser.add_argument("--pyroute2-upto", type=int, default=10000, metavar="N",
                        help="measure pyroute2 for route counts up to N (default 10000; 0: not at all)")
    args = parse_bench_args(parser, argv, name="route_programming", quick={"n": [1000], "repeat": 1})
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    require_root("bench/route_programming.py")

    results = []
    for n in args.n:
        runs: dict[str, list] = {"agentd": [], "ip": [], "pyroute2": []}
        for _ in range(args.repeat):  # interleaved, so all see the same machine noise
            runs["agentd"].append(asyncio.run(run_agentd(n, args.family)))
            runs["ip"].append(run_ip_batch(n, args.family))
            if n <= args.pyroute2_upto:
                runs["pyroute2"].append(run_pyroute2(n, args.family))
            print(f"  N={n:,}: round {len(runs['ip'])}/{args.repeat} done", file=sys.stderr, flush=True)
        for op in ("install", "remove"):
            ours = _median_run(runs["agentd"], op)
            theirs = _median_run(runs["ip"], op)
            row = {
                "n": n, "operation": op, "family": args.family,
                "agentd_routes_per_s": rate(n, ours.wall), "ip_batch_routes_per_s": rate(n, theirs.wall),
                "ratio": theirs.wall / ours.wall,
                "agentd": ours.__dict__, "ip_batch": theirs.__dict__,
                "agentd_runs_s": [r[op].wall for r in runs["agentd"]], "ip_batch_runs_s": [r[op].wall for r in runs["ip"]],
            }
            for way in PYROUTE2:
                walls = [r[f"{way} {op}"] for r in runs["pyroute2"]]
                row[way] = {"routes_per_s": rate(n, median(walls)), "runs_s": walls} if walls else None
            results.append(row)
        results.append({
            "n": n, "operation": "extras", "family": args.family,
            "route_construct_s": median(r["construct"] for r in runs["agentd"]),
            "full_resync_cold_s": median(r["resync_cold"].wall for r in runs["agentd"]),
            "full_resync_cold_cpu_s": median(r["resync_cold"].user + r["resync_cold"].sys for r in runs["agentd"]),
            "full_resync_warm_s": median(r["resync_warm"].wall for r in runs["agentd"]),
            "full_resync_warm_cpu_s": median(r["resync_warm"].user + r["resync_warm"].sys for r in runs["agentd"]),
            "restore_s": [d for r in runs["agentd"] for d in r["restore"]],
        })

    write_json(args.json, {"family": args.family, "repeat": args.repeat, "results": results})
    main_rows = [r for r in results if r["operation"] != "extras"]

    def pyroute2_cells(r: dict) -> list[str]:
        cells = []
        for way in PYROUTE2:
            got = r[way]
            cells += [fmt_rate(got["routes_per_s"]), fmt_ratio(r["agentd_routes_per_s"], got["routes_per_s"])] \
                if got else ["not run", ""]
        return cells

    print_table(
        f"Route programming, IPv{args.family} host routes via one gateway (median of {args.repeat})",
        ["N", "operation", "agentd routes/s", "ip -batch routes/s", "agentd / ip -batch",
         "pyroute2 route() routes/s", "agentd / route()", "pyroute2 IPBatch routes/s", "agentd / IPBatch"],
        [(f"{r['n']:,}", r["operation"], fmt_rate(r["agentd_routes_per_s"]), fmt_rate(r["ip_batch_routes_per_s"]),
          fmt_ratio(r["agentd_routes_per_s"], r["ip_batch_routes_per_s"]), *pyroute2_cells(r)) for r in main_rows],
    )
    print_table(
        "Where the time goes (the median runs): wall, user = the tool's own CPU, sys = kernel",
        ["N", "operation", "agentd wall", "user", "sys", "ip -batch wall", "user", "sys"],
        [(f"{r['n']:,}", r["operation"], *(f"{r[t][k]:.3f} s" for t in ("agentd", "ip_batch") for k in ("wall", "user", "sys")))
         for r in main_rows],
    )
    print_table(
        "agentd extras (median; resyncs as wall / CPU)",
        ["N", "Route() construction", "full resync, first (parse all)", "full resync, unchanged",
         "restore (median / max)"],
        [(f"{r['n']:,}", f"{r['route_construct_s']:.3f} s",
          f"{r['full_resync_cold_s']:.3f} s / {r['full_resync_cold_cpu_s']:.3f} s",
          f"{r['full_resync_warm_s']:.3f} s / {r['full_resync_warm_cpu_s']:.3f} s",
          f"{median(r['restore_s']) * 1000:.1f} ms / {max(r['restore_s']) * 1000:.1f} ms")
         for r in results if r["operation"] == "extras"],
    )
    notes = list(NOTES)
    if any(r[PYROUTE2[0]] is None for r in main_rows):
        notes.insert(1, f"pyroute2 not run above N = {args.pyroute2_upto:,} (--pyroute2-upto)")
    print_notes("Anchors and goal", notes)
    return 0


def _median_run(runs: list[dict], op: str) -> Timing:
    ordered = sorted(runs, key=lambda r: r[op].wall)
    return ordered[len(ordered) // 2][op]


if __name__ == "__main__":
    run_main(main, "bench/route_programming.py")
