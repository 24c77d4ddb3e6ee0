"""The fuzz harnesses (fuzz/) run clean for a bounded number of executions over their seed corpus.

Each harness runs in a subprocess, as CI and a person would run it (`python fuzz/<target>.py`),
with a fixed seed and a fresh directory for what it finds, so the committed corpus is read and
never written.  The known-failure reproducers under fuzz/crashes/ must be reported (not crash)
while their KNOWN_* flag is on, and must still fail with FUZZ_STRICT=1: when one stops failing,
the bug is fixed and its flag and reproducer should go (see docs/development.md, Fuzzing).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FUZZ = ROOT / "fuzz"
# Executions per target, the seed corpus replay included (so more than the corpus holds): about
# 30 s of CPU in all (the session harness builds two speakers and establishes two sessions per
# execution; the codec harness's merged corpus holds UPDATE streams of up to 8 KB).
RUNS = {"messages": 3000, "session": 700}
TARGETS = sorted(RUNS)


def run_harness(target: str, *args: str, strict: bool = False, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FUZZ_STRICT"}
    if strict:
        env["FUZZ_STRICT"] = "1"
    return subprocess.run(
        [sys.executable, str(FUZZ / f"{target}.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def crash_files(target: str) -> list[pathlib.Path]:
    return sorted((FUZZ / "crashes" / target).glob("*.bin"))


def test_harness_per_target_and_corpus_globs_match() -> None:
    assert sorted(p.stem for p in FUZZ.glob("[!_]*.py") if p.stem != "make_corpus") == TARGETS
    for target in TARGETS:
        seeds = list((FUZZ / "corpus" / target).iterdir())
        assert len(seeds) >= 40, f"fuzz/corpus/{target} holds {len(seeds)} files"
        assert all(p.stat().st_size > 0 for p in seeds)
    for target in TARGETS:
        for repro in crash_files(target):
            why = repro.with_suffix(".txt")
            assert why.is_file() and why.read_text().strip(), f"{repro.name} has no description"


@pytest.mark.parametrize("target", TARGETS)
def test_short_run_over_seed_corpus(target: str, tmp_path: pathlib.Path) -> None:
    found = tmp_path / "new"
    found.mkdir()
    proc = run_harness(
        target,
        str(found),
        f"fuzz/corpus/{target}",
        f"-runs={RUNS[target]}",
        "-seed=1",
        "-timeout=60",
        f"-artifact_prefix={tmp_path}/",
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    seeds = len(list((FUZZ / "corpus" / target).iterdir()))
    assert RUNS[target] > seeds, "the short run would only replay the corpus: raise RUNS"
    match = re.search(rf"(\d+) files found in fuzz/corpus/{target}", log)
    assert match is not None and int(match.group(1)) == seeds, log[-4000:]
    assert f"#{RUNS[target]}\tDONE" in log, log[-4000:]
    assert not list(tmp_path.glob("crash-*")), log[-4000:]


def test_known_failures_have_reproducers_that_are_reported_and_fail_when_strict() -> None:
    """A KNOWN_* flag is on exactly while a reproducer under fuzz/crashes/<target>/ shows its
    bug: reported (not raised) by default, raised with FUZZ_STRICT=1.  When one stops failing,
    the bug is fixed: set its flag to False and move the file into fuzz/corpus/<target>/."""
    for target in TARGETS:
        source = (FUZZ / f"{target}.py").read_text()
        flags_on = re.findall(r"^(KNOWN_\w+) = True", source, re.M)
        repros = crash_files(target)
        assert bool(flags_on) == bool(repros), (target, flags_on, [p.name for p in repros])
        for repro in repros:
            proc = run_harness(target, str(repro))
            log = proc.stdout + proc.stderr
            assert proc.returncode == 0 and "[known failure KNOWN_" in log, log[-4000:]
            strict = run_harness(target, str(repro), strict=True)
            assert strict.returncode != 0, (
                f"{repro.relative_to(ROOT)} no longer fails: the bug is fixed. Set its KNOWN_* flag in "
                f"fuzz/{target}.py to False and move the file into fuzz/corpus/{target}/."
            )
            assert "Uncaught Python exception" in strict.stdout + strict.stderr
