"""The BGP speaker's views as the REST API's JSON (README.md "REST": /peers, /rib).

bgp/ hands out typed views (:class:`bgp.PeerView`, :class:`bgp.RibPathView`); turning them
into JSON rows is the agent's business and lives here.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import Any

from bgp import PeerView, RibPathView, Speaker
from bgp.views import rib_paths, rib_prefixes
from proto.attributes import community_to_str
from proto.nlri import prefix_from_str, prefix_to_str

#: Prefixes rendered per chunk of a streamed /rib.
RIB_CHUNK = 1000


def peer_row(v: PeerView, wall_time: Callable[[float], float]) -> dict[str, Any]:
    return {
        "address": v.address,
        "asn": v.asn,
        "type": v.kind,
        "state": v.state,
        "since": round(wall_time(v.since), 3),
        "prefixes_received": v.prefixes_received,
        "prefixes_sent": v.prefixes_sent,
        "stale": v.stale,
        "router_id": v.router_id,
        "hold_time": v.hold_time,
        "families": list(v.families),
        "graceful_restart": v.graceful_restart,
        "info": v.last_error,
        "flaps": v.flaps,
        "description": v.description,
        "in_sync": v.in_sync,
        "max_prefixes": v.max_prefixes,
        "held_down": v.held_down,
    }


def rib_row(v: RibPathView) -> dict[str, Any]:
    path = v.path
    a = path.attributes
    return {
        "prefix": prefix_to_str(v.family[0], v.prefix),
        "next_hop": str(path.next_hop) if path.next_hop is not None else None,
        "as_path": str(a.as_path),
        "origin": a.origin,
        "local_pref": a.local_pref,
        "med": a.med,
        "communities": [community_to_str(c) for c in a.communities],
        "large_communities": [":".join(map(str, c)) for c in a.large_communities],
        "originator_id": str(a.originator_id) if a.originator_id else None,
        "cluster_list": [str(c) for c in a.cluster_list],
        "peer": path.source.key,
        "best": v.best,
        "reason": v.reason.value if v.reason is not None else None,
        "stale": path.stale,
    }


class RibQuery:
    """Which part of the Loc-RIB a /rib request wants: one prefix, or a page after a prefix."""

    def __init__(self, *, prefix: str | None = None, after: str | None = None, limit: int | None = None) -> None:
        self.prefix = _parse(prefix, "prefix") if prefix else None
        self.after = _parse(after, "after") if after else None
        if limit is not None and limit < 1:
            raise ValueError("limit must be a positive number of prefixes")
        self.limit = limit

    def chunks(self, speaker: Speaker) -> Iterator[list[dict[str, Any]]]:
        """The rows, a few hundred prefixes at a time, read from the RIB as it is when each
        chunk is made (a prefix gone by then is left out)."""
        if self.prefix is not None:
            yield [rib_row(v) for v in rib_paths(speaker.rib, *self.prefix)]
            return
        keys = rib_prefixes(speaker.rib)
        start = 0
        if self.after is not None:
            start = bisect.bisect_right(keys, self.after)
        end = len(keys) if self.limit is None else min(len(keys), start + self.limit)
        for i in range(start, end, RIB_CHUNK):
            rows = []
            for family, prefix in keys[i : min(end, i + RIB_CHUNK)]:
                rows.extend(rib_row(v) for v in rib_paths(speaker.rib, family, prefix))
            yield rows


def _parse(text: str, what: str) -> tuple[tuple[int, int], bytes]:
    try:
        afi, prefix = prefix_from_str(text)
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None
    return (afi, 1), prefix
