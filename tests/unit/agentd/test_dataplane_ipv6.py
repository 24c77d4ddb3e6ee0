"""The user-space data plane's Python loops on IPv6 inner packets (the reference and fall-back
the C loops are held to in test_fastpath.py): next hops keyed by IPv6 prefixes beside IPv4
ones, TCPv6 TSO segmentation as a kernel sender makes it (payload length per segment, no
header checksum, the TCP checksum over the IPv6 pseudo header, the hop limit), the vectorized
segmenter byte for byte the reference, GRO-style merging as ipv6_gro_receive and
tcp_gro_receive merge, whole batches the same writes as packet by packet, checksum completion."""

import socket
import struct

import numpy as np
import pytest
from coalescer_feed import batch_writes
from hypothesis import given, settings
from hypothesis import strategies as st

from agentd.dataplane._forward import ForwardError, NextHopTable, complete_checksum, segment_tcp, segment_tcp_packets
from agentd.dataplane._gro import Coalescer, coalesce_packets
from agentd.dataplane._tso import TsoSegmenter
from agentd.dataplane.udp import inner_packet_ok
from proto import packet as P

SRC, DST = "10.244.1.2", "10.244.2.2"
SRC6, DST6 = "fd00:10:244:1::2", "fd00:10:244:2::2"
TS_OPTS = b"\x01\x01\x08\x0a" + bytes(range(8))
TSO6 = P.VIRTIO_NET_HDR_GSO_TCPV6


def payloads(max_size: int, min_size: int = 1):
    """Payloads of any length up to ``max_size`` (hypothesis' binaries are mostly short: super-packets
    of many segments need lengths drawn first), random bytes repeated."""
    return st.builds(lambda n, seed: (seed * (n // len(seed) + 1))[:n], st.integers(min_size, max_size),
                     st.binary(min_size=1, max_size=256))


def super_packet6(payload: bytes, *, seq=1000, flags=P.TCP_ACK | P.TCP_PSH, opts=TS_OPTS, hop_limit=63,
                  traffic_class=0, flow_label=0x12345, partial=True) -> bytes:
    """A TSO super-packet as a TUN with TUN_F_TSO6 hands it over: one big IPv6/TCP packet whose
    TCP checksum field holds only the pseudo-header sum (CHECKSUM_PARTIAL)."""
    pkt = bytearray(P.tcp6_packet(SRC6, DST6, P.TcpHeader(40000, 5201, seq, 777, flags, 502, options=opts),
                                  payload, hop_limit=hop_limit, traffic_class=traffic_class, flow_label=flow_label))
    if partial:
        ps = P.pseudo_header_sum(bytes(pkt[8:24]), bytes(pkt[24:40]), 6, len(pkt) - 40)
        struct.pack_into("!H", pkt, 56, P.fold(ps))
    return bytes(pkt)


def seg6(seq, data=b"x" * 1000, **kw) -> bytes:
    """One TCPv6 segment of a flow (as received from the underlay: checksums complete)."""
    return P.tcp6_packet(SRC6, kw.pop("dst", DST6), P.TcpHeader(40000, kw.pop("dport", 5201), seq, 777,
                         kw.pop("flags", P.TCP_ACK), 502, options=kw.pop("opts", TS_OPTS)), data, **kw)


def seg4(seq, data=b"x" * 1000, **kw) -> bytes:
    return P.tcp_packet(SRC, DST, P.TcpHeader(40000, kw.pop("dport", 5201), seq, 777, kw.pop("flags", P.TCP_ACK),
                                              502, options=kw.pop("opts", TS_OPTS)), data, **kw)


def parse6(pkt):
    ip, seg = P.split_ipv6(pkt)
    tcp = P.TcpHeader.decode(seg)
    return ip, tcp, bytes(seg[tcp.header_length :])


def payload_of(pkt: bytes) -> bytes:
    if pkt[0] >> 4 == 6:
        return parse6(pkt)[2]
    _ip, seg = P.split_ipv4(pkt)
    return bytes(seg[P.TcpHeader.decode(seg).header_length :])


# -- next hops -----------------------------------------------------------------------------------


def test_next_hops_of_both_families_by_longest_prefix():
    t = NextHopTable({"10.244.2.0/24": "192.168.50.2", "fd00:10:244:2::/64": "192.168.50.2",
                      "fd00:10:244::/48": "192.168.50.9", "fd00:10:244:2:8000::/65": "192.168.50.3",
                      "::/0": "192.168.50.254"})
    assert t.lookup(socket.inet_pton(socket.AF_INET6, "fd00:10:244:2::5")) == "192.168.50.2"
    assert t.lookup("fd00:10:244:2:8000::1") == "192.168.50.3"
    assert t.lookup("fd00:10:244:7::1") == "192.168.50.9"
    assert t.lookup("2001:db8::1") == "192.168.50.254"
    assert t.lookup("10.244.2.7") == "192.168.50.2" and t.lookup("10.244.3.7") is None  # ::/0 is not IPv4's
    assert NextHopTable({"fd00:10:244:2::/64": "192.168.50.2"}).lookup("fd00:10:244:3::1") is None
    assert len(t) == 5 and t.routes["fd00:10:244:2::/64"] == "192.168.50.2"


@pytest.mark.parametrize("routes, msg", [
    ({"fd00:10:244:2::1/64": "192.168.50.2"}, "host bits"),
    ({"fd00:10:244:2::/64": "fd00::1"}, "bad next-hop address"),  # the underlay is IPv4
])
def test_ipv6_next_hops_go_through_ipv4_underlay_addresses(routes, msg):
    with pytest.raises(ValueError, match=msg):
        NextHopTable(routes)


# -- segmentation ---------------------------------------------------------------------------------


def test_tcpv6_segments_are_what_a_kernel_sender_sends():
    payload = bytes(range(256)) * 20  # 5120 bytes
    sp = super_packet6(payload, traffic_class=0xB8, flow_label=0xABCDE)
    segs = segment_tcp_packets(P.VirtioNetHdr(gso_type=TSO6, gso_size=1400), sp, ttl_decrement=True)
    assert [len(s) for s in segs] == [1472, 1472, 1472, 72 + 5120 - 3 * 1400]
    got = b""
    for i, s in enumerate(segs):
        ip, tcp, data = parse6(s)
        assert P.transport_checksum_ok(s)
        # Everything of the IPv6 header as it was, but the payload length and the hop limit.
        assert (ip.src, ip.dst, ip.next_header, ip.traffic_class, ip.flow_label) == (SRC6, DST6, 6, 0xB8, 0xABCDE)
        assert ip.hop_limit == 62 and ip.payload_length == len(s) - 40
        assert tcp.seq == 1000 + i * 1400 and tcp.ack == 777 and tcp.options == TS_OPTS
        assert tcp.flags == (P.TCP_ACK | P.TCP_PSH if i == 3 else P.TCP_ACK)
        got += data
    assert got == payload
    # CWR on the first only, FIN on the last only; odd lengths.
    segs = segment_tcp_packets(P.VirtioNetHdr(gso_type=TSO6, gso_size=101),
                               super_packet6(b"z" * 333, flags=P.TCP_ACK | P.TCP_CWR | P.TCP_FIN, opts=b""))
    assert [parse6(s)[1].flags for s in segs] == [P.TCP_ACK | P.TCP_CWR, P.TCP_ACK, P.TCP_ACK, P.TCP_ACK | P.TCP_FIN]
    assert all(P.transport_checksum_ok(s) for s in segs)


@settings(max_examples=60, deadline=None)
@given(
    payload=payloads(9000),
    mss=st.integers(min_value=64, max_value=1440),
    seq=st.integers(0, 0xFFFFFFFF),
    opts=st.sampled_from([b"", TS_OPTS, b"\x01\x01\x01\x01"]),
    flags=st.sampled_from([P.TCP_ACK, P.TCP_ACK | P.TCP_PSH, P.TCP_ACK | P.TCP_FIN | P.TCP_PSH]),
    traffic_class=st.integers(0, 255),
    flow_label=st.integers(0, 0xFFFFF),
)
def test_tcpv6_segments_verify_against_the_naive_checksum_and_coalesce_back(payload, mss, seq, opts, flags,
                                                                            traffic_class, flow_label):
    sp = super_packet6(payload, seq=seq, opts=opts, flags=flags, traffic_class=traffic_class, flow_label=flow_label)
    segs = segment_tcp_packets(P.VirtioNetHdr(gso_type=TSO6, gso_size=mss), sp)
    assert len(segs) == -(-len(payload) // mss)
    data = b""
    for i, s in enumerate(segs):
        _, seg = P.split_ipv6(s)
        assert P.checksum_naive(seg, P.pseudo_header_sum(s[8:24], s[24:40], 6, len(seg))) == 0
        ip, tcp, d = parse6(s)
        assert tcp.seq == (seq + i * mss) & 0xFFFFFFFF and s[:4] == sp[:4] and s[6:40] == sp[6:40]
        data += d
    assert data == payload

    # coalesce ∘ segment: the same bytes again, as few writes as GRO would make, each a TCPv6
    # super-packet whose completed checksum is valid.
    writes = coalesce_packets(segs)
    assert b"".join(parse6(pkt)[2] for _, pkt in writes) == payload
    for vnet, pkt in writes:
        if vnet.gso_type == TSO6:
            assert vnet.flags == P.VIRTIO_NET_HDR_F_NEEDS_CSUM and vnet.gso_size == min(mss, len(payload))
            assert (vnet.csum_start, vnet.csum_offset, vnet.hdr_len) == (40, 16, 60 + len(opts))
            assert pkt[:4] == sp[:4] and pkt[6:40] == sp[6:40] and (pkt[4] << 8 | pkt[5]) == len(pkt) - 40
            full = bytearray(pkt)
            complete_checksum(full, 0, len(full), vnet.csum_start, vnet.csum_offset)
            assert P.transport_checksum_ok(full)
        else:
            assert vnet == P.VirtioNetHdr() and P.transport_checksum_ok(pkt)
    if len(segs) <= 64 and not flags & P.TCP_FIN:  # a FIN segment is not merged (tcp_gro_receive)
        assert len(writes) == 1


def test_tcpv6_segmentation_refuses_hop_limit_one_and_what_is_not_tcp_next():
    out = bytearray(100000)
    with pytest.raises(ForwardError) as e:
        segment_tcp(memoryview(super_packet6(b"x" * 3000, hop_limit=1)), 1400, out, True)
    assert e.value.reason == "ttl_exceeded"
    assert segment_tcp(memoryview(super_packet6(b"x" * 3000, hop_limit=1)), 1400, out, False)[0] == 3
    hop_by_hop = bytearray(super_packet6(b"x" * 3000))
    hop_by_hop[6] = 0  # an extension header first: not what a TUN hands over with TSO
    for bad in (bytes(hop_by_hop), b"\x60" + bytes(70)):
        with pytest.raises(ForwardError) as e:
            segment_tcp(memoryview(bad), 1400, out)
        assert e.value.reason == "malformed"


def vector_segments(sp: bytes, mss: int, ttl_decrement=False, *, start=10, off=0):
    inbuf, out = bytearray(70000), bytearray(1 << 20)
    inbuf[start : start + len(sp)] = sp
    seg = TsoSegmenter(inbuf, out)
    got = seg.segment(start, len(sp), mss, off, ttl_decrement)
    return got, bytes(out[off : off + got[2]]), seg.vectorized


def scalar_segments(sp: bytes, mss: int, ttl_decrement=False):
    out = bytearray(1 << 20)
    got = segment_tcp(memoryview(sp), mss, out, ttl_decrement)
    return got, bytes(out[: got[2]])


@settings(max_examples=120, deadline=None)
@given(
    payload=st.one_of(st.binary(min_size=1, max_size=3000), payloads(65535 - 80)),
    mss=st.one_of(st.sampled_from([1400, 1408, 1428, 1000, 1001, 100]), st.integers(8, 1440)),
    seq=st.one_of(st.integers(0, 0xFFFFFFFF), st.integers(0xFFFFFFFF - 70000, 0xFFFFFFFF)),
    opts=st.sampled_from([b"", TS_OPTS, b"\x01\x01\x01\x01"]),
    flags=st.sampled_from([P.TCP_ACK, P.TCP_ACK | P.TCP_PSH, P.TCP_ACK | P.TCP_CWR | P.TCP_PSH | P.TCP_FIN]),
    hop_limit=st.integers(2, 255),
    ttl_decrement=st.booleans(),
    place=st.sampled_from([(10, 0), (0, 0), (3, 131072), (10, 77)]),
)
def test_vectorized_tcpv6_segmentation_equals_the_scalar_reference(payload, mss, seq, opts, flags, hop_limit,
                                                                   ttl_decrement, place):
    sp = super_packet6(payload, seq=seq, opts=opts, flags=flags, hop_limit=hop_limit)
    got, data, vectorized = vector_segments(sp, mss, ttl_decrement, start=place[0], off=place[1])
    assert (got, data) == scalar_segments(sp, mss, ttl_decrement)
    assert vectorized == (mss % 2 == 0 and len(payload) > mss and -(-len(payload) // mss) <= 1024)


def tun_frame(sp: bytes, mss: int) -> bytes:
    v6 = sp[0] >> 4 == 6
    ihl = 40 if v6 else 20
    hl = ihl + ((sp[ihl + 12] >> 4) << 2)
    vnet = P.VirtioNetHdr(flags=P.VIRTIO_NET_HDR_F_NEEDS_CSUM, gso_type=TSO6 if v6 else P.VIRTIO_NET_HDR_GSO_TCPV4,
                          hdr_len=hl, gso_size=mss, csum_start=ihl, csum_offset=16)
    return vnet.encode() + sp


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([4, 6, 6]), st.integers(1, 65000),
                          st.sampled_from([1400, 1400, 1420, 1000, 1399]), st.sampled_from([TS_OPTS, b""]),
                          st.integers(0, 0xFFFFFFFF)), min_size=1, max_size=12),
       st.booleans())
def test_block_mode_takes_tcpv6_and_mixed_families_like_the_reference(frames, ttl_decrement):
    """readv straight into segment slots: TCPv6 super-packets of the slots' geometry are
    segmented in place by the vectorized pass, a change of family (or MSS, or header length)
    is gathered and segmented from a copy and moves the slots to it; every byte the reference's."""
    inbuf, out = bytearray(70000), bytearray(3 << 20)
    seg = TsoSegmenter(inbuf, out, mtu=1472, blocks=4, block_area=2 << 20)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    try:
        pending = []

        def flush():
            if pending:
                results = seg.segment_blocks(len(pending), [n for _, n, _, _ in pending], ttl_decrement)
                for (jj, _n, sp, mss), (count, stride, total) in zip(pending, results):
                    want = scalar_segments(sp, mss, ttl_decrement)
                    assert (count, stride if count > 1 else total, total) == want[0]
                    assert bytes(out[jj * seg.block_bytes : jj * seg.block_bytes + total]) == want[1]
            pending.clear()

        for version, plen, mss, opts, seq in frames:
            payload = bytes([plen & 0xFF]) * plen
            sp = super_packet6(payload, seq=seq, opts=opts) if version == 6 else \
                P.tcp_packet(SRC, DST, P.TcpHeader(40000, 5201, seq, 777, P.TCP_ACK, 502, options=opts), payload)
            frame = tun_frame(sp, mss)
            a.send(frame)
            j = len(pending)
            n = seg.read(b.fileno(), j)
            assert n == len(frame)
            if seg.fits(j, n, mss):
                assert seg.geometry.version == version
                pending.append((j, n, sp, mss))
                if len(pending) == seg.blocks:
                    flush()
                continue
            flush()
            assert bytes(seg.gather(j, n)) == sp
            got = seg.segment(10, n - 10, mss, 0, ttl_decrement)
            want = scalar_segments(sp, mss, ttl_decrement)
            assert (got[0], got[2], bytes(out[: got[2]])) == (want[0][0], want[0][2], want[1])
        flush()
    finally:
        a.close()
        b.close()


# -- coalescing ------------------------------------------------------------------------------------


def test_coalescer_merges_tcpv6_only_where_gro_would():
    a = [seg6(1), seg6(1001), seg6(2001, flags=P.TCP_ACK | P.TCP_PSH)]
    writes = coalesce_packets(a)
    assert [(v.gso_type, v.hdr_len, v.csum_start, len(p)) for v, p in writes] == [(TSO6, 72, 40, 72 + 3000)]
    # ipv6_gro_receive: everything but the payload length must match (traffic class and hop
    # limit flush, flow label and addresses are another flow), and tcp_gro_receive's rules.
    no_next = bytearray(seg6(1001))
    no_next[6] = 60  # a destination options header: not TCP next
    cases = [
        [seg6(1), seg6(5001)],
        [seg6(1), seg6(1001, dport=5202)],
        [seg6(1), seg6(1001, flow_label=7)],
        [seg6(1), seg6(1001, traffic_class=4)],
        [seg6(1), seg6(1001, hop_limit=9)],
        [seg6(1), seg6(1001, dst="fd00:10:244:3::2")],
        [seg6(1), bytes(no_next)],
        [seg6(1, flags=P.TCP_SYN), seg6(1001)],
        [seg6(1, data=b"x" * 500), seg6(501)],
        [seg6(1, flags=P.TCP_ACK | P.TCP_PSH), seg6(1001)],
        [seg4(1), seg6(1001)],  # the same ports and sequence numbers in the other family
        [seg6(1), seg4(1001)],
    ]
    for packets in cases:
        writes = coalesce_packets(packets)
        assert len(writes) == 2, packets
        assert all(v == P.VirtioNetHdr() for v, _ in writes)
        assert [p for _, p in writes] == [bytes(p) for p in packets]


def test_coalescer_caps_a_tcpv6_super_packet_at_64k():
    packets = [seg6(1 + i * 1400, data=b"y" * 1400) for i in range(60)]
    writes = coalesce_packets(packets)
    assert len(writes) == 2 and all(len(p) <= 0xFFFF and v.gso_type == TSO6 for v, p in writes)
    assert b"".join(parse6(p)[2] for _, p in writes) == b"y" * 1400 * 60


@st.composite
def segment_streams6(draw):
    """Segments of TCPv6 flows with the events that end a run, and some IPv4 among them."""
    mss = draw(st.sampled_from([1000, 1400, 300]))
    n = draw(st.integers(1, 120))
    seq = draw(st.integers(0, 0xFFFFFFFF))
    events = draw(st.lists(st.sampled_from(["full"] * 30 + ["short", "psh", "gap", "flow", "fin", "hops", "label",
                                                           "v4", "icmp6", "corrupt"]), min_size=n, max_size=n))
    packets = []
    for ev in events:
        if ev == "icmp6":
            packets.append(P.ipv6_packet(P.IPv6Header(src=SRC6, dst=DST6, next_header=58), bytes(64)))
            continue
        ln = mss if ev != "short" else draw(st.integers(1, mss - 1))
        kw = {}
        flags = P.TCP_ACK | (P.TCP_PSH if ev == "psh" else 0) | (P.TCP_FIN if ev == "fin" else 0)
        if ev == "flow":
            kw["dport"] = 5202
        if ev == "hops":
            kw["hop_limit"] = 9
        if ev == "label":
            kw["flow_label"] = 99
        if ev == "gap":
            seq = (seq + 1) & 0xFFFFFFFF
        make = seg4 if ev == "v4" else seg6
        packets.append(make(seq, data=bytes([len(packets) & 0xFF]) * ln, flags=flags, **kw))
        if ev == "corrupt":  # a payload byte changed in flight: the TCP checksum fails
            packets[-1] = packets[-1][:-1] + bytes([packets[-1][-1] ^ 0x20])
        seq = (seq + ln) & 0xFFFFFFFF
    chunks = draw(st.lists(st.integers(1, 70), min_size=1, max_size=10))
    return packets, chunks


@settings(max_examples=120, deadline=None)
@given(segment_streams6())
def test_tcpv6_batches_coalesce_exactly_like_packet_by_packet(stream):
    packets, chunks = stream
    want = coalesce_packets(packets)
    got, _ = batch_writes(packets, chunks)
    assert got == want
    def tcp(p: bytes) -> bool:
        return (p[6] if p[0] >> 4 == 6 else p[9]) == P.IPPROTO_TCP

    assert b"".join(payload_of(p) for _, p in got if tcp(p)) == b"".join(payload_of(p) for p in packets if tcp(p))


def test_a_udp_gro_read_of_tcpv6_segments_is_merged_in_one_go():
    """A UDP GRO read: equal-sized datagrams back to back (the last shorter), each one inner
    TCPv6 segment: checked with a few numpy calls and written as one super-packet."""
    packets = [seg6(1 + i * 1400, data=b"q" * 1400) for i in range(20)] + [seg6(28001, data=b"r" * 600)]
    blob = b"".join(packets)
    writes = []
    c = Coalescer(lambda parts: writes.append(b"".join(bytes(p) for p in parts)))
    assert c.add_segments(np.frombuffer(blob + bytes(2048), np.uint8), 0, len(packets[0]), len(blob))
    c.flush()
    assert c.batches == 1 and len(writes) == 1
    vnet, pkt = P.VirtioNetHdr.decode(writes[0]), writes[0][10:]
    assert (vnet.gso_type, vnet.gso_size, len(pkt)) == (TSO6, 1400, 72 + 28600)
    assert writes[0][10:] == coalesce_packets(packets)[0][1]
    # A payload length that lies: refused whole, nothing taken (the caller counts per packet).
    bad = bytearray(blob)
    bad[len(packets[0]) * 3 + 5] ^= 1
    c = Coalescer(lambda parts: pytest.fail("nothing may be written"))
    assert not c.add_segments(np.frombuffer(bytes(bad) + bytes(2048), np.uint8), 0, len(packets[0]), len(bad))


def test_inner_packets_are_one_packet_of_either_family():
    assert inner_packet_ok(seg6(1), len(seg6(1))) and inner_packet_ok(seg4(1), len(seg4(1)))
    two = seg6(1) + seg6(1001)
    assert not inner_packet_ok(two, len(two))
    short = bytearray(seg6(1))
    short[5] += 1  # payload length one more than what is there
    assert not inner_packet_ok(short, len(short))
    assert not inner_packet_ok(b"\x60" + bytes(30), 31) and not inner_packet_ok(b"\x50" + bytes(59), 60)


def test_completing_an_ipv6_udp_checksum_never_writes_zero():
    udp = bytearray(struct.pack("!HHHH", 1, 2, 8 + 3, 0) + b"abc")
    pkt = bytearray(P.ipv6_packet(P.IPv6Header(src=SRC6, dst=DST6, next_header=17), bytes(udp)))
    ps = P.pseudo_header_sum(bytes(pkt[8:24]), bytes(pkt[24:40]), 17, len(pkt) - 40)
    struct.pack_into("!H", pkt, 46, P.fold(ps))
    complete_checksum(pkt, 0, len(pkt), 40, 6)
    assert P.transport_checksum_ok(pkt) and pkt[46:48] != b"\0\0"
    with pytest.raises(ForwardError):  # an IPv6 transport header starts after the 40-byte header
        complete_checksum(pkt, 0, len(pkt), 20, 6)
