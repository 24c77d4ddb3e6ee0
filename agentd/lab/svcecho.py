"""Servers that say who they are, and a client that counts who answered: Services on the lab.

Run inside a namespace (``python -m agentd.lab.svcecho NAME tcp:8080,udp:5353``; no ports for a
client only), it serves the ports - TCP: every line received is answered with ``NAME\\n`` on
the same connection (so a held connection can be asked again later); UDP: every datagram is
answered with ``NAME`` - and takes requests, one JSON line each, on stdin:

* ``{"tcp": [ip, port], "count": N, "timeout": T}``: N new connections one after another, each
  asked once; answers ``{"names": {name: count}, "failed": k}``;
* ``{"udp": [ip, port], "count": N, "sport": P, "timeout": T}``: N datagrams from ONE socket
  (source port P: one conntrack flow), each waiting for its answer; ``{"names": [name|null...]}``;
* ``{"hold": [ip, port], "id": ID}``: open a connection and keep it; ``{"name": name|null}``;
* ``{"ask": ID, "timeout": T}``: ask a held connection again; ``{"name": name|null}``
  (null: the connection is broken or silent);
* ``{"crr": [ip, port], "seconds": S, "parallel": P}``: TCP_CRR-style: P loops of connect, ask,
  close for S seconds; ``{"connections": n, "failed": k, "seconds": s}`` (bench/services.py);
* ``{"dns": [server, name, type, class], "tcp": bool}``: one DNS query (dnspython; class: IN unless given);
  ``{"rcode": "NOERROR", "answer": ["name ttl IN A 10.96.0.1", ...], "additional": [...], "aa": bool}``.

A ``dns:PORT`` server is a stand-in upstream resolver: it answers every A query with 192.0.2.99.
Servers listen on IPv4 and, where the namespace has IPv6, on IPv6; a client request goes
over the family of the address it names.

:class:`Echo` is the test side: it starts the process in a pod's or node's namespace.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from typing import Any, NoReturn

from agentd.lab.errors import LabError
from agentd.lab.probe import udp_server, wildcards

# How long :class:`Echo`'s tcp/udp/hold/ask wait for an answer unless told otherwise.
ANSWER_TIMEOUT = 5.0


async def _serve(name: str, ports: list[tuple[str, int]]) -> None:
    loop = asyncio.get_running_loop()
    label = name.encode()

    async def on_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readline():
                writer.write(label + b"\n")
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    class Udp(asyncio.DatagramProtocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr: Any) -> None:
            self.transport.sendto(label, addr)

    class Dns(asyncio.DatagramProtocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr: Any) -> None:
            import dns.message
            import dns.rrset

            query = dns.message.from_wire(data)
            response = dns.message.make_response(query)
            response.answer.append(dns.rrset.from_text(query.question[0].name, 30, "IN", "A", "192.0.2.99"))
            self.transport.sendto(response.to_wire(), addr)

    for proto, port in ports:
        for host in wildcards():
            if proto == "tcp":
                await asyncio.start_server(on_tcp, host, port, reuse_address=True)
            elif proto == "dns":
                await loop.create_datagram_endpoint(Dns, sock=udp_server(host, port))
            else:
                await loop.create_datagram_endpoint(Udp, sock=udp_server(host, port))


async def _ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float) -> str | None:
    try:
        writer.write(b"who\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
        return line.decode().strip() or None
    except (OSError, TimeoutError):
        return None


async def _tcp(ip: str, port: int, count: int, timeout: float) -> dict[str, Any]:
    names: dict[str, int] = {}
    failed = 0
    for _ in range(count):
        try:
            async with asyncio.timeout(timeout):  # not wait_for: the connection must not escape a cancel
                reader, writer = await asyncio.open_connection(ip, port)
        except (OSError, TimeoutError):
            failed += 1
            continue
        name = await _ask(reader, writer, timeout)
        writer.close()
        if name is None:
            failed += 1
        else:
            names[name] = names.get(name, 0) + 1
    return {"names": names, "failed": failed}


async def _crr(ip: str, port: int, seconds: float, parallel: int, timeout: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    done = [0, 0]
    start = loop.time()
    end = start + seconds

    async def one_loop() -> None:
        while loop.time() < end:
            try:
                async with asyncio.timeout(timeout):
                    reader, writer = await asyncio.open_connection(ip, port)
                name = await _ask(reader, writer, timeout)
                writer.close()
                done[0 if name else 1] += 1
            except (OSError, TimeoutError):
                done[1] += 1

    await asyncio.gather(*(one_loop() for _ in range(parallel)))
    return {"connections": done[0], "failed": done[1], "seconds": loop.time() - start}


def _udp(ip: str, port: int, count: int, sport: int, timeout: float) -> dict[str, Any]:
    out: list[str | None] = []
    v6 = ":" in ip
    with socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::" if v6 else "0.0.0.0", sport))
        sock.settimeout(timeout)
        for _ in range(count):
            try:
                sock.sendto(b"who", (ip, port))
                data, _ = sock.recvfrom(256)
                out.append(data.decode())
            except OSError:  # timeout, or ICMP unreachable
                out.append(None)
    return {"names": out}


async def _dns_query(server: str, name: str, rdtype: str, rdclass: str = "IN", *, tcp: bool, timeout: float) -> dict[str, Any]:
    import dns.asyncquery
    import dns.exception
    import dns.flags
    import dns.message
    import dns.rcode

    query = dns.message.make_query(name, rdtype, rdclass=rdclass)
    try:
        send = dns.asyncquery.tcp if tcp else dns.asyncquery.udp
        reply = await send(query, server, timeout=timeout)
    except (dns.exception.DNSException, OSError) as err:
        return {"rcode": None, "error": str(err)}
    return {
        "rcode": dns.rcode.to_text(reply.rcode()), "aa": bool(reply.flags & dns.flags.AA),
        "answer": [line for rr in reply.answer for line in rr.to_text().splitlines()],
        "additional": [line for rr in reply.additional for line in rr.to_text().splitlines()],
    }


async def _main(name: str, ports: list[tuple[str, int]]) -> None:
    loop = asyncio.get_running_loop()
    await _serve(name, ports)
    held: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps("ready"), flush=True)
    while line := await reader.readline():
        req = json.loads(line)
        timeout = float(req.get("timeout", 2.0))
        if "dns" in req:
            try:
                result: Any = await _dns_query(*req["dns"], tcp=bool(req.get("tcp")), timeout=timeout)
            except Exception as err:  # noqa: BLE001 - reported to the test, not a dead helper
                result = {"rcode": None, "error": f"{type(err).__name__}: {err}"}
        elif "crr" in req:
            result = await _crr(req["crr"][0], int(req["crr"][1]), float(req["seconds"]), int(req.get("parallel", 4)), timeout)
        elif "tcp" in req:
            result = await _tcp(req["tcp"][0], int(req["tcp"][1]), int(req.get("count", 1)), timeout)
        elif "udp" in req:
            result = await asyncio.to_thread(
                _udp, req["udp"][0], int(req["udp"][1]), int(req.get("count", 1)), int(req["sport"]), timeout
            )
        elif "hold" in req:
            try:
                async with asyncio.timeout(timeout):
                    r, w = await asyncio.open_connection(req["hold"][0], int(req["hold"][1]))
                held[req["id"]] = (r, w)
                result = {"name": await _ask(r, w, timeout)}
            except (OSError, TimeoutError):
                result = {"name": None}
        elif "ask" in req:
            conn = held.get(req["ask"])
            result = {"name": await _ask(*conn, timeout) if conn else None}
        else:
            result = {"error": "unknown request"}
        print(json.dumps(result), flush=True)


class Echo:
    """One svcecho process in a namespace (``where``: anything with ``.ns``).  A request it
    does not answer in time, or a helper that is gone, is a :class:`LabError` (one line in a
    bench, never a traceback); the helper is stopped then, so that its late answer is never
    read as the answer to the next request."""

    def __init__(self, proc: asyncio.subprocess.Process, label: str = "svcecho") -> None:
        self.proc = proc
        self.label = label
        self._lock = asyncio.Lock()
        self._stopped: str | None = None  # why the helper was stopped, once it was

    @classmethod
    async def start(cls, where: Any, name: str, ports: list[tuple[str, int]] = ()) -> Echo:  # type: ignore[assignment]
        spec = ",".join(f"{p}:{n}" for p, n in ports)
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", where.ns.name, sys.executable, "-m", "agentd.lab.svcecho", name, spec,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        self = cls(proc, f"svcecho {name} in {where.ns.name}")
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
        except TimeoutError:
            line = b""
        if json.loads(line or b'""') != "ready":
            await self.close()
            raise LabError(f"{self.label} did not start")
        return self

    async def call(self, req: dict[str, Any], timeout: float = 120.0) -> Any:
        async with self._lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            what = next(iter(req), "request")
            if self._stopped:
                raise LabError(f"{self.label}: no {what} request: the helper was stopped ({self._stopped})")
            try:
                self.proc.stdin.write(json.dumps(req).encode() + b"\n")
                await self.proc.stdin.drain()
                line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
            except TimeoutError:
                await self._stop(f"no answer to a {what} request within {timeout:g} s")
            except OSError as err:  # a helper that is gone: its pipe is broken
                await self._stop(f"it is gone ({err.strerror or err})")
            if not line:
                await self._stop(f"it exited without answering a {what} request")
            return json.loads(line)

    async def _stop(self, why: str) -> NoReturn:
        """Stop the helper (its late answer would be read by the next request) and raise."""
        self._stopped = why
        await self.close()
        raise LabError(f"{self.label}: {why}; the helper is stopped")

    # The default timeouts are for exchanges that must succeed: long enough for a loaded
    # machine (each exchange is tried once).  Where a drop is expected, pass a short one.
    async def tcp(self, ip: str, port: int, count: int = 1, timeout: float = ANSWER_TIMEOUT) -> dict[str, Any]:
        return await self.call({"tcp": [ip, port], "count": count, "timeout": timeout})

    async def udp(self, ip: str, port: int, sport: int, count: int = 1, timeout: float = ANSWER_TIMEOUT) -> list[str | None]:
        return (await self.call({"udp": [ip, port], "count": count, "sport": sport, "timeout": timeout}))["names"]

    async def hold(self, ident: str, ip: str, port: int, timeout: float = ANSWER_TIMEOUT) -> str | None:
        return (await self.call({"hold": [ip, port], "id": ident, "timeout": timeout}))["name"]

    async def ask(self, ident: str, timeout: float = ANSWER_TIMEOUT) -> str | None:
        return (await self.call({"ask": ident, "timeout": timeout}))["name"]

    async def crr(self, ip: str, port: int, seconds: float, parallel: int = 4) -> dict[str, Any]:
        return await self.call({"crr": [ip, port], "seconds": seconds, "parallel": parallel}, timeout=seconds + 60)

    async def dns(self, server: str, name: str, rdtype: str = "A", *, tcp: bool = False, rdclass: str = "IN") -> dict[str, Any]:
        return await self.call({"dns": [server, name, rdtype, rdclass], "tcp": tcp})

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


if __name__ == "__main__":
    ports = [(p.split(":")[0], int(p.split(":")[1])) for p in sys.argv[2].split(",") if p] if len(sys.argv) > 2 else []
    asyncio.run(_main(sys.argv[1], ports))
