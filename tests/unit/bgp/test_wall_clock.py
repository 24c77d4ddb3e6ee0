"""Peer times shown as UNIX times: stable between reads, following a stepped wall clock."""

from bgp.transport import WallClock


def test_the_same_reading_gives_the_same_time_while_the_clocks_drift_by_jitter():
    now = {"mono": 100.0, "wall": 1_000_100.0}
    wall = WallClock(lambda: now["mono"], lambda: now["wall"])
    first = wall(40.0)
    assert first == 1_000_040.0
    # time.time() and the monotonic clock are read a moment apart: their difference jitters.
    now["mono"], now["wall"] = 105.0, 1_000_105.0007
    assert wall(40.0) == first
    now["mono"], now["wall"] = 110.0, 1_000_109.9996
    assert wall(40.0) == first


def test_a_wall_clock_step_moves_the_offset():
    now = {"mono": 100.0, "wall": 1_000_100.0}
    wall = WallClock(lambda: now["mono"], lambda: now["wall"])
    assert wall(40.0) == 1_000_040.0
    now["wall"] += 3600.0  # NTP stepped the clock an hour forward
    assert wall(40.0) == 1_003_640.0
