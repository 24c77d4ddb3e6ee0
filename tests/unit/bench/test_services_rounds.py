"""bench/services.py's throughput pair: the VIP run and the direct run take turns at going
first (a drift of the shared machine falls on both alike), and iperf3's client and server are
pinned to CPUs 0 and 1, as the connection-rate rounds and the table's title say."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import services
from bench._common import Iperf3Run


def test_throughput_pairs_alternate_and_are_pinned(monkeypatch):
    servers, clients = [], []

    @contextlib.asynccontextmanager
    async def server(ns, **kw):
        servers.append(kw.get("prefix"))
        yield

    async def client(ns, dst, seconds, **kw):
        clients.append((dst, kw.get("prefix")))
        return Iperf3Run(9.0 if dst == "10.244.1.2" else 8.0, 0)

    monkeypatch.setattr(services._iperf, "server", server)
    monkeypatch.setattr(services._iperf, "client", client)
    bw = asyncio.run(services.throughput_rounds("client-ns", "server-ns", "10.244.1.2", "10.96.0.10", 2.0))
    assert bw == {"direct": [9.0, 9.0], "vip": [8.0, 8.0]}
    assert [dst for dst, _ in clients] == ["10.244.1.2", "10.96.0.10", "10.96.0.10", "10.244.1.2"]
    assert servers == [("taskset", "-c", "1")]
    assert {prefix for _, prefix in clients} == {("taskset", "-c", "0")}


class _Echo:
    """svcecho's client: ``failures`` maps (destination, run number) to the connections that failed."""

    def __init__(self, failures):
        self.failures, self.runs = failures, []

    async def crr(self, ip, port, seconds):
        self.runs.append((ip, port))
        failed = self.failures.get((ip, len(self.runs)), 0)
        return {"connections": 1000 if ip == "10.244.1.2" else 900, "failed": failed, "seconds": seconds}


def test_connection_rate_rounds_judge_their_failed_connections():
    """As bench/flows.py does (bench._common.crr_checked): the failed connections are counted,
    and a run with more than 1% of them failed stops the bench, naming the run; 1% is let through."""
    import pytest

    from bench._common import BenchError

    echo = _Echo({("10.96.0.10", 2): 9})  # 9 of 909: under 1%
    crr, failed = asyncio.run(services.crr_rounds(echo, "10.244.1.2", "10.96.0.10", 2.0))
    assert failed == 9 and len(crr["direct"]) == len(crr["vip"]) == services.CRR_ROUNDS
    assert crr["vip"][0] == 450.0 and echo.runs[:4] == [("10.244.1.2", 8080), ("10.96.0.10", 80),
                                                         ("10.96.0.10", 80), ("10.244.1.2", 8080)]
    with pytest.raises(BenchError, match=r"connections vip \(10\.96\.0\.10:80\), round 2: 10 of 910 connections failed"):
        asyncio.run(services.crr_rounds(_Echo({("10.96.0.10", 3): 10}), "10.244.1.2", "10.96.0.10", 2.0))
