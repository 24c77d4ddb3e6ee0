"""A blocking rtnetlink session for the few requests that are not bulk work: making and
configuring devices (VXLAN, addresses), ``ip route get``, listing bridges and their learned
MACs, and the tc requests of the BPF data path (agentd.kernel.netlink_tc).

The same codec and socket as the route programmer (agentd.kernel.netlink), one request at a
time with its answers; the kernel's refusal raises ``nl.NetlinkError`` naming what was asked.
Blocking calls: run them off the event loop (``asyncio.to_thread``).  Open it inside the
target network namespace; it stays bound there.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping

from agentd.kernel import netlink as nl
from agentd.kernel import netlink_links as links
from agentd.kernel.netlink_socket import NetlinkSocket


class Rtnl:
    """One NETLINK_ROUTE socket; ``with Rtnl() as rt: ...``."""

    def __init__(self) -> None:
        self.sock = NetlinkSocket(rcvbuf=1 << 20, sndbuf=1 << 20)
        self._seq = 0

    def __enter__(self) -> Rtnl:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def request(self, message: bytes, what: str) -> list[tuple[int, bytes, int, int]]:
        """Send ``message`` (built with :meth:`next_seq`); its answers ``(type, buf, start, end)``."""
        return self.sock.request(message, what=what)

    # ------------------------------------------------------------------ links

    def link(self, name: str) -> nl.LinkMessage | None:
        """Device ``name``, or None if there is none."""
        try:
            answers = self.request(links.encode_getlink(self.next_seq(), name=name), f"looking up device {name}")
        except nl.NetlinkError as err:
            if err.errno == errno.ENODEV:
                return None
            raise
        for mtype, buf, start, end in answers:
            if mtype == nl.RTM_NEWLINK:
                return nl.decode_link(buf, start, end)
        return None

    def peer_mac(self, name: str) -> str:
        """The MAC of the other end of veth ``name`` (a pod's own interface, in the pod's
        namespace), read through the id this namespace has for that one (IFLA_LINK_NETNSID,
        IFLA_TARGET_NETNSID): no path to the pod's namespace is needed.  LookupError, one
        line, where there is no such device or it has no other end."""
        link = self.link(name)
        if link is None:
            raise LookupError(f"no device {name}")
        if link.kind != "veth" or not link.link:
            raise LookupError(f"{name} is no veth with another end ({link.kind or 'no kind'})")
        try:
            answers = self.request(links.encode_getlink(self.next_seq(), index=link.link, netnsid=link.link_netnsid),
                                   f"looking up the other end of {name}")
        except nl.NetlinkError as err:
            raise LookupError(f"the other end of {name}: {err}") from None
        for mtype, buf, start, end in answers:
            if mtype == nl.RTM_NEWLINK:
                peer = nl.decode_link(buf, start, end)
                if peer.address is None or len(peer.address) != 6:
                    break
                return ":".join(f"{b:02x}" for b in peer.address)
        raise LookupError(f"the other end of {name} has no Ethernet address")

    def create_vxlan(self, name: str, vxlan: links.Vxlan) -> None:
        self.request(links.encode_newlink_vxlan(self.next_seq(), name, vxlan), f"creating vxlan device {name}")

    def create_link(self, name: str, kind: str) -> None:
        """A device of a kind without settings (``ip link add NAME type dummy``)."""
        self.request(links.encode_newlink(self.next_seq(), name, kind), f"creating {kind} device {name}")

    def set_link(self, index: int, *, mtu: int | None = None, up: bool | None = None) -> None:
        self.request(links.encode_setlink(self.next_seq(), index, mtu=mtu, up=up), f"configuring device {index}")

    def delete_link(self, index: int) -> None:
        self.request(links.encode_dellink(self.next_seq(), index), f"deleting device {index}")

    def bridges(self) -> set[int]:
        """The ifindexes of the bridge devices here (``ip link show type bridge``)."""
        return self.links_of_kind("bridge")

    def links_of_kind(self, kind: str) -> set[int]:
        """The ifindexes of the devices of ``kind`` here (``ip link show type KIND``)."""
        return of_kind(self.link_kinds(), kind)

    def link_kinds(self) -> dict[int, str | None]:
        """Every device here, ifindex -> its kind (None: a NIC, loopback), from one RTM_GETLINK
        dump (where one caller needs devices of several kinds: :func:`of_kind`)."""
        answers = self.request(nl.encode_getlink_dump(self.next_seq()), "listing the devices")
        return {link.index: link.kind
                for link in (nl.decode_link(b, s, e) for t, b, s, e in answers if t == nl.RTM_NEWLINK)}

    # ------------------------------------------------------------------ addresses

    def addresses(self, index: int, family: int = nl.AF_INET) -> list[links.AddrMessage]:
        """The addresses on device ``index`` (0: on every device)."""
        answers = self.request(links.encode_getaddr_dump(self.next_seq(), family, index),
                               f"listing the addresses of device {index}" if index else "listing the addresses")
        found = [links.decode_addr(b, s, e) for t, b, s, e in answers if t == nl.RTM_NEWADDR]
        # (older kernels do not filter)
        return [a for a in found if (a.index == index or not index) and a.family == family]

    def add_address(self, index: int, address: str, prefixlen: int, label: str | None = None) -> None:
        """``address`` (IPv4 or IPv6 text) /``prefixlen`` on device ``index``."""
        message = links.encode_addr(nl.RTM_NEWADDR, self.next_seq(), index, _packed(address), prefixlen, label)
        self.request(message, f"adding {address}/{prefixlen} to device {index}")

    def delete_address(self, index: int, address: str, prefixlen: int) -> None:
        self.request(links.encode_addr(nl.RTM_DELADDR, self.next_seq(), index, _packed(address), prefixlen),
                     f"removing {address}/{prefixlen} from device {index}")

    # ------------------------------------------------------------------ routes and neighbours

    def route_get(self, address: str) -> nl.RouteMessage | None:
        """The kernel's route to IPv4 or IPv6 ``address`` (``ip route get``)."""
        raw = _packed(address)
        answers = self.request(nl.encode_getroute(self.next_seq(), nl.AF_INET6 if len(raw) == 16 else nl.AF_INET, raw),
                               f"route to {address}")
        for mtype, buf, start, end in answers:
            if mtype == nl.RTM_NEWROUTE:
                return nl.decode_route(buf, start, end)
        return None

    def routes(self, family: int, table: int) -> list[nl.RouteMessage]:
        """Every route of ``table`` (``ip route show table T``)."""
        answers = self.request(nl.encode_getroute_dump(self.next_seq(), family, table=table), f"listing table {table}")
        found = [nl.decode_route(b, s, e) for t, b, s, e in answers if t == nl.RTM_NEWROUTE]
        return [r for r in found if r.table == table]  # older kernels dump every table

    def learned_macs(self) -> dict[tuple[int, bytes], int]:
        """(bridge ifindex, MAC) -> port ifindex, for every MAC the bridges here learned on a
        port (not the ports' own permanent addresses): ``bridge fdb show``."""
        message = nl.encode_getneigh_dump(self.next_seq(), nl.AF_BRIDGE)
        out = {}
        for mtype, buf, start, end in self.request(message, "listing the bridges' MACs"):
            if mtype != nl.RTM_NEWNEIGH:
                continue
            entry = nl.decode_neigh(buf, start, end)
            if entry.state & nl.NUD_PERMANENT or entry.lladdr is None or len(entry.lladdr) != 6 or not entry.master:
                continue
            out[(entry.master, entry.lladdr)] = entry.ifindex
        return out


def of_kind(links: Mapping[int, str | None], kind: str) -> set[int]:
    """The ifindexes of ``links`` (:meth:`Rtnl.link_kinds`) that are devices of ``kind``."""
    return {index for index, k in links.items() if k == kind}


def _packed(address: str) -> bytes:
    """IPv4 or IPv6 text as its 4 or 16 bytes."""
    return socket.inet_pton(socket.AF_INET6 if ":" in address else socket.AF_INET, address)
