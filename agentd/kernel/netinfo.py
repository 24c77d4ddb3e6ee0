"""Read-only facts about this host's network: which interface holds the node address,
its on-link prefixes, its MTU.  Used to decide "is this peer on my L2 segment?"
(host-gw, cross-subnet) and to size tunnel MTUs.  Never changes anything.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from ipaddress import (
    IPv4Address,
    IPv4Interface,
    IPv4Network,
    IPv6Address,
    IPv6Interface,
    IPv6Network,
    ip_address,
    ip_interface,
)

from . import netlink as nl
from .netlink_links import (
    IFA_F_DADFAILED,
    IFA_F_DEPRECATED,
    IFA_F_TEMPORARY,
    IFA_F_TENTATIVE,
    AddrMessage,
)
from .rtnl import Rtnl

log = logging.getLogger("agentd")


class NetInfoError(RuntimeError):
    pass


@dataclass(frozen=True)
class Underlay:
    """The interface that carries the node's underlay address, with what the route shapes and
    tunnels need of it.  ``interface`` is the node's primary address (IPv4; IPv6 with
    ip_family = ipv6), the one its BGP sessions and tunnels use."""

    ifname: str
    ifindex: int
    interface: IPv4Interface | IPv6Interface  # the node address with its prefix, e.g. 192.168.0.11/24
    mtu: int
    networks: tuple[IPv4Network | IPv6Network, ...]  # every prefix on the interface (on-link destinations), both families
    interface_v6: IPv6Interface | None = None  # the node's IPv6 underlay address (dual, ipv6), if it has one
    link_local: IPv6Address | None = None  # the interface's fe80:: address: host-gw's IPv6 next hop on an IPv4 underlay

    @property
    def family(self) -> int:
        """The version of the primary address: what encapsulated packets' outer headers are."""
        return self.interface.version

    def on_link(self, address: IPv4Address | IPv6Address | str) -> bool:
        a = ip_address(address)
        return any(a in n for n in self.networks)


def underlay_for(address: IPv4Address | IPv6Address, address_v6: IPv6Address | None = None) -> Underlay:
    """The interface that carries ``address`` in this network namespace; ``address_v6`` (the
    node's IPv6 underlay address in a dual-stack cluster) must be on the same interface.

    Read with ``ip -json address show`` (iproute2 is a dependency anyway): a few
    milliseconds, where importing a netlink library costs the agent's start-up ~0.2 s.
    """
    try:
        proc = subprocess.run(["ip", "-json", "address", "show"], capture_output=True, text=True, timeout=10)
        links = json.loads(proc.stdout or "[]")
    except (OSError, subprocess.SubprocessError, ValueError) as err:
        raise NetInfoError(f"cannot list this host's addresses (ip -json address show): {err}") from None
    holder = {}
    for link in links:
        for a in link.get("addr_info", []):
            if a.get("local"):
                holder[a["local"]] = link["ifname"]
    for link in links:
        infos = [a for a in link.get("addr_info", []) if a.get("family") in ("inet", "inet6") and a.get("local")]
        mine = [a for a in infos if ip_address(a["local"]) == address]
        if not mine:
            continue
        if address_v6 is not None and address_v6 != address:
            where = next((n for a, n in holder.items() if ip_address(a) == address_v6), None)
            if where != link["ifname"]:
                on = f"is on {where}" if where else "is on no interface here"
                raise NetInfoError(f"the node's IPv6 address {address_v6} {on}, not on {link['ifname']}, which holds "
                                   f"its address {address}: both must be on the underlay interface")
        # Link-local prefixes are on every link: they say nothing about which peers share ours.
        nets = [ip_interface(f"{a['local']}/{a['prefixlen']}").network for a in infos
                if a.get("scope") != "link" and not ip_address(a["local"]).is_link_local]
        v6 = address_v6 or (address if address.version == 6 else None)
        v6_info = next((a for a in infos if v6 is not None and ip_address(a["local"]) == v6), None)
        ll = next((a["local"] for a in infos if a["family"] == "inet6" and ip_address(a["local"]).is_link_local), None)
        return Underlay(
            ifname=link["ifname"],
            ifindex=int(link["ifindex"]),
            interface=ip_interface(f"{address}/{mine[0]['prefixlen']}"),
            mtu=int(link.get("mtu") or 1500),
            networks=tuple(dict.fromkeys(nets)),
            interface_v6=IPv6Interface(f"{v6}/{v6_info['prefixlen']}") if v6_info else None,
            link_local=IPv6Address(ll) if ll else None,
        )
    raise NetInfoError(f"no interface in this network namespace has the node address {address}")


class LocalHost:
    """The host facts the configuration's computed defaults need (:class:`agentd.config.settings.HostFacts`):
    the hostname and the default routes of the current namespace, read, never changed."""

    def hostname(self) -> str:
        return socket.gethostname()

    def default_address(self) -> IPv4Address | None:
        """The source address the kernel uses for the main table's best IPv4 default route."""
        with Rtnl() as rt:
            defaults = [r for r in rt.routes(nl.AF_INET, nl.RT_TABLE_MAIN) if r.dst_len == 0]
            if not defaults:
                return None
            best = min(defaults, key=lambda r: r.priority or 0)
            src = best.prefsrc
            if src is None and best.gateway:
                # The kernel's own source selection for the gateway, as `ip route get` shows it.
                got = rt.route_get(socket.inet_ntoa(best.gateway))
                src = got.prefsrc if got else None
            if src is None and best.oif:
                addrs = rt.addresses(best.oif)
                src = addrs[0].address if addrs else None
        return IPv4Address(src) if src else None

    def default_address_v6(self, beside: IPv4Address | None = None) -> IPv6Address | None:
        """A global (or unique-local) address of the interface the best IPv6 default route
        leaves by, its preferred source where it names one; with ``beside`` (the node's IPv4
        address, dual-stack) only if that address's interface holds it too, else None, logged
        (:func:`default_address_v6_of`)."""
        with Rtnl() as rt:
            defaults = [r for r in rt.routes(nl.AF_INET6, nl.RT_TABLE_MAIN) if r.dst_len == 0 and r.type == nl.RTN_UNICAST]
            if not defaults:
                return None
            best = min(defaults, key=lambda r: r.priority or 0)
            prefsrc = IPv6Address(best.prefsrc) if best.prefsrc is not None else None
            if prefsrc is None and not best.oif:
                return None
            v6 = rt.addresses(0, nl.AF_INET6)
            v4 = rt.addresses(0, nl.AF_INET) if beside is not None else []
        address, declined = default_address_v6_of(prefsrc, best.oif, v6, v4, beside, _ifname)
        if declined is not None:
            log.info("%s", declined)
        return address


def _ifname(index: int) -> str:
    try:
        return socket.if_indextoname(index)
    except OSError:
        return f"device {index}"


def _address_of(a: AddrMessage) -> IPv4Address | IPv6Address:
    packed = a.local or a.address or bytes(16 if a.family == nl.AF_INET6 else 4)
    return IPv6Address(packed) if len(packed) == 16 else IPv4Address(packed)


def default_address_v6_of(
    prefsrc: IPv6Address | None,
    oif: int | None,
    v6: Sequence[AddrMessage],
    v4: Sequence[AddrMessage],
    beside: IPv4Address | None,
    ifname: Callable[[int], str] = lambda i: f"device {i}",
) -> tuple[IPv6Address | None, str | None]:
    """The node's IPv6 underlay address as the IPv6 default route gives it -- its preferred
    source ``prefsrc``, else the first stable global or unique-local address of its device ``oif`` --
    from the host's IPv6 (``v6``) and IPv4 (``v4``) addresses; and, when it is declined, why.
    With ``beside`` (the node's IPv4 address, dual-stack) it must be on the device that holds
    ``beside``: :func:`underlay_for` wants both on the underlay interface, and address_v6 is
    optional with dual-stack, so a default route by another device leaves it unset (rather
    than stopping the node at start) with a line saying so.  Pure."""
    if prefsrc is not None:
        index = next((a.index for a in v6 if _address_of(a) == prefsrc), oif)
        chosen = prefsrc
    else:
        usable = [a for a in v6 if a.index == oif and _usable_v6(a)]
        if not usable:
            return None, None
        chosen, index = _address_of(usable[0]), oif
    holders = sorted({a.index for a in v4 if _address_of(a) == beside}) if beside is not None else []
    if not holders or index in holders:
        return chosen, None  # (an address held nowhere is underlay_for's to report)
    where = f"{ifname(index)}" if index else "no interface here"
    return None, (f"[node] address_v6 not set: the IPv6 default route's address {chosen} is on {where}, not on "
                  f"{ifname(holders[0])}, which holds the node address {beside}; IPv6 routes carry the IPv4-mapped "
                  f"next hop (set address_v6 to an address on {ifname(holders[0])} to use one)")


# Addresses not to take as the node's: one that goes away (an RFC 8981 temporary address is
# replaced every day or so and then removed; a deprecated one is past its preferred lifetime)
# or is not usable (duplicate address detection running, or failed).
_NOT_FOR_THE_NODE = IFA_F_TEMPORARY | IFA_F_DEPRECATED | IFA_F_TENTATIVE | IFA_F_DADFAILED


def _usable_v6(a: AddrMessage) -> bool:
    """A stable global or unique-local address: one other hosts can reach this node at."""
    addr = _address_of(a)
    return not (addr.is_link_local or addr.is_loopback or addr.is_unspecified or a.flags & _NOT_FOR_THE_NODE)
