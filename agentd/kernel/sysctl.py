"""The host's IP forwarding, which routing pods through the host needs.

A node routes pod traffic between its pod bridge, its tunnels and the underlay: with
``net.ipv4.ip_forward`` (or, for IPv6 pods, ``net.ipv6.conf.all.forwarding``) off, nothing
it routes for other hosts' pods arrives.  The CNI bridge plugin turns IPv4 forwarding on at
the first pod it attaches, but a Docker host (docs/docker.md) has no CNI, and a Docker daemon
that finds forwarding off turns it on *and* sets iptables' FORWARD policy to DROP, which drops
every connection another node's containers open to this node's.  So the agent turns
forwarding on for each pod family at start, before the subnet file (and with it Docker) is
there, as Calico's Felix does; it stays on after the agent stops, as it does after Docker.

IPv6 forwarding makes the kernel ignore router advertisements on interfaces with
``accept_ra = 1`` (a host, not a router): where the agent turned it on, those are named in a
warning (``accept_ra = 2`` keeps them).
"""

from __future__ import annotations

import os
from pathlib import Path

PROC_SYS = Path("/proc/sys")
FORWARDING = {4: "net/ipv4/ip_forward", 6: "net/ipv6/conf/all/forwarding"}


def enable_forwarding(versions, root: Path = PROC_SYS) -> list[str]:
    """Turn forwarding on for these IP versions; the keys it changed (``net.ipv4.ip_forward``).
    Raises OSError (naming the file) if one cannot be read or written."""
    changed = []
    for version in sorted(set(versions)):
        path = root / FORWARDING[version]
        if path.read_text().strip() != "1":
            path.write_text("1\n")
            changed.append(FORWARDING[version].replace("/", "."))
    return changed


def ra_ignored(root: Path = PROC_SYS) -> list[str]:
    """Interfaces that take router advertisements only while the host does not forward IPv6
    (``accept_ra = 1``); "all" and "default" are not interfaces."""
    out = []
    conf = root / "net/ipv6/conf"
    try:
        names = sorted(os.listdir(conf))
    except OSError:
        return out
    for name in names:
        if name in ("all", "default", "lo"):
            continue
        try:
            if (conf / name / "accept_ra").read_text().strip() == "1":
                out.append(name)
        except OSError:
            continue
    return out
