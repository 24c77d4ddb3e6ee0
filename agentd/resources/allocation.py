"""Cluster IPs and node ports of Services: what the API server's allocators do, as etcd keys.

Each allocated value is a key of its own, written in the same transaction as its Service::

    <prefix>/allocations/serviceips/<ip>       "<namespace>/<name>"
    <prefix>/allocations/nodeports/<port>      "<namespace>/<name>"

An allocation compares ``version == 0`` of its key, so two applies that pick the same free
address cannot both succeed: the loser's transaction fails, it reads again and picks another
(:meth:`agentd.resources.store.ResourceStore.apply`).  Deleting a Service deletes its keys in
the same transaction.  The keys are outside ``<prefix>/resources/``: watchers never see them.

Pure here: the keys, what a Service holds, and the choice of free values (``rng`` passed in).
"""

from __future__ import annotations

import ipaddress
import random
from collections.abc import Mapping
from typing import Any

from .service import HEADLESS, NODE_PORT_RANGE
from .validation import Invalid, invalid

ALLOCATIONS = "allocations"
SERVICE_IPS = "serviceips"
NODE_PORTS = "nodeports"


class Exhausted(Invalid):
    pass


def allocations_prefix(prefix: str, what: str) -> bytes:
    return f"{prefix}/{ALLOCATIONS}/{what}/".encode()


def allocation_key(prefix: str, what: str, value: str | int) -> bytes:
    return allocations_prefix(prefix, what) + str(value).encode()


def owner(obj: Mapping[str, Any]) -> bytes:
    meta = obj["metadata"]
    return f"{meta['namespace']}/{meta['name']}".encode()


def held(obj: Mapping[str, Any] | None) -> set[tuple[str, str]]:
    """The allocation keys (what, value) a stored Service holds."""
    if obj is None or obj.get("kind") != "Service":
        return set()
    spec = obj["spec"]
    out = set()
    if spec.get("clusterIP") not in ("", HEADLESS, None):
        out.add((SERVICE_IPS, spec["clusterIP"]))
    for p in spec.get("ports", []):
        if p.get("nodePort"):
            out.add((NODE_PORTS, str(p["nodePort"])))
    return out


def carry_over(new: dict[str, Any], old: Mapping[str, Any] | None) -> None:
    """Keep what the old Service was given (clusterIP is immutable; node ports stay with their port)."""
    if old is None:
        return
    spec, old_spec = new["spec"], old["spec"]
    old_ip = old_spec.get("clusterIP", "")
    if spec["clusterIP"] == "":
        if old_ip == HEADLESS:
            raise invalid("spec.clusterIP", "", "field is immutable (the Service is headless)")
        spec["clusterIP"] = old_ip
    elif old_ip and spec["clusterIP"] != old_ip:
        raise invalid("spec.clusterIP", spec["clusterIP"], "field is immutable")
    if spec["clusterIP"] not in ("", HEADLESS):
        spec["clusterIPs"] = [spec["clusterIP"]]
    if spec["type"] != "NodePort":
        return
    old_ports = {(p["port"], p["protocol"]): p.get("nodePort") for p in old_spec.get("ports", [])}
    for p in spec["ports"]:
        if not p.get("nodePort") and old_ports.get((p["port"], p["protocol"])):
            p["nodePort"] = old_ports[(p["port"], p["protocol"])]


def check_range(spec: Mapping[str, Any], service_cidr: ipaddress.IPv4Network) -> None:
    ip = spec.get("clusterIP", "")
    if ip in ("", HEADLESS):
        return
    if ipaddress.IPv4Address(ip) not in service_cidr or ip in (str(service_cidr.network_address), str(service_cidr.broadcast_address)):
        raise invalid("spec.clusterIP", ip, f"provided IP is not in the valid range. The range of valid IPs is {service_cidr}")


def pick_ip(service_cidr: ipaddress.IPv4Network, taken: set[str], rng: random.Random) -> str:
    """A free address of the range (not its network or broadcast address), at random as the
    API server's allocator does: concurrent applies rarely race for the same one."""
    first, last = int(service_cidr.network_address) + 1, int(service_cidr.broadcast_address) - 1
    size = last - first + 1
    if size <= 0 or len(taken) >= size:
        raise Exhausted("spec.clusterIP", f"Internal error: failed to allocate a serviceIP: range {service_cidr} is full")
    if len(taken) > size // 2:  # nearly full: walk from a random start
        start = rng.randrange(size)
        for i in range(size):
            ip = str(ipaddress.IPv4Address(first + (start + i) % size))
            if ip not in taken:
                return ip
    while True:
        ip = str(ipaddress.IPv4Address(first + rng.randrange(size)))
        if ip not in taken:
            return ip


def pick_port(taken: set[str], rng: random.Random) -> int:
    low, high = NODE_PORT_RANGE
    free = [p for p in range(low, high + 1) if str(p) not in taken]
    if not free:
        raise Exhausted("spec.ports", f"Internal error: failed to allocate a nodePort: range {low}-{high} is full")
    return rng.choice(free)
