"""The BGP finite state machine of RFC 4271 §8, as data.

Every legal ``(state, event) -> state`` pair is listed once in :data:`TRANSITIONS`.
The session (bgp.session) decides *what to do* on an event (send a NOTIFICATION,
start a timer); this table decides *where it ends up*, and refuses anything the
RFC does not allow.  Tests and docs read the same table.

Event names and numbers follow RFC 4271 §8.1; ``ROUTE_REFRESH_MSG`` is our own
addition for RFC 2918 messages, which RFC 4271 predates.
"""

from __future__ import annotations

import enum


class State(enum.IntEnum):
    # Ordered by progress, so "the most advanced state of a peer's connections"
    # is simply max().
    IDLE = 1
    CONNECT = 2
    ACTIVE = 3
    OPEN_SENT = 4
    OPEN_CONFIRM = 5
    ESTABLISHED = 6

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {
    State.IDLE: "Idle",
    State.CONNECT: "Connect",
    State.ACTIVE: "Active",
    State.OPEN_SENT: "OpenSent",
    State.OPEN_CONFIRM: "OpenConfirm",
    State.ESTABLISHED: "Established",
}


class Event(enum.IntEnum):
    """RFC 4271 §8.1 events (the subset this implementation raises)."""

    MANUAL_START = 1
    MANUAL_STOP = 2
    MANUAL_START_PASSIVE = 4  # "ManualStart_with_PassiveTcpEstablishment"
    AUTOMATIC_STOP = 8  # we end the session ourselves: max-prefix, send timeout, BFD, an internal error
    CONNECT_RETRY_TIMER_EXPIRES = 9
    HOLD_TIMER_EXPIRES = 10
    KEEPALIVE_TIMER_EXPIRES = 11
    TCP_CONNECTION_CONFIRMED = 17  # inbound connection accepted
    TCP_CR_ACKED = 16  # our outbound connection completed
    TCP_CONNECTION_FAILS = 18
    BGP_OPEN = 19
    BGP_HEADER_ERR = 21
    BGP_OPEN_MSG_ERR = 22
    OPEN_COLLISION_DUMP = 23
    NOTIF_MSG_VER_ERR = 24
    NOTIF_MSG = 25
    KEEPALIVE_MSG = 26
    UPDATE_MSG = 27
    UPDATE_MSG_ERR = 28
    ROUTE_REFRESH_MSG = 100  # RFC 2918; not an RFC 4271 event


class IllegalTransition(RuntimeError):
    def __init__(self, state: State, event: Event) -> None:
        super().__init__(f"no transition for event {event.name} in state {state.label}")
        self.state = state
        self.event = event


I, C, A, OS, OC, E = (
    State.IDLE,
    State.CONNECT,
    State.ACTIVE,
    State.OPEN_SENT,
    State.OPEN_CONFIRM,
    State.ESTABLISHED,
)
ev = Event

# Events that, in a state not expecting them, are an FSM error: the RFC sends
# NOTIFICATION (5, state-specific subcode, RFC 6608) where a connection exists and
# goes to Idle.
_UNEXPECTED_IN_OPEN_SENT = (
    ev.CONNECT_RETRY_TIMER_EXPIRES,
    ev.KEEPALIVE_TIMER_EXPIRES,
    ev.KEEPALIVE_MSG,
    ev.UPDATE_MSG,
    ev.UPDATE_MSG_ERR,
    ev.ROUTE_REFRESH_MSG,
)
_UNEXPECTED_IN_OPEN_CONFIRM = (
    ev.CONNECT_RETRY_TIMER_EXPIRES,
    ev.UPDATE_MSG,
    ev.UPDATE_MSG_ERR,
    ev.ROUTE_REFRESH_MSG,
    ev.BGP_OPEN,  # a second OPEN on the same connection (the collision case is handled by the peer)
)
_MESSAGE_EVENTS = (
    ev.BGP_OPEN,
    ev.BGP_HEADER_ERR,
    ev.BGP_OPEN_MSG_ERR,
    ev.NOTIF_MSG_VER_ERR,
    ev.NOTIF_MSG,
    ev.KEEPALIVE_MSG,
    ev.UPDATE_MSG,
    ev.UPDATE_MSG_ERR,
    ev.ROUTE_REFRESH_MSG,
)

TRANSITIONS: dict[tuple[State, Event], State] = {
    # -- Idle (§8.2.2): only a start leaves Idle; stops and stray events are ignored.
    (I, ev.MANUAL_START): C,
    (I, ev.MANUAL_START_PASSIVE): A,
    (I, ev.MANUAL_STOP): I,
    (I, ev.AUTOMATIC_STOP): I,
    (I, ev.TCP_CONNECTION_FAILS): I,
    # -- Connect: waiting for our outbound TCP connection.
    (C, ev.MANUAL_STOP): I,
    (C, ev.AUTOMATIC_STOP): I,
    (C, ev.CONNECT_RETRY_TIMER_EXPIRES): C,  # drop the attempt, try again
    (C, ev.TCP_CR_ACKED): OS,
    (C, ev.TCP_CONNECTION_CONFIRMED): OS,  # an inbound connection arrived first
    (C, ev.TCP_CONNECTION_FAILS): I,
    # -- Active: listening for the peer (passive peers live here).
    (A, ev.MANUAL_STOP): I,
    (A, ev.AUTOMATIC_STOP): I,
    (A, ev.CONNECT_RETRY_TIMER_EXPIRES): C,
    (A, ev.TCP_CR_ACKED): OS,
    (A, ev.TCP_CONNECTION_CONFIRMED): OS,
    (A, ev.TCP_CONNECTION_FAILS): I,
    # -- OpenSent: our OPEN is out, waiting for theirs.
    (OS, ev.MANUAL_STOP): I,
    (OS, ev.AUTOMATIC_STOP): I,
    (OS, ev.HOLD_TIMER_EXPIRES): I,
    (OS, ev.TCP_CONNECTION_FAILS): A,  # §8.2.2: close, restart ConnectRetry, listen
    (OS, ev.BGP_OPEN): OC,
    (OS, ev.BGP_HEADER_ERR): I,
    (OS, ev.BGP_OPEN_MSG_ERR): I,
    (OS, ev.OPEN_COLLISION_DUMP): I,
    (OS, ev.NOTIF_MSG_VER_ERR): I,
    (OS, ev.NOTIF_MSG): I,
    **{(OS, e): I for e in _UNEXPECTED_IN_OPEN_SENT},
    # -- OpenConfirm: OPENs exchanged, waiting for the first KEEPALIVE.
    (OC, ev.MANUAL_STOP): I,
    (OC, ev.AUTOMATIC_STOP): I,
    (OC, ev.HOLD_TIMER_EXPIRES): I,
    (OC, ev.KEEPALIVE_TIMER_EXPIRES): OC,
    (OC, ev.TCP_CONNECTION_FAILS): I,
    (OC, ev.NOTIF_MSG_VER_ERR): I,
    (OC, ev.NOTIF_MSG): I,
    (OC, ev.OPEN_COLLISION_DUMP): I,
    (OC, ev.BGP_HEADER_ERR): I,
    (OC, ev.BGP_OPEN_MSG_ERR): I,
    (OC, ev.KEEPALIVE_MSG): E,
    **{(OC, e): I for e in _UNEXPECTED_IN_OPEN_CONFIRM},
    # -- Established.
    (E, ev.MANUAL_STOP): I,
    (E, ev.AUTOMATIC_STOP): I,
    (E, ev.HOLD_TIMER_EXPIRES): I,
    (E, ev.KEEPALIVE_TIMER_EXPIRES): E,
    (E, ev.TCP_CONNECTION_FAILS): I,
    (E, ev.KEEPALIVE_MSG): E,
    (E, ev.UPDATE_MSG): E,
    (E, ev.ROUTE_REFRESH_MSG): E,
    (E, ev.UPDATE_MSG_ERR): I,
    (E, ev.NOTIF_MSG_VER_ERR): I,
    (E, ev.NOTIF_MSG): I,
    (E, ev.OPEN_COLLISION_DUMP): I,
    (E, ev.BGP_OPEN): I,  # FSM error
    (E, ev.BGP_HEADER_ERR): I,
    (E, ev.BGP_OPEN_MSG_ERR): I,
    (E, ev.CONNECT_RETRY_TIMER_EXPIRES): I,  # FSM error
}

# In Connect and Active no BGP connection exists yet, so message events cannot
# occur; timers that are not running cannot fire.  Those pairs are deliberately
# absent: if the session ever raises one, that is a bug and transition() says so.

del I, C, A, OS, OC, E, ev


def transition(state: State, event: Event) -> State:
    """The state after ``event`` in ``state``; raises :class:`IllegalTransition`."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(state, event) from None


def fsm_error_subcode(state: State) -> int:
    """RFC 6608 subcode for an unexpected event in ``state`` (NOTIFICATION code 5)."""
    return {State.OPEN_SENT: 1, State.OPEN_CONFIRM: 2, State.ESTABLISHED: 3}.get(state, 0)
