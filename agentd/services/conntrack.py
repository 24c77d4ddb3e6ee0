"""UDP conntrack entries of removed endpoints, deleted through ctnetlink (pyroute2's Conntrack).

UDP has no connection end: a client that keeps sending to a service keeps its conntrack
entry, and so its translation to the endpoint chosen first, for as long as it sends - also
after that endpoint is gone (kube-proxy's stale-UDP bug, kubernetes#59368 and friends).  So
when an endpoint stops taking new connections of a UDP service port, every entry that was
translated to it for that service (original destination the cluster IP and port, or the node
port; reply source the endpoint) is deleted, and the next datagram is a new connection that
the rules send to a live endpoint.  TCP entries stay: a terminating endpoint keeps its
established connections.

Blocking (netlink): the agent calls :func:`flush_udp` in a thread, in its own namespace.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Stale:
    ip: str  # the endpoint
    port: int
    vip: str | None  # the service's cluster IP and port, its node port
    service_port: int
    node_port: int | None = None

    def matches(self, orig_daddr: str, orig_dport: int, reply_saddr: str, reply_sport: int) -> bool:
        if (reply_saddr, reply_sport) != (self.ip, self.port):
            return False
        return (orig_daddr, orig_dport) == (self.vip, self.service_port) or (
            self.node_port is not None and orig_dport == self.node_port
        )


def flush_udp(stale: Iterable[Stale]) -> int:
    """Delete the UDP entries of ``stale`` endpoints; returns how many were deleted."""
    from pyroute2 import Conntrack
    from pyroute2.conntrack import NFCTAttrTuple

    wanted = list(stale)
    if not wanted:
        return 0
    deleted = 0
    with Conntrack() as ct:
        entries = list(ct.dump_entries(tuple_orig=NFCTAttrTuple(proto=socket.IPPROTO_UDP)))
        for entry in entries:
            o, r = entry.tuple_orig, entry.tuple_reply
            if o.proto != socket.IPPROTO_UDP:
                continue
            if any(s.matches(o.daddr, o.dport, r.saddr, r.sport) for s in wanted):
                try:
                    ct.entry("del", tuple_orig=o)
                    deleted += 1
                except OSError:  # gone meanwhile
                    pass
    return deleted
