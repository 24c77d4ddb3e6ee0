"""The node's flow recorder: conntrack events and drop logs in, flow records out.

Where the records come from (the kernel, never guessed):

* **connections**: conntrack's event groups over ctnetlink (``agentd.kernel.netlink_ct``):
  NEW when an entry is confirmed -- its first packet passed every hook, policy included, so
  the connection is *forwarded* -- and DESTROY when it goes (closed and timed out), with its
  bytes, packets and start and stop times.  For these the agent turns on
  ``net.netfilter.nf_conntrack_acct`` and ``nf_conntrack_timestamp`` in the node's namespace,
  noting the values it found in ``<state_dir>/flows-sysctl.json`` so that ``agentd leave``
  puts them back.  A Service's connection is translated (DNAT): its original destination is
  the virtual IP (or node port), its reply source the endpoint chosen.  Connections the pod
  fast path carries keep their entry (it is conntrack's judgement the fast path relies on).
* **pods' IPv4 TCP connections**, where the pod fast path's programs run: the programs
  record them (podpath.c podconn_see: the start when the answer passes, the end with the last
  ACK or a RST, every packet counted) into a ring buffer (:class:`Recording`), and conntrack's
  events of exactly those are masked by one nft rule (agentd.nft.flowmask, handed in as
  ``mask``); what ends without telling, the agent's sweep ends (:meth:`FlowRecorder.sweep`).
* **drops**: the drop rules of the policy and services tables log to one NFLOG group
  (``agentd.kernel.netlink_log``) with a prefix that names the rule; the
  :class:`Directory` says what the prefix means (the pod chain and direction -> the
  policies isolating the pod; ``spoofed``; ``no-endpoints``).

Cost: conntrack tells every listener of every connection, so the agent keeps that cheap.  A
classic BPF filter on its socket (:func:`agentd.kernel.netlink_ct.event_filter`) lets only
events of pods' connections through (an address in the pod network or the Services' range
that is not the node's own: its bridge's address, the pods' gateway, is in the pod network,
but what the node sends from it to no pod -- IGMP reports, multicast, broadcast -- is no pod's);
the socket is read at most every ``CT_INTERVAL`` (one wake-up for many events); a read and
the reading of its events are one call into C (agentd/kernel/_ctevents.c: recvmmsg, up to 64
datagrams a system call, each event's addresses read at fixed offsets and its ends named
then), which gives one list of :data:`Event` s for Python to keep as they came
(:class:`PendingConnection`); the record itself is made only when someone reads it -- most
scroll out of the ring unread.  Where the C file is not built, :meth:`FlowRecorder._decode_here`
does the same in Python.  Events laid out otherwise (IPv6, malformed) are decoded whole here.

The pod fast path (agentd/dataplane/bpf/podpath.c) carries established TCP between pods past
conntrack, which therefore counts only what it saw of such a connection; the programs count
what they carried, per connection (:class:`CarriedCounts`), and an ``end`` record adds it.

Rate limits: the kernel logs at most ``rate`` drops a second per drop rule (nft ``limit``; what
it holds back is counted in each table's ``flow-log-suppressed`` counter), the agent keeps at
most ``agent_rate`` records a second per drop key (:class:`~agentd.flows.ring.DropLimiter`),
and reads at most ``CT_BUDGET`` conntrack and ``BUDGET`` log datagrams per turn of the event
loop.  The sockets'
receive buffers are bounded; what the kernel could not queue is counted as lost (ENOBUFS,
gaps in NFLOG's sequence numbers).  So memory stays bounded under a drop storm: the ring, the
limiter's key table and two socket buffers.

Records go into a :class:`~agentd.flows.ring.FlowRing` (bounded) that ``GET /flows`` reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import heapq
import json
import logging
import os
import socket
import struct
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from ipaddress import (
    IPv4Address,
    IPv4Network,
    IPv6Address,
    IPv6Network,
    ip_address,
    ip_network,
)
from pathlib import Path
from typing import Protocol

from agentd.kernel import netlink as nl
from agentd.kernel import netlink_ct as ct
from agentd.kernel import netlink_log as nflog
from agentd.kernel.netlink_socket import NetlinkSocket

from .model import (
    SENDER_REASONS,
    Flow,
    Identity,
    Peer,
    direction_of,
    ethertype_name,
    protocol_name,
)
from .ring import Batch, Deferred, DropLimiter, Entry, FlowRing

log = logging.getLogger("agentd.flows")

SYSCTL_DIR = Path("/proc/sys/net/netfilter")
SYSCTLS = ("nf_conntrack_acct", "nf_conntrack_timestamp")
SYSCTL_STATE = "flows-sysctl.json"
BUDGET = 64  # datagrams read per socket per turn of the loop: the rest waits for the next turn
COPY_RANGE = 128  # bytes of each logged packet: its IP and transport headers
ICMP_ERRORS = (socket.IPPROTO_ICMP, socket.IPPROTO_ICMPV6)  # a no-route record from the error the node sent (dropped)
LOG_TIMEOUT_CS = 10  # the kernel sends logged packets within 0.1 s ...
LOG_QTHRESH = 64  # ... or once this many are queued
CT_INTERVAL = 0.05  # conntrack events are read at most this often: one wake-up for many
RECORDED_INTERVAL = 0.2  # the programs' ring is read this often (it holds about 11,900 records)
CT_BUDGET = 2048  # datagrams read per turn; more are read at the next turn of the loop
RESTARTS_MAX = 4096  # carried counts waiting for their connection's end (tuples reused meanwhile)
NAMES_MAX = 65536  # addresses whose identity is remembered between changes of the pods
# Whom an address named before it became someone else's (or nobody's): an end names its
# connection's ends as they were named when it started (:meth:`FlowRecorder._named_then`).
HISTORY_MAX = 65536  # addresses
HISTORY_PER_ADDRESS = 4  # changes of one address (the oldest forgotten first)
HISTORY_AGE_NS = 900 * 10**9  # a change is forgotten 15 minutes after it
# Events waiting in the ring that a change of the Services settles (:meth:`FlowRecorder._settle_step`)
# between two turns of the event loop: some milliseconds (a settle is a few microseconds), as
# flows.views' SEARCH_STEP, so BGP, etcd and other requests wait no longer.
SETTLE_STEP = 2048
# The Services before they changed, each with when it was last seen current: an end names the
# Service of its connection's start, as its ``new`` did (:meth:`FlowRecorder._services_at`).
SERVICES_HISTORY = 4  # snapshots (the oldest forgotten first; and HISTORY_AGE_NS after they were)
SWEEP_INTERVAL = 5.0  # the programs' recorded connections are looked over this often
SYN_TIMEOUT_NS = 120 * 10**9  # an unanswered SYN's entry goes (nf_conntrack_tcp_timeout_syn_sent)
CLOSING_TIMEOUT_NS = 2 * 10**9  # both FINs seen, no last ACK since: ended
RESET_TIMEOUT_NS = 2 * 10**9  # a RST seen, nothing but RST from its end since: ended (reset)
RESETS_MAX = 65536  # connections a RST passed, waiting to be looked at (podconns' size); more: the sweep's
IDLE_NS = 10 * 10**9  # idle this long: ended if conntrack no longer holds it
HELD_RECHECK_NS = 60 * 10**9  # conntrack found holding an idle one: not asked again for this long
REC_START, REC_FIN, REC_RST, REC_REUSED, REC_GONE = 1, 2, 3, 4, 5  # podpath.py (enum podconn_kind; GONE: the sweep's)
# The sweep's too, never the programs': GONE of a connection they held when told not to record
# (:class:`Leftovers`) that conntrack was found holding since -- it may have carried anything
# meanwhile, nobody counting: its bytes, packets and duration are unknown.
REC_GONE_UNCOUNTED = 6
CONN_SYN, CONN_OPEN, CONN_CLOSING, CONN_RESET_LO, CONN_RESET_HI = 1, 2, 3, 4, 5  # enum podconn_state
# struct podconn_value: packets sent by the key's lower end, by the other, bytes alike, CLOCK_TAI
# ns of the SYN and of the last packet, state, the client's side (1: the higher end), FIN bits
CONN_VALUE = struct.Struct("<QQQQQQIB3xI4x")  # and podpath.h's fin_ack_hi, client_seq: not read here
CONN_RECORD = struct.Struct("<12sI64s")  # struct podconn_record: key, kind, value
_KEY_KIND_FIRST = struct.Struct("<12sI32xQ24x")  # a record's key, kind and its connection's SYN's time
_NLMSG = struct.Struct("=IH")  # nlmsg_len, nlmsg_type
_TUPLE_LEN = struct.Struct("=H")  # the first attribute's nla_len: CTA_TUPLE_ORIG's
_UNKNOWN = object()  # an address not named yet
TCP = 6


class Drop(Protocol):
    """What a drop rule's prefix means (the directory's answer)."""

    reason: str
    direction: str | None  # "ingress" / "egress" of the pod that denied it; None: from the packet
    policies: tuple[str, ...]
    default_deny: bool


class Directory(Protocol):
    """Who an address is and what a drop prefix means (the daemon's policy and services agents)."""

    def version(self) -> int: ...  # changes whenever an address may have become someone else

    # (count now, [(address, whom it named before it may have become someone else, when:
    # CLOCK_REALTIME s, None if not known)] since the ``count`` th such change, oldest first;
    # None if some are no longer known).
    def named_before(self, count: int | None) -> tuple[int, list[tuple[str, Identity, float | None]] | None]: ...

    def identity(self, ip: str) -> Identity | None: ...

    def service(self, ip: str, proto: int, port: int) -> str | None: ...

    # service() as the Services are now, kept so: what a record made later of an event of now
    # names (the Service an address belonged to when the connection was made).
    def service_names(self) -> Callable[[str, int, int], str | None]: ...

    def drop(self, prefix: str) -> Drop | None: ...

    def pod_on(self, ifindex: int) -> tuple[str, Identity | None] | None:
        """The interface ``ifindex`` of the node (its name) and the local pod whose veth it is;
        None when there is no such interface (any more)."""
        ...


# (packets sent by the lower end, by the other, bytes sent by the lower end, by the other,
# CLOCK_TAI ns of the first packet carried)
Counts = tuple[int, int, int, int, int]


class CarriedCounts(Protocol):
    """What the pod fast path carried past conntrack, per connection
    (:class:`agentd.dataplane.bpf.podpath.PodFastPath`).  A connection is known by its two
    ends in a fixed order, the lower (address, port) first (:func:`carried_key`); its counts are
    :data:`Counts`.  When a connection ends, what the fast path holds of its tuple may already be
    a later connection's (the tuple reused before the end was read): when its first packet was
    carried tells whose they are, as conntrack stamps each connection's start and stop."""

    def carried_restarts(self) -> list[tuple[bytes, Counts]]: ...

    def take_carried(self, key: bytes) -> Counts | None: ...


def tai_offset_ns() -> int:
    """CLOCK_TAI - CLOCK_REALTIME (whole seconds, the kernel's TAI offset: 0 unless NTP set it):
    the fast path stamps in TAI, conntrack in real time."""
    return round((time.clock_gettime_ns(time.CLOCK_TAI) - time.time_ns()) / 1e9) * 1_000_000_000


# When an entry's last packet passed, from its DESTROY.  conntrack keeps an entry for a while
# after its connection's last packet (TCP's TIME_WAIT, 2 minutes; UDP's and ICMP's 30 s) and
# stamps an entry that expired with its expiry, so the end's time and duration would be that
# much late.  Each packet sets the entry's timeout to the one of the state it leaves it in
# (nf_conntrack_proto_tcp.c, _udp.c, _icmp.c): the expiry less that timeout is the last packet.
# The sysctl (``nf_conntrack_<name>`` in the node's namespace) of each such state:
CT_TCP_TIMEOUTS = {2: "tcp_timeout_syn_recv", 4: "tcp_timeout_fin_wait", 5: "tcp_timeout_close_wait",
                   6: "tcp_timeout_last_ack", 7: "tcp_timeout_time_wait", 8: "tcp_timeout_close"}
# Not SYN_SENT: a SYN sent again does not renew its entry (nf_conntrack_proto_tcp.c: "do not
# renew entry stuck in tcp SYN_SENT state"), so its expiry less the timeout is the first SYN;
# its stop stays (its first SYN and 2 minutes, about when the client gives up: 127 s at 6 tries).
# Not ESTABLISHED: its timeout (5 days) is longer than the two below, which may have been set
# instead.  A state's own timeout is the one set only where it is no longer than both.
CT_TCP_CAPS = ("tcp_timeout_max_retrans", "tcp_timeout_unacknowledged")
CT_TIMEOUT_NAMES = (*CT_TCP_TIMEOUTS.values(), *CT_TCP_CAPS, "udp_timeout", "udp_timeout_stream",
                    "icmp_timeout", "icmpv6_timeout")
# The kernel whose DESTROY events say how long their entry had left (CTA_TIMEOUT, and TCP's
# state, CTA_PROTOINFO): before it an entry deleted early cannot be told from one that expired.
CT_DESTROY_SAYS = (5, 11)


def ct_last_packet_ns(ev: ct.CtEvent, timeouts: dict[str, int]) -> int:
    """When the last packet of a DESTROYed entry passed (CLOCK_REALTIME ns), for an entry in a
    state whose timeout is that of a sysctl in ``timeouts`` (seconds): its stop stamp less that
    timeout and plus what it had left (:attr:`~agentd.kernel.netlink_ct.CtEvent.timeout_s`:
    none if it expired, the stop its expiry; whole seconds if it was deleted before -- its tuple
    taken by a new connection in TIME_WAIT, a flush -- when it was stamped; sent again later,
    as the kernel does for a listener that missed it, the time since counts too).  Exact to a
    jiffy where it expired, to a second where it was deleted.  Else (a fixed timeout,
    ESTABLISHED, SYN_SENT, refused -- CLOSE with no reply seen --, a NAT clash of UDP, SCTP,
    another protocol) its stop stamp.  Never before its start nor after its stop."""
    stop = ev.stop_ns
    if not (ev.destroyed and stop and ev.start_ns) or ev.status & ct.IPS_FIXED_TIMEOUT:
        return stop
    proto, name = ev.orig.proto, None
    if proto == socket.IPPROTO_TCP:
        name = CT_TCP_TIMEOUTS.get(ev.tcp_state)
        if ev.tcp_state == 8 and not ev.status & ct.IPS_SEEN_REPLY:
            name = None  # refused: its RST killed it in CLOSE with what SYN_SENT had left; at the RST
        caps = [timeouts.get(c) for c in CT_TCP_CAPS]
        if name is not None and (None in caps or timeouts.get(name, 0) > min(caps)):  # type: ignore[type-var]
            name = None
    elif proto in (socket.IPPROTO_UDP, 136):  # UDP-Lite alike
        # Assured: its packets since a reply came after its first 2 s set the stream timeout;
        # not assured (nor a NAT clash, which is never assured), every packet set the short one.
        if not ev.status & ct.IPS_NAT_CLASH:
            name = "udp_timeout_stream" if ev.status & ct.IPS_ASSURED else "udp_timeout"
    elif proto == socket.IPPROTO_ICMP:
        name = "icmp_timeout"
    elif proto == socket.IPPROTO_ICMPV6:
        name = "icmpv6_timeout"
    timeout = timeouts.get(name) if name is not None else None
    if timeout is None:
        return stop
    left = 0
    if ev.timeout_s > 0:
        left = ev.timeout_s * 1_000_000_000 + (max(0, ev.event_ns - stop) if ev.event_ns else 0)
    return min(stop, max(ev.start_ns, stop + left - timeout * 1_000_000_000))


def _kernel_at_least(release: str, want: tuple[int, int]) -> bool:
    try:
        major, minor = (int(x) for x in release.split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= want


class ConntrackTimeouts:
    """conntrack's timeouts (:data:`CT_TIMEOUT_NAMES`, seconds) in this process's namespace,
    read again at most every ``ttl`` seconds of ``clock``; one that cannot be read is left out,
    and all of them on a kernel older than :data:`CT_DESTROY_SAYS` (``release``)."""

    def __init__(self, root: Path = Path("/proc/sys/net/netfilter"), ttl: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, release: str | None = None) -> None:
        self.root, self.ttl, self.clock = root, ttl, clock
        self.usable = _kernel_at_least(os.uname().release if release is None else release, CT_DESTROY_SAYS)
        self._read_at: float | None = None
        self._values: dict[str, int] = {}

    def __call__(self) -> dict[str, int]:
        if not self.usable:
            return self._values
        now = self.clock()
        if self._read_at is None or now - self._read_at >= self.ttl:
            values = {}
            for name in CT_TIMEOUT_NAMES:
                try:
                    values[name] = int((self.root / f"nf_conntrack_{name}").read_text())
                except (OSError, ValueError):
                    continue
            if values != self._values:  # else the same dict: what events of before hold is this one
                self._values = values
            self._read_at = now
        return self._values


def tai_now() -> int:
    """CLOCK_TAI, ns: the clock the pod programs stamp packets with (bpf_ktime_get_tai_ns)."""
    return time.clock_gettime_ns(time.CLOCK_TAI)


def carried_key(src: bytes, sport: int, dst: bytes, dport: int) -> tuple[bytes, bool]:
    """The fast path's key of a connection from ``src``:``sport`` to ``dst``:``dport``, and
    whether ``src`` is its lower end (podpath.h, struct podflow_key)."""
    lower = (src, sport) <= (dst, dport)  # addresses (4 or 16 bytes) compare as the numbers they are
    a, ap, b, bp = (src, sport, dst, dport) if lower else (dst, dport, src, sport)
    return a + b + ap.to_bytes(2, "big") + bp.to_bytes(2, "big"), lower


# A conntrack event as its read gives it (agentd/kernel/_ctevents.c, or the recorder's Python
# loop): (the datagram -- one message --, its type, the names of its original source,
# original destination and reply source, and for a DESTROY of TCP between pods while the fast
# path counts: (its carried_key, whether the source is the lower end, conntrack's start and stop
# stamps), else None; and a DESTROY's start stamp, CLOCK_REALTIME ns -- 0: a NEW, or not kept).
Carry = tuple[bytes, bool, int, int]
Event = tuple[bytes, int, Identity | None, Identity | None, Identity | None, Carry | None, int]


class PendingConnection(Deferred):
    """A conntrack event as the kernel sent it, with its ends named when it came; the record
    is made when it is first read."""

    __slots__ = ("recorder", "event", "carried", "received", "services", "service", "timeouts", "_flow")

    def __init__(self, recorder: FlowRecorder, event: Event, carried: tuple[int, int, int, int] | None,
                 received: float, services: Callable[[str, int, int], str | None] | None = None,
                 timeouts: dict[str, int] | None = None) -> None:
        self.recorder = recorder
        self.event: Event | None = event
        self.carried = carried  # (packets, bytes) each way of the original direction, by the fast path
        self.received = received
        # The Services as they were when it came (shared by every event since the last sync) --
        # until the next sync, when its Service's name is looked up there and kept instead
        # (:meth:`settle`): no older snapshot is kept alive by what waits in the ring.
        self.services = services
        self.service: str | None | object = _UNKNOWN
        self.timeouts = timeouts  # conntrack's timeouts when it came (shared alike: one dict while they stay)
        self._flow: Flow | None = None

    def settle(self) -> None:
        """Its Service named as the Services it holds name it, and that snapshot let go (the
        original destination, protocol and port at their fixed offsets: one look-up)."""
        services, event = self.services, self.event
        if services is None or event is None:
            return
        data, mtype = event[0], event[1]
        fields = ct.ipv4_tuples(mtype, data, nl.NLMSG_HDRLEN, len(data))
        self.service = None if fields is None else services(socket.inet_ntoa(fields[1]), fields[2], fields[4])
        self.services = None

    def flow(self) -> Flow:
        if self._flow is None:
            assert self.event is not None
            data, mtype, *names, _carry, _start = self.event
            try:
                ev = ct.decode_event(mtype, data, nl.NLMSG_HDRLEN, len(data))
            except nl.NetlinkDecodeError as err:  # its tuples were read when it came, not the rest
                log.debug("flows: malformed conntrack message: %s", err)
                self.recorder.malformed += 1
                ev = _tuples_only(mtype, data)
            assert ev is not None  # its tuples were read when it came
            flow = self.recorder.connection(ev, names=tuple(names), carried=self.carried,  # type: ignore[arg-type]
                                            received=self.received, services=self.services,
                                            timeouts=self.timeouts, service=self.service)
            assert flow is not None
            flow.seq = self.seq
            self._flow = flow
            self.event = self.recorder = self.carried = self.services = self.timeouts = None  # type: ignore[assignment]
        return self._flow


class Mask(Protocol):
    """The table masking conntrack's events of the connections the pod programs mark
    (agentd.nft.flowmask.FlowMask); both blocking, ``install`` raises OSError or RuntimeError."""

    def install(self) -> None: ...

    def remove(self) -> None: ...


class Recording(Protocol):
    """The pod programs recording pods' IPv4 TCP connections themselves
    (:class:`agentd.dataplane.bpf.podpath.PodFastPath`): starts and ends through a ring
    buffer, what they hold in a map, as the kernel lays them out (podpath.h: struct
    podconn_record, struct podconn_value; :data:`CONN_RECORD`, :data:`CONN_VALUE`)."""

    recording: bool

    def set_recording(self, on: bool, remote: bool = False) -> None: ...

    def recorded(self) -> list[bytes]: ...  # struct podconn_record each (CONN_RECORD)

    # What recorded() gives, whether or not this process told them to record (the ring opened
    # for that read): what an earlier agent's programs wrote, kept before they are told to stop.
    def recorded_left(self) -> list[bytes]: ...

    def recorded_lost(self) -> int: ...  # records the ring could not take, ever

    def recorded_open(self) -> list[tuple[bytes, bytes]]: ...  # (key, struct podconn_value)

    def take_recorded(self, key: bytes) -> bytes | None: ...

    def recorded_entry(self, key: bytes) -> bytes | None: ...  # struct podconn_value, now

    # Back, unless the programs made one since (False); OSError where it cannot (E2BIG: full).
    def put_recorded(self, key: bytes, value: bytes) -> bool: ...

    # Whether the programs record connections with other nodes' pods too, as they are set now
    # (not what they were asked: without the wire program they do not).
    def records_remote(self) -> bool: ...

    # Connections a RST passed since the last call, (key, CLOCK_TAI ns of the RST) each: hints
    # (podpath.h: struct podconn_hint), which :meth:`FlowRecorder.end_resets` acts on.
    def reset_hints(self) -> list[tuple[bytes, int]]: ...


class Leftovers:
    """Connections the pod programs held when they were told not to record, as they were then
    (key -> struct podconn_value): what the sweep looks over of them as it does the programs'
    map (:meth:`FlowRecorder.sweep`), taking each out as it ends."""

    __slots__ = ("held", "held_on")

    def __init__(self) -> None:
        self.held: dict[bytes, bytes] = {}
        # Those conntrack was found holding at a look (after recording stopped): ended, their
        # counts are unknown (REC_GONE_UNCOUNTED), not those of when it stopped.
        self.held_on: set[bytes] = set()

    def recorded_open(self) -> list[tuple[bytes, bytes]]:
        return list(self.held.items())

    def recorded_entry(self, key: bytes) -> bytes | None:
        return self.held.get(key)

    def take_recorded(self, key: bytes) -> bytes | None:
        self.held_on.discard(key)
        return self.held.pop(key, None)

    def put_recorded(self, key: bytes, value: bytes) -> bool:
        return self.held.setdefault(key, value) is value


class RecordedBatch(Batch):
    """Starts and ends of connections the pod programs recorded, as one read of their ring gave
    them (struct podconn_record each, side by side), the addresses they hold named when they
    came; a record is made when it is first read."""

    __slots__ = ("blob", "ends", "names", "node", "offset", "received")

    def __init__(self, node: str, blob: bytes, count: int, names: dict[bytes, Identity | None], offset: int,
                 received: float, ends: dict[int, tuple[Identity | None, Identity | None]] | None = None) -> None:
        super().__init__(count)
        self.node = node
        self.blob = blob
        self.names = names
        self.offset = offset  # CLOCK_TAI - CLOCK_REALTIME, ns
        self.received = received
        self.ends = ends  # index -> (lower, higher end) as its connection's start named them

    def make(self, index: int) -> Flow:
        size = CONN_RECORD.size
        raw = self.blob[index * size : (index + 1) * size]
        named = self.ends.get(index) if self.ends else None
        if named is None:
            names = self.names
            named = (names.get(raw[0:4]), names.get(raw[4:8]))
        return recorded_flow(self.node, raw, named[0], named[1], self.offset, self.received)


def recorded_flow(node: str, raw: bytes, lo_id: Identity | None, hi_id: Identity | None, offset: int,
                  received: float) -> Flow:
    """A record of a connection the pod programs recorded: ``raw`` is a struct podconn_record,
    ``lo_id`` and ``hi_id`` its key's lower and higher end as named when it came, ``offset``
    CLOCK_TAI - CLOCK_REALTIME in ns.  The client is the end that sent the SYN; a start is
    ``new`` (when the SYN passed), anything else ``end`` (when its last packet passed; one the
    agent found gone from conntrack, when it found it)."""
    key, kind, value = CONN_RECORD.unpack(raw)
    p_lo, p_hi, b_lo, b_hi, first, last, _state, client, _fins = CONN_VALUE.unpack(value)
    lo = Peer(socket.inet_ntoa(key[0:4]), int.from_bytes(key[8:10], "big"), lo_id)
    hi = Peer(socket.inet_ntoa(key[4:8]), int.from_bytes(key[10:12], "big"), hi_id)
    src, dst = (hi, lo) if client else (lo, hi)
    direction = direction_of(src.identity, dst.identity)
    # ``received`` kept: the ring is in the order records came, which their times are not (a start
    # keeps its first SYN's, however late the answer; a tuple's reuse ends the connection before).
    if kind == REC_START:
        return Flow(time=(first - offset) / 1e9, node=node, event="new", protocol="TCP", src=src, dst=dst,
                    direction=direction, received=received)
    when = received if kind in (REC_GONE, REC_GONE_UNCOUNTED) else (last - offset) / 1e9
    flow = Flow(time=when, node=node, event="end", protocol="TCP", src=src, dst=dst, direction=direction,
                received=received)
    if kind == REC_GONE_UNCOUNTED:  # what it carried after recording stopped: not known
        return flow
    if client:
        flow.packets_sent, flow.bytes_sent, flow.packets_received, flow.bytes_received = p_hi, b_hi, p_lo, b_lo
    else:
        flow.packets_sent, flow.bytes_sent, flow.packets_received, flow.bytes_received = p_lo, b_lo, p_hi, b_hi
    flow.duration = max(0.0, (last - first) / 1e9)
    return flow


def _tuples_only(mtype: int, data: bytes) -> ct.CtEvent | None:
    """An event whose attributes after its tuples are malformed: what its tuples say (no
    counters, no stamps, no status)."""
    b = ct.brief(mtype, data, nl.NLMSG_HDRLEN, len(data))
    if b is None:
        return None
    src, dst, reply_src = (socket.inet_ntoa(a) for a in (b.src, b.dst, b.reply_src))
    return ct.CtEvent(b.destroyed, socket.AF_INET, ct.CtTuple(src, dst, b.proto, b.sport, b.dport),
                      ct.CtTuple(reply_src, src, b.proto, b.reply_sport, b.sport))


class FlowRecorder:
    def __init__(
        self,
        node: str,
        directory: Directory,
        state_dir: str | os.PathLike,
        *,
        group: int,
        ring_size: int = 10_000,
        agent_rate: float = 10.0,
        agent_burst: int = 20,
        clock: Callable[[], float] = time.time,
        pods: Sequence[IPv4Network | IPv6Network] = (),
        services: Sequence[IPv4Network | IPv6Network] = (),
        carried: CarriedCounts | None = None,
        tai_offset: Callable[[], int] = tai_offset_ns,
        connections: bool = True,
        record_remote: bool = False,
        mask: Mask | None = None,
        own: Sequence[IPv4Address | IPv6Address] = (),
        ct_timeouts: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        """``pods``, ``services``: the pod networks and the Services' ranges (either family); a
        conntrack event of a connection with neither end in them, nor named, is the node's own
        (its IPv4 ones are not even read: the kernel's filter).  ``own``: the node's own
        addresses inside those (its bridges' addresses, the pods' gateways, and its IPv4 subnet's
        broadcast address): no pod's, so an event whose only addresses in them are these is the
        node's own too (its bridge's IGMP reports).  ``carried``: the pod fast path's counts.
        ``connections`` False: drops only -- no conntrack events are asked for (nor the
        sysctls set), so connections cost nothing more than with flows off.  Where ``carried``
        can record connections itself (:class:`Recording`), it records pods' IPv4 TCP
        connections and conntrack's events of those are masked (``mask``);
        ``record_remote``: those with other nodes' pods too (every packet from them passes the
        wire program: host-gw); ``mask``: the table masking conntrack's events of what they
        mark (agentd.nft.flowmask), without which they do not record.  ``ct_timeouts``:
        conntrack's timeouts (:class:`ConntrackTimeouts`), for the ends of its entries at their
        last packet rather than at their expiry (:func:`ct_last_packet_ns`); without, at expiry."""
        self.node = node
        self.directory = directory
        self.state_dir = Path(state_dir)
        self.group = group
        self.clock = clock
        self.ring = FlowRing(ring_size, self._count)
        self.ring.on_batch = self._count_batch
        self.limiter = DropLimiter(agent_rate, agent_burst)
        self.ct_sock: NetlinkSocket | None = None
        self.log_sock: NetlinkSocket | None = None
        self.flows: Counter[str] = Counter()  # records by verdict
        self.drops: Counter[tuple[str, str]] = Counter()  # drop records by (reason, direction)
        self.lost: Counter[str] = Counter()  # events the kernel could not queue for us: conntrack, log
        self._ct_lost_before = 0  # conntrack events lost at sockets before the one open now
        self.malformed = 0
        self.events = 0
        self.filtered = False  # the kernel filters conntrack events (pods' only) for us
        v4 = [n for n in (*pods, *services) if n.version == 4]
        self.prefixes = [(int(n.network_address), int(n.netmask)) for n in v4]  # IPv4, for the kernel's filter and C
        self.networks = tuple(ip_network(n) for n in (*pods, *services))  # both families: the long way
        self.service_networks = tuple(ip_network(n) for n in services)
        self.own = frozenset(ip_address(a) for a in own)  # both families: the long way
        self._own_packed = frozenset(a.packed for a in self.own if a.version == 4)  # IPv4: Python's loop
        self.connections = connections
        self.carried = carried if connections else None
        # The pod programs, which may record (an earlier agent's told them to): told to stop
        # wherever this recorder does not record (:meth:`_stop_recording`).
        self.programs: Recording | None = carried if hasattr(carried, "set_recording") else None  # type: ignore[assignment]
        self.tai_offset = tai_offset
        self.ct_timeouts = ct_timeouts
        self._tai_offset = 0
        self._restarts: dict[bytes, deque[Counts]] = {}
        self.record_remote = record_remote
        self.mask = mask
        self.recording: Recording | None = None  # the pod programs, once they record connections
        # What they held when told not to record (:meth:`_keep_leftovers`), until the sweep
        # ended each; and what their ring held then, taken in when the recorder runs.
        self.leftovers: Leftovers | None = None
        self._leftover_records: list[bytes] = []
        self._get_sock: NetlinkSocket | None = None  # the sweep's conntrack look-ups
        self._get_seq = 0  # the last one's sequence number
        self.swept = 0  # recorded connections the sweep ended
        # Connections the sweep took that were not the one judged and could not be put back:
        # "ended" there (past their SYN), "lost" (unanswered SYNs: recorded by nobody).
        self.not_put_back: Counter[str] = Counter()
        # Idle recorded connections conntrack was last found holding: key -> (their SYN's time,
        # when found), CLOCK_TAI ns; only keys the programs still hold are kept.
        self._held_at: dict[bytes, tuple[int, int]] = {}
        # Connections a RST passed (the programs' hints): key -> when to look at it again, and
        # those times in a heap, (when, key), CLOCK_TAI ns (an entry whose time changed since
        # is skipped there).
        self._reset_due: dict[bytes, int] = {}
        self._resets: list[tuple[int, bytes]] = []
        self._names: dict[bytes, Identity | None] = {}
        # The Services' snapshot the events read since the last sync hold, and those reads (their
        # entries lists, oldest first, no more than the ring holds: :meth:`_extend`); conntrack's
        # timeouts the last read gave (kept while equal).
        self._services_then: Callable[[str, int, int], str | None] | None = None
        self._unsettled: deque[list[Entry]] = deque()
        self._unsettled_count = 0
        # Reads of snapshots before it, waiting to be settled SETTLE_STEP events at a time
        # (:meth:`_settle_step`): oldest first, the first from ``_settling_from`` on.
        self._settling: deque[list[Entry]] = deque()
        self._settling_count = 0
        self._settling_from = 0
        self._settle_due = False  # a step is asked of the loop
        # The snapshots before the current one, oldest first, each with the last read under it
        # (CLOCK_REALTIME ns): a connection that started by then was named by it when it came,
        # and its end is named alike (:meth:`_services_at`); when conntrack was last read empty
        # (s: the clock before the read's last recv; a read the budget stopped is none).
        self._services_past: deque[tuple[int, Callable[[str, int, int], str | None]]] = deque()
        self._services_forgot = 0  # the last read under a snapshot forgotten since (ns): what started by then is named as read
        self._ct_read_at: float | None = None
        self._timeouts_then: dict[str, int] | None = None
        # Addresses (packed: 4 or 16 bytes) that became someone else's or nobody's while
        # recording: [(when, CLOCK_TAI ns; whom it named until then)], oldest first -- an end
        # names its connection's ends as they were named when it started (:meth:`_named_then`).
        self._history: dict[bytes, list[tuple[int, Identity]]] = {}
        self._named_seen: int | None = None  # the directory's count of changes read
        self._history_pruned = 0  # CLOCK_TAI ns
        self._names_version: int | None = None
        self._log_seq: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: str | None = None
        # The per-event loop: in C where it is built (it then reads the socket too), else here.
        self.fast = ct.fast_events is not None

    # ------------------------------------------------------------------ lifecycle (blocking)

    def open(self) -> None:
        """Turn on conntrack's accounting and timestamps (noting what was there), join the
        conntrack event groups and bind the drop log group; with ``connections`` False only
        the last (and the sysctls an earlier run turned on put back).  Raises OSError (one line);
        the programs then do not record (nor is anything masked): this recorder is off."""
        try:
            if self.connections:
                self._open_conntrack()
                self._open_recording()
            elif self.mask is not None:
                self._stop_recording()
                try:
                    gone = restore_sysctls(self.state_dir)
                except OSError as err:  # the state file stays: `agentd leave` tries again
                    log.warning("flows: connection records off: %s", err)
                else:
                    if gone:
                        log.info("flows: connection records off: put back %s", ", ".join(gone))
            self.log_sock = self._bind_log()
        except OSError:
            self._stop_recording()
            self.close()
            raise

    def _bind_log(self) -> NetlinkSocket:
        sock = NetlinkSocket(rcvbuf=4 << 20, sndbuf=1 << 16, protocol=nl.NETLINK_NETFILTER)
        try:
            try:
                sock.request(nflog.encode_bind(self.group, 1), what=f"binding NFLOG group {self.group}", dump=False)
            except nl.NetlinkError as err:
                if err.errno != errno.EBUSY:
                    raise
                # The kernel frees a group when its socket closes (a dead agent's too): someone
                # else has it.
                raise OSError(err.errno, f"NFLOG group {self.group} is bound by another process "
                                         "([flows] log_group picks another)") from None
            # With each packet its conntrack entry: a Service's connection dropped at its
            # endpoint (NetworkPolicy) names the Service by the entry's original destination.
            # The kernel refuses that (EOPNOTSUPP) without its conntrack glue: built without
            # CONFIG_NETFILTER_NETLINK_GLUE_CT, or nf_conntrack_netlink (which registers it) not
            # loaded yet -- a ctnetlink request loads that, then once more; refused again,
            # the drops come without entries.
            def settings(seq: int, conntrack: bool) -> None:
                sock.request(nflog.encode_settings(self.group, seq, copy_range=COPY_RANGE, timeout_cs=LOG_TIMEOUT_CS,
                                                   qthresh=LOG_QTHRESH, conntrack=conntrack), what="configuring NFLOG", dump=False)

            try:
                try:
                    settings(2, True)
                except nl.NetlinkError as err:
                    if err.errno != errno.EOPNOTSUPP:
                        raise
                    with contextlib.suppress(OSError):
                        ct.holds(sock, ct.CtTuple("127.0.0.1", "127.0.0.1", socket.IPPROTO_TCP, 1, 1), seq=3)
                    settings(4, True)
            except nl.NetlinkError as err:
                if err.errno != errno.EOPNOTSUPP:
                    raise
                log.info("flows: NFLOG gives no conntrack entries here (%s): a policy drop of a Service's "
                         "connection names the endpoint, not the Service", err)
                settings(5, False)
        except OSError:
            sock.close()
            raise
        return sock

    def _open_conntrack(self) -> None:
        enable_sysctls(self.state_dir)
        sock = NetlinkSocket(rcvbuf=8 << 20, sndbuf=1 << 16, protocol=nl.NETLINK_NETFILTER)
        try:
            # Also with no IPv4 range at all (an IPv6-only cluster): then no IPv4 event is a pod's.
            try:
                own = sorted(int(a) for a in self.own if a.version == 4)
                sock.attach_filter(ct.event_filter(self.prefixes, own=own))
                self.filtered = True
            except OSError as err:  # every event is read and sorted here instead
                log.warning("flows: conntrack events are not filtered in the kernel: %s", err)
            for group in (ct.NFNLGRP_CONNTRACK_NEW, ct.NFNLGRP_CONNTRACK_DESTROY):
                sock.sock.setsockopt(nl.SOL_NETLINK, nl.NETLINK_ADD_MEMBERSHIP, group)
        except OSError:
            sock.close()
            raise
        self.ct_sock = sock
        self._ct_lost_before = self.lost["conntrack"]  # a new socket's drop count starts at 0

    def _open_recording(self) -> None:
        """The pod programs record pods' IPv4 TCP connections, where they can: conntrack's
        events of what they mark masked first (the table), then the programs told.  Where
        either cannot be done, conntrack's events tell of every connection (no table)."""
        rec = self.programs
        if rec is None or self.mask is None:
            self._stop_recording()
            return
        try:
            self.mask.install()
            rec.set_recording(True, self.record_remote)
        except (OSError, RuntimeError) as err:  # RuntimeError: agentd.nft's NftError
            log.warning("flows: the pod programs do not record connections, conntrack's events tell of all: %s", err)
            self._stop_recording()
            return
        self.recording = rec

    def _stop_recording(self) -> None:
        """The programs told not to record (an earlier agent may have told them to), then the
        mask removed: nothing is masked that no program records.  What they hold is kept first
        (:meth:`_keep_leftovers`): told, they drop it."""
        self.recording = None
        if self.programs is not None:
            self._keep_leftovers(self.programs)
            try:
                self.programs.set_recording(False)
            except (OSError, RuntimeError) as err:  # RuntimeError: BpfUnavailable (conntrack's sysctls unreadable)
                log.warning("flows: the pod programs may go on recording connections: %s", err)
        if self.mask is not None:
            with contextlib.suppress(OSError, RuntimeError):
                self.mask.remove()

    def _keep_leftovers(self, programs: Recording) -> None:
        """The connections the programs hold (podconns) and the starts and ends their ring
        holds, before they are told not to record -- they drop both then (podpath's
        _drop_recorded) -- which an earlier agent's told them to record, or this one's: their
        conntrack entries' events were masked at their SYN, so nobody else would ever end them.
        The connections are kept (:attr:`leftovers`) for the sweep to end each as it would
        have in the map (gone from conntrack, closing, reset: :meth:`sweep`), nothing new
        recorded; the records are taken in when the recorder runs."""
        look = getattr(programs, "recorded_open", None)
        if look is None:
            return
        try:
            held = look()
            # Not recorded(): it reads nothing where this process never told them to record
            # (recording refused, connections off) -- the very cases these are kept for.
            left = getattr(programs, "recorded_left", None)
            records = left() if left is not None else []
        except (OSError, RuntimeError) as err:  # RuntimeError: BpfUnavailable
            log.warning("flows: the connections the pod programs recorded could not be read, "
                        "their ends will not be recorded: %s", err)
            return
        if held:
            if self.leftovers is None:
                self.leftovers = Leftovers()
            self.leftovers.held.update(held)
            log.info("flows: %d connections the pod programs recorded are ended as they end, "
                     "nothing new is recorded by them", len(held))
        self._leftover_records += records

    def close(self) -> None:
        for sock in (self.ct_sock, self.log_sock, self._get_sock):
            if sock is not None:
                sock.close()
        self.ct_sock = self.log_sock = self._get_sock = None

    async def run(self) -> None:
        """The supervised task: read both sockets (the log's alone with ``connections`` False)
        as they become readable."""
        if self.log_sock is None:
            await asyncio.to_thread(self.open)
        assert self.log_sock is not None and (self.ct_sock is not None or not self.connections)
        loop = self._loop = asyncio.get_running_loop()
        ct_fd = self.ct_sock.fileno() if self.ct_sock is not None else None
        if ct_fd is not None:
            loop.add_reader(ct_fd, self._ct_ready)
        loop.add_reader(self.log_sock.fileno(), self._read, self.log_sock, self._on_log, "log")
        sweeper = None
        if self.recording is not None:
            loop.call_later(RECORDED_INTERVAL, self._drain_recorded)
        if self.recording is not None or self.leftovers is not None:
            sweeper = asyncio.ensure_future(self._sweep_loop())
        if self._leftover_records:  # what the programs' ring held when they were told not to record
            records, self._leftover_records = self._leftover_records, []
            self._on_recorded(records, self.clock())
        try:
            await asyncio.Event().wait()
        finally:
            if sweeper is not None:
                sweeper.cancel()
            self._loop = None
            if ct_fd is not None:
                loop.remove_reader(ct_fd)
            if self.log_sock is not None:
                loop.remove_reader(self.log_sock.fileno())

    # ------------------------------------------------------------------ connections the pod programs record

    def _drain_recorded(self) -> None:
        """Starts and ends the programs wrote since the last look (every ``RECORDED_INTERVAL``)."""
        loop, rec = self._loop, self.recording
        if loop is None or rec is None:
            return
        try:
            take = getattr(rec, "recorded_batch", None)
            if take is None:  # one that gives a list of records
                items = rec.recorded()
                if items:
                    self._on_recorded(items, self.clock())
            else:
                blob, count, others, addresses = take()
                self.malformed += others  # not the programs' (an older object's ring): counted, left out
                if count:
                    self._take_batch(blob, count, addresses, self.clock())
                else:  # the pods' changes read as they come, not only when records do
                    self._begin_names()
            self.note_resets(rec.reset_hints())
            if self._resets:
                ended = self.end_resets()
                if ended:
                    self._on_recorded(ended, self.clock())
        finally:
            loop.call_later(RECORDED_INTERVAL, self._drain_recorded)

    def note_resets(self, hints: list[tuple[bytes, int]]) -> None:
        """Connections a RST passed (``hints``: key, CLOCK_TAI ns of the RST), to be looked at
        ``RESET_TIMEOUT_NS`` after it (:meth:`end_resets`) -- so a reset's end comes about then,
        not when a sweep finds it (up to ``SWEEP_INTERVAL`` more).  Past ``RESETS_MAX`` waiting,
        a hint is left out: the sweep ends that one."""
        due_of, heap = self._reset_due, self._resets
        for key, tai in hints:
            due = tai + RESET_TIMEOUT_NS + 1
            if due_of.get(key, -1) >= due or (key not in due_of and len(due_of) >= RESETS_MAX):
                continue
            due_of[key] = due
            heapq.heappush(heap, (due, key))

    def end_resets(self, now_tai: int | None = None) -> list[bytes]:
        """The ends of connections a RST passed whose time to be looked at came: the sweep's
        judgement of one entry (:meth:`sweep`) -- ended as reset if it is still in a RESET state
        and its last packet ``RESET_TIMEOUT_NS`` ago, taken only if it is still the one looked at
        (:meth:`_take`, so that neither the programs nor a sweep running at the same time end it
        too: whoever takes the entry out ends it, once); looked at again at its last packet's
        time and ``RESET_TIMEOUT_NS`` if a RST came since (sent again); let go if it is open
        again (that end sent without RST: its TCP ignored the RST), gone (ended by the programs:
        a new SYN; or by a sweep) or another state.  A packet that changes the entry between
        the look and the take (the take finds it changed: put back) has it looked at again as it
        is then: still reset (a RST sent again, the other end's packet), ``RESET_TIMEOUT_NS``
        after that packet, as a RST sent again before the look is -- not left to the sweep.
        Returns the ends, laid out as the ring gives them."""
        rec = self.recording
        if rec is None:
            return []
        now = tai_now() if now_tai is None else now_tai
        due_of, heap = self._reset_due, self._resets
        out: list[bytes] = []
        failed: OSError | None = None

        def later(key: bytes, raw: bytes | None) -> None:
            """``key`` looked at again ``RESET_TIMEOUT_NS`` after its last packet if its entry
            (``raw``, as just read) is in a RESET state -- after this call's ``now`` in any case."""
            if raw is None:
                return
            v = CONN_VALUE.unpack(raw)
            if v[6] in (CONN_RESET_LO, CONN_RESET_HI):
                due_of[key] = max(v[5] + RESET_TIMEOUT_NS, now) + 1
                heapq.heappush(heap, (due_of[key], key))

        while heap and heap[0][0] <= now:
            due, key = heapq.heappop(heap)
            if due_of.get(key) != due:
                continue  # to be looked at later (a later hint)
            del due_of[key]
            # One key's trouble (a map operation failing) leaves that one to the sweep; what was
            # taken before it is returned all the same (it is out of the map).
            try:
                raw = rec.recorded_entry(key)
                if raw is None:
                    continue
                v = CONN_VALUE.unpack(raw)
                if v[6] not in (CONN_RESET_LO, CONN_RESET_HI):
                    continue
                if now - v[5] <= RESET_TIMEOUT_NS:  # a RST again since
                    later(key, raw)
                    continue
                taken = self._take(rec, key, v, out)
                if taken is None:
                    # Gone (the programs or a sweep ended it; or here, not put back), or changed
                    # by a packet since the look (put back if it was taken): as it is now.
                    later(key, rec.recorded_entry(key))
            except OSError as err:
                failed = err
                continue
            if taken is not None:
                out.append(CONN_RECORD.pack(key, REC_RST, taken))
                self.swept += 1
        if failed is not None:
            log.warning("flows: ending reset connections, some were left for the sweep: %s", failed)
        return out

    def _on_recorded(self, raws: list[bytes], now: float) -> None:
        """Records as the ring gives them, one each (the sweep's ends, a ring read the long way)."""
        size = CONN_RECORD.size
        good = [raw for raw in raws if len(raw) == size]
        self.malformed += len(raws) - len(good)  # not the programs' (an older object's ring): counted, left out
        if good:
            self._take_batch(b"".join(good), len(good), {raw[i : i + 4] for raw in good for i in (0, 4)}, now)

    def _take_batch(self, blob: bytes, count: int, addresses: set[bytes], now: float) -> None:
        """``count`` records side by side in ``blob``, into the ring as they came, as one
        :class:`RecordedBatch`: their keys' ``addresses`` named as they are now -- but an end's
        as they were when its connection started (:meth:`_ends_named_then`): it may come long
        after (the sweep ends an idle or flushed connection 10 to 65 s after its last packet),
        when its pod is deleted or its address another pod's.  Looked at one by one only where
        one of ``addresses`` changed hands while recording, else taken in whole."""
        self._begin_names()
        names, name, unknown = self._names, self._name, _UNKNOWN
        named: dict[bytes, Identity | None] = {}
        for a in addresses:
            ident = names.get(a, unknown)
            named[a] = name(a) if ident is unknown else ident  # type: ignore[assignment]
        history = self._history
        ends = self._ends_named_then(blob, count, named) if history and not history.keys().isdisjoint(addresses) else None
        self.events += count
        self.ring.extend_batch(RecordedBatch(self.node, blob, count, named, self.tai_offset(), now, ends))

    def _ends_named_then(self, blob: bytes, count: int,
                         named: dict[bytes, Identity | None]) -> dict[int, tuple[Identity | None, Identity | None]] | None:
        """The ends among ``count`` records whose ends were named otherwise when their
        connection started (its SYN's time, CLOCK_TAI ns, in every record), by index."""
        history, then, get = self._history, self._named_then, named.get
        ends: dict[int, tuple[Identity | None, Identity | None]] = {}
        for i, (key, kind, first) in enumerate(_KEY_KIND_FIRST.iter_unpack(blob[: count * CONN_RECORD.size])):
            if kind == REC_START:
                continue
            lo, hi = key[0:4], key[4:8]
            if lo in history or hi in history:
                now = (get(lo), get(hi))
                ids = (then(lo, first, now[0]), then(hi, first, now[1]))
                if ids != now:
                    ends[i] = ids
        return ends or None

    async def _sweep_loop(self) -> None:
        while True:
            if self.leftovers is not None and not self.leftovers.held:  # every one ended
                self.leftovers = None
            if self.recording is None and self.leftovers is None:
                return
            await asyncio.sleep(SWEEP_INTERVAL)
            try:
                ended = await asyncio.to_thread(self.sweep)
            except (OSError, nl.NetlinkError) as err:
                log.warning("flows: looking over the recorded connections: %s", err)
                continue
            except Exception:  # a bug, not the kernel: the next sweep goes on all the same
                # (no one awaits this task: ended, no idle or flushed connection would ever end)
                log.exception("flows: looking over the recorded connections failed; the next look is in %s s",
                              SWEEP_INTERVAL)
                continue
            if ended:
                self._on_recorded(ended, self.clock())
            with contextlib.suppress(OSError):
                self.lost["programs"] = self.recording.recorded_lost() if self.recording is not None else 0

    def sweep(self, now_tai: int | None = None) -> list[bytes]:
        """Connections the programs hold that ended without telling (blocking): an unanswered
        SYN after ``SYN_TIMEOUT_NS`` goes without a record (no start was recorded: it was
        never forwarded, or denied on the way); both FINs seen and nothing for
        ``CLOSING_TIMEOUT_NS`` (the last ACK went another way, or was lost): ended; a RST
        seen and its end silent since (podpath.c keeps the entry: a RST out of the receiver's
        window does not end the connection) for ``RESET_TIMEOUT_NS``: ended, reset; idle for
        ``IDLE_NS`` and no longer held by conntrack (timed out, flushed: a pod deleted): ended,
        when found so -- one that conntrack was found holding is asked about again
        ``HELD_RECHECK_NS`` later, not at every sweep.  An entry is taken only if it is still
        the one judged (the tuple may have been reused meanwhile: a new SYN's entry is left
        where it is -- but for one made between that look and the take, which is taken out
        for that moment and put back: :meth:`_take`).  A key whose look-up fails is left
        for the next sweep.  The same of what the programs held when
        they were told not to record (:attr:`leftovers`).  Returns the ends, laid out as the
        ring gives them."""
        sources = [rec for rec in (self.recording, self.leftovers) if rec is not None]
        if not sources:
            return []
        now = tai_now() if now_tai is None else now_tai
        out: list[bytes] = []
        held_at = self._held_at
        keys: set[bytes] = set()
        failed: Exception | None = None
        for rec in sources:
            conns = rec.recorded_open()
            keys.update(key for key, _raw in conns)
            failed = self._sweep_of(rec, conns, now, out) or failed
        if failed is not None:  # once a sweep: the next one tries those keys again
            log.warning("flows: looking over the recorded connections, some were left for the next look: %s", failed)
        if held_at:  # those the programs no longer hold are forgotten
            self._held_at = {key: seen for key, seen in held_at.items() if key in keys}
        return out

    def _sweep_of(self, rec: Recording | Leftovers, conns: list[tuple[bytes, bytes]], now: int,
                  out: list[bytes]) -> Exception | None:
        """:meth:`sweep` of the connections ``rec`` holds (``conns``): their ends into ``out``;
        the last trouble of a key left for the next sweep, if any."""
        held_at = self._held_at
        failed: Exception | None = None
        for key, raw in conns:
            # One key's trouble (a conntrack look-up or a map operation failing) skips that key
            # alone: what was taken before it is returned all the same (it is out of the map).
            try:
                v = CONN_VALUE.unpack(raw)
                state, idle = v[6], now - v[5]
                if state == CONN_SYN:
                    if idle > SYN_TIMEOUT_NS:
                        self._take(rec, key, v, out)
                    continue
                if state == CONN_CLOSING and idle > CLOSING_TIMEOUT_NS:
                    kind = REC_FIN
                elif state in (CONN_RESET_LO, CONN_RESET_HI) and idle > RESET_TIMEOUT_NS:
                    kind = REC_RST
                elif idle > IDLE_NS:
                    if self._still_held(key, v[4], now):
                        if type(rec) is Leftovers:
                            rec.held_on.add(key)
                        continue
                    kind = REC_GONE_UNCOUNTED if type(rec) is Leftovers and key in rec.held_on else REC_GONE
                else:
                    continue
                taken = self._take(rec, key, v, out)
            except (OSError, ValueError) as err:  # ValueError: nl.NetlinkDecodeError, an answer malformed
                failed = err
                continue
            if taken is not None:
                held_at.pop(key, None)
                out.append(CONN_RECORD.pack(key, kind, taken))
                self.swept += 1
        return failed

    def _take(self, rec: Recording | Leftovers, key: bytes, judged: tuple[int, ...], out: list[bytes]) -> bytes | None:
        """``key``'s entry out of the programs' map if it is still the one the sweep judged
        (``judged``: its value then, unpacked) -- the same SYN's, in the same state, with the same
        last packet --, else None.  It is looked at first and taken only if it still is (a
        reused tuple's new SYN taken out even for a moment would miss its answer, and its
        connection -- conntrack's events masked at its SYN -- be recorded by nobody); one that
        changed between that look and the take is put back (:meth:`_put_back`)."""
        now_raw = rec.recorded_entry(key)
        if now_raw is None or CONN_VALUE.unpack(now_raw)[4:7] != judged[4:7]:
            return None
        taken = rec.take_recorded(key)
        if taken is None:
            return None
        v = CONN_VALUE.unpack(taken)
        if v[4:7] != judged[4:7]:
            self._put_back(rec, key, taken, v, out)
            return None
        return taken

    def _put_back(self, rec: Recording | Leftovers, key: bytes, taken: bytes, v: tuple[int, ...], out: list[bytes]) -> None:
        """A connection taken that was not the one judged, back into the programs' map.  Where
        it cannot go back -- the programs made a new SYN's entry of the tuple since (which
        stays), or the map is full (the programs took the freed slot) -- it is ended here
        rather than lost silently: a connection past its SYN gets its end (REUSED: ended by the
        new SYN, at its last packet; GONE: when found), an unanswered SYN is counted as lost
        (its connection is recorded by nobody)."""
        try:
            if rec.put_recorded(key, taken):
                return
            kind, why = REC_REUSED, "its tuple was reused meanwhile"
        except OSError as err:
            kind, why = REC_GONE, str(err)
        # Its _held_at entry is left alone: end_resets runs this on the loop's thread while a
        # sweep's thread may be rebuilding that dict; the next sweep forgets what the programs
        # no longer hold, and one remembered for a connection of another SYN is not taken for it.
        peer = f"{socket.inet_ntoa(key[0:4])}:{int.from_bytes(key[8:10], 'big')} " \
               f"{socket.inet_ntoa(key[4:8])}:{int.from_bytes(key[10:12], 'big')}"
        if v[6] == CONN_SYN:
            self.not_put_back["lost"] += 1
            log.warning("flows: the recorded connection %s could not be put back (%s): not recorded", peer, why)
            return
        self.not_put_back["ended"] += 1
        log.warning("flows: the recorded connection %s could not be put back (%s): ended now", peer, why)
        out.append(CONN_RECORD.pack(key, kind, taken))

    def _still_held(self, key: bytes, first: int, now: int) -> bool:
        """Whether conntrack holds an idle recorded connection (``first``: its SYN's time): asked
        once every ``HELD_RECHECK_NS`` while it does."""
        seen = self._held_at.get(key)
        if seen is not None and seen[0] == first and now - seen[1] < HELD_RECHECK_NS:
            return True
        if self._held(key):
            self._held_at[key] = (first, now)
            return True
        self._held_at.pop(key, None)
        return False

    def _held(self, key: bytes) -> bool:
        if self._get_sock is None:
            self._get_sock = NetlinkSocket(rcvbuf=1 << 16, sndbuf=1 << 16, protocol=nl.NETLINK_NETFILTER)
        t = ct.CtTuple(socket.inet_ntoa(key[0:4]), socket.inet_ntoa(key[4:8]), TCP,
                       int.from_bytes(key[8:10], "big"), int.from_bytes(key[10:12], "big"))
        # A sequence number of its own per look-up: a late answer to one that timed out is
        # skipped (NetlinkSocket.request matches by it), not taken for this one's.
        self._get_seq = self._get_seq % 0xFFFFFFFF + 1
        return ct.holds(self._get_sock, t, seq=self._get_seq)

    # ------------------------------------------------------------------ reading conntrack events

    def _ct_ready(self) -> None:
        """Events are queued: read them in a moment, with those that come meanwhile."""
        if self._loop is None or self.ct_sock is None:
            return
        self._loop.remove_reader(self.ct_sock.fileno())
        self._loop.call_later(CT_INTERVAL, self._drain_conntrack)

    def _drain_conntrack(self) -> None:
        sock, loop = self.ct_sock, self._loop
        if sock is None or loop is None:
            return
        if self.fast and isinstance(sock, NetlinkSocket):
            self._drain_fast(sock, loop)
            return
        batch: list[bytes] = []
        emptied: float | None = None  # the clock before the last, empty recv: None, the budget ran out
        try:
            while len(batch) < CT_BUDGET:
                at = self.clock()
                try:
                    got = sock.recv_many()
                except OSError as err:
                    if err.errno == errno.ENOBUFS:  # the kernel dropped events for us: counted below
                        continue
                    raise
                if not got:
                    emptied = at
                    break
                batch += got
            self._count_ct_drops()
            # After the reads: the fast path's news then holds whatever came before these events.
            self._begin()
            self._on_conntrack_items(self._decode(batch), self.clock(), emptied, full=emptied is None)
        finally:
            if len(batch) >= CT_BUDGET:
                loop.call_soon(self._drain_conntrack)
            else:
                loop.add_reader(sock.fileno(), self._ct_ready)

    def _drain_fast(self, sock: NetlinkSocket, loop: asyncio.AbstractEventLoop) -> None:
        """:meth:`_drain_conntrack` with the socket read and its events looked at in C
        (agentd/kernel/_ctevents.c): names forgotten first if the pods changed (they are
        asked as the events are read), the fast path's news once the events are in hand."""
        n = 0
        try:
            self._begin_names()
            assert ct.fast_events is not None
            items, n, _overruns = ct.fast_events.drain(sock.fileno(), CT_BUDGET, self._names, self._name,
                                                       self.prefixes, self.carried is not None)
            # Its last system call found the socket empty, a moment ago (the clock before it is
            # C's): unless the budget ran out first, leaving events unread.
            emptied = self.clock() if n < CT_BUDGET else None
            if self._own_packed and not self.filtered:  # the kernel's filter leaves these out
                items = self._without_own(items)
            self._count_ct_drops()
            self._begin_carried()
            self._on_conntrack_items(items, self.clock(), emptied, full=emptied is None)
        finally:
            if n >= CT_BUDGET:
                loop.call_soon(self._drain_conntrack)
            else:
                loop.add_reader(sock.fileno(), self._ct_ready)

    def _count_ct_drops(self) -> None:
        """Conntrack events lost: what the kernel dropped at this socket (its sk_drops, one per
        event it could not queue), not how often it said ENOBUFS -- it says so once per
        overrun, which may have lost thousands."""
        sock = getattr(self.ct_sock, "sock", None)
        if not isinstance(sock, socket.socket):
            return
        try:
            drops = socket_drops(sock)
        except OSError:
            return
        self.lost["conntrack"] = max(self.lost["conntrack"], self._ct_lost_before + drops)

    def _begin(self) -> None:
        """Once the events of a read are in hand, before they are looked at: the fast path's
        counts of reused tuples (:meth:`_begin_carried`) and names forgotten if the pods
        changed since the last read (:meth:`_begin_names`)."""
        self._begin_carried()
        self._begin_names()

    def _begin_carried(self) -> None:
        """The fast path's counts of reused tuples: a SYN that reused a tuple passed the
        program before conntrack ended the old entry and sent its DESTROY, so the counts of
        every end in hand are in the ring by now."""
        if self.carried is not None:
            self._take_restarts()
            self._tai_offset = self.tai_offset()

    def _begin_names(self) -> None:
        """Names forgotten if the pods changed since the last read (an address may be someone
        else now)."""
        version = self.directory.version()
        if version != self._names_version or len(self._names) > NAMES_MAX:
            if version != self._names_version:
                self._note_named_before()
            self._names.clear()
            self._names_version = version

    def _note_named_before(self) -> None:
        """The addresses that became someone else's or nobody's since the last look, with whom
        they named until each change, and when (:attr:`_history`: the policy engine's time of
        the change, else this look's); changes older than HISTORY_AGE_NS forgotten."""
        count, got = self.directory.named_before(self._named_seen)
        first = self._named_seen is None
        self._named_seen = count
        offset = self.tai_offset()
        now = int(self.clock() * 1e9) + offset
        history = self._history
        if history and now - self._history_pruned > HISTORY_AGE_NS // 10:
            self._history_pruned = now
            for address in [a for a, changes in history.items() if now - changes[-1][0] > HISTORY_AGE_NS]:
                del history[address]
            for changes in history.values():
                while now - changes[0][0] > HISTORY_AGE_NS:
                    del changes[0]
        if first or not got:
            if got is None:
                log.warning("flows: more pods changed between two reads than the policy engine keeps; "
                            "ends of connections started before may name who has an address now")
            return
        by_ip: dict[str, list[tuple[int, Identity]]] = {}
        for ip, ident, when in got:
            by_ip.setdefault(ip, []).append((now if when is None else int(when * 1e9) + offset, ident))
        identity = self.directory.identity
        for ip, seen in by_ip.items():
            # Each change kept whose ``before`` differs from what the address named after it
            # (the next change's ``before``, or whom it names now): not a change of something
            # else of the pod, nor one undone.
            after = [s[1] for s in seen[1:]] + [identity(ip)]
            kept = [s for s, then in zip(seen, after) if s[1] != then]
            if not kept:
                continue
            try:
                address = socket.inet_pton(socket.AF_INET6 if ":" in ip else socket.AF_INET, ip)
            except OSError:
                continue
            changes = history.get(address)
            if changes is None:
                if len(history) >= HISTORY_MAX:
                    del history[next(iter(history))]
                changes = history[address] = []
            changes.extend(kept)
            del changes[:-HISTORY_PER_ADDRESS]

    def _named_then(self, address: bytes, started: int, named: Identity | None) -> Identity | None:
        """Whom ``address`` named when a connection started at ``started`` (CLOCK_TAI ns),
        ``named`` as it is named now: who had it until the first change after the start.  An
        address nobody had at the start is named as now (a new pod's first connections may
        come before its record)."""
        for at, ident in self._history.get(address, ()):
            if started < at:
                return ident
        return named

    def _decode(self, batch: list[bytes]) -> list[Event | bytes]:
        """A read's datagrams as :data:`Event` s, in C where it is built, else
        :meth:`_decode_here`."""
        if self.fast and ct.fast_events is not None:
            items = ct.fast_events.decode(batch, self._names, self._name, self.prefixes, self.carried is not None)
            return self._without_own(items) if self._own_packed else items
        return self._decode_here(batch)

    def _without_own(self, items: list[Event | bytes]) -> list[Event | bytes]:
        """C's events but those whose only addresses in the ranges are the node's own
        (:attr:`own`; C knows the ranges, not these): where the kernel's filter is not
        attached, or events not read from the socket."""
        out: list[Event | bytes] = []
        for item in items:
            if type(item) is not bytes and item[2] is None and item[3] is None and item[4] is None:  # type: ignore[index]
                data, mtype = item[0], item[1]  # type: ignore[index]
                fields = ct.ipv4_tuples(mtype, data, nl.NLMSG_HDRLEN, len(data))
                if fields is not None and not self._in_ranges(fields[0], fields[1], fields[5]):
                    continue
            out.append(item)
        return out

    def _decode_here(self, batch: list[bytes]) -> list[Event | bytes]:
        """What agentd/kernel/_ctevents.c does, in Python: each datagram of one IPv4 event laid
        out as the kernel lays them out read at fixed offsets and its ends named (the node's
        own left out); any other datagram as it is, for :meth:`_on_conntrack_long`."""
        out: list[Event | bytes] = []
        names, name, counting, hdr = self._names, self._name, self.carried is not None, nl.NLMSG_HDRLEN
        for data in batch:
            if len(data) < hdr + nl.NFGENMSG_LEN:
                out.append(data)
                continue
            mlen, mtype = _NLMSG.unpack_from(data)
            fields = ct.ipv4_tuples(mtype, data, hdr, mlen) if mlen == len(data) else None
            if fields is None:
                out.append(data)
                continue
            # What follows the tuples (52 bytes each, ICMP's 60) framed and sized as decode_event
            # reads it, else the long way, which counts it malformed now.
            if not ct.rest_ok(data, hdr + nl.NFGENMSG_LEN + 2 * _TUPLE_LEN.unpack_from(data, hdr + nl.NFGENMSG_LEN)[0], mlen):
                out.append(data)
                continue
            src, dst, proto, sport, dport, reply_src, _reply_sport = fields
            n_src, n_dst, n_reply = names.get(src, _UNKNOWN), names.get(dst, _UNKNOWN), names.get(reply_src, _UNKNOWN)
            if n_src is _UNKNOWN:
                n_src = name(src)
            if n_dst is _UNKNOWN:
                n_dst = name(dst)
            if n_reply is _UNKNOWN:
                n_reply = name(reply_src)
            if n_src is None and n_dst is None and n_reply is None and not self._in_ranges(src, dst, reply_src):
                continue  # the node's own traffic (etcd, BGP, its bridge's IGMP reports)
            carry, start = None, 0
            if mtype == ct.MSG_DELETE and proto == TCP and counting and n_src and n_dst:
                try:
                    carry = (*carried_key(src, sport, dst, dport), *ct.lifetime(data, hdr, mlen))
                except nl.NetlinkDecodeError:  # malformed: the long way, which counts it
                    out.append(data)
                    continue
                start = carry[2]
            elif mtype == ct.MSG_DELETE:  # its start, for the Services then (_services_of)
                try:
                    start = ct.lifetime(data, hdr, mlen)[0]
                except nl.NetlinkDecodeError:  # not known: its record is made the long way
                    start = 0
            out.append((data, mtype, n_src, n_dst, n_reply, carry, start))  # type: ignore[arg-type]
        return out

    def _on_conntrack_datagrams(self, batch: list[bytes], now: float) -> None:
        """A read's datagrams, into the ring in the order they came."""
        self._on_conntrack_items(self._decode(batch), now)

    def _on_conntrack_items(self, items: list[Event | bytes], now: float, emptied: float | None = None,
                            *, full: bool = False) -> None:
        """A read's events (:meth:`_decode`), into the ring in the order they came: the common
        kind as :class:`PendingConnection` s in one loop -- with what the fast path carried
        of an ended one -- the rest the long way.  ``emptied``: the clock before the read's
        last recv, which found the socket empty (else ``now``); ``full``: the read stopped at
        CT_BUDGET, events left in the socket -- those of connections started before its clock
        among them, read under whatever Services come next, so it is no boundary of the
        Services it read under (:attr:`_ct_read_at`)."""
        entries: list[Entry] = []
        carried = self._carried
        services = self.directory.service_names()
        past = self._services_past
        if services is not self._services_then:  # the Services synced: the waiting let go of the old ones
            if self._services_then is not None and self._ct_read_at is not None:
                past.append((int(self._ct_read_at * 1e9), self._services_then))
                if len(past) > SERVICES_HISTORY:
                    self._services_forgot = past.popleft()[0]
            self._settle_services()
            self._services_then = services
        elif self._settling:
            self._settle_step()
        if not full:  # every connection started by then had its new read by now
            self._ct_read_at = now if emptied is None else emptied
        while past and now * 1e9 - past[0][0] > HISTORY_AGE_NS:
            self._services_forgot = past.popleft()[0]
        timeouts = self.ct_timeouts() if self.ct_timeouts is not None else None
        if timeouts is not None:  # one dict while they stay the same, however often read
            if timeouts == self._timeouts_then:
                timeouts = self._timeouts_then
            else:
                self._timeouts_then = timeouts
        history, delete = self._history, ct.MSG_DELETE
        for item in items:
            if type(item) is bytes:
                if entries:
                    self._extend(entries)
                    entries = []
                self._on_conntrack_long(item)
                continue
            named_by = services
            if item[1] == delete:  # type: ignore[index]
                if history:
                    item = self._ct_named_then(item)  # type: ignore[arg-type]
                if past:
                    named_by = self._services_of(item, services)  # type: ignore[arg-type]
            carry = item[5]  # type: ignore[index]
            entries.append(PendingConnection(self, item, carried(*carry) if carry else None, now,  # type: ignore[arg-type]
                                             named_by, timeouts))
        if entries:
            self._extend(entries)

    def _services_of(self, item: Event,
                     services: Callable[[str, int, int], str | None]) -> Callable[[str, int, int], str | None]:
        """The Services a DESTROY read at fixed offsets (:meth:`_decode`) is named by: as they
        were when its entry was made (CTA_TIMESTAMP_START, which the decoder read:
        :meth:`_services_at`), else ``services`` (now; an entry made before timestamps were on
        too)."""
        return self._services_at(item[6]) or services

    def _services_at(self, start: int) -> Callable[[str, int, int], str | None] | None:
        """The Services as they were when a connection started at ``start`` (CLOCK_REALTIME
        ns; 0: not known) if they changed since: the first snapshot before the current one
        last seen current then or after -- its ``new`` record, read by then, was named by it --
        else None (as now; a start before what is kept too: not known)."""
        if not start or start <= self._services_forgot:
            return None
        for until, names in self._services_past:
            if start <= until:
                return names
        return None

    def _ct_named_then(self, item: Event) -> Event:
        """A DESTROY read at fixed offsets (:meth:`_decode`), its ends named as they were when
        its entry was made (CTA_TIMESTAMP_START; an entry made before timestamps were on is
        named as now) if one of its addresses changed hands while recording."""
        data, mtype = item[0], item[1]
        fields = ct.ipv4_tuples(mtype, data, nl.NLMSG_HDRLEN, len(data))
        if fields is None:
            return item
        src, dst, reply_src, history = fields[0], fields[1], fields[5], self._history
        if src not in history and dst not in history and reply_src not in history:
            return item
        start = item[6]  # CTA_TIMESTAMP_START, as the decoder read it
        if not start:
            return item
        start += self.tai_offset()
        then = self._named_then
        names = (then(src, start, item[2]), then(dst, start, item[3]), then(reply_src, start, item[4]))  # type: ignore[misc]
        return item if names == item[2:5] else self._named_at_start(item, names)  # type: ignore[arg-type]

    def _named_at_start(self, item: Event, names: tuple[Identity | None, Identity | None, Identity | None]) -> Event:
        """A DESTROY read at fixed offsets (:meth:`_decode`) with its ends named as they were
        when its entry was made, and what the fast path carried asked for if those are two
        pods (its ends may have gone unnamed since)."""
        data, mtype, _s, _d, _r, carry, start = item
        if carry is None and self.carried is not None and names[0] and names[1]:
            fields = ct.ipv4_tuples(mtype, data, nl.NLMSG_HDRLEN, len(data))
            if fields is not None and fields[2] == TCP:
                src, dst, _proto, sport, dport = fields[:5]
                with contextlib.suppress(nl.NetlinkDecodeError):
                    carry = (*carried_key(src, sport, dst, dport), *ct.lifetime(data, nl.NLMSG_HDRLEN, len(data)))
        return (data, mtype, *names, carry, start)

    def _extend(self, entries: list[Entry]) -> None:
        self.events += len(entries)
        self.ring.extend(entries)
        # Kept (the reads since the last sync, as many as the ring holds) for the next sync to
        # settle (:meth:`_settle_services`): one append a read, nothing an event.
        reads = self._unsettled
        reads.append(entries)
        self._unsettled_count += len(entries)
        while self._unsettled_count - len(reads[0]) >= self.ring.size:  # the oldest left the ring
            self._unsettled_count -= len(reads.popleft())

    def _settle_services(self) -> None:
        """The Services synced (a new snapshot, :meth:`Directory.service_names`): each event
        still waiting in the ring unread names its Service as the snapshot it holds does, and
        holds that name (or None) instead -- a snapshot (a dict of every Service port) is kept
        alive only while it is the current one (and settling; and for ends, one of the
        ``SERVICES_HISTORY`` before it: :meth:`_services_at`), not by every event read under
        it.  Up to the ring's size of them (a million): ``SETTLE_STEP`` now, the rest a step
        at each turn of the loop (:meth:`_settle_step`); one read meanwhile makes its record
        as the snapshot it holds names it, as settled."""
        reads = self._settling
        reads.extend(self._unsettled)
        self._settling_count += self._unsettled_count
        self._unsettled = deque()
        self._unsettled_count = 0
        while reads and self._settling_count - len(reads[0]) >= self.ring.size:  # those out of the ring: none to settle
            self._settling_count -= len(reads.popleft())
            self._settling_from = 0
        self._settle_step()

    def _settle_step(self) -> None:
        """``SETTLE_STEP`` of the events waiting to be settled, oldest first; a next step asked
        of the loop while some are left (where there is none, the next read takes it)."""
        reads, budget, pending = self._settling, SETTLE_STEP, PendingConnection
        while reads and budget > 0:
            entries, first = reads[0], self._settling_from
            last = min(len(entries), first + budget)
            for i in range(first, last):
                entry = entries[i]
                if type(entry) is pending:
                    entry.settle()  # type: ignore[union-attr]
            budget -= last - first
            if last < len(entries):
                self._settling_from = last
            else:
                reads.popleft()
                self._settling_count -= len(entries)
                self._settling_from = 0
        if reads and not self._settle_due and self._loop is not None:
            self._settle_due = True
            self._loop.call_soon(self._settle_next)

    def _settle_next(self) -> None:
        self._settle_due = False
        self._settle_step()

    def _on_conntrack_datagram(self, data: bytes, now: float) -> None:
        """One datagram of conntrack events, whatever its layout."""
        self._on_conntrack_items(self._decode([data]), now)

    def _on_conntrack_long(self, data: bytes) -> None:
        """A datagram not read at fixed offsets (IPv6, laid out otherwise, more than one
        message, malformed): every message of it, decoded whole; what is malformed counted."""
        try:
            for mtype, _flags, _seq, _pid, start, end in nl.iter_messages(data):
                try:
                    self._on_conntrack(mtype, data, start, end)
                # skipped: the rest are read (ValueError: nl.NetlinkDecodeError; OSError: an
                # address inet_pton refuses, should one come that decode_event let through)
                except (ValueError, OSError, struct.error) as err:
                    self.malformed += 1
                    log.debug("flows: malformed conntrack message: %s", err)
        except nl.NetlinkDecodeError as err:  # the framing: the rest of the datagram cannot be found
            self.malformed += 1
            log.debug("flows: malformed conntrack datagram: %s", err)

    def _name(self, address: bytes) -> Identity | None:
        """Who a 4-byte address is: the directory's answer, remembered until the pods change."""
        try:
            return self._names[address]
        except KeyError:
            ident = self._names[address] = self.directory.identity(socket.inet_ntoa(address))
            return ident

    def _in_ranges(self, *addresses: bytes) -> bool:
        """Whether any of these IPv4 addresses is in the pods' or the Services' ranges and not
        the node's own (:attr:`own`)."""
        own = self._own_packed
        for address in addresses:
            if address in own:
                continue
            value = int.from_bytes(address, "big")
            if any(value & mask == net for net, mask in self.prefixes):
                return True
        return False

    # ------------------------------------------------------------------ what the fast path carried

    def _take_restarts(self) -> None:
        """Counts of connections whose tuple a new connection took: they wait for their end,
        whole (nothing more of that connection is carried after its tuple's next SYN)."""
        assert self.carried is not None
        for key, counts in self.carried.carried_restarts():
            self._wait(key, counts, True)

    def _wait(self, key: bytes, counts: Counts, whole: bool) -> None:
        waiting = self._restarts.get(key)
        if waiting is None:
            if len(self._restarts) >= RESTARTS_MAX:
                del self._restarts[next(iter(self._restarts))]
            waiting = self._restarts[key] = deque()
        waiting.append((*counts, whole))

    def _ct_names(self, ev: ct.CtEvent) -> tuple[Identity | None, Identity | None, Identity | None]:
        """A decoded event's original source, destination and reply source named as they are
        now -- a DESTROY's as they were when its entry was made (:meth:`_named_then`), where
        its start is known."""
        d = self.directory
        o, r = ev.orig, ev.reply
        names = (d.identity(o.src), d.identity(o.dst), d.identity(r.src))
        history = self._history
        if not (ev.destroyed and history and ev.start_ns):
            return names
        start, then = ev.start_ns + self.tai_offset(), self._named_then
        packed = [socket.inet_pton(socket.AF_INET6 if ":" in a else socket.AF_INET, a) for a in (o.src, o.dst, r.src)]
        return (then(packed[0], start, names[0]), then(packed[1], start, names[1]), then(packed[2], start, names[2]))

    def _carried_of(self, ev: ct.CtEvent, names: tuple[Identity | None, ...] | None = None) -> tuple[int, int, int, int] | None:
        """:meth:`_carried` of a decoded event (IPv6's: the fast path counts them in a map of
        their own, keyed alike with 16-byte addresses) if it ended a TCP connection between pods
        (``names``: its ends as named, else as they are now)."""
        o = ev.orig
        if not ev.destroyed or o.proto != TCP or self.carried is None:
            return None
        d = self.directory
        src_id, dst_id = (names[0], names[1]) if names is not None else (d.identity(o.src), d.identity(o.dst))
        if src_id is None or dst_id is None:
            return None
        family = socket.AF_INET6 if ":" in o.src else socket.AF_INET
        src, dst = socket.inet_pton(family, o.src), socket.inet_pton(family, o.dst)
        return self._carried(*carried_key(src, o.sport, dst, o.dport), ev.start_ns, ev.stop_ns)

    def _carried(self, key: bytes, src_lower: bool, born: int, died: int) -> tuple[int, int, int, int] | None:
        """What the fast path carried of a connection that ended (its :func:`carried_key`,
        whether its original source is the lower end, conntrack's start and stop stamps
        ``born`` and ``died``, real-time ns, 0 if it kept none): (packets, bytes) of its
        original direction, then of its reply direction.

        Its counts are those whose first packet was carried while it lived: a SYN that reused
        the tuple moved them to the ring (read by :meth:`_begin` before this end is looked at),
        or they are still in the map -- or both: a retransmitted SYN-ACK (the client's packets
        lost a while) moves them to the ring too, in the middle of the connection, and what is
        carried after it is in the map; so the map is asked whatever the ring gave.  Counts
        first carried after its stop are a later connection's -- a short one before it,
        answered and reset, may end with the next one's counts already in the map -- and wait
        in the agent for that one's end (taken in one step, the map then holds what is carried
        of it afterwards: its end adds both); counts first carried before its start are an
        earlier connection's whose end went by."""
        assert self.carried is not None
        waiting = self._restarts.pop(key, None)
        counts: list[int] | None = None
        if not died:  # no stamps (made before they were turned on): in the order they came
            taken = waiting.popleft() if waiting else self.carried.take_carried(key)
            if taken is not None:
                counts = list(taken[:4])
            if waiting:
                self._restarts[key] = waiting
        else:
            lo, hi = born + self._tai_offset, died + self._tai_offset  # as CLOCK_TAI
            mine: list[tuple[int, ...]] = []
            if waiting:
                for c in waiting:
                    if c[4] >= hi:
                        self._wait(key, c[:5], c[5])  # type: ignore[arg-type]
                    elif c[4] >= lo:
                        mine.append(c)
            taken = self.carried.take_carried(key)
            if taken is not None and taken[4] >= hi:  # the tuple's next connection's
                self._wait(key, taken, False)
            elif taken is not None and taken[4] >= lo:
                mine.append(taken)
            if len(mine) == 1:  # the common case: one connection's counts, moved or taken
                counts = list(mine[0][:4])
            elif mine:
                counts = [sum(c[i] for c in mine) for i in range(4)]
        if counts is None:
            return None
        p_lo, p_hi, b_lo, b_hi = counts
        return (p_lo, b_lo, p_hi, b_hi) if src_lower else (p_hi, b_hi, p_lo, b_lo)

    # ------------------------------------------------------------------ reading drop logs

    def _read(self, sock: NetlinkSocket, handle: Callable[[int, bytes, int, int], None], what: str) -> None:
        for _ in range(BUDGET):
            try:
                data = sock.recv()
            except OSError as err:
                # The kernel dropped messages for us: the packets' sequence numbers show the gap
                # (_on_log counts each lost packet there; counting this too would count twice).
                if err.errno == errno.ENOBUFS:
                    continue
                raise
            if data is None:
                return
            # One message the agent cannot read is counted and skipped: the kernel batches
            # many in a datagram (NFLOG up to its qthresh), and those after it are read.
            try:
                for mtype, _flags, _seq, _pid, start, end in nl.iter_messages(data):
                    try:
                        handle(mtype, data, start, end)
                    except nl.NetlinkDecodeError as err:
                        self.malformed += 1
                        log.debug("flows: malformed %s message: %s", what, err)
            except nl.NetlinkDecodeError as err:  # the framing: the rest of the datagram cannot be found
                self.malformed += 1
                log.debug("flows: malformed %s datagram: %s", what, err)

    def _on_conntrack(self, mtype: int, buf: bytes, start: int, end: int) -> None:
        event = ct.decode_event(mtype, buf, start, end)
        if event is not None:
            self.events += 1
            names = self._ct_names(event)
            services = self._services_at(event.start_ns) if event.destroyed and self._services_past else None
            flow = self.connection(event, names=names, carried=self._carried_of(event, names), services=services)
            if flow is not None:
                flow.received = self.clock()  # when taken in: what ``since`` orders the ring by
                self.ring.add(flow)

    def _on_log(self, mtype: int, buf: bytes, start: int, end: int) -> None:
        if mtype != nflog.MSG_PACKET:
            return
        try:
            packet = nflog.decode_packet(buf, start, end, headerless=True)
        except nl.NetlinkDecodeError:
            # Counted malformed (by _read), not lost: its number, if it can be read, is passed.
            self._log_numbered(nflog.packet_seq(buf, start, end))
            raise
        assert packet is not None
        if not packet.read and self.directory.drop(packet.prefix) is None:
            # A payload the agent does not read, of a prefix it does not know: heard of all the
            # same.  One of its own drops (a frame of another EtherType with a MAC not the pod's,
            # a QinQ frame) is recorded without addresses: its reason, sender and EtherType.
            self._log_numbered(packet.seq)
            return
        self.events += 1
        if packet.ct_malformed:  # recorded all the same, without the Service its conntrack entry would name
            self.malformed += 1
        self._log_numbered(packet.seq)
        flow = self.dropped(packet)
        if flow is not None:
            flow.received = self.clock()  # when taken in (its time is the kernel's: read late, older)
            self.ring.add(flow)

    def _log_numbered(self, seq: int | None) -> None:
        """A logged packet's NFULA_SEQ: the numbers skipped since the last one are packets the
        kernel could not send the agent (lost["log"])."""
        if seq is None:
            return
        if self._log_seq is not None and seq > self._log_seq + 1:
            self.lost["log"] += seq - self._log_seq - 1
        self._log_seq = seq

    # ------------------------------------------------------------------ records (pure given the directory)

    def connection(self, ev: ct.CtEvent, *, names: tuple[Identity | None, Identity | None, Identity | None] | None = None,
                   carried: tuple[int, int, int, int] | None = None, received: float | None = None,
                   services: Callable[[str, int, int], str | None] | None = None,
                   timeouts: dict[str, int] | None = None, service: str | None | object = _UNKNOWN) -> Flow | None:
        """A conntrack event as a record; None if no end of it is a pod or a Service.
        ``names``: its ends as named when it came (original source, destination, reply source);
        ``carried``: what the pod fast path carried of it (packets, bytes each way);
        ``received``: when it came; ``services``: the Services then (Directory.service_names),
        else as they are now; ``service``: the Service's name already looked up there (a
        :class:`PendingConnection` settled); ``timeouts``: conntrack's then, else as they are now."""
        orig, reply = ev.orig, ev.reply
        d = self.directory
        if names is None:
            names = (d.identity(orig.src), d.identity(orig.dst), d.identity(reply.src))
        src_id = names[0]
        if ev.status & ct.IPS_DST_NAT:  # a Service: the endpoint is where the replies come from
            dst = Peer(reply.src, reply.sport, names[2])
            if service is _UNKNOWN:
                service = (services or d.service)(orig.dst, orig.proto, orig.dport)
        else:
            dst = Peer(orig.dst, orig.dport, names[1])
            service = None
        # A Service's node port to an endpoint outside the pod network is no pod's either (as the
        # kernel's filter judges IPv4: the same for both families).
        if (src_id is None and dst.identity is None and received is None
                and not self._ours(orig.src, orig.dst, reply.src)):  # fmt: skip
            return None  # the node's own traffic (etcd, BGP, its bridge's IGMP reports): not a pod's
        stop = ev.stop_ns
        if ev.destroyed:
            if timeouts is None and self.ct_timeouts is not None:
                timeouts = self.ct_timeouts()
            if timeouts is not None:
                stop = ct_last_packet_ns(ev, timeouts)  # its last packet, not its expiry
        when = (stop if ev.destroyed else ev.event_ns or ev.start_ns) / 1e9 or received or self.clock()
        flow = Flow(
            time=when, node=self.node, event="end" if ev.destroyed else "new", protocol=protocol_name(orig.proto),
            src=Peer(orig.src, orig.sport, src_id), dst=dst, direction=direction_of(src_id, dst.identity),
            service=service, received=received,  # type: ignore[arg-type]
        )  # fmt: skip
        if ev.status & ct.IPS_DST_NAT:
            flow.service_ip, flow.service_port = orig.dst, orig.dport
            if service is None:
                flow.service_unnamed = self._services_address(orig.dst, orig.proto, orig.dport)
        if ev.destroyed:
            # A direction conntrack did not count (the entry made before accounting was turned
            # on) is unknown, whatever the fast path carried of it.
            op, ob, rp, rb = ev.orig_packets, ev.orig_bytes, ev.reply_packets, ev.reply_bytes
            if carried is not None:
                if op is not None and ob is not None:
                    op, ob = op + carried[0], ob + carried[1]
                if rp is not None and rb is not None:
                    rp, rb = rp + carried[2], rb + carried[3]
            flow.bytes_sent, flow.bytes_received = ob, rb
            flow.packets_sent, flow.packets_received = op, rp
            if ev.start_ns and stop:
                flow.duration = max(0.0, (stop - ev.start_ns) / 1e9)
        return flow

    def _services_address(self, ip: str, proto: int, port: int) -> bool:
        """Whether a translated destination no Service is known of is one a Service could have
        had: in the Services' ranges (a cluster IP), or one a snapshot of the Services kept
        knew (a node port) -- not another translation's (portmap's hostPort to a node address)."""
        try:
            address = ip_address(ip)
        except ValueError:
            return False
        if any(address in n for n in self.service_networks):
            return True
        snapshots = [names for _until, names in self._services_past]
        if self._services_then is not None:
            snapshots.append(self._services_then)
        return any(names(ip, proto, port) is not None for names in snapshots)

    def _ours(self, *addresses: str) -> bool:
        """Whether any of these addresses is in the pods' or the Services' ranges and not the
        node's own (:attr:`own`): a pod's connection, named or not yet."""
        for text in addresses:
            try:
                address = ip_address(text)
            except ValueError:
                continue
            if address in self.own:
                continue
            if any(address in n for n in self.networks):
                return True
        return False

    def dropped(self, p: nflog.Packet) -> Flow | None:
        """A logged packet as a drop record; None when the agent's limit folds it.

        The limit is judged at the drop's time as the kernel stamped it (NFULA_TIMESTAMP): a
        backlog the agent reads late (a busy loop, a full read budget) holds drops that were
        spread out, and reading them in one go must not fold them as one burst.  Without a
        timestamp, the time the agent read it."""
        meaning = self.directory.drop(p.prefix)
        reason = meaning.reason if meaning is not None else "unknown"
        if reason == "no-route" and p.proto in ICMP_ERRORS:
            # The ICMP error the node sent for a Service's connection whose endpoint it has no
            # route for (agentd/policy/compiler.py, base_objects): the record is of the dropped
            # packet, as its conntrack entry tells it -- the pod, the endpoint, the Service --
            # or, where NFLOG gives no entries, as the error quotes it (the endpoint, no Service).
            if p.dnat is not None:
                orig, reply = p.dnat
                p = p._replace(src=orig.src, sport=orig.sport, dst=reply.src, dport=reply.sport, proto=orig.proto)
            elif p.quoted is not None:
                src, dst, proto, sport, dport = p.quoted
                p = p._replace(src=src, sport=sport, dst=dst, dport=dport, proto=proto)
        elif reason == "spoofed-nd" and p.claimed is not None:
            # As a spoofed ARP's: the address the advertisement claims is what it pretends to
            # be (its source is the pod's own link-local address; the sender is named below).
            p = p._replace(src=p.claimed)
        now = p.time or self.clock()
        # A drop naming its sender (spoofed*, ra-guard, ...) is folded only with the same
        # sender's: two pods claiming one address to one destination are two records.
        sender = p.port if reason in SENDER_REASONS else 0
        folded = self.limiter.allow((p.prefix, p.src, p.dst, p.proto, p.dport, sender), now)
        d = self.directory
        src_id, dst_id = d.identity(p.src), d.identity(p.dst)
        direction = meaning.direction if meaning is not None and meaning.direction else direction_of(src_id, dst_id)
        if folded is None:  # counted now, as a recorded one is when it is taken in (_count)
            self.drops[(reason, direction)] += 1
            return None
        # The Service: refused, the packet's own destination; dropped after it was translated
        # (NetworkPolicy at the endpoint), its conntrack entry's original one.
        if reason in ("no-endpoints", "no-local-endpoints", "no-service-port", "no-service"):
            service_at: tuple[str, int] | None = (p.dst, p.dport)
        else:
            service_at = p.orig_dst
        service = d.service(service_at[0], p.proto, service_at[1]) if service_at is not None else None
        flow = Flow(
            time=now, node=self.node, event="drop", protocol=protocol_name(p.proto) if p.read else ethertype_name(p.proto),
            src=Peer(p.src, p.sport, src_id), dst=Peer(p.dst, p.dport, dst_id), direction=direction,
            verdict="dropped", reason=reason, suppressed=folded, service=service,
        )  # fmt: skip
        if service is not None and service_at is not None:
            flow.service_ip, flow.service_port = service_at
        if meaning is not None:
            flow.policies, flow.default_deny = tuple(meaning.policies), meaning.default_deny
        if reason in SENDER_REASONS and p.port:
            # The source address names whom the packet pretends to be; the veth it came in
            # on names who sent it.
            on = d.pod_on(p.port)
            if on is not None:
                flow.sender_interface, flow.sender = on
        return flow

    def _count_batch(self, batch: Batch) -> None:
        self.flows["forwarded"] += batch.count

    def _count(self, entries: list[Entry]) -> None:
        made = [e for e in entries if type(e) is Flow]  # the rest: connections not read yet
        flows = self.flows
        if len(made) != len(entries):
            flows["forwarded"] += len(entries) - len(made)
        for flow in made:
            flows[flow.verdict] += 1
            if flow.verdict == "dropped":
                self.drops[(flow.reason or "unknown", flow.direction)] += 1  # folded ones: when folded (dropped)


# ------------------------------------------------------------------ conntrack's settings


SO_MEMINFO = 55  # <asm-generic/socket.h>: u32[SK_MEMINFO_VARS]
SK_MEMINFO_DROPS = 8


def socket_drops(sock: socket.socket) -> int:
    """What the kernel dropped at ``sock`` for want of room (its sk_drops: a netlink socket
    counts each message it could not queue, ENOBUFS or not)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 4 * (SK_MEMINFO_DROPS + 1))
    if len(raw) < 4 * (SK_MEMINFO_DROPS + 1):
        return 0
    return struct.unpack_from("=I", raw, 4 * SK_MEMINFO_DROPS)[0]


def enable_sysctls(state_dir: Path) -> None:
    """Set the conntrack sysctls flow records need to 1, noting the values found first (once:
    a restarted agent finds its own values and must not note those)."""
    state = state_dir / SYSCTL_STATE
    found = {name: int((SYSCTL_DIR / name).read_text().split()[0]) for name in SYSCTLS}
    if not state.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps(found) + "\n")
        os.replace(tmp, state)
    for name, value in found.items():
        if value != 1:
            (SYSCTL_DIR / name).write_text("1\n")


def restore_sysctls(state_dir: str | os.PathLike) -> list[str]:
    """Put the conntrack sysctls back as :func:`enable_sysctls` found them (``agentd leave``);
    idempotent.  Returns what was put back.  A value that cannot be written (a read-only
    /proc/sys, a sysctl that refuses it) raises OSError (one line) and keeps the state file,
    the only record of the operator's values: the next leave tries again."""
    state = Path(state_dir) / SYSCTL_STATE
    try:
        before = json.loads(state.read_text())
    except (OSError, ValueError):
        return []
    restored, failed = [], []
    for name in SYSCTLS:
        value = before.get(name)
        if isinstance(value, int) and value != 1:
            try:
                (SYSCTL_DIR / name).write_text(f"{value}\n")
            except OSError as err:
                failed.append(f"net.netfilter.{name} = {value} ({err.strerror or err})")
            else:
                restored.append(f"net.netfilter.{name} = {value}")
    if failed:
        raise OSError(f"could not put back {', '.join(failed)} (noted in {state}; "
                      f"put back {', '.join(restored) or 'nothing else'})")
    with contextlib.suppress(OSError):
        state.unlink()
    return restored
