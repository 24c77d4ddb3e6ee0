"""The node's IPv6 underlay address as the host's IPv6 default route gives it, chosen from
made-up address messages (agentd.kernel.netinfo.default_address_v6_of).  Pure."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address

from agentd.config.settings import load_config
from agentd.kernel import netlink as nl
from agentd.kernel.netinfo import default_address_v6_of
from agentd.kernel.netlink_links import AddrMessage

from .test_config_families import Host

NAMES = {2: "eth0", 3: "eth1"}


def v6(index: int, text: str, prefixlen: int = 64) -> AddrMessage:
    packed = IPv6Address(text).packed
    return AddrMessage(nl.AF_INET6, prefixlen, index, packed, packed)


def v4(index: int, text: str) -> AddrMessage:
    packed = IPv4Address(text).packed
    return AddrMessage(nl.AF_INET, 24, index, packed, packed, NAMES[index])


V4 = [v4(2, "192.0.2.1")]  # [node] address on eth0
V6 = [v6(2, "fe80::1"), v6(2, "2001:db8::1"), v6(3, "fe80::2"), v6(3, "2001:db8:1::1")]


NODE = IPv4Address("192.0.2.1")


def choose(prefsrc, oif, beside=NODE):
    return default_address_v6_of(prefsrc, oif, V6, V4, beside, NAMES.__getitem__)


def test_the_default_routes_address_on_the_node_addresses_interface_is_taken():
    assert choose(None, 2) == (IPv6Address("2001:db8::1"), None)  # not the link-local one
    assert choose(IPv6Address("2001:db8::1"), 2) == (IPv6Address("2001:db8::1"), None)


def test_a_default_route_by_another_interface_leaves_address_v6_unset_and_says_why():
    """Dual-stack: address_v6 is optional, and underlay_for would stop the node for an IPv6
    address off the interface that holds [node] address."""
    for prefsrc in (None, IPv6Address("2001:db8:1::1")):
        address, why = choose(prefsrc, 3)
        assert address is None
        assert why == ("[node] address_v6 not set: the IPv6 default route's address 2001:db8:1::1 is on eth1, "
                       "not on eth0, which holds the node address 192.0.2.1; IPv6 routes carry the IPv4-mapped "
                       "next hop (set address_v6 to an address on eth0 to use one)")


def test_ipv6_only_takes_the_default_routes_address_wherever_it_is():
    assert choose(None, 3, beside=None) == (IPv6Address("2001:db8:1::1"), None)
    assert choose(None, 4, beside=None) == (None, None)  # a device without a usable address


def test_the_configuration_asks_for_an_address_beside_the_ipv4_one_in_dual_stack_only():
    asked = []

    class Recording(Host):
        def default_address_v6(self, beside=None):
            asked.append(beside)
            # (what LocalHost gives for a default route by another interface than beside's)
            return None if beside is not None else self.address_v6

    cfg = load_config(env={"AGENTD_NETWORK_IP_FAMILY": "dual"}, host=Recording())
    assert cfg.node.address_v6 is None and cfg.bgp.next_hop_v6 is None  # the node starts, IPv4-mapped next hop
    load_config(env={"AGENTD_NETWORK_IP_FAMILY": "ipv6", "AGENTD_NETWORK_BACKEND": "vxlan"}, host=Recording())
    assert asked == [IPv4Address("192.0.2.10"), None]


def test_temporary_deprecated_tentative_and_dadfailed_addresses_are_not_taken():
    """An RFC 8981 privacy address disappears within days, a deprecated one is on its way out,
    a tentative or dadfailed one is not usable: the node's address is the stable one."""
    from agentd.kernel import netlink_links as links

    for flag in (links.IFA_F_TEMPORARY, links.IFA_F_DEPRECATED, links.IFA_F_TENTATIVE, links.IFA_F_DADFAILED):
        addrs = [v6(2, "fe80::1"), v6(2, "2001:db8::7a3:1")._replace(flags=flag), v6(2, "2001:db8::1")]
        assert default_address_v6_of(None, 2, addrs, V4, NODE) == (IPv6Address("2001:db8::1"), None), hex(flag)
        assert default_address_v6_of(None, 2, addrs[:2], V4, NODE) == (None, None), hex(flag)
    stable = v6(2, "2001:db8::1")._replace(flags=links.IFA_F_PERMANENT | 0x800)  # (0x800: stable-privacy)
    assert default_address_v6_of(None, 2, [stable], V4, NODE) == (IPv6Address("2001:db8::1"), None)


def test_address_flags_come_from_ifa_flags_else_from_the_header():
    import struct

    from agentd.kernel import netlink_links as links

    ip = IPv6Address("2001:db8::5").packed
    head = struct.Struct("=BBBBI")
    attrs = nl.attr(links.IFA_ADDRESS, ip)
    body = head.pack(nl.AF_INET6, 64, links.IFA_F_TEMPORARY, 0, 2) + attrs
    assert links.decode_addr(body).flags == links.IFA_F_TEMPORARY
    body = head.pack(nl.AF_INET6, 64, 0, 0, 2) + attrs + nl.attr_u32(links.IFA_FLAGS, 0x900 | links.IFA_F_DEPRECATED)
    assert links.decode_addr(body).flags == 0x920  # the u32 attribute: all of them
