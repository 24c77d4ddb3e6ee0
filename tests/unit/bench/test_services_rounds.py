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
