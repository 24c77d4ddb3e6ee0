"""The ctnetlink messages of agentd.services.conntrack, byte for byte against the uapi layout
(include/uapi/linux/netfilter/nfnetlink.h, nfnetlink_conntrack.h): nlmsghdr, nfgenmsg, nested
tuples with addresses and ports in network byte order."""

from __future__ import annotations

import socket

import pytest

from agentd.kernel import netlink as nl
from agentd.kernel import netlink_ct as codec
from agentd.services import conntrack as ct


def _hex(*parts: str) -> bytes:
    return bytes.fromhex("".join(parts).replace(" ", ""))


ORIG = codec.CtTuple("10.244.1.5", "10.96.0.10", socket.IPPROTO_UDP, 40000, 53)
REPLY = codec.CtTuple("10.244.2.7", "10.244.1.5", socket.IPPROTO_UDP, 5353, 40000)

ORIG_ATTR = (
    "34000180",  # CTA_TUPLE_ORIG | NLA_F_NESTED, 52 bytes
    "14000180",  # CTA_TUPLE_IP | NLA_F_NESTED, 20 bytes
    "08000100 0af40105",  # CTA_IP_V4_SRC 10.244.1.5
    "08000200 0a60000a",  # CTA_IP_V4_DST 10.96.0.10
    "1c000280",  # CTA_TUPLE_PROTO | NLA_F_NESTED, 28 bytes
    "05000100 11 000000",  # CTA_PROTO_NUM 17 (udp)
    "06000200 9c40 0000",  # CTA_PROTO_SRC_PORT 40000, big-endian
    "06000300 0035 0000",  # CTA_PROTO_DST_PORT 53
)


def test_dump_request_bytes():
    assert ct.encode_dump(1) == _hex(
        "14000000 0101 0103 01000000 00000000",  # 20 bytes, CTNETLINK << 8 | CT_GET, REQUEST|DUMP
        "02 00 0000",  # nfgenmsg: AF_INET, NFNETLINK_V0, res_id 0
    )


def test_delete_request_bytes():
    assert ct.encode_delete(9, ORIG) == _hex(
        "48000000 0201 0100 09000000 00000000",  # 72 bytes, CTNETLINK << 8 | CT_DELETE, REQUEST
        "02 00 0000",
        *ORIG_ATTR,
    )


# An IPCTNL_MSG_CT_NEW as a dump answers it: both tuples and attributes that are skipped.
ENTRY = _hex(
    "02 00 0000",  # nfgenmsg
    *ORIG_ATTR,
    "34000280",  # CTA_TUPLE_REPLY | NLA_F_NESTED
    "14000180", "08000100 0af40207", "08000200 0af40105",
    "1c000280", "05000100 11 000000", "06000200 14e9 0000", "06000300 9c40 0000",
    "08000300 00000188",  # CTA_STATUS (be32): skipped
    "08000700 0000001e",  # CTA_TIMEOUT (be32): skipped
)


def test_decode_entry():
    assert ct.decode_entry(ENTRY, 0, len(ENTRY)) == codec.CtEntry(ORIG, REPLY)
    # Round trip: the tuples re-encoded are the bytes they were read from.
    assert codec.encode_tuple(codec.CTA_TUPLE_ORIG, ORIG) == _hex(*ORIG_ATTR)


def test_decode_rejects_malformed_and_skips_other_families():
    with pytest.raises(nl.NetlinkDecodeError):
        ct.decode_entry(ENTRY, 0, 2)
    with pytest.raises(nl.NetlinkDecodeError):
        ct.decode_entry(ENTRY, 0, len(ENTRY) - 1)  # the last attribute cut short
    bad_port = ENTRY.replace(bytes.fromhex("06000200 9c40 0000".replace(" ", "")), bytes.fromhex("05000200 9c 000000"), 1)
    with pytest.raises(nl.NetlinkDecodeError):
        ct.decode_entry(bad_port, 0, len(bad_port))
    other = bytes([socket.AF_BRIDGE]) + ENTRY[1:]
    assert ct.decode_entry(other, 0, len(other)) is None


ORIG6 = ct.CtTuple("fd00:10:244:1::5", "fd00:10:96::a", socket.IPPROTO_UDP, 40000, 53)
REPLY6 = ct.CtTuple("fd00:10:244:2::7", "fd00:10:244:1::5", socket.IPPROTO_UDP, 5353, 40000)
ORIG6_ATTR = (
    "4c000180",  # CTA_TUPLE_ORIG | NLA_F_NESTED, 76 bytes
    "2c000180",  # CTA_TUPLE_IP | NLA_F_NESTED, 44 bytes
    "14000300 fd000010024400010000000000000005",  # CTA_IP_V6_SRC
    "14000400 fd00001000960000000000000000000a",  # CTA_IP_V6_DST
    "1c000280", "05000100 11 000000", "06000200 9c40 0000", "06000300 0035 0000",
)


def test_ipv6_entries_are_dumped_decoded_and_deleted_in_their_family():
    assert ct.encode_dump(1, socket.AF_INET6) == _hex("14000000 0101 0103 01000000 00000000", "0a 00 0000")
    assert ct.encode_delete(9, ORIG6) == _hex("60000000 0201 0100 09000000 00000000", "0a 00 0000", *ORIG6_ATTR)
    entry = _hex("0a 00 0000", *ORIG6_ATTR, "4c000280", "2c000180",
                 "14000300 fd000010024400020000000000000007", "14000400 fd000010024400010000000000000005",
                 "1c000280", "05000100 11 000000", "06000200 14e9 0000", "06000300 9c40 0000")  # fmt: skip
    assert ct.decode_entry(entry, 0, len(entry)) == ct.CtEntry(ORIG6, REPLY6)
    stale = ct.Stale("fd00:10:244:2::7", 5353, "fd00:10:96::a", 53)
    assert ct.entries_to_delete([ct.CtEntry(ORIG6, REPLY6), ct.CtEntry(ORIG, REPLY)], [stale]) == [ct.CtEntry(ORIG6, REPLY6)]


def test_entries_to_delete_match_what_kube_proxy_matches():
    stale = ct.Stale("10.244.2.7", 5353, "10.96.0.10", 53, 30053)
    via_vip = codec.CtEntry(ORIG, REPLY)
    via_node_port = codec.CtEntry(codec.CtTuple("192.0.2.9", "192.0.2.50", 17, 41000, 30053), REPLY._replace(dst="192.0.2.9"))
    other_endpoint = codec.CtEntry(ORIG, REPLY._replace(src="10.244.3.3"))
    tcp = codec.CtEntry(ORIG._replace(proto=socket.IPPROTO_TCP), REPLY._replace(proto=socket.IPPROTO_TCP))
    other_service = codec.CtEntry(ORIG._replace(dst="10.96.0.11"), REPLY)
    entries = [via_vip, via_node_port, other_endpoint, tcp, other_service]
    assert ct.entries_to_delete(entries, [stale], {"192.0.2.50"}) == [via_vip, via_node_port]
    assert ct.entries_to_delete(entries, [], {"192.0.2.50"}) == []
    # A node port is a port on the node's own addresses: an entry to another host's port of
    # that number, even one answered from the endpoint's address and port, is not the Service's.
    assert ct.entries_to_delete(entries, [stale], {"192.0.2.51"}) == [via_vip]


def test_entries_not_going_to_a_usable_endpoint_of_an_unusable_port():
    """An Unusable port: its UDP entries (VIP and port, or node port of its family) whose reply
    source is not a usable endpoint; TCP, other services and the other family's node port stay."""
    port = ct.Unusable("10.96.0.10", 53, 30053, 4, frozenset({("10.244.3.3", 5353)}))
    to_usable = codec.CtEntry(ORIG, REPLY._replace(src="10.244.3.3"))
    to_other = codec.CtEntry(ORIG, REPLY)  # 10.244.2.7: not usable
    untranslated = codec.CtEntry(ORIG, REPLY._replace(src="10.96.0.10", sport=53))
    via_node_port = codec.CtEntry(codec.CtTuple("192.0.2.9", "192.0.2.50", 17, 41000, 30053), REPLY._replace(dst="192.0.2.9"))
    node_port6 = ct.CtEntry(ORIG6._replace(dport=30053), REPLY6)
    tcp = codec.CtEntry(ORIG._replace(proto=socket.IPPROTO_TCP), REPLY._replace(proto=socket.IPPROTO_TCP))
    other_service = codec.CtEntry(ORIG._replace(dst="10.96.0.11"), REPLY)
    entries = [to_usable, to_other, untranslated, via_node_port, node_port6, tcp, other_service]
    assert ct.entries_to_delete(entries, [port], {"192.0.2.50"}) == [to_other, untranslated, via_node_port]
    assert port.af == socket.AF_INET and ct.Unusable(None, 53, 30053, 6).af == socket.AF_INET6


def test_a_node_ports_entries_are_those_to_the_nodes_own_addresses():
    """The review's case: a pod's UDP flow to an external host's port 30053 (another cluster's
    node port) is not this node's node port 30053, though no endpoint answers it: it stays.
    An entry to one of the node's addresses at that port, translated or not yet, goes."""
    u = ct.Unusable(None, 53, 30053, 4, frozenset({("10.244.1.5", 53)}))
    external = codec.CtEntry(codec.CtTuple("10.244.1.9", "203.0.113.7", 17, 41000, 30053),
                             codec.CtTuple("203.0.113.7", "192.168.0.1", 17, 30053, 41000))  # fmt: skip
    mine = codec.CtEntry(codec.CtTuple("10.244.1.9", "192.168.0.1", 17, 41001, 30053),
                         codec.CtTuple("192.168.0.1", "10.244.1.9", 17, 30053, 41001))  # fmt: skip
    assert ct.entries_to_delete([external, mine], [u], {"192.168.0.1"}) == [mine]
    gone = ct.Stale("203.0.113.7", 30053, None, 53, 30053)  # an endpoint at that address and port
    assert ct.entries_to_delete([external], [gone], {"192.168.0.1"}) == []
    assert ct.entries_to_delete([external._replace(orig=external.orig._replace(dst="192.168.0.1"))], [gone], {"192.168.0.1"})
