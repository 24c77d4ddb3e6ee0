"""agentd.kernel.netlink_links and netlink_tc: device, address and tc messages, pure.

Expected requests are written out byte by byte from the uapi layouts (include/uapi/linux/
netlink.h, rtnetlink.h, if_link.h, if_addr.h, pkt_sched.h, pkt_cls.h; little-endian host);
the decoded answers are goldens captured from a Linux 6.18 kernel in a lab namespace
(``ip link add agentd.vxlan type vxlan id 1 local 192.0.2.1 dev d0 dstport 8472 nolearning``,
``ip addr add 192.0.2.1/24 dev d0``).
"""

import errno
import socket

import pytest

from agentd.kernel import netlink as nl
from agentd.kernel import netlink_links as links
from agentd.kernel import netlink_tc as tcm

# IFLA_INFO_DATA of that vxlan device as the kernel dumps it (every IFLA_VXLAN_* it knows)
GOLDEN_VXLAN_INFO_DATA = (
    "0800010001000000080003000300000008000400c0000201050005000000000005001c000000000005000600"
    "0000000005001d000000000008001a00000000000800200000000000050007000000000005000b0000000000"
    "05000c000000000005000d000000000005000e00000000000500190000000000080008002c01000008000900"
    "0000000006000f00211800000500120001000000050013000000000005001400000000000500150000000000"
    "050016000000000005001f000100000008000a00000000000c002100f7ffffff000000ff"
)
# RTM_NEWADDR of 192.0.2.1/24 on device 3, from an RTM_GETADDR dump (with IFA_LABEL, IFA_FLAGS, IFA_CACHEINFO)
GOLDEN_NEWADDR = (
    "4c0000001400220003000000a14c0000021880000300000008000100c000020108000200c000020107000300"
    "64300000080008008000000014000600ffffffffffffffff5363270053632700"
)


def _hex(*parts: str) -> bytes:
    return bytes.fromhex("".join(p.replace(" ", "") for p in parts))


def test_newlink_vxlan_bytes():
    wire = links.encode_newlink_vxlan(
        7, "agentd.vxlan", links.Vxlan(vni=1, port=8472, local=socket.inet_aton("192.0.2.1"), link=2))
    assert wire == _hex(
        "70000000 1000 0106 07000000 00000000",  # nlmsghdr: 112 bytes, RTM_NEWLINK, REQUEST|EXCL|CREATE, seq 7
        "00 00 0000 00000000 00000000 00000000",  # ifinfomsg: AF_UNSPEC, no index, flags or change
        "11000300 6167656e74642e76786c616e00 000000",  # IFLA_IFNAME "agentd.vxlan"
        "3c001200",  # IFLA_LINKINFO, 60 bytes
        "09000100 7678 6c61 6e 000000",  # IFLA_INFO_KIND "vxlan"
        "2c000200",  # IFLA_INFO_DATA, 44 bytes
        "08000100 01000000",  # IFLA_VXLAN_ID 1
        "08000300 02000000",  # IFLA_VXLAN_LINK 2
        "08000400 c0000201",  # IFLA_VXLAN_LOCAL 192.0.2.1
        "05000700 00 000000",  # IFLA_VXLAN_LEARNING 0
        "06000f00 2118 0000",  # IFLA_VXLAN_PORT 8472, network order
    )


def test_vxlan_info_data_from_the_kernel():
    got = links.decode_vxlan(bytes.fromhex(GOLDEN_VXLAN_INFO_DATA))
    assert got == links.Vxlan(vni=1, port=8472, local=socket.inet_aton("192.0.2.1"), link=3, learning=False)


def test_vxlan_info_data_round_trip():
    v = links.Vxlan(vni=0xFFFFFF, port=4789, local=socket.inet_aton("10.0.0.9"), link=0, learning=True)
    assert links.decode_vxlan(links.vxlan_info_data(v)) == v


@pytest.mark.parametrize("bad", [
    "05000f00 21 000000",  # IFLA_VXLAN_PORT of 1 byte
    "06000700 0000 0000",  # IFLA_VXLAN_LEARNING of 2 bytes
    "07000400 c00002 00",  # IFLA_VXLAN_LOCAL of 3 bytes
    "0c000100 0100",  # length past the end
])
def test_vxlan_info_data_malformed(bad):
    with pytest.raises(nl.NetlinkDecodeError):
        links.decode_vxlan(_hex(bad))


def test_link_decode_keeps_info_data():
    info = nl.attr(nl.IFLA_INFO_KIND, b"vxlan\0") + nl.attr(nl.IFLA_INFO_DATA, bytes.fromhex(GOLDEN_VXLAN_INFO_DATA))
    body = _hex("00 00 0100 04000000 02100000 00000000") + nl.attr(nl.IFLA_LINKINFO, info)
    link = nl.decode_link(body)
    assert (link.index, link.kind, link.info_data) == (4, "vxlan", bytes.fromhex(GOLDEN_VXLAN_INFO_DATA))


def test_setlink_bytes():
    assert links.encode_setlink(9, 5, mtu=1450, up=True) == _hex(
        "28000000 1000 0100 09000000 00000000",  # 40 bytes, RTM_NEWLINK, REQUEST
        "00 00 0000 05000000 01000000 01000000",  # index 5, flags IFF_UP, change IFF_UP
        "08000400 aa050000",  # IFLA_MTU 1450
    )
    # MTU only: the flags are left alone (change 0)
    assert links.encode_setlink(1, 5, mtu=1400)[16:32] == _hex("00 00 0000 05000000 00000000 00000000")
    assert links.encode_setlink(1, 5, up=False)[16:32] == _hex("00 00 0000 05000000 00000000 01000000")


def test_dellink_and_getlink_bytes():
    assert links.encode_dellink(2, 7) == _hex("20000000 1100 0100 02000000 00000000",
                                              "00 00 0000 07000000 00000000 00000000")
    assert links.encode_getlink(3, name="d0") == _hex(
        "28000000 1200 0100 03000000 00000000",
        "00 00 0000 00000000 00000000 00000000",
        "07000300 643000 00",  # IFLA_IFNAME "d0"
    )


def test_addr_bytes():
    assert links.encode_addr(nl.RTM_NEWADDR, 3, 5, socket.inet_aton("10.244.1.0"), 32) == _hex(
        "28000000 1400 0106 03000000 00000000",  # RTM_NEWADDR, REQUEST|EXCL|CREATE
        "02 20 00 00 05000000",  # ifaddrmsg: AF_INET /32, device 5
        "08000200 0af40100",  # IFA_LOCAL
        "08000100 0af40100",  # IFA_ADDRESS
    )
    assert links.encode_addr(nl.RTM_DELADDR, 4, 5, socket.inet_aton("10.244.1.0"), 32)[4:8] == _hex("1500 0100")
    assert links.encode_getaddr_dump(6, nl.AF_INET, 5) == _hex("18000000 1600 0103 06000000 00000000",
                                                               "02 00 00 00 05000000")


def test_newlink_dummy_bytes():
    # ip link add agentd-dns type dummy
    assert links.encode_newlink(7, "agentd-dns", "dummy") == _hex(
        "40000000 1000 0106 07000000 00000000",  # 64 bytes, RTM_NEWLINK, REQUEST|EXCL|CREATE
        "00 00 0000 00000000 00000000 00000000",  # ifinfomsg: AF_UNSPEC, no index
        "0f000300 6167656e74642d646e7300 00",  # IFLA_IFNAME "agentd-dns"
        "10001200",  # IFLA_LINKINFO, 16 bytes
        "09000100 64756d6d79 000000",  # IFLA_INFO_KIND "dummy" (no NUL, as iproute2 sends it)
    )


def test_addr_with_label_bytes():
    # ip addr add 169.254.20.10/32 dev lo label lo:agentd
    wire = links.encode_addr(nl.RTM_NEWADDR, 3, 1, socket.inet_aton("169.254.20.10"), 32, "lo:agentd")
    assert wire == _hex(
        "38000000 1400 0106 03000000 00000000",  # 56 bytes
        "02 20 00 00 01000000",  # ifaddrmsg: AF_INET /32, device 1 (lo)
        "08000200 a9fe140a",  # IFA_LOCAL
        "08000100 a9fe140a",  # IFA_ADDRESS
        "0e000300 6c6f3a6167656e746400 0000",  # IFA_LABEL "lo:agentd"
    )
    [(_t, _f, _s, _p, start, end)] = nl.iter_messages(wire)
    ip = socket.inet_aton("169.254.20.10")
    assert links.decode_addr(wire, start, end) == links.AddrMessage(nl.AF_INET, 32, 1, ip, ip, "lo:agentd")


def test_addr_decode_from_the_kernel():
    wire = bytes.fromhex(GOLDEN_NEWADDR)
    [(mtype, _f, _seq, _p, start, end)] = nl.iter_messages(wire)
    assert mtype == nl.RTM_NEWADDR
    ip = socket.inet_aton("192.0.2.1")
    assert links.decode_addr(wire, start, end) == links.AddrMessage(nl.AF_INET, 24, 3, ip, ip, "d0",
                                                                    links.IFA_F_PERMANENT)  # IFA_FLAGS
    with pytest.raises(nl.NetlinkDecodeError):
        links.decode_addr(wire, start, start + 6)


def test_getroute_bytes():
    assert nl.encode_getroute(5, nl.AF_INET, socket.inet_aton("192.0.2.5")) == _hex(
        "24000000 1a00 0100 05000000 00000000",  # RTM_GETROUTE, REQUEST (no dump)
        "02 20 00 00 00 00 00 00 00000000",  # rtmsg: AF_INET, dst_len 32, nothing else
        "08000100 c0000205",  # RTA_DST
    )


def test_fdb_dump_and_master():
    assert nl.encode_getneigh_dump(2, nl.AF_BRIDGE) == _hex("1c000000 1e00 0103 02000000 00000000",
                                                            "07 000000 00000000 0000 00 00")
    learned = _hex("07 000000 05000000 0200 00 00",  # AF_BRIDGE, port 5, NUD_REACHABLE
                   "0a000200 02005e000001 0000",  # NDA_LLADDR
                   "08000900 04000000")  # NDA_MASTER: bridge 4
    entry = nl.decode_neigh(learned)
    assert (entry.ifindex, entry.lladdr, entry.master) == (5, bytes.fromhex("02005e000001"), 4)


def test_clsact_bytes():
    assert tcm.encode_add_clsact(1, 4) == _hex(
        "30000000 2400 0106 01000000 00000000",  # RTM_NEWQDISC, REQUEST|EXCL|CREATE
        "00 000000 04000000 0000ffff f1ffffff 00000000",  # tcmsg: device 4, handle ffff:, parent clsact
        "0b000100 636c736163740000",  # TCA_KIND "clsact"
    )
    assert tcm.encode_del_clsact(2, 4) == _hex("24000000 2500 0100 02000000 00000000",
                                               "00 000000 04000000 0000ffff f1ffffff 00000000")


def test_bpf_filter_bytes():
    wire = tcm.encode_replace_bpf_filter(2, 4, 0xFFFFFFF3, 0xA6E7, 1, 0x0003, 9, "agentd_egress")
    assert wire == _hex(
        "54000000 2c00 0105 02000000 00000000",  # 84 bytes, RTM_NEWTFILTER, REQUEST|REPLACE|CREATE
        "00 000000 04000000 01000000 f3ffffff 0003e7a6",  # handle 1, parent egress, prio a6e7 | htons(ETH_P_ALL)
        "08000100 62706600",  # TCA_KIND "bpf"
        "28000280",  # TCA_OPTIONS | NLA_F_NESTED, 40 bytes
        "08000600 09000000",  # TCA_BPF_FD 9
        "12000700", "6167656e74645f65677265737300", "0000",  # TCA_BPF_NAME
        "08000800 01000000",  # TCA_BPF_FLAGS: direct action
    )
    assert tcm.encode_del_filter(3, 4, 0xFFFFFFF3, 0xA6E7, 1, 0x0003, "bpf") == _hex(
        "2c000000 2d00 0100 03000000 00000000",
        "00 000000 04000000 01000000 f3ffffff 0003e7a6",
        "08000100 62706600",
    )
    assert tcm.encode_get_filters(4, 4, 0xFFFFFFF2) == _hex("24000000 2e00 0103 04000000 00000000",
                                                            "00 000000 04000000 00000000 f2ffffff 00000000")


def test_filter_decode():
    body = _hex(
        "00 000000 04000000 01000000 f3ffffff 0003e7a6",
        "08000100 62706600",
        "20000200",  # TCA_OPTIONS (the kernel does not set NLA_F_NESTED in dumps)
        "12000700", "6167656e74645f65677265737300", "0000",
        "08000b00 2a000000",  # TCA_BPF_ID 42
    )
    assert tcm.decode_filter(body) == tcm.TcFilter(0xA6E7, 1, "bpf", "agentd_egress", 42)
    # Another kind's options are its own numbering: not read as cls_bpf's.
    u32 = _hex("00 000000 04000000 00080080 f3ffffff 0003e7a6", "08000100 75333200", "0c000200 08000b00 2a000000")
    assert tcm.decode_filter(u32) == tcm.TcFilter(0xA6E7, 0x80000800, "u32", None, None)


def test_netlink_error_is_one_line():
    err = nl.NetlinkError(errno.EEXIST, "A file exists", "creating vxlan device agentd.vxlan")
    assert str(err) == "creating vxlan device agentd.vxlan: EEXIST (File exists): A file exists"
    assert err.errno == errno.EEXIST
