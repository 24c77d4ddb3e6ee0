"""The in-kernel data path on one underlay device: load or adopt, fill the maps, count, remove.

Everything lives in the kernel; this object only holds file descriptors to it (through
libbpf, which loads the object file).  The maps and programs are pinned in a BPF file
system, one directory per network namespace::

    <bpf_dir>/netns-<inode>/      [agent] bpf_dir, default /sys/fs/bpf/agentd
        agentd_routes  agentd_routes6  agentd_peers  agentd_drops
        agentd_ports  agentd_config  agentd_peers6  agentd_config6   the maps
        agentd_egress  agentd_ingress                                the programs
        links/agentd_egress-<ifindex>  links/agentd_ingress-<ifindex>  the tcx links (tc.py)

(the namespace's inode number keeps two agents on one machine, e.g. the lab's nodes, apart).
The hooks hold the programs (a pinned link, or a cls_bpf filter) and the programs hold the
maps, so pod traffic keeps flowing when the agent dies; the pins let the next agent find the
maps and its attachments again -- by BPF_OBJ_GET, which CAP_BPF allows, where opening
anything by its id would take CAP_SYS_ADMIN.

:meth:`BpfDatapath.open` has libbpf load the object with its maps pinned by name in that
directory: libbpf reuses the maps pinned there (the agent first removes a pin of another shape
-- type, sizes, flags -- which libbpf would refuse), so routes, members and counters survive a
restart or an upgrade; it creates and pins the rest, loads the programs afresh, and the agent
swaps them onto the device in place (a link update or tc filter replace: no packet sees no
program).  :meth:`remove` takes everything away again: programs off the hooks, pins, directory.

IPv6 pods (the udp backend) need one more thing in the kernel: Linux routes IPv6 only through
IPv6 next hops, so an IPv6 pod subnet's kernel route goes ``via ::ffff:<peer> dev <underlay>
onlink`` -- the peer's underlay address, IPv4-mapped (RFC 4291 section 2.5.5.2; no link ever
has such an address) -- and :meth:`BpfDatapath.set_gateways6` keeps a permanent neighbour entry
for each such gateway on the underlay device (the device's own MAC: the egress program gives
the outer packet the MACs of the real underlay next hop).  Those entries -- permanent,
IPv4-mapped, on the underlay device -- are the agent's: adopted on restart, removed with the
rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import socket
import struct
from collections.abc import Callable, Collection, Iterable, Mapping
from ipaddress import IPv4Network, IPv6Address, IPv6Network, ip_network
from pathlib import Path

from agentd.kernel import netlink as nl
from agentd.kernel.rtnl import Rtnl, of_kind

from . import layout, tc
from . import libbpf as lb

log = logging.getLogger("agentd.bpf")

OBJECT = Path(__file__).with_name("datapath.bpf.o")
DEFAULT_BPF_DIR = "/sys/fs/bpf/agentd"
DIRECTIONS = {layout.EGRESS: "egress", layout.INGRESS: "ingress"}  # program name -> its hook


class BpfUnavailable(RuntimeError):
    """The in-kernel data path cannot run here; ``str()`` is the reason (for /status and the log)."""


# Why the pin directory cannot be made (ensure_dir's reasons), and which of them the log has
# given in full: one cause that stops every BPF part of the agent (the data path, the member
# filter, the pod fast path) is logged in full once per run (this process), the other parts'
# lines refer to it.  /status keeps the full reason for each part.
_PIN_DIR_REASONS: set[str] = set()
_PIN_DIR_LOGGED: set[str] = set()
PIN_DIR_LOGGED_ABOVE = "its BPF pin directory cannot be made (the reason is logged above)"


def for_log(reason: str) -> str:
    """``reason`` (a BPF part's, as /status has it) as a log line gives it: a pin directory
    that cannot be made in full the first time this run logs it, and as
    :data:`PIN_DIR_LOGGED_ABOVE` after that."""
    for cause in _PIN_DIR_REASONS:
        if cause in reason:
            if cause in _PIN_DIR_LOGGED:
                reason = reason.replace(cause, PIN_DIR_LOGGED_ABOVE)
            else:
                _PIN_DIR_LOGGED.add(cause)
    return reason


def pin_dir(bpf_dir: str | os.PathLike) -> Path:
    """Where this network namespace's agent pins its maps and programs."""
    return Path(bpf_dir) / f"netns-{os.stat('/proc/self/ns/net').st_ino}"


def gateway6(peer: str) -> str:
    """The next hop of an IPv6 pod subnet's kernel route to BPF peer ``peer`` (its underlay
    IPv4 address): the peer's IPv4-mapped address, ``::ffff:192.0.2.7``."""
    return socket.inet_ntop(socket.AF_INET6, bytes(10) + b"\xff\xff" + socket.inet_aton(peer))


def explain(err: OSError) -> str:
    if err.errno == errno.EPERM:
        return f"{err} (needs CAP_BPF and CAP_NET_ADMIN)"
    return str(err)


class BpfDatapath:
    def __init__(self, ifindex: int, bpf_dir: str | os.PathLike = DEFAULT_BPF_DIR,
                 object_path: Path = OBJECT, *, attach: str = "auto") -> None:
        self.ifindex = ifindex
        self.dir = pin_dir(bpf_dir)
        self.bpf_dir = Path(bpf_dir)
        self.object_path = object_path
        self.attach = attach  # [network] bpf_attach
        self.hook: str | None = None  # what it resolved to here: "tcx" | "clsact"
        self.obj: lb.BpfObject | None = None
        self.maps: dict[str, int] = {}  # name -> fd (libbpf's)
        self.progs: dict[str, int] = {}  # program name -> fd (libbpf's)
        self.adopted: list[str] = []  # maps found pinned and kept
        self.routes: dict[IPv4Network | IPv6Network, tuple[str, str]] = {}  # as in the two routes maps
        self.gateways6: set[str] = set()  # peers with a neighbour entry for gateway6(peer)
        self.ports: dict[tuple[int, bytes], int] = {}  # as in the map
        self.ports_refused = 0  # learned MACs the full ports map refused at the last sync
        self.members: set[str] = set()
        self.members_refused = 0  # members the full member maps refused at the last sync
        self._replaced_members: dict[str, dict[bytes, int]] = {}  # map -> key -> flags, of older maps (open)
        self.peer_flags: dict[str, int] = {}
        self.guarded: set[int] = set()  # bridges the ingress filter is attached to as well
        self.unguarded: dict[int, str] = {}  # bridges it could not be attached to, and why
        self.config: layout.Config | None = None
        self.ncpus = 0
        self.prog_ids: dict[str, int] = {}
        self.pins = tc.Pins(self.dir)  # read at open: how our programs on the hooks are known
        self.unidentified: set[str] = set()  # programs on our hooks we could not take over, and why

    # ------------------------------------------------------------------ open / close

    def open(self, config: layout.Config, *, clear: int = 0) -> None:
        """Adopt or create the maps, load and attach the programs, write ``config`` (``clear``:
        as in :meth:`set_config`).
        Raises :class:`BpfUnavailable` with the reason when any of it cannot be done, having
        taken our programs off the device again: those this call had put on, and a previous
        agent's it never reached (they would go on steering the user-space worker's packets
        by maps no agent keeps any more)."""
        obj: lb.BpfObject | None = None
        try:
            self.hook = resolve_hook(self.attach)
            obj = open_checked(self.object_path, lambda o: layout.check(o.maps, o.programs))
            ensure_dir(self.bpf_dir, self.dir)
            self.pins = tc.Pins.read(self.dir)  # the previous agent's programs, before ours replace the pins
            tc.sweep(self.pins)
            self.ncpus = lb.possible_cpus()
            self.adopted = adopt_pins(obj, self.dir, self._replacing)
            obj.load()
            self.obj = obj
            self.maps = {name: obj.map_fd(name) for name in layout.MAPS}
            self._carry_members()
            self._read_back()
            self.set_config(config, keep=True, clear=clear)
            for name in layout.PROGRAMS:
                self.progs[name] = obj.prog_fd(name)
                self.prog_ids[name] = lb.prog_info(self.progs[name])["id"]
            # Attach (replacing the previous agent's programs in place), then pin.
            for name, fd in self.progs.items():
                self._note(tc.attach(self.ifindex, DIRECTIONS[name], fd, name, self.hook, self.pins))
                pin(self.dir, fd, name)
        except (OSError, tc.TcError, BpfUnavailable) as err:  # lb.BpfError is an OSError
            if isinstance(err, lb.BpfError):
                reason = explain(err)
            else:  # an OSError names its file (a pin, a link's pin) or its netlink request
                reason = str(err)
            if obj is not None:
                obj.close()
            self.close()
            raise BpfUnavailable(reason + self._detach(list(layout.PROGRAMS))) from None

    def _replacing(self, name: str, fd: int, info: dict) -> None:
        """A member map of another shape (an older agent's: another size) :func:`adopt_pins` is
        about to remove: its members are read, so that the new map holds them before the new
        programs replace the old ones on the device -- an empty one would drop every member's
        packets until the first sync after the members are known, seconds or more."""
        if name not in (layout.PEERS, layout.PEERS6) or info["key_size"] != (
                layout.PEER_KEY.size if name == layout.PEERS else layout.ADDR6.size):  # fmt: skip
            return
        size = ((info["value_size"] + 7) & ~7) * self.ncpus if name == layout.PEERS else info["value_size"]
        found = {}
        try:
            for key in lb.map_keys(fd, info["key_size"]):
                raw = lb.map_lookup(fd, key, size)
                flags = struct.unpack_from("<Q", raw)[0] if name == layout.PEERS and raw and len(raw) >= 8 else 0
                found[key] = flags
        except lb.BpfError as err:  # its members come with the first sync, as they would anyway
            log.warning("BPF: could not read the members of %s of an older layout: %s", name, explain(err))
        self._replaced_members[name] = found

    def _carry_members(self) -> None:
        """The members :meth:`_replacing` read, into the new maps (their flags; counters from 0)."""
        slot = (layout.PEER_STATS.size + 7) & ~7
        for name, found in self._replaced_members.items():
            fd = self.maps[name]
            for key, flags in found.items():
                value = b"".join(struct.pack("<Q", flags).ljust(slot, b"\0") for _ in range(self.ncpus)) \
                    if name == layout.PEERS else layout.PEER6_VALUE.pack(1)
                try:
                    lb.map_update(fd, key, value, lb.BPF_NOEXIST)
                except OSError as err:
                    if err.errno not in (errno.EEXIST, errno.E2BIG):
                        raise
        self._replaced_members.clear()

    def _note(self, lines: list[str]) -> None:
        self.unidentified.update(lines)

    def _detach(self, names: list[str]) -> str:
        """Take programs ``names`` off the device again after a failed :meth:`open`: the agent
        falls back to the user-space worker, whose packets a half-attached data path would
        take (or drop, as the member filter of a peer set no agent keeps).  Returns what could
        not be done, to add to the reason."""
        if not self.pins.programs:  # the failure came before the previous agent's pins were read
            with contextlib.suppress(OSError):
                self.pins = tc.Pins.read(self.dir)
        for name in names:
            try:
                tc.detach(self.ifindex, (name,), self.pins)
            except (OSError, tc.TcError) as err:
                if self._on_device(name):  # (a read-only bpffs fails the link pin's unlink after the detach)
                    return f"; and {name} could not be taken off device {self.ifindex} again: {err}"
        return ""

    def _on_device(self, name: str) -> bool:
        try:
            return any(f.name == name for f in tc.filters(self.ifindex, self.pins))
        except (OSError, tc.TcError):
            return True  # not known: say so

    def _read_back(self) -> None:
        """What adopted maps hold, so that the first sync only changes what differs."""
        for name, st in ((layout.ROUTES, layout.ROUTE_KEY), (layout.ROUTES6, layout.ROUTE6_KEY)):
            rfd = self.maps[name]
            for key in lb.map_keys(rfd, st.size):
                value = lb.map_lookup(rfd, key, layout.ROUTE_VALUE.size)
                if value is not None:
                    dst, peer, kind = layout.decode_route(key, value)
                    self.routes[ip_network(dst)] = (peer, kind)
        self.gateways6 = set(gateway_neighbours(self.ifindex))
        pfd = self.maps[layout.PEERS]
        slot = (layout.PEER_STATS.size + 7) & ~7
        for key in lb.map_keys(pfd, layout.PEER_KEY.size):
            raw = lb.map_lookup(pfd, key, slot * self.ncpus)
            addr = socket.inet_ntoa(key)
            self.members.add(addr)
            self.peer_flags[addr] = struct.unpack_from("<Q", raw)[0] if raw else 0
        for key in lb.map_keys(self.maps[layout.PEERS6], layout.ADDR6.size):
            self.members.add(socket.inet_ntop(socket.AF_INET6, key))
        for key in lb.map_keys(self.maps[layout.PORTS], layout.PORT_KEY.size):
            value = lb.map_lookup(self.maps[layout.PORTS], key, layout.PORT_VALUE.size)
            if value is not None:
                self.ports[layout.PORT_KEY.unpack(key)] = layout.PORT_VALUE.unpack(value)[0]

    def close(self) -> None:
        """Let go of the file descriptors; everything stays in the kernel."""
        if self.obj is not None:
            self.obj.close()
            self.obj = None
        self.maps.clear()
        self.progs.clear()

    def remove(self) -> None:
        """Detach the programs, remove every pin and the gateways' neighbour entries: nothing
        of ours is left in the kernel."""
        self.close()
        remove_pinned(self.bpf_dir, self.ifindex)
        self.gateways6.clear()

    # ------------------------------------------------------------------ desired state

    def set_config(self, config: layout.Config, *, keep: bool = False, clear: int = 0) -> None:
        """Write ``config``.  The decapsulation flags the program has found its kernel refuses
        stay cleared (it clears them in the live value; setting them again would cost a failed
        try per write).  ``keep`` also keeps every backend flag the live value has (an agent
        that adopted the maps must not stop decapsulating before it knows what it carries);
        ``clear``: flags off whatever the live value has."""
        fd = self.maps[layout.CONFIG]
        key = layout.CONFIG_KEY.pack(0)
        raw = lb.map_lookup(fd, key, layout.CONFIG_VALUE.size)
        raw6 = lb.map_lookup(self.maps[layout.CONFIG6], key, layout.ADDR6.size)
        live = layout.Config.unpack(raw, raw6) if raw else None
        flags = config.flags
        if live is not None and live.local != "0.0.0.0":  # a value an agent wrote (this run or the last)
            learned = layout.CFG_DECAP_L3_FLAG | layout.CFG_DECAP_L4_FLAGS
            flags = (flags & ~learned) | (flags & live.flags & learned)
            if keep:
                flags |= live.flags & ~learned
        value = dataclasses.replace(config, flags=flags & ~clear)
        if live is None or value.local6 != live.local6:  # first: the address the IPv4 config's flags filter at
            lb.map_update(self.maps[layout.CONFIG6], key, value.pack6())
        if live is None or value.pack() != live.pack():
            lb.map_update(fd, key, value.pack())
        self.config = value

    def set_routes(self, routes: Mapping[IPv4Network | IPv6Network, tuple[str, str]]) -> None:
        """Make the routes maps exactly ``routes`` (pod subnet, IPv4 or IPv6 -> (peer underlay
        IPv4 address, kind)); ValueError, before anything changes, for a route the programs
        cannot carry (an IPv6 one by ipip)."""
        for dst, (peer, kind) in routes.items():
            layout.check_route(dst, peer, kind)
        for dst, (peer, kind) in routes.items():
            if self.routes.get(dst) != (peer, kind):
                lb.map_update(self.maps[layout.routes_map(dst)], layout.route_key(dst), layout.route_value(peer, kind))
                self.routes[dst] = (peer, kind)
        for dst in [d for d in self.routes if d not in routes]:
            lb.map_delete(self.maps[layout.routes_map(dst)], layout.route_key(dst))
            del self.routes[dst]

    def set_gateways6(self, peers: Iterable[str]) -> None:
        """Make the permanent neighbour entries of the IPv6 routes' gateways (:func:`gateway6`)
        on the underlay device exactly those of ``peers``."""
        wanted = set(peers)
        if wanted == self.gateways6:
            return
        with Rtnl() as rt:
            link = rt.link(socket.if_indextoname(self.ifindex))
            mac = link.address if link is not None and link.address else bytes(6)
            for peer in sorted(wanted - self.gateways6):
                _neighbour(rt, nl.RTM_NEWNEIGH, self.ifindex, peer, mac)
                self.gateways6.add(peer)
            for peer in sorted(self.gateways6 - wanted):
                _neighbour(rt, nl.RTM_DELNEIGH, self.ifindex, peer)
                self.gateways6.discard(peer)

    def set_members(self, members: Iterable[str], peer_flags: Mapping[str, int] | None = None) -> None:
        """Make the member set exactly ``members`` (underlay addresses: IPv4 ones, or IPv6
        ones on an IPv6 underlay, each kept in its family's map), with ``peer_flags`` (enum
        peer_flag, e.g. for peers this node speaks to through its user-space workers); the
        counters of those that stay are kept.  Members that go are taken out first; one a
        full map refuses (E2BIG: more than :data:`layout.MEMBERS_MAX` of a family) is left
        out -- what fits stays in, counted as ``members_refused`` in the status, logged once
        while it lasts -- and tried again at the next sync."""
        wanted6 = {a for a in members if ":" in a}
        wanted = {a for a in members if ":" not in a}
        fd6 = self.maps[layout.PEERS6]
        fd = self.maps[layout.PEERS]
        for addr in [a for a in self.members if ":" in a and a not in wanted6]:
            lb.map_delete(fd6, layout.ADDR6.pack(socket.inet_pton(socket.AF_INET6, addr)))
            self.members.discard(addr)
        for addr in {a for a in self.members if ":" not in a} - wanted:
            lb.map_delete(fd, layout.peer_key(addr))
            self.members.discard(addr)
            self.peer_flags.pop(addr, None)
        refused = 0
        for addr in sorted(wanted6 - self.members):
            try:
                lb.map_update(fd6, layout.ADDR6.pack(socket.inet_pton(socket.AF_INET6, addr)), layout.PEER6_VALUE.pack(1))
            except OSError as err:
                if err.errno != errno.E2BIG:
                    raise
                refused += 1
                continue
            self.members.add(addr)
        flags = {a: (peer_flags or {}).get(a, 0) for a in wanted}
        slot = (layout.PEER_STATS.size + 7) & ~7
        for addr in sorted(wanted):
            key = layout.peer_key(addr)
            if addr in self.members and self.peer_flags.get(addr, 0) == flags[addr]:
                continue
            raw = bytearray(lb.map_lookup(fd, key, slot * self.ncpus) or bytes(slot * self.ncpus))
            for cpu in range(self.ncpus):  # the flags in every CPU's copy, the counters as they are
                struct.pack_into("<Q", raw, cpu * slot, flags[addr])
            try:
                lb.map_update(fd, key, bytes(raw))
            except OSError as err:
                if err.errno != errno.E2BIG:
                    raise
                refused += 1
                continue
            self.members.add(addr)
            self.peer_flags[addr] = flags[addr]
        if refused and not self.members_refused:
            log.error("BPF: the member maps hold at most %d nodes of each address family: %d cluster members are "
                      "left out (%d are in); encapsulated packets from them are dropped as from non-members",
                      layout.MEMBERS_MAX, refused, len(self.members))
        elif self.members_refused and not refused:
            log.info("BPF: every cluster member is in the member maps again")
        self.members_refused = refused

    def set_ports(self, ports: Mapping[tuple[int, bytes], int]) -> None:
        """Make the ports map ``ports`` ((bridge ifindex, MAC) -> port ifindex), as far as it
        fits: at most PORT_MACS_MAX MACs behind any one port (a pod flooding its bridge with
        made-up source MACs -- possible with ``[policy] check_source_mac = false`` -- takes that
        many entries, not the map: the other pods' MACs, a new pod's too, still get in), stale
        entries go first, and an entry left out -- over its port's share, or refused by the
        full map (E2BIG: many ports flooding) -- is counted (``bridge_ports_refused`` in the
        status), logged once while it lasts, and left to the stack's path; once the flood's
        MACs age out of the bridge their entries go and the ones left out get in."""
        fd = self.maps[layout.PORTS]
        ports, capped = per_port_share(ports, self.ports)
        for key in [k for k in self.ports if k not in ports]:
            lb.map_delete(fd, layout.PORT_KEY.pack(*key))
            del self.ports[key]
        refused = capped
        for (bridge, mac), port in ports.items():
            if self.ports.get((bridge, mac)) != port:
                try:
                    lb.map_update(fd, layout.PORT_KEY.pack(bridge, mac), layout.PORT_VALUE.pack(port))
                except OSError as err:
                    if err.errno != errno.E2BIG:
                        raise
                    refused += 1
                    continue
                self.ports[(bridge, mac)] = port
        if refused and not self.ports_refused:
            log.warning("BPF: %d learned MACs are not in the bridge ports map (%d entries; at most %d behind one "
                        "port%s): they are delivered by the stack until the bridges forget some",
                        refused, len(self.ports), PORT_MACS_MAX, f", {capped} over their port's share" if capped else "")
        elif self.ports_refused and not refused:
            log.info("BPF: every learned MAC is in the bridge ports map again")
        self.ports_refused = refused

    def gated(self, wire: str) -> bool:
        """Whether program ``wire`` (the pod fast path's) runs after our ingress program on the
        device's ingress hook: decapsulated packets reach it then (datapath.c deliver_gated)."""
        order = [f.name for f in tc.filters(self.ifindex) if f.direction == "ingress" and f.name in (layout.INGRESS, wire)]
        return layout.INGRESS in order and wire in order and order.index(layout.INGRESS) < order.index(wire)

    def link_kinds(self) -> dict[int, str | None]:
        """The devices here, ifindex -> kind (one RTM_GETLINK dump): a refresh reads them once,
        for :meth:`guard_bridges` and :meth:`sync_ports` both."""
        with Rtnl() as rt:
            return rt.link_kinds()

    def guard_bridges(self, links: Mapping[int, str | None] | None = None) -> set[int]:
        """Attach the ingress filter to every bridge here as well (the pods' bridges, which the
        CNI plugin makes when the first pod comes): encapsulated packets addressed to this node
        are dropped and counted unless they come from a cluster member, whichever device they
        come in by -- a pod sending VXLAN or flannel UDP to its own node included.  ``links``:
        the devices as :meth:`link_kinds` read them for this refresh (None: read now).  Returns
        the bridges guarded."""
        if links is not None:
            bridges = of_kind(links, "bridge")
        else:
            with Rtnl() as rt:
                bridges = rt.bridges()
        fd = self.progs.get(layout.INGRESS)
        if fd is None or self.hook is None:
            return set()
        failed = {}
        for ifindex in sorted(bridges - self.guarded):
            try:
                self._note(tc.attach(ifindex, "ingress", fd, layout.INGRESS, self.hook, self.pins))
            except tc.TcError as err:  # gone since listed, or someone else's filter where ours goes
                failed[ifindex] = str(err)
                if self.unguarded.get(ifindex) != str(err):  # logged once, tried again at every refresh
                    log.warning("bridge %d not guarded by the member filter: %s; trying again", ifindex, err)
        if self.guarded - bridges:  # a bridge that went took its filter along; its link's pin stays
            tc.sweep(self.pins)
        self.guarded = bridges - set(failed)
        self.unguarded = failed
        return self.guarded

    def sync_ports(self, links: Mapping[int, str | None] | None = None) -> int:
        """Mirror the MACs the bridges learned behind veths -- pods' ports -- into the ports map
        (deliver_local in datapath.c hands only to pods: a bridge whose port is a NIC, with the
        LAN's hosts behind it, takes no room there); returns how many there are.  ``links``:
        the devices as :meth:`link_kinds` read them for this refresh, before the learned MACs
        (a veth made in between is mirrored at the next refresh); None: read now, after them."""
        with Rtnl() as rt:
            learned = rt.learned_macs()
            veths = of_kind(links, "veth") if links is not None else rt.links_of_kind("veth")
        pods = {key: port for key, port in learned.items() if port in veths}
        self.set_ports(pods)
        return len(pods)

    # ------------------------------------------------------------------ observation

    def counters(self) -> dict:
        """Per-peer packets and bytes, drops by reason, and what the kernel took of the config."""
        peers = {}
        pfd = self.maps[layout.PEERS]
        size = ((layout.PEER_STATS.size + 7) & ~7) * self.ncpus
        for addr in sorted(a for a in self.members if ":" not in a):  # counted: the IPv4 underlay's
            raw = lb.map_lookup(pfd, layout.peer_key(addr), size)
            if raw is not None:
                _flags, tx_p, tx_b, rx_p, rx_b = layout.sum_percpu(raw, layout.PEER_STATS)
                peers[addr] = {"tx_packets": tx_p, "tx_bytes": tx_b, "rx_packets": rx_p, "rx_bytes": rx_b}
        drops = {}
        dfd = self.maps[layout.DROPS]
        dsize = ((layout.DROP_STATS.size + 7) & ~7) * self.ncpus
        for i, reason in enumerate(layout.DROP_REASONS):
            raw = lb.map_lookup(dfd, layout.DROP_KEY.pack(i), dsize)
            packets, nbytes = layout.sum_percpu(raw, layout.DROP_STATS) if raw else (0, 0)
            drops[reason] = {"packets": packets, "bytes": nbytes}
        raw = lb.map_lookup(self.maps[layout.CONFIG], layout.CONFIG_KEY.pack(0), layout.CONFIG_VALUE.size)
        live = layout.Config.unpack(raw) if raw else None
        return {"peers": peers, "drops": drops, "kernel": _kernel_flags(live)}

    def status(self) -> dict:
        return {
            "pins": str(self.dir),
            "adopted_maps": list(self.adopted),
            "programs": {DIRECTIONS[s]: {"id": i} for s, i in self.prog_ids.items()},
            "hook": self.hook,  # where the programs are attached: tcx or clsact ([network] bpf_attach)
            "routes": sum(1 for d in self.routes if d.version == 4),
            "routes_v6": sum(1 for d in self.routes if d.version == 6),  # IPv6 pod subnets (udp)
            "members": len(self.members),
            "members_refused": self.members_refused,  # left out: the member maps were full
            "bridge_ports": len(self.ports),
            "bridge_ports_refused": self.ports_refused,  # learned MACs left out: the map was full
            "guarded_bridges": len(self.guarded),
            "unguarded_bridges": {str(i): why for i, why in sorted(self.unguarded.items())},
            # Programs on our tcx hooks we could not tell ours or anyone's (tc.py): they stay.
            "unidentified_programs": sorted(self.unidentified),
        }


def resolve_hook(setting: str) -> str:
    """:func:`tc.resolve`, its refusal as :class:`BpfUnavailable`."""
    try:
        return tc.resolve(setting)
    except tc.TcError as err:
        raise BpfUnavailable(str(err)) from None
    except lb.BpfError as err:
        raise BpfUnavailable(explain(err)) from None


def open_checked(path: Path, check: Callable[[lb.BpfObject], None]) -> lb.BpfObject:
    """The object file at ``path`` as libbpf reads it (nothing loaded yet), held against its
    Python side by ``check``; :class:`BpfUnavailable` says why not."""
    if not path.exists():
        raise BpfUnavailable(f"no BPF object at {path}: it is built by "
                             "`pip install` and `scripts/dev setup` where clang is installed")
    try:
        obj = lb.BpfObject(path)
    except lb.BpfError as err:
        raise BpfUnavailable(str(err)) from None
    try:
        check(obj)
    except ValueError as err:
        obj.close()
        raise BpfUnavailable(f"{path}: {err}") from None
    return obj


def adopt_pins(
    obj: lb.BpfObject, directory: str | os.PathLike, replacing: Callable[[str, int, dict], None] | None = None,
    stale: Collection[str] = (),
) -> list[str]:
    """Point the object's pinned-by-name maps at ``directory``.  Those pinned there already
    with the shape the object gives them (type, key and value sizes, entries, flags) are what
    libbpf will reuse at load: their names are returned.  A pin of another shape (an older
    agent's layout) is removed, so that libbpf makes that map afresh instead of refusing it;
    so is one named in ``stale`` (of the same shape, but its entries laid out or meant
    otherwise, as the caller knows: the pod fast path's ``agentd_podconns``).
    ``replacing`` is called first with its name, its map (an fd, open for the call) and that
    map's :func:`libbpf.map_info`: what the old map notes that the new one must go on noting
    (the pod fast path's ``agentd_podcfg``: conntrack's be_liberal as the operator had it)."""
    obj.pin_maps_in(directory)
    adopted = []
    for name, mdef in obj.maps.items():
        path = Path(directory) / name
        if not mdef.pinned or not path.exists():
            continue
        what = "holds a map of another shape or layout (an older agent's) and cannot be removed"
        try:
            fd = lb.obj_get(str(path))
            try:
                info = lb.map_info(fd)
                if (info["type"], info["key_size"], info["value_size"], info["max_entries"],
                        info["flags"]) == mdef.shape() and name not in stale:  # fmt: skip
                    adopted.append(name)
                    continue
                if replacing is not None:
                    replacing(name, fd, info)
            finally:
                os.close(fd)
        except lb.BpfError as err:  # not a map (or not one we may open): replaced as well
            what = f"cannot be opened as a map ({os.strerror(err.errno)}) nor removed"
        try:
            path.unlink()
        except OSError as err:  # a read-only bpffs, say
            raise BpfUnavailable(f"the pin {path} {what}: {err.strerror}") from None
    return adopted


def ensure_dir(bpf_dir: Path, directory: Path) -> None:
    """Make ``directory`` (a namespace's pin directory under ``bpf_dir``), which must be on a
    BPF file system; :class:`BpfUnavailable` says why not."""
    try:
        probe = bpf_dir
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not lb.is_bpffs(str(probe)):
            reason = (f"no BPF file system at {bpf_dir} ([agent] bpf_dir): pins need one "
                      "(systemd mounts /sys/fs/bpf at boot; else `mount -t bpf bpf /sys/fs/bpf`)")
        else:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            return
    except PermissionError as err:
        reason = _denied(bpf_dir, directory, err)
    except OSError as err:
        reason = f"cannot make {directory}: {err.strerror}"
    _PIN_DIR_REASONS.add(reason)
    raise BpfUnavailable(reason)


def _denied(bpf_dir: Path, directory: Path, err: OSError) -> str:
    """Why an agent that is not root (or lacks CAP_DAC_OVERRIDE) cannot reach or make its pin
    directory: the deepest directory on the way that it can see, whose owner and mode stop it
    (systemd mounts /sys/fs/bpf root's, mode 0700)."""
    blocker, st = None, None
    for p in reversed((directory, *directory.parents)):  # "/" first
        try:
            st, blocker = p.stat(), p
        except OSError:
            break
    where = "" if blocker is None else f": {blocker} is uid {st.st_uid}'s, mode {st.st_mode & 0o7777:04o}"
    return (f"cannot make {directory} ([agent] bpf_dir {bpf_dir}): {err.strerror} for uid {os.geteuid()}{where}; "
            f"an agent that is not root needs {bpf_dir} made its own and reachable before it starts "
            "(docs/operations.md, the drop-in for a dedicated user)")


def pin(directory: Path, fd: int, name: str) -> None:
    """Pin ``fd`` as ``directory/name``, in place of what was pinned there (no moment without)."""
    path = directory / name
    new = directory / f"{name}_new"  # bpffs refuses names with a dot
    try:
        with contextlib.suppress(FileNotFoundError):
            new.unlink()
        lb.obj_pin(fd, str(new))
        os.replace(new, path)
    except lb.BpfError:
        raise
    except OSError as err:
        raise BpfUnavailable(f"cannot pin {name} as {path}: {err.strerror}") from None


# MACs of one bridge port in the ports map at most: a pod's own MAC, and those of what it
# bridges or runs inside (nested containers, VMs), within it; far below the map's 4,096.
PORT_MACS_MAX = 64


def per_port_share(ports: Mapping[tuple[int, bytes], int], held: Mapping[tuple[int, bytes], int],
                   most: int = PORT_MACS_MAX) -> tuple[dict[tuple[int, bytes], int], int]:
    """``ports`` with at most ``most`` MACs behind each (bridge, port) -- those ``held`` (in the
    map now) first, then the lowest MACs, so that a flood's share stays put from one sync to
    the next --, and how many were left out."""
    by_port: dict[tuple[int, int], list[tuple[int, bytes]]] = {}
    for key, port in ports.items():
        by_port.setdefault((key[0], port), []).append(key)
    out: dict[tuple[int, bytes], int] = {}
    left = 0
    for (_, port), keys in by_port.items():
        if len(keys) > most:
            keys = sorted(keys, key=lambda k: (held.get(k) != port, k[1]))
            left += len(keys) - most
            keys = keys[:most]
        for key in keys:
            out[key] = port
    return out, left


def _kernel_flags(live: layout.Config | None) -> dict:
    if live is None:
        return {}
    return {
        # Cleared by the program on the first decapsulation this kernel refused them for.
        "decap_l3_flag": bool(live.flags & layout.CFG_DECAP_L3_FLAG),
        "decap_l4_flags": bool(live.flags & layout.CFG_DECAP_L4_FLAGS),
    }


def _neighbour(rt: Rtnl, mtype: int, ifindex: int, peer: str, mac: bytes | None = None) -> None:
    """Create (replace) or delete the permanent neighbour entry of :func:`gateway6` ``(peer)``."""
    entry = nl.NeighMessage(nl.AF_INET6, ifindex, nl.NUD_PERMANENT, 0, 0, IPv6Address(gateway6(peer)).packed, mac)
    if mtype == nl.RTM_NEWNEIGH:
        flags = nl.NLM_F_REQUEST | nl.NLM_F_ACK | nl.NLM_F_CREATE | nl.NLM_F_REPLACE
        rt.request(nl.encode_newneigh(rt.next_seq(), flags, entry), f"neighbour entry {gateway6(peer)}")
    else:
        try:
            rt.request(nl.encode_delneigh(rt.next_seq(), nl.NLM_F_REQUEST | nl.NLM_F_ACK, entry),
                       f"removing neighbour entry {gateway6(peer)}")
        except nl.NetlinkError as err:
            if err.errno != errno.ENOENT:
                raise


def gateway_neighbours(ifindex: int) -> list[str]:
    """The peers whose :func:`gateway6` has a permanent neighbour entry on device ``ifindex``:
    ours (nobody else has a use for an IPv4-mapped neighbour)."""
    out = []
    with Rtnl() as rt:
        for mtype, buf, start, end in rt.request(nl.encode_getneigh_dump(rt.next_seq(), nl.AF_INET6),
                                                 "listing the IPv6 neighbours"):
            if mtype != nl.RTM_NEWNEIGH:
                continue
            entry = nl.decode_neigh(buf, start, end)
            if entry.ifindex != ifindex or not entry.state & nl.NUD_PERMANENT or entry.dst is None:
                continue
            mapped = IPv6Address(entry.dst).ipv4_mapped
            if mapped is not None:
                out.append(str(mapped))
    return out


def remove_pinned(bpf_dir: str | os.PathLike, ifindex: int | None) -> list[str]:
    """Detach our programs from ``ifindex`` and the bridges, remove the gateways' neighbour
    entries on ``ifindex`` and this namespace's pins of the data path (and their directory, and
    ``bpf_dir`` itself once empty).  Works without the agent that made them; idempotent.
    Returns what was removed."""
    removed = []
    d = pin_dir(bpf_dir)
    pins = tc.Pins.read(d)
    with Rtnl() as rt:
        devices = rt.bridges()  # guard_bridges() put the ingress program on them
    if ifindex is not None:
        devices.add(ifindex)
    n = sum(tc.detach(i, tc.OURS, pins) for i in sorted(devices)) + tc.remove_links(pins, tc.OURS)
    if n:
        removed.append(f"{n} tc filters")
    if ifindex is not None:
        peers = gateway_neighbours(ifindex)
        with Rtnl() as rt:
            for peer in peers:
                _neighbour(rt, nl.RTM_DELNEIGH, ifindex, peer)
        if peers:
            removed.append(f"{len(peers)} IPv6 gateway neighbour entries")
    if d.is_dir():
        for name in (*layout.MAPS, *tc.OURS):  # ours only: the pod fast path pins here too (podpath.py)
            for p in (d / name, d / f"{name}_new"):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(str(p))
        with contextlib.suppress(OSError):
            d.rmdir()
    with contextlib.suppress(OSError):
        Path(bpf_dir).rmdir()  # only when no other namespace's agent pins there
    return removed
