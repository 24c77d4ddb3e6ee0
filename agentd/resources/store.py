"""Resources in etcd: where each object lives, and apply / get / delete / label / watch.

Keys (prefix default ``/agentd``; ``<plural>`` is the kind's plural, lower case)::

    <prefix>/resources/namespaces/<name>                  Namespace
    <prefix>/resources/networkpolicies/<namespace>/<name> NetworkPolicy
    <prefix>/resources/pods/<namespace>/<name>            Pod (workload endpoint), written by the
                                                          agent of its node under that node's lease

The value is the object as JSON, as validated and defaulted (:func:`agentd.resources.kinds.validate`),
with the server's metadata: ``uid`` and ``creationTimestamp`` (kept across updates) and
``generation`` (counts changes of the spec).  ``resourceVersion`` is not stored: it is the
key's etcd ``mod_revision``, added when an object is read.

Writes are transactions that compare the ``mod_revision`` read before (so two applies, or an
agent and ``agentd label``, never overwrite each other's change unseen; the loser reads again).
Each watcher (in an agent: the policy engine, the Services agent and the Ingress controller,
each a ResourceStore of its own, with its own etcd connection and snapshots) follows the whole
``<prefix>/resources/`` prefix with one watch, so the objects it sees are one consistent
revision of etcd.  A record that does not validate is logged once,
never a crash; a watcher keeps the object's last readable version (from its own watch, or
from etcd's history when it starts: :meth:`ResourceStore.watch`), and without one the object
is left out.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aetcd import transactions as tx

from agentd.datastore.records import DEFAULT_SERVICE_CIDR
from agentd.datastore.store import Datastore, DatastoreError, HistoryCompacted, KeyValue

from . import allocation, ingress, ipfamilies, kinds
from .ingress import INGRESS_NODES
from .kinds import Kind
from .validation import Invalid, about

log = logging.getLogger("agentd.resources")

RESOURCES = "resources"

MAX_TXN_OPS = 100  # etcd's --max-txn-ops default is 128
Key = tuple[str, str, str]  # (kind, namespace or "", name)


class StoreError(RuntimeError):
    """An operation on the store failed; the message is one line."""


class NotFound(StoreError):
    pass


class PartialApply(StoreError):
    """An apply stopped after some of its transactions were written (a race with another
    writer: every object was checked before the first one); ``applied``: what was written."""

    def __init__(self, applied: list[Applied], total: int, cause: BaseException) -> None:
        super().__init__(
            f"{cause} -- the apply was partial: {len(applied)} of {total} objects were applied before this"
        )
        self.applied = applied
        self.cause = cause


class Conflict(StoreError):
    pass


def resources_prefix(prefix: str) -> bytes:
    return f"{prefix}/{RESOURCES}/".encode()


def kind_prefix(prefix: str, kind: Kind, namespace: str | None = None) -> bytes:
    base = f"{prefix}/{RESOURCES}/{kind.plural}/"
    return (base + f"{namespace}/" if namespace and kind.namespaced else base).encode()


def object_key(prefix: str, kind: Kind, namespace: str, name: str) -> bytes:
    path = f"{kind.plural}/{namespace}/{name}" if kind.namespaced else f"{kind.plural}/{name}"
    return f"{prefix}/{RESOURCES}/{path}".encode()


def parse_key(prefix: str, key: bytes) -> tuple[Kind, str, str]:
    """``(kind, namespace, name)`` of a key under the resources prefix; ValueError otherwise."""
    head = resources_prefix(prefix)
    if not key.startswith(head):
        raise ValueError(f"{key!r} is not under {head!r}")
    parts = key[len(head) :].decode(errors="replace").split("/")
    kind = kinds.BY_PLURAL.get(parts[0])
    if kind is None:
        raise ValueError(f"unknown resource type {parts[0]!r}")
    if kind.namespaced and len(parts) == 3 and all(parts[1:]):
        return kind, parts[1], parts[2]
    if not kind.namespaced and len(parts) == 2 and parts[1]:
        return kind, "", parts[1]
    raise ValueError(f"malformed {kind.plural} key")


def encode(obj: Mapping[str, Any]) -> bytes:
    """The stored value: the object without resourceVersion (that is the key's revision)."""
    meta = {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}
    return json.dumps({**obj, "metadata": meta}, separators=(",", ":"), sort_keys=False).encode()


def decode(prefix: str, kv: KeyValue) -> dict[str, Any]:
    """A stored record as an object (validated again: etcd may hold anything); Invalid on error."""
    kind, namespace, name = parse_key(prefix, kv.key)
    try:
        raw = json.loads(kv.value)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # RecursionError: nested too deep
        raise Invalid("", f"not valid JSON ({type(err).__name__}: {err})" if isinstance(err, RecursionError)
                      else f"not valid JSON ({err})") from None
    try:
        obj = kinds.validate(raw, default_namespace=namespace or kinds.DEFAULT_NAMESPACE)
    except (Invalid, ValueError):
        raise
    except Exception as err:  # noqa: BLE001 - a validator's slip on a shape no manifest passes: one bad record, not a dead watch
        raise Invalid("", f"cannot be validated ({type(err).__name__}: {err})") from None
    if (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]) != (kind.kind, namespace, name):
        raise Invalid("metadata", "the object's kind, namespace or name does not match its key")
    meta = raw.get("metadata") or {}
    for key in ("uid", "creationTimestamp"):
        if isinstance(meta.get(key), str):
            obj["metadata"][key] = meta[key]
    if isinstance(meta.get("generation"), int) and not isinstance(meta.get("generation"), bool):
        obj["metadata"]["generation"] = meta["generation"]
    obj["metadata"]["resourceVersion"] = str(kv.mod_revision)
    return obj


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _content(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What a change is judged by: everything but the server's metadata."""
    meta = {k: v for k, v in obj["metadata"].items() if k not in ("uid", "creationTimestamp", "generation", "resourceVersion")}
    return {**obj, "metadata": meta}


@dataclass(frozen=True)
class Applied:
    obj: dict[str, Any]
    outcome: str  # created | configured | unchanged
    revision: int  # etcd revision of the write (of the read, when unchanged)


@dataclass
class _Batch:
    """One transaction of an apply: its compares, writes and (object, outcome, revision) each."""

    compare: list[Any] = field(default_factory=list)
    puts: list[Any] = field(default_factory=list)
    plan: list[tuple[dict[str, Any], str, int | None]] = field(default_factory=list)


@dataclass(frozen=True)
class ResourceEvent:
    """From :meth:`ResourceStore.watch`: "snapshot" (``objects``: all of them, at ``revision``),
    "put" (``obj``) or "delete" (``key``)."""

    kind: str
    revision: int
    key: Key | None = None
    obj: dict[str, Any] | None = None
    objects: dict[Key, dict[str, Any]] = field(default_factory=dict)
    # The etcd lease each object is attached to (0: none): agents keep their pods' records
    # under their node lease and check it.
    lease: int = 0
    leases: dict[Key, int] = field(default_factory=dict)


#: Bytes of labels ``agentd label pod`` may leave a pod, counted as ADD counts them: the cap of
#: agentd/cni/endpoints.py LABELS_MAX (agentd.resources may not import agentd.cni; a unit test
#: holds the two equal).  A change past it is refused, unless it leaves the pod no more than it
#: had (a pod an older agentd-cni added with more may lose labels).
POD_LABELS_MAX = 16 << 10


def _labels_size(labels: Mapping[str, str]) -> int:
    return sum(len(key) + len(value) + 8 for key, value in labels.items())


class ResourceStore:
    """Resources in etcd, through a :class:`~agentd.datastore.store.Datastore` (its retries and failover)."""

    def __init__(
        self, datastore: Datastore, *, timeout: float | None = None,
        service_cidr: ipaddress.IPv4Network | None = None, rng: random.Random | None = None,
        service_cidr_v6: ipaddress.IPv6Network | None = None, service_families: list[str] | None = None,
    ) -> None:  # fmt: skip
        self.ds = datastore
        self.prefix = datastore.prefix
        self.timeout = timeout
        # The cluster IP ranges and the families Services may have ("IPv4", "IPv6", the
        # primary first); None: the stored cluster config's (read at the first Service).
        self.service_cidr = service_cidr
        self.service_cidr_v6 = service_cidr_v6
        self.service_families = service_families
        self.rng = rng or random.Random()
        self._reported: set[tuple[bytes, int]] = set()
        self.left_out: set[Key] = set()  # unreadable records with no readable version known (watch)

    # ------------------------------------------------------------------ reads

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        key = object_key(self.prefix, kind, namespace, name)
        got = await self.ds.request(f"read {kind.plural}", lambda c: c.get(key), timeout=self.timeout)
        if got is None:
            return None
        return self._decode(KeyValue(key, got.value, got.mod_revision, got.lease), strict=True)

    async def list(self, kind: Kind, namespace: str | None = None) -> list[dict[str, Any]]:
        head = kind_prefix(self.prefix, kind, namespace)
        got = await self.ds.request(f"list {kind.plural}", lambda c: c.get_prefix(head), timeout=self.timeout)
        out = []
        for kv in got:
            obj = self._decode(KeyValue(kv.key, kv.value, kv.mod_revision, kv.lease))
            if obj is not None:
                out.append(obj)
        return sorted(out, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))

    async def ingress_nodes(self) -> list[dict[str, Any]]:
        """The nodes serving Ingresses now (their agents keep these records under their lease)."""
        head = f"{self.prefix}/{INGRESS_NODES}/".encode()
        got = await self.ds.request("list ingress nodes", lambda c: c.get_prefix(head), timeout=self.timeout)
        out = []
        for kv in got:
            try:
                record = json.loads(kv.value)
            except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: nested too deep
                continue
            if isinstance(record, dict) and isinstance(record.get("addresses"), list):
                out.append(record)
        return out

    def _decode(self, kv: KeyValue, *, strict: bool = False) -> dict[str, Any] | None:
        try:
            return decode(self.prefix, kv)
        except (Invalid, ValueError) as err:
            if strict:
                raise StoreError(f"the record at {kv.key.decode(errors='replace')} is malformed: {err}") from None
            if (kv.key, kv.mod_revision) not in self._reported:
                if len(self._reported) > 10000:
                    self._reported.clear()
                self._reported.add((kv.key, kv.mod_revision))
                log.warning("skipping malformed record at %s: %s", kv.key.decode(errors="replace"), err)
            return None

    async def _last_readable(self, kv: KeyValue) -> dict[str, Any] | None:
        """The newest readable earlier version of the unreadable record ``kv``, from etcd's
        history: the key at ``mod_revision - 1`` is its previous version (etcd keeps them until
        it compacts), and so on back past a few unreadable ones.  None, logged once, if there
        is none: compacted away, the key's creation (or a delete) reached, or etcd not
        answering."""
        where = kv.key.decode(errors="replace")
        revision = kv.mod_revision
        why = f"no version of it was readable in its last {HISTORY_STEPS}"
        for _ in range(HISTORY_STEPS):
            try:
                old = await self.ds.get_at(kv.key, revision - 1, timeout=self.timeout) if revision > 1 else None
            except HistoryCompacted:
                why = "its earlier versions are compacted away"
                break
            except DatastoreError as err:
                why = f"its history could not be read ({err})"
                break
            if old is None:
                why = "it was never readable since it was created"
                break
            try:
                obj = decode(self.prefix, old)
            except (Invalid, ValueError):
                revision = old.mod_revision
                continue
            log.warning("record at %s is unreadable: using its last readable version (revision %d) until it "
                        "is readable or deleted", where, old.mod_revision)  # fmt: skip
            obj["metadata"]["resourceVersion"] = str(kv.mod_revision)
            return obj
        if (kv.key, -kv.mod_revision) not in self._reported:
            self._reported.add((kv.key, -kv.mod_revision))
            log.warning("record at %s is unreadable and left out: %s", where, why)
        return None

    # ------------------------------------------------------------------ writes by people

    async def apply(self, objs: Iterable[dict[str, Any]]) -> list[Applied]:
        """Create or replace validated objects, in transactions of up to MAX_TXN_OPS objects.
        Every object is read and checked against etcd (cluster IPs and node ports taken,
        immutable fields, an Ingress's class) before the first transaction: an Invalid one
        means nothing is written.  Only a race -- another writer between the reads and a later
        transaction that makes an object invalid, or keeps changing them -- can stop an apply
        after a first transaction: :class:`PartialApply` then holds what was written."""
        objs = list(objs)
        done: list[Applied] = []
        for _ in range(20):  # lost races: read the rest again and retry
            try:
                batches = await self._plan(objs[len(done):])
            except (Invalid, StoreError) as err:
                if done:
                    raise PartialApply(done, len(objs), err) from None
                raise
            for batch in batches:
                applied = await self._commit(batch)
                if applied is None:
                    break  # changed since read: plan what is left again
                done += applied
            else:
                return done
        err = Conflict("the objects kept changing while being applied; try again")
        if done:
            raise PartialApply(done, len(objs), err)
        raise err

    async def _plan(self, objs: list[dict[str, Any]]) -> list[_Batch]:
        """Read every object (and the allocations, for Services), check each and make the
        transactions: each at most MAX_TXN_OPS writes, comparing what was read."""
        keys = [object_key(self.prefix, kinds.KINDS[o["kind"]], *kinds.identity(o)[1:]) for o in objs]
        services = any(o["kind"] == "Service" for o in objs)
        if services:
            await self._load_service_cidr()
        alloc_heads = [allocation.allocations_prefix(self.prefix, w) for w in (allocation.SERVICE_IPS, allocation.NODE_PORTS)]
        found: list[Any] = []
        for i in range(0, len(keys), MAX_TXN_OPS):
            reads = [tx.Get(k) for k in keys[i : i + MAX_TXN_OPS]]
            _, got = await self.ds.request(
                "read objects", lambda c, r=reads: c.transaction(compare=[], success=r, failure=[]),
                timeout=self.timeout,
            )
            found += got
        taken: dict[tuple[str, str], bytes] = {}
        if services:
            _, got = await self.ds.request(
                "read allocations",
                lambda c: c.transaction(compare=[], success=[tx.Get(h, _prefix_end(h)) for h in alloc_heads], failure=[]),
                timeout=self.timeout,
            )
            taken = _allocated(got)
        batches: list[_Batch] = []
        batch, ops = _Batch(), 0
        for key, obj, kvs in zip(keys, objs, found):
            # A Service also writes (and compares) its allocation keys: its cluster IPs (two for
            # one that asks for both families) and node ports.
            cost = 1 + _cluster_ips_asked(obj["spec"]) + len(obj["spec"].get("ports", [])) if obj["kind"] == "Service" else 1
            if batch.plan and ops + cost > MAX_TXN_OPS:
                batches.append(batch)
                batch, ops = _Batch(), 0
            ops += cost
            old = None
            if kvs:
                value, meta = kvs[0]
                old = self._decode(KeyValue(key, value, meta.mod_revision, meta.lease))
                batch.compare.append(tx.Mod(key) == meta.mod_revision)
            else:
                batch.compare.append(tx.Version(key) == 0)
            allocs: list[Any] = []
            if obj["kind"] == "Service":
                try:
                    obj, (compare, allocs) = self._allocate(obj, old, taken)
                except Invalid as err:  # one of several documents: say which
                    raise about(err, kinds.describe(*kinds.identity(obj))) from None
                batch.compare += compare
            if obj["kind"] == "Ingress" and old is None:
                try:
                    ingress.check_create(obj)
                except Invalid as err:
                    raise about(err, kinds.describe(*kinds.identity(obj))) from None
            new = self._stamp(obj, old)
            if old is not None and _content(old) == _content(new):
                batch.plan.append((new, "unchanged", int(old["metadata"]["resourceVersion"])))
                continue
            batch.puts.append(tx.Put(key, encode(new)))
            batch.puts += allocs
            batch.plan.append((new, "configured" if kvs else "created", None))
        if batch.plan:
            batches.append(batch)
        return batches

    async def _commit(self, batch: _Batch) -> list[Applied] | None:
        """One transaction of a plan; None if something it read has changed since."""
        if not batch.puts:
            return [Applied(o, how, rev or 0) for o, how, rev in batch.plan]
        ok, responses = await self.ds.request(
            "apply objects", lambda c: c.transaction(compare=batch.compare, success=batch.puts, failure=[]),
            timeout=self.timeout,
        )
        if not ok:
            return None
        revision = responses[0].response_put.header.revision if responses else 0
        return [Applied(o, how, rev if rev is not None else revision) for o, how, rev in batch.plan]

    async def _load_service_cidr(self) -> None:
        if self.service_cidr is None or self.service_families is None:
            cluster = await self.ds.get_cluster_config(timeout=self.timeout)
            ranges = cluster.service_ranges() if cluster is not None else {ipfamilies.IPV4: DEFAULT_SERVICE_CIDR}
            if self.service_cidr is None:
                self.service_cidr = cluster.service_cidr if cluster is not None else DEFAULT_SERVICE_CIDR
            if self.service_cidr_v6 is None and ipfamilies.IPV6 in ranges:
                self.service_cidr_v6 = ranges[ipfamilies.IPV6]  # type: ignore[assignment]
            if self.service_families is None:
                self.service_families = list(ranges)

    def service_ranges(self) -> dict[str, ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """The cluster's service range of each family Services may have, the primary first."""
        assert self.service_cidr is not None and self.service_families is not None
        nets = {ipfamilies.IPV4: self.service_cidr, ipfamilies.IPV6: self.service_cidr_v6}
        return {fam: net for fam in self.service_families if (net := nets.get(fam)) is not None}

    def _allocate(
        self, obj: dict[str, Any], old: dict[str, Any] | None, taken: dict[tuple[str, str], bytes]
    ) -> tuple[dict[str, Any], tuple[list[Any], list[Any]]]:
        """The Service with its families (defaulted from the cluster's service ranges), its
        cluster IPs and node ports (kept, given or picked), and the compares and writes of the
        allocation keys it takes and frees.  ``taken`` is updated so that the next Service of
        the same batch picks other values."""
        new = copy.deepcopy(obj)
        allocation.carry_over(new, old)
        spec = new["spec"]
        if old is not None:
            ipfamilies.check_update(spec, old["spec"])
        ranges = self.service_ranges()
        ipfamilies.default(spec, old["spec"] if old is not None else None, list(ranges))
        me = allocation.owner(new)
        allocation.check_range(spec, ranges)
        if not ipfamilies.headless(spec):
            ips = list(spec.get("clusterIPs") or [])
            for fam in spec["ipFamilies"][len(ips):]:  # a cluster IP for each family that has none yet
                ips.append(allocation.pick_ip(ranges[fam], {v for w, v in taken if w == allocation.SERVICE_IPS}, self.rng))
            spec["clusterIPs"], spec["clusterIP"] = ips, ips[0]
        if spec["type"] == "NodePort":
            allocation.fill_node_ports(spec["ports"], {v for w, v in taken if w == allocation.NODE_PORTS}, self.rng)
        want = allocation.held(new)
        have = allocation.held(old)
        compare: list[Any] = []
        writes: list[Any] = []
        for what, value in sorted(want - have):
            holder = taken.get((what, value))
            if holder is not None and holder != me:
                if what == allocation.SERVICE_IPS:
                    index = spec["clusterIPs"].index(value)
                    field, shown, noun = "spec.clusterIP" if index == 0 else f"spec.clusterIPs[{index}]", value, "IP"
                else:
                    field, shown, noun = "spec.ports", f"nodePort {value}", "port"
                raise Invalid(field, f'Invalid value: "{shown}": provided {noun} is already allocated (to {holder.decode()})')
            key = allocation.allocation_key(self.prefix, what, value)
            compare.append(tx.Version(key) == 0)
            writes.append(tx.Put(key, me))
            taken[(what, value)] = me
        for what, value in sorted(have - want):
            writes.append(tx.Delete(allocation.allocation_key(self.prefix, what, value)))
            taken.pop((what, value), None)
        return new, (compare, writes)

    @staticmethod
    def _stamp(obj: dict[str, Any], old: Mapping[str, Any] | None) -> dict[str, Any]:
        new = copy.deepcopy(obj)
        meta = new["metadata"]
        old_meta = old["metadata"] if old is not None else {}
        meta["uid"] = old_meta.get("uid") or str(uuid.uuid4())
        meta["creationTimestamp"] = old_meta.get("creationTimestamp") or _now()
        generation = old_meta.get("generation", 0)
        same_spec = old is not None and old.get("spec") == new.get("spec")
        meta["generation"] = generation if same_spec else generation + 1
        return new

    async def delete(self, kind: Kind, namespace: str, name: str) -> int:
        """Delete one object (a Service with its allocations, in the same transaction);
        returns the revision of the delete; NotFound if there was none."""
        key = object_key(self.prefix, kind, namespace, name)
        for _ in range(20):
            compare, ops = [tx.Version(key) > 0], [tx.Delete(key)]
            if kind is kinds.SERVICE:
                got = await self.ds.request(f"read {kind.plural}", lambda c: c.get(key), timeout=self.timeout)
                if got is None:
                    break
                old = self._decode(KeyValue(key, got.value, got.mod_revision, got.lease))
                compare = [tx.Mod(key) == got.mod_revision]
                ops += [tx.Delete(allocation.allocation_key(self.prefix, w, v)) for w, v in sorted(allocation.held(old))]
            ok, responses = await self.ds.request(
                f"delete {kind.plural}",
                lambda c: c.transaction(compare=compare, success=ops, failure=[]),
                timeout=self.timeout,
            )
            if ok:
                return responses[0].response_delete_range.header.revision
            if kind is not kinds.SERVICE:
                break
        raise NotFound(f"{kind.plural} {_shown(kind, namespace, name)} not found")

    async def label(
        self, kind: Kind, namespace: str, name: str, changes: Mapping[str, str | None], *, overwrite: bool = False
    ) -> tuple[dict[str, Any], bool]:
        """Set (value) or remove (None) labels of one object; returns (object, changed).

        A Namespace that has no object yet gets one (namespaces exist implicitly in agentd).
        The write keeps the record's etcd lease (a pod's record stays tied to its node)."""
        key = object_key(self.prefix, kind, namespace, name)
        for _ in range(20):
            got = await self.ds.request(f"read {kind.plural}", lambda c: c.get(key), timeout=self.timeout)
            if got is None:
                if kind is not kinds.NAMESPACE:
                    raise NotFound(f"{kind.plural} {_shown(kind, namespace, name)} not found")
                obj = kinds.validate({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
                compare, lease = [tx.Version(key) == 0], None
            else:
                obj = self._decode(KeyValue(key, got.value, got.mod_revision, got.lease), strict=True)
                compare, lease = [tx.Mod(key) == got.mod_revision], (got.lease or None)
            assert obj is not None
            current = dict(obj["metadata"].get("labels", {}))
            for k, v in changes.items():
                if v is not None and k in current and current[k] != v and not overwrite:
                    raise Conflict(f"'{k}' already has a value ({current[k]}), and --overwrite is false")
                if v is None:
                    current.pop(k, None)
                else:
                    current[k] = v
            if kind is kinds.NAMESPACE:
                current[kinds.NAMESPACE_NAME_LABEL] = name
            if got is not None and current == obj["metadata"].get("labels", {}):
                return obj, False
            if kind is kinds.POD and _labels_size(current) > max(POD_LABELS_MAX, _labels_size(obj["metadata"].get("labels", {}))):
                raise Invalid("metadata.labels", f"Too long: {len(current)} labels of {_labels_size(current)} bytes "
                                                 f"(key + value + 8 each), more than the {POD_LABELS_MAX} a pod may have here")  # fmt: skip
            obj["metadata"]["labels"] = current
            new = kinds.validate(_content(obj), default_namespace=namespace or kinds.DEFAULT_NAMESPACE)
            new = self._stamp(new, obj if got is not None else None)
            ok, responses = await self.ds.request(
                f"label {kind.plural}",
                lambda c: c.transaction(compare=compare, success=[tx.Put(key, encode(new), lease=lease)], failure=[]),
                timeout=self.timeout,
            )
            if ok:
                new["metadata"]["resourceVersion"] = str(responses[0].response_put.header.revision)
                return new, True
        raise Conflict(f"{kind.plural} {_shown(kind, namespace, name)} kept changing; try again")

    # ------------------------------------------------------------------ writes by agents

    async def put_owned(
        self, obj: dict[str, Any], *, lease: int | None, expect: int | None
    ) -> bool:
        """Put an object an agent owns (a pod record) under ``lease`` if its key is still at
        ``expect`` (its mod_revision; 0: absent).  False if someone changed it meanwhile."""
        kind = kinds.KINDS[obj["kind"]]
        key = object_key(self.prefix, kind, *kinds.identity(obj)[1:])
        cmp = tx.Version(key) == 0 if not expect else tx.Mod(key) == expect
        ok, _ = await self.ds.request(
            f"write {kind.plural}",
            lambda c: c.transaction(compare=[cmp], success=[tx.Put(key, encode(obj), lease=lease or None)], failure=[]),
            timeout=self.timeout,
        )
        return bool(ok)

    async def delete_owned(self, kind: Kind, namespace: str, name: str, *, expect: int) -> bool:
        key = object_key(self.prefix, kind, namespace, name)
        ok, _ = await self.ds.request(
            f"delete {kind.plural}",
            lambda c: c.transaction(compare=[tx.Mod(key) == expect], success=[tx.Delete(key)], failure=[]),
            timeout=self.timeout,
        )
        return bool(ok)

    # ------------------------------------------------------------------ watch

    async def watch(self) -> AsyncIterator[ResourceEvent]:
        """Every resource: a snapshot, then puts and deletes (see Datastore.watch_prefix).

        A record that cannot be read (a bad put by hand, a field a newer agentd writes that this
        one does not know) is logged and leaves the watcher with the object's last good version:
        only a delete in etcd removes an object (bad input loses nothing already working).  A
        watch that starts with such a record (a restarted agent, a new node) looks for that
        version in etcd's history (:meth:`_last_readable`); if etcd has compacted it away, or
        the record was never readable, the object is left out (logged, ``left_out``)."""
        good: dict[Key, tuple[dict[str, Any], int]] = {}  # the last readable version of each object, its lease
        async for ev in self.ds.watch_prefix(resources_prefix(self.prefix), "resource watch"):
            if ev.kind == "snapshot":
                objects: dict[Key, dict[str, Any]] = {}
                leases: dict[Key, int] = {}
                for kv in ev.kvs:
                    obj = self._decode(kv)
                    if obj is not None:
                        objects[kinds.identity(obj)] = obj
                        leases[kinds.identity(obj)] = kv.lease
                        continue
                    try:
                        kind, namespace, name = parse_key(self.prefix, kv.key)
                    except ValueError:
                        continue
                    key = (kind.kind, namespace, name)
                    if key in good:
                        objects[key], leases[key] = _as_of(good[key][0], kv), kv.lease
                    elif (old := await self._last_readable(kv)) is not None:
                        objects[key], leases[key] = old, kv.lease
                        self.left_out.discard(key)
                    else:
                        self.left_out.add(key)
                good = {key: (obj, leases[key]) for key, obj in objects.items()}
                self.left_out -= set(objects)
                yield ResourceEvent("snapshot", ev.revision, objects=objects, leases=leases)
                continue
            kv = ev.kvs[0]
            try:
                kind, namespace, name = parse_key(self.prefix, kv.key)
            except ValueError:
                continue
            key = (kind.kind, namespace, name)
            if ev.kind != "put":
                self.left_out.discard(key)
                if good.pop(key, None) is not None:
                    yield ResourceEvent("delete", ev.revision, key=key)
                continue
            obj = self._decode(kv)
            if obj is None:  # unreadable (logged): the last good version stays, ...
                if key not in good:
                    continue
                # ... as of the record's revision now: a writer comparing it (an agent's own
                # pod record) must compare what etcd holds, or it fails for ever.
                obj = _as_of(good[key][0], kv)
            self.left_out.discard(key)
            good[key] = (obj, kv.lease)
            yield ResourceEvent("put", ev.revision, key=key, obj=obj, lease=kv.lease)


def _as_of(obj: dict[str, Any], kv: KeyValue) -> dict[str, Any]:
    """A copy of ``obj`` (the last readable version of the record ``kv``) with ``kv``'s
    resourceVersion: the revision a compare-and-put must name to replace what etcd holds."""
    kept = copy.deepcopy(obj)
    kept["metadata"]["resourceVersion"] = str(kv.mod_revision)
    return kept


HISTORY_STEPS = 5  # unreadable versions of a record looked past in etcd's history, at most


def _cluster_ips_asked(spec: Mapping[str, Any]) -> int:
    """How many cluster IPs a Service manifest may take: two where it asks for both families."""
    dual = spec.get("ipFamilyPolicy") in (ipfamilies.PREFER_DUAL, ipfamilies.REQUIRE_DUAL)
    return 2 if dual or len(spec.get("ipFamilies") or ()) == 2 or len(spec.get("clusterIPs") or ()) == 2 else 1


def _prefix_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _allocated(ranges: list[Any]) -> dict[tuple[str, str], bytes]:
    """(what, value) -> owner of every allocation key read (the range Gets of a transaction)."""
    out = {}
    for kvs in ranges:
        for value, meta in kvs:
            parts = meta.key.decode(errors="replace").rsplit("/", 2)
            out[(parts[-2], parts[-1])] = value
    return out


def _shown(kind: Kind, namespace: str, name: str) -> str:
    return f'"{name}" in namespace "{namespace}"' if kind.namespaced else f'"{name}"'

