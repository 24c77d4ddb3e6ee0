"""What ``GET /policy``, /metrics and ``agentd status`` show of the policy half of the agent.

:class:`PolicyViews` reads a :class:`PolicyState` (the running
:class:`agentd.policy.agent.PolicyAgent`) and changes nothing; it is the agent's
prometheus_client collector and the source of its REST view.  :func:`pod_view` is one local
pod as the engine sees it: the policies selecting it and its effective allow-lists.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from agentd.nft.programmer import NftProgrammer

from .engine import PolicyEngine
from .model import PodKey, Policy



class PolicyState(Protocol):
    """What the views read of the policy agent."""

    node: str
    engine: PolicyEngine
    programmer: NftProgrammer | None
    policy_count: int
    applied_revision: int
    applied_at: float | None
    history: deque[tuple[int, float]]
    last_sync: dict[str, Any] | None
    error: str | None
    dropped: dict[tuple[str, str], int]
    dropped_made: dict[tuple[PodKey, str], int]  # which counter each count of ``dropped`` is from
    spoofed: int
    sync_errors: int
    fast_path: Any
    fast_path_error: str | None
    fast_path_counters: dict[str, dict[str, dict[str, int]]]  # family ("ipv4", "ipv6") -> verdict -> counts

    @property
    def unknown_endpoints(self) -> list[str]: ...  # endpoint files never read: pods policy does not know

    @property
    def unchecked_macs(self) -> dict[str, str]: ...  # local pods whose source MAC is not known: not checked

    @property
    def refused_macs(self) -> dict[str, str]: ...  # local pods whose MAC read was refused: cut off

    def local_pods(self) -> list[PodKey]: ...

    def isolated(self) -> dict[str, int]: ...


class PolicyViews:
    def __init__(self, agent: PolicyState) -> None:
        self.agent = agent
        # agentd_policy_dropped_packets_total per (namespace, direction): what the pods' counters
        # (PolicyState.dropped) read at the last scrape, and what counters gone since (a pod
        # deleted, a counter made again from zero) had counted: the sum never goes down.
        self._drops_seen: dict[tuple[PodKey, str], tuple[int, int]] = {}  # (its counter's identity, packets)
        self._drops_gone: dict[tuple[str, str], int] = {}

    def status(self) -> dict[str, Any]:
        a = self.agent
        size = a.programmer.current.size() if a.programmer and a.programmer.current else {}
        return {
            "pods": len(a.engine.pods),
            "local_pods": len(a.local_pods()),
            "isolated": a.isolated(),
            "policies": a.policy_count,
            "revision": a.applied_revision,
            "applied_at": a.applied_at,
            "last_sync": a.last_sync,
            "ruleset": size,
            "error": a.error,
            # Endpoint files of this node never read (container IDs): their pods are neither
            # isolated nor source-checked, and their bridge ports cannot be named.
            "unknown_endpoints": a.unknown_endpoints,
            # Local pods whose port's source MAC goes unchecked (the check on): their endpoint
            # file names no MAC and their interface's could not be read ("NS/NAME": why).
            "unchecked_macs": a.unchecked_macs,
            # Local pods whose endpoint file names no MAC and whose interface's was refused (a
            # group address, the bridge's, another port's): every frame from their port is
            # dropped ("NS/NAME": why).
            "refused_macs": a.refused_macs,
            "fast_path": self.fast_path(),
            "too_large": self.too_large(),
        }

    def too_large(self) -> dict[str, str]:
        """Policies refused as too large to program ("NS/NAME": why): each isolates the pods it
        selects and allows nothing until it fits (docs/policy.md, Limits)."""
        return {f"{ns}/{name}": why for (ns, name), why in sorted(self.agent.engine.too_large.items())}

    def fast_path(self) -> dict[str, Any]:
        """The pod fast path: on or not (and why), where, and what it did with pods' TCP."""
        a = self.agent
        out: dict[str, Any] = {"on": a.fast_path is not None, "error": a.fast_path_error}
        if a.fast_path is not None:
            out.update(a.fast_path.status())
            # IPv4's (``ipv6`` in the status above has IPv6's).
            out["packets"] = {verdict: c["packets"] for verdict, c in a.fast_path_counters.get("ipv4", {}).items()}
        return out

    def view(self, pod: str | None = None, *, summary: bool = False, allow_lists: bool = True) -> dict[str, Any]:
        """GET /policy: per local pod (or ``pod``) its policies and allow-lists; with
        ``summary`` only what the node has applied (cheap enough to poll); without
        ``allow_lists`` (``?view=pods``, the browser view's node page) each pod's row without
        them: what costs (local pods x rules x peers) is left out."""
        a = self.agent
        applied = {
            "node": a.node,
            "revision": a.applied_revision,
            "applied_at": a.applied_at,
            "history": [list(h) for h in a.history],
            "policies": a.policy_count,
        }
        if summary:
            return {**applied, "pods": len(a.engine.pods), "error": a.error, "too_large": self.too_large()}
        pods = []
        rules = AllowLists(a.engine)  # each rule's peers resolved once for the whole answer
        for key in a.local_pods():
            name = f"{key[0]}/{key[1]}"
            if pod is not None and pod != name:
                continue
            v = pod_view(a.engine, key, rules, allow_lists=allow_lists)
            v["dropped"] = {
                "ingress": a.dropped.get((key, "ingress"), 0),
                "egress": a.dropped.get((key, "egress"), 0),
            }
            pods.append(v)
        return {
            **applied,
            "ruleset": self.status()["ruleset"],
            "spoofed_dropped": a.spoofed,
            "error": a.error,
            "too_large": self.too_large(),
            "pods": pods,
        }

    def dropped_by_namespace(self) -> dict[tuple[str, str], int]:
        """Packets policy dropped per (namespace, direction), a counter that never goes down: a
        pod label would make a series per pod ever run (unbounded over rollouts), and a sum of
        only the pods there now would go down when one goes -- a counter reset to Prometheus,
        whose rate() would count the whole sum again.  What a gone (or reset) pod counter had
        counted at the last scrape is kept; drops since that scrape are lost with it.  Per pod
        they stay in GET /policy and the flow records."""
        made = self.agent.dropped_made
        now = {at: (made.get(at, 0), packets) for at, packets in self.agent.dropped.items()}
        for (key, direction), (counter, before) in self._drops_seen.items():
            # Gone, or made again (a pod deleted and made again under its name: a new counter,
            # which may have counted past the old one's count by now), or reset (from zero).
            counter_now, packets = now.get((key, direction), (None, 0))
            if counter_now != counter or packets < before:
                at = (key[0], direction)
                self._drops_gone[at] = self._drops_gone.get(at, 0) + before
        self._drops_seen = now
        totals = dict(self._drops_gone)
        for ((ns, _), direction), (_counter, packets) in now.items():
            totals[(ns, direction)] = totals.get((ns, direction), 0) + packets
        return totals

    def collect(self):
        """Prometheus metrics (registered as a collector on the agent's registry)."""
        a = self.agent
        dropped = CounterMetricFamily(
            "agentd_policy_dropped_packets", "packets dropped by network policy to or from this node's pods, "
            "per namespace", labels=["namespace", "direction"],
        )  # fmt: skip
        for (ns, direction), packets in sorted(self.dropped_by_namespace().items()):
            dropped.add_metric([ns, direction], float(packets))
        spoofed = CounterMetricFamily("agentd_policy_spoofed_packets", "pod packets dropped for a foreign source address")
        spoofed.add_metric([], float(a.spoofed))
        isolated = GaugeMetricFamily("agentd_policy_isolated_pods", "local pods isolated by policy", labels=["direction"])
        for direction, n in a.isolated().items():
            isolated.add_metric([direction], float(n))
        local = GaugeMetricFamily("agentd_policy_local_pods", "pods of this node known to policy")
        local.add_metric([], float(len(a.local_pods())))
        policies = GaugeMetricFamily("agentd_policy_policies", "NetworkPolicy objects in the cluster")
        policies.add_metric([], float(a.policy_count))
        errors = CounterMetricFamily("agentd_policy_sync_errors", "policy changes nftables refused")
        errors.add_metric([], float(a.sync_errors))
        unknown = GaugeMetricFamily("agentd_policy_unknown_endpoint_files",
                                    "endpoint files of this node never read: pods unknown to policy")
        unknown.add_metric([], float(len(a.unknown_endpoints)))
        yield from (dropped, spoofed, isolated, local, policies, errors, unknown)
        if a.fast_path_counters:
            packets = CounterMetricFamily(
                "agentd_pod_fast_path_packets", "pod TCP packets by what the pod fast path did with them (carried: "
                "into the receiving pod or routed toward its node; else why the stack's path took them), by IP family",
                labels=["family", "verdict"],
            )  # fmt: skip
            for family, verdicts in sorted(a.fast_path_counters.items()):
                for verdict, c in verdicts.items():
                    packets.add_metric([family, verdict], float(c["packets"]))
            yield packets
        size = self.status()["ruleset"]
        if size:
            rules = GaugeMetricFamily("agentd_policy_ruleset", "size of the policy tables", labels=["what"])
            for what, n in size.items():
                rules.add_metric([what], float(n))
            yield rules


#: Peer addresses and resolved named ports one GET /policy answer lists in all (about 2 MB of
#: JSON): a rule's lists are cut where the answer has listed this many, and the rule says how
#: many it left out.  A namespace-wide rule of a namespace of thousands of pods, in the allow-lists
#: of each of a node's pods, would otherwise make an answer of hundreds of MB, built on the
#: agent's event loop (BGP keepalives, etcd leases and DNS wait meanwhile).
LISTED_MAX = 100_000


class AllowLists:
    """The allow-list entries of one answer: each rule's (a policy's, in one direction) resolved
    once however many local pods it applies to, and at most :data:`LISTED_MAX` addresses and
    named ports listed in all."""

    def __init__(self, engine: PolicyEngine, listed_max: int = LISTED_MAX) -> None:
        self.engine = engine
        self.left = listed_max  # addresses and named ports the answer may still list
        self._rules: dict[tuple[Any, str, int], _Rule] = {}

    def of(self, policies: list[Policy], direction: str) -> list[dict[str, Any]]:
        """The entries of ``policies``' rules in ``direction``; those of a policy refused as too
        large to program (``engine.too_large``: its chain is empty, it allows nothing) say
        ``"programmed": false``."""
        out = []
        for policy in policies:
            refused = policy.key in self.engine.too_large
            for index, rule in enumerate((policy.ingress if direction == "in" else policy.egress) or ()):
                key = (policy.key, direction, index)
                if key not in self._rules:
                    self._rules[key] = _Rule(self.engine, policy, direction, index, rule)
                entry = self._listed(self._rules[key])
                if refused:
                    entry["programmed"] = False
                out.append(entry)
        return out

    def _listed(self, rule: _Rule) -> dict[str, Any]:
        """The rule's entry with its lists, as much of them as the answer may still hold (none
        left: its peers are not resolved, only counted)."""
        if self.left <= 0 and not rule.resolved:
            cut = rule.count()
            out = {**rule.entry, "peer_addresses": [] if rule.rule.peers is not None else None, "named_ports": None}
            if cut:
                out["left_out"] = cut
            return out
        rule.resolve()
        cut, addresses, named = 0, None, rule.named
        if rule.addresses is not None:
            if len(rule.addresses) > self.left:
                cut += len(rule.addresses) - self.left
            addresses = rule.texts(min(self.left, len(rule.addresses)))
            self.left -= len(addresses)
        if len(named) > self.left:
            cut += len(named) - self.left
            named = named[: self.left]
        self.left -= len(named)
        out = {**rule.entry, "peer_addresses": addresses, "named_ports": named or None}
        if cut:
            out["left_out"] = cut  # addresses and named ports not listed: the answer holds LISTED_MAX
        return out


def pod_view(engine: PolicyEngine, key: PodKey, rules: AllowLists | None = None, *,
             allow_lists: bool = True) -> dict[str, Any]:
    """What /policy shows for one local pod: its policies and effective allow-lists (from
    ``rules``, the answer's :class:`AllowLists`: its rules resolved once for all its pods);
    without ``allow_lists`` its row alone (no ``ingress``/``egress``)."""
    pod = engine.pods[key]
    port = engine.local.get(key)
    ingress, egress = engine.isolation(key)
    policies = engine.selecting(key)
    out = {
        "pod": f"{pod.namespace}/{pod.name}",
        "ip": str(pod.ip) if pod.ip else None,
        "ips": [str(ip) for ip in pod.ips],
        "interface": port.interface if port else None,
        "labels": dict(pod.labels),
        "policies": [f"{p.namespace}/{p.name}" for p in policies],
        "isolated": {"ingress": ingress, "egress": egress},
    }
    if allow_lists:
        rules = rules if rules is not None else AllowLists(engine)
        out["ingress"] = rules.of(policies, "in") if ingress else None
        out["egress"] = rules.of(policies, "out") if egress else None
    return out


class _Rule:
    """One rule's allow-list entry but its lists, and the lists once the answer lists some of
    them (:meth:`resolve`): its peers' addresses in order (None: any peer), each made text
    once it is listed, and the named ports resolved."""

    def __init__(self, engine: PolicyEngine, policy: Policy, direction: str, index: int, rule: Any) -> None:
        self.engine, self.policy, self.direction, self.rule = engine, policy, direction, rule
        peers: Any = "all"
        if rule.peers is not None:
            peers = []
            for peer in rule.peers:
                if peer.block is not None:
                    peers.append({"ipBlock": str(peer.block.cidr), "except": [str(e) for e in peer.block.excepts]})
                else:
                    sel = peer.selector
                    assert sel is not None
                    peers.append({
                        "namespace": sel.namespace if sel.namespace is not None else f"matching {sel.namespaces}",
                        "pods": str(sel.pods),
                    })  # fmt: skip
        ports: Any = "all"
        if rule.ports is not None:
            ports = [
                {"protocol": p.protocol, "port": p.port, **({"endPort": p.end_port} if p.end_port else {})}
                for p in rule.ports
            ]
        self.entry = {"policy": f"{policy.namespace}/{policy.name}", "rule": index, "peers": peers,
                      "peer_addresses": None, "ports": ports, "named_ports": None}
        self.resolved = False
        self.addresses: list[Any] | None = None
        self.named: list[str] = []
        self._texts: list[str] = []
        self._count: int | None = None

    def resolve(self) -> None:
        if self.resolved:
            return
        mem = self.engine.rule_members(self.policy, self.direction, self.rule)
        self.addresses = sorted(mem.pod_ips, key=_address_order) if self.rule.peers is not None else None
        self.named = sorted(f"{a} {p}/{n}" for a, p, n in mem.named)
        self.resolved = True

    def count(self) -> int:
        """Its peer addresses and named ports, resolved or not (:meth:`PolicyEngine.rule_count`)."""
        if self._count is None:
            self._count = self.engine.rule_count(self.policy, self.direction, self.rule)
        return self._count

    def texts(self, n: int) -> list[str]:
        """The first ``n`` peer addresses as text (made once per answer, however many pods list them)."""
        assert self.addresses is not None
        if len(self._texts) < n:
            self._texts.extend(str(a) for a in self.addresses[len(self._texts) : n])
        return self._texts[:n]


def _address_order(ip: Any) -> tuple[int, int]:
    return (ip.version, int(ip))  # IPv4 first; addresses of two families do not compare
