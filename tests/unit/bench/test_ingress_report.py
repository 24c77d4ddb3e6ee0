"""bench/ingress.py's figures and goals with made-up wrk runs: the throughput goal is judged on
the ratio it prints (three decimals) and counts answered requests only."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import ingress


def _wrk(rps: float, failed: int = 0) -> dict:
    return {"requests": int(rps * 5), "rps": rps, "p50_ms": 1.0, "p99_ms": 2.0, "failed": failed}


def _out(anchor: dict, ours: dict) -> dict:
    rows = [{"row": row, "mode": m, **run, "proxy_cpu_us": None} for m in ("keep-alive", "new connection")
            for row, run in (("proxy alone (anchor)", anchor), ("agentd ingress", ours))]
    return {"load": (0.5, 0.5, 0.5), "rows": rows,
            "both": [{"mode": m, "anchor": anchor, "ingress": ours} for m in ("keep-alive", "new connection")]}


def _goals(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if "throughput through the ingress" in line]


def test_the_goal_prints_the_ratio_it_judges(capsys):
    ingress.report(_out(_wrk(1000), _wrk(896)))  # 0.896 printed with 2 decimals read "0.90x: NOT met"
    goals = _goals(capsys)
    assert len(goals) == 2 and all("0.896x: NOT met" in g for g in goals)
