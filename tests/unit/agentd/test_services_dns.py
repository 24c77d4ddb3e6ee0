"""Service DNS (the node-local resolver of cluster.local names), pure: the names a node answers, answers as the Kubernetes DNS spec
gives them (dnspython wire format), what is forwarded, the [dns] keys, and what agentd-cni hands
to pods (the subnet file's AGENTD_DNS, the ADD result's "dns")."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network

import dns.flags
import dns.message
import dns.rcode
import pytest

from agentd.cni.netconf import SubnetFile, SubnetFileError, dns_config, parse_subnet_file, render_subnet_file
from agentd.config.settings import ConfigError, load_config
from agentd.services import dns as sdns
from agentd.services.model import Endpoint, ServicePort


def sp(service: str, port_name: str, protocol: str, port: int, cluster_ip: str | None, endpoints=()) -> ServicePort:
    return ServicePort("shop", service, port_name, protocol, port, cluster_ip, None, None, False, False, tuple(endpoints))


TABLE = sdns.names([
    sp("web", "http", "TCP", 80, "10.96.0.10"),
    sp("web", "dns", "UDP", 53, "10.96.0.10"),
    sp("db", "", "TCP", 5432, None, [Endpoint("10.244.1.5", 5432), Endpoint("10.244.2.5", 5432, ready=False)]),
], "cluster.local")  # fmt: skip


def ask(name: str, rdtype: str = "A") -> dns.message.Message | None:
    return sdns.resolve(TABLE, dns.message.make_query(name, rdtype))


def lines(section) -> list[str]:
    return [line for rr in section for line in rr.to_text().splitlines()]


def test_a_records_cluster_ip_and_headless_ready_endpoints():
    r = ask("web.shop.svc.cluster.local")
    assert r is not None and r.rcode() == dns.rcode.NOERROR and r.flags & dns.flags.AA
    assert lines(r.answer) == ["web.shop.svc.cluster.local. 5 IN A 10.96.0.10"]
    assert lines(ask("DB.Shop.svc.cluster.local.").answer) == ["DB.Shop.svc.cluster.local. 5 IN A 10.244.1.5"]


def test_srv_for_named_ports_with_the_target_in_additional():
    r = ask("_http._tcp.web.shop.svc.cluster.local", "SRV")
    assert lines(r.answer) == ["_http._tcp.web.shop.svc.cluster.local. 5 IN SRV 0 100 80 web.shop.svc.cluster.local."]
    assert lines(r.additional) == ["web.shop.svc.cluster.local. 5 IN A 10.96.0.10"]
    assert lines(ask("_dns._udp.web.shop.svc.cluster.local", "SRV").answer)[0].endswith("SRV 0 100 53 web.shop.svc.cluster.local.")
    assert ask("_http._udp.web.shop.svc.cluster.local", "SRV").rcode() == dns.rcode.NXDOMAIN


def test_unknown_names_empty_branches_and_other_types():
    assert ask("nope.shop.svc.cluster.local").rcode() == dns.rcode.NXDOMAIN
    for branch in ("shop.svc.cluster.local", "svc.cluster.local", "cluster.local"):
        r = ask(branch)
        assert r.rcode() == dns.rcode.NOERROR and r.answer == [], branch
    r = ask("web.shop.svc.cluster.local", "AAAA")
    assert r.rcode() == dns.rcode.NOERROR and r.answer == []


def sp6(service: str, port_name: str, port: int, cluster_ip: str | None, endpoints=()) -> ServicePort:
    return ServicePort("shop", service, port_name, "TCP", port, cluster_ip, None, None, False, False, tuple(endpoints), 6)


DUAL = sdns.names([
    sp("web", "http", "TCP", 80, "10.96.0.10"), sp6("web", "http", 80, "fd00:10:96::a"),  # dual-stack
    sp6("six", "", 80, "fd00:10:96::b"),  # IPv6 only
    sp("hl", "", "TCP", 80, None, [Endpoint("10.244.1.5", 80)]),  # headless, dual-stack
    sp6("hl", "", 80, None, [Endpoint("fd00:10:244:1::5", 80), Endpoint("fd00:10:244:2::5", 80, ready=False)]),
], "cluster.local")  # fmt: skip


def ask6(name: str, rdtype: str) -> dns.message.Message:
    r = sdns.resolve(DUAL, dns.message.make_query(name, rdtype))
    assert r is not None and r.rcode() == dns.rcode.NOERROR and r.flags & dns.flags.AA, r
    return r


def test_aaaa_and_a_per_the_services_families():
    assert lines(ask6("web.shop.svc.cluster.local", "AAAA").answer) == ["web.shop.svc.cluster.local. 5 IN AAAA fd00:10:96::a"]
    assert lines(ask6("web.shop.svc.cluster.local", "A").answer) == ["web.shop.svc.cluster.local. 5 IN A 10.96.0.10"]
    assert lines(ask6("six.shop.svc.cluster.local", "AAAA").answer) == ["six.shop.svc.cluster.local. 5 IN AAAA fd00:10:96::b"]
    assert ask6("six.shop.svc.cluster.local", "A").answer == []  # the name exists: NOERROR, no record
    # Headless: the ready endpoints of each family.
    assert lines(ask6("hl.shop.svc.cluster.local", "A").answer) == ["hl.shop.svc.cluster.local. 5 IN A 10.244.1.5"]
    assert lines(ask6("hl.shop.svc.cluster.local", "AAAA").answer) == ["hl.shop.svc.cluster.local. 5 IN AAAA fd00:10:244:1::5"]
    assert sorted(lines(ask6("hl.shop.svc.cluster.local", "ANY").answer)) == [
        "hl.shop.svc.cluster.local. 5 IN A 10.244.1.5", "hl.shop.svc.cluster.local. 5 IN AAAA fd00:10:244:1::5"]
    # SRV: the target's records of both families in the additional section.
    r = ask6("_http._tcp.web.shop.svc.cluster.local", "SRV")
    assert lines(r.additional) == ["web.shop.svc.cluster.local. 5 IN A 10.96.0.10", "web.shop.svc.cluster.local. 5 IN AAAA fd00:10:96::a"]
    assert sdns.resolve(DUAL, dns.message.make_query("nope.shop.svc.cluster.local", "AAAA")).rcode() == dns.rcode.NXDOMAIN


def test_other_names_are_forwarded():
    assert ask("www.example.org") is None
    assert ask("cluster.local.example.org") is None
    assert sdns.resolve(TABLE, dns.message.Message()).rcode() == dns.rcode.FORMERR  # no question


async def test_server_answer_drops_garbage_and_servfails_without_upstreams():
    server = sdns.DnsServer("127.0.0.1", 0, lambda: TABLE, [])
    assert await server.answer(b"\x00\x01garbage") is None
    wire = await server.answer(dns.message.make_query("www.example.org", "A").to_wire())
    assert dns.message.from_wire(wire).rcode() == dns.rcode.SERVFAIL and server.failed == 1


async def test_an_answer_too_big_for_udp_is_truncated_with_tc_and_whole_over_tcp():
    """A headless Service with 40 endpoints: 40 A records (656 octets) exceed the 512 octets
    of a query without EDNS (glibc's): the UDP answer is cut and marked TC, so the client asks
    again over TCP, which gets all 40; an EDNS payload size that fits gets them all over UDP.
    The cut keeps as many records as fit (as CoreDNS does): a resolver that never retries over
    TCP (musl before 1.2.4) still gets addresses."""
    endpoints = [Endpoint(f"10.244.{i // 200}.{i % 200 + 2}", 80) for i in range(40)]
    table = sdns.names([sp("big", "", "TCP", 80, None, endpoints)], "cluster.local")
    server = sdns.DnsServer("127.0.0.1", 0, lambda: table, [])
    name = "big.shop.svc.cluster.local"
    wire = await server.answer(dns.message.make_query(name, "A").to_wire())
    udp = dns.message.from_wire(wire)
    assert len(wire) <= 512 and udp.flags & dns.flags.TC and udp.rcode() == dns.rcode.NOERROR
    assert 20 <= len(udp.answer[0]) < 40 and udp.question[0].name.to_text() == name + "."
    assert {r.address for r in udp.answer[0]} <= {e.ip for e in endpoints}
    tcp = dns.message.from_wire(await server.answer(dns.message.make_query(name, "A").to_wire(), tcp=True))
    assert not tcp.flags & dns.flags.TC and len(tcp.answer[0]) == 40
    edns = dns.message.from_wire(await server.answer(dns.message.make_query(name, "A", use_edns=0, payload=1232).to_wire()))
    assert not edns.flags & dns.flags.TC and len(edns.answer[0]) == 40 and edns.edns == 0
    small = await server.answer(dns.message.make_query(name, "A", use_edns=0, payload=600).to_wire())
    cut = dns.message.from_wire(small)
    assert len(small) <= 600 and cut.flags & dns.flags.TC and len(cut.answer[0]) > len(udp.answer[0]) and cut.edns == 0


def many(n: int) -> list[Endpoint]:
    return [Endpoint(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 80) for i in range(1, n + 1)]


async def test_cutting_an_answer_renders_it_a_few_times_not_once_per_record(monkeypatch):
    """1,000 endpoints over UDP with EDNS 4096: the cut keeps as many records as fit, found
    without rendering the message once per record kept (252 renderings, each of all the records
    before: a second of the event loop per query)."""
    table = sdns.names([sp("big", "", "TCP", 80, None, many(1000))], "cluster.local")
    server = sdns.DnsServer("127.0.0.1", 0, lambda: table, [])
    renders = []
    to_wire = dns.message.Message.to_wire

    def counted(self, *args, **kw):
        renders.append(1)
        return to_wire(self, *args, **kw)

    monkeypatch.setattr(dns.message.Message, "to_wire", counted)
    query = dns.message.make_query("big.shop.svc.cluster.local", "A", use_edns=0, payload=4096)
    wire = await server.answer(query.to_wire())
    renders.clear()
    wire = await server.answer(query.to_wire())
    cut = dns.message.from_wire(wire)
    assert len(renders) < 20, len(renders)
    assert cut.flags & dns.flags.TC and 4096 - 16 < len(wire) <= 4096 and len(cut.answer[0]) == 252


async def test_an_answer_over_64k_keeps_the_records_that_fit_over_tcp_too():
    """5,000 A records take 80,000 octets, more than a DNS message holds: the answer keeps
    the 4,000 and more that fit in 65535 octets, TC set (as CoreDNS's), over TCP and UDP alike;
    it was an empty TC answer even over TCP, so that no client ever had an address."""
    table = sdns.names([sp("big", "", "TCP", 80, None, many(5000))], "cluster.local")
    server = sdns.DnsServer("127.0.0.1", 0, lambda: table, [])
    name = "big.shop.svc.cluster.local"
    wire = await server.answer(dns.message.make_query(name, "A").to_wire(), tcp=True)
    tcp = dns.message.from_wire(wire)
    assert tcp.flags & dns.flags.TC and len(wire) <= 65535 and len(tcp.answer[0]) >= 4000
    assert {r.address for r in tcp.answer[0]} <= {e.ip for e in many(5000)}
    udp = dns.message.from_wire(await server.answer(dns.message.make_query(name, "A", use_edns=0, payload=4096).to_wire()))
    assert udp.flags & dns.flags.TC and len(udp.answer[0]) == 252


def test_host_resolvers_skip_our_own_address(tmp_path):
    conf = tmp_path / "resolv.conf"
    conf.write_text("search x\nnameserver 192.0.2.53\nnameserver 169.254.20.10\nnameserver fd00::1\n"
                    "nameserver FD00:169:254:20:0::10\nnameserver fe80::1%eth0\nnameserver bogus\n")
    # IPv6 servers too (an IPv6-only host has no other); ours in any spelling, a zoned one and junk not.
    assert sdns.host_resolvers(str(conf), exclude=["169.254.20.10", "fd00:169:254:20::10"]) == [
        ("192.0.2.53", 53), ("fd00::1", 53)]
    assert sdns.host_resolvers(str(tmp_path / "missing")) == []


def test_dns_config_keys():
    base = {"node.name": "n1", "node.address": "192.0.2.1"}
    cfg = load_config(None, env={}, overrides=base)
    assert (cfg.dns.enabled, cfg.dns.address, cfg.dns.cluster_domain, cfg.dns.upstream) == (
        True, IPv4Address("169.254.20.10"), "cluster.local", ())  # fmt: skip
    cfg = load_config(None, env={}, overrides={
        **base, "dns.cluster_domain": "Corp.Example.", "dns.upstream": "192.0.2.53, 192.0.2.54:5353"})  # fmt: skip
    assert cfg.dns.cluster_domain == "corp.example" and cfg.dns.upstream == ("192.0.2.53:53", "192.0.2.54:5353")
    cfg = load_config(None, env={}, overrides={**base, "dns.upstream": "2001:db8::53, [2001:DB8::54]:5353, [192.0.2.9]"})
    assert cfg.dns.upstream == ("[2001:db8::53]:53", "[2001:db8::54]:5353", "192.0.2.9:53")
    assert sdns.upstream_pairs(cfg.dns.upstream) == [("2001:db8::53", 53), ("2001:db8::54", 5353), ("192.0.2.9", 53)]
    for key, bad, why in (("dns.address", "127.0.0.2", "loopback"), ("dns.cluster_domain", "a..b", "domain name"),
                          ("dns.upstream", "x", "IPv4, IPv4:PORT, IPv6"), ("dns.upstream", "192.0.2.1:0", "1..65535"),
                          # past int()'s 4300 digits: its ValueError was a traceback
                          ("dns.upstream", "192.0.2.1:" + "9" * 5000, r"'192\.0\.2\.1:9+\.\.\.: the port must be 1\.\.65535"),
                          ("dns.upstream", "[2001:db8::1]:" + "0" * 5000 + "53", "1..65535"),
                          ("dns.upstream", "[fe80::1%eth0]:53", "IPv6"), ("dns.upstream", "[2001:db8::1]:x", "IPv6"),
                          ("dns.upstream", "0.0.0.0", "unicast"), ("dns.upstream", "2001:db8::1:53:", "IPv6"),
                          # inside the pod network or the service range, as for address_v6: pods' queries
                          # to it would be routed to a pod or a Service, not to their node
                          ("dns.address", "10.244.0.10", "node-local DNS address 10.244.0.10 is inside the pod network 10.244.0.0/16"),
                          ("dns.address", "10.96.0.10", "node-local DNS address 10.96.0.10 is inside the service range 10.96.0.0/12"),
                          # the node-local address itself: the agent would forward to itself
                          ("dns.upstream", "169.254.20.10", r"169.254.20.10:53 is the node-local DNS address \(\[dns\] address\) itself"),
                          ("dns.upstream", "192.0.2.53, [fd00:169:254:20::10]:53", r"\[dns\] address_v6\) itself")):  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            load_config(None, env={}, overrides={**base, key: bad})
    # Another port of the address, or DNS off: no loop.
    for more in ({"dns.upstream": "169.254.20.10:5353"}, {"dns.upstream": "169.254.20.10", "dns.enabled": "false"},
                 {"dns.address": "10.244.0.10", "dns.enabled": "false"}):
        load_config(None, env={}, overrides={**base, **more})
    # IPv6-only: no IPv4 pod asks [dns] address.
    load_config(None, env={}, overrides={"node.name": "n1", "node.address_v6": "2001:db8::1", "network.ip_family": "ipv6",
                                         "network.backend": "vxlan", "dns.address": "10.244.0.10"})  # fmt: skip


def test_subnet_file_and_cni_result_carry_the_pods_dns():
    sf = SubnetFile(IPv4Network("10.244.0.0/16"), IPv4Network("10.244.3.0/24"), 1450, dns=IPv4Address("169.254.20.10"))
    text = render_subnet_file(sf)
    assert "AGENTD_DNS=169.254.20.10\nAGENTD_CLUSTER_DOMAIN=cluster.local\n" in text
    assert parse_subnet_file(text) == sf
    assert dns_config(sf, "shop") == {"nameservers": ["169.254.20.10"], "options": ["ndots:5"],
                                      "search": ["shop.svc.cluster.local", "svc.cluster.local", "cluster.local"]}  # fmt: skip
    assert dns_config(sf, None)["search"] == ["svc.cluster.local", "cluster.local"]
    plain = SubnetFile(IPv4Network("10.244.0.0/16"), IPv4Network("10.244.3.0/24"), 1450)
    assert "AGENTD_DNS" not in render_subnet_file(plain) and dns_config(plain, "shop") is None


def test_pods_without_ipv4_get_the_ipv6_dns_address():
    from ipaddress import IPv6Address, IPv6Network

    base = {"node.name": "n1", "node.address_v6": "2001:db8::1", "network.ip_family": "ipv6", "network.backend": "vxlan"}
    cfg = load_config(None, env={}, overrides=base)
    assert cfg.dns.address_v6 == IPv6Address("fd00:169:254:20::10")
    for bad, why in (("fe80::10", "not loopback, link-local"), ("169.254.20.10", "must be an IPv6 address"),
                     ("fd00:10:244:9::10", "inside the IPv6 pod network"), ("fd00:10:96::10", "inside the IPv6 service range")):  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            load_config(None, env={}, overrides={**base, "dns.address_v6": bad})
    sf = SubnetFile(None, None, 1430, network_v6=IPv6Network("fd00:10:244::/48"), subnet_v6=IPv6Network("fd00:10:244:3::/64"),
                    dns_v6=IPv6Address("fd00:169:254:20::10"))  # fmt: skip
    text = render_subnet_file(sf)
    assert "AGENTD_DNS_V6=fd00:169:254:20::10\nAGENTD_CLUSTER_DOMAIN=cluster.local\n" in text and "AGENTD_DNS=" not in text
    assert parse_subnet_file(text) == sf
    assert dns_config(sf, "shop")["nameservers"] == ["fd00:169:254:20::10"]
    with pytest.raises(SubnetFileError, match="AGENTD_DNS_V6 '169.254.20.10' is not an IPv6 address"):
        parse_subnet_file(text.replace("fd00:169:254:20::10", "169.254.20.10"))



def test_before_the_services_were_read_the_domain_is_servfail_not_nxdomain():
    """A just-started agent has not read the Services yet: a cluster name is SERVFAIL (retried),
    never an authoritative NXDOMAIN (final, and cached by clients); others are forwarded."""
    empty = sdns.Names("cluster.local", ready=False)
    r = sdns.resolve(empty, dns.message.make_query("kubernetes.default.svc.cluster.local", "A"))
    assert r.rcode() == dns.rcode.SERVFAIL and not r.flags & dns.flags.AA
    assert sdns.resolve(empty, dns.message.make_query("example.com", "A")) is None
    assert sdns.names([], "cluster.local").ready  # once read, even with no Service at all


def test_a_headless_services_srv_records_give_the_endpoints_ports():
    """Nothing translates a headless Service, so its SRV records name the port the endpoints
    listen on (the Kubernetes DNS specification, 2.4.1), not the Service's port."""
    table = sdns.names([sp("h", "http", "TCP", 80, None, [Endpoint("10.244.1.5", 8080), Endpoint("10.244.2.5", 8081)])],
                       "cluster.local")
    r = sdns.resolve(table, dns.message.make_query("_http._tcp.h.shop.svc.cluster.local", "SRV"))
    assert sorted(lines(r.answer)) == [
        "_http._tcp.h.shop.svc.cluster.local. 5 IN SRV 0 100 8080 10-244-1-5.h.shop.svc.cluster.local.",
        "_http._tcp.h.shop.svc.cluster.local. 5 IN SRV 0 100 8081 10-244-2-5.h.shop.svc.cluster.local."]


async def test_an_upstream_that_closes_tcp_unanswered_is_a_failure_and_the_next_is_asked(monkeypatch):
    """dnspython raises a bare EOFError when a TCP upstream closes without an answer: asked for
    a TCP client, that upstream failed, the next one is asked, and with none left the client
    gets SERVFAIL.  (A UDP client's query answered truncated over UDP is answered: below.)"""
    import dns.asyncquery

    asked = []

    async def udp(query, host, **kw):
        asked.append(("udp", host))
        raise AssertionError("a TCP client's query is forwarded over TCP")

    async def tcp(query, host, **kw):
        asked.append(("tcp", host))
        raise EOFError

    monkeypatch.setattr(dns.asyncquery, "udp", udp)
    monkeypatch.setattr(dns.asyncquery, "tcp", tcp)
    server = sdns.DnsServer("127.0.0.1", 53, lambda: TABLE, [("192.0.2.1", 53), ("192.0.2.2", 53)])
    out = dns.message.from_wire(await server.answer(dns.message.make_query("example.com", "A").to_wire(), tcp=True))
    assert out.rcode() == dns.rcode.SERVFAIL and server.failed == 1
    assert asked == [("tcp", "192.0.2.1"), ("tcp", "192.0.2.2")]
    assert [u["fails"] for u in server.upstreams.status(0)] == [1, 1]


def test_branches_follow_services_coming_and_going():
    """The empty non-terminals are counted, not searched for: one Service's names going
    leaves the branch while another Service of the namespace has names under it."""
    table = sdns.names([sp("web", "", "TCP", 80, "10.96.0.10"), sp("db", "", "TCP", 5432, "10.96.0.11")], "cluster.local")
    assert dict(table.branches) == {"shop.svc.cluster.local.": 2, "svc.cluster.local.": 2, "cluster.local.": 2}
    table.add_hosts(["web.shop.svc.cluster.local."], -1)
    assert sdns.resolve(table, dns.message.make_query("shop.svc.cluster.local", "A")).rcode() == dns.rcode.NOERROR
    table.add_hosts(["db.shop.svc.cluster.local."], -1)
    assert not table.branches
    assert sdns.resolve(table, dns.message.make_query("shop.svc.cluster.local", "A")).rcode() == dns.rcode.NXDOMAIN


def test_a_headless_service_without_ports_has_its_endpoints_addresses():
    """Kubernetes allows a headless Service without ports (a StatefulSet's governing Service
    may have none): its name still gives the addresses of what it selects, as CoreDNS does."""
    from agentd.resources import manifests
    from agentd.services import model

    text = """\
apiVersion: v1
kind: Service
metadata: {name: peers, namespace: shop}
spec: {clusterIP: None, selector: {app: db}}
"""
    (svc,) = manifests.validate_all(manifests.read(text, "f.yaml"), "f.yaml")
    pod = {"kind": "Pod", "metadata": {"name": "db-0", "namespace": "shop", "labels": {"app": "db"}},
           "spec": {"nodeName": "node1", "containers": []}, "status": {"podIP": "10.244.1.7"}}
    table = sdns.names(model.build([svc], [], [pod]), "cluster.local")
    r = sdns.resolve(table, dns.message.make_query("peers.shop.svc.cluster.local", "A"))
    assert lines(r.answer) == ["peers.shop.svc.cluster.local. 5 IN A 10.244.1.7"]
    # The same from an EndpointSlice (a Service without a selector).
    text = """\
apiVersion: v1
kind: Service
metadata: {name: peers, namespace: shop}
spec: {clusterIP: None}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: peers-1, namespace: shop, labels: {kubernetes.io/service-name: peers}}
addressType: IPv4
endpoints: [{addresses: [10.244.2.8], conditions: {ready: true}}]
"""
    svc, eps = manifests.validate_all(manifests.read(text, "f.yaml"), "f.yaml")
    table = sdns.names(model.build([svc], [eps], []), "cluster.local")
    r = sdns.resolve(table, dns.message.make_query("peers.shop.svc.cluster.local", "A"))
    assert lines(r.answer) == ["peers.shop.svc.cluster.local. 5 IN A 10.244.2.8"]


def test_negative_answers_carry_the_domains_soa():
    """RFC 2308: an NXDOMAIN or a NODATA answer carries the zone's SOA, whose minimum tells
    caches how long to keep the "no" (CoreDNS's kubernetes plugin does the same)."""
    for name, rdtype, rcode in (("nope.shop.svc.cluster.local", "A", dns.rcode.NXDOMAIN),
                                ("web.shop.svc.cluster.local", "AAAA", dns.rcode.NOERROR)):
        r = ask(name, rdtype)
        assert r.rcode() == rcode and r.answer == []
        assert lines(r.authority) == ["cluster.local. 5 IN SOA ns.dns.cluster.local. hostmaster.cluster.local. 1 7200 1800 86400 5"]
    assert ask("web.shop.svc.cluster.local").authority == []


def test_a_headless_service_with_only_terminating_endpoints_has_no_name():
    """The Kubernetes DNS specification 2.4.1: "If there are no ready endpoints for the
    headless Service, the answer should be NXDOMAIN" (CoreDNS alike): A and AAAA, with the SOA."""
    table = sdns.names([sp("h", "http", "TCP", 80, None, [Endpoint("10.244.1.5", 8080, ready=False, terminating=True)])],
                       "cluster.local")
    for rdtype in ("A", "AAAA", "ANY"):
        r = sdns.resolve(table, dns.message.make_query("h.shop.svc.cluster.local", rdtype))
        assert r.rcode() == dns.rcode.NXDOMAIN and r.answer == [] and r.flags & dns.flags.AA, rdtype
        assert lines(r.authority)[0].startswith("cluster.local. 5 IN SOA"), rdtype
    r = sdns.resolve(table, dns.message.make_query("10-244-1-5.h.shop.svc.cluster.local", "A"))
    assert r.rcode() == dns.rcode.NXDOMAIN


def test_a_headless_services_srv_name_without_ready_endpoints_is_nxdomain_that_clients_can_read():
    table = sdns.names([sp("h", "pg", "TCP", 5432, None, [Endpoint("10.244.1.5", 5432, ready=False, terminating=True)])],
                       "cluster.local")
    for rdtype in ("SRV", "ANY"):
        r = sdns.resolve(table, dns.message.make_query("_pg._tcp.h.shop.svc.cluster.local", rdtype))
        parsed = dns.message.from_wire(r.to_wire())  # an empty SRV record would be FORMERR here
        assert parsed.rcode() == dns.rcode.NXDOMAIN and parsed.answer == [], rdtype
        assert lines(parsed.authority)[0].startswith("cluster.local. 5 IN SOA")


def test_a_headless_services_name_exists_while_either_family_has_a_ready_endpoint():
    """Ready endpoints of IPv4 only: the name's AAAA is NODATA (it exists), not NXDOMAIN; its
    SRV name has the IPv4 endpoints; none ready of either family: no name, no SRV name."""
    ready4 = sdns.names([sp("h", "pg", "TCP", 5432, None, [Endpoint("10.244.1.5", 5432)]),
                         sp6("h", "pg", 5432, None, [Endpoint("fd00:10:244:1::5", 5432, ready=False)])],
                        "cluster.local")  # fmt: skip
    r = sdns.resolve(ready4, dns.message.make_query("h.shop.svc.cluster.local", "AAAA"))
    assert r.rcode() == dns.rcode.NOERROR and r.answer == [] and lines(r.authority)[0].startswith("cluster.local. 5 IN SOA")
    r = sdns.resolve(ready4, dns.message.make_query("_pg._tcp.h.shop.svc.cluster.local", "SRV"))
    assert lines(r.answer) == ["_pg._tcp.h.shop.svc.cluster.local. 5 IN SRV 0 100 5432 10-244-1-5.h.shop.svc.cluster.local."]
    none = sdns.names([sp("h", "pg", "TCP", 5432, None, [Endpoint("10.244.1.5", 5432, ready=False)]),
                       sp6("h", "pg", 5432, None, [Endpoint("fd00:10:244:1::5", 5432, ready=False)])],
                      "cluster.local")  # fmt: skip
    for name, rdtype in (("h.shop.svc.cluster.local", "A"), ("h.shop.svc.cluster.local", "AAAA"),
                         ("_pg._tcp.h.shop.svc.cluster.local", "SRV")):  # fmt: skip
        r = sdns.resolve(none, dns.message.make_query(name, rdtype))
        assert r.rcode() == dns.rcode.NXDOMAIN and lines(r.authority)[0].startswith("cluster.local. 5 IN SOA"), (name, rdtype)


async def test_query_outcomes_are_monotonic_counters_counted_once_when_the_reply_is_made(monkeypatch):
    """agentd_dns_queries_total{outcome}: a query forwarded to a slow upstream is in no outcome
    until the upstream answers or fails; then it is in one.  No series ever goes down (it was
    forwarded - failed, which fell below zero while an upstream was slow: Prometheus saw a
    counter reset)."""
    import asyncio
    from types import SimpleNamespace

    import dns.asyncquery
    import dns.exception
    from prometheus_client import CollectorRegistry

    from agentd.services.views import ServiceViews

    release = asyncio.Event()
    answer_next = []

    async def udp(query, host, **kw):
        await release.wait()
        if answer_next.pop(0):
            return dns.message.make_response(query)
        raise dns.exception.Timeout()

    monkeypatch.setattr(dns.asyncquery, "udp", udp)
    server = sdns.DnsServer("127.0.0.1", 53, lambda: TABLE, [("192.0.2.1", 53)])

    state = SimpleNamespace(node="n1", applied_revision=1, error=None, error_dns=None, syncs=1, sync_errors=0, last_sync=None, flushed=0,
                            counters={}, ports=[], port_count=0, dns_server=server,
                            dns_outcomes=lambda: dict(server.outcomes))  # fmt: skip
    registry = CollectorRegistry()
    registry.register(ServiceViews(state))  # type: ignore[arg-type]
    seen: list[dict[str, float]] = []

    def scrape() -> dict[str, float]:
        now = {o: registry.get_sample_value("agentd_dns_queries_total", {"outcome": o}) for o in ("answered", "forwarded", "servfail")}
        for before in seen:
            assert all(now[o] >= before[o] for o in now), (before, now)
        seen.append(now)
        return now

    query = dns.message.make_query("www.example.org", "A").to_wire()
    assert await server.answer(dns.message.make_query("web.shop.svc.cluster.local", "A").to_wire()) is not None
    assert await server.answer(b"\x00\x01garbage") is None
    answer_next[:] = [False, True]
    slow = [asyncio.create_task(server.answer(query)) for _ in range(2)]
    await asyncio.sleep(0)  # both reach the upstream
    assert scrape() == {"answered": 1, "forwarded": 0, "servfail": 0}  # in flight: in none
    release.set()
    replies = [dns.message.from_wire(await t) for t in slow]
    assert [r.rcode() for r in replies] == [dns.rcode.SERVFAIL, dns.rcode.NOERROR]
    assert scrape() == {"answered": 1, "forwarded": 1, "servfail": 1}
    assert (server.queries, server.forwarded, server.failed) == (4, 2, 1)


async def test_forwarded_queries_in_flight_are_bounded_and_the_rest_servfail_at_once(monkeypatch):
    """An upstream that never answers: MAX_FORWARDED queries wait on it (a socket each in
    real life), the next is SERVFAIL at once without asking any upstream (as CoreDNS
    forward's max_concurrent), counted as rejected; once answers come, forwarding goes on."""
    import asyncio

    import dns.asyncquery

    asked = 0
    answer_now = asyncio.Event()
    waiting = asyncio.Event()

    async def udp(query, host, **kw):  # the upstream: holds every query until told to answer
        nonlocal asked
        asked += 1
        if asked == sdns.MAX_FORWARDED:
            waiting.set()
        await answer_now.wait()
        return dns.message.make_response(query)

    monkeypatch.setattr(dns.asyncquery, "udp", udp)
    server = sdns.DnsServer("127.0.0.1", 53, lambda: TABLE, [("192.0.2.1", 53), ("192.0.2.2", 53)])
    query = dns.message.make_query("example.com", "A").to_wire()
    async with asyncio.timeout(10):
        held = [asyncio.create_task(server.answer(query)) for _ in range(sdns.MAX_FORWARDED)]
        await waiting.wait()
        assert server.in_flight == sdns.MAX_FORWARDED == 1000
        out = dns.message.from_wire(await server.answer(query))  # at once: the upstream never answers yet
        assert out.rcode() == dns.rcode.SERVFAIL
        assert asked == sdns.MAX_FORWARDED and server.rejected == 1 and server.failed == 0
        answer_now.set()
        replies = await asyncio.gather(*held)
        assert all(dns.message.from_wire(r).rcode() == dns.rcode.NOERROR for r in replies)
        assert server.in_flight == 0
        assert dns.message.from_wire(await server.answer(query)).rcode() == dns.rcode.NOERROR
    assert (server.queries, server.forwarded, server.rejected) == (sdns.MAX_FORWARDED + 2, sdns.MAX_FORWARDED + 1, 1)


async def test_tcp_clients_open_at_once_are_bounded_and_the_rest_closed_at_once():
    """Each TCP client holds a socket (up to 10 s idle): MAX_TCP_CLIENTS may be open at once; a
    connection over that is closed at once without being read, counted as rejected."""
    import asyncio

    class Reader:
        def __init__(self, data: bytes = b"", hold: bool = True) -> None:
            self.data, self.hold = data, hold

        async def readexactly(self, n: int) -> bytes:
            if self.data:
                out, self.data = self.data[:n], self.data[n:]
                return out
            if self.hold:
                await asyncio.Event().wait()  # an idle client: until cancelled
            raise asyncio.IncompleteReadError(b"", n)

    class Transport:
        def get_write_buffer_size(self) -> int:
            return 0  # everything written went

    class Writer:
        def __init__(self) -> None:
            self.closed, self.sent, self.transport = False, b"", Transport()

        def write(self, data: bytes) -> None:
            self.sent += data

        async def drain(self) -> None:
            pass

        def close(self) -> None:
            self.closed = True

    server = sdns.DnsServer("127.0.0.1", 53, lambda: TABLE, [])
    limit = 1000  # sdns.MAX_TCP_CLIENTS
    writers = [Writer() for _ in range(limit)]
    held = [asyncio.create_task(server._tcp_client(Reader(), w)) for w in writers]  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert not any(w.closed for w in writers)
    query = dns.message.make_query("web.shop.svc.cluster.local", "A").to_wire()
    extra = Writer()
    await server._tcp_client(Reader(len(query).to_bytes(2, "big") + query, hold=False), extra)  # type: ignore[arg-type]
    assert extra.closed and extra.sent == b"" and server.rejected == 1 and server.queries == 0
    for t in held:
        t.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    assert server.tcp_clients == 0 and all(w.closed for w in writers)
    served = Writer()
    await server._tcp_client(Reader(len(query).to_bytes(2, "big") + query, hold=False), served)  # type: ignore[arg-type]
    assert served.closed and dns.message.from_wire(served.sent[2:]).rcode() == dns.rcode.NOERROR
    assert server.rejected == 1 and sdns.MAX_TCP_CLIENTS == limit


def test_only_pods_the_node_and_loopback_may_ask():
    """Not an open resolver on the underlay segment: the pod networks (both families), the
    node's own addresses and loopback are answered, anyone else is not; the node's addresses
    are listed again at most every LOCAL_REFRESH seconds for an unknown source."""
    now, listings = [0.0], []

    def local() -> set:
        listings.append(now[0])
        return {IPv4Address("192.0.2.10"), sdns.ipaddress.ip_address("2001:db8::10")}

    clients = sdns.Clients(["10.244.0.0/16", "fd00:10:244::/48", "169.254.20.10"], local=local, clock=lambda: now[0])
    for source in ("10.244.3.7", "fd00:10:244:3::7", "127.0.0.1", "::1", "169.254.20.10", "::ffff:10.244.1.2"):
        assert clients.allowed(source), source
    assert listings == []  # none of those needed the node's addresses
    assert clients.allowed("192.0.2.10") and clients.allowed("2001:db8::10") and listings == [0.0]
    for source in ("192.0.2.99", "10.245.0.1", "2001:db8::99", "fe80::1%eth0", "garbage"):
        assert not clients.allowed(source), source
    assert listings == [0.0]  # a flood of strangers: no listing per datagram
    now[0] = sdns.LOCAL_REFRESH
    assert not clients.allowed("192.0.2.99") and listings == [0.0, sdns.LOCAL_REFRESH]


async def test_queries_from_elsewhere_are_dropped_unanswered_and_counted_udp_and_tcp():
    import asyncio

    class Transport:
        def __init__(self) -> None:
            self.sent: list = []
            self.aborted = False

        def sendto(self, data: bytes, addr) -> None:
            self.sent.append((data, addr))

        def is_closing(self) -> bool:
            return False

        def abort(self) -> None:
            self.aborted = True

        def get_write_buffer_size(self) -> int:
            return 0  # everything written went

    class Reader:
        def __init__(self, data: bytes) -> None:
            self.data = data

        async def readexactly(self, n: int) -> bytes:
            if not self.data:
                raise asyncio.IncompleteReadError(b"", n)
            out, self.data = self.data[:n], self.data[n:]
            return out

    class Writer:
        def __init__(self, peer) -> None:
            self.peer, self.transport, self.sent, self.closed = peer, Transport(), b"", False

        def get_extra_info(self, name: str):
            return self.peer if name == "peername" else None

        def write(self, data: bytes) -> None:
            self.sent += data

        async def drain(self) -> None:
            pass

        def close(self) -> None:
            self.closed = True

    clients = sdns.Clients(["10.244.0.0/16"], local=lambda: {IPv4Address("192.0.2.10")}, clock=lambda: 0.0)
    server = sdns.DnsServer("169.254.20.10", 53, lambda: TABLE, [], clients=clients)
    query = dns.message.make_query("web.shop.svc.cluster.local", "A").to_wire()
    udp = Transport()
    assert server._datagram(udp, query, ("192.0.2.99", 4444)) is None  # type: ignore[arg-type]
    await server._datagram(udp, query, ("10.244.3.7", 5555))  # type: ignore[arg-type]
    assert [addr for _, addr in udp.sent] == [("10.244.3.7", 5555)]
    stranger, pod = Writer(("192.0.2.99", 4444)), Writer(("10.244.3.7", 5555))
    await server._tcp_client(Reader(len(query).to_bytes(2, "big") + query), stranger)  # type: ignore[arg-type]
    await server._tcp_client(Reader(len(query).to_bytes(2, "big") + query), pod)  # type: ignore[arg-type]
    assert stranger.transport.aborted and stranger.sent == b""
    assert dns.message.from_wire(pod.sent[2:]).rcode() == dns.rcode.NOERROR
    assert server.outcomes["foreign"] == 2 and server.outcomes["answered"] == 2 and server.queries == 2


def fake_upstream(monkeypatch) -> list[dns.message.Message]:
    """dnspython's queries to an upstream, recorded (each answered NOERROR, over UDP and TCP)."""
    import dns.asyncquery

    asked: list[dns.message.Message] = []

    async def ask(query, host, **kw):
        asked.append(query)
        return dns.message.make_response(query)

    monkeypatch.setattr(dns.asyncquery, "udp", ask)
    monkeypatch.setattr(dns.asyncquery, "tcp", ask)
    return asked


async def test_opcodes_other_than_query_are_not_implemented_and_never_forwarded(monkeypatch):
    """An UPDATE or a NOTIFY is no question to forward: an upstream would take it from the
    node's address (a pod's dynamic update to the site's DNS), and one for the cluster domain
    is no authoritative NOERROR (nothing was updated).  NOTIMP, as CoreDNS (miekg/dns) answers."""
    import dns.opcode
    import dns.update

    asked = fake_upstream(monkeypatch)
    server = sdns.DnsServer("127.0.0.1", 53, lambda: TABLE, [("192.0.2.1", 53)])
    for zone in ("corp.example.", "cluster.local."):
        update = dns.update.UpdateMessage(zone)
        update.add(f"evil.{zone}", 300, "A", "10.244.1.99")
        for tcp in (False, True):
            r = dns.message.from_wire(await server.answer(update.to_wire(), tcp=tcp))
            assert r.opcode() == dns.opcode.UPDATE and r.rcode() == dns.rcode.NOTIMP and not r.flags & dns.flags.AA
    notify = dns.message.make_query("corp.example.", "SOA")
    notify.set_opcode(dns.opcode.NOTIFY)
    r = dns.message.from_wire(await server.answer(notify.to_wire()))
    assert r.opcode() == dns.opcode.NOTIFY and r.rcode() == dns.rcode.NOTIMP
    assert asked == [] and server.forwarded == 0


async def test_a_response_sent_as_a_query_is_dropped_silently(monkeypatch, caplog):
    """A message with QR set is no query: dropped unanswered, not forwarded (where it held a
    forwarding slot for the upstream's timeout) and not logged per datagram (a flood of them
    was a warning each)."""
    import logging

    asked = fake_upstream(monkeypatch)
    server = sdns.DnsServer("127.0.0.1", 53, lambda: TABLE, [("192.0.2.1", 53)])

    class Transport:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def is_closing(self) -> bool:
            return False

        def sendto(self, data, addr) -> None:
            self.sent.append(data)

    caplog.set_level(logging.DEBUG, logger="agentd.services.dns")
    for name in ("example.com", "web.shop.svc.cluster.local"):
        response = dns.message.make_query(name, "A")
        response.flags |= dns.flags.QR
        assert await server.answer(response.to_wire()) is None
        assert await server.answer(response.to_wire(), tcp=True) is None
        transport = Transport()
        await server._udp_query(transport, response.to_wire(), ("10.244.1.5", 1234))  # type: ignore[arg-type]
        assert transport.sent == []
    assert asked == [] and server.forwarded == 0 and server.failed == 0
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


STATEFUL = """\
apiVersion: v1
kind: Service
metadata: {name: db, namespace: shop}
spec: {clusterIP: None, ipFamilyPolicy: PreferDualStack, ipFamilies: [IPv4, IPv6], ports: [{name: pg, port: 5432}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: db-v4, namespace: shop, labels: {kubernetes.io/service-name: db}}
addressType: IPv4
ports: [{name: pg, port: 5432, protocol: TCP}]
endpoints:
- {addresses: [10.244.1.5], hostname: db-0, conditions: {ready: true}}
- {addresses: [10.244.2.6], hostname: db-1, conditions: {ready: true}}
- {addresses: [10.244.3.7], conditions: {ready: true}}
- {addresses: [10.244.3.8], hostname: db-2, conditions: {ready: false}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: db-v6, namespace: shop, labels: {kubernetes.io/service-name: db}}
addressType: IPv6
ports: [{name: pg, port: 5432, protocol: TCP}]
endpoints:
- {addresses: ["fd00:10:244:1::5"], hostname: db-0, conditions: {ready: true}}
"""


def stateful_table_ports() -> list[ServicePort]:
    from agentd.resources import manifests
    from agentd.services import model

    svc, *slices = manifests.validate_all(manifests.read(STATEFUL, "f.yaml"), "f.yaml")
    return model.build([svc], slices, [])


def stateful_table() -> sdns.Names:
    return sdns.names(stateful_table_ports(), "cluster.local")


def test_a_headless_services_endpoints_have_their_own_names():
    """Kubernetes DNS specification 2.4.1: an endpoint of a headless Service with a hostname
    (a StatefulSet's pod: db-0) has <hostname>.<service>.<ns>.svc.<domain>, A and AAAA of
    its addresses; one without, its address with dashes (CoreDNS's name for it).  Not-ready
    endpoints have none; the Service's name still has every ready address."""
    table = stateful_table()

    def answer(name: str, rdtype: str) -> list[str]:
        r = sdns.resolve(table, dns.message.make_query(name, rdtype))
        assert r.rcode() == dns.rcode.NOERROR and r.flags & dns.flags.AA, (name, r)
        return [rr.split()[-1] for rr in lines(r.answer)]

    assert answer("db-0.db.shop.svc.cluster.local", "A") == ["10.244.1.5"]
    assert answer("DB-0.db.shop.svc.cluster.local", "AAAA") == ["fd00:10:244:1::5"]
    assert answer("db-1.db.shop.svc.cluster.local", "A") == ["10.244.2.6"]
    assert answer("db-1.db.shop.svc.cluster.local", "AAAA") == []  # NODATA: it has no IPv6 address
    assert answer("10-244-3-7.db.shop.svc.cluster.local", "A") == ["10.244.3.7"]
    assert sorted(answer("db.shop.svc.cluster.local", "A")) == ["10.244.1.5", "10.244.2.6", "10.244.3.7"]
    for gone in ("db-2.db.shop.svc.cluster.local", "10-244-3-8.db.shop.svc.cluster.local", "db-9.db.shop.svc.cluster.local"):
        assert sdns.resolve(table, dns.message.make_query(gone, "A")).rcode() == dns.rcode.NXDOMAIN, gone


def test_a_headless_services_srv_records_target_each_endpoints_own_name():
    """SRV of a headless Service: one per ready endpoint, with its own name as the target
    (the Kubernetes DNS specification 2.4.1; CoreDNS), each target's A and AAAA once in the
    additional section."""
    table = stateful_table()
    r = sdns.resolve(table, dns.message.make_query("_pg._tcp.db.shop.svc.cluster.local", "SRV"))
    assert sorted(lines(r.answer)) == [
        "_pg._tcp.db.shop.svc.cluster.local. 5 IN SRV 0 100 5432 10-244-3-7.db.shop.svc.cluster.local.",
        "_pg._tcp.db.shop.svc.cluster.local. 5 IN SRV 0 100 5432 db-0.db.shop.svc.cluster.local.",
        "_pg._tcp.db.shop.svc.cluster.local. 5 IN SRV 0 100 5432 db-1.db.shop.svc.cluster.local."]
    assert sorted(lines(r.additional)) == [
        "10-244-3-7.db.shop.svc.cluster.local. 5 IN A 10.244.3.7",
        "db-0.db.shop.svc.cluster.local. 5 IN A 10.244.1.5",
        "db-0.db.shop.svc.cluster.local. 5 IN AAAA fd00:10:244:1::5",
        "db-1.db.shop.svc.cluster.local. 5 IN A 10.244.2.6"]
    # A target named by two SRV records (one endpoint at two ports of one port name) is in the
    # additional section once: counted on the wire, which dnspython's parser would merge.
    table = sdns.names([sp("h", "http", "TCP", 80, None, [Endpoint("10.244.1.5", 80, hostname="web-0"),
                                                          Endpoint("10.244.1.5", 8080, hostname="web-0")])],
                       "cluster.local")  # fmt: skip
    r = sdns.resolve(table, dns.message.make_query("_http._tcp.h.shop.svc.cluster.local", "SRV"))
    assert sorted(lines(r.answer)) == ["_http._tcp.h.shop.svc.cluster.local. 5 IN SRV 0 100 80 web-0.h.shop.svc.cluster.local.",
                                       "_http._tcp.h.shop.svc.cluster.local. 5 IN SRV 0 100 8080 web-0.h.shop.svc.cluster.local."]
    wire = r.to_wire()
    assert int.from_bytes(wire[10:12], "big") == 1  # ARCOUNT
    assert lines(r.additional) == ["web-0.h.shop.svc.cluster.local. 5 IN A 10.244.1.5"]


async def test_an_srv_answer_whose_additional_records_do_not_fit_keeps_its_answers_without_tc():
    """RFC 2181 9: TC is for an answer cut, not for additional records left out."""
    endpoints = [Endpoint(f"10.244.1.{i}", 80, hostname=f"web-{i}") for i in range(1, 9)]
    table = sdns.names([sp("h", "http", "TCP", 80, None, endpoints)], "cluster.local")
    server = sdns.DnsServer("127.0.0.1", 0, lambda: table, [])
    wire = await server.answer(dns.message.make_query("_http._tcp.h.shop.svc.cluster.local", "SRV").to_wire())
    r = dns.message.from_wire(wire)
    assert len(wire) <= 512 and not r.flags & dns.flags.TC and len(r.answer[0]) == 8
    assert 0 < len(r.additional) < 8


def reverse(address: str) -> str:
    import ipaddress

    return ipaddress.ip_address(address).reverse_pointer


async def test_reverse_names_of_cluster_ips_and_headless_endpoints_are_answered(monkeypatch):
    """PTR (the Kubernetes DNS specification 2.3.3, 2.4.3): a cluster IP's reverse name gives
    its Service's name, a headless Service's ready endpoint's its own name, IPv4 and IPv6;
    another address of the Service ranges is NXDOMAIN (authoritative, with an SOA); any other
    address's reverse name (a pod's, the world's) is still forwarded.  They were all forwarded."""
    table = sdns.names([
        sp("web", "http", "TCP", 80, "10.96.0.10"), sp6("web", "http", 80, "fd00:10:96::a"),
        *stateful_table_ports(),
    ], "cluster.local")  # fmt: skip
    asked = fake_upstream(monkeypatch)
    server = sdns.DnsServer("127.0.0.1", 53, lambda: table, [("192.0.2.1", 53)],
                            service_ranges=["10.96.0.0/12", "fd00:10:96::/112"])

    async def ask(address: str, rdtype: str = "PTR") -> dns.message.Message:
        wire = await server.answer(dns.message.make_query(reverse(address), rdtype).to_wire())
        return dns.message.from_wire(wire)

    expected = {"10.96.0.10": "web.shop.svc.cluster.local.", "fd00:10:96::a": "web.shop.svc.cluster.local.",
                "10.244.1.5": "db-0.db.shop.svc.cluster.local.", "fd00:10:244:1::5": "db-0.db.shop.svc.cluster.local.",
                "10.244.3.7": "10-244-3-7.db.shop.svc.cluster.local."}  # fmt: skip
    for address, name in expected.items():
        r = await ask(address)
        assert r.rcode() == dns.rcode.NOERROR and r.flags & dns.flags.AA, address
        assert lines(r.answer) == [f"{reverse(address)}. 5 IN PTR {name}"]
    r = await ask("10.96.0.10", "A")  # the name exists, not with that type
    assert r.rcode() == dns.rcode.NOERROR and r.answer == [] and lines(r.authority)[0].startswith("in-addr.arpa. 5 IN SOA")
    for address, zone in (("10.96.0.99", "in-addr.arpa."), ("fd00:10:96::99", "ip6.arpa.")):
        r = await ask(address)
        assert r.rcode() == dns.rcode.NXDOMAIN and r.flags & dns.flags.AA and lines(r.authority)[0].startswith(f"{zone} 5 IN SOA")
    assert asked == [] and server.forwarded == 0
    for address in ("10.244.3.8", "192.0.2.7", "2001:db8::1"):  # a not-ready endpoint's, the world's
        assert (await ask(address)).rcode() == dns.rcode.NOERROR
    partial = dns.message.make_query("96.10.in-addr.arpa.", "PTR").to_wire()  # no address: not ours
    assert dns.message.from_wire(await server.answer(partial)).rcode() == dns.rcode.NOERROR
    assert [q.question[0].name.to_text() for q in asked] == [
        f"{reverse(a)}." for a in ("10.244.3.8", "192.0.2.7", "2001:db8::1")] + ["96.10.in-addr.arpa."]


def test_reverse_names_follow_services_changed_in_place():
    """The agent changes one Service's names in place (agentd.services.agent: add_hosts -1
    before its names are taken out, +1 after the new ones are put in): the reverse names follow."""
    table = sdns.names([sp("web", "", "TCP", 80, "10.96.0.10")], "cluster.local")
    key = f"{reverse('10.96.0.10')}."
    assert dict(table.ptr) == {key: {"web.shop.svc.cluster.local.": 1}}
    # web's cluster IP changes: out with the old names, in with the new ones.
    table.add_hosts(["web.shop.svc.cluster.local."], -1)
    table.a.pop("web.shop.svc.cluster.local.")
    table.aaaa.pop("web.shop.svc.cluster.local.")
    part = sdns.names([sp("web", "", "TCP", 80, "10.96.0.11")], "cluster.local")
    table.a.update(part.a)
    table.aaaa.update(part.aaaa)
    table.add_hosts(part.a)
    assert dict(table.ptr) == {f"{reverse('10.96.0.11')}.": {"web.shop.svc.cluster.local.": 1}}
    r = sdns.resolve(table, dns.message.make_query(reverse("10.96.0.10"), "PTR"), [IPv4Network("10.96.0.0/12")])
    assert r.rcode() == dns.rcode.NXDOMAIN


async def test_a_cut_keeps_every_record_that_fits_with_names_compressed_and_edns(caplog):
    """The cut's measuring pass writes what dnspython's renderer writes (owners compressed,
    SRV targets whole, AAAA, the OPT record at the end): the cut fits and leaves no room for
    one more record, whatever the limit."""
    import logging

    caplog.set_level(logging.DEBUG, logger="agentd.services.dns")
    endpoints = [Endpoint(f"10.244.{i // 250}.{i % 250 + 1}", 8000 + i, hostname=f"db-{i}") for i in range(300)]
    endpoints6 = [Endpoint(f"fd00:10:244::{i + 1:x}", 8000 + i, hostname=f"db-{i}") for i in range(300)]
    table = sdns.names([sp("db", "pg", "TCP", 5432, None, endpoints), sp6("db", "pg", 5432, None, endpoints6)], "cluster.local")
    server = sdns.DnsServer("127.0.0.1", 0, lambda: table, [])
    for name, rdtype, biggest in (("_pg._tcp.db.shop.svc.cluster.local", "SRV", 2 + 10 + 6 + len("db-299.db.shop.svc.cluster.local.") + 1),
                                  ("db.shop.svc.cluster.local", "ANY", 2 + 10 + 16),
                                  ("db.shop.svc.cluster.local", "AAAA", 2 + 10 + 16)):  # fmt: skip
        for edns, payload in ((False, 512), (0, 1232), (0, 4000), (0, 6000)):
            query = dns.message.make_query(name, rdtype, use_edns=edns, payload=payload)
            wire = await server.answer(query.to_wire())
            cut = dns.message.from_wire(wire)
            kept = sum(len(rrset) for rrset in cut.answer)
            assert cut.flags & dns.flags.TC and 0 < kept, (name, rdtype, payload)
            assert payload - biggest < len(wire) <= payload, (name, rdtype, payload, len(wire))
    assert not [r for r in caplog.records if "measured" in r.getMessage()]


async def test_an_edns_version_above_0_is_badvers_and_more_than_one_question_formerr(monkeypatch):
    """RFC 6891 §6.1.3: a query of an EDNS version the server does not speak gets BADVERS (with
    its own version, 0); a query of more than one question FORMERR (RFC 9619) -- whatever the
    name, before any is forwarded, as CoreDNS answers (it took the first question only, and an
    EDNS version 1 got NOERROR)."""
    asked = fake_upstream(monkeypatch)
    server = sdns.DnsServer("127.0.0.1", 53, lambda: TABLE, [("192.0.2.1", 53)])
    for name in ("web.shop.svc.cluster.local.", "www.example.org."):
        q = dns.message.make_query(name, "A", use_edns=1)
        r = dns.message.from_wire(await server.answer(q.to_wire()))
        assert r.rcode() == dns.rcode.BADVERS and r.edns == 0 and not r.answer, r
        q = dns.message.make_query(name, "A")
        q.question.append(dns.rrset.RRset(dns.name.from_text("bar.shop.svc.cluster.local."), dns.rdataclass.IN,
                                          dns.rdatatype.A))
        r = dns.message.from_wire(await server.answer(q.to_wire()), question_only=True)
        assert r.rcode() == dns.rcode.FORMERR and not r.answer, r
    assert asked == [] and server.forwarded == 0


async def test_a_class_other_than_in_is_refused_for_names_of_ours_and_forwarded_for_others(monkeypatch):
    """The cluster domain's records are IN's: a question of class CH, HS or ANY of one of its
    names (or of a reverse name answered here) is REFUSED, without records and not
    authoritative, never forwarded (CoreDNS's server refuses a class it does not serve).  It got
    the IN records, an answer of another class than asked.  ``version.bind CH TXT`` and any
    other name not ours is forwarded, as every other question is."""
    asked = fake_upstream(monkeypatch)
    server = sdns.DnsServer("127.0.0.1", 53, lambda: TABLE, [("192.0.2.1", 53)], service_ranges=["10.96.0.0/12"])
    ours = [("web.shop.svc.cluster.local.", "A"), ("DB.shop.svc.cluster.local.", "A"),
            ("_http._tcp.web.shop.svc.cluster.local.", "SRV"), ("nope.shop.svc.cluster.local.", "A"),
            ("svc.cluster.local.", "A"), ("cluster.local.", "SOA"), (f"{reverse('10.96.0.10')}.", "PTR"),
            (f"{reverse('10.96.0.99')}.", "PTR")]  # fmt: skip
    for rdclass in ("CH", "HS", "ANY"):
        for name, rdtype in ours:
            q = dns.message.make_query(name, rdtype, rdclass=rdclass)
            assert sdns.resolve(TABLE, q, [IPv4Network("10.96.0.0/12")]) is not None, (name, rdclass)
            r = dns.message.from_wire(await server.answer(q.to_wire()))
            assert r.rcode() == dns.rcode.REFUSED and not r.flags & dns.flags.AA, (name, rdclass, r)
            assert not r.answer and not r.authority and not r.additional, (name, rdclass, r)
    assert asked == [] and server.forwarded == 0
    for name, rdtype in (("version.bind.", "TXT"), ("www.example.org.", "A"), (f"{reverse('192.0.2.7')}.", "PTR")):
        q = dns.message.make_query(name, rdtype, rdclass="CH")
        assert sdns.resolve(TABLE, q, [IPv4Network("10.96.0.0/12")]) is None, name
        r = dns.message.from_wire(await server.answer(q.to_wire()))
        assert r.rcode() == dns.rcode.NOERROR and r.question[0].rdclass == dns.rdataclass.CH, name
    assert [(q.question[0].name.to_text(), q.question[0].rdclass) for q in asked] == [
        ("version.bind.", dns.rdataclass.CH), ("www.example.org.", dns.rdataclass.CH),
        (f"{reverse('192.0.2.7')}.", dns.rdataclass.CH)]
    r = sdns.resolve(TABLE, dns.message.make_query("web.shop.svc.cluster.local.", "A"))  # IN as before
    assert lines(r.answer) == ["web.shop.svc.cluster.local. 5 IN A 10.96.0.10"]


def test_a_pod_with_hostname_and_subdomain_of_a_headless_service_has_its_own_name():
    """Kubernetes: a pod with ``spec.hostname`` and ``spec.subdomain`` naming a headless Service
    of its namespace is ``<hostname>.<subdomain>.<ns>.svc.<domain>`` (A, AAAA, the SRV target,
    PTR): the EndpointSlice controller gives its endpoint that hostname.  A Service with a
    selector takes its endpoints from the pod records, whose hostname was never looked at: such
    a pod had its address with dashes only.  Without a hostname, or of another subdomain (or
    for another Service selecting it), the dashes as before.  The records as read from etcd
    (validated again: the optional fields must pass)."""
    from agentd.resources import kinds, manifests
    from agentd.resources.validation import Invalid
    from agentd.services import model

    def pod(name: str, ips: list[str], **spec: str) -> dict:
        return kinds.validate({"apiVersion": "v1", "kind": "Pod",
                               "metadata": {"name": name, "namespace": "shop", "labels": {"app": "db"}},
                               "spec": {"nodeName": "node1", **spec,
                                        "containers": [{"ports": [{"name": "pg", "containerPort": 5432}]}]},
                               "status": {"podIPs": [{"ip": ip} for ip in ips]}})  # fmt: skip

    pods = [pod("db-0", ["10.244.1.5", "fd00:10:244:1::5"], hostname="db-0", subdomain="db"),
            pod("db-1", ["10.244.1.6"], hostname="db-1", subdomain="other"),
            pod("db-2", ["10.244.1.7"], subdomain="db")]  # fmt: skip
    assert pods[0]["spec"]["hostname"] == "db-0" and pods[0]["spec"]["subdomain"] == "db"
    assert "hostname" not in pods[2]["spec"]
    text = """\
apiVersion: v1
kind: Service
metadata: {name: db, namespace: shop}
spec: {clusterIP: None, ipFamilyPolicy: PreferDualStack, ipFamilies: [IPv4, IPv6], selector: {app: db},
       ports: [{name: pg, port: 5432, targetPort: pg}]}
---
apiVersion: v1
kind: Service
metadata: {name: db-alt, namespace: shop}
spec: {clusterIP: None, selector: {app: db}, ports: [{name: pg, port: 5432, targetPort: pg}]}
"""
    services = manifests.validate_all(manifests.read(text, "f.yaml"), "f.yaml")
    table = sdns.names(model.build(services, [], pods), "cluster.local")

    def answer(name: str, rdtype: str) -> list[str]:
        r = sdns.resolve(table, dns.message.make_query(name, rdtype), [IPv4Network("10.96.0.0/12")])
        assert r.rcode() == dns.rcode.NOERROR and r.flags & dns.flags.AA, (name, r)
        return sorted(rr.split(" ", 4)[-1] for rr in lines(r.answer))

    assert answer("db-0.db.shop.svc.cluster.local", "A") == ["10.244.1.5"]
    assert answer("db-0.db.shop.svc.cluster.local", "AAAA") == ["fd00:10:244:1::5"]
    assert answer("_pg._tcp.db.shop.svc.cluster.local", "SRV") == [
        "0 100 5432 10-244-1-6.db.shop.svc.cluster.local.", "0 100 5432 10-244-1-7.db.shop.svc.cluster.local.",
        "0 100 5432 db-0.db.shop.svc.cluster.local."]  # fmt: skip
    assert answer("_pg._tcp.db-alt.shop.svc.cluster.local", "SRV") == [  # not its subdomain: dashes
        f"0 100 5432 10-244-1-{i}.db-alt.shop.svc.cluster.local." for i in (5, 6, 7)]
    assert answer(f"{reverse('10.244.1.5')}.", "PTR") == [  # an endpoint of both
        "10-244-1-5.db-alt.shop.svc.cluster.local.", "db-0.db.shop.svc.cluster.local."]
    for gone in ("10-244-1-5.db.shop.svc.cluster.local", "db-1.db.shop.svc.cluster.local",
                 "db-1.other.shop.svc.cluster.local", "db-0.db-alt.shop.svc.cluster.local"):  # fmt: skip
        assert sdns.resolve(table, dns.message.make_query(gone, "A")).rcode() == dns.rcode.NXDOMAIN, gone
    for bad in ({"hostname": "DB_0"}, {"subdomain": "a.b"}, {"hostname": 7}):
        with pytest.raises(Invalid):
            pod("db-9", ["10.244.1.9"], **bad)


class _Upstream:
    """A DNS server on 127.0.0.1 (an ephemeral port) that answers every query ``A 192.0.2.1``,
    first sending what ``before(query, addr, transport)`` sends (a stray datagram)."""

    def __init__(self, before=None) -> None:
        self.before = before
        self.asked = 0

    async def __aenter__(self) -> tuple[str, int]:
        import asyncio

        import dns.rrset

        upstream = self

        class Proto(asyncio.DatagramProtocol):
            def connection_made(self, transport) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr) -> None:
                upstream.asked += 1
                query = dns.message.from_wire(data)
                if upstream.before is not None:
                    upstream.before(query, addr, self.transport)
                reply = dns.message.make_response(query)
                reply.answer.append(dns.rrset.from_text(query.question[0].name, 60, "IN", "A", "192.0.2.1"))
                self.transport.sendto(reply.to_wire(), addr)

        self.transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(Proto, local_addr=("127.0.0.1", 0))
        return self.transport.get_extra_info("sockname")[:2]

    async def __aexit__(self, *exc) -> None:
        self.transport.close()


async def test_a_stray_datagram_before_the_upstreams_reply_is_ignored_not_a_failure():
    """A reply of another ID (a late answer to an earlier query) or a datagram from another
    source reaching the forwarder's port first is not the answer: it waits for the real one
    (as CoreDNS forward reads past mismatched IDs), and the client gets it, not SERVFAIL."""
    import socket

    def wrong_id(query, addr, transport) -> None:
        stale = dns.message.make_response(query)
        stale.id = (query.id + 1) & 0xFFFF
        transport.sendto(stale.to_wire(), addr)

    def foreign(query, addr, transport) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"junk", addr)

    for before in (wrong_id, foreign):
        async with _Upstream(before) as where:
            server = sdns.DnsServer("127.0.0.1", 0, lambda: TABLE, [where])
            out = dns.message.from_wire(await server.answer(dns.message.make_query("example.com", "A").to_wire()))
            assert out.rcode() == dns.rcode.NOERROR and lines(out.answer) == ["example.com. 60 IN A 192.0.2.1"], before
            assert server.outcomes["forwarded"] == 1 and server.failed == 0, before


async def test_a_dead_first_upstream_costs_max_fails_queries_their_timeout_not_every_query(monkeypatch):
    """[a black hole, a good one]: the first MAX_FAILS queries wait FORWARD_TIMEOUT for the
    hole, then the good one answers; the hole is down then: the next ones go to the good one
    at once."""
    import socket
    import time

    monkeypatch.setattr(sdns, "FORWARD_TIMEOUT", 0.3)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as hole:
        hole.bind(("127.0.0.1", 0))
        hole.setblocking(False)
        async with _Upstream() as good:
            server = sdns.DnsServer("127.0.0.1", 0, lambda: TABLE, [hole.getsockname(), good])
            took = []
            for i in range(sdns.MAX_FAILS + 2):
                start = time.monotonic()
                out = dns.message.from_wire(await server.answer(dns.message.make_query(f"q{i}.example.com", "A").to_wire()))
                took.append(time.monotonic() - start)
                assert out.rcode() == dns.rcode.NOERROR and out.answer, i
        asked_hole = 0
        while True:
            try:
                hole.recv(512)
            except BlockingIOError:
                break
            asked_hole += 1
    assert min(took[:sdns.MAX_FAILS]) >= 0.3 and max(took[sdns.MAX_FAILS:]) < 0.15, took
    assert asked_hole == sdns.MAX_FAILS and server.outcomes["forwarded"] == sdns.MAX_FAILS + 2 and server.failed == 0


async def test_upstreams_keep_their_place_below_max_fails_down_ones_skipped_for_a_backoff_all_down_asked_anyway(monkeypatch):
    """CoreDNS forward's health: below MAX_FAILS failures in a row an upstream is healthy and
    keeps its configured place; then it is down, skipped until its backoff is over, then back
    in its place (first again); failing then downs it for twice as long; answering makes it
    healthy; every one down: all are asked all the same, never none, and no failure counted
    while the backoff runs."""
    import dns.asyncquery

    now = [100.0]
    dead: set[str] = set()  # (rebound below: udp reads it at each call)
    asked: list[str] = []

    async def udp(query, host, **kw):
        asked.append(host)
        if host in dead:
            raise dns.exception.Timeout
        return dns.message.make_response(query)

    monkeypatch.setattr(dns.asyncquery, "udp", udp)
    server = sdns.DnsServer("127.0.0.1", 0, lambda: TABLE, [("192.0.2.1", 53), ("192.0.2.2", 53)], clock=lambda: now[0])

    async def ask() -> int:
        del asked[:]
        return dns.message.from_wire(await server.answer(dns.message.make_query("example.com", "A").to_wire())).rcode()

    one, two = "192.0.2.1", "192.0.2.2"
    dead.add(one)
    assert await ask() == dns.rcode.NOERROR and asked == [one, two]
    assert await ask() == dns.rcode.NOERROR and asked == [one, two]  # one failure: still healthy, still first
    assert await ask() == dns.rcode.NOERROR and asked == [two]  # two in a row: down for RETRY_INITIAL
    now[0] += sdns.RETRY_INITIAL  # back in its place, first
    assert await ask() == dns.rcode.NOERROR and asked == [one, two]  # fails: down again, for twice as long
    now[0] += sdns.RETRY_INITIAL
    assert await ask() == dns.rcode.NOERROR and asked == [two]  # one still skipped
    now[0] += sdns.RETRY_INITIAL
    dead = set()
    assert await ask() == dns.rcode.NOERROR and asked == [one]  # one answers: healthy again
    assert server.upstreams.all[0].fails == 0
    dead = {one, two}
    assert await ask() == dns.rcode.SERVFAIL and asked == [one, two]
    assert await ask() == dns.rcode.SERVFAIL and asked == [one, two]  # both down now
    assert await ask() == dns.rcode.SERVFAIL and asked == [one, two]  # all down: both asked all the same
    assert [u.fails for u in server.upstreams.all] == [2, 2]  # not counted while their backoff runs
    assert [u.retry_at for u in server.upstreams.all] == [now[0] + sdns.RETRY_INITIAL] * 2
    now[0] += sdns.RETRY_INITIAL
    assert await ask() == dns.rcode.SERVFAIL and asked == [one, two]
    assert [u.fails for u in server.upstreams.all] == [3, 3]


def test_one_failure_of_the_first_upstream_does_not_send_its_queries_to_the_second_for_good():
    """resolv.conf [corporate, public] (split horizon: the public one answers NXDOMAIN for the
    corporate names): the corporate one timing out once while the public one answers goes on
    being asked first, its failure forgotten once it answers."""
    now = [0.0]
    ups = sdns.Upstreams([("10.0.0.1", 53), ("8.8.8.8", 53)], lambda: now[0])
    first, second = ups.order()
    ups.failed(first, "timeout")
    for _ in range(3):
        now[0] += sdns.RETRY_MAX + 1
        order = ups.order()
        assert [u.host for u in order] == ["10.0.0.1", "8.8.8.8"]
        ups.answered(second)  # the public one answers other queries: first stays first
    ups.answered(first)
    assert first.fails == 0


async def test_a_burst_of_concurrent_timeouts_downs_an_upstream_once_for_the_initial_backoff(monkeypatch):
    """50 queries in flight to an upstream that times out: it is down for RETRY_INITIAL (the
    failures of queries sent before it went down are not counted), not RETRY_MAX; a query sent
    before it went down that fails after its backoff is over does not down it again."""
    import asyncio

    import dns.asyncquery

    now = [100.0]
    release, release_late = asyncio.Event(), asyncio.Event()

    async def udp(query, host, **kw):
        if host == "192.0.2.1":
            await (release_late if query.question[0].name.to_text() == "late.example.com." else release).wait()
            raise dns.exception.Timeout
        return dns.message.make_response(query)

    monkeypatch.setattr(dns.asyncquery, "udp", udp)
    server = sdns.DnsServer("127.0.0.1", 0, lambda: TABLE, [("192.0.2.1", 53), ("192.0.2.2", 53)], clock=lambda: now[0])
    first = server.upstreams.all[0]
    queries = [asyncio.ensure_future(server.answer(dns.message.make_query(f"q{i}.example.com", "A").to_wire()))
               for i in range(50)]  # fmt: skip
    # Sent before the burst downs the upstream; fails once its backoff is over.
    late = asyncio.ensure_future(server.answer(dns.message.make_query("late.example.com", "A").to_wire()))
    await asyncio.sleep(0)
    release.set()
    for out in await asyncio.gather(*queries):
        assert dns.message.from_wire(out).rcode() == dns.rcode.NOERROR
    assert first.fails == sdns.MAX_FAILS and first.retry_at == now[0] + sdns.RETRY_INITIAL
    now[0] += sdns.RETRY_INITIAL
    release_late.set()
    assert dns.message.from_wire(await late).rcode() == dns.rcode.NOERROR
    assert first.fails == sdns.MAX_FAILS and server.upstreams.order()[0] is first


def test_a_down_first_upstream_past_its_backoff_is_asked_first_by_one_query_at_a_time():
    """Its backoff over, a down first upstream is asked first by one query (a probe); every
    other query while that probe is outstanding asks it after the healthy ones (not a 2 s wait
    each); the probe failing downs it for twice as long, as before; the probe answering makes it
    healthy, first again (split horizon: a recovered first upstream comes back first)."""
    now = [100.0]
    ups = sdns.Upstreams([("10.0.0.1", 53), ("8.8.8.8", 53)], lambda: now[0])
    dead, good = ups.all
    for _ in range(sdns.MAX_FAILS):
        ups.failed(dead, "timeout")
    assert ups.order() == [good]  # down: skipped for RETRY_INITIAL
    now[0] += sdns.RETRY_INITIAL
    assert [u["state"] for u in ups.status(0.0)] == ["retrying", "healthy"]
    state = dead.state
    assert ups.order() == [dead, good]  # the probe
    assert ups.order() == [good, dead]  # every other query while it is outstanding
    assert ups.order() == [good, dead]
    assert [u["state"] for u in ups.status(0.0)] == ["retrying", "healthy"]
    now[0] += sdns.FORWARD_TIMEOUT
    ups.failed(dead, "timeout", state)  # the probe fails: down again, for twice as long
    assert dead.fails == sdns.MAX_FAILS + 1 and dead.retry_at == now[0] + 2 * sdns.RETRY_INITIAL
    assert ups.order() == [good] and ups.status(0.0)[0]["state"] == "down"
    now[0] += 2 * sdns.RETRY_INITIAL
    state = dead.state
    assert ups.order() == [dead, good]  # the next probe
    assert ups.order() == [good, dead]
    ups.answered(dead)  # it answers: healthy, first again for every query
    assert dead.fails == 0
    assert ups.order() == [dead, good] and ups.order() == [dead, good]
    assert [u["state"] for u in ups.status(0.0)] == ["healthy", "healthy"]
    ups.failed(dead, "timeout", state)  # a failure of a query sent before it answered: not counted
    assert dead.fails == 0


async def test_while_the_probe_waits_on_a_down_first_upstream_other_queries_go_to_the_healthy_one(monkeypatch):
    """Through the server: the probe query waits on the dead first upstream, a query meanwhile
    is answered by the second without asking the first; the probe times out and the second
    answers it; the first is down again for twice as long."""
    import asyncio

    import dns.asyncquery

    now = [100.0]
    release = asyncio.Event()
    asked: list[tuple[str, str]] = []

    async def udp(query, host, **kw):
        asked.append((query.question[0].name.to_text(), host))
        if host == "192.0.2.1":
            await release.wait()
            raise dns.exception.Timeout
        return dns.message.make_response(query)

    monkeypatch.setattr(dns.asyncquery, "udp", udp)
    server = sdns.DnsServer("127.0.0.1", 0, lambda: TABLE, [("192.0.2.1", 53), ("192.0.2.2", 53)], clock=lambda: now[0])
    first = server.upstreams.all[0]
    first.fails, first.retry_at = sdns.MAX_FAILS, now[0]  # down, its backoff just over
    probe = asyncio.ensure_future(server.answer(dns.message.make_query("probe.example.com", "A").to_wire()))
    await asyncio.sleep(0)
    other = asyncio.ensure_future(server.answer(dns.message.make_query("other.example.com", "A").to_wire()))
    for _ in range(5):  # turns of the loop, no time: answered at once, not waiting on the first
        await asyncio.sleep(0)
    done = other.done()
    release.set()
    assert done and dns.message.from_wire(await other).rcode() == dns.rcode.NOERROR
    assert asked[:2] == [("probe.example.com.", "192.0.2.1"), ("other.example.com.", "192.0.2.2")]
    assert dns.message.from_wire(await probe).rcode() == dns.rcode.NOERROR
    assert asked[2:] == [("probe.example.com.", "192.0.2.2")], asked
    assert first.fails == sdns.MAX_FAILS + 1 and first.retry_at == now[0] + 2 * sdns.RETRY_INITIAL


def test_a_probe_that_never_reports_is_given_up_after_its_deadline():
    """A probe query that neither fails nor answers (cancelled with the server's stop): after
    twice FORWARD_TIMEOUT (UDP, then TCP) the next query probes."""
    now = [0.0]
    ups = sdns.Upstreams([("10.0.0.1", 53), ("8.8.8.8", 53)], lambda: now[0])
    dead, good = ups.all
    for _ in range(sdns.MAX_FAILS):
        ups.failed(dead, "timeout")
    now[0] += sdns.RETRY_INITIAL
    assert ups.order() == [dead, good]
    now[0] += 2 * sdns.FORWARD_TIMEOUT - 0.1
    assert ups.order() == [good, dead]
    now[0] += 0.1
    assert ups.order() == [dead, good]


def test_a_dead_first_upstream_delays_one_query_per_backoff_cycle_not_every_query_past_its_backoff():
    """resolv.conf [dead, good], 200 queries/s for 120 s, clock passed in: each query asks
    order()[0] first; one sent to the dead one fails FORWARD_TIMEOUT later.  Before it is down
    (MAX_FAILS failures) every query waits on it; after, one query per backoff cycle (1, 2, 4,
    8, 16, 30, 30 s, each + the probe's timeout: 7 in 120 s), never two at once -- not every
    query of a 2 s window each cycle (2800 queries, 400 at once, before)."""
    import heapq

    now = [0.0]
    ups = sdns.Upstreams([("10.0.0.1", 53), ("10.0.0.2", 53)], lambda: now[0])
    dead = ups.all[0]
    pending: list[tuple[float, float, int]] = []  # (fails at, sent at, the upstream's state when sent)
    waited_at: list[float] = []
    down_at = None
    peak = 0
    for i in range(120 * 200):
        t = i / 200
        while pending and pending[0][0] <= t:
            now[0], _, state = heapq.heappop(pending)
            ups.failed(dead, "timeout", state)
            if down_at is None and dead.fails >= sdns.MAX_FAILS:
                down_at = now[0]
        now[0] = t
        if ups.order()[0] is dead:
            waited_at.append(t)
            heapq.heappush(pending, (t + sdns.FORWARD_TIMEOUT, t, dead.state))
        if down_at is not None:
            peak = max(peak, sum(1 for _, sent, _ in pending if sent > down_at))
    assert down_at is not None
    later = [t for t in waited_at if t > down_at]
    assert len(waited_at) - len(later) <= sdns.FORWARD_TIMEOUT * 200 + sdns.MAX_FAILS  # before it is known down
    assert len(later) == 7 and peak == 1, later
    assert all(b - a >= sdns.RETRY_INITIAL + sdns.FORWARD_TIMEOUT for a, b in zip(later, later[1:], strict=False)), later


def _a_server_of_big_answers(monkeypatch, padding: int, *, sndbuf: int | None = None):
    """A DnsServer on 127.0.0.1 (not started), its TCP_IDLE 0.2 s, that answers every query at
    once with one big answer (the response to big.example.org TXT and ``padding`` bytes); each
    TCP client's writer goes into the list returned with it (``sndbuf``: its socket's send
    buffer, else the kernel's)."""
    import socket

    monkeypatch.setattr(sdns, "TCP_IDLE", 0.2)
    server = sdns.DnsServer("127.0.0.1", 0, lambda: TABLE, [])
    big = dns.message.make_response(dns.message.make_query("big.example.org", "TXT")).to_wire() + b"\0" * padding

    async def answer(wire: bytes, *, tcp: bool = False) -> bytes:
        return big

    monkeypatch.setattr(server, "answer", answer)
    writers = []
    client_of = server._tcp_client

    async def tcp_client(reader, writer) -> None:
        writers.append(writer)
        if sndbuf is not None:
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        await client_of(reader, writer)

    monkeypatch.setattr(server, "_tcp_client", tcp_client)
    return server, writers


async def test_a_tcp_client_that_never_reads_its_answers_is_closed_after_the_idle_timeout(monkeypatch):
    """A client that sends queries and never reads their answers fills the socket's buffers:
    waiting for them to drain is bounded by the idle timeout like a read, and the connection
    (its slot of MAX_TCP_CLIENTS, its socket) goes then."""
    import asyncio
    import socket
    import struct

    server, writers = _a_server_of_big_answers(monkeypatch, 60000)
    await server.start()
    try:
        port = server._tcp[0].sockets[0].getsockname()[1]
        query = dns.message.make_query("big.example.org", "TXT").to_wire()
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", port))
            client.sendall((struct.pack("!H", len(query)) + query) * 200)  # 12 MB of answers, never read
            async with asyncio.timeout(10):
                while server.tcp_clients == 0:
                    await asyncio.sleep(0.01)
                while server.tcp_clients:  # the answers cannot go: closed after TCP_IDLE
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0)  # (a transport closes its socket at the next turn of the loop)
            # Its socket is closed (the agent's descriptor free), not kept until the client reads.
            assert writers[0].get_extra_info("socket").fileno() == -1
    finally:
        await server.stop()


async def test_a_tcp_client_that_never_reads_less_than_the_high_water_mark_is_closed_after_the_idle_timeout(monkeypatch):
    """Answers the client never reads, fewer than the transport's high-water mark (64 KiB)
    buffered: drain() returns, the wait for the next query times out, and the connection is
    aborted (its socket closed at once), not left waiting forever to flush while its slot of
    MAX_TCP_CLIENTS is given back."""
    import asyncio
    import socket
    import struct

    server, writers = _a_server_of_big_answers(monkeypatch, 20000, sndbuf=4096)  # its sends full sooner
    await server.start()
    try:
        port = server._tcp[0].sockets[0].getsockname()[1]
        query = dns.message.make_query("big.example.org", "TXT").to_wire()
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", port))
            async with asyncio.timeout(10):
                # One query at a time until the kernel's buffers are full and answers wait in
                # the transport's (under 64 KiB: drain() does not block).
                while not (writers and writers[0].transport.get_write_buffer_size()):
                    client.sendall(struct.pack("!H", len(query)) + query)
                    await asyncio.sleep(0.005)
                assert writers[0].transport.get_write_buffer_size() < 65536
                while server.tcp_clients:  # no query comes: closed after TCP_IDLE
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0)  # (a transport closes its socket at the next turn of the loop)
            assert writers[0].get_extra_info("socket").fileno() == -1
            assert writers[0].transport.get_write_buffer_size() == 0
    finally:
        await server.stop()


def test_the_zones_apex_has_its_soa_and_ns_with_services_or_none():
    """The cluster domain exists, Services or none (an NXDOMAIN for it would tell resolvers the
    whole domain does not, RFC 8020): its SOA and NS in the answer section, the NS being
    ns.dns.<domain>, which has the node-local addresses; as CoreDNS's kubernetes plugin
    answers.  The reverse zone the Service ranges' negative answers name alike."""
    import ipaddress

    soa = "cluster.local. 5 IN SOA ns.dns.cluster.local. hostmaster.cluster.local. 1 7200 1800 86400 5"
    ranges = [ipaddress.ip_network("10.96.0.0/12")]
    for table in (TABLE, sdns.Names("cluster.local")):
        def ask_apex(name: str, rdtype: str, table: sdns.Names = table) -> dns.message.Message:
            r = sdns.resolve(table, dns.message.make_query(name, rdtype), ranges, ["169.254.20.10", "fd00:169:254:20::10"])
            assert r is not None and r.rcode() == dns.rcode.NOERROR and r.flags & dns.flags.AA, (name, rdtype, r)
            return r

        r = ask_apex("cluster.local", "SOA")
        assert lines(r.answer) == [soa] and r.authority == []
        r = ask_apex("Cluster.Local.", "NS")
        assert lines(r.answer) == ["cluster.local. 5 IN NS ns.dns.cluster.local."]
        assert lines(r.additional) == ["ns.dns.cluster.local. 5 IN A 169.254.20.10", "ns.dns.cluster.local. 5 IN AAAA fd00:169:254:20::10"]
        assert sorted(lines(ask_apex("cluster.local", "ANY").answer)) == sorted([soa, "cluster.local. 5 IN NS ns.dns.cluster.local."])
        r = ask_apex("cluster.local", "A")
        assert r.answer == [] and lines(r.authority) == [soa]
        assert lines(ask_apex("ns.dns.cluster.local", "A").answer) == ["ns.dns.cluster.local. 5 IN A 169.254.20.10"]
        assert lines(ask_apex("ns.dns.cluster.local", "AAAA").answer) == ["ns.dns.cluster.local. 5 IN AAAA fd00:169:254:20::10"]
        r = ask_apex("dns.cluster.local", "A")
        assert r.answer == [] and lines(r.authority) == [soa]
        r = ask_apex("in-addr.arpa", "SOA")
        assert lines(r.answer) == ["in-addr.arpa. 5 IN SOA ns.dns.in-addr.arpa. hostmaster.in-addr.arpa. 1 7200 1800 86400 5"]
        assert sdns.resolve(table, dns.message.make_query("ip6.arpa", "SOA"), ranges) is None  # no IPv6 range: not ours
    assert sdns.resolve(sdns.Names("cluster.local"), dns.message.make_query("x.cluster.local", "A")).rcode() == dns.rcode.NXDOMAIN


def test_each_upstreams_health_shows_in_get_services():
    """GET /services' "dns" shows each upstream, in the configured order: healthy (below
    max_fails), down with when it is asked again, or retrying (its backoff over), and its
    failures in a row.  Clocks passed in: the upstreams' monotonic one and the wall clock."""
    from types import SimpleNamespace

    from agentd.services.views import ServiceViews

    now = [1000.0]
    server = sdns.DnsServer("169.254.20.10", 53, lambda: TABLE, [("10.0.0.1", 53), ("2001:db8::53", 5353), ("8.8.8.8", 53)],
                            clock=lambda: now[0])
    first, second, third = server.upstreams.all
    server.upstreams.failed(first, "timeout")  # once: still healthy
    for _ in range(sdns.MAX_FAILS):
        server.upstreams.failed(second, "timeout")  # down for RETRY_INITIAL
    for _ in range(sdns.MAX_FAILS):
        server.upstreams.failed(third, "refused")
    now[0] += sdns.RETRY_INITIAL  # the backoffs of both are over: retrying
    server.upstreams.failed(third, "refused")  # failing again: down for twice as long
    state = SimpleNamespace(node="n1", applied_revision=1, error=None, error_dns=None, syncs=1, sync_errors=0,
                            last_sync=None, flushed=0, counters={}, failed={}, ports=[], compiled_ports=[], conflicts={},
                            dns_server=server, dns_config=SimpleNamespace(enabled=True), dns_outcomes=lambda: None)
    view = ServiceViews(state, wall=lambda: 1_700_000_000.0).view()  # type: ignore[arg-type]
    assert view["dns"]["max_fails"] == sdns.MAX_FAILS
    assert view["dns"]["upstreams"] == [
        {"address": "10.0.0.1:53", "state": "healthy", "fails": 1, "down_until": None, "retry_in": None},
        {"address": "[2001:db8::53]:5353", "state": "retrying", "fails": 2, "down_until": None, "retry_in": None},
        {"address": "8.8.8.8:53", "state": "down", "fails": 3, "down_until": "2023-11-14T22:13:22Z", "retry_in": 2.0},
    ]


def test_every_upstream_down_shows_as_asked_not_skipped():
    """Every upstream down, none past its backoff: order() asks them all all the same, so the
    view must not say they are skipped ("down"): each is "down, asked" (review s54 r10 #3)."""
    now = [1000.0]
    ups = sdns.Upstreams([("10.0.0.1", 53), ("10.0.0.2", 53)], clock=lambda: now[0])
    for u in ups.all:
        for _ in range(sdns.MAX_FAILS):
            ups.failed(u, "timeout")
    assert [u.host for u in ups.order()] == ["10.0.0.1", "10.0.0.2"]  # asked all the same
    assert [u["state"] for u in ups.status(0.0)] == ["down, asked", "down, asked"]
    ups.answered(ups.all[1])  # one healthy again: the other is skipped, "down"
    assert [u["state"] for u in ups.status(0.0)] == ["down", "healthy"]
    assert [u.host for u in ups.order()] == ["10.0.0.2"]


@pytest.mark.parametrize("enabled", [True, False])
def test_dns_query_counters_are_exported_at_zero_before_a_server_ran_when_dns_is_configured(enabled):
    """agentd_dns_queries_total{outcome} exists from the start (every outcome at 0) when [dns]
    enabled, like the other counters, not only once a server has run; without DNS it is not
    exported at all."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from agentd.services.views import ServiceViews

    state = SimpleNamespace(node="n1", applied_revision=0, error=None, error_dns=None, syncs=0, sync_errors=0,
                            last_sync=None, flushed=0, counters={}, failed={}, ports=[], port_count=0, dns_server=None,
                            dns_config=SimpleNamespace(enabled=enabled), dns_outcomes=lambda: None)
    registry = CollectorRegistry()
    registry.register(ServiceViews(state))  # type: ignore[arg-type]
    samples = {o: registry.get_sample_value("agentd_dns_queries_total", {"outcome": o}) for o in sdns.OUTCOMES}
    assert samples == dict.fromkeys(sdns.OUTCOMES, 0.0 if enabled else None)


# ------------------------------------------------------------------ review r11


def padded(name: str, rdtype: str = "A", payload: int = 512) -> dns.message.Message:
    """A query with the EDNS Padding option (RFC 7830), as a stub resolver set up for DoT sends it."""
    import dns.edns

    return dns.message.make_query(name, rdtype, use_edns=0, payload=payload,
                                  options=[dns.edns.GenericOption(dns.edns.OptionType.PADDING, b"")])  # fmt: skip


async def test_a_query_with_the_padding_option_gets_an_unpadded_answer_that_fits_with_every_record_that_fits():
    """dnspython pads the answer to a query with the Padding option to 468-octet blocks (RFC
    8467, meant for encrypted transports): the answer was measured unpadded and then did not
    fit (TooBig: no reply over UDP, a WARNING per datagram, the TCP connection closed), and a cut
    kept 2 records where 28 fit.  Not padded here: the answer fits with all that fit."""
    name = "hl.shop.svc.cluster.local"
    for n, payload, cut in ((28, 512, False), (40, 512, True), (60, 1232, False), (70, 1232, False), (100, 1232, True)):
        table = sdns.names([sp("hl", "", "TCP", 80, None, many(n))], "cluster.local")
        server = sdns.DnsServer("127.0.0.1", 0, lambda table=table: table, [])
        wire = await server.answer(padded(name, payload=payload).to_wire())
        r = dns.message.from_wire(wire)
        kept = len(r.answer[0])
        assert len(wire) <= payload and bool(r.flags & dns.flags.TC) == cut, (n, payload, len(wire))
        assert kept == n if not cut else kept >= (28 if payload == 512 else 70), (n, payload, kept)
        tcp = dns.message.from_wire(await server.answer(padded(name, payload=payload).to_wire(), tcp=True))
        assert not tcp.flags & dns.flags.TC and len(tcp.answer[0]) == n, (n, payload)
        assert server.failed == 0


async def test_a_forwarded_reply_whose_opt_record_does_not_fit_is_cut_not_left_unanswered(monkeypatch):
    """A backstop of the rendering: an upstream's reply with a 600-octet EDNS option does not fit
    a 512-octet client whatever its records (dnspython: ValueError); the client gets the cut
    (TC, without the option), not silence."""
    import dns.asyncquery
    import dns.edns
    import dns.rrset

    async def udp(query, host, **kw):
        reply = dns.message.make_response(query)
        reply.use_edns(0, 0, 1232, options=[dns.edns.GenericOption(65001, b"x" * 600)])
        reply.answer.append(dns.rrset.from_text(query.question[0].name, 60, "IN", "A", "192.0.2.1"))
        return reply

    monkeypatch.setattr(dns.asyncquery, "udp", udp)
    server = sdns.DnsServer("127.0.0.1", 53, lambda: TABLE, [("192.0.2.1", 53)])
    wire = await server.answer(dns.message.make_query("example.com", "A", use_edns=0, payload=512).to_wire())
    r = dns.message.from_wire(wire)
    assert len(wire) <= 512 and r.flags & dns.flags.TC and r.rcode() == dns.rcode.NOERROR
    assert lines(r.answer) == ["example.com. 60 IN A 192.0.2.1"] and not r.options


async def test_an_upstream_answering_truncated_over_udp_but_not_over_tcp_is_answered_with_the_truncated_reply():
    """An upstream whose 53/tcp is filtered (refused here: a TCP socket bound to its port, not
    listening) answers a big name truncated over UDP: the client gets that reply, TC set, as
    CoreDNS forward passes it back, and the upstream answered -- not SERVFAIL, nor down after
    two such names (split-horizon names would then go to the next upstream)."""
    import asyncio
    import socket

    import dns.rrset

    class Proto(asyncio.DatagramProtocol):
        def connection_made(self, transport) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr) -> None:
            query = dns.message.from_wire(data)
            reply = dns.message.make_response(query)  # 60 records, cut to the 25 that fit in 512 octets
            reply.flags |= dns.flags.TC
            reply.answer.append(dns.rrset.from_text_list(query.question[0].name, 300, "IN", "A",
                                                         [f"192.0.2.{i}" for i in range(1, 26)]))  # fmt: skip
            self.transport.sendto(reply.to_wire(max_size=512), addr)

    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(Proto, local_addr=("127.0.0.1", 0))
    closed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        where = transport.get_extra_info("sockname")[:2]
        closed.bind(where)  # no listener: a TCP connection to the upstream is refused
        server = sdns.DnsServer("127.0.0.1", 0, lambda: TABLE, [where])
        for _ in range(3):
            wire = await server.answer(dns.message.make_query("big.example.com", "A").to_wire())
            r = dns.message.from_wire(wire)
            assert r.rcode() == dns.rcode.NOERROR and r.flags & dns.flags.TC and len(wire) <= 512
            assert len(r.answer[0]) == 25
        assert server.outcomes["forwarded"] == 3 and server.failed == 0
        assert [(u["state"], u["fails"]) for u in server.upstreams.status(0)] == [("healthy", 0)]
    finally:
        closed.close()
        transport.close()


def test_dns_version_txt_of_the_cluster_domain():
    """The Kubernetes DNS specification 2.2: "There must be a TXT record named
    dns-version.<zone>": CoreDNS's value, 1.1.0, TTL 28800; other types NODATA; SERVFAIL
    before the first sync, as every name of the domain."""
    r = ask("dns-version.cluster.local", "TXT")
    assert r.rcode() == dns.rcode.NOERROR and r.flags & dns.flags.AA
    assert lines(r.answer) == ['dns-version.cluster.local. 28800 IN TXT "1.1.0"'] and r.authority == []
    assert lines(ask("DNS-Version.cluster.local.", "ANY").answer) == ['DNS-Version.cluster.local. 28800 IN TXT "1.1.0"']
    r = ask("dns-version.cluster.local", "A")
    assert r.rcode() == dns.rcode.NOERROR and r.answer == [] and lines(r.authority)[0].startswith("cluster.local. 5 IN SOA")
    assert ask("x.dns-version.cluster.local", "TXT").rcode() == dns.rcode.NXDOMAIN
    empty = sdns.Names("cluster.local", ready=False)
    assert sdns.resolve(empty, dns.message.make_query("dns-version.cluster.local", "TXT")).rcode() == dns.rcode.SERVFAIL


def test_ipv6_endpoints_are_named_with_dashes_and_a_zero_where_the_address_ends_or_starts_in_colons():
    """An IPv6 endpoint without a hostname: its address with dashes for colons
    (fd00-10-244-1--5); one ending in "::" gets a "0" after (newer CoreDNS: a label ending in
    "-" is no host name, Go's resolver drops it), one starting with "::" a "0" before."""
    table = sdns.names([sp6("h", "pg", 5432, None, [Endpoint("fd00:10:244:1::5", 5432),
                                                   Endpoint("fd00:10:244:1:5:a3c0::", 5432)])],
                       "cluster.local")  # fmt: skip
    r = sdns.resolve(table, dns.message.make_query("_pg._tcp.h.shop.svc.cluster.local", "SRV"))
    assert sorted(lines(r.answer)) == [
        "_pg._tcp.h.shop.svc.cluster.local. 5 IN SRV 0 100 5432 fd00-10-244-1--5.h.shop.svc.cluster.local.",
        "_pg._tcp.h.shop.svc.cluster.local. 5 IN SRV 0 100 5432 fd00-10-244-1-5-a3c0--0.h.shop.svc.cluster.local."]
    for name, address in (("fd00-10-244-1--5", "fd00:10:244:1::5"), ("fd00-10-244-1-5-a3c0--0", "fd00:10:244:1:5:a3c0::")):
        r = sdns.resolve(table, dns.message.make_query(f"{name}.h.shop.svc.cluster.local", "AAAA"))
        assert lines(r.answer) == [f"{name}.h.shop.svc.cluster.local. 5 IN AAAA {address}"]
        r = sdns.resolve(table, dns.message.make_query(f"{name}.h.shop.svc.cluster.local", "A"))
        assert r.rcode() == dns.rcode.NOERROR and r.answer == []
    assert sdns.endpoint_label(Endpoint("::5", 80)) == "0--5"
    assert sdns.endpoint_label(Endpoint("::", 80)) == "0--0"
    assert sdns.endpoint_label(Endpoint("fd00::5", 80, hostname="db-0")) == "db-0"
