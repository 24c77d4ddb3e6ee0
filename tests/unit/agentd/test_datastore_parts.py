"""The datastore's parts alone, where they can be without etcd: the connection's deadline and
reachability bookkeeping (agentd.datastore.connection), what the lease keeper holds
(agentd.datastore.liveness) and node events from watch events (agentd.datastore.registration).
Against a real etcd: tests/system/test_datastore.py and test_etcd_cluster.py."""

from __future__ import annotations

import logging
import random

import aetcd
import pytest

from agentd.datastore.connection import EtcdConnection
from agentd.datastore.etcd import parse_endpoint
from agentd.datastore.liveness import LeaseKeeper
from agentd.datastore.records import (
    DatastoreError,
    DatastoreUnavailable,
    NodeEvent,
    NodeRecord,
    SubnetLease,
    node_key,
)
from agentd.datastore.registration import Registration
from agentd.datastore.store import Datastore

PREFIX = "/agentd"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def connection(*urls: str, clock: Clock | None = None, changes: list | None = None) -> EtcdConnection:
    return EtcdConnection([parse_endpoint(u) for u in urls or ("http://127.0.0.1:2379",)],
                          clock=clock or Clock(), request_timeout=5.0, rng=random.Random(7),
                          state_callback=(lambda: changes.append) if changes is not None else (lambda: None))


def record(name: str, subnet: str = "10.244.1.0/24") -> NodeRecord:
    return NodeRecord(name=name, address="192.0.2.1", asn=64512, subnet=subnet, route_reflector=False,
                      cluster_id=None)


# --- the connection ------------------------------------------------------------------------


def test_deadlines_come_from_the_clock_given():
    clock = Clock()
    conn = connection(clock=clock)
    assert conn.deadline(None) is None
    assert conn.deadline(2.5) == 102.5


def test_an_unanswered_keepalive_ping_ends_the_channel_within_seconds():
    """gRPC (1.85) gives up an unanswered keepalive ping only after grpc.http2.ping_timeout_ms
    (60 s by default; keepalive_timeout_ms alone has no effect): a watch on a stopped or cut-off
    member sat ~70 s missing changes.  Every client's channel bounds it (system test:
    test_a_watch_on_a_stopped_etcd_is_interrupted_within_seconds)."""
    from agentd.datastore.etcd import EtcdClient

    options = EtcdClient(parse_endpoint("http://127.0.0.1:2379"), timeout=5.0)._options
    assert options["grpc.keepalive_time_ms"] <= 10000
    assert options["grpc.keepalive_timeout_ms"] <= 5000
    assert options["grpc.http2.ping_timeout_ms"] <= 5000


async def test_a_call_whose_deadline_passed_before_etcd_was_asked_changes_nothing(caplog):
    """The second call of one operation, its deadline used up by the first (or by the wait for
    the lock): it raised asyncio.TimeoutError before asking etcd, taken for a transient
    failure -- "etcd unreachable" logged, on_state_change(False), failover to the next member
    -- while etcd was fine.  Now: one clear error, and etcd's state and endpoint as they were."""
    clock = Clock()
    changes: list[bool] = []
    conn = connection("http://10.0.0.1:2379", "http://10.0.0.2:2379", clock=clock, changes=changes)
    calls = []

    async def op(client):
        calls.append(client)
        return "value"

    assert await conn.call("read", op, conn.deadline(5)) == "value"
    index, endpoint = conn.index, conn.endpoint
    caplog.set_level(logging.INFO, logger="agentd.datastore")
    with pytest.raises(DatastoreUnavailable, match=r"^read again: deadline passed before etcd was asked$"):
        await conn.call("read again", op, clock.now)
    assert len(calls) == 1  # not even tried
    assert (conn.state, conn.index, conn.endpoint, changes) == (True, index, endpoint, [True])
    assert caplog.records == []
    conn.closed = True
    await conn.shut()


async def test_a_call_failing_until_its_deadline_is_one_clear_error_and_marks_etcd_unreachable():
    """A call tried and failing until its deadline: etcd unreachable, said once, with the
    failure -- also where the deadline runs out in the backoff's sleep (the next attempt is not
    made, and moves to no further endpoint)."""
    from agentd.datastore.records import Backoff

    times = iter([100.0, 100.5, 100.9, 101.0])  # deadline(1.0); attempt; after its failure; after the sleep
    changes: list[bool] = []
    conn = connection("http://10.0.0.1:2379", "http://10.0.0.2:2379", clock=lambda: next(times), changes=changes)
    conn.backoff = lambda cap=5.0: Backoff(initial=1e-6, cap=1e-6, rng=random.Random(1))
    index = conn.index
    calls = []

    async def op(client):
        calls.append(client)
        raise aetcd.ConnectionFailedError("refused")

    with pytest.raises(DatastoreUnavailable,
                       match=r"^etcd at http://10.0.0.1:2379, http://10.0.0.2:2379 unreachable \(list\): .*refused"):
        await conn.call("list", op, conn.deadline(1.0))
    assert len(calls) == 1 and conn.index == index + 1
    assert changes == [False] and conn.state is False
    conn.set_connected(False, "again")  # no change: no callback
    conn.set_connected(True)
    assert changes == [False, True]
    conn.closed = True
    await conn.shut()
    assert changes == [False, True, False]
    with pytest.raises(DatastoreError, match="closed"):
        conn.client()


async def test_a_call_that_succeeds_reports_etcd_reachable_once():
    changes: list[bool] = []
    conn = connection(changes=changes)

    async def op(client):
        return "value"

    assert await conn.call("read", op, None) == "value"
    assert await conn.call("read", op, None) == "value"
    assert changes == [True]
    conn.closed = True
    await conn.shut()


async def test_the_first_endpoint_is_random_and_failover_needs_two():
    urls = [f"http://127.0.0.{i}:2379" for i in range(1, 5)]
    assert connection(*urls).endpoint in urls
    single = connection("http://127.0.0.1:2379")
    client = single.client()
    single.failover(client)  # nowhere else to go
    assert single.client() is client
    single.closed = True
    await single.shut()


def test_malformed_records_are_logged_once_per_key_and_revision(caplog):
    conn = connection()
    with caplog.at_level(logging.WARNING, logger="agentd.datastore"):
        for _ in range(3):
            conn.report_bad(b"/agentd/nodes/x", 5, ValueError("bad"))
        conn.report_bad(b"/agentd/nodes/x", 6, ValueError("bad"))
    assert len(caplog.records) == 2


# --- liveness --------------------------------------------------------------------------------


def test_the_keeper_refreshes_at_a_third_of_the_ttl_and_says_what_it_holds():
    keeper = LeaseKeeper(connection(), PREFIX, 30)
    assert keeper.interval == 10.0
    assert LeaseKeeper(connection(), PREFIX, 1).interval == pytest.approx(1 / 3)
    assert keeper.holdings() == "nothing"
    keeper.node = record("n1")
    keeper.subnet = SubnetLease(subnet="10.244.1.0/24", node="n1", public_ip="192.0.2.1",
                                backend_type="vxlan", backend_data={})
    assert keeper.holdings() == "node n1 and subnet 10.244.1.0/24"
    keeper.lease_id = 0x42
    keeper.lease_gone(0x41)  # an older lease: ours is still good
    assert keeper.lease_id == 0x42
    keeper.lease_gone(0x42)
    assert keeper.lease_id is None


# --- registration: node events from watch events ------------------------------------------


def test_watch_events_become_node_events_for_what_the_consumer_knows():
    conn = connection()
    registration = Registration(conn, LeaseKeeper(conn, PREFIX, 30), PREFIX)
    n1 = record("n1")
    key = node_key(PREFIX, "n1")
    nodes: dict[str, NodeRecord] = {}
    assert registration.node_event(key, n1.to_json(), 5, "put", nodes) == NodeEvent("put", name="n1", record=n1)
    assert nodes == {"n1": n1}
    # It became unreadable (a bad `etcdctl put`): the consumer keeps its last good record --
    # taken for a delete, it cut a live node off (BGP Cease, its routes withdrawn).
    assert registration.node_event(key, b"{not json", 6, "put", nodes) is None
    assert registration.node_event(key, b"{not json", 7, "put", nodes) is None
    assert nodes == {"n1": n1}
    assert registration.node_event(key, b"", 8, "delete", nodes) == NodeEvent("delete", name="n1")  # only a delete
    assert registration.node_event(key, b"", 9, "delete", nodes) is None  # not known: nothing to say
    assert registration.node_event(b"/agentd/nodes/", b"", 10, "delete", nodes) is None  # not a node key



async def test_a_node_watch_keeps_the_last_good_record_of_an_unreadable_one_across_snapshots():
    """A new snapshot (after a compaction) with n1's record unreadable: n1 as last seen, not
    gone; n3, never seen readable, is left out (nothing good to keep)."""
    from agentd.datastore.watches import KeyValue, PrefixEvent, Watches

    conn = connection()
    registration = Registration(conn, LeaseKeeper(conn, PREFIX, 30), PREFIX)
    watches = Watches(conn, registration, PREFIX)
    n1, n2 = record("n1"), record("n2", "10.244.2.0/24")

    def kv(name: str, value: bytes, revision: int) -> KeyValue:
        return KeyValue(node_key(PREFIX, name), value, revision, 0x42)

    async def prefix_events(prefix: bytes, what: str = ""):
        yield PrefixEvent("snapshot", 5, [kv("n1", n1.to_json(), 5)])
        yield PrefixEvent("put", 6, [kv("n1", b"{not json", 6)])
        yield PrefixEvent("snapshot", 9, [kv("n1", b"{not json", 6), kv("n2", n2.to_json(), 8),
                                          kv("n3", b"{not json", 9)])
        yield PrefixEvent("delete", 10, [kv("n1", b"", 10)])

    watches.watch_prefix = prefix_events  # type: ignore[method-assign]
    got = [ev async for ev in watches.watch_nodes()]
    assert got == [NodeEvent("snapshot", nodes={"n1": n1}), NodeEvent("snapshot", nodes={"n1": n1, "n2": n2}),
                   NodeEvent("delete", name="n1")]

def test_the_facade_exposes_its_parts_and_their_calls():
    ds = Datastore("http://127.0.0.1:2379", lease_ttl=9)
    assert ds.keeper.lease_ttl == 9 and ds.lease_id is None and ds.node is None and ds.subnet_lease is None
    assert ds.registration.keeper is ds.keeper is ds.leases.keeper
    assert ds.watches.registration is ds.registration
    lost: list = []
    ds.on_subnet_lost = lost.append
    assert ds.keeper.subnet_lost_callback() == lost.append


# --- watches -------------------------------------------------------------------------------


class _Head:
    revision = 100


class _Got(list):
    header = _Head()


class _WatchClient:
    """A client whose watch is created fine, then runs ``stream(clock)`` (its events) and fails."""

    def __init__(self, endpoint, created: list, stream) -> None:
        self.endpoint = endpoint
        self.created = created
        self.stream = stream

    async def get_prefix(self, prefix, keys_only=False):
        return _Got()

    async def watch_prefix(self, prefix, start_revision):
        self.created.append(start_revision)
        stream = self.stream

        class Watch:
            def __aiter__(self):
                return stream()

        return Watch()

    async def close(self):
        pass


async def _watch_delays(monkeypatch, stream, clock: Clock, attempts: int = 8) -> list[float]:
    """The delays watch_prefix sleeps between ``attempts`` re-creations of a failing watch
    (asyncio.sleep stood in for: it advances the clock instead of waiting)."""
    import asyncio

    from agentd.datastore.watches import Watches

    conn = connection("http://10.0.0.1:2379", "http://10.0.0.2:2379", clock=clock)
    created: list[int] = []
    conn.new_client = lambda i: _WatchClient(conn.targets[i % 2], created, stream)
    delays: list[float] = []
    real_sleep = asyncio.sleep

    async def fake_sleep(delay, result=None):
        delays.append(delay)
        clock.now += delay
        await real_sleep(0)

    async def consume():
        async for _ in Watches(conn, None, PREFIX).watch_prefix(b"/agentd/resources/", "resource watch"):
            pass

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    task = asyncio.ensure_future(consume())
    try:
        for _ in range(10000):
            if len(created) >= attempts or task.done():
                break
            await real_sleep(0)
        assert len(created) >= attempts, task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        monkeypatch.undo()
    return delays


async def test_a_watch_that_fails_as_soon_as_it_is_made_backs_off(monkeypatch, caplog):
    """Created, then failing at once: before, the backoff restarted at every creation (~10
    re-creations a second, four log lines each).  Now it grows to its cap, and the error is
    logged once."""
    import aetcd

    clock = Clock()

    async def fails_at_once():
        raise aetcd.ConnectionFailedError("stream reset")
        yield

    caplog.set_level(logging.INFO, logger="agentd.datastore")
    delays = await _watch_delays(monkeypatch, fails_at_once, clock)
    assert delays[-1] > 3.0 and sum(delays) > 10.0
    assert sum("interrupted" in r.getMessage() for r in caplog.records) == 1


async def test_a_watch_that_stayed_up_or_delivered_starts_its_backoff_again(monkeypatch):
    import aetcd

    from agentd.datastore import watches

    clock = Clock()

    async def stays_up_then_fails():
        clock.now += watches.STABLE_AFTER
        raise aetcd.ConnectionFailedError("stream reset")
        yield

    assert max(await _watch_delays(monkeypatch, stays_up_then_fails, clock)) < 0.2

    class Event:
        kind = aetcd.EventKind.PUT
        kv = aetcd.KeyValue.__new__(aetcd.KeyValue)

    async def delivers_then_fails():
        yield Event()
        raise aetcd.ConnectionFailedError("stream reset")

    class KV:
        key, value, mod_revision, lease = b"/agentd/resources/x", b"{}", 101, 0

    Event.kv = KV()
    assert max(await _watch_delays(monkeypatch, delivers_then_fails, clock)) < 0.2


def test_tls_files_renewed_in_place_are_read_again_for_the_next_connection(tmp_path, monkeypatch, caplog):
    """A client certificate renewed in place: before, the files read at start served every
    reconnect, and once the old certificate expired every handshake failed (the lease ran out).
    new_client reads them again when one changed (a stat per new client, nothing more)."""
    import os
    from pathlib import Path

    from agentd.datastore import connection as conn_mod

    read: list[tuple[bytes, ...]] = []

    def credentials(ca, cert, key):
        if not os.path.exists(cert):
            raise ValueError(f"etcd TLS cert file {cert!r}: No such file or directory")
        got = tuple(Path(p).read_bytes() for p in (ca, cert, key))
        read.append(got)
        return got

    monkeypatch.setattr(conn_mod, "tls_credentials", credentials)
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    for name, path in files.items():
        path.write_bytes(f"{name} 1".encode())
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    conn = EtcdConnection([parse_endpoint("https://127.0.0.1:2379")], ca=str(files["ca"]), cert=str(files["cert"]),
                          key=str(files["key"]), clock=Clock(), request_timeout=5.0, rng=random.Random(7))  # fmt: skip
    assert conn.new_client(0)._credentials == (b"ca 1", b"cert 1", b"key 1")
    assert conn.new_client(0)._credentials == (b"ca 1", b"cert 1", b"key 1") and len(read) == 1  # unchanged: not read
    files["cert"].write_bytes(b"cert 2")
    files["key"].write_bytes(b"key 2")
    assert conn.new_client(0)._credentials == (b"ca 1", b"cert 2", b"key 2") and len(read) == 2
    caplog.set_level(logging.WARNING, logger="agentd.datastore")
    files["cert"].unlink()  # mid-renewal: what was read stays
    assert conn.new_client(0)._credentials == (b"ca 1", b"cert 2", b"key 2")
    assert conn.new_client(0)._credentials == (b"ca 1", b"cert 2", b"key 2")
    assert caplog.text.count("cannot be read") == 1
    files["cert"].write_bytes(b"cert 3")
    assert conn.new_client(0)._credentials == (b"ca 1", b"cert 3", b"key 2")


async def test_with_one_endpoint_a_failure_after_a_tls_renewal_makes_a_new_client(tmp_path, monkeypatch):
    """One endpoint: a transient failure keeps the client (its channel reconnects by itself),
    unless the TLS files changed: then the next request gets a client with the new ones."""
    import os

    from agentd.datastore import connection as conn_mod

    monkeypatch.setattr(conn_mod, "tls_credentials", lambda ca, cert, key: os.stat(cert).st_mtime_ns)
    cert = tmp_path / "cert.pem"
    for path in (cert, tmp_path / "key.pem"):
        path.write_bytes(b"1")
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    conn = EtcdConnection([parse_endpoint("https://127.0.0.1:2379")], cert=str(cert), key=str(tmp_path / "key.pem"),
                          clock=Clock(), request_timeout=5.0, rng=random.Random(7))  # fmt: skip
    first = conn.client()
    conn.failover(first)
    assert conn.client() is first  # nothing changed: the same client
    os.utime(cert, ns=(2_000_000_000, 2_000_000_000))
    conn.failover(first)
    renewed = conn.client()
    assert renewed is not first and renewed._credentials == 2_000_000_000
    conn.failover(renewed)
    assert conn.client() is renewed  # made with the current files: kept
    # The order the review found: a renewal, a watch's new client (which reads the new files
    # first), then a failure of the request client.  The shared stamp then matched the files
    # and the request client kept its old certificate for ever.
    os.utime(cert, ns=(3_000_000_000, 3_000_000_000))
    watch = conn.new_client(0)
    assert watch._credentials == 3_000_000_000
    conn.failover(renewed)
    again = conn.client()
    assert again is not renewed and again._credentials == 3_000_000_000
    conn.closed = True
    await conn.shut()


async def test_node_records_carry_their_keys_create_revision_from_the_snapshot_and_the_events():
    """Of two records publishing one VTEP MAC the one made first keeps it (agentd.kernel.
    forwarding.vtep_mac_holder): every record the node watch delivers carries its key's etcd
    create_revision -- from the snapshot and from each put -- and a re-put (a re-publish, a
    lease renewed) keeps it, as etcd does."""
    from types import SimpleNamespace

    from agentd.datastore.watches import Watches

    def kv(name, mod, create):
        return SimpleNamespace(key=node_key(PREFIX, name), value=record(name).to_json(), mod_revision=mod,
                               lease=0, create_revision=create)

    class Client(_WatchClient):
        async def get_prefix(self, prefix, keys_only=False):
            return _Got([kv("n1", 40, 30)])

    async def stream():
        for k in (kv("n2", 101, 101), kv("n1", 102, 30)):
            yield SimpleNamespace(kv=k, kind=aetcd.EventKind.PUT)
        raise aetcd.ClientError("the test's end")

    conn = connection()
    conn.new_client = lambda i: Client(conn.targets[0], [], stream)
    registration = Registration(conn, LeaseKeeper(conn, PREFIX, 30), PREFIX)
    seen = []
    async for ev in Watches(conn, registration, PREFIX).watch_nodes():
        seen.append(ev)
        if len(seen) == 3:
            break
    snapshot, put2, put1 = seen
    assert snapshot.kind == "snapshot" and snapshot.nodes["n1"].create_revision == 30
    assert (put2.name, put2.record.create_revision) == ("n2", 101)
    assert (put1.name, put1.record.create_revision) == ("n1", 30)
    # The list call's records carry it too; equality does not look at it.
    listed = registration.parse_nodes([kv("n1", 40, 30)])
    assert listed["n1"].create_revision == 30 and listed == {"n1": record("n1")}


async def test_a_watch_resumes_after_its_last_revision_and_re_lists_after_a_compaction_or_a_revision_gone_back(
        monkeypatch):
    """A scripted etcd: a snapshot at revision 10; events 11 and 12, then the stream reset
    (UNAVAILABLE): resumed at 13, no snapshot (from 12: event 12 again; review mutant M1);
    then compacted: a new snapshot (at 20) and a watch from 21 (keeping the old revision
    looped on the compacted one, never re-listing: M2); then reset again with etcd's head at 5,
    below 20 (restored from a backup): a new snapshot, not a watch from 21 waiting for
    revisions that never come (M3)."""
    import asyncio
    from types import SimpleNamespace

    import grpc

    from agentd.datastore.watches import Watches

    def kv(key, rev):
        return SimpleNamespace(key=key, value=b"{}", mod_revision=rev, lease=0, create_revision=rev)

    def got(rev, kvs=()):
        out = _Got(kvs)
        out.header = SimpleNamespace(revision=rev)
        return out

    def unavailable():
        cause = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                     details="stream reset")
        try:
            raise aetcd.ConnectionFailedError("stream reset") from cause
        except aetcd.ConnectionFailedError as exc:
            return exc

    heads, snapshots = [20, 5], [10, 20, 30]  # keys_only reads (the resume's check); full reads
    created: list[int] = []

    class Client(_WatchClient):
        async def get_prefix(self, prefix, keys_only=False):
            if not (heads if keys_only else snapshots):  # past the script (a wrong turn): no answer
                await asyncio.get_running_loop().create_future()
            if keys_only:
                return got(heads.pop(0))
            rev = snapshots.pop(0)
            return got(rev, [kv(b"/p/a", rev)])

        async def watch_prefix(self, prefix, start_revision):
            created.append(start_revision)
            n = len(created)

            async def stream():
                if n == 1:
                    yield SimpleNamespace(kind=aetcd.EventKind.PUT, kv=kv(b"/p/a", 11))
                    yield SimpleNamespace(kind=aetcd.EventKind.PUT, kv=kv(b"/p/b", 12))
                    raise unavailable()
                if n == 2:
                    raise aetcd.RevisionCompactedError(15)
                if n == 3:
                    raise unavailable()
                await asyncio.get_running_loop().create_future()  # stays up
                yield

            class Watch:
                def __aiter__(self):
                    return stream()

            return Watch()

    conn = connection("http://10.0.0.1:2379", "http://10.0.0.2:2379")
    conn.new_client = lambda i: Client(conn.targets[i % 2], [], None)
    real_sleep = asyncio.sleep

    async def no_wait(delay, result=None):
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", no_wait)
    out: list[tuple[str, int]] = []

    async def consume():
        async for event in Watches(conn, None, "/p").watch_prefix(b"/p/", "test watch"):
            out.append((event.kind, event.revision))

    task = asyncio.ensure_future(consume())
    try:
        for _ in range(2000):
            if len(created) >= 4 or task.done():
                break
            await real_sleep(0)
        for _ in range(10):  # the fourth watch's snapshot delivered
            await real_sleep(0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        monkeypatch.undo()
    assert created == [11, 13, 21, 31]
    assert out == [("snapshot", 10), ("put", 11), ("put", 12), ("snapshot", 20), ("snapshot", 30)]
    conn.closed = True
    await conn.shut()


async def test_a_cancel_landing_as_a_client_closes_is_kept():
    """close_quietly's wait_for (Python 3.11) returned normally when the close ended in the
    same loop step as its task was cancelled (CPython gh-86296): a watch cancelled by its
    consumer while closing its failed client went on re-creating watches for ever."""
    import asyncio

    from agentd.datastore.connection import close_quietly

    gate = asyncio.get_running_loop().create_future()

    class Client:
        async def close(self):
            await gate

    task = asyncio.ensure_future(close_quietly(Client()))  # type: ignore[arg-type]
    for _ in range(3):
        await asyncio.sleep(0)
    gate.set_result(None)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
