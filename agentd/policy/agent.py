"""The policy half of the node agent: etcd and local pods in, nftables out.

One :class:`PolicyAgent` per ``agentd run``.  It

1. adopts the node's policy tables as a previous run left them (they keep enforcing);
2. follows every resource in etcd with one watch (pods of every node, namespaces, policies)
   and this node's endpoint files (written by agentd-cni; inotify);
3. keeps this node's pod records in etcd equal to its endpoint files (under the node lease,
   so the records of a node that is gone go with its lease), labels set later with
   ``agentd label pod`` written back to the files (:class:`agentd.policy.publisher.PodPublisher`);
4. after every batch of changes, builds the wanted ruleset (:class:`PolicyEngine`) and sends
   the difference to the kernel in one transaction (:class:`NftProgrammer`);
5. keeps what ``GET /policy``, /metrics and ``agentd status`` show
   (:class:`agentd.policy.views.PolicyViews`);
6. tells the pod fast path (a :class:`FastPath`, agentd/dataplane/bpf/podpath.py) where this
   node's pods are, so that TCP connections the tables accepted go pod to pod in the kernel.

Until the first etcd snapshot has arrived nothing is changed in the kernel: a restarted
agent enforces what the previous run left, never a half-known state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import Histogram

from agentd.datastore.store import Datastore
from agentd.resources.store import ResourceEvent, ResourceStore

from agentd.cni import endpoints
from agentd.nft.expr import SUPPRESSED, DropLog
from agentd.nft.libnftables import Nft, NftError
from agentd.nft.programmer import NftProgrammer
from agentd.nft.ruleset import Ruleset

from . import compiler, conntrack, podmacs
from .engine import PolicyEngine
from .model import LocalPort, Pod, PodKey, Policy
from .podmacs import PodMacs
from .publisher import PodPublisher, container_of, record_for
from .views import PolicyViews

log = logging.getLogger("agentd.policy")

ACK_RETRY = 0.5  # endpoints/.lock held by another process: acknowledging is tried again this often
RESCAN_INTERVAL = 10.0  # endpoint files are read again this often even without inotify events
BRIDGE_SYSCTLS = Path("/proc/sys/net/bridge")  # br_netfilter's, of the agent's own namespace
BRIDGE_CALLS = {4: "bridge-nf-call-iptables", 6: "bridge-nf-call-ip6tables"}
COUNTERS_INTERVAL = 2.0
HISTORY = 64


class FastPath(Protocol):
    """The pod fast path as the policy agent drives it (blocking calls, run in a thread)."""

    def set_pods(self, wanted: Mapping[str, str]) -> None: ...

    def counters(self) -> dict[str, dict[str, int]]: ...

    def status(self) -> dict[str, Any]: ...

    def close(self) -> None: ...

    def remove(self) -> list[str]: ...


class PolicyAgent:
    def __init__(
        self,
        node: str,
        datastore: Datastore,
        data_dir: str,
        *,
        registry: Any = None,
        nft: Nft | None = None,
        on_isolation: Callable[[bool], Awaitable[None]] | None = None,
        before_ack: Callable[[], Awaitable[None]] | None = None,
        fast_path: FastPath | None = None,
        fast_path_error: str | None = None,
        drop_log: DropLog | None = None,
        families: tuple[int, ...] = (4,),
        route_all: bool | None = None,
        service_ranges: Iterable[Any] = (),
        check_source_mac: bool = True,
        peer_mac: Callable[[str], str] | None = None,
        bridge_mac: Callable[[str], str | None] | None = None,
        state_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """``drop_log``: flow records are kept (agentd.flows): drops are logged to its NFLOG
        group.  ``route_all``: every local pod's traffic is routed through conntrack, for
        connection records (default: whenever ``drop_log`` is given).  ``check_source_mac``: a pod
        port's frames must carry its pod's MAC ([policy] check_source_mac).  ``service_ranges``:
        the cluster's Service ranges, which the no-route drop records leave out.  ``peer_mac``,
        ``bridge_mac``: the MAC of the other end of a host-side veth, and a bridge's (None: no
        such device), LookupError or OSError where it cannot be read, for pods whose endpoint
        file names none (default: netlink, agentd.policy.podmacs.read_links).  ``state_dir``
        ([agent] state_dir): where the MACs taken that way are kept across restarts
        (agentd/policy/podmacs.py; None: in memory only)."""
        self.node = node
        self.ds = datastore
        self.store = ResourceStore(datastore)
        self.data_dir = str(data_dir)
        # families: the IP versions pods have addresses of
        if route_all is None:
            route_all = drop_log is not None
        self.engine = PolicyEngine(node, drop_log=drop_log, route_all=route_all, families=families,
                                   check_source_mac=check_source_mac, service_ranges=tuple(service_ranges))
        self.nft = nft
        self.peer_mac = peer_mac
        self.bridge_mac = bridge_mac
        # Pods whose endpoint file names no MAC (an older agentd-cni's, a delegate that gave
        # none): the MAC read of their own interface instead, per container and file version.
        self.pod_macs = PodMacs(state_dir)
        # Files whose pod_mac is refused (PodMacs.file_refusals): container -> (ident, why).
        self._file_refused: dict[str, tuple[str, str]] = {}
        self._pod_macs_lock = asyncio.Lock()  # loading and writing its file (one write at a time)
        # Called with True before a sync that leaves a pod of this node isolated, with False
        # after one that leaves none: the BPF data path must not hand packets to isolated pods
        # past netfilter (BpfPath.hold_redirect).
        self.on_isolation = on_isolation
        # Awaited before pods new to agentd-cni are acknowledged (their ADD then returns).
        self.before_ack = before_ack
        self.programmer: NftProgrammer | None = None
        # Pods' accepted TCP connections carried in the kernel past the stack; None where it is
        # off or cannot run here (``fast_path_error`` says which).
        self.fast_path = fast_path
        self.fast_path_error = fast_path_error
        self.fast_path_counters: dict[str, dict[str, dict[str, int]]] = {}  # family -> verdict -> counts
        self._fast_pods: dict[str, str] | None = None  # what the fast path was last told
        self.records: dict[PodKey, dict[str, Any]] = {}  # pod records in etcd, every node
        self.record_leases: dict[PodKey, int] = {}
        self.policy_count = 0
        self.revision = 0  # etcd revision of the last resource event taken in
        self.applied_revision = 0
        self.applied_at: float | None = None
        self.history: deque[tuple[int, float]] = deque(maxlen=HISTORY)
        self.dropped: dict[tuple[PodKey, str], int] = {}  # packets, by (local pod, "ingress"/"egress")
        # Which counter each of those is read from: a pod deleted and made again under its name
        # gets a new counter, from zero (the views keep the old one's count by this identity).
        self.dropped_made: dict[tuple[PodKey, str], int] = {}
        self._counter_made: dict[tuple[str, str], int] = {}  # (family, name) -> the sync that created it
        self._counters_made = 0
        self.spoofed = 0
        self.log_suppressed = 0  # drops the log rules' limit kept from the flow records
        self.error: str | None = None
        self.syncs = 0
        # Builds begun and the last one programmed, numbered: route_services waits for a build
        # begun after its change (a sync already under way when it came was built without it).
        self.builds = 0
        self.synced_build = 0
        # The drop explanations (engine.drop_explanations) of the build last programmed: what
        # the kernel's logging rules were built from.  None: nothing programmed yet.
        self._explained: dict[str, tuple[str, PodKey, tuple[str, ...], bool]] | None = None
        self._synced = asyncio.Event()  # set after each sync (route_services waits for one)
        self.last_sync: dict[str, Any] | None = None  # the last transaction: commands, seconds
        self.sync_errors = 0
        self._have_snapshot = False
        self._full_compare = True
        self._rewrite = False  # a table found deleted by someone else (counters loop): a sync writes it again
        self._acked: set[tuple[str, str]] = set()  # (container, Endpoint.ident) acknowledged
        self._ack_pending: set[tuple[str, str]] | None = None  # a build's attachments not acknowledged (lock held)
        self._ack_tried: set[tuple[str, str]] = set()  # the attachments last acknowledged (some may not be marked)
        self._conflicts: set[tuple[Any, ...]] = set()  # address conflicts logged already
        self._too_large: dict[tuple[str, str], str] = {}  # policies too large to program, logged already
        # Local pods' addresses -> the container that has each (agentd/policy/conntrack.py), and
        # the addresses whose conntrack entries go after the next sync.
        self._owners: dict[str, str] = {}
        self._released: set[str] = set()
        self.conntrack_flushed = 0  # entries deleted
        self._wake = asyncio.Event()
        # This node's endpoint files and their records in etcd (agentd/policy/publisher.py).
        self.publisher = PodPublisher(node, self.data_dir, datastore, self.store, self.records, self.record_leases)
        self._watch: endpoints.DirectoryWatch | None = None
        self.views = PolicyViews(self)  # GET /policy, /metrics, `agentd status` (agentd/policy/views.py)
        self.sync_seconds = (
            Histogram("agentd_policy_sync_seconds", "time to program one policy change into nftables", registry=registry)
            if registry is not None
            else None
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open nftables and adopt the tables a previous run left (no change to them)."""
        self._check_bridged()
        if self.nft is None:
            self.nft = await asyncio.to_thread(Nft)
        self.programmer = NftProgrammer(self.nft, compiler.TABLES, "policy")
        await self.programmer.adopt()

    async def run(self) -> None:
        """The supervised task: watches, publishing, syncing, counters."""
        if self.programmer is None:
            await self.start()
        self._watch = endpoints.DirectoryWatch(endpoints.endpoints_dir(self.data_dir), self._local_changed)
        if not self._watch.start():
            log.warning("inotify unavailable: endpoint files are read every %.0f s", RESCAN_INTERVAL)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._watch_resources())
                tg.create_task(self._rescan_loop())
                tg.create_task(self._sync_loop())
                tg.create_task(self.publisher.loop(lambda: self._have_snapshot))
                tg.create_task(self._counters_loop())
        finally:
            self._watch.stop()

    async def leave(self) -> None:
        """``agentd leave``: remove the policy tables (the pod records go with the node lease)
        and the pod fast path; both are tried, and what could not be removed is raised."""
        errors = []
        try:
            if self.programmer is None:
                self.nft = self.nft or Nft()
                self.programmer = NftProgrammer(self.nft, compiler.TABLES, "policy")
            if await self.programmer.remove():
                log.info("removed the policy tables")
        except NftError as err:
            errors.append(f"the policy tables stay: {err}")
        if self.fast_path is not None:
            try:
                gone = await asyncio.to_thread(self.fast_path.remove)
                if gone:
                    log.info("removed the pod fast path: %s", ", ".join(gone))
            except OSError as err:
                errors.append(f"the pod fast path stays: {err}")
            self.fast_path = None
        if errors:
            raise RuntimeError("; ".join(errors))

    async def remove_pod_macs(self) -> bool:
        """``agentd leave``: remove the file of the MACs read from pods' interfaces
        (agentd/policy/podmacs.py), after a write of it under way, and write it no more.
        True where there was one; an OSError says why it stays."""
        return await asyncio.to_thread(self.pod_macs.remove)

    def close(self) -> None:
        if self.fast_path is not None:  # it stays on the veths, as the tables stay in force
            self.fast_path.close()
        if self.nft is not None:
            self.nft.close()
            self.nft = None

    # ------------------------------------------------------------------ inputs

    async def _watch_resources(self) -> None:
        async for ev in self.store.watch():
            self._on_resource(ev)
            self._wake.set()

    def _on_resource(self, ev: ResourceEvent) -> None:
        # A snapshot is etcd as it is now: after a restore its revision may be below ours, and
        # what is programmed (from before it) is no revision's state: nothing above it is applied.
        if ev.kind == "snapshot":
            self.revision = ev.revision
            self.applied_revision = min(self.applied_revision, ev.revision)
        else:
            self.revision = max(self.revision, ev.revision)
        if ev.kind == "snapshot":
            seen = set(ev.objects)
            for key in list(self._known_keys()):
                if key not in seen:
                    self._delete(key)
            for key, obj in ev.objects.items():
                self._put(obj, ev.leases.get(key, 0))
            self._have_snapshot = True
            self.publisher.wake.set()
        elif ev.kind == "put" and ev.obj is not None:
            self._put(ev.obj, ev.lease)
        elif ev.kind == "delete" and ev.key is not None:
            self._delete(ev.key)

    def _known_keys(self) -> list[tuple[str, str, str]]:
        out = [("Pod", ns, name) for ns, name in self.records]
        out += [("Namespace", "", name) for name in self.engine.namespaces]
        out += [("NetworkPolicy", ns, name) for ns, name in self.engine.policies]
        return out

    def _put(self, obj: dict[str, Any], lease: int = 0) -> None:
        kind = obj["kind"]
        meta = obj["metadata"]
        if kind == "Namespace":
            self.engine.set_namespace(meta["name"], meta.get("labels") or {})
        elif kind == "NetworkPolicy":
            self.engine.upsert_policy(Policy.parse(obj))
            self.policy_count = len(self.engine.policies)
        elif kind == "Pod":
            key = (meta["namespace"], meta["name"])
            self.records[key] = obj
            self.record_leases[key] = lease
            if obj["spec"].get("nodeName") == self.node:
                self.publisher.wake.set()
            self._feed_pod(key)

    def _delete(self, key: tuple[str, str, str]) -> None:
        kind, ns, name = key
        if kind == "Namespace":
            self.engine.set_namespace(name, None)
        elif kind == "NetworkPolicy":
            self.engine.remove_policy((ns, name))
            self.policy_count = len(self.engine.policies)
        elif kind == "Pod":
            old = self.records.pop((ns, name), None)
            self.record_leases.pop((ns, name), None)
            if old is not None and old["spec"].get("nodeName") == self.node:
                self.publisher.wake.set()
            self._feed_pod((ns, name))

    def _local_changed(self) -> None:
        self._rescan()

    def _check_bridged(self) -> None:
        """Whether conntrack sees bridged pod traffic here (br_netfilter): a change rebuilds,
        routing every pod up for the flow records' connections and the Services' un-DNAT or
        no more (PolicyEngine.bridged_to_ip)."""
        on = bridged_to_ip(self.engine.families)
        if self.engine.set_bridged_to_ip(on):
            why = " and ".join(w for w, needs in (("flow records", self.engine.route_all),
                                                   ("Services", self.engine.route_services)) if needs)
            log.info("policy: br_netfilter %s bridged pod traffic to conntrack: pods of this node are %s for %s",
                     "hands" if on else "no longer hands", "bridged, not routed up," if on else "routed up", why)
            self._wake.set()

    async def _rescan_loop(self) -> None:
        while True:
            self._rescan()
            if await self._read_pod_macs(retry=True):  # those that failed are tried again
                self._wake.set()
            await self._record_pod_macs()  # (the rescans' takes: off the sync loop)
            self._check_bridged()
            if self.fast_path is not None and self.fast_path_error is not None:
                self._wake.set()  # a failed fast-path update: retried (below) without waiting for a change
            await asyncio.sleep(RESCAN_INTERVAL)

    def _rescan(self) -> None:
        changed = self.publisher.rescan()
        if changed is None:
            return
        self.pod_macs.prune(self.publisher.endpoints.keys())
        owners = conntrack.owners(self.publisher.endpoints.values())
        self._released |= conntrack.released(self._owners, owners)
        self._owners = owners
        for key in changed | self._check_file_macs():
            self._feed_pod(key)
        self._wake.set()

    def _feed_pod(self, key: PodKey) -> None:
        """Tell the engine what is known of pod ``key`` now (local file first, else its record)."""
        ep = self.publisher.local(key)
        record = self.records.get(key)
        if ep is not None:
            labels = ep.labels
            if record is not None and record["spec"].get("nodeName") == self.node and container_of(record) == ep.container_id:
                labels = record["metadata"].get("labels") or {}
            try:
                pod = Pod.parse(record_for(ep, self.node, labels))
            except (KeyError, ValueError, TypeError) as err:  # one bad file must not stop policy for every pod
                # Its port is known: kept a pod port with nothing of its own (cut off), not
                # left unchecked (its frames could claim another pod's MAC or addresses).
                log.warning("endpoint file of pod %s/%s unusable: %s; its port %s is cut off", *key, err, ep.interface)
                self.engine.cut_off(key, self._port(ep))
                return
            self.engine.upsert_pod(pod, self._port(ep))
        elif record is not None and record["spec"].get("nodeName") != self.node:
            try:
                self.engine.upsert_pod(Pod.parse(record))
            except (KeyError, ValueError) as err:
                log.warning("pod record %s/%s unusable: %s", *key, err)
                self.engine.remove_pod(key)
        else:
            # Gone, or a stale record of ours without a file (the publisher removes it from etcd).
            self.engine.remove_pod(key)

    def _port(self, ep: endpoints.Endpoint) -> LocalPort:
        """Where pod ``ep`` is attached, and the MAC its port takes: the one its file names, else
        the one read from its interface (agentd/policy/podmacs.py; none while it is not read
        or cannot be, and none at all -- cut off -- where the MAC read was refused)."""
        if not self.engine.check_source_mac:
            return LocalPort(ep.interface, ep.mac, ep.bridge, ep.written, ep.pod_mac)
        if ep.pod_mac:
            refused = self._file_refused.get(ep.container_id, ("", ""))[0] == ep.ident
            return LocalPort(ep.interface, ep.mac, ep.bridge, ep.written, "" if refused else ep.pod_mac,
                             mac_refused=refused)
        return LocalPort(ep.interface, ep.mac, ep.bridge, ep.written, self.pod_macs.mac(ep),
                         mac_refused=self.pod_macs.refused(ep))

    async def _read_pod_macs(self, *, retry: bool) -> bool:
        """Read the MACs of the local pods whose endpoint file names none and that have none
        taken yet (with ``retry`` those whose read failed or was refused too, else the new
        only), and the MACs of the bridges that files naming a MAC are on (with ``retry``
        every bridge, else those not read yet), off the event loop with one netlink socket,
        and feed them in.  True where a pod's port changed.  Writes nothing: what was taken
        is recorded in the state file by :meth:`_record_pod_macs`."""
        if not self.engine.check_source_mac:
            return False
        macs = self.pod_macs
        changed: set[PodKey] = set()
        if not macs.loaded:
            async with self._pod_macs_lock:
                if not macs.loaded:
                    macs.loaded_state(await asyncio.to_thread(macs.read_state))
                    changed |= {ep.key for ep in self.publisher.endpoints.values() if not ep.pod_mac and macs.mac(ep)}
        wanted = macs.wanted(self.publisher.endpoints.values(), retry=retry)
        bridges_wanted = {ep.bridge for ep in wanted} | {
            ep.bridge for ep in self.publisher.endpoints.values() if ep.pod_mac and (retry or ep.bridge not in macs.bridges)}
        if wanted or bridges_wanted:
            read, bridges = await asyncio.to_thread(podmacs.read_links, [ep.interface for ep in wanted],
                                                    sorted(bridges_wanted), self.peer_mac, self.bridge_mac)
            macs.bridges.update(bridges)
            current = self.publisher.endpoints  # the files now: one may have gone or changed meanwhile
            batch = {ep.container_id: read.get(ep.interface) for ep in wanted}

            def taken(other: endpoints.Endpoint) -> str:
                got = batch.get(other.container_id)
                return other.pod_mac or macs.mac(other) or (got if isinstance(got, str) else "")

            for ep in wanted:
                now = current.get(ep.container_id)
                if now is None or now.ident != ep.ident:
                    continue
                result = read[ep.interface]
                bridge = bridges.get(ep.bridge)
                if isinstance(bridge, BaseException) and isinstance(result, str):  # not taken unchecked against it
                    result = LookupError(f"the MAC of its bridge {ep.bridge} cannot be read: {bridge}")
                others = macs.others(ep, current.values(), taken, bridge if isinstance(bridge, str) else None)
                if macs.take(ep, result, others):
                    changed.add(ep.key)
        changed |= self._check_file_macs()
        for key in changed:
            self._feed_pod(key)
        return bool(changed)

    def _check_file_macs(self) -> set[PodKey]:
        """Check the MACs endpoint files name (PodMacs.file_refusals) against the bridges'
        (as last read), the host-side veths' and the other pods'; a refused one's port is cut
        off as a refused MAC read's is, said once per file.  The pods whose port changed."""
        if not self.engine.check_source_mac:
            return set()
        eps = self.publisher.endpoints
        refused = {cid: (eps[cid].ident, why) for cid, why in self.pod_macs.file_refusals(eps.values()).items()}
        changed = set()
        for cid in refused.keys() | self._file_refused.keys():
            was, now = self._file_refused.get(cid), refused.get(cid)
            if (was and was[0]) == (now and now[0]):
                continue
            ep = eps.get(cid)
            if ep is None:
                continue  # gone: fed as such by the rescan
            changed.add(ep.key)
            if now is not None:
                log.warning("pod %s/%s: the MAC its endpoint file names is refused (%s): every frame from its port %s "
                            "is dropped (spoofed-mac)", ep.namespace, ep.name, now[1], ep.interface)
            else:
                log.info("pod %s/%s: the MAC its endpoint file names, %s, is checked", ep.namespace, ep.name, ep.pod_mac)
        self._file_refused = refused
        return changed

    async def _record_pod_macs(self) -> None:
        """Write the MACs taken to the state file where it lacks some, off the event loop.  One
        write at a time: callers that come while one is under way wait for it, and where it
        had what they wanted recorded return; else one writes what there is then (requests
        coalesce).  With nothing to record, returns at once (no lock).  A write that fails is
        said once and tried again at the next call (each rescan, each new acknowledgement)."""
        macs = self.pod_macs
        if not macs.unrecorded:
            return
        wanted = macs.changes
        async with self._pod_macs_lock:
            if macs.recorded >= wanted:
                return  # the write under way had them
            changes, pods = macs.to_write()
            if await asyncio.to_thread(macs.write, pods):
                macs.recorded = max(macs.recorded, changes)

    def _unread(self) -> set[str]:
        """The containers whose pod's MAC is still to be read for the first time (their file
        names none), or whose file's MAC is still to be checked against their bridge's (not
        read yet: the first pod on it) -- files that came after the last read began: no build
        acknowledges them yet."""
        if not self.engine.check_source_mac:
            return set()
        eps = self.publisher.endpoints.values()
        return ({ep.container_id for ep in self.pod_macs.wanted(eps, retry=False)}
                | {ep.container_id for ep in eps if ep.pod_mac and ep.bridge not in self.pod_macs.bridges})

    @property
    def unchecked_macs(self) -> dict[str, str]:
        """Local pods whose port's source MAC is not checked though the check is on: their MAC
        is not known ("NS/NAME" -> why)."""
        return self._mac_ports(refused=False)

    @property
    def refused_macs(self) -> dict[str, str]:
        """Local pods whose endpoint file names no MAC and whose interface's was refused: their
        port is checked against none, every frame dropped ("NS/NAME" -> why)."""
        return self._mac_ports(refused=True)

    def _mac_ports(self, *, refused: bool) -> dict[str, str]:
        if not self.engine.check_source_mac:
            return {}
        out = {}
        for ep in self.publisher.endpoints.values():
            port = self.engine.local.get(ep.key)
            if port is not None and port.interface == ep.interface and not port.pod_mac and port.mac_refused == refused:
                why = self._file_refused.get(ep.container_id, ("", ""))
                out[f"{ep.namespace}/{ep.name}"] = (why[1] if why[0] == ep.ident else self.pod_macs.why(ep)) or "its MAC is not known"
        return out

    # ------------------------------------------------------------------ syncing

    async def _sync_loop(self) -> None:
        assert self.programmer is not None
        backoff = 0.2
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not (self._have_snapshot and self.publisher.have_local):
                continue  # keep what the kernel has until we know the whole picture
            # New pods without a MAC in their file: theirs read before the build that acks them.
            await self._read_pod_macs(retry=False)
            # A file that came while that read waited (inotify) is in the build unread: it is not
            # acknowledged by it (its ADD would return with its port unchecked), but by the next
            # round's, which reads it first.
            unread = self._unread()
            if unread:
                self._wake.set()
            # (Not after a failed sync: the engine built it, the kernel does not have it.)
            if (not self.engine.dirty and self.error is None and self.programmer.current is not None
                    and not self._rewrite and self.applied_at is not None):
                # The attachments now: a new file of a container that says what the old one did
                # (a DEL and ADD of one pod) changes nothing in the tables, but its ADD waits
                # for an acknowledgement of that file (endpoints.write removed the old one's).
                containers = {(cid, ep.ident) for cid, ep in self.publisher.endpoints.items() if cid not in unread}
                new = (self.error is None  # (the last sync programmed them)
                       and bool(containers - self._acked) and containers != self._ack_tried)
                if self.fast_path_error is not None or new:  # a failed update: the map may point at a gone veth
                    await self._update_fast_path()
                released, self._released = self._released, set()
                await self._flush_released(released)
                if new:
                    await self._acknowledge_build(containers)
                elif self._ack_pending is not None:  # the last build's acknowledgement found the lock held
                    await self._acknowledge(self._ack_pending)
                self._applied(self.revision)
                continue
            revision = self.revision
            start = time.perf_counter()
            # The attachments this build includes: (container, which write of its file), so that
            # a DEL and ADD with the same container ID (a new file) is acknowledged again.
            containers = {(cid, ep.ident) for cid, ep in self.publisher.endpoints.items() if cid not in unread}
            # The addresses this build takes from their pods; any released while the sync runs
            # wait for the next build (flushed now, their old tables could still accept anew).
            released, self._released = self._released, set()
            self.builds += 1
            build = self.builds
            desired = self.engine.build()
            explained = self.engine.drop_explanations()
            keys = self.engine.touched()
            self._report_conflicts()
            self._report_too_large()
            self._rewrite = False  # (the programmer, in doubt, adopts and rewrites everything)
            isolating = self.isolated()["any"] > 0
            try:
                if isolating and self.on_isolation is not None:
                    await self.on_isolation(True)
                self._note_new_counters(desired)
                result = await self.programmer.sync(desired, None if self._full_compare else keys)
                self._full_compare = False
                if not isolating and self.on_isolation is not None:
                    await self.on_isolation(False)
            except (NftError, OSError) as err:
                self._released |= released  # flushed after the sync that takes them out
                self._full_compare = True  # what changed since is not known exactly any more
                self.error = str(err)
                self.sync_errors += 1
                log.error("policy not programmed: %s; retrying in %.1fs", err, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                self._wake.set()
                continue
            backoff = 0.2
            self.error = None
            self.syncs += 1
            self.synced_build = build
            self._explained = explained
            self._synced.set()
            seconds = time.perf_counter() - start
            if self.sync_seconds is not None:
                self.sync_seconds.observe(seconds)
            self.last_sync = {"commands": result.commands, "seconds": round(seconds, 6),
                              "nft_seconds": round(result.seconds, 6), "full": result.full}
            await self._update_fast_path()
            await self._flush_released(released)  # before the new pod is acknowledged: its address's old flows gone
            await self._acknowledge_build(containers)  # tell agentd-cni, waiting in ADD, that its pod is in the tables now
            if result.full:
                size = desired.size()
                log.info("policy tables programmed: %d chains, %d rules, %d set elements (%d commands)",
                         size["chains"], size["rules"], size["elements"], result.commands)
            self._applied(revision)

    async def _acknowledge_build(self, containers: set[tuple[str, str]]) -> None:
        """Acknowledge the attachments of a build the kernel has now, ``before_ack`` first when
        one of them may have an ADD waiting.  The MACs taken are in the state file first: a
        pod's MAC is relied on across a restart once its ADD has returned (its container may
        then change it), so it is recorded before -- the one wait for a write on this path,
        and only where one was taken since the last write."""
        await self._record_pod_macs()
        if self.before_ack is not None and endpoints.unacknowledged(
            self.data_dir, {cid for cid, _ in containers - self._acked}
        ):
            # Only for an ADD waiting (no agent acknowledged the pod yet), not at a restart.
            try:  # e.g. the BPF data path guards a pods' bridge the first pod's CNI ADD just made
                await self.before_ack()
            except Exception as err:  # noqa: BLE001 -- the pod is programmed: acknowledge it anyway
                log.warning("before acknowledging pods: %s", err)
        self._ack_tried = containers
        await self._acknowledge(containers)

    async def _acknowledge(self, containers: set[tuple[str, str]]) -> None:
        """Mark the attachments the tables have now (endpoints.acknowledge, in a thread: file
        I/O).  The agent never waits for endpoints/.lock: held by another process, this round
        is skipped and the loop is woken again after ACK_RETRY (every ACK_RETRY while it is held)."""
        try:
            self._acked = await asyncio.to_thread(endpoints.acknowledge, self.data_dir, containers, self._acked)
        except endpoints.Busy as err:
            if self._ack_pending is None:
                log.warning("pods not acknowledged to agentd-cni yet: %s; trying again every %.1f s", err, ACK_RETRY)
            self._ack_pending = containers
            asyncio.get_running_loop().call_later(ACK_RETRY, self._wake.set)
            return
        except OSError as err:
            log.warning("cannot acknowledge programmed pods: %s", err)
        if self._ack_pending is not None:
            log.info("pods acknowledged to agentd-cni again")
        self._ack_pending = None

    async def _flush_released(self, released: set[str]) -> None:
        """Delete the conntrack entries of addresses local pods no longer have (after the sync
        that took them out of the tables: the next packet is judged as a new connection by
        the tables as they are now).  Errors are logged: the entries then live until they
        time out, as before."""
        if not released:
            return
        gone = sorted(released)
        try:
            deleted = await asyncio.to_thread(conntrack.flush_addresses, gone)
        except (OSError, ValueError) as err:
            log.warning("conntrack entries of the former pod addresses %s not deleted: %s", ", ".join(gone), err)
            return
        self.conntrack_flushed += deleted
        if deleted:
            log.info("deleted %d conntrack entries of former pod addresses %s", deleted, ", ".join(gone))

    def _report_conflicts(self) -> None:
        """Log each address two local pods claim once (PolicyEngine.conflicts)."""
        now = {(str(ip), owner, tuple(others)) for ip, (owner, others) in self.engine.conflicts().items()}
        for ip, owner, others in sorted(now - self._conflicts):
            log.warning("address %s is claimed by local pods %s and %s: %s/%s has it (the newer endpoint file); "
                        "the other's endpoint file is probably stale", ip, "/".join(owner),
                        ", ".join("/".join(k) for k in others), *owner)  # fmt: skip
        self._conflicts = now

    def _report_too_large(self) -> None:
        """Log each policy too large to program once (PolicyEngine.too_large), as an error."""
        now = dict(self.engine.too_large)
        for key in sorted(now):
            if self._too_large.get(key) != now[key]:
                log.error("%s", now[key])
        self._too_large = now

    async def route_services(self, on: bool, timeout: float = 5.0) -> None:
        """Services start (``on``) or stop translating on this node: every local pod's traffic
        goes up through the IP stack while they do, unless br_netfilter hands it to conntrack
        bridged (PolicyEngine.route_services, .bridged_to_ip).  Returns once
        a sync has programmed it -- the services agent calls this before its first translation
        and after its last -- or at once before the first build (which takes it in anyway).  A
        sync already under way was built before the change: the one after it is waited for."""
        if not self.engine.set_route_services(on):
            return
        begun = self.builds
        self._wake.set()
        if begun == 0:
            return
        try:
            async with asyncio.timeout(timeout):
                while self.synced_build <= begun:
                    self._synced.clear()
                    await self._synced.wait()
        except TimeoutError:
            log.warning("policy: routing every pod for Services not programmed within %.0fs; going on", timeout)

    async def _update_fast_path(self) -> None:
        """Tell the fast path this node's pods (address -> host side of its veth) when they
        changed.  Before a new pod is acknowledged to agentd-cni: its address must not point
        at the veth of a pod that had it before."""
        if self.fast_path is None:
            return
        # both families; of two pods with one address, the one the tables give it to.  A port
        # cut off (its MAC refused: every frame from it dropped) is left out, its addresses
        # too -- not handed to an older pod that had them -- so that no connection of it is
        # carried past the bridge table's drop.
        owner = {ip: ep for ep in sorted(self.publisher.endpoints.values(), key=lambda e: (e.written, e.key))
                 for ip in ep.ips}  # fmt: skip
        wanted = {ip: ep.interface for ip, ep in owner.items() if not self._cut_off(ep)}
        if wanted == self._fast_pods:
            return
        try:
            await asyncio.to_thread(self.fast_path.set_pods, wanted)
        except (OSError, RuntimeError) as err:  # BpfError, BpfUnavailable: the normal path carries on
            # Part of it may be applied (the other veths; a moved address off its old veth):
            # what the fast path has is known no more, and the next sync tells it all again --
            # also when the pods go back to what it was last told (a failed pod deleted).
            self._fast_pods = None
            self.fast_path_error = str(err)
            log.warning("pod fast path not updated: %s", err)
            return
        self._fast_pods = wanted
        self.fast_path_error = None

    def _cut_off(self, ep: endpoints.Endpoint) -> bool:
        """Whether every frame from ``ep``'s port is dropped (its MAC refused; with the check on)."""
        port = self.engine.local.get(ep.key)
        return (self.engine.check_source_mac and port is not None and port.interface == ep.interface
                and port.mac_refused)

    def _applied(self, revision: int) -> None:
        if revision > self.revision:  # a snapshot from a restore came during the build: the next one counts
            return
        now = time.time()
        if revision != self.applied_revision or self.applied_at is None:
            self.history.append((revision, now))
        self.applied_revision = revision
        self.applied_at = now

    async def _counters_loop(self) -> None:
        while True:
            await asyncio.sleep(COUNTERS_INTERVAL)
            if self.fast_path is not None:
                with contextlib.suppress(OSError):
                    self.fast_path_counters = await asyncio.to_thread(self.fast_path.counters)
            if self.programmer is None or self.programmer.current is None:
                continue
            try:
                counts = await self.programmer.counters()
            except NftError:
                continue
            self.take_counters(counts)
            if self.programmer.gone:  # a table deleted by someone else: the sync loop writes it again
                self._rewrite = True
                self._wake.set()

    def _note_new_counters(self, desired: Ruleset) -> None:
        """A new identity for each named counter the sync about to run creates (in ``desired``,
        not in the tables now): before it runs, so no read of the new counter carries the old
        identity.  A counter that stays keeps its identity; a gone one is forgotten."""
        assert self.programmer is not None
        have = self.programmer.current.objects if self.programmer.current is not None else {}
        made: dict[tuple[str, str], int] = {}
        for counter in desired.counters():
            if counter.key in have:  # (one there since before this run: 0, as take_counters reads it)
                made[(counter.family, counter.name)] = self._counter_made.get((counter.family, counter.name), 0)
            else:
                self._counters_made += 1
                made[(counter.family, counter.name)] = self._counters_made
        self._counter_made = made

    def take_counters(self, counts: dict[tuple[str, str], int]) -> None:
        """The nft counters read (by (family, name)): drops per local pod and direction,
        spoofed packets, drops kept from the log.  A pod chain's counter is mapped to its pod
        by the engine (the name the pod's chain got), not by reading the name: a long one is
        a hash."""
        dropped: dict[tuple[PodKey, str], int] = {}
        made: dict[tuple[PodKey, str], int] = {}
        suppressed = 0
        for (family, name), packets in counts.items():
            if name == SUPPRESSED:
                suppressed += packets
            if family == compiler.INET and name.startswith("pod-"):
                origin = self.engine.chain_origin(name)
                if origin is not None:  # else a pod gone since the read
                    direction, key = origin
                    at = (key, "ingress" if direction == "in" else "egress")
                    dropped[at] = packets
                    made[at] = self._counter_made.get((family, name), 0)
            elif family == compiler.BRIDGE and name == compiler.SPOOFED:
                self.spoofed = packets
        self.dropped = dropped
        self.dropped_made = made
        self.log_suppressed = suppressed

    # ------------------------------------------------------------------ state read by the views

    def explain_drop(self, prefix: str) -> tuple[str, PodKey, list[str], bool] | None:
        """A pod chain's drop log prefix -> (direction "ingress"/"egress", the pod, the
        policies isolating it that way, default deny) as the build last programmed has them (the
        rules that logged it: a policy deleted or added since is not programmed yet, or the
        drop was logged before); None if no local pod's chain had it then.  Before the first
        sync, as the engine has them."""
        explained = self._explained if self._explained is not None else self.engine.drop_explanations()
        got = explained.get(prefix)
        if got is None:
            return None
        direction, key, policies, default_deny = got
        return ("ingress" if direction == "in" else "egress"), key, list(policies), default_deny

    @property
    def unknown_endpoints(self) -> list[str]:
        """Container IDs of this node's endpoint files never read: pods unknown to policy."""
        return sorted(self.publisher.unknown)

    def local_pods(self) -> list[PodKey]:
        return sorted(k for k in self.engine.local if k in self.engine.pods)

    def isolated(self) -> dict[str, int]:
        ing = egr = both = 0
        for key in self.local_pods():
            i, e = self.engine.isolation(key)
            ing += i
            egr += e
            both += i or e
        return {"ingress": ing, "egress": egr, "any": both}


def bridged_to_ip(families: Iterable[int], root: Path = BRIDGE_SYSCTLS) -> bool:
    """Whether br_netfilter hands bridged frames of each of ``families`` to the IP hooks in
    this namespace (its sysctls exist only while the module is loaded, and are per namespace)."""
    try:
        return all((root / BRIDGE_CALLS[v]).read_text().strip() == "1" for v in families)
    except (OSError, KeyError, ValueError):
        return False


async def remove_policy_tables() -> None:
    """``agentd leave`` with no agent running: remove the policy tables of this host.
    Raises NftError (one line) when they could not be."""
    nft = await asyncio.to_thread(Nft)
    try:
        if await NftProgrammer(nft, compiler.TABLES, "policy").remove():
            log.info("removed the policy tables")
    finally:
        nft.close()

