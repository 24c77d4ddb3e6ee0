"""glibc's heap: handing free pages back after a large, rare, transient allocation.

glibc keeps memory a program frees in its heaps (for the next malloc) unless it is at the
top of a heap or was its own mapping; a large transient of many small blocks -- libnftables'
parse tree of a first sync, libbpf's kernel BTF -- stays resident after it is freed, and
what the agent allocates next (Python objects come from their own mappings) lands on top.
:func:`malloc_trim` returns those pages to the kernel (malloc_trim(3)); it walks the heaps
once, a few milliseconds at most, so it is called only around such rare calls.
"""

from __future__ import annotations

import ctypes
from typing import Any

_trim: Any = None


def malloc_trim() -> None:
    """Give the free pages of glibc's heaps back to the kernel; a no-op on a libc without
    ``malloc_trim`` (musl)."""
    global _trim
    if _trim is None:
        _trim = getattr(ctypes.CDLL(None), "malloc_trim", False)
    if _trim:
        _trim(0)
