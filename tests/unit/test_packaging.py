"""Packaging and the files that run agentd for real, checked without running anything.

Pure: pyproject.toml, the unit file, the Dockerfile and the docs are read as text; the CLI
is called in-process (`agentd.cli.main`) on configurations in tmp_path whose node name and
address are given, so no host facts are looked up. What needs tools (docker-compose, pip,
systemd-analyze, Graphviz) is in tests/system/test_packaging_system.py and test_systemd.py.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from agentd import cli
from agentd.config.settings import DEFAULT_CONFIG_PATH, AgentConfig, CniConfig

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(autouse=True)
def _no_agentd_environment(monkeypatch):
    # AGENTD_* variables are configuration sources: keep the caller's out of these tests.
    for key in list(os.environ):
        if key.startswith("AGENTD_"):
            monkeypatch.delenv(key)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as stop:  # argparse's --version and usage errors
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ entry points, version


def test_both_commands_are_declared_and_importable():
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts == {"agentd": "agentd.entry:agentd", "agentd-cni": "agentd.entry:agentd_cni"}
    for target in scripts.values():
        module, _, func = target.partition(":")
        assert callable(getattr(importlib.import_module(module), func))


def test_version(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0
    try:
        expected = version("agentd")
    except PackageNotFoundError:  # a source tree that was never installed
        expected = "0+unknown"
    assert out.strip() == f"agentd {expected}"
    if expected != "0+unknown":
        assert expected == PYPROJECT["project"]["version"]


# ------------------------------------------------------------------ check-config


GOOD = """\
[node]
name = "node-1"
address = "192.0.2.10"
[network]
backend = "vxlan"
[etcd]
endpoints = ["http://192.0.2.2:2379"]
"""

THREE_PROBLEMS = """\
[node]
name = "node-1"
address = "192.0.2.10"
asn = 23456
[network]
backend = "geneve"
[bgp]
hold_tme = 30
"""


def test_check_config_good(tmp_path, capsys):
    path = tmp_path / "agentd.toml"
    path.write_text(GOOD)
    code, out, err = run_cli(capsys, "check-config", "--config", str(path))
    assert (code, out, err) == (0, f"{path}: configuration OK\n", "")


def test_check_config_reports_every_problem_one_line_each(tmp_path, capsys):
    path = tmp_path / "agentd.toml"
    path.write_text(THREE_PROBLEMS)
    code, out, err = run_cli(capsys, "check-config", "--config", str(path))
    assert code == 1 and out == ""
    lines = err.splitlines()
    assert len(lines) == 3, err
    assert "Traceback" not in err
    assert lines[0].startswith(f"{path}:4: [node] asn") and "AS_TRANS" in lines[0]
    assert lines[1].startswith(f"{path}:6: [network] backend") and "host-gw, ipip, vxlan, udp" in lines[1]
    assert lines[2] == f"{path}:8: unknown key [bgp] hold_tme (did you mean hold_time?)"


@pytest.mark.parametrize(
    ("content", "needle"),
    [("[node\n", "TOML syntax error"), (None, "no such file")],
)
def test_check_config_unreadable_file_is_one_line(tmp_path, capsys, content, needle):
    path = tmp_path / "agentd.toml"
    if content is not None:
        path.write_text(content)
    code, out, err = run_cli(capsys, "check-config", "--config", str(path))
    assert code == 1 and out == ""
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_check_config_environment_and_overrides(tmp_path, capsys, monkeypatch):
    path = tmp_path / "agentd.toml"
    path.write_text(GOOD)
    monkeypatch.setenv("AGENTD_BGP_HOLD_TIME", "2")  # 0 or 3..65535
    code, _, err = run_cli(capsys, "check-config", "--config", str(path), "--set", "network.mtu=70000")
    assert code == 1
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert any("AGENTD_BGP_HOLD_TIME" in line for line in lines)
    assert any("mtu" in line for line in lines)


def test_check_config_show_prints_the_effective_configuration(tmp_path, capsys):
    path = tmp_path / "agentd.toml"
    path.write_text(GOOD)
    code, out, _ = run_cli(capsys, "check-config", "--config", str(path), "--show")
    assert code == 0
    shown = json.loads(out)
    assert shown["network"]["backend"] == "vxlan"
    assert shown["node"]["address"] == "192.0.2.10"


def test_the_example_configuration_is_valid(capsys):
    """etc/agentd.toml, what operators install as /etc/agentd/agentd.toml (the Dockerfile too)."""
    example = ROOT / "etc" / "agentd.toml"
    assert example.read_text().startswith(f"# {DEFAULT_CONFIG_PATH} ")
    code, out, err = run_cli(
        capsys, "check-config", "--config", str(example), "--set", "node.address=192.0.2.10", "--set", "node.name=n1"
    )
    assert code == 0, err
    assert out.endswith("configuration OK\n")


def test_the_example_configuration_works_for_an_ipv6_only_node(capsys):
    """The sample sets no host-dependent listen address: an IPv6-only node started from it
    listens for BGP on IPv6 (an IPv4 socket would refuse every peer)."""
    example = ROOT / "etc" / "agentd.toml"
    code, out, err = run_cli(
        capsys, "check-config", "--config", str(example), "--set", "node.name=n1", "--set", "network.ip_family=ipv6",
        "--set", "node.address_v6=2001:db8::10", "--set", "network.backend=vxlan", "--show",
    )
    assert code == 0, err
    assert json.loads(out)["bgp"]["listen"] == "[::]:179"


# ------------------------------------------------------------------ unit file, Dockerfile, docs


def unit_values(key: str) -> list[str]:
    text = (ROOT / "systemd" / "agentd.service").read_text()
    return [m[1].strip() for m in re.finditer(rf"^{key}=(.*)$", text, re.MULTILINE)]


def test_the_unit_lets_the_agent_write_where_the_defaults_say():
    """With the default configuration, everything the agent writes is writable in the unit."""
    writable = {"/var/lib/" + d for d in unit_values("StateDirectory")}
    writable |= {"/run/" + d for d in unit_values("RuntimeDirectory")}
    writable |= {p.lstrip("-") for line in unit_values("ReadWritePaths") for p in line.split()}
    cni, agent = CniConfig(), AgentConfig()
    for path in (cni.conf_dir, cni.subnet_file.parent, agent.state_dir):
        assert any(Path(path).is_relative_to(w) for w in writable), path
    # [ingress] access_log as a file: the directory etc/agentd.toml suggests is writable too.
    writable |= {"/var/log/" + d for d in unit_values("LogsDirectory")}
    suggested = re.search(r'e\.g\. "(/var/log/[^"]+)"', (ROOT / "etc" / "agentd.toml").read_text())
    assert suggested and any(Path(suggested[1]).is_relative_to(w) for w in writable), suggested
    # The CNI directory is made by root, not by ConfigurationDirectory= (which systemd would make
    # the user's of a drop-in's User=): it stays root's, shared with the container runtime.
    assert not any("cni" in d for line in unit_values("ConfigurationDirectory") for d in line.split())
    assert "+/bin/mkdir -p /etc/cni/net.d" in unit_values("ExecStartPre")
    # The command the unit runs is where pip (and the Dockerfile) put it, with the default config.
    (exec_start,) = unit_values("ExecStart")
    assert exec_start == f"/usr/local/bin/agentd run --config {DEFAULT_CONFIG_PATH}"


def test_the_unit_restarts_an_agent_a_sighup_ended():
    """Death by SIGHUP (the unit's reload, logrotate's postrotate in docs/ingress.md) is a clean
    exit to systemd: with Restart=on-failure alone, a SIGHUP landing before the agent ignores it
    (the interpreter's start-up, before agentd/entry.py's first line) left the node's agent down."""
    assert unit_values("Restart") == ["on-failure"]
    assert "SIGHUP" in [s for line in unit_values("RestartForceExitStatus") for s in line.split()]
    assert any("HUP" in line for line in unit_values("ExecReload"))  # what it is a defence against


def test_the_unit_checks_the_file_before_it_signals_a_reload(tmp_path, capsys):
    """`systemctl reload agentd` fails, with the problems, for a file the agent would refuse:
    ExecReload= runs ExecStart='s agentd check-config on the unit's file first (as HAProxy's unit
    runs `haproxy -c`), and sends SIGHUP only once it passed.  Only a signal, the reload said
    nothing (exit 0) and the refusal was in the journal alone."""
    (exec_start,) = unit_values("ExecStart")
    agentd, _, args = exec_start.partition(" ")
    config = args.split("--config ", 1)[1].split()[0]
    # --reload: no default route at that moment (no [node] address) fails a start, not the
    # reload, which keeps the running [node] address: a warning (test_cli_config.py).
    assert unit_values("ExecReload") == [f"{agentd} check-config --reload --config {config}", "/bin/kill -HUP $MAINPID"]
    # check-config's exit status is what fails the reload: non-zero for a file with problems.
    bad = tmp_path / "agentd.toml"
    bad.write_text('[node]\nname = "n1"\naddress = "10.1.1.1"\n[bgp]\nhold_time = 2\n')
    reload_args = unit_values("ExecReload")[0].split()[1:-1]  # its own arguments, the file ours
    code, _, err = run_cli(capsys, *reload_args, str(bad))
    assert code == 1 and "[bgp] hold_time" in err


def documented_drop_in(has: str) -> str:
    """docs/operations.md's drop-in (a `# systemctl edit agentd` block) that matches the regular
    expression ``has``, exactly as the page shows it (as tests/system/test_systemd_container.py
    reads the others)."""
    doc = (ROOT / "docs" / "operations.md").read_text()
    blocks = re.findall(r"    # systemctl edit agentd\n((?:    [^\n]*\n)+)", doc)
    blocks = ["".join(line[4:] + "\n" for line in block.splitlines()) for block in blocks]
    (block,) = [b for b in blocks if re.search(has, b, re.MULTILINE)]
    return block


def applied(unit: str, drop_in: str, key: str) -> list[str]:
    """The values of list setting ``key`` once ``drop_in`` is applied to ``unit`` as systemd
    does (systemd.service(5)): the drop-in's lines are added, an empty one empties the list."""
    values: list[str] = []
    for text in (unit, drop_in):
        for m in re.finditer(rf"^{key}=(.*)$", text, re.MULTILINE):
            values = values + [m[1].strip()] if m[1].strip() else []
    return values


def test_the_documented_drop_in_for_agentd_elsewhere_moves_every_command_that_runs_it():
    """docs/operations.md's drop-in for an agentd that lives elsewhere (a virtualenv without the
    symlink), applied to the unit: no command runs /usr/local/bin/agentd any more, and the
    reload checks the file the agent runs with, with the agent's agentd.  The page said to
    override ExecStart= alone: ExecReload='s check-config then ran the unit's
    /usr/local/bin/agentd, missing there (`systemd-analyze verify`: "Command
    /usr/local/bin/agentd is not executable"), and every `systemctl reload` failed, no SIGHUP
    sent; a drop-in with another --config had the reload check the wrong file."""
    unit = (ROOT / "systemd" / "agentd.service").read_text()
    drop_in = documented_drop_in(r"^ExecStart=\S")
    (exec_start,) = applied(unit, drop_in, "ExecStart")
    agentd, _, args = exec_start.partition(" ")
    config = args.split("--config ", 1)[1].split()[0]
    assert agentd != "/usr/local/bin/agentd", exec_start  # the drop-in is for agentd elsewhere
    commands = [exec_start, *applied(unit, drop_in, "ExecReload")]
    assert not [c for c in commands if "/usr/local/bin/agentd" in c], commands
    # The unit's reload, run by the drop-in's agentd on the drop-in's file.
    expected = [line.replace("/usr/local/bin/agentd", agentd).replace(str(DEFAULT_CONFIG_PATH), config)
                for line in unit_values("ExecReload")]
    assert commands[1:] == expected, drop_in


def test_the_unit_lets_bpf_maps_be_made_on_kernels_that_charge_them_to_memlock():
    """Before Linux 5.11 BPF maps count against RLIMIT_MEMLOCK (64 KiB under systemd < 253),
    and the unit allows neither CAP_SYS_RESOURCE nor setrlimit() to raise it."""
    assert unit_values("LimitMEMLOCK") == ["infinity"]
    assert "CAP_SYS_RESOURCE" not in unit_values("CapabilityBoundingSet")[0]


def test_the_status_lines_documented_are_the_ones_sent():
    """docs/operations.md's Type=notify table: each start-up step's STATUS= in the order the
    agent sends them, then the readiness loop's."""
    from agentd.daemon.agent import START_STEPS

    doc = (ROOT / "docs" / "operations.md").read_text()
    documented = re.findall(r"^\| `STATUS=([^`<]*?)(?: <[a-z]+>)?` \|", doc, re.MULTILINE)
    assert documented == [*START_STEPS, "not ready:"], documented
    assert "`READY=1` + `STATUS=ready: subnet <subnet>`" in doc


def test_dockerfile_copies_what_exists_and_matches_the_unit():
    dockerfile = (ROOT / "Dockerfile").read_text()
    sources = [
        src
        for m in re.finditer(r"^COPY (.+) (\S+)$", dockerfile, re.MULTILINE)
        for src in m[1].split()
        if not src.startswith("--")
    ]
    assert sources, "no COPY lines found"
    for src in sources:
        assert (ROOT / src).exists(), src
    # The base is a build argument: the slim Python image by default, a local one without a registry.
    assert re.search(r"^ARG BASE=python:3\.11-slim-bookworm$", dockerfile, re.MULTILINE)
    assert re.search(r"^FROM \$\{BASE\}$", dockerfile, re.MULTILINE)
    assert "containernetworking-plugins" in dockerfile
    assert "pip install --no-cache-dir ${PIP_OFFLINE:+--no-index} --find-links /tmp/wheels ." in dockerfile
    # The agent where the unit's ExecStart= expects it.
    assert "ln -s /opt/agentd/bin/agentd /opt/agentd/bin/agentd-cni /usr/local/bin/" in dockerfile
    assert "COPY etc/agentd.toml /etc/agentd/agentd.toml" in dockerfile
    # The same environment as the unit.
    for assignment in unit_values("Environment"):
        assert f"ENV {assignment}" in dockerfile


def test_compose_entrypoint_is_an_executable_python_script():
    entry = ROOT / "docker" / "agentd-node"
    assert os.access(entry, os.X_OK)
    text = entry.read_text()
    assert text.startswith("#!/usr/bin/env python3\n")
    compile(text, str(entry), "exec")
    assert "COPY docker/agentd-node /usr/local/bin/agentd-node" in (ROOT / "Dockerfile").read_text()


def test_architecture_svg_was_rendered_from_the_committed_source():
    source = (ROOT / "docs" / "architecture.dot").read_bytes()
    svg = (ROOT / "docs" / "architecture.svg").read_text()
    digest = hashlib.sha256(source).hexdigest()
    assert f"rendered from architecture.dot sha256 {digest}" in svg, "stale: run `sh docs/architecture.sh`"


def test_docs_link_to_files_that_exist():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) >= 4
    for page in pages:
        for target in re.findall(r"\]\(([^)#:]+)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
