"""Importing a peer's UPDATEs into the Adj-RIB-In (bgp.importer)."""

import logging
from collections import Counter
from ipaddress import IPv4Address

import pytest

from bgp.importer import Importer
from bgp.loglimit import LogLimiter
from bgp.rib import Rib, Source
from bgp.settings import LocalSettings, PeerSettings
from proto.messages import Update
from proto.nlri import IPV4_UNICAST, prefix_from_str

PEER = IPv4Address("10.0.0.2")
LOCAL = LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1"))
MANDATORY = bytes.fromhex("400101" "00" "400206" "02010000fde9" "400304" "0a000002")


def update(attributes: bytes, prefix: str) -> Update:
    return Update.decode(b"\x00\x00" + len(attributes).to_bytes(2, "big") + attributes + prefix_from_str(prefix)[1])


def attributes(asns, next_hop, *, local_pref=None, originator=None, clusters=()) -> bytes:
    """ORIGIN IGP, an AS_SEQUENCE of ``asns`` (4-octet), NEXT_HOP, and the optional internal ones."""
    seg = bytes((2, len(asns))) + b"".join(a.to_bytes(4, "big") for a in asns) if asns else b""
    out = bytes.fromhex("40010100") + bytes((0x40, 2, len(seg))) + seg + bytes.fromhex("400304") + IPv4Address(next_hop).packed
    if local_pref is not None:
        out += bytes.fromhex("400504") + local_pref.to_bytes(4, "big")
    if originator is not None:
        out += bytes.fromhex("800904") + IPv4Address(originator).packed
    if clusters:
        out += bytes((0x80, 10, 4 * len(clusters))) + b"".join(IPv4Address(c).packed for c in clusters)
    return out


def importer_with(*peers):
    """A Rib and an Importer (local AS 65000) with ``peers`` ((address, asn) pairs) attached."""
    rib, counters = Rib(), Counter()
    importer = Importer(rib, LOCAL, LogLimiter(logging.getLogger(__name__)), counters)
    for address, asn in peers:
        addr = IPv4Address(address)
        source = Source(address, addr, asn, LOCAL.asn, addr, ibgp=asn == LOCAL.asn, rr_client=False)
        rib.attach(source)
        importer.attach(source, PeerSettings(addr, asn), frozenset({IPV4_UNICAST}), None)
    return rib, importer, counters


@pytest.mark.parametrize("partial_first", [False, True])
def test_a_set_partial_bit_stays_with_its_own_route(partial_first):
    # RFC 4271 §5: a Partial bit once set stays set when the attribute is passed on.  Two
    # sets differing only in it must not share one import-cache entry or interned Path,
    # whichever arrives first.
    rib = Rib()
    src = Source(str(PEER), PEER, 65000, 65000, PEER, ibgp=True, rr_client=False)
    rib.attach(src)
    importer = Importer(rib, LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1")),
                        LogLimiter(logging.getLogger(__name__)), Counter())  # fmt: skip
    importer.attach(src, PeerSettings(PEER, 65000), frozenset({IPV4_UNICAST}), None)
    communities = bytes.fromhex("0400010001")  # length 4, 1:1
    plain = update(MANDATORY + b"\xc0\x08" + communities, "10.1.2.0/24")
    marked = update(MANDATORY + b"\xe0\x08" + communities, "10.1.3.0/24")
    for u in (marked, plain) if partial_first else (plain, marked):
        importer.update(src.key, u, 0.0)
    partial = rib.best(IPV4_UNICAST, prefix_from_str("10.1.3.0/24")[1]).attributes.get(8)
    assert partial.partial and partial.encode().startswith(b"\xe0\x08")
    assert not rib.best(IPV4_UNICAST, prefix_from_str("10.1.2.0/24")[1]).attributes.get(8).partial


@pytest.mark.parametrize("peer_as", [65000, 65001], ids=["ibgp", "ebgp"])
def test_a_route_whose_as_path_holds_our_as_is_ignored_from_any_peer(peer_as):
    # RFC 4271 §9.1.2: a route whose AS_PATH holds the local AS is excluded from the decision
    # process, whatever the peer (BIRD and GoBGP check every peer's routes).  Over iBGP it only
    # comes when another router of the AS let the loop in; it must not be selected or reflected.
    rib, importer, counters = importer_with(("10.0.0.2", peer_as))
    looping = attributes((65001, 65000, 65002), "10.0.0.2", local_pref=100)
    importer.update("10.0.0.2", update(looping, "10.9.0.0/16"), 0.0)
    assert rib.best(IPV4_UNICAST, prefix_from_str("10.9.0.0/16")[1]) is None
    assert counters["routes ignored"] == 1
    assert not rib.take_changes()


@pytest.mark.parametrize("as_path", [(), (65001, 65002)], ids=["internal", "external"])
def test_ibgp_routes_without_our_as_are_taken(as_path):
    # What the agent's iBGP mesh and reflectors carry: routes from inside the AS (empty
    # AS_PATH) and an external router's routes passed on over iBGP (external ASes only),
    # reflected ones included (ORIGINATOR_ID and CLUSTER_LIST of others).
    rib, importer, counters = importer_with(("10.0.0.2", 65000))
    attrs = attributes(as_path, "10.0.0.7", local_pref=100, originator="10.0.0.7", clusters=("10.0.0.9",))
    importer.update("10.0.0.2", update(attrs, "10.9.0.0/16"), 0.0)
    best = rib.best(IPV4_UNICAST, prefix_from_str("10.9.0.0/16")[1])
    assert best is not None and best.attributes.local_pref == 100
    assert str(best.attributes.originator_id) == "10.0.0.7"
    assert counters["routes ignored"] == 0


def test_an_external_peer_cannot_set_local_pref_or_reflection_attributes():
    # RFC 4271 §5.1.5: LOCAL_PREF from an external peer is ignored; RFC 4456 §8: ORIGINATOR_ID
    # and CLUSTER_LIST belong inside the AS.  Dropped on import, so a high LOCAL_PREF sent by
    # one eBGP peer does not beat another eBGP peer's shorter AS_PATH.
    rib, importer, counters = importer_with(("192.0.2.1", 65001), ("192.0.2.2", 65002))
    sneaky = attributes((65001, 9, 9), "192.0.2.1", local_pref=500, originator="1.1.1.1", clusters=("2.2.2.2",))
    importer.update("192.0.2.1", update(sneaky, "10.9.0.0/16"), 0.0)
    prefix = prefix_from_str("10.9.0.0/16")[1]
    got = rib.best(IPV4_UNICAST, prefix).attributes
    assert got.local_pref is None and got.originator_id is None and not got.cluster_list
    assert [a.code for a in got] == [1, 2, 3]  # ORIGIN, AS_PATH, NEXT_HOP: nothing else kept
    importer.update("192.0.2.2", update(attributes((65002,), "192.0.2.2"), "10.9.0.0/16"), 0.0)
    assert rib.best(IPV4_UNICAST, prefix).source.key == "192.0.2.2"
    assert counters["routes ignored"] == 0
