"""The ``agentd`` command line (README.md "Commands").

Every command validates its arguments and configuration before touching the system
and reports a problem as ONE line on stderr with a non-zero exit status.
"""

from __future__ import annotations

import argparse
import errno
import gc
import http.client  # (imported by what the CLI imports anyway)
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path
from typing import Any, NoReturn

from agentd.config.settings import (
    DEFAULT_CONFIG_PATH,
    ConfigError,
    HostFacts,
    NodeFacts,
    RunningHost,
    check_config,
    config_warnings,
    load_config,
)
from agentd.config.values import one_line, shorten
from agentd.kernel.netinfo import LocalHost
from agentd.tables import render_table

DEFAULT_API = "http://127.0.0.1:9099"

# The cyclic GC for the long-running commands (run, speaker).  A Loc-RIB of 200,000 routes,
# each with its own attribute set, is over a million tracked objects that never form
# cycles; with CPython's default thresholds (700, 10, 10) taking them in cost more CPU in
# full collections than decoding the UPDATEs did.  Young collections every 10,000 net
# allocations and a full one every 10 of the middle ones (still only after the heap grew by
# a quarter) keep cycles collected, over ten times less often than by default.
GC_THRESHOLDS = (10_000, 10, 10)


def tune_gc() -> None:
    """Set GC_THRESHOLDS; what start-up made (modules, configuration) is frozen, out of
    every later collection."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)
MALLOC_ARENAS = 2


def limit_malloc_arenas() -> None:
    """At most MALLOC_ARENAS glibc malloc arenas (unless MALLOC_ARENA_MAX says otherwise).
    glibc gives each thread that allocates its own arena, up to 8 per core; the agent's
    threads (the default executor's, the nft contexts', gRPC's, libuv's) allocate little and
    rarely, so each arena is mostly slack: 2 arenas instead of one a thread is 3 MB less RSS
    for an idle agent, with no lock contention worth the name.  No-op on a libc without
    ``mallopt`` (musl)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_ARENA_MAX, MALLOC_ARENAS)


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentd")
    except PackageNotFoundError:  # running from a source tree without an install
        return "0+unknown"


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (not usage + error) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


class _TopParser(_Parser):
    """``agentd`` itself: with no command given, a mistyped option (``agentd --verison``) is
    named rather than lost behind "COMMAND is required" (argparse checks that first)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required"):
            unknown = [a for a in getattr(self, "_given", ()) if a.startswith("-") and a != "-" and not self._known(a)]
            if unknown:
                message = f"unrecognized arguments: {' '.join(unknown)}"
        super().error(message)

    def _known(self, arg: str) -> bool:
        name = arg.split("=", 1)[0]
        options = self._option_string_actions
        return name in options or (name.startswith("--") and any(o.startswith(name) for o in options))


def _overrides(pairs: list[str] | None, parser: argparse.ArgumentParser) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in pairs or []:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name:
            parser.error(f"argument --set: expected SECTION.KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


# The commands of this module.  When the command line names one of them, the resource
# commands (YAML, manifests) and the plugged-in ones (entry points, the lab) are not
# loaded at all: `agentd run` is on the path of a joining node's routes (every
# import before the agent is up is join time).
CORE_COMMANDS = ("run", "speaker", "leave", "status", "check-config")


class _Version(argparse.Action):
    """``--version``, the package metadata read only when asked."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        print(f"agentd {package_version()}")
        parser.exit()


def _named_command(argv: list[str] | None) -> str | None:
    """The sub-command ``argv`` names (its first word that is no option), if any."""
    for arg in sys.argv[1:] if argv is None else argv:
        if not arg.startswith("-"):
            return arg
    return None


def build_parser(argv: list[str] | None = None, *, full: bool | None = None) -> argparse.ArgumentParser:
    """The parser; with ``full`` False only the commands of this module (see CORE_COMMANDS).
    By default that is decided from ``argv`` (``sys.argv[1:]`` when None)."""
    if full is None:
        full = _named_command(argv) not in CORE_COMMANDS
    p = _TopParser(prog="agentd", description="Pod-network agent: etcd subnet leases, BGP, routes, tunnels.")
    p.add_argument("--version", action=_Version, help="show the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def config_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--config", "-c", help=f"configuration file (default $AGENTD_CONFIG, else {DEFAULT_CONFIG_PATH})"
        )
        sp.add_argument(
            "--set", action="append", metavar="SECTION.KEY=VALUE", help="override one configuration key"
        )
        sp.add_argument("--log-level", choices=["debug", "info", "warning", "error"])

    sp = sub.add_parser("run", help="run the node agent")
    config_args(sp)

    sp = sub.add_parser("speaker", help="run the BGP speaker alone (route reflector, interop)")
    config_args(sp)

    sp = sub.add_parser("leave", help="decommission this node: withdraw, release the subnet, remove the node")
    config_args(sp)
    sp.add_argument("--timeout", type=seconds_arg, default=LEAVE_WAIT, metavar="SECONDS",
                    help=f"how long to wait for the running agent's whole leave (default {LEAVE_WAIT}, 1..3600)")
    sp.add_argument("--no-wait", action="store_true",
                    help="return once the node has left etcd; the agent goes on cleaning the host up (GET /leave)")

    sp = sub.add_parser("status", help="peer table, subnet, backend and routes of a running agent")
    sp.add_argument("--api", help=f"agent API URL (default $AGENTD_STATUS_URL, else {DEFAULT_API})")
    sp.add_argument("--json", action="store_true", help="print the raw /status JSON")

    sp = sub.add_parser("check-config", help="report every problem in a configuration without touching the system")
    config_args(sp)
    sp.add_argument("--show", action="store_true", help="print the effective configuration as JSON")
    sp.add_argument("--reload", action="store_true",
                    help="check for a reload of the running agent (systemctl reload): a [node] address the host "
                         "cannot give now is a warning, since a reload keeps the running one")

    if not full:
        return p
    sp = sub.add_parser("flows", help="flow records with their verdicts, like hubble observe (GET /flows)")
    add_flow_arguments(sp)
    config_args(sp)
    sp = sub.add_parser("ui", help="the browser view's address on this node, with its key (prints a URL)")
    config_args(sp)
    # Resources: agentd apply|get|delete|label, in agentd/resources/cli.py.
    from agentd.resources.cli import add_commands as add_resource_commands

    add_resource_commands(sub, config_args)

    # agentd docker-opts: a Docker daemon's bridge on this node's subnet (agentd/cni/docker_opts.py).
    from agentd.cni import docker_opts

    sp = sub.add_parser("docker-opts", help="the Docker daemon's --bip/--mtu/--ip-masq from the subnet file")
    docker_opts.add_arguments(sp)
    config_args(sp)

    # Commands other packages plug in (entry-point group "agentd.commands" in pyproject.toml):
    # `agentd lab` comes from the lab harness this way, so the agent never imports the lab.
    for name, command in plugin_commands().items():
        sp = sub.add_parser(name, help=command.help)
        command.add_arguments(sp)
        sp.set_defaults(plugin_command=command)
    return p


@dataclass(frozen=True)
class Command:
    """A sub-command another package adds to ``agentd`` (the lab's ``agentd lab``)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS_GROUP = "agentd.commands"


def plugin_commands() -> dict[str, Command]:
    """The installed ``agentd.commands`` entry points, by name."""
    from importlib.metadata import entry_points

    found: dict[str, Command] = {}
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        command = ep.load()
        if not isinstance(command, Command):
            raise TypeError(f"entry point {ep.name} = {ep.value} is not an agentd.cli.Command")
        found[ep.name] = command
    return found


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper())


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def _config_path(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, bool]:
    """The configuration file every command reads, by one rule: ``--config``, else
    ``$AGENTD_CONFIG``, else the default file.  Returns (path, named): a file named by the flag
    or the variable must exist; the default file may be missing (defaults and environment)."""
    if args.config is not None:
        if not args.config.strip():
            parser.error("argument --config: empty path")
        return args.config, True
    env = os.environ.get("AGENTD_CONFIG")
    if env is not None:
        if not env.strip():
            parser.error("AGENTD_CONFIG is set but empty: name a configuration file or unset it")
        return env, True
    return DEFAULT_CONFIG_PATH, False


def _load(args: argparse.Namespace, parser: argparse.ArgumentParser, *, host: HostFacts | None,
          check_files: bool = True, need_address: bool = True):
    """The configuration a command reads; ``check_files`` False for the commands that open none
    of the agent's own files (etcd's TLS files): their users need not be able to read them;
    ``need_address`` False: a node address the host cannot give is None (load_config)."""
    path, named = _config_path(args, parser)
    overrides = _overrides(args.set, parser)
    if getattr(args, "log_level", None):
        overrides["log.level"] = args.log_level
    return path, overrides, load_config(path, overrides=overrides, require_file=named, host=host,
                                        check_files=check_files, need_address=need_address)


def main(argv: list[str] | None = None) -> int:
    """``agentd``: every command, ``agentd lab`` included, ends quietly when its reader goes
    away (``agentd get pods -o yaml | head``: exit status 128 + SIGPIPE, what a shell reports
    for a tool that SIGPIPE killed) and on Ctrl-C (128 + SIGINT): no traceback, and no
    "Exception ignored" from the interpreter's last flush of stdout."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # buffered output meets a closed pipe here, not at exit
    except BrokenPipeError:
        return closed_stdout()
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def closed_stdout() -> int:
    """Stdout's reader is gone: point stdout at /dev/null, as Python's signal module docs
    advise ("Note on SIGPIPE"), so that nothing more fails on the way out."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return _dispatch(args, parser)
    except ConfigError as err:
        sys.stderr.write(f"agentd {args.command}: {err}\n")
        return 1


def _dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cmd = args.command
    if cmd == "check-config":
        path, named = _config_path(args, parser)
        overrides = _overrides(args.set, parser)
        if getattr(args, "log_level", None):
            overrides["log.level"] = args.log_level
        host: HostFacts = LocalHost()
        # --reload (the unit's ExecReload=): what the running agent's SIGHUP would refuse.  Its
        # reload takes [node] name, address and address_v6 as they were at its start
        # (RunningHost): the running agent's, asked on its local API (this host's now where none
        # answers), so a default route gone or moved at this moment fails only a start: a
        # warning here, not a problem.  Nor does a reload apply [api] token_group.
        checked = host
        if args.reload:
            checked, why = running_node(path, overrides, named)
            if checked is None:
                checked = host
                print(f"warning: {why}: [node] name and address checked as this host has them now, "
                      "not as the running agent's reload takes them", file=sys.stderr)
        problems = check_config(path, overrides=overrides, require_file=named, host=checked,
                                need_address=not args.reload, check_group=not args.reload)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            return 1
        if args.reload:
            for p in check_config(path, overrides=overrides, require_file=named, host=host):
                print(f"warning: a start would fail: {p} (a reload keeps the running [node] values)",
                      file=sys.stderr)
        cfg = load_config(path, overrides=overrides, host=checked, need_address=not args.reload)
        for line in config_warnings(cfg):
            print(f"warning: {line}", file=sys.stderr)
        if args.show:
            print(json.dumps(cfg.to_dict(), indent=2))
        elif os.path.exists(path):
            print(f"{path}: configuration OK")
        else:
            print(f"{path}: no such file; the defaults and the environment make a valid configuration")
        return 0
    named = "--api"
    if cmd in ("status", "flows") and args.api is None:  # the variable's, else the default
        env = os.environ.get("AGENTD_STATUS_URL")
        args.api, named = (DEFAULT_API, named) if env is None else (env, "AGENTD_STATUS_URL")
    if getattr(args, "api", None) is not None:
        problem = api_url_problem(args.api)
        if problem is not None:
            sys.stderr.write(f"agentd {cmd}: {named} {shown_url(args.api)!r}: {problem}\n")
            return 2
    if cmd == "status":
        return status_command(args.api, as_json=args.json)
    if cmd in ("flows", "ui"):  # [api] listen and token_file only: no host facts, no etcd (its TLS files
        # are root's: a token_group member, or anyone reading flows, runs these)
        _path, _overrides_, cfg = _load(args, parser, host=None, check_files=False)
        return flows_command(args, cfg.api.token_file) if cmd == "flows" else ui_command(cfg)
    if cmd in ("apply", "get", "delete", "label"):  # resources: agentd/resources/cli.py
        from agentd.resources import cli as resource_cli

        # etcd's endpoints and credentials only: no host facts (node name, address) are needed.
        _path, _overrides_, cfg = _load(args, parser, host=None)
        setup_logging(args.log_level or "warning")
        return resource_cli.run(args, cfg)
    if cmd == "docker-opts":
        from agentd.cni import docker_opts

        masq = cni = None
        if args.subnet_file is None:  # the configuration's: [cni] subnet_file (no host facts needed)
            cfg = _load(args, parser, host=None, check_files=False)[2]
            args.subnet_file, masq, cni = str(cfg.cni.subnet_file), cfg.network.ip_masq, cfg.cni
        return docker_opts.run(args, agent_masquerades=masq, cni=cni)
    plugin = getattr(args, "plugin_command", None)
    if plugin is not None:
        return plugin.run(args)
    if cmd == "leave":
        # Ask the running agent first: that needs [api] listen and the API token only, not the
        # agent's own files (etcd's TLS files, [api] read_token_file are root's; a token_group
        # member runs this) nor host facts. The daemon (and its imports), etcd's files and the
        # host's name and address are only needed to clean etcd up directly when no agent runs.
        cfg = _load(args, parser, host=None, check_files=False)[2]
        setup_logging(cfg.log.level, cfg.log.format)
        try:
            code = leave_running_agent(cfg.api.listen.host, cfg.api.listen.port, cfg.api.token_file,
                                       timeout=args.timeout, wait=not args.no_wait,
                                       report_path=Path(cfg.agent.state_dir) / "leave.json")
        except LeaveRefused as err:
            sys.stderr.write(f"agentd leave: {err}\n")
            return 1
        if code is not None:
            return code
        # Without an agent: the host's clean-up needs neither etcd's TLS files (a missing one fails
        # the etcd step alone) nor the node's address (the underlay device it finds the BPF data
        # path's wire program on; its pins name the devices too): what a killed agent left goes
        # even where etcd cannot be reached or the host has lost its default route.
        cfg = _load(args, parser, host=LocalHost(), check_files=False, need_address=False)[2]
        import uvloop

        from agentd.daemon import leave_report
        from agentd.daemon.agent import leave

        print(f"no agent answers at {cfg.api.listen.host}:{cfg.api.listen.port}: leaving without it", flush=True)
        report = uvloop.run(leave(cfg, on_step=lambda step: print(step.line(), flush=True)))
        print(leave_report.summary(report), flush=True)
        return leave_report.exit_code(report)
    if cmd in ("run", "speaker"):
        path, overrides, cfg = _load(args, parser, host=LocalHost())
        named = _config_path(args, parser)[1]  # a named file must still be there at a reload (SIGHUP)
        setup_logging(cfg.log.level, cfg.log.format)
        for line in config_warnings(cfg, nodes=cmd == "run"):  # the speaker has no sessions to nodes
            logging.getLogger("agentd").warning("%s", line)
        import uvloop

        if cmd == "speaker":
            from agentd.daemon.speaker import SpeakerRuntime

            read_once = [cfg.source is not None]

            def reload():
                # [node] name and address as at start (RunningHost): a reload must not fail
                # when the default route is gone at that moment, nor dump routes on the loop.
                # A file read once (named or the default one) must still be there: gone for a
                # moment, it is a failed reload, not the defaults (no peers).
                read = load_config(path, overrides=overrides, require_file=named or read_once[0],
                                   host=RunningHost(cfg))
                read_once[0] = read_once[0] or read.source is not None
                return read

            tune_gc()
            limit_malloc_arenas()
            return uvloop.run(SpeakerRuntime(cfg).run(reload=reload, set_logging=setup_logging))
        from agentd.daemon.agent import run_agent

        tune_gc()
        limit_malloc_arenas()
        return uvloop.run(run_agent(cfg, config_path=path, overrides=overrides, config_named=named,
                                    set_logging=setup_logging))
    parser.error(f"unknown command {cmd}")


LEAVE_WAIT = 60  # seconds `agentd leave` waits, by default, for the running agent's whole leave
LEAVE_POLL = 0.2  # seconds between two looks at its progress


RELOAD_ASK_WAIT = 2.0  # seconds `check-config --reload` waits for the running agent's /status


def running_node(path: str, overrides: dict[str, str], named: bool, *,
                 wait: float = RELOAD_ASK_WAIT) -> tuple[NodeFacts | None, str]:
    """The running agent's [node] values, asked at the file's [api] listen (as ``agentd leave``
    finds it; ``GET /status`` needs no token), within ``wait`` seconds; else None and why, in
    a few words: nothing answers, the answer is no agentd status, or the file cannot be read
    for its [api] listen (its problems are the check's to say)."""
    import urllib.error

    from agentd.config.values import BadValue, parse_node_name

    try:
        listen = load_config(path, overrides=overrides, require_file=named, check_files=False).api.listen
    except ConfigError:
        return None, "the running agent was not asked (no [api] listen read from a file with problems)"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(listen.host, listen.host)  # as `agentd ui`
    url = f"http://{'[' + host + ']' if ':' in host else host}:{listen.port}/status"
    try:
        status = fetch_json(url, timeout=wait, wait=wait)
    except urllib.error.HTTPError as err:
        err.close()
        return None, f"{url} answered HTTP {err.code}, not an agentd status"
    except (OSError, ValueError, RecursionError, http.client.HTTPException) as err:
        # (refused, no answer in time, cut short, no JSON, too long)
        reason = getattr(err, "reason", None) or err
        return None, f"no running agent answered at {url} ({server_text(_reason(reason), 200) or type(err).__name__})"
    node = status.get("node") if isinstance(status, dict) else None
    got = [node.get(key) if isinstance(node, dict) else 0 for key in ("name", "address", "address_v6")]
    try:
        if not all(isinstance(value, str) or (i and value is None) for i, value in enumerate(got)):
            raise TypeError
        name = parse_node_name(got[0])
        # "address": IPv4, or an IPv6-only node's IPv6 address (it has no IPv4 one, nor its
        # status None); "address_v6" is not in `agentd speaker`'s.
        v4 = got[1] if got[1] not in (None, "None") else None
        if v4 is not None and ":" in v4:
            IPv6Address(v4)
            v4 = None
        address = None if v4 is None else IPv4Address(v4)
        address_v6 = None if got[2] is None else IPv6Address(got[2])
    except (ValueError, TypeError, BadValue):
        name = None
    if name is None:
        return None, f"{url} did not answer with an agentd status (no [node] name and addresses)"
    return NodeFacts(name, address, address_v6), ""


def seconds_arg(text: str) -> float:
    """A ``--timeout``'s seconds, 1..3600 (``agentd leave``, ``agentd lab up`` and ``restart``)."""
    try:
        n = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
    if not 1 <= n <= 3600:  # also rejects nan and inf
        raise argparse.ArgumentTypeError(f"{text} is out of range 1..3600 seconds")
    return n


class LeaveRefused(Exception):
    """The running agent did not take ``agentd leave``'s request; the message says why."""


# Why a connection to the API could not be made: nothing took it (no agent runs there; what
# listens is looked at before a leave without the agent all the same: _agent_listens).  Any
# other failure came from something that took the connection (a reset, a close without an
# answer: a running agent whose connections are all taken, api.MAX_CONNECTIONS).
NOTHING_THERE = frozenset({errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL})


def _nothing_there(reason: object) -> bool:
    """Whether a URLError's ``reason`` says no connection was made: refused, no route, not an
    address here, the name unknown, or no answer to the connect in time (a full listen backlog
    looks so too: :func:`_agent_listens` tells)."""
    import socket

    if isinstance(reason, (socket.gaierror, TimeoutError)):
        return True
    return isinstance(reason, OSError) and reason.errno in NOTHING_THERE


def _reason(reason: object) -> str:
    return str(getattr(reason, "strerror", None) or reason)


def _closed_on_us(url: str, err: object) -> str:
    return (f"the agent's API at {url} took the connection but closed it without an answer "
            f"({server_text(_reason(err), 200) or 'busy?'}): "
            "all its connections taken? try again (nothing was done without the agent)")


def _agent_listens(host: str, port: int, token_file: Path) -> str | None:
    """Why no leave without the agent may run although nothing answered at ``host:port``: what
    listens there is root's or the agent's user's (the API token file's owner): an agent that
    is starting, stopping or stuck.  None when nothing listens there (or it cannot be told),
    or only another user's process (a squatter: no agent can have bound the port then)."""
    from agentd.daemon import listeners

    # The configured listen address is this host's (the agent binds it): a connection to it
    # reaches a wildcard listener on the port too, whether it is loopback or the node's own;
    # one to 0.0.0.0 or :: reaches loopback's; a name, each of its addresses in turn.
    uids: set[int] = set()
    for address in listeners.addresses(host):
        uids |= listeners.listener_owners(listeners.reached(address), port, wildcards=True) or set()
    ours = sorted(uids & {0, listeners.file_owner(token_file)})
    if not ours:
        return None
    return (f"a process of {listeners.user_name(ours[0])} listens on {host}:{port}: an agent starting, stopping or stuck? "
            "Not leaving without it while it may run: try again (stop it first if it does not answer)")


def leave_running_agent(host: str, port: int, token_file: Path, *, timeout: float = LEAVE_WAIT, wait: bool = True,
                        report_path: Path | None = None, out: Any = None) -> int | None:
    """POST /leave, with the API token of ``token_file``, to the agent on this host, then print
    every step of its leave with its result as it ends (GET /leave while its API is up, then
    the report file it writes, ``report_path`` unless the agent names another: it exits at the
    end) and the summary.  Returns the exit status (0: every step done or skipped), None if
    nothing takes the connection and no process of root's or the agent's user listens there
    (then, and only then, the leave runs without an agent); :class:`LeaveRefused` if it answers
    no, or takes the connection and closes it without an answer (a running agent with all its
    connections taken: not "no agent").  ``wait`` False: return once
    the node has left etcd; ``timeout``: how long to wait for the whole leave."""
    import http.client
    import urllib.error
    import urllib.request

    from agentd.daemon import leave_report as lr
    from agentd.daemon.auth import TokenFileError, bearer_header, read_token_file
    from agentd.daemon.listeners import squatter

    out = out if out is not None else sys.stdout
    deadline = time.monotonic() + timeout
    try:
        token, unreadable = read_token_file(token_file), None
    except TokenFileError as err:  # maybe no agent runs: asking tells
        token, unreadable = None, err
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/leave"
    # The configured listen address is this host's (loopback or the node's own): a wildcard
    # listener of another user on the port takes the connection as well.
    why = squatter(str(host), port, token_file, local=True) if token else None
    if why is not None:
        raise LeaveRefused(why)
    try:
        req = urllib.request.Request(url, method="POST", data=b"", headers=bearer_header(token) if token else {})
        # The agent answers once the node has left etcd (or could not): its releases and
        # removals wait up to 10 s each while etcd is unreachable.
        with api_open(req, timeout=timeout, deadline=deadline) as resp:
            answer = json.loads(read_answer(resp))
    except urllib.error.HTTPError as err:
        if unreadable is not None:
            err.close()
            raise LeaveRefused(f"an agent runs at {url}, but {unreadable}") from None
        raise LeaveRefused(f"the agent at {url} refused: {_api_error(err)}") from None
    except TimeoutError:  # connected, asked, no answer (a connect timeout is a URLError)
        where = f"GET {url} while it runs, then {report_path}" if report_path is not None else f"GET {url} while it runs"
        raise LeaveRefused(f"the agent at {url} took the request but did not answer within {timeout:g} s (its etcd "
                           f"step waits up to 20 s on an unreachable etcd): it may be leaving; see {where}") from None
    except urllib.error.URLError as err:  # the connection, or sending the request, failed
        if not _nothing_there(err.reason):  # accepted, then reset while the request went
            raise LeaveRefused(_closed_on_us(url, err.reason)) from None
        why = _agent_listens(str(host), port, token_file)
        if why is not None:
            raise LeaveRefused(f"nothing answered at {url} ({_reason(err.reason)}), but {why}") from None
        return None
    except (AnswerBrokeOff, http.client.IncompleteRead) as err:  # an answer cut short
        raise LeaveRefused(f"the answer of the agent at {url} broke off ({server_text(err)}): "
                           f"it may be leaving; see GET {url}") from None
    except (OSError, http.client.HTTPException) as err:  # accepted, then closed or reset before an answer
        raise LeaveRefused(_closed_on_us(url, err)) from None
    except (ValueError, RecursionError) as err:  # an answer that is no JSON, or too long (AnswerTooLarge)
        raise LeaveRefused(f"the agent at {url} answered, but not as an agent taking a leave: {server_text(err)}") from None
    if not isinstance(answer, dict) or answer.get("leaving") is not True:
        raise LeaveRefused(f"the agent at {url} answered, but not as an agent taking a leave: {server_text(answer, 200)}")

    def say(line: str) -> None:
        out.write(server_text(line, 2000) + "\n")  # the agent's words: one line each
        out.flush()

    etcd_error = answer.get("etcd_error")
    leave_id = answer.get("id")
    if isinstance(answer.get("report"), str) and answer["report"]:
        report_path = Path(answer["report"])
    if not isinstance(leave_id, str) or report_path is None:  # an agent from before leave reports
        step = lr.LeaveStep("leaving etcd", "failed" if etcd_error else "done", str(etcd_error or ""))
        say(step.line())
        # It removes its tables, routes and BPF data path and exits: wait until its API is gone.
        health = url[: -len("/leave")] + "/healthz"
        while wait and time.monotonic() < deadline:
            try:
                with api_open(health, timeout=1, deadline=min(deadline, time.monotonic() + 1)) as resp:
                    read_answer(resp, API_ERROR_MAX)
            except urllib.error.HTTPError as err:
                err.close()  # it answers (not healthy while stopping): still there
            except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
                break
            time.sleep(LEAVE_POLL)
        say("the agent reports none of its other steps (an older agentd): see its log for them")
        return 1 if etcd_error else 0
    if not wait:
        step = lr.LeaveStep("leaving etcd", "failed" if etcd_error else "done", str(etcd_error or ""))
        say(step.line())
        say(f"the agent goes on cleaning this host up: GET {url} while it runs, then {report_path}")
        return 1 if etcd_error else 0

    def from_api() -> lr.LeaveReport | None:
        """The report so far from GET /leave; None once the API no longer answers it."""
        now = time.monotonic()
        try:
            with api_open(url, timeout=5.0, deadline=max(now + 0.5, min(now + 5.0, deadline))) as resp:
                return lr.LeaveReport.from_json(json.loads(read_answer(resp)))
        except (urllib.error.URLError, OSError, ValueError, RecursionError, http.client.HTTPException):
            return None  # an HTTPError too (404: not leaving any more)

    printed, report, problem = 0, None, None
    while True:
        got = from_api()
        if got is None:  # the agent stopped its API: the end is in its report file
            try:
                got = lr.read_report(report_path)
                problem = None
            except lr.ReportError as err:
                if not err.missing:  # unreadable (permissions) or no report: waiting changes nothing
                    sys.stderr.write(f"agentd leave: the agent's API has stopped, and {err}\n")
                    return 1
                got, problem = None, str(err)
        if got is not None and got.id != leave_id:  # an older leave's file (this one's not written yet)
            got, problem = None, f"{report_path} is another leave's report (not the one of leave {leave_id})"
        if got is not None:
            report = got
            for step in report.steps[printed:]:
                say(step.line())
            printed = len(report.steps)
            if report.finished:
                say(lr.summary(report))
                return lr.exit_code(report)
        if time.monotonic() >= deadline:
            break
        time.sleep(LEAVE_POLL)
    if report is not None:
        say(lr.summary(report))
    sys.stderr.write(f"agentd leave: the agent had not finished leaving after {timeout:g} s"
                     + (f" ({problem})" if problem else "") +
                     f"; it may go on: GET {url} while it runs, then {report_path}\n")
    return 1


# ---------------------------------------------------------------- agentd flows

FLOW_FILTERS = ("pod", "from-pod", "to-pod", "namespace", "label", "verdict", "protocol", "port", "node", "ip",
                "event", "reason", "service")


def add_flow_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--api", help=f"agent API URL (default $AGENTD_STATUS_URL, else {DEFAULT_API})")
    sp.add_argument("--last", type=int, default=20, metavar="N", help="the last N matching records (default 20)")
    sp.add_argument("-f", "--follow", action="store_true", help="then every new one, until interrupted")
    sp.add_argument("-A", "--cluster", action="store_true", help="every node's records (the agent gathers them)")
    sp.add_argument("-o", "--output", choices=["text", "json"], default="text", help="json: one record per line")
    for name in FLOW_FILTERS:
        flags = [f"--{name}"] + (["-n"] if name == "namespace" else ["-l"] if name == "label" else [])
        sp.add_argument(*flags, action="append", default=[], dest=f"filter_{name.replace('-', '_')}",
                        metavar={"label": "KEY[=VALUE]", "pod": "NS/NAME", "from-pod": "NS/NAME",
                                 "to-pod": "NS/NAME", "service": "NS/NAME"}.get(name, name.upper()),
                        help="only records with these labels, all on one end (KEY or KEY=VALUE, comma-separated "
                             "or repeated: every one must hold)" if name == "label" else
                             f"only records whose {name} matches (repeat for any of several)")


def flows_command(args: argparse.Namespace, token_file: Path) -> int:
    """``agentd flows``: GET /flows, streamed; each record printed as it arrives.  What the
    agent gathers from other nodes (``-A``, ``--node``) needs the API token: its read-only key
    sent when this user can read ``token_file`` (root, ``[api] token_group``)."""
    import http.client
    import urllib.error
    import urllib.parse
    import urllib.request

    from agentd.daemon.auth import (
        TokenFileError,
        bearer_header,
        read_token_file,
        ui_key,
    )
    from agentd.daemon.listeners import is_local_host, squatter
    from agentd.flows.model import FilterError, FlowFilter
    from agentd.flows.render import line, notice

    pairs = [(name, v) for name in FLOW_FILTERS for v in getattr(args, f"filter_{name.replace('-', '_')}")]
    try:
        FlowFilter.parse(pairs)  # one clear line before asking anyone
        if not 0 <= args.last <= 100_000:
            raise FilterError(f"--last: {args.last} is out of range 0..100000")
    except FilterError as err:
        sys.stderr.write(f"agentd flows: {err}\n")
        return 2
    query = [*pairs, ("last", str(args.last))]
    if args.follow:
        query.append(("follow", "1"))
    if args.cluster:
        query.append(("cluster", "1"))
    url = args.api.rstrip("/") + "/flows?" + urllib.parse.urlencode(query)
    unreadable: TokenFileError | str | None
    try:
        # The token's read-only key (agentd/daemon/auth.py): all a reader needs, and it cannot POST.
        headers, unreadable = bearer_header(ui_key(read_token_file(token_file))), None
    except TokenFileError as err:  # needed only to gather from other nodes
        headers, unreadable = {}, err
    try:
        parsed = urllib.parse.urlsplit(args.api)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        # The key opens this host's agent alone: another host's has a token of its own, and
        # would be sent this one's key in clear.  Sent to this host's addresses only.
        if headers and not is_local_host(parsed.hostname or ""):
            headers, unreadable = {}, (f"{parsed.hostname} is not this host (this host's key is sent to no other: "
                                       "run agentd flows on that node)")
        why = squatter(parsed.hostname, port, token_file) if headers and parsed.hostname else None
    except ValueError as err:  # a port that cannot be checked is not sent the key (main checks --api first)
        why = f"{args.api}: cannot check who listens there ({err}): not sending it the API token"
    if why is not None:
        sys.stderr.write(f"agentd flows: {why}\n")
        return 1
    # Without -f, the whole stream within FLOWS_WAIT.  Followed, it has no end: each line within
    # FOLLOW_IDLE (the agent sends an empty line every 10 s on a quiet one; a host gone, or a
    # network partition, sends nothing, not even a FIN), the answer's head and its first line
    # within FLOWS_WAIT (-A: the last N come once gathered from the nodes).
    deadline = None if args.follow else time.monotonic() + FLOWS_WAIT
    lines = 0

    def idle() -> float:
        return FOLLOW_IDLE if lines else FLOWS_WAIT

    try:
        req = urllib.request.Request(url, headers=headers)
        resp = api_open(req, timeout=30, deadline=deadline, idle=idle if args.follow else None)
    except urllib.error.HTTPError as err:
        try:
            body = read_answer(err, API_ERROR_MAX).decode(errors="replace")
        except (OSError, ValueError, http.client.HTTPException):
            body = ""
        finally:
            err.close()
        try:
            body = json.loads(body).get("error", body)
        except (ValueError, AttributeError, RecursionError):
            pass
        if err.code == 401 and unreadable is not None:
            body = f"other nodes' records need the API token, and {unreadable}"
        sys.stderr.write(f"agentd flows: {url}: {err.code} {server_text(body)}\n")
        return 1
    except TimeoutError:  # (one in connecting is a URLError: below)
        sys.stderr.write(f"agentd flows: {args.api} did not answer within {FLOWS_WAIT:g} s\n")
        return 1
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as err:
        sys.stderr.write(f"agentd flows: cannot reach the agent at {args.api}: "
                         f"{server_text(getattr(err, 'reason', err))}\n")
        return 1
    errors = 0
    try:
        with resp:
            while raw := resp.readline(FLOW_LINE_MAX + 1):
                lines += 1
                if len(raw) > FLOW_LINE_MAX:
                    sys.stderr.write(f"agentd flows: {url} answered with a line of more than {FLOW_LINE_MAX} bytes: "
                                     "is that an agentd API?\n")
                    return 1
                if not raw.strip():
                    continue  # a keep-alive
                try:
                    record = json.loads(raw)
                except (ValueError, RecursionError):
                    sys.stderr.write(f"agentd flows: {url} answered, but not with JSON lines: is that an agentd API?\n")
                    return 1
                if not isinstance(record, dict):
                    sys.stderr.write(f"agentd flows: {url} answered, but not with flow records: is that an agentd API?\n")
                    return 1
                try:  # (printed outside: a closed pipe is main()'s, 141)
                    what = notice(record)
                    text = "" if what is not None else json.dumps(record) if args.output == "json" else line(record)
                except (TypeError, AttributeError, KeyError, ValueError, OverflowError, OSError, RecursionError) as err:
                    # OSError, OverflowError: a time localtime cannot give (EOVERFLOW)
                    sys.stderr.write(f"agentd flows: {url} answered with a record that is not an agentd flow record "
                                     f"({type(err).__name__}: {server_text(err)}): is that an agentd API?\n")
                    return 1
                if what is not None:
                    errors += "error" in record
                    sys.stderr.write(f"agentd flows: {what}\n")
                    continue
                print(text, flush=args.follow)
            broke = cut_short(resp)  # the agent died mid-stream: what was printed is not all
    except BrokenPipeError:  # our reader went (`| head`): main() ends quietly, 141
        raise
    except TimeoutError:
        if not args.follow:
            why = f"not whole within {FLOWS_WAIT:g} s"
        elif lines:
            why = f"no keep-alive within {FOLLOW_IDLE:g} s: the stream is gone"
        else:
            why = f"no line within {FLOWS_WAIT:g} s"
        sys.stderr.write(f"agentd flows: the stream from {args.api} broke: {why}\n")
        return 1
    except (http.client.HTTPException, OSError) as err:  # Ctrl-C is main()'s too: 130
        sys.stderr.write(f"agentd flows: the stream from {args.api} broke: {server_text(err)}\n")
        return 1
    if broke is not None:
        sys.stderr.write(f"agentd flows: the stream from {args.api} broke: {broke}\n")
        return 1
    return 1 if errors else 0  # some node could not be asked: what was printed is not everything


def ui_command(cfg: Any) -> int:
    """``agentd ui``: the address of the browser view on this node, with its key (the API
    token's read-only derivative, agentd/daemon/auth.py), for a browser here or through
    ``ssh -L 9099:127.0.0.1:9099 NODE``."""
    from agentd.daemon.auth import TokenFileError, read_token_file, ui_key

    try:
        token = read_token_file(cfg.api.token_file)
    except TokenFileError as err:
        sys.stderr.write(f"agentd ui: {err}\n")
        return 1
    # A wildcard listen address is reached at the loopback address of its family: the API on
    # [::] takes IPv6 alone (asyncio sets IPV6_V6ONLY), so 127.0.0.1 would be refused there.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(str(cfg.api.listen.host), str(cfg.api.listen.host))
    print(f"http://{'[' + host + ']' if ':' in host else host}:{cfg.api.listen.port}/ui/?key={ui_key(token)}")
    return 0


def _api_error(err: Any) -> str:
    """What an agent's error answer says (its JSON "error"), else the HTTP status: one line,
    at most :data:`API_ERROR_MAX` bytes of the answer read."""
    import http.client

    try:
        return server_text(json.loads(read_answer(err, API_ERROR_MAX))["error"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError, http.client.HTTPException):
        return f"HTTP {err.code} {server_text(err.reason, 100)}"
    finally:
        err.close()  # its connection, with what is left unread


# ---------------------------------------------------------------- agentd status


def api_url_problem(url: str) -> str | None:
    """Why ``url`` (``--api``) is no agent API URL, or None.  Checked before anything is sent:
    http.client would take port 74635 as 74635 % 65536 = 9099 (the API token then goes to
    whoever listens there, unchecked)."""
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(url)
        # (http.client would look the whole USER:PASSWORD@HOST up as the name.)  Before the
        # port's error, which would show a password with a "/" in it as the port.
        if "@" in url.partition("://")[2].partition("?")[0].partition("#")[0]:
            return ("a user or password in the URL is not for the agent's API, whose key comes from [api] "
                    "token_file: leave it out")
        port = parts.port
    except ValueError as err:  # "Port out of range 0-65535", "Port could not be cast to integer value"
        return f"the port must be a number 1..65535 ({err})"
    if parts.scheme not in ("http", "https"):
        return "expected http://HOST[:PORT] or https://HOST[:PORT]"
    if not parts.hostname:
        return "no host"
    if port is not None and not 1 <= port <= 65535:
        return f"the port must be a number 1..65535, not {port}"
    return None


def shown_url(url: str) -> str:
    """``url`` as a message shows it: whatever comes before its last ``@`` after ``://`` (a
    user and password, however malformed) left out."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        return f"{scheme}://***@{rest.rpartition('@')[2]}"
    return url


# What the commands read of an agent's answers.  Whatever answers at --api may be no agent: a
# body that never ends (4.5 GB read by `agentd status` before these), one that drips a byte at a
# time (each under the socket's timeout), text with newlines and escape sequences for the terminal.
API_BODY_MAX = 8 << 20  # bytes of an answer read whole (/status, /leave); a longer one is refused
API_ERROR_MAX = 64 << 10  # bytes of an error answer read (its JSON "error")
FLOW_LINE_MAX = 1 << 20  # bytes of one line of a /flows stream
SERVER_TEXT_MAX = 400  # characters of one text from a server shown (an error, a cell)
STATUS_WAIT = 10.0  # seconds `agentd status` waits for the whole /status answer
FLOWS_WAIT = 90.0  # seconds `agentd flows` (without -f) waits for the whole stream (the agent gathers
# from other nodes for 60 s at most: agentd.daemon.cluster.GATHER_TOTAL)
FOLLOW_IDLE = 25.0  # seconds `agentd flows -f` waits for a line: agentd.daemon.cluster.FOLLOW_IDLE,
# 2.5 keep-alive intervals


def server_text(value: Any, limit: int = SERVER_TEXT_MAX) -> str:
    """Text a server sent, fit for one line of the terminal: control characters (newlines,
    escape sequences) shown escaped, shortened to ``limit`` characters."""
    return shorten(one_line("" if value is None else str(value)), limit)


class AnswerTooLarge(ValueError):
    """An answer longer than the command reads (:data:`API_BODY_MAX`); the message says so."""


class AnswerBrokeOff(http.client.HTTPException):
    """An answer cut short (:func:`cut_short`); the message says how."""


def cut_short(resp: Any) -> str | None:
    """How a response whose reading has ended was cut short, or None: a chunked body whose last
    (empty) chunk never came, or one shorter than its Content-Length.  (http.client ends the
    reading quietly there: a stream cut by a dying agent looked whole.)"""
    if getattr(resp, "chunked", False) and getattr(resp, "chunk_left", None) is not None:
        return "it ended before its last chunk"
    left = getattr(resp, "length", None)
    if isinstance(left, int) and left > 0:
        return f"it ended {left} bytes short of its Content-Length"
    return None


def read_answer(resp: Any, limit: int = API_BODY_MAX) -> bytes:
    """A response's whole body, at most ``limit`` bytes (:class:`AnswerTooLarge` beyond), not
    cut short (:class:`AnswerBrokeOff`)."""
    length = getattr(resp, "length", None)
    if isinstance(length, int) and length > limit:
        raise AnswerTooLarge(f"{length} bytes, more than the {limit} read")
    data = resp.read(limit + 1)
    if len(data) > limit:
        raise AnswerTooLarge(f"more than {limit} bytes")
    if (why := cut_short(resp)) is not None:
        raise AnswerBrokeOff(f"{why} ({len(data)} bytes read)")
    return data


class _DeadlineReads:
    """Every receive of a connected socket waits only until ``_deadline`` (time.monotonic):
    the whole answer -- status line, headers, body -- within one bound, however slowly it
    trickles in; and each within ``_idle()`` seconds where that is set (a followed stream, which
    has no end).  http.client reads through ``recv_into`` (its socket file); a TLS socket's
    read waits at most its timeout in all (CPython's ssl module), so the bound holds there too."""

    _deadline: float  # inf: none
    _idle: Callable[[], float] | None = None

    def _wait_left(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        if self._idle is not None:
            left = min(left, self._idle())
        self.settimeout(left)  # type: ignore[attr-defined]

    def recv_into(self, *args: Any, **kwargs: Any) -> int:
        self._wait_left()
        return super().recv_into(*args, **kwargs)  # type: ignore[misc]

    def recv(self, *args: Any, **kwargs: Any) -> bytes:
        self._wait_left()
        return super().recv(*args, **kwargs)  # type: ignore[misc]


class _DeadlineSocket(_DeadlineReads, socket.socket):
    """A plain (http://) connection's socket under :class:`_DeadlineReads`."""

    def __init__(self, sock: Any, deadline: float, idle: Callable[[], float] | None = None) -> None:
        timeout = sock.gettimeout()
        super().__init__(sock.family, sock.type, sock.proto, fileno=sock.detach())
        self._deadline, self._idle = deadline, idle
        if deadline != NO_DEADLINE:  # sending the request too (else the connection's timeout)
            timeout = max(0.001, deadline - time.monotonic())
        self.settimeout(timeout)


NO_DEADLINE = float("inf")


def api_open(req: Any, timeout: float | None, *, deadline: float | None = None,
             idle: Callable[[], float] | None = None) -> Any:
    """``urlopen`` for an agent's API: straight to the address given, never through
    ``http_proxy`` (the API token must not go to a proxy), and no redirect followed (urllib
    would send the Authorization header on to wherever it points): a 3xx is an HTTPError.
    ``deadline`` (time.monotonic), for http:// and https:// URLs alike: the connection, the
    answer's head and every read of its body end by then (:class:`TimeoutError`), not only each
    read within ``timeout``.  ``idle``: each read of the answer (its head too) within ``idle()``
    seconds, asked before each one."""
    import urllib.error
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
            raise urllib.error.HTTPError(req.full_url, code, f"a redirect to {server_text(newurl, 100)}, not "
                                         "followed (an agent's API does not redirect)", headers, fp)

    handlers: list[Any] = [urllib.request.ProxyHandler({}), NoRedirect()]
    if deadline is not None or idle is not None:
        end = NO_DEADLINE if deadline is None else deadline
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            timeout = left if timeout is None else min(timeout, left)

        class Connection(http.client.HTTPConnection):
            def connect(self) -> None:
                super().connect()
                self.sock = _DeadlineSocket(self.sock, end, idle)

        class DeadlineHandler(urllib.request.HTTPHandler):
            def http_open(self, req: Any) -> Any:
                return self.do_open(Connection, req)

        handlers.append(DeadlineHandler())
        if hasattr(http.client, "HTTPSConnection"):  # (a Python built without ssl has no https)
            import ssl

            class DeadlineSSLSocket(_DeadlineReads, ssl.SSLSocket):
                _deadline = end
                _idle = None if idle is None else staticmethod(idle)

            class TLSConnection(http.client.HTTPSConnection):
                def __init__(self, *args: Any, **kwargs: Any) -> None:
                    super().__init__(*args, **kwargs)
                    # The connection's own context (a new default one: certificates checked as
                    # before), whose wrap_socket makes the TLS socket of that class.
                    self._context.sslsocket_class = DeadlineSSLSocket  # type: ignore[attr-defined]

            class DeadlineTLSHandler(urllib.request.HTTPSHandler):
                def https_open(self, req: Any) -> Any:
                    return self.do_open(TLSConnection, req)

            handlers.append(DeadlineTLSHandler())
    opener = urllib.request.build_opener(*handlers)
    return opener.open(req, timeout=timeout)


def fetch_json(url: str, timeout: float = 5.0, *, wait: float | None = None) -> Any:
    """GET ``url``'s JSON: each read within ``timeout``, the whole answer within ``wait``
    seconds (:data:`STATUS_WAIT` by default), at most :data:`API_BODY_MAX` bytes."""
    deadline = time.monotonic() + (STATUS_WAIT if wait is None else wait)
    with api_open(url, timeout=timeout, deadline=deadline) as resp:
        return json.loads(read_answer(resp))


def status_command(api: str, *, as_json: bool = False) -> int:
    import http.client
    import urllib.error

    url = api.rstrip("/") + "/status"
    try:
        status = fetch_json(url)
    except (json.JSONDecodeError, RecursionError) as err:  # (JSON nested too deep to read)
        sys.stderr.write(f"agentd status: {url} answered, but not with JSON ({server_text(err)}): "
                         "is that an agentd API?\n")
        return 1
    except AnswerTooLarge as err:
        sys.stderr.write(f"agentd status: {url} answered with {err}: is that an agentd API?\n")
        return 1
    except TimeoutError:  # (one in connecting is a URLError: below)
        sys.stderr.write(f"agentd status: {url} did not answer whole within {STATUS_WAIT:g} s\n")
        return 1
    except (AnswerBrokeOff, http.client.IncompleteRead) as err:  # (IncompleteRead: a chunk cut)
        sys.stderr.write(f"agentd status: the answer from {url} broke off: {server_text(err)}\n")
        return 1
    except urllib.error.HTTPError as err:
        sys.stderr.write(f"agentd status: {url}: {_api_error(err)}\n")
        return 1
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        sys.stderr.write(f"agentd status: cannot reach the agent at {url}: {server_text(reason)}\n")
        return 1
    if not isinstance(status, dict) or not isinstance(status.get("node"), dict):  # --json too
        sys.stderr.write(f"agentd status: {url} did not answer with an agentd status (no 'node' object)\n")
        return 1
    if as_json:
        print(json.dumps(status, indent=2))
        return 0
    try:
        text = render_status(status)
    except (TypeError, KeyError, AttributeError, ValueError, OverflowError, OSError) as err:  # OSError: a time
        # localtime cannot give (EOVERFLOW)
        sys.stderr.write(f"agentd status: {url} did not answer with an agentd status "
                         f"({type(err).__name__}: {server_text(err)})\n")
        return 1
    print(text)
    return 0


def _cell(value: Any) -> str:
    """A table cell, or a field of a status line: text from the agent, with control characters
    (newlines, escapes) shown escaped, at most :data:`SERVER_TEXT_MAX` characters."""
    text = "" if value is None else str(value)
    return shorten(text if text.isprintable() else text.encode("unicode_escape").decode("ascii"), SERVER_TEXT_MAX)


def _since(ts: float | None) -> str:
    if not ts:
        return "-"
    t = time.localtime(ts)
    if time.time() - ts < 86400:
        return time.strftime("%H:%M:%S", t)
    return time.strftime("%Y-%m-%d", t)


def _datapath(peer: dict[str, Any]) -> str:
    """How this node carries the peer's traffic: kernel route, vxlan device, bpf (with the
    packets the BPF maps counted), user space."""
    label = peer.get("datapath") or "-"
    c = peer.get("counters")
    if c:
        label += f" (tx {c.get('tx_packets', 0)} rx {c.get('rx_packets', 0)} pkts)"
    return label


def _backend(peer: dict[str, Any]) -> str:
    """The peer's backend, and how its IPv6 pods are reached where that differs (dual-stack)."""
    label = peer.get("backend") or "-"
    v6 = peer.get("backend_v6")
    if "backend_v6" in peer and v6 != peer.get("backend"):
        label += f" (IPv6: {v6 or '-'})"
    return label


def _unknown_endpoints(unknown: Any) -> str:
    """The status line's warning of endpoint files never read (their pods unknown to policy)."""
    if not isinstance(unknown, list) or not unknown:
        return ""
    return f"  UNKNOWN PODS {len(unknown)} (endpoint files never read: {_cell(', '.join(map(str, unknown[:3])))}{' ...' if len(unknown) > 3 else ''})"


def _unchecked_macs(unchecked: Any) -> str:
    """The status line's warning of local pods whose source MAC is not checked (not known)."""
    if not isinstance(unchecked, dict) or not unchecked:
        return ""
    names = ", ".join(map(str, sorted(unchecked)[:3]))
    return f"  MAC UNCHECKED {len(unchecked)} ({_cell(names)}{' ...' if len(unchecked) > 3 else ''})"


def _refused_macs(refused: Any) -> str:
    """The status line's warning of local pods cut off: the MAC read from their interface was refused."""
    if not isinstance(refused, dict) or not refused:
        return ""
    names = ", ".join(map(str, sorted(refused)[:3]))
    return f"  MAC REFUSED {len(refused)} ({_cell(names)}{' ...' if len(refused) > 3 else ''})"


def _fast_path_line(fast: dict[str, Any]) -> str:
    """The pod fast path (docs/policy.md): on where, and what it carried; or why it is off."""
    if not fast.get("on"):
        return f"Pod fast path off: {_cell(fast.get('error') or 'not running')}"
    between = fast.get("between_nodes") or {}
    where = "same node and between nodes" if between.get("on") else (
        f"same node only (between nodes: {_cell(between.get('why_not') or 'off')})")
    packets = fast.get("packets") or {}
    v6 = fast.get("ipv6") or {}
    ipv6 = f" (IPv6: carried {(v6.get('packets') or {}).get('carried', 0)}, pods {v6.get('pods', 0)})" \
        if v6.get("pods") else ""
    return f"Pod fast path on, {where}  carried {packets.get('carried', 0)} packets  pods {fast.get('pods', 0)}{ipv6}"


def _flows_line(flows: dict[str, Any]) -> str:
    """Flow records (docs/observability.md): what is recorded and how full the ring is; or why
    nothing is."""
    if not flows.get("on"):
        return f"Flows off: {_cell(flows['error'])}" if flows.get("error") else "Flows not on yet (starting)"
    what = "connections and drops" if flows.get("connections", True) else "drops only ([flows] connections = false)"
    lost = sum(v for v in (flows.get("lost") or {}).values() if isinstance(v, int))
    return (f"Flows on: {what}  records {flows.get('records', 0)} of {flows.get('ring_size', 0)}"
            f"{f'  LOST {lost} events' if lost else ''}")


def _ingress_line(ing: dict[str, Any]) -> str:
    """The ingress proxy (docs/ingress.md): where it listens, its PIDs, reloads and restarts."""
    where = ", ".join(_cell(a) for a in ing.get("addresses") or []) or "-"
    state = f"HAProxy pid {ing.get('pid')} worker {ing.get('worker')}" if ing.get("running") else "proxy NOT RUNNING"
    error = ing.get("error") or ing.get("settings_error")
    tls = "".join(f"\n  TLS Secret {_cell(secret)}: {_cell(why)}" for secret, why in sorted((ing.get("tls_errors") or {}).items()))
    alog = ing.get("access_log") or {}
    if alog.get("error"):
        tls += f"\n  access log {_cell(alog.get('to'))}: {_cell(alog['error'])} ({alog.get('dropped', 0)} lines dropped)"
    return (f"Ingress on {where} (http {ing.get('http_port')}, https {ing.get('https_port')})  {state}"
            f"  ingresses {ing.get('ingresses', 0)}  reloads {ing.get('reloads', 0)}  restarts {ing.get('restarts', 0)}"
            f"{'  ERROR ' + _cell(error) if error else ''}{tls}")


def _worker_lines(backends: dict[str, Any]) -> list[str]:
    """User-space data-plane workers that are down (died and could not be started again; the
    agent tries every 2 s): one line each, with the error /status gives."""
    workers = [(b, w, "") for b, w in (backends.get("active") or {}).items()] + [
        (b, w, " for peers that receive in user space") for b, w in (backends.get("userspace_peers_worker") or {}).items()]
    return [f"Data-plane worker {_cell(b)}{what} DOWN: {_cell(w.get('error') or 'not running')}"
            for b, w, what in workers if isinstance(w, dict) and w.get("running") is False]


def _printable(value: Any, depth: int = 0) -> Any:
    """``value`` (JSON) with every string in it, keys too, one line (:func:`_cell`): nothing an
    answer holds reaches the terminal as a control character, whatever field it is in."""
    if isinstance(value, str):
        return _cell(value)
    if depth > 50:  # (json.loads refuses deeper nesting than the interpreter's recursion limit anyway)
        raise ValueError("nested too deep")
    if isinstance(value, dict):
        return {_cell(k) if isinstance(k, str) else k: _printable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable(v, depth + 1) for v in value]
    return value


def render_status(status: dict[str, Any]) -> str:
    status = _printable(status)
    node = status.get("node") or {}
    bgp = status.get("bgp") or {}
    routes = status.get("routes") or {}
    ds = status.get("datastore") or {}
    out = []
    state = "ready" if status.get("ready") else "not ready"
    problems = [p for p in status.get("problems") or [] if p]
    out.append(f"agentd is running ({state}{', DEGRADED' if problems else ''}).")
    out += [f"PROBLEM: {_cell(p)}" for p in problems]  # start-up failures it runs without (not retried)
    out += _worker_lines(status.get("backends") or {})  # a dead worker not started again (/healthz 503)
    out.append(
        f"Node {_cell(node.get('name'))}  address {_cell(node.get('address'))}"
        f"{'  ' + _cell(node['address_v6']) if node.get('address_v6') and node['address_v6'] != node.get('address') else ''}"
        f"  AS {_cell(node.get('asn'))}{'  route reflector' if node.get('route_reflector') else ''}"
    )
    subnets = [s for s in dict.fromkeys((node.get("subnet"), node.get("subnet_v6"))) if s]
    out.append(f"Subnet{'s' * (len(subnets) > 1)} {'  '.join(map(_cell, subnets)) or '-'}  backend {_cell(node.get('backend') or '-')}")
    # A dedicated reflector (agentd speaker) programs no routes and uses no etcd by design: its
    # Loc-RIB's size, and "datastore -" (no endpoints), not an alarm that is not real.
    if "loc_rib_prefixes" in bgp:
        done = f"Loc-RIB {_cell(bgp['loc_rib_prefixes'])} prefixes"
    else:
        done = f"Routes programmed {_cell(routes.get('programmed', 0))}  last sync {_since(routes.get('last_sync'))}"
    datastore = "-" if ds.get("endpoints") == [] else "connected" if ds.get("connected") else "DISCONNECTED"
    out.append(
        f"{done}  datastore {datastore}"
        f"{' (' + _cell(ds['endpoint']) + ')' if len(ds.get('endpoints') or []) > 1 and ds.get('endpoint') else ''}"
    )
    policy = status.get("policy")  # NetworkPolicy
    if isinstance(policy, dict):
        iso = policy.get("isolated") or {}
        out.append(
            f"Policy {policy.get('policies', 0)} policies  local pods {policy.get('local_pods', 0)}"
            f"  isolated {iso.get('any', 0)} (ingress {iso.get('ingress', 0)}, egress {iso.get('egress', 0)})"
            f"{'  ERROR ' + _cell(policy['error']) if policy.get('error') else ''}"
            f"{_unknown_endpoints(policy.get('unknown_endpoints'))}"
            f"{_unchecked_macs(policy.get('unchecked_macs'))}"
            f"{_refused_macs(policy.get('refused_macs'))}"
        )
        fast = policy.get("fast_path")
        if isinstance(fast, dict):
            out.append(_fast_path_line(fast))
    flows = status.get("flows")  # flow records
    if isinstance(flows, dict):
        out.append(_flows_line(flows))
    ingress = status.get("ingress")  # Ingress
    if isinstance(ingress, dict):
        out.append(_ingress_line(ingress))
    # Programs on agentd's tcx hooks it could not tell its own or anyone's (docs/operations.md).
    bpf = (status.get("backends") or {}).get("bpf") or {}
    fast = (policy or {}).get("fast_path") if isinstance(policy, dict) else None
    unidentified = {*(bpf.get("unidentified_programs") or []), *((fast or {}).get("unidentified_programs") or [])}
    out += [f"BPF: {_cell(line)}" for line in sorted(unidentified)]
    out.append("")
    for family, label in (("ipv4", "IPv4"), ("ipv6", "IPv6")):
        peers = [p for p in bgp.get("peers", []) if (":" in p["address"]) == (family == "ipv6")]
        if not peers and (family == "ipv6" or bgp.get("peers")):  # an IPv6-only node has no IPv4 sessions
            continue
        out.append(f"{label} BGP status")
        rows = []
        for p in peers:
            established = p.get("state") == "Established"
            info = p.get("state", "")
            if not established and p.get("info"):
                info += f" ({p['info']})"
            rows.append(
                [
                    _cell(p["address"]),
                    _cell(p.get("description") or p.get("type", "")),
                    "up" if established else "down",
                    _since(p.get("since")),
                    _cell(_backend(p)),
                    _cell(_datapath(p)),
                    _cell(info),
                ]
            )
        out.append(render_table(["PEER ADDRESS", "PEER TYPE", "STATE", "SINCE", "BACKEND", "DATA PATH", "INFO"], rows))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    # ``python -m agentd.cli``: this file runs as ``__main__``, a second copy of the module beside
    # the ``agentd.cli`` that plugged-in commands import (``agentd lab``'s Command would not be
    # this copy's Command).  Run the one ``agentd.cli``, as the installed ``agentd`` does.
    from agentd.cli import main as _main

    sys.exit(_main())
