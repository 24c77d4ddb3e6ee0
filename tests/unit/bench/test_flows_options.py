"""bench/flows.py's --node-cpus check: it steers node 1's receive work to the clients' CPU 0 and
node 2's to the servers' CPU 1, so it is refused, with one line and before anything is built,
when the bench may not run on both."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import flows


def test_node_cpus_needs_cpus_0_and_1():
    assert flows.node_cpus_error({0, 1}) is None
    assert flows.node_cpus_error({0, 1, 2, 3}) is None
    assert "CPUs 0 only" in flows.node_cpus_error({0})
    assert "CPUs 1,2 only" in flows.node_cpus_error({1, 2})


def test_node_cpus_refused_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(flows.os, "sched_getaffinity", lambda pid: {0})

    def reached(*_):
        raise AssertionError("--node-cpus passed the check: the bench would start")

    monkeypatch.setattr(flows, "require_root", reached)  # never a lab from a unit test, root or not
    with pytest.raises(SystemExit) as exc:
        flows.main(["--node-cpus", "--placement", "split"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if "error:" in line] == [err[-1]]
    assert "--node-cpus" in err[-1] and "CPUs 0 only" in err[-1]


@pytest.mark.parametrize("placement", [[], ["--placement", "both"], ["--placement", "one"]])
def test_node_cpus_goes_with_the_split_placement_only(monkeypatch, capsys, placement):
    # RPS would put node 2's receive work on CPU 1: not "all on CPU 0".
    monkeypatch.setattr(flows.os, "sched_getaffinity", lambda pid: {0, 1})

    def reached(*_):
        raise AssertionError("the bench would start")

    monkeypatch.setattr(flows, "require_root", reached)
    with pytest.raises(SystemExit) as exc:
        flows.main(["--node-cpus", *placement])
    assert exc.value.code == 2
    assert "--node-cpus" in capsys.readouterr().err.strip().splitlines()[-1]


def test_both_placements_by_default_split_first():
    assert flows.placements_of("both") == ["split", "one"]
    assert flows.placements_of("one") == ["one"]
