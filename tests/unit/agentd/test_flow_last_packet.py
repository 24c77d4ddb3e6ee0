"""The end of a connection conntrack records is its last packet, not its entry's expiry, pure:
conntrack keeps an entry after the last packet (TCP's TIME_WAIT, UDP's and ICMP's timeouts) and
stamps one that expired with its expiry.  Against DESTROY events a Linux 6.18 kernel sent."""

from __future__ import annotations

import socket
import struct

import pytest

from agentd.flows.recorder import ConntrackTimeouts, FlowRecorder, ct_last_packet_ns
from agentd.kernel import netlink as nl
from agentd.kernel import netlink_ct as ct

from .test_flow_events import TCP_DESTROY, Directory, event

# Captured in a throwaway namespace on loopback (nf_conntrack_acct and _timestamp on, TCP's
# TIME_WAIT 3 s, UDP's timeout 2 s): the tuples, CTA_ID, _STATUS, (_TIMEOUT,) _COUNTERS_*,
# _TIMESTAMP, (_PROTOINFO: TCP's state alone,) _TIMESTAMP_EVENT.
# TCP_TAKEN: 127.0.0.1:40001 -> :5555 closed 51 ms after its start (TIME_WAIT), its tuple taken
#   by a new connection's SYN 1 s later: deleted then (CTA_TIMEOUT: 2 s left).
# UDP_EXPIRED: one datagram, no answer; expired 2 s later, reaped 57 s after that.
# TCP_EXPIRED: the new connection, closed; expired in TIME_WAIT 3 s later, reaped 56 s after that.
TCP_TAKEN = bytes.fromhex(
    "04010000020100000000000000000000020000003400018014000180080001007f000001080002007f0000011c0002800500"
    "010006000000060002009c4100000600030015b300003400028014000180080001007f000001080002007f0000011c000280"
    "05000100060000000600020015b30000060003009c41000008000c004ee83cc4080003000000020e08000700000000021c00"
    "09800c00010000000000000000050c000200000000000000010d1c000a800c00010000000000000000040c00020000000000"
    "000000d81c0014800c00010018eed03243f3c0790c00020018eed03282974892100004800c00018005000100070000000c00"
    "1b0018eed03282974997")
UDP_EXPIRED = bytes.fromhex(
    "ec000000020100000000000000000000020000003400018014000180080001007f000001080002007f0000011c0002800500"
    "01001100000006000200adc100000600030015b400003400028014000180080001007f000001080002007f0000011c000280"
    "05000100110000000600020015b4000006000300adc1000008000c003db1695708000300000002081c0009800c0001000000"
    "0000000000010c000200000000000000001d1c000a800c00010000000000000000000c00020000000000000000001c001480"
    "0c00010018eed032859bd8700c00020018eed032fcb4f7180c001b0018eed0403de151ad")
TCP_EXPIRED = bytes.fromhex(
    "fc000000020100000000000000000000020000003400018014000180080001007f000001080002007f0000011c0002800500"
    "010006000000060002009c4100000600030015b300003400028014000180080001007f000001080002007f0000011c000280"
    "05000100060000000600020015b30000060003009c41000008000c004ee83cc4080003000000020e1c0009800c0001000000"
    "0000000000050c000200000000000000010d1c000a800c00010000000000000000040c00020000000000000000d81c001480"
    "0c00010018eed0328297a59a0c00020018eed03338633220100004800c00018005000100070000000c001b0018eed0403df4"
    "c111")

TIMEOUTS = {"tcp_timeout_time_wait": 3, "tcp_timeout_close": 10, "tcp_timeout_fin_wait": 120,
            "tcp_timeout_max_retrans": 300, "tcp_timeout_unacknowledged": 300,
            "udp_timeout": 2, "udp_timeout_stream": 120, "icmp_timeout": 30, "icmpv6_timeout": 30}  # fmt: skip
S = 1_000_000_000


def decoded(msg: bytes) -> ct.CtEvent:
    ((mtype, _f, _s, _p, start, end),) = list(nl.iter_messages(msg))
    ev = ct.decode_event(mtype, msg, start, end)
    assert ev is not None and ev.destroyed
    return ev


def test_a_destroy_says_the_tcp_state_and_whether_time_was_left():
    assert (decoded(TCP_EXPIRED).tcp_state, decoded(TCP_EXPIRED).timeout_s) == (7, -1)  # TIME_WAIT, expired
    assert (decoded(TCP_TAKEN).tcp_state, decoded(TCP_TAKEN).timeout_s) == (7, 2)  # deleted, 2 s left
    assert (decoded(TCP_DESTROY).tcp_state, decoded(TCP_DESTROY).timeout_s) == (3, 431999)  # ESTABLISHED, deleted
    assert (decoded(UDP_EXPIRED).tcp_state, decoded(UDP_EXPIRED).timeout_s) == (-1, -1)


def test_an_entry_that_expired_ends_at_its_last_packet():
    ev = decoded(TCP_EXPIRED)
    last = ct_last_packet_ns(ev, TIMEOUTS)
    assert last == ev.stop_ns - 3 * S
    assert 0 <= last - ev.start_ns < 0.1 * S  # a connection of a few milliseconds
    # With no time left the event's stamp is not asked: reaped late (here) or in the jiffy it
    # expired (the stop then not moved back), or no stamp at all (before 6.14), alike.
    assert ct_last_packet_ns(ev._replace(event_ns=ev.stop_ns), TIMEOUTS) == last
    assert ct_last_packet_ns(ev._replace(event_ns=0), TIMEOUTS) == last


def test_an_entry_deleted_before_it_expired_ends_at_its_last_packet_to_a_second():
    """Its tuple taken by a new connection in TIME_WAIT, a second after its close: the time it
    had left says when its last packet set the timeout."""
    ev = decoded(TCP_TAKEN)
    last = ct_last_packet_ns(ev, TIMEOUTS)
    assert last == ev.event_ns + 2 * S - 3 * S  # the time left as when it was sent: at once
    assert abs(last - (ev.start_ns + 0.051 * S)) < S  # closed 51 ms after its start
    # Sent again later (to a listener that missed it): the event's stamp is then, and the time
    # left as then; the two together are as at the delete.
    again = ev._replace(timeout_s=1, event_ns=ev.stop_ns + int(1.2 * S))
    assert ct_last_packet_ns(again, TIMEOUTS) == ev.stop_ns + int(2.2 * S) - 3 * S


def test_udp_by_whether_it_was_assured_and_never_before_its_start():
    ev = decoded(UDP_EXPIRED)
    assert not ev.status & ct.IPS_ASSURED
    # Stamps are exact to a jiffy: the expiry less 2 s falls a little before the only packet.
    assert ev.stop_ns - 2 * S < ev.start_ns
    assert ct_last_packet_ns(ev, TIMEOUTS) == ev.start_ns
    assured = ev._replace(start_ns=ev.start_ns - 200 * S, status=ev.status | ct.IPS_ASSURED)
    assert ct_last_packet_ns(assured, TIMEOUTS) == ev.stop_ns - 120 * S
    clash = ev._replace(start_ns=ev.start_ns - 200 * S, status=ev.status | ct.IPS_NAT_CLASH)
    assert ct_last_packet_ns(clash, TIMEOUTS) == ev.stop_ns
    # Never after its stop: more time left than the timeout (the sysctl lowered since).
    assert ct_last_packet_ns(ev._replace(timeout_s=5), TIMEOUTS) == ev.stop_ns


@pytest.mark.parametrize("change, timeouts, why", [
    ({"tcp_state": 3}, TIMEOUTS, "ESTABLISHED: its timeout is longer than the caps"),
    ({"tcp_state": 1}, {**TIMEOUTS, "tcp_timeout_syn_sent": 120}, "SYN_SENT: a SYN sent again does not renew it"),
    ({"tcp_state": -1}, TIMEOUTS, "no state said (before Linux 5.11)"),
    ({"tcp_state": 8, "status": 0x208, "timeout_s": 5, "event_ns": 0}, TIMEOUTS,
     "refused: CLOSE with no reply seen, killed by the RST with what SYN_SENT had left"),
    ({"status": 0x20E | ct.IPS_FIXED_TIMEOUT}, TIMEOUTS, "a fixed timeout: packets do not set it"),
    ({}, {**TIMEOUTS, "tcp_timeout_time_wait": 400}, "longer than max_retrans: that may have been set"),
    ({}, {k: v for k, v in TIMEOUTS.items() if k != "tcp_timeout_unacknowledged"}, "a cap unread"),
    ({}, {k: v for k, v in TIMEOUTS.items() if k != "tcp_timeout_time_wait"}, "the state's unread"),
    ({}, {}, "no timeouts: a kernel before 5.11"),
    ({"orig": ct.CtTuple("127.0.0.1", "127.0.0.1", 132, 1, 2)}, TIMEOUTS, "SCTP: not known"),
])  # fmt: skip
def test_where_the_last_packet_is_not_known_the_stop_stamp_stays(change, timeouts, why):
    ev = decoded(TCP_EXPIRED)._replace(**change)
    assert ct_last_packet_ns(ev, timeouts) == ev.stop_ns, why


def test_a_reset_after_a_reply_ends_at_the_rst():
    """CLOSE after a reply came: the RST set CLOSE's timeout, and the entry expired or was taken."""
    ev = decoded(TCP_EXPIRED)._replace(tcp_state=8, start_ns=decoded(TCP_EXPIRED).stop_ns - 60 * S)
    assert ev.status & ct.IPS_SEEN_REPLY
    assert ct_last_packet_ns(ev, TIMEOUTS) == ev.stop_ns - 10 * S


def test_icmp_by_its_timeout():
    ev = decoded(TCP_EXPIRED)
    ping = ev._replace(orig=ct.CtTuple("127.0.0.1", "127.0.0.1", 1, 8, 0), tcp_state=-1, start_ns=ev.start_ns - 60 * S)
    assert ct_last_packet_ns(ping, TIMEOUTS) == ev.stop_ns - 30 * S
    assert ct_last_packet_ns(ping._replace(orig=ping.orig._replace(proto=socket.IPPROTO_ICMPV6)), TIMEOUTS) == \
        ev.stop_ns - 30 * S


def test_the_record_of_an_expired_entry_ends_at_its_last_packet():
    ev = decoded(TCP_EXPIRED)
    with_timeouts = FlowRecorder("node2", Directory(), "/nonexistent", group=143, clock=lambda: 1000.0,
                                 ct_timeouts=lambda: TIMEOUTS)
    flow = with_timeouts.connection(ev, received=1000.0)
    assert flow is not None and flow.event == "end"
    assert flow.time == (ev.stop_ns - 3 * S) / 1e9 and flow.duration is not None and flow.duration < 0.1
    # Without conntrack's timeouts: at the expiry, TIME_WAIT included.
    plain = FlowRecorder("node2", Directory(), "/nonexistent", group=143, clock=lambda: 1000.0)
    flow = plain.connection(ev, received=1000.0)
    assert flow is not None and flow.time == ev.stop_ns / 1e9 and flow.duration is not None and flow.duration > 2.9


def pods_destroy(start: int, stop: int) -> bytes:
    """A DESTROY of TCP between two pods (CTA_TIMESTAMP, TIME_WAIT, no time left)."""
    extra = (nl.attr(ct.CTA_STATUS, struct.pack("!I", 0x20E))
             + nl.nested(ct.CTA_TIMESTAMP, nl.attr(ct.CTA_TIMESTAMP_START, struct.pack("!Q", start)),
                         nl.attr(ct.CTA_TIMESTAMP_STOP, struct.pack("!Q", stop)))
             + nl.nested(ct.CTA_PROTOINFO, nl.nested(ct.CTA_PROTOINFO_TCP, nl.attr(ct.CTA_PROTOINFO_TCP_STATE, b"\x07"))))
    return event(ct.MSG_DELETE, ct.CtTuple("10.244.1.2", "10.244.2.3", 6, 40000, 80),
                 ct.CtTuple("10.244.2.3", "10.244.1.2", 6, 80, 40000), extra=extra)


def test_a_record_made_later_takes_the_timeouts_of_when_its_event_came():
    now = {"tcp_timeout_time_wait": 3, "tcp_timeout_max_retrans": 300, "tcp_timeout_unacknowledged": 300}
    r = FlowRecorder("node2", Directory(), "/nonexistent", group=143, clock=lambda: 1000.0,
                     ct_timeouts=lambda: now)
    start = 1_800_000_000 * S
    r._begin()
    r._on_conntrack_datagram(pods_destroy(start, start + 5 * S), 1000.0)
    now = {**now, "tcp_timeout_time_wait": 120}  # changed before anyone reads the record
    (flow,) = [e.flow() for e in r.ring.records]
    assert flow.event == "end" and flow.time == (start + 2 * S) / 1e9 and flow.duration == 2.0


def test_conntrack_timeouts_are_read_at_most_once_a_ttl(tmp_path):
    (tmp_path / "nf_conntrack_tcp_timeout_time_wait").write_text("120\n")
    (tmp_path / "nf_conntrack_udp_timeout").write_text("not a number\n")
    now = [0.0]
    read = ConntrackTimeouts(tmp_path, ttl=1.0, clock=lambda: now[0], release="6.1.0-13-amd64")
    assert read() == {"tcp_timeout_time_wait": 120}  # the rest unreadable: left out
    (tmp_path / "nf_conntrack_tcp_timeout_time_wait").write_text("5\n")
    now[0] = 0.5
    assert read() == {"tcp_timeout_time_wait": 120}
    now[0] = 1.0
    assert read() == {"tcp_timeout_time_wait": 5}
    # Before 5.11 a DESTROY does not say whether its entry expired: no timeouts, no moving back.
    assert ConntrackTimeouts(tmp_path, release="5.10.0-20-amd64")() == {}
    assert ConntrackTimeouts(tmp_path, release="nonsense")() == {}
