"""One bad peer must never hurt another session, on the real speaker.

Three routers on one bridge: ``agentd speaker`` at 10.0.0.1 (AS 65000), BIRD 2 at 10.0.0.2
(iBGP, the bystander whose session and routes must stay intact) and an attacker at
10.0.0.3 (AS 65001, eBGP, a hand-driven socket: agentd.lab.rawbgp).  Each test has the
attacker do one thing a broken or hostile peer does (routes that cannot be exported, a
refresh flood, a peer that stops reading, silent connections, a huge table, malformed
UPDATEs) and checks the bystander: its session never flapped (the speaker's ``flaps`` and
``since`` for it, BIRD's protocol state), it still has every valid route and none that could
not be sent.  Plus max-prefix, GTSM and BFD against BIRD.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable
from ipaddress import IPv4Address

import pytest

from agentd.lab.interop import ASN, ESTABLISH_TIMEOUT, HOLD, Watch, bird_bgp, bird_config, eventually, speaker_config
from agentd.lab.wait import until
from agentd.lab.rawbgp import RawBgpPeer, as_path, attr, prefix, route_refresh, update
from proto.errors import ErrorCode
from proto.messages import CodecContext, MessageType, Update, encode_updates
from proto.attributes import AsPath, AsPathSegment, Origin, PathAttributes

pytestmark = pytest.mark.timeout(240)

SPK, BIRD, ATTACKER = "10.0.0.1", "10.0.0.2", "10.0.0.3"
EVIL_AS = 65001
ORIGIN = attr(0x40, 1, b"\x00")
NH = attr(0x40, 3, IPv4Address(ATTACKER).packed)


def setup(routers, *, attacker: dict | None = None, bird_static=("10.99.2.0/24",),
            bird_extra: str = "", bgp: dict | None = None, bird_options: str = ""):
    r1, r2, r3 = routers.lan(3)
    bird = routers.bird(r2, bird_config(
        BIRD, bird_bgp("spk", BIRD, ASN, SPK, ASN, options=bird_options), bird_extra, static4=list(bird_static)))
    peers = [{"address": BIRD, "asn": ASN}, {"address": ATTACKER, "asn": EVIL_AS, "passive": True, **(attacker or {})}]
    spk = routers.speaker(r1, speaker_config(
        "spk", SPK, originate=["10.99.1.0/24"], peers=peers, **(bgp or {})))
    spk.wait_peer_state(BIRD, "Established", ESTABLISH_TIMEOUT)
    bird.wait_established("spk")
    eventually(lambda: set(bird_static) <= spk.best_routes().keys(), what="BIRD's routes at the speaker")
    return r1, r2, r3, spk, bird


def attacker(routers, r3, **kw) -> RawBgpPeer:
    """A raw neighbour from the attacker's address (hold time 0: it may sit idle as long as a
    test needs); closed with the test's processes."""
    kw.setdefault("hold_time", 0)
    return routers.add(RawBgpPeer.connect(r3, ATTACKER, SPK, asn=kw.pop("asn", EVIL_AS), **kw))


def bird_row(spk) -> dict:
    return spk.peer(BIRD)


def bystander_intact(spk, bird, row: dict, *, prefixes: set[str]) -> None:
    """BIRD's session is the one it was (no flap), and both sides hold what they should."""
    now = bird_row(spk)
    assert now["state"] == "Established" and now["flaps"] == row["flaps"] and now["since"] == row["since"], now
    assert bird.protocol_state("spk") == "Established"
    # ``prefixes`` from us at BIRD, and our count of what we sent agrees with what BIRD holds
    # (a withdrawal may still be on its way when this is called).
    def agreed() -> bool:
        at_bird = {p for p, r in bird.routes().items() if r["protocol"] == "spk"}
        return prefixes <= at_bird and bird_row(spk)["prefixes_sent"] == len(at_bird)
    eventually(agreed, interval=0.5, what=lambda: f"{prefixes} at BIRD, all counted as sent: {bird_row(spk)}")


def test_routes_that_cannot_be_exported_never_reach_or_reset_the_bystander(routers):
    r1, r2, r3, spk, bird = setup(routers)
    row = bird_row(spk)
    evil = attacker(routers, r3, graceful_restart=True)
    # 1,011 communities: 4,095 octets; with LOCAL_PREF for BIRD it does not fit. A valid prefix
    # in the same write must still reach BIRD.
    communities = attr(0xC0, 8, b"".join((EVIL_AS << 16 | i).to_bytes(4, "big") for i in range(1011)))
    big = update(ORIGIN + as_path([EVIL_AS]) + NH + communities, prefix("10.66.1.0/24"))
    assert len(big) == 4095
    evil.send(big + update(ORIGIN + as_path([EVIL_AS]) + NH, prefix("10.66.2.0/24")))
    eventually(lambda: "10.66.2.0/24" in bird.routes(), what="the valid prefix at BIRD")
    assert spk.best_routes().keys() >= {"10.66.1.0/24", "10.66.2.0/24"}  # both accepted on import
    assert "10.66.1.0/24" not in bird.routes()
    bystander_intact(spk, bird, row, prefixes={"10.99.1.0/24", "10.66.2.0/24"})

    # A 2-octet-AS attacker whose 1,100-AS path doubles on export to BIRD.
    evil.send(b"\xff" * 16 + b"\x00\x15\x03\x06\x02")  # Cease: this session ends, its routes go
    assert evil.wait_closed(10)
    eventually(lambda: "10.66.2.0/24" not in bird.routes(), what="the first session's routes withdrawn")
    old = attacker(routers, r3, four_octet=False)
    old.send(update(ORIGIN + as_path([EVIL_AS] + [64000 + i % 500 for i in range(1099)], width=2) + NH,
                    prefix("10.66.3.0/24")) + update(ORIGIN + as_path([EVIL_AS], 2) + NH, prefix("10.66.4.0/24")))
    eventually(lambda: "10.66.4.0/24" in bird.routes(), what="the 2-octet peer's valid prefix at BIRD")
    assert "10.66.3.0/24" in spk.best_routes() and "10.66.3.0/24" not in bird.routes()

    # An IPv4 route with an IPv6 next hop (no RFC 8950): the attacker alone is reset.
    v6 = attr(0x80, 14, struct.pack("!HBB", 1, 1, 16) + bytes.fromhex("20010db8" + "00" * 11 + "01") + b"\x00"
              + prefix("10.66.5.0/24"))
    old.send(update(ORIGIN + as_path([EVIL_AS], 2) + v6))
    assert old.wait_closed(10) and old.notifications()[-1].code == ErrorCode.UPDATE_MESSAGE
    bystander_intact(spk, bird, row, prefixes={"10.99.1.0/24"})

    # Kept as stale (graceful restart, 4,095 s), the unencodable route must not reset BIRD when
    # BIRD comes back: its session restarts once, takes the full table, and stays up.
    # (The reset session had just come up: the attacker's connections are refused until the
    # restart delay is over -- RFC 4271 §8.1.1 DampPeerOscillations -- and it is Active again.)
    eventually(lambda: spk.peer(ATTACKER)["state"] == "Active", what=lambda: f"the attacker taken again: {spk.peer(ATTACKER)}")
    evil2 = attacker(routers, r3, graceful_restart=True)
    evil2.send(big + update(ORIGIN + as_path([EVIL_AS]) + NH, prefix("10.66.6.0/24")))
    eventually(lambda: "10.66.6.0/24" in bird.routes(), what="10.66.6.0/24 at BIRD")
    evil2.sock.shutdown(2)  # gone without a NOTIFICATION: its routes stay, stale
    evil2.close()
    eventually(lambda: spk.peer(ATTACKER)["graceful_restart"], what="the attacker's routes kept as stale")
    bird.birdc("restart", "spk")
    # BIRD connects again after its start delay (5 s); on a loaded machine that and our side's
    # retry can take longer than the usual 15 s.  The session's row is named if it never comes.
    eventually(lambda: (r := bird_row(spk))["flaps"] >= row["flaps"] + 1 and r["state"] == "Established",
               timeout=40, what=lambda: f"BIRD back: {bird_row(spk)}")
    assert bird_row(spk)["flaps"] == row["flaps"] + 1, bird_row(spk)  # came back once, not reset again
    bird.wait_established("spk")
    eventually(lambda: {"10.99.1.0/24", "10.66.6.0/24"} <= bird.routes().keys(), what="the full table at BIRD")
    # The resync is over once everything owed to BIRD's session has been handed to its socket;
    # a resync that failed on the unencodable route would have reset the session before that.
    eventually(lambda: (r := bird_row(spk))["in_sync"] or r["flaps"] != row["flaps"] + 1, what="BIRD's resync done")
    assert bird_row(spk)["flaps"] == row["flaps"] + 1 and bird.protocol_state("spk") == "Established"
    assert "10.66.1.0/24" not in bird.routes()


def big_table(routers, *, send_timeout: float):
    """BIRD with 5,000 routes, each with its own community (a full re-send is 5,000 UPDATEs,
    ~270 KB), all of them at the speaker; the attacker's address is a passive peer."""
    r1, r2, r3 = routers.lan(3)
    statics = [f"10.{100 + i // 256}.{i % 256}.0/24" for i in range(5000)]
    routes = " ".join(f"route {p} blackhole {{ bgp_community.add((65000, {i})); }};" for i, p in enumerate(statics))
    bird = routers.bird(r2, bird_config(
        BIRD, bird_bgp("spk", BIRD, ASN, SPK, ASN), f"protocol static many {{ ipv4; {routes} }}\n"))
    spk = routers.speaker(r1, speaker_config("spk", SPK, originate=["10.99.1.0/24"], peers=[
        {"address": BIRD, "asn": ASN}, {"address": ATTACKER, "asn": EVIL_AS, "passive": True}], send_timeout=send_timeout))
    eventually(lambda: spk.peer(BIRD)["prefixes_received"] == 5000, timeout=30, what="BIRD's 5,000 routes")
    return r3, spk, bird


def test_route_refresh_flood_from_a_peer_that_never_reads(routers):
    r3, spk, bird = big_table(routers, send_timeout=4)
    row = bird_row(spk)
    rss_before = _rss(spk.pid)
    evil = attacker(routers, r3)
    evil.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, and it never reads
    evil.sock.settimeout(60)
    with Watch(lambda: spk.get("/healthz", timeout=10)["healthy"], interval=0.5) as health:
        evil.send(route_refresh() * 300_000)  # 6.9 MB at once
        # Then one more at each look (every 0.3 s), still reading nothing, until it is reset.
        def reset() -> bool:
            evil.send(route_refresh())
            return evil.closed or "send timeout" in spk.peer(ATTACKER)["info"]

        until(reset, 60, interval=0.3, what=lambda: f"the peer that reads nothing reset: {spk.peer(ATTACKER)}")
    assert not health.errors and all(v for _, v in health.samples), health.errors[:3]
    # Reset with Cease/Out of Resources once its socket stayed full for send_timeout.
    peer = spk.peer(ATTACKER)
    assert "send timeout" in peer["info"], peer
    assert _rss(spk.pid) - rss_before < 60 * 1024 * 1024
    bystander_intact(spk, bird, row, prefixes={"10.99.1.0/24"})
    metrics = spk.ns.http_get(spk.api_url + "/metrics")[1].decode()
    assert 'agentd_bgp_events_total{event="route refreshes folded"}' in metrics


def test_a_peer_that_stops_reading_with_little_owed_is_reset(routers):
    # One ROUTE-REFRESH, then nothing: the table it asked for (5,000 routes, ~270 KB) is less
    # than the transport's write high-water mark and fits in the kernel's send buffer, so the
    # socket never reports itself full. The peer reads nothing more (a 4 KB receive window),
    # sends nothing more and has hold time 0: neither a full buffer nor a hold timer would ever
    # end its session; seeing that nothing sent is acknowledged does (the transport's stall watch).
    r3, spk, bird = big_table(routers, send_timeout=3)
    row = bird_row(spk)
    evil = attacker(routers, r3, rcvbuf=4096)
    evil.send(route_refresh())  # its whole table again (what the handshake read took the first time)
    eventually(lambda: "send timeout" in spk.peer(ATTACKER)["info"], timeout=30, interval=0.5,
               what=lambda: f"the peer that reads nothing reset for its send timeout: {spk.peer(ATTACKER)}")
    bystander_intact(spk, bird, row, prefixes={"10.99.1.0/24"})


def test_silent_connections_do_not_leak_descriptors(routers):
    r1, r2, r3, spk, bird = setup(routers)
    row = bird_row(spk)
    fds = lambda: len(os.listdir(f"/proc/{spk.pid}/fd"))  # noqa: E731
    before = fds()
    for _ in range(50):
        silent = r3.connect(SPK, 179)
        peer = RawBgpPeer.connect(r3, ATTACKER, SPK, asn=EVIL_AS)
        eventually(lambda: spk.peer(ATTACKER)["state"] == "Established", what="the second connection established")
        peer.send(b"\xff" * 16 + b"\x00\x15\x03\x06\x02")  # Cease: next round starts clean
        peer.wait_closed(5)
        peer.close()
        silent.close()
    eventually(lambda: fds() <= before + 4, what=f"descriptors back near {before} (now {fds()})")
    bystander_intact(spk, bird, row, prefixes={"10.99.1.0/24"})


def test_silent_connections_never_lock_a_peer_out_and_every_session_end_is_counted(routers):
    r1, r2, r3, spk, bird = setup(routers)
    row = bird_row(spk)
    # Two connections from the attacker's address that never say a word fill both of its slots
    # (RFC 4271 §6.8) ...
    first, _second = (routers.add(RawBgpPeer(r3.connect(SPK, 179), EVIL_AS, True)) for _ in range(2))
    eventually(lambda: spk.peer(ATTACKER)["state"] == "OpenSent", what="the silent connections accepted")
    # ... and a well-behaved one still gets in: it takes the place of the older silent one.
    good = attacker(routers, r3)
    assert spk.peer(ATTACKER)["state"] == "Established"
    assert first.wait_closed(10) and first.notifications()[-1].subcode == 7  # Cease/Connection Collision Resolution
    eventually(lambda: f"peer {ATTACKER}: a new connection takes the place of an inbound connection on which it had"
               " sent nothing" in spk.log_path.read_text(), what="the displacement logged")
    assert "not a configured or enabled peer" not in spk.log_path.read_text()
    good.send(b"\xff" * 16 + b"\x00\x15\x03\x06\x02")  # Cease/Administrative Shutdown
    assert good.wait_closed(10)
    flaps = eventually(lambda: (p := spk.peer(ATTACKER))["state"] != "Established" and p["flaps"] + 1, what="down")

    # A session that comes up and ends within one read: OPEN, KEEPALIVE and NOTIFICATION in one
    # segment.  Logged, counted as a flap, and its reason shown like any other session end.
    log_before = spk.log_path.read_text().count(f"peer {ATTACKER} established")
    once = routers.add(RawBgpPeer.connect(r3, ATTACKER, SPK, asn=EVIL_AS, handshake=False))
    once.send(once.open_message(ATTACKER, hold_time=0) + b"\xff" * 16 + b"\x00\x13\x04"
              + b"\xff" * 16 + b"\x00\x15\x03\x06\x02")  # fmt: skip
    assert once.wait_closed(10)
    peer = eventually(lambda: (p := spk.peer(ATTACKER))["flaps"] == flaps and p, what=lambda: f"a flap: {spk.peer(ATTACKER)}")
    assert peer["state"] != "Established" and peer["info"].startswith("received NOTIFICATION Cease/Administrative Shutdown")
    log = spk.log_path.read_text()
    assert log.count(f"peer {ATTACKER} established") == log_before + 1, log[-2000:]
    assert log.count(f"peer {ATTACKER} down (received NOTIFICATION Cease/Administrative Shutdown)") == 2, log[-2000:]

    # A refused connection says why.
    r3.ip("addr", "add", "10.0.0.33/24", "dev", "eth0")
    with pytest.raises((ConnectionError, OSError)):
        RawBgpPeer.connect(r3, "10.0.0.33", SPK, asn=EVIL_AS, timeout=5).close()
    eventually(lambda: "refused BGP connection from 10.0.0.33 (not a configured peer)" in spk.log_path.read_text(),
               what="the refusal and its reason logged")
    bystander_intact(spk, bird, row, prefixes={"10.99.1.0/24"})


def test_a_big_rib_is_streamed_without_stopping_bgp(routers):
    r1, r2, r3, spk, bird = setup(routers)
    row = bird_row(spk)
    evil = attacker(routers, r3)
    attrs = PathAttributes((Origin(0), AsPath((AsPathSegment(2, (EVIL_AS,)),))))
    n = 100_000
    prefixes = [bytes((32,)) + (0x0B000000 + i).to_bytes(4, "big") for i in range(n)]  # 11.0.0.0/32 ...
    evil.send(b"".join(encode_updates(1, attrs, IPv4Address(ATTACKER), prefixes)))
    eventually(lambda: spk.peer(ATTACKER)["prefixes_received"] == n, timeout=60, what="100,000 prefixes")
    with Watch(lambda: bird.protocol_state("spk"), interval=0.5) as watch:
        status, body = spk.ns.http_get(spk.api_url + "/rib", timeout=120)
    assert status == 200
    import json

    rows = json.loads(body)
    assert len(rows) >= n + 2 and all(v == "Established" for _, v in watch.samples), watch.samples[-3:]
    page = spk.get("/rib?after=11.0.0.9/32&limit=5")
    assert [r["prefix"] for r in page] == [f"11.0.0.{i}/32" for i in range(10, 15)]
    one = spk.get("/rib?prefix=10.99.2.0/24")
    assert [r["prefix"] for r in one] == ["10.99.2.0/24"]
    assert spk.ns.http_get(spk.api_url + "/rib?prefix=nonsense")[0] == 400
    bystander_intact(spk, bird, row, prefixes={"10.99.1.0/24"})


def test_per_message_problems_do_not_flood_the_log(routers):
    r1, r2, r3, spk, bird = setup(routers, bgp={})
    row = bird_row(spk)
    log_path = spk.log_path
    before = log_path.stat().st_size
    evil = attacker(routers, r3)
    dup = attr(0x80, 4, b"\x00\x00\x00\x05") * 2
    msgs = b"".join(
        update(ORIGIN + as_path([EVIL_AS]) + NH + dup, prefix(f"10.{70 + i // 256}.{i % 256}.0/24")) for i in range(20_000)
    )
    assert len(msgs) > 1_000_000
    evil.send(msgs)
    eventually(lambda: spk.peer(ATTACKER)["prefixes_received"] == 20_000, timeout=60, what="all UPDATEs taken")
    grown = log_path.stat().st_size - before
    assert grown < 64 * 1024, grown
    metrics = spk.ns.http_get(spk.api_url + "/metrics")[1].decode()
    line = next(x for x in metrics.splitlines() if x.startswith('agentd_bgp_problems_total{kind="update-error attribute-discard'))
    assert float(line.rsplit(" ", 1)[1]) == 20_000
    bystander_intact(spk, bird, row, prefixes={"10.99.1.0/24"})


def test_errors_before_established_are_logged(routers):
    r1, r2, r3, spk, bird = setup(routers)
    with pytest.raises(ConnectionError):
        attacker(routers, r3, asn=65099)
    eventually(lambda: "AS 65099 is not the configured 65001" in spk.log_path.read_text(), what="the log line")


def test_rfc_deviations_are_handled_as_the_rfcs_say(routers):
    r1, r2, r3, spk, bird = setup(routers)
    row = bird_row(spk)
    evil = attacker(routers, r3)
    confed = attr(0x40, 2, bytes((3, 1)) + (65010).to_bytes(4, "big") + bytes((2, 1)) + EVIL_AS.to_bytes(4, "big"))
    own_nh = attr(0x40, 3, IPv4Address(SPK).packed)
    evil.send(
        update(ORIGIN + confed + NH, prefix("10.67.1.0/24"))  # RFC 5065 §5: treat-as-withdraw
        + update(ORIGIN + as_path([EVIL_AS]) + own_nh, prefix("10.67.2.0/24"))  # RFC 4271 §6.3: ignored
        + update(ORIGIN + as_path([EVIL_AS]) + NH + attr(0x40, 5, b"\x01\x02"), prefix("10.67.3.0/24"))  # §7.5
        + update(attr(0x40, 1, b"\x07") + as_path([EVIL_AS]) + NH)  # no NLRI, bad ORIGIN: session stays
        + update(ORIGIN + as_path([EVIL_AS]) + NH, prefix("10.67.4.0/24"))
    )
    eventually(lambda: "10.67.4.0/24" in spk.best_routes(), what="the last prefix")
    best = spk.best_routes()
    assert "10.67.1.0/24" not in best and "10.67.2.0/24" not in best
    assert best["10.67.3.0/24"]["local_pref"] is None
    assert spk.peer(ATTACKER)["state"] == "Established" and not evil.closed
    eventually(lambda: {"10.67.3.0/24", "10.67.4.0/24"} <= bird.routes().keys(), what="at BIRD")
    assert not {"10.67.1.0/24", "10.67.2.0/24"} & bird.routes().keys()
    bystander_intact(spk, bird, row, prefixes={"10.99.1.0/24"})


# ---------------------------------------------------------------- max-prefix, GTSM, BFD with BIRD as the peer


def test_max_prefixes_against_bird(routers):
    r1, r2 = routers.lan(2)
    statics = [f"10.98.{i}.0/24" for i in range(20)]
    bird = routers.bird(r2, bird_config(
        BIRD, bird_bgp("spk", BIRD, EVIL_AS, SPK, ASN), static4=statics))
    spk = routers.speaker(r1, speaker_config("spk", SPK, peers=[
        {"address": BIRD, "asn": EVIL_AS, "max_prefixes": 10, "max_prefixes_restart": 3}]))
    eventually(lambda: "Maximum number of prefixes reached" in bird.protocol_info("spk"), timeout=30,
               what="BIRD told Cease/1")
    peer = spk.peer(BIRD)
    assert "maximum prefixes" in peer["info"] and peer["prefixes_received"] == 0
    assert peer["max_prefixes"] == 10
    # It comes back after the restart interval, and trips again.  flaps counts the sessions
    # that came up and ended (bgp/views.py): 1 already, so 2 is a second session that ended.
    # From one row (one read): ended by a second Cease/1 (the hold is 3 s).
    again = eventually(lambda: (p := spk.peer(BIRD))["flaps"] >= 2 and p["state"] != "Established" and p,
                       timeout=60, what="a second session, reset again")
    assert "maximum prefixes" in again["info"] and again["prefixes_received"] == 0, again


def test_gtsm_with_a_strict_peer_both_ways(routers):
    """RFC 5082 against a peer that sets IP_MINTTL 255 before it connects or listens: one packet
    of ours below TTL 255, the SYN-ACK included, and the connection never completes."""
    r1, r2, r3, spk, bird = setup(routers, attacker={"ttl_security": True})
    with pytest.raises((ConnectionError, OSError)):
        attacker(routers, r3, timeout=3)  # Linux's default TTL 64: its SYN is refused
    eventually(lambda: "GTSM" in spk.log_path.read_text(), what="the refusal logged")
    drops = lambda: tcp_ext(r3, "TCPMinTTLDrop")  # noqa: E731 - what r3's IP_MINTTL dropped
    before = drops()

    # It connects to us: our SYN-ACK and everything after it leave with TTL 255.
    strict = attacker(routers, r3, ttl=255, min_ttl=255)
    assert spk.peer(ATTACKER)["state"] == "Established"
    strict.send(update(ORIGIN + as_path([EVIL_AS]) + NH, prefix("10.68.1.0/24")))
    eventually(lambda: "10.68.1.0/24" in bird.routes(), what="its route through us at BIRD")

    # We connect to it: it listens with IP_MINTTL 255 (our SYN and ACKs must be 255 too).
    r3.ip("addr", "add", "10.0.0.4/24", "dev", "eth0")
    r3.ip("addr", "add", "10.0.0.5/24", "dev", "eth0")
    listener = routers.add(RawBgpPeer.listen(r3, "10.0.0.4", ttl=255, min_ttl=255))
    listener.settimeout(ESTABLISH_TIMEOUT)
    cfg = spk.config
    cfg["bgp"]["peers"] += [{"address": "10.0.0.4", "asn": EVIL_AS, "ttl_security": True},
                            {"address": "10.0.0.5", "asn": EVIL_AS, "passive": True}]  # fmt: skip
    spk.reload(cfg)
    conn, _ = listener.accept()
    ours = routers.add(RawBgpPeer(conn, EVIL_AS, four_octet=True))
    ours.handshake("10.0.0.4", hold_time=0)
    spk.wait_peer_state("10.0.0.4", "Established", ESTABLISH_TIMEOUT)
    assert drops() == before

    # A peer without GTSM on the same (shared) listener gets TTL 255 on the SYN-ACK alone: a
    # client demanding 255 completes the TCP handshake, then drops our OPEN (the default TTL).
    plain = routers.add(RawBgpPeer.connect(r3, "10.0.0.5", SPK, asn=EVIL_AS, min_ttl=255, handshake=False))
    spk.wait_peer_state("10.0.0.5", "OpenSent", ESTABLISH_TIMEOUT)
    eventually(lambda: drops() > before, what="our OPEN to the peer without GTSM, below TTL 255, dropped")
    assert not plain.read(1.0)  # nothing of ours got through (read(0.0) would look at nothing)


def test_gtsm_session_with_bird(routers):
    r1, r2 = routers.lan(2)
    routers.bird(r2, bird_config(
        BIRD, bird_bgp("spk", BIRD, EVIL_AS, SPK, ASN, options="ttl security on;"), static4=["10.97.0.0/24"]))
    spk = routers.speaker(r1, speaker_config("spk", SPK, peers=[
        {"address": BIRD, "asn": EVIL_AS, "ttl_security": True}]))
    spk.wait_peer_state(BIRD, "Established", ESTABLISH_TIMEOUT)
    eventually(lambda: "10.97.0.0/24" in spk.best_routes(), what="BIRD's route")


def test_bfd_takes_a_frozen_bird_down_before_its_hold_timer(routers):
    r1, r2, r3 = routers.lan(3)
    bird = routers.bird(r2, bird_config(
        BIRD, bird_bgp("spk", BIRD, ASN, SPK, ASN, options="bfd on;"),
        'protocol bfd { interface "eth0" { min rx interval 100 ms; min tx interval 100 ms; multiplier 3; }; }\n',
        static4=["10.96.0.0/24"]))
    spk = routers.speaker(r1, speaker_config("spk", SPK, peers=[
        {"address": BIRD, "asn": ASN, "bfd": True},
        {"address": ATTACKER, "asn": EVIL_AS, "passive": True},
    ], bfd_interval=0.1))  # Detect Mult: the default, 3
    spk.wait_peer_state(BIRD, "Established", ESTABLISH_TIMEOUT)
    eventually(lambda: spk.peer(BIRD)["bfd"] == "Up", timeout=20, what="BFD Up")
    eventually(lambda: "10.96.0.0/24" in spk.best_routes(), what="BIRD's route")
    watcher = attacker(routers, r3)  # an eBGP neighbour that must be told the route is gone
    # It must have been sent the route before it can be told it is gone (the handshake's
    # reads may have taken it already: all it read counts).
    read_until(watcher, lambda got: prefix("10.96.0.0/24") in announced(got), 20, what="BIRD's route at the watcher")
    mark = len(watcher.messages)
    bird.freeze()
    try:
        frozen_at = time.monotonic()
        eventually(lambda: "10.96.0.0/24" not in spk.best_routes(), timeout=HOLD, interval=0.02, what="withdrawn")
        took = time.monotonic() - frozen_at
        # BFD's Detection Time is 0.3 s (Detect Mult 3, the default: a due detection timer
        # reads the packets waiting first, so a starved process is no flap); what else could end
        # the session is the hold timer, no sooner than HOLD less one keepalive interval (a third
        # of it) after the freeze.  Under that bound it was BFD (its "BFD down" is checked
        # below); how fast is bench material.
        assert took < HOLD - HOLD / 3, f"routes withdrawn {took:.3f}s after the freeze"
        print(f"\nroutes withdrawn {took:.3f}s after BIRD froze (BFD Detection Time 0.3 s, hold time {HOLD} s)")
    finally:
        bird.thaw()
    peer = spk.peer(BIRD)
    assert "BFD down" in peer["info"], peer
    read_until(watcher, lambda got: prefix("10.96.0.0/24") in withdrawn(got[mark:]), 20, what="the withdrawal at the watcher")
    # BIRD comes back: BFD and BGP up again, the route returns.
    eventually(lambda: spk.peer(BIRD)["state"] == "Established", timeout=30, what="BGP back")
    eventually(lambda: "10.96.0.0/24" in spk.best_routes(), timeout=20, what="route back")


def test_bfd_watches_a_client_accepted_from_a_listen_range(routers):
    """A reflector with [bgp] bfd and a listen range (no [[bgp.peers]] entry): the client it
    accepts gets a BFD session, and a frozen client is dropped by BFD, not at hold time."""
    r1, r2 = routers.lan(2)
    bird = routers.bird(r2, bird_config(
        BIRD, bird_bgp("reflector", BIRD, ASN, SPK, ASN, options="bfd on;"),
        'protocol bfd { interface "eth0" { min rx interval 100 ms; min tx interval 100 ms; multiplier 3; }; }\n',
        static4=["10.95.0.0/24"]))
    spk = routers.speaker(r1, speaker_config("spk", SPK, bfd=True, bfd_interval=0.1,
                                             listen_ranges=[{"prefix": "10.0.0.0/24", "asn": ASN}]))
    def client(field: str):
        row = next((p for p in spk.peers() if p["address"] == BIRD), None)  # none until BIRD connects
        return row[field] if row is not None else None

    eventually(lambda: client("state") == "Established", timeout=ESTABLISH_TIMEOUT, what="BIRD accepted")
    eventually(lambda: client("bfd") == "Up", timeout=20, what="BFD Up for the dynamic client")
    eventually(lambda: "10.95.0.0/24" in spk.best_routes(), what="BIRD's route")
    bird.freeze()
    try:
        frozen_at = time.monotonic()
        eventually(lambda: "10.95.0.0/24" not in spk.best_routes(), timeout=HOLD, interval=0.02, what="withdrawn")
        took = time.monotonic() - frozen_at
        assert took < HOLD - HOLD / 3, f"routes withdrawn {took:.3f}s after the freeze"
    finally:
        bird.thaw()
    eventually(lambda: "10.95.0.0/24" in spk.best_routes(), timeout=30, what="route back")


def _updates(got: list[tuple[int, bytes]]) -> list[Update]:
    return [Update.decode(body, CodecContext(external=True)) for t, body in got if t == MessageType.UPDATE]


def announced(got: list[tuple[int, bytes]]) -> list[bytes]:
    return [p for u in _updates(got) for p in u.nlri]


def withdrawn(got: list[tuple[int, bytes]]) -> list[bytes]:
    return [p for u in _updates(got) for p in u.withdrawn]


def read_until(peer: RawBgpPeer, seen: Callable[[list[tuple[int, bytes]]], bool], timeout: float, what: str) -> None:
    """Read from ``peer`` until ``seen(every message it has read, peer.messages)`` holds; fails
    after ``timeout`` s or if the connection closes first.  (A fixed read window misses what a
    loaded machine sends late.)"""
    deadline = time.monotonic() + timeout
    while not seen(peer.messages):
        left = deadline - time.monotonic()
        assert left > 0 and not peer.closed, f"{what}: not read in {timeout:g} s (closed: {peer.closed})"
        peer.read(min(0.5, left))


def tcp_ext(ns, counter: str) -> int:
    """One TcpExt counter of /proc/net/netstat in ``ns``."""
    lines = [line.split() for line in ns.exec("cat", "/proc/net/netstat").splitlines() if line.startswith("TcpExt:")]
    return int(lines[1][lines[0].index(counter)])


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")




def test_connections_reset_before_the_loop_set_them_up_are_refused_without_a_traceback():
    """Under uvloop (as the agent runs), an inbound connection reset before its transport was
    set up has no peer address: each one was a TypeError traceback in the loop's exception
    handler (log flooding by anyone who reaches port 179).  Refused and counted now.  In
    process, on loopback: the client's RST (SO_LINGER 0) is sent before the loop accepts."""
    import asyncio

    import uvloop

    from bgp.testing import make_speaker
    from bgp.transport import SpeakerService

    n = 20

    async def run() -> tuple[list[dict], int]:
        errors: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        svc = SpeakerService(make_speaker("127.0.0.1", 65000, [("127.0.0.2", 65000)]), listen=("127.0.0.1", 0))
        await svc.start()
        try:
            port = svc._listen_sock.getsockname()[1]
            for _ in range(n):
                with socket.socket() as c:
                    c.connect(("127.0.0.1", port))
                    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            deadline = time.monotonic() + 5.0
            while svc.speaker.counters["connections refused"] + len(errors) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return errors, svc.speaker.counters["connections refused"]
        finally:
            await svc.stop(graceful=False)

    errors, refused = uvloop.run(run())
    assert not errors, errors[0]
    assert refused == n
