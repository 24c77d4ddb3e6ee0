"""The controller's settings: the keys of its ConfigMap, parsed and checked.  Pure.

The ConfigMap is ``[ingress] configmap`` (default ``kube-system/agentd-ingress``); its keys
are named as ingress-nginx names them, so an operator finds the ones they know:

==========================  =========  ====================================================
key                         default    what it does
==========================  =========  ====================================================
proxy-connect-timeout       5          seconds to connect to a pod
proxy-read-timeout          60         seconds a pod may be silent during a response
proxy-send-timeout          60         seconds a client may be silent (HAProxy: timeout client)
keep-alive                  75         seconds an idle client connection is kept
proxy-body-size             1m         largest request body by Content-Length (k, m, g; 0: none)
use-http2                   true       offer HTTP/2 (ALPN h2) on the HTTPS port
ssl-redirect                true       plain HTTP to a TLS host gets a 308 to HTTPS
enable-access-log           false      one line per request, where [ingress] access_log says
log-format                  (HAProxy)  HAProxy log-format of those lines
websocket-timeout           3600       seconds an upgraded (WebSocket) connection may idle
frontend-snippet            (none)     extra frontend lines, only header rules (below)
==========================  =========  ====================================================

``frontend-snippet`` takes lines of the forms ``http-request set-header|add-header|del-header
...`` and ``http-response set-header|add-header|del-header ...`` only: they change headers,
nothing else (no ACL-less deny, no Lua, no file paths), so a snippet cannot break routing
or read the node's files.  Routing is a few variables (``txn.key``, ``txn.backend``) the
frontend sets around the snippet, and HAProxy's ``set-var()`` converter inside a header value
would overwrite them: ``set-var``/``unset-var`` are refused, as are maps and files named by
path (``map*()``, ``-f``, ``-M``, ``jwt_verify()``).  A line is checked as written and as
HAProxy's parser reads its words (:func:`as_parsed`: ``"e"nv(`` and ``e\\x6ev(`` are ``env(``
to it).  ``log-format`` (written into the configuration quoted and escaped) refuses the same reads
(``$``, ``env()``, ``map*()``, ``jwt_verify()``, ``lua.*``).  HAProxy then checks the whole
configuration before it is used.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from .validation import Invalid

SNIPPET_DIRECTIVES = (
    ("http-request", "set-header"), ("http-request", "add-header"), ("http-request", "del-header"),
    ("http-response", "set-header"), ("http-response", "add-header"), ("http-response", "del-header"),
)  # fmt: skip
# ASCII digits, so many as a size can have: \d and str.isdigit() take "²" and "٣" (int()
# refuses the one, reads the other as 3), and int() refuses more than 4300 digits.
_SIZE = re.compile(r"([0-9]{1,15})([kKmMgG]?)")
_SECONDS = re.compile(r"([0-9]{1,9})s?")
# Control characters, Lua, files, and the process environment (HAProxy expands "${VAR}" and
# has an env() fetch: a header could carry the agent's secrets to clients, ingress-nginx's
# CVE-2021-25742 class).
_ENV = re.compile(r"\benv\s*\(|\$")
# Lua: a ``lua.*`` fetch or converter (``%[lua.x]``, ``src,lua.x``, ``{ lua.x }``); ``lua-*``
# directives are global ones, no header rule.  Not the letters in a name (X-Evaluation-Id).
# Files: read only through what _REROUTES refuses (a header rule takes no ``file`` argument).
_UNSAFE = re.compile(r"[\x00-\x1f\x7f]|(?<![\w.-])lua\.|/etc/|/proc/|\benv\s*\(|\$")
# Variables (a converter in a header value can overwrite txn.key or txn.backend, which route the
# request), and maps or files read by path: map(), map_str(), ..., ACL -f/-M, jwt_verify().
_REROUTES = re.compile(r"\b(?:un)?set-var(?:-fmt)?\s*\(|\bmap(?:_\w+)?\s*\(|(?<!\S)-[fM](?!\S)|\bjwt_verify\s*\(")
# What in a log-format reads a file or runs code: map(), map_*() and jwt_verify() take a path
# (haproxy -c reads the file, and its ALERT on a bad line quotes the line: a map_ip() of
# /etc/shadow would show its first line in settings_error), lua.* calls Lua.  A log line is
# written after the request is routed, so set-var() there re-routes nothing.
_LOG_READS = re.compile(r"\bmap(?:_\w+)?\s*\(|\bjwt_verify\s*\(|\blua\.")


@dataclass(frozen=True)
class Settings:
    connect_timeout: int = 5
    read_timeout: int = 60
    send_timeout: int = 60
    keep_alive: int = 75
    body_size: int = 1024 * 1024  # bytes; 0: no limit
    http2: bool = True
    ssl_redirect: bool = True
    access_log: bool = False
    log_format: str = ""  # "": HAProxy's HTTP log format
    websocket_timeout: int = 3600
    snippet: tuple[str, ...] = ()


def parse(data: Mapping[str, str] | None, where: str = "data") -> Settings:
    """The settings of ConfigMap ``data``; Invalid naming the key on a bad value.  Unknown
    keys are ignored (ingress-nginx's many other keys may be present)."""
    data = data or {}
    out: dict[str, object] = {}
    for key, attr, lo, hi in (("proxy-connect-timeout", "connect_timeout", 1, 3600),
                              ("proxy-read-timeout", "read_timeout", 1, 86400),
                              ("proxy-send-timeout", "send_timeout", 1, 86400),
                              ("keep-alive", "keep_alive", 0, 86400),
                              ("websocket-timeout", "websocket_timeout", 1, 86400 * 7)):  # fmt: skip
        if key in data:
            out[attr] = _seconds(data[key], f"{where}[{key}]", lo, hi)
    if "proxy-body-size" in data:
        out["body_size"] = _size(data["proxy-body-size"], f"{where}[proxy-body-size]")
    for key, attr in (("use-http2", "http2"), ("ssl-redirect", "ssl_redirect"), ("enable-access-log", "access_log")):
        if key in data:
            out[attr] = _bool(data[key], f"{where}[{key}]")
    if "log-format" in data:
        text = data["log-format"]
        if "\n" in text or not text.isprintable():
            raise Invalid(f"{where}[log-format]", "Invalid value: must be one line of printable text")
        if _ENV.search(text):
            raise Invalid(f"{where}[log-format]", "Invalid value: environment variables ($, env()) are not allowed")
        if _LOG_READS.search(text):
            raise Invalid(f"{where}[log-format]", "Invalid value: maps and files by path (map*, jwt_verify) and Lua "
                                                  "(lua.*) are not allowed")
        out["log_format"] = text
    if "frontend-snippet" in data:
        out["snippet"] = snippet(data["frontend-snippet"], f"{where}[frontend-snippet]")
    return Settings(**out)  # type: ignore[arg-type]


def as_parsed(line: str) -> str:
    """``line`` about as HAProxy's configuration parser reads its words: quotes dropped, so
    ``"e"nv(X)`` is ``env(X)``, and backslash escapes resolved, so ``e\\x6ev(X)`` is too
    (``\\xNN``, ``\\r``, ``\\n``, ``\\t``, any other ``\\c`` as ``c``).  More generous than
    HAProxy (it resolves no escape inside single quotes, and keeps the backslash of most other
    pairs): a check of the line as written and of this refuses all HAProxy could read."""
    out: list[str] = []
    i = 0
    while i < len(line):
        c = line[i]
        if c == "\\" and i + 1 < len(line):
            nxt = line[i + 1]
            hexa = line[i + 2:i + 4]
            if nxt == "x" and len(hexa) == 2 and all(h in "0123456789abcdefABCDEF" for h in hexa):
                out.append(chr(int(hexa, 16)))
                i += 4
                continue
            out.append({"r": "\r", "n": "\n", "t": "\t"}.get(nxt, nxt))
            i += 2
            continue
        if c not in "\"'":
            out.append(c)
        i += 1
    return "".join(out)


def snippet(text: str, where: str) -> tuple[str, ...]:
    lines = []
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        words = line.split()
        if tuple(words[:2]) not in SNIPPET_DIRECTIVES or len(words) < 3:
            allowed = ", ".join(" ".join(d) for d in SNIPPET_DIRECTIVES)
            raise Invalid(where, f"Invalid value: line {n} {line[:60]!r}: only header rules are allowed ({allowed})")
        # As written and as HAProxy reads it: quotes and escapes spell what the checks refuse
        # ("e"nv(X), e\x6ev(X) are env(X) to HAProxy).
        read = (line, as_parsed(line))
        if any(_UNSAFE.search(t) for t in read):
            raise Invalid(where, f"Invalid value: line {n} {line[:60]!r}: control characters, Lua, file paths and "
                                 "environment variables ($, env()) are not allowed")
        if any(_REROUTES.search(t) for t in read):
            raise Invalid(where, f"Invalid value: line {n} {line[:60]!r}: variables (set-var, unset-var: they could "
                                 "re-route requests), maps and files by path (map*, -f, -M, jwt_verify) are not allowed")
        lines.append(line)
    return tuple(lines)


def _seconds(text: str, where: str, lo: int, hi: int) -> int:
    m = _SECONDS.fullmatch(text.strip())  # "10" or "10s"
    if m is None or not lo <= int(m.group(1)) <= hi:
        raise Invalid(where, f"Invalid value: {_quote(text)}: must be a whole number of seconds, {lo}..{hi}")
    return int(m.group(1))


def _size(text: str, where: str) -> int:
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise Invalid(where, f"Invalid value: {_quote(text)}: must be a size such as 1m, 512k or 0 (no limit)")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]


def _bool(text: str, where: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise Invalid(where, f'Invalid value: {_quote(text)}: must be "true" or "false"')
    return value == "true"


def _quote(text: str) -> str:
    """``text`` quoted for a message, cut to a readable length (a value may be megabytes)."""
    return repr(text if len(text) <= 40 else text[:37] + "...")
