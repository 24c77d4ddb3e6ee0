"""An HTTP server that says who it is and what it was asked: the Ingress tests' and bench's pods.

``python -m agentd.lab.httpecho NAME PORT [PORT...]`` (inside a pod's namespace) answers every
request with JSON: ``{"pod": NAME, "method", "path" (with the query), "host", "proto",
"headers": {...}}`` and the headers ``Server: httpecho``, ``X-Pod: NAME``; a request for
``/bytes/N`` gets N bytes instead (the bench's fixed-size responses; N up to 64 MiB).  A
WebSocket upgrade (any path) is accepted, and every text message is answered with ``NAME:
message``.  It prints ``ready`` once it listens.  aiohttp serves it: a real HTTP/1.1 server
(keep-alive, chunked bodies, the WebSocket handshake of RFC 6455).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

from aiohttp import WSMsgType, web

from agentd.digits import whole_number

BYTES_MAX = 64 << 20  # the largest /bytes/N answered so; a larger N is echoed as any other path


def _app(name: str) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        headers = {"Server": "httpecho", "X-Pod": name}
        if request.headers.get("Upgrade", "").lower() == "websocket":
            ws = web.WebSocketResponse()
            ws.headers.update(headers)
            await ws.prepare(request)
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    await ws.send_str(f"{name}: {msg.data}")
            return ws
        size = request.path[7:] if request.path.startswith("/bytes/") else ""
        # at most BYTES_MAX: "²" was a 500 (int() refuses it), 10**12 a MemoryError
        count = whole_number(size, len(str(BYTES_MAX)))
        if count is not None and count <= BYTES_MAX:
            return web.Response(body=b"x" * count, headers=headers, content_type="text/plain")
        await request.read()
        body = {"pod": name, "method": request.method, "path": request.path_qs, "host": request.headers.get("Host"),
                "proto": f"HTTP/{request.version.major}.{request.version.minor}", "headers": dict(request.headers)}  # fmt: skip
        return web.json_response(body, headers=headers)

    app = web.Application()
    app.router.add_route("*", r"/{tail:[\s\S]*}", handle)  # every path, one with a newline (%0A) too
    return app


async def _serve(name: str, ports: list[int]) -> None:
    runner = web.AppRunner(_app(name), access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, None, port, backlog=1024).start()  # every address, both families
    print("ready", flush=True)
    await asyncio.Event().wait()


class HttpEcho:
    """One httpecho process in a pod's namespace (``where``: anything with ``.ns``)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, where: Any, name: str, ports: list[int]) -> HttpEcho:
        proc = where.ns.popen([sys.executable, "-m", "agentd.lab.httpecho", name, *map(str, ports)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
        self = cls(proc)
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        if line.strip() != b"ready":
            self.close()
            raise RuntimeError(f"httpecho in {where.ns.name} did not start")
        return self

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], [int(p) for p in sys.argv[2:]]))
