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
