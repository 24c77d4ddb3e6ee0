"""The console scripts: Ctrl-C while the command's modules load is exit status 130, quietly;
a SIGHUP (the daemons' reload) before ``agentd run`` or ``agentd speaker`` can reload, or after
they stopped reloading, ends neither of them."""

import asyncio
import contextlib
import importlib.abc
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentd import entry
from agentd.config.settings import load_config
from agentd.daemon.speaker import SpeakerRuntime

ROOT = Path(__file__).resolve().parents[3]


class Interrupted(importlib.abc.MetaPathFinder):
    """Ctrl-C arrives while ``name`` is being imported."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            raise KeyboardInterrupt
        return None


@pytest.mark.parametrize("script, module", [(entry.agentd, "agentd.cli"), (entry.agentd_cni, "agentd.cni.plugin")])
def test_ctrl_c_while_the_command_loads_is_130_and_quiet(script, module, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["agentd", "status"])
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupted(module), *sys.meta_path])
    before = signal.getsignal(signal.SIGINT)
    try:
        assert script() == 130
        # A Ctrl-C while the interpreter shuts down: SIGINT's default action, no traceback.
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, before)
    assert capsys.readouterr() == ("", "")


def test_the_command_decides_the_exit_status(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["agentd", "status"])
    monkeypatch.setattr("agentd.cli.main", lambda: 3)
    before = signal.getsignal(signal.SIGINT)
    try:
        assert entry.agentd() == 3
    finally:
        signal.signal(signal.SIGINT, before)


# The console script (what pip writes for agentd.entry:agentd), stopped just before the module it
# is given loads: it says so on stdout and goes on at a line on stdin.
PAUSED_SCRIPT = """
import importlib.abc, sys

MODULE = sys.argv.pop(1)


class Pause(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == MODULE:
            sys.meta_path.remove(self)
            print("loading", fullname, flush=True)
            sys.stdin.readline()
        return None


sys.meta_path.insert(0, Pause())
from agentd.entry import agentd
sys.exit(agentd())
"""
NODE = '[node]\nname = "n1"\naddress = "192.0.2.77"\n'  # an address no interface has


@pytest.mark.parametrize("command, module, config, status, said", [
    # The imports (most of a start's first second): a configuration refused after them.
    ("run", "agentd.cli", NODE + "[bgp]\nhold_time = 2\n", 1, "hold_time = 2: must be 0 or at least 3"),
    ("speaker", "agentd.cli", NODE + "[bgp]\nhold_time = 2\n", 1, "hold_time = 2: must be 0 or at least 3"),
    # The configuration loaded, the agent about to run: it ends on the node address.
    ("run", "agentd.daemon.agent", NODE, 1, "no interface in this network namespace has the node address"),
], ids=["run-importing", "speaker-importing", "run-configured"])
def test_a_sighup_while_a_daemon_starts_does_not_end_it(tmp_path, command, module, config, status, said):
    """logrotate's postrotate (docs/ingress.md) sends SIGHUP at any time: one landing before the
    daemon installed its reload handler ended it by SIGHUP's default action, which systemd takes
    for a clean exit (Restart=on-failure then left the node's agent down)."""
    path = tmp_path / "agentd.toml"
    path.write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_SCRIPT, module, command, "--config", str(path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path)
    try:
        assert proc.stdout.readline() == f"loading {module}\n"
        proc.send_signal(signal.SIGHUP)
        with contextlib.suppress(BrokenPipeError):  # gone already: the signal ended it
            proc.stdin.write("\n")
            proc.stdin.flush()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode != -signal.SIGHUP, "ended by SIGHUP"
    assert proc.returncode == status and said in err, (proc.returncode, err)


def test_the_speaker_leaves_sighup_ignored_when_it_stops(tmp_path, monkeypatch):
    """Its reload handler removed at the stop left SIGHUP's default action (what the event loop
    puts back): a SIGHUP while it stopped ended it."""
    cfg = load_config(None, env={"AGENTD_NODE_NAME": "rr", "AGENTD_NODE_ADDRESS": "192.0.2.1",
                                 "AGENTD_AGENT_STATE_DIR": str(tmp_path), "AGENTD_BGP_PEERS": json.dumps([])})
    rt = SpeakerRuntime(cfg)

    async def nothing(*_a, **_kw):
        return None

    quiet = SimpleNamespace(start=nothing, stop=nothing, set_peers=lambda _: None, set_listen_ranges=lambda _: None,
                            set_originated=lambda _: None, peers_configured=lambda: None)
    monkeypatch.setattr(rt, "service", quiet)
    monkeypatch.setattr(rt, "api", SimpleNamespace(start=nothing, stop=nothing))

    async def main():
        asyncio.get_running_loop().call_soon(rt.stop)
        return await rt.run(reload=lambda: cfg)

    before = signal.getsignal(signal.SIGHUP)
    try:
        assert asyncio.run(main()) == 0
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
