"""Resources: manifests in (YAML/JSON, many documents), validation as the API server does it
(one line naming the field, nothing written), defaults, output; the kinds table; the CLI's
checks before etcd; agentd-cni's pod identity.  Pure: no etcd, no root."""

from __future__ import annotations

import json
import os
import threading

import pytest
import yaml

from agentd import cli
from agentd.cni import endpoints
from agentd.resources import kinds, manifests, networkpolicy
from agentd.resources.store import object_key, parse_key

POLICY = """\
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: allow-web
  namespace: prod
spec:
  podSelector:
    matchLabels: {app: web}
  ingress:
  - from:
    - namespaceSelector: {matchLabels: {team: a}}
      podSelector: {matchExpressions: [{key: tier, operator: In, values: [fe]}]}
    - ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16]}
    ports:
    - port: 80
    - port: http
    - {protocol: UDP, port: 5000, endPort: 5010}
"""


def validate_text(text: str, **kw) -> list[dict]:
    return manifests.validate_all(manifests.read(text, "f.yaml"), "f.yaml", **kw)


def error_of(text: str, **kw) -> str:
    with pytest.raises(manifests.ManifestError) as err:
        validate_text(text, **kw)
    message = str(err.value)
    assert "\n" not in message
    return message


def mutate(path: str, value, text: str = POLICY) -> str:
    """POLICY with the field at dotted ``path`` set (``None``: removed)."""
    doc = yaml.safe_load(text)
    parts = path.split(".")
    node = doc
    for p in parts[:-1]:
        node = node[int(p)] if p.isdigit() else node[p]
    last = parts[-1]
    if value is None:
        del node[int(last) if last.isdigit() else last]
    elif last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return yaml.safe_dump(doc)


# ------------------------------------------------------------------ good input, defaults


def test_a_policy_is_stored_with_the_api_servers_defaults():
    (obj,) = validate_text(POLICY)
    spec = obj["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert [p["protocol"] for p in spec["ingress"][0]["ports"]] == ["TCP", "TCP", "UDP"]
    assert obj["metadata"] == {"name": "allow-web", "namespace": "prod"}


@pytest.mark.parametrize(
    "spec, types",
    [
        ({"podSelector": {}}, ["Ingress"]),
        ({"podSelector": {}, "egress": [{}]}, ["Ingress", "Egress"]),
        ({"podSelector": {}, "egress": []}, ["Ingress"]),  # no egress rules: not an Egress policy
        ({"podSelector": {}, "policyTypes": ["Egress"]}, ["Egress"]),
        ({"podSelector": {}, "policyTypes": ["Egress", "Ingress"]}, ["Ingress", "Egress"]),
    ],
)
def test_policy_types_default(spec, types):
    doc = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "p"}, "spec": spec}
    assert kinds.validate(doc)["spec"]["policyTypes"] == types


def test_json_many_documents_and_lists():
    as_json = json.dumps(yaml.safe_load(POLICY))
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "prod", "labels": {"team": "a"}}}
    text = as_json + "\n---\n" + yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [ns]})
    objs = validate_text(text)
    assert [o["kind"] for o in objs] == ["NetworkPolicy", "Namespace"]
    assert objs[1]["metadata"]["labels"] == {"team": "a", "kubernetes.io/metadata.name": "prod"}


def test_ipv6_blocks_are_taken_as_written():
    block = {"cidr": "fd00:10:244::/48", "except": ["fd00:10:244:3::/64", "fd00:10:244:5::7/128"]}
    (obj,) = validate_text(mutate("spec.ingress.0.from.1.ipBlock", block))
    assert obj["spec"]["ingress"][0]["from"][1]["ipBlock"] == block
    (obj,) = validate_text(mutate("spec.ingress.0.from.1.ipBlock", {"cidr": "fd00:10:244::1/48"}))  # host bits: as given
    assert obj["spec"]["ingress"][0]["from"][1]["ipBlock"] == {"cidr": "fd00:10:244::1/48"}
    block = {"cidr": "::/0", "except": [f"2001:{i:x}::1/128" for i in range(networkpolicy.IPBLOCK_EXCEPT_MAX)]}
    (obj,) = validate_text(mutate("spec.ingress.0.from.1.ipBlock", block))  # as many excepts as agentd takes
    assert obj["spec"]["ingress"][0]["from"][1]["ipBlock"] == block


def test_server_fields_round_trip_and_namespace_defaults():
    doc = yaml.safe_load(POLICY)
    doc["metadata"].update(uid="x", resourceVersion="12", creationTimestamp="2024-01-01T00:00:00Z", generation=3)
    del doc["metadata"]["namespace"]
    (obj,) = validate_text(yaml.safe_dump(doc))
    assert obj["metadata"] == {"name": "allow-web", "namespace": "default"}
    (obj,) = validate_text(yaml.safe_dump(doc), namespace="team-b")
    assert obj["metadata"]["namespace"] == "team-b"


def test_output_is_yaml_or_json_a_list_for_listings():
    objs = validate_text(POLICY)
    assert yaml.safe_load(manifests.dump(objs, "yaml", as_list=False)) == objs[0]
    listed = json.loads(manifests.dump(objs, "json", as_list=True))
    assert listed["kind"] == "List" and listed["items"] == objs


# ------------------------------------------------------------------ bad input: one line naming the field

BAD = [
    (mutate("spec.podSelector", None), "spec.podSelector: Required value"),
    (mutate("spec.podselector", {}), "spec.podselector: unknown field"),
    (mutate("spec.ingress.0.ports.0.port", 0), "spec.ingress[0].ports[0].port: Invalid value: 0: must be between 1 and 65535"),
    (mutate("spec.ingress.0.ports.0.port", 70000), "must be between 1 and 65535, inclusive"),
    (mutate("spec.ingress.0.ports.1.port", "HTTP"), 'spec.ingress[0].ports[1].port: Invalid value: "HTTP"'),
    (mutate("spec.ingress.0.ports.1.port", "80"), "must contain at least one letter"),
    (mutate("spec.ingress.0.ports.1.port", "a--b"), "must not contain consecutive hyphens"),
    (mutate("spec.ingress.0.ports.1.port", "a-very-long-port-name"), "must be no more than 15 characters"),
    (mutate("spec.ingress.0.ports.2.endPort", 4000), "spec.ingress[0].ports[2].endPort: Invalid value: 4000: must be greater than or equal to `port`"),
    (mutate("spec.ingress.0.ports.1.endPort", 90), "endPort: Invalid value: 90: may not be specified when `port` is non-numeric"),
    (mutate("spec.ingress.0.ports.0", {"endPort": 90}), "may not be specified when `port` is not specified"),
    (mutate("spec.ingress.0.ports.0.protocol", "tcp"), 'spec.ingress[0].ports[0].protocol: Unsupported value: "tcp": supported values: "TCP", "UDP", "SCTP"'),
    (mutate("spec.ingress.0.ports.0.protocol", "ICMP"), "Unsupported value"),
    (mutate("spec.ingress.0.from.1.ipBlock.cidr", "10.0.0.0"), 'spec.ingress[0].from[1].ipBlock.cidr: Invalid value: "10.0.0.0": must be a valid CIDR'),
    (mutate("spec.ingress.0.from.1.ipBlock.cidr", "10.0.0.0/33"), "must be a valid CIDR"),
    (mutate("spec.ingress.0.from.1.ipBlock.except", ["11.0.0.0/16"]), "spec.ingress[0].from[1].ipBlock.except[0]: Invalid value: \"11.0.0.0/16\": must be a strict subset of `cidr`"),
    (mutate("spec.ingress.0.from.1.ipBlock.except", ["10.0.0.0/8"]), "must be a strict subset"),
    (mutate("spec.ingress.0.from.1.ipBlock.cidr", None), "spec.ingress[0].from[1].ipBlock.cidr: Required value"),
    # agentd's own bound (the API server has none): each except costs up to 128 prefixes
    (mutate("spec.ingress.0.from.1.ipBlock", {"cidr": "::/0", "except": [f"2001:{i:x}::1/128" for i in range(65)]}),
     "spec.ingress[0].from[1].ipBlock.except: Too many: 65: must have at most 64 items (an agentd limit)"),
    # IPv6 blocks: one family per block, excepts strictly inside
    (mutate("spec.ingress.0.from.1.ipBlock", {"cidr": "fd00::/8", "except": ["10.1.0.0/16"]}), 'ipBlock.except[0]: Invalid value: "10.1.0.0/16": must be a strict subset of `cidr`'),
    (mutate("spec.ingress.0.from.1.ipBlock", {"cidr": "10.0.0.0/8", "except": ["::ffff:10.1.0.0/112"]}), "must be a strict subset of `cidr`"),
    (mutate("spec.ingress.0.from.1.ipBlock", {"cidr": "fd00::/8", "except": ["fe80::/10"]}), "must be a strict subset of `cidr`"),
    (mutate("spec.ingress.0.from.1.ipBlock", {"cidr": "fd00::/8", "except": ["fd00::/8"]}), "must be a strict subset of `cidr`"),
    (mutate("spec.ingress.0.from.1.ipBlock.cidr", "fd00::/129"), 'ipBlock.cidr: Invalid value: "fd00::/129": must be a valid CIDR'),
    (mutate("spec.ingress.0.from.1.ipBlock.cidr", "fd00::1"), "must be a valid CIDR"),
    # a zone: Python's ip_network takes one, the API server's ParseCIDR and nftables do not
    (mutate("spec.ingress.0.from.1.ipBlock.cidr", "fe80::%eth0/64"), 'ipBlock.cidr: Invalid value: "fe80::%eth0/64": must be a valid CIDR'),
    (mutate("spec.ingress.0.from.1.ipBlock", {"cidr": "fe80::/10", "except": ["fe80::%1/64"]}), 'ipBlock.except[0]: Invalid value: "fe80::%1/64": must be a valid CIDR'),
    # a netmask or hostmask for the length: Python's ip_network takes them (0.0.0.255 as /24!),
    # the API server takes only a decimal prefix length
    (mutate("spec.ingress.0.from.1.ipBlock.cidr", "10.0.0.0/255.0.0.0"), 'ipBlock.cidr: Invalid value: "10.0.0.0/255.0.0.0": must be a valid CIDR'),
    (mutate("spec.ingress.0.from.1.ipBlock.cidr", "10.0.0.0/0.0.0.255"), 'ipBlock.cidr: Invalid value: "10.0.0.0/0.0.0.255": must be a valid CIDR'),
    (mutate("spec.ingress.0.from.1.ipBlock", {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/255.255.0.0"]}), 'ipBlock.except[0]: Invalid value: "10.1.0.0/255.255.0.0": must be a valid CIDR'),
    (mutate("spec.ingress.0.from.1.ipBlock", {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/0.0.255.255"]}), 'ipBlock.except[0]: Invalid value: "10.1.0.0/0.0.255.255": must be a valid CIDR'),
    (mutate("spec.ingress.0.from.1.ipBlock.cidr", "010.0.0.0/255.0.0.0"), "must be a valid CIDR"),
    (mutate("spec.ingress.0.from.1.ipBlock.cidr", "10.0.0.0/ 8"), "must be a valid CIDR"),
    (mutate("spec.ingress.0.from.1.ipBlock.cidr", "10.0.0.0/\u0668"), "must be a valid CIDR"),  # Arabic-Indic 8
    # an octet past int()'s 4300 digits (its ValueError was a traceback)
    (mutate("spec.ingress.0.from.1.ipBlock.cidr", "0" * 5000 + "1000.0.0.0/8"), 'ipBlock.cidr: Invalid value: "000'),
    (mutate("spec.ingress.0.from.1.ipBlock.cidr", "1" * 5000 + ".0.0.0/8"), "must be a valid CIDR"),
    (mutate("spec.ingress.0.from.1.podSelector", {}), "spec.ingress[0].from[1]: Forbidden: may not specify both ipBlock and another peer"),
    (mutate("spec.ingress.0.from.1", {}), "spec.ingress[0].from[1]: Required value: must specify a peer"),
    (mutate("spec.ingress.0.from.0.podSelector.matchExpressions.0.operator", "in"), 'operator: Invalid value: "in": not a valid selector operator'),
    (mutate("spec.ingress.0.from.0.podSelector.matchExpressions.0.values", []), "matchExpressions[0].values: Required value: must be specified when `operator` is 'In' or 'NotIn'"),
    (mutate("spec.ingress.0.from.0.podSelector.matchExpressions.0", {"key": "a", "operator": "Exists", "values": ["x"]}), "Forbidden: may not be specified when `operator` is 'Exists' or 'DoesNotExist'"),
    (mutate("spec.ingress.0.from.0.podSelector.matchExpressions.0.key", "-bad"), "matchExpressions[0].key: Invalid value: \"-bad\""),
    (mutate("spec.ingress.0.from.0.namespaceSelector.matchLabels", {"team": "a b"}), 'namespaceSelector.matchLabels: Invalid value: "a b"'),
    (mutate("spec.ingress.0.from.0.namespaceSelector.matchLabels", {"team": True}), "must be a string, not boolean"),
    (mutate("spec.podSelector.matchLabels", {"app/x/y": "v"}), "prefix part must be a lowercase RFC 1123 subdomain"),
    (mutate("spec.policyTypes", ["Ingress", "Egress", "Ingress"]), "may not specify more than two policyTypes"),
    (mutate("spec.policyTypes", ["ingress"]), 'spec.policyTypes[0]: Unsupported value: "ingress"'),
    (mutate("spec.ingress", {"from": []}), "spec.ingress: Invalid value"),
    (mutate("metadata.name", "Allow_Web"), 'metadata.name: Invalid value: "Allow_Web": a lowercase RFC 1123 subdomain'),
    (mutate("metadata.name", None), "metadata.name: Required value"),
    (mutate("metadata.namespace", "a.b"), 'metadata.namespace: Invalid value: "a.b": a lowercase RFC 1123 label'),
    (mutate("metadata.generateName", "x-"), "metadata.generateName: Forbidden"),
    (mutate("apiVersion", "networking.k8s.io/v1beta1"), 'apiVersion: Unsupported value: "networking.k8s.io/v1beta1"'),
    (mutate("kind", "Gateway"), 'kind: Unsupported value: "Gateway"'),
    (mutate("kind", None), "kind: Required value"),
    (mutate("spec", None), "spec: Required value"),
    ("apiVersion: v1\nkind: Namespace\nmetadata: {name: Prod}\n", 'metadata.name: Invalid value: "Prod"'),
    ("apiVersion: v1\nkind: Namespace\nmetadata: {name: p, namespace: x}\n", "metadata.namespace: Forbidden: Namespace is not namespaced"),
    ("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {nodeName: n}\n", "Pod objects are written by the agent"),
]  # fmt: skip


@pytest.mark.parametrize("text, expected", BAD, ids=[e for _, e in BAD])
def test_bad_manifests_give_one_line_naming_the_field(text, expected):
    message = error_of(text)
    assert expected in message, message
    assert message.startswith("f.yaml: document 1")


def test_nothing_is_taken_when_one_document_of_many_is_bad():
    good = "apiVersion: v1\nkind: Namespace\nmetadata: {name: ok}\n"
    message = error_of(good + "---\n" + mutate("spec.ingress.0.ports.0.port", 0))
    assert message.startswith("f.yaml: document 2 (NetworkPolicy prod/allow-web): spec.ingress[0].ports[0].port")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a: [1\n", "f.yaml: line 2, column 1: did not find expected ',' or ']'"),
        ("kind: Namespace\nkind: Namespace\n", 'f.yaml: line 2, column 1: mapping key "kind" already defined'),
        ("- 1\n- 2\n", "f.yaml: document 1: a manifest must be an object, not list"),
        ("---\n---\n", "f.yaml: no objects to apply"),
        ("a: !!python/object:os.system x\n", "f.yaml: line 1"),
        (POLICY + "---\n" + POLICY, "document 2 (NetworkPolicy prod/allow-web): the same object is also document 1"),
    ],
)
def test_unreadable_manifests(text, expected):
    assert expected in error_of(text)


def alias_bomb(n: int) -> str:
    """A NetworkPolicy of lists of aliases to lists of aliases: about n**4 nodes from n*30 bytes."""
    values = "[" + ",".join(f'"v{i}"' for i in range(n)) + "]"
    return (
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: x}\nspec:\n"
        "  podSelector:\n    matchExpressions:\n    - &e {key: a, operator: In, values: " + values + "}\n"
        "  ingress:\n  - from:\n    - &p\n      podSelector:\n"
        "        matchExpressions: [" + ",".join(["*e"] * n) + "]\n"
        "  - from: &ps [" + ",".join(["*p"] * n) + "]\n" + "  - from: *ps\n" * n
    )


def test_an_alias_bomb_is_refused_at_once_and_ordinary_aliases_still_work():
    import time

    text = alias_bomb(50)
    assert len(text) < 2000
    started = time.monotonic()
    message = error_of(text)
    assert time.monotonic() - started < 2
    assert message == (f"f.yaml: aliases expand this to more than {manifests.MAX_ALIAS_NODES} nodes beyond those "
                       "written (excessive aliasing)")  # fmt: skip
    (obj,) = validate_text(alias_bomb(5))  # 5**4: a few aliases are fine
    assert len(obj["spec"]["ingress"]) == 7
    # one long string aliased many times is a bomb too
    big = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata:\n  a: &s " + "x" * 100_000 + "\n"
    assert "excessive aliasing" in error_of(big + "".join(f"  a{i}: *s\n" for i in range(100)))
    (obj,) = validate_text(big + "  b: *s\n")
    assert obj["data"]["b"] == "x" * 100_000
    merged = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c, labels: &l {a: b}}\ndata: {<<: *l, c: d}\n"
    (obj,) = validate_text(merged)
    assert obj["data"] == {"a": "b", "c": "d"} and obj["metadata"]["labels"]["a"] == "b"
    assert "an alias refers to a node that holds it" in error_of("a: &a [1, *a]\n")


def test_json_is_read_as_json_and_yaml_numbers_have_no_base_60():
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"smile": "\U0001f600 ok"}}
    text = json.dumps(cm)
    assert "\\ud83d\\ude00" in text  # a surrogate pair, as json.dumps writes it
    (obj,) = validate_text(text)
    assert obj["data"]["smile"] == "\U0001f600 ok"
    objs = validate_text(text + "\n" + json.dumps(cm | {"metadata": {"name": "d"}}))  # a stream of values
    assert [o["metadata"]["name"] for o in objs] == ["c", "d"]
    assert manifests.read('{"kind": "X", "n": 8e1}')[0].raw["n"] == 80.0
    assert error_of('{"kind": "Namespace", "kind": "Namespace"}') == 'f.yaml: mapping key "kind" already defined'
    # YAML: "10:30" is a string (YAML 1.2), not 630 (YAML 1.1's base 60); other numbers as before
    (doc,) = manifests.read("kind: X\nt: 10:30\nf: 1:20.5\ni: 0x1f\no: 017\nd: 1_000\nx: 1.5\n")
    assert doc.raw == {"kind": "X", "t": "10:30", "f": "1:20.5", "i": 31, "o": 15, "d": 1000, "x": 1.5}
    (obj,) = validate_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {at: 10:30}\n")
    assert obj["data"] == {"at": "10:30"}
    # flow-style YAML that is not JSON still reads as YAML
    (obj,) = validate_text("{apiVersion: v1, kind: Namespace, metadata: {name: prod}}\n")
    assert obj["metadata"]["name"] == "prod"


def test_namespace_flag_conflicts_with_the_objects_namespace():
    assert "does not match the namespace" in error_of(POLICY, namespace="other")


# ------------------------------------------------------------------ kinds, keys


def test_kinds_are_found_by_every_name():
    for name in ("netpol", "NetworkPolicy", "networkpolicies", "networkpolicy.networking.k8s.io"):
        assert kinds.lookup(name) is kinds.NETWORK_POLICY
    assert kinds.lookup("ns") is kinds.NAMESPACE and kinds.lookup("po") is kinds.POD
    with pytest.raises(kinds.Invalid, match="doesn't have a resource type"):
        kinds.lookup("deployments")


def test_etcd_keys():
    assert object_key("/agentd", kinds.NETWORK_POLICY, "prod", "allow-web") == b"/agentd/resources/networkpolicies/prod/allow-web"
    assert object_key("/agentd", kinds.NAMESPACE, "", "prod") == b"/agentd/resources/namespaces/prod"
    assert parse_key("/agentd", b"/agentd/resources/pods/default/web-1") == (kinds.POD, "default", "web-1")
    for bad in (b"/agentd/resources/pods/default", b"/agentd/resources/deployments/a/b", b"/agentd/nodes/x"):
        with pytest.raises(ValueError):
            parse_key("/agentd", bad)


# ------------------------------------------------------------------ the command line, before etcd


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["get", "deployments"], "agentd get: the server doesn't have a resource type \"deployments\""),
        (["get", "netpol", "Bad/Name"], 'agentd get: namespace: Invalid value: "Bad"'),
        (["get", "ns", "a/b"], "agentd get: namespaces are not namespaced"),
        (["delete", "pods", "default/x"], "agentd delete: pods are written by the agent"),
        (["label", "pod", "default/x", "a=b c"], "agentd label: label 'a=b c': Invalid value"),
        (["label", "pod", "default/x", "novalue"], "expected KEY=VALUE or KEY-"),
        (["label", "pod", "default/x", "k=v", "k-"],
         "agentd label: label 'k-': label 'k' is also changed by 'k=v': give each label once in a command"),
        (["label", "ns", "prod", "a/k=v", "a/k=w"], "label 'a/k' is also changed by 'a/k=v'"),
        (["label", "netpol", "default/x", "a=b"], "labels of networkpolicies are changed with agentd apply"),
        (["apply", "-f", "/nonexistent/p.yaml"], "agentd apply: /nonexistent/p.yaml: No such file or directory"),
    ],
)
def test_cli_rejects_bad_arguments_before_touching_etcd(capsys, monkeypatch, argv, expected):
    monkeypatch.setenv("AGENTD_ETCD_ENDPOINTS", "http://192.0.2.1:1")  # never reached
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and expected in err, err


def test_cli_apply_rejects_a_bad_manifest_from_a_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AGENTD_ETCD_ENDPOINTS", "http://192.0.2.1:1")
    path = tmp_path / "p.yaml"
    path.write_text(mutate("spec.ingress.0.ports.0.protocol", "tcp"))
    assert cli.main(["apply", "-f", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == (f'agentd apply: {path}: document 1 (NetworkPolicy prod/allow-web): spec.ingress[0].ports[0].protocol: '
                   'Unsupported value: "tcp": supported values: "TCP", "UDP", "SCTP"\n')  # fmt: skip


def test_cli_apply_names_a_manifest_that_is_not_utf8(tmp_path, capsys, monkeypatch):
    import io
    import sys

    monkeypatch.setenv("AGENTD_ETCD_ENDPOINTS", "http://127.0.0.1:1")  # never reached: the error comes first
    path = tmp_path / "x.yaml"
    path.write_bytes(b"kind: \xff\xfe")
    assert cli.main(["apply", "-f", str(path)]) == 1
    assert capsys.readouterr().err == f"agentd apply: {path}: not valid UTF-8 (byte 6)\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff"), encoding="utf-8", errors="surrogateescape"))
    assert cli.main(["apply", "-f", "-"]) == 1
    assert capsys.readouterr().err == "agentd apply: stdin: not valid UTF-8 (byte 0)\n"


def test_cli_apply_refuses_the_same_object_in_two_files(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AGENTD_ETCD_ENDPOINTS", "http://192.0.2.1:1")  # never reached
    ns = "apiVersion: v1\nkind: Namespace\nmetadata: {name: prod}\n"
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(ns)
    b.write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: other}\n---\n" + ns)
    assert cli.main(["apply", "-f", str(a), "-f", str(b)]) == 1
    assert capsys.readouterr().err == (
        f"agentd apply: {b}: document 2 (Namespace prod): the same object is also document 1 of {a}\n"
    )
    assert cli.main(["apply", "-f", str(a), "-f", str(a)]) == 1
    assert capsys.readouterr().err.endswith(f"the same object is also document 1 of {a}\n")


def test_cli_apply_reads_a_bounded_manifest(tmp_path, capsys, monkeypatch):
    import io
    import sys

    from agentd.resources import cli as resources_cli

    monkeypatch.setenv("AGENTD_ETCD_ENDPOINTS", "http://192.0.2.1:1")  # never reached
    monkeypatch.setattr(resources_cli, "MAX_MANIFEST_BYTES", 1000)
    path = tmp_path / "big.yaml"
    path.write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: prod}\n" + "#" * 1000 + "\n")
    assert cli.main(["apply", "-f", str(path)]) == 1
    assert capsys.readouterr().err == f"agentd apply: {path}: larger than 1000 bytes\n"
    assert cli.main(["apply", "-f", "/dev/zero"]) == 1  # not read for ever
    assert capsys.readouterr().err == "agentd apply: /dev/zero: larger than 1000 bytes\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a: b\n" * 1000), encoding="utf-8"))
    assert cli.main(["apply", "-f", "-"]) == 1
    assert capsys.readouterr().err == "agentd apply: stdin: larger than 1000 bytes\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO("a: b\n" * 1000))  # a text stdin (no buffer)
    assert cli.main(["apply", "-f", "-"]) == 1
    assert capsys.readouterr().err == "agentd apply: stdin: larger than 1000 bytes\n"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("a: b\n" * 1000), daemon=True)
    writer.start()
    assert cli.main(["apply", "-f", str(fifo)]) == 1  # a FIFO is still taken, bounded
    writer.join(5)
    assert capsys.readouterr().err == f"agentd apply: {fifo}: larger than 1000 bytes\n"
    # at the bound: read, then refused for what it says, not its size
    path.write_text("x" * 1000)
    assert cli.main(["apply", "-f", str(path)]) == 1
    assert "larger than" not in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["delete", "svc", ""], ["delete", "ns", ""], ["label", "pod", "", "k=v"],
                                  ["delete", "svc", "shop/"], ["get", "svc", ""]])
def test_cli_an_empty_name_is_refused_before_etcd(argv, capsys, monkeypatch):
    """An empty NAME was taken for no name at all: delete and label went to etcd and failed
    there on an assertion (a traceback), get listed everything."""
    from agentd.datastore import store as datastore

    connected = []

    class Datastore:
        def __init__(self, endpoints, prefix, **_):
            pass

        async def connect(self, timeout=None):
            connected.append(True)

        async def close(self):
            pass

    monkeypatch.setattr(datastore, "Datastore", Datastore)
    assert cli.main(argv) == 1
    assert capsys.readouterr().err == f"agentd {argv[0]}: name: Required value\n"
    assert connected == []


def test_cli_apply_cut_short_by_a_race_prints_what_was_written_and_says_so(tmp_path, capsys, monkeypatch):
    from agentd.datastore import store as datastore
    from agentd.resources import cli as resources_cli
    from agentd.resources.store import Applied, PartialApply, StoreError

    class FakeDatastore:
        def __init__(self, *a, **kw):
            pass

        async def connect(self, timeout):
            pass

        async def close(self):
            pass

    class RacedStore:
        def __init__(self, ds, timeout):
            pass

        async def apply(self, objs):
            raise PartialApply([Applied(objs[0], "created", 5), Applied(objs[1], "configured", 5)], len(objs),
                               StoreError("the objects kept changing while being applied; try again"))

    monkeypatch.setattr(datastore, "Datastore", FakeDatastore)
    monkeypatch.setattr(resources_cli, "ResourceStore", RacedStore)
    monkeypatch.setenv("AGENTD_ETCD_ENDPOINTS", "http://192.0.2.1:1")
    path = tmp_path / "ns.yaml"
    path.write_text("---\n".join(f"apiVersion: v1\nkind: Namespace\nmetadata: {{name: n{i}}}\n" for i in range(3)))
    assert cli.main(["apply", "-f", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "namespace/n0 created\nnamespace/n1 configured\n"
    assert err == ("agentd apply: the objects kept changing while being applied; try again -- the apply was partial: "
                   "2 of 3 objects were applied before this\n")  # fmt: skip


def test_cli_label_pod_refuses_labels_over_the_cap_add_has_in_one_line_and_changes_nothing(capsys, monkeypatch):
    """`agentd label pod` has ADD's cap (LABELS_MAX bytes, key + value + 8 each): labels past it
    are refused with one line and the record is left as it was; under it, or shrinking labels
    a pod already had past it (added by an older agentd-cni), they are set."""
    from types import SimpleNamespace

    from agentd.cni import endpoints
    from agentd.datastore import store as datastore
    from agentd.policy.publisher import record_for
    from agentd.resources import store as resource_store
    from agentd.resources.store import encode, object_key

    key = object_key("/agentd", kinds.POD, "default", "web")
    near = {f"k{i:03d}": "v" * 63 for i in range(216)}  # 16,200 bytes: 184 short of the cap
    ep = endpoints.Endpoint(container_id="c0ffee01", namespace="default", name="web", labels=near, ports=[],
                            ips=["10.244.3.7"], interface="veth1", mac="aa:bb:cc:dd:ee:ff", bridge="cni0")
    stored = {"value": encode(record_for(ep, "node1", near)), "rev": 7}
    puts = []

    class Client:
        async def get(self, k):
            assert k == key
            return SimpleNamespace(value=stored["value"], mod_revision=stored["rev"], lease=5)

        async def transaction(self, compare, success, failure):
            puts.append(success)
            stored["value"], stored["rev"] = success[0].value, stored["rev"] + 1
            return True, [SimpleNamespace(response_put=SimpleNamespace(header=SimpleNamespace(revision=stored["rev"])))]

    class FakeDatastore:
        prefix = "/agentd"

        def __init__(self, *a, **kw):
            pass

        async def connect(self, timeout):
            pass

        async def close(self):
            pass

        async def request(self, what, op, *, timeout=None):
            return await op(Client())

    monkeypatch.setattr(datastore, "Datastore", FakeDatastore)
    monkeypatch.setenv("AGENTD_ETCD_ENDPOINTS", "http://192.0.2.1:1")
    over = [f"more{i}={'x' * 63}" for i in range(3)]  # 228 bytes more
    assert cli.main(["label", "pod", "default/web", *over]) == 1
    out, err = capsys.readouterr()
    size = endpoints.labels_size({**near, **dict(o.split("=") for o in over)})
    assert out == "" and err == (f"agentd label: metadata.labels: Too long: {len(near) + 3} labels of {size} bytes "
                                 f"(key + value + 8 each), more than the {endpoints.LABELS_MAX} a pod may have here\n")
    assert puts == []
    assert cli.main(["label", "pod", "default/web", "tier=web"]) == 0 and len(puts) == 1  # under the cap: set
    capsys.readouterr()
    past = {**near, **{f"old{i}": "o" * 63 for i in range(20)}}  # an older agentd-cni took more
    stored["value"] = encode(record_for(ep, "node1", past))
    assert cli.main(["label", "pod", "default/web", "old0-"]) == 0 and len(puts) == 2  # shrinking: allowed
    assert cli.main(["label", "pod", "default/web", "tier=db"]) == 1 and len(puts) == 2  # growing: not
    assert resource_store.POD_LABELS_MAX == endpoints.LABELS_MAX  # the one cap, counted alike
    assert resource_store._labels_size(near) == endpoints.labels_size(near)


# ------------------------------------------------------------------ pod identity from the runtime


def test_identity_from_cni_args_labels_and_ports():
    env = {"CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAMESPACE=prod;K8S_POD_NAME=web-1;K8S_POD_INFRA_CONTAINER_ID=abc"}
    netconf = {
        "args": {"cni": {"labels": [{"key": "app", "value": "web"}, {"key": "tier", "value": "fe"}]}},
        "runtimeConfig": {"labels": {"tier": "be"}, "containerPorts": [{"name": "http", "containerPort": 8080}]},
    }
    warnings: list[str] = []
    ns, name, labels, ports = endpoints.identity(env, netconf, warnings.append)
    assert (ns, name) == ("prod", "web-1")
    assert labels == {"app": "web", "tier": "be"}  # runtimeConfig last
    assert ports == [{"containerPort": 8080, "protocol": "TCP", "name": "http"}]
    assert endpoints.identity({"CNI_ARGS": "IgnoreUnknown=1"}, {}, warnings.append) is None
    assert warnings == []  # a pod, and a container that claims to be none: nothing to say


def test_identity_takes_a_kubernetes_container_port_with_host_port_and_host_ip():
    """A ContainerPort of a pod spec may carry hostPort and hostIP (the runtime passes those to
    portmap as portMappings): the named port is what policy needs, the rest is dropped."""
    env = {"CNI_ARGS": "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p"}
    port = {"name": "http", "containerPort": 80, "protocol": "TCP", "hostPort": 8080, "hostIP": "127.0.0.1"}
    for netconf in ({"runtimeConfig": {"containerPorts": [port]}}, {"args": {"cni": {"containerPorts": [port]}}}):
        assert endpoints.identity(env, netconf)[3] == [{"containerPort": 80, "protocol": "TCP", "name": "http"}]


@pytest.mark.parametrize(
    "cni_args, why",
    [
        # podman 4/5 with its CNI backend (containers/common libnetwork/cni/run.go getRuntimeConfig,
        # "Do not set the K8S env vars", podman#12083): the container name as K8S_POD_NAME only.
        ("IgnoreUnknown=1;K8S_POD_NAME=objective_tesla", "K8S_POD_NAME but no K8S_POD_NAMESPACE"),
        ("IgnoreUnknown=1;K8S_POD_NAME=web", "K8S_POD_NAME but no K8S_POD_NAMESPACE"),
        # podman 3 (ocicni): the container name as both; its default names hold "_".
        ("IgnoreUnknown=1;K8S_POD_NAMESPACE=objective_tesla;K8S_POD_NAME=objective_tesla;K8S_POD_INFRA_CONTAINER_ID=3f2a5c",
         'CNI_ARGS K8S_POD_NAMESPACE: Invalid value: "objective_tesla"'),
        ("K8S_POD_NAMESPACE=Prod;K8S_POD_NAME=a", 'CNI_ARGS K8S_POD_NAMESPACE: Invalid value: "Prod"'),
        ("K8S_POD_NAMESPACE=p;K8S_POD_NAME=My_App", 'CNI_ARGS K8S_POD_NAME: Invalid value: "My_App"'),
        ("K8S_POD_NAMESPACE=p", "K8S_POD_NAMESPACE but no K8S_POD_NAME"),
    ],
)  # fmt: skip
def test_identity_needs_both_names_valid_else_none_with_one_warning(cni_args, why):
    """A container runtime that is not kubelet's (podman) sends pod names that are no pod's: the
    container is attached without identity, as one without K8S args, and the plugin says why."""
    warnings: list[str] = []
    netconf = {"runtimeConfig": {"labels": {"a": "b c"}}}  # not checked: there is no pod to label
    assert endpoints.identity({"CNI_ARGS": cni_args}, netconf, warnings.append) is None
    assert len(warnings) == 1 and why in warnings[0] and "\n" not in warnings[0], warnings


@pytest.mark.parametrize(
    "env, netconf, expected",
    [
        ({"CNI_ARGS": "K8S_POD_NAMESPACE=p;K8S_POD_NAME=a"}, {"runtimeConfig": {"labels": {"a": "b c"}}}, 'labels: Invalid value: "b c"'),
        ({"CNI_ARGS": "K8S_POD_NAMESPACE=p;K8S_POD_NAME=a"}, {"args": {"cni": {"labels": {"a": "b"}}}}, "args.cni.labels must be a list"),
        ({"CNI_ARGS": "K8S_POD_NAMESPACE=p;K8S_POD_NAME=a"}, {"args": {"cni": {"labels": [{"key": ["x"]}]}}}, "args.cni.labels must be a list"),
        ({"CNI_ARGS": "K8S_POD_NAMESPACE=p;K8S_POD_NAME=a"}, {"args": {"cni": {"labels": [{"key": "a", "value": 1}]}}}, "args.cni.labels must be a list"),
        ({"CNI_ARGS": "K8S_POD_NAMESPACE=p;K8S_POD_NAME=a"}, {"runtimeConfig": {"containerPorts": [{"name": "HTTP", "containerPort": 80}]}},
         'containerPorts[0].name: Invalid value: "HTTP"'),
        ({"CNI_ARGS": "K8S_POD_NAMESPACE=p;K8S_POD_NAME=a"},
         {"runtimeConfig": {"containerPorts": [{"name": "a", "containerPort": 80}, {"name": "a", "containerPort": 81}]}},
         'containerPorts[1].name: Duplicate value: "a"'),
    ],
)  # fmt: skip
def test_bad_identity_is_one_clear_error(env, netconf, expected):
    with pytest.raises(endpoints.EndpointError) as err:
        endpoints.identity(env, netconf)
    assert expected in str(err.value)


@pytest.mark.parametrize("change, word", [
    ({"ips": ["10.0.0.300"]}, "10.0.0.300"),
    ({"ips": ["fd00::5%eth0"]}, "fd00::5%eth0"),
    ({"ips": [5]}, "ips"),
    ({"ports": [{"name": "http"}]}, "ports"),
    ({"ports": [{"name": "http", "containerPort": 70000}]}, "ports"),
    ({"ports": [{"name": "http", "containerPort": True}]}, "ports"),
    ({"labels": {"app": ["web"]}}, "labels"),
])  # fmt: skip
def test_an_endpoint_file_with_bad_contents_is_refused_when_read(change, word):
    """A file the policy agent reads must hold what a pod record can be made of: one that does
    not is refused (read_all logs and skips it), never taken in to fail every policy sync."""
    good = {"container_id": "c1", "namespace": "shop", "name": "web", "interface": "veth1", "mac": "02:00:00:00:00:01",
            "bridge": "cni0", "ips": ["10.244.1.5"], "labels": {"app": "web"},
            "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]}
    assert endpoints.Endpoint.from_json(json.dumps(good)).ips == ["10.244.1.5"]
    with pytest.raises(ValueError, match=word.replace("[", "\\[")):
        endpoints.Endpoint.from_json(json.dumps({**good, **change}))


def test_attachment_from_the_bridge_plugins_result():
    result = {
        "interfaces": [
            {"name": "cni0", "mac": "02:00:00:00:00:01"},
            {"name": "veth1234", "mac": "02:00:00:00:00:02"},
            {"name": "eth0", "mac": "02:00:00:00:00:03", "sandbox": "/run/netns/x"},
        ],
        "ips": [{"address": "10.244.1.5/24", "gateway": "10.244.1.1", "interface": 2}],
    }
    assert endpoints.attachment(result, "cni0") == (["10.244.1.5"], "veth1234", "02:00:00:00:00:02")
    with pytest.raises(endpoints.EndpointError):
        endpoints.attachment({"interfaces": [], "ips": []}, "cni0")
    # The pod's own MAC: the sandbox interface's of that name (checked as the port's source MAC).
    assert endpoints.pod_mac(result, "eth0") == "02:00:00:00:00:03"
    assert endpoints.pod_mac(result, "net1") == ""
    assert endpoints.pod_mac({"interfaces": [{"name": "eth0", "mac": "junk", "sandbox": "x"}]}, "eth0") == ""
    # A MAC the ADD asks for (a plugin chained after agentd-cni, such as tuning, sets it
    # after the delegate's result): CNI_ARGS MAC=, else runtimeConfig.mac; junk is no ask.
    env = {"CNI_ARGS": "K8S_POD_NAMESPACE=p;MAC=0A:58:0A:F4:01:09;K8S_POD_NAME=w"}
    assert endpoints.pod_mac(result, "eth0", env, {}) == "0a:58:0a:f4:01:09"
    runtime = {"runtimeConfig": {"mac": "02:AA:00:00:00:07"}}
    assert endpoints.pod_mac(result, "eth0", {}, runtime) == "02:aa:00:00:00:07"
    assert endpoints.pod_mac(result, "eth0", env, runtime) == "0a:58:0a:f4:01:09"
    assert endpoints.pod_mac(result, "eth0", {"CNI_ARGS": "MAC=nope"}, {"runtimeConfig": {"mac": 5}}) == "02:00:00:00:00:03"
    ep = endpoints.Endpoint("c1", "p", "w", {}, [], ["10.244.1.5"], "veth1234", "02:00:00:00:00:02", "cni0",
                            pod_mac="02:00:00:00:00:03")
    assert endpoints.Endpoint.from_json(ep.to_json()).pod_mac == "02:00:00:00:00:03"
    older = json.loads(ep.to_json())
    del older["pod_mac"]  # an older plugin's file: no MAC, not checked
    assert endpoints.Endpoint.from_json(json.dumps(older)).pod_mac == ""


def test_a_dual_stack_pod_is_recorded_and_known_to_policy_with_both_addresses():
    """host-local with two ranges: both addresses go from the ADD result into the endpoint
    file, the pod record's podIPs, and the policy engine's pod."""
    from agentd.policy.model import Pod
    from agentd.policy.publisher import record_for

    result = {
        "interfaces": [{"name": "cni0", "mac": "02:00:00:00:00:01"}, {"name": "veth1234", "mac": "02:00:00:00:00:02"}],
        "ips": [{"address": "10.244.1.5/24", "gateway": "10.244.1.1"}, {"address": "fd00:10:244:1::5/64", "gateway": "fd00:10:244:1::1"}],
    }
    ips, interface, mac = endpoints.attachment(result, "cni0")
    assert ips == ["10.244.1.5", "fd00:10:244:1::5"]
    ep = endpoints.Endpoint("c1", "prod", "web-1", {"app": "web"}, [], ips, interface, mac, "cni0")
    record = kinds.validate(record_for(ep, "node1", {"app": "web"}))
    assert record["status"] == {"phase": "Running", "podIP": "10.244.1.5", "podIPs": [{"ip": "10.244.1.5"}, {"ip": "fd00:10:244:1::5"}]}
    assert [str(ip) for ip in Pod.parse(record).ips] == ips


def test_endpoint_files_round_trip(tmp_path):
    ep = endpoints.Endpoint("c1", "prod", "web-1", {"app": "web"}, [], ["10.244.1.5"], "veth1", "02:00:00:00:00:02", "cni0")
    endpoints.write(tmp_path, ep)
    (tmp_path / "endpoints" / "junk.json").write_text("{")
    reported: set[str] = set()
    assert endpoints.read_all(tmp_path, reported) == {"c1": ep}
    assert len(reported) == 1
    endpoints.remove(tmp_path, "c1")
    endpoints.remove(tmp_path, "c1")  # idempotent, as DEL must be
    assert endpoints.read_all(tmp_path, reported) == {}


@pytest.mark.parametrize("value", [-1, 61, "2", True])
def test_cni_policy_timeout_is_checked(value):
    from agentd.cni import plugin as cni

    conf = {"cniVersion": "1.0.0", "name": "agentd", "type": "agentd-cni", "policyTimeout": value}
    with pytest.raises(cni.CniError, match="'policyTimeout' must be a number of seconds in \\[0, 60\\]"):
        cni.parse_netconf(json.dumps(conf).encode())


def _watched(events, history=None, compacted=0, store=None):
    """What ResourceStore.watch makes of these etcd watch events (a datastore stand-in);
    ``history``: the key-values etcd keeps (revision -> KeyValue or None: deleted then),
    ``compacted``: the revision below which it keeps none."""
    import asyncio

    from agentd.datastore.store import HistoryCompacted
    from agentd.resources.store import ResourceStore

    class Datastore:
        prefix = "/agentd"
        asked: list[int] = []

        async def watch_prefix(self, prefix, what):
            for ev in events:
                yield ev

        async def get_at(self, key, revision, *, timeout=None):
            self.asked.append(revision)
            if revision < compacted:
                raise HistoryCompacted(f"etcd revision {revision} is compacted")
            found = [r for r in (history or {}) if r <= revision]
            return history[max(found)] if found else None

    async def main():
        return [ev async for ev in (store or ResourceStore(Datastore())).watch()]

    return asyncio.run(main())


def _policy_kv(value: bytes, revision: int):
    from agentd.datastore.watches import KeyValue

    key = object_key("/agentd", kinds.KINDS["NetworkPolicy"], "prod", "allow-web")
    return KeyValue(key, value, revision, 0)


def test_an_unreadable_put_keeps_the_objects_last_good_version():
    """A record that becomes unreadable (a bad put by hand, nesting too deep for the JSON
    parser, a field a newer agentd writes) is logged and leaves the watcher with what it had:
    only a delete in etcd removes the object (bad input loses nothing already working)."""
    from agentd.datastore.watches import PrefixEvent
    from agentd.resources.store import encode

    good = encode(validate_text(POLICY)[0])
    events = _watched([
        PrefixEvent("snapshot", 5, [_policy_kv(good, 5)]),
        PrefixEvent("put", 6, [_policy_kv(b"[" * 100_000, 6)]),  # RecursionError in json.loads
        PrefixEvent("put", 7, [_policy_kv(b"{not json", 7)]),
        PrefixEvent("snapshot", 8, [_policy_kv(b"{not json", 7)]),  # a re-sync: still the last good one
        PrefixEvent("delete", 9, [_policy_kv(b"", 9)]),
    ])
    # Kept as of the record's revision in etcd (a writer comparing it compares what etcd holds).
    assert [ev.kind for ev in events] == ["snapshot", "put", "put", "snapshot", "delete"]
    key = ("NetworkPolicy", "prod", "allow-web")
    assert list(events[0].objects) == list(events[3].objects) == [key]
    kept = [events[1].obj, events[2].obj, events[3].objects[key]]
    first = events[0].objects[key]
    assert [o["metadata"].pop("resourceVersion") for o in kept] == ["6", "7", "7"]
    assert first["metadata"]["resourceVersion"] == "5"  # (the snapshot's own object is not changed)
    first["metadata"].pop("resourceVersion")
    assert all(o == first for o in kept)


def test_a_watch_starting_on_an_unreadable_record_takes_its_last_readable_version_from_history():
    """A restarted agent or a new node: the record is unreadable already (a field a newer
    agentd writes), so no watch of its own has its good version.  Left out, a default-deny
    policy would stop isolating (fail open): its previous versions in etcd's history are
    read back, past unreadable ones."""
    from agentd.datastore.watches import PrefixEvent
    from agentd.resources.store import encode

    good = encode(validate_text(POLICY)[0])
    history = {3: _policy_kv(good, 3), 6: _policy_kv(b"{not json", 6), 9: _policy_kv(b'{"newer": 1}', 9)}
    (snap,) = _watched([PrefixEvent("snapshot", 10, [_policy_kv(b'{"newer": 1}', 9)])], history)
    assert list(snap.objects) == [("NetworkPolicy", "prod", "allow-web")]
    obj = snap.objects[("NetworkPolicy", "prod", "allow-web")]
    assert obj["spec"] == validate_text(POLICY)[0]["spec"] and obj["metadata"]["resourceVersion"] == "9"


def test_an_unreadable_record_without_a_readable_past_is_left_out(caplog):
    from agentd.datastore.watches import PrefixEvent
    from agentd.resources.store import encode

    good = encode(validate_text(POLICY)[0])
    snapshot = [PrefixEvent("snapshot", 10, [_policy_kv(b"{not json", 9)])]
    # Compacted at revision 9: etcd answers no read before it (at 8 it would still have had
    # the version of revision 3, live then).
    (snap,) = _watched(snapshot, {3: _policy_kv(good, 3), 9: _policy_kv(b"{not json", 9)}, compacted=9)
    assert snap.objects == {} and "compacted" in caplog.text
    # Never readable: the key's creation (nothing before it) is reached.
    (snap,) = _watched(snapshot, {5: _policy_kv(b"{bad", 5), 9: _policy_kv(b"{not json", 9)})
    assert snap.objects == {} and "never readable" in caplog.text
    # Deleted and created again unreadable: the deleted incarnation does not come back.
    (snap,) = _watched(snapshot, {3: _policy_kv(good, 3), 6: None, 9: _policy_kv(b"{not json", 9)})
    assert snap.objects == {}
    # Only a few unreadable versions are looked past.
    history = {r: _policy_kv(b"{bad" if r > 1 else good, r) for r in range(1, 10)}
    (snap,) = _watched(snapshot, history)
    assert snap.objects == {} and "no version of it was readable" in caplog.text


def test_a_watch_knowing_the_good_version_does_not_read_history():
    from agentd.datastore.watches import PrefixEvent
    from agentd.resources.store import encode

    good = encode(validate_text(POLICY)[0])
    events = _watched([PrefixEvent("snapshot", 5, [_policy_kv(good, 5)]),
                       PrefixEvent("snapshot", 8, [_policy_kv(b"{not json", 7)])], history={})  # fmt: skip
    (kept,), (first,) = events[1].objects.values(), events[0].objects.values()
    assert kept["metadata"]["resourceVersion"] == "7" and kept["spec"] == first["spec"]


def test_an_unreadable_own_pod_record_is_replaced_not_retried_for_ever():
    """A pod record of this node made unreadable (revision 200), the pod then re-created
    (a new container): the watch hands the kept version over as of revision 200, so the
    publisher's compare-and-put names what etcd holds and succeeds; a compare that fails
    anyway waits (for the watch, or CONFLICT_RETRY) instead of re-trying at once."""
    import asyncio

    from agentd.datastore.watches import KeyValue, PrefixEvent
    from agentd.policy import publisher as pub_mod
    from agentd.policy.publisher import PodPublisher, record_for
    from agentd.resources.store import encode

    ep_old = endpoints.Endpoint("c1", "default", "web", {"app": "web"}, [], ["10.244.1.5"], "veth1",
                                "aa:bb:cc:dd:ee:01", "cni0")
    ep_new = endpoints.Endpoint("c2", "default", "web", {"app": "web"}, [], ["10.244.1.9"], "veth2",
                                "aa:bb:cc:dd:ee:02", "cni0")
    key = object_key("/agentd", kinds.POD, "default", "web")
    good = encode(kinds.validate(record_for(ep_old, "n1", ep_old.labels)))
    bad = b'{"apiVersion":"v1","kind":"Pod","metadata":{"name":"web"},"spec":{"nodeName":7}}'
    events = _watched([PrefixEvent("snapshot", 100, [KeyValue(key, good, 100, 7)]),
                       PrefixEvent("put", 200, [KeyValue(key, bad, 200, 7)])])  # fmt: skip
    assert [ev.kind for ev in events] == ["snapshot", "put"]
    record = events[1].obj
    assert record["metadata"]["resourceVersion"] == "200" and events[1].lease == 7

    class Store:
        def __init__(self, at: int) -> None:
            self.at, self.expects = at, []

        async def put_owned(self, obj, *, lease, expect):
            self.expects.append(expect)
            return expect == self.at  # etcd's compare

    class Leased:
        lease_id = 7

    async def publish(store):
        pub = PodPublisher("n1", "/nonexistent", Leased(), store, {("default", "web"): record},
                           {("default", "web"): 7})  # type: ignore[arg-type]
        pub.endpoints, pub.have_local = {"c2": ep_new}, True
        await pub.publish()
        handle = pub._retry
        woke_at_once = pub.wake.is_set()
        return woke_at_once, handle and handle.when() - asyncio.get_running_loop().time()

    store = Store(200)
    assert asyncio.run(publish(store)) == (False, None) and store.expects == [200]
    store = Store(300)  # changed again meanwhile: no wake at once, one a while later
    woke_at_once, retry_in = asyncio.run(publish(store))
    assert not woke_at_once and 0.5 * pub_mod.CONFLICT_RETRY < retry_in <= pub_mod.CONFLICT_RETRY


def test_a_record_the_validator_cannot_take_is_a_bad_record_not_a_dead_watch(caplog):
    """A ConfigMap record whose data is a number once made the validator raise TypeError out
    of decode and the watch: every follower of the resources restarted on it and crashed again."""
    from agentd.datastore.watches import KeyValue, PrefixEvent
    from agentd.resources import store

    key = b"/agentd/resources/configmaps/default/c"
    value = b'{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"c","namespace":"default"},"data":5}'
    with pytest.raises(kinds.Invalid, match="^data: Invalid value: 5: must be an object"):
        store.decode("/agentd", KeyValue(key, value, 5, 0))
    good = value.replace(b'"data":5', b'"data":{"a":"b"}')
    events = _watched([PrefixEvent("snapshot", 4, [KeyValue(key, good, 4, 0)]),
                       PrefixEvent("put", 5, [KeyValue(key, value, 5, 0)]),
                       PrefixEvent("snapshot", 6, [KeyValue(key, value, 5, 0)])])  # fmt: skip
    assert [ev.kind for ev in events] == ["snapshot", "put", "snapshot"]  # the last good one, as of revision 5
    first, kept = events[0].objects[("ConfigMap", "default", "c")], events[2].objects[("ConfigMap", "default", "c")]
    assert first["data"] == kept["data"] == events[1].obj["data"] == {"a": "b"}
    assert kept["metadata"]["resourceVersion"] == events[1].obj["metadata"]["resourceVersion"] == "5"
    assert "skipping malformed record at /agentd/resources/configmaps/default/c: data: Invalid value" in caplog.text


def test_decode_turns_any_validator_failure_into_one_bad_record(monkeypatch):
    """The backstop: whatever a validator raises on a stored record, decode says Invalid."""
    from agentd.datastore.watches import KeyValue
    from agentd.resources import store

    def broken(raw, **kw):
        raise TypeError("'int' object is not iterable")

    monkeypatch.setattr(store.kinds, "validate", broken)
    key = b"/agentd/resources/configmaps/default/c"
    with pytest.raises(kinds.Invalid, match="cannot be validated \\(TypeError: 'int' object is not iterable\\)"):
        store.decode("/agentd", KeyValue(key, b"{}", 5, 0))


def test_ingress_nodes_skip_a_record_nested_too_deep():
    import asyncio
    from types import SimpleNamespace

    from agentd.resources.store import ResourceStore

    kvs = [SimpleNamespace(value=b'{"addresses": ["192.0.2.1"]}'), SimpleNamespace(value=b"[" * 100_000),
           SimpleNamespace(value=b"{not json")]  # fmt: skip

    class Datastore:
        prefix = "/agentd"

        async def request(self, what, call, *, timeout=None):
            return call(SimpleNamespace(get_prefix=lambda head: kvs))

    assert asyncio.run(ResourceStore(Datastore()).ingress_nodes()) == [{"addresses": ["192.0.2.1"]}]


def test_an_ipv4_cidr_with_leading_zeros_is_read_as_the_api_server_reads_it():
    """ParseCIDRSloppy (the API server without strict IP validation) takes 010 as 10: so does
    agentd; an octet past 255, however written, is still refused."""
    from ipaddress import IPv4Network, IPv6Network

    from agentd.resources.validation import Invalid, cidr

    assert cidr("010.0.0.0/8", "c") == IPv4Network("10.0.0.0/8")
    assert cidr("192.168.001.000/24", "c") == IPv4Network("192.168.1.0/24")
    assert cidr("10.0.0.1/08", "c") == IPv4Network("10.0.0.0/8")
    # as many zeros as there are (Go's dtoi has no limit; int() refuses over 4300 digits)
    assert cidr("00000000010.0.0.0/8", "c") == IPv4Network("10.0.0.0/8")
    assert cidr("10.0.0.000000000001/32", "c") == IPv4Network("10.0.0.1/32")
    assert cidr("0" * 5000 + ".0.0.0/8", "c") == IPv4Network("0.0.0.0/8")
    assert cidr("10.0.0.0/" + "0" * 5000 + "8", "c") == IPv4Network("10.0.0.0/8")
    assert cidr("fd00::/0064", "c") == IPv6Network("fd00::/64")
    for bad in ("0256.0.0.0/8", "10.0.0/8", "10.0.0.0.0/8", "١٠.0.0.0/8", "0" * 5000 + "1000.0.0.0/8", "10.0.0.0/0033",
                "10.0.0.0/" + "9" * 5000, "fd00::/129"):
        with pytest.raises(Invalid, match="must be a valid CIDR"):
            cidr(bad, "c")
