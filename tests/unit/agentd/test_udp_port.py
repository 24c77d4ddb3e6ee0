"""The udp backend's port is held by the agent for its life and handed to each worker
(agentd/dataplane/udp_port.py, ``--socket-fd``): no other user can take it between workers.
No root: sockets on 127.0.0.1 and the agent's side with fake workers."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import types
from pathlib import Path

import pytest

from agentd.dataplane import DataplaneError, DataplaneProcess, backends, udp_port
from agentd.dataplane.udp import UdpTransport
from agentd.dataplane.worker import COUNTERS, DROP_REASONS, parse_args

LOCAL = "127.0.0.1"


def _counters():
    return dict.fromkeys(COUNTERS, 0), dict.fromkeys(DROP_REASONS, 0)


def _free_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((LOCAL, 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _port_free(port: int) -> bool:
    """Whether a plain bind (what anyone could do) gets ``LOCAL:port``."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind((LOCAL, port))
    except OSError as exc:
        assert exc.errno == errno.EADDRINUSE
        return False
    finally:
        s.close()
    return True


def _same_socket(a: socket.socket, b: socket.socket) -> bool:
    return os.fstat(a.fileno()).st_ino == os.fstat(b.fileno()).st_ino


# -- the worker's side: --socket-fd -----------------------------------------------------------


def _handed(held: socket.socket, offload: bool) -> UdpTransport:
    """A worker's transport on (a copy of) the socket the agent holds, as --socket-fd hands it."""
    c, d = _counters()
    return UdpTransport(LOCAL, held.getsockname()[1], offload=offload, counters=c, drops=d,
                        sock=socket.socket(fileno=os.dup(held.fileno())))


def test_a_udp_worker_uses_the_socket_it_is_handed_and_the_port_outlives_it():
    held = udp_port.bind_udp_port(LOCAL, 0)
    port = held.getsockname()[1]
    try:
        t = _handed(held, offload=True)
        assert _same_socket(t.sock, held) and t.sock.getsockname() == (LOCAL, port)
        peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            peer.sendto(b"E" + bytes(19), (LOCAL, port))
            assert held.recv(100) == b"E" + bytes(19)  # one socket: the agent's copy sees the same queue
        finally:
            peer.close()
        t.close()  # the worker exits (or crashes)
        assert not _port_free(port)  # ... and nobody can take the port meanwhile
    finally:
        held.close()
    assert _port_free(port)


def test_a_worker_without_offloads_turns_off_the_gro_a_previous_worker_left_on_its_socket():
    held = udp_port.bind_udp_port(LOCAL, 0)
    try:
        first = _handed(held, offload=True)
        assert first.offloads["udp_gro"]  # this machine's kernel has UDP_GRO (tests run where it does)
        first.close()
        second = _handed(held, offload=False)
        assert second.sock.getsockopt(17, 104) == 0  # SOL_UDP, UDP_GRO
        second.close()
    finally:
        held.close()


def test_a_socket_bound_elsewhere_is_refused_in_one_line():
    other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    other.bind((LOCAL, 0))
    c, d = _counters()
    with pytest.raises(OSError, match=r"not an IPv4 UDP socket bound to 127\.0\.0\.1:1 \(\('127\.0\.0\.1', \d+\)\)"):
        UdpTransport(LOCAL, 1, offload=False, counters=c, drops=d, sock=other)
    assert other.fileno() == -1  # closed
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with pytest.raises(OSError, match="not an IPv4 UDP socket"):
        UdpTransport(LOCAL, 1, offload=False, counters=c, drops=d, sock=tcp)


_ARGS = ["udp", "--mtu", "1472", "--local-ip", "192.0.2.1", "--control", "/run/agentd/dp.sock"]


def test_socket_fd_is_checked_on_the_command_line(capsys):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        assert parse_args([*_ARGS, "--socket-fd", str(s.fileno())]).socket_fd == s.fileno()
        assert parse_args(_ARGS).socket_fd is None
        closed = os.dup(s.fileno())
        os.close(closed)
        for bad, word in ((["--socket-fd", str(closed)], "is not open"), (["--socket-fd", "1"], "3 or more"),
                          (["--socket-fd", "x"], "3 or more")):
            with pytest.raises(SystemExit):
                parse_args([*_ARGS, *bad])
            err = capsys.readouterr().err
            assert word in err and err.count("\n") == 1
        with pytest.raises(SystemExit):
            parse_args(["ipip", *_ARGS[1:], "--socket-fd", str(s.fileno())])
        assert "udp worker only" in capsys.readouterr().err
    finally:
        s.close()


# -- the agent's side ---------------------------------------------------------------------------


def test_proc_net_udp_is_parsed_and_a_squatter_is_named(tmp_path):
    holder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # no SO_REUSEPORT: keeps the agent out
    holder.bind((LOCAL, 0))
    port = holder.getsockname()[1]
    addr = int.from_bytes(socket.inet_aton(LOCAL), sys.byteorder)
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "udp").write_text(
        "   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops\n"
        f"  1: {addr:08X}:{port:04X} 00000000:0000 07 00000000:00000000 00:00000000 00000000  1000        0 4242 2 "
        "0000000000000000 0\n"
        "  2: 00000000:2105 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 77 2 0 0\n")
    assert udp_port.parse_udp_sockets((tmp_path / "net" / "udp").read_text()) == [
        (LOCAL, port, 1000, 4242), ("0.0.0.0", 0x2105, 0, 77)]
    assert udp_port.port_owners(LOCAL, port, tmp_path) == {1000}
    assert udp_port.port_owners(LOCAL, 0x2105, tmp_path) == {0}  # the wildcard keeps it too
    try:
        with pytest.raises(OSError) as exc:
            udp_port.bind_udp_port(LOCAL, port, tmp_path)
        assert exc.value.errno == errno.EADDRINUSE
        assert f"cannot bind the udp backend's port {LOCAL}:{port}" in str(exc.value)
        assert "a socket of uid 1000" in str(exc.value)
    finally:
        holder.close()


def test_the_agent_takes_a_running_workers_own_socket_not_another_in_its_group():
    """A worker an older agent started bound its own socket: the agent takes (pidfd_getfd) that
    very socket, so that it is one socket (a second one in the SO_REUSEPORT group would get a
    share of the peers' datagrams, unread)."""
    worker_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    worker_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    worker_sock.bind((LOCAL, 0))
    port = worker_sock.getsockname()[1]
    try:
        taken = udp_port.take_worker_socket(os.getpid(), LOCAL, port)
        assert _same_socket(taken, worker_sock) and taken.fileno() != worker_sock.fileno()
        worker_sock.close()
        assert not _port_free(port)
        taken.close()
        assert _port_free(port)
        with pytest.raises(OSError, match="holds no UDP socket bound to"):
            udp_port.take_worker_socket(os.getpid(), LOCAL, port)
    finally:
        worker_sock.close()


class _Started:
    """DataplaneProcess.start and DataplaneClient.connect as the agent sees them, faked: what
    each start was handed."""

    def __init__(self, monkeypatch, held_by_worker: dict | None = None):
        self.socks: list[socket.socket | None] = []
        self.worker_config = held_by_worker
        started = self

        class Client:
            async def get(self):
                return {"config": started.worker_config, "next_hops": {}}

            async def shutdown(self, remove_device=False):
                started.worker_config = None

            async def close(self):
                pass

        async def start(kind, tun, mtu, local_ip, *, port, control_path, state_path, sock=None):
            self.socks.append(None if sock is None else socket.socket(fileno=os.dup(sock.fileno())))
            return types.SimpleNamespace(pid=4242)

        async def connect(path, timeout=5.0):
            if started.worker_config is None and not started.socks:
                raise DataplaneError("no worker")
            return Client()

        monkeypatch.setattr(backends.DataplaneProcess, "start", start)
        monkeypatch.setattr(backends.DataplaneClient, "connect", connect)
        monkeypatch.setattr(backends._Worker, "_address", lambda self, address: None)

    def close(self):
        for s in self.socks:
            if s is not None:
                s.close()


def _agent(tmp_path, port: int, mtu: int = 1500):
    return types.SimpleNamespace(
        cfg=types.SimpleNamespace(agent=types.SimpleNamespace(state_dir=str(tmp_path)),
                                  network=types.SimpleNamespace(udp_port=port)),
        underlay=types.SimpleNamespace(interface=types.SimpleNamespace(ip=LOCAL), mtu=mtu),
        subnet=None,
        subnets={},  # (Tunnels': up() falls back to the subnet it is given)
        hosts_v6={},
    )


async def test_the_agent_holds_the_udp_port_across_worker_restarts(monkeypatch, tmp_path):
    port = _free_port()
    started = _Started(monkeypatch)
    w = backends._Worker(_agent(tmp_path, port), "udp")
    try:
        await w.up(types.SimpleNamespace(network_address="10.244.7.0"))
        assert len(started.socks) == 1 and started.socks[0].getsockname() == (LOCAL, port)
        started.close()  # the worker dies: its socket goes
        assert not _port_free(port)  # the agent's keeps the port
        started.socks.clear()
        await w.up(types.SimpleNamespace(network_address="10.244.7.0"))  # started again: the same socket
        assert _same_socket(started.socks[0], w.port_socket)
        started.close()
        await w.down(remove=True)
        assert _port_free(port)
    finally:
        started.close()
        w._release_port()


async def test_the_agent_takes_over_the_port_of_a_worker_it_adopts_and_of_one_it_replaces(monkeypatch, tmp_path):
    """Graceful restart: the previous run's worker (or an older agent's, with a socket of its own)
    keeps forwarding and is taken over; one with another MTU is replaced, and the port is held
    throughout (the agent takes the worker's socket before it asks it to go)."""
    worker_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    worker_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    worker_sock.bind((LOCAL, 0))
    port = worker_sock.getsockname()[1]
    config = {"local_ip": LOCAL, "port": port, "mtu": 1472, "pid": os.getpid()}
    started = _Started(monkeypatch, held_by_worker=dict(config))
    w = backends._Worker(_agent(tmp_path, port, mtu=1500), "udp")
    try:
        await w.up(types.SimpleNamespace(network_address="10.244.7.0"))
        assert started.socks == [] and _same_socket(w.port_socket, worker_sock)  # adopted, its socket held
        worker_sock.close()
        assert not _port_free(port)
        started.worker_config = dict(config, mtu=1400, pid=4194303 + 1)  # another MTU: replaced (no such pid)
        await w.up(types.SimpleNamespace(network_address="10.244.7.0"))
        assert len(started.socks) == 1 and _same_socket(started.socks[0], w.port_socket)
    finally:
        worker_sock.close()
        started.close()
        w._release_port()


FAKE_WORKER = """
import json, os, socket, sys
args = sys.argv[1:]
control, fd = args[args.index("--control") + 1], int(args[args.index("--socket-fd") + 1])
s = socket.socket(fileno=fd)
with open(control + ".seen", "w") as f:
    json.dump({"name": list(s.getsockname()), "ino": os.fstat(fd).st_ino}, f)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(control)
srv.listen()
while True:
    srv.accept()[0].close()
"""


async def test_dataplane_process_hands_the_worker_the_socket(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\n{FAKE_WORKER}")
    fake.chmod(0o755)
    held = udp_port.bind_udp_port(LOCAL, 0)
    control = str(tmp_path / "dp.sock")
    proc = None
    try:
        proc = await DataplaneProcess.start("udp", "agentd.udp", 1472, LOCAL, port=held.getsockname()[1],
                                            control_path=control, python=str(fake), sock=held, ready_timeout=10)
        seen = json.loads(Path(control + ".seen").read_text())
        assert seen == {"name": list(held.getsockname()), "ino": os.fstat(held.fileno()).st_ino}
    finally:
        if proc is not None:
            await proc.stop()
        held.close()
        with contextlib.suppress(OSError):
            os.unlink(control)
