"""A Service's IP families: ``clusterIP``/``clusterIPs``, ``ipFamilies`` and ``ipFamilyPolicy``,
validated and defaulted as the API server does it.

Three steps, as there (Kubernetes' dual-stack Services, KEP-563):

* :func:`validate` - the fields alone (``ValidateServiceClusterIPsRelatedFields``,
  pkg/apis/core/validation): addresses, at most two and one of each family, ``None`` only
  alone, families ``IPv4``/``IPv6`` without repeats, a known policy, each cluster IP of the
  family at its index.  No cluster needed: ``agentd apply`` checks this before it connects.
* :func:`check_update` - a change against the stored Service (``validateUpgradeDowngrade*``):
  the primary cluster IP and the primary family never change; a secondary goes only with
  ``ipFamilyPolicy: SingleStack``.
* :func:`default` - what the registry does before allocating (``initIPFamilyFields``,
  pkg/registry/core/service/storage/alloc.go), from the families the cluster has service
  ranges of, its primary first: the policy (the stored one on an update; a new Service
  ``SingleStack``, a headless one without selector ``RequireDualStack``), the families
  (those of given cluster IPs, else the cluster's primary; the other one added for
  ``PreferDualStack``/``RequireDualStack`` where the cluster has both), and the refusals:
  ``RequireDualStack`` on a single-stack cluster, a family the cluster has no range of.  A
  ``PreferDualStack`` Service whose addresses and families did not change is left as it is:
  a cluster becoming dual-stack does not add a second address to it on its next apply.

The store then allocates a cluster IP for each family that has none yet, in the same etcd
transaction (:mod:`agentd.resources.allocation`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any

from .validation import Invalid, array, invalid, string, unsupported

HEADLESS = "None"
IPV4, IPV6 = "IPv4", "IPv6"
FAMILIES = (IPV4, IPV6)
SINGLE, PREFER_DUAL, REQUIRE_DUAL = "SingleStack", "PreferDualStack", "RequireDualStack"
POLICIES = (SINGLE, PREFER_DUAL, REQUIRE_DUAL)
VERSION = {IPV4: 4, IPV6: 6}
NAME = {4: IPV4, 6: IPV6}


def family_of(ip: str) -> str:
    """``IPv4`` or ``IPv6``: the family of an address in text form."""
    return IPV6 if ":" in ip else IPV4


def other(family: str) -> str:
    return IPV6 if family == IPV4 else IPV4


# ------------------------------------------------------------------ the fields alone


def validate(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``clusterIP`` (always; "" when none is given), ``clusterIPs``, ``ipFamilies`` and
    ``ipFamilyPolicy`` (each where given), checked and in canonical form."""
    ip = string(spec.get("clusterIP", ""), "spec.clusterIP")
    ips = [string(x, f"spec.clusterIPs[{i}]") for i, x in enumerate(array(spec.get("clusterIPs"), "spec.clusterIPs"))]
    if ip not in ("", HEADLESS):
        ip = _address(ip, "spec.clusterIP", "must be empty, 'None', or a valid IP address")
    for i, x in enumerate(ips):
        if x == HEADLESS and i == 0:
            if len(ips) > 1:
                raise invalid("spec.clusterIPs", ips, "'None' must be the first and only value")
            continue
        ips[i] = _address(x, f"spec.clusterIPs[{i}]", "must be a valid IP address")
    if len(ips) > 2:
        raise invalid("spec.clusterIPs", ips, "may only hold up to 2 values")
    if len(ips) == 2 and family_of(ips[0]) == family_of(ips[1]):
        raise invalid("spec.clusterIPs", ips, "may specify no more than one IP for each IP family")
    if ip and ips and ips[0] != ip:
        raise invalid("spec.clusterIPs", ips, "first value must match `clusterIP`")
    out: dict[str, Any] = {"clusterIP": ip or (ips[0] if ips else "")}  # clusterIPs alone: clusterIP is its first
    if ips:
        out["clusterIPs"] = ips
    if "ipFamilies" in spec:
        families: list[str] = []
        for i, fam in enumerate(array(spec["ipFamilies"], "spec.ipFamilies")):
            if fam not in FAMILIES:
                raise unsupported(f"spec.ipFamilies[{i}]", fam, FAMILIES)
            if fam in families:
                raise Invalid(f"spec.ipFamilies[{i}]", f'Duplicate value: "{fam}"')
            families.append(fam)
        out["ipFamilies"] = families
        given = ips or ([out["clusterIP"]] if out["clusterIP"] else [])
        if given and given[0] != HEADLESS:
            for i, (x, fam) in enumerate(zip(given, families)):
                if family_of(x) != fam:
                    raise invalid(f"spec.clusterIPs[{i}]", x, f"expected an {fam} value as indicated by `ipFamilies[{i}]`")
    if "ipFamilyPolicy" in spec and spec["ipFamilyPolicy"] is not None:
        if spec["ipFamilyPolicy"] not in POLICIES:
            raise unsupported("spec.ipFamilyPolicy", spec["ipFamilyPolicy"], POLICIES)
        out["ipFamilyPolicy"] = spec["ipFamilyPolicy"]
    return out


def _address(text: str, path: str, why: str) -> str:
    try:
        if "%" in text:  # a zone: the API server's net.ParseIP refuses it
            raise ValueError(text)
        addr = ipaddress.ip_address(text)
    except ValueError:
        raise invalid(path, text, why) from None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        # ::ffff:10.96.0.10 is IPv4 to the API server (Go's To4) and IPv6 to Python: one
        # address, one spelling (the API server's strict IP validation refuses it too).
        raise invalid(path, text, "must not be an IPv4-mapped IPv6 address")
    return str(addr)


def cluster_ips(spec: Mapping[str, Any]) -> list[str]:
    """The Service's cluster IPs, primary first (none for a headless Service or one not
    allocated yet)."""
    ips = list(spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else []))
    return [] if ips[:1] == [HEADLESS] else [x for x in ips if x]


def headless(spec: Mapping[str, Any]) -> bool:
    return spec.get("clusterIP") == HEADLESS


def families_of(spec: Mapping[str, Any]) -> list[str]:
    """The Service's families as stored (those of its cluster IPs, IPv4, for an object that
    never went through the store)."""
    return list(spec.get("ipFamilies") or [family_of(x) for x in cluster_ips(spec)] or [IPV4])


# ------------------------------------------------------------------ a change


def check_update(spec: Mapping[str, Any], old: Mapping[str, Any]) -> None:
    """The user's new spec (with what it left out kept from the stored one) against the stored."""
    new_ips, old_ips = list(spec.get("clusterIPs") or []), list(old.get("clusterIPs") or [])
    policy = spec.get("ipFamilyPolicy")
    if not (headless(spec) and headless(old)):
        _upgrade_downgrade("clusterIPs", new_ips, old_ips, policy, "clusterIP")
    if headless(spec) == headless(old) and not headless(spec):
        _upgrade_downgrade("ipFamilies", list(spec.get("ipFamilies") or []), list(old.get("ipFamilies") or []), policy,
                           "ipFamily")  # fmt: skip


def _upgrade_downgrade(field: str, new: list[str], old: list[str], policy: str | None, what: str) -> None:
    if not new or not old:
        return
    if len(new) == len(old):
        for i, (a, b) in enumerate(zip(new, old)):
            if a != b:
                raise invalid(f"spec.{field}[{i}]", new, "may not change once set")
        return
    if new[0] != old[0]:
        raise invalid(f"spec.{field}[0]", new, "may not change once set")
    if len(new) < len(old) and policy != SINGLE:
        raise invalid("spec.ipFamilyPolicy", policy, f"must be set to 'SingleStack' when releasing the secondary {what}")


# ------------------------------------------------------------------ defaults


def default(spec: dict[str, Any], old: Mapping[str, Any] | None, cluster: Sequence[str]) -> None:
    """Set ``ipFamilyPolicy`` and ``ipFamilies`` of ``spec`` (in place) for a cluster with
    service ranges of ``cluster`` (families, primary first); Invalid when the Service asks
    for what the cluster has not."""
    if old is not None and _unchanged_prefer_dual(spec, old):
        return
    if spec.get("ipFamilyPolicy") is None:
        if old is not None and old.get("ipFamilyPolicy"):
            spec["ipFamilyPolicy"] = old["ipFamilyPolicy"]
        elif headless(spec) and not spec.get("selector"):
            spec["ipFamilyPolicy"] = REQUIRE_DUAL  # headless without selector: both, where there are both
        else:
            spec["ipFamilyPolicy"] = SINGLE
    policy = spec["ipFamilyPolicy"]
    ips: list[str] = list(spec.get("clusterIPs") or [])
    families: list[str] = list(spec.get("ipFamilies") or [])
    if old is not None:
        old_ips, old_families = list(old.get("clusterIPs") or []), list(old.get("ipFamilies") or [])
        if policy == SINGLE:
            # Unchanged addresses and families with SingleStack: the secondary goes (the primary never changes).
            if ips == old_ips and len(ips) > 1:
                ips = ips[:1]
            if families == old_families and len(families) > 1:
                families = families[:1]
        elif ips and len(ips) < len(old_ips):
            raise invalid("spec.ipFamilyPolicy", policy, "must be 'SingleStack' to release the secondary cluster IP")
        elif families and len(families) < len(old_families):
            raise invalid("spec.ipFamilyPolicy", policy, "must be 'SingleStack' to release the secondary IP family")
    if policy == SINGLE:
        if len(ips) == 2:
            raise invalid("spec.ipFamilyPolicy", policy,
                          "must be 'RequireDualStack' or 'PreferDualStack' when multiple cluster IPs are specified")  # fmt: skip
        if len(families) == 2:
            raise invalid("spec.ipFamilyPolicy", policy,
                          "must be 'RequireDualStack' or 'PreferDualStack' when multiple IP families are specified")  # fmt: skip
    for i, ip in enumerate(ips):  # the families of given cluster IPs
        if ip == HEADLESS:
            break
        if i >= len(families):
            if family_of(ip) not in cluster:
                raise invalid(f"spec.clusterIPs[{i}]", ips, f"{family_of(ip)} is not configured on this cluster")
            families.append(family_of(ip))
    if headless(spec) and not spec.get("selector"):
        # Headless without selector: its endpoints are whatever its slices say, so it may have
        # both families on any cluster.
        families = families or [cluster[0]]
        if len(families) < 2 and policy != SINGLE:
            families.append(other(families[0]))
        _set(spec, ips, families)
        return
    if policy == REQUIRE_DUAL and len(cluster) < 2:
        raise invalid("spec.ipFamilyPolicy", policy, "this cluster is not configured for dual-stack services")
    for i, fam in enumerate(families):
        if fam not in cluster:
            raise invalid(f"spec.ipFamilies[{i}]", fam, "not configured on this cluster")
    families = families or [cluster[0]]
    if policy != SINGLE and len(families) == 1 and len(cluster) == 2:
        families.append(other(families[0]))
    _set(spec, ips, families)


def _set(spec: dict[str, Any], ips: list[str], families: list[str]) -> None:
    spec["ipFamilies"] = families
    if ips:
        spec["clusterIPs"] = ips
        spec["clusterIP"] = ips[0]


def _unchanged_prefer_dual(spec: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    """PreferDualStack before and after, the same type, addresses and families: nothing to do."""
    return (
        spec.get("ipFamilyPolicy") == PREFER_DUAL
        and old.get("ipFamilyPolicy") == PREFER_DUAL
        and spec.get("type") == old.get("type")
        and list(spec.get("clusterIPs") or []) == list(old.get("clusterIPs") or [])
        and list(spec.get("ipFamilies") or []) == list(old.get("ipFamilies") or [])
    )
