"""Who an address is and what a drop prefix means, for the flow recorder: what the policy and
services agents already know, never a second copy.

* a pod anywhere in the cluster, by address: the policy engine's pods (from every node's pod
  records in etcd), with its labels and node; the :class:`Identity` objects are cached per
  pod record so every record of a pod shares one;
* a Service, by virtual IP (or one of this node's addresses, IPv4 or IPv6: a node port) and
  port: the services agent's ports as last programmed.  The services table translates a node
  port on every address the kernel holds as local (``fib daddr type local``), so a node port
  is named on [node] address / address_v6 and on every address of the kernel's local routing
  table (read again, at most every few seconds, when a node port's port comes on an address
  not known to be local: an address added since);
* a drop prefix: a pod chain's (``pod-in/...``, ``pod-out/...``: the pod, the direction and
  the policies isolating it, :meth:`agentd.policy.agent.PolicyAgent.explain_drop`),
  ``spoofed`` (``spoofed-mac``, ``spoofed-arp``, ``spoofed-nd``, ``ra-guard``), ``vlan-tagged``, ``isolated-in`` and ``isolated-out``
  (reason ``isolated``: unrouted traffic to or from an isolated pod), ``other-family``, ``no-route`` (a pod's packet the kernel
  has no route for), or a services refusal chain's (``no-endpoints``, ``no-local-endpoints``);
* the pod on an interface (a spoofed packet's sender): the node's side of each local pod's
  veth, as agentd-cni's endpoint files name it (the policy agent's publisher).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network
from typing import Any

from agentd.flows.model import Identity
from agentd.kernel import netlink as nl
from agentd.policy.agent import PolicyAgent
from agentd.policy.compiler import (
    ISOLATED_IN,
    ISOLATED_OUT,
    NO_ROUTE,
    OTHER_FAMILY,
    RA_GUARD,
    SPOOFED_ARP,
    SPOOFED_MAC,
    SPOOFED_ND,
    SPOOFED_PREFIX,
    VLAN_TAGGED,
)
from agentd.services import compiler as services_compiler
from agentd.services.agent import ServiceAgent

_PROTO = {6: "TCP", 17: "UDP", 132: "SCTP"}


@dataclass(frozen=True)
class DropMeaning:
    reason: str
    direction: str | None = None
    policies: tuple[str, ...] = ()
    default_deny: bool = False


SERVICE_REFUSALS = {services_compiler.REJECT_CHAIN: "no-endpoints", services_compiler.DROP_CHAIN: "no-local-endpoints",
                    services_compiler.NO_PORT_CHAIN: "no-service-port", services_compiler.NO_SERVICE_CHAIN: "no-service"}


def _no_service(ip: str, proto: int, port: int) -> str | None:
    return None


LOCAL_REREAD = 5.0  # seconds: the kernel's local addresses are read again at most this often


def kernel_local_networks() -> list[IPv4Network | IPv6Network]:
    """What the kernel holds as this node's own addresses, both families: the ``local``
    routes of its local table (``ip route show table local type local``), which is what the
    services table's ``fib daddr type local`` asks (an address, or a prefix routed as local)."""
    from agentd.kernel.rtnl import Rtnl

    out: list[IPv4Network | IPv6Network] = []
    with Rtnl() as rt:
        for family, size in ((nl.AF_INET, 4), (nl.AF_INET6, 16)):
            for r in rt.routes(family, nl.RT_TABLE_LOCAL):
                if r.type == nl.RTN_LOCAL:
                    out.append(ip_network((ip_address(r.dst or bytes(size)), r.dst_len), strict=False))
    return out


class _ServiceNames:
    """A Service's name by the address, protocol and port a client used (its cluster IP, or
    a node port of one of this node's addresses), as the Services were at one sync."""

    __slots__ = ("local", "nodeports", "vips")

    def __init__(self, vips: dict[tuple[str, str, int], str], nodeports: dict[tuple[str, int], str],
                 local: Callable[[str], bool]) -> None:
        self.vips, self.nodeports, self.local = vips, nodeports, local

    def name(self, ip: str, proto: int, port: int) -> str | None:
        protocol = _PROTO.get(proto)
        if protocol is None:
            return None
        name = self.vips.get((ip, protocol, port))
        if name is None:
            # Not a cluster IP: a node port, where the address is the node's own (the services
            # table translates and refuses node ports on every local address but loopback).
            name = self.nodeports.get((protocol, port))
            if name is not None and not self.local(ip):
                name = None
        return name


class FlowDirectory:
    def __init__(self, policy: PolicyAgent | None, services: ServiceAgent | None,
                 node_addresses: Iterable[object | None],
                 local_networks: Callable[[], Iterable[IPv4Network | IPv6Network]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``node_addresses``: the node's addresses a node port is reached on ([node] address
        and address_v6; None, a family the node has not, left out).  ``local_networks``: reads
        every address the kernel holds as local (:func:`kernel_local_networks`), on which a
        node port is reached too; None: only ``node_addresses``."""
        self.policy = policy
        self.services = services
        if isinstance(node_addresses, str):  # one address
            node_addresses = (node_addresses,)
        self.node_addresses = frozenset(str(a) for a in node_addresses if a is not None)
        self._read_local = local_networks
        self._clock = clock
        self._local_hosts: frozenset[str] = frozenset()
        self._local_nets: tuple[IPv4Network | IPv6Network, ...] = ()
        self._local_read_at: float | None = None
        self._ids: dict[tuple[str, str], tuple[Any, Identity]] = {}  # pod key -> (its Pod, identity)
        self._names: Callable[[str, int, int], str | None] = _no_service
        self._services_seen = -1

    def version(self) -> int:
        """Changes whenever a pod's record does: an address may be someone else since."""
        return self.policy.engine.pods_version if self.policy is not None else 0

    def named_before(self, count: int | None) -> tuple[int, list[tuple[str, Identity, float | None]] | None]:
        """Addresses that may name someone else since the ``count`` th change (None: from
        now on), each with whom it named before and when it changed (CLOCK_REALTIME s),
        oldest first, and the count now; None for the list if some of those changes are no
        longer known."""
        if self.policy is None:
            return 0, []
        engine = self.policy.engine
        now = engine.named_before_count
        if count is None:
            return now, []
        got = engine.named_before_since(count)
        if got is None:
            return now, None
        return now, [(ip, self._identity_then(pod, local), when) for ip, pod, local, when in got]

    def _identity_then(self, pod: Any, local: bool) -> Identity:
        cached = self._ids.get(pod.key)
        if cached is not None and cached[0] is pod and cached[1].local == local:
            return cached[1]
        return Identity(f"{pod.namespace}/{pod.name}", pod.node, dict(pod.labels), local)

    def identity(self, ip: str) -> Identity | None:
        if self.policy is None:
            return None
        engine = self.policy.engine
        key = engine.by_ip.get(ip)
        if key is None:
            return None
        return self._identity_of(key)

    def _identity_of(self, key: Any) -> Identity | None:
        engine = self.policy.engine  # type: ignore[union-attr]
        pod = engine.pods.get(key)
        if pod is None:
            return None
        cached = self._ids.get(key)
        if cached is not None and cached[0] is pod:
            return cached[1]
        ident = Identity(f"{pod.namespace}/{pod.name}", pod.node, dict(pod.labels), key in engine.local)
        if len(self._ids) > 2 * len(engine.pods) + 64:
            # Pods gone or changed since: their entries go (amortised: at most half are live).
            # A recorded flow keeps the Identity it was named with, and named_before names a
            # departed pod from the policy engine's own record of it (_identity_then).
            self._ids = {k: v for k, v in self._ids.items() if engine.pods.get(k) is v[0]}
        if len(self._ids) > 100_000:
            self._ids.clear()
        self._ids[key] = (pod, ident)
        return ident

    def pod_on(self, ifindex: int) -> tuple[str, Identity | None] | None:
        try:
            name = socket.if_indextoname(ifindex)  # this node's namespace: the agent's own
        except OSError:  # gone since the packet was logged
            return None
        if self.policy is None:
            return name, None
        for ep in self.policy.publisher.endpoints.values():  # this node's pods: a short scan, for rate-limited drops
            if ep.interface == name:
                return name, self._identity_of(ep.key)
        return name, None

    def is_local(self, ip: str) -> bool:
        """Whether ``ip`` is one of the node's own addresses but loopback (where the services
        table translates node ports): [node] address / address_v6, or an address the kernel
        holds as local, read again on a miss at most every LOCAL_REREAD seconds."""
        if ip in self.node_addresses or ip in self._local_hosts:
            return True
        try:
            address = ip_address(ip)
        except ValueError:
            return False
        if address.is_loopback:
            return False
        if any(address in n for n in self._local_nets):
            return True
        if self._read_local is None:
            return False
        now = self._clock()
        if self._local_read_at is not None and now - self._local_read_at < LOCAL_REREAD:
            return False
        self._local_read_at = now
        try:
            nets = list(self._read_local())
        except (OSError, ValueError):  # the routing table unreadable: what was read stays
            return False
        self._local_hosts = frozenset(str(n.network_address) for n in nets if n.prefixlen == n.max_prefixlen)
        self._local_nets = tuple(n for n in nets if n.prefixlen != n.max_prefixlen and not n.network_address.is_loopback)
        return ip in self._local_hosts or any(address in n for n in self._local_nets)

    def service(self, ip: str, proto: int, port: int) -> str | None:
        return self.service_names()(ip, proto, port)

    def service_names(self) -> Callable[[str, int, int], str | None]:
        """The Services as they are now (rebuilt after each sync of the services agent, never
        changed after): a record made later from an event of now names the Service it went to
        then, not one that took its address since."""
        if self.services is None:
            return _no_service
        if self._services_seen != self.services.syncs:
            vips: dict[tuple[str, str, int], str] = {}
            nodeports: dict[tuple[str, int], str] = {}
            # As compiled, not as asked: a cluster IP or node port two Services claim is named
            # after the one it is translated to (the older), not whichever was listed last.
            for sp in self.services.compiled_ports:
                name = f"{sp.namespace}/{sp.service}"
                if sp.cluster_ip is not None:
                    vips[(sp.cluster_ip, sp.protocol, sp.port)] = name
                if sp.node_port is not None:
                    nodeports[(sp.protocol, sp.node_port)] = name
            then = getattr(self._names, "__self__", None)
            # Unchanged (an endpoint's change): the same snapshot, which the recorder's waiting
            # events hold already (a new one has them look their Services up: recorder.py).
            if not (isinstance(then, _ServiceNames) and then.vips == vips and then.nodeports == nodeports):
                self._names = _ServiceNames(vips, nodeports, self.is_local).name
            self._services_seen = self.services.syncs
        return self._names

    def drop(self, prefix: str) -> DropMeaning | None:
        if prefix in (SPOOFED_PREFIX, SPOOFED_MAC, SPOOFED_ARP, SPOOFED_ND, RA_GUARD, VLAN_TAGGED):  # the bridge's: their prefix is the reason
            return DropMeaning(prefix, "egress")
        if prefix in (ISOLATED_IN, ISOLATED_OUT):  # crossing the bridge unrouted to or from an isolated pod
            return DropMeaning("isolated", "ingress" if prefix == ISOLATED_IN else "egress")
        if prefix == OTHER_FAMILY:  # a pod's packet of a family the cluster does not run
            return DropMeaning(OTHER_FAMILY, "egress")
        if prefix == NO_ROUTE:  # a pod's packet the kernel drops for want of a route: always on its way out
            return DropMeaning(NO_ROUTE, "egress")
        reason = SERVICE_REFUSALS.get(prefix)
        if reason is not None:
            return DropMeaning(reason)
        if self.policy is not None:
            explained = self.policy.explain_drop(prefix)
            if explained is not None:
                direction, _key, policies, default_deny = explained
                return DropMeaning("policy", direction, tuple(policies), default_deny)
        if prefix.startswith(("pod-in/", "pod-out/")):  # a pod gone since the packet was logged
            return DropMeaning("policy", "ingress" if prefix.startswith("pod-in/") else "egress")
        return None
