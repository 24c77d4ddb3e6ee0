"""bench/_wrk.py: wrk's report read as it prints it (a run of wrk 4.1 here, one request per
connection against the HAProxy that answers itself), failures counted, never a silent zero."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import _wrk
from bench._common import BenchError

CLOSE = """Running 1s test @ http://127.0.0.1:8099/
  1 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   630.92us    1.19ms   9.96ms   89.93%
    Req/Sec     8.41k     2.70k   12.05k    72.73%
  Latency Distribution
     50%  244.00us
     75%  358.00us
     90%    1.85ms
     99%    6.09ms
  9190 requests in 1.10s, 762.84KB read
Requests/sec:   8349.35
Transfer/sec:    693.06KB
"""


class _Ns:
    def __init__(self, rc: int, out: str, err: str = "") -> None:
        self.answer = (rc, out.encode(), err.encode())
        self.args: tuple = ()

    async def aexec(self, *args, check=True, timeout=60):
        self.args = args
        return self.answer


def _run(ns: _Ns, **kw) -> dict:
    return asyncio.run(_wrk.run(ns, "http://10.244.1.2:8081/", 3.0, **kw))


def test_a_run_is_read_as_wrk_prints_it():
    ns = _Ns(0, CLOSE)
    got = _run(ns, close=True, threads=1, connections=4, prefix=("taskset", "-c", "0"))
    assert got == {"requests": 9190, "answered": 9190, "rps": 8349.35, "rps_all": 8349.35, "p50_ms": 0.244,
                   "p99_ms": 6.09, "failed": 0, "connect_errors": 0, "timeouts": 0}
    assert ns.args == ("taskset", "-c", "0", "wrk", "-t", "1", "-c", "4", "-d", "3s", "--latency", "-H", "Connection: close",
                       "http://10.244.1.2:8081/")


def test_socket_errors_and_error_answers_are_failed_and_not_counted_as_answered():
    text = CLOSE.replace("Requests/sec", "  Socket errors: connect 2, read 3, write 1, timeout 4\n"
                                         "  Non-2xx or 3xx responses: 10\nRequests/sec")
    got = _run(_Ns(0, text))
    # a timeout is a slow answer, counted among the answers by wrk: apart, not failed
    assert got["failed"] == 16 and got["answered"] == 9180 and got["connect_errors"] == 2 and got["timeouts"] == 4
    assert got["rps"] == pytest.approx(8349.35 * 9180 / 9190)


@pytest.mark.parametrize("rc, out, err", [(1, "", "unable to connect to 10.244.1.2:8081 Connection refused"),
                                          (0, "garbled", "")])
def test_a_run_that_failed_is_an_error_naming_why(rc, out, err):
    with pytest.raises(BenchError, match="wrk http://10.244.1.2:8081/ failed"):
        _run(_Ns(rc, out, err))


def test_a_run_with_nothing_answered_is_an_error_unless_failures_are_the_figure():
    text = CLOSE.replace("Requests/sec", "  Non-2xx or 3xx responses: 9190\nRequests/sec")
    with pytest.raises(BenchError, match="no request answered"):
        _run(_Ns(0, text))
    assert _run(_Ns(0, text), need_answers=False)["rps"] == 0.0


def test_the_answering_haproxy_serves_the_port_itself_on_one_thread():
    cfg = _wrk.answering_config(8082).splitlines()
    assert "    bind :8082" in cfg and "    nbthread 1" in cfg
    assert any(line.strip().startswith("http-request return status 200") for line in cfg)
    assert not any(line.strip().startswith(("backend", "server", "default_backend")) for line in cfg)
