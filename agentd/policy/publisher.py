"""This node's pods, as the policy agent knows them: the endpoint files agentd-cni writes
(one per pod it attached) and the pod records in etcd made from them.

:class:`PodPublisher` reads the files (inotify tells the agent when to look; a rescan every
few seconds covers lost events), keeps one record per pod in etcd under the node's lease
(so the records of a node that is gone go with its lease), writes labels set later with
``agentd label pod`` back to the files, and removes records of pods that are no longer here.
It never writes a record another node owns.  Every record in etcd (all nodes) is the
agent's, from its watch; the publisher reads them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from agentd.cni import endpoints
from agentd.datastore.store import Datastore
from agentd.resources import kinds
from agentd.resources.pod import CONTAINER_ID, CONTAINER_NAME, INTERFACE
from agentd.resources.store import ResourceStore


from .model import PodKey

log = logging.getLogger("agentd.policy")

PUBLISH_INTERVAL = 5.0  # own pod records are checked against etcd this often (lease changes)
# After a put whose compare failed (the record changed meanwhile), the next round comes when the
# watch brings the change (it wakes the publisher) or after this long: never at once, which
# spun hundreds of transactions a second while the watch had nothing new to bring.
CONFLICT_RETRY = 1.0


class PodPublisher:
    def __init__(
        self,
        node: str,
        data_dir: str,
        datastore: Datastore,
        store: ResourceStore,
        records: dict[PodKey, dict[str, Any]],
        record_leases: dict[PodKey, int],
    ) -> None:
        self.node = node
        self.data_dir = data_dir
        self.ds = datastore
        self.store = store
        self.records = records  # every pod record in etcd, kept by the agent's watch (read here)
        self.record_leases = record_leases
        self.endpoints: dict[str, endpoints.Endpoint] = {}  # this node's endpoint files, by container
        self.have_local = False  # the files were read at least once
        self.wake = asyncio.Event()  # something changed: publish now rather than at the interval
        self._reported: set[str] = set()  # problems logged once (until they are over)
        # The endpoint files whose read failure was logged: only while they still fail (a file
        # read again, or gone with its pod, leaves; its next problem is logged anew).
        self._unreadable_logged: set[str] = set()
        # Container IDs whose endpoint file is there but has never been read (bad permissions,
        # damaged from its first write): their pods are unknown to policy -- no isolation and
        # no source check on their bridge ports, which cannot even be named without the file.
        self.unknown: set[str] = set()
        self._retry: asyncio.TimerHandle | None = None  # the wake after a failed compare

    # ------------------------------------------------------------------ the files

    def rescan(self) -> set[PodKey] | None:
        """Read the endpoint files again; the pods whose file appeared, changed or went (None:
        nothing changed)."""
        unreadable: set[str] = set()
        try:
            found = endpoints.read_all(self.data_dir, self._unreadable_logged, unreadable)
        except OSError as err:  # the directory itself (EMFILE, EIO): no pod is known to be gone
            self._report(f"endpoints:{err.errno}", "cannot read the endpoint files: %s; keeping this node's pods as they were", err)
            return None
        self._reported = {tag for tag in self._reported if not tag.startswith("endpoints:")}  # read again: over
        directory = endpoints.endpoints_dir(self.data_dir)
        self._unreadable_logged &= {os.path.join(directory, cid + endpoints.SUFFIX) for cid in unreadable}
        # A file still there that cannot be read now (EMFILE, EIO, a half-written copy) is no
        # pod gone: it keeps what it was, in the tables and in etcd (fail closed, not open).
        for cid in unreadable & self.endpoints.keys():
            found[cid] = self.endpoints[cid]
        unknown = unreadable - found.keys()
        for cid in sorted(unknown - self.unknown):
            log.warning("endpoint file of container %s has never been readable: its pod is unknown to policy "
                        "(not isolated, its bridge port not checked) until the file can be read", cid)
        self.unknown = unknown
        if found == self.endpoints and self.have_local and all(
            (ep.written, ep.ident) == (self.endpoints[cid].written, self.endpoints[cid].ident) for cid, ep in found.items()
        ):  # (written and ident are not compared: a new file of the same container with the same
            # content, written within the same mtime tick as the one it replaced, differs by ident)
            return None
        old_keys = {ep.key for ep in self.endpoints.values()}
        self.endpoints = found
        self.have_local = True
        self.wake.set()
        return old_keys | {ep.key for ep in found.values()}

    def local(self, key: PodKey) -> endpoints.Endpoint | None:
        """The endpoint file of pod ``key`` if it is on this node (of two, a stale one and
        the pod's new one, the newer)."""
        mine = [ep for ep in self.endpoints.values() if ep.key == key]
        return max(mine, key=lambda ep: (ep.written, ep.container_id)) if mine else None

    # ------------------------------------------------------------------ the records

    async def loop(self, ready: Callable[[], bool]) -> None:
        """Publish when woken and every PUBLISH_INTERVAL, once ``ready()`` (the agent has the
        etcd snapshot) and the files have been read."""
        while True:
            try:
                # Not wait_for: on Python 3.11 it drops a cancel that comes as the wait ends,
                # and the agent stopping would wait for this loop for ever.
                async with asyncio.timeout(PUBLISH_INTERVAL):
                    await self.wake.wait()
            except TimeoutError:
                pass
            self.wake.clear()
            if not (ready() and self.have_local):
                continue
            try:
                await self.publish()
            except Exception as err:  # etcd trouble: the next round tries again
                log.warning("publishing this node's pods failed: %s", err)
                await asyncio.sleep(1.0)
                self.wake.set()

    async def publish(self) -> None:
        """Make this node's records in etcd what the files say."""
        lease = self.ds.lease_id
        if lease is None:
            return
        # Of two files of one pod (a sandbox recreated after a DEL that never came), the newer,
        # as in the tables (local()).
        wanted = {key: ep for key in {ep.key for ep in self.endpoints.values()} if (ep := self.local(key))}
        conflicts: set[str] = set()
        for key, ep in wanted.items():
            if self.endpoints.get(ep.container_id) != ep:
                continue  # changed or gone while this round awaited etcd: the rescan woke the next round
            record = self.records.get(key)
            if record is not None and record["spec"].get("nodeName") != self.node:
                conflicts.add(f"conflict:{key}")
                self._report(f"conflict:{key}", "pod %s/%s is recorded for node %s; not overwriting it",
                             key[0], key[1], record["spec"].get("nodeName"))  # fmt: skip
                continue
            labels = ep.labels
            expect = 0
            if record is not None:
                expect = int(record["metadata"]["resourceVersion"])
                if container_of(record) == ep.container_id:
                    labels = record["metadata"].get("labels") or {}
                    if labels != ep.labels:  # set by `agentd label pod`: keep it in the file
                        try:  # in a thread: file I/O under endpoints/.lock, which it never waits for
                            relabelled = await asyncio.to_thread(endpoints.relabel, self.data_dir, ep, labels)
                        except endpoints.Busy as err:  # the record is right; the file waits for the next round
                            log.warning("labels of pod %s/%s not written to its endpoint file yet: %s", *key, err)
                            continue
                        if relabelled is None:  # DEL removed the file (or ADD replaced it) meanwhile:
                            continue  # the rescan that sees it wakes the next round
                        if self.endpoints.get(ep.container_id) == ep:  # (not read again meanwhile)
                            self.endpoints[ep.container_id] = relabelled
            new = record_for(ep, self.node, labels)
            if record is not None:
                same = _comparable(record) == _comparable(new)
                if same and self.record_leases.get(key) == lease:
                    continue
                for field in ("uid", "creationTimestamp"):
                    if field in record["metadata"]:
                        new["metadata"][field] = record["metadata"][field]
            if not await self.store.put_owned(new, lease=lease, expect=expect):
                self._retry_later()  # changed meanwhile: the watch brings it, try again
        # A conflict over (the pod gone, the record ours again) is logged anew if it comes back.
        self._reported = {tag for tag in self._reported if not tag.startswith("conflict:") or tag in conflicts}
        for key, record in list(self.records.items()):
            if record["spec"].get("nodeName") == self.node and key not in wanted:
                log.info("removing the record of pod %s/%s: no such pod on this node any more", *key)
                await self.store.delete_owned(kinds.POD, *key, expect=int(record["metadata"]["resourceVersion"]))

    def _retry_later(self) -> None:
        if self._retry is None or self._retry.cancelled() or self._retry.when() <= asyncio.get_running_loop().time():
            self._retry = asyncio.get_running_loop().call_later(CONFLICT_RETRY, self.wake.set)

    def _report(self, tag: str, msg: str, *args: Any) -> None:
        if tag not in self._reported:
            self._reported.add(tag)
            log.error(msg, *args)


def container_of(record: dict[str, Any]) -> str | None:
    """The container a pod record was made for (its annotation), if any."""
    return (record["metadata"].get("annotations") or {}).get(CONTAINER_ID)


def record_for(ep: endpoints.Endpoint, node: str, labels: dict[str, str]) -> dict[str, Any]:
    """The pod record (a v1 Pod) for this node's endpoint file ``ep``."""
    meta: dict[str, Any] = {
        "name": ep.name,
        "namespace": ep.namespace,
        "annotations": {CONTAINER_ID: ep.container_id, INTERFACE: ep.interface},
    }
    if labels:
        meta["labels"] = dict(labels)
    status: dict[str, Any] = {"phase": "Running"}
    if ep.ips:
        status["podIP"] = ep.ips[0]
        status["podIPs"] = [{"ip": ip} for ip in ep.ips]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"nodeName": node, "containers": [{"name": CONTAINER_NAME, "ports": list(ep.ports)}]},
        "status": status,
    }


def _comparable(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in obj["metadata"].items() if k in ("name", "namespace", "labels", "annotations")}
    return {"metadata": meta, "spec": obj.get("spec"), "status": obj.get("status")}
