"""Update groups share one encoded stream among their members (sans-IO, float clock).

A route reflector (10.0.0.1, AS 65000, update_delay 0.5 s) has K clients driven by hand
(bgp.testing.RawPeer).  In one send window each client announces a prefix of its own: the
window's stretch of the group's log excludes nearly every member (nobody gets its own route
back, RFC 4456 §8), and yet every member must be handed views of the one shared object,
never a private copy of the stretch; what each client ends up holding must still be
exactly the others' routes.
"""

from __future__ import annotations

import random
from ipaddress import IPv4Address

from bgp import PeerSettings, Speaker, State
from bgp.session import Send
from bgp.settings import LocalSettings
from bgp.testing import RawHarness, RawPeer
from proto.attributes import AsPath, LocalPref, Origin, PathAttributes
from proto.messages import CodecContext, encode_updates, encode_withdrawals
from proto.nlri import IPV4_UNICAST, prefix_from_str, prefix_to_str

LOCAL = "10.0.0.1"
K = 6
WINDOW = 0.5


def client_addr(i: int) -> str:
    return f"10.0.1.{i + 1}"


def client_prefix(i: int) -> str:
    return f"10.192.{i}.0/26"


def announce(i: int, prefix: str, local_pref: int = 100) -> bytes:
    attrs = PathAttributes((Origin(0), AsPath(()), LocalPref(local_pref)))
    (msg,) = encode_updates(1, attrs, IPv4Address(client_addr(i)), [prefix_from_str(prefix)[1]], CodecContext())
    return msg


def reflector(k: int = K) -> tuple[Speaker, RawHarness, list[RawPeer]]:
    local = LocalSettings(
        asn=65000, router_id=IPv4Address(LOCAL), cluster_id=IPv4Address(LOCAL), update_delay=WINDOW,
        families=(IPV4_UNICAST,), graceful_restart=False,
    )  # fmt: skip
    sp = Speaker(local, now=0.0, rng=random.Random(1))
    for i in range(k):
        sp.add_peer(PeerSettings(IPv4Address(client_addr(i)), 65000, passive=True, rr_client=True), 0.0)
    sp.start(0.0)
    h = RawHarness(sp, LOCAL)
    clients = [RawPeer(client_addr(i), 65000, conn=-(i + 1), families=((1, 1),)) for i in range(k)]
    for c in clients:
        assert h.connect(c)
        assert sp.peers[c.address].state is State.ESTABLISHED
    h.advance(WINDOW * 2)  # End-of-RIB for the empty table
    return sp, h, clients


def holds(c: RawPeer) -> dict[str, IPv4Address]:
    """The prefixes ``c`` holds from the reflector and their next hops, replaying every UPDATE."""
    held: dict[str, IPv4Address] = {}
    for u in c.updates():
        for p in u.withdrawn:
            held.pop(prefix_to_str(1, p), None)
        for p in u.nlri:
            held[prefix_to_str(1, p)] = u.attributes.next_hop
    return held


def chunks_to(h: RawHarness, c: RawPeer, since: int) -> list[bytes | memoryview]:
    return [x for a in h.sent[since:] if isinstance(a, Send) and a.conn == c.conn for x in a.chunks]


def base(chunk: bytes | memoryview) -> bytes:
    """The object a chunk's bytes live in (a memoryview's underlying bytes)."""
    return chunk.obj if isinstance(chunk, memoryview) else chunk  # type: ignore[return-value]


def test_a_window_of_every_clients_own_route_is_one_shared_object_for_all_members():
    sp, h, clients = reflector()
    start = len(h.sent)
    for i, c in enumerate(clients):
        h.send(c, announce(i, client_prefix(i)))
    assert not any(chunks_to(h, c, start) for c in clients)  # held for the send window
    h.advance(WINDOW)
    # Every member is handed pieces of one and the same object: no member holds a private
    # copy of the window's stream (which would cost K times its size).
    objects = {id(base(x)): base(x) for c in clients for x in chunks_to(h, c, start) if len(x) > 19}
    assert len(objects) == 1, [len(o) for o in objects.values()]
    (shared,) = objects.values()
    for i, c in enumerate(clients):
        pieces = chunks_to(h, c, start)
        assert all(base(x) is shared for x in pieces if len(x) > 19)
        # All of it but this client's own route, which lies inside the stretch for all but the ends.
        assert sum(map(len, pieces)) < len(shared)
        assert holds(c) == {client_prefix(j): IPv4Address(client_addr(j)) for j in range(K) if j != i}
        assert sp.adj_out_count(c.address) == K - 1


def test_a_member_the_window_excludes_gets_the_withdrawal_of_what_it_had_in_its_place():
    sp, h, clients = reflector()
    shared = "10.200.0.0/24"
    h.send(clients[1], announce(1, shared))
    h.advance(WINDOW)
    assert holds(clients[0])[shared] == IPv4Address(client_addr(1))
    # One window: client 2's own prefix, client 0 takes over `shared` (higher LOCAL_PREF),
    # client 3's own prefix.  Client 0 must lose client 1's route (it is not sent its own),
    # in the middle of the stream the others share.
    start = len(h.sent)
    h.send(clients[2], announce(2, client_prefix(2)))
    h.send(clients[0], announce(0, shared, local_pref=200))
    h.send(clients[3], announce(3, client_prefix(3)))
    h.advance(WINDOW)
    assert shared not in holds(clients[0])
    assert holds(clients[0]) == {client_prefix(2): IPv4Address(client_addr(2)), client_prefix(3): IPv4Address(client_addr(3))}
    for i in (1, 4, 5):
        assert holds(clients[i])[shared] == IPv4Address(client_addr(0))
    pieces = chunks_to(h, clients[0], start)
    owners = {id(base(x)) for c in clients[1:] for x in chunks_to(h, c, start) if len(x) > 19}
    assert len(owners) == 1 and any(id(base(x)) in owners for x in pieces)
    for c in clients:
        assert sp.adj_out_count(c.address) == len(holds(c))


def test_a_member_that_cannot_take_bytes_is_handed_nothing_and_later_the_same_shared_stream():
    sp, h, clients = reflector()
    slow = clients[0]
    h.set_writable(slow, False)
    start = len(h.sent)
    for i, c in enumerate(clients[1:], 1):
        h.send(c, announce(i, client_prefix(i)))
    h.advance(WINDOW)
    assert chunks_to(h, slow, start) == []  # nothing queued for it: it holds no bytes at all
    h.set_writable(slow, True)
    # It reads from the same log position as the others did: the same object, not a copy.
    objects = {id(base(x)) for c in clients for x in chunks_to(h, c, start) if len(x) > 19}
    assert len(objects) == 1
    assert holds(slow) == {client_prefix(j): IPv4Address(client_addr(j)) for j in range(1, K)}


def withdraw(prefix: str) -> bytes:
    (msg,) = encode_withdrawals(1, [prefix_from_str(prefix)[1]], CodecContext())
    return msg


def test_routes_held_back_while_a_group_had_one_member_reach_the_second_one_to_join():
    # While client 0 is the group's only member its own routes are not exported (nobody in
    # the group could take them; no record per prefix is kept): the second member to join
    # gets what the Loc-RIB holds then -- not what client 0 withdrew meanwhile.
    local = LocalSettings(
        asn=65000, router_id=IPv4Address(LOCAL), cluster_id=IPv4Address(LOCAL), update_delay=WINDOW,
        families=(IPV4_UNICAST,), graceful_restart=False,
    )  # fmt: skip
    sp = Speaker(local, now=0.0, rng=random.Random(1))
    for i in range(2):
        sp.add_peer(PeerSettings(IPv4Address(client_addr(i)), 65000, passive=True, rr_client=True), 0.0)
    sp.start(0.0)
    h = RawHarness(sp, LOCAL)
    first, second = (RawPeer(client_addr(i), 65000, conn=-(i + 1), families=((1, 1),)) for i in range(2))
    assert h.connect(first)
    kept, gone = [f"10.192.{n}.0/26" for n in range(50)], "10.193.0.0/24"
    for prefix in [*kept, gone]:
        h.send(first, announce(0, prefix))
    h.advance(WINDOW * 2)
    h.send(first, withdraw(gone))
    h.advance(WINDOW * 2)
    assert sp.rib.count() == len(kept)
    assert sp.adj_out_count(first.address) == 0
    assert h.connect(second)
    h.advance(WINDOW * 2)
    assert holds(second) == {p: IPv4Address(client_addr(0)) for p in kept}
    assert sp.adj_out_count(second.address) == len(kept)
    assert holds(first) == {}
