"""The import contracts of pyproject.toml ([tool.importlinter]) hold: proto <- bgp <- agentd,
production never imports the lab, no import cycles between siblings, each agentd package
imports only what docs/development.md's "may import" table allows, bgp's sans-IO core imports
no transport.  Run by CI with the unit
suite; `lint-imports` from the virtualenv explains a broken contract."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("proto", "bgp", "agentd")


def test_import_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    assert lint.exists(), f"{lint}: install the test extras (scripts/dev setup)"
    proc = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout
    # Every contract of pyproject.toml was checked (a contract that failed to load is not "kept").
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert len(contracts) >= 15 and proc.stdout.count(" KEPT") == len(contracts), proc.stdout


def test_import_bgp_imports_no_transport():
    """The speaker's sans-IO core is importable without asyncio (its transports are their own modules)."""
    code = "import sys, bgp, bgp.speaker, bgp.session, proto; sys.exit(sorted(m for m in sys.modules if m.split('.')[0] in ('asyncio', 'bgp') and m in ('asyncio', 'bgp.transport', 'bgp.bfd_transport')) != [])"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_production_never_imports_tests_or_bench():
    # tests/ and bench/ are not packages, so lint-imports cannot see them: check by hand.
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    assert files
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in ("tests", "bench", "fuzz")]
    assert not bad, bad
