"""The console scripts: Ctrl-C while the command's modules load is exit status 130, quietly."""

import importlib.abc
import signal
import sys

import pytest

from agentd import entry


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
    monkeypatch.setattr("agentd.cli.main", lambda: 3)
    before = signal.getsignal(signal.SIGINT)
    try:
        assert entry.agentd() == 3
    finally:
        signal.signal(signal.SIGINT, before)
