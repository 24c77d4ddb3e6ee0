"""The udp backend's port, held by the agent (root) for its whole life.

``udp_port`` (8285, flannel's) is an unprivileged port.  A worker that binds it itself leaves it
free whenever no worker runs -- after a crash until the next refresh starts another, while one
is replaced, after its orphan exit -- and a local user who binds it then keeps every later
worker out (SO_REUSEPORT admits sockets of the same user only), receives the peers' pod traffic
and may send forged pod packets from the port the member filter trusts.  So the agent binds
the socket once (:func:`bind_udp_port`) and hands each worker it starts that socket
(``--socket-fd``); one it takes over after a graceful restart (started by the previous run, or
by an agent before this change, which bound its own) it takes the socket from
(:func:`take_worker_socket`: pidfd_getfd, Linux >= 5.6), so the port stays held as long as the
agent runs.  Where binding fails, :func:`port_owners` names who holds the port
(/proc/net/udp's uid column).
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import pwd
import socket
import sys
from pathlib import Path

from agentd.dataplane._sockopt import IP_MTU_DISCOVER, IP_PMTUDISC_DO

PROC = Path("/proc")  # (tests give fixtures)
_SYS_PIDFD_GETFD = 438  # the same number on every architecture (the unified syscall table)


def parse_udp_sockets(text: str) -> list[tuple[str, int, int, int]]:
    """(local address, port, owner uid, inode) of each socket in a /proc/net/udp text (its
    addresses: a 32-bit word in host byte order, in hex)."""
    out = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10 or ":" not in f[1]:
            continue
        addr, _, port = f[1].rpartition(":")
        try:
            ip = str(ipaddress.IPv4Address(int(addr, 16).to_bytes(4, sys.byteorder)))
            out.append((ip, int(port, 16), int(f[7]), int(f[9])))
        except ValueError:
            continue
    return out


def _sockets(proc: Path) -> list[tuple[str, int, int, int]]:
    try:
        return parse_udp_sockets((proc / "net" / "udp").read_text(errors="replace"))
    except OSError:
        return []


def port_owners(local_ip: str, port: int, proc: Path | None = None) -> set[int]:
    """The uids of the IPv4 UDP sockets bound to ``local_ip:port`` or the wildcard address
    with that port (either keeps a bind of ``local_ip:port`` out)."""
    return {uid for ip, p, uid, _ino in _sockets(PROC if proc is None else proc)
            if p == port and ip in (local_ip, "0.0.0.0")}


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def bind_udp_port(local_ip: str, port: int, proc: Path | None = None) -> socket.socket:
    """A UDP socket bound to ``local_ip:port`` as the worker would bind it (SO_REUSEPORT: a
    worker an older agent started, still exiting, may hold the port beside it; DF set).  An
    OSError that says who holds the port where another user's socket keeps it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        sock.bind((local_ip, port))
    except OSError as exc:
        sock.close()
        why = f"cannot bind the udp backend's port {local_ip}:{port} ([network] udp_port): {exc.strerror}"
        if exc.errno == errno.EADDRINUSE:
            others = sorted(port_owners(local_ip, port, proc) - {os.geteuid()})
            if others:
                why += (f"; a socket of {', '.join(_user(u) for u in others)} holds it (another user took "
                        "the port while no agent or worker held it? stop that process)")
        raise OSError(exc.errno, why) from None
    return sock


def _pidfd_getfd(pid: int, fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        got = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return got
    finally:
        os.close(pidfd)


def take_worker_socket(pid: int, local_ip: str, port: int, proc: Path | None = None) -> socket.socket:
    """A duplicate of the socket worker ``pid`` has bound to ``local_ip:port`` (the same open
    socket, not another one in its SO_REUSEPORT group: the kernel would share the peers'
    datagrams between them).  OSError when there is none or it cannot be taken (no
    pidfd_getfd before Linux 5.6, or ptrace refused)."""
    proc = PROC if proc is None else proc
    inodes = {ino for ip, p, _uid, ino in _sockets(proc) if p == port and ip == local_ip}
    fd_dir = proc / str(pid) / "fd"
    try:
        entries = list(os.scandir(fd_dir))
    except OSError as exc:
        raise OSError(exc.errno, f"cannot list {fd_dir}: {exc.strerror}") from None
    for entry in entries:
        try:
            target = os.readlink(entry.path)
        except OSError:
            continue
        if target.startswith("socket:[") and int(target[8:-1] or 0) in inodes:
            sock = socket.socket(fileno=_pidfd_getfd(pid, int(entry.name)))
            try:
                if sock.type == socket.SOCK_DGRAM and sock.getsockname() == (local_ip, port):
                    return sock
            except OSError:
                pass
            sock.close()
    raise OSError(errno.ENOENT, f"worker {pid} holds no UDP socket bound to {local_ip}:{port}")
