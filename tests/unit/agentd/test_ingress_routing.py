"""The Ingress routing table (agentd.ingress.routing) against the Kubernetes Ingress semantics
(the ingress-controller-conformance host_rules, path_rules and default_backend features and
the path-matching examples of the Ingress docs), and its HAProxy maps (agentd.ingress.haproxy)
against the table: the same answer for every request."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentd.ingress import haproxy, proxy, routing
from agentd.resources import kinds
from agentd.resources.ingress_settings import Settings

NOT_FOUND = routing.NOT_FOUND


def ing(name: str, rules: list, *, created: str = "2024-01-01T00:00:00Z", ns: str = "default", **spec) -> dict:
    doc = {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": name, "namespace": ns},
           "spec": {**spec, **({"rules": rules} if rules else {})}}  # fmt: skip
    obj = kinds.validate(doc)
    obj["metadata"]["creationTimestamp"] = created
    return obj


def p(path: str, kind: str, svc: str) -> dict:
    return {"path": path, "pathType": kind, "backend": {"service": {"name": svc, "port": {"number": 8080}}}}


def svc_of(table: routing.RouteTable, backend: str) -> str | int:
    if backend == NOT_FOUND:
        return 404
    if backend == routing.BAD_REQUEST:
        return 400
    return table.backends[backend].service or "resource"


PATH_RULES = ing("path-rules", [
    {"host": "exact-path-rules", "http": {"paths": [p("/foo", "Exact", "foo-exact")]}},
    {"host": "prefix-path-rules", "http": {"paths": [p("/foo", "Prefix", "foo-prefix"), p("/aaa/bbb", "Prefix", "aaa-slash-bbb-prefix"),
                                                      p("/aaa", "Prefix", "aaa-prefix")]}},
    {"host": "mixed-path-rules", "http": {"paths": [p("/foo", "Prefix", "foo-prefix"), p("/foo", "Exact", "foo-exact")]}},
    {"host": "trailing-slash-path-rules", "http": {"paths": [p("/aaa/bbb/", "Prefix", "aaa-slash-bbb-slash-prefix"),
                                                              p("/foo/", "Exact", "foo-slash-exact")]}},
])  # fmt: skip

# (host, path) -> service or status: the conformance path_rules scenarios.
PATH_CASES = {
    ("exact-path-rules", "/foo"): "foo-exact", ("exact-path-rules", "/foo/"): 404, ("exact-path-rules", "/FOO"): 404,
    ("exact-path-rules", "/bar"): 404, ("prefix-path-rules", "/foo"): "foo-prefix", ("prefix-path-rules", "/foo/"): "foo-prefix",
    ("prefix-path-rules", "/FOO"): 404, ("prefix-path-rules", "/aaa/bbb"): "aaa-slash-bbb-prefix",
    ("prefix-path-rules", "/aaa/bbb/ccc"): "aaa-slash-bbb-prefix", ("prefix-path-rules", "/aaa/ccc"): "aaa-prefix",
    ("prefix-path-rules", "/aaaccc"): 404, ("mixed-path-rules", "/foo"): "foo-exact",
    ("trailing-slash-path-rules", "/aaa/bbb"): "aaa-slash-bbb-slash-prefix",
    ("trailing-slash-path-rules", "/aaa/bbb/"): "aaa-slash-bbb-slash-prefix", ("trailing-slash-path-rules", "/foo"): 404,
}  # fmt: skip

HOST_RULES = ing("host-rules", [
    {"host": "*.foo.com", "http": {"paths": [p("/", "Prefix", "wildcard-foo-com")]}},
    {"host": "foo.bar.com", "http": {"paths": [p("/", "Prefix", "foo-bar-com")]}},
], tls=[{"hosts": ["foo.bar.com"], "secretName": "conformance-tls"}])  # fmt: skip

HOST_CASES = {
    ("foo.bar.com", "/"): "foo-bar-com", ("subdomain.bar.com", "/"): 404, ("bar.foo.com", "/"): "wildcard-foo-com",
    ("baz.bar.foo.com", "/"): 404, ("foo.com", "/"): 404, ("FOO.bar.com:8080", "/x"): "foo-bar-com",
    # Several values, or a path, in a Host: no host (req.hdr would take the last value, bar.foo.com).
    ("foo.com,bar.foo.com", "/"): 400, ("foo.com, bar.foo.com", "/"): 400, ("foo.bar.com/x", "/"): 400,
}  # fmt: skip


def test_conformance_path_rules():
    table = routing.build([PATH_RULES])
    for (host, path), want in PATH_CASES.items():
        assert svc_of(table, table.route(host, path)) == want, (host, path)


def test_conformance_host_rules_and_redirect():
    table = routing.build([HOST_RULES])
    for (host, path), want in HOST_CASES.items():
        assert svc_of(table, table.route(host, path)) == want, (host, path)
    assert table.redirects("foo.bar.com", "/")
    # *.foo.com, a rule host of an Ingress with tls that no entry names: the default
    # certificate, redirected all the same -- as ingress-nginx does (its conformance runs
    # expect plain HTTP answered for both hosts: with ssl-redirect off).
    assert table.redirects("bar.foo.com", "/") and not table.redirects("subdomain.bar.com", "/")
    off = routing.build([HOST_RULES], ssl_redirect=False)
    assert not off.redirects("foo.bar.com", "/")


def test_the_docs_examples_of_path_matching():
    # kubernetes.io/docs/concepts/services-networking/ingress/#examples
    examples = [("Prefix", "/", "/aaa/bbb", True), ("Prefix", "/", "/", True), ("Exact", "/foo", "/foo", True),
                ("Exact", "/foo", "/bar", False), ("Exact", "/foo", "/foo/", False), ("Exact", "/foo/", "/foo", False),
                ("Prefix", "/foo", "/foo/", True), ("Prefix", "/foo/", "/foo", True), ("Prefix", "/aaa/bb", "/aaa/bbb", False),
                ("Prefix", "/aaa/bbb", "/aaa/bbb", True), ("Prefix", "/aaa/bbb/", "/aaa/bbb", True),
                ("Prefix", "/aaa/bbb", "/aaa/bbb/", True), ("Prefix", "/aaa/bbb", "/aaa/bbb/ccc", True),
                ("Prefix", "/aaa/bbb", "/aaa/bbbxyz", False), ("ImplementationSpecific", "/foo", "/foo/bar", True),
                ("ImplementationSpecific", "/foo", "/foobar", False)]  # fmt: skip
    for kind, path, request, match in examples:
        table = routing.build([ing("x", [{"host": "h", "http": {"paths": [p(path, kind, "svc")]}}])])
        assert (table.route("h", request) != NOT_FOUND) == match, (kind, path, request)


def test_default_backends_and_merging():
    old = ing("old", [{"host": "a", "http": {"paths": [p("/x", "Prefix", "old-x")]}}],
              created="2024-01-01T00:00:00Z", defaultBackend={"service": {"name": "old-default", "port": {"number": 80}}})
    new = ing("new", [{"host": "a", "http": {"paths": [p("/x", "Prefix", "new-x"), p("/y", "Exact", "new-y")]}},
                      {"host": "b", "http": {"paths": [p("/", "Prefix", "b")]}}],
              created="2024-02-01T00:00:00Z", defaultBackend={"service": {"name": "new-default", "port": {"number": 80}}})
    for order in ([old, new], [new, old]):  # the input order does not matter
        table = routing.build(order)
        assert svc_of(table, table.route("a", "/x/1")) == "old-x"  # the older Ingress wins a conflict
        assert svc_of(table, table.route("a", "/y")) == "new-y"  # merged
        assert svc_of(table, table.route("a", "/z")) == "old-default"  # a's oldest Ingress with a default
        assert svc_of(table, table.route("b", "/z")) == "b"
        assert svc_of(table, table.route("elsewhere", "/")) == "old-default"  # the oldest default overall
        assert any("default/new" in c and "/x" in c for c in table.conflicts), table.conflicts
    assert svc_of(routing.build([]), routing.build([]).route("any", "/")) == 404


def test_ours_follows_the_classes():
    from agentd.resources.ingress import ours

    cls = kinds.validate({"apiVersion": "networking.k8s.io/v1", "kind": "IngressClass", "metadata": {"name": "agentd"},
                          "spec": {"controller": "agentd.io/ingress-controller"}})  # fmt: skip
    other = kinds.validate({"apiVersion": "networking.k8s.io/v1", "kind": "IngressClass", "metadata": {"name": "nginx"},
                            "spec": {"controller": "k8s.io/ingress-nginx"}})  # fmt: skip
    named = ing("a", [], ingressClassName="agentd", defaultBackend={"service": {"name": "s", "port": {"number": 1}}})
    theirs = ing("b", [], ingressClassName="nginx", defaultBackend={"service": {"name": "s", "port": {"number": 1}}})
    none = ing("c", [], defaultBackend={"service": {"name": "s", "port": {"number": 1}}})
    assert ours(named, [cls, other]) and not ours(theirs, [cls, other]) and not ours(none, [cls, other])
    default = {**cls, "metadata": {**cls["metadata"], "annotations": {"ingressclass.kubernetes.io/is-default-class": "true"}}}
    assert ours(none, [default, other]) and ours(none, [cls], without_class=True)
    annotated = ing("d", [], defaultBackend={"service": {"name": "s", "port": {"number": 1}}})
    annotated["metadata"]["annotations"] = {"kubernetes.io/ingress.class": "agentd"}
    assert ours(annotated, [cls])


# ------------------------------------------------------------------ the HAProxy maps


def fetch(sample: str, host: str) -> str:
    """What HAProxy's sample fetch gives of a request's Host header ``host``: req.fhdr, the
    whole value; req.hdr, a value taken as a comma-separated list, its last element."""
    if sample == "req.fhdr(host)":
        return host.strip()
    assert sample == "req.hdr(host)", sample
    return host.rsplit(",", 1)[-1].strip()


REDIRECT = "308"  # lookup's answer for a request redirected to HTTPS


def _split(text: str) -> list[str]:
    """``text`` cut at its commas outside parentheses and double quotes (a converter chain,
    or a converter's arguments)."""
    parts, depth, quoted, cur = [], 0, False, ""
    for ch in text:
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch == "(":
            depth += 1
        elif not quoted and ch == ")":
            depth -= 1
        elif not quoted and depth == 0 and ch == ",":
            parts.append(cur)
            cur = ""
            continue
        cur += ch
    return [*parts, cur]


def _url_dec(raw: str) -> str | None:
    data = raw.encode("utf-8", "surrogatepass")
    if data.count(b"%") != len(re.findall(rb"%[0-9A-Fa-f]{2}", data)):
        return None  # HAProxy's url_dec fails on a bad escape
    return re.sub(rb"%([0-9A-Fa-f]{2})", lambda m: bytes([int(m.group(1), 16)]), data).decode("latin-1")


def lookup(files: dict[str, str], table: routing.RouteTable, host: str, path: str, *, https: bool = False) -> str:
    """What the rendered frontend does with a request: its ``http-request`` rules, ACLs,
    ``use_backend`` and ``default_backend`` run in order by a small interpreter of the sample
    fetches, converters and matches they use (an unknown one fails the test), on the map files
    -- not a restatement of them.  The backend, :data:`routing.BAD_REQUEST`, or
    :data:`REDIRECT` (plain HTTP redirected to HTTPS)."""
    import shlex

    def lines(name: str) -> list[str]:
        return files[Path(name).name].splitlines()

    txn: dict[str, str] = {}

    def evaluate(expr: str) -> str | bool | None:
        fetch_, *convs = _split(expr)
        m = re.fullmatch(r"([\w.]+)(?:\((.*)\))?", fetch_)
        assert m, expr
        name, arg = m.groups()
        value: str | bool | None
        if name in ("req.fhdr", "req.hdr"):
            assert arg == "host", expr
            value = fetch(f"{name}(host)", host)
        elif name == "var":
            value = txn.get(arg)
        elif name == "str":
            value = arg
        elif name == "path":
            value = path.encode("utf-8", "surrogatepass").decode("latin-1")
        elif name == "ssl_fc":
            value = https
        elif name == "req.hdr_val":
            value = None  # no Content-Length: a GET
        else:
            raise AssertionError(f"fetch {name} not emulated: {expr}")
        for conv in convs:
            if value is None:
                return None
            m = re.fullmatch(r"(\w+)(?:\((.*)\))?", conv)
            assert m and isinstance(value, str), (conv, expr)
            cname, cargs = m.group(1), [a.strip('"') for a in _split(m.group(2))] if m.group(2) is not None else []
            if cname == "field":
                value = value.split(cargs[1])[int(cargs[0]) - 1]
            elif cname == "lower":
                value = value.lower()
            elif cname == "regsub":
                value = re.sub(cargs[0], cargs[1], value, count=0 if "g" in cargs[2:] else 1)
            elif cname == "map_str":
                value = dict(line.split(" ", 1) for line in lines(cargs[0])).get(value)  # type: ignore[misc]
            elif cname == "map_beg":  # the first line, in file order, whose key starts the value
                value = next((v for k, v in (line.split(" ", 1) for line in lines(cargs[0])) if value.startswith(k)), None)
            elif cname == "url_dec":
                value = _url_dec(value)
            elif cname == "hex":
                value = value.encode("latin-1").hex().upper()
            else:
                raise AssertionError(f"converter {cname} not emulated: {expr}")
        return value

    def matches(expr: str, how: list[str]) -> bool:
        value = evaluate(expr)
        if not how:
            return value is True
        if value is None:
            return False  # a fetch or converter that fails matches nothing
        assert isinstance(value, str), (expr, how)
        if how == ["-m", "found"]:
            return True
        if how[:2] == ["-m", "sub"]:
            return how[2] in value
        if how[:2] == ["-m", "reg"]:
            return re.search(how[2], value) is not None
        if how[:3] == ["-m", "str", "-f"]:
            return value in lines(how[3])
        raise AssertionError(f"match {how} not emulated")

    acls: dict[str, list[tuple[str, list[str]]]] = {}

    def condition(words: list[str]) -> bool:
        """``if`` and what follows: terms ANDed, ``||`` between ORed groups."""
        if not words:
            return True
        assert words[0] == "if", words
        groups: list[list[bool]] = [[]]
        i = 1
        while i < len(words):
            word = words[i]
            if word == "||":
                groups.append([])
                i += 1
                continue
            negate = word.startswith("!")
            word = word.removeprefix("!")
            if word == "{":
                close = words.index("}", i)
                term = matches(words[i + 1], words[i + 2:close])
                i = close + 1
            else:
                assert word in acls, (word, words)
                term = any(matches(e, how) for e, how in acls[word])
                i += 1
            groups[-1].append(term != negate)
        return any(all(g) for g in groups)

    frontend = files["haproxy.cfg"].split("\nfrontend ingress\n", 1)[1].split("\n\n", 1)[0]
    for line in frontend.splitlines():
        words = shlex.split(line)
        if words[0] == "bind":
            continue
        if words[0] == "acl":
            acls.setdefault(words[1], []).append((words[2], words[3:]))
        elif words[0] == "default_backend":
            return words[1]
        elif words[0] == "use_backend":
            assert words[1] == "%[var(txn.backend)]", line
            if condition(words[2:]):
                return txn["txn.backend"]
        elif words[:2] == ["http-request", "deny"]:
            assert words[2] == "deny_status", line
            if condition(words[4:]):
                return words[3]
        elif words[:2] == ["http-request", "redirect"]:
            if condition(words[words.index("if"):]):
                return REDIRECT
        elif words[0] == "http-request" and words[1].startswith("set-var("):
            var = words[1][len("set-var("):-1]
            if condition(words[3:]):
                value = evaluate(words[2])
                if value is not None:  # a sample that fails sets nothing
                    assert isinstance(value, str)
                    txn[var] = value
        elif words[0] == "http-request" and words[1].startswith("set-var-fmt("):
            var = words[1][len("set-var-fmt("):-1]
            pieces = re.split(r"%\[([^\]]*)\]", words[2])  # text, expression, text, ...
            values = [piece if i % 2 == 0 else evaluate(piece) for i, piece in enumerate(pieces)]
            if all(isinstance(value, str) for value in values):
                txn[var] = "".join(values)  # type: ignore[arg-type]
        elif words[:2] == ["http-request", "set-header"]:
            continue
        else:
            raise AssertionError(f"frontend line not emulated: {line}")
    raise AssertionError("no default_backend")


def expected(table: routing.RouteTable, host: str, path: str) -> str:
    """The reference's answer to a plain-HTTP request, as :func:`lookup` gives it."""
    return REDIRECT if table.redirects(host, path) else table.route(host, path)


def render(table: routing.RouteTable) -> dict[str, str]:
    paths = haproxy.Paths(Path("/run/x"))
    return haproxy.render(table, {}, Settings(), haproxy.Listen(("192.0.2.1",)), paths, {})


def test_the_maps_answer_as_the_table_on_the_conformance_cases():
    for ingress, cases in ((PATH_RULES, PATH_CASES), (HOST_RULES, HOST_CASES)):
        table = routing.build([ingress])
        files = render(table)
        for host, path in cases:
            assert lookup(files, table, host, path) == expected(table, host, path), (host, path)
            assert lookup(files, table, host, path, https=True) == table.route(host, path), (host, path)


SEGMENTS = st.sampled_from(["a", "b", "ab", "aa"])
PATHS = st.lists(SEGMENTS, min_size=0, max_size=3).map(lambda parts: "/" + "/".join(parts))
RULE_PATHS = st.tuples(PATHS, st.booleans(), st.sampled_from(["Exact", "Prefix", "ImplementationSpecific"]))
HOSTS = st.sampled_from(["x.io", "y.x.io", "*.x.io", None])
# What a client may send for them: escaped, with dot segments and doubled slashes.
REQUEST_PATHS = st.lists(st.sampled_from(["a", "b", "ab", "aa", "%61", "a%2Fb", ".", "..", "%2E%2E", ""]),
                         min_size=0, max_size=4).map(lambda parts: "/" + "/".join(parts))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(HOSTS, st.lists(RULE_PATHS, min_size=1, max_size=4)), min_size=1, max_size=4),
       st.sampled_from(["x.io", "y.x.io", "z.x.io", "q.y.x.io", "other", "other,x.io", "x.io, y.x.io", "x.io/a"]),
       REQUEST_PATHS, st.booleans())  # fmt: skip
def test_the_maps_answer_as_the_table_on_any_rules(rules, host, path, slash):
    spec_rules = []
    for i, (h, paths) in enumerate(rules):
        r = {"http": {"paths": [p(rp + ("/" if trail and rp != "/" else ""), kind, f"s{i}{j}")
                                for j, (rp, trail, kind) in enumerate(paths)]}}  # fmt: skip
        if h:
            r["host"] = h
        spec_rules.append(r)
    table = routing.build([ing("r", spec_rules)])
    request = path + ("/" if slash and path != "/" else "")
    assert lookup(render(table), table, host, request) == table.route(host, request)


def test_a_path_with_spaces_or_newlines_matches_decoded_and_keeps_to_its_own_map_line():
    # The API server accepts any character after the leading "/" of a path.  Written raw, a
    # newline would add a map line of the Ingress writer's choosing (here: every request
    # for api.example to this Ingress's backend), a space or tab split its key from its value.
    evil = ing("evil", [{"host": "evil.test", "http": {"paths": [
        p("/z\napi.example/ ing.default.evil.c.8080\nx", "ImplementationSpecific", "c"),
        p("/a b", "Exact", "space"), p("/t\tu", "Prefix", "tab"), p("/caf\u00e9", "Prefix", "utf8")]}}])
    api = ing("api", [{"host": "api.example", "http": {"paths": [p("/", "Prefix", "api")]}}], created="2023-01-01T00:00:00Z")
    table = routing.build([evil, api])
    files = render(table)
    for name in ("exact.map", "prefix.map"):
        for line in files[name].splitlines():
            key, value = line.split(" ")  # one key, one value, nothing else
            assert value in table.backends and key.startswith(("evil.test/", "api.example/")), (name, line)
    assert svc_of(table, lookup(files, table, "api.example", "/")) == "api"
    assert svc_of(table, lookup(files, table, "api.example", "/x")) == "api"
    for path, want in (("/a%20b", "space"), ("/a%2520b", 404), ("/t%09u/v", "tab"), ("/caf%C3%A9", "utf8"),
                       ("/z%0Aapi.example/%20ing.default.evil.c.8080%0Ax/1", "c")):  # fmt: skip
        assert svc_of(table, table.route("evil.test", path)) == want, path
        assert lookup(files, table, "evil.test", path) == table.route("evil.test", path), path


# The request path as nginx 1.22 normalises it before matching a location ($uri), seen with
# a real nginx: percent-decoded once (%2F too), slashes merged, dot segments resolved; 400
# for a bad escape, %00, or a ".." above the root.
NGINX_URI = {
    "/a%2Fb": b"/a/b", "/a%2fb/c": b"/a/b/c", "/%61pi": b"/api", "/api/../admin": b"/admin",
    "/api/%2E%2E/admin": b"/admin", "/api%2F..%2Fadmin": b"/admin", "//api": b"/api", "/api/./x": b"/api/x",
    "/../admin": None, "/%2e%2e/admin": None, "/a%20b": b"/a b", "/x%00y": None, "/x%3Fy": b"/x?y",
    "/%252F": b"/%2F", "/api/..": b"/", "/x/..%2F..%2Fadmin": None, "/api/.": b"/api/", "/a/b/../../..": None,
    "/a/./../b": b"/b", "/%zz": None, "/a%2": None, "/a/b/c/d/e/../../../../../x": b"/x", "/a/.../b": b"/a/.../b",
    "/a/..b/c": b"/a/..b/c", "/caf%C3%A9": "/caf\u00e9".encode(), "/a+b": b"/a+b", "/./": b"/", "/.": b"/",
    "/a/./.": b"/a/", "/a/.//../b": b"/b",
}  # fmt: skip


def test_the_request_path_is_normalised_as_nginx_does():
    for raw, want in NGINX_URI.items():
        assert routing.normalise_path(raw) == want, raw
    # ".." or "." followed by an encoded newline is a segment like any other, as nginx's parser
    # reads it (a dot segment ends at "/" or the path's end; "$" would match before the "\n").
    for raw, want in (("/admin/..%0A", b"/admin/..\n"), ("/admin/.%0a", b"/admin/.\n"), ("/admin/..%0A/x", b"/admin/..\n/x")):
        assert routing.normalise_path(raw) == want, raw
    table = routing.build([ing("n", [{"host": "h", "http": {"paths": [
        p("/a/b", "Prefix", "ab"), p("/api", "Prefix", "api"), p("/admin", "Exact", "admin")]}}])])
    files = render(table)
    for path, want in (("/a%2Fb", "ab"), ("/%61pi/v1", "api"), ("/api/../admin", "admin"), ("/x/..%2Fapi", "api"),
                       ("/../admin", routing.BAD_REQUEST), ("/apix/../api", "api"), ("/a%252Fb", 404)):  # fmt: skip
        got = table.route("h", path)
        assert (got if got == routing.BAD_REQUEST else svc_of(table, got)) == want, path
        assert lookup(files, table, "h", path) == got, path


def test_a_host_header_with_a_slash_or_a_comma_is_refused_before_it_is_read():
    # "Host: h/public" with the path /admin would be keyed h/public/admin: routed by /public.
    # "Host: pub.example,adm.example": req.hdr(host) would give adm.example (a list's last).
    rules = [{"host": h, "http": {"paths": [p("/public", "Prefix", svc)]}} for h, svc in (("h", "h"), ("adm.example", "adm"))]
    ings = [ing("one", rules)]
    for table in (routing.build(ings), routing.build([])):
        cfg = render(table)["haproxy.cfg"].splitlines()
        slash = cfg.index("    http-request deny deny_status 400 if { req.fhdr(host) -m sub / }")
        comma = cfg.index("    http-request deny deny_status 400 if { req.fhdr(host) -m sub , }")
        assert max(slash, comma) < next(i for i, line in enumerate(cfg) if "set-var(txn.host)" in line)
        assert not any("req.hdr(host)" in line for line in cfg)  # X-Forwarded-Host too: the whole value
        assert "    http-request set-header X-Forwarded-Host %[req.fhdr(host)]" in cfg
        assert table.route("h,adm.example", "/public") == table.route("h/x", "/") == routing.BAD_REQUEST


def test_rendered_config_names_every_backend_and_its_servers():
    table = routing.build([HOST_RULES])
    name = next(iter(table.backends))
    servers = {name: [("10.244.1.5", 8080), ("fd00:10:244:1::5", 8080)]}
    files = haproxy.render(table, servers, Settings(), haproxy.Listen(("192.0.2.1", "2001:db8::1")),
                           haproxy.Paths(Path("/run/x")), {})  # fmt: skip
    cfg = files["haproxy.cfg"]
    assert f"backend {name}" in cfg and "server 10.244.1.5:8080 10.244.1.5:8080" in cfg
    assert "server fd00:10:244:1::5:8080 [fd00:10:244:1::5]:8080" in cfg
    assert "bind 192.0.2.1:80" in cfg and "bind [2001:db8::1]:443 ssl" in cfg
    assert "\n\n\n" not in cfg and "log " not in cfg.split("defaults")[0]
    logged = haproxy.render(table, servers, Settings(access_log=True), haproxy.Listen(("192.0.2.1",)), haproxy.Paths(Path("/run/x")), {})
    assert "    log /run/x/log.sock format raw local0" in logged["haproxy.cfg"]


def test_show_proc_names_the_master_and_its_workers():
    # HAProxy 2.6's answer on the master CLI after two reloads, an old worker still finishing.
    text = """#<PID>          <type>          <reloads>       <uptime>        <version>
26601           master          2 [failed: 0]   0d00h05m12s     2.6.12-1+deb12u4
# workers
26890           worker          0               0d00h00m03s     2.6.12-1+deb12u4
26750           worker          1               0d00h01m40s     2.6.12-1+deb12u4
# old workers
# programs
"""
    master, workers = proxy.parse_proc(text)
    assert master == (26601, 2)
    assert workers == [proxy.Worker(26890, 0), proxy.Worker(26750, 1)]
    assert proxy.parse_proc("") == (None, [])


def test_a_tls_host_is_redirected_whatever_its_secret():
    # ingress-nginx redirects every host of a tls section and serves its default certificate
    # where the Secret is missing or bad: no Secret is no reason to serve plain HTTP.
    tls = [{"hosts": ["ok.example"], "secretName": "ok"}, {"hosts": ["gone.example"], "secretName": "gone"},
           {"hosts": ["unnamed.example"]}]  # fmt: skip
    table = routing.build([ing("t", [{"host": h, "http": {"paths": [p("/", "Prefix", "s")]}}
                                     for h in ("ok.example", "gone.example", "unnamed.example")], tls=tls)])  # fmt: skip
    files = haproxy.maps(table, {("default", "ok"): Path("/run/x/certs/default.ok.pem")})
    assert files["tls-hosts.lst"].split() == ["gone.example", "ok.example", "unnamed.example"]
    assert files["crt-list"] == "/run/x/certs/default.ok.pem ok.example\n"  # the others: the default certificate
    assert all(table.redirects(h, "/") for h in ("ok.example", "gone.example", "unnamed.example"))


def test_a_host_with_a_final_dot_is_the_same_host():
    """`Host: shop.example.` (a fully qualified name) routes as `shop.example`, as nginx
    takes it; the rendered lookup strips that dot the same way."""
    table = routing.build([HOST_RULES])
    for (host, path), want in HOST_CASES.items():
        if host and not host.startswith("["):
            assert svc_of(table, table.route(host + ".", path)) == want, (host, path)
    files = haproxy.render(table, {}, Settings(), haproxy.Listen(("192.0.2.1",)), haproxy.Paths(Path("/run/x")), {})
    assert """set-var(txn.host) 'req.fhdr(host),field(1,:),lower,regsub("[.](?!.)","")'""" in files["haproxy.cfg"]


def test_keep_alive_0_closes_client_connections_after_each_response():
    files = haproxy.render(routing.build([HOST_RULES]), {}, Settings(keep_alive=0), haproxy.Listen(("192.0.2.1",)),
                           haproxy.Paths(Path("/run/x")), {})  # fmt: skip
    defaults = files["haproxy.cfg"].split("frontend")[0]
    # The last of HAProxy's three connection modes declared wins: httpclose, after http-keep-alive.
    assert defaults.index("    option httpclose") > defaults.index("    option http-keep-alive")
    assert "timeout http-keep-alive" not in defaults


def test_a_certificate_the_tls_library_refuses_is_named(tmp_path):
    """A 1024-bit RSA key passes a parse-and-match check but OpenSSL's security level refuses
    it, and HAProxy with it: the controller leaves it out (its hosts get the default
    certificate) instead of a crt-list HAProxy will not load."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    from agentd.ingress import certs

    def pem(bits: int) -> bytes:
        key = rsa.generate_private_key(public_exponent=65537, key_size=bits)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shop.example")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
                .sign(key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    assert certs.refused(pem(2048), tmp_path) is None
    assert certs.refused(pem(1024), tmp_path) is not None
    assert certs.refused(certs.self_signed("x"), tmp_path) is None
    assert list(tmp_path.iterdir()) == []  # nothing left of the check


def test_an_older_ingresses_unusable_secret_does_not_keep_a_newer_usable_one_from_the_host():
    old = ing("old", [{"host": "shop.example", "http": {"paths": [p("/", "Prefix", "web")]}}],
              tls=[{"hosts": ["shop.example"], "secretName": "old-tls"}])
    new = ing("new", [{"host": "shop.example", "http": {"paths": [p("/a", "Prefix", "web")]}}],
              created="2024-02-01T00:00:00Z", tls=[{"hosts": ["shop.example"], "secretName": "shop-tls"}])
    usable = {("default", "shop-tls")}
    table = routing.build([old, new], usable=usable.__contains__)
    assert [(t.host, t.secret, t.ingress) for t in table.tls] == [("shop.example", ("default", "shop-tls"), ("default", "new"))]
    assert any("its Secret cannot serve" in c for c in table.conflicts)
    # Both usable: the older one keeps the host, as before.
    table = routing.build([old, new], usable=lambda s: True)
    assert [t.secret for t in table.tls] == [("default", "old-tls")]
    # Neither: the older one's (served with the default certificate).
    table = routing.build([old, new], usable=lambda s: False)
    assert [t.secret for t in table.tls] == [("default", "old-tls")]


def test_a_tls_entry_without_hosts_takes_only_its_own_ingresses_hosts_its_certificate_covers():
    """A ``tls[]`` entry without ``hosts`` stands for its Ingress's own rule hosts that its
    certificate covers, each through the oldest-wins ownership -- as ingress-nginx does.  An
    unfiltered crt-list line would serve its certificate for every name in it: a newer
    Ingress in another namespace with a certificate for shop.example (an ECDSA one beats an
    RSA one HAProxy holds for the same name) would take shop.example from its owner."""
    shop = ing("shop", [{"host": "shop.example", "http": {"paths": [p("/", "Prefix", "web")]}}], ns="shop",
               tls=[{"hosts": ["shop.example"], "secretName": "legit"}])
    evil = ing("evil", [{"host": h, "http": {"paths": [p("/", "Prefix", "x")]}}
                        for h in ("evil.example", "shop.example", "other.example", "a.wild.example")]
               + [{"http": {"paths": [p("/", "Prefix", "x")]}}],
               ns="evil", created="2024-02-01T00:00:00Z", tls=[{"secretName": "evil"}])  # fmt: skip
    names = {("shop", "legit"): ("shop.example",), ("evil", "evil"): ("shop.example", "evil.example", "*.wild.example")}
    table = routing.build([evil, shop], cert_names=lambda s: names[s])
    assert [(t.host, t.secret) for t in table.tls] == [
        ("shop.example", ("shop", "legit")), ("evil.example", ("evil", "evil")), ("other.example", None),
        ("a.wild.example", ("evil", "evil"))]
    assert "evil/evil: tls for shop.example: already given by shop/shop" in table.conflicts
    files = haproxy.maps(table, {("shop", "legit"): Path("/c/shop.pem"), ("evil", "evil"): Path("/c/evil.pem")})
    lines = files["crt-list"].splitlines()
    assert lines == ["/c/shop.pem shop.example", "/c/evil.pem evil.example", "/c/evil.pem a.wild.example"]
    assert all(len(line.split()) == 2 for line in lines)  # every line filtered by SNI
    # other.example (its certificate does not cover it): the controller's default certificate,
    # redirected all the same, as ingress-nginx does for a rule host of an Ingress with tls;
    # the rules without a host: the default certificate, never redirected.
    assert table.redirects("other.example", "/") and table.redirects("evil.example", "/")
    assert not table.redirects("nohost.example", "/")
    # A Secret that cannot serve names nothing: the entry covers no host (each one the default certificate).
    table = routing.build([evil], usable=lambda s: False, cert_names=lambda s: names[s])
    assert {(t.secret, t.serves) for t in table.tls} == {(None, False)} and haproxy.maps(table, {})["crt-list"] == ""
    assert table.hostless == [("evil", "evil")]  # said (controller: tls_errors), not dropped silently


def test_a_tls_entry_without_hosts_leaves_the_hosts_another_entry_names_to_it():
    rules = [{"host": h, "http": {"paths": [p("/", "Prefix", "x")]}} for h in ("a.example", "b.example")]
    i = ing("i", rules, tls=[{"secretName": "any"}, {"hosts": ["a.example"], "secretName": "a"}])
    table = routing.build([i], cert_names=lambda s: ("a.example", "b.example"))
    assert [(t.host, t.secret[1]) for t in table.tls] == [("a.example", "a"), ("b.example", "any")]
    assert table.conflicts == []


def test_a_certificate_covers_its_names_and_one_label_under_its_wildcards():
    names = ("Shop.Example", "*.wild.example")
    assert routing.covers(names, "shop.example")
    assert routing.covers(names, "a.wild.example") and routing.covers(names, "*.wild.example")
    assert not routing.covers(names, "wild.example") and not routing.covers(names, "a.b.wild.example")
    assert not routing.covers(names, "other.example") and not routing.covers((), "shop.example")
    assert not routing.covers(("a.wild.example",), "*.wild.example")


def test_the_dns_names_of_a_certificate_are_its_subject_alternative_names():
    from agentd.ingress import certs

    assert certs.dns_names(certs.self_signed("cn.example", ("a.example", "*.b.example"))) == ("a.example", "*.b.example")
    assert certs.dns_names(certs.self_signed("cn.example")) == ()  # the common name is no name a client checks
    assert certs.dns_names(b"not a certificate") == ()


def test_the_workers_run_as_the_ingress_user_when_one_is_given():
    """``user``/``group`` in the global section: HAProxy's workers switch to them (the master
    stays root); without (the agent not root, or ``[ingress] user = "root"``) none."""
    table = routing.build([HOST_RULES])
    args = (table, {}, Settings(), haproxy.Listen(("192.0.2.1",)), haproxy.Paths(Path("/run/x")), {})
    glob = haproxy.render(*args, run_as=("haproxy", "haproxy"))["haproxy.cfg"].split("defaults")[0]
    assert "    user haproxy\n    group haproxy\n" in glob
    bare = haproxy.render(*args)["haproxy.cfg"].split("defaults")[0]
    assert "user " not in bare and "group " not in bare


def test_the_ingress_user_is_named_and_its_absence_said_in_one_line():
    assert proxy.resolve_user("root") is None  # on purpose: no switch
    if os.geteuid() == 0:  # a root test run: the lookup happens (a non-root agent never switches)
        with pytest.raises(proxy.ProxyError, match=r"^\[ingress\] user no-such-user-x: no such user; create it .*useradd"):
            proxy.resolve_user("no-such-user-x")
    else:
        assert proxy.resolve_user("no-such-user-x") is None


def test_a_directory_the_workers_cannot_pass_through_is_named(tmp_path):
    shut = tmp_path / "shut"
    inner = shut / "in" / "ingress"
    inner.mkdir(parents=True)
    os.chmod(shut, 0o700)
    st = shut.stat()
    other, other_gid = st.st_uid + 12345, st.st_gid + 12345
    above = proxy.unsearchable(tmp_path / "x", other, other_gid)  # pytest's own directories may be shut too
    assert proxy.unsearchable(inner, other, other_gid) == (above or shut)
    assert proxy.unsearchable(inner, st.st_uid, st.st_gid) is None  # its owner may
    os.chmod(shut, 0o710)
    assert proxy.unsearchable(inner, other, st.st_gid) == proxy.unsearchable(tmp_path / "x", other, st.st_gid)  # its group may
    assert proxy.unsearchable(inner, other, other_gid) == (above or shut)
    os.chmod(shut, 0o711)
    assert proxy.unsearchable(inner, other, other_gid) == above


def test_the_ingress_user_setting_takes_a_user_name():
    from agentd.config.settings import ConfigError, load_config

    base = {"node.address": "10.1.1.1", "node.name": "n1"}
    assert load_config(None, env={}, overrides=base).ingress.user == ""  # haproxy where usable, else root
    assert load_config(None, env={}, overrides={**base, "ingress.user": ""}).ingress.user == ""
    assert load_config(None, env={}, overrides={**base, "ingress.user": " www-data "}).ingress.user == "www-data"
    assert load_config(None, env={}, overrides={**base, "ingress.user": "root"}).ingress.user == "root"
    for bad in ("Bad", "a b", "0day", "x" * 33, "hap\nroxy"):
        with pytest.raises(ConfigError, match=r"\[ingress\] user: must be a user name"):
            load_config(None, env={}, overrides={**base, "ingress.user": bad})


def _rules(host: str, *paths: tuple[str, str, str]) -> dict:
    return {"host": host, "http": {"paths": [p(path, kind, svc) for path, kind, svc in paths]}}


def _annotated(obj: dict, **annotations: str) -> dict:
    obj["metadata"]["annotations"] = {f"ingress.agentd.io/{k.replace('_', '-')}": v for k, v in annotations.items()}
    return obj


def test_a_tls_entry_applies_only_to_its_own_ingresses_rule_hosts():
    """team-a's Ingress, the older, has rules for a.example only but lists b.example in its tls
    too: that took b.example's certificate (SNI) from team-b's Ingress, which holds all of
    b.example's rules.  As in ingress-nginx (createServers walks an Ingress's rules), an
    Ingress's tls applies to its own rule hosts: b.example keeps team-b's certificate, and
    team-a's listing is said in the conflicts."""
    a = ing("a", [_rules("a.example", ("/", "Prefix", "a"))], ns="team-a",
            tls=[{"hosts": ["a.example", "b.example"], "secretName": "a-cert"}])
    b = ing("b", [_rules("b.example", ("/", "Prefix", "b"))], ns="team-b", created="2024-02-01T00:00:00Z",
            tls=[{"hosts": ["b.example"], "secretName": "b-cert"}])
    for order in ([a, b], [b, a]):
        table = routing.build(order)
        assert [(t.host, t.secret) for t in table.tls] == [("a.example", ("team-a", "a-cert")), ("b.example", ("team-b", "b-cert"))]
        assert not any("already given" in c for c in table.conflicts), table.conflicts
        assert any(c.startswith("team-a/a: tls for b.example: no rule of team-a/a names this host") for c in table.conflicts)
        files = haproxy.maps(table, {("team-a", "a-cert"): Path("/c/a.pem"), ("team-b", "b-cert"): Path("/c/b.pem")})
        assert files["crt-list"].splitlines() == ["/c/a.pem a.example", "/c/b.pem b.example"]
    # Alone, team-a's Ingress gives b.example nothing: b.example is no TLS host of its.
    alone = routing.build([a])
    assert [t.host for t in alone.tls] == ["a.example"] and not alone.tls_host("b.example")
    # A rule host that no entry names takes an entry whose certificate covers it, a wildcard
    # one too (ingress-nginx: VerifyHostname); the wildcard itself, no rule host, is no SNI name.
    w = ing("w", [_rules("shop.wild.example", ("/", "Prefix", "s"))], tls=[{"hosts": ["*.wild.example"], "secretName": "wild"}])
    table = routing.build([w], cert_names=lambda s: ("*.wild.example",))
    assert [(t.host, t.secret, t.serves) for t in table.tls] == [("shop.wild.example", ("default", "wild"), True)]
    assert table.redirects("shop.wild.example", "/")
    assert haproxy.maps(table, {("default", "wild"): Path("/c/w.pem")})["crt-list"] == "/c/w.pem shop.wild.example\n"


def test_a_secret_whose_certificate_does_not_cover_the_host_does_not_serve_it():
    """A tls entry naming shop.example with a certificate for other.example only: that
    certificate was served for shop.example (a client refuses it), silently, and kept a newer
    Ingress's certificate for shop.example from the host.  Now the host falls through to the
    newer Ingress's Secret, or to the default certificate, and it is said (routing:
    ``uncovered``, the controller's tls_errors)."""
    a = ing("a", [_rules("shop.example", ("/", "Prefix", "web"))], tls=[{"hosts": ["shop.example"], "secretName": "s"}])
    b = ing("b", [_rules("shop.example", ("/b", "Prefix", "b"))], created="2024-02-01T00:00:00Z",
            tls=[{"hosts": ["shop.example"], "secretName": "good"}])
    names = {("default", "s"): ("other.example",), ("default", "good"): ("shop.example",)}
    pems = {("default", "s"): Path("/c/s.pem"), ("default", "good"): Path("/c/good.pem")}
    alone = routing.build([a], cert_names=names.get)
    assert [(t.host, t.secret, t.serves) for t in alone.tls] == [("shop.example", ("default", "s"), False)]
    assert alone.uncovered == [(("default", "s"), "shop.example")]
    assert haproxy.maps(alone, pems)["crt-list"] == ""  # the default certificate
    assert alone.redirects("shop.example", "/")  # a TLS host all the same, as with a missing Secret
    both = routing.build([b, a], cert_names=names.get)
    assert [(t.host, t.secret, t.ingress) for t in both.tls] == [("shop.example", ("default", "good"), ("default", "b"))]
    assert "default/a: tls for shop.example: its Secret cannot serve it; default/b's does" in both.conflicts
    assert haproxy.maps(both, pems)["crt-list"] == "/c/good.pem shop.example\n"
    # Both covering: the older keeps the host, as before.
    assert [t.secret for t in routing.build([a, b], cert_names=lambda s: ("shop.example",)).tls] == [("default", "s")]


def test_the_redirect_to_https_follows_the_ingress_of_the_path():
    """ingress-nginx decides per location: the location's ssl-redirect and a certificate for
    the host.  It was decided per host by the Ingress owning the tls entry: B's "false" on
    /healthz was ignored, and A's "false" served B's /login over plain HTTP."""
    a = ing("a", [_rules("shop.example", ("/", "Prefix", "web"), ("/a", "Prefix", "web"))],
            tls=[{"hosts": ["shop.example"], "secretName": "s"}])
    b = _annotated(ing("b", [_rules("shop.example", ("/healthz", "Exact", "health"))], created="2024-02-01T00:00:00Z"),
                   ssl_redirect="false")
    table = routing.build([a, b])
    files = render(table)
    for path, redirected in (("/", True), ("/x", True), ("/healthz", False), ("/healthz/x", True), ("/a", True)):
        assert table.redirects("shop.example", path) == redirected, path
        assert lookup(files, table, "shop.example", path) == expected(table, "shop.example", path), path
        assert lookup(files, table, "shop.example", path, https=True) == table.route("shop.example", path), path
    # The reverse: the tls entry's Ingress says "false", the other keeps the default.
    a = _annotated(ing("a", [_rules("shop.example", ("/a", "Prefix", "web"))], tls=[{"hosts": ["shop.example"], "secretName": "s"}]),
                   ssl_redirect="false")
    b = ing("b", [_rules("shop.example", ("/login", "Prefix", "login"))], created="2024-02-01T00:00:00Z")
    table = routing.build([a, b])
    files = render(table)
    # A path no rule matches follows the host's oldest Ingress (ingress-nginx's default location).
    for path, redirected in (("/login", True), ("/login/x", True), ("/a", False), ("/elsewhere", False)):
        assert table.redirects("shop.example", path) == redirected, path
        assert lookup(files, table, "shop.example", path) == expected(table, "shop.example", path), path
    # No TLS for the host: never redirected, whatever the Ingress wants.
    table = routing.build([b])
    assert not table.redirects("shop.example", "/login") and lookup(render(table), table, "shop.example", "/login") != REDIRECT


def test_a_wildcard_tls_host_redirects_the_one_label_under_it():
    """A wildcard TLS host (a wildcard rule host in its Ingress's tls) covers one label: its
    plain-HTTP requests are redirected -- also for a host with rules of its own under it
    (its certificate is the wildcard's by SNI) -- and two labels under it are not."""
    w = ing("w", [_rules("*.foo.com", ("/", "Prefix", "wild"))], tls=[{"hosts": ["*.foo.com"], "secretName": "wild"}])
    other = ing("other", [_rules("x.foo.com", ("/", "Prefix", "x")), _rules("a.b.foo.com", ("/", "Prefix", "ab"))],
                created="2024-02-01T00:00:00Z")
    table = routing.build([w, other])
    files = render(table)
    assert files["tls-hosts.lst"] == "*.foo.com\n"
    assert "    acl tls_host var(txn.host),regsub(^[^.]+,*) -m str -f /run/x/tls-hosts.lst" in files["haproxy.cfg"].splitlines()
    for host, redirected in (("a.foo.com", True), ("A.Foo.com:80", True), ("a.foo.com.", True), ("x.foo.com", True),
                             ("a.b.foo.com", False), ("foo.com", False), ("foo.bar.com", False)):  # fmt: skip
        assert table.redirects(host, "/") == redirected, host
        assert (lookup(files, table, host, "/") == REDIRECT) == redirected, host
        assert lookup(files, table, host, "/", https=True) == table.route(host, "/"), host


TLS_HOSTS = st.sampled_from(["x.io", "y.x.io", "*.x.io"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(HOSTS, st.lists(RULE_PATHS, min_size=1, max_size=3)), min_size=1, max_size=3),
       st.lists(st.tuples(HOSTS, st.lists(RULE_PATHS, min_size=1, max_size=3)), min_size=1, max_size=3),
       st.lists(TLS_HOSTS, max_size=2), st.lists(TLS_HOSTS, max_size=2), st.booleans(), st.booleans(),
       st.sampled_from(["x.io", "y.x.io", "z.x.io", "q.y.x.io", "Y.x.io:80", "other"]), REQUEST_PATHS)  # fmt: skip
def test_the_rendered_frontend_redirects_as_the_table_on_any_rules(rules_a, rules_b, tls_a, tls_b, off_a, off_b, host, path):
    """Two Ingresses with any rules, tls hosts and ssl-redirect: the rendered frontend (its
    rules run by lookup) answers every plain-HTTP and HTTPS request as the reference."""
    ings = []
    for name, rules, tls, off, created in (("a", rules_a, tls_a, off_a, "2024-01-01T00:00:00Z"),
                                           ("b", rules_b, tls_b, off_b, "2024-02-01T00:00:00Z")):  # fmt: skip
        spec_rules = []
        for i, (h, paths) in enumerate(rules):
            r = {"http": {"paths": [p(rp + ("/" if trail and rp != "/" else ""), kind, f"{name}{i}{j}")
                                    for j, (rp, trail, kind) in enumerate(paths)]}}  # fmt: skip
            if h:
                r["host"] = h
            spec_rules.append(r)
        obj = ing(name, spec_rules, created=created, **({"tls": [{"hosts": sorted(set(tls)), "secretName": name}]} if tls else {}))
        ings.append(_annotated(obj, ssl_redirect="false") if off else obj)
    table = routing.build(ings)
    files = render(table)
    assert lookup(files, table, host, path) == expected(table, host, path)
    assert lookup(files, table, host, path, https=True) == table.route(host, path)


def test_a_rule_host_of_an_ingress_with_tls_that_no_secret_serves_is_a_tls_host_all_the_same():
    """Review s57/r12 #1: rule a.x with tls hosts ["*.x"] (cert-manager's wildcard entry) and
    its Secret not usable yet (missing, wrong type, refused) or for other names: a.x was no
    TLS host at all -- plain HTTP served, no 308, nothing in tls_errors.  As in ingress-nginx
    (createServers: a rule host of an Ingress with a tls section that no entry serves gets the
    default certificate, and is redirected), it is a TLS host with the wildcard entry's Secret,
    not serving it; so is a rule host no entry names at all."""
    w = ing("w", [_rules("a.x", ("/", "Prefix", "s"))], tls=[{"hosts": ["*.x"], "secretName": "wild"}])
    pems = {("default", "wild"): Path("/c/wild.pem")}
    for usable, names, uncovered in ((lambda s: False, (), []), (lambda s: True, ("*.y",), [(("default", "wild"), "a.x")])):
        table = routing.build([w], usable=usable, cert_names=lambda s, names=names: names)
        assert table.tls == [routing.TlsHost("a.x", ("default", "wild"), ("default", "w"), False)]
        assert table.redirects("a.x", "/") and lookup(render(table), table, "a.x", "/") == REDIRECT
        assert haproxy.maps(table, pems)["crt-list"] == ""  # the default certificate
        assert table.uncovered == uncovered  # the controller's tls_errors ("no such Secret" and the like: its own check)
        assert table.conflicts == []  # the wildcard entry covers a rule host: nothing "not given"
    # Served: the rule host, not the wildcard, is the SNI name.  The certificate's names not
    # known (cert_names None): it serves the hosts named for it and one label under its wildcards.
    for cert_names in (lambda s: ("*.x",), lambda s: None):
        table = routing.build([w], cert_names=cert_names)
        assert table.tls == [routing.TlsHost("a.x", ("default", "wild"), ("default", "w"), True)] and table.uncovered == []
    # A rule host no entry names, in an Ingress with tls: the default certificate, redirected
    # (ingress-nginx: extractTLSSecretName finds nothing -> the default certificate).
    two = ing("two", [_rules("a.example", ("/", "Prefix", "a")), _rules("b.example", ("/", "Prefix", "b")),
                      {"http": {"paths": [p("/", "Prefix", "any")]}}],
              tls=[{"hosts": ["a.example"], "secretName": "a"}])  # fmt: skip
    table = routing.build([two], cert_names=lambda s: ("a.example",))
    assert [(t.host, t.secret, t.serves) for t in table.tls] == [("a.example", ("default", "a"), True), ("b.example", None, False)]
    assert table.redirects("b.example", "/") and not table.redirects("elsewhere", "/")  # the rules without a host: never
    assert haproxy.maps(table, {("default", "a"): Path("/c/a.pem")})["crt-list"] == "/c/a.pem a.example\n"
    # An Ingress without tls gives its hosts none, and takes nothing from an older one's TLS host.
    plain = ing("plain", [_rules("b.example", ("/p", "Prefix", "p")), _rules("c.example", ("/", "Prefix", "c"))],
                created="2024-02-01T00:00:00Z")
    table = routing.build([two, plain], cert_names=lambda s: ("a.example",))
    assert [t.host for t in table.tls] == ["a.example", "b.example"] and not table.redirects("c.example", "/")
    assert table.conflicts == []
    # A newer Ingress whose tls is for other hosts takes nothing and says nothing of them; one
    # whose Secret serves b.example takes it from the older one's default certificate.
    other = ing("other", [_rules("a.example", ("/o", "Prefix", "o")), _rules("b.example", ("/o", "Prefix", "o")),
                          _rules("o.example", ("/", "Prefix", "o"))],
                created="2024-02-01T00:00:00Z", tls=[{"hosts": ["o.example", "b.example"], "secretName": "o"}])  # fmt: skip
    table = routing.build([two, other], cert_names=lambda s: ("a.example",) if s[1] == "a" else ("o.example", "b.example"))
    assert [(t.host, t.secret, t.ingress) for t in table.tls] == [
        ("a.example", ("default", "a"), ("default", "two")), ("b.example", ("default", "o"), ("default", "other")),
        ("o.example", ("default", "o"), ("default", "other"))]
    assert table.conflicts == ["default/two: tls for b.example: its tls gives it no Secret; default/other's does"]


def test_a_wildcard_tls_host_that_serves_a_rule_host_is_no_conflict():
    """Review s57/r12 #2: the docs' example (tls ["*.shop.example"] for the rule host
    www.shop.example) was listed as "no rule ... names this host: not given its Secret" while its
    Secret was served for www.shop.example.  Only a named host that covers none of the
    Ingress's rule hosts is said."""
    web = ing("web", [_rules("www.shop.example", ("/", "Prefix", "web"))], ns="shop",
              tls=[{"hosts": ["*.shop.example", "*.other.example", "x.other.example"], "secretName": "wild"}])
    table = routing.build([web], cert_names=lambda s: ("*.shop.example",))
    assert haproxy.maps(table, {("shop", "wild"): Path("/c/wild.pem")})["crt-list"] == "/c/wild.pem www.shop.example\n"
    assert table.conflicts == [f"shop/web: tls for {h}: no rule of shop/web names this host: not given its Secret "
                               "(an Ingress's tls applies to its own rule hosts only)" for h in ("*.other.example", "x.other.example")]


def test_the_first_tls_entry_naming_a_host_gives_it_its_secret():
    """Review s57/r12 #5, as ingress-nginx (extractTLSSecretName): the first entry of an Ingress
    naming a host gives it its Secret; when that one cannot serve it, the host gets the default
    certificate -- a later entry naming it is not looked at (said in ``conflicts``)."""
    rules = [_rules("shop.example", ("/", "Prefix", "web"))]
    names = {("default", "bad"): ("other.example",), ("default", "good"): ("shop.example",)}
    pems = {("default", "bad"): Path("/c/bad.pem"), ("default", "good"): Path("/c/good.pem")}
    bad_first = ing("i", rules, tls=[{"hosts": ["shop.example"], "secretName": "bad"}, {"hosts": ["shop.example"], "secretName": "good"}])
    table = routing.build([bad_first], cert_names=names.get)
    assert table.tls == [routing.TlsHost("shop.example", ("default", "bad"), ("default", "i"), False)]
    assert haproxy.maps(table, pems)["crt-list"] == ""  # the default certificate
    assert table.uncovered == [(("default", "bad"), "shop.example")]
    assert table.conflicts == [("default/i: tls for shop.example: the first entry naming it gives it its Secret, default/bad, "
                                "which cannot serve it; not default/good of a later entry")]
    good_first = ing("i", rules, tls=[{"hosts": ["shop.example"], "secretName": "good"}, {"hosts": ["shop.example"], "secretName": "bad"}])
    table = routing.build([good_first], cert_names=names.get)
    assert table.tls == [routing.TlsHost("shop.example", ("default", "good"), ("default", "i"), True)]
    assert haproxy.maps(table, pems)["crt-list"] == "/c/good.pem shop.example\n"
    assert table.uncovered == [] and table.conflicts == []
    # An entry without a secretName first: the default certificate too (ingress-nginx: "secretName is empty").
    none_first = ing("i", rules, tls=[{"hosts": ["shop.example"]}, {"hosts": ["shop.example"], "secretName": "good"}])
    table = routing.build([none_first], cert_names=names.get)
    assert table.tls == [routing.TlsHost("shop.example", None, ("default", "i"), False)]
    assert table.conflicts == ["default/i: tls for shop.example: the first entry naming it has no secretName; not default/good of a later entry"]


class _Host(str):
    """A host name that counts how often it is compared: the work of routing.build."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _Host.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def _work(n: int, shape: str) -> int:
    hosts = [_Host(f"h{i}.shop.example") for i in range(n)]
    if shape == "an entry per host":
        tls = [{"hosts": [_Host(h)], "secretName": f"s{i}"} for i, h in enumerate(hosts)]
    elif shape == "one entry for all":
        tls = [{"hosts": [_Host(h) for h in hosts], "secretName": "s"}]
    else:  # entries without hosts, each certificate for one host
        tls = [{"secretName": f"s{i}"} for i in range(n)]
    obj = {"metadata": {"namespace": "d", "name": "big", "creationTimestamp": "2024-01-01T00:00:00Z"},
           "spec": {"rules": [{"host": h, "http": {"paths": [p("/", "Prefix", "s")]}} for h in hosts], "tls": tls}}
    calls = 0

    def usable(secret: tuple[str, str]) -> bool:
        nonlocal calls
        calls += 1
        return True

    _Host.compared = 0
    table = routing.build([obj], usable=usable, cert_names=lambda s: ("*.shop.example",) if s[1] == "s" else (f"h{s[1][1:]}.shop.example",))
    assert len(table.tls) == n and all(t.serves for t in table.tls)
    return _Host.compared + calls


@pytest.mark.parametrize("shape", ["an entry per host", "one entry for all", "entries without hosts"])
def test_the_tls_of_one_ingress_costs_work_linear_in_its_hosts(shape):
    """Review s57/r12 #3: one Ingress's tls was quadratic in its hosts (a list searched per host,
    every entry scanned per host) -- 8,000 hosts with an entry each took 5.5 s, on the agent's
    event loop.  Twice the hosts, about twice the work (host comparisons and Secret checks)."""
    small, large = _work(300, shape), _work(600, shape)
    assert large <= 2.5 * small, (small, large)


def test_each_secret_is_asked_whether_it_is_usable_once_per_build():
    """The controller's usable() decodes and hashes the Secret: asked once or twice per rule
    host (8,000 hosts of one entry: 8,000 calls, 206 ms of the event loop), it is now asked
    once per Secret in a build (review s57 r19)."""
    hosts = [f"h{i}.shop.example" for i in range(200)]
    obj = {"metadata": {"namespace": "d", "name": "big", "creationTimestamp": "2024-01-01T00:00:00Z"},
           "spec": {"rules": [{"host": h, "http": {"paths": [p("/", "Prefix", "s")]}} for h in hosts],
                    "tls": [{"hosts": hosts, "secretName": "s"}, {"secretName": "other"}]}}
    asked: list[tuple[str, str]] = []

    def usable(secret: tuple[str, str]) -> bool:
        asked.append(secret)
        return True

    table = routing.build([obj], usable=usable, cert_names=lambda s: ("*.shop.example",))
    assert len(table.tls) == 200 and all(t.serves for t in table.tls)
    assert sorted(asked) == sorted(set(asked)) and len(asked) <= 2


def test_secrets_of_hostless_entries_are_listed_once_however_many_ingresses():
    """table.hostless was made a set again for every Ingress with tls (quadratic in them):
    one set for the whole build; each Secret listed once (review s57 r19)."""
    objs = [{"metadata": {"namespace": "d", "name": f"i{i}", "creationTimestamp": f"2024-01-01T00:00:{i % 60:02d}Z"},
             "spec": {"rules": [{"host": f"h{i}.example", "http": {"paths": [p("/", "Prefix", "s")]}}],
                      "tls": [{"secretName": "pending"}, {"secretName": f"own{i}"}]}} for i in range(50)]
    table = routing.build(objs, usable=lambda s: s[1] != "pending", cert_names=lambda s: (f"h{s[1][3:]}.example",))
    assert table.hostless.count(("d", "pending")) == 1
