"""What ``GET /flows``, ``/status`` and /metrics show of the flow recorder.  Reads only.

Metrics have bounded label sets: verdicts (2), drop reasons (:data:`agentd.flows.model.REASONS`,
``unknown`` among them) by direction (4), where records were suppressed (kernel, agent) and where
events were lost (conntrack, log).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .model import VERDICTS, Flow, FlowFilter
from .recorder import FlowRecorder
from .ring import Follower, LastSearch

# Records a search of the ring looks at between two turns of the event loop: some milliseconds
# (a filter's match is about a microsecond), so BGP, etcd and other requests wait no longer.
SEARCH_STEP = 10_000


class FlowViews:
    def __init__(self, recorder: FlowRecorder, kernel_suppressed: Callable[[], int] = lambda: 0) -> None:
        self.recorder = recorder
        self.kernel_suppressed = kernel_suppressed  # drops the log rules' nft limit held back

    def search(self, flt: FlowFilter, n: int, since: float | None = None, after: str | None = None) -> LastSearch:
        """The last ``n`` matching records of the ring as it is now, to be searched (:meth:`finish`).
        ``after``: a :meth:`cursor` -- only the records made after it (all, if it is another
        ring's: this node restarted since)."""
        ring = self.recorder.ring
        ring_id, _, seq = (after or "").partition(":")
        return ring.search(flt, n, since=since, after=int(seq) if after and ring_id == ring.id else None)

    def cursor(self) -> str:
        """Where the ring is now (``ID:SEQ``: its last record's number): what ``after`` takes."""
        ring = self.recorder.ring
        return f"{ring.id}:{ring.seq}"

    async def last(self, flt: FlowFilter, n: int, since: float | None = None, after: str | None = None) -> list[Flow]:
        return await self.finish(self.search(flt, n, since, after))

    @staticmethod
    async def finish(search: LastSearch) -> list[Flow]:
        """Search ``SEARCH_STEP`` records at a time, the event loop free in between."""
        while not search.step(SEARCH_STEP):
            await asyncio.sleep(0)
        return search.result()

    def follow(self, flt: FlowFilter, pool: str = "open") -> Follower:
        """``pool``: "trusted" for a reader with a credential (agentd/flows/ring.py)."""
        return self.recorder.ring.follow(flt, pool=pool)

    def unfollow(self, follower: Follower) -> None:
        self.recorder.ring.unfollow(follower)

    def followers(self, pool: str | None = None) -> int:
        ring = self.recorder.ring
        return len(ring.followers) if pool is None else ring.following(pool)

    def status(self) -> dict[str, Any]:
        r = self.recorder
        return {
            "on": True,
            "connections": r.connections,  # False: drops only ([flows] connections = false)
            "records": len(r.ring),
            "ring_size": r.ring.size,
            "seq": r.ring.seq,
            "flows": {v: r.flows.get(v, 0) for v in VERDICTS},
            # agent_evicted: of agent's, folded into a key the limiter forgot before its next
            # record (a storm of more than its 4,096 keys): shown by no record's suppressed
            "suppressed": {"kernel": self.kernel_suppressed(), "agent": r.limiter.suppressed,
                           "agent_evicted": r.limiter.evicted},
            "lost": dict(r.lost),
            "followers": len(r.ring.followers),
            "log_group": r.group,
            # Pods' IPv4 TCP connections recorded by the pod programs (conntrack's events of
            # them masked): with other nodes' pods too (remote), ended by the agent's sweep;
            # taken by it and not put back (the map full, or the tuple reused): ended then, or
            # unanswered SYNs lost.
            # remote: as the programs are set (no wire program: not), not as the agent asked.
            "programs": {"recording": r.recording is not None,
                         "remote": r.recording is not None and r.recording.records_remote(),
                         "swept": r.swept, "not_put_back": {k: r.not_put_back.get(k, 0) for k in ("ended", "lost")}},
        }

    def collect(self):
        r = self.recorder
        flows = CounterMetricFamily("agentd_flows", "flow records of this node's pods by verdict "
                                    "(forwarded: connections conntrack confirmed or ended; dropped: drops logged)",
                                    labels=["verdict"])  # fmt: skip
        for verdict in VERDICTS:
            flows.add_metric([verdict], float(r.flows.get(verdict, 0)))
        drops = CounterMetricFamily("agentd_flow_drops", "packets dropped, by reason and direction "
                                    "(those the agent's limit folded included)", labels=["reason", "direction"])
        for (reason, direction), n in sorted(r.drops.items()):
            drops.add_metric([reason, direction], float(n))
        suppressed = CounterMetricFamily("agentd_flow_drops_suppressed", "drops not recorded: over the kernel's "
                                         "log limit, or folded by the agent's limit", labels=["where"])
        suppressed.add_metric(["kernel"], float(self.kernel_suppressed()))
        suppressed.add_metric(["agent"], float(r.limiter.suppressed))
        evicted = CounterMetricFamily("agentd_flow_drops_suppressed_evicted", "of the drops the agent's limit "
                                      "folded, those whose key it forgot before their next record (no record "
                                      "shows them)")
        evicted.add_metric([], float(r.limiter.evicted))
        lost = CounterMetricFamily("agentd_flow_events_lost", "conntrack events, logged packets and the pod "
                                   "programs' connection records the kernel could not queue for the agent",
                                   labels=["source"])
        for source in ("conntrack", "log", "programs"):
            lost.add_metric([source], float(r.lost.get(source, 0)))
        ring = GaugeMetricFamily("agentd_flow_ring_records", "flow records held in the node's ring")
        ring.add_metric([], float(len(r.ring)))
        yield from (flows, drops, suppressed, evicted, lost, ring)
