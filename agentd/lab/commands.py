"""The bodies of ``agentd lab up|down|status|restart|exec|pod`` (argument parsing is :mod:`agentd.lab.cli`):
what each prints.  The lab itself (:mod:`agentd.lab.lab`) prints nothing but its progress."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import bpffs
from .lab import LAB_ROOT, Lab, LabError, LabSpec, stage_timeout
from .netns import delete_matching
from .wait import auntil

def check_spec(spec: LabSpec) -> None:
    """Refuse, in one line and before anything is built, a lab whose pods could never all
    reach each other (``lab up`` waits for exactly that)."""
    if spec.encap == "cross-subnet" and spec.backend == "host-gw":
        raise LabError("--encap cross-subnet needs an encapsulating --backend (ipip, vxlan or udp)")
    if spec.ip_family == "ipv6" and spec.backend in ("ipip", "udp"):
        raise LabError(f"--backend {spec.backend} needs an IPv4 underlay (its outer header is IPv4), which "
                       "--ip-family ipv6 has not: use vxlan or host-gw, or --ip-family dual")
    if spec.ip_family == "dual" and spec.backend == "ipip" and spec.subnets > 1:
        # ipip carries IPv4 inside IPv4 only (RFC 2003): a peer's IPv6 pods are routed
        # directly or not at all, so across the router between segments they are unreachable.
        raise LabError("--backend ipip carries no IPv6 pods between segments (IPv4 in IPv4 only): with "
                       "--ip-family dual and --subnets above 1 use udp or vxlan, or one segment")
    if spec.ipv4_underlay and spec.ip_family != "dual":
        raise LabError("--ipv4-underlay goes with --ip-family dual")


def up(args) -> int:
    spec = LabSpec(
        name=args.name,
        nodes=args.nodes,
        pods=args.pods,
        bgp=args.bgp,
        reflectors=min(args.reflectors, args.nodes),
        backend=args.backend,
        datapath=args.datapath,
        encap=args.encap,
        subnets=args.subnets,
        etcd=args.etcd,
        docker=args.docker,
        ip_family=args.ip_family,
        ipv4_underlay=args.ipv4_underlay,
        ingress=args.ingress,
    )
    check_spec(spec)
    lab = Lab(spec, progress=lambda line: print(line, flush=True))

    timeout = args.timeout or stage_timeout(spec.nodes)

    async def go() -> None:
        await lab.up(timeout)

    try:
        asyncio.run(go())
    except LabError as err:
        print(f"agentd lab up: {err}", file=sys.stderr)
        print(f"(the lab is left as it is for inspection; `{agentd_command()} lab down --name {spec.name}` removes it)",
              file=sys.stderr)
        return 1
    for version in _versions(spec.ip_family):
        print()
        print(_matrix(lab, version if spec.ip_family == "dual" else None))
    print()
    pings = [(lab.pods[0].name, lab.pods[-1].address(v)) for v in _versions(spec.ip_family)] if lab.pods else []
    print(try_hints(spec.name, [n.name for n in lab.nodes], pings, lab.nodes[0].address if spec.ingress else None,
                    agentd=agentd_command()))
    return 0


def agentd_command() -> str:
    """How a shell runs this agentd: ``agentd`` where that is the one on PATH, else its path
    (after ``scripts/dev lab`` it is .venv/bin/agentd, on no PATH)."""
    me = sys.argv[0] if sys.argv and os.path.basename(sys.argv[0]) == "agentd" else None
    if me is None:
        return "agentd"
    found = shutil.which("agentd")
    return "agentd" if found and os.path.realpath(found) == os.path.realpath(me) else os.path.abspath(me)


def try_hints(name: str, nodes: list[str], pings: list[tuple[str, str]], ingress_address: str | None,
              *, agentd: str = "agentd") -> str:
    """What ``agentd lab up`` suggests next: each line a command that works as printed
    (``agentd``: how the shell runs it, :func:`agentd_command`).  ``pings``: (pod, address)
    pairs; ``ingress_address``: a node's, when the lab has an ingress."""
    lines = [f"Lab {name} is up. Try:",
             f"  {agentd} lab status --name {name}",
             f"  {agentd} lab exec --name {name} {nodes[0]} -- agentd status"]  # fmt: skip
    lines += [f"  {agentd} lab exec --name {name} {pod} -- ping -c 3 {address}" for pod, address in pings]
    if ingress_address is not None:
        lines.append(f"  {agentd} lab exec --name {name} underlay -- curl -s http://{ingress_address}/  "
                     "(the ingress, from outside the pod network: docs/ingress.md)")
    lines.append(f"  {agentd} lab restart --name {name} {nodes[-1]} [--kill]  (its agent stops and starts again; --kill: a crash)")
    lines.append(f"  {agentd} lab down --name {name}")
    return "\n".join(lines)


MATRIX_PODS = 16  # a larger lab gets a count and the failing pairs instead of the matrix


def _versions(ip_family: str) -> tuple[int, ...]:
    return {"ipv4": (4,), "dual": (4, 6), "ipv6": (6,)}[ip_family]


def _matrix(lab: Lab, version: int | None = None) -> str:
    matrix = asyncio.run(lab.ready.reachability(version=version))
    names = [p.name for p in lab.pods]
    what = "ICMP echo" if version is None else ("IPv4, ICMP echo" if version == 4 else "IPv6, ICMPv6 echo")
    if len(names) > MATRIX_PODS:
        failing = [f"{a}->{b}" for (a, b), ok in matrix.items() if not ok]
        text = f"pod reachability ({what}): {len(matrix) - len(failing)}/{len(matrix)} ordered pod pairs answer"
        return text + (f"; failing: {', '.join(failing)}" if failing else "")
    width = max([len(n) for n in names] + [4])
    lines = [f"pod reachability ({what}):", " " * (width + 2) + " ".join(n.rjust(width) for n in names)]
    for a in lab.pods:
        cells = []
        for b in lab.pods:
            cells.append("-".rjust(width) if a is b else ("ok" if matrix.get((a.name, b.name)) else "FAIL").rjust(width))
        lines.append(f"{a.name.ljust(width)}  " + " ".join(cells))
    return "\n".join(lines)


def down(name: str) -> int:
    try:
        lab = Lab.load(name)
    except LabError:
        from .docker_hosts import stop_leftover_engines

        stop_leftover_engines(name)  # a lab of Docker hosts whose state file is gone
        removed = delete_matching(f"ad-{name}-")
        with contextlib.suppress(OSError):
            bpffs.umount(LAB_ROOT / name / "bpffs")
        shutil.rmtree(LAB_ROOT / name, ignore_errors=True)
        print(f"lab {name}: removed {len(removed)} namespaces" if removed else f"lab {name}: nothing to remove")
        return 0
    removed = asyncio.run(lab.down())
    print(f"lab {name}: removed {len(removed)} namespaces")
    return 0


def status(name: str) -> int:
    lab = Lab.load(name)
    from agentd.tables import render_table

    roles = asyncio.run(lab.etcd.roles())
    rows = [[m.name, m.endpoint, roles[m.name]] for m in lab.etcd.members]
    print(render_table(["ETCD MEMBER", "ENDPOINT", "ROLE"], rows))
    print()
    for n in lab.nodes:
        status = n.api_or_none("/status")
        if status is None:
            print(f"{n.name} ({n.primary}): agent not answering (log {n.log_path})\n")
            continue
        node, ds = status["node"], status.get("datastore") or {}
        subnets = " ".join(dict.fromkeys(s for s in (node.get("subnet"), node.get("subnet_v6")) if s))
        print(
            f"{n.name} ({' '.join(a for a in (n.address, n.address_v6) if a)}) subnet {subnets} "
            f"backend {node.get('backend')}"
            f"{' [route reflector]' if node.get('route_reflector') else ''}"
            f" routes {status['routes']['programmed']} ready {status.get('ready')}"
            f" etcd {'connected' if ds.get('connected') else 'DISCONNECTED'} ({ds.get('endpoint') or '-'})"
        )
        rows = [
            [p["address"], p.get("description") or p.get("type", ""), p["state"], str(p.get("prefixes_received", 0)),
             p.get("backend") or "-", p.get("datapath") or "-"]
            for p in status["bgp"]["peers"]
        ]
        print(render_table(["PEER", "TYPE", "STATE", "PREFIXES", "BACKEND", "DATA PATH"], rows))
        for line in n.kernel_routes():
            print(f"  {line}")
        print()
    print("pods: " + ", ".join(f"{p.name}={'/'.join(p.ips) or p.ip}" for p in lab.pods))
    return 0


def restart(name: str, node_name: str, *, kill: bool = False, timeout: float = 60.0) -> int:
    """Stop one node's agent (SIGTERM: a graceful stop that keeps its routes and lets its peers
    keep theirs; ``kill``: SIGKILL, a crash) and start it again with the same configuration,
    then wait until it says it is ready.  What a systemd restart or a crash does to a host,
    for one lab node; the kernel routes before and after show what the restart kept."""
    lab = Lab.load(name)
    node = lab.node(node_name)
    before = node.kernel_routes()
    sig = signal.SIGKILL if kill else signal.SIGTERM
    old_pid = node.agent_pid()
    t0 = time.monotonic()

    async def run() -> None:
        await node.stop_agent(sig)
        node.start_agent()

        def ready() -> bool:
            if node.proc is not None and node.proc.poll() is not None:
                raise LabError(f"{node.name}: the agent exited with status {node.proc.returncode} (log {node.log_path})")
            return bool((node.api_or_none("/status") or {}).get("ready"))

        await auntil(ready, timeout, what=f"{node.name}: agent ready after the restart (log {node.log_path})",
                     interval=0.1, in_thread=True, error=LabError)

    asyncio.run(run())
    after = node.kernel_routes()
    kept = len(set(before) & set(after))
    if old_pid is None:
        what = "was not running; started"
    else:
        what = f"(pid {old_pid}) {'killed with SIGKILL' if kill else 'stopped with SIGTERM'}; started again"
    print(f"{node.name}: agent {what} as pid {node.agent_pid()}, ready in {time.monotonic() - t0:.1f} s")
    print(f"kernel routes (proto 143): {len(before)} before, {len(after)} after, {kept} unchanged")
    return 0


def exec_in(name: str, target: str, argv: list[str]) -> int:
    lab = Lab.load(name)
    ns = lab.namespace_of(target)
    if not ns.exists():
        raise LabError(f"{target}: namespace {ns.name} does not exist")
    env = dict(os.environ)
    # The venv's agentd and agentd-cni first, so `lab exec node1 -- agentd status` works under sudo.
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
    for n in lab.nodes:
        if n.name == target:  # `lab exec node1 -- agentd apply -f ...` finds the lab's etcd
            env["AGENTD_CONFIG"] = str(n.config_path)
    rc = subprocess.call(["ip", "netns", "exec", ns.name, *argv], env=env)
    return 128 - rc if rc < 0 else rc  # killed by a signal: the status a shell gives


def pod(args) -> int:
    """``agentd lab pod add NODE NS/NAME [--labels k=v ...] [--port NAME=PORT[/PROTO] ...]
    [--host-port NAME=HOSTPORT ...]``, ``agentd lab pod del NS/NAME``, ``agentd lab pod list``."""
    host_ports = []
    if args.pod_command == "add":
        try:
            host_ports = host_port_mappings(args.port, args.host_port)
        except ValueError as err:
            raise LabError(str(err)) from None
    lab = Lab.load(args.name)
    if args.pod_command == "list":
        from agentd.resources.cli import plain_table

        rows = [[p.name, p.node.name, " ".join(p.ips) or p.ip or "-",
                 ",".join(f"{k}={v}" for k, v in p.labels.items()) or "-"]
                for p in lab.pods]  # fmt: skip
        print(plain_table(["POD", "NODE", "IP", "LABELS"], rows))
        return 0
    ns, _, pod_name = args.pod.rpartition("/")
    if args.pod_command == "del":
        asyncio.run(lab.remove_pod(lab.pod(args.pod if ns else f"default/{pod_name}")))
        print(f"pod {args.pod} removed")
        return 0
    labels = dict(item.split("=", 1) for item in args.labels)
    pod = asyncio.run(lab.add_pod(args.node, ns or "default", pod_name, labels=labels, ports=args.port,
                                  host_ports=host_ports))  # fmt: skip
    mapped = "".join(f", {pod.node.primary}:{m['hostPort']}/{m['protocol']} -> {m['containerPort']}" for m in host_ports)
    print(f"pod {pod.name} on {pod.node.name}: {' '.join(pod.ips) or pod.ip} (namespace {pod.ns.name}{mapped})")
    return 0


def host_port_mappings(ports: list[dict], host_ports: list[tuple[str, int]]) -> list[dict]:
    """``--host-port NAME=HOSTPORT`` as the runtime passes hostPorts to portmap
    (runtimeConfig.portMappings), each the named ``--port``'s container port and protocol."""
    named = {p["name"]: p for p in ports if "name" in p}
    out: list[dict] = []
    seen: set[tuple[int, str]] = set()
    for name, host_port in host_ports:
        if name not in named:
            raise ValueError(f"--host-port {name}={host_port}: no --port named {name!r} "
                             f"(named ports: {', '.join(named) or 'none'})")  # fmt: skip
        proto = named[name]["protocol"].lower()
        if (host_port, proto) in seen:  # the API server: hostPort/protocol unique in a pod
            raise ValueError(f"--host-port {name}={host_port}: host port {host_port}/{proto.upper()} is given twice")
        seen.add((host_port, proto))
        out.append({"hostPort": host_port, "containerPort": named[name]["containerPort"], "protocol": proto})
    return out
