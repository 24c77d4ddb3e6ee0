"""Small helpers shared by the benchmarks: the command line every bench accepts, failures,
timing, rates, ratios and aligned tables.

Benchmarks print tables, never assert timings (tests do that for behaviour only).

The command line (bench/README.md): every bench takes ``--quick`` (its small sizes, to see it
run end to end in a few minutes; options given explicitly still win) and ``--json FILE``
(also write the results as JSON to FILE, or to DIR/<bench>.json when FILE is a directory,
which is how ``scripts/dev bench --json DIR`` hands one directory to all of them).  A run
that fails is a :class:`BenchError`: one line on stderr and exit status 1, never a zero in a
table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class BenchError(RuntimeError):
    """A run that failed (a tool that did not start, a transfer that moved nothing): the
    bench stops, says what failed in one line and exits 1."""


def add_common_options(parser: argparse.ArgumentParser, quick: str) -> None:
    """``--quick`` and ``--json FILE``, the same in every bench; ``quick`` says what the
    small sizes are (for --help)."""
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes, to see the bench run end to end ({quick}); options given explicitly win")
    parser.add_argument("--json", metavar="FILE",
                        help="also write the results as JSON to FILE (a directory: FILE/<bench>.json)")


def parse_bench_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None, *, name: str,
                     quick: Mapping[str, Any]) -> argparse.Namespace:
    """Parse with the common options: under ``--quick`` the defaults in ``quick`` replace the
    parser's own (an option given on the command line still wins); ``args.json`` becomes the
    file to write (``name``.json inside a directory), checked to be writable before the run."""
    if not any(a.dest == "quick" for a in parser._actions):
        add_common_options(parser, ", ".join(f"{k.replace('_', '-')} {v}" for k, v in quick.items()))
    argv = list(sys.argv[1:] if argv is None else argv)
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**quick)
    args = parser.parse_args(argv)
    if args.json is not None:
        try:
            args.json = json_target(args.json, name)
        except BenchError as err:
            parser.error(str(err))
    return args


def json_target(path: str, name: str) -> str:
    """Where ``--json PATH`` writes: PATH, or PATH/<name>.json when PATH is a directory.
    The file is opened (and left as it was) so that a bad path fails before a long run."""
    target = Path(path)
    if target.is_dir():
        target = target / f"{name}.json"
    try:
        with target.open("a"):
            pass
    except OSError as err:
        raise BenchError(f"--json {path}: {err.strerror}") from None
    return str(target)


def write_json(path: str | None, obj: object) -> None:
    """The results as JSON to ``path`` (nothing when it is None)."""
    if path is not None:
        with open(path, "w") as f:
            emit_json(obj, file=f)


def run_main(main: Callable[[], int | None], name: str, errors: tuple[type[BaseException], ...] = ()) -> None:
    """``sys.exit(main())`` with the benches' conventions: a :class:`BenchError` (or one of
    ``errors``, e.g. the lab's) is one line on stderr and exit 1; Ctrl-C exits 130 and a closed
    pipe (``| head``) 141, quietly, by ``agentd``'s own rule (agentd.cli.main)."""
    from agentd.cli import closed_stdout

    try:
        try:
            code = main()
        finally:
            sys.stdout.flush()  # buffered output meets a closed pipe here, not at exit
    except (BenchError, *errors) as err:
        print(f"{name}: {err}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BrokenPipeError:
        code = closed_stdout()
    sys.exit(code or 0)


@dataclass(frozen=True)
class Iperf3Run:
    gbps: float  # received, as the server counted it
    retransmits: int


def iperf3_result(returncode: int, stdout: str | bytes, stderr: str | bytes, what: str) -> Iperf3Run:
    """The figures of one ``iperf3 -c ... -J`` run; anything but a clean run that moved data
    (a non-zero exit, an "error" in its report, no report, nothing received) is a
    :class:`BenchError` naming ``what`` and iperf3's own reason."""
    out = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout
    err = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    try:
        report = json.loads(out)
    except ValueError:
        report = None
    if not isinstance(report, dict):
        tail = (out.strip() or err.strip() or "no output")[-300:]
        raise BenchError(f"{what}: iperf3 failed (exit {returncode}): {tail}")
    if report.get("error") or returncode != 0:
        reason = report.get("error") or err.strip()[-300:] or "no reason given"
        raise BenchError(f"{what}: iperf3 failed (exit {returncode}): {reason}")
    try:
        gbps = float(report["end"]["sum_received"]["bits_per_second"]) / 1e9
        retransmits = int(report["end"].get("sum_sent", {}).get("retransmits", 0))
    except (KeyError, TypeError, ValueError):
        raise BenchError(f"{what}: iperf3 reported no received total") from None
    if gbps <= 0:
        raise BenchError(f"{what}: iperf3 moved no data (0 bit/s received)")
    return Iperf3Run(gbps, retransmits)


def require_root(what: str) -> None:
    """Exit with one clear line unless running as root (namespaces need it)."""
    if os.geteuid() != 0:
        print(f"{what} needs root (it builds network namespaces); run it as root (or with sudo)", file=sys.stderr)
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


# The share of a run's connections that may fail (svcecho's crr counts a connect that failed
# or took over 2 s, and a request not answered within 2 s) before the run is a BenchError: a
# rate counts the successes only, so a run that lost many would read as merely slower.
CRR_FAILED_SHARE = 0.01


def crr_checked(r: dict[str, Any], what: str) -> dict[str, Any]:
    """svcecho's crr answer ``r`` (``connections`` answered, ``failed``), unless no connection
    succeeded or more than CRR_FAILED_SHARE of them failed: then a BenchError naming ``what``
    (bench/flows.py and bench/services.py judge each run so)."""
    done, failed = r["connections"], r["failed"]
    if not done > 0:
        raise BenchError(f"{what}: no connection succeeded ({failed:,} failed)")
    if failed > CRR_FAILED_SHARE * (done + failed):
        raise BenchError(f"{what}: {failed:,} of {done + failed:,} connections failed "
                         f"(more than {CRR_FAILED_SHARE:.0%}): the connection rate would not be the path's")
    return r


def rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")


def fmt_rate(per_second: float) -> str:
    return f"{per_second:,.0f}/s"


def fmt_ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs else "n/a"


def judged(value: float, goal: float, *, at_least: bool = True, strict: bool = False, decimals: int = 3,
           unit: str = "x") -> tuple[str, str]:
    """``value`` against its ``goal`` (at least it, or with ``at_least`` False at most it;
    ``strict``: above it, or below it): the value as printed and the verdict, "met" or "NOT
    met".  The value gets more decimals than ``decimals`` where fewer would print it on the
    other side of the goal or as the goal itself: 0.9496 against >= 0.95 prints 0.9496, not
    0.950 beside "NOT met"; 999.6 ms against < 1000 prints 999.6, not 1000 beside "met"."""
    def meets(x: float) -> bool:
        if strict:
            return x > goal if at_least else x < goal
        return x >= goal if at_least else x <= goal

    met = meets(value)
    d = decimals
    text = f"{value:.{d}f}"
    while d < 15 and meets(float(text)) != met:  # (printed as the goal itself: it would meet it)
        d += 1
        text = f"{value:.{d}f}"
    return text + unit, "met" if met else "NOT met"


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
