"""The REST API against what its callers and the underlay can do to it: connections that send
nothing, errors as JSON, this node's /nodes/ answers, the cluster view against odd or
redirecting nodes, followers without a credential, and the CLI against proxies and redirects.
Servers in process on 127.0.0.1 with ephemeral ports; no sleeps."""

from __future__ import annotations

import argparse
import asyncio
import http.server
import io
import ipaddress
import json
import threading
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from prometheus_client import CollectorRegistry

from agentd import cli
from agentd.daemon import api, auth, cluster, observe_api
from agentd.daemon.cluster import ClusterView, NodeAnswered
from agentd.flows.model import FlowFilter
from agentd.flows.ring import MAX_FOLLOWERS, FlowRing
from agentd.flows.views import FlowViews

TOKEN = "api-token"


class Provider:
    """What the API reads: a node ``node1`` with flow records, not ready, no BGP speaker."""

    def __init__(self, flows: FlowViews | None = None, cluster_view: ClusterView | None = None) -> None:
        self.registry = CollectorRegistry()
        self._flows = flows
        self._cluster = cluster_view

    def health(self):
        return True, []

    def readiness(self):
        return False, ["routes not reconciled yet"]

    def status(self):
        return {"node": {"name": "node1"}}

    def peers(self):
        return []

    def routes(self):
        return []

    def bgp_speaker(self):
        return None

    def flows_view(self):
        return self._flows

    def cluster_view(self):
        return self._cluster

    def node_name(self):
        return "node1"


async def _started(server: api.ApiServer) -> api.ApiServer:
    await server.start()
    return server


# ------------------------------------------------------------------ connections


def test_the_api_keeps_an_idle_connection_seconds_not_an_hour():
    server = api.ApiServer(Provider(), "127.0.0.1", 0, token=TOKEN)
    assert server.keepalive_timeout == api.KEEPALIVE_TIMEOUT == 15.0
    assert server.max_connections == api.MAX_CONNECTIONS == 1000
    # Another node's gatherer lets an idle connection go first: no GET on one being closed.
    assert cluster.IDLE_KEPT < api.KEEPALIVE_TIMEOUT


async def test_connections_that_send_nothing_are_closed_and_at_most_the_cap_are_open():
    server = api.ApiServer(Provider(), "127.0.0.1", 0, token=TOKEN)
    server.keepalive_timeout = 0.2  # seconds here, so that the test waits for no more
    server.max_connections = 3
    await _started(server)
    held = []
    try:
        for _ in range(3):
            held.append(await asyncio.open_connection("127.0.0.1", server.port))
        held[1][1].write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # half a head, never finished
        await held[1][1].drain()
        # One past the cap is answered 503 and closed as it comes.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert await asyncio.wait_for(reader.read(), 5) == api.BUSY_ANSWER and server.connections.refused == 1
        writer.close()
        # Nothing, or half a head: closed once the keep-alive time has passed, not an hour later.
        for reader, _ in held:
            assert await asyncio.wait_for(reader.read(), 5) == b""
        # The places are free again: a request is answered.
        for _ in range(100):
            if not server.connections.connections:
                break
            await asyncio.sleep(0)
        async with aiohttp.ClientSession() as session, session.get(server.url + "/healthz") as resp:
            assert resp.status == 200
        assert not server.connections.waiting  # what came in time is not held
    finally:
        for _, writer in held:
            writer.close()
        await server.stop()


def _head_timers(loop: asyncio.AbstractEventLoop, connections: api._Connections) -> list:
    """The loop's timers still due to close a connection whose first head has not come."""
    return [h for h in loop._scheduled if not h.cancelled() and h._callback == connections._head_due]  # type: ignore[attr-defined]


async def test_a_connection_lost_or_answered_lets_go_of_its_head_timer():
    """Each connection's timer (close it unless its first head comes) held its aiohttp handler
    for the whole KEEPALIVE_TIMEOUT after the connection was gone: aborted at once, a probe's
    5000 connections held 1.75 KB each for 15 s (memory growing with the rate of new ones)."""
    loop = asyncio.get_running_loop()
    server = await _started(api.ApiServer(Provider(), "127.0.0.1", 0, token=TOKEN))
    try:
        writers = []
        for n in range(1, 21):
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writers.append(writer)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 1000)  # half a head
            await writer.drain()
            for _ in range(100):
                if len(_head_timers(loop, server.connections)) == n:
                    break
                await asyncio.sleep(0)
            assert len(_head_timers(loop, server.connections)) == n  # one each while it waits
        for writer in writers:
            writer.transport.abort()
        for _ in range(200):
            if not server.connections.open:
                break
            await asyncio.sleep(0)
        assert server.connections.open == 0 and not server.connections.waiting
        # None left holding its handler (a cancelled timer lets go of its arguments) for 15 s.
        assert _head_timers(loop, server.connections) == []
        # A connection whose head came: its timer cancelled then, not left to fire for nothing.
        async with aiohttp.ClientSession() as session, session.get(server.url + "/healthz") as resp:
            assert resp.status == 200 and server.connections.open == 1
            assert not server.connections.waiting and _head_timers(loop, server.connections) == []
    finally:
        await server.stop()


@pytest.mark.parametrize("run", ["asyncio", "uvloop"])  # the agent runs on uvloop
def test_a_burst_of_connections_does_not_pass_the_cap(run):
    """asyncio (and uvloop, libuv) accept what the listen backlog holds at a time and make every
    one's protocol before any is told of its transport: counted as they are accepted, no burst
    passes the cap."""
    if run == "uvloop":
        import uvloop

        uvloop.run(_burst())
    else:
        asyncio.run(_burst())


async def _burst() -> None:
    server = api.ApiServer(Provider(), "127.0.0.1", 0, token=TOKEN)
    server.max_connections = 5
    await _started(server)
    held: list = []
    try:
        held = list(await asyncio.gather(*(asyncio.open_connection("127.0.0.1", server.port) for _ in range(40))))
        for _ in range(100):  # the accepted ones told of their transports
            await asyncio.sleep(0)
        assert (len(server.connections.connections), server.connections.refused) == (5, 35)
        assert server.connections.open == 5
        kept = {h.transport.get_extra_info("peername")[1] for h in server.connections.connections}
        refused = [r for r, w in held if w.get_extra_info("sockname")[1] not in kept]
        assert len(refused) == 35
        closed = await asyncio.gather(*(asyncio.wait_for(r.read(), 5) for r in refused), return_exceptions=True)
        assert all(c == api.BUSY_ANSWER or isinstance(c, ConnectionResetError) for c in closed), closed
        for _, writer in held:
            writer.close()
        for _ in range(500):  # aiohttp drops its handler of a closed connection a little later, under load
            if not server.connections.open and not server.connections.connections:
                break
            await asyncio.sleep(0.01)
        assert server.connections.open == 0 and not server.connections.connections
        async with aiohttp.ClientSession() as session, session.get(server.url + "/healthz") as resp:
            assert resp.status == 200
    finally:
        for _, writer in held:
            writer.close()
        await server.stop()


def test_a_full_api_refuses_the_leave_it_would_otherwise_run_without_the_agent(tmp_path):
    """The agent's API at its connection cap: `agentd leave` is told to try again (the API
    answers 503 past its cap), and the agent is not asked to leave, nor is anything done
    without it."""
    asked = []

    class Agent(Provider):
        def request_leave(self):
            asked.append(True)

    async def main() -> None:
        token_file = tmp_path / "api.token"
        server = api.ApiServer(Agent(), "127.0.0.1", 0, token=auth.write_token_file(token_file))
        server.max_connections = 1
        await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:  # the one place held, with a keep-alive request
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await reader.readuntil(b"\r\n\r\n")
            with pytest.raises(cli.LeaveRefused, match="too many connections open to this API: try again"):
                await asyncio.to_thread(cli.leave_running_agent, "127.0.0.1", server.port, token_file, timeout=5)
        finally:
            writer.close()
            await server.stop()

    asyncio.run(main())
    assert asked == []


# ------------------------------------------------------------------ errors are JSON


async def test_every_error_is_json_aiohttps_own_too():
    server = await _started(api.ApiServer(Provider(flows=FlowViews(SimpleNamespace(ring=FlowRing(16)))),
                                          "127.0.0.1", 0, token=TOKEN))
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(server.url + "/nope") as resp:
                assert resp.status == 404 and resp.content_type == "application/json"
                assert await resp.json() == {"error": "Not Found"}
            async with session.delete(server.url + "/status", headers=auth.bearer_header(TOKEN)) as resp:
                assert resp.status == 405 and resp.content_type == "application/json"
                assert await resp.json() == {"error": "Method Not Allowed"}
                assert "GET" in resp.headers["Allow"]  # aiohttp's header kept
            async with session.get(server.url + "/ui", allow_redirects=False) as resp:
                assert resp.status == 302 and resp.headers["Location"] == "/ui/"  # a redirect stays one
    finally:
        await server.stop()


async def test_ui_without_its_slash_keeps_the_key_in_its_redirect():
    """/ui?key=K typed without the trailing slash went to /ui/, the key dropped: 401 in the view."""
    from yarl import URL

    server = await _started(api.ApiServer(Provider(flows=FlowViews(SimpleNamespace(ring=FlowRing(16)))),
                                          "127.0.0.1", 0, token=TOKEN))
    key = auth.ui_key(TOKEN)
    try:
        async with aiohttp.ClientSession() as session:
            for query in (f"key={key}", "key=a%2Bb%26c&x=1"):  # as sent, its escapes too
                url = URL(f"{server.url}/ui?{query}", encoded=True)
                async with session.get(url, allow_redirects=False) as resp:
                    assert resp.status == 302 and resp.headers["Location"] == f"/ui/?{query}", query
    finally:
        await server.stop()


# ------------------------------------------------------------------ /nodes/<this node>/...


async def test_this_nodes_rib_metrics_healthz_readyz_are_answered_not_redirected():
    server = await _started(api.ApiServer(Provider(flows=FlowViews(SimpleNamespace(ring=FlowRing(16)))),
                                          "127.0.0.1", 0, token=TOKEN))
    try:
        async with aiohttp.ClientSession() as session:
            for what, status, body in (("healthz", 200, {"healthy": True, "problems": []}),
                                       ("readyz", 503, {"ready": False, "reasons": ["routes not reconciled yet"]}),
                                       ("rib?prefix=10.0.0.0/24", 200, [])):
                async with session.get(f"{server.url}/nodes/node1/{what}", allow_redirects=False) as resp:
                    assert (resp.status, await resp.json()) == (status, body), what
            async with session.get(f"{server.url}/nodes/node1/rib?prefix=nonsense", allow_redirects=False) as resp:
                assert resp.status == 400  # the query is /rib's, as /rib reads it
            async with session.get(f"{server.url}/nodes/node1/metrics", allow_redirects=False) as resp:
                assert resp.status == 200 and resp.content_type == "text/plain"
    finally:
        await server.stop()


async def test_policy_view_pods_is_asked_without_allow_lists_here_and_for_this_node():
    """GET /policy?view=pods and /nodes/<this node>/policy?view=pods (the browser view's node
    page) ask the policy view without its allow-lists; the other views as before."""
    asked = []

    class WithPolicy(Provider):
        def policy_view(self, pod=None, summary=False, allow_lists=True):
            asked.append((pod, summary, allow_lists))
            return {"pods": []}

    server = await _started(api.ApiServer(WithPolicy(), "127.0.0.1", 0, token=TOKEN))
    try:
        async with aiohttp.ClientSession() as session:
            for path in ("/policy?view=pods", "/nodes/node1/policy?view=pods", "/policy", "/nodes/node1/policy?pod=x/a",
                         "/policy?view=summary", "/nodes/node1/policy?view=summary"):
                async with session.get(server.url + path, allow_redirects=False) as resp:
                    assert resp.status == 200, path
    finally:
        await server.stop()
    assert asked == [(None, False, False), (None, False, False), (None, False, True), ("x/a", False, True),
                     (None, True, True), (None, True, True)]


async def test_bad_rib_and_flows_queries_are_one_error_naming_the_parameter():
    server = await _started(api.ApiServer(Provider(flows=FlowViews(SimpleNamespace(ring=FlowRing(16)))),
                                          "127.0.0.1", 0, token=TOKEN))
    many = "9" * 5000  # past int()'s digit limit: its own message names no parameter
    try:
        async with aiohttp.ClientSession() as session:
            for query, error in (
                ("rib?limit=abc", "limit: 'abc' is not a whole number"),
                ("rib?limit=-1", "limit: '-1' is not a whole number"),
                (f"rib?limit={many}", "limit: 99999999999999999999... is out of range 1..10000000"),
                ("rib?limit=0", "limit: 0 is out of range 1..10000000"),
                ("rib?limit=10000001", "limit: 10000001 is out of range 1..10000000"),
                ("rib?prefix=", "prefix: empty (leave it out for the whole RIB)"),
                ("flows?follow=2", "follow: '2' is neither 1, true, yes (on) nor 0, false, no (off)"),
                ("flows?follow=on&last=0", "follow: 'on' is neither"),
                ("flows?follow=TRUE", "follow: 'TRUE' is neither"),
                ("flows?cluster=all", "cluster: 'all' is neither"),
            ):
                async with session.get(f"{server.url}/{query}") as resp:
                    assert (resp.status, await resp.json()) == (400, {"error": AnyStartingWith(error)}), query
            for query in ("rib?limit=5", "rib?limit=10000000", "flows?follow=0&last=0", "flows?follow=no&cluster=false"):
                async with session.get(f"{server.url}/{query}") as resp:
                    assert resp.status == 200, query
            async with session.get(f"{server.url}/nodes/node1/flows") as resp:
                error = (await resp.json())["error"]
                assert resp.status == 404 and error.startswith("flows is not relayed (relayed: status, peers,"), error
                assert "flows," not in error and error.endswith("; flows: GET /flows?node=NAME)"), error
    finally:
        await server.stop()


class AnyStartingWith(str):
    def __eq__(self, other):
        return isinstance(other, str) and other.startswith(str(self))

    __hash__ = str.__hash__


# ------------------------------------------------------------------ the cluster view


class FakeCluster:
    """A ClusterView that asks no node: node2 answers what it is asked, and says what it was."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def nodes(self):
        return {"node1": "192.0.2.1", "node2": "192.0.2.2"}

    async def gather(self, path, own):
        self.asked.append(f"node2 {path}")
        return {"node1": own(), "node2": {"node": {"name": "node2"}}}

    async def get(self, name, path):
        self.asked.append(f"{name} {path}")
        return 200, "application/json", b'{"node": {"name": "node2"}}'

    async def lines(self, name, path, follow=False):
        self.asked.append(f"{name} {path.split('?')[0]}")
        for line in ():
            yield line


@pytest.mark.parametrize("path", ["/cluster", "/nodes/node2/status", "/flows?node=node2&last=5",
                                  "/flows?cluster=1&last=5"])
async def test_other_nodes_answers_need_the_token_or_the_browser_key(path):
    """The loopback API relays to other nodes with the cluster's read token: a local user
    without a credential (or with a wrong one) is refused before any node is asked; the API
    token or its browser key (agentd flows, the /ui/ page) is answered."""
    view = FakeCluster()
    server = await _started(api.ApiServer(Provider(FlowViews(SimpleNamespace(ring=FlowRing(16))), view),
                                          "127.0.0.1", 0, token=TOKEN))  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session:
            for headers in ({}, auth.bearer_header("guess"), auth.bearer_header(auth.ui_key("other"))):
                async with session.get(server.url + path, headers=headers) as resp:
                    assert resp.status == 401, (path, headers)
            assert view.asked == []
            for credential in (TOKEN, auth.ui_key(TOKEN)):
                async with session.get(server.url + path, headers=auth.bearer_header(credential)) as resp:
                    assert resp.status == 200, (path, await resp.text())
                    await resp.read()
            assert len(view.asked) == 2 and all(a.startswith("node2 /") for a in view.asked), view.asked
            # This node's own answers need nothing.
            async with session.get(server.url + "/nodes/node1/status") as resp:
                assert resp.status == 200 and await resp.json() == {"node": {"name": "node1"}}
    finally:
        await server.stop()


async def test_a_node_answering_no_json_object_is_that_nodes_error_not_a_500():
    for answer in (5, None, [1], "some text", True):
        view = ClusterView("node1", lambda: {"node1": "192.0.2.1", "node2": "192.0.2.2"}, 9098)
        view.token = "read-token"

        async def get_json(node, path, a=answer):
            return a

        view.get_json = get_json  # type: ignore[method-assign]
        agent = SimpleNamespace(cluster_view=lambda v=view: v, flows_view=lambda: None, node_name=lambda: "node1",
                                status=lambda: {"node": {"name": "node1"}})
        handlers = observe_api._Handlers(agent, read_only=False, token_of=lambda: TOKEN)
        resp = await handlers.cluster(make_mocked_request("GET", "/cluster", headers=auth.bearer_header(TOKEN)))
        nodes = json.loads(resp.text)["nodes"]
        assert resp.status == 200 and nodes["node1"]["status"] == {"node": {"name": "node1"}}, answer
        assert nodes["node2"] == {"address": "192.0.2.2", "error": "node2 did not answer with a JSON object"}, answer


async def test_a_node_that_redirects_is_not_followed(monkeypatch):
    asked: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({"secret": True})

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://127.0.0.1:{other_port}/latest/meta-data")

    other = web.Application()
    other.router.add_get("/{tail:.*}", elsewhere)
    node = web.Application()
    node.router.add_get("/{tail:.*}", redirect)
    runners = []
    ports = []
    for app in (other, node):
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        ports.append(site._server.sockets[0].getsockname()[1])
    other_port, node_port = ports
    monkeypatch.setattr(cluster, "unsafe_address", lambda address: None)  # the test's node is on loopback
    view = ClusterView("node1", lambda: {"node2": "127.0.0.1"}, node_port)
    view.token = "read-token"
    try:
        with pytest.raises(NodeAnswered, match="node2 answered 302: a redirect to .*not followed") as err:
            await view.get("node2", "/status")
        assert err.value.status == 302
        with pytest.raises(NodeAnswered, match="answered 302"):
            async for _ in view.lines("node2", "/flows?last=1"):
                pass
        gathered = await view.gather("/status", lambda: {"me": 1})
        assert "answered 302" in gathered["node2"]["error"]
        assert asked == []  # the token went nowhere else
    finally:
        await view.close()
        for runner in runners:
            await runner.cleanup()



async def test_a_nodes_endless_error_answer_is_read_no_further_than_its_start(monkeypatch):
    """A followed request has no total deadline: a node answering 503 with a body that never
    ends was read whole (a probe's agent grew by 821 MB) before NodeAnswered said so.  Its
    start is read, the connection let go; the node gets to send a few chunks, not 64 KB."""
    sent = 0
    gone = asyncio.Event()

    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 1024
        try:
            while sent < 4 << 20:  # "endless": the test stops it at 4 MB
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
                sent += len(chunk)
                await asyncio.sleep(0)  # the reader runs between two chunks
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            gone.set()
            writer.close()

    server = await asyncio.start_server(node, "127.0.0.1", 0)
    monkeypatch.setattr(cluster, "unsafe_address", lambda address: None)  # the test's node is on loopback
    view = ClusterView("node1", lambda: {"node2": "127.0.0.1"}, server.sockets[0].getsockname()[1])
    view.token = "read-token"
    try:
        with pytest.raises(NodeAnswered, match=r"node2 answered 503: x+$") as err:
            async for _ in view.lines("node2", "/flows?follow=1", follow=True):
                pass
        assert err.value.status == 503
        await asyncio.wait_for(gone.wait(), 5)
        assert sent < 64 << 10, sent
    finally:
        await view.close()
        server.close()
        await server.wait_closed()

# ------------------------------------------------------------------ followers


async def test_local_readers_without_a_credential_cannot_take_the_clusters_places():
    views = FlowViews(SimpleNamespace(ring=FlowRing(16)))
    agent = SimpleNamespace(cluster_view=lambda: None, flows_view=lambda: views, node_name=lambda: "node1")
    loopback = observe_api._Handlers(agent, read_only=False, token_of=lambda: TOKEN)
    listener = observe_api._Handlers(agent, read_only=True, token_of=lambda: None)

    async def follow(handlers, headers=None):
        request = make_mocked_request("GET", "/flows?follow=1&last=0", headers=headers or {})
        task = asyncio.create_task(handlers.flows(request))
        for _ in range(5):
            await asyncio.sleep(0)
        return task

    open_ones = [await follow(loopback) for _ in range(MAX_FOLLOWERS)]  # a local user's curls
    refused = await follow(loopback)
    assert refused.done() and refused.result().status == 503
    # Another node's gatherer (the read-only listener) and a reader here with the key still follow.
    trusted = [await follow(listener), await follow(loopback, auth.bearer_header(auth.ui_key(TOKEN)))]
    assert not any(t.done() for t in trusted) and views.followers("trusted") == 2
    assert views.followers("open") == MAX_FOLLOWERS and views.followers() == MAX_FOLLOWERS + 2
    for task in open_ones + trusted:
        task.cancel()
    await asyncio.gather(*open_ones, *trusted, return_exceptions=True)
    assert views.followers() == 0


def _peer(address: str):
    from unittest import mock

    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (address, 40000) if name == "peername" else default
    return transport


async def test_other_nodes_gatherers_cannot_take_this_nodes_roots_places():
    """Other nodes' gatherers, the readers here with a credential and this node's own cluster
    streams shared one pool: whoever holds the browser key on another node, opening 64 cluster
    follows there, took the 64 places of every node -- root's `agentd flows -f` was refused
    while readers without a credential still followed.  The gatherers hold at most
    REMOTE_FOLLOWERS (REMOTE_PER_NODE each); a reader here with a credential falls back on an
    open place when the trusted ones are taken."""
    views = FlowViews(SimpleNamespace(ring=FlowRing(16)))
    agent = SimpleNamespace(cluster_view=lambda: None, flows_view=lambda: views, node_name=lambda: "node1")
    loopback = observe_api._Handlers(agent, read_only=False, token_of=lambda: TOKEN)
    listener = observe_api._Handlers(agent, read_only=True, token_of=lambda: None)
    key = auth.bearer_header(auth.ui_key(TOKEN))

    async def follow(handlers, headers=None, peer="127.0.0.1", query="follow=1&last=0"):
        request = make_mocked_request("GET", f"/flows?{query}", headers=headers or {}, transport=_peer(peer))
        task = asyncio.create_task(handlers.flows(request))
        for _ in range(5):
            await asyncio.sleep(0)
        return task

    assert observe_api.REMOTE_FOLLOWERS < MAX_FOLLOWERS and observe_api.REMOTE_PER_NODE < observe_api.REMOTE_FOLLOWERS
    one_node = [await follow(listener, peer="192.0.2.2") for _ in range(MAX_FOLLOWERS)]
    assert sum(not t.done() for t in one_node) == observe_api.REMOTE_PER_NODE
    refused = next(t for t in one_node if t.done())
    assert refused.result().status == 503 and "192.0.2.2" in json.loads(refused.result().text)["error"]
    nodes = [await follow(listener, peer=f"192.0.2.{i}") for i in range(3, 10) for _ in range(MAX_FOLLOWERS)]
    assert sum(not t.done() for t in one_node + nodes) == observe_api.REMOTE_FOLLOWERS
    roots = [await follow(loopback, key) for _ in range(MAX_FOLLOWERS - observe_api.REMOTE_FOLLOWERS)]
    assert not any(t.done() for t in roots) and views.followers("trusted") == MAX_FOLLOWERS
    # The trusted places all taken: a reader with the key still follows, in an open place.
    more = [await follow(loopback, key), await follow(loopback)]
    assert not any(t.done() for t in more) and views.followers("open") == 2
    tasks = one_node + nodes + roots + more
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert views.followers() == 0 and listener.remote == {}


async def test_cluster_follows_are_capped_with_flow_records_off_here():
    """With this node's flow records off there is no follower of its own to count: a followed
    cluster stream (each one following every node) was not limited at all."""
    agent = SimpleNamespace(cluster_view=lambda: None, flows_view=lambda: None, node_name=lambda: "node1")
    loopback = observe_api._Handlers(agent, read_only=False, token_of=lambda: TOKEN)
    key = auth.bearer_header(auth.ui_key(TOKEN))

    async def follow():
        request = make_mocked_request("GET", "/flows?cluster=1&follow=1&last=0", headers=key)
        task = asyncio.create_task(loopback.flows(request))
        for _ in range(5):
            await asyncio.sleep(0)
        return task

    streams = [await follow() for _ in range(MAX_FOLLOWERS)]
    assert not any(t.done() for t in streams)
    refused = await follow()
    assert refused.done() and refused.result().status == 503
    assert loopback.cluster_follows == MAX_FOLLOWERS
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    assert loopback.cluster_follows == 0
    again = await follow()  # the places given back
    assert not again.done()
    again.cancel()
    await asyncio.gather(again, return_exceptions=True)

@pytest.mark.parametrize("run", ["asyncio", "uvloop"])  # the agent runs on uvloop
@pytest.mark.parametrize("stream", ["local", "cluster", "listener"])
def test_a_follower_whose_reader_went_is_let_go_at_once(run, stream):
    """A reader that goes (a closed connection) gives its follower's place back then, not at
    the next write (a keep-alive every KEEPALIVE seconds on a quiet stream): this node's own
    followed stream, the cluster's gathered one (this node's records followed in it), and
    another node's gatherer on the cluster listener.  Real servers and clients."""
    main = _reader_goes(stream)
    if run == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


async def _reader_goes(stream: str) -> None:
    views = FlowViews(SimpleNamespace(ring=FlowRing(16)))
    if stream == "listener":
        server = api.ApiServer(Provider(views), "127.0.0.1", 0, read_token=lambda: "read-token")
        headers, query = auth.bearer_header("read-token"), "follow=1&last=0"
    else:
        server = api.ApiServer(Provider(views), "127.0.0.1", 0, token=TOKEN)
        headers = auth.bearer_header(TOKEN) if stream == "cluster" else {}
        query = "cluster=1&follow=1&last=0" if stream == "cluster" else "follow=1&last=0"
    await _started(server)
    loop = asyncio.get_running_loop()

    async def until(cond, seconds: float) -> float:
        """How long ``cond()`` took to hold (at most ``seconds``, else fails)."""
        start = loop.time()
        while not cond():
            assert loop.time() - start < seconds, f"not within {seconds} s"
            await asyncio.sleep(0.005)
        return loop.time() - start

    try:
        async with aiohttp.ClientSession() as session:
            resp = await session.get(server.url + "/flows?" + query, headers=headers)
            assert resp.status == 200
            await until(lambda: views.followers() == 1, 3)
            resp.close()  # the reader goes, the stream quiet: nothing is written to find it out
            took = await until(lambda: views.followers() == 0, cluster.KEEPALIVE / 2)
            assert took < 1.0, took  # /status: flows.followers, len(ring.followers) as here
            # Its place is free, and the server still answers.
            async with session.get(server.url + "/healthz", headers=headers) as again:
                assert again.status == 200
    finally:
        await server.stop()


def test_the_ring_counts_each_pool_on_its_own():
    ring = FlowRing(16)
    for _ in range(MAX_FOLLOWERS):
        ring.follow(FlowFilter())
    follower = ring.follow(FlowFilter(), pool="trusted")
    assert ring.following("open") == MAX_FOLLOWERS and ring.following("trusted") == 1
    ring.unfollow(follower)
    assert ring.following("trusted") == 0


# ------------------------------------------------------------------ the CLI


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Records each request (method, path, Authorization) in ``server.seen``; answers with
    ``server.answer(handler)``."""

    def _any(self) -> None:
        self.server.seen.append((self.command, self.path, self.headers.get("Authorization")))  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.answer(self)  # type: ignore[attr-defined]

    do_GET = do_POST = _any

    def log_message(self, *args):
        pass


def _serve(answer):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.seen = []  # type: ignore[attr-defined]
    server.answer = answer  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _reply(handler, status, body=b"{}", headers=()):
    handler.send_response(status)
    for k, v in headers:
        handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _agent(handler):
    if handler.command == "POST":
        _reply(handler, 202, b'{"leaving": true}')
    elif handler.path == "/healthz":  # stopping: the connection closed unanswered, so leave returns
        handler.close_connection = True
    else:
        _reply(handler, 200, b'{"node": {"name": "node1"}}')


@pytest.fixture
def servers(monkeypatch):
    import urllib.request

    made = []

    def make(answer):
        made.append(_serve(answer))
        return made[-1]

    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen's opener made anew, from this environment
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    yield make
    for server in made:
        server.shutdown()
        server.server_close()


def test_the_cli_never_sends_the_token_through_a_proxy(servers, monkeypatch, tmp_path):
    agent = servers(_agent)
    proxy = servers(lambda h: _reply(h, 502, b"bad gateway"))
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.server_address[1]}")
    token_file = tmp_path / "api.token"
    token_file.write_text(TOKEN + "\n")
    assert cli.leave_running_agent("127.0.0.1", agent.server_address[1], token_file, out=io.StringIO()) == 0
    assert cli.fetch_json(f"http://127.0.0.1:{agent.server_address[1]}/status") == {"node": {"name": "node1"}}
    assert proxy.seen == []
    assert agent.seen[0] == ("POST", "/leave", f"Bearer {TOKEN}")


def test_the_cli_follows_no_redirect_with_the_key(servers, tmp_path, capsys):
    elsewhere = servers(lambda h: _reply(h, 200, b'{"time": 1}\n'))
    redirecting = servers(lambda h: _reply(h, 302, b"", [("Location", f"http://127.0.0.1:{elsewhere.server_address[1]}/x")]))
    token_file = tmp_path / "api.token"
    token_file.write_text(TOKEN + "\n")
    parser = argparse.ArgumentParser()
    cli.add_flow_arguments(parser)
    args = parser.parse_args(["--api", f"http://127.0.0.1:{redirecting.server_address[1]}"])
    assert cli.flows_command(args, token_file) == 1
    assert "302" in capsys.readouterr().err
    with pytest.raises(Exception, match="not followed"):
        cli.fetch_json(f"http://127.0.0.1:{redirecting.server_address[1]}/status")
    assert elsewhere.seen == []  # neither the key nor anything else went there
    assert redirecting.seen[0][2] == f"Bearer {auth.ui_key(TOKEN)}"


# ------------------------------------------------------------------ the cluster listener without the token


async def test_a_request_the_cluster_listener_refuses_closes_its_connection():
    """Without the read token a client holds no connection: the 401 (no token) and the 405 (a
    change) come with Connection: close, and the connection is closed after them."""
    server = await _started(api.ApiServer(Provider(), "127.0.0.1", 0, read_token=lambda: "read-token"))
    try:
        for head in (b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n", b"POST /leave HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
                     b"GET /status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n\r\n"):  # fmt: skip
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(head)
            answer = await asyncio.wait_for(reader.read(), 5)  # to EOF: the server closed
            status, _, rest = answer.partition(b"\r\n")
            assert status.split()[1] in (b"401", b"405") and b"connection: close" in rest.lower(), answer
            writer.close()
        # With the token the connection is kept for the next request.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer read-token\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)).split()[1] == b"200"
        writer.close()
    finally:
        await server.stop()


async def test_the_cluster_listener_holds_at_most_so_many_connections_of_one_address():
    """One host cannot fill the cluster listener's MAX_CONNECTIONS (other nodes could no longer
    gather from this one): one past MAX_PER_ADDRESS of its connections is closed as it comes,
    before aiohttp sees it; another address, and loopback, are not counted with it."""
    assert api.MAX_PER_ADDRESS == 64
    assert api.ApiServer(Provider(), "127.0.0.1", 0, token=TOKEN).max_per_address is None  # the loopback API's
    cluster_listener = api.ApiServer(Provider(), "127.0.0.1", 0, read_token=lambda: "t")
    assert cluster_listener.max_per_address == api.MAX_PER_ADDRESS

    class Handler(asyncio.Protocol):
        def __init__(self, server) -> None:
            self.server, self.made, self.lost = server, False, False

        def connection_made(self, transport) -> None:
            self.made, self.transport = True, transport
            self.server.connections.append(self)

        def connection_lost(self, exc) -> None:
            self.lost = True
            self.server.connections.remove(self)

    class Server:
        def __init__(self) -> None:
            self.connections: list = []

        def __call__(self) -> Handler:
            return Handler(self)

    class Transport:
        def __init__(self, peer) -> None:
            self.peer, self.aborted, self.written = peer, False, b""

        def get_extra_info(self, name):
            return self.peer if name == "peername" else None

        def write(self, data: bytes) -> None:
            self.written += data

        def close(self) -> None:  # refused: answered 503, then closed
            assert self.written == api.BUSY_ANSWER
            self.aborted = True

    cluster_listener.max_per_address = 2
    conns = cluster_listener._capped(Server())  # type: ignore[arg-type]

    def connect(address: str):
        protocol, transport = conns(), Transport((address, 40000))
        protocol.connection_made(transport)  # type: ignore[arg-type]
        return protocol, transport

    a1, a2 = connect("192.0.2.7"), connect("192.0.2.7")
    a3 = connect("192.0.2.7")
    assert a3[1].aborted and not a3[0].handler.made and conns.refused_address == 1
    assert not any(t.aborted for _, t in (a1, a2)) and a1[0].handler.made
    b = connect("192.0.2.8")
    lo = [connect("127.0.0.1") for _ in range(3)]
    assert not b[1].aborted and not any(t.aborted for _, t in lo)
    assert len(conns.connections) == 6 and conns.by_address == {"192.0.2.7": 2, "192.0.2.8": 1}
    a3[0].connection_lost(None)  # the refused one's end changes nothing
    a1[0].connection_lost(None)
    assert a1[0].handler.lost and conns.by_address["192.0.2.7"] == 1
    assert not connect("192.0.2.7")[1].aborted  # a place is free again
    for p, _ in lo:
        p.connection_lost(None)
    assert conns.by_address == {"192.0.2.7": 2, "192.0.2.8": 1}
    # An IPv6 host may use any address of its /64: they are counted together, per /64.
    v6 = [connect(f"2001:db8:1:2::{i:x}") for i in (1, 0xbeef, 0xffff)] + [connect("2001:db8:1:2:dead::1")]
    assert [t.aborted for _, t in v6] == [False, False, True, True], v6
    assert not connect("2001:db8:1:3::1")[1].aborted  # the next /64 is another host's
    assert [connect(a)[1].aborted for a in ("fe80::1%eth0", "fe80::2%eth1", "fe80::3")] == [False, False, True]
    # An IPv4 client of a dual-stack socket (::ffff:a.b.c.d) is its IPv4 address.
    assert [connect("::ffff:192.0.2.8")[1].aborted for _ in range(2)] == [False, True]
    assert conns.by_address == {"192.0.2.7": 2, "192.0.2.8": 2, "2001:db8:1:2::/64": 2, "2001:db8:1:3::/64": 1,
                                "fe80::/64": 2}  # fmt: skip
    assert not connect("::ffff:127.0.0.1")[1].aborted and conns.by_address["192.0.2.8"] == 2  # loopback


async def test_registered_nodes_of_one_ipv6_64_are_each_counted_on_their_own():
    """A datacenter's IPv6 subnet is often one /64 that every node shares, each node holding
    connections to the cluster listener (gathers, follows): the registered nodes' addresses
    are counted each on its own (70 nodes of one /64, two connections each: all admitted);
    other clients of a /64 stay counted together (70 of them: MAX_PER_ADDRESS admitted)."""
    nodes = frozenset(f"2001:db8:7::{i:x}" for i in range(1, 71))
    cluster_listener = api.ApiServer(Provider(), "127.0.0.1", 0, read_token=lambda: "t", nodes=lambda: nodes)

    class Transport:
        def __init__(self, peer) -> None:
            self.peer, self.aborted, self.written = peer, False, b""

        def get_extra_info(self, name):
            return self.peer if name == "peername" else None

        def write(self, data: bytes) -> None:
            self.written += data

        def close(self) -> None:  # refused: answered 503, then closed
            assert self.written == api.BUSY_ANSWER
            self.aborted = True

    class Handler(asyncio.Protocol):
        pass

    conns = cluster_listener._capped(lambda: Handler())  # type: ignore[arg-type]

    def admitted(address: str) -> bool:
        protocol, transport = conns(), Transport((address, 40000))
        protocol.connection_made(transport)  # type: ignore[arg-type]
        return not transport.aborted

    # The node addresses written otherwise than canonically by the peer (upper case, zeros).
    assert all(admitted(ipaddress.ip_address(a).exploded.upper()) for a in sorted(nodes) for _ in range(2))
    assert conns.by_address["2001:db8:7::1"] == 2 and "2001:db8:7::/64" not in conns.by_address
    others = [admitted(f"2001:db8:7::1:{i:x}") for i in range(70)]
    assert others.count(True) == api.MAX_PER_ADDRESS and others[: api.MAX_PER_ADDRESS] == [True] * api.MAX_PER_ADDRESS
    assert conns.by_address["2001:db8:7::/64"] == api.MAX_PER_ADDRESS


async def test_hosts_of_the_underlay_cannot_take_the_registered_nodes_places():
    """The cluster listener's cap was checked before the peer was known: 16 hosts of the
    underlay at MAX_PER_ADDRESS each (connections sitting KEEPALIVE_TIMEOUT without a request,
    then opened again) filled MAX_CONNECTIONS, and the registered nodes could no longer gather
    from this one.  The others hold at most MAX_CONNECTIONS - NODE_RESERVE; a node finds a place."""
    nodes = frozenset({*(f"10.0.0.{i}" for i in range(2, 10)), "2001:db8::2"})
    cluster_listener = api.ApiServer(Provider(), "127.0.0.1", 0, read_token=lambda: "t", nodes=lambda: nodes)

    class Transport:
        def __init__(self, peer) -> None:
            self.peer, self.refused = peer, False

        def get_extra_info(self, name):
            return self.peer if name == "peername" else None

        def write(self, data: bytes) -> None:
            assert data == api.BUSY_ANSWER

        def close(self) -> None:
            self.refused = True

    class Handler(asyncio.Protocol):
        pass

    conns = cluster_listener._capped(lambda: Handler())  # type: ignore[arg-type]

    def connect(address: str):
        protocol, transport = conns(), Transport((address, 40000))
        protocol.connection_made(transport)  # type: ignore[arg-type]
        return protocol, transport

    pods = [connect(f"10.244.1.{host}") for host in range(10, 26) for _ in range(api.MAX_PER_ADDRESS)]
    others = api.MAX_CONNECTIONS - api.NODE_RESERVE
    assert sum(not t.refused for _, t in pods) == others and conns.others == others
    assert not connect("10.0.0.2")[1].refused and not connect("2001:db8::2")[1].refused
    assert connect("127.0.0.1")[1].refused  # loopback is no registered node
    # The nodes may take every place left (each at most MAX_PER_ADDRESS); then nobody gets one.
    more = [connect(f"10.0.0.{i}") for i in range(2, 10) for _ in range(api.MAX_PER_ADDRESS)]
    assert sum(not t.refused for _, t in more) == api.NODE_RESERVE - 2 and conns.open == api.MAX_CONNECTIONS
    # A pod's place given back is a pod's again.
    pods[0][0].connection_lost(None)
    assert conns.open == api.MAX_CONNECTIONS - 1 and not connect("10.244.1.10")[1].refused
