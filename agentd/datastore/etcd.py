"""The thin layer between the datastore and aetcd: endpoints, TLS, channel options, errors.

aetcd 1.0 only opens plaintext channels to one ``host:port``; ``EtcdClient`` adds TLS
(a gRPC secure channel) and the datastore rotates through its endpoints on failure.

Every request carries etcd's "require leader" metadata (``hasleader: true``, what
clientv3's ``WithRequireLeader`` sends): a member of a cluster that has lost its leader
(quorum lost, or this member cut off from the others) refuses requests at once with
"etcdserver: no leader" instead of holding them until they time out, and cancels the
watch and lease keep-alive streams it serves; the datastore then moves to the next
endpoint, where a member that still has a leader answers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import aetcd
import grpc
from aetcd import rpc, watcher

from .records import HistoryCompacted

log = logging.getLogger("agentd.datastore")

DEFAULT_PORT = 2379

# gRPC's default reconnect backoff grows to 120 s: after a long etcd outage the
# channel would sit out up to two minutes before trying again.  Cap it near our
# own retry cap so the agent notices a returned etcd within seconds.  Keepalive
# pings find a dead peer behind a silent network (no RST) on long-lived watch
# streams; etcd accepts pings no more often than every 5 s (--grpc-keepalive-min-time).
# gRPC (1.85) gives up an unanswered ping only after grpc.http2.ping_timeout_ms (60 s by
# default), whatever keepalive_timeout_ms says: without it a watch on a silent member
# (stopped, partitioned) sits ~70 s missing every change; with it ~15 s.
# gRPC refuses a reply over 4 MiB by default; a snapshot of <prefix>/resources/ is one
# Range, so a few large objects would make it fail for ever.  No limit on what we receive,
# as clientv3 (math.MaxInt32): etcd limits only what it receives (--max-request-bytes,
# 1.5 MiB a write by default) and sends replies up to math.MaxInt32 bytes.
CHANNEL_OPTIONS = {
    "grpc.max_receive_message_length": -1,
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 2000,
    "grpc.keepalive_time_ms": 10000,
    "grpc.keepalive_timeout_ms": 5000,
    "grpc.http2.ping_timeout_ms": 5000,
    "grpc.keepalive_permit_without_calls": 0,
    "grpc.http2.max_pings_without_data": 0,
}

# etcd's rpctypes.MetadataRequireLeaderKey / MetadataHasLeader (etcdserver/api/v3rpc).
REQUIRE_LEADER = (("hasleader", "true"),)

# gRPC status codes that mean "etcd is (for now) not there or not able to answer".
_TRANSIENT_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@dataclass(frozen=True)
class Endpoint:
    url: str
    host: str
    port: int
    tls: bool


def parse_endpoint(url: str) -> Endpoint:
    """``http://127.0.0.1:2379`` / ``https://etcd:2379`` / ``127.0.0.1:2379``; ValueError otherwise."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"etcd endpoint must be a URL like http://127.0.0.1:2379, got {url!r}")
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"etcd endpoint {url!r}: scheme must be http or https")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise ValueError(f"etcd endpoint {url!r}: bad port") from None
    if not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"etcd endpoint {url!r}: expected scheme://host:port")
    return Endpoint(url=url, host=parts.hostname, port=port, tls=parts.scheme == "https")


def _read(what: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"etcd TLS {what} file {path!r}: {e.strerror or e}") from None


def tls_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    if (cert is None) != (key is None):
        raise ValueError("etcd TLS: cert and key must be given together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read("ca", ca), private_key=_read("key", key), certificate_chain=_read("cert", cert)
    )


class EtcdClient(aetcd.Client):
    """aetcd.Client that can open a TLS channel."""

    def __init__(
        self, endpoint: Endpoint, *, timeout: float, credentials: grpc.ChannelCredentials | None = None
    ) -> None:
        # gRPC's target is host:port, an IPv6 literal in brackets ([fd00::2]:2379).
        host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
        super().__init__(host, endpoint.port, timeout=timeout, options=dict(CHANNEL_OPTIONS))
        self.endpoint = endpoint
        self._credentials = credentials

    def _init_channel_attrs(self) -> None:
        # aetcd sends ``self.metadata`` with every request and hands it to the watcher it
        # makes on connect; it resets it here (at init and on close).
        super()._init_channel_attrs()
        self.metadata = REQUIRE_LEADER

    async def connect(self) -> None:
        if self._credentials is None or self._connected.is_set():
            return await super().connect()
        # Same wiring as aetcd.Client.connect, over a secure channel.
        target = f"{self._host}:{self._port}"
        self.channel = rpc.secure_channel(target, self._credentials, options=list(self._options.items()))
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
        self._connected.set()


    async def get_at(self, key: bytes, revision: int) -> aetcd.Get | None:
        """``key`` as it was at ``revision`` (aetcd's get cannot ask for a revision); None if
        it did not exist then; HistoryCompacted if etcd has compacted that revision away."""
        await self.connect()
        request = rpc.RangeRequest(key=key, revision=revision)
        try:
            response = await self.kvstub.Range(request, timeout=self._timeout, metadata=self.metadata)
        except rpc.AioRpcError as err:
            if err.code() == grpc.StatusCode.OUT_OF_RANGE and "compacted" in (err.details() or ""):
                raise HistoryCompacted(f"etcd revision {revision} is compacted") from None
            raise  # the connection's retries judge it (is_transient reads its gRPC code)
        if response.count < 1:
            return None
        return aetcd.Get(response.header, response.kvs[-1])


def _grpc_code(exc: BaseException) -> grpc.StatusCode | None:
    for e in (exc, exc.__cause__):
        if isinstance(e, grpc.aio.AioRpcError):
            return e.code()
    return None


def _too_large(exc: BaseException) -> bool:
    """gRPC's own "Received/Sent message larger than max" (RESOURCE_EXHAUSTED, as etcd's
    "too many requests" and "database space exceeded" are): retrying sends the same again."""
    return any("larger than max" in str(e) for e in (exc, exc.__cause__) if e is not None)


def is_transient(exc: BaseException) -> bool:
    """True if exc means etcd is unreachable or briefly unable to serve (retry later)."""
    if _too_large(exc):
        return False
    if isinstance(
        exc,
        (
            aetcd.ConnectionFailedError,
            aetcd.ConnectionTimeoutError,
            aetcd.InternalError,
            aetcd.WatchTimeoutError,
            asyncio.TimeoutError,
            OSError,
            grpc.aio.UsageError,  # "channel closed": a client retired by endpoint failover
        ),
    ):
        return True
    code = _grpc_code(exc)
    return code in _TRANSIENT_CODES


def is_lease_not_found(exc: BaseException) -> bool:
    """True if etcd refused a request because the lease it named no longer exists."""
    return _grpc_code(exc) == grpc.StatusCode.NOT_FOUND and "lease not found" in str(exc)


def describe(exc: BaseException) -> str:
    """One line for a log message.  A gRPC error's str() begins "<AioRpcError of RPC that
    terminated with:" and has its status and details on the lines after: those are taken."""
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        details = " ".join((exc.details() or "").split())
        text = ": ".join(part for part in (code.name if code is not None else "", details) if part)
    else:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
