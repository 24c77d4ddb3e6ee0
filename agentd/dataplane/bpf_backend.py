"""The BPF data path as the agent runs it (agentd.dataplane.bpf is the mechanism).

One :class:`BpfPath` per node: the two tc programs on the underlay device and their pinned
maps serve every backend carried in BPF (udp, ipip: encapsulation and decapsulation) and the
member filter of every backend that has one (the same two, and VXLAN's port, whose kernel
device takes packets from anyone).  :class:`InBpf` is the per-backend face agentd.dataplane.backends
drives, like its vxlan-device and user-space implementations.

The maps are filled from the same reconcile that programs the kernel routes
(agentd.dataplane.backends.Tunnels): routes (pod subnet -> peer, kind; IPv4 and IPv6 subnets
alike, :meth:`BpfPath.sync` puts each in its family's map), members (every node's underlay
address), config (ports, which backends to decapsulate or filter).  An IPv6 pod subnet's
kernel route goes via the peer's IPv4-mapped address (``datapath.gateway6``), whose
neighbour entry the same sync keeps.  Before BGP has re-learned
everything after a restart (``prune`` False) nothing is removed from them -- not a route, not
a member, not a backend's flag -- exactly like the kernel routes adopted at start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from ipaddress import IPv4Network, IPv6Network
from typing import TYPE_CHECKING, Any

from agentd.backend_table import BACKENDS
from agentd.dataplane.bpf import BpfDatapath, BpfUnavailable, Config, layout

if TYPE_CHECKING:
    from agentd.config.settings import Config as AgentConfig
    from agentd.kernel.netinfo import Underlay

log = logging.getLogger("agentd.backends")

# BACKENDS[...].member_filter -> the config flag that turns it on in the ingress program.
FILTER_FLAGS = {"udp": layout.CFG_DECAP_UDP, "ipip": layout.CFG_DECAP_IPIP, "vxlan": layout.CFG_FILTER_VXLAN}
# Decapsulation flags of newer kernels: always offered, the program drops what its kernel refuses.
KERNEL_FLAGS = layout.CFG_DECAP_L3_FLAG | layout.CFG_DECAP_L4_FLAGS


class BpfPath:
    def __init__(self, cfg: AgentConfig, underlay: Underlay) -> None:
        self.cfg = cfg
        self.underlay = underlay
        self.dp: BpfDatapath | None = None
        self.error: str | None = None  # why it cannot run here (then it never will, this run)
        self.carried: set[str] = set()  # backends encapsulated and decapsulated here
        self.filtered: set[str] = set()  # backends whose member filter is here
        self.counters: dict[str, Any] = {}
        # Who needs decapsulated packets on the stack's path, where netfilter judges them and
        # conntrack sees both directions, instead of bpf_redirect past it (see hold_redirect):
        # "policy" while NetworkPolicy isolates a pod of this node, "services" while Services
        # are translated here (a reply must meet its connection's NAT), each also until its
        # agent has synced once; "flows" while connection records are kept (conntrack must see
        # every connection start and end; not for drops only, [flows] connections = false).
        self.holders: set[str] = set()
        # While it is held, the pod fast path's wire program (podpath.c), after ours on the
        # underlay's ingress hook, judges decapsulated packets (datapath.c deliver_gated): TCP
        # that conntrack accepted still goes straight to its pod.  None: no pod fast path here
        # (held, every decapsulated packet takes the stack's path); else its program's name.
        self.gate: str | None = None
        self.gated = False  # it is there, after ours (checked when the data path comes up)
        # redirect_held as hold_redirect (or the data path's first config) last wrote it: a
        # write that failed or was cancelled leaves it, so that the next call writes again.
        self._written_held: bool | None = None
        self._ports_error = ""  # the last bridge ports sync's failure, logged once
        self._lock = asyncio.Lock()

    @property
    def redirect_held(self) -> bool:
        return bool(self.holders)

    @property
    def redirecting(self) -> bool:
        return self.cfg.network.bpf_pod_redirect and not self.redirect_held

    @property
    def delivery(self) -> str:
        """How decapsulated packets reach this node's pods: "direct" (all straight to the pods'
        bridge ports), "gated" (accepted, established TCP straight into the pod, the rest by
        the stack's path) or "stack" (all by the stack's path)."""
        if self.redirecting:
            return "direct"
        return "gated" if self.gated else "stack"

    def config(self, extra: Iterable[str] = ()) -> Config:
        flags = KERNEL_FLAGS | (layout.CFG_POD_REDIRECT if self.redirecting else 0) | \
            (layout.CFG_POD_GATE if self.gated else 0)
        for name in {*self.carried, *self.filtered, *extra}:
            flags |= FILTER_FLAGS.get(BACKENDS[name].member_filter or "", 0)
        net = self.cfg.network
        ip = self.underlay.interface.ip
        # An IPv6 underlay (an IPv6-only cluster): no IPv4 address to encapsulate from or
        # decapsulate at; the member filter judges VXLAN to the IPv6 one (config6).
        local, local6 = (str(ip), None) if ip.version == 4 else ("0.0.0.0", str(ip))
        return Config(local, net.udp_port, net.vxlan_port, flags, self.underlay.mtu, local6)

    async def up(self, *, carry: str | None = None, filter: str | None = None) -> None:
        """Load (or adopt) the data path once, with ``carry``/``filter`` in its config from the
        first write; raises :class:`BpfUnavailable` with the reason it cannot run here."""
        async with self._lock:
            if self.dp is None:
                if self.error is not None:
                    raise BpfUnavailable(self.error)
                dp = BpfDatapath(self.underlay.ifindex, self.cfg.agent.bpf_dir, attach=self.cfg.network.bpf_attach)
                held = self.redirect_held
                try:
                    await asyncio.to_thread(dp.open, self.config([n for n in (carry, filter) if n]), clear=self._cleared())
                except BpfUnavailable as err:
                    self.error = str(err)
                    raise
                self.dp, self._written_held = dp, held
                await self._check_gate()
                how = f"adopted the pinned maps ({len(dp.routes)} routes, {len(dp.members)} members)" \
                    if dp.adopted else "loaded"
                log.info("BPF data path on %s: %s; programs attached, pins in %s", self.underlay.ifname, how, dp.dir)
            if carry:
                self.carried.add(carry)
            if filter:
                self.filtered.add(filter)

    async def sync(self, routes: Mapping[IPv4Network | IPv6Network, tuple[str, str]], members: set[str] | None,
                   peer_flags: Mapping[str, int], *, prune: bool) -> None:
        """Make the maps say ``routes`` and ``members`` (None: leave the members as they are),
        with ``peer_flags`` (layout.PEER_F_*: whose packets go to this node's workers).

        ``routes``: pod subnet -> (the peer's underlay IPv4 address, backend), for the pod
        subnets of both families the node carries in BPF: IPv4 ones by udp or ipip, IPv6 ones
        by udp only (:meth:`carries`), each routed ``via gateway6(peer) ... onlink`` in the
        kernel; the gateways' neighbour entries follow the IPv6 routes."""
        dp = self.dp
        if dp is None:
            return
        if not prune:
            routes = {**dp.routes, **routes}
            members = None if members is None else members | dp.members
        async with self._lock:  # hold_redirect's config write is not undone by this one's
            await asyncio.to_thread(self._sync, dp, dict(routes), members, dict(peer_flags), not prune)

    async def hold_redirect(self, hold: bool, who: str = "policy") -> None:
        """Stop (``hold``) or resume handing decapsulated packets straight to pods, for ``who``.
        NetworkPolicy calls this before it isolates a pod of this node (the packets must reach
        its netfilter chains from then on) and after the last isolation is gone, Services before
        the first translation and after the last: no window either way.  The redirect resumes
        when no one holds it."""
        if hold:
            self.holders.add(who)
        else:
            self.holders.discard(who)
        async with self._lock:
            held = self.redirect_held
            # Judged against what was last written, not against the holders before this call:
            # a write that failed (the caller retries) or was cancelled is made by the next call.
            if self.dp is None or held == self._written_held:
                return
            await asyncio.to_thread(self.dp.set_config, self.config(), keep=True, clear=self._cleared())
            self._written_held = held
        if self.carried and self.cfg.network.bpf_pod_redirect:  # else there is no redirect to speak of
            how = "TCP that conntrack accepted straight to the pods, the rest by" if self.delivery == "gated" \
                else "by"
            log.info("BPF: decapsulated packets for pods %s", f"go {how} the stack's path ({who} needs netfilter here)"
                     if hold else "go straight to the pods' bridge ports again")

    async def _check_gate(self) -> None:
        """Whether the pod fast path's wire program runs after ours (tcx puts it last; an
        older cls_bpf filter of it may run first), and the config saying so."""
        dp = self.dp
        if dp is None:
            return
        gated = bool(self.gate and self.cfg.network.bpf_pod_redirect) and \
            await asyncio.to_thread(dp.gated, self.gate)  # type: ignore[arg-type]
        if gated != self.gated:
            self.gated = gated
            await asyncio.to_thread(dp.set_config, self.config(), keep=True, clear=self._cleared())
        if self.gate and not gated and self.cfg.network.bpf_pod_redirect:
            log.warning("BPF: the pod fast path's program on %s does not run after the data path's: decapsulated "
                        "packets take the stack's path while netfilter must see them", self.underlay.ifname)

    def _cleared(self) -> int:
        return (0 if self.redirecting else layout.CFG_POD_REDIRECT) | (0 if self.gated else layout.CFG_POD_GATE)

    def _sync(self, dp: BpfDatapath, routes: dict, members: set[str] | None, flags: dict, keep: bool) -> None:
        dp.set_config(self.config(), keep=keep, clear=self._cleared())
        carried = {dst: v for dst, v in routes.items() if self.carries(v[1], dst.version)}
        if len(carried) < len(routes):
            log.warning("BPF: %d IPv6 pod subnets routed to ipip peers are not carried (ipip is IPv4 only)",
                        len(routes) - len(carried))
        dp.set_gateways6({peer for dst, (peer, _kind) in carried.items() if dst.version == 6})
        dp.set_routes(carried)
        if members is not None:
            dp.set_members(members, flags)

    @staticmethod
    def carries(backend: str, version: int) -> bool:
        """Whether the BPF data path carries pods of IP ``version`` for ``backend``: udp both
        families (flannel UDP's payload is the inner packet), ipip IPv4 only (RFC 2003)."""
        return version == 4 or backend in layout.KINDS6


    async def refresh(self) -> None:
        if self.dp is not None:
            async with self._lock:
                self.counters = await asyncio.to_thread(self._refresh, self.dp)

    async def guard_bridges(self) -> None:
        """Under ``bpf_attach = "clsact"``, guard the pods' bridges now rather than at the next
        refresh: called before a pod no agent has acknowledged yet is acknowledged to
        agentd-cni (its ADD then returns), so that the clsact qdisc a bridge the first pod's
        ADD made needs is added before that bridge carries traffic -- adding a qdisc stops the
        device's transmit queues for a moment, and an agent killed before its next refresh left
        that to the next agent, whose first refresh did it to a bridge in use (a ping lost).
        Under tcx (no qdisc, nothing stopped) it does nothing: the refresh attaches."""
        if self.dp is not None and self.dp.hook == "clsact":
            async with self._lock:
                await asyncio.to_thread(self.dp.guard_bridges)

    def _refresh(self, dp: BpfDatapath) -> dict[str, Any]:
        links = dp.link_kinds()  # one dump of the host's devices: the bridges to guard, the pods' veths
        dp.guard_bridges(links)  # a new pods' bridge gets the member filter within 2 s
        if self.redirecting and self.carried:
            try:
                dp.sync_ports(links)  # the bridges' learned MACs: a new pod is on the direct path within 2 s
            except Exception as err:  # noqa: BLE001 -- the counters are read all the same
                if str(err) != self._ports_error:
                    log.warning("BPF: the bridge ports map not synced: %s; trying again", err)
                self._ports_error = str(err)
            else:
                self._ports_error = ""
        return dp.counters()

    def peer_counters(self, address: str) -> dict[str, int] | None:
        return (self.counters.get("peers") or {}).get(address)

    def status(self) -> dict[str, Any]:
        if self.dp is None:
            return {"active": False, "error": self.error}
        return {
            "active": True,
            "device": self.underlay.ifname,
            "carries": sorted(self.carried),
            # The pod families each carries (outer headers IPv4): udp both, ipip IPv4 only.
            "families": {b: [v for v in (4, 6) if self.carries(b, v)] for b in sorted(self.carried)},
            "filters": sorted(self.carried | self.filtered),
            "redirecting": self.redirecting,  # decapsulated packets straight to pods (not while policy, services or flows need netfilter)
            "delivery": self.delivery,  # direct, gated (accepted TCP straight to pods, the rest by the stack) or stack
            "held_by": sorted(self.holders),
            **self.dp.status(),
            "drops": {k: v["packets"] for k, v in (self.counters.get("drops") or {}).items()},
            "kernel": self.counters.get("kernel") or {},
        }

    async def down(self, remove: bool) -> None:
        """``remove``: detach and unpin everything; else only let go (it all keeps running)."""
        if self.dp is None:
            return
        await asyncio.to_thread(self.dp.remove if remove else self.dp.close)
        self.dp = None


class InBpf:
    """A backend (udp or ipip) carried by the node's :class:`BpfPath`."""

    datapath = "bpf"
    device = None

    def __init__(self, t: Any, name: str) -> None:
        self.t = t
        self.name = name

    async def up(self, subnet: IPv4Network) -> None:
        await self.t.bpf.up(carry=self.name)

    def data(self) -> dict[str, Any]:
        return {key: getattr(self.t.cfg.network, key) for key in BACKENDS[self.name].node_data}

    async def sync(self, plans, next_hops, prune: bool) -> None:
        return None  # the shared BpfPath syncs once for every backend it carries

    def status(self) -> dict[str, Any]:
        dp = self.t.bpf.dp
        return {"datapath": self.datapath, "device": self.t.underlay.ifname, "pins": str(dp.dir) if dp else None}

    async def down(self, remove: bool) -> None:
        if remove:
            self.t.bpf.carried.discard(self.name)
