"""pytest fixture ``etcd_server``: a started etcd 3.4 on 127.0.0.1 with its own ports.

Function scope; the server is stopped (SIGTERM, then SIGKILL) when the test ends,
pass or fail.  Tests may ``await etcd_server.stop()`` / ``start()`` to simulate an
outage: the data directory survives, so keys and leases come back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from agentd.lab import etcd as _etcd


@pytest_asyncio.fixture
async def etcd_server(tmp_path) -> AsyncIterator[_etcd.EtcdServer]:
    async with _etcd.etcd_server(tmp_path) as server:
        yield server
