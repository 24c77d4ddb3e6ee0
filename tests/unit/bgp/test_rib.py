"""Adj-RIB-In / Loc-RIB bookkeeping and change batches."""

from ipaddress import IPv4Address, ip_address

from hypothesis import given, settings
from hypothesis import strategies as st

from bgp import bestpath
from bgp.rib import Rib, Source
from proto.attributes import AsPath, LocalPref, Origin, PathAttributes
from proto.nlri import IPV4_UNICAST, prefix_from_str

P1 = prefix_from_str("10.1.0.0/16")[1]
P2 = prefix_from_str("10.2.0.0/16")[1]
ATTRS = PathAttributes((Origin(0), AsPath(())))
ATTRS_LP = PathAttributes((Origin(0), AsPath(()), LocalPref(200)))


def source(addr):
    return Source(addr, ip_address(addr), 65000, 65000, IPv4Address(addr), ibgp=True)


def setup():
    rib = Rib()
    for a in ("10.0.0.1", "10.0.0.2"):
        rib.attach(source(a))
    return rib


def test_paths_are_shared_by_prefixes():
    rib = setup()
    adj = rib.adj_in["10.0.0.1"]
    p = adj.path(ATTRS, ip_address("10.0.0.1"))
    assert adj.path(ATTRS, ip_address("10.0.0.1")) is p
    rib.announce("10.0.0.1", IPV4_UNICAST, [P1, P2], p)
    assert rib.best(IPV4_UNICAST, P1) is rib.best(IPV4_UNICAST, P2) is p


def test_paths_are_interned_per_attributes_and_next_hop():
    # Keyed by the attributes alone when the next hop is their NEXT_HOP, by both otherwise
    # (an MP_REACH_NLRI next hop): the same pair always yields the same Path, and the same
    # attributes with another next hop never do.
    from proto.attributes import NextHop

    adj = setup().adj_in["10.0.0.1"]
    attrs = ATTRS.replace(NextHop(IPv4Address("192.0.2.1")))
    own = adj.path(attrs, IPv4Address("192.0.2.1"))
    other = adj.path(attrs, IPv4Address("192.0.2.9"))
    none = adj.path(attrs, None)
    assert len({id(own), id(other), id(none)}) == 3
    assert (own.next_hop, other.next_hop, none.next_hop) == (IPv4Address("192.0.2.1"), IPv4Address("192.0.2.9"), None)
    assert adj.path(attrs, IPv4Address("192.0.2.1")) is own
    assert adj.path(attrs, IPv4Address("192.0.2.9")) is other
    assert adj.path(attrs, None) is none
    # A stale path is never handed out again (RFC 4724): a fresh one replaces it.
    own.stale = True
    fresh = adj.path(attrs, IPv4Address("192.0.2.1"))
    assert fresh is not own and not fresh.stale


def test_changes_report_old_and_new_best_once_per_batch():
    rib = setup()
    a = rib.adj_in["10.0.0.1"].path(ATTRS, ip_address("10.0.0.1"))
    b = rib.adj_in["10.0.0.2"].path(ATTRS_LP, ip_address("10.0.0.2"))
    rib.announce("10.0.0.1", IPV4_UNICAST, [P1], a)
    rib.announce("10.0.0.2", IPV4_UNICAST, [P1], b)
    (ch,) = rib.take_changes()
    assert ch.old is None and ch.new is b  # one change for the batch, with the final best
    rib.withdraw("10.0.0.2", IPV4_UNICAST, [P1])
    (ch,) = rib.take_changes()
    assert ch.old is b and ch.new is a
    rib.withdraw("10.0.0.1", IPV4_UNICAST, [P1])
    (ch,) = rib.take_changes()
    assert ch.old is a and ch.new is None
    assert rib.count() == 0


def test_announce_then_withdraw_in_one_batch_is_no_change():
    rib = setup()
    a = rib.adj_in["10.0.0.1"].path(ATTRS, ip_address("10.0.0.1"))
    rib.announce("10.0.0.1", IPV4_UNICAST, [P1], a)
    rib.withdraw("10.0.0.1", IPV4_UNICAST, [P1])
    assert rib.take_changes() == []


def test_drop_withdraws_everything_from_a_source():
    rib = setup()
    a = rib.adj_in["10.0.0.1"].path(ATTRS, ip_address("10.0.0.1"))
    b = rib.adj_in["10.0.0.2"].path(ATTRS, ip_address("10.0.0.2"))
    rib.announce("10.0.0.1", IPV4_UNICAST, [P1, P2], a)
    rib.announce("10.0.0.2", IPV4_UNICAST, [P1], b)
    rib.take_changes()
    assert rib.drop("10.0.0.1") == 2
    changes = {c.prefix: c for c in rib.take_changes()}
    assert changes[P2].new is None
    assert changes[P1].new is b


def test_stale_marking_and_purge():
    rib = setup()
    a = rib.adj_in["10.0.0.1"].path(ATTRS_LP, ip_address("10.0.0.1"))
    b = rib.adj_in["10.0.0.2"].path(ATTRS, ip_address("10.0.0.2"))
    rib.announce("10.0.0.1", IPV4_UNICAST, [P1, P2], a)
    rib.announce("10.0.0.2", IPV4_UNICAST, [P1], b)
    rib.take_changes()
    assert rib.best(IPV4_UNICAST, P1) is a
    assert rib.mark_stale("10.0.0.1") == 2
    # Stale loses to fresh, but is kept where it is the only path.
    assert rib.best(IPV4_UNICAST, P1) is b
    assert rib.best(IPV4_UNICAST, P2) is a and a.stale
    # The peer comes back and refreshes P2 only; then End-of-RIB purges the rest.
    rib.attach(source("10.0.0.1"))
    fresh = rib.adj_in["10.0.0.1"].path(ATTRS_LP, ip_address("10.0.0.1"))
    assert fresh is not a and not fresh.stale
    rib.announce("10.0.0.1", IPV4_UNICAST, [P2], fresh)
    assert rib.purge_stale("10.0.0.1") == 1
    assert rib.best(IPV4_UNICAST, P1) is b
    assert rib.best(IPV4_UNICAST, P2) is fresh


def test_fresh_announcement_then_competitor_in_the_same_batch():
    rib = setup()
    a = rib.adj_in["10.0.0.1"].path(ATTRS, ip_address("10.0.0.1"))
    b = rib.adj_in["10.0.0.2"].path(ATTRS_LP, ip_address("10.0.0.2"))
    rib.announce("10.0.0.1", IPV4_UNICAST, [P1, P2], a)  # fresh: nobody had them
    rib.announce("10.0.0.2", IPV4_UNICAST, [P1], b)  # a competitor for one of them
    changes = {c.prefix: c for c in rib.take_changes()}
    assert changes[P1].old is None and changes[P1].new is b
    assert changes[P2].old is None and changes[P2].new is a


def test_fresh_announcement_replaced_by_its_source_in_the_same_batch():
    rib = setup()
    a1 = rib.adj_in["10.0.0.1"].path(ATTRS, ip_address("10.0.0.1"))
    a2 = rib.adj_in["10.0.0.1"].path(ATTRS_LP, ip_address("10.0.0.1"))
    rib.announce("10.0.0.1", IPV4_UNICAST, [P1], a1)
    rib.announce("10.0.0.1", IPV4_UNICAST, [P1], a2)
    (ch,) = rib.take_changes()
    assert ch.old is None and ch.new is a2
    assert rib.promoted[IPV4_UNICAST] == {a1, a2}


def test_batches_do_not_leak_into_each_other():
    rib = setup()
    a = rib.adj_in["10.0.0.1"].path(ATTRS, ip_address("10.0.0.1"))
    rib.announce("10.0.0.1", IPV4_UNICAST, [P1], a)
    assert len(rib.take_changes()) == 1
    assert rib.take_changes() == [] and not rib.has_changes()
    rib.withdraw("10.0.0.1", IPV4_UNICAST, [P1])
    (ch,) = rib.take_changes()
    assert ch.old is a and ch.new is None


# --------------------------------------------------------------- model check

_PREFIXES = [prefix_from_str(f"10.{i}.0.0/16")[1] for i in range(8)]
_SOURCES = ("10.0.0.1", "10.0.0.2", "10.0.0.3")
_ATTR_SETS = [PathAttributes((Origin(0), AsPath(()), LocalPref(lp))) for lp in (100, 200, 300)]

_op = st.one_of(
    st.tuples(st.just("announce"), st.sampled_from(_SOURCES), st.lists(st.sampled_from(_PREFIXES), max_size=6), st.integers(0, 2)),
    st.tuples(st.just("withdraw"), st.sampled_from(_SOURCES), st.lists(st.sampled_from(_PREFIXES), max_size=6), st.just(0)),
    st.tuples(st.just("drop"), st.sampled_from(_SOURCES), st.just([]), st.just(0)),
    st.tuples(st.just("batch"), st.just(""), st.just([]), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_op, max_size=40))
def test_rib_agrees_with_a_model(ops):
    """Whatever the order of announcements, re-announcements, withdrawals and drops from
    several sources: the Loc-RIB holds exactly the Adj-RIBs-In's candidates, its best is the
    decision process's pick, and each batch reports exactly the prefixes whose best changed."""
    rib = Rib()
    model: dict[str, dict[bytes, object]] = {}
    for s in _SOURCES:
        rib.attach(source(s))
        model[s] = {}

    def bests():
        out = {}
        for p in _PREFIXES:
            cands = [model[s][p] for s in _SOURCES if p in model[s]]
            if cands:
                out[p] = bestpath.select(cands)[0]
        return out

    before = bests()
    for kind, src, prefixes, attrs in ops + [("batch", "", [], 0)]:
        if kind == "announce":
            path = rib.adj_in[src].path(_ATTR_SETS[attrs], ip_address(src))
            rib.announce(src, IPV4_UNICAST, list(prefixes), path)
            model[src].update(dict.fromkeys(prefixes, path))
        elif kind == "withdraw":
            rib.withdraw(src, IPV4_UNICAST, list(prefixes))
            for p in prefixes:
                model[src].pop(p, None)
        elif kind == "drop":
            rib.drop(src)
            rib.attach(source(src))
            model[src] = {}
        else:
            after = bests()
            changes = rib.take_changes()
            reported = {c.prefix: c.new for c in changes}
            assert len(reported) == len(changes), changes  # one change per prefix
            assert all(c.old is before.get(c.prefix) for c in changes)
            assert reported == {p: after.get(p) for p in set(before) | set(after) if before.get(p) is not after.get(p)}
            before = after
        for p in _PREFIXES:
            cands = [model[s][p] for s in _SOURCES if p in model[s]]
            assert set(map(id, rib.candidates(IPV4_UNICAST, p))) == set(map(id, cands))
            for s in _SOURCES:
                assert rib.adj_in[s].tables.get(IPV4_UNICAST, {}).get(p) is model[s].get(p)
    assert rib.best(IPV4_UNICAST, _PREFIXES[0]) is before.get(_PREFIXES[0])


def test_an_ibgp_route_back_at_its_originator_or_its_cluster_is_refused_at_import():
    """RFC 4456 §8: a route whose ORIGINATOR_ID is this speaker's router id, or whose
    CLUSTER_LIST holds its cluster id, came round a loop of reflectors: treated as withdrawn.
    Either alone refuses it; neither, it is taken; from an eBGP peer neither is looked at."""
    from bgp.policy import Rejected, import_attributes
    from bgp.settings import LocalSettings
    from proto.attributes import ClusterList, OriginatorId

    me = LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.9"), cluster_id=IPv4Address("10.0.0.99"))
    ibgp = source("10.0.0.1")
    mine = PathAttributes((Origin(0), AsPath(()), OriginatorId(IPv4Address("10.0.0.9"))))
    looped = PathAttributes((Origin(0), AsPath(()), ClusterList((IPv4Address("10.0.0.7"), IPv4Address("10.0.0.99")))))
    passing = PathAttributes((Origin(0), AsPath(()), OriginatorId(IPv4Address("10.0.0.3")),
                              ClusterList((IPv4Address("10.0.0.7"),))))
    assert isinstance(import_attributes(mine, ibgp, me), Rejected)
    assert isinstance(import_attributes(looped, ibgp, me), Rejected)
    assert import_attributes(passing, ibgp, me) is passing
    ebgp = Source("10.0.0.5", ip_address("10.0.0.5"), 65001, 65000, IPv4Address("10.0.0.5"), ibgp=False)
    assert not isinstance(import_attributes(mine, ebgp, me), Rejected)


def test_a_graceful_peers_families_it_did_not_keep_are_flushed_not_kept_stale():
    """RFC 4724 §4.2: the routes of a family the restarting peer did not list in its Graceful
    Restart capability are flushed at once; only the families listed are kept, stale."""
    from proto.nlri import IPV6_UNICAST

    rib = setup()
    v6 = prefix_from_str("fd00:1::/64")[1]
    a = rib.adj_in["10.0.0.1"].path(ATTRS, ip_address("10.0.0.1"))
    rib.announce("10.0.0.1", IPV4_UNICAST, [P1], a)
    rib.announce("10.0.0.1", IPV6_UNICAST, [v6], rib.adj_in["10.0.0.1"].path(ATTRS, ip_address("fd00::1")))
    rib.take_changes()
    assert rib.mark_stale("10.0.0.1", [IPV4_UNICAST]) == 1
    assert rib.best(IPV4_UNICAST, P1) is a and a.stale
    assert rib.best(IPV6_UNICAST, v6) is None
