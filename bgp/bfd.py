"""One BFD session, sans-IO: RFC 5880 asynchronous mode, single hop (RFC 5881).

A :class:`BfdSession` watches one neighbour.  It never opens a socket or reads a clock:
the caller feeds it

* ``receive(packet, now)`` for every Control packet demultiplexed to it (already decoded
  and checked by :meth:`proto.bfd.ControlPacket.decode`, with a TTL of 255),
* ``handle_timer(now)`` whenever ``get_timer()`` is due,
* ``admin_down(now)`` / ``enable(now)`` (§6.8.16) and ``set_settings(settings, now)``,

and collects ``take_packets()`` (Control packets to send to the neighbour) and
``next_event()`` (:class:`BfdStateChanged`).  Where the session ends up after each event
is decided by :data:`TRANSITIONS`, the state table of §6.8.6 (plus the timer and
administrative events of §6.8.4 and §6.8.16).

Timing, all of it from §6.8:

* transmit every ``max(bfd.DesiredMinTxInterval, bfd.RemoteMinRxInterval)`` less a random
  0-25 % (10-25 % when our Detect Mult is 1), §6.8.7;
* while the session is not Up, advertise a Desired Min TX of at least 1 s (§6.8.3);
* declare the neighbour down when nothing arrived for a Detection Time,
  ``remote Detect Mult x max(bfd.RequiredMinRxInterval, remote Desired Min TX)`` (§6.8.4);
* a change of either advertised interval starts a Poll Sequence (§6.5, §6.8.3); an
  increase of our TX interval, or a decrease of our RX interval, takes effect only once the
  neighbour answered with Final; a Poll from the neighbour is answered at once (§6.8.6).

Like BIRD and FRR, a session also sends one packet at once when its state changes or a
poll starts, instead of waiting up to a (slow, 1 s) interval: the three-way handshake
then takes milliseconds.

For the client (BGP): :attr:`BfdStateChanged.failure` is true only when an Up session
went Down because the neighbour stopped answering or said Down.  Administrative down on
either side (we disabled the session, or the neighbour sent AdminDown) is not a failure
(RFC 5882 §3.2), and neither is a session that never came Up.
"""

from __future__ import annotations

import collections
import enum
import random
from dataclasses import dataclass

from proto.bfd import ControlPacket, Diag, State

# §6.8.3: "When bfd.SessionState is not Up, the system MUST set bfd.DesiredMinTxInterval
# to a value of not less than one second (1,000,000 microseconds)."
SLOW_TX_US = 1_000_000
# Shortest interval we accept in settings: an asyncio process on a busy host cannot keep
# a tighter schedule without false detections.  (RFC 5880 has no minimum.)
MIN_INTERVAL = 0.05
MAX_INTERVAL = 0xFFFFFFFF / 1e6  # the 32-bit microsecond fields of §4.1


# ---------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class BfdSettings:
    """What we ask of one session (RFC 5880 §6.8.1), intervals in seconds.

    ``desired_min_tx`` is bfd.DesiredMinTxInterval once Up, ``required_min_rx`` is
    bfd.RequiredMinRxInterval, ``detect_mult`` is bfd.DetectMult.  The defaults detect a
    dead neighbour in 3 x 300 ms = 0.9 s.
    """

    desired_min_tx: float = 0.3
    required_min_rx: float = 0.3
    detect_mult: int = 3

    def __post_init__(self) -> None:
        for name in ("desired_min_tx", "required_min_rx"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                MIN_INTERVAL <= value <= MAX_INTERVAL
            ):
                raise ValueError(f"bfd {name} = {value!r}: must be between {MIN_INTERVAL} and {MAX_INTERVAL:.0f} seconds")
        if isinstance(self.detect_mult, bool) or not isinstance(self.detect_mult, int) or not 1 <= self.detect_mult <= 255:
            raise ValueError(f"bfd detect_mult = {self.detect_mult!r}: must be an integer from 1 to 255")

    @property
    def desired_min_tx_us(self) -> int:
        return round(self.desired_min_tx * 1e6)

    @property
    def required_min_rx_us(self) -> int:
        return round(self.required_min_rx * 1e6)


# ---------------------------------------------------------------- the state table


class BfdEvent(enum.Enum):
    """What can move a session: the State field of a received packet (§6.8.6), the
    detection timer (§6.8.4) and administrative control (§6.8.16)."""

    RECV_ADMIN_DOWN = "received AdminDown"
    RECV_DOWN = "received Down"
    RECV_INIT = "received Init"
    RECV_UP = "received Up"
    DETECTION_TIME_EXPIRED = "detection time expired"
    ADMIN_DISABLE = "administratively disabled"
    ADMIN_ENABLE = "administratively enabled"


RECEIVED: dict[State, BfdEvent] = {
    State.ADMIN_DOWN: BfdEvent.RECV_ADMIN_DOWN,
    State.DOWN: BfdEvent.RECV_DOWN,
    State.INIT: BfdEvent.RECV_INIT,
    State.UP: BfdEvent.RECV_UP,
}

AD, DOWN, INIT, UP = State.ADMIN_DOWN, State.DOWN, State.INIT, State.UP
ev = BfdEvent
_NEIGHBOR_DOWN = Diag.NEIGHBOR_SIGNALED_SESSION_DOWN
_EXPIRED = Diag.CONTROL_DETECTION_TIME_EXPIRED
_ADMIN = Diag.ADMINISTRATIVELY_DOWN

# (state, event) -> (next state, bfd.LocalDiag to set; None keeps the current one).
# Every pair is present: a session can receive any State in any state.
TRANSITIONS: dict[tuple[State, BfdEvent], tuple[State, Diag | None]] = {
    # -- AdminDown: §6.8.6 "If bfd.SessionState is AdminDown: Discard the packet";
    #    only enabling leaves it (§6.8.16 "Set bfd.SessionState to Down").
    (AD, ev.RECV_ADMIN_DOWN): (AD, None),
    (AD, ev.RECV_DOWN): (AD, None),
    (AD, ev.RECV_INIT): (AD, None),
    (AD, ev.RECV_UP): (AD, None),
    (AD, ev.DETECTION_TIME_EXPIRED): (AD, None),
    (AD, ev.ADMIN_DISABLE): (AD, None),
    (AD, ev.ADMIN_ENABLE): (DOWN, None),
    # -- Down: "If bfd.SessionState is Down: If received State is Down, set Init;
    #    else if received State is Init, set Up."  AdminDown "if not Down" does nothing here.
    (DOWN, ev.RECV_ADMIN_DOWN): (DOWN, None),
    (DOWN, ev.RECV_DOWN): (INIT, Diag.NONE),
    (DOWN, ev.RECV_INIT): (UP, Diag.NONE),
    (DOWN, ev.RECV_UP): (DOWN, None),
    (DOWN, ev.DETECTION_TIME_EXPIRED): (DOWN, None),  # §6.8.4 applies in Init and Up only
    (DOWN, ev.ADMIN_DISABLE): (AD, _ADMIN),
    (DOWN, ev.ADMIN_ENABLE): (DOWN, None),
    # -- Init: "If received State is Init or Up, set Up"; AdminDown -> Down, diag 3.
    (INIT, ev.RECV_ADMIN_DOWN): (DOWN, _NEIGHBOR_DOWN),
    (INIT, ev.RECV_DOWN): (INIT, None),
    (INIT, ev.RECV_INIT): (UP, Diag.NONE),
    (INIT, ev.RECV_UP): (UP, Diag.NONE),
    (INIT, ev.DETECTION_TIME_EXPIRED): (DOWN, _EXPIRED),
    (INIT, ev.ADMIN_DISABLE): (AD, _ADMIN),
    (INIT, ev.ADMIN_ENABLE): (INIT, None),
    # -- Up: "If received State is Down, set bfd.LocalDiag to 3, set Down"; AdminDown likewise.
    (UP, ev.RECV_ADMIN_DOWN): (DOWN, _NEIGHBOR_DOWN),
    (UP, ev.RECV_DOWN): (DOWN, _NEIGHBOR_DOWN),
    (UP, ev.RECV_INIT): (UP, None),
    (UP, ev.RECV_UP): (UP, None),
    (UP, ev.DETECTION_TIME_EXPIRED): (DOWN, _EXPIRED),
    (UP, ev.ADMIN_DISABLE): (AD, _ADMIN),
    (UP, ev.ADMIN_ENABLE): (UP, None),
}

# Leaving Up because of these is a connectivity failure for the client.  Not AdminDown
# from the neighbour (RFC 5882 §3.2: "the local system SHOULD NOT indicate a connectivity
# failure to any client") and not our own ADMIN_DISABLE.
FAILURE_EVENTS = frozenset({ev.DETECTION_TIME_EXPIRED, ev.RECV_DOWN})

del AD, DOWN, INIT, UP, ev


def transition(state: State, event: BfdEvent) -> tuple[State, Diag | None]:
    return TRANSITIONS[(state, event)]


# ---------------------------------------------------------------- events (for the client)


@dataclass(frozen=True, slots=True)
class BfdStateChanged:
    """The local session state changed (``old`` -> ``state``) because of ``cause``.

    ``diag`` is bfd.LocalDiag after the change (why it went down).  ``failure``: the
    neighbour was Up and is now unreachable or said Down; a client protocol tears its
    session down on this (RFC 5882 §3.2, §4.3; BGP: Cease subcode 10, RFC 9384).
    """

    old: State
    state: State
    diag: int
    cause: BfdEvent

    @property
    def up(self) -> bool:
        return self.state is State.UP

    @property
    def failure(self) -> bool:
        return self.old is State.UP and self.state is State.DOWN and self.cause in FAILURE_EVENTS


# ---------------------------------------------------------------- the session


class BfdSession:
    """One BFD session (RFC 5880 §6.8) in the Active role, asynchronous mode, no echo."""

    def __init__(
        self,
        settings: BfdSettings = BfdSettings(),
        *,
        local_discriminator: int,
        now: float,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < local_discriminator <= 0xFFFFFFFF:
            raise ValueError(f"local discriminator {local_discriminator}: must be a nonzero 32-bit value")
        self.settings = settings
        self.rng = rng if rng is not None else random.Random()
        # §6.8.1 state variables, initialised as it says.
        self.local_discr = local_discriminator
        self.state = State.DOWN
        self.diag: int = Diag.NONE
        self.since = now
        self.remote_discr = 0
        self.remote_state = State.DOWN
        self.remote_diag: int = Diag.NONE
        self.remote_min_rx = 1  # µs, bfd.RemoteMinRxInterval
        self.remote_desired_min_tx = 0  # µs, the last received Desired Min TX
        self.remote_detect_mult = 0  # the last received Detect Mult (0: nothing received)
        self.remote_demand = False
        # What we advertise (bfd.DesiredMinTxInterval / bfd.RequiredMinRxInterval) and what
        # our own timing uses; they differ while a poll holds back a change (§6.8.3).
        self.advertised_tx, self.advertised_rx = self._wanted()
        self._tx_in_force = self.advertised_tx
        self._rx_in_force = self.advertised_rx
        self.poll_active = False
        self._poll_values: tuple[int, int] | None = None
        self._last_rx: float | None = None
        self._tx_base = now  # the last periodic (or immediate) transmission
        self._tx_factor = 0.0  # first packet at once
        self.admin_down_until: float | None = None
        self._out: list[ControlPacket] = []
        self._events: collections.deque[BfdStateChanged] = collections.deque()
        # Counters for status and tests.
        self.packets_in = 0
        self.packets_out = 0
        self.discarded = 0  # valid packets that were not for this session
        self.state_changes = 0

    def __repr__(self) -> str:
        return f"<BfdSession {self.local_discr:#x} {self.state.label} remote={self.remote_discr:#x}>"

    # ------------------------------------------------------------ outputs

    def take_packets(self) -> list[ControlPacket]:
        out, self._out = self._out, []
        return out

    def next_event(self) -> BfdStateChanged | None:
        return self._events.popleft() if self._events else None

    def get_timer(self) -> float | None:
        times = [t for t in (self._next_tx(), self._detect_at()) if t is not None]
        return min(times) if times else None

    # ------------------------------------------------------------ derived timing (seconds)

    @property
    def tx_interval(self) -> float | None:
        """The negotiated transmit interval before jitter (§6.8.7), or None when periodic
        transmission must stop (bfd.RemoteMinRxInterval zero, or remote Demand mode)."""
        if not self._periodic_allowed():
            return None
        return max(self._tx_in_force, self.remote_min_rx) / 1e6

    @property
    def detection_time(self) -> float | None:
        """§6.8.4: remote Detect Mult x max(bfd.RequiredMinRxInterval, remote Desired Min TX);
        None until a packet has been received."""
        if not self.remote_detect_mult:
            return None
        return self.remote_detect_mult * max(self._rx_in_force, self.remote_desired_min_tx) / 1e6

    def _periodic_allowed(self) -> bool:
        # §6.8.7: "MUST NOT periodically transmit ... if bfd.RemoteMinRxInterval is zero."
        if self.remote_min_rx == 0:
            return False
        # §6.8.6: Demand mode active on the remote system -> cease periodic transmission
        # (a poll still goes out, §6.6).
        return not (
            self.remote_demand and self.state is State.UP and self.remote_state is State.UP and not self.poll_active
        )

    def _next_tx(self) -> float | None:
        interval = self.tx_interval
        if interval is None:
            return None
        return self._tx_base + interval * self._tx_factor

    @property
    def detect_at(self) -> float | None:
        """When the Detection Time runs out (§6.8.4) unless a packet comes first; None while
        no packet has been received."""
        return self._detect_at()

    def _detect_at(self) -> float | None:
        detection = self.detection_time
        if self._last_rx is None or detection is None:
            return None
        return self._last_rx + detection

    # ------------------------------------------------------------ inputs

    def receive(self, packet: ControlPacket, now: float) -> bool:
        """Process a received Control packet (§6.8.6, after the packet-only checks of
        :meth:`ControlPacket.decode`).  False when the packet was not for this session."""
        if packet.your_discriminator not in (0, self.local_discr):
            # "If the Your Discriminator field is nonzero, it MUST be used to select the
            # session ... If no session is found, the packet MUST be discarded."
            self.discarded += 1
            return False
        self.packets_in += 1
        self.remote_discr = packet.my_discriminator
        self.remote_state = packet.state
        self.remote_diag = packet.diag
        self.remote_demand = packet.demand
        self.remote_min_rx = packet.required_min_rx
        self.remote_desired_min_tx = packet.desired_min_tx
        self.remote_detect_mult = packet.detect_mult
        # "If the Final (F) bit is set, terminate any Poll Sequence in progress."
        if packet.final and self.poll_active:
            self._terminate_poll(now)
        if self.state is State.ADMIN_DOWN:
            return True  # "If bfd.SessionState is AdminDown: Discard the packet"
        self._last_rx = now  # "received for purposes of the Detection Time expiration rules"
        self._apply(RECEIVED[packet.state], now)
        if packet.poll:
            # "... MUST transmit a BFD Control packet with the Poll (P) bit clear and the Final
            # (F) bit set as soon as practicable, without respect to the transmission timer."
            self._emit(final=True)
        return True

    def handle_timer(self, now: float) -> None:
        detect_at = self._detect_at()
        if detect_at is not None and now >= detect_at:
            self._expire(now)
        next_tx = self._next_tx()
        if next_tx is not None and now >= next_tx:
            self._send_periodic(now)

    def admin_down(self, now: float) -> None:
        """§6.8.16: disable the session (diag 7, Administratively Down).  AdminDown packets
        keep going out; "BFD Control packets SHOULD be transmitted for at least a Detection
        Time after transitioning to AdminDown state": that time is :attr:`admin_down_until`."""
        if self.state is State.ADMIN_DOWN:
            return
        self._apply(BfdEvent.ADMIN_DISABLE, now)
        interval = self.tx_interval or SLOW_TX_US / 1e6
        self.admin_down_until = now + self.settings.detect_mult * interval

    def enable(self, now: float) -> None:
        """§6.8.16: "If enabling session, set bfd.SessionState to Down"."""
        self.admin_down_until = None
        self._apply(BfdEvent.ADMIN_ENABLE, now)

    def send_now(self, now: float) -> None:
        """One more packet at once, as the next periodic one would be (the transport repeats
        AdminDown this way when it stops, and cannot wait for the 1 s period)."""
        self._send_periodic(now)

    def set_settings(self, settings: BfdSettings, now: float) -> None:
        """New intervals or Detect Mult; interval changes go through a Poll Sequence."""
        self.settings = settings
        if self._update_advertised(now):
            self._emit()
            self._restart_period(now)

    # ------------------------------------------------------------ internals

    def _apply(self, event: BfdEvent, now: float) -> None:
        new, diag = transition(self.state, event)
        if new is self.state:
            return
        old = self.state
        self.state = new
        if diag is not None:
            self.diag = diag
        self.since = now
        self.state_changes += 1
        self._events.append(BfdStateChanged(old, new, self.diag, event))
        self._update_advertised(now)
        # Tell the neighbour at once (BIRD and FRR do the same), then resume the period.
        self._emit()
        self._restart_period(now)

    def _wanted(self) -> tuple[int, int]:
        tx = self.settings.desired_min_tx_us
        if self.state is not State.UP:
            tx = max(tx, SLOW_TX_US)  # §6.8.3
        return tx, self.settings.required_min_rx_us

    def _update_advertised(self, now: float) -> bool:
        """Advertise what the settings and state ask for; True when a poll started."""
        wanted = self._wanted()
        if wanted == (self.advertised_tx, self.advertised_rx):
            return False
        self.advertised_tx, self.advertised_rx = wanted
        self._adopt_allowed()
        if self.remote_discr == 0 or self.state is State.ADMIN_DOWN:
            # Nobody to confirm a poll (BIRD skips it too), or every reply would be
            # discarded in AdminDown (§6.8.6): the change simply takes effect.
            self._tx_in_force, self._rx_in_force = wanted
            return False
        if self.poll_active:
            return False  # _terminate_poll starts another one for the newer values
        # §6.8.3: "If either bfd.DesiredMinTxInterval is changed or
        # bfd.RequiredMinRxInterval is changed, a Poll Sequence MUST be initiated."
        self.poll_active = True
        self._poll_values = wanted
        return True

    def _adopt_allowed(self) -> None:
        """§6.8.3: take advertised values into use now, except a TX increase or an RX
        decrease while Up, which wait for the Final of the poll."""
        up = self.state is State.UP
        if not up or self.advertised_tx < self._tx_in_force:
            self._tx_in_force = self.advertised_tx
        if not up or self.advertised_rx > self._rx_in_force:
            self._rx_in_force = self.advertised_rx

    def _terminate_poll(self, now: float) -> None:
        assert self._poll_values is not None
        # The neighbour has seen (at least) the values this poll started with (§6.5).
        self._tx_in_force, self._rx_in_force = self._poll_values
        self._adopt_allowed()
        self.poll_active = False
        self._poll_values = None
        if (self.advertised_tx, self.advertised_rx) != (self._tx_in_force, self._rx_in_force):
            self.poll_active = True  # values changed during the poll: confirm the newer ones
            self._poll_values = (self.advertised_tx, self.advertised_rx)

    def _expire(self, now: float) -> None:
        # §6.8.1: bfd.RemoteDiscr "MUST be set to zero" after a Detection Time without
        # packets; §6.8.18: reset bfd.RemoteMinRxInterval to 1.  A poll cannot finish now.
        self._last_rx = None
        self.remote_discr = 0
        self.remote_state = State.DOWN
        self.remote_min_rx = 1
        self.remote_desired_min_tx = 0
        self.remote_detect_mult = 0
        self.remote_demand = False
        self.poll_active = False
        self._poll_values = None
        self._tx_in_force, self._rx_in_force = self.advertised_tx, self.advertised_rx
        # §6.8.4: in Init or Up -> Down, bfd.LocalDiag 1 (the table says so).
        self._apply(BfdEvent.DETECTION_TIME_EXPIRED, now)

    def _send_periodic(self, now: float) -> None:
        self._emit()
        self._restart_period(now)

    def _restart_period(self, now: float) -> None:
        # §6.8.7: each interval "MUST be reduced by a random value of 0 to 25%"; with
        # bfd.DetectMult 1 "no more than 90% ... and no less than 75%".
        self._tx_base = now
        high = 0.9 if self.settings.detect_mult == 1 else 1.0
        self._tx_factor = self.rng.uniform(0.75, high)

    def _emit(self, *, final: bool = False) -> None:
        # §6.8.7 "Transmitting BFD Control Packets": the fields, in the RFC's order.
        self._out.append(
            ControlPacket(
                state=self.state,
                diag=self.diag,
                poll=self.poll_active and not final,
                final=final,
                detect_mult=self.settings.detect_mult,
                my_discriminator=self.local_discr,
                your_discriminator=self.remote_discr,
                desired_min_tx=self.advertised_tx,
                required_min_rx=self.advertised_rx,
                required_min_echo_rx=0,  # we do not run the Echo function
            )
        )
        self.packets_out += 1

    def status(self) -> dict:
        """A JSON-ready view for /status and /metrics."""
        return {
            "state": self.state.label,
            "diag": int(self.diag),
            "since": self.since,
            "local_discriminator": self.local_discr,
            "remote_discriminator": self.remote_discr,
            "remote_state": self.remote_state.label,
            "remote_diag": int(self.remote_diag),
            "tx_interval": self.tx_interval,
            "detection_time": self.detection_time,
            "desired_min_tx": self.advertised_tx / 1e6,
            "required_min_rx": self.advertised_rx / 1e6,
            "detect_mult": self.settings.detect_mult,
            "remote_min_rx": self.remote_min_rx / 1e6,
            "remote_desired_min_tx": self.remote_desired_min_tx / 1e6,
            "remote_detect_mult": self.remote_detect_mult,
            "poll": self.poll_active,
            "packets_in": self.packets_in,
            "packets_out": self.packets_out,
            "state_changes": self.state_changes,
        }
