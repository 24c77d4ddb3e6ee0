"""``agentd speaker`` as a real process inside a lab namespace, for the system tests.

The configuration is a plain dict in the shape of the TOML file (sections as dicts,
``[[bgp.peers]]`` as a list of dicts); :func:`render_toml` writes it.  The speaker runs
as ``ip netns exec NS <venv>/bin/agentd speaker --config FILE``, its log goes to a file
in the work directory, and its REST API is queried from inside the namespace::

    spk = SpeakerProcess(ns, tmp_path / "spk1", {
        "node": {"name": "spk1", "address": "10.0.0.1", "asn": 65000},
        "bgp": {"listen": "10.0.0.1:179", "hold_time": 9, "originate": ["10.99.1.0/24"],
                "peers": [{"address": "10.0.0.2", "asn": 65000}]},
    })
    spk.start(); spk.wait_ready()
    spk.wait_peer_state("10.0.0.2", "Established", timeout=20)
    spk.rib()                          # GET /rib
    spk.reload({... "originate": []})  # rewrite the file + SIGHUP
    spk.stop()                         # SIGTERM

``[api] listen`` defaults to 127.0.0.1:9099 and ``[log] level`` to "debug" when the dict
does not set them (each speaker has its own namespace, so the port never clashes).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agentd.lab.netns import Netns, stop_process
from agentd.lab.wait import until

DEFAULT_API = "127.0.0.1:9099"
START_TIMEOUT = 15.0
STOP_GRACE = 10.0
_LOG_TAIL_LINES = 40


class SpeakerError(RuntimeError):
    """The speaker could not be started or queried, or a wait timed out; carries its log tail."""


def agentd_binary() -> str:
    """The ``agentd`` console script of the running interpreter's environment (the venv)."""
    return os.path.join(sys.prefix, "bin", "agentd")


# ---------------------------------------------------------------- TOML


def render_toml(config: Mapping[str, Any]) -> str:
    """Render a dict as TOML: tables, arrays of tables, strings, ints, floats, bools, arrays.

    Enough for agentd's configuration; no new dependency.  Keys are written bare (they are
    agentd's own ``[a-z_]`` names).
    """
    lines: list[str] = []
    _render_table(lines, [], config)
    return "\n".join(lines).lstrip("\n") + "\n"


def _render_table(lines: list[str], path: list[str], table: Mapping[str, Any]) -> None:
    scalars = {k: v for k, v in table.items() if not _is_table(v) and not _is_table_array(v)}
    if path and (scalars or not any(_is_table(v) or _is_table_array(v) for v in table.values())):
        lines.append(f"\n[{'.'.join(path)}]")
    for key, value in scalars.items():
        if value is None:
            continue  # TOML has no null: leave the key out (its default applies)
        lines.append(f"{key} = {_value(value)}")
    for key, value in table.items():
        if _is_table(value):
            _render_table(lines, [*path, key], value)
    for key, value in table.items():
        if _is_table_array(value):
            for item in value:
                lines.append(f"\n[[{'.'.join([*path, key])}]]")
                for k, v in item.items():
                    if v is not None:
                        lines.append(f"{k} = {_value(v)}")


def _is_table(v: Any) -> bool:
    return isinstance(v, Mapping)


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list | tuple) and bool(v) and all(isinstance(i, Mapping) for i in v)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"cannot write {v!r} to TOML")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(i) for i in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} to TOML")


# ---------------------------------------------------------------- the process


class SpeakerProcess:
    """One ``agentd speaker`` in ``ns``, configured from a dict; ``start()``, ``stop()``; restartable."""

    def __init__(self, ns: Netns, workdir: str | os.PathLike[str], config: Mapping[str, Any]) -> None:
        self.ns = ns
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "agentd.toml"
        self.log_path = self.workdir / "agentd.log"
        self._proc: subprocess.Popen | None = None
        self._log = None
        self.config: dict[str, Any] = {}
        self._write(config)

    def __repr__(self) -> str:
        return f"SpeakerProcess({self.ns.name}, pid={self.pid})"

    @property
    def api_url(self) -> str:
        return f"http://{self.config['api']['listen']}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Spawn the speaker (returns at once; see :meth:`wait_ready`)."""
        if self.running:
            return
        self._close_log()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open while the speaker runs
        self._log.write(f"--- lab: starting agentd speaker at {time.ctime()} ---\n".encode())
        self._log.flush()
        self._proc = self.ns.popen(
            [agentd_binary(), "speaker", "--config", str(self.config_path)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until ``GET /healthz`` answers 200; SpeakerError (with the log) if it exits or times out."""
        def exited() -> str | None:
            if self.running:
                return None
            code = self._proc.returncode if self._proc else None
            return f"agentd speaker exited with status {code} while starting:\n{self.log_tail()}"

        until(lambda: self.ns.http_get(self.api_url + "/healthz", timeout=1.0)[0] == 200, timeout,
              what=lambda: f"the agentd speaker API:\n{self.log_tail()}", ignore=(OSError, ValueError, IndexError),
              abort=exited, error=SpeakerError)

    def reload(self, config: Mapping[str, Any]) -> None:
        """Rewrite the configuration file and send SIGHUP (peers and ``originate`` change live)."""
        self._write(config)
        self.signal(signal.SIGHUP)

    def stop(self, timeout: float = STOP_GRACE) -> int | None:
        """SIGTERM and wait (SIGKILL after ``timeout``); returns the exit status.  Idempotent."""
        proc = self._proc
        if proc is None:
            return None
        code = stop_process(proc, timeout)
        self._proc = None
        self._close_log()
        return code

    def kill(self) -> None:
        """SIGKILL (a crash: the kernel closes its TCP sessions) and wait."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(5)
        self._proc = None
        self._close_log()

    def freeze(self) -> None:
        """SIGSTOP: sessions stay open but the speaker sends nothing (a hung router)."""
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def signal(self, sig: int) -> None:
        if not self.running:
            raise SpeakerError(f"agentd speaker is not running (signal {sig}):\n{self.log_tail()}")
        assert self._proc is not None
        self._proc.send_signal(sig)

    # ------------------------------------------------------------ queries

    def get(self, path: str, timeout: float = 5.0) -> Any:
        """``GET path`` on the speaker's API (from inside its namespace), decoded JSON."""
        return self.ns.http_json(self.api_url + path, timeout)

    def peers(self) -> list[dict[str, Any]]:
        return self.get("/peers")

    def rib(self) -> list[dict[str, Any]]:
        return self.get("/rib")

    def status(self) -> dict[str, Any]:
        return self.get("/status")

    def best_routes(self) -> dict[str, dict[str, Any]]:
        """``/rib`` reduced to ``{prefix: best entry}``."""
        return {r["prefix"]: r for r in self.rib() if r.get("best")}

    def peer(self, address: str) -> dict[str, Any]:
        for p in self.peers():
            if p["address"] == address:
                return p
        raise SpeakerError(f"no peer {address} in /peers")

    def status_cli(self, *extra: str) -> str:
        """``agentd status --api URL`` run inside the namespace: its stdout (raises on non-zero exit)."""
        return self.ns.exec(agentd_binary(), "status", "--api", self.api_url, *extra, timeout=20)

    def wait_peer_state(self, address: str, state: str, timeout: float = 20.0) -> dict[str, Any]:
        """Wait until peer ``address`` is in ``state`` ("Established", "Idle", ...); returns its row."""
        return self.wait_until(
            lambda: (p := self.peer(address))["state"] == state and p,
            timeout,
            what=lambda: f"peer {address} {state} (now {self._peer_summary(address)})",
        )

    def wait_until(self, predicate: Callable[[], Any], timeout: float, *, what: str | Callable[[], str] = "condition",
                   interval: float = 0.1) -> Any:
        """Poll ``predicate`` until truthy and return its value; SpeakerError (with the log) on timeout."""

        def exited() -> str | None:
            if self._proc is not None and self._proc.poll() is not None:
                return f"agentd speaker exited with status {self._proc.returncode}:\n{self.log_tail()}"
            return None

        return until(predicate, timeout, what=lambda: f"{what() if callable(what) else what}\n{self.log_tail()}",
                     interval=interval, ignore=(OSError, ValueError), abort=exited, error=SpeakerError)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    # ------------------------------------------------------------ internals

    def _peer_summary(self, address: str) -> str:
        try:
            p = self.peer(address)
        except (OSError, ValueError, SpeakerError) as err:
            return f"unknown: {err}"
        return f"{p.get('state')}, info {p.get('info')!r}"

    def _write(self, config: Mapping[str, Any]) -> None:
        cfg = copy.deepcopy(dict(config))
        cfg.setdefault("api", {}).setdefault("listen", DEFAULT_API)
        cfg.setdefault("log", {}).setdefault("level", "debug")
        self.config = cfg
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(render_toml(cfg))
        os.replace(tmp, self.config_path)  # the speaker never reads a half-written file on SIGHUP

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
