"""NetworkPolicy (networking.k8s.io/v1) enforced on every node in nftables.

``model`` (policies, selectors, pods as values), ``engine`` (cluster state in, the node's
ruleset out, incrementally), ``compiler`` (the nftables objects and where they hook),
``publisher`` (this node's pods, from the files agentd-cni leaves (:mod:`agentd.cni.endpoints`),
into etcd), ``agent`` (the agent's policy task: etcd and local pods in, kernel out through
:mod:`agentd.nft`; /policy, metrics).
"""
