"""Pure forwarding logic of the user-space data plane: next hops, members, TSO segmentation
(the scalar reference and the vectorized segmenter, byte for byte), GRO-style coalescing (per
packet and whole batches, packet for packet the same writes; the C receive side too, its TUN
writes going to a SOCK_SEQPACKET socket), checksum completion."""

import contextlib
import socket
import struct

import numpy as np
import pytest
from coalescer_feed import batch_writes
from hypothesis import given, settings
from hypothesis import strategies as st

from agentd.dataplane import _fast
from agentd.dataplane._forward import (
    ForwardError,
    NextHopTable,
    complete_checksum,
    parse_members,
    segment_tcp,
    segment_tcp_packets,
)
from agentd.dataplane._gro import Coalescer, coalesce_packets
from agentd.dataplane._tso import TsoSegmenter
from proto import packet as P

SRC, DST = "10.244.1.2", "10.244.2.2"
TS_OPTS = b"\x01\x01\x08\x0a" + bytes(range(8))


def super_packet(payload: bytes, *, seq=1000, flags=P.TCP_ACK | P.TCP_PSH, opts=TS_OPTS, ttl=63, ident=100,
                 partial=True):
    """A TSO super-packet as a TUN with TUN_F_TSO4 hands it over: one big IPv4/TCP packet whose
    TCP checksum field holds only the pseudo-header sum (CHECKSUM_PARTIAL)."""
    pkt = bytearray(P.tcp_packet(SRC, DST, P.TcpHeader(40000, 5201, seq, 777, flags, 502, options=opts),
                                 payload, ttl=ttl, identification=ident))
    if partial:
        tcp_len = len(pkt) - 20
        ps = P.pseudo_header_sum(bytes(pkt[12:16]), bytes(pkt[16:20]), 6, tcp_len)
        struct.pack_into("!H", pkt, 36, P.fold(ps))
    return bytes(pkt)


def parse(pkt):
    ip, seg = P.split_ipv4(pkt)
    return ip, P.TcpHeader.decode(seg), bytes(seg[P.TcpHeader.decode(seg).header_length:])


# -- next hops and members ------------------------------------------------------------------------


def test_next_hop_longest_prefix_match():
    t = NextHopTable({"10.244.0.0/16": "192.168.50.9", "10.244.2.0/24": "192.168.50.2",
                      "10.244.2.128/25": "192.168.50.3", "0.0.0.0/0": "192.168.50.254"})
    assert t.lookup(bytes([10, 244, 2, 5])) == "192.168.50.2"
    assert t.lookup("10.244.2.200") == "192.168.50.3"
    assert t.lookup("10.244.7.1") == "192.168.50.9"
    assert t.lookup("8.8.8.8") == "192.168.50.254"
    assert NextHopTable({"10.244.2.0/24": "192.168.50.2"}).lookup("10.244.3.1") is None
    assert len(t) == 4 and t.routes["10.244.2.0/24"] == "192.168.50.2"


@pytest.mark.parametrize("routes, msg", [
    ({"10.244.2.1/24": "192.168.50.2"}, "host bits"),
    ({"nonsense": "192.168.50.2"}, "bad next-hop prefix"),
    ({"10.244.2.0/24": "fe80::1"}, "bad next-hop address"),
])
def test_next_hop_table_rejects_bad_entries(routes, msg):
    with pytest.raises(ValueError, match=msg):
        NextHopTable(routes)


def test_members():
    assert parse_members(["192.168.50.2", "192.168.50.2", "192.168.50.3"]) == {"192.168.50.2", "192.168.50.3"}
    with pytest.raises(ValueError, match="bad member"):
        parse_members(["192.168.50.300"])
    with pytest.raises(ValueError, match="not a single string"):
        parse_members("192.168.50.2")


# -- segmentation ---------------------------------------------------------------------------------


def test_segment_rebuilds_what_a_kernel_sender_would_send():
    payload = bytes(range(256)) * 20  # 5120 bytes
    segs = segment_tcp_packets(P.VirtioNetHdr(gso_type=1, gso_size=1448), super_packet(payload), ttl_decrement=True)
    assert [len(s) for s in segs] == [1500, 1500, 1500, 20 + 32 + 5120 - 3 * 1448]
    got = b""
    for i, s in enumerate(segs):
        ip, tcp, data = parse(s)
        assert P.ipv4_header_checksum_ok(s) and P.transport_checksum_ok(s)
        assert ip.ttl == 62 and ip.identification == 100 + i and ip.df
        assert tcp.seq == 1000 + i * 1448 and tcp.ack == 777 and tcp.options == TS_OPTS
        assert tcp.flags == (P.TCP_ACK | P.TCP_PSH if i == 3 else P.TCP_ACK)
        got += data
    assert got == payload


def test_segment_cwr_first_fin_last_and_odd_lengths():
    segs = segment_tcp_packets(P.VirtioNetHdr(gso_type=1, gso_size=101),
                                super_packet(b"z" * 333, flags=P.TCP_ACK | P.TCP_CWR | P.TCP_FIN, opts=b""))
    flags = [parse(s)[1].flags for s in segs]
    assert flags == [P.TCP_ACK | P.TCP_CWR, P.TCP_ACK, P.TCP_ACK, P.TCP_ACK | P.TCP_FIN]
    assert all(P.transport_checksum_ok(s) for s in segs)


@settings(max_examples=60, deadline=None)
@given(
    payload=st.binary(min_size=1, max_size=9000),
    mss=st.integers(min_value=64, max_value=1460),
    seq=st.integers(0, 0xFFFFFFFF),
    ident=st.integers(0, 0xFFFF),
    opts=st.sampled_from([b"", TS_OPTS, b"\x01\x01\x01\x01"]),
    flags=st.sampled_from([P.TCP_ACK, P.TCP_ACK | P.TCP_PSH, P.TCP_ACK | P.TCP_FIN | P.TCP_PSH]),
)
def test_segments_verify_against_the_naive_checksum_and_coalesce_back(payload, mss, seq, ident, opts, flags):
    sp = super_packet(payload, seq=seq, ident=ident, opts=opts, flags=flags)
    segs = segment_tcp_packets(P.VirtioNetHdr(gso_type=1, gso_size=mss), sp)
    assert len(segs) == -(-len(payload) // mss)
    data = b""
    for i, s in enumerate(segs):
        _, seg = P.split_ipv4(s)
        assert P.checksum_naive(s[:20]) == 0
        assert P.checksum_naive(seg, P.pseudo_header_sum(s[12:16], s[16:20], 6, len(seg))) == 0
        ip, tcp, d = parse(s)
        assert tcp.seq == (seq + i * mss) & 0xFFFFFFFF and ip.identification == (ident + i) & 0xFFFF
        data += d
    assert data == payload

    # coalesce ∘ segment: the same bytes again, as few writes as GRO would make.
    writes = coalesce_packets(segs)
    rebuilt = b"".join(parse(pkt)[2] for _, pkt in writes)
    assert rebuilt == payload
    for vnet, pkt in writes:
        if vnet.gso_type == P.VIRTIO_NET_HDR_GSO_TCPV4:
            assert vnet.flags == P.VIRTIO_NET_HDR_F_NEEDS_CSUM and vnet.gso_size == min(mss, len(payload))
            assert (vnet.csum_start, vnet.csum_offset, vnet.hdr_len) == (20, 16, 40 + len(opts))
            assert P.ipv4_header_checksum_ok(pkt)
            # Completing the partial checksum must give a valid packet (what the kernel would do).
            full = bytearray(pkt)
            complete_checksum(full, 0, len(full), vnet.csum_start, vnet.csum_offset)
            assert P.transport_checksum_ok(full)
        else:
            assert vnet == P.VirtioNetHdr() and P.transport_checksum_ok(pkt)
    if len(segs) <= 64:
        assert len(writes) == 1


def test_segment_refuses_ttl_one_and_garbage():
    out = bytearray(100000)
    with pytest.raises(ForwardError) as e:
        segment_tcp(memoryview(super_packet(b"x" * 3000, ttl=1)), 1448, out, True)
    assert e.value.reason == "ttl_exceeded"
    with pytest.raises(ForwardError) as e:
        segment_tcp(memoryview(P.udp_datagram(SRC, DST, 1, 2, b"x" * 100)), 1448, out)
    assert e.value.reason == "malformed"
    with pytest.raises(ForwardError):
        segment_tcp(memoryview(b"\x45" + bytes(50)), 1448, out)


def vector_segments(sp: bytes, mss: int, ttl_decrement=False, *, start=10, off=0):
    inbuf, out = bytearray(70000), bytearray(1 << 20)
    inbuf[start : start + len(sp)] = sp
    seg = TsoSegmenter(inbuf, out)
    count, seglen, total = seg.segment(start, len(sp), mss, off, ttl_decrement)
    return (count, seglen, total), bytes(out[off : off + total]), seg.vectorized


def scalar_segments(sp: bytes, mss: int, ttl_decrement=False):
    out = bytearray(1 << 20)
    count, seglen, total = segment_tcp(memoryview(sp), mss, out, ttl_decrement)
    return (count, seglen, total), bytes(out[:total])


@settings(max_examples=150, deadline=None)
@given(
    payload=st.binary(min_size=1, max_size=66000 - 60),
    mss=st.one_of(st.sampled_from([1420, 1428, 1448, 536, 1000, 1002, 1001, 100]), st.integers(8, 1460)),
    seq=st.one_of(st.integers(0, 0xFFFFFFFF), st.integers(0xFFFFFFFF - 70000, 0xFFFFFFFF)),
    ident=st.one_of(st.integers(0, 0xFFFF), st.integers(0xFFC0, 0xFFFF)),
    opts=st.sampled_from([b"", TS_OPTS, b"\x01\x01\x01\x01"]),
    flags=st.sampled_from([P.TCP_ACK, P.TCP_ACK | P.TCP_PSH, P.TCP_ACK | P.TCP_FIN | P.TCP_PSH,
                           P.TCP_ACK | P.TCP_CWR, P.TCP_ACK | P.TCP_CWR | P.TCP_PSH | P.TCP_FIN]),
    ttl=st.integers(2, 255),
    ttl_decrement=st.booleans(),
    place=st.sampled_from([(10, 0), (0, 0), (3, 131072), (10, 77)]),
)
def test_vectorized_segmentation_equals_the_scalar_reference(payload, mss, seq, ident, opts, flags, ttl,
                                                             ttl_decrement, place):
    """The numpy segmenter writes exactly the bytes segment_tcp writes (which the tests above
    check against the naive RFC 1071 checksum), for any MSS, wrap of ID and sequence number,
    flags, options and buffer offsets; what it cannot view it hands to the reference."""
    sp = super_packet(payload, seq=seq, ident=ident, opts=opts, flags=flags, ttl=ttl)
    got, data, vectorized = vector_segments(sp, mss, ttl_decrement, start=place[0], off=place[1])
    assert (got, data) == scalar_segments(sp, mss, ttl_decrement)
    hl = 40 + len(opts)
    assert vectorized == (mss % 2 == 0 and len(payload) > mss and -(-len(payload) // mss) <= 1024)
    if vectorized:  # spot-check one segment against the naive checksum as well
        s = data[: got[1]]  # the first segment, always a full one here
        tcp_len = len(s) - 20
        assert P.checksum_naive(s[:20]) == 0 and len(s) == hl + mss
        assert P.checksum_naive(s[20:], P.pseudo_header_sum(s[12:16], s[16:20], 6, tcp_len)) == 0


def test_vectorized_segmentation_typical_super_packet():
    payload = bytes(range(256)) * 254  # 65024 bytes: 46 segments of 1420 (the UDP path's MSS)
    sp = super_packet(payload, seq=0xFFFFF000, ident=0xFFF0, flags=P.TCP_ACK | P.TCP_PSH)
    (count, seglen, total), data, vectorized = vector_segments(sp, 1420, True)
    assert vectorized == 1 and count == 46 and seglen == 1472
    segs = [data[i : i + seglen] for i in range(0, total, seglen)]
    assert len(segs) == 46 and len(segs[-1]) == 52 + 65024 - 45 * 1420
    for i, s in enumerate(segs):
        ip, tcp, _ = parse(s)
        assert P.ipv4_header_checksum_ok(s) and P.transport_checksum_ok(s)
        assert ip.ttl == 62 and ip.identification == (0xFFF0 + i) & 0xFFFF
        assert tcp.seq == (0xFFFFF000 + i * 1420) & 0xFFFFFFFF
        assert tcp.flags == (P.TCP_ACK | P.TCP_PSH if i == 45 else P.TCP_ACK)


def test_vectorized_segmentation_refuses_what_the_reference_refuses():
    inbuf, out = bytearray(70000), bytearray(1 << 20)
    seg = TsoSegmenter(inbuf, out)
    sp = super_packet(b"x" * 3000, ttl=1)
    inbuf[10 : 10 + len(sp)] = sp
    with pytest.raises(ForwardError) as e:
        seg.segment(10, len(sp), 1448, 0, True)
    assert e.value.reason == "ttl_exceeded"
    udp = P.udp_datagram(SRC, DST, 1, 2, b"x" * 3000)
    inbuf[10 : 10 + len(udp)] = udp
    with pytest.raises(ForwardError) as e:
        seg.segment(10, len(udp), 1448, 0)
    assert e.value.reason == "malformed"
    with pytest.raises(ForwardError) as e:  # does not fit behind the given offset
        seg.segment(10, len(sp), 1448, len(out) - 1000)
    assert e.value.reason == "malformed"


def tun_frame(payload: bytes, mss: int, **kw) -> bytes:
    """What a TUN with IFF_VNET_HDR and TSO hands over: virtio-net header + super-packet."""
    sp = super_packet(payload, **kw)
    hl = 40 + len(kw.get("opts", TS_OPTS))
    vnet = P.VirtioNetHdr(flags=P.VIRTIO_NET_HDR_F_NEEDS_CSUM, gso_type=P.VIRTIO_NET_HDR_GSO_TCPV4,
                          hdr_len=hl, gso_size=mss, csum_start=20, csum_offset=16)
    return vnet.encode() + sp


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 65000), st.sampled_from([1420, 1420, 1420, 1000, 1432, 536, 1419]),
                          st.sampled_from([TS_OPTS, TS_OPTS, b""]), st.integers(0, 0xFFFFFFFF),
                          st.sampled_from([P.TCP_ACK, P.TCP_ACK | P.TCP_PSH, P.TCP_ACK | P.TCP_CWR | P.TCP_FIN])),
                min_size=1, max_size=12),
       st.booleans())
def test_block_mode_reads_into_segment_slots_and_segments_like_the_reference(frames, ttl_decrement):
    """The worker's fast path: readv (over an AF_UNIX seqpacket pair, like a TUN one packet
    per read) straight into a block of segment slots; blocks that fit the expected geometry are
    segmented in place, in one vectorized pass; the others are gathered and segmented from a
    copy (and the layout follows them).  Every byte must equal the scalar reference's."""
    import socket

    inbuf, out = bytearray(70000), bytearray(3 << 20)
    seg = TsoSegmenter(inbuf, out, mtu=1472, blocks=4, block_area=2 << 20)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    try:
        pending, j = [], 0

        def flush():
            nonlocal pending
            if pending:
                results = seg.segment_blocks(len(pending), [n for _, n, _ in pending], ttl_decrement)
                for (jj, _n, sp), (count, stride, total) in zip(pending, results):
                    want = scalar_segments(sp, sp_mss[jj], ttl_decrement)
                    assert (count, stride if count > 1 else total, total) == want[0]
                    assert bytes(out[jj * seg.block_bytes : jj * seg.block_bytes + total]) == want[1]
            pending = []

        sp_mss = {}
        for plen, mss, opts, seq, flags in frames:
            frame = tun_frame(bytes([plen & 0xFF]) * plen, mss, opts=opts, seq=seq, flags=flags)
            a.send(frame)
            n = seg.read(b.fileno(), j)
            assert n == len(frame)
            if seg.fits(j, n, mss):
                pending.append((j, n, frame[10:]))
                sp_mss[j] = mss
                j += 1
                if j == seg.blocks:
                    flush()
                    j = 0
                continue
            flush()
            assert bytes(seg.gather(j, n)) == frame[10:]
            j = 0
            got = seg.segment(10, n - 10, mss, 0, ttl_decrement)
            want = scalar_segments(frame[10:], mss, ttl_decrement)
            assert (got[0], got[2], bytes(out[: got[2]])) == (want[0][0], want[0][2], want[1])
        flush()
        with pytest.raises(BlockingIOError):
            b.setblocking(False)
            seg.read(b.fileno(), 0)
    finally:
        a.close()
        b.close()


def test_block_layout_keeps_small_packets_contiguous_and_follows_the_flow():
    inbuf, out = bytearray(70000), bytearray(3 << 20)
    seg = TsoSegmenter(inbuf, out, mtu=1472, blocks=2, block_area=2 << 20)
    assert seg.geometry.hl == 52 and seg.geometry.stride == 1472
    ack = P.VNET_HDR_NONE + seg_packet_ack()
    views = seg.read_iovecs(1)
    views[0][:10], views[1][: len(ack) - 10] = ack[:10], ack[10:]
    assert bytes(seg.packet(1, len(ack))) == ack[10:]  # a plain packet lies whole in the first row
    # A flow without timestamps (40-byte headers, MSS 1432): gathered once, then expected.
    frame = tun_frame(b"q" * 20000, 1432, opts=b"")
    pos = 0
    for v in seg.read_iovecs(0):
        take = min(len(v), len(frame) - pos)
        v[:take] = frame[pos : pos + take]
        pos += take
    assert not seg.fits(0, len(frame), 1432)
    assert bytes(seg.gather(0, len(frame))) == frame[10:]
    assert (seg.geometry.hl, seg.geometry.gso, seg.gathered) == (40, 1432, 1)


def seg_packet_ack():
    return P.tcp_packet(SRC, DST, P.TcpHeader(40000, 5201, 1, 2, P.TCP_ACK, 502, options=TS_OPTS))


# -- coalescing ------------------------------------------------------------------------------------


def seg(seq, data=b"x" * 1000, **kw):
    return P.tcp_packet(kw.pop("src", SRC), DST, P.TcpHeader(40000, kw.pop("dport", 5201), seq, 777,
                        kw.pop("flags", P.TCP_ACK), 502, options=kw.pop("opts", TS_OPTS)), data, **kw)


def test_coalescer_merges_only_what_gro_would():
    a = [seg(1), seg(1001), seg(2001, flags=P.TCP_ACK | P.TCP_PSH)]
    assert [v.gso_type for v, _ in coalesce_packets(a)] == [1]
    # A gap in sequence numbers, another flow, another option value, a SYN, UDP: separate writes.
    cases = [
        [seg(1), seg(5001)],
        [seg(1), seg(1001, dport=5202)],
        [seg(1), seg(1001, opts=b"\x01\x01\x08\x0a" + bytes(8))],
        [seg(1, flags=P.TCP_SYN), seg(1001)],
        [P.udp_datagram(SRC, DST, 1, 2, b"x" * 100), seg(1)],
        [seg(1, data=b"x" * 500), seg(501)],  # a short segment ends a run
        [seg(1, flags=P.TCP_ACK | P.TCP_PSH), seg(1001)],  # PSH ends a run
        [seg(1, ttl=5), seg(1001, ttl=6)],
    ]
    for packets in cases:
        writes = coalesce_packets(packets)
        assert len(writes) == 2, packets
        assert all(v == P.VirtioNetHdr() for v, _ in writes)
        assert [p for _, p in writes] == [bytes(p) for p in packets]


def test_coalescer_caps_the_super_packet_at_64k_and_max_segments():
    packets = [seg(1 + i * 1400, data=b"y" * 1400) for i in range(60)]
    writes = coalesce_packets(packets)
    assert all(len(p) <= 0xFFFF for _, p in writes) and len(writes) == 2
    writes = coalesce_packets(packets[:10], max_segments=4)
    assert [len(p) for _, p in writes] == [52 + 4 * 1400, 52 + 4 * 1400, 52 + 2 * 1400]


def test_coalescer_counts():
    writes = []
    c = Coalescer(writes.append)
    for p in [seg(1), seg(1001), seg(2001)]:
        c.add(memoryview(p))
    c.flush()
    assert (c.merged, c.written, len(writes)) == (3, 1, 1)


def test_complete_checksum_for_udp_never_writes_zero():
    pkt = bytearray(P.udp_datagram(SRC, DST, 1, 2, b"abc"))
    ps = P.pseudo_header_sum(bytes(pkt[12:16]), bytes(pkt[16:20]), 17, len(pkt) - 20)
    struct.pack_into("!H", pkt, 26, P.fold(ps))
    complete_checksum(pkt, 0, len(pkt), 20, 6)
    assert P.transport_checksum_ok(pkt)
    with pytest.raises(ForwardError):
        complete_checksum(pkt, 0, len(pkt), 20, 600)


# -- batches: the vectorized path makes exactly the writes the per-packet path makes -----------------


@st.composite
def segment_streams(draw):
    mss = draw(st.sampled_from([1000, 1420, 300]))
    n = draw(st.integers(1, 120))
    seq = draw(st.integers(0, 0xFFFFFFFF))
    events = draw(st.lists(st.sampled_from(["full"] * 30 + ["short", "psh", "gap", "flow", "fin", "ttl", "icmp",
                                                              "corrupt"]),
                           min_size=n, max_size=n))
    packets = []
    for ev in events:
        if ev == "icmp":
            packets.append(P.ipv4_packet(P.IPv4Header(src=SRC, dst=DST, protocol=P.IPPROTO_ICMP),
                                         P.icmp_message(8, 0, 1, bytes(64))))
            continue
        ln = mss if ev != "short" else draw(st.integers(1, mss - 1))
        kw = {}
        flags = P.TCP_ACK | (P.TCP_PSH if ev == "psh" else 0) | (P.TCP_FIN if ev == "fin" else 0)
        if ev == "flow":
            kw["dport"] = 5202
        if ev == "ttl":
            kw["ttl"] = 9
        if ev == "gap":
            seq = (seq + 1) & 0xFFFFFFFF
        packets.append(seg(seq, data=bytes([len(packets) & 0xFF]) * ln, flags=flags, **kw))
        if ev == "corrupt":  # a payload byte changed in flight: the TCP checksum fails
            packets[-1] = packets[-1][:-1] + bytes([packets[-1][-1] ^ 0x20])
        seq = (seq + ln) & 0xFFFFFFFF
    chunks = draw(st.lists(st.integers(1, 70), min_size=1, max_size=10))
    return packets, chunks


def test_a_batch_with_non_tcp_packets_of_full_size_merges_only_the_tcp_runs():
    """Two full-sized ICMP packets between two runs, crafted so that read as TCP they would
    follow on (byte 33 says ACK, bytes 24-27 advance by the payload length): they must go out
    on their own, unchanged."""
    def echo(rest: int) -> bytes:
        body = bytearray(P.icmp_message(8, 0, rest, bytes(1024)))
        body[2:4] = b"\x12\x34"  # the same checksum bytes in both (TCP's port bytes 22-23)
        body[13] = P.TCP_ACK      # packet byte 33
        return P.ipv4_packet(P.IPv4Header(src=SRC, dst=DST, protocol=P.IPPROTO_ICMP), bytes(body))

    icmp = [echo(5000), echo(6000)]
    assert len(icmp[0]) == len(seg(1)) and icmp[0][33] == P.TCP_ACK
    packets = [seg(1 + i * 1000) for i in range(8)] + icmp + [seg(8001 + i * 1000) for i in range(8)]
    got, batches = batch_writes(packets, [len(packets)])
    assert batches == 1 and got == coalesce_packets(packets)
    assert [(v.gso_type, len(p)) for v, p in got] == [(1, 52 + 8000), (0, 1052), (0, 1052), (1, 52 + 8000)]
    assert [got[1][1], got[2][1]] == icmp


@settings(max_examples=120, deadline=None)
@given(segment_streams())
def test_batches_coalesce_exactly_like_packet_by_packet(stream):
    packets, chunks = stream
    want = coalesce_packets(packets)
    got, _ = batch_writes(packets, chunks)
    assert got == want
    tcp = P.IPPROTO_TCP
    assert b"".join(parse(p)[2] for _, p in got if p[9] == tcp) == b"".join(parse(p)[2] for p in packets if p[9] == tcp)


def test_a_clean_batch_goes_through_numpy_and_runs_continue_across_batches():
    packets = [seg(1 + i * 1000) for i in range(50)] + [seg(50001, flags=P.TCP_ACK | P.TCP_PSH)]
    got, batches = batch_writes(packets, [30, 21])
    assert batches == 2  # both whole; the run goes on across them and PSH ends it
    assert [(v.gso_type, v.gso_size, len(p)) for v, p in got] == [(1, 1000, 52 + 51 * 1000)]
    got, batches = batch_writes(packets, [20, 20, 11])
    assert batches == 3 and len(got) == 1 and got == coalesce_packets(packets)


def test_add_batch_refuses_malformed_batches_without_taking_anything():
    good = [seg(1 + i * 1000) for i in range(10)]
    bad = bytearray(good[4])
    bad[3] ^= 1  # IP total length no longer the packet length: malformed, counted per packet
    for packets in ([*good[:4], bytes(bad), *good[5:]], good[:4]):  # malformed; too few for numpy
        c = Coalescer(lambda parts: pytest.fail("nothing may be written"))
        buf = bytearray(2048 * len(packets))
        for j, p in enumerate(packets):
            buf[j * 2048 : j * 2048 + len(p)] = p
        assert not c.add_batch(np.frombuffer(buf, np.uint8), 0, 2048, np.array([len(p) for p in packets]))
        assert c.merged == c.written == c.batches == 0


def _ipv4(first: int, size: int, ident: int = 0, total: int | None = None) -> bytes:
    """A non-TCP IPv4 packet of ``size`` bytes whose first byte (version, IHL) is ``first``."""
    p = bytearray(size)
    p[0], p[8], p[9] = first, 64, P.IPPROTO_ICMP
    p[2:4] = (size if total is None else total).to_bytes(2, "big")
    p[4:6] = ident.to_bytes(2, "big")
    return bytes(p)


def _seg6(seq: int, data: bytes = b"x" * 1000) -> bytes:
    return bytes(P.tcp6_packet("fd00:10:244:1::2", "fd00:10:244:2::2",
                               P.TcpHeader(40000, 5201, seq, 777, P.TCP_ACK, 502, options=TS_OPTS), data))


@pytest.mark.parametrize("how", ["batch", "gro"])
@pytest.mark.parametrize("odd", ["ihl below 5", "header longer than the packet", "ipv4 length unchecked in ipv6"])
def test_the_batch_paths_check_each_packets_header_themselves(how, odd):
    """add_batch and add_segments took a packet whose IPv4 IHL is below 5 or says more header
    than the packet has (and so wrote it to the TUN): their callers checked the first bytes
    before, a new caller would not.  An IPv4 packet in an IPv6 batch had its own total length
    checked by nothing (the batch's check reads IPv6's payload length there).  Each is refused
    whole: the caller checks and counts packet by packet."""
    v6 = odd == "ipv4 length unchecked in ipv6"
    packets = [_seg6(1 + i * 1000) if v6 else bytes(seg(1 + i * 1000)) for i in range(10)]
    size = len(packets[0])
    if odd == "ihl below 5":
        packets[4] = b"\x44" + packets[4][1:]
    elif odd == "header longer than the packet":  # 56 bytes, IHL 15 (60): after the TCP headers (52)
        packets[-1] = _ipv4(0x4F, 56)
    else:  # IPv6's payload length where IPv4 has its ID: the batch's check passes, the total length lies
        packets[4] = _ipv4(0x45, size, ident=size - 40, total=size - 1)
    c = Coalescer(lambda parts: pytest.fail("nothing may be written"))
    if how == "batch":
        buf = bytearray(2048 * len(packets))
        for j, p in enumerate(packets):
            buf[j * 2048 : j * 2048 + len(p)] = p
        assert not c.add_batch(np.frombuffer(buf, np.uint8), 0, 2048, np.array([len(p) for p in packets]))
    else:
        blob = b"".join(packets)
        assert not c.add_segments(np.frombuffer(blob + bytes(2048), np.uint8), 0, size, len(blob))
    assert c.merged == c.written == c.batches == 0


def test_the_batch_paths_still_take_ipv4_options_and_other_packets_of_the_family():
    """A row with IPv4 options (IHL 6, within the packet) or a ping among the segments is a packet:
    the batch is taken, the row written on its own."""
    packets = [bytes(seg(1 + i * 1000)) for i in range(10)]
    opts = bytearray(packets[3])
    opts[0] = 0x46  # 4 bytes of the TCP header read as options: no TCP to merge, a packet still
    packets[3] = bytes(opts)
    packets[7] = _ipv4(0x45, 100)
    want = coalesce_packets(packets)
    for how in ("batch", "gro"):
        writes: list = []

        def write(parts, writes=writes):
            blob = b"".join(map(bytes, parts))
            writes.append((P.VirtioNetHdr.decode(blob), blob[10:]))

        c = Coalescer(write)
        if how == "batch":
            buf = bytearray(2048 * len(packets))
            for j, p in enumerate(packets):
                buf[j * 2048 : j * 2048 + len(p)] = p
            assert c.add_batch(np.frombuffer(buf, np.uint8), 0, 2048, np.array([len(p) for p in packets]))
        else:
            same = packets[:7]  # a GRO read: equal-sized datagrams
            blob = b"".join(same)
            assert c.add_segments(np.frombuffer(blob + bytes(2048), np.uint8), 0, len(same[0]), len(blob))
            want = coalesce_packets(same)
        c.flush()
        assert writes == want and c.batches == 1, how


def test_a_batch_spanning_super_packets_is_cut_where_gro_would_cut_it():
    """A recvmmsg batch holds segments of several TSO super-packets: the timestamp option
    changes between them (so GRO cuts there), other flows and gaps come in between."""
    ts = [b"\x01\x01\x08\x0a" + struct.pack("!II", t, 7) for t in (100, 101, 102)]
    packets = [seg(1 + i * 1000, opts=ts[i // 20]) for i in range(60)]
    packets.insert(30, seg(5, dport=5202))          # another flow in between
    packets[45:46] = []                             # a lost segment: a gap
    got, batches = batch_writes(packets, [len(packets)])
    assert batches == 1 and got == coalesce_packets(packets)
    assert [len(p) for _, p in got] == [52 + n * 1000 for n in (20, 10, 1, 10, 4, 15)]


# -- the worker's command line ------------------------------------------------------------------

_WORKER_ARGS = ["udp", "--mtu", "1450", "--local-ip", "192.0.2.1", "--control", "/run/agentd/dp.sock"]


def _worker_args(**changes: str) -> list[str]:
    args = list(_WORKER_ARGS)
    for option, value in changes.items():
        flag = "--" + option.replace("_", "-")
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


def test_worker_args_accept_a_sane_command_line():
    from agentd.dataplane.worker import parse_args

    cfg = parse_args(_worker_args(icmp_source="10.244.3.1", orphan_timeout="0"))
    assert (cfg.local_ip, cfg.icmp_source, cfg.control, cfg.orphan_timeout) == (
        "192.0.2.1", "10.244.3.1", "/run/agentd/dp.sock", 0.0)
    assert parse_args(_worker_args(orphan_timeout="2.5")).orphan_timeout == 2.5


@pytest.mark.parametrize(
    ("changes", "word"),
    [
        ({"local_ip": "0.0.0.0"}, "--local-ip"),
        ({"local_ip": "255.255.255.255"}, "--local-ip"),
        ({"local_ip": "224.0.0.1"}, "--local-ip"),
        ({"local_ip": "239.255.255.250"}, "--local-ip"),
        ({"icmp_source": "0.0.0.0"}, "--icmp-source"),
        ({"icmp_source": "255.255.255.255"}, "--icmp-source"),
        ({"icmp_source": "224.0.0.5"}, "--icmp-source"),
        ({"orphan_timeout": "nan"}, "--orphan-timeout"),
        ({"orphan_timeout": "inf"}, "--orphan-timeout"),
        ({"orphan_timeout": "-1"}, "--orphan-timeout"),
        ({"orphan_timeout": "soon"}, "--orphan-timeout"),
        ({"control": ""}, "--control"),
    ],
)
def test_worker_args_refuse_unusable_values_in_one_line(capsys, changes, word):
    from agentd.dataplane.worker import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(_worker_args(**changes))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert word in err and err.count("\n") == 1 and "Traceback" not in err


# -- the C receive side (agentd/dataplane/_fastpath.c) against the Coalescer -------------------


@contextlib.contextmanager
def c_writer():
    """A FastPath whose TUN fd is a SOCK_SEQPACKET socket; yields (fastpath, read_writes)."""
    lib, why = _fast.load()
    assert lib is not None, why
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.setblocking(False)
    fp = _fast.FastPath(lib, "udp", tun_fd=a.fileno(), sock_fd=-1, mtu=1500, ttl_decrement=True, port=8285,
                        udp_gso=True, udp_gro=True)

    def writes():
        out = []
        while True:
            try:
                blob = b.recv(1 << 17)
            except BlockingIOError:
                return out
            out.append((P.VirtioNetHdr.decode(blob), blob[10:]))

    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    try:
        yield fp, writes
    finally:
        fp.close()
        a.close()
        b.close()


@settings(max_examples=150, deadline=None)
@given(segment_streams())
def test_c_coalescing_makes_exactly_the_python_writes(stream):
    """The C receive side (_fastpath.c) merges and writes exactly what the Coalescer does."""
    packets, _chunks = stream
    with c_writer() as (fp, writes):
        assert fp.write_packets(packets) == len(packets)
        assert writes() == coalesce_packets(packets)


def test_c_coalescing_merges_a_clean_run_into_one_super_packet():
    packets = [seg(1 + i * 1000) for i in range(40)] + [seg(40001, flags=P.TCP_ACK | P.TCP_PSH)]
    with c_writer() as (fp, writes):
        fp.write_packets(packets)
        got = writes()
        counters = fp.counters()
    assert [(v.gso_type, v.gso_size, v.hdr_len, len(p)) for v, p in got] == [(1, 1000, 52, 52 + 41000)]
    assert counters["coalesced_segments"] == 41 and counters["tun_writes"] == 1


def test_c_coalescing_drops_and_counts_packets_whose_length_lies():
    good = seg(1)
    short = bytearray(seg(1001))
    short[3] -= 1  # total length one less than the packet
    with c_writer() as (fp, writes):
        assert fp.write_packets([good, bytes(short), b"\x60" + bytes(39)]) == 1
        assert writes() == coalesce_packets([good])
        assert fp.counters()["drop:malformed"] == 2


