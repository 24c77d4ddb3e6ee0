"""An in-memory network of sans-IO speakers with a float clock, for tests.

``MemoryNetwork`` plays the transport for several :class:`~bgp.speaker.Speaker` s:
Connect actions become connections to the speaker registered at that address,
Send actions deliver bytes to the other end, Close actions tell the other end the
connection was lost.  Time only moves when :meth:`run` advances it to the next
timer, so hold timers, keepalives, backoff and graceful-restart timers are all
exercised exactly, with no sleeps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .session import Close, Connect, Send
from .speaker import Speaker


@dataclass
class _Node:
    address: str
    speaker: Speaker
    up: bool = True  # False: the host is unreachable (connects fail, bytes are lost)
    frozen: bool = False  # True: like SIGSTOP, the process neither reads nor sends nor times out
    inbox: list = field(default_factory=list)


class MemoryNetwork:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.nodes: dict[str, _Node] = {}
        # (address, conn) -> (address, conn) of the other end
        self.links: dict[tuple[str, int], tuple[str, int]] = {}
        self._next_inbound = -1000
        self.bytes_sent = 0
        self.trace: list[str] = []
        self.tamper: Callable[[str, str, bytes], bytes] | None = None

    def add(self, address: str, speaker: Speaker) -> Speaker:
        self.nodes[address] = _Node(address, speaker)
        return speaker

    def speaker(self, address: str) -> Speaker:
        return self.nodes[address].speaker

    # ------------------------------------------------------------ faults

    def freeze(self, address: str, frozen: bool = True) -> None:
        self.nodes[address].frozen = frozen

    def crash(self, address: str) -> None:
        """The process at ``address`` dies: its connections reset (the kernel sends RST)."""
        node = self.nodes.pop(address)
        for (a, conn), (b, bconn) in list(self.links.items()):
            if a == address:
                del self.links[(a, conn)]
                self.links.pop((b, bconn), None)
                if b in self.nodes:
                    self.nodes[b].speaker.connection_lost(bconn, self.now)
        node.speaker = None  # type: ignore[assignment]

    def replace(self, address: str, speaker: Speaker) -> None:
        """A restarted process at ``address`` (after crash())."""
        self.nodes[address] = _Node(address, speaker)

    def inject(self, src: str, dst: str, data: bytes) -> None:
        """Deliver ``data`` to ``dst`` as if ``src`` had sent it on their connection (bytes no
        well-behaved speaker would send, for tests)."""
        for (a, conn), (b, bconn) in self.links.items():
            if a == src and b == dst:
                self.nodes[dst].inbox.append((bconn, data))
                return
        raise AssertionError(f"no connection from {src} to {dst}")

    # ------------------------------------------------------------ running

    def pump(self) -> bool:
        """Carry out every pending action; True if anything happened."""
        progress = False
        for node in list(self.nodes.values()):
            if node.frozen or node.speaker is None:
                continue
            if node.speaker.has_work():
                node.speaker.work(self.now)
            for action in node.speaker.take_actions():
                progress = True
                self._do(node, action)
        for node in list(self.nodes.values()):
            if node.frozen or not node.inbox:
                continue
            inbox, node.inbox = node.inbox, []
            for conn, data in inbox:
                if (node.address, conn) in self.links:
                    node.speaker.data_received(conn, data, self.now)
            progress = True
        return progress

    def _do(self, node: _Node, action) -> None:
        if isinstance(action, Connect):
            target = self.nodes.get(action.address)
            if target is None or not target.up or target.speaker is None or target.frozen:
                self.trace.append(f"{self.now:.3f} {node.address} -> {action.address} connect failed")
                node.speaker.connect_failed(action.conn, self.now)
                return
            inbound = self._next_inbound
            self._next_inbound -= 1
            if not target.speaker.accept(inbound, node.address, self.now, target.address):
                self.trace.append(f"{self.now:.3f} {node.address} -> {action.address} refused")
                node.speaker.connect_failed(action.conn, self.now)
                return
            self.links[(node.address, action.conn)] = (target.address, inbound)
            self.links[(target.address, inbound)] = (node.address, action.conn)
            node.speaker.connection_made(action.conn, self.now, node.address)
        elif isinstance(action, Send):
            other = self.links.get((node.address, action.conn))
            if other is None:
                return
            data = action.data
            if self.tamper is not None:
                data = self.tamper(node.address, other[0], data)
            self.bytes_sent += len(data)
            self.nodes[other[0]].inbox.append((other[1], data))
        elif isinstance(action, Close):
            other = self.links.pop((node.address, action.conn), None)
            if other is None:
                return
            self.links.pop(other, None)
            peer = self.nodes.get(other[0])
            if peer is not None and peer.speaker is not None:
                # Bytes already sent arrive before the FIN.
                inbox = [(c, d) for c, d in peer.inbox if c == other[1]]
                peer.inbox = [(c, d) for c, d in peer.inbox if c != other[1]]
                for c, d in inbox:
                    peer.speaker.data_received(c, d, self.now)
                peer.speaker.connection_lost(other[1], self.now)

    def next_timer(self) -> float | None:
        times = [
            t
            for n in self.nodes.values()
            if not n.frozen and n.speaker is not None
            for t in [n.speaker.get_timer()]
            if t is not None
        ]
        return min(times) if times else None

    def run(self, until: float | None = None, *, duration: float | None = None, max_steps: int = 1_000_000) -> None:
        """Deliver everything and fire timers in order until ``until`` (or ``now + duration``)."""
        if duration is not None:
            until = self.now + duration
        assert until is not None
        for _ in range(max_steps):
            if self.pump():
                continue
            t = self.next_timer()
            if t is None or t > until:
                self.now = until
                return
            self.now = max(self.now, t)
            for n in list(self.nodes.values()):
                if n.frozen or n.speaker is None:
                    continue
                nt = n.speaker.get_timer()
                if nt is not None and nt <= self.now:
                    n.speaker.handle_timer(self.now)
        raise RuntimeError("MemoryNetwork.run: too many steps (a livelock?)")

    def run_until(self, condition: Callable[[], bool], *, timeout: float, step: float = 0.05) -> float:
        """Run until ``condition()`` holds; return the simulated time it took.  Fails after ``timeout``."""
        start = self.now
        while not condition():
            if self.now - start > timeout:
                raise AssertionError(f"condition not met within {timeout}s of simulated time")
            self.run(duration=step)
        return self.now - start


def make_speaker(
    address: str,
    asn: int,
    peers: list[tuple[str, int]] | list = (),  # type: ignore[assignment]
    *,
    now: float = 0.0,
    router_id: str | None = None,
    seed: int = 1,
    peers_known: bool = True,
    **local_settings,
) -> Speaker:
    """A speaker at ``address`` (router id = address unless given) with ``peers``: (address, asn)
    pairs or PeerSettings, which are then its whole configured peer set (``peers_known``:
    :meth:`Speaker.peers_configured` is called).  Other keyword arguments go to LocalSettings."""
    import random
    from ipaddress import IPv4Address

    from .settings import LocalSettings, PeerSettings

    local = LocalSettings(asn=asn, router_id=IPv4Address(router_id or address), **local_settings)
    sp = Speaker(local, now=now, rng=random.Random(seed))
    for p in peers:
        sp.add_peer(p if isinstance(p, PeerSettings) else PeerSettings(address=p[0], asn=p[1]), now)
    if peers_known:
        sp.peers_configured(now)
    return sp


def speaker_pair(
    asn_a: int = 65000, asn_b: int = 65000, **kw
) -> tuple[MemoryNetwork, Speaker, Speaker]:
    """Speakers 10.0.0.1 (``asn_a``) and 10.0.0.2 (``asn_b``) configured as each other's peer in
    a fresh MemoryNetwork, both started at t=0; ``kw`` goes to :func:`make_speaker`."""
    net = MemoryNetwork()
    a = net.add("10.0.0.1", make_speaker("10.0.0.1", asn_a, [("10.0.0.2", asn_b)], **kw))
    b = net.add("10.0.0.2", make_speaker("10.0.0.2", asn_b, [("10.0.0.1", asn_a)], **kw))
    a.start(0.0)
    b.start(0.0)
    return net, a, b


class RawPeer:
    """A neighbour driven by hand, for tests that must send what no well-behaved speaker would.

    It connects to a sans-IO :class:`Speaker` (an inbound connection from ``address``),
    completes the OPEN exchange, and from then on sends whatever bytes the test gives it;
    what the speaker sends back is kept, framed, in :attr:`inbox`.  :class:`RawHarness`
    routes one speaker's actions to several raw peers."""

    def __init__(
        self, address: str, asn: int, *, conn: int, router_id: str | None = None, four_octet: bool = True,
        families: tuple[tuple[int, int], ...] = ((1, 1), (2, 1)), hold_time: int = 90,
    ) -> None:  # fmt: skip
        from proto.messages import MessageReader

        self.address = address
        self.asn = asn
        self.conn = conn
        self.router_id = router_id or address
        self.four_octet = four_octet
        self.families = families
        self.hold_time = hold_time
        self.reader = MessageReader()
        self.inbox: list[tuple[int, bytes]] = []
        self.closed = False
        self.writable = True

    def open_message(self) -> bytes:
        from ipaddress import IPv4Address

        from proto.capabilities import MultiProtocol, RouteRefresh
        from proto.messages import Open

        caps = [MultiProtocol(a, s) for a, s in self.families] + [RouteRefresh()]
        if self.four_octet:
            return Open.build(self.asn, self.hold_time, self.router_id, caps).encode()
        return Open(self.asn if self.asn <= 0xFFFF else 23456, self.hold_time, IPv4Address(self.router_id), tuple(caps)).encode()

    def take(self, data: bytes) -> None:
        self.reader.feed(data)
        self.inbox.extend(self.reader.messages())

    def updates(self, ctx=None):  # -> list[Update]
        from proto.messages import CodecContext, MessageType, Update

        ctx = ctx or CodecContext(four_octet_as=self.four_octet)
        return [Update.decode(body, ctx) for t, body in self.inbox if t == MessageType.UPDATE]

    def notifications(self):  # -> list[Notification]
        from proto.messages import MessageType, Notification

        return [Notification.decode(body) for t, body in self.inbox if t == MessageType.NOTIFICATION]


class RawHarness:
    """One speaker and the raw peers connected to it; ``pump`` delivers the speaker's output."""

    def __init__(self, speaker: Speaker, local_address: str, now: float = 0.0) -> None:
        self.speaker = speaker
        self.local_address = local_address
        self.now = now
        self.peers: dict[int, RawPeer] = {}
        self.sent: list = []  # every action, in order

    def open(self, peer: RawPeer):  # -> bgp.peer.Admission
        """Open the TCP connection only (the speaker sends its OPEN; the peer says nothing)."""
        self.peers[peer.conn] = peer
        admission = self.speaker.accept(peer.conn, peer.address, self.now, self.local_address)
        if not admission:
            peer.closed = True
        self.pump()
        return admission

    def connect(self, peer: RawPeer) -> bool:
        """Open the connection and complete the OPEN exchange; True when the speaker accepted."""
        from proto.messages import Keepalive

        if not self.open(peer):
            return False
        self.send(peer, peer.open_message() + Keepalive().encode())
        return not peer.closed

    def send(self, peer: RawPeer, data: bytes) -> None:
        if not peer.closed:
            self.speaker.data_received(peer.conn, data, self.now)
        self.pump()

    def advance(self, seconds: float) -> None:
        """Let time pass, firing the speaker's timers in order."""
        until = self.now + seconds
        while True:
            t = self.speaker.get_timer()
            if t is None or t > until:
                break
            self.now = max(self.now, t)
            self.speaker.handle_timer(self.now)
            self.pump()
        self.now = until
        self.pump()

    def set_writable(self, peer: RawPeer, writable: bool) -> None:
        peer.writable = writable
        self.speaker.set_writable(peer.conn, writable, self.now)
        self.pump()

    def pump(self) -> None:
        for _ in range(100_000):
            if self.speaker.has_work() and any(p.writable and not p.closed for p in self.peers.values()):
                self.speaker.work(self.now)
            actions = self.speaker.take_actions()
            if not actions and not (
                self.speaker.has_work() and any(p.writable and not p.closed for p in self.peers.values())
            ):
                return
            for a in actions:
                self.sent.append(a)
                peer = self.peers.get(getattr(a, "conn", None))  # type: ignore[arg-type]
                if isinstance(a, Send) and peer is not None and not peer.closed:
                    peer.take(a.data)
                elif isinstance(a, Close) and peer is not None:
                    peer.closed = True
                elif isinstance(a, Connect):
                    self.speaker.connect_failed(a.conn, self.now)  # raw peers are reached passively
        raise RuntimeError("RawHarness.pump: the speaker never stops producing actions")
