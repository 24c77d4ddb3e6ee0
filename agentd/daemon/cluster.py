"""The cluster view: how one agent shows every node (``/ui/``, ``GET /cluster``,
``agentd flows --cluster``).

Each agent serves its own GET endpoints a second time on a **read-only listener**, on its
node's address at ``[api] cluster_port`` (9098), where only other agents come: no POST, no
``/ui/``, and no relay (``GET /flows`` there is that node's own records, whatever the
filter), and every request must carry the **cluster read token** (``Authorization: Bearer
<token>``; 401 without it, compared in constant time by :func:`agentd.daemon.auth.read_guard`).
The token is ``[api] read_token_file``, or else the one the agents keep in etcd
(``<prefix>/cluster/read-token``, made by the first agent that starts: whoever can read etcd
has the cluster anyway); agents follow that key, so a token deleted there is replaced by a
new one on every node (agentd/daemon/observe.py).

The agent a person talks to (its loopback API: the browser, ``agentd flows``) gathers from the
others over the underlay with that token -- the nodes it knows from the node registry in
etcd, each at its ``[node] address`` and the same ``cluster_port`` -- and relays: the token
never reaches the browser, and mutating endpoints stay on loopback (and behind their own
credential).  A node that does not answer a gathered GET within ``TIMEOUT`` (a followed
stream: ``FOLLOW_IDLE`` without a byte, keep-alives included) is shown as unreachable with
the reason; nothing is cached, so every answer is the nodes' own data at that moment.
The token goes only to the address a node registered on the underlay (its record's
``address``, IPv6 in an IPv6-only cluster): never to a loopback, link-local, unspecified,
multicast or reserved address (:func:`unsafe_address`) -- a node record naming one is shown as
unreachable with that reason, and nothing is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from ipaddress import IPv6Address, ip_address
from typing import Any

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

log = logging.getLogger("agentd.cluster")

TIMEOUT = 3.0  # seconds a node has to answer a gathered GET (to connect, and between two reads)
GATHER_TOTAL = 60.0  # seconds a gathered answer may take in all (the last 100,000 records of a node)
RELAY_MAX = 64 << 20  # bytes of one node's answer a gathering node holds (a large /rib: ask that node itself)
ERROR_BODY_MAX = 4096  # bytes of a streamed answer that is not 200 read for its error (NodeAnswered)
KEEPALIVE = 10.0  # seconds between empty lines on a quiet followed stream (proxies close idle ones)
FOLLOW_IDLE = 2.5 * KEEPALIVE  # seconds without a byte after which a followed node counts as gone
IDLE_KEPT = 10.0  # seconds an idle connection to another node is kept for the next GET
LINE_MAX = 1 << 20  # bytes of one NDJSON line of a node's streamed answer read; a longer one is skipped
RELAYED = ("status", "peers", "routes", "policy", "services", "flows", "rib", "metrics", "healthz", "readyz")


def unsafe_address(address: str) -> str | None:
    """Why the read token must not be sent to ``address`` (a node record's), or None: it is
    no underlay address of another host (loopback, link-local, unspecified, multicast
    or reserved (240.0.0.0/4, the broadcast address among them); an IPv4-mapped IPv6 address is judged as its IPv4 one) or no IP
    address at all."""
    try:
        a = ip_address(address)
    except ValueError:
        return f"{address!r} is not an IP address"
    if isinstance(a, IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    for kind in ("loopback", "link_local", "unspecified", "multicast", "reserved"):
        if getattr(a, f"is_{kind}"):
            return f"its address {address} is {kind.replace('_', '-')}"
    return None


class NodeAnswered(OSError):
    """A node answered, but not 200: ``status`` and what it said."""

    def __init__(self, node: str, status: int, body: bytes) -> None:
        super().__init__(f"{node} answered {status}: {body[:200].decode(errors='replace').strip()}")
        self.status = status


#: Header of a followed ``GET /flows`` answer whose last N end with an empty line (a node of
#: an older agentd sends none: its last N and its followed records cannot be told apart).
LAST_END = "X-Agentd-Last-End"
#: Header of a followed ``GET /flows`` answer: ``ID:SEQ``, the node's ring and the number of its
#: last record before the follow began.  A stream that breaks is asked again ``after`` the
#: last record it sent (or this), so no record of the gap is lost or comes twice.
RING = "X-Agentd-Ring"


class UnmarkedStream(OSError):
    """A followed answer without :data:`LAST_END` (an older agentd): ask it the older way."""


class ClusterView:
    """Gathers from the other nodes' read-only listeners (the local node answers itself)."""

    def __init__(self, me: str, nodes: Callable[[], dict[str, str]], port: int, *,
                 follow_idle: float = FOLLOW_IDLE) -> None:
        """``nodes()``: node name -> underlay address, as the registry in etcd says now."""
        self.me = me
        self.nodes = nodes
        self.port = port
        self.follow_idle = follow_idle
        self.token: str | None = None  # may change while running (observe.py follows etcd)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No pool limit: followed streams hold a connection per node each (at most
            # MAX_FOLLOWERS of them), and a gathered GET must never wait behind them -- its
            # deadlines are the connection's and the reads', not the pool's.
            # An idle connection is closed here before the other node's listener closes it (15 s,
            # agentd/daemon/api.py), so a GET never goes out on one being closed under it.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_KEPT))
        return self._session

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def url(self, node: str, path: str) -> str:
        address = self.nodes().get(node)
        if address is None:
            raise KeyError(node)
        why = unsafe_address(address)
        if why is not None:  # a node record's word: the token is not sent there
            raise OSError(f"{node} not asked: {why}, not a node's underlay address")
        host = f"[{address}]" if ":" in address else address
        return f"http://{host}:{self.port}{path}"

    def _check(self) -> None:
        if not self.port or self.token is None:
            raise OSError("the cluster listener is off ([api] cluster_port = 0) or no read token yet")

    async def get(self, node: str, path: str) -> tuple[int, str, bytes]:
        """One node's answer to ``GET path`` as it is: (status, content type, body); raises
        OSError (unreachable, too slow, more than RELAY_MAX bytes; a redirect, never followed:
        :class:`NodeAnswered`) or KeyError (no such node).
        ``TIMEOUT`` to connect and between two reads, ``GATHER_TOTAL`` in all."""
        self._check()
        timeout = aiohttp.ClientTimeout(total=GATHER_TOTAL, sock_connect=TIMEOUT, sock_read=TIMEOUT)
        url = self.url(node, path)  # first: an address the token must not go to raises before any connection
        try:
            async with self._client().get(url, headers=self._headers(), timeout=timeout,
                                          allow_redirects=False) as resp:
                if 300 <= resp.status < 400:  # followed, it would relay another host's answer as this node's
                    raise NodeAnswered(node, resp.status, _redirect(resp))
                body = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > RELAY_MAX:
                        raise OSError(f"{node} answered more than {RELAY_MAX >> 20} MB: ask it directly")
                return resp.status, resp.headers.get("Content-Type", "application/octet-stream"), bytes(body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise OSError(f"{node} unreachable: {type(err).__name__} {err}".strip()) from None

    async def get_json(self, node: str, path: str) -> Any:
        """One node's JSON answer to ``GET path`` (raises OSError/ValueError/KeyError with the
        reason: JSON nested too deep to read is a ValueError too, as one node's error)."""
        status, _, body = await self.get(node, path)
        if status != 200:
            raise NodeAnswered(node, status, body)
        try:
            return json.loads(body)
        except RecursionError:  # (json.loads raises it, not ValueError, past Python's recursion limit)
            raise ValueError(f"{node} answered JSON nested too deep to read") from None

    async def lines(self, node: str, path: str, *, follow: bool = False, blanks: bool = False,
                    seen: dict[str, str] | None = None) -> AsyncIterator[bytes]:
        """The NDJSON lines of one node's streamed answer (``GET /flows``).  A gathered answer
        must keep coming (``TIMEOUT`` between reads, ``GATHER_TOTAL`` in all); a followed one
        (``follow``) may be quiet, but not for ``follow_idle`` (its keep-alives count).  Empty
        lines (keep-alives, the end of a followed stream's last N) only with ``blanks``; a followed
        answer asked so that does not say it ends its last N so raises :class:`UnmarkedStream`.
        ``seen``: given the answer's :data:`RING` header, if it has one, before its first line.
        A line longer than :data:`LINE_MAX` is not read (nor held): in its place comes a line
        saying one record was lost, with the record's ``seq`` and the node -- the stream goes
        on past it, and a resume asks after it (a record an older agentd made of a pod with a
        thousand labels was a MB: the stream broke on it and was asked for it again, forever)."""
        self._check()
        if follow:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=TIMEOUT, sock_read=self.follow_idle)
        else:
            timeout = aiohttp.ClientTimeout(total=GATHER_TOTAL, sock_connect=TIMEOUT, sock_read=TIMEOUT)
        url = self.url(node, path)
        try:
            async with self._client().get(url, headers=self._headers(), timeout=timeout,
                                          allow_redirects=False) as resp:
                if 300 <= resp.status < 400:
                    raise NodeAnswered(node, resp.status, _redirect(resp))
                if resp.status != 200:
                    raise NodeAnswered(node, resp.status, await _error_body(resp))
                if blanks and follow and resp.headers.get(LAST_END) != "empty-line":
                    raise UnmarkedStream(f"{node} does not end its last records with an empty line")
                if seen is not None and RING in resp.headers:
                    seen[RING] = resp.headers[RING]
                async for line in _lines(resp.content, node):
                    if blanks or line.strip():
                        yield line
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            what = f"nothing for {self.follow_idle:g}s" if follow and isinstance(err, asyncio.TimeoutError) else \
                f"{type(err).__name__} {err}".strip()
            raise OSError(f"{node} unreachable: {what}") from None
        except HttpProcessingError as err:  # a line past aiohttp's limit (LineTooLong), a broken chunk
            raise OSError(f"{node} answered what cannot be read: {type(err).__name__} {err.message}".strip()) from None

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
                answer = await self.get_json(name, path)
                if not isinstance(answer, dict):  # every gathered endpoint answers an object
                    return name, {"error": f"{name} did not answer with a JSON object"}
                return name, answer
            except (OSError, ValueError, KeyError) as err:
                return name, {"error": str(err) if not isinstance(err, KeyError) else f"no node {name} in etcd"}

        return dict(await asyncio.gather(*(one(n) for n in names)))


_SEQ = re.compile(rb'\{\s*"seq"\s*:\s*(\d{1,20})\s*,')


def _skipped(node: str, head: bytes) -> bytes:
    """The line that stands for a record too long to read (``head``: its start): one record
    lost, numbered as it was (a ``{"seq": ...`` record first, as :meth:`Flow.json` sends it)."""
    why = f"a record of more than {LINE_MAX} bytes, not read"
    number = _SEQ.match(head)
    if number is None:
        return (json.dumps({"lost": 1, "why": why, "node": node}, separators=(",", ":")) + "\n").encode()
    return (json.dumps({"seq": int(number[1]), "node": node, "lost": 1, "why": why}, separators=(",", ":")) + "\n").encode()


async def _lines(content: aiohttp.StreamReader, node: str) -> AsyncIterator[bytes]:
    """The lines of a streamed answer, each with its newline (the last one without, if the
    answer ends in the middle of it); one longer than ``LINE_MAX`` as :func:`_skipped` says it:
    at most ``LINE_MAX`` bytes held, however long a line."""
    held = bytearray()
    head: bytes | None = None  # a line past LINE_MAX is being skipped: its start
    async for chunk in content.iter_any():
        start = 0
        while start < len(chunk):
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start : end + 1]
            start = len(chunk) if end < 0 else end + 1
            if head is None:
                if len(held) + len(piece) > LINE_MAX + (end >= 0):  # its newline not counted
                    head = bytes((held + piece)[:64])
                    held.clear()
                else:
                    held += piece
            if end < 0:
                break
            if head is not None:
                yield _skipped(node, head)
                head = None
            else:
                yield bytes(held)
                held.clear()
    if head is not None:
        yield _skipped(node, head)
    elif held:
        yield bytes(held)


async def _error_body(resp: aiohttp.ClientResponse) -> bytes:
    """The start of an answer that is not 200 (what :class:`NodeAnswered` says): at most
    ``ERROR_BODY_MAX`` bytes, read for at most ``TIMEOUT`` seconds -- a followed request has no
    total deadline, and a node's endless error answer must not fill this agent's memory."""
    body = bytearray()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(TIMEOUT):
            while len(body) < ERROR_BODY_MAX:
                chunk = await resp.content.read(ERROR_BODY_MAX - len(body))
                if not chunk:
                    break
                body += chunk
    return bytes(body)


def _redirect(resp: aiohttp.ClientResponse) -> bytes:
    return f"a redirect to {resp.headers.get('Location')!r}, not followed".encode()
