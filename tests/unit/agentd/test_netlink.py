"""agentd.kernel.netlink: rtnetlink encode/decode, pure (no sockets), plus the Route model it feeds.

The golden messages were captured from a Linux 6.18 kernel (RTM_GETROUTE dumps of routes
made with `ip route add ... proto 143` in a lab namespace, and one error ack).
"""

import socket
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentd.kernel import netlink as nl
from agentd.kernel.route_model import InvalidRoute, Route, canonical_dst

# 10.9.0.0/16 via 198.51.100.1 dev v0 (ifindex 2) onlink src 192.0.2.1 proto 143
GOLDEN_V4_ONLINK = (
    "440000001800220001000000645f000002100000fe8f00010400000008000f00fe000000080001000a090000"
    "08000700c000020108000500c63364010800040002000000"
)
# blackhole 10.244.0.0/24 proto 143
GOLDEN_V4_BLACKHOLE = "2c0000001800220001000000645f000002180000fe8f00060000000008000f00fe000000080001000af40000"
# 10.244.1.0/24 via 192.0.2.2 dev v0 proto 143 metric 20 mtu 1400
GOLDEN_V4_METRIC_MTU = (
    "500000001800220001000000645f000002180000fe8f00010000000008000f00fe000000080001000af40100"
    "08000600140000000c000800080002007805000008000500c00002020800040002000000"
)
# 2001:db8:5::/64 via 2001:db8::2 dev v0 proto 143 metric 1024 (with RTA_CACHEINFO and RTA_PREF)
GOLDEN_V6 = (
    "880000001800220001000000645f00000a400000fe8f00010000000008000f00fe0000001400010020010db8"
    "00050000000000000000000008000600000400001400050020010db800000000000000000000000208000400"
    "0200000024000c000000000000000000000000000000000000000000000000000000000000000000050014"
    "0000000000"
)
# NLMSG_ERROR answering seq 5: ENETUNREACH, capped, with the kernel's message as a TLV
GOLDEN_ERROR = (
    "440000000200000305000000645f00009bffffff3400000018000506050000000000000020000100"
    "4e657874686f702068617320696e76616c6964206761746577617900"
)


def one_message(hexdata: str):
    data = bytes.fromhex(hexdata)
    messages = list(nl.iter_messages(data))
    assert len(messages) == 1
    return data, messages[0]


# --- golden kernel messages ---------------------------------------------------------------


def test_golden_onlink_route_with_prefsrc():
    data, (mtype, flags, seq, pid, start, end) = one_message(GOLDEN_V4_ONLINK)
    assert (mtype, flags, seq) == (nl.RTM_NEWROUTE, nl.NLM_F_MULTI | nl.NLM_F_DUMP_FILTERED, 1)
    msg = nl.decode_route(data, start, end)
    assert (msg.family, msg.dst_len, msg.table, msg.protocol) == (socket.AF_INET, 16, 254, 143)
    assert (msg.scope, msg.type, msg.flags) == (nl.RT_SCOPE_UNIVERSE, nl.RTN_UNICAST, nl.RTNH_F_ONLINK)
    assert msg.dst == socket.inet_aton("10.9.0.0")
    assert msg.gateway == socket.inet_aton("198.51.100.1")
    assert msg.prefsrc == socket.inet_aton("192.0.2.1")
    assert (msg.oif, msg.priority, msg.mtu) == (2, None, None)


def test_golden_blackhole_route():
    data, (_t, _f, _s, _p, start, end) = one_message(GOLDEN_V4_BLACKHOLE)
    msg = nl.decode_route(data, start, end)
    assert (msg.type, msg.dst, msg.dst_len, msg.gateway, msg.oif) == (
        nl.RTN_BLACKHOLE, socket.inet_aton("10.244.0.0"), 24, None, 0)


def test_golden_route_with_metric_and_mtu():
    data, (_t, _f, _s, _p, start, end) = one_message(GOLDEN_V4_METRIC_MTU)
    msg = nl.decode_route(data, start, end)
    assert (msg.priority, msg.mtu, msg.gateway) == (20, 1400, socket.inet_aton("192.0.2.2"))


def test_golden_ipv6_route_ignores_cacheinfo_and_pref():
    data, (_t, _f, _s, _p, start, end) = one_message(GOLDEN_V6)
    msg = nl.decode_route(data, start, end)
    assert msg.family == socket.AF_INET6
    assert msg.dst == socket.inet_pton(socket.AF_INET6, "2001:db8:5::")
    assert msg.gateway == socket.inet_pton(socket.AF_INET6, "2001:db8::2")
    assert (msg.dst_len, msg.priority, msg.oif, msg.protocol) == (64, 1024, 2, 143)


def test_golden_error_ack_carries_errno_seq_and_kernel_message():
    data, (mtype, flags, seq, _p, start, end) = one_message(GOLDEN_ERROR)
    assert (mtype, seq) == (nl.NLMSG_ERROR, 5)
    assert flags & nl.NLM_F_CAPPED and flags & nl.NLM_F_ACK_TLVS
    assert nl.decode_error(data, start, end, flags) == (101, "Nexthop has invalid gateway")
    assert nl.describe_error(101, "Nexthop has invalid gateway") == (
        "ENETUNREACH: Network is unreachable (Nexthop has invalid gateway)")


def test_our_encoding_of_a_golden_route_is_what_the_kernel_dumps():
    """Same attributes, same order as the kernel's own dump: the layout is the kernel's."""
    data, _ = one_message(GOLDEN_V4_METRIC_MTU)
    ours = nl.encode_newroute(
        1, nl.NLM_F_MULTI | nl.NLM_F_DUMP_FILTERED, socket.AF_INET, socket.inet_aton("10.244.1.0"), 24,
        table=254, protocol=143, gateway=socket.inet_aton("192.0.2.2"), oif=2, priority=20, mtu=1400,
    )
    assert nl.decode_route(ours, 16) == nl.decode_route(data, 16)
    assert struct.unpack_from("=IHHI", ours) == struct.unpack_from("=IHHI", data)


# --- encoders -------------------------------------------------------------------------------


def test_newroute_round_trip_ipv6_all_attributes():
    wire = nl.encode_newroute(
        77, nl.NLM_F_REQUEST | nl.NLM_F_CREATE | nl.NLM_F_EXCL, socket.AF_INET6,
        socket.inet_pton(socket.AF_INET6, "2001:db8:1::"), 48,
        table=1000, protocol=143, rtype=nl.RTN_UNICAST, rtm_flags=nl.RTNH_F_ONLINK,
        gateway=socket.inet_pton(socket.AF_INET6, "fe80::1"), oif=7, priority=300,
        prefsrc=socket.inet_pton(socket.AF_INET6, "2001:db8::1"), mtu=1280,
    )
    [(mtype, flags, seq, pid, start, end)] = nl.iter_messages(wire)
    assert (mtype, flags, seq, pid, end) == (
        nl.RTM_NEWROUTE, nl.NLM_F_REQUEST | nl.NLM_F_CREATE | nl.NLM_F_EXCL, 77, 0, len(wire))
    msg = nl.decode_route(wire, start, end)
    assert msg == nl.RouteMessage(
        family=socket.AF_INET6, dst_len=48, table=1000, protocol=143, scope=0, type=nl.RTN_UNICAST,
        flags=nl.RTNH_F_ONLINK, dst=socket.inet_pton(socket.AF_INET6, "2001:db8:1::"),
        gateway=socket.inet_pton(socket.AF_INET6, "fe80::1"), oif=7, priority=300,
        prefsrc=socket.inet_pton(socket.AF_INET6, "2001:db8::1"), mtu=1280,
    )
    assert wire[16 + 4] == nl.RT_TABLE_UNSPEC  # tables above 255 live only in RTA_TABLE


def test_delroute_names_protocol_and_any_scope():
    wire = nl.encode_delroute(9, nl.NLM_F_REQUEST, socket.AF_INET, socket.inet_aton("10.1.0.0"), 16,
                              table=254, protocol=143)
    msg = nl.decode_route(wire, 16)
    assert (msg.protocol, msg.scope, msg.type, msg.table, msg.dst_len) == (143, nl.RT_SCOPE_NOWHERE, nl.RTN_UNSPEC, 254, 16)
    assert struct.unpack_from("=HH", wire, 4) == (nl.RTM_DELROUTE, nl.NLM_F_REQUEST)


def test_default_route_has_no_dst_attribute():
    wire = nl.encode_newroute(1, nl.NLM_F_REQUEST, socket.AF_INET, b"", 0, rtype=nl.RTN_BLACKHOLE)
    assert nl.RTA_DST not in [t for t, _s, _e in nl.iter_attrs(wire, 28, len(wire))]
    assert nl.decode_route(wire, 16).dst == b""


def test_template_encoding_equals_direct_encoding():
    template = nl.route_template(socket.AF_INET, table=254, protocol=143, gateway=socket.inet_aton("192.0.2.2"))
    direct = nl.encode_newroute(3, 1, socket.AF_INET, socket.inet_aton("10.0.0.1"), 32, table=254, protocol=143,
                                gateway=socket.inet_aton("192.0.2.2"))
    assert nl.encode_route(nl.RTM_NEWROUTE, 3, 1, socket.inet_aton("10.0.0.1"), 32, template) == direct


def test_getroute_dump_request_filters_table_and_protocol():
    wire = nl.encode_getroute_dump(4, socket.AF_INET6, table=254, protocol=143)
    [(mtype, flags, seq, _pid, start, end)] = nl.iter_messages(wire)
    assert (mtype, flags, seq) == (nl.RTM_GETROUTE, nl.NLM_F_REQUEST | nl.NLM_F_DUMP, 4)
    msg = nl.decode_route(wire, start, end)
    assert (msg.family, msg.table, msg.protocol, msg.dst_len) == (socket.AF_INET6, 254, 143, 0)


def test_with_flags_sets_ack_and_keeps_the_rest():
    wire = nl.encode_delroute(9, nl.NLM_F_REQUEST, socket.AF_INET, socket.inet_aton("10.1.0.0"), 16)
    acked = nl.with_flags(wire, nl.NLM_F_ACK)
    assert struct.unpack_from("=H", acked, 6)[0] == nl.NLM_F_REQUEST | nl.NLM_F_ACK
    assert acked[:6] == wire[:6] and acked[8:] == wire[8:]


def test_iter_messages_walks_a_batch_in_order():
    batch = b"".join(
        nl.encode_delroute(seq, nl.NLM_F_REQUEST, socket.AF_INET, bytes([10, 0, 0, seq]), 32) for seq in range(1, 6))
    seqs = [seq for _t, _f, seq, _p, _s, _e in nl.iter_messages(batch)]
    assert seqs == [1, 2, 3, 4, 5]


def test_link_decode():
    name = nl.attr(nl.IFLA_IFNAME, b"vxlan.calico\0")
    info = nl.attr(nl.IFLA_LINKINFO, nl.attr(nl.IFLA_INFO_KIND, b"vxlan\0"))
    body = struct.pack("=BxHiII", 0, 1, 12, nl.IFF_UP, 0) + name + nl.attr_u32(nl.IFLA_MTU, 1450) + info
    link = nl.decode_link(body)
    assert link == nl.LinkMessage(12, "vxlan.calico", nl.IFF_UP, 1450, None, "vxlan", None)
    assert link.up
    dump = nl.encode_getlink_dump(8)
    assert struct.unpack_from("=IHHI", dump) == (32, nl.RTM_GETLINK, nl.NLM_F_REQUEST | nl.NLM_F_DUMP, 8)


def test_a_veths_other_end_is_read_from_its_link_attributes():
    """A veth whose other end is in a pod's namespace names it by index (IFLA_LINK) and by
    the id this namespace has for that one (IFLA_LINK_NETNSID, signed: -1 is none); a
    request for it carries that id (IFLA_TARGET_NETNSID)."""
    from agentd.kernel import netlink_links as links

    info = nl.attr(nl.IFLA_LINKINFO, nl.attr(nl.IFLA_INFO_KIND, b"veth\0"))
    body = (struct.pack("=BxHiII", 0, 1, 7, 0, 0) + nl.attr(nl.IFLA_IFNAME, b"veth1234\0") + nl.attr_u32(nl.IFLA_LINK, 2)
            + nl.attr(nl.IFLA_LINK_NETNSID, struct.pack("=i", 3)) + info)  # fmt: skip
    link = nl.decode_link(body)
    assert (link.kind, link.link, link.link_netnsid) == ("veth", 2, 3)
    same = nl.decode_link(struct.pack("=BxHiII", 0, 1, 7, 0, 0) + nl.attr(nl.IFLA_LINK_NETNSID, struct.pack("=i", -1)))
    assert (same.link, same.link_netnsid) == (None, -1)
    request = links.encode_getlink(5, index=2, netnsid=3)
    attrs = {t: request[s:e] for t, s, e in nl.iter_attrs(request, 16 + 16, len(request))}
    assert struct.unpack_from("=i", request, 16 + 4)[0] == 2 and attrs == {nl.IFLA_TARGET_NETNSID: struct.pack("=i", 3)}
    assert links.encode_getlink(5, index=2) == links.encode_getlink(5, index=2, netnsid=None)


def test_fdb_entry_round_trip():
    entry = nl.NeighMessage(nl.AF_BRIDGE, 5, nl.NUD_PERMANENT, nl.NTF_SELF,
                            dst=socket.inet_aton("192.0.2.7"), lladdr=bytes.fromhex("02005e000001"))
    wire = nl.encode_newneigh(3, nl.NLM_F_REQUEST | nl.NLM_F_CREATE | nl.NLM_F_APPEND, entry)
    [(mtype, _f, seq, _p, start, end)] = nl.iter_messages(wire)
    assert (mtype, seq) == (nl.RTM_NEWNEIGH, 3)
    assert nl.decode_neigh(wire, start, end) == entry


def test_ipv6_neighbour_round_trip():
    neigh = nl.NeighMessage(socket.AF_INET6, 2, nl.NUD_PERMANENT, 0,
                            dst=socket.inet_pton(socket.AF_INET6, "fe80::2"), lladdr=bytes(6))
    wire = nl.encode_delneigh(4, nl.NLM_F_REQUEST, neigh)
    assert nl.decode_neigh(wire, 16) == neigh


def test_plain_ack_decodes_to_errno_zero():
    ack = struct.pack("=IHHII", 36, nl.NLMSG_ERROR, nl.NLM_F_CAPPED, 9, 0) + struct.pack("=i", 0) + bytes(16)
    [(_t, flags, seq, _p, start, end)] = nl.iter_messages(ack)
    assert nl.decode_error(ack, start, end, flags) == (0, None)


def test_uncapped_error_ack_finds_tlvs_after_the_echoed_request():
    request = nl.encode_delroute(9, nl.NLM_F_REQUEST, socket.AF_INET, socket.inet_aton("10.1.0.0"), 16)
    tlv = nl.attr(nl.NLMSGERR_ATTR_MSG, b"No such process\0")
    body = struct.pack("=i", -3) + request + tlv
    wire = struct.pack("=IHHII", 16 + len(body), nl.NLMSG_ERROR, nl.NLM_F_ACK_TLVS, 9, 0) + body
    [(_t, flags, _s, _p, start, end)] = nl.iter_messages(wire)
    assert nl.decode_error(wire, start, end, flags) == (3, "No such process")


# --- malformed input: one error type, never anything else -----------------------------------


@pytest.mark.parametrize(
    "data, what",
    [
        (b"\x10\x00\x00", "truncated netlink header"),
        (struct.pack("=IHHII", 8, 24, 0, 0, 0), "does not fit"),  # shorter than its own header
        (struct.pack("=IHHII", 64, 24, 0, 0, 0), "does not fit"),  # longer than the buffer
    ],
)
def test_bad_framing_raises_decode_error(data, what):
    with pytest.raises(nl.NetlinkDecodeError, match=what):
        list(nl.iter_messages(data))


def test_truncated_golden_route_raises_decode_error():
    data = bytes.fromhex(GOLDEN_V4_METRIC_MTU)
    body = data[16:]
    # Where a cut leaves whole attributes (rtmsg is 12 octets; each attribute is its length,
    # padded to 4) and less than an attribute header after them (the kernel's nla_ok() ignores
    # such a tail too), the rest parses, and is what the whole route has up to that point.
    ends, off = {}, 12
    while off < len(body):
        for end in range(off, off + 4):
            ends[end] = off
        off += (struct.unpack_from("=H", body, off)[0] + 3) & ~3
    assert len(ends) >= 12
    errors = 0
    for cut in range(1, len(body)):
        if cut not in ends:
            with pytest.raises(nl.NetlinkDecodeError):
                nl.decode_route(body[:cut])
            errors += 1
        else:
            assert nl.decode_route(body[:cut]) == nl.decode_route(body[: ends[cut]])
    assert errors > len(body) // 2  # most cuts fall inside an attribute: a clean error each


@pytest.mark.parametrize(
    "attr, what",
    [
        (nl.attr(nl.RTA_DST, b"\x0a\x00\x00"), "needs 4"),  # IPv4 address of 3 bytes
        (nl.attr(nl.RTA_GATEWAY, bytes(16)), "needs 4"),  # IPv6-sized gateway on an IPv4 route
        (nl.attr(nl.RTA_OIF, b"\x01\x00"), "4 bytes"),
        (nl.attr(nl.RTA_PREFSRC, bytes(5)), "needs 4"),
        (nl.attr(nl.RTA_METRICS, nl.attr(nl.RTAX_MTU, b"\x01")), "4 bytes"),
        (struct.pack("=HH", 200, nl.RTA_DST) + bytes(4), "does not fit"),
        (struct.pack("=HH", 2, nl.RTA_DST) + bytes(4), "does not fit"),
    ],
)
def test_bad_route_attribute_raises_decode_error(attr, what):
    body = struct.pack("=BBBBBBBBI", socket.AF_INET, 24, 0, 0, 254, 143, 0, 1, 0) + attr
    with pytest.raises(nl.NetlinkDecodeError, match=what):
        nl.decode_route(body)


def test_short_bodies_raise_decode_error():
    for decode in (nl.decode_route, nl.decode_link, nl.decode_neigh):
        with pytest.raises(nl.NetlinkDecodeError):
            decode(b"\x02\x18\x00")
    with pytest.raises(nl.NetlinkDecodeError):
        nl.decode_error(b"\x00" * 10, 0, 10)
    with pytest.raises(nl.NetlinkDecodeError, match="too long"):
        nl.decode_route(struct.pack("=BBBBBBBBI", socket.AF_INET, 33, 0, 0, 254, 143, 0, 1, 0))
    with pytest.raises(nl.NetlinkDecodeError):
        nl.with_flags(b"\x00" * 8, nl.NLM_F_ACK)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_decode_error(data):
    for parse in (
        lambda: list(nl.iter_messages(data)),
        lambda: nl.decode_route(data),
        lambda: nl.decode_link(data),
        lambda: nl.decode_neigh(data),
        lambda: nl.decode_error(data, 0, len(data), nl.NLM_F_ACK_TLVS),
    ):
        try:
            parse()
        except nl.NetlinkDecodeError:
            pass


@settings(max_examples=300, deadline=None)
@given(
    family=st.sampled_from([socket.AF_INET, socket.AF_INET6]),
    dst_len=st.integers(0, 32),
    priority=st.none() | st.integers(0, 2**32 - 1),
    mtu=st.none() | st.integers(1, 2**32 - 1),
    oif=st.integers(0, 2**31 - 1),
    table=st.integers(1, 2**32 - 1),
    seq=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_newroute_round_trips(family, dst_len, priority, mtu, oif, table, seq, data):
    size = 4 if family == socket.AF_INET else 16
    dst = data.draw(st.binary(min_size=size, max_size=size)) if dst_len else b""
    gateway = data.draw(st.none() | st.binary(min_size=size, max_size=size))
    wire = nl.encode_newroute(seq, nl.NLM_F_REQUEST, family, dst, dst_len, table=table, protocol=143,
                              gateway=gateway, oif=oif, priority=priority, mtu=mtu)
    [(_t, _f, got_seq, _p, start, end)] = nl.iter_messages(wire)
    msg = nl.decode_route(wire, start, end)
    assert got_seq == seq
    assert (msg.family, msg.dst_len, msg.dst, msg.gateway, msg.oif, msg.priority, msg.mtu, msg.table) == (
        family, dst_len, dst, gateway, oif, priority, mtu, table)


# --- the Route model (agentd.kernel.routing) ----------------------------------------------------------


def test_route_canonicalises_addresses_and_defaults():
    route = Route("2001:DB8:0:0::/64", gateway="2001:db8:0::2", metric=1024)
    assert (route.dst, route.gateway, route.metric) == ("2001:db8::/64", "2001:db8::2", None)
    assert Route("10.0.0.1", dev="v0").dst == "10.0.0.1/32"
    assert Route("10.1.0.0/16", gateway="192.0.2.1", metric=0) == Route("10.1.0.0/16", gateway="192.0.2.1")
    assert Route("10.1.0.0/16", dev="v0", mtu=0).mtu is None
    assert canonical_dst("2001:db8::0/128") == "2001:db8::/128"
    assert Route("10.1.0.0/16", gateway="192.0.2.1").family == socket.AF_INET


@pytest.mark.parametrize(
    "kwargs, what",
    [
        (dict(dst="10.1.2.3/24", gateway="192.0.2.1"), "host bits"),
        (dict(dst="10.1.0.0/33", gateway="192.0.2.1"), "prefix length"),
        (dict(dst="10.1.0.0/x", gateway="192.0.2.1"), "prefix length"),
        (dict(dst="banana", gateway="192.0.2.1"), "not an IP prefix"),
        (dict(dst=None, gateway="192.0.2.1"), "must be a string"),
        (dict(dst="10.1.0.0/16", gateway="2001:db8::1"), "family"),
        (dict(dst="10.1.0.0/16", gateway="192.0.2.256"), "not an IP address"),
        (dict(dst="10.1.0.0/16"), "needs a gateway or a dev"),
        (dict(dst="10.1.0.0/16", gateway="192.0.2.1", onlink=True), "needs both"),
        (dict(dst="10.1.0.0/16", kind="blackhole", gateway="192.0.2.1"), "takes no gateway"),
        (dict(dst="10.1.0.0/16", kind="prohibit"), "kind"),
        (dict(dst="10.1.0.0/16", dev="a-very-long-interface-name"), "1-15"),
        (dict(dst="10.1.0.0/16", dev="v0", metric=-1), "metric"),
        (dict(dst="10.1.0.0/16", dev="v0", metric=True), "metric"),
        (dict(dst="10.1.0.0/16", dev="v0", mtu="1500"), "mtu"),
        (dict(dst="10.1.0.0/16", dev="v0", onlink=1), "bool"),
        (dict(dst="10.1.0.0/16", dev="v0", src="2001:db8::1"), "family"),
        ({"dst": "2001:db8:1::/64", "gateway": "fe80::2"}, "link-local fe80::2 needs a dev"),
        ({"dst": "2001:db8:1::/64", "gateway": "FEBF::2"}, "link-local febf::2 needs a dev"),
    ],
)
def test_bad_routes_raise_one_clear_error(kwargs, what):
    with pytest.raises(InvalidRoute, match=what):
        Route(**kwargs)


def test_vxlan_backend_peer_entries_are_a_permanent_neighbour_and_a_self_fdb_entry():
    """What agentd.dataplane.backends programs per VXLAN peer (tests/system/test_encap.py
    checks them in the kernel with ``ip neigh`` and ``bridge fdb``)."""
    from agentd.dataplane.backends import vxlan_peer_entries

    neighbour, fdb = vxlan_peer_entries(7, ("10.244.3.0",), "02:00:5e:00:00:01", "192.0.2.3")
    mac = bytes.fromhex("02005e000001")
    assert neighbour == nl.NeighMessage(socket.AF_INET, 7, nl.NUD_PERMANENT, 0, 0, socket.inet_aton("10.244.3.0"), mac)
    assert fdb == nl.NeighMessage(nl.AF_BRIDGE, 7, nl.NUD_PERMANENT, nl.NTF_SELF, 0, socket.inet_aton("192.0.2.3"), mac)
    # A dual-stack peer: an NDP entry for its IPv6 VTEP address too; an IPv6 underlay: the FDB
    # entry's remote is the peer's IPv6 address.
    v4, v6, fdb6 = vxlan_peer_entries(7, ("10.244.3.0", "fd00:10:244:3::"), "02:00:5e:00:00:01", "2001:db8::3")
    assert v4 == neighbour
    assert v6 == nl.NeighMessage(socket.AF_INET6, 7, nl.NUD_PERMANENT, 0, 0,
                                 socket.inet_pton(socket.AF_INET6, "fd00:10:244:3::"), mac)
    assert fdb6.dst == socket.inet_pton(socket.AF_INET6, "2001:db8::3") and fdb6.family == nl.AF_BRIDGE
    for entry in (neighbour, fdb, v6, fdb6):
        wire = nl.encode_newneigh(9, nl.NLM_F_REQUEST | nl.NLM_F_ACK | nl.NLM_F_CREATE | nl.NLM_F_REPLACE, entry)
        [(mtype, flags, seq, _p, start, end)] = nl.iter_messages(wire)
        assert (mtype, seq) == (nl.RTM_NEWNEIGH, 9) and flags & nl.NLM_F_REPLACE
        assert nl.decode_neigh(wire, start, end) == entry
