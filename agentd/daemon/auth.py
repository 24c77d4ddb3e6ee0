"""Who may use the agent's REST API.

Reading the loopback API is open (``GET /status``, ``/metrics``, ...: what ``agentd status`` and
Prometheus ask).  A request that changes something -- any method but GET, HEAD and
OPTIONS; today ``POST /leave``, which decommissions the node -- must come from this host
(a loopback address) and carry ``Authorization: Bearer <token>`` (RFC 6750 2.1), the token
that ``agentd run`` writes at every start into ``[api] token_file`` (default
/run/agentd/api.token): mode 0600, so only root (the agent's user) reads it, or 0640 with
``[api] token_group`` as its group.  A local process that cannot read that file cannot take
the node out of the cluster, whatever port it can reach -- the same rule as kubelet's or
containerd's root-only sockets, with a file instead of a socket so that the API stays the
one TCP listener it is.

The file is replaced atomically (a new file renamed over the old one), so a reader sees the
old token or the new one, never a half-written one; an agent removes it when it stops, if it
still holds its own token.

What this agent gathers from the other nodes (``GET /cluster``, ``/nodes/NODE/...`` of
another node, ``/flows?cluster=1``: the cluster view) needs a credential too, since the
cluster read token guards the same data on the other nodes (:func:`may_read_cluster`): the
API token, or the browser view's key derived from it (:func:`ui_key`; ``agentd ui`` prints
the address with it), which reads and never changes anything.  What this node alone knows
stays open to this host, as ``/status`` and ``/metrics`` are.

Every request to the loopback API must name it in its Host header (:func:`host_guard`): an
address, ``localhost`` or the ``[api] listen`` host.  A web page of another site that has its
own name resolve to 127.0.0.1 (DNS rebinding) sends that name, and is refused.

The read-only cluster listener (:mod:`agentd.daemon.cluster`: the node's address, ``[api]
cluster_port``) is the other door: GET and HEAD only, each with the cluster read token
(:func:`read_guard`); it changes nothing, so the API token never leaves loopback.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import grp
import hmac
import ipaddress
import os
import secrets
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentd.config.settings import read_token_problem

if TYPE_CHECKING:  # aiohttp only where the API runs: `agentd leave` reads the token without it
    from aiohttp import web

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # RFC 9110 9.2.1: they change nothing
TOKEN_BYTES = 32  # 256 bits from the OS's CSPRNG (secrets.token_urlsafe)
REALM = "agentd"
CLUSTER_REALM = "agentd-cluster"


class TokenFileError(RuntimeError):
    """The token file cannot be written (at start) or read (by a command); one clear line."""


def write_token_file(path: Path, group: str | None = None) -> str:
    """A new token in ``path``: mode 0600, or 0640 owned by ``group``; returns the token.

    The group change needs no CAP_CHOWN when the agent is a member of the group (under
    systemd: ``SupplementaryGroups=`` in a drop-in); root outside the unit can always do it."""
    gid = _group_id(group) if group else None
    token = new_token()
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as err:
        raise TokenFileError(f"cannot create {path.parent} for the API token: {err.strerror or err}") from None
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with contextlib.suppress(FileNotFoundError):  # left by an agent that died here, with our pid
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask: nobody else reads it before the group is set
            if gid is not None:
                os.fchown(fd, -1, gid)
                os.fchmod(fd, 0o640)
            os.write(fd, (token + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if gid is not None and err.errno == errno.EPERM:
            raise TokenFileError(
                f"cannot give the API token {path} to group {group}: {err.strerror} "
                "(the agent must be a member of that group, or have CAP_CHOWN)"
            ) from None
        raise TokenFileError(f"cannot write the API token {path}: {err.strerror or err}") from None
    return token


def _group_id(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise TokenFileError(f"[api] token_group: no group named {group!r} on this host") from None


TOKEN_FILE_MAX = 4096  # bytes of [api] token_file read: the agent writes one line of 43 characters


def _nonblocking(path: str | bytes, flags: int) -> int:
    """``open``'s opener that never waits: a FIFO is opened (and then refused by its type) instead
    of blocking until someone writes to it."""
    return os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)


def _read_small_file(path: str | Path, limit: int) -> bytes:
    """At most ``limit`` + 1 bytes of ``path``, a regular file: the same guard as the
    configuration file's (agentd.config.settings): /dev/zero would be read until memory ran
    out, a FIFO would block for ever.  :class:`OSError` (``EINVAL`` for another kind of file)."""
    with open(path, "rb", opener=_nonblocking) as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return file.read(limit + 1)


def read_token_file(path: Path) -> str:
    """The token in ``path``, or :class:`TokenFileError` saying why it cannot be had."""
    try:
        data = _read_small_file(path, TOKEN_FILE_MAX)
        if len(data) > TOKEN_FILE_MAX:
            raise TokenFileError(f"cannot read the API token {path}: over {TOKEN_FILE_MAX} bytes, not a token the agent wrote")
        token = data.decode("ascii").strip()
    except PermissionError:
        raise TokenFileError(
            f"cannot read the API token {path}: permission denied (run as root, or as a member of [api] token_group)"
        ) from None
    except FileNotFoundError:
        raise TokenFileError(f"no API token at {path}: is the agent running with this configuration ([api] token_file)?") from None
    except (OSError, UnicodeDecodeError) as err:
        raise TokenFileError(f"cannot read the API token {path}: {getattr(err, 'strerror', None) or err}") from None
    if not token:
        raise TokenFileError(f"the API token file {path} is empty")
    return token


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


READ_TOKEN_MAX = 4096  # bytes of [api] read_token_file read (one line: a token)


def read_line_token(path: str | Path) -> str:
    """The cluster read token of ``[api] read_token_file``: one non-empty line, in a file
    only its owner (root, or the agent's user) may read (:func:`agentd.config.settings.read_token_problem`: refused
    otherwise, with :class:`TokenFileError` saying why)."""
    # Not blocking on a FIFO; the checks are of what was opened (a symlink's target).
    with open(path, "rb", opener=_nonblocking) as file:
        problem = read_token_problem(os.fstat(file.fileno()), path)
        if problem is not None:
            raise TokenFileError(problem)
        data = file.read(READ_TOKEN_MAX + 1)
    try:
        token = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: the read token is not UTF-8 text") from None
    if not token or "\n" in token or len(data) > READ_TOKEN_MAX:
        raise ValueError(f"{path}: the read token must be one non-empty line")
    return token


def remove_token_file(path: Path, token: str) -> None:
    """Remove ``path`` if it still holds ``token`` (a newer agent's file stays)."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if _read_small_file(path, TOKEN_FILE_MAX).decode("ascii").strip() == token:
            path.unlink()


def bearer_header(token: str) -> dict[str, str]:
    """The request header a client sends (RFC 6750 2.1)."""
    return {"Authorization": f"Bearer {token}"}


def is_loopback(remote: str | None) -> bool:
    """127.0.0.0/8 or ::1; also 127.x as a dual-stack socket ("::" listen) shows it, ::ffff:127.x."""
    try:
        addr = ipaddress.ip_address((remote or "").split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def from_this_host(request: Any) -> bool:
    """The request came from this host: over loopback, or from one of this host's own
    addresses to itself (``[api] listen`` on the node's address: the CLI's connection then has
    that address at both ends -- which no other host can give a TCP connection)."""
    if is_loopback(request.remote):
        return True
    transport = request.transport
    local = transport.get_extra_info("sockname") if transport is not None else None
    if not local or not request.remote:
        return False
    try:
        ours = ipaddress.ip_address(str(local[0]).split("%", 1)[0])
        theirs = ipaddress.ip_address(request.remote.split("%", 1)[0])
    except ValueError:
        return False
    return ours == theirs


Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]


def guard(token_of: Callable[[], str | None]) -> Any:
    """An aiohttp middleware: requests that change something need this host and the token
    ``token_of()`` gives (None: this process accepts no changes at all)."""
    from aiohttp import web

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method in SAFE_METHODS:
            return await handler(request)
        if not from_this_host(request):
            return _refuse(403, f"{request.method} {request.path} is only accepted from this host")
        token = token_of()
        if token is None:
            return _refuse(403, "this process accepts no changes over its API")
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            return _refuse(401, "this request needs the API token ([api] token_file) as Authorization: Bearer")
        if not hmac.compare_digest(_octets(given), token.encode()):
            return _refuse(401, "wrong API token ([api] token_file holds the running agent's)", error="invalid_token")
        return await handler(request)

    return middleware


def _octets(presented: str) -> bytes:
    """A presented credential as the octets that came: aiohttp decodes header values as UTF-8
    with surrogateescape, so a header that is not UTF-8 gets its own bytes back (and is simply
    wrong) rather than failing to encode."""
    return presented.strip().encode("utf-8", "surrogateescape")


UI_KEY_PURPOSE = b"agentd ui: read the cluster through this agent"


def ui_key(token: str) -> str:
    """The browser view's key: HMAC-SHA256 of a fixed purpose under this run's API token --
    it changes with the token, and does not give the token away (it cannot POST)."""
    digest = hmac.new(token.encode(), UI_KEY_PURPOSE, "sha256").digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def may_read_cluster(authorization: str, token: str | None) -> bool:
    """``Authorization: Bearer`` with the API token or its :func:`ui_key` (a process that runs
    no agent -- ``agentd speaker`` -- gathers nothing)."""
    scheme, _, given = authorization.partition(" ")
    if token is None or scheme.lower() != "bearer" or not given.strip():
        return False
    presented = _octets(given)
    # Both compared, in constant time each, whichever matches.
    as_token = hmac.compare_digest(presented, token.encode())
    as_key = hmac.compare_digest(presented, ui_key(token).encode())
    return as_token or as_key


def refuse_cluster_read() -> web.Response:
    return _refuse(401, "the cluster view needs the API token ([api] token_file) or the browser view's key "
                        "(agentd ui prints the address with it) as Authorization: Bearer")


def allowed_host(host: str | None, listen_host: str) -> bool:
    """The Host header names this API: an address (what no rebinding page can be served
    from), ``localhost``, or the ``[api] listen`` host; a request without one (HTTP/1.0) too."""
    if host is None:
        return True
    name = host.strip()
    if name.startswith("["):  # [v6]:port
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:  # name:port
        name = name.partition(":")[0]
    name = name.rstrip(".").lower()
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return name == "localhost" or name == listen_host.strip("[]").rstrip(".").lower()


def host_guard(listen_host: str) -> Any:
    """An aiohttp middleware: every request names this API in its Host (:func:`allowed_host`),
    421 Misdirected Request otherwise (RFC 9110 15.5.20), before anything is read or done."""
    from aiohttp import web

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if not allowed_host(host, listen_host):
            return web.json_response({"error": f"Host {host!r} is not this API: ask it by address or as localhost"},
                                     status=421)
        return await handler(request)

    return middleware


def read_guard(token_of: Callable[[], str | None]) -> Any:
    """An aiohttp middleware for the read-only cluster listener: GET and HEAD only (405
    otherwise), each with the cluster read token ``token_of()`` gives (401 without it; None:
    not known yet, so nobody is let in).  A refused request's connection is closed after the
    answer: a client without the token holds no connection of the listener's."""
    from aiohttp import web

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            refused = web.json_response({"error": "this listener is read-only"}, status=405)
        else:
            token = token_of()
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if token is not None and scheme.lower() == "bearer" and hmac.compare_digest(_octets(given), token.encode()):
                return await handler(request)
            refused = _refuse(401, "the cluster read token is required", realm=CLUSTER_REALM)
        refused.force_close()  # Connection: close, then closed
        return refused

    return middleware


def _refuse(status: int, message: str, *, error: str | None = None, realm: str = REALM) -> web.Response:
    from aiohttp import web

    headers = {}
    if status == 401:  # RFC 6750 3: the challenge a client needs to authenticate
        headers["WWW-Authenticate"] = f'Bearer realm="{realm}"' + (f', error="{error}"' if error else "")
    return web.json_response({"error": message}, status=status, headers=headers)
