"""agentd's BGP speaker (``agentd speaker``) against a real BIRD 2: iBGP mesh, route
reflection both ways, eBGP with 4-octet ASNs, IPv6 over IPv4, TCP MD5, hold timers,
graceful restart and unknown peers.

Every test builds its own routers (the ``routers`` fixture), one network namespace each: two
routers share a veth pair, three or more hang off a bridge in an "ul" (underlay) namespace.  The lab
addresses are 10.0.0.x/24 (and 2001:db8:ff::x/64) inside those namespaces only.
agentd speakers run as real processes (agentd.lab.speaker_proc) and are observed
through their REST API from inside their namespace; BIRD runs as ``bird -f`` and is
observed through ``birdc`` (agentd.lab.bird).

Timers are short so the file runs in a few minutes: hold time 9 s, BIRD's keepalive 1 s
where a hold timer is measured, BIRD's connect delay 1 s.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest

from agentd.lab.interop import (
    ASN,
    ESTABLISH_TIMEOUT,
    HOLD,
    Watch,
    address,
    best,
    bird_bgp,
    bird_config,
    eventually,
    md5_failures,
    rib_paths,
    speaker_config,
)
from agentd.lab.netns import Netns, veth
from agentd.lab.wait import holds, pause, until

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- a. iBGP full mesh


def test_ibgp_full_mesh_two_speakers_and_bird(routers):
    r1, r2, r3 = routers.lan(3)
    bird_conf = bird_config(
        "10.0.0.3",
        bird_bgp("spk1", "10.0.0.3", ASN, "10.0.0.1", ASN),
        bird_bgp("spk2", "10.0.0.3", ASN, "10.0.0.2", ASN),
        static4=["10.99.3.0/24", "10.99.33.0/24"],
    )
    bird = routers.bird(r3, bird_conf)
    spk_cfg = {
        1: speaker_config("spk1", "10.0.0.1", originate=["10.99.1.0/24", "10.99.11.0/24"],
                          peers=[{"address": "10.0.0.2", "asn": ASN}, {"address": "10.0.0.3", "asn": ASN}]),
        2: speaker_config("spk2", "10.0.0.2", originate=["10.99.2.0/24"],
                          peers=[{"address": "10.0.0.1", "asn": ASN}, {"address": "10.0.0.3", "asn": ASN}]),
    }
    spk1 = routers.speaker(r1, spk_cfg[1], name="spk1")
    spk2 = routers.speaker(r2, spk_cfg[2], name="spk2")
    for spk, other in ((spk1, "10.0.0.2"), (spk2, "10.0.0.1")):
        spk.wait_peer_state(other, "Established", ESTABLISH_TIMEOUT)
        spk.wait_peer_state("10.0.0.3", "Established", ESTABLISH_TIMEOUT)
    bird.wait_established("spk1")
    bird.wait_established("spk2")

    # Each speaker has the other two routers' prefixes, learned from the originator itself
    # (iBGP routes are not re-advertised to iBGP peers: exactly one path each).
    expected = {
        spk1: {"10.99.2.0/24": "10.0.0.2", "10.99.3.0/24": "10.0.0.3", "10.99.33.0/24": "10.0.0.3"},
        spk2: {"10.99.1.0/24": "10.0.0.1", "10.99.11.0/24": "10.0.0.1", "10.99.3.0/24": "10.0.0.3",
               "10.99.33.0/24": "10.0.0.3"},
    }
    for spk, want in expected.items():
        eventually(lambda spk=spk, want=want: want.keys() <= spk.best_routes().keys(), what=f"{spk} routes")
        for prefix, next_hop in want.items():
            paths = rib_paths(spk, prefix)
            assert len(paths) == 1, paths
            assert paths[0]["next_hop"] == next_hop and paths[0]["peer"] == next_hop, paths
            assert paths[0]["as_path"] == "" and paths[0]["local_pref"] == 100, paths
    eventually(lambda: {"10.99.1.0/24", "10.99.11.0/24", "10.99.2.0/24"} <= bird.routes().keys(), what="BIRD routes")
    routes = bird.routes()
    for prefix, (proto, next_hop) in {
        "10.99.1.0/24": ("spk1", "10.0.0.1"), "10.99.11.0/24": ("spk1", "10.0.0.1"), "10.99.2.0/24": ("spk2", "10.0.0.2"),
    }.items():
        r = routes[prefix]
        assert (r["protocol"], r["via"], r["BGP.next_hop"], r["BGP.as_path"]) == (proto, next_hop, next_hop, ""), r
        assert r["alternatives"] == [], r

    # `agentd status` inside the namespace prints the peer table.
    table = spk1.status_cli()
    for line in ("10.0.0.2", "10.0.0.3"):
        row = next((row for row in table.splitlines() if line in row), "")
        assert "Established" in row, table

    # Withdraw one agentd prefix (SIGHUP reload) and one BIRD prefix (birdc configure).
    since = {p["address"]: p["since"] for p in spk1.peers()}
    spk_cfg[1]["bgp"]["originate"] = ["10.99.1.0/24"]
    spk1.reload(spk_cfg[1])
    bird.reconfigure(bird_conf.replace(" route 10.99.33.0/24 blackhole;", ""))
    gone = {"10.99.11.0/24", "10.99.33.0/24"}
    eventually(lambda: not gone & spk1.best_routes().keys(), what="withdrawals at spk1")
    eventually(lambda: not gone & spk2.best_routes().keys(), what="withdrawals at spk2")
    eventually(lambda: not gone & bird.routes().keys(), what="withdrawals at BIRD")
    # ... and nothing else went away, and no session was reset for it.
    assert {"10.99.2.0/24", "10.99.3.0/24"} <= spk1.best_routes().keys()
    assert {"10.99.1.0/24", "10.99.3.0/24"} <= spk2.best_routes().keys()
    assert {"10.99.1.0/24", "10.99.2.0/24", "10.99.3.0/24"} <= bird.routes().keys()
    assert {p["address"]: p["since"] for p in spk1.peers()} == since
    assert all(p["state"] == "Established" for p in spk1.peers() + spk2.peers())

    # The file named at start (--config) gone for a moment: the reload fails, nothing changes
    # (rather than the defaults, which a default route makes valid here: no peers at all).
    r1.ip("route", "add", "default", "via", "10.0.0.3")
    aside = spk1.config_path.rename(spk1.config_path.with_suffix(".aside"))
    try:
        spk1.signal(signal.SIGHUP)
        spk1.wait_until(lambda: "reload failed, keeping the running configuration" in spk1.log_path.read_text(), 10,
                        what="the failed reload")  # fmt: skip
        assert {p["address"]: p["since"] for p in spk1.peers()} == since
        assert "10.99.1.0/24" in spk2.best_routes()  # still originated
    finally:
        aside.rename(spk1.config_path)


# ---------------------------------------------------------------- b. agentd reflects to two BIRDs


def test_agentd_route_reflector_with_bird_clients(routers):
    r1, r2, r3 = routers.lan(3)
    birds = {}
    for i in (2, 3):
        conf = bird_config(f"192.0.2.{i}", bird_bgp("reflector", f"10.0.0.{i}", ASN, "10.0.0.1", ASN),
                           static4=[f"10.99.{i}.0/24"])
        birds[i] = routers.bird((r2, r3)[i - 2], conf, name=f"bird{i}")
    cfg = speaker_config("rr", "10.0.0.1", originate=["10.99.1.0/24"],
                         peers=[{"address": f"10.0.0.{i}", "asn": ASN, "rr_client": True} for i in (2, 3)])
    cfg["node"].update(route_reflector=True, cluster_id="1.1.1.1")
    spk = routers.speaker(r1, cfg)
    for i in (2, 3):
        row = spk.wait_peer_state(f"10.0.0.{i}", "Established", ESTABLISH_TIMEOUT)
        assert row["type"] == "ibgp rr-client" and row["router_id"] == f"192.0.2.{i}", row
        birds[i].wait_established("reflector")
    assert spk.status()["bgp"]["cluster_id"] == "1.1.1.1"

    for mine, other in ((2, 3), (3, 2)):
        bird = birds[mine]
        prefix = f"10.99.{other}.0/24"
        routes = eventually(lambda bird=bird, prefix=prefix: prefix in (r := bird.routes()) and r,
                            what=f"{prefix} reflected to BIRD {mine}")
        r = routes[prefix]
        # RFC 4456 §8: ORIGINATOR_ID is the originator's router id, CLUSTER_LIST the reflector's
        # cluster id; the next hop is left alone (the originating client's address).
        assert r["BGP.originator_id"] == f"192.0.2.{other}", r
        assert r["BGP.cluster_list"] == "1.1.1.1", r
        assert r["BGP.next_hop"] == f"10.0.0.{other}" and r["via"] == f"10.0.0.{other}", r
        assert r["BGP.as_path"] == "", r
        # The reflector's own prefix is not reflected: no ORIGINATOR_ID / CLUSTER_LIST.
        own = eventually(lambda bird=bird: bird.routes().get("10.99.1.0/24"), what="reflector's prefix")
        assert own["BGP.next_hop"] == "10.0.0.1" and "BGP.originator_id" not in own and "BGP.cluster_list" not in own, own
        # A client's own prefix is not sent back to it (it would be a loop: BIRD shows only its static).
        assert birds[mine].routes()[f"10.99.{mine}.0/24"]["protocol"] == "static4"
        assert birds[mine].routes()[f"10.99.{mine}.0/24"]["alternatives"] == []


# ---------------------------------------------------------------- c. BIRD reflects to two speakers


def test_bird_route_reflector_with_agentd_clients(routers):
    r1, r2, r3 = routers.lan(3)
    conf = bird_config(
        "192.0.2.3",
        bird_bgp("spk1", "10.0.0.3", ASN, "10.0.0.1", ASN, options="rr client; rr cluster id 3.3.3.3;"),
        bird_bgp("spk2", "10.0.0.3", ASN, "10.0.0.2", ASN, options="rr client; rr cluster id 3.3.3.3;"),
        static4=["10.99.3.0/24"],
    )
    bird = routers.bird(r3, conf)
    spks = {}
    for i, ns in ((1, r1), (2, r2)):
        cfg = speaker_config(f"spk{i}", f"10.0.0.{i}", originate=[f"10.99.{i}.0/24"], router_id=f"192.0.2.1{i}",
                             peers=[{"address": "10.0.0.3", "asn": ASN}])
        spks[i] = routers.speaker(ns, cfg, name=f"spk{i}")
    for i in (1, 2):
        spks[i].wait_peer_state("10.0.0.3", "Established", ESTABLISH_TIMEOUT)
        bird.wait_established(f"spk{i}")

    for mine, other in ((1, 2), (2, 1)):
        spk = spks[mine]
        prefix = f"10.99.{other}.0/24"
        r = eventually(lambda spk=spk, prefix=prefix: best(spk, prefix), what=f"{prefix} at spk{mine}")
        assert r["originator_id"] == f"192.0.2.1{other}", r
        assert r["cluster_list"] == ["3.3.3.3"], r
        assert r["next_hop"] == f"10.0.0.{other}" and r["peer"] == "10.0.0.3", r
        assert r["as_path"] == "", r
        # BIRD's own prefix arrives unreflected.
        own = eventually(lambda spk=spk: best(spk, "10.99.3.0/24"), what="BIRD's prefix")
        assert own["originator_id"] is None and own["cluster_list"] == [] and own["next_hop"] == "10.0.0.3", own
        # BIRD does not reflect a client's route back to it: only the local path.
        assert [p["peer"] for p in rib_paths(spk, f"10.99.{mine}.0/24")] == ["local"]


# ---------------------------------------------------------------- d. eBGP, 4-octet AS numbers


@pytest.mark.parametrize("bird_as", [4200000002, 65010])
def test_ebgp_four_octet_as(routers, bird_as):
    r1, r2 = routers.pair()
    agentd_as = 4200000001
    conf = bird_config("10.0.0.2", bird_bgp("spk", "10.0.0.2", bird_as, "10.0.0.1", agentd_as), static4=["10.99.2.0/24"])
    bird = routers.bird(r2, conf)
    spk = routers.speaker(r1, speaker_config("spk", "10.0.0.1", asn=agentd_as, originate=["10.99.1.0/24"],
                                             peers=[{"address": "10.0.0.2", "asn": bird_as}]))
    row = spk.wait_peer_state("10.0.0.2", "Established", ESTABLISH_TIMEOUT)
    assert row["type"] == "ebgp" and row["asn"] == bird_as, row
    bird.wait_established("spk")
    info = bird.protocol_info("spk")
    assert f"Neighbor AS:      {agentd_as}" in info, info

    r = eventually(lambda: best(spk, "10.99.2.0/24"), what="BIRD's prefix at agentd")
    assert r["as_path"] == str(bird_as) and r["next_hop"] == "10.0.0.2", r
    got = eventually(lambda: bird.routes().get("10.99.1.0/24"), what="agentd's prefix at BIRD")
    # 4200000001 itself, not AS_TRANS (23456): both sides negotiated 4-octet AS (RFC 6793).
    assert got["BGP.as_path"] == str(agentd_as), got
    assert got["BGP.next_hop"] == "10.0.0.1" and got["via"] == "10.0.0.1", got
    assert "BGP.as4_path" not in got, got
    assert got["tag"] == f"AS{agentd_as}i", got


# ---------------------------------------------------------------- e. IPv6 over an IPv4 session


def test_ipv6_prefixes_over_ipv4_session(routers):
    r1, r2 = routers.pair(v6=True)
    conf = bird_config(
        "10.0.0.2",
        bird_bgp("spk", "10.0.0.2", ASN, "10.0.0.1", ASN, ipv6="import all; export all; next hop address 2001:db8:ff::2;"),
        static4=["10.99.2.0/24"],
        static6=["2001:db8:2::/48"],
    )
    bird = routers.bird(r2, conf)
    spk = routers.speaker(r1, speaker_config("spk", "10.0.0.1", originate=["10.99.1.0/24", "2001:db8:1::/48"],
                                             next_hop_v6="2001:db8:ff::1", peers=[{"address": "10.0.0.2", "asn": ASN}]))
    row = spk.wait_peer_state("10.0.0.2", "Established", ESTABLISH_TIMEOUT)
    assert set(row["families"]) == {"ipv4-unicast", "ipv6-unicast"}, row
    bird.wait_established("spk")

    r = eventually(lambda: best(spk, "2001:db8:2::/48"), what="BIRD's IPv6 prefix at agentd")
    assert r["next_hop"] == "2001:db8:ff::2" and r["peer"] == "10.0.0.2", r
    assert best(spk, "10.99.2.0/24")["next_hop"] == "10.0.0.2"
    got = eventually(lambda: bird.routes("master6").get("2001:db8:1::/48"), what="agentd's IPv6 prefix at BIRD")
    assert got["protocol"] == "spk" and got["via"] == "2001:db8:ff::1" and got["dev"] == "eth0", got
    assert got["BGP.next_hop"].split()[0] == "2001:db8:ff::1", got
    assert bird.routes()["10.99.1.0/24"]["via"] == "10.0.0.1"


# ---------------------------------------------------------------- f. TCP MD5


def test_tcp_md5_same_password(routers):
    r1, r2 = routers.pair()
    conf = bird_config("10.0.0.2", bird_bgp("spk", "10.0.0.2", ASN, "10.0.0.1", ASN, options='password "s3cr3t-md5";'),
                       static4=["10.99.2.0/24"])
    bird = routers.bird(r2, conf)
    spk = routers.speaker(r1, speaker_config("spk", "10.0.0.1", originate=["10.99.1.0/24"],
                                             peers=[{"address": "10.0.0.2", "asn": ASN, "password": "s3cr3t-md5"}]))
    spk.wait_peer_state("10.0.0.2", "Established", ESTABLISH_TIMEOUT)
    bird.wait_established("spk")
    eventually(lambda: best(spk, "10.99.2.0/24"), what="route over the MD5 session")
    eventually(lambda: "10.99.1.0/24" in bird.routes(), what="route over the MD5 session at BIRD")
    # The segments really are signed: a capture on the link shows the MD5 option (kind 19).
    out = r1.exec("timeout", "15", "tcpdump", "-i", "eth0", "-c", "2", "-nn", "-v", "tcp port 179", check=False)
    assert "md5" in out.lower(), out
    assert md5_failures(r1) == 0 and md5_failures(r2) == 0


def test_tcp_md5_mismatch_never_establishes(routers):
    """Wrong password on BIRD's side (pair a) and no password on BIRD's side (pair b)."""
    cases = {}
    for case, bird_option in (("wrong", 'password "not-the-secret";'), ("none", "")):
        ns_a, ns_b = routers.namespace(f"{case}1"), routers.namespace(f"{case}2")
        veth(ns_a, "eth0", ns_b, "eth0")
        address(ns_a, 1)
        address(ns_b, 2)
        conf = bird_config("10.0.0.2", bird_bgp("spk", "10.0.0.2", ASN, "10.0.0.1", ASN, options=bird_option),
                           static4=["10.99.2.0/24"])
        bird = routers.bird(ns_b, conf, name=f"bird-{case}")
        spk = routers.speaker(ns_a, speaker_config("spk", "10.0.0.1", originate=["10.99.1.0/24"],
                                                   peers=[{"address": "10.0.0.2", "asn": ASN, "password": "the-secret"}]),
                              name=f"spk-{case}")
        cases[case] = (ns_a, ns_b, bird, spk)

    seen: dict[str, set[str]] = {case: set() for case in cases}

    def never_established() -> bool:
        for case, (_, _, bird, spk) in cases.items():
            state = spk.peer("10.0.0.2")["state"]
            bird_state = bird.protocol_state("spk")
            seen[case] |= {f"agentd {state}", f"bird {bird_state}"}
            assert state != "Established", (case, spk.peer("10.0.0.2"))
            assert bird_state != "Established", (case, bird.protocol_info("spk"))
        return True

    def dropped_by_the_kernel() -> bool:
        # BIRD's SYNs (wrong key or none) at agentd's socket; with a wrong key also agentd's
        # SYNs at BIRD's.
        never_established()
        return all(md5_failures(ns_a) + _md5_not_found(ns_a) > 0 and (case != "wrong" or md5_failures(ns_b) > 0)
                   for case, (ns_a, ns_b, _, _) in cases.items())

    until(dropped_by_the_kernel, ESTABLISH_TIMEOUT, interval=0.3, what=lambda: f"both sides' connects dropped: {seen}")
    # Nothing happens over a few more connect attempts either (BIRD retries every 2 s).
    holds(never_established, 5, interval=0.3, what="no session established")
    for case, (ns_a, ns_b, bird, spk) in cases.items():
        assert spk.best_routes().keys() == {"10.99.1.0/24"}, case
        assert "10.99.1.0/24" not in bird.routes(), case


def _md5_not_found(ns: Netns) -> int:
    lines = [line.split() for line in ns.exec("cat", "/proc/net/netstat").splitlines() if line.startswith("TcpExt:")]
    return int(lines[1][lines[0].index("TCPMD5NotFound")])


# ---------------------------------------------------------------- g. hold timer


def _frozen_drop(observe_established: Callable[[], bool], timeout: float = 2 * HOLD + 5) -> float:
    t0 = time.monotonic()
    eventually(lambda: not observe_established(), timeout, what="the session to drop", interval=0.1)
    return time.monotonic() - t0


def test_hold_timer_bird_frozen(routers):
    r1, r2 = routers.pair()
    # keepalive 1 s: the last message before the freeze is at most 1 s old, so the hold timer
    # (9 s negotiated) must fire 8..9 s after the freeze (plus polling slack).
    conf = bird_config("10.0.0.2", bird_bgp("spk", "10.0.0.2", ASN, "10.0.0.1", ASN, options="keepalive time 1;"),
                       static4=["10.99.2.0/24"])
    bird = routers.bird(r2, conf)
    spk = routers.speaker(r1, speaker_config("spk", "10.0.0.1", originate=["10.99.1.0/24"],
                                             peers=[{"address": "10.0.0.2", "asn": ASN}]))
    row = spk.wait_peer_state("10.0.0.2", "Established", ESTABLISH_TIMEOUT)
    assert row["hold_time"] == HOLD, row
    eventually(lambda: best(spk, "10.99.2.0/24"), what="BIRD's route")

    bird.freeze()
    try:
        took = _frozen_drop(lambda: spk.peer("10.0.0.2")["state"] == "Established")
        row = spk.peer("10.0.0.2")
        # The hold timer is the behaviour: never early -- less the keepalive interval (1 s, the
        # last one came up to then before the freeze) and as much again for BIRD sending it
        # late on a loaded machine; late only by the (generous) slack a loaded machine needs
        # to run the timer and answer the poll.
        assert HOLD - 2 <= took <= HOLD + 5, (took, row)
        assert "hold" in (row["info"] or "").lower(), row
        # Hold timer expiry sends a NOTIFICATION: not a graceful restart (which would keep the
        # route for its 120 s restart time), the route goes at once.
        eventually(lambda: best(spk, "10.99.2.0/24") is None, what="BIRD's route withdrawn")
        assert spk.peer("10.0.0.2")["stale"] == 0
    finally:
        bird.thaw()


def test_hold_timer_agentd_frozen(routers):
    r1, r2 = routers.pair()
    conf = bird_config("10.0.0.2", bird_bgp("spk", "10.0.0.2", ASN, "10.0.0.1", ASN), static4=["10.99.2.0/24"])
    bird = routers.bird(r2, conf)
    spk = routers.speaker(r1, speaker_config("spk", "10.0.0.1", originate=["10.99.1.0/24"], keepalive_time=1,
                                             peers=[{"address": "10.0.0.2", "asn": ASN}]))
    spk.wait_peer_state("10.0.0.2", "Established", ESTABLISH_TIMEOUT)
    bird.wait_established("spk")
    eventually(lambda: "10.99.1.0/24" in bird.routes(), what="agentd's route at BIRD")

    spk.freeze()
    try:
        took = _frozen_drop(lambda: bird.protocol_state("spk") == "Established")
        # BIRD jitters its hold timer too (bgp_start_timer() takes up to 25% off every timer),
        # and the last keepalive (1 s interval) came up to 1 s before the freeze -- 2 s if a
        # loaded machine held our keepalive back.
        assert 0.75 * HOLD - 2 <= took <= HOLD + 5, (took, bird.protocol_info("spk"))
        assert "Hold timer expired" in bird.protocol_info("spk")
        eventually(lambda: "10.99.1.0/24" not in bird.routes(), what="agentd's route withdrawn at BIRD")
    finally:
        spk.thaw()


# ---------------------------------------------------------------- h. graceful restart

CHANGING = "changing"


def gr_probe(spk, peer: str, prefix: str) -> Callable[[], tuple[bool, bool, str]]:
    """A Watch probe: (``prefix`` present at spk, stale, the session's state).  The route and
    the state are two requests, so the state is read before and after the route: a sample
    whose two reads differ straddled a change and has the state CHANGING."""

    def probe() -> tuple[bool, bool, str]:
        before = spk.peer(peer)["state"]
        r = best(spk, prefix)
        after = spk.peer(peer)["state"]
        return (r is not None, bool(r and r["stale"]), before if before == after else CHANGING)

    return probe


def test_graceful_restart_bird_restarts(routers):
    r1, r2 = routers.pair()
    conf = bird_config("10.0.0.2", bird_bgp("spk", "10.0.0.2", ASN, "10.0.0.1", ASN, options="debug { states, routes, events };"),
                       static4=["10.99.2.0/24"])
    bird = routers.bird(r2, conf)
    spk = routers.speaker(r1, speaker_config("spk", "10.0.0.1", originate=["10.99.1.0/24"],
                                             peers=[{"address": "10.0.0.2", "asn": ASN}]))
    spk.wait_peer_state("10.0.0.2", "Established", ESTABLISH_TIMEOUT)
    bird.wait_established("spk")
    eventually(lambda: best(spk, "10.99.2.0/24"), what="BIRD's route")
    first_since = spk.peer("10.0.0.2")["since"]

    with Watch(gr_probe(spk, "10.0.0.2", "10.99.2.0/24")) as watch:
        watch.wait_samples(3)
        bird.graceful_restart(down_for=3.0)
        row = spk.wait_peer_state("10.0.0.2", "Established", ESTABLISH_TIMEOUT)
        assert row["since"] > first_since, row
        eventually(lambda: (r := best(spk, "10.99.2.0/24")) is not None and not r["stale"], 20,
                   what="BIRD's route fresh again")
        watch.wait_samples(3)
    assert not watch.errors, watch.errors[:3]
    present = [s[1][0] for s in watch.samples]
    stale_while_away = [s[1][1] for s in watch.samples if s[1][2] not in ("Established", CHANGING)]
    assert all(present), f"BIRD's route missing in {present.count(False)} of {len(present)} samples"
    assert stale_while_away and all(stale_while_away), watch.samples
    assert watch.samples[-1][1] == (True, False, "Established")
    assert spk.peer("10.0.0.2")["stale"] == 0


def neighbor_caps(info: str) -> str:
    """The "Neighbor capabilities" part of BIRD's ``show protocols all``: what the peer's OPEN
    offered ("Restart recovery": its Restart State bit, RFC 4724 §3)."""
    return info.partition("Neighbor capabilities")[2].partition("Session:")[0]


def test_graceful_restart_agentd_killed(routers):
    r1, r2 = routers.pair()
    # BIRD logs every route change of the session ("spk.ipv4 > removed ..."), so a withdrawal
    # shorter than any polling interval is still seen.
    conf = bird_config("10.0.0.2", bird_bgp("spk", "10.0.0.2", ASN, "10.0.0.1", ASN, options="debug { states, routes, events };"),
                       static4=["10.99.2.0/24"])
    bird = routers.bird(r2, conf)
    cfg = speaker_config("spk", "10.0.0.1", originate=["10.99.1.0/24"], restart_time=60,
                         peers=[{"address": "10.0.0.2", "asn": ASN}])
    spk = routers.speaker(r1, cfg)
    spk.wait_peer_state("10.0.0.2", "Established", ESTABLISH_TIMEOUT)
    bird.wait_established("spk")
    eventually(lambda: "10.99.1.0/24" in bird.routes(), what="agentd's route at BIRD")
    first_caps = neighbor_caps(bird.protocol_info("spk"))
    assert "Graceful restart" in first_caps and "Restart recovery" not in first_caps, first_caps  # a fresh start

    def probe() -> tuple[bool, str]:
        return ("10.99.1.0/24" in bird.routes(), bird.protocol_state("spk"))

    log_start = bird.log_path.stat().st_size
    with Watch(probe) as watch:
        watch.wait_samples(3)
        spk.kill()
        eventually(lambda: bird.protocol_state("spk") != "Established", what="BIRD to notice the crash")
        pause(2.0, "agentd stays down a while: BIRD must keep its route as stale meanwhile")
        spk_log_start = spk.log_path.stat().st_size
        spk.start()
        spk.wait_ready()
        spk.wait_peer_state("10.0.0.2", "Established", ESTABLISH_TIMEOUT)
        bird.wait_established("spk")
        eventually(lambda: "10.99.1.0/24" in bird.routes(), what="agentd's route at BIRD after restart")
        watch.wait_samples(5)
    assert not watch.errors, watch.errors[:3]
    states = [s[1][1] for s in watch.samples]
    assert any(s != "Established" for s in states), "BIRD never saw the session go down"
    missing = [t for t, (present, _) in watch.samples if not present]
    assert not missing, f"agentd's route missing at BIRD in {len(missing)} of {len(watch.samples)} samples"
    assert watch.samples[-1][1] == (True, "Established")
    with open(bird.log_path, errors="replace") as f:
        f.seek(log_start)
        log = f.read()
    assert "Neighbor graceful restart detected" in log, log
    # RFC 4724 §4.2: BIRD keeps the routes as stale until agentd's End-of-RIB; it must never
    # have removed the prefix (not even for the instant between the new OPEN and the UPDATE).
    removed = [line for line in log.splitlines() if "spk.ipv4 > removed" in line and "10.99.1.0/24" in line]
    assert not removed, "BIRD removed agentd's route during the restart:\n" + log
    # Refreshed: BIRD's graceful restart state for the peer ends (at agentd's End-of-RIB, sent
    # after its own selection deferral and update window: waited for, not read once).
    eventually(lambda: "Neighbor graceful restart active" not in bird.protocol_info("spk"),
               what="BIRD's graceful restart over (agentd's End-of-RIB)")
    # The restarted speaker knew it restarted (the file the killed one left in its state_dir):
    # its OPEN said so (RFC 4724 §3), and it deferred its End-of-RIB until BIRD's (§4.1).
    caps = neighbor_caps(bird.protocol_info("spk"))
    assert "Restart recovery" in caps, caps
    with open(spk.log_path, errors="replace") as f:
        f.seek(spk_log_start)
        spk_log = f.read()
    assert "restarting gracefully" in spk_log, spk_log
    assert "route selection no longer deferred (every peer sent End-of-RIB)" in spk_log, spk_log


# ---------------------------------------------------------------- unknown peers


def test_unknown_peer_is_refused(routers):
    """(a) BIRD peers with agentd, agentd does not know BIRD; (b) the reverse."""
    a1, a2 = routers.namespace("a1"), routers.namespace("a2")
    b1, b2 = routers.namespace("b1"), routers.namespace("b2")
    for x, y in ((a1, a2), (b1, b2)):
        veth(x, "eth0", y, "eth0")
        address(x, 1)
        address(y, 2)
    conf = bird_config("10.0.0.2", bird_bgp("spk", "10.0.0.2", ASN, "10.0.0.1", ASN), static4=["10.99.2.0/24"])
    bird_a = routers.bird(a2, conf, name="bird-a")
    spk_a = routers.speaker(a1, speaker_config("spk", "10.0.0.1", originate=["10.99.1.0/24"],
                                               peers=[{"address": "10.0.0.9", "asn": ASN, "passive": True}]), name="spk-a")
    # BIRD only listens while it has a BGP protocol: give it one for some other neighbour.
    bird_b = routers.bird(b2, bird_config("10.0.0.2", bird_bgp("elsewhere", "10.0.0.2", ASN, "10.0.0.9", ASN, options="passive;"),
                                          static4=["10.99.2.0/24"]), name="bird-b")
    spk_b = routers.speaker(b1, speaker_config("spk", "10.0.0.1", originate=["10.99.1.0/24"],
                                               peers=[{"address": "10.0.0.2", "asn": ASN}]), name="spk-b")

    eventually(lambda: "refused BGP connection from 10.0.0.2" in spk_a.log_tail(200), 15,
               what="agentd to refuse BIRD's connection")

    def refused() -> bool:
        assert bird_a.protocol_state("spk") != "Established"
        assert [p["address"] for p in spk_a.peers()] == ["10.0.0.9"]
        assert spk_b.peer("10.0.0.2")["state"] != "Established"
        return True

    holds(refused, 5, interval=0.3, what="no session with the unknown peer")  # a few retries of both
    for spk in (spk_a, spk_b):
        assert spk.running and spk.ns.http_get(spk.api_url + "/healthz")[0] == 200
        assert spk.best_routes().keys() == {"10.99.1.0/24"}
        assert "Traceback" not in spk.log_tail(500)
    assert "10.99.1.0/24" not in bird_a.routes() and "10.99.1.0/24" not in bird_b.routes()
    # BIRD turned agentd's connection away as from an unknown address.
    assert "Unexpected connect from unknown address 10.0.0.1" in bird_b.log_tail(200)


def test_ipv6_session_with_bird_and_its_graceful_restart(routers):
    """An IPv6-only cluster's kind of session: TCP over IPv6, IPv6 unicast alone (BIRD offers
    no IPv4 channel), each side's prefix at the other with the other's address as next hop;
    BIRD's graceful restart keeps its IPv6 route at agentd (stale) until BIRD's End-of-RIB."""
    r1, r2 = routers.pair(v6=True)
    conf = bird_config("10.0.0.2", "\n".join([
        "protocol bgp spk {",
        f"  local 2001:db8:ff::2 as {ASN};",
        f"  neighbor 2001:db8:ff::1 as {ASN};",
        f"  hold time {HOLD};",
        "  connect delay time 1; connect retry time 2; error wait time 1, 5;",
        "  graceful restart on;",
        "  direct;",
        "  ipv6 { import all; export all; };",
        "}",
    ]) + "\n", static6=["2001:db8:2::/48"])
    bird = routers.bird(r2, conf)
    spk = routers.speaker(r1, speaker_config("spk", "10.0.0.1", originate=["2001:db8:1::/48"],
                                             listen="[2001:db8:ff::1]:179", peers=[{"address": "2001:db8:ff::2", "asn": ASN}]))
    row = spk.wait_peer_state("2001:db8:ff::2", "Established", ESTABLISH_TIMEOUT)
    assert row["families"] == ["ipv6-unicast"], row
    bird.wait_established("spk")
    r = eventually(lambda: best(spk, "2001:db8:2::/48"), what="BIRD's IPv6 prefix at agentd")
    assert r["next_hop"] == "2001:db8:ff::2" and r["peer"] == "2001:db8:ff::2", r
    got = eventually(lambda: bird.routes("master6").get("2001:db8:1::/48"), what="agentd's prefix at BIRD")
    assert got["protocol"] == "spk" and got["via"] == "2001:db8:ff::1", got

    with Watch(gr_probe(spk, "2001:db8:ff::2", "2001:db8:2::/48")) as watch:
        watch.wait_samples(3)
        bird.graceful_restart(down_for=3.0)
        spk.wait_peer_state("2001:db8:ff::2", "Established", ESTABLISH_TIMEOUT)
        eventually(lambda: (r := best(spk, "2001:db8:2::/48")) is not None and not r["stale"], 20,
                   what="BIRD's IPv6 route fresh again")
        watch.wait_samples(3)
    assert not watch.errors, watch.errors[:3]
    assert all(s[1][0] for s in watch.samples), watch.samples
    stale_while_away = [s[1][1] for s in watch.samples if s[1][2] not in ("Established", CHANGING)]
    assert stale_while_away and all(stale_while_away), watch.samples
