"""``[ingress] access_log``: the setting (agent, off, a file), the file's writer
(agentd/ingress/access_log.py: appended, opened again after logrotate moved it or on SIGHUP,
a file it cannot write warned about once, then at most once a minute), the socket's reader
handing lines to it instead of the agent's log, and "off" telling HAProxy not to log."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket

import pytest

from agentd.config.settings import ConfigError, load_config
from agentd.datastore.store import Datastore
from agentd.ingress.access_log import CHECK_EVERY, WARN_EVERY, AccessFile, FileWriter
from agentd.ingress.controller import IngressController
from agentd.ingress.proxy import AccessLog

BASE = {"node.address": "10.1.1.1", "node.name": "n1"}


def config(**overrides: str):
    return load_config(None, env={}, overrides={**BASE, **overrides})


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "agentd.ingress" and r.levelno >= logging.WARNING]


# ---------------------------------------------------------------- the setting


def test_the_setting_defaults_to_the_agents_log_and_takes_off_or_a_file(tmp_path):
    assert config().ingress.access_log == "agent"
    assert config(**{"ingress.access_log": "off"}).ingress.access_log == "off"
    assert config(**{"ingress.access_log": " /var/log//agentd/ingress.log "}).ingress.access_log == "/var/log/agentd/ingress.log"
    cfg = load_config(None, env={"AGENTD_INGRESS_ACCESS_LOG": str(tmp_path / "a.log")}, overrides=BASE)
    assert cfg.ingress.access_log == str(tmp_path / "a.log")


@pytest.mark.parametrize("value, why", [
    ("access.log", "must be \"agent\", \"off\" or the absolute path of a file"),
    ("", "must be \"agent\", \"off\" or the absolute path of a file"),
    ("Agent", "must be \"agent\", \"off\" or the absolute path of a file"),
    ("/var/log/agentd/", "must be \"agent\", \"off\" or the absolute path of a file"),
    ("/var/log/a\nb.log", "must be \"agent\", \"off\" or the absolute path of a file"),
    ("TMP", "is a directory, not a file"),
])  # fmt: skip
def test_a_bad_value_is_one_line_naming_the_key(value, why, tmp_path):
    toml = tmp_path / "agentd.toml"
    value = str(tmp_path) if value == "TMP" else value
    toml.write_text(f'[node]\nname = "n1"\naddress = "10.1.1.1"\n[ingress]\naccess_log = {json.dumps(value)}\n')
    with pytest.raises(ConfigError) as err:
        load_config(toml, env={})
    line = str(err.value)
    assert "\n" not in line and "[ingress] access_log" in line and why in line, line
    assert line.startswith(f"{toml}:5: "), line


# ---------------------------------------------------------------- the file


def test_lines_are_appended(tmp_path):
    path = tmp_path / "access.log"
    path.write_bytes(b"from before\n")
    f = AccessFile(path)
    assert f.write(b"GET /a\n", 0.0) and f.write(b"GET /b\nGET /c\n", 0.1)
    assert path.read_bytes() == b"from before\nGET /a\nGET /b\nGET /c\n"
    assert f.written == 3
    f.close()


def test_a_new_file_is_made_owner_and_group_readable(tmp_path):
    path = tmp_path / "access.log"
    old = os.umask(0o022)
    try:
        AccessFile(path).write(b"x\n", 0.0)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("how", ["renamed", "deleted", "created"])
def test_the_file_is_opened_again_once_logrotate_moved_it_away(tmp_path, how):
    path = tmp_path / "access.log"
    f = AccessFile(path)
    f.write(b"one\n", 10.0)
    if how == "deleted":
        path.unlink()
    else:
        path.rename(tmp_path / "access.log.1")
        if how == "created":  # logrotate's "create": a new empty file at the path at once
            path.touch()
    f.write(b"two\n", 10.0 + CHECK_EVERY / 2)  # not looked at within a second: the open file still
    f.write(b"three\n", 10.0 + CHECK_EVERY)
    assert path.read_bytes() == b"three\n"
    if how != "deleted":
        assert (tmp_path / "access.log.1").read_bytes() == b"one\ntwo\n"
    f.close()


def test_copytruncate_goes_on_at_the_start(tmp_path):
    path = tmp_path / "access.log"
    f = AccessFile(path)
    f.write(b"one\n", 0.0)
    os.truncate(path, 0)
    f.write(b"two\n", 0.1)
    assert path.read_bytes() == b"two\n"  # O_APPEND: no hole of the old length
    f.close()


def test_a_file_that_cannot_be_opened_is_warned_about_once_then_once_a_minute(tmp_path, caplog):
    caplog.set_level(logging.INFO, "agentd.ingress")
    path = tmp_path / "missing-dir" / "access.log"
    f = AccessFile(path)
    for i in range(50):
        assert not f.write(b"GET /x\n", 100.0 + i * 0.5)
    said = warnings(caplog)
    assert len(said) == 1, said
    assert str(path) in said[0] and "cannot open it: No such file or directory" in said[0], said
    assert not f.write(b"GET /y\n", 100.0 + WARN_EVERY + 1)
    said = warnings(caplog)
    assert len(said) == 2 and "50 lines dropped since the last warning" in said[1], said
    path.parent.mkdir()
    assert f.write(b"GET /z\n", 100.0 + WARN_EVERY + 2)
    said = warnings(caplog)
    assert len(said) == 3 and "writing again" in said[2], said
    assert path.read_bytes() == b"GET /z\n" and f.dropped_total == 51
    f.close()


def test_a_full_disk_is_warned_about_once_and_nothing_raises(caplog):
    caplog.set_level(logging.INFO, "agentd.ingress")
    f = AccessFile("/dev/full")  # every write: ENOSPC
    for i in range(20):
        assert not f.write(b"GET /x\n", float(i))
    said = warnings(caplog)
    assert len(said) == 1 and "cannot write it: No space left on device" in said[0], said
    f.close()


def test_a_line_cut_by_a_failed_write_does_not_swallow_the_next(tmp_path, monkeypatch):
    path = tmp_path / "access.log"
    f = AccessFile(path)
    real = os.write
    calls = []

    def half_then_enospc(fd, data):
        calls.append(bytes(data))
        if len(calls) == 1:
            return real(fd, bytes(data)[:3])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", half_then_enospc)
    assert not f.write(b"GET /a\n", 0.0)
    assert f.write(b"GET /b\n", CHECK_EVERY)
    assert path.read_bytes() == b"GET\nGET /b\n"
    f.close()


# ---------------------------------------------------------------- the thread and the socket


def test_the_writer_thread_writes_in_order_and_reopens_on_request(tmp_path):
    path, rotated = tmp_path / "access.log", tmp_path / "access.log.1"
    w = FileWriter(path)
    real = w.file.write

    def write_then_rotate(data: bytes, now: float, lines: int | None = None) -> bool:
        done = real(data, now, lines)
        if data == b"one\ntwo\n":  # logrotate renames it; its postrotate sends SIGHUP
            path.rename(rotated)
        return done

    w.file.write = write_then_rotate  # type: ignore[method-assign]
    w.put([b"one", b"two\n"])
    w.reopen()
    w.put([b"three"])  # well within the second before the path is looked at: the reopen alone
    w.start()
    w.stop()
    assert rotated.read_bytes() == b"one\ntwo\n" and path.read_bytes() == b"three\n"
    assert w.file.fd is None
    w.start()  # started again (the ingress task restarted)
    w.put([b"four"])
    w.stop()
    assert path.read_bytes() == b"three\nfour\n"


def test_lines_past_the_queue_limit_are_dropped_and_counted(tmp_path, caplog):
    caplog.set_level(logging.INFO, "agentd.ingress")
    w = FileWriter(tmp_path / "access.log", limit=10)
    w.put([b"12345678"])
    w.put([b"more", b"lines"])  # the thread has not run: over the limit
    w.start()
    w.stop()
    assert (tmp_path / "access.log").read_bytes() == b"12345678\n"
    said = warnings(caplog)
    assert len(said) == 1 and "does not keep up" in said[0], said
    assert w.file.dropped_total == 2


class Collect:
    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def put(self, lines: list[bytes]) -> None:
        self.lines += lines


def test_the_socket_hands_lines_to_the_file_and_none_to_the_agents_log(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    writer = Collect()
    log = AccessLog(tmp_path / "log.sock", writer)  # type: ignore[arg-type]
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    b.setblocking(False)
    log.sock = b
    a.send(b"GET /one\n")
    a.send(b"GET /two")
    log._drain()
    assert writer.lines == [b"GET /one\n", b"GET /two"]
    assert not [r for r in caplog.records if r.name == "agentd.ingress.access"]
    # "agent": the agent's log, as before
    log.writer = None
    a.send(b"GET /three\n")
    log._drain()
    assert [r.getMessage() for r in caplog.records if r.name == "agentd.ingress.access"] == ["GET /three"]
    a.close()
    b.close()


def test_off_tells_haproxy_not_to_log(tmp_path):
    enabled = {"data": {"enable-access-log": "true"}}
    for value, logs in (("agent", True), (str(tmp_path / "a.log"), True), ("off", False)):
        cfg = config(**{"ingress.access_log": value})
        ctl = IngressController("n1", Datastore(["http://127.0.0.1:2379"], "/agentd"), cfg.ingress, ["10.1.1.1"], tmp_path)
        ctl.objects["ConfigMap"][("kube-system", "agentd-ingress")] = enabled
        files, _ = asyncio.run(ctl._render())
        text = files["haproxy.cfg"].decode()
        assert ("    log global" in text) == logs and ("    no log" in text) != logs, (value, text)
        assert (str(ctl.paths.log_socket) in text) == logs
        assert (ctl.access_log.writer is not None) == value.startswith("/")


def test_a_failing_file_is_in_status_and_agentd_status(tmp_path):
    from agentd.cli import _ingress_line

    path = tmp_path / "no-such-dir" / "access.log"
    cfg = config(**{"ingress.access_log": str(path)})
    ctl = IngressController("n1", Datastore(["http://127.0.0.1:2379"], "/agentd"), cfg.ingress, ["10.1.1.1"], tmp_path)
    assert ctl.views.status()["access_log"] == {"to": str(path), "error": None, "dropped": 0}
    ctl.access_log.writer.file.write(b"GET /a\nGET /b\n", 0.0)  # type: ignore[union-attr]
    shown = ctl.views.status()["access_log"]
    assert shown == {"to": str(path), "error": "cannot open it: No such file or directory", "dropped": 2}, shown
    line = _ingress_line(ctl.views.status())
    assert f"access log {path}: cannot open it: No such file or directory (2 lines dropped)" in line, line
