"""agentd.daemon.sdnotify.Notifier: the sd_notify(3) datagrams, without systemd.

Pure: the environment is passed in, and the "systemd" end is a unix datagram socket this
test binds (a file in tmp_path, or a name in the abstract namespace); nothing sleeps.
"""

from __future__ import annotations

import logging
import os
import socket

import pytest

from agentd.daemon.sdnotify import Notifier


@pytest.fixture
def systemd_end(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    sock.bind(str(path))
    sock.setblocking(False)
    try:
        yield str(path), sock
    finally:
        sock.close()


def received(sock: socket.socket) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096))
        except BlockingIOError:
            return out


def test_without_notify_socket_everything_is_a_no_op():
    n = Notifier({})
    assert not n.enabled
    assert n.watchdog_interval is None
    assert n.notify("READY=1") is False
    n.ready("x")
    n.status("y")
    n.stopping()
    n.close()


def test_ready_status_stopping_datagrams(systemd_end):
    path, sock = systemd_end
    n = Notifier({"NOTIFY_SOCKET": path})
    assert n.enabled
    n.status("connecting to etcd")
    n.ready("ready: subnet 10.244.1.0/24")
    n.ready()
    n.stopping()
    n.close()
    assert received(sock) == [
        b"STATUS=connecting to etcd",
        b"READY=1\nSTATUS=ready: subnet 10.244.1.0/24",  # one datagram: both take effect together
        b"READY=1",
        b"STOPPING=1",
    ]


def test_abstract_namespace_socket():
    name = f"agentd-test-{os.getpid()}-{id(object())}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.setblocking(False)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.notify("WATCHDOG=1") is True
        n.close()
        assert received(sock) == [b"WATCHDOG=1"]
    finally:
        sock.close()


def test_a_vanished_socket_is_a_warning_not_an_error(tmp_path, caplog):
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    with caplog.at_level(logging.WARNING, logger="agentd.sdnotify"):
        assert n.notify("READY=1") is False
    assert "sd_notify" in caplog.text
    n.close()


def test_socket_is_reused_and_closed(systemd_end):
    path, sock = systemd_end
    n = Notifier({"NOTIFY_SOCKET": path})
    n.notify("A=1")
    first = n._sock
    n.notify("B=2")
    assert n._sock is first and first is not None
    assert first.get_inheritable() is False  # children (the data-plane worker, nft) never get it
    n.close()
    assert n._sock is None
    n.close()  # idempotent
    assert received(sock) == [b"A=1", b"B=2"]


@pytest.mark.parametrize(
    ("env", "interval"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),  # WatchdogSec=30s: ping every 15 s
        ({"WATCHDOG_USEC": "2000000"}, 1.0),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "junk"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        # digits int() refuses ("²", over 4300 of them: a traceback at start) or reads ("٣" as 3)
        ({"WATCHDOG_USEC": "\u00b2"}, None),
        ({"WATCHDOG_USEC": "\u0663000000"}, None),
        pytest.param({"WATCHDOG_USEC": "9" * 5000}, None, id="5000-digits"),
        ({}, None),
        # sd_watchdog_enabled(3): WATCHDOG_PID names the process the watchdog is meant for.
        ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}, 2.0),
        ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}, None),
    ],
)
def test_watchdog_interval_is_half_watchdog_usec(env, interval, tmp_path):
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "s"), **env})
    assert n.watchdog_interval == interval


async def test_watchdog_loop_returns_at_once_when_disabled(tmp_path):
    # Supervised as "watchdog": a loop that returns is done, not restarted, not a crash.
    assert await Notifier({"NOTIFY_SOCKET": str(tmp_path / "s")}).watchdog_loop() is None
    assert await Notifier({"WATCHDOG_USEC": "2000000"}).watchdog_loop() is None
