"""The policy programmer against the real kernel, in a namespace of its own.

Set elements that take the netlink fast path (agentd.nft.nfnetlink) must land in the
kernel exactly as libnftables would have put them: every key layout the tables use
(address, interface name, interface . address, address . protocol . port, each with IPv4
and IPv6 addresses: the pods are dual-stack) and map data (verdict jumps, MAC addresses) is
written, then read back with `nft -j list` and compared with the wanted ruleset.  A second programmer adopts the tables (same handles, no delete)
and rewrites them in one transaction; removing deletes both tables.
"""

from __future__ import annotations

import ipaddress
import json

from agentd.policy import compiler
from agentd.policy.engine import PolicyEngine
from agentd.nft.libnftables import Nft
from agentd.policy.model import LocalPort, NamedPort, Pod, Policy
from agentd.nft.programmer import NftProgrammer
from agentd.nft.ruleset import NftSet
from agentd.resources import kinds


def _ips(i: int, net: int = 1) -> tuple:
    return (ipaddress.IPv4Address(f"10.244.{net}.{i + 2}"), ipaddress.IPv6Address(f"fd00:10:244:{net}::{i + 2}"))


def _engine() -> PolicyEngine:
    eng = PolicyEngine("node1", families=(4, 6))
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


def test_tables_are_named_for_the_agent():
    assert compiler.TABLES == {("inet", "agentd-policy"), ("bridge", "agentd-policy")}
