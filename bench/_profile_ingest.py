"""Where agentd's speaker spends its time ingesting the bench/bgp_ingest.py stream (cProfile).

    .venv/bin/python bench/_profile_ingest.py [--n 1000000] [--regime packed] [--top 25] [--sort tottime]

No root, no network: the speaker is built exactly as ``agentd speaker`` builds it (the
same TOML through agentd.config.settings and agentd.daemon.speaker.local_settings/peer_settings), an
inbound session from the feeder is opened sans-IO (the feeder's OPEN and KEEPALIVE fed
to Speaker.data_received), and then the same pre-encoded UPDATE stream goes into
Speaker.data_received in 256 KiB pieces, the most bgp.transport reads at once.  What
the asyncio transport adds on top is the difference to bgp_ingest.py's agentd time.

Three passes, each on a fresh speaker: unprofiled (the plain in-process rate, with the
time the cyclic GC took), unprofiled with the GC off, and under cProfile; then the top
functions by own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentd.config.settings import load_config
from agentd.daemon.speaker import local_settings, peer_settings
from bench._common import int_list
from bench._feeder import FeedStream, build_stream
from bench._speakers import DUT_ADDR, FEEDER_ADDR, FEEDER_AS, HOLD_TIME, AgentdSpeaker
from bgp import Speaker
from bgp.views import peer_views
from proto.capabilities import FourOctetAs, MultiProtocol, RouteRefresh
from proto.messages import Keepalive, Open

READ = 256 * 1024  # bgp.transport.READ_CHUNK
CONN = -1  # the id bgp.transport gives the first inbound connection


def fresh_speaker(workdir: Path) -> Speaker:
    """A Speaker configured from the same TOML bgp_ingest.py gives ``agentd speaker``, session up."""
    AgentdSpeaker(None, workdir).write_config()  # type: ignore[arg-type]
    cfg = load_config(str(workdir / "agentd.toml"), require_file=True)
    now = time.monotonic()
    speaker = Speaker(local_settings(cfg), now=now)
    speaker.set_peers([peer_settings(p, cfg) for p in cfg.bgp.peers], now)
    speaker.start(now)
    if not speaker.accept(CONN, FEEDER_ADDR, now, DUT_ADDR):
        raise SystemExit("the speaker refused the feeder's connection")
    caps = (MultiProtocol(1, 1), RouteRefresh(), FourOctetAs(FEEDER_AS))
    speaker.data_received(CONN, Open.build(FEEDER_AS, HOLD_TIME, FEEDER_ADDR, caps).encode(), now)
    speaker.data_received(CONN, Keepalive().encode(), now)
    speaker.take_actions()
    state = peer_views(speaker)[0].state
    if state.lower() != "established":
        raise SystemExit(f"session with the feeder is {state}, not Established")
    return speaker


def feed(speaker: Speaker, stream: FeedStream) -> float:
    """Push the stream through data_received as the transport would; returns seconds."""
    data = b"".join(stream.chunks)
    start = time.perf_counter()
    for i in range(0, len(data), READ):
        speaker.data_received(CONN, data[i : i + READ], time.monotonic())
        speaker.take_actions()  # bgp.transport's _pump after every read
    return time.perf_counter() - start


def received(speaker: Speaker) -> int:
    return peer_views(speaker)[0].prefixes_received


class GcClock:
    """Collections and seconds spent in them, per generation (gc.callbacks)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            gen = info["generation"]
            self.count[gen] += 1
            self.seconds[gen] += time.perf_counter() - self._start

    def __str__(self) -> str:
        parts = [f"gen{g} {self.count[g]}x {self.seconds[g]:.2f} s" for g in range(3)]
        return f"{sum(self.seconds):.2f} s in the cyclic GC ({', '.join(parts)})"


def timed_pass(workdir: Path, stream: FeedStream, *, gc_enabled: bool) -> str:
    speaker = fresh_speaker(workdir)
    clock = GcClock()
    gc.callbacks.append(clock)
    if not gc_enabled:
        gc.disable()
    try:
        seconds = feed(speaker, stream)
    finally:
        gc.enable()
        gc.callbacks.remove(clock)
    n = stream.prefixes
    line = f"{seconds:.3f} s, {n / seconds:,.0f} prefixes/s, {received(speaker):,} received, Loc-RIB {speaker.rib.count():,}"
    del speaker
    gc.collect()
    return line + (f"; {clock}" if gc_enabled else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="_profile_ingest", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int_list, default=[1_000_000], help="prefix count (default 1000000)")
    p.add_argument("--top", type=int, default=25, help="functions to show (default 25)")
    p.add_argument("--sort", default="tottime", choices=("tottime", "cumulative"), help="first listing's order")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--regime", choices=("one", "three", "packed"), default="packed",
                   help="the stream of bench/bgp_ingest.py to feed (default packed)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ad-profile-ingest-") as tmp:
        workdir = Path(tmp)
        for n in args.n:
            stream = build_stream(n, regime=args.regime, next_hop=FEEDER_ADDR, seed=args.seed)
            print(f"N={n}: {stream.describe()}")
            gc.collect()
            print(f"  unprofiled:          {timed_pass(workdir, stream, gc_enabled=True)}")
            print(f"  unprofiled, GC off:  {timed_pass(workdir, stream, gc_enabled=False)}")
            speaker = fresh_speaker(workdir)
            prof = cProfile.Profile()
            prof.enable()
            seconds = feed(speaker, stream)
            prof.disable()
            print(f"  profiled:            {seconds:.3f} s ({received(speaker):,} received)")
            stats = pstats.Stats(prof, stream=sys.stdout).strip_dirs()
            for order in (args.sort, "cumulative" if args.sort == "tottime" else "tottime"):
                print(f"\n  top {args.top} by {order}:")
                stats.sort_stats(order).print_stats(args.top)
            del speaker
            gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
