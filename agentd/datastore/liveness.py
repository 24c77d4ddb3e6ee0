"""Liveness: the one etcd lease our node record and subnet key live under, kept alive.

The lease is granted on first use and refreshed every ttl/3 by a background task (as etcd's
clientv3 does).  If it expires or is revoked, the task grants a new one, puts the node record
again and re-acquires THE SAME subnet if it is still free (by the same claim as a new lease's:
no other node's lease around it, none inside it made first); if another node took it
meanwhile, ``on_subnet_lost(lease)`` is called and the node record (put again if gone,
rewritten if it names it) no longer names it.  Each round also puts back our keys if someone
deleted them, and takes over our keys found under another lease when they name this node as
it is (name and addresses): an etcd restored from a backup brings them back under our earlier
run's lease, which nobody refreshes.  Every write is a transaction that compares what it read
(a plain put only where the key was missing).  The task never exits and never raises.

A key of ours found under our lease or under none, unreadable or naming this node (other
addresses, other data), is ours whatever it holds: no agent but this one writes under our
lease, and none writes under no lease but a reservation's.  Such a value was put by hand (a
plain ``etcdctl put`` detaches the key from its lease, ``--ignore-lease`` keeps ours), and
the round writes ours back under our lease -- except a readable subnet record naming this
node under no lease: a reservation (flannel's: "removing the TTL from a lease will convert it
to a reservation"), left under no lease (its value rewritten, still under none, only where
it is not what we publish), so it never expires with our lease; an unreadable value under no
lease stays under none where we held it as a reservation.  A subnet record naming another
node is that node's, under any lease: an assignment by hand, or a reservation for it.

``LeaseKeeper`` holds what we keep alive (``node``, ``subnets`` by IP version) and the ``lock`` every change
of our keys takes: agentd.datastore.registration and agentd.datastore.leases change them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Network, IPv6Network
from typing import Any, TypeVar

import aetcd
from aetcd import transactions as tx

from agentd.datastore import subnets
from agentd.datastore.connection import EtcdConnection, cancel_kept
from agentd.datastore.etcd import EtcdClient, describe, is_lease_not_found, is_transient
from agentd.datastore.records import (
    NodeRecord,
    RecordError,
    SubnetLease,
    node_key,
    subnet_key,
)
from agentd.datastore.subnets import Claim

log = logging.getLogger("agentd.datastore")

T = TypeVar("T")
Network = IPv4Network | IPv6Network
SubnetLostCallback = Callable[[SubnetLease], Any]


class LeaseKeeper:
    """Our etcd lease, the keys under it, and the keepalive task that renews and restores them.

    ``subnet_lost_callback()`` returns the callback to run when our subnet was taken while
    the lease was gone (read when it happens)."""

    def __init__(self, connection: EtcdConnection, prefix: str, lease_ttl: int,
                 subnet_lost_callback: Callable[[], SubnetLostCallback | None] = lambda: None) -> None:
        self.connection = connection
        self.prefix = prefix
        self.lease_ttl = lease_ttl
        self.subnet_lost_callback = subnet_lost_callback
        self.lease_id: int | None = None
        self.node: NodeRecord | None = None
        self.subnets: dict[int, SubnetLease] = {}  # by IP version: one each in a dual-stack cluster
        self.lost: set[Network] = set()  # subnets taken by another node while our lease was gone
        self.renewals = 0  # successful keepalives
        self.lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        # Our keys held under another lease, by key: the revision last logged (one entry a key,
        # however often the other agent rewrites it: logged again at each new revision).
        self._reported_conflicts: dict[bytes, int] = {}
        # Our keys taken over from another lease (_ours_to_take), by key: the lease taken from.
        self._taken_over: dict[bytes, int] = {}

    @property
    def subnet(self) -> SubnetLease | None:
        """The node's first subnet lease (IPv4 where it has one)."""
        return next((self.subnets[v] for v in sorted(self.subnets)), None)

    @subnet.setter
    def subnet(self, lease: SubnetLease | None) -> None:
        """Hold ``lease`` as the subnet of its family; None holds none at all."""
        if lease is None:
            self.subnets.clear()
        else:
            self.subnets[lease.subnet.version] = lease

    # -- the lease ------------------------------------------------------------------------

    async def ensure_lease(self, deadline: float | None) -> int:
        if self.lease_id is None:
            lease = await self.connection.call("grant lease", lambda c: c.lease(self.lease_ttl), deadline)
            self.lease_id = lease.id
            log.info("granted etcd lease %x (ttl %ss)", lease.id, lease.ttl)
        self.start()
        return self.lease_id

    async def with_lease(
        self, what: str, op: Callable[[EtcdClient, int], Awaitable[T]], deadline: float | None
    ) -> T:
        """Run ``op(client, lease_id)``; if etcd says the lease is gone, grant a new one and retry."""
        while True:
            lease_id = await self.ensure_lease(deadline)
            try:
                return await self.connection.call(what, lambda c: op(c, lease_id), deadline)
            except Exception as exc:
                if not is_lease_not_found(exc):
                    raise
                self.lease_gone(lease_id)

    def lease_gone(self, lease_id: int) -> None:
        if self.lease_id == lease_id:
            log.warning("etcd lease %x is gone (expired or revoked); granting a new one", lease_id)
            self.lease_id = None

    # -- keepalive --------------------------------------------------------------------------

    def start(self) -> None:
        if self.connection.closed or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="agentd-datastore-keepalive")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None or task is asyncio.current_task():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    @property
    def interval(self) -> float:
        return max(0.2, self.lease_ttl / 3)

    async def _loop(self) -> None:
        """Refresh the lease every ttl/3; restore our keys when needed.  Never exits on error."""
        interval = self.interval
        # A failing keep-alive never waits longer than a successful one: when etcd is back
        # (a member restarted, quorum regained) the lease must be refreshed well within its TTL.
        backoff = self.connection.backoff(cap=min(5.0, interval))
        last_problem = ""
        while not self.connection.closed:
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if is_transient(exc):
                    self.connection.set_connected(False, f"lease keepalive: {describe(exc)}")
                elif describe(exc) != last_problem:
                    log.error("lease keepalive failed: %s; retrying", describe(exc))
                last_problem = describe(exc)
                await asyncio.sleep(backoff.next())
            else:
                last_problem = ""
                backoff.reset()
                await asyncio.sleep(interval)

    async def _round(self) -> None:
        client = self.connection.client()
        try:
            await self._refresh(client)
            if self.lock.locked():
                return  # a public call is changing our keys right now; check next round
            async with self.lock:
                await self._restore_keys(client)
        except Exception as exc:
            if is_transient(exc):
                self.connection.failover(client)  # the next round asks the next member
            raise

    async def _bounded(self, request: Awaitable[T]) -> T:
        """One etcd request of the keepalive.  A member that went silent (cut off: no reset, no
        answer) must not hold it much past the next refresh is due: the lease (TTL = 3
        intervals) is refreshed elsewhere in time.  At least 1 s, or a merely busy member
        would count as lost."""
        timeout = min(self.connection.request_timeout, max(1.0, self.interval))
        return await cancel_kept(asyncio.wait_for(request, timeout))

    async def _refresh(self, client: EtcdClient) -> None:
        lease_id = self.lease_id
        if lease_id is None:
            return
        reply = await self._bounded(client.refresh_lease(lease_id))
        if reply is None:  # no answer about the lease: never take that for "expired"
            raise aetcd.ConnectionFailedError("lease keep-alive stream ended without a reply")
        self.connection.set_connected(True)
        if reply.TTL > 0:
            self.renewals += 1
        elif self.lease_id == lease_id:
            log.warning("etcd lease %x expired or was revoked; granting a new one and restoring %s",
                        lease_id, self.holdings())
            self.lease_id = None

    def holdings(self) -> str:
        parts = []
        if self.node is not None:
            parts.append(f"node {self.node.name}")
        parts += [f"subnet {lease.subnet}" for _v, lease in sorted(self.subnets.items())]
        return " and ".join(parts) or "nothing"

    # -- restoring our keys -----------------------------------------------------------------

    async def _restore_keys(self, client: EtcdClient) -> None:
        """Make sure our node record and subnet keys exist under our lease."""
        node, held = self.node, sorted(self.subnets.items())
        if node is None and not held:
            return
        if self.lease_id is None:
            lease = await self._bounded(client.lease(self.lease_ttl))
            self.lease_id = lease.id
            log.info("granted new etcd lease %x (ttl %ss)", lease.id, lease.ttl)
        lease_id = self.lease_id
        keys = [node_key(self.prefix, node.name)] if node else []
        keys += [subnet_key(self.prefix, lease.subnet) for _v, lease in held]
        _, found = await self._bounded(client.transaction(compare=[], success=[tx.Get(k) for k in keys], failure=[]))
        for remembered in (self._reported_conflicts, self._taken_over):
            for gone in remembered.keys() - set(keys):  # a subnet no longer held
                del remembered[gone]
        node_kvs = found[0] if node else []
        for (_v, lease), kvs in zip(held, found[1 if node else 0:]):
            if self.lease_id != lease_id:
                return  # the lease went while restoring: the next round starts again
            await self._restore_subnet(client, lease, kvs, lease_id)
        node = self.node  # without a subnet lost meanwhile
        if node is None or self.lease_id != lease_id:
            return
        if not node_kvs:
            try:
                await self._bounded(client.put(keys[0], node.to_json(), lease=lease_id))
            except Exception as exc:
                if not is_lease_not_found(exc):
                    raise
                self.lease_gone(lease_id)
                return
            log.info("restored node record %s under lease %x", node.name, lease_id)
            return
        value, kv = node_kvs[0]
        try:
            stored: NodeRecord | None = NodeRecord.from_json(value)
        except RecordError:
            stored = None
        if kv.lease not in (lease_id, 0):
            if stored is None or not self._ours_to_take(kv.key, kv.lease, stored.name == node.name and (
                    stored.address, stored.address_v6) == (node.address, node.address_v6)):
                self._report_conflict(keys[0], kv.mod_revision, "node record")
                return
            if await self._put_unchanged(client, kv, node.to_json(), lease_id):
                self._taken_over[kv.key] = kv.lease
                log.warning("node record %s was under etcd lease %x, not ours (etcd restored from a backup?): "
                            "taken over under lease %x", node.name, kv.lease, lease_id)
            return
        # Under our lease or under none: ours whatever it holds (module docstring).
        if (kv.lease == 0 or bytes(value) != node.to_json()) and await self._put_unchanged(
                client, kv, node.to_json(), lease_id):
            if kv.lease == lease_id and stored is not None and dataclasses.replace(
                    stored, subnet=node.subnet, subnet_v6=node.subnet_v6).to_json() == node.to_json():
                # Put under this lease naming a subnet lost since (register_node, update_node:
                # they grant a new lease when the old one is gone): other nodes would take it
                # for ours and refuse its holder's route to it (agentd.kernel.forwarding).
                log.info("node record %s rewritten: it named subnets %s, not ours", node.name,
                         ", ".join(str(n) for n in (stored.subnet, stored.subnet_v6) if n))
            else:
                log.warning("node record %s %s: rewritten under lease %x", node.name,
                            _edited(kv.lease, stored is None, bytes(value) == node.to_json()), lease_id)

    def _ours_to_take(self, key: bytes, other_lease: int, same_identity: bool) -> bool:
        """Whether our key found under ``other_lease`` is ours to take over: its content names
        this node as it is (``same_identity``: name and addresses), and we never took it from
        that lease before.  A lease no agent runs under (our earlier run's, brought back by an
        etcd restored from a backup) never writes again; a key found again under a lease we
        took it from has been written under it since: another agent runs under that lease
        with our name and addresses, and we leave the key to it."""
        return same_identity and self._taken_over.get(key) != other_lease

    async def _put_unchanged(self, client: EtcdClient, kv: Any, value: bytes, lease_id: int) -> bool:
        """Put ``value`` at ``kv.key`` under our lease if the key is unchanged since ``kv``."""
        try:
            ok, _ = await self._bounded(client.transaction(
                compare=[tx.Mod(kv.key) == kv.mod_revision],
                success=[tx.Put(kv.key, value, lease=lease_id)],
                failure=[],
            ))
        except Exception as exc:
            if not is_lease_not_found(exc):
                raise
            self.lease_gone(lease_id)
            return False
        return bool(ok)

    async def _restore_subnet(self, client: EtcdClient, subnet: SubnetLease, kvs: list, lease_id: int) -> None:
        if not kvs:
            # The same claim as a new lease's (agentd.datastore.leases): the subnets around ours
            # must not be leased either, and a narrower lease of another node's inside ours,
            # made before our claim, holds (subnets.earlier_overlaps).
            outcome = await self._bounded(subnets.claim(client, self.prefix, subnet, subnet.subnet, None, {}, lease_id,
                                                        subnets.wider_subnets(subnet.subnet)))
            if outcome is Claim.LEASE_GONE:
                self.lease_gone(lease_id)
                return
            if outcome is Claim.WON:
                view = await self._bounded(self._read_subnets(client, subnet.node))
                mine = view.entries.get(subnet.subnet)
                earlier = subnets.earlier_overlaps(view, subnet.subnet, subnet.node)
                if earlier and mine is not None:
                    await self._bounded(subnets.release(client, self.prefix, {subnet.subnet: mine}))
                    self._lose(subnet, f"another node ({', '.join(map(str, earlier))}, leased before our claim)")
                    return
                self.subnets[subnet.subnet.version] = dataclasses.replace(subnet, lease_id=lease_id)
                log.info("re-acquired subnet %s for node %s under lease %x", subnet.subnet, subnet.node, lease_id)
                return
            kvs = await self._bounded(client.get(subnet_key(self.prefix, subnet.subnet)))
            kvs = [(kvs.value, kvs)] if kvs is not None else []
            if not kvs:
                # Our key is free, but the claim failed: a wider subnet of another node's
                # holds ours (or it was freed just now: the next round claims it again).
                view = await self._bounded(self._read_subnets(client, subnet.node))
                others = subnets.other_overlaps(view, subnet.subnet, subnet.node)
                if others and subnet.subnet not in view.entries:
                    self._lose(subnet, f"another node ({', '.join(map(str, others))})")
                return
        value, kv = kvs[0]
        try:
            stored: SubnetLease | None = SubnetLease.from_json(value, subnet.subnet, kv.lease)
        except RecordError:
            stored = None
        if stored is not None and stored.node != subnet.node:
            # Another node's by its record, under whatever lease: its claim after ours was
            # gone, or an assignment by hand (as a flannel reservation names its node).
            self._lose(subnet, stored.node)
            return
        if kv.lease == 0 and (stored is not None or subnet.lease_id is None):
            # Reserved for us (module docstring): kept under no lease.
            if subnet.lease_id is not None:
                subnet = dataclasses.replace(subnet, lease_id=None)
                self.subnets[subnet.subnet.version] = subnet
                log.info("subnet %s is reserved for node %s now (its key under no etcd lease): kept so",
                         subnet.subnet, subnet.node)
            if stored != subnet and await self._bounded(
                subnets.put_unchanged(client, self.prefix, subnet, kv.mod_revision)
            ):
                log.warning("subnet key %s reserved for node %s %s (put by hand?): rewritten, still under no "
                            "etcd lease", kv.key.decode(errors="replace"), subnet.node,
                            "was unreadable" if stored is None else "held another value than ours")
            return
        if kv.lease in (lease_id, 0):
            # Unreadable or naming us: ours (module docstring).  An unreadable value is no
            # node's claim -- giving the subnet up for it stopped the agent, and a restarted
            # one took another subnet (every pod recreated).
            if subnet.lease_id != lease_id:  # re-taken by a claim whose reply was lost, or no longer reserved
                subnet = dataclasses.replace(subnet, lease_id=lease_id)
                self.subnets[subnet.subnet.version] = subnet
            # Ours, but not what we publish -- put back while the new backend data could not be
            # written (set_subnet_backend_data found the key gone with our lease), or edited by
            # hand: rewritten.
            if stored != subnet and await self._bounded(
                subnets.put_unchanged(client, self.prefix, subnet, kv.mod_revision)
            ):
                if kv.lease == lease_id and stored is not None and stored.public_ip == subnet.public_ip:
                    log.info("subnet %s: published its backend data under lease %x", subnet.subnet, lease_id)
                else:
                    log.warning("subnet key %s %s: rewritten under lease %x", kv.key.decode(errors="replace"),
                                _edited(kv.lease, stored is None, bytes(value) == subnet.to_json()), lease_id)
            return
        if stored is not None:  # naming us, under another lease
            if not self._ours_to_take(kv.key, kv.lease, stored.public_ip == subnet.public_ip):
                self._report_conflict(kv.key, kv.mod_revision, "subnet key")
                return
            taken = dataclasses.replace(subnet, lease_id=lease_id)
            if await self._bounded(subnets.put_unchanged(client, self.prefix, taken, kv.mod_revision)):
                self._taken_over[kv.key] = kv.lease
                self.subnets[subnet.subnet.version] = taken
                log.warning("subnet %s of node %s was under etcd lease %x, not ours (etcd restored from a "
                            "backup?): taken over under lease %x", subnet.subnet, subnet.node, kv.lease, lease_id)
            return
        self._lose(subnet, "an unreadable record under another etcd lease")

    def _read_subnets(self, client: EtcdClient, node: str) -> Awaitable[subnets.SubnetView]:
        return subnets.read_subnets(client, self.prefix, node, self.connection.report_bad)

    def _lose(self, subnet: SubnetLease, holder: str) -> None:
        """Our ``subnet`` is another node's now: no longer held, no longer named by our record."""
        self.subnets.pop(subnet.subnet.version, None)
        self.lost.add(subnet.subnet)
        node = self.node
        if node is not None and subnet.subnet in (node.subnet, node.subnet_v6):
            # Our record must not name it any more: other nodes would take it for ours and
            # refuse its holder's route to it (agentd.kernel.forwarding).
            self.node = dataclasses.replace(node, subnet=None if node.subnet == subnet.subnet else node.subnet,
                                            subnet_v6=None if node.subnet_v6 == subnet.subnet else node.subnet_v6)
        log.error("subnet %s of node %s was taken by %s while our etcd lease was gone; it is lost",
                  subnet.subnet, subnet.node, holder)
        self.connection.notify("on_subnet_lost", self.subnet_lost_callback(), subnet)

    def _report_conflict(self, key: bytes, mod_revision: int, what: str) -> None:
        if self._reported_conflicts.get(key) == mod_revision:
            return
        self._reported_conflicts[key] = mod_revision
        log.error("%s %s is held under another etcd lease than ours (%x): is another agent running "
                  "with the same node name? leaving it alone", what, key.decode(errors="replace"),
                  self.lease_id or 0)


def _edited(found_lease: int, unreadable: bool, same_value: bool) -> str:
    """How one of our keys was found edited by hand, for the log."""
    what = "was unreadable" if unreadable else "was as ours" if same_value else "held another value than ours"
    return what + (" under no etcd lease (a plain etcdctl put?)" if found_lease == 0 else " (put by hand?)")
