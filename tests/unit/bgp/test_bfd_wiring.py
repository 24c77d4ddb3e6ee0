"""How the speaker's transport (bgp.transport.SpeakerService) wires BFD in: which peers get a
session, from which source address, and what happens when the BFD sockets cannot be opened.

No sockets here: the BFD service is a recording fake, the BGP connections are fake transports,
and the event loop is never run (its timers are only scheduled)."""

from __future__ import annotations

import asyncio
import random
from ipaddress import IPv4Address, ip_network

import pytest

from bgp import ListenRange, PeerSettings, Speaker
from bgp.settings import LocalSettings
from bgp.transport import SpeakerService, _Protocol

RR = "10.1.0.1"
BFD = (0.1, 3)


class FakeBfd:
    """What SpeakerService calls on a BfdService, recorded."""

    def __init__(self, fail_open: OSError | None = None) -> None:
        self.started = False
        self.fail_open = fail_open
        self.opens = 0
        self.listen: set[str] = set()
        self.sessions: dict[str, str | None] = {}  # peer -> local address

    def open(self, addresses=None) -> None:
        self.opens += 1
        if self.fail_open is not None:
            raise self.fail_open
        self.started = True
        self.listen = set(addresses or ())

    def set_listen(self, addresses) -> None:
        self.listen = set(addresses)

    def add(self, peer, local_address=None, settings=None) -> None:
        self.sessions[peer] = local_address

    def remove(self, peer, *, drain=True) -> None:
        self.sessions.pop(peer, None)

    async def stop(self) -> None:
        self.started = False


class FakeTransport:
    def __init__(self, peer: str, local: str) -> None:
        self.peer = peer
        self.local = local
        self.closing = False
        self.written: list = []

    def get_extra_info(self, name, default=None):
        return {"peername": (self.peer, 40000), "sockname": (self.local, 179)}.get(name, default)

    def writelines(self, chunks) -> None:
        self.written.extend(chunks)

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        self.closing = True

    abort = close


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def service(loop, bfd: FakeBfd, *, listen=None) -> SpeakerService:
    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address(RR), cluster_id=IPv4Address(RR)), now=0.0,
                 rng=random.Random(1))
    svc = SpeakerService(sp, listen=None, clock=lambda: 0.0, bfd=bfd)  # type: ignore[arg-type]
    loop.run_until_complete(svc.start())  # (no BGP listener: start() binds nothing without one)
    svc.listen = listen  # what [bgp] listen says, for the choice of BFD addresses
    return svc


def inbound(svc: SpeakerService, peer: str, local: str = RR) -> _Protocol:
    proto = _Protocol(svc, None)
    proto.transport = FakeTransport(peer, local)  # type: ignore[assignment]
    svc._inbound(proto)
    return proto


def client_range(bfd=BFD) -> ListenRange:
    return ListenRange(ip_network("10.1.0.0/16"), PeerSettings(IPv4Address("10.1.0.0"), 65000, rr_client=True, bfd=bfd))


def test_a_client_accepted_from_a_listen_range_gets_a_bfd_session_and_loses_it_when_forgotten(loop):
    bfd = FakeBfd()
    svc = service(loop, bfd)
    svc.set_listen_ranges([client_range()])
    assert bfd.sessions == {}
    proto = inbound(svc, "10.1.0.7")
    assert proto.conn is not None and "10.1.0.7" in svc.speaker.dynamic
    assert "10.1.0.7" in bfd.sessions
    # Its connection goes: the speaker forgets the client, and its BFD session goes too.
    svc._lost(proto.conn)
    assert "10.1.0.7" not in svc.speaker.peers
    assert bfd.sessions == {}


def test_a_listen_range_that_stops_asking_for_bfd_ends_its_clients_sessions(loop):
    bfd = FakeBfd()
    svc = service(loop, bfd)
    svc.set_listen_ranges([client_range()])
    inbound(svc, "10.1.0.7")
    assert "10.1.0.7" in bfd.sessions
    svc.set_listen_ranges([client_range(bfd=None)])
    assert bfd.sessions == {}
