"""A set's shape as listed: the kernel's own flags do not make it another set."""

from agentd.nft.ruleset import NftSet, Ruleset, plan


def affinity(flags: tuple[str, ...]) -> NftSet:
    return NftSet("inet", "agentd-services", "aff/0", ("ipv4_addr",), flags=flags, contents_known=False, timeout=10800)


def test_a_set_the_kernel_lists_dynamic_is_the_set_declared_without_it():
    # A set that rules fill (`update @aff { ip saddr }`) is made dynamic by nft itself; a newer
    # nft lists that flag in JSON.  Taken for another shape, the set would be deleted and made
    # again while rules use it: the transaction refused, every sync after a restart.
    declared, listed = affinity(("timeout",)), affinity(("dynamic", "timeout"))
    assert declared.same_shape(listed) and listed.same_shape(declared)
    have, want = Ruleset(), Ruleset()
    have.add(listed)
    want.add(declared)
    assert not [c for c in plan(have, want) if "delete" in c or ("add" in c and "set" in c["add"])]
    # Other flags still tell shapes apart.
    assert not affinity(("interval", "timeout")).same_shape(declared)


def test_an_adopted_affinity_set_is_the_one_the_compiler_declares():
    # At a restart the programmer adopts Services' ClientIP affinity sets from nft's JSON
    # listing.  Their timeout read as none, each would be another shape than the compiler's
    # declaration: deleted and made again (every client's affinity lost) at every restart.
    from agentd.nft.expr import IPV4
    from agentd.nft.programmer import _parse
    from agentd.nft.ruleset import NftChain
    from agentd.services import compiler, model

    sp = model.ServicePort("shop", "web", "http", "TCP", 80, "10.96.0.10", node_port=None, affinity_timeout=10800,
                           internal_local=False, external_local=False,
                           endpoints=(model.Endpoint("10.244.1.2", 8080),))  # fmt: skip
    declared, chain = compiler._endpoint(sp, IPV4, sp.endpoints[0], compiler.ep_chain(sp, sp.endpoints[0]))
    assert isinstance(declared, NftSet) and isinstance(chain, NftChain)
    listed = {"set": {"family": declared.family, "table": declared.table, "name": declared.name, "type": "ipv4_addr",
                      "handle": 7, "flags": ["timeout", "dynamic"], "timeout": 10800,
                      "elem": [{"elem": {"val": "203.0.113.9", "expires": 9000}}]}}  # fmt: skip
    have = _parse(listed)
    assert have.same_shape(declared)
    tables = frozenset({(declared.family, declared.table)})
    assert plan(Ruleset(tables, {have.key: have}), Ruleset(tables, {declared.key: declared})) == []
