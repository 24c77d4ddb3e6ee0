"""``agentd speaker`` as a real process inside a lab namespace, for the system tests.

The configuration is a plain dict in the shape of the TOML file (sections as dicts,
``[[bgp.peers]]`` as a list of dicts); :func:`render_toml` writes it.  The speaker runs
as ``ip netns exec NS <venv>/bin/agentd speaker --config FILE``, its log goes to a file
in the work directory (agentd.lab.process runs it), and its REST API is queried from inside the namespace::

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

``[api] listen`` defaults to 127.0.0.1:9099, ``[log] level`` to "debug" and ``[agent]
state_dir`` to a directory in the work directory when the dict does not set them (each
speaker has its own namespace, so the port never clashes).
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agentd.lab.netns import Netns
from agentd.lab.process import LabProcess

DEFAULT_API = "127.0.0.1:9099"
START_TIMEOUT = 15.0


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


class SpeakerProcess(LabProcess):
    """One ``agentd speaker`` in ``ns``, configured from a dict; ``start()``, ``stop()``; restartable."""

    label = "agentd speaker"
    error = SpeakerError

    def __init__(self, ns: Netns, workdir: str | os.PathLike[str], config: Mapping[str, Any]) -> None:
        self.workdir = Path(workdir)
        super().__init__(ns, self.workdir / "agentd.log")
        self.config_path = self.workdir / "agentd.toml"
        self.config: dict[str, Any] = {}
        self._write(config)

    @property
    def api_url(self) -> str:
        return f"http://{self.config['api']['listen']}"

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Spawn the speaker (returns at once; see :meth:`wait_ready`)."""
        if not self.running:
            self.spawn([agentd_binary(), "speaker", "--config", str(self.config_path)])

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until ``GET /healthz`` answers 200; SpeakerError (with the log) if it exits or times out."""
        self.wait_until(lambda: self.ns.http_get(self.api_url + "/healthz", timeout=1.0)[0] == 200, timeout,
                        what="the agentd speaker API")

    def reload(self, config: Mapping[str, Any]) -> None:
        """Rewrite the configuration file and send SIGHUP (peers and ``originate`` change live)."""
        self._write(config)
        self.signal(signal.SIGHUP)

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
                   interval: float = 0.1, ignore: tuple[type[BaseException], ...] = (OSError, ValueError)) -> Any:
        """Poll ``predicate`` until truthy and return its value (the API not answering yet is
        "not yet"); SpeakerError (with the log) on timeout or when the speaker exits."""
        return super().wait_until(predicate, timeout, what=what, interval=interval, ignore=ignore)

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
        # Its own state (the file that tells a restart, agentd.daemon.speaker.RunMarker), not the host's.
        cfg.setdefault("agent", {}).setdefault("state_dir", str(self.workdir / "state"))
        self.config = cfg
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(render_toml(cfg))
        os.replace(tmp, self.config_path)  # the speaker never reads a half-written file on SIGHUP
