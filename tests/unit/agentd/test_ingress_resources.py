"""Ingress, IngressClass, Secret and ConfigMap admission (agentd.resources) and the controller's
settings: the API server's checks, one line naming the field."""

from __future__ import annotations

import base64
import copy

import pytest

from agentd.resources import kinds, manifests
from agentd.resources.ingress_settings import Settings, parse
from agentd.resources.validation import Invalid

BACKEND = {"service": {"name": "web", "port": {"number": 80}}}
GOOD = {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": "a", "namespace": "shop"},
        "spec": {"rules": [{"host": "*.example.com", "http": {"paths": [{"path": "/x", "pathType": "Prefix", "backend": BACKEND}]}}],
                 "tls": [{"hosts": ["a.example.com"], "secretName": "a-tls"}]}}  # fmt: skip


def bad(change) -> str:
    doc = copy.deepcopy(GOOD)
    change(doc)
    with pytest.raises(Invalid) as err:
        kinds.validate(doc)
    return str(err.value)


def path0(doc):
    return doc["spec"]["rules"][0]["http"]["paths"][0]


def test_a_good_ingress_is_stored_as_given():
    obj = kinds.validate(copy.deepcopy(GOOD))
    assert obj["spec"]["rules"][0]["host"] == "*.example.com" and obj["spec"]["tls"][0]["secretName"] == "a-tls"


@pytest.mark.parametrize("change, want", [
    (lambda d: path0(d).pop("pathType"), "spec.rules[0].http.paths[0].pathType: Required value"),
    (lambda d: path0(d).update(pathType="Regex"), 'pathType: Unsupported value: "Regex"'),
    (lambda d: path0(d).update(path="x"), "path: Invalid value: \"x\": must be an absolute path"),
    (lambda d: path0(d).update(path="/a/../b"), "must not contain '/../'"),
    (lambda d: path0(d).update(path="/a%2Fb"), "must not contain '%2F'"),
    (lambda d: path0(d).update(path="/a/."), "cannot end with '/.'"),
    (lambda d: d["spec"]["rules"][0].update(host="*.*.example.com"), "a wildcard DNS-1123 subdomain"),
    (lambda d: d["spec"]["rules"][0].update(host="a.*.example.com"), "a wildcard DNS-1123 subdomain"),
    (lambda d: d["spec"]["rules"][0].update(host="10.0.0.1"), "must be a DNS name, not an IP address"),
    (lambda d: d["spec"]["rules"][0].update(host="Upper.com"), "spec.rules[0].host: Invalid value"),
    (lambda d: path0(d).update(backend={**BACKEND, "resource": {"kind": "B", "name": "b"}}), "cannot set both resource and service"),
    (lambda d: path0(d).update(backend={}), "resource or service backend is required"),
    (lambda d: path0(d).update(backend={"service": {"name": "web", "port": {"number": 80, "name": "http"}}}),
     "cannot set both port name & port number"),
    (lambda d: path0(d).update(backend={"service": {"name": "web", "port": {}}}), "port name or number is required"),
    (lambda d: path0(d).update(backend={"service": {"name": "web", "port": {"number": 70000}}}), "between 1 and 65535"),
    (lambda d: d["spec"].pop("rules"), "either `defaultBackend` or `rules` must be specified"),
    (lambda d: d["spec"]["rules"][0]["http"].update(paths=[]), "spec.rules[0].http.paths: Required value"),
    (lambda d: d["spec"]["tls"][0].update(hosts=["*"]), "spec.tls[0].hosts[0]"),
    (lambda d: d["spec"].update(ingressClasName="x"), "spec.ingressClasName: unknown field"),
])  # fmt: skip
def test_bad_ingresses(change, want):
    assert want in bad(change)


def test_ingress_class():
    doc = {"apiVersion": "networking.k8s.io/v1", "kind": "IngressClass", "metadata": {"name": "agentd"},
           "spec": {"controller": "agentd.io/ingress-controller"}}  # fmt: skip
    assert kinds.validate(doc)["spec"]["controller"] == "agentd.io/ingress-controller"
    for spec, want in (({}, "spec.controller: Required value"), ({"controller": "no-slash"}, "domain-prefixed path")):
        with pytest.raises(Invalid, match=want):
            kinds.validate({**doc, "spec": spec})
    with pytest.raises(Invalid, match="is-default-class"):
        kinds.validate({**doc, "metadata": {"name": "x", "annotations": {"ingressclass.kubernetes.io/is-default-class": "yes"}}})


def _pem_pair():
    from agentd.ingress.certs import self_signed

    pem = self_signed("x.example", ("x.example",))
    cert, _, key = pem.partition(b"-----BEGIN PRIVATE KEY-----")
    return cert, b"-----BEGIN PRIVATE KEY-----" + key


def secret(crt: bytes, key: bytes) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "t", "namespace": "shop"}, "type": "kubernetes.io/tls",
            "data": {"tls.crt": base64.b64encode(crt).decode(), "tls.key": base64.b64encode(key).decode()}}  # fmt: skip


def test_tls_secrets_are_checked():
    crt, key = _pem_pair()
    assert kinds.validate(secret(crt, key))["type"] == "kubernetes.io/tls"
    _, other = _pem_pair()
    with pytest.raises(Invalid, match=r"data\[tls.key\]: Invalid value: the private key does not match"):
        kinds.validate(secret(crt, other))
    with pytest.raises(Invalid, match=r"data\[tls.crt\]: Invalid value: not a PEM certificate"):
        kinds.validate(secret(b"junk", key))
    with pytest.raises(Invalid, match=r"data\[tls.key\]: Invalid value: not an unencrypted PEM private key"):
        kinds.validate(secret(crt, b"junk"))
    doc = secret(crt, key)
    doc["data"]["tls.crt"] = "not base64!"
    with pytest.raises(Invalid, match="must be base64 encoded"):
        kinds.validate(doc)
    doc = secret(crt, key)
    del doc["data"]["tls.key"]
    with pytest.raises(Invalid, match=r"data\[tls.key\]: Required value"):
        kinds.validate(doc)
    plain = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "p"}, "stringData": {"a": "b"}}
    assert kinds.validate(plain)["data"] == {"a": base64.b64encode(b"b").decode()}


@pytest.mark.parametrize("kind, field, value", [
    ("Secret", "data", 5), ("Secret", "stringData", True), ("Secret", "data", "abc"),
    ("ConfigMap", "data", 5), ("ConfigMap", "binaryData", 1.5), ("ConfigMap", "binaryData", [1]),
])
def test_secret_and_configmap_data_that_is_no_object_is_named(kind, field, value):
    doc = {"apiVersion": "v1", "kind": kind, "metadata": {"name": "c", "namespace": "shop"}, field: value}
    with pytest.raises(Invalid, match=rf"^{field}: Invalid value: .*must be an object"):
        kinds.validate(doc)


def test_the_controllers_configmap_is_checked_on_apply():
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "agentd-ingress", "namespace": "kube-system"},
          "data": {"proxy-read-timeout": "30", "proxy-body-size": "8m", "use-http2": "false",
                   "frontend-snippet": "http-response set-header X-A b"}}  # fmt: skip
    assert parse(cm["data"]) == Settings(read_timeout=30, body_size=8 << 20, http2=False, snippet=("http-response set-header X-A b",))
    # Fetches and converters that read no file pass (the word "evaluate" holds "lua", "bitmap" "map").
    fmt = "%ci:%cp %ST %B %{+Q}r %[src,ipmask(24)] %[ssl_fc,bool] evaluate bitmap(x) file=%f"
    assert parse({"log-format": fmt}) == Settings(log_format=fmt)
    for data, want in (({"proxy-read-timeout": "soon"}, "proxy-read-timeout"), ({"use-http2": "yes"}, "use-http2"),
                       ({"frontend-snippet": "use_backend x"}, "only header rules"),
                       ({"frontend-snippet": "http-request set-header X %[lua.x]"}, "Lua"),
                       # The agent's environment (its BGP password may be there) is nothing a header may carry.
                       ({"frontend-snippet": "http-response set-header X-Leak %[env(AGENTD_BGP_PASSWORD)]"}, "environment"),
                       ({"frontend-snippet": 'http-response set-header X "${AGENTD_BGP_PASSWORD}"'}, "environment"),
                       # haproxy -c prints an unknown fetch in an ALERT: settings_error in /ingress and the log.
                       ({"log-format": "%[${AGENTD_BGP_PASSWORD}]"}, r"log-format\]: Invalid value: environment"),
                       ({"log-format": "%ci %[env(AGENTD_BGP_PASSWORD)]"}, r"log-format\]: Invalid value: environment"),
                       # haproxy -c reads a map's file, and its ALERT quotes a bad line: map_ip() of a file
                       # that holds no addresses shows the file's first line in settings_error.
                       ({"log-format": "%ci %[src,map_ip(/etc/shadow,x)]"}, r"log-format\]: Invalid value: maps and files"),
                       ({"log-format": "%[str(root),map_str(/etc/passwd)]"}, r"log-format\]: Invalid value: maps and files"),
                       ({"log-format": "%[str(a),map (/var/lib/x.map)]"}, r"log-format\]: Invalid value: maps and files"),
                       ({"log-format": "%[str(a),jwt_verify(RS256,/etc/ssl/private/k.pem)]"}, r"log-format\]: .*jwt_verify"),
                       ({"log-format": "%ci %[src,lua.leak]"}, r"log-format\]: .*Lua")):  # fmt: skip
        doc = {**cm, "data": data}
        with pytest.raises(manifests.ManifestError, match=want):
            manifests.validate_all([manifests.Document("document 1", doc)], "f.yaml")
        # Another ConfigMap is just data.
        manifests.validate_all([manifests.Document("document 1", {**doc, "metadata": {"name": "other"}})], "f.yaml")


@pytest.mark.parametrize("key, value", [
    # digits str.isdigit() and \\d take: int() refuses "²" and more than 4300 digits, reads "٣" as 3
    ("keep-alive", "\u00b2"), ("proxy-read-timeout", "\u0663"),
    pytest.param("proxy-connect-timeout", "9" * 5000, id="proxy-connect-timeout-5000-digits"),
    pytest.param("websocket-timeout", "9" * 5000 + "s", id="websocket-timeout-5000-digits-s"),
    pytest.param("proxy-body-size", "9" * 5000 + "m", id="proxy-body-size-5000-digits-m"),
    ("proxy-body-size", "\u0663m"), ("proxy-body-size", "\u00b2"),
    ("keep-alive", "10ss"),  # one "s" of seconds, not any number of them
])  # fmt: skip
def test_settings_of_digits_int_refuses_or_misreads_are_one_line_naming_the_key(key, value):
    with pytest.raises(Invalid, match=rf"^data\[{key}\]: Invalid value: '.{{1,40}}': must be ") as err:
        parse({key: value})
    assert len(str(err.value)) < 200  # the value cut, not megabytes of it
    # Under any ConfigMap name apply stores it unchecked; the controller's own is checked.
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "agentd-ingress", "namespace": "kube-system"},
          "data": {key: value}}  # fmt: skip
    with pytest.raises(manifests.ManifestError, match=rf"data\[{key}\]: Invalid value"):
        manifests.validate_all([manifests.Document("document 1", cm)], "f.yaml")


def test_settings_in_seconds_and_sizes_as_written():
    assert parse({"keep-alive": " 10s ", "proxy-read-timeout": "0060", "proxy-body-size": "512k"}) == Settings(
        keep_alive=10, read_timeout=60, body_size=512 << 10)
    assert parse({"proxy-body-size": "0"}).body_size == 0 and parse({"keep-alive": "0"}).keep_alive == 0


@pytest.mark.parametrize("line", [
    # set-var() inside a header value overwrites what routes the request: every request re-routed.
    "http-request set-header X-B %[str(_/2F),set-var(txn.key)]",
    "http-request set-header X-B %[str(x),set-var(txn.backend)]",
    "http-response add-header X-B %[str(x),unset-var(txn.vhost)]",
    # maps and files named by path
    "http-request set-header X-C %[req.hdr(host),map_str(/var/lib/agentd/ingress/exact.map)]",
    "http-request set-header X-C %[src,map(/tmp/m,x)]",
    "http-request del-header X-C if { req.hdr(a) -f /tmp/list }",
    "http-request set-header X-C 1 if { req.hdr(a) -M /tmp/list }",
    "http-request set-header X-C %[req.hdr(a),jwt_verify(RS256,/tmp/k.pem)]",
    # spelt with quotes or escapes, which HAProxy's parser resolves before it reads the words
    'http-request set-header X-B %[str(x),"set"-var(txn.backend)]',
    r"http-request set-header X-C %[src,m\x61p(/tmp/m)]",
    r"http-request del-header X-C if { req.hdr(a) -\x66 /tmp/list }",
])
def test_a_snippet_that_could_re_route_or_read_files_is_refused(line):
    with pytest.raises(Invalid, match=r"^data\[frontend-snippet\]: Invalid value: line 1 .*set-var.*not allowed"):
        parse({"frontend-snippet": line})


@pytest.mark.parametrize("line", [
    "http-request set-header X-Sitemap yes",
    "http-request set-header X-Key %[var(txn.key)]",
    "http-request set-header X-Opt -foo",
    "http-request set-header X-Host %[req.hdr(host),lower] if { req.hdr(x) -m str y }",
    "http-response set-header Strict-Transport-Security max-age=31536000",
    # "lua" and "file" as letters of a name are no Lua call and no file read
    "http-request set-header X-Evaluation-Id %[uuid]",
    "http-response del-header x-file-name",
    "http-response set-header Link <https://www.lua.org/>",
    "http-response set-header Content-Security-Policy \"default-src 'self'\"",
])
def test_header_rules_that_read_variables_or_match_inline_are_accepted(line):
    assert parse({"frontend-snippet": line}).snippet == (line,)


@pytest.mark.parametrize("line", [
    # HAProxy's parser drops quotes and resolves escapes before it reads a word: each of these
    # is env(AGENTD_BGP_PASSWORD), %[lua.x] or a control character to it (seen with haproxy -c
    # and a live proxy: the "e"nv() one sends the variable's value).
    'http-request set-header X-Leak %["e"nv(AGENTD_BGP_PASSWORD)]',
    "http-request set-header X-Leak %['e'nv(AGENTD_BGP_PASSWORD)]",
    r"http-request set-header X-Leak %[e\x6ev(AGENTD_BGP_PASSWORD)]",
    r"http-request set-header X-Lua %[str(a),l\x75a.x]",
    "http-request set-header X-Lua %[str(a),lua.x]",
    "http-request set-header X-Lua 1 if { lua.x -m found }",
    r"http-response set-header X-Split a\r\nSet-Cookie: x",
])
def test_a_snippet_that_spells_lua_or_the_environment_with_quotes_or_escapes_is_refused(line):
    with pytest.raises(Invalid, match=r"^data\[frontend-snippet\]: Invalid value: line 1 .*Lua.*not allowed"):
        parse({"frontend-snippet": line})
