"""The lab's underlay: the wires between its hosts, all inside lab namespaces.

``ad-NAME-ul`` holds one bridge per L2 segment (``br0`` .. ``brS-1``); with more than one
segment ``ad-NAME-rt`` routes between them (172.30.s.1 on each).  With IPv6 on the underlay
(``ip_family`` "dual" or "ipv6") segment s is also ``fd00:172:30:s::/64`` (the router
``::1``): a dual-stack lab gives every host both addresses, an IPv6-only lab only the IPv6
one (etcd then listens on IPv6 too).  Duplicate address detection is off in the lab's
namespaces (``accept_dad = 0``): an IPv6 address is usable the moment it is added.  Each etcd member's ``eth0``
is a veth on ``br0``, each node's ``eth0`` a veth on its segment's bridge.  Big labs get
permanent neighbour entries instead of ARP (see ``LabSpec.static_neighbors``).  A test
partitions an etcd member by taking its port down (:meth:`Underlay.cut`).

This module knows hosts only by what it wires: a namespace, an index, a segment and an
address (:class:`Host`); the lab (agentd.lab.lab) owns the hosts themselves.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Protocol

from agentd.lab.etcd import EtcdCluster, EtcdServer
from agentd.lab.netns import Netns, run, veth

UNDERLAY_PREFIX = "172.30"
UNDERLAY_PREFIX_V6 = "fd00:172:30"  # segment s: fd00:172:30:s::/64, host h: ...:s::h (h as in 172.30.s.h)


class Host(Protocol):
    """A lab node as the underlay sees it."""

    ns: Netns
    index: int
    segment: int
    address: str | None  # IPv4 (None in an IPv6-only lab)
    address_v6: str | None  # IPv6 (None in an IPv4 lab)


def v6_address(segment: int, host: int) -> str:
    """The IPv6 twin of 172.30.<segment>.<host>, as RFC 5952 writes it (fd00:172:30::11)."""
    return str(ipaddress.IPv6Address(f"{UNDERLAY_PREFIX_V6}:{segment}::{host}"))


def quiet_dad(ns: Netns) -> None:
    """No duplicate address detection in ``ns``: its IPv6 addresses (those of interfaces made
    from now on, link-local ones too) are usable at once, not "tentative" for a second or two."""
    run(["sysctl", "-q", "-w", "net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0"], ns=ns.name)


@dataclass(frozen=True)
class _Member:
    """One interface on an underlay segment (a node's, an etcd member's, the router's)."""

    ns: Netns
    ifname: str
    segment: int
    address: str | None
    mac: str
    address_v6: str | None = None


class Underlay:
    def __init__(self, name: str, segments: int, etcd: EtcdCluster, *, ip_family: str = "ipv4",
                 host_forwarding: bool = True) -> None:
        self.ns = Netns(f"ad-{name}-ul")
        self.router = Netns(f"ad-{name}-rt")
        self.segments = segments
        self.etcd = etcd
        self.v4 = ip_family != "ipv6"  # IPv4 on the underlay
        self.v6 = ip_family != "ipv4"  # IPv6 on the underlay
        # The hosts' IP forwarding as the lab makes them; off: as a fresh host has it, for the
        # agent to turn on (a Docker daemon that finds it off drops what it forwards).
        self.host_forwarding = host_forwarding

    def _create(self, name: str) -> Netns:
        ns = Netns.create(name)
        if self.v6:
            quiet_dad(ns)
        return ns

    def build(self, hosts: list[Host], *, static_neighbors: bool) -> None:
        """The bridges, the router, every etcd member's and every host's link."""
        ul = self._create(self.ns.name)
        for s in range(self.segments):
            ul.ip("link", "add", f"br{s}", "type", "bridge")
            ul.ip("link", "set", f"br{s}", "up")
        if self.segments > 1:
            rt = self._create(self.router.name)
            rt.sysctl("net.ipv4.ip_forward", 1)
            if self.v6:
                rt.sysctl("net.ipv6.conf.all.forwarding", 1)
            for s in range(self.segments):
                veth(rt, f"eth{s}", ul, f"r{s}")
                ul.ip("link", "set", f"r{s}", "master", f"br{s}")
                if self.v4:
                    rt.ip("addr", "add", f"{UNDERLAY_PREFIX}.{s}.1/24", "dev", f"eth{s}")
                if self.v6:
                    rt.ip("-6", "addr", "add", f"{v6_address(s, 1)}/64", "dev", f"eth{s}", "nodad")
        for i, member in enumerate(self.etcd.members, start=1):
            assert member.netns is not None
            et = self._create(member.netns.name)
            veth(et, "eth0", ul, f"etcd{i}")
            ul.ip("link", "set", f"etcd{i}", "master", "br0")
            plen = 64 if ":" in member.host else 24
            et.ip("addr", "add", f"{member.host}/{plen}", "dev", "eth0", *(["nodad"] if plen == 64 else []))
            # A dual-stack underlay gives the member its IPv6 twin as well (etcd itself listens
            # on the IPv4 address the agents are configured with): every host on it has both.
            twin = v6_address(0, int(member.host.rsplit(".", 1)[1])) if self.v4 and self.v6 and plen == 24 else None
            if twin is not None:
                et.ip("-6", "addr", "add", f"{twin}/64", "dev", "eth0", "nodad")
            if self.segments > 1:
                if plen == 24:
                    et.ip("route", "add", "default", "via", f"{UNDERLAY_PREFIX}.0.1")
                if plen == 64 or twin is not None:
                    et.ip("-6", "route", "add", "default", "via", v6_address(0, 1))
        for h in hosts:
            self._link(h)
        if static_neighbors:
            members = self._members(hosts)
            for ns in {m.ns.name: m.ns for m in members}.values():
                self._program_neighbors(ns, members)

    def add_client(self, address: str | None, address_v6: str | None = None) -> None:
        """Addresses of the underlay namespace itself on segment 0 (a client outside the pod
        network: it reaches the nodes' addresses, never a pod's), routed to the other segments."""
        if address is not None:
            self.ns.ip("addr", "add", f"{address}/24", "dev", "br0")
            if self.segments > 1:
                self.ns.ip("route", "add", f"{UNDERLAY_PREFIX}.0.0/16", "via", f"{UNDERLAY_PREFIX}.0.1")
        if address_v6 is not None:
            self.ns.ip("-6", "addr", "add", f"{address_v6}/64", "dev", "br0", "nodad")
            if self.segments > 1:
                self.ns.ip("-6", "route", "add", f"{UNDERLAY_PREFIX_V6}::/48", "via", v6_address(0, 1))

    def add(self, host: Host, hosts: list[Host], *, static_neighbors: bool) -> None:
        """Wire one more host (``hosts`` includes it) into a running underlay."""
        self._link(host)
        if static_neighbors:
            members = self._members(hosts)
            self._program_neighbors(host.ns, members)
            new = [m for m in members if m.ns.name == host.ns.name]
            for ns in {m.ns.name: m.ns for m in members if m.ns.name != host.ns.name}.values():
                self._program_neighbors(ns, members, only=new)

    def cut(self, member: EtcdServer) -> None:
        """Take ``member``'s link down: a partition (nothing is reset, packets to and from it
        vanish), from the agents and from the other members alike."""
        self.ns.ip("link", "set", self._etcd_port(member), "down")

    def mend(self, member: EtcdServer) -> None:
        self.ns.ip("link", "set", self._etcd_port(member), "up")

    def _etcd_port(self, member: EtcdServer) -> str:
        return f"etcd{self.etcd.members.index(member) + 1}"

    def _link(self, h: Host) -> None:
        ns = self._create(h.ns.name)
        forward = int(self.host_forwarding)
        for key in ("net.ipv4.ip_forward", "net.ipv4.conf.all.rp_filter", "net.ipv4.conf.default.rp_filter"):
            ns.sysctl(key, forward if key.endswith("forward") else 0)
        if self.v6:
            ns.sysctl("net.ipv6.conf.all.forwarding", forward)
        veth(ns, "eth0", self.ns, f"n{h.index}")
        self.ns.ip("link", "set", f"n{h.index}", "master", f"br{h.segment}")
        if h.address is not None:
            ns.ip("addr", "add", f"{h.address}/24", "dev", "eth0")
        if h.address_v6 is not None:
            ns.ip("-6", "addr", "add", f"{h.address_v6}/64", "dev", "eth0", "nodad")
        if self.segments > 1:
            if h.address is not None:
                ns.ip("route", "add", "default", "via", f"{UNDERLAY_PREFIX}.{h.segment}.1")
            if h.address_v6 is not None:
                ns.ip("-6", "route", "add", "default", "via", v6_address(h.segment, 1))

    def _members(self, hosts: list[Host]) -> list[_Member]:
        """Every interface on the underlay segments, with the MAC address the lab gives it when
        it uses permanent neighbour entries (02:ad:00:00 + a 16-bit id unique in the lab)."""
        out = [_Member(m.netns, "eth0", 0, None if ":" in m.host else m.host, _mac(0x100 + i),  # type: ignore[arg-type]
                       m.host if ":" in m.host else None)
               for i, m in enumerate(self.etcd.members, start=1)]  # fmt: skip
        if self.segments > 1:
            out += [_Member(self.router, f"eth{s}", s, f"{UNDERLAY_PREFIX}.{s}.1" if self.v4 else None,
                            _mac(0x200 + s), v6_address(s, 1) if self.v6 else None)
                    for s in range(self.segments)]  # fmt: skip
        out += [_Member(h.ns, "eth0", h.segment, h.address, _mac(h.index), h.address_v6) for h in hosts]
        return out

    def _program_neighbors(self, ns: Netns, members: list[_Member], only: list[_Member] | None = None) -> None:
        """One ``ip -batch`` in ``ns``: its own underlay MACs, then a permanent entry for every other
        member on the same segment (``only``: just for those)."""
        own = [m for m in members if m.ns.name == ns.name]
        lines = [] if only else [f"link set dev {m.ifname} address {m.mac}" for m in own]
        for mine in own:
            for other in only or members:
                if other.ns.name != ns.name and other.segment == mine.segment:
                    for address in (other.address, other.address_v6):
                        if address is not None:
                            lines.append(f"neigh replace {address} lladdr {other.mac} dev {mine.ifname} nud permanent")
        if lines:
            run(["ip", "-n", ns.name, "-batch", "-"], input=("\n".join(lines) + "\n").encode())


def _mac(ident: int) -> str:
    """A locally administered unicast MAC address for underlay interface ``ident``."""
    return f"02:ad:00:00:{ident >> 8:02x}:{ident & 0xFF:02x}"
