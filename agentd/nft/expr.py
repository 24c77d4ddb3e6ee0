"""nftables JSON expressions the agent's compilers share (policy, Services).

libnftables' JSON schema (libnftables-json(5)): a rule is a list of statements; these build
the few shapes both compilers write, so each compiler reads as the rules it makes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

NAME_MAX = 200  # nft object names may have 255 bytes; longer names are hashed (names stay unique)

ACCEPT: dict[str, Any] = {"accept": None}
DROP: dict[str, Any] = {"drop": None}


def payload(protocol: str, field: str) -> dict[str, Any]:
    return {"payload": {"protocol": protocol, "field": field}}


def meta(key: str) -> dict[str, Any]:
    return {"meta": {"key": key}}


def match(left: Any, right: Any, op: str = "==") -> dict[str, Any]:
    return {"match": {"op": op, "left": left, "right": right}}


def jump(chain: str) -> dict[str, Any]:
    return {"jump": {"target": chain}}


def goto(chain: str) -> dict[str, Any]:
    return {"goto": {"target": chain}}


def ref(name: str) -> str:
    """A named set or map as a rule refers to it (``@name``)."""
    return "@" + name


ESTABLISHED = match({"ct": {"key": "state"}}, ["established", "related"], "in")


def object_name(kind: str, *parts: Any) -> str:
    """``kind/part/part...``, or ``kind/#<hash>`` when that is too long for nftables."""
    full = "/".join((kind, *map(str, parts)))
    if len(full) <= NAME_MAX:
        return full
    return f"{kind}/#{hashlib.sha1(full.encode()).hexdigest()[:20]}"


SUPPRESSED = "flow-log-suppressed"  # the counter of drops a log rule's limit kept from the log


@dataclass(frozen=True)
class DropLog:
    """How drop rules log for flow records (``agentd.flows``): the NFLOG group, and the
    kernel's limit per log rule (packets a second, burst); what goes over it is counted in
    each table's ``flow-log-suppressed`` counter instead."""

    group: int
    rate: int = 100
    burst: int = 100

    def statements(self, prefix: str) -> list[dict[str, Any]]:
        """``limit rate R/second burst B packets log prefix "<prefix>" group N``"""
        return [{"limit": {"rate": self.rate, "per": "second", "burst": self.burst}},
                {"log": {"prefix": prefix, "group": self.group}}]

    def chain_rules(self, prefix: str, final: list[dict[str, Any]]) -> tuple[str, ...]:
        """A drop chain's rules: ``final`` logged while under the limit, else the suppressed
        counter and ``final`` alone."""
        from .ruleset import rule_text

        return (rule_text([*self.statements(prefix), *final]), rule_text([{"counter": SUPPRESSED}]), rule_text(final))
