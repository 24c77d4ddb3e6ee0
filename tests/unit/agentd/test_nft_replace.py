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


def test_an_adopted_chain_whose_rules_are_unknown_is_flushed_before_a_set_it_may_use_goes():
    # After a restart the chains' rules are not read (adopted: contents unknown), and the
    # one below uses @p: deleting p before flushing it is a transaction the kernel refuses
    # (EBUSY), on every retry, which adopts the same state again.
    uses = rule_text([match({"payload": {"protocol": "ip", "field": "saddr"}}, ref("p")), {"accept": None}])
    cur = ruleset(NftSet("inet", T, "p", ("ipv4_addr",), contents_known=False),
                  NftChain("inet", T, "c", (), contents_known=False))
    want = ruleset(NftSet("inet", T, "p", ("ipv4_addr", "inet_service")), NftChain("inet", T, "c", (uses,)))
    cmds = plan(cur, want)
    flushed, deleted = where(cmds, "flush", "chain", "c"), where(cmds, "delete", "set", "p")
    assert flushed and deleted and flushed[0] < deleted[0]
    assert where(cmds, "add", "rule", "c") and where(cmds, "add", "set", "p")[0] > deleted[0]


def test_a_counter_map_goes_before_the_counters_its_elements_name():
    # An adopted table (nft lists a table's counters before its maps): a counter map and the
    # counter it names both no longer wanted.  The counter deleted first, while the map's
    # element still names it, is refused by the kernel (EBUSY) on every retry.
    from agentd.nft.programmer import _parse

    listing = [
        {"table": {"family": "ip", "name": "agentd-services"}},
        {"chain": {"family": "ip", "table": "agentd-services", "name": "services"}},
        {"counter": {"family": "ip", "table": "agentd-services", "name": "svc/default/web"}},
        {"map": {"family": "ip", "table": "agentd-services", "name": "old-counters", "type": "ipv4_addr",
                 "map": "counter"}},
    ]
    objects = {o.key: o for o in map(_parse, listing) if o is not None}
    table = frozenset({("ip", "agentd-services")})
    cur = Ruleset(table, objects)
    want = Ruleset(table, {})
    want.add(NftChain("ip", "agentd-services", "services", (rule_text([{"accept": None}]),)))
    cmds = plan(cur, want)
    counter = [i for i, cmd in enumerate(cmds) if cmd.get("delete", {}).get("counter")]
    assert where(cmds, "flush", "map", "old-counters")[0] < where(cmds, "delete", "map", "old-counters")[0] < counter[0]


def test_planning_many_replaced_sets_reads_each_rule_a_bounded_number_of_times(monkeypatch):
    # An upgrade changing the pod sets' type replaces N sets used by N chains: each replaced
    # set searched every rule of the table (N x rules: 2,000 sets took 3.5 s of the event
    # loop).  Rules read (a substring search or a scan of its names) grow with N, not N^2.
    import agentd.nft.ruleset as ruleset_module

    reads = 0

    class Rule(str):
        def __contains__(self, needle: object) -> bool:
            nonlocal reads
            reads += 1
            return str.__contains__(self, needle)  # type: ignore[operator]

    names_in = getattr(ruleset_module, "_names_in", None)
    if names_in is not None:
        def counted(rule: str) -> set[str]:
            nonlocal reads
            reads += 1
            return names_in(rule)
        monkeypatch.setattr(ruleset_module, "_names_in", counted)

    def reads_for(n: int) -> int:
        nonlocal reads
        cur, want = ruleset(), ruleset()
        for i in range(n):
            rules = tuple(Rule(rule_text([match({"payload": {"protocol": "ip", "field": "saddr"}},
                                                ref(f"np-in/ns{i}/pol/{j}/pods")), {"accept": None}]))
                          for j in range(4))
            name = f"np-in/ns{i}/pol/0/pods"
            cur.add(NftSet("inet", T, name, ("ipv4_addr",)))
            want.add(NftSet("inet", T, name, ("ipv4_addr", "inet_service")))
            cur.add(NftChain("inet", T, f"np-in/ns{i}/pol", rules))
            want.add(NftChain("inet", T, f"np-in/ns{i}/pol", rules))
        reads = 0
        cmds = plan(cur, want)
        assert len(where(cmds, "flush", "chain", "np-in/ns0/pol")) == 1  # each chain refilled
        return reads

    small, large = reads_for(100), reads_for(200)
    assert small > 0 and large <= 2 * small + 10, (small, large)


def test_a_plan_replacing_nothing_walks_no_object_of_the_ruleset():
    """_referring walked every object of the kernel's ruleset at every plan, also with nothing
    replaced (almost every sync): one endpoint change at 10,000 Services spent nearly all its
    plan there (review s57 r19)."""
    from agentd.nft import ruleset as r

    class Objects(dict):
        def items(self):
            raise AssertionError("the whole ruleset walked")

    assert r._referring(Ruleset(frozenset(), Objects()), set()) == set()
