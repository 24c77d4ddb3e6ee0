"""The REST and metrics API (README.md "REST", docs/operations.md "Metrics"), served by aiohttp inside the agent's loop.

The API knows nothing about how the answers are computed: it asks a
:class:`StatusProvider` (the node agent, or the standalone speaker) and renders JSON.
Metrics come from the provider's prometheus-client registry.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from bgp import Speaker

from agentd.daemon import auth
from agentd.daemon import observe_api
from agentd.daemon.bgp_json import RibQuery

log = logging.getLogger("agentd.api")

# Seconds a request in flight has to finish when the API stops (then it is cancelled): a
# followed GET /flows never ends by itself, and the agent must not wait aiohttp's 60 s for it.
SHUTDOWN_GRACE = 2.0


class StatusProvider(Protocol):
    registry: CollectorRegistry

    def health(self) -> tuple[bool, list[str]]: ...

    def readiness(self) -> tuple[bool, list[str]]: ...

    def status(self) -> dict[str, Any]: ...

    def peers(self) -> list[dict[str, Any]]: ...

    def bgp_speaker(self) -> Speaker | None: ...

    def routes(self) -> list[dict[str, Any]]: ...


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(data, indent=2, sort_keys=False, default=str) + "\n",
        status=status,
        content_type="application/json",
    )


class ApiServer:
    """``GET /healthz /readyz /status /peers /rib /routes /policy /services /metrics``, for the
    node agent ``/flows``, ``/cluster``, ``/nodes/...``, ``/ui/``, and ``POST /leave``, on
    ``host:port``."""

    def __init__(
        self,
        provider: StatusProvider,
        host: str = "127.0.0.1",
        port: int = 9099,
        *,
        token: str | None = None,
        read_token: Callable[[], str | None] | None = None,
    ) -> None:
        """``token``: what a request that changes something (POST /leave) must carry
        (agentd/daemon/auth.py); None: this API accepts no changes.  With ``read_token`` this is
        the read-only cluster listener (agentd/daemon/cluster.py): GET endpoints only, each
        request with that token."""
        self.provider = provider
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self.token = token
        read_only = read_token is not None
        if read_token is not None:
            middlewares = [auth.read_guard(read_token)]
        else:  # loopback's: DNS rebinding, then changes
            middlewares = [auth.host_guard(host), auth.guard(lambda: self.token)]
        app = web.Application(middlewares=middlewares)
        app.add_routes(
            [
                web.get("/healthz", self._healthz),
                web.get("/readyz", self._readyz),
                web.get("/status", self._status),
                web.get("/peers", self._peers),
                web.get("/rib", self._rib),
                web.get("/routes", self._routes),
                web.get("/metrics", self._metrics),
                web.get("/policy", self._policy),  # NetworkPolicy
                web.get("/services", self._services),  # Services
                *([] if read_only else [web.post("/leave", self._leave)]),
                web.get("/ingress", self._ingress),  # Ingress
            ]
        )
        if hasattr(provider, "flows_view"):  # flows, the cluster view, /ui/ (agentd/daemon/observe_api.py)
            observe_api.add_routes(app, provider, read_only=read_only,  # type: ignore[arg-type]
                                   token_of=lambda: self.token)
        self.app = app

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        try:
            await self._site.start()
        except OSError:  # the port is taken, the address is not ours: nothing is left half made
            await self._runner.cleanup()
            self._runner = self._site = None
            raise
        if self.port == 0:
            server = self._site._server  # the bound port, for tests that ask for port 0
            sockets = getattr(server, "sockets", None) or []
            if sockets:
                self.port = sockets[0].getsockname()[1]
        log.info("API listening on http://%s:%d", self.host, self.port)

    @property
    def running(self) -> bool:
        return self._site is not None

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = self._site = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def _healthz(self, request: web.Request) -> web.Response:
        ok, problems = self.provider.health()
        return _json({"healthy": ok, "problems": problems}, 200 if ok else 503)

    async def _readyz(self, request: web.Request) -> web.Response:
        ok, reasons = self.provider.readiness()
        return _json({"ready": ok, "reasons": reasons}, 200 if ok else 503)

    async def _status(self, request: web.Request) -> web.Response:
        return _json(self.provider.status())

    async def _peers(self, request: web.Request) -> web.Response:
        return _json(self.provider.peers())

    async def _rib(self, request: web.Request) -> web.StreamResponse:
        """The Loc-RIB as one JSON array, streamed a chunk at a time with the loop free in
        between, so a million prefixes neither block BGP nor sit in memory as one document.
        ``?prefix=P`` gives one prefix; ``?after=P&limit=N`` a page of N prefixes after P."""
        try:
            limit = request.query.get("limit")
            query = RibQuery(
                prefix=request.query.get("prefix"),
                after=request.query.get("after"),
                limit=int(limit) if limit is not None else None,
            )
        except ValueError as err:
            return _json({"error": str(err)}, 400)
        speaker = self.provider.bgp_speaker()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        first = True
        await resp.write(b"[")
        if speaker is not None:
            for rows in query.chunks(speaker):
                if rows:
                    text = ",\n".join(json.dumps(r, default=str) for r in rows)
                    await resp.write((("\n" if first else ",\n") + text).encode())
                    first = False
                await asyncio.sleep(0)  # BGP, timers and other requests run between chunks
        await resp.write(b"\n]\n")
        await resp.write_eof()
        return resp

    async def _routes(self, request: web.Request) -> web.Response:
        return _json(self.provider.routes())

    async def _policy(self, request: web.Request) -> web.Response:
        """Per local pod: the policies selecting it, its allow-lists, drops (agentd/policy/agent.py)."""
        view = getattr(self.provider, "policy_view", None)
        summary = request.query.get("view") == "summary"  # what is applied only: cheap to poll
        data = view(request.query.get("pod"), summary) if view is not None else None
        if data is None:
            return _json({"error": "network policy is not running here"}, 404 if view is None else 503)
        return _json(data)

    async def _services(self, request: web.Request) -> web.Response:
        """Per service: VIP, ports, endpoints with their state, connections (agentd/services/agent.py)."""
        view = getattr(self.provider, "services_view", None)
        summary = request.query.get("view") == "summary"  # what is applied only: cheap to poll
        data = view(summary) if view is not None else None
        if data is None:
            return _json({"error": "services are not running here"}, 404 if view is None else 503)
        return _json(data)

    async def _ingress(self, request: web.Request) -> web.Response:
        """The Ingress controller: hosts, rules, backends and their servers (agentd/ingress/)."""
        view = getattr(self.provider, "ingress_view", None)
        data = view() if view is not None else None
        if data is None:
            return _json({"error": "the ingress controller is not enabled here ([ingress] enabled)"}, 404)
        return _json(data)

    async def _leave(self, request: web.Request) -> web.Response:
        """``agentd leave`` asks the running agent to decommission its node (from this host,
        with the API token: auth.guard)."""
        leave = getattr(self.provider, "request_leave", None)
        if leave is None:
            return _json({"error": "this process does not manage a node"}, 404)
        leave()
        return _json({"leaving": True}, 202)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.provider.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
