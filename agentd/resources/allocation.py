"""Cluster IPs and node ports of Services: what the API server's allocators do, as etcd keys.

Each allocated value is a key of its own, written in the same transaction as its Service::

    <prefix>/allocations/serviceips/<ip>       "<namespace>/<name>"   (IPv6 in RFC 5952 text: one spelling)
    <prefix>/allocations/nodeports/<port>      "<namespace>/<name>"

A dual-stack Service holds one address of each family's range (``clusterIPs``); node ports
are per port, whatever the families.

An allocation compares ``version == 0`` of its key, so two applies that pick the same free
address cannot both succeed: the loser's transaction fails, it reads again and picks another
(:meth:`agentd.resources.store.ResourceStore.apply`).  Deleting a Service deletes its keys in
the same transaction.  The keys are outside ``<prefix>/resources/``: watchers never see them.

Pure here: the keys, what a Service holds, and the choice of free values (``rng`` passed in).
"""

from __future__ import annotations

import copy
import ipaddress
import random
from collections.abc import Mapping
from typing import Any

from . import ipfamilies
from .service import HEADLESS, NODE_PORT_RANGE
from .validation import Invalid, invalid

Range = ipaddress.IPv4Network | ipaddress.IPv6Network

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
    out = {(SERVICE_IPS, ip) for ip in ipfamilies.cluster_ips(spec)}
    for p in spec.get("ports", []):
        if p.get("nodePort"):
            out.add((NODE_PORTS, str(p["nodePort"])))
    return out


def carry_over(new: dict[str, Any], old: Mapping[str, Any] | None) -> None:
    """Keep what the old Service was given and the new manifest leaves out: its cluster IPs
    (clusterIP is immutable), its families and policy (``ipfamilies.default`` decides from
    there), node ports with their port.  Without an old one: clusterIPs from clusterIP."""
    spec = new["spec"]
    if old is None:
        if spec["clusterIP"] and not spec.get("clusterIPs"):
            spec["clusterIPs"] = [spec["clusterIP"]]
        return
    old_spec = old["spec"]
    old_ip = old_spec.get("clusterIP", "")
    old_ips = list(old_spec.get("clusterIPs") or ([old_ip] if old_ip else []))
    if spec["clusterIP"] == "":
        if old_ip == HEADLESS:
            raise invalid("spec.clusterIP", "", "field is immutable (the Service is headless)")
        spec["clusterIP"] = old_ip
        if old_ips:
            spec["clusterIPs"] = old_ips
    elif old_ip and spec["clusterIP"] != old_ip:
        raise invalid("spec.clusterIP", spec["clusterIP"], "field is immutable")
    elif not spec.get("clusterIPs"):  # clusterIP alone, as it was: an older client's manifest (NormalizeClusterIPs)
        spec["clusterIPs"] = old_ips or [spec["clusterIP"]]
    if spec["clusterIP"] == "":
        spec.pop("clusterIPs", None)
    for key in ("ipFamilies", "ipFamilyPolicy"):
        if key not in spec and old_spec.get(key) is not None:
            spec[key] = copy.deepcopy(old_spec[key])
    if spec["type"] != "NodePort":
        return
    old_ports = {(p["port"], p["protocol"]): p.get("nodePort") for p in old_spec.get("ports", [])}
    for p in spec["ports"]:
        if not p.get("nodePort") and old_ports.get((p["port"], p["protocol"])):
            p["nodePort"] = old_ports[(p["port"], p["protocol"])]


def check_range(spec: Mapping[str, Any], ranges: Mapping[str, Range] | Range) -> None:
    """Every cluster IP of ``spec`` in the service range of its family (``ranges``: by family,
    ``IPv4``/``IPv6``; one network: that family's alone)."""
    if not isinstance(ranges, Mapping):
        ranges = {ipfamilies.NAME[ranges.version]: ranges}
    for i, ip in enumerate(ipfamilies.cluster_ips(spec)):
        net = ranges.get(ipfamilies.family_of(ip))
        where = "spec.clusterIP" if i == 0 else f"spec.clusterIPs[{i}]"
        if net is None:
            raise invalid(where, ip, f"{ipfamilies.family_of(ip)} is not configured on this cluster")
        addr = ipaddress.ip_address(ip)
        if addr not in net or addr == net.network_address or (net.version == 4 and addr == net.broadcast_address):
            raise invalid(where, ip, f"provided IP is not in the valid range. The range of valid IPs is {net}")


def usable(service_cidr: Range) -> tuple[int, int]:
    """The first and last address of a range a Service may get: not the network's own (the
    IPv6 subnet-router anycast, RFC 4291 2.6.1), nor IPv4's broadcast address; as the API
    server's allocator."""
    first = int(service_cidr.network_address) + 1
    last = int(service_cidr.broadcast_address) - (1 if service_cidr.version == 4 else 0)
    return first, last


def pick_ip(service_cidr: Range, taken: set[str], rng: random.Random) -> str:
    """A free address of the range, at random as the API server's allocator does: concurrent
    applies rarely race for the same one."""
    first, last = usable(service_cidr)
    size = last - first + 1
    make = type(service_cidr.network_address)
    mine = sum(1 for ip in taken if (":" in ip) == (service_cidr.version == 6))  # this family's (all in its range)
    if size <= 0 or mine >= size:
        raise Exhausted("spec.clusterIP", f"Internal error: failed to allocate a serviceIP: range {service_cidr} is full")
    if mine > size // 2:  # nearly full: walk from a random start
        start = rng.randrange(size)
        for i in range(size):
            ip = str(make(first + (start + i) % size))
            if ip not in taken:
                return ip
    while True:
        ip = str(make(first + rng.randrange(size)))
        if ip not in taken:
            return ip


def fill_node_ports(ports: list[dict[str, Any]], held: set[str], rng: random.Random) -> None:
    """Give each of a Service's ``ports`` without a ``nodePort`` one picked at random: not one
    ``held`` (by any Service), nor one this Service gives another of its ports, nor one just
    picked for it."""
    taken = set(held) | {str(p["nodePort"]) for p in ports if p.get("nodePort")}
    for p in ports:
        if not p.get("nodePort"):
            p["nodePort"] = pick_port(taken, rng)
            taken.add(str(p["nodePort"]))


def pick_port(taken: set[str], rng: random.Random) -> int:
    low, high = NODE_PORT_RANGE
    free = [p for p in range(low, high + 1) if str(p) not in taken]
    if not free:
        raise Exhausted("spec.ports", f"Internal error: failed to allocate a nodePort: range {low}-{high} is full")
    return rng.choice(free)
