"""The speakers under test in bench/bgp_ingest.py: agentd, BIRD 2 and GoBGP, one driver each.

A driver writes the speaker's configuration (AS 65000 at 10.0.0.2, one passive eBGP
neighbour 10.0.0.1 in AS 65001, import everything, export nothing, nothing installed in
the kernel), starts it inside a namespace, and answers two questions:

* :meth:`Speaker.received`: prefixes received from the feeder as the speaker reports them,
  by its cheapest query (agentd GET /peers over one kept-alive HTTP connection, BIRD
  "show protocols all" over one kept-open control socket, GoBGP ``gobgp neighbor -j``);
* :meth:`Speaker.held`: the prefixes in its main table counted the thorough way (asked
  once after the measurement: agentd /status Loc-RIB, BIRD "show route count", GoBGP
  ``global rib summary``).

Also the /proc readings the benchmark takes of the speaker process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from agentd.lab.netns import Netns

DUT_AS = 65000
FEEDER_AS = 65001
FEEDER_ADDR, DUT_ADDR = "10.0.0.1", "10.0.0.2"
HOLD_TIME = 90
AGENTD_API_PORT = 9099
LABELS = {"agentd": "agentd", "bird": "BIRD 2", "gobgp": "GoBGP"}


class BenchError(RuntimeError):
    """A run could not be set up or failed; the message says which and why."""


def tool(name: str) -> str:
    """Absolute path of a system tool, or one clear error."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if path is None:
        raise BenchError(f"{name} not found: run `bash scripts/dev setup` first")
    return path


class Speaker:
    """One speaker under test inside namespace ``ns``; subclasses know how to start and ask it."""

    key = ""

    def __init__(self, ns: Netns, workdir: Path) -> None:
        self.ns = ns
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / f"{self.key}.log"

    @property
    def label(self) -> str:
        return LABELS[self.key]

    def write_config(self) -> None:
        raise NotImplementedError

    def argv(self) -> list[str]:
        raise NotImplementedError

    def received(self) -> int:
        """Prefixes received from the feeder, as the speaker reports them (its cheapest query)."""
        raise NotImplementedError

    def held(self) -> int:
        """Prefixes in the speaker's main table, counted the thorough way (asked once, after t1)."""
        raise NotImplementedError

    def start(self) -> None:
        self.write_config()
        argv = self.argv()
        with open(self.log_path, "wb") as log:
            self.proc = self.ns.popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid  # `ip netns exec` execs the command in place: same pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])


# --------------------------------------------------------------------------- agentd


class AgentdSpeaker(Speaker):
    key = "agentd"

    def __init__(self, ns: Netns, workdir: Path) -> None:
        super().__init__(ns, workdir)
        self._conn: socket.socket | None = None
        self._buf = b""

    def write_config(self) -> None:
        (self.workdir / "agentd.toml").write_text(
            f"""[node]
name = "dut"
address = "{DUT_ADDR}"
asn = {DUT_AS}
[bgp]
listen = "{DUT_ADDR}:179"
hold_time = {HOLD_TIME}
graceful_restart = false
[[bgp.peers]]
address = "{FEEDER_ADDR}"
asn = {FEEDER_AS}
passive = true
[api]
listen = "127.0.0.1:{AGENTD_API_PORT}"
[agent]
state_dir = "{self.workdir / 'state'}"
[log]
level = "warning"
"""
        )

    def argv(self) -> list[str]:
        exe = Path(sys.executable).with_name("agentd")
        if not exe.exists():
            raise BenchError(f"{exe} not found: run `bash scripts/dev setup` first")
        return [str(exe), "speaker", "--config", str(self.workdir / "agentd.toml")]

    def received(self) -> int:
        for peer in json.loads(self._get("/peers")):
            if peer.get("address") == FEEDER_ADDR:
                return int(peer.get("prefixes_received") or 0)
        return 0

    def held(self) -> int:
        return int(json.loads(self._get("/status"))["bgp"]["loc_rib_prefixes"])

    def _get(self, path: str) -> bytes:
        # One kept-alive HTTP/1.1 connection, each response read by its Content-Length: a
        # busy speaker answers between two reads of its BGP socket, and closing a
        # per-request connection can come much later than the answer itself.
        if self._conn is None:
            self._conn = self.ns.connect("127.0.0.1", AGENTD_API_PORT, timeout=60)
            self._buf = b""
        try:
            self._conn.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            while b"\r\n\r\n" not in self._buf:
                self._recv()
            head, _, rest = self._buf.partition(b"\r\n\r\n")
            m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            if m is None:
                raise OSError(f"agentd answered {path} without Content-Length")
            length = int(m.group(1))
            while len(rest) < length:
                self._recv()
                rest = self._buf.partition(b"\r\n\r\n")[2]
            self._buf = rest[length:]
            return rest[:length]
        except OSError:
            self._close()
            raise

    def _recv(self) -> None:
        assert self._conn is not None
        data = self._conn.recv(65536)
        if not data:
            raise OSError("agentd closed the API connection")
        self._buf += data

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def stop(self) -> None:
        self._close()
        super().stop()


# --------------------------------------------------------------------------- BIRD


class BirdSpeaker(Speaker):
    key = "bird"
    _ROUTES = re.compile(rb"Routes:\s+(\d+) imported")
    _LAST_LINE = re.compile(rb"(?m)^\d{4} [^\n]*\n")  # a reply ends with "NNNN text"

    def __init__(self, ns: Netns, workdir: Path) -> None:
        super().__init__(ns, workdir)
        self._ctl: socket.socket | None = None
        self._ctl_buf = b""

    @property
    def sock(self) -> Path:
        return self.workdir / "bird.ctl"

    def write_config(self) -> None:
        # No kernel protocol: BIRD keeps the routes in master4 and installs nothing.
        (self.workdir / "bird.conf").write_text(
            f"""log stderr {{ warning, error, fatal, bug }};
router id {DUT_ADDR};
protocol device {{ }}
protocol bgp feeder {{
  local {DUT_ADDR} as {DUT_AS};
  neighbor {FEEDER_ADDR} as {FEEDER_AS};
  passive on;
  hold time {HOLD_TIME};
  ipv4 {{ import all; export none; }};
}}
"""
        )

    def argv(self) -> list[str]:
        return [tool("bird"), "-f", "-c", str(self.workdir / "bird.conf"), "-s", str(self.sock)]

    def received(self) -> int:
        # The protocol's import counter; "show route count" walks the whole table.
        m = self._ROUTES.search(self._command(b"show protocols all feeder"))
        return int(m.group(1)) if m else 0

    def held(self) -> int:
        m = re.search(rb"(\d+) of \d+ routes for (\d+) networks", self._command(b"show route count"))
        return int(m.group(2)) if m else 0

    def _command(self, line: bytes) -> bytes:
        # The control socket birdc uses, kept open for the whole run.
        if self._ctl is None:
            ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            ctl.settimeout(60)
            ctl.connect(str(self.sock))
            self._ctl, self._ctl_buf = ctl, b""
            self._reply()  # "0001 BIRD x.y.z ready."
        self._ctl.sendall(line + b"\n")
        return self._reply()

    def _reply(self) -> bytes:
        assert self._ctl is not None
        while True:
            m = self._LAST_LINE.search(self._ctl_buf)
            if m is not None:
                reply, self._ctl_buf = self._ctl_buf[: m.end()], self._ctl_buf[m.end() :]
                return reply
            data = self._ctl.recv(65536)
            if not data:
                raise OSError("BIRD closed its control socket")
            self._ctl_buf += data

    def stop(self) -> None:
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None
        super().stop()


# --------------------------------------------------------------------------- GoBGP


class GobgpSpeaker(Speaker):
    key = "gobgp"

    @property
    def target(self) -> str:
        return f"unix://{self.workdir / 'gobgp.sock'}"

    def write_config(self) -> None:
        # Without a [zebra] section gobgpd installs nothing in the kernel; routes go to
        # its global (default) table.
        (self.workdir / "gobgpd.toml").write_text(
            f"""[global.config]
  as = {DUT_AS}
  router-id = "{DUT_ADDR}"
  port = 179
  local-address-list = ["{DUT_ADDR}"]

[[neighbors]]
  [neighbors.config]
    neighbor-address = "{FEEDER_ADDR}"
    peer-as = {FEEDER_AS}
  [neighbors.timers.config]
    hold-time = {HOLD_TIME}
  [neighbors.transport.config]
    passive-mode = true
  [[neighbors.afi-safis]]
    [neighbors.afi-safis.config]
      afi-safi-name = "ipv4-unicast"
"""
        )

    def argv(self) -> list[str]:
        return [
            tool("gobgpd"), "-f", str(self.workdir / "gobgpd.toml"), "-t", "toml", "-l", "warn",
            "--api-hosts", self.target, "--pprof-disable",
        ]

    def _gobgp(self, *args: str, timeout: float = 60) -> bytes:
        return subprocess.run(
            [tool("gobgp"), "--target", self.target, *args], check=False, capture_output=True, timeout=timeout
        ).stdout

    def received(self) -> int:
        try:
            peers = json.loads(self._gobgp("-j", "neighbor") or b"[]")
        except ValueError:
            return 0
        for peer in peers or []:
            if (peer.get("state") or {}).get("neighbor_address") == FEEDER_ADDR:
                return sum(int((a.get("state") or {}).get("accepted") or 0) for a in peer.get("afi_safis") or [])
        return 0

    def held(self) -> int:
        m = re.search(rb"Destination:\s*(\d+)", self._gobgp("global", "rib", "summary", "-a", "ipv4", timeout=120))
        return int(m.group(1)) if m else 0


DRIVERS: dict[str, type[Speaker]] = {"agentd": AgentdSpeaker, "bird": BirdSpeaker, "gobgp": GobgpSpeaker}


# --------------------------------------------------------------------------- /proc


def status_kb(pid: int, field: str) -> int:
    """A ``kB`` field of /proc/PID/status (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise BenchError(f"/proc/{pid}/status has no {field}")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of every thread of the process (clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


class CpuMeter:
    """Scheduler time of every thread of a process, from /proc/PID/task/*/schedstat.

    :meth:`read` returns (on CPU, on CPU + runnable but waiting for one) in ns: a speaker
    that other load keeps off the CPU is still busy, not idle.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._tids: list[str] = []
        self._listed = 0.0

    def read(self) -> tuple[int, int]:
        now = time.monotonic()
        if now - self._listed > 0.5:  # Go starts threads as it goes
            self._tids = os.listdir(f"/proc/{self.pid}/task")
            self._listed = now
        run = wait = 0
        for tid in self._tids:
            try:
                with open(f"/proc/{self.pid}/task/{tid}/schedstat", "rb") as f:
                    fields = f.read().split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            run += int(fields[0])
            wait += int(fields[1])
        return run, run + wait


class SystemLoad:
    """Busy CPU seconds of the whole machine (from /proc/stat), to tell other load apart."""

    @staticmethod
    def busy_seconds() -> float:
        with open("/proc/stat") as f:
            parts = f.readline().split()[1:]
        values = [int(v) for v in parts[:8]]
        idle = values[3] + values[4]  # idle + iowait
        return (sum(values) - idle) / os.sysconf("SC_CLK_TCK")
