"""The Services half of the node agent: Services, EndpointSlices and pod records in, nftables out.

One :class:`ServiceAgent` per ``agentd run``.  It

1. adopts the node's ``ip agentd-services`` table (and ``ip6 agentd-services`` where the
   cluster has IPv6) as a previous run left it (it keeps translating while the agent reads etcd);
2. follows every resource in etcd with one watch (Services, EndpointSlices, pod records);
3. after every batch of changes, compiles the whole table (:mod:`agentd.services.compiler`)
   and sends the difference to the kernel in ONE transaction (the policy programmer, on its
   own table);
4. flushes the UDP conntrack entries of endpoints that stopped serving (a UDP "flow"
   has no end, so without this it would keep going to an endpoint that is gone), and, on the
   first sync after start and for a port that goes from no usable endpoint to some, those of
   its flows that do not go to a usable endpoint;
5. keeps what ``GET /services`` and /metrics show (:class:`agentd.services.views.ServiceViews`).

Until the first etcd snapshot nothing is changed in the kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from agentd.datastore.store import Datastore
from agentd.nft.expr import DropLog
from agentd.nft.libnftables import Nft, NftError
from agentd.nft.nfnetlink import TableAbsent
from agentd.nft.programmer import NftProgrammer
from agentd.resources.service import SERVICE_NAME_LABEL
from agentd.resources.store import ResourceEvent, ResourceStore

from . import compiler, conntrack, dns, model
from .views import ServiceViews

log = logging.getLogger("agentd.services")

COUNTERS_INTERVAL = 2.0  # also how often conntrack's TCP window setting is read again
BE_LIBERAL = "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal"
RETRY_MAX = 30.0  # the longest pause before a failed sync pass is tried again
REJECT_IN_PREROUTING = "5.9"  # the kernel that takes reject in a chain on the prerouting hook (filter-prerouting)
KINDS = ("Service", "EndpointSlice", "Pod")
# Service DNS that could not start (its address taken, port 53 in use) is tried again after
# DNS_RETRY_INITIAL seconds, doubling up to DNS_RETRY_MAX, until it is served.
DNS_RETRY_INITIAL = 1.0
DNS_RETRY_MAX = 60.0
# A full rebuild of the table gives the event loop (BGP, BFD, the API) back after every
# COMPILE_STEP Services: compiling one costs ~0.1 ms, so the loop waits ~10 ms at most.
COMPILE_STEP = 100


class ServiceAgent:
    def __init__(
        self,
        node: str,
        datastore: Datastore,
        *,
        nft: Nft | None = None,
        dns_config: Any = None,
        on_translating: Callable[[bool], Awaitable[None]] | None = None,
        drop_log: DropLog | None = None,
        families: tuple[int, ...] = (4,),
        pod_subnets: dict[int, str] | None = None,
        pod_networks: Sequence[str] = (),
        service_ranges: dict[int, str] | None = None,
        tcp_liberal: Callable[[], bool] | None = None,
    ) -> None:
        self.node = node
        # Whether conntrack's TCP window check is liberal in this namespace (the pod fast path
        # sets it when it opens; the operator may): read at every pass and every
        # COUNTERS_INTERVAL, so the forward hook's invalid-drop rule follows it.
        self.tcp_liberal = tcp_liberal or tcp_be_liberal
        self._liberal: bool | None = None  # as last read
        self.service_ranges = dict(service_ranges or {})  # IP version -> the cluster IPs' range (other addresses of it: dropped)
        self.pod_networks = tuple(pod_networks)  # the cluster's pod networks: who, with the node itself, may ask its DNS
        self.pod_subnets = dict(pod_subnets or {})  # IP version -> this node's pod subnet (Local node ports short-circuit it)
        self.drop_log = drop_log  # refusals logged for flow records (agentd.flows)
        self.families = tuple(sorted(set(families)))  # the IP versions Services have here (one table each)
        # Called with True before the table first translates anything and with False after it
        # stops: the BPF data path must then hand decapsulated packets to netfilter, where
        # conntrack undoes the translation of replies (BpfPath.hold_redirect).
        self.on_translating = on_translating
        self.dns_config = dns_config  # agentd.config.settings.DnsConfig; None or not enabled: no DNS
        self.dns_server: dns.DnsServer | None = None
        self.dns_counted: dict[str, int] = {}  # queries by outcome of the DNS servers this agent ran before
        self.error_dns: str | None = None
        self.names = dns.Names(dns_config.cluster_domain if dns_config is not None else "cluster.local", ready=False)
        self.store = ResourceStore(datastore)
        self.nft = nft
        self.programmer: NftProgrammer | None = None
        self.objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {k: {} for k in KINDS}
        self._named: dict[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...]]] = {}  # Service -> its host and SRV names
        self.revision = 0
        self.applied_revision = 0
        self.syncs = 0
        self.sync_errors = 0  # passes that failed: the kernel refused the transaction, or a bug raised
        self.retry_delay = 1.0  # the pause before a pass that raised is tried again (doubled while they keep failing)
        self._failing = 0  # passes that raised in a row
        self.flushed = 0  # UDP conntrack entries deleted
        self.last_sync: dict[str, Any] | None = None
        self.error: str | None = None
        self.counters: dict[str, int] = {}  # per Service counter: new connections, never going down
        self._counts: dict[tuple[str, str, str], int] = {}  # (family, table, counter) -> packets, as last read
        self._counted_before: dict[str, int] = {}  # per counter: what tables no longer hold (see take_counters)
        self._have_snapshot = False
        self._wake = asyncio.Event()
        self._slices: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}  # (ns, service) -> its slices
        # Pod records by namespace and label, and the selectors of each namespace's Services:
        # a Service is matched against the pods with one of its labels, a pod event against
        # its namespace's selectors (a full rebuild costs the pods, not Services x pods).
        self._pods = model.PodIndex()
        self._selectors: dict[str, dict[str, Any]] = {}  # namespace -> Service -> its selector (those with one)
        self._dirty: set[tuple[str, str]] | None = None  # Services to recompile (None: all)
        self._table: compiler.Table | None = None
        # Each Service's ports as last programmed, kept across rebuilds of the table: the UDP
        # endpoints a change takes away are judged against it, and flushes that failed wait here.
        self._applied: dict[tuple[str, str], list[model.ServicePort]] = {}  # per Service, its ports as compiled
        self._unflushed: list[conntrack.Flush] = []
        self._fresh = True  # no sync yet since start: every UDP port's flows are checked against its endpoints
        # Services whose records could not be built or compiled (a bug): left out, one line each
        # (the reason), until their records change; the others are programmed all the same.
        self.failed: dict[tuple[str, str], str] = {}
        self.views = ServiceViews(self)  # GET /services and /metrics (agentd/services/views.py)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.nft is None:
            self.nft = await asyncio.to_thread(Nft)
        self.programmer = NftProgrammer(self.nft, compiler.TABLES, "services")
        await self.programmer.adopt()

    async def run(self) -> None:
        if self.programmer is None:
            await self.start()
        served = await self._start_dns()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._watch())
                tg.create_task(self._sync_loop())
                tg.create_task(self._counters_loop())
                if not served:
                    tg.create_task(self._retry_dns())
        finally:
            if self.dns_server is not None:
                await self.dns_server.stop()
                for outcome, n in self.dns_server.outcomes.items():  # the next server counts from 0
                    self.dns_counted[outcome] = self.dns_counted.get(outcome, 0) + n
                self.dns_server = None

    def dns_outcomes(self) -> dict[str, int] | None:
        """DNS queries by outcome since the agent started, across restarts of the services task
        (agentd_dns_queries_total: never going down); None while no server ever ran."""
        if self.dns_server is None and not self.dns_counted:
            return None
        out = dict(self.dns_counted)
        for outcome, n in (self.dns_server.outcomes.items() if self.dns_server is not None else ()):
            out[outcome] = out.get(outcome, 0) + n
        return out

    def problems(self) -> list[str]:
        """What the agent's problems (/status, /healthz, systemd's STATUS=) say of this half:
        service DNS not served, and why, while it is tried again."""
        return [f"service DNS not served: {self.error_dns} (trying again)"] if self.error_dns else []

    async def _retry_dns(self) -> None:
        """Start service DNS again after a backoff until it is served (the address taken by
        something else, port 53 in use, IPv6 off: all may end while the agent runs)."""
        delay = DNS_RETRY_INITIAL
        while True:
            await asyncio.sleep(delay)
            if await self._start_dns(retry=True):
                return
            delay = min(DNS_RETRY_MAX, delay * 2)

    async def _start_dns(self, retry: bool = False) -> bool:
        """Serve service DNS (``[dns] enabled``); False when it could not be (:attr:`error_dns` says why)."""
        cfg = self.dns_config
        if cfg is None or not cfg.enabled:
            return True
        # The IPv6 address too where pods have IPv6 (pods without IPv4 are handed that one).
        addresses = [str(cfg.address)] + ([str(cfg.address_v6)] if 6 in self.families else [])
        address = addresses[0]
        try:
            for a in addresses:
                device = await asyncio.to_thread(dns.add_address, a)
        except OSError as err:
            self._dns_failed(f"cannot put {' and '.join(addresses)} on this node: {err}", retry)
            return False
        if cfg.upstream:
            upstreams = dns.upstream_pairs(cfg.upstream)
        else:
            upstreams = dns.host_resolvers(exclude=addresses)
        server = dns.DnsServer(address, 53, lambda: self.names, upstreams, more=addresses[1:],
                               clients=dns.Clients([*self.pod_networks, *addresses]),
                               service_ranges=self.service_ranges.values())  # their reverse names are ours
        try:
            await server.start()
        except OSError as err:
            await server.stop()
            self._dns_failed(f"cannot listen on {' and '.join(addresses)} port 53: {err}", retry)
            return False
        self.dns_server = server
        self.error_dns = None
        log.info("answering DNS for %s on %s port 53 (%s; others to %s)", cfg.cluster_domain, " and ".join(addresses), device,
                 ", ".join(f"{h}:{p}" for h, p in upstreams) or "nowhere: SERVFAIL")  # fmt: skip
        return True

    def _dns_failed(self, error: str, retry: bool) -> None:
        """Logged as an error the first time and when the reason changes (each retry: debug)."""
        if error != self.error_dns or not retry:
            log.error("service DNS is not served: %s; trying again until it is", error)
        else:
            log.debug("service DNS is still not served: %s", error)
        self.error_dns = error

    async def leave(self) -> None:
        """``agentd leave``: remove the services table and the DNS address; both are tried, and
        what could not be removed is raised."""
        errors = []
        try:
            if self.programmer is None:
                self.nft = self.nft or Nft()
                self.programmer = NftProgrammer(self.nft, compiler.TABLES, "services")
            if await self.programmer.remove():
                log.info("removed the services table")
        except NftError as err:
            errors.append(f"the services table stays: {err}")
        if self.dns_config is not None and self.dns_config.enabled:
            try:
                if await asyncio.to_thread(dns.remove_address, None, str(self.dns_config.address_v6)):
                    log.info("removed the DNS address (%s)", dns.DEVICE)
            except OSError as err:
                errors.append(f"the DNS address stays: {err.strerror or err}")
        if errors:
            raise RuntimeError("; ".join(errors))

    def close(self) -> None:
        if self.nft is not None:
            self.nft.close()
            self.nft = None

    # ------------------------------------------------------------------ inputs

    async def _watch(self) -> None:
        async for ev in self.store.watch():
            if self._on_resource(ev):
                self._wake.set()

    def _on_resource(self, ev: ResourceEvent) -> bool:
        """Take one event in, marking the Services it may change; True if it may change the table."""
        # A snapshot is etcd as it is now: after a restore its revision may be below ours, and
        # what is programmed (from before it) is no revision's state: nothing above it is applied.
        if ev.kind == "snapshot":
            self.revision = ev.revision
            self.applied_revision = min(self.applied_revision, ev.revision)
            self.objects = {k: {} for k in KINDS}
            self._slices = {}
            self._pods = model.PodIndex()
            self._selectors = {}
            for (kind, ns, name), obj in ev.objects.items():
                if kind in self.objects:
                    self._put(kind, ns, name, obj)
            self._dirty = None  # everything
            self.failed = {}  # tried again
            self._have_snapshot = True
            return True
        self.revision = max(self.revision, ev.revision)
        kind, ns, name = ev.key if ev.key is not None else ("", "", "")
        if kind not in self.objects:
            self._wake.set()  # nothing to change, but the revision is applied
            return False
        self._touch(kind, ns, name)
        if ev.kind == "put" and ev.obj is not None:
            self._put(kind, ns, name, ev.obj)
        else:
            self._drop(kind, ns, name)
        self._touch(kind, ns, name)
        return True

    def _put(self, kind: str, ns: str, name: str, obj: dict[str, Any]) -> None:
        self._drop(kind, ns, name)
        self.objects[kind][(ns, name)] = obj
        if kind == "EndpointSlice":
            owner = (obj["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL)
            if owner:
                self._slices.setdefault((ns, owner), {})[name] = obj
        elif kind == "Pod":
            self._pods.put(ns, name, obj)
        elif kind == "Service":
            selector = (obj.get("spec") or {}).get("selector")
            if selector:
                self._selectors.setdefault(ns, {})[name] = selector

    def _drop(self, kind: str, ns: str, name: str) -> None:
        old = self.objects[kind].pop((ns, name), None)
        if kind == "EndpointSlice" and old is not None:
            owner = (old["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL)
            group = self._slices.get((ns, owner or ""))
            if group is not None:
                group.pop(name, None)
                if not group:
                    del self._slices[(ns, owner or "")]
        elif kind == "Pod":
            self._pods.drop(ns, name)
        elif kind == "Service":
            selectors = self._selectors.get(ns)
            if selectors is not None and selectors.pop(name, None) is not None and not selectors:
                del self._selectors[ns]

    def _touch(self, kind: str, ns: str, name: str) -> None:
        """Mark the Services that object (as it is now) feeds (a failed one is tried again)."""
        if self._dirty is None and not self.failed:
            return
        fed: set[tuple[str, str]] = set()
        if kind == "Service":
            fed.add((ns, name))
        elif kind == "EndpointSlice":
            obj = self.objects[kind].get((ns, name))
            owner = (obj["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL) if obj else None
            if owner:
                fed.add((ns, owner))
        elif kind == "Pod":  # the Services of its namespace whose selector picks it (called before and after a change)
            pod = self.objects[kind].get((ns, name))
            if pod is None:
                return
            labels = pod["metadata"].get("labels") or {}
            fed.update((ns, service) for service, selector in self._selectors.get(ns, {}).items()
                       if model.matches(selector, labels))
        for key in fed:
            self.failed.pop(key, None)
        if self._dirty is not None:
            self._dirty |= fed

    def _build(self, key: tuple[str, str]) -> list[model.ServicePort]:
        svc = self.objects["Service"].get(key)
        if svc is None:
            return []
        selector = svc["spec"].get("selector")
        pods = self._pods.candidates(key[0], selector) if selector else []
        return model.build([svc], list(self._slices.get(key, {}).values()), pods)

    # ------------------------------------------------------------------ syncing

    async def _sync_loop(self) -> None:
        """One pass per wake-up.  A pass that raises (a bug in the UDP flush bookkeeping, the
        DNS names, a callback: anything but the kernel's refusal, handled in the pass) does not
        end the loop, which nothing else would start again with other records than those that
        raised: one line says why, it is counted (``sync_errors``) and shown (``error``, GET
        /services and /status), the kernel keeps what it has, and the whole table is built
        again at the next pass, after a pause that doubles while passes keep failing."""
        assert self.programmer is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._have_snapshot:
                continue
            try:
                if await self._sync_pass():
                    self._failing = 0
                    continue
            except Exception as err:  # one pass's bug must not stop every later change
                self._table = None  # rebuilt whole: whatever the pass changed before it raised
                self._dirty = None
                self.sync_errors += 1
                self.error = f"a services sync pass failed (tried again): {type(err).__name__}: {err}"
                log.error("%s", self.error)
                log.debug("the failed services sync pass", exc_info=err)
            self._failing += 1
            await asyncio.sleep(min(RETRY_MAX, self.retry_delay * 2 ** (self._failing - 1)))
            self._wake.set()

    async def _sync_pass(self) -> bool:
        """Compile what changed, program it, rename, flush the UDP flows that must move; False
        if the kernel refused the transaction (said and counted: the pass is tried again)."""
        assert self.programmer is not None
        revision = self.revision
        start = time.perf_counter()
        dirty, self._dirty = self._dirty, set()
        full = dirty is None or self._table is None
        if full:
            # Built aside, in steps: until it is whole, GET /services shows the table before it.
            table = compiler.Table(self.node, self.drop_log, self.families, self.pod_subnets, self.service_ranges)
            dirty = set(self.objects["Service"]) | set(self._applied)  # and those gone since
            keys = None
            done = await self._compile_in_steps(table, dirty)
            self._table = table
        else:
            keys = set()
            done = self._compile(dirty, full, keys)
        gone: list[conntrack.Flush] = list(self._unflushed)
        if not done:
            # The table was left half-updated by a Service that could not be compiled: built
            # again at once without it (it stays out until its records change).
            self._table = None
            self._dirty = None
            self._wake.set()
            return True
        # The flows to flush follow the ports as compiled, not as asked: a cluster IP or
        # node port an older Service holds is not this one's (its endpoints coming or going
        # say nothing of the holder's flows), and one a Service gains or loses by a conflict
        # changing is compiled anew without an update of its own.
        built = {key: list(self._table.compiled(key)) for key in self._table.take_recompiled() | dirty}
        for n, (key, after) in enumerate(sorted(built.items())):
            if full and n and n % COMPILE_STEP == 0:
                await asyncio.sleep(0)  # as the compiling: a full rebuild's every port is judged
            gone += stale_udp(self._applied.get(key, []), after)
            gone += unusable_udp(self._applied.get(key, []), after, self.node, first=self._fresh,
                                 short_circuit=tuple(self.pod_subnets.values()))
        translating = self._table.translating()
        # kube-proxy's ct state invalid drop, unless the TCP window check is liberal -- and only
        # while translating: then the BPF data path hands every decapsulated packet to
        # netfilter (on_translating), so conntrack sees both directions of the pods' flows;
        # otherwise it may see one (the other delivered straight to the pod), which it deems
        # invalid, and there is no translation to protect.  Before the transaction: put in
        # after the redirect is held, taken out before it is released.
        self._liberal = self.tcp_liberal()
        touched = self._table.drop_invalid(translating and not self._liberal)
        if keys is not None:
            keys |= touched
        if touched:
            log.info("forwarded TCP conntrack deems invalid (out of window): %s", "dropped, as kube-proxy does "
                     "(nf_conntrack_tcp_be_liberal is not 1)" if self._table.dropping_invalid else "no longer dropped")
        try:
            if translating and self.on_translating is not None:
                await self.on_translating(True)
            result = await self.programmer.sync(self._table.rs, keys)
            if not translating and self.on_translating is not None:
                await self.on_translating(False)
        except NftError as err:
            self._table = None  # rebuild everything next time
            self._dirty = None
            self.sync_errors += 1
            self.error = str(err)
            if "not supported" in self.error.lower():
                self.error += f" (a reject in a prerouting chain needs Linux {REJECT_IN_PREROUTING} or later)"
            log.error("programming services failed: %s", self.error)
            return False
        await self._rename(dirty, full)
        for key, after in built.items():
            if after:
                self._applied[key] = after
            else:
                self._applied.pop(key, None)
        self._fresh = False
        # Until flushed, they wait: a flush that fails, or raises (the pass then fails), keeps them.
        self._unflushed = list(dict.fromkeys(gone))
        if self._unflushed:  # before the revision counts as applied: the change includes the flows' move
            try:
                self.flushed += await asyncio.to_thread(conntrack.flush_udp, self._unflushed)
            except OSError as err:
                log.warning("flushing UDP conntrack entries failed (tried again at the next change): %s", err)
            else:
                self._unflushed = []
        self.error = None
        self.syncs += 1
        if revision <= self.revision:  # else a snapshot from a restore came meanwhile: the next sync counts
            self.applied_revision = revision
        self.last_sync = {"commands": result.commands, "seconds": round(time.perf_counter() - start, 6),
                          "full": result.full, "services": len(dirty)}  # fmt: skip
        return True

    async def _compile_in_steps(self, table: compiler.Table, dirty: set[tuple[str, str]]) -> bool:
        """:meth:`_compile` of a full rebuild into ``table``, COMPILE_STEP Services at a time,
        the event loop given back between them (a rebuild of 10,000 Services would hold it for
        a second: BFD would declare the node down).  Records that change meanwhile mark their
        Services for the next pass, as during the kernel's transaction."""
        order = sorted(dirty)
        for start in range(0, len(order), COMPILE_STEP):
            if start:
                await asyncio.sleep(0)
            if not self._compile(set(order[start : start + COMPILE_STEP]), True, None, table):
                return False
        return True

    def _compile(self, dirty: set[tuple[str, str]], full: bool, keys: set[Any] | None,
                 table: compiler.Table | None = None) -> bool:
        """Update the table (``table``, else the agent's) with the ``dirty`` Services (``keys``:
        the changed objects, added); False if one failed to compile, leaving the table
        half-updated.  A Service whose records cannot be built or compiled (a bug, or records
        the model cannot take) is not translated, one line says why (and :attr:`failed`, GET
        /services): the others are programmed; a full rebuild skips it until its records
        change (a new put, a snapshot)."""
        table = table if table is not None else self._table
        assert table is not None
        for key in sorted(dirty):
            if full and key in self.failed:
                continue
            self.failed.pop(key, None)
            try:
                ports = self._build(key)
            except Exception as err:  # noqa: BLE001 -- one Service's records must not stop the others'
                self._fail(key, "cannot be read", err)
                ports = []
            try:
                touched = table.update(key, ports)
            except Exception as err:  # noqa: BLE001 -- as above; the table is rebuilt without it
                self._fail(key, "cannot be compiled", err)
                return False
            if keys is not None:
                keys |= touched
        return True

    def _fail(self, key: tuple[str, str], what: str, err: Exception) -> None:
        line = f"{what}, not translated: {type(err).__name__}: {err}"
        log.error("service %s/%s %s", key[0], key[1], line)
        self.failed[key] = line

    @property
    def ports(self) -> list[model.ServicePort]:
        """Every service port as last programmed."""
        return self._table.ports() if self._table is not None else []

    @property
    def compiled_ports(self) -> list[model.ServicePort]:
        """Every service port as last compiled: without the cluster IPs and node ports an older
        Service holds (None), so each VIP and node port is in the one Service it is translated to."""
        return self._table.compiled_ports() if self._table is not None else []

    @property
    def port_count(self) -> int:
        """How many service ports were last programmed (without listing them)."""
        return self._table.port_count if self._table is not None else 0

    @property
    def conflicts(self) -> dict[tuple[str, str], list[str]]:
        """Per Service, the cluster IP ports and node ports another (older) Service holds: not translated to it."""
        return self._table.conflicts if self._table is not None else {}

    async def _rename(self, dirty: set[tuple[str, str]], full: bool) -> None:
        """The DNS names of the ``dirty`` Services, changed in place: a Service's names are its
        own (its host name is unique to it), so one change costs that Service, not a pass over
        10,000.  ``full``: all of them, named afresh aside (DNS answers from the names before
        until they are whole), COMPILE_STEP Services at a time, the event loop given back
        between them as in the compiling."""
        if not full:
            self._rename_into(self.names, self._named, dirty)
            return
        names, named = dns.Names(self.names.domain), {}
        order = list(dirty)
        for start in range(0, len(order), COMPILE_STEP):
            if start:
                await asyncio.sleep(0)
            self._rename_into(names, named, order[start : start + COMPILE_STEP])
        self.names, self._named = names, named

    def _rename_into(self, names: dns.Names, named: dict[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...]]],
                     keys: Iterable[tuple[str, str]]) -> None:
        assert self._table is not None
        for key in keys:
            old_hosts, old_srv = named.pop(key, ((), ()))
            names.add_hosts(old_hosts, -1)
            for name in old_hosts:
                names.a.pop(name, None)
                names.aaaa.pop(name, None)
            for name in old_srv:
                names.srv.pop(name, None)
            ports = self._table.services.get(key, ((),))[0]
            if ports:
                part = dns.names(ports, names.domain)
                names.a.update(part.a)
                names.aaaa.update(part.aaaa)
                names.srv.update(part.srv)
                names.add_hosts(part.a)
                named[key] = (tuple(part.a), tuple(part.srv))

    async def _counters_loop(self) -> None:
        assert self.programmer is not None
        while True:
            await asyncio.sleep(COUNTERS_INTERVAL)
            if self._liberal is not None and self.tcp_liberal() != self._liberal:
                self._wake.set()  # the invalid-drop rule follows (a pass without Services to compile)
            with contextlib.suppress(NftError):
                await self.refresh_counters()

    async def refresh_counters(self) -> None:
        """Each Service's new connections: its counters of every family's table, added up."""
        assert self.nft is not None
        counts: dict[tuple[str, str, str], int] = {}
        for family, table in sorted(compiler.tables(self.families)):
            got = await self.nft.acounters(family, table)
            if isinstance(got, TableAbsent) and self.programmer is not None and self.programmer.table_absent(family, table):
                self._wake.set()  # deleted by someone else: a pass writes the tables again (NftProgrammer)
            for name, (packets, _bytes) in got.items():
                counts[(family, table, name)] = packets
        self.take_counters(counts)

    def take_counters(self, counts: dict[tuple[str, str, str], int]) -> None:
        """``counters``: per counter (Service), the sum over the families' tables, plus what a
        table's counter had counted before it went (a dual-stack Service made single-stack) or
        started again from zero (re-created): the total never goes down while the agent runs.
        A counter no table holds any more (the Service gone) is forgotten."""
        before = self._counted_before
        for key, packets in self._counts.items():
            now = counts.get(key)
            if now is None or now < packets:
                before[key[2]] = before.get(key[2], 0) + packets
        self._counts = counts
        names = {name for _, _, name in counts}
        self._counted_before = {name: n for name, n in before.items() if name in names}
        totals = dict(self._counted_before)
        for (_, _, name), packets in counts.items():
            totals[name] = totals.get(name, 0) + packets
        self.counters = totals

def tcp_be_liberal() -> bool:
    """Whether ``nf_conntrack_tcp_be_liberal`` is 1 in this namespace (unreadable: as the
    kernel's default, 0 -- the rule is only a drop of what conntrack would not translate)."""
    try:
        with open(BE_LIBERAL) as f:
            return f.read().strip() == "1"
    except (OSError, ValueError):
        return False


def serving(sp: model.ServicePort) -> set[tuple[str, int]]:
    """The port's serving endpoints (address and port), any node's: those that may take its
    traffic -- ready, or serving while terminating."""
    return {(e.ip, e.port) for e in sp.endpoints if e.ready or e.serving}


def stale_udp(before: list[model.ServicePort], after: list[model.ServicePort]) -> list[conntrack.Stale]:
    """UDP endpoints whose flows through a port are to be flushed: those that left its serving
    set (:func:`serving`: gone, or no longer serving), as kube-proxy's conntrack cleanup
    (pkg/proxy/conntrack/cleanup.go: "we do not take traffic policies, topology, or
    terminating status of the service into account").  One still serving keeps its flows
    whatever else changed: turned terminating while others are ready (a rolling update's
    graceful drain of stateful UDP: QUIC, VPN, game servers), a traffic policy turned Local
    keeping new connections here off it; an endpoint that was not serving took no traffic.
    The flows are those through the port's cluster IP and node port as they were (every
    source).  A cluster IP or node port the port no longer has here (the Service gone, its
    address changed, taken by an older Service) has the flows through it to every endpoint
    it had flushed: it is no longer translated to them."""
    now = {sp.key: sp for sp in after}
    out = []
    for sp in before:
        if sp.protocol != "UDP":
            continue
        later = now.get(sp.key)
        kept = serving(later) if later is not None else set()
        vip_kept = later is not None and later.cluster_ip == sp.cluster_ip
        node_port_kept = later is not None and later.node_port == sp.node_port
        for ip, port in serving(sp):
            left = (ip, port) not in kept
            vip = sp.cluster_ip if left or not vip_kept else None
            node_port = sp.node_port if left or not node_port_kept else None
            if vip is not None or node_port is not None:
                out.append(conntrack.Stale(ip, port, vip, sp.port, node_port))
    return sorted(set(out), key=lambda s: (s.ip, s.port, s.vip or "", s.service_port, s.node_port or 0))


def unusable_udp(before: list[model.ServicePort], after: list[model.ServicePort], node: str | None = None,
                 *, first: bool = False, short_circuit: tuple[str, ...] = ()) -> list[conntrack.Unusable]:
    """UDP ports whose flows not going to one of their usable endpoints are to be flushed:
    every one on the ``first`` sync after start (endpoints may have gone while the agent was
    down), else those going from no usable endpoint (or none at all) to some, or with some
    gaining a cluster IP or node port (another Service held it): a flow sent before this node
    translated the port is not translated, and would stay so.  ``before`` and ``after`` are
    the ports as compiled (a cluster IP or node port another Service holds is None): one
    not translated to this Service's endpoints has flows that are not its own.

    Each path on its own (one :class:`conntrack.Unusable` each): on
    ``node`` a traffic policy Local keeps the cluster IP or the node port (from outside) on
    this node's endpoints, so a flow through it to another node's endpoint goes too (one made
    before the policy turned Local while the agent was down).  A Local node port's flows from
    ``short_circuit`` (this node's pod subnets), which the node translates to every usable
    endpoint, keep any of them; one from the node's own address, which may too, is chosen
    anew.  "Any of them" is :meth:`model.ServicePort.short_circuit_endpoints`, the data
    path's choice: the cluster IP's (with this node's endpoints all terminating and others
    ready, not this node's terminating ones, whose flows from its pods through the node port
    go as they would through the cluster IP)."""
    had = {(sp.key, sp.cluster_ip, sp.node_port) for sp in before if sp.usable()}
    out = []
    for sp in after:
        if sp.protocol != "UDP" or not (first or (sp.usable() and (sp.key, sp.cluster_ip, sp.node_port) not in had)):
            continue
        if sp.cluster_ip is not None:
            out.append(conntrack.Unusable(sp.cluster_ip, sp.port, None, sp.family,
                                          frozenset((e.ip, e.port) for e in sp.cluster_ip_endpoints(node))))
        if sp.node_port is not None:
            local = bool(sp.external_local and node is not None and short_circuit)
            out.append(conntrack.Unusable(None, sp.port, sp.node_port, sp.family,
                                          frozenset((e.ip, e.port) for e in sp.node_port_endpoints(node)),
                                          short_circuit=short_circuit if local else (),
                                          everywhere=frozenset((e.ip, e.port) for e in sp.short_circuit_endpoints(node))
                                          if local else frozenset()))  # fmt: skip
    return out


async def remove_services_table(dns_address_v6: str | None = None, *, table: bool = True) -> None:
    """``agentd leave`` with no agent running: remove this host's DNS addresses and (``table``:
    False where libnftables cannot be had) services tables; both are tried, and what could not
    be removed is raised."""
    errors = []
    try:
        if await asyncio.to_thread(dns.remove_address, None, dns_address_v6):
            log.info("removed the DNS address (%s)", dns.DEVICE)
    except OSError as err:
        errors.append(f"the DNS address stays: {err.strerror or err}")
    if table:
        try:
            nft = await asyncio.to_thread(Nft)
            try:
                if await NftProgrammer(nft, compiler.TABLES, "services").remove():
                    log.info("removed the services table")
            finally:
                nft.close()
        except NftError as err:
            errors.append(f"the services table stays: {err}")
    if errors:
        raise RuntimeError("; ".join(errors))
