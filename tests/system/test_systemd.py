"""systemd/agentd.service for real: the unit, its hardening, sd_notify and the watchdog.

* ``systemd-analyze verify`` accepts the unit, its hardening keys are there, and its
  ``systemd-analyze security`` exposure is the figure docs/operations.md states.
* The notify protocol, end to end: a real ``agentd run`` (in a node namespace, with a real
  etcd in another) gets ``NOTIFY_SOCKET`` (a datagram socket this test binds) and
  ``WATCHDOG_USEC`` as systemd would give them, and sends STATUS=, READY=1 only once
  /readyz answers 200, WATCHDOG=1 at half WATCHDOG_USEC, and STOPPING=1 on SIGTERM.
* The unit's sandbox: no systemd manager runs on this machine (PID 1 is not systemd), so
  the test rebuilds the parts of the sandbox that can break a running agent from the unit
  file itself -- the capability bounding set, NoNewPrivileges, MemoryDenyWriteExecute (the
  kernel's PR_SET_MDWE), SystemCallFilter/SystemCallArchitectures/RestrictAddressFamilies
  (a seccomp filter built from ``systemd-analyze syscall-filter``, refusing with
  SystemCallErrorNumber) -- and runs a 3-node lab under it with one node per backend
  (vxlan with the BPF member filter, udp in BPF, ipip in the user-space worker over a raw
  socket): every pod must reach every other. The file-system options (ProtectSystem=, ...)
  are not rebuilt here.
* Restarts under that sandbox, as Restart=, the watchdog and upgrades make them: an agent
  killed (SIGKILL) or stopped (SIGTERM) and started again with only the unit's capabilities
  takes over the BPF programs its predecessor attached -- the data path (udp in BPF, the
  VXLAN member filter) and the pod fast path (pods' veths, the underlay) -- by tcx and by
  clsact, while pod traffic flows throughout; and it takes over an agent before links (its
  tcx programs attached without one), saying which program on its hooks it cannot tell
  ours or anyone's.  And docs/operations.md's drop-in that takes CAP_PERFMON away turns the
  pod fast path off: the agent says why and leaves none of it on the hooks.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from agentd.dataplane.bpf import tc
from agentd.lab.etcd import EtcdServer
from agentd.lab.lab import Lab, LabSpec, render_toml
from agentd.lab.netns import unique_tag, veth
from agentd.lab.traffic import Pinger
from agentd.lab.wait import auntil

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "agentd.service"
OPERATIONS_DOC = ROOT / "docs" / "operations.md"
AGENTD = Path(sys.executable).parent / "agentd"

# ------------------------------------------------------------------ the unit file


def parse_unit(text: str) -> dict[str, list[str]]:
    """``{"Section.Key": [value, ...]}`` of a unit file (repeated keys accumulate)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


UNIT_KEYS = parse_unit(UNIT.read_text())


def service(key: str) -> str:
    values = UNIT_KEYS.get(f"Service.{key}")
    assert values, f"[Service] {key}= missing from {UNIT}"
    return " ".join(values)


def verifiable_copy(directory: Path) -> Path:
    """The unit with ExecStart (and ExecReload's check-config) pointing at this checkout's agentd:
    `verify` checks that the binary exists, and this machine has no /usr/local/bin/agentd (tests
    never install one)."""
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/agentd run " in text
    copy = directory / "agentd.service"
    assert "ExecReload=/usr/local/bin/agentd check-config " in text
    copy.write_text(text.replace("ExecStart=/usr/local/bin/agentd ", f"ExecStart={AGENTD} ")
                    .replace("ExecReload=/usr/local/bin/agentd ", f"ExecReload={AGENTD} "))
    return copy


def test_unit_passes_systemd_analyze_verify(tmp_path):
    unit = verifiable_copy(tmp_path)
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, output
    # Warnings (unknown keys, bad values) come out with rc 0: there must be none about us.
    assert "agentd.service" not in output, output


def test_verify_fails_only_for_the_missing_binary():
    """The unit as shipped is the copy above except for the agentd path (ExecStart, ExecReload)."""
    proc = subprocess.run(["systemd-analyze", "verify", str(UNIT)], capture_output=True, text=True, timeout=60)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    if os.path.exists("/usr/local/bin/agentd"):
        assert proc.returncode == 0, lines
    else:
        assert lines == [f"{UNIT.name}: Command /usr/local/bin/agentd is not executable: No such file or directory"] * 2


def test_unit_hardening_keys():
    assert service("Type") == "notify"
    assert service("NotifyAccess") == "main"
    assert re.fullmatch(r"\d+s", service("WatchdogSec"))
    assert service("Restart") == "on-failure"
    assert service("ExecStart") == "/usr/local/bin/agentd run --config /etc/agentd/agentd.toml"
    assert UNIT_KEYS["Service.ExecReload"] == [  # the file checked first: a bad one fails the reload
        "/usr/local/bin/agentd check-config --reload --config /etc/agentd/agentd.toml", "/bin/kill -HUP $MAINPID"]
    assert service("KillMode") == "process"  # the data-plane worker outlives a restart
    caps = {"CAP_NET_ADMIN", "CAP_BPF", "CAP_PERFMON", "CAP_NET_RAW", "CAP_NET_BIND_SERVICE"}
    assert set(service("CapabilityBoundingSet").split()) == caps
    assert set(service("AmbientCapabilities").split()) == caps
    assert service("ProtectSystem") == "strict"
    assert service("StateDirectory") == "agentd"
    assert service("RuntimeDirectory") == "agentd"
    assert "-/etc/cni/net.d" in service("ReadWritePaths").split()  # made by ExecStartPre=+ (test_packaging)
    assert set(service("RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_NETLINK", "AF_INET", "AF_INET6", "AF_PACKET"}
    assert UNIT_KEYS["Service.SystemCallFilter"][0] == "@system-service"
    for key, value in {
        "ProtectHome": "yes",
        "NoNewPrivileges": "yes",
        "SystemCallArchitectures": "native",
        "LockPersonality": "yes",
        "MemoryDenyWriteExecute": "yes",
        "ProtectKernelModules": "yes",
        "ProtectKernelLogs": "yes",
        "ProtectControlGroups": "yes",
        "ProtectClock": "yes",
        "ProtectHostname": "yes",
        "RestrictNamespaces": "yes",
        "RestrictRealtime": "yes",
        "RestrictSUIDSGID": "yes",
        "PrivateTmp": "yes",
    }.items():
        assert service(key) == value, key
    # The worker writes /proc/sys/net/ipv4/conf/<tun>/: /proc/sys must stay writable.
    assert "Service.ProtectKernelTunables" not in UNIT_KEYS
    # And every hardening line carries a reason: no key without a comment block above it.
    text = UNIT.read_text()
    service_block = text.split("[Service]", 1)[1].split("[Install]", 1)[0]
    assert service_block.count("\n#") >= 30


def test_security_exposure_is_the_documented_one(tmp_path):
    unit = verifiable_copy(tmp_path)
    proc = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    m = re.search(r"Overall exposure level for agentd\.service: (\d+\.\d) (\w+)", proc.stdout)
    assert m, proc.stdout[-2000:] + proc.stderr
    score, verdict = m.groups()
    assert float(score) <= 3.0, proc.stdout
    doc = OPERATIONS_DOC.read_text()
    assert f"{score} {verdict}" in doc, f"docs/operations.md should state the exposure level {score} {verdict}"
    assert f"{score} {verdict}" in UNIT.read_text(), "the unit's header comment should state the exposure level"
    assert f"{score} {verdict}" in (ROOT / "README.md").read_text(), "README.md should state the exposure level"


# ------------------------------------------------------------------ sd_notify, end to end


class NotifySink:
    """The NOTIFY_SOCKET systemd would give the unit: a bound datagram socket, read by a thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode().split("\n")))

    def lines(self) -> list[tuple[float, str]]:
        return [(t, line) for t, lines in list(self.messages) for line in lines]

    def first(self, line: str) -> float | None:
        return next((t for t, got in self.lines() if got == line), None)

    def times(self, line: str) -> list[float]:
        return [t for t, got in self.lines() if got == line]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


class ReadyzPoller:
    """GET /readyz inside the node namespace every 100 ms; (asked at, status or None, answered at)."""

    def __init__(self, ns) -> None:
        self.ns = ns
        self.samples: list[tuple[float, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                status, _ = self.ns.http_get("http://127.0.0.1:9099/readyz", timeout=2)
            except (OSError, ValueError, IndexError):
                status = None
            self.samples.append((t, status, time.monotonic()))
            self._stop.wait(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


async def wait_for(what: str, check, timeout: float, detail=lambda: "") -> None:
    await auntil(check, timeout, what=lambda: f"{what}; {detail()}")


def node_with_etcd(netns_factory, tmp_path):
    """An etcd namespace and a node namespace joined by a veth (192.0.2.0/24, TEST-NET-1,
    only inside the two namespaces); etcd is created but not started."""
    etcd_ns, node = netns_factory("etcd"), netns_factory("node")
    veth(node, "eth0", etcd_ns, "eth0")
    etcd_ns.ip("addr", "add", "192.0.2.2/24", "dev", "eth0")
    node.ip("addr", "add", "192.0.2.11/24", "dev", "eth0")
    etcd = EtcdServer(
        str(tmp_path / "etcd" / "data"), netns=etcd_ns, host="192.0.2.2", client_port=2379, peer_port=2380,
        log_path=str(tmp_path / "etcd" / "etcd.log"),
    )  # fmt: skip
    config = tmp_path / "agentd.toml"
    config.write_text(
        render_toml(
            {
                "node": {"name": "node1", "address": "192.0.2.11"},
                "etcd": {"endpoints": ["http://192.0.2.2:2379"], "lease_ttl": 10},
                "cni": {
                    "conf_dir": str(tmp_path / "net.d"),
                    "subnet_file": str(tmp_path / "run" / "subnet.env"),
                    "data_dir": str(tmp_path / "cni"),
                    "ipam_data_dir": str(tmp_path / "ipam"),
                },
                "agent": {"state_dir": str(tmp_path / "state")},
                "api": {"token_file": str(tmp_path / "api.token")},
            }
        )
    )
    return node, etcd, config


def start_agent(node, config: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "ab") as out:
        return node.popen(
            [str(AGENTD), "run", "--config", str(config)],
            env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


async def stop_process(proc: subprocess.Popen, timeout: float = 30.0) -> int | None:
    with contextlib.suppress(AssertionError):
        await auntil(lambda: proc.poll() is not None, timeout, what=f"pid {proc.pid} to exit")
    return proc.poll()


# systemd would kill the unit after 4 s without WATCHDOG=1.  The agent pings every 2 s: what
# the test checks is that spacing, with 2 s of slack for a loaded machine before a gap would
# have tripped systemd.
WATCHDOG_USEC = 4_000_000


async def test_notify_ready_watchdog_stopping(netns_factory, tmp_path):
    node, etcd, config = node_with_etcd(netns_factory, tmp_path)
    sink = NotifySink(tmp_path / "notify.sock")
    log = tmp_path / "agentd.log"
    env = {"NOTIFY_SOCKET": str(sink.path), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    agent = start_agent(node, config, log, env)
    poller = ReadyzPoller(node)
    detail = lambda: f"notifications {sink.lines()}; log {log}:\n{log.read_text()[-2000:]}"
    try:
        # 1. etcd is not up yet: the agent says what it waits for and keeps the watchdog
        #    fed, and neither READY=1 nor /readyz 200 happen.
        await wait_for("STATUS=connecting to etcd", lambda: sink.first("STATUS=connecting to etcd"), 60, detail)
        await wait_for("3 WATCHDOG=1 while not ready", lambda: len(sink.times("WATCHDOG=1")) >= 3, 30, detail)
        await wait_for("/readyz 503", lambda: any(s == 503 for _, s, _ in poller.samples), 30, detail)
        assert sink.first("READY=1") is None, detail()
        assert all(s != 200 for _, s, _ in poller.samples)
        assert agent.poll() is None, detail()

        # 2. etcd comes up: lease, BGP, routes -> ready.
        await etcd.start()
        await wait_for("READY=1", lambda: sink.first("READY=1"), 60, detail)
        t_ready = sink.first("READY=1")
        status = json.loads(node.http_get("http://127.0.0.1:9099/status")[1])
        assert status["ready"] is True
        assert node.http_get("http://127.0.0.1:9099/readyz")[0] == 200
        # READY=1 and its STATUS= come in one datagram, naming the leased subnet.
        (ready_msg,) = [lines for _, lines in sink.messages if "READY=1" in lines]
        assert f"STATUS=ready: subnet {status['node']['subnet']}" in ready_msg
        # /readyz never said 200 before READY=1 except within one readiness poll (0.5 s, and
        # slack for a loaded machine) before it, and never 503 from READY=1 on.  An answer
        # counts from when it came back, a 503 from when it was asked.
        early = [done for _, s, done in poller.samples if s == 200 and done < t_ready - 2.0]
        assert not early, f"/readyz was 200 {t_ready - early[0]:.2f}s before READY=1"
        assert [t for t, s, _ in poller.samples if t > t_ready + 0.1 and s == 503] == []

        # 3. While it runs: WATCHDOG=1 about every WATCHDOG_USEC/2.
        await wait_for(
            "5 WATCHDOG=1 after READY=1", lambda: len([t for t in sink.times("WATCHDOG=1") if t > t_ready]) >= 5, 30, detail
        )
        pings = sink.times("WATCHDOG=1")
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        half = WATCHDOG_USEC / 2e6
        assert max(gaps) < 2 * half, f"a watchdog gap of {max(gaps):.2f}s would have tripped systemd: {gaps}"
        # Paced by half the timeout: a ping never comes sooner than that (a sleep does not end
        # early; 0.05 s for the two sides' timestamps), and is typically not much later.  The
        # upper bound only has to tell that pace from one tied to the whole timeout.
        median = sorted(gaps)[len(gaps) // 2]
        assert half - 0.05 <= median < 1.5 * half, gaps

        # 4. SIGTERM: STOPPING=1, then a clean exit.
        t_term = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        assert await stop_process(agent) == 0, detail()
        await wait_for("STOPPING=1", lambda: sink.first("STOPPING=1"), 30, detail)
        assert sink.first("STOPPING=1") > t_term

        # The whole conversation, in order.
        order = [line.split("=")[0] for _, line in sink.lines() if line != "WATCHDOG=1"]
        assert order[0] == "STATUS" and order[-1] == "STOPPING", order
        assert order.count("READY") == 1 and order.count("STOPPING") == 1
        assert order.index("READY") < order.index("STOPPING")
        # Start-up named each of its steps, in order, before anything else (docs/operations.md).
        from agentd.daemon.agent import START_STEPS

        statuses = [line.removeprefix("STATUS=") for _, line in sink.lines() if line.startswith("STATUS=")]
        assert statuses[: len(START_STEPS)] == list(START_STEPS), statuses
    finally:
        poller.close()
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        await etcd.stop()
        sink.close()


async def test_sigterm_while_waiting_for_etcd(netns_factory, tmp_path):
    """`systemctl stop` (and TimeoutStartSec) during an etcd outage at boot."""
    node, _etcd, config = node_with_etcd(netns_factory, tmp_path)
    sink = NotifySink(tmp_path / "notify.sock")
    agent = start_agent(node, config, tmp_path / "agentd.log", {"NOTIFY_SOCKET": str(sink.path)})
    try:
        await wait_for("STATUS=connecting to etcd", lambda: sink.first("STATUS=connecting to etcd"), 60)
        agent.send_signal(signal.SIGTERM)
        assert await stop_process(agent, timeout=10) is not None
        assert sink.first("STOPPING=1") is not None
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        sink.close()


# ------------------------------------------------------------------ the unit's sandbox, rebuilt

SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
ADDRESS_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17}
EPERM, EAFNOSUPPORT = 1, 97


def syscall_groups() -> dict[str, list[str]]:
    """Every @group of this systemd, from ``systemd-analyze syscall-filter``."""
    out = subprocess.run(["systemd-analyze", "syscall-filter"], capture_output=True, text=True, check=True).stdout
    groups: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif line.startswith("    ") and current is not None and not line.strip().startswith("#"):
            current.append(line.strip())
        elif not line.strip():
            current = None
    return groups


def expand(names: list[str], groups: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    for name in names:
        out |= expand(groups[name], groups) if name.startswith("@") else {name}
    return out


def syscall_numbers() -> dict[str, int]:
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h").read_text()
    return {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+) (\d+)", header)}


def capability_numbers() -> dict[str, int]:
    header = Path("/usr/include/linux/capability.h").read_text()
    return {m[1]: int(m[2]) for m in re.finditer(r"#define (CAP_[A-Z_]+)\s+(\d+)\s*$", header, re.MULTILINE)}


def allowed_syscalls(filters: list[str], groups: dict[str, list[str]]) -> set[str]:
    """SystemCallFilter= lines in order: the first one decides allow- or deny-list; after an
    allow-list, each line adds (or, with ~, removes) names, in order, as systemd applies them."""
    allowed: set[str] = set()
    for i, value in enumerate(filters):
        deny = value.startswith("~")
        names = expand(value.lstrip("~").split(), groups)
        assert i > 0 or not deny, "the unit should start from an allow-list (@system-service)"
        allowed = allowed - names if deny else allowed | names
    return allowed


def seccomp_program(allowed: set[str], families: list[str], errno: int) -> bytes:
    """Classic BPF for SECCOMP_SET_MODE_FILTER: native arch only, socket() only for
    ``families`` (EAFNOSUPPORT otherwise, as systemd does), ``allowed`` syscalls, else errno."""
    numbers = syscall_numbers()
    ins: list[tuple[int, int, int, int]] = [
        (BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (BPF_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno),
        (BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (BPF_JGE_K, 0, 1, X32_SYSCALL_BIT),  # SystemCallArchitectures=native: no x32
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno),
    ]
    fams = [ADDRESS_FAMILIES[f] for f in families]
    ins.append((BPF_JEQ_K, 0, 2 * len(fams) + 2, numbers["socket"]))
    ins.append((BPF_LD_W_ABS, 0, 0, 16))  # args[0] (low 32 bits): the address family
    for fam in fams:
        ins += [(BPF_JEQ_K, 0, 1, fam), (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW)]
    ins.append((BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EAFNOSUPPORT))
    for name in sorted(allowed):
        if name in numbers and name != "socket":
            ins += [(BPF_JEQ_K, 0, 1, numbers[name]), (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW)]
    ins.append((BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno))
    assert len(ins) < 4096
    return b"".join(struct.pack("=HBBI", *i) for i in ins)


# Runs as `python -c SANDBOX spec.json -- argv...`: applies the spec, then execs argv.
SANDBOX = r"""
import ctypes, json, os, sys
spec = json.load(open(sys.argv[1])); argv = sys.argv[3:]
libc = ctypes.CDLL(None, use_errno=True)
def prctl(*a):
    if libc.prctl(*[ctypes.c_ulong(x) for x in a]) != 0:
        raise OSError(ctypes.get_errno(), f"prctl{a}")
for cap in range(int(open("/proc/sys/kernel/cap_last_cap").read()) + 1):
    if cap not in spec["keep_caps"]:
        prctl(24, cap, 0, 0, 0)                     # PR_CAPBSET_DROP
prctl(38, 1, 0, 0, 0)                               # PR_SET_NO_NEW_PRIVS
if spec["mdwe"]:
    prctl(65, 1, 0, 0, 0)                           # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
prog = bytes.fromhex(spec["bpf"])
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
fprog = Fprog(len(prog) // 8, prog)
prctl(22, 2, ctypes.addressof(fprog), 0, 0)        # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
os.execv(argv[0], argv)
"""


def perfmon_drop_in() -> str:
    """docs/operations.md's drop-in that takes CAP_PERFMON away, exactly as the page shows it."""
    blocks = re.findall(r"    # systemctl edit agentd\n((?:    [^\n]*\n)+)", OPERATIONS_DOC.read_text())
    (block,) = [b for b in blocks if "~CAP_PERFMON" in b]
    return "".join(line[4:] + "\n" for line in block.splitlines())


def capability_set(values: list[str]) -> set[str]:
    """CapabilityBoundingSet= assignments in order, merged as systemd.exec(5) says: a list adds
    its capabilities, a list prefixed with "~" takes its own out, the empty string empties the set."""
    caps: set[str] = set()
    for i, value in enumerate(values):
        assert i > 0 or not value.startswith("~"), "a first ~ line would mean all capabilities but those"
        if not value:
            caps = set()
        elif value.startswith("~"):
            caps -= set(value[1:].split())
        else:
            caps |= set(value.split())
    return caps


def sandbox_spec(drop_in: str = "") -> dict:
    """The unit's sandbox, or the one it has with ``drop_in`` (a drop-in's text: systemd reads
    its lines after the unit's)."""
    keys = parse_unit(UNIT.read_text() + "\n" + drop_in)
    caps = capability_numbers()
    groups = syscall_groups()
    allowed = allowed_syscalls(keys["Service.SystemCallFilter"], groups)
    assert {"socket", "ioctl", "sendmmsg", "recvmmsg", "execve", "epoll_wait", "setsockopt", "bpf"} <= allowed
    assert not {"setuid", "mount", "init_module", "capset", "sched_setaffinity", "perf_event_open"} & allowed
    errno = {"EPERM": EPERM}[service("SystemCallErrorNumber")]
    return {
        "keep_caps": sorted(caps[c] for c in capability_set(keys["Service.CapabilityBoundingSet"])),
        "mdwe": service("MemoryDenyWriteExecute") == "yes",
        "bpf": seccomp_program(allowed, service("RestrictAddressFamilies").split(), errno).hex(),
    }


def sandboxed_caps(pid: int) -> int:
    """CapEff of a process that must be under a seccomp filter with no_new_privs set."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    assert status["Seccomp"].strip() == "2" and status["NoNewPrivs"].strip() == "1", pid
    return int(status["CapEff"].strip(), 16)


def test_sandbox_filter_refuses_what_the_unit_refuses(tmp_path):
    """The rebuilt sandbox is not a no-op: inside it, what the unit forbids fails."""
    spec = tmp_path / "sandbox.json"
    spec.write_text(json.dumps(sandbox_spec()))
    probe = (
        "import ctypes, errno, os, socket\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "out = {}\n"
        "try: socket.socket(socket.AF_ALG, socket.SOCK_SEQPACKET, 0); out['alg'] = 'ok'\n"
        "except OSError as e: out['alg'] = errno.errorcode[e.errno]\n"
        "out['netlink'] = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).fileno() > 0\n"
        "out['setuid'] = libc.setuid(0) == 0 or errno.errorcode[ctypes.get_errno()]\n"
        "out['mdwe'] = libc.prctl(66, 0, 0, 0, 0)\n"
        "import tempfile\n"
        "with tempfile.TemporaryFile() as f:\n"
        "    try: os.fchown(f.fileno(), -1, os.getgid()); out['fchown'] = 'ok'\n"
        "    except OSError as e: out['fchown'] = errno.errorcode[e.errno]\n"
        "out['caps'] = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0]\n"
        "print(__import__('json').dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", SANDBOX, str(spec), "--", sys.executable, "-c", probe],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["alg"] == "EAFNOSUPPORT"
    assert out["netlink"] is True
    assert out["setuid"] == "EPERM"
    assert out["fchown"] == "ok"  # [api] token_group: the token file's group
    assert out["mdwe"] == 1
    assert int(out["caps"], 16) == sum(1 << c for c in json.loads(spec.read_text())["keep_caps"])


UNIT_ENV = dict(v.partition("=")[::2] for line in UNIT_KEYS.get("Service.Environment", []) for v in line.split())


def sandboxed(node, spec_path: Path):
    """The lab node's ``start_agent``, starting ``agentd run`` inside the unit's sandbox (with
    the unit's Environment=)."""

    def start_agent() -> None:
        node.write_config()
        with open(node.log_path, "ab") as log:
            node.proc = node.ns.popen(
                [sys.executable, "-c", SANDBOX, str(spec_path), "--", str(AGENTD), "run", "--config", str(node.config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **UNIT_ENV},
            )  # fmt: skip
        (node.dir / "agent.pid").write_text(str(node.proc.pid))

    return start_agent


async def test_lab_runs_under_the_units_sandbox(tmp_path):
    """Three agents, one per encapsulating backend, each started inside the unit's sandbox;
    node3 runs its backends in the user-space worker, so every node also starts a worker
    (for node3's peers, beside BPF), which inherits the sandbox. Every pod reaches every other."""
    spec_path = tmp_path / "sandbox.json"
    spec = sandbox_spec()
    spec_path.write_text(json.dumps(spec))
    backends = {"node1": "vxlan", "node2": "udp", "node3": "ipip"}
    # A short root: the workers' control sockets live under it and AF_UNIX paths end at
    # 107 bytes, which tmp_path of a long test name gets close to. Logs are copied to
    # tmp_path at the end.
    root = Path(tempfile.mkdtemp(prefix="ad-sb-"))
    lab = Lab(
        LabSpec(
            name="sb" + unique_tag("")[:6], nodes=3, pods=1,
            extra={name: {"network": {"backend": b, "datapath": "userspace" if name == "node3" else "auto"}}
                   for name, b in backends.items()},
        ),
        root=root,
    )  # fmt: skip

    # The unit's Environment= too.
    assert UNIT_ENV.get("GRPC_ENABLE_FORK_SUPPORT") == "0"

    for node in lab.nodes:
        node.start_agent = sandboxed(node, spec_path)
    try:
        await lab.up(timeout=90)
        want = sum(1 << c for c in spec["keep_caps"])
        for node in lab.nodes:
            pid = node.agent_pid()
            assert pid is not None and sandboxed_caps(pid) == want, node.name
            status = node.api("/status")
            backends = status["backends"]
            active = backends["active"]
            # Every node runs every backend its peers use, all inside the sandbox: in BPF (its
            # programs loaded and attached with the unit's capabilities and system calls),
            # and in workers for node3, which receives in user space.
            assert set(active) == {"vxlan", "udp", "ipip"}, (node.name, backends)
            assert backends["bpf"]["active"] and not backends["member_filter"]["missing"], (node.name, backends)
            paths = {k: v["datapath"] for k, v in active.items()}
            workers = [active[k]["worker_pid"] for k, v in paths.items() if v == "userspace"]
            if node.name == "node3":
                assert paths == {"vxlan": "vxlan-device", "udp": "userspace", "ipip": "userspace"}, paths
            else:
                assert paths == {"vxlan": "vxlan-device", "udp": "bpf", "ipip": "bpf"}, paths
                # Workers to speak to node3: its backend (to send), and our own if BPF carries it
                # (what node3's worker sends us).
                workers = [w["worker_pid"] for w in backends["userspace_peers_worker"].values()]
                want_workers = {"node1": ["ipip"], "node2": ["ipip", "udp"]}[node.name]
                assert sorted(backends["userspace_peers_worker"]) == want_workers, backends
            assert workers and all(w and sandboxed_caps(w) == want for w in workers), (node.name, workers)
            text = node.log_path.read_text()
            # What a sandbox refusal looks like: EPERM/EAFNOSUPPORT from a system call, a
            # worker killed by a signal (SIGSYS, or SIGSEGV from code that did not expect one).
            for bad in ("Operation not permitted", "Address family not supported", "exited with -"):
                assert bad not in text, f"{node.name}: {bad!r} in {node.log_path}"
        matrix = await lab.ready.reachability()
        assert matrix and all(matrix.values()), matrix
    finally:
        await lab.down(keep_files=True)
        for node in lab.nodes:  # down() killed them with their namespaces; reap the Popen objects
            if node.proc is not None:
                if node.proc.poll() is None:
                    node.proc.kill()
                node.proc.wait(timeout=10)
        shutil.copytree(root, tmp_path / "labs", ignore=shutil.ignore_patterns("*.sock"), dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------ restarts under the sandbox

# Every program on every device of the namespace it runs in: tcx and cls_bpf, named by id
# (the test runs as root, with CAP_SYS_ADMIN: it sees what the agent cannot).
HOOKS_OF = r"""
import json, socket
from agentd.dataplane.bpf import tc
print(json.dumps({dev: [[f.direction, f.kind, f.name, f.prog_id, f.link_id] for f in tc.filters(i)]
                  for i, dev in socket.if_nameindex()}))
"""


def hooks_of(ns) -> dict[str, list[tuple[str, str, str | None, int, int]]]:
    """device -> (direction, kind, name, program id, link id) of every program on its hooks."""
    return {dev: [tuple(f) for f in found] for dev, found in json.loads(ns.exec(sys.executable, "-c", HOOKS_OF)).items()}


def loaded(status: dict) -> dict[str, int]:
    """The agent's own word on the programs it runs: name -> id."""
    bpf, fast = status["backends"]["bpf"], status["policy"]["fast_path"]
    ids = {"agentd_egress": bpf["programs"]["egress"]["id"], "agentd_ingress": bpf["programs"]["ingress"]["id"]}
    if fast["on"]:
        ids.update({"agentd_pod_fast": fast["program"]["id"], "agentd_pod_wire": fast["between_nodes"]["program"]["id"]})
    return ids


def takeover(node, hook: str, fast: bool, pods: int = 2) -> str | None:
    """Why the node's agent has not (yet) taken every hook over, or None: ready, its programs --
    and only those -- on the underlay (both data-path programs, and with the pod fast path
    (``fast``) the wire program), on the pods' bridge (the member filter) and on each of its
    ``pods`` veths (the fast path), attached by ``hook``, each tcx one held by a link."""
    status = node.api_or_none("/status")
    if not status or not status.get("ready"):
        return "not ready"
    if not status["backends"]["bpf"].get("active") or status["policy"]["fast_path"]["on"] != fast:
        return f"BPF: {status['backends']['bpf']} / {status['policy']['fast_path']}"
    ids = loaded(status)
    kind = "tcx" if hook == "tcx" else "bpf"
    placed: dict[str, list[str]] = {}
    for dev, found in hooks_of(node.ns).items():
        for direction, k, name, prog_id, link_id in found:
            if name not in ids or prog_id != ids[name] or k != kind or (kind == "tcx") != bool(link_id):
                return f"{dev} {direction}: {k} {name} id {prog_id} link {link_id}, not one of {ids} by {hook}"
            placed.setdefault(name, []).append(f"{dev} {direction}")
    want = {"agentd_egress": ["eth0 egress"], "agentd_pod_wire": ["eth0 ingress"] if fast else None,
            "agentd_pod_fast": pods if fast else 0, "agentd_ingress": 2}  # the underlay and the pods' bridge
    got = {n: len(placed.get(n, [])) if isinstance(w, int) else placed.get(n) for n, w in want.items()}
    return None if got == want else f"programs placed {placed}"


def stop_stream(client: subprocess.Popen) -> list[float]:
    """SIGINT to an ``iperf3 -c`` started with stdout piped; the bytes of each interval it
    reported, but the last (cut short by the signal)."""
    client.send_signal(signal.SIGINT)
    out, _ = client.communicate(timeout=10)
    units = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}
    sizes = [float(m[1]) * units[m[2]] for m in re.finditer(r"sec\s+([\d.]+) ([KMG]?)Bytes\s+[\d.]+ \w*bits/sec(?!.*(?:sender|receiver))", out)]
    assert len(sizes) > 2, out
    return sizes[:-1]


@pytest.mark.parametrize("hook", ["tcx", "clsact"])
async def test_restarts_under_the_units_sandbox_take_the_programs_over(tmp_path, hook):
    """Two nodes under the unit's sandbox, node1 on udp (carried in BPF), node2 on vxlan (the
    BPF member filter); each runs both backends' BPF and the pod fast path.  Both agents are
    killed (SIGKILL: Restart=, the watchdog), started again in their sandboxes, and later
    stopped (SIGTERM: an upgrade) and started again.  Each time the new agents take every hook
    over with their own programs (the member filter there, udp in BPF and not in the
    user-space worker: no fall-back, the fast path on the pods' veths and the underlay), while
    a ping between the nodes' pods and a TCP stream between node2's pods (carried by its fast
    path) run throughout without losing a packet or stalling.  Neither has CAP_SYS_ADMIN.
    Then node1 is restarted with docs/operations.md's drop-in that takes CAP_PERFMON away:
    its agent takes the data path over, says why the fast path is off, and has removed its
    predecessor's fast path from every hook (a fast path no agent keeps would go on steering
    packets by pods that may be gone)."""
    if hook == "tcx" and not tc.tcx_available():  # asking for it is refused, saying why (test_bpf_datapath)
        with pytest.raises(tc.TcError, match="no tcx hooks"):
            tc.resolve(hook)
        return
    unit, no_perfmon = tmp_path / "sandbox.json", tmp_path / "sandbox-no-perfmon.json"
    unit.write_text(json.dumps(sandbox_spec()))
    no_perfmon.write_text(json.dumps(sandbox_spec(perfmon_drop_in())))
    assert set(json.loads(unit.read_text())["keep_caps"]) - set(json.loads(no_perfmon.read_text())["keep_caps"]) == {
        capability_numbers()["CAP_PERFMON"]}
    root = Path(tempfile.mkdtemp(prefix="ad-sb-"))  # a short root: see test_lab_runs_under_the_units_sandbox
    lab = Lab(
        LabSpec(name="sr" + unique_tag("")[:6], nodes=2, pods=2,
                extra={name: {"network": {"backend": b, "bpf_attach": hook}}
                       for name, b in (("node1", "udp"), ("node2", "vxlan"))}),
        root=root,
    )  # fmt: skip
    node1, node2 = lab.nodes
    node1.start_agent, node2.start_agent = sandboxed(node1, unit), sandboxed(node2, unit)
    fast = {node1: True, node2: True}
    pinger = server = client = None

    def settled(node) -> bool:
        return takeover(node, hook, fast[node]) is None

    try:
        await lab.up(timeout=90)
        for node in lab.nodes:
            await auntil(lambda n=node: settled(n), 30, in_thread=True,
                         what=lambda n=node: f"{n.name}'s programs on its hooks: {takeover(n, hook, fast[n])}")
        here, there = (p for p in lab.pods if p.node is node2)
        far = next(p for p in lab.pods if p.node is node1)
        # Pod traffic for the whole test: across the nodes (udp in BPF one way, VXLAN through
        # the member filter the other), and a TCP stream between node2's pods (the fast path).
        pinger = Pinger(far.ns, here.ip, interval=0.05)
        server = here.ns.popen(["iperf3", "-s", "-p", "5201"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await auntil(lambda: here.ns.exec("ss", "-Hltn", "sport = :5201").strip(), 10, in_thread=True,
                     what="iperf3 listening")
        client = there.ns.popen(["iperf3", "-c", here.ip, "-p", "5201", "-t", "600", "-i", "1", "-b", "20M",
                                 "--forceflush"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def carried() -> int:
            return node2.api("/status")["policy"]["fast_path"]["packets"].get("carried", 0)

        await auntil(lambda: carried() > 100, 15, in_thread=True, what="the fast path carrying the stream")
        for sig in (signal.SIGKILL, signal.SIGTERM):
            before = {node: loaded(node.api("/status")) for node in lab.nodes}
            count = carried()
            for node in lab.nodes:
                await node.stop_agent(sig)
            for node in lab.nodes:
                node.start_agent()
            for node in lab.nodes:
                await auntil(lambda n=node: settled(n), 90, in_thread=True,
                             what=lambda n=node: f"{n.name}'s new agent (after signal {sig}) on every hook: "
                                                 f"{takeover(n, hook, fast[n])}; log {n.log_path}")  # fmt: skip
                status = node.api("/status")
                assert not set(loaded(status).values()) & set(before[node].values()), (before[node], loaded(status))
                backends = status["backends"]
                assert backends["active"]["udp"]["datapath"] == "bpf" and "fallback" not in backends["active"]["udp"]
                assert backends["member_filter"] == {"bpf": ["udp", "vxlan"], "userspace": [], "missing": {}}, backends
                assert backends["bpf"]["hook"] == hook and backends["bpf"]["unidentified_programs"] == [], backends
            view = node2.api("/status")["policy"]["fast_path"]
            assert view["hook"] == hook and view["adopted_maps"] and view["between_nodes"]["on"], view
            assert view["unidentified_programs"] == [], view
            await auntil(lambda c=count: carried() > c + 100, 15, in_thread=True,
                         what="the new agent's fast path carrying the stream")
        for node in lab.nodes:
            assert sandboxed_caps(node.agent_pid()) == sum(1 << c for c in json.loads(unit.read_text())["keep_caps"])
        intervals = stop_stream(client)
        assert min(intervals) > 0, f"the stream stalled: {intervals}"
        answered = pinger.replies()  # answers after the last restart: every echo before is checked
        await auntil(lambda: pinger.replies() >= answered + 20, what=lambda: f"pings answered: {pinger.lines[-3:]}")
        sent, missing = pinger.stop()  # those after the last answer may still have been on their way
        assert sent > 0 and not missing, (sent, sorted(missing)[:20], pinger.trouble(), pinger.lines[-3:])
        for node in lab.nodes:
            text = node.log_path.read_text()
            for bad in ("Operation not permitted", "not its first data path", "no member filter"):
                assert bad not in text, f"{bad!r} in {node.log_path}"

        # The drop-in taking CAP_PERFMON away, on node1: its data path taken over, its fast path
        # off and gone from every hook (takeover() with fast=False: no program of it anywhere).
        node1.start_agent, fast[node1] = sandboxed(node1, no_perfmon), False
        await node1.stop_agent(signal.SIGTERM)
        node1.start_agent()
        await auntil(lambda: settled(node1), 90, in_thread=True,
                     what=lambda: f"node1 without CAP_PERFMON: {takeover(node1, hook, False)}; log {node1.log_path}")
        view = node1.api("/status")["policy"]["fast_path"]
        assert view["error"].startswith("the pod fast path needs CAP_PERFMON, which this agent lacks"), view
        assert sandboxed_caps(node1.agent_pid()) == sum(1 << c for c in json.loads(no_perfmon.read_text())["keep_caps"])
        text = node1.log_path.read_text()
        assert "pod fast path off: removed the pod fast path from 2 veths" in text and "Traceback" not in text, text[-3000:]
    finally:
        if pinger is not None:
            pinger.close()
        for proc in (client, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        await lab.down(keep_files=True)
        for node in lab.nodes:
            if node.proc is not None:
                if node.proc.poll() is None:
                    node.proc.kill()
                node.proc.wait(timeout=10)
        shutil.copytree(root, tmp_path / "labs", ignore=shutil.ignore_patterns("*.sock"), dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)


# Run inside the sandbox, in the device's namespace: what a restarted agent does (open the data
# path), and what it then knows of the device's hooks.
REOPEN = r"""
import json, logging, sys
from agentd.dataplane.bpf import BpfDatapath, Config, tc
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
ifindex, bpf_dir, hook = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dp = BpfDatapath(ifindex, bpf_dir, attach=hook)
dp.open(Config("192.168.50.2", 8285, 4789, 0, 1500))
print(json.dumps({"status": dp.status(), "hooks": [[f.direction, f.kind, f.name, f.prog_id, f.link_id]
                                                   for f in tc.filters(ifindex, tc.Pins.read(dp.dir))]}))
"""


@pytest.mark.parametrize("hook", ["tcx", "clsact"])
def test_an_agent_before_links_is_taken_over_with_the_units_capabilities(netns_factory, bpffs, tmp_path, hook):
    """An agent before links left its data path on tcx without one, its programs pinned by
    name -- and one more program it never pinned (it died between attaching and pinning).  An
    agent with only the unit's capabilities takes the device over by either hook: the pinned
    ones recognised by their pins and removed, ours on; the unpinned one, which it cannot name
    (that takes CAP_SYS_ADMIN), left in place and said so, in its status and once in its log.
    An agent with CAP_SYS_ADMIN names it and removes it."""
    if not tc.tcx_available():  # no agent before links could have used tcx here
        with pytest.raises(tc.TcError, match="no tcx hooks"):
            tc.resolve("tcx")
        return
    from agentd.dataplane.bpf import OBJECT, BpfDatapath, Config, layout, libbpf

    ns = netns_factory("h")
    ns.ip("link", "add", "u0", "type", "veth", "peer", "name", "u9")
    ns.ip("link", "set", "u0", "up")
    ifindex = int(ns.exec("cat", "/sys/class/net/u0/ifindex"))
    config = Config("192.168.50.2", 8285, 4789, 0, 1500)
    tcx = {layout.EGRESS: libbpf.TCX_EGRESS, layout.INGRESS: libbpf.TCX_INGRESS}
    with ns.entered():
        dp = BpfDatapath(ifindex, bpffs, attach="tcx")
        dp.open(config)
        tc.remove_links(dp.pins, tc.OURS)  # as an agent before links attached them:
        for name, attach_type in tcx.items():
            libbpf.tcx_attach(ifindex, attach_type, dp.progs[name])
        old = set(dp.prog_ids.values())
        stray_dir = Path(bpffs) / "stray"
        stray_dir.mkdir()
        with libbpf.BpfObject(OBJECT) as obj:  # the same object again, its program never pinned
            obj.pin_maps_in(stray_dir)
            obj.load()
            libbpf.tcx_attach(ifindex, libbpf.TCX_INGRESS, obj.prog_fd(layout.INGRESS))
            stray = libbpf.prog_info(obj.prog_fd(layout.INGRESS))["id"]
        shutil.rmtree(stray_dir)  # (its maps' pins: the program holds the maps)
        dp.close()
    assert [(d, k, n, link) for d, k, n, _, link in hooks_of(ns)["u0"]] == [
        ("ingress", "tcx", "agentd_ingress", 0), ("ingress", "tcx", "agentd_ingress", 0), ("egress", "tcx", "agentd_egress", 0)]

    spec = tmp_path / "sandbox.json"
    spec.write_text(json.dumps(sandbox_spec()))
    proc = ns.popen([sys.executable, "-c", SANDBOX, str(spec), "--", sys.executable, "-c", REOPEN, str(ifindex),
                     bpffs, hook], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    seen = json.loads(out)
    new = {seen["status"]["programs"]["egress"]["id"], seen["status"]["programs"]["ingress"]["id"]}
    (line,) = seen["status"]["unidentified_programs"]
    assert line.startswith(f"u0 ingress (tcx): program {stray}, attached without a link") and "CAP_SYS_ADMIN" in line
    assert err.count(f"program {stray},") == 1, err  # said once in the log
    # What the sandboxed agent knows of the hook: ours (named by its pins) and the stray, unnamed.
    kind = "tcx" if hook == "tcx" else "bpf"
    assert sorted(((d, k, n) for d, k, n, _, _ in seen["hooks"]), key=str) == sorted(
        [("egress", kind, "agentd_egress"), ("ingress", kind, "agentd_ingress"), ("ingress", "tcx", None)], key=str)
    hooks = hooks_of(ns)["u0"]
    assert {i for *_, i, _ in hooks} == new | {stray} and not old & {i for *_, i, _ in hooks}, hooks
    if hook == "tcx":  # ours first, by a link; the stray after it
        assert [(i, bool(link)) for d, _, _, i, link in hooks if d == "ingress"] == [
            (seen["status"]["programs"]["ingress"]["id"], True), (stray, False)]

    # An agent with CAP_SYS_ADMIN (this test) names the stray by its id: agentd's, removed.
    with ns.entered():
        dp = BpfDatapath(ifindex, bpffs, attach=hook)
        dp.open(config)
        assert dp.status()["unidentified_programs"] == []
        assert {n for _, _, n, _, _ in hooks_of(ns)["u0"]} == set(tc.OURS)
        assert stray not in {i for *_, i, _ in hooks_of(ns)["u0"]}
        dp.remove()
    assert hooks_of(ns).get("u0") == [] and not dp.dir.exists()
