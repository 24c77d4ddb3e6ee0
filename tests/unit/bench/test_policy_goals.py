"""bench/policy.py's goals, judged: the ratio printed beside a verdict is the one judged
(three decimals, more where needed: 0.946 -- nor 0.9496 -- must not print as 0.95 beside "NOT met"
at a goal of 0.95)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import policy


def test_a_goal_prints_the_ratio_it_judges():
    r = {"change_s": [0.05], "pods": 1000, "policies": 1000,
         "throughput_gbps": {"no tables": {"across": [10.0]}, "policies": {"across": [9.46]}}}
    line = next(x for x in policy.goals(r) if x.startswith("throughput"))
    assert "0.946x, NOT met" in line
    r["throughput_gbps"]["policies"]["across"] = [9.5]
    assert "0.950x, met" in next(x for x in policy.goals(r) if x.startswith("throughput"))
    r["throughput_gbps"]["policies"]["across"] = [9.496]  # under the goal by less than 0.0005
    assert "0.9496x, NOT met" in next(x for x in policy.goals(r) if x.startswith("throughput"))
