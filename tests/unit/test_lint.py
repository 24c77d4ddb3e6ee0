"""The code has no undefined names, unused imports or unused variables (pyflakes rules via ruff)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_pyflakes_clean():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "F", "--no-cache", "proto", "bgp", "agentd", "bench", "tests", "fuzz"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
