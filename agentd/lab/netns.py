"""Network namespace primitives for the lab and the system tests.

Rules kept here so callers cannot forget them:

* Nothing is ever created in the root network namespace.  veth pairs are created
  with both ends already inside lab namespaces (``ip -n A link add X type veth
  peer name Y netns B`` asks the kernel to create them there directly).
* Every namespace this module makes is named ``ad-<tag>-<role>`` so a lab or test
  run can find and remove exactly its own (``delete_matching``).
* Deleting a namespace first kills every process still running inside it.
* In a test run (:func:`tie_children_to_this_process`, which tests/conftest.py calls), the
  long-running processes started here die with the run, even a SIGKILLed one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from agentd.kernel.netns import NETNS_DIR, entered
from agentd.lab.wait import until

NAME_PREFIX = "ad-"
# Per-namespace files: `ip netns exec NAME` bind-mounts /etc/netns/NAME/<file> over /etc/<file>
# (a pod's resolv.conf); they go with the namespace.
ETC_NETNS = "/etc/netns"


PR_SET_PDEATHSIG = 1  # linux/prctl.h
_tie_children = False


def tie_children_to_this_process(on: bool = True) -> None:
    """From now on, daemons this process starts (:meth:`Netns.popen`, :func:`tied`) get
    PR_SET_PDEATHSIG SIGKILL: when the test run ends in any way -- a SIGKILL after a CI
    timeout included, when no finalizer runs -- the kernel kills them, instead of leaving
    etcd, the agents, BIRD or a dockerd running in namespaces nobody removes.

    Off unless asked for: ``agentd lab up`` and ``scripts/dev compose up`` start daemons that
    must outlive the command.  The signal is sent when the *thread* that started the child
    ends, so only children started from the main thread get it (it lives as long as the
    process; pytest and its xdist workers run tests there, and so does their event loop); one
    started from a worker thread (asyncio.to_thread, an executor: the Docker hosts' dockerds)
    would be killed when that thread is retired, and is left without (the namespace it runs
    in goes with the lab's teardown).  Also cleared by the kernel when the child executes a
    binary with file capabilities or set-user-ID."""
    global _tie_children
    _tie_children = on


# In a test run, each namespace made names the process that made it here (``PID STARTTIME``),
# so the next run can remove those of a run that was killed (:func:`sweep_dead_owners`).
OWNERS_DIR = "/run/agentd-netns-owners"


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (when it started, in clock ticks since boot): a PID and its
    start time name one process, even after the PID is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def _record_owner(name: str) -> None:
    if not _tie_children:
        return
    pid = os.getpid()
    with contextlib.suppress(OSError):  # a tidy-up aid: the namespace works without it
        os.makedirs(OWNERS_DIR, exist_ok=True)
        with open(os.path.join(OWNERS_DIR, name), "w") as f:
            f.write(f"{pid} {_start_time(pid)}\n")


def _forget_owner(name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(OWNERS_DIR, name))


def record_owner(name: str) -> None:
    """Record namespace ``name`` as this test run's (when :func:`tie_children_to_this_process`
    is on), for one that another process makes for it: the compose lab's engine namespace,
    made by the ``compose up`` command a test runs."""
    _record_owner(name)


def sweep_dead_owners(before_delete: Callable[[str], None] | None = None) -> list[str]:
    """Delete the namespaces (and what runs in them) that test runs made and left when they
    were killed: those recorded in :data:`OWNERS_DIR` whose process is gone.  Namespaces of
    runs still going, of ``agentd lab up`` (never recorded) and names not ours are left alone.
    ``before_delete(name)`` is called first for each (stopping what keeps more than the
    namespace's processes: a Docker engine's containers, agentd.lab.fixtures); its errors are
    ignored.  Returns the names deleted."""
    try:
        names = sorted(os.listdir(OWNERS_DIR))
    except FileNotFoundError:
        return []
    deleted = []
    for name in names:
        if not name.startswith(NAME_PREFIX) or "/" in name:
            continue
        try:
            with open(os.path.join(OWNERS_DIR, name)) as f:
                pid_text, _, start = f.read().strip().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if _start_time(pid) == start:  # its run is still going (here, or beside us)
            continue
        ns = Netns(name)
        if ns.exists():
            if before_delete is not None:
                with contextlib.suppress(Exception):  # a tidy-up aid: deleting goes on regardless
                    before_delete(name)
            try:
                ns.delete()
            except (OSError, subprocess.SubprocessError, NetnsError):
                continue  # tried again by the next run
            deleted.append(name)
        _forget_owner(name)
    return deleted


def tied(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``subprocess.Popen`` keyword arguments with the parent-death signal added when
    :func:`tie_children_to_this_process` is on and this is the main thread (else as given)."""
    if not _tie_children or "preexec_fn" in kwargs or threading.current_thread() is not threading.main_thread():
        return kwargs
    return {**kwargs, "preexec_fn": _die_with(os.getpid())}


def _die_with(parent: int) -> Callable[[], None]:
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it

    def child() -> None:  # after fork, before exec: nothing that takes a lock
        if prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent:  # the parent died before the prctl: no signal will come
            os.kill(os.getpid(), signal.SIGKILL)

    return child


class NetnsError(RuntimeError):
    """A namespace operation failed; the message names the command and its stderr."""


def unique_tag(kind: str = "t") -> str:
    """A short tag unique to this process and call, e.g. ``t4f2a9c``."""
    return f"{kind}{secrets.token_hex(3)}"


def run(
    args: Sequence[str],
    *,
    ns: str | None = None,
    check: bool = True,
    input: bytes | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[bytes]:
    """Run a command (inside ``ns`` if given) and return the completed process."""
    argv = _in_ns(args, ns)
    proc = subprocess.run(argv, input=input, capture_output=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise NetnsError(
            f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.decode(errors='replace').strip()}"
        )
    return proc


async def arun(
    args: Sequence[str],
    *,
    ns: str | None = None,
    check: bool = True,
    input: bytes | None = None,
    timeout: float = 60,
) -> tuple[int, bytes, bytes]:
    """asyncio variant of :func:`run`; returns ``(returncode, stdout, stderr)``."""
    argv = _in_ns(args, ns)
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(input), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise NetnsError(f"{' '.join(argv)} timed out after {timeout}s") from None
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} exited {proc.returncode}: {err.decode(errors='replace').strip()}")
    return proc.returncode or 0, out, err


def _in_ns(args: Sequence[str], ns: str | None) -> list[str]:
    return ["ip", "netns", "exec", ns, *args] if ns else list(args)


class Netns:
    """One named network namespace.  Create with :meth:`create`, remove with :meth:`delete`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Netns({self.name!r})"

    @property
    def path(self) -> str:
        return f"{NETNS_DIR}/{self.name}"

    @classmethod
    def create(cls, name: str) -> Netns:
        if not name.startswith(NAME_PREFIX):
            raise ValueError(f"namespace names must start with {NAME_PREFIX!r}: {name!r}")
        run(["ip", "netns", "add", name])
        _record_owner(name)
        ns = cls(name)
        ns.ip("link", "set", "lo", "up")
        return ns

    @classmethod
    def attach(cls, name: str, pid: int) -> Netns:
        """Name the network namespace process ``pid`` is in (``ip netns attach``: a container's,
        made by its runtime), recorded as :meth:`create` records one: the name keeps the
        namespace alive after the process is gone, so a killed run's must be swept too."""
        if not name.startswith(NAME_PREFIX):
            raise ValueError(f"namespace names must start with {NAME_PREFIX!r}: {name!r}")
        run(["ip", "netns", "attach", name, str(pid)])
        _record_owner(name)
        return cls(name)

    def exists(self) -> bool:
        return os.path.exists(self.path)

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        """``ip -n NAME ARGS...``"""
        return run(["ip", "-n", self.name, *args], check=check)

    def exec(self, *args: str, check: bool = True, timeout: float = 60, input: bytes | None = None) -> str:
        """Run a command inside the namespace and return its stdout as text."""
        return run(args, ns=self.name, check=check, timeout=timeout, input=input).stdout.decode()

    def popen(self, args: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start a long-running process inside the namespace (tied to this process in a test
        run: :func:`tie_children_to_this_process`)."""
        return subprocess.Popen(_in_ns(args, self.name), **tied(kwargs))

    async def aexec(self, *args: str, check: bool = True, timeout: float = 60) -> tuple[int, bytes, bytes]:
        return await arun(args, ns=self.name, check=check, timeout=timeout)

    def sysctl(self, key: str, value: str | int) -> None:
        run(["sysctl", "-q", "-w", f"{key}={value}"], ns=self.name)

    def pids(self) -> list[int]:
        out = run(["ip", "netns", "pids", self.name], check=False).stdout.decode()
        return [int(p) for p in out.split()]

    def kill_all(self, grace: float = 2.0) -> None:
        """SIGTERM every process in the namespace, then SIGKILL what is left."""
        pids = self.pids()
        for sig, timeout in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            with contextlib.suppress(AssertionError):
                until(lambda: not self.pids(), timeout, what=f"the processes in {self.name} to exit")
                return
            pids = self.pids()

    @property
    def etc(self) -> str:
        """/etc/netns/NAME: files `ip netns exec` shows in place of /etc's (see ETC_NETNS)."""
        return f"{ETC_NETNS}/{self.name}"

    def delete(self) -> None:
        """Kill everything inside and remove the namespace and its /etc/netns files.  Idempotent."""
        if self.exists():
            self.kill_all()
            run(["ip", "netns", "del", self.name], check=False)
        if self.name.startswith(NAME_PREFIX):
            shutil.rmtree(self.etc, ignore_errors=True)
        _forget_owner(self.name)

    def connect(self, host: str, port: int, timeout: float = 5.0) -> socket.socket:
        """A TCP connection made from inside this namespace (usable from the calling process)."""
        with self.entered():
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect((host, port))
        except OSError:
            sock.close()
            raise
        return sock

    def http_get(self, url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """``GET url`` from inside the namespace; returns (status, body).  Plain HTTP/1.0 only;
        ``headers`` are sent too (``Host`` among them replaces the URL's)."""
        parts = urllib.parse.urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        fields = {"Host": host, **(headers or {}), "Connection": "close"}
        head = "".join(f"{k}: {v}\r\n" for k, v in fields.items())
        with self.connect(host, port, timeout) as sock:
            sock.sendall(f"GET {path} HTTP/1.0\r\n{head}\r\n".encode())
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        raw = b"".join(chunks)
        # An empty or foreign reply (the agent's API closes a connection at once when it is over
        # its connection limit or shutting down) is a ValueError, as a garbled one is.
        if not raw.startswith(b"HTTP/"):
            raise ValueError(f"GET {url}: not an HTTP reply ({len(raw)} bytes: {raw[:40]!r})")
        head, _, body = raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        return status, body

    def http_json(self, url: str, timeout: float = 5.0, headers: dict[str, str] | None = None):
        """``GET url`` inside the namespace and decode the JSON body (any status)."""
        return json.loads(self.http_get(url, timeout, headers)[1])

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the block with the *calling thread* inside this namespace.

        Sockets created inside the block stay bound to the namespace after it
        ends, which is how in-process tests open netlink or UDP sockets there.
        Keep the block short and free of awaits: the whole thread moves.
        """
        with entered(self.path):
            yield


def veth(a: Netns, if_a: str, b: Netns, if_b: str, *, mtu: int | None = None, up: bool = True) -> None:
    """Create a veth pair with one end in ``a`` and the other in ``b`` (never the root namespace)."""
    for ifname in (if_a, if_b):
        if len(ifname) > 15:
            raise ValueError(f"interface name longer than 15 characters: {ifname!r}")
    args = ["link", "add", if_a]
    if mtu:
        args += ["mtu", str(mtu)]
    args += ["type", "veth", "peer", "name", if_b, "netns", b.name]
    if mtu:
        args += ["mtu", str(mtu)]
    a.ip(*args)
    if up:
        a.ip("link", "set", if_a, "up")
        b.ip("link", "set", if_b, "up")


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    """SIGCONT (a frozen process cannot act on SIGTERM), SIGTERM, wait; SIGKILL after ``timeout``.
    Returns the exit status; idempotent."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


def list_names(prefix: str = NAME_PREFIX) -> list[str]:
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(prefix))


def delete_matching(prefix: str) -> list[str]:
    """Delete every namespace whose name starts with ``prefix``; returns their names."""
    if not prefix.startswith(NAME_PREFIX):
        raise ValueError(f"refusing to delete namespaces outside {NAME_PREFIX!r}: {prefix!r}")
    names = list_names(prefix)
    for name in names:
        Netns(name).delete()
    with contextlib.suppress(FileNotFoundError):  # files of namespaces already gone
        for name in os.listdir(ETC_NETNS):
            if name.startswith(prefix):
                Netns(name).delete()
    return names
