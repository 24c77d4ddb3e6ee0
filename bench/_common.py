"""Small helpers shared by the benchmarks: timing, rates, ratios and aligned tables.

Benchmarks print tables, never assert timings (tests do that for behaviour only).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def require_root(what: str) -> None:
    """Exit with one clear line unless running as root (namespaces need it)."""
    if os.geteuid() != 0:
        print(f"{what} needs root (it builds network namespaces); run it with sudo", file=sys.stderr)
        raise SystemExit(2)


def int_list(text: str) -> list[int]:
    """argparse type for ``"10000,100000"`` (underscores allowed: ``100_000``)."""
    try:
        values = [int(part.replace("_", "")) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


@dataclass(frozen=True)
class Timing:
    """Wall clock and CPU seconds of one measured step (CPU of this process, or of the
    children that finished during it)."""

    wall: float
    user: float
    sys: float


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.timing``; ``children=True`` measures the
    CPU of child processes that exited inside the block (e.g. one ``ip -batch`` run)."""

    def __init__(self, *, children: bool = False) -> None:
        self.who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
        self.timing = Timing(0.0, 0.0, 0.0)

    def __enter__(self) -> Stopwatch:
        self._usage = resource.getrusage(self.who)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._start
        usage = resource.getrusage(self.who)
        self.timing = Timing(wall, usage.ru_utime - self._usage.ru_utime, usage.ru_stime - self._usage.ru_stime)


def rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")


def fmt_rate(per_second: float) -> str:
    return f"{per_second:,.0f}/s"


def fmt_ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs else "n/a"


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[object]], *, file=None) -> None:
    """Columns separated by two spaces; numbers and rates right-aligned, text left-aligned."""
    file = file or sys.stdout
    text_rows = [[str(cell) for cell in row] for row in rows]
    widths = [max([len(col)] + [len(row[i]) for row in text_rows]) for i, col in enumerate(columns)]

    print(f"\n{title}", file=file)
    print("  ".join(col.ljust(w) for col, w in zip(columns, widths)).rstrip(), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in text_rows:
        cells = [cell.rjust(w) if _numeric(cell) else cell.ljust(w) for cell, w in zip(row, widths)]
        print("  ".join(cells).rstrip(), file=file)


def _numeric(cell: str) -> bool:
    """"12,345/s", "1.23x", "0.51 s", "42%" and plain numbers are right-aligned."""
    core = cell.replace(",", "").rstrip("x%/s ").strip()
    try:
        float(core)
    except ValueError:
        return False
    return True


def print_notes(title: str, lines: Iterable[str], *, file=None) -> None:
    file = file or sys.stdout
    print(f"\n{title}", file=file)
    for line in lines:
        print(f"  - {line}", file=file)


def emit_json(obj: object, *, file=None) -> None:
    json.dump(obj, file or sys.stdout, indent=2, sort_keys=True, default=str)
    print(file=file or sys.stdout)
