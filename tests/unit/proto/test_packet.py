"""proto.packet: checksums against the RFC 1071 reference, codecs round-trip, bad bytes raise
DecodeError only."""

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proto import packet as P


def test_rfc1071_example():
    # RFC 1071 §3: the words 0001 f203 f4f5 f6f7 sum to ddf2 (with end-around carry).
    data = bytes.fromhex("0001f203f4f5f6f7")
    assert P.ones_sum(data) == 0xDDF2
    assert P.checksum(data) == 0x220D == P.checksum_naive(data)


@given(st.binary(max_size=3000), st.integers(min_value=0, max_value=1 << 20))
def test_checksum_matches_naive_reference(data, initial):
    assert P.checksum(data, initial) == P.checksum_naive(data, initial)


def test_checksum_edge_cases():
    assert P.checksum(b"") == 0xFFFF
    assert P.checksum(b"\0\0\0") == 0xFFFF
    assert P.checksum(b"\xff\xff") == 0 == P.checksum_naive(b"\xff\xff")
    assert P.checksum(b"\x01") == P.checksum_naive(b"\x01") == 0xFEFF


@given(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF), st.binary(min_size=20, max_size=20))
def test_rfc1624_incremental_update_equals_recompute(old_word, new_word, rest):
    hdr = bytearray(rest)
    hdr[0] = 0x45  # a real header is never all zero (RFC 1624 §3 assumes as much)
    struct.pack_into("!H", hdr, 8, old_word)
    hdr[10:12] = b"\0\0"
    struct.pack_into("!H", hdr, 10, P.checksum(hdr))
    updated = P.checksum_update16(struct.unpack_from("!H", hdr, 10)[0], old_word, new_word)
    struct.pack_into("!H", hdr, 8, new_word)
    # Either zero representation is fine for the receiver: the sum must verify.
    struct.pack_into("!H", hdr, 10, updated)
    assert P.ones_sum(hdr) == 0xFFFF


@given(st.integers(2, 255), st.integers(0, 255), st.integers(0, 0xFFFF))
def test_decrement_ttl_keeps_header_checksum_valid(ttl, proto, ident):
    hdr = bytearray(P.IPv4Header(src="10.0.0.1", dst="10.0.0.2", protocol=proto, ttl=ttl,
                                 identification=ident).encode(0))
    assert P.decrement_ttl(hdr) == ttl - 1
    assert hdr[8] == ttl - 1
    assert P.ipv4_header_checksum_ok(hdr)


def test_decrement_ttl_at_one_refuses_and_leaves_packet():
    hdr = bytearray(P.IPv4Header(src="10.0.0.1", dst="10.0.0.2", protocol=6, ttl=1).encode(0))
    before = bytes(hdr)
    assert P.decrement_ttl(hdr) == 0
    assert bytes(hdr) == before


def test_ipv4_round_trip():
    h = P.IPv4Header(src="192.168.50.1", dst="192.168.50.2", protocol=4, ttl=64, tos=0x10,
                     identification=7, df=True, options=b"\x01\x01\x01\x00")
    raw = h.encode(100)
    d = P.IPv4Header.decode(raw + b"\0" * 100)
    assert (d.src, d.dst, d.protocol, d.ttl, d.tos, d.identification, d.df, d.options) == (
        "192.168.50.1", "192.168.50.2", 4, 64, 0x10, 7, True, b"\x01\x01\x01\x00")
    assert d.total_length == 124 and d.header_length == 24
    assert P.ipv4_header_checksum_ok(raw)


@pytest.mark.parametrize("raw, msg", [
    (b"\x45" * 10, "needs 20 bytes"),
    (b"\x65" + b"\0" * 19, "version 6"),
    (b"\x44" + b"\0" * 19, "header length 16"),
    (b"\x4f" + b"\0" * 19, "exceeds"),
])
def test_ipv4_decode_errors(raw, msg):
    with pytest.raises(P.DecodeError, match=msg):
        P.IPv4Header.decode(raw)


@given(st.binary(max_size=80))
def test_decoders_raise_only_decode_error(data):
    for decode in (P.IPv4Header.decode, P.UdpHeader.decode, P.TcpHeader.decode, P.VxlanHeader.decode,
                   P.VirtioNetHdr.decode, P.IcmpHeader.decode, P.split_ipv4, P.ipip_decapsulate,
                   P.IPv6Header.decode, P.split_ipv6, P.SctpHeader.decode):
        try:
            decode(data)
        except P.DecodeError:
            pass


def test_flannel_udp_payload_is_exactly_the_inner_packet():
    inner = P.tcp_packet("10.244.1.2", "10.244.2.2", P.TcpHeader(1000, 80, 1, 0, P.TCP_SYN, 65535))
    outer = P.flannel_udp_encapsulate(inner, "192.168.50.1", "192.168.50.2")
    ip, payload = P.split_ipv4(outer)
    assert ip.protocol == P.IPPROTO_UDP and ip.df
    udp = P.UdpHeader.decode(payload)
    assert udp.dst_port == P.FLANNEL_UDP_PORT == 8285 and udp.length == 8 + len(inner)
    assert bytes(payload[8:]) == inner
    assert P.transport_checksum_ok(outer)


def test_ipip_encapsulation_is_rfc2003():
    inner = P.tcp_packet("10.244.1.2", "10.244.2.2", P.TcpHeader(1000, 80, 1, 0, P.TCP_SYN, 65535))
    outer = P.ipip_encapsulate(inner, "192.168.50.1", "192.168.50.2")
    assert len(outer) == 20 + len(inner)
    hdr, got = P.ipip_decapsulate(outer)
    assert hdr.protocol == 4 and hdr.df and hdr.ttl == 64 and hdr.src == "192.168.50.1"
    assert bytes(got) == inner
    with pytest.raises(P.DecodeError, match="expected 4"):
        P.ipip_decapsulate(P.udp_datagram("1.1.1.1", "2.2.2.2", 1, 2, b"x"))


def test_vxlan_header():
    raw = P.VxlanHeader(vni=4096).encode()
    assert raw == bytes.fromhex("0800000000100000") and len(raw) == 8
    assert P.VxlanHeader.decode(raw).vni == 4096
    with pytest.raises(P.DecodeError, match="I flag"):
        P.VxlanHeader.decode(b"\0" * 8)
    with pytest.raises(ValueError):
        P.VxlanHeader(vni=1 << 24).encode()


def test_virtio_net_hdr_both_sizes():
    h = P.VirtioNetHdr(flags=P.VIRTIO_NET_HDR_F_NEEDS_CSUM, gso_type=P.VIRTIO_NET_HDR_GSO_TCPV4,
                       hdr_len=52, gso_size=1448, csum_start=20, csum_offset=16)
    raw = h.encode()
    assert len(raw) == 10 and raw == struct.pack("<BBHHHH", 1, 1, 52, 1448, 20, 16)
    assert P.VirtioNetHdr.decode(raw) == h
    m = P.VirtioNetHdr(gso_size=1448, num_buffers=1)
    assert m.size == 12 and P.VirtioNetHdr.decode(m.encode(), 12) == m
    assert P.VNET_HDR_NONE == b"\0" * 10
    with pytest.raises(P.DecodeError):
        P.VirtioNetHdr.decode(b"\0" * 9)


def test_tcp_header_round_trip_and_checksum():
    tcp = P.TcpHeader(40000, 5201, 123456, 654321, P.TCP_ACK | P.TCP_PSH, 502,
                      options=b"\x01\x01\x08\x0a" + bytes(8))
    pkt = P.tcp_packet("10.244.1.2", "10.244.2.2", tcp, b"hello world")
    assert P.transport_checksum_ok(pkt)
    _, seg = P.split_ipv4(pkt)
    d = P.TcpHeader.decode(seg)
    assert (d.seq, d.ack, d.flags, d.window, d.options) == (123456, 654321, 0x18, 502, tcp.options)
    corrupted = bytearray(pkt)
    corrupted[-1] ^= 1
    assert not P.transport_checksum_ok(corrupted)


def test_icmp_net_unreachable_quotes_header_and_8_bytes():
    offender = P.tcp_packet("10.244.1.2", "10.244.9.9", P.TcpHeader(1, 2, 3, 4, P.TCP_SYN, 5), b"x" * 50)
    icmp = P.icmp_net_unreachable(offender, "192.168.50.1")
    ip, body = P.split_ipv4(icmp)
    assert (ip.src, ip.dst, ip.protocol) == ("192.168.50.1", "10.244.1.2", P.IPPROTO_ICMP)
    h = P.IcmpHeader.decode(body)
    assert (h.type, h.code) == (3, 0)
    assert bytes(body[8:]) == offender[:28]
    assert P.checksum(body) == 0
    te = P.split_ipv4(P.icmp_time_exceeded(offender, "192.168.50.1"))[1]
    assert (te[0], te[1]) == (11, 0)
    fn = P.IcmpHeader.decode(P.split_ipv4(P.icmp_frag_needed(offender, "192.168.50.1", 1472))[1])
    assert (fn.type, fn.code, fn.rest) == (3, 4, 1472)


def _udp4(src="10.244.1.2", dst="10.244.9.9", body=bytes(16)):
    return bytearray(P.ipv4_packet(P.IPv4Header(src=src, dst=dst, protocol=P.IPPROTO_UDP, ttl=1), body))


@pytest.mark.parametrize("bad", [
    "error about an error", "redirect", "source quench", "parameter problem", "time exceeded",
    "non-first fragment", "multicast dst", "broadcast dst", "src 0.0.0.0", "src loopback",
    "src multicast", "src broadcast", "src class E",
])
def test_icmp_errors_never_about_errors_fragments_or_non_unicast(bad):
    # RFC 1122 section 3.2.2 and RFC 1812 section 4.3.2.7, as RFC 4443 section 2.4 (e) for ICMPv6.
    offender = P.tcp_packet("10.244.1.2", "10.244.9.9", P.TcpHeader(1, 2, 3, 4, P.TCP_SYN, 5), b"x" * 50)
    error_types = {"error about an error": 3, "redirect": 5, "source quench": 4,
                   "parameter problem": 12, "time exceeded": 11}
    if bad in error_types:
        pkt = bytearray(P.icmp_net_unreachable(offender, "192.168.50.9"))
        pkt[20] = error_types[bad]
    elif bad == "non-first fragment":
        pkt = _udp4()
        pkt[6:8] = (0x2000 | 16).to_bytes(2, "big")  # more fragments, offset 128 bytes
    else:
        src, dst = {"multicast dst": ("10.244.1.2", "224.0.0.5"), "broadcast dst": ("10.244.1.2", "255.255.255.255"),
                    "src 0.0.0.0": ("0.0.0.0", "10.244.9.9"), "src loopback": ("127.0.0.1", "10.244.9.9"),
                    "src multicast": ("239.1.1.1", "10.244.9.9"), "src broadcast": ("255.255.255.255", "10.244.9.9"),
                    "src class E": ("240.0.0.1", "10.244.9.9")}[bad]
        pkt = _udp4(src, dst)
    for build in (P.icmp_net_unreachable, P.icmp_time_exceeded):
        with pytest.raises(ValueError):
            build(bytes(pkt), "192.168.50.1")
    with pytest.raises(ValueError):
        P.icmp_frag_needed(bytes(pkt), "192.168.50.1", 1400)


def test_icmp_errors_still_about_echo_and_first_fragments():
    echo = P.ipv4_packet(P.IPv4Header(src="10.244.1.2", dst="10.244.9.9", protocol=P.IPPROTO_ICMP, ttl=1),
                         b"\x08\x00\x00\x00" + bytes(12))
    assert P.split_ipv4(P.icmp_time_exceeded(echo, "192.168.50.1"))[0].dst == "10.244.1.2"
    first = _udp4()
    first[6:8] = (0x2000).to_bytes(2, "big")  # more fragments, offset 0: the first fragment
    assert P.split_ipv4(P.icmp_time_exceeded(bytes(first), "192.168.50.1"))[0].dst == "10.244.1.2"


# -- IPv6 (RFC 8200) and ICMPv6 errors (RFC 4443) ------------------------------------------------

SRC6, DST6 = "fd00:10:244:1::2", "fd00:10:244:9::9"


def test_ipv6_header_round_trip_and_hop_limit():
    h = P.IPv6Header(SRC6, DST6, P.IPPROTO_TCP, hop_limit=7, traffic_class=0xB9, flow_label=0xFEDCB)
    pkt = bytearray(P.ipv6_packet(h, b"x" * 30))
    assert len(pkt) == 70 and pkt[0] == 0x6B and pkt[1] == 0x9F
    got, payload = P.split_ipv6(pkt)
    assert got == P.IPv6Header(SRC6, DST6, 6, 7, 0xB9, 0xFEDCB, 30) and bytes(payload) == b"x" * 30
    assert P.decrement_hop_limit(pkt) == 6 and pkt[7] == 6
    pkt[7] = 1
    assert P.decrement_hop_limit(pkt) == 0 and pkt[7] == 1
    with pytest.raises(P.DecodeError, match="version"):
        P.IPv6Header.decode(b"\x45" + bytes(39))
    with pytest.raises(P.DecodeError, match="exceeds"):
        P.split_ipv6(bytes(pkt[:60]))


def test_tcp_over_ipv6_checksum_covers_the_ipv6_pseudo_header():
    pkt = P.tcp6_packet(SRC6, DST6, P.TcpHeader(40000, 5201, 1, 2, P.TCP_ACK, 502), b"hello")
    assert P.transport_checksum_ok(pkt)
    seg = pkt[40:]
    # RFC 8200 section 8.1: source, destination, upper-layer length (32 bits), next header (32 bits).
    pseudo = pkt[8:40] + struct.pack("!II", len(seg), 6)
    assert P.checksum_naive(pseudo + seg) == 0
    moved = bytearray(pkt)
    moved[39] ^= 1  # another destination: the same TCP bytes no longer check
    assert not P.transport_checksum_ok(moved)


def test_icmpv6_errors_quote_up_to_the_minimum_mtu_and_never_answer_errors():
    offender = P.tcp6_packet(SRC6, DST6, P.TcpHeader(1, 2, 3, 4, P.TCP_SYN, 5), b"x" * 1400)
    for build, (type_, code) in ((P.icmp6_no_route, (1, 0)), (P.icmp6_hop_limit_exceeded, (3, 0))):
        msg = build(offender, "fd00:10:244:1::1")
        ip, body = P.split_ipv6(msg)
        assert (ip.src, ip.dst, ip.next_header, ip.hop_limit) == ("fd00:10:244:1::1", SRC6, 58, 64)
        assert len(msg) == 1280 and (body[0], body[1]) == (type_, code)  # RFC 4443 section 2.4 (c)
        assert bytes(body[8:]) == offender[: 1280 - 48]
        assert P.transport_checksum_ok(msg)
    small = P.tcp6_packet(SRC6, DST6, P.TcpHeader(1, 2, 3, 4, P.TCP_SYN, 5), b"y")
    assert bytes(P.split_ipv6(P.icmp6_no_route(small, "fd00::1"))[1][8:]) == small
    # Never about an ICMPv6 error, multicast or the unspecified source (RFC 4443 section 2.4 (e));
    # about an echo request, yes.
    error = P.icmp6_no_route(small, "fd00::1")
    multicast = P.ipv6_packet(P.IPv6Header(SRC6, "ff02::1", 17), bytes(8))
    unspecified = P.ipv6_packet(P.IPv6Header("::", DST6, 17), bytes(8))
    for bad in (error, multicast, unspecified):
        with pytest.raises(ValueError):
            P.icmp6_no_route(bad, "fd00::1")
    echo = P.ipv6_packet(P.IPv6Header(SRC6, DST6, 58), b"\x80\x00\x00\x00" + bytes(12))
    assert P.transport_checksum_ok(P.icmp6_hop_limit_exceeded(echo, "fd00::1"))
    with pytest.raises(P.DecodeError):
        P.icmp6_no_route(b"\x60" + bytes(20), "fd00::1")


def test_icmpv6_packet_too_big_carries_the_mtu():
    offender = P.tcp6_packet(SRC6, DST6, P.TcpHeader(1, 2, 3, 4, P.TCP_ACK, 5), b"x" * 1400)
    msg = P.icmp6_packet_too_big(offender, "fd00::1", 1400)
    _, body = P.split_ipv6(msg)
    assert (body[0], body[1], struct.unpack_from("!I", body, 4)[0]) == (2, 0, 1400)  # RFC 4443 section 3.2
    assert P.transport_checksum_ok(msg)


# --------------------------------------------------------------------------------------------
# IPv6 (RFC 8200) and what sits behind its extension headers


def test_ipv6_header_round_trip():
    h = P.IPv6Header("fd00:10:244:1::2", "2001:db8::1", P.IPPROTO_TCP, hop_limit=63, traffic_class=0xB8,
                     flow_label=0xABCDE, payload_length=20)
    raw = h.encode()
    assert len(raw) == P.IPV6_HEADER_LEN and raw[0] >> 4 == 6
    assert P.IPv6Header.decode(raw + b"tail") == h
    with pytest.raises(P.DecodeError, match="40 bytes"):
        P.IPv6Header.decode(raw[:39])
    with pytest.raises(P.DecodeError, match="version 4"):
        P.IPv6Header.decode(b"\x45" + raw[1:])


def _ext(next_header: int, units: int) -> bytes:
    """An extension header of RFC 8200 §4's format: (units + 1) * 8 octets."""
    return bytes([next_header, units]) + b"\0" * (units * 8 + 6)


def test_upper_layer_behind_every_kind_of_extension_header():
    tcp = P.TcpHeader(40000, 443, 1, 0, P.TCP_SYN, 65535).encode()
    ah = bytes([P.IPPROTO_TCP, 4]) + b"\0" * 22  # RFC 4302: (4 + 2) * 4 = 24 octets
    fragment = bytes([P.IPPROTO_AH, 0, 0, 1]) + b"\0\0\0\x07"  # offset 0, M set: the first fragment
    chain = _ext(P.IPPROTO_ROUTING, 0) + _ext(P.IPPROTO_DSTOPTS, 2) + _ext(P.IPPROTO_FRAGMENT, 1) + fragment + ah
    packet = P.IPv6Header("fd00::1", "fd00::2", P.IPPROTO_HOPOPTS).encode(len(chain) + len(tcp)) + chain + tcp
    upper = P.ipv6_upper_layer(packet, P.IPPROTO_HOPOPTS)
    assert upper == P.UpperLayer(P.IPPROTO_TCP, 40 + len(chain))
    assert P.transport_ports(upper.protocol, packet[upper.offset:]) == (40000, 443)
    # A later fragment: the protocol is known, its header is not here.
    later = bytes([P.IPPROTO_UDP, 0, 0x05, 0x08]) + b"\0\0\0\x07"
    assert P.ipv6_upper_layer(later, P.IPPROTO_FRAGMENT, 0) == P.UpperLayer(P.IPPROTO_UDP, None)
    # No extension headers: the upper layer is right after the fixed header.
    assert P.ipv6_upper_layer(b"\0" * 48, P.IPPROTO_UDP) == P.UpperLayer(P.IPPROTO_UDP, 40)


def test_transport_ports_of_each_protocol_and_of_cut_headers():
    udp = P.UdpHeader(5353, 53, 9).encode()
    sctp = struct.pack("!HHII", 36412, 38412, 7, 0)
    assert P.transport_ports(P.IPPROTO_UDP, udp) == (5353, 53)
    assert P.transport_ports(P.IPPROTO_SCTP, sctp) == (36412, 38412)
    assert P.transport_ports(P.IPPROTO_ICMPV6, bytes([128, 0]) + b"\0" * 6) == (128, 0)
    assert P.transport_ports(P.IPPROTO_UDP, udp[:7]) == (0, 0)
    assert P.transport_ports(P.IPPROTO_SCTP, sctp[:11]) == (0, 0)
    assert P.transport_ports(P.IPPROTO_TCP, b"\0" * 20) == (0, 0)  # data offset 0: not a TCP header
    assert P.transport_ports(47, b"\0" * 40) == (0, 0)  # GRE: no ports


@given(st.integers(0, 255), st.binary(max_size=200), st.integers(0, 60))
def test_upper_layer_walk_never_raises(next_header, data, offset):
    upper = P.ipv6_upper_layer(data, next_header, offset)
    assert upper.offset is None or offset <= upper.offset <= len(data)
    if upper.offset is not None:
        P.transport_ports(upper.protocol, data[upper.offset:])
