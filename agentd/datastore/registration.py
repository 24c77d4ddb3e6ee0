"""Registration: the cluster config and the node records in etcd.

Our own node record lives under the liveness lease (agentd.datastore.liveness), so it goes
away by itself when the agent is gone for longer than the lease TTL.  Reading other nodes'
records skips (and logs once) the malformed ones; a node watch keeps the last good record of
a node whose record became unreadable (its own agent writes it back), until its key is deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from typing import Any

from aetcd import transactions as tx

from agentd.datastore.connection import EtcdConnection
from agentd.datastore.liveness import LeaseKeeper
from agentd.datastore.records import (
    ClusterConfig,
    NodeEvent,
    NodeRecord,
    RecordError,
    config_key,
    node_key,
    nodes_prefix,
    parse_node,
    parse_node_key,
    parse_read_token,
    read_token_key,
)

log = logging.getLogger("agentd.datastore")


class Registration:
    """Cluster config and node records (ours under the lease, everyone's to read)."""

    def __init__(self, connection: EtcdConnection, keeper: LeaseKeeper, prefix: str) -> None:
        self.connection = connection
        self.keeper = keeper
        self.prefix = prefix

    # -- cluster config ---------------------------------------------------------------------

    async def ensure_cluster_config(self, wanted: ClusterConfig, *, timeout: float | None = None) -> ClusterConfig:
        """Store ``wanted`` if no config exists (one transaction); else return the stored one.

        The one change a later node makes to a stored config: an IPv4 cluster that a node
        configured for dual-stack joins becomes dual-stack, with that node's IPv6 pod network
        (a compare-and-swap on the stored value; nothing stored is ever changed, only the IPv6
        fields added).  That is how a running IPv4 cluster moves to dual-stack: its nodes
        restart with ip_family = "dual" one at a time."""
        key = config_key(self.prefix)
        deadline = self.connection.deadline(timeout)
        while True:
            ok, responses = await self.connection.call(
                "store cluster config",
                lambda c: c.transaction(
                    compare=[tx.Version(key) == 0], success=[tx.Put(key, wanted.to_json())], failure=[tx.Get(key)]
                ),
                deadline,
            )
            if ok:
                log.info("stored cluster config at %s: %s", key.decode(), wanted.to_json().decode())
                return wanted
            current = responses[0]
            while current:
                raw = current[0][0]
                stored = parse_config(key, raw)
                if not (stored.ip_family == "ipv4" and stored.cidr_v6 is None and wanted.ip_family == "dual"):
                    return stored
                upgraded = dataclasses.replace(stored, ip_family="dual", cidr_v6=wanted.cidr_v6,
                                               subnet_len_v6=wanted.subnet_len_v6,
                                               service_cidr_v6=wanted.service_cidr_v6)
                ok, responses = await self.connection.call(
                    "make the cluster dual-stack",
                    lambda c, raw=raw, upgraded=upgraded: c.transaction(
                        compare=[tx.Value(key) == raw], success=[tx.Put(key, upgraded.to_json())],
                        failure=[tx.Get(key)]
                    ),
                    deadline,
                )
                if ok:
                    log.info("the cluster is dual-stack from now on: IPv6 pods in %s, a /%d per node (%s)",
                             upgraded.cidr_v6, upgraded.subnet_len_v6, key.decode())
                    return upgraded
                current = responses[0]  # changed meanwhile: judge the new value
            # deleted meanwhile: store ours, as if we were the first node

    async def get_cluster_config(self, *, timeout: float | None = None) -> ClusterConfig | None:
        key = config_key(self.prefix)
        got = await self.connection.call("read cluster config", lambda c: c.get(key), self.connection.deadline(timeout))
        return None if got is None else parse_config(key, got.value)

    async def ensure_read_token(self, wanted: str, *, timeout: float | None = None) -> str:
        """The cluster's read credential at ``<prefix>/cluster/read-token`` (``{"token": ...}``,
        JSON like every other record): ``wanted`` if none is stored yet (one transaction, first
        writer wins), else the stored one."""
        key = read_token_key(self.prefix)
        ok, responses = await self.connection.call(
            "store the cluster read token",
            lambda c: c.transaction(
                compare=[tx.Version(key) == 0],
                success=[tx.Put(key, json.dumps({"token": wanted}).encode())],
                failure=[tx.Get(key)],
            ),
            self.connection.deadline(timeout),
        )
        if ok:
            log.info("stored a new cluster read token at %s", key.decode())
            return wanted
        return parse_read_token(key, bytes(responses[0][0][0]))

    # -- our node record --------------------------------------------------------------------

    async def register_node(self, record: NodeRecord, *, timeout: float | None = None) -> None:
        """Put our node record under our liveness lease; the keepalive task keeps it there."""
        await self._register(record, timeout, update=False)

    async def update_node(self, record: NodeRecord, *, timeout: float | None = None) -> None:
        """Replace our registered node record (same name).  A registration still under way
        (etcd slow to answer it) is waited for: checked before it was done, the newer record
        was refused and etcd kept the older (a changed VTEP MAC never published).  Nothing
        registered -- not yet (the registration to come carries the node's data as it is then),
        or removed since -- nothing is replaced; a record of another name is refused."""
        await self._register(record, timeout, update=True)

    async def _register(self, record: NodeRecord, timeout: float | None, *, update: bool) -> None:
        if not isinstance(record, NodeRecord):
            raise TypeError(f"{'update' if update else 'register'}_node needs a NodeRecord, got {type(record).__name__}")
        keeper, call = self.keeper, self.connection.call
        deadline = self.connection.deadline(timeout)
        async with self.connection.locked(keeper.lock, deadline, "register node"):
            # Under the lock: a registration under way holds it (every change of our keys does).
            if update and keeper.node is None:
                log.debug("update_node %s: no node record registered here (yet): nothing to replace", record.name)
                return
            if update and keeper.node is not None and keeper.node.name != record.name:
                raise ValueError(f"update_node: node {record.name!r} is not registered here "
                                 f"(node {keeper.node.name!r} is)")
            lost = keeper.lost & {record.subnet, record.subnet_v6}
            if lost:  # the caller's record was made before the keepalive found it taken
                log.warning("node record %s: not naming subnet %s, lost", record.name, ", ".join(map(str, lost)))
                record = dataclasses.replace(record, subnet=None if record.subnet in lost else record.subnet,
                                             subnet_v6=None if record.subnet_v6 in lost else record.subnet_v6)
            key, value = node_key(self.prefix, record.name), record.to_json()
            old = keeper.node
            await keeper.with_lease("register node", lambda c, lease: c.put(key, value, lease=lease), deadline)
            keeper.node = record
            log.info("registered node %s (address %s, subnet %s) under lease %x",
                     record.name, record.address, record.subnet, keeper.lease_id or 0)
            if old is not None and old.name != record.name:
                old_key = node_key(self.prefix, old.name)
                await call("remove old node name", lambda c: c.delete(old_key), deadline)

    async def remove_node(self, name: str, *, timeout: float | None = None) -> bool:
        """Delete ``<prefix>/nodes/<name>``; True if it existed."""
        key = node_key(self.prefix, name)
        keeper = self.keeper
        deadline = self.connection.deadline(timeout)
        async with self.connection.locked(keeper.lock, deadline, "remove node"):
            if keeper.node is not None and keeper.node.name == name:
                keeper.node = None  # or the keepalive would put it back
            existed = await self.connection.call("read node", lambda c: c.get(key), deadline) is not None
            attempts = 0

            def delete(client: Any) -> Any:
                nonlocal attempts
                attempts += 1
                return client.delete(key)

            deleted = await self.connection.call("remove node", delete, deadline) is not None
            # Not found on a retry of a record that was there: the attempt whose reply was lost
            # deleted it.
            deleted = deleted or (attempts > 1 and existed)
        log.info("removed node %s%s", name, "" if deleted else " (it was not registered)")
        return deleted

    # -- everyone's node records ------------------------------------------------------------

    async def list_nodes(self, *, timeout: float | None = None) -> dict[str, NodeRecord]:
        prefix = nodes_prefix(self.prefix)
        got = await self.connection.call("list nodes", lambda c: c.get_prefix(prefix), self.connection.deadline(timeout))
        return self.parse_nodes(got)

    def parse_nodes(self, kvs: Any, known: dict[str, NodeRecord] | None = None) -> dict[str, NodeRecord]:
        """The readable records among ``kvs``; an unreadable one keeps its node's record in
        ``known`` (what the consumer has seen: a watch's new snapshot), as node_event does."""
        nodes: dict[str, NodeRecord] = {}
        for kv in kvs:
            record = self.parse_node_kv(kv.key, kv.value, kv.mod_revision, kv.create_revision)
            if record is not None:
                nodes[record.name] = record
            elif known:
                with contextlib.suppress(RecordError):
                    name = parse_node_key(self.prefix, kv.key)
                    if name in known:
                        nodes.setdefault(name, known[name])
        return nodes

    def parse_node_kv(self, key: bytes, value: bytes, mod_revision: int, create_revision: int = 0) -> NodeRecord | None:
        """The record at ``key`` (carrying its key's ``create_revision``), or None, logged once, if it is bad."""
        try:
            return parse_node(self.prefix, key, value, create_revision)
        except RecordError as e:
            self.connection.report_bad(key, mod_revision, e)
            return None

    def node_event(self, key: bytes, value: bytes, mod_revision: int, kind: str,
                   nodes: dict[str, NodeRecord], create_revision: int = 0) -> NodeEvent | None:
        """A watch's "put"/"delete" of a node key as a NodeEvent (``nodes``: what the consumer
        has seen, updated; ``create_revision``: the put key's); None when the consumer learns
        nothing from it."""
        if kind == "delete":
            try:
                name = parse_node_key(self.prefix, key)
            except RecordError:
                return None
            return NodeEvent("delete", name=name) if nodes.pop(name, None) is not None else None
        record = self.parse_node_kv(key, value, mod_revision, create_revision)
        if record is None:
            # Unreadable (logged once): the consumer keeps the node's last good record, as
            # flannel skips a malformed subnet event and agentd.resources keeps an object's
            # last good version.  Taken for a delete, a bad `etcdctl put` cut a live node off
            # on every other node (BGP Cease, its pods' routes withdrawn) until fixed; its own
            # agent writes its record back (agentd.datastore.liveness), and only a delete --
            # its lease gone with it -- removes the node.
            return None
        nodes[record.name] = record
        return NodeEvent("put", name=record.name, record=record)


def parse_config(key: bytes, value: bytes) -> ClusterConfig:
    try:
        return ClusterConfig.from_json(value)
    except RecordError as e:
        raise RecordError(f"{key.decode()}: {e}") from None
