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

The table is replaced whole in one transaction when the agent starts (cluster network and
subnet are known then), kept when it stops (like the policy tables: pods keep reaching out
while the agent restarts), removed when ``ip_masq`` is switched off and by ``agentd leave``.
"""

from __future__ import annotations

import asyncio
import logging
from ipaddress import IPv4Network
from typing import Any

from .libnftables import Nft, NftError

log = logging.getLogger("agentd.masquerade")

FAMILY, TABLE, CHAIN = "ip", "agentd-masq", "postrouting"
MULTICAST = IPv4Network("224.0.0.0/4")


def _addr(field: str, net: IPv4Network, op: str = "==") -> dict[str, Any]:
    prefix = {"prefix": {"addr": str(net.network_address), "len": net.prefixlen}}
    return {"match": {"op": op, "left": {"payload": {"protocol": "ip", "field": field}}, "right": prefix}}


def _rule(*expr: dict[str, Any]) -> dict[str, Any]:
    return {"add": {"rule": {"family": FAMILY, "table": TABLE, "chain": CHAIN, "expr": list(expr)}}}


MASQUERADE = {"masquerade": {"flags": ["fully-random"]}}


def ruleset(cluster: IPv4Network, subnet: IPv4Network) -> list[dict[str, Any]]:
    """The commands that replace the table with the rules for ``cluster`` and this node's ``subnet``."""
    table = {"family": FAMILY, "name": TABLE}
    return [
        {"add": {"table": table}},  # so that the delete below never fails
        {"delete": {"table": table}},
        {"add": {"table": table}},
        {"add": {"chain": {"family": FAMILY, "table": TABLE, "name": CHAIN, "type": "nat", "hook": "postrouting",
                           "prio": 100, "policy": "accept"}}},  # srcnat  # fmt: skip
        _rule(_addr("saddr", cluster), _addr("daddr", cluster), {"return": None}),
        _rule(_addr("saddr", cluster), _addr("daddr", MULTICAST, "!="), MASQUERADE),
        _rule(_addr("saddr", cluster, "!="), _addr("daddr", subnet), {"return": None}),
        _rule(_addr("saddr", cluster, "!="), _addr("daddr", cluster), MASQUERADE),
    ]


async def program(cluster: IPv4Network, subnet: IPv4Network) -> None:
    """Install (replace) the table in this network namespace."""
    nft = await asyncio.to_thread(Nft)
    try:
        await nft.arun(ruleset(cluster, subnet))
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
        if await nft.alist({"table": {"family": FAMILY, "name": TABLE}}) is None:
            return False
        await nft.arun([{"delete": {"table": {"family": FAMILY, "name": TABLE}}}])
        return True
    finally:
        await asyncio.to_thread(nft.close)
