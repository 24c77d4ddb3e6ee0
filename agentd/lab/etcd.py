"""Real etcd 3.4 servers for the system tests and the lab: one member, or a cluster.

``EtcdServer`` runs ``/usr/bin/etcd`` (inside a lab namespace if one is given) with
its own data directory and ports.  ``stop()`` keeps the data directory, so a later
``start()`` brings back the same keys and leases: the datastore tests stop etcd for
a while and start it again to check that the agent recovers by itself.

``EtcdCluster`` is N such members that form one raft cluster (each its own process,
data directory and address); a test kills or stops single members, asks which one is
the leader and starts members again.

Ports are picked at random below the kernel's ephemeral range (which starts at
32768 by default) and bind-tested first, so test runs on the same machine do not
collide; if etcd still loses a race for a port on its first start, new ports are
picked and it is started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import random
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentd.lab.netns import Netns
from agentd.lab.process import LabProcess
from agentd.lab.wait import auntil

ETCD_BINARY = "etcd"
START_TIMEOUT = 20.0
STOP_GRACE = 10.0
# Picked ports come from here: above the well-known and registered services most
# machines run, below the Linux default ephemeral range (32768-60999).
PORT_RANGE = (12000, 32000)


class EtcdError(RuntimeError):
    """etcd could not be started or stopped; the message carries the tail of its log."""


@dataclass(frozen=True)
class EtcdTls:
    """PEM files for an etcd that serves clients over TLS and requires client certificates.

    ``client_cert``/``client_key`` are what a client (the datastore) presents; the
    server's own pair is ``server_cert``/``server_key``; both are signed by ``ca``.
    """

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def make_test_pki(directory: str | os.PathLike[str], host: str = "127.0.0.1") -> EtcdTls:
    """A throwaway CA, a server certificate for ``host`` and a client certificate (openssl)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    san = f"IP:{host}" if _is_ip(host) else f"DNS:{host}"

    def openssl(*args: str) -> None:
        proc = subprocess.run(["openssl", *args], capture_output=True, cwd=d)
        if proc.returncode != 0:
            raise EtcdError(f"openssl {args[0]} failed: {proc.stderr.decode(errors='replace').strip()}")

    openssl("req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=agentd-test-ca")
    for role, usage in (("server", "serverAuth,clientAuth"), ("client", "clientAuth")):
        (d / f"{role}.ext").write_text(f"subjectAltName={san}\nextendedKeyUsage={usage}\n")
        openssl("req", *curve, "-keyout", f"{role}.key", "-out", f"{role}.csr", "-subj", f"/CN=agentd-{role}")
        openssl("x509", "-req", "-in", f"{role}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{role}.pem", "-days", "2", "-extfile", f"{role}.ext")
    return EtcdTls(
        ca=str(d / "ca.pem"), server_cert=str(d / "server.pem"), server_key=str(d / "server.key"),
        client_cert=str(d / "client.pem"), client_key=str(d / "client.key"),
    )


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class EtcdServer(LabProcess):
    """One etcd member.  ``await start()``, ``await stop()``; restartable with the same data.

    The one lab process with an async life (the datastore tests run in the event loop):
    ``start``, ``stop`` and ``kill`` are coroutines around agentd.lab.process's waits."""

    error = EtcdError

    def __init__(
        self,
        data_dir: str,
        *,
        netns: Netns | None = None,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        name: str = "agentd-etcd",
        log_path: str | None = None,
        tls: EtcdTls | None = None,
        initial_cluster: str | None = None,
        cluster_token: str | None = None,
        heartbeat_ms: int = 50,
        election_ms: int = 500,
    ) -> None:
        """``initial_cluster`` (``name=peer_url,...``, every member) makes this one member
        of a cluster; its ports must then be fixed before any member starts."""
        self.data_dir = str(data_dir)
        self.initial_cluster = initial_cluster
        self.cluster_token = cluster_token or name
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.tls = tls
        self.netns = netns
        self.host = host
        self.name = name
        super().__init__(netns, log_path or f"{self.data_dir}.log")
        self._family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        self._ports_picked = client_port is None or peer_port is None
        self.client_port = client_port or 0
        self.peer_port = peer_port or 0
        if self._ports_picked:
            self._pick_ports(client_port, peer_port)

    def __repr__(self) -> str:
        where = f" in {self.netns.name}" if self.netns else ""
        return f"EtcdServer({self.endpoint}{where}, pid={self.pid})"

    @property
    def label(self) -> str:  # type: ignore[override]
        return f"etcd {self.endpoint}"

    # -- addresses ---------------------------------------------------------

    def _url(self, port: int, scheme: str = "http") -> str:
        host = f"[{self.host}]" if self._family == socket.AF_INET6 else self.host
        return f"{scheme}://{host}:{port}"

    @property
    def endpoint(self) -> str:
        """The client URL, e.g. ``http://127.0.0.1:23791`` (``https://`` with TLS)."""
        return self._url(self.client_port, "https" if self.tls else "http")

    @property
    def peer_url(self) -> str:
        return self._url(self.peer_port)

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Spawn etcd and wait until it answers ``/health``; raise EtcdError if it does not.

        A cluster member is healthy only once a majority of members runs: start members
        together (``EtcdCluster.start``, or ``asyncio.gather``)."""
        if self.running:
            return
        if shutil.which(ETCD_BINARY) is None:
            raise EtcdError(f"{ETCD_BINARY!r} not found on PATH; run `scripts/dev setup` (Debian etcd-server)")
        first_start = not os.path.isdir(os.path.join(self.data_dir, "member"))
        # A cluster member cannot move to other ports alone: its peers know them already.
        attempts = 3 if (self._ports_picked and first_start and self.initial_cluster is None) else 1
        for attempt in range(attempts):
            self._spawn()
            try:
                await self._wait_healthy()
                return
            except EtcdError:
                lost_port_race = "address already in use" in self.log_tail()
                await self.kill()
                if not lost_port_race or attempt == attempts - 1:
                    raise
                # Someone took a port between our bind test and etcd's listen: try others.
                shutil.rmtree(self.data_dir, ignore_errors=True)
                self._pick_ports(None, None)

    async def stop(self) -> None:  # type: ignore[override]
        """SIGTERM, then SIGKILL after a grace period.  The data directory is kept."""
        await asyncio.to_thread(LabProcess.stop, self, STOP_GRACE)

    async def kill(self) -> None:  # type: ignore[override]
        """SIGKILL at once (a crash); the data directory is kept."""
        await asyncio.to_thread(LabProcess.kill, self)

    async def __aenter__(self) -> EtcdServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- internals ---------------------------------------------------------

    def _argv(self) -> list[str]:
        client, peer = self.endpoint, self.peer_url
        return [
            ETCD_BINARY,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.initial_cluster or f'{self.name}={peer}'}",
            "--initial-cluster-state=new",  # ignored once the data directory exists
            f"--initial-cluster-token={self.cluster_token}",
            # Short raft timers: a member elects a leader sooner after a (re)start or a loss.
            f"--heartbeat-interval={self.heartbeat_ms}",
            f"--election-timeout={self.election_ms}",
            "--logger=zap",
            "--log-outputs=stderr",
        ] + (
            [
                f"--cert-file={self.tls.server_cert}",
                f"--key-file={self.tls.server_key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
            if self.tls
            else []
        )

    def _spawn(self) -> None:
        Path(self.data_dir).parent.mkdir(parents=True, exist_ok=True)
        self.spawn(self._argv())

    async def _wait_healthy(self) -> None:
        await auntil(self._healthy, START_TIMEOUT, abort=self.exited, error=EtcdError,
                     what=lambda: f"etcd {self.endpoint} /health; log {self.log_path} ends:\n{self.log_tail()}")

    async def _healthy(self) -> bool:
        reply = await self._http_get("/health")
        return reply is not None and b'"health":"true"' in reply

    async def is_leader(self) -> bool | None:
        """True if this member is the raft leader now, False if not, None if it does not answer."""
        reply = await self._http_get("/metrics")
        if reply is None:
            return None
        for line in reply.decode(errors="replace").splitlines():
            if line.startswith("etcd_server_is_leader "):
                return float(line.split()[1]) == 1.0
        return None

    async def _http_get(self, path: str) -> bytes | None:
        """GET ``path`` over a socket opened in etcd's namespace; the raw reply, or None."""
        loop = asyncio.get_running_loop()
        writer = None
        try:
            sock = self._socket()  # OSError too when the namespace is gone (a lab half up, half down)
        except OSError:
            return None
        try:
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, (self.host, self.client_port)), 1.0)
            context = self._client_ssl()
            async with asyncio.timeout(2.0):  # not wait_for: the connection must not escape a cancel
                reader, writer = await asyncio.open_connection(
                    sock=sock, ssl=context, server_hostname=self.host if context else None
                )
            writer.write(f"GET {path} HTTP/1.0\r\nHost: {self.host}\r\n\r\n".encode())
            return await asyncio.wait_for(reader.read(), 2.0)
        except (OSError, asyncio.TimeoutError):
            return None
        finally:
            if writer is not None:
                writer.close()
                with contextlib.suppress(OSError, asyncio.TimeoutError):
                    await asyncio.wait_for(writer.wait_closed(), 1.0)
            else:
                sock.close()

    def _client_ssl(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        context = ssl.create_default_context(cafile=self.tls.ca)
        context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        return context

    def _socket(self) -> socket.socket:
        if self.netns is None:
            return socket.socket(self._family, socket.SOCK_STREAM)
        with self.netns.entered():
            return socket.socket(self._family, socket.SOCK_STREAM)

    def _pick_ports(self, client_port: int | None, peer_port: int | None) -> None:
        taken: set[int] = set()
        if client_port is None:
            self.client_port = self._free_port(taken | {peer_port or 0})
        taken.add(self.client_port)
        if peer_port is None:
            self.peer_port = self._free_port(taken)

    def _free_port(self, avoid: set[int]) -> int:
        rng = random.SystemRandom()
        for _ in range(500):
            port = rng.randrange(*PORT_RANGE)
            if port in avoid:
                continue
            sock = self._socket()
            try:
                sock.bind((self.host, port))
            except OSError:
                continue
            finally:
                sock.close()
            return port
        raise EtcdError(f"no free TCP port on {self.host} in {PORT_RANGE[0]}-{PORT_RANGE[1]}")


@contextlib.asynccontextmanager
async def etcd_server(
    tmp_path: str | os.PathLike[str], netns: Netns | None = None, **kwargs
) -> AsyncIterator[EtcdServer]:
    """A started EtcdServer with its data under ``tmp_path``; always stopped on exit."""
    server = EtcdServer(os.path.join(os.fspath(tmp_path), "etcd-data"), netns=netns, **kwargs)
    try:
        await server.start()
        yield server
    finally:
        await server.stop()


class EtcdCluster:
    """N etcd members forming one raft cluster, each its own process, data directory and
    address.  ``start()`` starts them together (a member is healthy only once a majority
    runs); single members are killed, stopped and started again through ``members``.
    With one member it is simply a single etcd."""

    def __init__(self, members: Sequence[EtcdServer]) -> None:
        if not members:
            raise ValueError("an etcd cluster needs at least one member")
        self.members = list(members)
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    @classmethod
    def create(
        cls,
        root: str | os.PathLike[str],
        size: int,
        *,
        name: str = "agentd-etcd",
        hosts: Sequence[str] | None = None,
        netns: Sequence[Netns | None] | None = None,
        client_port: int | None = None,
        peer_port: int | None = None,
        heartbeat_ms: int = 50,
        election_ms: int = 500,
    ) -> EtcdCluster:
        """Members ``<name>-1`` .. ``<name>-<size>`` with data and logs under ``root/etcdI/``;
        member I listens on ``hosts[I-1]`` (default 127.0.0.1) in ``netns[I-1]`` (default
        this namespace) on the given ports (default: picked, distinct per member)."""
        hosts = list(hosts or ["127.0.0.1"] * size)
        spaces = list(netns or [None] * size)
        if len(hosts) != size or len(spaces) != size:
            raise ValueError(f"an etcd cluster of {size} needs {size} hosts and namespaces")
        members = []
        for i, (host, ns) in enumerate(zip(hosts, spaces), start=1):
            d = Path(root) / f"etcd{i}"
            members.append(
                EtcdServer(
                    str(d / "data"), netns=ns, host=host, client_port=client_port, peer_port=peer_port,
                    name=f"{name}-{i}", log_path=str(d / "etcd.log"), cluster_token=name,
                    heartbeat_ms=heartbeat_ms, election_ms=election_ms,
                )
            )  # fmt: skip
        return cls(members)

    def __repr__(self) -> str:
        return f"EtcdCluster({', '.join(repr(m) for m in self.members)})"

    def __len__(self) -> int:
        return len(self.members)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def member(self, name: str) -> EtcdServer:
        for m in self.members:
            if m.name == name:
                return m
        raise KeyError(f"no etcd member {name!r} (members: {', '.join(m.name for m in self.members)})")

    async def start(self) -> None:
        """Start every member that is not running and wait until each answers /health."""
        results = await asyncio.gather(*(m.start() for m in self.members), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def stop(self) -> None:
        await asyncio.gather(*(m.stop() for m in self.members))

    async def kill(self) -> None:
        await asyncio.gather(*(m.kill() for m in self.members))

    async def roles(self) -> dict[str, str]:
        """Each member's role now, as it says itself: "leader", "follower" or "down" (no answer)."""
        answers = await asyncio.gather(*(m.is_leader() for m in self.members))
        return {m.name: {True: "leader", False: "follower", None: "down"}[a] for m, a in zip(self.members, answers)}

    async def leader(self) -> EtcdServer | None:
        """The member that says it is the raft leader, or None (no quorum, or an election)."""
        roles = await self.roles()
        return next((m for m in self.members if roles[m.name] == "leader"), None)

    async def wait_leader(self, timeout: float = 30.0, *, other_than: EtcdServer | None = None) -> EtcdServer:
        """Wait until a member (not ``other_than``) is the leader; EtcdError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = await self.leader()
            if leader is not None and leader is not other_than:
                return leader
            await asyncio.sleep(0.05)
        raise EtcdError(f"no etcd leader within {timeout:.0f}s: {await self.roles()}")


@contextlib.asynccontextmanager
async def etcd_cluster(tmp_path: str | os.PathLike[str], size: int = 3, **kwargs) -> AsyncIterator[EtcdCluster]:
    """A started EtcdCluster (on 127.0.0.1 unless told) under ``tmp_path``; always killed on exit."""
    cluster = EtcdCluster.create(os.path.join(os.fspath(tmp_path), "etcd-cluster"), size, **kwargs)
    try:
        await cluster.start()
        yield cluster
    finally:
        await cluster.kill()
