"""TCP MD5 keys (RFC 2385) on the BGP listener, with real sockets on loopback: setsockopt
TCP_MD5SIG needs no privilege, so the kernel itself says which keys a listener takes.

An IPv4 listen range on a dual-stack (IPv6) listener is keyed IPv4-mapped with its IPv4 prefix
length; an IPv6 peer or range on an IPv4 listener is skipped and said once; a key the listener
refuses is logged, not raised, and the others still go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from ipaddress import IPv4Address

import pytest

from bgp import ListenRange, PeerSettings, Speaker
from bgp.settings import LocalSettings
from bgp.transport import SpeakerService, set_md5, set_md5_prefix

PASSWORD = "sesame"


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 on loopback")


@contextlib.contextmanager
def dual_stack_listener():
    """An IPv6 listener that takes IPv4 connections too, as ``[bgp] listen = "[::]:179"`` makes
    (here on 127.0.0.1 as ::ffff:127.0.0.1, an ephemeral port)."""
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::ffff:127.0.0.1", 0))
        sock.listen(4)
        sock.settimeout(5.0)
        yield sock
    finally:
        sock.close()


def signed_connect(port: int, password: str) -> socket.socket:
    """A connection from 127.0.0.1 whose segments carry an MD5 signature made with ``password``."""
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    set_md5(client, "127.0.0.1", password)
    client.settimeout(5.0)
    client.connect(("127.0.0.1", port))
    return client


# ---------------------------------------------------------------- an IPv4 range on a dual-stack listener


@needs_ipv6
def test_an_ipv4_prefix_key_is_taken_by_a_dual_stack_listener_and_signs_its_connections():
    with dual_stack_listener() as listener:
        set_md5_prefix(listener, "10.0.0.0", 24, PASSWORD)  # was: /120, EINVAL
        set_md5_prefix(listener, "127.0.0.0", 8, PASSWORD)
        port = listener.getsockname()[1]
        # The key covers 127.0.0.1 as an IPv4 peer: a signed SYN from it is answered (a listener
        # without a matching key drops signed segments, and the connect would time out).
        client = signed_connect(port, PASSWORD)
        try:
            conn, peer = listener.accept()
            conn.close()
            assert peer[0] == "::ffff:127.0.0.1"
        finally:
            client.close()
        set_md5_prefix(listener, "127.0.0.0", 8, None)  # and it is removed the same way
        set_md5_prefix(listener, "10.0.0.0", 24, None)


@needs_ipv6
def test_a_listen_range_with_a_password_on_a_dual_stack_listener_starts(caplog):
    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1")), now=0.0, rng=random.Random(1))
    sp.set_listen_ranges([ListenRange("10.0.0.0/24", PeerSettings("10.0.0.0", 65000, password=PASSWORD))], 0.0)
    svc = SpeakerService(sp, listen=("::ffff:127.0.0.1", 0), clock=lambda: 0.0)

    async def run() -> None:
        await svc.start()  # the keys are set before the speaker starts: this raised
        try:
            assert svc._md5_keys == {"10.0.0.0/24": PASSWORD}
        finally:
            await svc.stop(graceful=False)

    with caplog.at_level(logging.WARNING, logger="bgp"):
        asyncio.run(run())
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


# ---------------------------------------------------------------- IPv6 keys on an IPv4 listener, refused keys


def ipv4_service() -> SpeakerService:
    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1")), now=0.0, rng=random.Random(1))
    return SpeakerService(sp, listen=("127.0.0.1", 0), clock=lambda: 0.0)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_ipv6_peer_with_a_password_on_an_ipv4_listener_is_skipped_and_said_once(caplog):
    svc = ipv4_service()
    # Passive peers: the test connects nowhere.
    v4 = PeerSettings("127.0.0.2", 65001, passive=True, password=PASSWORD)
    v6 = PeerSettings("fd00::2", 65001, passive=True, password=PASSWORD)
    v6_range = ListenRange("fd00:1::/64", PeerSettings("fd00:1::", 65001, password=PASSWORD))

    async def run() -> None:
        await svc.start()
        try:
            with caplog.at_level(logging.WARNING, logger="bgp"):
                svc.set_peers([v4, v6])  # raised EINVAL (an AF_INET6 key on an AF_INET socket)
                svc.set_listen_ranges([v6_range])
            assert set(svc.speaker.peers) == {"127.0.0.2", "fd00::2"}
            assert svc._md5_keys == {"127.0.0.2": PASSWORD}
            said = warnings(caplog)
            assert len(said) == 2 and all("the BGP listener 127.0.0.1:0 is IPv4" in m for m in said), said
            assert any("fd00::2" in m for m in said) and any("fd00:1::/64" in m for m in said)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="bgp"):
                svc.set_peers([v4, v6])  # nothing new to say
            assert warnings(caplog) == []
            assert svc._md5_keys == {"127.0.0.2": PASSWORD}
        finally:
            await svc.stop(graceful=False)

    asyncio.run(run())


def test_a_key_the_listener_refuses_is_logged_and_the_others_still_set(caplog):
    svc = ipv4_service()
    bad = PeerSettings("127.0.0.3", 65001, passive=True, password="x" * 81)  # over TCP_MD5SIG_MAXKEYLEN
    good = PeerSettings("127.0.0.2", 65001, passive=True, password=PASSWORD)

    async def run() -> None:
        await svc.start()
        try:
            with caplog.at_level(logging.WARNING, logger="bgp"):
                svc.set_peers([bad, good])
            assert svc._md5_keys == {"127.0.0.2": PASSWORD}  # only what the listener has
            (said,) = warnings(caplog)
            assert "could not set the TCP MD5 key for 127.0.0.3" in said
            # Corrected, it is set at the next sync.
            svc.set_peers([PeerSettings("127.0.0.3", 65001, passive=True, password="short"), good])
            assert svc._md5_keys == {"127.0.0.2": PASSWORD, "127.0.0.3": "short"}
        finally:
            await svc.stop(graceful=False)

    asyncio.run(run())
