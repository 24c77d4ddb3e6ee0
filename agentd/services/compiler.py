"""Services -> the node's ``ip agentd-services`` nftables table (and ``ip6 agentd-services``).  Pure: ServicePorts in, a Ruleset out.

The table (kube-proxy's nftables mode, in agentd's own table, but with the endpoints in maps)::

    map service-ips       { ipv4_addr . inet_proto . inet_service : verdict }   VIP . proto . port -> goto pick/N
    map service-nodeports { inet_proto . inet_service : verdict }                proto . node port -> goto np-pick/N
    chain prerouting   { type nat hook prerouting priority dstnat; jump services }
    chain output       { type nat hook output priority dstnat; jump services }
    map nodeport-short-circuit { inet_proto . inet_service : verdict }          Local node ports -> goto np-local/N (every usable endpoint)
    chain services     { ip daddr . meta l4proto . th dport vmap @service-ips
                         fib daddr type local ip daddr != 127.0.0.0/8 goto nodeports }
    chain nodeports    { ip saddr <this node's pod subnet> meta l4proto . th dport vmap @nodeport-short-circuit
                         fib saddr type local meta l4proto . th dport vmap @nodeport-short-circuit
                         meta l4proto . th dport vmap @service-nodeports }
    set hairpin-self   { ipv4_addr . ipv4_addr }                                this node's endpoints E, as E . E
    chain postrouting  { type nat hook postrouting priority srcnat;
                         ct status dnat ip saddr . ip daddr @hairpin-self masquerade fully-random
                         meta mark & 0x4000 == 0 return
                         meta mark set meta mark ^ 0x4000          (cleared: not on an encapsulated packet)
                         masquerade fully-random }
    chain filter-forward { type filter hook forward priority dstnat + 1;     (only while translating with
                         meta l4proto tcp ct state invalid drop }           nf_conntrack_tcp_be_liberal 0)
    chain filter-prerouting, filter-output { type filter hook prerouting / output priority dstnat + 1;
                         ct state new ip daddr . meta l4proto . th dport vmap @service-unavailable
                         ct state new fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @nodeport-unavailable
                         ct state new ip daddr @cluster-ips goto no-service-port        (reject)
                         ct state new ip daddr <the service range> goto no-service }    (drop)
    set cluster-ips    { ipv4_addr }                                            every cluster IP

    chain pick/N       (one per endpoint count N in use, shared by every service with N endpoints)
                       ip saddr != <this node's pod subnet> meta mark set meta mark | 0x4000
                       counter name ip daddr . meta l4proto . th dport map @service-counters
                       numgen random mod N vmap { 0 : goto slot/0, ..., N-1 : goto slot/N-1 }
    chain slot/i       dnat to ip daddr . meta l4proto . th dport map @addr/i : ... map @port/i
    map addr/i, port/i { VIP . proto . port : the address / port of the service's i-th endpoint }

    node ports alike: np-pick/N (externalTrafficPolicy Cluster: marked for masquerade),
    np-local/N (Local: client address kept; the node's own traffic marked), np-slot/i with the
    maps np-addr/i and np-port/i keyed by proto . node port.  A Local node port's slots hold
    this node's endpoints first, then the others: from outside, np-local/L picks among the L
    of this node; from this node or its pods, kube-proxy's short-circuit, np-local/N among all
    N usable ones -- but while this node's are all terminating and others ready (which the
    short-circuit takes alone), a chain of the Service's own (short-circuit/...) picks among
    the slots after this node's.

So 10,000 services are one map lookup, not a chain walk, and a Service's endpoints are map
elements, not rules: an endpoint appearing, leaving or becoming ready changes elements only,
which go to the kernel as one nf_tables element batch (:mod:`agentd.nft.nfnetlink`)
without libnftables reading the table first.  The pick chains of 1 to ``SLOTS_MIN`` endpoints
and their slots are prepared at start; above that, there are slots up to the largest count
in use and pick chains for the counts in use only (a chain for each count up to the largest
would be ~1.5 N^2 vmap entries: 1,000 endpoints, 60 MB of rules), so the table grows linearly
with the endpoints.  Rules change when a Service above ``SLOTS_MIN`` reaches a count whose
chains are not there, for ClientIP affinity, and for a Local node port's own short-circuit
chain (coming, going, or its counts changing).  A count no longer used keeps its chains
while it is near one in use (within a quarter, the ``RETAIN`` most recent): a rolling update
going back and forth between counts changes rules once per count, then elements only.

A connection picks an endpoint at random once (NAT rules see only a connection's first
packet; conntrack does the rest, which is also why a terminating endpoint keeps its
established connections).  SNAT happens only where it is needed: a pod reaching itself
through its service (hairpin: decided after the endpoint is chosen, in postrouting, by the
translated connection's source and destination being one of this node's endpoints, as
kube-proxy marks only the endpoint reaching itself -- a pod reaching a sibling endpoint
keeps its address, on this node or another, whose reply comes back through this node
anyway: it is routed to the client's node, where conntrack undoes the DNAT), node ports
with externalTrafficPolicy Cluster (the endpoint may be on another node, whose reply would
not come back through this node otherwise), a node's own connections to its Local node
ports (their source, the node port's address, is the node's), and connections to a cluster
IP not from this node's pods (kube-proxy's mark of "off-cluster traffic to a service VIP",
its detect-local NodeCIDR mode): the node itself and its hostNetwork pods, whose source
address the kernel chose by the route to the VIP, before the translation -- the underlay
address, where an endpoint on another node is reached through the tunnel, whose reply would
cross the underlay unencapsulated with a pod's source address --, and traffic routed here
from outside.  A port without usable endpoints is not translated but
refused (ICMP port unreachable, as kube-proxy does), or dropped where a Local traffic policy
keeps it off other nodes' endpoints.

externalTrafficPolicy Local is for traffic from outside the node.  A node port reached from
the node itself or from one of its pods is short-circuited to every usable endpoint of the
Service, as kube-proxy does (pkg/proxy/nftables/proxier.go and pkg/proxy/iptables/proxier.go,
the "external" chain: pod traffic to the cluster policy's endpoints, the node's own traffic
masqueraded and to them too), so such a node without endpoints of its own still reaches the
Service; the cluster policy's endpoints are the ready ones wherever they are (the terminating
ones only when none is ready anywhere), as for the cluster IP.  "From this node" is ``fib
saddr type local``; "one of its pods" is a source in the node's pod subnet of the family
(kube-proxy's ``--detect-local-mode=NodeCIDR``).

Services with ClientIP affinity keep a chain of their own, one chain per endpoint and a
timeout set per endpoint (``svc/...``, ``ext/...``, ``ep/...``, ``aff/.../TIMEOUT``): the affinity
sets are per endpoint, so changing their endpoints rewrites rules (through libnftables); a
changed timeout is a new set (its name holds the timeout), the old one deleted after the
chains that used it are rewritten.

IPv6 (dual-stack and IPv6-only clusters) has a table of its own, ``ip6 agentd-services``, the
same objects with IPv6 addresses: one table per family, as kube-proxy runs one proxier per
family, so that every map is keyed by one address type and an IPv4 node's table is what it
was.  A Service's IPv6 cluster IP and IPv6 endpoints go there (``ServicePort.family``), its
node ports too, reached on the node's IPv6 addresses (``fib daddr type local``, ``::1`` aside).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from agentd.nft.expr import (
    IPV4, SUPPRESSED, AddressFamily, DropLog, FAMILIES, families as rows, goto, match, meta, object_name, payload, prefix,
)  # fmt: skip
from agentd.nft.ruleset import Elements, NftChain, NftCounter, NftSet, Ruleset, rule_text

from .model import Endpoint, ServicePort

log = logging.getLogger("agentd.services")

FAMILY = "ip"  # the IPv4 table's family (the IPv6 table's: "ip6")
TABLE = "agentd-services"
TABLES = frozenset({(FAMILY, TABLE), ("ip6", TABLE)})  # what the programmer owns; a node has those of its families
SERVICE_IPS = "service-ips"
NODE_PORTS = "service-nodeports"
HAIRPIN = "hairpin-self"  # address . address: this node's endpoints E as E . E (a DNATed flow from E to E: masqueraded)
CLUSTER_IPS = "cluster-ips"  # every cluster IP translated here (a new connection still to one: a port it lacks, refused)
NP_SHORT_CIRCUIT = "nodeport-short-circuit"  # proto . node port : goto the choice among every usable endpoint (Local node ports)
SVC_COUNTERS = "service-counters"  # VIP . proto . port : the service's counter
NP_COUNTERS = "nodeport-counters"  # proto . node port : the service's counter
UNAVAILABLE = "service-unavailable"  # VIP . proto . port : goto reject or drop (no usable endpoint)
NP_UNAVAILABLE = "nodeport-unavailable"  # proto . node port : the same for node ports
REJECT_CHAIN, DROP_CHAIN = "no-endpoints", "no-local-endpoints"
# A cluster IP's port no Service has: refused; an address of the service range no Service has: dropped (kube-proxy's cluster-ips-check).
NO_PORT_CHAIN, NO_SERVICE_CHAIN = "no-service-port", "no-service"
SLOTS_MIN = 16  # endpoint counts prepared at start: up to this many, an endpoint change is elements only
RETAIN = 4  # pick chains of counts above SLOTS_MIN no longer in use kept (near one in use; the most recent)
MASQ_MARK = 0x4000  # kube-proxy's masquerade bit
DSTNAT, SRCNAT = -100, 100
FORWARD_CHAIN = "filter-forward"  # ct state invalid drop, while conntrack's TCP window check is strict


MARK_MASQ = {"mangle": {"key": meta("mark"), "value": {"|": [meta("mark"), MASQ_MARK]}}}
UNMARK_MASQ = {"mangle": {"key": meta("mark"), "value": {"^": [meta("mark"), MASQ_MARK]}}}  # the bit known set: cleared
MASQUERADE = {"masquerade": {"flags": ["fully-random"]}}
SADDR = payload("ip", "saddr")
FROM_NODE = match({"fib": {"result": "type", "flags": ["saddr"]}}, "local")  # sent by this node itself
CT_NEW = match({"ct": {"key": "state"}}, "new", "in")  # a connection's first packet




def tables(versions: Iterable[int]) -> frozenset[tuple[str, str]]:
    """The tables a node serving Services of IP ``versions`` has."""
    return frozenset((f.proto, TABLE) for f in rows(versions))


def svc_chain(sp: ServicePort) -> str:
    return object_name("svc", sp.namespace, sp.service, sp.l4, sp.port)


def ext_chain(sp: ServicePort) -> str:
    return object_name("ext", sp.namespace, sp.service, sp.l4, sp.port)


def short_circuit_chain(sp: ServicePort) -> str:
    return object_name("short-circuit", sp.namespace, sp.service, sp.l4, sp.port)


def ep_chain(sp: ServicePort, e: Endpoint) -> str:
    return object_name("ep", sp.namespace, sp.service, sp.l4, sp.port, e.ip, e.port)


def affinity_set(sp: ServicePort, e: Endpoint) -> str:
    """The endpoint's timeout set; its timeout is part of its name, so that a changed timeout
    is a new set the chains are rewritten to use, the old one deleted after them (a set
    still used by a rule cannot be deleted, and a set's timeout cannot be changed in place)."""
    return object_name("aff", sp.namespace, sp.service, sp.l4, sp.port, e.ip, e.port, sp.affinity_timeout)


def counter_name(namespace: str, service: str) -> str:
    return object_name("svc", namespace, service)


_COUNTERS: dict[tuple[str, str, str], NftCounter] = {}


def _counter(namespace: str, service: str, fam: AddressFamily = IPV4) -> NftCounter:
    """One counter object per service and table, shared by its ports (so an unchanged one stays the same object)."""
    got = _COUNTERS.get((fam.proto, namespace, service))
    if got is None:
        if len(_COUNTERS) > 200_000:
            _COUNTERS.clear()
        got = _COUNTERS[(fam.proto, namespace, service)] = NftCounter(fam.proto, TABLE, counter_name(namespace, service))
    return got


def vip_type(fam: AddressFamily) -> tuple[str, ...]:
    return (fam.addr, "inet_proto", "inet_service")


def vip_key(fam: AddressFamily) -> dict[str, Any]:
    return {"concat": [payload(fam.proto, "daddr"), meta("l4proto"), payload("th", "dport")]}


VIP_TYPE = vip_type(IPV4)
NP_TYPE = ("inet_proto", "inet_service")
VIP_KEY = vip_key(IPV4)
NP_KEY = {"concat": [meta("l4proto"), payload("th", "dport")]}
L4_ANY = match(meta("l4proto"), {"set": ["tcp", "udp", "sctp"]})  # dnat to a port needs the protocol known


def pick_chain(n: int) -> str:
    return f"pick/{n}"


def np_pick_chain(n: int, local: bool) -> str:
    return f"np-local/{n}" if local else f"np-pick/{n}"


def _numgen(n: int, slot: str, first: int = 0) -> str:
    """The rule choosing one of ``n`` slots at random, from slot ``first`` on."""
    if n == 1:
        return rule_text([goto(f"{slot}/{first}")])
    pick = {"numgen": {"mode": "random", "mod": n, "offset": first}}
    choices = [[i, goto(f"{slot}/{i}")] for i in range(first, first + n)]
    return rule_text([{"vmap": {"key": pick, "data": {"set": choices}}}])


def slot_objects(i: int, fam: AddressFamily = IPV4) -> list[Any]:
    """Slot ``i``: the i-th endpoint of every service, as two maps per kind and the chain reading them."""
    out: list[Any] = []
    for pre, key_type, key in (("", vip_type(fam), vip_key(fam)), ("np-", NP_TYPE, NP_KEY)):
        addr, port = f"{pre}addr/{i}", f"{pre}port/{i}"
        out += [
            NftSet(fam.proto, TABLE, addr, key_type, map=fam.addr),
            NftSet(fam.proto, TABLE, port, key_type, map="inet_service"),
            NftChain(fam.proto, TABLE, f"{pre}slot/{i}", (rule_text([L4_ANY, {"dnat": {
                "family": fam.proto,
                "addr": {"map": {"key": key, "data": "@" + addr}},
                "port": {"map": {"key": key, "data": "@" + port}},
            }}]),)),
        ]  # fmt: skip
    return out


def not_from_pods(fam: AddressFamily, pod_subnet: str | None) -> list[Any]:
    """The match of a connection to a cluster IP that is masqueraded: one not from this node's
    pods (kube-proxy's "masquerade off-cluster traffic to a service VIP", its detect-local
    NodeCIDR mode, as the short-circuit's "one of its pods"): the node itself and its
    hostNetwork pods, whose source the kernel chose by the route to the VIP -- not the one
    that reaches another node's endpoint through the tunnel, whose reply would come back
    unencapsulated --, and anything routed here from outside.  Another node's pods translate
    their connections on their own node; one of theirs reaching here untranslated is
    masqueraded too (its endpoint's reply could not find its way back through this node
    otherwise).  Without the pod subnet known: the node's own traffic only."""
    if pod_subnet:
        return [match(payload(fam.proto, "saddr"), prefix(pod_subnet), "!=")]
    return [FROM_NODE]


def pick_objects(n: int, fam: AddressFamily = IPV4, pod_subnet: str | None = None) -> list[Any]:
    """The chains choosing one of ``n`` endpoints: for VIPs (a connection not from this node's
    pods, ``pod_subnet``, marked for masquerading: :func:`not_from_pods`), Cluster node ports,
    Local node ports (the node's own traffic reaches those short-circuited only, masqueraded as
    by kube-proxy: the node port's address, one of the node's, is its source)."""
    count = rule_text([{"counter": {"map": {"key": vip_key(fam), "data": "@" + SVC_COUNTERS}}}])
    t = fam.proto
    return [
        NftChain(t, TABLE, pick_chain(n), (rule_text([*not_from_pods(fam, pod_subnet), MARK_MASQ]), count, _numgen(n, "slot"))),
        NftChain(t, TABLE, np_pick_chain(n, False), (rule_text([MARK_MASQ]), NP_COUNT, _numgen(n, "np-slot"))),
        NftChain(t, TABLE, np_pick_chain(n, True), (rule_text([FROM_NODE, MARK_MASQ]), NP_COUNT, _numgen(n, "np-slot"))),
    ]


NP_COUNT = rule_text([{"counter": {"map": {"key": NP_KEY, "data": "@" + NP_COUNTERS}}}])  # a node port's counter


def own_short_circuit(sp: ServicePort, fam: AddressFamily, first: int, n: int) -> NftChain:
    """A Local node port's short-circuit of its own (``short-circuit/...``): the choice among
    the ``n`` node port slots from ``first`` on, as the shared ``np-local/N`` chooses among the
    first N (the node's own traffic masqueraded).  For the one case the shared slots cannot
    serve: this node's endpoints all terminating while others are ready (compile_port)."""
    return NftChain(fam.proto, TABLE, short_circuit_chain(sp), (
        rule_text([FROM_NODE, MARK_MASQ]), NP_COUNT, _numgen(n, "np-slot", first)))  # fmt: skip


def base_objects(
    slots: int = SLOTS_MIN, log: DropLog | None = None, *, fam: AddressFamily = IPV4, pod_subnet: str | None = None,
    service_range: str | None = None, drop_invalid: bool = False,
) -> list[Any]:
    """The fixed part of family ``fam``'s table, prepared for services of up to ``slots``
    endpoints (the maps empty); with ``log`` the refusals are logged for flow records
    (prefix: the chain's name).  ``pod_subnet``: this node's pods' subnet of the family, whose
    traffic to a Local node port is short-circuited (none: only the node's own is).
    ``service_range``: the cluster IPs' range of the family, whose addresses no Service has
    are dropped (none: not checked).  ``drop_invalid``: with the forward hook's chain dropping
    TCP conntrack deems invalid (:func:`invalid_drop`)."""
    local = match({"fib": {"result": "type", "flags": ["daddr"]}}, "local")
    not_loopback = match(payload(fam.proto, "daddr"), prefix(fam.loopback), "!=")
    # Hairpin, decided after the endpoint is chosen: a translated connection from one of this
    # node's endpoints to itself (its reply would not leave the pod otherwise).
    hairpin = [match({"ct": {"key": "status"}}, "dnat", "in"),
               match({"concat": [payload(fam.proto, "saddr"), payload(fam.proto, "daddr")]}, "@" + HAIRPIN)]
    short_circuit = {"vmap": {"key": NP_KEY, "data": "@" + NP_SHORT_CIRCUIT}}
    t, key, key_type = fam.proto, vip_key(fam), vip_type(fam)
    out: list[Any] = [
        NftSet(t, TABLE, SERVICE_IPS, key_type, map="verdict"),
        NftSet(t, TABLE, NODE_PORTS, NP_TYPE, map="verdict"),
        NftSet(t, TABLE, NP_SHORT_CIRCUIT, NP_TYPE, map="verdict"),
        NftSet(t, TABLE, HAIRPIN, (fam.addr, fam.addr)),
        NftSet(t, TABLE, SVC_COUNTERS, key_type, map="counter"),
        NftSet(t, TABLE, NP_COUNTERS, NP_TYPE, map="counter"),
        NftChain(t, TABLE, "services", (
            rule_text([{"vmap": {"key": key, "data": "@" + SERVICE_IPS}}]),
            rule_text([local, not_loopback, goto("nodeports")]),
        )),
        # A node port from this node's pods or from the node itself: a Local one goes to every
        # usable endpoint (kube-proxy's short-circuit); anything else, and traffic from outside,
        # as the node port's policy says.
        NftChain(t, TABLE, "nodeports", (
            *([rule_text([match(payload(t, "saddr"), prefix(pod_subnet)), short_circuit])] if pod_subnet else []),
            rule_text([FROM_NODE, short_circuit]),
            rule_text([{"vmap": {"key": NP_KEY, "data": "@" + NODE_PORTS}}]),
        )),
        NftChain(t, TABLE, "prerouting", (rule_text([{"jump": {"target": "services"}}]),),
                 hook=("nat", "prerouting", DSTNAT, "accept")),
        NftChain(t, TABLE, "output", (rule_text([{"jump": {"target": "services"}}]),),
                 hook=("nat", "output", DSTNAT, "accept")),
        # A packet marked for masquerading has the bit cleared first, as kube-proxy does
        # (kubernetes#92035): vxlan and ipip keep the skb mark on the encapsulated packet,
        # whose outer header would be masqueraded too otherwise.  Fully random source ports,
        # as the agent's other masquerading (agentd.nft.masquerade).
        NftChain(t, TABLE, "postrouting", (
            rule_text([*hairpin, MASQUERADE]),
            rule_text([match({"&": [meta("mark"), MASQ_MARK]}, 0), {"return": None}]),
            rule_text([UNMARK_MASQ]),
            rule_text([MASQUERADE]),
        ), hook=("nat", "postrouting", SRCNAT, "accept")),
        # A port without usable endpoints is refused, as kube-proxy does: no endpoint at all,
        # ICMP port unreachable (a TCP client sees "connection refused" at once instead of a
        # timeout); endpoints only on other nodes under a Local policy, dropped.  Looked at
        # right after the nat chains (a translated packet no longer has the VIP), before routing,
        # for a connection's first packet only (``ct state new``, as kube-proxy): the other
        # packets of the node skip the lookups, and a reply to one of the node's own sockets
        # whose port is a node port without endpoints is not refused.  Then, as kube-proxy's
        # cluster-ips-check: a new connection still to a cluster IP (not translated: a port
        # no Service of it has) is refused, one to another address of the service range dropped.
        NftSet(t, TABLE, UNAVAILABLE, key_type, map="verdict"),
        NftSet(t, TABLE, NP_UNAVAILABLE, NP_TYPE, map="verdict"),
        NftSet(t, TABLE, CLUSTER_IPS, (fam.addr,)),
        *_refusals(log, fam),
        *(NftChain(t, TABLE, f"filter-{hook}", (
            rule_text([CT_NEW, {"vmap": {"key": key, "data": "@" + UNAVAILABLE}}]),
            rule_text([CT_NEW, local, not_loopback, {"vmap": {"key": NP_KEY, "data": "@" + NP_UNAVAILABLE}}]),
            rule_text([CT_NEW, match(payload(t, "daddr"), "@" + CLUSTER_IPS), goto(NO_PORT_CHAIN)]),
            *([rule_text([CT_NEW, match(payload(t, "daddr"), prefix(service_range)), goto(NO_SERVICE_CHAIN)])]
              if service_range else []),
        ), hook=("filter", hook, DSTNAT + 1, "accept")) for hook in ("prerouting", "output")),
    ]  # fmt: skip
    if drop_invalid:
        out.append(invalid_drop(fam))
    for i in range(slots):
        out += slot_objects(i, fam)
    for n in range(1, slots + 1):
        out += pick_objects(n, fam, pod_subnet)
    return out


def invalid_drop(fam: AddressFamily = IPV4) -> NftChain:
    """kube-proxy's ``ct state invalid drop`` on the forward hook (unless conntrackTCPLiberal;
    kubernetes#74839, #117924): with conntrack's TCP window check strict
    (``nf_conntrack_tcp_be_liberal`` 0), an endpoint's reply conntrack finds out of window is
    invalid, not translated back: it would reach the client from the endpoint's own address,
    the client answers with a RST, and a long or busy connection through a Service is reset.
    TCP only: the window check is the case, and an ICMP error conntrack knows no flow of (one
    the BPF data path or the pod fast path carried past it) still brings a path MTU or an
    unreachable to its sender.  Only forwarded packets meet it: the node's own (BGP, BFD, the
    tunnels' outer packets, the udp backend's) are on the input and output hooks."""
    return NftChain(fam.proto, TABLE, FORWARD_CHAIN, (
        rule_text([match(meta("l4proto"), "tcp"), match({"ct": {"key": "state"}}, "invalid", "in"), {"drop": None}]),
    ), hook=("filter", "forward", DSTNAT + 1, "accept"))  # fmt: skip


def _refusals(log: DropLog | None, fam: AddressFamily = IPV4) -> list[Any]:
    """The chains of ports without usable endpoints (reject, drop), of a cluster IP's port no
    Service has (reject) and of a service range address no Service has (drop), logged with ``log``."""
    t = fam.proto
    verdicts = ((REJECT_CHAIN, "reject"), (DROP_CHAIN, "drop"), (NO_PORT_CHAIN, "reject"), (NO_SERVICE_CHAIN, "drop"))
    if log is None:
        return [NftChain(t, TABLE, name, (rule_text([{verdict: None}]),)) for name, verdict in verdicts]
    return [NftCounter(t, TABLE, SUPPRESSED),
            *(NftChain(t, TABLE, name, log.chain_rules(name, [{verdict: None}])) for name, verdict in verdicts)]


MapKey = tuple[str, str]  # (table family, map or set name)


class Compiled:
    """What one service port compiles to: objects of its own (affinity chains, its counter),
    elements in the shared maps, and the endpoint counts whose pick chains it uses (a
    negative one -N: the slots up to N only, which its own chain picks from)."""

    __slots__ = ("objects", "elements", "sizes")

    def __init__(self, objects: list[Any], elements: dict[tuple[str, str], set[Any]], sizes: tuple[int, ...] = ()) -> None:
        self.objects = objects
        self.elements = elements
        self.sizes = sizes


def compile_port(sp: ServicePort, node: str, pod_subnets: Mapping[int, str] | None = None) -> Compiled:
    """The objects and map elements of one service port on ``node``; its elements are keyed
    by (table family, map name): the port's family decides the table.  ``pod_subnets``: this
    node's pod subnet per IP version (a ClientIP affinity Service's chain marks a connection
    to its cluster IP not from them for masquerading, as the shared pick chains do)."""
    fam = FAMILIES[sp.family]
    counter = _counter(sp.namespace, sp.service, fam)
    objs: list[Any] = [counter]
    elements: dict[tuple[str, str], set[Any]] = {}

    def put(name: str, elem: Any) -> None:
        elements.setdefault((fam.proto, name), set()).add(elem)

    if sp.cluster_ip is not None:
        put(CLUSTER_IPS, sp.cluster_ip)
    if sp.affinity_timeout is not None:
        _compile_affinity(sp, node, fam, objs, put, (pod_subnets or {}).get(fam.version))
        return Compiled(objs, elements)
    every, local = sp.usable(), sp.usable(node)
    sizes: set[int] = set()
    if sp.cluster_ip is not None:
        chosen = local if sp.internal_local else every
        if chosen:
            key = (sp.cluster_ip, sp.l4, sp.port)
            put(SERVICE_IPS, (key, ("goto", pick_chain(len(chosen)))))
            put(SVC_COUNTERS, (key, counter.name))
            for i, e in enumerate(chosen):
                put(f"addr/{i}", (key, e.ip))
                put(f"port/{i}", (key, e.port))
            sizes.add(len(chosen))
        else:
            put(UNAVAILABLE, ((sp.cluster_ip, sp.l4, sp.port), _unavailable(every)))
    if sp.node_port is not None:
        key = (sp.l4, sp.node_port)
        # The short-circuit (externalTrafficPolicy Local, from this node or its pods) chooses
        # among every usable endpoint, kube-proxy's cluster policy chain: the ready ones
        # wherever they are (sp.short_circuit_endpoints).  The slots hold this node's
        # endpoints first, the others after them: from outside the choice is among the first
        # L (np-local/L).  Where this node's are among every usable one (ready, or none ready
        # anywhere), the short-circuit is the shared np-local/N over the first N.  Only while
        # this node's are all terminating and others ready are they not: the N ready ones
        # follow the L terminating ones in the slots, and the short-circuit is a chain of the
        # Service's own choosing among slots L to L+N-1, none of this node's.
        shared = not sp.external_local or set(local) <= set(every)
        if sp.external_local:
            chosen, outside = local + tuple(e for e in every if e not in local), len(local)
        else:
            chosen, outside = every, len(every)
        for i, e in enumerate(chosen):
            put(f"np-addr/{i}", (key, e.ip))
            put(f"np-port/{i}", (key, e.port))
        if chosen:
            put(NP_COUNTERS, (key, counter.name))
        if outside:
            put(NODE_PORTS, (key, ("goto", np_pick_chain(outside, sp.external_local))))
            sizes.add(outside)
        else:
            put(NP_UNAVAILABLE, (key, _unavailable(every)))
        if sp.external_local and every:
            if shared:
                put(NP_SHORT_CIRCUIT, (key, ("goto", np_pick_chain(len(every), True))))
                sizes.add(len(every))
            else:
                objs.append(own_short_circuit(sp, fam, len(local), len(every)))
                put(NP_SHORT_CIRCUIT, (key, ("goto", short_circuit_chain(sp))))
                sizes.add(-len(chosen))  # slots up to there, no pick chain of that count
    # This node's endpoints (and those of no known node: maybe this one's) among the chosen:
    # one reaching itself through the Service is masqueraded in postrouting.  An element only
    # matches on the endpoint's own node (the client is the endpoint), others are left out.
    translated = sp.cluster_ip is not None or sp.node_port is not None
    for addr in {e.ip for e in (*every, *local) if e.node in (node, None)} if translated else ():
        put(HAIRPIN, (addr, addr))
    return Compiled(objs, elements, tuple(sorted(sizes)))


def _unavailable(every: tuple[Endpoint, ...]) -> tuple[str, str]:
    """Where a port without a usable endpoint here goes: refused if it has none anywhere,
    dropped if its traffic policy keeps it off the endpoints other nodes have."""
    return ("goto", DROP_CHAIN if every else REJECT_CHAIN)


def _compile_affinity(
    sp: ServicePort, node: str, fam: AddressFamily, objs: list[Any], put: Callable[[str, Any], None],
    pod_subnet: str | None = None,
) -> None:
    """ClientIP affinity: a chain for the service (``svc/``) and node port (``ext/``), one per
    endpoint; the service's marks a connection not from this node's pods (``pod_subnet``) for
    masquerading (:func:`not_from_pods`)."""
    counter = {"counter": counter_name(sp.namespace, sp.service)}
    every, local = sp.usable(), sp.usable(node)
    chains: dict[str, Endpoint] = {}
    t = fam.proto
    if sp.cluster_ip is not None:
        chosen = local if sp.internal_local else every
        if chosen:
            mark = rule_text([*not_from_pods(fam, pod_subnet), MARK_MASQ])
            objs.append(NftChain(t, TABLE, svc_chain(sp), (mark, *_dispatch(sp, fam, chosen, counter))))
            chains.update((ep_chain(sp, e), e) for e in chosen)
            put(SERVICE_IPS, ((sp.cluster_ip, sp.l4, sp.port), ("goto", svc_chain(sp))))
        else:
            put(UNAVAILABLE, ((sp.cluster_ip, sp.l4, sp.port), _unavailable(every)))
    if sp.node_port is not None:
        key = (sp.l4, sp.node_port)
        rules: tuple[str, ...] = ()
        # The choice among every endpoint: the cluster IP's chain where it has them all.
        via_svc = sp.cluster_ip is not None and not sp.internal_local
        if every and not via_svc:
            chains.update((ep_chain(sp, e), e) for e in every)
        if sp.external_local:
            if local:
                rules = _dispatch(sp, fam, local, counter)
                chains.update((ep_chain(sp, e), e) for e in local)
            if every:  # from this node or its pods: every endpoint, the node's own traffic masqueraded
                mark = rule_text([FROM_NODE, MARK_MASQ])
                short = (mark, rule_text([goto(svc_chain(sp))])) if via_svc else (mark, *_dispatch(sp, fam, every, counter))
                objs.append(NftChain(t, TABLE, short_circuit_chain(sp), short))
                put(NP_SHORT_CIRCUIT, (key, ("goto", short_circuit_chain(sp))))
        elif every:
            if via_svc:
                rules = (rule_text([MARK_MASQ, goto(svc_chain(sp))]),)
            else:
                rules = (rule_text([MARK_MASQ]), *_dispatch(sp, fam, every, counter))
        if rules:
            objs.append(NftChain(t, TABLE, ext_chain(sp), rules))
            put(NODE_PORTS, (key, ("goto", ext_chain(sp))))
        else:
            put(NP_UNAVAILABLE, (key, _unavailable(every)))
    for chain, e in sorted(chains.items()):
        objs += _endpoint(sp, fam, e, chain)


def _dispatch(sp: ServicePort, fam: AddressFamily, endpoints: tuple[Endpoint, ...], counter: dict[str, Any]) -> tuple[str, ...]:
    saddr = payload(fam.proto, "saddr")
    rules = [rule_text([match(saddr, "@" + affinity_set(sp, e)), counter, goto(ep_chain(sp, e))]) for e in endpoints]
    if len(endpoints) == 1:
        rules.append(rule_text([counter, goto(ep_chain(sp, endpoints[0]))]))
    else:
        pick = {"numgen": {"mode": "random", "mod": len(endpoints), "offset": 0}}
        table = {"set": [[i, goto(ep_chain(sp, e))] for i, e in enumerate(endpoints)]}
        rules.append(rule_text([counter, {"vmap": {"key": pick, "data": table}}]))
    return tuple(rules)


def _endpoint(sp: ServicePort, fam: AddressFamily, e: Endpoint, chain: str) -> list[Any]:
    """An affinity Service's endpoint: its chain (hairpin mark, the client recorded in the
    endpoint's timeout set, dnat) and that set."""
    aff = affinity_set(sp, e)
    saddr = payload(fam.proto, "saddr")
    rules = (
        rule_text([match(saddr, e.ip), MARK_MASQ]),  # hairpin: the pod reaching itself
        rule_text([{"set": {"op": "update", "elem": saddr, "set": "@" + aff}}]),
        # dnat to addr:port needs the protocol known in the rule (the map matched it already).
        rule_text([match(meta("l4proto"), sp.l4), {"dnat": {"addr": e.ip, "port": e.port}}]),
    )
    return [
        NftSet(fam.proto, TABLE, aff, (fam.addr,), flags=("timeout",), timeout=sp.affinity_timeout),
        NftChain(fam.proto, TABLE, chain, rules),
    ]


ServiceKey = tuple[str, str]  # (namespace, name)
Claim = tuple[Any, ...]  # (family, "vip", VIP, proto, port) or (family, "node-port", proto, node port)


def _claims(sp: ServicePort) -> list[Claim]:
    """The keys a service port takes in the shared maps: its VIP's, then its node port's."""
    out: list[Claim] = []
    if sp.cluster_ip is not None:
        out.append((sp.family, "vip", sp.cluster_ip, sp.l4, sp.port))
    if sp.node_port is not None:
        out.append((sp.family, "node-port", sp.l4, sp.node_port))
    return out


def _owner(holders: Mapping[ServiceKey, tuple[Any, ...]]) -> ServiceKey:
    """The oldest claimant (creationTimestamp, then namespace/name)."""
    return min(holders, key=lambda k: holders[k])


class _Log:
    """One shared map of a :class:`Table`: every Service's elements (``have``, the Table's
    own set, changed in place), what came and went since :attr:`Table.rs` last handed out a
    version of it (``added``, ``removed``: net, what came and went in between cancels), and
    that version (``latest``)."""

    __slots__ = ("added", "have", "latest", "removed")

    def __init__(self, have: set[Any]) -> None:
        self.have = have
        self.added: set[Any] = set()
        self.removed: set[Any] = set()
        self.latest: _Version | None = None

    def note(self, gone: set[Any], new: set[Any]) -> None:
        self.removed |= gone - self.added
        self.added -= gone
        self.added |= new - self.removed
        self.removed -= new

    def read(self) -> tuple[frozenset[Any], frozenset[Any]]:
        """A new version of the map (``latest``); its difference from the one before."""
        added, removed = frozenset(self.added), frozenset(self.removed)
        self.added, self.removed = set(), set()
        version = _Version(self)
        if self.latest is not None:
            self.latest.followed(version, added, removed)
        self.latest = version
        return added, removed


class _Version(Elements):
    """A version of a shared map's elements as :attr:`Table.rs` handed it out, made only when
    looked at: the latest from the map's elements now less what changed since, an older one
    from the next version less the difference between them.  An older one holds the next
    (and the differences), never the one before: a version nobody holds goes."""

    __slots__ = ("_added", "_log", "_next", "_removed")

    def __init__(self, log: _Log) -> None:
        super().__init__()
        self._log: _Log | None = log
        self._next: _Version | None = None
        self._added: frozenset[Any] = frozenset()
        self._removed: frozenset[Any] = frozenset()

    def followed(self, version: _Version, added: frozenset[Any], removed: frozenset[Any]) -> None:
        """``version`` came after this one, ``added`` and ``removed`` from it."""
        self._log = None
        if not self.made:
            self._next, self._added, self._removed = version, added, removed

    def _build(self) -> set[Any]:
        # Forward to the latest (or to one already made), then back, undoing each difference:
        # iterative, a chain of versions never read by plan() may be long.
        chain: list[_Version] = []
        v = self
        while not v.made and v._next is not None:
            chain.append(v)
            v = v._next
        if v.made:
            out = set(v.frozen())
        else:
            assert v._log is not None
            out = (v._log.have - v._log.added) | v._log.removed
        for older in reversed(chain):
            out -= older._added
            out |= older._removed
        return out

    def _forget(self) -> None:
        self._log, self._next, self._added, self._removed = None, None, frozenset(), frozenset()


class Table:
    """The table kept up to date service by service: a change costs that service's objects
    and elements.

    :meth:`update` replaces what one Service compiles to and returns the keys of the objects
    that changed (for :meth:`agentd.nft.programmer.NftProgrammer.sync`).  The shared maps
    change by exact differences: each update adds and removes that Service's elements, and
    reading :attr:`rs` makes each changed map a new version once, carrying its net difference
    since the last read (``NftSet.delta``), its elements made only if the plan looks at them
    (:class:`_Version`), so that neither a batch of many Services nor the plan of one change
    costs a pass over 10,000 elements per map.  ``rs`` is the whole wanted ruleset.
    ``pod_subnets``: this node's pod subnet per IP version (whose traffic to a Local node port
    is short-circuited, as the node's own is); ``service_ranges``: the cluster IPs' range per
    IP version (an address of it no Service has: dropped)."""

    def __init__(
        self, node: str, log: DropLog | None = None, families: Iterable[int] = (4,),
        pod_subnets: Mapping[int, str] | None = None, service_ranges: Mapping[int, str] | None = None,
    ) -> None:  # fmt: skip
        self.node = node
        self.pod_subnets = dict(pod_subnets or {})  # IP version -> this node's pod subnet
        self.families = rows(families)  # the IP versions this node serves (one table each)
        self._versions = {f.version for f in self.families}
        self._rs = Ruleset(tables(self._versions))
        self.slots = SLOTS_MIN
        self.picks: set[int] = set()  # the counts above SLOTS_MIN with pick chains
        self._unused: list[int] = []  # of those, the ones no longer in use, the most recently used last
        for fam in self.families:
            for obj in base_objects(self.slots, log, fam=fam, pod_subnet=(pod_subnets or {}).get(fam.version),
                                    service_range=(service_ranges or {}).get(fam.version)):  # fmt: skip
                self._rs.add(obj)
        # (family, map name) -> its elements and their difference since rs last handed it out
        self._logs: dict[MapKey, _Log] = {}
        self._pending: dict[MapKey, _Log] = {}  # those changed since rs was last read
        # per service: its ports, its own objects by key, its elements by map, its pick sizes
        self.services: dict[ServiceKey, tuple[tuple[ServicePort, ...], dict[Any, Any], dict[MapKey, set[Any]], list[int]]] = {}
        self.elements: dict[MapKey, set[Any]] = {}  # (family, map or set name) -> every service's elements
        self.sizes: Counter[int] = Counter()
        self.port_count = 0
        self._wanted: dict[ServiceKey, tuple[ServicePort, ...]] = {}  # per service: its ports as asked
        self._compiled: dict[ServiceKey, tuple[ServicePort, ...]] = {}  # and as compiled (less what others hold)
        self._claims: dict[Claim, dict[ServiceKey, tuple[Any, ...]]] = {}  # VIP or node port -> who wants it (their age)
        self.conflicts: dict[ServiceKey, list[str]] = {}  # per service: what it was refused, one line each
        self._recompiled: set[ServiceKey] = set()  # services compiled anew since take_recompiled()
        # Elements several Services put in one map or set (an endpoint of two Services, a VIP's
        # element of the Service taking it over): per map, how many Services beyond the first.
        self._uses: dict[MapKey, Counter[Any]] = {}

    def update(self, key: ServiceKey, ports: Iterable[ServicePort]) -> set[Any]:
        """Make service ``key`` compile to ``ports`` (none: it is gone); the changed object keys.
        Ports of a family this node does not serve are left out.

        A cluster IP . protocol . port or a protocol . node port is one Service's: where two
        claim one (records that allocation did not check: a hand-written put, a restore), the
        older Service has it (creationTimestamp, then namespace/name, as kube-proxy keeps the
        first), the other's port is compiled without it and the conflict is in
        :attr:`conflicts` (two map elements of one key would make the kernel refuse the
        whole transaction).  A change to either recompiles both."""
        ports = tuple(sorted((p for p in ports if p.family in self._versions), key=lambda p: p.key))
        old_wanted = self._wanted.get(key, ())
        if old_wanted == ports:
            return set()
        affected = {key}
        for sp in old_wanted:
            for claim in _claims(sp):
                holders = self._claims.get(claim, {})
                holders.pop(key, None)
                affected |= holders.keys()
                if not holders:
                    self._claims.pop(claim, None)
        for sp in ports:
            for claim in _claims(sp):
                holders = self._claims.setdefault(claim, {})
                affected |= holders.keys()
                holders[key] = (sp.created, *key)
        if ports:
            self._wanted[key] = ports
        else:
            self._wanted.pop(key, None)
        touched: set[Any] = set()
        for k in sorted(affected):
            touched |= self._compile(k)
        return touched

    def compiled(self, key: ServiceKey) -> tuple[ServicePort, ...]:
        """Service ``key``'s ports as compiled: without the cluster IPs (None) and node ports
        (None) an older Service holds; none for a Service not here.  What this node translates
        to its endpoints -- unlike the ports asked for, the ones whose flows are its."""
        return self._compiled.get(key, ())

    def take_recompiled(self) -> set[ServiceKey]:
        """The Services compiled anew (their ports as compiled changed, :meth:`compiled`) since
        the last call: those :meth:`update` was called for and those a conflict's change moved."""
        out, self._recompiled = self._recompiled, set()
        return out

    def _held(self, key: ServiceKey) -> tuple[tuple[ServicePort, ...], list[str]]:
        """Service ``key``'s ports without the VIPs and node ports an older Service holds; the conflicts."""
        out, conflicts = [], []
        for sp in self._wanted.get(key, ()):
            held = sp
            for claim in _claims(sp):
                owner = _owner(self._claims[claim])
                if owner == key:
                    continue
                if claim[1] == "vip":
                    conflicts.append(f"cluster IP {sp.cluster_ip} {sp.l4}/{sp.port} is {owner[0]}/{owner[1]}'s: left out")
                    held = replace(held, cluster_ip=None)
                else:
                    conflicts.append(f"node port {sp.l4}/{sp.node_port} (IPv{sp.family}) is {owner[0]}/{owner[1]}'s: left out")
                    held = replace(held, node_port=None)
            out.append(held)
        return tuple(out), conflicts

    def _compile(self, key: ServiceKey) -> set[Any]:
        """Compile Service ``key`` as it is wanted, less what other Services hold; the changed object keys."""
        wanted = self._wanted.get(key, ())
        ports, conflicts = self._held(key)
        if conflicts != self.conflicts.get(key, []):
            for line in conflicts:
                log.warning("service %s/%s: %s", key[0], key[1], line)
            if conflicts:
                self.conflicts[key] = conflicts
            else:
                self.conflicts.pop(key, None)
        old = self.services.get(key)
        if old is not None and self._compiled.get(key) == ports:
            if old[0] != wanted:
                self.services[key] = (wanted, *old[1:])
            return set()
        old_objs, old_elems, old_sizes = (old[1], old[2], old[3]) if old is not None else ({}, {}, [])
        objs: dict[Any, Any] = {}
        elems: dict[MapKey, set[Any]] = {}
        sizes: list[int] = []
        for sp in ports:
            compiled = compile_port(sp, self.node, self.pod_subnets)
            objs.update((o.key, o) for o in compiled.objects)
            for name, items in compiled.elements.items():
                elems.setdefault(name, set()).update(items)
            sizes += compiled.sizes
        touched: set[Any] = set()
        for k in old_objs.keys() - objs.keys():
            self._rs.objects.pop(k, None)
            touched.add(k)
        for k, o in objs.items():
            if old_objs.get(k) != o:
                self._rs.objects[k] = o
                touched.add(k)
        self.port_count += len(ports) - (len(old[0]) if old is not None else 0)
        self._recompiled.add(key)
        if ports:
            self.services[key] = (wanted, objs, elems, sizes)
            self._compiled[key] = ports
        else:
            self.services.pop(key, None)
            self._compiled.pop(key, None)
        self.sizes.subtract(old_sizes)
        self.sizes.update(sizes)
        touched |= self._resize()
        for name in old_elems.keys() | elems.keys():
            before, after = old_elems.get(name, set()), elems.get(name, set())
            if before == after:
                continue
            obj_key = (name[0], TABLE, "set", name[1])
            if obj_key not in self._rs.objects:  # a slot map _resize removed: it went with its last service
                continue
            have = self.elements.setdefault(name, set())
            # In the set while any Service has it: a cluster IP or endpoint two Services share,
            # and a map element with the same value in two (the one taking over a VIP or node
            # port from the one that held it, compiled before the holder gives it up).
            gone, new = self._unshared(name, have, before - after, after - before)
            have -= gone
            have |= new
            changes = self._logs.get(name)
            if changes is None:
                changes = self._logs[name] = _Log(have)
            changes.note(gone, new)
            self._pending[name] = changes
            touched.add(obj_key)
        return touched

    def _unshared(self, name: MapKey, have: set[Any], gone: set[Any], new: set[Any]) -> tuple[set[Any], set[Any]]:
        """Of one Service's elements of map or set ``name`` (holding ``have``) gone and new,
        those it loses (no other Service has them) and gains (no other Service had them).
        Only the Services beyond the first are counted (most elements are one Service's)."""
        extra = self._uses.get(name)
        really_new = set()
        for e in new:
            if e in have:
                if extra is None:
                    extra = self._uses[name] = Counter()
                extra[e] += 1
            else:
                really_new.add(e)
        really_gone = set()
        for e in gone:
            if extra and extra.get(e):
                extra[e] -= 1
                if not extra[e]:
                    del extra[e]
            else:
                really_gone.add(e)
        if extra is not None and not extra:
            del self._uses[name]
        return really_gone, really_new

    @property
    def rs(self) -> Ruleset:
        """The whole wanted ruleset (a changed map is a new version of it, once per read,
        carrying its difference: its elements are made only if plan() looks at them)."""
        for name, changes in self._pending.items():
            base = self._rs.objects.get((name[0], TABLE, "set", name[1]))
            if not isinstance(base, NftSet):
                continue  # (its difference stays in the log, the next version's)
            # Only one step back: plan() takes the delta when the kernel holds ``base`` itself
            # (the object, as applied() keeps it), never an older version -- so ``base`` lets go
            # of its own, or every version of a set that keeps changing would stay reachable.
            if base.delta is not None:
                object.__setattr__(base, "delta", None)
            added, removed = changes.read()
            self._rs.add(NftSet(base.family, base.table, base.name, base.type, map=base.map,
                                elements=changes.latest, delta=(base, added, removed)))  # fmt: skip
        self._pending.clear()
        return self._rs

    def _resize(self) -> set[Any]:
        """Slots for the largest endpoint count in use (at least SLOTS_MIN), pick chains for
        the counts in use (those up to SLOTS_MIN always), and for a few no longer used near
        one in use: linear in the endpoints, not a chain for every count up to the largest."""
        in_use = {n for n, uses in self.sizes.items() if uses > 0 and n > SLOTS_MIN}
        slots_only = [-n for n, uses in self.sizes.items() if uses > 0 and n < 0]  # own chains' slots
        self._unused = [n for n in self._unused if n not in in_use] + sorted(self.picks - in_use - set(self._unused))
        near = [n for n in self._unused if any(abs(n - m) * 4 <= m for m in in_use)]
        kept = set(near[-RETAIN:])
        self._unused = [n for n in self._unused if n in kept]
        picks = in_use | kept
        slots = max([SLOTS_MIN, *picks, *slots_only])
        if picks == self.picks and slots == self.slots:
            return set()
        added: list[Any] = []
        removed: list[Any] = []
        for fam in self.families:
            added += [o for i in range(self.slots, slots) for o in slot_objects(i, fam)]
            added += [o for n in sorted(picks - self.picks) for o in pick_objects(n, fam, self.pod_subnets.get(fam.version))]
            removed += [o for i in range(slots, self.slots) for o in slot_objects(i, fam)]
            removed += [o for n in sorted(self.picks - picks) for o in pick_objects(n, fam, self.pod_subnets.get(fam.version))]
        touched: set[Any] = set()
        for obj in added:
            self._rs.add(obj)
            touched.add(obj.key)
        for obj in removed:
            self._rs.objects.pop(obj.key, None)
            self.elements.pop((obj.family, obj.name), None)
            self._pending.pop((obj.family, obj.name), None)
            changes = self._logs.pop((obj.family, obj.name), None)
            if changes is not None and changes.latest is not None:
                changes.latest.frozen()  # the kernel may hold it: made before its elements go
            self._uses.pop((obj.family, obj.name), None)
            touched.add(obj.key)
        self.slots, self.picks = slots, picks
        return touched

    def drop_invalid(self, on: bool) -> set[Any]:
        """Have the forward hook's chain dropping TCP conntrack deems invalid (``on``) or not
        (:func:`invalid_drop`); the changed object keys."""
        touched: set[Any] = set()
        for fam in self.families:
            chain = invalid_drop(fam)
            if on and chain.key not in self._rs.objects:
                self._rs.add(chain)
                touched.add(chain.key)
            elif not on and self._rs.objects.pop(chain.key, None) is not None:
                touched.add(chain.key)
        return touched

    @property
    def dropping_invalid(self) -> bool:
        """Whether the forward hook's chain dropping invalid TCP is in the table."""
        return any((f.proto, TABLE, "chain", FORWARD_CHAIN) in self._rs.objects for f in self.families)

    def translating(self) -> bool:
        """Whether any VIP or node port is translated here (a Local node port short-circuited
        for this node and its pods only counts: those are DNATed without SNAT)."""
        maps = (SERVICE_IPS, NODE_PORTS, NP_SHORT_CIRCUIT)
        return any(self.elements.get((f.proto, m)) for f in self.families for m in maps)

    def ports(self) -> list[ServicePort]:
        """Every Service's ports as asked (a cluster IP or node port an older Service holds included)."""
        return [sp for ports, *_ in self.services.values() for sp in ports]

    def compiled_ports(self) -> list[ServicePort]:
        """Every Service's ports as compiled (:meth:`compiled`): a cluster IP or node port is
        named only by the Service it is translated to."""
        return [sp for ports in self._compiled.values() for sp in ports]


def compile_services(
    ports: Iterable[ServicePort], node: str, families: Iterable[int] = (4,), pod_subnets: Mapping[int, str] | None = None,
    service_ranges: Mapping[int, str] | None = None,
) -> Ruleset:
    """The whole table for ``node`` at once (what a :class:`Table` fed service by service holds)."""
    by_service: dict[ServiceKey, list[ServicePort]] = {}
    for sp in ports:
        by_service.setdefault((sp.namespace, sp.service), []).append(sp)
    table = Table(node, families=families, pod_subnets=pod_subnets, service_ranges=service_ranges)
    for key in sorted(by_service):
        table.update(key, by_service[key])
    return table.rs
