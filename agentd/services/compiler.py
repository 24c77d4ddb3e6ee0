"""Services -> the node's ``ip agentd-services`` nftables table.  Pure: ServicePorts in, a Ruleset out.

The table (kube-proxy's nftables mode, in agentd's own table, but with the endpoints in maps)::

    map service-ips       { ipv4_addr . inet_proto . inet_service : verdict }   VIP . proto . port -> goto pick/N
    map service-nodeports { inet_proto . inet_service : verdict }                proto . node port -> goto np-pick/N
    chain prerouting   { type nat hook prerouting priority dstnat; jump services }
    chain output       { type nat hook output priority dstnat; jump services }
    chain services     { ip daddr . meta l4proto . th dport vmap @service-ips
                         fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports }
    chain postrouting  { type nat hook postrouting priority srcnat; meta mark & 0x4000 == 0x4000 masquerade }

    chain pick/N       (one per endpoint count N, shared by every service with N endpoints)
                       ip saddr . ip daddr . meta l4proto . th dport @service-hairpin  mark for masquerade
                       counter name ip daddr . meta l4proto . th dport map @service-counters
                       numgen random mod N vmap { 0 : goto slot/0, ..., N-1 : goto slot/N-1 }
    chain slot/i       dnat to ip daddr . meta l4proto . th dport map @addr/i : ... map @port/i
    map addr/i, port/i { VIP . proto . port : the address / port of the service's i-th endpoint }

    node ports alike: np-pick/N (externalTrafficPolicy Cluster: marked for masquerade),
    np-local/N (Local: only this node's endpoints, client address kept), np-slot/i with the
    maps np-addr/i and np-port/i keyed by proto . node port.

So 10,000 services are one map lookup, not a chain walk, and a Service's endpoints are map
elements, not rules: an endpoint appearing, leaving or becoming ready changes elements only,
which go to the kernel as one nf_tables element batch (:mod:`agentd.nft.nfnetlink`)
without libnftables reading the table first.  Rules change only when the largest endpoint
count in use passes the prepared slots (``SLOTS_MIN``), or for ClientIP affinity.

A connection picks an endpoint at random once (NAT rules see only a connection's first
packet; conntrack does the rest, which is also why a terminating endpoint keeps its
established connections).  SNAT happens only where the reply would not come back through
this node otherwise: a pod reaching itself or a sibling endpoint through its service
(hairpin; kube-proxy marks only the endpoint reaching itself), and node ports with
externalTrafficPolicy Cluster (the endpoint may be on another node).  A port without usable
endpoints is not translated but refused (ICMP port unreachable, as kube-proxy does), or
dropped where a Local traffic policy keeps it off other nodes' endpoints.

Services with ClientIP affinity keep a chain of their own, one chain per endpoint and a
timeout set per endpoint (``svc/...``, ``ext/...``, ``ep/...``, ``aff/...``): the affinity
sets are per endpoint, so changing their endpoints rewrites rules (through libnftables).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from agentd.nft.expr import SUPPRESSED, DropLog, goto, match, meta, object_name, payload
from agentd.nft.ruleset import NftChain, NftCounter, NftSet, Ruleset, rule_text

from .model import Endpoint, ServicePort

FAMILY = "ip"
TABLE = "agentd-services"
TABLES = frozenset({(FAMILY, TABLE)})
SERVICE_IPS = "service-ips"
NODE_PORTS = "service-nodeports"
HAIRPIN = "service-hairpin"  # endpoint address . VIP . proto . port
NP_HAIRPIN = "nodeport-hairpin"  # endpoint address . proto . node port (Local node ports)
SVC_COUNTERS = "service-counters"  # VIP . proto . port : the service's counter
NP_COUNTERS = "nodeport-counters"  # proto . node port : the service's counter
UNAVAILABLE = "service-unavailable"  # VIP . proto . port : goto reject or drop (no usable endpoint)
NP_UNAVAILABLE = "nodeport-unavailable"  # proto . node port : the same for node ports
REJECT_CHAIN, DROP_CHAIN = "no-endpoints", "no-local-endpoints"
SLOTS_MIN = 16  # endpoint counts prepared at start: up to this many, an endpoint change is elements only
MASQ_MARK = 0x4000  # kube-proxy's masquerade bit
DSTNAT, SRCNAT = -100, 100


MARK_MASQ = {"mangle": {"key": meta("mark"), "value": {"|": [meta("mark"), MASQ_MARK]}}}
SADDR = payload("ip", "saddr")




def svc_chain(sp: ServicePort) -> str:
    return object_name("svc", sp.namespace, sp.service, sp.l4, sp.port)


def ext_chain(sp: ServicePort) -> str:
    return object_name("ext", sp.namespace, sp.service, sp.l4, sp.port)


def ep_chain(sp: ServicePort, e: Endpoint) -> str:
    return object_name("ep", sp.namespace, sp.service, sp.l4, sp.port, e.ip, e.port)


def affinity_set(sp: ServicePort, e: Endpoint) -> str:
    return object_name("aff", sp.namespace, sp.service, sp.l4, sp.port, e.ip, e.port)


def counter_name(namespace: str, service: str) -> str:
    return object_name("svc", namespace, service)


_COUNTERS: dict[tuple[str, str], NftCounter] = {}


def _counter(namespace: str, service: str) -> NftCounter:
    """One counter object per service, shared by its ports (so an unchanged one stays the same object)."""
    got = _COUNTERS.get((namespace, service))
    if got is None:
        if len(_COUNTERS) > 200_000:
            _COUNTERS.clear()
        got = _COUNTERS[(namespace, service)] = NftCounter(FAMILY, TABLE, counter_name(namespace, service))
    return got


VIP_TYPE = ("ipv4_addr", "inet_proto", "inet_service")
NP_TYPE = ("inet_proto", "inet_service")
VIP_KEY = {"concat": [payload("ip", "daddr"), meta("l4proto"), payload("th", "dport")]}
NP_KEY = {"concat": [meta("l4proto"), payload("th", "dport")]}
L4_ANY = match(meta("l4proto"), {"set": ["tcp", "udp", "sctp"]})  # dnat to a port needs the protocol known


def pick_chain(n: int) -> str:
    return f"pick/{n}"


def np_pick_chain(n: int, local: bool) -> str:
    return f"np-local/{n}" if local else f"np-pick/{n}"


def _numgen(n: int, slot: str) -> str:
    if n == 1:
        return rule_text([goto(f"{slot}/0")])
    pick = {"numgen": {"mode": "random", "mod": n, "offset": 0}}
    return rule_text([{"vmap": {"key": pick, "data": {"set": [[i, goto(f"{slot}/{i}")] for i in range(n)]}}}])


def slot_objects(i: int) -> list[Any]:
    """Slot ``i``: the i-th endpoint of every service, as two maps per kind and the chain reading them."""
    out: list[Any] = []
    for prefix, key_type, key in (("", VIP_TYPE, VIP_KEY), ("np-", NP_TYPE, NP_KEY)):
        addr, port = f"{prefix}addr/{i}", f"{prefix}port/{i}"
        out += [
            NftSet(FAMILY, TABLE, addr, key_type, map="ipv4_addr"),
            NftSet(FAMILY, TABLE, port, key_type, map="inet_service"),
            NftChain(FAMILY, TABLE, f"{prefix}slot/{i}", (rule_text([L4_ANY, {"dnat": {
                "family": "ip",
                "addr": {"map": {"key": key, "data": "@" + addr}},
                "port": {"map": {"key": key, "data": "@" + port}},
            }}]),)),
        ]  # fmt: skip
    return out


def pick_objects(n: int) -> list[Any]:
    """The chains choosing one of ``n`` endpoints: for VIPs, Cluster node ports, Local node ports."""
    hairpin = match({"concat": [SADDR, payload("ip", "daddr"), meta("l4proto"), payload("th", "dport")]}, "@" + HAIRPIN)
    np_hairpin = match({"concat": [SADDR, meta("l4proto"), payload("th", "dport")]}, "@" + NP_HAIRPIN)
    count = rule_text([{"counter": {"map": {"key": VIP_KEY, "data": "@" + SVC_COUNTERS}}}])
    np_count = rule_text([{"counter": {"map": {"key": NP_KEY, "data": "@" + NP_COUNTERS}}}])
    return [
        NftChain(FAMILY, TABLE, pick_chain(n), (rule_text([hairpin, MARK_MASQ]), count, _numgen(n, "slot"))),
        NftChain(FAMILY, TABLE, np_pick_chain(n, False), (rule_text([MARK_MASQ]), np_count, _numgen(n, "np-slot"))),
        NftChain(FAMILY, TABLE, np_pick_chain(n, True), (rule_text([np_hairpin, MARK_MASQ]), np_count, _numgen(n, "np-slot"))),
    ]


def base_objects(slots: int = SLOTS_MIN, log: DropLog | None = None) -> list[Any]:
    """The fixed part, prepared for services of up to ``slots`` endpoints (the maps empty);
    with ``log`` the refusals are logged for flow records (prefix: the chain's name)."""
    local = match({"fib": {"result": "type", "flags": ["daddr"]}}, "local")
    not_loopback = match(payload("ip", "daddr"), {"prefix": {"addr": "127.0.0.0", "len": 8}}, "!=")
    masq = match({"&": [meta("mark"), MASQ_MARK]}, MASQ_MARK)
    out: list[Any] = [
        NftSet(FAMILY, TABLE, SERVICE_IPS, VIP_TYPE, map="verdict"),
        NftSet(FAMILY, TABLE, NODE_PORTS, NP_TYPE, map="verdict"),
        NftSet(FAMILY, TABLE, HAIRPIN, ("ipv4_addr", *VIP_TYPE)),
        NftSet(FAMILY, TABLE, NP_HAIRPIN, ("ipv4_addr", *NP_TYPE)),
        NftSet(FAMILY, TABLE, SVC_COUNTERS, VIP_TYPE, map="counter"),
        NftSet(FAMILY, TABLE, NP_COUNTERS, NP_TYPE, map="counter"),
        NftChain(FAMILY, TABLE, "services", (
            rule_text([{"vmap": {"key": VIP_KEY, "data": "@" + SERVICE_IPS}}]),
            rule_text([local, not_loopback, {"vmap": {"key": NP_KEY, "data": "@" + NODE_PORTS}}]),
        )),
        NftChain(FAMILY, TABLE, "prerouting", (rule_text([{"jump": {"target": "services"}}]),),
                 hook=("nat", "prerouting", DSTNAT, "accept")),
        NftChain(FAMILY, TABLE, "output", (rule_text([{"jump": {"target": "services"}}]),),
                 hook=("nat", "output", DSTNAT, "accept")),
        NftChain(FAMILY, TABLE, "postrouting", (rule_text([masq, {"masquerade": None}]),),
                 hook=("nat", "postrouting", SRCNAT, "accept")),
        # A port without usable endpoints is refused, as kube-proxy does: no endpoint at all,
        # ICMP port unreachable (a TCP client sees "connection refused" at once instead of a
        # timeout); endpoints only on other nodes under a Local policy, dropped.  Looked at
        # right after the nat chains (a translated packet no longer has the VIP), before routing.
        NftSet(FAMILY, TABLE, UNAVAILABLE, VIP_TYPE, map="verdict"),
        NftSet(FAMILY, TABLE, NP_UNAVAILABLE, NP_TYPE, map="verdict"),
        *_refusals(log),
        *(NftChain(FAMILY, TABLE, f"filter-{hook}", (
            rule_text([{"vmap": {"key": VIP_KEY, "data": "@" + UNAVAILABLE}}]),
            rule_text([local, {"vmap": {"key": NP_KEY, "data": "@" + NP_UNAVAILABLE}}]),
        ), hook=("filter", hook, DSTNAT + 1, "accept")) for hook in ("prerouting", "output")),
    ]  # fmt: skip
    for i in range(slots):
        out += slot_objects(i)
    for n in range(1, slots + 1):
        out += pick_objects(n)
    return out


def _refusals(log: DropLog | None) -> list[Any]:
    """The chains of ports without usable endpoints: reject, drop (logged with ``log``)."""
    if log is None:
        return [NftChain(FAMILY, TABLE, REJECT_CHAIN, (rule_text([{"reject": None}]),)),
                NftChain(FAMILY, TABLE, DROP_CHAIN, (rule_text([{"drop": None}]),))]
    return [NftCounter(FAMILY, TABLE, SUPPRESSED),
            NftChain(FAMILY, TABLE, REJECT_CHAIN, log.chain_rules(REJECT_CHAIN, [{"reject": None}])),
            NftChain(FAMILY, TABLE, DROP_CHAIN, log.chain_rules(DROP_CHAIN, [{"drop": None}]))]


Elements = dict[str, frozenset[Any]]  # map or set name -> the elements one service puts there


class Compiled:
    """What one service port compiles to: objects of its own (affinity chains, its counter),
    elements in the shared maps, and the endpoint count its pick chains need."""

    __slots__ = ("objects", "elements", "size")

    def __init__(self, objects: list[Any], elements: dict[str, set[Any]], size: int) -> None:
        self.objects = objects
        self.elements = elements
        self.size = size


def compile_port(sp: ServicePort, node: str) -> Compiled:
    """The objects and map elements of one service port on ``node``."""
    counter = _counter(sp.namespace, sp.service)
    objs: list[Any] = [counter]
    elements: dict[str, set[Any]] = {}

    def put(name: str, elem: Any) -> None:
        elements.setdefault(name, set()).add(elem)

    if sp.affinity_timeout is not None:
        _compile_affinity(sp, node, objs, put)
        return Compiled(objs, elements, 0)
    every, local = sp.usable(), sp.usable(node)
    size = 0
    if sp.cluster_ip is not None:
        chosen = local if sp.internal_local else every
        if chosen:
            key = (sp.cluster_ip, sp.l4, sp.port)
            put(SERVICE_IPS, (key, ("goto", pick_chain(len(chosen)))))
            put(SVC_COUNTERS, (key, counter.name))
            for i, e in enumerate(chosen):
                put(f"addr/{i}", (key, e.ip))
                put(f"port/{i}", (key, e.port))
            for addr in {e.ip for e in chosen}:
                put(HAIRPIN, (addr, *key))
            size = len(chosen)
        else:
            put(UNAVAILABLE, ((sp.cluster_ip, sp.l4, sp.port), _unavailable(every)))
    if sp.node_port is not None:
        chosen = local if sp.external_local else every
        if chosen:
            key = (sp.l4, sp.node_port)
            put(NODE_PORTS, (key, ("goto", np_pick_chain(len(chosen), sp.external_local))))
            put(NP_COUNTERS, (key, counter.name))
            for i, e in enumerate(chosen):
                put(f"np-addr/{i}", (key, e.ip))
                put(f"np-port/{i}", (key, e.port))
            if sp.external_local:
                for addr in {e.ip for e in chosen}:
                    put(NP_HAIRPIN, (addr, *key))
            size = max(size, len(chosen))
        else:
            put(NP_UNAVAILABLE, ((sp.l4, sp.node_port), _unavailable(every)))
    return Compiled(objs, elements, size)


def _unavailable(every: tuple[Endpoint, ...]) -> tuple[str, str]:
    """Where a port without a usable endpoint here goes: refused if it has none anywhere,
    dropped if its traffic policy keeps it off the endpoints other nodes have."""
    return ("goto", DROP_CHAIN if every else REJECT_CHAIN)


def _compile_affinity(sp: ServicePort, node: str, objs: list[Any], put: Callable[[str, Any], None]) -> None:
    """ClientIP affinity: a chain for the service (``svc/``) and node port (``ext/``), one per endpoint."""
    counter = {"counter": counter_name(sp.namespace, sp.service)}
    every, local = sp.usable(), sp.usable(node)
    chains: dict[str, Endpoint] = {}
    if sp.cluster_ip is not None:
        chosen = local if sp.internal_local else every
        if chosen:
            objs.append(NftChain(FAMILY, TABLE, svc_chain(sp), _dispatch(sp, chosen, counter)))
            chains.update((ep_chain(sp, e), e) for e in chosen)
            put(SERVICE_IPS, ((sp.cluster_ip, sp.l4, sp.port), ("goto", svc_chain(sp))))
        else:
            put(UNAVAILABLE, ((sp.cluster_ip, sp.l4, sp.port), _unavailable(every)))
    if sp.node_port is not None:
        rules: tuple[str, ...] = ()
        if sp.external_local:
            if local:
                rules = _dispatch(sp, local, counter)
                chains.update((ep_chain(sp, e), e) for e in local)
        elif every:
            if sp.cluster_ip is not None and not sp.internal_local:
                rules = (rule_text([MARK_MASQ, goto(svc_chain(sp))]),)
            else:
                rules = (rule_text([MARK_MASQ]), *_dispatch(sp, every, counter))
                chains.update((ep_chain(sp, e), e) for e in every)
        if rules:
            objs.append(NftChain(FAMILY, TABLE, ext_chain(sp), rules))
            put(NODE_PORTS, ((sp.l4, sp.node_port), ("goto", ext_chain(sp))))
        else:
            put(NP_UNAVAILABLE, ((sp.l4, sp.node_port), _unavailable(every)))
    for chain, e in sorted(chains.items()):
        objs += _endpoint(sp, e, chain)


def _dispatch(sp: ServicePort, endpoints: tuple[Endpoint, ...], counter: dict[str, Any]) -> tuple[str, ...]:
    rules = [rule_text([match(SADDR, "@" + affinity_set(sp, e)), counter, goto(ep_chain(sp, e))]) for e in endpoints]
    if len(endpoints) == 1:
        rules.append(rule_text([counter, goto(ep_chain(sp, endpoints[0]))]))
    else:
        pick = {"numgen": {"mode": "random", "mod": len(endpoints), "offset": 0}}
        table = {"set": [[i, goto(ep_chain(sp, e))] for i, e in enumerate(endpoints)]}
        rules.append(rule_text([counter, {"vmap": {"key": pick, "data": table}}]))
    return tuple(rules)


def _endpoint(sp: ServicePort, e: Endpoint, chain: str) -> list[Any]:
    """An affinity Service's endpoint: its chain (hairpin mark, the client recorded in the
    endpoint's timeout set, dnat) and that set."""
    aff = affinity_set(sp, e)
    rules = (
        rule_text([match(SADDR, e.ip), MARK_MASQ]),  # hairpin: the pod reaching itself
        rule_text([{"set": {"op": "update", "elem": SADDR, "set": "@" + aff}}]),
        # dnat to addr:port needs the protocol known in the rule (the map matched it already).
        rule_text([match(meta("l4proto"), sp.l4), {"dnat": {"addr": e.ip, "port": e.port}}]),
    )
    return [
        NftSet(FAMILY, TABLE, aff, ("ipv4_addr",), flags=("timeout",), timeout=sp.affinity_timeout),
        NftChain(FAMILY, TABLE, chain, rules),
    ]


ServiceKey = tuple[str, str]  # (namespace, name)


class Table:
    """The table kept up to date service by service: a change costs that service's objects
    and elements.

    :meth:`update` replaces what one Service compiles to and returns the keys of the objects
    that changed (for :meth:`agentd.nft.programmer.NftProgrammer.sync`).  The shared maps
    change by exact differences: each update adds and removes that Service's elements, and
    reading :attr:`rs` rebuilds each changed map once, carrying its net difference since the
    last read (``NftSet.delta``), so that neither a batch of many Services nor the plan of one
    change costs a pass over 10,000 elements per map.  ``rs`` is the whole wanted ruleset."""

    def __init__(self, node: str, log: DropLog | None = None) -> None:
        self.node = node
        self._rs = Ruleset(TABLES)
        self.slots = SLOTS_MIN
        for obj in base_objects(self.slots, log):
            self._rs.add(obj)
        # map name -> (elements added, elements removed) since rs was last read
        self._pending: dict[str, tuple[set[Any], set[Any]]] = {}
        # per service: its ports, its own objects by key, its elements by map, its pick sizes
        self.services: dict[ServiceKey, tuple[tuple[ServicePort, ...], dict[Any, Any], dict[str, set[Any]], list[int]]] = {}
        self.elements: dict[str, set[Any]] = {}  # map or set name -> every service's elements
        self.sizes: Counter[int] = Counter()
        self.port_count = 0

    def update(self, key: ServiceKey, ports: Iterable[ServicePort]) -> set[Any]:
        """Make service ``key`` compile to ``ports`` (none: it is gone); the changed object keys."""
        ports = tuple(sorted(ports, key=lambda p: p.key))
        old = self.services.get(key)
        if old is not None and old[0] == ports:
            return set()
        old_objs, old_elems, old_sizes = (old[1], old[2], old[3]) if old is not None else ({}, {}, [])
        objs: dict[Any, Any] = {}
        elems: dict[str, set[Any]] = {}
        sizes: list[int] = []
        for sp in ports:
            compiled = compile_port(sp, self.node)
            objs.update((o.key, o) for o in compiled.objects)
            for name, items in compiled.elements.items():
                elems.setdefault(name, set()).update(items)
            if compiled.size:
                sizes.append(compiled.size)
        touched: set[Any] = set()
        for k in old_objs.keys() - objs.keys():
            self._rs.objects.pop(k, None)
            touched.add(k)
        for k, o in objs.items():
            if old_objs.get(k) != o:
                self._rs.objects[k] = o
                touched.add(k)
        self.port_count += len(ports) - (len(old[0]) if old is not None else 0)
        if ports:
            self.services[key] = (ports, objs, elems, sizes)
        else:
            self.services.pop(key, None)
        self.sizes.subtract(old_sizes)
        self.sizes.update(sizes)
        touched |= self._resize()
        for name in old_elems.keys() | elems.keys():
            before, after = old_elems.get(name, set()), elems.get(name, set())
            if before == after:
                continue
            key = (FAMILY, TABLE, "set", name)
            if key not in self._rs.objects:  # a slot map _resize removed: it went with its last service
                continue
            have = self.elements.setdefault(name, set())
            gone, new = before - after, after - before
            have -= gone
            have |= new
            # The net difference since rs was last read: what came and went in between cancels.
            added, removed = self._pending.setdefault(name, (set(), set()))
            removed |= gone - added
            added -= gone
            added |= new - removed
            removed -= new
            touched.add(key)
        return touched

    @property
    def rs(self) -> Ruleset:
        """The whole wanted ruleset (changed maps rebuilt here, once per read)."""
        for name, (added, removed) in self._pending.items():
            base = self._rs.objects.get((FAMILY, TABLE, "set", name))
            if not isinstance(base, NftSet):
                continue
            self._rs.add(NftSet(base.family, base.table, base.name, base.type, map=base.map,
                                elements=frozenset(self.elements.get(name, ())),
                                delta=(base, frozenset(added), frozenset(removed))))  # fmt: skip
        self._pending.clear()
        return self._rs

    def _resize(self) -> set[Any]:
        """Prepare slots and pick chains for the largest endpoint count in use (at least SLOTS_MIN)."""
        wanted = max([SLOTS_MIN, *(n for n, uses in self.sizes.items() if uses > 0)])
        if wanted == self.slots:
            return set()
        touched: set[Any] = set()
        if wanted > self.slots:
            for obj in [o for i in range(self.slots, wanted) for o in slot_objects(i)] + [
                o for n in range(self.slots + 1, wanted + 1) for o in pick_objects(n)
            ]:
                self._rs.add(obj)
                touched.add(obj.key)
        else:
            for obj in [o for i in range(wanted, self.slots) for o in slot_objects(i)] + [
                o for n in range(wanted + 1, self.slots + 1) for o in pick_objects(n)
            ]:
                self._rs.objects.pop(obj.key, None)
                self.elements.pop(obj.name, None)
                self._pending.pop(obj.name, None)
                touched.add(obj.key)
        self.slots = wanted
        return touched

    def translating(self) -> bool:
        """Whether any VIP or node port is translated here."""
        return bool(self.elements.get(SERVICE_IPS) or self.elements.get(NODE_PORTS))

    def ports(self) -> list[ServicePort]:
        return [sp for ports, *_ in self.services.values() for sp in ports]


def compile_services(ports: Iterable[ServicePort], node: str) -> Ruleset:
    """The whole table for ``node`` at once (what a :class:`Table` fed service by service holds)."""
    by_service: dict[ServiceKey, list[ServicePort]] = {}
    for sp in ports:
        by_service.setdefault((sp.namespace, sp.service), []).append(sp)
    table = Table(node)
    for key in sorted(by_service):
        table.update(key, by_service[key])
    return table.rs
