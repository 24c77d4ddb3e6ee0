"""Issue 10 on the real speaker: one bad peer must never hurt another session.

Three routers on one bridge: ``agentd speaker`` at 10.0.0.1 (AS 65000), BIRD 2 at 10.0.0.2
(iBGP, the bystander whose session and routes must stay intact) and an attacker at
10.0.0.3 (AS 65001, eBGP, a hand-driven socket: agentd.lab.rawbgp).  Each test replays one
finding of the issue and checks the bystander: its session never flapped (the speaker's
``flaps`` and ``since`` for it, BIRD's protocol state), it still has every valid route and
none that could not be sent.  Plus max-prefix, GTSM and BFD against BIRD.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator
from ipaddress import IPv4Address

import pytest

from agentd.lab.interop import ASN, ESTABLISH_TIMEOUT, Watch, bird_bgp, bird_config, eventually, lan, speaker_config, start_bird, start_speaker
from agentd.lab.rawbgp import RawBgpPeer, as_path, attr, prefix, route_refresh, update
from proto.errors import ErrorCode
from proto.messages import encode_updates
from proto.attributes import AsPath, AsPathSegment, Origin, PathAttributes

pytestmark = pytest.mark.timeout(240)

SPK, BIRD, ATTACKER = "10.0.0.1", "10.0.0.2", "10.0.0.3"
EVIL_AS = 65001
ORIGIN = attr(0x40, 1, b"\x00")
NH = attr(0x40, 3, IPv4Address(ATTACKER).packed)


@pytest.fixture
def procs() -> Iterator[list]:
    made: list = []
    try:
        yield made
    finally:
        for p in reversed(made):
            p.stop()


def routers(netns_factory, procs, tmp_path, *, attacker: dict | None = None, bird_static=("10.99.2.0/24",),
            bird_extra: str = "", bgp: dict | None = None, bird_options: str = ""):
    r1, r2, r3 = lan(netns_factory, 3)
    bird = start_bird(procs, r2, tmp_path / "bird", bird_config(
        BIRD, bird_bgp("spk", BIRD, ASN, SPK, ASN, options=bird_options), bird_extra, static4=list(bird_static)))
    peers = [{"address": BIRD, "asn": ASN}, {"address": ATTACKER, "asn": EVIL_AS, "passive": True, **(attacker or {})}]
    spk = start_speaker(procs, r1, tmp_path / "spk", speaker_config(
        "spk", SPK, originate=["10.99.1.0/24"], peers=peers, **(bgp or {})))
    spk.wait_peer_state(BIRD, "Established", ESTABLISH_TIMEOUT)
    bird.wait_established("spk")
    eventually(lambda: set(bird_static) <= spk.best_routes().keys(), what="BIRD's routes at the speaker")
    return r1, r2, r3, spk, bird


def attacker(procs: list, r3, **kw) -> RawBgpPeer:
    """A raw neighbour from the attacker's address (hold time 0: it may sit idle as long as a
    test needs); closed with the test's processes."""
    kw.setdefault("hold_time", 0)
    peer = RawBgpPeer.connect(r3, ATTACKER, SPK, asn=kw.pop("asn", EVIL_AS), **kw)
    procs.append(peer)
    return peer


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


def test_routes_that_cannot_be_exported_never_reach_or_reset_the_bystander(netns_factory, procs, tmp_path):
    r1, r2, r3, spk, bird = routers(netns_factory, procs, tmp_path)
    row = bird_row(spk)
    evil = attacker(procs, r3, graceful_restart=True)
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
    old = attacker(procs, r3, four_octet=False)
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
    evil2 = attacker(procs, r3, graceful_restart=True)
    evil2.send(big + update(ORIGIN + as_path([EVIL_AS]) + NH, prefix("10.66.6.0/24")))
    eventually(lambda: "10.66.6.0/24" in bird.routes(), what="10.66.6.0/24 at BIRD")
    evil2.sock.shutdown(2)  # gone without a NOTIFICATION: its routes stay, stale
    evil2.close()
    eventually(lambda: spk.peer(ATTACKER)["graceful_restart"], what="the attacker's routes kept as stale")
    bird.birdc("restart", "spk")
    eventually(lambda: bird_row(spk)["flaps"] == row["flaps"] + 1 and bird_row(spk)["state"] == "Established",
               what="BIRD back")
    bird.wait_established("spk")
    eventually(lambda: {"10.99.1.0/24", "10.66.6.0/24"} <= bird.routes().keys(), what="the full table at BIRD")
    flaps = bird_row(spk)["flaps"]
    time.sleep(3)  # a resync that failed would reset BIRD's session again within this window
    assert bird_row(spk)["flaps"] == flaps and bird.protocol_state("spk") == "Established"
    assert "10.66.1.0/24" not in bird.routes()


def big_table(netns_factory, procs, tmp_path, *, send_timeout: float):
    """BIRD with 5,000 routes, each with its own community (a full re-send is 5,000 UPDATEs,
    ~270 KB), all of them at the speaker; the attacker's address is a passive peer."""
    r1, r2, r3 = lan(netns_factory, 3)
    statics = [f"10.{100 + i // 256}.{i % 256}.0/24" for i in range(5000)]
    routes = " ".join(f"route {p} blackhole {{ bgp_community.add((65000, {i})); }};" for i, p in enumerate(statics))
    bird = start_bird(procs, r2, tmp_path / "bird", bird_config(
        BIRD, bird_bgp("spk", BIRD, ASN, SPK, ASN), f"protocol static many {{ ipv4; {routes} }}\n"))
    spk = start_speaker(procs, r1, tmp_path / "spk", speaker_config("spk", SPK, originate=["10.99.1.0/24"], peers=[
        {"address": BIRD, "asn": ASN}, {"address": ATTACKER, "asn": EVIL_AS, "passive": True}], send_timeout=send_timeout))
    eventually(lambda: spk.peer(BIRD)["prefixes_received"] == 5000, timeout=30, what="BIRD's 5,000 routes")
    return r3, spk, bird


def test_route_refresh_flood_from_a_peer_that_never_reads(netns_factory, procs, tmp_path):
    r3, spk, bird = big_table(netns_factory, procs, tmp_path, send_timeout=4)
    row = bird_row(spk)
    rss_before = _rss(spk.pid)
    evil = attacker(procs, r3)
    evil.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, and it never reads
    evil.sock.settimeout(60)
    with Watch(lambda: spk.get("/healthz", timeout=10)["healthy"], interval=0.5) as health:
        evil.send(route_refresh() * 300_000)  # 6.9 MB at once
        # Then one more every 0.3 s (its hold timer never expires), still reading nothing.
        deadline = time.monotonic() + 60
        while not evil.closed and time.monotonic() < deadline:
            evil.send(route_refresh())
            if "send timeout" in spk.peer(ATTACKER)["info"]:
                break
            time.sleep(0.3)
    assert not health.errors and all(v for _, v in health.samples), health.errors[:3]
    # Reset with Cease/Out of Resources once its socket stayed full for send_timeout.
    peer = spk.peer(ATTACKER)
    assert "send timeout" in peer["info"], peer
    assert _rss(spk.pid) - rss_before < 60 * 1024 * 1024
    bystander_intact(spk, bird, row, prefixes={"10.99.1.0/24"})
    metrics = spk.ns.http_get(spk.api_url + "/metrics")[1].decode()
    assert 'agentd_bgp_events_total{event="route refreshes folded"}' in metrics


def test_a_peer_that_stops_reading_with_little_owed_is_reset(netns_factory, procs, tmp_path):
    # One ROUTE-REFRESH, then nothing: the table it asked for (5,000 routes, ~270 KB) is less
    # than the transport's write high-water mark and fits in the kernel's send buffer, so the
    # socket never reports itself full. The peer reads nothing more (a 4 KB receive window),
    # sends nothing more and has hold time 0: neither a full buffer nor a hold timer would ever
    # end its session; seeing that nothing sent is acknowledged does (the transport's stall watch).
    r3, spk, bird = big_table(netns_factory, procs, tmp_path, send_timeout=3)
    row = bird_row(spk)
    evil = attacker(procs, r3, rcvbuf=4096)
    evil.send(route_refresh())  # its whole table again (what the handshake read took the first time)
    eventually(lambda: "send timeout" in spk.peer(ATTACKER)["info"], timeout=30, interval=0.5,
               what=lambda: f"the peer that reads nothing reset for its send timeout: {spk.peer(ATTACKER)}")
    bystander_intact(spk, bird, row, prefixes={"10.99.1.0/24"})


def test_silent_connections_do_not_leak_descriptors(netns_factory, procs, tmp_path):
    r1, r2, r3, spk, bird = routers(netns_factory, procs, tmp_path)
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


def test_a_big_rib_is_streamed_without_stopping_bgp(netns_factory, procs, tmp_path):
    r1, r2, r3, spk, bird = routers(netns_factory, procs, tmp_path)
    row = bird_row(spk)
    evil = attacker(procs, r3)
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


def test_per_message_problems_do_not_flood_the_log(netns_factory, procs, tmp_path):
    r1, r2, r3, spk, bird = routers(netns_factory, procs, tmp_path, bgp={})
    row = bird_row(spk)
    log_path = spk.log_path
    before = log_path.stat().st_size
    evil = attacker(procs, r3)
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


def test_errors_before_established_are_logged(netns_factory, procs, tmp_path):
    r1, r2, r3, spk, bird = routers(netns_factory, procs, tmp_path)
    with pytest.raises(ConnectionError):
        attacker(procs, r3, asn=65099)
    eventually(lambda: "AS 65099 is not the configured 65001" in spk.log_path.read_text(), what="the log line")


def test_rfc_deviations_are_handled_as_the_rfcs_say(netns_factory, procs, tmp_path):
    r1, r2, r3, spk, bird = routers(netns_factory, procs, tmp_path)
    row = bird_row(spk)
    evil = attacker(procs, r3)
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


def test_max_prefixes_against_bird(netns_factory, procs, tmp_path):
    r1, r2 = lan(netns_factory, 2)
    statics = [f"10.98.{i}.0/24" for i in range(20)]
    bird = start_bird(procs, r2, tmp_path / "bird", bird_config(
        BIRD, bird_bgp("spk", BIRD, EVIL_AS, SPK, ASN), static4=statics))
    spk = start_speaker(procs, r1, tmp_path / "spk", speaker_config("spk", SPK, peers=[
        {"address": BIRD, "asn": EVIL_AS, "max_prefixes": 10, "max_prefixes_restart": 3}]))
    eventually(lambda: "Maximum number of prefixes reached" in bird.protocol_info("spk"), timeout=30,
               what="BIRD told Cease/1")
    peer = spk.peer(BIRD)
    assert "maximum prefixes" in peer["info"] and peer["prefixes_received"] == 0
    assert peer["max_prefixes"] == 10
    # It comes back after the restart interval, and trips again.
    eventually(lambda: spk.peer(BIRD)["flaps"] >= 1, timeout=30, what="a second session")


def test_gtsm_refuses_a_peer_whose_packets_did_not_come_with_ttl_255(netns_factory, procs, tmp_path):
    r1, r2, r3, spk, bird = routers(netns_factory, procs, tmp_path, attacker={"ttl_security": True})
    with pytest.raises((ConnectionError, OSError)):
        attacker(procs, r3, timeout=3)  # Linux's default TTL 64
    eventually(lambda: "GTSM" in spk.log_path.read_text(), what="the refusal logged")
    attacker(procs, r3, ttl=255)
    assert spk.peer(ATTACKER)["state"] == "Established"


def test_gtsm_session_with_bird(netns_factory, procs, tmp_path):
    r1, r2 = lan(netns_factory, 2)
    start_bird(procs, r2, tmp_path / "bird", bird_config(
        BIRD, bird_bgp("spk", BIRD, EVIL_AS, SPK, ASN, options="ttl security on;"), static4=["10.97.0.0/24"]))
    spk = start_speaker(procs, r1, tmp_path / "spk", speaker_config("spk", SPK, peers=[
        {"address": BIRD, "asn": EVIL_AS, "ttl_security": True}]))
    spk.wait_peer_state(BIRD, "Established", ESTABLISH_TIMEOUT)
    eventually(lambda: "10.97.0.0/24" in spk.best_routes(), what="BIRD's route")


def test_bfd_takes_a_frozen_bird_down_within_a_second(netns_factory, procs, tmp_path):
    r1, r2, r3 = lan(netns_factory, 3)
    bird = start_bird(procs, r2, tmp_path / "bird", bird_config(
        BIRD, bird_bgp("spk", BIRD, ASN, SPK, ASN, options="bfd on;"),
        'protocol bfd { interface "eth0" { min rx interval 100 ms; min tx interval 100 ms; multiplier 3; }; }\n',
        static4=["10.96.0.0/24"]))
    spk = start_speaker(procs, r1, tmp_path / "spk", speaker_config("spk", SPK, peers=[
        {"address": BIRD, "asn": ASN, "bfd": True},
        {"address": ATTACKER, "asn": EVIL_AS, "passive": True},
    ], bfd_interval=0.1, bfd_multiplier=3))
    spk.wait_peer_state(BIRD, "Established", ESTABLISH_TIMEOUT)
    eventually(lambda: spk.peer(BIRD)["bfd"] == "Up", timeout=20, what="BFD Up")
    eventually(lambda: "10.96.0.0/24" in spk.best_routes(), what="BIRD's route")
    watcher = attacker(procs, r3)  # an eBGP neighbour that must be told the route is gone
    watcher.read(1.0)
    bird.freeze()
    try:
        frozen_at = time.monotonic()
        eventually(lambda: "10.96.0.0/24" not in spk.best_routes(), timeout=5, interval=0.02, what="withdrawn")
        took = time.monotonic() - frozen_at
        assert took < 1.0, f"routes withdrawn {took:.3f}s after the freeze"
    finally:
        bird.thaw()
    peer = spk.peer(BIRD)
    assert "BFD down" in peer["info"], peer
    got = watcher.read(1.0)
    from proto.messages import Update, CodecContext

    withdrawn = [p for t, body in got if t == 2 for p in Update.decode(body, CodecContext(external=True)).withdrawn]
    assert prefix("10.96.0.0/24") in withdrawn
    # BIRD comes back: BFD and BGP up again, the route returns.
    eventually(lambda: spk.peer(BIRD)["state"] == "Established", timeout=30, what="BGP back")
    eventually(lambda: "10.96.0.0/24" in spk.best_routes(), timeout=20, what="route back")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


