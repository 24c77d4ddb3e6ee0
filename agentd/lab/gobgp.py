"""A GoBGP (``gobgpd``) runner for interop tests and benches.

``GoBgp(ns, workdir, asn=..., router_id=..., neighbors=[...])`` writes a TOML config and
runs ``gobgpd`` in the namespace with its gRPC API on 127.0.0.1:50051 there; the ``gobgp``
CLI (run inside the namespace) adds and reads routes as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .netns import Netns
from .process import LabProcess

API = "127.0.0.1"


class GoBgpError(RuntimeError):
    pass


def gobgp_config(asn: int, router_id: str, neighbors: Iterable[Mapping[str, Any]]) -> str:
    """TOML for gobgpd: each neighbor is {address, asn, password?, rr_client?, families?}."""
    lines = ["[global.config]", f"  as = {asn}", f'  router-id = "{router_id}"', f'  local-address-list = ["{router_id}"]']
    for n in neighbors:
        lines += ["[[neighbors]]", "  [neighbors.config]", f'    neighbor-address = "{n["address"]}"', f"    peer-as = {n['asn']}"]
        if n.get("password"):
            lines.append(f'    auth-password = "{n["password"]}"')
        lines += ["  [neighbors.timers.config]", "    hold-time = 9", "    keepalive-interval = 3", "    connect-retry = 1"]
        if n.get("rr_client"):
            lines += ["  [neighbors.route-reflector.config]", "    route-reflector-client = true",
                      f'    route-reflector-cluster-id = "{n.get("cluster_id", router_id)}"']  # fmt: skip
        for fam in n.get("families", ("ipv4-unicast",)):
            lines += ["  [[neighbors.afi-safis]]", "    [neighbors.afi-safis.config]", f'      afi-safi-name = "{fam}"']
    return "\n".join(lines) + "\n"


class GoBgp(LabProcess):
    label = "gobgpd"
    error = GoBgpError

    def __init__(self, ns: Netns, workdir: str | os.PathLike[str], config: str) -> None:
        self.dir = Path(workdir)
        super().__init__(ns, self.dir / "gobgpd.log")
        self.conf = self.dir / "gobgpd.toml"
        self.conf.write_text(config)

    def start(self, timeout: float = 10.0) -> None:
        if self.running:
            return
        self.spawn(["gobgpd", "-f", str(self.conf), "-t", "toml", "--api-hosts", f"{API}:50051", "-l", "info"])
        self.wait_until(lambda: self._cli("global", check=False)[0] == 0, timeout, what="the gobgpd API")

    def _cli(self, *args: str, check: bool = True) -> tuple[int, str]:
        proc = subprocess.run(
            ["ip", "netns", "exec", self.ns.name, "gobgp", "-u", API, "-p", "50051", *args],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if check and proc.returncode != 0:
            raise GoBgpError(f"gobgp {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
        return proc.returncode, proc.stdout

    def add(self, prefix: str, family: str = "ipv4") -> None:
        self._cli("global", "rib", "add", prefix, "-a", family)

    def delete(self, prefix: str, family: str = "ipv4") -> None:
        self._cli("global", "rib", "del", prefix, "-a", family)

    def rib(self, family: str = "ipv4") -> dict[str, dict[int, Any]]:
        """prefix -> {attribute type: value} of the best path (1 origin, 2 AS path, 3 next hop,
        9 originator id, 10 cluster list, ...); plus "neighbor" and "stale"."""
        _, out = self._cli("global", "rib", "-a", family, "-j")
        table = json.loads(out or "{}")
        result = {}
        for prefix, paths in table.items():
            best = next((p for p in paths if p.get("best")), paths[0])
            attrs: dict[Any, Any] = {"neighbor": best.get("neighbor-ip"), "stale": best.get("stale")}
            for a in best.get("attrs", []):
                attrs[a["type"]] = a
            result[prefix] = attrs
        return result

    def neighbor_state(self, address: str) -> int | None:
        """RFC 4271 FSM state of the session to ``address`` (6 = Established)."""
        _, out = self._cli("neighbor", "-j", check=False)
        for n in json.loads(out or "[]"):
            if n.get("state", {}).get("neighbor_address") == address:
                return n["state"].get("session_state")
        return None
