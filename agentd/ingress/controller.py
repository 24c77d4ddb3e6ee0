"""The Ingress controller of one node: resources in etcd in, a HAProxy configured and supervised.

One :class:`IngressController` per ``agentd run`` with ``[ingress] enabled``.  It

1. follows every resource with one watch (Ingresses, IngressClasses, Secrets, ConfigMaps,
   Services, EndpointSlices, pod records);
2. after every batch of changes builds the routing table (:mod:`agentd.ingress.routing`) of
   the Ingresses its IngressClasses own, the settings of its ConfigMap, the TLS certificates
   of their Secrets and the ready endpoints of every backend (:mod:`agentd.services.model`,
   the same endpoints the Services table uses);
3. renders the proxy's configuration (:mod:`agentd.ingress.haproxy`).  When only endpoints
   changed, the proxy is told through its runtime API (no reload, no restart); when anything
   else changed (rules, TLS, settings, a backend added or gone), the configuration is
   checked and the proxy reloaded gracefully;
4. starts the proxy, and starts it again (with the configuration of the moment) whenever it
   exits.  The proxy outlives the agent: an agent that stops or dies leaves it serving, and
   the next one adopts it (:meth:`Proxy.adopt`), reloads it only if the configuration it
   renders differs from the one the proxy runs, and brings its servers up to date through
   the runtime API.  Only ``agentd leave``, ``[ingress] enabled = false`` or a proxy that
   cannot be adopted stop it;
5. publishes which addresses this node serves Ingresses on (``<prefix>/ingress/nodes/<node>``,
   under the node's etcd lease): ``status.loadBalancer.ingress`` is read from those;
6. keeps what ``/status``, ``/ingress`` and /metrics show (:mod:`agentd.ingress.views`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import Any

from aetcd import transactions as tx

from agentd.datastore.store import Datastore
from agentd.resources.ingress import INGRESS_NODES, ours
from agentd.resources.secret import TLS_CERT_KEY, TLS_PRIVATE_KEY_KEY, TLS_TYPE
from agentd.resources.service import SERVICE_NAME_LABEL
from agentd.resources.store import ResourceEvent, ResourceStore
from agentd.resources.validation import Invalid
from agentd.services import model

from agentd.resources import ingress_settings as settings

from . import STATE_SUBDIR, certs, haproxy, routing
from .access_log import FileWriter
from .haproxy import Listen, Paths, Server
from .proxy import AUTO_USER, AccessLog, ConfigRefused, Proxy, ProxyError, RunAs, resolve_user, stop_stale, unsearchable
from .views import IngressViews

log = logging.getLogger("agentd.ingress")

KINDS = ("Ingress", "IngressClass", "Secret", "ConfigMap", "Service", "EndpointSlice", "Pod")
TICK = 1.0  # servers waiting for their connections to end are retried this often
STATS_INTERVAL = 2.0
RESTART_BACKOFF = (0.2, 1.0, 2.0, 5.0)
# servers_in_steps gives the loop back every ENDPOINT_STEP backend Services (one model.build,
# ~0.1 ms each) and every INDEX_STEP EndpointSlices or pods indexed: held ~5-10 ms at a time.
ENDPOINT_STEP = 50
INDEX_STEP = 2000
RETRY_FIRST, RETRY_MAX = 1.0, 30.0  # a failed reload is tried again after 1 s, doubling to 30 s


class IngressController:
    def __init__(self, node: str, datastore: Datastore, cfg: Any, addresses: list[str], state_dir: Path) -> None:
        self.node = node
        self.ds = datastore
        self.cfg = cfg  # agentd.config.settings.IngressConfig
        self.listen = Listen(tuple(addresses), cfg.http_port, cfg.https_port)
        self.paths = Paths(Path(state_dir) / STATE_SUBDIR)
        self.proxy = Proxy(self.paths, cfg.haproxy)
        # [ingress] access_log: "agent" (the agent's log), "off" (HAProxy logs nothing), a file.
        self.log_to = cfg.access_log
        writer = FileWriter(cfg.access_log) if cfg.access_log not in ("agent", "off") else None
        self.access_log = AccessLog(self.paths.log_socket, writer)
        # Who HAProxy's workers run as ([ingress] user; None: root, or the agent's own user),
        # known in run(); while it cannot be used (run_as_error) the proxy is neither started
        # nor reloaded, and /status says why.
        self.run_as: RunAs | None = None
        self.run_as_error: str | None = None
        self.run_as_fallback: str | None = None  # why AUTO_USER is not used ([ingress] user not set)
        self.store = ResourceStore(datastore)
        self.objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {k: {} for k in KINDS}
        self.revision = 0
        self.applied_revision = 0
        self.table = routing.RouteTable()  # of the last render: what is loaded, or being tried
        # The table of the configuration the running proxy loaded (None: none known -- not
        # running, or adopted and not yet synced): what /ingress and the metrics show, so that a
        # reload that failed shows what is served, not what was tried (its error in ``error``).
        self.served: routing.RouteTable | None = None
        self.settings = settings.Settings()
        self.servers: dict[str, set[Server]] = {}  # what the proxy has, per backend
        self._want: dict[str, set[Server]] = {}  # the servers of the last render, per backend
        self.draining: dict[str, set[Server]] = {}  # disabled, deleted once their connections end
        self._structure: str | None = None  # everything but the servers, as last loaded
        self.restarts = 0
        self.runtime_changes = 0
        self.last_change: dict[str, Any] | None = None
        self.error: str | None = None
        self.settings_error: str | None = None
        # Settings HAProxy refused and why: while the ConfigMap holds them the last settings it
        # accepted are used and the error stays (a later sync parses them without complaint).
        self._refused_settings: tuple[settings.Settings, str] | None = None
        self._good_settings = settings.Settings()  # the last settings HAProxy's check accepted
        self._fallback = settings.Settings()  # what runs instead of the refused settings
        self.tls_errors: dict[str, str] = {}
        self._loadable: dict[bytes, str | None] = {}  # PEM digest -> why the TLS library refuses it (None: it loads)
        self._names: dict[bytes, tuple[str, ...]] = {}  # PEM digest -> its certificate's DNS names
        self.worker: Any = None  # proxy.Worker
        self.stats: list[dict[str, str]] = []
        self.info: dict[str, str] = {}
        self.counter_base: dict[tuple[str, str], int] = {}  # (backend, counter) of proxies gone
        self._last_counts: dict[tuple[str, str], int] = {}
        self._reloading = False
        self._retry_at: float | None = None  # time.monotonic() of the next try of a failed reload
        self._retry_delay = RETRY_FIRST
        self._published: tuple[int | None, str] | None = None
        self._have_snapshot = False
        self._wake = asyncio.Event()
        self.views = IngressViews(self)

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        if not await self._resolve_run_as():  # the proxy waits; its directory is the agent's alone meanwhile
            await asyncio.to_thread(self._prepare_dir, None)
        if self.log_to == "off":
            log.info("ingress: access log off ([ingress] access_log): HAProxy logs no requests")
        elif self.log_to != "agent":
            log.info("ingress: access log to %s ([ingress] access_log), once the ConfigMap's enable-access-log is "
                     "\"true\"", self.log_to)  # fmt: skip
        if self.access_log.sock is None and self.log_to != "off":
            try:
                self.access_log.open()
            except OSError as err:  # the access log is lost, not the ingress
                log.warning("ingress: no access log: cannot bind %s: %s", self.paths.log_socket, err)
        if not self.proxy.running and (adopted := await self.proxy.adopt()) is not None:
            self.worker = adopted
            log.info("ingress: adopted the running HAProxy (pid %d, worker %d)", self.proxy.pid or 0,
                     self.worker.pid if self.worker else 0)  # fmt: skip
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._watch())
            tg.create_task(self._supervise())
            tg.create_task(self._stats_loop())

    async def _resolve_run_as(self) -> bool:
        """Resolve and check ``[ingress] user``; True when it can be used.  Not set (""):
        :data:`AUTO_USER` where it can be used, else root with one warning saying what the
        node lacks -- a node upgraded without the drop-in's new lines keeps its proxy."""
        try:
            try:
                run_as = await asyncio.to_thread(resolve_user, self.cfg.user or AUTO_USER)
                await asyncio.to_thread(self._prepare_dir, run_as)
            except ProxyError as err:
                if self.cfg.user:
                    raise
                run_as = None
                if self.run_as_fallback != str(err):
                    log.warning("ingress: HAProxy's workers run as root, with the agent's capabilities, as "
                                "[ingress] user is not set and %s", err)
                self.run_as_fallback = str(err)
                await asyncio.to_thread(self._prepare_dir, None)
        except ProxyError as err:
            if self.run_as_error != str(err):
                log.error("ingress: %s", err)
            self.run_as_error = str(err)
            return False
        if run_as is None and self.cfg.user == "root":
            log.warning("ingress: HAProxy's workers run as root, with the agent's capabilities ([ingress] user = root)")
        self.run_as, self.run_as_error = run_as, None
        self.access_log.mode = 0o622 if run_as is not None else 0o600
        return True

    def _prepare_dir(self, run_as: RunAs | None) -> None:
        """The proxy's directory: the agent's alone (0700), or, when the workers run as
        ``run_as``, its group's to pass through (0710, root's and that group's), so that the
        workers may send to the access log's socket bound in it (0622: no one else can reach
        it; no set-group-ID bit, which the unit's RestrictSUIDSGID= refuses); nothing else in it
        is readable but by root (files 0600, certs/ 0700).  ProxyError when the directory
        cannot be given to the group."""
        self.paths.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.paths.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if run_as is not None:
                try:
                    os.fchown(fd, -1, run_as.gid)  # fchown: the one the unit's seccomp filter allows
                    os.fchmod(fd, 0o710)
                except OSError as err:
                    raise ProxyError(f"cannot give {self.paths.dir} to group {run_as.group} of [ingress] user "
                                     f"{run_as.user} ({err.strerror}): under the systemd unit add "
                                     f"SupplementaryGroups={run_as.group} to the drop-in "
                                     "/etc/systemd/system/agentd.service.d/ingress.conf (docs/ingress.md)") from None  # fmt: skip
                blocked = unsearchable(self.paths.dir, run_as.uid, run_as.gid)
                if blocked is not None and self.log_to != "off":
                    log.warning("ingress: HAProxy's workers (user %s) cannot reach the access log's socket %s: %s "
                                "is not searchable by them; no request will be logged ([agent] state_dir under a "
                                "directory others may pass through, such as /var/lib)", run_as.user,
                                self.paths.log_socket, blocked)  # fmt: skip
            else:
                os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
        self.paths.certs.mkdir(exist_ok=True)
        os.chmod(self.paths.certs, 0o700)
        # Made again unless it loads: an empty or torn one (a power loss) would make HAProxy
        # refuse every start and reload, every Ingress down for good.
        try:
            pem = self.paths.default_cert.read_bytes()
        except FileNotFoundError:
            pem = b""
        if not pem or certs.refused(pem, self.paths.certs) is not None:
            _write(self.paths.default_cert, certs.self_signed("agentd ingress default certificate"))

    async def _supervise(self) -> None:
        """Start the proxy, keep it configured, start it again whenever it exits."""
        while not self._have_snapshot:
            await self._wake.wait()
            self._wake.clear()
        failures = 0
        if self.proxy.running:  # adopted, or this task was restarted after a crash: keep the proxy
            await self._take_over()
        while True:
            try:
                if not self.proxy.running:
                    await self._start_proxy()
            except (ProxyError, OSError) as err:
                self.error = f"proxy not started: {err}"
                log.error("ingress: %s", self.error)
                if self._published is not None and not self.proxy.running:  # it serves nothing: out of the status
                    await self._unpublish()  # (failed, etcd away: asked again at the next failed start)
                await asyncio.sleep(RESTART_BACKOFF[min(failures, len(RESTART_BACKOFF) - 1)])
                failures += 1
                continue
            failures = 0
            exited = asyncio.ensure_future(self.proxy.wait())
            try:
                while not exited.done():
                    woke = asyncio.ensure_future(self._wake.wait())
                    await asyncio.wait({exited, woke}, timeout=TICK, return_when=asyncio.FIRST_COMPLETED)
                    woke.cancel()
                    if exited.done():
                        break
                    if self._wake.is_set() or any(self.draining.values()) or self._retry_due(time.monotonic()):
                        self._wake.clear()
                        try:
                            await self._sync()
                        except (ProxyError, OSError) as err:  # tried again after a while
                            self.error = f"applying the configuration failed: {err}"
                            log.error("ingress: %s", self.error)
                            self._retry_later()
                    await self._publish()  # again when etcd gave us a new lease
            finally:
                if not exited.done():
                    exited.cancel()
            self.restarts += 1
            self._structure = None
            self.served = None
            self._fold_counters()
            self._forget_proxy()
            self.error = f"the proxy (pid {self.proxy.pid}) exited; started again"
            log.error("ingress: HAProxy (pid %s) exited; starting it again with the current configuration", self.proxy.pid)
            await self.proxy.stop()

    async def _start_proxy(self) -> None:
        files, structure = await self._render()
        await asyncio.to_thread(self._write_files, files)
        structure = await self._check_or_fall_back(structure)
        await self.proxy.start()
        self.servers = {name: set(s) for name, s in self._want.items()}  # of the configuration it started with
        self.draining = {}
        self._structure = structure
        await asyncio.to_thread(self._save_loaded, structure)
        self.worker = await self.proxy.worker()
        self.served = self.table
        self.error = None
        self.applied_revision = self.revision
        self._retry_at, self._retry_delay = None, RETRY_FIRST
        log.info("ingress: HAProxy %d serving %d Ingresses on %s (http %d, https %d)", self.proxy.pid or 0,
                 len(self.table.ingresses), ", ".join(self.listen.addresses), self.listen.http_port,
                 self.listen.https_port)  # fmt: skip
        await self._publish()

    async def _take_over(self) -> None:
        """Go on with a running proxy this controller did not start (adopted from a previous
        agent, or this task restarted after a crash): what it runs is known from
        ``loaded.json`` (a reload only if the rendered configuration differs) and from its
        runtime API (its servers, enabled or draining); the next sync does the rest."""
        self._structure = None
        self.served = None  # known at the first sync (the table it renders, if it is what runs)
        loaded = await asyncio.to_thread(_read_json, self.paths.loaded)
        if loaded.get("master") == self.proxy.pid:
            self._structure = loaded.get("structure")
            # The settings its check accepted: the fallback should the ConfigMap hold settings
            # it refuses (a loaded.json of an older agent has none: the defaults, as before).
            accepted = _settings_from(loaded.get("settings"))
            if accepted is not None:
                self._good_settings = self._fallback = accepted
        self.servers, self.draining = {}, {}
        try:
            rows = await self.proxy.stats()
        except ProxyError as err:
            log.warning("ingress: reading the adopted proxy's servers failed (%s); reloading it", err)
            self._structure = None
            rows = []
        for row in rows:
            name = row.get("svname", "")
            if name in ("FRONTEND", "BACKEND"):  # servers are ours alone: named ip:port
                continue
            ip, _, port = name.rpartition(":")
            with contextlib.suppress(ValueError):
                into = self.draining if row.get("status", "").startswith("MAINT") else self.servers
                into.setdefault(row["pxname"], set()).add((ip, int(port)))
        self._wake.set()

    def _save_loaded(self, structure: str) -> None:
        _write(self.paths.loaded, json.dumps({"master": self.proxy.pid, "structure": structure,
                                              "settings": dataclasses.asdict(self._good_settings)}).encode())

    async def stop(self) -> None:
        """The agent stops: the proxy goes on serving (the next agent adopts it)."""
        self.proxy.detach()
        await self.access_log.aclose()

    def access_log_state(self) -> dict[str, Any]:
        """Where the access lines go, and (a file) why they are being dropped, if they are."""
        w = self.access_log.writer
        return {"to": self.log_to, "error": w.file.failing if w else None, "dropped": w.file.dropped_total if w else 0}

    def reopen_access_log(self) -> None:
        """SIGHUP: an access log file is closed and opened again (after logrotate moved it)."""
        self.access_log.reopen()

    async def leave(self) -> None:
        """``agentd leave``: stop the proxy (requests in flight finish), unpublish this node,
        remove the proxy's files."""
        await self.proxy.stop()
        await self.access_log.aclose()
        await self._unpublish()
        await asyncio.to_thread(remove_ingress_proxy, self.paths.dir.parent)

    # ------------------------------------------------------------------ inputs

    async def _watch(self) -> None:
        async for ev in self.store.watch():
            if self._on_resource(ev):
                self._wake.set()

    def _on_resource(self, ev: ResourceEvent) -> bool:
        # A snapshot is etcd as it is now: after a restore its revision may be below ours, and
        # what is programmed (from before it) is no revision's state: nothing above it is applied.
        if ev.kind == "snapshot":
            self.revision = ev.revision
            self.applied_revision = min(self.applied_revision, ev.revision)
            self.objects = {k: {} for k in KINDS}
            for (kind, ns, name), obj in ev.objects.items():
                if kind in self.objects:
                    self.objects[kind][(ns, name)] = obj
            self._have_snapshot = True
            return True
        self.revision = max(self.revision, ev.revision)
        kind, ns, name = ev.key if ev.key is not None else ("", "", "")
        if kind not in self.objects:
            self._wake.set()  # the revision counts as applied too
            return False
        if ev.kind == "put" and ev.obj is not None:
            self.objects[kind][(ns, name)] = ev.obj
        else:
            self.objects[kind].pop((ns, name), None)
        return True

    # ------------------------------------------------------------------ desired state

    def _ours(self) -> list[dict[str, Any]]:
        classes = list(self.objects["IngressClass"].values())
        return [i for i in self.objects["Ingress"].values()
                if ours(i, classes, self.cfg.controller, without_class=self.cfg.watch_without_class)]  # fmt: skip

    def _parse_settings(self) -> settings.Settings:
        ns, _, name = self.cfg.configmap.partition("/")
        cm = self.objects["ConfigMap"].get((ns, name))
        try:
            parsed = settings.parse((cm or {}).get("data"), f"ConfigMap {self.cfg.configmap}: data")
        except ValueError as err:  # Invalid; or a bad value a check missed (int() of it): no crash loop
            why = str(err) if isinstance(err, Invalid) else f"ConfigMap {self.cfg.configmap}: data: {err}"
            if self.settings_error != why:
                log.error("ingress: %s; keeping the settings in use", why)
            self.settings_error = why
            return self.settings
        if self._refused_settings is not None:
            if parsed == self._refused_settings[0]:
                self.settings_error = self._refused_settings[1]
                return self._fallback
            self._refused_settings = None  # other settings: HAProxy checks them
        self.settings_error = None
        return parsed

    async def _want_servers_in_steps(self, backends: Mapping[str, routing.Backend]) -> dict[str, set[Server]]:
        """The ready endpoints of every backend of ``backends`` (none: it answers 503), the
        event loop given back between steps."""
        steps = servers_in_steps(backends, self.objects)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            await asyncio.sleep(0)

    def _cert_files(self) -> dict[tuple[str, str], bytes]:
        """PEM (certificate chain + key) of every Secret the table's TLS hosts name."""
        out: dict[tuple[str, str], bytes] = {}
        errors = {}
        hosts: dict[tuple[str, str], list[str]] = {}
        for t in self.table.tls:
            if t.secret is not None:
                hosts.setdefault(t.secret, []).append(t.host)
        for t in self.table.tls:
            if t.secret is None:
                continue
            secret = self.objects["Secret"].get(t.secret)
            where = f"{t.secret[0]}/{t.secret[1]}"
            served = f"{', '.join(hosts[t.secret])} served with the default certificate"
            if secret is None:
                errors[where] = f"no such Secret: {served}"
            elif secret.get("type") != TLS_TYPE:
                errors[where] = f"type is {secret.get('type')}, not {TLS_TYPE}: {served}"
            else:
                pem = _pem(secret)
                refused = self._refused(pem)
                if refused is not None:
                    # One such certificate in the crt-list and HAProxy refuses the whole
                    # configuration: every Ingress would be down, not only this host.
                    errors[where] = f"the TLS library refuses it ({refused}): {served}"
                else:
                    out[t.secret] = pem
        for key in self.table.hostless:
            where = f"{key[0]}/{key[1]}"
            if key in hosts or where in errors:
                continue  # it serves other hosts (an entry with hosts names it), or said above
            secret = self.objects["Secret"].get(key)
            served = "its Ingress's hosts are served with the default certificate"
            if secret is None:
                errors[where] = f"no such Secret (a tls entry without hosts): {served}"
            elif secret.get("type") != TLS_TYPE:
                errors[where] = f"type is {secret.get('type')}, not {TLS_TYPE} (a tls entry without hosts): {served}"
            elif (refused := self._refused(_pem(secret))) is not None:
                errors[where] = f"the TLS library refuses it ({refused}; a tls entry without hosts): {served}"
            else:
                errors[where] = ("a tls entry without hosts, and its certificate names none of its Ingress's rule "
                                 f"hosts that no other entry names: {served}")
        # A usable Secret named for a host its certificate does not cover: not served for it
        # (a client would refuse it), the host goes to another Ingress's Secret that covers
        # it, else to the default certificate -- as ingress-nginx says (VerifyHostname).
        uncovered: dict[tuple[str, str], list[str]] = {}
        for key, host in self.table.uncovered:
            uncovered.setdefault(key, []).append(host)
        given = {t.host: t for t in self.table.tls}
        for key, names in uncovered.items():
            where = f"{key[0]}/{key[1]}"
            said = []
            for host in dict.fromkeys(names):
                t = given.get(host)
                by = (f"{t.secret[0]}/{t.secret[1]}'s certificate" if t is not None and t.serves and t.secret is not None
                      and t.secret != key else "the default certificate")  # fmt: skip
                said.append(f"its certificate does not cover {host} (no subjectAltName for it): {host} served with {by}")
            errors[where] = "; ".join([errors[where], *said] if where in errors else said)
        for where, why in errors.items():
            if self.tls_errors.get(where) != why:
                log.warning("ingress: TLS Secret %s: %s", where, why)
        self.tls_errors = errors
        return out

    def _usable(self, key: tuple[str, str]) -> bool:
        """Whether Secret ``key`` can serve TLS: it exists, is kubernetes.io/tls and loads
        (routing.build also asks that its certificate cover the host: ``_cert_names``)."""
        secret = self.objects["Secret"].get(key)
        return secret is not None and secret.get("type") == TLS_TYPE and self._refused(_pem(secret)) is None

    def _cert_names(self, key: tuple[str, str]) -> tuple[str, ...]:
        """The DNS names of usable Secret ``key``'s certificate (routing.build: the hosts it
        may serve, of those its Ingress's rules have)."""
        secret = self.objects["Secret"].get(key)
        if secret is None or not self._usable(key):
            return ()
        pem = _pem(secret)
        digest = hashlib.sha256(pem).digest()
        if digest not in self._names:
            if len(self._names) > 4096:
                self._names.clear()
            self._names[digest] = certs.dns_names(pem)
        return self._names[digest]

    def _refused(self, pem: bytes) -> str | None:
        """Why OpenSSL (HAProxy's and ours, with the system's security level) will not load
        this certificate and key -- a 1024-bit RSA key, a SHA-1 signature --, or None."""
        digest = hashlib.sha256(pem).digest()
        if digest not in self._loadable:
            if len(self._loadable) > 4096:
                self._loadable.clear()
            self._loadable[digest] = certs.refused(pem, self.paths.certs)
        return self._loadable[digest]

    async def _render(self, with_settings: settings.Settings | None = None) -> tuple[dict[str, bytes], str]:
        """Every file of the proxy (config, maps, certificates) and its structure: all of it
        but the servers (what decides reload vs. runtime change).  ``with_settings``: these
        rather than the ConfigMap's."""
        if self.run_as_error is not None:  # tried again (the user created, the drop-in added meanwhile)
            if not await self._resolve_run_as():
                raise ProxyError(self.run_as_error or "")
            if self.access_log.sock is not None:  # bound again: in the group's directory now
                self.access_log.close()
                with contextlib.suppress(OSError):
                    self.access_log.open()
        self.settings = with_settings if with_settings is not None else self._parse_settings()
        table = self.table = routing.build(self._ours(), ssl_redirect=self.settings.ssl_redirect, usable=self._usable,
                                           cert_names=self._cert_names)  # fmt: skip
        # Once per render, in steps: what _sync and _start_proxy give the proxy (self._want).
        want = self._want = await self._want_servers_in_steps(table.backends)
        pems = self._cert_files()
        cert_paths = {k: self.paths.certs / f"{k[0]}.{k[1]}.pem" for k in pems}
        logs = False if self.log_to == "off" else None  # None: the ConfigMap's enable-access-log
        run_as = (self.run_as.user, self.run_as.group) if self.run_as is not None else None
        files = {name: text.encode() for name, text in haproxy.render(
            self.table, want, self.settings, self.listen, self.paths, cert_paths, access_log=logs,
            run_as=run_as).items()}  # fmt: skip
        bare = haproxy.render(self.table, {}, self.settings, self.listen, self.paths, cert_paths, access_log=logs,
                              run_as=run_as)  # fmt: skip
        digest = hashlib.sha256(json.dumps(bare, sort_keys=True).encode())
        for key in sorted(pems):
            files[f"certs/{key[0]}.{key[1]}.pem"] = pems[key]
            digest.update(pems[key])
        return files, digest.hexdigest()

    def _write_files(self, files: Mapping[str, bytes]) -> None:
        for name, content in files.items():
            _write(self.paths.dir / name, content)
        keep = {name.partition("/")[2] for name in files if name.startswith("certs/")}
        for path in self.paths.certs.iterdir():
            if path.name not in keep:
                path.unlink(missing_ok=True)

    async def _check_or_fall_back(self, structure: str) -> str:
        """Check the configuration on disk (of ``structure``).  Refused by HAProxy (its ALERT:
        ConfigRefused) with the ConfigMap's settings, the settings are blamed only if it takes
        the same Ingresses with other settings: the last settings it accepted (if these are
        new), else the defaults.  Taken: that runs instead, and new settings so refused stay
        refused while the ConfigMap holds them (settings it accepted before are asked again at
        the next sync).  Refused with those too, or with the defaults, it is no fault of the
        settings (an Ingress, a certificate), and a check that failed by itself (killed) blames
        nothing either: the ProxyError goes to the caller, which tries again later, and what
        runs is left alone.  The structure of what was checked."""
        try:
            await self.proxy.check(self.paths.config)
        except ConfigRefused as err:
            if self.settings == settings.Settings():
                raise
            tried, accepted = self.settings, self._good_settings
            taken = None
            try:
                for other in dict.fromkeys((accepted if tried != accepted else settings.Settings(), settings.Settings())):
                    files, structure = await self._render(with_settings=other)
                    await asyncio.to_thread(self._write_files, files)
                    try:
                        await self.proxy.check(self.paths.config)
                    except ConfigRefused:
                        continue
                    taken = other
                    break
            except (ProxyError, OSError):
                await self._render_again(tried)
                raise
            if taken is None:
                await self._render_again(tried)  # what was tried, as /ingress shows it
                raise
            error = f"ConfigMap {self.cfg.configmap}: HAProxy refused the settings: {err}"
            if self._refused_settings is not None and tried == self._fallback:
                # What ran instead of the ConfigMap's refused settings, refused now with these
                # Ingresses: the defaults instead, while the ConfigMap holds those settings.
                error = self._refused_settings[1]
                self._fallback = taken
            elif tried != accepted:
                self._refused_settings, self._fallback = (tried, error), taken
            self.settings_error = error
            log.error("ingress: %s; using %s", error,
                      "the last settings it accepted" if taken == accepted else "the default settings")  # fmt: skip
        self._good_settings = self.settings
        return structure

    async def _render_again(self, with_settings: settings.Settings) -> None:
        """The files, table and settings of a render with ``with_settings`` (after fallbacks
        that were refused too)."""
        files, _ = await self._render(with_settings=with_settings)
        await asyncio.to_thread(self._write_files, files)

    # ------------------------------------------------------------------ applying

    async def _sync(self) -> None:
        revision = self.revision
        start = time.perf_counter()
        files, structure = await self._render()
        want = self._want  # the render's servers (no await between): computed once per sync
        failed = False  # a reload failed: this revision is not applied, tried again later
        reload = structure != self._structure
        if reload:
            how = "reload"
            loaded = await self._reload(files, structure, want, unless_running=True)
            if loaded is None:  # settings HAProxy refuses fell back to the configuration it runs
                reload = False
                files, structure = await self._render()  # that configuration (should the runtime API refuse)
            elif not loaded:
                failed = True
                # The proxy runs on with what it had: its backends still follow their endpoints.
                changed = await self._runtime({b: s for b, s in want.items() if b in self.servers})
                how = "runtime" if changed else "none"
        if not reload:
            self.served = self.table  # the structure the proxy runs: its table
            changed = await self._runtime(want)
            if changed is None:  # the runtime API refused something: load it all
                failed = not await self._reload(files, structure, want)
                how = "none" if failed else "reload"
            else:
                how = "runtime" if changed else "none"
        if failed:
            self._retry_later()
        else:
            self._retry_at, self._retry_delay = None, RETRY_FIRST
            if revision <= self.revision:  # else a snapshot from a restore came meanwhile: the next sync counts
                self.applied_revision = revision
        if how != "none":
            self.last_change = {"how": how, "seconds": round(time.perf_counter() - start, 6), "at": time.time(),
                                "revision": revision}  # fmt: skip

    async def _reload(self, files: Mapping[str, bytes], structure: str, want: dict[str, set[Server]], *,
                      unless_running: bool = False) -> bool | None:
        """Load the configuration; False when the check or the reload failed (the proxy runs
        on with what it had).  ``unless_running``: None, and no reload, when what passed the
        check is the configuration the proxy runs (settings HAProxy refuses fell back to the
        ones it runs with, say after an agent restart: the files on disk are that configuration
        again, servers aside, which the runtime API sets)."""
        try:
            await asyncio.to_thread(self._write_files, files)
            structure = await self._check_or_fall_back(structure)
            if unless_running and structure == self._structure:
                return None
            await self.refresh_stats()  # what the old worker counted until now: folded once a new one runs
            self._reloading = True  # no stats read meanwhile (the new worker's would replace the old's)
            try:
                self.worker = await self.proxy.reload()
            finally:
                self._reloading = False
        except (ProxyError, OSError) as err:  # the old worker runs on and counts on: nothing folded
            self.error = f"reload failed: {err}"
            log.error("ingress: %s", self.error)
            return False
        self._fold_counters()
        self.servers = {name: set(s) for name, s in want.items()}
        self.draining = {}
        self._structure = structure
        self.served = self.table
        await asyncio.to_thread(self._save_loaded, structure)
        self.error = None
        log.info("ingress: reloaded (worker %d): %d Ingresses, %d backends%s", self.worker.pid if self.worker else 0,
                 len(self.table.ingresses), len(self.table.backends),
                 f"; conflicts: {'; '.join(self.table.conflicts)}" if self.table.conflicts else "")  # fmt: skip
        return True

    def _retry_later(self) -> None:
        """A failed reload (a master socket timing out, ``haproxy -c`` not started) is tried
        again even if nothing else changes: after 1 s, then 2, 4, ... up to 30 s."""
        self._retry_at = time.monotonic() + self._retry_delay
        self._retry_delay = min(self._retry_delay * 2, RETRY_MAX)

    def _retry_due(self, now: float) -> bool:
        return self._retry_at is not None and now >= self._retry_at

    async def _runtime(self, want: dict[str, set[Server]]) -> int | None:
        """Endpoint changes through the runtime API; the number of servers changed, None when
        the proxy refused a command (the caller reloads)."""
        changed = 0
        try:
            for backend in sorted(want):
                have = self.servers.get(backend, set())
                draining = self.draining.setdefault(backend, set())
                for server in sorted(want[backend] - have):
                    name = f"{backend}/{haproxy.server_name(server)}"
                    if server in draining:  # back before its connections ended: just enable it
                        draining.discard(server)
                    else:
                        out = await self.proxy.command(f"add server {name} {haproxy.address(*server)}")
                        if "New server registered" not in out:
                            raise ProxyError(f"add server {name}: {out}")
                    await self._expect_empty(f"enable server {name}")
                    have.add(server)
                    changed += 1
                for server in sorted(have - want[backend]):
                    await self._expect_empty(f"disable server {backend}/{haproxy.server_name(server)}")
                    have.discard(server)
                    draining.add(server)
                    changed += 1
                self.servers[backend] = have
                for server in sorted(draining):  # deleted once no connection uses it
                    out = await self.proxy.command(f"del server {backend}/{haproxy.server_name(server)}")
                    if "Server deleted" in out:
                        draining.discard(server)
        except ProxyError as err:
            log.warning("ingress: runtime change refused (%s); reloading instead", err)
            return None
        self.runtime_changes += changed
        return changed

    async def _expect_empty(self, command: str) -> None:
        out = await self.proxy.command(command)
        if out:
            raise ProxyError(f"{command}: {out}")

    # ------------------------------------------------------------------ status in etcd

    def _node_key(self) -> bytes:
        return f"{self.ds.prefix}/{INGRESS_NODES}/{self.node}".encode()

    async def _publish(self) -> None:
        """``<prefix>/ingress/nodes/<node>`` under our lease, while the proxy serves; put again
        when the lease changes (etcd lost it) or what we serve changes."""
        lease = self.ds.lease_id
        value = json.dumps({"node": self.node, "addresses": list(self.listen.addresses), "controller": self.cfg.controller,
                            "watch_without_class": self.cfg.watch_without_class, "http_port": self.listen.http_port,
                            "https_port": self.listen.https_port})  # fmt: skip
        if lease is None or not self.proxy.running or self._published == (lease, value):
            return
        key = self._node_key()
        try:
            await self.ds.request("publish the ingress node", lambda c: c.transaction(
                compare=[], success=[tx.Put(key, value.encode(), lease=lease)], failure=[]), timeout=10)  # fmt: skip
        except Exception as err:  # noqa: BLE001 - etcd down: tried again at the next tick
            log.debug("ingress: publishing %s failed: %s", key.decode(), err)
            return
        self._published = (lease, value)

    async def _unpublish(self) -> None:
        key = self._node_key()
        try:
            await self.ds.request("unpublish the ingress node", lambda c: c.delete(key), timeout=5)
        except Exception as err:  # noqa: BLE001 - etcd away: the key stays (and _published with it)
            log.debug("ingress: unpublishing %s failed: %s", key.decode(), err)
            return
        self._published = None

    # ------------------------------------------------------------------ counters

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL)
            await self.refresh_stats()

    async def refresh_stats(self) -> None:
        if self._reloading:
            return
        if not self.proxy.running:  # what it showed last is not what runs now: nothing does
            self._fold_counters()
            self._forget_proxy()
            return
        with contextlib.suppress(ProxyError):
            self.stats = await self.proxy.stats()
            self.info = await self.proxy.info()
            self._last_counts = {}
            for row in self.stats:
                if row.get("svname") == "BACKEND":
                    for counter in ("req_tot", "hrsp_1xx", "hrsp_2xx", "hrsp_3xx", "hrsp_4xx", "hrsp_5xx", "hrsp_other"):
                        with contextlib.suppress(ValueError):
                            self._last_counts[(row["pxname"], counter)] = int(row.get(counter) or 0)

    def _forget_proxy(self) -> None:
        """The proxy is gone: its connections and servers' states with it (the counters stay,
        folded)."""
        self.stats = []
        self.info = {}

    def _fold_counters(self) -> None:
        """A reload or restart starts the proxy's counters from zero: keep what was counted,
        of the backends there are (a backend gone takes its counts along: its metric series
        went with it: views.py lists the backends of the table served, which a reload makes this one)."""
        backends = self.table.backends
        for key, value in self._last_counts.items():
            if key[0] in backends:
                self.counter_base[key] = self.counter_base.get(key, 0) + value
        self.counter_base = {k: v for k, v in self.counter_base.items() if k[0] in backends}
        self._last_counts = {}

    def counter(self, backend: str, counter: str) -> int:
        return self.counter_base.get((backend, counter), 0) + self._last_counts.get((backend, counter), 0)


def servers_in_steps(backends: Mapping[str, routing.Backend], objects: Mapping[str, Mapping[tuple[str, str], Any]]
                     ) -> Generator[None, None, dict[str, set[Server]]]:
    """The ready endpoints of every backend of ``backends`` (a ``resource`` backend, a Service
    that does not exist: none, it answers 503), from the records ``objects`` (by kind, then
    (namespace, name)), the same endpoints the Services table uses (:func:`model.build`).

    Linear: one pass over the cluster's EndpointSlices and the pods of the backends'
    namespaces (a :class:`model.PodIndex`), then one :func:`model.build` per :data:`ENDPOINT_STEP`
    backend Services, given only the EndpointSlices of those Services and the pods their
    selectors may match -- not (backend Services) x (the cluster's pods and slices).  Yields
    between steps (:data:`INDEX_STEP` records indexed, :data:`ENDPOINT_STEP` Services built: the
    caller gives the event loop back); the records are taken before the first: records that
    change meanwhile count at the next sync."""
    services = objects["Service"]
    needed: dict[tuple[str, str], Any] = {}
    for b in backends.values():
        if b.service is not None and (key := (b.namespace, b.service)) not in needed and key in services:
            needed[key] = services[key]
    slices: dict[tuple[str, str], list[Any]] = {}
    pods = model.PodIndex()
    namespaces = {ns for ns, _ in needed}
    records = list(objects["EndpointSlice"].items()) if needed else []
    mine = [(k, p) for k, p in objects["Pod"].items() if k[0] in namespaces]
    work = 0  # records' worth of work since the loop was last given back (a Service: INDEX_STEP / ENDPOINT_STEP)
    for start in range(0, len(records), INDEX_STEP):
        if work:
            yield
            work = 0
        for (ns, _), s in records[start : start + INDEX_STEP]:
            key = (ns, (s["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL))
            if key in needed:
                slices.setdefault(key, []).append(s)  # type: ignore[arg-type]
        work += len(records[start : start + INDEX_STEP])
    for start in range(0, len(mine), INDEX_STEP):
        chunk = mine[start : start + INDEX_STEP]
        if work and work + len(chunk) > INDEX_STEP:
            yield
            work = 0
        for (ns, name), p in chunk:
            pods.put(ns, name, p)
        work += len(chunk)
    ports: dict[tuple[str, str], list[model.ServicePort]] = {}
    keys = list(needed)
    for start in range(0, len(keys), ENDPOINT_STEP):
        step = keys[start : start + ENDPOINT_STEP]
        cost = len(step) * INDEX_STEP // ENDPOINT_STEP
        if work and work + cost > INDEX_STEP:
            yield
            work = 0
        chosen: dict[int, Any] = {}  # the pods the step's selectors may match, once each
        for key in step:
            if needed[key]["spec"].get("selector"):
                chosen.update((id(p), p) for p in pods.candidates(key[0], needed[key]["spec"]["selector"]))
        for sp in model.build([needed[k] for k in step], [s for k in step for s in slices.get(k, ())], chosen.values()):
            ports.setdefault((sp.namespace, sp.service), []).append(sp)
        work += cost
    return {name: backend_servers(ports.get((b.namespace, b.service), []), b.port) if b.service is not None else set()
            for name, b in backends.items()}  # fmt: skip


def backend_servers(ports: list[model.ServicePort], port: int | str) -> set[Server]:
    """The ready endpoints of a backend's Service port (a number or a port name): those of the
    Service's primary family, its first (a dual-stack Service's pods are not proxied to twice)."""
    for sp in ports:
        if sp.protocol == "TCP" and (sp.port == port if isinstance(port, int) else sp.port_name == port):
            return {(e.ip, e.port) for e in sp.usable()}
    return set()


def _write(path: Path, content: bytes) -> None:
    """Atomically and durably, readable by the owner only (certificates hold private keys):
    a temporary file of its own (a leftover one, whatever its mode, removed first: O_EXCL
    creates it 0600), on disk before it takes the name, the rename synced after."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    # The rename itself, where the file system can sync a directory.  (As
    # agentd.cni.endpoints.fsync_directory, which agentd.ingress may not import:
    # pyproject.toml's import contracts.)
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def remove_files(paths: Paths) -> None:
    """The proxy's directory, certificates included."""
    import shutil

    shutil.rmtree(paths.dir, ignore_errors=True)


def remove_ingress_proxy(state_dir: Path) -> bool:
    """Stop the proxy a previous agent left running and remove its files: ``agentd leave``
    (with or without an agent), an agent started with ``[ingress] enabled = false``."""
    paths = Paths(Path(state_dir) / STATE_SUBDIR)
    if not paths.dir.exists():
        return False
    stop_stale(paths)
    remove_files(paths)
    log.info("removed the ingress proxy's files (%s)", paths.dir)
    return True


def _pem(secret: Mapping[str, Any]) -> bytes:
    """A kubernetes.io/tls Secret as HAProxy's crt-list takes it: the chain, then the key."""
    data = secret.get("data", {})
    crt = base64.b64decode(data[TLS_CERT_KEY])
    key = base64.b64decode(data[TLS_PRIVATE_KEY_KEY])
    return crt.rstrip(b"\n") + b"\n" + key.rstrip(b"\n") + b"\n"


def _settings_from(raw: Any) -> settings.Settings | None:
    """Settings as ``_save_loaded`` wrote them (dataclasses.asdict); None for anything else
    (none written, an older agent's file, a field of the wrong type)."""
    if not isinstance(raw, dict):
        return None
    out: dict[str, Any] = {}
    for f in dataclasses.fields(settings.Settings):
        if f.name not in raw:
            continue
        value, default = raw[f.name], getattr(settings.Settings(), f.name)
        if isinstance(default, tuple):
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                return None
            value = tuple(value)
        elif type(value) is not type(default):
            return None
        out[f.name] = value
    return settings.Settings(**out)
