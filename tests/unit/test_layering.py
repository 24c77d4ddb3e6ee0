"""The import contracts of pyproject.toml ([tool.importlinter]) hold: proto <- bgp <- agentd,
production never imports the lab, no import cycles between siblings, each agentd package
imports only what docs/development.md's "may import" table allows, bgp's sans-IO core imports
no transport.  Run by CI with the unit
suite; `lint-imports` from the virtualenv explains a broken contract."""

from __future__ import annotations

import ast
import re
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


def _may_import_table() -> list[tuple[list[str], str]]:
    """docs/development.md's map: (the modules of a row, its "may import" cell), in order."""
    rows = []
    for line in (ROOT / "docs" / "development.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[0])  # `agentd/cli.py`, `tables.py`: both of agentd/
        prefix = "agentd/" if names[0].startswith("agentd/") else ""
        units = [(n if n.startswith(prefix) else prefix + n).removesuffix("/").removesuffix(".py").replace("/", ".")
                 for n in names]
        rows.append((units, cells[-1]))
    return rows


def expected_forbidden_contracts() -> dict[str, set[str]]:
    """Per agentd package of the table: what it must not import of its siblings (everything the
    row's "may import" does not name; "everything above": the rows above; the lab has its own
    contract)."""
    rows = [(units, cell) for units, cell in _may_import_table() if units[0].startswith("agentd")]
    every = {u for units, _ in rows for u in units} - {"agentd.lab"}
    out = {}
    for i, (units, cell) in enumerate(rows):
        if units == ["agentd.lab"]:
            continue
        if cell.startswith("everything above"):
            allowed = {u for above, _ in rows[:i] for u in above}
        else:
            allowed = set(re.findall(r"`(agentd\.[a-z_]+)`", cell))
        for unit in units:
            out[unit] = every - allowed - set(units)
    return {unit: forbidden for unit, forbidden in out.items() if forbidden}


def test_every_agentd_package_is_in_the_map():
    on_disk = {f"agentd.{p.stem}" for p in (ROOT / "agentd").iterdir()
               if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    in_map = {u for units, _ in _may_import_table() for u in units if u.startswith("agentd")}
    assert on_disk == in_map, (on_disk - in_map, in_map - on_disk)


def test_the_contracts_are_the_may_import_table():
    """One forbidden contract per package of docs/development.md's map, forbidding exactly what
    its "may import" cell leaves out (a new package forbidden to the others too)."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    got = {c["source_modules"][0]: set(c["forbidden_modules"]) for c in contracts
           if c["type"] == "forbidden" and len(c["source_modules"]) == 1 and c["source_modules"][0].startswith("agentd.")
           and c["forbidden_modules"] != ["agentd.lab"]}
    want = expected_forbidden_contracts()
    assert got == want, "\n".join(f"{u}: missing {sorted(want.get(u, set()) - got.get(u, set()))}, "
                                  f"extra {sorted(got.get(u, set()) - want.get(u, set()))}"
                                  for u in sorted(set(got) | set(want)) if got.get(u) != want.get(u))
