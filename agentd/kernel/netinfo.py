"""Read-only facts about this host's network: which interface holds the node address,
its on-link prefixes, its MTU.  Used to decide "is this peer on my L2 segment?"
(host-gw, cross-subnet) and to size tunnel MTUs.  Never changes anything.
"""

from __future__ import annotations

import json
import socket
import subprocess
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Interface, IPv4Network, ip_address

from . import netlink as nl
from .rtnl import Rtnl


class NetInfoError(RuntimeError):
    pass


@dataclass(frozen=True)
class Underlay:
    ifname: str
    ifindex: int
    interface: IPv4Interface  # the node address with its prefix, e.g. 192.168.0.11/24
    mtu: int
    networks: tuple[IPv4Network, ...]  # every IPv4 prefix on the interface (on-link destinations)

    def on_link(self, address: IPv4Address | str) -> bool:
        a = ip_address(address)
        return any(a in n for n in self.networks)


def underlay_for(address: IPv4Address) -> Underlay:
    """The interface that carries ``address`` in this network namespace.

    Read with ``ip -json -4 address show`` (iproute2 is a dependency anyway): a few
    milliseconds, where importing a netlink library costs the agent's start-up ~0.2 s.
    """
    try:
        proc = subprocess.run(["ip", "-json", "-4", "address", "show"], capture_output=True, text=True, timeout=10)
        links = json.loads(proc.stdout or "[]")
    except (OSError, subprocess.SubprocessError, ValueError) as err:
        raise NetInfoError(f"cannot list this host's addresses (ip -json -4 address show): {err}") from None
    for link in links:
        infos = [a for a in link.get("addr_info", []) if a.get("family") == "inet" and a.get("local")]
        mine = [a for a in infos if a["local"] == str(address)]
        if not mine:
            continue
        nets = [IPv4Interface(f"{a['local']}/{a['prefixlen']}").network for a in infos]
        return Underlay(
            ifname=link["ifname"],
            ifindex=int(link["ifindex"]),
            interface=IPv4Interface(f"{address}/{mine[0]['prefixlen']}"),
            mtu=int(link.get("mtu") or 1500),
            networks=tuple(dict.fromkeys(nets)),
        )
    raise NetInfoError(f"no interface in this network namespace has the node address {address}")


class LocalHost:
    """The host facts the configuration's computed defaults need (:class:`agentd.config.settings.HostFacts`):
    the hostname and the IPv4 default route of the current namespace, read, never changed."""

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
