"""Tunnel backends: the devices, FDB/neighbour entries and user-space next hops that
encapsulated peers need.  host-gw needs none of it.

The agent runs every backend *per peer*: a peer is reached with the backend it
advertises in its node record (``backend.type``), so nodes on different backends
still reach each other.  ``available(backend)`` says whether this node can run one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from ipaddress import IPv4Network
from typing import Any

from .config import Config
from .datastore import NodeRecord
from .forwarding import PeerPlan
from .netinfo import Underlay

log = logging.getLogger("agentd.backends")


class Tunnels:
    def __init__(self, cfg: Config, underlay: Underlay, node_name: str) -> None:
        self.cfg = cfg
        self.underlay = underlay
        self.node_name = node_name
        self.own = cfg.network.backend
        self.devices: dict[str, str] = {}
        self.subnet: IPv4Network | None = None

    async def start(self, subnet: IPv4Network) -> None:
        self.subnet = subnet
        if self.own != "host-gw":
            raise NotImplementedError(f"backend {self.own} is not built yet")

    def available(self, backend: str) -> str | None:
        if backend == "host-gw":
            return None
        return f"backend {backend} is not available on this node"

    def node_data(self) -> dict[str, Any]:
        return {"type": self.own}

    def apply(self, plans: Mapping[str, PeerPlan], next_hops: Mapping[str, list[str]], nodes: Mapping[str, NodeRecord]) -> None:
        """Bring tunnel state in line with the peer plans (nothing to do for host-gw)."""

    def status(self) -> dict[str, Any]:
        return {"own": self.own, "active": {"host-gw": {"device": self.underlay.ifname}}}

    async def stop(self, *, remove: bool) -> None:
        return None
