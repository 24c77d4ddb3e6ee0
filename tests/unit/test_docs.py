"""The docs' commands paste into a root shell as written: no ``sudo`` in front (a root box
need not have sudo; a sudo user is told once, in prose, to put it in front)."""

from __future__ import annotations

import re
from pathlib import Path

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
