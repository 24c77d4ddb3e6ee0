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
  pass through ``ct state established,related accept`` first, and a pod sent back to itself
  through a Service (``ct status dnat``, from a pod bridge, ``self-pods``) is accepted next:
  NetworkPolicy cannot keep a pod from itself.  Traffic between a pod and its
  own node is never judged (the input and output hooks are not used), as in Kubernetes.
* ``table bridge agentd-policy`` exists because two pods of one node talk through the CNI
  bridge, at layer 2, where the inet hooks do not see them unless br_netfilter is built in
  and bridge-nf-call-iptables is on (a host setting agentd does not rely on; bridge-family
  conntrack, nf_conntrack_bridge, is not available everywhere either).  Its prerouting
  chain hands unicast IPv4 frames from or to an isolated pod up to the node's IP stack
  (``meta pkttype set host`` and a destination MAC the bridge delivers locally: the host side
  of a pod's own veth), so they are routed back out of the bridge, through conntrack and the
  inet chains like any other traffic.  It also drops frames whose source address is not the
  pod's own (a pod must not borrow another's identity; ARP's sender address too) or whose
  source MAC is not its interface's (``spoofed-mac``: another pod's MAC would move the
  bridge's forwarding entry for it to this port; nor may its ARP packets' sender hardware
  address, which neighbour caches take, be another MAC), VLAN-tagged
  frames from pods (the tag hides the frame's type from every ``ether type`` match), the
  family a single-family cluster has not (nothing would judge it once routed), and what
  still crosses the bridge to or from an isolated pod without being routed (IPv4 broadcast
  and multicast, IPv6 other than neighbour discovery).

Drop records (flow visibility, ``agentd.flows``): with a :class:`DropLog`, each pod chain's
drop is preceded by a rate-limited ``log group N prefix "<the chain's name>"`` rule (NFLOG:
the agent hears the packet and maps the prefix back to the pod, the direction and the
policies that isolate it), what the limit holds back is counted in the ``flow-log-suppressed``
counter, and the spoofing drops log with prefix ``spoofed`` (``spoofed-mac``, ``spoofed-arp``,
``spoofed-nd``; a pod's router advertisements and redirects ``ra-guard``; its VLAN-tagged
frames ``vlan-tagged``), the isolation
drops of what crosses the bridge unrouted ``isolated-in`` and ``isolated-out``, the other
family's ``other-family`` (every drop but the node's own ICMP redirects to its pods and, in
an IPv4-only cluster, the MLD messages a pod's kernel sends at link up).  With ``route_all``
the bridge table hands every local pod's unicast up to the IP stack, not only isolated pods', so that
conntrack sees every connection of the node's pods (the flows' connection records); so it does
while Services translate on the node (``route_services``: an endpoint's reply to a client pod
of its node is un-DNATed) -- for either, unless br_netfilter hands the bridged frames to the IP
hooks already (PolicyEngine.bridged_to_ip), where conntrack sees and translates them bridged.

IPv6 (``families`` with 6, dual-stack and IPv6-only clusters) is judged by the same chains:
every object that holds addresses has an IPv6 twin beside it, named with a ``6``
(``egress-pods6``, ``np-in/<ns>/<policy>/<rule>/pods6``), read by an ``ip6`` match next to
the ``ip`` one, and a pod is in the sets of both families with both its addresses.  The
bridge table checks IPv6 sources as it checks IPv4 ones (link-local sources and the
unspecified source of duplicate address detection aside), drops router advertisements and
redirects from pods (they are no routers), drops their neighbour advertisements for
addresses not their own (``na/<port>`` chains, :func:`compile_na_chain`) and, from a pod whose
MAC is checked, neighbour discovery whose options are not one link-layer address option naming
that MAC, or none (``lla/<port>`` chains, :func:`compile_lla_chain`), and lets neighbour
discovery pass otherwise untouched, to and from isolated pods alike: it is never routed up,
so isolation never breaks it.

Selector members are set elements: each distinct set of peer selectors a rule of a policy's
chain lists has one set of the addresses of the pods any of them matches
(``np-in/<ns>/<policy>/<rule>/pods``, after the first rule listing them), read by every rule
listing the same selectors, and named ports a set of (address, protocol, port)
(``.../named``); ipBlocks are prefix matches in the rules.  A pod appearing or changing labels
anywhere in the cluster changes elements, never rules.  A policy's chains and the sets they
read are laid out from the policy alone (:func:`layout`): one too large (MAX_POLICY_RULES,
MAX_POLICY_SELECTORS) is refused before any pod is looked at; the engine fills the sets, at
most MAX_POLICY_ELEMENTS elements a policy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from agentd.nft.expr import (
    ACCEPT, DROP, ESTABLISHED, RETURN, SUPPRESSED, AddressFamily, DropLog, families as rows, jump, match, meta,
    object_name, payload, prefix, ref,
)  # fmt: skip
from agentd.nft.flowmask import MARK as RECORD_MARK
from agentd.nft.ruleset import NftChain, NftCounter, NftSet, rule_text

from .model import Address, Network, Peer, PeerSelector, Policy, Port, Rule


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
SELF = "self-pods"  # address . address: each isolated local pod's P as P . P (a pod reaching itself through a Service)
SELF_PORTS = "self-ports"  # the bridge's: port . address . address, P's port . P . P
SPOOFED = "spoofed"
# The packet mark bit the bridge's prerouting sets on an isolated pod's packet that came in
# from that pod's own port with its own address (self-ports, port . P . P): the hairpin
# accepts require it, so a packet with P's address from anywhere else (a container attached
# without identity, whose source is not checked) is not taken for P's own.  Beside the
# Services' masquerade bit (0x4000, kube-proxy's) and the fast path's record bit (0x00800000).
SELF_MARK = 0x00400000
FROM_SELF = match({"&": [meta("mark"), SELF_MARK]}, SELF_MARK)

NA_PORTS = "na-ports"  # pod port -> its chain of the targets its neighbour advertisements may have
LLA_PORTS = "lla-ports"  # MAC-checked pod port -> its chain of the neighbour discovery options it may send

SPOOFED_PREFIX = "spoofed"
# Frames from a pod port whose source MAC is not the pod's own: their own drop chain and log
# prefix (the flow record's reason), counted in the one spoofed counter.
SPOOFED_MAC = "spoofed-mac"
SPOOFED_ARP = "spoofed-arp"  # ARP from a pod port claiming an address not the pod's own
SPOOFED_ND = "spoofed-nd"  # a neighbour advertisement from a pod port claiming an address not the pod's own
RA_GUARD = "ra-guard"  # a router advertisement or redirect from a pod port: pods are no routers
VLAN_TAGGED = "vlan-tagged"  # a VLAN-tagged frame from a pod port (its source is not what is wrong)
# What crosses the bridge to (``isolated-in``) or from (``isolated-out``) an isolated pod
# without being routed up, so without being judged (IPv4 broadcast and multicast, IPv6 other
# than neighbour discovery): dropped, each direction through its own logged chain.
ISOLATED_IN = "isolated-in"
ISOLATED_OUT = "isolated-out"
# A pod's packets of the family the cluster does not run (nothing would judge them once routed).
OTHER_FAMILY = "other-family"
# The bridge table's logged drop chains, each its name the log prefix (the record's reason:
# agentd.daemon.flow_directory) and the counter it counts in (None: an anonymous one).
BRIDGE_DROPS: dict[str, str | None] = {
    SPOOFED_PREFIX: SPOOFED, SPOOFED_MAC: SPOOFED, SPOOFED_ARP: SPOOFED, SPOOFED_ND: SPOOFED, RA_GUARD: SPOOFED,
    VLAN_TAGGED: SPOOFED,
    ISOLATED_IN: None, ISOLATED_OUT: None, OTHER_FAMILY: None,
}  # fmt: skip
# A pod's new connection to an address the node has no route to (the kernel drops it when it
# routes the packet, before any forward hook): logged only, its chain's name the log prefix.
NO_ROUTE = "no-route"
# A nat chain just before the Services' translation (dstnat, -100): the kernel asks nat chains
# for a connection's first packet only, and only until one binds (a DNAT), so after it a
# translated connection would never be asked.
NO_ROUTE_PRIORITY = -101
# The ICMP errors the kernel sends for a packet it has no route for (ip_error, ip6_pkt_drop):
# none, an unreachable route; a prohibit route.
NO_ROUTE_CODES = {4: ("net-unreachable", "host-unreachable"), 6: ("no-route",)}
POD_MACS = "pod-macs"  # port . the MAC of the pod behind it
MAC_PORTS = "mac-ports"  # the pod ports whose pod's MAC is known, or refused (the others are not checked)
PREFIX_MAX = 127  # NF_LOG_PREFIXLEN (128) with its NUL

_L4 = {"TCP": "tcp", "UDP": "udp", "SCTP": "sctp"}
ND_TYPES = ["nd-router-solicit", "nd-router-advert", "nd-neighbor-solicit", "nd-neighbor-advert"]
# MLD's query, report, done and MLDv2 report (RFC 2710, 3810): what a pod's kernel sends of IPv6
# unasked, where the cluster runs none, at every link up (its one drop left unlogged).
MLD_TYPES = [130, 131, 132, 143]
OTHER_FAMILY_ND = ["nd-router-solicit", "nd-neighbor-solicit", "nd-neighbor-advert"]  # what a pod may send of IPv6 where it has none


def pod_chain(direction: str, namespace: str, name: str) -> str:
    return object_name(f"pod-{direction}", namespace, name)


def policy_chain(direction: str, policy: Policy) -> str:
    return object_name(f"np-{direction}", policy.namespace, policy.name)


def na_chain(interface: str) -> str:
    return f"na/{interface}"


def lla_chain(interface: str) -> str:
    return f"lla/{interface}"


# A neighbour advertisement's target address: 8 bytes into the ICMPv6 header (nftables 1.0.6
# has no name for it, so it is a raw payload, compared with numbers).
_NA_TARGET = {"payload": {"base": "th", "offset": 64, "len": 128}}
_NA_TARGET_NOT_LINK_LOCAL = match({"&": [{"payload": {"base": "th", "offset": 64, "len": 16}}, 0xFFC0]}, 0xFE80, "!=")


def compile_na_chain(interface: str, addresses: Iterable[str], log: DropLog | None = None) -> NftChain:
    """``na/<interface>``: the pod port's neighbour advertisements (with a target that is not
    link-local) go on only for the pod's own IPv6 addresses; the others are spoofed."""
    from ipaddress import IPv6Address

    rules = [rule_text([match(_NA_TARGET, f"0x{int(IPv6Address(a)):032x}"), RETURN]) for a in sorted(addresses)]
    return NftChain(BRIDGE, TABLE, na_chain(interface), (*rules, rule_text(_spoofed(log, SPOOFED_ND))))


# Neighbour discovery's link-layer address options (RFC 4861 4.6.1), which a receiver's
# neighbour cache takes for the sender's (NS, RS: source, type 1) or the target's (NA: target,
# type 2) address, as an ARP packet's sender hardware address.  nftables 1.0.6 has no expression
# for options, only raw payloads at fixed offsets, while a receiving Linux kernel takes the first
# link-layer address option wherever it is among the options: so the check is by shape, judged
# with the IPv6 payload length.  An NS or NA is 24 bytes (ICMPv6 header, reserved or flags, the
# target) and an RS 8 before its options; what a pod may send is that alone, or with exactly one
# option, of the right type, 8 bytes long (length 1), naming the pod's own MAC: type, length and
# MAC as one 64-bit raw payload at the options' offset.  (An extension header makes the ICMPv6
# message shorter than the payload length: a receiver sees no option the check did not.)
_ND_BODY = {"nd-neighbor-solicit": 24, "nd-neighbor-advert": 24, "nd-router-solicit": 8}
_ND_LLA_TYPE = {"nd-neighbor-solicit": 1, "nd-neighbor-advert": 2, "nd-router-solicit": 1}
ND_CHECKED = ["nd-router-solicit", "nd-neighbor-solicit", "nd-neighbor-advert"]
_IP6_LENGTH = payload("ip6", "length")
# Duplicate address detection's solicitation (from the unspecified address) carries no source
# link-layer address (RFC 4861 7.2.2; a receiving Linux kernel drops one that does) but, with
# enhanced_dad (Linux's default), a nonce option (RFC 7527, type 14, 8 bytes: Linux's nonce is
# 6), which is no address and updates no cache.
ND_NONCE = 14
_DAD_NONCE = [match(payload("icmpv6", "type"), "nd-neighbor-solicit"), match(_IP6_LENGTH, 32),
              match({"payload": {"base": "th", "offset": 192, "len": 16}}, f"0x{ND_NONCE:02x}01")]  # fmt: skip


def _nd_option(kind: str) -> dict[str, Any]:
    """The raw payload of a neighbour discovery message's first 8 bytes of options."""
    return {"payload": {"base": "th", "offset": _ND_BODY[kind] * 8, "len": 64}}


def compile_lla_chain(interface: str, mac: str, log: DropLog | None = None) -> NftChain:
    """``lla/<interface>``: the neighbour solicitations, advertisements and router
    solicitations of the pod port whose pod's MAC is ``mac`` go on only with no option, or
    with one link-layer address option of their kind naming ``mac``; the others are spoofed
    (``spoofed-mac``, as an ARP packet's sender hardware address not the pod's own)."""
    own = int.from_bytes(bytes.fromhex(mac.replace(":", "")), "big")  # six octets (podmacs.refusal refuses the rest)
    rules = [rule_text([match(payload("icmpv6", "type"), {"set": ["nd-neighbor-solicit", "nd-neighbor-advert"]}),
                        match(_IP6_LENGTH, 24), RETURN])]  # fmt: skip
    for kind in ("nd-neighbor-solicit", "nd-neighbor-advert"):
        option = (_ND_LLA_TYPE[kind] << 56) | (1 << 48) | own
        rules.append(rule_text([match(payload("icmpv6", "type"), kind), match(_IP6_LENGTH, 32),
                                match(_nd_option(kind), f"0x{option:016x}"), RETURN]))  # fmt: skip
    option = (_ND_LLA_TYPE["nd-router-solicit"] << 56) | (1 << 48) | own
    rules += [rule_text([match(payload("icmpv6", "type"), "nd-router-solicit"), match(_IP6_LENGTH, 8), RETURN]),
              rule_text([match(payload("icmpv6", "type"), "nd-router-solicit"), match(_IP6_LENGTH, 16),
                         match(_nd_option("nd-router-solicit"), f"0x{option:016x}"), RETURN])]  # fmt: skip
    return NftChain(BRIDGE, TABLE, lla_chain(interface), (*rules, rule_text(_spoofed(log, SPOOFED_MAC))))


def drop_prefix(chain: str) -> str:
    """The log prefix of a pod chain's drop rule: its name, or its hash where that is too long."""
    if len(chain) <= PREFIX_MAX:
        return chain
    kind = chain.partition("/")[0]
    return f"{kind}/#{hashlib.sha1(chain.encode()).hexdigest()[:20]}"


# ------------------------------------------------------------------ base objects


def base_objects(
    bridges: Iterable[str], stateful: bool = True, log: DropLog | None = None, families: Sequence[int] = (4,),
    unrouted: Sequence[Any] = (),
) -> list[Any]:
    """Tables' fixed part: base chains, dispatch maps, the bridge table's sets.

    ``stateful``: some local pod is isolated.  Only then do the base chains look at conntrack
    (a ct expression makes the kernel track every packet of the namespace): a node without
    isolated pods pays no connection tracking for policy.  ``families``: the IP versions
    pods have addresses of (an IPv4-only node's tables hold no IPv6 set or address match).
    ``unrouted``: destinations the no-route check leaves out (the Services' ranges: a virtual
    IP has no route of its own, the Services translate it after the check)."""
    fams = rows(families)
    established = (rule_text([ESTABLISHED, ACCEPT]),) if stateful else ()
    # A pod sent back to itself through a Service (hairpin: the Service chose the pod as its
    # endpoint, so the connection is DNATed from P to P) is never judged: NetworkPolicy cannot
    # keep a pod from itself (as kube-proxy with Calico or Cilium).  Only a translated
    # connection (``ct status dnat``) that came in from a pod bridge and goes from an isolated
    # pod of this node to itself, marked by the bridge as come from that pod's own port
    # (SELF_MARK: its source address is P's, from P's port): a sibling endpoint's traffic, and
    # a packet with P's address from a port without a checked source, is still judged.
    hairpin = tuple(rule_text([match(meta("iifname"), ref(BRIDGES)), match({"ct": {"key": "status"}}, "dnat", "in"), FROM_SELF,
                               match({"concat": [f.saddr(), f.daddr()]}, ref(f.name(SELF))), ACCEPT])
                    for f in fams) if stateful else ()  # fmt: skip

    def dispatch(field: str, base: str) -> tuple[str, ...]:
        return tuple(rule_text([{"vmap": {"key": payload(f.proto, field), "data": ref(f.name(base))}}]) for f in fams)

    # Neighbour discovery is never routed, but where br_netfilter hands bridged frames to the
    # IP hooks (bridge-nf-call-ip6tables, which kubelet hosts and Docker turn on) it crosses
    # the forward hook too: isolation must not take it away.
    # Only with hop limit 255, which no routed packet has (the node decrements it before the
    # forward hook) and every neighbour discovery message must have (RFC 4861): routed ICMPv6
    # of these types is judged like any other packet.
    nd = (rule_text([match(payload("icmpv6", "type"), {"set": ND_TYPES}), match(payload("ip6", "hoplimit"), 255), ACCEPT]),
          ) if 6 in families else ()  # fmt: skip

    # No route (flow records only): the kernel drops a routed packet it has no route for
    # (ENETUNREACH: none at all, or a blackhole / unreachable / prohibit route) when it routes
    # it, after prerouting and before the forward hook, so no forward chain ever sees it.  This
    # chain asks the same question just before (fib daddr oif missing: no output interface),
    # for a pod's packets only (in on a pod bridge).  A nat chain: the kernel asks it for the
    # first packet of a connection only (a SYN sent again after a drop is a new connection
    # again: the dropped one was never confirmed), so no other packet pays for it -- a filter
    # chain here cost every packet of the node a hook.  Being before the Services' translation,
    # it leaves their ranges out (``unrouted``: a virtual IP has no route of its own); a
    # Service whose endpoint has no route is not asked.  The node's own addresses (fib answers
    # them with no interface too: local, and IPv6's subnet-router anycast), broadcast and
    # multicast are not asked.  It only logs: the
    # kernel drops the packet.
    no_route: list[Any] = []
    if log is not None:
        def asked(f: Any) -> list[Any]:  # the family's pods' packets, its Service ranges left out
            skip = [{"prefix": {"addr": str(n.network_address), "len": n.prefixlen}} for n in unrouted
                    if n.version == f.version]
            return [match(meta("nfproto"), "ipv4" if f.version == 4 else "ipv6"),
                    *([match(payload(f.proto, "daddr"), {"set": skip}, "!=")] if skip else [])]

        no_route = [
            NftChain(INET, TABLE, NO_ROUTE, (rule_text([*log.statements(NO_ROUTE), RETURN]),
                                             rule_text([{"counter": SUPPRESSED}]))),
            NftChain(INET, TABLE, "prerouting", tuple(rule_text([
                match(meta("iifname"), ref(BRIDGES)),
                # A SYN the pod programs record (marked: flowmask.MARK) had its route asked by
                # them (a pod of this node, or the underlay device: podpath.c podconn_wired).
                match({"&": [meta("mark"), RECORD_MARK]}, 0),
                *asked(f),
                # The route first: most connections have one, and stop at this one look-up.
                match({"fib": {"result": "oif", "flags": ["daddr"]}}, False),
                # Anycast: an address of the node's too (IPv6's subnet-router anycast of each
                # subnet it routes: the kernel's fib look-up gives it no device, yet takes it).
                match({"fib": {"result": "type", "flags": ["daddr"]}},
                      {"set": ["local", "broadcast", "multicast", "anycast"]}, "!="),
                jump(NO_ROUTE)]) for f in fams), hook=("nat", "prerouting", NO_ROUTE_PRIORITY, "accept")),
        ]  # fmt: skip
    # A Service's connection is translated (-100) after that check, to an endpoint the node may
    # have no route for either.  The kernel tells the pod so with an ICMP error (net or host
    # unreachable: not for a blackhole route, and no more than about one a second per pod, the
    # kernel's own limits; a prohibit route's admin-prohibited is left out, as firewalls' REJECT
    # rules -- firewalld's forward chain ends in one -- send that code too) that carries the dropped first
    # packet's conntrack entry: translated, never confirmed (a packet that left the node was
    # confirmed on its way out).  That error, on its way to a pod bridge, is logged through the
    # same chain; the record is made from the entry (the pod, the endpoint, the Service).  Only
    # the node's own packets pass the output hook: nothing is added to a forwarded packet's way.
    unrouted_service = tuple(rule_text([
        match(meta("oifname"), ref(BRIDGES)),
        match(payload(f.icmp, "type"), "destination-unreachable"),
        match(payload(f.icmp, "code"), {"set": list(NO_ROUTE_CODES[f.version])}),
        match({"&": [{"ct": {"key": "status"}}, ["dnat", "confirmed"]]}, "dnat"),
        jump(NO_ROUTE)]) for f in fams) if log is not None else ()  # fmt: skip
    inet: list[Any] = [
        *no_route,
        *(NftSet(INET, TABLE, f.name(m), (f.addr,), map="verdict") for f in fams for m in (EGRESS_MAP, INGRESS_MAP)),
        NftSet(INET, TABLE, BRIDGES, ("ifname",), elements=frozenset(bridges)),
        *(NftSet(INET, TABLE, f.name(SELF), (f.addr, f.addr)) for f in fams),
        *([NftCounter(INET, TABLE, SUPPRESSED)] if log is not None else []),
        NftChain(INET, TABLE, "egress", (*established, *nd, *hairpin, *dispatch("saddr", EGRESS_MAP)),
                 hook=("filter", "forward", EGRESS_PRIORITY, "accept")),
        NftChain(INET, TABLE, "ingress", (*established, *nd, *hairpin, *dispatch("daddr", INGRESS_MAP)),
                 hook=("filter", "forward", INGRESS_PRIORITY, "accept")),
        # Same-node pod traffic is routed back out of the bridge it came in on; the node
        # would tell the pod so with ICMP redirects ("send it directly"), which is not the point.
        NftChain(INET, TABLE, "output", (*(
            rule_text([match(meta("oifname"), ref(BRIDGES)), match(payload(f.icmp, "type"), f.redirect), DROP])
            for f in fams), *unrouted_service), hook=("filter", "output", 0, "accept")),
    ]  # fmt: skip
    return inet + _bridge_base(fams, log)


def _spoofed(log: DropLog | None, chain: str = SPOOFED) -> list[dict[str, Any]]:
    """What happens to a pod's packet with a source that is not its own (logged: flow records,
    each kind through its own chain, whose name is its log prefix)."""
    return _dropped(log, chain)


def _dropped(log: DropLog | None, chain: str) -> list[dict[str, Any]]:
    """A bridge drop (one of BRIDGE_DROPS): with ``log``, a jump to its logged chain; without,
    counted (in its counter) and dropped where it is."""
    return [jump(chain)] if log is not None else [{"counter": BRIDGE_DROPS[chain]}, DROP]


def _bridge_base(fams: list[AddressFamily], log: DropLog | None = None) -> list[Any]:
    to_host = {"mangle": {"key": meta("pkttype"), "value": "host"}}
    unicast_other = match(meta("pkttype"), "other")  # not for the bridge, not broadcast/multicast
    from_pod = match(meta("iifname"), ref("pod-ports"))
    prerouting: list[list[dict[str, Any]]] = [
        # A pod sends with its own interface's MAC only: another's would move the bridge's
        # forwarding entry for that MAC to this port (frames for that pod would come here).
        # Checked before the bridge learns the source (br_handle_frame runs this hook first).
        [match(meta("iifname"), ref(MAC_PORTS)),
         match({"concat": [meta("iifname"), payload("ether", "saddr")]}, ref(POD_MACS), "!="), *_spoofed(log, SPOOFED_MAC)],
    ]
    versions = {f.version for f in fams}
    if 4 in versions:  # an IPv6-only cluster drops all ARP from pods below, not counted as spoofed
        prerouting.append(
            # Nor any other MAC as its ARP packets' sender hardware address, which every receiver's
            # neighbour cache takes rather than the frame's source: "my address is at the gateway's
            # MAC" would send the other pods' (and the node's) traffic for this pod there.  The
            # address probes of RFC 5227 carry the pod's own MAC too.  (The offsets of
            # ``arp saddr ether`` are Ethernet's: ARP of other hardware or address lengths is
            # refused by every receiving Linux kernel, arp_rcv.)
            [match(payload("ether", "type"), "arp"), match(meta("iifname"), ref(MAC_PORTS)),
             match({"concat": [meta("iifname"), payload("arp", "saddr ether")]}, ref(POD_MACS), "!="), *_spoofed(log, SPOOFED_MAC)])
    prerouting += [
        # A VLAN tag hides the frame's type from every ``ether type`` match below (the kernel
        # reads the tag's type, 802.1Q), while the receiving pod treats VID 0 as untagged:
        # pods send no tagged frames.
        # Its own drop chain and log prefix (``vlan-tagged``), counted in the spoofed counter.
        [from_pod, match(payload("ether", "type"), {"set": ["8021q", "8021ad"]}), *_dropped(log, VLAN_TAGGED)],
    ]
    # The family the cluster has not leaves no pod, to be routed unjudged: dropped, not counted
    # as spoofed (a pod's kernel sends some of it unasked, such as MLD reports at link up).
    if 4 not in versions:  # an IPv6-only cluster: no IPv4, nor ARP
        prerouting.append([from_pod, match(payload("ether", "type"), {"set": ["ip", "arp"]}), *_dropped(log, OTHER_FAMILY)])
    if 6 not in versions:  # an IPv4-only cluster: no IPv6 but neighbour discovery (RA guard included)
        ip6 = match(payload("ether", "type"), "ip6")
        prerouting += [[from_pod, ip6, match(meta("l4proto"), "ipv6-icmp", "!="), *_dropped(log, OTHER_FAMILY)],
                       # The multicast listener messages a pod's kernel sends unasked at every
                       # link up: dropped unlogged (a record of each pod's start says nothing).
                       [from_pod, ip6, match(payload("icmpv6", "type"), {"set": MLD_TYPES}), DROP],
                       [from_pod, ip6, match(payload("icmpv6", "type"), {"set": OTHER_FAMILY_ND}, "!="),
                        *_dropped(log, OTHER_FAMILY)]]
    routed_up: list[list[dict[str, Any]]] = []
    for f in fams:
        ether = match(payload("ether", "type"), f.proto)
        own = match({"concat": [meta("iifname"), f.saddr()]}, ref(f.name("pod-addrs")), "!=")
        unrouted: list[dict[str, Any]] = []  # what the node must not route (and so not be handed)
        if f.version == 6:
            not_ll = match(f.saddr(), prefix(f.link_local), "!=")
            unrouted = [not_ll, match(f.daddr(), prefix(f.link_local), "!=")]
            prerouting += [
                # Pods are no routers: their router advertisements and redirects would move
                # the other pods' routes (RFC 6105's RA guard, on every pod port).
                [ether, from_pod, match(payload(f.icmp, "type"), {"set": ["nd-router-advert", f.redirect]}),
                 *_spoofed(log, RA_GUARD)],
                # Its neighbour advertisements claim only its own addresses ("B is at my MAC"
                # would draw B's traffic to this pod): each pod port's chain (compile_na_chain).
                [ether, from_pod, match(payload(f.icmp, "type"), "nd-neighbor-advert"), _NA_TARGET_NOT_LINK_LOCAL,
                 {"vmap": {"key": meta("iifname"), "data": ref(NA_PORTS)}}],
                # Nor another MAC in their link-layer address options (a receiver's neighbour
                # cache takes that, not the frame's source): each MAC-checked pod port's chain
                # (compile_lla_chain), after duplicate address detection's solicitations with a
                # nonce option, which need none.  Neighbour discovery only (hop limit 255: a
                # receiver drops any other), from the port of a pod whose MAC is known.
                [ether, match(f.saddr(), "::"), *_DAD_NONCE, ACCEPT],
                [ether, match(payload(f.icmp, "type"), {"set": ND_CHECKED}), match(payload("ip6", "hoplimit"), 255),
                 {"vmap": {"key": meta("iifname"), "data": ref(LLA_PORTS)}}],
                # Duplicate address detection (and MLD before it) comes from the unspecified address.
                [ether, match(f.saddr(), "::"), match(meta("l4proto"), "ipv6-icmp"), ACCEPT],
                # A pod's IPv6 packets carry its own address or a link-local one, or are dropped.
                [ether, from_pod, not_ll, own, *_spoofed(log)],
                # Neighbour discovery passes as it is, isolated or not: never routed up (a
                # unicast advertisement handed to the node would never reach its pod).
                [match(payload(f.icmp, "type"), {"set": ND_TYPES}), ACCEPT],
            ]
        else:
            # A pod's IPv4 packets carry its own address, or are dropped (and logged: flow records).
            prerouting.append([ether, from_pod, own, *_spoofed(log)])
            # So do its ARP packets (the sender address, which every receiver's neighbour cache
            # takes: "B's address is at my MAC" would draw B's traffic to this pod), but for
            # address probes, which come from 0.0.0.0 (RFC 5227) and update no cache.
            prerouting.append([match(payload("ether", "type"), "arp"), from_pod, match(payload("arp", "saddr ip"), "0.0.0.0", "!="),
                               match({"concat": [meta("iifname"), payload("arp", "saddr ip")]}, ref(f.name("pod-addrs")), "!="),
                               *_spoofed(log, SPOOFED_ARP)])  # fmt: skip
        # An isolated pod's packet from its own port with its own address: marked (SELF_MARK),
        # for the hairpin accepts (the inet base chains', the forward chain's below).
        prerouting.append([ether, match({"concat": [meta("iifname"), f.saddr(), f.saddr()]}, ref(f.name(SELF_PORTS))),
                           {"mangle": {"key": meta("mark"), "value": {"|": [meta("mark"), SELF_MARK]}}}])
        routed_up += [
            # Unicast from an isolated pod: up to the IP stack (delivered to the host through the
            # pod's own host-side MAC, a local FDB entry of the bridge).
            [ether, unicast_other, match(meta("iifname"), ref("isolated-ports")), *unrouted, to_host,
             {"mangle": {"key": payload("ether", "daddr"), "value": {"map": {"key": meta("iifname"), "data": ref("port-macs")}}}}],
            # Unicast to an isolated pod, from anywhere on the bridge: the same, by destination.
            [ether, unicast_other, match(f.daddr(), ref(f.name("isolated-addrs"))), *unrouted[:1], to_host,
             {"mangle": {"key": payload("ether", "daddr"), "value": {"map": {"key": f.daddr(), "data": ref(f.name("addr-macs"))}}}}],
        ]  # fmt: skip
    prerouting += routed_up
    # Tagged frames to or from an isolated pod too (from a port that is not a pod's: no
    # prerouting rule dropped them).
    both = match(payload("ether", "type"), {"set": ["ip", "ip6", "8021q", "8021ad"]})
    # A pod sent back to itself through a Service where br_netfilter hands bridged frames to
    # the IP hooks (bridge-nf-call-iptables, on for kubelet hosts and Docker): the DNATed frame
    # is bridged back out of the pod's own port (hairpin mode) rather than routed, and would
    # meet the isolation drops below.  Never judged (NetworkPolicy cannot keep a pod from
    # itself): a frame to the pod's port from its address to its address, marked in
    # prerouting as come in from that port (SELF_MARK: a container without identity could
    # send with the pod's address, no other pod port can).  No ``ct`` match here: in the
    # bridge family it needs nf_conntrack_bridge, which not every kernel has.
    hairpin = [[match({"concat": [meta("oifname"), f.saddr(), f.daddr()]}, ref(f.name(SELF_PORTS))), FROM_SELF, ACCEPT]
               for f in fams]
    # Any frame the bridge forwards though it was addressed to the node (the gateway's MAC:
    # pkttype host) is one br_netfilter translated in the IP prerouting hooks and, its new
    # destination being a pod of this bridge, bridged to that pod instead of routing it (a
    # same-node client's connection to a Service whose endpoint is here).  br_netfilter hands
    # it to the inet forward hook next, where the policy chains judge it with conntrack like a
    # routed packet (ingress, egress, the hairpin accept): it must not meet the isolation
    # drops below, which are for what crosses the bridge unjudged.  Nothing else forwards a
    # frame addressed to the node (the route-up hands frames to a local MAC: delivered up).
    bridged_dnat = [match(meta("pkttype"), "host"), ACCEPT]
    forward = [
        [match(payload("icmpv6", "type"), {"set": ND_TYPES}), ACCEPT],
        *hairpin,
        bridged_dnat,
        [both, match(meta("oifname"), ref("isolated-in-ports")), *_dropped(log, ISOLATED_IN)],
        [both, match(meta("iifname"), ref("isolated-out-ports")), *_dropped(log, ISOLATED_OUT)],
    ]
    logged: list[Any] = []
    if log is not None:
        logged = [NftCounter(BRIDGE, TABLE, SUPPRESSED),
                  *(NftChain(BRIDGE, TABLE, name, log.chain_rules(name, [{"counter": counter}, DROP]))
                    for name, counter in BRIDGE_DROPS.items())]
    return [
        *logged,
        NftSet(BRIDGE, TABLE, "pod-ports", ("ifname",)),
        NftSet(BRIDGE, TABLE, MAC_PORTS, ("ifname",)),
        NftSet(BRIDGE, TABLE, POD_MACS, ("ifname", "ether_addr")),
        *(NftSet(BRIDGE, TABLE, f.name("pod-addrs"), ("ifname", f.addr)) for f in fams),
        NftSet(BRIDGE, TABLE, "isolated-ports", ("ifname",)),
        NftSet(BRIDGE, TABLE, "isolated-in-ports", ("ifname",)),
        NftSet(BRIDGE, TABLE, "isolated-out-ports", ("ifname",)),
        *(NftSet(BRIDGE, TABLE, f.name("isolated-addrs"), (f.addr,)) for f in fams),
        *(NftSet(BRIDGE, TABLE, f.name(SELF_PORTS), ("ifname", f.addr, f.addr)) for f in fams),
        NftSet(BRIDGE, TABLE, "port-macs", ("ifname",), map="ether_addr"),
        *(NftSet(BRIDGE, TABLE, f.name("addr-macs"), (f.addr,), map="ether_addr") for f in fams),
        *(NftSet(BRIDGE, TABLE, m, ("ifname",), map="verdict") for m in (NA_PORTS, LLA_PORTS) if any(f.version == 6 for f in fams)),
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
        pod_ips: frozenset[Address] = frozenset(),
        named: frozenset[tuple[str, str, int]] = frozenset(),
    ) -> None:
        self.pod_ips = pod_ips  # addresses (both families) of the pods the rule's selector peers match
        self.named = named  # (address, l4proto, port) for the rule's named ports


def version_of(address: str) -> int:
    """The IP version of an address in text form (IPv6 text always has a colon, IPv4 never)."""
    return 6 if ":" in address else 4


# The most rules one policy chain may have.  Its ipBlocks are prefix matches, one rule per
# prefix per port match: a wide IPv6 block with excepts can ask for tens of thousands, whose
# compiling and programming would hold the agent's event loop (BGP hold timers, etcd leases)
# and the kernel's table for minutes.  A policy over it is compiled to an empty chain: it
# still isolates the pods it selects, and allows nothing (see docs/policy.md, Limits).
# Checked from the policy alone (:func:`layout_policy`), before any of its members are.
MAX_POLICY_RULES = 10_000
RAW_PREFIXES_MAX = 4 * MAX_POLICY_RULES  # a rule's ipBlock prefixes before collapsing (duplicates merge)
# The most set elements one policy's sets may hold together (both directions, both families):
# a policy whose distinct selectors each match much of a large cluster would otherwise cost
# the agent seconds and hundreds of MiB at every pod change.  Refused as MAX_POLICY_RULES is.
MAX_POLICY_ELEMENTS = 250_000
# The most distinct peer selectors one policy may have: the agent keeps each one's members as
# pods come and go (every pod change asks each selector), whether or not they are compiled.
MAX_POLICY_SELECTORS = 500


class PolicyTooLarge(ValueError):
    """A policy's chain would have more than MAX_POLICY_RULES rules, or its sets more than
    MAX_POLICY_ELEMENTS elements."""


@dataclass(frozen=True)
class NamedSource:
    """Where a rule's named ports resolve: for "in" on the pods the policy selects, for
    "out" on its peers (``peers``; None: every pod).  Rules with equal sources share a set."""

    direction: str
    ports: tuple[tuple[str, str], ...]  # (name, protocol), sorted
    peers: frozenset[Peer] | None = None  # "out" only


@dataclass(frozen=True)
class PolicySet:
    """A set of a policy's chain, filled by the engine: ``source`` a rule's peer selectors
    (the addresses of ``family`` of the pods any of them matches) or a NamedSource
    ((address, l4proto, port) of ``family``)."""

    name: str
    family: AddressFamily
    source: frozenset[PeerSelector] | NamedSource


# A rule's peer or port alternative: (the IP version it is bound to, None: any; its matches;
# the set it reads, if any)
Alternative = tuple[int | None, list[dict[str, Any]], PolicySet | None]


@dataclass(frozen=True)
class Layout:
    """A policy's chain in one direction, from the policy alone: its rules and the sets they
    read (each distinct set of a rule's peer selectors one set per family, shared by every
    rule listing the same selectors)."""

    chain: NftChain
    sets: tuple[PolicySet, ...]

    def fill(self, elements: dict[str, frozenset[Any]]) -> list[Any]:
        """The chain and its sets, each set's elements by its name."""
        out: list[Any] = []
        for s in self.sets:
            if isinstance(s.source, NamedSource):
                key: tuple[str, ...] = (s.family.addr, "inet_proto", "inet_service")
            else:
                key = (s.family.addr,)
            out.append(NftSet(INET, TABLE, s.name, key, elements=elements[s.name]))
        out.append(self.chain)
        return out


def layout(policy: Policy, families: Sequence[int] = (4,)) -> tuple[Layout, ...]:
    """The policy's chains (ingress, egress: those of its policyTypes) from the policy alone,
    or PolicyTooLarge (:func:`layout_policy`; more than MAX_POLICY_SELECTORS distinct peer
    selectors)."""
    selectors = {p.selector for rules in (policy.ingress, policy.egress) for r in rules or () for p in r.peers or ()
                 if p.selector is not None}  # fmt: skip
    if len(selectors) > MAX_POLICY_SELECTORS:
        raise PolicyTooLarge(
            f"policy {policy.namespace}/{policy.name} not programmed: its peers have {len(selectors)} distinct pod "
            f"and namespace selectors, more than {MAX_POLICY_SELECTORS}; it allows nothing until fewer make it smaller"
        )
    return tuple(layout_policy(policy, direction, rules, families)
                 for direction, rules in (("in", policy.ingress), ("out", policy.egress)) if rules is not None)  # fmt: skip


def layout_policy(policy: Policy, direction: str, rules: tuple[Rule, ...], families: Sequence[int] = (4,)) -> Layout:
    """The chain ``np-<direction>/<ns>/<name>`` and the sets its rules read, or
    PolicyTooLarge: from the policy alone (no pod is looked at).

    ``direction`` is "in" (peers are sources) or "out" (peers are destinations).  A rule's
    peer selectors have one set per family of the addresses of the pods any of them matches
    (``np-in/<ns>/<policy>/<rule>/pods``, named after the first rule listing those selectors),
    read by every rule listing the same ones (in any order): a rule of 50 selectors reads one
    set per family, not 50.  Named ports resolve on the destination pod: for "in" the selected
    local pods, for "out" the peers (``.../named``, shared by rules with the same named
    ports and, for "out", peers).  Each rule allows the peers x ports it lists; a peer match
    and a port match of two different families never meet in one rule (it could match
    nothing)."""
    fams = rows(families)
    chain_name = policy_chain(direction, policy)
    peer_field = "saddr" if direction == "in" else "daddr"
    pod_sets: dict[frozenset[PeerSelector], str] = {}  # a rule's selectors -> their sets' base name
    named_sets: dict[NamedSource, str] = {}
    sets: dict[str, PolicySet] = {}  # the sets some rule reads, by name
    chain_rules: list[str] = []
    for index, rule in enumerate(rules):
        peers: list[Alternative] = []
        if rule.peers is None:
            peers.append((None, [], None))
        else:
            mine = frozenset(p.selector for p in rule.peers if p.selector is not None)
            if mine:
                base = pod_sets.setdefault(mine, f"{chain_name}/{index}")
                for f in fams:
                    name = f.name(f"{base}/pods")
                    peers.append((f.version, [match(payload(f.proto, peer_field), ref(name))], PolicySet(name, f, mine)))
            # ipBlocks: one prefix match per range (cidr minus its excepts), no set: named
            # interval sets would make libnftables dump all their elements before every change.
            for f in fams:
                raw: list[Network] = []
                for p in rule.peers:
                    if p.block is not None:
                        raw += p.block.ranges(f.version)
                        if len(raw) > RAW_PREFIXES_MAX:  # stop before collapsing (and compiling) more
                            raise _too_large(policy, direction, index, f"{len(raw)} ipBlock prefixes or more")
                for net in _collapse(raw):
                    peers.append((f.version, [match(payload(f.proto, peer_field), prefix(net))], None))
        port_matches, names = _port_matches(rule.ports)
        ports: list[Alternative] = [(None, m, None) for m in port_matches]
        named_rules: list[tuple[str, PolicySet]] = []
        if names:
            source = NamedSource(direction, names, (frozenset(rule.peers) if rule.peers is not None else None)
                                 if direction == "out" else None)  # fmt: skip
            base = named_sets.setdefault(source, f"{chain_name}/{index}")
            for f in fams:
                named = PolicySet(f.name(f"{base}/named"), f, source)
                named_match = [
                    match({"concat": [payload(f.proto, "daddr"), meta("l4proto"), payload("th", "dport")]}, ref(named.name))
                ]
                if direction == "in":
                    ports.append((f.version, named_match, named))
                else:
                    # Egress named ports resolve on the peers themselves: the set holds only peers.
                    named_rules.append((rule_text([*named_match, ACCEPT]), named))
        pairs = [(peer, port) for peer in peers for port in ports if peer[0] is None or port[0] is None or peer[0] == port[0]]
        count = len(chain_rules) + len(named_rules) + len(pairs)
        if count > MAX_POLICY_RULES:
            sets_read = sum(1 for peer in peers if peer[2] is not None)
            detail = (f", {len(chain_rules)} before it and {len(pairs) + len(named_rules)} of its own: {sets_read} "
                      f"selector sets and {len(peers) - sets_read} ipBlock prefixes on {len(ports)} port matches"
                      + (f", {len(named_rules)} named port rules" if named_rules else ""))  # fmt: skip
            raise _too_large(policy, direction, index, f"{count} rules", detail)
        for text, named in named_rules:
            chain_rules.append(text)
            sets.setdefault(named.name, named)
        # (only the sets a rule reads: an egress rule of named ports alone reads no pods set)
        for (_, peer, peer_set), (_, port, port_set) in pairs:
            chain_rules.append(rule_text([*peer, *port, ACCEPT]))
            for read in (peer_set, port_set):
                if read is not None:
                    sets.setdefault(read.name, read)
    return Layout(NftChain(INET, TABLE, chain_name, tuple(chain_rules)), tuple(sets.values()))


def too_many_elements(policy: Policy, count: int) -> PolicyTooLarge:
    return PolicyTooLarge(
        f"policy {policy.namespace}/{policy.name} not programmed: its sets need more than {MAX_POLICY_ELEMENTS} "
        f"elements ({count} or more: an address per pod a rule's peer selectors match, per distinct set of a rule's "
        "selectors, and an address . port per named port); it allows nothing until fewer or narrower peer selectors "
        "make it smaller"
    )


def refused_policy(policy: Policy) -> list[Any]:
    """What a policy too large to program (PolicyTooLarge) is compiled to: its chains, empty.
    The pods' chains jump to them, so the policy still isolates the pods it selects, and
    allows nothing."""
    return [
        NftChain(INET, TABLE, policy_chain(d, policy), ())
        for d, rules in (("in", policy.ingress), ("out", policy.egress))
        if rules is not None
    ]


def _too_large(policy: Policy, direction: str, index: int, what: str, detail: str = "") -> PolicyTooLarge:
    """``what`` was too large at the rule ``index`` (``detail``: what it was made of)."""
    rules = "ingress" if direction == "in" else "egress"
    where = f"{what} at {rules}[{index}]{detail}"
    return PolicyTooLarge(
        f"policy {policy.namespace}/{policy.name} not programmed: its {rules} rules need more than "
        f"{MAX_POLICY_RULES} nftables rules ({where}; a rule per selector set or ipBlock prefix, per port "
        "match of its family); it allows nothing until fewer rules, ipBlock excepts, peers or ports make it smaller"
    )


def _collapse(nets: Iterable[Network]) -> list[Network]:
    from ipaddress import collapse_addresses

    return list(collapse_addresses(nets))  # type: ignore[arg-type]


def _port_matches(ports: tuple[Port, ...] | None) -> tuple[list[list[dict[str, Any]]], tuple[tuple[str, str], ...]]:
    """The numeric port matches of a rule (one per protocol), and its named ports: (name,
    protocol), sorted."""
    if ports is None:
        return [[]], ()
    by_proto: dict[str, list[Any] | None] = {}
    named: set[tuple[str, str]] = set()
    for p in ports:
        if isinstance(p.port, str):
            named.add((p.port, p.protocol))
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
    return out, tuple(sorted(named))


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
