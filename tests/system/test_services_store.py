"""Services in etcd: cluster IPs (of each family a Service has) and node ports allocated atomically, against a real etcd.

Many ResourceStores (each its own etcd connection) apply Services at once: every Service gets
its own address of the cluster's range and its own node port, and etcd holds exactly one
allocation key per value, naming its Service.  A re-apply keeps what was given; a taken
address is refused with one line; a delete frees what the Service held, in the same
transaction.  The command line (`agentd apply`, `get svc`, `get endpointslices`) on top.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path

import aetcd
import pytest

from agentd.datastore.store import ClusterConfig, Datastore
from agentd.resources import kinds
from agentd.resources.store import ResourceStore
from agentd.resources.validation import Invalid

RANGE = IPv4Network("10.96.0.0/24")


def service(name: str, ns: str = "default", *, node_port: bool = False, ip: str | None = None,
            ips: list[str] | None = None, policy: str | None = None, families: list[str] | None = None) -> dict:
    spec: dict = {"selector": {"app": name}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
    if node_port:
        spec["type"] = "NodePort"
    if ip:
        spec["clusterIP"] = ip
    if ips:
        spec["clusterIP"], spec["clusterIPs"] = ips[0], ips
    if policy:
        spec["ipFamilyPolicy"] = policy
    if families:
        spec["ipFamilies"] = families
    return kinds.validate({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns}, "spec": spec})


@pytest.fixture
async def stores(etcd_server) -> AsyncIterator:
    made: list[Datastore] = []

    async def make() -> ResourceStore:
        ds = Datastore([etcd_server.endpoint], lease_ttl=5)
        made.append(ds)
        await ds.connect(timeout=10)
        return ResourceStore(ds, timeout=10)

    try:
        yield make
    finally:
        await asyncio.gather(*(ds.close() for ds in made))


async def allocations(server) -> dict[str, str]:
    async with aetcd.Client(server.host, server.client_port, timeout=5) as client:
        got = await client.get_prefix(b"/agentd/allocations/")
        return {kv.key.decode().removeprefix("/agentd/allocations/"): kv.value.decode() for kv in got}


async def test_concurrent_applies_never_share_an_address_or_a_node_port(etcd_server, stores):
    first = await stores()
    await first.ds.ensure_cluster_config(
        ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "vxlan", "always", RANGE), timeout=10
    )
    clients = [await stores() for _ in range(12)]
    # 12 clients x 4 services, all at once: 48 of the range's 254 addresses.
    batches = [[service(f"s{c}-{i}", node_port=True) for i in range(4)] for c in range(12)]
    results = await asyncio.gather(*(cl.apply(b) for cl, b in zip(clients, batches)))
    applied = [a.obj for r in results for a in r]
    assert {a.outcome for r in results for a in r} == {"created"}
    ips = [o["spec"]["clusterIP"] for o in applied]
    ports = [o["spec"]["ports"][0]["nodePort"] for o in applied]
    assert len(set(ips)) == 48 and len(set(ports)) == 48
    assert all(IPv4Address(ip) in RANGE and ip not in ("10.96.0.0", "10.96.0.255") for ip in ips)
    assert all(30000 <= p <= 32767 for p in ports)
    # etcd holds one key per value, naming its Service, and the stored objects agree.
    held = await allocations(etcd_server)
    assert len(held) == 96
    stored = {o["metadata"]["name"]: o for o in await first.list(kinds.SERVICE)}
    for name, obj in stored.items():
        assert held[f"serviceips/{obj['spec']['clusterIP']}"] == f"default/{name}"
        assert held[f"nodeports/{obj['spec']['ports'][0]['nodePort']}"] == f"default/{name}"
        assert obj["spec"]["clusterIPs"] == [obj["spec"]["clusterIP"]]


async def test_reapply_keeps_address_taken_is_refused_delete_frees(etcd_server, stores):
    store = await stores()
    store.service_cidr = RANGE
    (a,) = await store.apply([service("a", node_port=True)])
    ip, port = a.obj["spec"]["clusterIP"], a.obj["spec"]["ports"][0]["nodePort"]
    # The same manifest again: unchanged, same address and node port.
    (again,) = await store.apply([service("a", node_port=True)])
    assert again.outcome == "unchanged"
    assert again.obj["spec"]["clusterIP"] == ip and again.obj["spec"]["ports"][0]["nodePort"] == port
    # Another Service asking for a's address; a asking for another one (immutable); out of range.
    with pytest.raises(Invalid, match=r'spec\.clusterIP: Invalid value: "%s": provided IP is already allocated' % ip):
        await store.apply([service("b", ip=ip)])
    with pytest.raises(Invalid, match=r"spec\.clusterIP: .*field is immutable"):
        await store.apply([service("a", ip="10.96.0.77" if ip != "10.96.0.77" else "10.96.0.78", node_port=True)])
    with pytest.raises(Invalid, match=r"not in the valid range. The range of valid IPs is 10\.96\.0\.0/24"):
        await store.apply([service("c", ip="10.97.0.5")])
    assert await store.get(kinds.SERVICE, "default", "b") is None
    # Becoming a ClusterIP service frees the node port, in the same transaction.
    (a2,) = await store.apply([service("a")])
    assert a2.outcome == "configured" and a2.obj["spec"]["clusterIP"] == ip
    assert await allocations(etcd_server) == {f"serviceips/{ip}": "default/a"}
    await store.delete(kinds.SERVICE, "default", "a")
    assert await allocations(etcd_server) == {}
    # Now b may have it.
    (b,) = await store.apply([service("b", ip=ip)])
    assert b.obj["spec"]["clusterIP"] == ip
    assert await allocations(etcd_server) == {f"serviceips/{ip}": "default/b"}


def _cli(etcd_server, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """``agentd ARGS`` pointed at the test's etcd (no configuration file: the defaults)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    env["AGENTD_ETCD_ENDPOINTS"] = etcd_server.endpoint
    return subprocess.run(
        [str(Path(sys.executable).parent / "agentd"), *args], input=stdin, capture_output=True, text=True,
        env=env, timeout=60,
    )  # fmt: skip


MANIFEST = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  type: NodePort
  selector: {app: web}
  sessionAffinity: ClientIP
  ports:
  - {name: http, port: 80, targetPort: http, nodePort: 30080}
  - {name: dns, port: 53, protocol: UDP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: ext-1, namespace: shop, labels: {kubernetes.io/service-name: ext}}
addressType: IPv4
endpoints:
- addresses: [192.0.2.7]
  conditions: {ready: true}
ports: [{name: http, port: 8080}]
"""


async def test_command_line_apply_get_delete(etcd_server):
    done = await asyncio.to_thread(_cli, etcd_server, "apply", "-f", "-", stdin=MANIFEST)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["service/web created", "endpointslice.discovery.k8s.io/ext-1 created"]
    got = await asyncio.to_thread(_cli, etcd_server, "get", "svc", "-n", "shop")
    assert got.returncode == 0, got.stderr
    header, row = got.stdout.splitlines()
    assert header.split() == ["NAMESPACE", "NAME", "TYPE", "CLUSTER-IP", "PORT(S)", "SELECTOR", "AGE"]
    cells = row.split()
    assert cells[:3] == ["shop", "web", "NodePort"] and IPv4Address(cells[3]) in IPv4Network("10.96.0.0/12")
    assert cells[4].startswith("80:30080/TCP,53:") and cells[4].endswith("/UDP") and cells[5] == "app=web"
    js = await asyncio.to_thread(_cli, etcd_server, "get", "endpointslices", "shop/ext-1", "-o", "json")
    assert json.loads(js.stdout)["endpoints"] == [{"addresses": ["192.0.2.7"], "conditions": {"ready": True}}]
    bad = await asyncio.to_thread(_cli, etcd_server, "apply", "-f", "-", stdin=MANIFEST.replace("30080", "80"))
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.strip() == (
        "agentd apply: stdin: document 1 (Service shop/web): spec.ports[0].nodePort: Invalid value: 80: "
        "provided port is not in the valid range. The range of valid ports is 30000-32767"
    )
    gone = await asyncio.to_thread(_cli, etcd_server, "delete", "svc", "shop/web")
    assert gone.returncode == 0 and gone.stdout.strip() == "service/web deleted"
    assert await allocations(etcd_server) == {}


async def test_a_large_apply_stays_within_etcds_operations_per_transaction(etcd_server, stores):
    store = await stores()
    store.service_cidr = RANGE
    objs = []
    for i in range(120):
        objs.append(service(f"big-{i}", node_port=True))
        objs.append(kinds.validate({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                                    "metadata": {"name": f"big-{i}-1", "namespace": "default",
                                                 "labels": {"kubernetes.io/service-name": f"big-{i}"}},
                                    "addressType": "IPv4", "endpoints": [{"addresses": [f"192.0.2.{i + 1}"]}]}))  # fmt: skip
    applied = await store.apply(objs)
    assert len(applied) == 240 and {a.outcome for a in applied} == {"created"}
    assert len({a.obj["spec"]["clusterIP"] for a in applied if a.obj["kind"] == "Service"}) == 120


RANGE6 = IPv6Network("fd00:10:96::/120")


async def test_dual_stack_services_get_an_address_of_each_family_and_give_them_back(etcd_server, stores):
    """A dual-stack cluster: PreferDualStack Services get one address of each range, concurrent
    applies never share one, an upgrade takes the second in the same transaction that writes the
    Service, a downgrade (SingleStack) frees it there, a taken IPv6 address is refused."""
    clients = [await stores() for _ in range(6)]
    for c in clients:
        c.service_cidr, c.service_cidr_v6, c.service_families = RANGE, RANGE6, ["IPv4", "IPv6"]
    batches = [[service(f"d{c}-{i}", policy="PreferDualStack") for i in range(4)] for c in range(6)]
    results = await asyncio.gather(*(cl.apply(b) for cl, b in zip(clients, batches)))
    applied = [a.obj for r in results for a in r]
    pairs = [o["spec"]["clusterIPs"] for o in applied]
    assert all(o["spec"]["ipFamilies"] == ["IPv4", "IPv6"] for o in applied)
    assert len({p[0] for p in pairs}) == 24 and len({p[1] for p in pairs}) == 24
    assert all(IPv4Address(a) in RANGE and IPv6Address(b) in RANGE6 and b != "fd00:10:96::" for a, b in pairs)
    held = await allocations(etcd_server)
    assert len(held) == 48 and all(held[f"serviceips/{b}"] == f"default/{o['metadata']['name']}" for o, (_, b) in zip(applied, pairs))

    store = clients[0]
    (one,) = await store.apply([service("up")])  # SingleStack: the primary family only
    assert one.obj["spec"]["ipFamilies"] == ["IPv4"] and len(one.obj["spec"]["clusterIPs"]) == 1
    (up,) = await store.apply([service("up", policy="RequireDualStack")])  # upgrade: the IPv6 address added
    v4, v6 = up.obj["spec"]["clusterIPs"]
    assert v4 == one.obj["spec"]["clusterIP"] and IPv6Address(v6) in RANGE6
    held = await allocations(etcd_server)
    assert held[f"serviceips/{v6}"] == "default/up"
    # An IPv4 address nobody holds (the ones above are random), beside the taken IPv6 one.
    free4 = next(str(a) for a in RANGE.hosts() if f"serviceips/{a}" not in held)
    with pytest.raises(Invalid, match=r"spec\.clusterIPs\[1\]: Invalid value: \"%s\": provided IP is already allocated \(to default/up\)" % v6):
        await store.apply([service("other", ips=[free4, v6], policy="RequireDualStack")])
    with pytest.raises(Invalid, match="must be set to 'SingleStack' when releasing the secondary clusterIP"):
        await store.apply([service("up", ips=[v4], policy="RequireDualStack")])
    (down,) = await store.apply([service("up", policy="SingleStack")])  # downgrade: the IPv6 address goes
    assert down.obj["spec"]["clusterIPs"] == [v4] and down.obj["spec"]["ipFamilies"] == ["IPv4"]
    held = await allocations(etcd_server)
    assert f"serviceips/{v6}" not in held and held[f"serviceips/{v4}"] == "default/up"
    # IPv6-primary and headless without selector (both families, no address).
    (six,) = await store.apply([service("six", families=["IPv6"])])
    assert IPv6Address(six.obj["spec"]["clusterIP"]) in RANGE6 and six.obj["spec"]["clusterIPs"] == [six.obj["spec"]["clusterIP"]]
    headless = kinds.validate({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "hl", "namespace": "default"},
                               "spec": {"clusterIP": "None"}})  # fmt: skip
    (hl,) = await store.apply([headless])
    assert (hl.obj["spec"]["ipFamilyPolicy"], hl.obj["spec"]["ipFamilies"]) == ("RequireDualStack", ["IPv4", "IPv6"])
    assert "serviceips/None" not in await allocations(etcd_server)
    # Deleting a dual-stack Service frees both addresses in one transaction.
    await store.delete(kinds.SERVICE, "default", "d0-0")
    first = next(o for o in applied if o["metadata"]["name"] == "d0-0")["spec"]["clusterIPs"]
    held = await allocations(etcd_server)
    assert not {f"serviceips/{ip}" for ip in first} & set(held)


async def test_a_single_stack_cluster_refuses_what_it_cannot_give(etcd_server, stores):
    store = await stores()
    store.service_cidr = RANGE  # the cluster config's families: IPv4 alone
    # A refusal that needs the cluster's state names the Service: a manifest may hold many.
    with pytest.raises(Invalid, match=r'^Service default/x: spec\.ipFamilyPolicy: Invalid value: "RequireDualStack": '
                                      "this cluster is not configured for dual-stack services$"):
        await store.apply([service("y"), service("x", policy="RequireDualStack")])
    (ok,) = await store.apply([service("y", policy="PreferDualStack")])
    assert ok.obj["spec"]["ipFamilies"] == ["IPv4"] and len(ok.obj["spec"]["clusterIPs"]) == 1


async def test_a_large_dual_stack_apply_stays_within_etcds_operations_per_transaction(etcd_server, stores):
    store = await stores()
    store.service_cidr, store.service_cidr_v6, store.service_families = RANGE, RANGE6, ["IPv4", "IPv6"]
    applied = await store.apply([service(f"dual-{i}", node_port=True, policy="PreferDualStack") for i in range(70)])
    assert len(applied) == 70 and {a.outcome for a in applied} == {"created"}
    assert len({ip for a in applied for ip in a.obj["spec"]["clusterIPs"]}) == 140


async def _first_snapshot(store: ResourceStore) -> dict:
    watch = store.watch()
    try:
        ev = await asyncio.wait_for(anext(watch), 10)
    finally:
        await watch.aclose()
    assert ev.kind == "snapshot"
    return ev.objects


async def test_a_fresh_watch_keeps_a_policy_whose_record_became_unreadable(etcd_server, stores):
    """A default-deny policy whose record a newer agentd rewrote with a field this one does not
    know: a restarted agent (a fresh watch, no good version of its own) takes the last readable
    version from etcd's history rather than leaving the policy out (failing open).  Once etcd
    compacted that version away the policy is left out, as before."""
    store = await stores()
    policy = kinds.validate({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                             "metadata": {"name": "deny", "namespace": "shop"}, "spec": {"podSelector": {}}})  # fmt: skip
    await store.apply([policy])
    key = b"/agentd/resources/networkpolicies/shop/deny"
    async with aetcd.Client(etcd_server.host, etcd_server.client_port, timeout=5) as client:
        stored = json.loads((await client.get(key)).value)
        for extra in ({"newField": 1}, {"newerField": 2}):  # two unreadable versions in a row
            newer = dict(stored, spec={**stored["spec"], **extra})
            put = await client.put(key, json.dumps(newer).encode())
        objects = await _first_snapshot(await stores())
        assert list(objects) == [("NetworkPolicy", "shop", "deny")]
        assert objects["NetworkPolicy", "shop", "deny"]["spec"] == policy["spec"]
        assert objects["NetworkPolicy", "shop", "deny"]["metadata"]["resourceVersion"] == str(put.header.revision)
        # Compacted up to the last put: no readable version is left.
        await client.compact(put.header.revision, physical=True)
        fresh = await stores()
        assert await _first_snapshot(fresh) == {}
        assert fresh.left_out == {("NetworkPolicy", "shop", "deny")}


def ingress(name: str, class_name: str | None, annotation: str | None, host: str = "a.example") -> dict:
    meta: dict = {"name": name, "namespace": "shop"}
    if annotation is not None:
        meta["annotations"] = {"kubernetes.io/ingress.class": annotation}
    spec: dict = {"rules": [{"host": host, "http": {"paths": [
        {"path": "/", "pathType": "Prefix", "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}]}
    if class_name is not None:
        spec["ingressClassName"] = class_name
    return kinds.validate({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": meta, "spec": spec})


async def test_an_ingress_whose_class_annotation_names_another_class_is_refused_when_created(etcd_server, stores):
    """As the API server: at create only (a stored one, from an agent before this check, is
    still read and replaced); the same class in both, or either alone, is taken."""
    from agentd.resources.store import encode, object_key

    store = await stores()
    with pytest.raises(Invalid) as err:
        await store.apply([ingress("both", "agentd", "nginx")])
    assert str(err.value) == ("Ingress shop/both: metadata.annotations.kubernetes.io/ingress.class: Invalid value: "
                              '"nginx": must match `ingressClassName` when both are specified')  # fmt: skip
    assert await store.get(kinds.INGRESS, "shop", "both") is None
    applied = await store.apply([ingress("same", "agentd", "agentd"), ingress("field", "agentd", None),
                                 ingress("note", None, "nginx")])  # fmt: skip
    assert [a.outcome for a in applied] == ["created"] * 3
    old = ingress("old", "agentd", "nginx")  # as an older agent stored it
    async with aetcd.Client(etcd_server.host, etcd_server.client_port, timeout=5) as client:
        await client.put(object_key("/agentd", kinds.INGRESS, "shop", "old"), encode(store._stamp(old, None)))
    assert (await store.get(kinds.INGRESS, "shop", "old")) is not None
    again = await store.apply([ingress("old", "agentd", "nginx", host="b.example")])
    assert [a.outcome for a in again] == ["configured"]


def _slice(i: int) -> dict:
    return kinds.validate({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                           "metadata": {"name": f"many-{i}", "namespace": "default",
                                        "labels": {"kubernetes.io/service-name": f"many-{i}"}},
                           "addressType": "IPv4", "endpoints": [{"addresses": ["192.0.2.1"]}]})  # fmt: skip


async def test_an_apply_of_many_transactions_checks_every_object_before_the_first(etcd_server, stores):
    """More than MAX_TXN_OPS objects are written in several transactions; an object of a later
    one that etcd's state makes invalid (an address taken) stops the apply before the first
    is written.  Only a race between the transactions can leave it partial: said, with what
    was written."""
    from agentd.resources.store import PartialApply

    store, other = await stores(), await stores()
    store.service_cidr = other.service_cidr = RANGE
    await other.apply([service("holder", ip="10.96.0.10")])
    objs = [_slice(i) for i in range(110)] + [service("late", ip="10.96.0.10")]
    with pytest.raises(Invalid, match=r'Service default/late: spec\.clusterIP: Invalid value: "10\.96\.0\.10": provided IP '
                                      r"is already allocated \(to default/holder\)"):  # fmt: skip
        await store.apply(objs)
    assert await store.list(kinds.ENDPOINT_SLICE) == []  # nothing written, not the first 100
    # A race: another writer takes the address between the first transaction and the second.
    objs[-1] = service("late", ip="10.96.0.11")
    commit = store._commit

    async def racing_commit(batch):
        applied = await commit(batch)
        if applied is not None and not any(a.obj["kind"] == "Service" for a in applied):
            await other.apply([service("racer", ip="10.96.0.11")])
        return applied

    store._commit = racing_commit  # type: ignore[method-assign]
    with pytest.raises(PartialApply) as err:
        await store.apply(objs)
    assert [a.outcome for a in err.value.applied] == ["created"] * 100
    assert str(err.value).startswith('Service default/late: spec.clusterIP: Invalid value: "10.96.0.11": provided IP '
                                     "is already allocated (to default/racer) -- the apply was partial: 100 of 111 "
                                     "objects were applied before this")  # fmt: skip
    assert len(await store.list(kinds.ENDPOINT_SLICE)) == 100
