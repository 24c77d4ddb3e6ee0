"""BFD sessions (RFC 5880 §6.8) against each other in memory, with a float clock.

No sockets, no sleeps: ``Link`` carries every packet through the codec to the other
session after a fixed delay and advances time to the next timer or delivery.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from bgp.bfd import (
    FAILURE_EVENTS,
    RECEIVED,
    SLOW_TX_US,
    TRANSITIONS,
    BfdEvent,
    BfdSession,
    BfdSettings,
    BfdStateChanged,
)
from proto.bfd import ControlPacket, Diag, State

FAST = BfdSettings(desired_min_tx=0.1, required_min_rx=0.1, detect_mult=3)
DELAY = 0.001


@dataclass
class Sent:
    at: float
    by: str
    packet: ControlPacket


@dataclass
class Link:
    """Two sessions ``a`` and ``b`` joined by a wire with a fixed one-way delay."""

    a: BfdSession
    b: BfdSession
    now: float = 0.0
    delay: float = DELAY
    frozen: set[str] = field(default_factory=set)  # like SIGSTOP: neither sends nor receives nor times out
    cut: set[str] = field(default_factory=set)  # packets sent by these are lost
    drop_finals: set[str] = field(default_factory=set)  # packets with F sent by these are lost
    in_flight: list[tuple[float, str, bytes]] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)
    events: list[tuple[float, str, BfdStateChanged]] = field(default_factory=list)

    def session(self, name: str) -> BfdSession:
        return self.a if name == "a" else self.b

    def collect(self) -> None:
        for name in ("a", "b"):
            s = self.session(name)
            for p in s.take_packets():
                self.sent.append(Sent(self.now, name, p))
                if name not in self.cut and not (p.final and name in self.drop_finals):
                    self.in_flight.append((self.now + self.delay, "b" if name == "a" else "a", p.encode()))
            while (e := s.next_event()) is not None:
                self.events.append((self.now, name, e))

    def run(self, duration: float) -> None:
        until = self.now + duration
        self.collect()
        while True:
            times = [t for t, _, _ in self.in_flight]
            times += [t for n in ("a", "b") if n not in self.frozen and (t := self.session(n).get_timer()) is not None]
            at = min(times, default=None)
            if at is None or at > until:
                self.now = until
                return
            self.now = max(self.now, at)
            due = [x for x in self.in_flight if x[0] <= self.now]
            self.in_flight = [x for x in self.in_flight if x[0] > self.now]
            for _, to, data in due:
                if to not in self.frozen:
                    self.session(to).receive(ControlPacket.decode(data), self.now)
            for n in ("a", "b"):
                s = self.session(n)
                if n not in self.frozen and (t := s.get_timer()) is not None and t <= self.now:
                    s.handle_timer(self.now)
            self.collect()

    def states(self) -> tuple[State, State]:
        return self.a.state, self.b.state

    def sent_by(self, name: str, since: float = 0.0, mark: int = 0) -> list[Sent]:
        """Packets ``name`` sent at or after ``since`` (and after ``mark`` = an earlier len(sent))."""
        return [s for s in self.sent[mark:] if s.by == name and s.at >= since]


def make_link(settings_a: BfdSettings = FAST, settings_b: BfdSettings = FAST, seed: int = 1) -> Link:
    rng = random.Random(seed)
    a = BfdSession(settings_a, local_discriminator=0x11111111, now=0.0, rng=rng)
    b = BfdSession(settings_b, local_discriminator=0x22222222, now=0.0, rng=rng)
    return Link(a, b)


def up_link(**kw) -> Link:
    link = make_link(**kw)
    link.run(2.0)
    assert link.states() == (State.UP, State.UP)
    assert not link.a.poll_active and not link.b.poll_active
    return link


# ---------------------------------------------------------------- the table


def test_transition_table_is_complete_and_cites_the_rfc_outcomes():
    assert set(TRANSITIONS) == {(s, e) for s in State for e in BfdEvent}
    assert set(RECEIVED) == set(State)
    # §6.8.6 three-way handshake and its teardown.
    assert TRANSITIONS[(State.DOWN, BfdEvent.RECV_DOWN)] == (State.INIT, Diag.NONE)
    assert TRANSITIONS[(State.DOWN, BfdEvent.RECV_INIT)] == (State.UP, Diag.NONE)
    assert TRANSITIONS[(State.DOWN, BfdEvent.RECV_UP)] == (State.DOWN, None)
    assert TRANSITIONS[(State.UP, BfdEvent.RECV_DOWN)] == (State.DOWN, Diag.NEIGHBOR_SIGNALED_SESSION_DOWN)
    assert TRANSITIONS[(State.UP, BfdEvent.DETECTION_TIME_EXPIRED)] == (State.DOWN, Diag.CONTROL_DETECTION_TIME_EXPIRED)
    # AdminDown discards everything but enabling.
    for event in BfdEvent:
        if event is not BfdEvent.ADMIN_ENABLE:
            assert TRANSITIONS[(State.ADMIN_DOWN, event)][0] is State.ADMIN_DOWN
    assert BfdEvent.RECV_ADMIN_DOWN not in FAILURE_EVENTS and BfdEvent.ADMIN_DISABLE not in FAILURE_EVENTS


# ---------------------------------------------------------------- coming up


def test_two_sessions_come_up_then_poll_down_to_the_fast_interval():
    link = make_link()
    link.run(0.05)
    assert link.states() == (State.UP, State.UP)
    # Down -> Init -> Up on both sides, in one round trip each, with nothing reported as a failure.
    for name in ("a", "b"):
        path = [(e.old, e.state) for _, n, e in link.events if n == name]
        assert path == [(State.DOWN, State.INIT), (State.INIT, State.UP)]
        assert not any(e.failure for _, _, e in link.events)
    up_event = [e for _, n, e in link.events if n == "a"][-1]
    assert up_event.up and up_event.diag == Diag.NONE
    # While not Up the session advertised 1 s (§6.8.3); Up advertises 100 ms behind a poll.
    first = link.sent_by("a")[0].packet
    assert first.state is State.DOWN and first.desired_min_tx == SLOW_TX_US and first.your_discriminator == 0
    assert first.required_min_rx == 100_000 and first.detect_mult == 3
    polls = [s.packet for s in link.sent_by("a") if s.packet.poll]
    assert polls and polls[0].state is State.UP and polls[0].desired_min_tx == 100_000
    finals = [s.packet for s in link.sent_by("b") if s.packet.final]
    assert finals and not any(p.poll for p in finals)
    link.run(1.0)
    for s in (link.a, link.b):
        assert not s.poll_active
        assert s.tx_interval == pytest.approx(0.1)
        assert s.detection_time == pytest.approx(0.3)
        assert s.remote_discr == (link.b if s is link.a else link.a).local_discr
    # Steady state: periodic packets, 75-100 % of 100 ms apart, no P or F.
    steady = link.sent_by("a", since=link.now - 0.8)
    gaps = [y.at - x.at for x, y in zip(steady, steady[1:], strict=False)]
    assert gaps and all(0.075 - 1e-9 <= g <= 0.1 + 1e-9 for g in gaps)
    assert not any(s.packet.poll or s.packet.final for s in steady)


def test_slow_transmission_while_the_neighbour_is_silent():
    link = make_link()
    link.cut.add("b")  # b's packets never arrive: a stays Down
    link.run(30.0)
    assert link.a.state is State.DOWN
    sent = link.sent_by("a")
    assert all(s.packet.desired_min_tx == SLOW_TX_US and not s.packet.poll for s in sent)
    gaps = [y.at - x.at for x, y in zip(sent, sent[1:], strict=False)]
    assert len(gaps) >= 29 and all(0.75 - 1e-9 <= g <= 1.0 + 1e-9 for g in gaps)
    assert link.a.detection_time is None and link.a.get_timer() == pytest.approx(sent[-1].at + gaps[-1], abs=1.0)


# ---------------------------------------------------------------- detection time


def test_detection_time_expiry_takes_the_session_down_with_diag_1_exactly_on_time():
    link = up_link()
    link.run(0.5)
    link.frozen.add("b")
    last_arrival = max(s.at for s in link.sent_by("b")) + DELAY
    detection = 3 * max(0.1, 0.1)
    assert link.a.get_timer() == pytest.approx(min(last_arrival + detection, link.a.get_timer()))
    expires = last_arrival + detection
    # An instant before the Detection Time the session is still Up ...
    link.run(expires - link.now - 1e-6)
    assert link.a.state is State.UP
    # ... and at it, Down with "Control Detection Time Expired".
    link.run(2e-6)
    assert link.a.state is State.DOWN and link.a.diag == Diag.CONTROL_DETECTION_TIME_EXPIRED
    at, _, event = [e for e in link.events if e[1] == "a"][-1]
    assert at == pytest.approx(expires, abs=1e-9)
    assert event.failure and not event.up and event.cause is BfdEvent.DETECTION_TIME_EXPIRED
    # §6.8.1 / §6.8.18: the remote's discriminator and RX interval are forgotten,
    # and the session falls back to 1 s transmission.
    assert link.a.remote_discr == 0 and link.a.remote_min_rx == 1
    down_pkt = link.sent_by("a", since=at)[0].packet
    assert down_pkt.state is State.DOWN and down_pkt.diag == Diag.CONTROL_DETECTION_TIME_EXPIRED
    assert down_pkt.your_discriminator == 0 and down_pkt.desired_min_tx == SLOW_TX_US


def test_detection_uses_the_remote_detect_mult_and_the_larger_interval():
    link = up_link(settings_a=BfdSettings(0.1, 0.2, 3), settings_b=BfdSettings(0.15, 0.1, 5))
    link.run(1.0)
    # a detects b: b's mult (5) x max(a's RequiredMinRx 0.2, b's DesiredMinTx 0.15) = 1.0 s.
    assert link.a.detection_time == pytest.approx(1.0)
    # b detects a: a's mult (3) x max(0.1, 0.1) = 0.3 s; b sends every max(0.15, 0.2) = 0.2 s.
    assert link.b.detection_time == pytest.approx(0.3)
    assert link.b.tx_interval == pytest.approx(0.2) and link.a.tx_interval == pytest.approx(0.1)


def test_frozen_neighbour_thaws_and_the_session_comes_back():
    link = up_link()
    link.frozen.add("b")
    link.run(0.5)
    assert link.a.state is State.DOWN
    link.frozen.clear()
    link.run(3.0)
    assert link.states() == (State.UP, State.UP)


def test_remote_discriminator_is_forgotten_after_a_detection_time_even_when_down():
    link = up_link()
    link.b.admin_down(link.now)
    link.run(0.01)
    assert link.a.state is State.DOWN and link.a.remote_discr == link.b.local_discr
    link.frozen.add("b")
    link.run(5.0)
    assert link.a.remote_discr == 0 and link.a.state is State.DOWN


# ---------------------------------------------------------------- neighbour signals down


def test_neighbour_down_is_a_failure_and_neighbour_admin_down_is_not():
    link = up_link()
    # b goes Down by detection (its link from a is cut): it tells a "Down" -> failure at a.
    link.cut.add("a")
    link.run(0.4)
    assert link.b.state is State.DOWN
    a_events = [e for _, n, e in link.events if n == "a"]
    assert a_events[-1].state is State.DOWN and a_events[-1].diag == Diag.NEIGHBOR_SIGNALED_SESSION_DOWN
    assert a_events[-1].failure and a_events[-1].cause is BfdEvent.RECV_DOWN
    link.cut.clear()
    link.run(3.0)
    assert link.states() == (State.UP, State.UP)
    # b is administratively disabled: a goes Down with diag 3, but not as a failure (RFC 5882 §3.2).
    link.b.admin_down(link.now)
    link.run(0.01)
    a_event = [e for _, n, e in link.events if n == "a"][-1]
    assert (a_event.old, a_event.state, a_event.diag) == (State.UP, State.DOWN, Diag.NEIGHBOR_SIGNALED_SESSION_DOWN)
    assert a_event.cause is BfdEvent.RECV_ADMIN_DOWN and not a_event.failure
    b_event = [e for _, n, e in link.events if n == "b"][-1]
    assert (b_event.state, b_event.diag, b_event.failure) == (State.ADMIN_DOWN, Diag.ADMINISTRATIVELY_DOWN, False)


# ---------------------------------------------------------------- administrative control


def test_admin_down_keeps_sending_for_a_detection_time_and_ignores_the_neighbour():
    link = up_link()
    t0, mark = link.now, len(link.sent)
    link.a.admin_down(t0)
    link.collect()
    first = link.sent_by("a", mark=mark)[0].packet
    assert first.state is State.ADMIN_DOWN and first.diag == Diag.ADMINISTRATIVELY_DOWN
    # §6.8.16: at least a Detection Time of AdminDown packets; now at the slow 1 s rate.
    assert link.a.admin_down_until == pytest.approx(t0 + 3 * 1.0)
    link.run(3.5)
    sent = link.sent_by("a", mark=mark)
    assert all(s.packet.state is State.ADMIN_DOWN for s in sent) and len(sent) >= 4
    assert sent[-1].at >= link.a.admin_down_until - 1.0
    # Received packets are discarded in AdminDown: no transition, no Final reply.
    assert link.b.state is State.DOWN
    poll = ControlPacket(State.DOWN, my_discriminator=link.b.local_discr, poll=True)
    link.a.receive(poll, link.now)
    assert link.a.state is State.ADMIN_DOWN and link.a.take_packets() == []
    # Enabling goes back to Down and the handshake brings it Up again.
    link.a.enable(link.now)
    link.run(3.0)
    assert link.states() == (State.UP, State.UP)
    assert link.a.admin_down_until is None


# ---------------------------------------------------------------- poll sequences


def test_poll_sequence_delays_a_tx_increase_until_the_final():
    link = up_link()
    link.drop_finals.add("b")  # hold back b's Final to look at the in-between state
    mark = len(link.sent)
    link.a.set_settings(BfdSettings(desired_min_tx=0.5, required_min_rx=0.1, detect_mult=3), link.now)
    link.run(0.35)
    polls = link.sent_by("a", mark=mark)
    assert polls and all(s.packet.poll and s.packet.desired_min_tx == 500_000 for s in polls)
    # §6.8.3: an increase of the TX interval waits for the Final: still 100 ms.
    assert link.a.tx_interval == pytest.approx(0.1)
    gaps = [y.at - x.at for x, y in zip(polls, polls[1:], strict=False)]
    assert gaps and max(gaps) <= 0.1 + 1e-9
    # b answered every Poll at once with Final (and no Poll bit).
    finals = [s for s in link.sent_by("b", mark=mark) if s.packet.final]
    assert len(finals) == len(polls) and not any(s.packet.poll for s in finals)
    # b already detects with the new value (its Detection Time for a grows at once).
    assert link.b.detection_time == pytest.approx(3 * 0.5)
    link.drop_finals.clear()
    link.run(0.3)
    assert not link.a.poll_active and link.a.tx_interval == pytest.approx(0.5)
    link.run(5.0)
    assert link.states() == (State.UP, State.UP)
    assert not any(s.packet.poll for s in link.sent_by("a", since=link.now - 2.0))


def test_poll_sequence_delays_an_rx_decrease_until_the_final():
    link = up_link(settings_a=BfdSettings(0.1, 0.3, 3))
    assert link.a.detection_time == pytest.approx(0.9)
    link.drop_finals.add("b")
    link.a.set_settings(BfdSettings(0.1, 0.1, 3), link.now)
    link.collect()
    last = link.sent[-1]
    assert last.by == "a" and last.packet.poll and last.packet.required_min_rx == 100_000
    # The shorter RX interval must not shorten a's Detection Time before b confirmed it.
    link.run(0.5)
    assert link.a.poll_active and link.a.detection_time == pytest.approx(0.9)
    link.drop_finals.clear()
    link.run(0.3)
    assert not link.a.poll_active and link.a.detection_time == pytest.approx(0.3)
    link.run(3.0)
    assert link.states() == (State.UP, State.UP)


def test_changes_during_a_poll_are_confirmed_by_a_second_poll():
    link = up_link()
    link.drop_finals.add("b")
    link.a.set_settings(BfdSettings(0.2, 0.1, 3), link.now)
    link.run(0.05)
    link.a.set_settings(BfdSettings(0.4, 0.1, 3), link.now)
    link.run(0.05)
    assert link.a.tx_interval == pytest.approx(0.1)  # neither increase confirmed yet
    link.drop_finals.clear()
    link.run(1.0)
    assert not link.a.poll_active
    assert link.a.tx_interval == pytest.approx(0.4) and link.b.detection_time == pytest.approx(1.2)
    assert link.states() == (State.UP, State.UP)


def test_a_poll_is_answered_at_once_with_final():
    s = BfdSession(FAST, local_discriminator=7, now=0.0, rng=random.Random(3))
    s.handle_timer(0.0)
    s.take_packets()
    s.receive(ControlPacket(State.DOWN, my_discriminator=9, poll=True), 0.1)
    out = s.take_packets()
    # The state change (Down -> Init) goes out, then the Final: both at 0.1, before any timer.
    assert [(p.state, p.final, p.poll) for p in out] == [(State.INIT, False, False), (State.INIT, True, False)]
    assert out[-1].your_discriminator == 9


# ---------------------------------------------------------------- transmit rules


@pytest.mark.parametrize(("mult", "low", "high"), [(3, 0.75, 1.0), (1, 0.75, 0.9)])
def test_jitter_bounds(mult, low, high):
    settings = BfdSettings(0.1, 0.1, mult)
    link = up_link(settings_a=settings, settings_b=settings, seed=mult)
    t0 = link.now
    link.run(200.0)
    sent = link.sent_by("a", since=t0)
    factors = [(y.at - x.at) / 0.1 for x, y in zip(sent, sent[1:], strict=False)]
    assert len(factors) > 1500
    assert min(factors) >= low - 1e-9 and max(factors) <= high + 1e-9
    # ... and the jitter does spread over the whole range.
    assert min(factors) < low + 0.01 and max(factors) > high - 0.01
    assert link.states() == (State.UP, State.UP)


def test_no_periodic_transmission_when_the_neighbour_asks_for_none():
    s = BfdSession(FAST, local_discriminator=7, now=0.0, rng=random.Random(3))
    s.handle_timer(0.0)
    s.receive(ControlPacket(State.INIT, my_discriminator=9, your_discriminator=7, required_min_rx=0), 0.01)
    assert s.state is State.UP
    s.take_packets()
    assert s.tx_interval is None  # §6.8.7: bfd.RemoteMinRxInterval zero
    # Only the detection timer remains.
    assert s.get_timer() == pytest.approx(0.01 + s.detection_time)


def test_remote_demand_mode_stops_periodic_transmission_when_both_are_up():
    s = BfdSession(FAST, local_discriminator=7, now=0.0, rng=random.Random(3))
    s.handle_timer(0.0)
    s.receive(ControlPacket(State.INIT, my_discriminator=9, your_discriminator=7, desired_min_tx=100_000,
                            required_min_rx=100_000), 0.01)
    s.receive(ControlPacket(State.UP, my_discriminator=9, your_discriminator=7, final=True, desired_min_tx=100_000,
                            required_min_rx=100_000), 0.02)
    assert s.state is State.UP and not s.poll_active and s.tx_interval == pytest.approx(0.1)
    s.receive(ControlPacket(State.UP, my_discriminator=9, your_discriminator=7, demand=True,
                            desired_min_tx=100_000, required_min_rx=100_000), 0.05)
    assert s.tx_interval is None
    s.take_packets()
    s.handle_timer(0.3)
    assert s.take_packets() == []


def test_packets_for_another_discriminator_are_discarded():
    s = BfdSession(FAST, local_discriminator=7, now=0.0)
    assert not s.receive(ControlPacket(State.DOWN, my_discriminator=9, your_discriminator=8), 0.0)
    assert s.discarded == 1 and s.packets_in == 0 and s.state is State.DOWN and s.remote_discr == 0


def test_settings_are_validated():
    for bad in (dict(desired_min_tx=0.001), dict(required_min_rx=0), dict(detect_mult=0), dict(detect_mult=256),
                dict(desired_min_tx="1"), dict(detect_mult=2.5), dict(required_min_rx=5000.0)):
        with pytest.raises(ValueError, match="bfd "):
            BfdSettings(**bad)
    assert BfdSettings(0.1, 0.1, 1).desired_min_tx_us == 100_000
    with pytest.raises(ValueError):
        BfdSession(FAST, local_discriminator=0, now=0.0)
