"""The docs' commands paste into a root shell as written: no ``sudo`` in front (a root box
need not have sudo; a sudo user is told once, in prose, to put it in front), and every
``agentd ...`` they show is one agentd's argument parser accepts."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from agentd import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A command line in an indented block or a fenced block, or a command in backticks.
SUDO = re.compile(r"^(?: {4,}|\t)\s*sudo\s|`sudo \S")


def test_no_command_starts_with_sudo():
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in DOCS for n, line in enumerate(path.read_text().splitlines(), 1)
             if SUDO.search(line) and "put `sudo`" not in line]
    assert not found, "\n".join(found)


def _section(text: str, heading: str) -> str:
    assert heading in text, heading
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def test_a_docker_host_leaves_with_the_drop_in_that_would_start_the_agent_removed():
    """docker.md's drop-in has Wants=agentd.service: after `agentd leave` and `systemctl
    disable agentd` a Docker restart or a boot started the agent again, and the node joined
    again.  Both leave instructions say to remove the drop-in (before the leave)."""
    docker = (ROOT / "docs" / "docker.md").read_text()
    ops = (ROOT / "docs" / "operations.md").read_text()
    drop_ins = re.findall(r"^ +# (/etc/systemd/system/docker\.service\.d/\S+)\n +\[Unit\]\n(?: +\S.*\n)*?"
                          r" +Wants=agentd\.service$", docker, re.MULTILINE)
    assert drop_ins, "the drop-in with Wants=agentd.service is not where this test looks"
    out = _section(docker, "## Taking a Docker host out of the cluster")
    commands = [line.split("#")[0].strip() for line in out.splitlines() if line.startswith("    ")]
    assert commands.index("agentd leave") < commands.index("systemctl disable agentd")
    assert all(commands.index(f"rm {path}") < commands.index("agentd leave") for path in set(drop_ins))
    leave = ops[ops.index("Then `systemctl disable agentd`"):][:800]
    assert "docker.md#taking-a-docker-host-out-of-the-cluster" in leave and "drop-in" in leave


def test_the_daemon_json_route_still_orders_docker_after_the_agent():
    """The daemon.json alternative had no ordering: Docker could start before the agent turned
    forwarding on (and set FORWARD to DROP)."""
    docker = (ROOT / "docs" / "docker.md").read_text()
    start = docker.index("Or merge the JSON into daemon.json")
    after = docker[start:docker.index("\n3. ", start)]
    assert "After=agentd.service" in after


def test_the_docker_drop_in_keeps_the_operators_docker_opts_and_names_each_packages_dockerd():
    """The drop-in wrote agentd's options as DOCKER_OPTS, read after Debian's
    /etc/default/docker: the operator's own DOCKER_OPTS (--dns, --insecure-registry) were
    silently replaced.  And its ExecStart's /usr/sbin/dockerd is Debian's: Docker CE's is
    /usr/bin/dockerd (docker.service failed with 203/EXEC)."""
    docker = (ROOT / "docs" / "docker.md").read_text()
    drop_in = docker[docker.index("[Service]\n        ExecStartPre=/usr/local/bin/agentd docker-opts"):]
    pre = re.search(r"ExecStartPre=/usr/local/bin/agentd docker-opts (.*)", drop_in)
    assert pre is not None
    key = re.search(r"--key (\w+)", pre.group(1))
    assert key is not None and key.group(1) != "DOCKER_OPTS", pre.group(0)
    starts = re.findall(r"^ +ExecStart=(\S+) (.*)$", drop_in[:3000], re.MULTILINE)
    assert {path for path, _ in starts} == {"/usr/sbin/dockerd", "/usr/bin/dockerd"}, starts
    for path, args in starts:  # agentd's variable on each; Debian's keeps the operator's DOCKER_OPTS
        assert f"${key.group(1)}" in args.split()
        assert ("$DOCKER_OPTS" in args.split()) == (path == "/usr/sbin/dockerd")



# ------------------------------------------------------------------ agentd command lines

# Where a code line runs agentd: at the start of a command (of the line, after |, && or ;), after
# `<compose> exec <service>`, in `agentd lab exec ... -- <command>` / `sh -c '<commands>'`, and
# in a unit's (a drop-in's) Exec*= line.
UNIT_EXEC = re.compile(r"^Exec\w+=[-+@:!]*")
AGENTD_RUN = re.compile(r"(?:^|^Exec\w+=[-+@:!]*|[|;&]\s*|\bexec\s+\S+\s+|--\s+|sh -c ')(?:\S*/)?agentd(?:\s|$)")
# A documented `agentd ...` that is no command line, and why it is not parsed (each rule must
# still match something, below).
NOT_COMMANDS = {
    "a message agentd prints (its command's name and a colon)": re.compile(r"^agentd [\w-]+:"),
    "`agentd status` output": re.compile(r"^agentd is running\b"),
    "a table row: the command, then 2+ spaces and a description (README's command list) or "
    "figures (ingress.md's benchmark, where agentd ingress is the proxy measured)": re.compile(r"^agentd(?: \S+)+ {2,}[^#\s-]"),
    "a usage synopsis ([optional], a|b): grammar, not a line to run": re.compile(r"(?:^|\s)\[|\S\|\S"),
    "a list of commands (agentd apply/get/delete)": re.compile(r"^agentd [\w-]+/|\s/\s"),
    "a benchmark row's name (bench/README.md's `agentd vxlan`: the lab's vxlan backend)": re.compile(r"^agentd vxlan\b"),
}
# Placeholders, given sample values so that the command around them is parsed all the same.
SAMPLES = [
    (re.compile(r"-- <command>"), "-- true"),
    (re.compile(r"<[\w' -]+>"), "sample"),
    (re.compile(r"\bNS/(?:NAME|POD)\b"), "shop/web"),
    (re.compile(r"\bKIND\b"), "pods"),
    (re.compile(r"\$\w+"), "1"),  # a shell loop's variable (for n in 1 2 3: node$n)
    (re.compile(r"(?<!\S)\.\.\.(?!\S)"), ""),  # "and so on"
]
SHELL_OPERATORS = re.compile(r"^(?:\|\|?|&&?|;|[0-9]?[<>]+&?[0-9]?)$")


def _code_lines(text: str) -> list[tuple[int, str]]:
    """The lines of fenced and indented (4 spaces or more) code blocks, a line continued with a
    backslash joined to the next, without a `$ ` or `# ` prompt."""
    out: list[tuple[int, str]] = []
    fenced, pending = False, None
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not (fenced or line.startswith("    ")):
            pending = None
            continue
        line = line.strip()
        if pending is not None:
            n, line = pending[0], pending[1] + " " + line
        if line.endswith("\\"):
            pending = (n, line[:-1].rstrip())
            continue
        pending = None
        out.append((n, re.sub(r"^[$#] (?=\S)", "", line)))
    return out


def _why_not_a_command(text: str) -> str | None:
    """``text`` from its `agentd` on: the NOT_COMMANDS reason it is no command line, if any."""
    own = re.split(r"\s(?:\||&&|;|#)\s", text)[0]  # the rule is about agentd's words, not a pipe's
    return next((why for why, rule in NOT_COMMANDS.items() if rule.search(own)), None)


def _agentd_commands(line: str) -> list[list[str]]:
    """The argument lists of the agentd commands in shell line ``line`` (where AGENTD_RUN says)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    found: list[list[str]] = []
    command: list[str] = []
    for word in [*lexer, ";"]:
        if not SHELL_OPERATORS.match(word):
            command.append(word)
            continue
        while command and re.match(r"^[A-Z_]+=", command[0]):  # VAR=value before the command
            command.pop(0)
        exec_at = command.index("exec") if "exec" in command else -9
        if command[:2] == ["sh", "-c"] and len(command) > 2:
            found += _agentd_commands(command[2])
        elif command and re.search(r"(?:^|/)agentd$", command[0]):
            found.append(command[1:])
            if command[1:3] == ["lab", "exec"] and "--" in command:
                found += _agentd_commands(shlex.join(command[command.index("--") + 1:]))
        elif re.search(r"(?:^|/)agentd$", (command[exec_at + 2:] or [""])[0]):
            found.append(command[exec_at + 3:])
        command = []
    return found


def _documented_agentd() -> tuple[list[tuple[str, str, list[str]]], list[tuple[str, str, str]]]:
    """Every agentd command the docs show: (where, text, arguments) of those to parse, with "span"
    or "line" in where; and (where, text, reason) of the excluded."""
    found, excluded = [], []
    for path in DOCS:
        text, name = path.read_text(), path.relative_to(ROOT)
        places = [(f"{name}:{n} line", line) for n, line in _code_lines(text) if AGENTD_RUN.search(line)]
        places += [(f"{name}:{text.count(chr(10), 0, m.start()) + 1} span", m[1])
                   for m in re.finditer(r"`((?:\S*/)?agentd(?: [^`]*)?)`", text)]
        for where, shown in places:
            start = AGENTD_RUN.search(shown)
            why = _why_not_a_command(re.sub(r"^\S*/?agentd", "agentd", shown[start.start():].lstrip("|;& ")))
            if why:
                excluded.append((where, shown, why))
                continue
            shown = UNIT_EXEC.sub("", shown)
            for rule, sample in SAMPLES:
                shown = rule.sub(sample, shown)
            found += [(where, shown, argv) for argv in _agentd_commands(shown)]
    return found, excluded


def _parse(argv: list[str]) -> tuple[int, str]:
    """agentd's argument parser on ``argv``, nothing run: exit status (0: parsed) and message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            cli.build_parser(full=True).parse_args(argv)
    except SystemExit as stop:  # a usage error (2), or --help and --version (0)
        return int(stop.code or 0), err.getvalue().strip()
    return 0, ""


def test_every_agentd_command_in_the_docs_parses():
    """Every `agentd ...` the docs show, in a code block or in backticks in the text, is accepted
    by agentd's argument parser (parsed only: nothing runs).  troubleshooting.md told operators
    to run `agentd get pods -n shop -o wide`: invalid choice 'wide', exit 2.  A span in the text
    may leave out the operands its command needs (`agentd get`, `agentd label pod`, `agentd
    apply -f`): for spans, "the following arguments are required" and "expected one argument"
    are no failure, every other error is.  Placeholders
    get sample values (SAMPLES); what is excluded, and why, is NOT_COMMANDS."""
    found, excluded = _documented_agentd()
    assert len(found) > 50, found  # the docs' commands were found at all
    assert not any("--help" in argv for _, _, argv in found)  # --help would print, not parse
    rejected = []
    for where, shown, argv in found:
        code, message = _parse(argv)
        if code and not (where.endswith("span") and re.search(r"arguments are required|expected one argument", message)):
            rejected.append(f"{where}: {shown}\n    {message}")
    assert not rejected, "\n".join(rejected)
    # Every exclusion still stands for something the docs show (and nothing else is left out).
    assert {why for _, _, why in excluded} == set(NOT_COMMANDS), excluded


# ------------------------------------------------------------------ the upgrade's one-liner


def _status_with_workers(active_pid: int | None, beside_bpf_pid: int | None) -> dict:
    """A /status whose backends part is what the agent makes (Tunnels.status() of the
    backends' status()): udp in user space (a worker, ``active_pid``) or in BPF, and, with
    ``beside_bpf_pid``, the worker beside BPF for peers that receive ipip in user space."""
    from types import SimpleNamespace

    from agentd.dataplane.backends import _Worker
    from agentd.dataplane.bpf_backend import InBpf

    def worker(kind: str, pid: int) -> dict:  # a worker re-attached after a restart: its pid from its stats
        return _Worker.status(SimpleNamespace(datapath="userspace", device=f"agentd.{kind}", client=object(),
                                              error=None, process=None, last_stats={"pid": pid}))

    in_bpf = InBpf.status(SimpleNamespace(datapath="bpf", t=SimpleNamespace(
        bpf=SimpleNamespace(dp=None), underlay=SimpleNamespace(ifname="eth0"))))
    return {"node": {"name": "n1"}, "backends": {
        "own": "udp", "active": {"udp": worker("udp", active_pid) if active_pid else in_bpf}, "failed": {},
        "userspace_peers_worker": {"ipip": worker("ipip", beside_bpf_pid)} if beside_bpf_pid else {},
        "userspace_peers_worker_failed": {}}}


@pytest.mark.parametrize("active_pid, beside_bpf_pid", [(4141, None), (None, 4242), (None, None)])
def test_the_upgrade_one_liner_prints_every_worker_pid(active_pid, beside_bpf_pid):
    """operations.md's upgrade: the command that prints the user-space workers' pids to kill, run
    as the page shows it on a /status.  It read backends.active alone: on a BPF node with peers
    that receive in user space it printed {'udp': None}, and the worker beside BPF
    (backends.userspace_peers_worker) kept running the old code."""
    ops = (ROOT / "docs" / "operations.md").read_text()
    upgrade = ops[ops.index("**Upgrade**"):]
    (line,) = [line for _, line in _code_lines(upgrade)[:2] if line.startswith("agentd status --json | ")]
    reader = shlex.split(line.split(" | ", 1)[1])
    assert reader[:2] == ["python3", "-c"] and len(reader) == 3, reader
    status = _status_with_workers(active_pid, beside_bpf_pid)
    proc = subprocess.run([sys.executable, "-c", reader[2]], input=json.dumps(status), capture_output=True, check=False,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert [int(pid) for pid in re.findall(r"\b\d+\b", proc.stdout)] == [p for p in (active_pid, beside_bpf_pid) if p]


def test_what_runs_where_names_every_pin_of_the_pod_fast_path():
    """operations.md's "What runs where" lists the pod fast path's pins: every map podpath.c
    pins by name and both programs.  agentd_podrsts (the ring of connections a RST passed) was
    left out."""
    source = (ROOT / "agentd" / "dataplane" / "bpf" / "podpath.c").read_text()
    maps = re.findall(r"__uint\(pinning, LIBBPF_PIN_BY_NAME\);\n\} (\w+) SEC\(\"\.maps\"\);", source)
    programs = re.findall(r"^SEC\(\"tc\"\)\nint (\w+)\(", source, re.MULTILINE)
    assert len(maps) >= 13 and programs == ["agentd_pod_fast", "agentd_pod_wire"], (maps, programs)
    ops = (ROOT / "docs" / "operations.md").read_text()
    (row,) = [line for line in _section(ops, "## What runs where").splitlines() if line.startswith("| pod fast path")]
    pins = row.rsplit("|", 2)[1]
    assert [name for name in maps + programs if f"`{name}`" not in pins] == []


# ------------------------------------------------------------------ the CNI plugins' directory

# Where a Debian package puts what it installs, of the plugins: containernetworking-plugins'
# reference plugins are in /usr/lib/cni (Debian ships nothing in /opt).
PACKAGE_PLACES = {"containernetworking-plugins": ("/usr/lib/cni", ("bridge", "host-local", "portmap", "bandwidth"))}


def _conflists_plugins() -> tuple[str, ...]:
    """Every plugin type a pod's ADD runs: the conflist's (agentd-cni and the chained ones), which
    the runtime runs from its own CNI bin directory, and agentd-cni's delegate and its IPAM,
    which agentd-cni looks for in the runtime's CNI_PATH (that same directory) first."""
    from ipaddress import IPv4Network

    from agentd.cni import netconf

    doc = netconf.conflist(subnet_file="/run/agentd/subnet.env", data_dir="/var/lib/agentd/cni")
    delegate = netconf.delegate_config(doc["plugins"][0] | {"name": doc["name"], "cniVersion": doc["cniVersion"]},
                                       netconf.SubnetFile(IPv4Network("10.244.0.0/16"), IPv4Network("10.244.3.0/24"), 1450))
    return (*[p["type"] for p in doc["plugins"]], delegate["type"], delegate["ipam"]["type"])


def _placed(section: str) -> dict[str, set[str]]:
    """What the shell commands of ``section``'s code blocks put where: directory -> file names,
    from `apt-get install` (PACKAGE_PLACES) and `ln`, `cp` and `install` (not -d) -- a last
    operand ending in / or after several sources is a directory, else the file's path.  A link
    to a plugin in a package's directory must have that package installed before it."""
    placed: dict[str, set[str]] = {}
    for _n, line in _code_lines(section):
        lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
        lexer.whitespace_split, lexer.commenters = True, "#"
        command: list[str] = []
        for word in [*lexer, ";"]:
            if not SHELL_OPERATORS.match(word):
                command.append(word)
                continue
            name, options = (command or [""])[0], [w for w in command[1:] if w.startswith("-")]
            operands = [w for w in command[1:] if not w.startswith("-")]
            if "-m" in options:  # install's mode takes the next word
                operands = operands[1:]
            if name == "apt-get" and operands[:1] == ["install"]:
                for package in operands[1:]:
                    if package in PACKAGE_PLACES:
                        where, names = PACKAGE_PLACES[package]
                        placed.setdefault(where, set()).update(names)
            elif name in ("ln", "cp", "install") and "-d" not in options and len(operands) >= 2:
                *sources, target = operands
                for source in sources:
                    folder, file = source.rsplit("/", 1) if source.startswith("/") else ("", source)
                    if folder in {where for where, _names in PACKAGE_PLACES.values()}:
                        assert file in placed.get(folder, ()), f"{line}: no package installed {source} before"
                if target.endswith("/") or len(sources) > 1:
                    placed.setdefault(target.rstrip("/"), set()).update(s.rsplit("/", 1)[-1] for s in sources)
                else:
                    folder, file = target.rsplit("/", 1)
                    placed.setdefault(folder, set()).add(file)
            command = []
    return placed


def test_the_installs_put_every_plugin_a_pods_add_runs_in_one_directory():
    """The container runtime runs every plugin of the conflist (agentd-cni, then portmap and
    bandwidth) from its own CNI bin directory; the conflist's binDir tells agentd-cni alone where
    its delegates are.  README's install never put agentd-cni in a CNI directory (every ADD:
    "failed to find plugin agentd-cni"); operations.md's linked it into /opt/cni/bin while
    Debian's containernetworking-plugins has portmap and bandwidth in /usr/lib/cni (every ADD:
    portmap not found).  Both installs must put all of them in one directory, the same one."""
    wanted = set(_conflists_plugins())
    assert {"agentd-cni", "portmap", "bandwidth", "bridge", "host-local"} <= wanted, wanted
    found = {}
    for doc, heading in (("README.md", "## Running it on hosts"), ("docs/operations.md", "## Install")):
        placed = _placed(_section((ROOT / doc).read_text(), heading))
        found[doc] = sorted(where for where, names in placed.items() if wanted <= names)
        assert found[doc], f"{doc}: no directory gets all of {sorted(wanted)}: {placed}"
    assert found["README.md"] == found["docs/operations.md"], found
