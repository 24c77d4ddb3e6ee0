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


def test_what_a_lost_echo_shows_is_ping_saying_something_other_than_a_reply():
    from agentd.lab.traffic import Pinger

    p = Pinger.__new__(Pinger)  # the output alone: no ping started
    p.lines = [
        "PING 10.244.2.3 (10.244.2.3) 56(84) bytes of data.\n",
        "[1733431200.101010] 64 bytes from 10.244.2.3: icmp_seq=1 ttl=62 time=0.101 ms\n",
        "[1733431200.151515] From 10.244.1.1 icmp_seq=2 Destination Net Unreachable\n",
        "[1733431200.201010] 64 bytes from 10.244.2.3: icmp_seq=3 ttl=62 time=0.099 ms\n",
        "\n",
        "--- 10.244.2.3 ping statistics ---\n",
        "3 packets transmitted, 2 received, +1 errors, 33.3333% packet loss, time 102ms\n",
        "rtt min/avg/max/mdev = 0.099/0.100/0.101/0.001 ms\n",
    ]
    assert p.trouble() == ["[1733431200.151515] From 10.244.1.1 icmp_seq=2 Destination Net Unreachable"]
    assert p.trouble(limit=0) == []
