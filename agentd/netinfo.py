"""Read-only facts about this host's network: which interface holds the node address,
its on-link prefixes, its MTU.  Used to decide "is this peer on my L2 segment?"
(host-gw, cross-subnet) and to size tunnel MTUs.  Never changes anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Interface, IPv4Network, ip_address

from pyroute2 import IPRoute


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
    """The interface that carries ``address`` in this network namespace."""
    with IPRoute() as ipr:
        match = None
        for msg in ipr.get_addr(family=2):
            if msg.get_attr("IFA_ADDRESS") == str(address) or msg.get_attr("IFA_LOCAL") == str(address):
                match = msg
                break
        if match is None:
            raise NetInfoError(f"no interface in this network namespace has the node address {address}")
        index = match["index"]
        (link,) = ipr.get_links(index)
        nets = []
        for msg in ipr.get_addr(family=2, index=index):
            a = msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS")
            nets.append(IPv4Interface(f"{a}/{msg['prefixlen']}").network)
        return Underlay(
            ifname=link.get_attr("IFLA_IFNAME"),
            ifindex=index,
            interface=IPv4Interface(f"{address}/{match['prefixlen']}"),
            mtu=int(link.get_attr("IFLA_MTU") or 1500),
            networks=tuple(dict.fromkeys(nets)),
        )
