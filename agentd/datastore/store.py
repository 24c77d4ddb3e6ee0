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
(member down, or cut off from its leader: see ``_datastore_etcd``), so it keeps
working while a majority of the members is up.  Leases live in the replicated state:
a new leader takes them over, extended by their full TTL, so a leader change costs no
lease.  While quorum is lost nothing can be written or read; every call keeps retrying
and the agent keeps its routes as they are.

Malformed records in etcd are logged once (one line, per key and revision) and
skipped; they never stop a list or a watch.  Everything logs to "agentd.datastore".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from ipaddress import IPv4Address, IPv4Network
from typing import Any, TypeVar

import aetcd
from aetcd import transactions as tx

from agentd.datastore import subnets
from agentd.datastore.etcd import (
    EtcdClient,
    describe,
    is_lease_not_found,
    is_transient,
    parse_endpoint,
    tls_credentials,
)
from agentd.datastore.records import (
    BACKENDS,
    ENCAPS,
    Backoff,
    ClusterConfig,
    DatastoreError,
    DatastoreUnavailable,
    NodeEvent,
    NodeRecord,
    RecordError,
    SubnetExhausted,
    SubnetLease,
    check_node_name,
    config_key,
    is_cluster_subnet,
    node_key,
    nodes_prefix,
    normalize_prefix,
    parse_node,
    parse_node_key,
    parse_subnet_key,
    pick_free_subnet,
    subnet_count,
    subnet_key,
    subnets_prefix,
)
from agentd.datastore.subnets import Claim, Entry

__all__ = [
    "BACKENDS",
    "ENCAPS",
    "ClusterConfig",
    "Datastore",
    "DatastoreError",
    "DatastoreUnavailable",
    "KeyValue",
    "NodeEvent",
    "PrefixEvent",
    "NodeRecord",
    "RecordError",
    "SubnetExhausted",
    "SubnetLease",
]

log = logging.getLogger("agentd.datastore")


@dataclasses.dataclass(frozen=True)
class KeyValue:
    """One etcd key-value as a watch or a read delivers it (``lease`` 0: none)."""

    key: bytes
    value: bytes
    mod_revision: int
    lease: int


@dataclasses.dataclass(frozen=True)
class PrefixEvent:
    """From :meth:`Datastore.watch_prefix`: "snapshot" (``kvs``: every key, at ``revision``),
    "put" or "delete" (``kvs``: the one key; a delete's value is empty)."""

    kind: str
    revision: int
    kvs: list[KeyValue]

T = TypeVar("T")
StateCallback = Callable[[bool], Any]
SubnetLostCallback = Callable[[SubnetLease], Any]

# A subnet allocator that loses this many races in a row re-reads etcd's view.
_LOST_RACES_BEFORE_REREAD = 8


class Datastore:
    """The agent's view of etcd.  One instance per agent; all methods are coroutines."""

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
        self._endpoints = [parse_endpoint(e) for e in endpoints]
        if not self._endpoints:
            raise ValueError("etcd endpoints: at least one endpoint is needed")
        self.prefix = normalize_prefix(prefix)
        if isinstance(lease_ttl, bool) or not isinstance(lease_ttl, int) or lease_ttl < 1:
            raise ValueError(f"etcd lease_ttl must be a whole number of seconds >= 1, got {lease_ttl!r}")
        self.lease_ttl = lease_ttl
        if not request_timeout > 0:
            raise ValueError(f"etcd request_timeout must be > 0, got {request_timeout!r}")
        self.request_timeout = float(request_timeout)
        tls = any(e.tls for e in self._endpoints)
        if (ca or cert or key) and not tls:
            raise ValueError("etcd TLS: ca/cert/key are set but no endpoint is https://")
        self._credentials = tls_credentials(ca, cert, key) if tls else None
        self._clock = clock
        self._rng = rng or random.Random()

        #: Called with True/False when etcd becomes reachable/unreachable (sync or async).
        self.on_state_change: StateCallback | None = None
        #: Called with the lost SubnetLease when another node took our subnet while our
        #: lease was gone.  The datastore then holds no subnet: call acquire_subnet again.
        self.on_subnet_lost: SubnetLostCallback | None = None
        #: Successful lease keepalives (agentd_subnet_lease_renewals_total).
        self.lease_renewals = 0

        self._connected: bool | None = None  # None: not tried yet
        self._closed = False
        # Start at a random member, so that the agents of a cluster spread over its members.
        self._endpoint_index = self._rng.randrange(len(self._endpoints))
        self._current: EtcdClient | None = None
        self._retiring: set[asyncio.Task] = set()
        self._watch_clients: set[EtcdClient] = set()
        self._callback_tasks: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()
        self._lease_id: int | None = None
        self._node: NodeRecord | None = None
        self._subnet: SubnetLease | None = None
        self._keepalive_task: asyncio.Task | None = None
        self._reported_bad: set[tuple[bytes, int]] = set()
        self._reported_conflicts: set[tuple[bytes, int]] = set()

    def __repr__(self) -> str:
        return f"Datastore({self.endpoints}, prefix={self.prefix!r}, connected={self.connected})"

    # -- state -------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return bool(self._connected)

    @property
    def endpoints(self) -> list[str]:
        return [e.url for e in self._endpoints]

    @property
    def endpoint(self) -> str:
        """The endpoint requests go to now (after a transient failure: the next one)."""
        return self._endpoints[self._endpoint_index % len(self._endpoints)].url

    @property
    def lease_id(self) -> int | None:
        """The etcd lease our node record and subnet key are attached to."""
        return self._lease_id

    @property
    def node(self) -> NodeRecord | None:
        return self._node

    @property
    def subnet_lease(self) -> SubnetLease | None:
        return self._subnet

    # -- connection ----------------------------------------------------------------

    async def connect(self, timeout: float | None = None) -> None:
        """Reach etcd (retrying with backoff); DatastoreUnavailable after ``timeout`` seconds."""
        await self._call("connect", lambda c: c.get(config_key(self.prefix)), self._deadline(timeout))

    async def close(self) -> None:
        """Stop background work and close connections.  Leases are NOT revoked: a restart
        within lease_ttl finds its node record and subnet still in place."""
        if self._closed:
            return
        self._closed = True
        await self._stop_keepalive()
        if self._connected:
            self._connected = False
            self._notify("on_state_change", self.on_state_change, False)
        if self._callback_tasks:
            await asyncio.wait(list(self._callback_tasks), timeout=1.0)
        clients = [c for c in (self._current, *self._watch_clients) if c is not None]
        self._current = None
        for task in list(self._retiring) + list(self._callback_tasks):
            task.cancel()
        await asyncio.gather(*self._retiring, *self._callback_tasks, return_exceptions=True)
        await asyncio.gather(*(_close_quietly(c) for c in clients))

    def _client(self) -> EtcdClient:
        if self._closed:
            raise DatastoreError("the datastore is closed")
        if self._current is None:
            self._current = self._new_client(self._endpoint_index)
        return self._current

    def _new_client(self, index: int) -> EtcdClient:
        endpoint = self._endpoints[index % len(self._endpoints)]
        credentials = self._credentials if endpoint.tls else None
        return EtcdClient(endpoint, timeout=self.request_timeout, credentials=credentials)

    def _failover(self, client: EtcdClient) -> None:
        """After a transient failure, move to the next endpoint (if there is one)."""
        if len(self._endpoints) < 2 or self._current is not client:
            return
        self._endpoint_index += 1
        self._current = None
        # Other coroutines may still be using the old client: close it a little later.
        task = asyncio.get_running_loop().create_task(self._close_later(client))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _close_later(self, client: EtcdClient) -> None:
        try:
            await asyncio.sleep(2 * self.request_timeout)
        finally:
            await _close_quietly(client)

    def _set_connected(self, up: bool, reason: str = "") -> None:
        if up is self._connected or self._closed:
            return
        self._connected = up
        if up:
            log.info("etcd reachable at %s", ", ".join(self.endpoints))
        else:
            log.warning("etcd unreachable at %s (%s); retrying with backoff", ", ".join(self.endpoints), reason)
        self._notify("on_state_change", self.on_state_change, up)

    def _notify(self, what: str, callback: Callable[..., Any] | None, *args: Any) -> None:
        """Run a user callback; its failure is logged, never raised into our tasks."""
        if callback is None:
            return
        try:
            result = callback(*args)
        except Exception as exc:
            log.error("%s callback failed: %s", what, describe(exc))
            return
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._callback_tasks.add(task)
            task.add_done_callback(lambda t: self._callback_done(what, t))

    def _callback_done(self, what: str, task: asyncio.Future) -> None:
        self._callback_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s callback failed: %s", what, describe(task.exception()))

    def _deadline(self, timeout: float | None) -> float | None:
        return None if timeout is None else self._clock() + timeout

    def _backoff(self, cap: float = 5.0) -> Backoff:
        return Backoff(cap=cap, rng=self._rng)

    async def _call(self, what: str, op: Callable[[EtcdClient], Awaitable[T]], deadline: float | None) -> T:
        """Run ``op`` against etcd, retrying transient failures with backoff until ``deadline``."""
        backoff = self._backoff()
        problem = ""
        while True:
            client = self._client()
            remaining = None if deadline is None else deadline - self._clock()
            try:
                if remaining is None:
                    result = await op(client)
                elif remaining <= 0:
                    raise asyncio.TimeoutError()
                else:
                    result = await asyncio.wait_for(op(client), remaining)
            except asyncio.CancelledError:
                if self._closed_under_us():
                    raise DatastoreError(f"the datastore was closed during {what}") from None
                raise
            except Exception as exc:
                if not is_transient(exc):
                    raise
                if not isinstance(exc, asyncio.TimeoutError) or not problem:
                    problem = describe(exc)  # a deadline cut is less telling than the error before it
                self._set_connected(False, f"{what}: {problem}")
                self._failover(client)
                delay = backoff.next()
                if deadline is not None:
                    remaining = deadline - self._clock()
                    if remaining <= 0:
                        raise DatastoreUnavailable(
                            f"etcd at {', '.join(self.endpoints)} unreachable ({what}): {problem}"
                        ) from None
                    delay = min(delay, remaining)
                await asyncio.sleep(delay)
            else:
                self._set_connected(True)
                return result

    def _closed_under_us(self) -> bool:
        """True if a CancelledError came from close() shutting a channel, not from our caller."""
        task = asyncio.current_task()
        return self._closed and (task is None or task.cancelling() == 0)

    # -- cluster config -------------------------------------------------------------

    async def ensure_cluster_config(self, wanted: ClusterConfig, *, timeout: float | None = None) -> ClusterConfig:
        """Store ``wanted`` if no config exists (one transaction); else return the stored one."""
        key = config_key(self.prefix)
        ok, responses = await self._call(
            "store cluster config",
            lambda c: c.transaction(
                compare=[tx.Version(key) == 0], success=[tx.Put(key, wanted.to_json())], failure=[tx.Get(key)]
            ),
            self._deadline(timeout),
        )
        if ok:
            log.info("stored cluster config at %s: %s", key.decode(), wanted.to_json().decode())
            return wanted
        return _parse_config(key, responses[0][0][0])

    async def get_cluster_config(self, *, timeout: float | None = None) -> ClusterConfig | None:
        key = config_key(self.prefix)
        got = await self._call("read cluster config", lambda c: c.get(key), self._deadline(timeout))
        return None if got is None else _parse_config(key, got.value)

    # -- leases -----------------------------------------------------------------------

    async def _ensure_lease(self, deadline: float | None) -> int:
        if self._lease_id is None:
            lease = await self._call("grant lease", lambda c: c.lease(self.lease_ttl), deadline)
            self._lease_id = lease.id
            log.info("granted etcd lease %x (ttl %ss)", lease.id, lease.ttl)
        self._start_keepalive()
        return self._lease_id

    async def _with_lease(
        self, what: str, op: Callable[[EtcdClient, int], Awaitable[T]], deadline: float | None
    ) -> T:
        """Run ``op(client, lease_id)``; if etcd says the lease is gone, grant a new one and retry."""
        while True:
            lease_id = await self._ensure_lease(deadline)
            try:
                return await self._call(what, lambda c: op(c, lease_id), deadline)
            except Exception as exc:
                if not is_lease_not_found(exc):
                    raise
                self._lease_gone(lease_id)

    def _lease_gone(self, lease_id: int) -> None:
        if self._lease_id == lease_id:
            log.warning("etcd lease %x is gone (expired or revoked); granting a new one", lease_id)
            self._lease_id = None

    # -- nodes ------------------------------------------------------------------------

    async def register_node(self, record: NodeRecord, *, timeout: float | None = None) -> None:
        """Put our node record under our liveness lease; the keepalive task keeps it there."""
        if not isinstance(record, NodeRecord):
            raise TypeError(f"register_node needs a NodeRecord, got {type(record).__name__}")
        deadline = self._deadline(timeout)
        key, value = node_key(self.prefix, record.name), record.to_json()
        async with self._lock:
            old = self._node
            await self._with_lease("register node", lambda c, lease: c.put(key, value, lease=lease), deadline)
            self._node = record
            log.info("registered node %s (address %s, subnet %s) under lease %x",
                     record.name, record.address, record.subnet, self._lease_id or 0)
            if old is not None and old.name != record.name:
                old_key = node_key(self.prefix, old.name)
                await self._call("remove old node name", lambda c: c.delete(old_key), deadline)

    async def update_node(self, record: NodeRecord, *, timeout: float | None = None) -> None:
        """Replace our registered node record (same name)."""
        if self._node is None or self._node.name != getattr(record, "name", None):
            raise ValueError(f"update_node: node {getattr(record, 'name', record)!r} is not registered here")
        await self.register_node(record, timeout=timeout)

    async def remove_node(self, name: str, *, timeout: float | None = None) -> bool:
        """Delete ``<prefix>/nodes/<name>``; True if it existed."""
        key = node_key(self.prefix, name)
        async with self._lock:
            if self._node is not None and self._node.name == name:
                self._node = None  # or the keepalive would put it back
            deleted = await self._call("remove node", lambda c: c.delete(key), self._deadline(timeout))
        log.info("removed node %s%s", name, "" if deleted else " (it was not registered)")
        return deleted is not None

    async def list_nodes(self, *, timeout: float | None = None) -> dict[str, NodeRecord]:
        prefix = nodes_prefix(self.prefix)
        got = await self._call("list nodes", lambda c: c.get_prefix(prefix), self._deadline(timeout))
        return self._parse_nodes(got)

    def _parse_nodes(self, kvs: Any) -> dict[str, NodeRecord]:
        nodes: dict[str, NodeRecord] = {}
        for kv in kvs:
            record = self._parse_node_kv(kv.key, kv.value, kv.mod_revision)
            if record is not None:
                nodes[record.name] = record
        return nodes

    def _parse_node_kv(self, key: bytes, value: bytes, mod_revision: int) -> NodeRecord | None:
        try:
            return parse_node(self.prefix, key, value)
        except RecordError as e:
            self._report_bad(key, mod_revision, e)
            return None

    def _report_bad(self, key: bytes, mod_revision: int, error: Exception) -> None:
        """Log a malformed record once per key and revision."""
        if (key, mod_revision) in self._reported_bad:
            return
        if len(self._reported_bad) > 10000:
            self._reported_bad.clear()
        self._reported_bad.add((key, mod_revision))
        log.warning("skipping malformed record at %s: %s", key.decode(errors="replace"), error)

    async def watch_nodes(self) -> AsyncIterator[NodeEvent]:
        """A "snapshot" of every node, then "put"/"delete" events (see :meth:`watch_prefix`).
        Runs until the consumer stops iterating."""
        nodes: dict[str, NodeRecord] = {}
        async for ev in self.watch_prefix(nodes_prefix(self.prefix), "node watch"):
            if ev.kind == "snapshot":
                nodes = self._parse_nodes(ev.kvs)
                yield NodeEvent("snapshot", nodes=dict(nodes))
                continue
            item = self._node_event(ev.kvs[0], ev.kind, nodes)
            if item is not None:
                yield item

    async def watch_prefix(self, prefix: bytes, what: str = "watch") -> AsyncIterator[PrefixEvent]:
        """Every key under ``prefix``: a "snapshot" (all key-values at one revision), then a
        "put" or "delete" per change.  After an interruption (a member lost, a leader change,
        an outage) the watch resumes on the next endpoint from the revision after the last
        one delivered, so no event is lost or repeated; a new snapshot only follows a
        compaction (or an error we cannot place).  Runs until the consumer stops iterating."""
        backoff = self._backoff()
        index = self._endpoint_index
        interrupted = False
        revision: int | None = None  # every event up to here is delivered; None: snapshot first
        while not self._closed:
            # Its own connection: aetcd serves all watches of a client over one stream,
            # and a fresh client per attempt starts from a clean watcher state.
            client = self._new_client(index)
            self._watch_clients.add(client)
            try:
                if revision is None:
                    got = await asyncio.wait_for(client.get_prefix(prefix), self.request_timeout)
                    revision = got.header.revision
                    kvs = [KeyValue(kv.key, kv.value, kv.mod_revision, kv.lease) for kv in got]
                    self._set_connected(True)
                    if interrupted:
                        log.info("%s re-synced at revision %d (%d keys)", what, revision, len(kvs))
                    yield PrefixEvent("snapshot", revision, kvs)
                watch = await client.watch_prefix(prefix, start_revision=revision + 1)
                self._set_connected(True)
                if interrupted:
                    log.info("%s resumed at revision %d on %s", what, revision + 1, client.endpoint.url)
                interrupted = False
                backoff.reset()
                async for event in watch:
                    # aetcd queues all events of a watch response before any error, so a
                    # revision is never split across an interruption.
                    revision = max(revision, event.kv.mod_revision)
                    kv = KeyValue(event.kv.key, event.kv.value, event.kv.mod_revision, event.kv.lease)
                    kind = "delete" if event.kind == aetcd.EventKind.DELETE else "put"
                    yield PrefixEvent(kind, event.kv.mod_revision, [kv])
                if self._closed:
                    return
                raise aetcd.ClientError("watch canceled by etcd")
            except asyncio.CancelledError:
                if self._closed_under_us():
                    return
                raise
            except Exception as exc:
                if self._closed:
                    return
                compacted = isinstance(exc, aetcd.RevisionCompactedError)
                if is_transient(exc):
                    self._set_connected(False, f"{what}: {describe(exc)}")
                    index += 1
                else:
                    revision = None  # compacted, or not understood: start again from a snapshot
                if not interrupted:
                    level = logging.WARNING if (compacted or is_transient(exc)) else logging.ERROR
                    how = "resuming" if revision is not None else "re-syncing with a new snapshot"
                    log.log(level, "%s interrupted (%s); %s", what, describe(exc), how)
                interrupted = True
                await asyncio.sleep(0 if compacted else backoff.next())
            finally:
                self._watch_clients.discard(client)
                await _close_quietly(client)

    async def request(
        self, what: str, op: Callable[[EtcdClient], Awaitable[T]], *, timeout: float | None = None
    ) -> T:
        """Run ``op(client)`` against etcd with the datastore's retries and endpoint failover
        (for stores built on this one, e.g. agentd.resources); DatastoreUnavailable after
        ``timeout`` seconds."""
        return await self._call(what, op, self._deadline(timeout))

    def _node_event(self, kv: KeyValue, kind: str, nodes: dict[str, NodeRecord]) -> NodeEvent | None:
        key = kv.key
        if kind == "delete":
            try:
                name = parse_node_key(self.prefix, key)
            except RecordError:
                return None
            return NodeEvent("delete", name=name) if nodes.pop(name, None) is not None else None
        record = self._parse_node_kv(key, kv.value, kv.mod_revision)
        if record is None:
            # The record we knew became unreadable: to the consumer it is gone.
            with contextlib.suppress(RecordError):
                name = parse_node_key(self.prefix, key)
                if nodes.pop(name, None) is not None:
                    return NodeEvent("delete", name=name)
            return None
        nodes[record.name] = record
        return NodeEvent("put", name=record.name, record=record)

    # -- subnets ----------------------------------------------------------------------

    async def acquire_subnet(
        self,
        node: str,
        public_ip: IPv4Address | str,
        backend_type: str,
        backend_data: dict[str, Any],
        *,
        cluster: ClusterConfig,
        previous: IPv4Network | str | None = None,
        timeout: float | None = None,
    ) -> SubnetLease:
        """Lease a /subnet_len of cluster.cidr for ``node`` (see the module doc for the order)."""
        check_node_name(node, "acquire_subnet", "node")
        template = SubnetLease(
            subnet=cluster.cidr,  # replaced by each candidate
            node=node,
            public_ip=public_ip,
            backend_type=backend_type,
            backend_data=backend_data,
        )
        if previous is not None:
            previous = IPv4Network(previous)
            if not is_cluster_subnet(cluster, previous):
                log.warning("previous subnet %s is not a /%d of the cluster network %s; ignoring it",
                            previous, cluster.subnet_len, cluster.cidr)
                previous = None
        deadline = self._deadline(timeout)
        async with self._lock:
            lease = await self._allocate(template, cluster, previous, deadline)
            self._subnet = lease
        return lease

    async def set_subnet_backend_data(self, backend_data: dict[str, Any], *, timeout: float | None = None) -> bool:
        """Publish ``backend_data`` (our VTEP MAC, UDP port...) in our subnet lease record too,
        as flannel does; the node record carries the same.  Never moves or re-takes the lease:
        the record is rewritten only while it is still the one we wrote.  True if written."""
        async with self._lock:
            lease = self._subnet
            if lease is None or lease.lease_id is None or lease.backend_data == backend_data:
                return False
            new = dataclasses.replace(lease, backend_data=dict(backend_data))
            self._subnet = new  # a re-claim after an etcd outage writes the new data too
            ok = await self._call(
                "publish subnet backend data",
                lambda c: subnets.rewrite(c, self.prefix, lease, new),
                self._deadline(timeout),
            )
        if not ok:
            log.warning("subnet %s: its record changed meanwhile; backend data not published", lease.subnet)
        return ok

    async def _allocate(
        self, template: SubnetLease, cluster: ClusterConfig, previous: IPv4Network | None, deadline: float | None
    ) -> SubnetLease:
        node = template.node
        while True:
            lease_id = await self._ensure_lease(deadline)
            view = await self._call("read subnets", lambda c: self._read_subnets(c, node), deadline)
            ours = view.held_by(node)
            preferred = [previous, *sorted(ours), view.node_subnet]
            outcome = Claim.RETRY
            tried: set[IPv4Network] = set()
            for candidate in preferred:
                if candidate is None or candidate in tried or not is_cluster_subnet(cluster, candidate):
                    continue
                tried.add(candidate)
                entry = view.entries.get(candidate)
                if entry is not None and candidate not in ours:
                    continue  # someone else's
                outcome = await self._claim(template, candidate, entry, ours, lease_id, deadline)
                if outcome in (Claim.WON, Claim.LEASE_GONE, Claim.RETRY):
                    break
            else:
                taken = set(view.entries)
                for _ in range(_LOST_RACES_BEFORE_REREAD):
                    candidate = pick_free_subnet(cluster.cidr, cluster.subnet_len, taken, self._rng)
                    if candidate is None:
                        if taken == set(view.entries):
                            raise SubnetExhausted(
                                f"no free /{cluster.subnet_len} subnet left in {cluster.cidr} for node {node}: "
                                f"all {subnet_count(cluster.cidr, cluster.subnet_len)} are leased"
                            )
                        break  # full only in our stale view: read again
                    outcome = await self._claim(template, candidate, None, ours, lease_id, deadline)
                    if outcome is not Claim.TAKEN:
                        break
                    taken.add(candidate)
            if outcome is Claim.WON:
                lease = dataclasses.replace(template, subnet=candidate, lease_id=lease_id)
                how = "re-acquired" if candidate in ours or candidate == previous else "acquired"
                log.info("%s subnet %s for node %s under lease %x", how, candidate, node, lease_id)
                return lease
            if outcome is Claim.LEASE_GONE:
                self._lease_gone(lease_id)

    async def _claim(
        self,
        template: SubnetLease,
        candidate: IPv4Network,
        entry: Entry | None,
        ours: dict[IPv4Network, Entry],
        lease_id: int,
        deadline: float | None,
    ) -> Claim:
        stale = {s: e for s, e in ours.items() if s != candidate}
        return await self._call(
            f"claim subnet {candidate}",
            lambda c: subnets.claim(c, self.prefix, template, candidate, entry, stale, lease_id),
            deadline,
        )

    def _read_subnets(self, client: EtcdClient, node: str) -> Awaitable[subnets.SubnetView]:
        return subnets.read_subnets(client, self.prefix, node, self._report_bad)

    async def get_subnet_lease(
        self, subnet: IPv4Network | str, *, timeout: float | None = None
    ) -> SubnetLease | None:
        """The lease on ``subnet``, or None; RecordError if the stored value is malformed."""
        subnet = IPv4Network(subnet)
        got = await self._call(
            "read subnet", lambda c: c.get(subnet_key(self.prefix, subnet)), self._deadline(timeout)
        )
        return None if got is None else SubnetLease.from_json(got.value, subnet, got.lease)

    async def list_subnets(self, *, timeout: float | None = None) -> dict[IPv4Network, SubnetLease]:
        head = subnets_prefix(self.prefix)
        got = await self._call("list subnets", lambda c: c.get_prefix(head), self._deadline(timeout))
        leases: dict[IPv4Network, SubnetLease] = {}
        for kv in got:
            try:
                subnet = parse_subnet_key(self.prefix, kv.key)
                leases[subnet] = SubnetLease.from_json(kv.value, subnet, kv.lease)
            except RecordError as e:
                self._report_bad(kv.key, kv.mod_revision, e)
        return leases

    async def release(self, node: str, *, timeout: float | None = None) -> list[IPv4Network]:
        """Delete the subnet keys recorded for ``node`` and revoke this instance's lease
        (which removes the node record it registered).  Returns the released subnets.
        Afterwards this instance holds no lease, node record or subnet."""
        check_node_name(node, "release", "node")
        deadline = self._deadline(timeout)
        async with self._lock:  # the keepalive does not restore keys while we hold it
            released: list[IPv4Network] = []
            while True:
                view = await self._call("read subnets", lambda c: self._read_subnets(c, node), deadline)
                ours = view.held_by(node)
                if not ours:
                    break
                ok = await self._call("release subnets", lambda c: subnets.release(c, self.prefix, ours), deadline)
                if ok:
                    released = sorted(ours)
                    break
            # Past this point nothing is ours any more; a failed revoke only means the
            # lease runs out by itself after lease_ttl.
            await self._stop_keepalive()
            lease_id, self._lease_id = self._lease_id, None
            self._node = None
            self._subnet = None
            if lease_id is not None:
                try:
                    await self._call("revoke lease", lambda c: c.revoke_lease(lease_id), deadline)
                except Exception as exc:
                    if not is_lease_not_found(exc):
                        raise
        log.info("released node %s: subnets %s; revoked lease %s",
                 node, ", ".join(map(str, released)) or "none", f"{lease_id:x}" if lease_id else "none")
        return released

    # -- keepalive --------------------------------------------------------------------

    def _start_keepalive(self) -> None:
        if self._closed or (self._keepalive_task is not None and not self._keepalive_task.done()):
            return
        self._keepalive_task = asyncio.get_running_loop().create_task(
            self._keepalive_loop(), name="agentd-datastore-keepalive"
        )

    async def _stop_keepalive(self) -> None:
        task, self._keepalive_task = self._keepalive_task, None
        if task is None or task is asyncio.current_task():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    @property
    def _keepalive_interval(self) -> float:
        return max(0.2, self.lease_ttl / 3)

    async def _keepalive_loop(self) -> None:
        """Refresh the lease every ttl/3; restore our keys when needed.  Never exits on error."""
        interval = self._keepalive_interval
        # A failing keep-alive never waits longer than a successful one: when etcd is back
        # (a member restarted, quorum regained) the lease must be refreshed well within its TTL.
        backoff = self._backoff(cap=min(5.0, interval))
        last_problem = ""
        while not self._closed:
            try:
                await self._keepalive_round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if is_transient(exc):
                    self._set_connected(False, f"lease keepalive: {describe(exc)}")
                elif describe(exc) != last_problem:
                    log.error("lease keepalive failed: %s; retrying", describe(exc))
                last_problem = describe(exc)
                await asyncio.sleep(backoff.next())
            else:
                last_problem = ""
                backoff.reset()
                await asyncio.sleep(interval)

    async def _keepalive_round(self) -> None:
        client = self._client()
        try:
            await self._refresh_lease(client)
            if self._lock.locked():
                return  # a public call is changing our keys right now; check next round
            async with self._lock:
                await self._restore_keys(client)
        except Exception as exc:
            if is_transient(exc):
                self._failover(client)  # the next round asks the next member
            raise

    async def _refresh_lease(self, client: EtcdClient) -> None:
        lease_id = self._lease_id
        if lease_id is None:
            return
        # A member that went silent (cut off: no reset, no answer) must not hold the refresh
        # much past the next one is due: the lease (TTL = 3 intervals) is refreshed elsewhere
        # in time.  At least 1 s, or a merely busy member would count as lost.
        timeout = min(self.request_timeout, max(1.0, self._keepalive_interval))
        reply = await asyncio.wait_for(client.refresh_lease(lease_id), timeout)
        if reply is None:  # no answer about the lease: never take that for "expired"
            raise aetcd.ConnectionFailedError("lease keep-alive stream ended without a reply")
        self._set_connected(True)
        if reply.TTL > 0:
            self.lease_renewals += 1
        elif self._lease_id == lease_id:
            log.warning("etcd lease %x expired or was revoked; granting a new one and restoring %s",
                        lease_id, self._holdings())
            self._lease_id = None

    def _holdings(self) -> str:
        parts = []
        if self._node is not None:
            parts.append(f"node {self._node.name}")
        if self._subnet is not None:
            parts.append(f"subnet {self._subnet.subnet}")
        return " and ".join(parts) or "nothing"

    async def _restore_keys(self, client: EtcdClient) -> None:
        """Make sure our node record and subnet key exist under our lease."""
        node, subnet = self._node, self._subnet
        if node is None and subnet is None:
            return
        if self._lease_id is None:
            lease = await client.lease(self.lease_ttl)
            self._lease_id = lease.id
            log.info("granted new etcd lease %x (ttl %ss)", lease.id, lease.ttl)
        lease_id = self._lease_id
        keys = [node_key(self.prefix, node.name)] if node else []
        keys += [subnet_key(self.prefix, subnet.subnet)] if subnet else []
        _, found = await client.transaction(compare=[], success=[tx.Get(k) for k in keys], failure=[])
        node_kvs = found[0] if node else []
        if subnet is not None:
            await self._restore_subnet(client, subnet, found[-1], lease_id)
        if node is not None and self._lease_id == lease_id:
            if not node_kvs:
                try:
                    await client.put(keys[0], node.to_json(), lease=lease_id)
                except Exception as exc:
                    if not is_lease_not_found(exc):
                        raise
                    self._lease_gone(lease_id)
                    return
                log.info("restored node record %s under lease %x", node.name, lease_id)
            elif node_kvs[0][1].lease != lease_id:
                self._report_conflict(keys[0], node_kvs[0][1].mod_revision, "node record")

    async def _restore_subnet(self, client: EtcdClient, subnet: SubnetLease, kvs: list, lease_id: int) -> None:
        if not kvs:
            outcome = await subnets.claim(client, self.prefix, subnet, subnet.subnet, None, {}, lease_id)
            if outcome is Claim.WON:
                self._subnet = dataclasses.replace(subnet, lease_id=lease_id)
                log.info("re-acquired subnet %s for node %s under lease %x", subnet.subnet, subnet.node, lease_id)
                return
            if outcome is Claim.LEASE_GONE:
                self._lease_gone(lease_id)
                return
            if outcome is Claim.RETRY:
                return
            kvs = await client.get(subnet_key(self.prefix, subnet.subnet))
            kvs = [(kvs.value, kvs)] if kvs is not None else []
            if not kvs:
                return
        value, kv = kvs[0]
        try:
            holder = SubnetLease.from_json(value, subnet.subnet, kv.lease).node
        except RecordError:
            holder = "an unreadable record"
        if holder == subnet.node:
            if kv.lease != lease_id:
                self._report_conflict(kv.key, kv.mod_revision, "subnet key")
            return
        self._subnet = None
        log.error("subnet %s of node %s was taken by %s while our etcd lease was gone; it is lost",
                  subnet.subnet, subnet.node, holder)
        self._notify("on_subnet_lost", self.on_subnet_lost, subnet)

    def _report_conflict(self, key: bytes, mod_revision: int, what: str) -> None:
        if (key, mod_revision) in self._reported_conflicts:
            return
        self._reported_conflicts.add((key, mod_revision))
        log.error("%s %s is held under another etcd lease than ours (%x): is another agent running "
                  "with the same node name? leaving it alone", what, key.decode(errors="replace"),
                  self._lease_id or 0)


def _parse_config(key: bytes, value: bytes) -> ClusterConfig:
    try:
        return ClusterConfig.from_json(value)
    except RecordError as e:
        raise RecordError(f"{key.decode()}: {e}") from None


async def _close_quietly(client: EtcdClient) -> None:
    """Close an aetcd client; a client whose streams already failed may complain, ignore it."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.close(), 5.0)
