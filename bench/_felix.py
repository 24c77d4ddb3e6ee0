"""The Calico anchor of bench/policy.py: the iptables ruleset Calico's Felix (iptables data
plane) would hold on node1 for the bench's policies and pods, and what Felix sends per change.

Felix renders every active policy as its own chains (``cali-pi-*`` ingress, ``cali-po-*``
egress), every local workload as ``cali-tw-*`` / ``cali-fw-*`` chains that jump to the chains
of the policies selecting it (and to its namespace's profile when none does), dispatch chains
on the interface names, and every selector as an ipset of pod addresses.  Per change it does
not rewrite the table: felix/iptables/table.go keeps a hash per rule of every chain and
restores only the chains whose hashes changed, with ``iptables-restore --noflush``; under
iptables-nft (Debian's iptables) a changed chain is flushed by its forward reference and
rewritten whole.  A membership change touches no chain at all: it is an ipset member added
or removed.

The model keeps what decides the kernel's work (chain and rule counts, one set per selector,
the rule shapes and their hash comments) and leaves out what does not (Felix's own
computation in Go, the raw/mangle/nat tables).  A named port is matched as its number here
(Felix uses a named-port ipset for it).
"""

from __future__ import annotations

import base64
import hashlib
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench._scratch import timed

from agentd.lab.netns import Netns, unique_tag

ACCEPT_MARK = "0x10000/0x10000"
PASS_MARK = "0x20000/0x20000"
RESTORE = ["iptables-restore", "--noflush", "--verbose", "--wait", "10"]  # Felix's arguments


def _profile(namespace: str) -> str:
    return f"cali-pri-kns.{namespace}"[:28]


def _hash(text: str, size: int) -> str:
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode().lower()[:size]


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str]
    ip: str
    interface: str | None = None  # set for a pod on this node


def _matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn/Exists) on ``labels``."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


@dataclass
class Ruleset:
    """node1's Felix-shaped filter table: chains of rules and the ipsets they match."""

    pods: Sequence[Pod]
    namespaces: dict[str, dict[str, str]]
    chains: dict[str, list[str]] = field(default_factory=dict)
    sets: dict[str, list[str]] = field(default_factory=dict)
    policy_chains: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    # ------------------------------------------------------------------ rendering

    def _set_for(self, key: str, members: Iterable[str]) -> str:
        name = "cali40s:" + _hash(key, 22)
        self.sets.setdefault(name, sorted(set(members)))
        return name

    def _peer(self, namespace: str, peer: dict[str, Any], direction: str) -> str:
        """The match of one NetworkPolicy peer: an ipset of the pods it selects, or a CIDR."""
        side = "src" if direction == "ingress" else "dst"
        if "ipBlock" in peer:
            block = peer["ipBlock"]
            match = f"{'-s' if side == 'src' else '-d'} {block['cidr']}"
            if block.get("except"):
                name = self._set_for(f"except {block['except']}", block["except"])
                match += f" -m set ! --match-set {name} {side}"
            return match
        pod_sel = peer.get("podSelector")
        ns_sel = peer.get("namespaceSelector")
        if ns_sel is not None:
            pods = [p for p in self.pods if _matches(ns_sel, self.namespaces.get(p.namespace, {}))
                    and (pod_sel is None or _matches(pod_sel, p.labels))]
        else:
            pods = [p for p in self.pods if p.namespace == namespace and _matches(pod_sel, p.labels)]
        name = self._set_for(f"{namespace} {ns_sel} {pod_sel}", (p.ip for p in pods))
        return f"-m set --match-set {name} {side}"

    @staticmethod
    def _ports(ports: list[dict[str, Any]] | None) -> str:
        if not ports:
            return ""
        numbers = sorted({8080 if isinstance(p.get("port"), str) else int(p["port"]) for p in ports})
        return f"-p tcp -m multiport --dports {','.join(map(str, numbers))} "

    def _rule(self, chain: str, body: str) -> None:
        rules = self.chains.setdefault(chain, [])
        rules.append(f'-m comment --comment "cali:{_hash(chain + str(len(rules)) + body, 16)}" {body}')

    def render_policy(self, pol: dict[str, Any]) -> list[str]:
        """The policy's chains (replacing earlier ones of the same name); their names."""
        ns, name, spec = pol["metadata"]["namespace"], pol["metadata"]["name"], pol["spec"]
        names = []
        for direction, prefix, key in (("ingress", "cali-pi-_", "from"), ("egress", "cali-po-_", "to")):
            if direction not in spec and direction.capitalize() not in spec.get("policyTypes", []):
                continue
            chain = prefix + _hash(f"{direction} {ns}/{name}", 19)
            self.chains[chain] = []
            for rule in spec.get(direction) or []:
                peers = rule.get(key) or [None]
                for peer in peers:
                    match = self._ports(rule.get("ports")) + (self._peer(ns, peer, direction) if peer else "")
                    self._rule(chain, f"{match} -j MARK --set-xmark {ACCEPT_MARK}".strip())
                    self._rule(chain, f"-m mark --mark {ACCEPT_MARK} -j RETURN")
            names.append(chain)
        self.policy_chains[(ns, name)] = names
        return names

    def render(self, policies: Sequence[dict[str, Any]]) -> None:
        """Every policy, every local pod's chains, the dispatch chains and the profiles."""
        for pol in policies:
            self.render_policy(pol)
        for ns in self.namespaces:
            chain = _profile(ns)
            self._rule(chain, f"-j MARK --set-xmark {ACCEPT_MARK}")
            self._rule(chain, f"-m mark --mark {ACCEPT_MARK} -j RETURN")
        for pod in self.pods:
            if pod.interface is None:
                continue
            for direction, prefix, dispatch, flag in (("ingress", "cali-tw-", "cali-to-wl-dispatch", "-o"),
                                                      ("egress", "cali-fw-", "cali-from-wl-dispatch", "-i")):
                chain = prefix + pod.interface
                selecting = [
                    c for pol in policies
                    if pol["metadata"]["namespace"] == pod.namespace and _matches(pol["spec"]["podSelector"], pod.labels)
                    for c in self.policy_chains[(pol["metadata"]["namespace"], pol["metadata"]["name"])]
                    if c.startswith("cali-pi-" if direction == "ingress" else "cali-po-")
                ]
                self.chains[chain] = []
                self._rule(chain, "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT")
                self._rule(chain, "-m conntrack --ctstate INVALID -j DROP")
                self._rule(chain, "-j MARK --set-xmark 0x0/0x30000")
                if selecting:
                    self._rule(chain, "-j MARK --set-xmark 0x0/0x20000")
                    for target in selecting:
                        self._rule(chain, f"-m mark --mark 0x0/0x20000 -j {target}")
                        self._rule(chain, f"-m mark --mark {ACCEPT_MARK} -j RETURN")
                    self._rule(chain, "-m mark --mark 0x0/0x20000 -j DROP")
                else:
                    self._rule(chain, f"-j {_profile(pod.namespace)}")
                    self._rule(chain, f"-m mark --mark {ACCEPT_MARK} -j RETURN")
                self._rule(chain, "-j DROP")
                self._rule(dispatch, f"{flag} {pod.interface} -g {chain}")
        for dispatch in ("cali-to-wl-dispatch", "cali-from-wl-dispatch"):
            self._rule(dispatch, "-j DROP")
        self._rule("cali-FORWARD", "-i cali+ -j cali-from-wl-dispatch")
        self._rule("cali-FORWARD", "-o cali+ -j cali-to-wl-dispatch")

    # ------------------------------------------------------------------ restore input

    def restore_input(self, chains: Iterable[str], hook: bool = False) -> str:
        """Felix's iptables-restore input for ``chains``: a forward reference each (it flushes
        the chain under iptables-nft), then every rule of them."""
        chains = list(chains)
        lines = ["*filter", *(f":{c} - [0:0]" for c in chains)]
        lines += [f"-A {c} {rule}" for c in chains for rule in self.chains[c]]
        if hook:
            lines.append("-I FORWARD -j cali-FORWARD")
        return "\n".join([*lines, "COMMIT", ""])


def _create_sets(ns: Netns, sets: dict[str, list[str]]) -> Any:
    """The ipsets over netlink (pyroute2, the bench extra; no ipset tool is needed)."""
    try:
        from pyroute2.ipset import IPSet
    except ImportError:
        from bench._common import BenchError

        raise BenchError("pyroute2 is not installed (a bench dependency): .venv/bin/pip install -e '.[bench]'") from None
    with ns.entered():
        ipset = IPSet()
    for name, members in sets.items():
        ipset.create(name, stype="hash:net")
        for member in members:
            ipset.add(name, member, etype="net")
    return ipset


def anchor(policies: Sequence[dict[str, Any]], pods: Sequence[Pod], namespaces: dict[str, dict[str, str]],
           changed: Sequence[dict[str, Any]], member_ip: str) -> dict[str, Any]:
    """Load node1's Felix-shaped ruleset into a scratch namespace, then time what Felix sends
    for each policy in ``changed`` (a new version of an existing one: the chains whose rules
    changed, restored with --noflush) and one membership change (``member_ip`` added to a
    selector's ipset over netlink; Felix itself writes ipset updates through ``ipset
    restore``, a process start more)."""
    model = Ruleset(pods, namespaces)
    model.render(policies)
    ns = Netns.create(f"ad-bfx{unique_tag('')[:6]}")
    ipset = None
    try:
        ipset = _create_sets(ns, model.sets)
        full, _ = timed(ns, RESTORE, model.restore_input(model.chains, hook=True).encode())
        policy_runs, lines = [], []
        for pol in changed:
            key = (pol["metadata"]["namespace"], pol["metadata"]["name"])
            before = {c: list(model.chains[c]) for c in model.policy_chains[key]}
            model.render_policy(pol)
            dirty = [c for c in model.policy_chains[key] if model.chains[c] != before.get(c)]
            text = model.restore_input(dirty)
            seconds, _ = timed(ns, RESTORE, text.encode())
            policy_runs.append(seconds)
            lines.append(text.count("\n-A "))
        target = max(model.sets, key=lambda n: len(model.sets[n]))
        start = time.perf_counter()  # the socket was opened in the namespace
        ipset.add(target, member_ip, etype="net")
        member = time.perf_counter() - start
        rules = sum(len(r) for r in model.chains.values())
        return {"full_s": full, "policy_s": statistics.median(policy_runs), "policy_runs_s": policy_runs,
                "policy_rules_restored": statistics.median(lines), "member_s": member, "chains": len(model.chains),
                "rules": rules, "ipsets": len(model.sets), "set_members": sum(len(m) for m in model.sets.values())}
    finally:
        if ipset is not None:
            ipset.close()
        ns.delete()
