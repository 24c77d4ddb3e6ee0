"""The FSM transition table (RFC 4271 §8) is data; check its shape."""

import pytest

from bgp.fsm import TRANSITIONS, Event, IllegalTransition, State, transition


def test_only_a_start_leaves_idle():
    leaving = {e for (s, e), t in TRANSITIONS.items() if s is State.IDLE and t is not State.IDLE}
    assert leaving == {Event.MANUAL_START, Event.MANUAL_START_PASSIVE}


def test_established_is_reached_only_by_keepalive_in_open_confirm():
    into = {(s, e) for (s, e), t in TRANSITIONS.items() if t is State.ESTABLISHED and s is not State.ESTABLISHED}
    assert into == {(State.OPEN_CONFIRM, Event.KEEPALIVE_MSG)}


def test_every_state_can_be_stopped_into_idle():
    for state in State:
        assert transition(state, Event.MANUAL_STOP) is State.IDLE


def test_errors_in_connected_states_end_in_idle():
    for state in (State.OPEN_SENT, State.OPEN_CONFIRM, State.ESTABLISHED):
        for event in (Event.HOLD_TIMER_EXPIRES, Event.NOTIF_MSG, Event.BGP_HEADER_ERR, Event.BGP_OPEN_MSG_ERR):
            assert transition(state, event) is State.IDLE


def test_open_sent_tcp_failure_goes_active_per_rfc():
    assert transition(State.OPEN_SENT, Event.TCP_CONNECTION_FAILS) is State.ACTIVE


def test_an_update_before_established_is_an_fsm_error():
    assert transition(State.OPEN_SENT, Event.UPDATE_MSG) is State.IDLE
    assert transition(State.OPEN_CONFIRM, Event.UPDATE_MSG) is State.IDLE


def test_impossible_pairs_raise():
    with pytest.raises(IllegalTransition, match="KEEPALIVE_MSG in state Connect"):
        transition(State.CONNECT, Event.KEEPALIVE_MSG)
    with pytest.raises(IllegalTransition):
        transition(State.ACTIVE, Event.UPDATE_MSG)


def test_table_targets_are_states():
    assert all(isinstance(s, State) and isinstance(e, Event) and isinstance(t, State) for (s, e), t in TRANSITIONS.items())
