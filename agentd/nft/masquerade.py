"""Masquerading for traffic that leaves the pod network: ``[network] ip_masq``, flannel's ``ipMasq``.

Pods (CNI's or a Docker daemon's containers on ``agentd docker-opts``' bridge) have addresses of
the cluster network, which nothing outside the cluster routes back to.  With ``ip_masq = true``
the agent keeps one nftables table in the node's network namespace, ``ip agentd-masq``, with
flannel's four rules (flannel's ``pkg/ip/iptables.go`` / ``MasqRules``), in this order::

    ip saddr CIDR  ip daddr CIDR         return                     pod to pod, any node: never
    ip saddr CIDR  ip daddr != 224.0.0.0/4  masquerade fully-random  pods to the outside world
    ip saddr != CIDR  ip daddr SUBNET    return                     to this node's pods: untouched
    ip saddr != CIDR  ip daddr CIDR      masquerade fully-random     the host (or outside) to other
                                                                    nodes' pods: their replies come back

So traffic between pods or containers is never masqueraded, on any backend.  That is why the
bridge's own masquerading stays off (the subnet file's ``AGENTD_IPMASQ=false``, Docker's
``--ip-masq=false`` from ``agentd docker-opts``): both masquerade everything leaving the node's
subnet, pod-to-pod traffic to other nodes included.

The table is written in one transaction when the agent starts (cluster network and subnet
are known then; a previous run's is adopted and rewritten in that transaction, never left
empty), kept when it stops (like the policy tables: pods keep reaching out
while the agent restarts), removed when ``ip_masq`` is switched off and by ``agentd leave``.
"""

from __future__ import annotations

import asyncio
import logging
from ipaddress import IPv4Network

from .expr import RETURN, match, payload, prefix
from .libnftables import Nft, NftError
from .programmer import NftProgrammer
from .ruleset import NftChain, Ruleset, rule_text

log = logging.getLogger("agentd.masquerade")

FAMILY, TABLE, CHAIN = "ip", "agentd-masq", "postrouting"
TABLES = frozenset({(FAMILY, TABLE)})
MULTICAST = IPv4Network("224.0.0.0/4")
MASQUERADE = {"masquerade": {"flags": ["fully-random"]}}
SRCNAT = ("nat", "postrouting", 100, "accept")  # type, hook, priority (srcnat), policy


def ruleset(cluster: IPv4Network, subnet: IPv4Network) -> Ruleset:
    """The table for ``cluster`` and this node's ``subnet``: one chain, the four rules above."""
    saddr, daddr = payload("ip", "saddr"), payload("ip", "daddr")
    rules = [
        [match(saddr, prefix(cluster)), match(daddr, prefix(cluster)), RETURN],
        [match(saddr, prefix(cluster)), match(daddr, prefix(MULTICAST), "!="), MASQUERADE],
        [match(saddr, prefix(cluster), "!="), match(daddr, prefix(subnet)), RETURN],
        [match(saddr, prefix(cluster), "!="), match(daddr, prefix(cluster)), MASQUERADE],
    ]
    chain = NftChain(FAMILY, TABLE, CHAIN, tuple(rule_text(r) for r in rules), hook=SRCNAT)
    return Ruleset(TABLES, {chain.key: chain})


async def program(cluster: IPv4Network, subnet: IPv4Network) -> None:
    """Install the table in this network namespace, or bring a previous run's to these rules
    (adopted and rewritten in one transaction: NftProgrammer)."""
    nft = await asyncio.to_thread(Nft)
    try:
        await NftProgrammer(nft, TABLES, "masquerading").sync(ruleset(cluster, subnet))
    finally:
        await asyncio.to_thread(nft.close)
    log.info("masquerading traffic from %s to outside it (nftables table %s %s)", cluster, FAMILY, TABLE)


async def remove() -> bool:
    """Delete the table if it is there; True if it was."""
    try:
        nft = await asyncio.to_thread(Nft)
    except NftError:
        return False
    try:
        return await NftProgrammer(nft, TABLES, "masquerading").remove()
    finally:
        await asyncio.to_thread(nft.close)
