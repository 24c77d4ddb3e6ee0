"""nftables, as the agent's table owners use it (NetworkPolicy, Services).

``ruleset`` (nftables objects as values, and the one-transaction plan between two rulesets),
``expr`` (the JSON expressions the compilers share), ``libnftables`` (the kernel's nftables
through libnftables' JSON API), ``nfnetlink`` (set-element batches and counter dumps straight
over NETLINK_NETFILTER), ``programmer`` (adopt, sync, remove: desired vs. actual, atomically).
"""
