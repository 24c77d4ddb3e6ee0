"""Where agentd's speaker keeps its memory after ingesting the bench/bgp_ingest.py stream (tracemalloc).

    .venv/bin/python bench/_mem_ingest.py [--n 200000] [--regime one] [--top 25] [--group lineno]

No root, no network: the same in-process speaker as bench/_profile_ingest.py (built from
the TOML bgp_ingest.py gives ``agentd speaker``, session opened sans-IO).  The stream is
built before tracing starts, so what is reported is the speaker's: the bytes it still
holds after the last UPDATE (per prefix, and by allocating line), the peak while feeding,
and the process RSS (VmHWM) for comparison with bgp_ingest.py's figure.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._feeder import build_stream  # noqa: E402
from bench._profile_ingest import feed, fresh_speaker, received  # noqa: E402
from bench._speakers import FEEDER_ADDR  # noqa: E402


def vm(field: str) -> int:
    """A /proc/self/status field in kB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="_mem_ingest", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200_000, help="prefix count (default 200000)")
    p.add_argument("--regime", choices=("one", "three", "packed"), default="one")
    p.add_argument("--top", type=int, default=25, help="lines to show (default 25)")
    p.add_argument("--group", choices=("lineno", "filename", "traceback"), default="lineno")
    p.add_argument("--no-trace", action="store_true", help="RSS and time only (no tracemalloc)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ad-mem-ingest-") as tmp:
        stream = build_stream(args.n, regime=args.regime, next_hop=FEEDER_ADDR, seed=args.seed)
        print(f"N={args.n}: {stream.describe()}")
        speaker = fresh_speaker(Path(tmp))
        gc.collect()
        rss0 = vm("VmRSS")
        if not args.no_trace:
            tracemalloc.start(8 if args.group == "traceback" else 1)
        before = tracemalloc.take_snapshot() if not args.no_trace else None
        cpu = time.process_time()
        seconds = feed(speaker, stream)
        cpu = time.process_time() - cpu
        gc.collect()
        rss1 = vm("VmRSS")
        print(f"  {seconds:.2f} s wall, {cpu:.2f} s CPU ({args.n / seconds:,.0f} prefixes/s, traced={not args.no_trace}); "
              f"{received(speaker):,} received, Loc-RIB {speaker.rib.count():,}")
        print(f"  RSS before feeding {rss0 / 1024:.1f} MB, after {rss1 / 1024:.1f} MB "
              f"(+{(rss1 - rss0) * 1024 / args.n:.0f} B/prefix), VmHWM {vm('VmHWM') / 1024:.1f} MB")
        if args.no_trace:
            return 0
        current, peak = tracemalloc.get_traced_memory()
        print(f"  traced: held {current / 1e6:.1f} MB ({current / args.n:.0f} B/prefix), peak {peak / 1e6:.1f} MB")
        after = tracemalloc.take_snapshot()
        stats = after.compare_to(before, args.group)
        print(f"\n  top {args.top} by {args.group} (held after the feed):")
        for stat in stats[: args.top]:
            if args.group == "traceback":
                print(f"  {stat.size_diff / 1e6:8.1f} MB {stat.count_diff:>9,} blocks")
                for line in stat.traceback.format()[-8:]:
                    print("      " + line)
            else:
                print(f"  {stat.size_diff / 1e6:8.1f} MB {stat.count_diff:>9,} blocks  {stat.traceback[0].filename.split('/wt-ingest2/')[-1]}:{stat.traceback[0].lineno}")
        del speaker
    return 0


if __name__ == "__main__":
    sys.exit(main())
