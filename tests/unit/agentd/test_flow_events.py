"""What keeps flow records cheap, pure: conntrack events read at fixed offsets (against events
a Linux 6.18 kernel sent; in C, agentd/kernel/_ctevents.c, as in Python), the classic BPF filter the kernel runs on them for the recorder's
socket (run here by a small interpreter of the instructions it uses), records made only when
read but naming their pods as they were when the event came, and the pod fast path's counts
added to a connection's end -- a tuple reused before its end came included."""

from __future__ import annotations

import ipaddress
import socket
import struct

import pytest

from agentd.flows.model import FlowFilter, Identity
from agentd.flows.recorder import FlowRecorder, PendingConnection, carried_key
from agentd.flows.ring import FlowRing
from agentd.flows.ring import record as ring_record
from agentd.kernel import netlink as nl
from agentd.kernel import _ctevents  # the recorder's per-event loop in C: scripts/dev setup builds it
from agentd.kernel import netlink_ct as ct

# Events as the kernel sent them (captured in a lab node: nf_conntrack_acct and _timestamp on).
ICMP_NEW = bytes.fromhex(
    "b0000000000100060000000000000000020000003c00018014000180080001000af45f02080002000af48102240002800500"
    "0100010000000600040006f80000050005000800000005000600000000003c00028014000180080001000af4810208000200"
    "0af45f022400028005000100010000000600040006f800000500050000000000050006000000000008000c0028d21d150800"
    "030000000188080007000000001e0c001b0018ee16be81db663c")
TCP_NEW = bytes.fromhex(
    "d0000000000100060000000000000000020000003400018014000180080001000af45f02080002000af481021c0002800500"
    "01000600000006000200da1a000006000300001600003400028014000180080001000af48102080002000af45f021c000280"
    "0500010006000000060002000016000006000300da1a000008000c0002423010080003000000018808000700000000783000"
    "04802c0001800500010001000000050002000a0000000500030000000000060004000300000006000500000000000c001b00"
    "18ee16be8248e813")
UDP_NEW = bytes.fromhex(
    "a0000000000100060000000000000000020000003400018014000180080001000af45f02080002000af481021c0002800500"
    "01001100000006000200d5f3000006000300003500003400028014000180080001000af48102080002000af45f021c000280"
    "0500010011000000060002000035000006000300d5f3000008000c006ea930170800030000000188080007000000001e0c00"
    "1b0018ee16be827ef8b9")
LOOPBACK_NEW = bytes.fromhex(
    "d0000000000100060000000000000000020000003400018014000180080001007f000001080002007f0000011c0002800500"
    "01000600000006000200b824000006000300238b00003400028014000180080001007f000001080002007f0000011c000280"
    "050001000600000006000200238b000006000300b824000008000c00286f9c9b080003000000018808000700000000783000"
    "04802c0001800500010001000000050002000a0000000500030000000000060004000300000006000500000000000c001b00"
    "18ee16be8478cd46")
# A DESTROY as the kernel sent it (a lab namespace, loopback, both sysctls on): the tuples, CTA_ID,
# _STATUS, _TIMEOUT, _COUNTERS_ORIG and _REPLY, _TIMESTAMP, _PROTOINFO, _TIMESTAMP_EVENT.
TCP_DESTROY = bytes.fromhex(
    "04010000020100000000000016eb77bd020000003400018014000180080001007f000001080002007f0000011c0002800500"
    "01000600000006000200c858000006000300232800003400028014000180080001007f000001080002007f0000011c000280"
    "0500010006000000060002002328000006000300c858000008000c0000db49fe080003000000020e080007000006977f1c00"
    "09800c00010000000000000000030c00020000000000000000a51c000a800c00010000000000000000020c00020000000000"
    "000000701c0014800c00010018ee2585773495b80c00020018ee25857d52e3f3100004800c00018005000100030000000c00"
    "1b0018ee25857d52e4c2")
PODS = (int.from_bytes(socket.inet_aton("10.244.0.0"), "big"), 0xFFFF0000)
SERVICES = (int.from_bytes(socket.inet_aton("10.96.0.0"), "big"), 0xFFF00000)


@pytest.fixture(autouse=True, params=["c", "python"])
def per_event_loop(request, monkeypatch):
    """Every test with the recorder's per-event loop in C (agentd/kernel/_ctevents.c, as the
    agent runs it) and in Python (its fall-back and reference)."""
    if request.param == "c":
        assert ct.fast_events is not None, "agentd/kernel/_ctevents.c is not built (scripts/dev setup)"
    else:
        monkeypatch.setattr(ct, "fast_events", None)
    return request.param


def body(msg: bytes) -> tuple[int, int, int]:
    ((mtype, _f, _s, _p, start, end),) = list(nl.iter_messages(msg))
    return mtype, start, end


def event(mtype: int, orig: ct.CtTuple, reply: ct.CtTuple, family: int = socket.AF_INET, extra: bytes = b"") -> bytes:
    attrs = ct.encode_tuple(ct.CTA_TUPLE_ORIG, orig) + ct.encode_tuple(ct.CTA_TUPLE_REPLY, reply) + extra
    return nl.encode_nfgen(mtype, 0, 0, family, attrs)


def tcp(src: str, dst: str, sport: int, dport: int, *, reply_src: str | None = None, destroyed: bool = False,
        status: int = 0, counters: tuple[int, int, int, int] = (0, 0, 0, 0), lived: tuple[int, int] | None = None) -> bytes:
    """``lived``: conntrack's CTA_TIMESTAMP (start, stop), real-time ns."""
    extra = nl.attr(ct.CTA_STATUS, struct.pack("!I", status))
    if destroyed:
        for kind, packets, nbytes in ((ct.CTA_COUNTERS_ORIG, *counters[:2]), (ct.CTA_COUNTERS_REPLY, *counters[2:])):
            extra += nl.nested(kind, nl.attr(ct.CTA_COUNTERS_PACKETS, struct.pack("!Q", packets)),
                               nl.attr(ct.CTA_COUNTERS_BYTES, struct.pack("!Q", nbytes)))
    if lived is not None:
        extra += nl.nested(ct.CTA_TIMESTAMP, nl.attr(ct.CTA_TIMESTAMP_START, struct.pack("!Q", lived[0])),
                           nl.attr(ct.CTA_TIMESTAMP_STOP, struct.pack("!Q", lived[1])))
    return event(ct.MSG_DELETE if destroyed else ct.MSG_NEW, ct.CtTuple(src, dst, 6, sport, dport),
                 ct.CtTuple(reply_src or dst, src, 6, dport, sport), socket.AF_INET6 if ":" in src else socket.AF_INET,
                 extra=extra)


# ------------------------------------------------------------------ fixed offsets


def test_a_destroys_lifetime_is_read_where_the_kernel_puts_it():
    mtype, start, end = body(TCP_DESTROY)
    ev = ct.decode_event(mtype, TCP_DESTROY, start, end)
    assert ev is not None and ev.destroyed and ev.start_ns and ev.stop_ns > ev.start_ns
    assert ct.lifetime(TCP_DESTROY, start, end) == (ev.start_ns, ev.stop_ns)
    # Laid out otherwise (no CTA_ID, no CTA_TIMEOUT): the attributes are walked, same answer.
    other = tcp("10.244.1.2", "10.244.2.3", 1, 80, destroyed=True, lived=(5, 9))
    assert ct.lifetime(other, *body(other)[1:]) == (5, 9)
    # A header that is not where the layout says: walked, never read at the wrong place.
    moved = bytearray(TCP_DESTROY)
    at = TCP_DESTROY.index(bytes.fromhex("1c001480"))  # CTA_TIMESTAMP's header ...
    moved[at + 2] = ct.CTA_TIMESTAMP + 1  # ... now another attribute's: no timestamps to read
    assert ct.lifetime(bytes(moved), start, end) == (0, 0)



@pytest.mark.parametrize("msg, proto, sport, dport", [
    (TCP_NEW, 6, 55834, 22), (UDP_NEW, 17, 54771, 53), (ICMP_NEW, 1, 8, 0),
])  # fmt: skip
def test_brief_reads_what_the_full_decoder_reads(msg, proto, sport, dport):
    mtype, start, end = body(msg)
    b = ct.brief(mtype, msg, start, end)
    ev = ct.decode_event(mtype, msg, start, end)
    assert b is not None and ev is not None and not b.destroyed
    assert (socket.inet_ntoa(b.src), socket.inet_ntoa(b.dst), b.proto, b.sport, b.dport) == (
        ev.orig.src, ev.orig.dst, ev.orig.proto, ev.orig.sport, ev.orig.dport) == (
        "10.244.95.2", "10.244.129.2", proto, sport, dport)
    assert socket.inet_ntoa(b.reply_src) == ev.reply.src
    assert ev.event_ns > 1.7e18  # CTA_TIMESTAMP_EVENT: when the kernel confirmed it (2023 onwards)


def test_brief_leaves_other_layouts_to_the_decoder():
    v6 = event(ct.MSG_NEW, ct.CtTuple("fd00::1", "fd00::2", 6, 1, 2), ct.CtTuple("fd00::2", "fd00::1", 6, 2, 1),
               family=socket.AF_INET6)
    assert ct.brief(*body(v6)[:1], v6, *body(v6)[1:]) is None
    mtype, start, end = body(TCP_NEW)
    bent = bytearray(TCP_NEW)
    bent[start + 4 + 2] = ct.CTA_TUPLE_REPLY  # the first tuple says it is the reply's
    assert ct.brief(mtype, bytes(bent), start, end) is None
    assert ct.brief(mtype, TCP_NEW, start, start + 60) is None  # cut short
    assert ct.brief(ct.MSG_NEW + 1, TCP_NEW, start, end) is None  # not an entry


# ------------------------------------------------------------------ the kernel's filter


def run_cbpf(prog: list[tuple[int, int, int, int]], packet: bytes) -> int:
    """Classic BPF as the kernel runs a socket filter, for the instructions event_filter uses
    (loads out of the packet end the program with 0, as the kernel's do)."""
    a = x = pc = 0
    while True:
        code, jt, jf, k = prog[pc]
        pc += 1
        if code in (0x20, 0x30, 0x40):  # ld w abs, ld b abs, ld w ind
            off, size = (k + x, 4) if code == 0x40 else (k, 4 if code == 0x20 else 1)
            if off + size > len(packet):
                return 0
            a = int.from_bytes(packet[off: off + size], "big")
        elif code == 0x07:  # tax
            x = a
        elif code == 0x54:  # and k
            a &= k
        elif code == 0x15:  # jeq k
            pc += jt if a == k else jf
        elif code == 0x06:  # ret k
            return k
        else:
            raise AssertionError(f"instruction {code:#x} is not one event_filter writes")


def test_the_filter_passes_pods_and_services_and_drops_the_nodes_own():
    prog = ct.event_filter([PODS, SERVICES])
    assert len(prog) < 64 and all(j < 256 for _c, jt, jf, _k in prog for j in (jt, jf))
    for msg in (TCP_NEW, UDP_NEW, ICMP_NEW):
        assert run_cbpf(prog, msg) == 0xFFFFFFFF
    assert run_cbpf(prog, LOOPBACK_NEW) == 0  # the API on 127.0.0.1
    node = tcp("172.30.0.11", "172.30.0.2", 40000, 2379)  # etcd
    assert run_cbpf(prog, node) == 0
    # A pod at either end, a Service's address, or a pod that answers for the node (node port).
    for msg in (tcp("10.244.1.2", "172.30.0.2", 1, 2), tcp("172.30.0.2", "10.244.1.2", 1, 2),
                tcp("172.30.0.2", "10.96.0.10", 1, 80, reply_src="172.30.0.9"),
                tcp("192.0.2.7", "172.30.0.11", 1, 30080, reply_src="10.244.1.2", destroyed=True)):
        assert run_cbpf(prog, msg) == 0xFFFFFFFF, ct.decode_event(*body(msg)[:1], msg, *body(msg)[1:])
    v6 = event(ct.MSG_NEW, ct.CtTuple("fd00::1", "fd00::2", 6, 1, 2), ct.CtTuple("fd00::2", "fd00::1", 6, 2, 1),
               family=socket.AF_INET6)
    assert run_cbpf(prog, v6) == 0xFFFFFFFF  # not read here: the agent sorts it
    # An IPv6-only cluster (no IPv4 range): no IPv4 event is a pod's, every IPv6 one is sorted by the agent.
    none = ct.event_filter([])
    for msg in (TCP_NEW, UDP_NEW, ICMP_NEW, node):
        assert run_cbpf(none, msg) == 0
    assert run_cbpf(none, v6) == 0xFFFFFFFF


def test_a_node_port_to_an_endpoint_outside_the_pod_network_is_no_record_in_either_family():
    """Neither end a pod's nor in the Services' range (a node port's Service whose endpoint is
    outside the cluster): IPv4's is left out by the kernel's filter, IPv6's by the agent alike."""
    r = recorder()
    r.directory.service = lambda ip, proto, port: "shop/ext"  # the node port names a Service
    prog = ct.event_filter([PODS, SERVICES])
    for client, node, endpoint, family in (("192.0.2.99", "172.30.0.11", "192.0.2.50", socket.AF_INET),
                                           ("2001:db8::99", "2001:db8::10", "2001:db8::50", socket.AF_INET6)):
        msg = event(ct.MSG_NEW, ct.CtTuple(client, node, 6, 40000, 30443), ct.CtTuple(endpoint, node, 6, 443, 40000),
                    family=family, extra=nl.attr(ct.CTA_STATUS, struct.pack("!I", ct.IPS_DST_NAT | ct.IPS_SRC_NAT)))
        if family == socket.AF_INET:
            assert run_cbpf(prog, msg) == 0
        feed(r, msg)
    assert len(r.ring) == 0


# ------------------------------------------------------------------ records made when read


WEB = Identity("shop/web", "node2", {"app": "web"}, True)
CLIENT = Identity("shop/client", "node1", {"app": "client"}, False)
WEB6, CLIENT6 = "fd00:10:244:2::3", "fd00:10:244:1::2"  # their IPv6 addresses (dual-stack)


class Directory:
    def __init__(self) -> None:
        self.ids = {"10.244.2.3": WEB, "10.244.1.2": CLIENT, WEB6: WEB, CLIENT6: CLIENT}
        self.asked = 0
        self.changes = 0

    def version(self):
        return self.changes

    def named_before(self, count):
        """The engine's log, told from what ``ids`` held when last asked."""
        snap, self._snap = getattr(self, "_snap", None), dict(self.ids)
        got = [(ip, was, None) for ip, was in (snap or {}).items() if was is not None and self.ids.get(ip) != was]
        self._told = getattr(self, "_told", 0) + len(got)
        return self._told, got

    def identity(self, ip):
        self.asked += 1
        return self.ids.get(ip)

    def service(self, ip, proto, port):
        return None

    def service_names(self):
        return self.service

    def drop(self, prefix):
        return None


class Carried:
    def __init__(self, table=None, restarts=()):
        self.table = dict(table or {})
        self.restarts = list(restarts)

    def carried_restarts(self):
        out, self.restarts = self.restarts, []
        return out

    def take_carried(self, key):
        return self.table.pop(key, None)


TAI = 37 * 10**9  # CLOCK_TAI - CLOCK_REALTIME, as an NTP daemon sets it


def recorder(carried=None) -> FlowRecorder:
    return FlowRecorder("node2", Directory(), "/nonexistent", group=143, clock=lambda: 1000.0, carried=carried,
                        tai_offset=lambda: TAI)


def feed(r: FlowRecorder, *messages: bytes) -> None:
    """One read of the recorder's socket that finds ``messages``."""
    r._begin()
    for msg in messages:
        r._on_conntrack_datagram(msg, 1000.0)


def test_records_are_made_when_read_with_the_names_of_when_they_came():
    r = recorder()
    feed(r, tcp("10.244.1.2", "10.244.2.3", 40000, 80), tcp("172.30.0.11", "172.30.0.2", 1, 2379))
    assert len(r.ring) == 1 and r.flows["forwarded"] == 1  # the node's own connection is no record
    (entry,) = r.ring.records
    assert isinstance(entry, PendingConnection) and entry._flow is None
    r.directory.ids["10.244.2.3"] = None  # web goes, and its address is someone else's later
    r.directory.changes += 1
    (flow,) = r.ring.last(FlowFilter.parse([("to-pod", "shop/web")]), 10)
    assert (flow.src.identity, flow.dst.identity, flow.direction, flow.seq) == (CLIENT, WEB, "ingress", 1)
    assert flow.time == 1000.0  # no CTA_TIMESTAMP_EVENT in this one: when it was read
    assert entry.event is None  # the kernel's bytes go once the record is made


def test_names_are_asked_once_per_address_until_the_pods_change():
    r = recorder()
    feed(r, *(tcp("10.244.1.2", "10.244.2.3", 40000 + i, 80) for i in range(50)))
    assert r.directory.asked == 2
    r.directory.changes += 1
    feed(r, tcp("10.244.1.2", "10.244.2.3", 41000, 80))
    assert r.directory.asked == 4


def test_followers_get_records_at_once():
    ring = FlowRing(10)
    r = recorder()
    r.ring = ring
    follower = ring.follow(FlowFilter())
    feed(r, tcp("10.244.1.2", "10.244.2.3", 40000, 80))
    assert follower.queue.qsize() == 1 and follower.queue.get_nowait().dst.identity == WEB


# ------------------------------------------------------------------ what the fast path carried


def test_carried_key_orders_the_ends_as_podpath_does():
    a, b = socket.inet_aton("10.244.1.2"), socket.inet_aton("10.244.2.3")
    key, lower = carried_key(a, 40000, b, 80)
    assert key == a + b + (40000).to_bytes(2, "big") + (80).to_bytes(2, "big") and lower
    assert carried_key(b, 80, a, 40000) == (key, False)
    assert carried_key(a, 2, a, 1)[0] == a + a + b"\x00\x01\x00\x02"  # one address: the ports decide


def test_an_end_adds_what_the_fast_path_carried():
    a, b = socket.inet_aton("10.244.1.2"), socket.inet_aton("10.244.2.3")
    key, _ = carried_key(a, 40000, b, 80)
    # The lower end (client) sent 1000 packets of 1 MB in all past conntrack, web 500 of 26 kB.
    r = recorder(Carried({key: (1000, 500, 1_000_000, 26_000, 0)}))
    feed(r, tcp("10.244.1.2", "10.244.2.3", 40000, 80, destroyed=True, counters=(6, 400, 5, 300)))
    (flow,) = list(r.ring)
    assert (flow.packets_sent, flow.bytes_sent, flow.packets_received, flow.bytes_received) == (
        1006, 1_000_400, 505, 26_300)
    assert r.carried.table == {}  # taken from the map
    # Seen from web's end (web the original source): the other way round.
    r = recorder(Carried({key: (1000, 500, 1_000_000, 26_000, 0)}))
    feed(r, tcp("10.244.2.3", "10.244.1.2", 80, 40000, destroyed=True))
    assert (list(r.ring)[0].bytes_sent, list(r.ring)[0].bytes_received) == (26_000, 1_000_000)


def test_a_reused_tuple_keeps_each_connections_counts():
    a, b = socket.inet_aton("10.244.1.2"), socket.inet_aton("10.244.2.3")
    key, _ = carried_key(a, 40000, b, 80)
    # Two connections ended on one tuple before the agent read their ends: the first two were
    # moved to the ring by the SYNs that reused it, the third is in the map.
    r = recorder(Carried({key: (3, 0, 3000, 0, 0)}, [(key, (1, 0, 1000, 0, 0)), (key, (2, 0, 2000, 0, 0))]))
    ends = [tcp("10.244.1.2", "10.244.2.3", 40000, 80, destroyed=True) for _ in range(3)]
    feed(r, *ends)
    assert [f.bytes_sent for f in r.ring] == [1000, 2000, 3000]
    assert r._restarts == {}


def test_a_reused_tuple_gives_each_end_the_counts_of_its_lifetime():
    """One source port three times in a row, the ends read late: the first connection's counts
    went to the ring with the second's SYN; the second was answered from TIME_WAIT and reset
    (it carried nothing); the third's counts are in the map by the time the second's end is
    read.  Each end takes what was first carried between its start and its stop."""
    a, b = socket.inet_aton("10.244.1.2"), socket.inet_aton("10.244.2.3")
    key, _ = carried_key(a, 41003, b, 5002)
    s = 10**9  # conntrack stamps real time, the fast path TAI (TAI seconds ahead)
    carried = Carried({key: (700, 0, 1_000_000, 0, 21 * s + TAI)})
    r = recorder(carried)
    feed(r)  # a read before the second connection's SYN: the ring was empty then
    carried.restarts = [(key, (2100, 0, 3_000_000, 0, 11 * s + TAI))]  # that SYN moved the first's counts
    first, short, third = (tcp("10.244.1.2", "10.244.2.3", 41003, 5002, destroyed=True, lived=lived)
                           for lived in ((10 * s, 15 * s), (15 * s, 16 * s), (20 * s, 30 * s)))
    feed(r, first, short)  # the ring is read once the ends are in hand: the SYN's news is in it
    assert [f.bytes_sent for f in r.ring] == [3_000_000, 0]
    assert key not in carried.table and list(r._restarts[key]) == [(700, 0, 1_000_000, 0, 21 * s + TAI, False)]
    feed(r, third)  # the third's counts, taken with the second's end, wait for it
    assert [f.bytes_sent for f in r.ring] == [3_000_000, 0, 1_000_000] and r._restarts == {}


def test_counts_split_by_an_early_take_add_up_at_the_end():
    """A later connection's counts taken from the map with an earlier end (one step, no look
    first) wait in the agent; what the fast path carries of it afterwards is in the map
    again, and its end adds both."""
    a, b = socket.inet_aton("10.244.1.2"), socket.inet_aton("10.244.2.3")
    key, _ = carried_key(a, 41003, b, 5002)
    s = 10**9
    carried = Carried({key: (7, 0, 7000, 0, 21 * s + TAI)})
    r = recorder(carried)
    feed(r, tcp("10.244.1.2", "10.244.2.3", 41003, 5002, destroyed=True, lived=(15 * s, 16 * s)))
    carried.table[key] = (3, 0, 3000, 0, 25 * s + TAI)  # carried after the take
    feed(r, tcp("10.244.1.2", "10.244.2.3", 41003, 5002, destroyed=True, lived=(20 * s, 30 * s)))
    assert [(f.packets_sent, f.bytes_sent) for f in r.ring] == [(0, 0), (10, 10_000)]
    assert r._restarts == {} and carried.table == {}


def test_counts_a_syn_moved_and_the_next_connections_in_the_map_go_each_to_its_own():
    """A client that reuses its ports: each end's counts came through the ring with the next
    SYN, and what the map holds is the next connection's: taken with this end, it waits for
    that one's."""
    a, b = socket.inet_aton("10.244.1.2"), socket.inet_aton("10.244.2.3")
    key, _ = carried_key(a, 40000, b, 80)
    s = 10**9
    carried = Carried({key: (2, 0, 200, 0, 21 * s + TAI)}, [(key, (1, 0, 100, 0, 11 * s + TAI))])
    r = recorder(carried)
    feed(r, tcp("10.244.1.2", "10.244.2.3", 40000, 80, destroyed=True, lived=(10 * s, 20 * s)))
    assert [f.bytes_sent for f in r.ring] == [100] and key not in carried.table
    feed(r, tcp("10.244.1.2", "10.244.2.3", 40000, 80, destroyed=True, lived=(20 * s, 30 * s)))
    assert [f.bytes_sent for f in r.ring] == [100, 200] and r._restarts == {}


def test_counts_a_retransmitted_syn_ack_moved_add_to_what_was_carried_after_it():
    """The server retransmits its SYN-ACK in the middle of an established connection (the
    client's packets lost a while): the programs move what they carried so far to the ring as
    if the tuple were reused; what they carry afterwards is in the map.  The end adds both."""
    a, b = socket.inet_aton("10.244.1.2"), socket.inet_aton("10.244.2.3")
    key, _ = carried_key(a, 40000, b, 80)
    s = 10**9
    carried = Carried({key: (3, 0, 3000, 0, 15 * s + TAI)}, [(key, (1, 0, 1000, 0, 11 * s + TAI))])
    r = recorder(carried)
    feed(r, tcp("10.244.1.2", "10.244.2.3", 40000, 80, destroyed=True, lived=(10 * s, 20 * s)))
    assert [(f.packets_sent, f.bytes_sent) for f in r.ring] == [(4, 4000)]
    assert carried.table == {} and r._restarts == {}


def test_a_read_takes_the_socket_first_then_the_fast_paths_news_once():
    """Whatever the fast path moved to its ring before an end was queued is in the ring when
    the read looks at the ends; it is read once per read of the socket, not once per end."""
    a, b = socket.inet_aton("10.244.1.2"), socket.inet_aton("10.244.2.3")
    key, _ = carried_key(a, 40000, b, 80)
    calls: list[str] = []
    ends = [tcp("10.244.1.2", "10.244.2.3", 40000, 80, destroyed=True) for _ in range(3)]

    class Sock:
        queued = [ends[:2], ends[2:]]

        def recv_many(self):
            calls.append("recv")
            if self.queued and len(calls) == 2:  # the SYN that reused the tuple, while the socket is read
                carried.restarts = [(key, (1, 0, 100, 0, 0)), (key, (2, 0, 200, 0, 0))]
            return self.queued.pop(0) if self.queued else []

        def fileno(self):
            return -1

    class Carried2(Carried):
        def carried_restarts(self):
            calls.append("ring")
            return super().carried_restarts()

    class Loop:
        def add_reader(self, *args):
            calls.append("wait")

        def call_soon(self, *args):
            calls.append("again")

    carried = Carried2({key: (3, 0, 300, 0, 0)})
    r = recorder(carried)
    r.ct_sock, r._loop = Sock(), Loop()  # type: ignore[assignment]
    r._drain_conntrack()
    assert calls == ["recv", "recv", "recv", "ring", "wait"]
    assert [f.bytes_sent for f in r.ring] == [100, 200, 300]


def test_counts_carried_before_a_connection_began_are_not_its_own():
    a, b = socket.inet_aton("10.244.1.2"), socket.inet_aton("10.244.2.3")
    key, _ = carried_key(a, 40000, b, 80)
    s = 10**9
    # An earlier connection's counts, moved by a SYN after its end was read: nobody's now.
    r = recorder(Carried({key: (5, 0, 5000, 0, 12 * s + TAI)}, [(key, (1, 0, 1000, 0, 2 * s + TAI))]))
    feed(r, tcp("10.244.1.2", "10.244.2.3", 40000, 80, destroyed=True, lived=(10 * s, 20 * s)))
    assert [f.bytes_sent for f in r.ring] == [5000] and r._restarts == {}


def test_carried_key_orders_ipv6_ends_as_128_bit_numbers():
    a, b = socket.inet_pton(socket.AF_INET6, "fd00::ff"), socket.inet_pton(socket.AF_INET6, "fd00::1:0")
    key, lower = carried_key(a, 40000, b, 80)
    assert len(key) == 36 and lower  # struct podflow6_key: fd00::ff is below fd00::1:0, as numbers
    assert key == a + b + (40000).to_bytes(2, "big") + (80).to_bytes(2, "big")
    assert carried_key(b, 80, a, 40000) == (key, False)


def test_an_ipv6_end_adds_what_the_fast_path_carried_and_a_reused_tuple_keeps_its_own():
    """IPv6 ends are decoded in full (no fixed offsets for them) and take their counts by the
    IPv6 key, as IPv4's do: what the map holds, and what a SYN reusing the tuple moved to the ring."""
    a, b = socket.inet_pton(socket.AF_INET6, CLIENT6), socket.inet_pton(socket.AF_INET6, WEB6)
    key, _ = carried_key(a, 40000, b, 80)
    s = 10**9
    carried = Carried({key: (3, 1, 3_000_000, 52, 21 * s + TAI)}, [(key, (1000, 500, 1_000_000, 26_000, 11 * s + TAI))])
    r = recorder(carried)
    first, second = (tcp(CLIENT6, WEB6, 40000, 80, destroyed=True, counters=(6, 400, 5, 300), lived=lived)
                     for lived in ((10 * s, 15 * s), (20 * s, 30 * s)))
    feed(r, first, second)
    assert [(f.src.ip, f.packets_sent, f.bytes_sent, f.packets_received, f.bytes_received) for f in r.ring] == [
        (CLIENT6, 1006, 1_000_400, 505, 26_300), (CLIENT6, 9, 3_000_400, 6, 352)]
    assert carried.table == {} and r._restarts == {}
    # Seen from web's end (web the original source): the other way round.
    r = recorder(Carried({key: (1000, 500, 1_000_000, 26_000, 0)}))
    feed(r, tcp(WEB6, CLIENT6, 80, 40000, destroyed=True))
    assert [(f.bytes_sent, f.bytes_received) for f in r.ring] == [(26_000, 1_000_000)]


def test_only_ended_pod_to_pod_tcp_is_looked_up():
    carried = Carried()
    asked = []
    carried.take_carried = lambda key: asked.append(key)  # type: ignore[method-assign]
    r = recorder(carried)
    feed(r, tcp("10.244.1.2", "10.244.2.3", 1, 80),  # not ended
         tcp("10.244.1.2", "10.96.0.10", 2, 80, reply_src="10.244.2.3", destroyed=True, status=ct.IPS_DST_NAT),
         tcp("10.244.1.2", "10.244.2.3", 3, 80, destroyed=True),
         tcp(CLIENT6, "fd00:10:96::a", 4, 80, reply_src=WEB6, destroyed=True, status=ct.IPS_DST_NAT),
         tcp(CLIENT6, WEB6, 5, 80), tcp(CLIENT6, WEB6, 6, 80, destroyed=True))
    six = [socket.inet_pton(socket.AF_INET6, a) for a in (CLIENT6, WEB6)]
    assert asked == [carried_key(socket.inet_aton("10.244.1.2"), 3, socket.inet_aton("10.244.2.3"), 80)[0],
                     carried_key(six[0], 6, six[1], 80)[0]]


def test_since_looks_behind_records_that_came_late():
    """A conntrack event is read up to a moment after it happened (the recorder reads every
    50 ms), so the ring's order is its records' time order only nearly."""
    ring = FlowRing(10)
    r = recorder()
    r.ring = ring
    for when in (10.0, 12.0, 11.9, 12.5):  # the 11.9 one came after the 12.0 one
        flow = r.connection(ct.CtEvent(False, socket.AF_INET, ct.CtTuple("10.244.1.2", "10.244.2.3", 6, 1, 80),
                                       ct.CtTuple("10.244.2.3", "10.244.1.2", 6, 80, 1), event_ns=int(when * 1e9)))
        ring.add(flow)
    assert [f.time for f in ring.last(FlowFilter(), 10, since=11.5)] == [12.0, 11.9, 12.5]
    assert [f.time for f in ring.last(FlowFilter(), 2)] == [11.9, 12.5]


# ------------------------------------------------------------------ the per-event loop in C


class Everyone(Directory):
    """Names every address but the node's own (172.30.0.0/16): the captured events' too."""

    def identity(self, ip):
        self.asked += 1
        return None if ip.startswith("172.30.") else Identity(f"ns/{ip}", "node1", {}, True)


def real_and_made() -> list[bytes]:
    """The captured events, and events made to every layout the recorder meets."""
    s = 10**9
    made = [tcp("10.244.1.2", "10.244.2.3", 40000, 80), tcp("10.244.2.3", "10.244.1.2", 80, 40000, destroyed=True),
            tcp("10.244.1.2", "10.244.2.3", 40001, 80, destroyed=True, lived=(10 * s, 20 * s)),
            tcp("10.244.1.2", "10.96.0.10", 2, 80, reply_src="10.244.2.3", destroyed=True, status=ct.IPS_DST_NAT),
            tcp("172.30.0.11", "172.30.0.2", 1, 2379), tcp("172.30.0.2", "10.96.0.10", 1, 80, reply_src="172.30.0.9"),
            tcp(CLIENT6, WEB6, 5, 80), tcp(CLIENT6, WEB6, 6, 80, destroyed=True)]
    return [ICMP_NEW, TCP_NEW, UDP_NEW, LOOPBACK_NEW, TCP_DESTROY, *made, TCP_DESTROY + TCP_NEW]


@pytest.mark.parametrize("counting", [False, True])
def test_the_c_loop_reads_what_the_python_loop_reads(counting):
    batch = real_and_made()
    r = FlowRecorder("node2", Everyone(), "/nonexistent", group=143, clock=lambda: 1000.0,
                     carried=Carried() if counting else None, services=[ipaddress.IPv4Network("10.96.0.0/12")])
    r._begin()
    here = r._decode_here(batch)
    asked = r.directory.asked
    assert _ctevents.decode(batch, r._names, r._name, r.prefixes, counting) == here
    assert r.directory.asked == asked  # the names the Python loop asked for are remembered
    kinds = [item if type(item) is bytes else item[:2] for item in here]
    assert kinds[:5] == [(m, ct.MSG_NEW) for m in (ICMP_NEW, TCP_NEW, UDP_NEW, LOOPBACK_NEW)] + [
        (TCP_DESTROY, ct.MSG_DELETE)]
    assert batch[9] not in kinds  # the node's own (etcd): left out ...
    assert (batch[10], ct.MSG_NEW) in kinds  # ... but not a Service's connection from the node
    assert kinds[-3:] == batch[-3:]  # IPv6, two messages in one datagram: as they came, the long way
    carries = [item[5] for item in here if type(item) is tuple and item[5]]
    if counting:  # the DESTROYs of TCP between pods: their key, their source's end, their lifetime
        a, b = socket.inet_aton("10.244.1.2"), socket.inet_aton("10.244.2.3")
        assert carries[1:] == [(carried_key(b, 80, a, 40000)[0], False, 0, 0),
                               (carried_key(a, 40001, b, 80)[0], True, 10 * 10**9, 20 * 10**9),
                               (carried_key(a, 2, socket.inet_aton("10.96.0.10"), 80)[0], False, 0, 0)]
        _mtype, start, end = body(TCP_DESTROY)
        assert carries[0][2:] == ct.lifetime(TCP_DESTROY, start, end) != (0, 0)
    else:
        assert carries == []


def netlink_ct_layouts() -> list[bytes]:
    """configure()'s arguments as agentd.kernel.netlink_ct gives them at import."""
    return [v.to_bytes(n, "little") for n, m, w in (
        (ct._PORTS_LEN, ct._PORTS_MASK, ct._PORTS_WANT), (ct._ICMP_LEN, ct._ICMP_MASK, ct._ICMP_WANT),
        (ct._LIFETIME_LEN, ct._LIFETIME_MASK, ct._LIFETIME_WANT)) for v in (m, w)]


def test_a_refused_configure_keeps_the_layouts_it_had():
    """configure() refused -- a later layout too long, or layouts of other lengths than the
    C loop's fixed offsets -- changes nothing: the layouts before it stay, never one installed
    in part (an 8-byte ports layout would let a 28-byte message be read 40 bytes past its
    end).  The 28-byte message and the captured events read as before."""
    short = bytearray(28)
    short[0:4] = (28).to_bytes(4, "little")
    short[4:6] = ct.MSG_NEW.to_bytes(2, "little")
    short[16] = socket.AF_INET
    batch = [ICMP_NEW, TCP_NEW, UDP_NEW, TCP_DESTROY, bytes(short)]

    def decode():
        return _ctevents.decode(batch, {}, lambda a: "named", [PODS], True)

    before = decode()
    assert before[-1] == bytes(short)  # laid out otherwise: for Python to read (and count)
    try:
        with pytest.raises(ValueError):  # the icmp layout's 300 bytes: refused after ports was read
            _ctevents.configure(b"\0" * 8, b"\0" * 8, b"\0" * 300, b"\0" * 300, b"", b"")
        assert decode() == before
        with pytest.raises(ValueError):  # each accepted, but not the lengths of the fixed offsets
            _ctevents.configure(*[b"\0" * 8] * 6)
        assert decode() == before
    finally:
        _ctevents.configure(*netlink_ct_layouts())  # as netlink_ct left it, whatever happened


class Nobody(Directory):
    """Names no address at all: a pod whose record has not come yet, one gone already."""

    def identity(self, ip):
        return None


def test_a_pods_connection_is_kept_before_its_pod_is_known():
    """The node's own connections are told by their addresses (no end in the pods' or the
    Services' ranges, as the kernel's filter tells them), not by whether a pod is named: a
    new pod's first connection -- before its record reached the agent -- is a record with
    its addresses, in the C loop, the Python loop and the long way (IPv6) alike."""
    r = FlowRecorder("node2", Nobody(), "/nonexistent", group=143, clock=lambda: 1000.0,
                     pods=[ipaddress.IPv4Network("10.244.0.0/16"), ipaddress.IPv6Network("fd00:10:244::/48")],
                     services=[ipaddress.IPv4Network("10.96.0.0/12")])
    batch = [tcp("10.244.1.9", "8.8.8.8", 40000, 53), tcp("172.30.0.11", "172.30.0.2", 1, 2379),
             tcp("8.8.8.8", "10.244.1.9", 53, 40001, destroyed=True)]
    r._begin()
    here = r._decode_here(batch)
    assert _ctevents.decode(batch, r._names, r._name, r.prefixes, False) == here
    assert [item[0] for item in here] == [batch[0], batch[2]]  # the etcd connection alone is left out
    feed(r, *batch, tcp(CLIENT6, "2001:db8::1", 7, 443), tcp("2001:db8::2", "2001:db8::1", 8, 179))
    got = [(f.src.ip, f.dst.ip, f.src.identity) for f in r.ring]
    assert got == [("10.244.1.9", "8.8.8.8", None), ("8.8.8.8", "10.244.1.9", None), (CLIENT6, "2001:db8::1", None)]


GATEWAY, BROADCAST, GATEWAY6 = "10.244.179.1", "10.244.179.255", "fd00:10:244:179::1"  # node2's bridge


def generic(src: str, dst: str, proto: int = 2) -> bytes:
    """A NEW of a protocol conntrack tracks without ports (IGMP's, 2): CTA_PROTO_NUM alone."""
    def tup(kind: int, a: str, b: str) -> bytes:
        family = socket.AF_INET6 if ":" in a else socket.AF_INET
        v4 = family == socket.AF_INET
        ip = (nl.attr(ct.CTA_IP_V4_SRC if v4 else ct.CTA_IP_V6_SRC, socket.inet_pton(family, a))
              + nl.attr(ct.CTA_IP_V4_DST if v4 else ct.CTA_IP_V6_DST, socket.inet_pton(family, b)))
        return nl.nested(kind, nl.nested(ct.CTA_TUPLE_IP, ip), nl.nested(ct.CTA_TUPLE_PROTO, nl.attr(ct.CTA_PROTO_NUM, bytes([proto]))))

    family = socket.AF_INET6 if ":" in src else socket.AF_INET
    return nl.encode_nfgen(ct.MSG_NEW, 0, 0, family, tup(ct.CTA_TUPLE_ORIG, src, dst) + tup(ct.CTA_TUPLE_REPLY, dst, src))


def udp(src: str, dst: str, sport: int, dport: int) -> bytes:
    return event(ct.MSG_NEW, ct.CtTuple(src, dst, 17, sport, dport), ct.CtTuple(dst, src, 17, dport, sport),
                 socket.AF_INET6 if ":" in src else socket.AF_INET)


# The node's own packets from its bridge's address (in the pod network: the pods' gateway) to no
# pod -- an IGMP report, mDNS, the subnet's broadcast, the node to itself -- and what pods (named
# or not yet) send to it or it to them, from it to a Service, from another node's pod.
NODES_OWN = [generic(GATEWAY, "224.0.0.22"), generic(GATEWAY, "239.77.1.2"), udp(GATEWAY, "224.0.0.251", 5353, 5353),
             udp(GATEWAY, BROADCAST, 5353, 5353), tcp(GATEWAY, GATEWAY, 40000, 53), tcp("172.30.0.11", GATEWAY, 1, 22)]
PODS_OWN = [udp("10.244.179.5", GATEWAY, 40000, 53), tcp(GATEWAY, "10.244.179.5", 40001, 8080),
            udp("10.244.179.5", "224.0.0.251", 5353, 5353), tcp(GATEWAY, "10.96.0.10", 40002, 80, reply_src="10.244.179.6"),
            tcp("10.244.5.7", GATEWAY, 40003, 9100), tcp("10.244.179.250", "172.30.0.2", 40004, 80)]
OWN = [ipaddress.ip_address(a) for a in (GATEWAY, BROADCAST, GATEWAY6)]


def test_the_filter_leaves_out_the_nodes_own_addresses_in_the_pod_network():
    own = sorted(int(a) for a in OWN if a.version == 4)
    prog = ct.event_filter([PODS, SERVICES], own=own)
    assert len(prog) < 128 and all(j < 256 for _c, jt, jf, _k in prog for j in (jt, jf))
    assert [run_cbpf(prog, m) for m in NODES_OWN] == [0] * len(NODES_OWN)
    assert [run_cbpf(prog, m) for m in PODS_OWN] == [0xFFFFFFFF] * len(PODS_OWN)
    for msg in (TCP_NEW, UDP_NEW, ICMP_NEW, generic(GATEWAY6, "ff02::16", 58)):  # IPv6: the agent sorts it
        assert run_cbpf(prog, msg) == 0xFFFFFFFF
    assert run_cbpf(prog, LOOPBACK_NEW) == 0
    plain = ct.event_filter([PODS, SERVICES])  # no own addresses: the gateway is the pod network's
    assert run_cbpf(plain, NODES_OWN[0]) == 0xFFFFFFFF


def test_the_nodes_own_traffic_from_its_bridge_is_no_record():
    """What the node sends from its bridge's address to no pod is its own, in the C loop, the
    Python loop and the long way (no ports: IGMP; IPv6) alike -- also where the kernel's
    filter is not attached; what pods send to the gateway, or it to them, is recorded."""
    r = FlowRecorder("node2", Nobody(), "/nonexistent", group=143, clock=lambda: 1000.0,
                     pods=[ipaddress.IPv4Network("10.244.0.0/16"), ipaddress.IPv6Network("fd00:10:244::/48")],
                     services=[ipaddress.IPv4Network("10.96.0.0/12")], own=OWN)
    six_own = [generic(GATEWAY6, "ff02::16", 58), udp(GATEWAY6, "ff02::fb", 5353, 5353)]
    six_pods = [udp("fd00:10:244:179::5", GATEWAY6, 40005, 53)]
    feed(r, *NODES_OWN, *six_own, *PODS_OWN, *six_pods)
    got = [(f.src.ip, f.dst.ip) for f in r.ring]
    assert got == [("10.244.179.5", GATEWAY), (GATEWAY, "10.244.179.5"), ("10.244.179.5", "224.0.0.251"),
                   (GATEWAY, "10.96.0.10"), ("10.244.5.7", GATEWAY), ("10.244.179.250", "172.30.0.2"),
                   ("fd00:10:244:179::5", GATEWAY6)]
    plain = FlowRecorder("node2", Nobody(), "/nonexistent", group=143, clock=lambda: 1000.0,
                         pods=[ipaddress.IPv4Network("10.244.0.0/16")])
    feed(plain, NODES_OWN[0], NODES_OWN[2])  # not told the node's own: the pod network's, as before
    assert len(plain.ring) == 2


def test_the_c_loop_reads_a_socket_in_batches():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with a, b:
        a.setblocking(False)
        r = recorder()
        batch = [tcp("10.244.1.2", "10.244.2.3", 40000 + i, 80) for i in range(150)] + [b"\x01\x02"]
        for msg in batch:
            b.send(msg)
        items, n, lost = _ctevents.drain(a.fileno(), 100, r._names, r._name, [], False)
        assert (n, lost) == (128, 0)  # whole reads of 64 until the budget is reached
        assert [item[0] for item in items] == batch[:128]
        items, n, lost = _ctevents.drain(a.fileno(), 100, r._names, r._name, [], False)
        assert (n, lost, items[-1]) == (23, 0, b"\x01\x02") and len(items) == 23
        assert _ctevents.drain(a.fileno(), 100, r._names, r._name, [], False) == ([], 0, 0)
    with pytest.raises(OSError):
        _ctevents.drain(a.fileno(), 100, r._names, r._name, [], False)  # closed


def test_malformed_datagrams_are_counted_never_raised():
    r = recorder()
    cut = TCP_NEW[:100]
    lying = bytearray(TCP_NEW)
    lying[0] += 8  # says it is longer than it is
    feed(r, b"\x01", cut, bytes(lying), b"", tcp("10.244.1.2", "10.244.2.3", 40000, 80))
    assert r.malformed == 3 and len(r.ring) == 1  # (an empty datagram holds no message)


def test_every_cut_and_bent_byte_of_an_event_is_read_or_counted():
    """What the kernel would never send -- an event cut anywhere, any one byte changed -- is
    read (as some event) or counted as malformed: never an exception, never a read out of
    the datagram (the C loop's checks of lengths and layouts)."""
    r = recorder(Carried())
    r.ct_timeouts = lambda: {"tcp_timeout_time_wait": 120, "tcp_timeout_max_retrans": 300,  # ends moved back too
                             "tcp_timeout_unacknowledged": 300, "icmp_timeout": 30}  # fmt: skip
    r.directory.ids.update({"127.0.0.1": CLIENT})
    for msg in (TCP_DESTROY, TCP_NEW, ICMP_NEW):
        datagrams = [msg[:n] for n in range(len(msg))]
        for at in range(len(msg)):
            bent = bytearray(msg)
            bent[at] ^= 0xFF
            datagrams.append(bytes(bent))
        for data in datagrams:
            r._begin()
            r._on_conntrack_datagram(data, 1000.0)
    assert r.malformed > 0 and r.events > 0
    for entry in r.ring.records:  # and the records of what was read can be made
        assert ring_record(entry).node == "node2"


@pytest.mark.parametrize("client", ["10.244.1.2", CLIENT6])
def test_an_end_after_its_pod_went_names_it_and_adds_what_the_fast_path_carried(client):
    """The client pod deleted (its entries flushed) before its connection's DESTROY is read:
    the end names the pods as they were when the entry was made, and so is a connection
    between pods whose carried counts are looked up and added."""
    src = socket.inet_pton(socket.AF_INET6 if ":" in client else socket.AF_INET, client)
    web = WEB6 if ":" in client else "10.244.2.3"
    dst = socket.inet_pton(socket.AF_INET6 if ":" in client else socket.AF_INET, web)
    key, _ = carried_key(src, 40000, dst, 80)
    carried = Carried({key: (10, 5, 10_000, 500, 950 * 10**9)})
    r = recorder(carried)
    r.tai_offset = lambda: 0
    feed(r, tcp(client, web, 40000, 80))
    r.directory.ids[client] = None  # at 1000 s, the recorder's clock
    r.directory.changes += 1
    feed(r, tcp(client, web, 40000, 80, destroyed=True, counters=(1, 60, 1, 60), lived=(900 * 10**9, 999 * 10**9)))
    _new, end = r.ring.last(FlowFilter(), 10)
    assert (end.event, end.src.identity, end.dst.identity) == ("end", CLIENT, WEB)
    assert (end.packets_sent, end.bytes_sent, end.bytes_received) == (11, 10_060, 560) and carried.table == {}
