"""Which backend answers a request: the Kubernetes Ingress rules as one routing table.  Pure.

:func:`build` turns the Ingresses this controller serves (:func:`ours`) into a
:class:`RouteTable`; :meth:`RouteTable.route` is the reference answer for one request
(host, path), and :mod:`agentd.ingress.haproxy` renders the same table as HAProxy maps
(tests/unit/agentd/test_ingress_routing.py holds the two equal).

The semantics are the Ingress API's (networking.k8s.io/v1, "Ingress" in the Kubernetes
docs; the ingress-controller-conformance host_rules, path_rules and default_backend
features):

* **Host.**  A request's host (the Host header, port and case dropped) picks one virtual
  host: the rules whose ``host`` is exactly it; else those whose host is ``*.`` + its parent
  domain (a wildcard covers exactly ONE label: ``*.foo.com`` matches ``bar.foo.com``, not
  ``foo.com`` nor ``baz.bar.foo.com``); else the rules without a host.  Once a virtual host
  is picked, only its rules apply (as in ingress-nginx: ``server_name`` first, then
  ``location``).
* **Path.**  ``Exact`` matches the path exactly, case-sensitively.  ``Prefix`` matches
  element by element on ``/``: ``/foo`` (and ``/foo/``) match ``/foo``, ``/foo/`` and
  ``/foo/bar``, never ``/foobar``; ``/`` matches every path.  ``ImplementationSpecific`` is
  agentd's choice, documented: it is ``Prefix``.  Of the paths that match, the longest wins
  (its length without a trailing slash); at equal length ``Exact`` beats ``Prefix``.  The
  query string is not part of the path.  The request's path is matched as ingress-nginx
  (nginx) matches its ``location``s: normalised first (:func:`normalise_path`: percent-decoded,
  ``//`` merged, ``.`` and ``..`` segments resolved), so ``/%61pi``, ``/a%2Fb`` and
  ``/x/../api`` are ``/api``, ``/a/b`` and ``/api``; a rule's path is taken as written (its
  UTF-8 bytes), so ``/a b`` matches ``/a%20b`` and ``/café`` matches ``/caf%C3%A9``.
* **Merging.**  Every Ingress of ours adds its rules.  Two rules for the same host, the same
  match kind and the same path conflict: the one of the OLDEST Ingress (creationTimestamp,
  then namespace/name) wins, as in ingress-nginx; the loser is listed in ``conflicts``.
* **Default backend.**  A request no rule matches goes to the ``defaultBackend`` of the
  oldest Ingress of its virtual host that has one, else to the ``defaultBackend`` of the
  oldest Ingress of ours that has one, else to the built-in default backend: 404.
* **TLS.**  ``tls[]`` entries give each host its Secret (SNI); a host named by several
  Ingresses takes the oldest one's.  An entry without ``hosts`` stands for the hosts of its
  own Ingress's rules that its certificate covers (:func:`covers`) and no other entry of
  that Ingress names, as in ingress-nginx -- never for the rules without a host (those, and
  any host no Ingress gives a certificate, get the controller's default certificate, not an
  Ingress's).  Plain-HTTP requests for a TLS host are redirected to
  HTTPS (308) unless switched off (ConfigMap ``ssl-redirect``, Ingress annotation
  ``ingress.agentd.io/ssl-redirect``) -- also when its Secret is missing or unusable (or
  the entry names none): it is then served with the default certificate, as in ingress-nginx.

A backend is one (Ingress, Service, port): its requests are counted per Ingress.
"""

from __future__ import annotations

import calendar
import re
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


Obj = Mapping[str, Any]

NOT_FOUND = "default-404"  # the built-in default backend
ANY_HOST = "_"  # the virtual host of the rules without a host (never a valid DNS name)
REDIRECT_ANNOTATION = "ingress.agentd.io/ssl-redirect"


@dataclass(frozen=True)
class Backend:
    """Requests of one Ingress to one Service port (``port``: a number or a port name; for
    a ``resource`` backend ``service`` is None: agentd does not serve those, they answer 503)."""

    namespace: str
    ingress: str
    service: str | None
    port: int | str | None

    @property
    def name(self) -> str:
        """The HAProxy backend name: dots between parts no part of it can contain but the
        Ingress name (a DNS subdomain), which sits between two that cannot."""
        if self.service is None:
            return f"ing.{self.namespace}.{self.ingress}.-resource"
        return f"ing.{self.namespace}.{self.ingress}.{self.service}.{self.port}"


@dataclass(frozen=True)
class Rule:
    path: str  # as written; "/" when none is named
    path_type: str
    backend: str  # Backend.name
    ingress: tuple[str, str]

    @property
    def exact(self) -> bool:
        return self.path_type == "Exact"

    @property
    def key(self) -> bytes:
        """The path as it is compared with a normalised request path: its UTF-8 bytes, taken
        literally (nginx compares a ``location`` as written with the decoded URI)."""
        return self.path.encode("utf-8", "surrogatepass")

    @property
    def stem(self) -> bytes:
        """What a Prefix rule matches on: the path without its trailing slash (b"" for "/")."""
        return self.key if self.exact else self.key.rstrip(b"/")

    def matches(self, path: bytes) -> bool:
        if self.exact:
            return path == self.key
        return path == self.stem or path.startswith(self.stem + b"/")

    @property
    def rank(self) -> tuple[int, int]:
        """Sort key: longest first, then Exact before Prefix."""
        return (-len(self.stem), 0 if self.exact else 1)


@dataclass
class VirtualHost:
    host: str  # exact, "*.parent", or ANY_HOST
    rules: list[Rule] = field(default_factory=list)  # sorted by rank
    default: str | None = None  # backend name

    def route(self, path: bytes) -> Rule | None:
        for rule in self.rules:
            if rule.matches(path):
                return rule
        return None


@dataclass(frozen=True)
class TlsHost:
    host: str  # exact or "*.parent" (an entry without hosts: one per rule host of its Ingress its certificate covers)
    secret: tuple[str, str] | None  # (namespace, name); None: the entry names none (the default certificate)
    ingress: tuple[str, str]
    redirect: bool


@dataclass
class RouteTable:
    vhosts: dict[str, VirtualHost] = field(default_factory=dict)
    backends: dict[str, Backend] = field(default_factory=dict)
    default: str = NOT_FOUND
    tls: list[TlsHost] = field(default_factory=list)
    ingresses: list[tuple[str, str]] = field(default_factory=list)  # ours, oldest first
    conflicts: list[str] = field(default_factory=list)
    # Secrets of ``tls[]`` entries without hosts that stand for no host (their Secret unusable,
    # or its certificate naming none of their Ingress's rule hosts): said, not silently dropped.
    hostless: list[tuple[str, str]] = field(default_factory=list)

    def vhost_for(self, host: str) -> VirtualHost | None:
        host = normalise_host(host)
        if host in self.vhosts:
            return self.vhosts[host]
        label, dot, parent = host.partition(".")
        if label and dot and f"*.{parent}" in self.vhosts:
            return self.vhosts[f"*.{parent}"]
        return self.vhosts.get(ANY_HOST)

    def route(self, host: str, path: str) -> str:
        """The backend name a request for ``host`` (the Host header's value, whole) and
        ``path`` (as sent, without the query) goes to; :data:`BAD_REQUEST` for a Host with a
        ``,`` (several values) or a ``/`` (a path in it), or a path :func:`normalise_path`
        refuses."""
        if "," in host or "/" in host:
            return BAD_REQUEST
        normal = normalise_path(path)
        if normal is None:
            return BAD_REQUEST
        vhost = self.vhost_for(host)
        if vhost is None:
            return self.default
        rule = vhost.route(normal)
        if rule is not None:
            return rule.backend
        return vhost.default or self.default

    def redirects(self, host: str) -> bool:
        """Whether a plain-HTTP request for ``host`` is redirected to HTTPS."""
        host = normalise_host(host)
        label, dot, parent = host.partition(".")
        names = {host, f"*.{parent}"} if label and dot else {host}
        return any(t.redirect and t.host in names for t in self.tls)


def normalise_host(host: str) -> str:
    """The Host header as matched: lower case, without a port, without the final dot of a
    fully qualified name (``shop.example.`` is ``shop.example``, as nginx takes it)."""
    if host.startswith("["):  # an IPv6 literal: no rule can name it
        return host.lower()
    host = host.partition(":")[0].lower()
    return host[:-1] if host.endswith(".") else host


# The request path's normalisation, as nginx does it before it matches a ``location``
# (ngx_http_parse_complex_uri): percent-decode it once, merge slashes, resolve dot segments
# (RFC 3986 section 5.2.4).  Written as the regular expressions HAProxy's ``regsub`` runs on
# every request (agentd.ingress.haproxy renders these same patterns; Python's re and PCRE2
# read them alike), so this reference and the proxy cannot drift apart.
# The end of the path: "(?![\s\S])", not "$", which in both engines also matches before a
# final newline ("/admin/..%0A" would lose "/admin"; nginx keeps "..\n" a segment of its own).
END = r"(?![\s\S])"
NEEDS_NORMALISING = r"//|/\.\.?(/|" + END + ")"  # a path without these is already normal
NORMALISE = (
    ("//+", "/", True),  # merge slashes
    (r"(/\.\.?)" + END, r"\1/", False),  # a final "." or ".." ends in a slash ("/a/.." is "/a/")
    (r"/\.(?=/)", "", True),  # "/./" is "/"
) + ((r"/(?!\.\.?/)[^/]+/\.\.(?=/)", "", True),) * 8  # "/seg/../" is "/": one level of nesting a pass
BAD_REQUEST = "400"  # what a path that climbs above the root (or %00, or a bad escape) gets, as from nginx
_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")


def normalise_path(raw: str) -> bytes | None:
    """The path a request is routed by: percent-decoded, ``//`` merged, ``.`` and ``..``
    resolved (``/%61pi`` and ``/x/%2E%2E/api`` are ``/api``; ``/a%2Fb`` is ``/a/b``: nginx
    decodes ``%2F`` too).  None when nginx answers 400: a ``%`` not followed by two hex
    digits, ``%00``, or a ``..`` above the root (also past eight nested levels, where the
    proxy's fixed number of passes ends)."""
    data = raw.encode("utf-8", "surrogatepass")
    if b"%00" in data or data.count(b"%") != len(_ESCAPE.findall(data)):
        return None
    text = _ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), data).decode("latin-1")
    if re.search(NEEDS_NORMALISING, text):
        for pattern, replacement, every in NORMALISE:
            text = re.sub(pattern, replacement, text, count=0 if every else 1)
        if "/../" in text:
            return None
    return text.encode("latin-1")


def age_key(obj: Obj) -> tuple[float, str, str]:
    """Oldest first: creationTimestamp, then namespace/name (deterministic for equal stamps)."""
    meta = obj["metadata"]
    try:
        created = float(calendar.timegm(time.strptime(meta.get("creationTimestamp", ""), "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        created = float("inf")
    return (created, meta.get("namespace", ""), meta["name"])


def _backend(ns: str, name: str, spec: Obj) -> Backend:
    svc = spec.get("service")
    if svc is None:
        return Backend(ns, name, None, None)
    port = svc["port"]
    return Backend(ns, name, svc["name"], port.get("number") or port.get("name"))


def build(ingresses: Iterable[Obj], *, ssl_redirect: bool = True,
          usable: Callable[[tuple[str, str]], bool] = lambda secret: True,
          cert_names: Callable[[tuple[str, str]], Collection[str]] = lambda secret: ()) -> RouteTable:
    """The routing table of ``ingresses`` (those this controller serves).  ``usable(secret)``:
    whether a TLS Secret can serve (it exists, is kubernetes.io/tls, loads): a host's older
    Ingress whose Secret cannot does not keep a newer one's usable Secret from it.
    ``cert_names(secret)``: the DNS names of a usable Secret's certificate (none for one that
    cannot serve), which a ``tls[]`` entry without hosts is applied by."""
    table = RouteTable()
    seen: dict[tuple[str, bool, str], tuple[str, str]] = {}
    tls_seen: dict[str, tuple[int, tuple[str, str], bool]] = {}  # host -> (its entry in table.tls, whose, usable)
    default_of: dict[str, tuple[str, str]] = {}
    for ing in sorted(ingresses, key=age_key):
        ns, name = ing["metadata"]["namespace"], ing["metadata"]["name"]
        me = (ns, name)
        table.ingresses.append(me)
        spec = ing["spec"]
        own_default = None
        if "defaultBackend" in spec:
            b = _backend(ns, name, spec["defaultBackend"])
            table.backends[b.name] = b
            own_default = b.name
            if table.default == NOT_FOUND:
                table.default = b.name
            else:
                table.conflicts.append(f"{ns}/{name}: defaultBackend: the default backend of {default_of['']} is older")
            default_of.setdefault("", me)
        for rule in spec.get("rules", []):
            host = rule.get("host") or ANY_HOST
            vhost = table.vhosts.setdefault(host, VirtualHost(host))
            if own_default is not None and vhost.default is None:
                vhost.default = own_default
            for p in (rule.get("http") or {}).get("paths", []):
                b = _backend(ns, name, p["backend"])
                table.backends[b.name] = b
                kind = p["pathType"]
                r = Rule(p.get("path") or "/", "Exact" if kind == "Exact" else "Prefix", b.name, me)
                key = (host, r.exact, r.stem)
                if key in seen:
                    if seen[key] != me:
                        table.conflicts.append(
                            f"{ns}/{name}: {'' if host == ANY_HOST else host}{r.path} ({kind}): "
                            f"already routed by {seen[key][0]}/{seen[key][1]}, which is older")  # fmt: skip
                    continue
                seen[key] = me
                vhost.rules.append(r)
        redirect = _redirect(ing, ssl_redirect)
        own_hosts = list(dict.fromkeys(r["host"] for r in spec.get("rules", []) if r.get("host")))
        named = {h for t in spec.get("tls", []) for h in t.get("hosts") or ()}
        for t in spec.get("tls", []):
            # Without a secretName the hosts are still TLS hosts, served with the default
            # certificate and redirected, as ingress-nginx does.
            secret = (ns, t["secretName"]) if t.get("secretName") else None
            ok = secret is not None and usable(secret)
            hosts = t.get("hosts")
            if not hosts and secret is not None:
                # An entry without hosts: this Ingress's own rule hosts (not those it names in
                # another entry) that its certificate covers, each as if named -- never every
                # name in the certificate, which would take other Ingresses' hosts by SNI.
                names = cert_names(secret) if ok else ()
                hosts = [h for h in own_hosts if h not in named and covers(names, h)]
                if not hosts and secret not in table.hostless:
                    table.hostless.append(secret)
            for host in hosts or []:
                if host in tls_seen:
                    index, owner, owner_ok = tls_seen[host]
                    if owner_ok or not ok:
                        if owner != me:
                            table.conflicts.append(f"{ns}/{name}: tls for {host}: already given by {owner[0]}/{owner[1]}")
                        continue
                    # The older Ingress's Secret cannot serve: this one's does (as ingress-nginx
                    # skips an unusable Secret and takes the next Ingress's for the host).
                    table.conflicts.append(f"{owner[0]}/{owner[1]}: tls for {host}: its Secret cannot serve; "
                                           f"{ns}/{name}'s does")
                    table.tls[index] = TlsHost(host, secret, me, table.tls[index].redirect)
                    tls_seen[host] = (index, me, True)
                    continue
                tls_seen[host] = (len(table.tls), me, ok)
                table.tls.append(TlsHost(host, secret, me, redirect))
    for vhost in table.vhosts.values():
        vhost.rules.sort(key=lambda r: r.rank)
    return table


def covers(names: Iterable[str], host: str) -> bool:
    """Whether a certificate with these DNS names (subjectAltName) is valid for ``host``: a
    name equal to it (case aside), or ``*.`` + its parent domain (one label, as RFC 6125 and Go's
    ``VerifyHostname``, which ingress-nginx asks, have it).  A wildcard rule host ``*.foo.com``
    is covered by the name ``*.foo.com`` only."""
    host = host.lower()
    label, dot, parent = host.partition(".")
    for name in names:
        name = name.lower().removesuffix(".")
        if name == host or (label and dot and name.startswith("*.") and name[2:] == parent):
            return True
    return False


def _redirect(ing: Obj, default: bool) -> bool:
    value = (ing["metadata"].get("annotations") or {}).get(REDIRECT_ANNOTATION)
    if value is None:
        return default
    return value.strip().lower() not in ("false", "0", "no", "off")
