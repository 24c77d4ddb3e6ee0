"""The policy engine: cluster state in, the node's nftables ruleset out, incrementally.

Pure (sans-IO): the agent feeds it pods (every pod of the cluster, the local ones with where
they are attached), namespaces and policies, and asks :meth:`PolicyEngine.build` for the
:class:`~agentd.nft.ruleset.Ruleset` this node should have.

Kubernetes semantics (networking.k8s.io/v1):

* a policy selects the pods of its namespace its podSelector matches; a pod selected by no
  policy with Ingress (Egress) in its policyTypes is not isolated in that direction;
* an isolated pod accepts what at least one rule of at least one selecting policy allows
  (policies are a union); a rule allows a peer if it matches any of its peers (none listed:
  every peer) on any of its ports (none listed: every port and protocol);
* a podSelector peer means pods of the policy's namespace, a namespaceSelector peer every
  pod of the matching namespaces, both together the pods matching both; an ipBlock is a
  range of addresses minus its excepts;
* a named port resolves on the destination pod, by name and protocol;
* a pod has an address of each family the cluster runs (``families``): a selector that
  matches it matches both, an ipBlock only those of its own family.

One address, one local pod: when two local pods claim an address (a stale endpoint file whose
pod's address host-local has handed to a new pod), the newer endpoint file's pod has it
(``LocalPort.since``, then the pod's name: the same for any order the pods came in) and the
other is as if it had not that address (:meth:`PolicyEngine.conflicts`).  Two elements with
one key in the address maps would make the kernel refuse every transaction.  Naming an
address for flow records (``by_ip``) follows that rule for local pods and, for two pods of
other nodes claiming one address, takes the newer record (creationTimestamp, then the name):
never whichever came last, and the other when one goes.

Incremental: the members of each distinct peer selector are kept as pods come, go and
change; a change marks the policies whose members changed (and local pods whose selecting
policies changed) dirty, and only those are compiled again.  Only policies selecting a
pod of this node are compiled at all: laid out (compiler.layout) when one first does, and
only then are their peers' members kept.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from agentd.nft.expr import FAMILIES, DropLog
from agentd.nft.ruleset import Ruleset

from . import compiler
from .model import (
    Address,
    LocalPort,
    PeerSelector,
    Pod,
    PodKey,
    Policy,
    Rule,
    namespace_labels,
)

NAMED_BEFORE_MAX = 8192  # addresses' former owners kept for the flow recorder (read every 0.2 s)


PolicyKey = tuple[str, str]


class PolicyEngine:
    def __init__(
        self, node: str, *, drop_log: DropLog | None = None, route_all: bool = False, families: tuple[int, ...] = (4,),
        check_source_mac: bool = True, service_ranges: tuple[Any, ...] = (),
    ) -> None:
        """``drop_log``: drops are logged for flow records; ``route_all``: every local pod's
        traffic goes through the IP stack and conntrack, not only isolated pods' (flow records
        of connections between pods of this node); ``families``: the IP versions compiled (a
        pod's addresses of other versions are ignored); ``check_source_mac``: a pod port's frames
        must carry its pod's MAC ([policy] check_source_mac)."""
        self.node = node
        self.service_ranges = service_ranges  # left out of the no-route check (compiler.base_objects)
        self.check_source_mac = check_source_mac
        self.drop_log = drop_log
        self.route_all = route_all
        # br_netfilter hands this node's bridged frames of every pod family to the IP hooks
        # (bridge-nf-call-iptables and -ip6tables on, as on kubelet and Docker hosts): conntrack
        # sees connections between pods of this node without routing them up, and translates
        # them back on the bridge, so neither ``route_all`` nor ``route_services`` routes
        # anybody then (:meth:`set_bridged_to_ip`, read by the policy agent).
        self.bridged_to_ip = False
        # Services translate on this node: every local pod's traffic is routed too, so that an
        # endpoint's reply to a client on its own node (which the bridge would hand over at
        # layer 2, past the un-DNAT, where br_netfilter does not call the IP hooks) is translated.
        self.route_services = False
        self.families = tuple(sorted(set(families)))
        self.by_ip: dict[str, PodKey] = {}  # every pod's addresses (flow records name pods by them)
        # Every pod claiming each address (by_ip names one: _name_address): a stale record of
        # another node's sharing an address with a live pod neither takes it by coming last nor
        # leaves it unnamed when it goes.
        self._ip_pods: dict[str, set[PodKey]] = {}
        self.pods_version = 0  # changes with any pod's record (flow records remember names until then)
        # Whom an address named before a change that may have given it to another (or to
        # nobody): (address, the pod it named, whether a pod of this node, when: ``clock``),
        # the latest last, at most NAMED_BEFORE_MAX; ``named_before_count`` counts every one
        # ever kept (the flow recorder names a connection's end as its start named it:
        # :meth:`named_before_since`).
        self.named_before: deque[tuple[str, Pod, bool, float]] = deque(maxlen=NAMED_BEFORE_MAX)
        self.named_before_count = 0
        self.clock: Callable[[], float] = time.time  # when a change is noted (CLOCK_REALTIME s)
        self._prefixes: dict[str, tuple[str, PodKey]] | None = None
        self._chains: dict[str, tuple[str, PodKey]] | None = None
        self.pods: dict[PodKey, Pod] = {}
        self.local: dict[PodKey, LocalPort] = {}
        # Local pods known only by their port (their endpoint file or record unusable): cut off,
        # their port a pod port with no address and no MAC (:meth:`cut_off`).
        self.cut_off_ports: dict[PodKey, LocalPort] = {}
        self.namespaces: dict[str, dict[str, str]] = {}  # labels of Namespace objects
        self.policies: dict[PolicyKey, Policy] = {}
        self.bridges: set[str] = set()
        self._claims: dict[Address, set[PodKey]] = {}  # local pods' addresses: who claims each
        self._lost: dict[PodKey, frozenset[Address]] = {}  # addresses a newer local pod has

        self._ns_pods: dict[str, set[PodKey]] = defaultdict(set)
        self._ns_policies: dict[str, set[PolicyKey]] = defaultdict(set)
        self._members: dict[PeerSelector, set[PodKey]] = {}
        self._sel_refs: dict[PeerSelector, set[PolicyKey]] = defaultdict(set)
        self._all_pods_refs: set[PolicyKey] = set()  # egress named ports over ipBlocks / every peer
        # Each kept selector's members' addresses (those the tables hold) as text, by IP
        # version: worked out when a build first needs them, shared by every policy reading the
        # selector, and kept until its members or a member's addresses change (_sel_changed).
        self._sel_sets: dict[PeerSelector, dict[int, frozenset[str]]] = {}
        # Each pod's addresses the tables hold as text, a tuple per family (of ``families``),
        # with the record and lost addresses they were made of (good while those are the same).
        self._texts: dict[PodKey, tuple[Pod, frozenset[Address] | None, tuple[tuple[str, ...], ...]]] = {}
        # Egress named port sources resolved (on the peers: the same for every policy naming
        # them), by IP version: kept until a selector among their peers changes, or, for those
        # resolved on every pod or ipBlocks, any pod's addresses or ports (_all_pods_changed),
        # or a policy naming them is unlaid; indexed by their peers' selectors.
        self._peers_named: dict[compiler.NamedSource, dict[int, frozenset[tuple[str, str, int]]]] = {}
        self._named_by_sel: dict[PeerSelector, set[compiler.NamedSource]] = {}
        self._named_all_pods: set[compiler.NamedSource] = set()
        self._selected: dict[PolicyKey, set[PodKey]] = defaultdict(set)  # local pods each policy selects
        self._pod_policies: dict[PodKey, set[PolicyKey]] = defaultdict(set)

        self._objects: dict[Any, Any] = {}  # the ruleset, kept up to date by build()
        self._touched: set[Any] = set()
        self._compiled: dict[PolicyKey, list[Any]] = {}
        # The chains from the policy alone (compiler.layout) of each policy selecting a local
        # pod, or why it is too large to program: laid out by build() once it selects one
        # (not as it comes: every node hears every policy of the cluster), before any of its
        # members are kept; forgotten, with its members, when it selects none or changes.
        self._layouts: dict[PolicyKey, tuple[compiler.Layout, ...] | str] = {}
        # Policies compiled to empty chains, too large to program (compiler.MAX_POLICY_RULES): why.
        self.too_large: dict[PolicyKey, str] = {}
        self._pod_objects: dict[PodKey, list[Any]] = {}
        self._dirty_policies: set[PolicyKey] = set()
        self._dirty_pods: set[PodKey] = set()
        self._local_dirty = True
        self._base: list[Any] | None = None

    # ------------------------------------------------------------------ namespaces

    def ns_labels(self, namespace: str) -> dict[str, str]:
        return namespace_labels(namespace, self.namespaces.get(namespace))

    def set_namespace(self, name: str, labels: Mapping[str, str] | None) -> None:
        """A Namespace object's labels (None: the object is gone; the namespace stays implicit)."""
        before = self.ns_labels(name)
        if labels is None:
            self.namespaces.pop(name, None)
        else:
            self.namespaces[name] = dict(labels)
        after = self.ns_labels(name)
        if before == after:
            return
        for sel, members in self._members.items():
            if sel.namespaces is None:
                continue
            for key in self._ns_pods.get(name, ()):
                self._recheck(sel, members, self.pods[key], after, changed=False)

    # ------------------------------------------------------------------ pods

    def _note_named(self, ips: Iterable[Address]) -> None:
        """Whom ``ips`` name now, before a change that may give them to another."""
        when = None
        for ip in ips:
            owner = self.by_ip.get(str(ip))
            pod = self.pods.get(owner) if owner is not None else None
            if pod is not None:
                when = self.clock() if when is None else when
                self.named_before.append((str(ip), pod, owner in self.local, when))
                self.named_before_count += 1

    def named_before_since(self, count: int) -> list[tuple[str, Pod, bool, float]] | None:
        """What :attr:`named_before` kept after its first ``count``, oldest first; None if
        some of those are gone (more than NAMED_BEFORE_MAX since)."""
        new = self.named_before_count - count
        if new <= 0:
            return []
        if new > len(self.named_before):
            return None
        return list(itertools.islice(self.named_before, len(self.named_before) - new, None))

    def upsert_pod(self, pod: Pod, local: LocalPort | None = None) -> None:
        key = pod.key
        self._uncut(key)
        old = self.pods.get(key)
        old_local = self.local.get(key)
        if old != pod or old_local != local:
            self._note_named(dict.fromkeys((*old.ips, *pod.ips)) if old is not None else pod.ips)
        self.pods[key] = pod
        self._ns_pods[pod.namespace].add(key)
        if local is not None:
            self.local[key] = local
            self.bridges.add(local.bridge)
        else:
            self.local.pop(key, None)
        self._claim(key, old.ips if old is not None and old_local is not None else (), pod.ips if local else ())
        self._index(key, old.ips if old is not None else (), pod.ips)
        if old != pod:
            changed = old is None or old.ips != pod.ips or old.ports != pod.ports
            labels = self.ns_labels(pod.namespace)
            for sel, members in self._members.items():
                self._recheck(sel, members, pod, labels, changed=changed)
            # Egress named ports toward every pod or ipBlocks resolve on any pod's addresses and
            # ports: its labels alone change none of them (a selector of such a rule whose
            # members they change marks the policy dirty in _recheck).
            if changed:
                self._all_pods_changed()
        if old != pod or old_local != local:
            self.pods_version += 1
            # Which policies select it: only asked of a pod of this node (or one that was).
            # Another node's pods are in no pod chain nor the base ruleset: their changes
            # reach the tables through the peer selectors' members (_recheck, above) alone,
            # not by building this node's whole base ruleset again at every pod event of the
            # cluster (as remove_pod).
            if local is not None or old_local is not None or key in self._pod_policies:
                self._reselect(key)

    def cut_off(self, key: PodKey, port: LocalPort) -> None:
        """Local pod ``key``, attached at ``port``, is known no better (its endpoint file or
        record cannot be read): gone as a pod (:meth:`remove_pod`), but its port stays a pod
        port with no address and no MAC of its own -- every IP and ARP packet from it spoofed,
        and, where MACs are checked, every frame -- rather than a port nothing checks (whose
        frames could move another pod's forwarding entry, or claim its addresses)."""
        before = self.cut_off_ports.pop(key, None)
        self.remove_pod(key)
        self.cut_off_ports[key] = port
        self.bridges.add(port.bridge)
        if before != port:
            self._local_dirty = True

    def _uncut(self, key: PodKey) -> None:
        if self.cut_off_ports.pop(key, None) is not None:
            self._local_dirty = True

    def remove_pod(self, key: PodKey) -> None:
        self._uncut(key)
        pod = self.pods.get(key)
        if pod is None:
            return
        self._note_named(pod.ips)
        del self.pods[key]
        self.pods_version += 1
        _discard(self._ns_pods, pod.namespace, key)
        self._claim(key, pod.ips if key in self.local else (), ())
        self._index(key, pod.ips, ())
        self._texts.pop(key, None)
        for sel, members in self._members.items():
            if key in members:
                members.discard(key)
                self._sel_changed(sel)
        self._all_pods_changed()
        if self.local.pop(key, None) is not None or key in self._pod_policies:
            self._reselect(key)

    def _claim(self, key: PodKey, before: tuple[Address, ...], after: tuple[Address, ...]) -> None:
        """Local pod ``key`` claims ``after`` now, ``before`` until now: which local pods lose
        an address to another (see the module's doc)."""
        for ip in before:
            claims = self._claims.get(ip)
            if claims is not None:
                claims.discard(key)
                if not claims:
                    del self._claims[ip]
        for ip in after:
            self._claims.setdefault(ip, set()).add(key)
        affected = {key}
        for ip in (*before, *after):
            affected |= self._claims.get(ip, set())
            self._name_address(ip)
        for k in sorted(affected):
            pod, port = self.pods.get(k), self.local.get(k)
            mine = pod.ips if pod is not None and port is not None else ()
            lost = frozenset(ip for ip in mine if self._owner(ip) != k)
            if lost == self._lost.get(k, frozenset()):
                continue
            if lost:
                self._lost[k] = lost
            else:
                self._lost.pop(k, None)
            # Its addresses as the tables see them changed: as if its record had.
            for sel, members in self._members.items():
                if k in members:
                    self._sel_changed(sel)
            self._all_pods_changed()
            self._reselect(k)

    def _owner(self, ip: Address) -> PodKey | None:
        claims = self._claims.get(ip)
        if not claims:
            return None
        return max(claims, key=lambda k: (self.local[k].since, k))

    def conflicts(self) -> dict[Address, tuple[PodKey, list[PodKey]]]:
        """Addresses more than one local pod claims: the pod that has it, the others."""
        return {ip: (owner, sorted(claims - {owner}))
                for ip, claims in self._claims.items() if len(claims) > 1 and (owner := self._owner(ip)) is not None}

    def _index(self, key: PodKey, before: tuple[Address, ...], after: tuple[Address, ...]) -> None:
        """Pod ``key`` claims ``after`` now, ``before`` until now (its record's addresses):
        whom each names (:meth:`_name_address`; asked again when they are the same: its
        record's creation time may not be)."""
        if before != after:
            for ip in before:
                _discard(self._ip_pods, str(ip), key)
            for ip in after:
                self._ip_pods.setdefault(str(ip), set()).add(key)
        for ip in dict.fromkeys((*before, *after)):
            self._name_address(ip)

    def _name_address(self, ip: Address) -> None:
        """Whom ``ip`` names (by_ip), whatever order the claimants came and went in: the local
        pod that has it in this node's tables (:meth:`_owner`), else of the pods claiming it the
        one whose record is the newest (creationTimestamp, then namespace/name: their node's
        tables give it to the newer endpoint file's pod), else nobody."""
        text = str(ip)
        owner = self._owner(ip)
        if owner is None:
            claims = [k for k in self._ip_pods.get(text, ()) if k in self.pods]  # (one going: not yet out of it)
            if claims:
                owner = max(claims, key=lambda k: (self.pods[k].created, k))
        if owner is None:
            self.by_ip.pop(text, None)
        else:
            self.by_ip[text] = owner

    def _recheck(self, sel: PeerSelector, members: set[PodKey], pod: Pod, ns_labels: Mapping[str, str], *, changed: bool) -> None:
        key = pod.key
        was = key in members
        now = sel.matches(pod, ns_labels)
        if now:
            members.add(key)
        else:
            members.discard(key)
        if was != now or (now and changed):
            self._sel_changed(sel)

    def _sel_changed(self, sel: PeerSelector) -> None:
        """The members of kept selector ``sel``, or the addresses of one, changed: the policies
        reading it are compiled again, its addresses worked out again."""
        self._dirty_policies |= self._sel_refs[sel]
        self._sel_sets.pop(sel, None)
        self._forget_named(self._named_by_sel.get(sel, ()))

    def _all_pods_changed(self) -> None:
        """A pod's addresses or named ports changed, or it came or went: the policies with
        egress named ports toward every pod or ipBlocks are compiled again, those sources
        resolved again."""
        self._dirty_policies |= self._all_pods_refs
        self._forget_named(self._named_all_pods)

    def _forget_named(self, sources: Iterable[compiler.NamedSource]) -> None:
        for source in list(sources):
            if self._peers_named.pop(source, None) is None:
                continue
            self._named_all_pods.discard(source)
            for peer in source.peers or ():
                if peer.selector is not None:
                    _discard(self._named_by_sel, peer.selector, source)

    def _reselect(self, key: PodKey) -> None:
        """Which policies select local pod ``key`` (after it changed, came or went)."""
        before = set(self._pod_policies.get(key, ()))
        pod = self.pods.get(key)
        after: set[PolicyKey] = set()
        if pod is not None and key in self.local:
            after = {p for p in self._ns_policies.get(pod.namespace, ()) if self.policies[p].selects(pod)}
        for p in before - after:  # (a policy removed is no longer in _selected: not put back)
            _discard(self._selected, p, key)
        for p in after:
            self._selected[p].add(key)
        if after:
            self._pod_policies[key] = after
        else:
            self._pod_policies.pop(key, None)
        # The pod's chains, the bridge sets, and the policies whose selection or whose
        # ingress named ports (resolved on the selected pods) may differ.
        self._dirty_policies |= before | after
        self._selection_changed((key,))

    def _selection_changed(self, keys: Iterable[PodKey]) -> None:
        """The policies selecting local pods ``keys`` changed: their chains and the base
        ruleset (which pods are isolated) are built again."""
        self._dirty_pods.update(keys)
        self._local_dirty = True
        self._prefixes = self._chains = None

    # ------------------------------------------------------------------ policies

    def upsert_policy(self, policy: Policy) -> None:
        key = policy.key
        if self.policies.get(key) == policy:
            return
        if key in self.policies:
            self._forget_policy(key)
        self.policies[key] = policy
        self._ns_policies[policy.namespace].add(key)
        # Nothing is laid out or kept for it here (its limits are checked as it is laid out,
        # before anything of it is kept): only whether it selects a local pod is asked.  No
        # other policy's selection changes: its own entries are added, not each pod's
        # selecting policies asked again (:meth:`_reselect`: for a burst of policies of one
        # namespace, an etcd snapshot, that was quadratic in them).
        selected = [k for k in self.local if (pod := self.pods.get(k)) is not None and policy.selects(pod)]
        if selected:
            self._selected[key].update(selected)
            for pod_key in selected:
                self._pod_policies[pod_key].add(key)
            self._selection_changed(selected)
        self._dirty_policies.add(key)

    def _match_all(self, sel: PeerSelector) -> set[PodKey]:
        """The pods ``sel`` matches: namespace by namespace (its pod selector asked only in
        those its namespace part takes)."""
        out: set[PodKey] = set()
        for ns, keys in self._ns_pods.items():
            if sel.namespace is not None and ns != sel.namespace:
                continue
            if sel.namespaces is not None and not sel.namespaces.matches(self.ns_labels(ns)):
                continue
            if sel.pods.empty:
                out |= keys
            else:
                out.update(k for k in keys if sel.pods.matches(self.pods[k].labels))
        return out

    def remove_policy(self, key: PolicyKey) -> None:
        if key not in self.policies:
            return
        self._forget_policy(key)
        self._dirty_policies.add(key)

    def _forget_policy(self, key: PolicyKey) -> None:
        policy = self.policies.pop(key)
        _discard(self._ns_policies, policy.namespace, key)
        self._unlay(key, policy)
        selected = self._selected.pop(key, set())  # (only its own entries: as upsert_policy)
        for pod_key in selected:
            _discard(self._pod_policies, pod_key, key)
        if selected:
            self._selection_changed(selected)

    def _laid_out(self, key: PolicyKey, policy: Policy) -> tuple[compiler.Layout, ...] | str:
        """The policy's chains from the policy alone, or why it is too large to program: laid
        out once (then kept until :meth:`_unlay`), and only then are its peers' members kept."""
        layouts = self._layouts.get(key)
        if layouts is not None:
            return layouts
        try:
            layouts = compiler.layout(policy, self.families)
        except compiler.PolicyTooLarge as err:
            # Refused from the policy alone: none of its peers' members are worked out or
            # kept (it compiles to empty chains whatever they are).
            layouts = str(err)
        self._layouts[key] = layouts
        if not isinstance(layouts, str):
            for sel in _peer_selectors(policy):
                if sel not in self._members:
                    self._members[sel] = self._match_all(sel)
                self._sel_refs[sel].add(key)
            if _needs_all_pods(policy):
                self._all_pods_refs.add(key)
        return layouts

    def _unlay(self, key: PolicyKey, policy: Policy) -> None:
        """Forget the policy's layout and the members kept for it (its peers' that no other
        laid-out policy has)."""
        layouts = self._layouts.pop(key, None)
        if layouts is None or isinstance(layouts, str):
            return
        self._forget_named(s.source for layout in layouts for s in layout.sets if isinstance(s.source, compiler.NamedSource))
        for sel in _peer_selectors(policy):
            refs = self._sel_refs[sel]
            refs.discard(key)
            if not refs:
                del self._sel_refs[sel]
                self._members.pop(sel, None)
                self._sel_sets.pop(sel, None)
        self._all_pods_refs.discard(key)

    # ------------------------------------------------------------------ queries

    def selecting(self, key: PodKey) -> list[Policy]:
        return [self.policies[p] for p in sorted(self._pod_policies.get(key, ()))]

    def isolation(self, key: PodKey) -> tuple[bool, bool]:
        """(ingress isolated, egress isolated) of a local pod."""
        policies = self.selecting(key)
        return any(p.ingress is not None for p in policies), any(p.egress is not None for p in policies)

    def drop_origin(self, prefix: str) -> tuple[str, PodKey] | None:
        """Which local pod's chain, in which direction ("in", "out"), a drop log prefix names."""
        if self._prefixes is None:
            self._prefixes = {
                compiler.drop_prefix(compiler.pod_chain(d, *key)): (d, key) for key in self.local for d in ("in", "out")
            }
        return self._prefixes.get(prefix)

    def chain_origin(self, chain: str) -> tuple[str, PodKey] | None:
        """Which local pod, in which direction ("in", "out"), a pod chain (and its counter)
        belongs to: by the name each local pod's chain gets (a long one is a hash)."""
        if self._chains is None:
            self._chains = {compiler.pod_chain(d, *key): (d, key) for key in self.local for d in ("in", "out")}
        return self._chains.get(chain)

    def denying(self, key: PodKey, direction: str) -> tuple[list[str], bool]:
        """The policies isolating local pod ``key`` in ``direction`` ("in", "out") -- a drop
        there means none of them allows the packet -- and whether that is a default deny
        (none of them has a rule in that direction at all; never with no policy)."""
        attr = "ingress" if direction == "in" else "egress"
        chosen = [p for p in self.selecting(key) if getattr(p, attr) is not None]
        return [f"{p.namespace}/{p.name}" for p in chosen], bool(chosen) and all(not getattr(p, attr) for p in chosen)

    def drop_explanations(self) -> dict[str, tuple[str, PodKey, tuple[str, ...], bool]]:
        """Each local pod chain's drop log prefix -> (direction "in"/"out", the pod, the policies
        isolating it that way, default deny), as the engine has them now: the agent keeps the
        one of the build it last programmed, so that a drop the kernel logged is explained by
        the policies its rules were built from, not by those of a change not programmed yet."""
        out = {}
        for key in self.local:
            if key not in self.pods:
                continue
            for direction in ("in", "out"):
                policies, default_deny = self.denying(key, direction)
                if policies:  # (a pod chain in that direction)
                    prefix = compiler.drop_prefix(compiler.pod_chain(direction, *key))
                    out[prefix] = (direction, key, tuple(policies), default_deny)
        return out

    def members(self, policy: Policy, rule: Rule) -> set[PodKey]:
        """The pods the selector peers of ``rule`` match."""
        out: set[PodKey] = set()
        for peer in rule.peers or ():
            if peer.selector is not None:
                out |= self._selector_members(peer.selector)
        return out

    def _selector_members(self, sel: PeerSelector) -> set[PodKey]:
        """The pods ``sel`` matches: as kept for the policies laid out, else worked out now
        (a policy not laid out yet: views may ask before build() has)."""
        members = self._members.get(sel)
        return members if members is not None else self._match_all(sel)

    def addresses(self, pod: Pod) -> tuple[Address, ...]:
        """The addresses of ``pod`` this node's tables hold: those of the cluster's families
        (not those a newer local pod has, see the module's doc)."""
        lost = self._lost.get(pod.key)
        return tuple(ip for ip in pod.ips if ip.version in self.families and not (lost and ip in lost))

    def rule_members(self, policy: Policy, direction: str, rule: Rule) -> compiler.RuleMembers:
        """What one rule allows, resolved (for views: the compiled sets are filled per
        distinct selector and named port source, :meth:`selector_addresses`, :meth:`named_members`)."""
        pods = self.members(policy, rule)
        ips = frozenset(ip for k in pods for ip in self.addresses(self.pods[k]))
        names = tuple(sorted({(p.port, p.protocol) for p in rule.ports or () if isinstance(p.port, str)}))
        named: frozenset[tuple[str, str, int]] = frozenset()
        if names:
            peers = (frozenset(rule.peers) if rule.peers is not None else None) if direction == "out" else None
            named = self.named_members(policy, compiler.NamedSource(direction, names, peers))  # type: ignore[arg-type]
        return compiler.RuleMembers(ips, named)

    def rule_count(self, policy: Policy, direction: str, rule: Rule) -> int:
        """How many addresses and named ports :meth:`rule_members` would give (for views: what
        an answer leaves out of its lists), from the sets kept for the compiled policies where
        there are some (a rule's peers' addresses a union of its selectors', not sorted)."""
        count = 0
        selectors = [peer.selector for peer in rule.peers or () if peer.selector is not None]
        if selectors:
            kept = [self._sel_sets.get(sel) for sel in selectors]
            if all(sets is not None for sets in kept):
                by_version: dict[int, set[str]] = defaultdict(set)
                for sets in kept:
                    for version, addresses in sets.items():  # type: ignore[union-attr]
                        by_version[version] |= addresses
                count += sum(len(addresses) for addresses in by_version.values())
            else:
                count += len({ip for k in self.members(policy, rule) for ip in self.addresses(self.pods[k])})
        names = tuple(sorted({(p.port, p.protocol) for p in rule.ports or () if isinstance(p.port, str)}))
        if names:
            peers = (frozenset(rule.peers) if rule.peers is not None else None) if direction == "out" else None
            source = compiler.NamedSource(direction, names, peers)  # type: ignore[arg-type]
            named = self._peers_named.get(source) if direction == "out" else None
            count += sum(map(len, named.values())) if named is not None else len(self.named_members(policy, source))
        return count

    def selector_addresses(self, selector: PeerSelector) -> dict[int, frozenset[str]]:
        """The addresses (this node's tables hold) of the pods kept selector ``selector``
        matches, as text, by IP version (each of ``families``)."""
        out: list[set[str]] = [set() for _ in self.families]
        for k in self._members.get(selector, ()):
            for into, texts in zip(out, self._address_texts(k)):
                into.update(texts)
        return {version: frozenset(texts) for version, texts in zip(self.families, out)}

    def _address_texts(self, key: PodKey) -> tuple[tuple[str, ...], ...]:
        """Pod ``key``'s addresses the tables hold (:meth:`addresses`) as text, a tuple per
        family of ``families``: made once while its record and lost addresses stay the same."""
        pod, lost = self.pods[key], self._lost.get(key)
        kept = self._texts.get(key)
        if kept is not None and kept[0] is pod and kept[1] is lost:
            return kept[2]
        ips = self.addresses(pod)
        texts = tuple(tuple(str(ip) for ip in ips if ip.version == version) for version in self.families)
        self._texts[key] = (pod, lost, texts)
        return texts

    def named_members(self, policy: Policy, source: compiler.NamedSource) -> frozenset[tuple[str, str, int]]:
        """(address, l4proto, port) of the named ports ``source`` names, resolved on the
        destinations: for "in" the pods ``policy`` selects, for "out" its peers."""
        # The destinations a named port is resolved on, each with the addresses it has as
        # one (a pod a selector matches: all of them; one an ipBlock holds: those inside).
        members: set[PodKey] | None = None  # ipBlocks among the peers: the pods a selector matches
        blocks = []
        keys: Iterable[PodKey]
        if source.direction == "in":
            keys = self._selected.get(policy.key, ())
        elif source.peers is None:
            keys = self.pods
        else:
            members = set()
            for peer in source.peers:
                if peer.selector is not None:
                    members |= self._selector_members(peer.selector)
            blocks = [p.block for p in source.peers if p.block is not None]
            keys = self.pods if blocks else members
        ports = [(name, protocol, compiler.l4proto(protocol)) for name, protocol in source.ports]
        named: set[tuple[str, str, int]] = set()
        for k in keys:
            pod = self.pods[k]
            numbers = [(proto, n) for name, protocol, proto in ports if (n := pod.named_port(name, protocol)) is not None]
            if not numbers:
                continue
            if blocks and k not in members:  # type: ignore[operator]
                texts: Iterable[str] = [str(ip) for ip in self.addresses(pod) if any(b.contains(ip) for b in blocks)]
            else:
                texts = [text for family in self._address_texts(k) for text in family]
            named.update((text, proto, n) for text in texts for proto, n in numbers)
        return frozenset(named)

    def _named(self, policy: Policy, source: compiler.NamedSource) -> dict[int, frozenset[tuple[str, str, int]]]:
        """:meth:`named_members` by IP version; an egress source's kept (:attr:`_peers_named`)."""
        if source.direction == "out":
            kept = self._peers_named.get(source)
            if kept is not None:
                return kept
        named = self.named_members(policy, source)
        by_version: dict[int, set[tuple[str, str, int]]] = defaultdict(set)
        for element in named:
            by_version[compiler.version_of(element[0])].add(element)
        out = {version: frozenset(elements) for version, elements in by_version.items()}
        if source.direction == "out":
            self._peers_named[source] = out
            selectors = [p.selector for p in source.peers or () if p.selector is not None]
            for sel in selectors:
                self._named_by_sel.setdefault(sel, set()).add(source)
            if source.peers is None or len(selectors) < len(source.peers):  # every pod, or ipBlocks
                self._named_all_pods.add(source)
        return out

    def _fill(self, policy: Policy, layouts: tuple[compiler.Layout, ...]) -> list[Any]:
        """The policy's chains and their sets, filled: each distinct selector's, set of a
        rule's selectors' and named port source's members worked out once, at most
        compiler.MAX_POLICY_ELEMENTS elements in all (PolicyTooLarge as soon as they are more)."""
        total = 0
        addresses: dict[frozenset[PeerSelector], dict[int, frozenset[str]]] = {}
        named: dict[compiler.NamedSource, dict[int, frozenset[tuple[str, str, int]]]] = {}
        elements: dict[str, frozenset[Any]] = {}
        for layout in layouts:
            for s in layout.sets:
                got: frozenset[Any]
                if isinstance(s.source, compiler.NamedSource):
                    if s.source not in named:
                        named[s.source] = self._named(policy, s.source)
                    got = named[s.source].get(s.family.version, frozenset())
                else:
                    if s.source not in addresses:
                        addresses[s.source] = self._union(policy, s.source, total)
                    got = addresses[s.source].get(s.family.version, frozenset())
                total += len(got)
                if total > compiler.MAX_POLICY_ELEMENTS:
                    raise compiler.too_many_elements(policy, total)
                elements[s.name] = got
        return [obj for layout in layouts for obj in layout.fill(elements)]

    def _union(self, policy: Policy, selectors: frozenset[PeerSelector], total: int) -> dict[int, frozenset[str]]:
        """The addresses of the pods any of ``selectors`` matches, by IP version (each
        selector's kept across policies and builds: :attr:`_sel_sets`), or PolicyTooLarge as
        soon as they and the ``total`` elements before them are over
        compiler.MAX_POLICY_ELEMENTS (the union is in a set of each family: together it is
        counted once)."""
        out: dict[int, frozenset[str] | set[str]] = {}
        for sel in selectors:
            sets = self._sel_sets.get(sel)
            if sets is None:
                sets = self.selector_addresses(sel)
                if sel in self._members:
                    self._sel_sets[sel] = sets
            count = 0
            for version, addresses in sets.items():
                have = out.get(version)
                if not have:
                    have = out[version] = addresses  # (one selector: its own, no copy)
                elif addresses:
                    if isinstance(have, frozenset):
                        have = out[version] = set(have)
                    have |= addresses
                count += len(have)
            if total + count > compiler.MAX_POLICY_ELEMENTS:
                raise compiler.too_many_elements(policy, total + count)
        return {version: frozenset(addresses) for version, addresses in out.items()}

    # ------------------------------------------------------------------ compile

    def set_route_services(self, on: bool) -> bool:
        """Route every local pod's traffic while Services translate (see ``route_services``;
        not where br_netfilter hands it to conntrack bridged: ``bridged_to_ip``); whether that
        changed anything."""
        if on == self.route_services:
            return False
        self.route_services = on
        self._local_dirty = True
        return True

    def set_bridged_to_ip(self, on: bool) -> bool:
        """Whether br_netfilter hands bridged frames of every pod family to the IP hooks (see
        ``bridged_to_ip``); whether that changed what is built."""
        if on == self.bridged_to_ip:
            return False
        self.bridged_to_ip = on
        if not (self.route_all or self.route_services):
            return False
        self._local_dirty = True
        return True

    @property
    def routes_every_pod(self) -> bool:
        """Every local pod's unicast goes up to the IP stack, isolated or not: for flow records
        (``route_all``) or Services (``route_services``), where conntrack would not see it
        bridged (``bridged_to_ip``)."""
        return (self.route_all or self.route_services) and not self.bridged_to_ip

    @property
    def dirty(self) -> bool:
        return bool(self._dirty_policies or self._dirty_pods or self._local_dirty or self._base is None)

    def build(self) -> Ruleset:
        """The ruleset this node should have now (recompiling only what changed).

        The objects it returns are the engine's own (do not modify them); :meth:`touched`
        tells which of them changed since it was last asked."""
        for key in self._dirty_policies:
            policy = self.policies.get(key)
            objects: list[Any] = []
            self.too_large.pop(key, None)
            if policy is not None and not self._selected.get(key):
                self._unlay(key, policy)  # (selecting no local pod: nothing of it is kept)
            elif policy is not None:
                try:
                    layouts = self._laid_out(key, policy)
                    if isinstance(layouts, str):
                        raise compiler.PolicyTooLarge(layouts)
                    objects = self._fill(policy, layouts)
                except compiler.PolicyTooLarge as err:
                    # Empty chains (the pods' chains jump to them): the policy still isolates
                    # the pods it selects and allows nothing; the other policies are as ever.
                    self.too_large[key] = str(err)
                    objects = compiler.refused_policy(policy)
            self._replace(self._compiled.pop(key, []), objects)
            if objects:
                self._compiled[key] = objects
        self._dirty_policies.clear()
        for key in self._dirty_pods:
            objects = []
            if key in self.local and key in self.pods:
                pod = self.pods[key]
                policies = self.selecting(key)
                for direction, attr in (("in", "ingress"), ("out", "egress")):
                    chosen = [p for p in policies if getattr(p, attr) is not None]
                    if chosen:
                        objects += compiler.compile_pod_chain(direction, pod.namespace, pod.name, chosen,
                                                              self.drop_log)
            self._replace(self._pod_objects.pop(key, []), objects)
            if objects:
                self._pod_objects[key] = objects
        self._dirty_pods.clear()
        if self._base is None or self._local_dirty:
            base = self._base_objects()
            self._replace(self._base or [], base)
            self._base = base
            self._local_dirty = False
        return Ruleset(compiler.TABLES, self._objects)

    def _replace(self, old: list[Any], new: list[Any]) -> None:
        for obj in old:
            self._objects.pop(obj.key, None)
            self._touched.add(obj.key)
        for obj in new:
            self._objects[obj.key] = obj
            self._touched.add(obj.key)

    def touched(self) -> set[Any]:
        """Keys of the objects built anew since the last call (changed or not)."""
        out, self._touched = self._touched, set()
        return out

    def _base_objects(self) -> list[Any]:
        """The fixed objects with this node's local pods filled in (dispatch maps, bridge sets)."""
        from dataclasses import replace

        elements: dict[str, set[Any]] = defaultdict(set)
        na_targets: dict[str, set[str]] = {}  # a pod port's IPv6 addresses (of every pod with the port: one)
        lla_macs: dict[str, str] = {}  # a MAC-checked pod port's pod's MAC, for its neighbour discovery options
        cut = list(self.cut_off_ports.values())
        for key, port in self.local.items():
            pod = self.pods.get(key)
            if pod is None or not any(ip.version in self.families for ip in pod.ips):
                # No address of the cluster's families (an IPv6-only endpoint file in an IPv4
                # cluster): nothing it sends is its own, but its port is checked all the same.
                cut.append(port)
                continue
            # Without the addresses a newer pod has: a stale pod's port stays a pod port (its
            # packets with them are spoofed ones) but is no way to them.
            addresses = [(FAMILIES[ip.version], str(ip)) for ip in self.addresses(pod)]
            ingress, egress = self.isolation(key)
            elements["pod-ports"].add(port.interface)
            elements["port-macs"].add((port.interface, port.mac))
            if (port.pod_mac or port.mac_refused) and self.check_source_mac:
                elements[compiler.MAC_PORTS].add(port.interface)
                if port.pod_mac:  # (a refused one: checked against none, cut off)
                    elements[compiler.POD_MACS].add((port.interface, port.pod_mac))
            # its unicast goes up to the IP stack (route_all, route_services: only where conntrack
            # would not see it bridged)
            routed = ingress or egress or self.routes_every_pod
            if routed:
                elements["isolated-ports"].add(port.interface)
            if ingress:
                elements["isolated-in-ports"].add(port.interface)
            if egress:
                elements["isolated-out-ports"].add(port.interface)
            if 6 in self.families:  # every pod port, with IPv6 addresses or none
                elements[compiler.NA_PORTS].add((port.interface, ("jump", compiler.na_chain(port.interface))))
                na_targets.setdefault(port.interface, set()).update(ip for f, ip in addresses if f.version == 6)
                # where its MAC is known and checked (a refused one's port is cut off already)
                if port.pod_mac and self.check_source_mac:
                    elements[compiler.LLA_PORTS].add((port.interface, ("jump", compiler.lla_chain(port.interface))))
                    lla_macs[port.interface] = port.pod_mac
            for f, ip in addresses:
                elements[f.name("pod-addrs")].add((port.interface, ip))
                elements[f.name("addr-macs")].add((ip, port.mac))
                if routed:
                    elements[f.name("isolated-addrs")].add(ip)
                if ingress or egress:  # reaching itself through a Service: never judged
                    elements[f.name(compiler.SELF)].add((ip, ip))
                    elements[f.name(compiler.SELF_PORTS)].add((port.interface, ip, ip))
                if ingress:
                    elements[f.name(compiler.INGRESS_MAP)].add((ip, ("jump", compiler.pod_chain("in", *key))))
                if egress:
                    elements[f.name(compiler.EGRESS_MAP)].add((ip, ("jump", compiler.pod_chain("out", *key))))
        for port in cut:
            # A pod port with no address (every IP and ARP packet from it spoofed) and, where
            # MACs are checked, no MAC (every frame dropped); its neighbour advertisements
            # target none of its own (merged with a pod's of the same port, should there be one).
            elements["pod-ports"].add(port.interface)
            if self.check_source_mac:
                elements[compiler.MAC_PORTS].add(port.interface)
            if 6 in self.families:
                elements[compiler.NA_PORTS].add((port.interface, ("jump", compiler.na_chain(port.interface))))
                na_targets.setdefault(port.interface, set())
        out = []
        # Only a pod that a policy isolates needs the base chains to look at conntrack (replies
        # accepted as established, the Services hairpin): without one the dispatch maps are
        # empty and every packet is accepted all the same -- pods routed up for flow records or
        # Services (isolated-ports without br_netfilter) included.  Flow records and Services
        # need conntrack too, but their own ct and nat expressions (the flows' output chain, the
        # Services' DNAT) make the kernel track the namespace's connections: two more rules in
        # each forward chain would cost every packet the node forwards through its stack.
        stateful = bool(elements["isolated-in-ports"] or elements["isolated-out-ports"])
        for obj in compiler.base_objects(sorted(self.bridges), stateful, self.drop_log, self.families,
                                           self.service_ranges):
            if obj.kind == "set" and obj.name in elements:
                obj = replace(obj, elements=frozenset(elements[obj.name]))
            out.append(obj)
        return out + [compiler.compile_na_chain(port, ips, self.drop_log) for port, ips in sorted(na_targets.items())] + [
            compiler.compile_lla_chain(port, mac, self.drop_log) for port, mac in sorted(lla_macs.items())]


def _peer_selectors(policy: Policy) -> set[PeerSelector]:
    out = set()
    for rules in (policy.ingress, policy.egress):
        for rule in rules or ():
            for peer in rule.peers or ():
                if peer.selector is not None:
                    out.add(peer.selector)
    return out


def _needs_all_pods(policy: Policy) -> bool:
    """Egress named ports toward ipBlocks or every peer resolve on any pod of the cluster."""
    for rule in policy.egress or ():
        if any(isinstance(p.port, str) for p in rule.ports or ()):
            if rule.peers is None or any(p.block is not None for p in rule.peers):
                return True
    return False


def _discard(index: dict[Any, set[Any]], key: Any, member: Any) -> None:
    """``member`` out of ``index[key]``, and the key out of ``index`` when its set is empty
    (namespaces and policies come and go: the indexes hold only those that have members)."""
    members = index.get(key)
    if members is not None:
        members.discard(member)
        if not members:
            del index[key]
