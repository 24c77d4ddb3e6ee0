"""The observability endpoints of the API: ``GET /flows`` (NDJSON, streamed), the cluster view
(``GET /cluster``, ``GET /nodes/{node}/{what}``) and the browser view (``/ui/``).

Everything here reads: the same views as the other endpoints (the UI calls these and nothing
else), gathered from other nodes through :class:`agentd.daemon.cluster.ClusterView`.

``GET /flows`` takes the filters of :class:`agentd.flows.model.FlowFilter` as query parameters
(``pod``, ``from-pod``, ``to-pod``, ``namespace``, ``label``, ``verdict``, ``protocol``,
``port``, ``node``, ``ip``, ``event``, ``reason``, ``service``; repeat one for "any of"), and
``last=N`` (default 100: the last N matching records, oldest first), ``since=UNIX-TIME``,
``follow=1`` (then every new matching record as it comes, until the client goes), and
``cluster=1`` (every node's records, gathered; a ``node`` filter alone also asks those nodes).
One JSON record per line; a node that cannot be asked is a line ``{"node": ..., "error": ...}``,
records a slow follower missed a line ``{"lost": N}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlencode

from aiohttp import web

from agentd.daemon.cluster import RELAYED, ClusterView
from agentd.flows.model import FilterError, FlowFilter
from agentd.flows.views import FlowViews

log = logging.getLogger("agentd.api")

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
NDJSON = "application/x-ndjson"
CONTROL = ("last", "since", "follow", "cluster")
KEEPALIVE = 10.0  # seconds between empty lines on a quiet followed stream (proxies close idle ones)
MAX_LAST = 100_000
# The browser view loads nothing from elsewhere: the page says so to the browser too.
UI_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
UI_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml",
            ".png": "image/png", ".ico": "image/x-icon"}


class ObservedAgent(Protocol):
    """What these endpoints read (``agentd.daemon.views.AgentViews``)."""

    def flows_view(self) -> FlowViews | None: ...

    def cluster_view(self) -> ClusterView | None: ...

    def node_name(self) -> str: ...

    def status(self) -> dict[str, Any]: ...

    def peers(self) -> list[dict[str, Any]]: ...

    def routes(self) -> list[dict[str, Any]]: ...

    def policy_view(self, pod: str | None = None, summary: bool = False) -> dict[str, Any] | None: ...

    def services_view(self, summary: bool = False) -> dict[str, Any] | None: ...


def add_routes(app: web.Application, agent: ObservedAgent, *, read_only: bool) -> None:
    """``/flows`` on both listeners; the cluster gathering and ``/ui/`` only on loopback's."""
    handlers = _Handlers(agent)
    app.router.add_get("/flows", handlers.flows)
    if read_only:
        return
    app.router.add_get("/cluster", handlers.cluster)
    app.router.add_get("/nodes/{node}/{what}", handlers.node)
    app.router.add_get("/ui", handlers.ui_root)
    app.router.add_get("/ui/", handlers.ui_file)
    app.router.add_get("/ui/{name}", handlers.ui_file)


class _Handlers:
    def __init__(self, agent: ObservedAgent) -> None:
        self.agent = agent

    # ------------------------------------------------------------------ /flows

    async def flows(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        try:
            flt = FlowFilter.parse((k, v) for k, v in q.items() if k not in CONTROL)
            last = int(q.get("last", "100"))
            if not 0 <= last <= MAX_LAST:
                raise FilterError(f"last: {last} is out of range 0..{MAX_LAST}")
            since = float(q["since"]) if "since" in q else None
        except (FilterError, ValueError) as err:
            return web.json_response({"error": str(err)}, status=400)
        follow = q.get("follow", "") in ("1", "true", "yes")
        cluster = q.get("cluster", "") in ("1", "true", "yes") or bool(flt.node and set(flt.node) != {self.agent.node_name()})
        view = self.agent.flows_view()
        if view is None and not cluster:
            return web.json_response({"error": "flow records are off on this node ([flows] enabled = false)"}, status=404)
        resp = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            if cluster:
                await self._cluster_flows(resp, flt, last, since, follow)
            else:
                assert view is not None
                await _local_flows(resp, view, flt, last, since, follow)
        except ConnectionResetError:  # the reader went: a followed stream ends so
            return resp
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    async def _cluster_flows(self, resp: web.StreamResponse, flt: FlowFilter, last: int, since: float | None,
                             follow: bool) -> None:
        cluster = self.agent.cluster_view()
        me = self.agent.node_name()
        names = sorted(set(flt.node) if flt.node else {me, *(cluster.nodes() if cluster else {})})
        params = flt.pairs()
        if since is not None:
            params.append(("since", str(since)))
        view = self.agent.flows_view()
        # The last N of the cluster: each node's last N, merged by time.
        records: list[dict[str, Any]] = []
        for name, answer in (await self._gather_last(names, params, last)).items():
            if isinstance(answer, str):
                await resp.write(_line({"node": name, "error": answer}))
            else:
                records += answer
        records.sort(key=lambda r: r.get("time", 0))
        for record in records[len(records) - last:] if last else []:
            await resp.write(_line(record))
        if not follow:
            return
        queue: asyncio.Queue[bytes] = asyncio.Queue(10_000)
        tasks = []
        for name in names:
            if name == me:
                if view is not None:
                    tasks.append(asyncio.create_task(_pump_local(view, flt, queue)))
            elif cluster is not None:
                path = "/flows?" + urlencode([*params, ("last", "0"), ("follow", "1")])
                tasks.append(asyncio.create_task(_pump_remote(cluster, name, path, queue)))
        try:
            while True:
                try:
                    line = await asyncio.wait_for(queue.get(), KEEPALIVE)
                except asyncio.TimeoutError:
                    line = b"\n"
                await resp.write(line)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _gather_last(self, names: list[str], params: list[tuple[str, str]], last: int) -> dict[str, Any]:
        """Each node's last ``last`` matching records (list of dicts), or the reason it has none (str)."""
        cluster = self.agent.cluster_view()
        me = self.agent.node_name()
        view = self.agent.flows_view()
        flt = FlowFilter.parse(p for p in params if p[0] != "since")
        since = next((float(v) for k, v in params if k == "since"), None)

        async def one(name: str) -> tuple[str, Any]:
            if name == me:
                if view is None:
                    return name, "flow records are off on this node"
                return name, [f.json() for f in view.last(flt, last, since)]
            if cluster is None:
                return name, "no cluster view here"
            path = "/flows?" + urlencode([*params, ("last", str(last))])
            out = []
            try:
                async for line in cluster.lines(name, path):
                    record = json.loads(line)
                    if "error" in record:
                        return name, str(record["error"])
                    out.append(record)
            except (OSError, ValueError, KeyError) as err:
                return name, str(err) if not isinstance(err, KeyError) else f"no node {name} in etcd"
            return name, out

        return dict(await asyncio.gather(*(one(n) for n in names)))

    # ------------------------------------------------------------------ the cluster

    async def cluster(self, request: web.Request) -> web.Response:
        """Every node: its record in etcd and its own ``/status`` (peers included), or why not."""
        cluster = self.agent.cluster_view()
        me = self.agent.node_name()
        if cluster is None:
            return web.json_response({"node": me, "nodes": {me: {"status": self.agent.status()}}},
                                     dumps=_dumps)
        statuses = await cluster.gather("/status", self.agent.status)
        addresses = cluster.nodes()
        nodes = {name: {"address": addresses.get(name), **({"error": s["error"]} if "error" in s else {"status": s})}
                 for name, s in statuses.items()}
        return web.json_response({"node": me, "nodes": nodes}, dumps=_dumps)

    async def node(self, request: web.Request) -> web.Response:
        """One node's GET endpoint, answered here for this node and relayed for another."""
        name, what = request.match_info["node"], request.match_info["what"]
        if what not in RELAYED or what == "flows":
            return web.json_response({"error": f"{what} is not relayed (relayed: {', '.join(RELAYED)}; flows: "
                                      "GET /flows?node=NAME)"}, status=404)
        a = self.agent
        if name == a.node_name():
            pod, summary = request.query.get("pod"), request.query.get("view") == "summary"
            local = {"status": a.status, "peers": a.peers, "routes": a.routes,
                     "policy": lambda: a.policy_view(pod, summary), "services": lambda: a.services_view(summary)}
            if what not in local:
                raise web.HTTPFound(f"/{what}?{request.query_string}" if request.query_string else f"/{what}")
            data = local[what]()
            if data is None:
                return web.json_response({"error": f"{what} is not running here"}, status=503)
            return web.json_response(data, dumps=_dumps)
        cluster = a.cluster_view()
        if cluster is None:
            return web.json_response({"error": "no cluster view here"}, status=503)
        path = f"/{what}" + (f"?{request.query_string}" if request.query_string else "")
        try:
            return web.json_response(await cluster.get_json(name, path), dumps=_dumps)
        except KeyError:
            return web.json_response({"error": f"no node {name} in etcd"}, status=404)
        except (OSError, ValueError) as err:
            return web.json_response({"error": str(err)}, status=502)

    # ------------------------------------------------------------------ /ui/

    async def ui_root(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/ui/")

    async def ui_file(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info.get("name") or "index.html"
        path = UI_DIR / name
        if "/" in name or name.startswith(".") or path.suffix not in UI_TYPES or not path.is_file():
            return web.json_response({"error": f"no {name} in the browser view"}, status=404)
        return web.FileResponse(path, headers={**UI_HEADERS, "Content-Type": UI_TYPES[path.suffix]})


async def _local_flows(resp: web.StreamResponse, view: FlowViews, flt: FlowFilter, last: int,
                       since: float | None, follow: bool) -> None:
    # Following starts with the same ring the last N are read from (no await in between): no
    # record falls between them, and none is written twice.
    follower = view.follow(flt) if follow else None
    try:
        for flow in view.last(flt, last, since) if last else []:
            await resp.write(_line(flow.json()))
        if follower is None:
            return
        lost = 0
        while True:
            try:
                flow = await asyncio.wait_for(follower.queue.get(), KEEPALIVE)
            except asyncio.TimeoutError:
                await resp.write(b"\n")
                continue
            if follower.lost != lost:
                await resp.write(_line({"lost": follower.lost - lost}))
                lost = follower.lost
            await resp.write(_line(flow.json()))
    finally:
        if follower is not None:
            view.unfollow(follower)


async def _pump_local(view: FlowViews, flt: FlowFilter, queue: asyncio.Queue[bytes]) -> None:
    follower = view.follow(flt)
    try:
        while True:
            flow = await follower.queue.get()
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(_line(flow.json()))
    finally:
        view.unfollow(follower)


async def _pump_remote(cluster: ClusterView, node: str, path: str, queue: asyncio.Queue[bytes]) -> None:
    """One node's followed stream into ``queue``; reconnects after a pause when it breaks."""
    while True:
        try:
            async for line in cluster.lines(node, path):
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait(line if line.endswith(b"\n") else line + b"\n")
        except (OSError, KeyError) as err:
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(_line({"node": node, "error": str(err)}))
        await asyncio.sleep(2.0)


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()


def _dumps(data: Any) -> str:
    return json.dumps(data, default=str)
