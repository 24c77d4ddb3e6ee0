"""Masquerading for traffic that leaves the pod network: ``[network] ip_masq``, flannel's ``ipMasq``.

Pods (CNI's or a Docker daemon's containers on ``agentd docker-opts``' bridge) have addresses of
the cluster network, which nothing outside the cluster routes back to.  With ``ip_masq = true``
the agent keeps one nftables table per pod family in the node's network namespace,
``ip agentd-masq`` for IPv4 pods and ``ip6 agentd-masq`` for IPv6 ones (a dual-stack node has
both), each with flannel's four rules (flannel's ``pkg/ip/iptables.go`` / ``MasqRules`` and
``MasqIP6Rules``), in this order::

    ip saddr CIDR  ip daddr CIDR         return                     pod to pod, any node: never
    ip saddr CIDR  ip daddr != 224.0.0.0/4  masquerade fully-random  pods to the outside world
    ip saddr != CIDR  ip daddr SUBNET    return                     to this node's pods: untouched
    ip saddr != CIDR  ip daddr CIDR      masquerade fully-random     the host (or outside) to other
                                                                    nodes' pods: their replies come back

and the same with ``ip6`` and the IPv6 cluster network, subnet and multicast (ff00::/8,
RFC 4291 §2.7).  So traffic between pods or containers is never masqueraded, on any backend.
That is why the bridge's own masquerading stays off (the subnet file's ``AGENTD_IPMASQ=false``,
Docker's ``--ip-masq=false`` from ``agentd docker-opts``): both masquerade everything leaving
the node's subnet, pod-to-pod traffic to other nodes included.

The tables are written in one transaction when the agent starts (cluster networks and subnets
are known then; a previous run's are adopted and rewritten in that transaction, never left
empty, and a family the node no longer has loses its table in it), kept when it stops (like
the policy tables: pods keep reaching out while the agent restarts), removed when ``ip_masq``
is switched off and by ``agentd leave``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from ipaddress import IPv4Network, IPv6Network

from .expr import RETURN, match, payload, prefix
from .libnftables import Nft, NftError
from .programmer import NftProgrammer
from .ruleset import NftChain, Ruleset, rule_text

log = logging.getLogger("agentd.masquerade")

TABLE, CHAIN = "agentd-masq", "postrouting"
FAMILIES = {4: "ip", 6: "ip6"}  # the table's nftables family per IP version
TABLES = frozenset((family, TABLE) for family in FAMILIES.values())
MULTICAST = {4: IPv4Network("224.0.0.0/4"), 6: IPv6Network("ff00::/8")}
MASQUERADE = {"masquerade": {"flags": ["fully-random"]}}
SRCNAT = ("nat", "postrouting", 100, "accept")  # type, hook, priority (srcnat), policy

Network = IPv4Network | IPv6Network


def ruleset(networks: Mapping[int, tuple[Network, Network]]) -> Ruleset:
    """The tables for ``networks``: IP version -> (cluster network, this node's subnet); one
    table per version, one chain, the four rules above."""
    objects = {}
    for version, (cluster, subnet) in sorted(networks.items()):
        family = FAMILIES[version]
        saddr, daddr = payload(family, "saddr"), payload(family, "daddr")
        rules = [
            [match(saddr, prefix(cluster)), match(daddr, prefix(cluster)), RETURN],
            [match(saddr, prefix(cluster)), match(daddr, prefix(MULTICAST[version]), "!="), MASQUERADE],
            [match(saddr, prefix(cluster), "!="), match(daddr, prefix(subnet)), RETURN],
            [match(saddr, prefix(cluster), "!="), match(daddr, prefix(cluster)), MASQUERADE],
        ]
        chain = NftChain(family, TABLE, CHAIN, tuple(rule_text(r) for r in rules), hook=SRCNAT)
        objects[chain.key] = chain
    return Ruleset(frozenset((FAMILIES[v], TABLE) for v in networks), objects)


async def program(networks: Mapping[int, tuple[Network, Network]]) -> None:
    """Install the tables in this network namespace, or bring a previous run's to these rules
    (adopted and rewritten in one transaction: NftProgrammer); a family not in ``networks``
    loses its table."""
    nft = await asyncio.to_thread(Nft)
    try:
        await NftProgrammer(nft, TABLES, "masquerading").sync(ruleset(networks))
    finally:
        await asyncio.to_thread(nft.close)
    for version, (cluster, _subnet) in sorted(networks.items()):
        log.info("masquerading traffic from %s to outside it (nftables table %s %s)", cluster, FAMILIES[version], TABLE)


async def remove() -> bool:
    """Delete the tables that are there; True if there was one."""
    try:
        nft = await asyncio.to_thread(Nft)
    except NftError:
        return False
    try:
        return await NftProgrammer(nft, TABLES, "masquerading").remove()
    finally:
        await asyncio.to_thread(nft.close)
