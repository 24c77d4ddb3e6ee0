"""An object wanted in another shape under the name the kernel holds (upgrades): the old one
goes before the new one is declared, in the same transaction.

The kernel refuses to add a chain or set under a name it still holds in another shape
(EEXIST), to delete a set a rule still uses or a chain something still jumps to (EBUSY):
declared first and deleted at the end, the whole transaction was refused, on every retry
(policy frozen after an upgrade across db7790c, the no-route chain's hook changed)."""

from agentd.nft.expr import jump, match, meta, ref
from agentd.nft.ruleset import NftChain, NftSet, Ruleset, plan, rule_text
from agentd.policy import compiler as c

T = c.TABLE


def where(cmds: list, verb: str, kind: str, name: str) -> list[int]:
    """The positions of ``verb`` commands on the object ``name`` of ``kind`` (a rule counts
    as its chain's: kind "rule")."""
    out = []
    for i, cmd in enumerate(cmds):
        (v, body), = cmd.items()
        if v != verb or kind not in body:
            continue
        obj = body[kind]
        if (obj.get("chain") if kind == "rule" else obj.get("name")) == name:
            out.append(i)
    return out


def ruleset(*objects) -> Ruleset:
    rs = Ruleset(frozenset({("inet", T)}))
    for o in objects:
        rs.add(o)
    return rs


def test_a_base_chain_whose_hook_changed_goes_before_it_is_declared_again():
    # db7790c: "prerouting" (flows on) was filter/prerouting/0, is nat/prerouting/-101; the
    # adopted tables' contents are unknown (a restart onto the new version).
    bridges = NftSet("inet", T, c.BRIDGES, ("ifname",), elements=frozenset({"cni0"}))
    rule = rule_text([match(meta("iifname"), ref(c.BRIDGES)), jump(c.NO_ROUTE)])
    old = [NftChain("inet", T, "prerouting", hook=("filter", "prerouting", 0, "accept"), contents_known=False),
           NftChain("inet", T, c.NO_ROUTE, contents_known=False),
           NftSet("inet", T, c.BRIDGES, ("ifname",), contents_known=False)]
    new = [NftChain("inet", T, "prerouting", (rule,), hook=("nat", "prerouting", c.NO_ROUTE_PRIORITY, "accept")),
           NftChain("inet", T, c.NO_ROUTE, (rule_text([{"counter": None}]),)), bridges]
    cmds = plan(ruleset(*old), ruleset(*new))
    flush, delete = where(cmds, "flush", "chain", "prerouting"), where(cmds, "delete", "chain", "prerouting")
    add, rules = where(cmds, "add", "chain", "prerouting"), where(cmds, "add", "rule", "prerouting")
    assert len(flush) == len(delete) == len(add) == len(rules) == 1
    assert flush[0] < delete[0] < add[0] < rules[0]
    assert cmds[add[0]]["add"]["chain"]["type"] == "nat"
    # Nothing else changed shape: the rest is refilled as on any adoption, nothing deleted.
    assert where(cmds, "delete", "chain", c.NO_ROUTE) == where(cmds, "delete", "set", c.BRIDGES) == []
    assert where(cmds, "add", "rule", c.NO_ROUTE) and where(cmds, "add", "element", c.BRIDGES)


def test_a_set_whose_type_changed_goes_first_with_the_rules_using_it_flushed_before():
    uses = rule_text([match({"concat": [meta("iifname"), {"payload": {"protocol": "ip", "field": "saddr"}}]}, ref("x")),
                      {"accept": None}])
    other = rule_text([match(meta("iifname"), "cni0"), {"accept": None}])
    s_old = NftSet("inet", T, "x", ("ifname",), elements=frozenset({"cni0"}))
    s_new = NftSet("inet", T, "x", ("ifname", "ipv4_addr"), elements=frozenset({("cni0", "10.0.0.1")}))
    old_user = NftChain("inet", T, "user", (rule_text([match(meta("iifname"), ref("x")), {"accept": None}]),))
    new_user = NftChain("inet", T, "user", (uses,))
    bystander = NftChain("inet", T, "bystander", (other,))
    cmds = plan(ruleset(s_old, old_user, bystander), ruleset(s_new, new_user, bystander))
    delete, add = where(cmds, "delete", "set", "x"), where(cmds, "add", "set", "x")
    assert len(delete) == len(add) == 1 and delete[0] < add[0]
    assert cmds[add[0]]["add"]["set"]["type"] == ["ifname", "ipv4_addr"]
    # The chain using it is flushed before the set goes, once, and refilled after it is back.
    assert len(where(cmds, "flush", "chain", "user")) == 1
    assert where(cmds, "flush", "chain", "user")[0] < delete[0]
    assert [cmds[i]["add"]["rule"]["expr"] for i in where(cmds, "add", "rule", "user")] == [uses]
    assert where(cmds, "add", "rule", "user")[0] > add[0]
    assert where(cmds, "add", "element", "x")[0] > add[0]
    # Nothing goes under that name after it is declared again; a chain not using it is left be.
    assert not [i for i in range(add[0], len(cmds)) if "delete" in cmds[i] or "flush" in cmds[i]]
    assert not [cmd for cmd in cmds if "bystander" in str(cmd)]


def test_an_unchanged_chain_using_a_replaced_set_is_refilled_as_it_was():
    rule = rule_text([match(meta("iifname"), ref("x")), {"accept": None}])
    user = NftChain("inet", T, "user", (rule,))
    cmds = plan(ruleset(NftSet("inet", T, "x", ("ifname",)), user),
                ruleset(NftSet("inet", T, "x", ("ifname",), flags=("interval",)), user))
    flush, delete = where(cmds, "flush", "chain", "user"), where(cmds, "delete", "set", "x")
    add, refill = where(cmds, "add", "set", "x"), where(cmds, "add", "rule", "user")
    assert len(flush) == len(refill) == 1 and flush[0] < delete[0] < add[0] < refill[0]


def test_a_chain_becoming_a_base_chain_loses_its_jumps_and_verdicts_before_it_goes():
    # A regular chain may be jumped to (a rule, a verdict map's element); a base chain may not.
    caller_rule = rule_text([match(meta("iifname"), "cni0"), jump("c")])
    old = [NftChain("inet", T, "c", (rule_text([{"accept": None}]),)),
           NftChain("inet", T, "caller", (caller_rule,)),
           NftSet("inet", T, "vm", ("ifname",), map="verdict", elements=frozenset({("cni0", ("jump", "c"))}))]
    new = [NftChain("inet", T, "c", (rule_text([{"accept": None}]),), hook=("filter", "forward", 0, "accept")),
           NftChain("inet", T, "caller", ()),
           NftSet("inet", T, "vm", ("ifname",), map="verdict")]
    cmds = plan(ruleset(*old), ruleset(*new))
    delete, add = where(cmds, "delete", "chain", "c"), where(cmds, "add", "chain", "c")
    assert len(delete) == len(add) == 1 and delete[0] < add[0]
    assert where(cmds, "flush", "chain", "caller")[0] < delete[0]
    assert where(cmds, "flush", "map", "vm")[0] < delete[0]
    assert not where(cmds, "add", "rule", "caller") and not where(cmds, "add", "element", "vm")
    # A base chain being replaced has nothing jumping to it: no other chain is touched.
    cmds = plan(ruleset(NftChain("inet", T, "b", hook=("filter", "input", 0, "accept")), old[1]),
                ruleset(NftChain("inet", T, "b", hook=("filter", "input", 5, "accept")), old[1]))
    assert not [cmd for cmd in cmds if "caller" in str(cmd)]
    assert where(cmds, "delete", "chain", "b")[0] < where(cmds, "add", "chain", "b")[0]
