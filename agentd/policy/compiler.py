"""From policies and pods to nftables objects: the agent's two tables, as values.

Where packets are judged (see docs/policy.md for the picture):

* ``table inet agentd-policy`` holds the policy itself, on the **forward** hook, where every
  packet to or from a pod of this node passes once it is routed: traffic between nodes (any
  backend: it is routed between the pod bridge and the underlay or a tunnel device) and,
  thanks to the bridge table below, traffic between two pods of this node.  Two base chains:
  ``egress`` (priority 0) sends a packet from a local egress-isolated pod through a verdict
  map keyed by its source address to that pod's chain; ``ingress`` (priority 10) does the
  same by destination for ingress-isolated pods.  A pod's chain jumps to the chain of every
  policy selecting it (``accept`` there ends that base chain: the packet is allowed in that
  direction, and the next base chain judges the other) and ends in a counted drop.  Replies
  pass through ``ct state established,related accept`` first.  Traffic between a pod and its
  own node is never judged (the input and output hooks are not used), as in Kubernetes.
* ``table bridge agentd-policy`` exists because two pods of one node talk through the CNI
  bridge, at layer 2, where the inet hooks do not see them unless br_netfilter is built in
  and bridge-nf-call-iptables is on (a host setting agentd does not rely on; bridge-family
  conntrack, nf_conntrack_bridge, is not available everywhere either).  Its prerouting
  chain hands unicast IPv4 frames from or to an isolated pod up to the node's IP stack
  (``meta pkttype set host`` and a destination MAC the bridge delivers locally: the host side
  of a pod's own veth), so they are routed back out of the bridge, through conntrack and the
  inet chains like any other traffic.  It also drops frames whose source address is not the
  pod's own (a pod must not borrow another's identity), and what still crosses the bridge
  to or from an isolated pod without being routed (IPv4 broadcast and multicast, IPv6 other
  than neighbour discovery).

Drop records (flow visibility, ``agentd.flows``): with a :class:`DropLog`, each pod chain's
drop is preceded by a rate-limited ``log group N prefix "<the chain's name>"`` rule (NFLOG:
the agent hears the packet and maps the prefix back to the pod, the direction and the
policies that isolate it), what the limit holds back is counted in the ``flow-log-suppressed``
counter, and the spoofing drop logs with prefix ``spoofed``.  With ``route_all`` the bridge
table hands every local pod's unicast up to the IP stack, not only isolated pods', so that
conntrack sees every connection of the node's pods (the flows' connection records).

Selector members are set elements: each rule has a set of its peer pods' addresses
(``np-in/<ns>/<policy>/<rule>/pods``) and, with named ports, a set of (address, protocol,
port) (``.../named``); its ipBlocks are prefix matches in its rules.  A pod appearing or
changing labels anywhere in the cluster changes elements, never rules.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from ipaddress import IPv4Address, IPv4Network
from typing import Any

from agentd.nft.expr import ACCEPT, DROP, ESTABLISHED, SUPPRESSED, DropLog, jump, match, meta, object_name, payload, ref
from agentd.nft.ruleset import NftChain, NftCounter, NftSet, rule_text

from .model import Policy, Port, Rule


TABLE = "agentd-policy"
INET = "inet"
BRIDGE = "bridge"
TABLES = frozenset({(INET, TABLE), (BRIDGE, TABLE)})

EGRESS_PRIORITY = 0
INGRESS_PRIORITY = 10
BRIDGE_PRIORITY = -200  # the bridge family's "filter" priority

EGRESS_MAP = "egress-pods"
INGRESS_MAP = "ingress-pods"
BRIDGES = "bridges"
SPOOFED = "spoofed"

SPOOFED_PREFIX = "spoofed"
PREFIX_MAX = 127  # NF_LOG_PREFIXLEN (128) with its NUL

_L4 = {"TCP": "tcp", "UDP": "udp", "SCTP": "sctp"}
ND_TYPES = ["nd-router-solicit", "nd-router-advert", "nd-neighbor-solicit", "nd-neighbor-advert"]


def pod_chain(direction: str, namespace: str, name: str) -> str:
    return object_name(f"pod-{direction}", namespace, name)


def policy_chain(direction: str, policy: Policy) -> str:
    return object_name(f"np-{direction}", policy.namespace, policy.name)


def drop_prefix(chain: str) -> str:
    """The log prefix of a pod chain's drop rule: its name, or its hash where that is too long."""
    if len(chain) <= PREFIX_MAX:
        return chain
    kind = chain.partition("/")[0]
    return f"{kind}/#{hashlib.sha1(chain.encode()).hexdigest()[:20]}"


# ------------------------------------------------------------------ base objects


def base_objects(bridges: Iterable[str], stateful: bool = True, log: DropLog | None = None) -> list[Any]:
    """Tables' fixed part: base chains, dispatch maps, the bridge table's sets.

    ``stateful``: some local pod is isolated.  Only then do the base chains look at conntrack
    (a ct expression makes the kernel track every packet of the namespace): a node without
    isolated pods pays no connection tracking for policy."""
    established = (rule_text([ESTABLISHED, ACCEPT]),) if stateful else ()
    inet: list[Any] = [
        NftSet(INET, TABLE, EGRESS_MAP, ("ipv4_addr",), map="verdict"),
        NftSet(INET, TABLE, INGRESS_MAP, ("ipv4_addr",), map="verdict"),
        NftSet(INET, TABLE, BRIDGES, ("ifname",), elements=frozenset(bridges)),
        *([NftCounter(INET, TABLE, SUPPRESSED)] if log is not None else []),
        NftChain(
            INET, TABLE, "egress",
            (*established, rule_text([{"vmap": {"key": payload("ip", "saddr"), "data": ref(EGRESS_MAP)}}])),
            hook=("filter", "forward", EGRESS_PRIORITY, "accept"),
        ),
        NftChain(
            INET, TABLE, "ingress",
            (*established, rule_text([{"vmap": {"key": payload("ip", "daddr"), "data": ref(INGRESS_MAP)}}])),
            hook=("filter", "forward", INGRESS_PRIORITY, "accept"),
        ),
        # Same-node pod traffic is routed back out of the bridge it came in on; the node
        # would tell the pod so with ICMP redirects ("send it directly"), which is not the point.
        NftChain(
            INET, TABLE, "output",
            (rule_text([match(meta("oifname"), ref(BRIDGES)), match(payload("icmp", "type"), "redirect"), DROP]),),
            hook=("filter", "output", 0, "accept"),
        ),
    ]  # fmt: skip
    return inet + _bridge_base(log)


def _bridge_base(log: DropLog | None = None) -> list[Any]:
    ip = match(payload("ether", "type"), "ip")
    to_host = {"mangle": {"key": meta("pkttype"), "value": "host"}}
    unicast_other = match(meta("pkttype"), "other")  # not for the bridge, not broadcast/multicast
    spoofed = [ip, match(meta("iifname"), ref("pod-ports")),
               match({"concat": [meta("iifname"), payload("ip", "saddr")]}, ref("pod-addrs"), "!=")]
    prerouting = [
        # A pod's IPv4 packets carry its own address, or are dropped (and logged: flow records).
        [*spoofed, jump(SPOOFED)] if log is not None else [*spoofed, {"counter": SPOOFED}, DROP],
        # Unicast from an isolated pod: up to the IP stack (delivered to the host through the
        # pod's own host-side MAC, a local FDB entry of the bridge).
        [ip, unicast_other, match(meta("iifname"), ref("isolated-ports")), to_host,
         {"mangle": {"key": payload("ether", "daddr"), "value": {"map": {"key": meta("iifname"), "data": ref("port-macs")}}}}],
        # Unicast to an isolated pod, from anywhere on the bridge: the same, by destination.
        [ip, unicast_other, match(payload("ip", "daddr"), ref("isolated-addrs")), to_host,
         {"mangle": {"key": payload("ether", "daddr"), "value": {"map": {"key": payload("ip", "daddr"), "data": ref("addr-macs")}}}}],
    ]  # fmt: skip
    both = match(payload("ether", "type"), {"set": ["ip", "ip6"]})
    forward = [
        [match(payload("icmpv6", "type"), {"set": ND_TYPES}), ACCEPT],
        [both, match(meta("oifname"), ref("isolated-in-ports")), {"counter": None}, DROP],
        [both, match(meta("iifname"), ref("isolated-out-ports")), {"counter": None}, DROP],
    ]
    logged: list[Any] = []
    if log is not None:
        logged = [NftCounter(BRIDGE, TABLE, SUPPRESSED),
                  NftChain(BRIDGE, TABLE, SPOOFED, log.chain_rules(SPOOFED_PREFIX, [{"counter": SPOOFED}, DROP]))]
    return [
        *logged,
        NftSet(BRIDGE, TABLE, "pod-ports", ("ifname",)),
        NftSet(BRIDGE, TABLE, "pod-addrs", ("ifname", "ipv4_addr")),
        NftSet(BRIDGE, TABLE, "isolated-ports", ("ifname",)),
        NftSet(BRIDGE, TABLE, "isolated-in-ports", ("ifname",)),
        NftSet(BRIDGE, TABLE, "isolated-out-ports", ("ifname",)),
        NftSet(BRIDGE, TABLE, "isolated-addrs", ("ipv4_addr",)),
        NftSet(BRIDGE, TABLE, "port-macs", ("ifname",), map="ether_addr"),
        NftSet(BRIDGE, TABLE, "addr-macs", ("ipv4_addr",), map="ether_addr"),
        NftCounter(BRIDGE, TABLE, SPOOFED),
        NftChain(BRIDGE, TABLE, "prerouting", tuple(rule_text(r) for r in prerouting),
                 hook=("filter", "prerouting", BRIDGE_PRIORITY, "accept")),
        NftChain(BRIDGE, TABLE, "forward", tuple(rule_text(r) for r in forward),
                 hook=("filter", "forward", BRIDGE_PRIORITY, "accept")),
    ]  # fmt: skip


# ------------------------------------------------------------------ per policy


class RuleMembers:
    """What a compiled rule needs from the cluster: resolved by the engine."""

    def __init__(
        self,
        pod_ips: frozenset[IPv4Address] = frozenset(),
        named: frozenset[tuple[str, str, int]] = frozenset(),
    ) -> None:
        self.pod_ips = pod_ips  # addresses of the pods the rule's selector peers match
        self.named = named  # (address, l4proto, port) for the rule's named ports


def compile_policy(
    policy: Policy,
    direction: str,
    rules: tuple[Rule, ...],
    members: list[RuleMembers],
) -> list[Any]:
    """The chain ``np-<direction>/<ns>/<name>`` and its rules' sets.

    ``direction`` is "in" (peers are sources) or "out" (peers are destinations).  Named
    ports resolve on the destination pod: for "in" the selected local pods, for "out" the
    peers; ``members[i].named`` already holds the resolved triples."""
    chain_name = policy_chain(direction, policy)
    peer_field = "saddr" if direction == "in" else "daddr"
    objects: list[Any] = []
    chain_rules: list[str] = []
    for index, (rule, mem) in enumerate(zip(rules, members)):
        base = f"{chain_name}/{index}"
        peer_matches: list[list[dict[str, Any]]] = []
        if rule.peers is None:
            peer_matches.append([])
        else:
            if any(p.selector is not None for p in rule.peers):
                name = f"{base}/pods"
                objects.append(NftSet(INET, TABLE, name, ("ipv4_addr",), elements=frozenset(map(str, mem.pod_ips))))
                peer_matches.append([match(payload("ip", peer_field), ref(name))])
            # ipBlocks: one prefix match per range (cidr minus its excepts), no set: named
            # interval sets would make libnftables dump all their elements before every change.
            for net in _collapse(r for p in rule.peers if p.block is not None for r in p.block.ranges()):
                prefix = str(net.network_address) if net.prefixlen == 32 else {
                    "prefix": {"addr": str(net.network_address), "len": net.prefixlen}}
                peer_matches.append([match(payload("ip", peer_field), prefix)])
        port_matches, named = _port_matches(rule.ports)
        if named:
            name = f"{base}/named"
            objects.append(
                NftSet(INET, TABLE, name, ("ipv4_addr", "inet_proto", "inet_service"), elements=frozenset(mem.named))
            )
            named_match = [
                match({"concat": [payload("ip", "daddr"), meta("l4proto"), payload("th", "dport")]}, ref(name))
            ]
            if direction == "in":
                port_matches.append(named_match)
            else:
                # Egress named ports resolve on the peers themselves: the set holds only peers.
                chain_rules.append(rule_text([*named_match, ACCEPT]))
        for peer in peer_matches:
            for port in port_matches:
                chain_rules.append(rule_text([*peer, *port, ACCEPT]))
    objects.append(NftChain(INET, TABLE, chain_name, tuple(chain_rules)))
    return objects


def _collapse(nets: Iterable[IPv4Network]) -> list[IPv4Network]:
    from ipaddress import collapse_addresses

    return list(collapse_addresses(nets))


def _port_matches(ports: tuple[Port, ...] | None) -> tuple[list[list[dict[str, Any]]], bool]:
    """The numeric port matches of a rule (one per protocol), and whether it has named ports."""
    if ports is None:
        return [[]], False
    by_proto: dict[str, list[Any] | None] = {}
    named = False
    for p in ports:
        if isinstance(p.port, str):
            named = True
            continue
        if p.port is None:
            by_proto[p.protocol] = None  # every port of the protocol
            continue
        values = by_proto.setdefault(p.protocol, [])
        if values is None:
            continue
        if p.end_port is not None and p.end_port != p.port:
            values.append({"range": [p.port, p.end_port]})
        else:
            values.append(p.port)
    out = []
    for proto in ("TCP", "UDP", "SCTP"):
        if proto not in by_proto:
            continue
        values = by_proto[proto]
        proto_match = match(meta("l4proto"), _L4[proto])
        if values is None:
            out.append([proto_match])
        else:
            right = values[0] if len(values) == 1 and not isinstance(values[0], dict) else {"set": _dedupe(values)}
            out.append([proto_match, match(payload("th", "dport"), right)])
    return out, named


def _dedupe(values: list[Any]) -> list[Any]:
    seen, out = set(), []
    for v in values:
        key = repr(v)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return sorted(out, key=lambda v: v if isinstance(v, int) else v["range"][0])


def l4proto(protocol: str) -> str:
    return _L4[protocol]


# ------------------------------------------------------------------ per local pod


def compile_pod_chain(direction: str, namespace: str, name: str, policies: list[Policy],
                      log: DropLog | None = None) -> list[Any]:
    """``pod-<direction>/<ns>/<name>``: a jump to each selecting policy, then a counted drop
    (with ``log``: logged while under the limit, else counted as suppressed)."""
    chain = pod_chain(direction, namespace, name)
    rules = [rule_text([jump(policy_chain(direction, p))]) for p in policies]
    if log is not None:
        rules += log.chain_rules(drop_prefix(chain), [{"counter": chain}, DROP])
    else:
        rules.append(rule_text([{"counter": chain}, DROP]))
    return [NftChain(INET, TABLE, chain, tuple(rules)), NftCounter(INET, TABLE, chain)]
