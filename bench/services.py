"""Services at scale: N Services x 10 endpoints on a 3-node lab, and what one endpoint change
costs, next to kube-proxy-shaped rulesets measured on this machine.

    python bench/services.py [--services 1000] [--endpoints 10] [--changes 10] [--seconds 5]
                             [--selector-services 1000] [--pods 3000] [--quick] [--json FILE]

Defaults: 1,000 services x 10 endpoints, 10 endpoint changes, 5 s per data-path run, then
1,000 selector services over 3,000 pod records for the full rebuild;
``--quick``: 100 services, 3 changes, 2 s, 100 selector services over 300 pods.
``--services 1000,10000`` runs both sizes.

Real: etcd, three `agentd run` agents (host-gw) with their `ip agentd-services` tables, two
pods (a client on node1, a server on node2) with svcecho and iperf3.  The N services have no
selector; their endpoints are EndpointSlices with made-up addresses (10.250.0.0/16, not
routed: only the table's size matters for them), except one service whose endpoint is the
server pod, used for the data-path figures.

Measured, per N:

* apply all: the N Services and N EndpointSlices written to etcd (transactions of 100
  objects, cluster IPs allocated) until every node reports the last revision applied
  (GET /services?view=summary polled every 5 ms: an upper bound);
* one endpoint change, end to end: one EndpointSlice rewritten (an endpoint replaced) until
  every node reports it applied; median and max over --changes;
* one endpoint change, one node's sync: what each agent reports for the sync that applied it
  (``last_sync``: the table's delta compiled and sent to nftables in one transaction), median
  over the nodes and changes;
* a full rebuild with selector Services: --selector-services Services with a selector each
  (``app: a<i>``, 10 namespaces) and --pods pod records of a node that is not in the lab
  (``app: a<j mod S>``, addresses in 10.251.0.0/16, not routed) are written beside the N
  services; then node1's agent is restarted: the time until it reports the last revision
  applied, its first sync (a full rebuild of the table from every record: each Service's
  endpoints matched from the pod records) as it reports it (``last_sync``; "not seen" when
  later syncs came before its API first answered), and the longest answer of its API (served
  by the agent's one event loop, polled every 5 ms from the restart until the revision is
  applied: an upper bound of how long the loop was held, the agent's own start included);
* connection setup through the VIP vs. directly to the pod: TCP_CRR-style, 4 loops of
  connect + one request/response + close for --seconds, 6 rounds of a pair, the pair's
  order turned round each round, the client pinned to CPU 0 and the server to CPU 1; the
  ratio is the median of the rounds' own ratios
  (asyncio client: the client's own cost dominates, the ratio is the figure); a run in which
  no connection succeeded or more than 1% failed (a connect or an answer over 2 s) stops the
  bench, as in bench/flows.py, and the failed ones of all rounds are counted in the table;
* throughput through the VIP vs. direct (iperf3, --seconds, one stream, 2 rounds of a pair,
  the pair's order turned round each round, the client pinned to CPU 0 and the server to
  CPU 1, medians; the client starts once the server listens, and a failed run stops the bench).

There is no kube-proxy here (no API server for it to watch), so the anchors are what its
syncs send to the kernel, rebuilt and timed in a scratch namespace of the same machine; its
own Go work (walking every service to write the input) is not in them, so they are lower
bounds of a kube-proxy sync (3 changes each, median; every tool is started by a thread that
has entered the namespace, so ``ip netns exec`` is not in the figures):

* a kube-proxy-shaped iptables ruleset (its nat chains KUBE-SERVICES -> KUBE-SVC-* with
  statistic random -> KUBE-SEP-* with masquerade mark and DNAT, its filter chains), loaded
  once, then per change what kube-proxy's iptables mode restores in a partial sync
  (pkg/proxy/iptables/proxier.go, MinimizeIPTablesRestore): ``iptables-restore --noflush
  --counters`` of its top-level chains in full (KUBE-SERVICES holds a rule per service) and of
  the changed service's KUBE-SVC/KUBE-SEP chains only; with 1,000 endpoints or fewer it also
  reads the nat table (iptables-save) to delete stale chains, as kube-proxy does below its
  large-cluster threshold (Debian's iptables 1.8, nf_tables backend);
* kube-proxy's nftables layout (pkg/proxy/nftables/proxier.go: table ip kube-proxy, the
  service-ips verdict map, a chain per service choosing with numgen, a chain per endpoint),
  built once, then per change what its partial sync does: delete the chains the previous
  sync left stale (a transaction of its own), list the table's chains and sets (nft --json),
  and one nft transaction rewriting the changed service's chains and flushing its stale ones.

Like is compared with like: one node's sync against one sync of each anchor.  The end-to-end
figure (etcd write -> every node) has no anchor measured here.  Goals: one endpoint change
live everywhere < 100 ms at 10,000 services; connection rate through a VIP >= 0.9x direct.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import _iperf  # noqa: E402
from bench._scratch import timed  # noqa: E402
from bench._common import (  # noqa: E402
    CRR_FAILED_SHARE,
    BenchError,
    crr_checked,
    int_list,
    parse_bench_args,
    print_notes,
    print_table,
    require_root,
    run_main,
    write_json,
)

from agentd.lab.lab import Lab, LabError, LabSpec  # noqa: E402
from agentd.lab.netns import Netns, NetnsError, unique_tag  # noqa: E402
from agentd.lab.svcecho import Echo  # noqa: E402

NS = "bench"


def service(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS},
            "spec": {"ports": [{"name": "http", "port": 80}]}}  # fmt: skip


def endpoint_slice(name: str, addresses: list[str], port: int = 8080) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{name}-1", "namespace": NS, "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4", "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addresses],
            "ports": [{"name": "http", "port": port}]}  # fmt: skip


SELECTOR_NAMESPACES = 10


def selector_service(i: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"sel{i}", "namespace": f"sel{i % SELECTOR_NAMESPACES}"},
            "spec": {"selector": {"app": f"a{i}"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}  # fmt: skip


def ghost_pod(j: int, services: int) -> dict[str, Any]:
    """A pod record of a node that is not in the lab (as bench/policy.py's), selected by
    selector Service j mod ``services``."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": f"sel{j % services % SELECTOR_NAMESPACES}", "name": f"pod-{j}",
                         "labels": {"app": f"a{j % services}"}},
            "spec": {"nodeName": "ghost1", "containers": [{"name": "pod", "ports": [{"name": "http", "containerPort": 8080,
                                                                                      "protocol": "TCP"}]}]},
            "status": {"podIP": f"10.251.{(j >> 8) & 255}.{j & 255}"}}  # fmt: skip


async def full_rebuild(lab: Lab, res: Any, services: int, pods: int) -> dict[str, Any]:
    """The selector Services and pod records written, then node1's agent restarted: its first
    sync (a full rebuild) as it reports it, and the longest answer of its API meanwhile."""
    ghosts = [ghost_pod(j, services) for j in range(pods)]
    for k in range(0, len(ghosts), 100):  # records only agents write: put as bench/policy.py puts them
        await res.put_records(ghosts[k : k + 100])
    objs = [selector_service(i) for i in range(services)]
    revision = 0
    for k in range(0, len(objs), 100):  # after the pods: its revision covers them
        revision = await res.apply(objs[k : k + 100])
    await live_everywhere(lab, revision)
    node = lab.nodes[0]
    await node.stop_agent()
    node.start_agent()
    start = time.perf_counter()
    longest, first = 0.0, None
    while time.perf_counter() - start < 600:
        t = time.perf_counter()
        view = await asyncio.to_thread(node.api_or_none, "/services?view=summary")
        if view is not None:
            longest = max(longest, time.perf_counter() - t)
            if view.get("syncs") == 1:
                first = view.get("last_sync")
            if view.get("syncs", 0) >= 1 and view.get("revision", 0) >= revision and not view.get("error"):
                break
        await asyncio.sleep(0.005)
    else:
        raise BenchError(f"node1's agent did not apply revision {revision} within 600 s of its restart")
    applied = time.perf_counter() - start
    await live_everywhere(lab, revision)  # the others too
    full = first is not None and first.get("full")  # not seen: more syncs came before its API answered
    return {"selector_services": services, "pods": pods, "full_sync_s": first["seconds"] if full else None,
            "full_sync_services": first["services"] if full else None, "api_longest_s": longest,
            "restart_to_applied_s": applied}  # fmt: skip


def fake_addresses(i: int, count: int, salt: int = 0) -> list[str]:
    base = (i * count + salt * 7919) % (1 << 16)
    return [f"10.250.{((base + j) >> 8) & 255}.{(base + j) & 255}" for j in range(count)]


async def live_everywhere(lab: Lab, revision: int, timeout: float = 600.0) -> float:
    """Seconds until every node reports ``revision`` applied (polled)."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        views = await asyncio.gather(*(asyncio.to_thread(n.api_or_none, "/services?view=summary") for n in lab.nodes))
        if all(v and v.get("revision", 0) >= revision and not v.get("error") for v in views):
            return time.perf_counter() - start
        await asyncio.sleep(0.005)
    raise BenchError(f"revision {revision} not applied everywhere in {timeout}s")


async def node_syncs(lab: Lab) -> list[dict[str, Any]]:
    """Every node's report of its last sync (``last_sync`` of GET /services?view=summary)."""
    views = await asyncio.gather(*(asyncio.to_thread(n.api, "/services?view=summary") for n in lab.nodes))
    return [v.get("last_sync") or {} for v in views]


CRR_ROUNDS = 6  # connection-rate rounds, each a direct run and a VIP run


def pin(pid: int, cpu: int) -> None:
    """Every thread of process ``pid`` (and so what it starts later) on ``cpu``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})


BW_ROUNDS = 2  # throughput rounds, each a direct run and a VIP run
CLIENT_CPU, SERVER_CPU = ("taskset", "-c", "0"), ("taskset", "-c", "1")


async def throughput_rounds(client_ns: Netns, server_ns: Netns, direct: str, vip: str, seconds: float) -> dict[str, list[float]]:
    """Gbit/s of one iperf3 stream to the server pod ``direct`` and through the ``vip``,
    BW_ROUNDS rounds of a pair, the pair's order turned round every round (a drift of the
    machine falls on both alike), the client on CPU 0 and the server on CPU 1 as the
    connection rate runs."""
    bw: dict[str, list[float]] = {"direct": [], "vip": []}
    pair = [("direct", direct), ("vip", vip)]
    async with _iperf.server(server_ns, prefix=SERVER_CPU, what="the iperf3 server in the server pod"):
        for k in range(BW_ROUNDS):
            for what, dst in pair if k % 2 == 0 else pair[::-1]:
                run = await _iperf.client(client_ns, dst, seconds, prefix=CLIENT_CPU,
                                          what=f"iperf3 {what} ({dst}), round {k + 1}")
                bw[what].append(run.gbps)
    return bw


async def crr_rounds(echo: Echo, direct: str, vip: str, seconds: float) -> tuple[dict[str, list[float]], int]:
    """Connections per second to the server pod ``direct`` (port 8080) and through the
    ``vip`` (port 80), CRR_ROUNDS rounds of a pair, the pair's order turned round every round;
    and the connections that failed.  Each run is judged as bench/flows.py judges its own
    (bench._common.crr_checked): one in which none succeeded, or more than CRR_FAILED_SHARE
    failed, stops the bench (a rate counts the answered connections only, so a lossy path
    would read as merely slower)."""
    crr: dict[str, list[float]] = {"direct": [], "vip": []}
    failed = 0
    pair = [("direct", direct, 8080), ("vip", vip, 80)]
    for k in range(CRR_ROUNDS):
        for what, ip, port in pair if k % 2 == 0 else pair[::-1]:
            r = crr_checked(await echo.crr(ip, port, seconds), f"connections {what} ({ip}:{port}), round {k + 1}")
            crr[what].append(r["connections"] / r["seconds"])
            failed += r["failed"]
    return crr, failed


async def run_size(n: int, endpoints: int, changes: int, seconds: float, root: Path,
                   selector_services: int = 0, pods: int = 0) -> dict[str, Any]:
    lab = Lab(LabSpec(name="bs" + unique_tag("")[:6], nodes=3, pods=0, log_level="warning"), root=root)
    echoes: list[Echo] = []
    try:
        await lab.up(timeout=120)
        client = await lab.add_pod(lab.nodes[0], NS, "client")
        server = await lab.add_pod(lab.nodes[1], NS, "server")
        echoes.append(await Echo.start(server, "server", [("tcp", 8080)]))
        pin(echoes[-1].proc.pid, 1)
        # Many short connections from one address: let the client reuse its TIME_WAIT ports
        # (as TCP_CRR runs do), or the second round waits for free ports, not for the path.
        client.ns.sysctl("net.ipv4.tcp_tw_reuse", 1)
        c = await Echo.start(client, "client")
        pin(c.proc.pid, 0)  # client and server on a core each, as bench/flows.py and bench/policy.py run them
        echoes.append(c)
        res = await lab.resources()
        objs: list[dict[str, Any]] = []
        for i in range(n):
            objs += [service(f"s{i}"), endpoint_slice(f"s{i}", fake_addresses(i, endpoints))]
        start = time.perf_counter()
        revision = 0
        for k in range(0, len(objs), 100):
            revision = await res.apply(objs[k : k + 100])
        written = time.perf_counter() - start
        await live_everywhere(lab, revision)
        apply_all = time.perf_counter() - start
        print(f"[{n} services] applied everywhere in {apply_all:.1f} s (etcd writes {written:.1f} s)", file=sys.stderr, flush=True)
        # One endpoint change, etcd write -> applied on every node; and each node's own sync for it.
        lat, node_sync = [], []
        for k in range(changes):
            i = (k * 7919) % n
            t = time.perf_counter()
            rev = await res.apply(endpoint_slice(f"s{i}", fake_addresses(i, endpoints, salt=k + 1)))
            await live_everywhere(lab, rev)
            lat.append(time.perf_counter() - t)
            for sync in await node_syncs(lab):
                if sync.get("seconds") is not None and not sync.get("full"):
                    node_sync.append(sync["seconds"])
        if not node_sync:
            raise BenchError("no node reported an incremental sync for the endpoint changes")
        print(f"[{n} services] one change: {', '.join(f'{x * 1000:.0f}' for x in lat)} ms end to end; "
              f"node syncs {', '.join(f'{x * 1000:.1f}' for x in node_sync)} ms", file=sys.stderr, flush=True)
        rebuild = None
        if selector_services:
            rebuild = await full_rebuild(lab, res, selector_services, pods)
            print(f"[{n} services] full rebuild with {selector_services} selector services, {pods} pods: {rebuild}",
                  file=sys.stderr, flush=True)
        # The data path: one more service whose endpoint is the server pod (8080 and iperf3's 5201).
        real = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "real", "namespace": NS},
                "spec": {"ports": [{"name": "http", "port": 80}, {"name": "iperf", "port": 5201}]}}  # fmt: skip
        sl = endpoint_slice("real", [server.ip])
        sl["ports"] = [{"name": "http", "port": 8080}, {"name": "iperf", "port": 5201}]
        await live_everywhere(lab, await res.apply([real, sl]))
        vip = (await res.get("Service", NS, "real"))["spec"]["clusterIP"]
        # Rounds of a pair each, the pair's order turned round every round (direct first, then
        # the VIP first); the ratio is the median of the rounds' own ratios: a shared 2-core
        # machine drifts between rounds more than the difference between the two.
        crr, failed = await crr_rounds(c, server.ip, vip, seconds)
        ratios = [v / d for v, d in zip(crr["vip"], crr["direct"], strict=True)]
        print(f"[{n} services] conn/s {crr}; VIP/direct by round {', '.join(f'{x:.2f}' for x in ratios)}",
              file=sys.stderr, flush=True)
        bw = await throughput_rounds(client.ns, server.ns, server.ip, vip, seconds)
        sizes = lab.nodes[0].api("/services?view=summary")
        chains = await asyncio.to_thread(lab.nodes[0].ns.exec, "nft", "list", "chains", "ip", timeout=300)
        return {
            "services": n, "endpoints": endpoints, "write_s": written, "apply_all_s": apply_all,
            "change_median_ms": statistics.median(lat) * 1000, "change_max_ms": max(lat) * 1000,
            "change_runs_ms": [x * 1000 for x in lat],
            "node_sync_median_ms": statistics.median(node_sync) * 1000, "node_sync_max_ms": max(node_sync) * 1000,
            "node_sync_runs_ms": [x * 1000 for x in node_sync],
            "crr_direct": statistics.median(crr["direct"]), "crr_vip": statistics.median(crr["vip"]),
            "crr_ratio": statistics.median(ratios), "crr_ratio_range": [min(ratios), max(ratios)],
            "crr_failed": failed, "gbps_direct": statistics.median(bw["direct"]), "gbps_vip": statistics.median(bw["vip"]),
            "table_chains": chains.count("chain "), "last_sync": sizes.get("last_sync"), "full_rebuild": rebuild,
        }  # fmt: skip
    finally:
        for e in echoes:
            await e.close()
        await lab.down()


# ------------------------------------------------------------------ the anchors

LARGE_CLUSTER_ENDPOINTS = 1000  # kube-proxy's largeClusterEndpointsThreshold
POD_CIDR = "10.244.0.0/16"


def vip(i: int) -> str:
    return f"10.96.{(i >> 8) & 255}.{i & 255}"


def port_name(i: int) -> str:
    return f"{NS}/s{i}:http"


def kp_hash(text: str) -> str:
    """kube-proxy's chain-name hash: sha256, base32, the first 16 characters."""
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()[:16]


def svc_chain(i: int) -> str:
    return "KUBE-SVC-" + kp_hash(port_name(i) + "tcp")


def sep_chain(i: int, addr: str) -> str:
    return "KUBE-SEP-" + kp_hash(port_name(i) + "tcp" + f"{addr}:8080")


def _iptables_service(i: int, addrs: list[str], large: bool) -> tuple[list[str], list[str]]:
    """kube-proxy's nat chains for service ``i`` (KUBE-SVC, a KUBE-SEP per endpoint): (chain
    lines, rules).  Below the large-cluster threshold its rules carry comments."""
    def comment(text: str) -> str:
        return "" if large else f'-m comment --comment "{text}" '

    svc = svc_chain(i)
    chains, rules = [f":{svc} - [0:0]"], []
    rules.append(f'-A {svc} -m comment --comment "{port_name(i)} cluster IP" -m tcp -p tcp -d {vip(i)} --dport 80 '
                 f"! -s {POD_CIDR} -j KUBE-MARK-MASQ")
    for j, addr in enumerate(addrs):
        sep = sep_chain(i, addr)
        left = len(addrs) - j
        pick = f"-m statistic --mode random --probability {1 / left:.10f} " if left > 1 else ""
        rules.append(f"-A {svc} {comment(f'{port_name(i)} -> {addr}:8080')}{pick}-j {sep}")
        chains.append(f":{sep} - [0:0]")
        rules.append(f"-A {sep} {comment(port_name(i))}-s {addr} -j KUBE-MARK-MASQ")
        rules.append(f"-A {sep} {comment(port_name(i))}-m tcp -p tcp -j DNAT --to-destination {addr}:8080")
    return chains, rules


def kube_proxy_restore(n: int, endpoints: int, addresses: dict[int, list[str]], changed: set[int] | None,
                       stale: list[str] = ()) -> str:
    """The iptables-restore input of one kube-proxy sync: its filter chains and top-level nat
    chains in full, the per-service chains of ``changed`` services only (all of them when
    ``changed`` is None: a full sync), and a flush + delete of every ``stale`` chain."""
    large = n * endpoints > LARGE_CLUSTER_ENDPOINTS
    filter_chains = [":KUBE-SERVICES - [0:0]", ":KUBE-EXTERNAL-SERVICES - [0:0]", ":KUBE-FORWARD - [0:0]",
                     ":KUBE-NODEPORTS - [0:0]", ":KUBE-PROXY-FIREWALL - [0:0]"]
    filter_rules = [
        "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP",
        '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT',
        '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack '
        "--ctstate RELATED,ESTABLISHED -j ACCEPT",
    ]
    nat_chains = [":KUBE-SERVICES - [0:0]", ":KUBE-NODEPORTS - [0:0]", ":KUBE-POSTROUTING - [0:0]",
                  ":KUBE-MARK-MASQ - [0:0]"]
    nat_rules = [
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
        "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE',
        "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
    ]
    for i in range(n):
        nat_rules.append(f'-A KUBE-SERVICES -m comment --comment "{port_name(i)} cluster IP" -m tcp -p tcp '
                         f"-d {vip(i)} --dport 80 -j {svc_chain(i)}")
        if changed is None or i in changed:
            chains, rules = _iptables_service(i, addresses[i], large)
            nat_chains += chains
            nat_rules += rules
    nat_rules.append('-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the '
                     'last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS')
    for chain in stale:
        nat_chains.append(f":{chain} - [0:0]")
        nat_rules.append(f"-X {chain}")
    return "\n".join(["*filter", *filter_chains, *filter_rules, "COMMIT",
                      "*nat", *nat_chains, *nat_rules, "COMMIT", ""])


def iptables_anchor(n: int, endpoints: int, changes: int = 3) -> dict[str, Any]:
    """The kube-proxy-shaped iptables ruleset in a scratch namespace: the first (full) load,
    then per change the partial restore its iptables mode sends (see the module docstring)."""
    ns = Netns.create(f"ad-bipt{unique_tag('')[:6]}")
    try:
        addresses = {i: fake_addresses(i, endpoints) for i in range(n)}
        hooks = "\n".join(["*nat", "-A PREROUTING -j KUBE-SERVICES", "-A OUTPUT -j KUBE-SERVICES",
                           "-A POSTROUTING -j KUBE-POSTROUTING", "COMMIT", ""])
        first = kube_proxy_restore(n, endpoints, addresses, None)
        full, _ = timed(ns, ["iptables-restore", "--noflush", "--counters"], first.encode())
        timed(ns, ["iptables-restore", "--noflush"], hooks.encode())  # kube-proxy's EnsureRule jumps
        large = n * endpoints > LARGE_CLUSTER_ENDPOINTS
        syncs, sizes = [], []
        for k in range(changes):
            i = (k * 7919) % n
            before = addresses[i]
            addresses[i] = fake_addresses(i, endpoints, salt=k + 1)
            stale: list[str] = []
            took = 0.0
            if not large:  # it reads the nat table back to find stale chains
                took, saved = timed(ns, ["iptables-save", "-t", "nat"])
                have = {line[1:].split()[0] for line in saved.splitlines() if line.startswith(":KUBE-SEP-")}
                stale = sorted(have - {sep_chain(j, a) for j in range(n) for a in addresses[j]})
            text = kube_proxy_restore(n, endpoints, addresses, {i}, stale)
            restore, _ = timed(ns, ["iptables-restore", "--noflush", "--counters"], text.encode())
            syncs.append(took + restore)
            sizes.append(text.count("\n-A ") + text.count("\n-X "))
            if not large and sorted({sep_chain(i, a) for a in before} - {sep_chain(i, a) for a in addresses[i]}) != stale:
                raise BenchError("the iptables anchor's stale-chain cleanup did not find what changed")
        rules = ns.exec("iptables-save", timeout=600).count("\n-A ")
        return {"rules": rules, "full_s": full, "change_s": statistics.median(syncs), "change_runs_s": syncs,
                "lines_per_sync": statistics.median(sizes), "large_cluster_mode": large}
    finally:
        ns.delete()


def nft_service_name(i: int) -> str:
    return f"service-{kp_hash(port_name(i) + 'tcp')[:8]}-{NS}/s{i}/tcp/http"


def nft_endpoint_name(i: int, addr: str) -> str:
    return f"endpoint-{kp_hash(port_name(i) + 'tcp' + addr)[:8]}-{NS}/s{i}/tcp/http__{addr}/8080"


def _nft_service(i: int, addrs: list[str]) -> tuple[list[str], list[str]]:
    """kube-proxy nftables mode's commands for service ``i``: (endpoint chain names, commands):
    its chains added and flushed (ensureChain), then their rules."""
    svc = nft_service_name(i)
    eps = [nft_endpoint_name(i, a) for a in addrs]
    cmds = [f"add chain ip kube-proxy {svc}", f"flush chain ip kube-proxy {svc}"]
    for e in eps:
        cmds += [f"add chain ip kube-proxy {e}", f"flush chain ip kube-proxy {e}"]
    cmds.append(f"add rule ip kube-proxy {svc} ip daddr {vip(i)} tcp dport 80 ip saddr != {POD_CIDR} "
                "jump mark-for-masquerade")
    vmap = ", ".join(f"{j} : goto {e}" for j, e in enumerate(eps))
    cmds.append(f"add rule ip kube-proxy {svc} numgen random mod {len(eps)} vmap {{ {vmap} }}")
    for e, a in zip(eps, addrs):
        cmds.append(f"add rule ip kube-proxy {e} ip saddr {a} jump mark-for-masquerade")
        cmds.append(f"add rule ip kube-proxy {e} meta l4proto tcp dnat to {a}:8080")
    return eps, cmds


NFT_BASE = [
    "add table ip kube-proxy",
    "add set ip kube-proxy cluster-ips { type ipv4_addr ; }",
    "add map ip kube-proxy service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; }",
    "add map ip kube-proxy no-endpoint-services { type ipv4_addr . inet_proto . inet_service : verdict ; }",
    "add chain ip kube-proxy mark-for-masquerade",
    "add rule ip kube-proxy mark-for-masquerade mark set mark or 0x4000",
    "add chain ip kube-proxy masquerading { type nat hook postrouting priority srcnat ; }",
    "add rule ip kube-proxy masquerading mark and 0x4000 == 0 return",
    "add rule ip kube-proxy masquerading mark set mark xor 0x4000",
    "add rule ip kube-proxy masquerading masquerade fully-random",
    "add chain ip kube-proxy services",
    "add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips",
    "add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority dstnat ; }",
    "add rule ip kube-proxy nat-prerouting jump services",
    "add chain ip kube-proxy nat-output { type nat hook output priority -100 ; }",
    "add rule ip kube-proxy nat-output jump services",
    "add chain ip kube-proxy filter-forward { type filter hook forward priority -110 ; }",
    "add rule ip kube-proxy filter-forward ct state new ip daddr . meta l4proto . th dport vmap @no-endpoint-services",
]


def nft_anchor(n: int, endpoints: int, changes: int = 3) -> dict[str, Any]:
    """kube-proxy's nftables layout in a scratch namespace: built once, then per change what
    its partial sync does (see the module docstring)."""
    ns = Netns.create(f"ad-bnft{unique_tag('')[:6]}")
    try:
        base = list(NFT_BASE)
        current: dict[int, list[str]] = {}
        elements, ips = [], []
        for i in range(n):
            eps, cmds = _nft_service(i, fake_addresses(i, endpoints))
            current[i] = eps
            base += cmds
            elements.append(f"{vip(i)} . tcp . 80 : goto {nft_service_name(i)}")
            ips.append(vip(i))
        for k in range(0, n, 1000):
            base.append(f"add element ip kube-proxy service-ips {{ {', '.join(elements[k : k + 1000])} }}")
            base.append(f"add element ip kube-proxy cluster-ips {{ {', '.join(ips[k : k + 1000])} }}")
        full, _ = timed(ns, ["nft", "-f", "-"], "\n".join(base).encode())
        syncs, stale = [], []
        for k in range(changes):
            i = (k * 7919) % n
            took = 0.0
            if stale:  # chains flushed by the previous sync, deleted in a transaction of their own
                took, _ = timed(ns, ["nft", "-f", "-"], "\n".join(f"delete chain ip kube-proxy {c}" for c in stale).encode())
            seconds, text = timed(ns, ["nft", "--json", "list", "chains", "ip"])
            listed = json.loads(text)
            took += seconds
            seconds, text = timed(ns, ["nft", "--json", "list", "sets", "ip"])
            json.loads(text)
            took += seconds
            eps, cmds = _nft_service(i, fake_addresses(i, endpoints, salt=k + 1))
            stale = [e for e in current[i] if e not in eps]
            cmds += [f"flush chain ip kube-proxy {e}" for e in stale]
            current[i] = eps
            seconds, _ = timed(ns, ["nft", "-f", "-"], "\n".join(cmds).encode())
            syncs.append(took + seconds)
        chains = sum(1 for item in listed["nftables"] if "chain" in item)
        return {"chains": chains, "full_s": full, "change_s": statistics.median(syncs), "change_runs_s": syncs}
    finally:
        ns.delete()


# ------------------------------------------------------------------ the run


async def amain(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="agentd-bench-svc-") as tmp:
        for n in args.services:
            row = await run_size(n, args.endpoints, args.changes, args.seconds, Path(tmp), args.selector_services, args.pods)
            row["iptables_anchor"] = await asyncio.to_thread(iptables_anchor, n, args.endpoints)
            print(f"[{n} services] kube-proxy-shaped iptables {row['iptables_anchor']}", file=sys.stderr, flush=True)
            row["nft_anchor"] = await asyncio.to_thread(nft_anchor, n, args.endpoints)
            print(f"[{n} services] kube-proxy nftables layout {row['nft_anchor']}", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def report(rows: list[dict[str, Any]]) -> None:
    print_table(
        "Services: N x endpoints on 3 nodes (etcd write -> applied on every node)",
        ["services", "endpoints", "apply all (s)", "1 change median (ms)", "1 change max (ms)", "chains (node1)"],
        [[r["services"], r["endpoints"], f"{r['apply_all_s']:.1f}", f"{r['change_median_ms']:.0f}",
          f"{r['change_max_ms']:.0f}", r["table_chains"]] for r in rows],
    )  # fmt: skip
    print_table(
        f"Data path: client pod (node1, CPU 0) -> server pod (node2, CPU 1), through the VIP vs. direct; conn/s "
        f"medians of {CRR_ROUNDS} rounds, VIP/direct the median of the rounds' own ratios (their range beside it); "
        f"failed: connections of all rounds that failed (a run with more than {CRR_FAILED_SHARE:.0%} failed stops "
        f"the bench)",
        ["services", "conn/s direct", "conn/s VIP", "VIP/direct", "rounds' range", "Gbit/s direct", "Gbit/s VIP",
         "failed"],
        [[r["services"], f"{r['crr_direct']:.0f}", f"{r['crr_vip']:.0f}", f"{r['crr_ratio']:.2f}",
          f"{r['crr_ratio_range'][0]:.2f}-{r['crr_ratio_range'][1]:.2f}",
          f"{r['gbps_direct']:.2f}", f"{r['gbps_vip']:.2f}", r["crr_failed"]] for r in rows],
    )  # fmt: skip

    def ms(seconds: float) -> str:
        return f"{seconds * 1000:.1f}"

    rebuilt = [r for r in rows if r.get("full_rebuild")]
    if rebuilt:
        print_table(
            "A full rebuild (node1's agent restarted): its first sync as it reports it (every Service compiled, "
            "selector Services' endpoints matched from the pod records, one nft transaction), and the longest "
            "answer of its API from the restart to that sync (the event loop held: an upper bound)",
            ["services (slices + selector)", "pod records", "full sync (ms)", "longest API answer (ms)",
             "restart -> applied (s)"],
            [[f"{r['services']} + {r['full_rebuild']['selector_services']}", r["full_rebuild"]["pods"],
              ms(r["full_rebuild"]["full_sync_s"]) if r["full_rebuild"]["full_sync_s"] is not None else "not seen",
              ms(r["full_rebuild"]["api_longest_s"]),
              f"{r['full_rebuild']['restart_to_applied_s']:.1f}"] for r in rebuilt],
        )  # fmt: skip

    print_table(
        "One endpoint change, one node's sync (median): agentd's own report vs. one sync of each anchor, "
        "all on this machine (anchors: the kernel-facing part of a kube-proxy sync, a lower bound)",
        ["services", "agentd node sync (ms)", "iptables --noflush partial (ms)", "agentd / iptables",
         "nft partial sync (ms)", "agentd / nft", "anchors' first load: iptables / nft (s)"],
        [[r["services"], f"{r['node_sync_median_ms']:.1f}", ms(r["iptables_anchor"]["change_s"]),
          f"{r['node_sync_median_ms'] / (r['iptables_anchor']['change_s'] * 1000):.3f}x",
          ms(r["nft_anchor"]["change_s"]), f"{r['node_sync_median_ms'] / (r['nft_anchor']['change_s'] * 1000):.2f}x",
          f"{r['iptables_anchor']['full_s']:.1f} / {r['nft_anchor']['full_s']:.1f}"] for r in rows],
    )  # fmt: skip
    print_notes("Anchors and goals", [
        "no kube-proxy runs here: the anchors are the inputs its syncs send, rebuilt and timed in scratch namespaces",
        "iptables: a kube-proxy-shaped ruleset; per change iptables-restore --noflush --counters of its top-level "
        "chains (KUBE-SERVICES: a rule per service) and the changed service's KUBE-SVC/KUBE-SEP chains, as its partial "
        "sync sends (plus iptables-save for stale chains at 1,000 endpoints or fewer)",
        "nftables: kube-proxy's nftables layout; per change: delete the previous sync's stale chains, list chains and "
        "sets, one nft transaction with the changed service's chains",
        "agentd node sync: the agent's own figure for the sync that applied the change (delta compiled + one nft "
        "transaction), median over 3 nodes x the changes",
        "end to end (the first table) has no anchor here: kube-proxy's would include the API server and its watch",
        "kube-proxy IPVS mode: not measured here (this kernel has no IPVS: CONFIG_IP_VS is not set)",
        "goals: one endpoint change live everywhere < 100 ms at 10,000 services; connection rate through a VIP >= 0.9x direct",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", type=int_list, default=[1000], help="service counts, e.g. 1000,10000 (default 1000)")
    ap.add_argument("--endpoints", type=int, default=10, help="endpoints per service (default 10)")
    ap.add_argument("--changes", type=int, default=10, help="endpoint changes timed per size (default 10)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per data-path run (default 5)")
    ap.add_argument("--selector-services", type=int, default=1000,
                    help="selector services for the full rebuild (0: not measured; default 1000)")
    ap.add_argument("--pods", type=int, default=3000, help="pod records they select from (default 3000)")
    args = parse_bench_args(ap, argv, name="services", quick={"services": [100], "changes": 3, "seconds": 2.0,
                                                              "selector_services": 100, "pods": 300})  # fmt: skip
    if args.endpoints < 2 or args.changes < 1 or args.seconds < 1:
        ap.error("--endpoints must be at least 2, --changes and --seconds at least 1")
    if args.selector_services < 0 or args.pods < 0 or (args.pods and not args.selector_services):
        ap.error("--selector-services and --pods must be at least 0, and pods need selector services")
    require_root("bench/services.py")
    rows = asyncio.run(amain(args))
    write_json(args.json, rows)
    report(rows)
    return 0


if __name__ == "__main__":
    run_main(main, "bench/services.py", errors=(LabError, NetnsError))
