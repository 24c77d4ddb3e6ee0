"""Services at scale (issue 14): N services x 10 endpoints on a 3-node lab.

    python bench/services.py [--services 1000,10000] [--endpoints 10] [--changes 10] [--seconds 5] [--json]

Real: etcd, three `agentd run` agents (host-gw) with their `ip agentd-services` tables, two
pods (a client on node1, a server on node2) with svcecho and iperf3.  The N services have no
selector; their endpoints are EndpointSlices with made-up addresses (10.250.0.0/16, not
routed: only the table's size matters for them), except one service whose endpoint is the
server pod, used for the data-path figures.

Measured, per N:

* apply all: the N Services and N EndpointSlices written to etcd (transactions of 100
  objects, cluster IPs allocated) until every node reports the last revision applied
  (GET /services?view=summary polled every 5 ms: an upper bound);
* one endpoint change: one EndpointSlice rewritten (an endpoint replaced) until every node
  reports it applied; median and max over --changes;
* connection setup through the VIP vs. directly to the pod: TCP_CRR-style, 4 loops of
  connect + one request/response + close for --seconds, 3 alternating rounds each, medians
  (asyncio client: the client's own cost dominates, the ratio is the figure);
* throughput through the VIP vs. direct (iperf3, 5 s, one stream, 2 alternating rounds, medians).

Anchors (published figures, not measured here): kube-proxy iptables mode rewrites the whole
ruleset with iptables-restore, seconds per change at 10,000 services; IPVS and kube-proxy's
nftables mode change incrementally (IPVS: one virtual server; nftables: a transaction per sync).
Goals of the issue: one endpoint change live everywhere < 100 ms at 10,000 services; connection
rate through a VIP >= 0.9x direct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit_json, int_list, print_notes, print_table, require_root  # noqa: E402

from agentd.lab.lab import Lab, LabSpec  # noqa: E402
from agentd.lab.netns import Netns, unique_tag  # noqa: E402
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
    raise RuntimeError(f"revision {revision} not applied everywhere in {timeout}s")


def iperf(client_ns: str, server_ip: str, port: int, seconds: int) -> float:
    out = subprocess.run(["ip", "netns", "exec", client_ns, "iperf3", "-c", server_ip, "-p", str(port), "-t", str(seconds), "-J"],
                         capture_output=True, text=True, timeout=seconds + 30, check=False)  # fmt: skip
    data = json.loads(out.stdout or "{}")
    return data.get("end", {}).get("sum_received", {}).get("bits_per_second", 0.0) / 1e9


async def run_size(n: int, endpoints: int, changes: int, seconds: float, root: Path) -> dict[str, Any]:
    lab = Lab(LabSpec(name="bs" + unique_tag("")[:6], nodes=3, pods=0, log_level="warning"), root=root)
    echoes: list[Echo] = []
    iperf_server = None
    try:
        await lab.up(timeout=120)
        client = await lab.add_pod(lab.nodes[0], NS, "client")
        server = await lab.add_pod(lab.nodes[1], NS, "server")
        echoes.append(await Echo.start(server, "server", [("tcp", 8080)]))
        # Many short connections from one address: let the client reuse its TIME_WAIT ports
        # (as TCP_CRR runs do), or the second round waits for free ports, not for the path.
        client.ns.sysctl("net.ipv4.tcp_tw_reuse", 1)
        c = await Echo.start(client, "client")
        echoes.append(c)
        iperf_server = subprocess.Popen(["ip", "netns", "exec", server.ns.name, "iperf3", "-s", "-p", "5201"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
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
        # One endpoint change, etcd write -> applied on every node.
        lat = []
        for k in range(changes):
            i = (k * 7919) % n
            t = time.perf_counter()
            rev = await res.apply(endpoint_slice(f"s{i}", fake_addresses(i, endpoints, salt=k + 1)))
            await live_everywhere(lab, rev)
            lat.append(time.perf_counter() - t)
        print(f"[{n} services] one change: {', '.join(f'{x * 1000:.0f}' for x in lat)} ms", file=sys.stderr, flush=True)
        # The data path: one more service whose endpoint is the server pod (8080 and iperf3's 5201).
        real = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "real", "namespace": NS},
                "spec": {"ports": [{"name": "http", "port": 80}, {"name": "iperf", "port": 5201}]}}  # fmt: skip
        sl = endpoint_slice("real", [server.ip])
        sl["ports"] = [{"name": "http", "port": 8080}, {"name": "iperf", "port": 5201}]
        await live_everywhere(lab, await res.apply([real, sl]))
        vip = (await res.get("Service", NS, "real"))["spec"]["clusterIP"]
        # Alternating rounds, medians: a shared 2-core machine drifts more than the difference.
        crr: dict[str, list[float]] = {"direct": [], "vip": []}
        failed = 0
        for _ in range(3):
            for what, ip, port in (("direct", server.ip, 8080), ("vip", vip, 80)):
                r = await c.crr(ip, port, seconds)
                crr[what].append(r["connections"] / r["seconds"])
                failed += r["failed"]
        print(f"[{n} services] conn/s {crr}", file=sys.stderr, flush=True)
        bw: dict[str, list[float]] = {"direct": [], "vip": []}
        for _ in range(2):
            bw["direct"].append(await asyncio.to_thread(iperf, client.ns.name, server.ip, 5201, 5))
            bw["vip"].append(await asyncio.to_thread(iperf, client.ns.name, vip, 5201, 5))
        sizes = lab.nodes[0].api("/services?view=summary")
        chains = await asyncio.to_thread(lab.nodes[0].ns.exec, "nft", "list", "chains", "ip", timeout=300)
        return {
            "services": n, "endpoints": endpoints, "write_s": written, "apply_all_s": apply_all,
            "change_median_ms": statistics.median(lat) * 1000, "change_max_ms": max(lat) * 1000,
            "crr_direct": statistics.median(crr["direct"]), "crr_vip": statistics.median(crr["vip"]),
            "crr_failed": failed, "gbps_direct": statistics.median(bw["direct"]), "gbps_vip": statistics.median(bw["vip"]),
            "table_chains": chains.count("chain "), "last_sync": sizes.get("last_sync"),
        }  # fmt: skip
    finally:
        for e in echoes:
            await e.close()
        if iperf_server is not None:
            iperf_server.kill()
            iperf_server.wait()
        await lab.down()


def kube_proxy_rules(n: int, endpoints: int, salt: int = 0, changed: int = -1) -> str:
    """The nat table kube-proxy's iptables mode writes for ``n`` services x ``endpoints``
    (KUBE-SERVICES -> KUBE-SVC-* with statistic random -> KUBE-SEP-* with masquerade mark and
    DNAT), as one iptables-restore input; service ``changed`` gets endpoints salted ``salt``."""
    chains = [":KUBE-SERVICES - [0:0]", ":KUBE-MARK-MASQ - [0:0]", ":KUBE-POSTROUTING - [0:0]"]
    rules = ["-A PREROUTING -j KUBE-SERVICES", "-A OUTPUT -j KUBE-SERVICES", "-A POSTROUTING -j KUBE-POSTROUTING",
             "-A KUBE-POSTROUTING -m mark --mark 0x4000/0x4000 -j MASQUERADE",
             "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000"]  # fmt: skip
    for i in range(n):
        vip = f"10.96.{(i >> 8) & 255}.{i & 255}"
        chains.append(f":KUBE-SVC-{i} - [0:0]")
        rules.append(f"-A KUBE-SERVICES -d {vip}/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-{i}")
        addrs = fake_addresses(i, endpoints, salt if i == changed else 0)
        for j, addr in enumerate(addrs):
            chains.append(f":KUBE-SEP-{i}-{j} - [0:0]")
            left = len(addrs) - j
            pick = f"-m statistic --mode random --probability {1 / left:.11f} " if left > 1 else ""
            rules.append(f"-A KUBE-SVC-{i} {pick}-j KUBE-SEP-{i}-{j}")
            rules.append(f"-A KUBE-SEP-{i}-{j} -s {addr}/32 -j KUBE-MARK-MASQ")
            rules.append(f"-A KUBE-SEP-{i}-{j} -p tcp -m tcp -j DNAT --to-destination {addr}:8080")
    return "\n".join(["*nat", *chains, *rules, "COMMIT", ""])


def iptables_anchor(n: int, endpoints: int, changes: int = 3) -> dict[str, Any]:
    """kube-proxy's iptables mode, measured here: the whole nat table through iptables-restore
    (Debian's iptables 1.8, nf_tables backend) in a scratch namespace, then the same restore
    again with one service's endpoints changed, which is what that mode does per sync."""
    ns = Netns.create(f"ad-bipt{unique_tag('')[:6]}")
    try:
        first = kube_proxy_rules(n, endpoints)
        start = time.perf_counter()
        ns.exec("iptables-restore", input=first.encode(), timeout=1800)
        full = time.perf_counter() - start
        again = []
        for k in range(changes):
            text = kube_proxy_rules(n, endpoints, salt=k + 1, changed=(k * 7919) % n)
            start = time.perf_counter()
            ns.exec("iptables-restore", input=text.encode(), timeout=1800)
            again.append(time.perf_counter() - start)
        return {"rules": first.count("\n-A "), "full_s": full, "change_s": statistics.median(again)}
    finally:
        ns.delete()


def _kp_service(i: int, endpoints: int, salt: int) -> tuple[list[str], list[str]]:
    """kube-proxy nftables mode's chains for service ``i``: (chain names, nft commands)."""
    addrs = fake_addresses(i, endpoints, salt)
    eps = [f"endpoint-{i}-{a.replace('.', '-')}" for a in addrs]
    cmds = [f"add chain ip kube-proxy service-{i}", f"flush chain ip kube-proxy service-{i}"]
    cmds += [f"add chain ip kube-proxy {e}" for e in eps]
    vmap = ", ".join(f"{j} : goto {e}" for j, e in enumerate(eps))
    cmds.append(f"add rule ip kube-proxy service-{i} numgen random mod {len(eps)} vmap {{ {vmap} }}")
    for e, a in zip(eps, addrs):
        cmds.append(f"flush chain ip kube-proxy {e}")
        cmds.append(f"add rule ip kube-proxy {e} ip saddr {a} jump mark-for-masquerade")
        cmds.append(f"add rule ip kube-proxy {e} meta l4proto tcp dnat to {a}:8080")
    return eps, cmds


def nft_anchor(n: int, endpoints: int, changes: int = 3) -> dict[str, Any]:
    """kube-proxy's nftables mode, measured here: its table (a verdict map of services, a chain
    per service choosing with numgen, a chain per endpoint) in a scratch namespace, then what it
    sends for one changed service: one `nft -f` transaction that rewrites that service's chain,
    adds the new endpoint chains and deletes the old (nft reads the table's state first)."""
    ns = Netns.create(f"ad-bnft{unique_tag('')[:6]}")
    try:
        base = ["add table ip kube-proxy",
                "add map ip kube-proxy service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; }",
                "add chain ip kube-proxy mark-for-masquerade",
                "add rule ip kube-proxy mark-for-masquerade meta mark set meta mark or 0x4000",
                "add chain ip kube-proxy services",
                "add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips",
                "add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority dstnat ; }",
                "add rule ip kube-proxy nat-prerouting jump services"]  # fmt: skip
        current: dict[int, list[str]] = {}
        elements = []
        for i in range(n):
            eps, cmds = _kp_service(i, endpoints, 0)
            current[i] = eps
            base += cmds
            elements.append(f"10.96.{(i >> 8) & 255}.{i & 255} . tcp . 80 : goto service-{i}")
        for k in range(0, len(elements), 1000):
            base.append(f"add element ip kube-proxy service-ips {{ {', '.join(elements[k : k + 1000])} }}")
        start = time.perf_counter()
        ns.exec("nft", "-f", "-", input="\n".join(base).encode(), timeout=1800)
        full = time.perf_counter() - start
        again = []
        for k in range(changes):
            i = (k * 7919) % n
            eps, cmds = _kp_service(i, endpoints, k + 1)
            cmds += [f"delete chain ip kube-proxy {e}" for e in current[i] if e not in eps]
            current[i] = eps
            start = time.perf_counter()
            ns.exec("nft", "-f", "-", input="\n".join(cmds).encode(), timeout=600)
            again.append(time.perf_counter() - start)
        return {"chains": n * (endpoints + 1), "full_s": full, "change_s": statistics.median(again)}
    finally:
        ns.delete()


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", type=int_list, default=[1000])
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--changes", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    require_root("bench/services.py")
    rows = []
    with tempfile.TemporaryDirectory(prefix="agentd-bench-svc-") as tmp:
        for n in args.services:
            row = await run_size(n, args.endpoints, args.changes, args.seconds, Path(tmp))
            row["anchor"] = await asyncio.to_thread(iptables_anchor, n, args.endpoints)
            print(f"[{n} services] kube-proxy iptables anchor {row['anchor']}", file=sys.stderr, flush=True)
            row["nft_anchor"] = await asyncio.to_thread(nft_anchor, n, args.endpoints)
            print(f"[{n} services] kube-proxy nftables anchor {row['nft_anchor']}", file=sys.stderr, flush=True)
            rows.append(row)
    if args.json:
        emit_json(rows)
        return 0
    print_table(
        "Services: N x endpoints on 3 nodes (etcd write -> applied on every node)",
        ["services", "endpoints", "apply all (s)", "1 change median (ms)", "1 change max (ms)", "chains (node1)"],
        [[r["services"], r["endpoints"], f"{r['apply_all_s']:.1f}", f"{r['change_median_ms']:.0f}",
          f"{r['change_max_ms']:.0f}", r["table_chains"]] for r in rows],
    )  # fmt: skip
    print_table(
        "Data path: client pod (node1) -> server pod (node2), through the VIP vs. direct",
        ["services", "conn/s direct", "conn/s VIP", "VIP/direct", "Gbit/s direct", "Gbit/s VIP", "failed"],
        [[r["services"], f"{r['crr_direct']:.0f}", f"{r['crr_vip']:.0f}", f"{r['crr_vip'] / max(r['crr_direct'], 1e-9):.2f}",
          f"{r['gbps_direct']:.2f}", f"{r['gbps_vip']:.2f}", r["crr_failed"]] for r in rows],
    )  # fmt: skip
    print_table(
        "One endpoint change vs. the anchors, kube-proxy's iptables mode (whole nat table through iptables-restore) and "
        "nftables mode (the changed service's chains through nft -f), both measured here on one node",
        ["services", "agentd: etcd -> all 3 nodes (ms)", "iptables-restore (ms)", "agentd / iptables",
         "nft -f (ms)", "agentd / nft", "first load: iptables / nft (s)"],
        [[r["services"], f"{r['change_median_ms']:.0f}", f"{r['anchor']['change_s'] * 1000:.0f}",
          f"{r['change_median_ms'] / max(r['anchor']['change_s'] * 1000, 1e-9):.3f}x",
          f"{r['nft_anchor']['change_s'] * 1000:.0f}",
          f"{r['change_median_ms'] / max(r['nft_anchor']['change_s'] * 1000, 1e-9):.2f}x",
          f"{r['anchor']['full_s']:.1f} / {r['nft_anchor']['full_s']:.1f}"] for r in rows],
    )  # fmt: skip
    print_notes("Anchors and goals", [
        "kube-proxy iptables mode: the rules it writes, restored whole per change in a scratch namespace (above)",
        "kube-proxy nftables mode: its table built and one service's chains rewritten with nft -f in a scratch namespace (above)",
        "kube-proxy IPVS mode: not measured here (this kernel has no IPVS: CONFIG_IP_VS is not set)",
        "goals: one endpoint change live everywhere < 100 ms at 10,000 services; connection rate through a VIP >= 0.9x direct",
    ])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
