"""Timing a tool inside a scratch namespace the way a daemon living there would run it: the
calling thread enters the namespace and starts the tool itself, so ``ip netns exec`` (its
own setns and exec, a few milliseconds) is not in the figure."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence

from bench._common import BenchError

from agentd.lab.netns import Netns


def timed(ns: Netns, argv: Sequence[str], input: bytes | None = None, timeout: float = 1800) -> tuple[float, str]:
    """Run ``argv`` in ``ns``: (wall seconds, stdout); a non-zero exit is a BenchError."""
    with ns.entered():  # a child started from this thread is born in ``ns``
        start = time.perf_counter()
        proc = subprocess.run(list(argv), input=input, capture_output=True, timeout=timeout, check=False)
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        said = proc.stderr.decode(errors="replace").strip().splitlines()
        raise BenchError(f"{' '.join(argv[:3])} in {ns.name} exited {proc.returncode}: {' / '.join(said[:3])[:300]}")
    return seconds, proc.stdout.decode()
