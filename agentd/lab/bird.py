"""A real BIRD 2 routing daemon for the system tests, the lab and the benches.

``Bird`` runs ``bird -f`` (foreground, so this process owns it) inside a lab namespace
with its configuration, control socket and log in a work directory, and talks to it
through ``birdc``::

    bird = Bird(ns, tmp_path / "bird", BIRD_CONF)
    bird.start()
    bird.wait_established("spk1", timeout=20)
    routes = bird.routes()            # {"10.99.1.0/24": {"via": "10.0.0.1", "BGP.as_path": "65000", ...}}
    bird.reconfigure(new_conf)        # rewrite bird.conf + `birdc configure`
    bird.stop()

The configuration text is used as given, with one line put in front of it:
``log "<workdir>/bird.log" all;`` so every run leaves a log next to its configuration
(``log_tail()`` shows its end in error messages).

Graceful restart (RFC 4724) the way BIRD does it: ``birdc graceful restart`` makes BIRD
close its BGP sessions *without* a NOTIFICATION and exit; started again with ``-R``
("graceful restart recovery") it advertises the Restart State bit and waits for its
peers' End-of-RIB before it recomputes and re-announces.  :meth:`Bird.graceful_restart`
does both steps.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from agentd.lab.netns import Netns
from agentd.lab.process import LabProcess
from agentd.lab.wait import pause

BIRD_BINARY = "bird"
BIRDC_BINARY = "birdc"
START_TIMEOUT = 10.0
STOP_GRACE = 10.0  # graceful restart: how long BIRD may take to exit
# sockaddr_un.sun_path is 108 bytes; pytest's tmp_path can be long.
_MAX_SOCKET_PATH = 100
_LOG_TAIL_LINES = 30

# "10.99.1.0/24         unicast [spk1 10:20:30.123 from 10.0.0.3] * (100) [AS65001i]"
# "                     unicast [spk2 10:20:30.456] (100) [i]"   (an alternative for the same prefix)
_ROUTE_LINE = re.compile(
    r"^(?P<prefix>\S+)?\s+(?P<kind>\w+) \[(?P<proto>\S+) (?P<since>[^\]\s]+)(?: from (?P<from>[^\]]+))?\]"
    r"(?P<best> \*)?(?: \((?P<preference>\d+)(?:/\S+)?\))?(?: \[(?P<tag>[^\]]*)\])?"
)
_VIA_LINE = re.compile(r"^\s+via (?P<via>\S+)(?: on (?P<dev>\S+))?")
_DEV_LINE = re.compile(r"^\s+dev (?P<dev>\S+)")
_ATTR_LINE = re.compile(r"^\s+(?P<key>[A-Za-z][\w.]*(?: [\w.]+)?): ?(?P<value>.*)$")
_BGP_STATE = re.compile(r"^\s+BGP state:\s+(?P<state>\w+)", re.MULTILINE)


class BirdError(RuntimeError):
    """BIRD could not be started, stopped or queried; the message carries the tail of its log."""


class Bird(LabProcess):
    """One BIRD 2 daemon inside ``ns``.  ``start()``, ``stop()``; restartable."""

    label = "bird"
    error = BirdError

    def __init__(self, ns: Netns, workdir: str | os.PathLike[str], config: str) -> None:
        self.workdir = Path(workdir)
        # The process's own output; BIRD writes its log (``log_path``) itself.
        super().__init__(ns, self.workdir / "bird.stderr")
        self.stderr_path = self.output_path
        self.config_path = self.workdir / "bird.conf"
        self.log_path = self.workdir / "bird.log"
        self.socket_path = _socket_path(self.workdir)
        self.config = config
        self._write_config(config)

    # ------------------------------------------------------------ lifecycle

    def start(self, *, recovery: bool = False, timeout: float = START_TIMEOUT) -> None:
        """Start BIRD (``recovery``: with ``-R``, graceful restart recovery) and wait for its socket."""
        if self.running:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        argv = [BIRD_BINARY, "-f", "-c", str(self.config_path), "-s", self.socket_path]
        self.spawn(argv + ["-R"] if recovery else argv)
        try:
            self.wait_until(lambda: os.path.exists(self.socket_path) and self._ping(), timeout,
                            what=f"bird to answer on {self.socket_path}")
        except BirdError:
            self.kill()
            raise

    def graceful_restart(self, *, down_for: float = 0.0, timeout: float = STOP_GRACE) -> None:
        """``birdc graceful restart`` (sessions closed without NOTIFICATION, BIRD exits), wait
        ``down_for`` seconds, then start again with ``-R`` (graceful restart recovery)."""
        proc = self._proc
        if proc is None:
            raise BirdError("graceful_restart: bird is not running")
        self.birdc("graceful", "restart")
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise BirdError(f"bird did not exit within {timeout:.0f}s of `graceful restart`:\n{self.log_tail()}") from None
        self._forget()
        if down_for:
            pause(down_for, "BIRD stays down for the restart time the test asked for")
        self.start(recovery=True)

    def reconfigure(self, config: str) -> str:
        """Rewrite the configuration and ``birdc configure``; returns birdc's answer."""
        self._write_config(config)
        out = self.birdc("configure")
        if "Reconfigured" not in out and "Reconfiguration in progress" not in out:
            raise BirdError(f"birdc configure failed: {out.strip()}")
        return out

    # ------------------------------------------------------------ queries

    def birdc(self, *args: str, timeout: float = 10.0, check: bool = True) -> str:
        """Run one ``birdc`` command against this BIRD and return its output (text)."""
        proc = subprocess.run(
            [BIRDC_BINARY, "-s", self.socket_path, *args], capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        out = proc.stdout.decode(errors="replace")
        if check and (proc.returncode != 0 or "Unable to connect" in out):
            raise BirdError(f"birdc {' '.join(args)} exited {proc.returncode}: {out.strip()} {proc.stderr.decode().strip()}")
        return out

    def routes(self, table: str = "master4") -> dict[str, dict[str, Any]]:
        """``show route all table T`` as ``{prefix: route}`` for the preferred route of each prefix.

        A route is a dict with ``kind`` ("unicast", "blackhole", ...), ``protocol``, ``best``,
        ``preference``, ``from``, ``via`` (the gateway), ``dev``, and every attribute line under it
        by BIRD's name (``Type``, ``BGP.origin``, ``BGP.as_path``, ``BGP.next_hop``,
        ``BGP.local_pref``, ``BGP.originator_id``, ``BGP.cluster_list``, ...), values as text.
        ``alternatives`` lists the other routes BIRD has for the prefix (same shape).
        """
        out = self.birdc("show", "route", "all", "table", table)
        return parse_routes(out)

    def protocol_state(self, name: str) -> str:
        """The BGP session state of protocol ``name``: "Established", "Idle", "Active", "Connect"... """
        out = self.birdc("show", "protocols", "all", name)
        m = _BGP_STATE.search(out)
        if m is None:
            raise BirdError(f"no BGP state for protocol {name!r} in:\n{out.strip()}")
        return m.group("state")

    def protocol_info(self, name: str) -> str:
        """``show protocols all NAME`` as text (for messages and reports)."""
        return self.birdc("show", "protocols", "all", name, check=False)

    def wait_established(self, name: str, timeout: float = 20.0) -> None:
        self.wait_until(lambda: self.protocol_state(name) == "Established", timeout,
                        what=lambda: f"protocol {name} Established:\n{self.protocol_info(name)}")

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The end of BIRD's log and of its own output."""
        text = []
        for path in (self.log_path, self.stderr_path):
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                text.extend(f.readlines()[-lines:])
        return "".join(text)

    # ------------------------------------------------------------ internals

    def _write_config(self, config: str) -> None:
        self.config = config
        self.config_path.write_text(f'log "{self.log_path}" all;\n{config}')

    def _ping(self) -> bool:
        try:
            out = self.birdc("show", "status", timeout=2.0, check=False)
        except subprocess.TimeoutExpired:
            return False
        return "Daemon is up and running" in out or "Router ID" in out


def parse_routes(text: str) -> dict[str, dict[str, Any]]:
    """Parse ``birdc show route all`` output (BIRD 2.0); see :meth:`Bird.routes`."""
    result: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    prefix: str | None = None
    for line in text.splitlines():
        if not line.strip() or line.startswith(("BIRD ", "Table ", "Access restricted")):
            continue
        m = _ROUTE_LINE.match(line)
        if m and (m.group("prefix") or prefix):
            if m.group("prefix"):
                prefix = m.group("prefix")
            current = {
                "prefix": prefix,
                "kind": m.group("kind"),
                "protocol": m.group("proto"),
                "from": m.group("from"),
                "best": bool(m.group("best")),
                "preference": int(m.group("preference")) if m.group("preference") else None,
                "tag": m.group("tag"),
                "via": None,
                "dev": None,
            }
            first = result.get(prefix)  # type: ignore[arg-type]
            if first is None:
                current["alternatives"] = []
                result[prefix] = current  # type: ignore[index]
            else:
                first["alternatives"].append(current)
            continue
        if current is None:
            continue
        if m := _VIA_LINE.match(line):
            current["via"] = m.group("via")
            current["dev"] = m.group("dev")
        elif m := _DEV_LINE.match(line):
            current["dev"] = m.group("dev")
        elif m := _ATTR_LINE.match(line):
            current[m.group("key")] = m.group("value").strip()
    return result


def _socket_path(workdir: Path) -> str:
    path = str(workdir / "bird.ctl")
    if len(path) <= _MAX_SOCKET_PATH:
        return path
    digest = hashlib.sha1(str(workdir).encode()).hexdigest()[:12]
    return f"/tmp/ad-bird-{digest}.ctl"
