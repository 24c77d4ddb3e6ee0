"""bgp.bfd_transport.BfdService on loopback sockets, its callbacks driven by hand with a clock
the test moves: no sleeps, the event loop is never left to run its timers.

Our side listens on 127.0.0.1, the neighbour is a plain UDP socket on 127.0.0.2 (TTL 255)
that sends what the test tells it to."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator

from bgp.bfd import BfdSettings
from bgp.bfd_transport import BfdService
from proto.bfd import ControlPacket, Diag, State

OURS, THEIRS = "127.0.0.1", "127.0.0.2"
FAST = BfdSettings(0.1, 0.1, 3)  # Detection Time 0.3 s


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Neighbour:
    """The far end: sends Control packets from 127.0.0.2 with TTL 255, reads ours."""

    def __init__(self, port: int, discr: int = 0x77) -> None:
        self.port = port
        self.discr = discr
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, 255)
        self.sock.bind((THEIRS, port))
        self.sock.setblocking(False)

    def send(self, state: State, your: int) -> None:
        packet = ControlPacket(state, self.discr, your, detect_mult=3, desired_min_tx=100_000, required_min_rx=100_000)
        self.sock.sendto(packet.encode(), (OURS, self.port))

    def received(self) -> list[tuple[int, ControlPacket]]:
        """(source port, packet) for everything our side sent since the last call."""
        out = []
        while True:
            try:
                data, addr = self.sock.recvfrom(512)
            except BlockingIOError:
                return out
            out.append((addr[1], ControlPacket.decode(data)))

    def close(self) -> None:
        self.sock.close()


def service(clock: Clock, changes: list) -> tuple[BfdService, Neighbour]:
    bfd = BfdService(port=0, clock=clock, on_change=lambda peer, change: changes.append(change))
    bfd.open([OURS])
    bfd.port = bfd.listen_addresses[0][1]  # a free port for both ends (3784 needs no root, but may be taken)
    return bfd, Neighbour(bfd.port)


@contextlib.asynccontextmanager
async def running_service() -> AsyncIterator[tuple[BfdService, Neighbour, Clock, list]]:
    """``service`` on a new clock, stopped and its neighbour closed at the end."""
    clock, changes = Clock(), []
    bfd, nbr = service(clock, changes)
    try:
        yield bfd, nbr, clock, changes
    finally:
        await bfd.stop()
        nbr.close()


def read(bfd: BfdService) -> None:
    """What the loop does when the receive socket is readable."""
    for sock in list(bfd._rx.values()):
        bfd._readable(sock)


def bring_up(bfd: BfdService, nbr: Neighbour, **add) -> int:
    bfd.add(THEIRS, settings=FAST, **add)
    mine = bfd.session(THEIRS).local_discr
    nbr.send(State.DOWN, 0)
    read(bfd)
    nbr.send(State.UP, mine)
    read(bfd)
    assert bfd.state(THEIRS) is State.UP
    return mine


def fire_timer(bfd: BfdService) -> None:
    """The session's call_later timer runs (whichever of transmit / detection it was set for)."""
    nb = bfd._by_address[THEIRS]
    assert nb.timer is not None
    nb.timer.cancel()
    bfd._on_timer(nb)


def test_a_busy_loop_that_runs_the_detection_timer_before_reading_the_neighbours_packets_keeps_the_session_up():
    # uvloop runs due timers before it reads sockets that became readable during a long
    # callback: the neighbour's on-time packets are still unread when the detection timer fires.
    async def run() -> None:
        async with running_service() as (bfd, nbr, clock, changes):
            mine = bring_up(bfd, nbr, local_address=OURS)
            changes.clear()
            packets_in = bfd.session(THEIRS).packets_in
            for _ in range(4):  # sent every 100 ms, not read: the loop is busy elsewhere
                clock.t += 0.1
                nbr.send(State.UP, mine)
            assert clock.t >= bfd.session(THEIRS).detect_at  # the Detection Time is due
            fire_timer(bfd)
            assert bfd.state(THEIRS) is State.UP and changes == []
            assert bfd.session(THEIRS).packets_in == packets_in + 4
            # A neighbour that really fell silent is still declared down, with diag 1.
            clock.t += 0.31
            fire_timer(bfd)
            assert bfd.state(THEIRS) is State.DOWN
            assert [(c.old, c.state, c.diag, c.failure) for c in changes] == [
                (State.UP, State.DOWN, Diag.CONTROL_DETECTION_TIME_EXPIRED, True)
            ]

    asyncio.run(run())


def test_a_new_source_address_replaces_the_session_with_one_admin_down_not_a_drain_beside_the_new_one():
    # Two sessions to one neighbour make it flap between them (it keys its one session by our
    # address): the old one says AdminDown once and is gone before the new one starts.
    async def run() -> None:
        async with running_service() as (bfd, nbr, clock, changes):
            bring_up(bfd, nbr, local_address=OURS)
            changes.clear()
            old = bfd._by_address[THEIRS]
            old_port = old.source_port
            nbr.received()
            clock.t += 0.05
            bfd.add(THEIRS, local_address="127.0.0.3", settings=FAST)
            new = bfd._by_address[THEIRS]
            assert new is not old and new.local_address == "127.0.0.3"
            wire = nbr.received()
            from_old = [p for port, p in wire if port == old_port]
            assert [(p.state, p.diag) for p in from_old] == [(State.ADMIN_DOWN, Diag.ADMINISTRATIVELY_DOWN)]
            assert old.sock.fileno() < 0 and old.timer is None  # closed: nothing more from it
            assert bfd._draining == {} and bfd.peers() == [THEIRS]
            assert changes == []  # a replaced session's AdminDown is no failure of ours

    asyncio.run(run())


# ------------------------------------------------------------ which packets a session takes
# Crafted ancillary data handed to BfdService._datagram, as recvmsg would give it: the TTL and
# the pktinfo (arrival interface, destination).  The route lookup is the test's.

ETH0, BRIDGE = 7, 9  # interface indexes: the neighbour's link, a pod bridge on the same node


def ancdata(ifindex: int | None, dst: str = OURS, ttl: int | None = 255) -> list:
    from bgp.bfd_transport import IP_PKTINFO, IP_TTL

    out = [(socket.IPPROTO_IP, IP_TTL, struct.pack("=i", ttl))] if ttl is not None else []
    if ifindex is not None:
        out.append((socket.IPPROTO_IP, IP_PKTINFO, struct.pack("=i4s4s", ifindex, socket.inet_aton(dst),
                                                                socket.inet_aton(dst))))
    return out


def packet(state: State, your: int, mine: int = 0xAA) -> bytes:
    return ControlPacket(state, mine, your, detect_mult=3, desired_min_tx=100_000, required_min_rx=100_000).encode()


def crafted(clock: Clock, changes: list, route=lambda peer: ETH0) -> BfdService:
    bfd = BfdService(port=0, clock=clock, on_change=lambda peer, change: changes.append(change), route=route)
    bfd.open([OURS])
    bfd.port = bfd.listen_addresses[0][1]
    return bfd


@contextlib.asynccontextmanager
async def crafted_service(route=lambda peer: ETH0) -> AsyncIterator[tuple[BfdService, Clock, list]]:
    """``crafted`` on a new clock, stopped at the end."""
    clock, changes = Clock(), []
    bfd = crafted(clock, changes, route=route)
    try:
        yield bfd, clock, changes
    finally:
        await bfd.stop()


def crafted_up(bfd: BfdService, anc: list | None = None) -> int:
    bfd.add(THEIRS, local_address=OURS, settings=FAST)
    mine = bfd.session(THEIRS).local_discr
    bfd._datagram(packet(State.DOWN, 0), anc or ancdata(ETH0), THEIRS)
    bfd._datagram(packet(State.UP, mine), anc or ancdata(ETH0), THEIRS)
    assert bfd.state(THEIRS) is State.UP
    return mine


def test_a_packet_forged_from_another_interface_or_to_another_address_cannot_take_an_up_session_down():
    # RFC 5881 §3: the session is bound to its interface.  A pod with NET_RAW on the node's
    # bridge forging the neighbour's address with TTL 255, Your Discriminator 0 and State Down
    # took an Up session Down -- a failure, the BGP session closed with Cease/10.
    async def run() -> None:
        async with crafted_service() as (bfd, _, changes):
            mine = crafted_up(bfd)
            changes.clear()
            session = bfd.session(THEIRS)
            packets_in = session.packets_in
            bfd._datagram(packet(State.DOWN, 0, mine=0x1234), ancdata(BRIDGE), THEIRS)
            bfd._datagram(packet(State.DOWN, mine), ancdata(BRIDGE), THEIRS)  # (had it seen ours)
            bfd._datagram(packet(State.DOWN, 0), ancdata(ETH0, dst="127.0.0.5"), THEIRS)  # another address of ours
            bfd._datagram(packet(State.DOWN, 0), ancdata(None), THEIRS)  # no pktinfo: cannot tell
            assert bfd.state(THEIRS) is State.UP and changes == [] and session.packets_in == packets_in
            assert bfd.status()[0]["bad_packets"] == 4 and bfd.unknown_packets == 0
            # The neighbour itself, on its link, to the address we send from: taken.
            bfd._datagram(packet(State.DOWN, mine), ancdata(ETH0), THEIRS)
            assert bfd.state(THEIRS) is State.DOWN and [(c.old, c.state, c.failure) for c in changes] == [
                (State.UP, State.DOWN, True)
            ]
            # The receive sockets ask the kernel for the interface and destination.
            rx = next(iter(bfd._rx.values()))
            from bgp.bfd_transport import IP_PKTINFO

            assert rx.getsockopt(socket.IPPROTO_IP, IP_PKTINFO) == 1

    asyncio.run(run())


def test_a_session_follows_its_route_to_another_interface_looking_it_up_at_most_once_a_second():
    async def run() -> None:
        routes = {THEIRS: ETH0}
        lookups: list[str] = []

        def route(peer: str) -> int | None:
            lookups.append(peer)
            return routes.get(peer)

        async with crafted_service(route=route) as (bfd, clock, _):
            mine = crafted_up(bfd)
            assert lookups == [THEIRS]  # once, when the session started
            routes[THEIRS] = BRIDGE  # the neighbour is now reached through another interface
            clock.t += 0.5
            bfd._datagram(packet(State.UP, mine), ancdata(BRIDGE), THEIRS)
            assert bfd.status()[0]["bad_packets"] == 1 and len(lookups) == 1  # not looked up again yet
            clock.t += 0.5
            bfd._datagram(packet(State.UP, mine), ancdata(BRIDGE), THEIRS)
            assert bfd.status()[0]["bad_packets"] == 1 and len(lookups) == 2
            assert bfd._by_address[THEIRS].ifindex == BRIDGE and bfd.state(THEIRS) is State.UP
            # No route at all: nothing is taken (the route is asked again a second later).
            routes.clear()
            clock.t += 1.0
            bfd._datagram(packet(State.UP, mine), ancdata(ETH0), THEIRS)
            assert bfd._by_address[THEIRS].ifindex is None and bfd.status()[0]["bad_packets"] == 2

    asyncio.run(run())


def test_a_kernel_that_cannot_be_asked_for_the_route_leaves_sessions_unbound_with_one_warning(caplog):
    def no_netlink(peer: str) -> int | None:
        raise PermissionError(1, "Operation not permitted")

    async def run() -> None:
        async with crafted_service(route=no_netlink) as (bfd, _, _):
            with caplog.at_level("WARNING", logger="bgp.bfd"):
                crafted_up(bfd, ancdata(BRIDGE))  # any interface: as before
                bfd.add("127.0.0.3", settings=FAST)
            assert [r.levelname for r in caplog.records if r.name == "bgp.bfd"].count("WARNING") == 1
            assert "not bound to their interfaces" in caplog.text

    asyncio.run(run())


def test_a_packet_with_our_discriminator_from_another_address_is_unknown_and_leaves_the_session_up():
    # RFC 5881 §3: one session per neighbour address.  Your Discriminator picks the session;
    # the source must still be that session's neighbour.
    async def run() -> None:
        async with crafted_service() as (bfd, _, changes):
            mine = crafted_up(bfd)
            changes.clear()
            bfd._datagram(packet(State.DOWN, mine), ancdata(ETH0), "127.0.0.3")
            assert bfd.state(THEIRS) is State.UP and changes == []
            assert bfd.unknown_packets == 1 and bfd.status()[0]["bad_packets"] == 0

    asyncio.run(run())


# ------------------------------------------------------------ stop()


def test_stop_repeats_admin_down_within_the_neighbours_detection_time():
    # One AdminDown, lost, and an agentd neighbour saw Control Detection Time Expired: a failure,
    # its BGP session to us closed with Cease/10 in the middle of our graceful restart.
    async def run() -> None:
        clock, changes = Clock(), []
        slept: list[float] = []

        async def sleep(seconds: float) -> None:  # the test's: no real waiting
            slept.append(seconds)
            clock.t += seconds

        bfd, nbr = service(clock, changes)
        bfd.sleep = sleep
        try:
            bring_up(bfd, nbr, local_address=OURS)
            port = bfd._by_address[THEIRS].source_port
            nbr.received()
            start = clock.t
            await bfd.stop()
            wire = [p for src, p in nbr.received() if src == port]
            assert [(p.state, p.diag) for p in wire] == [(State.ADMIN_DOWN, Diag.ADMINISTRATIVELY_DOWN)] * 3
            # 100 ms apart at most, all within the neighbour's Detection Time of us (3 x 100 ms).
            assert len(slept) == 2 and all(0.05 <= s <= 0.1 for s in slept) and clock.t - start < 0.3
            assert bfd._by_discr == {} and bfd._rx == {}  # all closed
        finally:
            nbr.close()

    asyncio.run(run())


def test_stop_with_no_session_up_returns_at_once():
    async def run() -> None:
        clock, changes = Clock(), []
        slept: list[float] = []

        async def sleep(seconds: float) -> None:
            slept.append(seconds)

        bfd, nbr = service(clock, changes)
        bfd.sleep = sleep
        try:
            bfd.add(THEIRS, local_address=OURS, settings=FAST)  # Down: the neighbour has nothing Up
            await bfd.stop()
            assert slept == [] and bfd._by_discr == {}
        finally:
            nbr.close()

    asyncio.run(run())


def test_the_arrival_interface_and_destination_are_read_from_ipv4_and_ipv6_pktinfo():
    from bgp.bfd_transport import IP_PKTINFO, IPV6_PKTINFO, _received_pktinfo

    v4 = struct.pack("=i4s4s", 3, socket.inet_aton("10.0.0.9"), socket.inet_aton("10.0.0.1"))
    assert _received_pktinfo([(socket.IPPROTO_IP, IP_PKTINFO, v4)]) == (3, "10.0.0.1")  # ipi_addr, not spec_dst
    v6 = socket.inet_pton(socket.AF_INET6, "fd00::1") + struct.pack("=i", 5)
    assert _received_pktinfo([(socket.IPPROTO_IPV6, IPV6_PKTINFO, v6)]) == (5, "fd00::1")
    assert _received_pktinfo([(socket.IPPROTO_IP, IP_PKTINFO, v4[:8])]) == (None, None)  # truncated


def test_a_link_local_neighbour_written_with_its_scope_keeps_that_interface_when_looked_up_again():
    # fe80::2%7: the operator named the link.  Looked up again (a packet on another interface,
    # a second later), the route to the bare fe80::2 -- which any link may answer, here the
    # bridge -- must not take the session off its link.
    async def run() -> None:
        lookups: list[str] = []

        def route(peer: str) -> int | None:
            lookups.append(peer)
            return BRIDGE

        async with crafted_service(route=route) as (bfd, clock, _):
            bfd.add(f"fe80::2%{ETH0}", settings=FAST)
            nb = bfd._by_address["fe80::2"]
            assert nb.ifindex == ETH0 and lookups == []
            clock.t += 1.0
            assert bfd._misdelivered(nb, BRIDGE, None) is not None  # a forgery on the bridge: refused
            assert nb.ifindex == ETH0 and lookups == []
            assert bfd._misdelivered(nb, ETH0, None) is None

    asyncio.run(run())


def test_a_due_detection_timer_reads_past_many_other_neighbours_packets_before_declaring_down():
    # All sessions share one wildcard receive socket.  A loop stall of about the Detection Time
    # queues several packets per neighbour: with 200 of others' ahead of this neighbour's, the
    # timer read 64 and declared it down (Cease/10 to a healthy peer).
    async def run() -> None:
        async with running_service() as (bfd, nbr, clock, changes):
            other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            other.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, 255)
            other.bind(("127.0.0.9", 0))
            try:
                mine = bring_up(bfd, nbr, local_address=OURS)
                changes.clear()
                for i in range(200):  # other neighbours' packets, queued first (no session here: unknown)
                    other.sendto(ControlPacket(State.UP, 0x100 + i, 0x9999, detect_mult=3, desired_min_tx=100_000,
                                               required_min_rx=100_000).encode(), (OURS, bfd.port))
                clock.t += 0.35  # the loop was busy; the neighbour sent in time, behind the others
                nbr.send(State.UP, mine)
                assert clock.t >= bfd.session(THEIRS).detect_at
                fire_timer(bfd)
                assert bfd.state(THEIRS) is State.UP and changes == []
                assert bfd.unknown_packets == 200
            finally:
                other.close()

    asyncio.run(run())


# ------------------------------------------------------------ GTSM-like checks (RFC 5881 §4, §5)


def test_a_packet_with_a_ttl_other_than_255_or_none_at_all_is_discarded_and_counted():
    # RFC 5881 §5: "MUST be discarded if the received TTL or Hop Limit is not equal to 255".
    # 254 is one router away; no TTL in the ancillary data means it cannot be told.
    async def run() -> None:
        async with crafted_service() as (bfd, _, changes):
            mine = crafted_up(bfd)
            changes.clear()
            session = bfd.session(THEIRS)
            packets_in = session.packets_in
            bfd._datagram(packet(State.DOWN, mine), ancdata(ETH0, ttl=254), THEIRS)
            assert bfd.status()[0]["bad_packets"] == 1
            bfd._datagram(packet(State.DOWN, mine), ancdata(ETH0, ttl=None), THEIRS)
            assert bfd.status()[0]["bad_packets"] == 2
            bfd._datagram(packet(State.DOWN, 0), ancdata(ETH0, ttl=1), THEIRS)
            assert bfd.status()[0]["bad_packets"] == 3
            assert bfd.state(THEIRS) is State.UP and changes == [] and session.packets_in == packets_in
            # From an address without a session: the service's own counter.
            bfd._datagram(packet(State.DOWN, 0), ancdata(ETH0, ttl=254), "127.0.0.3")
            assert bfd.bad_packets == 1 and bfd.unknown_packets == 0
            # The same packet with TTL 255 is taken.
            bfd._datagram(packet(State.DOWN, mine), ancdata(ETH0), THEIRS)
            assert bfd.state(THEIRS) is State.DOWN

    asyncio.run(run())


def test_sessions_send_with_ttl_255_from_a_source_port_in_49152_to_65535():
    # RFC 5881 §4: "The source port MUST be in the range 49152 through 65535"; §5: sent with
    # TTL / Hop Limit 255.  Sixteen sessions: a port drawn from a wider range would fall below
    # 49152 in one of them (all above by chance: 0.25 ** 16).
    async def run() -> None:
        async with crafted_service() as (bfd, _, _):
            peers = [f"127.0.0.{i}" for i in range(10, 26)]
            for peer in peers:
                bfd.add(peer, settings=FAST)
            ports = [bfd._by_address[peer].source_port for peer in peers]
            assert all(49152 <= port <= 65535 for port in ports), ports
            assert len(set(ports)) == len(ports)
            for peer in peers:
                sock = bfd._by_address[peer].sock
                assert sock.getsockopt(socket.IPPROTO_IP, socket.IP_TTL) == 255
            if socket.has_ipv6:
                try:
                    bfd.add("::1", settings=FAST)
                except OSError:
                    pass  # no IPv6 on this host: the IPv4 checks stand
                else:
                    nb = bfd._by_address["::1"]
                    assert nb.sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS) == 255
                    assert 49152 <= nb.source_port <= 65535

    asyncio.run(run())


def test_an_interface_scope_of_other_digits_is_a_name_not_an_index_nor_a_traceback(caplog):
    # "fe80::7%²": str.isdigit() took "²" and int() refused it (a ValueError out of add(), the
    # except caught OSError only); "%٣" was read as interface 3.  Both are names: no such link,
    # so unbound with the one warning.  "%5" is interface 5.
    from types import SimpleNamespace

    from bgp.bfd_transport import ANY_INTERFACE

    bfd = BfdService(port=0, clock=Clock(), on_change=lambda peer, change: None, route=lambda peer: ETH0)
    nb = SimpleNamespace(ifindex=None, ifindex_at=None, written=None, address="fe80::7")
    for scope in ("²", "٣", "9" * 5000):
        bfd._bind_interface(nb, f"fe80::7%{scope}")
        assert nb.ifindex == ANY_INTERFACE, scope
    bfd._bind_interface(nb, "fe80::7%5")
    assert nb.ifindex == 5
    bfd._bind_interface(nb, "fe80::7")
    assert nb.ifindex == ETH0
