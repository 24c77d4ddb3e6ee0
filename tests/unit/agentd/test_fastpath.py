"""The C fast path (agentd/dataplane/_fastpath.c) against the Python reference, byte for byte:
TSO segmentation against segment_tcp4, receive-side coalescing against the Coalescer.

Pure: no root, no devices.  The coalescer's TUN writes go to one end of a SOCK_SEQPACKET
socket pair, which keeps every write a message of its own.  The library must be built (the
setup step builds it): these tests fail, not skip, where it is not.
"""

import contextlib
import socket

from hypothesis import given, settings
from hypothesis import strategies as st

from agentd.dataplane import _fast
from agentd.dataplane._forward import segment_tcp4
from agentd.dataplane._gro import coalesce_packets
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
    out = bytearray(1 << 20)
    count, seglen, total = segment_tcp4(memoryview(sp), mss, out, ttl_decrement)
    return count, seglen, total, bytes(out[:total])


def test_the_library_is_built_and_matches_this_code():
    lib, why = _fast.load()
    assert lib is not None, why


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
    segmenter writes exactly what segment_tcp4 writes (which test_dataplane_logic checks
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


@st.composite
def segment_streams(draw):
    """A receive batch as a UDP GRO read or a recvmmsg batch brings it: runs of one flow,
    cut by short segments, PSH, FIN, gaps, other flows, other TTLs, ICMP."""
    mss = draw(st.sampled_from([1000, 1420, 300]))
    n = draw(st.integers(1, 120))
    seq = draw(st.integers(0, 0xFFFFFFFF))
    events = draw(st.lists(st.sampled_from(["full"] * 30 + ["short", "psh", "gap", "flow", "fin", "ttl", "icmp"]),
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
        seq = (seq + ln) & 0xFFFFFFFF
    return packets


@settings(max_examples=150, deadline=None)
@given(segment_streams())
def test_c_coalescing_makes_exactly_the_python_writes(packets):
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
