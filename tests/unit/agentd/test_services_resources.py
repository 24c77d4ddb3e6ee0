"""Services (ClusterIP, NodePort, headless; kube-proxy's job), the pure half: Service and EndpointSlice validation and defaults as the
API server does them (one line naming the field), the allocators' choices, the cluster config
record and the kinds table.  No etcd, no root."""

from __future__ import annotations

import random
from ipaddress import IPv4Network, IPv6Address

import pytest
import yaml

from agentd.datastore.records import ClusterConfig, RecordError
from agentd.resources import allocation, ipfamilies, kinds, manifests, service
from agentd.resources.validation import Invalid
from agentd.services import dns, model

SERVICE = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  type: NodePort
  selector: {app: web}
  sessionAffinity: ClientIP
  externalTrafficPolicy: Local
  ports:
  - {name: http, port: 80, targetPort: http}
  - {name: dns, port: 53, protocol: UDP, nodePort: 30053}
"""

SLICE = """\
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints:
- addresses: [10.244.1.2]
  conditions: {ready: true, terminating: false}
  nodeName: node1
- addresses: [10.244.2.2]
ports: [{name: http, port: 8080}]
"""


def one(text: str) -> dict:
    (obj,) = manifests.validate_all(manifests.read(text, "f.yaml"), "f.yaml")
    return obj


def error_of(text: str) -> str:
    with pytest.raises(manifests.ManifestError) as err:
        one(text)
    assert "\n" not in str(err.value)
    return str(err.value)


def mutate(text: str, path: str, value) -> str:
    doc = yaml.safe_load(text)
    parts = path.split(".")
    node = doc
    for p in parts[:-1]:
        node = node[int(p)] if p.isdigit() else node[p]
    last = int(parts[-1]) if parts[-1].isdigit() else parts[-1]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return yaml.safe_dump(doc)


def test_service_defaults_as_the_api_server():
    spec = one(SERVICE)["spec"]
    assert spec == {
        "type": "NodePort", "clusterIP": "",  # families: the store's, from the cluster's service ranges
        "selector": {"app": "web"},
        "ports": [
            {"name": "http", "protocol": "TCP", "port": 80, "targetPort": "http"},
            {"name": "dns", "protocol": "UDP", "port": 53, "targetPort": 53, "nodePort": 30053},
        ],
        "sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 10800}},
        "internalTrafficPolicy": "Cluster", "externalTrafficPolicy": "Local",
    }  # fmt: skip
    plain = one("apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {ports: [{port: 53, targetPort: '5353'}]}\n")
    assert plain["metadata"]["namespace"] == "default"
    assert plain["spec"]["type"] == "ClusterIP" and plain["spec"]["sessionAffinity"] == "None"
    assert "externalTrafficPolicy" not in plain["spec"] and plain["spec"]["ports"][0]["targetPort"] == 5353
    headless = one("apiVersion: v1\nkind: Service\nmetadata: {name: h}\nspec: {clusterIP: None, selector: {a: b}}\n")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["ports"] == []
    # An IPv4 cluster's store gives every Service what it gave before dual-stack existed.
    ipfamilies.default(spec, None, ["IPv4"])
    assert (spec["ipFamilies"], spec["ipFamilyPolicy"]) == (["IPv4"], "SingleStack")


def test_a_target_port_0_or_empty_is_the_port_headless_included():
    """Kubernetes' SetDefaults_Service: targetPort 0 or "" is the port, before validation (a
    normal Service's was refused, a headless one kept 0: endpoints on port 0, SRV port 0)."""
    for target in (0, ""):
        doc = f"apiVersion: v1\nkind: Service\nmetadata: {{name: a}}\nspec: {{ports: [{{port: 80, targetPort: {target!r}}}]}}\n"
        assert one(doc)["spec"]["ports"][0]["targetPort"] == 80, target
    headless = kinds.validate({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "db", "namespace": "shop"},
                               "spec": {"clusterIP": "None", "selector": {"app": "db"},
                                        "ports": [{"name": "pg", "port": 5432, "targetPort": 0}]}})  # fmt: skip
    assert headless["spec"]["ports"][0]["targetPort"] == 5432
    db = kinds.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "a", "namespace": "shop", "labels": {"app": "db"}},
                         "spec": {"nodeName": "n1", "containers": []}, "status": {"podIP": "10.244.1.2"}})  # fmt: skip
    (port,) = model.build([headless], [], [db])
    assert [(e.ip, e.port) for e in port.endpoints] == [("10.244.1.2", 5432)]
    assert dns.names([port], "cluster.local").srv["_pg._tcp.db.shop.svc.cluster.local."] == (
        (5432, "10-244-1-2.db.shop.svc.cluster.local."),)
    # false is no 0: refused as a number that is not one
    with pytest.raises(manifests.ManifestError, match="targetPort: Invalid value: false: must be an integer"):
        one("apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {ports: [{port: 80, targetPort: false}]}\n")


@pytest.mark.parametrize(
    "path, value, expected",
    [
        ("spec.type", "LoadBalancer", 'spec.type: Unsupported value: "LoadBalancer": agentd implements ClusterIP and NodePort'),
        ("spec.type", "Bogus", 'spec.type: Unsupported value: "Bogus": supported values: "ClusterIP", "NodePort"'),
        ("spec.ports.0.port", 0, "spec.ports[0].port: Invalid value: 0: must be between 1 and 65535, inclusive"),
        ("spec.ports.0.port", None, "spec.ports[0].port: Required value"),
        ("spec.ports.0.name", None, "spec.ports[0].name: Required value"),
        ("spec.ports.1.name", "http", 'spec.ports[1].name: Duplicate value: "http"'),
        ("spec.ports.0.name", "HTTP", 'spec.ports[0].name: Invalid value: "HTTP": a lowercase RFC 1123 label'),
        ("spec.ports.0.targetPort", "Http_1", 'spec.ports[0].targetPort: Invalid value: "Http_1": must contain only'),
        # digits str.isdigit() takes and int() refuses ("²", over 4300 of them) or reads ("٣" as 3)
        ("spec.ports.0.targetPort", "\u00b2", 'spec.ports[0].targetPort: Invalid value: "\u00b2": must contain only'),
        ("spec.ports.0.targetPort", "\u0663", 'spec.ports[0].targetPort: Invalid value: "\u0663": must contain only'),
        pytest.param("spec.ports.0.targetPort", "9" * 5000, 'spec.ports[0].targetPort: Invalid value: "999',
                     id="targetPort-5000-digits"),
        # leading zeros count toward int()'s limit too (review r9: this still reached it)
        pytest.param("spec.ports.0.targetPort", "0" * 5000, "spec.ports[0].targetPort: Invalid value: 0: must be between",
                     id="targetPort-5000-zeros"),
        ("spec.ports.0.targetPort", "123456", 'targetPort: Invalid value: "123456": must be between 1 and 65535'),
        ("spec.ports.0.protocol", "ICMP", 'spec.ports[0].protocol: Unsupported value: "ICMP"'),
        ("spec.ports.1.nodePort", 8080, "spec.ports[1].nodePort: Invalid value: 8080: provided port is not in the valid range"),
        ("spec.sessionAffinity", "Cookie", 'spec.sessionAffinity: Unsupported value: "Cookie"'),
        ("spec.sessionAffinityConfig", {"clientIP": {"timeoutSeconds": 0}},
         "spec.sessionAffinityConfig.clientIP.timeoutSeconds: Invalid value: 0: must be greater than 0"),
        ("spec.externalTrafficPolicy", "Nearby", 'spec.externalTrafficPolicy: Unsupported value: "Nearby"'),
        ("spec.clusterIP", "10.96.0.300", 'spec.clusterIP: Invalid value: "10.96.0.300": must be empty'),
        ("spec.clusterIP", "fd00::1::2", 'spec.clusterIP: Invalid value: "fd00::1::2": must be empty'),
        ("spec.ipFamilyPolicy", "Dual", 'spec.ipFamilyPolicy: Unsupported value: "Dual"'),
        ("spec.selector", {"app": True}, "spec.selector: Invalid value: true: must be a string"),
        ("spec.portz", [], "spec.portz: unknown field"),
        ("metadata.name", "web.v1", 'metadata.name: Invalid value: "web.v1": a lowercase RFC 1123 label'),
        ("spec.ports", [], "spec.ports: Required value"),
    ],
)  # fmt: skip
def test_bad_services_give_one_line_naming_the_field(path, value, expected):
    message = error_of(mutate(SERVICE, path, value))
    assert message.startswith("f.yaml: document 1 (Service shop/web"), message
    assert expected in message, message


def test_type_dependent_fields():
    cluster_ip = mutate(SERVICE, "spec.type", "ClusterIP")
    assert "spec.ports[1].nodePort: Forbidden: may not be used when `type` is 'ClusterIP'" in error_of(cluster_ip)
    cluster_ip = mutate(mutate(cluster_ip, "spec.ports.1.nodePort", None), "spec.externalTrafficPolicy", "Local")
    assert "spec.externalTrafficPolicy: Invalid value" in error_of(cluster_ip)
    headless_np = mutate(SERVICE, "spec.clusterIP", "None")
    assert "spec.clusterIP: Invalid value: \"None\": may be 'None' only when `type` is 'ClusterIP'" in error_of(headless_np)
    assert "spec.sessionAffinityConfig: Forbidden" in error_of(
        mutate(mutate(SERVICE, "spec.sessionAffinity", "None"), "spec.sessionAffinityConfig", {"clientIP": {}})
    )


LOAD_BALANCER = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  type: LoadBalancer
  selector: {app: web}
  loadBalancerIP: 192.0.2.10
  loadBalancerSourceRanges: [198.51.100.0/24, " 203.0.113.0/25 "]
  loadBalancerClass: example.com/lb
  allocateLoadBalancerNodePorts: false
  externalTrafficPolicy: Local
  healthCheckNodePort: 30500
  ports:
  - {name: http, port: 80, targetPort: http, nodePort: 30080}
"""

EXTERNAL_NAME = """\
apiVersion: v1
kind: Service
metadata: {name: db, namespace: shop}
spec:
  type: ExternalName
  externalName: db.example.com.
"""

TYPE_REFUSED = 'spec.type: Unsupported value: "{}": agentd implements ClusterIP and NodePort services'


def test_load_balancer_and_external_name_are_refused_by_type_after_their_fields():
    """A manifest written for a cluster is refused for what agentd lacks (its type), in one
    line, once its fields pass the API server's checks; a bad field is named first."""
    assert error_of(LOAD_BALANCER).endswith(TYPE_REFUSED.format("LoadBalancer")), error_of(LOAD_BALANCER)
    assert error_of(EXTERNAL_NAME).endswith(TYPE_REFUSED.format("ExternalName")), error_of(EXTERNAL_NAME)
    for text, path, value, expected in [
        (LOAD_BALANCER, "spec.loadBalancerSourceRanges", ["10.0.0.1"], "spec.loadBalancerSourceRanges: Invalid value: "
         '["10.0.0.1"]: must be a list of IP ranges'),
        (LOAD_BALANCER, "spec.loadBalancerIP", "192.0.2.300", 'spec.loadBalancerIP: Invalid value: "192.0.2.300"'),
        (LOAD_BALANCER, "spec.loadBalancerClass", "-lb", 'spec.loadBalancerClass: Invalid value: "-lb"'),
        (LOAD_BALANCER, "spec.allocateLoadBalancerNodePorts", "no",
         'spec.allocateLoadBalancerNodePorts: Invalid value: "no": must be a boolean'),
        (LOAD_BALANCER, "spec.externalTrafficPolicy", "Cluster", "spec.healthCheckNodePort: Invalid value: 30500: "
         "may only be set when `type` is 'LoadBalancer' and `externalTrafficPolicy` is 'Local'"),
        (LOAD_BALANCER, "spec.clusterIP", "None", "spec.clusterIP: Invalid value: \"None\": may be 'None' only"),
        (EXTERNAL_NAME, "spec.externalName", None, "spec.externalName: Required value"),
        (EXTERNAL_NAME, "spec.externalName", "db_1.example.com", 'spec.externalName: Invalid value: "db_1.example.com"'),
        (EXTERNAL_NAME, "spec.clusterIP", "10.96.0.5", "spec.clusterIPs: Forbidden: may not be set for ExternalName services"),
        (EXTERNAL_NAME, "spec.ipFamilyPolicy", "SingleStack",
         "spec.ipFamilyPolicy: Forbidden: may not be set for ExternalName services"),
        (EXTERNAL_NAME, "spec.externalTrafficPolicy", "Local", "spec.externalTrafficPolicy: Invalid value"),
    ]:  # fmt: skip
        message = error_of(mutate(text, path, value))
        assert expected in message and "unknown field" not in message, message
    # The LoadBalancer-only fields on the types agentd implements: the API server's words.
    node_port = mutate(mutate(LOAD_BALANCER, "spec.type", "NodePort"), "spec.healthCheckNodePort", None)
    for key in ("loadBalancerSourceRanges", "allocateLoadBalancerNodePorts", "loadBalancerClass"):
        message = error_of(node_port)
        assert message.endswith(f"spec.{key}: Forbidden: may only be used when `type` is 'LoadBalancer'"), message
        node_port = mutate(node_port, f"spec.{key}", None)
    # What is left is a valid NodePort Service: loadBalancerIP is kept and ignored, as the API
    # server does; externalIPs are refused as not implemented (after their own check).
    spec = one(node_port)["spec"]
    assert spec["type"] == "NodePort" and spec["loadBalancerIP"] == "192.0.2.10"
    assert "spec.externalIPs[0]: Invalid value" in error_of(mutate(node_port, "spec.externalIPs", ["x"]))
    message = error_of(mutate(node_port, "spec.externalIPs", ["192.0.2.7"]))
    assert message.endswith("spec.externalIPs: Unsupported value: agentd does not implement external IPs"), message


def test_endpointslice_validates_at_the_top_level():
    obj = one(SLICE)
    assert obj["endpoints"][1] == {"addresses": ["10.244.2.2"], "conditions": {}}
    assert obj["ports"] == [{"name": "http", "protocol": "TCP", "port": 8080}]
    assert "spec" not in obj
    for path, value, expected in [
        ("addressType", "FQDN", 'addressType: Unsupported value: "FQDN": supported values: "IPv4", "IPv6"'),
        ("addressType", "IPv6", 'endpoints[0].addresses[0]: Invalid value: "10.244.1.2": must be a valid IPv6 address'),
        ("endpoints.0.addresses", ["fd00::2"], 'endpoints[0].addresses[0]: Invalid value: "fd00::2": must be a valid IPv4 address'),
        ("addressType", None, "addressType: Required value"),
        ("endpoints.0.addresses", [], "endpoints[0].addresses: Required value"),
        ("endpoints.0.addresses", ["10.0.0.300"], 'endpoints[0].addresses[0]: Invalid value: "10.0.0.300"'),
        ("endpoints.0.conditions", {"ready": "yes"}, 'endpoints[0].conditions.ready: Invalid value: "yes": must be a boolean'),
        ("ports.0.port", 70000, "ports[0].port: Invalid value: 70000"),
        ("spec", {}, "spec: unknown field"),
    ]:  # fmt: skip
        message = error_of(mutate(SLICE, path, value))
        assert message.startswith("f.yaml: document 1 (EndpointSlice shop/web-1): ") and expected in message, message


def test_null_endpoint_conditions_are_unset_as_the_api_reads_them():
    """discovery.k8s.io/v1 EndpointConditions are *bool: a null is nil, accepted by the API
    and read as ready, serving, not terminating (kube-proxy: Ready == nil || *Ready); an
    endpoint's null nodeName, zone or hostname is unset too.  (validation.obj drops a null
    field, so the record holds none and the model reads it as unset.)"""
    text = SLICE.replace("conditions: {ready: true, terminating: false}",
                         "conditions: {ready: null, serving: null, terminating: null}\n  zone: null\n  hostname: null")
    text = text.replace("nodeName: node1", "nodeName: null")
    obj = one(text)
    assert obj["endpoints"][0] == {"addresses": ["10.244.1.2"], "conditions": {}}
    (sp,) = model.build([{"metadata": {"namespace": "shop", "name": "web"},
                          "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10",
                                   "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]}}],
                        [one(text)], [])  # fmt: skip
    assert [(ep.ip, ep.ready, ep.serving, ep.terminating) for ep in sp.usable()] == [
        ("10.244.1.2", True, True, False), ("10.244.2.2", True, True, False)]


@pytest.mark.parametrize(("family", "address", "why"), [
    ("IPv4", "127.0.0.1", "loopback"), ("IPv4", "127.3.2.1", "loopback"), ("IPv4", "0.0.0.0", "unspecified"),
    ("IPv4", "169.254.169.254", "link-local range"), ("IPv4", "224.0.0.5", "link-local multicast"),
    ("IPv6", "::1", "loopback"), ("IPv6", "::", "unspecified"), ("IPv6", "fe80::1", "link-local range"),
    ("IPv6", "ff02::2", "link-local multicast"),
])
def test_an_endpoint_on_the_nodes_own_or_link_local_addresses_is_refused(family, address, why):
    # The API server's ValidateEndpointIP: such a Service (or Ingress backend) would hand the
    # node's loopback services (its API, etcd) or the cloud metadata service to its clients.
    text = mutate(mutate(SLICE, "addressType", family), "endpoints", [{"addresses": [address]}])
    message = error_of(text)
    assert f'endpoints[0].addresses[0]: Invalid value: "{address}": may not be' in message and why in message, message


@pytest.mark.parametrize("address", ["::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:0.0.0.0", "::ffff:224.0.0.1",
                                     "::ffff:10.244.1.2"])
def test_an_ipv6_endpoint_may_not_be_ipv4_mapped(address):
    # Python's IPv6Address("::ffff:127.0.0.1").is_loopback is False; Go's is True, and the API
    # server's IsValidIPv6Address refuses a mapped address outright (To4() != nil).  Accepted, it
    # made an Ingress backend [::ffff:7f00:1]:2379: the node's etcd, from HAProxy's v6 socket.
    text = mutate(mutate(SLICE, "addressType", "IPv6"), "endpoints", [{"addresses": [address]}])
    message = error_of(text)
    assert f'endpoints[0].addresses[0]: Invalid value: "{address}": must be a valid IPv6 address' in message, message


@pytest.mark.parametrize("address", ["::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:0.0.0.0", "::ffff:224.0.0.1"])
def test_a_mapped_address_is_judged_as_the_ipv4_address_it_embeds(address):
    assert service.special_address(IPv6Address(address)) is not None
    assert service.special_address(IPv6Address("::ffff:10.244.1.2")) is None


@pytest.mark.parametrize(("path", "value"), [
    ("spec.clusterIP", "::ffff:10.96.0.10"), ("spec.clusterIPs", ["::ffff:10.96.0.10"]),
    ("spec.externalIPs", ["::ffff:127.0.0.1"]), ("spec.loadBalancerIP", "::ffff:127.0.0.1"),
])  # fmt: skip
def test_a_service_address_may_not_be_ipv4_mapped(path, value):
    # IPv4 to the API server (Go's To4), IPv6 to Python: refused, as the API server's strict IP
    # validation does, so that no address has two families or two spellings.
    where = path + ("[0]" if isinstance(value, list) else "")
    text = value[0] if isinstance(value, list) else value
    message = error_of(mutate(SERVICE, path, value))
    assert f'{where}: Invalid value: "{text}": must not be an IPv4-mapped IPv6 address' in message, message


def test_an_ipv6_slice_holds_ipv6_addresses():
    text = mutate(mutate(SLICE, "addressType", "IPv6"), "endpoints", [{"addresses": ["FD00:10:244:1::0002"]}])
    obj = one(text)
    assert obj["addressType"] == "IPv6" and obj["endpoints"] == [{"addresses": ["fd00:10:244:1::2"], "conditions": {}}]


def test_kinds_table_names_and_rows():
    assert kinds.lookup("svc") is kinds.SERVICE and kinds.lookup("services") is kinds.SERVICE
    assert kinds.lookup("endpointslices") is kinds.ENDPOINT_SLICE
    assert kinds.lookup("endpointslice.discovery.k8s.io") is kinds.ENDPOINT_SLICE
    svc = one(SERVICE)
    svc["spec"]["clusterIP"] = "10.96.0.10"
    svc["spec"]["ports"][0]["nodePort"] = 31000
    row = kinds.SERVICE.row(svc)
    assert row[:6] == ["shop", "web", "NodePort", "10.96.0.10", "80:31000/TCP,53:30053/UDP", "app=web"]
    assert kinds.ENDPOINT_SLICE.row(one(SLICE))[:5] == ["shop", "web-1", "IPv4", "8080", "10.244.1.2,10.244.2.2"]


def test_allocator_choices_are_free_and_in_range():
    rng = random.Random(1)
    net = IPv4Network("10.96.0.0/29")  # 6 usable
    taken: set[str] = set()
    for _ in range(6):
        ip = allocation.pick_ip(net, taken, rng)
        assert ip not in taken and ip not in ("10.96.0.0", "10.96.0.7")
        taken.add(ip)
    with pytest.raises(allocation.Exhausted, match="range 10.96.0.0/29 is full"):
        allocation.pick_ip(net, taken, rng)
    ports = {str(p) for p in range(30000, 32767)}
    assert allocation.pick_port(ports, rng) == 32767


def test_picked_node_ports_never_repeat_the_services_own_given_or_picked_ones():
    # Two ports free in the whole range: one given to this Service's first port, so its
    # other two ports must get the last free one and then find the range full -- never 30000
    # again, and never the same pick twice.
    held = {str(p) for p in range(30000, 32768)} - {"30000", "30001", "30002"}
    ports = [{"port": 80, "nodePort": 30000}, {"port": 81}, {"port": 82}]
    allocation.fill_node_ports(ports, held, random.Random(0))
    assert sorted(p["nodePort"] for p in ports) == [30000, 30001, 30002]
    with pytest.raises(allocation.Exhausted, match="range 30000-32767 is full"):
        allocation.fill_node_ports([{"port": 80, "nodePort": 30000}, {"port": 81}], held | {"30001", "30002"},
                                   random.Random(0))


def test_carry_over_keeps_ip_and_node_ports_and_refuses_changes():
    old = one(SERVICE)
    old["spec"]["clusterIP"] = "10.96.0.10"
    old["spec"]["ports"][0]["nodePort"] = 31000
    new = one(SERVICE)
    allocation.carry_over(new, old)
    assert new["spec"]["clusterIP"] == "10.96.0.10" and new["spec"]["clusterIPs"] == ["10.96.0.10"]
    assert [p.get("nodePort") for p in new["spec"]["ports"]] == [31000, 30053]
    assert allocation.held(new) == {("serviceips", "10.96.0.10"), ("nodeports", "31000"), ("nodeports", "30053")}
    other = one(mutate(SERVICE, "spec.clusterIP", "10.96.0.11"))
    with pytest.raises(Invalid, match="field is immutable"):
        allocation.carry_over(other, old)
    with pytest.raises(Invalid, match="not in the valid range"):
        allocation.check_range({"clusterIP": "10.96.0.0"}, IPv4Network("10.96.0.0/24"))


def test_cluster_config_carries_the_service_range():
    cfg = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "vxlan", "always")
    assert cfg.service_cidr == IPv4Network("10.96.0.0/12")
    old_record = b'{"backend":"vxlan","cidr":"10.244.0.0/16","encap":"always","subnet_len":24}'
    assert ClusterConfig.from_json(old_record) == cfg
    assert ClusterConfig.from_json(cfg.to_json()) == cfg
    assert b"service_cidr" not in cfg.to_json()  # the record docs/operations.md lists, unless the range is not the default
    other = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "vxlan", "always", IPv4Network("172.30.0.0/16"))
    assert ClusterConfig.from_json(other.to_json()).service_cidr == IPv4Network("172.30.0.0/16")
    with pytest.raises(RecordError, match="service_cidr"):
        ClusterConfig.from_json(old_record[:-1] + b',"service_cidr":"10.96.0.1/12"}')


def test_the_ipv6_service_range_key_and_record():
    from ipaddress import IPv6Network

    from agentd.config.settings import ConfigError, load_config
    from agentd.daemon.agent import wanted_cluster

    base = {"node.name": "n1", "node.address": "192.0.2.1", "node.address_v6": "2001:db8::1", "network.ip_family": "dual"}
    cfg = load_config(None, env={}, overrides=base)
    assert cfg.network.service_cidr_v6 == IPv6Network("fd00:10:96::/112")
    for value, why in (("10.96.0.0/12", "not IPv4"), ("fd00:10:96::/48", "must be a /64 to a /124"),
                       ("fd00:10:244:7::/112", "overlaps the IPv6 pod network fd00:10:244::/48"),
                       ("fd00:10:96::1/112", "host bits")):  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            load_config(None, env={}, overrides={**base, "network.service_cidr_v6": value})
    # The cluster config records it where the cluster has IPv6; an IPv4 cluster's record is as it was.
    dual = wanted_cluster(cfg)
    assert b'"service_cidr_v6":"fd00:10:96::/112"' in dual.to_json() and ClusterConfig.from_json(dual.to_json()) == dual
    assert dual.service_ranges() == {"IPv4": IPv4Network("10.96.0.0/12"), "IPv6": IPv6Network("fd00:10:96::/112")}
    v4 = wanted_cluster(load_config(None, env={}, overrides={"node.name": "n1", "node.address": "192.0.2.1"}))
    assert b"service_cidr_v6" not in v4.to_json() and v4.service_ranges() == {"IPv4": IPv4Network("10.96.0.0/12")}
    six = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "vxlan", "always", ip_family="ipv6",
                        cidr_v6=IPv6Network("fd00:10:244::/48"), subnet_len_v6=64)  # a record written without the range
    assert six.service_ranges() == {"IPv6": IPv6Network("fd00:10:96::/112")}
    with pytest.raises(RecordError, match="service_cidr_v6"):
        ClusterConfig.from_json(dual.to_json().replace(b"fd00:10:96::/112", b"10.96.0.0/12"))


def test_a_target_port_of_digits_behind_thousands_of_zeros_is_that_port():
    # int() counts leading zeros toward its 4300-digit limit (review r9: a traceback in apply)
    from agentd.resources.service import target_port

    assert target_port("0" * 4998 + "80", "spec.ports[0].targetPort") == 80
