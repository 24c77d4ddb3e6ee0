"""The datastore's etcd transactions and the lease keeper's restoring of our keys against an
in-memory etcd (FakeEtcd below: keys with versions, revisions and leases; compares of
Version, Value and Mod; a reply that can be lost after the write committed, as a request
timing out does).  Against a real etcd: tests/system/test_datastore.py."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Network
from pathlib import Path
from types import SimpleNamespace

import aetcd
import grpc
import pytest
from aetcd import transactions as tx

from agentd.datastore.connection import EtcdConnection
from agentd.datastore.etcd import parse_endpoint
from agentd.datastore.leases import SubnetLeases
from agentd.datastore.liveness import LeaseKeeper
from agentd.datastore.records import (
    Backoff,
    ClusterConfig,
    NodeRecord,
    SubnetExhausted,
    SubnetLease,
    config_key,
    node_key,
    subnet_key,
)
from agentd.datastore.registration import Registration

PREFIX = "/agentd"
X = IPv4Network("10.244.1.0/24")


@dataclass
class KV:
    key: bytes
    value: bytes
    lease: int
    mod_revision: int
    version: int
    create_revision: int = 0


def lease_not_found() -> Exception:
    return grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="etcdserver: requested lease not found")


class FakeEtcd:
    """What the datastore asks of aetcd, in memory.  ``lose_reply``: names of calls whose next
    reply is lost after the change was made (a transient error instead)."""

    def __init__(self) -> None:
        self.kvs: dict[bytes, KV] = {}
        self.revision = 1
        self.leases: set[int] = set()
        self.next_lease = 0x100
        self.lose_reply: set[str] = set()
        self.calls: list[str] = []
        self.before_transaction: list[Callable[[], None]] = []  # another client's change, one per transaction
        self.silent = False  # a member cut off: requests get no answer
        self.puts: list[bytes] = []  # every key written, in order (a put or a transaction's)

    async def _answer(self) -> None:
        if self.silent:
            await asyncio.get_running_loop().create_future()  # never answered

    def _reply(self, what: str, result):
        self.calls.append(what)
        if what in self.lose_reply:
            self.lose_reply.discard(what)
            raise aetcd.ConnectionTimeoutError("request timed out")
        return result

    def _put(self, key: bytes, value: bytes, lease: int | None) -> None:
        if lease and lease not in self.leases:
            raise lease_not_found()
        self.revision += 1
        self.puts.append(key)
        old = self.kvs.get(key)
        self.kvs[key] = KV(key, value, lease or 0, self.revision, (old.version if old else 0) + 1,
                           old.create_revision if old else self.revision)

    def _delete(self, key: bytes) -> bool:
        if key not in self.kvs:
            return False
        self.revision += 1
        del self.kvs[key]
        return True

    def _get(self, key: bytes, range_end: bytes | None = None) -> list:
        if range_end is None:
            return [(kv.value, kv) for kv in [self.kvs.get(key)] if kv is not None]
        return [(kv.value, kv) for k, kv in sorted(self.kvs.items()) if key <= k < range_end]

    def _holds(self, compare) -> bool:
        kv = self.kvs.get(compare.key)
        actual = {
            tx.Version: kv.version if kv else 0,
            tx.Value: kv.value if kv else None,
            tx.Mod: kv.mod_revision if kv else 0,
        }[type(compare)]
        assert compare.op == aetcd.rpc.Compare.EQUAL
        return actual == compare.value

    def _op(self, op):
        if isinstance(op, tx.Get):
            return self._get(op.key, op.range_end)
        if isinstance(op, tx.Put):
            return self._put(op.key, op.value, op.lease)
        return self._delete(op.key)

    # -- the client's calls --------------------------------------------------------------

    async def lease(self, ttl: int):
        self.next_lease += 1
        self.leases.add(self.next_lease)
        return self._reply("lease", SimpleNamespace(id=self.next_lease, ttl=ttl))

    async def refresh_lease(self, lease_id: int):
        return self._reply("refresh_lease", SimpleNamespace(TTL=30 if lease_id in self.leases else 0))

    async def revoke_lease(self, lease_id: int):
        if lease_id not in self.leases:
            raise lease_not_found()
        self.leases.discard(lease_id)
        for key in [k for k, kv in self.kvs.items() if kv.lease == lease_id]:
            self._delete(key)
        return self._reply("revoke_lease", None)

    def expire(self, lease_id: int) -> None:
        """etcd expires the lease: its keys go."""
        self.leases.discard(lease_id)
        for key in [k for k, kv in self.kvs.items() if kv.lease == lease_id]:
            self._delete(key)

    async def get(self, key: bytes):
        await self._answer()
        return self._reply("get", self.kvs.get(key))

    async def put(self, key: bytes, value: bytes, lease: int | None = None):
        self._put(key, value, lease)
        return self._reply("put", None)

    async def delete(self, key: bytes):
        return self._reply("delete", True if self._delete(key) else None)

    async def transaction(self, compare, success=None, failure=None):
        await self._answer()
        if self.before_transaction:
            self.before_transaction.pop(0)()
        ok = all(self._holds(c) for c in compare)
        responses = [self._op(o) for o in ((success if ok else failure) or [])]
        return self._reply("transaction", (ok, responses))


def connection(client: FakeEtcd, request_timeout: float = 5.0) -> EtcdConnection:
    conn = EtcdConnection([parse_endpoint("http://127.0.0.1:2379")], clock=lambda: 0.0, request_timeout=request_timeout,
                          rng=random.Random(7))
    conn._current = client  # type: ignore[assignment]  # every request goes to the fake
    conn.backoff = lambda cap=5.0: Backoff(initial=1e-6, cap=1e-6, rng=random.Random(1))  # retries at once
    return conn


def node(name: str, subnet: IPv4Network | None = X) -> NodeRecord:
    return NodeRecord(name=name, address="192.0.2.1", asn=64512, subnet=subnet, route_reflector=False,
                      cluster_id=None)


def lease_of(name: str, lease_id: int | None = None, **backend) -> SubnetLease:
    return SubnetLease(subnet=X, node=name, public_ip="192.0.2.1", backend_type="vxlan",
                       backend_data=dict(backend), lease_id=lease_id)


# --- the keeper restoring our keys ----------------------------------------------------------


async def test_a_node_that_lost_its_subnet_does_not_put_its_record_back_with_it():
    """A cut off longer than lease_ttl: its lease expired (node record and subnet key gone),
    B took the subnet.  Back, A's keeper grants a new lease and finds the subnet B's; the
    node record it puts back must not name the subnet, or other nodes refuse B's route to it."""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    lost: list[SubnetLease] = []
    keeper.subnet_lost_callback = lambda: lost.append
    old = 0x11
    etcd.leases.add(old)
    keeper.node, keeper.subnet = node("A"), lease_of("A", old)
    etcd._put(node_key(PREFIX, "A"), keeper.node.to_json(), old)
    etcd._put(subnet_key(PREFIX, X), lease_of("A").to_json(), old)
    etcd.expire(old)
    etcd.leases.add(0x99)
    etcd._put(subnet_key(PREFIX, X), lease_of("B").to_json(), 0x99)

    async with keeper.lock:
        await keeper._restore_keys(etcd)

    assert [lease.subnet for lease in lost] == [X] and keeper.subnets == {}
    stored = NodeRecord.from_json(etcd.kvs[node_key(PREFIX, "A")].value)
    assert stored.subnet is None and keeper.node is not None and keeper.node.subnet is None
    assert etcd.kvs[node_key(PREFIX, "A")].lease == keeper.lease_id != old
    async with keeper.lock:  # and the next round leaves it so
        await keeper._restore_keys(etcd)
    assert NodeRecord.from_json(etcd.kvs[node_key(PREFIX, "A")].value).subnet is None



def _expired_holder(etcd: FakeEtcd, keeper: LeaseKeeper, subnet: IPv4Network) -> None:
    """``keeper`` held ``subnet`` (and its node record) under lease 0x11, which expired."""
    etcd.leases.add(0x11)
    keeper.lease_id = 0x11
    keeper.node = node("A", subnet)
    keeper.subnet = dataclasses.replace(lease_of("A", 0x11), subnet=subnet)
    etcd._put(node_key(PREFIX, "A"), keeper.node.to_json(), 0x11)
    etcd._put(subnet_key(PREFIX, subnet), dataclasses.replace(lease_of("A"), subnet=subnet).to_json(), 0x11)
    etcd.expire(0x11)
    keeper.lease_id = None  # its refresh found it gone


def _subnet_keys(etcd: FakeEtcd) -> list[bytes]:
    return sorted(k for k in etcd.kvs if k.startswith(b"/agentd/subnets/"))


async def test_a_subnet_re_taken_inside_a_wider_lease_made_while_the_lease_was_gone_is_lost():
    """The cluster's subnet_len went from 24 to 23 while A (its /24) was cut off longer than the
    TTL; B leased the /23 around A's /24.  The keeper's re-take checked only that the /24's own
    key was free: A ran on with a subnet inside B's.  The earlier key holds: A's is lost."""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    lost: list[SubnetLease] = []
    keeper.subnet_lost_callback = lambda: lost.append
    _expired_holder(etcd, keeper, X)
    _wide_lease(etcd)  # B: 10.244.0.0/23, around X
    before = len(etcd.puts)

    async with keeper.lock:
        await keeper._restore_keys(etcd)

    assert [lease.subnet for lease in lost] == [X] and keeper.subnets == {}
    assert _subnet_keys(etcd) == [subnet_key(PREFIX, WIDE)] and subnet_key(PREFIX, X) not in etcd.puts[before:]
    assert NodeRecord.from_json(etcd.kvs[node_key(PREFIX, "A")].value).subnet is None


async def test_a_wider_subnet_re_taken_around_a_narrower_lease_made_while_the_lease_was_gone_is_lost():
    """The other way round: A held a /23, B (its cluster record saying /24) leased a /24 inside
    it while A's lease was gone.  The claim checks no narrower keys, so A's re-take wins; the
    read after it finds B's earlier /24, and A gives the /23 up again: lost."""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    lost: list[SubnetLease] = []
    keeper.subnet_lost_callback = lambda: lost.append
    _expired_holder(etcd, keeper, WIDE)
    etcd.leases.add(0x99)
    etcd._put(subnet_key(PREFIX, X), lease_of("B").to_json(), 0x99)

    async with keeper.lock:
        await keeper._restore_keys(etcd)

    assert [lease.subnet for lease in lost] == [WIDE] and keeper.subnets == {}
    assert _subnet_keys(etcd) == [subnet_key(PREFIX, X)]
    assert NodeRecord.from_json(etcd.kvs[node_key(PREFIX, "A")].value).subnet is None


async def test_a_record_put_under_a_new_lease_before_the_subnet_was_found_lost_no_longer_names_it():
    """A's lease expired, B took its subnet; an update_node (new node data) ran before the
    keepalive's round: it granted a new lease and put the record, naming the subnet, under it.
    The round then found the subnet lost but left that record as it was (only a missing record
    was put back): two records named the subnet, and other nodes trusted neither."""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    lost: list[SubnetLease] = []
    keeper.subnet_lost_callback = lambda: lost.append
    _expired_holder(etcd, keeper, X)
    keeper.lease_id = 0x11  # not yet found gone: update_node finds it so
    etcd.leases.add(0x99)
    etcd._put(subnet_key(PREFIX, X), lease_of("B").to_json(), 0x99)
    registration = Registration(keeper.connection, keeper, PREFIX)
    await registration.update_node(dataclasses.replace(node("A"), backend={"vtep_mac": "02:00:00:00:00:01"}))
    await keeper.stop()
    assert NodeRecord.from_json(etcd.kvs[node_key(PREFIX, "A")].value).subnet == X

    async with keeper.lock:
        await keeper._restore_keys(etcd)

    assert [lease.subnet for lease in lost] == [X]
    stored = NodeRecord.from_json(etcd.kvs[node_key(PREFIX, "A")].value)
    assert stored.subnet is None and stored.backend == {"vtep_mac": "02:00:00:00:00:01"}
    assert etcd.kvs[node_key(PREFIX, "A")].lease == keeper.lease_id


async def test_a_record_made_before_the_subnet_was_found_lost_is_registered_without_it():
    """The other order: the round found the subnet lost; an update_node whose record was made
    before (waiting for the lock, or retried while etcd was unreachable) put it back naming it."""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    lost: list[SubnetLease] = []
    keeper.subnet_lost_callback = lambda: lost.append
    _expired_holder(etcd, keeper, X)
    etcd.leases.add(0x99)
    etcd._put(subnet_key(PREFIX, X), lease_of("B").to_json(), 0x99)
    async with keeper.lock:
        await keeper._restore_keys(etcd)
    assert [lease.subnet for lease in lost] == [X]

    await Registration(keeper.connection, keeper, PREFIX).update_node(node("A"))  # made with X
    await keeper.stop()
    assert NodeRecord.from_json(etcd.kvs[node_key(PREFIX, "A")].value).subnet is None
    assert keeper.node is not None and keeper.node.subnet is None


async def test_our_keys_under_the_lease_of_a_restored_backup_are_taken_over():
    """etcd restored from a backup taken before A's last restart: A's record and subnet key are
    back under A's previous lease, which nobody refreshes; A's lease is not there.  The keeper
    left them alone ("another agent with the same node name?") until that lease expired and
    took them with it: meanwhile the subnet was free to take, then A's routes dropped."""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    lost: list[SubnetLease] = []
    keeper.subnet_lost_callback = lambda: lost.append
    etcd.leases.add(0x11)  # the snapshot's
    etcd._put(node_key(PREFIX, "A"), node("A").to_json(), 0x11)
    etcd._put(subnet_key(PREFIX, X), lease_of("A").to_json(), 0x11)
    keeper.node, keeper.subnet = node("A"), lease_of("A", 0x22)  # 0x22: not in the snapshot

    async with keeper.lock:
        await keeper._restore_keys(etcd)

    assert keeper.lease_id not in (None, 0x11, 0x22)
    assert {k: kv.lease for k, kv in etcd.kvs.items()} == {node_key(PREFIX, "A"): keeper.lease_id,
                                                         subnet_key(PREFIX, X): keeper.lease_id}
    assert keeper.subnet.lease_id == keeper.lease_id and lost == []
    etcd.expire(0x11)  # nobody refreshes it
    assert set(etcd.kvs) == {node_key(PREFIX, "A"), subnet_key(PREFIX, X)}


async def test_our_keys_taken_back_under_the_lease_we_took_them_from_are_left_to_that_agent(caplog):
    """Another agent with our name and our addresses (which a backup's lease cannot be told
    from at first): taken over once, and once it writes them again under its lease -- which no
    backup's lease does -- left to it, the conflict logged."""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    etcd.leases.update({0x11, 0x99})
    keeper.lease_id = 0x11
    keeper.node, keeper.subnet = node("A"), lease_of("A", 0x11)

    def rewrite() -> None:  # the other agent takes them back
        etcd._put(node_key(PREFIX, "A"), node("A").to_json(), 0x99)
        etcd._put(subnet_key(PREFIX, X), lease_of("A").to_json(), 0x99)

    rewrite()
    async with keeper.lock:
        await keeper._restore_keys(etcd)
    assert {kv.lease for kv in etcd.kvs.values()} == {0x11}  # taken over
    rewrite()
    with caplog.at_level("ERROR", logger="agentd"):
        async with keeper.lock:
            for _ in range(3):
                await keeper._restore_keys(etcd)
    assert {kv.lease for kv in etcd.kvs.values()} == {0x99}  # left alone since
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2 and all("another agent" in e for e in errors)


async def test_our_keys_rewritten_by_another_agent_every_round_are_remembered_once_each(caplog):
    """Another agent with our node name (on another host: its address not ours) keeps rewriting
    our node record and subnet key under its own lease: the keeper logs the conflict at each new
    revision, and remembers only the last one per key -- not every (key, revision) met, which
    grew with each keepalive round."""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    etcd.leases.update({0x11, 0x99})
    keeper.lease_id = 0x11
    keeper.node, keeper.subnet = node("A"), lease_of("A", 0x11)
    theirs = dataclasses.replace(node("A"), address=IPv4Address("192.0.2.9"))

    def rewrite() -> None:  # the other agent, between two of our rounds
        etcd._put(node_key(PREFIX, "A"), theirs.to_json(), 0x99)
        etcd._put(subnet_key(PREFIX, X), dataclasses.replace(lease_of("A"), public_ip="192.0.2.9").to_json(), 0x99)

    rounds = 20_000
    etcd.before_transaction += [rewrite] * rounds
    with caplog.at_level("ERROR", logger="agentd"):
        async with keeper.lock:
            for _ in range(rounds):
                await keeper._restore_keys(etcd)
            assert len(caplog.records) == 2 * rounds  # each new revision of each key said
            caplog.clear()
            await keeper._restore_keys(etcd)  # no rewrite since: nothing new to say
    assert caplog.records == []
    assert len(keeper._reported_conflicts) <= 2  # at most one entry per key
    assert etcd.kvs[node_key(PREFIX, "A")].lease == 0x99  # and left alone
    keeper.subnets = {}  # the subnet no longer ours: its key forgotten
    async with keeper.lock:
        await keeper._restore_keys(etcd)
    assert list(keeper._reported_conflicts) == [node_key(PREFIX, "A")]


async def test_a_subnet_re_taken_by_a_claim_whose_reply_was_lost_gets_its_backend_data_published():
    """The keepalive re-takes our subnet under the new lease, the reply is lost; the next
    round finds the key ours under that lease.  The subnet must then carry that lease's ID,
    or the rewrite of its backend data puts under the expired lease ("lease not found")."""
    etcd = FakeEtcd()
    conn = connection(etcd)
    keeper = LeaseKeeper(conn, PREFIX, 30)
    keeper.subnet = lease_of("A", 0x11)  # 0x11 expired: the subnet key went with it
    etcd.before_transaction += [lambda: None, lambda: etcd.lose_reply.add("transaction")]  # the read, the claim
    async with keeper.lock:
        with pytest.raises(aetcd.ConnectionTimeoutError):
            await keeper._restore_keys(etcd)
        await keeper._restore_keys(etcd)  # the next round

    leases = SubnetLeases(conn, keeper, PREFIX, random.Random(1))
    assert await leases.set_subnet_backend_data({"vtep_mac": "02:00:00:00:00:01"})
    stored = SubnetLease.from_json(etcd.kvs[subnet_key(PREFIX, X)].value, X, 0)
    assert stored.backend_data == {"vtep_mac": "02:00:00:00:00:01"}
    assert etcd.kvs[subnet_key(PREFIX, X)].lease == keeper.lease_id == keeper.subnet.lease_id


async def test_backend_data_not_written_is_written_by_the_next_call():
    """A rewrite that failed left the new data in the keeper as if published: the next call
    with the same data did nothing."""
    etcd = FakeEtcd()
    conn = connection(etcd)
    keeper = LeaseKeeper(conn, PREFIX, 30)
    etcd.leases.add(0x11)
    keeper.subnet = lease_of("A", 0x11)
    etcd._put(subnet_key(PREFIX, X), lease_of("A").to_json(), 0x11)
    leases = SubnetLeases(conn, keeper, PREFIX, random.Random(1))

    def refuse() -> None:
        raise aetcd.PreconditionFailedError("refused")

    etcd.before_transaction.append(refuse)
    with pytest.raises(aetcd.PreconditionFailedError):
        await leases.set_subnet_backend_data({"vtep_mac": "02:00:00:00:00:01"})
    assert keeper.subnet.backend_data == {}
    assert await leases.set_subnet_backend_data({"vtep_mac": "02:00:00:00:00:01"})
    stored = SubnetLease.from_json(etcd.kvs[subnet_key(PREFIX, X)].value, X, 0)
    assert stored.backend_data == keeper.subnet.backend_data == {"vtep_mac": "02:00:00:00:00:01"}


async def test_backend_data_set_while_the_lease_is_gone_is_what_the_keepalive_puts_back():
    """Our lease expired (an etcd outage longer than its TTL): the subnet record went with it.
    The backend came up meanwhile (at start-up: its VTEP MAC); set_subnet_backend_data found no
    record to rewrite, the keeper kept the old (empty) data, and the keepalive put the record
    back without the MAC until the next change.  Now the keeper holds the new data and the
    restore writes it."""
    etcd = FakeEtcd()
    conn = connection(etcd)
    keeper = LeaseKeeper(conn, PREFIX, 30)
    etcd.leases.add(0x11)
    keeper.lease_id, keeper.subnet = 0x11, lease_of("A", 0x11)
    etcd._put(subnet_key(PREFIX, X), lease_of("A").to_json(), 0x11)
    etcd.expire(0x11)
    leases = SubnetLeases(conn, keeper, PREFIX, random.Random(1))

    assert await leases.set_subnet_backend_data({"vtep_mac": "02:00:00:00:00:01"}) is False  # nothing to rewrite
    keeper.lease_gone(0x11)  # the keepalive's refresh finds it gone
    async with keeper.lock:
        await keeper._restore_keys(etcd)

    kv = etcd.kvs[subnet_key(PREFIX, X)]
    assert SubnetLease.from_json(kv.value, X, 0).backend_data == {"vtep_mac": "02:00:00:00:00:01"}
    assert kv.lease == keeper.lease_id != 0x11
    assert keeper.subnet.backend_data == {"vtep_mac": "02:00:00:00:00:01"}


async def test_our_subnet_record_put_back_with_stale_backend_data_is_rewritten():
    """Our record under our lease, but not with what the keeper holds (put back with stale
    data): the keepalive's next round rewrites it."""
    etcd = FakeEtcd()
    conn = connection(etcd)
    keeper = LeaseKeeper(conn, PREFIX, 30)
    etcd.leases.add(0x11)
    keeper.lease_id, keeper.subnet = 0x11, lease_of("A", 0x11, vtep_mac="02:00:00:00:00:01")
    etcd._put(subnet_key(PREFIX, X), lease_of("A").to_json(), 0x11)
    async with keeper.lock:
        await keeper._restore_keys(etcd)
    kv = etcd.kvs[subnet_key(PREFIX, X)]
    assert SubnetLease.from_json(kv.value, X, 0).backend_data == {"vtep_mac": "02:00:00:00:00:01"}
    assert kv.lease == 0x11
    calls = len(etcd.calls)
    async with keeper.lock:  # and the round after it writes nothing
        await keeper._restore_keys(etcd)
    assert etcd.calls[calls:] == ["transaction"]  # the read only


# --- our keys edited by hand (etcdctl put: lease 0; --ignore-lease: still ours) -------------------

UNREADABLE_SUBNET = [b'{"node": "A", "public_ip": 5}', b"not json", b""]


READABLE_OTHER = dataclasses.replace(lease_of("A"), public_ip="192.0.2.9").to_json()


@pytest.mark.parametrize(("edited_lease", "value"), [("ours", v) for v in [*UNREADABLE_SUBNET, READABLE_OTHER]]
                         + [("none", v) for v in UNREADABLE_SUBNET])
async def test_our_subnet_key_edited_by_hand_is_rewritten_not_lost(edited_lease, value, caplog):
    """Our subnet key given another value by hand, under our lease (`etcdctl put
    --ignore-lease`) or, unreadable, under none (a plain `etcdctl put`).  An unreadable one
    counted as "another node's": the keeper gave a working subnet up (on_subnet_lost: the agent
    exits, and takes a new subnet when restarted -- every pod recreated) and, under lease 0,
    the key never went.  No agent writes under our lease but us, nor under none: the key,
    unreadable or naming us, is ours whatever it holds, and the keepalive writes it back.
    (A readable record naming us under no lease is a reservation: kept so, below.)"""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    lost: list[SubnetLease] = []
    keeper.subnet_lost_callback = lambda: lost.append
    etcd.leases.add(0x42)
    keeper.lease_id, keeper.node, keeper.subnet = 0x42, node("A"), lease_of("A", 0x42)
    etcd._put(node_key(PREFIX, "A"), keeper.node.to_json(), 0x42)
    etcd._put(subnet_key(PREFIX, X), lease_of("A").to_json(), 0x42)
    etcd._put(subnet_key(PREFIX, X), value, 0x42 if edited_lease == "ours" else 0)

    with caplog.at_level("WARNING", logger="agentd.datastore"):
        async with keeper.lock:
            await keeper._restore_keys(etcd)

    assert lost == [] and keeper.subnets == {4: lease_of("A", 0x42)} and keeper.lost == set()
    kv = etcd.kvs[subnet_key(PREFIX, X)]
    assert (kv.value, kv.lease) == (lease_of("A").to_json(), 0x42)
    assert NodeRecord.from_json(etcd.kvs[node_key(PREFIX, "A")].value).subnet == X
    assert keeper.node is not None and keeper.node.subnet == X
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "rewritten" in said[0] and "ERROR" not in [r.levelname for r in caplog.records], said
    calls = len(etcd.calls)
    async with keeper.lock:  # and the round after it writes nothing
        await keeper._restore_keys(etcd)
    assert etcd.calls[calls:] == ["transaction"]


@pytest.mark.parametrize(("value", "lease"), [(b"not json", 0x99), (lease_of("B").to_json(), 0),
                                              (lease_of("B").to_json(), 0x42)])
async def test_our_subnet_key_naming_another_node_or_unreadable_under_another_lease_is_lost(value, lease):
    """Not ours, as before: an unreadable value under another agent's lease, and a record
    naming another node under any lease (its claim, or an assignment by hand: a flannel
    reservation names its node so)."""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    lost: list[SubnetLease] = []
    keeper.subnet_lost_callback = lambda: lost.append
    etcd.leases.update({0x42, 0x99})
    keeper.lease_id, keeper.node, keeper.subnet = 0x42, node("A"), lease_of("A", 0x42)
    etcd._put(node_key(PREFIX, "A"), keeper.node.to_json(), 0x42)
    etcd._put(subnet_key(PREFIX, X), value, lease)
    async with keeper.lock:
        await keeper._restore_keys(etcd)
    assert [lease.subnet for lease in lost] == [X]
    assert etcd.kvs[subnet_key(PREFIX, X)].value == value


@pytest.mark.parametrize("edited_lease", ["ours", "none"])
@pytest.mark.parametrize("value", [
    b'{"name": "A", "address": "192.0.2.1", "asn": "64512", "subnet": "10.244.1.0/24", "route_reflector": false}',
    b"not json",
    dataclasses.replace(node("A"), address=IPv4Address("192.0.2.9")).to_json(),  # readable, not as we are
    dataclasses.replace(node("A"), asn=64999).to_json(),
])
async def test_our_node_record_edited_by_hand_is_rewritten(edited_lease, value):
    """Our node record given another value by hand.  Under lease 0 (a plain `etcdctl put`) an
    unreadable one counted as "held under another etcd lease: another agent with our name?"
    and was left alone for good -- the key never expires, and every other node took the
    unreadable put for a delete (BGP Cease, our pods' routes withdrawn).  Under our lease or
    none it is ours: written back as we publish it, under our lease."""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    etcd.leases.add(0x42)
    keeper.lease_id, keeper.node, keeper.subnet = 0x42, node("A"), lease_of("A", 0x42)
    etcd._put(subnet_key(PREFIX, X), lease_of("A").to_json(), 0x42)
    etcd._put(node_key(PREFIX, "A"), value, 0x42 if edited_lease == "ours" else 0)

    async with keeper.lock:
        await keeper._restore_keys(etcd)

    kv = etcd.kvs[node_key(PREFIX, "A")]
    assert (kv.value, kv.lease) == (node("A").to_json(), 0x42)
    calls = len(etcd.calls)
    async with keeper.lock:  # and the round after it writes nothing
        await keeper._restore_keys(etcd)
    assert etcd.calls[calls:] == ["transaction"]


async def test_our_node_record_taken_over_from_lease_0_is_taken_again_after_another_edit():
    """A record found under no lease and taken over once: one found under lease 0 again is a
    second edit by hand, not another agent writing under that lease (none runs under lease 0)."""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    etcd.leases.add(0x42)
    keeper.lease_id, keeper.node = 0x42, node("A")
    for _ in range(2):
        etcd._put(node_key(PREFIX, "A"), node("A").to_json(), 0)
        async with keeper.lock:
            await keeper._restore_keys(etcd)
        assert etcd.kvs[node_key(PREFIX, "A")].lease == 0x42


# --- update_node and the first registration ---------------------------------------------------


class SlowPuts(FakeEtcd):
    """A put is answered once ``answer`` is set (etcd slow at start-up: a leader election)."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()
        self.put_waiting = asyncio.Event()

    async def put(self, key: bytes, value: bytes, lease: int | None = None):
        self.put_waiting.set()
        await self.answer.wait()
        return await super().put(key, value, lease)


async def test_update_node_during_the_first_registration_is_put_after_it():
    """The VXLAN device's MAC changed (udev) while the agent's first register_node was still
    waiting for etcd: update_node checked the registration before taking the keeper's lock,
    found none and raised (the agent's _published swallowed it); etcd kept the older record,
    with the old vtep_mac, and nothing corrected it.  It waits for the registration now."""
    etcd = SlowPuts()
    conn = connection(etcd)
    keeper = LeaseKeeper(conn, PREFIX, 30)
    registration = Registration(conn, keeper, PREFIX)
    r1 = dataclasses.replace(node("A"), backend={"vtep_mac": "aa:aa:aa:aa:aa:01"})
    r2 = dataclasses.replace(r1, backend={"vtep_mac": "aa:aa:aa:aa:aa:02"})
    first = asyncio.ensure_future(registration.register_node(r1))
    await etcd.put_waiting.wait()  # the registration's put is with etcd
    second = asyncio.ensure_future(registration.update_node(r2))
    etcd.answer.set()
    try:
        await first
        await second
    finally:
        await keeper.stop()
    assert NodeRecord.from_json(etcd.kvs[node_key(PREFIX, "A")].value).backend == {"vtep_mac": "aa:aa:aa:aa:aa:02"}
    assert keeper.node == r2


async def test_update_node_with_nothing_registered_writes_nothing_and_another_name_is_refused():
    """Before the first registration (a backend coming up during start-up: the registration
    that follows carries its data) or after the node's removal, there is nothing to replace."""
    etcd = FakeEtcd()
    conn = connection(etcd)
    keeper = LeaseKeeper(conn, PREFIX, 30)
    registration = Registration(conn, keeper, PREFIX)
    await registration.update_node(node("A"))
    assert etcd.kvs == {} and keeper.node is None and etcd.calls == []
    keeper.node = node("A")
    with pytest.raises(ValueError, match="not registered here"):
        await registration.update_node(node("B"))
    assert etcd.calls == []


async def test_a_failed_publication_of_node_data_is_logged(caplog):
    """Agent._published dropped whatever update_node or set_subnet_backend_data raised ("errors
    are logged by the datastore": they were not)."""
    from agentd.daemon.agent import Agent

    async def fails() -> None:
        raise ValueError("update_node: node 'B' is not registered here")

    async def works() -> None:
        return None

    agent = SimpleNamespace(_publishing=set())
    with caplog.at_level("DEBUG", logger="agentd"):
        for job in (fails(), works()):
            task = asyncio.ensure_future(job)
            agent._publishing.add(task)
            await asyncio.gather(task, return_exceptions=True)
            Agent._published(agent, task)  # type: ignore[arg-type]
        cancelled = asyncio.ensure_future(works())
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        Agent._published(agent, cancelled)  # type: ignore[arg-type]
    assert agent._publishing == set()
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert len(said) == 1 and said[0][0] == "ERROR" and "not registered here" in said[0][1], said


async def test_a_silent_member_holds_the_keys_restore_no_longer_than_the_refresh():
    """Only the refresh had the keepalive's short timeout: with lease_ttl = 2 a read of the
    restore that got no answer outlived the lease.  (request_timeout is 50 ms here, to keep
    the test short: the bound is min(request_timeout, max(1 s, lease_ttl/3)).)"""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd, request_timeout=0.05), PREFIX, 2)
    keeper.node = node("A")  # its lease expired: the round grants one and reads our keys
    etcd.silent = True
    restore = asyncio.ensure_future(keeper._restore_keys(etcd))
    done, _ = await asyncio.wait([restore], timeout=2.0)
    if not done:
        restore.cancel()
    assert done and isinstance(restore.exception(), asyncio.TimeoutError)

# --- the cluster config ------------------------------------------------------------------


async def test_a_config_deleted_during_the_dual_stack_upgrade_is_stored_anew():
    """The IPv4 config read, then deleted before the compare-and-swap: the swap's failure
    read finds nothing (it was an IndexError: "cannot start: list index out of range")."""
    etcd = FakeEtcd()
    conn = connection(etcd)
    registration = Registration(conn, LeaseKeeper(conn, PREFIX, 30), PREFIX)
    ipv4 = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "vxlan", "always")
    dual = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "vxlan", "always", ip_family="dual",
                         cidr_v6=IPv6Network("fd00:10:244::/56"), subnet_len_v6=64)
    key = config_key(PREFIX)
    etcd._put(key, ipv4.to_json(), None)
    etcd.before_transaction += [lambda: None, lambda: etcd._delete(key)]

    assert await registration.ensure_cluster_config(dual) == dual
    assert ClusterConfig.from_json(etcd.kvs[key].value) == dual



# --- requests retried after their reply was lost -------------------------------------------


def lose_the_reply_of_transaction(etcd: FakeEtcd, n: int) -> None:
    etcd.before_transaction += [lambda: None] * (n - 1) + [lambda: etcd.lose_reply.add("transaction")]


async def test_a_release_whose_reply_was_lost_reports_what_it_released():
    etcd = FakeEtcd()
    conn = connection(etcd)
    keeper = LeaseKeeper(conn, PREFIX, 30)
    etcd.leases.add(0x11)
    keeper.lease_id, keeper.subnet = 0x11, lease_of("A", 0x11)
    etcd._put(subnet_key(PREFIX, X), lease_of("A").to_json(), 0x11)
    lose_the_reply_of_transaction(etcd, 2)  # the read, the delete

    assert await SubnetLeases(conn, keeper, PREFIX, random.Random(1)).release("A") == [X]
    assert etcd.kvs == {} and etcd.calls.count("transaction") >= 3


async def test_a_rewrite_whose_reply_was_lost_reports_it_written():
    etcd = FakeEtcd()
    conn = connection(etcd)
    keeper = LeaseKeeper(conn, PREFIX, 30)
    etcd.leases.add(0x11)
    keeper.subnet = lease_of("A", 0x11)
    etcd._put(subnet_key(PREFIX, X), lease_of("A").to_json(), 0x11)
    lose_the_reply_of_transaction(etcd, 1)

    assert await SubnetLeases(conn, keeper, PREFIX, random.Random(1)).set_subnet_backend_data({"port": 8472})
    assert keeper.subnet.backend_data == {"port": 8472}


async def test_a_node_removal_whose_reply_was_lost_reports_it_removed():
    etcd = FakeEtcd()
    conn = connection(etcd)
    registration = Registration(conn, LeaseKeeper(conn, PREFIX, 30), PREFIX)
    etcd._put(node_key(PREFIX, "A"), node("A").to_json(), None)
    etcd.lose_reply.add("delete")

    assert await registration.remove_node("A") is True
    assert etcd.kvs == {} and etcd.calls == ["get", "delete", "delete"]


async def test_a_retried_removal_of_a_node_never_registered_reports_it_not_found():
    etcd = FakeEtcd()
    conn = connection(etcd)
    registration = Registration(conn, LeaseKeeper(conn, PREFIX, 30), PREFIX)
    etcd.lose_reply.add("delete")  # lost: the retry tells nothing of what the first one did

    assert await registration.remove_node("A") is False
    assert etcd.calls == ["get", "delete", "delete"]


# --- a leave's writes wait for another write's lock no longer than their deadline ------------


async def test_a_release_and_node_removal_wait_no_longer_than_their_deadline_for_a_stuck_publication():
    """A publication of node data retrying without a deadline while etcd does not answer held
    the keeper's lock, and the leave's release and node removal waited for it for ever."""
    from agentd.datastore.records import DatastoreUnavailable

    etcd = FakeEtcd()
    conn = connection(etcd, request_timeout=0.05)
    keeper = LeaseKeeper(conn, PREFIX, 30)
    etcd.leases.add(0x11)
    keeper.lease_id, keeper.subnet = 0x11, lease_of("A", 0x11)
    leases = SubnetLeases(conn, keeper, PREFIX, random.Random(1))
    registration = Registration(conn, keeper, PREFIX)
    etcd.silent = True  # nothing is answered: the publication retries, holding the lock
    stuck = asyncio.ensure_future(leases.set_subnet_backend_data({"vtep_mac": "02:00:00:00:00:01"}))
    await asyncio.sleep(0)
    assert keeper.lock.locked()
    try:
        for leave in (lambda: leases.release("A", timeout=0.05), lambda: registration.remove_node("A", timeout=0.05)):
            done, _ = await asyncio.wait([asyncio.ensure_future(leave())], timeout=2.0)
            assert done, "waited past its deadline for the publication's lock"
            err = next(iter(done)).exception()
            assert isinstance(err, DatastoreUnavailable) and "past the deadline" in str(err), err
    finally:
        stuck.cancel()
        await asyncio.gather(stuck, return_exceptions=True)
    assert not keeper.lock.locked()


async def test_every_write_of_our_keys_waits_no_longer_than_its_deadline_for_the_lock():
    """register_node (update_node), acquire_subnet and set_subnet_backend_data took the keeper's
    lock with a plain ``async with``: held by a publication retrying while etcd is unreachable,
    they waited for ever whatever their timeout said."""
    from agentd.datastore.records import DatastoreUnavailable

    etcd = FakeEtcd()
    conn = connection(etcd)
    keeper = LeaseKeeper(conn, PREFIX, 30)
    etcd.leases.add(0x11)
    keeper.lease_id, keeper.subnet, keeper.node = 0x11, lease_of("A", 0x11), node("A")
    leases = SubnetLeases(conn, keeper, PREFIX, random.Random(1))
    registration = Registration(conn, keeper, PREFIX)
    cluster = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "vxlan", "always")
    writes = [
        ("register node", lambda: registration.register_node(node("A"), timeout=0.2)),
        ("register node", lambda: registration.update_node(node("A"), timeout=0.2)),
        ("acquire subnet", lambda: leases.acquire_subnet("A", "192.0.2.1", "vxlan", {}, cluster=cluster, timeout=0.2)),
        ("publish subnet backend data", lambda: leases.set_subnet_backend_data({"port": 8472}, timeout=0.2)),
    ]
    async with keeper.lock:  # another write holds it
        for what, write in writes:
            done, _ = await asyncio.wait([asyncio.ensure_future(write())], timeout=2.0)
            assert done, f"{what}: waited past its deadline for the lock"
            err = next(iter(done)).exception()
            assert isinstance(err, DatastoreUnavailable) and str(err).startswith(what), err
            assert "past the deadline" in str(err)
    assert etcd.calls == []


# --- leases of another prefix length (subnet_len changed, a stray key) ---------------------------

WIDE = IPv4Network("10.244.0.0/23")  # leased while the cluster's subnet_len was 23
NOW_24 = ClusterConfig(IPv4Network("10.244.0.0/22"), 24, "vxlan", "always")


def _wide_lease(etcd: FakeEtcd, lease_id: int = 0x50) -> None:
    etcd.leases.add(lease_id)
    etcd._put(subnet_key(PREFIX, WIDE), SubnetLease(WIDE, "a", "192.0.2.1", "vxlan").to_json(), lease_id)


async def test_a_new_subnet_never_lies_inside_a_wider_lease_of_another_node():
    """Node a holds 10.244.0.0/23; the cluster's subnet_len is 24 now.  Both /24s inside a's
    lease are a's pods' addresses: a new node gets one of the others, whatever the seed."""
    got = set()
    for seed in range(12):
        etcd = FakeEtcd()
        _wide_lease(etcd)
        keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
        lease = await SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(seed)).acquire_subnet(
            "b", "192.0.2.2", "vxlan", {}, cluster=NOW_24)
        got.add(lease.subnet)
        await keeper.stop()
    assert got == {IPv4Network("10.244.2.0/24"), IPv4Network("10.244.3.0/24")}


async def test_a_previous_subnet_inside_a_wider_lease_of_another_node_is_not_reused():
    etcd = FakeEtcd()
    _wide_lease(etcd)
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    lease = await SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(1)).acquire_subnet(
        "b", "192.0.2.2", "vxlan", {}, cluster=NOW_24, previous="10.244.1.0/24")
    assert not lease.subnet.overlaps(WIDE)
    await keeper.stop()


async def test_a_wider_lease_taken_between_the_read_and_the_claim_makes_the_claim_read_again():
    """The claim's transaction checks the subnets around the candidate too: a node (its
    cluster record still saying /23) that leased one of them meanwhile wins, we read again."""
    etcd = FakeEtcd()
    cluster = ClusterConfig(IPv4Network("10.244.0.0/23"), 24, "vxlan", "always")
    etcd.before_transaction += [lambda: None, lambda: _wide_lease(etcd)]  # the read; then a's lease, before our claim
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    with pytest.raises(Exception, match="no free /24"):
        await SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(1)).acquire_subnet(
            "b", "192.0.2.2", "vxlan", {}, cluster=cluster, timeout=5)
    assert [k for k in etcd.kvs if k.startswith(b"/agentd/subnets/")] == [subnet_key(PREFIX, WIDE)]
    # Refused by the claim itself: no /24 inside a's lease was ever written (a claim without the
    # wider compares wins, and only the read after it gives the /24 up again).
    assert etcd.puts == [subnet_key(PREFIX, WIDE)]
    await keeper.stop()


async def test_a_narrower_lease_taken_between_the_read_and_the_claim_makes_the_wider_claim_give_up():
    """The other order: our cluster record still says /23, and another node (its record
    saying /24) leases a /24 inside our candidate between our read and our claim.  The claim
    checks only the wider keys, so it wins; the read after it finds the earlier narrower lease,
    and we give the /23 up and take one clear of both /24s."""
    etcd = FakeEtcd()
    cluster = ClusterConfig(IPv4Network("10.244.0.0/22"), 23, "vxlan", "always")
    narrow = [IPv4Network("10.244.0.0/24"), IPv4Network("10.244.2.0/24")]

    def lease_narrow() -> None:
        etcd.leases.add(0x51)
        for net, node in zip(narrow, "ac"):
            etcd._put(subnet_key(PREFIX, net), SubnetLease(net, node, "192.0.2.1", "vxlan").to_json(), 0x51)

    etcd.before_transaction += [lambda: None, lease_narrow]  # the read; then the /24s, before our claim
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    with pytest.raises(Exception, match="no free /23"):  # both /23s hold another node's /24
        await SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(1)).acquire_subnet(
            "b", "192.0.2.2", "vxlan", {}, cluster=cluster, timeout=5)
    assert sorted(k for k in etcd.kvs if k.startswith(b"/agentd/subnets/")) == [subnet_key(PREFIX, n) for n in narrow]
    await keeper.stop()


async def test_a_wider_claim_keeps_its_subnet_against_a_narrower_lease_made_after_it():
    """Whoever's key came first holds: a narrower lease made after our key (its maker's claim
    won as ours did) does not make us give ours up -- that node gives its own up."""
    from agentd.datastore import subnets as sn

    etcd = FakeEtcd()
    etcd.leases.update({0x50, 0x51})
    wide, narrow = IPv4Network("10.244.0.0/23"), IPv4Network("10.244.1.0/24")
    etcd._put(subnet_key(PREFIX, wide), SubnetLease(wide, "b", "192.0.2.2", "vxlan").to_json(), 0x50)
    etcd._put(subnet_key(PREFIX, narrow), SubnetLease(narrow, "a", "192.0.2.1", "vxlan").to_json(), 0x51)
    view = await sn.read_subnets(etcd, PREFIX, "b", lambda *a: None)  # type: ignore[arg-type]
    assert sn.earlier_overlaps(view, wide, "b") == []
    view = await sn.read_subnets(etcd, PREFIX, "a", lambda *a: None)  # type: ignore[arg-type]
    assert sn.earlier_overlaps(view, narrow, "a") == [wide]


# --- a subnet key not spelled as agentd spells it (someone's etcdctl put, a migration script) ---

DUAL = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "vxlan", "always", ip_family="dual",
                     cidr_v6=IPv6Network("fd00:10:244::/63"), subnet_len_v6=64)  # two IPv6 /64s
X6 = IPv6Network("fd00:10:244::/64")
OTHER6 = IPv6Network("fd00:10:244:1::/64")


class TooManyTransactions(Exception):
    pass


def at_most_transactions(etcd: FakeEtcd, limit: int) -> None:
    """Any transaction past ``limit`` raises (FakeEtcd's clock is frozen: a loop is ended by this)."""
    transaction = etcd.transaction

    async def counted(*args, **kwargs):
        if etcd.calls.count("transaction") >= limit:
            raise TooManyTransactions(f"more than {limit} transactions")
        return await transaction(*args, **kwargs)

    etcd.transaction = counted  # type: ignore[method-assign]


def lease6_of(name: str, subnet: IPv6Network = X6) -> SubnetLease:
    return SubnetLease(subnet=subnet, node=name, public_ip="192.0.2.1", backend_type="vxlan")


@pytest.mark.parametrize("spelled", [b"fd00:10:244:0:0:0:0:0-64", b"FD00:10:244::-64", b"fd00:10:244::0-64",
                                     b"fd00:10:244::-064"])
async def test_our_earlier_lease_under_a_subnet_key_not_spelled_as_ours_neither_loops_nor_is_shared(spelled, caplog):
    """Node A's earlier IPv6 lease restored under another spelling of its key: every compare
    is on the key agentd writes, which did not exist -- the claim failed, was retried at
    once, for ever (the agent never finished starting, flooding etcd); the release reported
    the key deleted and left it.  The key is a bad record, reported once in one line; its
    subnet stays taken (by no node: A takes the other one, B gets none), the release leaves it."""
    etcd = FakeEtcd()
    etcd.leases.add(0x50)
    odd = b"/agentd/subnets/" + spelled
    etcd._put(odd, lease6_of("A").to_json(), 0x50)
    at_most_transactions(etcd, 10)
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    leases = SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(1))

    with caplog.at_level("WARNING", logger="agentd.datastore"):
        lease = await leases.acquire_subnet("A", "192.0.2.1", "vxlan", {}, cluster=DUAL, previous=X6, version=6,
                                            timeout=1)
    assert lease.subnet == OTHER6
    assert _subnet_keys(etcd) == sorted([odd, subnet_key(PREFIX, OTHER6)])
    bad = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(bad) == 1 and "\n" not in bad[0], bad
    assert spelled.decode() in bad[0] and subnet_key(PREFIX, X6).decode() in bad[0] and "until this key is deleted" in bad[0]

    other = LeaseKeeper(connection(etcd), PREFIX, 30)
    with pytest.raises(SubnetExhausted):  # X6 is not free for B either
        await SubnetLeases(other.connection, other, PREFIX, random.Random(2)).acquire_subnet(
            "B", "192.0.2.2", "vxlan", {}, cluster=DUAL, previous=X6, version=6, timeout=1)

    assert await leases.release("A", timeout=1) == [OTHER6]
    assert _subnet_keys(etcd) == [odd]
    await other.stop()


@pytest.mark.parametrize("spelled", [b"fd00:10:244::0-64", b"FD00:10:244::-64"])  # sorted after ours; before it
async def test_a_subnet_key_beside_ours_in_another_spelling_leaves_the_subnet_ours(spelled):
    """Both keys name one subnet: ours (the key every compare and delete is on) holds it,
    whichever etcd lists last; the other spelling neither hides it nor is released with it."""
    etcd = FakeEtcd()
    etcd.leases.update({0x50, 0x51})
    odd = b"/agentd/subnets/" + spelled
    etcd._put(subnet_key(PREFIX, X6), lease6_of("A").to_json(), 0x50)
    etcd._put(odd, lease6_of("B").to_json(), 0x51)
    at_most_transactions(etcd, 10)
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    leases = SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(1))

    lease = await leases.acquire_subnet("A", "192.0.2.1", "vxlan", {}, cluster=DUAL, version=6, timeout=1)
    assert lease.subnet == X6 and etcd.kvs[subnet_key(PREFIX, X6)].lease == keeper.lease_id
    other = LeaseKeeper(connection(etcd), PREFIX, 30)
    got = await SubnetLeases(other.connection, other, PREFIX, random.Random(2)).acquire_subnet(
        "B", "192.0.2.2", "vxlan", {}, cluster=DUAL, previous=X6, version=6, timeout=1)
    assert got.subnet == OTHER6
    assert await leases.release("A", timeout=1) == [X6]
    assert _subnet_keys(etcd) == sorted([odd, subnet_key(PREFIX, OTHER6)])
    await other.stop()


async def test_a_reboot_longer_than_the_lease_ttl_takes_the_same_subnet_back(tmp_path):
    """The host is down longer than [etcd] lease_ttl: etcd has expired the node's lease and
    /run (the subnet file) is empty at boot.  The node took a random subnet then; the record
    in [agent] state_dir brings the old one back."""
    from agent_config import agent_cfg

    from agentd.daemon import node_files

    cfg = agent_cfg(tmp_path, **{"cni.write_conflist": False})
    cluster = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "vxlan", "always")
    etcd = FakeEtcd()

    async def start(seed: int) -> SubnetLease:  # as Agent._start: the previous subnet asked for first
        keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
        lease = await SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(seed)).acquire_subnet(
            "n1", "192.0.2.10", "vxlan", {}, cluster=cluster, previous=node_files.previous_subnets(cfg).get(4))
        node_files.write_cni_files(cfg, cluster, {4: lease}, 1450)
        await keeper.stop()  # a stop that keeps the lease
        return lease

    first = await start(1)
    etcd.expire(first.lease_id)  # the reboot took longer than lease_ttl
    Path(cfg.cni.subnet_file).unlink()  # /run is a tmpfs
    second = await start(2)  # (seed 2 alone picks another subnet)
    assert second.subnet == first.subnet


def test_free_subnets_leave_out_leases_of_every_prefix_length():
    from agentd.datastore.records import pick_free_subnet

    cidr = IPv4Network("10.244.0.0/22")
    taken = [IPv4Network("10.244.0.0/23"), IPv4Network("10.244.3.128/25"), IPv4Network("10.0.0.0/8"),
             IPv6Network("fd00::/8")]  # the /8 holds the whole pool
    assert pick_free_subnet(cidr, 24, taken, random.Random(1)) is None
    taken = taken[:2]
    assert {pick_free_subnet(cidr, 24, taken, random.Random(s)) for s in range(20)} == {IPv4Network("10.244.2.0/24")}
    huge = IPv4Network("10.0.0.0/8")  # probed: a stray /9 takes half of it
    picks = {pick_free_subnet(huge, 28, [IPv4Network("10.0.0.0/9")], random.Random(s)) for s in range(30)}
    assert all(p is not None and not p.overlaps(IPv4Network("10.0.0.0/9")) for p in picks) and len(picks) == 30


# --- racing claims, a lease lost mid-acquire ----------------------------------------------------

CLUSTER_16 = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "vxlan", "always")


class RacingClaim(FakeEtcd):
    """Another node's claim of the same subnet lands between our read and our claim (its key
    put just before our first subnet transaction reaches etcd)."""

    raced: KV | None = None

    async def transaction(self, compare, success=None, failure=None):
        puts = [o for o in (success or []) if isinstance(o, tx.Put) and b"/subnets/" in o.key]
        if puts and self.raced is None:
            self.next_lease += 1
            self.leases.add(self.next_lease)
            subnet = IPv4Network(puts[0].key.decode().rsplit("/", 1)[1].replace("-", "/"))
            self._put(puts[0].key, SubnetLease(subnet, "n2", "192.0.2.20", "vxlan").to_json(), self.next_lease)
            self.raced = dataclasses.replace(self.kvs[puts[0].key])
        return await super().transaction(compare, success, failure)


async def test_two_nodes_racing_for_one_free_subnet_never_both_hold_it():
    """The claim of a free subnet puts its key only if it is still absent (Version == 0): n2's
    claim, landing between n1's read and n1's claim, wins; n1 takes another subnet and n2's key
    is left as n2 wrote it (without the compare both believed they held it: review mutant M4)."""
    etcd = RacingClaim()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    got = await SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(3)).acquire_subnet(
        "n1", "192.0.2.10", "vxlan", {}, cluster=CLUSTER_16)
    await keeper.stop()
    assert etcd.raced is not None
    assert etcd.kvs[etcd.raced.key] == etcd.raced  # n2's, untouched
    assert subnet_key(PREFIX, got.subnet) != etcd.raced.key
    mine = etcd.kvs[subnet_key(PREFIX, got.subnet)]
    assert (mine.value, mine.lease) == (SubnetLease(got.subnet, "n1", "192.0.2.10", "vxlan").to_json(), got.lease_id)


class LeaseExpiresBeforeTheClaim(FakeEtcd):
    """The lease expires just before the first subnet claim reaches etcd (an outage longer than
    lease_ttl while the agent starts)."""

    expired: int | None = None

    async def transaction(self, compare, success=None, failure=None):
        puts = [o for o in (success or []) if isinstance(o, tx.Put) and b"/subnets/" in o.key]
        if puts and self.expired is None:
            self.expired = puts[0].lease
            self.expire(puts[0].lease)
        return await super().transaction(compare, success, failure)


async def test_a_lease_lost_in_the_middle_of_acquire_subnet_is_granted_again_and_the_subnet_taken():
    """The claim finds the lease gone (etcd: lease not found): the allocation carries on under a
    new lease instead of failing (the agent would not start: review mutant M12)."""
    etcd = LeaseExpiresBeforeTheClaim()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    got = await SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(3)).acquire_subnet(
        "n1", "192.0.2.10", "vxlan", {}, cluster=CLUSTER_16)
    await keeper.stop()
    assert etcd.expired is not None and got.lease_id not in (None, etcd.expired)
    assert keeper.lease_id == got.lease_id and got.lease_id in etcd.leases
    assert etcd.kvs[subnet_key(PREFIX, got.subnet)].lease == got.lease_id


# --- reservations (flannel's: a subnet record naming a node, under no etcd lease) -----------------

R = IPv4Network("10.244.7.0/24")
MAC = {"vtep_mac": "02:00:00:00:00:01"}


def _reserve(etcd: FakeEtcd, node_name: str, subnet: IPv4Network = R, **kw) -> bytes:
    """An operator's reservation: `etcdctl put <prefix>/subnets/... '{"node": ...}'`, no --lease."""
    key = subnet_key(PREFIX, subnet)
    record = SubnetLease(subnet, node_name, kw.pop("public_ip", "192.0.2.10"), "vxlan", **kw)
    etcd._put(key, record.to_json(), None)
    return key


async def test_a_subnet_reserved_for_the_node_stays_reserved_through_acquire_keepalive_lease_expiry_and_release():
    """A reservation naming n1 was claimed back under n1's lease: n1 down longer than lease_ttl,
    the key expired and another node took the reserved subnet.  As flannel does, it is taken
    under no lease (our data written into it), preferred to the subnet n1 had before, kept so
    by the keepalive and across the lease's expiry, and left by release: n2 never gets it."""
    etcd = FakeEtcd()
    key = _reserve(etcd, "n1")
    created = etcd.kvs[key].create_revision
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    leases = SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(1))
    got = await leases.acquire_subnet("n1", "192.0.2.10", "vxlan", MAC, cluster=CLUSTER_16,
                                      previous="10.244.9.0/24")
    await keeper.stop()
    mine = SubnetLease(R, "n1", "192.0.2.10", "vxlan", MAC)
    assert got == mine and keeper.subnets == {4: mine}
    kv = etcd.kvs[key]
    assert (kv.value, kv.lease, kv.create_revision) == (mine.to_json(), 0, created)
    assert keeper.lease_id in etcd.leases  # granted all the same: the node record lives under it
    assert [k for k in etcd.kvs if k.startswith(b"/agentd/subnets/")] == [key]

    written = len(etcd.puts)
    await keeper._round()
    assert etcd.kvs[key] == kv and len(etcd.puts) == written  # left as it is

    etcd.expire(keeper.lease_id)  # n1 away longer than lease_ttl
    assert etcd.kvs[key] == kv
    keeper.node = node("n1", R)
    await keeper._round()  # back: a new lease, the node record put again; the reservation as it was
    assert keeper.lease_id in etcd.leases and etcd.kvs[node_key(PREFIX, "n1")].lease == keeper.lease_id
    assert etcd.kvs[key] == kv and keeper.subnets == {4: mine} and keeper.lost == set()

    assert await leases.release("n1") == []
    assert etcd.kvs[key] == kv  # an operator's to delete, as flannel leaves it
    assert node_key(PREFIX, "n1") not in etcd.kvs

    # Another node, the only other /24 of its pool taken: the reserved one is not free.
    small = ClusterConfig(IPv4Network("10.244.6.0/23"), 24, "vxlan", "always")
    _reserve(etcd, "n3", IPv4Network("10.244.6.0/24"))
    other = LeaseKeeper(connection(etcd), PREFIX, 30)
    with pytest.raises(SubnetExhausted):
        await SubnetLeases(other.connection, other, PREFIX, random.Random(2)).acquire_subnet(
            "n2", "192.0.2.20", "vxlan", {}, cluster=small, timeout=5)
    await other.stop()
    assert etcd.kvs[key] == kv


async def test_an_operator_turning_our_lease_into_a_reservation_is_kept_so(caplog):
    """flannel's way to reserve a subnet a node holds: `etcdctl put KEY "$(etcdctl get
    --print-value-only KEY)"` (no --lease).  The next keepalive put it back under the lease.
    Now it stays under none -- our backend data published into it under none, a value edited
    by hand written back under none -- and the node's lease running out leaves it."""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    leases = SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(1))
    got = await leases.acquire_subnet("n1", "192.0.2.10", "vxlan", MAC, cluster=CLUSTER_16)
    await keeper.stop()
    key = subnet_key(PREFIX, got.subnet)
    assert etcd.kvs[key].lease == got.lease_id
    etcd._put(key, etcd.kvs[key].value, None)  # the operator's conversion
    converted = etcd.kvs[key]

    with caplog.at_level("INFO", logger="agentd.datastore"):
        await keeper._round()
    assert etcd.kvs[key] == converted
    assert keeper.subnets == {4: dataclasses.replace(got, lease_id=None)}
    assert any("reserved for node n1" in r.getMessage() for r in caplog.records)
    calls = len(etcd.calls)
    await keeper._round()  # and the round after it writes nothing
    assert etcd.calls[calls:] == ["refresh_lease", "transaction"] and etcd.kvs[key] == converted

    assert await leases.set_subnet_backend_data({"vtep_mac": "02:00:00:00:00:02"})
    published = etcd.kvs[key]
    assert published.lease == 0 and b"02:00:00:00:00:02" in published.value

    edited = dataclasses.replace(got, public_ip="192.0.2.99").to_json()
    etcd._put(key, edited, None)  # edited by hand, still a reservation for n1
    await keeper._round()
    assert (etcd.kvs[key].value, etcd.kvs[key].lease) == (published.value, 0)

    etcd._put(key, b"not json", None)  # made unreadable: ours, and still reserved
    await keeper._round()
    assert (etcd.kvs[key].value, etcd.kvs[key].lease) == (published.value, 0)

    etcd.expire(keeper.lease_id)
    assert (etcd.kvs[key].value, etcd.kvs[key].lease) == (published.value, 0)
    assert keeper.lost == set() and keeper.subnets[4].subnet == got.subnet


async def test_a_reservation_changed_between_the_read_and_the_claim_is_not_taken():
    """The claim of a reservation compares the revision read (Mod): reserved for another node
    meanwhile, the claim fails, and the node reads again and takes another subnet."""
    etcd = FakeEtcd()
    key = _reserve(etcd, "n1")
    etcd.before_transaction += [lambda: None, lambda: _reserve(etcd, "n2", public_ip="192.0.2.20")]
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    got = await SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(1)).acquire_subnet(
        "n1", "192.0.2.10", "vxlan", {}, cluster=CLUSTER_16)
    await keeper.stop()
    assert got.subnet != R and got.lease_id == keeper.lease_id
    assert SubnetLease.from_json(etcd.kvs[key].value, R).node == "n2" and etcd.kvs[key].lease == 0


async def test_backend_data_published_after_an_operator_made_our_lease_a_reservation_leaves_it_one():
    """The docs' conversion (the same value put again, no --lease) leaves the value as we wrote
    it: a publish before the next keepalive round compared only the value and put the key back
    under our lease, to expire with it (review s57 r18 #1).  The key's lease is checked too:
    nothing written, and the keepalive takes the conversion and the new data on."""
    etcd = FakeEtcd()
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    leases = SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(1))
    got = await leases.acquire_subnet("n1", "192.0.2.10", "vxlan", MAC, cluster=CLUSTER_16)
    await keeper.stop()
    key = subnet_key(PREFIX, got.subnet)
    etcd._put(key, etcd.kvs[key].value, None)  # the operator's conversion

    assert not await leases.set_subnet_backend_data({"vtep_mac": "02:00:00:00:00:02"})
    assert etcd.kvs[key].lease == 0
    await keeper._round()
    assert etcd.kvs[key].lease == 0 and b"02:00:00:00:00:02" in etcd.kvs[key].value
    assert keeper.subnets[4].lease_id is None
    etcd.expire(keeper.lease_id)
    assert etcd.kvs[key].lease == 0


async def test_backend_data_published_after_an_operator_ended_our_reservation_leaves_it_leased():
    """The reverse: the operator ends the reservation (`etcdctl put --lease=<node's lease>`); a
    publish must not put it back under no lease."""
    etcd = FakeEtcd()
    key = _reserve(etcd, "n1")
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    leases = SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(1))
    await leases.acquire_subnet("n1", "192.0.2.10", "vxlan", MAC, cluster=CLUSTER_16)
    await keeper.stop()
    etcd._put(key, etcd.kvs[key].value, keeper.lease_id)  # the operator ends the reservation

    assert not await leases.set_subnet_backend_data({"vtep_mac": "02:00:00:00:00:02"})
    assert etcd.kvs[key].lease == keeper.lease_id
    await keeper._round()
    assert etcd.kvs[key].lease == keeper.lease_id and b"02:00:00:00:00:02" in etcd.kvs[key].value
    assert keeper.subnets[4].lease_id == keeper.lease_id


async def test_a_reservation_s_backend_data_publish_whose_reply_was_lost_reports_it_written():
    """The retried rewrite finds the reservation written as asked, under no lease: written
    (review s57 r18 mutant M14: compared with None, not 0, it reported not written)."""
    etcd = FakeEtcd()
    key = _reserve(etcd, "n1")
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    leases = SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(1))
    await leases.acquire_subnet("n1", "192.0.2.10", "vxlan", MAC, cluster=CLUSTER_16)
    await keeper.stop()
    etcd.lose_reply.add("transaction")

    assert await leases.set_subnet_backend_data({"vtep_mac": "02:00:00:00:00:02"})
    assert etcd.kvs[key].lease == 0 and b"02:00:00:00:00:02" in etcd.kvs[key].value
    assert keeper.subnets[4].backend_data == {"vtep_mac": "02:00:00:00:00:02"}


@pytest.mark.parametrize("reserved", ["10.99.0.0/24", "10.244.7.0/25"])
async def test_a_reservation_for_the_node_it_cannot_use_is_deleted_when_it_takes_another(reserved, caplog):
    """A reservation naming n1 outside the pool, or of the wrong length: n1 takes a free subnet
    under its lease, and the reservation is deleted in the same transaction, as flannel deletes an
    incompatible lease (it stayed beside the new lease, two records naming n1: review s57 r18 #2)."""
    etcd = FakeEtcd()
    key = _reserve(etcd, "n1", IPv4Network(reserved))
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    with caplog.at_level("INFO", logger="agentd.datastore"):
        got = await SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(1)).acquire_subnet(
            "n1", "192.0.2.10", "vxlan", {}, cluster=CLUSTER_16)
    await keeper.stop()
    assert got.lease_id == keeper.lease_id and key not in etcd.kvs
    assert [k for k in etcd.kvs if k.startswith(b"/agentd/subnets/")] == [subnet_key(PREFIX, got.subnet)]
    warned = [r for r in caplog.records if r.levelname == "WARNING" and reserved in r.getMessage()]
    assert len(warned) == 1 and "is not a /24 of the cluster network 10.244.0.0/16" in warned[0].getMessage()


async def test_a_reservation_given_up_for_an_earlier_narrower_lease_of_another_node_is_kept_and_not_used():
    """_gave_up after a won claim of a reservation, another node's narrower lease made before the
    reservation's key (their subnet lengths differ): the reservation is not used, and not deleted
    either -- an operator's to delete (review s57 r18 mutants M2: deleted; M11: used all the same).
    Called directly: acquire's read sees such a lease and never claims the reservation."""
    etcd = FakeEtcd()
    etcd.leases.add(0x51)
    narrow = IPv4Network("10.244.7.0/25")
    etcd._put(subnet_key(PREFIX, narrow), SubnetLease(narrow, "n2", "192.0.2.20", "vxlan").to_json(), 0x51)
    key = _reserve(etcd, "n1")
    reserved = etcd.kvs[key]
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    leases = SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(1))

    assert await leases._gave_up("n1", R, None)
    assert etcd.kvs[key] == reserved


async def test_a_previous_subnet_around_an_unusable_reservation_of_ours_is_taken_and_the_reservation_deleted():
    """The previous /24 holds a /25 reserved for n1 (not a subnet of the pool's length): the /25
    goes in the claim transaction, so the /24 is ours alone -- one record naming n1, none
    overlapping another (review s57 r18 #2 and mutant M6)."""
    etcd = FakeEtcd()
    small = _reserve(etcd, "n1", IPv4Network("10.244.7.0/25"))
    keeper = LeaseKeeper(connection(etcd), PREFIX, 30)
    got = await SubnetLeases(keeper.connection, keeper, PREFIX, random.Random(1)).acquire_subnet(
        "n1", "192.0.2.10", "vxlan", {}, cluster=CLUSTER_16, previous=R)
    await keeper.stop()
    assert got.subnet == R and got.lease_id == keeper.lease_id and small not in etcd.kvs
    assert [k for k in etcd.kvs if k.startswith(b"/agentd/subnets/")] == [subnet_key(PREFIX, R)]
