"""The cluster view: how one agent shows every node (``/ui/``, ``GET /cluster``,
``agentd flows --cluster``).

Each agent serves its own GET endpoints a second time on a **read-only listener**, on its
node's address at ``[api] cluster_port`` (9098), where only other agents come: no POST, no
``/ui/``, no relay, and every request must carry the **cluster read token**
(``Authorization: Bearer <token>``; 401 without it, compared in constant time).  The token is
``[api] read_token_file``, or the one the agents keep in etcd (both checked by
:func:`agentd.daemon.auth.read_guard`) (``<prefix>/cluster/read-token``,
made by the first agent that starts: whoever can read etcd has the cluster anyway).

The agent a person talks to (its loopback API: the browser, ``agentd flows``) gathers from the
others over the underlay with that token -- the nodes it knows from the node registry in
etcd, each at its ``[node] address`` and the same ``cluster_port`` -- and relays: the token
never reaches the browser, and mutating endpoints stay on loopback (and behind their own
credential).  A node that does not answer within ``TIMEOUT`` is shown as unreachable with
the reason; nothing is cached, so every answer is the nodes' own data at that moment.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

log = logging.getLogger("agentd.cluster")

TIMEOUT = 3.0  # seconds a node has to answer a gathered GET
RELAYED = ("status", "peers", "routes", "policy", "services", "flows", "rib", "metrics", "healthz", "readyz")


class ClusterView:
    """Gathers from the other nodes' read-only listeners (the local node answers itself)."""

    def __init__(self, me: str, nodes: Callable[[], dict[str, str]], port: int) -> None:
        """``nodes()``: node name -> underlay address, as the registry in etcd says now."""
        self.me = me
        self.nodes = nodes
        self.port = port
        self.token: str | None = None
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=TIMEOUT, sock_read=None),
                headers={"Authorization": f"Bearer {self.token}"} if self.token else None,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def url(self, node: str, path: str) -> str:
        address = self.nodes().get(node)
        if address is None:
            raise KeyError(node)
        host = f"[{address}]" if ":" in address else address
        return f"http://{host}:{self.port}{path}"

    async def get_json(self, node: str, path: str) -> Any:
        """One node's answer to ``GET path`` (raises OSError/ValueError/KeyError with the reason)."""
        if not self.port or self.token is None:
            raise OSError("the cluster listener is off ([api] cluster_port = 0) or no read token yet")
        try:
            async with self._client().get(self.url(node, path), timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise OSError(f"{node} answered {resp.status}: {body[:200].decode(errors='replace').strip()}")
                return json.loads(body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise OSError(f"{node} unreachable: {type(err).__name__} {err}".strip()) from None

    async def lines(self, node: str, path: str) -> AsyncIterator[bytes]:
        """The NDJSON lines of one node's streamed answer (``GET /flows?follow=1``)."""
        if not self.port or self.token is None:
            raise OSError("the cluster listener is off or no read token yet")
        try:
            async with self._client().get(self.url(node, path)) as resp:
                if resp.status != 200:
                    body = await resp.read()
                    raise OSError(f"{node} answered {resp.status}: {body[:200].decode(errors='replace').strip()}")
                async for line in resp.content:
                    if line.strip():
                        yield line
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise OSError(f"{node} unreachable: {type(err).__name__} {err}".strip()) from None

    async def gather(self, path: str, local: Callable[[], Any], nodes: list[str] | None = None) -> dict[str, Any]:
        """``{node: answer}`` of every (or each named) node; an unreachable one maps to
        ``{"error": reason}``.  ``local()`` answers for this node without the network."""
        names = sorted(self.nodes()) if nodes is None else nodes
        if self.me not in names and nodes is None:
            names.append(self.me)

        async def one(name: str) -> tuple[str, Any]:
            if name == self.me:
                return name, local()
            try:
                return name, await self.get_json(name, path)
            except (OSError, ValueError, KeyError) as err:
                return name, {"error": str(err) if not isinstance(err, KeyError) else f"no node {name} in etcd"}

        return dict(await asyncio.gather(*(one(n) for n in names)))
