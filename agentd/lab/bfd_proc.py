"""A :class:`~bgp.bfd_transport.BfdService` alone in a process, for the interop tests.

``python -m agentd.lab.bfd_proc --listen 10.0.0.1 --peer 10.0.0.2 --tx 0.1 --rx 0.1 --mult 3``
runs the service on uvloop inside whatever namespace it was started in, logs every state
change, and serves on ``--api`` (default 127.0.0.1:9098, inside that namespace):

    GET  /status               {"sessions": [...BfdService.status()], "events": [...], "unknown_packets": N, ...}
    POST /remove?peer=ADDR     BfdService.remove(ADDR)
    POST /add?peer=ADDR[&local=ADDR]   BfdService.add(...) with the process's settings

Each event is ``{"t": <time.monotonic() at the change>, "peer", "old", "state", "diag",
"cause", "failure"}``.  CLOCK_MONOTONIC is one clock for every process on the host, so a
test compares ``t`` with its own ``time.monotonic()``.

:class:`BfdProcess` starts and queries it from a test::

    bfd = BfdProcess(ns, tmp_path / "bfd", listen="10.0.0.1", peers=["10.0.0.2"], tx=0.1, rx=0.1, mult=3)
    bfd.start()
    bfd.wait_state("10.0.0.2", "Up")
    bfd.session("10.0.0.2")["detection_time"]
    bfd.remove("10.0.0.2")
    bfd.stop()
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path
from typing import Any

from agentd.lab.netns import Netns
from agentd.lab.process import LabProcess

DEFAULT_API = "127.0.0.1:9098"
START_TIMEOUT = 15.0


class BfdProcessError(RuntimeError):
    """The process could not be started or queried, or a wait timed out; carries its log tail."""


# ---------------------------------------------------------------- the process itself


async def _serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    from bgp.bfd import BfdSettings
    from bgp.bfd_transport import BfdService

    events: list[dict] = []
    settings = BfdSettings(desired_min_tx=args.tx, required_min_rx=args.rx, detect_mult=args.mult)

    def changed(peer, change) -> None:
        events.append({"t": time.monotonic(), "peer": peer, "old": change.old.label, "state": change.state.label,
                       "diag": int(change.diag), "cause": change.cause.value, "failure": change.failure})

    service = BfdService(listen=args.listen, on_change=changed)
    await service.start()
    for peer in args.peer:
        service.add(peer, args.local, settings)

    async def status(_request: web.Request) -> web.Response:
        return web.json_response({
            "sessions": service.status(), "events": events, "unknown_packets": service.unknown_packets,
            "bad_packets": service.bad_packets, "internal_errors": service.internal_errors,
            "listen": service.listen_addresses, "now": time.monotonic(),
        })

    async def remove(request: web.Request) -> web.Response:
        service.remove(request.query["peer"])
        return web.json_response({"ok": True})

    async def add(request: web.Request) -> web.Response:
        service.add(request.query["peer"], request.query.get("local", args.local), settings)
        return web.json_response({"ok": True})

    app = web.Application()
    app.add_routes([web.get("/status", status), web.post("/remove", remove), web.post("/add", add)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = args.api.rsplit(":", 1)
    await web.TCPSite(runner, host, int(port)).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    logging.getLogger("bgp.bfd").info("serving on %s", args.api)
    await stop.wait()
    await service.stop()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentd.lab.bfd_proc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default=None, help="address for UDP 3784 (default 0.0.0.0 and ::)")
    parser.add_argument("--peer", action="append", default=[], help="neighbour address (repeatable)")
    parser.add_argument("--local", default=None, help="local address of the sessions")
    parser.add_argument("--tx", type=float, default=0.3, help="desired min tx interval, seconds")
    parser.add_argument("--rx", type=float, default=0.3, help="required min rx interval, seconds")
    parser.add_argument("--mult", type=int, default=3, help="detect multiplier")
    parser.add_argument("--api", default=DEFAULT_API, help="HOST:PORT of the status API")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stdout)
    import uvloop

    try:
        uvloop.run(_serve(args))
    except (OSError, ValueError) as err:
        print(f"bfd_proc: {err}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------- the test-side handle


class BfdProcess(LabProcess):
    """One ``python -m agentd.lab.bfd_proc`` in ``ns``; ``start()``, ``stop()``; restartable."""

    label = "bfd_proc"
    error = BfdProcessError

    def __init__(self, ns: Netns, workdir: str | os.PathLike[str], *, listen: str | None, peers: list[str],
                 local: str | None = None, tx: float = 0.3, rx: float = 0.3, mult: int = 3,
                 api: str = DEFAULT_API) -> None:
        self.workdir = Path(workdir)
        super().__init__(ns, self.workdir / "bfd.log")
        self.api = api
        self.argv = [sys.executable, "-m", "agentd.lab.bfd_proc", "--api", api, "--tx", str(tx), "--rx", str(rx),
                     "--mult", str(mult)]
        if listen:
            self.argv += ["--listen", listen]
        if local:
            self.argv += ["--local", local]
        for peer in peers:
            self.argv += ["--peer", peer]

    def start(self, timeout: float = START_TIMEOUT) -> None:
        if self.running:
            return
        self.spawn(self.argv)
        self.wait_until(lambda: self.status(timeout=1.0), timeout, what="the BFD process's API")

    # ------------------------------------------------------------ queries and commands

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        return self.ns.http_json(f"http://{self.api}/status", timeout)

    def session(self, peer: str) -> dict[str, Any] | None:
        return next((s for s in self.status()["sessions"] if s["peer"] == peer), None)

    def events(self, peer: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.status()["events"] if peer is None or e["peer"] == peer]

    def remove(self, peer: str) -> None:
        self._post(f"/remove?peer={peer}")

    def add(self, peer: str) -> None:
        self._post(f"/add?peer={peer}")

    def wait_state(self, peer: str, state: str, timeout: float = 20.0) -> dict[str, Any]:
        return self.wait_until(lambda: (s := self.session(peer)) is not None and s["state"] == state and s, timeout,
                               what=lambda: f"BFD session to {peer} {state} (now {self.session(peer)})")

    def wait_until(self, predicate: Callable[[], Any], timeout: float, *, what: str | Callable[[], str] = "condition",
                   interval: float = 0.05, ignore: tuple[type[BaseException], ...] = (OSError, ValueError, IndexError)) -> Any:
        """Poll ``predicate`` until truthy (the API not answering yet is "not yet"); BfdProcessError,
        with the log, on timeout or when the process exits."""
        return super().wait_until(predicate, timeout, what=what, interval=interval, ignore=ignore)

    def _post(self, path: str) -> None:
        host, port = self.api.rsplit(":", 1)
        with self.ns.connect(host, int(port)) as sock:
            sock.sendall(f"POST {path} HTTP/1.0\r\nHost: {host}\r\nContent-Length: 0\r\n\r\n".encode())
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        head = reply.split(b"\r\n", 1)[0]
        if b" 200 " not in head:
            raise BfdProcessError(f"POST {path}: {reply.decode(errors='replace')}")


# ---------------------------------------------------------------- on the wire


ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
PACKET_OUTGOING = 4
_UDP = struct.Struct("!HHHH")


@dataclass(frozen=True)
class Captured:
    """One BFD Control datagram seen on an interface (either direction)."""

    t: float  # time.monotonic() when read
    src: str
    dst: str
    ttl: int  # TTL or Hop Limit
    tos: int  # TOS or Traffic Class
    sport: int
    dport: int
    payload: bytes
    outgoing: bool

    def decode(self):
        from proto.bfd import ControlPacket

        return ControlPacket.decode(self.payload)


class BfdSniffer:
    """Records every UDP datagram to or from port ``port`` on ``ifname`` inside ``ns``
    (an AF_PACKET socket read by a thread), for looking at BFD on the wire::

        with BfdSniffer(r2, "eth0") as wire:
            ...
        wire.packets                   # [Captured, ...]
    """

    def __init__(self, ns: Netns, ifname: str, port: int = 3784) -> None:
        self.ns, self.ifname, self.port = ns, ifname, port
        self.packets: list[Captured] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._sock: socket.socket | None = None

    def __enter__(self) -> BfdSniffer:
        with self.ns.entered():
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_ALL))
        sock.bind((self.ifname, ETH_P_ALL))
        sock.settimeout(0.1)
        self._sock = sock
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._sock is not None:
            self._sock.close()

    def from_address(self, src: str) -> list[Captured]:
        return [p for p in list(self.packets) if p.src == src]

    def _run(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                data, addr = self._sock.recvfrom(2048)
            except TimeoutError:
                continue
            except OSError:
                return
            got = _parse(data, addr[1])
            if got is None:
                continue
            src, dst, ttl, tos, udp = got
            if len(udp) < 8:
                continue
            sport, dport, _, _ = _UDP.unpack_from(udp)
            if self.port in (sport, dport):
                self.packets.append(Captured(time.monotonic(), src, dst, ttl, tos, sport, dport, bytes(udp[8:]),
                                             addr[2] == PACKET_OUTGOING))


def _parse(data: bytes, proto: int):
    if proto == ETH_P_IP and len(data) >= 20 and data[9] == 17:
        ihl = (data[0] & 0x0F) * 4
        return str(ip_address(data[12:16])), str(ip_address(data[16:20])), data[8], data[1], data[ihl:]
    if proto == ETH_P_IPV6 and len(data) >= 40 and data[6] == 17:
        tclass = ((data[0] & 0x0F) << 4) | (data[1] >> 4)
        return str(ip_address(data[8:24])), str(ip_address(data[24:40])), data[7], tclass, data[40:]
    return None


def send_udp(ns: Netns, src: str, dst: str, payload: bytes, *, ttl: int, port: int = 3784) -> None:
    """Send one UDP datagram from ``src`` (an address in ``ns``) with the given TTL / Hop Limit."""
    v6 = ":" in dst
    with ns.entered():
        sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
    with sock:
        if v6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, ttl)
        else:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, ttl)
        sock.bind((src, 0))
        sock.sendto(payload, (dst, port))


if __name__ == "__main__":
    sys.exit(main())
