"""GET /flows and the /nodes/ relay against odd input: a cursor of more digits than int()
reads, a search that fails after its follower was registered, a query relayed as written.
Servers in process on 127.0.0.1 with ephemeral ports; no sleeps."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from agentd.daemon import auth, cluster, observe_api
from agentd.daemon.cluster import ClusterView
from agentd.flows.ring import MAX_FOLLOWERS, FlowRing
from agentd.flows.views import FlowViews

TOKEN = "api-token"


def _agent(views: FlowViews | None, cluster_view: ClusterView | None = None) -> SimpleNamespace:
    return SimpleNamespace(cluster_view=lambda: cluster_view, flows_view=lambda: views, node_name=lambda: "node1")


@pytest.mark.parametrize("seq", [pytest.param("9" * 5000, id="5000-digits"), "\u00b2", "\u0663"])
async def test_a_cursor_int_cannot_read_is_a_400_and_leaves_no_follower(seq):
    """after=RING:<5000 digits> reached int(): a 500, and with follow=1 a follower registered for
    good -- 64 of them and every local reader without a credential got 503."""
    ring = FlowRing(16)
    views = FlowViews(SimpleNamespace(ring=ring))
    handlers = observe_api._Handlers(_agent(views), read_only=False, token_of=lambda: TOKEN)
    for query in [f"follow=1&last=0&after={ring.id}:{seq}"] * MAX_FOLLOWERS + [f"last=1&after={ring.id}:{seq}"]:
        resp = await handlers.flows(make_mocked_request("GET", f"/flows?{query}"))
        assert resp.status == 400, query[:40]
        assert json.loads(resp.text)["error"].startswith("after: "), query[:40]
    assert views.followers() == 0


def test_a_cursor_has_the_digits_of_a_64_bit_number_at_most():
    assert observe_api._after("r:" + "9" * 20) == "r:" + "9" * 20
    with pytest.raises(observe_api.FilterError, match=r"^after: 'r:9+' is not a cursor"):
        observe_api._after("r:" + "9" * 21)


async def test_a_follower_whose_search_fails_is_let_go():
    class Failing(FlowViews):
        def search(self, flt, n, since=None, after=None):
            raise RuntimeError("the search failed")

    views = Failing(SimpleNamespace(ring=FlowRing(16)))
    handlers = observe_api._Handlers(_agent(views), read_only=False, token_of=lambda: TOKEN)
    for _ in range(MAX_FOLLOWERS + 1):  # one more than the places: none was kept
        with pytest.raises(RuntimeError, match="the search failed"):
            await handlers.flows(make_mocked_request("GET", "/flows?follow=1&last=0"))
    assert views.followers() == 0


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def test_the_node_relay_forwards_the_query_as_written(monkeypatch):
    """The relay sent yarl's query_string, %23 decoded to "#": node2 was asked for
    prefix=10.0.0.0/8 (the rest a fragment) and answered 200 where /rib here answers 400."""
    asked: list[str] = []

    async def node2(request: web.Request) -> web.Response:
        asked.append(request.raw_path)
        return web.json_response([])

    other = web.Application()
    other.router.add_get("/{tail:.*}", node2)
    node_runner, node_port = await _serve(other)
    monkeypatch.setattr(cluster, "unsafe_address", lambda address: None)  # the test's node is on loopback
    view = ClusterView("node1", lambda: {"node2": "127.0.0.1"}, node_port)
    view.token = "read-token"
    app = web.Application()
    observe_api.add_routes(app, _agent(None, view), read_only=False, token_of=lambda: TOKEN)  # type: ignore[arg-type]
    runner, port = await _serve(app)
    try:
        import aiohttp
        from yarl import URL

        async with aiohttp.ClientSession() as session:
            for query in ("prefix=10.0.0.0/8%23junk", "a=%25&b=%26c%3Dd", "prefix=10.0.0.0/8"):
                url = URL(f"http://127.0.0.1:{port}/nodes/node2/rib?{query}", encoded=True)
                async with session.get(url, headers=auth.bearer_header(TOKEN)) as resp:
                    assert resp.status == 200, query
                assert asked[-1] == f"/rib?{query}"
    finally:
        await view.close()
        await runner.cleanup()
        await node_runner.cleanup()
