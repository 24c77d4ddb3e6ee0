"""A Service's IP families, the pure half: ``clusterIPs``, ``ipFamilies`` and ``ipFamilyPolicy``
validated alone, checked against the stored Service on a change, and defaulted from the
cluster's service ranges, case by case as the API server does (KEP-563's tables and
pkg/registry/core/service/storage's tests); the IPv6 allocator's choices.  No etcd."""

from __future__ import annotations

import copy
import random
from ipaddress import IPv4Network, IPv6Network

import pytest

from agentd.resources import allocation, ipfamilies, kinds
from agentd.resources.validation import Invalid

V4, V6 = ["IPv4"], ["IPv6"]
DUAL, DUAL6 = ["IPv4", "IPv6"], ["IPv6", "IPv4"]


def spec(selector: bool = True, **fields) -> dict:
    """A validated spec (as ``agentd apply`` has it before the store)."""
    body = {**({"selector": {"app": "a"}} if selector else {}), "ports": [{"port": 80}], **fields}
    return kinds.validate({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}, "spec": body})["spec"]


def defaulted(cluster: list[str], old: dict | None = None, selector: bool = True, **fields) -> dict:
    """What the store does before allocating: keep what the manifest leaves out, check the
    change, default."""
    s = spec(selector, **fields)
    allocation.carry_over({"spec": s}, {"spec": old} if old is not None else None)
    if old is not None:
        ipfamilies.check_update(s, old)
    ipfamilies.default(s, old, cluster)
    return s


CREATE = [
    # cluster, fields, (policy, families)
    (V4, {}, ("SingleStack", V4)),
    (V4, {"ipFamilyPolicy": "PreferDualStack"}, ("PreferDualStack", V4)),
    (V4, {"clusterIP": "None"}, ("SingleStack", V4)),  # headless with a selector: as any Service
    (V4, {"clusterIP": "None", "selector": None}, ("RequireDualStack", DUAL)),  # without: both, on any cluster
    (V4, {"clusterIP": "None", "selector": None, "ipFamilyPolicy": "SingleStack"}, ("SingleStack", V4)),
    (DUAL, {}, ("SingleStack", V4)),
    (DUAL, {"ipFamilyPolicy": "PreferDualStack"}, ("PreferDualStack", DUAL)),
    (DUAL, {"ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv6"]}, ("RequireDualStack", DUAL6)),
    (DUAL, {"ipFamilies": ["IPv6"]}, ("SingleStack", V6)),
    (DUAL, {"clusterIP": "fd00:10:96::5", "ipFamilyPolicy": "PreferDualStack"}, ("PreferDualStack", DUAL6)),
    (DUAL, {"clusterIPs": ["10.96.0.5", "fd00:10:96::5"], "ipFamilyPolicy": "RequireDualStack"}, ("RequireDualStack", DUAL)),
    (DUAL6, {}, ("SingleStack", V6)),
    (V6, {}, ("SingleStack", V6)),
    (V6, {"ipFamilyPolicy": "PreferDualStack"}, ("PreferDualStack", V6)),
]  # fmt: skip


@pytest.mark.parametrize("cluster, fields, expected", CREATE)
def test_a_new_service_gets_the_api_servers_defaults(cluster, fields, expected):
    selector = fields.get("selector", True) is not None
    s = defaulted(cluster, selector=selector, **{k: v for k, v in fields.items() if k != "selector"})
    assert (s["ipFamilyPolicy"], s["ipFamilies"]) == expected


REFUSED = [
    (V4, {"ipFamilyPolicy": "RequireDualStack"}, 'spec.ipFamilyPolicy: Invalid value: "RequireDualStack": this cluster is not configured for dual-stack services'),
    (V4, {"ipFamilies": ["IPv6"]}, 'spec.ipFamilies[0]: Invalid value: "IPv6": not configured on this cluster'),
    (V4, {"clusterIP": "fd00::1"}, 'spec.clusterIPs[0]: Invalid value: ["fd00::1"]: IPv6 is not configured on this cluster'),
    (V6, {"ipFamilies": ["IPv4"]}, 'spec.ipFamilies[0]: Invalid value: "IPv4": not configured on this cluster'),
    (DUAL, {"ipFamilies": ["IPv4", "IPv6"]}, "spec.ipFamilyPolicy: Invalid value: \"SingleStack\": must be 'RequireDualStack' or 'PreferDualStack' when multiple IP families are specified"),
    (DUAL, {"clusterIPs": ["10.96.0.5", "fd00:10:96::5"]}, "when multiple cluster IPs are specified"),
]  # fmt: skip


@pytest.mark.parametrize("cluster, fields, message", REFUSED)
def test_what_the_cluster_cannot_give_is_refused_in_the_api_servers_words(cluster, fields, message):
    with pytest.raises(Invalid) as err:
        defaulted(cluster, **fields)
    assert message in str(err.value)


BAD = [
    ({"clusterIPs": ["None", "10.96.0.1"]}, "spec.clusterIPs: Invalid value: [\"None\", \"10.96.0.1\"]: 'None' must be the first and only value"),
    ({"clusterIPs": ["10.96.0.1", "10.96.0.2"]}, "may specify no more than one IP for each IP family"),
    ({"clusterIPs": ["10.96.0.1", "fd00::1", "10.96.0.2"]}, "may only hold up to 2 values"),
    ({"clusterIP": "10.96.0.1", "clusterIPs": ["10.96.0.2"]}, "spec.clusterIPs: Invalid value: [\"10.96.0.2\"]: first value must match `clusterIP`"),
    ({"clusterIPs": ["fd00::zz"]}, 'spec.clusterIPs[0]: Invalid value: "fd00::zz": must be a valid IP address'),
    ({"ipFamilies": ["IPv4", "IPv4"]}, 'spec.ipFamilies[1]: Duplicate value: "IPv4"'),
    ({"ipFamilies": ["ipv6"]}, 'spec.ipFamilies[0]: Unsupported value: "ipv6": supported values: "IPv4", "IPv6"'),
    ({"ipFamilyPolicy": "DualStack"}, 'spec.ipFamilyPolicy: Unsupported value: "DualStack": supported values: "SingleStack", "PreferDualStack", "RequireDualStack"'),
    ({"clusterIP": "fd00::1", "ipFamilies": ["IPv4"]}, 'spec.clusterIPs[0]: Invalid value: "fd00::1": expected an IPv4 value as indicated by `ipFamilies[0]`'),
    ({"clusterIPs": ["10.96.0.1", "fd00::1"], "ipFamilies": ["IPv4", "IPv4"]}, "Duplicate value"),
]  # fmt: skip


@pytest.mark.parametrize("fields, message", BAD)
def test_bad_fields_give_one_line_naming_the_field(fields, message):
    with pytest.raises(Invalid) as err:
        spec(**fields)
    assert message in str(err.value)


def test_addresses_are_kept_in_canonical_form():
    s = spec(clusterIP="FD00:0:0::0A", clusterIPs=["fd00::a", "10.96.0.7"], ipFamilyPolicy="RequireDualStack")
    assert (s["clusterIP"], s["clusterIPs"]) == ("fd00::a", ["fd00::a", "10.96.0.7"])


STORED_DUAL = {"type": "ClusterIP", "clusterIP": "10.96.0.5", "clusterIPs": ["10.96.0.5", "fd00:10:96::5"],
               "ipFamilies": DUAL, "ipFamilyPolicy": "PreferDualStack", "selector": {"app": "a"}}  # fmt: skip
STORED_V4 = {"type": "ClusterIP", "clusterIP": "10.96.0.5", "clusterIPs": ["10.96.0.5"], "ipFamilies": V4,
             "ipFamilyPolicy": "SingleStack", "selector": {"app": "a"}}  # fmt: skip


def test_a_reapply_keeps_what_the_service_has():
    s = defaulted(DUAL, copy.deepcopy(STORED_DUAL))
    assert (s["clusterIPs"], s["ipFamilies"], s["ipFamilyPolicy"]) == (STORED_DUAL["clusterIPs"], DUAL, "PreferDualStack")


def test_upgrade_to_dual_stack_asks_for_the_second_family():
    s = defaulted(DUAL, copy.deepcopy(STORED_V4), ipFamilyPolicy="PreferDualStack")
    assert (s["ipFamilies"], s["clusterIPs"]) == (DUAL, ["10.96.0.5"])  # the store allocates the IPv6 address


def test_downgrade_with_single_stack_releases_the_secondary():
    s = defaulted(DUAL, copy.deepcopy(STORED_DUAL), ipFamilyPolicy="SingleStack")
    assert (s["ipFamilies"], s["clusterIPs"], s["clusterIP"]) == (V4, ["10.96.0.5"], "10.96.0.5")


def test_prefer_dual_stack_is_not_upgraded_when_the_cluster_becomes_dual():
    old = {**copy.deepcopy(STORED_V4), "ipFamilyPolicy": "PreferDualStack"}
    s = defaulted(DUAL, old)
    assert (s["ipFamilies"], s["clusterIPs"]) == (V4, ["10.96.0.5"])


CHANGES = [
    (STORED_DUAL, {"clusterIPs": ["10.96.0.5"], "clusterIP": "10.96.0.5"},
     "spec.ipFamilyPolicy: Invalid value: \"PreferDualStack\": must be set to 'SingleStack' when releasing the secondary clusterIP"),
    (STORED_DUAL, {"clusterIPs": ["10.96.0.5", "fd00:10:96::6"], "clusterIP": "10.96.0.5"},
     'spec.clusterIPs[1]: Invalid value: ["10.96.0.5", "fd00:10:96::6"]: may not change once set'),
    (STORED_V4, {"ipFamilies": ["IPv6"]}, 'spec.ipFamilies[0]: Invalid value: ["IPv6"]: may not change once set'),
    (STORED_V4, {"ipFamilies": ["IPv6", "IPv4"], "ipFamilyPolicy": "PreferDualStack"}, "spec.ipFamilies[0]: Invalid value"),
    (STORED_V4, {"clusterIP": "10.96.0.6"}, 'spec.clusterIP: Invalid value: "10.96.0.6": field is immutable'),
]  # fmt: skip


@pytest.mark.parametrize("old, fields, message", CHANGES)
def test_the_primary_never_changes_and_a_secondary_goes_only_with_single_stack(old, fields, message):
    with pytest.raises(Invalid) as err:
        defaulted(DUAL, copy.deepcopy(old), **fields)
    assert message in str(err.value)


def test_held_allocations_are_every_cluster_ip():
    svc = {"kind": "Service", "spec": {**STORED_DUAL, "ports": [{"port": 80, "nodePort": 30080}]}}
    assert allocation.held(svc) == {("serviceips", "10.96.0.5"), ("serviceips", "fd00:10:96::5"), ("nodeports", "30080")}
    assert allocation.held({"kind": "Service", "spec": {"clusterIP": "None", "clusterIPs": ["None"]}}) == set()


def test_ipv6_allocator_uses_every_address_but_the_subnet_router_anycast():
    rng = random.Random(1)
    net = IPv6Network("fd00:10:96::/125")  # 8 addresses: ::0 is the subnet-router anycast, ::7 is usable
    taken = {"10.96.0.1", "10.96.0.2"}  # another family's: not counted against this range
    got = set()
    for _ in range(7):
        ip = allocation.pick_ip(net, taken | got, rng)
        assert ip not in got and ip != "fd00:10:96::"
        got.add(ip)
    assert "fd00:10:96::7" in got
    with pytest.raises(allocation.Exhausted, match="range fd00:10:96::/125 is full"):
        allocation.pick_ip(net, taken | got, rng)


def test_ranges_are_checked_per_family():
    ranges = {"IPv4": IPv4Network("10.96.0.0/24"), "IPv6": IPv6Network("fd00:10:96::/112")}
    allocation.check_range({"clusterIPs": ["10.96.0.7", "fd00:10:96::ffff"]}, ranges)
    with pytest.raises(Invalid, match=r"spec\.clusterIPs\[1\]: .*not in the valid range. The range of valid IPs is fd00:10:96::/112"):
        allocation.check_range({"clusterIPs": ["10.96.0.7", "fd00:10:97::1"]}, ranges)
    with pytest.raises(Invalid, match="not in the valid range"):
        allocation.check_range({"clusterIPs": ["fd00:10:96::"]}, ranges)
    with pytest.raises(Invalid, match=r"spec\.clusterIP: .*IPv6 is not configured on this cluster"):
        allocation.check_range({"clusterIPs": ["fd00:10:96::1"]}, {"IPv4": ranges["IPv4"]})
