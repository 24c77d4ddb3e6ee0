"""Tunnel backends: the devices, FDB/neighbour entries and user-space next hops that
encapsulated peers need.  host-gw needs none of it.

The agent runs backends *per peer*: a peer is reached with the backend it advertises in
its node record (``backend.type``), so nodes on different backends still reach each
other.  Our own backend is brought up at start (peers must be able to reach us); any
other is brought up the first time a peer needs it.

=========  =========================================================================
vxlan      kernel VTEP ``agentd.vxlan`` (VNI/port configurable, no learning); per peer a
           permanent neighbour entry (peer VTEP IP -> MAC) and an FDB entry (MAC -> peer
           underlay IP), as flannel does; routes ``subnet via vtep_ip dev agentd.vxlan onlink``.
ipip       kernel ``agentd.ipip`` device where the kernel has ipip (routes ``subnet via peer
           dev agentd.ipip onlink``); otherwise the user-space worker (TUN + raw socket).
udp        the user-space worker (TUN ``agentd.udp`` + UDP 8285, flannel's wire format).
=========  =========================================================================

Encapsulated packets are accepted only from cluster members: the user-space workers
check their member list, and for kernel devices an nftables table ``inet agentd`` drops
IPIP and VXLAN from anyone else (agentd.firewall).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
from collections.abc import Callable, Mapping
from ipaddress import IPv4Network
from pathlib import Path
from typing import Any

from .config import Config, mtu_overhead
from .dataplane import DataplaneClient, DataplaneError, DataplaneProcess
from .datastore import NodeRecord
from .firewall import MemberFilter
from .forwarding import PeerPlan
from .netinfo import Underlay

log = logging.getLogger("agentd.backends")

DEVICES = {"ipip": "agentd.ipip", "vxlan": "agentd.vxlan", "udp": "agentd.udp"}
NTF_SELF = 0x02


def _ipr():
    """pyroute2, imported on first use: only kernel tunnel devices need it, and importing it
    costs every agent ~0.2 s of start-up and ~10 MB."""
    from pyroute2 import IPRoute

    return IPRoute()


def _netlink_error() -> type[Exception]:
    from pyroute2.netlink.exceptions import NetlinkError

    return NetlinkError


def _link_index(ipr, name: str) -> int | None:
    found = ipr.link_lookup(ifname=name)
    return found[0] if found else None


def _set_address(ipr, index: int, address: str) -> None:
    """``address``/32 on the device, replacing any other IPv4 address we put there before."""
    have = [
        (m.get_attr("IFA_LOCAL") or m.get_attr("IFA_ADDRESS"), m["prefixlen"])
        for m in ipr.get_addr(family=2, index=index)
    ]
    for addr, plen in have:
        if (addr, plen) != (address, 32):
            ipr.addr("del", index=index, address=addr, prefixlen=plen)
    if (address, 32) not in have:
        ipr.addr("add", index=index, address=address, prefixlen=32)


class _Vxlan:
    name = "vxlan"

    def __init__(self, t: Tunnels) -> None:
        self.t = t
        self.device = DEVICES["vxlan"]
        self.mac: str | None = None
        self.vtep_ip: str | None = None
        self.installed: dict[str, tuple[str, str]] = {}  # peer underlay -> (vtep ip, mac)

    def _up(self, subnet: IPv4Network) -> None:
        cfg, ul = self.t.cfg.network, self.t.underlay
        mtu = ul.mtu - mtu_overhead("vxlan")
        with _ipr() as ipr:
            index = _link_index(ipr, self.device)
            if index is not None:
                (link,) = ipr.get_links(index)
                info = link.get_attr("IFLA_LINKINFO")
                data = info.get_attr("IFLA_INFO_DATA") if info else None
                same = (
                    data is not None
                    and data.get_attr("IFLA_VXLAN_ID") == cfg.vxlan_vni
                    and data.get_attr("IFLA_VXLAN_PORT") == cfg.vxlan_port
                    and data.get_attr("IFLA_VXLAN_LOCAL") == str(self.t.underlay.interface.ip)
                )
                if not same:
                    log.info("replacing %s: its VNI, port or local address changed", self.device)
                    ipr.link("del", index=index)
                    index = None
            if index is None:
                ipr.link(
                    "add",
                    ifname=self.device,
                    kind="vxlan",
                    vxlan_id=cfg.vxlan_vni,
                    vxlan_port=cfg.vxlan_port,
                    vxlan_local=str(ul.interface.ip),
                    vxlan_link=ul.ifindex,
                    vxlan_learning=0,
                )
                index = _link_index(ipr, self.device)
                assert index is not None
            ipr.link("set", index=index, mtu=mtu, state="up")
            self.vtep_ip = str(subnet.network_address)
            _set_address(ipr, index, self.vtep_ip)
            self.mac = ipr.get_links(index)[0].get_attr("IFLA_ADDRESS")

    async def up(self, subnet: IPv4Network) -> None:
        await asyncio.to_thread(self._up, subnet)

    def data(self) -> dict[str, Any]:
        return {
            "vtep_mac": self.mac,
            "vtep_ip": self.vtep_ip,
            "vni": self.t.cfg.network.vxlan_vni,
            "vxlan_port": self.t.cfg.network.vxlan_port,
        }

    def _sync(self, wanted: dict[str, tuple[str, str]], prune: bool) -> None:
        with _ipr() as ipr:
            index = _link_index(ipr, self.device)
            if index is None:
                return
            for peer, (vtep_ip, mac) in list(self.installed.items()):
                if prune and wanted.get(peer) != (vtep_ip, mac):
                    with contextlib.suppress(_netlink_error()):
                        ipr.neigh("del", dst=vtep_ip, lladdr=mac, ifindex=index)
                    with contextlib.suppress(_netlink_error()):
                        ipr.fdb("del", ifindex=index, lladdr=mac, dst=peer, flags=NTF_SELF)
                    del self.installed[peer]
            for peer, (vtep_ip, mac) in wanted.items():
                if self.installed.get(peer) == (vtep_ip, mac):
                    continue
                ipr.neigh("replace", dst=vtep_ip, lladdr=mac, ifindex=index, state="permanent")
                ipr.fdb("replace", ifindex=index, lladdr=mac, dst=peer, state="permanent", flags=NTF_SELF)
                self.installed[peer] = (vtep_ip, mac)

    async def sync(self, plans: Mapping[str, PeerPlan], next_hops: Mapping[str, list[str]], prune: bool) -> None:
        wanted = {}
        for addr, plan in plans.items():
            if plan.backend == "vxlan" and plan.extra.get("vtep_ip") and plan.extra.get("vtep_mac"):
                wanted[addr] = (str(plan.extra["vtep_ip"]), str(plan.extra["vtep_mac"]))
        await asyncio.to_thread(self._sync, wanted, prune)

    def status(self) -> dict[str, Any]:
        return {"device": self.device, **self.data(), "peers": {p: {"vtep_ip": v, "mac": m} for p, (v, m) in self.installed.items()}}

    async def down(self, remove: bool) -> None:
        if remove:
            await asyncio.to_thread(_delete_link, self.device)


class _Worker:
    """The user-space data plane (udp, or ipip where the kernel has no ipip)."""

    def __init__(self, t: Tunnels, kind: str) -> None:
        self.t = t
        self.name = kind
        self.device = DEVICES[kind]
        self.control_path = control_path(Path(t.cfg.agent.state_dir), kind)
        self.process: DataplaneProcess | None = None
        self.client: DataplaneClient | None = None
        self.pushed: tuple[dict, frozenset] | None = None
        self.base: dict[str, str] = {}  # a re-attached worker's table, kept until routes are re-learned
        self.last_stats: dict[str, Any] = {}

    async def up(self, subnet: IPv4Network) -> None:
        Path(self.control_path).parent.mkdir(parents=True, exist_ok=True)
        try:
            # A worker left running by our previous run keeps forwarding; take it over.
            self.client = await DataplaneClient.connect(self.control_path, timeout=1.0)
            # Its table keeps traffic flowing until BGP has re-learned every route.
            self.base = dict((await self.client.get()).get("next_hops") or {})
            log.info("re-attached to the running %s data-plane worker (%d next hops)", self.name, len(self.base))
        except DataplaneError:
            mtu = self.t.underlay.mtu - mtu_overhead("udp" if self.name == "udp" else "ipip")
            self.process = await DataplaneProcess.start(
                self.name,
                self.device,
                mtu,
                str(self.t.underlay.interface.ip),
                port=self.t.cfg.network.udp_port,
                control_path=self.control_path,
            )
            self.client = await DataplaneClient.connect(self.control_path)
            log.info("started the %s data-plane worker (pid %d)", self.name, self.process.pid)
        await asyncio.to_thread(self._address, str(subnet.network_address))
        self.pushed = None

    def _address(self, address: str) -> None:
        with _ipr() as ipr:
            index = _link_index(ipr, self.device)
            if index is not None:
                _set_address(ipr, index, address)

    def data(self) -> dict[str, Any]:
        return {"udp_port": self.t.cfg.network.udp_port} if self.name == "udp" else {"ipip_path": "userspace"}

    async def sync(self, plans: Mapping[str, PeerPlan], next_hops: Mapping[str, list[str]], prune: bool) -> None:
        if self.client is None:
            return
        table = {
            dst: nh for nh, dsts in next_hops.items() if plans.get(nh) and plans[nh].backend == self.name for dst in dsts
        }
        if prune:
            self.base = {}
        else:
            table = {**self.base, **table}
        members = frozenset(self.t.members)
        if self.pushed == (table, members):
            return
        try:
            await self.client.set_next_hops(table)
            await self.client.set_members(members)
            self.pushed = (table, members)
        except DataplaneError as err:
            log.warning("%s worker: %s; reconnecting", self.name, err)
            await self._reconnect()

    async def _reconnect(self) -> None:
        with contextlib.suppress(Exception):
            if self.client is not None:
                await self.client.close()
        self.client = None
        assert self.t.subnet is not None
        await self.up(self.t.subnet)

    async def refresh_stats(self) -> None:
        if self.client is not None:
            with contextlib.suppress(DataplaneError):
                self.last_stats = await self.client.stats()

    def status(self) -> dict[str, Any]:
        s = self.last_stats
        return {
            "device": self.device,
            "path": "userspace",
            "worker_pid": self.process.pid if self.process else s.get("config", {}).get("pid"),
            "offloads": s.get("offloads"),
            "fallbacks": s.get("fallbacks"),
            "drops": s.get("drops"),
            "counters": {k: v for k, v in s.items() if isinstance(v, int)},
        }

    async def down(self, remove: bool) -> None:
        if self.client is None:
            return
        if remove:
            with contextlib.suppress(DataplaneError, OSError):
                await self.client.shutdown(remove_device=True)
            if self.process is not None:
                with contextlib.suppress(Exception):
                    await self.process.stop()
        # Without remove (graceful restart) the worker keeps forwarding for our next run.
        with contextlib.suppress(Exception):
            await self.client.close()
        self.client = None


class _KernelIpip:
    name = "ipip"

    def __init__(self, t: Tunnels) -> None:
        self.t = t
        self.device = DEVICES["ipip"]

    def _up(self, subnet: IPv4Network) -> None:
        with _ipr() as ipr:
            index = _link_index(ipr, self.device)
            if index is None:
                ipr.link("add", ifname=self.device, kind="ipip", ipip_local=str(self.t.underlay.interface.ip))
                index = _link_index(ipr, self.device)
                assert index is not None
            ipr.link("set", index=index, mtu=self.t.underlay.mtu - mtu_overhead("ipip"), state="up")
            _set_address(ipr, index, str(subnet.network_address))

    async def up(self, subnet: IPv4Network) -> None:
        await asyncio.to_thread(self._up, subnet)

    def data(self) -> dict[str, Any]:
        return {"ipip_path": "kernel"}

    async def sync(self, plans: Mapping[str, PeerPlan], next_hops: Mapping[str, list[str]], prune: bool) -> None:
        return None  # routes carry the peer as an onlink next hop

    def status(self) -> dict[str, Any]:
        return {"device": self.device, "path": "kernel"}

    async def down(self, remove: bool) -> None:
        if remove:
            await asyncio.to_thread(_delete_link, self.device)


def control_path(state_dir: Path, kind: str) -> str:
    """The worker's control socket: in the state dir, unless that path is longer than a unix
    socket address allows (108 bytes); then in /run/agentd under a name derived from it."""
    path = str(state_dir / f"dataplane-{kind}.sock")
    if len(path.encode()) < 100:
        return path
    digest = hashlib.sha256(str(state_dir).encode()).hexdigest()[:16]
    return f"/run/agentd/dataplane-{kind}-{digest}.sock"


def _delete_link(name: str) -> None:
    with _ipr() as ipr:
        index = _link_index(ipr, name)
        if index is not None:
            ipr.link("del", index=index)


def _kernel_has_ipip() -> tuple[bool, str]:
    """Probe by creating (and deleting) a device: the only reliable test without module tools."""
    probe = "agentd.probe"
    try:
        with _ipr() as ipr:
            ipr.link("add", ifname=probe, kind="ipip")
            index = _link_index(ipr, probe)
            if index is not None:
                ipr.link("del", index=index)
        return True, "the kernel has ipip"
    except _netlink_error() as err:
        if err.code in (errno.EOPNOTSUPP, errno.ENODEV, errno.EINVAL):
            return False, f"the kernel has no ipip support ({os.strerror(err.code)})"
        raise


class Tunnels:
    def __init__(
        self, cfg: Config, underlay: Underlay, node_name: str, *, on_node_data: Callable[[], None] | None = None
    ) -> None:
        self.cfg = cfg
        self.underlay = underlay
        self.node_name = node_name
        self.own = cfg.network.backend
        self.on_node_data = on_node_data
        self.devices: dict[str, str] = dict(DEVICES)
        self.subnet: IPv4Network | None = None
        self.active: dict[str, Any] = {}
        self.failed: dict[str, str] = {}
        self.ipip_why = ""
        self.members: set[str] = set()
        self._members_known = False
        self.firewall = MemberFilter()
        self._plans: Mapping[str, PeerPlan] = {}
        self._next_hops: Mapping[str, list[str]] = {}
        self._prune = True
        self._dirty = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self, subnet: IPv4Network) -> None:
        self.subnet = subnet
        self.members = {str(self.underlay.interface.ip)}
        if self.own != "host-gw":
            await self._ensure(self.own)
            if self.own in self.failed:
                raise RuntimeError(f"backend {self.own}: {self.failed[self.own]}")
        self._task = asyncio.get_running_loop().create_task(self._sync_loop(), name="tunnels")

    async def _ensure(self, backend: str) -> None:
        if backend in self.active or backend in self.failed or backend == "host-gw":
            return
        assert self.subnet is not None
        try:
            if backend == "vxlan":
                impl: Any = _Vxlan(self)
            elif backend == "udp":
                impl = _Worker(self, "udp")
            elif backend == "ipip":
                mode = self.cfg.network.ipip_mode
                has, self.ipip_why = await asyncio.to_thread(_kernel_has_ipip) if mode != "userspace" else (False, "ipip_mode = userspace")
                if mode == "kernel" and not has:
                    raise RuntimeError(f"ipip_mode = kernel but {self.ipip_why}")
                impl = _KernelIpip(self) if has else _Worker(self, "ipip")
                self.devices["ipip_path"] = "kernel" if has else "userspace"
            else:
                raise RuntimeError(f"unknown backend {backend}")
            await impl.up(self.subnet)
        except (OSError, _netlink_error(), DataplaneError, RuntimeError) as err:
            self.failed[backend] = f"cannot bring up {backend}: {err}"
            log.error("%s", self.failed[backend])
            return
        self.active[backend] = impl
        log.info("backend %s up (%s)", backend, getattr(impl, "device", ""))
        if self.on_node_data is not None:
            self.on_node_data()

    def available(self, backend: str) -> str | None:
        return self.failed.get(backend)

    def node_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"type": self.own}
        for impl in self.active.values():
            data.update(impl.data())
        return data

    def apply(
        self,
        plans: Mapping[str, PeerPlan],
        next_hops: Mapping[str, list[str]],
        nodes: Mapping[str, NodeRecord],
        *,
        members_known: bool = True,
        prune: bool = True,
    ) -> None:
        """Bring tunnel state in line with the peer plans (in the background, coalesced).

        ``prune`` False (until BGP has re-learned every route after a restart) only adds and
        updates tunnel state, never removes it, like the kernel routes adopted at start.
        ``members_known`` is False until the node registry has been read once: until then the
        member filters keep whatever they had (a restarted agent must not start dropping its
        peers' traffic because it has not heard of them yet)."""
        self._plans, self._next_hops, self._prune = plans, next_hops, prune
        if members_known:
            self.members = {str(n.address) for n in nodes.values()} | {str(self.underlay.interface.ip)}
            self._members_known = True
        self._dirty.set()

    async def _sync_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            plans, next_hops, prune = self._plans, self._next_hops, self._prune
            try:
                for backend in {p.backend for p in plans.values()} & set(DEVICES):
                    await self._ensure(backend)
                if not self._members_known:
                    continue
                for impl in list(self.active.values()):
                    await impl.sync(plans, next_hops, prune)
                kernel = [b for b, impl in self.active.items() if not isinstance(impl, _Worker)]
                await self.firewall.apply(self.members, ipip="ipip" in kernel, vxlan_port=self.cfg.network.vxlan_port if "vxlan" in kernel else None)
            except Exception:
                log.exception("tunnel sync failed; retrying")
                await asyncio.sleep(1.0)
                self._dirty.set()

    async def refresh(self) -> None:
        for impl in list(self.active.values()):  # _ensure may add a backend meanwhile
            if isinstance(impl, _Worker):
                await impl.refresh_stats()

    def status(self) -> dict[str, Any]:
        return {
            "own": self.own,
            "active": {b: impl.status() for b, impl in self.active.items()},
            "failed": dict(self.failed),
            "ipip": self.ipip_why or None,
            "firewall": self.firewall.status(),
        }

    async def stop(self, *, remove: bool) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for impl in self.active.values():
            with contextlib.suppress(Exception):
                await impl.down(remove)
        if remove:
            await self.firewall.remove()
