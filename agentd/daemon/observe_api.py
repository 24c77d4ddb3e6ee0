"""The observability endpoints of the API: ``GET /flows`` (NDJSON, streamed), the cluster view
(``GET /cluster``, ``GET /nodes/{node}/{what}``) and the browser view (``/ui/``).

Everything here reads: the same views as the other endpoints (the UI calls these and nothing
else), gathered from other nodes through :class:`agentd.daemon.cluster.ClusterView`.  What
is gathered needs a credential (the API token or the browser view's key:
agentd/daemon/auth.py); what this node alone knows does not.  On the read-only cluster
listener only ``/flows`` is served, and only this node's records: nothing is relayed there.

``GET /flows`` takes the filters of :class:`agentd.flows.model.FlowFilter` as query parameters
(``pod``, ``from-pod``, ``to-pod``, ``namespace``, ``label``, ``verdict``, ``protocol``,
``port``, ``node``, ``ip``, ``event``, ``reason``, ``service``; repeat one for "any of"), and
``last=N`` (default 100: the last N matching records, oldest first), ``since=UNIX-TIME``,
``after=CURSOR`` (only the records this node made after the one it numbered so: a followed
answer's ``X-Agentd-Ring`` header, ``ID:SEQ``, where its follow began, with a record's ``seq``
for SEQ; all it holds when ID is not its ring's, as after a restart), ``follow=1`` (then every new matching record as it comes, until the client goes), and
``cluster=1`` (every node's records, gathered, followed ones too of a node that joins meanwhile;
a ``node`` filter alone also asks those nodes, each for its own records); ``follow`` and
``cluster`` take 1/true/yes or 0/false/no (or empty), nothing else.  One JSON record per
line (gathered: JSON objects only -- a node's line that is none is left out, its error said); a
node that cannot be asked is a line ``{"node": ..., "error": ...}``, records a slow
reader missed a line ``{"lost": N}`` -- gathered, one node's records lost (its answer said so, or
this node's own follower fell behind) name it: ``{"lost": N, "why": ..., "node": ...}``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import json
import logging
import math
import time
import traceback
from pathlib import Path
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol
from urllib.parse import urlencode

from aiohttp import web

from agentd.daemon import auth
from agentd.daemon.cluster import (
    GATHER_TOTAL,
    KEEPALIVE,
    LAST_END,
    RELAYED,
    RING,
    TIMEOUT,
    ClusterView,
    NodeAnswered,
    UnmarkedStream,
)
from agentd.digits import whole_number
from agentd.flows.model import FilterError, FlowFilter
from agentd.flows.ring import MAX_FOLLOWERS, Follower, LastSearch, TooManyFollowers
from agentd.flows.views import FlowViews

log = logging.getLogger("agentd.api")

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
NDJSON = "application/x-ndjson"
CONTROL = ("last", "since", "after", "follow", "cluster")
MAX_LAST = 100_000
# Bytes of records a cluster's last N holds while gathered: the nodes' last N waiting to be
# merged together, and the merged newest as much again (a record is up to LINE_MAX).
LAST_BYTES = 64 << 20
# The browser view loads nothing from elsewhere: the page says so to the browser too.
UI_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
UI_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml",
            ".png": "image/png", ".ico": "image/x-icon"}


# Of a node's MAX_FOLLOWERS places for readers with a credential, the most other nodes'
# gatherers hold (the rest stay for this node's root: `agentd flows -f`, its cluster streams),
# and the most one of them holds (whoever reads its cluster view opens one here per stream).
REMOTE_FOLLOWERS = MAX_FOLLOWERS * 3 // 4
REMOTE_PER_NODE = MAX_FOLLOWERS // 4


def _full(view: FlowViews | None, pool: str) -> bool:
    return view is not None and view.followers(pool) >= MAX_FOLLOWERS


class ObservedAgent(Protocol):
    """What these endpoints read (``agentd.daemon.views.AgentViews``)."""

    def flows_view(self) -> FlowViews | None: ...

    def cluster_view(self) -> ClusterView | None: ...

    def node_name(self) -> str: ...

    def status(self) -> dict[str, Any]: ...

    def peers(self) -> list[dict[str, Any]]: ...

    def routes(self) -> list[dict[str, Any]]: ...

    def policy_view(self, pod: str | None = None, summary: bool = False,
                    allow_lists: bool = True) -> dict[str, Any] | None: ...

    def services_view(self, summary: bool = False) -> dict[str, Any] | None: ...


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_routes(app: web.Application, agent: ObservedAgent, *, read_only: bool,
               token_of: Callable[[], str | None] = lambda: None, own: dict[str, Handler] | None = None) -> None:
    """``/flows`` on both listeners (on the read-only one: this node's records only); the
    cluster gathering and ``/ui/`` only on loopback's, where what is gathered from other
    nodes needs the API token ``token_of()`` gives, or its browser key (agentd/daemon/auth.py).
    ``own``: the API's handlers of what ``/nodes/<this node>/WHAT`` answers as ``/WHAT`` does
    (rib, metrics, healthz, readyz)."""
    handlers = _Handlers(agent, read_only=read_only, token_of=token_of, own=own)
    app.router.add_get("/flows", handlers.flows)
    if read_only:
        return
    app.router.add_get("/cluster", handlers.cluster)
    app.router.add_get("/nodes/{node}/{what}", handlers.node)
    app.router.add_get("/ui", handlers.ui_root)
    app.router.add_get("/ui/", handlers.ui_file)
    app.router.add_get("/ui/{name}", handlers.ui_file)


class _Handlers:
    def __init__(self, agent: ObservedAgent, *, read_only: bool, token_of: Callable[[], str | None],
                 own: dict[str, Handler] | None = None) -> None:
        self.agent = agent
        self.own = own or {}
        self.read_only = read_only  # the cluster listener: never relays
        self.token_of = token_of
        self.remote: dict[str, int] = {}  # another node's address -> its followed streams here (read_only)
        self.cluster_follows = 0  # followed cluster=1 streams (loopback): each follows every node

    def _may_gather(self, request: web.Request) -> bool:
        return auth.may_read_cluster(request.headers.get("Authorization", ""), self.token_of())

    def _remote_busy(self, source: str) -> str | None:
        """Why another node's gatherer (at address ``source``) may not follow now, or None."""
        held = self.remote.get(source, 0)
        if held >= REMOTE_PER_NODE:
            return f"{held} streams of {source} already follow this node's flow records (at most {REMOTE_PER_NODE} each)"
        everyone = sum(self.remote.values())
        if everyone >= REMOTE_FOLLOWERS:
            return f"{everyone} streams of other nodes already follow this node's flow records (at most {REMOTE_FOLLOWERS})"
        return None

    # ------------------------------------------------------------------ /flows

    async def flows(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        try:
            flt = FlowFilter.parse((k, v) for k, v in q.items() if k not in CONTROL)
            last = _last(q.get("last", "100"))
            since = _since(q["since"]) if "since" in q else None
            after = _after(q["after"]) if "after" in q else None
            follow, everyone = _switch(q, "follow"), _switch(q, "cluster")
        except FilterError as err:
            return web.json_response({"error": str(err)}, status=400)
        me = self.agent.node_name()
        # Another node's listener asks each node for its own records: a node filter there
        # selects among them (no record of another node), it never sends the question on.
        cluster = not self.read_only and (everyone or bool(flt.node and set(flt.node) != {me}))
        if cluster and not self._may_gather(request):
            return auth.refuse_cluster_read()
        if cluster and after is not None:
            return web.json_response({"error": "after: a cursor of one node's records, not of a cluster's"}, status=400)
        view = self.agent.flows_view()
        if view is None and not cluster:
            return web.json_response({"error": "flow records are off on this node ([flows] enabled = false)"}, status=404)
        # Other nodes' gatherers (the read token) and readers with the API token or browser key
        # have places of their own: local readers without one cannot take them all.  The
        # gatherers hold at most REMOTE_FOLLOWERS of those (each node REMOTE_PER_NODE): whoever
        # reads one node's cluster view cannot take this node's root's places; a reader here
        # with a credential takes an open place when the trusted ones are all taken.
        pool = "trusted" if self.read_only or (self._may_gather(request) and not _full(view, "trusted")) else "open"
        source = str(request.remote or "")
        busy = None
        if follow and self.read_only:
            busy = self._remote_busy(source)
        if follow and cluster and self.cluster_follows >= MAX_FOLLOWERS:
            busy = f"{self.cluster_follows} streams already follow the cluster from this node (at most {MAX_FOLLOWERS})"
        if follow and busy is None and _full(view, pool):
            assert view is not None
            busy = f"{view.followers(pool)} streams already follow this node's flow records (at most {MAX_FOLLOWERS})"
        if busy is not None:
            return web.json_response({"error": f"{busy}; try again later"}, status=503)
        follower: Follower | None = None
        search: LastSearch | None = None
        cursor = ""
        if not cluster:
            assert view is not None
            # Following starts with the same ring the last N are searched in, before anything
            # is awaited (the answer's headers included): no record falls between them, none
            # comes twice, and none made once the request came is missed.
            try:
                follower = view.follow(flt, pool) if follow else None
            except TooManyFollowers as err:  # more came since the handler looked
                return web.json_response({"error": str(err)}, status=503)
            try:
                cursor = view.cursor()  # the last record before the follow: a reader broken off resumes after what it had
                search = view.search(flt, last, since, after)
            except BaseException:  # not followed after all: the place is free again
                if follower is not None:
                    view.unfollow(follower)
                raise
        headers = {"Content-Type": NDJSON, "Cache-Control": "no-cache"}
        if follower is not None:
            headers[LAST_END] = "empty-line"  # a gathering node splits the last N from what follows there
            headers[RING] = cursor
        resp = web.StreamResponse(headers=headers)
        remote = follower is not None and self.read_only
        if remote:
            self.remote[source] = self.remote.get(source, 0) + 1
        self.cluster_follows += cluster and follow
        try:
            await resp.prepare(request)
            if cluster:
                await self._cluster_flows(resp, flt, last, since, follow)
            else:
                assert view is not None and search is not None
                await _local_flows(resp, view, search, follower)
        except ConnectionResetError:  # the reader went during a write (else: cancelled then, api.HANDLER_CANCELLATION)
            return resp
        finally:
            self.cluster_follows -= cluster and follow
            if remote:
                n = self.remote.pop(source) - 1
                if n:
                    self.remote[source] = n
            if follower is not None:
                view.unfollow(follower)  # type: ignore[union-attr]  # view is there when follower is
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    async def _cluster_flows(self, resp: web.StreamResponse, flt: FlowFilter, last: int, since: float | None,
                             follow: bool) -> None:
        cluster = self.agent.cluster_view()
        me = self.agent.node_name()
        names = sorted(set(flt.node) if flt.node else {me, *(cluster.nodes() if cluster else {})})
        view = self.agent.flows_view()
        merge = _Merge()
        # This node's follower starts before its last N are looked up: a record made meanwhile
        # may come twice (in the last N and followed), but none falls between the two.  Another
        # node is asked once for both (last=N&follow=1): it takes its last N and starts following
        # at once, so none falls between them there either; its last N (up to the empty line
        # that ends them) go to the gathering, what follows to the merged stream.
        tasks: dict[str, asyncio.Task] = {}
        followed: set[str] = set()
        firsts: dict[str, _Snapshot] = {}
        held = _Held()  # what the nodes' last N hold together until merged

        def follow_nodes(new: list[str], joined_since: float | None = None) -> None:
            for name in new:
                followed.add(name)
                if name == me:
                    if view is not None:
                        tasks[name] = asyncio.create_task(_pump_local(view, flt, merge, me))
                elif cluster is not None:
                    again = "/flows?" + urlencode([*_node_params(flt, name, None), ("last", "0"), ("follow", "1")])

                    def resume(cursor: str, name: str = name) -> str:  # what it made since the last record it sent
                        return "/flows?" + urlencode([*_node_params(flt, name, None), ("after", cursor),
                                                      ("last", str(MAX_LAST)), ("follow", "1")])

                    path, first = again, None
                    if joined_since is not None:  # a node that joined: what it recorded since it could have been seen
                        path = "/flows?" + urlencode([*_node_params(flt, name, joined_since), ("last", str(MAX_LAST)),
                                                      ("follow", "1")])
                    elif last:
                        first = firsts[name] = _Snapshot(last, held)
                        path = "/flows?" + urlencode([*_node_params(flt, name, since), ("last", str(last)), ("follow", "1")])
                    # The whole cluster followed: a node that leaves it is let go (and followed
                    # again if it comes back); one the reader named is asked for until it is back.
                    tasks[name] = asyncio.create_task(_pump_remote(cluster, name, path, merge, leaves=not flt.node,
                                                                   first=first, again=again, resume=resume))

        def let_go_of_departed() -> None:
            for name, t in list(tasks.items()):
                if t.done() and not t.cancelled() and t.exception() is None and t.result():
                    del tasks[name]
                    followed.discard(name)

        if follow:
            follow_nodes(names)
        try:
            if last:
                records, errors = await self._gather_last(names, flt, last, since, firsts)
                firsts.clear()  # gathered (each node's lines let go there): nothing held for the stream's life
                for name, error in sorted(errors.items()):
                    await resp.write(_line({"node": name, "error": error}))
                for line in records:
                    await resp.write(line)
            if not follow:
                return
            told = 0
            loop = asyncio.get_running_loop()
            looked, looked_at = loop.time(), time.time()
            watch = not flt.node and cluster is not None
            while True:
                # A node that joined since is followed from then on: the registry looked at once
                # per keep-alive interval, however busy or quiet the stream, and the node asked
                # for what it recorded since the look before (its records in between not lost).
                wait = max(0.0, looked + KEEPALIVE - loop.time()) if watch else KEEPALIVE
                try:
                    async with asyncio.timeout(wait):  # not wait_for: the stream's cancel must end it
                        line = await merge.queue.get()
                except TimeoutError:
                    line = b"\n"
                if watch and loop.time() - looked >= KEEPALIVE:
                    assert cluster is not None
                    before = looked_at
                    looked, looked_at = loop.time(), time.time()
                    let_go_of_departed()
                    follow_nodes(sorted(set(cluster.nodes()) - followed), joined_since=before)
                if merge.lost != told:  # what the merged stream could not hold, said before the next line
                    await resp.write(_line({"lost": merge.lost - told}))
                    told = merge.lost
                await resp.write(line)
        finally:
            for t in tasks.values():
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def _gather_last(self, names: list[str], flt: FlowFilter, last: int, since: float | None,
                           firsts: dict[str, _Snapshot] | None = None) -> tuple[list[bytes], dict[str, str]]:
        """The cluster's last ``last`` matching records (each node's last ``last``, merged by
        time: at most ``last`` are held, however many nodes answer, and at most LAST_BYTES of
        them: ``{"lost": N, ...}`` lines first say what that left out), and why a node has none.
        ``firsts``: the nodes whose last N come at the start of their followed streams."""
        cluster = self.agent.cluster_view()
        me = self.agent.node_name()
        view = self.agent.flows_view()
        newest = _Newest(last)
        errors: dict[str, str] = {}
        lost: list[bytes] = []  # {"lost": N, ...} lines: what a byte budget left out, said before the records

        async def one(name: str) -> None:
            if name == me:
                if view is None:
                    errors[name] = "flow records are off on this node"
                    return
                for flow in await view.last(flt, last, since):
                    newest.add(flow.time, _line(flow.json()))
                return
            if cluster is None:
                errors[name] = "no cluster view here"
                return
            first = (firsts or {}).get(name)
            if first is not None:
                await first.wait(name)
                if first.unmarked:  # an older agentd: its last N asked apart, as it answers them
                    first = None
            if first is not None:
                if first.dropped:
                    lost.append(_line({"lost": first.dropped, "node": name, "why": _over_budget("its oldest")}))
                if first.error is not None:
                    errors[name] = first.error
                    first.take()  # what came before it stalled: not held for the stream's life
                    return
                answer: Any = _aiter(first.take())
            else:
                path = "/flows?" + urlencode([*_node_params(flt, name, since), ("last", str(last))])
                answer = cluster.lines(name, path)
            try:
                async for line in answer:
                    record = _json(line, name)
                    if not isinstance(record, dict):
                        errors[name] = f"{name} answered a line that is not a JSON object"
                        return
                    if "error" in record:
                        errors[name] = str(record["error"])
                        return
                    line = line if line.endswith(b"\n") else line + b"\n"
                    if "time" in record:
                        if record.get("node") != name:  # a node answers for itself alone: left out, said once
                            errors.setdefault(name, _not_its_own(name, record.get("node")))
                            continue
                        try:
                            when = float(record["time"])
                        except OverflowError:  # an integer of 400 digits (json.loads reads it exactly)
                            when = math.inf
                        if not math.isfinite(when):  # json.loads takes NaN, Infinity: no order with the rest
                            errors.setdefault(name, f"{name} answered a record whose time is not a time")
                            continue
                        newest.add(when, line)
                    elif "lost" in record:  # a record too long to read (cluster._skipped): said, with whose
                        lost.append(_lost_at(name, line)[0])
            except (OSError, ValueError, TypeError) as err:
                errors[name] = str(err)
            except KeyError:
                errors[name] = f"no node {name} in etcd"

        await asyncio.gather(*(one(n) for n in names))
        if newest.dropped:
            lost.append(_line({"lost": newest.dropped, "why": _over_budget("the oldest of the cluster's")}))
        return lost + newest.oldest_first(), errors

    # ------------------------------------------------------------------ the cluster

    async def cluster(self, request: web.Request) -> web.Response:
        """Every node: its record in etcd and its own ``/status`` (peers included), or why not."""
        if not self._may_gather(request):
            return auth.refuse_cluster_read()
        cluster = self.agent.cluster_view()
        me = self.agent.node_name()
        if cluster is None:
            return web.json_response({"node": me, "nodes": {me: {"status": self.agent.status()}}},
                                     dumps=_dumps)
        statuses = await cluster.gather("/status", self.agent.status)
        for name, s in statuses.items():
            said = (s.get("node") or {}).get("name") if isinstance(s.get("node"), dict) else None
            if "error" not in s and said != name:  # shown as that node's: it must be that node's
                statuses[name] = {"error": f"{name}'s address answered as node {said!r}"}
        addresses = cluster.nodes()
        nodes = {name: {"address": addresses.get(name), **({"error": str(s["error"])} if "error" in s else {"status": s})}
                 for name, s in statuses.items()}
        return web.json_response({"node": me, "nodes": nodes}, dumps=_dumps)

    async def node(self, request: web.Request) -> web.StreamResponse:
        """One node's GET endpoint, answered here for this node and relayed for another."""
        name, what = request.match_info["node"], request.match_info["what"]
        if what not in RELAYED or what == "flows":
            relayed = ", ".join(r for r in RELAYED if r != "flows")
            return web.json_response({"error": f"{what} is not relayed (relayed: {relayed}; flows: "
                                      "GET /flows?node=NAME)"}, status=404)
        a = self.agent
        if name == a.node_name():
            pod, view = request.query.get("pod"), request.query.get("view")
            summary = view == "summary"
            local = {"status": a.status, "peers": a.peers, "routes": a.routes,
                     "policy": lambda: a.policy_view(pod, summary, allow_lists=view != "pods"),
                     "services": lambda: a.services_view(summary)}
            if what not in local:  # answered here as /WHAT answers, query and status alike
                own = self.own.get(what)
                if own is None:
                    return web.json_response({"error": f"{what} is not served by this process"}, status=404)
                return await own(request)
            data = local[what]()
            if data is None:
                return web.json_response({"error": f"{what} is not running here"}, status=503)
            return web.json_response(data, dumps=_dumps)
        if not self._may_gather(request):
            return auth.refuse_cluster_read()
        cluster = a.cluster_view()
        if cluster is None:
            return web.json_response({"error": "no cluster view here"}, status=503)
        # The query as the reader wrote it (query_string has %23 decoded to "#", %25 to "%")
        raw = request.rel_url.raw_query_string
        path = f"/{what}" + (f"?{raw}" if raw else "")
        try:
            status, content_type, body = await cluster.get(name, path)
        except KeyError:
            return web.json_response({"error": f"no node {name} in etcd"}, status=404)
        except OSError as err:
            return web.json_response({"error": str(err)}, status=502)
        # The node's own answer as it gave it: Prometheus text for metrics, a 503 of /readyz.
        return web.Response(body=body, status=status, headers={"Content-Type": content_type})

    # ------------------------------------------------------------------ /ui/

    async def ui_root(self, request: web.Request) -> web.StreamResponse:
        # The query kept: /ui?key=K typed without the slash still carries the browser key.
        raw = request.rel_url.raw_query_string
        raise web.HTTPFound("/ui/" + (f"?{raw}" if raw else ""))

    async def ui_file(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info.get("name") or "index.html"
        path = UI_DIR / name
        if "/" in name or name.startswith(".") or path.suffix not in UI_TYPES or not path.is_file():
            return web.json_response({"error": f"no {name} in the browser view"}, status=404)
        return web.FileResponse(path, headers={**UI_HEADERS, "Content-Type": UI_TYPES[path.suffix]})


async def _local_flows(resp: web.StreamResponse, view: FlowViews, search: LastSearch, follower: Follower | None) -> None:
    """The last N records ``search`` finds, then (``follower``) each new one.  A followed
    stream's last N end with an empty line (a keep-alive to any reader): what came before it
    is the last N, what comes after was followed (a gathering agent tells them apart so).  A
    search after a cursor the ring has wrapped past starts with a ``{"lost": N, "why": ...}``
    line: N records made after the cursor that this node no longer holds.  One after a cursor
    more than N matching records behind (the last N asked, at most ``MAX_LAST``) says so the
    same way before its records: N those left out, the oldest after the cursor."""
    if search.scrolled:
        await resp.write(_line({"lost": search.scrolled, "why": "made after the reader's last record, since "
                                "scrolled out of the node's ring"}))
    found = await view.finish(search)
    if search.left_out:
        await resp.write(_line({"lost": search.left_out, "why": _left_out_why(search.n)}))
    for flow in found:
        await resp.write(_line(flow.json()))
    if follower is None:
        return
    await resp.write(b"\n")
    lost = 0
    while True:
        try:
            async with asyncio.timeout(KEEPALIVE):  # not wait_for: the stream's cancel must end it
                flow = await follower.queue.get()
        except TimeoutError:
            await resp.write(b"\n")
            continue
        if follower.lost != lost:
            await resp.write(_line({"lost": follower.lost - lost}))
            lost = follower.lost
        await resp.write(_line(flow.json()))


def _over_budget(which: str) -> str:
    size = f"{LAST_BYTES >> 20} MiB" if LAST_BYTES % (1 << 20) == 0 else f"{LAST_BYTES} bytes"
    return f"{which} last records, over the {size} a gathering holds of them"


def _left_out_why(n: int) -> str:
    asked = "" if n == MAX_LAST else f" (this one asked for the last {n})"
    return f"made after the reader's last record, left out: a resume returns at most the last {MAX_LAST}{asked}"


def _last(value: str) -> int:
    try:
        last = int(value)
    except ValueError:
        raise FilterError(f"last: {value!r} is not a whole number") from None
    if not 0 <= last <= MAX_LAST:
        raise FilterError(f"last: {last} is out of range 0..{MAX_LAST}")
    return last


SWITCH_ON, SWITCH_OFF = ("1", "true", "yes"), ("", "0", "false", "no")


def _switch(query: Any, name: str) -> bool:
    """``follow=`` / ``cluster=``: on (1, true, yes) or off (0, false, no, empty, absent); a
    FilterError for any other value (``follow=on`` was silently no follow)."""
    value = query.get(name, "")
    if value in SWITCH_ON or value in SWITCH_OFF:
        return value in SWITCH_ON
    shown = value if len(value) <= 20 else value[:20] + "..."
    raise FilterError(f"{name}: {shown!r} is neither 1, true, yes (on) nor 0, false, no (off)")


def _since(value: str) -> float:
    try:
        since = float(value)
    except ValueError:
        since = math.nan
    if not math.isfinite(since):  # nan or inf: no record, and no word of why
        raise FilterError(f"since: {value!r} is not a UNIX time")
    return since


def _after(value: str) -> str:
    ring, colon, seq = value.partition(":")
    if not (ring and colon and whole_number(seq, 20) is not None):  # no more than a 64-bit number has
        raise FilterError(f"after: {value!r} is not a cursor (ID:SEQ, as a followed answer's {RING} header)")
    return value


def _node_params(flt: FlowFilter, node: str, since: float | None) -> list[tuple[str, str]]:
    """The query that asks ``node`` for its own matching records: the filter with ``node``
    naming that node alone (however many the reader named), so no node relays the question."""
    params = [(k, v) for k, v in flt.pairs() if k != "node"] + [("node", node)]
    return params + ([("since", repr(since))] if since is not None else [])


class _Newest:
    """The ``n`` newest of the lines added (by time), in a heap: a cluster's last N cost the
    memory of N records, not of N per node -- and at most ``max_bytes`` bytes of them (records
    of large label sets are up to LINE_MAX each): past that the oldest held go, counted in
    ``dropped``, and so does any line added later that is not newer than the newest of them
    (``floor``): nothing older than a dropped line is kept, the lines held run unbroken."""

    def __init__(self, n: int, max_bytes: int | None = None) -> None:
        self.n = n
        self.max_bytes = LAST_BYTES if max_bytes is None else max_bytes
        self.heap: list[tuple[float, int, bytes]] = []
        self.count = 0
        self.bytes = 0
        self.dropped = 0
        self.floor: tuple[float, int] | None = None  # (when, count) of the newest dropped for bytes

    def add(self, when: float, line: bytes) -> None:
        self.count += 1
        item = (when, self.count, line)
        if self.floor is not None and item[:2] <= self.floor:
            self.dropped += 1
            return
        if len(self.heap) < self.n:
            heapq.heappush(self.heap, item)
            self.bytes += len(line)
        elif self.n and item > self.heap[0]:
            self.bytes += len(line) - len(heapq.heapreplace(self.heap, item)[2])
        while self.bytes > self.max_bytes and self.heap:
            gone = heapq.heappop(self.heap)  # the oldest held: newer than the floor
            self.bytes -= len(gone[2])
            self.floor = gone[:2]
            self.dropped += 1

    def oldest_first(self) -> list[bytes]:
        return [line for _, _, line in sorted(self.heap)]


class _Held:
    """The bytes the nodes' last N of one gathering hold together while they wait to be merged."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = LAST_BYTES if limit is None else limit
        self.used = 0


class _Snapshot:
    """One node's last N, the start of its followed stream (up to the empty line that ends
    them), handed to the gathering (:meth:`take`: held no longer); ``error``: why they did not
    all come.  More than the ``limit`` asked for are not kept, nor more bytes than ``held``
    allows the gathering's snapshots together: past that this node's oldest go (they come
    oldest first), counted in ``dropped``."""

    def __init__(self, limit: int, held: _Held | None = None) -> None:
        self.limit = limit
        self.held = held if held is not None else _Held()
        self.lines: collections.deque[bytes] = collections.deque()
        self.taken = 0  # lines added, kept or not (the first ``limit`` are kept)
        self.dropped = 0
        self.error: str | None = None
        self.done = asyncio.Event()
        self.moved = asyncio.Event()  # a line came, or the end
        self.unmarked = False  # the node is an older agentd: its last N are to be asked apart

    def add(self, line: bytes) -> None:
        if self.taken < self.limit:
            self.taken += 1
            self.lines.append(line)
            self.held.used += len(line)
            while self.held.used > self.held.limit and self.lines:
                self.held.used -= len(self.lines.popleft())
                self.dropped += 1
        self.moved.set()

    def take(self) -> list[bytes]:
        """The lines, handed over: not held here any more."""
        lines, self.lines = list(self.lines), collections.deque()
        self.held.used -= sum(len(line) for line in lines)
        return lines

    def end(self, error: str | None = None) -> None:
        """Handed over (what came after goes to the merged stream)."""
        if not self.done.is_set():
            self.error = error
            self.done.set()
            self.moved.set()

    async def wait(self, node: str) -> None:
        """Until they came, as long as a gathered answer is waited for: ``TIMEOUT`` between
        two lines, ``GATHER_TOTAL`` in all (then said unreachable, and what comes after is
        followed)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GATHER_TOTAL
        while not self.done.is_set():
            self.moved.clear()
            try:
                async with asyncio.timeout(min(TIMEOUT, max(0.0, deadline - loop.time()))):
                    await self.moved.wait()
            except TimeoutError:
                took = f"nothing for {TIMEOUT:g}s" if loop.time() < deadline else f"more than {GATHER_TOTAL:g}s"
                self.end(f"{node} unreachable: {took}")


async def _aiter(lines: list[bytes]) -> AsyncIterator[bytes]:
    for line in lines:
        yield line


MERGE_LINES = 10_000  # lines a followed cluster stream holds for its reader
MERGE_BYTES = 32 << 20  # and bytes: a node's records of large label sets are up to LINE_MAX each


class _Lines(asyncio.Queue):
    """An asyncio queue of lines that counts the bytes it holds (however they are taken out)."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.bytes = 0

    def _put(self, item: bytes) -> None:
        super()._put(item)  # type: ignore[misc]
        self.bytes += len(item)

    def _get(self) -> bytes:
        item = super()._get()  # type: ignore[misc]
        self.bytes -= len(item)
        return item


class _Merge:
    """The followed streams of several nodes as one, in a bounded queue (``limit`` lines,
    ``max_bytes`` bytes): what does not fit (a reader slower than the cluster) is counted, and
    the reader is told how much."""

    def __init__(self, limit: int = MERGE_LINES, max_bytes: int = MERGE_BYTES) -> None:
        self.queue: _Lines = _Lines(limit)
        self.max_bytes = max_bytes
        self.lost = 0

    def put(self, line: bytes, records: int = 1) -> None:
        """``line`` into the queue; ``records``: how many records it stands for, counted as
        lost if it does not fit (a line saying N were lost: those N)."""
        if self.queue.bytes + len(line) > self.max_bytes:
            self.lost += records
            return
        try:
            self.queue.put_nowait(line)
        except asyncio.QueueFull:
            self.lost += records


async def _pump_local(view: FlowViews, flt: FlowFilter, merge: _Merge, me: str) -> None:
    """This node's followed records into ``merge``.  A follow that fails of an error of this
    agent's own (a defect: nothing here expects one) is said in ``merge`` as this node's error
    and in one log line, and begun again after a pause, longer each time while it keeps failing
    (as another node's broken stream is asked again): it died silently, and the stream showed
    this node's records no more."""
    loop = asyncio.get_running_loop()
    delay, said = RETRY_FIRST, None
    while True:
        started = loop.time()
        try:
            await _follow_local(view, flt, merge, me)
            return  # no place for another follower: said
        except Exception as err:  # noqa: BLE001 - a defect of this agent's: said, and followed again
            message, failed = _failed(me, err), err
        if loop.time() - started > RETRY_MAX:  # it ran a good while: a new failure, not the same one
            delay, said = RETRY_FIRST, None
        if message != said:
            merge.put(_line({"node": me, "error": message}))
            _log_failed(message, failed)
            said = message
        await asyncio.sleep(delay)
        delay = min(RETRY_MAX, delay * 2)


async def _follow_local(view: FlowViews, flt: FlowFilter, merge: _Merge, me: str) -> None:
    try:  # the cluster's stream: its reader has a credential (an open place when the trusted ones are taken)
        try:
            follower = view.follow(flt, "trusted")
        except TooManyFollowers:
            follower = view.follow(flt, "open")
    except TooManyFollowers as err:
        merge.put(_line({"node": me, "error": str(err)}))
        return
    try:
        lost = 0
        while True:
            flow = await follower.queue.get()
            if follower.lost != lost:  # the follower's own queue overflowed: this node's records lost
                merge.put(_line({"lost": follower.lost - lost, "node": me}), follower.lost - lost)
                lost = follower.lost
            merge.put(_line(flow.json()))
    finally:
        view.unfollow(follower)


def _failed(node: str, err: Exception) -> str:
    """What a followed node's stream says when following it failed of an error of this agent's
    own (not one of the node's answer: those are said as they are)."""
    return f"following {node} failed on this node: {type(err).__name__}: {err} (followed again after a pause)"


def _log_failed(message: str, err: Exception) -> None:
    """One log line: the failure and where it was raised (a defect to be found)."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    log.error("flows of the cluster: %s%s", message, where)


RETRY_FIRST = 2.0  # seconds before a broken followed stream is asked again; doubled each time, up to
RETRY_MAX = 60.0
GIVE_UP = (400, 404)  # that node will not follow this (a filter it does not know, flow records off there)


async def _pump_remote(cluster: ClusterView, node: str, path: str, merge: _Merge, *, leaves: bool = False,
                       first: _Snapshot | None = None, again: str | None = None,
                       resume: Callable[[str], str] | None = None) -> bool:
    """One node's followed stream into ``merge``; asked again (``again``, else ``path``) after a
    pause when it breaks (longer each time while it stays broken), given up on when the node
    says it cannot.  ``leaves``: given up on as well when the node is no longer in the cluster
    (then True).  ``first``: where the last N the stream starts with go (up to an empty line);
    why they did not come is said there, not in ``merge``.  ``resume(cursor)``: the path that
    asks again for what the node made after the last record it sent (its answer's ``RING``
    header, then each record's ``seq``): what it made while the stream was broken is neither
    lost nor sent twice.  A node that sends no such header (an older agentd) is asked ``again``.
    Following that fails of an error of this agent's own (a defect, none of the node's answer)
    is said as the node's error, in one log line too, and the node asked again as after a break."""
    loop = asyncio.get_running_loop()
    delay, said = RETRY_FIRST, None
    ring, seq = "", 0  # where the records sent so far end: the answers' RING, their records' seq
    resumed = False  # the path asks after a cursor
    answering = ""  # the ring the current answer's records are numbered in (its RING header)
    seen: dict[str, str] = {}

    def take() -> None:
        """An answer's RING header (before its first line): where its follow began.  An answer
        that starts with what the reader asked as history (the last N, or nothing) moves the
        cursor there at once: what follows is what counts.  One asked after the cursor (a
        resume) starts with the gap itself, numbered up to the header: only its records move the
        cursor, so a resume broken off in the middle of the gap is resumed after what came."""
        nonlocal ring, seq, answering
        header = seen.pop(RING, None)
        if header is not None:
            there, _, number = header.partition(":")
            with contextlib.suppress(ValueError):
                began = int(number)
                answering = there
                if not resumed:
                    seq = max(seq, began) if there == ring else began
                    ring = there

    def passed(line: bytes) -> bytes:
        nonlocal seq, ring
        take()
        if answering and line.startswith(b'{"seq":'):  # Flow.json: the number first
            with contextlib.suppress(ValueError):
                number = int(line[7 : line.find(b",")])
                if answering != ring:  # the node's ring is another since (it restarted): numbered anew
                    ring, seq = answering, number
                else:
                    seq = max(seq, number)
        return line if line.endswith(b"\n") else line + b"\n"

    held: list[tuple[bytes, int]] = []  # the current answer's {"lost": N} lines (and N), before its next record
    foreign = False  # a record naming another node came (said once, each such record left out)
    garbled = False  # a line that is no JSON object came (said once per outage, each such line left out)

    def forward(line: bytes) -> None:
        """Into ``merge``, if it is a JSON object (else left out, and said once per outage:
        whatever answers on the node's address, its readers are given JSON lines only); a
        ``{"lost": N}`` line, named with the node (the merged stream is many nodes'), held
        until the answer's next record comes.  An answer broken before it is asked again after
        the same record: its new answer says anew what is lost after it (left out, scrolled
        out, not kept up with), so the held line goes, and no record lost is told twice."""
        nonlocal garbled
        try:
            record = _json(line, node)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if not garbled:
                garbled = True
                merge.put(_line({"node": node, "error": f"{node} answered a line that is not a JSON object: "
                                                        "left out (is that an agentd's cluster listener?)"}))
            return
        if line.startswith(b'{"lost":'):
            held.append(_lost_at(node, line))
            return
        if not own(line, record):
            return
        for lost, n in held:
            merge.put(lost, n)
        held.clear()
        merge.put(line)

    def own(line: bytes, record: Any = None) -> bool:
        """Whether a line is the node's own (a node answers for itself alone): a record naming
        another is left out, and said once.  ``record``: the line, read already."""
        nonlocal foreign
        if _names(line, node, record):
            return True
        if not foreign:
            foreign = True
            merge.put(_line({"node": node, "error": _not_its_own(node, _named(line))}))
        return False

    def say(message: str) -> None:
        if first is not None and not first.done.is_set():
            first.end(message)
        else:
            merge.put(_line({"node": node, "error": message}))

    while True:
        started = loop.time()
        failed: Exception | None = None
        try:
            if first is None:
                async for line in cluster.lines(node, path, follow=True, seen=seen):
                    forward(passed(line))
            else:
                async for line in cluster.lines(node, path, follow=True, blanks=True, seen=seen):
                    take()
                    if not line.strip():  # the end of the last N, or a keep-alive
                        first.end()
                    elif not first.done.is_set():
                        if own(line := passed(line)):
                            first.add(line)
                    else:
                        forward(passed(line))
            message = f"{node} ended the stream"
        except UnmarkedStream:
            # An older agentd, which does not mark the end of its last N: they are asked apart
            # (by the gathering), and this stream follows from now on only, asked at once.
            assert first is not None
            first.unmarked = True
            first.end()
            first, path = None, again or path
            continue
        except NodeAnswered as err:
            if resumed and err.status == 400:  # an older agentd now, which takes no cursor: asked as before
                ring, seq, resumed, path = "", 0, False, again or path
                continue
            if err.status in GIVE_UP:
                say(str(err))
                return False
            message = str(err)
        except OSError as err:
            message = str(err)
        except KeyError:
            message = f"no node {node} in etcd"
            if leaves:
                say(f"{message}: it left the cluster, no longer followed")
                return True
        except Exception as err:  # noqa: BLE001 - a defect of this agent's, not the node's answer: said, followed again
            # (the task died of it silently, and the stream showed this node's records no more)
            message, failed = _failed(node, err), err
        if loop.time() - started > RETRY_MAX:  # it ran a good while: a new outage, not the same one
            delay, said, garbled = RETRY_FIRST, None, False
        if message != said:  # said once per outage, not at every retry
            say(message)
            said = message
            if failed is not None:
                _log_failed(message, failed)
        if first is not None:
            first.end()  # asked again for what comes from now on only (or after the last record sent)
            first = None
        take()  # an answer that sent no line
        resumed = bool(ring and resume is not None)
        if not resumed:  # asked for what follows only: what the held lines say is not said again
            for lost, n in held:
                merge.put(lost, n)
        held.clear()
        path = resume(f"{ring}:{seq}") if resumed else again or path  # type: ignore[misc]
        await asyncio.sleep(delay)
        delay = min(RETRY_MAX, delay * 2)


def _json(line: bytes, node: str) -> Any:
    """A line of ``node``'s answer, read: ValueError if it is no JSON -- or JSON nested too deep
    to read (json.loads raises RecursionError then), one node's error, not the gathering's."""
    try:
        return json.loads(line)
    except RecursionError:
        raise ValueError(f"{node} answered JSON nested too deep to read") from None


def _named(line: bytes) -> Any:
    """The node a gathered record names (None: none, or not a record)."""
    try:
        record = _json(line, "")
    except ValueError:
        return None
    return record.get("node") if isinstance(record, dict) else None


def _names(line: bytes, node: str, record: Any = None) -> bool:
    """Whether a line of ``node``'s followed stream is its own: a record that names it (an
    answer's other lines -- its error, a keep-alive -- are not records).  ``record``: the
    line, read already (else it is read here)."""
    if not line.startswith(b'{"seq":'):  # Flow.json: the number first
        return True
    return (record.get("node") if isinstance(record, dict) else _named(line)) == node


def _not_its_own(asked: str, named: Any) -> str:
    return f"{asked} answered with records of node {named!r}, not its own: left out"


def _lost_at(node: str, line: bytes) -> tuple[bytes, int]:
    """A node's ``{"lost": N, ...}`` line as a gathered stream passes it on: with ``"node"``
    naming the node asked (its records were lost: a node speaks for itself alone), and N."""
    try:
        record = _json(line, node)
        n = max(1, int(record["lost"]))
    except (ValueError, TypeError, KeyError, OverflowError):  # not what an agentd sends (Infinity): passed on as it came
        return line, 1
    if not isinstance(record, dict) or record.get("node") == node:
        return line, n
    return _line({**record, "node": node}), n


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()


def _dumps(data: Any) -> str:
    return json.dumps(data, default=str)
