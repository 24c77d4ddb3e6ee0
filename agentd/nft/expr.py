"""nftables JSON expressions the agent's compilers share (policy, Services, masquerading).

libnftables' JSON schema (libnftables-json(5)): a rule is a list of statements; these build
the few shapes both compilers write, so each compiler reads as the rules it makes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network
from typing import Any

NAME_MAX = 200  # nft object names may have 255 bytes; longer names are hashed (names stay unique)

ACCEPT: dict[str, Any] = {"accept": None}
DROP: dict[str, Any] = {"drop": None}
RETURN: dict[str, Any] = {"return": None}


def payload(protocol: str, field: str) -> dict[str, Any]:
    return {"payload": {"protocol": protocol, "field": field}}


def meta(key: str) -> dict[str, Any]:
    return {"meta": {"key": key}}


def match(left: Any, right: Any, op: str = "==") -> dict[str, Any]:
    return {"match": {"op": op, "left": left, "right": right}}


def jump(chain: str) -> dict[str, Any]:
    return {"jump": {"target": chain}}


def goto(chain: str) -> dict[str, Any]:
    return {"goto": {"target": chain}}


def ref(name: str) -> str:
    """A named set or map as a rule refers to it (``@name``)."""
    return "@" + name


ESTABLISHED = match({"ct": {"key": "state"}}, ["established", "related"], "in")


def object_name(kind: str, *parts: Any) -> str:
    """``kind/part/part...``, or ``kind/#<hash>`` when that is too long for nftables."""
    full = "/".join((kind, *map(str, parts)))
    if len(full) <= NAME_MAX:
        return full
    return f"{kind}/#{hashlib.sha1(full.encode()).hexdigest()[:20]}"


SUPPRESSED = "flow-log-suppressed"  # the counter of drops a log rule's limit kept from the log


@dataclass(frozen=True)
class DropLog:
    """How drop rules log for flow records (``agentd.flows``): the NFLOG group, and the
    kernel's limit per log rule (packets a second, burst); what goes over it is counted in
    each table's ``flow-log-suppressed`` counter instead."""

    group: int
    rate: int = 100
    burst: int = 100

    def statements(self, prefix: str) -> list[dict[str, Any]]:
        """``limit rate R/second burst B packets log prefix "<prefix>" group N``"""
        return [{"limit": {"rate": self.rate, "per": "second", "burst": self.burst}},
                {"log": {"prefix": prefix, "group": self.group}}]

    def chain_rules(self, prefix: str, final: list[dict[str, Any]]) -> tuple[str, ...]:
        """A drop chain's rules: ``final`` logged while under the limit, else the suppressed
        counter and ``final`` alone."""
        from .ruleset import rule_text

        return (rule_text([*self.statements(prefix), *final]), rule_text([{"counter": SUPPRESSED}]), rule_text(final))


@dataclass(frozen=True)
class AddressFamily:
    """What an IP version is called where the compilers write it: the header's payload
    protocol (``ip saddr`` / ``ip6 saddr``), the set key type, the suffix of the objects
    that hold its addresses (``egress-pods`` / ``egress-pods6``), its ICMP and loopback.
    A table of two rows rather than a ladder of ifs: each compiler writes a rule once and
    asks the row for the words."""

    version: int
    proto: str  # payload protocol of its header: "ip" | "ip6"; also the ether type and nft table family
    addr: str  # set element type: "ipv4_addr" | "ipv6_addr"
    suffix: str  # appended to the names of the objects holding its addresses ("" for IPv4: unchanged)
    icmp: str  # "icmp" | "icmpv6"
    redirect: str  # its ICMP redirect type
    loopback: str  # the loopback network, as a prefix
    link_local: str  # the link-local network, as a prefix

    def name(self, base: str) -> str:
        return base + self.suffix

    def saddr(self) -> dict[str, Any]:
        return payload(self.proto, "saddr")

    def daddr(self) -> dict[str, Any]:
        return payload(self.proto, "daddr")


def prefix(net: IPv4Network | IPv6Network | str) -> Any:
    """A network as a rule's right-hand side: an address for a host route, else a prefix."""
    if isinstance(net, str):
        net = IPv4Network(net) if ":" not in net else IPv6Network(net)
    if net.prefixlen == net.max_prefixlen:
        return str(net.network_address)
    return {"prefix": {"addr": str(net.network_address), "len": net.prefixlen}}


IPV4 = AddressFamily(4, "ip", "ipv4_addr", "", "icmp", "redirect", "127.0.0.0/8", "169.254.0.0/16")
IPV6 = AddressFamily(6, "ip6", "ipv6_addr", "6", "icmpv6", "nd-redirect", "::1/128", "fe80::/10")
FAMILIES = {4: IPV4, 6: IPV6}


def families(versions: Any) -> list[AddressFamily]:
    """The rows of IP ``versions`` (4, 6), in that order."""
    return [FAMILIES[v] for v in sorted(set(versions))]
