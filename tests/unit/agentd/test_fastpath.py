"""The C fast path (agentd/dataplane/_fastpath.c) against the Python reference, byte for byte:
TSO segmentation against segment_tcp, and the transmit loop (TUN reads into segment slots,
UDP GSO sends) against it.  The receive side is held to the Coalescer in
test_dataplane_logic.py.

No root, no devices: the "TUN" is a SOCK_SEQPACKET socket (one message per read), the underlay
UDP on loopback.  The library must be built (the setup step builds it): these tests fail, not
skip, where it is not.
"""

import contextlib
import socket

from hypothesis import given, settings
from hypothesis import strategies as st

from agentd.dataplane import _fast
from agentd.dataplane._forward import complete_checksum, segment_tcp
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

        def received():
            out = []
            while True:
                try:
                    out.append(rx.recv(1 << 16))
                except BlockingIOError:
                    return out

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
        assert received() == expected_wire(reads)
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
