"""bench/ingress.py's figures and goals with made-up wrk runs: the throughput goal is judged on
the ratio it prints (three decimals) and counts answered requests only."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import ingress
from bench._common import BenchError


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


WRK_OUT = """Running 5s test @ http://10.0.0.1/bytes/64
  2 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.20ms  300.00us   9.00ms   90.00%
    Req/Sec     4.00k   100.00     4.20k    70.00%
  Latency Distribution
     50%    1.10ms
     75%    1.30ms
     90%    1.50ms
     99%    2.50ms
  40000 requests in 5.00s, 6.00MB read
  Socket errors: connect 0, read 3, write 0, timeout 1
  Non-2xx or 3xx responses: 10000
Requests/sec:   8000.00
Transfer/sec:      1.20MB
"""


def _run_wrk(text: str, **kw) -> dict:
    async def aexec(*args, check, timeout):
        return 0, text.encode(), b""

    node = SimpleNamespace(ns=SimpleNamespace(aexec=aexec))
    return asyncio.run(ingress.wrk(SimpleNamespace(nodes=[node, node]), "http://10.0.0.1/bytes/64", 5, **kw))


def test_requests_per_second_count_answered_requests_only():
    got = _run_wrk(WRK_OUT)  # 10,000 of wrk's 40,000 responses were errors: 8000/s answered 6000/s
    assert got["rps"] == 6000 and got["rps_all"] == 8000 and got["failed"] == 10_004


def test_a_run_with_no_request_answered_stops_the_bench():
    none_answered = WRK_OUT.replace("Non-2xx or 3xx responses: 10000", "Non-2xx or 3xx responses: 40000")
    with pytest.raises(BenchError, match="no request answered"):
        _run_wrk(none_answered)
    churn = _run_wrk(none_answered, need_answers=False)  # during churn the failed requests are the figure
    assert churn["rps"] == 0 and churn["failed"] == 40_004


def test_error_answers_count_against_the_throughput_goal(capsys):
    # The ingress answered as many requests a second as the anchor, a tenth of them with errors.
    ours = _run_wrk(WRK_OUT.replace("Non-2xx or 3xx responses: 10000", "Non-2xx or 3xx responses: 4000"))
    anchor = _run_wrk(WRK_OUT.replace("Non-2xx or 3xx responses: 10000", "Non-2xx or 3xx responses: 0"))
    ingress.report(_out(anchor, ours))
    goals = _goals(capsys)
    assert len(goals) == 2 and all("0.900x: met" in g for g in goals)
    ours = _run_wrk(WRK_OUT.replace("Non-2xx or 3xx responses: 10000", "Non-2xx or 3xx responses: 4040"))
    ingress.report(_out(anchor, ours))
    assert all("0.899x: NOT met" in g for g in _goals(capsys))
