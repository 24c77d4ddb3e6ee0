"""The log limiter's count of held-back lines reaches the log when the interval ends, also
when no further line of that kind comes to carry it (time passed in, no sleeps)."""

from __future__ import annotations

import logging
import random
from ipaddress import IPv4Address

from bgp import PeerSettings, Speaker
from bgp.loglimit import LogLimiter
from bgp.settings import LocalSettings

log = logging.getLogger("bgp.test_loglimit")


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == log.name]


def test_a_burst_that_ends_has_its_count_logged_when_the_interval_ends(caplog):
    limiter = LogLimiter(log, interval=60.0, pinned=lambda s: s == "10.0.0.2")
    caplog.set_level(logging.INFO, logger=log.name)
    for i in range(5):
        limiter.log(logging.WARNING, "bad-attr", "10.0.0.2", 1.0 + i, "peer %s: bad attribute %d", "10.0.0.2", i)
    assert lines(caplog) == ["peer 10.0.0.2: bad attribute 0"]
    assert limiter.next_flush() == 61.0
    assert limiter.flush(60.0) == 0  # the interval has not ended
    assert limiter.flush(61.0) == 1
    assert lines(caplog)[1:] == ["4 similar suppressed in the last 60s, the last: peer 10.0.0.2: bad attribute 4"]
    assert caplog.records[-1].levelno == logging.WARNING
    assert limiter.next_flush() is None and limiter.flush(200.0) == 0  # said once
    # The next interval started with the count: one line per interval still.
    assert not limiter.log(logging.WARNING, "bad-attr", "10.0.0.2", 100.0, "peer %s: bad attribute %d", "10.0.0.2", 5)
    assert limiter.log(logging.WARNING, "bad-attr", "10.0.0.2", 121.0, "peer %s: bad attribute %d", "10.0.0.2", 6)
    assert lines(caplog)[-1] == "peer 10.0.0.2: bad attribute 6 (1 similar suppressed in the last 60s)"


def test_the_speaker_asks_for_a_timer_to_log_a_held_back_count(caplog):
    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1")), now=0.0, rng=random.Random(1))
    sp.add_peer(PeerSettings("10.0.0.2", 65000, passive=True), 0.0)
    sp.start(0.0)
    caplog.set_level(logging.INFO, logger="bgp")
    assert sp.get_timer() is None  # a passive peer, nothing held back
    for i in range(3):  # what the speaker's parts log through its limiter: one line, two held back
        sp.limiter.log(logging.WARNING, "session-failed", "10.0.0.2", 1.0 + i, "peer %s: failed %d", "10.0.0.2", i)
    assert sp.get_timer() == 61.0
    sp.handle_timer(61.0)
    assert caplog.records[-1].getMessage() == "2 similar suppressed in the last 60s, the last: peer 10.0.0.2: failed 2"
    assert sp.get_timer() is None
