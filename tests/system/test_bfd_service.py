"""Two of agentd's BfdServices against each other (IPv4 and IPv6 at once), each in its own
network namespace and process (agentd.lab.bfd_proc): removal and re-adding, stopping, a
frozen process.  The BIRD interop is tests/system/test_bfd_bird.py."""

from __future__ import annotations

import time

import pytest

from proto.bfd import Diag

pytestmark = pytest.mark.timeout(120)

V4 = ("10.0.0.1", "10.0.0.2")
V6 = ("2001:db8:ff::1", "2001:db8:ff::2")


# Detect Mult 3 with 100 ms timers (Detection Time 0.3 s).  Commit 08261f7 had raised it to 5
# after a session went down by itself on a busy machine; BfdService now reads the packets
# waiting in its sockets before it declares a neighbour down (uvloop runs due timers first).
MULT = 3
# A frozen process must be noticed after the Detection Time the fast timers give (3 x 0.1 s),
# not the one of the slow rate a session uses while not Up (3 x 1 s, RFC 5880 §6.8.3): the bound
# lies halfway, slack for a loaded machine; the figure itself is printed.
FREEZE_BOUND = (MULT * 0.1 + MULT * 1.0) / 2


def test_two_services_remove_readd_freeze_and_stop(routers):
    r1, r2 = routers.pair(v6=True)
    a = routers.bfd(r1, "a", listen=None, peers=[V4[1], V6[1]], tx=0.1, rx=0.1, mult=MULT)
    b = routers.bfd(r2, "b", listen=None, peers=[V4[0], V6[0]], tx=0.1, rx=0.1, mult=MULT)
    for proc, peers in ((a, (V4[1], V6[1])), (b, (V4[0], V6[0]))):
        for peer in peers:
            proc.wait_state(peer, "Up", 20)
    assert {tuple(x) for x in a.status()["listen"]} == {("0.0.0.0", 3784), ("::", 3784)}

    # Remove and add again at once: b sees AdminDown (not a failure), then one new session
    # comes Up and stays Up (the draining old one is closed, so nothing flaps).
    old_discr = a.session(V4[1])["local_discriminator"]
    seen = len(b.events(V4[0]))
    a.remove(V4[1])
    a.add(V4[1])
    b.wait_until(lambda: [e for e in b.events(V4[0])[seen:] if e["state"] == "Up"], 10, what="b Up again")
    changes = b.events(V4[0])[seen:]
    assert changes[0]["old"] == "Up" and changes[0]["state"] == "Down" and changes[0]["diag"] == 3
    assert changes[0]["cause"] == "received AdminDown" and not any(e["failure"] for e in changes)
    new = a.wait_state(V4[1], "Up", 10)
    assert new["local_discriminator"] != old_discr
    assert b.session(V4[0])["remote_discriminator"] == new["local_discriminator"]
    settled = len(b.events(V4[0]))
    packets = b.session(V4[0])["packets_in"]
    b.wait_until(lambda: b.session(V4[0])["packets_in"] >= packets + 30, 10, what="30 more packets at b")
    assert len(b.events(V4[0])) == settled and b.session(V4[0])["state"] == "Up"

    # a frozen: b declares both sessions down with diag 1, after the fast Detection Time.
    seen = {p: len(b.events(p)) for p in (V4[0], V6[0])}
    t_freeze = time.monotonic()
    a.freeze()
    try:
        for peer in (V4[0], V6[0]):
            down = b.wait_until(lambda peer=peer: [e for e in b.events(peer)[seen[peer]:] if e["state"] == "Down"],
                                10, what=f"b's session to {peer} Down")[0]
            assert down["diag"] == Diag.CONTROL_DETECTION_TIME_EXPIRED and down["failure"]
            assert down["t"] - t_freeze < FREEZE_BOUND
            print(f"\n{peer}: down {down['t'] - t_freeze:.3f} s after SIGSTOP")
    finally:
        a.thaw()
    for peer in (V4[0], V6[0]):
        b.wait_state(peer, "Up", 20)

    # a stops (SIGTERM): AdminDown to every neighbour, which b does not take as a failure.  The
    # Down that counts is the one b's session rests in once a's AdminDown has arrived (a's last
    # word): a flap of a starved process before it would be an earlier Down.
    seen = {p: len(b.events(p)) for p in (V4[0], V6[0])}
    a.stop()

    def resting_down(peer):
        heard = (b.session(peer) or {}).get("remote_diag") == Diag.ADMINISTRATIVELY_DOWN
        changes = b.events(peer)[seen[peer]:]  # read after: the Down it caused is in it
        return heard and changes and changes[-1]["state"] == "Down" and changes[-1]

    for peer in (V4[0], V6[0]):
        down = b.wait_until(lambda peer=peer: resting_down(peer), 10,
                            what=lambda peer=peer: f"b's session to {peer} Down after a stopped: {b.events(peer)[seen[peer]:]}")
        assert down["cause"] == "received AdminDown" and not down["failure"], b.events(peer)[seen[peer]:]
