"""Services -> the node's ``ip agentd-services`` nftables table.  Pure: ServicePorts in, a Ruleset out.

The table (kube-proxy's nftables mode, in agentd's own table)::

    map service-ips    { type ipv4_addr . inet_proto . inet_service : verdict }  VIP . proto . port -> goto svc chain
    map service-nodeports { type inet_proto . inet_service : verdict }           proto . node port -> goto ext chain
    chain prerouting   { type nat hook prerouting priority dstnat; jump services }
    chain output       { type nat hook output priority dstnat; jump services }
    chain services     { ip daddr . meta l4proto . th dport vmap @service-ips
                         fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports }
    chain postrouting  { type nat hook postrouting priority srcnat; meta mark & 0x4000 == 0x4000 masquerade }

    chain svc/<ns>/<svc>/<proto>/<port>    counter; [affinity: ip saddr @aff/<ep> goto ep/<ep>, ...];
                                           numgen random mod N vmap { 0 : goto ep/..., ... }
    chain ext/<ns>/<svc>/<proto>/<port>    (node port) Cluster: mark for masquerade, goto svc/...;
                                           Local: this node's endpoints only, no SNAT
    chain ep/<ns>/<svc>/<proto>/<port>/<ip>/<tport>
                                           [ip saddr <ip> mark for masquerade  (hairpin)]
                                           [update @aff/... { ip saddr }]; dnat to <ip>:<tport>

So 10,000 services are one map lookup, not a chain walk; a connection picks an endpoint at
random once (NAT rules see only a connection's first packet; conntrack does the rest, which
is also why a terminating endpoint keeps its established connections).  SNAT happens only
where the reply would not come back through this node otherwise: a pod reaching itself
through its service (hairpin), and node ports with externalTrafficPolicy Cluster (the
endpoint may be on another node).  A port without usable endpoints has no map element: its
traffic is not translated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from agentd.policy.ruleset import NftChain, NftCounter, NftSet, Ruleset, rule_text

from .model import Endpoint, ServicePort

FAMILY = "ip"
TABLE = "agentd-services"
TABLES = frozenset({(FAMILY, TABLE)})
SERVICE_IPS = "service-ips"
NODE_PORTS = "service-nodeports"
MASQ_MARK = 0x4000  # kube-proxy's masquerade bit
NAME_MAX = 200
DSTNAT, SRCNAT = -100, 100


def _payload(protocol: str, field: str) -> dict[str, Any]:
    return {"payload": {"protocol": protocol, "field": field}}


def _meta(key: str) -> dict[str, Any]:
    return {"meta": {"key": key}}


def _match(left: Any, right: Any, op: str = "==") -> dict[str, Any]:
    return {"match": {"op": op, "left": left, "right": right}}


def _goto(chain: str) -> dict[str, Any]:
    return {"goto": {"target": chain}}


MARK_MASQ = {"mangle": {"key": _meta("mark"), "value": {"|": [_meta("mark"), MASQ_MARK]}}}
SADDR = _payload("ip", "saddr")


def name(kind: str, *parts: Any) -> str:
    full = "/".join((kind, *map(str, parts)))
    if len(full) <= NAME_MAX:
        return full
    return f"{kind}/#{hashlib.sha1(full.encode()).hexdigest()[:20]}"


def svc_chain(sp: ServicePort) -> str:
    return name("svc", sp.namespace, sp.service, sp.l4, sp.port)


def ext_chain(sp: ServicePort) -> str:
    return name("ext", sp.namespace, sp.service, sp.l4, sp.port)


def ep_chain(sp: ServicePort, e: Endpoint) -> str:
    return name("ep", sp.namespace, sp.service, sp.l4, sp.port, e.ip, e.port)


def affinity_set(sp: ServicePort, e: Endpoint) -> str:
    return name("aff", sp.namespace, sp.service, sp.l4, sp.port, e.ip, e.port)


def counter_name(namespace: str, service: str) -> str:
    return name("svc", namespace, service)


_COUNTERS: dict[tuple[str, str], NftCounter] = {}


def _counter(namespace: str, service: str) -> NftCounter:
    """One counter object per service, shared by its ports (so an unchanged one stays the same object)."""
    got = _COUNTERS.get((namespace, service))
    if got is None:
        if len(_COUNTERS) > 200_000:
            _COUNTERS.clear()
        got = _COUNTERS[(namespace, service)] = NftCounter(FAMILY, TABLE, counter_name(namespace, service))
    return got


def base_objects() -> list[Any]:
    key = {"concat": [_payload("ip", "daddr"), _meta("l4proto"), _payload("th", "dport")]}
    node_key = {"concat": [_meta("l4proto"), _payload("th", "dport")]}
    local = _match({"fib": {"result": "type", "flags": ["daddr"]}}, "local")
    not_loopback = _match(_payload("ip", "daddr"), {"prefix": {"addr": "127.0.0.0", "len": 8}}, "!=")
    masq = _match({"&": [_meta("mark"), MASQ_MARK]}, MASQ_MARK)
    return [
        NftSet(FAMILY, TABLE, SERVICE_IPS, ("ipv4_addr", "inet_proto", "inet_service"), map="verdict"),
        NftSet(FAMILY, TABLE, NODE_PORTS, ("inet_proto", "inet_service"), map="verdict"),
        NftChain(FAMILY, TABLE, "services", (
            rule_text([{"vmap": {"key": key, "data": "@" + SERVICE_IPS}}]),
            rule_text([local, not_loopback, {"vmap": {"key": node_key, "data": "@" + NODE_PORTS}}]),
        )),
        NftChain(FAMILY, TABLE, "prerouting", (rule_text([{"jump": {"target": "services"}}]),),
                 hook=("nat", "prerouting", DSTNAT, "accept")),
        NftChain(FAMILY, TABLE, "output", (rule_text([{"jump": {"target": "services"}}]),),
                 hook=("nat", "output", DSTNAT, "accept")),
        NftChain(FAMILY, TABLE, "postrouting", (rule_text([masq, {"masquerade": None}]),),
                 hook=("nat", "postrouting", SRCNAT, "accept")),
    ]  # fmt: skip


Compiled = tuple[list[Any], Any, Any]


def compile_services(ports: Iterable[ServicePort], node: str, cache: dict[ServicePort, Compiled] | None = None) -> Ruleset:
    """The whole table for ``node``.  ``cache``: what earlier calls compiled, by ServicePort
    (a frozen value: an unchanged port is the same object again, so recompiling after one
    change costs lookups, and :func:`changed` finds the changed objects by identity)."""
    rs = Ruleset(TABLES)
    for obj in base_objects():
        rs.add(obj)
    vips: set[Any] = set()
    node_ports: set[Any] = set()
    fresh: dict[ServicePort, Compiled] = {}
    for sp in sorted(ports, key=lambda p: p.key):
        got = cache.get(sp) if cache is not None else None
        if got is None:
            got = compile_port(sp, node)
        fresh[sp] = got
        objs, vip, node_port = got
        for obj in objs:
            rs.add(obj)
        if vip is not None:
            vips.add(vip)
        if node_port is not None:
            node_ports.add(node_port)
    for map_name, elements in ((SERVICE_IPS, vips), (NODE_PORTS, node_ports)):
        base = rs.objects[(FAMILY, TABLE, "set", map_name)]
        assert isinstance(base, NftSet)
        rs.add(NftSet(base.family, base.table, base.name, base.type, map=base.map, elements=frozenset(elements)))
    if cache is not None:
        cache.clear()
        cache.update(fresh)
    return rs


def changed(before: Ruleset | None, after: Ruleset) -> set[Any] | None:
    """The keys of objects that may differ (None: compare everything): new, gone, or not the
    same object (compile_services with a cache reuses the objects of unchanged ports)."""
    if before is None:
        return None
    keys = set(before.objects.keys() ^ after.objects.keys())
    keys.update(k for k, v in after.objects.items() if before.objects.get(k) is not v)
    return keys


def compile_port(sp: ServicePort, node: str) -> tuple[list[Any], Any, Any]:
    """The objects of one service port, its service-ips element and its node-port element."""
    objs: list[Any] = [_counter(sp.namespace, sp.service)]
    counter = {"counter": counter_name(sp.namespace, sp.service)}
    every = sp.usable()
    local = sp.usable(node)
    chains: dict[str, Endpoint] = {}
    vip = None
    if sp.cluster_ip is not None:
        chosen = local if sp.internal_local else every
        if chosen:
            rules, eps = _pick(sp, chosen, counter)
            objs.append(NftChain(FAMILY, TABLE, svc_chain(sp), rules))
            chains.update(eps)
            vip = ((sp.cluster_ip, sp.l4, sp.port), ("goto", svc_chain(sp)))
    node_port = None
    if sp.node_port is not None:
        rules = ()
        if sp.external_local:
            if local:
                rules, eps = _pick(sp, local, counter)
                chains.update(eps)
        elif every:
            if sp.cluster_ip is not None and not sp.internal_local:
                rules = (rule_text([MARK_MASQ, _goto(svc_chain(sp))]),)
            else:
                picked, eps = _pick(sp, every, counter)
                rules = (rule_text([MARK_MASQ]), *picked)
                chains.update(eps)
        if rules:
            objs.append(NftChain(FAMILY, TABLE, ext_chain(sp), rules))
            node_port = ((sp.l4, sp.node_port), ("goto", ext_chain(sp)))
    for chain, e in sorted(chains.items()):
        objs += _endpoint(sp, e, chain)
    return objs, vip, node_port


def _pick(sp: ServicePort, endpoints: tuple[Endpoint, ...], counter: dict[str, Any]) -> tuple[tuple[str, ...], dict[str, Endpoint]]:
    """The rules choosing an endpoint, and the endpoint chains they use.

    Without affinity: no chain per endpoint, the service chain translates itself (one rule:
    ``dnat ip to numgen random mod N map { 0 : ip . port, ... }``), and a connection from any of
    the endpoints is marked for SNAT (hairpin: kube-proxy marks only the endpoint reaching
    itself; here an endpoint reaching a sibling through the VIP is SNATed too).  A table of
    one chain per service instead of one per endpoint is what keeps libnftables' per-transaction
    cost (it reads the table's chains first) low.  With ClientIP affinity: a chain per endpoint."""
    if sp.affinity_timeout is not None:
        return _dispatch(sp, endpoints, counter), {ep_chain(sp, e): e for e in endpoints}
    addrs = sorted({e.ip for e in endpoints})
    hairpin = rule_text([_match(SADDR, addrs[0] if len(addrs) == 1 else {"set": addrs}), MARK_MASQ])
    proto = _match(_meta("l4proto"), sp.l4)
    if len(endpoints) == 1:
        nat: dict[str, Any] = {"dnat": {"addr": endpoints[0].ip, "port": endpoints[0].port}}
    else:
        pick = {"numgen": {"mode": "random", "mod": len(endpoints), "offset": 0}}
        table = {"set": [[i, {"concat": [e.ip, e.port]}] for i, e in enumerate(endpoints)]}
        nat = {"dnat": {"family": "ip", "addr": {"map": {"key": pick, "data": table}}}}
    return (hairpin, rule_text([proto, counter, nat])), {}


def _dispatch(sp: ServicePort, endpoints: tuple[Endpoint, ...], counter: dict[str, Any]) -> tuple[str, ...]:
    rules = []
    if sp.affinity_timeout is not None:
        for e in endpoints:
            rules.append(rule_text([_match(SADDR, "@" + affinity_set(sp, e)), counter, _goto(ep_chain(sp, e))]))
    if len(endpoints) == 1:
        rules.append(rule_text([counter, _goto(ep_chain(sp, endpoints[0]))]))
    else:
        pick = {"numgen": {"mode": "random", "mod": len(endpoints), "offset": 0}}
        table = {"set": [[i, _goto(ep_chain(sp, e))] for i, e in enumerate(endpoints)]}
        rules.append(rule_text([counter, {"vmap": {"key": pick, "data": table}}]))
    return tuple(rules)


def _endpoint(sp: ServicePort, e: Endpoint, chain: str) -> list[Any]:
    rules = [rule_text([_match(SADDR, e.ip), MARK_MASQ])]  # hairpin: the pod reaching itself
    objs: list[Any] = []
    if sp.affinity_timeout is not None:
        aff = affinity_set(sp, e)
        objs.append(NftSet(FAMILY, TABLE, aff, ("ipv4_addr",), flags=("timeout",), timeout=sp.affinity_timeout))
        rules.append(rule_text([{"set": {"op": "update", "elem": SADDR, "set": "@" + aff}}]))
    # dnat to addr:port needs the protocol known in the rule (the map matched it already).
    rules.append(rule_text([_match(_meta("l4proto"), sp.l4), {"dnat": {"addr": e.ip, "port": e.port}}]))
    objs.append(NftChain(FAMILY, TABLE, chain, tuple(rules)))
    return objs


ServiceKey = tuple[str, str]  # (namespace, name)


class Table:
    """The table kept up to date service by service: a change costs that service's objects.

    :meth:`update` replaces what one Service compiles to and returns the keys of the objects
    that changed (for :meth:`agentd.policy.programmer.PolicyProgrammer.sync`); the maps are
    rebuilt from per-service elements.  ``rs`` is the whole wanted ruleset at any time."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.rs = Ruleset(TABLES)
        for obj in base_objects():
            self.rs.add(obj)
        self.services: dict[ServiceKey, tuple[tuple[ServicePort, ...], dict[Any, Any], set[Any], set[Any]]] = {}
        self.vips: set[Any] = set()
        self.node_ports: set[Any] = set()

    def update(self, key: ServiceKey, ports: Iterable[ServicePort]) -> set[Any]:
        """Make service ``key`` compile to ``ports`` (none: it is gone); the changed object keys."""
        ports = tuple(sorted(ports, key=lambda p: p.key))
        old = self.services.get(key)
        if old is not None and old[0] == ports:
            return set()
        old_objs, old_vips, old_nps = (old[1], old[2], old[3]) if old is not None else ({}, set(), set())
        objs: dict[Any, Any] = {}
        vips: set[Any] = set()
        nps: set[Any] = set()
        for sp in ports:
            compiled, vip, node_port = compile_port(sp, self.node)
            objs.update((o.key, o) for o in compiled)
            if vip is not None:
                vips.add(vip)
            if node_port is not None:
                nps.add(node_port)
        touched: set[Any] = set()
        for k in old_objs.keys() - objs.keys():
            self.rs.objects.pop(k, None)
            touched.add(k)
        for k, o in objs.items():
            if old_objs.get(k) != o:
                self.rs.objects[k] = o
                touched.add(k)
        if ports:
            self.services[key] = (ports, objs, vips, nps)
        else:
            self.services.pop(key, None)
        for name, have, old_set, new_set in ((SERVICE_IPS, self.vips, old_vips, vips), (NODE_PORTS, self.node_ports, old_nps, nps)):
            if old_set != new_set:
                have.difference_update(old_set - new_set)
                have.update(new_set)
                base = self.rs.objects[(FAMILY, TABLE, "set", name)]
                assert isinstance(base, NftSet)
                self.rs.add(NftSet(base.family, base.table, base.name, base.type, map=base.map, elements=frozenset(have)))
                touched.add(base.key)
        return touched

    def ports(self) -> list[ServicePort]:
        return [sp for ports, *_ in self.services.values() for sp in ports]
