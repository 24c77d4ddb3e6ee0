"""bgp.bfd_transport.BfdService on loopback sockets, its callbacks driven by hand with a clock
the test moves: no sleeps, the event loop is never left to run its timers.

Our side listens on 127.0.0.1, the neighbour is a plain UDP socket on 127.0.0.2 (TTL 255)
that sends what the test tells it to."""

from __future__ import annotations

import asyncio
import socket

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
        clock, changes = Clock(), []
        bfd, nbr = service(clock, changes)
        try:
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
        finally:
            await bfd.stop()
            nbr.close()

    asyncio.run(run())


def test_a_new_source_address_replaces_the_session_with_one_admin_down_not_a_drain_beside_the_new_one():
    # Two sessions to one neighbour make it flap between them (it keys its one session by our
    # address): the old one says AdminDown once and is gone before the new one starts.
    async def run() -> None:
        clock, changes = Clock(), []
        bfd, nbr = service(clock, changes)
        try:
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
        finally:
            await bfd.stop()
            nbr.close()

    asyncio.run(run())
