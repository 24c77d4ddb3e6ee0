"""Subnet leases: acquiring, publishing into, reading and releasing the subnets nodes hold.

A subnet is taken by ONE etcd transaction that puts the subnet key only if it does not exist
(agentd.datastore.subnets), under the liveness lease (agentd.datastore.liveness renews it and
re-takes the subnet after the lease was lost).  Candidates are tried in this order: a
subnet reserved for the node (a record naming it under no etcd lease, as flannel's
reservations: taken under no lease, so it never expires), the subnet the node had before,
the subnets etcd records for it, the subnet in its node record, then a free one picked at
random.  A lost race moves on to the next candidate.  A reservation is never deleted by
agentd: not when another subnet is taken, not by ``release`` (flannel never deletes one) --
but for one naming the node that it cannot use (not a /subnet_len of the pool), deleted when
the node takes another subnet, as flannel deletes an incompatible lease.

A dual-stack node holds one subnet of each family (``version`` 4 and 6), each taken by its
own transaction of the same kind, under the same lease; a claim's clean-up of older subnets
recorded for the node touches only its own family.  ``release`` drops both in one.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Awaitable
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_network
from typing import Any

from agentd.datastore import subnets
from agentd.datastore.connection import EtcdConnection
from agentd.datastore.etcd import EtcdClient, is_lease_not_found
from agentd.datastore.liveness import LeaseKeeper
from agentd.datastore.records import (
    ClusterConfig,
    RecordError,
    SubnetExhausted,
    SubnetLease,
    check_node_name,
    is_cluster_subnet,
    parse_subnet_key,
    pick_free_subnet,
    subnet_count,
    subnet_key,
    subnets_prefix,
)
from agentd.datastore.subnets import Claim, Entry

log = logging.getLogger("agentd.datastore")

Network = IPv4Network | IPv6Network

# A subnet allocator that loses this many races in a row re-reads etcd's view.
LOST_RACES_BEFORE_REREAD = 8


class SubnetLeases:
    """The subnets this agent holds (in ``keeper.subnets``, by IP version) and everyone's subnet
    records."""

    def __init__(self, connection: EtcdConnection, keeper: LeaseKeeper, prefix: str, rng: random.Random) -> None:
        self.connection = connection
        self.keeper = keeper
        self.prefix = prefix
        self.rng = rng

    async def acquire_subnet(
        self,
        node: str,
        public_ip: IPv4Address | IPv6Address | str,
        backend_type: str,
        backend_data: dict[str, Any],
        *,
        cluster: ClusterConfig,
        previous: Network | str | None = None,
        timeout: float | None = None,
        version: int = 4,
    ) -> SubnetLease:
        """Lease a subnet of the cluster's pod network of IP ``version`` for ``node`` (see the
        module doc for the order)."""
        check_node_name(node, "acquire_subnet", "node")
        if version not in cluster.versions:
            raise ValueError(f"the cluster is {cluster.ip_family}: it has no IPv{version} pod network")
        cidr, subnet_len = cluster.pool(version)
        template = SubnetLease(
            subnet=cidr,  # replaced by each candidate
            node=node,
            public_ip=public_ip,
            backend_type=backend_type,
            backend_data=backend_data,
        )
        if previous is not None:
            previous = ip_network(previous)
            if previous.version != version or not is_cluster_subnet(cluster, previous):
                log.warning("previous subnet %s is not a /%d of the cluster network %s; ignoring it",
                            previous, subnet_len, cidr)
                previous = None
        deadline = self.connection.deadline(timeout)
        async with self.connection.locked(self.keeper.lock, deadline, "acquire subnet"):
            lease = await self._allocate(template, cluster, previous, deadline, version)
            self.keeper.subnets[version] = lease
            self.keeper.lost.discard(lease.subnet)
        return lease

    async def set_subnet_backend_data(self, backend_data: dict[str, Any], *, timeout: float | None = None) -> bool:
        """Publish ``backend_data`` (our VTEP MAC, UDP port...) in our subnet lease record too,
        as flannel does; the node record carries the same.  Never moves or re-takes the lease:
        the record is rewritten only while it is still the one we wrote.  True if written.
        Not written (our record gone with an expired lease): the keeper holds the new data all
        the same, and its keepalive puts the record back with it."""
        keeper = self.keeper
        written = False
        deadline = self.connection.deadline(timeout)
        async with self.connection.locked(keeper.lock, deadline, "publish subnet backend data"):
            for version, lease in sorted(keeper.subnets.items()):
                if lease.backend_data == backend_data:
                    continue
                new = dataclasses.replace(lease, backend_data=dict(backend_data))
                ok = await self.connection.call(
                    "publish subnet backend data",
                    lambda c, lease=lease, new=new: subnets.rewrite(c, self.prefix, lease, new),
                    deadline,
                )
                if not ok:
                    # Not the record we wrote: gone with our lease (an outage longer than the TTL),
                    # changed, or stored under another lease (an operator made it a reservation or
                    # ended one: what is stored is followed, as flannel does).  The keepalive puts our record back, or rewrites it while it is
                    # ours, with what the keeper holds: the new data, not the stale.
                    log.info("subnet %s: its record is not the one we wrote (gone with our lease?); the "
                             "keepalive publishes the backend data once the record is ours", lease.subnet)
                # Not before it is done: a rewrite that raised is tried again by the next call.
                keeper.subnets[version] = new
                written |= ok
        return written

    async def _allocate(
        self, template: SubnetLease, cluster: ClusterConfig, previous: Network | None, deadline: float | None,
        version: int,
    ) -> SubnetLease:
        node = template.node
        cidr, subnet_len = cluster.pool(version)
        while True:
            lease_id = await self.keeper.ensure_lease(deadline)
            view = await self.connection.call("read subnets", lambda c: self._read_subnets(c, node), deadline)
            ours = view.held_by(node, version)
            reserved = sorted(s for s, e in ours.items() if e.reserved)
            # A reservation we cannot use (not a /subnet_len of the pool) is dropped with our
            # leased subnets when we take another, as flannel deletes an incompatible lease: else
            # it stayed beside the new one, two records naming the node.
            unusable = [s for s in reserved if not is_cluster_subnet(cluster, s)]
            leased = {s: e for s, e in ours.items() if not e.reserved or s in unusable}  # ours to drop
            preferred = [*reserved, previous, *sorted(ours), view.node_subnets.get(version)]
            outcome = Claim.RETRY
            tried: set[Network] = set()
            for candidate in preferred:
                if candidate is None or candidate in tried or not is_cluster_subnet(cluster, candidate):
                    continue
                tried.add(candidate)
                entry = view.entries.get(candidate)
                if entry is not None and candidate not in ours:
                    continue  # someone else's
                if any(s != candidate and s not in leased and s.overlaps(candidate)  # type: ignore[arg-type]
                       for s in view.entries):
                    continue  # inside a wider lease of someone else's (or around a narrower one)
                outcome = await self._claim(template, candidate, entry, leased, lease_id, deadline)
                if outcome in (Claim.WON, Claim.LEASE_GONE, Claim.RETRY):
                    break
            else:
                taken = set(view.entries)
                for _ in range(LOST_RACES_BEFORE_REREAD):
                    candidate = pick_free_subnet(cidr, subnet_len, taken, self.rng)
                    if candidate is None:
                        if taken == set(view.entries):
                            raise SubnetExhausted(
                                f"no free /{subnet_len} subnet left in {cidr} for node {node}: "
                                f"all {subnet_count(cidr, subnet_len)} are leased"
                            )
                        break  # full only in our stale view: read again
                    outcome = await self._claim(template, candidate, None, leased, lease_id, deadline)
                    if outcome is not Claim.TAKEN:
                        break
                    taken.add(candidate)
            if outcome is Claim.WON and await self._gave_up(node, candidate, deadline):
                continue
            if outcome is Claim.WON:
                for s in unusable:
                    log.warning("subnet %s reserved for node %s is not a /%d of the cluster network %s: "
                                "deleted, as flannel deletes an incompatible lease", s, node, subnet_len, cidr)
                if candidate in reserved:
                    log.info("acquired subnet %s for node %s: reserved for it (its key under no etcd lease, "
                             "kept so)", candidate, node)
                    return dataclasses.replace(template, subnet=candidate, lease_id=None)
                lease = dataclasses.replace(template, subnet=candidate, lease_id=lease_id)
                how = "re-acquired" if candidate in ours or candidate == previous else "acquired"
                log.info("%s subnet %s for node %s under lease %x", how, candidate, node, lease_id)
                return lease
            if outcome is Claim.LEASE_GONE:
                self.keeper.lease_gone(lease_id)

    async def _gave_up(self, node: str, candidate: Network, deadline: float | None) -> bool:
        """After our claim of ``candidate`` won: whether another node's lease overlapping it was
        made first (subnets.earlier_overlaps) -- then our key is deleted again, and the caller
        reads etcd and chooses once more."""
        after = await self.connection.call("read subnets", lambda c: self._read_subnets(c, node), deadline)
        earlier = subnets.earlier_overlaps(after, candidate, node)
        if not earlier:
            return False
        log.warning("subnet %s overlaps %s, leased by another node just before our claim (their cluster's "
                     "subnet length not ours): giving it up", candidate, ", ".join(map(str, earlier)))
        mine = {candidate: after.entries[candidate]}
        if mine[candidate].reserved:
            return True  # not used, but left as reserved: an operator's to delete
        await self.connection.call(f"give up subnet {candidate}",
                                   lambda c: subnets.release(c, self.prefix, mine), deadline)
        return True

    async def _claim(
        self,
        template: SubnetLease,
        candidate: Network,
        entry: Entry | None,
        ours: dict[Network, Entry],
        lease_id: int,
        deadline: float | None,
    ) -> Claim:
        """Claim ``candidate``, dropping ``ours`` (our other leased subnets) in the same
        transaction: under ``lease_id``, or under none if it is reserved for us (``entry``)."""
        stale = {s: e for s, e in ours.items() if s != candidate}
        wider = subnets.wider_subnets(candidate)
        under = 0 if entry is not None and entry.reserved else lease_id
        return await self.connection.call(
            f"claim subnet {candidate}",
            lambda c: subnets.claim(c, self.prefix, template, candidate, entry, stale, under, wider),
            deadline,
        )

    def _read_subnets(self, client: EtcdClient, node: str) -> Awaitable[subnets.SubnetView]:
        return subnets.read_subnets(client, self.prefix, node, self.connection.report_bad)

    async def get_subnet_lease(
        self, subnet: Network | str, *, timeout: float | None = None
    ) -> SubnetLease | None:
        """The lease on ``subnet``, or None; RecordError if the stored value is malformed."""
        subnet = ip_network(subnet)
        got = await self.connection.call(
            "read subnet", lambda c: c.get(subnet_key(self.prefix, subnet)), self.connection.deadline(timeout)
        )
        return None if got is None else SubnetLease.from_json(got.value, subnet, got.lease)

    async def list_subnets(self, *, timeout: float | None = None) -> dict[Network, SubnetLease]:
        head = subnets_prefix(self.prefix)
        got = await self.connection.call("list subnets", lambda c: c.get_prefix(head),
                                         self.connection.deadline(timeout))
        leases: dict[Network, SubnetLease] = {}
        for kv in got:
            try:
                subnet = parse_subnet_key(self.prefix, kv.key)
                leases[subnet] = SubnetLease.from_json(kv.value, subnet, kv.lease)
            except RecordError as e:
                self.connection.report_bad(kv.key, kv.mod_revision, e)
        return leases

    async def release(self, node: str, *, timeout: float | None = None) -> list[Network]:
        """Delete the subnet keys recorded for ``node`` and revoke this instance's lease
        (which removes the node record it registered).  Returns the released subnets.
        A subnet reserved for the node (a record naming it under no etcd lease) stays: as
        flannel's, a reservation is an operator's, and the node takes it again when it joins
        again.  Afterwards this instance holds no lease, node record or subnet."""
        check_node_name(node, "release", "node")
        call, keeper = self.connection.call, self.keeper
        deadline = self.connection.deadline(timeout)
        # The keepalive does not restore keys while we hold the lock.
        async with self.connection.locked(keeper.lock, deadline, "release subnets"):
            released: list[Network] = []
            kept: list[Network] = []
            while True:
                view = await call("read subnets", lambda c: self._read_subnets(c, node), deadline)
                ours = {s: e for s, e in view.held_by(node).items() if not e.reserved}
                kept = sorted((s for s, e in view.held_by(node).items() if e.reserved), key=lambda n: (n.version, n))
                if not ours:
                    break
                ok = await call("release subnets", lambda c: subnets.release(c, self.prefix, ours), deadline)
                if ok:
                    released = sorted(ours, key=lambda n: (n.version, n))
                    break
            # Past this point nothing is ours any more; a failed revoke only means the
            # lease runs out by itself after lease_ttl.
            await keeper.stop()
            lease_id, keeper.lease_id = keeper.lease_id, None
            keeper.node = None
            keeper.subnets.clear()
            if lease_id is not None:
                try:
                    await call("revoke lease", lambda c: c.revoke_lease(lease_id), deadline)
                except Exception as exc:
                    if not is_lease_not_found(exc):
                        raise
        log.info("released node %s: subnets %s; revoked lease %s%s",
                 node, ", ".join(map(str, released)) or "none", f"{lease_id:x}" if lease_id else "none",
                 f"; kept subnets reserved for it (under no etcd lease): {', '.join(map(str, kept))}" if kept else "")
        return released
