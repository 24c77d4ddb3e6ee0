"""The end of a connection conntrack records is its last packet, not its entry's expiry, pure:
conntrack keeps an entry after the last packet (TCP's TIME_WAIT, UDP's and ICMP's timeouts) and
stamps one that expired with its expiry.  Against DESTROY events a Linux 6.18 kernel sent."""

from __future__ import annotations

import socket

import pytest

from agentd.flows.recorder import ConntrackTimeouts, FlowRecorder, ct_last_packet_ns
from agentd.kernel import netlink as nl
from agentd.kernel import netlink_ct as ct

from .test_flow_events import TCP_DESTROY, Directory

# Captured in a throwaway namespace on loopback (nf_conntrack_acct and _timestamp on, TCP's
# TIME_WAIT 3 s, UDP's timeout 2 s): the tuples, CTA_ID, _STATUS, (_TIMEOUT,) _COUNTERS_*,
# _TIMESTAMP, (_PROTOINFO: TCP's state alone,) _TIMESTAMP_EVENT.
# TCP_TAKEN: 127.0.0.1:40001 -> :5555 closed (TIME_WAIT), its tuple taken by a new connection's
#   SYN 1 s later: deleted then (CTA_TIMEOUT 2 s left), stop and event stamp within a microsecond.
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


def test_a_destroy_says_the_tcp_state_its_entry_died_in():
    assert decoded(TCP_EXPIRED).tcp_state == 7  # TIME_WAIT
    assert decoded(TCP_TAKEN).tcp_state == 7
    assert decoded(TCP_DESTROY).tcp_state == 3  # ESTABLISHED (deleted)
    assert decoded(UDP_EXPIRED).tcp_state == -1


def test_an_entry_that_expired_ends_at_its_last_packet():
    ev = decoded(TCP_EXPIRED)
    assert ev.event_ns - ev.stop_ns > 50 * S  # reaped long after it expired
    last = ct_last_packet_ns(ev, TIMEOUTS)
    assert last == ev.stop_ns - 3 * S
    assert 0 <= last - ev.start_ns < 0.1 * S  # a connection of a few milliseconds


def test_an_entry_deleted_before_it_expired_ends_when_it_went():
    """Its tuple taken by a new connection in TIME_WAIT: the last packet was up to TIME_WAIT
    before, which the event does not tell; so the stop stamp, as before."""
    ev = decoded(TCP_TAKEN)
    assert 0 <= ev.event_ns - ev.stop_ns < 1_000_000
    assert ct_last_packet_ns(ev, TIMEOUTS) == ev.stop_ns
    assert ct_last_packet_ns(decoded(TCP_DESTROY), TIMEOUTS) == decoded(TCP_DESTROY).stop_ns  # ESTABLISHED, deleted


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


@pytest.mark.parametrize("change, timeouts, why", [
    ({"tcp_state": 3}, TIMEOUTS, "ESTABLISHED: the pod fast path sets its own timeout"),
    ({"tcp_state": -1}, TIMEOUTS, "no state said"),
    ({"status": 0x20E | ct.IPS_FIXED_TIMEOUT}, TIMEOUTS, "a fixed timeout: packets do not set it"),
    ({"event_ns": 0}, TIMEOUTS, "no event stamp (before Linux 6.1): expired or deleted, unknown"),
    ({}, {**TIMEOUTS, "tcp_timeout_time_wait": 400}, "longer than max_retrans: that may have been set"),
    ({}, {k: v for k, v in TIMEOUTS.items() if k != "tcp_timeout_unacknowledged"}, "a cap unread"),
    ({}, {k: v for k, v in TIMEOUTS.items() if k != "tcp_timeout_time_wait"}, "the state's unread"),
    ({"orig": ct.CtTuple("127.0.0.1", "127.0.0.1", 132, 1, 2)}, TIMEOUTS, "SCTP: not known"),
])  # fmt: skip
def test_where_the_last_packet_is_not_known_the_stop_stamp_stays(change, timeouts, why):
    ev = decoded(TCP_EXPIRED)._replace(**change)
    assert ct_last_packet_ns(ev, timeouts) == ev.stop_ns, why


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


def test_conntrack_timeouts_are_read_at_most_once_a_ttl(tmp_path):
    (tmp_path / "nf_conntrack_tcp_timeout_time_wait").write_text("120\n")
    (tmp_path / "nf_conntrack_udp_timeout").write_text("not a number\n")
    now = [0.0]
    read = ConntrackTimeouts(tmp_path, ttl=1.0, clock=lambda: now[0])
    assert read() == {"tcp_timeout_time_wait": 120}  # the rest unreadable: left out
    (tmp_path / "nf_conntrack_tcp_timeout_time_wait").write_text("5\n")
    now[0] = 0.5
    assert read() == {"tcp_timeout_time_wait": 120}
    now[0] = 1.0
    assert read() == {"tcp_timeout_time_wait": 5}
