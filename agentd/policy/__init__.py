"""NetworkPolicy (networking.k8s.io/v1) enforced on every node in nftables.

``model`` (policies, selectors, pods as values), ``engine`` (cluster state in, the node's
ruleset out, incrementally), ``compiler`` (the nftables objects and where they hook),
``ruleset`` (nftables objects as values and the one-transaction plan between two rulesets),
``libnftables`` (the kernel's nftables through libnftables' JSON API), ``programmer``
(adopt, sync, remove), ``endpoints`` (the files agentd-cni leaves for the agent),
``agent`` (the agent's policy task: etcd and local pods in, kernel out; /policy, metrics).
"""
