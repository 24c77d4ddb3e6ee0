"""The REST and metrics API (README.md "REST", docs/operations.md "Metrics"), served by aiohttp inside the agent's loop.

The API knows nothing about how the answers are computed: it asks a
:class:`StatusProvider` (the node agent, or the standalone speaker) and renders JSON.
Metrics come from the provider's prometheus-client registry.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections.abc import Callable, Container
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from bgp import Speaker

from agentd.daemon import auth
from agentd.daemon import observe_api
from agentd.daemon.bgp_json import RibQuery
from agentd.digits import ascii_digits, whole_number

log = logging.getLogger("agentd.api")

# Seconds a request in flight has to finish when the API stops (then it is cancelled): a
# followed GET /flows never ends by itself, and the agent must not wait aiohttp's 60 s for it.
SHUTDOWN_GRACE = 2.0
# A request's handler is cancelled when its connection is lost (aiohttp's handler_cancellation):
# a followed GET /flows whose reader went gives its follower's place back then, not at its next
# write (a keep-alive every 10 s on a quiet stream), and a gathering stops asking other nodes.
# What must finish whoever waits (POST /leave's step in etcd) is shielded.
HANDLER_CANCELLATION = True
# Seconds a connection may stay idle between two requests, and may take to send its first
# request's head (aiohttp's default keeps an idle connection for an hour): the read-only
# listener is open to the underlay, and a connection that sends nothing must not hold a
# file descriptor for long.
KEEPALIVE_TIMEOUT = 15.0
# Connections open at once on one listener; more are answered 503 and closed as they come (as
# the DNS server's TCP clients are closed, agentd/services/dns.py): the agent's descriptors
# stay for etcd, netlink and BGP whoever opens connections.
MAX_CONNECTIONS = 1000
# Connections open at once from one remote address on the read-only cluster listener (loopback
# not counted): without the read token one host could otherwise fill MAX_CONNECTIONS and the
# other nodes could no longer gather from this one.  A node's gatherer keeps a few.  An IPv6
# address is counted with the rest of its /64 (a host may use any address of its /64, as
# rate limiters assume), an IPv4 one (also as ::ffff:a.b.c.d) on its own -- except the
# cluster's registered nodes' addresses, each counted on its own: a datacenter's IPv6 subnet is
# often one /64 that every node shares, and each of them holds connections (gathers, follows).
MAX_PER_ADDRESS = 64
# Of the cluster listener's MAX_CONNECTIONS, the places only the registered nodes' addresses
# take: a few hosts of the underlay (16 of them at MAX_PER_ADDRESS, each connection sitting
# KEEPALIVE_TIMEOUT without a request, then opened again) cannot lock the nodes out.
NODE_RESERVE = MAX_CONNECTIONS // 4
RIB_LIMIT_MAX = 10_000_000  # /rib?limit=N: more prefixes than any RIB holds


class Conflict(Exception):
    """A request the provider refuses in its present state (409, the message its error)."""


class StatusProvider(Protocol):
    registry: CollectorRegistry

    def health(self) -> tuple[bool, list[str]]: ...

    def readiness(self) -> tuple[bool, list[str]]: ...

    def status(self) -> dict[str, Any]: ...

    def peers(self) -> list[dict[str, Any]]: ...

    def bgp_speaker(self) -> Speaker | None: ...

    def routes(self) -> list[dict[str, Any]]: ...


@web.middleware
async def _json_errors(request: web.Request, handler: auth.Handler) -> web.StreamResponse:
    """Every error answer is JSON, aiohttp's own too (404 of no route, 405 with its Allow):
    ``{"error": reason}``; a redirect stays one."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")}
        return web.json_response({"error": exc.reason}, status=exc.status, headers=headers)


class _Connections:
    """The protocol factory of one listener: aiohttp's server, with at most ``limit``
    connections open at once (one past it is answered 503 and closed as it comes) and each
    connection's first request head read within ``head_timeout`` seconds (later ones:
    aiohttp's keep-alive).  With ``nodes`` (the cluster listener) the other clients together
    hold at most ``limit - reserve``: the registered nodes always find places."""

    def __init__(self, server: web.Server, limit: int, head_timeout: float, per_address: int | None = None,
                 nodes: Callable[[], Container[str]] | None = None, reserve: int = 0) -> None:
        """``nodes``: the cluster's registered nodes' addresses (canonical text), each counted on
        its own rather than with the rest of its IPv6 /64, and admitted into the ``reserve``
        places the others cannot take."""
        self._server = server
        self.nodes = nodes
        self.limit = limit
        self.reserve = reserve if nodes is not None else 0
        self.head_timeout = head_timeout
        self.per_address = per_address  # None: no limit per remote address
        self.by_address: dict[str, int] = {}  # IPv4 address or IPv6 /64 -> its connections open (per_address only)
        self.open = 0  # connections admitted and not yet lost (those refused as they came aside)
        self.others = 0  # of them, those not from a registered node's address
        self.refused = 0
        self.refused_address = 0  # refused as they came: their address had per_address open
        # Connections whose first request head has not come yet -> the timer that closes them
        # when it is due.  The timer is cancelled once the head comes or the connection is lost:
        # it holds the handler (aiohttp's take no weak references), and each aborted connection
        # was held head_timeout longer (~1.75 KB each: memory growing with the rate of new ones).
        self.waiting: dict[Any, asyncio.TimerHandle] = {}

    def __getattr__(self, name: str) -> Any:  # the rest is aiohttp's server's (shutdown, connections)
        return getattr(self._server, name)

    def __call__(self) -> asyncio.BaseProtocol:
        # Admitted (or not) in connection_made, where the peer is known (a registered node has
        # places of its own), and counted there at once: asyncio's loop accepts up to the
        # listen backlog (aiohttp's 128) at a time and makes all their protocols before any is
        # told of its transport, but tells them one after the other -- no burst passes the cap.
        return _Counted(self, self._server())

    def admit(self, peer: Any) -> tuple[str, bool] | None:
        """(the key ``peer`` is counted under, whether it is a registered node's address), or
        None when it is refused: ``limit`` connections open (the others: ``limit - reserve``),
        or its address has ``per_address`` open.  The key is "" for what is not counted per
        address (loopback, a peer without address, a listener without ``per_address``)."""
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        try:
            ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            ip = None
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # a dual-stack socket's IPv4 client
            ip = ip.ipv4_mapped
        node = ip is not None and not ip.is_loopback and self.nodes is not None and str(ip) in self.nodes()
        if self.open >= self.limit or (not node and self.others >= self.limit - self.reserve):
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                log.warning("API: %d connections open (%d of them not from a registered node), more answered 503 "
                            "as they come (%d so far)", self.open, self.others, self.refused)
            return None
        if ip is None or ip.is_loopback or self.per_address is None:
            return "", node
        # An IPv6 host is given a /64 and may use any address of it: counted per /64, but for a
        # registered node's address (the nodes of one subnet often share its /64).
        address = str(ip)
        if ip.version == 6 and not node:
            address = str(ipaddress.IPv6Network((ip, 64), strict=False))
        n = self.by_address.get(address, 0)
        if n >= self.per_address:
            self.refused_address += 1
            if self.refused_address == 1 or self.refused_address % 1000 == 0:
                log.warning("API: %s has %d connections open, more from it answered 503 as they come (%d so far)",
                            address, n, self.refused_address)  # fmt: skip
            return None
        self.by_address[address] = n + 1
        return address, node

    def take(self, node: bool) -> None:
        self.open += 1
        self.others += not node

    def release(self, address: str, node: bool) -> None:
        self.open -= 1
        self.others -= not node
        if address:
            n = self.by_address.pop(address, 0) - 1
            if n > 0:
                self.by_address[address] = n

    def await_head(self, handler: Any) -> None:
        """``handler``'s connection is closed unless its first request head comes within
        ``head_timeout``.  (aiohttp 3.14, here, arms its keep-alive timer at the connection's
        start as well, since aio-libs/aiohttp#13681; the aiohttp versions before it, which
        pyproject allows, closed no connection whose first head never came.)"""
        self.waiting[handler] = asyncio.get_running_loop().call_later(self.head_timeout, self._head_due, handler)

    def head_came(self, handler: Any) -> None:
        """Its first head came, or its connection is gone: the timer lets go of it."""
        timer = self.waiting.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def _head_due(self, handler: Any) -> None:
        if self.waiting.pop(handler, None) is not None and handler.transport is not None:
            handler.force_close()  # nothing, or half a head, in all this time


class _Counted(asyncio.Protocol):
    """aiohttp's handler behind the listener's limits (:meth:`_Connections.admit`), counted
    in ``open`` from its admission to its end: one refused is answered 503 and closed before
    aiohttp sees it."""

    def __init__(self, connections: _Connections, handler: Any) -> None:
        self.connections = connections
        self.handler = handler
        self.counted: tuple[str, bool] | None = None  # its admit() key while counted; None: aiohttp has it not

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        admitted = self.connections.admit(transport.get_extra_info("peername"))
        if admitted is None:
            _refuse(transport)  # type: ignore[arg-type]
            return
        self.counted = admitted
        self.connections.take(admitted[1])
        self.connections.await_head(self.handler)
        self.handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.counted is None:
            return
        self.connections.release(*self.counted)
        self.counted = None
        self.connections.head_came(self.handler)  # no head will: its timer cancelled, the handler let go
        self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.counted is not None:
            self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        if self.counted is None:
            return None
        return self.handler.eof_received()  # type: ignore[no-any-return]

    def pause_writing(self) -> None:
        if self.counted is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.counted is not None:
            self.handler.resume_writing()


_BUSY = json.dumps({"error": "too many connections open to this API: try again"}).encode() + b"\n"
# What a connection past a limit is told before it is closed: one write of what the client would
# otherwise have to guess from a close (a running agent, busy; not "no agent here").
BUSY_ANSWER = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
               b"Content-Length: %d\r\nConnection: close\r\n\r\n%s") % (len(_BUSY), _BUSY)


def _refuse(transport: asyncio.WriteTransport) -> None:
    transport.write(BUSY_ANSWER)  # into the socket's buffer at once (a few hundred bytes)
    transport.close()


class _Runner(web.AppRunner):
    def __init__(self, app: web.Application, connections: Callable[[web.Server], _Connections], **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._connections = connections

    async def _make_server(self) -> web.Server:
        return self._connections(await super()._make_server())  # type: ignore[return-value]


def _count(value: str, name: str, most: int) -> int:
    """A query parameter that is a whole number 1..``most``; ValueError naming it otherwise
    (Python's own int() message names no parameter, and 5000 digits meet its digit limit)."""
    number = whole_number(value, 12)
    if number is None:
        shown = value if len(value) <= 20 else value[:20] + "..."
        if ascii_digits(value):  # too many of them
            raise ValueError(f"{name}: {shown} is out of range 1..{most}")
        raise ValueError(f"{name}: {shown!r} is not a whole number")
    if not 1 <= number <= most:
        raise ValueError(f"{name}: {number} is out of range 1..{most}")
    return number


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
        nodes: Callable[[], Container[str]] | None = None,
    ) -> None:
        """``token``: what a request that changes something (POST /leave) must carry
        (agentd/daemon/auth.py); None: this API accepts no changes.  With ``read_token`` this is
        the read-only cluster listener (agentd/daemon/cluster.py): GET endpoints only, each
        request with that token; ``nodes``: the registered nodes' addresses, whose connections
        count per address (not per IPv6 /64) against MAX_PER_ADDRESS."""
        self.provider = provider
        self.nodes = nodes
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self.token = token
        self.connections: _Connections | None = None
        self.max_connections = MAX_CONNECTIONS
        self.max_per_address = MAX_PER_ADDRESS if read_token is not None else None  # the cluster listener's
        self.node_reserve = NODE_RESERVE  # with ``nodes``: places only the registered nodes take
        self.keepalive_timeout = KEEPALIVE_TIMEOUT
        read_only = read_token is not None
        if read_token is not None:
            middlewares = [auth.read_guard(read_token)]
        else:  # loopback's: DNS rebinding, then changes
            middlewares = [auth.host_guard(host), auth.guard(lambda: self.token)]
        app = web.Application(middlewares=[self._head_seen, _json_errors, *middlewares])
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
                *([] if read_only else [web.post("/leave", self._leave), web.get("/leave", self._leave_progress)]),
                web.get("/ingress", self._ingress),  # Ingress
            ]
        )
        if hasattr(provider, "flows_view"):  # flows, the cluster view, /ui/ (agentd/daemon/observe_api.py)
            observe_api.add_routes(app, provider, read_only=read_only,  # type: ignore[arg-type]
                                   token_of=lambda: self.token,
                                   own={"rib": self._rib, "metrics": self._metrics, "healthz": self._healthz,
                                        "readyz": self._readyz})
        self.app = app

    @web.middleware
    async def _head_seen(self, request: web.Request, handler: auth.Handler) -> web.StreamResponse:
        if self.connections is not None:
            self.connections.head_came(request.protocol)
        return await handler(request)

    def _capped(self, server: web.Server) -> _Connections:
        self.connections = _Connections(server, self.max_connections, self.keepalive_timeout, self.max_per_address,
                                        self.nodes, self.node_reserve)
        return self.connections

    async def start(self) -> None:
        self._runner = _Runner(self.app, self._capped, access_log=None, handle_signals=False,
                               shutdown_timeout=SHUTDOWN_GRACE, keepalive_timeout=self.keepalive_timeout,
                               handler_cancellation=HANDLER_CANCELLATION)
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
            limit, prefix = request.query.get("limit"), request.query.get("prefix")
            if prefix == "":  # not "every prefix": a script's empty variable
                raise ValueError("prefix: empty (leave it out for the whole RIB)")
            query = RibQuery(
                prefix=prefix,
                after=request.query.get("after"),
                limit=_count(limit, "limit", RIB_LIMIT_MAX) if limit is not None else None,
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
        shown = request.query.get("view")
        summary = shown == "summary"  # what is applied only: cheap to poll
        # view=pods: each local pod's row without its allow-lists (the browser view's node page)
        data = view(request.query.get("pod"), summary, allow_lists=shown != "pods") if view is not None else None
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
        try:
            left = leave()
        except Conflict as err:  # e.g. already stopping
            return _json({"error": str(err)}, 409)
        # Answered once the node has left etcd (or could not): `agentd leave` says which, and
        # follows the other steps on GET /leave, then in the report file (the agent exits).
        error = await asyncio.shield(left) if asyncio.isfuture(left) else None
        answer: dict[str, Any] = {"leaving": True, "etcd_error": error}
        progress = getattr(self.provider, "leave_progress", None)
        report = progress() if progress is not None else None
        if report is not None:
            answer["id"] = report["id"]
            answer["report"] = str(getattr(self.provider, "leave_report_path", "") or "") or None
        return _json(answer, 202)

    async def _leave_progress(self, request: web.Request) -> web.Response:
        """The leave under way, step by step (agentd/daemon/leave_report.py): what ``agentd
        leave`` prints while the agent is still up; 404 when this agent is not leaving."""
        progress = getattr(self.provider, "leave_progress", None)
        report = progress() if progress is not None else None
        if report is None:
            return _json({"error": "this agent is not leaving (POST /leave starts a leave)"}, 404)
        return _json(report)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.provider.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
