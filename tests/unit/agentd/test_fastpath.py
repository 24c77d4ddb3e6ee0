"""The C fast path (agentd/dataplane/_fastpath.c) against the Python reference, byte for byte:
TSO segmentation against segment_tcp, and the transmit loop (TUN reads into segment slots,
UDP GSO sends) against it.  The receive side is held to the Coalescer in
test_dataplane_logic.py.

No root, no devices: the "TUN" is a SOCK_SEQPACKET socket (one message per read), the underlay
UDP on loopback.  The library must be built (the setup step builds it): these tests fail, not
skip, where it is not.
"""

import contextlib
import select
import socket
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentd.dataplane import _fast
from agentd.dataplane._forward import complete_checksum, segment_tcp
from agentd.dataplane._gro import Coalescer, _BatchViews, coalesce_packets, csum_ok
from proto import packet as P

SRC, DST = "10.244.1.2", "10.244.2.2"
TS_OPTS = b"\x01\x01\x08\x0a" + bytes(range(8))


def super_packet(payload: bytes, *, seq=1000, flags=P.TCP_ACK | P.TCP_PSH, opts=TS_OPTS, ttl=63, ident=100):
    return bytes(P.tcp_packet(SRC, DST, P.TcpHeader(40000, 5201, seq, 777, flags, 502, options=opts),
                              payload, ttl=ttl, identification=ident))


def seg(seq, data=b"x" * 1000, **kw):
    return P.tcp_packet(SRC, DST, P.TcpHeader(40000, kw.pop("dport", 5201), seq, 777, kw.pop("flags", P.TCP_ACK),
                                              502, options=kw.pop("opts", TS_OPTS)), data, **kw)


def reference(sp: bytes, mss: int, ttl_decrement=False):
    out = bytearray(len(sp) + (len(sp) // max(mss, 1) + 2) * 120)
    count, seglen, total = segment_tcp(memoryview(sp), mss, out, ttl_decrement)
    return count, seglen, total, bytes(out[:total])


def test_the_library_is_built_and_matches_this_code():
    lib, why = _fast.load()
    assert lib is not None, why


def test_every_field_python_mirrors_matches_the_c_struct():
    # struct fp_state's shared fields as _fastpath.c exports them (fp_fields), field by field.
    lib, why = _fast.load()
    assert lib is not None, why
    exported = [lib.fp_field_name(i).decode() for i in range(lib.fp_field_count())]
    assert exported == [name for name, _ in _fast._State._fields_]
    assert _fast.layout_mismatch(lib) == ""


@settings(max_examples=200, deadline=None)
@given(
    payload=st.binary(min_size=0, max_size=66000 - 60),
    mss=st.one_of(st.sampled_from([1420, 1428, 1448, 536, 1001, 100]), st.integers(1, 1460)),
    seq=st.one_of(st.integers(0, 0xFFFFFFFF), st.integers(0xFFFFFFFF - 70000, 0xFFFFFFFF)),
    ident=st.one_of(st.integers(0, 0xFFFF), st.integers(0xFFC0, 0xFFFF)),
    opts=st.sampled_from([b"", TS_OPTS, b"\x01\x01\x01\x01", bytes(40)]),
    flags=st.sampled_from([P.TCP_ACK, P.TCP_ACK | P.TCP_PSH, P.TCP_ACK | P.TCP_FIN | P.TCP_PSH,
                           P.TCP_ACK | P.TCP_CWR, P.TCP_ACK | P.TCP_CWR | P.TCP_PSH | P.TCP_FIN]),
    ttl=st.integers(2, 255),
    ttl_decrement=st.booleans(),
)
def test_c_segmentation_equals_the_reference(payload, mss, seq, ident, opts, flags, ttl, ttl_decrement):
    """Any MSS (odd ones too), wrap of ID and sequence number, flags, TCP options, TTL: the C
    segmenter writes exactly what segment_tcp writes (which test_dataplane_logic checks
    against the naive RFC 1071 checksum and a kernel sender's rules)."""
    sp = super_packet(payload, seq=seq, ident=ident, opts=opts, flags=flags, ttl=ttl)
    assert _fast.segment(sp, mss, ttl_decrement) == reference(sp, mss, ttl_decrement)


def test_c_segmentation_refuses_what_the_reference_refuses():
    assert _fast.segment(super_packet(b"x" * 3000, ttl=1), 1448, True)[0] == -2     # TTL exhausted
    assert _fast.segment(super_packet(b"x" * 3000, ttl=1), 1448, False)[0] == 3     # not decremented: fine
    assert _fast.segment(P.udp_datagram(SRC, DST, 1, 2, b"x" * 100), 1448)[0] == -1  # not TCP
    assert _fast.segment(b"\x45" + bytes(50), 1448)[0] == -1                        # garbage
    assert _fast.segment(super_packet(b"x" * 3000), 0)[0] == -1                     # no MSS
    bad = bytearray(super_packet(b"x" * 10))
    bad[32] = 0xF0                                                                  # TCP header past the end
    assert _fast.segment(bytes(bad), 1448)[0] == -1


# -- the transmit loop: TUN reads into segment slots, segmented in place or gathered --------------


def vnet_tso(sp: bytes, mss: int) -> bytes:
    hl = 20 + ((sp[32] >> 4) << 2)
    return P.VirtioNetHdr(flags=1, gso_type=1, hdr_len=hl, gso_size=mss, csum_start=20, csum_offset=16).encode() + sp


@contextlib.contextmanager
def c_sender(mtu: int):
    """A FastPath reading a SOCK_SEQPACKET socket as its TUN and sending UDP (GSO) to a socket
    on loopback, which receives one datagram per inner packet (no GRO)."""
    lib, why = _fast.load()
    assert lib is not None, why
    tun_app, tun_worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        tun_worker.setblocking(False)
        tun_app.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        rx.bind(("127.0.0.1", 0))
        rx.setblocking(False)
        tx.bind(("127.0.0.1", 0))
        fp = _fast.FastPath(lib, "udp", tun_fd=tun_worker.fileno(), sock_fd=tx.fileno(), mtu=mtu, ttl_decrement=True,
                            port=rx.getsockname()[1], udp_gso=True, udp_gro=False)
        fp.set_routes(_fast.NextHopTable({"10.244.0.0/16": "127.0.0.1"}))

        def received(want: int = 0):
            """What has come; with ``want``, waiting (up to 5 s) until that many have: loopback
            delivers in the sender's softirq, which a busy machine may put off to ksoftirqd."""
            out: list[bytes] = []
            give_up = time.monotonic() + 5
            while True:
                try:
                    out.append(rx.recv(1 << 16))
                except BlockingIOError:
                    if len(out) >= want or time.monotonic() > give_up:
                        return out
                    select.select([rx], [], [], 0.05)

        yield fp, tun_app, received
    finally:
        for s in (tun_app, tun_worker, rx, tx):
            s.close()


@st.composite
def tun_reads(draw):
    """What a TUN with TSO hands over: super-packets of a few geometries (the slots follow the
    last one seen), plain packets small and large, one with a partial checksum."""
    reads = []
    seq = draw(st.integers(0, 0xFFFFFFFF))
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["tso", "tso", "tso", "plain", "partial"]))
        opts = draw(st.sampled_from([TS_OPTS, b""]))
        if kind == "tso":
            mss = draw(st.sampled_from([1420, 1000, 700, 1432 - len(opts)]))
            payload = draw(st.binary(min_size=mss + 1, max_size=65535 - 40 - len(opts)))
            sp = super_packet(payload, seq=seq, opts=opts, flags=P.TCP_ACK)
            reads.append(("tso", vnet_tso(sp, mss), sp, mss))
            seq = (seq + len(payload)) & 0xFFFFFFFF
        else:
            size = draw(st.sampled_from([10, 900, 1400]))
            pkt = super_packet(bytes([size & 0xFF]) * size, seq=seq, opts=opts)
            vnet = P.VNET_HDR_NONE
            if kind == "partial":  # the TCP checksum field holds the pseudo-header sum only
                pkt = bytearray(pkt)
                ps = P.pseudo_header_sum(bytes(pkt[12:16]), bytes(pkt[16:20]), 6, len(pkt) - 20)
                pkt[36:38] = P.fold(ps).to_bytes(2, "big")
                pkt = bytes(pkt)
                vnet = P.VirtioNetHdr(flags=1, csum_start=20, csum_offset=16).encode()
            reads.append((kind, vnet + pkt, pkt, 0))
    return reads


def expected_wire(reads) -> list[bytes]:
    out = []
    for kind, _raw, pkt, mss in reads:
        if kind == "tso":
            _count, seglen, total, data = reference(pkt, mss, ttl_decrement=True)
            out += [data[i : i + seglen] for i in range(0, total, seglen)]
        else:
            buf = bytearray(pkt)
            if kind == "partial":
                complete_checksum(buf, 0, len(buf), 20, 16)
            P.decrement_ttl(buf, 0)
            out.append(bytes(buf))
    return out


@settings(max_examples=60, deadline=None)
@given(tun_reads())
def test_c_transmit_loop_sends_what_the_reference_segmenter_makes(reads):
    """Super-packets of the slots' geometry are segmented where readv put them, others are
    gathered first (and move the slots to their geometry); every inner packet on the wire is
    byte for byte what segment_tcp makes, in order, TTL decremented (udp)."""
    with c_sender(mtu=1472) as (fp, tun, received):
        for _kind, raw, _pkt, _mss in reads:
            tun.send(raw)
        assert fp.run((), 0) == 0
        want = expected_wire(reads)
        assert received(len(want)) == want
        counters = fp.counters()
    assert counters["tun_reads"] == len(reads) and counters["drop:malformed"] == 0
    assert counters["tso_frames"] == sum(k == "tso" for k, *_ in reads)


def test_c_transmit_loop_hands_back_what_needs_an_icmp_error():
    with c_sender(mtu=1472) as (fp, tun, received):
        fp.set_routes(_fast.NextHopTable({"10.244.9.0/24": "127.0.0.1"}))  # DST is not routed now
        tun.send(P.VNET_HDR_NONE + seg(1))
        assert fp.run((), 0) == 1  # a packet waits for Python
        kind, pkt = fp.slow_packet()
        assert kind == _fast.SLOW_NET_UNREACHABLE and pkt == seg(1)
        fp.set_routes(_fast.NextHopTable({"10.244.0.0/16": "127.0.0.1"}))
        sp = super_packet(b"y" * 5000, ttl=1, flags=P.TCP_ACK)
        tun.send(vnet_tso(sp, 1420))
        assert fp.run((), 0) == 1
        # gathered from the segment slots: the first SLOW_MAX bytes, as they were read
        assert fp.slow_packet() == (_fast.SLOW_TIME_EXCEEDED, sp[: _fast.SLOW_MAX])
        assert received() == []
        assert fp.counters()["drop:no_route"] == 1 and fp.counters()["drop:ttl_exceeded"] == 1


def test_c_transmit_loop_rate_limits_its_icmp_errors_and_keeps_forwarding():
    """A pod's flood of TTL-1 packets (plain and TSO) and unrouted ones: a burst of 50 and then
    1000 a second leave the C loop for an ICMP error (as the kernel's icmp_msgs_per_sec); the
    rest are counted and the loop goes on in C, and the good packets between them flow."""
    n, good = 2000, 100
    with c_sender(mtu=1472) as (fp, tun, received):
        fp.set_routes(_fast.NextHopTable({"10.244.2.0/24": "127.0.0.1"}))
        for i in range(n):
            if i % (n // good) == 0:
                tun.send(P.VNET_HDR_NONE + seg(1 + i * 1000))
            if i % 3 == 0:
                tun.send(vnet_tso(super_packet(b"y" * 3000, seq=1 + i, ttl=1), 1420))
            elif i % 3 == 1:
                tun.send(P.VNET_HDR_NONE + seg(1 + i, data=b"z" * 20, ttl=1))
            else:
                tun.send(P.VNET_HDR_NONE + P.tcp_packet(SRC, "10.244.9.9", P.TcpHeader(1, 2, 3, 4, P.TCP_ACK, 5), b"u"))
        returns, start = 0, time.monotonic()
        while fp.counters()["tun_reads"] < n + good and time.monotonic() < start + 30:
            returns += fp.run((), 0) == 1  # 0: its 1 ms was up (timeout 0), the TUN not drained
        elapsed_ms = (time.monotonic() - start) * 1000
        counters = fp.counters()
        assert len(received(good)) == good
    assert returns <= 50 + elapsed_ms + 1 < n / 4
    assert counters["drop:icmp_ratelimited"] == n - returns
    assert counters["drop:ttl_exceeded"] + counters["drop:no_route"] == n


def test_c_transmit_loop_drops_a_read_longer_than_its_gather_buffer_as_malformed():
    """A read longer than a stock TUN gives (a BIG TCP super-packet; the SOCK_SEQPACKET stand-in
    gives any length): the slots and the overflow iovec take it, but the packet is not
    copied into the gather buffer (65,590 bytes after the virtio-net header) -- it is dropped
    as malformed, and the loop goes on.  One of exactly that length still is handed back."""
    limit = 65536 + 64 - 10
    with c_sender(mtu=1472) as (fp, tun, received):
        fp.set_routes(_fast.NextHopTable({"10.244.2.0/24": "127.0.0.1"}))
        # (an IPv4 total length cannot say so much: the headers of shorter packets, padded)
        unrouted = bytearray(super_packet(b"u" * 5000))
        unrouted[16:20] = bytes([192, 0, 2, 1])  # no route: handed back, gathered first
        unrouted += b"u" * (limit - len(unrouted))
        tun.send(P.VNET_HDR_NONE + bytes(unrouted))
        assert fp.run((), 0) == 1
        assert fp.slow_packet() == (_fast.SLOW_NET_UNREACHABLE, bytes(unrouted[: _fast.SLOW_MAX]))
        tun.send(P.VNET_HDR_NONE + bytes(unrouted) + b"u" * (70000 - limit))
        tso = super_packet(b"t" * 5000, flags=P.TCP_ACK)  # MSS 1000: not the slots' geometry, gathered
        tun.send(vnet_tso(tso + b"t" * (70000 - len(tso)), 1000))
        tun.send(P.VNET_HDR_NONE + seg(1))
        assert fp.run((), 0) == 0
        assert received(1) == expected_wire([("plain", None, bytes(seg(1)), 0)])  # the loop went on
        c = fp.counters()
    assert (c["drop:malformed"], c["drop:no_route"], c["tun_reads"], c["tso_frames"]) == (2, 1, 4, 0)


# -- IPv6 inner packets (udp): the same loops, byte for byte the Python reference ------------------

SRC6, DST6 = "fd00:10:244:1::2", "fd00:10:244:2::2"


def payloads(max_size: int, min_size: int = 1):
    """Payloads of any length up to ``max_size`` (hypothesis' binaries are mostly short: super-packets
    of many segments need lengths drawn first), random bytes repeated."""
    return st.builds(lambda n, seed: (seed * (n // len(seed) + 1))[:n], st.integers(min_size, max_size),
                     st.binary(min_size=1, max_size=256))


ROUTES = {"10.244.0.0/16": "127.0.0.1", "fd00:10:244::/48": "127.0.0.1"}


def super_packet6(payload: bytes, *, seq=1000, flags=P.TCP_ACK | P.TCP_PSH, opts=TS_OPTS, hop_limit=63,
                  traffic_class=0, flow_label=0x54321, dport=5201):
    return bytes(P.tcp6_packet(SRC6, DST6, P.TcpHeader(40000, dport, seq, 777, flags, 502, options=opts), payload,
                               hop_limit=hop_limit, traffic_class=traffic_class, flow_label=flow_label))


@settings(max_examples=200, deadline=None)
@given(
    payload=st.one_of(st.binary(min_size=0, max_size=3000), payloads(65535 - 100)),
    mss=st.one_of(st.sampled_from([1400, 1408, 1428, 536, 1001, 100]), st.integers(1, 1440)),
    seq=st.one_of(st.integers(0, 0xFFFFFFFF), st.integers(0xFFFFFFFF - 70000, 0xFFFFFFFF)),
    opts=st.sampled_from([b"", TS_OPTS, b"\x01\x01\x01\x01", bytes(40)]),
    flags=st.sampled_from([P.TCP_ACK, P.TCP_ACK | P.TCP_PSH, P.TCP_ACK | P.TCP_FIN | P.TCP_PSH,
                           P.TCP_ACK | P.TCP_CWR, P.TCP_ACK | P.TCP_CWR | P.TCP_PSH | P.TCP_FIN]),
    hop_limit=st.integers(2, 255),
    traffic_class=st.integers(0, 255),
    flow_label=st.integers(0, 0xFFFFF),
    ttl_decrement=st.booleans(),
)
def test_c_tcpv6_segmentation_equals_the_reference(payload, mss, seq, opts, flags, hop_limit, traffic_class,
                                                   flow_label, ttl_decrement):
    """TCPv6 super-packets: payload length per segment, no header checksum, the TCP checksum
    over the IPv6 pseudo header, the hop limit: what segment_tcp writes (checked against the
    naive checksum and a kernel sender's rules in test_dataplane_ipv6)."""
    sp = super_packet6(payload, seq=seq, opts=opts, flags=flags, hop_limit=hop_limit, traffic_class=traffic_class,
                       flow_label=flow_label)
    assert _fast.segment(sp, mss, ttl_decrement) == reference(sp, mss, ttl_decrement)


def test_c_tcpv6_segmentation_refuses_what_the_reference_refuses():
    assert _fast.segment(super_packet6(b"x" * 3000, hop_limit=1), 1400, True)[0] == -2    # hop limit exhausted
    assert _fast.segment(super_packet6(b"x" * 3000, hop_limit=1), 1400, False)[0] == 3
    ext = bytearray(super_packet6(b"x" * 3000))
    ext[6] = 0  # a hop-by-hop options header first
    assert _fast.segment(bytes(ext), 1400)[0] == -1
    assert _fast.segment(b"\x60" + bytes(70), 1400)[0] == -1


def vnet_tso6(sp: bytes, mss: int) -> bytes:
    hl = 40 + ((sp[52] >> 4) << 2)
    return P.VirtioNetHdr(flags=1, gso_type=P.VIRTIO_NET_HDR_GSO_TCPV6, hdr_len=hl, gso_size=mss, csum_start=40,
                          csum_offset=16).encode() + sp


@st.composite
def tun_reads_dual(draw):
    """What a TUN with TSO hands over from dual-stack pods: super-packets and plain packets of
    both families (the slots follow the last geometry seen, whatever its family), some with a
    partial checksum."""
    reads = []
    seq = draw(st.integers(0, 0xFFFFFFFF))
    for _ in range(draw(st.integers(1, 8))):
        v6 = draw(st.booleans())
        kind = draw(st.sampled_from(["tso", "tso", "tso", "plain", "partial"]))
        opts = draw(st.sampled_from([TS_OPTS, b""]))
        ihl = 40 if v6 else 20
        if kind == "tso":
            mss = draw(st.sampled_from([1400, 1000, 700, 1432 - ihl + 20 - len(opts)]))
            payload = draw(st.binary(min_size=mss + 1, max_size=65535 - 80))
            if v6:
                sp = super_packet6(payload, seq=seq, opts=opts, flags=P.TCP_ACK)
                reads.append(("tso", vnet_tso6(sp, mss), sp, mss))
            else:
                sp = super_packet(payload, seq=seq, opts=opts, flags=P.TCP_ACK)
                reads.append(("tso", vnet_tso(sp, mss), sp, mss))
            seq = (seq + len(payload)) & 0xFFFFFFFF
            continue
        size = draw(st.sampled_from([10, 900, 1380]))
        make = super_packet6 if v6 else super_packet
        pkt = make(bytes([size & 0xFF]) * size, seq=seq, opts=opts)
        vnet = P.VNET_HDR_NONE
        if kind == "partial":  # the TCP checksum field holds the pseudo-header sum only
            pkt = bytearray(pkt)
            src, dst = (pkt[8:24], pkt[24:40]) if v6 else (pkt[12:16], pkt[16:20])
            ps = P.pseudo_header_sum(bytes(src), bytes(dst), 6, len(pkt) - ihl)
            pkt[ihl + 16 : ihl + 18] = P.fold(ps).to_bytes(2, "big")
            pkt = bytes(pkt)
            vnet = P.VirtioNetHdr(flags=1, csum_start=ihl, csum_offset=16).encode()
        reads.append((kind, vnet + pkt, pkt, 0))
    return reads


def expected_wire_dual(reads) -> list[bytes]:
    out = []
    for kind, _raw, pkt, mss in reads:
        if kind == "tso":
            _count, seglen, total, data = reference(pkt, mss, ttl_decrement=True)
            out += [data[i : i + seglen] for i in range(0, total, seglen)]
            continue
        buf = bytearray(pkt)
        v6 = buf[0] >> 4 == 6
        if kind == "partial":
            complete_checksum(buf, 0, len(buf), 40 if v6 else 20, 16)
        if v6:
            P.decrement_hop_limit(buf, 0)
        else:
            P.decrement_ttl(buf, 0)
        out.append(bytes(buf))
    return out


@settings(max_examples=60, deadline=None)
@given(tun_reads_dual())
def test_c_transmit_loop_sends_both_families_as_the_reference_makes_them(reads):
    """IPv6 and IPv4 reads mixed: TCPv6 super-packets segmented in the slots or gathered
    (moving the slots to their geometry), plain IPv6 packets checksummed and their hop limit
    decremented; every inner packet on the wire what segment_tcp makes, in order."""
    with c_sender(mtu=1472) as (fp, tun, received):
        fp.state.ipv6 = 1
        fp.set_routes(_fast.NextHopTable(ROUTES))
        for _kind, raw, _pkt, _mss in reads:
            tun.send(raw)
        assert fp.run((), 0) == 0
        want = expected_wire_dual(reads)
        assert received(len(want)) == want
        counters = fp.counters()
    assert counters["tun_reads"] == len(reads) and counters["drop:malformed"] == counters["drop:not_ipv4"] == 0
    assert counters["tso_frames"] == sum(k == "tso" for k, *_ in reads)


def test_c_transmit_loop_hands_back_ipv6_for_icmpv6_errors_and_ipip_drops_it():
    with c_sender(mtu=1472) as (fp, tun, received):
        fp.state.ipv6 = 1
        fp.set_routes(_fast.NextHopTable({"fd00:10:244:9::/64": "127.0.0.1"}))  # DST6 is not routed
        plain = super_packet6(b"p" * 100)
        tun.send(P.VNET_HDR_NONE + plain)
        assert fp.run((), 0) == 1
        assert fp.slow_packet() == (_fast.SLOW_NET_UNREACHABLE, plain)
        fp.set_routes(_fast.NextHopTable(ROUTES))
        sp = super_packet6(b"y" * 5000, hop_limit=1, flags=P.TCP_ACK)
        tun.send(vnet_tso6(sp, 1400))
        assert fp.run((), 0) == 1
        assert fp.slow_packet() == (_fast.SLOW_TIME_EXCEEDED, sp[: _fast.SLOW_MAX])
        tun.send(P.VNET_HDR_NONE + super_packet6(b"q", hop_limit=1))
        assert fp.run((), 0) == 1 and fp.slow_packet()[0] == _fast.SLOW_TIME_EXCEEDED
        assert received() == []
        # A backend that carries IPv4 only (ipip): IPv6 is not sent, and counted.
        fp.state.ipv6 = 0
        tun.send(P.VNET_HDR_NONE + plain)
        tun.send(vnet_tso6(super_packet6(b"z" * 5000), 1400))
        assert fp.run((), 0) == 0 and received() == []
        c = fp.counters()
    assert (c["drop:no_route"], c["drop:ttl_exceeded"], c["drop:not_ipv4"]) == (1, 2, 2)


# -- the receive side: C merges TCPv6 runs exactly as the Coalescer does -------------------------


@contextlib.contextmanager
def c_writer6():
    """A FastPath (udp, IPv6 carried) whose TUN fd is a SOCK_SEQPACKET socket; yields
    (fastpath, read_writes)."""
    lib, why = _fast.load()
    assert lib is not None, why
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.setblocking(False)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    fp = _fast.FastPath(lib, "udp", tun_fd=a.fileno(), sock_fd=-1, mtu=1500, ttl_decrement=True, port=8285,
                        udp_gso=True, udp_gro=True, ipv6=True)

    def writes():
        out = []
        while True:
            try:
                blob = b.recv(1 << 17)
            except BlockingIOError:
                return out
            out.append((P.VirtioNetHdr.decode(blob), blob[10:]))

    try:
        yield fp, writes
    finally:
        fp.close()
        a.close()
        b.close()


def seg6(seq, data=b"x" * 1000, **kw) -> bytes:
    return P.tcp6_packet(SRC6, DST6, P.TcpHeader(40000, kw.pop("dport", 5201), seq, 777, kw.pop("flags", P.TCP_ACK),
                                                 502, options=kw.pop("opts", TS_OPTS)), data, **kw)


@st.composite
def dual_streams(draw):
    """Segments of TCP flows of both families with what ends a GRO run among them."""
    mss = draw(st.sampled_from([1000, 1400, 300]))
    seq = draw(st.integers(0, 0xFFFFFFFF))
    packets = []
    for ev in draw(st.lists(st.sampled_from(["v6"] * 20 + ["v4"] * 5 + ["short", "psh", "gap", "flow", "label",
                                                                          "hops", "tclass", "icmp6", "corrupt"]),
                            min_size=1, max_size=100)):
        if ev == "icmp6":
            packets.append(P.ipv6_packet(P.IPv6Header(src=SRC6, dst=DST6, next_header=58), bytes(64)))
            continue
        ln = mss if ev != "short" else draw(st.integers(1, mss - 1))
        kw = {"flow_label": 99} if ev == "label" else {"hop_limit": 9} if ev == "hops" else \
            {"traffic_class": 0x20} if ev == "tclass" else {"dport": 5202} if ev == "flow" else {}
        if ev == "gap":
            seq = (seq + 1) & 0xFFFFFFFF
        flags = P.TCP_ACK | (P.TCP_PSH if ev == "psh" else 0)
        data = bytes([len(packets) & 0xFF]) * ln
        packets.append(seg(seq, data, flags=flags) if ev == "v4" else seg6(seq, data, flags=flags, **kw))
        if ev == "corrupt":  # a payload byte changed in flight: the TCP checksum fails
            packets[-1] = packets[-1][:-1] + bytes([packets[-1][-1] ^ 0x20])
        seq = (seq + ln) & 0xFFFFFFFF
    return packets


@settings(max_examples=150, deadline=None)
@given(dual_streams())
def test_c_coalescing_of_both_families_makes_exactly_the_python_writes(packets):
    with c_writer6() as (fp, writes):
        assert fp.write_packets(packets) == len(packets)
        assert writes() == coalesce_packets(packets)


@settings(max_examples=80, deadline=None)
@given(
    payload=payloads(64000),
    mss=st.sampled_from([1400, 1388, 1000, 536, 777]),
    seq=st.integers(0, 0xFFFFFFFF),
    opts=st.sampled_from([b"", TS_OPTS]),
    v6=st.booleans(),
)
def test_c_segment_then_merge_round_trips_to_the_super_packet(payload, mss, seq, opts, v6):
    """What one worker segments (C) and the other merges (C) is the sender's super-packet again:
    its headers (the IP length of the whole, PSH where it was), its payload, one TUN write per
    at most 64 segments, with the TSO kind of its family and a checksum to complete; and the
    Python loops make the same bytes."""
    make = super_packet6 if v6 else super_packet
    sp = make(payload, seq=seq, opts=opts, flags=P.TCP_ACK | P.TCP_PSH)
    count, seglen, total, data = _fast.segment(sp, mss)
    segs = [data[i : i + seglen] for i in range(0, total, seglen)]
    with c_writer6() as (fp, writes):
        assert fp.write_packets(segs) == count
        got = writes()
    assert got == coalesce_packets(segs)
    ihl = 40 if v6 else 20
    hl = ihl + 20 + len(opts)
    assert b"".join(p[hl:] for _, p in got) == payload
    if count > 1 and count <= 64 and len(sp) <= 0xFFFF:
        ((vnet, merged),) = got
        assert vnet.gso_type == (P.VIRTIO_NET_HDR_GSO_TCPV6 if v6 else P.VIRTIO_NET_HDR_GSO_TCPV4)
        assert (vnet.gso_size, vnet.hdr_len, vnet.csum_start, vnet.csum_offset) == (mss, hl, ihl, 16)
        # The sender's headers but the checksum fields (IPv4's is recomputed; TCP's is partial).
        mask = [(ihl + 16, ihl + 18)] + ([] if v6 else [(10, 12)])
        strip = lambda p: bytes(b for i, b in enumerate(p[:hl]) if not any(a <= i < e for a, e in mask))  # noqa: E731
        assert strip(merged) == strip(sp)
        full = bytearray(merged)
        complete_checksum(full, 0, len(full), ihl, 16)
        assert P.transport_checksum_ok(full)


# -- checksums are validated before merging, as tcp4_gro_receive / tcp6_gro_receive do -------------


def naive_csum_ok(p: bytes) -> bool:
    """RFC 1071's word-by-word reference: IPv4's header checksum and the TCP checksum."""
    if p[0] >> 4 == 4:
        pseudo = P.pseudo_header_sum(p[12:16], p[16:20], P.IPPROTO_TCP, len(p) - 20)
        return P.checksum_naive(p[:20]) == 0 and P.checksum_naive(p[20:], pseudo) == 0
    return P.checksum_naive(p[40:], P.pseudo_header_sum(p[8:24], p[24:40], P.IPPROTO_TCP, len(p) - 40)) == 0


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(1, 1460), min_size=1, max_size=24), v6=st.booleans(),
       flips=st.lists(st.tuples(st.integers(0, 23), st.integers(0, 1 << 20), st.integers(0, 7)), max_size=6))
def test_the_checksum_checks_agree_with_rfc_1071s_reference(sizes, v6, flips):
    """The per-packet check and the batch check (one np.add.reduceat over 2 KB slots) say what
    the word-by-word reference says, for odd and even lengths, with bits flipped anywhere a
    checksum covers (IPv4 from its checksum field on; IPv6 from its addresses on)."""
    make = seg6 if v6 else seg
    packets = [bytearray(make(1 + i, bytes([i * 7 & 0xFF]) * n)) for i, n in enumerate(sizes)]
    first = 8 if v6 else 10
    for i, at, bit in flips:
        if i < len(packets):
            p = packets[i]
            p[first + at % (len(p) - first)] ^= 1 << bit
    want = [naive_csum_ok(bytes(p)) for p in packets]
    ihl = 40 if v6 else 20
    assert [csum_ok(memoryview(bytes(p)), ihl) for p in packets] == want
    buf = bytearray(2048 * len(packets))
    for j, p in enumerate(packets):
        buf[j * 2048 : j * 2048 + len(p)] = p
    arr = np.frombuffer(buf, np.uint8)
    vw = _BatchViews(arr, 0, 2048, len(packets), ihl + 32, ihl)
    bad = Coalescer._csum_failures(arr, vw, np.array([len(p) for p in packets]))
    assert bad == [i for i, ok in enumerate(want) if not ok]


def python_writes(packets, how: str):
    """The Coalescer's writes and checksum-failure count for ``packets`` fed packet by packet
    ("add"), as a recvmmsg batch in 2 KB slots ("batch") or as one UDP GRO read of equal-sized
    datagrams back to back ("gro"); the batch forms must be taken whole."""
    writes = []

    def write(parts):
        blob = b"".join(bytes(p) for p in parts)
        writes.append((P.VirtioNetHdr.decode(blob), blob[10:]))

    c = Coalescer(write)
    if how == "add":
        for p in packets:
            c.add(memoryview(p))
    elif how == "batch":
        buf = bytearray(2048 * len(packets))
        for j, p in enumerate(packets):
            buf[j * 2048 : j * 2048 + len(p)] = p
        assert c.add_batch(np.frombuffer(buf, np.uint8), 0, 2048, np.array([len(p) for p in packets]))
    else:
        blob = b"".join(packets)
        assert c.add_segments(np.frombuffer(blob + bytes(2048), np.uint8), 0, len(packets[0]), len(blob))
    c.flush()
    return writes, c.csum_errors


def corrupt(pkt: bytes, what: str) -> bytes:
    """``pkt`` with one thing wrong in flight: a payload byte, the TCP checksum, the IPv4 header
    checksum, or a pseudo-header byte (the last destination address byte, the IPv4 header
    checksum made right again, so that only the TCP checksum catches it)."""
    b = bytearray(pkt)
    ihl = 20 if b[0] >> 4 == 4 else 40
    if what == "payload":
        b[-7] ^= 0x5A
    elif what == "tcp checksum":
        b[ihl + 16] ^= 0x01
    elif what == "ip header checksum":
        b[10] ^= 0x01
    else:
        b[ihl - 1] ^= 0x04
        if ihl == 20:
            b[10:12] = b"\0\0"
            b[10:12] = P.checksum(bytes(b[:20])).to_bytes(2, "big")
    return bytes(b)


CORRUPTIONS = [(v6, what, at) for v6 in (False, True)
               for what in ("payload", "tcp checksum", "ip header checksum", "pseudo header")
               for at in (0, 5, 11) if not (v6 and what == "ip header checksum")]


@pytest.mark.parametrize(("v6", "what", "at"), CORRUPTIONS)
@pytest.mark.parametrize("size", [1000, 999])
def test_a_segment_whose_checksum_fails_goes_alone_and_the_rest_still_merge(v6, what, at, size):
    """Twelve segments of one flow, one corrupted in flight: it goes to the TUN on its own, as it
    came, claiming no valid checksum (flags 0, no GSO: the pod's stack checks it and drops it),
    counted; the good ones merge around it.  C and the Python paths (packet by packet, a
    recvmmsg batch, a UDP GRO read, odd segment sizes too) write the same bytes."""
    make = seg6 if v6 else seg
    good = [make(1 + i * size, bytes([i]) * size) for i in range(12)]
    packets = list(good)
    packets[at] = bad = corrupt(good[at], what)
    assert bad != good[at]
    before, after = coalesce_packets(good[:at]), coalesce_packets(good[at + 1 :])
    assert [v.gso_type != 0 for v, _ in before + after] == [True] * (at > 0) + [True] * (at < 11)
    want = before + [(P.VirtioNetHdr(), bad)] + after
    assert want[len(before)][0].flags == 0
    for how in ("add", "batch", "gro"):
        assert python_writes(packets, how) == (want, 1), how
    with c_writer6() as (fp, writes):
        assert fp.write_packets(packets) == 12
        assert writes() == want
        assert fp.counters()["rx_csum_errors"] == 1


def test_good_segments_are_not_counted_and_non_tcp_is_not_checked_as_tcp():
    """A clean run merges whole with no failure counted; an ICMP packet among the segments (its
    bytes are no TCP checksum) goes alone as before, not counted as a checksum failure."""
    packets = [seg(1 + i * 1000) for i in range(8)]
    packets.insert(4, bytes(P.ipv4_packet(P.IPv4Header(src=SRC, dst=DST, protocol=P.IPPROTO_ICMP),
                                          P.icmp_message(8, 0, 1, bytes(1024)))))
    want = coalesce_packets(packets)
    assert [v.gso_type for v, _ in want] == [1, 0, 1]
    for how in ("add", "batch"):
        assert python_writes(packets, how) == (want, 0), how
    with c_writer6() as (fp, writes):
        fp.write_packets(packets)
        assert writes() == want and fp.counters()["rx_csum_errors"] == 0


def test_an_ipv4_header_longer_than_its_packet_is_malformed():
    """inner_ok took an IPv4 packet whose IHL says more header than the packet has (60 bytes of
    header in a 40-byte packet whose total length says 40): written to the TUN, counted as
    received.  Now it is malformed, as one whose IHL is below 5; a header exactly as long as the
    packet (no payload) is still a packet."""
    def ipv4(first: int, size: int) -> bytes:
        p = bytearray(size)
        p[0], p[8], p[9] = first, 64, P.IPPROTO_ICMP
        p[2:4] = size.to_bytes(2, "big")  # the total length: the packet's
        return bytes(p)

    good = [seg(1 + i * 1000) for i in range(3)]
    longer = [ipv4(0x4F, 40), ipv4(0x46, 20), ipv4(0x4F, 59), ipv4(0x44, 40)]
    whole = ipv4(0x4A, 40)  # 40 bytes of header, all of the packet
    with c_writer6() as (fp, writes):
        assert fp.write_packets([good[0], *longer, good[1], whole, good[2]]) == 4
        assert fp.counters()["drop:malformed"] == len(longer)
        assert writes() == coalesce_packets([*good[:2], whole, good[2]])
