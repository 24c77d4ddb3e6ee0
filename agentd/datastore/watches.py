"""Watches: every key under a prefix as a snapshot, then one event per change, resumed
after interruptions without losing or repeating an event.

Each watch has its own etcd client (aetcd serves all watches of a client over one stream).
After an interruption (a member lost, a leader change, an outage) it resumes on the next
endpoint from the revision after the last one delivered; a new snapshot follows only a
compaction (or an error we cannot place).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

import aetcd

from agentd.datastore.connection import EtcdConnection, cancel_kept, close_quietly
from agentd.datastore.etcd import describe, is_transient
from agentd.datastore.records import NodeEvent, NodeRecord, RecordError, nodes_prefix, parse_read_token, read_token_key
from agentd.datastore.registration import Registration

log = logging.getLogger("agentd.datastore")

# A watch that stays up this long (seconds, by the connection's clock) without failing has
# recovered, as has one that delivers an event: the backoff before the next attempt starts again.
STABLE_AFTER = 5.0


@dataclasses.dataclass(frozen=True)
class KeyValue:
    """One etcd key-value as a watch or a read delivers it (``lease`` 0: none;
    ``create_revision`` 0: not known, as in a delete event)."""

    key: bytes
    value: bytes
    mod_revision: int
    lease: int
    create_revision: int = 0


@dataclasses.dataclass(frozen=True)
class PrefixEvent:
    """From :meth:`Watches.watch_prefix`: "snapshot" (``kvs``: every key, at ``revision``),
    "put" or "delete" (``kvs``: the one key; a delete's value is empty)."""

    kind: str
    revision: int
    kvs: list[KeyValue]


class Watches:
    """Prefix watches with resume, and the node watch built on them."""

    def __init__(self, connection: EtcdConnection, registration: Registration, prefix: str) -> None:
        self.connection = connection
        self.registration = registration
        self.prefix = prefix

    async def watch_nodes(self) -> AsyncIterator[NodeEvent]:
        """A "snapshot" of every node, then "put"/"delete" events (see :meth:`watch_prefix`).
        Runs until the consumer stops iterating."""
        registration = self.registration
        nodes: dict[str, NodeRecord] = {}
        async for ev in self.watch_prefix(nodes_prefix(self.prefix), "node watch"):
            if ev.kind == "snapshot":
                nodes = registration.parse_nodes(ev.kvs, known=nodes)  # an unreadable one: its last good
                yield NodeEvent("snapshot", nodes=dict(nodes))
                continue
            kv = ev.kvs[0]
            item = registration.node_event(kv.key, kv.value, kv.mod_revision, ev.kind, nodes, kv.create_revision)
            if item is not None:
                yield item

    async def watch_read_token(self) -> AsyncIterator[str | None]:
        """The cluster read token now, then at every change: the token, or None when there is
        none (deleted).  A record that is no token is logged and skipped."""
        key = read_token_key(self.prefix)
        async for ev in self.watch_prefix(key, "read token watch"):
            kvs = [kv for kv in ev.kvs if kv.key == key]  # the prefix would match longer keys too
            if ev.kind == "snapshot" and not kvs:
                yield None
            elif not kvs:
                continue
            elif ev.kind == "delete":
                yield None
            else:
                try:
                    yield parse_read_token(key, kvs[0].value)
                except RecordError as err:
                    log.warning("%s", err)

    async def watch_prefix(self, prefix: bytes, what: str = "watch") -> AsyncIterator[PrefixEvent]:
        """Every key under ``prefix``: a "snapshot" (all key-values at one revision), then a
        "put" or "delete" per change.  After an interruption (a member lost, a leader change,
        an outage) the watch resumes on the next endpoint from the revision after the last
        one delivered, so no event is lost or repeated; a new snapshot only follows a
        compaction (or an error we cannot place).  Runs until the consumer stops iterating."""
        conn = self.connection
        backoff = conn.backoff()
        index = conn.index
        interrupted = False
        revision: int | None = None  # every event up to here is delivered; None: snapshot first
        while not conn.closed:
            # Its own connection: aetcd serves all watches of a client over one stream,
            # and a fresh client per attempt starts from a clean watcher state.
            client = conn.new_client(index)
            conn.watch_clients.add(client)
            up_since: float | None = None  # when this attempt's watch was created (conn.clock)
            try:
                if revision is not None and interrupted:
                    # Resuming: etcd accepts a watch from a revision it has not reached and sends
                    # nothing below it, so a store whose revision went back (restored from a
                    # snapshot, a lone member that lost its data) would starve the watch unseen.
                    head = await cancel_kept(asyncio.wait_for(client.get_prefix(prefix, keys_only=True), conn.request_timeout))
                    if head.header.revision < revision:
                        log.warning("%s: etcd's revision went back from %d to %d (restored from a snapshot, or its "
                                    "data lost): re-syncing", what, revision, head.header.revision)
                        revision = None
                if revision is None:
                    got = await cancel_kept(asyncio.wait_for(client.get_prefix(prefix), conn.request_timeout))
                    revision = got.header.revision
                    kvs = [KeyValue(kv.key, kv.value, kv.mod_revision, kv.lease, kv.create_revision) for kv in got]
                    conn.set_connected(True)
                    if interrupted:
                        log.info("%s re-synced at revision %d (%d keys)", what, revision, len(kvs))
                    yield PrefixEvent("snapshot", revision, kvs)
                # aetcd waits for the watch's creation with wait_for, which may drop a cancel.
                watch = await cancel_kept(client.watch_prefix(prefix, start_revision=revision + 1))
                conn.set_connected(True)
                if interrupted:
                    log.info("%s resumed at revision %d on %s", what, revision + 1, client.endpoint.url)
                # Recovered only once the stream delivers an event or stays up STABLE_AFTER s: a
                # watch created and then failing at once would otherwise be re-made ~10 times a second.
                up_since = conn.clock()
                async for event in watch:
                    if interrupted or up_since is not None:
                        interrupted, up_since = False, None
                        backoff.reset()
                    # aetcd queues all events of a watch response before any error, so a
                    # revision is never split across an interruption.
                    revision = max(revision, event.kv.mod_revision)
                    kv = KeyValue(event.kv.key, event.kv.value, event.kv.mod_revision, event.kv.lease,
                                  event.kv.create_revision)
                    kind = "delete" if event.kind == aetcd.EventKind.DELETE else "put"
                    yield PrefixEvent(kind, event.kv.mod_revision, [kv])
                if conn.closed:
                    return
                raise aetcd.ClientError("watch canceled by etcd")
            except asyncio.CancelledError:
                if conn.closed_under_us():
                    return
                raise
            except Exception as exc:
                if conn.closed:
                    return
                if up_since is not None and conn.clock() - up_since >= STABLE_AFTER:
                    interrupted = False  # it stayed up: a new interruption, logged, from the first delay
                    backoff.reset()
                compacted = isinstance(exc, aetcd.RevisionCompactedError)
                if is_transient(exc):
                    conn.set_connected(False, f"{what}: {describe(exc)}")
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
                conn.watch_clients.discard(client)
                await close_quietly(client)
