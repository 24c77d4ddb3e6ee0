"""Accept encapsulated traffic only from cluster members (kernel IPIP and VXLAN devices).

A kernel ipip device without a remote, and a VXLAN device, take packets from anyone who
can reach the node.  The agent owns one nftables table, ``inet agentd``, whose input chain
drops IP protocol 4 and UDP to the VXLAN port unless the source is in the ``members`` set,
counting what it drops (Calico does the same with iptables for its tunnels).  Membership
changes only rewrite the set, so the counters survive.  The user-space workers do their
own member check and need none of this.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable

log = logging.getLogger("agentd.firewall")

TABLE = "agentd"


async def _nft(script: str | None = None, *args: str) -> tuple[int, str]:
    argv = ["nft", *args] if script is None else ["nft", "-f", "-"]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if script is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(script.encode() if script is not None else None)
    return proc.returncode or 0, (out or err).decode(errors="replace")


class MemberFilter:
    def __init__(self) -> None:
        self._rules: tuple[bool, int | None] | None = None  # (ipip, vxlan_port) of the live table
        self._members: frozenset[str] = frozenset()
        self.dropped: dict[str, int] = {}
        self.error: str | None = None

    async def apply(self, members: Iterable[str], *, ipip: bool, vxlan_port: int | None) -> None:
        members = frozenset(members)
        rules = (ipip, vxlan_port)
        if not ipip and vxlan_port is None:
            if self._rules is not None:
                await self.remove()
            return
        if rules == self._rules and members == self._members:
            return
        elements = ", ".join(sorted(members))
        lines = []
        if rules != self._rules:
            lines += [
                f"table inet {TABLE} {{}}",
                f"delete table inet {TABLE}",
                f"table inet {TABLE} {{",
                "  set members { type ipv4_addr; }",
                "  counter ipip_dropped {}",
                "  counter vxlan_dropped {}",
                "  chain input {",
                "    type filter hook input priority -10; policy accept;",
            ]
            if ipip:
                lines.append('    ip protocol 4 ip saddr != @members counter name "ipip_dropped" drop')
            if vxlan_port is not None:
                lines.append(f'    udp dport {vxlan_port} ip saddr != @members counter name "vxlan_dropped" drop')
            lines += ["  }", "}"]
        lines.append(f"flush set inet {TABLE} members")
        if elements:
            lines.append(f"add element inet {TABLE} members {{ {elements} }}")
        rc, out = await _nft("\n".join(lines) + "\n")
        if rc != 0:
            self.error = out.strip()
            log.error("nftables member filter not applied: %s", self.error)
            return
        self.error = None
        self._rules, self._members = rules, members

    async def counters(self) -> dict[str, int]:
        if self._rules is None:
            return {}
        rc, out = await _nft(None, "-j", "list", "counters", "table", "inet", TABLE)
        if rc != 0:
            return self.dropped
        try:
            for item in json.loads(out).get("nftables", []):
                c = item.get("counter")
                if c:
                    self.dropped[c["name"]] = int(c.get("packets", 0))
        except (ValueError, KeyError, TypeError):
            pass
        return self.dropped

    def status(self) -> dict:
        return {
            "active": self._rules is not None,
            "members": len(self._members),
            "dropped": dict(self.dropped),
            "error": self.error,
        }

    async def remove(self) -> None:
        if self._rules is None:
            return
        await _nft(f"table inet {TABLE} {{}}\ndelete table inet {TABLE}\n")
        self._rules = None
        self._members = frozenset()
