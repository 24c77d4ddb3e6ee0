"""The ingress request counters across proxy reloads (agentd/ingress/controller.py), with a
fake proxy: a reload starts the worker's counters from zero, so the old worker's are kept
(folded) -- once, and only when a new worker runs."""

from __future__ import annotations

import asyncio

from agentd.config.settings import load_config
from agentd.datastore.store import Datastore
from agentd.ingress.controller import IngressController
from agentd.ingress.proxy import ProxyError
from agentd.ingress.routing import Backend

BACKEND = "ing.shop.web.api.80"


class FakeProxy:
    running, pid = True, 1

    def __init__(self) -> None:
        self.count = 0  # hrsp_2xx of the running worker
        self.fail_next = False
        self.during_reload = None  # awaited inside a reload (what another task does meanwhile)

    async def check(self, path) -> None:
        pass

    async def stats(self):
        return [{"pxname": BACKEND, "svname": "BACKEND", "hrsp_2xx": str(self.count)}]

    async def info(self):
        return {}

    async def reload(self):
        if self.fail_next:
            raise ProxyError("no new worker")
        self.count = 0  # the new worker counts from zero
        if self.during_reload is not None:
            await self.during_reload()


def test_a_failed_reload_does_not_count_the_old_workers_requests_twice(tmp_path):
    cfg = load_config(None, env={}, overrides={"node.address": "10.1.1.1", "node.name": "n1"})
    ctl = IngressController("n1", Datastore(["http://127.0.0.1:2379"], "/agentd"), cfg.ingress, ["10.1.1.1"], tmp_path)
    ctl.paths.certs.mkdir(parents=True)
    proxy = ctl.proxy = FakeProxy()  # type: ignore[assignment]
    ctl.table.backends[BACKEND] = Backend("shop", "web", "api", 80)

    def total() -> int:
        return ctl.counter(BACKEND, "hrsp_2xx")

    async def main():
        proxy.count = 100
        await ctl.refresh_stats()
        assert total() == 100
        proxy.fail_next = True
        assert not await ctl._reload({}, "s1", {})
        assert total() == 100  # the old worker runs on
        proxy.count = 110
        await ctl.refresh_stats()
        assert total() == 110  # was 210: its 100 folded, then counted again
        proxy.fail_next = False
        proxy.during_reload = ctl.refresh_stats  # the stats loop meanwhile: skipped
        assert await ctl._reload({}, "s2", {})
        assert total() == 110
        proxy.count = 5
        await ctl.refresh_stats()
        assert total() == 115

    asyncio.run(main())


def test_the_counts_of_a_backend_gone_are_not_kept():
    cfg = load_config(None, env={}, overrides={"node.address": "10.1.1.1", "node.name": "n1"})
    ctl = IngressController("n1", Datastore(["http://127.0.0.1:2379"], "/agentd"), cfg.ingress, ["10.1.1.1"], "/nonexistent")
    kept = Backend("shop", "web", "api", 80)
    assert kept.name == BACKEND
    ctl.table.backends[BACKEND] = kept
    for pr in range(50):  # per-PR Ingresses: each a backend for a while
        gone = Backend("ci", f"pr-{pr}", "app", 80)
        ctl.table.backends[gone.name] = gone
        ctl._last_counts = {(BACKEND, "hrsp_2xx"): 1, (gone.name, "hrsp_2xx"): 1, (gone.name, "req_tot"): 1}
        ctl._fold_counters()  # a reload: its Ingress still there
        del ctl.table.backends[gone.name]  # the PR closed
        ctl._fold_counters()  # the next reload
    assert ctl.counter_base == {(BACKEND, "hrsp_2xx"): 50}
