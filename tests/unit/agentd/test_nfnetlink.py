"""The nf_tables messages of agentd.nft.nfnetlink (element batches, counter dumps), byte
for byte.  The expected bytes are what the module produced before it moved onto the kernel
codec's framing (agentd.kernel.netlink: attributes, nfgenmsg header): computed with the old
``_attr`` / ``_nested`` / ``_message`` / ``batch`` and pasted here, so the wire did not change.
Decoding: the counters of an NFT_MSG_NEWOBJ dump, built the way the old code parsed them.
The writer on the shared NetlinkSocket: acks matched by sequence number, refusals as one line."""

from __future__ import annotations

import errno
import os
import socket
import struct

import pytest

from agentd.kernel import netlink as nl
from agentd.kernel.netlink_socket import NetlinkSocket
from agentd.nft import nfnetlink as nf

# --- encoding: the old module's bytes --------------------------------------------------------

ADD_IPV4 = bytes.fromhex(
    "580000000c0a0504650000000000000001000000120001006167656e74642d706f6c69637900000009000200706f64730000000024000380"
    "100001800c000180080001000a010203100001800c000180080001000a010204"
)
DEL_CONCAT = bytes.fromhex(
    "4c0000000e0a0500660000000000000002000000140001006167656e74642d73657276696365730008000200657073001c000380180001"
    "8014000180100001000a0000011100000000350000"
)
ADD_VERDICT_MAP = bytes.fromhex(
    "700000000c0a0504670000000000000001000000120001006167656e74642d706f6c6963790000000c000200696e6772657373003c000380"
    "38000180180001801400010061642d766574683000000000000000001c0002801800028008000100fffffffd0c000200706f6c2d61626300"
)
DEL_VERDICT_MAP = bytes.fromhex(
    "540000000e0a0500680000000000000001000000120001006167656e74642d706f6c6963790000000c000200696e67726573730020000380"
    "1c000180180001801400010061642d76657468300000000000000000"
)
ADD_ETHER_MAP = bytes.fromhex(
    "580000000c0a0504690000000000000002000000140001006167656e74642d736572766963657300090002006d6163730000000024000380"
    "200001800c000180080001000a000002100002800a00010002000a0000020000"
)
ADD_GOTO_CONCAT = bytes.fromhex(
    "540000000c0a05046a00000000000000020000000600010074000000060002006d000000300003802c000180100001800c0001000a000003"
    "00500000180002801400028008000100fffffffc0600020063000000"
)
BATCH_BEGIN_100 = bytes.fromhex("140000001000010064000000000000000000000a")
BATCH_END_103 = bytes.fromhex("140000001100010067000000000000000000000a")
EMPTY_BATCH_7 = bytes.fromhex("140000001000010007000000000000000000000a140000001100010008000000000000000000000a")
GETOBJ_COUNTERS = bytes.fromhex(
    "30000000130a01032a0000000000000001000000120001006167656e74642d706f6c6963790000000800030000000001"
)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("add", "inet", "agentd-policy", "pods", ["ipv4_addr"], None, ["10.1.2.3", "10.1.2.4"], 101), ADD_IPV4),
        (("delete", "ip", "agentd-services", "eps", ["ipv4_addr", "inet_proto", "inet_service"], None,
          [{"concat": ["10.0.0.1", "udp", 53]}], 102), DEL_CONCAT),
        (("add", "inet", "agentd-policy", "ingress", ["ifname"], "verdict",
          [["ad-veth0", {"jump": {"target": "pol-abc"}}]], 103), ADD_VERDICT_MAP),
        (("delete", "inet", "agentd-policy", "ingress", ["ifname"], "verdict", ["ad-veth0"], 104), DEL_VERDICT_MAP),
        (("add", "ip", "agentd-services", "macs", ["ipv4_addr"], "ether_addr",
          [["10.0.0.2", "02:00:0a:00:00:02"]], 105), ADD_ETHER_MAP),
        (("add", "ip", "t", "m", ["ipv4_addr", "inet_service"], "verdict",
          [[["10.0.0.3", 80], {"goto": {"target": "c"}}]], 106), ADD_GOTO_CONCAT),
    ],
    ids=["add-ipv4", "delete-concat", "add-verdict-map", "delete-verdict-map", "add-ether-map", "add-goto-concat"],
)  # fmt: skip
def test_element_messages_are_the_old_bytes(args, expected):
    assert nf.element_message(*args) == expected


def test_batch_is_the_old_bytes_and_frames_one_transaction():
    data = nf.batch([ADD_IPV4, DEL_CONCAT], 100)
    assert data == BATCH_BEGIN_100 + ADD_IPV4 + DEL_CONCAT + BATCH_END_103
    assert nf.batch([], 7) == EMPTY_BATCH_7
    # Read back with the kernel codec: begin/end carry res_id NFNL_SUBSYS_NFTABLES (big-endian)
    # and family AF_UNSPEC; the element messages ask for an ACK each, adds with NLM_F_CREATE.
    got = [(t, f, s, bytes(data[b:e][:4])) for t, f, s, _pid, b, e in nl.iter_messages(data)]
    assert got == [
        (nf.NFNL_MSG_BATCH_BEGIN, nl.NLM_F_REQUEST, 100, bytes([nl.AF_UNSPEC, 0, 0, nf.NFNL_SUBSYS_NFTABLES])),
        (nf.NFNL_SUBSYS_NFTABLES << 8 | nf.NFT_MSG_NEWSETELEM, nl.NLM_F_REQUEST | nl.NLM_F_ACK | nl.NLM_F_CREATE, 101,
         bytes([nf.FAMILIES["inet"], 0, 0, 0])),
        (nf.NFNL_SUBSYS_NFTABLES << 8 | nf.NFT_MSG_DELSETELEM, nl.NLM_F_REQUEST | nl.NLM_F_ACK, 102,
         bytes([nf.FAMILIES["ip"], 0, 0, 0])),
        (nf.NFNL_MSG_BATCH_END, nl.NLM_F_REQUEST, 103, bytes([nl.AF_UNSPEC, 0, 0, nf.NFNL_SUBSYS_NFTABLES])),
    ]  # fmt: skip


def test_getobj_counters_is_the_old_bytes():
    assert nf.getobj_counters("inet", "agentd-policy", 42) == GETOBJ_COUNTERS


def test_element_attributes_decode_with_the_kernel_codec():
    (_t, _f, _s, _pid, start, end), = nl.iter_messages(ADD_VERDICT_MAP)
    top = {a: (vs, ve) for a, vs, ve in nl.iter_attrs(ADD_VERDICT_MAP, start + nl.NFGENMSG_LEN, end)}
    assert nl.read_string(ADD_VERDICT_MAP, *top[nf.NFTA_SET_ELEM_LIST_TABLE]) == "agentd-policy"
    assert nl.read_string(ADD_VERDICT_MAP, *top[nf.NFTA_SET_ELEM_LIST_SET]) == "ingress"
    (elem_type, es, ee), = nl.iter_attrs(ADD_VERDICT_MAP, *top[nf.NFTA_SET_ELEM_LIST_ELEMENTS])
    assert elem_type == nf.NFTA_LIST_ELEM
    parts = {a: (vs, ve) for a, vs, ve in nl.iter_attrs(ADD_VERDICT_MAP, es, ee)}
    (_v, ks, ke), = nl.iter_attrs(ADD_VERDICT_MAP, *parts[nf.NFTA_SET_ELEM_KEY])
    assert ADD_VERDICT_MAP[ks:ke] == b"ad-veth0" + b"\0" * 8  # IFNAMSIZ
    (_d, vs, ve), = nl.iter_attrs(ADD_VERDICT_MAP, *parts[nf.NFTA_SET_ELEM_DATA])
    verdict = {a: ADD_VERDICT_MAP[s:e] for a, s, e in nl.iter_attrs(ADD_VERDICT_MAP, vs, ve)}
    assert verdict == {nf.NFTA_VERDICT_CODE: (nf.NFT_JUMP & 0xFFFFFFFF).to_bytes(4, "big"),
                       nf.NFTA_VERDICT_CHAIN: b"pol-abc\0"}  # fmt: skip


def test_address_and_port_maps_carry_their_values():
    """Services' slot maps (VIP . proto . port -> an endpoint's address, or its port)."""
    key = {"concat": ["10.96.0.10", "tcp", 80]}
    for map_type, value, raw in (("ipv4_addr", "10.244.1.2", bytes([10, 244, 1, 2])), ("inet_service", 8080, b"\x1f\x90")):
        msg = nf.element_message("add", "ip", "agentd-services", "m", ["ipv4_addr", "inet_proto", "inet_service"],
                                 map_type, [[key, value]], 7)  # fmt: skip
        (_t, _f, _s, _pid, start, end), = nl.iter_messages(msg)
        top = {a: (vs, ve) for a, vs, ve in nl.iter_attrs(msg, start + nl.NFGENMSG_LEN, end)}
        (_e, es, ee), = nl.iter_attrs(msg, *top[nf.NFTA_SET_ELEM_LIST_ELEMENTS])
        parts = {a: (vs, ve) for a, vs, ve in nl.iter_attrs(msg, es, ee)}
        (_k, ks, ke), = nl.iter_attrs(msg, *parts[nf.NFTA_SET_ELEM_KEY])
        assert msg[ks:ke] == bytes([10, 96, 0, 10]) + b"\x06\0\0\0" + b"\0\x50\0\0"  # each part padded to 4
        (kind, vs, ve), = nl.iter_attrs(msg, *parts[nf.NFTA_SET_ELEM_DATA])
        assert (kind, msg[vs:ve]) == (nf.NFTA_DATA_VALUE, raw)
    # Object maps (a counter by name) are left to libnftables.
    assert nf.can_encode(("ipv4_addr", "inet_proto", "inet_service"), "inet_service")
    assert not nf.can_encode(("ipv4_addr", "inet_proto", "inet_service"), "counter")


def test_ipv6_keys_and_values_are_sixteen_bytes():
    """IPv6 sets and maps (policy's ``.../pods6``, Services' ``ip6 agentd-services`` maps)."""
    assert nf.can_encode(("ipv6_addr", "inet_proto", "inet_service"), "ipv6_addr")
    assert nf.encode_key(["ipv6_addr"], "fd00::1") == bytes.fromhex("fd000000000000000000000000000001")
    # In a concatenation the 16 bytes need no padding; the protocol and port do.
    key = nf.encode_key(["ipv6_addr", "inet_proto", "inet_service"], ["fd00:10:96::a", "udp", 53])
    assert key == bytes.fromhex("fd00001000960000000000000000000a") + b"\x11\0\0\0" + b"\0\x35\0\0"
    msg = nf.element_message("add", "ip6", "agentd-services", "addr/0", ["ipv6_addr", "inet_proto", "inet_service"],
                             "ipv6_addr", [[{"concat": ["fd00:10:96::a", "tcp", 80]}, "fd00:10:244:1::2"]], 7)  # fmt: skip
    (_t, _f, _s, _pid, start, end), = nl.iter_messages(msg)
    assert msg[start] == 10  # NFPROTO_IPV6: the ip6 table's family
    top = {a: (vs, ve) for a, vs, ve in nl.iter_attrs(msg, start + nl.NFGENMSG_LEN, end)}
    (_e, es, ee), = nl.iter_attrs(msg, *top[nf.NFTA_SET_ELEM_LIST_ELEMENTS])
    parts = {a: (vs, ve) for a, vs, ve in nl.iter_attrs(msg, es, ee)}
    (kind, vs, ve), = nl.iter_attrs(msg, *parts[nf.NFTA_SET_ELEM_DATA])
    assert (kind, msg[vs:ve]) == (nf.NFTA_DATA_VALUE, bytes.fromhex("fd000010024400010000000000000002"))


def test_keys_that_cannot_be_encoded_are_value_errors():
    with pytest.raises(ValueError, match="too long"):
        nf.encode_key(["ifname"], "x" * 16)
    with pytest.raises(ValueError, match="does not match ipv4_addr.inet_service"):
        nf.encode_key(["ipv4_addr", "inet_service"], ["10.0.0.1"])
    with pytest.raises(ValueError, match="no netlink encoding for nft type ipv4_addr6"):
        nf.encode_key(["ipv4_addr6"], "::1")


# --- decoding: a counter dump ----------------------------------------------------------------

# Two NFT_MSG_NEWOBJ answers as nf_tables dumps them (table, name, type, data {bytes,
# packets}, use, handle), then NLMSG_DONE; built with the old module's encoders.
NEWOBJ_DROP = bytes.fromhex(
    "78000000120a02002a0000000000000001000000120001006167656e74642d706f6c69637900000015000200706f6c2d696e6772657373"
    "2d64726f700000000008000300000000011c0004800c00010000000000000001a40c00020000000000000000070800050000000001"
    "0c0006000000000000000003"
)
NEWOBJ_DNS = bytes.fromhex(
    "70000000120a02002a0000000000000001000000120001006167656e74642d706f6c6963790000000f0002007376632d7564702d3533"
    "000008000300000000011c0004800c00010000040000000000090c000200000001000000000508000500000000010c0006000000000000"
    "000004"
)
DONE = bytes.fromhex("14000000 0300 0200 2a000000 00000000 00000000".replace(" ", ""))  # NLM_F_MULTI, seq 42


def test_counters_decode_from_a_dump():
    dump = NEWOBJ_DROP + NEWOBJ_DNS + DONE
    got = [nf.decode_counter(dump, s, e) for t, _f, _seq, _pid, s, e in nl.iter_messages(dump)
           if t == nf.NFNL_SUBSYS_NFTABLES << 8 | nf.NFT_MSG_NEWOBJ]  # fmt: skip
    assert got == [("pol-ingress-drop", 7, 420), ("svc-udp-53", 2**40 + 5, 2**50 + 9)]


def test_counter_without_counts_is_zero():
    msg = nl.encode_nfgen(nf.NFNL_SUBSYS_NFTABLES << 8 | nf.NFT_MSG_NEWOBJ, 0, 1, 1,
                          nl.attr(nf.NFTA_OBJ_NAME, b"c\0") + nl.nested(nf.NFTA_OBJ_DATA))  # fmt: skip
    assert nf.decode_counter(msg, nl.NLMSG_HDRLEN, len(msg)) == ("c", 0, 0)


def test_malformed_counters_are_decode_errors():
    (_t, _f, _s, _pid, start, end), = nl.iter_messages(NEWOBJ_DROP)
    with pytest.raises(nl.NetlinkDecodeError, match="nfgenmsg needs 4"):
        nf.decode_counter(NEWOBJ_DROP, start, start + 2)
    short = nl.encode_nfgen(nf.NFNL_SUBSYS_NFTABLES << 8 | nf.NFT_MSG_NEWOBJ, 0, 1, 1,
                            nl.nested(nf.NFTA_OBJ_DATA, nl.attr(nf.NFTA_COUNTER_PACKETS, b"\0\0\0\1")))  # fmt: skip
    with pytest.raises(nl.NetlinkDecodeError, match="must be 8 bytes, got 4"):
        nf.decode_counter(short, nl.NLMSG_HDRLEN, len(short))
    with pytest.raises(nl.NetlinkDecodeError, match="does not fit"):
        nf.decode_counter(NEWOBJ_DROP, start, end - 4)  # the last attribute cut short


def test_refused_batch_reads_as_one_line_naming_it():
    # What callers (libnftables.Nft -> NftError) see when nf_tables refuses an element.
    # The ack of message 101 (NETLINK_CAP_ACK: it echoes only the request's header).
    ack = struct.pack("=IHHIIi", 36, nl.NLMSG_ERROR, nl.NLM_F_CAPPED, 101, 0, -errno.EEXIST) + ADD_IPV4[:16]
    (t, flags, seq, _pid, start, end), = nl.iter_messages(ack)
    assert (t, seq, nl.decode_error(ack, start, end, flags)) == (nl.NLMSG_ERROR, 101, (errno.EEXIST, None))
    err = nl.NetlinkError(errno.EEXIST, None, "nf_tables refused the element batch")
    assert isinstance(err, OSError) and err.errno == errno.EEXIST
    assert str(err) == "nf_tables refused the element batch: EEXIST (File exists)"


# --- the writer on NetlinkSocket: requests out, answers in -----------------------------------
# The kernel's side is a datagram socket pair here (no netlink, no root): the answers, in the
# kernel's format, are queued before the call, which sends its request and then reads them.


def _writer(seq: int) -> tuple[nf.ElementWriter, socket.socket]:
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    ours.setblocking(False)
    sock = NetlinkSocket.__new__(NetlinkSocket)
    sock.sock, sock._buf = ours, bytearray(NetlinkSocket.RECV_SIZE)
    sock._view = memoryview(sock._buf)
    writer = nf.ElementWriter.__new__(nf.ElementWriter)
    writer.sock, writer.seq = sock, seq
    return writer, kernel


def _ack(seq: int, error: int = 0) -> bytes:
    """NLMSG_ERROR as a NETLINK_CAP_ACK socket gets it: the request's header echoed."""
    return struct.pack("=IHHIIi", 36, nl.NLMSG_ERROR, nl.NLM_F_CAPPED, seq, 0, -error) + bytes(16)


OPS = [("add", "inet", "agentd-policy", "pods", ["ipv4_addr"], None, ["10.1.2.3", "10.1.2.4"]),
       ("delete", "ip", "agentd-services", "eps", ["ipv4_addr", "inet_proto", "inet_service"], None,
        [{"concat": ["10.0.0.1", "udp", 53]}])]  # fmt: skip


def test_writer_sends_the_batch_and_waits_for_every_ack():
    writer, kernel = _writer(100)
    with kernel, writer.sock.sock:
        kernel.send(_ack(57, errno.EEXIST) + _ack(101))  # a stale refusal of an earlier batch is skipped
        kernel.send(_ack(102))
        writer.send(OPS)
        assert kernel.recv(1 << 16) == BATCH_BEGIN_100 + ADD_IPV4 + DEL_CONCAT + BATCH_END_103
        assert writer.seq == 104
        writer.send([])  # nothing to commit: nothing sent
        assert writer.seq == 104


@pytest.mark.parametrize(("seq", "error"), [(102, errno.EEXIST), (100, errno.EPERM)], ids=["element", "batch-begin"])
def test_writer_raises_the_refusal_of_its_batch(seq, error):
    writer, kernel = _writer(100)
    with kernel, writer.sock.sock:
        kernel.send(_ack(101) + _ack(seq, error))
        with pytest.raises(nl.NetlinkError) as caught:
            writer.send(OPS)
        assert caught.value.errno == error
        assert str(caught.value) == f"nf_tables refused the element batch: {errno.errorcode[error]} ({os.strerror(error)})"


def test_writer_reads_counters_from_a_getobj_dump():
    writer, kernel = _writer(41)
    with kernel, writer.sock.sock:
        kernel.send(NEWOBJ_DROP + NEWOBJ_DNS)
        kernel.send(DONE)
        assert writer.counters("inet", "agentd-policy") == {"pol-ingress-drop": (7, 420),
                                                            "svc-udp-53": (2**40 + 5, 2**50 + 9)}  # fmt: skip
        assert kernel.recv(1 << 16) == GETOBJ_COUNTERS
        kernel.send(_ack(43, errno.ENOENT))  # no such table: no counters
        assert writer.counters("inet", "agentd-policy") == {}
        kernel.send(_ack(44, errno.EPERM))
        with pytest.raises(nl.NetlinkError, match=r"^reading counters: EPERM \(Operation not permitted\)$"):
            writer.counters("inet", "agentd-policy")


def test_recv_many_takes_what_is_queued_a_batch_per_call():
    """A listener of many small messages (conntrack's events) reads up to BATCH datagrams a
    system call (recvmmsg), each whole and in order."""
    writer, kernel = _writer(1)
    sock = writer.sock
    sock._batch = None
    sent = [bytes([k % 251]) * (1 + k * 37 % 900) for k in range(NetlinkSocket.BATCH + 6)]
    with kernel, sock.sock:
        assert sock.recv_many() == []
        for datagram in sent:
            kernel.send(datagram)
        assert sock.recv_many() == sent[:NetlinkSocket.BATCH]
        assert sock.recv_many() == sent[NetlinkSocket.BATCH:]
        assert sock.recv_many() == []


# --- a large change of one set: several messages, one batch ----------------------------------


def _element_lists(data: bytes) -> list[tuple[int, int, str, str, int, list[bytes]]]:
    """``(type, seq, table, set, element list's attribute length, keys)`` of each element
    message in ``data``, read back with the kernel codec."""
    out = []
    for mtype, _flags, seq, _pid, start, end in nl.iter_messages(data):
        if mtype in (nf.NFNL_MSG_BATCH_BEGIN, nf.NFNL_MSG_BATCH_END):
            continue
        top = {a: (vs, ve) for a, vs, ve in nl.iter_attrs(data, start + nl.NFGENMSG_LEN, end)}
        es, ee = top[nf.NFTA_SET_ELEM_LIST_ELEMENTS]
        keys = []
        for _e, s, e in nl.iter_attrs(data, es, ee):
            parts = {a: (vs, ve) for a, vs, ve in nl.iter_attrs(data, s, e)}
            (_v, ks, ke), = nl.iter_attrs(data, *parts[nf.NFTA_SET_ELEM_KEY])
            keys.append(data[ks:ke])
        out.append((mtype, seq, nl.read_string(data, *top[nf.NFTA_SET_ELEM_LIST_TABLE]),
                    nl.read_string(data, *top[nf.NFTA_SET_ELEM_LIST_SET]), 4 + ee - es, keys))  # fmt: skip
    return out


def test_a_change_larger_than_one_attribute_goes_in_several_messages_of_one_batch():
    """An attribute's length is 16 bits: one NFTA_SET_ELEM_LIST_ELEMENTS holds ~4,000 IPv4
    keys, ~2,300 IPv6 ones.  5,000 IPv4 addresses added and 3,000 IPv6 ones deleted in one
    sync (a namespace selector now matching a large namespace) went as one message each: the
    encoding raised struct.error, which escaped the programmer's sync.  They are split over
    several messages, each within the 16-bit length, in ONE batch (one transaction), every
    one of them acknowledged before the call returns."""
    v4 = [f"10.{i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(5000)]
    v6 = [f"fd00:10:244::{i:x}" for i in range(3000)]
    ops = [("add", "inet", "agentd-policy", "np-in/x/p/0/pods", ["ipv4_addr"], None, v4),
           ("delete", "inet", "agentd-policy", "np-in/x/p/0/pods6", ["ipv6_addr"], None, v6)]  # fmt: skip
    writer, kernel = _writer(100)
    with kernel, writer.sock.sock:
        kernel.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        kernel.send(b"".join(_ack(seq) for seq in range(101, 105)))
        writer.send(ops)
        data = kernel.recv(1 << 20)
    messages = list(nl.iter_messages(data))
    assert [m[0] for m in (messages[0], messages[-1])] == [nf.NFNL_MSG_BATCH_BEGIN, nf.NFNL_MSG_BATCH_END]
    assert [m[2] for m in messages] == list(range(100, 106))  # one begin, four element messages, one end
    lists = _element_lists(data)
    assert [(t & 0xFF, seq, name) for t, seq, _table, name, _len, _keys in lists] == [
        (nf.NFT_MSG_NEWSETELEM, 101, "np-in/x/p/0/pods"), (nf.NFT_MSG_NEWSETELEM, 102, "np-in/x/p/0/pods"),
        (nf.NFT_MSG_DELSETELEM, 103, "np-in/x/p/0/pods6"), (nf.NFT_MSG_DELSETELEM, 104, "np-in/x/p/0/pods6"),
    ]  # fmt: skip
    assert all(length <= 0xFFFF for *_rest, length, _keys in lists)
    assert [k for *_r, keys in lists[:2] for k in keys] == [socket.inet_aton(a) for a in v4]
    assert [k for *_r, keys in lists[2:] for k in keys] == [socket.inet_pton(socket.AF_INET6, a) for a in v6]
    assert writer.seq == 106
    # One message of a change that needs two is refused as a ValueError (an NftError to the programmer).
    with pytest.raises(ValueError, match="5000 elements of set s need 2 messages"):
        nf.element_message("add", "inet", "t", "s", ["ipv4_addr"], None, v4, 1)
