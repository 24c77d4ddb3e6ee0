"""A connection reset before the event loop set its transport up (a connect scan, a health
check, a peer that gave up; RST right after the handshake): uvloop's transport then has no
``peername`` (nor ``sockname``) -- None.  Inbound, it is refused and aborted, counted with
the other refusals, not a TypeError traceback in the loop's exception handler per connection
(anyone who reaches port 179 could flood the log so); outbound, it is a failed connect.

Fake transports and a fake loop stand in for uvloop's, sans-IO: the clock is passed in.
"""

from __future__ import annotations

import asyncio
import socket

from bgp import State
from bgp.session import Connect
from bgp.testing import make_speaker
from bgp.transport import SpeakerService, _Protocol


class GoneTransport:
    """A uvloop transport whose socket was reset before it was set up: no addresses."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        self.sock = sock
        self.aborted = False
        self.closed = False

    def get_extra_info(self, name: str, default=None):
        return default  # peername, sockname, socket: None

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def is_closing(self) -> bool:
        return self.aborted or self.closed

    def get_write_buffer_size(self) -> int:
        return 0

    def abort(self) -> None:
        self.aborted = True
        if self.sock is not None:
            self.sock.close()

    def close(self) -> None:
        self.closed = True
        if self.sock is not None:
            self.sock.close()


def service() -> SpeakerService:
    sp = make_speaker("127.0.0.1", 65000, [("127.0.0.2", 65000)])
    return SpeakerService(sp, listen=("127.0.0.1", 0), clock=lambda: 0.0)


def test_an_inbound_connection_reset_before_it_was_set_up_is_refused_and_aborted():
    svc = service()
    transport = GoneTransport()
    proto = _Protocol(svc, None)
    proto.connection_made(transport)  # raised TypeError: 'NoneType' object is not subscriptable
    assert transport.aborted
    assert svc.speaker.counters["connections refused"] == 1
    assert proto.conn is None and not svc._protocols
    proto.connection_lost(ConnectionResetError())  # then uvloop reads the reset: nothing to tell
    assert svc.speaker.peers["127.0.0.2"].session.conn is None


class FakeHandle:
    def cancel(self) -> None:
        pass


class FakeLoop:
    """Just what SpeakerService._connect asks of its loop: the connection is reset between
    the connect and the transport's setup."""

    def __init__(self) -> None:
        self.transports: list[GoneTransport] = []
        self.timers: list[float] = []

    def call_later(self, delay: float, callback):
        self.timers.append(delay)
        return FakeHandle()

    async def sock_connect(self, sock: socket.socket, address) -> None:
        pass

    async def create_connection(self, factory, sock: socket.socket):
        proto = factory()
        transport = GoneTransport(sock)
        self.transports.append(transport)
        proto.connection_made(transport)
        return transport, proto

    def create_task(self, coro):
        raise AssertionError("no new connection at once")


def test_an_outbound_connection_reset_before_it_was_set_up_is_a_failed_connect():
    svc = service()
    sp = svc.speaker
    sp.start(0.0)
    (action,) = [a for a in sp.take_actions() if isinstance(a, Connect)]
    assert sp.peers["127.0.0.2"].session.state is State.CONNECT
    loop = FakeLoop()
    svc._loop = loop  # type: ignore[assignment]
    svc._bfd_version = sp.peers_version  # (no BFD here)
    svc._connecting[action.conn] = None  # type: ignore[assignment]
    asyncio.run(svc._connect(action))  # raised TypeError: 'NoneType' object is not subscriptable
    (transport,) = loop.transports
    assert transport.aborted and transport.sock is not None and transport.sock.fileno() == -1
    assert not svc._protocols and action.conn not in svc._connecting
    peer = sp.peers["127.0.0.2"]
    assert peer.session.conn is None and peer.state is State.IDLE  # tried again after the backoff:
    assert loop.timers == [peer.get_timer()]


def _recording_sockets(monkeypatch) -> list[socket.socket]:
    """Every socket made from now on (socket.socket replaced for the test)."""
    made: list[socket.socket] = []
    real = socket.socket

    class Recorded(real):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(socket, "socket", Recorded)
    return made


async def test_a_listener_that_cannot_bind_is_closed_not_left_open(monkeypatch):
    """start() whose bind fails (the port taken, the address not ours) raises, and leaves no
    socket behind: it held the half-set-up listener open until the process ended."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        sp = make_speaker("127.0.0.1", 65000, [("127.0.0.2", 65000)])
        svc = SpeakerService(sp, listen=("127.0.0.1", taken.getsockname()[1]), clock=lambda: 0.0)
        made = _recording_sockets(monkeypatch)
        try:
            await svc.start()
        except OSError:
            pass
        else:
            raise AssertionError("bind to a taken port succeeded")
    assert len(made) == 1
    assert made[0].fileno() == -1  # closed
    assert svc._listen_sock is None and svc._server is None


async def test_a_listener_whose_server_cannot_be_made_is_closed_too(monkeypatch):
    """Past bind and listen -- its MD5 keys set (_sync_listener) -- create_server failing
    leaves no socket either, nor one the service still takes for its listener."""
    async def refused(*_args, **_kwargs):
        raise OSError(24, "Too many open files")

    svc = service()
    made = _recording_sockets(monkeypatch)
    monkeypatch.setattr(asyncio.get_running_loop(), "create_server", refused)
    try:
        await svc.start()
    except OSError:
        pass
    else:
        raise AssertionError("create_server's failure was not raised")
    assert len(made) == 1 and made[0].fileno() == -1
    assert svc._listen_sock is None and svc._server is None
