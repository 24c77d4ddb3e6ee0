"""The policy compiler against an independent model of NetworkPolicy v1 (tests/netpol_model.py).

The engine compiles policies into nftables JSON; a small interpreter here runs a new
connection's first packet through the compiled ``inet agentd-policy`` chains (egress base
chain, then ingress) the way the kernel evaluates them, and the verdict must be what the
model says - for hand-written cases covering each item of the v1 semantics and for random
clusters (hypothesis), over IPv4 and IPv6 in a dual-stack cluster (every pod has both).  Plus the structure the kernel engineer cares about: membership is
set elements, a pod appearing changes elements and not rules, plans are incremental.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from netpol_model import Cluster, ModelPod, egress_allowed, ingress_allowed

from agentd.nft import expr
from agentd.policy import compiler
from agentd.policy.engine import PolicyEngine
from agentd.policy.model import LocalPort, NamedPort, PeerSelector, Pod, Policy
from agentd.nft.ruleset import NftChain, NftSet, Ruleset, plan
from agentd.policy.views import pod_view
from agentd.resources import kinds

NODE = "node1"


# ------------------------------------------------------------------ an nftables interpreter


class Packet:
    def __init__(self, saddr: str, daddr: str, proto: str, dport: int, iif: str = "cni0", dnat: bool = False,
                 mark: int = 0) -> None:
        family = "ip6" if ":" in saddr else "ip"
        self.fields = {
            ("payload", family, "saddr"): saddr,
            ("payload", family, "daddr"): daddr,
            ("meta", "l4proto"): proto,
            ("payload", "th", "dport"): dport,
            ("meta", "iifname"): iif,  # routed up from a pod bridge (or in from elsewhere)
            ("ct", "state"): "new",  # the first packet of a connection
            ("ct", "status"): "dnat" if dnat else None,  # translated (a Service's) or not
            ("meta", "mark"): mark,  # the packet mark (the bridge's prerouting sets compiler.SELF_MARK)
        }


class NoField(Exception):
    """The packet has no such header (an ``ip`` match on an IPv6 packet: no match)."""


def _value(expr: Any, pkt: Packet) -> Any:
    if "payload" in expr:
        key = ("payload", expr["payload"]["protocol"], expr["payload"]["field"])
        if key not in pkt.fields:
            raise NoField(key)
        return pkt.fields[key]
    if "meta" in expr:
        return pkt.fields[("meta", expr["meta"]["key"])]
    if "concat" in expr:
        return tuple(_value(e, pkt) for e in expr["concat"])
    if "ct" in expr:
        return pkt.fields[("ct", expr["ct"]["key"])]
    if "&" in expr:
        left, mask = expr["&"]
        return _value(left, pkt) & mask
    raise AssertionError(f"unexpected expression {expr}")


def _in_set(value: Any, s: NftSet) -> bool:
    for e in s.elements:
        if isinstance(e, ipaddress.IPv4Network):
            if ipaddress.ip_address(value) in e:
                return True
        elif isinstance(e, tuple):
            if tuple(str(x) if i == 0 else x for i, x in enumerate(value)) == e:
                return True
        elif e == value:
            return True
    return False


def _literal(right: Any, value: Any) -> bool:
    if isinstance(right, dict) and "set" in right:
        return any(_literal(r, value) for r in right["set"])
    if isinstance(right, dict) and "prefix" in right:
        return ipaddress.ip_address(value) in ipaddress.ip_network(f"{right['prefix']['addr']}/{right['prefix']['len']}")
    if isinstance(right, dict) and "range" in right:
        lo, hi = right["range"]
        return lo <= value <= hi
    if isinstance(right, list):
        return value in right
    return value == right


def _match(m: dict[str, Any], pkt: Packet, rs: Ruleset) -> bool:
    try:
        value = _value(m["left"], pkt)
    except NoField:
        return False
    right = m["right"]
    if isinstance(right, str) and right.startswith("@"):
        result = _in_set(value, rs.objects[(compiler.INET, compiler.TABLE, "set", right[1:])])  # type: ignore[arg-type]
    else:
        result = _literal(right, value)
    return result if m["op"] in ("==", "in") else not result


def run_chain(name: str, pkt: Packet, rs: Ruleset) -> str | None:
    """"accept" / "drop" if the chain decided, None if it fell through (or returned)."""
    chain = rs.objects[(compiler.INET, compiler.TABLE, "chain", name)]
    assert isinstance(chain, NftChain)
    for text in chain.rules:
        for stmt in json.loads(text):
            if "match" in stmt:
                if not _match(stmt["match"], pkt, rs):
                    break
            elif "vmap" in stmt:
                m = rs.objects[(compiler.INET, compiler.TABLE, "set", stmt["vmap"]["data"][1:])]
                try:
                    key = _value(stmt["vmap"]["key"], pkt)
                except NoField:
                    break
                target = dict(m.elements).get(key)  # type: ignore[union-attr]
                if target is None:
                    break
                verdict = run_chain(target[1], pkt, rs)
                if verdict is not None:
                    return verdict
            elif "jump" in stmt:
                verdict = run_chain(stmt["jump"]["target"], pkt, rs)
                if verdict is not None:
                    return verdict
            elif "accept" in stmt:
                return "accept"
            elif "drop" in stmt:
                return "drop"
            elif "counter" in stmt:
                pass
            else:
                raise AssertionError(f"unexpected statement {stmt}")
    return None


def forwarded(rs: Ruleset, pkt: Packet) -> bool:
    """The forward hook: base chain "egress" (priority 0), then "ingress" (10)."""
    return run_chain("egress", pkt, rs) != "drop" and run_chain("ingress", pkt, rs) != "drop"


# ------------------------------------------------------------------ helpers


def pod_obj(p: ModelPod, node: str) -> Pod:
    ips = tuple(ipaddress.ip_address(a) for a in (p.ip, p.ip6) if a is not None)
    return Pod(p.namespace, p.name, node, ips, dict(p.labels),
               tuple(NamedPort(n, port, proto) for n, (port, proto) in p.ports.items()))  # fmt: skip


def engine_for(cluster: Cluster, local: list[str], families: tuple[int, ...] = (4,)) -> PolicyEngine:
    eng = PolicyEngine(NODE, families=families)
    for ns, labels in cluster.namespaces.items():
        eng.set_namespace(ns, labels)
    for i, p in enumerate(cluster.pods):
        is_local = p.key in local
        port = LocalPort(f"veth{i}", f"02:00:00:00:00:{i:02x}", "cni0") if is_local else None
        eng.upsert_pod(pod_obj(p, NODE if is_local else "node2"), port)
    for manifest in cluster.policies:
        eng.upsert_policy(Policy.parse(kinds.validate(manifest)))
    return eng


# Probes of every port a grid pod names (80 and 8080: pods b name theirs with other numbers),
# and some they do not.
PROBES = (("TCP", 80), ("TCP", 81), ("UDP", 80), ("SCTP", 80), ("TCP", 8080), ("UDP", 81), ("UDP", 8081),
          ("SCTP", 8080))


def check_all(cluster: Cluster, probes=PROBES, families=(4, 6)) -> None:
    """Every ordered pair with a local end, over each family both have an address of: the
    compiled verdict is the model's.

    This node judges the egress of its own pods and the ingress of its own pods; a remote
    pod's side is its own node's business."""
    local = {p.key for p in cluster.pods[: len(cluster.pods) // 2 + 1]}
    rs = engine_for(cluster, sorted(local), families).build()
    wrong = []
    for src in cluster.pods:
        for dst in cluster.pods:
            if src is dst or (src.key not in local and dst.key not in local):
                continue
            for family in families:
                saddr, daddr = src.addr(family), dst.addr(family)
                if saddr is None or daddr is None:
                    continue
                for proto, port in probes:
                    want = True
                    if src.key in local:
                        want = want and egress_allowed(cluster, src, dst, proto, port, family)
                    if dst.key in local:
                        want = want and ingress_allowed(cluster, src, dst, proto, port, family)
                    got = forwarded(rs, Packet(saddr, daddr, compiler.l4proto(proto), port))
                    if got != want:
                        wrong.append(f"{src.key}->{dst.key} {proto}/{port} IPv{family}: model {want}, compiled {got}")
    assert not wrong, "\n".join(wrong[:20])


def np(name: str, ns: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name, "namespace": ns}, "spec": spec}


def grid() -> Cluster:
    """Nine pods, three a namespace; the b pods name their ports with other numbers (a named
    port resolves on each pod for itself: 80 on a and c, 8080 on b)."""
    pods = []
    n = 1
    for ns in ("x", "y", "z"):
        for name in ("a", "b", "c"):
            base = 8000 if name == "b" else 0
            pods.append(ModelPod(ns, name, f"10.244.{n}.{n + 1}", {"pod": name, "ns": ns},
                                 {"serve-80-tcp": (base + 80, "TCP"), "serve-81-udp": (base + 81, "UDP"),
                                  "serve-80-sctp": (base + 80, "SCTP")},
                                 f"fd00:10:244:{n}::{n + 1}"))  # fmt: skip
            n += 1
    return Cluster(pods, {"x": {"team": "blue"}, "y": {"team": "red"}, "z": {}})


# ------------------------------------------------------------------ hand-written cases

CASES = {
    "deny all ingress": np("deny", "x", {"podSelector": {}}),
    "deny all egress": np("deny", "x", {"podSelector": {}, "policyTypes": ["Egress"]}),
    "empty ingress rule allows all": np("p", "x", {"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [{}]}),
    "empty from allows all": np("p", "x", {"podSelector": {}, "ingress": [{"from": [], "ports": [{"port": 80}]}]}),
    "pod selector in own ns": np("p", "x", {"podSelector": {"matchLabels": {"pod": "a"}},
                                             "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}]}]}),
    "namespace selector": np("p", "x", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "red"}}}]}]}),
    "ns and pod selector combined": np("p", "x", {"podSelector": {}, "ingress": [{"from": [
        {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "Exists"}]},
         "podSelector": {"matchExpressions": [{"key": "pod", "operator": "In", "values": ["a", "c"]}]}}]}]}),
    "ns and pod selector as two peers": np("p", "x", {"podSelector": {}, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"team": "red"}}}, {"podSelector": {"matchLabels": {"pod": "c"}}}]}]}),
    "ipblock with except": np("p", "x", {"podSelector": {}, "ingress": [{"from": [
        {"ipBlock": {"cidr": "10.244.0.0/16", "except": ["10.244.4.0/24", "10.244.7.0/24"]}}]}]}),
    "ports numeric range udp": np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"port": 79, "endPort": 80, "protocol": "UDP"}]}]}),
    "named port ingress": np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"port": "serve-80-tcp"}]}]}),
    "named port egress": np("p", "x", {"podSelector": {}, "policyTypes": ["Egress"], "egress": [{"ports": [{"port": "serve-81-udp", "protocol": "UDP"}]}]}),
    "egress to ns with named port": np("p", "y", {"podSelector": {}, "egress": [{"to": [{"namespaceSelector": {}}], "ports": [{"port": "serve-80-tcp"}]}]}),
    "egress ipblock named port": np("p", "x", {"podSelector": {}, "egress": [{"to": [{"ipBlock": {"cidr": "10.244.0.0/20"}}], "ports": [{"port": "serve-80-tcp"}]}]}),
    "named port with another protocol ingress": np("p", "x", {"podSelector": {}, "ingress": [
        {"ports": [{"port": "serve-80-tcp", "protocol": "UDP"}, {"port": "serve-81-udp"}]}]}),
    "named port with another protocol egress": np("p", "x", {"podSelector": {}, "policyTypes": ["Egress"], "egress": [
        {"ports": [{"port": "serve-81-udp", "protocol": "TCP"}, {"port": "serve-80-sctp", "protocol": "SCTP"}]}]}),
    "protocol only": np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"protocol": "SCTP"}]}]}),
    "NotIn and DoesNotExist": np("p", "x", {"podSelector": {"matchExpressions": [{"key": "pod", "operator": "NotIn", "values": ["a"]}]},
                                            "ingress": [{"from": [{"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "DoesNotExist"}]}}]}]}),
    "ingress only types with egress rules ignored": np("p", "x", {"podSelector": {}, "policyTypes": ["Ingress"], "egress": [{}], "ingress": [{"ports": [{"port": 81}]}]}),
    "ipv6 ipblock with except": np("p", "x", {"podSelector": {}, "ingress": [{"from": [
        {"ipBlock": {"cidr": "fd00:10:244::/48", "except": ["fd00:10:244:4::/64", "fd00:10:244:7::8/128"]}}]}]}),
    "ipblocks of both families": np("p", "x", {"podSelector": {}, "ingress": [{"from": [
        {"ipBlock": {"cidr": "10.244.4.0/22"}}, {"ipBlock": {"cidr": "fd00:10:244:8::/62"}}], "ports": [{"port": 80}]}]}),
    "egress ipv6 ipblock named port": np("p", "x", {"podSelector": {}, "egress": [{"to": [{"ipBlock": {"cidr": "fd00:10:244::/60",
        "except": ["fd00:10:244:5::/64"]}}], "ports": [{"port": "serve-80-tcp"}, {"port": 81, "protocol": "UDP"}]}]}),
}  # fmt: skip


def test_each_case_matches_the_model():
    for label, manifest in CASES.items():
        cluster = grid()
        cluster.policies = [manifest]
        try:
            check_all(cluster)
        except AssertionError as err:
            raise AssertionError(f"case {label!r}: {err}") from None


def test_a_pod_reaching_itself_through_a_service_is_never_judged():
    """Hairpin: an isolated pod DNATed back to itself by its Service passes both base chains
    (NetworkPolicy cannot keep a pod from itself); a sibling's translated connection to it,
    an untranslated one, one that did not come from a pod bridge, or one the bridge did not
    mark as come from the pod's own port (a container attached without identity sending with
    the pod's address to its Service) is judged as ever."""
    cluster = grid()
    cluster.policies = [np("deny", "x", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})]
    a, b = cluster.pods[0], cluster.pods[1]  # x/a, x/b: both isolated both ways, both local
    rs = engine_for(cluster, [a.key, b.key], (4, 6)).build()
    for family in (4, 6):
        ip_a, ip_b = a.addr(family), b.addr(family)
        own = compiler.SELF_MARK | 0x4000  # with the Services' masquerade bit beside it
        assert forwarded(rs, Packet(ip_a, ip_a, "tcp", 80, dnat=True, mark=own)), family
        assert not forwarded(rs, Packet(ip_a, ip_a, "tcp", 80, dnat=True)), family  # not from a's port: judged
        assert not forwarded(rs, Packet(ip_a, ip_a, "tcp", 80, dnat=True, mark=0x4000)), family
        assert not forwarded(rs, Packet(ip_b, ip_a, "tcp", 80, dnat=True, mark=own)), family  # a sibling endpoint: judged
        assert not forwarded(rs, Packet(ip_a, ip_b, "tcp", 80, dnat=True, mark=own)), family
        assert not forwarded(rs, Packet(ip_a, ip_a, "tcp", 80, mark=own)), family  # not translated: not a Service's
        assert not forwarded(rs, Packet(ip_a, ip_a, "tcp", 80, iif="eth0", dnat=True, mark=own)), family  # not from a pod bridge
    # Only isolated local pods are in the set (one of another node is its node's business).
    assert rs.objects[(compiler.INET, compiler.TABLE, "set", compiler.SELF)].elements == {(a.ip, a.ip), (b.ip, b.ip)}
    # Bridged back out of its own port (br_netfilter's DNAT path): let through before the isolation drops.
    assert rs.objects[(compiler.BRIDGE, compiler.TABLE, "set", compiler.SELF_PORTS)].elements == {
        ("veth0", a.ip, a.ip), ("veth1", b.ip, b.ip)}
    forward = rs.objects[(compiler.BRIDGE, compiler.TABLE, "chain", "forward")].rules
    hairpin = [i for i, r in enumerate(forward) if "@" + compiler.SELF_PORTS in r or "@" + compiler.SELF_PORTS + "6" in r]
    drops = [i for i, r in enumerate(forward) if '"drop"' in r]
    assert len(hairpin) == 2 and max(hairpin) < min(drops), forward  # one per family


def test_policies_are_a_union():
    cluster = grid()
    cluster.policies = [CASES["pod selector in own ns"], np("q", "x", {"podSelector": {}, "ingress": [{"ports": [{"port": 81}]}]}),
                        CASES["deny all egress"]]  # fmt: skip
    check_all(cluster)


# ------------------------------------------------------------------ random clusters

# Plain draws only (one_of, sampled_from, builds): small label and value alphabets make
# selectors that match some pods and miss others.
_VALUE = st.sampled_from(["a", "b", "c"])
LABELS = st.builds(
    lambda pod, tier: {k: v for k, v in (("pod", pod), ("tier", tier)) if v is not None},
    st.one_of(st.none(), _VALUE), st.one_of(st.none(), _VALUE),
)
SELECTOR = st.one_of(
    st.just({}),
    st.builds(lambda k, v: {"matchLabels": {k: v}}, st.sampled_from(["pod", "tier"]), _VALUE),
    st.builds(
        lambda k, op, v: {"matchExpressions": [{"key": k, "operator": op, **({"values": v} if op in ("In", "NotIn") else {})}]},
        st.sampled_from(["pod", "tier", "team"]), st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist"]),
        st.sampled_from([["a"], ["b", "red"], ["blue", "c"]]),
    ),
)  # fmt: skip
PEER = st.one_of(
    st.builds(lambda s: {"podSelector": s}, SELECTOR),
    st.builds(lambda s: {"namespaceSelector": s}, SELECTOR),
    st.builds(lambda a, b: {"podSelector": a, "namespaceSelector": b}, SELECTOR, SELECTOR),
    st.sampled_from([
        {"ipBlock": {"cidr": "10.244.0.0/16"}},
        {"ipBlock": {"cidr": "10.244.0.0/16", "except": ["10.244.3.3/32", "10.244.5.0/24"]}},
        {"ipBlock": {"cidr": "10.244.0.0/21", "except": ["10.244.2.0/24"]}},
        {"ipBlock": {"cidr": "10.244.3.0/24"}},
        {"ipBlock": {"cidr": "10.244.4.0/22", "except": ["10.244.6.0/24"]}},
        {"ipBlock": {"cidr": "fd00:10:244::/48"}},
        {"ipBlock": {"cidr": "fd00:10:244::/48", "except": ["fd00:10:244:3::4/128", "fd00:10:244:5::/64"]}},
        {"ipBlock": {"cidr": "fd00:10:244::/61", "except": ["fd00:10:244:2::/63"]}},
        {"ipBlock": {"cidr": "fd00:10:244:4::/62", "except": ["fd00:10:244:6::/64"]}},
    ]),
)  # fmt: skip
PORT = st.one_of(
    st.builds(lambda p, proto: {"port": p, "protocol": proto}, st.sampled_from([80, 81]), st.sampled_from(["TCP", "UDP"])),
    st.builds(lambda proto: {"protocol": proto}, st.sampled_from(["TCP", "UDP", "SCTP"])),
    st.just({"port": 79, "endPort": 81}),
    st.builds(lambda n: {"port": n, "protocol": "TCP" if "tcp" in n else "UDP" if "udp" in n else "SCTP"},
              st.sampled_from(["serve-80-tcp", "serve-81-udp", "serve-80-sctp"])),
)  # fmt: skip
RULE = st.builds(
    lambda peers, ports: {k: v for k, v in (("peers", peers), ("ports", ports)) if v is not None},
    st.one_of(st.none(), st.lists(PEER, max_size=2)), st.one_of(st.none(), st.lists(PORT, max_size=2)),
)
POLICY = st.builds(
    lambda ns, sel, ing, egr, types: np("p", ns, {
        "podSelector": sel,
        **({"ingress": [{**({"from": r["peers"]} if "peers" in r else {}), **({"ports": r["ports"]} if "ports" in r else {})} for r in ing]} if ing is not None else {}),
        **({"egress": [{**({"to": r["peers"]} if "peers" in r else {}), **({"ports": r["ports"]} if "ports" in r else {})} for r in egr]} if egr is not None else {}),
        **({"policyTypes": types} if types else {}),
    }),
    st.sampled_from(["x", "y"]), SELECTOR, st.one_of(st.none(), st.lists(RULE, max_size=2)),
    st.one_of(st.none(), st.lists(RULE, max_size=2)),
    st.one_of(st.none(), st.sampled_from([["Ingress"], ["Egress"], ["Ingress", "Egress"]])),
)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(POLICY, max_size=3), st.lists(LABELS, min_size=9, max_size=9), st.sampled_from([{}, {"team": "red"}]))
def test_random_clusters_match_the_model(policies, pod_labels, z_labels):
    cluster = grid()
    for pod, labels in zip(cluster.pods, pod_labels):
        pod.labels = labels
    cluster.namespaces["z"] = z_labels
    cluster.policies = [dict(p, metadata={"name": f"p{i}", "namespace": p["metadata"]["namespace"]}) for i, p in enumerate(policies)]
    check_all(cluster, probes=(("TCP", 80), ("UDP", 81), ("SCTP", 80), ("TCP", 8080), ("UDP", 8081)))


# ------------------------------------------------------------------ structure


def test_a_pod_appearing_changes_set_elements_not_rules():
    cluster = grid()
    cluster.policies = [CASES["ns and pod selector combined"]]
    eng = engine_for(cluster, [p.key for p in cluster.pods[:3]])
    before = eng.build()
    snapshot = Ruleset(before.tables, dict(before.objects))
    eng.upsert_pod(Pod("y", "new", "node3", (ipaddress.IPv4Address("10.244.9.9"),), {"pod": "a"}))
    commands = plan(snapshot, eng.build())
    assert commands and all("element" in next(iter(c.values())) for c in commands), commands
    assert all(c.get("add", {}).get("element", {}).get("elem") == ["10.244.9.9"] for c in commands), commands


def test_relabelling_a_namespace_changes_elements_only():
    cluster = grid()
    cluster.policies = [CASES["namespace selector"]]
    eng = engine_for(cluster, [p.key for p in cluster.pods[:3]])
    before = eng.build()
    snapshot = Ruleset(before.tables, dict(before.objects))
    eng.set_namespace("z", {"team": "red"})
    commands = plan(snapshot, eng.build())
    assert len(commands) == 1 and "add" in commands[0] and "element" in commands[0]["add"], commands
    assert sorted(commands[0]["add"]["element"]["elem"]) == ["10.244.7.8", "10.244.8.9", "10.244.9.10"]


def test_only_policies_selecting_local_pods_are_compiled():
    cluster = grid()
    cluster.policies = [np("for-z", "z", {"podSelector": {}})]
    rs = engine_for(cluster, [p.key for p in cluster.pods[:3]]).build()  # x/a, x/b, x/c
    assert not any(name.startswith("np-") for (_, _, _, name) in rs.objects), sorted(rs.objects)


def test_no_change_is_an_empty_plan_and_adoption_rewrites_in_one_transaction():
    cluster = grid()
    cluster.policies = [CASES["ipblock with except"], CASES["named port ingress"]]
    eng = engine_for(cluster, [p.key for p in cluster.pods[:3]])
    rs = eng.build()
    assert plan(Ruleset(rs.tables, dict(rs.objects)), eng.build()) == []
    # A restart: the same objects found in the kernel, contents unknown.
    from agentd.nft.ruleset import unknown_contents

    adopted = Ruleset(rs.tables, unknown_contents(rs.objects))
    commands = plan(adopted, rs)
    verbs = {next(iter(c)) for c in commands}
    assert "delete" not in verbs, "adoption must not delete anything that is still wanted"
    flushed = {next(iter(c["flush"].values()))["name"] for c in commands if "flush" in c}
    assert {c.name for c in rs.chains()} <= flushed  # every chain refilled ...
    assert not any("table" in c.get("add", {}) for c in commands)  # ... inside the existing tables


def test_plan_deletes_chains_after_their_jumps_and_sets_last():
    cluster = grid()
    cluster.policies = [CASES["pod selector in own ns"]]
    eng = engine_for(cluster, [p.key for p in cluster.pods[:3]])
    before = eng.build()
    snapshot = Ruleset(before.tables, dict(before.objects))
    eng.remove_policy(("x", "p"))
    commands = plan(snapshot, eng.build())
    kinds_in_order = [(next(iter(c)), next(iter(next(iter(c.values()))))) for c in commands]
    first_chain_delete = kinds_in_order.index(("delete", "chain"))
    assert ("delete", "element") in kinds_in_order[:first_chain_delete]  # the vmap entry goes first
    last_chain_delete = max(i for i, k in enumerate(kinds_in_order) if k == ("delete", "chain"))
    rest = kinds_in_order[last_chain_delete + 1 :]
    assert ("delete", "set") in rest and ("delete", "counter") in rest  # what chains used goes last
    assert all(k[0] == "delete" for k in rest)


def test_plan_deletes_a_verdict_map_before_the_chains_its_elements_jump_to():
    """A dual-stack node's tables rewritten for IPv4 only (an agent restarted with another
    ``ip_family`` adopts them): the map ``na-ports`` and the ``na/<port>`` chains its elements
    jump to both go; the kernel refuses (EBUSY) a chain an element still jumps to."""
    cluster = grid()
    before = engine_for(cluster, ["x/a"], (4, 6)).build()
    commands = plan(Ruleset(before.tables, dict(before.objects)), engine_for(cluster, ["x/a"], (4,)).build())
    deleted = [next(iter(c["delete"].values()))["name"] for c in commands if "delete" in c and "element" not in c["delete"]]
    assert "na-ports" in deleted and "na/veth0" in deleted
    assert deleted.index("na-ports") < deleted.index("na/veth0"), deleted


def test_leave_plan_deletes_the_tables():
    cluster = grid()
    cluster.policies = [CASES["deny all ingress"]]
    rs = engine_for(cluster, [p.key for p in cluster.pods[:3]]).build()
    commands = plan(rs, Ruleset())
    assert commands == [{"delete": {"table": {"family": f, "name": t}}} for f, t in sorted(compiler.TABLES)]


def test_long_names_are_hashed_within_nft_limits():
    name = "p" + "x" * 250
    chain = compiler.policy_chain("in", Policy("ns", name, None, (), None))  # type: ignore[arg-type]
    assert len(chain) <= expr.NAME_MAX and chain.startswith("np-in/#")


def test_view_lists_policies_and_allow_lists():
    cluster = grid()
    cluster.policies = [CASES["ns and pod selector combined"], CASES["deny all egress"]]
    eng = engine_for(cluster, [p.key for p in cluster.pods[:3]])
    eng.build()
    view = pod_view(eng, ("x", "a"))
    assert view["policies"] == ["x/deny", "x/p"]
    assert view["isolated"] == {"ingress": True, "egress": True}
    assert view["egress"] == []  # deny: no egress rule at all
    (rule,) = view["ingress"]
    assert rule["policy"] == "x/p" and rule["ports"] == "all"
    assert rule["peer_addresses"] == ["10.244.1.2", "10.244.3.4", "10.244.4.5", "10.244.6.7"]


def test_conntrack_only_while_a_local_pod_is_isolated():
    def ct_rules(rs):
        return [r for c in rs.chains() if c.hook is not None for r in c.rules if '"ct"' in r]

    cluster = grid()
    eng = engine_for(cluster, [p.key for p in cluster.pods[:3]])
    assert ct_rules(eng.build()) == []  # nothing isolated: the kernel tracks nothing for policy
    eng.upsert_policy(Policy.parse(kinds.validate(CASES["deny all ingress"])))
    assert len(ct_rules(eng.build())) == 4  # egress and ingress base chains: established, and hairpin to self
    eng.remove_policy(("x", "deny"))
    assert ct_rules(eng.build()) == []


# ------------------------------------------------------------------ IPv6 and dual-stack


def test_ipv4_only_tables_hold_nothing_of_ipv6():
    """A cluster without IPv6: pods' IPv6 addresses are ignored and no IPv6 object exists."""
    cluster = grid()
    cluster.policies = [CASES["ns and pod selector combined"], CASES["named port ingress"], CASES["ipv6 ipblock with except"]]
    rs = engine_for(cluster, [p.key for p in cluster.pods[:3]]).build()
    assert not [s.name for s in rs.sets() if any("ipv6" in t for t in s.type)]
    assert not [r for c in rs.chains() for r in c.rules if '"protocol":"ip6"' in r]
    assert not [e for s in rs.sets() for e in s.elements if ":" in str(e[0] if isinstance(e, tuple) else e)]


def test_a_dual_stack_pod_appearing_changes_elements_of_both_families_only():
    cluster = grid()
    cluster.policies = [CASES["ns and pod selector combined"]]
    eng = engine_for(cluster, [p.key for p in cluster.pods[:3]], (4, 6))
    before = eng.build()
    snapshot = Ruleset(before.tables, dict(before.objects))
    eng.upsert_pod(Pod("y", "new", "node3", (ipaddress.ip_address("10.244.9.9"), ipaddress.ip_address("fd00:10:244:9::9")),
                       {"pod": "a"}))  # fmt: skip
    commands = plan(snapshot, eng.build())
    assert {(c["add"]["element"]["name"], tuple(c["add"]["element"]["elem"])) for c in commands} == {
        ("np-in/x/p/0/pods", ("10.244.9.9",)), ("np-in/x/p/0/pods6", ("fd00:10:244:9::9",))}


def test_a_local_dual_stack_pod_is_in_the_bridge_sets_of_both_families():
    cluster = grid()
    cluster.policies = [CASES["deny all ingress"]]
    rs = engine_for(cluster, ["x/a"], (4, 6)).build()
    sets = {s.name: s.elements for s in rs.sets() if s.family == compiler.BRIDGE}
    assert sets["pod-addrs"] == {("veth0", "10.244.1.2")} and sets["pod-addrs6"] == {("veth0", "fd00:10:244:1::2")}
    assert sets["isolated-addrs"] == {"10.244.1.2"} and sets["isolated-addrs6"] == {"fd00:10:244:1::2"}
    inet = {s.name: s.elements for s in rs.sets() if s.family == compiler.INET}
    assert inet["ingress-pods6"] == {("fd00:10:244:1::2", ("jump", "pod-in/x/a"))}
    # Neighbour discovery goes before any pod's verdict, in both base chains.
    for name in ("egress", "ingress"):
        chain = rs.objects[(compiler.INET, compiler.TABLE, "chain", name)]
        assert "nd-neighbor-solicit" in chain.rules[1], chain.rules  # after ct state established


def test_a_view_lists_both_addresses():
    cluster = grid()
    cluster.policies = [CASES["pod selector in own ns"]]
    eng = engine_for(cluster, [p.key for p in cluster.pods[:3]], (4, 6))
    eng.build()
    view = pod_view(eng, ("x", "a"))
    assert view["ip"] == "10.244.1.2" and view["ips"] == ["10.244.1.2", "fd00:10:244:1::2"]
    (rule,) = view["ingress"]
    assert rule["peer_addresses"] == ["10.244.2.3", "fd00:10:244:2::3"]


# ------------------------------------------------------------------ one address, two local pods


def _local(ns: str, name: str, ip: str, labels: dict[str, str], i: int, since: int) -> tuple[Pod, LocalPort]:
    pod = Pod(ns, name, NODE, (ipaddress.ip_address(ip),), labels, ())
    return pod, LocalPort(f"veth{i}", f"02:00:00:00:00:{i:02x}", "cni0", since)


def _maps(rs: Ruleset) -> dict[str, set[Any]]:
    return {s.name: set(s.elements) for s in rs.sets()
            if s.name in ("ingress-pods", "egress-pods", "addr-macs", "pod-addrs", "pod-ports", "isolated-addrs")}  # fmt: skip


def test_an_address_two_local_pods_claim_goes_to_the_newer_endpoint_file():
    """A stale endpoint file (its pod deleted, its address handed to a new pod) must not put a
    second element with the same key into the address maps: the kernel refuses the clash and
    the node's policy sync fails for ever.  The newer file's pod has the address; the other is
    a conflict, its port checked for spoofing with no address of its own."""
    eng = PolicyEngine(NODE)
    old, old_port = _local("a", "gone", "10.0.0.5", {"app": "x"}, 1, since=100)
    new, new_port = _local("a", "fresh", "10.0.0.5", {"app": "y"}, 2, since=200)
    eng.upsert_pod(new, new_port)
    eng.upsert_pod(old, old_port)  # arrival order does not decide
    eng.upsert_policy(Policy.parse(kinds.validate(np("deny", "a", {"podSelector": {}}))))
    eng.upsert_policy(Policy.parse(kinds.validate(np("from-x", "b", {
        "podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "x"}}}]}]}))))
    eng.upsert_pod(*_local("b", "server", "10.0.0.9", {}, 3, since=50))
    rs = eng.build()
    maps = _maps(rs)
    assert maps["ingress-pods"] == {("10.0.0.5", ("jump", "pod-in/a/fresh")), ("10.0.0.9", ("jump", "pod-in/b/server"))}
    assert maps["addr-macs"] == {("10.0.0.5", "02:00:00:00:00:02"), ("10.0.0.9", "02:00:00:00:00:03")}
    assert maps["pod-addrs"] == {("veth2", "10.0.0.5"), ("veth3", "10.0.0.9")}
    assert maps["pod-ports"] == {"veth1", "veth2", "veth3"}
    # The stale pod (app=x) is no peer: its address is the new pod's (app=y).
    assert not forwarded(rs, Packet("10.0.0.5", "10.0.0.9", compiler.l4proto("TCP"), 80))
    assert eng.conflicts() == {ipaddress.ip_address("10.0.0.5"): (("a", "fresh"), [("a", "gone")])}
    # The newer pod goes: the older one has its address again, as a fresh engine would say.
    eng.remove_pod(("a", "fresh"))
    rs = eng.build()
    assert _maps(rs)["ingress-pods"] == {("10.0.0.5", ("jump", "pod-in/a/gone")), ("10.0.0.9", ("jump", "pod-in/b/server"))}
    assert forwarded(rs, Packet("10.0.0.5", "10.0.0.9", compiler.l4proto("TCP"), 80))
    assert eng.conflicts() == {}


def test_equal_endpoint_file_times_are_decided_by_pod_name():
    eng = PolicyEngine(NODE)
    eng.upsert_pod(*_local("a", "q", "10.0.0.5", {}, 2, since=7))
    eng.upsert_pod(*_local("a", "p", "10.0.0.5", {}, 1, since=7))
    assert eng.conflicts() == {ipaddress.ip_address("10.0.0.5"): (("a", "q"), [("a", "p")])}
    assert _maps(eng.build())["addr-macs"] == {("10.0.0.5", "02:00:00:00:00:02")}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 6), st.sampled_from("pqrs"), st.integers(0, 2), st.booleans(), st.integers(0, 3),
                          st.sampled_from([{}, {"app": "x"}, {"app": "y"}])), max_size=30))  # fmt: skip
@example([(1, "p", 0, True, 1, {}), (2, "q", 0, True, 2, {}), (6, "p", 0, True, 3, {})])  # the owner flips by time alone
def test_incremental_builds_equal_a_fresh_engine_with_address_conflicts(steps):
    """Pods come, go, move and clash over addresses (local and remote), and a local pod's
    endpoint file alone changes time (the Pod the same: which pod has an address may flip):
    after every step the incrementally kept ruleset is the one a fresh engine builds from the
    same state."""
    policies = [
        np("deny", "a", {"podSelector": {}}),
        np("from-x", "a", {"podSelector": {"matchLabels": {"app": "y"}},
                           "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "x"}}}], "ports": [{"port": "http"}]}]}),
        np("to-http", "a", {"podSelector": {"matchLabels": {"app": "x"}},
                            "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/24"}}], "ports": [{"port": "http"}]}]}),
    ]  # fmt: skip
    # A client to-http always selects (laid out from the start): an address flipping owner
    # between two pods it does not select changes its named ports alone.
    client = Pod("a", "client", NODE, (ipaddress.ip_address("10.0.1.1"),), {"app": "x"}, ())
    state: dict[Any, tuple[Pod, LocalPort | None]] = {client.key: (client, LocalPort("vethc", "02:00:00:00:00:0c", "cni0", 0))}
    eng = PolicyEngine(NODE)
    eng.upsert_pod(*state[client.key])
    for manifest in policies:
        eng.upsert_policy(Policy.parse(kinds.validate(manifest)))
    for op, name, ip, local, since, labels in steps:
        key = ("a", name)
        if op == 0:
            state.pop(key, None)
            eng.remove_pod(key)
        elif op == 6:
            if key in state and state[key][1] is not None:
                pod, port = state[key][0], dataclasses.replace(state[key][1], since=since)  # type: ignore[arg-type]
                state[key] = (pod, port)
                eng.upsert_pod(pod, port)
        else:
            pod = Pod("a", name, NODE if local else "node2", (ipaddress.ip_address(f"10.0.0.{ip + 1}"),), labels,
                      (NamedPort("http", 80 + op % 2, "TCP"),))
            port = LocalPort(f"veth{name}", "02:00:00:00:00:01", "cni0", since) if local else None
            state[key] = (pod, port)
            eng.upsert_pod(pod, port)
        fresh = PolicyEngine(NODE)
        for pod, port in state.values():
            fresh.upsert_pod(pod, port)
        for manifest in policies:
            fresh.upsert_policy(Policy.parse(kinds.validate(manifest)))
        # (the bridges set keeps every bridge a local pod was ever on: by design, not compared)
        got, want = (dict(e.build().objects) for e in (eng, fresh))
        bridges = (compiler.INET, compiler.TABLE, "set", "bridges")
        got.pop(bridges, None), want.pop(bridges, None)
        assert got == want
        assert eng.conflicts() == fresh.conflicts()


# ------------------------------------------------------------------ a policy too large to program


def test_a_policy_too_large_to_program_allows_nothing_and_the_others_stay():
    # ::/0 minus 64 /128s (as many excepts as validation takes) is ~7,800 prefixes; on two
    # port matches (TCP and UDP) that is more rules than compiler.MAX_POLICY_RULES.
    wide = {"cidr": "::/0", "except": [f"2001:{i:x}::1/128" for i in range(64)]}
    big = np("big", "x", {"podSelector": {}, "ingress": [{"from": [{"ipBlock": wide}],
                                                          "ports": [{"port": 80}, {"port": 81, "protocol": "UDP"}]}]})
    small = np("small", "x", {"podSelector": {}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}]}]})
    cluster = grid()
    cluster.policies = [big, small]
    a, b, ya = cluster.pods[0], cluster.pods[1], cluster.pods[3]  # x/a, x/b, y/a
    eng = engine_for(cluster, [a.key], families=(4, 6))
    rs = eng.build()
    assert list(eng.too_large) == [("x", "big")]
    assert eng.too_large[("x", "big")].startswith(
        f"policy x/big not programmed: its ingress rules need more than {compiler.MAX_POLICY_RULES} nftables rules"
    )
    assert rs.objects[(compiler.INET, compiler.TABLE, "chain", "np-in/x/big")].rules == ()  # type: ignore[union-attr]
    tcp = compiler.l4proto("TCP")
    assert forwarded(rs, Packet(b.addr(6), a.addr(6), tcp, 80))  # the other policy is programmed
    assert not forwarded(rs, Packet(ya.addr(6), a.addr(6), tcp, 80))  # big would allow it: isolated, nothing allowed
    # Made smaller, it is programmed (and forgotten as too large).
    eng.upsert_policy(Policy.parse(kinds.validate(np("big", "x", {**big["spec"], "ingress": [
        {"from": [{"ipBlock": {**wide, "except": wide["except"][:8]}}], "ports": [{"port": 80}]}]}))))
    rs = eng.build()
    assert eng.too_large == {}
    assert forwarded(rs, Packet(ya.addr(6), a.addr(6), tcp, 80))
    assert not forwarded(rs, Packet(ya.addr(6), a.addr(6), compiler.l4proto("UDP"), 81))


def test_the_allow_list_of_a_policy_too_large_to_program_says_it_is_not_programmed():
    """The pod page listed a policy refused as too large (empty chain: it allows nothing) as
    allowing what its rules say: its entries now say "programmed": false; the others none."""
    wide = {"cidr": "::/0", "except": [f"2001:{i:x}::1/128" for i in range(64)]}
    big = np("big", "x", {"podSelector": {}, "ingress": [{"from": [{"ipBlock": wide}],
                                                          "ports": [{"port": 80}, {"port": 81, "protocol": "UDP"}]}]})
    small = np("small", "x", {"podSelector": {}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}]}]})
    cluster = grid()
    cluster.policies = [big, small]
    a = cluster.pods[0]
    eng = engine_for(cluster, [a.key], families=(4, 6))
    eng.build()
    assert list(eng.too_large) == [("x", "big")]
    view = pod_view(eng, ("x", "a"))
    assert [(r["policy"], r.get("programmed")) for r in view["ingress"]] == [("x/big", False), ("x/small", None)]
    eng.upsert_policy(Policy.parse(kinds.validate(np("big", "x", {**big["spec"], "ingress": [
        {"from": [{"ipBlock": {**wide, "except": wide["except"][:8]}}], "ports": [{"port": 80}]}]}))))
    eng.build()  # made smaller: programmed, and said so no longer
    assert [r.get("programmed") for r in pod_view(eng, ("x", "a"))["ingress"]] == [None, None]


def test_many_ipblocks_are_refused_before_collapsing_them_all(monkeypatch):
    monkeypatch.setattr(compiler, "RAW_PREFIXES_MAX", 100)
    blocks = [{"ipBlock": {"cidr": "10.0.0.0/8", "except": [f"10.{i}.0.1/32"]}} for i in range(10)]  # 24 prefixes each
    cluster = grid()
    cluster.policies = [np("many", "x", {"podSelector": {}, "ingress": [{"from": blocks}]})]
    eng = engine_for(cluster, [cluster.pods[0].key])
    eng.build()
    assert "(120 ipBlock prefixes or more at ingress[0]" in eng.too_large[("x", "many")]


def test_the_agent_logs_a_policy_too_large_once(caplog):
    from types import SimpleNamespace

    from agentd.policy.agent import PolicyAgent

    agent = PolicyAgent.__new__(PolicyAgent)  # only the reporting: no etcd, no nftables
    agent.engine = SimpleNamespace(too_large={("x", "big"): "policy x/big not programmed: ..."})  # type: ignore[assignment]
    agent._too_large = {}
    with caplog.at_level("ERROR", logger="agentd.policy"):
        agent._report_too_large()
        agent._report_too_large()
    assert [r.getMessage() for r in caplog.records] == ["policy x/big not programmed: ..."]


def test_an_ipblock_written_with_leading_zeros_is_compiled_as_validated():
    """010.244.4.0/22 is 10.244.4.0/22 to the API server (and to validation): the engine
    compiles it so, rather than failing on what it stored."""
    cluster = grid()
    cluster.policies = [np("p", "x", {"podSelector": {}, "ingress": [{"from": [
        {"ipBlock": {"cidr": "010.244.4.0/22", "except": ["010.244.006.000/24"]}}]}]})]  # fmt: skip
    written = grid()
    written.policies = [np("p", "x", {"podSelector": {}, "ingress": [{"from": [
        {"ipBlock": {"cidr": "10.244.4.0/22", "except": ["10.244.6.0/24"]}}]}]})]  # fmt: skip
    check_all(written)
    check_all(cluster)


# ------------------------------------------------------------------ a pod changing but still matched


def _pod(ns: str, name: str, ip: str, labels: dict[str, str], node: str = "node2", ports=()) -> Pod:
    return Pod(ns, name, node, (ipaddress.ip_address(ip),), labels, tuple(NamedPort(*p) for p in ports))


def test_a_peer_recreated_with_a_new_address_is_allowed_there_and_no_longer_at_the_old_one():
    """The peer still matches (same name, same labels) but its address changed: the policy's
    pods set follows (a match that stays a match is still a change when its record is)."""
    eng = PolicyEngine(NODE)
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {"app": "srv"}, NODE), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    eng.upsert_pod(_pod("x", "cli", "10.0.1.1", {"role": "client"}))
    eng.upsert_policy(Policy.parse(kinds.validate(np("p", "x", {"podSelector": {"matchLabels": {"app": "srv"}},
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}]}]}))))  # fmt: skip
    assert forwarded(eng.build(), Packet("10.0.1.1", "10.0.0.1", "tcp", 80))
    eng.upsert_pod(_pod("x", "cli", "10.0.1.2", {"role": "client"}))  # re-created under its name
    rs = eng.build()
    assert forwarded(rs, Packet("10.0.1.2", "10.0.0.1", "tcp", 80))
    assert not forwarded(rs, Packet("10.0.1.1", "10.0.0.1", "tcp", 80))


def test_an_egress_peer_renumbering_its_named_port_is_reached_on_the_new_number():
    eng = PolicyEngine(NODE)
    eng.upsert_pod(_pod("x", "cli", "10.0.0.1", {"app": "cli"}, NODE), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    eng.upsert_pod(_pod("x", "web", "10.0.1.1", {"app": "web"}, ports=[("http", 80, "TCP")]))
    eng.upsert_policy(Policy.parse(kinds.validate(np("p", "x", {"podSelector": {"matchLabels": {"app": "cli"}},
        "policyTypes": ["Egress"],
        "egress": [{"to": [{"podSelector": {"matchLabels": {"app": "web"}}}], "ports": [{"port": "http"}]}]}))))  # fmt: skip
    assert forwarded(eng.build(), Packet("10.0.0.1", "10.0.1.1", "tcp", 80))
    eng.upsert_pod(_pod("x", "web", "10.0.1.1", {"app": "web"}, ports=[("http", 8080, "TCP")]))  # only the port changed
    rs = eng.build()
    assert forwarded(rs, Packet("10.0.0.1", "10.0.1.1", "tcp", 8080))
    assert not forwarded(rs, Packet("10.0.0.1", "10.0.1.1", "tcp", 80))


def _named_sets(rs: Ruleset) -> dict[str, set[Any]]:
    return {s.name: set(s.elements) for s in rs.sets() if s.name.endswith("/named")}


def _fresh_named(pods: list[tuple[Pod, LocalPort | None]], policy: Policy) -> dict[str, set[Any]]:
    fresh = PolicyEngine(NODE)
    for pod, port in pods:
        fresh.upsert_pod(pod, port)
    fresh.upsert_policy(policy)
    return _named_sets(fresh.build())


def test_an_egress_named_port_toward_every_peer_follows_a_peer_renumbering_it():
    """A rule with named ports and no ``to`` resolves them on every pod of the cluster: a remote
    pod renumbering its port (no selector of the policy to notice) is reached on the new number
    (review r9 item 4)."""
    policy = Policy.parse(kinds.validate(np("p", "a", {"podSelector": {}, "policyTypes": ["Egress"],
                                                       "egress": [{"ports": [{"port": "http"}]}]})))  # fmt: skip
    src = (_pod("a", "src", "10.0.0.1", {}, NODE), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    dst = [(_pod("b", "dst", "10.0.1.1", {}, ports=[("http", n, "TCP")]), None) for n in (80, 8080)]
    eng = PolicyEngine(NODE)
    eng.upsert_policy(policy)
    for pod, port in (src, dst[0]):
        eng.upsert_pod(pod, port)
    assert forwarded(eng.build(), Packet("10.0.0.1", "10.0.1.1", "tcp", 80))
    eng.upsert_pod(*dst[1])
    rs = eng.build()
    assert _named_sets(rs) == _fresh_named([src, dst[1]], policy) == {"np-out/a/p/0/named": {("10.0.1.1", "tcp", 8080)}}
    assert forwarded(rs, Packet("10.0.0.1", "10.0.1.1", "tcp", 8080))
    assert not forwarded(rs, Packet("10.0.0.1", "10.0.1.1", "tcp", 80))


def test_an_address_changing_owner_by_endpoint_file_time_alone_moves_its_named_ports():
    """Two local pods claim 10.0.0.5 with other numbers for "http"; only an endpoint file's time
    changes and the address is the other pod's: an egress named port toward an ipBlock holding
    it resolves on the new owner (review r9 item 5)."""
    policy = Policy.parse(kinds.validate(np("q", "a", {"podSelector": {"matchLabels": {"r": "c"}}, "policyTypes": ["Egress"],
        "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/24"}}], "ports": [{"port": "http"}]}]})))  # fmt: skip
    c = (_pod("a", "c", "10.0.0.9", {"r": "c"}, NODE), LocalPort("veth9", "02:00:00:00:00:09", "cni0", 1))

    def x(since: int) -> tuple[Pod, LocalPort]:
        return _pod("a", "x", "10.0.0.5", {}, NODE, [("http", 80, "TCP")]), LocalPort("vethx", "02:00:00:00:00:0a", "cni0", since)

    def y(since: int) -> tuple[Pod, LocalPort]:
        return _pod("a", "y", "10.0.0.5", {}, NODE, [("http", 81, "TCP")]), LocalPort("vethy", "02:00:00:00:00:0b", "cni0", since)

    eng = PolicyEngine(NODE)
    eng.upsert_policy(policy)
    for pod, port in (c, x(1), y(2)):
        eng.upsert_pod(pod, port)
    assert _named_sets(eng.build()) == {"np-out/a/q/0/named": {("10.0.0.5", "tcp", 81)}}
    eng.upsert_pod(*x(3))  # the same Pod, a newer endpoint file: x has the address now
    rs = eng.build()
    assert _named_sets(rs) == _fresh_named([c, x(3), y(2)], policy) == {"np-out/a/q/0/named": {("10.0.0.5", "tcp", 80)}}
    assert forwarded(rs, Packet("10.0.0.9", "10.0.0.5", "tcp", 80))
    assert not forwarded(rs, Packet("10.0.0.9", "10.0.0.5", "tcp", 81))


def test_a_pod_relabelled_where_no_selector_looks_compiles_nothing_again():
    """Egress named ports toward every peer or an ipBlock resolve on any pod's addresses and
    ports, not its labels: a remote pod taking a label no selector reads leaves every policy
    as built (each such policy's named sets were filled again, scanning every pod: review r9
    item 2).  A label that changes a selector's members still does."""
    eng = PolicyEngine(NODE)
    eng.upsert_pod(_pod("x", "cli", "10.0.0.1", {"app": "cli"}, NODE), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    eng.upsert_pod(_pod("y", "web", "10.0.1.1", {"app": "web"}, ports=[("http", 80, "TCP")]))
    eng.upsert_policy(Policy.parse(kinds.validate(np("all", "x", {"podSelector": {}, "policyTypes": ["Egress"],
                                                                  "egress": [{"ports": [{"port": "http"}]}]}))))  # fmt: skip
    eng.upsert_policy(Policy.parse(kinds.validate(np("mixed", "x", {"podSelector": {}, "policyTypes": ["Egress"], "egress": [
        {"to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}, {"namespaceSelector": {}, "podSelector": {"matchLabels": {"role": "db"}}}],
         "ports": [{"port": "http"}]}]}))))  # fmt: skip
    eng.build()
    assert eng._all_pods_refs == {("x", "all"), ("x", "mixed")}
    eng.upsert_pod(_pod("y", "web", "10.0.1.1", {"app": "web", "unread": "yes"}, ports=[("http", 80, "TCP")]))
    assert eng._dirty_policies == set()
    eng.upsert_pod(_pod("y", "web", "10.0.1.1", {"app": "web", "role": "db"}, ports=[("http", 80, "TCP")]))
    assert eng._dirty_policies == {("x", "mixed")}
    rs = eng.build()
    assert _named_sets(rs)["np-out/x/mixed/0/named"] == {("10.0.1.1", "tcp", 80)}
    assert forwarded(rs, Packet("10.0.0.1", "10.0.1.1", "tcp", 80))


def test_a_selected_local_pod_renumbering_its_named_port_is_reached_on_the_new_number():
    """Same labels, so the same policies select it: the policy's ingress named ports
    (resolved on the selected pods) are compiled again all the same."""
    eng = PolicyEngine(NODE)
    port = LocalPort("veth0", "02:00:00:00:00:01", "cni0")
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {"app": "srv"}, NODE, [("http", 80, "TCP")]), port)
    eng.upsert_policy(Policy.parse(kinds.validate(np("p", "x", {"podSelector": {"matchLabels": {"app": "srv"}},
        "ingress": [{"ports": [{"port": "http"}]}]}))))  # fmt: skip
    assert forwarded(eng.build(), Packet("10.0.1.1", "10.0.0.1", "tcp", 80))
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {"app": "srv"}, NODE, [("http", 8080, "TCP")]), port)
    rs = eng.build()
    assert forwarded(rs, Packet("10.0.1.1", "10.0.0.1", "tcp", 8080))
    assert not forwarded(rs, Packet("10.0.1.1", "10.0.0.1", "tcp", 80))


def test_a_selected_local_pod_changing_address_is_reached_at_the_new_one():
    eng = PolicyEngine(NODE)
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {"app": "srv"}, NODE, [("http", 80, "TCP")]),
                   LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    eng.upsert_policy(Policy.parse(kinds.validate(np("p", "x", {"podSelector": {"matchLabels": {"app": "srv"}},
        "ingress": [{"ports": [{"port": "http"}]}]}))))  # fmt: skip
    assert forwarded(eng.build(), Packet("10.0.1.1", "10.0.0.1", "tcp", 80))
    eng.upsert_pod(_pod("x", "srv", "10.0.0.5", {"app": "srv"}, NODE, [("http", 80, "TCP")]),
                   LocalPort("veth0", "02:00:00:00:00:01", "cni0"))  # still selected, a new address
    rs = eng.build()
    assert forwarded(rs, Packet("10.0.1.1", "10.0.0.5", "tcp", 80))
    # (the old address is no pod's now, judged by nobody: the named ports set no longer holds it)
    assert [s.elements for s in rs.sets() if s.name.endswith("/named")] == [{("10.0.0.5", "tcp", 80)}]


# ------------------------------------------------------------------ incremental = fresh, at random

_LABELS = [{}, {"a": "1"}, {"a": "2"}, {"a": "1", "b": "x"}, {"b": "x"}]
_NS_LABELS = [{}, {"t": "r"}, {"t": "b"}]
_PORTS = [(), (("http", 80, "TCP"),), (("http", 8080, "TCP"), ("dns", 53, "UDP")), (("http", 81, "UDP"),)]
_SELECTORS = [{}, {"matchLabels": {"a": "1"}}, {"matchExpressions": [{"key": "b", "operator": "Exists"}]},
              {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["2"]}]}]  # fmt: skip
_NS_SELECTORS = [{}, {"matchLabels": {"t": "r"}}, {"matchExpressions": [{"key": "t", "operator": "DoesNotExist"}]}]
_BLOCKS = [{"cidr": "10.1.0.0/16", "except": ["10.1.2.0/24"]}, {"cidr": "fd00::/16"}, {"cidr": "0.0.0.0/0"}]
_RULE_PORTS = [None, [{"port": "http"}], [{"port": "dns", "protocol": "UDP"}, {"port": 80}], [{"port": 80, "endPort": 90}],
               [{"protocol": "SCTP"}]]  # fmt: skip
_peer = st.one_of(
    st.builds(lambda p: {"podSelector": p}, st.sampled_from(_SELECTORS)),
    st.builds(lambda n: {"namespaceSelector": n}, st.sampled_from(_NS_SELECTORS)),
    st.builds(lambda n, p: {"namespaceSelector": n, "podSelector": p}, st.sampled_from(_NS_SELECTORS), st.sampled_from(_SELECTORS)),
    st.builds(lambda b: {"ipBlock": b}, st.sampled_from(_BLOCKS)),
)


def _rule(field: str) -> Any:
    return st.builds(lambda peers, ports: {**({field: peers} if peers else {}), **({"ports": ports} if ports else {})},
                     st.one_of(st.none(), st.lists(_peer, min_size=1, max_size=2)), st.sampled_from(_RULE_PORTS))  # fmt: skip


_policy_spec = st.builds(
    lambda sel, ingress, egress, types: {"podSelector": sel, **({"ingress": ingress} if ingress is not None else {}),
                                         **({"egress": egress} if egress is not None else {}),
                                         **({"policyTypes": types} if types else {})},
    st.sampled_from(_SELECTORS), st.one_of(st.none(), st.lists(_rule("from"), max_size=2)),
    st.one_of(st.none(), st.lists(_rule("to"), max_size=2)),
    st.sampled_from([None, ["Ingress"], ["Egress"], ["Ingress", "Egress"]]),
)  # fmt: skip
_op = st.one_of(
    st.tuples(st.just("ns"), st.sampled_from("xyz"), st.sampled_from(_NS_LABELS)),
    st.tuples(st.just("pod"), st.integers(0, 7), st.integers(0, 1), st.integers(1, 2), st.integers(1, 2),
              st.sampled_from(_LABELS), st.sampled_from(_PORTS), st.integers(0, 2)),
    st.tuples(st.just("rmpod"), st.integers(0, 7)),
    st.tuples(st.just("pol"), st.sampled_from(["p1", "p2", "p3"]), st.sampled_from("xy"), _policy_spec),
    st.tuples(st.just("rmpol"), st.sampled_from(["p1", "p2", "p3"]), st.sampled_from("xy")),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(_op, max_size=30))
def test_incremental_builds_equal_a_fresh_engine(ops):
    """Namespaces relabelled, pods of this node and others coming, going, changing labels,
    addresses, named ports and endpoint files, policies of every kind replaced and removed:
    after every step the incrementally kept ruleset is the one a fresh engine builds from
    the same state (dual-stack)."""
    families = (4, 6)
    state: dict[str, dict[Any, Any]] = {"ns": {}, "pods": {}, "pol": {}}
    eng = PolicyEngine(NODE, families=families)
    for op in ops:
        if op[0] == "ns":
            _, ns, labels = op
            eng.set_namespace(ns, labels)
            state["ns"][ns] = labels
        elif op[0] == "pod":
            _, i, shift, host, count, labels, ports, since = op
            j = (i + shift) % 4 if i < 4 else i  # local pods may take each other's addresses
            ips = [f"10.1.{j}.{host}", f"fd00::{j}:{host}"][:count]
            local = i < 4
            pod = Pod("xyz"[i % 3], f"p{i}", NODE if local else "n2", tuple(map(ipaddress.ip_address, ips)), labels,
                      tuple(NamedPort(*p) for p in ports))  # fmt: skip
            port = LocalPort(f"veth{i}", f"02:00:00:00:00:{i:02x}", "cni0", since=since) if local else None
            eng.upsert_pod(pod, port)
            state["pods"][pod.key] = (pod, port)
        elif op[0] == "rmpod":
            key = ("xyz"[op[1] % 3], f"p{op[1]}")
            eng.remove_pod(key)
            state["pods"].pop(key, None)
        elif op[0] == "pol":
            _, name, ns, spec = op
            policy = Policy.parse(kinds.validate(np(name, ns, spec)))
            eng.upsert_policy(policy)
            state["pol"][policy.key] = policy
        else:
            eng.remove_policy((op[2], op[1]))
            state["pol"].pop((op[2], op[1]), None)
        fresh = PolicyEngine(NODE, families=families)
        for ns, labels in state["ns"].items():
            fresh.set_namespace(ns, labels)
        for pod, port in state["pods"].values():
            fresh.upsert_pod(pod, port)
        for policy in state["pol"].values():
            fresh.upsert_policy(policy)
        # (the bridges set keeps every bridge a local pod was ever on: by design, not compared)
        got, want = (dict(e.build().objects) for e in (eng, fresh))
        bridges = (compiler.INET, compiler.TABLE, "set", "bridges")
        got.pop(bridges, None), want.pop(bridges, None)
        assert got == want
        assert eng.too_large == fresh.too_large


# ------------------------------------------------------------------ a policy's size, bounded


def _crowd(eng: PolicyEngine, count: int, ns: str = "y", labels: dict[str, str] | None = None) -> None:
    for i in range(count):
        eng.upsert_pod(_pod(ns, f"p{i}", f"10.{1 + i // 65536}.{(i // 256) % 256}.{i % 256}", dict(labels or {})))


def _count_calls(monkeypatch, owner: Any, name: str) -> list[Any]:
    calls: list[Any] = []
    real = getattr(owner, name, None)

    def spy(*args, **kw):
        calls.append(args)
        return real(*args, **kw)  # type: ignore[misc]

    monkeypatch.setattr(owner, name, spy, raising=False)
    return calls


def test_rules_with_one_selector_share_its_set(monkeypatch):
    """2,000 rules of one peer selector (each its own port), 3,000 pods it matches: one set of
    their addresses, read by every rule, worked out once -- not 2,000 sets of 3,000 (6 million
    elements, 900 MiB and 20 s a build, at every pod change)."""
    eng = PolicyEngine(NODE)
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {}, NODE), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    _crowd(eng, 3000)
    rules = [{"from": [{"namespaceSelector": {}}], "ports": [{"port": 1 + i}]} for i in range(2000)]
    eng.upsert_policy(Policy.parse(kinds.validate(np("p", "x", {"podSelector": {}, "ingress": rules}))))
    by_selector = _count_calls(monkeypatch, PolicyEngine, "selector_addresses")
    by_rule = _count_calls(monkeypatch, PolicyEngine, "rule_members")
    rs = eng.build()
    sets = [s for s in rs.sets() if s.name.startswith("np-in/x/p/")]
    assert sum(len(s.elements) for s in sets) <= 3001 * 1  # pods x families
    assert [s.name for s in sets] == ["np-in/x/p/0/pods"]
    assert len(by_selector) == 1 and by_rule == []
    assert forwarded(rs, Packet("10.1.11.183", "10.0.0.1", "tcp", 2000))  # the last pod, the last rule
    assert not forwarded(rs, Packet("10.1.11.183", "10.0.0.1", "tcp", 2001))
    # A pod coming changes that one set's elements: still worked out once.
    eng.upsert_pod(_pod("y", "new", "10.200.0.1", {}))
    rs = eng.build()
    assert len(by_selector) == 2 and by_rule == []
    assert forwarded(rs, Packet("10.200.0.1", "10.0.0.1", "tcp", 7))


def test_policies_sharing_a_selector_work_its_addresses_out_once_across_builds(monkeypatch):
    """50 policies selecting local pods, each reading namespaceSelector {} over 3,000 pods
    (and egress named ports toward it): its addresses and named ports are worked out once a
    build, not once a policy (a pod coming re-filled all 50 from scratch, 1.5 s at 5,000
    pods: review r9 item 1), and not again in a build where nothing of it changed."""
    eng = PolicyEngine(NODE)
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {}, NODE), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    _crowd(eng, 3000)
    for i in range(50):
        eng.upsert_policy(Policy.parse(kinds.validate(np(f"p{i}", "x", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"namespaceSelector": {}}], "ports": [{"port": 1 + i}]}],
            "egress": [{"to": [{"namespaceSelector": {}}], "ports": [{"port": "http"}]}]}))))  # fmt: skip
    by_selector = _count_calls(monkeypatch, PolicyEngine, "selector_addresses")
    named = _count_calls(monkeypatch, PolicyEngine, "named_members")
    rs = eng.build()
    assert len(by_selector) == 1 and len(named) == 1
    assert forwarded(rs, Packet("10.1.11.183", "10.0.0.1", "tcp", 50))
    eng.upsert_pod(_pod("y", "new", "10.200.0.1", {}, ports=[("http", 8080, "TCP")]))
    rs = eng.build()
    assert len(by_selector) == 2 and len(named) == 2
    assert forwarded(rs, Packet("10.200.0.1", "10.0.0.1", "tcp", 7))
    assert forwarded(rs, Packet("10.0.0.1", "10.200.0.1", "tcp", 8080))
    assert _sets(rs, "np-out/x/p49/")["np-out/x/p49/0/named"] == {("10.200.0.1", "tcp", 8080)}
    # The local pod's record changes (its selecting policies compiled again), no peer's set does.
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {"v": "2"}, NODE), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    assert len(eng._dirty_policies) == 50
    assert eng.build().objects == rs.objects
    assert len(by_selector) == 2 and len(named) == 2  # (srv's labels: no member or address changed)


def test_a_peer_changing_while_no_policy_reads_it_is_seen_when_one_does_again():
    """The members and named ports worked out for a policy are forgotten with it when it
    selects no local pod: a peer renumbering its port meanwhile is reached on the new number
    once it selects one again."""
    eng = PolicyEngine(NODE)
    port = LocalPort("veth0", "02:00:00:00:00:01", "cni0")
    eng.upsert_pod(_pod("x", "cli", "10.0.0.1", {"app": "cli"}, NODE), port)
    eng.upsert_pod(_pod("x", "web", "10.0.1.1", {"app": "web"}, ports=[("http", 80, "TCP")]))
    eng.upsert_policy(Policy.parse(kinds.validate(np("p", "x", {"podSelector": {"matchLabels": {"app": "cli"}},
        "policyTypes": ["Egress"], "egress": [
            {"to": [{"podSelector": {"matchLabels": {"app": "web"}}}], "ports": [{"port": "http"}]},
            {"to": [{"ipBlock": {"cidr": "10.0.2.0/24"}}], "ports": [{"port": "http"}]}]}))))  # fmt: skip
    eng.upsert_pod(_pod("x", "far", "10.0.2.1", {}, ports=[("http", 80, "TCP")]))
    assert forwarded(eng.build(), Packet("10.0.0.1", "10.0.1.1", "tcp", 80))
    eng.upsert_pod(_pod("x", "cli", "10.0.0.1", {"app": "other"}, NODE), port)  # no local pod selected
    eng.build()
    eng.upsert_pod(_pod("x", "web", "10.0.1.1", {"app": "web"}, ports=[("http", 8080, "TCP")]))
    eng.upsert_pod(_pod("x", "far", "10.0.2.1", {}, ports=[("http", 8081, "TCP")]))
    eng.upsert_pod(_pod("x", "cli", "10.0.0.1", {"app": "cli"}, NODE), port)
    rs = eng.build()
    assert forwarded(rs, Packet("10.0.0.1", "10.0.1.1", "tcp", 8080))
    assert not forwarded(rs, Packet("10.0.0.1", "10.0.1.1", "tcp", 80))
    assert forwarded(rs, Packet("10.0.0.1", "10.0.2.1", "tcp", 8081))
    assert not forwarded(rs, Packet("10.0.0.1", "10.0.2.1", "tcp", 80))


def _sets(rs: Ruleset, prefix: str) -> dict[str, frozenset[Any]]:
    return {s.name: s.elements for s in rs.sets() if s.name.startswith(prefix)}


def test_a_rule_with_several_selectors_reads_one_set_of_the_pods_any_of_them_matches():
    """A rule's peer selectors are one set per family (the pods any of them matches), shared
    by the rules listing the same selectors in any order; a pod is in it while it matches
    one of them, and leaves it when it matches none."""
    eng = PolicyEngine(NODE, families=(4, 6))
    eng.upsert_pod(Pod("x", "srv", NODE, (ipaddress.ip_address("10.0.0.1"), ipaddress.ip_address("fd00::1")), {}, ()),
                   LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    eng.set_namespace("z", {"team": "z"})

    def peer(ns: str, name: str, n: int, labels: dict[str, str]) -> None:
        eng.upsert_pod(Pod(ns, name, "node2", (ipaddress.ip_address(f"10.0.{n}.1"), ipaddress.ip_address(f"fd00::{n}:1")),
                           labels, ()))  # fmt: skip

    peer("x", "b", 1, {"role": "b"})  # the pod selector's
    peer("z", "o", 2, {})  # the namespace selector's
    peer("y", "n", 3, {"role": "b"})  # neither's (role b, but not of x; y is no team z)
    b_or_z = [{"podSelector": {"matchLabels": {"role": "b"}}}, {"namespaceSelector": {"matchLabels": {"team": "z"}}}]
    eng.upsert_policy(Policy.parse(kinds.validate(np("p", "x", {"podSelector": {}, "ingress": [
        {"from": b_or_z, "ports": [{"port": 80}]},
        {"from": b_or_z[1:], "ports": [{"port": 81}]},
        {"from": [*reversed(b_or_z), b_or_z[0]], "ports": [{"port": 82}]}]}))))  # fmt: skip
    rs = eng.build()
    assert _sets(rs, "np-in/x/p/") == {
        "np-in/x/p/0/pods": {"10.0.1.1", "10.0.2.1"}, "np-in/x/p/0/pods6": {"fd00::1:1", "fd00::2:1"},
        "np-in/x/p/1/pods": {"10.0.2.1"}, "np-in/x/p/1/pods6": {"fd00::2:1"}}  # fmt: skip
    chain = rs.objects[(compiler.INET, compiler.TABLE, "chain", "np-in/x/p")]
    assert len(chain.rules) == 6  # type: ignore[union-attr]  # 3 rules x 2 families: one set each
    assert sum("@np-in/x/p/0/pods" in r for r in chain.rules) == 4  # type: ignore[union-attr]  # rules 0 and 2
    for port in (80, 82):
        assert forwarded(rs, Packet("10.0.1.1", "10.0.0.1", "tcp", port))
        assert forwarded(rs, Packet("fd00::2:1", "fd00::1", "tcp", port))
        assert not forwarded(rs, Packet("10.0.3.1", "10.0.0.1", "tcp", port))
    # x/b no longer matches the pod selector: out of the union (not of the namespace's set).
    peer("x", "b", 1, {"role": "c"})
    rs = eng.build()
    assert _sets(rs, "np-in/x/p/0/") == {"np-in/x/p/0/pods": {"10.0.2.1"}, "np-in/x/p/0/pods6": {"fd00::2:1"}}
    assert not forwarded(rs, Packet("10.0.1.1", "10.0.0.1", "tcp", 80))
    # x/b back, x a team z namespace too: x/b matches both selectors ...
    peer("x", "b", 1, {"role": "b"})
    eng.set_namespace("x", {"team": "z"})
    rs = eng.build()
    assert "10.0.1.1" in _sets(rs, "np-in/x/p/0/")["np-in/x/p/0/pods"]
    # ... and stays while it matches one of them ...
    peer("x", "b", 1, {"role": "c"})
    rs = eng.build()
    assert "10.0.1.1" in _sets(rs, "np-in/x/p/0/")["np-in/x/p/0/pods"]
    assert forwarded(rs, Packet("fd00::1:1", "fd00::1", "tcp", 82))
    # ... and leaves when it matches none.
    eng.set_namespace("x", {})
    rs = eng.build()
    assert _sets(rs, "np-in/x/p/0/") == {"np-in/x/p/0/pods": {"10.0.2.1"}, "np-in/x/p/0/pods6": {"fd00::2:1"}}
    assert not forwarded(rs, Packet("fd00::1:1", "fd00::1", "tcp", 82))


def _team_rules(selectors: int, rules: int) -> dict[str, Any]:
    """A policy of ``rules`` ingress rules, each listing ``selectors`` namespaces one by one on
    a TCP, a UDP and an SCTP port."""
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": f"team{i}"}}} for i in range(selectors)]
    ports = [{"port": 80}, {"port": 53, "protocol": "UDP"}, {"port": 9000, "protocol": "SCTP"}]
    return np("p", "x", {"podSelector": {}, "ingress": [{"from": peers, "ports": ports} for _ in range(rules)]})


def _dual_stack_server() -> PolicyEngine:
    eng = PolicyEngine(NODE, families=(4, 6))
    eng.upsert_pod(Pod("x", "srv", NODE, (ipaddress.ip_address("10.0.0.1"), ipaddress.ip_address("fd00::1")), {}, ()),
                   LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    return eng


def test_a_rule_listing_50_namespaces_is_one_set_lookup_per_family_and_port_match():
    """50 selectors of one dual-stack rule on 3 protocols: 6 rules (2 families x 3 port
    matches), not 300 (each selector its set, each set its rules: per-packet lookups)."""
    eng = _dual_stack_server()
    eng.upsert_pod(Pod("team49", "c", "node2", (ipaddress.ip_address("10.0.9.1"), ipaddress.ip_address("fd00::9:1")), {}, ()))
    eng.upsert_policy(Policy.parse(kinds.validate(_team_rules(50, 1))))
    rs = eng.build()
    assert eng.too_large == {}
    assert len(rs.objects[(compiler.INET, compiler.TABLE, "chain", "np-in/x/p")].rules) <= 6  # type: ignore[union-attr]
    assert _sets(rs, "np-in/x/p/") == {"np-in/x/p/0/pods": {"10.0.9.1"}, "np-in/x/p/0/pods6": {"fd00::9:1"}}
    assert forwarded(rs, Packet("fd00::9:1", "fd00::1", "sctp", 9000))
    assert not forwarded(rs, Packet("fd00::9:1", "fd00::1", "sctp", 9001))


def test_60_rules_listing_namespaces_one_by_one_are_programmed():
    """60 such rules of 30 namespaces were 10,800 nftables rules, refused (blaming ipBlock
    prefixes the policy has none of); 360 rules reading one shared set per family now."""
    eng = _dual_stack_server()
    eng.upsert_policy(Policy.parse(kinds.validate(_team_rules(30, 60))))
    rs = eng.build()
    assert eng.too_large == {}
    assert len(rs.objects[(compiler.INET, compiler.TABLE, "chain", "np-in/x/p")].rules) == 360  # type: ignore[union-attr]
    assert sorted(_sets(rs, "np-in/x/p/")) == ["np-in/x/p/0/pods", "np-in/x/p/0/pods6"]


def test_a_refusal_names_what_made_the_rules_too_many(monkeypatch):
    monkeypatch.setattr(compiler, "MAX_POLICY_RULES", 20)
    eng = _dual_stack_server()
    eng.upsert_policy(Policy.parse(kinds.validate(_team_rules(30, 4))))
    eng.build()
    assert eng.too_large[("x", "p")] == (
        "policy x/p not programmed: its ingress rules need more than 20 nftables rules (24 rules at ingress[3], 18 "
        "before it and 6 of its own: 2 selector sets and 0 ipBlock prefixes on 3 port matches; a rule per selector "
        "set or ipBlock prefix, per port match of its family); it allows nothing until fewer rules, ipBlock "
        "excepts, peers or ports make it smaller")  # fmt: skip


def test_the_element_budget_counts_a_rules_union_once(monkeypatch):
    """Two selectors matching the same 20 pods: their rule's set holds 20 addresses, counted
    as 20 (not 40) against compiler.MAX_POLICY_ELEMENTS."""
    monkeypatch.setattr(compiler, "MAX_POLICY_ELEMENTS", 25)
    eng = PolicyEngine(NODE)
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {}, NODE), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    _crowd(eng, 20, labels={"app": "c"})
    peers = [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "c"}}},
             {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "y"}}}]  # fmt: skip
    eng.upsert_policy(Policy.parse(kinds.validate(np("p", "x", {"podSelector": {}, "ingress": [{"from": peers}]}))))
    rs = eng.build()
    assert eng.too_large == {}
    assert len(_sets(rs, "np-in/x/p/")["np-in/x/p/0/pods"]) == 20
    _crowd(eng, 26, labels={"app": "c"})
    eng.build()
    assert eng.too_large[("x", "p")].startswith("policy x/p not programmed: its sets need more than 25 elements (26 or more")


def test_too_many_rules_are_refused_from_the_policy_alone(monkeypatch):
    """A policy over compiler.MAX_POLICY_RULES is refused before any of its peers' members
    are worked out (its selectors are not even kept)."""
    monkeypatch.setattr(compiler, "MAX_POLICY_RULES", 10)
    eng = PolicyEngine(NODE)
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {}, NODE), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    _crowd(eng, 20, labels={"app": "c"})
    matched = _count_calls(monkeypatch, PeerSelector, "matches")
    by_rule = _count_calls(monkeypatch, PolicyEngine, "rule_members")
    by_selector = _count_calls(monkeypatch, PolicyEngine, "selector_addresses")
    rules = [{"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "y"}},
                        "podSelector": {"matchLabels": {"app": "c"}}}], "ports": [{"port": 1 + i}]} for i in range(11)]  # fmt: skip
    eng.upsert_policy(Policy.parse(kinds.validate(np("big", "x", {"podSelector": {}, "ingress": rules}))))
    rs = eng.build()
    assert eng.too_large[("x", "big")].startswith(
        "policy x/big not programmed: its ingress rules need more than 10 nftables rules (11 rules at ingress[10]")
    assert rs.objects[(compiler.INET, compiler.TABLE, "chain", "np-in/x/big")].rules == ()  # type: ignore[union-attr]
    assert matched == [] and by_rule == [] and by_selector == [] and eng._members == {}
    # A pod changing asks no selector of it either.
    eng.upsert_pod(_pod("y", "p3", "10.1.0.3", {"app": "d"}))
    eng.build()
    assert matched == [] and by_selector == []


def test_too_many_distinct_selectors_are_refused_from_the_policy_alone(monkeypatch):
    monkeypatch.setattr(compiler, "MAX_POLICY_SELECTORS", 3)
    eng = PolicyEngine(NODE)
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {}, NODE), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    _crowd(eng, 10)
    peers = [{"namespaceSelector": {"matchExpressions": [{"key": "k", "operator": "NotIn", "values": [f"v{i}"]}]}}
             for i in range(4)]  # fmt: skip
    eng.upsert_policy(Policy.parse(kinds.validate(np("p", "x", {"podSelector": {}, "ingress": [{"from": peers}]}))))
    eng.build()
    assert eng.too_large[("x", "p")] == ("policy x/p not programmed: its peers have 4 distinct pod and namespace "
                                         "selectors, more than 3; it allows nothing until fewer make it smaller")  # fmt: skip
    assert eng._members == {}
    eng.upsert_policy(Policy.parse(kinds.validate(np("p", "x", {"podSelector": {}, "ingress": [{"from": peers[:3]}]}))))
    eng.build()
    assert eng.too_large == {} and len(eng._members) == 3


def test_a_policy_whose_sets_grow_over_the_budget_allows_nothing_until_they_shrink(monkeypatch):
    """compiler.MAX_POLICY_ELEMENTS: counted as the sets are filled, refused as soon as they
    are over (the rest not worked out); the other policies are programmed as ever."""
    monkeypatch.setattr(compiler, "MAX_POLICY_ELEMENTS", 65)
    eng = PolicyEngine(NODE)
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {"app": "srv"}, NODE), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    _crowd(eng, 20)
    peers = [{"namespaceSelector": {"matchExpressions": [{"key": "k", "operator": "NotIn", "values": [f"v{i}"]}]}}
             for i in range(3)]  # fmt: skip
    eng.upsert_policy(Policy.parse(kinds.validate(np("wide", "x", {"podSelector": {}, "ingress": [
        {"from": [p], "ports": [{"port": 80 + i}]} for i, p in enumerate(peers)]}))))  # fmt: skip
    eng.upsert_policy(Policy.parse(kinds.validate(np("other", "x", {"podSelector": {}, "ingress": [
        {"from": [{"namespaceSelector": {}}], "ports": [{"port": 9000}]}]}))))  # fmt: skip
    rs = eng.build()
    assert eng.too_large == {}
    assert forwarded(rs, Packet("10.1.0.5", "10.0.0.1", "tcp", 82))
    _crowd(eng, 40)  # 3 selectors x 41 pods: over 65 at the second
    by_selector = _count_calls(monkeypatch, PolicyEngine, "selector_addresses")
    rs = eng.build()
    assert eng.too_large[("x", "wide")].startswith(
        "policy x/wide not programmed: its sets need more than 65 elements (82 or more: ")
    wide = [c for c in by_selector if any(s in peers_of(eng, ("x", "wide")) for s in c[1:2])]
    assert len(wide) == 2  # the third selector's members never worked out
    assert rs.objects[(compiler.INET, compiler.TABLE, "chain", "np-in/x/wide")].rules == ()  # type: ignore[union-attr]
    assert not [s for s in rs.sets() if s.name.startswith("np-in/x/wide/")]
    assert not forwarded(rs, Packet("10.1.0.5", "10.0.0.1", "tcp", 82))
    assert forwarded(rs, Packet("10.1.0.5", "10.0.0.1", "tcp", 9000))  # the other policy
    for i in range(10, 40):
        eng.remove_pod(("y", f"p{i}"))
    rs = eng.build()
    assert eng.too_large == {}
    assert forwarded(rs, Packet("10.1.0.5", "10.0.0.1", "tcp", 82))


def peers_of(eng: PolicyEngine, key: Any) -> set[Any]:
    policy = eng.policies[key]
    return {p.selector for r in policy.ingress or () for p in r.peers or ()}


# ------------------------------------------------------------------ laid out where it selects a pod


def test_a_policy_is_laid_out_only_once_it_selects_a_local_pod(monkeypatch):
    """Every node hears every policy of the cluster: one selecting no pod of this node is not
    laid out (0.67 s for a 2,000-rule ipBlock policy, on the agent's event loop) and nothing of
    it is kept; it is laid out once when a local pod becomes selected, and forgotten when none
    is or when it changes."""
    laid = _count_calls(monkeypatch, compiler, "layout")
    eng = PolicyEngine(NODE)
    port = LocalPort("veth0", "02:00:00:00:00:01", "cni0")
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {"app": "other"}, NODE), port)
    eng.upsert_pod(_pod("x", "cli", "10.0.1.1", {"role": "client"}))
    spec = {"podSelector": {"matchLabels": {"app": "srv"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}], "ports": [{"port": 80}]}]}
    eng.upsert_policy(Policy.parse(kinds.validate(np("p", "x", spec))))
    eng.build()
    assert laid == [] and eng._layouts == {} and eng._members == {}
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {"app": "srv"}, NODE), port)  # selected now
    rs = eng.build()
    assert len(laid) == 1 and forwarded(rs, Packet("10.0.1.1", "10.0.0.1", "tcp", 80))
    eng.upsert_pod(_pod("x", "cli2", "10.0.1.2", {"role": "client"}))  # its members change: the layout is kept
    rs = eng.build()
    assert len(laid) == 1 and forwarded(rs, Packet("10.0.1.2", "10.0.0.1", "tcp", 80))
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {"app": "other"}, NODE), port)  # selects no local pod again
    eng.build()
    assert eng._layouts == {} and eng._members == {}
    eng.upsert_pod(_pod("x", "srv", "10.0.0.1", {"app": "srv"}, NODE), port)
    eng.build()
    assert len(laid) == 2
    eng.upsert_policy(Policy.parse(kinds.validate(np("p", "x", {**spec, "ingress": [{"ports": [{"port": 81}]}]}))))
    rs = eng.build()  # changed: laid out again
    assert len(laid) == 3 and forwarded(rs, Packet("10.0.3.3", "10.0.0.1", "tcp", 81))
    assert not forwarded(rs, Packet("10.0.1.1", "10.0.0.1", "tcp", 80))
    eng.remove_policy(("x", "p"))
    eng.build()
    assert eng._layouts == {} and eng._members == {} and len(laid) == 3
