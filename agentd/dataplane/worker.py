"""The data-plane worker process: ``python -m agentd.dataplane udp|ipip --tun NAME ...``.

It runs beside the agent (same network namespace), never inside the agent's asyncio loop: a
tight blocking ``poll`` loop over the TUN fd, the underlay socket and a unix control socket.

With offloads and user segmentation (the default) the per-packet loops run in C
(``_fastpath.c`` through ``_fast.FastPath``, whose ``run`` is then the poll loop and returns
only when a control socket needs Python); this module keeps everything else and hands the C
side the next hops and members.  The Python loops (``_transmit``: one class per loop, one
table picks it) do the same work where the C file is not built or ``--fast-path python`` is
given, and are the reference the tests hold C to.

TUN -> underlay: with offloads one read returns a TCP super-packet (up to 64 KB), read
straight into a block of segment slots; the super-packets at hand (up to ``_TSO_BLOCKS``) are
segmented in place by one vectorized pass (``_tso.TsoSegmenter``, numpy) and handed to the
transport in the order they were read, one run each (one UDP GSO message of one sendmmsg, or
part of one IPIP sendmmsg).  Underlay -> TUN: a UDP GRO read or a recvmmsg batch yields many
inner packets; ``_gro.Coalescer`` checks a whole batch with a few numpy calls and merges each
flow's in-order segments into one super-packet per TUN write.  Without offloads it is one read
and one send per packet (flannel's model), kept as a separate, lean loop so the baseline is
honest.

Control protocol (JSON lines over the unix socket; one response line per request):
``{"op": "set_next_hops", "next_hops": {prefix: underlay_ip}, "sources": {prefix: underlay_ip}}``
("sources", optional: the reverse-path table, below; without it the next hops are that table),
``{"op": "set_members", "members": [underlay_ip, ...]}``, ``{"op": "stats"}``, ``{"op": "get"}``,
``{"op": "shutdown", "remove_device": bool}``.  Responses: ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``.  The table survives controller disconnects and is saved to a
state file so that a worker started after one that died (killed, crashed) starts with it.  A
worker that stops cleanly -- a shutdown request, SIGTERM or SIGINT, ``orphan_timeout`` seconds
without a controller -- removes its control socket and its state file: whoever starts the next
one (the agent) brings its table.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ipaddress
import json
import logging
import math
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentd.backend_table import BACKENDS
from agentd.dataplane import _fast
from agentd.dataplane._forward import NextHopTable, parse_members, unicast_ipv4
from agentd.dataplane._gro import Coalescer
from agentd.dataplane._transmit import BUDGET, LOOPS, Transmit
from agentd.dataplane.ipip import IpipTransport
from agentd.dataplane.tun import TunError, check_name, local_source_accepted, open_tun
from agentd.dataplane.udp import UdpTransport
from proto.packet import FLANNEL_UDP_PORT, VNET_HDR_NONE

log = logging.getLogger("agentd.dataplane")

TRANSPORTS = {"udp": UdpTransport, "ipip": IpipTransport}
DEFAULT_DEVICE = {kind: BACKENDS[kind].device for kind in TRANSPORTS}
# flannel's UDP backend decrements the inner TTL (it is a router hop in user space); IPIP
# (like a kernel ipip device) does not.
TTL_DECREMENT = {kind: BACKENDS[kind].ttl_decrement for kind in TRANSPORTS}
# The inner families each carries: udp IPv4 and IPv6 (the payload is the inner packet), ipip IPv4
# (RFC 2003; IPv6 in IPv4 would be another protocol, 41).
FAMILIES = {kind: BACKENDS[kind].inner_families for kind in TRANSPORTS}
# icmp_ratelimited: ICMP errors not sent (over the rate limit; the packet is counted under its own reason).
# spoofed: a member's inner packet whose source does not route back to that member (NextHopTable.source_ok).
DROP_REASONS = ("non_member", "no_route", "ttl_exceeded", "malformed", "mtu", "not_ipv4", "send_error",
                "tun_write_error", "icmp_ratelimited", "spoofed")
COUNTERS = ("tx_packets", "tx_bytes", "tx_syscalls", "rx_packets", "rx_bytes", "rx_syscalls",
            "tun_reads", "tun_writes", "tso_frames", "tso_segments", "tso_batches", "icmp_sent")

_RX_BUF = (1 << 19) + 4096  # 256 IPIP slots of 2 KB (fewer, larger ones on a jumbo-frame underlay; + slack
# for numpy row views), or a 64 KB GRO read


@dataclass(frozen=True)
class WorkerConfig:
    kind: str
    tun: str
    mtu: int
    local_ip: str
    control: str
    port: int = FLANNEL_UDP_PORT
    offload: bool = True
    orphan_timeout: float = 120.0
    state: str | None = None
    icmp_source: str | None = None
    icmp_source_v6: str | None = None
    segmentation: str = "user"
    txqueuelen: int = 1000
    fast_path: str = "c"
    socket_fd: int | None = None  # udp: the agent's socket, bound to local_ip:port (inherited)


class Worker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.started = time.monotonic()
        self.c = dict.fromkeys(COUNTERS, 0)
        self.drops = dict.fromkeys(DROP_REASONS, 0)
        self.table = NextHopTable()
        self.sources = self.table  # the reverse-path table (set_next_hops' "sources")
        self.members: frozenset[str] = frozenset()
        self.ttl_decrement = TTL_DECREMENT[cfg.kind]
        self.state_path = cfg.state or cfg.control + ".state"
        self._stop = False
        self._remove_device = False
        self.state_error: str | None = None  # why the last save of the state file failed, if it did

        user_tso = cfg.offload and cfg.segmentation == "user"
        self.tun = open_tun(cfg.tun, mtu=cfg.mtu, offload=user_tso, txqueuelen=cfg.txqueuelen,
                            no_offload_reason="disabled by --no-offload" if not cfg.offload
                            else "segmentation left to the kernel (--segmentation kernel)")
        try:
            self._set_up(user_tso)
        except BaseException:
            self._abandon()  # leave nothing behind that we made: a failed start has no worker
            raise

    def _set_up(self, user_tso: bool) -> None:
        """Everything after the TUN: what fails here (the socket, the fast path, the control
        socket -- a path too long, a running worker serving it) leaves the TUN to
        :meth:`_abandon`."""
        cfg = self.cfg
        try:
            extra = {}
            if cfg.socket_fd is not None:
                extra["sock"] = socket.socket(fileno=cfg.socket_fd)
            self.transport = TRANSPORTS[cfg.kind](cfg.local_ip, cfg.port, offload=cfg.offload,
                                                  counters=self.c, drops=self.drops, mtu=cfg.mtu, **extra)
        except OSError as exc:
            raise TunError(f"cannot open the {cfg.kind} socket on {cfg.local_ip}: {exc.strerror}") from None
        # ICMP errors: from our underlay address where the kernel accepts a local source on the
        # TUN; otherwise (conf.all.rp_filter on) from the unreachable destination itself, which
        # is routed via the TUN and so passes any reverse-path check.
        if cfg.icmp_source:
            self.icmp_source: str | None = cfg.icmp_source
        elif local_source_accepted(cfg.tun):
            self.icmp_source = cfg.local_ip
        else:
            self.icmp_source = None
            self.fallbacks_icmp = "conf.all.rp_filter is on: ICMP errors use the inner destination as source"
        self.offloads = {**self.tun.offloads, **self.transport.offloads, "tun_coalesce": cfg.offload}
        self.fallbacks = {**self.tun.fallbacks, **self.transport.fallbacks}
        if not cfg.offload:
            self.fallbacks["tun_coalesce"] = "disabled by --no-offload"
        if self.icmp_source is None:
            self.fallbacks["icmp_source"] = self.fallbacks_icmp
        self.fast = self._open_fast_path(user_tso)
        # TUN -> underlay: the C loop, or the Python loop the table picks (agentd.dataplane._transmit).
        loop = Transmit if self.fast is not None else LOOPS[(cfg.offload, cfg.segmentation)]
        self.tx = loop(tun_fd=self.tun.fd, transport=self.transport, mtu=cfg.mtu,
                       ttl_decrement=self.ttl_decrement, icmp_source=self.icmp_source,
                       counters=self.c, drops=self.drops, families=FAMILIES[cfg.kind],
                       icmp_source_v6=cfg.icmp_source_v6)
        # Underlay -> TUN in Python: the receive buffer and the coalescer, only where the C loop does not run.
        # (The transports check the inner family on receive: udp takes IPv4 and IPv6, ipip IPv4.)
        self.coalescer: Coalescer | _SingleWriter | None = None
        self.rxbuf: bytearray | None = None
        if self.fast is None:
            self.rxbuf = bytearray(_RX_BUF)
            self.coalescer = Coalescer(self.tx.tun_write) if cfg.offload else _SingleWriter(self.tx.tun_write)
        self.control = ControlServer(cfg.control, self.handle_request)
        self._load_state()

    def _abandon(self) -> None:
        """Undo a start that failed after the TUN was opened: what was made of the control
        socket, the fast path and the transport is closed, and a TUN device this worker created
        goes (persistent, it would stay with accept_local on and no worker behind it); one that
        was there before (a previous worker's, with the routes through it) stays."""
        for part in ("control", "fast", "transport"):
            obj = getattr(self, part, None)
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()
        if self.tun.created:
            with contextlib.suppress(OSError):
                self.tun.set_persist(False)
        self.tun.close()

    def _open_fast_path(self, user_tso: bool) -> _fast.FastPath | None:
        """The C loops where they can run (offloads on, user segmentation), else None and the
        reason in fallbacks: the Python loops below then do the same work."""
        cfg = self.cfg
        why = ""
        lib = None
        if not cfg.offload:
            why = "disabled by --no-offload"
        elif not user_tso:
            why = "segmentation left to the kernel (--segmentation kernel)"
        elif cfg.fast_path != "c":
            why = f"--fast-path {cfg.fast_path}"
        else:
            lib, why = _fast.load()
        self.offloads["c_fast_path"] = lib is not None
        if lib is None:
            self.fallbacks["c_fast_path"] = why
            return None
        t = self.transport.offloads
        return _fast.FastPath(lib, cfg.kind, tun_fd=self.tun.fd, sock_fd=self.transport.fileno(), mtu=cfg.mtu,
                              ttl_decrement=self.ttl_decrement, port=cfg.port, udp_gso=t.get("udp_gso", False),
                              udp_gro=t.get("udp_gro", False), ipv6=6 in FAMILIES[cfg.kind])

    # -- control ------------------------------------------------------------------------------

    def _load_state(self) -> None:
        try:
            with open(self.state_path) as f:
                state = json.load(f)
            if state.get("kind") != self.cfg.kind:
                return
            self._apply_next_hops(state.get("next_hops") or {}, state.get("sources"), save=False)
            self._apply_members(state.get("members") or [], save=False)
            log.info("restored %d next hops and %d members from %s", len(self.table), len(self.members),
                     self.state_path)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError, TypeError, RecursionError) as exc:
            log.warning("ignoring unreadable state file %s: %s", self.state_path, exc)

    def _save_state(self) -> None:
        """Write the table to the state file.  One that cannot be written (its directory full,
        read-only or gone) does not stop the worker: the table is applied and forwards; the
        failure is kept (``state_error``: the answer's ``warning``, ``fallbacks.state_file`` in
        stats, one log line while it stays the same) -- only a worker started after this one
        dies would start without the table, until the agent gives it the table again."""
        tmp = self.state_path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"kind": self.cfg.kind, "next_hops": self.table.routes, "sources": self.sources.routes,
                           "members": sorted(self.members)}, f)
            os.replace(tmp, self.state_path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            error = f"cannot save the state file {self.state_path}: {exc.strerror or exc}"
            if error != self.state_error:
                log.warning("%s (forwarding with the new table all the same)", error)
            self.state_error = error
            return
        if self.state_error is not None:
            log.info("state file %s saved again", self.state_path)
        self.state_error = None

    def _apply_next_hops(self, routes, sources=None, save: bool = True) -> None:
        """The next hops, and the reverse-path table the receive side checks every inner source
        against (NextHopTable.source_ok): every pod subnet the node routes to a peer node,
        whatever carries it -- a peer this worker sends nothing to (reached by host-gw, say)
        still sends its pods' packets here.  Without ``sources`` (a controller that does not
        give them) the next hops are that table too."""
        if not isinstance(routes, dict):
            raise ValueError("next_hops must be an object {prefix: underlay address}")
        if sources is not None and not isinstance(sources, dict):
            raise ValueError("sources must be an object {prefix: underlay address}")
        table = NextHopTable(routes)
        sources = table if sources is None else NextHopTable(sources)
        self.table, self.sources = table, sources
        self.tx.set_table(table)
        self.transport.set_table(sources)  # the receive side's reverse-path check
        if self.fast is not None:
            self.fast.set_routes(table, sources)
        if save:
            self._save_state()

    def _apply_members(self, members, save: bool = True) -> None:
        if not isinstance(members, list):
            raise ValueError("members must be a list of underlay addresses")
        self.members = parse_members(members, own=self.cfg.local_ip)
        self.transport.set_members(self.members)
        if self.fast is not None:
            self.fast.set_members(self.members)
        if save:
            self._save_state()

    def handle_request(self, req) -> dict:
        if not isinstance(req, dict):
            return {"ok": False, "error": "request must be a JSON object"}
        op = req.get("op")
        try:
            if op == "set_next_hops":
                self._apply_next_hops(req.get("next_hops"), req.get("sources"))
                return self._saved({"ok": True, "next_hops": len(self.table), "sources": len(self.sources)})
            if op == "set_members":
                self._apply_members(req.get("members"))
                return self._saved({"ok": True, "members": len(self.members)})
            if op == "stats":
                return {"ok": True, "stats": self.stats()}
            if op == "get":
                return {"ok": True, "config": self.describe(), "next_hops": self.table.routes,
                        "sources": self.sources.routes,
                        "members": sorted(self.members)}
            if op == "shutdown":
                self._stop = True
                self._remove_device = bool(req.get("remove_device", False))
                return {"ok": True}
        except ValueError as exc:
            return {"ok": False, "error": str(exc)}
        except RecursionError:  # (a value nested too deep to show in the error)
            return {"ok": False, "error": f"{op!r}: a value nested too deeply"}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _saved(self, resp: dict) -> dict:
        """A change's answer: applied (forwarding uses it), with a warning where the state file
        could not be saved -- not an error, which the agent would answer by reconnecting and
        asking again, to the same full disk."""
        if self.state_error is not None:
            resp["warning"] = self.state_error
        return resp

    def describe(self) -> dict:
        cfg = self.cfg
        return {"kind": cfg.kind, "tun": cfg.tun, "mtu": cfg.mtu, "local_ip": cfg.local_ip, "port": cfg.port,
                "icmp_source": self.icmp_source or "inner-destination",
                "icmp_source_v6": cfg.icmp_source_v6 or "inner-destination",
                "families": list(FAMILIES[cfg.kind]),
                "offload": cfg.offload, "segmentation": cfg.segmentation if cfg.offload else "none",
                "fast_path": "c" if self.fast is not None else "python",
                "pid": os.getpid(), "orphan_timeout": cfg.orphan_timeout,
                "socket": "inherited" if cfg.socket_fd is not None else "own"}

    def stats(self) -> dict:
        c = {**self.c, "coalesced_segments": getattr(self.coalescer, "merged", 0),
             "coalesced_batches": getattr(self.coalescer, "batches", 0),
             "rx_csum_errors": getattr(self.coalescer, "csum_errors", 0)}
        drops = dict(self.drops)
        offloads = dict(self.offloads, **self.transport.offloads)
        fallbacks = dict(self.fallbacks, **self.transport.fallbacks)
        if self.state_error is not None:
            fallbacks["state_file"] = self.state_error
        if self.fast is not None:  # the C loops count on their side
            for name, value in self.fast.counters().items():
                if name.startswith("drop:"):
                    drops[name[5:]] += value
                else:
                    c[name] += value
            if not self.fast.udp_gso and offloads.get("udp_gso"):
                offloads["udp_gso"] = False
                fallbacks["udp_gso"] = f"UDP_SEGMENT send failed: {os.strerror(self.fast.gso_failed_errno)}"
        return {
            **self.describe(),
            "uptime": round(time.monotonic() - self.started, 3),
            "next_hops": len(self.table),
            "sources": len(self.sources),
            "members": len(self.members),
            "controllers": len(self.control.clients),
            **c,
            "tso_gathered": self.tx.segmenter.gathered if self.tx.segmenter is not None else 0,
            "drops": drops,
            "offloads": offloads,
            "fallbacks": fallbacks,
        }

    # -- forwarding ---------------------------------------------------------------------------

    def _run_fast(self) -> None:
        """Packets move in C until the control sockets need Python (or 0.5 s passed, for the
        orphan check and signals); a packet handed back needs an ICMP error to the TUN."""
        rc = self.fast.run(self.control.fds(), 500)
        if rc == 1:
            kind, pkt = self.fast.slow_packet()
            # The C loop rate-limits what it hands back (its ICMP error token bucket).
            if kind == _fast.SLOW_FRAG_NEEDED:
                self.tx.send_too_big(memoryview(pkt), self.fast.slow_peer())
            else:
                self.tx.send_icmp("no_route" if kind == _fast.SLOW_NET_UNREACHABLE else "ttl_exceeded",
                                  memoryview(pkt))
        elif rc < 0:
            _raise_errno()

    # -- main loop ----------------------------------------------------------------------------

    def run(self) -> int:
        self.poller = poller = select.poll()
        tun_fd, sock_fd = self.tun.fd, self.transport.fileno()
        fast = self.fast
        if fast is None:  # else the C loop polls these two
            poller.register(tun_fd, select.POLLIN)
            poller.register(sock_fd, select.POLLIN)
        self.control.attach(poller)
        receive, rxbuf, coalescer = self.transport.receive, self.rxbuf, self.coalescer
        from_tun = self.tx.from_tun  # None with the C loop: it polls the TUN and the socket
        log.info("%s worker on %s (mtu %d, local %s, offload %s) ready; control %s", self.cfg.kind,
                 self.cfg.tun, self.cfg.mtu, self.cfg.local_ip, self.cfg.offload, self.cfg.control)
        clean = False
        try:
            while not self._stop:
                if fast is not None:
                    self._run_fast()
                for fd, _ev in poller.poll(0 if fast is not None else 500):
                    if fd == tun_fd:
                        from_tun()
                    elif fd == sock_fd:
                        receive(rxbuf, coalescer, BUDGET)
                    else:
                        self.control.readable(fd)
                since = self.control.orphan_since
                if since is not None and self.cfg.orphan_timeout > 0:
                    if time.monotonic() - since > self.cfg.orphan_timeout:
                        log.warning("no controller for %.0f s: exiting", self.cfg.orphan_timeout)
                        break
            clean = True
        finally:
            self.close(keep_state=not clean)  # an error: the next worker starts from the table
        return 0

    def stop(self) -> None:
        self._stop = True

    def close(self, *, keep_state: bool = False) -> None:
        """Release everything; the state file goes too unless ``keep_state`` (the worker is
        going down on an error, not stopping)."""
        self.control.close()
        self.transport.close()
        if self.fast is not None:
            self.fast.close()
        if self._remove_device:
            with contextlib.suppress(OSError):
                self.tun.set_persist(False)
        if self._remove_device or not keep_state:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.state_path)
        self.tun.close()


class ControlServer:
    """The worker's unix control socket: JSON lines in, one response line per request (the
    protocol in this module's docstring, answered by ``handle``); it notes when the last
    controller left, for the orphan timeout.  Its sockets are polled by the worker's loop
    (or by the C loop, which returns when one is readable)."""

    def __init__(self, path: str, handle: Callable[[dict], dict]) -> None:
        self.path = path
        self.listener = self._listen(path)
        self.clients: dict[int, tuple[socket.socket, bytearray]] = {}
        self.orphan_since: float | None = time.monotonic()  # no controller connected since then
        self._handle = handle
        self._poller: Any = None

    def attach(self, poller: Any) -> None:
        self._poller = poller
        poller.register(self.listener.fileno(), select.POLLIN)

    def fds(self) -> tuple[int, ...]:
        return (self.listener.fileno(), *self.clients)

    def readable(self, fd: int) -> None:
        if fd == self.listener.fileno():
            self._accept()
        elif fd in self.clients:
            self._client_readable(fd)

    def close(self) -> None:
        for fd in list(self.clients):
            self._drop_client(fd)
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    @staticmethod
    def _listen(path: str) -> socket.socket:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # stale socket of a dead worker
            else:
                probe.close()
                raise TunError(f"control socket {path} is served by a running worker")
            finally:
                probe.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(path)
            os.chmod(path, 0o600)
            s.listen(8)
            s.setblocking(False)
        except BaseException:
            s.close()  # (a path too long for AF_UNIX, a directory we may not write to)
            raise
        return s

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        conn.setblocking(True)
        conn.settimeout(2.0)
        self.clients[conn.fileno()] = (conn, bytearray())
        if self._poller is not None:
            self._poller.register(conn.fileno(), select.POLLIN)
        self.orphan_since = None

    def _client_readable(self, fd: int) -> None:
        conn, buf = self.clients[fd]
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._drop_client(fd)
            return
        buf += data
        if len(buf) > 16 << 20:
            self._drop_client(fd)
            return
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            if not line.strip():
                continue
            try:
                req = json.loads(line)
            except ValueError:
                resp = {"ok": False, "error": "request is not valid JSON"}
            except RecursionError:  # json's decoder recurses per level: the worker must outlive it
                resp = {"ok": False, "error": "request is nested too deeply"}
            else:
                resp = self._handle(req)
            try:
                conn.sendall(json.dumps(resp).encode() + b"\n")
            except OSError:
                self._drop_client(fd)
                return

    def _drop_client(self, fd: int) -> None:
        conn, _ = self.clients.pop(fd)
        if self._poller is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._poller.unregister(fd)
        conn.close()
        if not self.clients:
            self.orphan_since = time.monotonic()


def _raise_errno() -> None:
    """A read error in the C loops: raised as the Python loops would raise it."""
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err))


class _SingleWriter:
    """Receive side without coalescing: one TUN write per packet."""

    def __init__(self, write) -> None:
        self.write = write

    def add(self, v) -> None:
        self.write([VNET_HDR_NONE, v])

    def flush(self) -> None:
        pass


# -- command line -----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def _ipv4(value: str) -> str:
    """A unicast IPv4 address: packets are sent from it and to it."""
    try:
        return unicast_ipv4(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ipv6(value: str) -> str:
    """A unicast IPv6 address (the source of ICMPv6 errors)."""
    try:
        addr = ipaddress.IPv6Address(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an IPv6 address: {value!r}") from None
    if addr.is_unspecified or addr.is_multicast or addr.ipv4_mapped is not None:
        raise argparse.ArgumentTypeError(f"not a unicast IPv6 address: {value!r}")
    return str(addr)


def _timeout(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise argparse.ArgumentTypeError(f"not a finite number of seconds >= 0: {value!r}")
    return seconds


def _path(value: str) -> str:
    if not value:
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a port number (1-65535): {value!r}")
    return port


def _fd(value: str) -> int:
    try:
        fd = int(value)
    except ValueError:
        fd = -1
    if fd < 3:
        raise argparse.ArgumentTypeError(f"not an inherited file descriptor (3 or more): {value!r}")
    try:
        os.fstat(fd)
    except OSError:
        raise argparse.ArgumentTypeError(f"file descriptor {fd} is not open") from None
    return fd


def _mtu(value: str) -> int:
    try:
        mtu = int(value)
    except ValueError:
        mtu = 0
    if not 576 <= mtu <= 65000:
        raise argparse.ArgumentTypeError(f"MTU must be 576..65000, not {value!r}")
    return mtu


def _ifname(value: str) -> str:
    try:
        return check_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    p = _Parser(prog="python -m agentd.dataplane", description="agentd user-space data plane worker")
    p.add_argument("kind", choices=sorted(TRANSPORTS), help="udp (flannel wire format) or ipip (RFC 2003)")
    p.add_argument("--tun", type=_ifname, help="TUN device name (default agentd.udp / agentd.ipip)")
    p.add_argument("--mtu", type=_mtu, required=True, help="inner MTU of the TUN device")
    p.add_argument("--local-ip", type=_ipv4, required=True, help="this node's underlay IPv4 address")
    p.add_argument("--port", type=_port, default=FLANNEL_UDP_PORT, help="UDP port (udp only, default 8285)")
    p.add_argument("--control", type=_path, required=True, help="unix socket path of the control channel")
    p.add_argument("--no-offload", action="store_true",
                   help="no TSO/GSO/GRO/mmsg: one read and one send per packet")
    p.add_argument("--orphan-timeout", type=_timeout, default=120.0,
                   help="exit after this many seconds without a controller (0: never)")
    p.add_argument("--segmentation", choices=("user", "kernel"), default="user",
                   help="who cuts TCP super-packets into MTU-sized packets: user (TUN TSO, segmented "
                        "and checksummed here) or kernel (TUN without TSO, read per packet, batched sends)")
    p.add_argument("--fast-path", choices=("c", "python"), default="c",
                   help="who runs the per-packet loops with offloads on: c (agentd/dataplane/_fastpath.c, "
                        "where built) or python (numpy; also the fall-back)")
    p.add_argument("--state", help="state file (default CONTROL.state)")
    p.add_argument("--icmp-source", type=_ipv4, help="source of ICMP errors sent to pods (default --local-ip)")
    p.add_argument("--icmp-source-v6", type=_ipv6,
                   help="source of ICMPv6 errors sent to IPv6 pods (udp; default the unreachable destination)")
    p.add_argument("--socket-fd", type=_fd,
                   help="udp: an inherited UDP socket already bound to --local-ip:--port (the agent's) "
                        "to use instead of binding one")
    a = p.parse_args(argv)
    if a.socket_fd is not None and a.kind != "udp":
        p.error("--socket-fd is for the udp worker only")
    return WorkerConfig(kind=a.kind, tun=a.tun or DEFAULT_DEVICE[a.kind], mtu=a.mtu, local_ip=a.local_ip,
                        port=a.port, control=a.control, offload=not a.no_offload,
                        orphan_timeout=a.orphan_timeout, state=a.state, icmp_source=a.icmp_source,
                        icmp_source_v6=a.icmp_source_v6, segmentation=a.segmentation, fast_path=a.fast_path,
                        socket_fd=a.socket_fd)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="agentd-dataplane[%(process)d] %(levelname)s %(message)s")
    try:
        worker = Worker(cfg)
    except (TunError, OSError) as exc:
        print(f"agentd-dataplane: error: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())
    profile = os.environ.get("AGENTD_DATAPLANE_PROFILE")
    if profile:  # cProfile the forwarding loop; stats land in PROFILE.<kind>.<pid>
        import cProfile

        # CPU time, not wall time: on a shared 2-core machine preemption would otherwise be
        # charged to whatever call was running (AGENTD_DATAPLANE_PROFILE_CLOCK=wall for waits).
        wall = os.environ.get("AGENTD_DATAPLANE_PROFILE_CLOCK") == "wall"
        prof = cProfile.Profile() if wall else cProfile.Profile(time.thread_time)
        try:
            return prof.runcall(worker.run)
        finally:
            prof.dump_stats(f"{profile}.{cfg.kind}.{os.getpid()}")
    return worker.run()
