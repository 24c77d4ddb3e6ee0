"""The lab's underlay: the wires between its hosts, all inside lab namespaces.

``ad-NAME-ul`` holds one bridge per L2 segment (``br0`` .. ``brS-1``); with more than one
segment ``ad-NAME-rt`` routes between them (172.30.s.1 on each).  Each etcd member's ``eth0``
is a veth on ``br0``, each node's ``eth0`` a veth on its segment's bridge.  Big labs get
permanent neighbour entries instead of ARP (see ``LabSpec.static_neighbors``).  A test
partitions an etcd member by taking its port down (:meth:`Underlay.cut`).

This module knows hosts only by what it wires: a namespace, an index, a segment and an
address (:class:`Host`); the lab (agentd.lab.lab) owns the hosts themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from agentd.lab.etcd import EtcdCluster, EtcdServer
from agentd.lab.netns import Netns, run, veth

UNDERLAY_PREFIX = "172.30"


class Host(Protocol):
    """A lab node as the underlay sees it."""

    ns: Netns
    index: int
    segment: int
    address: str


@dataclass(frozen=True)
class _Member:
    """One interface on an underlay segment (a node's, an etcd member's, the router's)."""

    ns: Netns
    ifname: str
    segment: int
    address: str
    mac: str


class Underlay:
    def __init__(self, name: str, segments: int, etcd: EtcdCluster) -> None:
        self.ns = Netns(f"ad-{name}-ul")
        self.router = Netns(f"ad-{name}-rt")
        self.segments = segments
        self.etcd = etcd

    def build(self, hosts: list[Host], *, static_neighbors: bool) -> None:
        """The bridges, the router, every etcd member's and every host's link."""
        ul = Netns.create(self.ns.name)
        for s in range(self.segments):
            ul.ip("link", "add", f"br{s}", "type", "bridge")
            ul.ip("link", "set", f"br{s}", "up")
        if self.segments > 1:
            rt = Netns.create(self.router.name)
            rt.sysctl("net.ipv4.ip_forward", 1)
            for s in range(self.segments):
                veth(rt, f"eth{s}", ul, f"r{s}")
                ul.ip("link", "set", f"r{s}", "master", f"br{s}")
                rt.ip("addr", "add", f"{UNDERLAY_PREFIX}.{s}.1/24", "dev", f"eth{s}")
        for i, member in enumerate(self.etcd.members, start=1):
            assert member.netns is not None
            et = Netns.create(member.netns.name)
            veth(et, "eth0", ul, f"etcd{i}")
            ul.ip("link", "set", f"etcd{i}", "master", "br0")
            et.ip("addr", "add", f"{member.host}/24", "dev", "eth0")
            if self.segments > 1:
                et.ip("route", "add", "default", "via", f"{UNDERLAY_PREFIX}.0.1")
        for h in hosts:
            self._link(h)
        if static_neighbors:
            members = self._members(hosts)
            for ns in {m.ns.name: m.ns for m in members}.values():
                self._program_neighbors(ns, members)

    def add_client(self, address: str) -> None:
        """An address of the underlay namespace itself on segment 0 (a client outside the pod
        network: it reaches the nodes' addresses, never a pod's), routed to the other segments."""
        self.ns.ip("addr", "add", f"{address}/24", "dev", "br0")
        if self.segments > 1:
            self.ns.ip("route", "add", f"{UNDERLAY_PREFIX}.0.0/16", "via", f"{UNDERLAY_PREFIX}.0.1")

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
        ns = Netns.create(h.ns.name)
        for key in ("net.ipv4.ip_forward", "net.ipv4.conf.all.rp_filter", "net.ipv4.conf.default.rp_filter"):
            ns.sysctl(key, 1 if key.endswith("forward") else 0)
        veth(ns, "eth0", self.ns, f"n{h.index}")
        self.ns.ip("link", "set", f"n{h.index}", "master", f"br{h.segment}")
        ns.ip("addr", "add", f"{h.address}/24", "dev", "eth0")
        if self.segments > 1:
            ns.ip("route", "add", "default", "via", f"{UNDERLAY_PREFIX}.{h.segment}.1")

    def _members(self, hosts: list[Host]) -> list[_Member]:
        """Every interface on the underlay segments, with the MAC address the lab gives it when
        it uses permanent neighbour entries (02:ad:00:00 + a 16-bit id unique in the lab)."""
        out = [_Member(m.netns, "eth0", 0, m.host, _mac(0x100 + i))  # type: ignore[arg-type]
               for i, m in enumerate(self.etcd.members, start=1)]  # fmt: skip
        if self.segments > 1:
            out += [_Member(self.router, f"eth{s}", s, f"{UNDERLAY_PREFIX}.{s}.1", _mac(0x200 + s))
                    for s in range(self.segments)]  # fmt: skip
        out += [_Member(h.ns, "eth0", h.segment, h.address, _mac(h.index)) for h in hosts]
        return out

    def _program_neighbors(self, ns: Netns, members: list[_Member], only: list[_Member] | None = None) -> None:
        """One ``ip -batch`` in ``ns``: its own underlay MACs, then a permanent entry for every other
        member on the same segment (``only``: just for those)."""
        own = [m for m in members if m.ns.name == ns.name]
        lines = [] if only else [f"link set dev {m.ifname} address {m.mac}" for m in own]
        for mine in own:
            for other in only or members:
                if other.ns.name != ns.name and other.segment == mine.segment:
                    lines.append(f"neigh replace {other.address} lladdr {other.mac} dev {mine.ifname} nud permanent")
        if lines:
            run(["ip", "-n", ns.name, "-batch", "-"], input=("\n".join(lines) + "\n").encode())


def _mac(ident: int) -> str:
    """A locally administered unicast MAC address for underlay interface ``ident``."""
    return f"02:ad:00:00:{ident >> 8:02x}:{ident & 0xFF:02x}"
