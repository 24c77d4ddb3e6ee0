"""The policy programmer against the real kernel, in a namespace of its own.

Set elements that take the netlink fast path (agentd.nft.nfnetlink) must land in the
kernel exactly as libnftables would have put them: every key layout the tables use
(address, interface name, interface . address, address . protocol . port, each with IPv4
and IPv6 addresses: the pods are dual-stack) and map data (verdict jumps, MAC addresses) is
written, then read back with `nft -j list` and compared with the wanted ruleset.  A second programmer adopts the tables (same handles, no delete)
and rewrites them in one transaction; removing deletes both tables.  An upgrade that
changed a chain's hook (db7790c: the no-route chain) or a set's type syncs, the kernel the judge.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from dataclasses import replace

from agentd.nft.expr import DropLog, jump, match, meta, ref
from agentd.nft.libnftables import Nft
from agentd.nft.programmer import NftProgrammer
from agentd.nft.ruleset import NftChain, NftSet, Ruleset, rule_text
from agentd.policy import compiler
from agentd.policy.engine import PolicyEngine
from agentd.policy.model import LocalPort, NamedPort, Pod, Policy
from agentd.resources import kinds


def _ips(i: int, net: int = 1) -> tuple:
    return (ipaddress.IPv4Address(f"10.244.{net}.{i + 2}"), ipaddress.IPv6Address(f"fd00:10:244:{net}::{i + 2}"))


def _engine(drop_log: DropLog | None = None) -> PolicyEngine:
    eng = PolicyEngine("node1", families=(4, 6), drop_log=drop_log)
    ports = (NamedPort("http", 80, "TCP"), NamedPort("dns", 53, "UDP"))
    for i in range(6):
        local = LocalPort(f"veth{i}", f"02:00:00:00:00:{i:02x}", "cni0") if i < 3 else None
        eng.upsert_pod(Pod("x", f"p{i}", "node1" if local else "node2", _ips(i), {"app": "a" if i % 2 else "b"}, ports),
                       local)  # fmt: skip
    spec = {"podSelector": {}, "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a"}}}, {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.244.0.0/16"]}},
                                  {"ipBlock": {"cidr": "fd00::/8", "except": ["fd00:10:244::/48"]}}],
                         "ports": [{"port": "http"}, {"port": 443}]}],
            "egress": [{"to": [{"namespaceSelector": {}}], "ports": [{"port": "dns", "protocol": "UDP"}]}]}  # fmt: skip
    eng.upsert_policy(Policy.parse(kinds.validate({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                                                   "metadata": {"name": "p", "namespace": "x"}, "spec": spec})))  # fmt: skip
    return eng


def _elements_in_kernel(ns) -> dict[str, set]:
    out: dict[str, set] = {}
    for family in ("inet", "bridge"):
        listing = json.loads(ns.exec("nft", "-j", "list", "table", family, "agentd-policy"))["nftables"]
        for item in listing:
            body = item.get("set") or item.get("map")
            if body is None:
                continue
            elems = set()
            for e in body.get("elem", []):
                elems.add(json.dumps(_norm(e), sort_keys=True))
            out[f"{family}:{body['name']}"] = elems
    return out


_PROTO = {6: "tcp", 17: "udp", 132: "sctp"}


def _norm(e):
    if isinstance(e, dict) and "elem" in e:
        return _norm(e["elem"]["val"])
    if isinstance(e, dict) and "concat" in e:
        return [_PROTO.get(x, x) if isinstance(x, int) and i == 1 else x for i, x in enumerate(e["concat"])]
    if isinstance(e, list):
        return [_norm(e[0]), _norm(e[1])]
    return e


def _wanted(rs) -> dict[str, set]:
    out = {}
    for s in rs.sets():
        elems = set()
        for e in s.elements:
            if s.map is not None:
                k, v = e
                v = {v[0]: {"target": v[1]}} if isinstance(v, tuple) else v
                elems.add(json.dumps([list(k) if isinstance(k, tuple) else k, v], sort_keys=True))
            else:
                elems.add(json.dumps(list(e) if isinstance(e, tuple) else e, sort_keys=True))
        out[f"{s.family}:{s.name}"] = elems
    return out


async def test_element_batches_land_as_libnftables_would_put_them(netns_factory):
    ns = netns_factory("nft")
    nft = Nft(netns=ns.path)
    try:
        eng = _engine()
        prog = NftProgrammer(nft, compiler.TABLES, "policy")
        await prog.sync(eng.build())
        assert _elements_in_kernel(ns) == _wanted(eng.build())
        # Membership changes only: they go through nfnetlink.
        before = prog.fast
        eng.upsert_pod(Pod("x", "new", "node3", _ips(7, 3), {"app": "a"}, (NamedPort("dns", 53, "UDP"),)))
        eng.remove_pod(("x", "p5"))
        await prog.sync(eng.build(), eng.touched())
        eng.upsert_pod(Pod("x", "p4", "node2", _ips(4)[:1], {"app": "a"}, ()))  # its IPv6 address gone
        await prog.sync(eng.build(), eng.touched())
        assert prog.fast == before + 2
        assert _elements_in_kernel(ns) == _wanted(eng.build())
        # A local pod going away: verdict maps and the bridge's ifname / ifname . address / MAC maps.
        eng.remove_pod(("x", "p1"))
        await prog.sync(eng.build(), eng.touched())
        assert _elements_in_kernel(ns) == _wanted(eng.build())
        assert not any(isinstance(o, NftSet) and o.interval for o in eng.build().sets())

        handles = {f: json.loads(ns.exec("nft", "-j", "list", "table", f, "agentd-policy"))["nftables"][1]["table"]["handle"]
                   for f in ("inet", "bridge")}  # fmt: skip
        # A restart: another programmer adopts, rewrites in one transaction, deletes nothing.
        nft2 = Nft(netns=ns.path)
        try:
            again = NftProgrammer(nft2, compiler.TABLES, "policy")
            await again.adopt()
            assert again.adopted_objects == len(eng.build().objects)
            result = await again.sync(eng.build())
            assert result.full
            assert {f: json.loads(ns.exec("nft", "-j", "list", "table", f, "agentd-policy"))["nftables"][1]["table"]["handle"]
                    for f in ("inet", "bridge")} == handles  # fmt: skip
            assert _elements_in_kernel(ns) == _wanted(eng.build())
            assert await again.remove()
            assert "agentd-policy" not in ns.exec("nft", "list", "tables")
        finally:
            nft2.close()
    finally:
        nft.close()


def _chain_in_kernel(ns, family: str, table: str, name: str) -> dict:
    listing = json.loads(ns.exec("nft", "-j", "list", "chain", family, table, name))["nftables"]
    return next(item["chain"] for item in listing if "chain" in item)


async def test_an_upgrade_that_changed_a_chains_hook_or_a_sets_type_syncs(netns_factory, caplog):
    """The tables as an older agentd left them, then this version's: the object of another
    shape goes before it is declared again, in one transaction the kernel takes (it refused
    the add while the old one was there: EEXIST, and the programmer retried forever)."""
    caplog.set_level(logging.WARNING, logger="agentd.nft")
    ns = netns_factory("nftup")
    eng = _engine(DropLog(group=7))
    new = eng.build()
    key = ("inet", compiler.TABLE, "chain", "prerouting")
    pre = new.objects[key]
    assert isinstance(pre, NftChain) and pre.hook == ("nat", "prerouting", compiler.NO_ROUTE_PRIORITY, "accept")
    # Before db7790c: a filter chain at priority 0, its rule asking ct state new.
    old = Ruleset(new.tables, dict(new.objects))
    old.add(replace(pre, hook=("filter", "prerouting", 0, "accept"), rules=(rule_text([
        match(meta("iifname"), ref(compiler.BRIDGES)), match({"ct": {"key": "state"}}, "new", "in"),
        match({"fib": {"result": "type", "flags": ["daddr"]}}, {"set": ["local", "broadcast", "multicast"]}, "!="),
        match({"fib": {"result": "oif", "flags": ["daddr"]}}, False), jump(compiler.NO_ROUTE)]),)))  # fmt: skip
    nft = Nft(netns=ns.path)
    try:
        await NftProgrammer(nft, compiler.TABLES, "policy").sync(old)
        assert _chain_in_kernel(ns, "inet", compiler.TABLE, "prerouting")["type"] == "filter"
        # The new version starts: it adopts the old tables (contents unknown) and syncs its own.
        upgraded = NftProgrammer(nft, compiler.TABLES, "policy")
        await upgraded.adopt()
        await upgraded.sync(new)
        chain = _chain_in_kernel(ns, "inet", compiler.TABLE, "prerouting")
        assert (chain["type"], chain["hook"], chain["prio"]) == ("nat", "prerouting", compiler.NO_ROUTE_PRIORITY)
        assert _elements_in_kernel(ns) == _wanted(new)
        # Membership changes go through again (the policy is not frozen).
        eng.remove_pod(("x", "p5"))
        await upgraded.sync(eng.build(), eng.touched())
        assert _elements_in_kernel(ns) == _wanted(eng.build())

        # A set whose type changed, a rule of a chain using it (contents known: the same
        # programmer, no adoption in between).
        table = ("inet", "agentd-upgrade-test")
        uses = [{"payload": {"protocol": "ip", "field": "saddr"}}]
        def shape(types: tuple, elements: frozenset, key: list) -> Ruleset:
            rs = Ruleset(frozenset({table}))
            rs.add(NftSet(*table, "x", types, elements=elements))
            rs.add(NftChain(*table, "in", (rule_text([match(key[0] if len(key) == 1 else {"concat": key}, ref("x")),
                                                      {"accept": None}]),),
                            hook=("filter", "input", 0, "accept")))  # fmt: skip
            return rs
        prog = NftProgrammer(nft, frozenset({table}), "test")
        await prog.sync(shape(("ipv4_addr",), frozenset({"10.0.0.1"}), uses))
        await prog.sync(shape(("ipv4_addr", "inet_service"), frozenset({("10.0.0.1", 80)}),
                              [*uses, {"payload": {"protocol": "tcp", "field": "dport"}}]))  # fmt: skip
        listing = json.loads(ns.exec("nft", "-j", "list", "set", *table, "x"))["nftables"]
        body = next(item["set"] for item in listing if "set" in item)
        assert body["type"] == ["ipv4_addr", "inet_service"] and body["elem"] == [{"concat": ["10.0.0.1", 80]}]
        assert "10.0.0.1 . 80" not in ns.exec("nft", "list", "chain", *table, "in")  # the rule, not the set
        assert "ip saddr . tcp dport @x accept" in ns.exec("nft", "list", "chain", *table, "in")
        # Neither took the programmer's fallback (a refused transaction, a full rewrite).
        assert not [r for r in caplog.records if "refused" in r.getMessage()]
        assert await prog.remove() and await upgraded.remove()
    finally:
        nft.close()


async def test_a_change_of_thousands_of_elements_to_one_set_lands_in_one_sync(netns_factory, caplog):
    """5,000 IPv4 addresses (and 3,000 IPv6 ones) added to one set each, element-only, in one
    sync (a namespace selector edited to match a large namespace), then all but a few
    deleted: more than one netlink attribute holds (its length is 16 bits, ~4,000 IPv4 keys),
    so the batch carries several messages per set -- still one transaction, no fallback to
    libnftables.  The encoding raised struct.error, which escaped the sync."""
    caplog.set_level(logging.WARNING, logger="agentd.nft")
    ns = netns_factory("nftbig")
    table = ("inet", "agentd-policy")

    def policy(v4: set[str], v6: set[str]) -> Ruleset:
        rs = Ruleset(frozenset({table}))
        rs.add(NftSet(*table, "np-in/x/p/0/pods", ("ipv4_addr",), elements=frozenset(v4)))
        rs.add(NftSet(*table, "np-in/x/p/0/pods6", ("ipv6_addr",), elements=frozenset(v6)))
        rs.add(NftChain(*table, "np-in/x/p", (rule_text([match({"payload": {"protocol": "ip", "field": "saddr"}},
                                                               ref("np-in/x/p/0/pods")), {"accept": None}]),)))  # fmt: skip
        return rs

    def in_kernel(name: str) -> set[str]:
        listing = json.loads(ns.exec("nft", "-j", "list", "set", *table, name))["nftables"]
        return {str(ipaddress.ip_address(e)) for e in next(item["set"] for item in listing if "set" in item).get("elem", [])}

    few4, few6 = {"10.244.0.2", "10.244.0.3"}, {"fd00:10:244::2"}
    many4 = few4 | {str(ipaddress.IPv4Address("10.245.0.0") + i) for i in range(5000)}
    many6 = few6 | {str(ipaddress.IPv6Address("fd00:10:245::") + i) for i in range(3000)}
    nft = Nft(netns=ns.path)
    prog = NftProgrammer(nft, frozenset({table}), "policy")
    try:
        assert (await prog.sync(policy(few4, few6))).full
        for v4, v6 in ((many4, many6), (few4, few6)):  # added, then deleted
            fast = prog.fast
            result = await prog.sync(policy(v4, v6))
            assert not result.full and prog.fast == fast + 1  # one element batch
            assert (in_kernel("np-in/x/p/0/pods"), in_kernel("np-in/x/p/0/pods6")) == (v4, v6)
        assert not [r for r in caplog.records if "refused" in r.getMessage()]
        assert await prog.remove()
    finally:
        nft.close()


def test_tables_are_named_for_the_agent():
    assert compiler.TABLES == {("inet", "agentd-policy"), ("bridge", "agentd-policy")}


async def test_a_policy_table_deleted_by_someone_else_is_written_again(lab_factory):
    """``nft delete table inet agentd-policy`` in a node's namespace (an admin, ``nft flush
    ruleset``, a firewall's restart): the agent's counters read (every COUNTERS_INTERVAL)
    finds the table gone, and a sync writes everything again -- network policy enforced
    again within seconds.  The agent kept believing its tables there: pods stayed open
    until some later policy or pod change failed."""
    from netpol_lab import close_grid, converged, make_grid, np

    from agentd.lab.wait import auntil

    lab = await lab_factory(nodes=2, pods=0)
    grid = await make_grid(lab, [(0, "x", "a"), (1, "x", "b")], {"x": {"ns": "x"}})
    node1 = lab.nodes[0]
    target = [(grid.pods["x/a"].address(4), "tcp", 80)]

    async def denied() -> bool:
        return await grid.probers["x/b"].probe(target, 1.0) == [False]

    try:
        await converged(lab, await grid.res.apply(np("deny", "x", {"podSelector": {"matchLabels": {"pod": "a"}}})))
        assert await denied()
        chains = _chains(node1)
        node1.ns.exec("nft", "delete", "table", "inet", "agentd-policy")
        assert "table inet agentd-policy" not in node1.ns.exec("nft", "list", "tables")
        await auntil(lambda: "table inet agentd-policy" in node1.ns.exec("nft", "list", "tables"), 15,
                     what="node1's agent to write its policy table again")
        await auntil(denied, 15, what="x/a's ingress denied again")
        assert _chains(node1) == chains  # written whole, not an empty table
    finally:
        await close_grid(grid)


def _chains(node) -> dict[str, int]:
    """The chains of node's inet policy table, and how many rules each has."""
    listing = json.loads(node.ns.exec("nft", "-j", "list", "table", "inet", "agentd-policy"))["nftables"]
    out = {item["chain"]["name"]: 0 for item in listing if "chain" in item}
    for item in listing:
        if "rule" in item:
            out[item["rule"]["chain"]] += 1
    return out
