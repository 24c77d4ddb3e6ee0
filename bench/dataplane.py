"""Pod-to-pod TCP throughput through the agent, every data path side by side.

    python bench/dataplane.py [--seconds 6] [--rounds 5] [--only "udp bpf,ipip bpf,..."] [--routed]
                              [--no-pod-fast-path] [--flows on|off|both] [--no-pin] [--node-cpus] [--quick]
                              [--json FILE]

Defaults: 6 s per iperf3 run, 5 rounds, every row below; ``--quick``: 2 s, 1 round.

Brings up one lab per row (agentd.lab: 2 nodes, 1 pod each, real agents, etcd, BGP; all in
namespaces, removed at the end) and runs ONE iperf3 TCP stream pod -> pod across the two
nodes, plus 20 pings:

  raw veth      node to node over the lab underlay (veth, bridge, veth): the physical anchor,
                in the host-gw lab
  kernel VTEP   the kernel alone, no agentd: the same shape built by hand (an underlay bridge,
                two node namespaces with a kernel VXLAN device each (VNI 1, port 8472, no
                learning, static FDB, neighbour and onlink routes, as flannel's vxlan backend
                sets them), a cni0 bridge per node and a pod behind it, MTU 1450), no BPF
                program anywhere: the kernel anchor of the encapsulating rows
  kernel VTEP mtu N  the same with pods at MTU N (its underlay N + 50): the anchor a goal over
                the kernel VTEP judges a row with pods at MTU N against (udp bpf: 1472, ipip
                bpf: 1480, the lab's 1500 less their 28 and 20 bytes of outer headers), so both
                carry the same payload per packet and the goal measures the data path, not the
                size of its headers (1.6-2.1 % more payload a packet than VXLAN's pods)
  agentd vxlan  the lab's vxlan backend: the same kernel VTEP, programmed by agentd, with
                agentd's programs attached (its BPF member filter on the underlay, the pod
                fast path)
  host-gw       plain routes
  udp bpf       the udp backend in the in-kernel (tc-BPF) data path
  ipip bpf      the ipip backend in the in-kernel data path
  udp user      the udp backend in the user-space worker ([network] datapath = "userspace")
  ipip user     the ipip backend in the user-space worker
  ... v6        the same lab, the same two pods (or nodes), over their IPv6 addresses: the labs
                of raw veth, host-gw and agentd vxlan are dual-stack (agentd lab --ip-family dual:
                IPv4 and IPv6 on the underlay, both in the pods), so each IPv6 row runs beside its
                IPv4 row, interleaved; the goal is IPv6 >= 0.95x IPv4 on the same backend. vxlan
                carries IPv6 pods through its one VTEP over the IPv4 underlay, udp in outer IPv4
                + UDP (bpf: the BPF programs; user: the worker's C loops, TCPv6 segmented and
                merged in user space); ipip carries IPv4 pods only: it has no IPv6 row
  ... routed    with --routed: agentd vxlan and udp bpf (both also over IPv6) and ipip bpf between
                nodes on two L2 segments joined by the lab's router (agentd lab --subnets 2): the
                outer packet routed

The pod fast path (tc-BPF: accepted TCP from a pod's veth straight to the underlay device and
into the other pod) carries both families (it needs conntrack, which runs where a policy or
flow records need it); ``--no-pod-fast-path`` switches it off in every lab ([network]
bpf_pod_fast_path = false), so both families take the stack's path.

The agents keep flow records ([flows] enabled, the default) unless ``--flows off``; ``--flows
both`` runs every agentd row twice, "(flows on)" and "(flows off)", in labs of their own,
interleaved like the rest, and adds the ratio of each pair: what recording costs the data path.

Every row runs --rounds times, the rows interleaved (round 1 of every row, then round 2...,
every other round in the reverse order), so a slow spell of the machine hits all of them
alike; the table shows each row's median round, its range, its client's MTU and TCP MSS
(checked against the lab before the rounds), and ratios of medians -- but "x
IPv4", which is the median of the per-round ratios: an IPv6 row runs right beside its IPv4 row
in every round (before it in one round, after it in the next), so each round's ratio compares
two runs a few seconds apart, and the spread of the ratios is printed under the table.  The
iperf3 client runs on CPU 0 and its server on CPU 1 (taskset; ``--no-pin``: where the
scheduler puts them): on a 2-core machine the scheduler otherwise moves them, and the
softirq work that follows the sender, between the cores, which moves a single stream's
throughput by several per cent from run to run and hides a 5 % question.  Even pinned, a
veth's receive work runs on the CPU that sent, so CPU 0 does the client's sending, both
nodes' forwarding and the server pod's receiving -- two hosts' work of the stream on one
core, which the family that costs more per packet (IPv6) feels first; ``--node-cpus`` steers
what each node receives on its underlay device to its own CPU (RPS; node 1 beside the client
on CPU 0, node 2 beside the server on CPU 1), as on two hosts: every row's rate is then
bounded by the receiving core, lower than with one core doing everything, and in-order (no
retransmissions).  "CPU/Gbit" is the machine's busy CPU time during
the transfer (all cores, /proc/stat: iperf3 x2, softirq, workers, everything else running)
per second and per Gbit/s moved: cores per Gbit/s, lower is cheaper. On a shared machine
other jobs inflate it; the load line says how busy the machine was. A failed iperf3 run is
an error that stops the bench (exit 1), never a 0 Gbit/s row; the client starts once the
server's socket listens.  ``--json FILE`` also writes every round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import _iperf  # noqa: E402
from bench._common import BenchError, judged, parse_bench_args, run_main, write_json  # noqa: E402

from agentd.backend_table import mtu_overhead
from agentd.lab.lab import Lab, LabError, LabSpec  # noqa: E402
from agentd.lab.netns import Netns, unique_tag, veth  # noqa: E402

ANCHORS = [
    "flannel's UDP backend ~ 0.6x kernel VXLAN in published tests (\"for debugging only\")",
    "Calico IPIP (kernel ipip device) and the Cilium / Calico eBPF data planes: at or above kernel VXLAN",
    ("the BPF data path's design probe on this machine: BPF udp 1.09x, BPF ipip 1.02x the lab's vxlan (medians of 6; "
     "each at its own pod MTU, 1472 and 1480 against 1450)"),
]
GOALS = [("udp bpf", "kernel VTEP", 1.0), ("ipip bpf", "kernel VTEP", 1.0), ("host-gw", "raw veth", 0.95), ("udp bpf routed", "vxlan routed", 1.0), ("ipip bpf routed", "vxlan routed", 1.0),
         ("raw veth v6", "raw veth", 0.95), ("host-gw v6", "host-gw", 0.95), ("agentd vxlan v6", "agentd vxlan", 0.95),
         ("vxlan routed v6", "vxlan routed", 0.95), ("udp bpf v6", "udp bpf", 0.95),
         ("udp bpf routed v6", "udp bpf routed", 0.95), ("udp user v6", "udp user", 0.95)]
KERNEL_VTEP = "kernel VTEP"
FLOWS = {"on": (True,), "off": (False,), "both": (True, False)}  # --flows: [flows] enabled of the agents
FLOW_SUFFIX = {True: " (flows on)", False: " (flows off)"}
# A row's name -> (its ROWS entry, [flows] enabled: None for the kernel VTEP, which runs no agentd)
SPECS: dict[str, tuple[str, bool | None]] = {}


def expand(names: list[str], flows: str) -> list[str]:
    """The rows to run: with ``--flows both`` each agentd row twice, flows on then off (the
    raw veth anchors once, in the flows-on lab); after the kernel VTEP, a kernel VTEP at the
    pod MTU of each row judged against it whose pods have another (:func:`goal_base`)."""
    out = []
    for name in names:
        if name == KERNEL_VTEP:
            SPECS[name] = (name, None)
            out.append(name)
            continue
        for on in FLOWS[flows]:
            row = name + (FLOW_SUFFIX[on] if flows == "both" and not name.startswith("raw veth") else "")
            if row not in out:  # raw veth: once, in the flows-on lab
                SPECS[row] = (name, on)
                out.append(row)
    if KERNEL_VTEP in out:
        anchors = [goal_base(row, base) for row in out for name, base, _ in GOALS
                   if base == KERNEL_VTEP and SPECS[row][0] == name]
        at = out.index(KERNEL_VTEP) + 1
        for anchor in dict.fromkeys(a for a in anchors if a not in out):
            out.insert(at, anchor)
            at += 1
    return out


# The lab's underlay: veths at the kernel's default MTU; each agentd row's pods have it less
# their backend's outer headers (agentd.backend_table: vxlan 50, udp 28, ipip 20; the lab's
# encapsulation runs over its IPv4 underlay, also in a dual-stack lab).
LAB_UNDERLAY_MTU = 1500


def vtep_row(pod_mtu: int) -> str:
    """The kernel VTEP row whose pods have ``pod_mtu`` (its underlay that plus VXLAN's 50):
    "kernel VTEP" at the lab's vxlan pods' 1450, "kernel VTEP mtu 1472" beside udp's pods."""
    name = KERNEL_VTEP if pod_mtu == KernelVtep.MTU else f"{KERNEL_VTEP} mtu {pod_mtu}"
    SPECS.setdefault(name, (KERNEL_VTEP, None))
    VTEP_MTU[name] = pod_mtu
    return name


VTEP_MTU: dict[str, int] = {}  # a kernel VTEP row -> its pods' MTU


def pod_mtu(name: str) -> int:
    """The MTU of the interface a row's traffic leaves from: the pods' (the nodes' underlay
    device for raw veth)."""
    base, _ = SPECS.get(name, (name, None))
    if base == KERNEL_VTEP:
        return VTEP_MTU.get(name, KernelVtep.MTU)
    backend, _, what, _, _ = ROWS.get(base) or ROUTED[base]
    return LAB_UNDERLAY_MTU if what == "nodes" else LAB_UNDERLAY_MTU - mtu_overhead(backend, 4)


def mss(name: str) -> int:
    """The TCP MSS a row's connection announces: its MTU less the IP (20 or 40) and TCP (20)
    headers of its family."""
    base, _ = SPECS.get(name, (name, None))
    version = (ROWS.get(base) or ROUTED.get(base) or ("", "", "", 1, 4))[4]
    return pod_mtu(name) - (40 if version == 4 else 60)


def goal_base(name: str, base: str) -> str:
    """The row ``name`` is judged against for a goal over ``base``: for the kernel VTEP, the
    kernel VTEP whose pods have ``name``'s MTU, so that both carry the same payload per packet
    and the goal measures the data path, not the size of its headers (udp's 28 bytes and
    ipip's 20 leave their pods 1472 and 1480 where VXLAN's 50 leaves 1450: 1.6-2.1 % more
    payload a packet); any other base as it is."""
    return vtep_row(pod_mtu(name)) if base == KERNEL_VTEP else base

# name -> (lab backend, [network] datapath, what to measure, L2 segments, IP version); the
# kernel VTEP row is no agentd lab (KernelVtep below).  A lab with a version 6 row is dual-stack.
ROWS = {
    "raw veth": ("host-gw", "auto", "nodes", 1, 4),
    "raw veth v6": ("host-gw", "auto", "nodes", 1, 6),
    KERNEL_VTEP: ("", "", "pods", 1, 4),
    "agentd vxlan": ("vxlan", "auto", "pods", 1, 4),
    "agentd vxlan v6": ("vxlan", "auto", "pods", 1, 6),
    "host-gw": ("host-gw", "auto", "pods", 1, 4),
    "host-gw v6": ("host-gw", "auto", "pods", 1, 6),
    "udp bpf": ("udp", "bpf", "pods", 1, 4),
    "udp bpf v6": ("udp", "bpf", "pods", 1, 6),
    "ipip bpf": ("ipip", "bpf", "pods", 1, 4),
    "udp user": ("udp", "userspace", "pods", 1, 4),
    "udp user v6": ("udp", "userspace", "pods", 1, 6),
    "ipip user": ("ipip", "userspace", "pods", 1, 4),
}
ROUTED = {
    "vxlan routed": ("vxlan", "auto", "pods", 2, 4),
    "vxlan routed v6": ("vxlan", "auto", "pods", 2, 6),
    "udp bpf routed": ("udp", "bpf", "pods", 2, 4),
    "udp bpf routed v6": ("udp", "bpf", "pods", 2, 6),
    "ipip bpf routed": ("ipip", "bpf", "pods", 2, 4),
}
ANCHOR_ROWS = ("raw veth", KERNEL_VTEP)  # always run


PIN = (("taskset", "-c", "0"), ("taskset", "-c", "1"))  # iperf3 (client, server): their own CPUs


class Round(NamedTuple):
    gbps: float
    retr: int
    ping: float
    cpu_per_gbit: float  # busy cores per Gbit/s


def busy_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v), sum(v) - v[3] - v[4]


async def iperf(client: Netns, server: Netns, dst: str, seconds: int, what: str,
                pin: bool) -> tuple[float, int, float]:
    """(Gbit/s, retransmits, busy cores) of one iperf3 TCP stream; a failure raises."""
    cpus = PIN if pin else ((), ())
    async with _iperf.server(server, bind=dst, once=True, prefix=cpus[1], what=f"{what}: the iperf3 server"):
        total0, busy0 = busy_jiffies()
        run = await _iperf.client(client, dst, seconds, prefix=cpus[0], what=what)
        total1, busy1 = busy_jiffies()
    cores = (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)
    return run.gbps, run.retransmits, cores


class KernelVtep:
    """The kernel VXLAN anchor without agentd: an underlay bridge, two nodes with a kernel
    VTEP each, a cni0 bridge per node and one pod behind it, all programmed by hand the way
    flannel's vxlan backend programs a node (static FDB and neighbour entries, onlink routes,
    no learning); every namespace is removed by :meth:`down`."""

    UNDERLAY = ("192.168.250.1", "192.168.250.2")
    SUBNETS = ("10.99.1", "10.99.2")
    MACS = ("02:ad:00:00:00:01", "02:ad:00:00:00:02")
    MTU = 1450  # 1500 underlay - 50 of VXLAN, as the lab's vxlan pods have (the default)

    def __init__(self, tag: str, pod_mtu: int = MTU) -> None:
        self.tag = tag
        self.pod_mtu = pod_mtu  # the pods', the cni0 bridge's and the VTEP's
        self.underlay_mtu = pod_mtu + mtu_overhead("vxlan", 4)  # the nodes' eth0, the bridge's ports
        self.namespaces: list[Netns] = []
        self.pods: list[Netns] = []
        self.nodes: list[Netns] = []

    def _ns(self, suffix: str) -> Netns:
        ns = Netns.create(f"ad-{self.tag}-{suffix}")
        self.namespaces.append(ns)
        return ns

    def up(self) -> None:
        ul = self._ns("ul")
        ul.ip("link", "add", "br0", "type", "bridge")
        ul.ip("link", "set", "br0", "up")
        nodes = self.nodes = [self._ns(f"n{i + 1}") for i in range(2)]
        for i, node in enumerate(nodes):
            veth(node, "eth0", ul, f"n{i + 1}", mtu=self.underlay_mtu)
            ul.ip("link", "set", f"n{i + 1}", "master", "br0")
            node.ip("addr", "add", f"{self.UNDERLAY[i]}/24", "dev", "eth0")
            node.sysctl("net.ipv4.ip_forward", 1)
            node.ip("link", "add", "vxlan0", "address", self.MACS[i], "mtu", str(self.pod_mtu), "type", "vxlan", "id", "1",
                    "local", self.UNDERLAY[i], "dev", "eth0", "dstport", "8472", "nolearning")
            node.ip("addr", "add", f"{self.SUBNETS[i]}.0/32", "dev", "vxlan0")
            node.ip("link", "set", "vxlan0", "up")
            node.ip("link", "add", "cni0", "mtu", str(self.pod_mtu), "type", "bridge")
            node.ip("addr", "add", f"{self.SUBNETS[i]}.1/24", "dev", "cni0")
            node.ip("link", "set", "cni0", "up")
            pod = self._ns(f"p{i + 1}")
            veth(pod, "eth0", node, "veth0", mtu=self.pod_mtu)
            node.ip("link", "set", "veth0", "master", "cni0")
            pod.ip("addr", "add", f"{self.SUBNETS[i]}.2/24", "dev", "eth0")
            pod.ip("link", "set", "lo", "up")
            pod.ip("route", "add", "default", "via", f"{self.SUBNETS[i]}.1")
            self.pods.append(pod)
        for i, node in enumerate(nodes):
            j = 1 - i
            node.ip("neigh", "add", f"{self.SUBNETS[j]}.0", "lladdr", self.MACS[j], "dev", "vxlan0", "nud", "permanent")
            node.exec("bridge", "fdb", "append", self.MACS[j], "dev", "vxlan0", "dst", self.UNDERLAY[j], "self", "permanent")
            node.ip("route", "add", f"{self.SUBNETS[j]}.0/24", "via", f"{self.SUBNETS[j]}.0", "dev", "vxlan0", "onlink")

    @property
    def dst(self) -> str:
        return f"{self.SUBNETS[1]}.2"

    def down(self) -> None:
        for ns in reversed(self.namespaces):
            with contextlib.suppress(Exception):
                ns.delete()


def steer(ns: Netns, cpu: int) -> None:
    """--node-cpus: what ``ns`` (a node) receives on its underlay device is processed on ``cpu``
    (RPS on every receive queue of its eth0).  A veth's receive work otherwise runs on the CPU
    that sent, so the client's CPU did both nodes' forwarding and the server pod's receiving
    too: two hosts' work of the stream on one core, which no two real hosts share."""
    ns.exec("sh", "-c", f"for q in /sys/class/net/eth0/queues/rx-*; do echo {1 << cpu:x} > $q/rps_cpus; done")
    got = ns.exec("sh", "-c", "cat /sys/class/net/eth0/queues/rx-*/rps_cpus").split()
    if not got or any(int(x, 16) != 1 << cpu for x in got):
        raise BenchError(f"{ns.name}: RPS of eth0 reads {got}, not CPU {cpu}")


async def ping_avg(ns: Netns, dst: str, count: int = 20) -> float:
    _, out, _ = await ns.aexec("ping", "-c", str(count), "-i", "0.05", "-W", "2", dst, check=False)
    m = re.search(r"= [\d.]+/([\d.]+)/", out.decode())
    return float(m.group(1)) if m else float("nan")


def endpoints(name: str, lab: Lab | KernelVtep) -> tuple[Netns, Netns, str]:
    """(client, server, the server's address) of row ``name``."""
    what, version = ROWS[SPECS[name][0]][2], ROWS[SPECS[name][0]][4]
    if isinstance(lab, KernelVtep):
        client, server, dst = lab.pods[0], lab.pods[1], lab.dst
    elif what == "nodes":
        node = lab.nodes[1]
        client, server, dst = lab.nodes[0].ns, node.ns, node.address if version == 4 else node.address_v6
    else:
        client, server, dst = lab.pods[0].ns, lab.pods[1].ns, lab.pods[1].address(version)
    if dst is None:
        raise BenchError(f"{name}: the lab has no IPv{version} address to measure")
    return client, server, dst


async def run_row(name: str, lab: Lab | KernelVtep, seconds: int, pin: bool) -> Round:
    client, server, dst = endpoints(name, lab)
    lat = await ping_avg(client, dst)
    gbps, retr, cores = await iperf(client, server, dst, seconds, name, pin)
    return Round(gbps, retr, lat, cores / gbps)


def check_datapath(name: str, lab: Lab) -> None:
    """The row measures what it says: every peer carried by the data path named (and, for an
    IPv6 row, its IPv6 pods by the same backend as its IPv4 ones)."""
    base, flows = SPECS[name]
    backend, datapath, _, _, version = ROWS[base]
    want = {"host-gw": "kernel route", "vxlan": "vxlan device"}.get(backend) or \
        {"bpf": "bpf", "userspace": "user space"}[datapath]
    for node in lab.nodes:
        recording = bool((node.api("/status").get("flows") or {}).get("on"))
        if recording != flows:
            raise BenchError(f"{name}: {node.name} has flow records {'on' if recording else 'off'}")
        peers = node.api("/peers")
        got = {p.get("datapath") for p in peers}
        if got != {want}:
            raise BenchError(f"{name}: {node.name} carries its peer as {got}, not {want}")
        if version == 6 and {p.get("backend_v6") for p in peers} != {backend}:
            raise BenchError(f"{name}: {node.name} carries its peer's IPv6 pods as "
                             f"{ {p.get('backend_v6') for p in peers} }, not {backend}")


def route_mtu(ns: Netns, dst: str) -> int:
    """The MTU of the device ``ns`` sends to ``dst`` from (a route's own mtu, where it has one)."""
    route = json.loads(ns.ip("-j", "route", "get", dst).stdout)[0]
    link = json.loads(ns.ip("-j", "link", "show", "dev", route["dev"]).stdout)[0]
    given = route.get("metrics") or []
    metrics = given if isinstance(given, dict) else {k: v for m in given if isinstance(m, dict) for k, v in m.items()}
    return int(metrics.get("mtu") or link["mtu"])


def check_mtu(name: str, lab: Lab | KernelVtep) -> None:
    """The row's traffic leaves with the MTU its goals are judged with (:func:`pod_mtu`)."""
    client, _, dst = endpoints(name, lab)
    got = route_mtu(client, dst)
    if got != pod_mtu(name):
        raise BenchError(f"{name}: {client.name} sends to {dst} with MTU {got}, not {pod_mtu(name)}: the goals "
                         "would compare packets of other sizes")


async def bench(args, names: list[str]) -> dict[str, list[Round]]:
    tag = unique_tag("b")
    labs: dict[str, Lab | KernelVtep] = {}
    specs: dict[tuple[str, str, int, bool | None], Lab] = {}
    vteps: list[KernelVtep] = []
    runs: dict[str, list[Round]] = {}
    # A lab with an IPv6 row is dual-stack, and its IPv4 rows run in it too: the two families
    # side by side on one data path.
    dual = {ROWS[SPECS[n][0]][:2] + ROWS[SPECS[n][0]][3:4] for n in names if ROWS[SPECS[n][0]][4] == 6}
    try:
        for name in names:
            base, flows = SPECS[name]
            backend, datapath, _, segments, _version = ROWS[base]
            if base == KERNEL_VTEP:
                mtu = pod_mtu(name)
                print(f"  the kernel VTEP pair (no agentd), pod MTU {mtu} ...", file=sys.stderr, flush=True)
                vtep = KernelVtep(f"{tag}k{len(vteps)}", pod_mtu=mtu)
                vteps.append(vtep)
                labs[name] = vtep
                vtep.up()
                if args.node_cpus:
                    for cpu, node in enumerate(vtep.nodes):
                        steer(node, cpu)
                check_mtu(name, vtep)
                continue
            key = (backend, datapath, segments, flows)
            if key not in specs:  # raw veth and host-gw share a lab
                family = "dual" if key[:3] in dual else "ipv4"
                extra = {f"node{i}": {"flows": {"enabled": bool(flows)},
                                      **({"network": {"bpf_pod_fast_path": False}} if args.no_pod_fast_path else {})}
                         for i in (1, 2)}
                lab = Lab(LabSpec(name=f"{tag}{len(specs)}", nodes=2, pods=1, backend=backend, datapath=datapath,
                                  subnets=segments, log_level="warning", ip_family=family, extra=extra),
                          root=args.root)
                specs[key] = lab
                print(f"  lab for {backend} ({datapath}, {family}, flows {'on' if flows else 'off'}) ...",
                      file=sys.stderr, flush=True)
                await lab.up(timeout=120)
                if args.node_cpus:
                    for cpu, node in enumerate(lab.nodes[:2]):
                        steer(node.ns, cpu)
            labs[name] = specs[key]
            check_datapath(name, specs[key])
            check_mtu(name, specs[key])
        for r in range(args.rounds):
            for name in round_order(names, r):
                got = await run_row(name, labs[name], args.seconds, args.pin)
                runs.setdefault(name, []).append(got)
                print(f"  round {r + 1}/{args.rounds} {name:<28} {got.gbps:6.2f} Gbit/s, {got.retr} retr, "
                      f"{got.cpu_per_gbit:.3f} cores/Gbit", file=sys.stderr, flush=True)
    finally:
        for vtep in vteps:
            vtep.down()
        for lab in specs.values():
            await lab.down()
    return runs


def round_order(names: list[str], r: int) -> list[str]:
    """The rows in round ``r`` (from 0): as listed in even rounds, reversed in odd ones, so
    that neither row of an IPv4/IPv6 pair always runs first (a machine warming up or
    slowing down through a round favours neither family), while each stays beside the other."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def ipv4_row(name: str) -> str | None:
    """The IPv4 row an IPv6 row is compared with ("udp bpf v6 (flows off)" -> "udp bpf (flows
    off)"), or None for a row that is not an IPv6 one."""
    base, flows = SPECS.get(name, (name, None))
    if not base.endswith(" v6"):
        return None
    return base.removesuffix(" v6") + (FLOW_SUFFIX[flows] if name != base and flows is not None else "")


def round_ratios(v6: list[Round], v4: list[Round]) -> list[float]:
    """Each round's IPv6 Gbit/s over the same round's IPv4 Gbit/s (the two ran side by side)."""
    return [a.gbps / b.gbps for a, b in zip(v6, v4, strict=True) if b.gbps > 0]


def ipv4_ratios(runs: dict[str, list[Round]]) -> dict[str, list[float]]:
    """Per IPv6 row whose IPv4 row ran too: its per-round ratios."""
    out = {}
    for name, got in runs.items():
        v4 = ipv4_row(name)
        if v4 in runs:
            out[name] = round_ratios(got, runs[v4])
    return out


def report(args, runs: dict[str, list[Round]], load: tuple, background: float) -> None:
    results = []
    for name, got in runs.items():
        ordered = sorted(got, key=lambda g: g.gbps)
        mid = ordered[len(ordered) // 2]  # the median round (the upper one of an even count)
        spread = f"{ordered[0].gbps:.2f}-{ordered[-1].gbps:.2f}" if len(got) > 1 else ""
        results.append((name, mid, spread))
    by = {name: mid.gbps for name, mid, _ in results}
    ratios = ipv4_ratios(runs)
    x_ipv4 = {name: statistics.median(got) for name, got in ratios.items() if got}
    raw, vx = by.get("raw veth") or float("nan"), by.get(KERNEL_VTEP) or float("nan")
    # Ratios and goals name rows as recorded by default (flows on): with --flows both, a goal's
    # "host-gw v6" is the "host-gw v6 (flows on)" row, its Gbit/s and its "x IPv4" alike.
    for table in (by, x_ipv4):
        for name, value in list(table.items()):
            if name.endswith(FLOW_SUFFIX[True]):
                table.setdefault(name.removesuffix(FLOW_SUFFIX[True]), value)
    print(f"\nagentd data plane: iperf3 TCP, 1 stream, {args.seconds} s; median of {args.rounds} interleaved rounds "
          "(pod to pod, but raw veth: node to node); pod fast path "
          + ("off" if args.no_pod_fast_path else "on") + "; iperf3 "
          + ("client on CPU 0, server on CPU 1 (taskset)" if args.pin else "not pinned (--no-pin)")
          + ("; each node's received packets on its own CPU (--node-cpus: node 1 CPU 0, node 2 CPU 1)"
             if args.node_cpus else ""))
    after = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, busy {background * 100:.0f}% before the run (other jobs); load average "
          f"{load[0]:.2f} before, {after[0]:.2f} after" + ("  <- rows are skewed by other load" if background > 0.1 else "")
          + "\n")
    width = max(17, *(len(name) for name, _mid, _spread in results))
    print(f"{'path':<{width}} {'Gbit/s':>7} {'range':>11} {'x raw veth':>10} {'x VTEP':>7} {'x IPv4':>7} {'retr':>6} "
          f"{'ping ms':>8} {'CPU/Gbit':>9} {'MTU':>5} {'MSS':>5}")
    print("-" * (width + 85))
    for name, mid, spread in results:
        ratio = f"{x_ipv4[name]:7.2f}" if name in x_ipv4 else f"{'':>7}"
        print(f"{name:<{width}} {mid.gbps:7.2f} {spread:>11} {mid.gbps / raw:10.2f} {mid.gbps / vx:7.2f} {ratio} "
              f"{mid.retr:6d} {mid.ping:8.3f} {mid.cpu_per_gbit:9.3f} {pod_mtu(name):5d} {mss(name):5d}")
    pairs = [(base, by[base + FLOW_SUFFIX[True]], by[base + FLOW_SUFFIX[False]]) for base in ROWS
             if base + FLOW_SUFFIX[True] in by and base + FLOW_SUFFIX[False] in by]
    if pairs:
        print("\nflow records on / off (the same row with [flows] enabled = true and false):")
        for base, on, off in pairs:
            print(f"  {base:<17} {on:6.2f} / {off:6.2f} Gbit/s = {on / off:.2f}x")
    print("\nx VTEP: over the kernel VTEP row (the kernel's VXLAN, no agentd program anywhere, pods at MTU "
          f"{KernelVtep.MTU} as the lab's vxlan pods); MTU, MSS: the client's, pod (raw veth: node); a goal over the "
          "kernel VTEP judges a row against a kernel VTEP whose pods have the row's MTU (\"kernel VTEP mtu N\", its "
          "underlay N + 50); x IPv4: an IPv6 row over the IPv4 row of the same lab, the median of the per-round "
          "ratios (the two run side by side):")
    for name, got in ratios.items():
        print(f"  {name:<{width}} " + " ".join(f"{x:.3f}" for x in got)
              + (f"   range {min(got):.3f}-{max(got):.3f}" if got else ""))
    print("\nanchors (context, not measured here):")
    for a in ANCHORS:
        print(f"  - {a}")
    print("\ngoals:")
    for name, base, want in GOALS:
        row = name if name in runs else name + FLOW_SUFFIX[True]  # as judged: the flows-on row
        if row not in runs:
            continue
        against = goal_base(row, base)
        if against in by:
            got = x_ipv4[name] if ipv4_row(name) == base and name in x_ipv4 else by[name] / by[against]
            twin = against if against in runs else against + FLOW_SUFFIX[True]
            print(f"  {name:<17} >= {want:.2f}x {base:<12}: {'  '.join(judged(got, want))}   "
                  f"(pod MTU {pod_mtu(row)} / {pod_mtu(twin)}, MSS {mss(row)} / {mss(twin)})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=6, help="iperf3 duration per row (default 6)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="run every row this many times, interleaved; the table shows medians (default 5)")
    ap.add_argument("--only", help=f"comma-separated rows to run, of: {', '.join(ROWS)} (anchors always run)")
    ap.add_argument("--root", default=None, help="lab directory (default: agentd lab's)")
    ap.add_argument("--no-pod-fast-path", action="store_true",
                    help="[network] bpf_pod_fast_path = false in every lab")
    ap.add_argument("--routed", action="store_true",
                    help="also the routed-underlay rows (two L2 segments joined by the lab's router)")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="leave iperf3's client and server where the scheduler puts them (default: CPU 0 and 1)")
    ap.add_argument("--flows", choices=FLOWS, default="on",
                    help="the agents' flow records: on (the default config), off, or both (each agentd row twice)")
    ap.add_argument("--node-cpus", action="store_true",
                    help="each node's received packets on its own CPU (RPS on its underlay device: node 1 and "
                         "the client CPU 0, node 2 and the server CPU 1), as on two hosts")
    args = parse_bench_args(ap, argv, name="dataplane", quick={"seconds": 2, "rounds": 1})
    if args.rounds < 1 or args.seconds < 1:
        ap.error("--rounds and --seconds must be at least 1")
    if args.pin and (os.cpu_count() or 1) < 2:
        ap.error("pinning iperf3's client and server to CPUs 0 and 1 needs 2 CPUs: add --no-pin")
    if args.node_cpus and (not args.pin or (os.cpu_count() or 1) < 2):
        ap.error("--node-cpus puts each node beside its iperf3 end: it needs the pinning (2 CPUs, no --no-pin)")
    if os.geteuid() != 0:
        print("bench/dataplane.py: needs root (network namespaces)", file=sys.stderr)
        return 1
    if args.routed:
        ROWS.update(ROUTED)
    wanted = [x.strip() for x in args.only.split(",")] if args.only else list(ROWS)
    unknown = [x for x in wanted if x not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; rows are {', '.join(ROWS)}")
    names = expand([n for n in ROWS if n in wanted or n in ANCHOR_ROWS], args.flows)
    total0, busy0 = busy_jiffies()
    time.sleep(1.0)  # a one-second sample of what else is running (the load line), not a synchronisation
    total1, busy1 = busy_jiffies()
    background = (busy1 - busy0) / max(total1 - total0, 1)
    load = os.getloadavg()
    runs = asyncio.run(bench(args, names))
    write_json(args.json, {"seconds": args.seconds, "rounds": args.rounds, "flows": args.flows, "pinned": args.pin,
                           "node_cpus": args.node_cpus,
                           "x_ipv4_per_round": ipv4_ratios(runs),
                           "pod_mtu": {name: pod_mtu(name) for name in runs},
                           "background_busy": background,
                           "load_before": load[0], "load_after": os.getloadavg()[0],
                           "rows": {name: [r._asdict() for r in got] for name, got in runs.items()}})
    report(args, runs, load, background)
    return 0


if __name__ == "__main__":
    run_main(main, "bench/dataplane.py", errors=(LabError,))
