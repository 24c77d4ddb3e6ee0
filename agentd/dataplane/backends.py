"""Tunnel backends: the devices, BPF programs, FDB/neighbour entries and user-space next hops
that encapsulated peers need.  host-gw needs none of it.

The agent runs backends *per peer*: a peer is reached with the backend it advertises in
its node record (``backend.type``), so nodes on different backends still reach each
other.  Our own backend is brought up at start (peers must be able to reach us); any
other is brought up the first time a peer needs it (a user-space worker of another backend,
or one beside BPF, stops again, its TUN device with it, once no peer needs it; our own
backend's runs while we do).  Each backend runs on the first of its
data paths (agentd.backend_table) that comes up here, and says why it fell back:

============  ==========================================================================
vxlan-device  kernel VTEP ``agentd.vxlan`` (VNI/port configurable, no learning); per peer a
              permanent neighbour entry (peer VTEP IP -> MAC) and an FDB entry (MAC -> peer
              underlay IP, and the peer's VNI and port where they are not ours), as flannel
              does; routes ``subnet via vtep_ip dev agentd.vxlan onlink``.  The entries are
              re-read from the kernel every VXLAN_REREAD seconds and put back where they went
              (the device set down and up, ``ip neigh flush``, ``bridge fdb del``).
              One VTEP carries both pod families: a dual-stack peer gets an IPv6 neighbour
              entry too (its IPv6 VTEP address, the network address of its IPv6 subnet, as
              flannel's second VTEP has it); the VTEP's outer family is the node's underlay's.
bpf           udp and ipip: the tc-BPF programs on the underlay device (agentd.dataplane.bpf),
              routes ``subnet via <underlay next hop> dev <underlay> mtu <pod mtu>``.
userspace     udp and ipip where BPF cannot run: the worker (TUN ``agentd.udp`` / ``agentd.ipip``
              + UDP socket / raw socket), routes ``subnet dev agentd.<backend>``.
============  ==========================================================================

Encapsulated packets are accepted only from cluster members: the BPF ingress program drops
(and counts) udp, ipip and VXLAN from anyone else, on the underlay device; the user-space
workers check their own member list.  One BPF data path per node serves all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network
from pathlib import Path
from typing import Any

from agentd.backend_table import BACKENDS, DATAPATHS, mtu_overhead
from agentd.dataplane.bpf_backend import BpfPath, InBpf
from agentd.config.settings import Config
from agentd.dataplane import DataplaneClient, DataplaneError, DataplaneProcess
from agentd.dataplane.bpf import BpfUnavailable, for_log, layout, remove_pinned
from agentd.dataplane.udp_port import bind_udp_port, take_worker_socket
from agentd.datastore.store import NodeRecord
from agentd.kernel import netlink as nl
from agentd.kernel.netlink_links import Vxlan, decode_vxlan
from agentd.kernel.netlink_socket import NetlinkSocket
from agentd.kernel.rtnl import Rtnl
from agentd.kernel.forwarding import HOST_GW, LocalPaths, PeerPlan, peer_in_userspace
from agentd.kernel.netinfo import Underlay

log = logging.getLogger("agentd.backends")

DEVICES = {name: b.device for name, b in BACKENDS.items() if b.device}
GATEWAY_REFRESH = 15.0  # seconds between re-resolving the underlay next hops of BPF routes
VXLAN_REREAD = GATEWAY_REFRESH  # seconds between re-reading the VTEP's neighbour and FDB entries
WORKER_EXIT_TIMEOUT = 5.0  # seconds a replaced worker has to exit before its successor starts
RETRY_FIRST, RETRY_MAX = 5.0, 300.0  # a backend that failed to come up: tried again after 5 s, 10 s, ... 5 min


class _Retries:
    """When the parts that failed to come up (backends, workers) may be tried again: RETRY_FIRST
    seconds after the first failure, twice as long after each next one, at most RETRY_MAX."""

    def __init__(self) -> None:
        self._at: dict[str, tuple[float, float]] = {}  # name -> (when, the delay that led there)

    def failed(self, name: str, now: float) -> float:
        delay = min(self._at[name][1] * 2, RETRY_MAX) if name in self._at else RETRY_FIRST
        self._at[name] = (now + delay, delay)
        return delay

    def due(self, name: str, now: float) -> bool:
        return name not in self._at or now >= self._at[name][0]

    def any_due(self, now: float) -> bool:
        return any(now >= at for at, _delay in self._at.values())

    def succeeded(self, name: str) -> None:
        self._at.pop(name, None)

    forget = succeeded  # no longer wanted: never tried again (wanted again later: tried at once)


# (the peer's VTEP addresses, one per pod family; its VTEP MAC; its UDP port and VNI where they
# are not ours, else None)
VtepPeer = tuple[tuple[str, ...], str, "int | None", "int | None"]


def _packed(address: str) -> tuple[int, bytes]:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return family, socket.inet_pton(family, address)


def vxlan_peer_entries(index: int, vtep_ips: tuple[str, ...], mac: str, peer: str,
                       port: int | None = None, vni: int | None = None) -> list[nl.NeighMessage]:
    """What a VXLAN peer needs on our VTEP (device ``index``), as flannel does it: a permanent
    neighbour entry per pod family (its VTEP IP -> its VTEP MAC: ARP for IPv4, NDP for IPv6)
    and an FDB entry on the device itself (NTF_SELF: the VXLAN driver's table, MAC -> its
    underlay address, IPv4 or IPv6).  ``port`` and ``vni``: the peer's UDP port and VNI where
    they are not our device's (the kernel keeps them per remote, and sends to it with them)."""
    lladdr = bytes.fromhex(mac.replace(":", ""))
    entries = [nl.NeighMessage(family, index, nl.NUD_PERMANENT, 0, 0, raw, lladdr)
               for family, raw in map(_packed, vtep_ips)]
    entries.append(nl.NeighMessage(nl.AF_BRIDGE, index, nl.NUD_PERMANENT, nl.NTF_SELF, 0, _packed(peer)[1], lladdr,
                                   port=port, vni=vni))
    return entries


async def _neigh_request(sock: NetlinkSocket, code: str, entry: nl.NeighMessage, seq: int) -> None:
    """One RTM_NEWNEIGH ("replace": create or replace) or RTM_DELNEIGH ("del"), acknowledged;
    the kernel's refusal raises nl.NetlinkError."""
    if code == "replace":
        flags = nl.NLM_F_REQUEST | nl.NLM_F_ACK | nl.NLM_F_CREATE | nl.NLM_F_REPLACE
        message = nl.encode_newneigh(seq, flags, entry)
    else:
        message = nl.encode_delneigh(seq, nl.NLM_F_REQUEST | nl.NLM_F_ACK, entry)
    errors, complete = await sock.send_batch(message, seq, seq)
    what = "FDB entry" if entry.family == nl.AF_BRIDGE else "neighbour entry"
    if errors:
        _seq, err, kernel_message = errors[0]
        raise nl.NetlinkError(err, kernel_message, f"{code} {what}")
    if not complete:
        raise nl.NetlinkError(errno.ETIMEDOUT, None, f"{code} {what}: no acknowledgement")


def vxlan_peers_installed(rt: Rtnl, index: int) -> dict[str, VtepPeer]:
    """The peers a VTEP (device ``index``) holds entries of, as :func:`vxlan_peer_entries` made
    them: each permanent FDB entry (MAC -> a peer's underlay address) with the permanent
    neighbour entries of that MAC (its VTEP addresses, IPv4 first).  What a previous run left,
    so that this one prunes the entries of peers gone meanwhile."""
    vteps: dict[bytes, list[tuple[int, str]]] = {}
    for family in (nl.AF_INET, nl.AF_INET6):
        for mtype, buf, start, end in rt.request(nl.encode_getneigh_dump(rt.next_seq(), family), "listing the VTEP's neighbours"):
            e = nl.decode_neigh(buf, start, end) if mtype == nl.RTM_NEWNEIGH else None
            if e is None or e.ifindex != index or not e.state & nl.NUD_PERMANENT or e.dst is None or not e.lladdr:
                continue
            vteps.setdefault(e.lladdr, []).append((family, socket.inet_ntop(family, e.dst)))
    peers: dict[str, VtepPeer] = {}
    for mtype, buf, start, end in rt.request(nl.encode_getneigh_dump(rt.next_seq(), nl.AF_BRIDGE), "listing the VTEP's FDB"):
        e = nl.decode_neigh(buf, start, end) if mtype == nl.RTM_NEWNEIGH else None
        if e is None or e.ifindex != index or not e.state & nl.NUD_PERMANENT or e.dst is None or not any(e.lladdr or b""):
            continue
        family = socket.AF_INET if len(e.dst) == 4 else socket.AF_INET6
        ips = tuple(ip for _f, ip in sorted(vteps.get(e.lladdr, []), key=lambda v: v[0] != nl.AF_INET))
        peers[socket.inet_ntop(family, e.dst)] = (ips, _mac(e.lladdr) or "", e.port, e.vni)
    return peers


def _vxlan_peers_of(index: int) -> dict[str, VtepPeer]:
    with Rtnl() as rt:
        return vxlan_peers_installed(rt, index)


def _set_address(rt: Rtnl, index: int, *addresses: str) -> None:
    """Each of ``addresses`` as a host address (/32, /128) on the device, replacing any other
    address of its family we put there before (IPv6 link-local addresses are the kernel's)."""
    for family, bits in ((socket.AF_INET, 32), (socket.AF_INET6, 128)):
        wanted = {(a, bits) for a in addresses if _packed(a)[0] == family}
        have = [(socket.inet_ntop(family, a.local or a.address), a.prefixlen)
                for a in rt.addresses(index, family) if a.local or a.address]
        have = [(a, p) for a, p in have if not (family == socket.AF_INET6 and a.startswith("fe80:"))]
        for addr, plen in have:
            if (addr, plen) not in wanted:
                rt.delete_address(index, addr, plen)
        for addr, plen in wanted - set(have):
            rt.add_address(index, addr, plen)


def _mac(address: bytes | None) -> str | None:
    return ":".join(f"{b:02x}" for b in address) if address else None


def _canonical_ip(value: object) -> str:
    """An address in the kernel's spelling (what inet_ntop gives back); text that is no
    address as it is (the kernel refuses it, and that peer alone, when it is sent)."""
    try:
        return str(ip_address(str(value)))
    except ValueError:
        return str(value)


def vtep_mac(node_name: str, vni: int) -> bytes:
    """The MAC agentd gives the VTEP it makes: the first 6 bytes of SHA-256 of the node's name
    and the VNI, locally administered and unicast -- the same each time the device is made (a
    restart, the device deleted and made again), as flannel's persistent MAC is.  Given at
    creation, the kernel marks it set (not random), so systemd-udev's MACAddressPolicy=
    persistent leaves it alone instead of swapping it for one peers were never told."""
    mac = bytearray(hashlib.sha256(f"agentd.vxlan {node_name} {vni}".encode()).digest()[:6])
    mac[0] = (mac[0] & 0xFC) | 0x02
    return bytes(mac)


def _link_named(name: str) -> nl.LinkMessage | None:
    with Rtnl() as rt:
        return rt.link(name)


class _Vxlan:
    datapath = "vxlan-device"

    def __init__(self, t: Tunnels, name: str = "vxlan") -> None:
        self.t = t
        self.name = name
        self.device = DEVICES[name]
        self.mac: str | None = None
        self.vtep_ip: str | None = None
        self.vtep_ip_v6: str | None = None
        self.installed: dict[str, VtepPeer] = {}  # peer underlay -> (vtep ips, mac, port, vni)
        # The kernel's entries are re-read when the readiness loop's refresh sets ``reread``
        # (every VXLAN_REREAD seconds after ``read_at``) or the device has another index.
        self.read_at = time.monotonic()
        self.reread = False
        self.index: int | None = None
        self.made = False  # ``up`` made the device (rather than adopting a previous run's)
        self.refused: dict[str, str] = {}  # peer underlay -> why it has no entries (logged once)
        self.error: str | None = None  # the device went and could not be brought back (problems())

    def _up(self, subnet: IPv4Network | IPv6Network) -> None:
        cfg, ul = self.t.cfg.network, self.t.underlay
        mtu = ul.mtu - mtu_overhead("vxlan", ul.family)
        wanted = Vxlan(cfg.vxlan_vni, cfg.vxlan_port, ul.interface.ip.packed, ul.ifindex, learning=False,
                       address=vtep_mac(self.t.node_name, cfg.vxlan_vni))
        with Rtnl() as rt:
            link = rt.link(self.device)
            if link is not None:
                # Adopt a device left by our previous run if it carries the same VNI, port and
                # local address, without learning (which would let any sender rewrite the FDB).
                have = decode_vxlan(link.info_data) if link.kind == "vxlan" and link.info_data is not None else None
                if have is None or have._replace(link=0, address=None) != wanted._replace(link=0, address=None):
                    log.info("replacing %s: its VNI, port, local address or learning changed", self.device)
                    rt.delete_link(link.index)
                    link = None
            if link is None:
                rt.create_vxlan(self.device, wanted)
                self.made = True
                link = rt.link(self.device)
                if link is None:
                    raise OSError(errno.ENODEV, f"vxlan device {self.device} vanished after it was made")
            rt.set_link(link.index, mtu=mtu, up=True)
            # An adopted device keeps the previous run's entries: known, they are pruned once
            # the routes are re-learned (peers gone meanwhile), like the routes themselves.
            self.installed = vxlan_peers_installed(rt, link.index)
            self.index, self.read_at, self.reread = link.index, time.monotonic(), False
            v4, v6 = self.t.subnets.get(4), self.t.subnets.get(6)
            self.vtep_ip = str(v4.network_address) if v4 else None
            self.vtep_ip_v6 = str(v6.network_address) if v6 else None
            _set_address(rt, link.index, *(a for a in (self.vtep_ip, self.vtep_ip_v6) if a))
            self.mac = _mac(link.address)

    async def up(self, subnet: IPv4Network | IPv6Network) -> None:
        await asyncio.to_thread(self._up, subnet)

    def data(self) -> dict[str, Any]:
        data = {
            "vtep_mac": self.mac,
            "vtep_ip": self.vtep_ip,
            "vni": self.t.cfg.network.vxlan_vni,
            "vxlan_port": self.t.cfg.network.vxlan_port,
        }
        if self.vtep_ip_v6 is not None:
            data["vtep_ip_v6"] = self.vtep_ip_v6
        return data

    async def _reread(self, index: int) -> None:
        """The entries the kernel holds now become ``installed``: what went since (the device
        set down and up flushes even permanent neighbour entries; ``ip neigh flush``, ``bridge
        fdb del``) is put back by the sync that follows."""
        self.reread, self.index, self.read_at = False, index, time.monotonic()
        kernel = await asyncio.to_thread(_vxlan_peers_of, index)
        lost = sorted(p for p, v in self.installed.items() if kernel.get(p) != v)
        if lost:
            log.warning("%s lost the neighbour or FDB entries of %d peers (%s%s); putting them back", self.device,
                        len(lost), ", ".join(lost[:3]), ", ..." if len(lost) > 3 else "")
        self.installed = kernel

    async def _sync(self, wanted: dict[str, VtepPeer], prune: bool) -> None:
        """Neighbour and FDB entries through agentd.kernel.netlink, the route programmer's
        rtnetlink codec."""
        link = await asyncio.to_thread(_link_named, self.device)
        if link is None or not link.flags & nl.IFF_UP:
            if not await self._bring_back(link):
                return
            link = await asyncio.to_thread(_link_named, self.device)
            if link is None:
                return
        index = link.index
        mac = _mac(link.address)
        if mac != self.mac:
            # Another MAC than we published (systemd-udev's MACAddressPolicy=persistent on a
            # device made with a random one, ``ip link set address``): peers must be told.
            log.warning("%s has MAC %s, not %s as published: publishing it", self.device, mac, self.mac)
            self.mac = mac
            if self.t.on_node_data is not None:
                self.t.on_node_data()
        if self.reread or index != self.index:
            await self._reread(index)
        sock = NetlinkSocket(rcvbuf=1 << 20, sndbuf=1 << 20)
        seq = 0
        # A neighbour entry is the kernel's by VTEP address alone: one a wanted peer uses now
        # (a peer re-addressed, its VTEP address kept) is not deleted with the old peer's.
        in_use = {ip for ips, *_rest in wanted.values() for ip in ips}
        try:
            for peer, have in list(self.installed.items()):
                if prune and wanted.get(peer) != have:
                    # (an FDB entry's delete names its port and VNI: the kernel fills ours in
                    # for those missing, and finds no such remote for a peer with its own)
                    for entry in vxlan_peer_entries(index, *have[:2], peer, *have[2:]):
                        if entry.family != nl.AF_BRIDGE and entry.dst and socket.inet_ntop(entry.family, entry.dst) in in_use:
                            continue
                        seq += 1
                        with contextlib.suppress(nl.NetlinkError):
                            await _neigh_request(sock, "del", entry, seq)
                    del self.installed[peer]
            for peer in set(self.refused) - set(wanted):
                del self.refused[peer]
            for peer, want in wanted.items():
                if self.installed.get(peer) == want:
                    continue
                vtep_ips, mac, port, vni = want
                if self.mac is not None and mac.lower() == self.mac.lower():
                    # Its FDB entry would send what is for this node's own MAC to it.
                    self._refuse(peer, f"its record's VTEP MAC {mac} is this node's own")
                    continue
                sent: list[nl.NeighMessage] = []
                try:
                    for entry in vxlan_peer_entries(index, vtep_ips, mac, peer, port, vni):
                        seq += 1
                        await _neigh_request(sock, "replace", entry, seq)
                        sent.append(entry)
                except nl.NetlinkError as err:
                    # That peer's record (a MAC or underlay address the kernel will not take):
                    # the other peers' entries are made regardless, and it is not half made.
                    self._refuse(peer, f"the kernel refused its entries: {err}")
                    for entry in sent:
                        seq += 1
                        with contextlib.suppress(nl.NetlinkError):
                            await _neigh_request(sock, "del", entry, seq)
                    continue
                if self.refused.pop(peer, None) is not None:
                    log.info("%s: the entries of peer %s are made now", self.device, peer)
                self.installed[peer] = want
        finally:
            sock.close()

    def _refuse(self, peer: str, why: str) -> None:
        if self.refused.get(peer) != why:
            log.error("%s: no VXLAN entries for peer %s: %s", self.device, peer, why)
        self.refused[peer] = why
        self.installed.pop(peer, None)

    async def _bring_back(self, link: Any) -> bool:
        """The VTEP deleted (``ip link del``, a network restart, its underlay device removed) or
        set down while the agent runs: made or set up again as at start, tried again with
        back-off while that fails (reported by ``problems()`` meanwhile).  True once it is back."""
        what = "is gone" if link is None else "is down"
        now = time.monotonic()
        if not self.t._retries.due(f"vtep:{self.name}", now):
            return False
        try:
            await self.up(self.t.subnet)  # type: ignore[arg-type]
        except (OSError, RuntimeError) as err:  # nl.NetlinkError is an OSError
            delay = self.t._retries.failed(f"vtep:{self.name}", now)
            error = f"the VXLAN device {self.device} {what} and could not be brought back: {err}"
            (log.error if self.error != error else log.warning)("%s; trying again in %.0f s", error, delay)
            self.error = error
            return False
        self.t._retries.succeeded(f"vtep:{self.name}")
        self.error = None
        log.warning("the VXLAN device %s %s: brought it back", self.device, what)
        if self.t.on_node_data is not None:
            self.t.on_node_data()  # its MAC, as it is now
        if self.t.on_paths is not None:
            self.t.on_paths()  # the kernel took the routes through it away
        return True

    async def sync(self, plans: Mapping[str, PeerPlan], next_hops: Mapping[str, list[str]], prune: bool) -> None:
        wanted: dict[str, VtepPeer] = {}
        ours = self.t.cfg.network
        # A dual-stack peer may be reached over VXLAN for one family only (cross-subnet, on-link
        # for IPv4 but without an IPv6 next hop on the segment): its IPv6 plan needs it too.
        for addr, plan in [*plans.items(), *self.t.plans_v6.items()]:
            if plan.backend == "vxlan" and plan.extra.get("vtep_mac"):
                # The peer's VTEP address of each pod family this node has too.
                keys = [k for k, mine in (("vtep_ip", self.vtep_ip), ("vtep_ip_v6", self.vtep_ip_v6)) if mine]
                # In the kernel's spelling (inet_ntop, lower-case MAC), as ``installed`` is read
                # back: a record's "FD00:10:244:3:0::" or "0A:BB:..." (valid, and taken by
                # plan_peer) would otherwise differ from it for ever -- sent again at every sync,
                # and "lost" at every re-read.
                ips = tuple(_canonical_ip(plan.extra[k]) for k in keys if plan.extra.get(k))
                # Its port and VNI (checked by plan_peer) where they are not ours.
                port, vni = plan.extra.get("vxlan_port"), plan.extra.get("vni")
                if ips:
                    wanted[addr] = (ips, str(plan.extra["vtep_mac"]).lower(),
                                    None if port in (None, ours.vxlan_port) else port,
                                    None if vni in (None, ours.vxlan_vni) else vni)
        await self._sync(wanted, prune)

    def status(self) -> dict[str, Any]:
        return {"datapath": self.datapath, "device": self.device, **self.data(),
                **({"error": self.error} if self.error else {}), **({"refused": dict(self.refused)} if self.refused else {}),
                "peers": {p: {"vtep_ip": v[0] if v else None, "vtep_ips": list(v), "mac": m,
                              **({"vxlan_port": port} if port is not None else {}),
                              **({"vni": vni} if vni is not None else {})}
                          for p, (v, m, port, vni) in self.installed.items()}}

    async def down(self, remove: bool) -> None:
        if remove:
            await asyncio.to_thread(_delete_link, self.device)

    async def discard(self) -> None:
        """After an ``up`` that failed: a device it made goes (a previous run's keeps forwarding)."""
        if self.made:
            await asyncio.to_thread(_delete_link, self.device)


def host_addresses_v6(nodes: Iterable[NodeRecord], own: str,
                      refused: Iterable[IPv4Network | IPv6Network] = ()) -> dict[str, str]:
    """The peer nodes' IPv6 node addresses, each -> the node's IPv4 underlay address (the
    worker's sender): a peer's host sends IPv6 from it where no address of its own subnet is
    picked (its TUN's, its pods' bridge's) -- a reply from its node address to a pod that
    connected to it (with ``ip_masq`` off), or a host with no such address yet.  An address
    two records claim (one of them this node's) is no one's, as next_hop_owners has it; nor is
    one inside ``refused`` (own_ranges_v6: this node's own addresses, whether or not its record
    is in ``nodes``, the pod network, the Service range) or inside any record's pod subnet,
    whether or not its route is routed here yet: a record must not let its node pose as pods,
    as another node's host or as this one."""
    nodes = list(nodes)
    # The networks by prefix length (one or two lengths: the pod subnets' and a few more): a
    # claim is looked up once per length, not against every record's subnet -- at 1,000
    # dual-stack nodes that was 4.4 s of the event loop at every apply.
    nets: dict[int, set[int]] = {}
    for net in (*refused, *(s for r in nodes for s in (r.subnet, r.subnet_v6))):
        if net is not None and net.version == 6:
            nets.setdefault(net.prefixlen, set()).add(int(net.network_address))

    def inside(addr: str) -> bool:
        x = int(ip_address(addr))
        return any((x >> (128 - plen)) << (128 - plen) in starts for plen, starts in nets.items())

    claims: dict[str, list[NodeRecord]] = {}
    for n in nodes:
        if n.address_v6 is not None:
            claims.setdefault(str(n.address_v6), []).append(n)
    return {
        addr: str(ns[0].address)
        for addr, ns in claims.items()
        if len(ns) == 1 and ns[0].name != own and ns[0].address is not None and not inside(addr)
    }


def own_ranges_v6(cfg: Config, underlay: Underlay) -> list[IPv6Network]:
    """What no peer's node address may lie in besides the pod subnets (host_addresses_v6):
    this node's own IPv6 addresses -- its node and underlay addresses, the node-local DNS
    address (the same on every node), the Ingress addresses -- and the IPv6 pod network and
    Service range (cluster IPs)."""
    addresses = [cfg.node.address_v6, cfg.dns.address_v6, *cfg.ingress.addresses, underlay.interface.ip,
                 underlay.interface_v6.ip if underlay.interface_v6 is not None else None, underlay.link_local]
    return [*(ip_network(a) for a in addresses if a is not None and a.version == 6),
            cfg.network.cidr_v6, cfg.network.service_cidr_v6]


def _host_sources(hosts: Mapping[str, str], sources: Mapping[str, str],
                  own: Iterable[IPv4Network | IPv6Network]) -> dict[str, str]:
    """``<address>/128 -> peer`` for each of ``hosts`` (host_addresses_v6, which refuses the
    rest), but for one inside this node's pod subnets or inside a prefix ``sources`` gives
    another peer: a record's address_v6 must not let its node pose as our pods or as another
    node's."""
    by_len: dict[int, dict[int, str]] = {}
    for dst, nh in sources.items():
        if ":" in dst:
            net = ip_network(dst)
            by_len.setdefault(net.prefixlen, {})[int(net.network_address)] = nh
    mine = [n for n in own if n.version == 6]
    out = {}
    for addr, peer in hosts.items():
        a = ip_address(addr)
        if any(a in n for n in mine):
            continue
        if any(entries.get(int(a) >> (128 - plen) << (128 - plen), peer) != peer for plen, entries in by_len.items()):
            continue
        out[f"{addr}/128"] = peer
    return out


class _Worker:
    """The user-space data plane (udp and ipip where BPF cannot run)."""

    datapath = "userspace"

    def __init__(self, t: Tunnels, kind: str) -> None:
        self.t = t
        self.name = kind
        self.device = DEVICES[kind]
        self.control_path = control_path(Path(t.cfg.agent.state_dir), kind)
        self.state_path = state_path(Path(t.cfg.agent.state_dir), kind)
        self.process: DataplaneProcess | None = None
        self.client: DataplaneClient | None = None
        self.pushed: tuple[dict, dict, frozenset] | None = None
        self.base: dict[str, str] = {}  # a re-attached worker's table, kept until routes are re-learned
        self.base_sources: dict[str, str] = {}  # and its reverse-path table
        self.last_stats: dict[str, Any] = {}  # the running worker's, as last read; {} while none runs
        self.error: str | None = None  # why no worker runs: it died and could not be started again
        # agentd_dataplane_drops_total is a counter: what the workers before the one last read
        # dropped, by reason, and (pid, drops) of the one last read (kept after it died).
        self.drops_before: dict[str, int] = {}
        self._counted: tuple[Any, dict[str, int]] = (None, {})
        self.attached_pid: int | None = None  # the pid of a previous run's worker we re-attached to
        # No peer needs it any more: stopped for good (a peer that needs one later gets another).
        self.retired = False
        # udp: the socket on udp_port, held for the agent's life and handed to each worker
        # (agentd/dataplane/udp_port.py): no other user can take the port while we run.
        self.port_socket: socket.socket | None = None

    async def up(self, subnet: IPv4Network) -> None:
        Path(self.control_path).parent.mkdir(parents=True, exist_ok=True)
        mtu = self.t.underlay.mtu - mtu_overhead(self.name)
        local_ip, port = str(self.t.underlay.interface.ip), self.t.cfg.network.udp_port
        self.client = None
        # A worker left running by our previous run keeps forwarding; take it over -- if it
        # runs as this run would start it (a re-addressed node, a changed MTU or udp_port:
        # its socket and TUN would be the old ones).
        with contextlib.suppress(DataplaneError):
            await self._attach({"local_ip": local_ip, "port": port, "mtu": mtu})
        if self.client is None:
            self.process = await DataplaneProcess.start(
                self.name,
                self.device,
                mtu,
                local_ip,
                port=port,
                control_path=self.control_path,
                state_path=self.state_path,
                sock=self._port_socket(local_ip, port),
            )
            self.client = await DataplaneClient.connect(self.control_path)
            log.info("started the %s data-plane worker (pid %d)", self.name, self.process.pid)
        # The TUN's address in each pod subnet it carries (as vxlan's vtep_ip, vtep_ip_v6): the
        # kernel takes it as the source of this host's packets routed through the TUN (its own,
        # NodePort SNAT, ICMP errors), which the peers' reverse-path check then accepts as ours.
        # IPv6 only on udp's (ipip carries IPv4 alone).
        carried = [s for v, s in sorted(self.t.subnets.items()) if v == 4 or self.name == "udp"] or [subnet]
        await asyncio.to_thread(self._address, *(str(s.network_address) for s in carried))
        self.pushed = None

    async def _attach(self, wanted: dict[str, Any]) -> None:
        client = await DataplaneClient.connect(self.control_path, timeout=1.0)
        try:
            held = await client.get()
        except DataplaneError:
            with contextlib.suppress(Exception):
                await client.close()
            raise
        config = held.get("config") or {}
        have = {key: config.get(key) for key in wanted}
        if self.name == "udp" and (config.get("local_ip"), config.get("port")) == (wanted["local_ip"], wanted["port"]):
            # Before it may be replaced (another MTU): the port stays held throughout.
            await self._hold_worker_socket(config.get("pid"), wanted["local_ip"], wanted["port"])
        if have == wanted:
            self.client = client
            pid = config.get("pid")
            self.attached_pid = pid if isinstance(pid, int) and pid > 0 else None
            # Its table keeps traffic flowing until BGP has re-learned every route.
            self.base = dict(held.get("next_hops") or {})
            self.base_sources = dict(held.get("sources") or {})
            log.info("re-attached to the running %s data-plane worker (%d next hops)", self.name, len(self.base))
            return
        log.info("the running %s data-plane worker has %s, not %s: replacing it", self.name, have, wanted)
        with contextlib.suppress(DataplaneError, OSError):
            await client.shutdown(remove_device=False)
        with contextlib.suppress(Exception):
            await client.close()
        pid = config.get("pid")
        if isinstance(pid, int) and pid > 0:
            deadline = time.monotonic() + WORKER_EXIT_TIMEOUT
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

    def _port_socket(self, local_ip: str, port: int) -> socket.socket | None:
        """udp: the socket on ``local_ip:port`` the agent holds, bound now if it holds none
        there (OSError naming who holds the port when another user does)."""
        if self.name != "udp":
            return None
        held = self.port_socket
        if held is not None:
            with contextlib.suppress(OSError):
                if held.getsockname() == (local_ip, port):
                    return held
            self._release_port()
        self.port_socket = bind_udp_port(local_ip, port)
        return self.port_socket

    async def _hold_worker_socket(self, pid: Any, local_ip: str, port: int) -> None:
        """Take (a duplicate of) the running worker's socket, unless we hold it already: a
        worker the previous run started (with graceful restart) uses a socket that run bound,
        one an older agent started its own.  Where that fails, the worker holds the port alone
        (as before) and the next worker we start gets a socket of ours."""
        held = self.port_socket
        if held is not None:
            with contextlib.suppress(OSError):
                if held.getsockname() == (local_ip, port):
                    return
            self._release_port()
        if not isinstance(pid, int) or pid <= 0:
            return
        try:
            self.port_socket = await asyncio.to_thread(take_worker_socket, pid, local_ip, port)
        except OSError as err:
            log.warning("cannot take the udp socket of the running worker (pid %d): %s; it holds %s:%d alone "
                        "until it is replaced", pid, err.strerror or err, local_ip, port)

    def _release_port(self) -> None:
        if self.port_socket is not None:
            self.port_socket.close()
            self.port_socket = None

    def _address(self, *addresses: str) -> None:
        with Rtnl() as rt:
            link = rt.link(self.device)
            if link is not None:
                _set_address(rt, link.index, *addresses)

    def data(self) -> dict[str, Any]:
        return {key: getattr(self.t.cfg.network, key) for key in BACKENDS[self.name].node_data}

    async def sync(self, plans: Mapping[str, PeerPlan], next_hops: Mapping[str, list[str]], prune: bool) -> None:
        if self.client is None:
            return
        paths = self.t.paths()
        # Both pod families: a dual-stack node's IPv6 subnets go through the same peers (the
        # worker's next hops are IPv4 underlay addresses whatever the inner family).
        table = {
            dst: nh
            for plans_f, next_hops_f in ((plans, next_hops), (self.t.plans_v6, self.t.next_hops_v6))
            for nh, dsts in next_hops_f.items()
            if plans_f.get(nh) and plans_f[nh].backend == self.name and paths.datapath(plans_f[nh]) == "userspace"
            for dst in dsts
        }
        # What the worker may receive from each peer node: every pod subnet this node routes to
        # it, whatever carries it here (a peer reached by host-gw, or in BPF, may still send its
        # pods' packets through our worker), by its (IPv4 underlay) address -- the worker's
        # reverse-path check of inner sources (docs/networking.md, security notes).
        sources = {
            dst: nh
            for plans_f, next_hops_f in ((plans, next_hops), (self.t.plans_v6, self.t.next_hops_v6))
            for nh, dsts in next_hops_f.items()
            if plans_f.get(nh) and plans_f[nh].node is not None and ":" not in nh
            for dst in dsts
        }
        if prune:
            self.base, self.base_sources = {}, {}
        else:
            table = {**self.base, **table}
            sources = {**self.base, **self.base_sources, **sources}
        sources = {**table, **sources}  # (every next hop is a peer's subnet too)
        # A peer's host sends IPv4 from its TUN's address (its subnet) or its underlay address
        # (taken as the sender's own); IPv6 from its TUN's (up gives it one of its IPv6 subnet),
        # its pods' bridge's or its node address_v6, which it is taken from here.
        sources.update(_host_sources(self.t.hosts_v6, sources, self.t.subnets.values()))
        # Not our own underlay address (it is a member for BPF): a node never encapsulates to
        # itself, and the worker would take any local process's datagram from it.
        members = frozenset(self.t.members) - {str(self.t.underlay.interface.ip)}
        if self.pushed == (table, sources, members):
            return
        try:
            await self.client.set_next_hops(table, sources)
            await self.client.set_members(members)
            self.pushed = (table, sources, members)
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
        if self.retired:  # stopped meanwhile (no peer needs it): what this up started goes too
            self.t.hold_port(self.name, await self.retire())

    async def discard(self) -> None:
        """After an ``up`` that failed: a worker it started goes (one of a previous run it
        attached to keeps forwarding)."""
        if self.process is not None:
            with contextlib.suppress(DataplaneError, OSError):
                if self.client is not None:
                    await self.client.shutdown(remove_device=True)
            with contextlib.suppress(Exception):
                await self.process.stop()
            self.process = None
        with contextlib.suppress(Exception):
            if self.client is not None:
                await self.client.close()
        self.client = None
        self._release_port()

    async def refresh_stats(self) -> None:
        """The worker's counters; a worker that no longer answers (it died: its TUN and our
        routes through it stay, so its traffic would be dropped unseen) is started again and
        given its table.  One stopped for want of peers (``retire``) is not started again."""
        if self.retired:
            return
        try:
            if self.client is None:
                raise DataplaneError("not connected")
            stats = await self.client.stats()
            self._count(stats)
            self.last_stats = stats
            return
        except DataplaneError as err:
            if self.retired:  # stopped while we asked: no longer ours to start again
                return
            if self.error is None:  # (one that stays down is not news every 2 s)
                log.warning("%s data-plane worker not answering (%s): starting it again", self.name, err)
        self.pushed = None
        self.last_stats = {}  # a dead worker's, or one that does not answer: not what runs
        try:
            await self._reconnect()
        except (OSError, DataplaneError, RuntimeError) as err:
            self.client = None
            self.process = None
            error = f"could not be started again: {err}"
            (log.error if error != self.error else log.debug)("%s data-plane worker %s", self.name, error)
            self.error = error
        else:
            if self.error is not None:
                log.info("%s data-plane worker running again", self.name)
            self.error = None
        self.t.resync()

    def _count(self, stats: Mapping[str, Any]) -> None:
        """Another worker (a new pid) counts from 0: what the previous one counted is kept."""
        pid = stats.get("pid")  # the worker's stats() carries its describe(): pid at the top
        drops = {k: int(v) for k, v in (stats.get("drops") or {}).items()}
        before_pid, before = self._counted
        if pid != before_pid:
            for reason, n in before.items():
                self.drops_before[reason] = self.drops_before.get(reason, 0) + n
        self._counted = (pid, drops)

    def drops(self) -> dict[str, int]:
        """Packets dropped by reason since the agent started, by every worker it ran (never down)."""
        out = dict(self.drops_before)
        for reason, n in self._counted[1].items():
            out[reason] = out.get(reason, 0) + n
        return out

    def status(self) -> dict[str, Any]:
        s = self.last_stats
        return {
            "datapath": self.datapath,
            "device": self.device,
            "running": self.client is not None,
            "error": self.error,
            "worker_pid": self.process.pid if self.process else s.get("pid"),
            "offloads": s.get("offloads"),
            "fallbacks": s.get("fallbacks"),
            "drops": s.get("drops"),
            "counters": {k: v for k, v in s.items() if isinstance(v, int)},
        }

    async def down(self, remove: bool, *, keep_port: bool = False) -> None:
        # Without remove a worker keeps its own duplicate of the socket (graceful restart).
        if not keep_port:
            self._release_port()
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

    async def retire(self) -> socket.socket | None:
        """No peer needs this worker any more: it stops and takes its TUN device, control socket
        and state file along.  A previous run's worker we re-attached to is waited for (the next
        worker makes the TUN device again); what a worker that no longer answered left (it
        died) is removed.  Returns udp's port socket, which the agent keeps holding (no other
        user may take the port while it runs: docs/networking.md) for the next worker."""
        self.retired = True
        pid = self.process.pid if self.process is not None else self.attached_pid
        answering = self.client is not None
        await self.down(remove=True, keep_port=True)  # (a worker we started: waited for)
        self.process = None
        if answering and pid is not None:
            for _ in range(int(WORKER_EXIT_TIMEOUT / 0.05)):
                if not os.path.exists(f"/proc/{pid}"):
                    break
                await asyncio.sleep(0.05)
        await remove_worker_leftovers(Path(self.t.cfg.agent.state_dir), [self.name])
        port, self.port_socket = self.port_socket, None
        return port


def control_path(state_dir: Path, kind: str) -> str:
    """The worker's control socket: in the state dir, unless that path is longer than a unix
    socket address allows (108 bytes); then in /run/agentd under a name derived from it."""
    path = str(state_dir / f"dataplane-{kind}.sock")
    if len(path.encode()) < 100:
        return path
    digest = hashlib.sha256(str(state_dir).encode()).hexdigest()[:16]
    return f"/run/agentd/dataplane-{kind}-{digest}.sock"


def state_path(state_dir: Path, kind: str) -> str:
    """The worker's state file: in the state dir always (a path has no length limit there), so
    that it goes with the node's state whatever directory its control socket had to use."""
    return str(state_dir / f"dataplane-{kind}.sock.state")


async def remove_worker_leftovers(state_dir: Path, kinds: Collection[str] = ("udp", "ipip")) -> list[str]:
    """``agentd leave`` with no agent running (and an agent whose backend changed, for the
    ``kinds`` it no longer runs): a worker still forwarding (orphaned) is asked to shut down
    and take its TUN device along; what a killed one left -- its control socket, its state
    file, its persistent TUN device -- is removed.  Returns what went."""
    gone = []
    for kind in kinds:
        control = control_path(state_dir, kind)
        try:
            client = await DataplaneClient.connect(control, timeout=1.0)
        except DataplaneError:
            client = None
        if client is not None:
            with contextlib.suppress(DataplaneError, OSError):
                await client.shutdown(remove_device=True)
                gone.append(f"the running {kind} worker")
            with contextlib.suppress(Exception):
                await client.close()
            continue
        # Nobody answers: a dead worker's files (the state file also where earlier versions
        # kept it, beside a control socket in /run/agentd).
        for path in dict.fromkeys((control, state_path(state_dir, kind), control + ".state")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                gone.append(path)
        if await asyncio.to_thread(_delete_link, DEVICES[kind]):
            gone.append(DEVICES[kind])
    return gone


def remove_vxlan_leftover() -> list[str]:
    """The VXLAN device a previous run left (``agentd leave``; an agent whose peers no longer
    use VXLAN): left up, it takes VXLAN from anyone on its port."""
    return [DEVICES["vxlan"]] if _delete_link(DEVICES["vxlan"]) else []


def _delete_link(name: str) -> bool:
    with Rtnl() as rt:
        link = rt.link(name)
        if link is not None:
            rt.delete_link(link.index)
            return True
    return False


# The implementation of each data path (agentd.backend_table.DATAPATHS); "route" needs none.
IMPLEMENTATIONS: dict[str, Callable[[Tunnels, str], Any]] = {
    "vxlan-device": _Vxlan,
    "userspace": _Worker,
    "bpf": InBpf,
}


class Tunnels:
    def __init__(
        self, cfg: Config, underlay: Underlay, node_name: str, *, on_node_data: Callable[[], None] | None = None,
        on_paths: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.underlay = underlay
        self.node_name = node_name
        self.own = cfg.network.backend
        self.on_node_data = on_node_data
        self.on_paths = on_paths  # the data paths or the underlay next hops changed: recompute routes
        self.subnet: IPv4Network | IPv6Network | None = None  # the first of ``subnets``
        self.subnets: dict[int, IPv4Network | IPv6Network] = {}  # this node's pod subnets, by IP version
        self.active: dict[str, Any] = {}
        self.failed: dict[str, str] = {}  # backend -> why it is not up (tried again with back-off while a peer names it)
        # The backends the node records of the peers reached through a tunnel name (None until
        # the node registry has been read).
        self._needed: set[str] | None = None
        self._retries = _Retries()  # of ``failed`` and ``helper_failed`` (as "helper:<backend>")
        self.fallbacks: dict[str, str] = {}  # backend -> why it does not run on its first data path
        self.unfiltered: dict[str, str] = {}  # backend -> why its member filter cannot run
        self.bpf = BpfPath(cfg, underlay)
        self.helpers: dict[str, _Worker] = {}  # bpf backends' workers for peers that receive in user space
        self.helper_failed: dict[str, str] = {}
        # What the user-space workers stopped for want of peers dropped, by backend and reason
        # (agentd_dataplane_drops is a counter: the next worker goes on from it).
        self.worker_drops: dict[str, dict[str, int]] = {}
        self._retiring: set[_Worker] = set()  # being stopped by a pass (a stop meanwhile finishes the job)
        self._held_ports: dict[str, socket.socket] = {}  # udp_port of a worker stopped, for the next one
        self.gateways: dict[str, str] = {}  # peer -> underlay next hop (BPF routes to off-link peers)
        self.unreachable: dict[str, str] = {}
        self._gateways_at = 0.0
        self.members: set[str] = set()
        # Each peer node's IPv6 node address -> its (IPv4) peer address: what its host's IPv6
        # packets may come from besides its pod subnets (the workers' reverse-path check), as its
        # IPv4 ones may from its underlay address.  An address two records claim is no one's, nor
        # one inside a pod subnet or the pod network, nor one of ours (own_ranges_v6).
        self.hosts_v6: dict[str, str] = {}
        self._members_known = False
        self._plans: Mapping[str, PeerPlan] = {}
        self._next_hops: Mapping[str, list[str]] = {}
        self.plans_v6: Mapping[str, PeerPlan] = {}
        self.next_hops_v6: Mapping[str, list[str]] = {}
        self._prune = True
        self._leftovers_removed = False
        self._refresh_failing: dict[str, str] = {}  # part -> its refresh's last error (logged when new)
        self._dirty = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self, subnets: Mapping[int, IPv4Network | IPv6Network]) -> None:
        self.subnets = dict(subnets)
        self.subnet = next(self.subnets[v] for v in sorted(self.subnets))
        self.members = {str(self.underlay.interface.ip)}
        # On an IPv6 underlay the BPF programs carry no pods (udp and ipip need an IPv4 one) but
        # are the member filter of VXLAN over IPv6 (agentd.dataplane.bpf).
        if self.cfg.network.datapath != "userspace":
            # Learn now whether udp and ipip can run in BPF here: the node record says so, and
            # peers choose how to speak to us by it (a host-gw node may be sent udp any time).
            try:
                await self.bpf.up()
            except BpfUnavailable as err:
                log.warning("the BPF data path cannot run here: %s; udp and ipip use the user-space worker", for_log(str(err)))
        else:
            # A previous run's BPF programs would stay on the underlay with the member list and
            # flags they had then (dropping a later node's packets as a non-member's).
            try:
                gone = await asyncio.to_thread(remove_pinned, self.cfg.agent.bpf_dir, self.underlay.ifindex)
            except Exception as err:  # noqa: BLE001 -- best effort: the user-space path works regardless
                log.warning("datapath = userspace: could not remove a previous run's BPF data path: %s", err)
            else:
                if gone:
                    log.info("datapath = userspace: removed the BPF data path a previous run left: %s", ", ".join(gone))
        await self._ensure(self.own)
        if self.own in self.failed:
            raise RuntimeError(f"backend {self.own}: {self.failed[self.own]}")
        self._task = asyncio.get_running_loop().create_task(self._sync_loop(), name="tunnels")

    def _candidates(self, backend: str) -> tuple[str, ...]:
        """The data paths to try for ``backend``, best first ([network] datapath narrows them)."""
        paths = BACKENDS[backend].datapaths
        choice = self.cfg.network.datapath
        return (choice,) if choice != "auto" and choice in paths else paths

    async def _ensure(self, backend: str) -> None:
        """Bring ``backend`` up on the first of its data paths that comes up; one that failed
        (another VXLAN device holding the VNI during a migration, a worker that did not start)
        is tried again with back-off (``_Retries``), its half-made parts taken away first."""
        if backend in self.active or backend not in BACKENDS:
            return
        if not BACKENDS[backend].encapsulates:
            return  # host-gw: plain routes, nothing to bring up
        if backend in self.failed and not self._retries.due(backend, time.monotonic()):
            return
        assert self.subnet is not None
        reasons = []
        for datapath in self._candidates(backend):
            impl = self._new_worker(IMPLEMENTATIONS[datapath](self, backend))
            try:
                await impl.up(self.subnet)
            except (OSError, DataplaneError, RuntimeError) as err:  # nl.NetlinkError is an OSError
                reasons.append(f"{DATAPATHS[datapath].label}: {err}")
                await _discard(impl)
                continue
            self.active[backend] = impl
            if isinstance(impl, _Worker):  # one stopped for want of peers before: counted on from there
                impl.drops_before = dict(self.worker_drops.get(backend, {}))
            break
        if backend not in self.active:
            failed = f"cannot bring up {backend}: {'; '.join(reasons)}"
            delay = self._retries.failed(backend, time.monotonic())
            (log.error if self.failed.get(backend) != failed else log.warning)(
                "%s; trying again in %.0f s", for_log(failed), delay)
            self.failed[backend] = failed
            return
        recovered = self.failed.pop(backend, None) is not None
        self._retries.succeeded(backend)
        impl = self.active[backend]
        if reasons:
            self.fallbacks[backend] = "; ".join(reasons)
            log.warning("backend %s runs in %s, not its first data path: %s", backend,
                        DATAPATHS[impl.datapath].label, for_log(self.fallbacks[backend]))
        else:
            log.info("backend %s up (%s)", backend, DATAPATHS[impl.datapath].label)
        if BACKENDS[backend].member_filter and impl.datapath == "vxlan-device":
            # The kernel device takes packets from anyone: the member filter is in BPF.
            try:
                await self.bpf.up(filter=backend)
            except BpfUnavailable as err:
                self.unfiltered[backend] = str(err)
                log.error("backend %s has no member filter (packets from non-members are accepted): %s", backend,
                          for_log(str(err)))
        if self.on_node_data is not None:
            self.on_node_data()
        if recovered and self.on_paths is not None:
            self.on_paths()  # its peers were planned "none" while it was down: routes for them now

    def available(self, backend: str) -> str | None:
        return self.failed.get(backend)

    def paths(self) -> LocalPaths:
        """How this node carries each backend now, for the route shapes (agentd.kernel.forwarding)."""
        return LocalPaths({b: impl.datapath for b, impl in self.active.items()}, dict(self.gateways),
                          frozenset(self.helpers))

    def node_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"type": self.own}
        for impl in self.active.values():
            data.update(impl.data())
        # How this node runs udp and ipip: a peer that runs them in its user-space worker must
        # be spoken to through workers (see peer_in_userspace), whatever backend it uses.
        data["datapath"] = "bpf" if self.bpf.dp is not None and self.cfg.network.datapath != "userspace" \
            else "userspace"
        return data

    def _userspace_peers(self, plans: Mapping[str, PeerPlan]) -> set[str]:
        return {addr for addr, p in plans.items() if peer_in_userspace(p)}

    def _peer_flags(self, plans: Mapping[str, PeerPlan]) -> dict[str, int]:
        """The BPF peers map's flags: a user-space peer's udp/ipip goes to our workers."""
        flags = 0
        for backend in self.helpers:
            flags |= layout.TO_WORKER.get(backend, 0)
        return dict.fromkeys(self._userspace_peers(plans), flags) if flags else {}

    def _helpers_wanted(self, plans: Mapping[str, PeerPlan]) -> set[str]:
        """The backends that need a user-space worker beside BPF for the peers that run udp/ipip
        in user space: each such peer's backend (to send to it) and our own (what it sends us)."""
        def in_bpf(backend: str) -> bool:
            return backend in self.active and self.active[backend].datapath == "bpf"

        userspace = self._userspace_peers(plans)
        wanted = {plans[a].backend for a in userspace if in_bpf(plans[a].backend)}
        if userspace and in_bpf(self.own):
            wanted.add(self.own)
        return wanted

    async def _ensure_helpers(self, plans: Mapping[str, PeerPlan]) -> None:
        """User-space workers beside BPF for the peers that run udp/ipip in user space
        (``_helpers_wanted``); those no peer needs any more go in ``_retire_workers``."""
        wanted = self._helpers_wanted(plans)
        for backend in sorted(set(self.helper_failed) - wanted):
            # Its peers are gone: no longer tried (the readiness loop would ask for a whole
            # tunnel pass each time a retry fell due), nor reported.
            del self.helper_failed[backend]
            self._retries.forget(f"helper:{backend}")
            log.info("backend %s: no peer needs a user-space worker any more; no longer trying to start one", backend)
        now = time.monotonic()
        for backend in sorted(wanted - set(self.helpers)):
            if backend in self.helper_failed and not self._retries.due(f"helper:{backend}", now):
                continue
            assert self.subnet is not None
            worker = self._new_worker(_Worker(self, backend))
            try:
                await worker.up(self.subnet)
            except (OSError, DataplaneError, RuntimeError) as err:  # nl.NetlinkError is an OSError
                await _discard(worker)
                delay = self._retries.failed(f"helper:{backend}", now)
                (log.error if self.helper_failed.get(backend) != str(err) else log.warning)(
                    "backend %s: no user-space worker for the peers that need one: %s; trying again in %.0f s",
                    backend, err, delay)
                self.helper_failed[backend] = str(err)
                continue
            self.helper_failed.pop(backend, None)
            self._retries.succeeded(f"helper:{backend}")
            self.helpers[backend] = worker
            worker.drops_before = dict(self.worker_drops.get(backend, {}))
            log.info("backend %s: user-space worker up for the peers that receive in user space", backend)
            if self.on_paths is not None:
                self.on_paths()

    async def _retire_workers(self) -> None:
        """The user-space workers no peer needs any more (their last peer left, or reaches us
        otherwise now) stop, and their process, socket and TUN device go -- as flannel takes a
        departed node's routes away; another starts when a peer needs one.  Our own backend's
        stays while we run (peers must be able to reach us; flannel0 stays while flanneld
        runs).  Decided on the latest plans, and a worker leaves the data paths the routes are
        computed from before anything is waited for: a peer that arrived meanwhile keeps it."""
        plans = [*self._plans.values(), *self.plans_v6.values()]
        used = {p.backend for p in plans}
        helpers = self._helpers_wanted(self._plans)
        retired: list[tuple[_Worker, str]] = []
        for backend, impl in list(self.active.items()):
            if backend != self.own and backend not in used and isinstance(impl, _Worker):
                del self.active[backend]
                self.fallbacks.pop(backend, None)
                retired.append((impl, ""))
        for backend, worker in list(self.helpers.items()):
            if backend not in helpers:
                del self.helpers[backend]
                retired.append((worker, " for peers that receive in user space"))
        if not retired:
            return
        if self.on_paths is not None:
            self.on_paths()  # (their peers are gone: no route goes through them)
        for worker, what in retired:
            self.worker_drops[worker.name] = worker.drops()
            self._retiring.add(worker)
            try:
                self.hold_port(worker.name, await worker.retire())
            except Exception as err:  # noqa: BLE001 -- the others still go; a later start replaces what stays
                log.warning("backend %s: could not stop the user-space worker%s no peer needs any more: %s",
                            worker.name, what, err)
            else:
                log.info("backend %s: no peer needs the user-space worker%s any more: stopped, %s removed",
                         worker.name, what, worker.device)
            finally:
                self._retiring.discard(worker)
        if self.on_node_data is not None and any(not what for _w, what in retired):
            self.on_node_data()  # its data (udp_port) leaves our node record

    def hold_port(self, backend: str, port: socket.socket | None) -> None:
        """Keep the port socket of a worker that stopped for want of peers until the next one."""
        if port is not None:
            held = self._held_ports.pop(backend, None)
            if held is not None and held is not port:
                held.close()
            self._held_ports[backend] = port

    def _new_worker(self, impl: Any) -> Any:
        """A worker about to start takes the port socket the one before it held."""
        if isinstance(impl, _Worker) and impl.port_socket is None:
            impl.port_socket = self._held_ports.pop(impl.name, None)
        return impl

    def apply(
        self,
        plans: Mapping[str, PeerPlan],
        next_hops: Mapping[str, list[str]],
        nodes: Mapping[str, NodeRecord],
        *,
        members_known: bool = True,
        prune: bool = True,
        plans_v6: Mapping[str, PeerPlan] | None = None,
        next_hops_v6: Mapping[str, list[str]] | None = None,
    ) -> None:
        """Bring tunnel state in line with the peer plans (in the background, coalesced).
        ``plans_v6``, ``next_hops_v6``: a dual-stack node's IPv6 plans and the IPv6 pod
        subnets routed by them (the BPF data path carries those of udp peers).

        ``prune`` False (until BGP has re-learned every route after a restart) only adds and
        updates tunnel state, never removes it, like the kernel routes adopted at start.
        ``members_known`` is False until the node registry has been read once: until then the
        member filters keep whatever they had (a restarted agent must not start dropping its
        peers' traffic because it has not heard of them yet)."""
        self._plans, self._next_hops, self._prune = plans, next_hops, prune
        self.plans_v6, self.next_hops_v6 = dict(plans_v6 or {}), dict(next_hops_v6 or {})
        if members_known:
            self.members = {str(n.peer_address) for n in nodes.values()} | {str(self.underlay.interface.ip)}
            self.hosts_v6 = host_addresses_v6(nodes.values(), self.node_name, own_ranges_v6(self.cfg, self.underlay))
            self._members_known = True
            # Only the peers reached through a tunnel need the backend their record names: one
            # reached directly (cross-subnet, on our segment) needs none, so a backend named only
            # by such peers is not tried again when it failed.  ("none": planned so because its
            # backend failed here -- it needs it all the same.)
            tunnelled = {p.node for p in [*plans.values(), *self.plans_v6.values()] if p.backend != HOST_GW}
            self._needed = {str(n.backend.get("type") or self.own) for n in nodes.values()
                            if n.name != self.node_name and n.name in tunnelled}
        self._dirty.set()

    async def _remove_unused(self) -> None:
        """Once BGP has re-learned every route after a start: what a previous run left of a
        backend no peer uses now ([network] backend changed) goes -- a VXLAN device would take
        VXLAN from anyone, a worker would keep forwarding.  So does the worker of a backend that
        now runs in BPF (a previous run's datapath = "userspace") with no worker beside it."""
        used = {*self.active, *self.helpers}
        in_worker = {*self.helpers, *(b for b, impl in self.active.items() if impl.datapath == "userspace")}
        gone = await remove_worker_leftovers(Path(self.cfg.agent.state_dir), [k for k in ("udp", "ipip") if k not in in_worker])
        if "vxlan" not in used:
            gone += await asyncio.to_thread(remove_vxlan_leftover)
        if gone:
            log.info("removed what a previous run left of backends no peer uses now: %s", ", ".join(gone))

    def resync(self) -> None:
        """Bring every backend's state in line again (a worker was started again)."""
        self._dirty.set()

    async def _sync_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._pass()
            except Exception:
                log.exception("tunnel sync failed; retrying")
                await asyncio.sleep(1.0)
                self._dirty.set()

    async def _pass(self) -> None:
        """One pass of the sync loop: the backends, workers, underlay next hops, peer entries
        and BPF maps the last ``apply`` asks for."""
        plans, next_hops, prune = self._plans, self._next_hops, self._prune
        needed = self._needed
        for backend in sorted(b for b in self.failed if needed is not None and b not in needed and b != self.own):
            # No peer reached through a tunnel names it any more: no longer tried (a success
            # would make a device nobody uses); a peer that needs it later has it tried at once.
            del self.failed[backend]
            self._retries.forget(backend)
            log.info("backend %s: no peer reached through a tunnel uses it any more; no longer trying to bring it up", backend)
        # (a backend that failed is planned "none" for its peers: tried again all the same)
        wanted = {p.backend for p in [*plans.values(), *self.plans_v6.values()]} | set(self.failed)
        for backend in sorted(wanted & set(BACKENDS)):
            await self._ensure(backend)
        await self._ensure_helpers(plans)
        await self._resolve_gateways(plans)
        if not self._members_known:
            return
        if prune:  # (not before BGP has re-learned every route: a re-attached worker's table carries them)
            await self._retire_workers()
        errors = []
        for impl in [*self.active.values(), *self.helpers.values()]:
            try:
                await impl.sync(plans, next_hops, prune)
            except Exception as err:  # noqa: BLE001 -- the others and the BPF maps are synced regardless
                errors.append(err)
        if prune and not self._leftovers_removed:
            self._leftovers_removed = True
            await self._remove_unused()
        routes = {**self._bpf_routes(plans, next_hops), **self._bpf_routes(self.plans_v6, self.next_hops_v6)}
        await self.bpf.sync(routes, set(self.members), self._peer_flags(plans), prune=prune)
        if errors:
            raise errors[0]

    def _bpf_routes(self, plans: Mapping[str, PeerPlan], next_hops: Mapping[str, list[str]]) -> dict:
        routes = {}
        paths = self.paths()
        for nh, dsts in next_hops.items():
            plan = plans.get(nh)
            if plan is None or plan.backend not in self.bpf.carried or paths.datapath(plan) != "bpf":
                continue
            for dst in dsts:  # IPv4 and IPv6 pod subnets: BpfPath puts each in its family's map
                with contextlib.suppress(ValueError):
                    routes[ip_network(dst)] = (nh, plan.backend)
        return routes

    async def _resolve_gateways(self, plans: Mapping[str, PeerPlan], *, every: float = GATEWAY_REFRESH) -> None:
        """The underlay next hop toward each BPF peer off this node's segment, as the kernel
        routes it (RTM_GETROUTE), re-read every ``every`` seconds; a change recomputes routes."""
        peers = sorted(a for a, p in plans.items() if p.backend in self.bpf.carried and not self.underlay.on_link(a))
        now = time.monotonic()
        if not peers:
            # Nothing to re-read; noted as read all the same, or the readiness loop would ask
            # for a whole tunnel pass every 2 s instead of every GATEWAY_REFRESH (refresh()).
            self._gateways_at = now
            return
        if set(peers) <= set(self.gateways) | set(self.unreachable) and now - self._gateways_at < every:
            return
        self._gateways_at = now
        gateways, unreachable = await asyncio.to_thread(_underlay_next_hops, peers, self.underlay.ifindex)
        if gateways != {p: self.gateways[p] for p in peers if p in self.gateways}:
            for p, why in unreachable.items():
                log.warning("peer %s: %s; no BPF route to it", p, why)
            self.gateways, self.unreachable = gateways, unreachable
            if self.on_paths is not None:
                self.on_paths()

    async def refresh(self) -> None:
        """Each part on its own: one that fails (an unexpected stats record, a netlink error)
        leaves the others refreshed; its error is logged when it starts or changes, not every
        2 s, and that it works again is logged too."""
        parts: list[tuple[str, Callable[[], Any]]] = [  # _ensure may add one meanwhile: a copy
            *((f"the {b} data-plane worker", impl.refresh_stats) for b, impl in list(self.active.items())
              if isinstance(impl, _Worker)),
            *((f"the {b} data-plane worker for peers that receive in user space", w.refresh_stats)
              for b, w in list(self.helpers.items()) if isinstance(w, _Worker)),
            ("the BPF data path", self.bpf.refresh),
        ]
        for name, refresh in parts:
            try:
                await refresh()
            except Exception as err:  # the other parts are refreshed regardless
                if self._refresh_failing.get(name) != repr(err):
                    log.error("refreshing %s failed: %s; trying again every 2 s", name, err, exc_info=err)
                self._refresh_failing[name] = repr(err)
            else:
                if self._refresh_failing.pop(name, None) is not None:
                    log.info("refreshing %s works again", name)
        now = time.monotonic()
        if self._plans and now - self._gateways_at >= GATEWAY_REFRESH:
            self._dirty.set()  # the sync loop re-reads the underlay next hops
        if self._retries.any_due(now):
            self._dirty.set()  # a backend or worker that failed is tried again
        for impl in list(self.active.values()):
            if isinstance(impl, _Vxlan) and not impl.reread and now - impl.read_at >= VXLAN_REREAD:
                impl.reread = True  # the sync loop re-reads the VTEP's entries and puts back what went
                self._dirty.set()

    def status(self) -> dict[str, Any]:
        active = {}
        for b, impl in self.active.items():
            active[b] = impl.status()
            if b in self.fallbacks:
                active[b]["fallback"] = self.fallbacks[b]
        return {
            "own": self.own,
            "active": active,
            "failed": dict(self.failed),
            "bpf": self.bpf.status(),
            "member_filter": {
                "bpf": sorted(self.bpf.carried | self.bpf.filtered) if self.bpf.dp else [],
                "userspace": sorted(b for b, impl in self.active.items() if impl.datapath == "userspace"),
                "missing": dict(self.unfiltered),
            },
            "unreachable": dict(self.unreachable),
            "userspace_peers_worker": {b: w.status() for b, w in self.helpers.items()},
            "userspace_peers_worker_failed": dict(self.helper_failed),
        }

    def problems(self) -> list[str]:
        """User-space workers that died and could not be started again (tried every 2 s): the
        traffic of their peers goes nowhere meanwhile (/healthz says so)."""
        workers = [(b, w, "") for b, w in self.active.items()] + [
            (b, w, " for peers that receive in user space") for b, w in self.helpers.items()]
        return [f"the {b} data-plane worker{what} is down: {w.error}; trying again"
                for b, w, what in workers if isinstance(w, _Worker) and w.error] + [
            f"{v.error}; trying again" for v in self.active.values() if isinstance(v, _Vxlan) and v.error]

    async def stop(self, *, remove: bool) -> None:
        """Stop every backend and the BPF data path; with ``remove`` take their devices,
        workers and programs away too, and raise (after trying them all) naming those that
        could not be (a leave reports it; a stop that keeps them goes on quietly)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        errors = []

        async def down(what: str, job: Callable[[], Awaitable[object]]) -> None:
            try:
                await job()
            except Exception as err:  # noqa: BLE001 - the others still go
                errors.append(f"{what}: {str(err) or type(err).__name__}")

        for name, impl in [*self.active.items(), *self.helpers.items()]:
            await down(name, lambda impl=impl: impl.down(remove))
        async def retire(worker: _Worker) -> None:
            port = await worker.retire()
            if port is not None:
                port.close()

        for worker in list(self._retiring):  # a pass stopping it was cancelled: it goes all the same
            job = (lambda w=worker: retire(w)) if remove else (lambda w=worker: w.down(False))
            await down(f"the {worker.name} worker no peer needs", job)
        for port in self._held_ports.values():
            port.close()
        self._held_ports.clear()
        await down("the BPF data path", lambda: self.bpf.down(remove))
        if remove and "vxlan" not in self.active:  # a previous run's (nothing of ours survives a leave)
            await down("the VXLAN device", lambda: asyncio.to_thread(remove_vxlan_leftover))
        if errors and remove:
            raise RuntimeError("; ".join(errors))


async def _discard(impl: Any) -> None:
    """What a backend's ``up`` that failed made (a device, a worker started) goes."""
    discard = getattr(impl, "discard", None)
    if discard is None:
        return  # InBpf: BpfPath.up(carry=...) changes nothing when it fails
    try:
        await discard()
    except Exception as err:  # noqa: BLE001 -- the next try adopts or replaces what stays
        log.warning("could not take away what the %s backend's failed start made: %s", impl.name, err)


def _underlay_next_hops(peers: list[str], ifindex: int) -> tuple[dict[str, str], dict[str, str]]:
    """peer -> the gateway the kernel routes it through (the peer itself when on-link), for the
    peers routed out of the underlay device; the others with the reason."""
    gateways, unreachable = {}, {}
    with Rtnl() as rt:
        for peer in peers:
            try:
                route = rt.route_get(peer)
            except nl.NetlinkError as err:
                unreachable[peer] = f"no route to its underlay address ({err})"
                continue
            oif = route.oif if route is not None else None
            gateway = socket.inet_ntoa(route.gateway) if route is not None and route.gateway else None
            if oif != ifindex:
                unreachable[peer] = f"its underlay address is routed out of interface {oif}, not the underlay device"
                continue
            gateways[peer] = gateway or peer
    return gateways, unreachable


def dataplane_metrics(t: Tunnels):
    """Prometheus families from the data paths: per-peer packets and bytes from the BPF maps,
    drops by reason from the BPF maps and the user-space workers."""
    from prometheus_client.core import CounterMetricFamily

    packets = CounterMetricFamily("agentd_dataplane_peer_packets", "packets to (tx) and from (rx) each peer, "
                                  "counted by the BPF data path", labels=["peer", "direction"])
    nbytes = CounterMetricFamily("agentd_dataplane_peer_bytes", "bytes to (tx) and from (rx) each peer, "
                                 "counted by the BPF data path", labels=["peer", "direction"])
    for peer, c in (t.bpf.counters.get("peers") or {}).items():
        for direction in ("tx", "rx"):
            packets.add_metric([peer, direction], float(c[f"{direction}_packets"]))
            nbytes.add_metric([peer, direction], float(c[f"{direction}_bytes"]))
    drops = CounterMetricFamily("agentd_dataplane_drops", "packets the data path dropped, by reason",
                                labels=["datapath", "backend", "reason"])
    for reason, c in (t.bpf.counters.get("drops") or {}).items():
        drops.add_metric(["bpf", "", reason], float(c["packets"]))
    running = set()
    for backend, impl in [*t.active.items(), *t.helpers.items()]:
        if isinstance(impl, _Worker):
            running.add(backend)
            for reason, n in impl.drops().items():
                drops.add_metric(["userspace", backend, reason], float(n))
    for backend, counted in t.worker_drops.items():  # stopped for want of peers: what they counted stays
        if backend not in running:
            for reason, n in counted.items():
                drops.add_metric(["userspace", backend, reason], float(n))
    return [packets, nbytes, drops]


def remove_bpf_leftovers(cfg: Config) -> list[str]:
    """``agentd leave`` with no agent running: detach and unpin the BPF data path and the pod
    fast path a killed agent left behind in this network namespace (nothing of ours survives a
    leave)."""
    from agentd.dataplane.bpf import remove_pinned
    from agentd.dataplane.bpf.podpath import remove_pinned_fast_path
    from agentd.kernel.netinfo import NetInfoError, underlay_for

    ifindex = None
    address = cfg.node.address or cfg.node.address_v6
    if address is not None:
        with contextlib.suppress(NetInfoError):
            ifindex = underlay_for(address).ifindex
    return remove_pinned_fast_path(cfg.agent.bpf_dir) + remove_pinned(cfg.agent.bpf_dir, ifindex)
