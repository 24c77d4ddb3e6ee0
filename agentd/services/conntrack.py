"""UDP conntrack entries of removed endpoints, deleted through ctnetlink.

UDP has no connection end: a client that keeps sending to a service keeps its conntrack
entry, and so its translation to the endpoint chosen first, for as long as it sends - also
after that endpoint is gone (kube-proxy's stale-UDP bug, kubernetes#59368 and friends).  So
when an endpoint stops taking new connections of a UDP service port, every entry that was
translated to it for that service (original destination the cluster IP and port, or the node
port on one of the node's own addresses; reply source the endpoint) is deleted, and the next
datagram is a new connection that the rules send to a live endpoint.  A node port is a port
on the node's addresses only (the rules match ``fib daddr type local``, loopback aside): a
pod's flow to another host's port of that number is not the Service's and stays.  TCP entries stay: a terminating endpoint keeps its
established connections.

A flow may also predate what this node translates: an endpoint removed while the agent was
down, or datagrams sent to a cluster IP before this node translated it (the entry untranslated,
its reply source the VIP itself).  So on the agent's first sync after it starts, and for a
service port that goes from no usable endpoint to some, every UDP entry to its VIP and port or
its node port whose reply source is not one of the endpoints that path may use (with its
traffic policy Local, this node's) is deleted too (:class:`Unusable`; kube-proxy clears a
Service's entries when it goes from 0 endpoints to some, and checks every UDP entry against
the current endpoints since 1.30).

The messages (include/uapi/linux/netfilter/nfnetlink.h, nfnetlink_conntrack.h), encoded and
decoded by the ctnetlink codec of the agent's one netlink stack (agentd.kernel.netlink_ct)::

    nlmsghdr.type = NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_GET (dump) / _DELETE
    struct nfgenmsg { u8 nfgen_family; u8 version; __be16 res_id; }          4 bytes
    CTA_TUPLE_ORIG / CTA_TUPLE_REPLY (nested) {
        CTA_TUPLE_IP (nested) { CTA_IP_V4_SRC/DST in_addr | CTA_IP_V6_SRC/DST in6_addr },
        CTA_TUPLE_PROTO (nested) { CTA_PROTO_NUM u8,
                                   CTA_PROTO_SRC_PORT __be16, CTA_PROTO_DST_PORT __be16 } }

A DELETE names the entry by its original tuple (ctnetlink_del_conntrack looks it up in the
hash by either direction's tuple); its nfgen_family is the entry's (AF_INET6 for IPv6
endpoints, whose flows the ``ip6`` table translated).  Dumps are not filtered in the kernel
(CTA_FILTER needs a 5.x kernel with a different attribute set): the dump is of one family's
entries (of each family a stale endpoint has), the UDP ones are picked here.

Blocking (netlink): the agent calls :func:`flush_udp` in a thread, in its own namespace.
"""

from __future__ import annotations

import socket
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from ipaddress import ip_address, ip_network

from agentd.kernel import netlink as nl
from agentd.kernel.netlink_ct import (
    CTA_TUPLE_ORIG,
    IPCTNL_MSG_CT_DELETE,
    IPCTNL_MSG_CT_GET,
    IPCTNL_MSG_CT_NEW,
    NFNL_SUBSYS_CTNETLINK,
    CtEntry,
    CtTuple,
    decode_event,
    delete_entries,
    encode_tuple,
)
from agentd.kernel.netlink_ct import message as _message
from agentd.kernel.netlink_socket import NetlinkSocket
from agentd.kernel.rtnl import Rtnl


def encode_dump(seq: int, family: int = nl.AF_INET) -> bytes:
    """IPCTNL_MSG_CT_GET with NLM_F_DUMP: every entry of ``family`` (``conntrack -L -f ipv4|ipv6``)."""
    return _message(IPCTNL_MSG_CT_GET, seq, nl.NLM_F_REQUEST | nl.NLM_F_DUMP, b"", family)


def encode_delete(seq: int, orig: CtTuple) -> bytes:
    """IPCTNL_MSG_CT_DELETE of the entry whose original tuple is ``orig`` (ENOENT: none)."""
    return _message(IPCTNL_MSG_CT_DELETE, seq, nl.NLM_F_REQUEST, encode_tuple(CTA_TUPLE_ORIG, orig), _family(orig.src))


def _family(address: str) -> int:
    return socket.AF_INET6 if ":" in address else nl.AF_INET


def decode_entry(buf: bytes, start: int, end: int) -> CtEntry | None:
    """An IPCTNL_MSG_CT_NEW body (nfgenmsg + attributes) as its two tuples; None if it is
    neither IPv4 nor IPv6, or lacks a tuple."""
    event = decode_event(NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW, buf, start, end)
    if event is None or event.family not in (nl.AF_INET, socket.AF_INET6):
        return None
    return CtEntry(event.orig, event.reply)


# ------------------------------------------------------------------ what to delete


@dataclass(frozen=True, order=True)
class Stale:
    ip: str  # the endpoint
    port: int
    vip: str | None  # the service's cluster IP and port, its node port
    service_port: int
    node_port: int | None = None
    # The node port's flows from these only: None, from anywhere; else from these networks
    # (this node's pod subnets) and from the node itself, those a Local node port's
    # short-circuit sends to every endpoint (an endpoint elsewhere leaving it: only theirs go).
    sources: tuple[str, ...] | None = None

    @property
    def af(self) -> int:
        return _family(self.ip)

    def matches(self, orig_daddr: str, orig_dport: int, reply_saddr: str, reply_sport: int,
                local: Collection[str] = (), orig_saddr: str = "") -> bool:  # fmt: skip
        """Whether an entry was translated to this endpoint for its service: to its VIP and
        port, or to its node port on one of ``local`` (the node's own addresses) from one of
        its ``sources``."""
        if (reply_saddr, reply_sport) != (self.ip, self.port):
            return False
        return (orig_daddr, orig_dport) == (self.vip, self.service_port) or (
            self.node_port is not None and orig_dport == self.node_port and orig_daddr in local
            and (self.sources is None or orig_saddr in local or any(_within(orig_saddr, n) for n in self.sources))
        )


@dataclass(frozen=True)
class Unusable:
    """A UDP service port whose flows go to its ``usable`` endpoints only: an entry to its VIP
    and port, or to its node port (of the same IP family), whose reply source is anything
    else is deleted (an endpoint gone while the agent was down, a flow not translated yet).
    The agent gives each path its own (``vip`` or ``node_port`` None), with the endpoints
    that path may use: a traffic policy Local keeps one of them on this node's endpoints."""

    vip: str | None
    service_port: int
    node_port: int | None
    family: int  # 4 or 6
    usable: frozenset[tuple[str, int]] = frozenset()  # (address, port) of each usable endpoint
    # A node port's flows from these sources (this node's pod subnet) go to ``everywhere``
    # instead: a Local node port takes every usable endpoint for this node's own pods
    # (kube-proxy's short-circuit, agentd.services.compiler's ``nodeports`` chain).
    short_circuit: tuple[str, ...] = ()
    everywhere: frozenset[tuple[str, int]] = frozenset()

    @property
    def af(self) -> int:
        return socket.AF_INET6 if self.family == 6 else nl.AF_INET

    def allowed(self, orig_src: str) -> frozenset[tuple[str, int]]:
        """The endpoints a flow from ``orig_src`` may go to."""
        if self.short_circuit and any(_within(orig_src, net) for net in self.short_circuit):
            return self.everywhere
        return self.usable


def _within(address: str, network: str) -> bool:
    try:
        return ip_address(address) in ip_network(network, strict=False)
    except ValueError:
        return False


Flush = Stale | Unusable


def entries_to_delete(entries: Iterable[CtEntry], stale: Iterable[Flush], local: Collection[str] = ()) -> list[CtEntry]:
    """The UDP entries translated to a ``stale`` endpoint (reply source the endpoint, original
    destination its service's VIP and port or its node port), and those of an
    :class:`Unusable` port not translated to one of its usable endpoints.  A node port is
    one on ``local``, the node's own addresses (none given: no entry is a node port's)."""
    wanted = [s for s in stale if isinstance(s, Stale)]
    by_vip: dict[tuple[str, int], set[tuple[str, int]]] = {}
    by_node_port: dict[tuple[bool, int], list[Unusable]] = {}
    for u in stale:
        if isinstance(u, Unusable):
            if u.vip is not None:
                by_vip.setdefault((u.vip, u.service_port), set()).update(u.usable)
            if u.node_port is not None:
                by_node_port.setdefault((u.family == 6, u.node_port), []).append(u)

    def unusable(e: CtEntry) -> bool:
        source = (e.reply.src, e.reply.sport)
        usable = by_vip.get((e.orig.dst, e.orig.dport))
        if usable is not None and source not in usable:
            return True
        if e.orig.dst not in local:
            return False
        ports = by_node_port.get((":" in e.orig.dst, e.orig.dport))
        return ports is not None and not any(source in u.allowed(e.orig.src) for u in ports)

    return [e for e in entries if e.orig.proto == socket.IPPROTO_UDP and (
        (by_vip or by_node_port) and unusable(e)
        or any(s.matches(e.orig.dst, e.orig.dport, e.reply.src, e.reply.sport, local, e.orig.src) for s in wanted))]  # fmt: skip


def node_addresses() -> frozenset[str]:
    """This namespace's own addresses, IPv4 and IPv6, loopback aside: where its node ports are."""
    out = set()
    with Rtnl() as rt:
        for family in (nl.AF_INET, socket.AF_INET6):
            for a in rt.addresses(0, family):
                raw = a.local or a.address
                if raw is not None and not ip_address(raw).is_loopback:
                    out.add(str(ip_address(raw)))
    return frozenset(out)


def flush_udp(stale: Iterable[Flush]) -> int:
    """Delete the UDP entries of ``stale`` endpoints (and of :class:`Unusable` ports not going
    to a usable endpoint); returns how many were deleted."""
    wanted = list(stale)
    if not wanted:
        return 0
    sock = NetlinkSocket(rcvbuf=4 << 20, sndbuf=1 << 20, protocol=nl.NETLINK_NETFILTER)
    try:
        seq = 0
        entries: list[CtEntry] = []
        for family in sorted({s.af for s in wanted}):  # the families of the stale endpoints
            seq += 1
            answers = sock.request(encode_dump(seq, family), what="listing conntrack entries", dump=True)
            entries += [e for t, buf, s, end in answers
                        if t == NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW and (e := decode_entry(buf, s, end))]
        local = node_addresses() if any(s.node_port is not None for s in wanted) else frozenset()
        gone = entries_to_delete(entries, wanted, local)
        deleted = delete_entries(sock, ((encode_delete(seq, entry.orig), str(entry.orig))
                                        for seq, entry in enumerate(gone, start=seq + 1)))
    finally:
        sock.close()
    return deleted
