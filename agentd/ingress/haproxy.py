"""The routing table as HAProxy 2.6 configuration, and endpoint changes as runtime commands.  Pure.

:func:`render` writes the whole configuration: ``haproxy.cfg`` and the map files it reads.
Routing is four map lookups per request, so the configuration does not grow a rule per path
and no path is ever quoted into the configuration text:

1. ``hosts.map``: the request host (Host header, port and case dropped) -> its virtual host;
   if absent, the host with its first label replaced by ``*`` (one wildcard label); if still
   absent, ``_`` (the rules without a host);
2. ``exact.map`` (``map_str``, a tree): the key -> backend, for every Exact rule and for
   every Prefix rule's own path (a request equal to a Prefix rule's path: no longer rule can
   match it, and an Exact rule of the same path wins);
3. ``prefix.map`` (``map_beg``, first match in file order): the key of ``stem + "/"`` ->
   backend, longest first: the element-wise Prefix match;
4. ``defaults.map``: ``vhost`` -> its default backend; then the frontend's default backend.

Plain HTTP to a TLS host (``tls-hosts.lst``: the name, or the wildcard one label above it) is
redirected to HTTPS between steps 3 and 4, per path as ingress-nginx decides per location:
when the backend a rule chose is in ``redirect-backends.lst`` (those of the Ingresses whose
ssl-redirect is on), or, no rule matching, the virtual host is in ``redirect-vhosts.lst``
(its oldest Ingress's is on).

A key is ``vhost/`` and the normalised path's bytes in hex (:func:`key`): the request path is
percent-decoded and normalised first, as nginx does (agentd.ingress.routing.normalise_path,
whose regular expressions the frontend runs), and a decoded path may hold any byte -- a
space, a tab or a newline would split a map line into a key and a value of the sender's
choosing; in hex each rule is one line whatever its path, and a byte prefix is a hex prefix.

:mod:`agentd.ingress.routing` is the reference (``route``, ``redirects``);
tests/unit/agentd/test_ingress_routing.py runs both on the same tables, the rendered frontend's
rules run by an interpreter of the fetches, converters and matches they use.

Backends list their endpoints as ``server <ip>:<port> <ip>:<port>``: the server's name is
its address, so the controller (agentd.ingress.controller) changes them through the runtime
API by name (``add server`` + ``enable server``; ``disable server`` + ``del server``) and the
proxy is never reloaded for an endpoint change.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .routing import ANY_HOST, BAD_REQUEST, NEEDS_NORMALISING, NORMALISE, NOT_FOUND, RouteTable
from agentd.resources.ingress_settings import Settings

Server = tuple[str, int]  # (ip, port) of one ready endpoint

MAPS = ("hosts.map", "exact.map", "prefix.map", "defaults.map", "tls-hosts.lst", "redirect-backends.lst",
        "redirect-vhosts.lst", "crt-list")
BACKEND_DEFAULTS = (
    "balance roundrobin",
    # A request whose connection failed, or that a pod closed without an answer (one that just
    # went away), is tried again, twice at most, on another pod where there is one -- but a
    # POST, PATCH or LOCK that reached a pod is never sent again (it may have been acted on),
    # as ingress-nginx's proxy_next_upstream never sends a non-idempotent request twice.
    "retries 2",
    "retry-on conn-failure empty-response",
    "http-request disable-l7-retry if METH_POST || { method PATCH LOCK }",
    "option redispatch 1",
    "http-reuse safe",
)
# What the pod sees of the client: its address (not what the client claims), scheme, host and
# port, as ingress-nginx sets them by default.
FORWARDED = (
    "http-request set-header X-Forwarded-For %[src]",
    "http-request set-header X-Real-IP %[src]",
    "http-request set-header X-Forwarded-Proto %[ssl_fc,iif(https,http)]",
    "http-request set-header X-Forwarded-Host %[req.fhdr(host)]",  # fhdr: the whole value (hdr: its last after a comma)
    "http-request set-header X-Forwarded-Port %[dst_port]",
)


@dataclass(frozen=True)
class Listen:
    addresses: tuple[str, ...]
    http_port: int = 80
    https_port: int = 443


@dataclass(frozen=True)
class Paths:
    """Where the proxy's files live (``[agent] state_dir``/ingress)."""

    dir: Path

    @property
    def config(self) -> Path:
        return self.dir / "haproxy.cfg"

    @property
    def admin_socket(self) -> Path:
        return self.dir / "admin.sock"

    @property
    def master_socket(self) -> Path:
        return self.dir / "master.sock"

    @property
    def pidfile(self) -> Path:
        return self.dir / "haproxy.pid"

    @property
    def output(self) -> Path:
        """What the launcher printed (startup warnings and alerts): the master's stdio is
        /dev/null once it runs in the background."""
        return self.dir / "haproxy.log"

    @property
    def log_socket(self) -> Path:
        """The access log's unix datagram socket, which the agent drains."""
        return self.dir / "log.sock"

    @property
    def loaded(self) -> Path:
        """Which master runs which configuration (its structure's digest): what a restarted
        agent compares with what it renders before it decides to reload."""
        return self.dir / "loaded.json"

    @property
    def certs(self) -> Path:
        return self.dir / "certs"

    @property
    def default_cert(self) -> Path:
        return self.dir / "default.pem"

    def file(self, name: str) -> Path:
        return self.dir / name


def server_name(server: Server) -> str:
    ip, port = server
    return f"{ip}:{port}"


def address(ip: str, port: int) -> str:
    """A bind or server address: an IPv6 one in brackets (RFC 3986's form, which HAProxy reads
    in the configuration and in the runtime API's ``add server`` alike)."""
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


def key(vhost: str, path: bytes) -> str:
    """A map key: the virtual host, a slash (a host never has one), the path in hex."""
    return f"{vhost}/{path.hex().upper()}"


def maps(table: RouteTable, cert_files: Mapping[tuple[str, str], Path]) -> dict[str, str]:
    """The map files of ``table``.  ``cert_files``: the PEM file of each usable TLS Secret."""
    hosts, exact, prefix, defaults = [], {}, [], []
    for name, vhost in sorted(table.vhosts.items()):
        if name != ANY_HOST:
            hosts.append(f"{name} {name}")
        for rule in vhost.rules:
            if rule.exact:
                exact[key(name, rule.key)] = rule.backend
        for rule in vhost.rules:
            if not rule.exact:
                if rule.stem:
                    exact.setdefault(key(name, rule.stem), rule.backend)
                prefix.append((key(name, rule.stem + b"/"), rule.backend))
        if vhost.default is not None:
            defaults.append(f"{name} {vhost.default}")
    prefix.sort(key=lambda kv: (-len(kv[0]), kv[0]))
    # Every TLS host may be redirected, its Secret usable or not (ingress-nginx serves the
    # default certificate then, and still redirects) -- where the Ingress of the path that
    # answers wants it: the matching rule's backend's, else the virtual host's oldest.
    tls_hosts = sorted({t.host for t in table.tls if t.host})
    redirect_backends = sorted(n for n, b in table.backends.items() if (b.namespace, b.ingress) in table.redirecting)
    redirect_vhosts = sorted(n for n, v in table.vhosts.items() if v.ingress in table.redirecting)
    # Every line names its host (SNI filter): a line without one would serve its certificate
    # for every name in it, other Ingresses' hosts included.  A Secret that does not serve the
    # host (its certificate does not cover it): the default certificate.
    crt = [f"{cert_files[t.secret]} {t.host}" for t in table.tls
           if t.host and t.serves and t.secret is not None and t.secret in cert_files]  # fmt: skip
    return {
        "hosts.map": _lines(hosts),
        "exact.map": _lines(f"{k} {v}" for k, v in sorted(exact.items())),
        "prefix.map": _lines(f"{k} {v}" for k, v in prefix),
        "defaults.map": _lines(defaults),
        "tls-hosts.lst": _lines(tls_hosts),
        "redirect-backends.lst": _lines(redirect_backends),
        "redirect-vhosts.lst": _lines(redirect_vhosts),
        "crt-list": _lines(crt),
    }


def _lines(lines: Iterable[str]) -> str:
    text = "\n".join(lines)
    return text + "\n" if text else ""


def render(
    table: RouteTable, servers: Mapping[str, Iterable[Server]], settings: Settings, listen: Listen, paths: Paths,
    cert_files: Mapping[tuple[str, str], Path], *, access_log: bool | None = None,
    run_as: tuple[str, str] | None = None,
) -> dict[str, str]:  # fmt: skip
    """Every file of the proxy's configuration, by name (``haproxy.cfg`` and :data:`MAPS`).
    ``run_as``: the (user, group) the workers run as (None: the master's, root's)."""
    d = paths.dir
    s = settings
    log = s.access_log if access_log is None else access_log
    g = [
        "global",
        f"    stats socket {paths.admin_socket} mode 600 level admin expose-fd listeners",
        "    stats timeout 30s",
        f"    pidfile {paths.pidfile}",
        "    hard-stop-after 10m",  # an old worker with a stuck connection goes after a reload
        "    ssl-default-bind-options ssl-min-ver TLSv1.2",
    ]
    if run_as is not None:
        # The workers, which parse requests, switch to this user (uid 0 to another drops every
        # capability); the master stays root (reloads, certificates, listeners), as the
        # packages run it.  ingress-nginx's nginx runs as uid 101 alike.
        g += [f"    user {run_as[0]}", f"    group {run_as[1]}"]
    if log:
        g.append(f"    log {paths.log_socket} format raw local0")
    out = [
        *g,
        "",
        "defaults",
        "    mode http",
        "    log global" if log else "    no log",
        "    option httplog" if log and not s.log_format else "",
        f"    log-format \"{_quote(s.log_format)}\"" if log and s.log_format else "",
        "    option http-keep-alive",
        # On a reload the old worker keeps its idle keep-alive connections until their next
        # response (sent with Connection: close) instead of closing them under a client that
        # may be sending a request at that moment: no request is lost to the race.
        "    option idle-close-on-response",
        f"    timeout connect {s.connect_timeout}s",
        f"    timeout client {s.send_timeout}s",
        f"    timeout server {s.read_timeout}s",
        # keep-alive 0 (ingress-nginx: "disables keep-alive client connections"): each side closes after a response.
        f"    timeout http-keep-alive {s.keep_alive}s" if s.keep_alive else "    option httpclose",
        "    timeout http-request 60s",
        f"    timeout tunnel {s.websocket_timeout}s",
        "    timeout client-fin 30s",
        "",
        "frontend ingress",
    ]
    alpn = " alpn h2,http/1.1" if s.http2 else ""
    for addr in listen.addresses:
        out.append(f"    bind {address(addr, listen.http_port)}")
        out.append(f"    bind {address(addr, listen.https_port)} ssl crt {paths.default_cert} crt-list {d / 'crt-list'}{alpn}")
    https = "" if listen.https_port == 443 else f":{listen.https_port}"
    files = maps(table, cert_files)
    # Only the lookups this table needs: every rule costs each request some CPU.
    wildcards = any(v.startswith("*.") for v in table.vhosts)
    tls_hosts = files["tls-hosts.lst"].split()
    # With no wildcard host and no rule without a host, a request's virtual host is its host
    # (a host no rule names matches no key: every key starts with a rule's host), so the key
    # is built in one step; the hosts.map lookup is only needed for the other cases.
    by_map = wildcards or ANY_HOST in table.vhosts
    # The Host header is read whole (req.fhdr): req.hdr() takes a value as a list, split at
    # commas, and gives its last element -- "Host: pub.example,adm.example" would be routed
    # as adm.example.  A Host with a comma (several values) or a "/" (a path in it: for /admin,
    # "Host: h/public" would be keyed h/public/admin, routed by the /public rule) is no host:
    # refused as RFC 9112 section 3.2 asks of an invalid Host, 400 (routing.RouteTable.route).
    out += [
        "    http-request deny deny_status 400 if { req.fhdr(host) -m sub , }",
        "    http-request deny deny_status 400 if { req.fhdr(host) -m sub / }",
    ]
    # routing.normalise_host: lower case, no port, no final dot ("shop.example." is
    # "shop.example", as nginx takes it).  Single-quoted: the regular expression's empty
    # replacement must reach the converter as an argument.
    out.append("""    http-request set-var(txn.host) 'req.fhdr(host),field(1,:),lower,regsub("[.](?!.)","")'""")
    host = "var(txn.host)"
    vhost = host
    if table.vhosts and by_map:
        out += [
            f"    http-request set-var(txn.vhost) {host},map_str({d / 'hosts.map'})",
            f"    http-request set-var(txn.vhost) {host},regsub(^[^.]+,*),map_str({d / 'hosts.map'}) "
            "if !{ var(txn.vhost) -m found }" if wildcards else "",
            f"    http-request set-var(txn.vhost) str({ANY_HOST}) if !{{ var(txn.vhost) -m found }}"
            if ANY_HOST in table.vhosts else "",
        ]
        vhost = "var(txn.vhost)"
    if table.vhosts:  # a request's key: its virtual host, then its path (a Host with "/": refused above)
        out += _normalise_path()
        out.append(f'    http-request set-var-fmt(txn.key) "%[{vhost}]/%[var(txn.path),hex]"')
    out += [
        f"    http-request set-var(txn.backend) var(txn.key),map_str({d / 'exact.map'})" if files["exact.map"] else "",
        f"    http-request set-var(txn.backend) var(txn.key),map_beg({d / 'prefix.map'}) if !{{ var(txn.backend) -m found }}"
        if files["prefix.map"] else "",
    ]
    # HTTP -> HTTPS for a TLS host (the exact name, or the wildcard covering it), decided per
    # path as ingress-nginx decides per location: by the Ingress of the rule that matched (its
    # backend, in txn.backend by now), else by the virtual host's oldest Ingress.
    wanted = []
    if files["redirect-backends.lst"]:
        wanted.append(f"{{ var(txn.backend) -m str -f {d / 'redirect-backends.lst'} }}")
    if files["redirect-vhosts.lst"]:
        wanted.append(f"!{{ var(txn.backend) -m found }} {{ {vhost} -m str -f {d / 'redirect-vhosts.lst'} }}")
    if tls_hosts and wanted:
        out.append(f"    acl tls_host var(txn.host) -m str -f {d / 'tls-hosts.lst'}")
        if any(h.startswith("*.") for h in tls_hosts):
            out.append(f"    acl tls_host var(txn.host),regsub(^[^.]+,*) -m str -f {d / 'tls-hosts.lst'}")
        out.append(f"    http-request redirect location https://%[var(txn.host)]{https}%[capture.req.uri] code 308 if "
                   + " || ".join(f"!{{ ssl_fc }} tls_host {w}" for w in wanted))
    if s.body_size:
        out.append(f"    http-request deny deny_status 413 if {{ req.hdr_val(content-length) gt {s.body_size} }}")
    out += [
        f"    http-request set-var(txn.backend) {vhost},map_str({d / 'defaults.map'}) if !{{ var(txn.backend) -m found }}"
        if files["defaults.map"] else "",
        *(f"    {line}" for line in FORWARDED),
        *(f"    {line}" for line in s.snippet),
        "    use_backend %[var(txn.backend)] if { var(txn.backend) -m found }" if table.vhosts else "",
        f"    default_backend {table.default}",
        "",
        f"backend {NOT_FOUND}",
        '    http-request return status 404 content-type "text/plain" string "default backend - 404"',
    ]
    for name in sorted(table.backends):
        out += ["", f"backend {name}", *(f"    {line}" for line in BACKEND_DEFAULTS)]
        for server in sorted(set(servers.get(name, ()))):
            out.append(f"    server {server_name(server)} {address(*server)}")
    files["haproxy.cfg"] = "\n".join(_squeeze(out)) + "\n"
    return files


def _normalise_path() -> list[str]:
    """The request path as nginx matches it, in ``txn.path`` (routing.normalise_path's
    steps); 400 where nginx answers 400.  The request itself goes on as sent (ingress-nginx's
    ``proxy_pass`` names no URI: the pod gets the client's)."""
    steps = ",".join(f'regsub("{p}","{r}"{",g" if every else ""})' for p, r, every in NORMALISE)
    return [
        f"    http-request deny deny_status {BAD_REQUEST} if {{ path -m sub %00 }}",
        "    http-request set-var(txn.path) path,url_dec",  # fails (no variable) on a bad escape
        f"    http-request deny deny_status {BAD_REQUEST} if !{{ var(txn.path) -m found }}",
        # Single quotes: no "$" expanded, the inner double quotes keep the patterns' commas
        # and parentheses from the converter's argument list.
        f"    http-request set-var(txn.path) 'var(txn.path),{steps}' if {{ var(txn.path) -m reg '{NEEDS_NORMALISING}' }}",
        f"    http-request deny deny_status {BAD_REQUEST} if {{ var(txn.path) -m sub /../ }}",
    ]


def _squeeze(lines: list[str]) -> list[str]:
    """Drop the placeholders of switched-off lines (empty strings inside a section)."""
    out: list[str] = []
    for i, line in enumerate(lines):
        if line == "" and (i + 1 >= len(lines) or lines[i + 1].startswith("    ") or not out or out[-1] == ""):
            continue
        out.append(line)
    return out


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
