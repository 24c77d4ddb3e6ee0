"""wrk, the HTTP load generator (Debian's), run in a lab namespace, and a C server for it:
HAProxy answering every request itself (no backend).  bench/ingress.py drives requests
through proxies with it; bench/flows.py makes many short TCP connections with it (one
request per connection, ``Connection: close``), a client and a server in C whose own work
per connection is small beside the network's, so that what recording a connection costs is
not hidden behind an interpreter's.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from bench._common import BenchError
from bench._iperf import serving

from agentd.lab.netns import Netns


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    assert m, text
    return float(m.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[m.group(2)]


async def run(ns: Netns, url: str, seconds: float, *, host: str | None = None, close: bool = False, threads: int = 2,
              connections: int = 16, need_answers: bool = True, prefix: Sequence[str] = ()) -> dict[str, float]:  # fmt: skip
    """One wrk run in ``ns`` (``prefix``: e.g. ``taskset -c 0``) for ``seconds`` (whole, at
    least 1); ``close``: a new connection per request.  ``rps`` counts answered requests only
    (not non-2xx/3xx); ``failed`` = connect, read and write errors + error answers
    (``timeouts``, answers slower than 2 s, apart).  A run with none answered is
    a BenchError unless ``need_answers`` is false (churn: there the failed requests are the
    figure, and a run that failed them all is a NOT met)."""
    args = [*prefix, "wrk", "-t", str(threads), "-c", str(connections), "-d", f"{max(1, int(seconds))}s", "--latency"]
    if host:
        args += ["-H", f"Host: {host}"]
    if close:
        args += ["-H", "Connection: close"]
    rc, out, err = await ns.aexec(*args, url, check=False, timeout=seconds + 60)
    text = out.decode()
    if rc != 0 or "requests in" not in text:
        raise BenchError(f"wrk {url} failed (exit {rc}): {err.decode().strip() or text.strip()}")
    total = int(re.search(r"(\d+) requests in", text).group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    connect, read, write, timeouts = (int(x) for x in m.groups()) if m else (0, 0, 0, 0)
    non2xx = int(m.group(1)) if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", text)) else 0
    # wrk's Requests/sec counts every response, error answers (non-2xx/3xx) too: requests/s
    # here, and the goals judged on them, count the answered ones only (at wrk's rate).
    rps_all = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
    if need_answers and total <= non2xx:
        raise BenchError(f"wrk {url}: no request answered ({total} responses, {non2xx} of them errors; "
                         f"{connect + read + write} socket errors)")
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", text, re.MULTILINE).group(1))
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", text, re.MULTILINE).group(1))
    # A slow answer (over wrk's 2 s timeout) is counted both as an answer and as a timeout:
    # ``timeouts`` apart, not among the failed.  A connect error loses that connection for
    # the rest of the run (wrk does not open it again): ``connect_errors`` apart too.
    return {"requests": total, "answered": total - non2xx, "rps": rps_all * (total - non2xx) / total if total else 0.0,
            "rps_all": rps_all, "p50_ms": p50, "p99_ms": p99, "failed": connect + read + write + non2xx,
            "connect_errors": connect, "timeouts": timeouts}


def answering_config(port: int) -> str:
    """HAProxy's configuration for :func:`answering`: one thread, one frontend on ``port``
    that answers 200 "ok" itself, no log."""
    return "\n".join(["global", "    nbthread 1", "defaults", "    mode http", "    no log", "    timeout connect 5s",
                      "    timeout client 10s", "    timeout server 10s", "frontend answer", f"    bind :{port}",
                      "    http-request return status 200 content-type text/plain string ok", ""])  # fmt: skip


@contextlib.asynccontextmanager
async def answering(ns: Netns, port: int, *, prefix: Sequence[str] = (), what: str = "HAProxy") -> AsyncIterator[None]:
    """HAProxy in ``ns`` (``prefix``: e.g. ``taskset -c 1``) answering every HTTP request on
    ``port`` itself, in a session of its own as a daemon runs (see bench/ingress.py: the
    scheduler's autogroups), listening before the body runs; stopped after it."""
    with tempfile.TemporaryDirectory(prefix="agentd-answer-") as tmp:
        cfg = Path(tmp) / "haproxy.cfg"
        cfg.write_text(answering_config(port))
        async with serving(ns, [*prefix, "haproxy", "-db", "-f", str(cfg)], port, what, new_session=True):
            yield
