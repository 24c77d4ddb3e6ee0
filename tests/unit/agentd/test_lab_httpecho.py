"""The lab's HTTP echo server (agentd/lab/httpecho.py): /bytes/N as the bench asks it, and what
str.isdigit() takes but is no N.  A server in process on 127.0.0.1, an ephemeral port."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from agentd.lab import httpecho


async def test_bytes_n_is_n_ascii_digits_up_to_the_cap_else_an_echo():
    runner = web.AppRunner(httpecho._app("web-1"))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as session:
            for path, size in (("/bytes/64", 64), ("/bytes/0", 0), (f"/bytes/{httpecho.BYTES_MAX}", httpecho.BYTES_MAX)):
                async with session.get(url + path) as resp:
                    assert (resp.status, len(await resp.read())) == (200, size), path
            # "²" was a 500 (int() refuses it), "٣" 3 bytes, 10**12 a MemoryError: echoes now
            for path in ("/bytes/\u00b2", "/bytes/\u0663", "/bytes/1000000000000", f"/bytes/{httpecho.BYTES_MAX + 1}",
                         "/bytes/" + "9" * 5000):
                async with session.get(url + path) as resp:
                    assert resp.status == 200, path[:20]
                    assert (await resp.json())["pod"] == "web-1", path[:20]
    finally:
        await runner.cleanup()
