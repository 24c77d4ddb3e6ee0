"""Masquerading for traffic that leaves the pod network: ``[network] ip_masq``, flannel's ``ipMasq``.

Pods (CNI's or a Docker daemon's containers on ``agentd docker-opts``' bridge) have addresses of
the cluster network, which nothing outside the cluster routes back to.  With ``ip_masq = true``
the agent keeps one nftables table per pod family in the node's network namespace,
``ip agentd-masq`` for IPv4 pods and ``ip6 agentd-masq`` for IPv6 ones (a dual-stack node has
both), each with flannel's rules (flannel's ``pkg/ip/iptables.go`` / ``MasqRules`` and
``MasqIP6Rules``), in this order::

    meta mark & 0x4000 == 0x4000        return                     Services' to masquerade: theirs
    ip saddr CIDR  ip daddr CIDR         return                     pod to pod, any node: never
    ip saddr CIDR  ip daddr != 224.0.0.0/4  masquerade fully-random  pods to the outside world
    ip saddr != CIDR  ip daddr SUBNET    return                     to this node's pods: untouched
    ip saddr != CIDR  ip daddr CIDR      masquerade fully-random     the host (or outside) to other
                                                                    nodes' pods: their replies come back

and the same with ``ip6`` and the IPv6 cluster network, subnet and multicast (ff00::/8,
RFC 4291 §2.7).  So traffic between pods or containers is never masqueraded, on any backend.

The first rule is flannel's "avoid double NAT" one: a packet kube-proxy's bit (0x4000, as
``agentd.services.compiler.MASQ_MARK``) marks for masquerading is the Services table's to
masquerade, which clears the bit first (kubernetes#92035: vxlan and ipip keep the mark on the
encapsulated packet, whose outer header would be masqueraded too).  The chain's priority is
srcnat + 10, after the Services table's postrouting chain (srcnat): which of two nat chains
of one priority runs first depends on the order their tables were made (a restart, a table
made again), and once one masquerades, the connection's later nat chains are skipped.

Masqueraded, a pod's packet to another node's underlay address comes from this node's address:
the other node's BGP listener, udp worker, VXLAN device and IPIP tunnel take a cluster member by
its address, so a pod could pose as its node (inject pod packets with any inner source, open a
BGP session in its name).  Each table therefore also has a filter chain on the forward hook
that drops what pods send to a member (the set ``members``: every node's underlay addresses of
the family, kept up to date as nodes come and go) on the agent's own ports -- TCP to the BGP
port, UDP to ``udp_port`` and ``vxlan_port``, and IP protocol 4 (IPIP)::

    ip saddr CIDR  ip daddr @members  tcp dport BGP                        drop
    ip saddr CIDR  ip daddr @members  udp dport { UDP_PORT, VXLAN_PORT }   drop
    ip saddr CIDR  ip daddr @members  meta l4proto 4                       drop

Everything else pods send to nodes (their host services, node ports) is masqueraded as
before.  (Not masquerading pod traffic to members instead would keep the pod's source, but
send packets from pod addresses onto the underlay, which an overlay's receiver drops by
reverse-path filtering and a cloud network by its source check: a pod could no longer reach
another node's host services on vxlan, udp or ipip.)  BFD needs TTL 255 (RFC 5881), which no
forwarded packet has.
That is why the bridge's own masquerading stays off (the subnet file's ``AGENTD_IPMASQ=false``,
Docker's ``--ip-masq=false`` from ``agentd docker-opts``): both masquerade everything leaving
the node's subnet, pod-to-pod traffic to other nodes included.

Tables someone else deletes (``nft flush ruleset``, a firewall's restart) come back: every
CHECK_INTERVAL seconds (flannel re-ensures its rules every ``iptables-resync``, 5 s) the agent
asks the kernel for each table's counters (one netlink request, no listing), and a table it
wrote that is not there is written again, the whole ruleset in one transaction.

A transaction the kernel refuses (at start, or a member update) is tried again after
RETRY_INITIAL seconds, doubling up to RETRY_MAX, until it applies -- with the latest members --
and :meth:`Masquerade.problems` (the agent's /status) says why meanwhile: a member missing from
the set is a node whose ports pods can reach as their node.

The tables are written in one transaction when the agent starts (cluster networks and subnets
are known then; a previous run's are adopted and rewritten in that transaction, never left
empty -- the member sets keep what the previous run's hold until the node list is read, which
comes later -- and a family the node no longer has loses its table in it), kept when it stops (like
the policy tables: pods keep reaching out while the agent restarts), removed when ``ip_masq``
is switched off and by ``agentd leave``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network, ip_address
from typing import Any

from .expr import DROP, RETURN, match, meta, payload, prefix, ref
from .libnftables import Nft, NftError
from .nfnetlink import TableAbsent
from .programmer import NftProgrammer
from .ruleset import NftChain, NftSet, Ruleset, rule_text

log = logging.getLogger("agentd.masquerade")

TABLE, CHAIN = "agentd-masq", "postrouting"
FAMILIES = {4: "ip", 6: "ip6"}  # the table's nftables family per IP version
TABLES = frozenset((family, TABLE) for family in FAMILIES.values())
MULTICAST = {4: IPv4Network("224.0.0.0/4"), 6: IPv6Network("ff00::/8")}
MASQUERADE = {"masquerade": {"flags": ["fully-random"]}}
# type, hook, priority, policy: after the Services table's postrouting chain (srcnat, 100)
SRCNAT = ("nat", "postrouting", 110, "accept")
MASQ_MARK = 0x4000  # kube-proxy's masquerade bit (agentd.services.compiler.MASQ_MARK)
GUARD_CHAIN, MEMBERS = "forward", "members"
FORWARD = ("filter", "forward", 0, "accept")
IPPROTO_IPIP = 4
RETRY_INITIAL, RETRY_MAX = 1.0, 30.0  # seconds between tries of a refused transaction
CHECK_INTERVAL = 5.0  # seconds between looks for tables deleted by someone else

Network = IPv4Network | IPv6Network


@dataclass(frozen=True)
class Guarded:
    """The agent's ports a pod may not reach on a member (see above)."""

    bgp_port: int = 179
    udp_port: int = 8285
    vxlan_port: int = 4789


def member_addresses(nodes: Iterable[Any]) -> frozenset[str]:
    """The underlay addresses (IPv4 and IPv6) of ``nodes`` (NodeRecords)."""
    return frozenset(str(a) for n in nodes for a in (n.address, n.address_v6) if a is not None)


def ruleset(networks: Mapping[int, tuple[Network, Network]], members: Iterable[str] = (),
            guarded: Guarded = Guarded(), members_known: bool = True) -> Ruleset:  # fmt: skip
    """The tables for ``networks``: IP version -> (cluster network, this node's subnet); one
    table per version, the masquerading rules above and the forward chain that keeps pods
    from the agent's ports on ``members`` (the nodes' underlay addresses; those of the version
    go in its table's set).  ``members_known`` False (a start, before the node list is read):
    the sets keep what a previous run's hold (plan), as the tunnels' member filters do."""
    objects: dict[Any, Any] = {}
    for version, (cluster, subnet) in sorted(networks.items()):
        family = FAMILIES[version]
        saddr, daddr = payload(family, "saddr"), payload(family, "daddr")
        rules = [
            [match({"&": [meta("mark"), MASQ_MARK]}, MASQ_MARK), RETURN],
            [match(saddr, prefix(cluster)), match(daddr, prefix(cluster)), RETURN],
            [match(saddr, prefix(cluster)), match(daddr, prefix(MULTICAST[version]), "!="), MASQUERADE],
            [match(saddr, prefix(cluster), "!="), match(daddr, prefix(subnet)), RETURN],
            [match(saddr, prefix(cluster), "!="), match(daddr, prefix(cluster)), MASQUERADE],
        ]
        chain = NftChain(family, TABLE, CHAIN, tuple(rule_text(r) for r in rules), hook=SRCNAT)
        objects[chain.key] = chain
        own = frozenset(a for a in members if ip_address(a).version == version)
        members_set = NftSet(family, TABLE, MEMBERS, ("ipv4_addr" if version == 4 else "ipv6_addr",), elements=own,
                             contents_known=members_known)
        objects[members_set.key] = members_set
        to_member = [match(saddr, prefix(cluster)), match(daddr, ref(MEMBERS))]
        guard = [
            [*to_member, match(payload("tcp", "dport"), guarded.bgp_port), DROP],
            [*to_member, match(payload("udp", "dport"), {"set": sorted({guarded.udp_port, guarded.vxlan_port})}), DROP],
            [*to_member, match(meta("l4proto"), IPPROTO_IPIP), DROP],
        ]
        forward = NftChain(family, TABLE, GUARD_CHAIN, tuple(rule_text(r) for r in guard), hook=FORWARD)
        objects[forward.key] = forward
    return Ruleset(frozenset((FAMILIES[v], TABLE) for v in networks), objects)


class Masquerade:
    """The tables of one agent: :meth:`program` at start, :meth:`set_members` as nodes come
    and go (in the background, coalesced, one transaction each)."""

    def __init__(self, networks: Mapping[int, tuple[Network, Network]], guarded: Guarded = Guarded(),
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 check_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:  # fmt: skip
        self.networks = dict(networks)
        self.guarded = guarded
        self.members: frozenset[str] = frozenset()
        self.members_known = False  # until the node list is read: the member sets keep what they hold
        self.error: str | None = None  # the last transaction's refusal, while it is tried again
        self._programmer: NftProgrammer | None = None
        self._task: asyncio.Task[None] | None = None
        self._again = False
        self._sleep = sleep  # the wait between tries (tests pass their own)
        self._check_sleep = check_sleep  # the wait between looks for deleted tables (CHECK_INTERVAL)
        self._watch: asyncio.Task[None] | None = None
        self._announced = False

    def ruleset(self) -> Ruleset:
        return ruleset(self.networks, self.members, self.guarded, self.members_known)

    def problems(self) -> list[str]:
        """What the agent's problems (/status, systemd's STATUS=) say of the tables: a refused
        transaction, while it is tried again."""
        return [f"ip_masq tables not up to date: {self.error} (trying again)"] if self.error else []

    async def program(self, retry: bool = False) -> None:
        """Install the tables in this network namespace, or bring a previous run's to these
        rules (adopted and rewritten in one transaction: NftProgrammer); a family not in
        ``networks`` loses its table.  ``retry`` (the agent): a transaction the kernel refuses
        is tried again in the background (:attr:`error` says why meanwhile) instead of raising,
        and tables someone else deletes are written again (:meth:`check`, every CHECK_INTERVAL);
        without libnftables there is nothing to try with, and NftError is raised all the same."""
        try:
            await self._sync()
        except NftError as err:
            if not retry or self._programmer is None:
                raise
            self._failed(err, RETRY_INITIAL)
            self._start(RETRY_INITIAL)
            self._watching()
            return
        self._announce()
        if retry:
            self._watching()

    def _watching(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._watch_tables())

    async def _watch_tables(self) -> None:
        while True:
            await self._check_sleep(CHECK_INTERVAL)
            try:
                await self.check()
            except NftError as err:  # (the netlink socket failing: looked at again next time)
                log.debug("could not look for the masquerading tables: %s", err)

    async def check(self) -> bool:
        """Whether a table the programmer wrote is gone (someone deleted it): if so, the tables
        are written again (in the background, as a member update)."""
        programmer = self._programmer
        if programmer is None or programmer.current is None:
            return False
        gone = False
        for family, table in sorted(programmer.current.tables):
            counts = await programmer.nft.acounters(family, table)
            if isinstance(counts, TableAbsent) and programmer.table_absent(family, table):
                gone = True
        if gone:
            self._start()
        return gone

    def _announce(self) -> None:
        """Once the tables are first in place."""
        if self._announced:
            return
        self._announced = True
        for version, (cluster, _subnet) in sorted(self.networks.items()):
            log.info("masquerading traffic from %s to outside it (nftables table %s %s)", cluster, FAMILIES[version], TABLE)

    def _failed(self, err: NftError, delay: float) -> None:
        self.error = str(err)
        log.error("the masquerading tables (cluster members included) are not up to date: %s; trying again in %.0fs",
                  err, delay)  # fmt: skip

    def set_members(self, members: Iterable[str]) -> None:
        """The node list's members (read: from now on the sets hold exactly these)."""
        members = frozenset(members)
        same = members == self.members and self.members_known
        self.members, self.members_known = members, True
        if same or self._programmer is None:  # not programmed (off, or no libnftables): nothing to keep
            return
        self._start()

    def _start(self, delay: float = 0.0) -> None:
        if self._task is not None and not self._task.done():
            self._again = True  # the running one syncs again after its transaction
            return
        self._task = asyncio.get_running_loop().create_task(self._resync(delay))

    async def _resync(self, delay: float = 0.0) -> None:
        """Sync until the tables hold the latest members: at once, again after a change that
        came meanwhile, and after ``delay`` seconds (doubling up to RETRY_MAX) while the kernel
        refuses -- the members stay the same then, and nothing else would try again."""
        while True:
            if delay:
                await self._sleep(delay)
            self._again = False
            try:
                await self._sync()
            except NftError as err:
                delay = min(max(delay * 2, RETRY_INITIAL), RETRY_MAX)
                self._failed(err, delay)
                continue
            if self.error is not None:
                log.info("the masquerading tables are up to date again")
                self.error = None
            self._announce()
            delay = 0.0
            if not self._again:
                return

    async def _sync(self) -> None:
        if self._programmer is None:
            self._programmer = NftProgrammer(await asyncio.to_thread(Nft), TABLES, "masquerading")
        await self._programmer.sync(self.ruleset())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._programmer is not None:
            await asyncio.to_thread(self._programmer.nft.close)
            self._programmer = None


async def program(networks: Mapping[int, tuple[Network, Network]], members: Iterable[str] = ()) -> None:
    """A :class:`Masquerade`'s tables, once (tests, tools)."""
    m = Masquerade(networks)
    m.set_members(members)
    try:
        await m.program()
    finally:
        await m.close()


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
