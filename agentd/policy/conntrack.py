"""Conntrack entries of this node's pods' former addresses, deleted through ctnetlink.

A connection the tables accepted is ``ct state established`` for as long as it lives: a UDP
flow whose sender keeps sending never ends, and its entry outlives the pod it went to.  When
host-local hands that address to a new pod, the sender's datagrams would reach the new pod
past its ingress policy (and its replies past its egress policy).  So when a local pod's
endpoint file goes, or its addresses change, or a newer pod's file claims one of them, the
policy agent deletes every entry whose original or reply source or destination is such an
address: every protocol, IPv4 and IPv6, in the node's namespace (Calico does the same for
removed workload addresses).  The next packet of such a flow is a new connection, judged by
the policy of whoever has the address then.

Which addresses go (:func:`owners`, :func:`released`) is pure; :func:`flush_addresses` is
blocking netlink (the agent calls it in a thread).  A DELETE carries the entry's original
tuple exactly as the dump gave it (so every protocol's tuple -- ICMP's id, type and code,
SCTP's ports -- is named right) and its CTA_ID (an entry that went and came back meanwhile
with the same tuple is not the one found; ENOENT).  Without a tuple a DELETE would flush
the whole table: one is always sent.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping

from agentd.cni.endpoints import Endpoint
from agentd.kernel import netlink as nl
from agentd.kernel.netlink_ct import (
    CTA_ID,
    CTA_TUPLE_ORIG,
    IPCTNL_MSG_CT_DELETE,
    IPCTNL_MSG_CT_GET,
    MSG_NEW,
    CtEvent,
    decode_event,
    delete_entries,
    message,
)
from agentd.kernel.netlink_socket import NetlinkSocket


def owners(endpoints: Iterable[Endpoint]) -> dict[str, str]:
    """Address -> the container of this node's pod that has it: of two endpoint files with
    one address the newer (as the policy engine and the fast path choose)."""
    out: dict[str, tuple[tuple[int, tuple[str, str], str], str]] = {}
    for ep in endpoints:
        rank = (ep.written, ep.key, ep.container_id)
        for text in ep.ips:
            try:
                ip = str(ipaddress.ip_address(text))
            except ValueError:
                continue
            if ip not in out or out[ip][0] < rank:
                out[ip] = (rank, ep.container_id)
    return {ip: cid for ip, (_, cid) in out.items()}


def released(before: Mapping[str, str], after: Mapping[str, str]) -> set[str]:
    """The addresses whose connections must go: those a pod had before and has not now (its
    file went, its addresses changed, a newer file claims them).  A stale file going while
    the pod that has its address stays releases nothing."""
    return {ip for ip, cid in before.items() if after.get(ip) != cid}


def touches(event: CtEvent, addresses: set[str]) -> bool:
    """Whether an entry has one of ``addresses`` as an end, either way (NAT included)."""
    return bool({event.orig.src, event.orig.dst, event.reply.src, event.reply.dst} & addresses)


def encode_dump(seq: int, family: int) -> bytes:
    """IPCTNL_MSG_CT_GET with NLM_F_DUMP: every entry of ``family``."""
    return message(IPCTNL_MSG_CT_GET, seq, nl.NLM_F_REQUEST | nl.NLM_F_DUMP, b"", family)


def delete_body(buf: bytes, start: int, end: int) -> bytes | None:
    """The DELETE attributes of a dumped entry (its message body ``buf[start:end]``): its
    CTA_TUPLE_ORIG as the kernel wrote it and its CTA_ID; None without an original tuple."""
    tuple_orig = ident = None
    for atype, vs, ve in nl.iter_attrs(buf, start + nl.NFGENMSG_LEN, end):
        if atype == CTA_TUPLE_ORIG:
            tuple_orig = nl.nested(CTA_TUPLE_ORIG, bytes(buf[vs:ve]))
        elif atype == CTA_ID:
            ident = nl.attr(CTA_ID, bytes(buf[vs:ve]))
    if tuple_orig is None:
        return None
    return tuple_orig + (ident or b"")


def flush_addresses(addresses: Iterable[str]) -> int:
    """Delete every conntrack entry (of this thread's network namespace) with one of
    ``addresses`` as an end; how many were deleted."""
    wanted = {str(ipaddress.ip_address(a)) for a in addresses}
    if not wanted:
        return 0
    # An entry's addresses are in its message as the packed bytes: one without any of them is
    # passed over without being decoded (a busy node's table is large; few entries match).
    packed = [socket.inet_pton(socket.AF_INET6 if ":" in a else socket.AF_INET, a) for a in wanted]
    sock = NetlinkSocket(rcvbuf=4 << 20, sndbuf=1 << 20, protocol=nl.NETLINK_NETFILTER)
    try:
        seq = 0
        doomed: list[tuple[int, bytes, CtEvent]] = []
        for family in sorted({socket.AF_INET6 if ":" in a else socket.AF_INET for a in wanted}):
            seq += 1
            for mtype, buf, start, end in sock.request(encode_dump(seq, family), what="listing conntrack entries", dump=True):
                if mtype != MSG_NEW or not any(p in buf[start:end] for p in packed):
                    continue
                event = decode_event(mtype, buf, start, end)
                if event is not None and touches(event, wanted):
                    body = delete_body(buf, start, end)
                    if body is not None:
                        doomed.append((event.family, body, event))
        deleted = delete_entries(sock, ((message(IPCTNL_MSG_CT_DELETE, seq, nl.NLM_F_REQUEST, body, family),
                                         str(event.orig))
                                        for seq, (family, body, event) in enumerate(doomed, start=seq + 1)))
    finally:
        sock.close()
    return deleted
