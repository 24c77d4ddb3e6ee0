"""The bridge table (and the inet base chains' neighbour discovery rule) against crafted frames.

A small interpreter runs a frame, as the kernel presents it to a rule, through the compiled
chains: a field the frame does not have makes its match fail, whichever the operator (an nft
match carries its protocol dependency).  A VLAN-tagged frame is modelled as the kernel reads
it: ``ether type`` gives the tag's type (802.1Q), while the network header (``ip saddr``) is
the inner packet's.  What each test checks is what a pod with a raw socket can send.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any

from agentd.nft.ruleset import NftChain, NftSet, Ruleset
from agentd.policy import compiler
from agentd.policy.engine import PolicyEngine
from agentd.policy.model import LocalPort, Pod, Policy
from agentd.resources import kinds

NODE = "node1"
A4, B4, A6, B6 = "10.244.1.2", "10.244.1.3", "fd00:10:244:1::2", "fd00:10:244:1::3"


class Missing(Exception):
    pass


def _value(expr: Any, frame: dict[Any, Any]) -> Any:
    if "payload" in expr and "base" in expr["payload"]:  # raw: bits of the ICMPv6 message (a NA's target, ND options)
        raw = expr["payload"]
        assert raw["base"] == "th" and raw["offset"] % 8 == 0 and raw["len"] % 8 == 0, raw
        start, end = raw["offset"] // 8, (raw["offset"] + raw["len"]) // 8
        body = frame.get(("th",))
        if body is None or len(body) < end:  # past the packet's end: the kernel's payload load breaks the rule
            raise Missing(raw)
        return int.from_bytes(body[start:end], "big")
    if "&" in expr:
        left, mask = expr["&"]
        return _value(left, frame) & mask
    if "|" in expr:
        left, bits = expr["|"]
        return _value(left, frame) | bits
    if "payload" in expr:
        key: tuple[str, ...] = ("payload", expr["payload"]["protocol"], expr["payload"]["field"])
    elif "meta" in expr:
        key = ("meta", expr["meta"]["key"])
        if key == ("meta", "mark"):
            return frame.get(key, 0)  # every packet has one (0: unmarked)
    elif "concat" in expr:
        return tuple(_value(e, frame) for e in expr["concat"])
    elif "ct" in expr:
        return "new"  # a packet conntrack has not seen before
    else:
        raise AssertionError(f"unexpected expression {expr}")
    if key not in frame:
        raise Missing(key)
    return frame[key]


def _literal(right: Any, value: Any) -> bool:
    if isinstance(right, dict) and "set" in right:
        return any(_literal(r, value) for r in right["set"])
    if isinstance(right, dict) and "prefix" in right:
        net = ipaddress.ip_network(f"{right['prefix']['addr']}/{right['prefix']['len']}")
        return ipaddress.ip_address(value) in net
    if isinstance(right, str) and right.startswith("0x"):
        return value == int(right, 16)
    if isinstance(right, str) and ":" in right and isinstance(value, str) and ":" in value:
        return ipaddress.ip_address(right) == ipaddress.ip_address(value)
    return value == right


def _in_set(rs: Ruleset, family: str, name: str, value: Any) -> bool:
    s = rs.objects[(family, compiler.TABLE, "set", name)]
    assert isinstance(s, NftSet)
    return value in {tuple(map(str, e)) if isinstance(e, tuple) else str(e) for e in s.elements}


def run(rs: Ruleset, family: str, chain: str, frame: dict[Any, Any]) -> tuple[str | None, list[str]]:
    """The chain's verdict ("accept", "drop" or None: fell through) and the counters it bumped."""
    c = rs.objects[(family, compiler.TABLE, "chain", chain)]
    assert isinstance(c, NftChain)
    counted: list[str] = []
    for text in c.rules:
        for stmt in json.loads(text):
            if "match" in stmt:
                m = stmt["match"]
                try:
                    value = _value(m["left"], frame)
                except Missing:
                    break
                right = m["right"]
                if isinstance(right, str) and right.startswith("@"):
                    value = tuple(map(str, value)) if isinstance(value, tuple) else str(value)
                    hit = _in_set(rs, family, right[1:], value)
                elif isinstance(right, list):  # ct state in [...]
                    hit = value in right
                else:
                    hit = _literal(right, value)
                if hit != (m["op"] in ("==", "in")):
                    break
            elif "counter" in stmt:
                if stmt["counter"] is not None:
                    counted.append(stmt["counter"])
            elif "drop" in stmt:
                return "drop", counted
            elif "accept" in stmt:
                return "accept", counted
            elif "mangle" in stmt and stmt["mangle"]["key"] == {"meta": {"key": "mark"}}:
                frame[("meta", "mark")] = _value(stmt["mangle"]["value"], frame)  # marked, and on
            elif "mangle" in stmt:
                return "up", counted  # handed up to the node's IP stack (the rest of the rule only mangles)
            elif "vmap" in stmt:
                if family == "inet":
                    break  # the inet dispatch: a pod's chain (not what these tests look at)
                try:
                    key = str(_value(stmt["vmap"]["key"], frame))
                except Missing:
                    break
                m = rs.objects[(family, compiler.TABLE, "set", stmt["vmap"]["data"][1:])]
                target = dict(m.elements).get(key)  # type: ignore[union-attr]
                if target is None:
                    break
                verdict, more = run(rs, family, target[1], frame)
                counted += more
                if verdict is not None:
                    return verdict, counted
                break
            elif "return" in stmt:
                return None, counted
            else:
                raise AssertionError(f"unexpected statement {stmt}")
    return None, counted


def engine(families: tuple[int, ...], *policies: dict[str, Any], pod_macs: tuple[str, ...] = ("", ""),
           check_source_mac: bool = True) -> Ruleset:
    """Pods x/a (veth0) and x/b (veth1) on this node, with the families' addresses (and
    ``pod_macs``, their own interfaces' MACs, where known)."""
    eng = PolicyEngine(NODE, families=families, check_source_mac=check_source_mac)
    for i, (name, v4, v6) in enumerate((("a", A4, A6), ("b", B4, B6))):
        ips = tuple(ipaddress.ip_address(ip) for ip, v in ((v4, 4), (v6, 6)) if v in families)
        eng.upsert_pod(Pod("x", name, NODE, ips, {"pod": name}),
                       LocalPort(f"veth{i}", f"02:00:00:00:00:{i:02x}", "cni0", pod_mac=pod_macs[i]))
    for p in policies:
        eng.upsert_policy(Policy.parse(kinds.validate(p)))
    return eng.build()


DENY_ALL = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "deny", "namespace": "x"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}}  # fmt: skip


def ip_frame(iif: str, src: str, dst: str, ether: str | None = None, extra: dict[Any, Any] | None = None) -> dict[Any, Any]:
    proto = "ip6" if ":" in src else "ip"
    frame: dict[Any, Any] = {("meta", "iifname"): iif, ("meta", "pkttype"): "other", ("payload", "ether", "type"): ether or proto,
                             ("payload", proto, "saddr"): src, ("payload", proto, "daddr"): dst, ("meta", "l4proto"): "udp"}  # fmt: skip
    frame.update(extra or {})
    return frame


def test_a_vlan_tagged_frame_from_a_pod_is_dropped_and_counted():
    """VID 0 (priority tag): the receiving pod takes it as untagged; the bridge table must
    not let it past the source check and the isolation (to b, isolated, or with b's source)."""
    rs = engine((4, 6), DENY_ALL)
    for tag in ("8021q", "8021ad"):
        for src, dst in ((A4, B4), (B4, "192.0.2.1"), (A6, B6), (B6, "2001:db8::1")):
            assert run(rs, "bridge", "prerouting", ip_frame("veth0", src, dst, ether=tag)) == ("drop", ["spoofed"]), (tag, src)
        # From a port that is not a pod's, tagged frames to an isolated pod go no further either.
        assert run(rs, "bridge", "forward", {("payload", "ether", "type"): tag, ("meta", "oifname"): "veth1"})[0] == "drop"
    # Untagged, a's own traffic is handed up as before (a is isolated).
    assert run(rs, "bridge", "prerouting", ip_frame("veth0", A4, B4))[0] == "up"


def test_the_family_an_ipv6_only_cluster_has_not_leaves_no_pod():
    """IPv4 (and ARP) from a pod of an IPv6-only cluster: nothing would judge it once routed."""
    rs = engine((6,), DENY_ALL)
    assert run(rs, "bridge", "prerouting", ip_frame("veth0", "10.9.9.9", "192.0.2.1"))[0] == "drop"
    assert run(rs, "bridge", "prerouting", {("meta", "iifname"): "veth0", ("payload", "ether", "type"): "arp",
                                            ("payload", "arp", "saddr ip"): "10.9.9.9"})[0] == "drop"  # fmt: skip
    assert run(rs, "bridge", "prerouting", ip_frame("veth0", A6, "2001:db8::1"))[0] == "up"  # its own family as before


def test_the_family_an_ipv4_only_cluster_has_not_leaves_no_pod_but_neighbour_discovery():
    rs = engine((4,), DENY_ALL)
    assert run(rs, "bridge", "prerouting", ip_frame("veth0", "fd00::9", "2001:db8::1"))[0] == "drop"
    icmp = {("meta", "l4proto"): "ipv6-icmp"}
    for kind, verdict in (("echo-request", "drop"), ("nd-router-advert", "drop"), ("nd-redirect", "drop"), (143, "drop"),
                          ("nd-neighbor-solicit", None), ("nd-neighbor-advert", None), ("nd-router-solicit", None)):  # fmt: skip
        frame = ip_frame("veth0", "fe80::1", "ff02::1", extra={**icmp, ("payload", "icmpv6", "type"): kind})
        assert run(rs, "bridge", "prerouting", frame)[0] == verdict, kind
    assert run(rs, "bridge", "prerouting", ip_frame("veth0", A4, "192.0.2.1"))[0] == "up"


def test_routed_icmpv6_of_neighbour_discovery_types_is_judged():
    """The inet base chains let neighbour discovery pass (br_netfilter hosts) only with hop
    limit 255: a routed packet has had it decremented before the forward hook."""
    rs = engine((4, 6), DENY_ALL)
    for chain in ("egress", "ingress"):
        for kind in ("nd-neighbor-solicit", "nd-neighbor-advert", "nd-router-solicit", "nd-router-advert"):
            pkt = {("payload", "icmpv6", "type"): kind, ("payload", "ip6", "saddr"): A6,
                   ("payload", "ip6", "daddr"): "2001:db8::1", ("meta", "l4proto"): "ipv6-icmp"}  # fmt: skip
            assert run(rs, "inet", chain, {**pkt, ("payload", "ip6", "hoplimit"): 254})[0] is None, (chain, kind)  # to the pod's chain
            assert run(rs, "inet", chain, {**pkt, ("payload", "ip6", "hoplimit"): 255})[0] == "accept", (chain, kind)


def arp(iif: str, sender: str) -> dict[Any, Any]:
    return {("meta", "iifname"): iif, ("meta", "pkttype"): "broadcast", ("payload", "ether", "type"): "arp",
            ("payload", "arp", "saddr ip"): sender}  # fmt: skip


def test_arp_from_a_pod_claims_only_its_own_address():
    """Pod a saying "b's address is at my MAC" (gratuitous ARP or a reply) would draw the
    node's traffic for b to a's port."""
    for families in ((4,), (4, 6)):
        rs = engine(families)  # isolated or not: nobody may take another's address
        assert run(rs, "bridge", "prerouting", arp("veth0", B4)) == ("drop", ["spoofed"])
        assert run(rs, "bridge", "prerouting", arp("veth0", "10.244.1.1"))[0] == "drop"  # the gateway's neither
        assert run(rs, "bridge", "prerouting", arp("veth0", A4))[0] is None
        assert run(rs, "bridge", "prerouting", arp("veth0", "0.0.0.0"))[0] is None  # an address probe (RFC 5227)
        assert run(rs, "bridge", "prerouting", arp("eth9", B4))[0] is None  # not a pod port: not checked (docs/policy.md, Pods)


ND_NUMBERS = {"nd-router-solicit": 133, "nd-neighbor-solicit": 135, "nd-neighbor-advert": 136}


def nd(iif: str, kind: str, source: str, target: str | None = None, options: bytes = b"", hoplimit: int = 255,
       mac: str | None = None) -> dict[Any, Any]:
    """A neighbour discovery message (``kind``) as the kernel presents it: the ICMPv6 message's
    bytes (``target`` for a solicitation or advertisement, then ``options``), its IPv6 payload
    length and hop limit (255, as neighbour discovery has), from the frame source ``mac``."""
    body = bytes([ND_NUMBERS[kind], 0, 0, 0, 0x20 if kind == "nd-neighbor-advert" else 0, 0, 0, 0])
    if target is not None:
        body += ipaddress.IPv6Address(target).packed
    frame = {**ip_frame(iif, source, "ff02::1", extra={("meta", "l4proto"): "ipv6-icmp"}),
             ("payload", "icmpv6", "type"): kind, ("th",): body + options,
             ("payload", "ip6", "length"): len(body + options), ("payload", "ip6", "hoplimit"): hoplimit}  # fmt: skip
    if mac is not None:
        frame[("payload", "ether", "saddr")] = mac
    return frame


def na(iif: str, source: str, target: str) -> dict[Any, Any]:
    return nd(iif, "nd-neighbor-advert", source, target)


def test_a_neighbour_advertisement_from_a_pod_claims_only_its_own_address():
    """The IPv6 twin of ARP's check, on the advertisement's target (what a neighbour cache
    takes), whatever the source: the unspecified one included (accepted further down for
    duplicate address detection)."""
    for families in ((6,), (4, 6)):
        rs = engine(families)
        for source in (A6, "fe80::1", "::"):
            assert run(rs, "bridge", "prerouting", na("veth0", source, B6)) == ("drop", ["spoofed"]), source
            assert run(rs, "bridge", "prerouting", na("veth0", source, "fd00:10:244:1::1"))[0] == "drop"  # nor the gateway's
        assert run(rs, "bridge", "prerouting", na("veth0", A6, A6))[0] == "accept"  # its own: neighbour discovery as ever
        assert run(rs, "bridge", "prerouting", na("veth0", "fe80::1", "fe80::1"))[0] == "accept"  # link-local: not checked
        assert run(rs, "bridge", "prerouting", na("veth1", B6, B6))[0] == "accept"
        assert run(rs, "bridge", "prerouting", na("eth9", "fe80::1", B6))[0] == "accept"  # not a pod port


MAC_A, MAC_B = "0a:58:0a:f4:01:02", "0a:58:0a:f4:01:03"


def test_a_frame_from_a_pod_with_a_source_mac_not_its_own_is_dropped():
    """A pod sending with b's MAC (or any other) would move the bridge's forwarding entry for
    that MAC to its own port: dropped before the bridge learns it, whatever the frame holds
    (IP with its own address, ARP, IPv6 neighbour discovery); its own MAC passes as before."""
    for families in ((4,), (4, 6)):
        rs = engine(families, pod_macs=(MAC_A, MAC_B))
        mac = {("payload", "ether", "saddr"): MAC_B}
        assert run(rs, "bridge", "prerouting", ip_frame("veth0", A4, "192.0.2.1", extra=mac)) == ("drop", ["spoofed"])
        assert run(rs, "bridge", "prerouting", {**arp("veth0", A4), **mac}) == ("drop", ["spoofed"])
        other = {("payload", "ether", "saddr"): "02:11:22:33:44:55"}
        assert run(rs, "bridge", "prerouting", ip_frame("veth0", A4, "192.0.2.1", extra=other))[0] == "drop"
        if 6 in families:
            assert run(rs, "bridge", "prerouting", {**na("veth0", "fe80::1", "fe80::1"), **mac})[0] == "drop"
            assert run(rs, "bridge", "prerouting", {**na("veth0", A6, A6), ("payload", "ether", "saddr"): MAC_A})[0] == "accept"
        own = {("payload", "ether", "saddr"): MAC_A}
        assert run(rs, "bridge", "prerouting", ip_frame("veth0", A4, "192.0.2.1", extra=own))[0] is None  # bridged as ever
        assert run(rs, "bridge", "prerouting", {**arp("veth0", A4), **own})[0] is None
        assert run(rs, "bridge", "prerouting", ip_frame("veth1", B4, A4, extra=mac))[0] is None  # b's own
        # Not a pod port, or a pod whose MAC is not known (an older plugin's file): not checked.
        assert run(rs, "bridge", "prerouting", {**arp("eth9", "10.9.9.9"), **mac})[0] is None
        unknown = engine(families)
        assert run(unknown, "bridge", "prerouting", ip_frame("veth0", A4, "192.0.2.1", extra=mac))[0] is None


def test_arp_from_a_pod_names_only_its_own_mac_as_the_sender_hardware_address():
    """A neighbour cache takes an ARP packet's sender hardware address, not the frame's
    source: pod a saying "my address is at b's (or the gateway's) MAC" from its own MAC
    would draw the traffic for a there.  Dropped as MAC-spoofed, requests, replies and
    address probes alike; its own MAC in both places passes as before."""
    gateway = "0a:58:0a:f4:01:01"
    for families in ((4,), (4, 6)):
        rs = engine(families, pod_macs=(MAC_A, MAC_B))
        own = {("payload", "ether", "saddr"): MAC_A}
        for sender in (A4, "0.0.0.0"):  # a reply or gratuitous ARP, an address probe (RFC 5227)
            for sha in (MAC_B, gateway):
                frame = {**arp("veth0", sender), **own, ("payload", "arp", "saddr ether"): sha}
                assert run(rs, "bridge", "prerouting", frame) == ("drop", ["spoofed"]), (sender, sha)
            ok = {**arp("veth0", sender), **own, ("payload", "arp", "saddr ether"): MAC_A}
            assert run(rs, "bridge", "prerouting", ok)[0] is None, sender
        theirs = {**arp("veth1", B4), ("payload", "ether", "saddr"): MAC_B, ("payload", "arp", "saddr ether"): MAC_B}
        assert run(rs, "bridge", "prerouting", theirs)[0] is None  # b's own
        # Not a pod port, a pod whose MAC is not known, the MAC check off: not checked.
        assert run(rs, "bridge", "prerouting", {**arp("eth9", "10.9.9.9"), ("payload", "arp", "saddr ether"): MAC_B})[0] is None
        forged = {**arp("veth0", A4), ("payload", "ether", "saddr"): MAC_A, ("payload", "arp", "saddr ether"): MAC_B}
        assert run(engine(families), "bridge", "prerouting", dict(forged))[0] is None
        assert run(engine(families, pod_macs=(MAC_A, MAC_B), check_source_mac=False), "bridge", "prerouting", dict(forged))[0] is None


def _with_unknowable_ports(families: tuple[int, ...], check_source_mac: bool = True) -> Ruleset:
    """Pods x/a (veth0) and x/b (veth1), as :func:`engine`; x/c on veth2 with an address of no
    family of the cluster (an IPv6-only endpoint file in an IPv4 cluster); x/d on veth3 whose
    endpoint file could not be read (the policy agent cuts its port off)."""
    eng = PolicyEngine(NODE, families=families, check_source_mac=check_source_mac)
    for i, (name, v4, v6) in enumerate((("a", A4, A6), ("b", B4, B6))):
        ips = tuple(ipaddress.ip_address(ip) for ip, v in ((v4, 4), (v6, 6)) if v in families)
        eng.upsert_pod(Pod("x", name, NODE, ips, {"pod": name}),
                       LocalPort(f"veth{i}", f"02:00:00:00:00:{i:02x}", "cni0", pod_mac=(MAC_A, MAC_B)[i]))
    other = "fd00:10:244:1::9" if 6 not in families else "10.244.1.9"
    eng.upsert_pod(Pod("x", "c", NODE, (ipaddress.ip_address(other),), {"pod": "c"}),
                   LocalPort("veth2", "02:00:00:00:00:02", "cni0", pod_mac="0a:58:0a:f4:01:09"))
    eng.upsert_pod(Pod("x", "d", NODE, (ipaddress.ip_address("10.244.1.10" if 4 in families else "fd00:10:244:1::a"),), {"pod": "d"}),
                   LocalPort("veth3", "02:00:00:00:00:03", "cni0", pod_mac="0a:58:0a:f4:01:0a"))
    eng.cut_off(("x", "d"), LocalPort("veth3", "02:00:00:00:00:03", "cni0", pod_mac="0a:58:0a:f4:01:0a"))
    assert ("x", "d") not in eng.pods and ("x", "d") not in eng.local
    return eng.build()


def test_a_local_pod_with_no_address_of_the_clusters_families_or_no_usable_file_is_cut_off():
    """Its port used to be left out of every pod-port set: nothing checked its source address,
    its ARP or its source MAC, so it could claim b's address or move b's forwarding entry on
    the bridge.  Now a pod port with no address of its own and no MAC: every IP and ARP
    packet from it spoofed and, where MACs are checked, every frame dropped."""
    for families in ((4,), (6,), (4, 6)):
        for check in (True, False):
            rs = _with_unknowable_ports(families, check_source_mac=check)
            for port in ("veth2", "veth3"):
                assert _in_set(rs, "bridge", "pod-ports", port) and _in_set(rs, "bridge", compiler.MAC_PORTS, port) == check
                own_mac = {("payload", "ether", "saddr"): "0a:58:0a:f4:01:09" if port == "veth2" else "0a:58:0a:f4:01:0a"}
                for src, dst in ((A4, "192.0.2.1"), (B4, "192.0.2.1"), (A6, "2001:db8::1"), (B6, "2001:db8::1")):
                    if (6 if ":" in src else 4) in families:
                        assert run(rs, "bridge", "prerouting", ip_frame(port, src, dst, extra=own_mac))[0] == "drop", (port, src)
                if 4 in families:
                    assert run(rs, "bridge", "prerouting", {**arp(port, B4), **own_mac})[0] == "drop", port
                if 6 in families:
                    assert run(rs, "bridge", "prerouting", {**na(port, "fe80::1", B6), **own_mac})[0] == "drop", port
                if check:  # b's MAC, on any frame: never learned on this port
                    frame = {("meta", "iifname"): port, ("payload", "ether", "type"): "0x88b5", ("payload", "ether", "saddr"): MAC_B}
                    assert run(rs, "bridge", "prerouting", frame)[0] == "drop", port
            # a and b as before.
            a4, a_mac = (A4, "192.0.2.1") if 4 in families else (A6, "2001:db8::1"), {("payload", "ether", "saddr"): MAC_A}
            assert run(rs, "bridge", "prerouting", ip_frame("veth0", *a4, extra=a_mac))[0] is None


def test_arp_of_an_ipv6_only_cluster_is_dropped_not_counted_as_mac_spoofed():
    """An IPv6-only cluster drops every ARP packet from a pod (the family it has not), not
    counted as spoofed: the ARP sender hardware address check is IPv4's and comes only with
    it, so a pod's ARP naming another MAC is not counted (nor logged) as ``spoofed-mac``."""
    rs = engine((6,), pod_macs=(MAC_A, MAC_B))
    for sha in (MAC_A, MAC_B):
        frame = {**arp("veth0", A4), ("payload", "ether", "saddr"): MAC_A, ("payload", "arp", "saddr ether"): sha}
        assert run(rs, "bridge", "prerouting", frame) == ("drop", []), sha
    from agentd.nft.expr import DropLog

    eng = PolicyEngine(NODE, families=(6,), drop_log=DropLog(5))
    eng.upsert_pod(Pod("x", "a", NODE, (ipaddress.ip_address(A6),), {}), LocalPort("veth0", "02:00:00:00:00:01", "cni0", pod_mac=MAC_A))
    rules = eng.build().objects[("bridge", compiler.TABLE, "chain", "prerouting")].rules  # type: ignore[union-attr]
    assert not [r for r in rules if '"saddr ether"' in r]
    assert sum('"spoofed-mac"' in r for r in rules) == 1  # the frame's own source MAC is checked as ever


def test_with_check_source_mac_off_no_mac_is_checked():
    """[policy] check_source_mac = false (pods whose MAC changes after agentd-cni's ADD): the
    pods' MACs known or not, no port is in the MAC check's sets and any source MAC passes;
    the address checks stay."""
    for families in ((4,), (4, 6)):
        rs = engine(families, pod_macs=(MAC_A, MAC_B), check_source_mac=False)
        assert not _in_set(rs, "bridge", compiler.MAC_PORTS, "veth0") and not _in_set(rs, "bridge", compiler.MAC_PORTS, "veth1")
        assert not _in_set(rs, "bridge", compiler.POD_MACS, ("veth0", MAC_A))
        other = {("payload", "ether", "saddr"): "02:11:22:33:44:55"}
        assert run(rs, "bridge", "prerouting", ip_frame("veth0", A4, "192.0.2.1", extra=other))[0] is None
        assert run(rs, "bridge", "prerouting", {**arp("veth0", A4), **other})[0] is None
        assert run(rs, "bridge", "prerouting", ip_frame("veth0", B4, "192.0.2.1", extra=other)) == ("drop", ["spoofed"])


def test_the_mac_check_logs_as_its_own_reason():
    """With flow records, a MAC-spoofed frame goes through its own logged chain (prefix
    ``spoofed-mac``, the record's reason), counted in the one spoofed counter."""
    from agentd.nft.expr import DropLog

    eng = PolicyEngine(NODE, families=(4,), drop_log=DropLog(5))
    eng.upsert_pod(Pod("x", "a", NODE, (ipaddress.ip_address(A4),), {}), LocalPort("veth0", "02:00:00:00:00:01", "cni0", pod_mac=MAC_A))
    rs = eng.build()
    prerouting = rs.objects[("bridge", compiler.TABLE, "chain", "prerouting")]
    first, arp_sender = (json.loads(r) for r in prerouting.rules[:2])  # type: ignore[union-attr]
    assert first[-1] == {"jump": {"target": "spoofed-mac"}}
    assert arp_sender[-1] == {"jump": {"target": "spoofed-mac"}}  # an ARP sender hardware address not its own
    assert any(m.get("match", {}).get("left", {}).get("concat", [None, None])[1] == {"payload": {"protocol": "arp", "field": "saddr ether"}}
               for m in arp_sender)
    chain = rs.objects[("bridge", compiler.TABLE, "chain", "spoofed-mac")]
    logged = json.loads(chain.rules[0])  # type: ignore[union-attr]
    assert {"log": {"prefix": "spoofed-mac", "group": 5}} in logged and {"counter": "spoofed"} in logged
    assert any("limit" in stmt for stmt in logged)
    assert _in_set(rs, "bridge", "pod-macs", ("veth0", MAC_A)) and _in_set(rs, "bridge", "mac-ports", "veth0")


def test_neighbour_advertisements_and_router_messages_log_as_their_own_reasons():
    """With flow records, a pod's neighbour advertisement claiming an address not its own goes
    through ``spoofed-nd``, its router advertisements and redirects through ``ra-guard`` (each
    its log prefix, the record's reason, not ``spoofed``: their source is the pod's own), both
    counted in the one spoofed counter."""
    from agentd.nft.expr import DropLog

    eng = PolicyEngine(NODE, families=(4, 6), drop_log=DropLog(5))
    eng.upsert_pod(Pod("x", "a", NODE, (ipaddress.ip_address(A4), ipaddress.ip_address(A6)), {}),
                   LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    rs = eng.build()
    na = rs.objects[("bridge", compiler.TABLE, "chain", "na/veth0")]
    assert json.loads(na.rules[-1]) == [{"jump": {"target": "spoofed-nd"}}]  # type: ignore[union-attr]
    prerouting = rs.objects[("bridge", compiler.TABLE, "chain", "prerouting")]
    guard = [json.loads(r) for r in prerouting.rules if "ra-guard" in r]  # type: ignore[union-attr]
    assert len(guard) == 1 and guard[0][-1] == {"jump": {"target": "ra-guard"}} and "nd-router-advert" in str(guard)
    for name in ("spoofed-nd", "ra-guard"):
        logged = json.loads(rs.objects[("bridge", compiler.TABLE, "chain", name)].rules[0])  # type: ignore[union-attr]
        assert {"log": {"prefix": name, "group": 5}} in logged and {"counter": "spoofed"} in logged


def test_only_a_pods_own_port_marks_its_hairpin_as_its_own():
    """An isolated pod's packet from its own port with its own address is marked
    (compiler.SELF_MARK) in prerouting; the same address from a port without a checked
    source (a container attached without identity) is not, and its frame DNATed back to the
    pod meets the isolation drop in forward rather than the hairpin accept (here a frame not
    addressed to the node; one that was, br_netfilter's path, passes to the inet chains,
    whose hairpin accept wants the mark too: test_policy_engine).  A pod not isolated:
    nothing marked."""
    for families in ((4,), (4, 6)):
        rs = engine(families, DENY_ALL)
        addrs = [(A4, "192.0.2.1")] + ([(A6, "fd00:96::1")] if 6 in families else [])
        for a, vip in addrs:
            own = ip_frame("veth0", a, vip)
            assert run(rs, "bridge", "prerouting", own)[0] == "up"
            assert own[("meta", "mark")] & compiler.SELF_MARK
            stranger = ip_frame("eth9", a, vip)  # no pod port: its source is not checked
            run(rs, "bridge", "prerouting", stranger)
            assert not stranger.get(("meta", "mark"), 0) & compiler.SELF_MARK
            # After DNAT to a, bridged back out of a's port.
            back = {("meta", "oifname"): "veth0"}
            assert run(rs, "bridge", "forward", {**own, ("payload", own_proto(a), "daddr"): a, **back})[0] == "accept"
            assert run(rs, "bridge", "forward", {**stranger, ("payload", own_proto(a), "daddr"): a, **back}) == ("drop", [])
        open_rs = engine(families)
        frame = ip_frame("veth0", A4, "192.0.2.1")
        run(open_rs, "bridge", "prerouting", frame)
        assert not frame.get(("meta", "mark"), 0)


def own_proto(address: str) -> str:
    return "ip6" if ":" in address else "ip"


def test_a_frame_br_netfilter_translated_and_bridged_is_left_to_the_inet_chains():
    """Where br_netfilter hands bridged frames to the IP hooks, a same-node client's frame to
    a Service (addressed to the node: the gateway's MAC, pkttype host) translated to an
    endpoint on the same bridge is bridged to it, not routed; br_netfilter hands it to the
    inet forward hook next, where the policy chains judge it.  The bridge table's isolation
    drops (for what crosses the bridge unjudged) let it pass: to an ingress-isolated pod, from
    an egress-isolated one.  A frame between two pods (pkttype other) still meets them."""
    for families in ((4,), (4, 6)):
        rs = engine(families, DENY_ALL)  # x/a (veth0) and x/b (veth1), both isolated both ways
        pairs = [(A4, B4)] + ([(A6, B6)] if 6 in families else [])
        for a, b in pairs:
            translated = ip_frame("veth0", a, b, extra={("meta", "pkttype"): "host", ("meta", "oifname"): "veth1"})
            assert run(rs, "bridge", "forward", translated)[0] == "accept", a
            bridged = ip_frame("veth0", a, b, extra={("meta", "oifname"): "veth1"})  # not for the node
            assert run(rs, "bridge", "forward", bridged) == ("drop", []), a
            assert run(rs, "bridge", "forward", {**bridged, ("meta", "pkttype"): "broadcast"}) == ("drop", []), a


def lla(kind: int, mac: str, length: int = 1) -> bytes:
    """A link-layer address option: source (1) or target (2), ``length`` units of 8 bytes."""
    return bytes([kind, length]) + bytes.fromhex(mac.replace(":", "")) + bytes(8 * length - 8)


NONCE = bytes([14, 1]) + bytes.fromhex("b8a0b799ee1e")  # as Linux's enhanced_dad sends it (RFC 7527)
GATEWAY_MAC = "0a:58:0a:f4:01:01"


def test_neighbour_discovery_names_only_the_pods_own_mac_in_its_link_layer_address_options():
    """A neighbour cache takes a solicitation's (or router solicitation's) source link-layer
    address option and an advertisement's target one, not the frame's source: pod a saying,
    from its own MAC and for its own address, "I am at b's (or the gateway's) MAC" would draw
    the traffic for a there.  A receiving Linux kernel takes the first such option wherever
    it is among the options, so only these shapes pass: no option, or one option of the
    right type and 8 bytes naming a's own MAC.  The rest is dropped as MAC-spoofed."""
    ns, na_, rs = "nd-neighbor-solicit", "nd-neighbor-advert", "nd-router-solicit"
    for families in ((6,), (4, 6)):
        rs_ = engine(families, pod_macs=(MAC_A, MAC_B))

        def verdict(kind: str, source: str, options: bytes = b"", rules: Ruleset = rs_, **kw: Any) -> tuple[str | None, list[str]]:
            target = None if kind == rs else A6
            return run(rules, "bridge", "prerouting", nd("veth0", kind, source, target, options, mac=MAC_A, **kw))

        # What a Linux pod sends (tcpdump on this kernel): an NS and an RS with its own MAC as
        # the source option, an NA with it as the target option, or none of them.
        for source in (A6, "fe80::1"):
            assert verdict(ns, source, lla(1, MAC_A))[0] == "accept", source
            assert verdict(na_, source, lla(2, MAC_A))[0] == "accept", source
            assert verdict(ns, source)[0] == verdict(na_, source)[0] == "accept", source
        assert verdict(rs, "fe80::1", lla(1, MAC_A))[0] == verdict(rs, "fe80::1")[0] == "accept"
        assert verdict(rs, "::")[0] == "accept"  # from the unspecified address: no option
        for other in (MAC_B, GATEWAY_MAC):
            for source in (A6, "fe80::1"):
                assert verdict(ns, source, lla(1, other)) == ("drop", ["spoofed"]), (source, other)
                assert verdict(na_, source, lla(2, other)) == ("drop", ["spoofed"]), (source, other)
            assert verdict(rs, "fe80::1", lla(1, other)) == ("drop", ["spoofed"]), other
            assert verdict(na_, "::", lla(2, other)) == ("drop", ["spoofed"]), other  # an NA is never DAD's
            assert verdict(ns, "::", lla(1, other)) == ("drop", ["spoofed"]), other
        # Not the shape: its own MAC behind another option (a nonce, an unknown one) or before
        # a second address option, the other type, a longer option, an option cut short.
        for options in (NONCE + lla(1, MAC_B), NONCE + lla(1, MAC_A), bytes([99, 1]) + bytes(6) + lla(1, MAC_A),
                        lla(1, MAC_A) + lla(1, MAC_B), lla(2, MAC_A), lla(1, MAC_A, length=2), lla(1, MAC_A)[:6]):  # fmt: skip
            assert verdict(ns, A6, options) == ("drop", ["spoofed"]), options.hex()
            assert verdict(rs, "fe80::1", options) == ("drop", ["spoofed"]), options.hex()
        for options in (lla(1, MAC_A), lla(2, MAC_A) + lla(2, MAC_B), bytes([99, 1]) + bytes(6) + lla(2, MAC_B), NONCE):
            assert verdict(na_, A6, options) == ("drop", ["spoofed"]), options.hex()
        assert verdict(ns, A6, NONCE) == ("drop", ["spoofed"])  # a nonce is duplicate address detection's only
        # Duplicate address detection: from the unspecified address, a nonce option (Linux's
        # enhanced_dad, the default) or none, and nothing else.
        assert verdict(ns, "::", NONCE)[0] == verdict(ns, "::")[0] == "accept"
        for options in (NONCE + lla(1, MAC_B), NONCE + NONCE, bytes([14, 2]) + bytes(14)):
            assert verdict(ns, "::", options) == ("drop", ["spoofed"]), options.hex()
        # b's port: b's own MAC.
        assert run(rs_, "bridge", "prerouting", nd("veth1", ns, B6, B6, lla(1, MAC_B), mac=MAC_B))[0] == "accept"
        assert run(rs_, "bridge", "prerouting", nd("veth1", ns, B6, B6, lla(1, MAC_A), mac=MAC_B)) == ("drop", ["spoofed"])
        # Routed ICMPv6 of these types (hop limit below 255) is no neighbour discovery: a
        # receiver drops it, and the rules left for it are as before.
        assert verdict(ns, A6, lla(1, MAC_B), hoplimit=64)[0] == "accept"
        # Not a pod port, a pod whose MAC is not known, the MAC check off: not checked.
        assert run(rs_, "bridge", "prerouting", nd("eth9", ns, A6, A6, lla(1, MAC_B)))[0] == "accept"
        for unchecked in (engine(families), engine(families, pod_macs=(MAC_A, MAC_B), check_source_mac=False)):
            assert run(unchecked, "bridge", "prerouting", nd("veth0", ns, A6, A6, lla(1, MAC_B), mac=MAC_A))[0] == "accept"
            assert not any(name.startswith("lla/") for (_, _, _, name) in unchecked.objects)


def test_other_icmpv6_is_untouched_by_the_link_layer_address_check():
    """MLD (from the unspecified address too, before a link-local one is up), echo requests,
    router advertisements and redirects: the same verdicts, with the pods' MACs checked or
    not; an IPv4-only cluster's neighbour discovery is not looked into (link-local only)."""
    checked, unchecked = engine((4, 6), pod_macs=(MAC_A, MAC_B)), engine((4, 6))
    for kind, source in (("mld2-listener-report", "::"), ("mld2-listener-report", "fe80::1"), ("echo-request", A6),
                         ("echo-request", "fe80::1"), ("nd-router-advert", "fe80::1"), ("nd-redirect", "fe80::1")):  # fmt: skip
        frame = {**ip_frame("veth0", source, "ff02::16", extra={("meta", "l4proto"): "ipv6-icmp"}),
                 ("payload", "icmpv6", "type"): kind, ("th",): bytes(8) + lla(1, MAC_B), ("payload", "ip6", "length"): 16,
                 ("payload", "ip6", "hoplimit"): 255, ("payload", "ether", "saddr"): MAC_A}  # fmt: skip
        assert run(checked, "bridge", "prerouting", dict(frame)) == run(unchecked, "bridge", "prerouting", dict(frame)), kind
    v4only = engine((4,), pod_macs=(MAC_A, MAC_B))
    assert run(v4only, "bridge", "prerouting", nd("veth0", "nd-neighbor-solicit", "fe80::1", "fe80::2", lla(1, MAC_B), mac=MAC_A))[0] is None
    assert not any(name.startswith("lla") for (_, _, _, name) in v4only.objects)


def test_the_link_layer_address_check_logs_as_a_mac_check():
    """With flow records, a message naming another MAC goes through the ``spoofed-mac`` chain
    (its log prefix the record's reason), as an ARP sender hardware address not the pod's own;
    the port's chain holds the pod's MAC, reached through ``lla-ports``, only for known MACs."""
    from agentd.nft.expr import DropLog

    eng = PolicyEngine(NODE, families=(4, 6), drop_log=DropLog(5))
    eng.upsert_pod(Pod("x", "a", NODE, (ipaddress.ip_address(A4), ipaddress.ip_address(A6)), {}),
                   LocalPort("veth0", "02:00:00:00:00:01", "cni0", pod_mac=MAC_A))
    eng.upsert_pod(Pod("x", "b", NODE, (ipaddress.ip_address(B4), ipaddress.ip_address(B6)), {}),
                   LocalPort("veth1", "02:00:00:00:00:02", "cni0"))  # an older plugin's file: no MAC
    rs = eng.build()
    chain = rs.objects[("bridge", compiler.TABLE, "chain", "lla/veth0")]
    assert json.loads(chain.rules[-1]) == [{"jump": {"target": "spoofed-mac"}}]  # type: ignore[union-attr]
    assert any("0x01010a580af40102" in r for r in chain.rules)  # type: ignore[union-attr]
    lla_ports = rs.objects[("bridge", compiler.TABLE, "set", compiler.LLA_PORTS)]
    assert dict(lla_ports.elements) == {"veth0": ("jump", "lla/veth0")}  # type: ignore[union-attr]
    assert ("bridge", compiler.TABLE, "chain", "lla/veth1") not in rs.objects


def _logged_drops(rs: Ruleset) -> list[tuple[str, str, str]]:
    """The drop rules of ``rs`` that log nothing: neither with a log statement of their own nor
    in a logged drop chain (DropLog.chain_rules: a limited log and drop, the suppressed counter,
    the drop), but the output chain's drop of the node's own ICMP redirects to its pods (no
    pod's packet) and an IPv4-only cluster's drop of the MLD messages a pod's kernel sends at
    link up (docs/observability.md)."""
    unlogged = []
    for obj in rs.objects.values():
        if not isinstance(obj, NftChain):
            continue
        rules = [json.loads(r) for r in obj.rules]
        for i, rule in enumerate(rules):
            if not any("drop" in s for s in rule) or any("log" in s for s in rule):
                continue
            if i >= 2 and rules[i - 1] == [{"counter": compiler.SUPPRESSED}] and any("log" in s for s in rules[i - 2]) \
                    and rules[i - 2][-len(rule):] == rule:
                continue  # the limit's excess: logged up to the limit by the rule before
            if obj.family == "inet" and obj.name == "output" and any(
                    s.get("match", {}).get("right") in ("redirect", "nd-redirect") for s in rule):
                continue
            if obj.family == "bridge" and {"set": compiler.MLD_TYPES} in [s.get("match", {}).get("right") for s in rule]:
                continue  # an IPv4-only cluster's pods' MLD messages at link up
            unlogged.append((obj.family, obj.name, json.dumps(rule)[:160]))
    return unlogged


def test_with_flow_records_every_drop_rule_is_logged():
    """docs/observability.md: each drop rule of the agent's tables is preceded by a rate-limited
    log rule -- the bridge's isolation drops (broadcast, multicast, IPv6 but neighbour discovery
    to or from an isolated pod) and the other family's drops too, each its own prefix."""
    from agentd.nft.expr import DropLog

    for families in ((4,), (6,), (4, 6)):
        eng = PolicyEngine(NODE, families=families, drop_log=DropLog(5))
        for i, (name, v4, v6) in enumerate((("a", A4, A6), ("b", B4, B6))):
            ips = tuple(ipaddress.ip_address(ip) for ip, v in ((v4, 4), (v6, 6)) if v in families)
            eng.upsert_pod(Pod("x", name, NODE, ips, {"pod": name}),
                           LocalPort(f"veth{i}", f"02:00:00:00:00:{i:02x}", "cni0", pod_mac=MAC_A if i == 0 else ""))
        eng.upsert_policy(Policy.parse(kinds.validate(DENY_ALL)))
        rs = eng.build()
        assert _logged_drops(rs) == [], families
        forward = rs.objects[("bridge", compiler.TABLE, "chain", "forward")]
        jumps = [s["jump"]["target"] for r in forward.rules for s in json.loads(r) if "jump" in s]  # type: ignore[union-attr]
        assert jumps == [compiler.ISOLATED_IN, compiler.ISOLATED_OUT]
        for name in (compiler.ISOLATED_IN, compiler.ISOLATED_OUT):
            first = json.loads(rs.objects[("bridge", compiler.TABLE, "chain", name)].rules[0])  # type: ignore[union-attr]
            assert {"log": {"prefix": name, "group": 5}} in first


def test_a_vlan_tagged_frame_from_a_pod_logs_as_its_own_reason_not_as_spoofed():
    """A pod's tagged frame (a priority tag with its own address) claims no address of
    another's: with flow records it goes through its own chain (``vlan-tagged``, the record's
    reason), still counted in the one spoofed counter."""
    from agentd.daemon.flow_directory import FlowDirectory
    from agentd.nft.expr import DropLog

    eng = PolicyEngine(NODE, families=(4, 6), drop_log=DropLog(5))
    eng.upsert_pod(Pod("x", "a", NODE, (ipaddress.ip_address(A4), ipaddress.ip_address(A6)), {}),
                   LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    rs = eng.build()
    prerouting = rs.objects[("bridge", compiler.TABLE, "chain", "prerouting")]
    tagged = [json.loads(r) for r in prerouting.rules if "8021q" in r]  # type: ignore[union-attr]
    assert len(tagged) == 1 and tagged[0][-1] == {"jump": {"target": compiler.VLAN_TAGGED}}
    logged = json.loads(rs.objects[("bridge", compiler.TABLE, "chain", compiler.VLAN_TAGGED)].rules[0])  # type: ignore[union-attr]
    assert {"log": {"prefix": "vlan-tagged", "group": 5}} in logged and {"counter": "spoofed"} in logged
    meaning = FlowDirectory(None, None, (None, None)).drop(compiler.VLAN_TAGGED)
    assert meaning is not None and (meaning.reason, meaning.direction) == ("vlan-tagged", "egress")
