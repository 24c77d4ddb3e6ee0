"""Pod-to-pod TCP throughput and latency across the data-plane paths, side by side.

    python bench/dataplane.py [--seconds 10] [--rounds 3] [--only udp,ipip,...] [--compare DIR]

Builds the two-host topology of agentd.dataplane._testbed afresh for every row (namespaces
only; removed at the end), runs ONE iperf3 TCP stream pod -> pod and 20 pings per row:

  raw veth     host to host over the underlay veth (the physical anchor)
  kernel vxlan hand-configured kernel VXLAN pair with routes for the pod subnets (kernel anchor)
  host-gw      plain routes via the peer's underlay address
  udp / ipip   the agentd user-space fast paths (TUN TSO + user segmentation, UDP GSO/GRO or
               sendmmsg/recvmmsg, GRO-style coalescing into the TUN), loops in C (_fastpath.c)
  ... python   the same with --fast-path python: the loops in Python and numpy (the fall-back)
  ... kseg     the same with --segmentation kernel (TUN without TSO; batched sends)
  ... no-offl  --no-offload: one read + one send per packet (flannel's model, the baseline)
  ipip ceiling no TUN, no TCP, no worker: MTU-sized IP-protocol-4 packets sent through a
               raw socket with sendmmsg and drained from one with recvmmsg (bench/_raw_ceiling.c,
               built with gcc on first use), Gbit/s of inner packets: the most any IPIP path on
               raw sockets gets from this kernel, the bound the ipip row runs into
  ... before   with --compare DIR: the same paths run by the code in DIR (a directory holding
               agentd/ and proto/, e.g. ``git archive HEAD~1 agentd proto | tar -x -C DIR``),
               in the same run, so before and after see the same machine

"retr" is the median count of segments the iperf3 sender retransmitted per round: on these veths
nearly all are spurious (reordering across the two CPUs' receive backlogs, DSACKed), and each
costs the flow a congestion-window cut, which is much of the rows' round-to-round spread.
--pin pins the iperf3 client to CPU 0 and the server to CPU 1 (every row; the workers float):
the ratios move with placement on 2 cores, and this shows by how much.

Every row runs --rounds times, the rows interleaved (round 1 of every row, then round 2...),
so a slow spell of the machine hits all of them alike; the table shows each row's median
round, its range, and ratios of medians.

The machine has 2 cores: iperf3 client, iperf3 server, both workers and the kernel's softirq
work all compete for them, so the user-space rows measure total CPU cost per byte.  The
CPU columns are the sender's and receiver's worker CPU time as a share of one core, and the
same per 64 KB forwarded (user + system time of each worker process, /proc/PID/stat).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentd.dataplane._testbed import (  # noqa: E402
    CLUSTER,
    DEVICE,
    H1_UNDERLAY,
    H2_UNDERLAY,
    OVERHEAD,
    P2,
    SUBNET1,
    SUBNET2,
    build_two_hosts,
    wait_for,
)
from agentd.lab.netns import Netns, delete_matching, unique_tag  # noqa: E402

ANCHORS = [
    "kernel VXLAN ~ 0.71x raw veth on this machine (measured earlier: 12.3 vs 17.4 Gbit/s)",
    "flannel's C UDP backend ~ 0.6x kernel VXLAN in published tests",
    "Tailscale's TUN-offload path 2.2x its per-packet baseline",
]
GOALS = [("host-gw", "raw veth", 0.95), ("udp", "kernel vxlan", 0.7), ("ipip", "kernel vxlan", 0.5)]

ROWS = [
    ("raw veth", "raw", {}),
    ("kernel vxlan", "vxlan", {}),
    ("host-gw", "hostgw", {}),
    ("udp", "udp", {"offload": True}),
    ("ipip", "ipip", {"offload": True}),
    ("udp python", "udp", {"offload": True, "extra": ("--fast-path", "python")}),
    ("ipip python", "ipip", {"offload": True, "extra": ("--fast-path", "python")}),
    ("udp kseg", "udp", {"offload": True, "extra": ("--segmentation", "kernel")}),
    ("ipip kseg", "ipip", {"offload": True, "extra": ("--segmentation", "kernel")}),
    ("udp no-offl", "udp", {"offload": False}),
    ("ipip no-offl", "ipip", {"offload": False}),
    ("ipip ceiling", "rawceil", {}),
]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_share(seconds: float = 1.0) -> float:
    """Share of the machine's CPU used by everything else right now (other jobs skew the rows)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return sum(v), v[3] + v[4]
    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1 - (i1 - i0) / max(t1 - t0, 1)


# --pin: taskset prefixes for the iperf3 client and server (empty: the scheduler places them)
PIN_CLIENT: tuple[str, ...] = ()
PIN_SERVER: tuple[str, ...] = ()


class Round(NamedTuple):
    gbps: float
    retr: int  # TCP segments the sender retransmitted (on veth mostly spurious: reordering, DSACKed)
    ping: float
    cpu: str = ""
    per64k: str = ""
    per_io: str = ""


def iperf(client: Netns, server: Netns, dst: str, seconds: int) -> tuple[float, int]:
    srv = server.popen([*PIN_SERVER, "iperf3", "-s", "-1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: ":5201" in server.exec("ss", "-ltn", check=False), 5)
        out = client.exec(*PIN_CLIENT, "iperf3", "-c", dst, "-t", str(seconds), "-J", timeout=seconds + 30, check=False)
        end = json.loads(out)["end"]
        return end["sum_received"]["bits_per_second"] / 1e9, int(end["sum_sent"].get("retransmits", 0))
    except (ValueError, KeyError):
        return 0.0, 0
    finally:
        try:
            srv.wait(timeout=5)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()


def ping_avg(ns: Netns, dst: str, count: int = 20) -> float:
    out = ns.exec("ping", "-c", str(count), "-i", "0.05", "-W", "2", dst, check=False)
    m = re.search(r"= [\d.]+/([\d.]+)/", out)
    return float(m.group(1)) if m else float("nan")


def run_row(kind: str, opts: dict, seconds: int, tag: str, n: str) -> Round:
    def make(role: str) -> Netns:
        return Netns.create(f"ad-{tag}-{n}{role}")

    t = build_two_hosts(make, outsider=False)
    try:
        if kind == "raw":
            return Round(*iperf(t.h1, t.h2, H2_UNDERLAY, seconds), ping_avg(t.h1, H2_UNDERLAY))
        if kind == "hostgw":
            t.h1.ip("route", "add", SUBNET2, "via", H2_UNDERLAY)
            t.h2.ip("route", "add", SUBNET1, "via", H1_UNDERLAY)
            return Round(*iperf(t.p1, t.p2, P2, seconds), ping_avg(t.p1, P2))
        if kind == "rawceil":
            return raw_socket_ceiling(t, seconds)
        if kind == "vxlan":
            for h, local, remote, addr, peer_addr, subnet in (
                (t.h1, H1_UNDERLAY, H2_UNDERLAY, "10.99.0.1", "10.99.0.2", SUBNET2),
                (t.h2, H2_UNDERLAY, H1_UNDERLAY, "10.99.0.2", "10.99.0.1", SUBNET1),
            ):
                h.ip("link", "add", "vx0", "type", "vxlan", "id", "42", "local", local, "remote", remote,
                     "dstport", "4789", "dev", "u1" if h is t.h1 else "u2")
                h.ip("link", "set", "vx0", "mtu", str(t.underlay_mtu - OVERHEAD["vxlan"]), "up")
                h.ip("addr", "add", f"{addr}/24", "dev", "vx0")
                h.ip("route", "add", subnet, "via", peer_addr, "dev", "vx0")
            t.set_pod_mtu(t.underlay_mtu - OVERHEAD["vxlan"])
            return Round(*iperf(t.p1, t.p2, P2, seconds), ping_avg(t.p1, P2))
        # agentd user-space paths
        mtu = t.underlay_mtu - OVERHEAD[kind]
        t.set_pod_mtu(mtu)
        ctl = {i: f"/tmp/agentd-bench-{tag}-{n}-{i}.sock" for i in (1, 2)}
        procs = {i: t.start_worker(kind, i, ctl[i], mtu=mtu, offload=opts["offload"], extra=opts.get("extra", ()),
                                   stderr=subprocess.DEVNULL, source=opts.get("source")) for i in (1, 2)}
        if not wait_for(lambda: all(os.path.exists(p) for p in ctl.values()), 15):
            raise RuntimeError(f"{kind} workers did not start")
        for i, peer, subnet in ((1, H2_UNDERLAY, SUBNET2), (2, H1_UNDERLAY, SUBNET1)):
            t.host(i).ip("route", "add", CLUSTER, "dev", DEVICE[kind])
            req = json.dumps({"op": "set_next_hops", "next_hops": {subnet: peer}}) + "\n" + \
                json.dumps({"op": "set_members", "members": [peer]}) + "\n"
            _control(ctl[i], req)
        lat = ping_avg(t.p1, P2)
        c0 = {i: cpu_seconds(p.pid) for i, p in procs.items()}
        w0 = time.monotonic()
        gbps, retr = iperf(t.p1, t.p2, P2, seconds)
        wall = time.monotonic() - w0
        cpu = {i: (cpu_seconds(p.pid) - c0[i]) / wall for i, p in procs.items()}
        tx, rx = (_control(ctl[i], json.dumps({"op": "stats"}) + "\n")[0]["stats"] for i in (1, 2))
        # Inner packets per TUN read (sender) and per TUN write (receiver): the batching achieved.
        per_io = f"{tx['tx_packets'] / max(tx['tun_reads'], 1):4.1f} / {rx['rx_packets'] / max(rx['tun_writes'], 1):4.1f}"
        t.stop_workers()
        for p in ctl.values():
            for f in (p, p + ".state"):
                if os.path.exists(f):
                    os.unlink(f)
        per64k = {i: cpu[i] * 1e6 / max(gbps * 1e9 / 8 / 65536, 1e-9) for i in cpu}
        return Round(gbps, retr, lat, f"{cpu[1] * 100:3.0f}% / {cpu[2] * 100:3.0f}%",
                     f"{per64k[1]:5.0f} / {per64k[2]:5.0f}" if gbps > 0 else "", per_io)
    finally:
        t.stop_workers()


def raw_socket_ceiling(t, seconds: int) -> Round:
    here = os.path.dirname(os.path.abspath(__file__))
    src, exe = os.path.join(here, "_raw_ceiling.c"), f"/tmp/agentd-bench-raw-ceiling-{os.getuid()}"
    if not os.path.exists(exe) or os.path.getmtime(exe) < os.path.getmtime(src):
        subprocess.run(["gcc", "-O2", "-o", exe, src], check=True)
    mtu = t.underlay_mtu - OVERHEAD["ipip"]
    rx = t.h2.popen([exe, "recv"], stdout=subprocess.PIPE, text=True)
    try:
        rx.stdout.readline()  # "ready"
        t.h1.exec(exe, "send", H2_UNDERLAY, str(seconds), str(mtu), timeout=seconds + 30)
        out = rx.communicate(timeout=30)[0].split()  # received N SECONDS
        n, secs = int(out[1]), float(out[2])
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    return Round(n * mtu * 8 / max(secs, 1e-9) / 1e9, 0, float("nan"))


def _control(path: str, lines: str) -> list[dict]:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(lines.encode())
        buf = b""
        while buf.count(b"\n") < lines.count("\n"):
            buf += s.recv(65536)
    replies = [json.loads(line) for line in buf.decode().splitlines()]
    for reply in replies:
        if not reply.get("ok"):
            raise RuntimeError(f"worker refused: {reply}")
    return replies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=10, help="iperf3 duration per row (default 10)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="run every row this many times, interleaved; the table shows medians (default 3)")
    ap.add_argument("--only", help="comma-separated row names to run (anchors always run)")
    ap.add_argument("--compare", metavar="DIR",
                    help="also run the udp and ipip rows with the code in DIR (holding agentd/ and proto/)")
    ap.add_argument("--pin", action="store_true",
                    help="pin the iperf3 client to CPU 0 and the server to CPU 1 (the workers float)")
    args = ap.parse_args()
    if args.pin:
        global PIN_CLIENT, PIN_SERVER
        PIN_CLIENT, PIN_SERVER = ("taskset", "-c", "0"), ("taskset", "-c", "1")
    rows = list(ROWS)
    if args.compare:
        if not os.path.isfile(os.path.join(args.compare, "agentd", "dataplane", "__main__.py")):
            print(f"bench/dataplane.py: {args.compare} holds no agentd/dataplane", file=sys.stderr)
            return 1
        source = os.path.abspath(args.compare)
        at = next(i for i, r in enumerate(rows) if r[0] == "udp")
        rows[at:at] = [("udp before", "udp", {"offload": True, "source": source}),
                       ("ipip before", "ipip", {"offload": True, "source": source})]
    if args.rounds < 1 or args.seconds < 1:
        print("bench/dataplane.py: --rounds and --seconds must be at least 1", file=sys.stderr)
        return 1
    if os.geteuid() != 0:
        print("bench/dataplane.py: needs root (network namespaces)", file=sys.stderr)
        return 1
    wanted = set(args.only.split(",")) if args.only else None
    tag = unique_tag("bdp")
    runs: dict[str, list[Round]] = {}
    background = busy_share()
    load = os.getloadavg()
    selected = [
        (n, name, kind, opts) for n, (name, kind, opts) in enumerate(rows)
        if not wanted or name in wanted or kind in ("raw", "vxlan")
        or (name.endswith(" before") and name.split()[0] in wanted)
    ]
    try:
        for r in range(args.rounds):
            for n, name, kind, opts in selected:
                got = run_row(kind, opts, args.seconds, tag, f"r{r}n{n}")
                runs.setdefault(name, []).append(got)
                print(f"  round {r + 1}/{args.rounds} {name:<13} {got.gbps:6.2f} Gbit/s, {got.retr} retr", file=sys.stderr, flush=True)
            delete_matching(f"ad-{tag}-r{r}n")
    finally:
        delete_matching(f"ad-{tag}-")
    results = []
    for name, got in runs.items():
        ordered = sorted(got, key=lambda g: g.gbps)
        mid = ordered[len(ordered) // 2]  # the median round (the upper one of an even count)
        spread = f"{ordered[0].gbps:.2f}-{ordered[-1].gbps:.2f}" if len(got) > 1 else ""
        retr = sorted(g.retr for g in got)[len(got) // 2]
        results.append((name, mid, spread, retr))
    by = {name: mid.gbps for name, mid, _, _ in results}
    raw, vx = by.get("raw veth") or float("nan"), by.get("kernel vxlan") or float("nan")
    print(f"\nagentd data plane: iperf3 TCP, 1 stream, {args.seconds} s, pod -> pod (2 cores shared by "
          f"iperf3 x2, both workers and softirq); median of {args.rounds} interleaved rounds")
    after = os.getloadavg()
    print(f"machine CPU busy before the run (other jobs): {background * 100:.0f}%; load average "
          f"{load[0]:.2f} before, {after[0]:.2f} after"
          + ("  <- rows are skewed by other load" if background > 0.1 else "") + "\n")
    print(f"{'path':<14} {'Gbit/s':>7} {'range':>11} {'x raw veth':>10} {'x vxlan':>8} {'retr':>6} {'ping ms':>8}  "
          f"{'worker CPU tx / rx':<19} {'us CPU per 64 KB tx / rx':<25} pkts per TUN read / write")
    print("-" * 145)
    for name, mid, spread, retr in results:
        print(f"{name:<14} {mid.gbps:7.2f} {spread:>11} {mid.gbps / raw:10.2f} {mid.gbps / vx:8.2f} {retr:6d} "
              f"{mid.ping:8.3f}  {mid.cpu:<19} {mid.per64k:<25} {mid.per_io}")
    print("\nanchors (context, not measured here):")
    for a in ANCHORS:
        print(f"  - {a}")
    print("\ngoals:")
    for name, base, want in GOALS:
        if name in by:
            got = by[name] / (raw if base == "raw veth" else vx)
            print(f"  {name:<8} >= {want:.2f}x {base:<12}: {got:.2f}x  {'met' if got >= want else 'NOT met'}")
    for fast, slow in (("udp", "udp no-offl"), ("ipip", "ipip no-offl")):
        if fast in by and by.get(slow):
            print(f"  {fast:<8} offload / per-packet baseline: {by[fast] / by[slow]:.2f}x "
                  "(Tailscale's offload path: 2.2x)")
    if by.get("ipip") and by.get("ipip ceiling"):
        print(f"  ipip     / the raw-socket ceiling (ipip ceiling row): {by['ipip'] / by['ipip ceiling']:.2f}x")
    for fast in ("udp", "ipip"):
        if fast in by and by.get(f"{fast} before"):
            print(f"  {fast:<8} after / before (--compare): {by[fast] / by[f'{fast} before']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
