"""A peer is sent the new best path when a route it had no use for becomes the best (sans-IO).

The speaker (10.0.0.1, AS 65000) originates nothing.  ``a`` (10.0.0.2, AS 65001) is eBGP,
``b`` (10.0.0.3, AS 65000) iBGP.  While ``a``'s own path is the best, ``a`` is sent nothing
for the prefix (never its own route back).  When ``a``'s path stops being the best -- by a
worse announcement replacing it (an implicit withdraw, RFC 4271 §3.1) or by a withdrawal --
``b``'s path is the new best and ``a`` must be sent it, although ``a``'s group had nothing
for that family before.
"""

from __future__ import annotations

from ipaddress import IPv4Address

from bgp.settings import PeerSettings
from bgp.testing import RawHarness, RawPeer, make_speaker
from proto._aspath import AsPathSegment
from proto.attributes import AsPath, Origin, PathAttributes
from proto.messages import CodecContext, encode_updates, encode_withdrawals
from proto.nlri import prefix_from_str, prefix_to_str

CTX = CodecContext(four_octet_as=True)
PREFIX = "192.0.2.0/24"
P = prefix_from_str(PREFIX)[1]


def attrs(*asns: int) -> PathAttributes:
    return PathAttributes((Origin(0), AsPath((AsPathSegment(2, asns),) if asns else ())))


def setup() -> tuple[RawHarness, RawPeer, RawPeer]:
    sp = make_speaker(
        "10.0.0.1", 65000,
        [PeerSettings("10.0.0.2", 65001, passive=True), PeerSettings("10.0.0.3", 65000, passive=True)],
    )  # fmt: skip
    sp.start(0.0)
    h = RawHarness(sp, "10.0.0.1")
    a = RawPeer("10.0.0.2", 65001, conn=-1, families=((1, 1),))
    b = RawPeer("10.0.0.3", 65000, conn=-2, families=((1, 1),))
    assert h.connect(a)
    assert h.connect(b)
    return h, a, b


def send(h: RawHarness, peer: RawPeer, at: PathAttributes) -> None:
    for m in encode_updates(1, at, IPv4Address(peer.address), [P], CTX):
        h.send(peer, m)


def holds(peer: RawPeer) -> dict[str, tuple[int, ...]]:
    """What ``peer`` holds from the speaker, prefix -> AS path, replaying every UPDATE."""
    held: dict[str, tuple[int, ...]] = {}
    for u in peer.updates():
        for p in u.withdrawn:
            held.pop(prefix_to_str(1, p), None)
        for p in u.nlri:
            held[prefix_to_str(1, p)] = tuple(a for s in u.attributes.as_path.segments for a in s.asns)
    return held


def test_a_peer_whose_worse_reannouncement_makes_anothers_path_best_is_sent_that_path():
    h, a, b = setup()
    send(h, a, attrs(65001))  # eBGP, AS path of 1: the best
    send(h, b, attrs(65003, 65004))  # iBGP, AS path of 2
    assert h.speaker.rib.best((1, 1), P).source.key == "10.0.0.2"
    assert holds(a) == {}
    send(h, a, attrs(65001, 65005, 65006))  # implicit withdraw: now worse than b's
    assert h.speaker.rib.best((1, 1), P).source.key == "10.0.0.3"
    assert holds(a) == {PREFIX: (65000, 65003, 65004)}
    # a's path is the best again: a is sent the withdrawal of b's.
    send(h, a, attrs(65001))
    assert holds(a) == {}


def test_a_peer_whose_withdrawal_makes_anothers_path_best_is_sent_that_path():
    h, a, b = setup()
    send(h, a, attrs(65001))
    send(h, b, attrs(65003, 65004))
    for m in encode_withdrawals(1, [P], CTX):
        h.send(a, m)
    assert holds(a) == {PREFIX: (65000, 65003, 65004)}
