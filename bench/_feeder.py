"""The feeding peer of bench/bgp_ingest.py: pre-encoded UPDATE streams and a blocking BGP sender.

:func:`build_stream` generates, before any connection exists, the complete byte stream
of UPDATEs announcing ``n`` distinct IPv4 prefixes, so that the feeder's own Python cost
is not part of what the benchmark measures.  :class:`Feeder` opens a session on a
connected socket (OPEN / KEEPALIVE exchange, RFC 4271 §8.2.2), then pushes the stream
with ``sendall`` of large message-aligned chunks as fast as TCP lets it, keeps the
session up with KEEPALIVEs, and reads and discards whatever the device under test sends
so it never blocks on its send buffer.  Messages are encoded by bench/_wire.py, on
purpose independent of the project's codec (tests/unit/bench/ holds the two to the same
bytes).

Prefixes (every regime): ~90 % distinct /24s, ~10 % /20-/23, drawn at random from
1.0.0.0-223.255.255.255 (first octets 0, 10 and 127 left out), sent in address order, as
a table dump would be; one End-of-RIB marker (RFC 4724 §2) after the last prefix.

Attribute sets: ORIGIN (IGP 85 %, INCOMPLETE 15 %), an AS_PATH of length 2-6 starting with
the feeder's AS, drawn from a pool of 4,000 distinct paths (2- and 4-octet ASNs), NEXT_HOP
= the feeder, 1-4 COMMUNITIES on 50 % of the sets, and by regime:

* ``packed`` (the best case, a table transfer): consecutive runs of 100-500 prefixes
  (uniform, mean 300) share one attribute set, MED on 30 % of the sets; one distinct set
  per ~300 prefixes (3,337 at 1M);
* ``one`` (a pod network: every node's route its own): one prefix per UPDATE, and every
  UPDATE a distinct attribute set -- its MED is its sequence number;
* ``three``: three prefixes per UPDATE, every UPDATE a distinct set (MED as in ``one``).
"""

from __future__ import annotations

import random
import socket
import threading
import time
from dataclasses import dataclass

from bench import _wire

FEEDER_AS = 65001
CHUNK_SIZE = 256 * 1024
GROUP_MIN, GROUP_MAX = 100, 500  # packed: prefixes per attribute set, uniform, mean 300
REGIMES = {"one": 1, "three": 3, "packed": None}  # prefixes per UPDATE (None: as many as fit)
AS_PATH_POOL = 4000
SHORT_LENGTHS = (20, 21, 22, 23)
SHORT_WEIGHTS = (0.15, 0.20, 0.35, 0.30)
SHORT_SHARE = 0.10
_EXCLUDED_FIRST_OCTETS = (0, 10, 127)  # unroutable, the lab's own 10/8, loopback


@dataclass(frozen=True)
class FeedStream:
    """The complete UPDATE stream for one run, cut into message-aligned chunks."""

    regime: str
    prefixes: int
    updates: int  # UPDATE messages, End-of-RIB included
    attribute_sets: int
    chunks: tuple[bytes, ...]

    @property
    def size(self) -> int:
        return sum(len(c) for c in self.chunks)

    def describe(self) -> str:
        return (
            f"{self.regime}: {self.prefixes:,} prefixes in {self.updates:,} UPDATEs ({self.size / 1e6:.1f} MB), "
            f"{self.attribute_sets:,} attribute sets (1 per {self.prefixes / max(1, self.attribute_sets):.0f} prefixes)"
        )


# --------------------------------------------------------------------------- the stream


def _random_prefixes(n: int, rng: random.Random) -> list[bytes]:
    """``n`` distinct wire-form IPv4 prefixes (/24 and /20-/23), sorted by address then length."""
    n_short = int(n * SHORT_SHARE)
    counts = {24: n - n_short}
    picks = rng.choices(SHORT_LENGTHS, SHORT_WEIGHTS, k=n_short)
    for plen in SHORT_LENGTHS:
        counts[plen] = picks.count(plen)
    keyed: list[tuple[int, int, bytes]] = []
    for plen, count in counts.items():
        if not count:
            continue
        shift = 32 - plen
        lo, hi = 1 << (plen - 8), 224 << (plen - 8)  # 1.0.0.0 .. 223.255.255.255
        per_octet = 1 << (plen - 8)
        # Map a dense index over the allowed first octets onto network numbers.
        allowed = [o for o in range(lo >> (plen - 8), hi >> (plen - 8)) if o not in _EXCLUDED_FIRST_OCTETS]
        space = len(allowed) * per_octet
        if count > space:
            raise ValueError(f"cannot draw {count} distinct /{plen}s from {space}")
        octets = (plen + 7) >> 3
        head = bytes((plen,))
        for idx in rng.sample(range(space), count):
            net = (allowed[idx // per_octet] << (plen - 8)) | (idx % per_octet)
            address = net << shift
            keyed.append((address, plen, head + address.to_bytes(4, "big")[:octets]))
    keyed.sort()
    return [p for _, _, p in keyed]


def _asn(rng: random.Random) -> int:
    # Public ASNs: mostly 2-octet (skipping AS_TRANS), some 4-octet (RFC 6793).
    if rng.random() < 0.8:
        while (asn := rng.randint(1, 64495)) == 23456:
            pass
        return asn
    return rng.randint(131072, 399999)


def _as_path_pool(size: int, rng: random.Random) -> list[tuple[int, ...]]:
    pool: set[tuple[int, ...]] = set()
    while len(pool) < size:
        length = rng.randint(2, 6)
        pool.add((FEEDER_AS, *(_asn(rng) for _ in range(length - 1))))
    return sorted(pool)


def _attribute_sets(count: int, rng: random.Random, next_hop: str, *, med_per_set: bool) -> list[bytes]:
    """``count`` distinct encoded attribute sets; ``med_per_set``: set k carries MED k (so all
    differ), otherwise 30 % carry a random MED."""
    paths = _as_path_pool(AS_PATH_POOL, rng)
    seen: set[tuple] = set()
    out: list[bytes] = []
    while len(out) < count:
        path = rng.choice(paths)
        origin = _wire.ORIGIN_INCOMPLETE if rng.random() < 0.15 else _wire.ORIGIN_IGP
        if med_per_set:
            med: int | None = len(out)
        else:
            med = rng.randint(0, 1000) if rng.random() < 0.30 else None
        comms: tuple[int, ...] = ()
        if rng.random() < 0.50:
            upstream = path[1] if path[1] <= 0xFFFF else FEEDER_AS
            comms = tuple(sorted({(upstream << 16) | rng.randint(1, 999) for _ in range(rng.randint(1, 4))}))
        key = (path, origin, med, comms)
        if key in seen:
            continue
        seen.add(key)
        out.append(_wire.path_attributes(origin=origin, as_path=path, next_hop=next_hop, med=med, communities=comms))
    return out


def build_stream(n: int, *, regime: str = "packed", next_hop: str = "10.0.0.1", seed: int = 1,
                 chunk_size: int = CHUNK_SIZE) -> FeedStream:
    """The UPDATE stream announcing ``n`` prefixes in ``regime`` (see the module docstring),
    deterministic per ``seed``."""
    if n < 1:
        raise ValueError("the stream needs at least one prefix")
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r} (expected one of {', '.join(REGIMES)})")
    rng = random.Random(seed)
    prefixes = _random_prefixes(n, rng)
    per_update = REGIMES[regime]
    sizes: list[int] = []
    left = n
    while left > 0:
        size = min(left, per_update or rng.randint(GROUP_MIN, GROUP_MAX))
        sizes.append(size)
        left -= size
    sets = _attribute_sets(len(sizes), rng, next_hop, med_per_set=per_update is not None)
    messages: list[bytes] = []
    start = 0
    for attrs, size in zip(sets, sizes):
        messages += _wire.updates(attrs, prefixes[start : start + size])
        start += size
    messages.append(_wire.END_OF_RIB)  # End-of-RIB for IPv4 unicast (RFC 4724 §2)
    chunks: list[bytes] = []
    pending: list[bytes] = []
    pending_len = 0
    for msg in messages:
        pending.append(msg)
        pending_len += len(msg)
        if pending_len >= chunk_size:
            chunks.append(b"".join(pending))
            pending, pending_len = [], 0
    if pending:
        chunks.append(b"".join(pending))
    return FeedStream(regime, n, len(messages), len(sets), tuple(chunks))


# --------------------------------------------------------------------------- the sender


class FeederError(RuntimeError):
    """The session with the device under test failed; the message says how."""


class Feeder:
    """One BGP session on an already connected blocking socket, driven by two threads.

    The sender thread pushes the stream and then a KEEPALIVE every hold_time/3
    (RFC 4271 §4.4); the reader thread parses and discards what the peer sends,
    remembering a NOTIFICATION or the connection closing as :attr:`error`.
    """

    def __init__(self, sock: socket.socket, *, asn: int = FEEDER_AS, router_id: str = "10.0.0.1",
                 hold_time: int = 90) -> None:
        self.sock = sock
        self.asn = asn
        self.router_id = router_id
        self.hold_time = hold_time
        self.peer_hold: int | None = None  # from the peer's OPEN
        self.error: str | None = None
        self.t0: float | None = None  # time.monotonic() right before the first UPDATE left
        self.t_sent: float | None = None  # ... and after the last stream byte was handed to TCP
        self._reader = _wire.Splitter()
        self._pending: list[tuple[int, bytes]] = []
        self._stop = threading.Event()
        self._started = threading.Event()
        self._send_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------ session setup

    def open_session(self, timeout: float = 30.0) -> int:
        """Exchange OPENs and KEEPALIVEs (RFC 4271 §8.2.2) until Established; returns the
        peer's hold time."""
        sock = self.sock
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_wire.open_message(self.asn, self.hold_time, self.router_id))
        deadline = time.monotonic() + timeout
        got_keepalive = False
        while not got_keepalive:
            if time.monotonic() > deadline:
                raise FeederError(f"no session within {timeout:.0f} s")
            msg_type, body = self._next_message()
            if msg_type == _wire.OPEN:
                try:
                    self.peer_hold = _wire.parse_open(body)[1]
                except ValueError as err:
                    raise FeederError(f"bad OPEN from peer: {err}") from None
                sock.sendall(_wire.keepalive())
            elif msg_type == _wire.KEEPALIVE and self.peer_hold is not None:
                got_keepalive = True
            elif msg_type == _wire.NOTIFICATION:
                raise FeederError(f"peer sent NOTIFICATION during setup: {_wire.describe_notification(body)}")
        sock.settimeout(None)
        assert self.peer_hold is not None
        return self.peer_hold

    def _next_message(self) -> tuple[int, bytes]:
        while not self._pending:
            data = self.sock.recv(65536)
            if not data:
                raise FeederError("peer closed the connection during setup")
            self._reader.feed(data)
            try:
                self._pending = self._reader.messages()
            except ValueError as err:
                raise FeederError(f"bad message from peer: {err}") from None
        return self._pending.pop(0)

    # ------------------------------------------------------------ streaming

    def start(self, stream: FeedStream) -> float:
        """Start sending ``stream``; returns t0 (time.monotonic() before the first UPDATE)."""
        reader = threading.Thread(target=self._read_loop, name="feeder-read", daemon=True)
        sender = threading.Thread(target=self._send_loop, args=(stream,), name="feeder-send", daemon=True)
        self._threads = [reader, sender]
        reader.start()
        sender.start()
        self._started.wait()
        assert self.t0 is not None
        return self.t0

    def _send_loop(self, stream: FeedStream) -> None:
        try:
            self.t0 = time.monotonic()
            self._started.set()
            for chunk in stream.chunks:
                if self._stop.is_set():
                    return
                with self._send_lock:
                    self.sock.sendall(chunk)
            self.t_sent = time.monotonic()
            keepalive = _wire.keepalive()
            interval = max(1.0, (self._negotiated_hold() or 90) / 3)
            while not self._stop.wait(interval):
                with self._send_lock:
                    self.sock.sendall(keepalive)
        except OSError as err:
            if not self._stop.is_set():
                self.error = self.error or f"send failed: {err}"
        finally:
            self._started.set()

    def _negotiated_hold(self) -> int:
        peer = self.hold_time if self.peer_hold is None else self.peer_hold
        return min(self.hold_time, peer) if peer else 0

    def _read_loop(self) -> None:
        reader = self._reader
        try:
            while not self._stop.is_set():
                data = self.sock.recv(262144)
                if not data:
                    if not self._stop.is_set():
                        self.error = self.error or "peer closed the connection"
                    return
                reader.feed(data)
                for msg_type, body in reader.messages():
                    if msg_type == _wire.NOTIFICATION:
                        self.error = f"peer sent NOTIFICATION: {_wire.describe_notification(body)}"
        except (OSError, ValueError) as err:
            if not self._stop.is_set():
                self.error = self.error or f"receive failed: {err}"

    def close(self) -> None:
        """Stop both threads and close the socket (the DUT sees the connection end)."""
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for thread in self._threads:
            thread.join(timeout=5)
        self.sock.close()
