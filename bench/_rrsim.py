"""The route-reflector client simulator of bench/rr_scale.py: N iBGP clients in one process.

    ip netns exec NS python bench/_rrsim.py CONFIG.json

Runs inside the clients' namespace, where each client has its own address.  Client i
connects from its address to the reflector, opens an iBGP session (OPEN with IPv4 unicast,
Route Refresh and 4-octet AS; hold time from the config), and, when told, announces one /26
(``base + i * 64``) with itself as NEXT_HOP, as a pod-network node does.  Everything it
sends is encoded before the clock starts (bench/_wire.py, independent of the project's codec).

Cheap on purpose, so that it is not what is measured: one thread, non-blocking sockets on
epoll, one reusable receive buffer, and the receive path in C (bench/_rrscan.c): once a
session is Established its socket moves to an epoll set that ``rr_pump`` serves without
returning to Python -- whole messages walked by their lengths, UPDATEs and KEEPALIVEs
counted, each client's held prefixes kept as a bitmap from the NLRI and withdrawn bytes
alone, and a client's completion noted when its count reaches the phase's target.  Python
handles session setup, the sends, and the rare message C leaves to it (OPEN, NOTIFICATION,
ROUTE-REFRESH, anything malformed).  Its own CPU time is in every reply.

Driven over stdin/stdout, one JSON object per line.  It answers ``{"ready": ...}`` at start,
then one reply per command:

    {"cmd": "establish", "in_flight": 8, "timeout": 60}
        connect every client, at most in_flight connections between connect() and
        Established at once (a refused or reset attempt is retried after 1 s, at most 5 times)
    {"cmd": "announce", "timeout": 120, "quiet": 1.0, "quiet_max": 10}
        every client sends its UPDATE (and End-of-RIB); done when every client holds the
        N-1 prefixes of the others; the reply comes once no UPDATE arrived for ``quiet`` s
        after that (at most ``quiet_max`` s), so late duplicates are counted too
    {"cmd": "withdraw", "fraction": 0.1, ...}
        that share of the clients (spread evenly) withdraws its prefix; done when every
        client holds exactly the prefixes still announced, less its own
    {"cmd": "stats"} / {"cmd": "quit"}

A session that ends after Established (NOTIFICATION, reset, close, a malformed message) is
a drop: the phase running ends with status "dropped", and every later reply lists it.
Timestamps are time.monotonic(), the same clock in every process of the machine.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import select
import selectors
import socket
import sys
import time
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import _wire
from bench._rrscan import (
    C_HELD,
    C_KEEPALIVES,
    C_UPDATES,
    COUNTER_NAMES,
    EV_CLOSED,
    EV_MESSAGE,
    N_COUNTERS,
    Scanner,
)

RECV = 256 * 1024
CONNECT_TIMEOUT = 30.0
RETRY_DELAY = 1.0
MAX_RETRIES = 5
TICK = 0.5

IDLE, CONNECTING, OPENSENT, OPENCONFIRM, ESTABLISHED, CLOSED = range(6)
STATE_NAMES = ("Idle", "Connecting", "OpenSent", "OpenConfirm", "Established", "Closed")


def prefix_of(base: int, i: int) -> bytes:
    return _wire.prefix(base + i * 64, 26)


class Client:
    __slots__ = (
        "addr",
        "announce_msg",
        "connect_deadline",
        "cs",
        "fd",
        "hold",
        "idx",
        "ka_at_open",
        "last_rx",
        "leftover",
        "out",
        "pumped",
        "retries",
        "sock",
        "state",
        "t_connect",
        "t_established",
        "t_keepalive",
        "withdraw_msg",
    )

    def __init__(self, idx: int, addr: str, base: int, cs) -> None:
        self.idx = idx
        self.addr = addr
        self.sock: socket.socket | None = None
        self.fd = -1
        self.state = IDLE
        self.out = b""
        self.leftover = b""  # before Established; then cs.leftover (C)
        self.cs = cs  # struct rr_client: counters, target, receive times
        self.hold = 0
        self.ka_at_open = 0
        self.t_connect = 0.0
        self.t_established = 0.0
        self.last_rx = 0.0
        self.retries = 0
        self.connect_deadline = 0.0
        self.t_keepalive = 0.0  # the last KEEPALIVE sent
        self.pumped = False  # the socket is in the C pump's epoll set
        pfx = prefix_of(base, idx)
        # iBGP from a pod-network node: empty AS_PATH, its own NEXT_HOP, LOCAL_PREF (RFC 4271 §5.1.5).
        attrs = _wire.path_attributes(next_hop=addr, local_pref=100)
        self.announce_msg = _wire.update(attrs, pfx)
        self.withdraw_msg = _wire.update(withdrawn=pfx)


class Simulator:
    def __init__(self, cfg: dict) -> None:
        self.rr = (cfg["rr"], int(cfg.get("port", 179)))
        self.asn = int(cfg["asn"])
        self.hold = int(cfg.get("hold", 90))
        self.base = int(cfg["base"])
        self.eor = bool(cfg.get("eor", True))
        addrs = cfg["clients"]
        self.n = len(addrs)
        self.scanner = Scanner(self.n, self.base, cfg.get("scanner_lib"), recv_max=RECV)
        self.st = self.scanner.state
        self.clients = [Client(i, a, self.base, self.scanner.clients[i]) for i, a in enumerate(addrs)]
        self.opens = {c.idx: _wire.open_message(self.asn, self.hold, c.addr) for c in self.clients}
        self.keepalive = _wire.keepalive()
        self.sel = selectors.DefaultSelector()
        self.ep = select.epoll()  # Established sockets, served by the C pump
        self.rview = memoryview(self.scanner.rbuf).cast("B")
        self.raddr = self.scanner.rbuf_address
        self.stdin_buf = b""
        self.quit = False
        self.phase: dict | None = None
        self.drops: list[dict] = []
        self.connect_errors: list[str] = []
        self.other_messages: dict[str, int] = {}
        self.next_ka = float("inf")
        self.announced = [False] * self.n  # which prefixes are announced now

    # ------------------------------------------------------------ output

    @staticmethod
    def reply(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    # ------------------------------------------------------------ the loop

    def run(self) -> None:
        stdin = sys.stdin.fileno()
        os.set_blocking(stdin, False)
        self.sel.register(stdin, selectors.EVENT_READ, "stdin")
        self.sel.register(self.ep.fileno(), selectors.EVENT_READ, "pump")
        self.reply({"ready": True, "clients": self.n, "pid": os.getpid()})
        while not self.quit:
            for key, mask in self.sel.select(TICK):
                c = key.data
                if c == "stdin":
                    self.read_commands(stdin)
                elif c == "pump":
                    self.pump()
                else:
                    if mask & selectors.EVENT_WRITE:
                        self.on_writable(c)
                    if mask & selectors.EVENT_READ and c.sock is not None and not c.pumped:
                        self.on_readable(c)
            self.tick(time.monotonic())
        for c in self.clients:
            self.close(c)

    def read_commands(self, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not data:  # the driver went away: stop, closing every session
            self.quit = True
            return
        self.stdin_buf += data
        while b"\n" in self.stdin_buf:
            line, self.stdin_buf = self.stdin_buf.split(b"\n", 1)
            if line.strip():
                self.command(json.loads(line))

    def command(self, cmd: dict) -> None:
        name = cmd.get("cmd")
        if self.phase is not None:
            self.reply({"status": "error", "detail": f"{name} while {self.phase['name']} runs"})
            return
        if name == "establish":
            self.start_establish(cmd)
        elif name in ("announce", "withdraw"):
            self.start_routes(name, cmd)
        elif name == "stats":
            self.reply(self.stats())
        elif name == "quit":
            self.quit = True
            self.reply({"status": "ok"})
        else:
            self.reply({"status": "error", "detail": f"unknown command {name!r}"})

    # ------------------------------------------------------------ sockets

    def connect(self, c: Client, now: float) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((c.addr, 0))
        err = sock.connect_ex(self.rr)
        c.sock, c.fd, c.state, c.out, c.leftover = sock, sock.fileno(), CONNECTING, b"", b""
        c.t_connect, c.connect_deadline = now, now + CONNECT_TIMEOUT
        if err not in (0, errno.EINPROGRESS):
            self.failed(c, f"connect: {os.strerror(err)}")
            return
        self.sel.register(sock, selectors.EVENT_WRITE, c)

    def close(self, c: Client) -> None:
        if c.sock is not None:
            if c.pumped:
                self.ep.unregister(c.fd)
                self.scanner.fd2idx[c.fd] = -1
                c.pumped = False
            try:
                self.sel.unregister(c.sock)
            except (KeyError, ValueError):
                pass
            c.sock.close()
            c.sock, c.fd = None, -1
        c.state = CLOSED

    def watch(self, c: Client) -> None:
        """Selector interest: reads in Python until Established (then the pump reads), writes
        while output is pending."""
        assert c.sock is not None
        events = (0 if c.pumped else selectors.EVENT_READ) | (selectors.EVENT_WRITE if c.out else 0)
        registered = self.sel.get_map().get(c.fd) is not None
        if events and registered:
            self.sel.modify(c.sock, events, c)
        elif events:
            self.sel.register(c.sock, events, c)
        elif registered:
            self.sel.unregister(c.sock)

    def send(self, c: Client, data: bytes) -> None:
        if c.sock is None:
            return
        if c.out:
            c.out += data
            return
        try:
            sent = c.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as err:
            self.failed(c, f"send: {err.strerror or err}")
            return
        if sent < len(data):
            c.out = data[sent:]
            self.watch(c)

    def on_writable(self, c: Client) -> None:
        sock = c.sock
        assert sock is not None
        if c.state == CONNECTING:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self.failed(c, f"connect: {os.strerror(err)}")
                return
            c.state = OPENSENT
            c.last_rx = time.monotonic()
            self.watch(c)
            self.send(c, self.opens[c.idx])
            return
        if c.out:
            try:
                sent = sock.send(c.out)
            except BlockingIOError:
                return
            except OSError as err:
                self.failed(c, f"send: {err.strerror or err}")
                return
            c.out = c.out[sent:]
        if not c.out:
            self.watch(c)

    def on_readable(self, c: Client) -> None:
        """Before Established: read and scan in Python (with the C scanner)."""
        sock = c.sock
        assert sock is not None
        left = len(c.leftover)
        view = self.rview
        if left:
            view[:left] = c.leftover
        try:
            n = sock.recv_into(view[left : left + RECV])
        except BlockingIOError:
            return
        except OSError as err:
            self.failed(c, f"receive: {err.strerror or err}")
            return
        if n == 0:
            self.failed(c, "connection closed by the reflector")
            return
        c.last_rx = time.monotonic()
        pos = self.consume(c, 0, left + n)
        if pos is None:
            return
        c.leftover = bytes(view[pos : left + n])
        if c.state == OPENCONFIRM and c.cs.ctr[C_KEEPALIVES] > c.ka_at_open:
            self.established(c, c.last_rx)

    def consume(self, c: Client, pos: int, total: int) -> int | None:
        """Scan rbuf[pos:total] for client c, handing what C leaves to :meth:`message`;
        returns where a partial message starts, or None when the session ended."""
        view = self.rview
        ctr = c.cs.ctr
        updates0 = ctr[C_UPDATES]
        while pos < total:
            pos += self.scanner.scan(self.raddr + pos, total - pos, c.idx)
            if total - pos < _wire.HEADER_LEN:
                break
            length = (view[pos + 16] << 8) | view[pos + 17]
            if view[pos : pos + 16] != _wire.MARKER or not _wire.HEADER_LEN <= length <= _wire.MAX_MESSAGE_LEN:
                self.failed(c, f"bad message header from the reflector: {bytes(view[pos:pos + 19]).hex()}")
                return None
            if total - pos < length:
                break
            if not self.message(c, view[pos + 18], bytes(view[pos + _wire.HEADER_LEN : pos + length])):
                return None
            pos += length
        if ctr[C_UPDATES] != updates0:
            self.note_update(c, time.monotonic())
        return pos

    def note_update(self, c: Client, now: float) -> None:
        """What rr_pump does after UPDATEs for a client, for the ones read in Python."""
        st, cs = self.st, c.cs
        st.last_update = now
        if cs.target >= 0:
            done = int(cs.ctr[C_HELD] == cs.target)
            if done != cs.done:
                cs.done = done
                st.done_count += 1 if done else -1
                if done and st.want_done and st.done_count == st.want_done and not st.t_done:
                    st.t_done = now

    def pump(self) -> None:
        """Serve the Established sockets in C; handle the events it hands back."""
        st = self.st
        while self.scanner.pump(self.ep.fileno(), 0.05):
            c = self.clients[st.ev_client]
            if st.ev_kind == EV_CLOSED:
                self.failed(c, "connection closed by the reflector")
            elif st.ev_kind == EV_MESSAGE:
                total = st.ev_len
                pos = self.consume(c, st.ev_pos, total)
                if pos is not None:
                    rest = total - pos
                    ctypes.memmove(ctypes.addressof(c.cs.leftover), self.raddr + pos, rest)
                    c.cs.left = rest
            else:
                self.failed(c, f"receive: {os.strerror(st.ev_errno)}")

    def message(self, c: Client, msg_type: int, body: bytes) -> bool:
        """A message the C scanner left to Python; False when the session ended."""
        if msg_type == _wire.OPEN and c.state == OPENSENT:
            try:
                _asn, hold, _rid = _wire.parse_open(body)
            except ValueError as err:
                self.failed(c, f"bad OPEN from the reflector: {err}")
                return False
            c.hold = min(self.hold, hold) if hold else 0
            c.ka_at_open = c.cs.ctr[C_KEEPALIVES]
            c.state = OPENCONFIRM
            self.send(c, self.keepalive)
            c.t_keepalive = time.monotonic()
            return c.sock is not None
        if msg_type == _wire.NOTIFICATION:
            self.failed(c, "NOTIFICATION " + _wire.describe_notification(body))
            return False
        name = _wire.TYPE_NAMES.get(msg_type, f"type {msg_type}")
        if msg_type == _wire.ROUTE_REFRESH and c.state == ESTABLISHED:
            self.other_messages[name] = self.other_messages.get(name, 0) + 1
            return True
        why = "malformed" if msg_type in (_wire.UPDATE, _wire.KEEPALIVE) else "unexpected"
        self.failed(c, f"{why} {name} ({len(body) + 19} bytes) in {STATE_NAMES[c.state]}: {body[:32].hex()}")
        return False

    def failed(self, c: Client, why: str) -> None:
        """The connection ended: a setup failure (retried) before Established, a drop after."""
        was = c.state
        self.close(c)
        now = time.monotonic()
        if was == ESTABLISHED:
            self.drops.append({
                "client": c.idx, "addr": c.addr, "t": now, "why": why,
                "phase": self.phase["name"] if self.phase else None,
                "established_for": round(now - c.t_established, 2),
                "last_keepalive_sent": round(now - c.t_keepalive, 2),
                "last_received": round(now - max(c.cs.last_rx, c.last_rx), 2),
            })
            if self.phase is not None and self.phase["name"] != "establish":
                self.finish("dropped", now)
            return
        self.connect_errors.append(f"{c.addr}: {why}")
        ph = self.phase
        if ph is not None and ph["name"] == "establish":
            ph["inflight"].discard(c.idx)
            c.retries += 1
            if c.retries > MAX_RETRIES:
                ph["failed"] = f"{c.addr} failed {c.retries} times, last: {why}"
            else:
                ph["retry"].append((now + RETRY_DELAY, c.idx))

    def established(self, c: Client, now: float) -> None:
        c.state = ESTABLISHED
        c.t_established = now
        cs = c.cs
        cs.last_rx, cs.max_gap = now, 0.0
        rest = c.leftover
        ctypes.memmove(ctypes.addressof(cs.leftover), rest, len(rest))
        cs.left, c.leftover = len(rest), b""
        # From now on the C pump reads this socket.
        c.pumped = True
        self.scanner.fd2idx[c.fd] = c.idx
        self.ep.register(c.fd, select.EPOLLIN)
        self.watch(c)
        if c.hold:
            self.next_ka = min(self.next_ka, now + max(1.0, c.hold / 3))
        ph = self.phase
        if ph is not None and ph["name"] == "establish":
            ph["inflight"].discard(c.idx)
            ph["established"] += 1
            ph["t_last"] = now
            self.fill(now)

    # ------------------------------------------------------------ phases

    def start_establish(self, cmd: dict) -> None:
        now = time.monotonic()
        todo = [c.idx for c in self.clients if c.state != ESTABLISHED]
        self.phase = {
            "name": "establish", "t_start": now, "deadline": now + float(cmd.get("timeout", 60)),
            "in_flight": int(cmd.get("in_flight", 8)), "queue": deque(todo), "inflight": set(), "retry": [],
            "established": self.n - len(todo), "t_last": None, "failed": None,
            "cpu0": self.cpu(),
        }
        self.fill(now)
        self.tick(now)

    def fill(self, now: float) -> None:
        ph = self.phase
        assert ph is not None
        due = [r for r in ph["retry"] if r[0] <= now]
        if due:
            ph["retry"] = [r for r in ph["retry"] if r[0] > now]
            ph["queue"].extendleft(i for _, i in due)
        while ph["queue"] and len(ph["inflight"]) < ph["in_flight"]:
            i = ph["queue"].popleft()
            ph["inflight"].add(i)
            self.connect(self.clients[i], now)

    def start_routes(self, name: str, cmd: dict) -> None:
        now = time.monotonic()
        down = [c.addr for c in self.clients if c.state != ESTABLISHED]
        if down:
            self.reply({"status": "error", "detail": f"{len(down)} clients not Established (first {down[0]})"})
            return
        if name == "announce":
            movers = list(range(self.n))
            for i in movers:
                self.announced[i] = True
        else:
            count = max(1, round(self.n * float(cmd.get("fraction", 0.1))))
            movers = sorted({k * self.n // count for k in range(count)})
            for i in movers:
                self.announced[i] = False
        still = sum(self.announced)
        st = self.st
        st.done_count = 0
        for c in self.clients:
            cs = c.cs
            cs.target = still - (1 if self.announced[c.idx] else 0)
            cs.done = int(cs.ctr[C_HELD] == cs.target)
            st.done_count += cs.done
        st.want_done = self.n
        st.t_done = now if st.done_count == self.n else 0.0
        st.last_update = now
        self.phase = {
            "name": name, "t_start": now, "deadline": now + float(cmd.get("timeout", 120)),
            "quiet": float(cmd.get("quiet", 1.0)), "quiet_max": float(cmd.get("quiet_max", 10.0)),
            "movers": len(movers), "totals0": self.totals(), "cpu0": self.cpu(), "recvs0": st.recvs,
        }
        for i in movers:
            c = self.clients[i]
            msg = c.announce_msg if name == "announce" else c.withdraw_msg
            if name == "announce" and self.eor:
                msg += _wire.END_OF_RIB  # as a node does after its initial routes (RFC 4724 §2)
            self.send(c, msg)
        self.phase["t_sent"] = time.monotonic()
        self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        if now >= self.next_ka:
            holds = []
            for c in self.clients:
                if c.state == ESTABLISHED and c.hold:
                    self.send(c, self.keepalive)
                    c.t_keepalive = now
                    holds.append(c.hold)
            self.next_ka = now + max(1.0, min(holds) / 3) if holds else float("inf")
        ph = self.phase
        if ph is None:
            return
        if ph["name"] == "establish":
            for i in list(ph["inflight"]):
                c = self.clients[i]
                if c.state == CONNECTING and now > c.connect_deadline:
                    self.failed(c, f"no connection within {CONNECT_TIMEOUT:.0f} s")
            self.fill(now)
            if ph["failed"]:
                self.finish("failed", now)
            elif ph["established"] == self.n:
                self.finish("ok", now)
            elif now > ph["deadline"]:
                self.finish("timeout", now)
            return
        st = self.st
        if st.t_done:
            if now - st.last_update >= ph["quiet"] or now - st.t_done >= ph["quiet_max"]:
                self.finish("ok", now)
        elif now > ph["deadline"]:
            self.finish("timeout", now)

    def finish(self, status: str, now: float) -> None:
        ph = self.phase
        assert ph is not None
        self.phase = None
        out = {"status": status, "phase": ph["name"], "t_start": ph["t_start"], "t_reply": now,
               "sim_cpu": round(self.cpu() - ph["cpu0"], 3), "drops": self.drops[:10] + self.drops[10:][-10:],
               "n_drops": len(self.drops)}
        if ph["name"] == "establish":
            lat = sorted(c.t_established - c.t_connect for c in self.clients if c.state == ESTABLISHED)
            out.update(
                t_end=ph["t_last"], established=ph["established"], connect_errors=len(self.connect_errors),
                first_errors=self.connect_errors[:5], retries=sum(c.retries for c in self.clients),
                setup_median=lat[len(lat) // 2] if lat else None, setup_max=lat[-1] if lat else None,
                detail=ph["failed"] or "",
            )
            self.reply(out)
            return
        st = self.st
        totals = self.totals()
        delta = {k: totals[k] - ph["totals0"][k] for k in totals if k != "held"}
        helds = [c.cs.ctr[C_HELD] for c in self.clients]
        out.update(
            t_sent=ph.get("t_sent"), t_done=st.t_done or None, t_quiet=st.last_update, movers=ph["movers"],
            done=st.done_count, min_held=min(helds), max_held=max(helds), mismatched=self.verify(), **delta,
            recvs=st.recvs - ph["recvs0"], max_silence=self.max_silence(now),
            other_messages=dict(self.other_messages),
        )
        for c in self.clients:
            c.cs.target, c.cs.done = -1, 0
        st.want_done = 0
        self.reply(out)

    # ------------------------------------------------------------ readings

    @staticmethod
    def cpu() -> float:
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime

    def totals(self) -> dict[str, int]:
        sums = [0] * N_COUNTERS
        for c in self.clients:
            ctr = c.cs.ctr
            for k in range(N_COUNTERS):
                sums[k] += ctr[k]
        return dict(zip(COUNTER_NAMES, sums))

    def verify(self) -> int:
        """Clients whose held set is not exactly the announced prefixes less their own."""
        want = bytearray((self.n + 7) // 8)
        for i, on in enumerate(self.announced):
            if on:
                want[i >> 3] |= 1 << (i & 7)
        bad = 0
        for c in self.clients:
            exp = bytearray(want)
            exp[c.idx >> 3] &= ~(1 << (c.idx & 7)) & 0xFF
            if self.scanner.bitmap(c.idx) != exp:
                bad += 1
        return bad

    def max_silence(self, now: float) -> dict:
        worst, who, hold = 0.0, None, None
        for c in self.clients:
            if c.state != ESTABLISHED:
                continue
            gap = max(c.cs.max_gap, now - c.cs.last_rx)
            if gap > worst:
                worst, who, hold = gap, c.addr, c.hold
        return {"seconds": round(worst, 2), "client": who, "hold": hold}

    def stats(self) -> dict:
        now = time.monotonic()
        states: dict[str, int] = {}
        for c in self.clients:
            states[STATE_NAMES[c.state]] = states.get(STATE_NAMES[c.state], 0) + 1
        return {"status": "ok", "states": states, "totals": self.totals(),
                "drops": self.drops[:10] + self.drops[10:][-10:],
                "n_drops": len(self.drops), "connect_errors": len(self.connect_errors),
                "max_silence": self.max_silence(now), "cpu": round(self.cpu(), 3), "recvs": self.st.recvs}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: _rrsim.py CONFIG.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        cfg = json.load(f)
    Simulator(cfg).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
