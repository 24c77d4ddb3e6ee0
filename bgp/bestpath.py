"""Best-path selection: RFC 4271 §9.1.2.2 with the RFC 4456 §9 tie-breaks.

:func:`select` runs the RFC's elimination procedure over all candidate paths for
one prefix and returns the winner and the :class:`Reason` at which the last
competitor fell, so /rib can say *why* a route won (GoBGP's BestPathReason, BIRD's
``bgp_rte_better`` labels).  Every step is a pure filter over the candidates.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from ipaddress import IPv4Address, IPv6Address
from typing import Protocol

from proto.attributes import PathAttributes

DEFAULT_LOCAL_PREF = 100


class CandidateSource(Protocol):
    """What selection reads of a path's source (bgp.rib.Source has it)."""

    address: IPv4Address | IPv6Address | None
    local_asn: int
    router_id: IPv4Address
    ibgp: bool
    local: bool


class Candidate(Protocol):
    """What selection reads of a candidate path (bgp.rib.Path has it); typed here so
    bestpath needs nothing from the RIB that calls it."""

    source: CandidateSource
    attributes: PathAttributes
    stale: bool


class Reason(enum.Enum):
    ONLY_PATH = "only path"
    NOT_STALE = "not stale"  # RFC 4724 stale routes lose to fresh ones (BIRD does the same)
    LOCAL_ORIGIN = "locally originated"
    LOCAL_PREF = "highest local preference"
    AS_PATH = "shortest AS path"
    ORIGIN = "lowest origin"
    MED = "lowest MED"
    EBGP = "external over internal"
    ROUTER_ID = "lowest router id"
    CLUSTER_LIST = "shortest cluster list"
    PEER_ADDRESS = "lowest peer address"


def local_pref(path: Candidate) -> int:
    """Degree of preference (§9.1.1): LOCAL_PREF for internal routes, the default otherwise."""
    lp = path.attributes.local_pref
    return DEFAULT_LOCAL_PREF if lp is None else lp


def neighbor_as(path: Candidate) -> int:
    """The AS a route came from, for MED comparison (§9.1.2.2 c): leftmost AS_SEQUENCE AS,
    or our own AS for routes with an empty AS_PATH (originated inside the AS)."""
    first = path.attributes.as_path.first_asn()
    return path.source.local_asn if first is None else first


def originator(path: Candidate) -> int:
    """BGP Identifier for step f): ORIGINATOR_ID when present (RFC 4456 §9)."""
    oid = path.attributes.originator_id
    return int(oid if oid is not None else path.source.router_id)


def _keep_min(key: Callable[[Candidate], int]) -> Callable[[list[Candidate]], list[Candidate]]:
    def step(paths: list[Candidate]) -> list[Candidate]:
        best = min(key(p) for p in paths)
        return [p for p in paths if key(p) == best]

    return step


def _keep_max(key: Callable[[Candidate], int]) -> Callable[[list[Candidate]], list[Candidate]]:
    def step(paths: list[Candidate]) -> list[Candidate]:
        best = max(key(p) for p in paths)
        return [p for p in paths if key(p) == best]

    return step


def _med_step(paths: list[Candidate]) -> list[Candidate]:
    # §9.1.2.2 c): MED is compared only among routes from the same neighbouring AS;
    # a route is removed if another route from that AS has a lower MED.  A missing
    # MED is the lowest possible value (0).
    lowest: dict[int, int] = {}
    for p in paths:
        asn, med = neighbor_as(p), p.attributes.med or 0
        if asn not in lowest or med < lowest[asn]:
            lowest[asn] = med
    return [p for p in paths if (p.attributes.med or 0) == lowest[neighbor_as(p)]]


def _ebgp_step(paths: list[Candidate]) -> list[Candidate]:
    # §9.1.2.2 d): if any route was learned from an external peer, drop the internal ones.
    external = [p for p in paths if not p.source.ibgp and not p.source.local]
    return external or paths


def _peer_address(path: Candidate) -> int:
    addr = path.source.address
    return -1 if addr is None else int(addr)


STEPS: tuple[tuple[Reason, Callable[[list[Candidate]], list[Candidate]]], ...] = (
    (Reason.NOT_STALE, _keep_min(lambda p: 1 if p.stale else 0)),
    (Reason.LOCAL_ORIGIN, _keep_max(lambda p: 1 if p.source.local else 0)),
    # §9.1.1 / §9.1.2: highest degree of preference.
    (Reason.LOCAL_PREF, _keep_max(local_pref)),
    # §9.1.2.2 a): shortest AS_PATH (an AS_SET counts as one).
    (Reason.AS_PATH, _keep_min(lambda p: p.attributes.as_path.path_length())),
    # §9.1.2.2 b): lowest ORIGIN (IGP < EGP < INCOMPLETE).
    (Reason.ORIGIN, _keep_min(lambda p: p.attributes.origin or 0)),
    (Reason.MED, _med_step),
    (Reason.EBGP, _ebgp_step),
    # §9.1.2.2 e) (lowest interior cost) does not apply: we have no IGP, all next hops cost the same.
    # §9.1.2.2 f) with RFC 4456 §9: lowest BGP Identifier, ORIGINATOR_ID standing in for it.
    (Reason.ROUTER_ID, _keep_min(originator)),
    # RFC 4456 §9: "inserted between steps f) and g)": shorter CLUSTER_LIST.
    (Reason.CLUSTER_LIST, _keep_min(lambda p: len(p.attributes.cluster_list))),
    # §9.1.2.2 g): lowest peer address.
    (Reason.PEER_ADDRESS, _keep_min(_peer_address)),
)


def select(candidates: Sequence[Candidate]) -> tuple[Candidate, Reason]:
    """The best path among ``candidates`` (non-empty) and the step that decided it."""
    if len(candidates) == 1:
        return candidates[0], Reason.ONLY_PATH
    paths = list(candidates)
    for reason, step in STEPS:
        paths = step(paths)
        if len(paths) == 1:
            return paths[0], reason
    # Identical on every step (same peer announced it twice cannot happen in one
    # Adj-RIB-In); keep the first for stability.
    return paths[0], Reason.PEER_ADDRESS


def rank(candidates: Sequence[Candidate]) -> list[tuple[Candidate, Reason]]:
    """All candidates, best first, each with the reason it beat the ones after it."""
    rest = list(candidates)
    out: list[tuple[Candidate, Reason]] = []
    while rest:
        best, reason = select(rest)
        out.append((best, reason))
        rest = [p for p in rest if p is not best]
    return out
