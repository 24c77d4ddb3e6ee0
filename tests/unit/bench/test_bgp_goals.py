"""The goals of bench/rr_scale.py and bench/bgp_ingest.py, judged the right way round: the
reflector's times and RSS at most a bound times the other speaker's, the ingest rate at least
one and its peak RSS at most one (a flipped direction read a slower agentd as the goal met)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import bgp_ingest, rr_scale


def _rr_goals(capsys, agentd: float, gobgp: float) -> list[str]:
    """rr_scale's goal lines at N=2000 with agentd's establish, converge and peak RSS all
    ``agentd`` and GoBGP's (and BIRD's) all ``gobgp``."""
    def run(speaker: str, v: float) -> rr_scale.RunResult:
        return rr_scale.RunResult(n=2000, speaker=speaker, round=1, style="-", status="ok", ready=1.0,
                                  establish=v, converge=v, withdraw=v, peak_rss_mb=v)

    best = {(2000, "agentd"): run("agentd", agentd), (2000, "gobgp"): run("gobgp", gobgp),
            (2000, "bird"): run("bird", gobgp)}
    args = argparse.Namespace(rounds=1, in_flight=64, withdraw=0.1)
    rr_scale.report(best, [2000], ["agentd", "bird", "gobgp"], args)
    out = capsys.readouterr().out.splitlines()
    return [line.strip() for line in out if line.strip().startswith("- N=2000: agentd")]


def test_rr_scale_a_reflector_faster_and_smaller_than_gobgp_meets_its_goals(capsys):
    lines = _rr_goals(capsys, agentd=0.5, gobgp=1.0)
    gobgp = [line for line in lines if "x GoBGP" in line]
    assert len(gobgp) == 3  # converge, rss, establish
    assert all(line.endswith("0.50x  met") for line in gobgp), gobgp
    assert all(line.endswith("met") and "NOT" not in line for line in lines), lines


def test_rr_scale_a_reflector_slower_than_gobgp_does_not(capsys):
    lines = _rr_goals(capsys, agentd=1.5, gobgp=1.0)
    gobgp = [line for line in lines if "x GoBGP" in line]
    assert len(gobgp) == 3 and all(line.endswith("1.50x  NOT met") for line in gobgp), gobgp
    bird = [line for line in lines if "x BIRD" in line]  # bounds 3.0x and 4.0x: 1.5x meets them
    assert bird and all(line.endswith("1.50x  met") for line in bird), bird


def _ingest_goals(capsys, rate: float, rss: float) -> list[str]:
    """bgp_ingest's goal lines of the "one" regime: agentd at ``rate`` prefixes/s and ``rss``
    MB peak, GoBGP and BIRD at 1000/s and 100 MB."""
    def run(speaker: str, rate: float, rss: float) -> bgp_ingest.RunResult:
        return bgp_ingest.RunResult(regime="one", n=1000, speaker=speaker, round=1, method="-", status="ok",
                                    seconds=1000 / rate, rate=rate, peak_rss_mb=rss, base_rss_mb=rss, cpu_seconds=1.0)

    best = {("one", 1000, "agentd"): run("agentd", rate, rss), ("one", 1000, "gobgp"): run("gobgp", 1000.0, 100.0),
            ("one", 1000, "bird"): run("bird", 1000.0, 100.0)}
    args = argparse.Namespace(rounds=1, t1="idle", poll=0.05)
    bgp_ingest.report(best, [("one", 1000)], ["agentd", "bird", "gobgp"], args, {})
    out = capsys.readouterr().out.splitlines()
    return [line.strip() for line in out if line.strip().startswith("- one N=1000: agentd")]


def test_bgp_ingest_a_faster_agentd_meets_the_rate_goals_a_slower_one_does_not(capsys):
    fast = [line for line in _ingest_goals(capsys, rate=1200.0, rss=100.0) if "prefixes/s >=" in line]
    assert len(fast) == 2 and all(line.endswith("1.20x  met") for line in fast), fast
    slow = [line for line in _ingest_goals(capsys, rate=200.0, rss=100.0) if "prefixes/s >= 1x" in line]
    assert len(slow) == 1 and slow[0].endswith("0.20x  NOT met"), slow


def test_bgp_ingest_the_rss_goal_is_at_most(capsys):
    small = [line for line in _ingest_goals(capsys, rate=1000.0, rss=150.0) if "peak RSS <=" in line]
    assert len(small) == 1 and small[0].endswith("1.50x  met"), small
    big = [line for line in _ingest_goals(capsys, rate=1000.0, rss=250.0) if "peak RSS <=" in line]
    assert len(big) == 1 and big[0].endswith("2.50x  NOT met"), big
