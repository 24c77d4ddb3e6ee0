"""Ingress: requests through the node's HAProxy as agentd configures it, side by side with anchors.

    .venv/bin/python bench/ingress.py [--seconds 5] [--churn-seconds 30] [--rounds 3] [--only PARTS] [--quick] [--json FILE]

Real: etcd, two `agentd run` agents (host-gw) with `[ingress] enabled`, two pods (one per
node) running agentd.lab.httpecho (aiohttp), an IngressClass, a Service without selector
whose EndpointSlice lists both pods, and an Ingress for host bench.example.  The client is
wrk (Debian's), run in node2's namespace against node1's address (the ingress) or a pod.

Rows, each wrk with 2 threads and 16 connections for --seconds (keep-alive, or a new
connection per request with ``Connection: close``) asking for ``/bytes/64`` (a fixed answer,
whatever the request's headers): requests/s (answered ones: an error answer, non-2xx or 3xx,
is not counted, though wrk's own Requests/sec counts it; a run with none answered stops the
bench), p50 and p99 latency, failed requests (socket errors + non-2xx), and the proxy's CPU
per request (its workers' user + system time over the
run: what the load on the machine does not change); --rounds rounds, each starting with
another row, medians:

* ``pod directly``: wrk to one pod's address;
* ``proxy alone (anchor)``: the same HAProxy binary in node1's namespace on port 8081, one
  frontend and one backend listing the same two pods, with what a hand-written HAProxy in
  front of an HTTP service gives it too and the ingress gives every request: the same
  forwarded headers (X-Forwarded-For, X-Real-IP, X-Forwarded-Proto/Host/Port), the same
  backend settings (round robin, retries, connection reuse), no access log (the ingress's
  default).  Not the routing: what the ingress costs is the difference to this;
* ``agentd ingress``: node1's port 80, host bench.example.

Both proxies run as daemons in a session of their own (the agent starts HAProxy with
``-D``; the anchor with ``setsid``), while wrk and the pods share the bench's session.  That
matters on Linux with ``kernel.sched_autogroup_enabled = 1`` (this machine's default): the
scheduler shares the CPU between sessions first, and the same HAProxy configuration started in
the bench's session, beside wrk and the pods, served about three times the keep-alive
requests/s it served when started in a session of its own.  The anchor used to run in the
bench's session while agentd's HAProxy ran in the agent's: that, not the configuration, was
most of the gap the first runs showed.

Then, each round, both proxies at once: two wrk (one thread, 8 connections each), one to the
anchor and one to the ingress, for the same seconds.  On a shared machine whose load changes
from one five-second run to the next (single runs of the same row differ by 2x and more),
rows measured one after the other compare runs under different loads; two proxies measured
at the same time share whatever load there is.  The goal is judged on that table: the median
of the rounds' ratios.

Churn (--churn-seconds, 30 s by the issue), wrk keep-alive meanwhile:

* endpoints: one change every 100 ms (pod 2 made not ready, ready again, ...): agentd changes
  the servers through the runtime API; the anchor is the same proxy alone re-rendered and
  reloaded (SIGUSR2, master-worker) on every change, as a template-and-reload controller (and
  ingress-nginx before its Lua balancer) does;
* Ingresses: one change per second (a new host rule): agentd reloads gracefully; the anchor
  reloads the proxy alone at the same rate.

New rule: seconds from `agentd apply` (through the lab's resource helper: one etcd write) of an
Ingress with a new host until the first 200 for that host from every node (polled every 5 ms
by a client in node2's namespace), median and max of 5.

Goals of the issue: throughput through the ingress >= 0.9x the proxy alone; 0 failed requests
during churn; a new rule served everywhere in < 1 s.  The machine is shared (2 cores): the
table names the load average, and pods in Python (aiohttp) bound the absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import _wrk  # noqa: E402
from bench._common import (BenchError, judged, parse_bench_args, print_notes, print_table, require_root,  # noqa: E402
                           run_main, write_json)

from agentd.ingress.haproxy import BACKEND_DEFAULTS, FORWARDED  # noqa: E402
from agentd.lab.errors import LabError  # noqa: E402
from agentd.lab.httpecho import HttpEcho  # noqa: E402
from agentd.lab.lab import Lab, LabSpec  # noqa: E402
from agentd.lab.netns import NetnsError, unique_tag  # noqa: E402

NS = "bench"
PARTS = ("throughput", "endpoints", "ingresses", "first")
HOST = "bench.example"
ANCHOR_PORT = 8081
# A fixed 64-byte answer: the pods' work does not depend on the request's headers (the ingress
# adds X-Forwarded-*; an echo of them would make the pods, the bottleneck here, slower).
PATH = "/bytes/64"


def objects(pods: dict[str, str], ready2: bool = True) -> list[dict[str, Any]]:
    eps = [{"addresses": [pods["web-1"]], "conditions": {"ready": True}},
           {"addresses": [pods["web-2"]], "conditions": {"ready": ready2}}]  # fmt: skip
    return [
        {"apiVersion": "networking.k8s.io/v1", "kind": "IngressClass", "metadata": {"name": "agentd"},
         "spec": {"controller": "agentd.io/ingress-controller"}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": NS},
         "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "web-1", "namespace": NS, "labels": {"kubernetes.io/service-name": "web"}},
         "addressType": "IPv4", "endpoints": eps, "ports": [{"name": "http", "port": 8080}]},
        ingress("bench", [HOST]),
    ]  # fmt: skip


def ingress(name: str, hosts: list[str]) -> dict[str, Any]:
    rules = [{"host": h, "http": {"paths": [{"path": "/", "pathType": "Prefix",
              "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}} for h in hosts]  # fmt: skip
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": name, "namespace": NS},
            "spec": {"ingressClassName": "agentd", "rules": rules}}  # fmt: skip


# ---------------------------------------------------------------- wrk


async def wrk(lab: Lab, url: str, seconds: float, *, host: str | None = None, close: bool = False, threads: int = 2,
              connections: int = 16, need_answers: bool = True) -> dict[str, float]:  # fmt: skip
    """One wrk run in node2's namespace (bench/_wrk.py); an answer slower than wrk's 2 s
    timeout counts as failed here too (churn's goal is no request failed or stalled)."""
    r = await _wrk.run(lab.nodes[1].ns, url, seconds, host=host, close=close, threads=threads, connections=connections,
                       need_answers=need_answers)  # fmt: skip
    r["failed"] += r["timeouts"]
    return r


# ---------------------------------------------------------------- the anchor: the proxy alone


class ProxyAlone:
    """The same HAProxy in node1's namespace: one frontend, one backend, the pods as servers;
    ``reload`` rewrites its configuration and reloads it (SIGUSR2: master-worker)."""

    def __init__(self, lab: Lab, pods: list[str]) -> None:
        self.lab = lab
        self.dir = Path(tempfile.mkdtemp(prefix="anchor-", dir=lab.dir))
        self.pods = pods
        self.proc: subprocess.Popen | None = None

    def render(self, servers: list[str]) -> None:
        lines = ["global", f"    stats socket {self.dir}/admin.sock mode 600 level admin expose-fd listeners",
                 "defaults", "    mode http", "    no log", "    timeout connect 5s", "    timeout client 60s", "    timeout server 60s",
                 "    option http-keep-alive", "    option idle-close-on-response", "frontend alone", f"    bind {self.lab.nodes[0].address}:{ANCHOR_PORT}",
                 *(f"    {line}" for line in FORWARDED), "    default_backend pods", "backend pods",
                 *(f"    {line}" for line in BACKEND_DEFAULTS)]  # fmt: skip
        lines += [f"    server {ip}:8080 {ip}:8080" for ip in servers]
        (self.dir / "haproxy.cfg").write_text("\n".join(lines) + "\n")

    def start(self) -> None:
        self.render(self.pods)
        # A session of its own, as agentd's HAProxy (see the module's docstring: autogroups).
        self.proc = self.lab.nodes[0].ns.popen(["haproxy", "-W", "-S", f"{self.dir}/master.sock", "-f", str(self.dir / "haproxy.cfg")],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip

    def reload(self, servers: list[str]) -> None:
        self.render(servers)
        assert self.proc is not None
        self.proc.send_signal(signal.SIGUSR2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def proxy_workers(lab: Lab, alone: ProxyAlone, label: str) -> list[int]:
    """The HAProxy worker processes of a row (none for the pod row)."""
    if label == "agentd ingress":
        return [lab.nodes[0].api("/ingress")["worker"]]
    if label.startswith("proxy alone") and alone.proc is not None:
        out = subprocess.run(["pgrep", "-P", str(alone.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]
    return []


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (the proxy's cost per request, whatever the load)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


# ---------------------------------------------------------------- first 200 everywhere

POLLER = """
import sys, time, http.client
host, addrs = sys.argv[1], sys.argv[2:]
print("ready", flush=True)
sys.stdin.readline()
start = time.perf_counter()
left, out = set(addrs), {}
while left and time.perf_counter() - start < 30:
    for a in sorted(left):
        try:
            c = http.client.HTTPConnection(a, 80, timeout=1)
            c.request("GET", "/", headers={"Host": host})
            if c.getresponse().status == 200:
                out[a] = time.perf_counter() - start
                left.discard(a)
            c.close()
        except OSError:
            pass
    time.sleep(0.005)
print(max(out.values()) if not left else -1, flush=True)
"""


async def first_200(lab: Lab, res: Any, n: int) -> float:
    host = f"new{n}.example"
    proc = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", lab.nodes[1].ns.name, sys.executable, "-c", POLLER, host, *[x.address for x in lab.nodes],
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    await proc.stdout.readline()
    proc.stdin.write(b"go\n")
    await proc.stdin.drain()
    await res.apply(ingress(f"new{n}", [host]))
    seconds = float((await proc.stdout.readline()).decode())
    await proc.wait()
    if seconds < 0:
        raise BenchError(f"{host}: not served by every node within 30 s of the apply")
    await res.delete("Ingress", NS, f"new{n}")
    return seconds


# ---------------------------------------------------------------- the run


async def churn(lab: Lab, res: Any, pods: dict[str, str], alone: ProxyAlone, seconds: float, what: str) -> tuple[dict, dict]:
    """(agentd, anchor) under wrk while changes happen: endpoints every 100 ms or Ingresses every second."""
    interval = 0.1 if what == "endpoints" else 1.0
    results = []
    for target in ("agentd", "anchor"):
        url = f"http://{lab.nodes[0].address}:{80 if target == 'agentd' else ANCHOR_PORT}{PATH}"
        load = asyncio.ensure_future(wrk(lab, url, seconds, host=HOST, need_answers=False))
        start, i = time.monotonic(), 0
        while time.monotonic() - start < seconds - 0.5:
            i += 1
            if target == "agentd":
                if what == "endpoints":
                    await res.apply(objects(pods, ready2=i % 2 == 0)[2])
                else:
                    await res.apply(ingress("bench", [HOST] + [f"churn{i}.example"]))
            else:
                alone.reload([pods["web-1"]] + ([pods["web-2"]] if i % 2 == 0 or what != "endpoints" else []))
            await asyncio.sleep(max(0.0, start + i * interval - time.monotonic()))
        result = await load
        result["changes"] = i
        results.append(result)
    await res.apply(objects(pods))
    return results[0], results[1]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = LabSpec(name="bi" + unique_tag("")[:6], nodes=2, pods=0, backend="host-gw", ingress=True)
    lab = Lab(spec)
    echo: list[HttpEcho] = []
    alone = None
    out: dict[str, Any] = {"rows": [], "both": [], "load": os.getloadavg()}
    try:
        await lab.up(timeout=120)
        pods = {}
        for i, node in enumerate(lab.nodes, start=1):
            pod = await lab.add_pod(node, NS, f"web-{i}", labels={"app": "web"})
            echo.append(await HttpEcho.start(pod, f"web-{i}", [8080]))
            pods[f"web-{i}"] = pod.ip
        res = await lab.resources()
        await res.apply(objects(pods))
        first = await first_200(lab, res, 0)  # warm: every node serves
        alone = ProxyAlone(lab, list(pods.values()))
        alone.start()
        await asyncio.sleep(1)
        node1 = lab.nodes[0].address
        only = set(args.only.split(","))
        targets = [("pod directly", f"http://{pods['web-1']}:8080{PATH}", None),
                   ("proxy alone (anchor)", f"http://{node1}:{ANCHOR_PORT}{PATH}", None),
                   ("agentd ingress", f"http://{node1}{PATH}", HOST)]  # fmt: skip
        for n in range(args.rounds if "throughput" in only else 0):
            order = targets[n % 3:] + targets[:n % 3]  # each round starts with another row: the load drifts
            for close in (False, True):
                mode = "new connection" if close else "keep-alive"
                for label, url, host in order:
                    workers = proxy_workers(lab, alone, label)
                    before = cpu_seconds(workers)
                    r = await wrk(lab, url, args.seconds, host=host, close=close)
                    used = cpu_seconds(workers) - before
                    r["proxy_cpu_us"] = used / r["requests"] * 1e6 if workers and r["requests"] else None
                    out["rows"].append({"row": label, "mode": mode, **r})
                # Both proxies at once, half the connections each: the same load on the machine
                # for both, whatever it does meanwhile.
                anchor, ours = await asyncio.gather(
                    wrk(lab, targets[1][1], args.seconds, close=close, threads=1, connections=8),
                    wrk(lab, targets[2][1], args.seconds, host=HOST, close=close, threads=1, connections=8))  # fmt: skip
                out["both"].append({"mode": mode, "anchor": anchor, "ingress": ours})
        out["load_after"] = os.getloadavg()
        for what in ("endpoints", "ingresses"):
            if what in only:
                out[what] = await churn(lab, res, pods, alone, args.churn_seconds, what)
        if "first" in only:
            out["first_200"] = [first] + [await first_200(lab, res, n) for n in range(1, 6)]
    finally:
        if alone is not None:
            alone.stop()
        for e in echo:
            e.close()
        await lab.down()
    return out


def report(out: dict[str, Any]) -> None:
    load = ", ".join(f"{x:.2f}" for x in out["load"])
    if "load_after" in out:
        load += "; after the rows " + ", ".join(f"{x:.2f}" for x in out["load_after"])
    goals = []
    if out["rows"]:
        by: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in out["rows"]:
            by.setdefault((r["row"], r["mode"]), []).append(r)
        rows = []
        for (label, mode), rs in by.items():
            rps = statistics.median(r["rps"] for r in rs)
            anchor = statistics.median(r["rps"] for r in by[("proxy alone (anchor)", mode)])
            cpu = [r["proxy_cpu_us"] for r in rs if r.get("proxy_cpu_us") is not None]
            rows.append([label, mode, f"{rps:,.0f}/s", f"{statistics.median(r['p50_ms'] for r in rs):.2f}",
                         f"{statistics.median(r['p99_ms'] for r in rs):.2f}", str(sum(r["failed"] for r in rs)),
                         f"{rps / anchor:.2f}x", f"{statistics.median(cpu):.1f}" if cpu else "-"])  # fmt: skip
        print_table(f"Requests through the ingress (wrk -t2 -c16, medians of {len(out['rows']) // 6} rounds; load average at start {load})",
                    ["path", "connections", "requests/s", "p50 ms", "p99 ms", "failed", "vs proxy alone", "proxy CPU us/req"],
                    rows)  # fmt: skip
        rows = []
        for mode in ("keep-alive", "new connection"):
            both = [b for b in out["both"] if b["mode"] == mode]
            ratio = statistics.median(b["ingress"]["rps"] / b["anchor"]["rps"] for b in both)
            for label, key in (("proxy alone (anchor)", "anchor"), ("agentd ingress", "ingress")):
                rows.append([label, mode, f"{statistics.median(b[key]['rps'] for b in both):,.0f}/s",
                             f"{statistics.median(b[key]['p99_ms'] for b in both):.2f}", str(sum(b[key]["failed"] for b in both)),
                             f"{ratio:.2f}x" if key == "ingress" else "1.00x"])  # fmt: skip
            goals.append(f"throughput through the ingress >= 0.9x the proxy alone ({mode}, both at once): "
                         f"{': '.join(judged(ratio, 0.9))}")  # fmt: skip
        print_table(f"Both proxies at once (two wrk -t1 -c8, one per proxy; medians of {len(out['both']) // 2} rounds, "
                    "ratio: the median of the rounds' ratios)",
                    ["path", "connections", "requests/s", "p99 ms", "failed", "vs proxy alone"], rows)  # fmt: skip
    rows = []
    for what, label in (("endpoints", "endpoint change every 100 ms"), ("ingresses", "Ingress change every 1 s")):
        if what not in out:
            continue
        ours, anchor = out[what]
        for who, r in (("agentd ingress (runtime API)" if what == "endpoints" else "agentd ingress (graceful reload)", ours),
                       ("proxy alone, reloaded per change (anchor)", anchor)):  # fmt: skip
            rows.append([label, who, str(r["changes"]), f"{r['requests']:,}", str(r["failed"]), f"{r['p99_ms']:.2f}",
                         f"{r['rps']:,.0f}/s"])  # fmt: skip
        goals.append(f"0 failed requests during {label} (agentd): {ours['failed']}: {'met' if ours['failed'] == 0 else 'NOT met'}")
    if rows:
        print_table(f"During changes (wrk -t2 -c16 keep-alive; load average at start {load})",
                    ["changes", "who", "n", "requests", "failed", "p99 ms", "requests/s"], rows)  # fmt: skip
    if "first_200" in out:
        firsts = out["first_200"][1:]
        print_table("New host rule: agentd apply -> first 200 from every node (2 nodes)",
                    ["samples", "median s", "max s"], [[str(len(firsts)), f"{statistics.median(firsts):.3f}", f"{max(firsts):.3f}"]])  # fmt: skip
        shown, verdict = judged(max(firsts), 1, at_least=False, strict=True, unit=" s")
        goals.append(f"new rule served everywhere < 1 s: max {shown}: {verdict}")
    print_notes("goals", goals)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="wrk duration per throughput row (default 5)")
    ap.add_argument("--churn-seconds", type=float, default=30.0, help="duration of each churn run (default 30)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the throughput rows, alternating (medians; default 3)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts to run, of: {', '.join(PARTS)}")
    args = parse_bench_args(ap, argv, name="ingress", quick={"seconds": 2.0, "churn_seconds": 5.0, "rounds": 1})
    unknown = set(args.only.split(",")) - set(PARTS)
    if unknown or args.seconds < 1 or args.churn_seconds < 2 or args.rounds < 1:
        ap.error(f"--only takes {', '.join(PARTS)}; --seconds >= 1, --churn-seconds >= 2, --rounds >= 1")
    require_root("bench/ingress.py")
    out = asyncio.run(run(args))
    write_json(args.json, out)
    report(out)
    return 0


if __name__ == "__main__":
    run_main(main, "bench/ingress.py", errors=(LabError, NetnsError))
