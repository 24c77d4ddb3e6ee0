"""agentd's BGP speaker against GoBGP (gobgpd), and reflecting between GoBGP and BIRD clients.

The same documented config and REST as the BIRD tests; GoBGP is driven through its CLI.
"""

from __future__ import annotations

from ipaddress import IPv4Address

import pytest

from agentd.lab.gobgp import gobgp_config
from agentd.lab.interop import ASN, bird_bgp, bird_config, best, eventually, speaker_config

pytestmark = pytest.mark.timeout(120)


def test_ibgp_with_gobgp_routes_both_ways_and_withdrawals(routers):
    r1, r2 = routers.pair()
    gob = routers.gobgp(r2, gobgp_config(ASN, "10.0.0.2", [{"address": "10.0.0.1", "asn": ASN}]))
    spk = routers.speaker(r1, speaker_config("spk", "10.0.0.1", originate=["10.99.1.0/24"],
                                             peers=[{"address": "10.0.0.2", "asn": ASN}]))  # fmt: skip
    spk.wait_peer_state("10.0.0.2", "Established", 30)
    gob.add("10.98.0.0/24")
    eventually(lambda: best(spk, "10.98.0.0/24"), what="GoBGP's prefix at agentd")
    assert best(spk, "10.98.0.0/24")["next_hop"] == "10.0.0.2"
    rib = eventually(lambda: "10.99.1.0/24" in (r := gob.rib()) and r, what="agentd's prefix at GoBGP")
    assert rib["10.99.1.0/24"][3]["nexthop"] == "10.0.0.1"
    assert rib["10.99.1.0/24"][5]["value"] == 100  # LOCAL_PREF on iBGP
    assert gob.neighbor_state("10.0.0.1") == 6
    # Withdrawals in both directions.
    gob.delete("10.98.0.0/24")
    eventually(lambda: best(spk, "10.98.0.0/24") is None, what="GoBGP's withdrawal at agentd")
    spk.reload(speaker_config("spk", "10.0.0.1", originate=[], peers=[{"address": "10.0.0.2", "asn": ASN}]))
    eventually(lambda: "10.99.1.0/24" not in gob.rib(), what="agentd's withdrawal at GoBGP")


def test_ebgp_with_gobgp_four_octet_asns(routers):
    r1, r2 = routers.pair()
    gob = routers.gobgp(r2, gobgp_config(4200000002, "10.0.0.2", [{"address": "10.0.0.1", "asn": 4200000001}]))
    spk = routers.speaker(r1, speaker_config("spk", "10.0.0.1", asn=4200000001, originate=["10.99.1.0/24"],
                                             peers=[{"address": "10.0.0.2", "asn": 4200000002}]))  # fmt: skip
    spk.wait_peer_state("10.0.0.2", "Established", 30)
    gob.add("10.98.0.0/24")
    route = eventually(lambda: best(spk, "10.98.0.0/24"), what="GoBGP's prefix")
    assert route["as_path"] == "4200000002" and route["next_hop"] == "10.0.0.2"
    rib = eventually(lambda: "10.99.1.0/24" in (r := gob.rib()) and r, what="agentd's prefix at GoBGP")
    segs = rib["10.99.1.0/24"][2]["as_paths"]
    assert [n for s in segs for n in s["asns"]] == [4200000001]
    assert 5 not in rib["10.99.1.0/24"]  # no LOCAL_PREF across eBGP


def test_tcp_md5_with_gobgp(routers):
    r1, r2 = routers.pair()
    routers.gobgp(r2, gobgp_config(ASN, "10.0.0.2", [{"address": "10.0.0.1", "asn": ASN, "password": "s3cret"}]))
    spk = routers.speaker(r1, speaker_config("spk", "10.0.0.1",
                                             peers=[{"address": "10.0.0.2", "asn": ASN, "password": "s3cret"}]))  # fmt: skip
    spk.wait_peer_state("10.0.0.2", "Established", 30)


def test_agentd_reflects_between_a_gobgp_and_a_bird_client(routers):
    r1, r2, r3 = routers.lan(3)
    gob = routers.gobgp(r2, gobgp_config(ASN, "10.0.0.2", [{"address": "10.0.0.1", "asn": ASN}]))
    bird = routers.bird(r3, bird_config("10.0.0.3", bird_bgp("refl", "10.0.0.3", ASN, "10.0.0.1", ASN),
                                        static4=["10.97.0.0/24"]))
    cfg = speaker_config("rr", "10.0.0.1", peers=[{"address": "10.0.0.2", "asn": ASN, "rr_client": True},
                                                   {"address": "10.0.0.3", "asn": ASN, "rr_client": True}])  # fmt: skip
    cfg["node"].update(route_reflector=True, cluster_id="1.1.1.1")
    spk = routers.speaker(r1, cfg)
    spk.wait_peer_state("10.0.0.2", "Established", 30)
    spk.wait_peer_state("10.0.0.3", "Established", 30)
    gob.add("10.98.0.0/24")
    # BIRD learns GoBGP's prefix through agentd, with the reflection attributes.
    routes = eventually(lambda: "10.98.0.0/24" in (r := bird.routes()) and r, what="GoBGP prefix at BIRD")
    assert routes["10.98.0.0/24"]["BGP.originator_id"] == "10.0.0.2"
    assert routes["10.98.0.0/24"]["BGP.cluster_list"] == "1.1.1.1"
    assert routes["10.98.0.0/24"]["BGP.next_hop"].split()[0] == "10.0.0.2"
    # GoBGP learns BIRD's prefix the same way.
    rib = eventually(lambda: "10.97.0.0/24" in (r := gob.rib()) and r, what="BIRD prefix at GoBGP")
    assert rib["10.97.0.0/24"][9]["value"] == str(IPv4Address("10.0.0.3"))
    assert rib["10.97.0.0/24"][10]["value"] == ["1.1.1.1"]
    assert rib["10.97.0.0/24"][3]["nexthop"] == "10.0.0.3"
