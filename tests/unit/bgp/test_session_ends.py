"""How a session's end is handled, sans-IO with a float clock: a collision check that runs after
its connection has already ended (RFC 4271 §6.8), an active peer's session that took an inbound
connection and lost it, and a peer stopped while it has no BGP connection.

The speaker is 10.0.0.1 (or 10.0.0.3), AS 65000; its iBGP neighbour is 10.0.0.2.  Connection
ids: ours count up from 1, theirs are negative.
"""

from __future__ import annotations

import itertools
import logging
import random
from ipaddress import IPv4Address, IPv4Network

import pytest

from bgp import PeerSettings, Speaker, State
from bgp.peer import Peer, PeerFailed
from bgp.session import Close, Connect, Send, Session, SessionDown
from bgp.settings import LocalSettings
from proto.capabilities import GracefulRestart, GracefulRestartFamily
from proto.errors import CeaseSubcode, ErrorCode
from proto.messages import Keepalive, MessageReader, MessageType, Notification, Open

REMOTE = "10.0.0.2"


def local(router_id: str = "10.0.0.1") -> LocalSettings:
    return LocalSettings(asn=65000, router_id=IPv4Address(router_id))


def peer(router_id: str = "10.0.0.1", **settings) -> Peer:
    p = Peer(local(router_id), PeerSettings(REMOTE, 65000, **settings), conn_ids=itertools.count(1), now=0.0)
    p.start(0.0)
    return p


def open_(*caps) -> bytes:
    return Open.build(65000, 90, IPv4Address(REMOTE), list(caps)).encode()


def cease(subcode: int) -> bytes:
    return Notification(ErrorCode.CEASE, subcode).encode()


def closes(actions) -> list[int]:
    return [a.conn for a in actions if isinstance(a, Close)]


def notifications(actions) -> list[tuple[int, Notification]]:
    out = []
    for a in actions:
        if isinstance(a, Send):
            reader = MessageReader()
            reader.feed(a.data)
            while (item := reader.next_message()) is not None:
                if item[0] == MessageType.NOTIFICATION:
                    out.append((a.conn, Notification.decode(bytes(item[1]))))
    return out


def events(p: Peer) -> list:
    out = []
    while (ev := p.next_event()) is not None:
        out.append(ev)
    return out


# ---------------------------------------------------------------- §6.8 on a connection already gone


def test_a_collision_check_after_our_connection_ended_keeps_theirs():
    # The peer (higher identifier) keeps its own connection and closes ours with Cease/7; its OPEN
    # and that Cease arrive on ours in one read.  The check on our OPEN runs after both: our
    # session is Idle without a connection by then, and must neither be dumped nor win.
    p = peer("10.0.0.1")
    (connect,) = p.take_actions()
    p.connection_made(connect.conn, 0.1)
    assert p.accept(-1, 0.2)
    p.take_actions()
    p.data_received(-1, open_(), 0.3)  # theirs: OpenConfirm
    p.take_actions()
    p.data_received(connect.conn, open_() + cease(CeaseSubcode.CONNECTION_COLLISION_RESOLUTION), 0.4)
    actions = p.take_actions()
    assert closes(actions) == [connect.conn]  # ours, gone already; theirs stays open
    assert p.session.conn == -1 and p.session.state is State.OPEN_CONFIRM
    assert not p.collisions
    p.data_received(-1, Keepalive().encode(), 0.5)
    assert p.state is State.ESTABLISHED


def test_a_collision_check_after_our_connection_ended_is_no_internal_error():
    # The same through the speaker, which is what the transport drives: the check used to raise
    # (no transition for OpenCollisionDump in Idle), and the internal error reset the good
    # connection as well.
    sp = Speaker(local("10.0.0.1"), now=0.0, rng=random.Random(1))
    sp.add_peer(PeerSettings(REMOTE, 65000), 0.0)
    sp.start(0.0)
    (connect,) = [a for a in sp.take_actions() if isinstance(a, Connect)]
    sp.connection_made(connect.conn, 0.1, "10.0.0.1")
    assert sp.accept(-5, REMOTE, 0.2, "10.0.0.1")
    sp.take_actions()
    sp.data_received(-5, open_(), 0.3)
    sp.take_actions()
    sp.data_received(connect.conn, open_() + cease(CeaseSubcode.CONNECTION_COLLISION_RESOLUTION), 0.4)
    actions = sp.take_actions()
    assert sp.counters["internal errors"] == 0
    assert closes(actions) == [connect.conn]
    assert sp.peers[REMOTE].state is State.OPEN_CONFIRM
    sp.data_received(-5, Keepalive().encode(), 0.5)
    assert sp.peers[REMOTE].state is State.ESTABLISHED


@pytest.mark.parametrize("router_id", ["10.0.0.1", "10.0.0.3"])  # lower and higher than theirs
def test_a_connection_that_ended_in_the_read_of_its_open_does_not_close_the_good_one(router_id):
    # Ours is in OpenConfirm; on their second connection the OPEN and a NOTIFICATION come in one
    # read.  That dead connection must not win (closing ours) nor be dumped (Idle: no transition).
    p = peer(router_id)
    (connect,) = p.take_actions()
    p.connection_made(connect.conn, 0.1)
    p.data_received(connect.conn, open_(), 0.2)
    assert p.session.state is State.OPEN_CONFIRM
    assert p.accept(-1, 0.3)
    p.take_actions()
    p.data_received(-1, open_() + cease(CeaseSubcode.OTHER_CONFIGURATION_CHANGE), 0.4)
    actions = p.take_actions()
    assert closes(actions) == [-1]
    assert notifications(actions) == []
    assert p.session.conn == connect.conn and p.session.state is State.OPEN_CONFIRM
    assert not p.collisions
    p.data_received(connect.conn, Keepalive().encode(), 0.5)
    assert p.state is State.ESTABLISHED


def test_a_restarting_peers_connection_that_ended_at_once_leaves_the_established_session():
    # RFC 4724 §4.2: a new connection from a graceful-restart peer we hold Established means it
    # restarted -- but only a live one.  One whose OPEN came with a NOTIFICATION is gone already:
    # the Established session stays, nothing goes down.
    gr = GracefulRestart(False, 120, (GracefulRestartFamily(1, 1, True),))
    p = peer("10.0.0.1")
    (connect,) = p.take_actions()
    p.connection_made(connect.conn, 0.1)
    p.data_received(connect.conn, open_(gr) + Keepalive().encode(), 0.2)
    assert p.state is State.ESTABLISHED
    events(p)
    p.take_actions()
    assert p.accept(-1, 5.0)
    p.take_actions()
    p.data_received(-1, open_(gr) + cease(CeaseSubcode.OTHER_CONFIGURATION_CHANGE), 5.1)
    assert closes(p.take_actions()) == [-1]
    assert events(p) == []
    assert p.session.conn == connect.conn and p.session.state is State.ESTABLISHED


# ---------------------------------------------------------------- an active peer keeps connecting out


def test_an_active_peer_connects_out_again_after_an_inbound_connection_dies_in_open_sent():
    p = peer()
    (connect,) = p.take_actions()
    p.connect_failed(connect.conn, 1.0)  # Idle, in backoff
    assert p.session.state is State.IDLE and p.get_timer() is not None
    assert p.accept(-1, 1.2)  # the peer reaches us meanwhile: the session takes it (passive start)
    p.take_actions()
    p.connection_lost(-1, 2.0)  # ... and that connection dies in OpenSent: Active
    assert p.session.state is State.ACTIVE
    retry = p.get_timer()
    assert retry is not None  # ConnectRetry: an active peer does not only listen from now on
    p.handle_timer(retry)
    assert [a for a in p.take_actions() if isinstance(a, Connect)]
    assert p.session.state is State.CONNECT


def test_a_passive_peer_only_listens_after_an_inbound_connection_dies():
    p = peer(passive=True)
    assert p.take_actions() == []
    assert p.accept(-1, 1.0)
    p.take_actions()
    p.connection_lost(-1, 2.0)
    assert p.session.state is State.ACTIVE
    assert p.get_timer() is None  # nothing to retry: it waits for the peer
    assert p.take_actions() == []


def test_a_collision_session_that_loses_its_connection_is_still_forgotten():
    p = peer()
    (connect,) = p.take_actions()
    p.connection_made(connect.conn, 0.1)
    assert p.accept(-1, 0.2)
    assert len(p.collisions) == 1
    p.take_actions()
    p.connection_lost(-1, 0.3)  # the second connection dies in OpenSent
    assert p.collisions == []
    assert p.session.conn == connect.conn and p.session.state is State.OPEN_SENT
    assert p.take_actions() == []  # no connect-out of its own either


# ---------------------------------------------------------------- stopped while down


@pytest.mark.parametrize("started_passive", [False, True])  # Connect, Active
def test_stopping_a_session_without_a_connection_records_no_notification(started_passive):
    s = Session(local(), PeerSettings(REMOTE, 65000), conn_ids=itertools.count(1), now=0.0)
    s.start(0.0, passive=started_passive)
    assert s.state is (State.ACTIVE if started_passive else State.CONNECT)
    s.take_actions()
    s.stop(1.0, Notification.cease(CeaseSubcode.PEER_DECONFIGURED))
    (down,) = [e for e in iter(s.next_event, None)]
    assert isinstance(down, SessionDown)
    assert down.notification is None and down.reason == "stopped"
    assert notifications(s.take_actions()) == []


def test_stopping_a_session_in_open_sent_still_sends_and_records_its_notification():
    s = Session(local(), PeerSettings(REMOTE, 65000), conn_ids=itertools.count(1), now=0.0)
    s.start(0.0)
    (connect,) = s.take_actions()
    s.connection_made(connect.conn, 0.1, outbound=True)
    s.take_actions()
    s.stop(1.0, Notification.cease(CeaseSubcode.PEER_DECONFIGURED))
    (down,) = [e for e in iter(s.next_event, None)]
    assert down.notification == Notification.cease(CeaseSubcode.PEER_DECONFIGURED) and down.sent
    assert [(c, (n.code, n.subcode)) for c, n in notifications(s.take_actions())] == [
        (connect.conn, (ErrorCode.CEASE, CeaseSubcode.PEER_DECONFIGURED))
    ]


def test_removing_a_peer_that_is_down_logs_no_failed_session(caplog):
    sp = Speaker(local(), now=0.0, rng=random.Random(1))
    sp.add_peer(PeerSettings(REMOTE, 65000), 0.0)
    sp.start(0.0)
    sp.take_actions()  # Connect: nothing on the wire yet
    with caplog.at_level(logging.INFO, logger="bgp"):
        sp.remove_peer(REMOTE, 1.0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert closes(sp.take_actions()) == [1]


def test_a_peer_stopped_while_connecting_reports_no_failure():
    p = peer()
    p.take_actions()
    p.stop(1.0, Notification.cease(CeaseSubcode.ADMINISTRATIVE_SHUTDOWN))
    assert [e for e in events(p) if isinstance(e, PeerFailed)] == []


# ---------------------------------------------------------------- ends that are no failure


def _colliding_speaker() -> tuple[Speaker, int]:
    """Our connection (the main session) and theirs (a collision session) both in OpenSent."""
    sp = Speaker(local("10.0.0.1"), now=0.0, rng=random.Random(1))
    sp.add_peer(PeerSettings(REMOTE, 65000), 0.0)
    sp.start(0.0)
    (connect,) = [a for a in sp.take_actions() if isinstance(a, Connect)]
    sp.connection_made(connect.conn, 0.1, "10.0.0.1")
    assert sp.accept(-5, REMOTE, 0.2, "10.0.0.1")
    sp.take_actions()
    return sp, connect.conn


@pytest.mark.parametrize("with_open", [False, True])
def test_a_collision_the_peer_resolves_is_no_failed_session(caplog, with_open):
    # RFC 4271 §6.8 decided by the peer (the higher identifier keeps the connection it opened):
    # it closes ours, our main session, with Cease/7.  That is a resolved collision, logged at
    # debug, not a failed session (a warning, counted as session-failed).
    sp, ours = _colliding_speaker()
    sp.data_received(-5, open_(), 0.3)  # theirs: OpenConfirm
    sp.take_actions()
    with caplog.at_level(logging.DEBUG, logger="bgp"):
        data = (open_() if with_open else b"") + cease(CeaseSubcode.CONNECTION_COLLISION_RESOLUTION)
        sp.data_received(ours, data, 0.4)
        sp.data_received(-5, Keepalive().encode(), 0.5)
    assert sp.peers[REMOTE].state is State.ESTABLISHED
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert not any(kind == "session-failed" for kind, _ in sp.limiter.counts)
    assert any("connection collision" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)


def test_another_cease_before_the_session_came_up_is_still_a_failed_session(caplog):
    sp, ours = _colliding_speaker()
    sp.take_actions()
    with caplog.at_level(logging.INFO, logger="bgp"):
        sp.data_received(ours, cease(CeaseSubcode.OTHER_CONFIGURATION_CHANGE), 0.4)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith(f"peer {REMOTE}: received NOTIFICATION Cease")
    assert sp.limiter.counts[("session-failed", REMOTE)] == 1


@pytest.mark.parametrize("state", [State.OPEN_SENT, State.OPEN_CONFIRM])
@pytest.mark.parametrize("how", ["removed", "reconfigured", "range gone"])
def test_a_peer_we_remove_before_its_session_is_up_is_logged_as_removed(caplog, state, how):
    # Our own Cease (Peer De-configured, Other Configuration Change) on a session in OpenSent or
    # OpenConfirm: the removal, at info, not a failed session.
    from bgp import ListenRange

    sp = Speaker(local("10.0.0.1"), now=0.0, rng=random.Random(1))
    template = PeerSettings("10.0.0.0", 65000, passive=True)
    if how == "range gone":
        sp.set_listen_ranges([ListenRange(IPv4Network("10.0.0.0/24"), template)], 0.0)
    else:
        sp.add_peer(PeerSettings(REMOTE, 65000, passive=True), 0.0)
    sp.start(0.0)
    assert sp.accept(-5, REMOTE, 0.1, "10.0.0.1")
    if state is State.OPEN_CONFIRM:
        sp.data_received(-5, open_(), 0.2)
    assert sp.peers[REMOTE].state is state
    sp.take_actions()
    with caplog.at_level(logging.INFO, logger="bgp"):
        if how == "removed":
            sp.set_peers([], 1.0)
        elif how == "reconfigured":
            sp.set_peers([PeerSettings(REMOTE, 65000, passive=True, hold_time=9)], 1.0)
        else:
            sp.set_listen_ranges([], 1.0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert not any(kind == "session-failed" for kind, _ in sp.limiter.counts)
    subcode = "Peer De-configured" if how == "removed" else "Other Configuration Change"
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert line.startswith(f"peer {REMOTE} removed in {state.label}") and subcode in line, line
    assert [n.subcode for _, n in notifications(sp.take_actions())] == [
        CeaseSubcode.PEER_DECONFIGURED if how == "removed" else CeaseSubcode.OTHER_CONFIGURATION_CHANGE
    ]


def test_stopping_the_speaker_logs_no_failed_session(caplog):
    sp = Speaker(local("10.0.0.1"), now=0.0, rng=random.Random(1))
    sp.add_peer(PeerSettings(REMOTE, 65000, passive=True), 0.0)
    sp.start(0.0)
    assert sp.accept(-5, REMOTE, 0.1, "10.0.0.1")
    sp.take_actions()
    with caplog.at_level(logging.INFO, logger="bgp"):
        sp.stop(1.0, graceful=False)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert not any(kind == "session-failed" for kind, _ in sp.limiter.counts)


@pytest.mark.parametrize("with_open", [False, True])
def test_a_collision_cease_with_no_other_connection_is_a_failed_session(caplog, with_open):
    # After a crash without graceful restart the peer keeps its stale Established session and
    # answers each OPEN of ours with Cease/7 (until its hold timer expires; never at hold time
    # 0).  We have no other connection to it: the peer stays down, and that is a warning and a
    # session-failed count, not a debug line.
    sp = Speaker(local("10.0.0.1"), now=0.0, rng=random.Random(1))
    sp.add_peer(PeerSettings(REMOTE, 65000), 0.0)
    sp.start(0.0)
    (connect,) = [a for a in sp.take_actions() if isinstance(a, Connect)]
    sp.connection_made(connect.conn, 0.1, "10.0.0.1")
    sp.take_actions()
    with caplog.at_level(logging.DEBUG, logger="bgp"):
        data = (open_() if with_open else b"") + cease(CeaseSubcode.CONNECTION_COLLISION_RESOLUTION)
        sp.data_received(connect.conn, data, 0.4)
    assert sp.peers[REMOTE].state < State.OPEN_SENT
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith(f"peer {REMOTE}: received NOTIFICATION Cease")
    assert sp.limiter.counts[("session-failed", REMOTE)] == 1
    assert not any("connection collision, RFC 4271" in r.getMessage() for r in caplog.records)


def test_a_collision_cease_while_the_other_connection_is_in_open_sent_is_no_failed_session(caplog):
    # The other connection (theirs) has not had the peer's OPEN yet: it is still the one the
    # peer keeps.
    sp, ours = _colliding_speaker()
    with caplog.at_level(logging.DEBUG, logger="bgp"):
        sp.data_received(ours, cease(CeaseSubcode.CONNECTION_COLLISION_RESOLUTION), 0.4)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert not any(kind == "session-failed" for kind, _ in sp.limiter.counts)
    assert any("connection collision" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)


def _reconnect_gaps(subcode: int, rounds: int = 5) -> list[float]:
    """The waits before each reconnect of a peer that answers every OPEN of ours with
    Cease/``subcode`` on our only connection."""
    p = Peer(local(), PeerSettings(REMOTE, 65000), conn_ids=itertools.count(1), now=0.0, rng=random.Random(3))
    p.start(0.0)
    now, gaps = 0.0, []
    for _ in range(rounds):
        (connect,) = [a for a in p.take_actions() if isinstance(a, Connect)]
        p.connection_made(connect.conn, now + 0.1)
        ended = now + 0.2
        p.data_received(connect.conn, open_() + cease(subcode), ended)
        assert p.session.state is State.IDLE
        p.take_actions()
        now = p.get_timer()
        gaps.append(now - ended)
        p.handle_timer(now)
    return gaps


def test_a_collision_cease_on_the_only_connection_does_not_grow_the_backoff():
    # A peer holding a stale Established session answers each OPEN with Cease/7 until its hold
    # timer expires.  That is a failed session (logged), but no misbehaviour: like BIRD (error
    # delay grown only for a received NOTIFICATION other than Cease) and GoBGP (a fixed idle
    # hold time), the retries stay backoff_initial apart, so the session comes up soon after.
    gaps = _reconnect_gaps(CeaseSubcode.CONNECTION_COLLISION_RESOLUTION)
    assert max(gaps) <= local().backoff_initial, gaps


def test_another_failure_on_the_only_connection_still_grows_the_backoff():
    gaps = _reconnect_gaps(CeaseSubcode.OTHER_CONFIGURATION_CHANGE)
    assert gaps[-1] > 4 * local().backoff_initial, gaps
