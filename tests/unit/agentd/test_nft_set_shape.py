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
