"""The datastore against a real etcd 3.4 (EtcdServer on 127.0.0.1, its own ports per test).

No namespaces are needed: etcd listens on loopback only.  Lease TTLs are 5 s: short
enough that recovery past an expired lease is seen within seconds, long enough that one
slow keepalive on a loaded machine does not let a lease expire by itself (they come every
ttl/3: at 2 s every 0.67 s, each with a 1 s timeout).  2 s only where the lease running
out is what is tested.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import socket
import sys
import time
from collections.abc import AsyncIterator
from ipaddress import IPv4Address, IPv4Network, IPv6Network

import aetcd
import pytest

from agentd.datastore.store import (
    ClusterConfig,
    Datastore,
    DatastoreUnavailable,
    NodeEvent,
    NodeRecord,
    SubnetExhausted,
)
from agentd.lab import etcd as lab_etcd
from agentd.lab.etcd import EtcdServer
from agentd.lab.wait import apause, auntil

CLUSTER = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "vxlan", "always")
TTL = 5  # every client's lease unless a test gives another
SHORT_TTL = 2  # where the lease running out is the point
LOG = "agentd.datastore"


@contextlib.asynccontextmanager
async def raw(server: EtcdServer) -> AsyncIterator[aetcd.Client]:
    """A plain aetcd client to look at (and tamper with) etcd directly."""
    async with aetcd.Client(server.host, server.client_port, timeout=5) as client:
        yield client


@pytest.fixture
async def stores(etcd_server) -> AsyncIterator:  # noqa: F811
    """make(**kw) -> a Datastore on the test's etcd; all are closed at the end."""
    made: list[Datastore] = []

    def make(**kwargs) -> Datastore:
        kwargs.setdefault("lease_ttl", TTL)
        ds = Datastore([etcd_server.endpoint], **kwargs)
        made.append(ds)
        return ds

    try:
        yield make
    finally:
        await asyncio.gather(*(ds.close() for ds in made))


def node_record(name: str, subnet: IPv4Network | None, address: str = "192.0.2.10") -> NodeRecord:
    return NodeRecord(name, IPv4Address(address), 64512, subnet, False, None, {"vtep_mac": "02:00:00:00:00:01"})


async def acquire(ds: Datastore, node: str, previous=None, cluster: ClusterConfig = CLUSTER):
    return await ds.acquire_subnet(
        node, IPv4Address("192.0.2.10"), "vxlan", {"vtep_mac": "02:00:00:00:00:01"},
        cluster=cluster, previous=previous, timeout=30,
    )


async def keys(client: aetcd.Client, prefix: bytes = b"/agentd/") -> dict[bytes, aetcd.KeyValue]:
    return {kv.key: kv for kv in await client.get_prefix(prefix)}


async def eventually(check, timeout: float = 30.0, what: str = "condition"):
    """Poll an async or sync predicate until it returns something truthy."""
    return await auntil(check, timeout, what=what)


class Collector:
    """Runs ``watch_nodes()`` in a task and keeps every event."""

    def __init__(self, ds: Datastore) -> None:
        self.events: list[NodeEvent] = []
        self._task = asyncio.get_running_loop().create_task(self._run(ds))

    async def _run(self, ds: Datastore) -> None:
        async for event in ds.watch_nodes():
            self.events.append(event)

    def kinds(self, start: int = 0) -> list[tuple[str, str | None]]:
        return [(e.kind, e.name) for e in self.events[start:]]

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


# -- allocation ------------------------------------------------------------------------


async def test_fifty_concurrent_allocators_get_distinct_subnets(etcd_server, stores):  # noqa: F811
    clients = [stores() for _ in range(50)]
    started = time.monotonic()
    leases = await asyncio.gather(*(acquire(ds, f"node-{i:02d}") for i, ds in enumerate(clients)))
    elapsed = time.monotonic() - started
    print(f"50 concurrent allocators (50 etcd connections) done in {elapsed:.2f}s")

    subnets = [lease.subnet for lease in leases]
    assert len(set(subnets)) == 50
    assert all(s.subnet_of(CLUSTER.cidr) and s.prefixlen == 24 for s in subnets)
    # etcd itself holds exactly these 50 keys, each naming its node, under that node's lease.
    async with raw(etcd_server) as client:
        stored = await keys(client, b"/agentd/subnets/")
    assert len(stored) == 50
    for i, (ds, lease) in enumerate(zip(clients, leases)):
        kv = stored[f"/agentd/subnets/{lease.subnet.network_address}-24".encode()]
        value = json.loads(kv.value)
        assert value == {
            "node": f"node-{i:02d}", "public_ip": "192.0.2.10",
            "backend_type": "vxlan", "backend_data": {"vtep_mac": "02:00:00:00:00:01"},
        }
        assert kv.lease == ds.lease_id == lease.lease_id


async def test_cluster_config_first_writer_wins_under_concurrency(etcd_server, stores):  # noqa: F811
    wanted = [ClusterConfig(IPv4Network("10.244.0.0/16"), 17 + i, "host-gw", "always") for i in range(10)]
    clients = [stores() for _ in wanted]
    got = await asyncio.gather(*(ds.ensure_cluster_config(w, timeout=10) for ds, w in zip(clients, wanted)))
    assert len(set(got)) == 1, "every writer must see the same stored config"
    winner = got[0]
    assert sum(1 for w in wanted if w == winner) == 1
    async with raw(etcd_server) as client:
        stored = await client.get(b"/agentd/config")
    assert ClusterConfig.from_json(stored.value) == winner
    # A later writer with another opinion is told what is stored.
    late = await stores().ensure_cluster_config(CLUSTER, timeout=10)
    assert late == winner
    assert await stores().get_cluster_config(timeout=10) == winner


async def test_subnet_exhaustion_under_contention(etcd_server, stores):  # noqa: F811
    tiny = ClusterConfig(IPv4Network("10.9.0.0/28"), 30, "host-gw", "always")
    clients = [stores() for _ in range(6)]
    results = await asyncio.gather(
        *(acquire(ds, f"n{i}", cluster=tiny) for i, ds in enumerate(clients)), return_exceptions=True
    )
    won = [r for r in results if not isinstance(r, BaseException)]
    lost = [r for r in results if isinstance(r, BaseException)]
    assert sorted(r.subnet for r in won) == list(tiny.cidr.subnets(new_prefix=30))
    assert len(lost) == 2 and all(isinstance(e, SubnetExhausted) for e in lost)
    message = str(lost[0])
    assert "10.9.0.0/28" in message and "all 4" in message and "\n" not in message


# -- restarts: the same subnet comes back ------------------------------------------------


async def test_restarted_node_gets_its_previous_subnet_back(etcd_server, stores):  # noqa: F811
    first = stores()
    lease = await acquire(first, "alpha")
    await first.register_node(node_record("alpha", lease.subnet))
    await first.close()  # a crash: nothing released, the old lease still runs its course

    # With the subnet file: `previous` is preferred and taken over under the new lease.
    second = stores()
    again = await acquire(second, "alpha", previous=lease.subnet)
    assert again.subnet == lease.subnet and again.lease_id == second.lease_id != lease.lease_id
    async with raw(etcd_server) as client:
        kv = (await keys(client))[f"/agentd/subnets/{lease.subnet.network_address}-24".encode()]
        assert kv.lease == second.lease_id
    await second.close()

    # Without the subnet file: etcd's record of the node's subnet gives it back.
    third = stores()
    assert (await acquire(third, "alpha")).subnet == lease.subnet
    # Exactly one subnet key for alpha remains.
    assert [s for s, sl in (await third.list_subnets()).items() if sl.node == "alpha"] == [lease.subnet]


async def test_subnet_remembered_by_node_record_and_previous_taken_by_other(etcd_server, stores):  # noqa: F811
    ds = stores()
    remembered = IPv4Network("10.244.77.0/24")
    async with raw(etcd_server) as client:
        # Only the node record survived (e.g. its subnet key was deleted by hand).
        await client.put(b"/agentd/nodes/beta", node_record("beta", remembered).to_json())
    assert (await acquire(ds, "beta")).subnet == remembered

    # A previous subnet that another node holds is not taken from it.
    other = stores()
    theirs = await acquire(other, "gamma")
    mine = await acquire(stores(), "delta", previous=theirs.subnet)
    assert mine.subnet != theirs.subnet
    assert (await ds.get_subnet_lease(theirs.subnet)).node == "gamma"


@pytest.mark.parametrize(("spelled", "version"), [("10.244.0.0-024", 4), ("FD00:10:244:0:0:0:0:0-64", 6)])
async def test_our_earlier_subnet_key_in_another_spelling_neither_loops_nor_is_shared(
        etcd_server, stores, caplog, spelled, version):
    """A node's earlier lease put back (etcdctl, a migration script) under a key agentd does
    not write: every compare is on the key agentd writes, and the node's start retried its
    claim at once for ever.  Reported once, in one line; the subnet stays taken by no node."""
    tiny = ClusterConfig(IPv4Network("10.244.0.0/23"), 24, "vxlan", "always", ip_family="dual",
                         cidr_v6=IPv6Network("fd00:10:244::/63"), subnet_len_v6=64)
    odd = f"/agentd/subnets/{spelled}".encode()
    earlier, other = list(tiny.pool(version)[0].subnets(new_prefix=tiny.pool(version)[1]))
    async with raw(etcd_server) as client:
        await client.put(odd, json.dumps({"node": "lambda", "public_ip": "192.0.2.10", "backend_type": "vxlan",
                                          "backend_data": {}}).encode())

    async def take(node: str):
        return await stores().acquire_subnet(node, IPv4Address("192.0.2.10"), "vxlan", {}, cluster=tiny,
                                             previous=earlier, timeout=10, version=version)

    ds = stores()
    with caplog.at_level(logging.WARNING, logger=LOG):
        lease = await ds.acquire_subnet("lambda", IPv4Address("192.0.2.10"), "vxlan", {}, cluster=tiny,
                                        previous=earlier, timeout=10, version=version)
    assert lease.subnet == other
    bad = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and spelled in r.getMessage()]
    assert len(bad) == 1 and "until this key is deleted" in bad[0], bad
    with pytest.raises(SubnetExhausted):  # nor does another node get it
        await take("mu")
    assert await ds.release("lambda", timeout=10) == [other]
    async with raw(etcd_server) as client:
        assert list(await keys(client, b"/agentd/subnets/")) == [odd]
        await client.delete(odd)  # deleted, the subnet is free again
    assert (await take("mu")).subnet == earlier


# -- liveness ----------------------------------------------------------------------------


async def test_node_without_keepalive_disappears_after_ttl(etcd_server, stores):  # noqa: F811
    watcher = Collector(stores())
    try:
        await eventually(lambda: watcher.kinds() == [("snapshot", None)], what="initial snapshot")
        node = stores(lease_ttl=SHORT_TTL)
        lease = await acquire(node, "epsilon")
        await node.register_node(node_record("epsilon", lease.subnet))
        await eventually(lambda: ("put", "epsilon") in watcher.kinds(), what="put event")
        await node.update_node(node_record("epsilon", lease.subnet, address="192.0.2.99"))
        await eventually(
            lambda: any(e.kind == "put" and e.record.address == IPv4Address("192.0.2.99") for e in watcher.events),
            what="updated record",
        )

        stopped = time.monotonic()
        await node.close()  # no more keepalives, nothing revoked: the lease must run out
        await eventually(lambda: ("delete", "epsilon") in watcher.kinds(), timeout=SHORT_TTL + 30, what="delete event")
        print(f"node key gone {time.monotonic() - stopped:.1f}s after its keepalive stopped (ttl {SHORT_TTL}s)")
        async with raw(etcd_server) as client:
            assert await keys(client) == {}
    finally:
        await watcher.stop()


async def test_revoked_lease_is_replaced_and_same_subnet_reacquired(etcd_server, stores, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, logger=LOG)
    ds = stores()
    lost = []
    ds.on_subnet_lost = lost.append
    lease = await acquire(ds, "zeta")
    await ds.register_node(node_record("zeta", lease.subnet))
    await eventually(lambda: ds.lease_renewals >= 1, what="a keepalive")

    async with raw(etcd_server) as client:
        for _ in range(2):  # twice: the keepalive task must survive its own recovery
            old = ds.lease_id
            await client.revoke_lease(old)

            async def restored():
                stored = await keys(client)
                node_kv = stored.get(b"/agentd/nodes/zeta")
                subnet_kv = stored.get(f"/agentd/subnets/{lease.subnet.network_address}-24".encode())
                return (
                    ds.lease_id not in (None, old)
                    and node_kv is not None and node_kv.lease == ds.lease_id
                    and subnet_kv is not None and subnet_kv.lease == ds.lease_id
                )

            await eventually(restored, what="node and subnet back under a new lease")
            assert ds.subnet_lease.subnet == lease.subnet
            info = await client.get_lease_info(ds.lease_id)
            assert info.TTL > 0
    renewals = ds.lease_renewals
    await eventually(lambda: ds.lease_renewals > renewals, what="keepalives after recovery")
    assert lost == []
    assert any("expired or was revoked" in r.getMessage() for r in caplog.records)


async def test_subnet_taken_while_lease_gone_is_reported_not_raised(etcd_server, stores):  # noqa: F811
    ds = stores()
    lost = []
    ds.on_subnet_lost = lost.append
    lease = await acquire(ds, "eta")
    await ds.register_node(node_record("eta", lease.subnet))
    key = f"/agentd/subnets/{lease.subnet.network_address}-24".encode()
    async with raw(etcd_server) as client:
        # Another node's record replaces ours (detached from our lease), then our lease goes.
        intruder = {"node": "theta", "public_ip": "192.0.2.20", "backend_type": "vxlan", "backend_data": {}}
        await client.put(key, json.dumps(intruder).encode())
        await client.revoke_lease(ds.lease_id)
        await eventually(lambda: lost, what="on_subnet_lost")
        assert lost[0].subnet == lease.subnet and lost[0].node == "eta"
        assert ds.subnet_lease is None
        assert json.loads((await client.get(key)).value)["node"] == "theta"
        # The node record is back under the new lease; the agent can lease another subnet.
        await eventually(
            lambda: _lease_of(client, b"/agentd/nodes/eta", ds.lease_id), what="node record restored"
        )
    fresh = await acquire(ds, "eta", previous=lease.subnet)
    assert fresh.subnet != lease.subnet


async def test_our_keys_brought_back_under_an_earlier_lease_are_taken_over(etcd_server, stores):  # noqa: F811
    """etcd restored from a backup taken before the agent's last restart: its node record and
    subnet key are back under its earlier lease (which nobody refreshes) and its lease is not
    there.  The keeper takes them over under a new lease: that earlier lease running out
    removes neither."""
    ds = stores()
    lost = []
    ds.on_subnet_lost = lost.append
    lease = await acquire(ds, "iota")
    await ds.register_node(node_record("iota", lease.subnet))
    node_key = b"/agentd/nodes/iota"
    subnet_key = f"/agentd/subnets/{lease.subnet.network_address}-24".encode()
    async with raw(etcd_server) as client:
        stored = await keys(client)
        earlier = await client.lease(600)  # the snapshot's lease
        for key in (node_key, subnet_key):
            await client.put(key, stored[key].value, lease=earlier.id)
        await client.revoke_lease(ds.lease_id)  # not in the snapshot (its keys are not under it now)

        async def taken_over():
            now = await keys(client)
            return (ds.lease_id not in (None, earlier.id) and all(
                now.get(key) is not None and now[key].lease == ds.lease_id for key in (node_key, subnet_key)))

        await eventually(taken_over, what="node record and subnet key under a new lease")
        await client.revoke_lease(earlier.id)  # it runs out
        await apause(2 * TTL / 3, "a keepalive round or two")
        now = await keys(client)
        assert {key: now[key].lease for key in (node_key, subnet_key)} == dict.fromkeys((node_key, subnet_key),
                                                                                      ds.lease_id)
    assert lost == [] and ds.subnet_lease.subnet == lease.subnet



async def test_our_keys_garbled_by_hand_are_written_back_and_the_node_stays(etcd_server, stores):
    """`etcdctl put` of an unreadable value at our subnet key and node record: under no lease
    (a plain put detaches the key from ours), then under ours (--ignore-lease).  The keeper
    gave the subnet up for the first (on_subnet_lost: the agent exits) and left the node record
    unreadable for good (the other nodes took it for a delete: BGP Cease, routes withdrawn).
    Now both are written back under our lease, and another node's watch never loses the node."""
    ds = stores()
    lost = []
    ds.on_subnet_lost = lost.append
    lease = await acquire(ds, "rho")
    record = node_record("rho", lease.subnet)
    await ds.register_node(record)
    node_key = b"/agentd/nodes/rho"
    subnet_key = f"/agentd/subnets/{lease.subnet.network_address}-24".encode()
    watcher = Collector(stores())
    await eventually(lambda: watcher.kinds() == [("snapshot", None)] and "rho" in watcher.events[0].nodes,
                     what="the other node's snapshot")
    try:
        async with raw(etcd_server) as client:
            for garbled_under in (0, ds.lease_id):
                await client.put(subnet_key, b'{"node": "rho", "public_ip": 5}', lease=garbled_under)
                await client.put(node_key, b"{not json", lease=garbled_under)

                async def written_back():
                    now = await keys(client)
                    return (now.get(subnet_key) is not None and now.get(node_key) is not None
                            and (now[subnet_key].value, now[subnet_key].lease) == (lease.to_json(), ds.lease_id)
                            and (now[node_key].value, now[node_key].lease) == (record.to_json(), ds.lease_id))

                await eventually(written_back, what="subnet key and node record written back under our lease")
        assert lost == [] and ds.subnet_lease == lease
        assert ("delete", "rho") not in watcher.kinds()
    finally:
        await watcher.stop()

async def _lease_of(client: aetcd.Client, key: bytes, lease_id: int | None) -> bool:
    kv = await client.get(key)
    return kv is not None and lease_id is not None and kv.lease == lease_id


# -- etcd outages --------------------------------------------------------------------------


async def test_etcd_outage_longer_than_ttl_recovers_by_itself(etcd_server, stores):  # noqa: F811
    ds = stores()
    states: list[bool] = []
    ds.on_state_change = states.append
    await ds.connect(timeout=10)
    lease = await acquire(ds, "iota")
    await ds.register_node(node_record("iota", lease.subnet))
    watcher = Collector(ds)
    try:
        await eventually(lambda: ("snapshot", None) in watcher.kinds(), what="first snapshot")

        await etcd_server.stop()
        down_at = time.monotonic()
        await eventually(lambda: not ds.connected, what="connected=False")
        await apause(max(0.0, TTL + 1.5 - (time.monotonic() - down_at)), "the outage lasts past the lease TTL")
        assert not ds.connected
        seen = len(watcher.events)

        await etcd_server.start()
        up_at = time.monotonic()
        await eventually(lambda: ds.connected, what="connected=True")
        # The watch resumes from the revision it had reached: the next change arrives, no new snapshot.
        await stores().register_node(node_record("kappa", None), timeout=10)
        await eventually(lambda: ("put", "kappa") in watcher.kinds(seen), what="the event after the outage")
        print(f"outage {up_at - down_at:.1f}s; connected again and watching {time.monotonic() - up_at:.2f}s after")
        assert watcher.kinds(seen) == [("put", "kappa")]

        renewals = ds.lease_renewals
        await eventually(lambda: ds.lease_renewals > renewals, what="keepalives after the outage")
        async with raw(etcd_server) as client:
            stored = await keys(client)
            node_kv = stored[b"/agentd/nodes/iota"]
            subnet_kv = stored[f"/agentd/subnets/{lease.subnet.network_address}-24".encode()]
            assert node_kv.lease == subnet_kv.lease == ds.lease_id
            assert (await client.get_lease_info(ds.lease_id)).TTL > 0
        assert ds.subnet_lease.subnet == lease.subnet
        assert states[0] is True and False in states and states[-1] is True
    finally:
        await watcher.stop()


async def test_watch_re_syncs_when_etcd_revision_goes_back(etcd_server, stores):  # noqa: F811
    """etcd back with less history (a restore from a snapshot; here a lone member that lost its
    data): etcd would take a watch from a revision it has not reached and send nothing below
    it, so the watch re-syncs (a new snapshot) instead of resuming where it was."""
    ds = stores()
    await ds.connect(timeout=10)
    async with raw(etcd_server) as client:
        for i in range(40):  # the revision well past what the emptied store will reach
            await client.put(b"/agentd/elsewhere", str(i).encode())
    watcher = Collector(ds)
    try:
        await eventually(lambda: ("snapshot", None) in watcher.kinds(), what="first snapshot")
        await etcd_server.stop()
        await eventually(lambda: not ds.connected, what="connected=False")
        shutil.rmtree(etcd_server.data_dir)
        seen = len(watcher.events)
        await etcd_server.start()
        async with raw(etcd_server) as client:
            await client.put(b"/agentd/nodes/lambda", node_record("lambda", None).to_json())

        def lambda_seen() -> bool:  # in the new snapshot, or put after it
            return any((e.kind == "snapshot" and "lambda" in (e.nodes or {})) or (e.kind, e.name) == ("put", "lambda")
                       for e in watcher.events[seen:])

        await eventually(lambda_seen, timeout=20, what="the node put after etcd came back")
        assert ("snapshot", None) in watcher.kinds(seen)
    finally:
        await watcher.stop()


async def honoured(call, deadline: float):
    """``call``, which was given ``deadline`` seconds; TimeoutError if it has not ended ten
    times later (it ignored its deadline)."""
    return await asyncio.wait_for(call, 10 * deadline)


async def test_unreachable_etcd_with_deadline_raises_quickly_and_failover_works(etcd_server, stores):  # noqa: F811
    with socket.socket() as s:  # a port nobody listens on (bound, not listening, until the end)
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        ds = Datastore([dead], lease_ttl=TTL)
        try:
            # The deadlines are honoured: without one the datastore retries for ever, and the
            # guard (ten times the deadline: slack for a loaded machine) would end the call
            # with TimeoutError instead of DatastoreUnavailable.
            with pytest.raises(DatastoreUnavailable, match="unreachable"):
                await honoured(ds.connect(timeout=1.0), 1.0)
            with pytest.raises(DatastoreUnavailable):
                await honoured(acquire_with_deadline(ds, 1.0), 1.0)
            assert not ds.connected
        finally:
            await ds.close()
        # The first endpoint is dead; the datastore moves on to the second.
        both = Datastore([dead, etcd_server.endpoint], lease_ttl=TTL)
        try:
            await both.connect(timeout=10)
            assert both.connected
            assert (await acquire(both, "kappa")).node == "kappa"
        finally:
            await both.close()


async def test_tls_with_client_certificates(tmp_path):
    pki = lab_etcd.make_test_pki(tmp_path / "pki")
    async with lab_etcd.etcd_server(tmp_path, tls=pki) as server:
        assert server.endpoint.startswith("https://")
        ds = Datastore([server.endpoint], lease_ttl=TTL, ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
        try:
            await ds.connect(timeout=10)
            lease = await acquire(ds, "tau")
            await ds.register_node(node_record("tau", lease.subnet))
            events = ds.watch_nodes()
            try:
                snapshot = await asyncio.wait_for(anext(events), 10)
                assert set(snapshot.nodes) == {"tau"}
            finally:
                await events.aclose()
        finally:
            await ds.close()
        # etcd requires a client certificate: without one the handshake fails.
        anonymous = Datastore([server.endpoint], ca=pki.ca)
        try:
            with pytest.raises(DatastoreUnavailable):
                await anonymous.connect(timeout=1.5)
        finally:
            await anonymous.close()


async def test_hung_etcd_with_deadline_raises_and_close_ends_watches(etcd_server, stores):  # noqa: F811
    # A listener that never accepts or answers: calls hang rather than fail.
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        hung = Datastore([f"http://127.0.0.1:{hole.getsockname()[1]}"], lease_ttl=TTL, request_timeout=2)
        events: list[str] = []

        async def consume(ds: Datastore) -> None:
            async for event in ds.watch_nodes():
                events.append(event.kind)
            events.append("ended")

        consumer = asyncio.get_running_loop().create_task(consume(hung))
        try:
            with pytest.raises(DatastoreUnavailable) as excinfo:
                await honoured(hung.connect(timeout=1.0), 1.0)  # the 1 s deadline, not the retry for ever
            assert "\n" not in str(excinfo.value)
        finally:
            await hung.close()
        await asyncio.wait_for(consumer, 10)  # ends by itself; no CancelledError leaks out
        assert events == ["ended"]

    # The same for a watch that is following a live etcd.
    live = stores()
    events.clear()
    consumer = asyncio.get_running_loop().create_task(consume(live))
    await eventually(lambda: events == ["snapshot"], what="snapshot")
    await live.close()
    await asyncio.wait_for(consumer, 10)
    assert events == ["snapshot", "ended"]


async def test_a_watch_on_a_stopped_etcd_is_interrupted_within_seconds(etcd_server, stores):
    # A member that stops answering without closing its sockets (SIGSTOP here; a partition
    # alike): only keepalive pings find it.  gRPC gave up an unanswered ping after
    # grpc.http2.ping_timeout_ms, 60 s by default, so the watch sat ~70 s on the silent member
    # missing every change; with it bounded, ~15 s (10 s to the ping, 5 s for its answer).
    ds = stores()
    watch = Collector(ds)
    try:
        await eventually(lambda: watch.kinds() == [("snapshot", None)] and ds.connected, what="snapshot")
        await apause(1.0, "the watch stream is up and idle")
        etcd_server.freeze()
        try:
            started = time.monotonic()
            await eventually(lambda: not ds.connected, timeout=20, what="the watch interrupted")
            print(f"watch on a stopped etcd interrupted after {time.monotonic() - started:.1f}s")
        finally:
            etcd_server.thaw()
        await eventually(lambda: ds.connected, what="the watch resumed")
    finally:
        await watch.stop()


async def acquire_with_deadline(ds: Datastore, timeout: float):
    return await ds.acquire_subnet(
        "lambda", "192.0.2.1", "host-gw", {}, cluster=CLUSTER, timeout=timeout
    )


async def test_watch_resyncs_after_compaction(etcd_server, stores):  # noqa: F811
    ds = stores()
    writer = stores()
    events = ds.watch_nodes()
    try:
        first = await asyncio.wait_for(anext(events), 10)
        assert first.kind == "snapshot" and first.nodes == {}
        # While the consumer holds the snapshot, history moves on and is compacted away.
        async with raw(etcd_server) as client:
            await client.put(b"/agentd/nodes/mu", node_record("mu", None).to_json())
            put = await client.put(b"/agentd/nodes/nu", node_record("nu", None).to_json())
            await client.compact(put.header.revision, physical=True)
        following = await asyncio.wait_for(anext(events), 10)
        assert following.kind == "snapshot" and set(following.nodes) == {"mu", "nu"}
        # And it goes on with live events.
        await writer.register_node(node_record("xi", None))
        nxt = await asyncio.wait_for(anext(events), 10)
        assert (nxt.kind, nxt.name) == ("put", "xi")
    finally:
        await events.aclose()


async def test_a_watch_cancelled_while_it_is_being_set_up_ends(etcd_server, stores):  # noqa: F811
    """A task cancelled while its watch is being created (the snapshot read, the create
    request on its way) ends: the cancel is not lost when the creation completes in the same
    loop step (Python 3.11's wait_for, which aetcd uses, would drop it and the watch would
    wait for events forever: an agent that never exits on SIGTERM).  The cancel lands at 50
    offsets spread over the few milliseconds the creation takes, ten times each."""
    ds = stores()
    for i in range(500):
        snapshot = asyncio.Event()

        async def consume() -> None:
            async for _ in ds.watch_prefix(b"/agentd/cancelled-watch/", "cancelled watch"):
                snapshot.set()

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(snapshot.wait(), 10)
        await asyncio.sleep((i % 50) * 0.0001)  # where the cancel lands, not a wait for something
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        if not done:
            task.cancel()  # once more: it ends with the test
        assert done, f"cancel {i} ({(i % 50) * 0.1:.1f} ms after the snapshot) was lost: the watch goes on"


# -- malformed records ----------------------------------------------------------------------


async def test_malformed_records_are_logged_once_and_skipped(etcd_server, stores, caplog):  # noqa: F811
    caplog.set_level(logging.WARNING, logger=LOG)
    good = node_record("good", IPv4Network("10.244.1.0/24"))
    with_extra = json.loads(node_record("extra", None).to_json())
    with_extra["future_field"] = {"anything": 1}  # unknown keys are ignored
    bad_nodes = {
        b"/agentd/nodes/badjson": b"{not json",
        b"/agentd/nodes/badtype": json.dumps({**json.loads(node_record("badtype", None).to_json()), "asn": "64512"}).encode(),
        b"/agentd/nodes/missing": json.dumps({"name": "missing"}).encode(),
        b"/agentd/nodes/mismatch": node_record("someone-else", None).to_json(),
    }
    async with raw(etcd_server) as client:
        await client.put(b"/agentd/nodes/good", good.to_json())
        await client.put(b"/agentd/nodes/extra", json.dumps(with_extra).encode())
        for key, value in bad_nodes.items():
            await client.put(key, value)
        await client.put(b"/agentd/subnets/10.244.2.0-24", b"[]")
        await client.put(b"/agentd/subnets/not-a-subnet", b"{}")
        await client.put(
            b"/agentd/subnets/10.244.3.0-24",
            json.dumps({"node": "good", "public_ip": "192.0.2.1", "backend_type": "host-gw", "backend_data": {}}).encode(),
        )

        ds = stores()
        nodes = await ds.list_nodes()
        assert set(nodes) == {"good", "extra"} and nodes["good"] == good
        subnets = await ds.list_subnets()
        assert set(subnets) == {IPv4Network("10.244.3.0/24")}
        warnings = [r.getMessage() for r in caplog.records if r.name == LOG]
        assert len(warnings) == 6, warnings
        assert all("\n" not in w and "malformed" in w for w in warnings)
        assert any("badjson" in w and "not valid JSON" in w for w in warnings)
        assert any("badtype" in w and "'asn'" in w for w in warnings)
        await ds.list_nodes()
        await ds.list_subnets()
        assert len([r for r in caplog.records if r.name == LOG]) == 6, "logged once per record"

        # The watch skips them too, and a record that turns bad keeps its last good version:
        # the next event is the good one put again, no delete before it.
        events = ds.watch_nodes()
        try:
            snapshot = await asyncio.wait_for(anext(events), 10)
            assert set(snapshot.nodes) == {"good", "extra"}
            await client.put(b"/agentd/nodes/badjson", b"still not json")
            await client.put(b"/agentd/nodes/good", b'{"name": "good"}')
            await client.put(b"/agentd/nodes/good", good.to_json())
            event = await asyncio.wait_for(anext(events), 10)
            assert (event.kind, event.name, event.record) == ("put", "good", good)
        finally:
            await events.aclose()

        # A malformed subnet key still counts as taken: allocation never overwrites it.
        small = ClusterConfig(IPv4Network("10.244.0.0/22"), 24, "host-gw", "always")
        got = {(await acquire(stores(), f"omicron{i}", cluster=small)).subnet for i in range(2)}
        assert got == {IPv4Network("10.244.0.0/24"), IPv4Network("10.244.1.0/24")}
        with pytest.raises(SubnetExhausted):
            await acquire(stores(), "omicron2", cluster=small)
        assert (await client.get(b"/agentd/subnets/10.244.2.0-24")).value == b"[]"


# -- leaving -----------------------------------------------------------------------------------


async def test_release_and_remove_node_remove_exactly_that_nodes_keys(etcd_server, stores):  # noqa: F811
    a, b = stores(), stores()
    await a.ensure_cluster_config(CLUSTER)
    held = {}
    for ds, name in ((a, "pi"), (b, "rho")):
        held[name] = await acquire(ds, name)
        await ds.register_node(node_record(name, held[name].subnet))
    async with raw(etcd_server) as client:
        before = await keys(client)
        assert len(before) == 5

        assert await a.release("pi") == [held["pi"].subnet]
        await a.remove_node("pi")
        after = await keys(client)
        pi_keys = {b"/agentd/nodes/pi", f"/agentd/subnets/{held['pi'].subnet.network_address}-24".encode()}
        assert set(after) == set(before) - pi_keys
        assert a.lease_id is None and a.subnet_lease is None and a.node is None

        # `agentd leave` from a fresh process, for a node whose daemon has stopped.
        await b.close()
        leave = stores()
        assert await leave.release("rho") == [held["rho"].subnet]
        assert await leave.remove_node("rho") is True
        assert set(await keys(client)) == {b"/agentd/config"}


async def test_a_reserved_subnet_outlives_its_nodes_lease_and_leave(etcd_server, stores):
    """flannel's reservations (a subnet record naming the node under no etcd lease): kappa's,
    put before it starts, and lambda's, its held lease turned into one by `etcdctl put` of the
    same value without --lease.  Both were put under the node's lease again (at acquire, at
    the next keepalive) and expired with it: another node took the reserved subnet.  Now they
    stay under no lease through acquire, keepalives, the nodes' leases running out and a
    leave; a third node finds no free subnet, and kappa gets its own back."""
    reserved = IPv4Network("10.244.77.0/24")
    kappa_key = f"/agentd/subnets/{reserved.network_address}-24".encode()
    async with raw(etcd_server) as client:
        await client.put(kappa_key, json.dumps({"node": "kappa", "public_ip": "192.0.2.10",
                                                "backend_type": "vxlan"}).encode())
        kappa, lam = stores(lease_ttl=SHORT_TTL), stores(lease_ttl=SHORT_TTL)
        got = await acquire(kappa, "kappa")
        assert got.subnet == reserved and got.lease_id is None
        await kappa.register_node(node_record("kappa", got.subnet))
        stored = await client.get(kappa_key)
        assert stored.lease == 0 and json.loads(stored.value)["backend_data"] == {"vtep_mac": "02:00:00:00:00:01"}

        held = await acquire(lam, "lambda", cluster=ClusterConfig(IPv4Network("10.244.76.0/24"), 24, "vxlan",
                                                                   "always"))
        await lam.register_node(node_record("lambda", held.subnet, address="192.0.2.11"))
        lam_key = f"/agentd/subnets/{held.subnet.network_address}-24".encode()
        assert (await client.get(lam_key)).lease == lam.lease_id
        await client.put(lam_key, (await client.get(lam_key)).value)  # the operator's conversion
        renewals = lam.lease_renewals
        await eventually(lambda: lam.lease_renewals >= renewals + 3, what="three keepalive rounds")
        assert (await client.get(lam_key)).lease == 0 and lam.subnet_lease.lease_id is None

        await kappa.close()  # down longer than the lease: it runs out, nothing revoked
        await lam.close()
        await eventually(lambda: _gone(client, b"/agentd/nodes/"), timeout=SHORT_TTL + 30, what="node records expired")
        assert {k: (kv.lease, json.loads(kv.value)["node"]) for k, kv in (await keys(client, b"/agentd/subnets/")).items()
                } == {kappa_key: (0, "kappa"), lam_key: (0, "lambda")}

        # Only the two reserved subnets in mu's pool: none is free.
        pool = ClusterConfig(IPv4Network("10.244.76.0/23"), 24, "vxlan", "always")
        with pytest.raises(SubnetExhausted):
            await acquire(stores(), "mu", cluster=pool)

        back = stores()
        assert (await acquire(back, "kappa")).subnet == reserved
        assert await back.release("kappa") == []  # a leave keeps it, as flannel never deletes one
        kv = await client.get(kappa_key)
        assert kv is not None and kv.lease == 0 and json.loads(kv.value)["node"] == "kappa"


async def _gone(client: aetcd.Client, prefix: bytes) -> bool:
    return not await keys(client, prefix)


# -- the harness itself ---------------------------------------------------------------------------


async def test_etcd_server_in_a_namespace_keeps_data_across_kill_and_restart(tmp_path, netns_factory):
    ns = netns_factory("etcd")
    server = EtcdServer(str(tmp_path / "data"), netns=ns)
    # A client inside the namespace, as agents in the lab are.
    script = (
        "import asyncio, sys, aetcd\n"
        "async def main():\n"
        f"    async with aetcd.Client('127.0.0.1', {server.client_port}, timeout=5) as c:\n"
        "        if sys.argv[1] == 'put':\n"
        "            await c.put(b'/agentd/probe', b'kept')\n"
        "        else:\n"
        "            print((await c.get(b'/agentd/probe')).value.decode())\n"
        "asyncio.run(main())\n"
    )
    try:
        await server.start()
        assert server.running and server.pid in ns.pids()
        with socket.socket() as probe:  # it listens on the namespace's loopback, not ours
            assert probe.connect_ex(("127.0.0.1", server.client_port)) != 0
        await ns.aexec(sys.executable, "-c", script, "put")
        await server.kill()  # a crash
        assert not server.running and server.pid is None
        await server.start()  # same data dir, same ports
        _, out, _ = await ns.aexec(sys.executable, "-c", script, "get")
        assert out.decode().strip() == "kept"
        await server.stop()
        assert not server.running
        with open(server.log_path) as log:
            assert log.read().count("agentd lab: starting etcd") == 2
    finally:
        await server.stop()


async def test_backend_data_is_published_in_the_subnet_lease(etcd_server, stores):  # noqa: F811
    ds = stores()
    lease = await acquire(ds, "alpha")
    data = {"type": "vxlan", "vtep_mac": "02:aa:bb:cc:dd:ee", "vni": 1, "port": 4789}
    assert await ds.set_subnet_backend_data(data)
    got = await ds.get_subnet_lease(lease.subnet)
    assert got is not None and got.backend_data == data and got.lease_id == lease.lease_id
    assert not await ds.set_subnet_backend_data(data)  # unchanged: nothing written
    # Someone else's record now (the lease was lost and the subnet re-leased): never overwritten.
    key = f"/agentd/subnets/{lease.subnet.network_address}-24"
    async with raw(etcd_server) as client:
        await client.put(key.encode(), b'{"node": "beta", "public_ip": "192.0.2.11", "backend_type": "vxlan", "backend_data": {}}')
    assert not await ds.set_subnet_backend_data({**data, "vtep_mac": "02:00:00:00:00:99"})
    got = await ds.get_subnet_lease(lease.subnet)
    assert got is not None and got.node == "beta"


# -- dual-stack: one subnet of each family, under one lease --------------------------------

DUAL = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "vxlan", "always", ip_family="dual",
                     cidr_v6=IPv6Network("fd00:10:244::/48"), subnet_len_v6=64)


async def test_dual_stack_leases_restarts_revocation_and_release(etcd_server, stores):  # noqa: F811
    # An IPv4 cluster becomes dual-stack when a dual-stack node joins (compare-and-swap that
    # adds only the IPv6 fields); an IPv6-only node does not change it.
    assert await stores().ensure_cluster_config(CLUSTER, timeout=10) == CLUSTER
    assert (await stores().ensure_cluster_config(
        ClusterConfig(IPv4Network("10.9.0.0/16"), 24, "vxlan", "always", ip_family="ipv6",
                      cidr_v6=IPv6Network("fd00:9::/48"), subnet_len_v6=64), timeout=10)) == CLUSTER
    upgraded = await stores().ensure_cluster_config(
        ClusterConfig(IPv4Network("10.9.0.0/16"), 20, "host-gw", "always", ip_family="dual",
                      cidr_v6=IPv6Network("fd00:10:244::/48"), subnet_len_v6=64), timeout=10)
    assert upgraded == DUAL  # the IPv4 part stays as stored
    assert await stores().get_cluster_config(timeout=10) == DUAL

    first = stores()
    v4 = await acquire(first, "alpha", cluster=DUAL)
    v6 = await first.acquire_subnet("alpha", IPv4Address("192.0.2.10"), "vxlan", {}, cluster=DUAL, timeout=30,
                                    version=6)
    assert v6.subnet.prefixlen == 64 and v6.subnet.subnet_of(IPv6Network("fd00:10:244::/48"))
    assert set(first.subnet_leases) == {4, 6} and first.subnet_lease == v4
    key6 = f"/agentd/subnets/{v6.subnet.network_address}-64".encode()
    async with raw(etcd_server) as client:
        stored = await keys(client)
        assert stored[key6].lease == first.lease_id == stored[f"/agentd/subnets/{v4.subnet.network_address}-24".encode()].lease
    # A second node's IPv6 subnet is another one; claiming the first node's is impossible.
    other = stores()
    theirs = await other.acquire_subnet("beta", IPv4Address("192.0.2.11"), "vxlan", {}, cluster=DUAL, timeout=30,
                                        version=6, previous=v6.subnet)
    assert theirs.subnet != v6.subnet
    # A revoked lease: both subnets come back under the new one.
    async with raw(etcd_server) as client:
        old = first.lease_id
        await client.revoke_lease(old)

        async def both_back():
            stored = await keys(client)
            return first.lease_id not in (None, old) and all(
                stored.get(k) is not None and stored[k].lease == first.lease_id
                for k in (key6, f"/agentd/subnets/{v4.subnet.network_address}-24".encode()))

        await eventually(both_back, what="both subnets back under a new lease")
    await first.close()
    # A restart: each family's subnet from etcd's records (no subnet file), one key each.
    second = stores()
    assert (await acquire(second, "alpha", cluster=DUAL)).subnet == v4.subnet
    assert (await second.acquire_subnet("alpha", IPv4Address("192.0.2.10"), "vxlan", {}, cluster=DUAL, timeout=30,
                                        version=6)).subnet == v6.subnet
    held = sorted((s for s, sl in (await second.list_subnets()).items() if sl.node == "alpha"), key=str)
    assert held == sorted([v4.subnet, v6.subnet], key=str)
    # Leave: both released in one transaction.
    assert sorted(await second.release("alpha", timeout=10), key=str) == held
    async with raw(etcd_server) as client:
        stored = await keys(client)
    assert key6 not in stored and f"/agentd/subnets/{v4.subnet.network_address}-24".encode() not in stored
    assert [sl.node for sl in (await second.list_subnets()).values()] == ["beta"]


async def test_resources_over_grpcs_4_mib_default_load_as_one_snapshot(etcd_server, stores):
    """Five ConfigMaps of ~1 MB each (every write under etcd's 1.5 MiB --max-request-bytes):
    the watch's snapshot of <prefix>/resources/ and a list are one Range reply of > 4 MiB,
    gRPC's default receive limit; before, both failed for ever as "etcd unreachable"."""
    from agentd.resources import kinds
    from agentd.resources.store import ResourceStore

    ds = stores()
    await ds.connect(timeout=10)
    rs = ResourceStore(ds, timeout=10)
    big = "x" * 1_000_000
    for i in range(5):
        await rs.apply([kinds.validate({"apiVersion": "v1", "kind": "ConfigMap",
                                        "metadata": {"name": f"cm{i}", "namespace": "default"}, "data": {"k": big}})])
    listed = await asyncio.wait_for(rs.list(kinds.CONFIG_MAP), 20)
    assert sorted(o["metadata"]["name"] for o in listed) == [f"cm{i}" for i in range(5)]

    async def first_event():
        async for ev in rs.watch():
            return ev

    ev = await asyncio.wait_for(first_event(), 20)
    assert ev.kind == "snapshot"
    assert sorted(k[2] for k in ev.objects if k[0] == "ConfigMap") == [f"cm{i}" for i in range(5)]
    assert all(o["data"]["k"] == big for o in ev.objects.values())
