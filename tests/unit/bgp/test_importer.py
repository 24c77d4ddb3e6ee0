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
MANDATORY = bytes.fromhex("400101" "00" "400206" "02010000fde9" "400304" "0a000002")


def update(attributes: bytes, prefix: str) -> Update:
    return Update.decode(b"\x00\x00" + len(attributes).to_bytes(2, "big") + attributes + prefix_from_str(prefix)[1])


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
