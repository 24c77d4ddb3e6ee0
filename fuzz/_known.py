"""Report-only switches for known failures, shared by the harnesses.

A harness check that has found a bug someone else is fixing is turned into a report
(one line on stderr the first few times, no crash) while its ``KNOWN_*`` flag is True,
so that the short CI run stays green and the fuzzer keeps exploring past it.  The
reproducers live under ``fuzz/crashes/<target>/``; ``FUZZ_STRICT=1`` in the environment
turns every flag off, which is how those reproducers are checked to still fail.
"""

from __future__ import annotations

import os
import sys

STRICT = os.environ.get("FUZZ_STRICT", "") not in ("", "0")
_REPORTED: dict[str, int] = {}
_SHOWN = 3  # lines printed per flag; the rest are only counted


def enabled(flag: bool) -> bool:
    """Whether a known-failure flag is in force (always False under FUZZ_STRICT=1)."""
    return flag and not STRICT


def report(name: str, what: str) -> None:
    """Note one occurrence of the known failure ``name``."""
    n = _REPORTED.get(name, 0) + 1
    _REPORTED[name] = n
    if n <= _SHOWN:
        line = what.replace("\n", " ")[:300]
        print(f"[known failure {name} #{n}] {line}", file=sys.stderr, flush=True)
