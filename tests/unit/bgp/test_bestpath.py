"""RFC 4271 §9.1.2.2 and RFC 4456 §9 decision steps, each with the reason it reports."""

from ipaddress import IPv4Address, ip_address

import pytest

from bgp.bestpath import Reason, rank, select
from bgp.rib import Path, Source
from proto.attributes import (
    AsPath,
    AsPathSegment,
    ClusterList,
    LocalPref,
    MultiExitDisc,
    Origin,
    OriginatorId,
    PathAttributes,
)

AS_SEQ, AS_SET = 2, 1


def src(addr, asn=65000, rid=None, local=False):
    return Source(addr, None if local else ip_address(addr), asn, 65000, IPv4Address(rid or (addr if not local else "1.1.1.1")), ibgp=asn == 65000, local=local)


def path(source, *, lp=None, asns=(), origin=0, med=None, oid=None, clusters=(), as_set=()):
    segs = []
    if asns:
        segs.append(AsPathSegment(AS_SEQ, tuple(asns)))
    if as_set:
        segs.append(AsPathSegment(AS_SET, tuple(as_set)))
    attrs = [Origin(origin), AsPath(tuple(segs))]
    if lp is not None:
        attrs.append(LocalPref(lp))
    if med is not None:
        attrs.append(MultiExitDisc(med))
    if oid:
        attrs.append(OriginatorId(IPv4Address(oid)))
    if clusters:
        attrs.append(ClusterList(tuple(IPv4Address(c) for c in clusters)))
    return Path(source, PathAttributes(tuple(sorted(attrs, key=lambda a: a.code))), ip_address(source.key) if not source.local else None)


A, B, C = src("10.0.0.1"), src("10.0.0.2"), src("10.0.0.3")
E1, E2 = src("192.0.2.1", asn=65001), src("192.0.2.2", asn=65002)


def test_single_path():
    p = path(A)
    assert select([p]) == (p, Reason.ONLY_PATH)


def test_local_preference_wins_first():
    hi, lo = path(B, lp=200, asns=(1, 2, 3)), path(A, lp=100)
    assert select([lo, hi]) == (hi, Reason.LOCAL_PREF)


def test_missing_local_pref_counts_as_100():
    assert select([path(A, lp=99), path(B)])[0].source is B


def test_shorter_as_path_and_as_set_counts_one():
    long_, short = path(E1, asns=(65001, 1, 2)), path(E2, asns=(65002,), as_set=(7, 8, 9))
    assert select([long_, short]) == (short, Reason.AS_PATH)


def test_lowest_origin():
    igp, inc = path(A, origin=0), path(B, origin=2)
    assert select([inc, igp]) == (igp, Reason.ORIGIN)


def test_med_only_between_same_neighbour_as():
    x = path(src("192.0.2.1", asn=65001), asns=(65001,), med=50)
    y = path(src("192.0.2.2", asn=65001, rid="9.9.9.9"), asns=(65001,), med=10)
    assert select([x, y]) == (y, Reason.MED)
    # Different neighbour ASes: MED is not compared; the router id decides.
    z = path(src("192.0.2.3", asn=65002, rid="1.1.1.1"), asns=(65002,), med=999)
    best, reason = select([y, z])
    assert best is z and reason is Reason.ROUTER_ID


def test_med_neighbour_as_of_ibgp_routes_is_the_first_as_of_the_path():
    # §9.1.2.2 c): the neighbouring AS is the leftmost AS of the AS_PATH, not the AS of the
    # session's peer (our own AS for every iBGP-learned route).  Two iBGP routes that entered
    # the AS from 65001 and 65002: their MEDs are not comparable, the router id decides.
    via_1, via_2 = path(A, asns=(65001,), med=50), path(B, asns=(65002,), med=10)
    assert select([via_2, via_1]) == (via_1, Reason.ROUTER_ID)


@pytest.mark.parametrize("ibgp_med, ebgp_med", [(50, 10), (10, 50)])
def test_med_compares_ibgp_and_ebgp_routes_from_the_same_neighbour_as(ibgp_med, ebgp_med):
    # An iBGP route that entered from 65001 and an eBGP route from 65001 share a neighbouring
    # AS, so MED decides, before external-over-internal does.
    internal, external = path(A, asns=(65001,), med=ibgp_med), path(E1, asns=(65001,), med=ebgp_med)
    winner = external if ebgp_med < ibgp_med else internal
    assert select([internal, external]) == (winner, Reason.MED)


def test_missing_med_is_lowest():
    x = path(src("192.0.2.1", asn=65001), asns=(65001,), med=5)
    y = path(src("192.0.2.2", asn=65001, rid="9.9.9.9"), asns=(65001,))
    assert select([x, y]) == (y, Reason.MED)


def test_external_over_internal():
    i, e = path(A, asns=(65001,)), path(E1, asns=(65001,))
    assert select([i, e]) == (e, Reason.EBGP)


def test_originator_id_stands_in_for_router_id():
    # B has the lower router id, but A's route carries an ORIGINATOR_ID lower still.
    a, b = path(A, oid="1.0.0.1"), path(B)
    assert select([a, b]) == (a, Reason.ROUTER_ID)


def test_shorter_cluster_list_after_router_id():
    a = path(A, oid="1.0.0.1", clusters=("5.5.5.5", "6.6.6.6"))
    b = path(B, oid="1.0.0.1", clusters=("5.5.5.5",))
    assert select([a, b]) == (b, Reason.CLUSTER_LIST)


def test_lowest_peer_address_last():
    a = path(src("10.0.0.9", rid="7.7.7.7"), oid="1.0.0.1")
    b = path(src("10.0.0.2", rid="8.8.8.8"), oid="1.0.0.1")
    assert select([a, b]) == (b, Reason.PEER_ADDRESS)


def test_local_origin_beats_learned():
    mine = path(src("local", local=True))
    theirs = path(A, lp=1000)
    assert select([theirs, mine]) == (mine, Reason.LOCAL_ORIGIN)


def test_stale_loses_to_fresh():
    old, new = path(A, lp=500), path(B)
    old.stale = True
    assert select([old, new]) == (new, Reason.NOT_STALE)


def test_rank_orders_all_candidates():
    ps = [path(A, lp=100), path(B, lp=300), path(C, lp=200)]
    assert [p.source.key for p, _ in rank(ps)] == ["10.0.0.2", "10.0.0.3", "10.0.0.1"]
    assert rank(ps)[-1][1] is Reason.ONLY_PATH


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 0, 2), (2, 0, 1)])
def test_result_does_not_depend_on_candidate_order(order):
    # The classic MED non-transitivity case: the RFC elimination procedure is order-independent.
    ps = [
        path(src("192.0.2.1", asn=65001, rid="3.3.3.3"), asns=(65001,), med=10),
        path(src("192.0.2.2", asn=65001, rid="1.1.1.1"), asns=(65001,), med=20),
        path(src("192.0.2.3", asn=65002, rid="2.2.2.2"), asns=(65002,), med=0),
    ]
    best, _ = select([ps[i] for i in order])
    assert best is ps[2]
