"""agentd's datastore: cluster config, node registrations and subnet leases in etcd.

The agent calls, in order: ``connect()``, ``ensure_cluster_config()``,
``acquire_subnet()``, ``register_node()``; then it follows ``watch_nodes()``.
``agentd leave`` calls ``release()`` and ``remove_node()``.

Allocation.  A subnet is taken by ONE etcd transaction that puts the subnet key only
if it does not exist (``version == 0``), so no two nodes can ever hold the same
subnet, however many allocate at once.  Candidates are tried in this order:
the subnet the node had before (from its subnet file), then subnets etcd already
records for this node, then the subnet in the node's own record, then a free one
picked at random (random, not lowest-free, so that concurrent allocators rarely pick
the same one).  A lost race just moves on to another candidate.  The first subnet of
the cluster network (e.g. 10.244.0.0/24) is NOT skipped: it is a subnet like any
other; its network address is never given to a pod (host-local starts at .1) and the
cluster network's own address needs no reservation in a routed design.

Liveness.  The node record and the subnet key share one etcd lease of ``lease_ttl``
seconds, refreshed every ttl/3 by a background task (as etcd's own clientv3 does).
If the lease expires or is revoked, the task grants a new one, puts the node record
again and re-acquires THE SAME subnet if it is still free; if another node took it
meanwhile, ``on_subnet_lost(lease)`` is called.  The task never exits and never
raises: flanneld exits when its lease is revoked or expires (flannel#904, #1240),
we keep going.  Each round also checks that our keys are still there (someone may
have deleted them by hand) and puts them back.

Outages.  Every public method retries with capped exponential backoff (0.1 s
doubling to 5 s, with jitter) until it succeeds, or raises ``DatastoreUnavailable``
once the ``timeout`` it was given has passed.  The keepalive task and
``watch_nodes()`` retry forever; ``connected`` turns False while etcd is unreachable
and True again when it answers, and ``on_state_change(connected)`` is called on each
change.  ``watch_nodes()`` starts with a "snapshot" of all nodes; after an interruption
it resumes from the revision after the last one it delivered, so no event is lost or
repeated, and starts again with a new snapshot only when etcd has compacted that
revision away.

etcd clusters.  With several endpoints (the members of one etcd cluster) the datastore
starts at a random one and moves to the next whenever a request fails transiently
(member down, or cut off from its leader: see agentd.datastore.etcd), so it keeps
working while a majority of the members is up.  Leases live in the replicated state:
a new leader takes them over, extended by their full TTL, so a leader change costs no
lease.  While quorum is lost nothing can be written or read; every call keeps retrying
and the agent keeps its routes as they are.

Malformed records in etcd are logged once (one line, per key and revision) and
skipped; they never stop a list or a watch.  Everything logs to "agentd.datastore".

``Datastore`` is the facade over the parts, each with one job: the connection (client,
retries, failover: agentd.datastore.connection), liveness (the etcd lease and its keepalive:
agentd.datastore.liveness), registration (cluster config and node records:
agentd.datastore.registration), subnet leases (agentd.datastore.leases) and watches
(agentd.datastore.watches).
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Any, TypeVar

from agentd.datastore.connection import EtcdConnection, StateCallback
from agentd.datastore.etcd import EtcdClient, parse_endpoint
from agentd.datastore.leases import SubnetLeases
from agentd.datastore.liveness import LeaseKeeper, SubnetLostCallback
from agentd.datastore.records import (
    BACKENDS,
    ENCAPS,
    ClusterConfig,
    DatastoreError,
    DatastoreUnavailable,
    HistoryCompacted,
    NodeEvent,
    NodeRecord,
    RecordError,
    SubnetExhausted,
    SubnetLease,
    config_key,
    normalize_prefix,
)
from agentd.datastore.registration import Registration
from agentd.datastore.watches import KeyValue, PrefixEvent, Watches

__all__ = [
    "BACKENDS",
    "ENCAPS",
    "ClusterConfig",
    "Datastore",
    "DatastoreError",
    "DatastoreUnavailable",
    "HistoryCompacted",
    "KeyValue",
    "NodeEvent",
    "NodeRecord",
    "PrefixEvent",
    "RecordError",
    "SubnetExhausted",
    "SubnetLease",
]

T = TypeVar("T")


class Datastore:
    """The agent's view of etcd.  One instance per agent; all methods are coroutines.

    Each call is one of a part's (each part is usable alone):

    ``registration``  ensure_cluster_config, get_cluster_config, register_node, update_node,
                      remove_node, list_nodes
    ``leases``        acquire_subnet, set_subnet_backend_data, get_subnet_lease, list_subnets,
                      release
    ``watches``       watch_nodes, watch_prefix
    ``keeper``        the etcd lease and its keepalive (``lease_id``, ``node``, ``subnet_lease``,
                      ``lease_renewals``)
    ``connection``    the client, retries and failover (``connect``, ``request``, ``get_at``,
                      ``close``, ``connected``, ``endpoint``)
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str = "/agentd",
        *,
        lease_ttl: int = 30,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        request_timeout: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        targets = [parse_endpoint(e) for e in endpoints]
        if not targets:
            raise ValueError("etcd endpoints: at least one endpoint is needed")
        self.prefix = normalize_prefix(prefix)
        if isinstance(lease_ttl, bool) or not isinstance(lease_ttl, int) or lease_ttl < 1:
            raise ValueError(f"etcd lease_ttl must be a whole number of seconds >= 1, got {lease_ttl!r}")
        self.lease_ttl = lease_ttl
        rng = rng or random.Random()
        self.connection = EtcdConnection(targets, ca=ca, cert=cert, key=key, clock=clock,
                                         request_timeout=request_timeout, rng=rng,
                                         state_callback=lambda: self.on_state_change)
        self.request_timeout = self.connection.request_timeout
        self.keeper = LeaseKeeper(self.connection, self.prefix, lease_ttl,
                                  subnet_lost_callback=lambda: self.on_subnet_lost)
        self.registration = Registration(self.connection, self.keeper, self.prefix)
        self.leases = SubnetLeases(self.connection, self.keeper, self.prefix, rng)
        self.watches = Watches(self.connection, self.registration, self.prefix)

        #: Called with True/False when etcd becomes reachable/unreachable (sync or async).
        self.on_state_change: StateCallback | None = None
        #: Called with the lost SubnetLease when another node took our subnet while our
        #: lease was gone.  The datastore then holds no subnet: call acquire_subnet again.
        self.on_subnet_lost: SubnetLostCallback | None = None


    def __repr__(self) -> str:
        return f"Datastore({self.endpoints}, prefix={self.prefix!r}, connected={self.connected})"

    # -- state -------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return bool(self.connection.state)

    @property
    def endpoints(self) -> list[str]:
        return self.connection.urls

    @property
    def endpoint(self) -> str:
        """The endpoint requests go to now (after a transient failure: the next one)."""
        return self.connection.endpoint

    @property
    def lease_id(self) -> int | None:
        """The etcd lease our node record and subnet key are attached to."""
        return self.keeper.lease_id

    @property
    def node(self) -> NodeRecord | None:
        return self.keeper.node

    @property
    def subnet_lease(self) -> SubnetLease | None:
        """The node's first subnet lease (its IPv4 one where it has one)."""
        return self.keeper.subnet

    @property
    def subnet_leases(self) -> dict[int, SubnetLease]:
        """The node's subnet leases by IP version (both in a dual-stack cluster)."""
        return dict(self.keeper.subnets)

    @property
    def lease_renewals(self) -> int:
        """Successful lease keepalives (agentd_subnet_lease_renewals_total)."""
        return self.keeper.renewals

    # -- connection ----------------------------------------------------------------

    async def connect(self, timeout: float | None = None) -> None:
        """Reach etcd (retrying with backoff); DatastoreUnavailable after ``timeout`` seconds."""
        await self.connection.call("connect", lambda c: c.get(config_key(self.prefix)),
                                   self.connection.deadline(timeout))

    async def close(self) -> None:
        """Stop background work and close connections.  Leases are NOT revoked: a restart
        within lease_ttl finds its node record and subnet still in place."""
        if self.connection.closed:
            return
        self.connection.closed = True
        await self.keeper.stop()
        await self.connection.shut()

    async def request(
        self, what: str, op: Callable[[EtcdClient], Awaitable[T]], *, timeout: float | None = None
    ) -> T:
        """Run ``op(client)`` against etcd with the datastore's retries and endpoint failover
        (for stores built on this one, e.g. agentd.resources); DatastoreUnavailable after
        ``timeout`` seconds."""
        return await self.connection.call(what, op, self.connection.deadline(timeout))

    async def get_at(self, key: bytes, revision: int, *, timeout: float | None = None) -> KeyValue | None:
        """``key`` as it was at ``revision`` (etcd keeps old revisions until it compacts them);
        None if it did not exist then; HistoryCompacted if that revision is compacted away."""
        got = await self.request("read history", lambda c: c.get_at(key, revision), timeout=timeout)
        return None if got is None else KeyValue(key, got.value, got.mod_revision, got.lease)

    # -- registration --------------------------------------------------------------------

    async def ensure_cluster_config(self, wanted: ClusterConfig, *, timeout: float | None = None) -> ClusterConfig:
        """Store ``wanted`` if no config exists (one transaction); else return the stored one."""
        return await self.registration.ensure_cluster_config(wanted, timeout=timeout)

    async def get_cluster_config(self, *, timeout: float | None = None) -> ClusterConfig | None:
        return await self.registration.get_cluster_config(timeout=timeout)

    async def ensure_read_token(self, wanted: str, *, timeout: float | None = None) -> str:
        """The cluster's read credential (first writer wins): what agents show each other."""
        return await self.registration.ensure_read_token(wanted, timeout=timeout)

    async def register_node(self, record: NodeRecord, *, timeout: float | None = None) -> None:
        """Put our node record under our liveness lease; the keepalive task keeps it there."""
        await self.registration.register_node(record, timeout=timeout)

    async def update_node(self, record: NodeRecord, *, timeout: float | None = None) -> None:
        """Replace our registered node record (same name)."""
        await self.registration.update_node(record, timeout=timeout)

    async def remove_node(self, name: str, *, timeout: float | None = None) -> bool:
        """Delete ``<prefix>/nodes/<name>``; True if it existed."""
        return await self.registration.remove_node(name, timeout=timeout)

    async def list_nodes(self, *, timeout: float | None = None) -> dict[str, NodeRecord]:
        return await self.registration.list_nodes(timeout=timeout)

    # -- watches -------------------------------------------------------------------------

    def watch_nodes(self) -> AsyncIterator[NodeEvent]:
        """A "snapshot" of every node, then "put"/"delete" events (see :meth:`watch_prefix`)."""
        return self.watches.watch_nodes()

    def watch_read_token(self) -> AsyncIterator[str | None]:
        """The cluster read token now and at every change (None: none stored; see
        :meth:`agentd.datastore.watches.Watches.watch_read_token`)."""
        return self.watches.watch_read_token()

    def watch_prefix(self, prefix: bytes, what: str = "watch") -> AsyncIterator[PrefixEvent]:
        """Every key under ``prefix``: a "snapshot", then a "put" or "delete" per change,
        resumed after interruptions (agentd.datastore.watches)."""
        return self.watches.watch_prefix(prefix, what)

    # -- subnet leases -------------------------------------------------------------------

    async def acquire_subnet(
        self,
        node: str,
        public_ip: IPv4Address | IPv6Address | str,
        backend_type: str,
        backend_data: dict[str, Any],
        *,
        cluster: ClusterConfig,
        previous: IPv4Network | IPv6Network | str | None = None,
        timeout: float | None = None,
        version: int = 4,
    ) -> SubnetLease:
        """Lease a subnet of the cluster's IPv``version`` pod network for ``node`` (see the
        module doc for the order); a dual-stack node calls this once per family."""
        return await self.leases.acquire_subnet(node, public_ip, backend_type, backend_data, cluster=cluster,
                                                previous=previous, timeout=timeout, version=version)

    async def set_subnet_backend_data(self, backend_data: dict[str, Any], *, timeout: float | None = None) -> bool:
        """Publish ``backend_data`` in our subnet lease record too; True if written."""
        return await self.leases.set_subnet_backend_data(backend_data, timeout=timeout)

    async def get_subnet_lease(self, subnet: IPv4Network | IPv6Network | str, *,
                               timeout: float | None = None) -> SubnetLease | None:
        """The lease on ``subnet``, or None; RecordError if the stored value is malformed."""
        return await self.leases.get_subnet_lease(subnet, timeout=timeout)

    async def list_subnets(self, *, timeout: float | None = None) -> dict[IPv4Network | IPv6Network, SubnetLease]:
        return await self.leases.list_subnets(timeout=timeout)

    async def release(self, node: str, *, timeout: float | None = None) -> list[IPv4Network | IPv6Network]:
        """Delete the subnet keys recorded for ``node`` and revoke this instance's lease (which
        removes the node record it registered).  Returns the released subnets."""
        return await self.leases.release(node, timeout=timeout)
