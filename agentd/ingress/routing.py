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
* **TLS.**  An Ingress's ``tls[]`` applies to the hosts of its OWN rules only, as in
  ingress-nginx (createServers walks an Ingress's rules, extractTLSSecretName): a rule host
  takes the FIRST entry naming it (its Secret serving or not: a later entry naming it is not
  looked at), else the first entry whose certificate covers it (:func:`covers`: one without
  ``hosts``, or a wildcard one), else -- the Ingress has a tls section -- the default
  certificate (with the Secret of a wildcard entry covering it, said in tls_errors).  A host
  an entry names that covers none of its Ingress's rule hosts is ignored (in ``conflicts``)
  -- it would take another Ingress's host by SNI.  The rules without a host get the
  controller's default certificate, never an Ingress's, and are never redirected.  A Secret
  serves a host only if it is usable and its certificate covers the host (Go's
  ``VerifyHostname``, which ingress-nginx asks); a host several Ingresses give TLS takes the
  oldest one's Secret that serves it, else the oldest one's (served with the default
  certificate, in ``uncovered``/tls_errors when the certificate does not cover it).
  ingress-nginx differs there: the oldest Ingress keeps the host, with the default certificate.
  Plain-HTTP requests for a TLS host (its Secret usable or not, or none, as in ingress-nginx)
  are redirected to HTTPS (308) when the Ingress of the path that answers wants it (the
  matching rule's Ingress, else its virtual host's oldest: ConfigMap ``ssl-redirect``, Ingress
  annotation ``ingress.agentd.io/ssl-redirect``) -- decided per path, as ingress-nginx decides
  per location.

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
    # Its oldest Ingress: whose ssl-redirect a request no rule matches follows (ingress-nginx:
    # a server's default location takes the annotations of the first Ingress of its host).
    ingress: tuple[str, str] | None = None

    def route(self, path: bytes) -> Rule | None:
        for rule in self.rules:
            if rule.matches(path):
                return rule
        return None


@dataclass(frozen=True)
class TlsHost:
    host: str  # a rule host of its Ingress: exact or "*.parent"
    secret: tuple[str, str] | None  # (namespace, name); None: the entry names none (the default certificate)
    ingress: tuple[str, str]
    serves: bool = True  # the Secret is usable and its certificate covers the host (else: the default certificate)


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
    # (Secret, host): a usable Secret a tls[] entry names for a host its certificate does not
    # cover: not served for it (said in tls_errors, as ingress-nginx logs it).
    uncovered: list[tuple[tuple[str, str], str]] = field(default_factory=list)
    # The Ingresses whose plain-HTTP requests for a TLS host are redirected to HTTPS.
    redirecting: set[tuple[str, str]] = field(default_factory=set)

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
        return self._answer(host, path)[0]

    def _answer(self, host: str, path: str) -> tuple[str, tuple[str, str] | None]:
        """The backend, and the Ingress whose ssl-redirect applies: the matching rule's, else
        its virtual host's oldest (None: no virtual host)."""
        if "," in host or "/" in host:
            return BAD_REQUEST, None
        normal = normalise_path(path)
        if normal is None:
            return BAD_REQUEST, None
        vhost = self.vhost_for(host)
        if vhost is None:
            return self.default, None
        rule = vhost.route(normal)
        if rule is not None:
            return rule.backend, rule.ingress
        return vhost.default or self.default, vhost.ingress

    def tls_host(self, host: str) -> bool:
        """Whether ``host`` (normalised) is a TLS host: named, or under a wildcard one (one label)."""
        host = normalise_host(host)
        label, dot, parent = host.partition(".")
        names = {host, f"*.{parent}"} if label and dot else {host}
        return any(t.host in names for t in self.tls)

    def redirects(self, host: str, path: str) -> bool:
        """Whether a plain-HTTP request for ``host`` and ``path`` is redirected to HTTPS: a TLS
        host (its Secret usable or not), and the Ingress of the path that answers it (the
        matching rule's, else its virtual host's oldest) wants it -- decided per path, as
        ingress-nginx decides per location (its ssl-redirect and a certificate for the host)."""
        backend, ingress = self._answer(host, path)
        return backend != BAD_REQUEST and ingress in self.redirecting and self.tls_host(host)


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
          cert_names: Callable[[tuple[str, str]], Collection[str] | None] = lambda secret: None) -> RouteTable:
    """The routing table of ``ingresses`` (those this controller serves).  ``usable(secret)``:
    whether a TLS Secret can serve (it exists, is kubernetes.io/tls, loads).
    ``cert_names(secret)``: the DNS names of a usable Secret's certificate (none for one that
    cannot serve; None: not known, taken as valid for the hosts an entry names): a Secret serves a host only
    if its certificate covers it (:func:`covers`), and a host's older Ingress whose Secret
    cannot serve it does not keep a newer one's that can from it."""
    table = RouteTable()
    seen: dict[tuple[str, bool, str], tuple[str, str]] = {}
    tls_seen: dict[str, tuple[int, tuple[str, str], bool]] = {}  # host -> (its entry in table.tls, whose, serves)
    hostless: set[tuple[str, str]] = set()  # table.hostless, as a set
    # Each Secret asked once per build (the controller's answer decodes and hashes it: asked
    # per host of an Ingress with thousands, that was most of a render).
    answers: dict[tuple[str, str], bool] = {}

    def usable_once(secret: tuple[str, str]) -> bool:
        got = answers.get(secret)
        if got is None:
            got = answers[secret] = usable(secret)
        return got

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
            vhost = table.vhosts.setdefault(host, VirtualHost(host, ingress=me))
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
        if _redirect(ing, ssl_redirect):
            table.redirecting.add(me)
        _tls(table, me, spec, usable_once, cert_names, tls_seen, hostless)
    for vhost in table.vhosts.values():
        vhost.rules.sort(key=lambda r: r.rank)
    return table


def _tls(table: RouteTable, me: tuple[str, str], spec: Obj, usable: Callable[[tuple[str, str]], bool],
         cert_names: Callable[[tuple[str, str]], Collection[str] | None],
         tls_seen: dict[str, tuple[int, tuple[str, str], bool]], listed: set[tuple[str, str]]) -> None:
    """The ``tls[]`` section of Ingress ``me`` (newer than every one :func:`build` gave here
    before), as ingress-nginx applies it (createServers, extractTLSSecretName): per host of
    its OWN rules -- the first entry naming the host, else the first whose certificate covers
    it, else (the Ingress has a tls section) the default certificate --, never for a host it
    has no rule for (that would take another Ingress's host by SNI, across namespaces too);
    the oldest Ingress whose Secret serves a host keeps it.  Work linear in the hosts and
    entries (it runs on the agent's event loop): indexes, built once, not a scan per host."""
    ns, name = me
    # Without a secretName the hosts are still TLS hosts, served with the default certificate
    # and redirected, as ingress-nginx does.
    entries = [((ns, t["secretName"]) if t.get("secretName") else None, list(t.get("hosts") or ()))
               for t in spec.get("tls", [])]  # fmt: skip
    if not entries:
        return
    own = list(dict.fromkeys(r["host"] for r in spec.get("rules", []) if r.get("host")))
    own_set = set(own)
    own_parents = {parent for label, dot, parent in (h.partition(".") for h in own) if label and dot}
    named: dict[str, list[tuple[str, str] | None]] = {}  # a host an entry names -> the Secrets naming it, in order
    for secret, hosts in entries:
        for host in hosts:
            named.setdefault(host, []).append(secret)
    for host in named:  # one that covers none of its rule hosts gives nothing
        if host not in own_set and not (host.startswith("*.") and host[2:] in own_parents):
            table.conflicts.append(f"{ns}/{name}: tls for {host}: no rule of {ns}/{name} names this host: not "
                                   "given its Secret (an Ingress's tls applies to its own rule hosts only)")
    names: dict[tuple[str, str], Collection[str] | None] = {}

    def known_names(secret: tuple[str, str]) -> Collection[str] | None:
        if secret not in names:
            names[secret] = cert_names(secret)
        return names[secret]

    def serves(secret: tuple[str, str] | None, host: str) -> bool:
        """Whether ``secret`` can serve ``host``: usable, and its certificate valid for the host
        (Go's VerifyHostname, which ingress-nginx asks; names not known: valid for the hosts
        the Ingress names for it and one label under its wildcards, for no other)."""
        if secret is None or not usable(secret):
            return False
        known = known_names(secret)
        return any(n in named for n in _covering(host)) if known is None else covers(known, host)

    covering: dict[str, int] | None = None  # a certificate's name -> the first entry whose Secret has it

    def first_covering(host: str) -> tuple[str, str] | None:
        """The Secret of the first entry whose certificate covers ``host`` (none names it)."""
        nonlocal covering
        if covering is None:
            covering = {}
            for i, (secret, _) in enumerate(entries):
                # Names not known: it serves the hosts named for it only -- none of these.
                if secret is not None and usable(secret) and (known := known_names(secret)) is not None:
                    for n in known:
                        covering.setdefault(n.lower().removesuffix("."), i)
        found = [covering[n] for n in _covering(host) if n in covering]
        return entries[min(found)][0] if found else None

    chosen: set[tuple[str, str]] = set()
    for host in own:
        given = True  # an entry of its names the host or has a Secret for it
        if host in named:  # the first entry naming it, serving or not (ingress-nginx)
            secret = named[host][0]
            ok = serves(secret, host)
            if not ok and secret is not None and usable(secret):
                table.uncovered.append((secret, host))
            if not ok and (better := next((s for s in named[host][1:] if s != secret and serves(s, host)), None)):
                first = (f"gives it its Secret, {secret[0]}/{secret[1]}, which cannot serve it" if secret is not None
                         else "has no secretName")  # fmt: skip
                table.conflicts.append(f"{ns}/{name}: tls for {host}: the first entry naming it {first}; "
                                       f"not {better[0]}/{better[1]} of a later entry")  # fmt: skip
        elif (secret := first_covering(host)) is not None:
            ok = True
        else:  # the default certificate (ingress-nginx), a wildcard entry covering it named
            label, dot, parent = host.partition(".")
            wildcard = named.get(f"*.{parent}") if label and dot else None
            secret, given = (wildcard[0], True) if wildcard else (None, False)
            ok = serves(secret, host)  # its certificate's names not known: it does
            if not ok and secret is not None and usable(secret):
                table.uncovered.append((secret, host))
        if secret is not None:
            chosen.add(secret)
        if host in tls_seen:
            index, owner, owner_ok = tls_seen[host]
            if owner_ok or not ok:
                if given:
                    table.conflicts.append(f"{ns}/{name}: tls for {host}: already given by {owner[0]}/{owner[1]}")
                continue
            # The older Ingress's Secret cannot serve the host: this one's does (agentd's
            # choice: ingress-nginx gives the host the default certificate then).
            why = "its Secret cannot serve it" if table.tls[index].secret is not None else "its tls gives it no Secret"
            table.conflicts.append(f"{owner[0]}/{owner[1]}: tls for {host}: {why}; {ns}/{name}'s does")
            table.tls[index] = TlsHost(host, secret, me, True)
            tls_seen[host] = (index, me, True)
            continue
        tls_seen[host] = (len(table.tls), me, ok)
        table.tls.append(TlsHost(host, secret, me, ok))
    for secret, hosts in entries:  # (``listed``: table.hostless as a set, kept by build)
        if not hosts and secret is not None and secret not in chosen and secret not in listed:
            table.hostless.append(secret)
            listed.add(secret)


def _covering(host: str) -> tuple[str, ...]:
    """The certificate names valid for ``host`` (lower case): itself, and ``*.`` + its parent
    domain (one label, as RFC 6125 and Go's ``VerifyHostname`` have it)."""
    host = host.lower()
    label, dot, parent = host.partition(".")
    return (host, f"*.{parent}") if label and dot else (host,)


def covers(names: Iterable[str], host: str) -> bool:
    """Whether a certificate with these DNS names (subjectAltName) is valid for ``host``: a
    name equal to it (case aside), or ``*.`` + its parent domain (one label, as RFC 6125 and Go's
    ``VerifyHostname``, which ingress-nginx asks, have it).  A wildcard rule host ``*.foo.com``
    is covered by the name ``*.foo.com`` only."""
    valid = _covering(host)
    return any(name.lower().removesuffix(".") in valid for name in names)


def _redirect(ing: Obj, default: bool) -> bool:
    value = (ing["metadata"].get("annotations") or {}).get(REDIRECT_ANNOTATION)
    if value is None:
        return default
    return value.strip().lower() not in ("false", "0", "no", "off")
