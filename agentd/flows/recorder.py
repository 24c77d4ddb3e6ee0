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
* **drops**: the drop rules of the policy and services tables log to one NFLOG group
  (``agentd.kernel.netlink_log``) with a prefix that names the rule; the
  :class:`Directory` says what the prefix means (the pod chain and direction -> the
  policies isolating the pod; ``spoofed``; ``no-endpoints``).

Rate limits: the kernel logs at most ``rate`` drops a second per drop rule (nft ``limit``; what
it holds back is counted in each table's ``flow-log-suppressed`` counter), the agent keeps at
most ``agent_rate`` records a second per drop key (:class:`~agentd.flows.ring.DropLimiter`),
and reads at most ``BUDGET`` datagrams per socket per turn of the event loop.  The sockets'
receive buffers are bounded; what the kernel could not queue is counted as lost (ENOBUFS,
gaps in NFLOG's sequence numbers).  So memory stays bounded under a drop storm: the ring, the
limiter's key table and two socket buffers.

Records go into a :class:`~agentd.flows.ring.FlowRing` (bounded) that ``GET /flows`` reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from agentd.kernel import netlink as nl
from agentd.kernel import netlink_ct as ct
from agentd.kernel import netlink_log as nflog
from agentd.kernel.netlink_socket import NetlinkSocket

from .model import Flow, Identity, Peer, direction_of, protocol_name
from .ring import DropLimiter, FlowRing

log = logging.getLogger("agentd.flows")

SYSCTL_DIR = Path("/proc/sys/net/netfilter")
SYSCTLS = ("nf_conntrack_acct", "nf_conntrack_timestamp")
SYSCTL_STATE = "flows-sysctl.json"
BUDGET = 64  # datagrams read per socket per turn of the loop: the rest waits for the next turn
COPY_RANGE = 128  # bytes of each logged packet: its IP and transport headers
LOG_TIMEOUT_CS = 10  # the kernel sends logged packets within 0.1 s ...
LOG_QTHRESH = 64  # ... or once this many are queued


class Drop(Protocol):
    """What a drop rule's prefix means (the directory's answer)."""

    reason: str
    direction: str | None  # "ingress" / "egress" of the pod that denied it; None: from the packet
    policies: tuple[str, ...]
    default_deny: bool


class Directory(Protocol):
    """Who an address is and what a drop prefix means (the daemon's policy and services agents)."""

    def identity(self, ip: str) -> Identity | None: ...

    def service(self, ip: str, proto: int, port: int) -> str | None: ...

    def drop(self, prefix: str) -> Drop | None: ...


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
    ) -> None:
        self.node = node
        self.directory = directory
        self.state_dir = Path(state_dir)
        self.group = group
        self.clock = clock
        self.ring = FlowRing(ring_size, self._count)
        self.limiter = DropLimiter(agent_rate, agent_burst)
        self.ct_sock: NetlinkSocket | None = None
        self.log_sock: NetlinkSocket | None = None
        self.flows: Counter[str] = Counter()  # records by verdict
        self.drops: Counter[tuple[str, str]] = Counter()  # drop records by (reason, direction)
        self.lost: Counter[str] = Counter()  # events the kernel could not queue for us: conntrack, log
        self.malformed = 0
        self.events = 0
        self._log_seq: int | None = None
        self.error: str | None = None

    # ------------------------------------------------------------------ lifecycle (blocking)

    def open(self) -> None:
        """Turn on conntrack's accounting and timestamps (noting what was there), join the
        conntrack event groups and bind the drop log group.  Raises OSError (one line)."""
        enable_sysctls(self.state_dir)
        sock = NetlinkSocket(rcvbuf=8 << 20, sndbuf=1 << 16, protocol=nl.NETLINK_NETFILTER)
        try:
            for group in (ct.NFNLGRP_CONNTRACK_NEW, ct.NFNLGRP_CONNTRACK_DESTROY):
                sock.sock.setsockopt(nl.SOL_NETLINK, nl.NETLINK_ADD_MEMBERSHIP, group)
        except OSError:
            sock.close()
            raise
        self.ct_sock = sock
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
            sock.request(nflog.encode_settings(self.group, 2, copy_range=COPY_RANGE, timeout_cs=LOG_TIMEOUT_CS,
                                               qthresh=LOG_QTHRESH), what="configuring NFLOG", dump=False)
        except OSError:
            sock.close()
            self.close()
            raise
        self.log_sock = sock

    def close(self) -> None:
        for sock in (self.ct_sock, self.log_sock):
            if sock is not None:
                sock.close()
        self.ct_sock = self.log_sock = None

    async def run(self) -> None:
        """The supervised task: read both sockets as they become readable."""
        if self.ct_sock is None:
            await asyncio.to_thread(self.open)
        assert self.ct_sock is not None and self.log_sock is not None
        loop = asyncio.get_running_loop()
        loop.add_reader(self.ct_sock.fileno(), self._read, self.ct_sock, self._on_conntrack, "conntrack")
        loop.add_reader(self.log_sock.fileno(), self._read, self.log_sock, self._on_log, "log")
        try:
            await asyncio.Event().wait()
        finally:
            for sock in (self.ct_sock, self.log_sock):
                if sock is not None:
                    loop.remove_reader(sock.fileno())

    # ------------------------------------------------------------------ reading

    def _read(self, sock: NetlinkSocket, handle: Callable[[int, bytes, int, int], None], what: str) -> None:
        for _ in range(BUDGET):
            try:
                data = sock.recv()
            except OSError as err:
                if err.errno == errno.ENOBUFS:  # the kernel dropped messages for us
                    self.lost[what] += 1
                    continue
                raise
            if data is None:
                return
            try:
                for mtype, _flags, _seq, _pid, start, end in nl.iter_messages(data):
                    handle(mtype, data, start, end)
            except nl.NetlinkDecodeError as err:
                self.malformed += 1
                log.debug("flows: malformed %s message: %s", what, err)

    def _on_conntrack(self, mtype: int, buf: bytes, start: int, end: int) -> None:
        event = ct.decode_event(mtype, buf, start, end)
        if event is not None:
            self.events += 1
            flow = self.connection(event)
            if flow is not None:
                self.ring.add(flow)

    def _on_log(self, mtype: int, buf: bytes, start: int, end: int) -> None:
        if mtype != nflog.MSG_PACKET:
            return
        packet = nflog.decode_packet(buf, start, end)
        if packet is None:
            return
        self.events += 1
        if packet.seq is not None:
            if self._log_seq is not None and packet.seq > self._log_seq + 1:
                self.lost["log"] += packet.seq - self._log_seq - 1
            self._log_seq = packet.seq
        flow = self.dropped(packet)
        if flow is not None:
            self.ring.add(flow)

    # ------------------------------------------------------------------ records (pure given the directory)

    def connection(self, ev: ct.CtEvent) -> Flow | None:
        """A conntrack event as a record; None if no end of it is a pod or a Service."""
        orig, reply = ev.orig, ev.reply
        d = self.directory
        src_id = d.identity(orig.src)
        service = None
        if ev.status & ct.IPS_DST_NAT:  # a Service: the endpoint is where the replies come from
            dst = Peer(reply.src, reply.sport, d.identity(reply.src))
            service = d.service(orig.dst, orig.proto, orig.dport)
        else:
            dst = Peer(orig.dst, orig.dport, d.identity(orig.dst))
        if src_id is None and dst.identity is None and service is None:
            return None  # the node's own traffic (etcd, BGP): not a pod's
        now = self.clock()
        flow = Flow(
            time=(ev.stop_ns if ev.destroyed else ev.start_ns) / 1e9 or now,
            node=self.node, event="end" if ev.destroyed else "new", protocol=protocol_name(orig.proto),
            src=Peer(orig.src, orig.sport, src_id), dst=dst, direction=direction_of(src_id, dst.identity),
            service=service,
        )  # fmt: skip
        if ev.status & ct.IPS_DST_NAT:
            flow.service_ip, flow.service_port = orig.dst, orig.dport
        if ev.destroyed:
            flow.bytes_sent, flow.bytes_received = ev.orig_bytes, ev.reply_bytes
            flow.packets_sent, flow.packets_received = ev.orig_packets, ev.reply_packets
            if ev.start_ns and ev.stop_ns:
                flow.duration = max(0.0, (ev.stop_ns - ev.start_ns) / 1e9)
        return flow

    def dropped(self, p: nflog.Packet) -> Flow | None:
        """A logged packet as a drop record; None when the agent's limit folds it."""
        meaning = self.directory.drop(p.prefix)
        reason = meaning.reason if meaning is not None else "unknown"
        now = self.clock()
        folded = self.limiter.allow((p.prefix, p.src, p.dst, p.proto, p.dport), now)
        if folded is None:
            return None
        d = self.directory
        src_id, dst_id = d.identity(p.src), d.identity(p.dst)
        service = d.service(p.dst, p.proto, p.dport) if reason in ("no-endpoints", "no-local-endpoints") else None
        direction = meaning.direction if meaning is not None and meaning.direction else direction_of(src_id, dst_id)
        flow = Flow(
            time=p.time or now, node=self.node, event="drop", protocol=protocol_name(p.proto),
            src=Peer(p.src, p.sport, src_id), dst=Peer(p.dst, p.dport, dst_id), direction=direction,
            verdict="dropped", reason=reason, suppressed=folded, service=service,
        )  # fmt: skip
        if service is not None:
            flow.service_ip, flow.service_port = p.dst, p.dport
        if meaning is not None:
            flow.policies, flow.default_deny = tuple(meaning.policies), meaning.default_deny
        return flow

    def _count(self, flow: Flow) -> None:
        self.flows[flow.verdict] += 1
        if flow.verdict == "dropped":
            self.drops[(flow.reason or "unknown", flow.direction)] += 1 + flow.suppressed


# ------------------------------------------------------------------ conntrack's settings


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
    idempotent.  Returns what was put back."""
    state = Path(state_dir) / SYSCTL_STATE
    try:
        before = json.loads(state.read_text())
    except (OSError, ValueError):
        return []
    restored = []
    for name in SYSCTLS:
        value = before.get(name)
        if isinstance(value, int) and value != 1:
            with contextlib.suppress(OSError):
                (SYSCTL_DIR / name).write_text(f"{value}\n")
                restored.append(f"net.netfilter.{name} = {value}")
    with contextlib.suppress(OSError):
        state.unlink()
    return restored
