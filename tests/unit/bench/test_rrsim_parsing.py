"""The benchmarks' own BGP peers: the route-reflector client simulator's receive path
(bench/_rrscan.c and its Python reference) and the independent encoder (bench/_wire.py),
held against each other and against the project's codec (proto/)."""

from __future__ import annotations

import ctypes
import random
import sys
from ipaddress import IPv4Address
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import _feeder, _rrscan, _wire
from bench._rrscan import (
    C_ANNOUNCED,
    C_BYTES,
    C_EOR,
    C_FOREIGN,
    C_HELD,
    C_KEEPALIVES,
    C_OWN,
    C_UPDATES,
    C_WITHDRAWN,
    N_COUNTERS,
    scan_py,
)
from proto.attributes import (
    AS_SEQUENCE,
    ORIGIN_IGP,
    ORIGIN_INCOMPLETE,
    AsPath,
    AsPathSegment,
    Communities,
    MultiExitDisc,
    Origin,
    PathAttributes,
)
from proto.messages import MessageType, Open, Update, encode_updates

BASE = int(IPv4Address("10.192.0.0"))
NBITS = 20
OWN = 3


def pfx(i: int) -> bytes:
    return _wire.prefix(BASE + i * 64, 26)


def reflected(i: int) -> bytes:
    """A one-prefix UPDATE as a reflector sends it (ORIGINATOR_ID and CLUSTER_LIST added)."""
    nh = f"10.1.0.{i + 1}"
    attrs = _wire.path_attributes(next_hop=nh, local_pref=100)
    attrs += _wire.attribute(0x80, _wire.ATTR_ORIGINATOR_ID, IPv4Address(nh).packed)
    attrs += _wire.attribute(0x80, _wire.ATTR_CLUSTER_LIST, IPv4Address("10.1.0.1").packed)
    return _wire.update(attrs, pfx(i))


def mp_reach(prefixes: bytes, afi: int = 1) -> bytes:
    value = afi.to_bytes(2, "big") + b"\x01\x04" + IPv4Address("10.1.0.9").packed + b"\x00" + prefixes
    return _wire.attribute(0x80, _wire.ATTR_MP_REACH, value)


def mp_unreach(prefixes: bytes, afi: int = 1) -> bytes:
    return _wire.attribute(0x80, _wire.ATTR_MP_UNREACH, afi.to_bytes(2, "big") + b"\x01" + prefixes)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return _rrscan.build(str(tmp_path_factory.mktemp("rrscan")))


@pytest.fixture
def c_scanner(lib):
    return lambda: _rrscan.Scanner(NBITS, BASE, lib, recv_max=64 * 1024, max_fds=16)


def run_c(make, data: bytes, bitmap: bytearray, ctr: list[int]) -> int:
    """rr_scan on client OWN of a fresh Scanner, starting from ``bitmap`` and ``ctr``."""
    scanner = make()
    ctypes.memmove(scanner.bitmap_address(OWN), bytes(bitmap), len(bitmap))
    for k, v in enumerate(ctr):
        scanner.clients[OWN].ctr[k] = v
    ctypes.memmove(scanner.rbuf_address, data, len(data))
    consumed = scanner.scan(scanner.rbuf_address, len(data), OWN)
    bitmap[:] = scanner.bitmap(OWN)
    ctr[:] = list(scanner.clients[OWN].ctr)
    return consumed


def both(scanner, data: bytes) -> tuple[int, bytes, list[int]]:
    """Scan with C and with Python from the same start; they must agree; returns the result."""
    bm_c, bm_p = bytearray((NBITS + 7) // 8), bytearray((NBITS + 7) // 8)
    ctr_c, ctr_p = [0] * N_COUNTERS, [0] * N_COUNTERS
    got_c = run_c(scanner, data, bm_c, ctr_c)
    got_p = scan_py(data, bm_p, NBITS, BASE, OWN, ctr_p)
    assert (got_c, bytes(bm_c), ctr_c) == (got_p, bytes(bm_p), ctr_p)
    return got_p, bytes(bm_p), ctr_p


def test_announce_withdraw_own_foreign_eor_keepalive(c_scanner):
    msgs = [
        reflected(0), reflected(1), reflected(1),  # a duplicate is counted, held once
        reflected(OWN),  # its own prefix reflected back: counted as own, never held
        _wire.update(_wire.path_attributes(next_hop="10.1.0.9"), _wire.prefix("192.0.2.0", 24)),  # foreign
        _wire.keepalive(),
        _wire.update(withdrawn=pfx(0) + pfx(7)),  # 7 was never held
        _wire.update(mp_reach(pfx(9) + pfx(10)) + _wire.path_attributes(local_pref=100)),
        _wire.update(mp_unreach(pfx(10))),
        _wire.END_OF_RIB,
        _wire.update(mp_unreach(b"")),  # the MP form of IPv4 End-of-RIB
        _wire.update(mp_reach(pfx(11), afi=2)),  # another family: not ours to hold
    ]
    data = b"".join(msgs)
    consumed, bitmap, ctr = both(c_scanner, data)
    assert consumed == len(data)
    held = {i for i in range(NBITS) if bitmap[i >> 3] >> (i & 7) & 1}
    assert held == {1, 9}
    assert ctr[C_HELD] == 2
    assert ctr[C_UPDATES] == len(msgs) - 1
    assert ctr[C_KEEPALIVES] == 1
    assert ctr[C_ANNOUNCED] == 5  # 0, 1, 1, 9, 10
    assert ctr[C_WITHDRAWN] == 3  # 0, 7, 10
    assert ctr[C_OWN] == 1
    assert ctr[C_FOREIGN] == 1
    assert ctr[C_EOR] == 2
    assert ctr[C_BYTES] == len(data)


def test_stops_before_partial_other_types_and_malformed(c_scanner):
    head = reflected(0) + _wire.keepalive()
    open_msg = _wire.open_message(65000, 90, "10.1.0.1")
    assert both(c_scanner, head + open_msg + reflected(1))[0] == len(head)
    assert both(c_scanner, head + reflected(1)[:-3])[0] == len(head)
    assert both(c_scanner, head + _wire.notification(6, 2))[0] == len(head)
    bad_prefix = _wire.update(_wire.path_attributes(next_hop="10.1.0.9"), b"\x21\x0a\x00\x00\x00\x00")  # /33
    consumed, _bitmap, ctr = both(c_scanner, head + bad_prefix)
    assert consumed == len(head) and ctr[C_UPDATES] == 1  # the bad one counted nothing
    short_attr = bytearray(reflected(2))
    short_attr[22] += 1  # total path attribute length one past the message
    assert both(c_scanner, head + bytes(short_attr))[0] == len(head)
    long_keepalive = _wire.frame(_wire.KEEPALIVE, b"\x00")
    assert both(c_scanner, head + long_keepalive)[0] == len(head)
    bad_marker = b"\xfe" + reflected(3)[1:]
    assert both(c_scanner, bad_marker)[0] == 0


def test_c_and_python_agree_on_random_streams(c_scanner):
    rng = random.Random(11)
    makers = [
        lambda: reflected(rng.randrange(NBITS + 3)),
        lambda: _wire.update(withdrawn=b"".join(pfx(rng.randrange(NBITS)) for _ in range(rng.randint(1, 4)))),
        lambda: _wire.update(mp_reach(b"".join(pfx(rng.randrange(NBITS)) for _ in range(3)))),
        lambda: _wire.update(mp_unreach(pfx(rng.randrange(NBITS)))),
        lambda: _wire.update(_wire.path_attributes(next_hop="10.0.0.1"),
                             _wire.prefix(rng.getrandbits(32) & ~0xFF, rng.randint(0, 32))),
        _wire.keepalive,
        lambda: _wire.END_OF_RIB,
    ]
    for _ in range(300):
        data = b"".join(rng.choice(makers)() for _ in range(rng.randint(1, 30)))
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        if rng.random() < 0.2 and data:
            cut = bytearray(data)
            cut[rng.randrange(len(cut))] = rng.randrange(256)
            data = bytes(cut)
        both(c_scanner, data)


def test_wire_open_decodes_with_proto():
    msg = _wire.open_message(4200000001, 90, "10.1.2.3")
    assert msg[18] == MessageType.OPEN
    decoded = Open.decode(msg[19:])
    assert decoded.asn == 4200000001 and decoded.hold_time == 90 and str(decoded.router_id) == "10.1.2.3"
    assert _wire.parse_open(msg[19:]) == (4200000001, 90, "10.1.2.3")


def test_wire_updates_decode_with_proto():
    attrs = _wire.path_attributes(as_path=(65001, 4200000000), next_hop="10.0.0.1", med=7, communities=(1, 2))
    msgs = _wire.updates(attrs, [_wire.prefix(f"20.{i >> 8}.{i & 255}.0", 24) for i in range(2000)])
    assert len(msgs) > 1 and all(len(m) <= 4096 for m in msgs)
    seen = []
    for m in msgs:
        upd = Update.decode(m[19:])
        assert not upd.errors, upd.errors
        seen += upd.nlri
    assert len(seen) == 2000 and len(set(seen)) == 2000
    eor = Update.decode(_wire.END_OF_RIB[19:])
    assert eor.end_of_rib == (1, 1)
    wd = Update.decode(_wire.update(withdrawn=pfx(5))[19:])
    assert len(wd.withdrawn) == 1


def test_describe_notification():
    text = _wire.describe_notification(b"\x06\x02\x05hello")
    assert text == "Cease/Administrative Shutdown (6/2): hello"


def test_pump_serves_sockets_tracks_completion_and_hands_back_events(lib):
    """rr_pump over socketpairs (no network): counting, a message split across reads, the
    phase's completion time, and a NOTIFICATION and a closed connection handed to Python."""
    import select
    import socket
    import time

    scanner = _rrscan.Scanner(NBITS, BASE, lib, recv_max=64 * 1024, max_fds=4096)
    ep = select.epoll()
    pairs = [socket.socketpair() for _ in range(3)]
    st = scanner.state
    for i, (ours, _theirs) in enumerate(pairs):
        ours.setblocking(False)
        scanner.fd2idx[ours.fileno()] = i
        ep.register(ours.fileno(), select.EPOLLIN)
        scanner.clients[i].target = 2 if i == 0 else -1
    st.want_done, st.done_count = 1, 0
    try:
        first = reflected(5) + reflected(6)
        pairs[0][1].sendall(first[:30])  # a partial message is kept for the next read
        assert scanner.pump(ep.fileno(), 0.05) == 0
        assert scanner.clients[0].left == 30 and st.t_done == 0
        before = time.monotonic()
        pairs[0][1].sendall(first[30:])
        assert scanner.pump(ep.fileno(), 0.05) == 0
        assert scanner.clients[0].ctr[C_UPDATES] == 2 and scanner.clients[0].ctr[C_HELD] == 2
        assert scanner.clients[0].done == 1 and st.done_count == 1 and st.t_done >= before
        pairs[1][1].sendall(_wire.keepalive() + _wire.notification(6, 4) + _wire.keepalive())
        assert scanner.pump(ep.fileno(), 0.05) == 1
        assert (st.ev_client, st.ev_kind) == (1, _rrscan.EV_MESSAGE)
        assert scanner.clients[1].ctr[C_KEEPALIVES] == 1
        handed = ctypes.string_at(scanner.rbuf_address + st.ev_pos, st.ev_len - st.ev_pos)
        assert handed == _wire.notification(6, 4) + _wire.keepalive()
        ep.unregister(pairs[1][0].fileno())
        pairs[2][1].close()
        assert scanner.pump(ep.fileno(), 0.05) == 1
        assert (st.ev_client, st.ev_kind) == (2, _rrscan.EV_CLOSED)
    finally:
        ep.close()
        for a, b in pairs:
            a.close()
            b.close()


# --------------------------------------------------------------------------- the ingest feeder


def _packed_with_proto(n: int, seed: int, next_hop: str) -> list[bytes]:
    """The packed stream as bench/_feeder.py built it with proto/ before it had its own
    encoder: the same random draws, proto's attribute classes and encode_updates."""
    rng = random.Random(seed)
    prefixes = _feeder._random_prefixes(n, rng)
    sizes, left = [], n
    while left > 0:
        size = min(left, rng.randint(_feeder.GROUP_MIN, _feeder.GROUP_MAX))
        sizes.append(size)
        left -= size
    paths = _feeder._as_path_pool(_feeder.AS_PATH_POOL, rng)
    seen, sets = set(), []
    while len(sets) < len(sizes):
        path = rng.choice(paths)
        origin = ORIGIN_INCOMPLETE if rng.random() < 0.15 else ORIGIN_IGP
        med = rng.randint(0, 1000) if rng.random() < 0.30 else None
        comms: tuple[int, ...] = ()
        if rng.random() < 0.50:
            upstream = path[1] if path[1] <= 0xFFFF else _feeder.FEEDER_AS
            comms = tuple(sorted({(upstream << 16) | rng.randint(1, 999) for _ in range(rng.randint(1, 4))}))
        if (path, origin, med, comms) in seen:
            continue
        seen.add((path, origin, med, comms))
        attrs = [Origin(origin), AsPath((AsPathSegment(AS_SEQUENCE, path),))]
        if med is not None:
            attrs.append(MultiExitDisc(med))
        if comms:
            attrs.append(Communities(comms))
        sets.append(PathAttributes(tuple(attrs)))
    out, start = [], 0
    for attrs, size in zip(sets, sizes):
        out += encode_updates(1, attrs, IPv4Address(next_hop), prefixes[start : start + size])
        start += size
    return [*out, Update().encode()]


def test_packed_stream_is_the_same_bytes_as_with_proto():
    stream = _feeder.build_stream(20_000, regime="packed", next_hop="10.0.0.1", seed=3)
    assert b"".join(stream.chunks) == b"".join(_packed_with_proto(20_000, 3, "10.0.0.1"))


@pytest.mark.parametrize(("regime", "per_update"), [("one", 1), ("three", 3)])
def test_small_update_regimes_decode_with_proto_and_every_set_differs(regime, per_update):
    n = 3_001  # the last UPDATE of "three" carries what is left
    stream = _feeder.build_stream(n, regime=regime, next_hop="10.0.0.1", seed=5)
    data = b"".join(stream.chunks)
    splitter = _wire.Splitter()
    splitter.feed(data)
    msgs = splitter.messages()
    assert len(msgs) == stream.updates == -(-n // per_update) + 1  # + End-of-RIB
    prefixes, attr_blocks = [], set()
    for k, (msg_type, body) in enumerate(msgs[:-1]):
        upd = Update.decode(body)
        assert msg_type == MessageType.UPDATE and not upd.errors
        assert len(upd.nlri) == (per_update if k < len(msgs) - 2 else n - k * per_update)
        prefixes += upd.nlri
        attr_blocks.add(body[4 : 4 + int.from_bytes(body[2:4], "big")])
    assert Update.decode(msgs[-1][1]).end_of_rib == (1, 1)
    assert len(prefixes) == len(set(prefixes)) == n
    assert len(attr_blocks) == stream.attribute_sets == len(msgs) - 1
