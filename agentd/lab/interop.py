"""Helpers for BGP interop tests: router namespaces, speaker/BIRD configurations, polling.

Shared by the system tests that run ``agentd speaker`` against BIRD and GoBGP, and by the
BFD tests.  Addresses are 10.0.0.x/24 (and 2001:db8:ff::x/64) inside the namespaces the
caller's factory makes.  :class:`Routers` (the ``routers`` fixture of agentd.lab.fixtures)
is one test's set of routers and the daemons in them::

    def test_x(routers):
        r1, r2 = routers.pair()
        bird = routers.bird(r2, bird_config("10.0.0.2", bird_bgp("spk", "10.0.0.2", ASN, "10.0.0.1", ASN)))
        spk = routers.speaker(r1, speaker_config("spk", "10.0.0.1", peers=[{"address": "10.0.0.2", "asn": ASN}]))
        spk.wait_peer_state("10.0.0.2", "Established", ESTABLISH_TIMEOUT)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .bfd_proc import BfdProcess
from .bird import Bird
from .gobgp import GoBgp
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


T = TypeVar("T")


class Routers:
    """One test's routers and the daemons in them: namespaces from ``netns_factory``, each
    daemon with a work directory of its own under ``root`` (its configuration and log stay
    there for a failed test).  :meth:`stop` stops everything started here, last first; the
    ``routers`` fixture calls it when the test ends, pass or fail."""

    def __init__(self, netns_factory: Callable[[str], Netns], root: Path) -> None:
        self._netns = netns_factory
        self.root = Path(root)
        self._running: list[Any] = []
        self._dirs: set[str] = set()

    # -- the routers

    def namespace(self, role: str) -> Netns:
        return self._netns(role)

    def pair(self, *, v6: bool = False) -> tuple[Netns, Netns]:
        return pair(self._netns, v6=v6)

    def lan(self, count: int) -> list[Netns]:
        return lan(self._netns, count)

    # -- the daemons

    def bird(self, ns: Netns, config: str, name: str = "bird") -> Bird:
        """A started BIRD 2 in ``ns``."""
        bird = self.add(Bird(ns, self.workdir(name), config))
        bird.start()
        return bird

    def speaker(self, ns: Netns, config: dict, name: str = "spk") -> SpeakerProcess:
        """A started ``agentd speaker`` in ``ns`` whose API answers."""
        spk = self.add(SpeakerProcess(ns, self.workdir(name), config))
        spk.start()
        spk.wait_ready()
        return spk

    def gobgp(self, ns: Netns, config: str, name: str = "gobgp") -> GoBgp:
        """A started gobgpd in ``ns`` whose API answers."""
        gob = self.add(GoBgp(ns, self.workdir(name), config))
        gob.start()
        return gob

    def bfd(self, ns: Netns, name: str = "bfd", **settings: Any) -> BfdProcess:
        """A started BFD process (agentd.lab.bfd_proc) in ``ns``; ``settings`` as BfdProcess takes them."""
        bfd = self.add(BfdProcess(ns, self.workdir(name), **settings))
        bfd.start()
        return bfd

    def add(self, thing: T) -> T:
        """Stop ``thing`` with the rest: anything with ``stop()`` (a daemon, a raw peer) or
        ``close()`` (a socket)."""
        self._running.append(thing)
        return thing

    def workdir(self, name: str) -> Path:
        """A new directory under ``root`` named ``name`` (``name-2``, ... if taken)."""
        unique, n = name, 1
        while unique in self._dirs:
            n += 1
            unique = f"{name}-{n}"
        self._dirs.add(unique)
        return self.root / unique

    def stop(self) -> None:
        """Stop every daemon started here (a frozen one is thawed first), last started first."""
        errors = []
        while self._running:
            thing = self._running.pop()
            try:
                (getattr(thing, "stop", None) or thing.close)()
            except Exception as err:  # noqa: BLE001 - the others are stopped all the same
                errors.append(err)
        if errors:
            raise errors[0]


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
