"""Links and addresses on rtnetlink: make a VXLAN (or dummy) device, set a device's MTU and state,
delete it, read its VXLAN settings, put IPv4 and IPv6 addresses on it -- what ``ip link add ... type
vxlan``, ``ip link set`` and ``ip addr`` send.  Built on :mod:`agentd.kernel.netlink` (its
attribute packer, parser and socket); the requests are rare, so plain functions, no
precompiled message templates.

Layouts (include/uapi/linux/rtnetlink.h, if_link.h, if_addr.h)::

    struct ifinfomsg { u8 family, pad; u16 type; s32 index; u32 flags, change; }   16 bytes
    struct ifaddrmsg { u8 family, prefixlen, flags, scope; u32 index; }              8 bytes

    IFLA_LINKINFO (nested) { IFLA_INFO_KIND "vxlan", IFLA_INFO_DATA (nested) {
        IFLA_VXLAN_ID u32, IFLA_VXLAN_LINK u32, IFLA_VXLAN_LOCAL in_addr (or
        IFLA_VXLAN_LOCAL6 in6_addr), IFLA_VXLAN_LEARNING u8, IFLA_VXLAN_PORT __be16 } }
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from agentd.kernel import netlink as nl

# --- if_link.h: IFLA_VXLAN_* (inside IFLA_INFO_DATA of a "vxlan" link) ------------------------

IFLA_VXLAN_ID = 1
IFLA_VXLAN_LINK = 3
IFLA_VXLAN_LOCAL = 4
IFLA_VXLAN_LEARNING = 7
IFLA_VXLAN_PORT = 15  # network byte order
IFLA_VXLAN_LOCAL6 = 17  # the local address of a VTEP on an IPv6 underlay

# --- if_addr.h ------------------------------------------------------------------------------

IFA_ADDRESS = 1
IFA_LOCAL = 2
IFA_LABEL = 3  # NUL-terminated; "dev" or "dev:suffix" (an alias name ``ip addr`` shows)
IFA_FLAGS = 8  # u32: every flag (the ifaddrmsg's ifa_flags has room for the low 8 only)
IFA_F_TEMPORARY = 0x01  # an RFC 8981 temporary (privacy) address: replaced, then removed
IFA_F_NODAD = 0x02  # an IPv6 address usable at once: no duplicate address detection (RFC 4862 §5.4)
IFA_F_DADFAILED = 0x08  # duplicate address detection found it in use elsewhere: never usable
IFA_F_DEPRECATED = 0x20  # past its preferred lifetime (RFC 4862 §5.5.4): on its way out
IFA_F_TENTATIVE = 0x40  # duplicate address detection still running: not usable yet
IFA_F_PERMANENT = 0x80  # configured, not learned (SLAAC, DHCPv6): no lifetimes

_IFINFOMSG = struct.Struct("=BxHiII")
_IFADDRMSG = struct.Struct("=BBBBI")
_U8 = struct.Struct("=B")
_BE16 = struct.Struct("!H")


class Vxlan(NamedTuple):
    """The settings of a VXLAN device that agentd chooses (the kernel's defaults for the rest)."""

    vni: int
    port: int  # UDP destination port, host order here, __be16 on the wire
    local: bytes  # the underlay address: 4 bytes (IPv4 underlay) or 16 (IPv6)
    link: int = 0  # the underlay device's index (0: none named)
    learning: bool = False
    address: bytes | None = None  # the device's MAC (IFLA_ADDRESS) at creation; None: the kernel's random one


def _header(mtype: int, seq: int, flags: int, body: bytes) -> bytes:
    return struct.pack("=IHHII", nl.NLMSG_HDRLEN + len(body), mtype, flags, seq, 0) + body


def vxlan_info_data(v: Vxlan) -> bytes:
    """The IFLA_INFO_DATA payload for ``v`` (the attributes ``ip link add type vxlan`` sends)."""
    return (
        nl.attr_u32(IFLA_VXLAN_ID, v.vni)
        + (nl.attr_u32(IFLA_VXLAN_LINK, v.link) if v.link else b"")
        + nl.attr(IFLA_VXLAN_LOCAL6 if len(v.local) == 16 else IFLA_VXLAN_LOCAL, v.local)
        + nl.attr(IFLA_VXLAN_LEARNING, _U8.pack(int(v.learning)))
        + nl.attr(IFLA_VXLAN_PORT, _BE16.pack(v.port))
    )


def decode_vxlan(info_data: bytes) -> Vxlan:
    """The IFLA_INFO_DATA of a vxlan link (``nl.LinkMessage.info_data``) back into a :class:`Vxlan`;
    a missing attribute reads as 0 / empty (the kernel always sends these)."""
    vni = port = link = 0
    local = b""
    learning = False
    for atype, vs, ve in nl.iter_attrs(info_data, 0, len(info_data)):
        if atype == IFLA_VXLAN_ID:
            vni = nl.read_u32(info_data, vs, ve, "IFLA_VXLAN_ID")
        elif atype == IFLA_VXLAN_LINK:
            link = nl.read_u32(info_data, vs, ve, "IFLA_VXLAN_LINK")
        elif atype == IFLA_VXLAN_LOCAL:
            local = nl.read_address(info_data, vs, ve, nl.AF_INET, "IFLA_VXLAN_LOCAL")
        elif atype == IFLA_VXLAN_LOCAL6:
            local = nl.read_address(info_data, vs, ve, nl.AF_INET6, "IFLA_VXLAN_LOCAL6")
        elif atype == IFLA_VXLAN_LEARNING:
            if ve - vs != 1:
                raise nl.NetlinkDecodeError(f"IFLA_VXLAN_LEARNING must be 1 byte, got {ve - vs}")
            learning = bool(info_data[vs])
        elif atype == IFLA_VXLAN_PORT:
            if ve - vs != 2:
                raise nl.NetlinkDecodeError(f"IFLA_VXLAN_PORT must be 2 bytes, got {ve - vs}")
            port = _BE16.unpack_from(info_data, vs)[0]
    return Vxlan(vni, port, local, link, learning)


def encode_newlink_vxlan(seq: int, name: str, v: Vxlan) -> bytes:
    """RTM_NEWLINK creating VXLAN device ``name`` (CREATE|EXCL: an existing one is EEXIST)."""
    linkinfo = nl.attr(nl.IFLA_INFO_KIND, b"vxlan") + nl.attr(nl.IFLA_INFO_DATA, vxlan_info_data(v))
    body = (_IFINFOMSG.pack(nl.AF_UNSPEC, 0, 0, 0, 0) + nl.attr(nl.IFLA_IFNAME, name.encode() + b"\0")
            + (nl.attr(nl.IFLA_ADDRESS, v.address) if v.address is not None else b"")
            + nl.attr(nl.IFLA_LINKINFO, linkinfo))
    return _header(nl.RTM_NEWLINK, seq, nl.NLM_F_REQUEST | nl.NLM_F_CREATE | nl.NLM_F_EXCL, body)


def encode_newlink(seq: int, name: str, kind: str) -> bytes:
    """RTM_NEWLINK creating device ``name`` of a kind without settings of its own (``ip link add
    NAME type dummy``); CREATE|EXCL: an existing one is EEXIST, a kind the kernel has no driver
    for is EOPNOTSUPP."""
    body = (_IFINFOMSG.pack(nl.AF_UNSPEC, 0, 0, 0, 0) + nl.attr(nl.IFLA_IFNAME, name.encode() + b"\0")
            + nl.attr(nl.IFLA_LINKINFO, nl.attr(nl.IFLA_INFO_KIND, kind.encode())))
    return _header(nl.RTM_NEWLINK, seq, nl.NLM_F_REQUEST | nl.NLM_F_CREATE | nl.NLM_F_EXCL, body)


def encode_setlink(seq: int, index: int, *, mtu: int | None = None, up: bool | None = None) -> bytes:
    """RTM_NEWLINK changing device ``index``: its MTU and/or its IFF_UP flag (``ip link set``)."""
    flags = nl.IFF_UP if up else 0
    change = nl.IFF_UP if up is not None else 0
    body = _IFINFOMSG.pack(nl.AF_UNSPEC, 0, index, flags, change)
    if mtu is not None:
        body += nl.attr_u32(nl.IFLA_MTU, mtu)
    return _header(nl.RTM_NEWLINK, seq, nl.NLM_F_REQUEST, body)


def encode_dellink(seq: int, index: int) -> bytes:
    return _header(nl.RTM_DELLINK, seq, nl.NLM_F_REQUEST, _IFINFOMSG.pack(nl.AF_UNSPEC, 0, index, 0, 0))


def encode_getlink(seq: int, *, index: int = 0, name: str | None = None, netnsid: int | None = None) -> bytes:
    """RTM_GETLINK for one device, by index or by name (ENODEV if there is none); with
    ``netnsid``, the device of that index in the namespace of that id (IFLA_TARGET_NETNSID:
    a veth's other end, as its IFLA_LINK and IFLA_LINK_NETNSID name it)."""
    body = _IFINFOMSG.pack(nl.AF_UNSPEC, 0, index, 0, 0)
    if name is not None:
        body += nl.attr(nl.IFLA_IFNAME, name.encode() + b"\0")
    if netnsid is not None:
        body += nl.attr(nl.IFLA_TARGET_NETNSID, struct.pack("=i", netnsid))
    return _header(nl.RTM_GETLINK, seq, nl.NLM_F_REQUEST, body)


# --- addresses -------------------------------------------------------------------------------


class AddrMessage(NamedTuple):
    """An RTM_NEWADDR as the kernel says it: ``local`` is the address of the device (IFA_LOCAL,
    which on a point-to-point device differs from the peer's IFA_ADDRESS)."""

    family: int
    prefixlen: int
    index: int
    address: bytes | None = None
    local: bytes | None = None
    label: str | None = None  # IFA_LABEL (IPv4 only)
    flags: int = 0  # IFA_F_*: IFA_FLAGS where the kernel sends it, else the header's ifa_flags


def encode_addr(mtype: int, seq: int, index: int, address: bytes, prefixlen: int, label: str | None = None) -> bytes:
    """RTM_NEWADDR (CREATE|EXCL) or RTM_DELADDR of an IPv4 or IPv6 (16 bytes) ``address``/``prefixlen``
    on device ``index``: IFA_LOCAL and IFA_ADDRESS both the address, as ``ip addr add`` sends them
    (an IPv6 one with IFA_F_NODAD: the agent's own addresses are usable at once); with
    ``label`` (``ip addr add ... label lo:x``) IFA_LABEL, which must start with the device's name."""
    flags = nl.NLM_F_REQUEST | (nl.NLM_F_CREATE | nl.NLM_F_EXCL if mtype == nl.RTM_NEWADDR else 0)
    v6 = len(address) == 16
    body = (_IFADDRMSG.pack(nl.AF_INET6 if v6 else nl.AF_INET, prefixlen, IFA_F_NODAD if v6 else 0, 0, index)
            + nl.attr(IFA_LOCAL, address) + nl.attr(IFA_ADDRESS, address))
    if label is not None:
        body += nl.attr(IFA_LABEL, label.encode() + b"\0")
    return _header(mtype, seq, flags, body)


def encode_getaddr_dump(seq: int, family: int, index: int = 0) -> bytes:
    """RTM_GETADDR dump; with strict checking the kernel lists only device ``index`` (if not 0)."""
    return _header(nl.RTM_GETADDR, seq, nl.NLM_F_REQUEST | nl.NLM_F_DUMP, _IFADDRMSG.pack(family, 0, 0, 0, index))


def decode_addr(buf: bytes, start: int = 0, end: int | None = None) -> AddrMessage:
    if end is None:
        end = len(buf)
    if end > len(buf) or end - start < _IFADDRMSG.size:
        raise nl.NetlinkDecodeError(f"address message body is {end - start} bytes, ifaddrmsg needs {_IFADDRMSG.size}")
    family, prefixlen, flags, _scope, index = _IFADDRMSG.unpack_from(buf, start)
    address = local = label = None
    for atype, vs, ve in nl.iter_attrs(buf, start + _IFADDRMSG.size, end):
        if atype == IFA_ADDRESS:
            address = nl.read_address(buf, vs, ve, family, "IFA_ADDRESS")
        elif atype == IFA_LOCAL:
            local = nl.read_address(buf, vs, ve, family, "IFA_LOCAL")
        elif atype == IFA_LABEL:
            label = nl.read_string(buf, vs, ve)
        elif atype == IFA_FLAGS:
            flags = nl.read_u32(buf, vs, ve, "IFA_FLAGS")
    return AddrMessage(family, prefixlen, index, address, local, label, flags)
