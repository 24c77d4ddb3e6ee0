"""Pod-to-pod TCP throughput through the agent, every data path side by side.

    python bench/dataplane.py [--seconds 10] [--rounds 3] [--only "udp bpf,ipip bpf,..."]

Brings up one lab per row (agentd.lab: 2 nodes, 1 pod each, real agents, etcd, BGP; all in
namespaces, removed at the end) and runs ONE iperf3 TCP stream pod -> pod across the two
nodes, plus 20 pings:

  raw veth      node to node over the lab underlay (veth, bridge, veth): the physical anchor,
                in the host-gw lab
  kernel vxlan  the lab's vxlan backend (kernel VTEP; its BPF member filter on): the kernel anchor
  host-gw       plain routes
  udp bpf       the udp backend in the in-kernel (tc-BPF) data path
  ipip bpf      the ipip backend in the in-kernel data path
  udp user      the udp backend in the user-space worker ([network] datapath = "userspace")
  ipip user     the ipip backend in the user-space worker
  ... routed    with --routed: vxlan, udp bpf and ipip bpf between nodes on two L2 segments
                joined by the lab's router (agentd lab --subnets 2): the outer packet routed

Every row runs --rounds times, the rows interleaved (round 1 of every row, then round 2...),
so a slow spell of the machine hits all of them alike; the table shows each row's median
round, its range, and ratios of medians. "CPU/Gbit" is the machine's busy CPU time during
the transfer (all cores, /proc/stat: iperf3 x2, softirq, workers, everything else running)
per second and per Gbit/s moved: cores per Gbit/s, lower is cheaper. On a shared machine
other jobs inflate it; the load line says how busy the machine was. A failed iperf3 run is
an error that stops the bench (exit 1), never a 0 Gbit/s row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentd.lab.lab import Lab, LabError, LabSpec  # noqa: E402
from agentd.lab.netns import Netns, unique_tag  # noqa: E402

ANCHORS = [
    "flannel's UDP backend ~ 0.6x kernel VXLAN in published tests (\"for debugging only\")",
    "Calico IPIP (kernel ipip device) and the Cilium / Calico eBPF data planes: at or above kernel VXLAN",
    "the probe behind issue 12 on this machine: BPF udp 1.09x, BPF ipip 1.02x kernel VXLAN (medians of 6)",
]
GOALS = [("udp bpf", "kernel vxlan", 1.0), ("ipip bpf", "kernel vxlan", 1.0), ("host-gw", "raw veth", 0.95),
         ("udp bpf routed", "vxlan routed", 1.0), ("ipip bpf routed", "vxlan routed", 1.0)]

# name -> (lab backend, [network] datapath, what to measure, L2 segments)
ROWS = {
    "raw veth": ("host-gw", "auto", "nodes", 1),
    "kernel vxlan": ("vxlan", "auto", "pods", 1),
    "host-gw": ("host-gw", "auto", "pods", 1),
    "udp bpf": ("udp", "bpf", "pods", 1),
    "ipip bpf": ("ipip", "bpf", "pods", 1),
    "udp user": ("udp", "userspace", "pods", 1),
    "ipip user": ("ipip", "userspace", "pods", 1),
}
ROUTED = {
    "vxlan routed": ("vxlan", "auto", "pods", 2),
    "udp bpf routed": ("udp", "bpf", "pods", 2),
    "ipip bpf routed": ("ipip", "bpf", "pods", 2),
}


class BenchError(RuntimeError):
    pass


class Round(NamedTuple):
    gbps: float
    retr: int
    ping: float
    cpu_per_gbit: float  # busy cores per Gbit/s


def busy_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v), sum(v) - v[3] - v[4]


async def iperf(client: Netns, server: Netns, dst: str, seconds: int, what: str) -> tuple[float, int, float]:
    """(Gbit/s, retransmits, busy cores) of one iperf3 TCP stream; a failure raises."""
    srv = server.popen(["iperf3", "-s", "-1", "-B", dst], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while f"{dst}:5201" not in server.exec("ss", "-ltn", check=False):
            if time.monotonic() > deadline:
                raise BenchError(f"{what}: the iperf3 server did not start")
            await asyncio.sleep(0.05)
        total0, busy0 = busy_jiffies()
        rc, out, err = await client.aexec("iperf3", "-c", dst, "-t", str(seconds), "-J", check=False,
                                          timeout=seconds + 30)
        total1, busy1 = busy_jiffies()
        try:
            end = json.loads(out)["end"]
            gbps = end["sum_received"]["bits_per_second"] / 1e9
            retr = int(end["sum_sent"].get("retransmits", 0))
        except (ValueError, KeyError, TypeError):
            raise BenchError(f"{what}: iperf3 failed (rc {rc}): {(out + err).decode(errors='replace')[-400:]}") from None
        if rc != 0 or gbps <= 0:
            raise BenchError(f"{what}: iperf3 failed (rc {rc}, {gbps} Gbit/s)")
        cores = (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)
        return gbps, retr, cores
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait()


async def ping_avg(ns: Netns, dst: str, count: int = 20) -> float:
    _, out, _ = await ns.aexec("ping", "-c", str(count), "-i", "0.05", "-W", "2", dst, check=False)
    m = re.search(r"= [\d.]+/([\d.]+)/", out.decode())
    return float(m.group(1)) if m else float("nan")


async def run_row(name: str, lab: Lab, seconds: int) -> Round:
    what = ROWS[name][2]
    if what == "nodes":
        client, server, dst = lab.nodes[0].ns, lab.nodes[1].ns, lab.nodes[1].address
    else:
        client, server, dst = lab.pods[0].ns, lab.pods[1].ns, lab.pods[1].ip
    lat = await ping_avg(client, dst)
    gbps, retr, cores = await iperf(client, server, dst, seconds, name)
    return Round(gbps, retr, lat, cores / gbps)


def check_datapath(name: str, lab: Lab) -> None:
    """The row measures what it says: every peer carried by the data path named."""
    backend, datapath, _, _ = ROWS[name]
    want = {"host-gw": "kernel route", "vxlan": "vxlan device"}.get(backend) or \
        {"bpf": "bpf", "userspace": "user space"}[datapath]
    for node in lab.nodes:
        got = {p.get("datapath") for p in node.api("/peers")}
        if got != {want}:
            raise BenchError(f"{name}: {node.name} carries its peer as {got}, not {want}")


async def bench(args, names: list[str]) -> dict[str, list[Round]]:
    tag = unique_tag("b")
    labs: dict[str, Lab] = {}
    specs: dict[tuple[str, str], Lab] = {}
    runs: dict[str, list[Round]] = {}
    try:
        for name in names:
            backend, datapath, _, segments = ROWS[name]
            key = (backend, datapath, segments)
            if key not in specs:  # raw veth and host-gw share a lab
                lab = Lab(LabSpec(name=f"{tag}{len(specs)}", nodes=2, pods=1, backend=backend, datapath=datapath,
                                  subnets=segments, log_level="warning"), root=args.root)
                specs[key] = lab
                print(f"  lab for {backend} ({datapath}) ...", file=sys.stderr, flush=True)
                await lab.up(timeout=120)
            labs[name] = specs[key]
            check_datapath(name, labs[name])
        for r in range(args.rounds):
            for name in names:
                got = await run_row(name, labs[name], args.seconds)
                runs.setdefault(name, []).append(got)
                print(f"  round {r + 1}/{args.rounds} {name:<13} {got.gbps:6.2f} Gbit/s, {got.retr} retr, "
                      f"{got.cpu_per_gbit:.3f} cores/Gbit", file=sys.stderr, flush=True)
    finally:
        for lab in specs.values():
            await lab.down()
    return runs


def report(args, runs: dict[str, list[Round]], load: tuple, background: float) -> None:
    results = []
    for name, got in runs.items():
        ordered = sorted(got, key=lambda g: g.gbps)
        mid = ordered[len(ordered) // 2]  # the median round (the upper one of an even count)
        spread = f"{ordered[0].gbps:.2f}-{ordered[-1].gbps:.2f}" if len(got) > 1 else ""
        results.append((name, mid, spread))
    by = {name: mid.gbps for name, mid, _ in results}
    raw, vx = by.get("raw veth") or float("nan"), by.get("kernel vxlan") or float("nan")
    print(f"\nagentd data plane through the agent: lab pods, iperf3 TCP, 1 stream, {args.seconds} s; "
          f"median of {args.rounds} interleaved rounds")
    after = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, busy {background * 100:.0f}% before the run (other jobs); load average "
          f"{load[0]:.2f} before, {after[0]:.2f} after" + ("  <- rows are skewed by other load" if background > 0.1 else "")
          + "\n")
    print(f"{'path':<13} {'Gbit/s':>7} {'range':>11} {'x raw veth':>10} {'x vxlan':>8} {'retr':>6} {'ping ms':>8} "
          f"{'CPU/Gbit':>9}")
    print("-" * 80)
    for name, mid, spread in results:
        print(f"{name:<13} {mid.gbps:7.2f} {spread:>11} {mid.gbps / raw:10.2f} {mid.gbps / vx:8.2f} {mid.retr:6d} "
              f"{mid.ping:8.3f} {mid.cpu_per_gbit:9.3f}")
    print("\nanchors (context, not measured here):")
    for a in ANCHORS:
        print(f"  - {a}")
    print("\ngoals:")
    for name, base, want in GOALS:
        if name in by and base in by:
            got = by[name] / by[base]
            print(f"  {name:<9} >= {want:.2f}x {base:<12}: {got:.2f}x  {'met' if got >= want else 'NOT met'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=10, help="iperf3 duration per row (default 10)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="run every row this many times, interleaved; the table shows medians (default 3)")
    ap.add_argument("--only", help=f"comma-separated rows to run, of: {', '.join(ROWS)} (anchors always run)")
    ap.add_argument("--root", default=None, help="lab directory (default: agentd lab's)")
    ap.add_argument("--routed", action="store_true",
                    help="also the routed-underlay rows (two L2 segments joined by the lab's router)")
    args = ap.parse_args()
    if args.rounds < 1 or args.seconds < 1:
        print("bench/dataplane.py: --rounds and --seconds must be at least 1", file=sys.stderr)
        return 1
    if os.geteuid() != 0:
        print("bench/dataplane.py: needs root (network namespaces)", file=sys.stderr)
        return 1
    if args.routed:
        ROWS.update(ROUTED)
    wanted = [x.strip() for x in args.only.split(",")] if args.only else list(ROWS)
    unknown = [x for x in wanted if x not in ROWS]
    if unknown:
        print(f"bench/dataplane.py: unknown rows {unknown}; rows are {', '.join(ROWS)}", file=sys.stderr)
        return 1
    names = [n for n in ROWS if n in wanted or n in ("raw veth", "kernel vxlan")]
    total0, busy0 = busy_jiffies()
    time.sleep(1.0)
    total1, busy1 = busy_jiffies()
    background = (busy1 - busy0) / max(total1 - total0, 1)
    load = os.getloadavg()
    try:
        runs = asyncio.run(bench(args, names))
    except (BenchError, LabError) as err:
        print(f"bench/dataplane.py: {err}", file=sys.stderr)
        return 1
    report(args, runs, load, background)
    return 0


if __name__ == "__main__":
    sys.exit(main())
