"""Pure forwarding logic of the user-space data plane: next hops, members, TSO segmentation,
GRO-style coalescing, checksum completion."""

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentd.dataplane._forward import (
    Coalescer,
    ForwardError,
    NextHopTable,
    coalesce_packets,
    complete_checksum,
    parse_members,
    segment_tcp4,
    segment_tcp4_packets,
)
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
    segs = segment_tcp4_packets(P.VirtioNetHdr(gso_type=1, gso_size=1448), super_packet(payload), ttl_decrement=True)
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
    segs = segment_tcp4_packets(P.VirtioNetHdr(gso_type=1, gso_size=101),
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
    segs = segment_tcp4_packets(P.VirtioNetHdr(gso_type=1, gso_size=mss), sp)
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
        segment_tcp4(memoryview(super_packet(b"x" * 3000, ttl=1)), 1448, out, True)
    assert e.value.reason == "ttl_exceeded"
    with pytest.raises(ForwardError) as e:
        segment_tcp4(memoryview(P.udp_datagram(SRC, DST, 1, 2, b"x" * 100)), 1448, out)
    assert e.value.reason == "malformed"
    with pytest.raises(ForwardError):
        segment_tcp4(memoryview(b"\x45" + bytes(50)), 1448, out)


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
