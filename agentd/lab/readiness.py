"""Is the lab ready yet?  Each stage of ``agentd lab up``, as something to wait for.

Every check reads what an operator would: each node's REST API (``/status``: a subnet lease
held; ``/peers``: sessions Established), its kernel routes (``ip route show proto 143``) and
pod-to-pod ICMP (agentd.lab.sweep: one raw socket per source pod).  ``lab.ready`` is the
lab's :class:`Readiness`; a wait that runs out raises LabError naming what was missing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from agentd.lab.errors import LabError
from agentd.lab.sweep import Source, sweep
from agentd.lab.wait import auntil


class LabView(Protocol):
    """What the checks read of a lab (agentd.lab.lab.Lab)."""

    spec: Any  # .bgp: "mesh" or "route-reflector"
    nodes: list[Any]  # LabNode: .name, .reflector, .log_path, agent_pid(), api_or_none(), kernel_routes()
    pods: list[Any]  # LabPod: .name, .ips, .ns.path


def subnets_of(status: Any) -> list[str]:
    """A node's pod subnets as its /status says: IPv4, then IPv6 in a dual-stack lab."""
    node = (status or {}).get("node") or {}
    return list(dict.fromkeys(s for s in (node.get("subnet"), node.get("subnet_v6")) if s))


class Readiness:
    def __init__(self, lab: LabView) -> None:
        self.lab = lab

    async def agents_started(self, timeout: float, nodes: list[Any] | None = None) -> None:
        """Every agent (of ``nodes``) running and holding a subnet lease."""

        def check() -> tuple[bool, str]:
            for n in nodes or self.lab.nodes:
                if n.agent_pid() is None:
                    raise LabError(f"{n.name}: agent exited; log {n.log_path} ends:\n{_tail(n.log_path)}")
                status = n.api_or_none("/status")
                if not status or not (status.get("node") or {}).get("subnet"):
                    return False, f"{n.name} has no subnet lease yet (log: {n.log_path})"
            return True, ""

        await self._wait("every agent holding a subnet", check, timeout)

    async def agents_ready(self, timeout: float, nodes: list[Any] | None = None) -> None:
        """Every agent (of ``nodes``) ready, its CNI conflist written (which CNI ADD reads): what
        a one-node lab waits for, having no peer or route to wait for."""

        def check() -> tuple[bool, str]:
            for n in nodes or self.lab.nodes:
                if not (n.api_or_none("/status") or {}).get("ready"):
                    return False, f"{n.name}'s agent not ready (log: {n.log_path})"
                if not (n.dir / "net.d" / "10-agentd.conflist").exists():
                    return False, f"{n.name}'s CNI conflist not written"
            return True, ""

        await self._wait("every agent ready, its CNI conflist written", check, timeout)

    def expected_peers(self, node: Any) -> int:
        n = len(self.lab.nodes)
        if self.lab.spec.bgp == "mesh":
            return n - 1
        reflectors = sum(1 for x in self.lab.nodes if x.reflector)
        return n - 1 if node.reflector else reflectors

    async def established(self, timeout: float, nodes: list[Any] | None = None) -> None:
        """Every node (of ``nodes``) with all its BGP sessions Established."""

        def check() -> tuple[bool, str]:
            for n in nodes or self.lab.nodes:
                peers = n.api_or_none("/peers") or []
                up = [p for p in peers if p.get("state") == "Established"]
                if len(up) < self.expected_peers(n):
                    states = ", ".join(f"{p['address']} {p['state']}" for p in peers) or "no peers"
                    return False, f"{n.name}: {len(up)}/{self.expected_peers(n)} established ({states})"
            return True, ""

        await self._wait("every BGP session Established", check, timeout)

    async def routes(self, timeout: float, nodes: list[Any] | None = None) -> None:
        """Every node (of ``nodes``) with a kernel route to every other node's subnets (both
        families in a dual-stack lab).  A node whose agent has exited ends the wait at once
        (as in :meth:`agents_started`); one whose /status does not answer is "not yet": its
        subnets are unknown, so no other node's routes can be judged complete without it."""

        def check() -> tuple[bool, str]:
            subnets: dict[str, list[str]] = {}
            for n in self.lab.nodes:
                if n.agent_pid() is None:
                    raise LabError(f"{n.name}: agent exited; log {n.log_path} ends:\n{_tail(n.log_path)}")
                status = n.api_or_none("/status")
                if status is None:
                    return False, f"{n.name} not answering"
                subnets[n.name] = subnets_of(status)
            for n in nodes or self.lab.nodes:
                have = {line.split()[0] for line in n.kernel_routes() if not line.startswith("blackhole")}
                want = {s for name, mine in subnets.items() if name != n.name for s in mine}
                missing = want - have
                if missing:
                    return False, f"{n.name} has no route for {', '.join(sorted(missing))}"
            return True, ""

        await self._wait("routes to every other node's subnet", check, timeout)

    async def matrix(self, deadline: float = 3.0) -> dict[tuple[str, str, int], bool]:
        """{(source pod, target pod, IP version): an echo reply came back within ``deadline``
        seconds} for every ordered pair of pods and every address of the target (ICMP for IPv4,
        ICMPv6 for IPv6, RFC 4443 §4); one raw socket per source pod and family in this process
        (agentd.lab.sweep), not a ``ping`` process per pair."""
        pods = self.lab.pods
        if unaddressed := [p.name for p in pods if not p.ips]:  # else a pair would pass unprobed
            raise LabError(f"pods without an address: {', '.join(unaddressed)}")
        by_ip = {ip: p for p in pods for ip in p.ips}
        sources = [Source(a.name, a.ns.path, tuple(ip for b in pods if b is not a for ip in b.ips)) for a in pods]
        got = await asyncio.to_thread(sweep, sources, deadline=deadline)
        return {(src, by_ip[ip].name, 6 if ":" in ip else 4): ok for (src, ip), ok in got.items()}

    async def reachability(self, deadline: float = 3.0, version: int | None = None) -> dict[tuple[str, str], bool]:
        """{(source pod, target pod): every address of the target answered} for every ordered
        pair of pods (of IP ``version`` only, when given)."""
        out: dict[tuple[str, str], bool] = {}
        for (src, dst, v), ok in (await self.matrix(deadline)).items():
            if version in (None, v):
                out[(src, dst)] = out.get((src, dst), True) and ok
        return out

    async def reachable(self, timeout: float) -> None:
        """Every pod answering every other, at each of its addresses."""
        failing: list[str] = []
        dual = any(len(p.ips) > 1 for p in self.lab.pods)

        async def reachable() -> bool:
            nonlocal failing
            failing = [f"{a}->{b}" + (f" (IPv{v})" if dual else "")
                       for (a, b, v), ok in (await self.matrix()).items() if not ok]
            return not failing

        def what() -> str:
            more = f" and {len(failing) - 10} more" if len(failing) > 10 else ""
            return f"every pod reachable (failing: {', '.join(failing[:10])}{more})"

        await auntil(reachable, timeout, what=what, interval=0.5, error=LabError)

    async def _wait(self, what: str, check: Callable[[], tuple[bool, str]], timeout: float) -> None:
        detail = ""

        def ok() -> bool:
            nonlocal detail
            done, detail = check()
            return done

        await auntil(ok, timeout, what=lambda: f"{what} ({detail})", interval=0.2, in_thread=True, error=LabError)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
