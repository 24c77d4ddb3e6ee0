"""How the lab's Pinger counts losses: by sequence number, and only below the highest echo
answered (those after it may still be on their way when ping stops)."""

from agentd.lab.traffic import unanswered


def test_every_request_answered_is_no_loss():
    assert unanswered(10, set(range(1, 11))) == set()


def test_requests_after_the_last_answer_may_still_be_in_flight():
    # An interval shorter than the round trip: three requests out when ping stops.
    assert unanswered(10, set(range(1, 8))) == set()


def test_a_request_missing_before_a_later_answer_is_lost():
    assert unanswered(10, {1, 2, 5, 6, 9}) == {3, 4, 7, 8}


def test_nothing_answered_loses_every_request():
    assert unanswered(4, set()) == {1, 2, 3, 4}
    assert unanswered(0, set()) == set()
