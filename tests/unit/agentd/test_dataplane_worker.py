"""The user-space worker process's own parts (agentd/dataplane/worker.py), without a TUN: its
control channel under bad input, a state file it cannot save, a start that fails after the TUN
was made, the next hops and members the control protocol takes, and what the worker hands its
receive side.  A fake TUN device (a socketpair) and a fake transport stand in for the kernel's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import tempfile

import pytest

from agentd.dataplane import worker as W
from agentd.dataplane._forward import NextHopTable, parse_members, unicast_ipv4
from agentd.dataplane.control import DataplaneClient, DataplaneError


class FakeTun:
    """What open_tun returns, on a socketpair; it records the calls that matter here."""

    def __init__(self, created: bool, calls: list) -> None:
        self.created = created
        self._a, self._b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.fd = self._a.fileno()
        self.offloads: dict = {}
        self.fallbacks: dict = {}
        self.calls = calls

    def set_persist(self, persist: bool) -> None:
        self.calls.append(("tun.set_persist", persist))

    def close(self) -> None:
        self.calls.append(("tun.close",))
        self._a.close()
        self._b.close()


class FakeTransport:
    """The udp transport's face to the worker: it keeps the table and members it is given."""

    def __init__(self, *_a, calls: list, **_kw) -> None:
        self.offloads = {"udp_gso": False, "udp_gro": False}
        self.fallbacks: dict = {}
        self.too_big = None
        self.table = None
        self.members = None
        self.calls = calls

    def fileno(self) -> int:
        return -1

    def close(self) -> None:
        self.calls.append(("transport.close",))

    def set_table(self, table) -> None:
        self.table = table

    def set_members(self, members) -> None:
        self.members = members

    def bind_tx_buffer(self, _buf) -> None:
        pass


@pytest.fixture
def short_dir():
    """A directory for control sockets whose path fits sun_path (108 bytes)."""
    with tempfile.TemporaryDirectory(prefix="dpw") as d:
        yield d


def make_worker(monkeypatch, control: str, *, created: bool = True, **cfg) -> tuple[W.Worker | None, list, BaseException | None]:
    """A Worker on a fake TUN and transport (the Python loops: no C state); returns (worker or
    None, the cleanup calls made, the exception its start raised)."""
    calls: list = []
    monkeypatch.setattr(W, "open_tun", lambda *_a, **_k: FakeTun(created, calls))
    monkeypatch.setitem(W.TRANSPORTS, "udp", lambda *a, **k: FakeTransport(*a, calls=calls, **k))
    monkeypatch.setattr(W, "local_source_accepted", lambda _name: True)
    config = W.WorkerConfig(kind="udp", tun="agentd.udp", mtu=1472, local_ip="192.0.2.1", control=control,
                            fast_path="python", **cfg)
    try:
        return W.Worker(config), calls, None
    except (W.TunError, OSError) as exc:  # what main() catches before it returns 1
        return None, calls, exc


# -- a start that fails after the TUN was made (review r2 #3) ------------------------------------


def test_a_start_that_fails_after_making_the_tun_removes_it(monkeypatch, short_dir):
    """The control socket's path is too long for AF_UNIX (ControlServer fails): the TUN this
    worker created is made non-persistent and closed -- the kernel removes it -- and the
    transport is closed; before, a persistent TUN (accept_local on) stayed with no worker."""
    too_long = os.path.join(short_dir, "x" * 120 + ".sock")
    worker, calls, exc = make_worker(monkeypatch, too_long)
    assert worker is None and isinstance(exc, OSError), exc
    assert ("tun.set_persist", False) in calls and ("tun.close",) in calls and ("transport.close",) in calls
    assert calls.index(("tun.set_persist", False)) < calls.index(("tun.close",))


def test_a_start_that_fails_leaves_a_tun_it_did_not_make(monkeypatch, short_dir):
    """A TUN that was there before (a previous worker's, with the kernel routes through it)
    stays persistent: the next worker attaches to it."""
    worker, calls, exc = make_worker(monkeypatch, os.path.join(short_dir, "x" * 120 + ".sock"), created=False)
    assert worker is None and exc is not None
    assert ("tun.close",) in calls and not [c for c in calls if c[0] == "tun.set_persist"]


def test_a_start_that_fails_because_a_worker_serves_the_control_socket_removes_its_tun(monkeypatch, short_dir):
    path = os.path.join(short_dir, "c.sock")
    running = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    running.bind(path)
    running.listen(1)
    try:
        worker, calls, exc = make_worker(monkeypatch, path)
    finally:
        running.close()
    assert worker is None and "served by a running worker" in str(exc)
    assert ("tun.set_persist", False) in calls and ("tun.close",) in calls


# -- bad control input, a state file that cannot be saved (review r2 #2) -------------------------


@contextlib.contextmanager
def running_worker(monkeypatch, short_dir, **cfg):
    worker, _calls, exc = make_worker(monkeypatch, os.path.join(short_dir, "c.sock"), **cfg)
    assert worker is not None, exc
    try:
        yield worker
    finally:
        worker.close()


def _ask(worker: W.Worker, client: socket.socket, data: bytes) -> dict:
    """Send ``data`` (one request line) and let the worker's control server answer it."""
    client.sendall(data)
    fd = next(iter(worker.control.clients))
    client.setblocking(False)
    answer = b""
    while not answer.endswith(b"\n"):
        worker.control.readable(fd)
        with contextlib.suppress(BlockingIOError):
            answer += client.recv(1 << 16)
    return json.loads(answer)


def test_a_request_nested_too_deeply_is_answered_with_an_error_and_the_worker_goes_on(monkeypatch, short_dir):
    """json's decoder recurses per nesting level: 100,000 ``[`` raised RecursionError out of the
    control server and ended the worker's loop (the worker exited)."""
    with running_worker(monkeypatch, short_dir) as worker:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(worker.control.path)
        worker.control.readable(worker.control.listener.fileno())  # accepted
        try:
            resp = _ask(worker, client, b"[" * 100000 + b"\n")
            assert resp["ok"] is False and "nested too deeply" in resp["error"], resp
            # The same connection still works.
            assert _ask(worker, client, b'{"op": "get"}\n')["ok"] is True
            assert len(worker.control.clients) == 1
        finally:
            client.close()


def test_a_value_nested_too_deeply_to_show_is_refused_not_raised(monkeypatch, short_dir):
    deep: list = []
    for _ in range(sys.getrecursionlimit() - 30):
        deep = [deep]
    with running_worker(monkeypatch, short_dir) as worker:
        resp = worker.handle_request({"op": "set_members", "members": [deep]})
        assert resp["ok"] is False and worker.members == frozenset()


def test_a_state_file_that_cannot_be_saved_keeps_the_new_table_and_says_so(monkeypatch, short_dir):
    """/run/agentd full, read-only or gone: every change raised OSError after it was applied
    and killed the worker (restarted by the agent, given the table, dead again).  Now the
    change is answered (applied: forwarding uses it) with a warning, stats say it under
    fallbacks, and a later save that works clears it."""
    gone = os.path.join(short_dir, "no-such-dir", "c.sock.state")
    with running_worker(monkeypatch, short_dir, state=gone) as worker:
        resp = worker.handle_request({"op": "set_next_hops", "next_hops": {"10.244.1.0/24": "192.0.2.2"}})
        assert resp["ok"] is True and resp["next_hops"] == 1 and "cannot save the state file" in resp["warning"]
        assert worker.table.routes == {"10.244.1.0/24": "192.0.2.2"}
        assert worker.transport.table is worker.table and worker.tx.table is worker.table
        resp = worker.handle_request({"op": "set_members", "members": ["192.0.2.2"]})
        assert resp["ok"] is True and "warning" in resp and worker.transport.members == {"192.0.2.2"}
        stats = worker.handle_request({"op": "stats"})["stats"]
        assert "No such file or directory" in stats["fallbacks"]["state_file"]
        assert not os.path.exists(gone + ".tmp")
        os.mkdir(os.path.dirname(gone))  # the directory is back: the next change is saved
        resp = worker.handle_request({"op": "set_next_hops", "next_hops": {"10.244.1.0/24": "192.0.2.2"}})
        assert resp == {"ok": True, "next_hops": 1, "sources": 1}
        assert "state_file" not in worker.handle_request({"op": "stats"})["stats"]["fallbacks"]
        with open(gone) as f:
            assert json.load(f)["members"] == ["192.0.2.2"]


def test_a_state_file_nested_too_deeply_is_ignored(monkeypatch, short_dir):
    state = os.path.join(short_dir, "deep.state")
    with open(state, "w") as f:
        f.write("[" * 100000)
    with running_worker(monkeypatch, short_dir, state=state) as worker:
        assert worker.table.routes == {}


# -- the receive side gets the next hops (review r2 #1) --------------------------------------------


def test_the_reverse_path_table_reaches_the_receive_side_and_the_state_file(monkeypatch, short_dir):
    """set_next_hops' "sources" (every peer node's subnets: a peer this worker does not send to
    still sends here) is what the receive side checks inner sources against; without it, the
    next hops.  Both survive in the state file for the next worker."""
    peer, gw = socket.inet_aton("192.0.2.2"), socket.inet_aton("192.0.2.3")
    with running_worker(monkeypatch, short_dir, state=os.path.join(short_dir, "s.state")) as worker:
        resp = worker.handle_request({"op": "set_next_hops", "next_hops": {"10.244.1.0/24": "192.0.2.2"}})
        assert resp["ok"] and worker.transport.table is worker.sources is worker.table
        assert worker.transport.table.source_ok(socket.inet_aton("10.244.1.7"), peer)
        resp = worker.handle_request({"op": "set_next_hops", "next_hops": {"10.244.1.0/24": "192.0.2.2"},
                                      "sources": {"10.244.1.0/24": "192.0.2.2", "10.244.3.0/24": "192.0.2.3"}})
        assert resp == {"ok": True, "next_hops": 1, "sources": 2}
        assert worker.table.routes == {"10.244.1.0/24": "192.0.2.2"} and worker.transport.table is worker.sources
        assert worker.transport.table.source_ok(socket.inet_aton("10.244.3.7"), gw)
        assert worker.handle_request({"op": "get"})["sources"] == worker.sources.routes
        assert "spoofed" in worker.handle_request({"op": "stats"})["stats"]["drops"]
        bad = worker.handle_request({"op": "set_next_hops", "next_hops": {}, "sources": {"10.244.3.0/24": "0.0.0.0"}})
        assert bad["ok"] is False and worker.sources.routes["10.244.3.0/24"] == "192.0.2.3"  # nothing changed
    with running_worker(monkeypatch, short_dir, state=os.path.join(short_dir, "s.state")) as worker:
        pass  # (a clean stop removes the state file: the next worker starts without a table)
    with open(os.path.join(short_dir, "s.state"), "w") as f:
        json.dump({"kind": "udp", "next_hops": {"10.244.1.0/24": "192.0.2.2"},
                   "sources": {"10.244.3.0/24": "192.0.2.3"}, "members": []}, f)
    with running_worker(monkeypatch, short_dir, state=os.path.join(short_dir, "s.state")) as worker:
        assert worker.sources.routes == {"10.244.3.0/24": "192.0.2.3"} and worker.transport.table is worker.sources


# -- next hops and members are unicast (review r2 #4) ----------------------------------------------


NOT_UNICAST = ["0.0.0.0", "255.255.255.255", "224.0.0.1", "239.255.255.250"]


@pytest.mark.parametrize("address", NOT_UNICAST)
def test_a_next_hop_or_member_that_is_no_unicast_address_is_refused(monkeypatch, short_dir, address):
    """The command line refused these for --local-ip; the control protocol took them: 0.0.0.0
    was "no route" to the C loop (net unreachable) and an address to send to for the Python
    loops (delivered locally), the same table behaving differently per loop."""
    with pytest.raises(ValueError, match="bad next-hop address"):
        NextHopTable({"10.244.1.0/24": address})
    with pytest.raises(ValueError, match="bad member address"):
        parse_members(["192.0.2.2", address])
    with pytest.raises(ValueError, match="not a unicast"):
        unicast_ipv4(address)
    with running_worker(monkeypatch, short_dir) as worker:
        resp = worker.handle_request({"op": "set_next_hops", "next_hops": {"10.244.1.0/24": address}})
        assert resp["ok"] is False and "bad next-hop address" in resp["error"]
        resp = worker.handle_request({"op": "set_members", "members": [address]})
        assert resp["ok"] is False and "bad member address" in resp["error"]
        assert worker.table.routes == {} and worker.members == frozenset()
    # The agent's client refuses them before asking.
    client = DataplaneClient(None, None, "/nowhere")  # type: ignore[arg-type]
    with pytest.raises(DataplaneError, match="bad next hop"):
        asyncio.run(client.set_next_hops({"10.244.1.0/24": address}))
    with pytest.raises(DataplaneError, match="bad member"):
        asyncio.run(client.set_members([address]))


def test_unicast_next_hops_and_members_are_taken():
    assert NextHopTable({"10.244.1.0/24": "192.0.2.2"}).lookup("10.244.1.3") == "192.0.2.2"
    assert parse_members(["192.0.2.2", "10.0.0.1"]) == {"192.0.2.2", "10.0.0.1"}
    assert unicast_ipv4("192.0.2.2") == "192.0.2.2"
