"""Ingress on the lab: the real HAProxy on every node, driven by Ingress resources in etcd.

One 3-node lab (host-gw) with the Ingress controller on every node and pods running
agentd.lab.httpecho (an HTTP server that answers with its pod's name, the request and its
headers; WebSocket echo): web-1..3 (one per node, app=web), foo-1 (app=foo), bar-1 (app=bar).
The client is outside the pod network: curl and wrk in the lab's underlay namespace, to the
nodes' underlay addresses.  Each test applies manifests, waits until every node reports the
etcd revision applied (GET /ingress), and asserts what answered: the conformance scenarios
(host rules, path rules, default backend, TLS) plus SNI with two certificates on one port,
the redirect, the forwarded headers, WebSocket, merging, 404/503, the proxy's PID and worker
across endpoint changes (no reload) and Ingress changes (a graceful reload), zero failed
requests under load meanwhile, the proxy serving on while the agent is killed or stopped and
adopted by the next agent, a crash and restart, status/metrics, bad manifests, and leave.
The other backends (vxlan, udp, ipip) get one lab each for a short served-through-ingress check.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from agentd.lab.errors import LabError
from agentd.lab.httpecho import HttpEcho
from agentd.lab.lab import API_URL, CLIENT_ADDRESS_V6, Lab, LabSpec
from agentd.lab.netns import unique_tag
from agentd.lab.runtime import binary
from agentd.lab.wait import auntil

pytestmark = pytest.mark.asyncio(loop_scope="module")

NS = "shop"
HTTP = [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]


class World:
    def __init__(self, lab: Lab, tmp: Path) -> None:
        self.lab = lab
        self.tmp = tmp
        self.pods: dict[str, Any] = {}
        self.echo: list[HttpEcho] = []
        self.res: Any = None
        self.ca: Path = tmp / "ca.pem"

    @property
    def node_ips(self) -> list[str]:
        return [n.address for n in self.lab.nodes]

    async def apply(self, *objs: dict[str, Any]) -> int:
        rev = await self.res.apply(list(objs))
        await self.converged(rev)
        return rev

    async def delete(self, kind: str, name: str, ns: str = NS) -> None:
        await self.converged(await self.res.delete(kind, ns, name))

    async def converged(self, revision: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        behind: list[str] = []
        while time.monotonic() < deadline:
            views = await asyncio.gather(*(asyncio.to_thread(n.api_or_none, "/ingress") for n in self.lab.nodes))
            behind = [f"{n.name}={(v or {}).get('revision')} running={(v or {}).get('running')} error={(v or {}).get('error')}"
                      for n, v in zip(self.lab.nodes, views)
                      if not v or v.get("revision", 0) < revision or v.get("error") or not v.get("running")]  # fmt: skip
            if not behind:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"ingress revision {revision} not applied everywhere: {', '.join(behind)}")

    async def curl(self, url: str, *, node: int = 0, host: str | None = None, args: tuple[str, ...] = (),
                   family: int = 4) -> tuple[int, Any, dict[str, str]]:  # fmt: skip
        """One request from the underlay namespace to node ``node`` (``--resolve``: the URL's
        host name goes to that node's address of ``family``); (status, JSON body or text, headers)."""
        n = self.lab.nodes[node]
        ip = n.address if family == 4 else f"[{n.address_v6}]"
        m = re.match(r"(https?)://([^/:]+)(?::(\d+))?", url)
        assert m, url
        name, port = m.group(2), m.group(3) or ("443" if m.group(1) == "https" else "80")
        cmd = ["curl", "-sS", "--max-time", "10", "-D", "-", "--resolve", f"{name}:{port}:{ip}", "--cacert", str(self.ca)]
        if host is not None:
            cmd += ["-H", f"Host: {host}"]
        rc, out, err = await self.lab.underlay.aexec(*cmd, *args, url, check=False, timeout=30)
        assert rc == 0, f"curl {url} failed ({rc}): {err.decode(errors='replace').strip()}"
        text = out.decode(errors="replace")
        blocks = text.split("\r\n\r\n")
        while len(blocks) > 2 and blocks[1].startswith("HTTP/"):  # 1xx / redirects not followed: keep the last head
            blocks = blocks[1:]
        head, body = blocks[0], "\r\n\r\n".join(blocks[1:])
        status = int(head.split()[1])
        headers = {}
        for line in head.split("\r\n")[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        try:
            return status, json.loads(body), headers
        except ValueError:
            return status, body, headers

    async def served_by(self, url: str, **kw: Any) -> str | int:
        """The pod that answered, or the status when no pod did."""
        status, body, headers = await self.curl(url, **kw)
        if status == 200 and isinstance(body, dict) and "pod" in body:
            return body["pod"]
        return status

    def proxy(self, node: int = 0) -> dict[str, Any]:
        return self.lab.nodes[node].api("/ingress")


# ---------------------------------------------------------------- manifests


def service(name: str, app: str, port_name: str | None = "http") -> dict[str, Any]:
    port = {"port": 80, "targetPort": "http"}
    if port_name:
        port["name"] = port_name
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"app": app}, "ports": [port]}}  # fmt: skip


def backend(svc: str, port: int | str = 80) -> dict[str, Any]:
    return {"service": {"name": svc, "port": {"number": port} if isinstance(port, int) else {"name": port}}}


def path(p: str, kind: str, svc: str) -> dict[str, Any]:
    return {"path": p, "pathType": kind, "backend": backend(svc)}


def ingress(name: str, rules: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"ingressClassName": "agentd", **spec}
    if rules is not None:
        body["rules"] = rules
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": name, "namespace": NS},
            "spec": body}  # fmt: skip


def rule(host: str | None, *paths: dict[str, Any]) -> dict[str, Any]:
    r: dict[str, Any] = {"http": {"paths": list(paths)}}
    if host:
        r["host"] = host
    return r


CLASS = {"apiVersion": "networking.k8s.io/v1", "kind": "IngressClass", "metadata": {"name": "agentd"},
         "spec": {"controller": "agentd.io/ingress-controller"}}  # fmt: skip


def make_ca(tmp: Path) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agentd test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))  # fmt: skip
    (tmp / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def tls_secret(name: str, hosts: list[str], ca: tuple[Any, Any], *, wrong_key: bool = False,
               weak: bool = False) -> dict[str, Any]:
    """``weak``: a 1024-bit RSA key, which parses and matches but OpenSSL's security level refuses."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID

    ca_cert, ca_key = ca
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024) if weak else ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in hosts]), critical=False)
            .sign(ca_key, hashes.SHA256()))  # fmt: skip
    if wrong_key:
        key = ec.generate_private_key(ec.SECP256R1())
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    data = {"tls.crt": cert.public_bytes(serialization.Encoding.PEM), "tls.key": pem_key}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS}, "type": "kubernetes.io/tls",
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}  # fmt: skip


# ---------------------------------------------------------------- the lab


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ingress")
    spec = LabSpec(name="in" + unique_tag("")[:6], nodes=3, pods=0, backend="host-gw", ingress=True)
    # HAProxy's workers run as the haproxy user and send the access log to a socket in the
    # nodes' state directories, which they must be able to reach, as /var/lib/agentd is: the
    # lab goes where labs go (/run/agentd-lab, 0755), not under pytest's directories (0700,
    # and pytest puts 0700 back on its root whenever a process of it starts).
    lab = Lab(spec)
    w = World(lab, tmp)
    w.ca_pair = make_ca(tmp)
    try:
        await lab.up(timeout=90)
        layout = {"web-1": (0, "web"), "web-2": (1, "web"), "web-3": (2, "web"), "foo-1": (0, "foo"), "bar-1": (1, "bar")}
        for name, (node, app) in layout.items():
            w.pods[name] = await lab.add_pod(lab.nodes[node], NS, name, labels={"app": app}, ports=HTTP)
        w.echo = list(await asyncio.gather(*(HttpEcho.start(pod, name, [8080]) for name, pod in w.pods.items())))
        w.res = await lab.resources()
        await w.apply(CLASS, service("web", "web"), service("foo", "foo"), service("bar", "bar"), service("nobody", "none"))
        yield w
    finally:
        for e in w.echo:
            e.close()
        if w.res is not None:
            await w.res.close()
        await lab.down(keep_files=True)
        # The nodes' logs kept with the test's files; the lab's directory goes.
        for node in lab.nodes:
            with contextlib.suppress(OSError):
                shutil.copy(node.log_path, tmp / f"{node.name}.log")
        shutil.rmtree(lab.dir, ignore_errors=True)


WEBS = {"web-1", "web-2", "web-3"}


async def test_host_rules_and_tls_with_sni_and_redirect(world: World):
    """Conformance host_rules, plus a second TLS host on the same port (SNI picks the
    certificate, which curl checks against the test CA), the 308 redirect, and the default
    certificate for a host without a Secret -- and for a TLS host whose Secret is missing,
    still redirected (as ingress-nginx does), the missing Secret named in /ingress and
    `agentd status`."""
    await world.apply(
        tls_secret("foo-tls", ["foo.bar.com"], world.ca_pair), tls_secret("shop-tls", ["shop.example"], world.ca_pair),
        tls_secret("weak-tls", ["weak.example"], world.ca_pair, weak=True),
        ingress("hosts", [rule("*.foo.com", path("/", "Prefix", "web")), rule("foo.bar.com", path("/", "Prefix", "foo")),
                          rule("shop.example", path("/", "Prefix", "bar")), rule("nosecret.example", path("/", "Prefix", "foo")),
                          rule("weak.example", path("/", "Prefix", "foo"))],
                tls=[{"hosts": ["foo.bar.com"], "secretName": "foo-tls"}, {"hosts": ["shop.example"], "secretName": "shop-tls"},
                     {"hosts": ["nosecret.example"], "secretName": "missing-tls"},
                     {"hosts": ["weak.example"], "secretName": "weak-tls"}]),
    )  # fmt: skip
    try:
        for node in range(3):  # served on every node
            assert await world.served_by("https://foo.bar.com/", node=node) == "foo-1"
            assert await world.served_by("https://shop.example/", node=node) == "bar-1"
        status, body, headers = await world.curl("http://foo.bar.com/x?y=1")
        assert status == 308 and headers["location"] == "https://foo.bar.com/x?y=1", (status, headers)
        assert await world.served_by("http://subdomain.bar.com/") == 404
        # *.foo.com: a rule host of an Ingress with tls that no entry names -- the default
        # certificate, and redirected, as ingress-nginx does (review s57/r12).
        status, _, headers = await world.curl("http://bar.foo.com/x")
        assert status == 308 and headers["location"] == "https://bar.foo.com/x", (status, headers)
        assert await world.served_by("http://baz.bar.foo.com/") == 404  # one label only
        assert await world.served_by("http://foo.com/") == 404
        assert await world.served_by("https://bar.foo.com/", args=("-k",)) in WEBS
        # case and port of Host ignored, and the final dot of a fully qualified name
        for host in ("BAR.foo.com:443", "bar.foo.com."):
            assert await world.served_by("https://bar.foo.com/", host=host, args=("-k",)) in WEBS, host
        # A host without a Secret gets the default certificate: the client refuses it.
        rc, _, err = await world.lab.underlay.aexec("curl", "-sS", "--cacert", str(world.ca), "--resolve",
                                                    f"bar.foo.com:443:{world.node_ips[0]}", "https://bar.foo.com/", check=False)  # fmt: skip
        assert rc != 0 and b"certificate" in err.lower(), err
        # ... but is served over TLS (without checking the certificate).
        assert await world.served_by("https://bar.foo.com/", args=("-k",)) in WEBS
        # A TLS host whose Secret is missing: redirected all the same, served with the default
        # certificate, the Secret named where an operator looks.
        status, _, headers = await world.curl("http://nosecret.example/a?b=1")
        assert status == 308 and headers["location"] == "https://nosecret.example/a?b=1", (status, headers)
        assert await world.served_by("https://nosecret.example/", args=("-k",)) == "foo-1"
        rc, _, err = await world.lab.underlay.aexec("curl", "-sS", "--cacert", str(world.ca), "--resolve",
                                                    f"nosecret.example:443:{world.node_ips[0]}", "https://nosecret.example/", check=False)  # fmt: skip
        assert rc != 0 and b"certificate" in err.lower(), err
        why = world.proxy()["tls_errors"].get(f"{NS}/missing-tls", "")
        assert why.startswith("no such Secret") and "nosecret.example" in why, world.proxy()["tls_errors"]
        rc, out, _ = await world.lab.nodes[0].ns.aexec(binary("agentd"), "status", check=False)
        assert rc == 0 and f"TLS Secret {NS}/missing-tls: no such Secret" in out.decode(), out
        # A Secret whose key OpenSSL refuses (1024-bit RSA) would make HAProxy refuse the whole
        # configuration: its host is served with the default certificate, every other as ever.
        why = world.proxy()["tls_errors"].get(f"{NS}/weak-tls", "")
        assert why.startswith("the TLS library refuses it") and "weak.example" in why, world.proxy()["tls_errors"]
        assert await world.served_by("https://weak.example/", args=("-k",)) == "foo-1"
        assert world.proxy()["error"] is None
        # Switched off for one Ingress: plain HTTP is served.
        off = ingress("hosts", [rule("foo.bar.com", path("/", "Prefix", "foo"))],
                      tls=[{"hosts": ["foo.bar.com"], "secretName": "foo-tls"}])
        off["metadata"]["annotations"] = {"ingress.agentd.io/ssl-redirect": "false"}
        await world.apply(off)
        assert await world.served_by("http://foo.bar.com/") == "foo-1"
    finally:
        await world.delete("Ingress", "hosts")


async def test_wildcard_tls_host_redirect_per_path_and_tls_of_own_rule_hosts(world: World):
    """Review s57/r3: a wildcard TLS host's certificate (SNI) and plain-HTTP redirect for one
    label under it; the redirect decided per path by each path's own Ingress (ingress-nginx:
    per location); an Ingress's tls listing a host it has no rule for takes nothing from the
    Ingress that has its rules; a certificate that does not cover its host is not served for it."""
    off = {"ingress.agentd.io/ssl-redirect": "false"}

    def annotated(obj: dict[str, Any]) -> dict[str, Any]:
        obj["metadata"]["annotations"] = dict(off)
        return obj

    names = ("wild", "wild-health", "pp-a", "pp-b", "aa-grab", "bb-own", "mis", "pend")
    await world.apply(
        tls_secret("wild-tls", ["*.wild.example"], world.ca_pair), tls_secret("pp-tls", ["pp.example"], world.ca_pair),
        tls_secret("grab-tls", ["grab.example", "own.example"], world.ca_pair),
        tls_secret("own-tls", ["own.example"], world.ca_pair), tls_secret("mis-tls", ["other.example"], world.ca_pair),
        ingress("wild", [rule("*.wild.example", path("/", "Prefix", "web"))],
                tls=[{"hosts": ["*.wild.example"], "secretName": "wild-tls"}]),
        annotated(ingress("wild-health", [rule("a.wild.example", path("/healthz", "Exact", "foo"))])),
        annotated(ingress("pp-a", [rule("pp.example", path("/a", "Prefix", "foo"))],
                          tls=[{"hosts": ["pp.example"], "secretName": "pp-tls"}])),
        ingress("pp-b", [rule("pp.example", path("/login", "Prefix", "bar"))]),
        ingress("aa-grab", [rule("grab.example", path("/", "Prefix", "foo"))],
                tls=[{"hosts": ["grab.example", "own.example"], "secretName": "grab-tls"}]),
        ingress("bb-own", [rule("own.example", path("/", "Prefix", "bar"))], tls=[{"hosts": ["own.example"], "secretName": "own-tls"}]),
        ingress("mis", [rule("mis.example", path("/", "Prefix", "foo"))], tls=[{"hosts": ["mis.example"], "secretName": "mis-tls"}]),
        # cert-manager's wildcard entry before issuance: its Secret not there yet.
        ingress("pend", [rule("c.pend.example", path("/", "Prefix", "bar"))],
                tls=[{"hosts": ["*.pend.example"], "secretName": "pend-tls"}]),
    )  # fmt: skip

    async def subject(host: str) -> str:
        """The subject of the certificate the proxy serves for SNI ``host``."""
        rc, _, err = await world.lab.underlay.aexec(
            "curl", "-sSvk", "--max-time", "10", "-o", "/dev/null", "--resolve", f"{host}:443:{world.node_ips[0]}",
            f"https://{host}/", check=False, timeout=30)  # fmt: skip
        m = re.search(r"subject: (.*)", err.decode(errors="replace"))
        assert rc == 0 and m, err
        return m.group(1).strip()

    try:
        # The wildcard TLS host: one label under it redirected, and served with its
        # certificate (curl checks it against the test CA).
        status, _, headers = await world.curl("http://b.wild.example/x?y=1")
        assert status == 308 and headers["location"] == "https://b.wild.example/x?y=1", (status, headers)
        status, _, headers = await world.curl("http://B.Wild.example./")
        assert status == 308, (status, headers)
        assert await world.served_by("https://b.wild.example/") in WEBS
        assert await world.served_by("http://x.b.wild.example/") == 404  # two labels under it: no TLS host, no rule
        # a.wild.example has rules of its own (an Ingress with the redirect off): its paths are
        # not redirected, and over HTTPS it gets the wildcard's certificate by SNI.
        assert await world.served_by("http://a.wild.example/healthz") == "foo-1"
        assert await world.served_by("http://a.wild.example/") == 404
        assert await world.served_by("https://a.wild.example/healthz") == "foo-1"
        # Per path: pp-a owns the TLS with the redirect off, pp-b keeps it on.
        status, _, headers = await world.curl("http://pp.example/login/x")
        assert status == 308 and headers["location"] == "https://pp.example/login/x", (status, headers)
        assert await world.served_by("http://pp.example/a") == "foo-1"
        assert await world.served_by("https://pp.example/login") == "bar-1"
        # aa-grab (older) lists own.example in its tls without a rule for it: bb-own keeps it.
        assert await world.served_by("https://own.example/") == "bar-1"
        assert await subject("own.example") == "CN=own.example"
        assert await subject("grab.example") == "CN=grab.example"
        view = world.proxy()
        assert any(c.startswith(f"{NS}/aa-grab: tls for own.example: no rule of") for c in view["conflicts"]), view["conflicts"]
        # mis-tls is for other.example: the default certificate for mis.example, and said.
        assert await subject("mis.example") != "CN=other.example"
        rc, _, err = await world.lab.underlay.aexec("curl", "-sS", "--cacert", str(world.ca), "--resolve",
                                                    f"mis.example:443:{world.node_ips[0]}", "https://mis.example/", check=False)  # fmt: skip
        assert rc != 0, err
        why = view["tls_errors"].get(f"{NS}/mis-tls", "")
        assert "does not cover mis.example" in why and "default certificate" in why, view["tls_errors"]
        status, _, _ = await world.curl("http://mis.example/")
        assert status == 308  # a TLS host all the same
        # The rule host of a wildcard entry whose Secret is not issued yet: redirected, the
        # default certificate, the Secret named (review s57/r12: neither, before).
        status, _, headers = await world.curl("http://c.pend.example/p")
        assert status == 308 and headers["location"] == "https://c.pend.example/p", (status, headers)
        assert await world.served_by("https://c.pend.example/", args=("-k",)) == "bar-1"
        assert view["tls_errors"].get(f"{NS}/pend-tls") == "no such Secret: c.pend.example served with the default certificate", \
            view["tls_errors"]
        assert not any("pend" in c for c in view["conflicts"]), view["conflicts"]
        assert view["error"] is None
    finally:
        for name in names:
            await world.delete("Ingress", name)


async def test_path_rules(world: World):
    """Conformance path_rules: Exact, Prefix element by element, longest match, Exact over Prefix."""
    await world.apply(ingress("paths", [
        rule("exact-path-rules", path("/foo", "Exact", "foo")),
        rule("prefix-path-rules", path("/foo", "Prefix", "foo"), path("/aaa/bbb", "Prefix", "bar"), path("/aaa", "Prefix", "web")),
        rule("mixed-path-rules", path("/foo", "Prefix", "web"), path("/foo", "Exact", "foo")),
        rule("trailing-slash-path-rules", path("/aaa/bbb/", "Prefix", "bar"), path("/foo/", "Exact", "foo")),
    ]))  # fmt: skip
    try:
        cases = {
            "http://exact-path-rules/foo": "foo-1", "http://exact-path-rules/foo/": 404, "http://exact-path-rules/FOO": 404,
            "http://exact-path-rules/bar": 404, "http://prefix-path-rules/foo": "foo-1", "http://prefix-path-rules/foo/": "foo-1",
            "http://prefix-path-rules/FOO": 404, "http://prefix-path-rules/aaa/bbb": "bar-1",
            "http://prefix-path-rules/aaa/bbb/ccc": "bar-1", "http://prefix-path-rules/aaa/ccc": WEBS,
            "http://prefix-path-rules/aaaccc": 404, "http://mixed-path-rules/foo": "foo-1", "http://mixed-path-rules/foo/x": WEBS,
            "http://trailing-slash-path-rules/aaa/bbb": "bar-1", "http://trailing-slash-path-rules/aaa/bbb/": "bar-1",
            "http://trailing-slash-path-rules/foo": 404, "http://trailing-slash-path-rules/foo/": "foo-1",
        }  # fmt: skip
        for url, want in cases.items():
            got = await world.served_by(url)
            assert got in want if isinstance(want, set) else got == want, (url, got, want)
        status, body, _ = await world.curl("http://prefix-path-rules/aaa/bbb/ccc?q=1")
        assert body["path"] == "/aaa/bbb/ccc?q=1" and body["host"] == "prefix-path-rules"
        # A Host header with a path in it (not a host) moves no path into the routing key:
        # /ccc is nobody's, whatever "Host: prefix-path-rules/aaa" says.
        assert await world.served_by("http://prefix-path-rules/ccc", host="prefix-path-rules/aaa") == 400
        # Nor does a Host of several values pick its last one (HAProxy's req.hdr() would:
        # exact-path-rules' /foo, foo-1): no host, 400.
        assert await world.served_by("http://prefix-path-rules/foo", host="prefix-path-rules,exact-path-rules") == 400
        # A path with a space matches what a client sends for it; one with newlines keeps to
        # its own map line (raw, the second line would have routed mixed-path-rules/ here).
        odd = "/x\nmixed-path-rules/ ing.shop.odd-paths.bar.80\ny"
        await world.apply(ingress("odd-paths", [rule("odd-paths", path("/a b", "Exact", "bar"), path(odd, "Exact", "bar"))]))
        try:
            assert await world.served_by("http://odd-paths/a%20b") == "bar-1"
            status, body, _ = await world.curl("http://mixed-path-rules/")
            assert (status, body) == (404, "default backend - 404"), (status, body)
        finally:
            await world.delete("Ingress", "odd-paths")
    finally:
        await world.delete("Ingress", "paths")


async def test_the_request_path_is_normalised_as_ingress_nginx_does(world: World):
    """Rules match the path nginx matches its locations against (percent-decoded, %2F
    included, dot segments resolved, slashes merged); the pod still gets the path as sent."""
    await world.apply(ingress("normal", [rule("normal.example", path("/a/b", "Prefix", "foo"), path("/api", "Prefix", "bar"),
                                                path("/admin", "Prefix", "web"))]))  # fmt: skip
    try:
        as_is = ("--path-as-is",)  # curl would resolve the dot segments itself
        cases = {"/a%2Fb": "foo-1", "/%61pi/v1": "bar-1", "/api/../admin": WEBS, "//api": "bar-1",
                 "/x/%2E%2E/a/./b": "foo-1", "/../admin": 400, "/a%252Fb": 404,
                 "/admin/..%0A": WEBS}  # fmt: skip  (a segment "..\n", not a dot segment: /admin's)
        for p, want in cases.items():
            got = await world.served_by(f"http://normal.example{p}", args=as_is)
            assert got in want if isinstance(want, set) else got == want, (p, got, want)
        status, body, _ = await world.curl("http://normal.example/api/../admin?q=%2F", args=as_is)
        assert status == 200 and body["path"] == "/api/../admin?q=%2F", body
    finally:
        await world.delete("Ingress", "normal")


# A pod's server that takes each request and closes without an answer (a pod going away
# mid-request); prints each request's first line.
MUTE = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    data = b""
    while b"\\r\\n\\r\\n" not in data:
        more = c.recv(65536)
        if not more:
            break
        data += more
    print(data.split(b"\\r\\n")[0].decode(), flush=True)
    c.close()
"""


async def test_a_request_that_may_have_been_acted_on_is_not_sent_twice(world: World):
    """A pod closes each request without answering: a GET is tried again (twice), a POST, PATCH
    or LOCK that reached the pod never is (ingress-nginx's proxy_next_upstream alike): the client
    gets 502 and the pod saw it once."""
    pod = world.pods["foo-1"]
    server = pod.ns.popen([sys.executable, "-c", MUTE, "8090"], stdout=subprocess.PIPE, text=True)
    try:
        assert (await asyncio.to_thread(server.stdout.readline)).strip() == "ready"
        mute = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "mute", "namespace": NS},
                "spec": {"selector": {"app": "foo"}, "ports": [{"port": 80, "targetPort": 8090}]}}  # fmt: skip
        await world.apply(mute, ingress("mute", [rule("mute.example", path("/", "Prefix", "mute"))]))
        for method in ("POST", "PATCH", "LOCK", "GET"):
            status, _, _ = await world.curl("http://mute.example/pay", args=("-X", method, "-d", "amount=100"))
            assert status == 502, (method, status)
    finally:
        server.kill()
        out, _ = await asyncio.to_thread(server.communicate, timeout=10)
        await world.delete("Ingress", "mute")
        await world.delete("Service", "mute")
    seen = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert [m for m in seen if m != "GET"] == ["POST", "PATCH", "LOCK"], seen  # each once
    assert seen.count("GET") == 3, seen  # tried again, twice


async def test_default_backend_404_503_and_other_classes(world: World):
    # Nothing of ours: the built-in default backend.
    status, body, _ = await world.curl("http://my-host/")
    assert status == 404 and "default backend" in body
    # Conformance default_backend: an Ingress with only a defaultBackend takes every request.
    await world.apply(ingress("default-backend", defaultBackend=backend("foo")))
    try:
        for method, host, p in (("GET", "my-host", "/"), ("POST", "some-host", "/"), ("PUT", "", "/resource"),
                                ("DELETE", "some-host", "/resource"), ("PATCH", "my-host", "/resource")):  # fmt: skip
            status, body, headers = await world.curl(f"http://{world.node_ips[0]}{p}", host=host or None,
                                                     args=("-X", method, "--http1.1"))  # fmt: skip
            assert status == 200 and body["pod"] == "foo-1" and body["method"] == method and body["path"] == p
            assert body["proto"] == "HTTP/1.1" and headers.get("server") and headers.get("date")
        # 503: the Service has no ready endpoint; an unknown Service: the same.
        await world.apply(ingress("empty", [rule("empty.example", path("/", "Prefix", "nobody"), path("/gone", "Prefix", "missing"))]))
        assert await world.served_by("http://empty.example/") == 503
        assert await world.served_by("http://empty.example/gone") == 503
        assert await world.served_by("http://empty.example/", node=2) == 503
        # An Ingress of another controller's class is not ours: its host falls to the default backend.
        other = ingress("other", [rule("other.example", path("/", "Prefix", "bar"))])
        other["spec"]["ingressClassName"] = "nginx"
        await world.apply(other, {**CLASS, "metadata": {"name": "nginx"}, "spec": {"controller": "k8s.io/ingress-nginx"}})
        assert await world.served_by("http://other.example/") == "foo-1"
    finally:
        for name in ("default-backend", "empty", "other"):
            await world.delete("Ingress", name)
        await world.delete("IngressClass", "nginx", ns="")


async def test_headers_and_websocket(world: World):
    await world.apply(ingress("ws", [rule("ws.example", path("/", "Prefix", "foo"))]))
    try:
        status, body, _ = await world.curl("http://ws.example:80/h", args=("-H", "X-Forwarded-For: 6.6.6.6"))
        h = {k.lower(): v for k, v in body["headers"].items()}
        from agentd.lab.lab import CLIENT_ADDRESS

        # The client's own address only (a claimed X-Forwarded-For is not trusted), scheme, host, port.
        assert h["x-forwarded-for"] == CLIENT_ADDRESS and h["x-real-ip"] == CLIENT_ADDRESS, h
        assert h["x-forwarded-proto"] == "http" and h["x-forwarded-host"] == "ws.example" and h["x-forwarded-port"] == "80", h
        # WebSocket: the upgrade passes through and the connection carries messages both ways.
        script = (
            "import asyncio, aiohttp, sys\n"
            "async def main():\n"
            "    async with aiohttp.ClientSession() as s:\n"
            f"        async with s.ws_connect('http://{world.node_ips[1]}/chat', headers={{'Host': 'ws.example'}}) as ws:\n"
            "            for m in ('one', 'two'):\n"
            "                await ws.send_str(m)\n"
            "                print((await ws.receive(timeout=10)).data)\n"
            "asyncio.run(main())\n"
        )
        import sys

        rc, out, err = await world.lab.underlay.aexec(sys.executable, "-c", script, check=False, timeout=30)
        assert rc == 0 and out.decode().split("\n")[:2] == ["foo-1: one", "foo-1: two"], (out, err)
    finally:
        await world.delete("Ingress", "ws")


async def test_ingresses_merge_per_host_and_the_oldest_wins(world: World):
    await world.apply(ingress("first", [rule("merge.example", path("/a", "Prefix", "foo"), path("/same", "Prefix", "foo"))]))
    await world.apply(ingress("second", [rule("merge.example", path("/b", "Prefix", "bar"), path("/same", "Prefix", "bar"))]))
    try:
        assert await world.served_by("http://merge.example/a") == "foo-1"
        assert await world.served_by("http://merge.example/b/c") == "bar-1"
        assert await world.served_by("http://merge.example/same") == "foo-1"  # first is older
        conflicts = world.proxy()["conflicts"]
        assert any("shop/second" in c and "/same" in c for c in conflicts), conflicts
    finally:
        await world.delete("Ingress", "first")
        await world.delete("Ingress", "second")
    assert await world.served_by("http://merge.example/same") == 404


async def wrk(world: World, url: str, host: str, seconds: int, connections: int = 8) -> dict[str, int]:
    """wrk from the underlay namespace (keep-alive, ``connections`` connections); its totals.
    A request is a timeout error only after 30 s (wrk's default, 2 s, is reached by chance on
    a machine saturated by a reload or an agent's restart; a request dropped still shows)."""
    rc, out, err = await world.lab.underlay.aexec(
        "wrk", "-t", "2", "-c", str(connections), "-d", f"{seconds}s", "--timeout", "30s", "-H", f"Host: {host}", url,
        check=False, timeout=seconds + 60)  # fmt: skip
    text = out.decode()
    assert rc == 0, (text, err)
    total = int(re.search(r"(\d+) requests in", text).group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    errors = sum(int(x) for x in m.groups()) if m else 0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    return {"requests": total, "errors": errors, "non2xx": int(m.group(1)) if m else 0}


async def test_endpoint_changes_without_reload_and_ingress_change_with_graceful_reload(world: World):
    """Under steady load (wrk, keep-alive): endpoints made not ready, ready, removed and added
    change the proxy's servers through the runtime API: master and worker PIDs unchanged, not a
    request failed.  Then an Ingress change: a new worker (a graceful reload), the master
    unchanged, not a request failed."""
    pods = {n: world.pods[n].ip for n in ("web-1", "web-2", "web-3")}

    def slice_of(ready: dict[str, bool]) -> dict[str, Any]:
        return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "manual-1", "namespace": NS, "labels": {"kubernetes.io/service-name": "manual"}},
                "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}],
                "endpoints": [{"addresses": [pods[n]], "conditions": {"ready": r}} for n, r in ready.items()]}  # fmt: skip

    manual = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "manual", "namespace": NS},
              "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}  # fmt: skip
    await world.apply(manual, slice_of({"web-1": True, "web-2": False}),
                      ingress("load", [rule("load.example", path("/", "Prefix", "manual"))]))
    def requests() -> int:  # node 1's proxy's count of the backend's requests (read from HAProxy every 2 s)
        (b,) = [b for b in world.proxy()["backends"] if b["service"] == "manual"]
        return b["requests"]

    async def loaded(load: asyncio.Future) -> None:
        """Once wrk's requests reach the proxy: what follows happens under load."""
        count = requests()
        await auntil(lambda: requests() > count or load.done(), 15, in_thread=True, what="wrk's requests at the proxy")
        assert not load.done(), load.result()

    try:
        before = [world.proxy(i) for i in range(3)]
        assert all(b["running"] for b in before)
        url = f"http://{world.node_ips[0]}/"
        load = asyncio.ensure_future(wrk(world, url, "load.example", seconds=15))
        await loaded(load)
        steps = [{"web-1": True, "web-2": True}, {"web-1": False, "web-2": True}, {"web-2": True, "web-3": True},
                 {"web-1": True, "web-3": True}]  # fmt: skip
        for ready in steps:
            await world.apply(slice_of(ready))
            want = {f"{pods[n]}:8080" for n, r in ready.items() if r}
            (b,) = [b for b in world.proxy()["backends"] if b["service"] == "manual"]
            assert set(b["servers"]) == want, (b, want)
        assert not load.done(), "wrk was over before the endpoints had all changed"
        served = {await world.served_by("http://load.example/", node=1) for _ in range(12)}
        assert served == {"web-1", "web-3"}, served
        result = await load
        assert result["requests"] > 0 and result["errors"] == 0 and result["non2xx"] == 0, result
        after = [world.proxy(i) for i in range(3)]
        for b, a in zip(before, after):
            assert (a["pid"], a["worker"], a["reloads"]) == (b["pid"], b["worker"], b["reloads"]), (b, a)
            assert a["runtime_changes"] > b["runtime_changes"]
        # An Ingress change: a graceful reload, nothing dropped.
        load = asyncio.ensure_future(wrk(world, url, "load.example", seconds=12))
        await loaded(load)
        await world.apply(ingress("load", [rule("load.example", path("/", "Prefix", "manual"), path("/new", "Exact", "foo"))]))
        assert await world.served_by("http://load.example/new") == "foo-1"
        assert not load.done(), "wrk was over before the reload was done"
        result = await load
        assert result["requests"] > 0 and result["errors"] == 0 and result["non2xx"] == 0, result
        reloaded = [world.proxy(i) for i in range(3)]
        for a, r in zip(after, reloaded):
            assert r["pid"] == a["pid"] and r["worker"] != a["worker"] and r["reloads"] == a["reloads"] + 1, (a, r)
    finally:
        await world.delete("Ingress", "load")
        await world.delete("Service", "manual")
        await world.delete("EndpointSlice", "manual-1")


def proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


async def test_the_workers_run_as_the_ingress_user_without_capabilities(world: World):
    """HAProxy's workers (which parse the requests) run as ``[ingress] user`` (haproxy, the
    lab's default) with no capability at all, as ingress-nginx's nginx runs as uid 101; the
    master stays root, and a reload's new worker is the user's too.  The workers reach the
    access log's socket through the group of the proxy's directory."""
    import os
    import pwd
    import stat

    user = pwd.getpwnam("haproxy")
    node = world.lab.nodes[0]
    ingress_dir = node.dir / "state" / "ingress"
    await world.apply(ingress("whoami", [rule("whoami.example", path("/", "Prefix", "foo"))]))
    try:
        before = world.proxy(0)
        for pid in (before["worker"],):
            st = proc_status(pid)
            assert st["Uid"].split() == [str(user.pw_uid)] * 4 and st["Gid"].split() == [str(user.pw_gid)] * 4, st
            assert st["Groups"] == "", st  # the agent's supplementary groups dropped
            for caps in ("CapEff", "CapPrm", "CapAmb", "CapInh"):
                assert int(st[caps], 16) == 0, (caps, st)
        master = proc_status(before["pid"])
        assert master["Uid"].split()[0] == "0" and int(master["CapEff"], 16) != 0, master
        d = ingress_dir.stat()
        assert stat.S_IMODE(d.st_mode) == 0o710 and d.st_gid == user.pw_gid, oct(d.st_mode)
        sock = (ingress_dir / "log.sock").stat()
        assert stat.S_IMODE(sock.st_mode) == 0o622, oct(sock.st_mode)  # only root and the group reach it
        for name in ("haproxy.cfg", "default.pem", "admin.sock", "master.sock"):
            assert stat.S_IMODE((ingress_dir / name).stat().st_mode) == 0o600, name
        assert stat.S_IMODE((ingress_dir / "certs").stat().st_mode) == 0o700
        cfg = (ingress_dir / "haproxy.cfg").read_text()
        assert "    user haproxy\n    group haproxy\n" in cfg, cfg.split("defaults")[0]
        # A reload: the new worker is the user's too, and it serves.
        await world.apply(ingress("whoami", [rule("whoami.example", path("/", "Prefix", "foo"), path("/b", "Exact", "bar"))]))
        assert await world.served_by("http://whoami.example/b") == "bar-1"
        after = world.proxy(0)
        assert after["worker"] != before["worker"] and after["pid"] == before["pid"], (before, after)
        st = proc_status(after["worker"])
        assert st["Uid"].split()[0] == str(user.pw_uid) and int(st["CapEff"], 16) == 0, st
        assert os.stat(f"/proc/{after['worker']}").st_uid == user.pw_uid
    finally:
        await world.delete("Ingress", "whoami")


class SteadyLoad:
    """wrk from the underlay namespace for as long as it takes (keep-alive), stopped with
    SIGINT, which makes wrk print its totals.  Its timeout is 30 s, as wrk()'s."""

    def __init__(self, world: World, url: str, host: str) -> None:
        self.world, self.url, self.host = world, url, host
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> SteadyLoad:
        self.proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", self.world.lab.underlay.name, "wrk", "-t", "2", "-c", "8", "-d", "300s",
            "--timeout", "30s", "-H", f"Host: {self.host}", self.url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)  # fmt: skip
        await auntil(lambda: self.proc.pid in self.world.lab.underlay.pids(), 10, what="wrk to start")
        return self

    async def stop(self) -> dict[str, int]:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(self.proc.communicate(), 30)
        text = out.decode()
        assert "requests in" in text, (text, err.decode())
        total = int(re.search(r"(\d+) requests in", text).group(1))
        m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
        m2 = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
        return {"requests": total, "errors": sum(int(x) for x in m.groups()) if m else 0, "non2xx": int(m2.group(1)) if m2 else 0}

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def ingress_back_on(world: World, node: Any) -> None:
    """``node``'s agent running with the ingress on and its proxy serving, as the module's
    lab was set up: after a test that stops, restarts or reconfigures that agent, pass or fail."""
    world.lab.spec.extra.pop(node.name, None)
    if (node.api_or_none("/ingress") or {}).get("running"):
        return
    try:
        await node.stop_agent(signal.SIGTERM)
    except LabError:  # it did not exit: it goes anyway
        await node.stop_agent(signal.SIGKILL)
    node.start_agent()
    await auntil(lambda: (node.api_or_none("/ingress") or {}).get("running"), 60, what=f"{node.name}'s proxy to serve again")


async def test_the_proxy_outlives_agent_restarts(world: World):
    """The agent killed (SIGKILL), then stopped (SIGTERM), and started again each time, under
    steady load through its node's ingress: the proxy serves all along (not a request failed),
    the new agent adopts it (master and worker PIDs and reloads unchanged: no reload, the
    configuration it renders is the one running), and an endpoint change after the restart
    goes through the runtime API."""
    node = world.lab.nodes[1]
    pods = {n: world.pods[n].ip for n in ("web-1", "web-2", "web-3")}

    def slice_of(*ready: str) -> dict[str, Any]:
        return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "steady-1", "namespace": NS, "labels": {"kubernetes.io/service-name": "steady"}},
                "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}],
                "endpoints": [{"addresses": [ip], "conditions": {"ready": n in ready}} for n, ip in pods.items()]}  # fmt: skip

    steady = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "steady", "namespace": NS},
              "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}  # fmt: skip
    await world.apply(steady, slice_of("web-1", "web-2"), ingress("steady", [rule("steady.example", path("/", "Prefix", "steady"))]))
    try:
        before = world.proxy(1)
        for sig, ready in ((signal.SIGKILL, ("web-1", "web-3")), (signal.SIGTERM, ("web-2", "web-3"))):
            async with SteadyLoad(world, f"http://{node.address}/", "steady.example") as load:
                await node.stop_agent(sig)
                assert before["pid"] in node.ns.pids() and before["worker"] in node.ns.pids()  # no agent, still serving
                node.start_agent()
                await auntil(lambda: (node.api_or_none("/ingress") or {}).get("running"), 60, what="node2's agent to adopt its proxy")
                adopted = world.proxy(1)
                assert (adopted["pid"], adopted["worker"], adopted["reloads"]) == (before["pid"], before["worker"], before["reloads"]), (before, adopted)
                assert adopted["adopted"] and abs(adopted["started_at"] - before["started_at"]) < 2, (before, adopted)
                await world.apply(slice_of(*ready))
                (b,) = [b for b in world.proxy(1)["backends"] if b["service"] == "steady"]
                assert set(b["servers"]) == {f"{pods[n]}:8080" for n in ready}, b
                served = {await world.served_by("http://steady.example/", node=1) for _ in range(8)}
                assert served <= set(ready), served  # never a pod that is not ready
                result = await load.stop()
            assert result["requests"] > 0 and result["errors"] == 0 and result["non2xx"] == 0, (sig, result)
            # Every ready pod gets its turn.  Asked once the load is gone: round robin goes
            # through the servers in turn over all requests, and under wrk's the few of curl
            # can all land on the same one.
            served = {await world.served_by("http://steady.example/", node=1) for _ in range(8)}
            assert served == set(ready), (served, world.proxy(1)["proxy_servers"].get(b["name"]))
            after = world.proxy(1)
            assert (after["pid"], after["worker"], after["reloads"]) == (before["pid"], before["worker"], before["reloads"]), (before, after)
            assert after["runtime_changes"] > 0 and after["last_change"]["how"] == "runtime", after
        # An agent started with the ingress switched off stops the proxy it finds and removes
        # its files; switched on again, it starts a new one.
        ingress_dir = node.dir / "state" / "ingress"
        world.lab.spec.extra["node2"] = {"ingress": {"enabled": False}}
        await node.stop_agent(signal.SIGTERM)
        node.start_agent()
        await auntil(lambda: not ingress_dir.exists(), 60, what="node2's agent to remove the proxy it does not run")
        assert before["pid"] not in node.ns.pids() and before["worker"] not in node.ns.pids()
        del world.lab.spec.extra["node2"]
        await node.stop_agent(signal.SIGTERM)
        node.start_agent()
        await auntil(lambda: (node.api_or_none("/ingress") or {}).get("running"), 60, what="node2's proxy to start again")
        assert world.proxy(1)["pid"] != before["pid"]
    finally:
        await ingress_back_on(world, node)  # whatever failed: the next tests share this lab
        await world.delete("Ingress", "steady")
        await world.delete("Service", "steady")
        await world.delete("EndpointSlice", "steady-1")


async def test_a_crashed_proxy_is_started_again(world: World):
    await world.apply(ingress("crash", [rule("crash.example", path("/", "Prefix", "foo"))]))
    try:
        node = world.lab.nodes[2]
        before = world.proxy(2)
        import os

        os.kill(before["pid"], signal.SIGKILL)

        def back() -> bool:
            now = node.api_or_none("/ingress") or {}
            # Started (a new master) and configured again (the error of its exit is cleared then).
            return bool(now.get("running")) and now.get("pid") not in (None, before["pid"]) and now.get("error") is None

        await auntil(back, 30, what="node3's proxy to be started again")
        # The killed master's worker is gone too: the new one alone answers, at once.
        assert before["worker"] not in node.ns.pids()
        assert await world.served_by("http://crash.example/", node=2) == "foo-1"
        now = world.proxy(2)
        assert now["restarts"] == before["restarts"] + 1
        status = node.api("/status")["ingress"]
        assert status["running"] and status["restarts"] == now["restarts"]
        rc, out, _ = await node.ns.aexec(binary("agentd"), "status", check=False)
        assert rc == 0 and "Ingress on" in out.decode() and f"restarts {now['restarts']}" in out.decode(), out
    finally:
        await world.delete("Ingress", "crash")


# In a node's namespace: take the ingress's HTTP port (no SO_REUSEPORT, so HAProxy cannot bind
# it beside) the moment the proxy's master is killed, before the agent starts it again; hold it
# until stdin closes.
SQUAT = """
import os, signal, socket, sys, time
address, pid = sys.argv[1], int(sys.argv[2])
os.kill(pid, signal.SIGKILL)
deadline = time.monotonic() + 10
while True:
    s = socket.socket()
    try:
        s.bind((address, 80))
        s.listen()
        break
    except OSError:
        s.close()
        if time.monotonic() > deadline:
            sys.exit("the port never came free")
        time.sleep(0.0005)
print("held", flush=True)
sys.stdin.read()
"""


async def test_a_node_whose_proxy_cannot_start_is_out_of_the_status(world: World):
    """node3's proxy killed and its port taken before the agent could start it again: node3
    leaves the Ingresses' status (`agentd get ingress`, status.loadBalancer) while its proxy
    does not run, and is back once it runs again."""
    await world.apply(ingress("squat", [rule("squat.example", path("/", "Prefix", "foo"))]))
    node1, node3 = world.lab.nodes[0], world.lab.nodes[2]
    env = f"AGENTD_CONFIG={node1.config_path}"

    async def listed() -> list[str]:
        rc, out, err = await node1.ns.aexec("env", env, binary("agentd"), "get", "ingress", "shop/squat", "-o", "json",
                                            check=False)  # fmt: skip
        assert rc == 0, err
        return [e["ip"] for e in json.loads(out)["status"]["loadBalancer"].get("ingress", [])]

    squat = None
    try:
        await auntil(lambda: listed(), 20, what="every node in shop/squat's status")
        assert await listed() == world.node_ips
        before = world.proxy(2)
        squat = node3.ns.popen([sys.executable, "-c", SQUAT, world.node_ips[2], str(before["pid"])],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert (await asyncio.to_thread(squat.stdout.readline)).strip() == "held"
        await auntil(lambda: "proxy not started" in ((node3.api_or_none("/ingress") or {}).get("error") or ""), 30,
                     in_thread=True, what="node3's proxy failing to start")  # fmt: skip

        async def without_node3() -> bool:
            return await listed() == world.node_ips[:2]

        await auntil(without_node3, 30, what="shop/squat's status without node3")
        squat.stdin.close()
        squat.wait(10)

        async def with_node3() -> bool:
            return await listed() == world.node_ips

        await auntil(with_node3, 30, what="node3 back in shop/squat's status once its proxy runs")
        assert await world.served_by("http://squat.example/", node=2) == "foo-1"
    finally:
        if squat is not None:
            if squat.poll() is None:
                squat.kill()
                squat.wait()
            for pipe in (squat.stdin, squat.stdout):
                if pipe is not None and not pipe.closed:
                    pipe.close()
        await world.delete("Ingress", "squat")


async def test_status_metrics_and_get_ingress(world: World):
    await world.apply(ingress("shown", [rule("shown.example", path("/", "Prefix", "bar"))]))
    try:
        for _ in range(5):
            assert await world.served_by("http://shown.example/") == "bar-1"
        node1 = world.lab.nodes[0]

        def counted() -> bool:
            text = node1.ns.http_get(API_URL + "/metrics")[1].decode()
            m = re.search(r'agentd_ingress_requests_total\{code="2xx",ingress="shown",namespace="shop",port="[^"]*",service="bar"\} (\S+)', text)
            return m is not None and float(m.group(1)) >= 5

        await auntil(counted, 20, what="node1's request counter of shop/shown")
        text = node1.ns.http_get(API_URL + "/metrics")[1].decode()
        assert "agentd_ingress_proxy_up 1.0" in text
        env = f"AGENTD_CONFIG={node1.config_path}"
        rc, out, err = await node1.ns.aexec("env", env, binary("agentd"), "get", "ingress", "-n", NS, check=False)
        assert rc == 0, err
        (row,) = [line for line in out.decode().splitlines() if " shown " in f" {line} "]
        assert ",".join(world.node_ips) in row and "shown.example" in row and "agentd" in row, out.decode()
        rc, out, err = await node1.ns.aexec("env", env, binary("agentd"), "get", "ingress", "shop/shown", "-o", "json", check=False)
        lb = json.loads(out)["status"]["loadBalancer"]["ingress"]
        assert [e["ip"] for e in lb] == world.node_ips
    finally:
        await world.delete("Ingress", "shown")


async def test_bad_manifests_are_refused_with_one_line(world: World):
    node1 = world.lab.nodes[0]
    env = f"AGENTD_CONFIG={node1.config_path}"
    bad = {
        "path.yaml": (ingress("bad", [rule("x.example", {"path": "/a", "backend": backend("foo")})]),
                      "spec.rules[0].http.paths[0].pathType: Required value"),
        "host.yaml": (ingress("bad", [rule("*.*.example", path("/", "Prefix", "foo"))]), "spec.rules[0].host: Invalid value"),
        "both.yaml": (ingress("bad", [rule("x.example", {"path": "/", "pathType": "Prefix", "backend": {
            **backend("foo"), "resource": {"kind": "Bucket", "name": "b"}}})]), "cannot set both resource and service backends"),
        "key.yaml": (tls_secret("bad", ["x.example"], world.ca_pair, wrong_key=True), "does not match the certificate"),
        "cm.yaml": ({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "agentd-ingress", "namespace": "kube-system"},
                     "data": {"proxy-body-size": "lots"}}, "data[proxy-body-size]: Invalid value"),
    }  # fmt: skip
    for name, (doc, want) in bad.items():
        f = world.tmp / name
        f.write_text(json.dumps(doc))
        rc, out, err = await node1.ns.aexec("env", env, binary("agentd"), "apply", "-f", str(f), check=False)
        lines = err.decode().strip().splitlines()
        assert rc == 1 and len(lines) == 1 and want in lines[0] and "Traceback" not in err.decode(), (name, err)
    assert await world.res.get("Ingress", NS, "bad") is None and await world.res.get("Secret", NS, "bad") is None


async def test_settings_from_the_configmap(world: World):
    await world.apply(ingress("cfg", [rule("cfg.example", path("/", "Prefix", "foo"))]),
                      {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "agentd-ingress", "namespace": "kube-system"},
                       "data": {"proxy-body-size": "1k", "frontend-snippet": "http-response set-header X-Served-By agentd",
                                "enable-access-log": "true"}})  # fmt: skip
    try:
        status, _, headers = await world.curl("http://cfg.example/", args=("--data-binary", "x" * 2048))
        assert status == 413
        status, body, headers = await world.curl("http://cfg.example/logged", args=("--data-binary", "x" * 100))
        assert status == 200 and body["pod"] == "foo-1" and headers["x-served-by"] == "agentd"
        # The access log: HAProxy's line (httplog) through the agent's socket into the agent's log.
        log_path = world.lab.nodes[0].log_path

        def logged() -> bool:
            return any("agentd.ingress.access" in ln and "ing.shop.cfg.foo.80" in ln and "POST /logged" in ln
                       for ln in log_path.read_text(errors="replace").splitlines())  # fmt: skip

        await auntil(logged, 20, what="the access log line of POST /logged in node1's agent log")
        # Settings HAProxy refuses (a fetch it does not know): the last ones it accepted stay,
        # and as that is the configuration the proxy runs, it is not reloaded.
        before = world.proxy(1)
        await world.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "agentd-ingress", "namespace": "kube-system"},
                           "data": {"proxy-body-size": "1k", "frontend-snippet": "http-response set-header X-Served-By %[nosuchfetch]"}})  # fmt: skip
        assert "HAProxy refused the settings" in (world.proxy()["settings_error"] or ""), world.proxy()
        status, _, headers = await world.curl("http://cfg.example/", args=("--data-binary", "x" * 2048))
        assert status == 413
        status, body, headers = await world.curl("http://cfg.example/", args=("--data-binary", "x" * 100))
        assert status == 200 and headers["x-served-by"] == "agentd"
        await auntil(lambda: "HAProxy refused the settings" in (world.proxy(1)["settings_error"] or ""), 20,
                     what="node2 to refuse the settings")  # fmt: skip
        now = world.proxy(1)
        assert (now["pid"], now["worker"], now["reloads"]) == (before["pid"], before["worker"], before["reloads"]), (before, now)
        # An agent restarted meanwhile finds the refused settings again, falls back to those the
        # proxy runs with (loaded.json) and adopts the proxy without a reload.
        node = world.lab.nodes[1]
        try:
            await node.stop_agent(signal.SIGTERM)
            node.start_agent()
            await auntil(lambda: (node.api_or_none("/ingress") or {}).get("running"), 60, what="node2's agent to adopt its proxy")

            def synced() -> bool:  # its first sync done (the revision is set at its end)
                p = world.proxy(1)
                return "HAProxy refused the settings" in (p["settings_error"] or "") and p["revision"] >= now["revision"]

            await auntil(synced, 30, what="node2's new agent to refuse the settings and apply the revision")
            adopted = world.proxy(1)
            assert adopted["adopted"], adopted
            assert (adopted["pid"], adopted["worker"], adopted["reloads"]) == (now["pid"], now["worker"], now["reloads"]), (now, adopted)
            status, body, headers = await world.curl("http://cfg.example/", node=1, args=("--data-binary", "x" * 100))
            assert status == 200 and headers["x-served-by"] == "agentd"
        finally:
            await ingress_back_on(world, node)
    finally:
        await world.delete("ConfigMap", "agentd-ingress", ns="kube-system")
        await world.delete("Ingress", "cfg")


async def test_access_log_to_a_file_or_off(world: World):
    """[ingress] access_log on node2: a file gets each request's line through the real HAProxy
    (and the agent's log none), a new file once logrotate renamed it away, and on SIGHUP the
    renamed one is closed at once; "off": HAProxy is told not to log, no line anywhere."""
    node = world.lab.nodes[1]
    access = world.tmp / "node2-access.log"
    rev = await world.apply(ingress("alog", [rule("alog.example", path("/", "Prefix", "foo"))]),
                            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "agentd-ingress", "namespace": "kube-system"},
                             "data": {"enable-access-log": "true"}})  # fmt: skip

    async def restart_with(value: str | None) -> None:
        if value is None:
            world.lab.spec.extra.pop(node.name, None)
        else:
            world.lab.spec.extra[node.name] = {"ingress": {"access_log": value}}
        await node.stop_agent(signal.SIGTERM)
        node.start_agent()
        await auntil(lambda: (node.api_or_none("/ingress") or {}).get("running"), 60, what=f"node2's proxy with access_log {value}")
        await world.converged(rev)

    def lines(p: Path, what: str) -> list[str]:
        return [ln for ln in p.read_text(errors="replace").splitlines() if what in ln] if p.exists() else []

    def agent_log(what: str) -> list[str]:
        return [ln for ln in node.log_path.read_text(errors="replace").splitlines() if what in ln]

    async def get(path: str) -> None:
        status, body, _ = await world.curl(f"http://alog.example{path}", node=1)
        assert status == 200 and body["pod"] == "foo-1", (status, body)

    try:
        await restart_with(str(access))
        await get("/to-file")
        await auntil(lambda: lines(access, "GET /to-file"), 20, what="the line of GET /to-file in the access log file")
        (line,) = lines(access, "GET /to-file")
        assert "ing.shop.alog.foo.80" in line, line  # HAProxy's httplog line: frontend, backend/server, request
        assert not agent_log("/to-file"), agent_log("/to-file")
        # logrotate's "create": the file renamed away, the next line (past the writer's 1 s
        # look at the path) goes to a new file at the path.
        rotated = access.with_name("node2-access.log.1")
        access.rename(rotated)
        await asyncio.sleep(1.2)
        await get("/after-rename")
        await auntil(lambda: lines(access, "GET /after-rename"), 20, what="GET /after-rename in a new file at the path")
        assert lines(rotated, "GET /to-file") and not lines(rotated, "/after-rename")
        # SIGHUP (logrotate's postrotate): the renamed file is closed at once, the next line
        # opens the path again, however soon it comes.
        rotated2 = access.with_name("node2-access.log.2")
        access.rename(rotated2)
        pid = node.agent_pid()
        assert pid is not None

        def holds(p: Path) -> bool:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    if fd.readlink() == p:
                        return True
                except OSError:  # closed meanwhile
                    pass
            return False

        assert holds(rotated2)
        node.signal_agent(signal.SIGHUP)
        await auntil(lambda: not holds(rotated2), 10, what="node2's agent to close the renamed access log on SIGHUP")
        await get("/after-hup")
        await auntil(lambda: lines(access, "GET /after-hup"), 20, what="GET /after-hup in the file opened again")
        assert not lines(rotated2, "/after-hup") and not agent_log("/after-")
        # "off": no log in HAProxy's configuration, and no line of a request anywhere.
        await restart_with("off")
        cfg = (node.dir / "state" / "ingress" / "haproxy.cfg").read_text()
        assert "    no log" in cfg and "log.sock" not in cfg, cfg
        await get("/not-logged")
        await get("/after-hup")  # (a line of this one would come after that of /not-logged)
        await asyncio.sleep(2)
        for p in (access, rotated, rotated2):
            assert not lines(p, "/not-logged"), p
        assert not agent_log("/not-logged")
        assert len(lines(access, "GET /after-hup")) == 1
    finally:
        await restart_with(None)
        await world.delete("ConfigMap", "agentd-ingress", ns="kube-system")
        await world.delete("Ingress", "alog")


async def test_leave_stops_the_proxy_and_leaves_nothing(world: World):  # last: node3 goes
    node3 = world.lab.nodes[2]
    pid = world.proxy(2)["pid"]
    ingress_dir = node3.dir / "state" / "ingress"
    assert ingress_dir.exists()
    await node3.leave()
    await auntil(lambda: node3.agent_pid() is None, 30, what="node3's agent to exit")
    assert pid not in node3.ns.pids() and not ingress_dir.exists()
    rc, _, err = await world.lab.underlay.aexec("curl", "-sS", "--max-time", "3", f"http://{node3.address}/", check=False)
    assert rc != 0  # nothing listens there any more
    res = await world.res.call({"op": "ingress_nodes"})
    assert sorted(r["node"] for r in res) == ["node1", "node2"]


# ---------------------------------------------------------------- the other backends


@pytest.mark.parametrize(("backend_name", "ip_family"), [("vxlan", "ipv4"), ("udp", "ipv4"), ("ipip", "ipv4"), ("host-gw", "dual")])
async def test_served_through_the_ingress_on_every_backend(backend_name, ip_family, tmp_path_factory):
    """The proxy on node1 reaches pods on node2 through the backend's tunnel (the pod network
    carries the proxy's connections to pods like any node's).  Dual-stack: a Service whose
    primary family is IPv6 is served by its pods' IPv6 addresses, and the ingress answers on
    the nodes' IPv6 addresses as on their IPv4 ones."""
    spec = LabSpec(name="ib" + unique_tag("")[:6], nodes=2, pods=0, backend=backend_name, ingress=True, ip_family=ip_family)
    lab = Lab(spec, root=tmp_path_factory.mktemp("labs"))
    w = World(lab, tmp_path_factory.mktemp("ingress"))
    make_ca(w.tmp)
    echo = []
    try:
        await lab.up(timeout=90)
        pod = await lab.add_pod(lab.nodes[1], NS, "far-1", labels={"app": "far"}, ports=HTTP)
        echo.append(await HttpEcho.start(pod, "far-1", [8080]))
        w.res = await lab.resources()
        svc = service("far", "far")
        if ip_family == "dual":
            svc["spec"].update(ipFamilyPolicy="RequireDualStack", ipFamilies=["IPv6", "IPv4"])
        await w.apply(CLASS, svc, ingress("far", [rule("far.example", path("/", "Prefix", "far"))]))
        for node in (0, 1):
            assert await w.served_by("http://far.example/", node=node) == "far-1"
        if ip_family == "dual":
            (b,) = w.proxy(0)["backends"]
            assert b["servers"] == [f"[{pod.address(6)}]:8080"], b
            for node in (0, 1):
                status, body, _ = await w.curl("http://far.example/", node=node, family=6)
                assert status == 200 and body["pod"] == "far-1", (status, body)
                # The pod saw the proxy's IPv6 address; the client's is in X-Forwarded-For.
                assert body["headers"]["X-Forwarded-For"] == CLIENT_ADDRESS_V6, body
    finally:
        for e in echo:
            e.close()
        if w.res is not None:
            await w.res.close()
        await lab.down(keep_files=True)
