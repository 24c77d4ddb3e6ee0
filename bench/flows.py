"""What flow records cost: recording on vs. off, side by side, and a drop storm.

    sudo .venv/bin/python bench/flows.py [--seconds 5] [--rounds 2] [--storm-pps 100000] [--storm-seconds 5] [--drops 20]
                                         [--placement both|split|one] [--node-cpus]
                                         [--quick] [--json FILE]

One 2-node lab (host-gw): a client pod on node1, a server pod and a second client on node2.
Both agents run alternately with ``[flows] enabled = false``, with drops only (``enabled =
true``, ``connections = false``) and with ``true`` (restarted between modes), ``--rounds``
rounds of one run each, the order turned round every other round (off, drops, on; on, drops,
off; ...) so that a drift of the machine's load falls on all alike; each run measures:

* ``conn/s``: many short TCP connections, client pod to server pod across nodes and on one
  node: wrk (one thread, 4 connections at once, ``Connection: close``: connect, one HTTP
  request and answer, close) against HAProxy answering every request itself (one thread,
  no backend) in the server pod, for ``--seconds`` (whole seconds); with the CPU seconds both
  agents used meanwhile and until they were done with the run's connections (quiet, as below:
  the records recording reads after the run are part of the cost) (/proc/PID/stat), per 1000
  connections, and the machine's busy CPU seconds over the same span; the rate counts the requests
  answered (each its own connection), and a run in which more than 1% failed (socket errors
  and error answers; or none answered) stops the bench; the failed ones are counted under the
  table.  Client and server are in C, whose own work per connection is small beside
  svcecho's: until stop 46 the rate was svcecho's TCP_CRR, a Python client and server whose
  own 300-360 us a connection were about half of what a connection cost the core, which
  flattered the ratio (all on CPU 0, pooled: 0.954x and 0.968x then, 0.933x and 0.939x in
  the first run with wrk).  A connect error stops the bench (wrk does not open such a
  connection again: the run would go on with fewer at once).  The stream starts once both
  agents are quiet (under 5 ms of CPU in a quarter second, at most 5 s): the tens of
  thousands of connections just made leave them records to read;
* ``Gbit/s``: one iperf3 stream for ``--seconds``, across nodes and on one node.

Each mode's run measures two placements of the processes (``--placement``, both by default):

* ``split``: clients on CPU 0 and the servers on CPU 1 (``taskset``, as bench/policy.py does;
  the agents go where the scheduler puts them: their CPU is what is measured), which halves
  the spread between runs of one mode on 2 cores -- for the connection rate.  One stream's
  throughput between two CPUs varies by a fifth from run to run in either mode, flows off
  or on, the fast path on or off: the sender's segments leave from both CPUs (TCP small
  queues send from the core that freed the last ones, the receiver's), each CPU's backlog
  delivers its own, and the receiver sees them out of order (thousands of fast
  retransmissions a run where the stream stays on one core: none);
* ``one CPU``: the clients, the servers, iperf3's both ends and both agents (every thread)
  on CPU 0: every cycle recording costs -- the programs, conntrack, the agents' reading --
  is taken from the one core the traffic runs on, the strictest reading of its cost, and
  the rounds agree more closely.

In the split placement, a veth's receive work runs on the CPU that sent, so across nodes the client's CPU also does both nodes' forwarding and the server
pod's receiving: two hosts' work on one core.  ``--node-cpus`` steers what each node receives
on its underlay device to its own CPU (RPS, as bench/dataplane.py --node-cpus: node 1 beside
the client on CPU 0, node 2 beside the server on CPU 1), as on two hosts; traffic on one node
crosses no underlay device and is not steered.  The ratio on/off is the median of each round's
own ratio (its runs a minute or two apart at most), with the lowest and highest beside it;
drops only beside them, as its own median ratio to off.

Goals: connection rate >= 0.95x and throughput >= 0.98x of recording off (recording on).

Then, with recording on, a drop storm: a NetworkPolicy isolates the server, and a pod it
denies sends it UDP at ``--storm-pps`` for ``--storm-seconds`` (paced, bounded; at least 5,
also under --quick).  Beside a quiet baseline it measures node2's agent from 1 s into the
storm: API latency (GET /status, median and worst of 20, 0.1 s apart), policy change latency
(5 NetworkPolicies applied one after another, each timed until node2 has it in the kernel:
median and worst), RSS before and after, and what was recorded and suppressed; a storm that
ends before these readings do stops the bench.  Then the agents restart with flows off and
the same storm runs again, measured alike: 100,000 packets a second keep the 2 cores' softirq
busy whatever records them, so "during the storm, recording on / flows off" is what
recording the storm costs the agent's other work.  ``--storms`` such pairs (3 by default, in
the order on,off / off,on by turns), every sample of one mode pooled: one storm's 5 policy
changes of 10-20 ms each cannot tell a slowdown of a fifth.  Goal: neither slower nor bigger.

``drop -> followed stream``: with recording on and the server isolated, the client on node2
that the policy denies connects to a new port of the server ``--drops`` times; for each, the
time from the client's attempt to the drop's record on a followed ``GET /flows`` stream of
node2's own API, and of node1's gathering every node (``cluster=1``, through node2's read-only
listener).  Goal: within a second (docs/observability.md).

``ring memory``: the bytes one node's full ring (``[flows] ring_size``, 10,000 records) takes,
measured with tracemalloc on records built by the recorder's own classes (50 pods).

The machine is shared (2 cores): the figures move with other load; read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import _iperf, _wrk  # noqa: E402
from bench._common import (CRR_FAILED_SHARE, BenchError, crr_checked, judged, parse_bench_args,  # noqa: E402
                           print_notes, print_table, require_root, run_main, write_json)
from bench.dataplane import steer

from agentd.flows.model import Flow, Identity, Peer  # noqa: E402
from agentd.flows.recorder import CONN_RECORD, FlowRecorder, PendingConnection, RecordedBatch  # noqa: E402
from agentd.flows.ring import FlowRing  # noqa: E402
from agentd.kernel import netlink as nl  # noqa: E402
from agentd.kernel import netlink_ct as ct  # noqa: E402
from agentd.lab.errors import LabError  # noqa: E402
from agentd.lab.lab import Lab, LabSpec  # noqa: E402
from agentd.lab.netns import NetnsError, unique_tag  # noqa: E402
from agentd.lab.svcecho import Echo  # noqa: E402
from agentd.lab.wait import auntil  # noqa: E402

NS = "bench"
MODES = ("off", "drops", "on")  # flows off; [flows] connections = false (drops only); flows on
CLIENT_CPU, SERVER_CPU = ("taskset", "-c", "0"), ("taskset", "-c", "1")
# Where the servers run, and the agents (None: where the scheduler puts them), per placement;
# the clients always on CPU 0.  Keys of measure() carry the placement's suffix.
PLACEMENTS = {"split": {"server_cpu": 1, "agents_cpu": None, "suffix": "", "label": ""},
              "one": {"server_cpu": 0, "agents_cpu": 0, "suffix": "_one", "label": ", all on CPU 0"}}
IPERF_PORTS = {"split": _iperf.PORT, "one": _iperf.PORT + 1}  # one iperf3 server pinned per placement
HTTP_PORTS = {"split": 8081, "one": 8082}  # one HAProxy answering pinned per placement (the connection rate)
CRR_CONNECTIONS = 4  # wrk's connections at once: each a new TCP connection per request


def pin(pid: int, cpu: int | set[int]) -> None:
    """Every thread of process ``pid`` (and so what it starts later) on ``cpu`` (or a set of CPUs)."""
    cpus = {cpu} if isinstance(cpu, int) else cpu
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def place(lab: Lab, echo: dict[str, Echo], placement: str) -> None:
    """Put the echo servers and clients, and both agents, where ``placement`` says."""
    where = PLACEMENTS[placement]
    for name, e in echo.items():
        pin(e.proc.pid, where["server_cpu"] if name == "server" else 0)
    anywhere = os.sched_getaffinity(0)
    for node in lab.nodes:
        pid = node.agent_pid()
        if pid is None:
            raise BenchError(f"{node.name}: no agent to place")
        pin(pid, anywhere if where["agents_cpu"] is None else where["agents_cpu"])


def rss_mb(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def placements_of(choice: str) -> list[str]:
    """The placements ``--placement`` measures, in the order of a round."""
    return list(PLACEMENTS) if choice == "both" else [choice]


def node_cpus_error(cpus: set[int]) -> str | None:
    """--node-cpus puts node 1 beside the clients (CPU 0) and node 2 beside the servers (CPU 1):
    refused (the reason) unless this process may run on both (``cpus``: its affinity)."""
    if not {0, 1} <= cpus:
        return (f"--node-cpus puts each node beside the clients' CPU 0 and the servers' CPU 1, but this process may run "
                f"on CPUs {','.join(map(str, sorted(cpus)))} only")
    return None


async def restart(lab: Lab, flows: bool, connections: bool = True) -> None:
    for node in lab.nodes:
        lab.spec.extra.setdefault(node.name, {})["flows"] = {"enabled": flows, "connections": connections}
        await node.stop_agent()
        node.start_agent()
    await lab.ready.agents_started(60)
    await lab.ready.established(60)

    def settled() -> bool:
        for n in lab.nodes:
            s = n.api_or_none("/status") or {}
            f = s.get("flows") or {}
            if not s.get("ready") or bool(f.get("on")) != flows or (flows and f.get("connections") is not connections):
                return False
            p = n.api_or_none("/policy?view=summary") or {}
            if p.get("applied_at") is None:
                return False
        return True

    deadline = time.monotonic() + 60
    while not settled():
        if time.monotonic() > deadline:
            raise BenchError(f"agents not settled with flows {('on' if connections else 'drops only') if flows else 'off'}")
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)  # the first sync's transaction is in; let the restart's CPU settle


def bridged_frames(lab: Lab, *, off: bool) -> bool:
    """Whether br_netfilter hands the nodes' bridged frames to the IP hooks (conntrack sees
    connections between pods of one node without the agents routing them up: policy.md);
    ``off``: made so that it does not (bridge-nf-call-iptables = 0 in each node's namespace,
    as on a host without the module), before the agents' first restart reads it."""
    key = "/proc/sys/net/bridge/bridge-nf-call-iptables"
    values = []
    for node in lab.nodes:
        if off and node.ns.exec("sh", "-c", f"test -e {key} && echo yes", check=False).strip() == "yes":
            node.ns.sysctl("net.bridge.bridge-nf-call-iptables", 0)
        values.append(node.ns.exec("sh", "-c", f"cat {key} 2>/dev/null || echo 0", check=False).strip() == "1")
    return all(values)


def cpu_seconds(pid: int | None) -> float:
    """User and system CPU seconds a process has used (/proc/PID/stat utime + stime)."""
    if pid is None:
        return float("nan")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (/proc/stat: all but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


SETTLE_MAX = 5.0  # seconds the stream waits at most for the agents to be done with the connections


async def settled(pids: list[int | None], *, quiet: float = 0.005, every: float = 0.25, limit: float = SETTLE_MAX,
                  sleep: Any = asyncio.sleep, clock: Any = time.monotonic) -> float:  # fmt: skip
    """Wait until the agents (``pids``; None: no agent to wait for) used less than ``quiet`` CPU
    seconds together in ``every`` seconds, at most ``limit`` seconds; the seconds waited."""
    known = [p for p in pids if p is not None]
    start = clock()
    if not known:
        return 0.0
    before = [cpu_seconds(p) for p in known]
    while clock() - start < limit:
        await sleep(every)
        now = [cpu_seconds(p) for p in known]
        if sum(b - a for a, b in zip(before, now)) < quiet:
            break
        before = now
    return clock() - start


async def measure(lab: Lab, pods: dict[str, Any], seconds: float, placement: str = "split") -> dict[str, float]:
    """One mode's figures in one placement (the caller put the processes there: :func:`place`),
    keyed with the placement's suffix."""
    server = pods["server"]
    out: dict[str, float] = {}
    sfx = PLACEMENTS[placement]["suffix"]
    for where, client in (("across", "client"), ("same", "local")):
        pids = [n.agent_pid() for n in lab.nodes]
        agents, busy = [cpu_seconds(p) for p in pids], busy_seconds()
        what = f"{where}{PLACEMENTS[placement]['label']}"
        got = await _wrk.run(pods[client].ns, f"http://{server.ip}:{HTTP_PORTS[placement]}/", seconds, close=True, threads=1,
                             connections=CRR_CONNECTIONS, prefix=CLIENT_CPU)  # fmt: skip
        if got["connect_errors"]:  # wrk does not open a connection again whose connect failed: the rate would be low
            raise BenchError(f"connections {what}: {got['connect_errors']:,} connect error(s) (wrk's): the rate would "
                             f"not be the path's")
        r = crr_checked({"connections": got["answered"], "failed": got["failed"]}, f"connections {what}")
        per_k = 1000 / r["connections"]
        out[f"crr_{where}{sfx}"] = got["rps"]
        out[f"crr_failed_{where}{sfx}"] = r["failed"]
        out[f"crr_connections_{where}{sfx}"] = r["connections"]
        # The stream after the agents have done with the connections' records (tens of
        # thousands a run): measured beside that work it would read recording's backlog.
        out[f"settle_s_{where}{sfx}"] = await settled(pids)
        # The CPU is read once they have: reading the records is part of what the connections
        # cost (recording defers it past the run), still per 1000 of the connections made.
        out[f"agent_ms_{where}{sfx}"] = sum(cpu_seconds(p) - a for p, a in zip(pids, agents)) * 1000 * per_k
        out[f"busy_ms_{where}{sfx}"] = (busy_seconds() - busy) * 1000 * per_k
        run = await _iperf.client(pods[client].ns, server.ip, seconds, port=IPERF_PORTS[placement], prefix=CLIENT_CPU,
                                  what=f"iperf3 {what}")
        out[f"gbps_{where}{sfx}"] = run.gbps
    return out


def ring_memory(size: int = 10_000, pods: int = 50, *, deferred: bool = False, recorded: bool = False) -> float:
    """Bytes per node of a full ring of ``size`` records over ``pods`` pods (tracemalloc):
    records made (read), or ``deferred``: conntrack end events as the recorder keeps them
    until read (the kernel's bytes, laid out as Linux 6.18 sends a DESTROY, and the names), or
    ``recorded``: the pod programs' records as the recorder keeps them until read (reads of
    500 records, each read one object: the records' bytes side by side and the names)."""
    ids = [Identity(f"ns{i % 5}/pod-{i}", f"node{i % 3}", {"app": f"a{i}", "tier": "web"}, i % 2 == 0)
           for i in range(pods)]
    recorder = FlowRecorder("node1", None, "/nonexistent", group=0)  # type: ignore[arg-type]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    ring = FlowRing(size)
    if recorded:
        addresses = [socket.inet_aton(f"10.244.{i % 5}.{10 + i}") for i in range(pods)]  # pod i's
        for k in range(0, size * 2, 500):  # twice round
            ends = [(j % pods, (j * 7 + 1) % pods) for j in range(k, k + 500)]
            raws = [CONN_RECORD.pack(addresses[a] + addresses[b] + (30000 + j % 30000).to_bytes(2, "big")
                                     + (8080).to_bytes(2, "big"), 2, bytes(CONN_RECORD.size - 16))
                    for j, (a, b) in zip(range(k, k + 500), ends)]
            names = {addresses[i]: ids[i] for pair in ends for i in pair}
            ring.extend_batch(RecordedBatch("node1", b"".join(raws), len(raws), names, 0, time.time()))
        size = 0  # nothing more
    for k in range(size * 2):  # twice round: what stays is one full ring
        a, b = ids[k % pods], ids[(k * 7 + 1) % pods]
        src, dst = f"10.244.{k % 250}.{k % 200}", f"10.244.7.{k % 200}"
        if deferred:
            data = destroy_message(src, dst, 30000 + k % 30000, 8080)
            ring.add(PendingConnection(recorder, (data, ct.MSG_DELETE, a, b, b, None), None, time.time()))
            continue
        ring.add(Flow(time.time(), "node1", "end", "TCP", Peer(src, 30000 + k % 30000, a),
                      Peer(dst, 8080, b), "egress", bytes_sent=k, bytes_received=k,
                      packets_sent=3, packets_received=3, duration=0.01))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    used = sum(s.size_diff for s in after.compare_to(before, "filename"))
    del ring
    return used


def destroy_message(src: str, dst: str, sport: int, dport: int) -> bytes:
    """A conntrack DESTROY event as Linux 6.18 sends one (its attributes and their sizes)."""
    def u32(kind: int, value: int) -> bytes:
        return nl.attr(kind, value.to_bytes(4, "big"))

    def u64s(kind: int, *parts: tuple[int, int]) -> bytes:
        return nl.nested(kind, *(nl.attr(t, v.to_bytes(8, "big")) for t, v in parts))

    body = (ct.encode_tuple(ct.CTA_TUPLE_ORIG, ct.CtTuple(src, dst, 6, sport, dport))
            + ct.encode_tuple(ct.CTA_TUPLE_REPLY, ct.CtTuple(dst, src, 6, dport, sport))
            + u32(ct.CTA_ID, sport) + u32(ct.CTA_STATUS, 0x18e) + u32(7, 120)
            + u64s(ct.CTA_COUNTERS_ORIG, (1, 6), (2, 400)) + u64s(ct.CTA_COUNTERS_REPLY, (1, 5), (2, 300))
            + u64s(ct.CTA_TIMESTAMP, (1, 1), (2, 2)) + nl.nested(4, nl.nested(1, nl.attr(1, b"\x07")))
            + nl.attr(ct.CTA_TIMESTAMP_EVENT, (3).to_bytes(8, "big")))
    return nl.encode_nfgen(ct.MSG_DELETE, 0, 0, 2, body)


async def policy_latency(lab: Lab, res: Any, k: int | str) -> float:
    pol = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
           "metadata": {"name": f"probe-{k}", "namespace": NS},
           "spec": {"podSelector": {"matchLabels": {"app": "local"}}, "policyTypes": ["Egress"], "egress": [{}]}}
    node2 = lab.nodes[1]
    start = time.perf_counter()
    revision = await res.apply([pol])
    await applied(node2, revision, f"node2 to apply NetworkPolicy probe-{k}", interval=0.005)
    return time.perf_counter() - start


async def applied(node: Any, revision: int, what: str, *, timeout: float = 60, interval: float = 0.05) -> None:
    """Wait until ``node`` has applied the policy ``revision`` (BenchError after ``timeout``)."""
    def done() -> bool:
        return (node.api_or_none("/policy?view=summary") or {}).get("revision", 0) >= revision

    await auntil(done, timeout, what=what, interval=interval, error=BenchError)


POLICY_PROBES = 5  # policy changes a probe times, one after another (the median is its figure)


async def agent_probe(lab: Lab, res: Any, k: int | str) -> dict[str, Any]:
    """node2's agent: 20 GET /status 0.1 s apart, then POLICY_PROBES policy changes (``k``
    names them); medians and worst, and every sample (``api_ms``, ``policies_ms``: storms
    repeated pool them)."""
    node2 = lab.nodes[1]
    lat = []
    for _ in range(20):
        t = time.perf_counter()
        node2.api("/status")
        lat.append(time.perf_counter() - t)
        await asyncio.sleep(0.1)
    policy = [await policy_latency(lab, res, f"{k}-{i}") for i in range(POLICY_PROBES)]
    return {"api_median_ms": statistics.median(lat) * 1000, "api_max_ms": max(lat) * 1000,
            "policy_ms": statistics.median(policy) * 1000, "policy_max_ms": max(policy) * 1000,
            "api_ms": [x * 1000 for x in lat], "policies_ms": [x * 1000 for x in policy],
            "rss_mb": rss_mb(node2.agent_pid())}


STORM = """
import socket, sys, time
ip, pps, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
start = time.monotonic(); sent = 0; batch = max(1, pps // 1000)
while True:
    now = time.monotonic() - start
    if now >= seconds:
        break
    due = int(now * pps)
    while sent < due:
        for _ in range(batch):
            s.sendto(b"x" * 18, (ip, 9))
        sent += batch
    time.sleep(0.0005)
print(sent, time.monotonic() - start)
"""


DENY = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "isolate-server", "namespace": NS},
        "spec": {"podSelector": {"matchLabels": {"app": "server"}}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}]}]}}  # fmt: skip


async def isolate_server(lab: Lab, res: Any) -> None:
    revision = await res.apply([DENY])
    await applied(lab.nodes[1], revision, "node2 to apply the policy isolating the server")


class Followed:
    """A followed ``GET /flows`` in a node's namespace: each record with when it arrived."""

    def __init__(self, node: Any, query: str, token: str | None = None) -> None:
        self.records: list[tuple[float, dict[str, Any]]] = []
        with node.ns.entered():  # the socket belongs to the node's namespace from here on
            self.sock = socket.create_connection(("127.0.0.1", 9099), timeout=60)
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self.sock.sendall(f"GET /flows?{query} HTTP/1.0\r\nHost: 127.0.0.1\r\n{auth}\r\n".encode())
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        buf = b""
        with contextlib.suppress(OSError):
            while chunk := self.sock.recv(65536):
                now = time.monotonic()
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.startswith(b"{"):
                        self.records.append((now, json.loads(line)))

    def arrival(self, port: int) -> float | None:
        return next((t for t, r in self.records if r.get("dst", {}).get("port") == port), None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(10)


async def drop_latency(lab: Lab, pods: dict[str, Any], echo: dict[str, Echo], samples: int) -> dict[str, list[float]]:
    """Seconds from a denied connection attempt to its record on node2's followed stream and on
    node1's followed cluster stream, ``samples`` times (a new port each: its own limiter key)."""
    node1, node2 = lab.nodes
    query = f"follow=1&last=0&verdict=dropped&from-pod={NS}/local"
    streams = {"node": Followed(node2, query), "cluster": Followed(node1, query + "&cluster=1",
                                                                   node1.token_path.read_text().strip())}
    out: dict[str, list[float]] = {"node": [], "cluster": []}
    try:
        port = 20000
        deadline = time.monotonic() + 30
        while not all(s.arrival(port) for s in streams.values()):  # until both streams carry drops
            if time.monotonic() > deadline:
                raise BenchError("no drop record reached the followed streams within 30 s")
            port += 1
            await echo["local"].tcp(pods["server"].ip, port, timeout=0.3)
        for k in range(samples):
            port += 1
            start = time.monotonic()
            await echo["local"].tcp(pods["server"].ip, port, timeout=0.3)
            while not all(s.arrival(port) for s in streams.values()):
                if time.monotonic() - start > 10:
                    raise BenchError(f"the drop to port {port} did not reach both followed streams within 10 s")
                await asyncio.sleep(0.01)
            for name, stream in streams.items():
                out[name].append(stream.arrival(port) - start)  # type: ignore[operator]
    finally:
        for stream in streams.values():
            stream.close()
    return out


# The storm's readings are taken STORM_START seconds into it and take at least 2 s (20 GET
# /status 0.1 s apart) and then POLICY_PROBES policy changes (each some 10-20 ms here): a storm
# shorter than STORM_MIN_SECONDS would end before they do (and one that still does is a
# BenchError).
STORM_START, STORM_MIN_SECONDS = 1.0, 5.0


async def storm(lab: Lab, pods: dict[str, Any], res: Any, pps: int, seconds: float, *,
                recording: bool = True, name: str = "") -> dict[str, Any]:
    """The drop storm, node2's agent measured quiet and during it; ``recording`` False: with
    flows off (the same storm's own load on the machine, nothing recorded); ``name``: this
    storm's among several (its policy changes' names: each change a new one)."""
    k = f"{name}{'on' if recording else 'off'}"
    await isolate_server(lab, res)
    quiet = await agent_probe(lab, res, f"{k}-quiet")
    before = lab.nodes[1].api("/status")["flows"] if recording else None
    proc = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", pods["local"].ns.name, sys.executable, "-c", STORM, pods["server"].ip, str(pps), str(seconds),
        stdout=asyncio.subprocess.PIPE)  # fmt: skip
    try:
        await asyncio.sleep(STORM_START)
        during = await agent_probe(lab, res, f"{k}-storm")
        if proc.returncode is not None:  # then some of "during" was measured after the storm
            raise BenchError(f"the storm ended (the sender exited {proc.returncode}) before node2's agent was "
                             "measured during it: give a longer --storm-seconds")
        limit = seconds + 30  # the sender stops itself after ``seconds``
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), limit)
        except asyncio.TimeoutError:
            raise BenchError(f"the storm sender did not finish within {limit:.0f} s") from None
    finally:  # whatever happened, no sender outlives the storm
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    try:
        sent, took = out.split()
    except ValueError:
        raise BenchError(f"the storm sender exited {proc.returncode} without its count: {out[-200:]!r}") from None
    await asyncio.sleep(1.5)  # the last logged drops reach the agent (the kernel sends within 0.1 s)
    measured = {"quiet": quiet, "during": during, "rss_after_mb": rss_mb(lab.nodes[1].agent_pid()),
                "sent": int(sent), "pps": int(sent) / float(took)}
    if before is None:
        return measured
    after = lab.nodes[1].api("/status")["flows"]
    return {
        **measured,
        "records": after["flows"]["dropped"] - before["flows"]["dropped"],
        "suppressed_kernel": after["suppressed"]["kernel"] - before["suppressed"]["kernel"],
        "suppressed_agent": after["suppressed"]["agent"] - before["suppressed"]["agent"],
        "lost": lost_during(before.get("lost"), after["lost"]), "ring": after["records"],
    }


def lost_during(before: Any, after: Any) -> Any:
    """What /status's flows ``lost`` (the agent's running total: a count, or one per source)
    grew by between two readings."""
    if isinstance(after, dict):
        was = before if isinstance(before, dict) else {}
        return {k: v - was.get(k, 0) for k, v in after.items()}
    return (after or 0) - (before if isinstance(before, int) else 0)


async def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    lab = Lab(LabSpec(name="bf" + unique_tag("")[:6], nodes=2, pods=0, log_level="warning"), root=root)
    echo: dict[str, Echo] = {}
    try:
        await lab.up(timeout=120)
        if args.node_cpus:
            for cpu, node in enumerate(lab.nodes[:2]):
                steer(node.ns, cpu)
        bridge_nf = bridged_frames(lab, off=args.no_bridge_nf)
        pods = {"client": await lab.add_pod(lab.nodes[0], NS, "client", labels={"app": "client"}),
                "server": await lab.add_pod(lab.nodes[1], NS, "server", labels={"app": "server"}),
                "local": await lab.add_pod(lab.nodes[1], NS, "local", labels={"app": "local"})}
        for name in ("client", "local"):
            pods[name].ns.sysctl("net.ipv4.tcp_tw_reuse", 1)  # TCP_CRR from one address reuses its ports
        echo["server"] = await Echo.start(pods["server"], "server", [("tcp", 8080)])
        for name in ("client", "local"):
            echo[name] = await Echo.start(pods[name], name)
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        loads = [os.getloadavg()[0]]
        placements = placements_of(args.placement)
        async with contextlib.AsyncExitStack() as servers:
            for placement in placements:
                await servers.enter_async_context(_iperf.server(
                    pods["server"].ns, port=IPERF_PORTS[placement], what=f"iperf3 server ({placement})",
                    prefix=("taskset", "-c", str(PLACEMENTS[placement]["server_cpu"]))))
                await servers.enter_async_context(_wrk.answering(
                    pods["server"].ns, HTTP_PORTS[placement], what=f"HAProxy answering ({placement})",
                    prefix=("taskset", "-c", str(PLACEMENTS[placement]["server_cpu"]))))
            for k in range(args.rounds):
                for mode in MODES if k % 2 == 0 else MODES[::-1]:
                    await restart(lab, mode != "off", connections=mode == "on")
                    got: dict[str, float] = {}
                    for placement in placements if k % 2 == 0 else placements[::-1]:
                        place(lab, echo, placement)
                        got.update(await measure(lab, pods, args.seconds, placement))
                    runs[mode].append(got)
                    print(f"[flows {mode}] {got}", file=sys.stderr, flush=True)
                loads.append(os.getloadavg()[0])
            if args.node_cpus:  # the agents' restarts left the steering as it was
                for cpu, node in enumerate(lab.nodes[:2]):
                    rps = node.ns.exec("sh", "-c", "cat /sys/class/net/eth0/queues/rx-*/rps_cpus").split()
                    if not rps or any(int(x, 16) != 1 << cpu for x in rps):
                        raise BenchError(f"{node.name}: RPS of eth0 reads {rps} after the rounds, not CPU {cpu}")
            if mode != "on":  # what follows needs recording on, connections and all
                await restart(lab, True)
        # What follows (drops, the storms) with the processes where the first placement puts
        # them -- after each restart: a new agent runs where the bench may, not where the last was.
        place(lab, echo, placements[0])
        res = await lab.resources()
        await isolate_server(lab, res)
        latency = await drop_latency(lab, pods, echo, args.drops)
        print(f"[drop latency] {latency}", file=sys.stderr, flush=True)
        ring_size = lab.nodes[0].api("/status")["flows"]["ring_size"]  # while flows are on: off, /status has none
        # The storm recorded, and the same storm with flows off (its own load, apart from
        # recording's), --storms times each, in the order on,off / off,on by turns.
        storms: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
        recording = True  # as the drop latency left the agents
        for i, on in enumerate(storm_order(args.storms)):
            if on != recording:
                await restart(lab, on)
                place(lab, echo, placements[0])
                recording = on
            got = await storm(lab, pods, res, args.storm_pps, args.storm_seconds, recording=on, name=f"s{i}-")
            print(f"[storm {i + 1}, flows {'on' if on else 'off'}] {got}", file=sys.stderr, flush=True)
            storms["on" if on else "off"].append(got)
        storm_result = {**storms["on"][0], "off": storms["off"][0], "repeats": storms}
        return {"runs": runs, "loads": loads, "bridge_nf": bridge_nf, "storm": storm_result, "drop_latency": latency, "ring_bytes": ring_memory(ring_size),
                "ring_size": ring_size, "ring_bytes_deferred": ring_memory(ring_size, deferred=True),
                "ring_bytes_recorded": ring_memory(ring_size, recorded=True)}
    finally:
        for e in echo.values():
            await e.close()
        await lab.down()


def load() -> str:
    return f"load average {os.getloadavg()[0]:.2f}"


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="agentd-bench-flows-") as tmp:
        return await run(args, Path(tmp))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per measurement (default 5)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of off, drops only and on, interleaved (default 6)")
    ap.add_argument("--storm-pps", type=int, default=100_000, help="denied packets a second (default 100000)")
    ap.add_argument("--storm-seconds", type=float, default=5.0,
                    help=f"length of the storm, at least {STORM_MIN_SECONDS:.0f} (default 5)")
    ap.add_argument("--storms", type=int, default=3,
                    help="storm pairs, each a storm recorded and the same with flows off (default 3)")
    ap.add_argument("--drops", type=int, default=20, help="denied connections timed to the followed streams (default 20)")
    ap.add_argument("--no-bridge-nf", action="store_true",
                    help="bridge-nf-call-iptables = 0 in the nodes' namespaces (as on a host without br_netfilter): flow "
                         "records then route the pods of a node up through its IP stack to see their connections")
    ap.add_argument("--node-cpus", action="store_true",
                    help="each node's received packets on its own CPU (RPS on its underlay device: node 1 and the "
                         "clients CPU 0, node 2 and the servers CPU 1), as on two hosts")
    ap.add_argument("--placement", choices=("both", *PLACEMENTS), default="both",
                    help="split: clients on CPU 0, servers on CPU 1, the agents where the scheduler puts them; one: "
                         "clients, servers and both agents on CPU 0; both (default): each mode's run measures both")
    args = parse_bench_args(ap, argv, name="flows", quick={"seconds": 3.0, "rounds": 1, "drops": 5, "storms": 1})
    if args.node_cpus and args.placement != "split":
        ap.error("--node-cpus steers node 2's received packets to CPU 1: it goes with --placement split only")
    if args.seconds < 1 or args.rounds < 1 or args.storm_pps < 1 or args.drops < 1 or args.storms < 1:
        ap.error("--seconds, --rounds, --storm-pps, --storms and --drops must be at least 1")
    if not args.storm_seconds >= STORM_MIN_SECONDS:
        ap.error(f"--storm-seconds must be at least {STORM_MIN_SECONDS:.0f}: the readings during the storm begin "
                 f"{STORM_START:.0f} s into it and take over 2 s, then {POLICY_PROBES} policy changes")
    if args.node_cpus and (err := node_cpus_error(os.sched_getaffinity(0))):
        ap.error(err)
    require_root("bench/flows.py")
    r = asyncio.run(amain(args))
    r["node_cpus"] = args.node_cpus
    write_json(args.json, r)
    report(args, r)
    return 0


def storm_order(pairs: int) -> list[bool]:
    """The storms' order, True recording: a pair each, on,off then off,on by turns (so that
    neither mode always comes first, and a restart is saved between pairs)."""
    return [on for k in range(pairs) for on in ((True, False) if k % 2 == 0 else (False, True))]


def _pooled(storms: list[dict[str, Any]], phase: str, samples: str, worst: bool) -> float:
    values = [x for st in storms for x in st[phase][samples]]
    return max(values) if worst else statistics.median(values)


def repeated_storm_rows(reps: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    """storm_rows() of --storms pairs: every sample of the storms of one mode pooled (medians
    and worst of them all); RSS at the first storm's start and after the last."""
    on, off = reps["on"], reps["off"]
    rows = []
    for what, samples, fmt in (("GET /status", "api_ms", "{:.1f}"), ("policy change -> kernel", "policies_ms", "{:.0f}")):
        n = sum(len(st["during"][samples]) for st in on)
        for worst in (False, True):
            q, d = _pooled(on, "quiet", samples, worst), _pooled(on, "during", samples, worst)
            oq, od = _pooled(off, "quiet", samples, worst), _pooled(off, "during", samples, worst)
            rows.append([f"{what}, {'worst' if worst else 'median'} of {n} (ms)", fmt.format(q), fmt.format(d),
                         f"{d / q:.2f}x", fmt.format(oq), fmt.format(od), f"{od / oq:.2f}x", f"{d / od:.2f}x"])
    # RSS within each storm (the agents restart between modes: storms of one mode may be two
    # processes'): the growth from its quiet reading to after it, median and worst.
    def growth(storms: list[dict[str, Any]]) -> list[float]:
        return sorted(st["rss_after_mb"] - st["quiet"]["rss_mb"] for st in storms)

    g, og = growth(on), growth(off)
    rows.append([f"RSS growth in a storm (MB), median of {len(g)}", f"{statistics.median(st['quiet']['rss_mb'] for st in on):.1f}",
                 f"{statistics.median(g):+.1f}", "", f"{statistics.median(st['quiet']['rss_mb'] for st in off):.1f}",
                 f"{statistics.median(og):+.1f}", "", ""])
    rows.append([f"RSS growth in a storm (MB), worst of {len(g)}", "", f"{g[-1]:+.1f}", "", "", f"{og[-1]:+.1f}", "", ""])
    return rows


def storm_pairs_note(reps: dict[str, list[dict[str, Any]]]) -> str:
    """Each pair's own figure: the median policy change during the storm, recording on / flows off."""
    pairs = [f"{a['during']['policy_ms'] / b['during']['policy_ms']:.2f}x" for a, b in zip(reps["on"], reps["off"])]
    return (f"storms, {len(pairs)} pair(s): the median policy change during the storm, recording on / flows off, "
            f"pair by pair: {', '.join(pairs)}")


def lost_total(losts: Any) -> Any:
    """Storms' ``lost`` (each a count, or one per source) added up."""
    total: Any = None
    for lost in losts:
        if isinstance(lost, dict):
            total = dict(total) if isinstance(total, dict) else {}
            for k, v in lost.items():
                total[k] = total.get(k, 0) + v
        elif not isinstance(total, dict):
            total = (total or 0) + (lost or 0)
    return total


def lost_text(lost: Any) -> str:
    """/status's flows ``lost``: a count, or one per source ({"programs": 0}); none: 0."""
    if isinstance(lost, dict):
        return ", ".join(f"{k} {v:,}" for k, v in lost.items()) or "0"
    return f"{lost or 0:,}"


def storm_rows(s: dict[str, Any]) -> list[list[str]]:
    """The storm table's rows: recording on, quiet and during the storm; with flows off too
    (results of older runs have neither it nor the worst policy change); storms repeated
    (--storms) pooled."""
    reps = s.get("repeats")
    if reps and reps["off"] and all("api_ms" in st["quiet"] for mode in reps.values() for st in mode):
        return repeated_storm_rows(reps)
    rows = []
    off = s.get("off")
    for label, key, fmt in (("GET /status median (ms)", "api_median_ms", "{:.1f}"),
                            ("GET /status worst of 20 (ms)", "api_max_ms", "{:.1f}"),
                            (f"policy change -> kernel, median of {POLICY_PROBES} (ms)" if "policy_max_ms" in s["quiet"]
                             else "policy change -> kernel (ms)", "policy_ms", "{:.0f}"),
                            (f"policy change -> kernel, worst of {POLICY_PROBES} (ms)", "policy_max_ms", "{:.0f}")):
        if key not in s["quiet"]:
            continue
        q, d = s["quiet"][key], s["during"][key]
        row = [label, fmt.format(q), fmt.format(d), f"{d / q:.2f}x"]
        if off and key in off["quiet"]:
            oq, od = off["quiet"][key], off["during"][key]
            row += [fmt.format(oq), fmt.format(od), f"{od / oq:.2f}x", f"{d / od:.2f}x"]
        rows.append(row)
    q, after = s["quiet"]["rss_mb"], s["rss_after_mb"]
    row = ["RSS (MB)", f"{q:.1f}", f"{after:.1f} (after)", f"{after / q:.2f}x"]
    if off:
        row += [f"{off['quiet']['rss_mb']:.1f}", f"{off['rss_after_mb']:.1f} (after)",
                f"{off['rss_after_mb'] / off['quiet']['rss_mb']:.2f}x", ""]
    rows.append(row)
    return rows


def report(args: argparse.Namespace, r: dict[str, Any]) -> None:
    runs = r["runs"]
    med = {mode: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for mode, rs in runs.items()}
    off, on = med["off"], med["on"]
    drops = med.get("drops")

    # The placements measured: those whose keys the runs hold (older results: split only).
    placements = [p for p, w in PLACEMENTS.items() if f"crr_across{w['suffix']}" in runs["off"][0]]
    for mode, rs in runs.items():  # what measure() checked, again for results read back from --json
        for k, x in enumerate(rs):
            for placement in placements:
                sfx, label = PLACEMENTS[placement]["suffix"], PLACEMENTS[placement]["label"]
                for where in ("across", "same"):
                    done = x.get(f"crr_connections_{where}{sfx}", x[f"crr_{where}{sfx}"] * args.seconds)  # older: the rate's
                    crr_checked({"connections": done, "failed": x.get(f"crr_failed_{where}{sfx}", 0)},
                                f"{mode}, round {k + 1}, connections {where}{label}")

    def ratios_of(mode: str, key: str) -> list[float]:
        pairs = list(zip(runs["off"], runs.get(mode) or []))
        if any(not a[key] for a, _ in pairs):  # measure() lets no such run through: never a round left out
            raise BenchError(f"a run with flows off measured no {key}: no ratio to it")
        return sorted(b[key] / a[key] for a, b in pairs)

    rows = []
    measured = [(label + PLACEMENTS[p]["label"], key + PLACEMENTS[p]["suffix"], fmt) for p in placements
                for label, key, fmt in (("conn/s across nodes", "crr_across", "{:,.0f}"),
                                        ("conn/s same node", "crr_same", "{:,.0f}"),
                                        ("Gbit/s across nodes", "gbps_across", "{:.2f}"),
                                        ("Gbit/s same node", "gbps_same", "{:.2f}"))]
    for label, key, fmt in measured:
        goal = 0.95 if key.startswith("crr") else 0.98
        ratios = ratios_of("on", key)
        ratio = statistics.median(ratios) if ratios else float("nan")
        d = ratios_of("drops", key)
        shown, verdict = judged(ratio, goal)  # never 0.950x beside NOT met: 0.9496x
        rows.append([label, fmt.format(off[key]), fmt.format(on[key]), shown,
                     f"{ratios[0]:.3f}-{ratios[-1]:.3f}" if ratios else "", f">= {goal}x", verdict,
                     fmt.format(drops[key]) if drops else "", f"{statistics.median(d):.3f}x" if d else ""])
    for label, key in [(f"agents' CPU ms / 1000 conn, {where}{PLACEMENTS[p]['label']}", f"agent_ms_{k}{PLACEMENTS[p]['suffix']}")
                       for p in placements for where, k in (("across", "across"), ("same node", "same"))]:
        if key in off:
            rows.append([label, f"{off[key]:.1f}", f"{on[key]:.1f}", "", "", "", "",
                         f"{drops[key]:.1f}" if drops else "", ""])
    loads = r.get("loads") or []
    load_note = f"load average {min(loads):.2f}-{max(loads):.2f} over the rounds" if loads else load()
    where = {"split": "clients on CPU 0, servers on CPU 1, agents anywhere",
             "one": "'all on CPU 0': clients, servers and both agents on CPU 0"}
    print_table(f"Flow recording off vs on: 2-node lab, host-gw, {args.rounds} round(s) of {max(1, int(args.seconds))} s per mode, "
                f"order off,drops,on / on,drops,off by turns; " + "; then ".join(where[p] for p in placements)
                + "; medians, on/off the median of the rounds' own ratios; 'drops only': [flows] connections = false"
                + ("; each node's received packets on its own CPU (--node-cpus: node 1 CPU 0, node 2 CPU 1)"
                   if args.node_cpus else "")
                + ("; br_netfilter hands bridged frames to conntrack (bridge-nf-call-iptables = 1): pods of one node are "
                   "not routed up for flow records" if r.get("bridge_nf") else
                   "; no br_netfilter for bridged frames (bridge-nf-call-iptables = 0 or no module): flow records route "
                   "the pods of a node up" if "bridge_nf" in r else "") + f" ({load_note})",
                ["what", "off", "on", "on/off", "rounds' range", "goal", "", "drops only", "drops/off"], rows)
    lat = r["drop_latency"]
    lat_rows = []
    for label, key in (("node2's own", "node"), ("node1's, gathering every node", "cluster")):
        worst, verdict = judged(max(lat[key]) * 1000, 1000, at_least=False, decimals=0, unit="")  # never 1000 beside NOT met
        lat_rows.append([label, f"{statistics.median(lat[key]) * 1000:.0f}", worst, "<= 1000", verdict])
    print_table(f"Drop -> followed GET /flows: {len(lat['node'])} denied connections from node2's client pod "
                "(ms from the attempt to the record)", ["stream", "median", "worst", "goal", ""], lat_rows)
    s = r["storm"]
    reps = s.get("repeats") or {"on": [s], "off": [s["off"]] if "off" in s else []}
    sent, pps = sum(x["sent"] for x in reps["on"]), statistics.median(x["pps"] for x in reps["on"])
    title = (f"Drop storm: {len(reps['on'])} storm(s) of {sent // len(reps['on']):,} denied UDP packets at {pps:,.0f}/s into "
             "node2's isolated server pod" if len(reps["on"]) > 1 else
             f"Drop storm: {s['sent']:,} denied UDP packets at {s['pps']:,.0f}/s into node2's isolated server pod")
    if reps["off"]:
        title += (f"; the same storm with flows off ({len(reps['off'])} time(s), "
                  f"{statistics.median(x['pps'] for x in reps['off']):,.0f}/s): the storm's own load on the 2 cores, "
                  "nothing recorded" + ("; in the order on,off / off,on by turns, every sample pooled"
                                        if len(reps["on"]) > 1 else ""))
    print_table(title,
                ["node2's agent", "quiet", "during the storm", "ratio",
                 *(["flows off: quiet", "during", "ratio", "storm: on/off"] if "off" in s else [])], storm_rows(s))
    failed = {mode: sum(x.get(f"crr_failed_{where}{PLACEMENTS[p]['suffix']}", 0)
                        for x in rs for where in ("across", "same") for p in placements)
              for mode, rs in runs.items()}
    print_notes("Notes", [
        f"failed connections (wrk's socket errors and error answers; all rounds, across and same node, every placement; a run with more than "
        f"{CRR_FAILED_SHARE:.0%} failed stops the bench): " + ", ".join(f"{mode} {n:,}" for mode, n in failed.items()),
        (f"storms recorded, together: drop records kept {sum(x['records'] for x in reps['on']):,}; suppressed in the "
         f"kernel (nft limit) {sum(x['suppressed_kernel'] for x in reps['on']):,}, by the agent "
         f"{sum(x['suppressed_agent'] for x in reps['on']):,}; lost {lost_text(lost_total(x['lost'] for x in reps['on']))}; "
         "ring after the last "
         f"{reps['on'][-1]['ring']:,} records"),
        *([storm_pairs_note(reps)] if len(reps["on"]) > 1 and reps["off"] else []),
        f"ring memory per node: {r['ring_bytes'] / 1e6:.1f} MB for {r['ring_size']:,} records read "
        f"({r['ring_bytes'] / r['ring_size']:.0f} bytes each, tracemalloc, 50 pods); "
        f"{r['ring_bytes_deferred'] / 1e6:.1f} MB unread ({r['ring_bytes_deferred'] / r['ring_size']:.0f} bytes each: "
        "conntrack events kept as the kernel sent them)"
        + (f"; {r['ring_bytes_recorded'] / 1e6:.1f} MB unread from the pod programs "
           f"({r['ring_bytes_recorded'] / r['ring_size']:.0f} bytes each: their records side by side, one object a read)"
           if "ring_bytes_recorded" in r else ""),
        "the machine is shared (2 cores): other helpers' work runs beside this bench",
    ])


if __name__ == "__main__":
    run_main(main, "bench/flows.py", errors=(LabError, NetnsError))
