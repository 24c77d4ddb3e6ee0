"""Link-local peers (a fe80::/10 listen range, BGP unnumbered): a peer is keyed by its address
without the %zone, so a connection from the same link-local address on another interface -- a
second router that also uses fe80::1 -- is refused while the first one's is open, not taken
for a collision with it.  No sockets: fake transports, the loop never run."""

from __future__ import annotations

import asyncio
import random
from ipaddress import IPv4Address, IPv6Address, ip_network

import pytest

from bgp import ListenRange, PeerSettings, Speaker
from bgp.settings import LocalSettings
from bgp.transport import SpeakerService, _Protocol


class FakeTransport:
    def __init__(self, peername: tuple, sockname: tuple) -> None:
        self.info = {"peername": peername, "sockname": sockname}
        self.closing = False

    def get_extra_info(self, name, default=None):
        return self.info.get(name, default)

    def writelines(self, chunks) -> None:
        pass

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


def inbound(svc: SpeakerService, peer: str, scope: int) -> _Protocol:
    proto = _Protocol(svc, None)
    proto.transport = FakeTransport((peer, 40000, 0, scope), ("fe80::99", 179, 0, scope))  # type: ignore[assignment]
    svc._inbound(proto)
    return proto


def test_a_link_local_address_connected_on_one_interface_is_refused_on_another(loop, caplog):
    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address("10.1.0.1")),
                 now=0.0, rng=random.Random(1))
    svc = SpeakerService(sp, listen=None, clock=lambda: 0.0)
    loop.run_until_complete(svc.start())
    svc.set_listen_ranges([ListenRange(ip_network("fe80::/10"), PeerSettings(IPv6Address("fe80::"), 65001))])
    first = inbound(svc, "fe80::1", 2)
    assert first.conn is not None and "fe80::1" in sp.dynamic
    with caplog.at_level("INFO"):
        second = inbound(svc, "fe80::1", 3)
    assert second.conn is None and second.transport.closing
    assert "a connection from fe80::1 on" in caplog.text and "peers are told apart by address" in caplog.text
    assert not first.transport.closing  # the first router's session is left alone
    # The same interface again (the router reconnecting): a collision as ever, not refused for its link.
    third = inbound(svc, "fe80::1", 2)
    assert third.conn is not None
    # Once the first interface's connections are gone, the other interface may connect.
    svc._lost(first.conn)
    svc._lost(third.conn)
    assert inbound(svc, "fe80::1", 3).conn is not None
