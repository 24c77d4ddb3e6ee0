"""Service DNS forwards what is not the cluster's to an IPv6 upstream as well as to an IPv4
one (an IPv6-only node has no other): two real servers in a namespace of the test's own, one
forwarding to the other over ::1, and a real query over UDP and over TCP."""

import sys

SCRIPT = r"""
import asyncio, sys
import dns.asyncquery, dns.message, dns.rdatatype
from agentd.services import dns as sdns

async def main():
    far = sdns.DnsServer("::1", 5301, lambda: sdns.Names("cluster.local", a={"web.shop.svc.cluster.local.": ("10.96.0.10",)}), [])
    await far.start()
    near = sdns.DnsServer("127.0.0.1", 5300, lambda: sdns.Names("other.local"), sdns.upstream_pairs(["[::1]:5301"]))
    await near.start()
    try:
        q = dns.message.make_query("web.shop.svc.cluster.local.", "A")
        for how in (dns.asyncquery.udp, dns.asyncquery.tcp):
            r = await how(q, "127.0.0.1", port=5300, timeout=5)
            print(how.__name__, dns.rcode.to_text(r.rcode()), [rr.to_text() for rrset in r.answer for rr in rrset])
        print("forwarded", near.forwarded, "failed", near.failed)
    finally:
        await near.stop()
        await far.stop()

asyncio.run(main())
"""


async def test_names_go_to_an_ipv6_upstream(netns_factory):
    ns = netns_factory("dns6")
    ns.ip("link", "set", "lo", "up")
    rc, out, err = await ns.aexec(sys.executable, "-c", SCRIPT, timeout=30)
    assert rc == 0, err.decode()
    lines = out.decode().splitlines()
    assert lines == ["udp NOERROR ['10.96.0.10']", "tcp NOERROR ['10.96.0.10']", "forwarded 2 failed 0"], lines
