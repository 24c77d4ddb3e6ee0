"""``agentd lab up|down|status|exec``: argument parsing and dispatch (the lab itself is agentd.lab.lab)."""

from __future__ import annotations

import argparse
import re
import sys

from agentd.backend_table import NAMES
from agentd.cli import Command, seconds_arg
from agentd.config.settings import DATAPATH_CHOICES
from agentd.digits import whole_number

NAME_RE = re.compile(r"[a-z0-9]{1,12}")  # fullmatch: "$" matches before a final newline
MAX_NODES = 200  # agentd.lab.lab.MAX_NODES: node I is 172.30.s.(10+I), pod subnets are /24s of a /16


def _lab_name(text: str) -> str:
    if not NAME_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"invalid lab name {text!r}: 1-12 lowercase letters or digits")
    return text


def _positive(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"{n} is out of range {lo}..{hi}")
        return n

    return parse


def add_lab_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="lab_command", metavar="up|down|status|restart|exec|pod")
    sub.required = True
    up = sub.add_parser("up", help="build the lab and wait until every pod reaches every other pod")
    up.add_argument("--name", type=_lab_name, default="lab", help="lab name (namespaces are ad-<name>-*)")
    up.add_argument("--nodes", type=_positive(1, MAX_NODES), default=3,
                    help=f"nodes (1..{MAX_NODES}; node I has underlay address 172.30.s.(10+I))")
    up.add_argument("--pods", type=_positive(0, 16), default=2, help="pods per node")
    up.add_argument("--bgp", choices=["mesh", "route-reflector"], default="mesh")
    up.add_argument("--reflectors", type=_positive(1, 8), default=2, help="route reflectors (route-reflector mode)")
    up.add_argument("--backend", choices=NAMES, default="host-gw")
    up.add_argument("--datapath", choices=DATAPATH_CHOICES, default="auto",
                    help="udp and ipip: in-kernel BPF, the user-space worker, or auto (bpf where it loads)")
    up.add_argument("--encap", choices=["always", "cross-subnet"], default="always")
    up.add_argument("--ip-family", choices=["ipv4", "dual", "ipv6"], default="ipv4",
                    help="the pods' addresses: IPv4, both (dual-stack) or IPv6; the underlay gets IPv6 "
                         "addresses too (dual) or only (ipv6, etcd included)")
    up.add_argument("--ipv4-underlay", action="store_true",
                    help="with --ip-family dual: no IPv6 on the underlay (IPv6 pods over IPv4 links)")
    up.add_argument("--subnets", type=_positive(1, 8), default=1, help="L2 segments, joined by a router")
    up.add_argument("--etcd", type=_positive(1, 7), default=1, metavar="N",
                    help="etcd members forming one cluster (3 or 5 survive the loss of 1 or 2)")
    up.add_argument("--docker", action="store_true",
                    help="Docker hosts: every node runs a dockerd on its subnet (agentd docker-opts), the pods are "
                         "containers started with docker run, and the agents masquerade traffic leaving the pod network")
    up.add_argument("--ingress", action="store_true",
                    help="run the Ingress controller on every node; the underlay namespace gets a client address")
    up.add_argument("--timeout", type=seconds_arg, default=None,
                    help="seconds to wait for each stage (default 90, or 3 per node above 30 nodes)")
    for name, text in (("down", "stop the lab's agents and etcd and remove its namespaces and files"),
                       ("status", "the lab's etcd members, and each node's subnet, routes and BGP peers")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("--name", type=_lab_name, default="lab")
    rs = sub.add_parser("restart", help="stop one node's agent and start it again (graceful, or --kill for a crash)")
    rs.add_argument("--name", type=_lab_name, default="lab")
    rs.add_argument("node", help="node name (node2)")
    rs.add_argument("--kill", action="store_true",
                    help="SIGKILL instead of SIGTERM: a crash, as when the process dies or the OOM killer strikes")
    rs.add_argument("--timeout", type=seconds_arg, default=60.0, help="seconds to wait for the agent to be ready (default 60)")
    ex = sub.add_parser("exec", help="run a command in a node or pod namespace")
    ex.add_argument("--name", type=_lab_name, default="lab")
    ex.add_argument("target", help="node name (node1) or pod name (node1-pod1)")
    ex.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND...")
    # Pods with a namespace, labels and named ports (NetworkPolicy).
    pod = sub.add_parser("pod", help="add, remove or list pods with a namespace and labels")
    pods = pod.add_subparsers(dest="pod_command", metavar="add|del|list")
    pods.required = True
    add = pods.add_parser("add", help="attach a pod NS/NAME with labels to a node")
    add.add_argument("--name", type=_lab_name, default="lab")
    add.add_argument("node", help="node name (node1)")
    add.add_argument("pod", type=_pod_ref, metavar="NS/NAME")
    add.add_argument("--labels", "-l", nargs="*", default=[], type=_label, metavar="KEY=VALUE")
    add.add_argument("--port", "-p", action="append", default=[], type=_named_port, metavar="NAME=PORT[/PROTO]",
                     help="a named container port (repeatable), e.g. http=80/TCP")
    add.add_argument("--host-port", action="append", default=[], type=_host_port, metavar="NAME=HOSTPORT",
                     help="map the node's HOSTPORT to the named --port NAME (a hostPort, through the "
                          "conflist's portmap plugin; repeatable), e.g. http=8080")
    rm = pods.add_parser("del", help="detach a pod (CNI DEL) and remove its namespace")
    rm.add_argument("--name", type=_lab_name, default="lab")
    rm.add_argument("pod", type=_pod_ref, metavar="NS/NAME")
    ls = pods.add_parser("list", help="the lab's pods")
    ls.add_argument("--name", type=_lab_name, default="lab")


def _pod_ref(text: str) -> str:
    from agentd.resources.validation import Invalid, dns1123_label, dns1123_subdomain

    ns, _, name = text.rpartition("/")
    try:
        dns1123_label(ns or "default", "namespace")
        dns1123_subdomain(name, "name")
    except Invalid as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None
    return text


def _label(text: str) -> str:
    from agentd.resources.validation import Invalid, label_value, qualified_name

    key, eq, value = text.partition("=")
    try:
        if not eq:
            raise Invalid("", "expected KEY=VALUE")
        qualified_name(key, "key")
        label_value(value, "value")
    except Invalid as err:
        raise argparse.ArgumentTypeError(f"label {text!r}: {err}") from None
    return text


def _named_port(text: str) -> dict:
    from agentd.resources.pod import container_port
    from agentd.resources.validation import Invalid

    name, eq, rest = text.partition("=")
    number, _, proto = rest.partition("/")
    try:
        port = whole_number(number, 5) if eq else None
        if port is None:
            raise Invalid("", "expected NAME=PORT[/PROTO], e.g. http=80/TCP")
        return container_port({"name": name, "containerPort": port, "protocol": proto.upper() or "TCP"}, "port", set())
    except Invalid as err:
        raise argparse.ArgumentTypeError(f"port {text!r}: {err}") from None


def _host_port(text: str) -> tuple[str, int]:
    name, eq, number = text.partition("=")
    port = whole_number(number, 5)
    if not eq or not name or port is None or not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"host port {text!r}: expected NAME=HOSTPORT (1-65535), e.g. http=8080")
    return name, port


def lab_command(args: argparse.Namespace) -> int:
    from agentd.lab import commands
    from agentd.lab.lab import LabError

    try:
        if args.lab_command == "up":
            return commands.up(args)
        if args.lab_command == "down":
            return commands.down(args.name)
        if args.lab_command == "status":
            return commands.status(args.name)
        if args.lab_command == "pod":
            return commands.pod(args)
        if args.lab_command == "restart":
            return commands.restart(args.name, args.node, kill=args.kill, timeout=args.timeout)
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not argv:
            sys.stderr.write("agentd lab exec: no command given (agentd lab exec NODE -- CMD...)\n")
            return 2
        return commands.exec_in(args.name, args.target, argv)
    except LabError as err:
        sys.stderr.write(f"agentd lab {args.lab_command}: {err}\n")
        return 1
    except KeyboardInterrupt:  # agentd.cli.main makes it exit status 130, quietly
        if args.lab_command == "up":
            sys.stderr.write(f"agentd lab up: interrupted; `{commands.agentd_command()} lab down --name {args.name}` "
                             "removes what was built\n")
        raise


#: ``agentd lab``, plugged into the agent's command line through the ``agentd.commands``
#: entry point (pyproject.toml).
COMMAND = Command(
    help="the multi-node lab in network namespaces on this machine",
    add_arguments=add_lab_arguments,
    run=lab_command,
)
