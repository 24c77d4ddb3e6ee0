"""agentd's BFD (bgp.bfd_transport.BfdService) against BIRD 2's BFD: both sides Up at 100 ms,
a frozen peer noticed, TTL 255 on the wire and spoofed packets discarded, AdminDown on removal.

Two routers on a veth pair, one network namespace each: ``r1`` (10.0.0.1, 2001:db8:ff::1)
runs our BfdService in a small process (agentd.lab.bfd_proc), ``r2`` (10.0.0.2,
2001:db8:ff::2) runs BIRD with a ``protocol bfd`` neighbour towards r1.  Both sides ask
for 100 ms intervals and a multiplier of 3 (the default), so each side's Detection Time is
300 ms.  (Commit 08261f7 had raised it to 5 after a session went down by itself on a busy
machine; BfdService now reads the packets waiting in its sockets before it declares a
neighbour down, as uvloop runs due timers before it reads sockets.)

What is on the wire is read in r2 with an AF_PACKET socket (agentd.lab.bfd_proc.BfdSniffer)
and decoded with our codec; BIRD is read through ``birdc show bfd sessions``.
"""

from __future__ import annotations

import re
import time

import pytest

from agentd.lab.bfd_proc import BfdProcess, BfdSniffer, send_udp
from agentd.lab.bird import Bird
from proto.bfd import ControlPacket, Diag, State

pytestmark = pytest.mark.timeout(180)

INTERVAL = 0.1
MULT = 3
DETECTION = MULT * INTERVAL
# A frozen peer must be noticed after the Detection Time the fast timers give (0.3 s), not the
# one the slow rate of a session that is not Up would give (1 s x 3, RFC 5880 §6.8.3; BIRD's
# ``idle tx interval 1 s`` below).  The bound lies halfway between the two (1.65 s): it tells the
# fast timer from the slow one with over a second of slack for a loaded machine.  How fast it is
# exactly is printed, not asserted.
SLOW_DETECTION = MULT * 1.0
FREEZE_BOUND = (DETECTION + SLOW_DETECTION) / 2
UP_TIMEOUT = 20.0

_BIRD_ROW = re.compile(
    r"^(?P<address>\S+)\s+(?P<iface>\S+)\s+(?P<state>AdminDown|Down|Init|Up)\s+(?P<since>\S+)\s+"
    r"(?P<interval>[\d.]+)\s+(?P<timeout>[\d.]+)\s*$",
    re.MULTILINE,
)


def bird_bfd_config(router_id: str, *neighbors: str) -> str:
    lines = "\n".join(f'  neighbor {n} dev "eth0";' for n in neighbors)
    return (
        f"router id {router_id};\n"
        "protocol device { scan time 1; }\n"
        "protocol bfd {\n"
        "  debug { states, events };\n"
        '  interface "eth0" { min rx interval 100 ms; min tx interval 100 ms; idle tx interval 1 s; '
        f'multiplier {MULT}; }};\n'
        f"{lines}\n"
        "}\n"
    )


def bird_sessions(bird: Bird) -> dict[str, dict[str, str]]:
    """``birdc show bfd sessions`` as {address: {"state", "interval", "timeout", ...}}."""
    out = bird.birdc("show", "bfd", "sessions")
    return {m["address"]: m.groupdict() for m in _BIRD_ROW.finditer(out)}


def bird_state(bird: Bird, address: str) -> str | None:
    row = bird_sessions(bird).get(address)
    return row["state"] if row else None


def start(routers, *, v6: bool, ours: str, theirs: str) -> tuple:
    r1, r2 = routers.pair(v6=v6)
    bird = routers.bird(r2, bird_bfd_config("10.0.0.2", ours))
    bfd = routers.bfd(r1, listen=None, peers=[theirs], tx=INTERVAL, rx=INTERVAL, mult=MULT)
    bfd.wait_state(theirs, "Up", UP_TIMEOUT)
    bird.wait_until(lambda: bird_state(bird, ours) == "Up", UP_TIMEOUT, what=lambda: f"BIRD Up:\n{bird_sessions(bird)}")
    return r1, r2, bird, bfd


def wait_fast(bfd: BfdProcess, bird: Bird, ours: str, theirs: str) -> dict:
    """Both sides Up and done with their polls: 100 ms each way, 300 ms Detection Time."""
    session = bfd.wait_until(
        lambda: (s := bfd.session(theirs)) and s["state"] == "Up" and not s["poll"]
        and s["tx_interval"] == pytest.approx(INTERVAL) and s["detection_time"] == pytest.approx(DETECTION) and s,
        UP_TIMEOUT, what=lambda: f"fast timers at our side: {bfd.session(theirs)}",
    )
    row = bird.wait_until(
        lambda: (r := bird_sessions(bird).get(ours)) and r["state"] == "Up" and r["interval"] == "0.100"
        and r["timeout"] == f"{DETECTION:.3f}" and r,
        UP_TIMEOUT, what=lambda: f"fast timers at BIRD: {bird_sessions(bird)}",
    )
    assert row["iface"] == "eth0"
    return session


def downs_since(bfd: BfdProcess, peer: str, seen: int, t0: float) -> list[dict]:
    """The Down events after the first ``seen`` that happened at ``t0`` or later: an event
    logged just before (a flap of a starved process) is not the one a freeze at t0 causes."""
    return [e for e in bfd.events(peer)[seen:] if e["state"] == "Down" and e["t"] >= t0]


def test_bfd_with_bird_ipv4_up_freeze_thaw_ttl_and_remove(routers):
    ours, theirs = "10.0.0.1", "10.0.0.2"
    r1, r2, bird, bfd = start(routers, v6=False, ours=ours, theirs=theirs)

    # -- Up on both sides at 100 ms; look at the wire meanwhile (RFC 5881 §4, §5).
    with BfdSniffer(r2, "eth0") as wire:
        session = wait_fast(bfd, bird, ours, theirs)
        bfd.wait_until(lambda: len(wire.from_address(ours)) >= 5 and wire.from_address(theirs), 5,
                       what="packets both ways on the wire")
    mine = wire.from_address(ours)
    assert {p.ttl for p in mine} == {255} and {p.dport for p in mine} == {3784}
    assert len({p.sport for p in mine}) == 1 and 49152 <= mine[0].sport <= 65535
    assert {p.tos for p in mine} == {0xC0}
    last = mine[-1].decode()
    assert last.state is State.UP and last.desired_min_tx == 100_000 and last.required_min_rx == 100_000
    assert last.my_discriminator == session["local_discriminator"]
    assert last.your_discriminator == session["remote_discriminator"]
    birds = [p.decode() for p in wire.from_address(theirs)]
    assert birds[-1].state is State.UP and birds[-1].my_discriminator == session["remote_discriminator"]
    print(f"\nBIRD packet on the wire: {wire.from_address(theirs)[-1].payload.hex()} ({birds[-1]})")

    # -- BIRD frozen (SIGSTOP): our side goes Down, diag 1, within the bound.
    latencies = []
    for _round in range(3):
        wait_fast(bfd, bird, ours, theirs)
        seen = len(bfd.events(theirs))
        t_freeze = time.monotonic()
        bird.freeze()
        try:
            down = bfd.wait_until(lambda seen=seen, t0=t_freeze: downs_since(bfd, theirs, seen, t0), 10,
                                  what="our session Down after SIGSTOP")[0]
        finally:
            bird.thaw()
        latency = down["t"] - t_freeze
        latencies.append(latency)
        assert down["old"] == "Up" and down["diag"] == Diag.CONTROL_DETECTION_TIME_EXPIRED and down["failure"], down
        assert latency < FREEZE_BOUND, f"down {latency:.3f} s after SIGSTOP"
        # SIGCONT: Up again on both sides.
        bfd.wait_state(theirs, "Up", UP_TIMEOUT)
        bird.wait_until(lambda: bird_state(bird, ours) == "Up", UP_TIMEOUT, what="BIRD Up after SIGCONT")
    print(f"down after SIGSTOP (s): {', '.join(f'{x:.3f}' for x in latencies)}; Detection Time {DETECTION:.3f} s")
    # The freezes were the only failures: no false detection in between.
    failures = [e for e in bfd.events(theirs) if e["failure"]]
    assert len(failures) == len(latencies), failures
    assert bfd.session(theirs)["last_down_diag"] == Diag.CONTROL_DETECTION_TIME_EXPIRED

    # -- A packet that would take the session down, but arrives with TTL 64: discarded (RFC 5881 §5).
    session = wait_fast(bfd, bird, ours, theirs)
    spoof = ControlPacket(State.ADMIN_DOWN, my_discriminator=session["remote_discriminator"],
                          your_discriminator=session["local_discriminator"], diag=Diag.ADMINISTRATIVELY_DOWN,
                          detect_mult=MULT, desired_min_tx=100_000, required_min_rx=100_000).encode()
    bad_before, events_before = session["bad_packets"], len(bfd.events(theirs))
    send_udp(r2, theirs, ours, spoof, ttl=64)
    after = bfd.wait_until(lambda: (s := bfd.session(theirs))["bad_packets"] == bad_before + 1 and s, 5,
                           what="the bad-packet counter")
    assert after["state"] == "Up" and len(bfd.events(theirs)) == events_before
    packets_in = after["packets_in"]
    bfd.wait_until(lambda: bfd.session(theirs)["packets_in"] > packets_in + 5, 5, what="BIRD's packets still counted")
    assert bfd.session(theirs)["state"] == "Up" and len(bfd.events(theirs)) == events_before
    # The same packet with TTL 255 is taken: Down, diag 3, and (AdminDown) not a failure.  The
    # Down it caused is the one for received AdminDown (not one a starved process could add).
    send_udp(r2, theirs, ours, spoof, ttl=255)
    down = bfd.wait_until(lambda: [e for e in bfd.events(theirs)[events_before:]
                                   if e["state"] == "Down" and e["cause"] == "received AdminDown"], 5,
                          what=lambda: f"Down after the TTL 255 AdminDown: {bfd.events(theirs)[events_before:]}")[0]
    assert down["diag"] == Diag.NEIGHBOR_SIGNALED_SESSION_DOWN and not down["failure"], down
    wait_fast(bfd, bird, ours, theirs)

    # -- Our side removes the session: AdminDown on the wire, BIRD goes Down while still hearing from us.
    # The removal is timed from our first AdminDown packet, not from the request: Up packets
    # keep going out until the request is handled, and the sniffer stamps a packet when it reads it.
    def admin_downs() -> list:
        mine = wire.from_address(ours)
        first = next((i for i, p in enumerate(mine) if p.decode().state is State.ADMIN_DOWN), len(mine))
        return mine[first:]

    with BfdSniffer(r2, "eth0") as wire:
        bfd.remove(theirs)
        bird.wait_until(lambda: bird_state(bird, ours) == "Down", 10, what=lambda: f"BIRD Down: {bird_sessions(bird)}")
        bfd.wait_until(lambda: len(admin_downs()) >= 2, 5, what="AdminDown packets")
        admin = [p.decode() for p in admin_downs()]
        assert all(p.state is State.ADMIN_DOWN and p.diag == Diag.ADMINISTRATIVELY_DOWN for p in admin), admin
        assert admin[0].desired_min_tx == 1_000_000  # not Up: 1 s (RFC 5880 §6.8.3)
        # BIRD took the AdminDown packets (its Timeout is MULT x our AdminDown 1 s), not a timeout.
        assert bird_sessions(bird)[ours]["timeout"] == f"{SLOW_DETECTION:.3f}", bird_sessions(bird)
        assert bfd.session(theirs) is None
        # AdminDown goes out for a Detection Time (MULT x 1 s), then the session's socket closes.
        bfd.wait_until(lambda: time.monotonic() - max(p.t for p in wire.from_address(ours)) > 1.5, SLOW_DETECTION + 15,
                       what="the end of the AdminDown packets")
    sent = admin_downs()
    t_admin = sent[0].t
    # Sent at the 1 s rate (0.75-1 s apart, jittered), not 100 ms: still going out 1.5 s on (the
    # fast rate's Detection Time is 0.3 s; event-loop delays on a busy machine may cut the
    # train short of its MULT s by a packet), and no more than the 1 s rate gives.
    assert 3 <= len(sent) <= 2 * MULT and sent[-1].t - t_admin >= 1.5, [round(p.t - t_admin, 3) for p in sent]
    assert bird_state(bird, ours) == "Down"


def test_bfd_with_bird_ipv6_up_and_hop_limit(routers):
    ours, theirs = "2001:db8:ff::1", "2001:db8:ff::2"
    r1, r2, bird, bfd = start(routers, v6=True, ours=ours, theirs=theirs)
    with BfdSniffer(r2, "eth0") as wire:
        session = wait_fast(bfd, bird, ours, theirs)
        bfd.wait_until(lambda: len(wire.from_address(ours)) >= 3, 5, what="our IPv6 packets on the wire")
    mine = wire.from_address(ours)
    assert {p.ttl for p in mine} == {255} and {p.tos for p in mine} == {0xC0}
    assert 49152 <= mine[0].sport <= 65535 and mine[0].dport == 3784
    # Hop Limit 64: discarded, the session stays Up.
    spoof = ControlPacket(State.DOWN, my_discriminator=session["remote_discriminator"],
                          your_discriminator=session["local_discriminator"], detect_mult=MULT).encode()
    events_before = len(bfd.events(theirs))
    send_udp(r2, theirs, ours, spoof, ttl=64)
    after = bfd.wait_until(lambda: (s := bfd.session(theirs))["bad_packets"] == session["bad_packets"] + 1 and s, 5,
                           what="the bad-packet counter")
    assert after["state"] == "Up" and len(bfd.events(theirs)) == events_before
    # Freeze BIRD: Down with diag 1 within the bound, over IPv6 too.
    seen = len(bfd.events(theirs))
    t_freeze = time.monotonic()
    bird.freeze()
    try:
        down = bfd.wait_until(lambda: downs_since(bfd, theirs, seen, t_freeze), 10,
                              what="our session Down after SIGSTOP")[0]
    finally:
        bird.thaw()
    assert down["diag"] == Diag.CONTROL_DETECTION_TIME_EXPIRED and down["failure"]
    assert down["t"] - t_freeze < FREEZE_BOUND
    print(f"\nIPv6: down {down['t'] - t_freeze:.3f} s after SIGSTOP")
    assert [e for e in bfd.events(theirs) if e["failure"]] == [down]  # the freeze's, no other
    bfd.wait_state(theirs, "Up", UP_TIMEOUT)
