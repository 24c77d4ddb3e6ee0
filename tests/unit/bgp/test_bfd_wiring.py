"""How the speaker's transport (bgp.transport.SpeakerService) wires BFD in: which peers get a
session, from which source address, and what happens when the BFD sockets cannot be opened.

No sockets here: the BFD service is a recording fake, the BGP connections are fake transports,
and the event loop is never run (its timers are only scheduled)."""

from __future__ import annotations

import asyncio
import random
import socket
from ipaddress import IPv4Address, IPv6Address, ip_network

import pytest

from bgp import ListenRange, PeerSettings, Speaker
from bgp.settings import LocalSettings
from bgp.transport import BFD_RETRY, SpeakerService, _Protocol

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
        self.adds: list[tuple[str, str | None]] = []
        self.settings: dict[str, object] = {}  # peer -> its BfdSettings

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
        self.adds.append((peer, local_address))
        self.settings[peer] = settings

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


def test_bfd_sockets_that_cannot_be_opened_cost_one_log_line_not_the_caller_and_are_tried_again(loop, caplog):
    taken = OSError(98, "BFD: cannot listen on 10.1.0.1 port 3784: Address already in use")
    bfd = FakeBfd(fail_open=taken)
    svc = service(loop, bfd)
    peer = PeerSettings(IPv4Address("10.1.0.9"), 65000, passive=True, bfd=BFD)
    with caplog.at_level("ERROR", logger="bgp.transport"):
        svc.set_peers([peer])  # (before: the OSError escaped into the agent's node-watch task)
        svc.set_peers([peer, PeerSettings(IPv4Address("10.1.0.10"), 65000, passive=True, bfd=BFD)])
    assert not bfd.started and bfd.sessions == {} and bfd.opens >= 2
    lines = [r.getMessage() for r in caplog.records if r.name == "bgp.transport"]
    assert len(lines) == 1 and "Address already in use" in lines[0] and "Traceback" not in caplog.text
    assert "10.1.0.9" in svc.speaker.peers  # BGP goes on without BFD
    # The port is free again: the next change of peers opens the sockets and starts the sessions.
    bfd.fail_open = None
    svc.set_peers([peer])
    assert bfd.started and set(bfd.sessions) == {"10.1.0.9"}


def test_bfd_sockets_that_cannot_be_opened_are_tried_again_on_a_timer_with_no_change_of_peers(loop, caplog):
    bfd = FakeBfd(fail_open=OSError(98, "BFD: cannot listen on 0.0.0.0 port 3784: Address already in use"))
    svc = service(loop, bfd)
    peer = PeerSettings(IPv4Address("10.1.0.9"), 65000, passive=True, bfd=BFD)
    with caplog.at_level("ERROR", logger="bgp.transport"):
        svc.set_peers([peer])
        retry, opens = svc._bfd_retry, bfd.opens
        assert retry is not None and retry.when() - loop.time() == pytest.approx(BFD_RETRY, abs=1)
        retry._run()  # the timer fires: still taken, one more try later, no second log line
        assert bfd.opens == opens + 1 and not bfd.started and svc._bfd_retry not in (None, retry)
        bfd.fail_open = None  # the other BFD daemon went
        svc._bfd_retry._run()
    assert bfd.started and set(bfd.sessions) == {"10.1.0.9"}
    assert len([r for r in caplog.records if r.name == "bgp.transport"]) == 1
    assert svc._bfd_retry is None  # nothing more to try
    loop.run_until_complete(svc.stop(graceful=False))


def test_a_bfd_service_whose_port_is_taken_raises_and_stays_unstarted():
    from bgp.bfd_transport import BfdService

    async def run() -> None:
        blocker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        blocker.bind(("127.0.0.2", 0))
        port = blocker.getsockname()[1]
        try:
            bfd = BfdService(listen="127.0.0.2", port=port)
            with pytest.raises(OSError, match="cannot listen on 127.0.0.2"):
                bfd.open()
            assert not bfd.started and bfd.listen_addresses == []
            # One of two addresses taken: the one already bound is closed again.
            with pytest.raises(OSError):
                bfd.open(["127.0.0.1", "127.0.0.2"])
            assert not bfd.started
            probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            probe.bind(("127.0.0.1", port))  # free: open() closed it
            probe.close()
            with pytest.raises(RuntimeError):
                bfd.add("127.0.0.3")
        finally:
            blocker.close()

    asyncio.run(run())


# ------------------------------------------------------------ source and receive addresses


def test_the_bfd_source_is_the_configured_local_address_else_the_bgp_connections_else_the_kernels():
    from bgp.transport import bfd_source

    assert bfd_source("10.0.0.1", "10.0.0.9") == "10.0.0.1"  # local_address: as before
    assert bfd_source(None, "10.0.0.9") == "10.0.0.9"
    assert bfd_source(None, None) is None  # never [bgp] listen's host (was: an IPv4 source for IPv6 peers)
    assert bfd_source("0.0.0.0", None) is None and bfd_source("::", "fd00::1") == "fd00::1"


def test_bfd_receives_on_the_wildcard_of_each_family_in_use_unless_every_peer_names_its_address():
    from bgp.transport import bfd_listen_addresses

    assert bfd_listen_addresses([]) == []
    assert bfd_listen_addresses([("10.0.0.2", None)]) == ["0.0.0.0"]
    assert bfd_listen_addresses([("10.0.0.2", None), ("fd00::2", None)]) == ["0.0.0.0", "::"]
    # Every IPv4 peer names its local address: just those (as with local_address before).
    assert bfd_listen_addresses([("10.0.0.2", "10.0.0.1"), ("10.0.1.2", "10.0.1.1"), ("fd00::2", None)]) == [
        "10.0.0.1", "10.0.1.1", "::",
    ]
    assert bfd_listen_addresses([("10.0.0.2", "10.0.0.1"), ("10.0.0.3", None)]) == ["0.0.0.0"]


def test_an_ipv6_peer_gets_no_ipv4_source_from_an_ipv4_listen_address(loop):
    bfd = FakeBfd()
    svc = service(loop, bfd, listen=("10.1.0.1", 179))
    svc.set_peers([PeerSettings(IPv6Address("fd00::2"), 65000, passive=True, bfd=BFD),
                   PeerSettings(IPv4Address("10.1.0.2"), 65000, passive=True, bfd=BFD)])
    assert bfd.sessions == {"fd00::2": None, "10.1.0.2": None}  # the kernel chooses until BGP connects
    assert bfd.listen == {"0.0.0.0", "::"}
    # The BGP connection comes in on another address of ours: BFD sends from that one.
    inbound(svc, "10.1.0.2", local="10.1.0.77")
    assert bfd.sessions["10.1.0.2"] == "10.1.0.77"


def test_a_change_of_a_peers_other_settings_keeps_its_bfd_session_and_the_learned_source(loop):
    # Speaker.set_peers replaces the Peer object on a change of a compared setting: the BFD
    # session keeps the source its BGP connection taught it, so it is not replaced (which goes
    # AdminDown and resets the neighbour's BGP session once more).
    bfd = FakeBfd()
    svc = service(loop, bfd, listen=("0.0.0.0", 179))
    peer = PeerSettings(IPv4Address("10.1.0.2"), 65000, passive=True, bfd=BFD)
    svc.set_peers([peer])
    inbound(svc, "10.1.0.2", local="10.1.0.77")
    assert bfd.sessions == {"10.1.0.2": "10.1.0.77"}
    adds = len(bfd.adds)
    before = svc.speaker.peers["10.1.0.2"]
    svc.set_peers([PeerSettings(IPv4Address("10.1.0.2"), 65000, passive=True, bfd=BFD, hold_time=30)])
    assert svc.speaker.peers["10.1.0.2"] is not before
    assert bfd.sessions == {"10.1.0.2": "10.1.0.77"} and len(bfd.adds) == adds
    # A new connection from another address of ours: BFD follows it.
    inbound(svc, "10.1.0.2", local="10.1.0.78")
    assert bfd.sessions == {"10.1.0.2": "10.1.0.78"}
    # Without BFD the learned source is forgotten: BFD again later starts from the kernel's choice.
    svc.set_peers([PeerSettings(IPv4Address("10.1.0.2"), 65000, passive=True)])
    assert bfd.sessions == {}
    svc.set_peers([PeerSettings(IPv4Address("10.1.0.2"), 65000, passive=True, bfd=BFD)])
    assert bfd.sessions == {"10.1.0.2": None}


def test_a_configured_local_address_is_the_source_and_the_receive_address(loop):
    bfd = FakeBfd()
    svc = service(loop, bfd, listen=("0.0.0.0", 179))
    svc.set_peers([PeerSettings(IPv4Address("10.1.0.2"), 65000, passive=True, local_address=IPv4Address("10.1.0.1"),
                                bfd=BFD)])
    assert bfd.sessions == {"10.1.0.2": "10.1.0.1"} and bfd.listen == {"10.1.0.1"}
    inbound(svc, "10.1.0.2", local="10.1.0.1")
    assert bfd.sessions == {"10.1.0.2": "10.1.0.1"}


def test_a_dynamic_client_gets_the_address_it_connected_to_as_source(loop):
    bfd = FakeBfd()
    svc = service(loop, bfd, listen=("10.1.0.1", 179))
    svc.set_listen_ranges([client_range()])
    inbound(svc, "10.1.0.7", local="10.1.0.1")
    assert bfd.sessions == {"10.1.0.7": "10.1.0.1"} and bfd.listen == {"0.0.0.0"}


def test_a_session_whose_source_becomes_known_moves_to_it_without_going_down():
    from bgp.bfd import BfdSettings
    from bgp.bfd_transport import BfdService

    async def run() -> None:
        bfd = BfdService(port=0)
        bfd.open(["127.0.0.1"])
        try:
            bfd.add("127.0.0.2", settings=BfdSettings(0.1, 0.1, 3))
            session, port = bfd.session("127.0.0.2"), bfd.status()[0]["source_port"]
            assert bfd.status()[0]["local_address"] is None
            bfd.add("127.0.0.2", local_address="127.0.0.1", settings=BfdSettings(0.1, 0.1, 3))
            row = bfd.status()[0]
            assert bfd.session("127.0.0.2") is session  # same discriminator, same state
            assert row["local_address"] == "127.0.0.1" and row["source_port"] == port
        finally:
            await bfd.stop()

    asyncio.run(run())


def test_turning_bfd_on_retuning_it_or_off_keeps_an_established_bgp_session(loop):
    # A SIGHUP reload that only adds [[bgp.peers]] bfd (or changes bfd_interval) replaced the
    # Peer: Cease/6 to the neighbour and its routes withdrawn.  BIRD changes BFD in place.
    from dataclasses import replace

    from bgp.bfd import BfdSettings
    from bgp.fsm import State
    from bgp.testing import RawPeer
    from proto.messages import Keepalive, MessageReader, MessageType

    bfd = FakeBfd()
    svc = service(loop, bfd, listen=("0.0.0.0", 179))
    plain = PeerSettings(IPv4Address("10.1.0.2"), 65000, passive=True)
    svc.set_peers([plain])
    proto = inbound(svc, "10.1.0.2", local="10.1.0.77")
    proto.data_received(RawPeer("10.1.0.2", 65000, conn=0).open_message() + Keepalive().encode())
    peer = svc.speaker.peers["10.1.0.2"]
    assert peer.state is State.ESTABLISHED and bfd.sessions == {}

    svc.set_peers([replace(plain, bfd=BFD)])
    assert svc.speaker.peers["10.1.0.2"] is peer and peer.state is State.ESTABLISHED
    assert peer.settings.bfd == BFD and peer.session.peer.bfd == BFD
    assert bfd.sessions == {"10.1.0.2": "10.1.0.77"}  # from the running connection's address
    assert bfd.settings["10.1.0.2"] == BfdSettings(0.1, 0.1, 3)

    svc.set_peers([replace(plain, bfd=(0.3, 5))])
    assert svc.speaker.peers["10.1.0.2"] is peer and bfd.settings["10.1.0.2"] == BfdSettings(0.3, 0.3, 5)
    svc.set_peers([plain])
    assert svc.speaker.peers["10.1.0.2"] is peer and bfd.sessions == {}

    reader = MessageReader()
    reader.feed(b"".join(bytes(c) for c in proto.transport.written))
    kinds = [t for t, _ in reader.messages()]
    assert MessageType.NOTIFICATION not in kinds and not proto.transport.closing
    assert peer.state is State.ESTABLISHED
    # A change of a compared setting still restarts the peer (Cease/6), as before.
    svc.set_peers([replace(plain, hold_time=30)])
    assert svc.speaker.peers["10.1.0.2"] is not peer


def test_a_listen_range_that_starts_asking_for_bfd_keeps_its_clients_and_starts_their_sessions(loop):
    bfd = FakeBfd()
    svc = service(loop, bfd)
    svc.set_listen_ranges([client_range(bfd=None)])
    inbound(svc, "10.1.0.7")
    client = svc.speaker.peers["10.1.0.7"]
    assert bfd.sessions == {}
    svc.set_listen_ranges([client_range()])
    assert svc.speaker.peers["10.1.0.7"] is client and client.settings.bfd == BFD
    assert set(bfd.sessions) == {"10.1.0.7"}


# ------------------------------------------------------------ BFD resets damped (review r12)


def test_repeated_bfd_resets_hold_the_peer_down_longer_each_time_up_to_a_cap_and_are_forgotten_when_quiet():
    # A link that passes TCP but loses BFD packets: without damping every BFD failure reset the
    # peer and it was back within a second (the backoff starts over once Established), about
    # one flap a second, the node's routes withdrawn and re-announced cluster-wide each time.
    from bgp.fsm import State
    from bgp.speaker import BFD_HOLD_INITIAL, BFD_HOLD_MAX, BFD_QUIET
    from bgp.testing import speaker_pair

    net, a, _ = speaker_pair()

    def up() -> bool:
        return a.peers["10.0.0.2"].state is State.ESTABLISHED

    net.run_until(up, timeout=30)

    def flap() -> float:
        """BFD fails at once: how long until the session is Established again."""
        a.bfd_down("10.0.0.2", "Control Detection Time Expired", net.now)
        assert a.peers["10.0.0.2"].state is State.IDLE
        return net.run_until(up, timeout=BFD_HOLD_MAX + 60)

    took = [flap() for _ in range(7)]
    assert took[0] < 5  # the first after a quiet time: the usual backoff
    assert BFD_HOLD_INITIAL <= took[1] < BFD_HOLD_INITIAL + 5
    assert took[1] < took[2] < took[3] < took[4], took  # 60, 120, 240, 300
    assert all(BFD_HOLD_MAX <= t < BFD_HOLD_MAX + 5 for t in took[4:]), took  # the cap
    assert a.counters["bfd resets"] == 7 and a.counters["bfd hold-downs"] == 6
    # Quiet for BFD_QUIET after the last hold-down ended: forgotten, the usual backoff again.
    net.run(duration=BFD_QUIET)
    assert flap() < 5
    assert BFD_HOLD_INITIAL <= flap() < BFD_HOLD_INITIAL + 5


def test_a_bfd_hold_down_refuses_the_neighbours_connections_and_damps_each_peer_on_its_own():
    from bgp.fsm import State
    from bgp.speaker import BFD_HOLD_INITIAL
    from bgp.testing import RawHarness, RawPeer, make_speaker

    sp = make_speaker("10.0.0.1", 65000, [("10.0.0.2", 65000), ("10.0.0.3", 65000)])
    sp.start(0.0)
    h = RawHarness(sp, "10.0.0.1")
    conn = iter(range(-1, -100, -1))
    for address in ("10.0.0.2", "10.0.0.3"):
        assert h.connect(RawPeer(address, 65000, conn=next(conn)))
    assert all(p.state is State.ESTABLISHED for p in sp.peers.values())
    sp.bfd_down("10.0.0.2", "Neighbor Signaled Session Down", h.now)
    h.advance(10)
    assert h.connect(RawPeer("10.0.0.2", 65000, conn=next(conn)))  # the first: the usual backoff
    sp.bfd_down("10.0.0.2", "Neighbor Signaled Session Down", h.now)
    h.advance(10)
    admission = h.open(RawPeer("10.0.0.2", 65000, conn=next(conn)))
    assert not admission and "held down" in admission.reason
    assert sp.peers["10.0.0.3"].state is State.ESTABLISHED
    # 10.0.0.3's first BFD reset is its own first: not held.
    sp.bfd_down("10.0.0.3", "Control Detection Time Expired", h.now)
    h.advance(10)
    assert h.connect(RawPeer("10.0.0.3", 65000, conn=next(conn)))
    h.advance(BFD_HOLD_INITIAL)
    assert h.connect(RawPeer("10.0.0.2", 65000, conn=next(conn)))


# ------------------------------------------------------------ what a BFD state change does to BGP


def _established(svc: SpeakerService, *addresses: str) -> dict[str, _Protocol]:
    from bgp.fsm import State
    from bgp.testing import RawPeer
    from proto.messages import Keepalive

    svc.set_peers([PeerSettings(IPv4Address(a), 65000, passive=True, bfd=BFD) for a in addresses])
    protos = {}
    for a in addresses:
        protos[a] = proto = inbound(svc, a, local=RR)
        proto.data_received(RawPeer(a, 65000, conn=0).open_message() + Keepalive().encode())
        assert svc.speaker.peers[a].state is State.ESTABLISHED
    return protos


def _notifications(proto: _Protocol) -> list:
    from proto.messages import MessageReader, MessageType, Notification

    reader = MessageReader()
    reader.feed(b"".join(bytes(c) for c in proto.transport.written))
    return [Notification.decode(body) for t, body in reader.messages() if t == MessageType.NOTIFICATION]


def test_a_bfd_failure_resets_that_peers_bgp_session_with_cease_10_and_no_other(loop):
    from bgp.bfd import BfdEvent, BfdStateChanged
    from bgp.fsm import State
    from proto.bfd import Diag
    from proto.bfd import State as Bfd
    from proto.errors import CeaseSubcode, ErrorCode

    bfd = FakeBfd()
    svc = service(loop, bfd, listen=("0.0.0.0", 179))
    protos = _established(svc, "10.1.0.2", "10.1.0.3")
    assert set(bfd.sessions) == {"10.1.0.2", "10.1.0.3"}
    on_change = svc._bfd_changed  # what SpeakerService gives the BfdService it makes
    on_change("10.1.0.2", BfdStateChanged(Bfd.UP, Bfd.DOWN, Diag.CONTROL_DETECTION_TIME_EXPIRED,
                                          BfdEvent.DETECTION_TIME_EXPIRED))
    peer = svc.speaker.peers["10.1.0.2"]
    assert peer.state is State.IDLE and "BFD down: Control Detection Time Expired" in peer.last_error
    assert svc.speaker.counters["bfd resets"] == 1
    assert [(n.code, n.subcode) for n in _notifications(protos["10.1.0.2"])] == [(ErrorCode.CEASE, CeaseSubcode.BFD_DOWN)]
    assert protos["10.1.0.2"].transport.closing
    # The other peer is untouched.
    assert svc.speaker.peers["10.1.0.3"].state is State.ESTABLISHED
    assert _notifications(protos["10.1.0.3"]) == [] and not protos["10.1.0.3"].transport.closing
    # The neighbour saying Down (diagnostic 3) is a failure too.
    on_change("10.1.0.3", BfdStateChanged(Bfd.UP, Bfd.DOWN, Diag.NEIGHBOR_SIGNALED_SESSION_DOWN, BfdEvent.RECV_DOWN))
    assert svc.speaker.peers["10.1.0.3"].state is State.IDLE and svc.speaker.counters["bfd resets"] == 2


def test_a_bfd_session_going_down_administratively_or_coming_up_leaves_bgp_established(loop):
    # RFC 5882 §3.2: a neighbour's AdminDown (its agent restarting, its BFD turned off) is no
    # failure: its BGP session -- in a graceful restart, say -- must not be reset for it.
    from bgp.bfd import BfdEvent, BfdStateChanged
    from bgp.fsm import State
    from proto.bfd import Diag
    from proto.bfd import State as Bfd

    bfd = FakeBfd()
    svc = service(loop, bfd, listen=("0.0.0.0", 179))
    protos = _established(svc, "10.1.0.2")
    on_change = svc._bfd_changed
    for change in (
        BfdStateChanged(Bfd.UP, Bfd.DOWN, Diag.NEIGHBOR_SIGNALED_SESSION_DOWN, BfdEvent.RECV_ADMIN_DOWN),
        BfdStateChanged(Bfd.DOWN, Bfd.INIT, Diag.NONE, BfdEvent.RECV_DOWN),
        BfdStateChanged(Bfd.INIT, Bfd.UP, Diag.NONE, BfdEvent.RECV_UP),
        BfdStateChanged(Bfd.UP, Bfd.ADMIN_DOWN, Diag.ADMINISTRATIVELY_DOWN, BfdEvent.ADMIN_DISABLE),
        BfdStateChanged(Bfd.INIT, Bfd.DOWN, Diag.CONTROL_DETECTION_TIME_EXPIRED, BfdEvent.DETECTION_TIME_EXPIRED),
    ):
        on_change("10.1.0.2", change)
        assert svc.speaker.peers["10.1.0.2"].state is State.ESTABLISHED, change
    assert svc.speaker.counters["bfd resets"] == 0
    assert _notifications(protos["10.1.0.2"]) == [] and not protos["10.1.0.2"].transport.closing


def test_a_link_local_client_from_a_listen_range_gets_no_bfd_session_with_one_log_line(loop, caplog):
    # fe80::7%eth0 accepted from a range covering fe80::/10: its scope is lost on the way to
    # BFD (the peer's key is the bare address), so packets went out on whatever interface the
    # kernel chose, and once the local address fe80::1 was learned every add() failed (EINVAL)
    # with an error line every 30 s.  Refused, as BIRD refuses a link-local neighbour without
    # an interface: one line, the BGP session itself unaffected.
    from bgp.fsm import State
    from bgp.testing import RawPeer
    from proto.messages import Keepalive

    bfd = FakeBfd()
    svc = service(loop, bfd, listen=("::", 179))
    svc.set_listen_ranges([ListenRange(ip_network("::/0"), PeerSettings(IPv6Address("::"), 65000, bfd=BFD)),
                           ListenRange(ip_network("10.1.0.0/16"), PeerSettings(IPv4Address("10.1.0.0"), 65000,
                                                                               bfd=BFD))])
    with caplog.at_level("INFO", logger="bgp.transport"):
        proto = inbound(svc, "fe80::7%eth0", local="fe80::1%eth0")
        proto.data_received(RawPeer("fe80::7", 65000, conn=0, router_id="10.9.9.7").open_message()
                            + Keepalive().encode())
        assert svc.speaker.peers["fe80::7"].state is State.ESTABLISHED
        assert bfd.sessions == {} and bfd.listen == set()
        for _ in range(3):  # the 30 s retries and later changes of peers: no more lines
            svc._sync_bfd()
        inbound(svc, "10.1.0.7", local=RR)  # another client: BFD as usual
        assert set(bfd.sessions) == {"10.1.0.7"} and bfd.listen == {"0.0.0.0"}
        svc._sync_bfd()
    lines = [r for r in caplog.records if r.name == "bgp.transport" and "fe80::7" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "WARNING", [r.getMessage() for r in lines]
    assert "link-local" in lines[0].getMessage() and "without BFD" in lines[0].getMessage()
