"""Helpers for BGP interop tests: router namespaces, speaker/BIRD configurations, polling.

Shared by the system tests that run ``agentd speaker`` against BIRD and GoBGP.  Addresses
are 10.0.0.x/24 (and 2001:db8:ff::x/64) inside the namespaces the caller's factory makes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .bird import Bird
from .netns import Netns, veth
from .speaker_proc import SpeakerProcess
from .wait import until

HOLD = 9
ASN = 65000
ESTABLISH_TIMEOUT = 30.0
CONVERGE_TIMEOUT = 15.0


# ---------------------------------------------------------------- topology


def pair(netns_factory, *, v6: bool = False) -> tuple[Netns, Netns]:
    """Two routers on one veth link: ``r1`` 10.0.0.1, ``r2`` 10.0.0.2 (and 2001:db8:ff::1/2)."""
    r1, r2 = netns_factory("r1"), netns_factory("r2")
    veth(r1, "eth0", r2, "eth0")
    for i, ns in enumerate((r1, r2), start=1):
        address(ns, i, v6)
    return r1, r2


def lan(netns_factory, count: int) -> list[Netns]:
    """``count`` routers on one bridge (in namespace "ul"); router i has 10.0.0.i on eth0."""
    ul = netns_factory("ul")
    ul.ip("link", "add", "br0", "type", "bridge")
    ul.ip("link", "set", "br0", "up")
    routers = []
    for i in range(1, count + 1):
        ns = netns_factory(f"r{i}")
        veth(ns, "eth0", ul, f"p{i}")
        ul.ip("link", "set", f"p{i}", "master", "br0")
        address(ns, i)
        routers.append(ns)
    return routers


def address(ns: Netns, i: int, v6: bool = False) -> None:
    ns.ip("addr", "add", f"10.0.0.{i}/24", "dev", "eth0")
    if v6:
        ns.ip("addr", "add", f"2001:db8:ff::{i}/64", "dev", "eth0", "nodad")


# ---------------------------------------------------------------- configurations


def speaker_config(name: str, address: str, *, asn: int = ASN, originate=(), peers=(), **bgp: Any) -> dict:
    return {
        "node": {"name": name, "address": address, "asn": asn if asn < 2**32 else ASN},
        "bgp": {
            "listen": f"{address}:179",
            "asn": asn,
            "hold_time": HOLD,
            "connect_retry": 1.0,
            "graceful_restart": True,
            "originate": list(originate),
            **bgp,
            "peers": [dict(p) for p in peers],
        },
        "log": {"level": "debug"},
    }


def bird_config(router_id: str, *protocols: str, static4=(), static6=()) -> str:
    parts = [f"router id {router_id};", "protocol device { scan time 1; }"]
    if static4:
        routes = " ".join(f"route {p} blackhole;" for p in static4)
        parts.append(f"protocol static static4 {{ ipv4; {routes} }}")
    if static6:
        routes = " ".join(f"route {p} blackhole;" for p in static6)
        parts.append(f"protocol static static6 {{ ipv6; {routes} }}")
    parts.extend(protocols)
    return "\n".join(parts) + "\n"


def bird_bgp(
    name: str,
    local: str,
    local_as: int,
    neighbor: str,
    neighbor_as: int,
    *,
    options: str = "",
    ipv4: str = "import all; export all;",
    ipv6: str | None = None,
) -> str:
    """One ``protocol bgp``: hold time 9, graceful restart on, short connect/error timers.

    iBGP sessions get ``direct`` (BIRD treats iBGP as multihop by default and would
    resolve next hops recursively); eBGP sessions are direct anyway.
    """
    ibgp = local_as == neighbor_as
    lines = [
        f"protocol bgp {name} {{",
        f"  local {local} as {local_as};",
        f"  neighbor {neighbor} as {neighbor_as};",
        f"  hold time {HOLD};",
        "  connect delay time 1; connect retry time 2; error wait time 1, 5;",
        "  graceful restart on;",
        "  direct;" if ibgp else "",
        f"  {options}" if options else "",
        f"  ipv4 {{ {ipv4} }};",
        f"  ipv6 {{ {ipv6} }};" if ipv6 is not None else "",
        "}",
    ]
    return "\n".join(line for line in lines if line) + "\n"


# ---------------------------------------------------------------- helpers


def start_speaker(procs: list, ns: Netns, workdir: Path, config: dict) -> SpeakerProcess:
    spk = SpeakerProcess(ns, workdir, config)
    procs.append(spk)
    spk.start()
    spk.wait_ready()
    return spk


def start_bird(procs: list, ns: Netns, workdir: Path, config: str) -> Bird:
    bird = Bird(ns, workdir, config)
    procs.append(bird)
    bird.start()
    return bird


def eventually(predicate: Callable[[], Any], timeout: float = CONVERGE_TIMEOUT, what: str | Callable[[], str] = "condition",
               interval: float = 0.1) -> Any:
    """:func:`agentd.lab.wait.until` with the interop tests' default deadline."""
    return until(predicate, timeout, what=what, interval=interval)


def rib_paths(spk: SpeakerProcess, prefix: str) -> list[dict]:
    return [r for r in spk.rib() if r["prefix"] == prefix]


def best(spk: SpeakerProcess, prefix: str) -> dict | None:
    return next((r for r in rib_paths(spk, prefix) if r["best"]), None)


def md5_failures(ns: Netns) -> int:
    """The kernel's TcpExt TCPMD5Failure counter in ``ns`` (segments dropped for a bad signature)."""
    lines = [line.split() for line in ns.exec("cat", "/proc/net/netstat").splitlines() if line.startswith("TcpExt:")]
    names, values = lines[0], lines[1]
    return int(values[names.index("TCPMD5Failure")])


class Watch:
    """Poll ``probe()`` every ``interval`` s in a thread, recording (time, value), until stopped."""

    def __init__(self, probe: Callable[[], Any], interval: float = 0.2) -> None:
        self.probe, self.interval = probe, interval
        self.samples: list[tuple[float, Any]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def wait_samples(self, count: int, timeout: float = CONVERGE_TIMEOUT) -> None:
        """Wait until ``count`` more samples have been taken (instead of sleeping for them)."""
        want = len(self.samples) + len(self.errors) + count
        until(lambda: len(self.samples) + len(self.errors) >= want, timeout, what=f"{count} more samples")

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic(), self.probe()))
            except Exception as err:  # noqa: BLE001 - recorded and asserted on by the test
                self.errors.append(repr(err))
            self._stop.wait(self.interval)
