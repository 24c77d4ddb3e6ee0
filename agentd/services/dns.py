"""Service DNS: every agent answers ``<service>.<namespace>.svc.<cluster domain>`` on a node-local address.

As NodeLocal DNSCache does, the agent puts one address (``[dns] address``, 169.254.20.10)
on a dummy interface of its node (``agentd-dns``) and serves DNS there, UDP and TCP;
agentd-cni hands that address to pods as their nameserver (the ADD result's ``dns``).
The wire format is dnspython's.

* ``<svc>.<ns>.svc.<domain>`` A: the IPv4 cluster IP, AAAA: the IPv6 one (a Service has the
  records of its ``ipFamilies``); a headless service: its ready endpoints of each family (none
  ready, of either family: NXDOMAIN, as the specification 2.4.1), and each of them its own name, ``<hostname>.<svc>.<ns>.svc.<domain>`` (the EndpointSlice
  endpoint's ``hostname``: a StatefulSet's ``db-0``), else its address with dashes
  (``10-244-1-5.<svc>...``, as CoreDNS).
* ``_<port>._<proto>.<svc>.<ns>.svc.<domain>`` SRV (named ports): ``0 100 <port> <svc>.<ns>.svc.<domain>``
  (a headless Service: one per ready endpoint, its port and its own name), the targets' A and
  AAAA records in the additional section (RFC 2782; Kubernetes DNS spec 2.3.1/2.4.1, which
  gives AAAA as it gives A).
* ``dns-version.<domain>`` TXT: ``"1.1.0"`` (the specification 2.2; CoreDNS's value, TTL 28800).
* The cluster domain's apex (Services or none): its SOA and NS (``ns.dns.<domain>``, which has
  the node-local addresses), as CoreDNS's kubernetes plugin; ``in-addr.arpa``'s and
  ``ip6.arpa``'s where a Service range of that family makes reverse names ours.
* Other names under the cluster domain: NXDOMAIN (or NOERROR without answers when the name
  exists with another type), authoritative, TTL :data:`TTL`.
* PTR (spec 2.3.3/2.4.3): the reverse name of a cluster IP gives its Service's name, a headless
  Service's ready endpoint's its own name; other addresses of the Service ranges: NXDOMAIN;
  other addresses' reverse names are forwarded.
* A question of another class than IN (CH, HS, ANY) of a name of ours (under the cluster
  domain, a reverse name answered here): REFUSED, without records (they are IN's only); one
  of any other name (``version.bind CH TXT``) is forwarded, as everything else is.
* Opcodes other than QUERY (UPDATE, NOTIFY, ...): NOTIMP, never forwarded (as CoreDNS).  A
  message with QR set (a response) is dropped unanswered.  More than one question: FORMERR;
  an EDNS version above 0: BADVERS (RFC 6891 §6.1.3); neither forwarded.
* Everything else is forwarded to the upstream servers (``[dns] upstream``, else the host's
  /etc/resolv.conf), UDP then TCP when truncated; no answer: SERVFAIL.  The upstreams are
  asked in their configured order; one down (:data:`MAX_FAILS` failures in a row) is skipped
  for a backoff (:class:`Upstreams`; all down: all asked anyway).  At most
  :data:`MAX_FORWARDED` forwarded queries wait at once; more are SERVFAIL at once.  At most
  :data:`MAX_TCP_CLIENTS` TCP connections are open at once; more are closed at once.
* Only the node's pods (the pod networks), the node itself (its own addresses) and loopback
  are answered: a query from anywhere else (the underlay segment) is dropped unanswered and
  counted (``foreign``), on UDP and TCP alike -- no open resolver, no reflection, no Service
  names for strangers.

The names come from the Service agent's view after every sync (:func:`names`), so an
answer changes as soon as the node's table does.  :func:`resolve` is pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import errno
import logging
import socket
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rdtypes.IN.A
import dns.rdtypes.IN.AAAA
import dns.renderer
import dns.rrset

from agentd.kernel import netlink as nl
from agentd.kernel.rtnl import Rtnl

from .model import Endpoint, ServicePort

log = logging.getLogger("agentd.services.dns")

TTL = 5  # seconds, as CoreDNS's kubernetes plugin
# dns-version.<cluster domain> TXT (the Kubernetes DNS specification 2.2): the schema version
# CoreDNS's kubernetes plugin gives (its DNSSchemaVersion; the specification's text says
# 1.0.1), and its TTL.
DNS_SCHEMA_VERSION = "1.1.0"
DNS_VERSION_TTL = 28800  # seconds
DEVICE = "agentd-dns"
FORWARD_TIMEOUT = 2.0
OUTCOMES = ("answered", "forwarded", "servfail", "rejected", "foreign")  # agentd_dns_queries_total{outcome}
# Forwarded queries in flight at most (CoreDNS forward's max_concurrent; its value in
# NodeLocal DNSCache's and many clusters' Corefiles).  Each holds a socket for up to
# FORWARD_TIMEOUT per upstream: without a bound a pod flooding names an upstream never
# answers would take the agent to its LimitNOFILE, and etcd, BGP and netlink would fail
# (EMFILE).  Over it a query is answered SERVFAIL at once, without a socket, as CoreDNS does.
MAX_FORWARDED = 1000
# TCP client connections open at once, at most (each a socket for up to 10 s idle): over it a
# new connection is closed at once, counted as rejected, so that connections cannot take the
# agent to its LimitNOFILE either.
MAX_TCP_CLIENTS = 1000
TCP_IDLE = 10.0  # seconds a TCP client may take to send a query, or to take its answer, before it is closed
# How often, at most, the node's own addresses are listed again when a query comes from an
# address neither a pod network's, loopback, nor among the node's addresses as last listed
# (one netlink dump: a flood of foreign queries costs one per interval, not one each).
LOCAL_REFRESH = 5.0  # seconds
# The upstreams are asked in their configured order.  One that failed (no answer in
# FORWARD_TIMEOUT, refused, closed unanswered) fewer than MAX_FAILS times in a row is healthy
# and keeps its place (a split-horizon resolv.conf, corporate then public, must not turn to the
# public one for a timeout); one that failed MAX_FAILS times in a row is down (CoreDNS forward's
# max_fails, 2) and skipped for RETRY_INITIAL seconds; then one query (a probe: CoreDNS forward
# probes a down upstream out of band, we with a query) asks it in its place, first if it was
# first, while every other query asks it after the healthy ones; the probe failing, it is down
# again for twice as long, up to RETRY_MAX; answering (the probe or any query) makes it
# healthy, in its place for every query (split horizon: a recovered first one is first).  A burst of
# failures downs it once: not counted are a failure of a query sent before the upstream last
# changed state (went down, answered) and one while it is down (every upstream down: asked
# anyway), so 50 concurrent timeouts down it for RETRY_INITIAL, not RETRY_MAX.  A dead first
# upstream costs the queries of its first MAX_FAILS timeouts their timeout, then one query per
# backoff (the probe): not every query (nor holds a forwarding slot that long each).  When every upstream is down they are all asked all the same: there
# is no other to ask.
MAX_FAILS = 2
RETRY_INITIAL = 1.0  # seconds
RETRY_MAX = 30.0  # seconds


def local_addresses() -> set[Any]:
    """The addresses on this namespace's devices, IPv4 and IPv6 (``ip address``)."""
    out: set[Any] = set()
    with Rtnl() as rt:
        for family in (socket.AF_INET, socket.AF_INET6):
            for a in rt.addresses(0, family):
                raw = a.local or a.address
                if raw is not None:
                    out.add(ipaddress.ip_address(raw))
    return out


class Clients:
    """Who may ask: ``networks`` (the pod networks), loopback, and the node's own addresses
    (``local()``, listed again at most every :data:`LOCAL_REFRESH` seconds, when a source is
    none of them)."""

    def __init__(self, networks: Iterable[str], local: Callable[[], set[Any]] = local_addresses,
                 clock: Callable[[], float] | None = None) -> None:  # fmt: skip
        self.networks = [ipaddress.ip_network(n, strict=False) for n in networks]
        self.local = local
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
        self.known: set[Any] = set()
        self.listed_at: float | None = None

    def allowed(self, source: str) -> bool:
        try:
            ip = ipaddress.ip_address(source.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip.is_loopback or ip in self.known or any(ip in n for n in self.networks):
            return True
        now = self.clock()
        if self.listed_at is None or now - self.listed_at >= LOCAL_REFRESH:
            self.listed_at = now
            try:
                self.known = self.local()
            except OSError as err:
                log.warning("cannot list the node's addresses: %s", err)
            return ip in self.known
        return False


@dataclass(frozen=True)
class Names:
    """What the cluster domain holds: A, AAAA and SRV records by (lower-case, absolute) name.
    A name a Service has is in both ``a`` and ``aaaa``, with the addresses of each family
    (none for a family it has not)."""

    domain: str
    a: dict[str, tuple[str, ...]] = field(default_factory=dict)
    srv: dict[str, tuple[tuple[int, str], ...]] = field(default_factory=dict)  # (port, target)
    aaaa: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # False until the Services were read once: the domain's names are then SERVFAIL, not
    # NXDOMAIN (a client takes that as final and caches it; CoreDNS waits for its first sync too).
    ready: bool = True
    # The empty non-terminals (``<ns>.svc.<domain>.``, ``svc.<domain>.``, ``<domain>.``): how
    # many host names each has under it (a look-up, not a scan of every name, per NXDOMAIN).
    branches: Counter[str] = field(default_factory=Counter)
    # The reverse names (``10.0.96.10.in-addr.arpa.``, ``...ip6.arpa.``) of the hosts'
    # addresses: which hosts have each (how many times), for PTR answers.
    ptr: dict[str, Counter[str]] = field(default_factory=dict)

    def add_hosts(self, hosts: Iterable[str], sign: int = 1) -> None:
        """Count ``hosts`` in (``sign`` -1: out of) the branches above them, and in the reverse
        names of their addresses as ``a`` and ``aaaa`` hold them: after their addresses are
        put in, before they are taken out."""
        suffix = f"{self.domain}."
        for host in hosts:
            for address in (*self.a.get(host, ()), *self.aaaa.get(host, ())):
                reverse = f"{ipaddress.ip_address(address).reverse_pointer}."
                owners = self.ptr.setdefault(reverse, Counter())
                owners[host] += sign
                if owners[host] <= 0:
                    del owners[host]
                    if not owners:
                        del self.ptr[reverse]
            labels = host.split(".")
            for i in range(1, len(labels)):
                branch = ".".join(labels[i:])
                if not branch.endswith(suffix) and branch != suffix:
                    break
                self.branches[branch] += sign
                if self.branches[branch] <= 0:
                    del self.branches[branch]
                if branch == suffix:
                    break


def names(ports: Iterable[ServicePort], domain: str) -> Names:
    by_family: dict[int, dict[str, set[str]]] = {4: {}, 6: {}}
    srv: dict[str, set[tuple[int, str]]] = {}
    for sp in ports:
        host = f"{sp.service}.{sp.namespace}.svc.{domain}."
        # A headless Service's records are its ready endpoints only (the Kubernetes DNS
        # specification, as CoreDNS gives them), not the terminating ones a connection may
        # still be sent to when none is ready.
        ready = [e for e in sp.endpoints if e.ready] if sp.cluster_ip is None else []
        if sp.cluster_ip is not None or ready:
            # The name exists for both types, if empty for one (NODATA).  A headless Service
            # without a ready endpoint of either family has no name at all: NXDOMAIN, its SRV
            # names too (the specification 2.4.1: "If there are no ready endpoints for the
            # headless Service, the answer should be NXDOMAIN"; CoreDNS alike).
            for hosts in by_family.values():
                hosts.setdefault(host, set())
        addrs = by_family[sp.family].get(host, set())
        if sp.cluster_ip is not None:
            addrs.add(sp.cluster_ip)
        else:
            addrs.update(e.ip for e in ready)
            for e in ready:  # and each its own name (a StatefulSet's pods: db-0.db.<ns>.svc.<domain>)
                own = f"{endpoint_label(e)}.{host}"
                for hosts in by_family.values():
                    hosts.setdefault(own, set())
                by_family[sp.family][own].add(e.ip)
        if sp.port_name:
            # A headless Service is not translated: its SRV records give each endpoint's own
            # port and name (the Kubernetes DNS specification, 2.4.1), a cluster IP's the
            # Service's port and name.
            if sp.cluster_ip is not None:
                targets = {(sp.port, host)}
            else:
                targets = {(e.port, f"{endpoint_label(e)}.{host}") for e in ready}
            if targets:  # a headless Service's without a ready endpoint: no SRV name (NXDOMAIN)
                srv.setdefault(f"_{sp.port_name}._{sp.l4}.{host}", set()).update(targets)
    a, aaaa = ({k: tuple(sorted(v)) for k, v in by_family[version].items()} for version in (4, 6))
    table = Names(domain, a, {k: tuple(sorted(v)) for k, v in srv.items()}, aaaa)
    table.add_hosts(a)
    return table


def _response(query: dns.message.Message) -> dns.message.Message:
    """The start of a response to ``query``, never padded: dnspython pads one to a query with
    the EDNS Padding option to 468-octet blocks (RFC 8467), which is meant for encrypted
    transports (DoT, DoH), not this plain one -- and a padded answer does not fit where
    :func:`_render` measured it would (no reply over UDP, the TCP connection closed, a cut
    keeping 2 records where 28 fit)."""
    return dns.message.make_response(query, pad=0)


def _ours(table: Names, query: dns.message.Message) -> dns.message.Message:
    """The start of an answer from ``table``: SERVFAIL before its first sync (the caller
    returns it as it is), else authoritative."""
    response = _response(query)
    if table.ready:
        response.flags |= dns.flags.AA
    else:
        response.set_rcode(dns.rcode.SERVFAIL)
    return response


def _refused(query: dns.message.Message) -> dns.message.Message:
    """REFUSED, not authoritative: a question of a class other than IN (CH, HS, ANY, ...) of a
    name of ours.  The records are IN's only (the Kubernetes DNS specification), and an IN
    record in the answer to a CH question would be one of another class than asked.  CoreDNS's
    server answers a class it does not serve REFUSED (core/dnsserver, coredns#973), and lets CH
    through only to a server block with chaos or forward, where the kubernetes plugin, which
    checks no class, gave the IN records."""
    response = _response(query)
    response.set_rcode(dns.rcode.REFUSED)
    return response


def _reverse(table: Names, query: dns.message.Message, qname: str, service_ranges: Sequence[Any]) -> dns.message.Message | None:
    """PTR (the Kubernetes DNS specification 2.3.3, 2.4.3): a cluster IP's reverse name gives
    its Service's name, a headless Service's ready endpoint's its own name; another address of
    the Services' ranges is NXDOMAIN; any other address's (a pod's, the world's) is forwarded."""
    owners = table.ptr.get(qname)
    if not owners:
        address = _reverse_address(qname)
        if address is None or not any(address in r for r in service_ranges):
            return None
    if query.question[0].rdclass != dns.rdataclass.IN:
        return _refused(query)
    response = _ours(table, query)
    if not table.ready:
        return response
    zone = "in-addr.arpa" if qname.endswith(".in-addr.arpa.") else "ip6.arpa"
    q = query.question[0]
    if not owners:
        response.set_rcode(dns.rcode.NXDOMAIN)
    elif q.rdtype in (dns.rdatatype.PTR, dns.rdatatype.ANY):
        # A headless endpoint's address is its Service's name's too: the endpoint's own name
        # (one label more) is the one.
        deepest = max(host.count(".") for host in owners)
        hosts = sorted(host for host in owners if host.count(".") == deepest)
        response.answer.append(dns.rrset.from_text_list(q.name, TTL, "IN", "PTR", hosts))
    if not response.answer:
        response.authority.append(_soa(zone))
    return response


def _reverse_address(qname: str) -> Any:
    """The address a whole reverse name (``d.c.b.a.in-addr.arpa.``, 32 nibbles of
    ``ip6.arpa.``) stands for; None for any other name."""
    try:
        if qname.endswith(".in-addr.arpa."):
            labels = qname[: -len(".in-addr.arpa.")].split(".")
            return ipaddress.IPv4Address(".".join(reversed(labels))) if len(labels) == 4 else None
        labels = qname[: -len(".ip6.arpa.")].split(".")
        if len(labels) != 32 or any(len(label) != 1 or label not in "0123456789abcdef" for label in labels):
            return None
        return ipaddress.IPv6Address(int("".join(reversed(labels)), 16))
    except ValueError:
        return None


def endpoint_label(endpoint: Endpoint) -> str:
    """A headless Service's endpoint's label in DNS: its ``hostname``, else its address with
    dashes for dots and colons (``10-244-1-5``, ``fd00-10-244-1--5``), as CoreDNS names it;
    an IPv6 address ending (starting) in ``::`` gets a ``0`` after (before) its dashes, as
    newer CoreDNS's (``fd00-10-244-1-5-a3c0--0``): a label ending or starting with a dash is
    no host name (Go's resolver drops it)."""
    if endpoint.hostname:
        return endpoint.hostname
    label = endpoint.ip.replace(".", "-").replace(":", "-")
    if label.endswith("-"):
        label += "0"
    if label.startswith("-"):
        label = "0" + label
    return label


def resolve(table: Names, query: dns.message.Message, service_ranges: Sequence[Any] = (),
            nameservers: Sequence[str] = ()) -> dns.message.Message | None:  # fmt: skip
    """The answer to ``query`` from ``table``, or None when the name is not ours (forward it).
    ``service_ranges`` (``ipaddress`` networks): the cluster IPs' ranges, whose reverse names
    are ours.  ``nameservers``: the addresses of ``ns.dns.<domain>`` (the node-local ones),
    the name server the zones' SOA and NS records give."""
    if query.opcode() != dns.opcode.QUERY:
        # UPDATE, NOTIFY and the rest: not implemented, whatever the zone, as CoreDNS answers
        # them (miekg/dns); never forwarded, where an upstream would take them from the node.
        response = _response(query)
        response.set_rcode(dns.rcode.NOTIMP)
        return response
    if len(query.question) != 1:  # none, or more than one (RFC 9619): no question to answer
        response = _response(query)
        response.set_rcode(dns.rcode.FORMERR)
        return response
    if query.edns > 0:
        # RFC 6891 §6.1.3: an EDNS version this server does not speak gets BADVERS, with the
        # version it does (0; make_response answers with it), whatever the name (CoreDNS alike).
        response = _response(query)
        response.set_rcode(dns.rcode.BADVERS)
        return response
    q = query.question[0]
    qname = q.name.to_text().lower()
    if qname.endswith((".in-addr.arpa.", ".ip6.arpa.")):
        return _reverse(table, query, qname, service_ranges)
    if qname in _REVERSE_APEX and any(r.version == _REVERSE_APEX[qname] for r in service_ranges):
        # The zone whose SOA the negative answers of the Service ranges' reverse names carry.
        return _apex(table, query, qname[:-1], nameservers)
    if not (qname == f"{table.domain}." or qname.endswith(f".{table.domain}.")):
        return None
    if q.rdclass != dns.rdataclass.IN:
        return _refused(query)
    if qname == f"{table.domain}.":  # the zone's apex exists, with its SOA and NS, Services or none
        return _apex(table, query, table.domain, nameservers)
    response = _ours(table, query)
    if not table.ready:
        return response
    if qname in (f"ns.dns.{table.domain}.", f"dns.{table.domain}."):  # the name server the SOA and NS give
        if qname.startswith("ns."):
            _nameserver(response, q.name, q.rdtype, nameservers)
        if not response.answer:
            response.authority.append(_soa(table.domain))
        return response
    if qname == f"dns-version.{table.domain}.":  # the specification 2.2: "There must be a TXT record named dns-version.<zone>"
        if q.rdtype in (dns.rdatatype.TXT, dns.rdatatype.ANY):
            response.answer.append(dns.rrset.from_text(q.name, DNS_VERSION_TTL, "IN", "TXT", f'"{DNS_SCHEMA_VERSION}"'))
        else:
            response.authority.append(_soa(table.domain))
        return response
    known = qname in table.a or qname in table.srv or _is_branch(table, qname)  # a holds every host, aaaa too
    if not known:
        response.set_rcode(dns.rcode.NXDOMAIN)
        response.authority.append(_soa(table.domain))  # RFC 2308: how long a cache may keep the "no"
        return response
    for rdtype, records in ((dns.rdatatype.A, table.a), (dns.rdatatype.AAAA, table.aaaa)):
        if q.rdtype in (rdtype, dns.rdatatype.ANY) and records.get(qname):
            response.answer.append(_addresses(q.name, rdtype, records[qname]))
    if q.rdtype in (dns.rdatatype.SRV, dns.rdatatype.ANY) and table.srv.get(qname):  # none: NODATA, not an empty RRset
        srv = [f"0 100 {port} {target}" for port, target in table.srv[qname]]
        response.answer.append(dns.rrset.from_text_list(q.name, TTL, "IN", "SRV", srv))
        for target in dict.fromkeys(target for _, target in table.srv[qname]):  # each once, of several ports
            for rdtype, records in ((dns.rdatatype.A, table.a), (dns.rdatatype.AAAA, table.aaaa)):
                if records.get(target):
                    response.additional.append(_addresses(target, rdtype, records[target]))
    if not response.answer:  # NODATA: the name exists, without records of that type
        response.authority.append(_soa(table.domain))
    return response


_REVERSE_APEX = {"in-addr.arpa.": 4, "ip6.arpa.": 6}


def _apex(table: Names, query: dns.message.Message, zone: str, nameservers: Sequence[str]) -> dns.message.Message:
    """A zone's apex (the cluster domain, ``in-addr.arpa``, ``ip6.arpa``): its SOA and its NS
    (``ns.dns.<cluster domain>``, its addresses in the additional section), as CoreDNS's
    kubernetes plugin answers them; another type NODATA.  Never NXDOMAIN, which would say the
    whole zone does not exist (RFC 8020)."""
    if query.question[0].rdclass != dns.rdataclass.IN:
        return _refused(query)
    response = _ours(table, query)
    if not table.ready:
        return response
    q = query.question[0]
    if q.rdtype in (dns.rdatatype.SOA, dns.rdatatype.ANY):
        response.answer.append(_soa(zone))
    if q.rdtype in (dns.rdatatype.NS, dns.rdatatype.ANY):
        host = f"ns.dns.{table.domain}."
        response.answer.append(dns.rrset.from_text(f"{zone}.", TTL, "IN", "NS", host))
        _nameserver(response, host, dns.rdatatype.ANY, nameservers, response.additional)
    if not response.answer:
        response.authority.append(_soa(zone))
    return response


def _nameserver(response: dns.message.Message, name: dns.name.Name | str, rdtype: int, nameservers: Sequence[str],
                section: list[dns.rrset.RRset] | None = None) -> None:  # fmt: skip
    """``ns.dns.<domain>``'s A and AAAA records (of type ``rdtype``; ANY: both): the node-local addresses."""
    out = response.answer if section is None else section
    for kind, version in ((dns.rdatatype.A, 4), (dns.rdatatype.AAAA, 6)):
        addresses = [a for a in nameservers if ipaddress.ip_address(a).version == version]
        if rdtype in (kind, dns.rdatatype.ANY) and addresses:
            out.append(_addresses(name, kind, addresses))


def _addresses(name: dns.name.Name | str, rdtype: int, addresses: Iterable[str]) -> dns.rrset.RRset:
    """An A or AAAA RRset, made from the addresses, not parsed from text (half the cost: a
    headless Service's answer is made anew per query)."""
    kind = dns.rdtypes.IN.A.A if rdtype == dns.rdatatype.A else dns.rdtypes.IN.AAAA.AAAA
    rdclass = dns.rdataclass.IN
    return dns.rrset.from_rdata_list(name, TTL, [kind(rdclass, rdtype, a) for a in addresses])


def _render(query: dns.message.Message, response: dns.message.Message, limit: int) -> bytes:
    """``response`` in at most ``limit`` octets.  What does not fit is cut: when its answer
    section fits whole, some of its additional records are left out, without TC (RFC 2181 9:
    they are extra); else :func:`_truncated`.  Never padded (:func:`_response`: a forwarded
    reply too)."""
    response.pad = 0
    # The least the answers take: an answer too big for certain is not rendered in vain first.
    least = 12 + sum(len(r) * (11 + (len(r.name) > 1) + _LEAST_DATA.get(r.rdtype, 0)) for r in response.answer)
    if least > limit:
        return _truncated(query, response, limit)
    try:
        wire = response.to_wire(max_size=limit, prefer_truncation=True)
    except (dns.exception.TooBig, ValueError):  # what the measure did not foresee (an OPT record too big): cut, not unanswered
        return _truncated(query, response, limit)
    (ancount,) = struct.unpack("!H", wire[6:8])  # dnspython leaves out a whole RRset that does not fit
    if ancount < sum(len(rrset) for rrset in response.answer):
        return _truncated(query, response, limit)
    return wire


# Octets of a record's data at the least, by type (others: none): a record is its owner (the
# root's one octet, or a compression pointer's two at least), 10 octets of type, class, TTL
# and length, and its data.
_LEAST_DATA = {dns.rdatatype.A: 4, dns.rdatatype.AAAA: 16}


def _truncated(query: dns.message.Message, response: dns.message.Message, limit: int) -> bytes:
    """``response`` cut to ``limit`` octets, TC set: as many of its answer records as fit, in
    order, nothing of the other sections (as CoreDNS cuts: miekg/dns's ``Msg.Truncate``).  How
    many fit comes from one pass that writes the records as dnspython's renderer does (names
    compressed against the question and the records before) and stops where they no longer
    fit: the cost of one rendering, not of one per record (a headless Service's 1,000
    endpoints over UDP took a second of the event loop)."""
    records = [(rrset, rdata) for rrset in response.answer for rdata in rrset]

    def render(count: int) -> bytes:
        cut = _response(query)
        cut.flags = response.flags | dns.flags.TC
        cut.set_rcode(response.rcode())
        kept, source = None, None
        for rrset, rdata in records[:count]:
            if rrset is not source:
                kept, source = dns.rrset.RRset(rrset.name, rrset.rdclass, rrset.rdtype), rrset
                cut.answer.append(kept)
            kept.add(rdata, rrset.ttl)
        # Not shuffled (dnspython's default): the records take the room the pass measured.
        return cut.to_wire(max_size=limit, prefer_truncation=count == 0, want_shuffle=False)

    bare = render(0)  # the header, the question and the OPT record
    pass_ = dns.renderer.Renderer(0, 0, 1 << 32)
    for q in query.question:
        pass_.add_question(q.name, q.rdtype, q.rdclass)
    out = pass_.output
    room = limit - (len(bare) - out.tell())  # for the question and the answers: the OPT record goes last
    count = 0
    for rrset, rdata in records:
        rrset.name.to_wire(out, pass_.compress)
        out.write(struct.pack("!HHI", rrset.rdtype, rrset.rdclass, rrset.ttl))
        with dns.renderer.prefixed_length(out, 2):
            rdata.to_wire(out, pass_.compress)
        if out.tell() > room:
            break
        count += 1
    if count == 0:
        return bare
    try:
        return render(count)
    except dns.exception.TooBig:  # the pass measured otherwise than the renderer wrote: none then
        log.debug("an answer of %d records measured %d to fit in %d octets, which they did not", len(records), count, limit)
        return bare


def _soa(domain: str) -> dns.rrset.RRset:
    """The cluster domain's SOA, as CoreDNS's kubernetes plugin gives it, for negative answers
    (its minimum: the records' TTL)."""
    return dns.rrset.from_text(f"{domain}.", TTL, "IN", "SOA",
                               f"ns.dns.{domain}. hostmaster.{domain}. 1 7200 1800 86400 {TTL}")


def _is_branch(table: Names, qname: str) -> bool:
    """An empty non-terminal (``svc.<domain>``, ``<ns>.svc.<domain>``): it exists, without records."""
    return table.branches.get(qname, 0) > 0


@dataclass
class Upstream:
    """One upstream server and how it fared: ``fails`` counted in a row (0: healthy; below
    :data:`MAX_FAILS` still healthy), and once down (``fails`` >= :data:`MAX_FAILS`) when it
    may be asked again (``retry_at``) and until when the query asking it then (the probe) is
    awaited (``probe_until``; 0: no probe out).  ``state``: bumped at each change of state
    (down, or answering after a failure); a failure of a query sent before the last one is
    not counted."""

    host: str
    port: int
    fails: int = 0
    retry_at: float = 0.0
    state: int = 0
    probe_until: float = 0.0


class Upstreams:
    """The upstreams in the order to ask them: as configured, but for those down: skipped until
    their backoff is over, then asked in their place by one query (the probe) and after the
    healthy ones by every other query until the probe fails or it answers (every one skipped:
    all of them, as configured).  ``clock``: seconds, monotonic (the event loop's)."""

    def __init__(self, pairs: Iterable[tuple[str, int]], clock: Callable[[], float]) -> None:
        self.all = [Upstream(host, port) for host, port in pairs]
        self.clock = clock

    def __len__(self) -> int:
        return len(self.all)

    def order(self) -> list[Upstream]:
        """The order for one query.  A down upstream whose backoff is over and which no probe is
        out for gets this query as its probe (in its place: a first one first), awaited until
        2 * FORWARD_TIMEOUT from now (UDP, then TCP); a probe that never reports (cancelled)
        is given up then, and the next query probes."""
        if not self.all:
            return []
        now = self.clock()
        order, behind = [], []
        for u in self.all:
            if u.fails < MAX_FAILS:
                order.append(u)
            elif now < u.retry_at:
                continue  # its backoff runs: skipped
            elif now < u.probe_until:
                behind.append(u)  # a probe is out: after the healthy ones
            else:
                u.probe_until = now + 2 * FORWARD_TIMEOUT
                order.append(u)
        return order + behind or list(self.all)  # all down: asked anyway

    def failed(self, upstream: Upstream, err: object, state: int | None = None) -> None:
        """A query to ``upstream`` failed; ``state``: the upstream's when the query was sent
        (None: now).  Not counted when the upstream changed state since (went down, answered),
        nor while it is down and its backoff not over (queries sent while every upstream is
        down), so a burst of concurrent timeouts downs it once, for RETRY_INITIAL."""
        now = self.clock()
        if (state is not None and state != upstream.state) or (upstream.fails >= MAX_FAILS and now < upstream.retry_at):
            return
        upstream.fails += 1
        if upstream.fails >= MAX_FAILS:
            backoff = min(RETRY_MAX, RETRY_INITIAL * 2 ** min(upstream.fails - MAX_FAILS, 16))
            upstream.retry_at = now + backoff
            upstream.probe_until = 0.0
            upstream.state += 1
            if upstream.fails == MAX_FAILS:
                log.warning("upstream DNS server %s:%d failed %d times in a row (%s): not asked for %.0f s",
                            upstream.host, upstream.port, upstream.fails, err, backoff)  # fmt: skip

    def status(self, wall: float) -> list[dict[str, Any]]:
        """Each upstream as ``GET /services`` shows it, in the configured order: ``address``
        (host:port, an IPv6 host bracketed), ``state`` -- "healthy" (fewer than MAX_FAILS
        failures in a row), "down" (skipped until ``down_until``) or "retrying" (down, its
        backoff over: the next query asks it in its place, as a probe, the others after the
        healthy ones while the probe is out; the probe answering makes it healthy, failing
        downs it for twice as long) --,
        ``fails`` (in a row), and while down ``down_until`` (UTC, RFC 3339, from ``wall``: the
        wall clock now, in seconds since the epoch) and ``retry_in`` (seconds).  When every
        upstream is down and none is past its backoff, :meth:`order` asks them all anyway: each
        is then "down, asked" (none is skipped; every query waits on their timeouts)."""
        now = self.clock()
        skipped = [u.fails >= MAX_FAILS and now < u.retry_at for u in self.all]
        everyone = all(skipped)  # nothing else to ask: order() gives them all
        out = []
        for u, down in zip(self.all, skipped, strict=True):
            host = f"[{u.host}]" if ":" in u.host else u.host
            state = "healthy" if u.fails < MAX_FAILS else ("down, asked" if everyone else "down") if down else "retrying"
            until = None
            if down:
                at = datetime.datetime.fromtimestamp(wall + (u.retry_at - now), datetime.UTC)
                until = at.isoformat(timespec="seconds").replace("+00:00", "Z")
            out.append({"address": f"{host}:{u.port}", "state": state, "fails": u.fails, "down_until": until,
                        "retry_in": round(u.retry_at - now, 1) if down else None})
        return out

    def answered(self, upstream: Upstream) -> None:
        if upstream.fails >= MAX_FAILS:
            log.info("upstream DNS server %s:%d answers again", upstream.host, upstream.port)
        if upstream.fails:
            upstream.fails = 0
            upstream.probe_until = 0.0
            upstream.state += 1


def upstream_pairs(upstream: Iterable[str]) -> list[tuple[str, int]]:
    """``[dns] upstream`` as the config keeps it ("IPv4:PORT", "[IPv6]:PORT") -> (address, port)."""
    out = []
    for item in upstream:
        host, _, port = item.rpartition(":")
        out.append((host.strip("[]"), int(port)))
    return out


def host_resolvers(path: str = "/etc/resolv.conf", exclude: Iterable[str] = ()) -> list[tuple[str, int]]:
    """The host's nameservers, IPv4 and IPv6 (an IPv6-only host has no other), but for
    ``exclude`` (our own addresses) and what is no address (a zoned link-local one among them:
    a server on one link, which the forwarder's sockets are not bound to)."""
    out = []
    skip = {str(ipaddress.ip_address(a)) for a in exclude}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 2 or parts[0] != "nameserver" or "%" in parts[1]:
                    continue
                try:
                    addr = str(ipaddress.ip_address(parts[1]))
                except ValueError:
                    continue
                if addr not in skip:
                    out.append((addr, 53))
    except OSError:
        pass
    return out


class DnsServer:
    """UDP and TCP on ``address:port`` (and each of ``more``: the IPv6 address of a cluster with
    IPv6); answers from ``table()``, forwards the rest to ``upstreams``."""

    def __init__(self, address: str, port: int, table: Callable[[], Names], upstreams: list[tuple[str, int]],
                 more: Sequence[str] = (), clients: Clients | None = None,
                 service_ranges: Iterable[str] = (), clock: Callable[[], float] | None = None) -> None:  # fmt: skip
        self.address = address
        # The cluster IPs' ranges: their reverse names are answered here, never forwarded.
        self.service_ranges = [ipaddress.ip_network(r, strict=False) for r in service_ranges]
        self.clients = clients  # None: anyone (tests)
        self.addresses = [address, *more]
        self.port = port
        self.table = table
        self.upstreams = Upstreams(upstreams, clock or (lambda: asyncio.get_running_loop().time()))
        self.queries = 0  # received
        self.forwarded = 0  # sent upstream (in flight or done)
        # Monotonic, each query counted once when its reply is made: ``answered`` (from the
        # table), ``forwarded`` (an upstream answered), ``servfail`` (no upstream answered, or
        # no answer could be rendered).  A datagram that is not DNS is counted in none.
        # ``rejected``: not forwarded, MAX_FORWARDED were in flight already (SERVFAIL at once).
        # ``foreign``: from a source that is not ``clients`` (a datagram, or a TCP connection),
        # dropped unanswered (and not in ``queries``).
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.max_forwarded = MAX_FORWARDED
        self.in_flight = 0  # forwarded queries waiting for an upstream
        self.max_tcp_clients = MAX_TCP_CLIENTS
        self.tcp_clients = 0  # TCP connections open
        self._udp: list[asyncio.DatagramTransport] = []
        self._tcp: list[asyncio.base_events.Server] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        server = self

        class Udp(asyncio.DatagramProtocol):
            def connection_made(self, transport: Any) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr: Any) -> None:
                server._datagram(self.transport, data, addr)

        for address in self.addresses:
            udp, _ = await loop.create_datagram_endpoint(Udp, local_addr=(address, self.port))
            self._udp.append(udp)
            self._tcp.append(await asyncio.start_server(self._tcp_client, address, self.port, reuse_address=True))

    async def stop(self) -> None:
        for udp in self._udp:
            udp.close()
        for tcp in self._tcp:
            tcp.close()
            with contextlib.suppress(Exception):
                await tcp.wait_closed()
        self._udp, self._tcp = [], []

    async def answer(self, wire: bytes, *, tcp: bool = False) -> bytes | None:
        self.queries += 1
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None  # not DNS: no answer (as servers do with garbage)
        if query.flags & dns.flags.QR:
            return None  # a response, not a query: dropped, unlogged (nothing to answer, nothing to forward)
        response, outcome = resolve(self.table(), query, self.service_ranges, self.addresses), "answered"
        if response is None and self.in_flight >= self.max_forwarded:
            response, outcome = _response(query), "rejected"
            response.set_rcode(dns.rcode.SERVFAIL)
        elif response is None:
            response, outcome = await self._forward(query, tcp), "forwarded"
            if response is None:
                response, outcome = _response(query), "servfail"
                response.set_rcode(dns.rcode.SERVFAIL)
        # Over UDP an answer must fit the requestor's buffer: 512 octets (RFC 1035 4.2.1), or
        # the payload size its EDNS OPT record offers (RFC 6891 6.2.5, never less than 512).
        # What does not fit is cut and marked TC (RFC 2181 9): the client asks again over TCP,
        # where up to 65535 octets go (a headless Service's 40 endpoints need 700; glibc's stub
        # resolver asks without EDNS, and retries over TCP on TC).  The cut keeps as many
        # answer records as fit, as CoreDNS does: a resolver that never retries over TCP (musl
        # before 1.2.4, Alpine's) still gets addresses.
        limit = 65535 if tcp else min(65535, max(512, query.payload if query.edns >= 0 else 512))
        # Over TCP too, an answer over 65535 octets (a headless Service's 4,100 endpoints) keeps
        # as many records as fit, TC set, as CoreDNS's does: not none.
        wire = _render(query, response, limit)
        self.outcomes[outcome] += 1
        return wire

    @property
    def failed(self) -> int:
        return self.outcomes["servfail"]

    @property
    def rejected(self) -> int:
        return self.outcomes["rejected"]

    async def _forward(self, query: dns.message.Message, tcp: bool) -> Any:
        """The first upstream's reply; None when none answers."""
        self.forwarded += 1
        self.in_flight += 1
        try:
            return await self._ask_upstreams(query, tcp)
        finally:
            self.in_flight -= 1

    async def _ask_upstreams(self, query: dns.message.Message, tcp: bool) -> Any:
        for upstream in self.upstreams.order():
            host, port, state = upstream.host, upstream.port, upstream.state
            try:
                if tcp:
                    reply = await dns.asyncquery.tcp(query, host, timeout=FORWARD_TIMEOUT, port=port)
                else:
                    # A datagram from another source, or of another ID or question (a late
                    # answer to an earlier query, a spoofing attempt), is not the answer: read
                    # past it until the real one comes or the timeout ends (CoreDNS forward too).
                    reply = await dns.asyncquery.udp(query, host, timeout=FORWARD_TIMEOUT, port=port, ignore_trailing=True,
                                                     ignore_unexpected=True, ignore_errors=True)
                    if reply.flags & dns.flags.TC:
                        reply = await self._whole(query, upstream, reply)
            except (dns.exception.DNSException, OSError, EOFError, ValueError) as err:  # EOFError: TCP closed unanswered
                log.debug("upstream %s:%d failed: %s", host, port, err)
                self.upstreams.failed(upstream, str(err) or type(err).__name__, state)
                continue
            self.upstreams.answered(upstream)
            return reply
        return None

    async def _whole(self, query: dns.message.Message, upstream: Upstream, truncated: dns.message.Message) -> Any:
        """The whole answer over TCP to what ``upstream`` answered truncated (TC) over UDP; its
        TCP failing (53/tcp filtered in front of many a corporate resolver): the truncated reply,
        TC kept, as CoreDNS forward passes it back -- the upstream did answer, so it is not a
        failure (two such names downed it, and split-horizon names went to the next upstream),
        and a resolver that never retries over TCP (musl) still gets the records it holds."""
        try:
            return await dns.asyncquery.tcp(query, upstream.host, timeout=FORWARD_TIMEOUT, port=upstream.port)
        except (dns.exception.DNSException, OSError, EOFError, ValueError) as err:
            log.debug("upstream %s:%d answered truncated over UDP, not over TCP: %s", upstream.host, upstream.port,
                      str(err) or type(err).__name__)  # fmt: skip
            return truncated

    def _datagram(self, transport: asyncio.DatagramTransport, data: bytes, addr: Any) -> asyncio.Task[None] | None:
        """A datagram from ``addr``: answered, unless it comes from a source that may not ask."""
        if self.clients is not None and not self.clients.allowed(addr[0]):
            self.outcomes["foreign"] += 1
            return None
        return asyncio.get_running_loop().create_task(self._udp_query(transport, data, addr))

    async def _udp_query(self, transport: asyncio.DatagramTransport, data: bytes, addr: Any) -> None:
        try:
            out = await self.answer(data)
        except Exception as err:  # an answer we cannot render: no reply, never a dead task
            self.outcomes["servfail"] += 1
            log.warning("no answer to a query from %s:%d: %s", addr[0], addr[1], err)
            return
        if out is not None and not transport.is_closing():
            transport.sendto(out, addr)

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.clients is not None:
            peer = writer.get_extra_info("peername")
            if not (peer and self.clients.allowed(peer[0])):
                self.outcomes["foreign"] += 1
                writer.transport.abort()  # unanswered, no FIN handshake kept waiting
                return
        if self.tcp_clients >= self.max_tcp_clients:
            self.outcomes["rejected"] += 1
            writer.close()
            return
        self.tcp_clients += 1
        try:
            while True:
                async with asyncio.timeout(TCP_IDLE):  # not wait_for: a cancel (the server closing) must end the loop
                    head = await reader.readexactly(2)
                    (length,) = struct.unpack("!H", head)
                    wire = await reader.readexactly(length)
                out = await self.answer(wire, tcp=True)
                if out is None:
                    break
                writer.write(struct.pack("!H", len(out)) + out)
                try:
                    # A client that sends and never reads would hold the connection (and its
                    # slot of max_tcp_clients) forever: taking the answer is bounded alike.
                    async with asyncio.timeout(TCP_IDLE):
                        await writer.drain()
                except TimeoutError:
                    writer.transport.abort()  # not close(), which would wait for the unread answers to go
                    break
        except (asyncio.IncompleteReadError, TimeoutError, OSError, dns.exception.DNSException):
            pass
        except Exception as err:  # an answer we cannot render: the connection ends, the server goes on
            self.outcomes["servfail"] += 1
            log.warning("no answer to a query over TCP: %s", err)
        finally:
            self.tcp_clients -= 1
            # Answers still buffered (under the high-water mark, so drain() did not wait: the
            # idle timeout fired on the read): close() would keep the socket until a client
            # that never reads took them, its slot given back.  Abort, as on a drain timeout.
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()
            else:
                writer.close()


# ------------------------------------------------------------------ the node-local address


def add_address(address: str) -> str:
    """``address/32`` (an IPv6 one: /128) on the dummy interface ``agentd-dns`` (idempotent), in
    this namespace; on ``lo`` where the kernel has no dummy interfaces (no module).  Returns the
    device used.  Neither device does duplicate address detection (NOARP, loopback): the IPv6
    address is usable at once."""
    with Rtnl() as rt:
        device = DEVICE
        if rt.link(DEVICE) is None:
            try:
                rt.create_link(DEVICE, "dummy")
            except nl.NetlinkError as err:
                if err.errno != errno.EOPNOTSUPP:  # no dummy driver
                    raise
                device = "lo"
        link = rt.link(device)
        if link is None:
            raise nl.NetlinkError(errno.ENODEV, None, f"looking up device {device}")
        try:
            v6 = ":" in address
            rt.add_address(link.index, address, 128 if v6 else 32, f"{device}:agentd" if device == "lo" and not v6 else None)
        except nl.NetlinkError as err:
            if err.errno != errno.EEXIST:  # there from a previous run
                raise
        if device == DEVICE:
            rt.set_link(link.index, up=True)
        return device


def remove_address(address: str | None = None, address_v6: str | None = None) -> bool:
    """Remove ``agentd-dns``, or ``address`` (every address agentd labelled, without it) and
    ``address_v6`` from ``lo`` where they were put there (IPv6 addresses have no label)."""
    with Rtnl() as rt:
        link = rt.link(DEVICE)
        if link is not None:
            rt.delete_link(link.index)
            return True
        lo = rt.link("lo")
        if lo is None:
            return False
        found = False
        for a in rt.addresses(lo.index):
            if a.label != "lo:agentd" or a.local is None:
                continue
            if address is not None and a.local != socket.inet_aton(address):
                continue
            try:
                rt.delete_address(lo.index, socket.inet_ntoa(a.local), a.prefixlen)
                found = True
            except nl.NetlinkError:
                pass  # gone meanwhile
        if address_v6 is not None:
            packed = socket.inet_pton(socket.AF_INET6, address_v6)
            if any(a.address == packed and a.prefixlen == 128 for a in rt.addresses(lo.index, socket.AF_INET6)):
                with contextlib.suppress(nl.NetlinkError):  # gone meanwhile
                    rt.delete_address(lo.index, address_v6, 128)
                    found = True
        return found
