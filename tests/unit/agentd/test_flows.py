"""Flow records, pure: the ctnetlink and nfnetlink_log codecs byte for byte against the uapi
layouts, records from conntrack events and logged packets, filters, the ring, the drop
limiter, and the drop rules the compilers write."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import socket
import struct
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_network
from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentd.flows.model import REASONS, FilterError, Flow, FlowFilter, Identity, Peer
from agentd.flows.recorder import (
    CONN_OPEN,
    CONN_RECORD,
    CONN_RESET_HI,
    CONN_RESET_LO,
    CONN_VALUE,
    HELD_RECHECK_NS,
    HISTORY_AGE_NS,
    REC_FIN,
    REC_GONE,
    REC_REUSED,
    REC_RST,
    REC_START,
    RESET_TIMEOUT_NS,
    SWEEP_INTERVAL,
    SYN_TIMEOUT_NS,
    FlowRecorder,
    recorded_flow,
)
from agentd.flows.render import line
from agentd.flows.ring import MAX_FOLLOWERS, DropLimiter, FlowRing, TooManyFollowers
from agentd.kernel import netlink as nl
from agentd.kernel import netlink_ct as ct
from agentd.kernel import netlink_log as nflog
from agentd.nft.expr import SUPPRESSED, DropLog
from agentd.policy import compiler as policy_compiler
from agentd.policy.engine import PolicyEngine
from agentd.policy.model import LocalPort, Pod, Policy
from agentd.services import compiler as services_compiler
from proto import packet as P

# ------------------------------------------------------------------ ctnetlink events


def _tuple(kind: int, src: str, dst: str, proto: int, sport: int, dport: int) -> bytes:
    return ct.encode_tuple(kind, ct.CtTuple(src, dst, proto, sport, dport))


def _counters(kind: int, packets: int, nbytes: int) -> bytes:
    return nl.nested(kind, nl.attr(ct.CTA_COUNTERS_PACKETS, struct.pack("!Q", packets)),
                     nl.attr(ct.CTA_COUNTERS_BYTES, struct.pack("!Q", nbytes)))


def destroy_event(status: int = 0, start_ns: int = 1_000_000_000_000) -> bytes:
    body = (_tuple(ct.CTA_TUPLE_ORIG, "10.244.1.2", "10.96.0.10", 6, 40000, 80)
            + _tuple(ct.CTA_TUPLE_REPLY, "10.244.2.3", "10.244.1.2", 6, 8080, 40000)
            + nl.attr(ct.CTA_STATUS, struct.pack("!I", status)) + nl.attr(ct.CTA_ID, struct.pack("!I", 7))
            + _counters(ct.CTA_COUNTERS_ORIG, 5, 400) + _counters(ct.CTA_COUNTERS_REPLY, 4, 900)
            + nl.nested(ct.CTA_TIMESTAMP, nl.attr(ct.CTA_TIMESTAMP_START, struct.pack("!Q", start_ns)),
                        nl.attr(ct.CTA_TIMESTAMP_STOP, struct.pack("!Q", start_ns + 250_000_000))))
    return nl.encode_nfgen(ct.MSG_DELETE, 0, 0, socket.AF_INET, body)


def test_destroy_event_decodes_counters_and_timestamps():
    msg = destroy_event(ct.IPS_DST_NAT)
    ((mtype, _f, _s, _p, start, end),) = list(nl.iter_messages(msg))
    ev = ct.decode_event(mtype, msg, start, end)
    assert ev is not None and ev.destroyed and ev.nat and ev.id == 7
    assert ev.orig == ct.CtTuple("10.244.1.2", "10.96.0.10", 6, 40000, 80)
    assert ev.reply.src == "10.244.2.3"
    assert (ev.orig_packets, ev.orig_bytes, ev.reply_packets, ev.reply_bytes) == (5, 400, 4, 900)
    assert ev.stop_ns - ev.start_ns == 250_000_000


def test_ipv6_tuple_and_icmp_type_code():
    ip = nl.nested(ct.CTA_TUPLE_IP, nl.attr(ct.CTA_IP_V6_SRC, socket.inet_pton(socket.AF_INET6, "fd00::1")),
                   nl.attr(ct.CTA_IP_V6_DST, socket.inet_pton(socket.AF_INET6, "fd00::2")))
    proto = nl.nested(ct.CTA_TUPLE_PROTO, nl.attr(ct.CTA_PROTO_NUM, b"\x3a"),
                      nl.attr(ct.CTA_PROTO_ICMPV6_TYPE, b"\x80"), nl.attr(ct.CTA_PROTO_ICMPV6_CODE, b"\x00"))
    buf = ip + proto
    assert ct.decode_tuple(buf, 0, len(buf)) == ct.CtTuple("fd00::1", "fd00::2", 58, 128, 0)


def test_malformed_conntrack_attribute_is_a_decode_error():
    bad = nl.nested(ct.CTA_TUPLE_IP, nl.attr(ct.CTA_IP_V4_SRC, b"\x0a\x00\x00"))
    with pytest.raises(nl.NetlinkDecodeError):
        ct.decode_tuple(bad, 0, len(bad))


# ------------------------------------------------------------------ nfnetlink_log


def test_bind_and_settings_bytes():
    assert nflog.encode_bind(143, 1) == bytes.fromhex(
        "1c000000 0104 0100 01000000 00000000"  # 28 bytes, ULOG << 8 | CONFIG, REQUEST
        "00 00 008f"  # nfgenmsg: AF_UNSPEC, v0, res_id = group 143 big-endian
        "05000100 01 000000".replace(" ", ""))  # NFULA_CFG_CMD BIND
    msg = nflog.encode_settings(143, 2, copy_range=128, timeout_cs=10, qthresh=64)
    ((mtype, _f, _s, _p, start, end),) = list(nl.iter_messages(msg))
    attrs = {t: msg[s:e] for t, s, e in nl.iter_attrs(msg, start + 4, end)}
    assert mtype == nflog.MSG_CONFIG
    assert attrs[nflog.NFULA_CFG_MODE] == struct.pack("!IBx", 128, nflog.NFULNL_COPY_PACKET)
    assert attrs[nflog.NFULA_CFG_TIMEOUT] == struct.pack("!I", 10)
    assert attrs[nflog.NFULA_CFG_QTHRESH] == struct.pack("!I", 64)
    assert attrs[nflog.NFULA_CFG_FLAGS][:2] == struct.pack("!H", nflog.NFULNL_CFG_F_SEQ)


def logged_packet(prefix: str, src: str, dst: str, proto: int, sport: int, dport: int, seq: int = 1,
                  when: tuple[int, int] | None = (1700000000, 250000), devices: tuple[int, int] | None = None,
                  conntrack: bytes | None = None) -> bytes:
    """An NFULNL_MSG_PACKET as the kernel sends one; ``when``: NFULA_TIMESTAMP (seconds,
    microseconds), None for none (the kernel sends it only for packets it stamped); ``devices``:
    (NFULA_IFINDEX_INDEV, NFULA_IFINDEX_PHYSINDEV), as for a bridge hook's packet."""
    if proto == P.IPPROTO_TCP:
        payload = P.tcp_packet(src, dst, P.TcpHeader(sport, dport, 1, 0, P.TCP_SYN, 64240))
    else:
        payload = P.udp_datagram(src, dst, sport, dport, b"x" * 8)
    stamp = nl.attr(nflog.NFULA_TIMESTAMP, struct.pack("!QQ", *when)) if when is not None else b""
    body = (nl.attr(nflog.NFULA_PREFIX, prefix.encode() + b"\0") + nl.attr(nflog.NFULA_SEQ, struct.pack("!I", seq))
            + stamp + nl.attr(nflog.NFULA_PAYLOAD, payload))
    if devices is not None:
        body += nl.attr(nflog.NFULA_IFINDEX_INDEV, struct.pack("!I", devices[0]))
        body += nl.attr(nflog.NFULA_IFINDEX_PHYSINDEV, struct.pack("!I", devices[1]))
    if conntrack is not None:
        body += nl.attr(nflog.NFULA_CT, conntrack)
    return nl.encode_nfgen(nflog.MSG_PACKET, 0, 0, socket.AF_INET, body, res_id=143)


def test_logged_packet_decodes_prefix_addresses_and_ports():
    msg = logged_packet("pod-in/shop/web", "10.244.1.2", "10.244.2.3", 6, 40000, 80, seq=9)
    ((_t, _f, _s, _p, start, end),) = list(nl.iter_messages(msg))
    p = nflog.decode_packet(msg, start, end)
    assert p is not None
    assert (p.prefix, p.src, p.dst, p.proto, p.sport, p.dport, p.seq) == ("pod-in/shop/web", "10.244.1.2", "10.244.2.3", 6, 40000, 80, 9)
    assert p.time == pytest.approx(1700000000.25)


def test_a_policy_drop_of_a_services_connection_names_the_service_from_its_conntrack_entry():
    """NetworkPolicy drops a Service's connection at the endpoint, after DNAT: the packet
    carries the endpoint's address, its conntrack entry (NFULA_CT, asked for with
    NFULNL_CFG_F_CONNTRACK) the cluster IP it was sent to.  The drop record names the Service
    and that address; an entry not DNATed names none; an unreadable one is counted, the drop
    still recorded."""
    msg = nflog.encode_settings(143, 2, copy_range=128, timeout_cs=10, qthresh=64, conntrack=True)
    ((_t, _f, _s, _p, start, end),) = list(nl.iter_messages(msg))
    attrs = {t: msg[s:e] for t, s, e in nl.iter_attrs(msg, start + 4, end)}
    assert attrs[nflog.NFULA_CFG_FLAGS][:2] == struct.pack("!H", nflog.NFULNL_CFG_F_SEQ | nflog.NFULNL_CFG_F_CONNTRACK)

    def entry(status: int) -> bytes:
        return (_tuple(ct.CTA_TUPLE_ORIG, "10.244.1.2", "10.96.0.10", 6, 40000, 80)
                + _tuple(ct.CTA_TUPLE_REPLY, "10.244.2.3", "10.244.1.2", 6, 8080, 40000)
                + nl.attr(ct.CTA_STATUS, struct.pack("!I", status)))

    def drop(conntrack: bytes | None) -> tuple[FlowRecorder, Flow | None]:
        r = recorder()
        msg = logged_packet("pod-in/shop/web", "10.244.1.2", "10.244.2.3", 6, 40000, 8080, conntrack=conntrack)
        r._on_log(*next((t, msg, s, e) for t, _f, _q, _p, s, e in nl.iter_messages(msg)))
        return r, r.ring.records[-1] if r.ring.records else None

    r, flow = drop(entry(ct.IPS_DST_NAT | ct.IPS_CONFIRMED))
    assert flow is not None and flow.reason == "policy" and (flow.dst.ip, flow.dst.port) == ("10.244.2.3", 8080)
    assert (flow.service, flow.service_ip, flow.service_port) == ("shop/web", "10.96.0.10", 80)
    assert r.malformed == 0
    _r, flow = drop(entry(ct.IPS_CONFIRMED))  # not translated: no Service
    assert flow is not None and flow.service is None and flow.service_ip is None
    _r, flow = drop(None)  # the kernel sent no entry
    assert flow is not None and flow.service is None
    r, flow = drop(_tuple(ct.CTA_TUPLE_ORIG, "10.244.1.2", "10.96.0.10", 6, 40000, 80) + nl.attr(ct.CTA_STATUS, b"\x00\x20"))
    assert flow is not None and flow.service is None and r.malformed == 1  # CTA_STATUS of 2 bytes: counted, not raised


# Packets as Linux 6.18 sent them on a namespace's loopback (tcpdump; lo's MTU 1280 so that
# the 2,000-byte datagrams went in fragments), each its first 128 bytes, NFLOG's copy_range here.
CAPTURED = {
    "IPv4 TCP SYN": ("4500003c24ae40004006180c7f0000017f000001a4a60050862e70b400000000a002fbe0fe300000020404d804"
                     "02080a4fcdabca000000000103030a", ("127.0.0.1", "127.0.0.1", 6, 42150, 80)),
    "IPv4 ICMP echo request": ("4500005436e74000400105c07f0000017f0000010800a83a2cf700018bf1126b00000000c49d01000000"
                               "0000101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f3031323334353637",
                               ("127.0.0.1", "127.0.0.1", 1, 8, 0)),
    "IPv4 UDP, first fragment": ("450004fcf0252000401167c97f0000017f000001c26f14e907d89860" + "79" * 100,
                                 ("127.0.0.1", "127.0.0.1", 17, 49775, 5353)),
    # A later fragment carries no UDP header: its first bytes are payload ("yyyy"), not ports.
    "IPv4 UDP, later fragment": ("45000304f025009d401189247f0000017f000001" + "79" * 108, ("127.0.0.1", "127.0.0.1", 17, 0, 0)),
    # UDP behind a Destination Options header (PadN), from setsockopt(IPV6_DSTOPTS).
    "IPv6 UDP behind Destination Options": ("600a170100153c40" + "00" * 15 + "01" + "00" * 15 + "01"
                                            + "1100010400000000e9b40035000dd21668656c6c6f", ("::1", "::1", 17, 59828, 53)),
    "IPv6 UDP, first fragment": ("600bf1db04d82c40" + "00" * 15 + "01" + "00" * 15 + "01" + "11000001a7d6bc09b20e14e907d892ae"
                                 + "78" * 72, ("::1", "::1", 17, 45582, 5353)),
    "IPv6 UDP, later fragment": ("600bf1db03102c40" + "00" * 15 + "01" + "00" * 15 + "01" + "110004d0a7d6bc09" + "78" * 80,
                                 ("::1", "::1", 17, 0, 0)),
    "IPv6 ICMPv6 echo request": ("600e1f4400403a40" + "00" * 15 + "01" + "00" * 15 + "01" + "8000daca2cf600018bf1126b00000000"
                                 "1992010000000000101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f3031"
                                 "323334353637", ("::1", "::1", 58, 128, 0)),
}


@pytest.mark.parametrize("name", sorted(CAPTURED))
def test_ip_summary_of_captured_packets(name):
    raw, want = CAPTURED[name]
    packet = bytes.fromhex(raw)
    assert len(packet) <= 128
    framed = b"\xff" * 20 + packet + b"\xee" * 8  # inside a larger buffer, as in a netlink message
    assert nflog.ip_summary(framed, 20, 20 + len(packet)) == want


@given(st.sampled_from([0x45, 0x46, 0x4F, 0x60, 0x20]), st.binary(max_size=160))
def test_ip_summary_of_random_bytes_never_raises(first, rest):
    data = bytes([first]) + rest
    got = nflog.ip_summary(data, 0, len(data))
    assert got is None or len(got) == 5


def test_ip_summary_of_short_truncated_or_foreign_payloads():
    assert nflog.ip_summary(b"", 0, 0) is None
    assert nflog.ip_summary(b"\x45" + b"\0" * 10, 0, 11) is None  # too short for IPv4
    assert nflog.ip_summary(b"\x46" + b"\0" * 19, 0, 20) is None  # IHL says 24 bytes, 20 given
    assert nflog.ip_summary(b"\x20" * 40, 0, 40) is None  # not IP
    syn = bytes.fromhex(CAPTURED["IPv4 TCP SYN"][0])
    assert nflog.ip_summary(syn, 0, 30) == ("127.0.0.1", "127.0.0.1", 6, 0, 0)  # TCP header cut short: no ports
    dstopts = bytes.fromhex(CAPTURED["IPv6 UDP behind Destination Options"][0])
    assert nflog.ip_summary(dstopts, 0, 39) is None  # too short for IPv6
    # The bytes end inside the extension header: what is known is its type (60).
    assert nflog.ip_summary(dstopts, 0, 44) == ("::1", "::1", 60, 0, 0)
    # A chain of extension headers longer than the bytes: never an exception.
    chain = (P.IPv6Header("fd00::1", "fd00::2", P.IPPROTO_HOPOPTS).encode(64)
             + bytes([P.IPPROTO_DSTOPTS, 255]) + b"\0" * 6 + bytes([P.IPPROTO_TCP, 0]) + b"\0" * 6)
    assert nflog.ip_summary(chain, 0, len(chain)) == ("fd00::1", "fd00::2", 60, 0, 0)


# ------------------------------------------------------------------ records


WEB = Identity("shop/web", "node2", {"app": "web"}, True)
CLIENT = Identity("shop/client", "node1", {"app": "client"}, False)


class Meaning:
    def __init__(self, reason, direction=None, policies=(), default_deny=False):
        self.reason, self.direction, self.policies, self.default_deny = reason, direction, policies, default_deny


class Directory:
    ids = {"10.244.2.3": WEB, "10.244.1.2": CLIENT}

    def identity(self, ip):
        return self.ids.get(ip)

    def version(self):
        return 1

    def named_before(self, count):
        """The engine's log, told from what ``ids`` held when last asked."""
        snap, self._snap = getattr(self, "_snap", None), dict(self.ids)
        got = [(ip, was, None) for ip, was in (snap or {}).items() if was is not None and self.ids.get(ip) != was]
        self._told = getattr(self, "_told", 0) + len(got)
        return self._told, got

    def __init__(self):
        self.vips = {("10.96.0.10", 6, 80): "shop/web"}

    def service(self, ip, proto, port):
        return self.vips.get((ip, proto, port))

    def service_names(self):
        vips = dict(self.vips)  # as they are now, whatever comes later
        return lambda ip, proto, port: vips.get((ip, proto, port))

    def drop(self, prefix):
        if prefix in ("spoofed", "spoofed-mac", "spoofed-arp", "spoofed-nd", "ra-guard"):  # as agentd.daemon.flow_directory says
            return Meaning(prefix, "egress")
        return Meaning("policy", "ingress", ("shop/default-deny",), True) if prefix == "pod-in/shop/web" else None

    def pod_on(self, ifindex):
        return {7: ("vethclient", CLIENT), 8: ("vethgone", None)}.get(ifindex)


def recorder() -> FlowRecorder:
    return FlowRecorder("node2", Directory(), "/nonexistent", group=143, clock=lambda: 1000.0)


def test_service_connection_end_record():
    msg = destroy_event(ct.IPS_DST_NAT)
    ((mtype, _f, _s, _p, start, end),) = list(nl.iter_messages(msg))
    flow = recorder().connection(ct.decode_event(mtype, msg, start, end))
    assert flow is not None
    assert flow.service == "shop/web" and (flow.service_ip, flow.service_port) == ("10.96.0.10", 80)
    assert (flow.src.ip, flow.src.port, flow.src.identity) == ("10.244.1.2", 40000, CLIENT)
    assert (flow.dst.ip, flow.dst.port, flow.dst.identity) == ("10.244.2.3", 8080, WEB)  # the endpoint
    assert (flow.bytes_sent, flow.bytes_received, flow.packets_sent, flow.packets_received) == (400, 900, 5, 4)
    j = flow.json()
    assert j["event"] == "end" and j["direction"] == "ingress"
    assert j["service"] == {"name": "shop/web", "ip": "10.96.0.10", "port": 80}
    assert j["dst"]["pod"] == "shop/web" and j["dst"]["port"] == 8080  # the endpoint, from the reply tuple
    assert (j["bytes_sent"], j["bytes_received"], j["duration"]) == (400, 900, 0.25)


def test_a_record_read_later_names_the_service_of_when_the_event_came():
    """Records are made when first read: the Service is the one the address belonged to when
    the connection was made, not whatever took its address since (or nothing, once deleted)."""
    r = recorder()
    r._on_conntrack_datagrams([destroy_event(ct.IPS_DST_NAT)], 1000.0)
    r.directory.vips = {("10.96.0.10", 6, 80): "shop/other"}  # the Service deleted, its address reused
    (flow,) = list(r.ring)
    assert flow.service == "shop/web"
    r._on_conntrack_datagrams([destroy_event(ct.IPS_DST_NAT, start_ns=1_000_500_000_000)], 1001.0)
    assert list(r.ring)[-1].service == "shop/other"  # a connection made after the change


def _new_event(status: int) -> bytes:
    """destroy_event's connection confirmed (NEW: no counters, no stamps)."""
    body = (_tuple(ct.CTA_TUPLE_ORIG, "10.244.1.2", "10.96.0.10", 6, 40000, 80)
            + _tuple(ct.CTA_TUPLE_REPLY, "10.244.2.3", "10.244.1.2", 6, 8080, 40000)
            + nl.attr(ct.CTA_STATUS, struct.pack("!I", status)) + nl.attr(ct.CTA_ID, struct.pack("!I", 7)))
    return nl.encode_nfgen(ct.MSG_NEW, 0x400, 0, socket.AF_INET, body)


@pytest.mark.parametrize("fast", [True, False])
def test_an_end_names_the_service_of_when_its_connection_started(fast):
    """A connection outlives its Service (deleted; or deleted and its cluster IP given to
    another): its end names the Service its ``new`` named -- the Services as they were when it
    started (CTA_TIMESTAMP_START), not when its DESTROY is read.  One that started after the
    change is named as the Services are then; where no Service is known of a translated
    connection, its record keeps the address and port the client used (service name null),
    and the port and service filters agree with what it shows.  Also read the long way."""
    r = recorder()
    r.fast = fast and r.fast
    r._on_conntrack_datagrams([_new_event(ct.IPS_DST_NAT | ct.IPS_CONFIRMED)], 1000.0)  # started by then
    r.directory.vips = {}  # the Service deleted: established TCP goes on to its endpoint
    r._on_conntrack_datagrams([destroy_event(ct.IPS_DST_NAT)], 1001.0)
    r.directory.vips = {("10.96.0.10", 6, 80): "shop/other"}  # its address reused
    r._on_conntrack_datagrams([destroy_event(ct.IPS_DST_NAT)], 1002.0)
    msg = destroy_event(ct.IPS_DST_NAT)
    for mtype, _f, _s, _p, start, end in nl.iter_messages(msg):  # the long way (IPv6, laid out otherwise)
        r._on_conntrack(mtype, msg, start, end)
    new, *ends = list(r.ring)
    assert new.event == "new" and new.service == "shop/web"
    assert [(f.event, f.service) for f in ends] == [("end", "shop/web")] * 3
    for f in ends:
        assert f.json()["service"] == {"name": "shop/web", "ip": "10.96.0.10", "port": 80}
        assert FlowFilter.parse([("service", "shop/web")]).matches(f)
    # Started after the Service was deleted (between the reads at 1000 and 1001): named as then.
    r._on_conntrack_datagrams([destroy_event(ct.IPS_DST_NAT, start_ns=1_000_500_000_000)], 1003.0)
    gone = list(r.ring)[-1]
    assert gone.service is None
    assert gone.json()["service"] == {"name": None, "ip": "10.96.0.10", "port": 80}
    assert gone.json()["dst"]["ip"] == "10.244.2.3"
    for key, value, matches in (("ip", "10.96.0.10", True), ("port", "80", True), ("port", "8080", True),
                                ("port", "81", False), ("service", "shop/web", False)):
        assert FlowFilter.parse([(key, value)]).matches(gone) is matches, (key, value)
    assert "svc 10.96.0.10:80 => shop/web 10.244.2.3:8080" in line(gone.json())
    assert "svc shop/web 10.96.0.10:80 => shop/web 10.244.2.3:8080" in line(ends[0].json())
    # Started after the address was reused (after the read at 1001): the other Service.
    r._on_conntrack_datagrams([destroy_event(ct.IPS_DST_NAT, start_ns=1_001_500_000_000)], 1004.0)
    assert list(r.ring)[-1].service == "shop/other"
    # The Services as they were are forgotten HISTORY_AGE_NS after: then named as now.
    r._on_conntrack_datagrams([destroy_event(ct.IPS_DST_NAT)], 1004.0 + HISTORY_AGE_NS / 1e9 + 1)
    assert list(r.ring)[-1].service == "shop/other" and not r._services_past


def _dnat(dst: str, dport: int, mtype: int = ct.MSG_NEW) -> bytes:
    """A connection of client 10.244.1.2:40000 to ``dst``:``dport`` translated to web 10.244.2.3:80."""
    body = (_tuple(ct.CTA_TUPLE_ORIG, "10.244.1.2", dst, 6, 40000, dport)
            + _tuple(ct.CTA_TUPLE_REPLY, "10.244.2.3", "10.244.1.2", 6, 80, 40000)
            + nl.attr(ct.CTA_STATUS, struct.pack("!I", ct.IPS_DST_NAT | ct.IPS_CONFIRMED)) + nl.attr(ct.CTA_ID, struct.pack("!I", 7)))
    return nl.encode_nfgen(mtype, 0x400, 0, socket.AF_INET, body)


@pytest.mark.parametrize("fast", [True, False])
def test_a_translated_connection_is_shown_as_a_service_only_where_a_service_could_be(fast):
    """The portmap plugin's hostPort (node 192.168.1.10:8080 -> a pod's 80) is translated with
    no Service at all: its record has no ``service`` (as before Services' names were kept of
    deleted ones).  A translated destination in the Services' ranges, or one a snapshot of the
    Services knew (a node port of a Service deleted since), is a Service whose name is not
    known: name null.  The address the client used is still what the ip filter finds."""
    r = FlowRecorder("node2", Directory(), "/nonexistent", group=143, clock=lambda: 1000.0,
                     pods=[IPv4Network("10.244.0.0/16")], services=[IPv4Network("10.96.0.0/12")])
    r.fast = fast and r.fast
    r.directory.vips = {("192.168.1.10", 6, 30080): "shop/nodeport"}
    r._on_conntrack_datagrams([_dnat("192.168.1.10", 30080)], 1000.0)
    r.directory.vips = {}  # the NodePort Service deleted
    r._on_conntrack_datagrams([_dnat("192.168.1.10", 8080), _dnat("10.96.0.99", 80), _dnat("192.168.1.10", 30080)], 1001.0)
    named, hostport, vip, nodeport = (f.json() for f in r.ring)
    assert named["service"] == {"name": "shop/nodeport", "ip": "192.168.1.10", "port": 30080}
    assert "service" not in hostport and hostport["dst"] == {"ip": "10.244.2.3", "port": 80, **hostport["dst"]}
    assert "svc" not in line(hostport)
    assert FlowFilter.parse([("ip", "192.168.1.10")]).matches(list(r.ring)[1])
    assert vip["service"] == {"name": None, "ip": "10.96.0.99", "port": 80}
    assert nodeport["service"] == {"name": None, "ip": "192.168.1.10", "port": 30080}


@pytest.mark.parametrize("fast", [True, False])
def test_a_read_that_left_events_unread_is_no_boundary_of_the_services_then(monkeypatch, fast):
    """The Services before a change are kept with the time of the last read under them that
    emptied the socket (the clock before its last, empty recv): a connection that started by
    then had its ``new`` read under them.  A read that stopped at CT_BUDGET left such ``new`` s
    in the socket, and the Services may change before the next read (call_soon): its clock is no
    such boundary, or the end of a connection started before it names the Service its ``new``
    -- read under the Services after the change -- did not.  In C (drain) and in Python."""
    from agentd.flows import recorder as rec_mod

    if fast:
        assert ct.fast_events is not None, "agentd/kernel/_ctevents.c is not built (scripts/dev setup)"
    budget = 64 if fast else 3  # C reads up to 64 datagrams a system call
    monkeypatch.setattr(rec_mod, "CT_BUDGET", budget)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)  # C reads a file descriptor

    class Sock:
        def fileno(self):
            return a.fileno()

        def recv_many(self):
            try:
                return [a.recv(65536, socket.MSG_DONTWAIT)]
            except BlockingIOError:
                return []

    class Loop:
        def __init__(self) -> None:
            self.soon: list[object] = []

        def call_soon(self, callback):
            self.soon.append(callback)

        def add_reader(self, fd, callback):
            pass

    clock = [990.0]
    d = Directory()
    snapshot = [d.service_names()]
    d.service_names = lambda: snapshot[0]  # the same until the Services change, as FlowDirectory's
    r = FlowRecorder("node2", d, "/nonexistent", group=143, clock=lambda: clock[0])
    r.fast = fast
    r.ct_sock, r._loop = Sock(), Loop()  # type: ignore[assignment]

    def drain(*datagrams: bytes) -> None:
        for data in datagrams:
            b.send(data)
        r._drain_conntrack()

    try:
        drain(destroy_event(ct.IPS_DST_NAT, start_ns=900 * 10**9))  # emptied at 990
        clock[0] = 1000.0  # the budget's worth, and a connection started at 999.95 s left queued
        drain(*[destroy_event(ct.IPS_DST_NAT, start_ns=900 * 10**9)] * budget, _new_event(ct.IPS_DST_NAT | ct.IPS_CONFIRMED))
        assert len(r._loop.soon) == 1  # the rest at the next turn of the loop ...
        d.vips = {}  # ... before which the Services synced: shop/web deleted
        snapshot[0] = Directory.service_names(d)
        clock[0] = 1000.001
        r._loop.soon.pop()()  # type: ignore[operator]
        clock[0] = 1005.0
        drain(destroy_event(ct.IPS_DST_NAT, start_ns=999_950_000_000))
        new, end = list(r.ring)[-2:]
        assert (new.event, end.event) == ("new", "end")
        assert new.service is None and end.service is None  # as its new: named after the change
        assert r._services_past[0][0] == 990 * 10**9
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("fast", [True, False])
def test_a_services_change_costs_an_end_no_second_reading_of_its_event(monkeypatch, fast):
    """For 15 minutes after a Services change an end is named by the Services of its start
    (CTA_TIMESTAMP_START): the decoder (C, or Python where it is not built) hands that start
    over with every DESTROY -- a Service's connection (no pod at its VIP end: nothing carried)
    or one leaving the cluster -- rather than the event being walked again on the loop."""
    r = recorder()
    r.fast = fast
    if fast:
        assert r.fast, "agentd/kernel/_ctevents.c is not built (scripts/dev setup)"
    d = r.directory
    r._on_conntrack_datagrams([], 999.0)
    d.vips = {}
    r._on_conntrack_datagrams([], 999.5)
    assert r._services_past  # a past snapshot is kept
    batch = [destroy_event(ct.IPS_DST_NAT, start_ns=998 * 10**9), destroy_event(0, start_ns=998 * 10**9)]
    items = r._decode(batch)  # as the socket's read gives them (lifetime read here, once)
    walked = []
    lifetime = ct.lifetime
    monkeypatch.setattr(ct, "lifetime", lambda *a: (walked.append(a), lifetime(*a))[1])
    r._on_conntrack_items(items, 1000.0)
    assert walked == []
    assert [f.service for f in r.ring] == ["shop/web", None]  # the Services of its start


def test_a_change_of_the_services_settles_the_waiting_events_a_step_at_a_time(monkeypatch):
    """A Services change with the ring full of events read under the snapshot before: each
    read, and each turn of the loop, settles SETTLE_STEP of them, oldest first -- not all of
    them (up to a million: seconds) in one go on the event loop; each keeps the Service of
    when it came, and the new read's events the new snapshot."""
    from agentd.flows import recorder as rec_mod

    monkeypatch.setattr(rec_mod, "SETTLE_STEP", 100)
    d = Directory()
    snapshot = [d.service_names()]
    d.service_names = lambda: snapshot[0]  # the same until the Services change, as FlowDirectory's
    r = FlowRecorder("node2", d, "/nonexistent", group=143, ring_size=1000, clock=lambda: 1000.0)
    settled: list[object] = []
    settle = rec_mod.PendingConnection.settle
    monkeypatch.setattr(rec_mod.PendingConnection, "settle", lambda self: (settled.append(self), settle(self))[1])
    for _ in range(5):  # 1250 events: the first 250 left the ring (nothing to settle there)
        r._on_conntrack_datagrams([destroy_event(ct.IPS_DST_NAT)] * 250, 1000.0)
    assert not settled

    class Loop:
        def __init__(self) -> None:
            self.soon: list[object] = []

        def call_soon(self, callback):
            self.soon.append(callback)

    r._loop = loop = Loop()  # type: ignore[assignment]
    d.vips = {("10.96.0.10", 6, 80): "shop/other"}
    snapshot[0] = Directory.service_names(d)
    r._on_conntrack_datagrams([destroy_event(ct.IPS_DST_NAT, start_ns=1_000_500_000_000)], 1000.5)
    assert len(settled) == 100 and len(loop.soon) == 1  # a step now, the next asked of the loop
    r._on_conntrack_datagrams([destroy_event(ct.IPS_DST_NAT, start_ns=1_000_600_000_000)], 1000.6)
    assert len(settled) == 200 and len(loop.soon) == 1  # a read takes a step too, asking the loop once
    while loop.soon:
        loop.soon.pop(0)()  # type: ignore[operator]
    assert len(settled) == 1000 and len({id(e) for e in settled}) == 1000
    assert [e.seq for e in settled] == list(range(251, 1251))  # oldest first, those in the ring
    flows = list(r.ring)
    assert {f.service for f in flows[:-2]} == {"shop/web"}
    assert [f.service for f in flows[-2:]] == ["shop/other", "shop/other"]  # started after the change


def test_nodes_own_connections_are_not_recorded():
    ev = ct.CtEvent(False, socket.AF_INET, ct.CtTuple("172.30.0.11", "172.30.0.2", 6, 50000, 2379),
                    ct.CtTuple("172.30.0.2", "172.30.0.11", 6, 2379, 50000))
    assert recorder().connection(ev) is None


def test_drop_record_names_the_policies_and_folds_a_storm():
    r = recorder()
    msg = logged_packet("pod-in/shop/web", "10.244.1.2", "10.244.2.3", 6, 40000, 80)
    ((_t, _f, _s, _p, start, end),) = list(nl.iter_messages(msg))
    packet = nflog.decode_packet(msg, start, end)
    flows = [r.dropped(packet) for _ in range(100)]  # one instant: the burst, then folded
    kept = [f for f in flows if f is not None]
    assert len(kept) == r.limiter.burst and r.limiter.suppressed == 100 - r.limiter.burst
    j = kept[0].json()
    assert (j["verdict"], j["reason"], j["policies"], j["default_deny"]) == ("dropped", "policy", ["shop/default-deny"], True)
    assert "policy ingress: shop/default-deny (default deny)" in line(j)


def _decoded(msg: bytes) -> nflog.Packet:
    ((_t, _f, _s, _p, start, end),) = list(nl.iter_messages(msg))
    packet = nflog.decode_packet(msg, start, end)
    assert packet is not None
    return packet


def test_a_backlog_read_late_is_limited_by_when_the_kernel_logged_it():
    # Ten drops of one key a second apart, all read at one instant (the agent was busy): at
    # one record a second with a burst of 2, each came with a token back, so all are kept.
    r = FlowRecorder("node2", Directory(), "/nonexistent", group=143, agent_rate=1.0, agent_burst=2,
                     clock=lambda: 1700000100.0)
    drops = [_decoded(logged_packet("pod-in/shop/web", "10.244.1.2", "10.244.2.3", 6, 40000, 80, seq=k + 1,
                                    when=(1700000000 + k, 0))) for k in range(10)]
    kept = [r.dropped(p) for p in drops]
    assert all(f is not None for f in kept) and r.limiter.suppressed == 0
    assert [f.time for f in kept] == [1700000000.0 + k for k in range(10)]  # type: ignore[union-attr]
    # The same ten stamped within one second are a burst: two kept, eight folded into the next.
    burst = [_decoded(logged_packet("pod-in/shop/web", "10.244.1.2", "10.244.2.3", 6, 40000, 80, seq=k + 11,
                                    when=(1700000020, k * 1000))) for k in range(10)]
    assert sum(r.dropped(p) is not None for p in burst) == 2 and r.limiter.suppressed == 8


def test_a_drop_without_a_kernel_timestamp_is_limited_by_when_it_was_read():
    now = iter([1000.0, 1000.0, 1000.0, 1003.0])
    r = FlowRecorder("node2", Directory(), "/nonexistent", group=143, agent_rate=1.0, agent_burst=2,
                     clock=lambda: next(now))
    p = _decoded(logged_packet("pod-in/shop/web", "10.244.1.2", "10.244.2.3", 6, 40000, 80, when=None))
    assert p.time == 0.0
    kept = [r.dropped(p) for _ in range(4)]
    assert [f is not None for f in kept] == [True, True, False, True]
    assert kept[3].time == 1003.0 and kept[3].suppressed == 1  # type: ignore[union-attr]


def test_every_drop_is_counted_when_it_comes_folded_or_not():
    """agentd_flow_drops_total counts each dropped packet the agent heard of, the ones its limit
    folds included, as they come -- not when the next record of the same drop is made (a storm's
    last folded drops would wait for a record that may never come)."""
    r = recorder()
    msg = logged_packet("pod-in/shop/web", "10.244.1.2", "10.244.2.3", 6, 40000, 80)
    for mtype, _f, _s, _p, start, end in nl.iter_messages(msg):
        for _ in range(100):  # one instant: the burst recorded, the rest folded
            r._on_log(mtype, msg, start, end)
    assert len(r.ring) < 100 and r.limiter.suppressed == 100 - len(r.ring)
    assert r.drops == {("policy", "ingress"): 100}


def test_log_sequence_gaps_count_as_lost():
    r = recorder()
    for seq in (1, 2, 6):
        msg = logged_packet("x", "10.0.0.1", "10.0.0.2", 17, 1, 2, seq=seq)
        for mtype, _f, _s, _p, start, end in nl.iter_messages(msg):
            r._on_log(mtype, msg, start, end)
    assert r.lost["log"] == 3


class _Datagrams:
    """A log or conntrack socket holding datagrams to read (recv: None once read)."""

    def __init__(self, *datagrams: bytes) -> None:
        self.datagrams = list(datagrams)

    def recv(self) -> bytes | None:
        return self.datagrams.pop(0) if self.datagrams else None


def _web_drop(sport: int, seq: int) -> bytes:
    return logged_packet("pod-in/shop/web", "10.244.1.2", "10.244.2.3", 6, sport, 80, seq=seq)


def test_one_unreadable_message_of_a_log_datagram_is_skipped_and_not_lost():
    """The kernel batches up to its qthresh of logged packets in a datagram: one the agent
    cannot read is counted malformed, those after it are recorded, and its number is passed
    (it was heard of, not lost: the next datagram's sequence shows no gap)."""
    r = recorder()
    body = (nl.attr(nflog.NFULA_PREFIX, b"pod-in/shop/web\0") + nl.attr(nflog.NFULA_SEQ, struct.pack("!I", 2))
            + nl.attr(nflog.NFULA_IFINDEX_OUTDEV, b"\0" * 8))  # an ifindex of 8 bytes: unreadable
    bad = nl.encode_nfgen(nflog.MSG_PACKET, 0, 0, socket.AF_INET, body, res_id=143)
    rest = b"".join(_web_drop(40002 + i, 3 + i) for i in range(10))
    r._read(_Datagrams(_web_drop(40001, 1) + bad + rest), r._on_log, "log")
    assert len(r.ring) == 11 and r.malformed == 1 and r.lost.get("log", 0) == 0
    r._read(_Datagrams(_web_drop(50000, 13)), r._on_log, "log")
    assert len(r.ring) == 12 and r.malformed == 1 and r.lost.get("log", 0) == 0
    # One whose number cannot be read either (an attribute before it overruns): lost as well.
    broken = nl.encode_nfgen(nflog.MSG_PACKET, 0, 0, socket.AF_INET, struct.pack("=HH", 200, nflog.NFULA_PREFIX)
                             + nl.attr(nflog.NFULA_SEQ, struct.pack("!I", 14)), res_id=143)
    r._read(_Datagrams(broken + _web_drop(50001, 15)), r._on_log, "log")
    assert len(r.ring) == 13 and r.malformed == 2 and r.lost.get("log", 0) == 1


def test_a_logged_packet_the_agent_does_not_read_is_not_counted_lost():
    r = recorder()
    body = (nl.attr(nflog.NFULA_PREFIX, b"pod-in/shop/web\0") + nl.attr(nflog.NFULA_SEQ, struct.pack("!I", 2))
            + nl.attr(nflog.NFULA_PAYLOAD, b"\x00" * 20))  # no IPv4 or IPv6 packet
    foreign = nl.encode_nfgen(nflog.MSG_PACKET, 0, 0, socket.AF_INET, body, res_id=143)
    r._read(_Datagrams(_web_drop(40001, 1) + foreign, _web_drop(40002, 3)), r._on_log, "log")
    # (its prefix is known: a record without addresses, as of a frame that is no IP packet)
    assert len(r.ring) == 3 and r.lost.get("log", 0) == 0 and r.malformed == 0
    assert [f.src.ip for f in list(r.ring)] == ["10.244.1.2", "", "10.244.1.2"]


def test_one_unreadable_event_of_a_conntrack_datagram_is_skipped():
    r = recorder()
    bad = nl.encode_nfgen(ct.MSG_DELETE, 0, 0, socket.AF_INET,
                          nl.nested(ct.CTA_TUPLE_ORIG, nl.nested(ct.CTA_TUPLE_IP,
                                                                 nl.attr(ct.CTA_IP_V4_SRC, b"\x0a\x00\x00"))))
    r._on_conntrack_datagrams([destroy_event(ct.IPS_DST_NAT) + bad + destroy_event(ct.IPS_DST_NAT)], 1000.0)
    assert len(r.ring) == 2 and r.malformed == 1


# ------------------------------------------------------------------ filters, ring, limiter


def flow(src=CLIENT, dst=WEB, verdict="forwarded", port=80) -> Flow:
    return Flow(1.0, "node2", "new" if verdict == "forwarded" else "drop", "TCP", Peer("10.244.1.2", 40000, src),
                Peer("10.244.2.3", port, dst), "ingress", verdict=verdict)


@pytest.mark.parametrize("pairs, matches", [
    ([("pod", "shop/web")], True),
    ([("from-pod", "shop/web")], False),
    ([("to-pod", "shop/web"), ("verdict", "forwarded")], True),
    ([("namespace", "shop"), ("protocol", "tcp"), ("port", "80")], True),
    ([("label", "app=client")], True),
    ([("label", "app=client"), ("label", "app=web")], False),  # every label on the same end
    ([("label", "app")], True),
    ([("label", "app=client,app=web")], False),  # a selector's labels: on one end as well
    ([("label", "app=client, app")], True),
    ([("verdict", "dropped")], False),
    ([("node", "node1")], False),
    ([("ip", "10.244.2.3")], True),
    ([("port", "0")], False),  # no end has port 0, and a record of no Service has no Service port
])  # fmt: skip
def test_filters(pairs, matches):
    assert FlowFilter.parse(pairs).matches(flow()) is matches


@pytest.mark.parametrize("pairs, message", [
    ([("pod", "web")], "NAMESPACE/NAME"), ([("service", "web")], "filter service: expected NAMESPACE/NAME"),
    ([("verdict", "maybe")], "verdict"), ([("port", "99999")], "out of range"),
    ([("protocol", "gre")], "protocol"), ([("colour", "red")], "unknown filter"), ([("pod", " ")], "empty"),
    ([("label", "app!=web")], "label syntax"), ([("label", "app==web")], "label syntax"), ([("label", "app=web,")], "label syntax"),
    ([("label", "=web")], "label syntax"), ([("label", "Example.com/app=web")], "label syntax"),
    ([("ip", "fe80::aa:1%cni0")], "has a zone"),  # no record's address has one: it would match nothing
])  # fmt: skip
def test_bad_filters_are_one_line(pairs, message):
    with pytest.raises(FilterError, match=message):
        FlowFilter.parse(pairs)


def test_every_protocol_can_be_named_in_any_case():
    for name in ("ICMP", "TCP", "UDP", "ICMPv6", "SCTP"):
        for spelled in (name, name.lower(), name.upper()):
            assert FlowFilter.parse([("protocol", spelled)]).protocol == (name,), spelled
    v6 = Flow(1.0, "node2", "new", "ICMPv6", Peer("fd00::1", 128), Peer("fd00::2", 0), "egress")
    assert FlowFilter.parse([("protocol", "icmpv6")]).matches(v6)
    assert not FlowFilter.parse([("protocol", "icmp")]).matches(v6)


def test_verdicts_events_and_reasons_can_be_named_in_any_case():
    """As protocols (the browser view's form keeps a verdict in any case from its address)."""
    assert FlowFilter.parse([("verdict", "Dropped")]).verdict == ("dropped",)
    assert FlowFilter.parse([("verdict", "FORWARDED")]).matches(flow())
    assert FlowFilter.parse([("event", "NEW")]).event == ("new",)
    assert FlowFilter.parse([("reason", "No-Route")]).reason == ("no-route",)


def test_a_port_filter_never_matches_icmp_type_or_code():
    # ICMP's ends hold its type (source) and code (destination): an echo request is not port 8 or 0.
    ping = Flow(1.0, "node2", "new", "ICMP", Peer("10.244.1.2", 8, CLIENT), Peer("10.244.2.3", 0, WEB), "ingress")
    unreachable = Flow(1.0, "node2", "new", "ICMPv6", Peer("fd00::1", 1), Peer("fd00::2", 3), "egress")
    for port in ("8", "0", "1", "3"):
        flt = FlowFilter.parse([("port", port)])
        assert not flt.matches(ping) and not flt.matches(unreachable), port
    for protocol in ("UDP", "SCTP"):
        f = Flow(1.0, "node2", "new", protocol, Peer("10.244.1.2", 8), Peer("10.244.2.3", 53), "egress")
        assert FlowFilter.parse([("port", "53")]).matches(f), protocol


def test_a_service_without_endpoints_drop_is_found_by_service_not_by_to_pod():
    # docs/troubleshooting.md "Start here": the drop's destination is the virtual IP (no pod).
    drop = Flow(1.0, "node1", "drop", "TCP", Peer("10.244.1.2", 40000, CLIENT), Peer("10.96.0.10", 80), "egress",
                verdict="dropped", reason="no-endpoints", service="shop/web", service_ip="10.96.0.10", service_port=80)
    assert FlowFilter.parse([("from-pod", "shop/client"), ("service", "shop/web")]).matches(drop)
    assert FlowFilter.parse([("from-pod", "shop/client"), ("reason", "no-endpoints")]).matches(drop)
    assert not FlowFilter.parse([("from-pod", "shop/client"), ("to-pod", "shop/web")]).matches(drop)


def test_the_reason_filter_takes_what_the_recorder_gives_and_nothing_else():
    # An unrecognised log prefix is recorded (and counted) as "unknown": selectable like the rest.
    drop = recorder().dropped(nflog.Packet("someone-elses-rule", socket.AF_INET, 1.0, 3, 4, 1, "10.244.1.2",
                                           "10.244.2.3", 6, 40000, 80))
    assert drop is not None and drop.reason == "unknown"
    assert FlowFilter.parse([("reason", "unknown")]).matches(drop)
    assert not FlowFilter.parse([("reason", "policy")]).matches(drop)
    with pytest.raises(FilterError, match="'no-such' is not one of policy, spoofed, spoofed-mac, spoofed-arp, spoofed-nd, ra-guard, vlan-tagged, "
                                          "isolated, other-family, no-endpoints, "
                                          "no-local-endpoints, no-service-port, no-service, no-route, unknown"):
        FlowFilter.parse([("reason", "no-such")])  # nothing records it


def test_filter_round_trips_through_pairs():
    f = FlowFilter.parse([("pod", "shop/web"), ("label", "app=web"), ("label", "tier"), ("port", "80")])
    assert FlowFilter.parse(f.pairs()) == f


async def test_the_last_zero_records_are_none():
    # GET /flows?follow=1&last=0: only what comes from now on, not the newest record first.
    ring = FlowRing(3)
    ring.add(flow(port=1))
    assert ring.last(FlowFilter(), 0) == [] and ring.last(FlowFilter(), 1)[0].dst.port == 1
    search = ring.search(FlowFilter(), 0)
    assert search.step(10) and search.result() == []


async def test_ring_is_bounded_and_followers_lose_rather_than_grow():
    ring = FlowRing(3)
    follower = ring.follow(FlowFilter(), limit=2)
    for i in range(5):
        ring.add(flow(port=i))
    assert [f.dst.port for f in ring.records] == [2, 3, 4] and ring.seq == 5
    assert follower.queue.qsize() == 2 and follower.lost == 3
    assert [f.dst.port for f in ring.last(FlowFilter.parse([("port", "3")]), 10)] == [3]
    ring.unfollow(follower)
    await asyncio.sleep(0)


def test_the_ring_lists_what_it_holds_oldest_first_before_and_after_it_wraps():
    for size, added in ((5, 0), (5, 3), (5, 5), (5, 7), (5, 10), (1, 4)):
        ring = FlowRing(size)
        for i in range(added):
            ring.add(flow(port=i))
        want = list(range(max(0, added - size), added))
        assert [f.dst.port for f in ring.records] == want, (size, added)
        assert [f.dst.port for f in ring] == want and len(ring) == len(want)


def test_followers_are_bounded():
    ring = FlowRing(3)
    followers = [ring.follow(FlowFilter()) for _ in range(MAX_FOLLOWERS)]
    with pytest.raises(TooManyFollowers, match="at most"):
        ring.follow(FlowFilter())
    ring.unfollow(followers.pop())
    followers.append(ring.follow(FlowFilter()))  # room again once one went
    assert len(ring.followers) == MAX_FOLLOWERS


def test_search_goes_step_by_step_over_what_the_ring_held_when_it_began():
    ring = FlowRing(100)
    for i in range(50):
        f = flow(port=i % 5)
        f.time = float(i)
        ring.add(f)
    search = ring.search(FlowFilter.parse([("port", "3")]), 4)
    steps = 1
    late = flow(port=3)
    late.time = 50.0
    ring.add(late)  # taken in after the search began: not in it
    while not search.step(7):
        steps += 1
    assert [f.time for f in search.result()] == [33.0, 38.0, 43.0, 48.0]
    assert steps == 3  # 21 records looked at, 7 at a time: no more than the answer needed
    since = ring.search(FlowFilter(), 100, since=45.0)
    assert not since.step(2) and since.step(100)
    assert [f.time for f in since.result()] == [45.0, 46.0, 47.0, 48.0, 49.0, 50.0]
    assert ring.search(FlowFilter(), 0).step(1)  # asked for none: done at once


def test_a_search_for_none_after_a_cursor_counts_only_what_the_ring_lost():
    """``GET /flows?after=ID:SEQ&last=0`` (a follower resuming): the records after the cursor
    the ring still holds are not scrolled out; those it wrapped past are."""
    ring = FlowRing(100)
    for i in range(100):
        ring.add(flow(port=i))
    assert ring.search(FlowFilter(), 0, after=95).scrolled == 0
    assert ring.search(FlowFilter(), 0, after=0).scrolled == 0
    for i in range(50):
        ring.add(flow(port=i))  # records 1..50 scrolled out
    assert ring.search(FlowFilter(), 0, after=20).scrolled == 30
    assert ring.search(FlowFilter(), 5, after=20).scrolled == 30  # as a search for some says
    assert ring.search(FlowFilter(), 0, after=140).scrolled == 0


def test_a_cluster_answer_holds_the_newest_records_only():
    from agentd.daemon.observe_api import _Newest, _node_params

    newest = _Newest(3)
    for when, node in ((5.0, "a"), (1.0, "b"), (7.0, "b"), (3.0, "a"), (6.0, "c"), (2.0, "c")):
        newest.add(when, f"{node}{when}".encode())
    assert newest.oldest_first() == [b"a5.0", b"c6.0", b"b7.0"] and len(newest.heap) == 3
    none = _Newest(0)
    none.add(1.0, b"x")
    assert none.oldest_first() == []
    # Each node is asked for its own records, whichever nodes the reader named.
    flt = FlowFilter.parse([("node", "node1"), ("node", "node2"), ("verdict", "dropped")])
    assert _node_params(flt, "node2", 12.5) == [("verdict", "dropped"), ("node", "node2"), ("since", "12.5")]


def test_limiter_refills_and_keeps_few_keys():
    lim = DropLimiter(rate=10, burst=2, max_keys=3)
    assert [lim.allow("k", 0.0) for _ in range(4)] == [0, 0, None, None]
    assert lim.allow("k", 0.1) == 2  # one token back after 0.1 s: says how many were folded
    for k in range(10):
        lim.allow(("spoofed", k), 0.2)
    assert len(lim.buckets) == 3


def test_a_key_the_limiter_forgets_keeps_its_folds_unless_every_key_folds():
    """Past ``max_keys`` a new key evicts one that folds nothing -- the folded drops of another
    stay for its next record, and its budget is not reset --; where every key folds, the
    evicted one's folds are counted (``evicted``, /status suppressed.agent_evicted)."""
    from agentd.flows.views import FlowViews

    lim = DropLimiter(rate=1.0, burst=1, max_keys=2)
    assert (lim.allow("A", 0.0), lim.allow("A", 0.1)) == (0, None)  # A folds one
    assert (lim.allow("B", 0.2), lim.allow("C", 0.3)) == (0, 0)  # C evicts B, not A
    assert lim.allow("A", 0.4) is None  # no fresh burst: still over its limit
    assert lim.allow("A", 5.0) == 2 and lim.evicted == 0  # its next record shows both
    assert lim.allow("C", 5.1) == 0 and lim.allow("C", 5.2) is None  # A and C fold, both
    assert lim.allow("A", 5.3) is None
    assert lim.allow("D", 5.4) == 0 and lim.evicted == 1  # the oldest goes, its fold counted
    r = recorder()
    r.limiter = lim
    assert FlowViews(r, lambda: 0).status()["suppressed"] == {"kernel": 0, "agent": 4, "agent_evicted": 1}
    metrics = {m.name: [x.value for x in m.samples] for m in FlowViews(r, lambda: 0).collect()}
    assert metrics["agentd_flow_drops_suppressed_evicted"] == [1]


def test_limiter_takes_drops_a_little_out_of_order_without_losing_tokens():
    lim = DropLimiter(rate=10, burst=2)
    assert lim.allow("k", 5.0) == 0
    assert lim.allow("k", 4.9) == 0  # logged earlier on another CPU: the burst's second token
    assert lim.allow("k", 4.95) is None  # no refill from a time before the bucket's
    assert lim.allow("k", 5.25) == 1  # a quarter second after the bucket's time: tokens back


def test_limiter_refills_after_the_clock_steps_back():
    """Drops are timed by the wall clock: stepped back an hour (NTP, a resumed VM), a key that
    used its burst is not folded for the hour, but refills from the new time on."""
    lim = DropLimiter(rate=10, burst=20)
    t = 1_700_000_000.0
    for i in range(40):
        lim.allow("k", t + i * 0.001)  # the burst used, the rest folded
    assert lim.suppressed == 20
    # At the step the bucket has what it had (none); then, one drop a second, each is kept.
    assert [lim.allow("k", t - 3600 + s) for s in range(5)] == [None, 21, 0, 0, 0]
    assert sum(lim.allow("k", t - 3600 + s) is not None for s in range(5, 600)) == 595


# ------------------------------------------------------------------ the drop rules


def test_pod_chain_logs_before_its_drop_under_a_limit():
    policy = Policy.parse({"metadata": {"namespace": "shop", "name": "deny"}, "spec": {"podSelector": {}}})
    (chain, _counter) = policy_compiler.compile_pod_chain("in", "shop", "web", [policy], DropLog(143, 50, 60))
    rules = [json.loads(r) for r in chain.rules]
    assert rules[1] == [{"limit": {"rate": 50, "per": "second", "burst": 60}},
                        {"log": {"prefix": "pod-in/shop/web", "group": 143}},
                        {"counter": "pod-in/shop/web"}, {"drop": None}]
    assert rules[2] == [{"counter": SUPPRESSED}] and rules[3] == [{"counter": "pod-in/shop/web"}, {"drop": None}]
    (plain, _) = policy_compiler.compile_pod_chain("in", "shop", "web", [policy])
    assert len(plain.rules) == 2  # flows off: no log rule


def test_long_pod_chain_prefix_fits_nflog():
    chain = policy_compiler.pod_chain("in", "n" * 63, "p" * 130)
    prefix = policy_compiler.drop_prefix(chain)
    assert len(prefix) <= 127 and prefix.startswith("pod-in/#")


def test_engine_explains_a_prefix_and_routes_every_pod_with_flows_on():
    engine = PolicyEngine("node2", drop_log=DropLog(143), route_all=True)
    pod = Pod("shop", "web", "node2", (IPv4Address("10.244.2.3"),), {"app": "web"})
    engine.upsert_pod(pod, LocalPort("veth1", "02:00:00:00:00:01", "cni0"))
    engine.upsert_pod(Pod("lobby", "a", "node2", (IPv4Address("10.244.2.4"),), {}),
                      LocalPort("veth2", "02:00:00:00:00:02", "cni0"))
    engine.upsert_policy(Policy.parse({"metadata": {"namespace": "shop", "name": "deny"}, "spec": {"podSelector": {}}}))
    rs = engine.build()
    assert engine.drop_origin("pod-in/shop/web") == ("in", ("shop", "web"))
    assert engine.denying(("shop", "web"), "in") == (["shop/deny"], True)
    assert engine.by_ip["10.244.2.4"] == ("lobby", "a")
    handed_up = rs.objects[("bridge", "agentd-policy", "set", "isolated-ports")].elements
    assert handed_up == {"veth1", "veth2"}  # lobby/a is not isolated, but goes through conntrack


def _directory_drop(prefix: str):
    from agentd.daemon.flow_directory import FlowDirectory

    return FlowDirectory(None, None, (None, None)).drop(prefix)


def test_services_refusals_log_with_the_chain_name():
    table = services_compiler.Table("node1", DropLog(143))
    rs = table.rs
    reject = rs.objects[("ip", "agentd-services", "chain", services_compiler.REJECT_CHAIN)]
    assert json.loads(reject.rules[0])[1] == {"log": {"prefix": "no-endpoints", "group": 143}}
    assert ("ip", "agentd-services", "counter", SUPPRESSED) in rs.objects
    # A cluster IP's undefined port (refused) and an unallocated service address (dropped):
    # logged each with its chain's name, which the directory reads as its reason.
    for chain, verdict, reason in ((services_compiler.NO_PORT_CHAIN, "reject", "no-service-port"),
                                   (services_compiler.NO_SERVICE_CHAIN, "drop", "no-service")):  # fmt: skip
        rules = [json.loads(r) for r in rs.objects[("ip", "agentd-services", "chain", chain)].rules]
        assert rules[0][1] == {"log": {"prefix": chain, "group": 143}} and rules[0][-1] == {verdict: None}
        meaning = _directory_drop(chain)
        assert meaning is not None and meaning.reason == reason and reason in REASONS


# ------------------------------------------------------------------ the cluster's followed streams


class _Node:
    """A ClusterView whose node answers each follow with ``answers`` in turn (an exception, or lines)."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.asked = 0

    async def lines(self, node, path, *, follow=False, **_):
        self.asked += 1
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        for record in answer:
            yield record


async def test_a_merged_stream_counts_what_it_could_not_hold():
    from agentd.daemon.observe_api import _Merge

    merge = _Merge(limit=2)
    for i in range(5):
        merge.put(b"%d\n" % i)
    assert merge.queue.qsize() == 2 and merge.lost == 3


async def test_a_merged_stream_holds_at_most_its_bytes_of_large_records():
    """A stalled reader of a followed cluster stream: 10,000 lines of 1 MB records were held
    (10 GB).  At most MERGE_BYTES are; the rest counted as lost, as past the line count; what
    the reader takes frees its bytes."""
    from agentd.daemon.observe_api import _Merge

    merge = _Merge()
    big = b"x" * 999_999 + b"\n"
    for _ in range(100):
        merge.put(big)
    held = (32 << 20) // len(big)  # MERGE_BYTES: 32 MiB
    assert (merge.queue.qsize(), merge.lost) == (held, 100 - held) and merge.queue.bytes == held * len(big)
    merge.put(_line := b'{"lost":5}\n', 5)  # a small line still fits in what is left
    assert merge.queue.qsize() == held + 1 and merge.lost == 100 - held
    merge.put(big, 3)
    assert merge.lost == 100 - held + 3  # the records a line stands for, counted
    assert merge.queue.get_nowait() == big and merge.queue.bytes == (held - 1) * len(big) + len(_line)
    merge.put(big)  # taken out: room again
    assert merge.queue.qsize() == held + 1 and merge.lost == 100 - held + 3


async def test_a_followed_node_that_refuses_is_given_up_and_a_broken_one_asked_less_often(monkeypatch):
    from types import SimpleNamespace

    from agentd.daemon import observe_api
    from agentd.daemon.cluster import NodeAnswered

    gone = _Node([NodeAnswered("node2", 404, b'{"error": "flow records are off"}')])
    merge = observe_api._Merge()
    await observe_api._pump_remote(gone, "node2", "/flows?follow=1", merge)  # returns: not asked again
    assert gone.asked == 1 and b"answered 404" in merge.queue.get_nowait() and merge.queue.empty()

    delays: list[float] = []

    async def sleep(seconds):  # the pauses between two askings, without waiting them
        delays.append(seconds)
        if len(delays) == 5:
            raise asyncio.CancelledError

    merge = observe_api._Merge()
    monkeypatch.setattr(observe_api, "asyncio", SimpleNamespace(get_running_loop=asyncio.get_running_loop, sleep=sleep))
    refused = NodeAnswered("node2", 401, b'{"error": "the cluster read token is required"}')
    broken = _Node([refused, refused, refused, [b'{"time": 1}\n'], OSError("node2 unreachable: reset")])
    with pytest.raises(asyncio.CancelledError):
        await observe_api._pump_remote(broken, "node2", "/flows?follow=1", merge)
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0]  # longer each time while it stays broken, up to a minute
    said = [merge.queue.get_nowait() for _ in range(merge.queue.qsize())]
    # The refusal said once for the outage, the record passed on, each new reason said.
    assert [b"401" in line for line in said] == [True, False, False, False]
    assert said[1] == b'{"time": 1}\n' and b"ended the stream" in said[2] and b"reset" in said[3]


class _Faulty(_Node):
    """A node whose answer's lines may be followed by an exception: ``(lines, exception)``."""

    async def lines(self, node, path, *, follow=False, **_):
        self.asked += 1
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        lines, err = answer
        for record in lines:
            yield record
        if err is not None:
            raise err
        await asyncio.Event().wait()  # stays open


async def test_a_followed_node_whose_stream_fails_unexpectedly_is_said_logged_and_followed_again(monkeypatch, caplog):
    """Following a node that failed of an error this agent does not expect (a defect here: not
    the node's unreachable, slow or bad answer) ended the node's task for good, silently: the
    cluster's stream showed its records no more.  Said as the node's error (once per outage),
    one log line naming the node, the error and where it was raised, and the node asked again
    after the pauses of a broken stream."""
    from types import SimpleNamespace

    from agentd.daemon import observe_api

    delays: list[float] = []

    async def sleep(seconds):  # the pauses between two askings, without waiting them
        delays.append(seconds)

    monkeypatch.setattr(observe_api, "asyncio", SimpleNamespace(get_running_loop=asyncio.get_running_loop, sleep=sleep,
                                                                timeout=asyncio.timeout))
    node = _Faulty([([b'{"time": 1}\n'], RuntimeError("injected")), RuntimeError("injected"),
                    ([b'{"time": 2}\n'], TypeError("injected too")), ([b'{"time": 3}\n'], None)])
    merge = observe_api._Merge()
    task = asyncio.create_task(observe_api._pump_remote(node, "node2", "/flows?follow=1", merge))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not task.done() and node.asked == 4  # asked again each time, the last answer still followed
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert delays == [2.0, 4.0, 8.0]
    said = [json.loads(merge.queue.get_nowait()) for _ in range(merge.queue.qsize())]
    failed = "following node2 failed on this node: {} (followed again after a pause)"
    assert said == [{"time": 1}, {"node": "node2", "error": failed.format("RuntimeError: injected")},
                    {"time": 2}, {"node": "node2", "error": failed.format("TypeError: injected too")}, {"time": 3}]
    logged = [r for r in caplog.records if r.name == "agentd.api"]
    assert [r.levelname for r in logged] == ["ERROR", "ERROR"]  # the same failure again: not logged again
    assert "node2" in logged[0].getMessage() and "RuntimeError: injected" in logged[0].getMessage()
    assert " at test_flows.py:" in logged[0].getMessage() and "in lines" in logged[0].getMessage()


async def test_a_followed_node_that_fails_before_its_last_records_ended_hands_the_gathering_the_error():
    """The last N a followed stream starts with: a failure before they ended is said to the
    gathering (which waited for them until its timeout, then said the node unreachable)."""
    from agentd.daemon import observe_api

    node = _Faulty([([b'{"time": 1, "node": "node2"}\n'], ValueError("injected"))])
    first = observe_api._Snapshot(5)
    task = asyncio.create_task(observe_api._pump_remote(node, "node2", "/flows?last=5&follow=1", observe_api._Merge(),
                                                        first=first))
    for _ in range(10):
        await asyncio.sleep(0)
    assert first.done.is_set() and first.error is not None and "ValueError: injected" in first.error
    assert first.take() == [b'{"time": 1, "node": "node2"}\n']
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_this_nodes_followed_records_are_followed_again_after_an_unexpected_failure(monkeypatch, caplog):
    """The same of this node's own followed records in a cluster's stream."""
    from types import SimpleNamespace

    from agentd.daemon import observe_api

    delays: list[float] = []

    async def sleep(seconds):
        delays.append(seconds)

    monkeypatch.setattr(observe_api, "asyncio", SimpleNamespace(get_running_loop=asyncio.get_running_loop, sleep=sleep))
    ring = FlowRing(100)

    class Broken:
        lost = 0

        class queue:  # a follower's queue that fails
            @staticmethod
            async def get():
                raise RuntimeError("injected")

    class View:
        followed = 0
        unfollowed: ClassVar[list] = []

        def follow(self, flt, pool):
            View.followed += 1
            return Broken() if View.followed == 1 else ring.follow(flt, pool=pool)

        def unfollow(self, follower):
            View.unfollowed.append(follower)
            if not isinstance(follower, Broken):
                ring.unfollow(follower)

    merge = observe_api._Merge()
    task = asyncio.create_task(observe_api._pump_local(View(), FlowFilter(), merge, "node1"))
    for _ in range(5):
        await asyncio.sleep(0)
    ring.add(Flow(time=1.0, node="node1", event="new", protocol="UDP", src=Peer("10.244.1.2", 1),
                  dst=Peer("10.244.2.3", 53), direction="egress"))
    for _ in range(5):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    got = [json.loads(merge.queue.get_nowait()) for _ in range(merge.queue.qsize())]
    assert got[0] == {"node": "node1", "error": "following node1 failed on this node: RuntimeError: injected "
                                                "(followed again after a pause)"}
    assert [x["time"] for x in got[1:]] == [1.0]
    assert delays == [2.0] and View.followed == 2 and len(View.unfollowed) == 2  # each follower let go
    assert len([r for r in caplog.records if r.name == "agentd.api" and "node1" in r.getMessage()]) == 1


class _Registry:
    """A ClusterView whose registry can grow: each node's followed stream sends one record, then
    stays open until cancelled (``closed`` says whose were)."""

    def __init__(self, names):
        self.addresses = {name: "192.0.2.1" for name in names}
        self.asked: list[tuple[str, str]] = []
        self.closed: set[str] = set()

    def nodes(self):
        return dict(self.addresses)

    async def lines(self, node, path, *, follow=False, **_):
        self.asked.append((node, path))
        try:
            yield json.dumps({"time": 1.0, "node": node}).encode() + b"\n"
            await asyncio.Event().wait()
        finally:
            self.closed.add(node)


class _Stream:
    def __init__(self):
        self.lines: list[bytes] = []

    async def write(self, data):
        self.lines.append(data)


class _Failing(_Registry):
    """A registry whose node2's first followed stream fails of an unexpected error after one record."""

    async def lines(self, node, path, *, follow=False, **_):
        self.asked.append((node, path))
        yield json.dumps({"time": float(len(self.asked)), "node": node}).encode() + b"\n"
        if len(self.asked) == 1:
            raise AttributeError("'NoneType' object has no attribute 'read'")
        await asyncio.Event().wait()


async def test_a_followed_cluster_follows_again_a_node_whose_stream_failed_unexpectedly(monkeypatch, caplog):
    from types import SimpleNamespace

    from agentd.daemon import observe_api

    monkeypatch.setattr(observe_api, "RETRY_FIRST", 0.0)  # the pause of a broken stream: none here
    registry = _Failing(["node2"])
    agent = SimpleNamespace(cluster_view=lambda: registry, flows_view=lambda: None, node_name=lambda: "node1")
    handlers = observe_api._Handlers(agent, read_only=False, token_of=lambda: None)
    resp = _Stream()
    task = asyncio.create_task(handlers._cluster_flows(resp, FlowFilter.parse([("node", "node2")]), 0, None, True))
    for _ in range(30):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    said = [json.loads(line) for line in resp.lines if line.strip()]
    assert said[0] == {"time": 1.0, "node": "node2"} and said[2] == {"time": 2.0, "node": "node2"}
    assert said[1]["node"] == "node2" and "AttributeError" in said[1]["error"]
    assert len(registry.asked) == 2
    assert [r.getMessage().split(" at ")[0] for r in caplog.records if r.name == "agentd.api"] == [
        f"flows of the cluster: {said[1]['error']}"]


async def test_a_followed_cluster_takes_in_a_node_that_joined_after_it_began(monkeypatch):
    from types import SimpleNamespace

    from agentd.daemon import observe_api

    monkeypatch.setattr(observe_api, "KEEPALIVE", 0)  # a keep-alive tick at every quiet turn of the loop
    for pairs, joined_followed in (([], True), ([("node", "node2")], False)):
        registry = _Registry(["node1", "node2"])
        agent = SimpleNamespace(cluster_view=lambda r=registry: r, flows_view=lambda: None, node_name=lambda: "node1")
        handlers = observe_api._Handlers(agent, read_only=False, token_of=lambda: None)
        resp = _Stream()
        task = asyncio.create_task(handlers._cluster_flows(resp, FlowFilter.parse(pairs), 0, None, True))
        for _ in range(20):
            await asyncio.sleep(0)
        registry.addresses["node3"] = "192.0.2.3"  # registered after the stream began
        for _ in range(20):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        nodes = {json.loads(line)["node"] for line in resp.lines if line.strip()}
        followed = {"node2", "node3"} if joined_followed else {"node2"}
        assert nodes == followed and {n for n, _ in registry.asked} == followed, pairs
        assert registry.closed == followed  # every node's stream ended with the reader's


class _Leaving(_Registry):
    """A registry whose nodes can leave: a node's stream ends when it leaves, and asking for
    one not registered is a KeyError (as ClusterView.url's)."""

    def __init__(self, names):
        super().__init__(names)
        self.left: dict[str, asyncio.Event] = {}

    async def lines(self, node, path, *, follow=False, **_):
        self.asked.append((node, path))
        if node not in self.addresses:
            raise KeyError(node)
        left = self.left.setdefault(node, asyncio.Event())
        yield json.dumps({"time": 1.0, "node": node}).encode() + b"\n"
        await left.wait()


async def test_a_followed_cluster_lets_go_of_a_node_that_left_and_takes_it_in_again(monkeypatch):
    from types import SimpleNamespace

    from agentd.daemon import observe_api

    monkeypatch.setattr(observe_api, "KEEPALIVE", 0)
    monkeypatch.setattr(observe_api, "RETRY_FIRST", 0.0)  # a broken stream asked again at once
    registry = _Leaving(["node1", "node2", "node3"])
    agent = SimpleNamespace(cluster_view=lambda: registry, flows_view=lambda: None, node_name=lambda: "node1")
    handlers = observe_api._Handlers(agent, read_only=False, token_of=lambda: None)
    resp = _Stream()
    task = asyncio.create_task(handlers._cluster_flows(resp, FlowFilter.parse([]), 0, None, True))
    for _ in range(20):
        await asyncio.sleep(0)
    del registry.addresses["node3"]  # it leaves: its stream ends, it is no longer in etcd
    registry.left.pop("node3").set()
    for _ in range(50):
        await asyncio.sleep(0)
    asked_while_gone = sum(1 for n, _ in registry.asked if n == "node3")
    assert asked_while_gone == 2  # the first stream, and the one asking that found it gone: no retries
    said = [json.loads(line) for line in resp.lines if line.strip()]
    assert {"node": "node3", "error": "no node node3 in etcd: it left the cluster, no longer followed"} in said
    registry.addresses["node3"] = "192.0.2.3"  # back
    for _ in range(20):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sum(1 for n, _ in registry.asked if n == "node3") == 3  # followed again
    assert [json.loads(line)["node"] for line in resp.lines if line.strip()].count("node3") >= 3


@pytest.mark.parametrize("query, message", [
    ("last=abc", "last: 'abc' is not a whole number"), ("last=1e3", "last: '1e3' is not a whole number"),
    ("last=", "last: '' is not a whole number"), ("last=-1", "last: -1 is out of range 0..100000"),
    ("since=abc", "since: 'abc' is not a UNIX time"), ("since=nan", "since: 'nan' is not a UNIX time"),
    ("since=inf", "since: 'inf' is not a UNIX time"), ("since=-Infinity", "since: '-Infinity' is not a UNIX time"),
])  # fmt: skip
async def test_bad_last_or_since_is_a_400_naming_it(query, message):
    from types import SimpleNamespace

    from aiohttp.test_utils import make_mocked_request

    from agentd.daemon import observe_api

    agent = SimpleNamespace(cluster_view=lambda: None, flows_view=lambda: None, node_name=lambda: "node1")
    handlers = observe_api._Handlers(agent, read_only=False, token_of=lambda: None)
    resp = await handlers.flows(make_mocked_request("GET", "/flows?" + query))
    assert resp.status == 400 and json.loads(resp.body) == {"error": message}


def test_a_spoofed_drop_names_the_pod_whose_veth_sent_it():
    # A bridged packet: NFLOG's INDEV is the bridge (3), PHYSINDEV the pod's port (7).  The
    # source address is web's: whom it pretends to be; the port says client sent it.
    r = recorder()
    flow = r.dropped(_decoded(logged_packet("spoofed", "10.244.2.3", "10.244.2.9", 17, 5000, 81, devices=(3, 7))))
    assert flow is not None
    j = flow.json()
    assert (j["reason"], j["src"]["pod"]) == ("spoofed", "shop/web")
    assert j["sender"] == {"interface": "vethclient", "pod": "shop/client", "namespace": "shop", "node": "node1",
                           "labels": {"app": "client"}}  # fmt: skip
    assert "source address is not the pod's own (sent by shop/client on vethclient)" in line(j)
    # `agentd flows --from-pod shop/client` shows it: client sent it, whatever address it wrote.
    assert FlowFilter.parse([("from-pod", "shop/client")]).matches(flow)
    assert FlowFilter.parse([("pod", "shop/client")]).matches(flow)
    # An interface that is no pod's: named alone; a policy drop: no sender.
    j = r.dropped(_decoded(logged_packet("spoofed", "10.244.2.3", "10.244.2.9", 17, 5002, 81, devices=(3, 8)))).json()  # type: ignore[union-attr]
    assert j["sender"] == {"interface": "vethgone"} and "(sent by vethgone)" in line(j)
    j = r.dropped(_decoded(logged_packet("pod-in/shop/web", "10.244.1.2", "10.244.2.3", 6, 40000, 80, devices=(3, 7)))).json()  # type: ignore[union-attr]
    assert "sender" not in j


def test_a_spoofed_drops_sender_is_found_by_its_labels_as_by_its_name():
    """The pod whose veth sent a spoofed packet is one of its ends for every filter that
    names a pod: by name, namespace, or labels."""
    flow = recorder().dropped(_decoded(logged_packet("spoofed", "10.9.9.9", "10.244.2.3", 17, 5353, 53,
                                                     devices=(3, 7))))
    assert flow is not None and flow.sender is not None and flow.src.identity is None
    for pairs in ([("pod", "shop/client")], [("from-pod", "shop/client")], [("namespace", "shop")],
                  [("label", "app=client")], [("label", "app")]):
        assert FlowFilter.parse(pairs).matches(flow), pairs
    assert not FlowFilter.parse([("label", "app=db")]).matches(flow)


# ------------------------------------------------------------------ connections the pod programs record


def _conn(client_hi: bool, state: int, first: int, last: int, kind: int | None = None) -> tuple[bytes, bytes]:
    """podpath.h's struct podconn_value (and key) of client 10.244.1.2:40000 -> web
    10.244.2.3:80: the client is the key's lower end (client_hi False) as addresses go."""

    key = socket.inet_aton("10.244.1.2") + socket.inet_aton("10.244.2.3") + (40000).to_bytes(2, "big") + (80).to_bytes(2, "big")
    value = CONN_VALUE.pack(6, 5, 1400, 900, first, last, state, int(client_hi), 3)
    return key, value


class Programs:
    """What agentd.dataplane.bpf.podpath.PodFastPath gives the recorder (recording)."""

    recording = True

    def __init__(self, held: dict[bytes, bytes]) -> None:
        self.held, self.rings, self.hints = held, [], []

    def recorded(self):
        out, self.rings = self.rings, []
        return out

    def recorded_left(self):  # the ring read whether or not this process told them to record
        out, self.rings = self.rings, []
        return out

    def reset_hints(self):
        out, self.hints = self.hints, []
        return out

    def recorded_open(self):
        return list(self.held.items())

    def recorded_entry(self, key):
        return self.held.get(key)

    def take_recorded(self, key):
        return self.held.pop(key, None)

    def put_recorded(self, key, value):
        return self.held.setdefault(key, value) is value

    def records_remote(self):
        return self.remote

    remote = False


def test_status_says_whether_the_programs_record_remote_connections_not_what_was_asked():
    """/status flows.programs.remote: what the programs do -- the agent asks for other nodes'
    pods' connections too (host-gw), but without the wire program (its attach failed) the
    programs' config has no RECORD_REMOTE."""
    from agentd.flows.views import FlowViews

    r = recorder()
    r.record_remote = True
    r.recording = programs = Programs({})
    assert FlowViews(r, lambda: 0).status()["programs"]["remote"] is False
    programs.remote = True
    assert FlowViews(r, lambda: 0).status()["programs"]["remote"] is True


def test_a_recorded_start_and_end_are_records_like_conntracks():

    r = recorder()
    key, value = _conn(False, 2, 5_000_000_000, 5_250_000_000)
    r.tai_offset = lambda: 1_000_000_000
    r._on_recorded([CONN_RECORD.pack(key, REC_START, value), CONN_RECORD.pack(key, REC_FIN, value), b"short"], 1000.0)
    assert r.malformed == 1
    new, end = (f.json() for f in r.ring.last(FlowFilter(), 10))
    assert (new["event"], new["time"], new["verdict"], new["protocol"], new["direction"]) == ("new", 4.0, "forwarded", "TCP", "ingress")
    assert (new["src"]["pod"], new["src"]["port"], new["dst"]["pod"], new["dst"]["port"]) == ("shop/client", 40000, "shop/web", 80)
    assert (end["event"], end["time"], end["duration"]) == ("end", 4.25, 0.25)
    assert (end["packets_sent"], end["bytes_sent"], end["packets_received"], end["bytes_received"]) == (6, 1400, 5, 900)


def test_a_recorded_connection_whose_client_is_the_higher_end_is_turned_round():

    key, value = _conn(True, 2, 1, 2)
    j = recorded_flow("node2", CONN_RECORD.pack(key, REC_RST, value), CLIENT, WEB, 0, 1000.0).json()
    assert (j["src"]["ip"], j["src"]["port"], j["dst"]["ip"], j["dst"]["port"]) == ("10.244.2.3", 80, "10.244.1.2", 40000)
    assert (j["bytes_sent"], j["bytes_received"], j["direction"]) == (900, 1400, "egress")


def test_the_sweep_ends_a_reset_connection_once_its_end_stays_silent():
    """The programs keep a connection a RST passed (its TCP may have ignored it, out of window):
    the sweep ends it as reset once nothing but RST came from that end for RESET_TIMEOUT_NS
    (the end at its last packet); one reset a moment ago is left for the next look."""

    now = 1_000 * 10**9
    k_old, v_old = _conn(False, CONN_RESET_LO, 0, now - RESET_TIMEOUT_NS - 1)
    k_new, v_new = _conn(False, CONN_RESET_HI, 0, now - RESET_TIMEOUT_NS // 2)
    k_new = k_new[:8] + bytes([1, 1]) + k_new[10:]
    r = recorder()
    r.recording = Programs({k_old: v_old, k_new: v_new})
    r._held = lambda key: True  # conntrack holds both (it keeps a reset connection a while)
    assert [CONN_RECORD.unpack(x) for x in r.sweep(now)] == [(k_old, REC_RST, v_old)]
    assert r.recording.held == {k_new: v_new}


class Loop:
    """The event loop as the recorder's ring reading uses it: what it asked to be called later."""

    def __init__(self) -> None:
        self.later: list[tuple[float, object]] = []

    def call_later(self, delay, fn, *args):
        self.later.append((delay, fn))



_RST = 1_000 * 10**9  # the reset-hint tests' RST, in TAI ns


def _reset_entry(state: int, last: int = _RST):
    """A recorder whose programs hold one connection in reset ``state``, its last packet at
    ``last`` (its first 10 s before the RST): (recorder, programs, key, value)."""
    key, value = _conn(False, state, _RST - 10 * 10**9, last)
    r = recorder()
    r.recording = programs = Programs({key: value})
    return r, programs, key, value


def test_a_reset_hint_ends_the_connection_reset_timeout_after_its_last_packet(monkeypatch):
    """A RST passed (the programs' hint, read with their records every RECORDED_INTERVAL): the
    connection's end comes once RESET_TIMEOUT_NS passed since its last packet -- at the first
    read after that, not at the sweep (up to SWEEP_INTERVAL later) --, once: neither a later
    read nor the sweep ends it again."""
    from agentd.flows import recorder as rec_mod

    s, rst = 10**9, _RST
    r, programs, key, value = _reset_entry(CONN_RESET_LO)
    r.tai_offset = lambda: 0
    r._loop = loop = Loop()
    r._held = lambda key: True  # conntrack keeps a reset connection a while
    clock = [rst + s // 10]
    monkeypatch.setattr(rec_mod, "tai_now", lambda: clock[0], raising=False)
    programs.hints.append((key, rst))
    r._drain_recorded()  # the hint read 0.1 s after the RST
    assert len(r.ring) == 0 and programs.held == {key: value} and len(loop.later) == 1
    clock[0] = rst + RESET_TIMEOUT_NS - s // 10
    r._drain_recorded()  # 1.9 s: not yet
    assert len(r.ring) == 0 and programs.held == {key: value}
    clock[0] = rst + RESET_TIMEOUT_NS + s // 10
    r._drain_recorded()  # 2.1 s: ended, as reset, at its last packet
    ends = r.ring.last(FlowFilter(), 10)
    assert [(f.event, f.time, f.duration) for f in ends] == [("end", 1000.0, 10.0)] and programs.held == {}
    assert r.swept == 1
    for later in (3, 8):  # a later read, and the sweep, find nothing more to end
        clock[0] = rst + later * s
        r._drain_recorded()
        assert r.sweep(clock[0]) == []
    assert len(r.ring) == 1


def test_a_reset_hint_of_a_connection_open_again_ends_nothing():
    """The end that sent the RST sent again without it (its TCP ignored the RST: podconn_see
    sets the entry OPEN again): the hint's look ends nothing, and leaves nothing to look at."""

    s, rst = 10**9, _RST
    r, programs, key, value = _reset_entry(CONN_RESET_HI)
    r.note_resets([(key, rst)])
    v = list(CONN_VALUE.unpack(value))
    v[5], v[6] = rst + s // 2, CONN_OPEN  # a packet of that end half a second later
    programs.held[key] = CONN_VALUE.pack(*v)
    assert r.end_resets(rst + RESET_TIMEOUT_NS + s) == [] and list(programs.held) == [key]
    assert r._resets == [] and r._reset_due == {}


def test_a_reset_hint_after_a_rst_sent_again_ends_it_after_the_last_one():
    """RSTs sent again (one hint: the entry already RESET): the end comes RESET_TIMEOUT_NS after
    the last packet, not the first RST."""

    s, rst = 10**9, _RST
    r, programs, key, value = _reset_entry(CONN_RESET_LO, last=rst + s)  # its last RST a second after the first
    r.note_resets([(key, rst)])
    assert r.end_resets(rst + RESET_TIMEOUT_NS + s // 2) == [] and list(programs.held) == [key]
    assert r.end_resets(rst + s + RESET_TIMEOUT_NS + 1) == [CONN_RECORD.pack(key, REC_RST, value)]
    assert programs.held == {} and r._reset_due == {}


@pytest.mark.parametrize("between", ["look and take", "two looks"])
def test_a_reset_a_packet_changes_between_the_look_and_the_take_is_looked_at_again_not_left_to_the_sweep(between):
    """A packet passes between the hint's look and its take: the take finds the entry changed
    (put back), or the look just before the take does (left).  Still reset -- a RST sent again,
    or the other end's packet --: looked at again RESET_TIMEOUT_NS after that packet and ended
    then, as reset, with what its take finds -- not left to the sweep (up to SWEEP_INTERVAL
    later).  Open again (that end sent without RST): let go, nothing ended."""

    s, rst = 10**9, _RST
    looked = rst + RESET_TIMEOUT_NS + s // 10  # the hint's look, 2.1 s after the RST
    for state in (CONN_RESET_LO, CONN_RESET_HI, CONN_OPEN):
        r, programs, key, value = _reset_entry(CONN_RESET_LO)
        r._held = lambda key: True
        r.note_resets([(key, rst)])
        v = list(CONN_VALUE.unpack(value))
        v[0], v[2], v[5], v[6] = v[0] + 1, v[2] + 60, looked, state  # the packet: counted, its time the last
        changed = CONN_VALUE.pack(*v)
        look, take = programs.recorded_entry, programs.take_recorded
        looks: list[bytes] = []

        def packet_in_the_look(k, look=look, programs=programs, key=key, changed=changed, looks=looks):
            got = look(k)
            looks.append(got)
            if len(looks) == 1:  # right after the hint's look, before the take's
                programs.held[key] = changed
            return got

        def packet_in_the_take(k, take=take, programs=programs, key=key, changed=changed):
            programs.take_recorded = take
            programs.held[key] = changed  # as the take begins
            return take(k)

        if between == "two looks":
            programs.recorded_entry = packet_in_the_look
        else:
            programs.take_recorded = packet_in_the_take
        assert r.end_resets(looked) == [] and programs.held == {key: changed}, state
        programs.recorded_entry = look
        assert not any(r.not_put_back.values())  # put back, not ended
        if state == CONN_OPEN:
            assert r._resets == [] and r._reset_due == {}
            assert r.end_resets(looked + RESET_TIMEOUT_NS + s) == [] and programs.held == {key: changed}
            continue
        assert r.end_resets(looked + RESET_TIMEOUT_NS) == [] and programs.held == {key: changed}  # not yet
        # Ended RESET_TIMEOUT_NS after that packet, at the next read -- not at the sweep.
        assert r.end_resets(looked + RESET_TIMEOUT_NS + 1) == [CONN_RECORD.pack(key, REC_RST, changed)], state
        assert programs.held == {} and r._reset_due == {} and r.swept == 1
        assert r.sweep(looked + 10 * s) == []


def test_a_reset_the_sweep_ended_first_is_not_ended_again_by_its_hint():
    """The sweep and the hint's look judge the same entry (the sweep runs in a thread): whoever
    takes it out ends it -- the sweep first, the look finds it gone; the sweep taking it between
    the look and its take, the look's take finds nothing."""

    s, rst = 10**9, _RST
    r, programs, key, value = _reset_entry(CONN_RESET_LO)
    r._held = lambda key: True
    r.note_resets([(key, rst)])
    assert r.sweep(rst + RESET_TIMEOUT_NS + s) == [CONN_RECORD.pack(key, REC_RST, value)]
    assert r.end_resets(rst + RESET_TIMEOUT_NS + s) == [] and r.swept == 1
    # Taken by the sweep between the look and the take.
    programs.held[key] = value
    r.note_resets([(key, rst)])
    take, swept = programs.take_recorded, []

    def sweep_first(k):
        if not swept:
            programs.take_recorded = take
            swept.extend(r.sweep(rst + RESET_TIMEOUT_NS + s))
        return take(k)

    programs.take_recorded = sweep_first
    assert r.end_resets(rst + RESET_TIMEOUT_NS + s) == [] and programs.held == {}
    assert swept == [CONN_RECORD.pack(key, REC_RST, value)] and r.swept == 2


def test_the_sweep_ends_what_ended_silently_and_drops_unanswered_syns():

    now = 1_000 * 10**9
    k_syn, v_syn = _conn(False, 1, 0, now - SYN_TIMEOUT_NS - 1)
    k_closing, v_closing = _conn(False, 3, 0, now - 3 * 10**9)
    k_idle, v_idle = _conn(False, 2, 0, now - 60 * 10**9)
    k_busy, v_busy = _conn(False, 2, 0, now - 10**9)
    keys = [k[:8] + bytes([i, i]) + k[10:] for i, k in enumerate((k_syn, k_closing, k_idle, k_busy))]
    r = recorder()
    r.recording = programs = Programs(dict(zip(keys, (v_syn, v_closing, v_idle, v_busy))))
    held = []
    r._held = lambda key: held.append(key) or False  # conntrack no longer holds it
    ended = [CONN_RECORD.unpack(x)[:2] for x in r.sweep(now)]
    assert ended == [(keys[1], REC_FIN), (keys[2], REC_GONE)] and held == [keys[2]]
    assert list(programs.held) == [keys[3]] and r.swept == 2  # the SYN went without a record


def test_since_finds_what_came_after_a_start_whose_syn_was_retransmitted():
    """A recorded start keeps its first SYN's time, which may be long before its answer let it
    be recorded: ``since`` must not stop at it (the ring is in the order records came)."""

    s = 10**9
    r = recorder()
    r.tai_offset = lambda: 0

    def rec(kind, port, first, last):
        key = socket.inet_aton("10.244.1.2") + socket.inet_aton("10.244.2.3") + port.to_bytes(2, "big") + (80).to_bytes(2, "big")
        return CONN_RECORD.pack(key, kind, CONN_VALUE.pack(1, 1, 60, 60, first, last, 2, 0, 0))

    r._on_recorded([rec(REC_START, 40001, 1000 * s, 1000 * s)], 1000.0)
    r._on_recorded([rec(REC_START, 40002, 940 * s, 1001 * s)], 1001.0)  # SYN at 940, answered at 1001
    r._on_recorded([rec(REC_REUSED, 40004, 900 * s, 910 * s)], 1001.5)  # its last packet at 910
    r._on_recorded([rec(REC_START, 40003, 1002 * s, 1002 * s)], 1002.0)
    got = [(f.time, f.src.port) for f in r.ring.last(FlowFilter(), 10, since=995.0)]
    assert got == [(1000.0, 40001), (1002.0, 40003)]  # the late start keeps its SYN's time
    assert [f.time for f in r.ring.last(FlowFilter(), 10)] == [1000.0, 940.0, 910.0, 1002.0]
    # What came well before ``since`` still ends the search.
    ring = FlowRing(10)
    for when in (1.0, 2.0, 50.0, 51.0):
        f = flow()
        f.time = when
        ring.add(f)
    search = ring.search(FlowFilter(), 10, since=50.0)
    assert search.step(3) and [f.time for f in search.result()] == [50.0, 51.0] and search.index == 1


def test_the_sweep_takes_only_the_entries_it_judged():
    """A tuple reused between the sweep's look and its take: the program ended the old
    connection itself (REUSED) and made the new SYN's entry, which the sweep puts back rather
    than end as the old one; an unanswered SYN answered meanwhile stays too."""

    now = 1_000 * 10**9
    key, old = _conn(False, 2, 0, now - 60 * 10**9)  # open, idle 60 s
    fresh = CONN_VALUE.pack(1, 0, 60, 0, now, now, 1, 0, 0)
    r = recorder()
    r.recording = programs = Programs({key: old})

    def held(k):  # meanwhile the client opens a new connection on the same tuple
        programs.rings.append(CONN_RECORD.pack(k, REC_REUSED, programs.held[k]))
        programs.held[k] = fresh
        return False

    r._held = held
    assert r.sweep(now) == [] and r.swept == 0
    assert programs.held == {key: fresh}  # the new connection's, for the programs to record
    # An unanswered SYN, answered between the look and the take: not dropped.
    syn_key, syn = _conn(False, 1, now - SYN_TIMEOUT_NS - 2, now - SYN_TIMEOUT_NS - 1)
    answered = CONN_VALUE.pack(*CONN_VALUE.unpack(syn)[:5], now, 2, 0, 0)
    programs.held = {syn_key: syn}
    take = programs.take_recorded

    def answer_first(k):
        programs.held[k] = answered
        return take(k)

    programs.take_recorded = answer_first
    assert r.sweep(now) == [] and programs.held == {syn_key: answered}


def test_the_sweep_asks_conntrack_about_an_idle_connection_once_a_minute():

    s = 10**9
    now = 1_000 * s
    key, idle = _conn(False, 2, 5, now - 60 * s)
    other = key[:8] + bytes([1, 1]) + key[10:]
    r = recorder()
    r.recording = programs = Programs({key: idle, other: idle})
    asked, holds = [], {key, other}
    r._held = lambda k: asked.append(k) or k in holds
    step = int(SWEEP_INTERVAL * s)
    for i in range(HELD_RECHECK_NS // step):  # a minute of sweeps: each asked once
        assert r.sweep(now + i * step) == []
    assert sorted(asked) == sorted([key, other])
    del programs.held[other]  # ended by the programs: forgotten here too
    holds.discard(key)  # conntrack let it go: found at the next question
    assert r.sweep(now + HELD_RECHECK_NS - 1) == [] and list(r._held_at) == [key]
    (end,) = r.sweep(now + HELD_RECHECK_NS)
    assert CONN_RECORD.unpack(end)[:2] == (key, REC_GONE) and asked[2:] == [key] and r._held_at == {}
    # The tuple's next connection (another SYN) is asked about as a new one.
    _k, again = _conn(False, 2, 7, now)
    programs.held[key], holds = again, {key}
    r.sweep(now + HELD_RECHECK_NS + 11 * s)
    programs.held[key] = CONN_VALUE.pack(*CONN_VALUE.unpack(again)[:4], 9, *CONN_VALUE.unpack(again)[5:])
    r.sweep(now + HELD_RECHECK_NS + 12 * s)
    assert asked[3:] == [key, key]



class Told:
    """The pod programs as the recorder tells them (set_recording) and the mask table, in one
    list of what was done, in order."""

    def __init__(self) -> None:
        self.done: list[str] = []
        self.recording = False

    def set_recording(self, on, remote=False):
        self.recording = on
        self.done.append(f"record {on}")

    def install(self):
        self.done.append("mask")

    def remove(self):
        self.done.append("unmask")


def test_a_recorder_that_cannot_open_leaves_the_programs_not_recording(monkeypatch):
    """The NFLOG group is bound by someone else (EBUSY) after the programs were told to record:
    they are told to stop, then the mask goes -- /status says flows are off, and so they are."""
    import errno

    from agentd.flows import recorder as rec_mod

    class Sock(_QuietSock):
        busy = True  # the NFLOG group

        def request(self, _msg, what="", dump=False):
            if what.startswith("binding NFLOG") and self.busy:
                raise nl.NetlinkError(errno.EBUSY, what=what)

        def close(self):
            pass

    monkeypatch.setattr(rec_mod, "NetlinkSocket", Sock)
    monkeypatch.setattr(rec_mod, "enable_sysctls", lambda _d: None)
    told = Told()
    r = FlowRecorder("node2", Directory(), "/nonexistent", group=143, pods=[ip_network("10.244.0.0/16")],
                     carried=told, mask=told)
    with pytest.raises(OSError, match="NFLOG group 143 is bound by another process"):
        r.open()
    assert told.done == ["mask", "record True", "record False", "unmask"] and not told.recording
    assert r.recording is None and r.ct_sock is None and r.log_sock is None
    # Connections off: programs an earlier agent told to record are told to stop, then unmasked.
    monkeypatch.setattr(rec_mod, "restore_sysctls", lambda _d: [])
    Sock.busy = False
    told = Told()
    told.recording = True
    off = FlowRecorder("node2", Directory(), "/nonexistent", group=143, carried=told, mask=told, connections=False)
    off.open()
    assert told.done == ["record False", "unmask"] and off.log_sock is not None


def test_the_programs_record_as_an_earlier_agent_told_them_until_the_recorder_says():
    from agentd.dataplane.bpf.podpath import (
        CFG_COUNT,
        CFG_ON,
        CFG_RECORD,
        CFG_RECORD_REMOTE,
        CFG_ROUTE,
        config_flags,
    )

    earlier = CFG_ON | CFG_ROUTE | CFG_COUNT | CFG_RECORD | CFG_RECORD_REMOTE
    assert config_flags(earlier, route=True, counting=False, recording=None) == earlier
    assert config_flags(earlier, route=False, counting=False, recording=None) == CFG_ON | CFG_COUNT | CFG_RECORD
    assert config_flags(CFG_ON | CFG_COUNT, route=True, counting=True, recording=None) == CFG_ON | CFG_ROUTE | CFG_COUNT
    assert config_flags(0, route=False, counting=False, recording=None) == CFG_ON  # a new map
    assert config_flags(earlier, route=True, counting=True, recording=(False, False)) == CFG_ON | CFG_ROUTE | CFG_COUNT
    assert config_flags(0, route=True, counting=False, recording=(True, True)) == earlier


def test_flow_mask_is_a_nat_chain_asked_once_per_connection():
    """The mask of recorded connections' events is a nat chain after source NAT: the kernel
    asks nat chains only for a connection's first packet (a filter chain would run for every
    forwarded packet), and one whose source a chain before it translated never reaches it."""
    from agentd.nft import flowmask

    cmds = flowmask.commands()
    chains = [c["add"]["chain"] for c in cmds if "chain" in c.get("add", {})]
    assert [(c["type"], c["hook"], c["prio"]) for c in chains] == [("nat", "postrouting", 101)]
    (rule,) = [c["add"]["rule"]["expr"] for c in cmds if "rule" in c.get("add", {})]
    assert rule[0]["match"]["left"] == {"&": [{"meta": {"key": "mark"}}, flowmask.MARK]}  # the cheapest test first
    assert rule[-2] == {"mangle": {"key": {"ct": {"key": "event"}}, "value": 0}}
    # ... and marks the entry it masked, which the answer's program reads (podconn_plain): a
    # connection conntrack held before its marked SYN kept its events and stays conntrack's.
    assert rule[-1] == {"mangle": {"key": {"ct": {"key": "mark"}},
                                   "value": {"|": [{"ct": {"key": "mark"}}, flowmask.CTMARK]}}}


def test_a_mask_table_an_earlier_run_left_is_renewed_or_else_removed_before_the_programs_load():
    """An upgrade: the earlier agent's programs may still record, beside its table, whose rule
    may mask without marking.  The agent remakes the table before its programs load; where it
    cannot (no conntrack marks in the kernel), it removes it -- an old rule beside programs
    that need the mark would leave connections recorded by nobody, no rule leaves them to
    conntrack's events until the recorder opens.  No table, nothing made nor removed."""
    from agentd.daemon.agent import renew_flow_mask
    from agentd.nft.libnftables import NftError

    class Mask:
        def __init__(self, there: bool, fails: bool) -> None:
            self.there, self.fails, self.done = there, fails, []

        def renew(self) -> bool:
            self.done.append("renew")
            if self.fails:
                raise NftError("Error: Could not process rule: Operation not supported")
            return self.there

        def remove_quietly(self) -> None:
            self.done.append("remove")

    for there, fails, done in ((True, False, ["renew"]), (False, False, ["renew"]), (True, True, ["renew", "remove"])):
        mask = Mask(there, fails)
        renew_flow_mask(mask)
        assert mask.done == done, (there, fails)


def _logged(r: FlowRecorder, msg: bytes) -> None:
    for mtype, _f, _s, _p, start, end in nl.iter_messages(msg):
        r._on_log(mtype, msg, start, end)


def test_since_goes_past_a_drop_or_a_conntrack_event_read_late():
    """A drop the kernel logged a while before a busy agent read it, and a conntrack event read
    the long way, are in the ring after what was taken in before them: ``since`` goes by when
    they were taken in, not by their kernel time, and does not stop at them."""

    s = 10**9
    now = [1005.0]
    r = FlowRecorder("node2", Directory(), "/nonexistent", group=143, clock=lambda: now[0])
    r.tai_offset = lambda: 0
    key = socket.inet_aton("10.244.1.2") + socket.inet_aton("10.244.2.3") + (40001).to_bytes(2, "big") + (80).to_bytes(2, "big")
    r._on_recorded([CONN_RECORD.pack(key, REC_START, CONN_VALUE.pack(1, 1, 60, 60, 1004_900_000_000, 1005 * s, 2, 0, 0))],
                   1005.0)
    now[0] = 1005.5
    _logged(r, logged_packet("pod-in/shop/web", "10.244.1.2", "10.244.2.3", 6, 40002, 80, when=(1001, 0)))
    got = r.ring.last(FlowFilter(), 10, since=1004.0)
    assert [(f.event, f.src.port) for f in got] == [("new", 40001)]
    assert list(r.ring)[-1].received == 1005.5
    msg = destroy_event()  # stopped at 1000.25
    for mtype, _f, _s, _p, start, end in nl.iter_messages(msg):
        r._on_conntrack(mtype, msg, start, end)
    got = r.ring.last(FlowFilter(), 10, since=1004.0)
    assert [(f.event, f.src.port) for f in got] == [("new", 40001)]
    assert list(r.ring)[-1].received == 1005.5 and list(r.ring)[-1].time == 1000.25


def test_the_sweep_never_takes_a_reused_tuples_new_syn_out_of_the_map():
    """The tuple of an idle connection reused while the sweep asks conntrack about it: the new
    SYN's entry is looked at, not taken out (its answer, coming while it was out, would find
    none: the connection, its conntrack events masked at its SYN, recorded by nobody)."""

    now = 1_000 * 10**9
    key, old = _conn(False, 2, 0, now - 60 * 10**9)
    fresh = CONN_VALUE.pack(1, 0, 60, 0, now, now, 1, 0, 0)
    r = recorder()
    r.recording = programs = Programs({key: old})
    took = []
    take = programs.take_recorded
    programs.take_recorded = lambda k: took.append(k) or take(k)

    def held(k):
        programs.rings.append(CONN_RECORD.pack(k, REC_REUSED, programs.held[k]))
        programs.held[k] = fresh
        return False

    r._held = held
    assert r.sweep(now) == [] and took == [] and programs.held == {key: fresh}


def test_a_taken_connection_that_cannot_go_back_is_ended_not_lost():
    """Between the sweep's look and its take the tuple's connection changed; putting it back
    fails: the map is full (E2BIG: the programs took the freed slot), or the programs made a
    new SYN's entry since.  One past its SYN is ended (GONE, REUSED), an unanswered SYN counted
    as lost -- none vanishes silently."""
    import errno


    now = 1_000 * 10**9
    key, old = _conn(False, 2, 0, now - 60 * 10**9)  # idle, conntrack no longer holds it
    newer = CONN_VALUE.pack(3, 2, 180, 120, now - 5 * 10**9, now - 10**8, 2, 0, 0)  # reused, answered
    syn = CONN_VALUE.pack(1, 0, 60, 0, now - 10**8, now - 10**8, 1, 0, 0)  # reused, unanswered yet

    def sweep_with(meanwhile: bytes, put) -> tuple[list[tuple[bytes, int, bytes]], FlowRecorder]:
        r = recorder()
        r.recording = programs = Programs({key: old})
        take = programs.take_recorded

        def reused_first(k):  # the tuple reused between the look and the take
            programs.held[k] = meanwhile
            return take(k)

        programs.take_recorded = reused_first
        programs.put_recorded = put
        r._held = lambda k: False
        return [CONN_RECORD.unpack(x) for x in r.sweep(now)], r

    def full(k, v):
        raise OSError(errno.E2BIG, "agentd_podconns is full")

    ended, r = sweep_with(newer, full)
    assert ended == [(key, REC_GONE, newer)] and r.not_put_back == {"ended": 1} and r.swept == 0
    ended, r = sweep_with(syn, full)
    assert ended == [] and r.not_put_back == {"lost": 1}
    ended, r = sweep_with(newer, lambda k, v: False)  # a new SYN's entry since: it stays
    assert ended == [(key, REC_REUSED, newer)] and r.not_put_back == {"ended": 1}
    from agentd.flows.views import FlowViews

    assert FlowViews(r, lambda: 0).status()["programs"]["not_put_back"] == {"ended": 1, "lost": 0}


def test_a_sweep_that_fails_at_one_key_returns_what_it_took():
    """A conntrack look-up failing (not ENOENT) or a map operation failing at one key skips that
    key: the ends of those taken out of the map before and after it are returned, not lost."""
    import errno


    now = 1_000 * 10**9
    key, idle = _conn(False, 2, 0, now - 60 * 10**9)
    keys = [key[:8] + bytes([i, i]) + key[10:] for i in range(4)]
    r = recorder()
    r.recording = programs = Programs(dict.fromkeys(keys, idle))

    def held(k):
        if k == keys[1]:
            raise nl.NetlinkError(errno.EPERM, what="looking up a conntrack entry")
        return False

    r._held = held
    take = programs.take_recorded

    def take_failing(k):
        if k == keys[2]:
            raise OSError(errno.EINVAL, "map lookup and delete")
        return take(k)

    programs.take_recorded = take_failing
    ended = [CONN_RECORD.unpack(x)[:2] for x in r.sweep(now)]
    assert ended == [(keys[0], REC_GONE), (keys[3], REC_GONE)] and r.swept == 2
    assert sorted(programs.held) == sorted([keys[1], keys[2]])  # left for the next sweep


class _QuietSock:
    """A netlink socket that takes every request (the recorder's open, without a kernel)."""

    def __init__(self, **_kw):
        self.sock = self

    def attach_filter(self, _f):
        pass

    def setsockopt(self, *_a):
        pass

    def request(self, _msg, what="", dump=False):
        pass

    def close(self):
        pass


class Unconfigurable(Told):
    """Programs whose config cannot be written: conntrack's settings unreadable (BpfUnavailable,
    a RuntimeError, from podpath's _configure)."""

    def set_recording(self, on, remote=False):
        from agentd.dataplane.bpf.datapath import BpfUnavailable

        self.done.append(f"record {on}")
        raise BpfUnavailable("conntrack settings: [Errno 13] Permission denied")


def test_a_recorder_whose_programs_cannot_be_told_opens_without_them(monkeypatch, caplog):
    """BpfUnavailable from telling the programs (to record, or to stop) is one line: the
    recorder opens with conntrack's events telling of every connection (connections on), or
    drops only (off) -- it does not abort the agent's start."""
    from agentd.flows import recorder as rec_mod

    monkeypatch.setattr(rec_mod, "NetlinkSocket", _QuietSock)
    monkeypatch.setattr(rec_mod, "enable_sysctls", lambda _d: None)
    monkeypatch.setattr(rec_mod, "restore_sysctls", lambda _d: [])
    told = Unconfigurable()
    r = FlowRecorder("node2", Directory(), "/nonexistent", group=143, carried=told, mask=told)
    r.open()
    assert r.recording is None and r.ct_sock is not None and r.log_sock is not None
    assert told.done == ["mask", "record True", "record False", "unmask"]
    assert "the pod programs may go on recording connections: conntrack settings" in caplog.text
    told = Unconfigurable()
    off = FlowRecorder("node2", Directory(), "/nonexistent", group=143, carried=told, mask=told, connections=False)
    off.open()
    assert off.log_sock is not None and told.done == ["record False", "unmask"]


def test_what_the_programs_recorded_is_ended_when_the_recorder_cannot_have_them_record(monkeypatch):
    """The pinned podconns and podrecs outlive the agent: an earlier agent's programs recorded
    a connection (its conntrack entry's events masked at its SYN: conntrack never tells its
    end) and an end nobody read.  This recorder cannot turn recording on (the mask table
    refused): the programs are told to stop -- which drops both -- yet the connection still
    gets its end, from the sweep, when conntrack no longer holds it; the end in the ring is
    taken in when the recorder runs; nothing new is recorded, and the sweep stops once every
    one is ended."""
    from agentd.flows import recorder as rec_mod
    from agentd.flows.recorder import IDLE_NS, REC_GONE_UNCOUNTED

    pipe = os.pipe()

    class Sock(_QuietSock):
        def fileno(self):
            return pipe[0]

    class Dropping(Programs):
        """podpath's PodFastPath as the recorder tells it: told to stop, it drops what it holds."""

        def __init__(self, held):
            super().__init__(held)
            self.told = []

        def set_recording(self, on, remote=False):
            self.told.append(on)
            if not on:
                self.held.clear()
                self.rings = []

        def recorded(self):  # as PodFastPath: its ring is read only once it was told to record here
            return super().recorded() if True in self.told else []

    class Refusing:
        def install(self):
            raise RuntimeError("nft: table agentd-flows: Operation not permitted")

        def remove(self):
            pass

    monkeypatch.setattr(rec_mod, "NetlinkSocket", Sock)
    monkeypatch.setattr(rec_mod, "enable_sysctls", lambda _d: None)
    s = 10**9
    key, value = _conn(False, CONN_OPEN, 900 * s, 950 * s)
    other = socket.inet_aton("10.244.1.2") + socket.inet_aton("10.244.2.3") + (40001).to_bytes(2, "big") + (80).to_bytes(2, "big")
    programs = Dropping({key: value})
    programs.rings = [CONN_RECORD.pack(other, REC_FIN, _conn(False, 3, 800 * s, 850 * s)[1])]
    r = FlowRecorder("node2", Directory(), "/nonexistent", group=143, carried=programs, mask=Refusing(),
                     clock=lambda: 1000.0)
    r.tai_offset = lambda: 0
    try:
        r.open()
        assert r.recording is None and programs.told == [False] and not programs.held  # nothing new recorded
        held = [True]
        r._held = lambda k: held[0]  # type: ignore[method-assign]
        assert r.sweep(950 * s + IDLE_NS + 1) == []  # idle, but conntrack holds it: still open
        held[0] = False
        (end,) = r.sweep(950 * s + IDLE_NS + HELD_RECHECK_NS + 1)
        assert CONN_RECORD.unpack(end)[:2] == (key, REC_GONE_UNCOUNTED) and r.swept == 1  # held on: counts unknown
        assert r.sweep(950 * s + IDLE_NS + HELD_RECHECK_NS + 2) == []  # ended once

        async def run() -> None:
            task = asyncio.ensure_future(r.run())
            for _ in range(3):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(r._sweep_loop(), 1)  # every one ended: the sweep is over

        asyncio.run(run())
        assert [(f.event, f.src.port) for f in r.ring] == [("end", 40001)] and r.leftovers is None
    finally:
        os.close(pipe[0])
        os.close(pipe[1])


def test_what_the_programs_ring_holds_is_kept_though_this_process_never_had_them_record(monkeypatch, tmp_path):
    """podpath's PodFastPath as an agent's start leaves it (its ring not opened: only
    set_recording(True) opens it) holds starts and ends an earlier agent's programs wrote, and
    ends an open handed over (replaced_ends): the recorder that cannot have the programs
    record keeps both (the ring opened for that read) before they are told to stop, which
    drops them."""
    from agentd.dataplane.bpf import podpath

    s = 10**9
    key, value = _conn(False, CONN_OPEN, 900 * s, 950 * s)
    ring = [CONN_RECORD.pack(key, REC_START, value), CONN_RECORD.pack(key, REC_FIN, value)]
    handed = CONN_RECORD.pack(key, REC_GONE, value)
    opened = []

    class Ring:
        def __init__(self, fd):
            opened.append(fd)
            self.closed = False

        def drain(self):
            out = list(ring)
            ring.clear()
            return out

        def close(self):
            self.closed = True

    monkeypatch.setattr(podpath.lb, "RingBuffer", Ring)
    fp = podpath.PodFastPath(tmp_path / "bpf")
    fp.maps = {podpath.RECS: 7}
    fp.replaced_ends = [handed]
    assert fp.recs is None
    r = FlowRecorder("node2", Directory(), "/nonexistent", group=143, carried=fp)
    r._keep_leftovers(fp)
    assert r._leftover_records == [CONN_RECORD.pack(key, REC_START, value), CONN_RECORD.pack(key, REC_FIN, value), handed]
    assert opened == [7] and fp.recs is None and fp.replaced_ends == []


def test_a_leftover_connection_conntrack_held_on_ends_with_its_size_and_length_unknown():
    """A connection the programs held when told not to record is as it was then: nothing counts
    it since.  One conntrack still held at a look (a DB pool, a watch stream: it may carry
    traffic for an hour) ends, once gone, with its bytes, packets and duration unknown -- not
    those of when recording stopped; one found gone at the first look keeps them."""
    from agentd.flows.recorder import IDLE_NS, Leftovers

    s = 10**9
    r = recorder()
    r.tai_offset = lambda: 0
    key, value = _conn(False, CONN_OPEN, 900 * s, 950 * s)
    other = socket.inet_aton("10.244.1.2") + socket.inet_aton("10.244.2.3") + (40001).to_bytes(2, "big") + (80).to_bytes(2, "big")
    r.leftovers = Leftovers()
    r.leftovers.held.update({key: value, other: value})
    held = {key: True, other: False}
    r._held = lambda k: held[k]  # type: ignore[method-assign]
    (first,) = r.sweep(950 * s + IDLE_NS + 1)  # ``other``: gone at the first look
    assert CONN_RECORD.unpack(first)[0] == other
    assert r.sweep(4000 * s) == []  # ``key``: held an hour on
    held[key] = False
    (last,) = r.sweep(4000 * s + HELD_RECHECK_NS + 1)
    assert CONN_RECORD.unpack(last)[0] == key and r.leftovers.held == {}
    r._on_recorded([first, last], 4061.0)
    gone, later = (f.json() for f in r.ring)
    assert (gone["bytes_sent"], gone["packets_received"], gone["duration"]) == (1400, 5, 50.0)
    assert (later["event"], later["time"], later["src"]["port"]) == ("end", 4061.0, 40000)
    assert (later["bytes_sent"], later["bytes_received"], later["packets_sent"], later["packets_received"],
            later["duration"]) == (None, None, None, None, None)


def _observability(monkeypatch, tmp_path, **env):
    from agentd.config.settings import load_config
    from agentd.daemon import observe

    class Host:
        def hostname(self):
            return "node2"

        def default_address(self):
            return IPv4Address("192.0.2.10")

        def default_address_v6(self, beside=None):
            return None

    cfg = load_config(env={"AGENTD_AGENT_STATE_DIR": str(tmp_path), **env}, host=Host())
    monkeypatch.setattr(observe, "restore_sysctls", lambda _d: [])
    monkeypatch.setattr(observe, "remove_quietly", lambda: None)
    return observe, observe.Observability(cfg, "node2", dict)


class FastPath(Told):
    """The pod fast path as the agent holds it: counting per connection (set_counting), told
    to record (set_recording)."""

    def __init__(self, fail_recording=False) -> None:
        super().__init__()
        self.fail_recording = fail_recording
        self.counting = True  # the agent turned it on before the recorder opened

    def set_counting(self, on):
        self.counting = on
        self.done.append(f"count {on}")

    def set_recording(self, on, remote=False):
        super().set_recording(on, remote)
        if self.fail_recording:
            from agentd.dataplane.bpf.datapath import BpfUnavailable

            raise BpfUnavailable("conntrack settings: [Errno 13] Permission denied")

    def carried_restarts(self):
        return []

    def take_carried(self, key):
        return None


def test_a_recorder_that_fails_to_open_leaves_the_fast_path_not_counting(monkeypatch, tmp_path):
    """Flow records off because the recorder cannot open (OSError, or a RuntimeError such as
    BpfUnavailable): the fast path's per-connection counts, turned on for it, are turned off --
    nobody would read them -- and the agent's start goes on."""
    from prometheus_client import CollectorRegistry

    from agentd.dataplane.bpf.datapath import BpfUnavailable

    for err in (OSError(16, "NFLOG group 143 is bound by another process"), BpfUnavailable("conntrack settings: no")):
        observe, obs = _observability(monkeypatch, tmp_path)

        def fail(self, err=err):
            raise err

        monkeypatch.setattr(observe.FlowRecorder, "open", fail)
        fast = FastPath()
        asyncio.run(obs.open_flows(None, None, CollectorRegistry(), carried=fast))
        assert obs.recorder is None and obs.error == f"flow records off: {err}"
        assert fast.done == ["count False"] and not fast.counting


def test_flows_off_with_programs_that_cannot_be_told_is_one_line(monkeypatch, tmp_path, caplog):
    from prometheus_client import CollectorRegistry

    _observe, obs = _observability(monkeypatch, tmp_path, AGENTD_FLOWS_ENABLED="false")
    fast = FastPath(fail_recording=True)
    asyncio.run(obs.open_flows(None, None, CollectorRegistry(), carried=fast))
    assert fast.done == ["record False"] and obs.recorder is None
    assert "the pod programs may go on recording connections: conntrack settings" in caplog.text


# ------------------------------------------------------------------ the programs' records in batches


def _records(ports, kind=None):

    out = []
    for port in ports:
        key, value = _conn(False, 2, 5_000_000_000, 5_250_000_000)
        out.append(CONN_RECORD.pack(key[:8] + port.to_bytes(2, "big") + key[10:], REC_START if kind is None else kind, value))
    return out


def test_a_batch_of_recorded_starts_is_numbered_and_read_like_single_records():
    from agentd.flows.ring import Batch

    r = recorder()
    r.ring = FlowRing(5, r._count)
    r.ring.on_batch = r._count_batch
    r.ring.add(flow(port=1))  # number 1
    r._on_recorded(_records([40001, 40002, 40003]), 1000.0)  # numbers 2-4
    assert sum(isinstance(e, Batch) for e in r.ring.records) == 3 and len({id(e) for e in r.ring.records}) == 2
    r._on_recorded(_records([40004, 40005, 40006]), 1001.0)  # 5-7: the ring (5) wraps, 1 and 2 are gone
    assert r.ring.seq == 7 and len(r.ring) == 5 and r.flows["forwarded"] == 7 and r.events == 6
    got = r.ring.last(FlowFilter(), 10)
    assert [f.seq for f in got] == [3, 4, 5, 6, 7]
    assert [f.src.port for f in got] == [40002, 40003, 40004, 40005, 40006]
    assert [f.received for f in got] == [1000.0, 1000.0, 1001.0, 1001.0, 1001.0]
    assert got[0].src.identity == CLIENT and got[0].dst.identity == WEB  # named when they came
    assert [f.src.port for f in r.ring.last(FlowFilter.parse([("port", "40005")]), 10)] == [40005]
    assert r.ring.last(FlowFilter(), 10)[0] is got[0]  # made once
    assert [f.seq for f in r.ring] == [3, 4, 5, 6, 7]  # the slots' own numbers
    assert all(type(e) is Flow for e in r.ring.records)  # and each slot now holds its record


def test_a_batch_followed_is_made_at_once_and_counted_once():
    r = recorder()
    follower = r.ring.follow(FlowFilter())
    r._on_recorded(_records([40001, 40002]) + [b"short"], 1000.0)
    assert r.malformed == 1 and r.flows["forwarded"] == 2 and follower.queue.qsize() == 2
    assert [follower.queue.get_nowait().seq for _ in range(2)] == [1, 2]
    assert all(type(e) is Flow for e in r.ring.records)


def test_a_batch_larger_than_the_ring_keeps_its_last_records():
    r = recorder()
    r.ring = FlowRing(3, r._count)
    r.ring.on_batch = r._count_batch
    r._on_recorded(_records(range(40001, 40006)), 1000.0)
    assert [f.src.port for f in r.ring.last(FlowFilter(), 10)] == [40003, 40004, 40005]
    assert r.ring.seq == 5 and r.flows["forwarded"] == 5


def test_the_programs_ring_read_as_one_object_in_c_and_in_python():
    """agentd/kernel/_ctevents.c's ring_take_fixed (fed through its record function, as libbpf
    calls it) gives what libbpf.fixed_records gives: the records of the size asked, side by
    side; the others counted; the keys' addresses once each."""
    import ctypes

    from agentd.dataplane.bpf.libbpf import fixed_records
    from agentd.kernel import _ctevents

    size = CONN_RECORD.size

    records = _records([40001, 40002]) + [b"x" * 10] + _records([40003])
    records.append(bytes(range(size)))  # other addresses
    sample = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)(
        ctypes.cast(ctypes.CDLL(_ctevents.__file__).agentd_ring_sample, ctypes.c_void_p).value)
    sink = _ctevents.ring_sink()
    try:
        for rec in records:
            assert sample(sink, rec, len(rec)) == 0
        got = _ctevents.ring_take_fixed(sink, size)
        assert _ctevents.ring_take_fixed(sink, size) == (b"", 0, 0, set())  # emptied
    finally:
        _ctevents.ring_sink_free(sink)
    want = fixed_records(records, size)
    assert got == want
    blob, count, others, addresses = got
    assert count == 4 and others == 1 and blob[size * 3 :] == bytes(range(size))
    assert addresses == {socket.inet_aton("10.244.1.2"), socket.inet_aton("10.244.2.3"), bytes(range(4)), bytes(range(4, 8))}


def test_a_search_keeps_what_it_made_in_the_ring_and_nothing_the_ring_dropped():
    """A record made from a batch by a search goes into its slot, where the batch was, so a
    batch holds nothing made (a made record the ring has dropped is not kept alive by a batch
    still in other slots); a slot the ring has given to a newer record meanwhile keeps that."""
    from agentd.flows.ring import Batch

    r = recorder()
    r.ring = FlowRing(10, r._count)
    r.ring.on_batch = r._count_batch
    r._on_recorded(_records(range(40001, 40010)), 1000.0)  # numbers 1-9
    search = r.ring.search(FlowFilter(), 100)  # over a copy of 1-9
    r._on_recorded(_records(range(40010, 40019)), 1001.0)  # 10-18: the free slot and those of 1-8
    assert search.step(100)
    assert [f.src.port for f in search.result()] == list(range(40001, 40010))  # the copy's
    entries = r.ring.records  # 9-18
    assert r.ring.seq == 18 and type(entries[0]) is Flow and entries[0].seq == 9 and entries[0].src.port == 40009
    assert all(isinstance(e, Batch) for e in entries[1:])  # made records of 1-8 were not put over 11-18
    assert not hasattr(entries[1], "_made")
    got = r.ring.last(FlowFilter(), 100)
    assert [f.seq for f in got] == list(range(9, 19)) and [f.src.port for f in got] == list(range(40009, 40019))
    assert all(type(e) is Flow for e in r.ring.records)


def test_a_node_port_is_named_on_either_of_the_nodes_addresses():
    """A node port is reached on any of the node's addresses, IPv6 too (the services compiler:
    fib daddr type local): the directory names the Service on [node] address and address_v6;
    an IPv6-only node (no IPv4 address) names it on its IPv6 one."""
    from types import SimpleNamespace as NS

    from agentd.daemon.flow_directory import FlowDirectory

    ports = [NS(namespace="shop", service="web", protocol="TCP", port=80, cluster_ip="10.96.0.10", node_port=30080),
             NS(namespace="shop", service="web", protocol="TCP", port=80, cluster_ip="fd00:96::10", node_port=30080)]
    services = NS(syncs=1, ports=ports, compiled_ports=ports)
    dual = FlowDirectory(None, services, (IPv4Address("192.168.1.10"), IPv6Address("fd00::10")))
    assert dual.service("192.168.1.10", 6, 30080) == "shop/web"
    assert dual.service("fd00::10", 6, 30080) == "shop/web"
    assert dual.service("10.0.0.5", 6, 30080) is None  # not the node's
    v6only = FlowDirectory(None, services, (None, IPv6Address("fd00::10")))
    assert v6only.service("fd00::10", 6, 30080) == "shop/web" and v6only.service("None", 6, 30080) is None


def test_a_node_port_is_named_on_every_address_the_kernel_holds_as_local():
    """The services table translates (and refuses) a node port on every local address of the
    node but loopback (fib daddr type local), not only [node] address: a client reaching it on
    another address of the node -- a second interface's, an address added since -- gets
    records naming the Service, so ``--service`` and ``--port`` find them, and so does a
    refused one (no endpoints: the packet's own destination).  Addresses the kernel does not
    hold stay unnamed; its local table is read again at most every LOCAL_REREAD seconds."""
    from ipaddress import ip_network
    from types import SimpleNamespace as NS

    from agentd.daemon.flow_directory import LOCAL_REREAD, DropMeaning, FlowDirectory
    from agentd.kernel.netlink_log import Packet

    ports = [NS(namespace="shop", service="web", protocol="TCP", port=80, cluster_ip="10.96.0.10", node_port=30080)]
    services = NS(syncs=1, ports=ports, compiled_ports=ports)
    local = [ip_network("127.0.0.0/8"), ip_network("192.168.1.10/32"), ip_network("172.16.5.1/32"),
             ip_network("2001:db8:5::1/128"), ip_network("198.51.100.0/28")]  # the last: an AnyIP prefix
    reads, now = [], [100.0]

    def read():
        reads.append(now[0])
        return list(local)

    d = FlowDirectory(None, services, (IPv4Address("192.168.1.10"), None), local_networks=read, clock=lambda: now[0])
    assert d.service("192.168.1.10", 6, 30080) == "shop/web" and reads == []  # [node] address: no read
    assert d.service("172.16.5.1", 6, 30080) == "shop/web"
    assert d.service("2001:db8:5::1", 6, 30080) == "shop/web" and d.service("198.51.100.7", 6, 30080) == "shop/web"
    assert reads == [100.0]
    assert d.service("127.0.0.1", 6, 30080) is None  # loopback: not translated (the table's not_loopback)
    assert d.service("10.0.0.5", 6, 30080) is None and d.service("172.16.5.1", 17, 30080) is None
    assert d.service("172.16.5.1", 6, 30081) is None
    assert reads == [100.0]  # a miss within LOCAL_REREAD reads nothing
    local.append(ip_network("10.0.0.5/32"))  # an address added since
    now[0] += LOCAL_REREAD
    assert d.service("10.0.0.5", 6, 30080) == "shop/web" and reads == [100.0, 100.0 + LOCAL_REREAD]

    # A refused node port on the second address: the drop record names the Service.
    d.drop = lambda prefix: DropMeaning("no-endpoints")  # type: ignore[method-assign]
    r = FlowRecorder("node1", d, "/nonexistent", group=143, clock=lambda: 1.0)
    flow = r.dropped(Packet("no-endpoints", 2, 1.0, 0, 0, 1, "192.0.2.7", "172.16.5.1", 6, 40000, 30080))
    assert flow is not None and flow.service == "shop/web" and flow.service_port == 30080


def test_a_contested_cluster_ip_and_node_port_are_named_after_the_service_that_holds_them():
    """Two Services claiming one cluster IP port and one node port (a hand-written put): the
    older holds both (the services compiler), so flows to them are its -- the directory names
    it, from the ports as compiled, not the younger one listed after it in the ports as asked."""
    from types import SimpleNamespace as NS

    from agentd.daemon.flow_directory import FlowDirectory
    from agentd.services.compiler import Table
    from agentd.services.model import Endpoint, ServicePort

    def sp(ns, name, created, ep):
        return ServicePort(ns, name, "", "TCP", 80, "10.96.0.10", 30080, None, False, False,
                           (Endpoint(ep, 8080, "node1"),), created=created)

    t = Table("node1")
    t.update(("a", "old"), [sp("a", "old", 1.0, "10.244.1.2")])
    t.update(("z", "new"), [sp("z", "new", 2.0, "10.244.1.3")])
    assert t.compiled(("z", "new"))[0].cluster_ip is None and t.compiled(("z", "new"))[0].node_port is None
    d = FlowDirectory(None, NS(syncs=1, ports=t.ports(), compiled_ports=t.compiled_ports()),
                      (IPv4Address("192.168.1.10"), None))
    assert d.service("10.96.0.10", 6, 80) == "a/old"
    assert d.service("192.168.1.10", 6, 30080) == "a/old"


def test_an_end_names_the_pods_its_start_named_not_who_has_the_address_now():
    """The sweep ends an idle or flushed connection long after its last packet (a pod deleted
    without closing its sockets): by then its address may be another pod's, or nobody's.  The
    end names whom its addresses named when its connection started (its SYN's time, in every
    record) -- whether its start was seen or not --; one started after the change, whom they
    name now."""

    now = 1000 * 10**9
    key, v = _conn(False, 2, now - 100 * 10**9, now - 60 * 10**9)
    other = key[:8] + bytes([1, 1]) + key[10:]  # another connection of the same pods, its start not seen
    later = key[:8] + bytes([2, 2]) + key[10:]  # one the new pod started after the change
    v_later = CONN_VALUE.pack(6, 5, 1400, 900, now + 5 * 10**9, now + 6 * 10**9, 2, 0, 3)
    r = recorder()
    r.tai_offset = lambda: 0
    version = [1]
    r.directory.version = lambda: version[0]
    r._on_recorded([CONN_RECORD.pack(key, REC_START, v)], 1000.0)
    r.directory.ids = {"10.244.2.3": WEB, "10.244.1.2": Identity("other/newpod", "node1", {}, False)}  # the client pod deleted, its address reused
    version[0] = 2
    r.recording = Programs({key: v})
    r._held = lambda k: False  # flushed from conntrack with the pod
    r._on_recorded([*r.sweep(now), CONN_RECORD.pack(other, REC_FIN, v), CONN_RECORD.pack(later, REC_FIN, v_later)], 1060.0)
    new, end, unseen, after = r.ring.last(FlowFilter(), 10)
    assert (new.event, new.src.identity, new.dst.identity) == ("new", CLIENT, WEB)
    assert (end.event, end.src.identity, end.dst.identity) == ("end", CLIENT, WEB)
    assert (unseen.event, unseen.src.identity, unseen.dst.identity) == ("end", CLIENT, WEB)  # started before too
    assert (after.event, after.src.identity.pod, after.dst.identity) == ("end", "other/newpod", WEB)
    assert list(r._history) == [socket.inet_aton("10.244.1.2")]  # what changed hands, and only that


def test_ends_are_taken_in_whole_while_no_address_of_theirs_changed_hands():
    """Naming an end as its start did costs nothing while none of a batch's addresses changed
    hands: the records are not looked at one by one (and a change of some other pod's address,
    or of something else of a pod, leaves no trace)."""

    now = 1000 * 10**9
    key, v = _conn(False, 2, now - 100 * 10**9, now - 60 * 10**9)
    r = recorder()
    r.tai_offset = lambda: 0
    version = [1]
    r.directory.version = lambda: version[0]
    r._on_recorded([CONN_RECORD.pack(key, REC_START, v)], 1000.0)
    r.directory.ids = {**r.directory.ids, "10.244.3.9": WEB}  # a pod elsewhere came
    version[0] = 2
    looked: list[int] = []
    r._ends_named_then = lambda *a: looked.append(1)  # type: ignore[method-assign]
    r._on_recorded([CONN_RECORD.pack(key, REC_FIN, v)], 1060.0)
    assert r._history == {} and looked == []
    assert [(f.event, f.src.identity) for f in r.ring.last(FlowFilter(), 10)] == [("new", CLIENT), ("end", CLIENT)]


def test_changes_of_hands_are_forgotten_after_fifteen_minutes_and_bounded():
    from agentd.flows import recorder as rec

    clock = [1000.0]
    r = FlowRecorder("node2", Directory(), "/nonexistent", group=143, clock=lambda: clock[0])
    r.tai_offset = lambda: 0
    version = [1]
    r.directory.version = lambda: version[0]
    r._begin_names()
    r.directory.ids = {"10.244.2.3": WEB}  # the client pod deleted
    version[0] = 2
    r._begin_names()
    assert list(r._history) == [socket.inet_aton("10.244.1.2")]
    assert r._named_then(socket.inet_aton("10.244.1.2"), 999 * 10**9, None) == CLIENT
    assert r._named_then(socket.inet_aton("10.244.1.2"), 1001 * 10**9, None) is None
    clock[0] += rec.HISTORY_AGE_NS / 1e9 + 100
    r.directory.ids = {}  # web deleted too, 15 minutes later
    version[0] = 3
    r._begin_names()
    assert list(r._history) == [socket.inet_aton("10.244.2.3")]
    for k in range(rec.HISTORY_PER_ADDRESS + 3):  # an address passed from pod to pod
        r.directory.ids = {"10.244.2.3": Identity(f"shop/p{k}", "node2", {}, True)}
        version[0] += 1
        r._begin_names()
    assert len(r._history[socket.inet_aton("10.244.2.3")]) == rec.HISTORY_PER_ADDRESS


def _entry_event(mtype: int, src: str, dst: str, family: int = socket.AF_INET, counters: bool = True,
                 started: int = 1_000_000_000_000) -> bytes:
    """A conntrack NEW or DESTROY of ``src``:40000 -> ``dst``:80 (TCP), as the kernel lays it out."""
    body = (_tuple(ct.CTA_TUPLE_ORIG, src, dst, 6, 40000, 80) + _tuple(ct.CTA_TUPLE_REPLY, dst, src, 6, 80, 40000)
            + nl.attr(ct.CTA_STATUS, struct.pack("!I", 8)) + nl.attr(ct.CTA_ID, struct.pack("!I", 7)))
    if mtype == ct.MSG_DELETE:
        if counters:
            body += _counters(ct.CTA_COUNTERS_ORIG, 5, 400) + _counters(ct.CTA_COUNTERS_REPLY, 4, 900)
        body += nl.nested(ct.CTA_TIMESTAMP, nl.attr(ct.CTA_TIMESTAMP_START, struct.pack("!Q", started)),
                          nl.attr(ct.CTA_TIMESTAMP_STOP, struct.pack("!Q", started + 250_000_000)))
    return nl.encode_nfgen(mtype, 0, 0, family, body)


@pytest.mark.parametrize("way", ["c", "python", "ipv6"])
def test_a_conntrack_end_names_the_pods_its_new_event_named(way):
    """A conntrack entry's DESTROY comes after its timeout (TCP's TIME_WAIT: 2 minutes), or when
    a deleted pod's entries are flushed: its pods are named as they were when the entry was
    made (CTA_TIMESTAMP_START), not as the addresses are named then (the client deleted, its
    address another pod's) -- whether its NEW was seen or not --; an entry made after the
    change, as they are named then.  Read at fixed offsets (in C, in Python) and the long way
    (IPv6)."""
    if way == "c" and ct.fast_events is None:
        pytest.skip("agentd/kernel/_ctevents.c not built")
    client, web = ("fd00:244:1::2", "fd00:244:2::3") if way == "ipv6" else ("10.244.1.2", "10.244.2.3")
    family = socket.AF_INET6 if way == "ipv6" else socket.AF_INET
    clock = [1000.0]
    r = FlowRecorder("node2", Directory(), "/nonexistent", group=143, clock=lambda: clock[0])
    r.tai_offset = lambda: 0
    r.fast = way == "c"
    version = [1]
    r.directory.version = lambda: version[0]
    r.directory.ids = {client: CLIENT, web: WEB}
    r._begin_names()  # as each read does
    r._on_conntrack_datagrams([_entry_event(ct.MSG_NEW, client, web, family)], 1000.0)
    clock[0] = 1100.0  # the client pod deleted, its address another pod's
    r.directory.ids = {client: Identity("other/newpod", "node1", {}, False), web: WEB}
    version[0] = 2
    r._begin_names()  # as each read does: the pods changed
    made_later = _entry_event(ct.MSG_DELETE, client, web, family, started=1_200_000_000_000)
    r._on_conntrack_datagrams([_entry_event(ct.MSG_DELETE, client, web, family)] * 2 + [made_later], 1220.0)
    new, end, unseen, later = list(r.ring)
    assert (new.event, new.src.identity, new.dst.identity) == ("new", CLIENT, WEB)
    assert (end.event, end.src.identity, end.dst.identity) == ("end", CLIENT, WEB)
    assert (unseen.event, unseen.src.identity, unseen.dst.identity) == ("end", CLIENT, WEB)  # made before too
    assert (later.event, later.src.identity.pod, later.dst.identity) == ("end", "other/newpod", WEB)


@pytest.mark.parametrize("carried", [None, (7, 700, 3, 300)])
def test_an_end_conntrack_did_not_count_says_unknown_not_zero(carried):
    """A connection already open when flow records were turned on has no counters
    (nf_conntrack_acct counts only entries made after): its end says unknown (None, null,
    ``-``), not 0 bytes -- nor only what the fast path carried of it."""
    msg = _entry_event(ct.MSG_DELETE, "10.244.1.2", "10.244.2.3", counters=False)
    ((mtype, _f, _s, _p, start, end),) = list(nl.iter_messages(msg))
    ev = ct.decode_event(mtype, msg, start, end)
    assert (ev.orig_packets, ev.orig_bytes, ev.reply_packets, ev.reply_bytes) == (None, None, None, None)
    flow = recorder().connection(ev, carried=carried)
    j = flow.json()
    assert (j["bytes_sent"], j["bytes_received"], j["packets_sent"], j["packets_received"]) == (None, None, None, None)
    assert j["duration"] == 0.25
    assert "end  sent - received -  0.250s" in line(json.loads(json.dumps(j)))
    r = recorder()
    r._on_conntrack_datagrams([msg], 1000.0)  # read at fixed offsets, made when read
    assert next(iter(r.ring)).bytes_sent is None


def test_the_directory_tells_whom_an_address_named_before_it_changed_hands():
    """The policy engine keeps whom an address named before each change of a pod's record
    that may give it to another (deleted, its address taken, relabelled, moved): the
    directory hands those out as identities, since a count, oldest first."""
    from ipaddress import ip_address
    from types import SimpleNamespace as NS

    from agentd.daemon.flow_directory import FlowDirectory
    from agentd.policy import engine as eng_mod
    from agentd.policy.engine import PolicyEngine
    from agentd.policy.model import Pod

    eng = PolicyEngine("node2")
    d = FlowDirectory(NS(engine=eng), None, ())
    a, b = ip_address("10.244.1.2"), ip_address("10.244.1.3")
    client = Pod("shop", "client", "node1", (a,), {"app": "client"})
    count, got = d.named_before(None)
    assert got == []
    eng.upsert_pod(client)
    eng.upsert_pod(client)  # the same record again: no change
    assert d.named_before(count) == (count, [])
    eng.upsert_pod(Pod("shop", "client", "node1", (a,), {"app": "client", "v": "2"}))  # relabelled
    eng.remove_pod(("shop", "client"))
    eng.upsert_pod(Pod("other", "newpod", "node1", (a, b), {}))  # takes the address
    eng.upsert_pod(Pod("other", "newpod", "node1", (b,), {}))  # gives it back
    count2, got = d.named_before(count)
    assert [(ip, i.pod, dict(i.labels)) for ip, i, _when in got] == [
        ("10.244.1.2", "shop/client", {"app": "client"}),
        ("10.244.1.2", "shop/client", {"app": "client", "v": "2"}),
        ("10.244.1.2", "other/newpod", {}), ("10.244.1.3", "other/newpod", {})]
    assert d.named_before(count2) == (count2, [])
    assert d.identity("10.244.1.2") is None and d.identity("10.244.1.3").pod == "other/newpod"
    for k in range(eng_mod.NAMED_BEFORE_MAX + 1):  # more than the engine keeps between two looks
        eng.upsert_pod(Pod("other", "newpod", "node1", (b,), {"k": str(k)}))
    assert d.named_before(count2)[1] is None


def test_a_change_of_hands_counts_from_when_the_engine_saw_it_not_when_the_recorder_read_it():
    """The client pod deleted at 1010 and its address another pod's; the recorder reads the
    change only at 1030 (no record came in between): a connection the new pod started at 1029
    is the new pod's at its end.  Several changes between two reads keep each one's time (the
    address passed on twice: a connection started in between names the middle owner)."""
    from ipaddress import ip_address
    from types import SimpleNamespace as NS

    from agentd.daemon.flow_directory import FlowDirectory
    from agentd.policy.engine import PolicyEngine
    from agentd.policy.model import Pod

    a = ip_address("10.244.1.2")
    at = socket.inet_aton("10.244.1.2")
    eng = PolicyEngine("node2")
    clock = [1000.0]
    eng.clock = lambda: clock[0]
    eng.upsert_pod(Pod("shop", "client", "node1", (a,), {"app": "client"}))
    r = FlowRecorder("node2", FlowDirectory(NS(engine=eng), None, ()), "/nonexistent", group=143,
                     clock=lambda: clock[0])
    r.tai_offset = lambda: 0
    r._begin_names()  # a read at 1000
    clock[0] = 1010.0
    eng.remove_pod(("shop", "client"))
    eng.upsert_pod(Pod("other", "newpod", "node1", (a,), {}))
    clock[0] = 1020.0
    eng.remove_pod(("other", "newpod"))
    eng.upsert_pod(Pod("other", "third", "node1", (a,), {}))
    clock[0] = 1030.0
    r._begin_names()  # the next read
    named = r.directory.identity("10.244.1.2")
    assert named.pod == "other/third"
    assert r._named_then(at, 1005 * 10**9, named).pod == "shop/client"
    assert r._named_then(at, 1015 * 10**9, named).pod == "other/newpod"
    assert r._named_then(at, 1025 * 10**9, named).pod == "other/third"


def _bridge_logged(prefix: str, hw_protocol: int, payload: bytes) -> bytes:
    """NFLOG's message of a packet (of ``hw_protocol``) a bridge chain logged with ``prefix``,
    come in on client's bridge port (7) of the bridge (3)."""
    body = (nl.attr(nflog.NFULA_PACKET_HDR, struct.pack("!HBx", hw_protocol, 0))
            + nl.attr(nflog.NFULA_PREFIX, prefix.encode() + b"\0") + nl.attr(nflog.NFULA_SEQ, struct.pack("!I", 1))
            + nl.attr(nflog.NFULA_TIMESTAMP, struct.pack("!QQ", 1700000000, 0)) + nl.attr(nflog.NFULA_PAYLOAD, payload)
            + nl.attr(nflog.NFULA_IFINDEX_INDEV, struct.pack("!I", 3)) + nl.attr(nflog.NFULA_IFINDEX_PHYSINDEV, struct.pack("!I", 7)))
    return nl.encode_nfgen(nflog.MSG_PACKET, 0, 0, 7, body, res_id=143)


def test_a_spoofed_arp_drop_is_a_flow_record_naming_the_pod_that_sent_it():
    """The bridge drops ARP from client's port claiming web's address; NFLOG hands the ARP
    packet (hardware protocol ETH_P_ARP), which is a record: reason spoofed-arp, protocol ARP,
    the claimed address as source, client as the sender."""
    arp = (struct.pack("!HHBBH", 1, 0x0800, 6, 4, 2) + bytes.fromhex("0a580af40102") + socket.inet_aton("10.244.2.3")
           + bytes(6) + socket.inet_aton("10.244.2.1"))  # fmt: skip
    flow = recorder().dropped(_decoded(_bridge_logged("spoofed-arp", 0x0806, arp)))
    assert flow is not None
    j = flow.json()
    assert (j["reason"], j["protocol"], j["src"]["ip"], j["dst"]["ip"]) == ("spoofed-arp", "ARP", "10.244.2.3", "10.244.2.1")
    assert j["sender"]["pod"] == "shop/client" and j["reason_text"] == "ARP sender address is not the pod's own"
    assert FlowFilter.parse([("reason", "spoofed-arp"), ("from-pod", "shop/client")]).matches(flow)
    # Not ARP for IPv4 over Ethernet (or cut short): no record, as for any packet it cannot read.
    assert nflog.arp_summary(arp[:20], 0, 20) is None
    ipv6_arp = arp[:2] + struct.pack("!H", 0x86DD) + arp[4:]
    assert nflog.arp_summary(ipv6_arp, 0, len(ipv6_arp)) is None


def _icmp6_logged(prefix: str, icmp: bytes, src: str = "fe80::aa:1", dst: str = "ff02::1") -> bytes:
    """NFLOG's message of an ICMPv6 packet a bridge chain logged, come in on client's port."""
    packet = (struct.pack("!IHBB", 6 << 28, len(icmp), 58, 255) + ipaddress.IPv6Address(src).packed
              + ipaddress.IPv6Address(dst).packed + icmp)  # fmt: skip
    return _bridge_logged(prefix, 0x86DD, packet)


def test_a_spoofed_neighbour_advertisement_names_the_address_it_claims():
    """The bridge drops client's neighbour advertisement "web's IPv6 address is at my MAC"
    (spoofed-nd): its source is client's own link-local address, so the record's source is the
    address claimed (named: web), as a spoofed ARP's is, client the sender; advertisements
    claiming different addresses are different records.  A router advertisement (ra-guard) is
    no spoofed source: its record says so, client the sender."""
    r = recorder()
    r.directory.ids = {**r.directory.ids, "fd00:10:244:2::3": WEB}

    def na(target: str) -> bytes:
        return bytes([136, 0, 0, 0, 0x20, 0, 0, 0]) + ipaddress.IPv6Address(target).packed

    flow = r.dropped(_decoded(_icmp6_logged("spoofed-nd", na("fd00:10:244:2::3"))))
    assert flow is not None
    j = flow.json()
    assert (j["reason"], j["protocol"], j["src"]["ip"], j["dst"]["ip"]) == ("spoofed-nd", "ICMPv6", "fd00:10:244:2::3", "ff02::1")
    assert j["src"]["pod"] == "shop/web" and j["sender"]["pod"] == "shop/client"
    assert j["reason_text"] == "neighbour advertisement's target address is not the pod's own"
    assert FlowFilter.parse([("reason", "spoofed-nd"), ("pod", "shop/web")]).matches(flow)
    assert r.dropped(_decoded(_icmp6_logged("spoofed-nd", na("fd00:10:244:2::4")))) is not None  # another claim: not folded
    ra = bytes([134, 0, 0, 0, 64, 0]) + (1800).to_bytes(2, "big") + bytes(8)
    flow = r.dropped(_decoded(_icmp6_logged("ra-guard", ra)))
    assert flow is not None
    j = flow.json()
    assert (j["reason"], j["src"]["ip"], j["sender"]["pod"]) == ("ra-guard", "fe80::aa:1", "shop/client")
    assert j["reason_text"] == "router advertisement or redirect from a pod (pods are no routers)"
    # What is no neighbour advertisement, or cut short, claims nothing.
    for icmp in (ra, na("fd00:10:244:2::3")[:20]):
        assert _decoded(_icmp6_logged("spoofed-nd", icmp)).claimed is None


def test_spoofed_arp_drops_log_through_their_own_rate_limited_chain():
    eng = PolicyEngine("node1", families=(4,), drop_log=DropLog(5))
    eng.upsert_pod(Pod("x", "a", "node1", (IPv4Address("10.244.1.2"),), {}), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    rs = eng.build()
    pre = rs.objects[("bridge", policy_compiler.TABLE, "chain", "prerouting")]
    arp_rules = [json.loads(r) for r in pre.rules if '"arp"' in r and "saddr ip" in r]  # type: ignore[union-attr]
    assert [r[-1] for r in arp_rules] == [{"jump": {"target": "spoofed-arp"}}]
    logged = json.loads(rs.objects[("bridge", policy_compiler.TABLE, "chain", "spoofed-arp")].rules[0])  # type: ignore[union-attr]
    assert {"log": {"prefix": "spoofed-arp", "group": 5}} in logged and {"counter": "spoofed"} in logged
    assert any("limit" in stmt for stmt in logged)


def test_the_directory_gives_each_spoofing_drop_its_reason():
    from agentd.daemon.flow_directory import FlowDirectory
    from agentd.flows.model import REASONS

    d = FlowDirectory(None, None, (None, None))
    for prefix in ("spoofed", "spoofed-mac", "spoofed-arp", "spoofed-nd", "ra-guard"):
        meaning = d.drop(prefix)
        assert meaning is not None and (meaning.reason, meaning.direction) == (prefix, "egress") and prefix in REASONS


def test_the_bridges_isolation_drops_have_their_reason_direction_and_sender():
    """What crosses the bridge unrouted to (isolated-in) or from (isolated-out) an isolated pod
    -- broadcast, multicast, IPv6 but neighbour discovery -- is logged with its own prefix: a
    record of reason ``isolated``, in the direction of the isolation, naming the pod on the port
    it came in from; the other family's drops likewise (``other-family``)."""
    from agentd.daemon.flow_directory import FlowDirectory
    from agentd.flows.model import REASONS

    class Directory(FlowDirectory):
        def pod_on(self, ifindex):
            return {7: ("vethclient", CLIENT)}.get(ifindex)

    d = Directory(None, None, (None, None))
    expected = {"isolated-in": ("isolated", "ingress"), "isolated-out": ("isolated", "egress"),
                "other-family": ("other-family", "egress")}
    for prefix, (reason, direction) in expected.items():
        meaning = d.drop(prefix)
        assert meaning is not None and (meaning.reason, meaning.direction) == (reason, direction) and reason in REASONS
    r = FlowRecorder("node1", d, "/nonexistent", group=143, clock=lambda: 1000.0)
    mdns = P.udp_datagram("10.244.1.2", "224.0.0.251", 5353, 5353, b"x")
    flow = r.dropped(_decoded(_bridge_logged("isolated-out", 0x0800, mdns)))
    assert flow is not None
    j = flow.json()
    assert (j["reason"], j["direction"], j["dst"]["ip"], j["sender"]["pod"]) == ("isolated", "egress", "224.0.0.251", "shop/client")
    assert dict(r.drops) == {} and FlowFilter.parse([("reason", "isolated"), ("from-pod", "shop/client")]).matches(flow)


def test_an_ipv6_address_and_port_are_printed_in_brackets():
    record = {"time": 1.0, "node": "node1", "protocol": "TCP", "verdict": "forwarded", "event": "new",
              "src": {"ip": "fd00:10:244:1::2", "port": 40112, "pod": "shop/client"},
              "dst": {"ip": "10.244.2.3", "port": 8080},
              "service": {"name": "shop/web", "ip": "fd00:10:96::a", "port": 80}}
    text = line(record)
    assert "shop/client [fd00:10:244:1::2]:40112 -> svc shop/web [fd00:10:96::a]:80 => 10.244.2.3:8080" in text


class _Once(_Registry):
    """A registry whose node2 answers a followed stream that asks for its last N with them, the
    empty line that ends them, then (once ``more`` is set) a record it made later."""

    def __init__(self, names):
        super().__init__(names)
        self.more = asyncio.Event()

    async def lines(self, node, path, *, follow=False, blanks=False, **_):
        self.asked.append((node, path))
        if "last=0" not in path:
            yield b'{"time": 1.0, "node": "node2", "n": 1}\n'
            yield b'{"time": 2.0, "node": "node2", "n": 2}\n'
        if follow:
            if blanks:
                yield b"\n"
            await self.more.wait()
            yield b'{"time": 3.0, "node": "node2", "n": 3}\n'
            await asyncio.Event().wait()


async def _follow_cluster(registry, flt: FlowFilter, last: int, *, steps: int = 20, between=None) -> list[dict]:
    """A followed cluster stream (``GET /flows?cluster=1&follow=1&last=...``) of node1 (flow
    records off there) through ``registry``: ``steps`` turns of the loop, ``between(lines
    written)``, ``registry.more`` set, as many turns again; the lines written, read."""
    from types import SimpleNamespace

    from agentd.daemon import observe_api

    agent = SimpleNamespace(cluster_view=lambda: registry, flows_view=lambda: None, node_name=lambda: "node1")
    handlers = observe_api._Handlers(agent, read_only=False, token_of=lambda: None)
    resp = _Stream()
    task = asyncio.create_task(handlers._cluster_flows(resp, flt, last, None, True))
    for _ in range(steps):
        await asyncio.sleep(0)
    if between is not None:
        between([json.loads(line) for line in resp.lines if line.strip()])
    registry.more.set()
    for _ in range(steps):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return [json.loads(line) for line in resp.lines if line.strip()]


async def test_a_followed_cluster_asks_another_node_once_for_its_last_records_and_what_follows():
    """The last N and the followed records of a node in one request (last=N&follow=1): there
    it takes the one and starts the other at once, so no record it makes falls between them."""
    from urllib.parse import parse_qs, urlsplit


    registry = _Once(["node1", "node2"])
    written = await _follow_cluster(registry, FlowFilter.parse([("node", "node2")]), 5)
    assert len(registry.asked) == 1, registry.asked
    query = parse_qs(urlsplit(registry.asked[0][1]).query)
    assert query["last"] == ["5"] and query["follow"] == ["1"] and query["node"] == ["node2"]
    assert [line["n"] for line in written] == [1, 2, 3]


class _OlderNode(_Registry):
    """node2 runs an older agentd: a followed stream asked for its last N does not say it ends
    them with an empty line (it sends its last N and its followed records alike); asked
    without follow, it answers its last N."""

    def __init__(self, names):
        super().__init__(names)
        self.more = asyncio.Event()

    async def lines(self, node, path, *, follow=False, blanks=False, **_):
        from agentd.daemon.cluster import UnmarkedStream

        self.asked.append((node, path))
        if follow and blanks:
            raise UnmarkedStream(f"{node} does not end its last records with an empty line")
        if "last=0" not in path:
            yield b'{"time": 1.0, "node": "node2", "n": 1}\n'
            yield b'{"time": 2.0, "node": "node2", "n": 2}\n'
        if follow:
            await self.more.wait()
            yield b'{"time": 3.0, "node": "node2", "n": 3}\n'
            await asyncio.Event().wait()


async def test_a_followed_cluster_asks_an_older_node_its_last_records_apart():
    """In a rolling upgrade a node of an older agentd is asked the older way (its last N, then
    a followed stream from now on): not said unreachable, its last N not lost."""
    from urllib.parse import parse_qs, urlsplit


    registry = _OlderNode(["node1", "node2"])
    records = await _follow_cluster(registry, FlowFilter.parse([("node", "node2")]), 5, steps=40)
    assert [r.get("n") for r in records] == [1, 2, 3], records
    queries = [parse_qs(urlsplit(p).query) for _n, p in registry.asked]
    assert sorted((q["last"][0], q.get("follow", ["0"])[0]) for q in queries) == [("0", "1"), ("5", "0"), ("5", "1")]


class _Ring:
    """A node's flow records with nothing in them, saying in ``did`` what was asked when."""

    def __init__(self, did):
        self.did = did

    def followers(self, pool=None):
        return 0

    def follow(self, flt, pool="open"):
        self.did.append("follow")

        class Gone:  # the reader went: its stream ends at the first record waited for
            async def get(self):
                raise ConnectionResetError

        from types import SimpleNamespace

        return SimpleNamespace(queue=Gone(), lost=0)

    def search(self, flt, n, since=None, after=None):
        self.did.append("search")
        from types import SimpleNamespace

        return SimpleNamespace(scrolled=0, left_out=0)  # a LastSearch, as far as the handler reads it

    def cursor(self):
        return "r:0"

    async def finish(self, search):
        self.did.append("finish")
        return []

    def unfollow(self, follower):
        self.did.append("unfollow")


async def test_a_node_follows_before_it_answers_and_ends_its_last_records_with_an_empty_line(monkeypatch):
    from types import SimpleNamespace

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from agentd.daemon import observe_api

    did: list[str] = []
    written: list[bytes] = []

    headers: list = []

    async def prepare(self, request):
        did.append("prepare")
        headers.append(dict(self.headers))

    async def write(self, data):
        written.append(data)

    monkeypatch.setattr(web.StreamResponse, "prepare", prepare)
    monkeypatch.setattr(web.StreamResponse, "write", write)
    agent = SimpleNamespace(cluster_view=lambda: None, flows_view=lambda: _Ring(did), node_name=lambda: "node1")
    handlers = observe_api._Handlers(agent, read_only=True, token_of=lambda: None)
    await handlers.flows(make_mocked_request("GET", "/flows?last=5&follow=1"))
    assert did == ["follow", "search", "prepare", "finish", "unfollow"]
    assert written == [b"\n"]  # no record in the last 5: the empty line that ends them
    assert headers[0].get("X-Agentd-Last-End") == "empty-line"  # says so, for a gathering node to rely on


async def test_a_node_that_stalls_before_its_last_records_is_said_unreachable_and_still_followed(monkeypatch):

    from agentd.daemon import observe_api

    class Stalled(_Once):
        async def lines(self, node, path, *, follow=False, blanks=False, **_):
            self.asked.append((node, path))
            await self.more.wait()  # nothing until then, not even its last N
            yield b'{"time": 3.0, "node": "node2", "n": 3}\n'
            await asyncio.Event().wait()

    monkeypatch.setattr(observe_api, "TIMEOUT", 0)
    registry = Stalled(["node1", "node2"])
    said = await _follow_cluster(registry, FlowFilter.parse([("node", "node2")]), 5)
    assert said == [{"node": "node2", "error": "node2 unreachable: nothing for 0s"}, {"time": 3.0, "node": "node2", "n": 3}]


async def test_a_quiet_followed_cluster_looks_for_new_nodes_every_keepalive_and_asks_them_since(monkeypatch):
    """The registry is looked at KEEPALIVE after the last look, however the stream's lines come
    (not KEEPALIVE after the last line), and a node that joined is asked for what it recorded
    since the look before."""
    from types import SimpleNamespace
    from urllib.parse import parse_qs, urlsplit

    from agentd.daemon import observe_api

    clock = [0.0]
    asked_waits: list[tuple[float, float]] = []
    timeouts: list[asyncio.Timeout] = []

    def timeout(delay):  # the waits asked for, on the test's clock; fired by the test
        asked_waits.append((clock[0], delay))
        timeouts.append(asyncio.timeout(None))
        return timeouts[-1]

    fake = SimpleNamespace(get_running_loop=lambda: SimpleNamespace(time=lambda: clock[0]), timeout=timeout,
                           create_task=asyncio.create_task, gather=asyncio.gather, sleep=asyncio.sleep,
                           Event=asyncio.Event, Queue=asyncio.Queue, QueueFull=asyncio.QueueFull)
    monkeypatch.setattr(observe_api, "asyncio", fake)
    monkeypatch.setattr(observe_api, "time", SimpleNamespace(time=lambda: 1000.0 + clock[0]), raising=False)

    class Quiet(_Registry):
        def __init__(self, names):
            super().__init__(names)
            self.say = asyncio.Event()

        async def lines(self, node, path, *, follow=False, blanks=False, **_):
            self.asked.append((node, path))
            if node == "node2":
                await self.say.wait()
                yield b'{"time": 1.0, "node": "node2"}\n'
            await asyncio.Event().wait()

    registry = Quiet(["node1", "node2"])
    agent = SimpleNamespace(cluster_view=lambda: registry, flows_view=lambda: None, node_name=lambda: "node1")
    handlers = observe_api._Handlers(agent, read_only=False, token_of=lambda: None)
    resp = _Stream()
    task = asyncio.create_task(handlers._cluster_flows(resp, FlowFilter.parse([]), 0, None, True))
    for _ in range(20):
        await asyncio.sleep(0)
    clock[0] = 9.0
    registry.say.set()  # a line 9 s in: the next look is due 1 s later, not 10
    for _ in range(20):
        await asyncio.sleep(0)
    assert asked_waits == [(0.0, observe_api.KEEPALIVE), (9.0, 1.0)]
    registry.addresses["node3"] = "192.0.2.3"
    clock[0] = 10.0
    timeouts[-1].reschedule(asyncio.get_running_loop().time())  # the wait of 1 s is over
    for _ in range(20):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    [path] = [p for n, p in registry.asked if n == "node3"]
    query = parse_qs(urlsplit(path).query)
    assert query["since"] == ["1000.0"] and query["follow"] == ["1"], query  # since the look at the start


def test_a_pods_packet_with_no_route_is_logged_by_a_rate_limited_nat_rule_for_first_packets_only():
    """The kernel drops a routed packet it has no route for before any forward hook: the inet
    table's prerouting nat chain (before the Services' translation) logs it, with prefix no-route,
    for a pod's first packets (in on a pod bridge; the Service ranges left out) whose
    destination is not the node's own, broadcast or multicast and has no output interface
    (fib daddr oif missing), unless the pod programs marked it as a SYN they record (they asked
    its route); it only logs (the kernel drops), under the kernel's limit.  No
    such chain without flow records.  The record: reason no-route, egress, selectable."""
    from agentd.daemon.flow_directory import FlowDirectory
    from agentd.flows.model import REASONS

    eng = PolicyEngine("node1", families=(4, 6), drop_log=DropLog(5),
                       service_ranges=(IPv4Network("10.96.0.0/12"), IPv6Network("fd00:10:96::/112")))
    eng.upsert_pod(Pod("x", "a", "node1", (IPv4Address("10.244.1.2"),), {}), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    rs = eng.build()
    pre = rs.objects[("inet", policy_compiler.TABLE, "chain", "prerouting")]
    # A nat chain before the Services' DNAT (-100): asked for a connection's first packet only.
    assert pre.hook == ("nat", "prerouting", -101, "accept")  # type: ignore[union-attr]
    rules = [json.loads(r) for r in pre.rules]  # type: ignore[union-attr]
    assert len(rules) == 2  # one per family
    for rule, (nfproto, proto, rng) in zip(rules, [("ipv4", "ip", ("10.96.0.0", 12)), ("ipv6", "ip6", ("fd00:10:96::", 112))]):
        assert rule[0] == {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "@bridges"}}
        # A SYN the pod programs record (marked) had its route asked by them: not asked again.
        assert rule[1] == {"match": {"op": "==", "left": {"&": [{"meta": {"key": "mark"}}, 0x00800000]}, "right": 0}}
        assert rule[2] == {"match": {"op": "==", "left": {"meta": {"key": "nfproto"}}, "right": nfproto}}
        assert rule[3] == {"match": {"op": "!=", "left": {"payload": {"protocol": proto, "field": "daddr"}},
                                     "right": {"set": [{"prefix": {"addr": rng[0], "len": rng[1]}}]}}}  # a VIP has no route
        # The route asked first: a connection that has one (most) costs one look-up, not two.
        assert rule[4] == {"match": {"op": "==", "left": {"fib": {"result": "oif", "flags": ["daddr"]}}, "right": False}}
        assert rule[5]["match"]["op"] == "!=" and rule[5]["match"]["right"] == {"set": ["local", "broadcast", "multicast", "anycast"]}
        assert rule[6] == {"jump": {"target": "no-route"}}
    logged = [json.loads(r) for r in rs.objects[("inet", policy_compiler.TABLE, "chain", "no-route")].rules]  # type: ignore[union-attr]
    assert logged[0] == [{"limit": {"rate": 100, "per": "second", "burst": 100}}, {"log": {"prefix": "no-route", "group": 5}},
                         {"return": None}]
    assert logged[1] == [{"counter": SUPPRESSED}]  # over the limit: counted, not logged, never dropped here
    assert not any('"drop"' in r for r in pre.rules)  # type: ignore[union-attr]
    quiet = PolicyEngine("node1", families=(4,)).build()
    assert ("inet", policy_compiler.TABLE, "chain", "prerouting") not in quiet.objects

    d = FlowDirectory(None, None, (None, None))
    meaning = d.drop("no-route")
    assert meaning is not None and (meaning.reason, meaning.direction) == ("no-route", "egress") and "no-route" in REASONS
    r = FlowRecorder("node1", d, "/nonexistent", group=5, clock=lambda: 1.0)
    flow = r.dropped(nflog.Packet("no-route", socket.AF_INET, 1.0, 3, 0, 1, "10.244.1.2", "10.244.200.9", 17, 40000, 9))
    assert flow is not None and flow.reason == "no-route" and flow.verdict == "dropped" and flow.service is None
    assert flow.json()["reason_text"] == REASONS["no-route"]
    assert FlowFilter.parse([("reason", "no-route")]).matches(flow)
    r.ring.add(flow)  # counted when taken in: agentd_flow_drops{reason="no-route"}
    assert r.drops[("no-route", "egress")] == 1


def test_flow_records_follow_the_cluster_record_not_this_nodes_network_settings(monkeypatch, tmp_path):
    """The agent follows the cluster record in etcd where this node's [network] differs: a
    node configured ipv4 with another pod network and Service range, in a dual cluster.  Its
    recorder's pods and Services (the kernel's conntrack filter, IPv4, and the long way, both
    families) are the record's, and a node port is named on the node's own IPv6 address."""
    from ipaddress import IPv6Address, ip_network

    from prometheus_client import CollectorRegistry

    from agentd.datastore.store import ClusterConfig

    observe, obs = _observability(monkeypatch, tmp_path, AGENTD_NETWORK_CIDR="10.50.0.0/16",
                                  AGENTD_NETWORK_SERVICE_CIDR="10.60.0.0/16")
    monkeypatch.setattr(observe.FlowRecorder, "open", lambda self: None)
    cluster = ClusterConfig("10.244.0.0/16", 24, "vxlan", "always", "10.96.0.0/12", ip_family="dual",
                            cidr_v6="fd00:244::/56", subnet_len_v6=64, service_cidr_v6="fd00:96::/112")
    asyncio.run(obs.open_flows(None, None, CollectorRegistry(), cluster=cluster, address_v6=IPv6Address("2001:db8::10")))
    rec = obs.recorder
    assert set(rec.networks) == {ip_network("10.244.0.0/16"), ip_network("10.96.0.0/12"),
                                 ip_network("fd00:244::/56"), ip_network("fd00:96::/112")}
    assert sorted(rec.prefixes) == sorted((int(n.network_address), int(n.netmask))
                                          for n in (ip_network("10.244.0.0/16"), ip_network("10.96.0.0/12")))
    assert rec._ours("fd00:244::5", "2001:db8::99") and not rec._ours("10.50.0.5", "10.60.0.1")
    assert "2001:db8::10" in rec.directory.node_addresses


def test_the_forward_chains_look_at_conntrack_only_while_a_pod_is_isolated():
    """Flow records and Services need the kernel to track connections, which their own nat and
    ct expressions make it do; routing every local pod up (no br_netfilter) isolates nobody.
    Neither adds the conntrack rules (established accept, the Services hairpin accept) to the
    forward chains, which every packet the node forwards through its stack would pay for: only
    a pod that a policy isolates does, and its going takes them away again."""
    engine = PolicyEngine("node2", drop_log=DropLog(143), route_all=True)
    engine.upsert_pod(Pod("shop", "web", "node2", (IPv4Address("10.244.2.3"),), {"app": "web"}),
                      LocalPort("veth1", "02:00:00:00:00:01", "cni0"))
    engine.set_route_services(True)

    def ct_rules() -> list[str]:
        objects = engine.build().objects
        return [r for c in ("egress", "ingress") for r in objects[("inet", "agentd-policy", "chain", c)].rules if '"ct"' in r]

    for bridged in (False, True):  # every pod routed up (not isolated), or bridged
        engine.set_bridged_to_ip(bridged)
        assert ct_rules() == [], bridged
    deny = Policy.parse({"metadata": {"namespace": "shop", "name": "deny"}, "spec": {"podSelector": {}}})
    engine.upsert_policy(deny)
    assert len(ct_rules()) == 4  # established and hairpin, in each chain
    engine.remove_policy(deny.key)
    assert ct_rules() == []


def test_every_pod_is_routed_up_for_flow_records_only_where_conntrack_would_not_see_it_bridged(tmp_path):
    """br_netfilter handing bridged frames to the IP hooks (kubelet and Docker hosts): conntrack
    sees connections between pods of the node without routing them up -- only isolated pods
    are; without it (or for one family without it) every pod is routed up, as before."""
    from agentd.policy.agent import bridged_to_ip

    engine = PolicyEngine("node2", drop_log=DropLog(143), route_all=True)
    engine.upsert_pod(Pod("shop", "web", "node2", (IPv4Address("10.244.2.3"),), {"app": "web"}),
                      LocalPort("veth1", "02:00:00:00:00:01", "cni0"))
    engine.upsert_pod(Pod("lobby", "a", "node2", (IPv4Address("10.244.2.4"),), {}),
                      LocalPort("veth2", "02:00:00:00:00:02", "cni0"))
    engine.upsert_policy(Policy.parse({"metadata": {"namespace": "shop", "name": "deny"}, "spec": {"podSelector": {}}}))

    def handed_up() -> set[str]:
        return set(engine.build().objects[("bridge", "agentd-policy", "set", "isolated-ports")].elements)

    assert handed_up() == {"veth1", "veth2"}
    assert engine.set_bridged_to_ip(True) and engine.dirty
    assert handed_up() == {"veth1"}  # shop/web is isolated: routed up all the same
    assert not engine.set_bridged_to_ip(True)
    assert engine.set_bridged_to_ip(False)
    assert handed_up() == {"veth1", "veth2"}
    quiet = PolicyEngine("node2", route_all=False)
    assert not quiet.set_bridged_to_ip(True)  # flows off: nothing routed for them, nothing to change

    assert not bridged_to_ip((4,), tmp_path)  # br_netfilter not loaded: no sysctls
    (tmp_path / "bridge-nf-call-iptables").write_text("1\n")
    assert bridged_to_ip((4,), tmp_path)
    assert not bridged_to_ip((4, 6), tmp_path)  # IPv6 pods would pass unseen
    (tmp_path / "bridge-nf-call-ip6tables").write_text("1\n")
    assert bridged_to_ip((4, 6), tmp_path)
    (tmp_path / "bridge-nf-call-iptables").write_text("0\n")
    assert not bridged_to_ip((4, 6), tmp_path)


# ------------------------------------------------------------------ a broken followed stream resumes after its cursor


class _Resumable:
    """A node whose followed answers carry the ring header: ``answers`` in turn, each a header
    and the records (or an exception) it sends, then a break (``OSError``)."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.paths: list[str] = []

    async def lines(self, node, path, *, follow=False, blanks=False, seen=None):
        from agentd.daemon.cluster import RING

        self.paths.append(path)
        header, records = self.answers.pop(0)
        if seen is not None and header is not None:
            seen[RING] = header
        for seq in records:  # a record's number, or a line as it is ({"lost": N})
            line = seq if isinstance(seq, dict) else {"seq": seq, "time": float(seq), "node": node}
            yield json.dumps(line, separators=(",", ":")).encode() + b"\n"
        if not self.answers:
            await asyncio.Event().wait()  # the last answer stays open
        raise OSError(f"{node} unreachable: reset")


async def _pumped(monkeypatch, answers) -> tuple[list, list[dict]]:
    """node2's followed stream pumped from a :class:`_Resumable` answering ``answers`` until
    they run out: the ``after`` cursor of each request made, and the lines merged."""
    from urllib.parse import parse_qs, urlsplit

    from agentd.daemon import observe_api

    monkeypatch.setattr(observe_api, "RETRY_FIRST", 0.0)
    node = _Resumable(answers)
    merge = observe_api._Merge()

    def resume(cursor):
        return "/flows?" + observe_api.urlencode([("node", "node2"), ("after", cursor), ("last", "100000"), ("follow", "1")])

    task = asyncio.create_task(observe_api._pump_remote(node, "node2", "/flows?node=node2&last=0&follow=1", merge,
                                                        again="/flows?node=node2&last=0&follow=1", resume=resume))
    for _ in range(50):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    afters = [parse_qs(urlsplit(p).query).get("after", [None])[0] for p in node.paths]
    return afters, [json.loads(line) for line in (merge.queue.get_nowait() for _ in range(merge.queue.qsize()))]


async def test_a_broken_followed_stream_is_asked_again_after_the_last_record_it_sent(monkeypatch):
    # Follow began after the node's record 10; 11 and 12 came, the stream broke, the node made
    # 13 and 14 meanwhile: the stream asked again after 12 gets 13, 14 and what follows, each once.
    # A resumed answer broken before any record is resumed after the same record again (its
    # header counts the gap it had yet to send); a node that restarted (another ring) numbers
    # from 1 again.
    afters, lines = await _pumped(monkeypatch, [("r1:10", [11, 12]), ("r1:14", [13, 14]), ("r1:15", []), ("r2:0", [1, 2])])
    assert afters == [None, "r1:12", "r1:14", "r1:14"]
    assert [x["seq"] for x in lines if "seq" in x] == [11, 12, 13, 14, 1, 2]


async def test_a_resume_broken_in_the_middle_of_its_gap_is_resumed_after_what_came(monkeypatch):
    """The answer to a resume starts with the gap (the records after the cursor, up to where its
    follow began: its header): broken off after part of it, the next resume asks after the last
    record that came, not after the header's number (the rest of the gap was never sent)."""
    afters, lines = await _pumped(monkeypatch, [("r1:10", [11]), ("r1:14", [12]), ("r1:14", [13, 14, 15])])
    assert afters == [None, "r1:11", "r1:12"]
    assert [x["seq"] for x in lines if "seq" in x] == [11, 12, 13, 14, 15]


def test_a_record_carries_at_most_its_budget_of_a_pods_labels():
    """A pod may have any number of labels (CNI args and Kubernetes cap none in all): one of
    1,300 of the largest made a record of a MB, past what a gathering node reads as a line.
    A record's end carries at most LABELS_MAX bytes of them, in the pod's order, and says how
    many it left out; a filter still matches every label, and a pod of few labels is as before."""
    from agentd.flows.model import LABELS_MAX

    prefix = ".".join(c * 60 for c in "abcd") + ".example"  # 252 characters, the name 63: the largest keys
    labels = {f"{prefix}/{'n' * 57}{i:06d}": "v" * 63 for i in range(1300)}
    big = Identity("t/big", "node2", labels, True)
    f = Flow(1.0, "node2", "drop", "TCP", Peer("10.244.1.2", 1, big), Peer("10.244.2.3", 80, big), "local",
             verdict="dropped", reason="spoofed", sender=big, sender_interface="veth1")
    record = f.json()
    assert len(json.dumps(record)) < 4 * LABELS_MAX  # not 1.2 MB
    for end in (record["src"], record["dst"], record["sender"]):
        kept = end["labels"]
        assert list(kept) == list(labels)[: len(kept)] and end["labels_dropped"] == 1300 - len(kept)
        assert LABELS_MAX - 400 < len(json.dumps(kept)) <= LABELS_MAX
    last = list(labels)[-1]
    assert FlowFilter.parse([("label", f"{last}={'v' * 63}")]).matches(f)  # the filter sees them all
    small = flow().json()
    assert small["src"]["labels"] == dict(CLIENT.labels) and "labels_dropped" not in small["src"]


class _Chunks:
    """What aiohttp's StreamReader gives ``_lines``: the bytes in the chunks given."""

    def __init__(self, data: bytes, size: int) -> None:
        self.chunks = [data[i : i + size] for i in range(0, len(data), size)]

    async def iter_any(self):
        for chunk in self.chunks:
            yield chunk


async def test_a_line_past_the_limit_is_skipped_as_one_record_lost_however_it_is_cut(monkeypatch):
    from agentd.daemon import cluster

    monkeypatch.setattr(cluster, "LINE_MAX", 100)
    long = b'{"seq":7,"time":1.0,"node":"node2","labels":"' + b"x" * 300 + b'"}\n'
    data = b'{"seq":6}\n' + b"\n" + long + b"y" * 101 + b"\n" + b"z" * 100 + b"\n" + b'{"seq":8}'
    lost7 = b'{"seq":7,"node":"node2","lost":1,"why":"a record of more than 100 bytes, not read"}\n'
    lost = b'{"lost":1,"why":"a record of more than 100 bytes, not read","node":"node2"}\n'
    want = [b'{"seq":6}\n', b"\n", lost7, lost, b"z" * 100 + b"\n", b'{"seq":8}']
    for size in (1, 3, 64, 99, 100, 101, 4096):
        got = [line async for line in cluster._lines(_Chunks(data, size), "node2")]  # type: ignore[arg-type]
        assert got == want, size
    got = [line async for line in cluster._lines(_Chunks(long[:-1], 7), "node2")]  # type: ignore[arg-type]
    assert got == [lost7]  # cut off in the middle of it: still one record lost


async def test_a_followed_nodes_record_too_long_to_read_is_one_record_lost_and_the_stream_goes_on(monkeypatch):
    """A node (its agentd older than the labels' budget) sends records of 2 MB among small
    ones: the gatherer's read failed on the first (aiohttp's line limit), the stream was asked
    again after the record before it, and failed again, forever -- none of that node's later
    records came.  Now each is said lost, the next come, and a stream broken in the middle of
    one is asked again after it.  A node served on loopback, as the reviewer's probe did."""
    from aiohttp import web

    from agentd.daemon import cluster, observe_api
    from agentd.daemon.cluster import LAST_END, RING, ClusterView

    def record(seq, pad=0):
        return (json.dumps({"seq": seq, "time": 1000.0 + seq, "node": "node2", "event": "new", "verdict": "forwarded",
                            "protocol": "TCP", "src": {"ip": "10.0.0.1", "port": 1, "pod": "t/big",
                                                       "labels": {f"k{i:05d}": "v" * 50 for i in range(pad // 60)}},
                            "dst": {"ip": "10.0.0.2", "port": 80}}) + "\n").encode()

    asked: list[str | None] = []
    stay = asyncio.Event()

    async def flows(request):
        """Records 1 to 5, 2 and 4 of 2 MB; the first answer breaks in the middle of 4, an
        answer to a resume sends what follows its cursor and stays open.  Asked a fourth time
        (the same record asked for again and again), it answers 404: given up on."""
        after = request.query.get("after")
        asked.append(after)
        if len(asked) > 3:
            return web.json_response({"error": "asked too often"}, status=404)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", LAST_END: "empty-line", RING: "r1:0"})
        await resp.prepare(request)
        for seq in range(int(after.partition(":")[2]) + 1 if after else 1, 6):
            line = record(seq, 2_000_000 if seq in (2, 4) else 0)
            if after is None and seq == 4:
                await resp.write(line[: len(line) // 2])
                return resp
            await resp.write(line)
        await stay.wait()
        return resp

    app = web.Application()
    app.router.add_get("/flows", flows)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    monkeypatch.setattr(cluster, "unsafe_address", lambda address: None)  # the test's node is on loopback
    monkeypatch.setattr(observe_api, "RETRY_FIRST", 0.0)
    view = ClusterView("node1", lambda: {"node2": "127.0.0.1"}, port)
    view.token = "read-token"
    merge = observe_api._Merge()
    again = "/flows?node=node2&last=0&follow=1"
    task = asyncio.create_task(observe_api._pump_remote(
        view, "node2", again, merge, again=again, resume=lambda c: "/flows?node=node2&after=" + c + "&follow=1"))
    got = []
    try:
        while not any(r.get("seq") == 5 or "404" in r.get("error", "") for r in got):
            got.append(json.loads(await asyncio.wait_for(merge.queue.get(), 30)))  # a bound, not a pause
    finally:
        stay.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await view.close()
        await runner.cleanup()
    records = [r for r in got if "error" not in r]  # the break is said ("ended the stream")
    why = "a record of more than 1048576 bytes, not read"
    assert records == [json.loads(record(1)), {"seq": 2, "node": "node2", "lost": 1, "why": why}, json.loads(record(3)),
                       {"seq": 4, "node": "node2", "lost": 1, "why": why}, json.loads(record(5))]
    assert asked == [None, "r1:4"]  # asked again after the record it could not read, not for it


async def test_flows_after_a_cursor_are_the_records_made_after_it():
    from types import SimpleNamespace

    from aiohttp.test_utils import make_mocked_request

    from agentd.daemon import observe_api
    from agentd.daemon.cluster import RING
    from agentd.flows.views import FlowViews

    ring = FlowRing(10)
    for port in range(1, 6):
        ring.add(flow(port=port))
    views = FlowViews(SimpleNamespace(ring=ring))
    assert views.cursor() == f"{ring.id}:5"
    for after, ports in ((f"{ring.id}:3", [4, 5]), (f"{ring.id}:5", []), (f"{ring.id}:0", [1, 2, 3, 4, 5]),
                         ("another:3", [1, 2, 3, 4, 5])):  # another ring's: this node restarted since
        assert [f.dst.port for f in await views.last(FlowFilter(), 100, after=after)] == ports, after
    for _ in range(15):  # wrapped: what the ring still holds after the cursor
        ring.add(flow(port=9))
    assert [f.seq for f in await views.last(FlowFilter(), 100, after=f"{ring.id}:17")] == [18, 19, 20]
    assert views.search(FlowFilter(), 100, after=f"{ring.id}:17").scrolled == 0
    wrapped = views.search(FlowFilter(), 100, after=f"{ring.id}:7")  # 8, 9 and 10 are gone: the ring holds 11-20
    assert wrapped.scrolled == 3

    class Written:
        def __init__(self):
            self.lines = []

        async def write(self, data):
            self.lines.append(json.loads(data))

    out = Written()
    await observe_api._local_flows(out, views, wrapped, None)  # type: ignore[arg-type]
    assert out.lines[0] == {"lost": 3, "why": "made after the reader's last record, since scrolled out of the node's ring"}
    assert [x["seq"] for x in out.lines[1:]] == list(range(11, 21))

    class Resp:  # what a followed answer's headers say
        headers: ClassVar[dict] = {}

        def __init__(self, headers):
            Resp.headers = headers

        async def prepare(self, request):
            raise ConnectionResetError  # the reader went at once

    agent = SimpleNamespace(cluster_view=lambda: None, flows_view=lambda: views, node_name=lambda: "node1")
    handlers = observe_api._Handlers(agent, read_only=True, token_of=lambda: None)
    orig = observe_api.web.StreamResponse
    try:
        observe_api.web.StreamResponse = Resp
        await handlers.flows(make_mocked_request("GET", "/flows?follow=1&last=0"))
    finally:
        observe_api.web.StreamResponse = orig
    assert Resp.headers[RING] == f"{ring.id}:20"
    for query, message in (("after=5", "after: '5' is not a cursor"), ("after=r:x", "after: 'r:x' is not a cursor")):
        resp = await handlers.flows(make_mocked_request("GET", "/flows?" + query))
        assert resp.status == 400 and json.loads(resp.body)["error"].startswith(message)


async def test_a_resume_more_than_the_cap_behind_says_how_many_it_left_out(monkeypatch):
    """A resume returns at most the last MAX_LAST records after the cursor: those older than
    them that match are told as lost, before the records (N matching ones only), as the wrap's
    are; at most the cap after the cursor, or no cursor, is no such line."""
    from types import SimpleNamespace

    from agentd.daemon import observe_api
    from agentd.flows.views import FlowViews

    monkeypatch.setattr(observe_api, "MAX_LAST", 5)

    class Written:
        def __init__(self):
            self.lines = []

        async def write(self, data):
            self.lines.append(json.loads(data))

    async def answer(search):
        out = Written()
        await observe_api._local_flows(out, views, search, None)  # type: ignore[arg-type]
        return out.lines

    ring = FlowRing(100)
    for seq in range(1, 31):  # the odd ones to port 80, the even ones to 81
        ring.add(flow(port=80 + (seq + 1) % 2))
    views = FlowViews(SimpleNamespace(ring=ring))
    web = FlowFilter.parse([("port", "80")])
    why = "made after the reader's last record, left out: a resume returns at most the last 5"
    # After 10: 11, 13 ... 29 match (10 of them), the last 5 returned, 5 left out.
    lines = await answer(views.search(web, observe_api.MAX_LAST, after=f"{ring.id}:10"))
    assert lines[0] == {"lost": 5, "why": why}
    assert [x["seq"] for x in lines[1:]] == [21, 23, 25, 27, 29]
    lines = await answer(views.search(FlowFilter(), observe_api.MAX_LAST, after=f"{ring.id}:10"))
    assert lines[0] == {"lost": 15, "why": why}  # every record matches: 20 after the cursor
    assert [x["seq"] for x in lines[1:]] == [26, 27, 28, 29, 30]
    for after in (20, 21, 28, 30):  # 5, 4, 1, 0 matching after it: all returned, nothing said
        lines = await answer(views.search(web, observe_api.MAX_LAST, after=f"{ring.id}:{after}"))
        assert [x["seq"] for x in lines] == list(range(after + 1 + after % 2, 30, 2)), after  # no lost line
    lines = await answer(views.search(web, observe_api.MAX_LAST))  # the last N, no cursor: no gap to tell
    assert [x["seq"] for x in lines] == [21, 23, 25, 27, 29]
    lines = await answer(views.search(web, 2, after=f"{ring.id}:10"))  # a reader's own smaller last
    assert lines[0] == {"lost": 8, "why": why + " (this one asked for the last 2)"}
    # since still ends the search: only what was asked for is counted.
    for f in ring:
        f.time = float(f.seq)
    lines = await answer(views.search(web, observe_api.MAX_LAST, since=15.0, after=f"{ring.id}:10"))
    assert lines[0] == {"lost": 3, "why": why} and [x["seq"] for x in lines[1:]] == [21, 23, 25, 27, 29]
    # Wrapped past the cursor as well: both told, the scrolled ones first.
    for _ in range(80):
        ring.add(flow(port=80))
    lines = await answer(views.search(web, observe_api.MAX_LAST, after=f"{ring.id}:5"))
    assert lines[0]["lost"] == 5 and "scrolled out" in lines[0]["why"]  # 6-10 are gone: the ring holds 11-110
    assert lines[1] == {"lost": 10 + 75, "why": why}  # 11, 13 ... 29 and 31-105 left out
    assert [x["seq"] for x in lines[2:]] == [106, 107, 108, 109, 110]


async def test_a_gatherer_tells_a_resumes_lost_line_once_and_resumes_after_the_last_record_it_got(monkeypatch):
    """A resume answer's {"lost": N} line (left out or scrolled out) is passed on before its
    first record; broken off before that record, the stream is resumed after the same record,
    whose new answer tells what is lost anew: the first line is not told as well.  The cursor
    moves with the records that came, never past the ones left out."""
    why = "made after the reader's last record, left out: a resume returns at most the last 100000"
    afters, lines = await _pumped(monkeypatch, [("r1:10", [11, 12]), ("r1:20", [{"lost": 3, "why": why}]),
                                                ("r1:22", [{"lost": 5, "why": why}, 18, 19, 20]), ("r1:22", [21, 22])])
    assert afters == [None, "r1:12", "r1:12", "r1:20"]
    said = [x["seq"] if "seq" in x else x.get("lost", x.get("error")) for x in lines]
    assert said == [11, 12, "node2 unreachable: reset", 5, 18, 19, 20, 21, 22]
    assert lines[3] == {"lost": 5, "why": why, "node": "node2"}  # the merged stream is many nodes': whose


async def test_a_gatherer_names_the_node_whose_records_were_lost(monkeypatch):
    """In a gathered stream a {"lost": N} line says whose records they were: a node's own line
    (its follower fell behind the gatherer, no why) gets the node's name, and so does one that
    names another node (a node answers for itself alone); this node's follower falling behind the merged stream is
    a line naming this node.  A lost line that does not fit the merged queue counts its N."""
    from agentd.daemon import observe_api

    _afters, lines = await _pumped(monkeypatch, [("r1:10", [11, {"lost": 7}, 12, {"lost": 2, "node": "node9"}, 13])])
    assert [x for x in lines if "lost" in x] == [{"lost": 7, "node": "node2"}, {"lost": 2, "node": "node2"}]

    ring = FlowRing(100)

    class View:
        def follow(self, flt, pool):
            return ring.follow(flt, limit=2, pool=pool)

        def unfollow(self, follower):
            ring.unfollow(follower)

    merge = observe_api._Merge()
    task = asyncio.create_task(observe_api._pump_local(View(), FlowFilter(), merge, "node1"))
    await asyncio.sleep(0)

    def made(t):
        ring.add(Flow(time=t, node="node1", event="new", protocol="UDP", src=Peer("10.244.1.2", 1),
                      dst=Peer("10.244.2.3", 53), direction="egress"))

    for t in (1.0, 2.0, 3.0, 4.0, 5.0):  # two fit the follower's queue, three are lost there
        made(t)
    for _ in range(10):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    got = [json.loads(merge.queue.get_nowait()) for _ in range(merge.queue.qsize())]
    assert [x["time"] for x in got if "time" in x] == [1.0, 2.0]
    assert [x for x in got if "lost" in x] == [{"lost": 3, "node": "node1"}]
    assert merge.lost == 0

    full = observe_api._Merge(limit=1)
    full.put(b"{}\n")
    full.put(*observe_api._lost_at("node2", b'{"lost": 40, "why": "scrolled out"}'))
    assert full.lost == 40


@pytest.mark.parametrize("line", [b'{"lost": Infinity}', b'{"lost": 1e400}', b'{"lost": "many"}', b'{"lost": 2'])
def test_a_lost_line_no_agentd_sends_is_passed_on_as_it_came(line):
    # Infinity raised OverflowError out of the remote pump: the node's stream ended unsaid.
    from agentd.daemon import observe_api

    assert observe_api._lost_at("node2", line) == (line, 1)


def test_a_services_endpoint_with_no_route_is_a_no_route_record_from_the_error_the_node_sends():
    """The Services translate after the no-route check; a translated first packet the kernel
    has no route for gets its ICMP error (net/host unreachable; ICMPv6 no route; not
    admin-prohibited, which firewalls' REJECT rules send too) carrying its conntrack entry, translated and never confirmed.  The
    output chain (the node's own packets only: no rule on a forwarded packet's way) sends that
    error, on its way to a pod bridge, through the no-route chain.  The record is the dropped
    packet's: from its conntrack entry (the pod, the endpoint, the Service) or, without one,
    as the error quotes it."""
    from agentd.daemon.flow_directory import FlowDirectory

    eng = PolicyEngine("node1", families=(4, 6), drop_log=DropLog(5))
    eng.upsert_pod(Pod("x", "a", "node1", (IPv4Address("10.244.1.2"),), {}), LocalPort("veth0", "02:00:00:00:00:01", "cni0"))
    out = eng.build().objects[("inet", policy_compiler.TABLE, "chain", "output")]
    assert out.hook == ("filter", "output", 0, "accept")  # type: ignore[union-attr]
    rules = [json.loads(r) for r in out.rules if "no-route" in r]  # type: ignore[union-attr]
    assert len(rules) == 2  # one per family
    for rule, (icmp, codes) in zip(rules, [("icmp", ["net-unreachable", "host-unreachable"]),
                                           ("icmpv6", ["no-route"])]):
        assert rule[0] == {"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": "@bridges"}}
        assert rule[1]["match"]["left"] == {"payload": {"protocol": icmp, "field": "type"}}
        assert rule[2]["match"]["right"] == {"set": codes}
        assert rule[3] == {"match": {"op": "==", "left": {"&": [{"ct": {"key": "status"}}, ["dnat", "confirmed"]]},
                                     "right": "dnat"}}  # translated, never confirmed: it did not leave
        assert rule[4] == {"jump": {"target": "no-route"}}
    quiet = PolicyEngine("node1", families=(4,)).build().objects[("inet", policy_compiler.TABLE, "chain", "output")]
    assert not any("no-route" in r for r in quiet.rules)  # type: ignore[union-attr]

    d = FlowDirectory(None, None, (None, None))
    d.service = lambda ip, proto, port: "shop/nowhere" if (ip, proto, port) == ("10.96.0.9", 17, 9) else None
    r = FlowRecorder("node1", d, "/nonexistent", group=5, clock=lambda: 1.0)
    error = ("no-route", socket.AF_INET, 0.0, 0, 3, 1, "10.244.1.1", "10.244.1.2", 1, 3, 0)
    entry = (ct.CtTuple("10.244.1.2", "10.96.0.9", 17, 40000, 9), ct.CtTuple("10.244.200.7", "10.244.1.2", 17, 8080, 40000))
    flow = r.dropped(nflog.Packet(*error, orig_dst=("10.96.0.9", 9), dnat=entry))
    assert flow is not None and (flow.reason, flow.protocol, flow.direction) == ("no-route", "UDP", "egress")
    assert (flow.src.ip, flow.src.port, flow.dst.ip, flow.dst.port) == ("10.244.1.2", 40000, "10.244.200.7", 8080)
    assert (flow.service, flow.service_ip, flow.service_port) == ("shop/nowhere", "10.96.0.9", 9)
    flow = r.dropped(nflog.Packet(*error[:6], "10.244.1.1", "10.244.1.2", 1, 3, 1,
                                  quoted=("10.244.1.2", "10.244.200.7", 6, 40001, 8080)))
    assert flow is not None and (flow.protocol, flow.src.port, flow.dst.ip, flow.dst.port) == ("TCP", 40001, "10.244.200.7", 8080)
    # An error quoting the dropped packet, read from the log's bytes.
    def ip4(src, dst, proto, payload):
        return struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), 1, 0, 64, proto, 0,
                           socket.inet_aton(src), socket.inet_aton(dst)) + payload

    inner = ip4("10.244.1.2", "10.244.200.7", 17, struct.pack("!HHHH", 40000, 8080, 9, 0) + b"x")
    outer = ip4("10.244.1.1", "10.244.1.2", 1, bytes.fromhex("0300000000000000") + inner)
    assert nflog.quoted_summary(outer, 0, len(outer)) == ("10.244.1.2", "10.244.200.7", 17, 40000, 8080)
    assert nflog.quoted_summary(outer[:20] + b"\x08" + outer[21:], 0, len(outer)) is None  # an echo request quotes nothing


def test_an_icmpv6_error_whose_header_chain_is_cut_quotes_nothing():
    """A logged IPv6 packet whose extension headers run past its end (or a later fragment) has
    no upper layer to read: no quoted packet, never an exception (found by fuzzing)."""
    from agentd.kernel.netlink_log import quoted_summary

    for hexed in ("60122a0d75e53c0535bbdb56692ce107e898c6c01c1f84d99ddd10d08d912bcf7d77728c94bf29fc3ac1b6ceaf0682d9b3e630a8a0",
                  "60b7502b0c248bccf9464a7a7cca968058604192202eb60a771919ddb207ae442023317d4c43aeae3adac8ee32fa841afb1602"):
        packet = bytes.fromhex(hexed)
        assert quoted_summary(packet, 0, len(packet)) is None


def test_the_nodes_own_addresses_in_its_pod_subnets_are_the_gateway_and_the_broadcast():
    """What the recorder is told is the node's own, no pod's (agentd.cni.netconf: the bridge
    takes the subnet's first host)."""
    from agentd.daemon.observe import own_addresses

    assert own_addresses([IPv4Network("10.244.179.0/24"), IPv6Network("fd00:10:244:179::/64")]) == [
        IPv4Address("10.244.179.1"), IPv4Address("10.244.179.255"), IPv6Address("fd00:10:244:179::1")]
    assert own_addresses([]) == []


class _Claims(_Registry):
    """Each node answers ``last`` records and the empty line that ends them, then one followed
    record, then stays open; node3 says its records (and its status) are node2's."""

    def __init__(self, names):
        super().__init__(names)
        self.more = asyncio.Event()

    def named(self, node):
        return "node2" if node == "node3" else node

    async def lines(self, node, path, *, follow=False, blanks=False, **_):
        from urllib.parse import parse_qs, urlsplit

        self.asked.append((node, path))
        for i in range(int(parse_qs(urlsplit(path).query)["last"][0])):
            yield json.dumps({"seq": i + 1, "time": float(i), "node": self.named(node)}).encode() + b"\n"
        if blanks:
            yield b"\n"
        await self.more.wait()
        yield json.dumps({"seq": 1000, "time": 1000.0, "node": self.named(node)}).encode() + b"\n"
        await asyncio.Event().wait()

    async def get_json(self, node, path):
        return {"node": {"name": self.named(node)}, "ready": True}

    async def gather(self, path, local, nodes=None):
        return {name: (local() if name == "node1" else await self.get_json(name, path)) for name in self.nodes()}


def _held_by_snapshots() -> int:
    import gc

    from agentd.daemon import observe_api

    return sum(len(o.lines) for o in gc.get_objects() if isinstance(o, observe_api._Snapshot))


async def test_a_followed_cluster_holds_no_nodes_last_records_once_sent_and_takes_no_node_for_another():
    """A followed cluster stream with last=N: each node's last N are held until they are merged
    (then let go: not N per node for the stream's life) and never more than N of a node.  A
    node answers for itself alone: records (last or followed) naming another node are left out,
    said once, and never shown as that node's."""

    from agentd.daemon import observe_api

    def merged(written: list[dict]) -> None:
        assert sum(1 for x in written if "time" in x) == 300  # the cluster's last 300
        assert _held_by_snapshots() == 0

    registry = _Claims(["node1", "node2", "node3", "node4"])
    written = await _follow_cluster(registry, FlowFilter(), 300, steps=50, between=merged)
    assert {x["node"] for x in written if "time" in x} == {"node2", "node4"}
    assert sum(1 for x in written if x.get("seq") == 1000) == 2  # node2's and node4's followed one
    errors = [x for x in written if "error" in x]
    assert [x["node"] for x in errors] == ["node1", "node3"], errors  # node1: flow records off here
    assert "records of node 'node2', not its own" in errors[1]["error"]

    snapshot = observe_api._Snapshot(2)  # a node that sends more than it was asked for
    for i in range(5):
        snapshot.add(b"%d\n" % i)
    assert snapshot.take() == [b"0\n", b"1\n"] and not snapshot.lines


async def test_a_followed_node_whose_records_name_another_is_said_once_and_left_out(monkeypatch):
    from agentd.daemon import observe_api

    registry = _Claims(["node1", "node3"])
    registry.more.set()
    merge = observe_api._Merge()
    task = asyncio.create_task(observe_api._pump_remote(registry, "node3", "/flows?node=node3&last=3&follow=1", merge))
    for _ in range(50):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    got = [json.loads(merge.queue.get_nowait()) for _ in range(merge.queue.qsize())]
    assert got == [{"node": "node3", "error": "node3 answered with records of node 'node2', not its own: left out"}]


async def test_the_cluster_view_shows_no_nodes_status_as_anothers():
    from types import SimpleNamespace

    from agentd.daemon import observe_api

    registry = _Claims(["node1", "node2", "node3"])
    agent = SimpleNamespace(cluster_view=lambda: registry, node_name=lambda: "node1",
                            status=lambda: {"node": {"name": "node1"}, "ready": True})  # fmt: skip
    handlers = observe_api._Handlers(agent, read_only=False, token_of=lambda: None)
    handlers._may_gather = lambda request: True  # type: ignore[method-assign]
    resp = await handlers.cluster(None)  # type: ignore[arg-type]
    nodes = json.loads(resp.body)["nodes"]
    assert nodes["node1"]["status"]["node"]["name"] == "node1" and nodes["node2"]["status"]["node"]["name"] == "node2"
    assert nodes["node3"] == {"address": "192.0.2.1", "error": "node3's address answered as node 'node2'"}


async def test_a_node_whose_last_records_stall_holds_none_of_them_for_the_streams_life():
    """Its last N said unreachable (part came, then nothing for TIMEOUT: the snapshot ended with
    that error): what came is let go then, not held while the stream follows on."""
    from types import SimpleNamespace

    from agentd.daemon import observe_api

    registry = _Registry(["node1", "node2"])
    agent = SimpleNamespace(cluster_view=lambda: registry, flows_view=lambda: None, node_name=lambda: "node1")
    handlers = observe_api._Handlers(agent, read_only=False, token_of=lambda: None)
    snapshot = observe_api._Snapshot(100)
    for i in range(5):
        snapshot.add(json.dumps({"seq": i + 1, "time": float(i), "node": "node2"}).encode() + b"\n")
    snapshot.end("node2 unreachable: nothing for 3s")
    records, errors = await handlers._gather_last(["node2"], FlowFilter(), 100, None, {"node2": snapshot})
    assert (records, errors) == ([], {"node2": "node2 unreachable: nothing for 3s"})
    assert not snapshot.lines


async def test_a_nodes_record_naming_another_leaves_out_that_record_only():
    """Asked its last records (no follow): a record naming another node is left out and said
    once; the node's records before and after it are kept."""
    from types import SimpleNamespace

    from agentd.daemon import observe_api

    class Mixed(_Registry):
        async def lines(self, node, path, **_):
            for i, who in enumerate(["node3", "node2", "node3", "node2", "node3"]):
                yield json.dumps({"seq": i + 1, "time": float(i), "node": who}).encode() + b"\n"

    registry = Mixed(["node1", "node3"])
    agent = SimpleNamespace(cluster_view=lambda: registry, flows_view=lambda: None, node_name=lambda: "node1")
    handlers = observe_api._Handlers(agent, read_only=False, token_of=lambda: None)
    resp = _Stream()
    await handlers._cluster_flows(resp, FlowFilter(), 10, None, False)
    written = [json.loads(line) for line in resp.lines if line.strip()]
    assert [x["seq"] for x in written if "time" in x] == [1, 3, 5]
    assert [x for x in written if x.get("node") == "node3" and "error" in x] == [
        {"node": "node3", "error": "node3 answered with records of node 'node2', not its own: left out"}]


def test_a_cluster_answers_newest_hold_at_most_their_byte_budget():
    """Records of large label sets are up to LINE_MAX each: the cluster's last N hold at most
    ``max_bytes`` of them, the oldest going first, counted."""
    from agentd.daemon.observe_api import _Newest

    newest = _Newest(100, max_bytes=25)
    for when in (3.0, 1.0, 2.0, 5.0, 4.0):
        newest.add(when, b"%.1f......\n" % when)  # 10 bytes each
    assert [line[:3] for line in newest.oldest_first()] == [b"4.0", b"5.0"]
    assert newest.bytes == 20 and newest.dropped == 3
    one = _Newest(2, max_bytes=25)  # replaced in the heap: the bytes follow the line it holds now
    for when in (1.0, 2.0, 3.0, 4.0):
        one.add(when, b"x" * 10)
    assert one.bytes == 20 and one.dropped == 0 and len(one.heap) == 2


def test_a_record_older_than_one_dropped_for_the_byte_budget_is_dropped_too():
    """Once the byte budget dropped a record, an older one that would fit now is not taken
    back in: the answer would have a gap in its middle while its lost line says only the
    oldest were left out."""
    from agentd.daemon.observe_api import _Newest

    newest = _Newest(10, max_bytes=100)
    newest.add(10.0, b"N" * 90)  # the newest, big (labels)
    newest.add(9.0, b"m" * 20)  # over the budget: dropped
    newest.add(8.0, b"o" * 5)  # older than the one dropped: dropped too
    assert newest.oldest_first() == [b"N" * 90] and newest.dropped == 2 and newest.bytes == 90
    newest.add(11.0, b"p" * 5)  # newer: taken
    assert newest.oldest_first() == [b"N" * 90, b"p" * 5] and newest.dropped == 2


def test_the_nodes_last_records_share_one_byte_budget_while_they_wait_to_be_merged():
    from agentd.daemon.observe_api import _Held, _Snapshot

    held = _Held(30)
    a, b = _Snapshot(100, held), _Snapshot(100, held)
    for i in range(2):
        a.add(b"a%d.......\n" % i)  # 10 bytes each
    b.add(b"b0.......\n")
    assert held.used == 30 and not a.dropped and not b.dropped
    b.add(b"b1.......\n")  # over: this node's oldest goes
    assert [line[:2] for line in b.lines] == [b"b1"] and b.dropped == 1 and held.used == 30
    assert [line[:2] for line in a.take()] == [b"a0", b"a1"] and held.used == 10 and not a.lines


async def test_a_gathered_last_n_over_its_byte_budget_says_what_it_left_out(monkeypatch):
    from types import SimpleNamespace

    from agentd.daemon import observe_api

    class Many(_Registry):
        async def lines(self, node, path, **_):
            for i in range(10):
                yield json.dumps({"seq": i + 1, "time": float(i), "node": node, "pad": "x" * 60}).encode() + b"\n"

    monkeypatch.setattr(observe_api, "LAST_BYTES", 400)
    registry = Many(["node1", "node2", "node3"])
    agent = SimpleNamespace(cluster_view=lambda: registry, flows_view=lambda: None, node_name=lambda: "node1")
    handlers = observe_api._Handlers(agent, read_only=False, token_of=lambda: None)
    snapshot = observe_api._Snapshot(100, observe_api._Held())
    lines = [json.dumps({"seq": i + 1, "time": i + 0.5, "node": "node3", "pad": "x" * 60}).encode() + b"\n"
             for i in range(10)]
    for one in lines:
        snapshot.add(one)
    fit = 400 // len(lines[0])  # the newest that fit the budget
    assert snapshot.dropped == 10 - fit and list(snapshot.lines) == lines[-fit:]
    snapshot.end()
    records, errors = await handlers._gather_last(["node2", "node3"], FlowFilter(), 100, None, {"node3": snapshot})
    got = [json.loads(line) for line in records]
    lost = [r for r in got if "lost" in r]
    kept = [r for r in got if "time" in r]
    assert lost[0] == {"lost": 10 - fit, "node": "node3", "why": "its oldest last records, over the 400 bytes a gathering holds of them"}
    assert lost[1]["lost"] + len(kept) == 10 + fit and "node" not in lost[1]  # node2's 10 and node3's, merged
    assert sum(len(line) for line in records[2:]) <= 400
    assert [r["time"] for r in kept] == sorted(r["time"] for r in kept) and kept[-1]["time"] == 9.5
    assert errors == {}


# ------------------------------------------------------------------ review r5: what waits in the ring, the sweep, bounds


def test_events_waiting_in_the_ring_hold_their_services_name_not_every_snapshot_of_the_services():
    """Each sync of the services agent (any Service's or endpoint's change in the cluster) makes
    a new snapshot of the Services (a dict of every Service port); an event waiting unread in
    the ring keeps its Service's name, not the snapshot: 500 reads of one event, a sync before
    each, hold well under 2 MB -- not the 162 MB every snapshot held alive did -- and a record
    read later still names the Service of when its event came."""
    import gc
    import tracemalloc
    from types import SimpleNamespace as NS

    from agentd.daemon.flow_directory import FlowDirectory

    def port(i, name=None):
        return NS(namespace=f"ns{i % 50}", service=name or f"svc-{i}", cluster_ip=f"10.96.{i // 250}.{i % 250}",
                  protocol="TCP", port=80, node_port=None)

    agent = NS(syncs=0, compiled_ports=[port(i) for i in range(2000)])
    d = FlowDirectory(None, agent, ("192.0.2.1",))
    d.identity = lambda ip: None
    r = FlowRecorder("n1", d, "/nonexistent", group=1, ring_size=10_000, clock=lambda: 1000.0,
                     pods=[ip_network("10.244.0.0/16")], services=[ip_network("10.96.0.0/12")])
    msg = destroy_event(ct.IPS_DST_NAT)  # to 10.96.0.10:80, svc-10's
    tracemalloc.start()
    try:
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        for i in range(500):
            agent.compiled_ports = list(agent.compiled_ports)
            agent.compiled_ports[10] = port(10, f"svc-10-v{i}")  # a Service changed: a new snapshot
            agent.syncs += 1
            r._on_conntrack_datagrams([msg], 1000.0 + i)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(r.ring) == 500 and held < 2_000_000, held
    first, last = r.ring.last(FlowFilter(), 500)[0], r.ring.last(FlowFilter(), 500)[-1]
    assert (first.service, last.service) == ("ns10/svc-10-v0", "ns10/svc-10-v499")


def test_conntracks_timeouts_read_again_unchanged_are_the_same_dict():
    """What an event waiting in the ring holds of conntrack's timeouts is one dict while they
    stay the same (read again every second)."""
    import tempfile
    from pathlib import Path

    from agentd.flows.recorder import ConntrackTimeouts

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "nf_conntrack_udp_timeout").write_text("30\n")
        now = [0.0]
        t = ConntrackTimeouts(Path(tmp), clock=lambda: now[0], release="6.1.0")
        first = t()
        now[0] = 5.0
        assert t() is first and first == {"udp_timeout": 30}
        (Path(tmp) / "nf_conntrack_udp_timeout").write_text("20\n")
        now[0] = 10.0
        assert t() == {"udp_timeout": 20}


def test_a_malformed_answer_from_conntrack_skips_one_key_and_the_next_sweep_ends_it():
    """A conntrack look-up whose answer cannot be read (nl.NetlinkDecodeError, a ValueError)
    leaves that key for the next sweep, which ends it."""
    now = 1_000 * 10**9
    key, value = _conn(False, CONN_OPEN, 0, 0)  # idle for ages: conntrack is asked
    r = recorder()
    r.recording = Programs({key: value})
    calls = []

    def held(k):
        calls.append(k)
        if len(calls) == 1:
            raise nl.NetlinkDecodeError("NLMSG_ERROR body is 4 bytes, needs 20")
        return False

    r._held = held
    assert r.sweep(now) == [] and key in r.recording.held
    (end,) = r.sweep(now + 1)
    assert CONN_RECORD.unpack(end)[:2] == (key, REC_GONE) and r.recording.held == {}


def test_the_sweep_task_goes_on_after_a_sweep_fails_unexpectedly(monkeypatch):
    """Nobody awaits the sweep's task: one sweep's unexpected exception (a bug) is logged and
    the next sweep comes all the same."""
    from agentd.flows import recorder as rec_mod

    class Stop(BaseException):
        pass

    sleeps = []

    async def sleep(_s):
        sleeps.append(_s)
        if len(sleeps) > 3:
            raise Stop

    async def to_thread(fn, *a):
        return fn(*a)

    monkeypatch.setattr(rec_mod.asyncio, "sleep", sleep)
    monkeypatch.setattr(rec_mod.asyncio, "to_thread", to_thread)
    r = recorder()
    swept = []

    def sweep():
        swept.append(1)
        if len(swept) == 1:
            raise RuntimeError("dictionary changed size during iteration")
        return []

    r.sweep = sweep
    r.recording = programs = Programs({})  # it runs while the programs record (or leftovers wait)
    programs.recorded_lost = lambda: 0  # type: ignore[attr-defined]
    with pytest.raises(Stop):
        asyncio.run(r._sweep_loop())
    assert len(swept) == 3


def test_a_connection_that_cannot_be_put_back_leaves_held_at_alone():
    """end_resets puts back on the loop's thread while a sweep's thread may rebuild _held_at:
    putting back never touches that dict (a sweep forgets what the programs no longer hold)."""
    from types import MappingProxyType

    key, value = _conn(False, CONN_OPEN, 5, 6)

    class Full(Programs):
        def put_recorded(self, key, value):
            raise OSError(7, "Argument list too long")

    r = recorder()
    r._held_at = MappingProxyType({key: (5, 1)})  # read-only: a change would raise
    out: list[bytes] = []
    r._put_back(Full({}), key, value, CONN_VALUE.unpack(value), out)
    assert [CONN_RECORD.unpack(x)[:2] for x in out] == [(key, REC_GONE)]


def test_each_conntrack_look_up_has_its_own_sequence_number():
    """A late answer to a look-up that timed out is not taken for the next one's: each asks
    with a sequence number of its own (NetlinkSocket.request matches answers by it)."""
    seqs = []

    class Sock:
        def request(self, message, what, dump):
            seqs.append(struct.unpack_from("=IHHI", message)[3])
            return []

    r = recorder()
    r._get_sock = Sock()
    key, _v = _conn(False, CONN_OPEN, 0, 0)
    assert r._held(key) and r._held(key)
    assert len(set(seqs)) == 2 and 0 not in seqs


@pytest.mark.parametrize("fast", [True, False])
def test_an_event_malformed_after_its_tuples_is_counted_when_read(fast):
    """An event whose tuples read at fixed offsets but whose later attributes are malformed (a
    CTA_STATUS of 2 bytes) is counted in ``malformed`` when it is read, not when (if ever) its
    record is made; the good ones around it are kept."""
    if fast and ct.fast_events is None:
        pytest.skip("agentd/kernel/_ctevents.c not built")
    r = recorder()
    r.fast = fast
    body = (_tuple(ct.CTA_TUPLE_ORIG, "10.244.1.2", "10.244.2.3", 6, 40000, 80)
            + _tuple(ct.CTA_TUPLE_REPLY, "10.244.2.3", "10.244.1.2", 6, 80, 40000)
            + nl.attr(ct.CTA_STATUS, b"\x00\x00"))
    bad = nl.encode_nfgen(ct.MSG_NEW, 0, 0, socket.AF_INET, body)
    r._on_conntrack_datagrams([destroy_event(ct.IPS_DST_NAT), bad, destroy_event(ct.IPS_DST_NAT)], 1000.0)
    assert r.malformed == 1 and len(r.ring) == 2
    assert [f.service for f in r.ring] == ["shop/web", "shop/web"] and r.malformed == 1


@pytest.mark.parametrize("nested", [b"", nl.nested(ct.CTA_TIMESTAMP, nl.attr(ct.CTA_TIMESTAMP_START, b"\x00" * 4)),
                                    nl.nested(ct.CTA_COUNTERS_ORIG, nl.attr(ct.CTA_COUNTERS_BYTES, b"\x00" * 2)),
                                    nl.nested(ct.CTA_PROTOINFO, nl.nested(ct.CTA_PROTOINFO_TCP,
                                                                          nl.attr(ct.CTA_PROTOINFO_TCP_STATE, b"\x00\x00"))),
                                    nl.attr(ct.CTA_TIMESTAMP_EVENT, b"\x00" * 4), b"\x30\x00\x03\x00"])
def test_what_follows_the_tuples_is_checked_in_c_and_in_python_as_decode_event_reads_it(nested):
    """Both loops send an event the long way exactly where decode_event refuses it."""
    body = (_tuple(ct.CTA_TUPLE_ORIG, "10.244.1.2", "10.244.2.3", 6, 40000, 80)
            + _tuple(ct.CTA_TUPLE_REPLY, "10.244.2.3", "10.244.1.2", 6, 80, 40000)
            + nl.attr(ct.CTA_STATUS, struct.pack("!I", 8)) + nested)
    msg = nl.encode_nfgen(ct.MSG_DELETE, 0, 0, socket.AF_INET, body)
    try:
        ct.decode_event(ct.MSG_DELETE, msg, nl.NLMSG_HDRLEN, len(msg))
        good = True
    except nl.NetlinkDecodeError:
        good = False
    assert good == (nested == b"")
    r = recorder()
    ways = [False] + ([True] if ct.fast_events is not None else [])
    for fast in ways:
        r.fast = fast
        (item,) = r._decode([msg])
        assert (type(item) is bytes) == (not good), fast


@pytest.mark.parametrize("fast", [True, False])
def test_the_pad_before_cta_timestamp_event_is_skipped_in_c_and_in_python(fast):
    """The kernel writes CTA_TIMESTAMP_EVENT with nla_put_be64(.., CTA_TIMESTAMP_PAD): where
    64-bit access must be aligned, an empty attribute of type 3 -- CTA_STATUS's number among the
    event's own -- comes before it.  A pad, not a CTA_STATUS (the kernel never sends an empty
    one): the event is read, its status kept, in both loops."""
    assert not fast or ct.fast_events is not None, "agentd/kernel/_ctevents.c is not built (scripts/dev setup)"
    body = (_tuple(ct.CTA_TUPLE_ORIG, "10.244.1.2", "10.96.0.10", 6, 40000, 80)
            + _tuple(ct.CTA_TUPLE_REPLY, "10.244.2.3", "10.244.1.2", 6, 8080, 40000)
            + nl.attr(ct.CTA_STATUS, struct.pack("!I", ct.IPS_DST_NAT)) + nl.attr(ct.CTA_ID, struct.pack("!I", 7))
            + nl.attr(ct.CTA_TIMESTAMP_PAD, b"") + nl.attr(ct.CTA_TIMESTAMP_EVENT, struct.pack("!Q", 10**12)))
    msg = nl.encode_nfgen(ct.MSG_DELETE, 0, 0, socket.AF_INET, body)
    ev = ct.decode_event(ct.MSG_DELETE, msg, nl.NLMSG_HDRLEN, len(msg))
    assert ev is not None and ev.status == ct.IPS_DST_NAT and ev.event_ns == 10**12
    r = recorder()
    r.fast = fast
    (item,) = r._decode([msg])
    assert type(item) is not bytes, "sent the long way, as if malformed"  # read at fixed offsets
    r._on_conntrack_datagrams([msg], 1000.0)
    assert r.malformed == 0 and [f.service for f in r.ring] == ["shop/web"]


@pytest.mark.parametrize("fast", [True, False])
def test_an_event_mixing_ipv4_and_ipv6_in_a_tuple_is_malformed_and_the_rest_of_the_read_kept(fast):
    if fast and ct.fast_events is None:
        pytest.skip("agentd/kernel/_ctevents.c not built")

    def tup(kind, src, dst, sport, dport):
        ip = nl.attr(ct.CTA_IP_V4_SRC, socket.inet_aton(src)) + nl.attr(ct.CTA_IP_V6_DST, socket.inet_pton(socket.AF_INET6, dst))
        proto = (nl.attr(ct.CTA_PROTO_NUM, bytes([6])) + nl.attr(ct.CTA_PROTO_SRC_PORT, struct.pack("!H", sport))
                 + nl.attr(ct.CTA_PROTO_DST_PORT, struct.pack("!H", dport)))
        return nl.nested(kind, nl.nested(ct.CTA_TUPLE_IP, ip), nl.nested(ct.CTA_TUPLE_PROTO, proto))

    r = recorder()
    r.fast = fast
    r.directory.ids = dict(r.directory.ids, **{"fd00::3": WEB})
    r.carried = type("C", (), {"carried_restarts": lambda s: [], "take_carried": lambda s, k: None})()
    body = (tup(ct.CTA_TUPLE_ORIG, "10.244.1.2", "fd00::3", 1, 2) + tup(ct.CTA_TUPLE_REPLY, "10.244.1.2", "fd00::3", 2, 1)
            + nl.attr(ct.CTA_STATUS, struct.pack("!I", 0)))
    odd = nl.encode_nfgen(ct.MSG_DELETE, 0, 0, socket.AF_INET, body)
    r._on_conntrack_datagrams([destroy_event(0), odd, destroy_event(0)], 1000.0)
    assert len(r.ring) == 2 and r.malformed == 1


TAI = 37 * 10**9  # CLOCK_TAI - CLOCK_REALTIME where leap-second data is loaded


@pytest.mark.parametrize("way", ["c", "python", "ipv6"])
def test_a_conntrack_end_is_named_across_a_change_of_hands_in_tai_with_a_tai_offset(way):
    """The history of changes is in CLOCK_TAI, conntrack's stamps in real time: with a TAI
    offset of 37 s, an entry made 10 s before the change names whom the address named then, one
    made 10 s after whom it names now -- at fixed offsets (C, Python) and the long way (IPv6)."""
    if way == "c" and ct.fast_events is None:
        pytest.skip("agentd/kernel/_ctevents.c not built")
    client, web = ("fd00:244:1::2", "fd00:244:2::3") if way == "ipv6" else ("10.244.1.2", "10.244.2.3")
    family = socket.AF_INET6 if way == "ipv6" else socket.AF_INET
    clock = [1000.0]
    r = FlowRecorder("node2", Directory(), "/nonexistent", group=143, clock=lambda: clock[0])
    r.tai_offset = lambda: TAI
    r.fast = way == "c"
    version = [1]
    r.directory.version = lambda: version[0]
    r.directory.ids = {client: CLIENT, web: WEB}
    r._begin_names()
    clock[0] = 1100.0  # the client pod deleted, its address another pod's: seen at 1100 (real)
    r.directory.ids = {client: Identity("other/newpod", "node1", {}, False), web: WEB}
    version[0] = 2
    r._begin_names()
    before = _entry_event(ct.MSG_DELETE, client, web, family, started=1_090 * 10**9)
    after = _entry_event(ct.MSG_DELETE, client, web, family, started=1_110 * 10**9)
    r._on_conntrack_datagrams([before, after], 1200.0)
    b, a = list(r.ring)
    assert b.src.identity == CLIENT and a.src.identity.pod == "other/newpod"


def test_a_change_of_hands_the_engine_timed_is_in_tai_with_a_tai_offset():
    """A change the policy engine timed (its ``when``, real time) is kept in CLOCK_TAI: with a
    TAI offset of 37 s, a connection started 10 s before it names the pod before, one started
    10 s after the pod after."""
    from ipaddress import ip_address
    from types import SimpleNamespace as NS

    from agentd.daemon.flow_directory import FlowDirectory

    a = ip_address("10.244.1.2")
    at = socket.inet_aton("10.244.1.2")
    eng = PolicyEngine("node2")
    clock = [1000.0]
    eng.clock = lambda: clock[0]
    eng.upsert_pod(Pod("shop", "client", "node1", (a,), {"app": "client"}))
    r = FlowRecorder("node2", FlowDirectory(NS(engine=eng), None, ()), "/nonexistent", group=143,
                     clock=lambda: clock[0])
    r.tai_offset = lambda: TAI
    r._begin_names()
    clock[0] = 1010.0
    eng.remove_pod(("shop", "client"))
    eng.upsert_pod(Pod("other", "newpod", "node1", (a,), {}))
    clock[0] = 1030.0
    r._begin_names()
    named = r.directory.identity("10.244.1.2")
    assert r._named_then(at, 1000 * 10**9 + TAI, named).pod == "shop/client"
    assert r._named_then(at, 1020 * 10**9 + TAI, named).pod == "other/newpod"


def test_the_agents_tables_stay_within_their_bounds(monkeypatch):
    """Carried counts waiting for their end (RESTARTS_MAX), addresses that changed hands
    (HISTORY_MAX), resets waiting (RESETS_MAX) and names remembered (NAMES_MAX): one past each
    bound, the oldest is let go (or the newest left out: a reset hint, the sweep's then)."""
    from agentd.flows import recorder as rec_mod

    monkeypatch.setattr(rec_mod, "RESTARTS_MAX", 3)
    monkeypatch.setattr(rec_mod, "HISTORY_MAX", 3)
    monkeypatch.setattr(rec_mod, "RESETS_MAX", 3)
    monkeypatch.setattr(rec_mod, "NAMES_MAX", 3)
    r = recorder()
    keys = [bytes([k]) * 12 for k in range(4)]
    for k in keys:
        r._wait(k, (1, 1, 1, 1, 1), True)
    assert list(r._restarts) == keys[1:]
    r.note_resets([(k, 5) for k in keys])
    assert list(r._reset_due) == keys[:3]
    r.note_resets([(keys[0], 9)])  # a later RST of one waiting: still taken
    assert r._reset_due[keys[0]] == 9 + RESET_TIMEOUT_NS + 1
    # Names: past NAMES_MAX, forgotten at the next read (the pods unchanged); up to it, kept.
    r._begin_names()
    for k in range(3):
        r._name(bytes([10, 244, 9, k]))
    r._begin_names()
    assert len(r._names) == 3
    r._name(bytes([10, 244, 9, 3]))
    r._begin_names()
    assert r._names == {}
    # Addresses that changed hands: one past HISTORY_MAX, the first forgotten.
    version = [1]
    r.directory.version = lambda: version[0]
    ips = [f"10.244.9.{k}" for k in range(4)]
    r.directory.ids = {ip: CLIENT for ip in ips}
    r._begin_names()
    for ip in ips:
        del r.directory.ids[ip]
        version[0] += 1
        r._begin_names()
    assert list(r._history) == [socket.inet_aton(ip) for ip in ips[1:]]


def test_the_limiter_evicts_a_quiet_key_whose_bucket_refilled_before_one_still_empty():
    """A new key past max_keys evicts a quiet key whose bucket refilled (forgetting it loses
    nothing) before one still empty, wherever they are in the table."""
    lim = DropLimiter(rate=1.0, burst=1, max_keys=2)
    assert lim.allow("empty", 5.0) == 0  # its token spent at 5.0: 0.5 of one back at 5.5
    assert lim.allow("refilled", 3.0) == 0  # a little out of order: its token back by 4.0
    assert lim.allow("new", 5.5) == 0
    assert list(lim.buckets) == ["empty", "new"]


def test_an_end_the_sweep_found_gone_is_timed_when_it_was_found():
    """A recorded connection the sweep found no longer held by conntrack (REC_GONE) ends when
    it was found (``received``), not at its last packet; other ends at their last packet."""
    key, value = _conn(False, CONN_OPEN, 1_000 * 10**9, 1_010 * 10**9)
    gone = recorded_flow("node2", CONN_RECORD.pack(key, REC_GONE, value), CLIENT, WEB, 0, 1_075.0)
    fin = recorded_flow("node2", CONN_RECORD.pack(key, REC_FIN, value), CLIENT, WEB, 0, 1_075.0)
    assert (gone.time, fin.time, gone.duration) == (1_075.0, 1_010.0, 10.0)


# ------------------------------------------------------------------ what one node answers stays that node's


DEEP = b"[" * 5000 + b"]" * 5000  # JSON nested past Python's recursion limit: json.loads raises RecursionError


class _Answers(_Registry):
    """node2 answers ``node2`` (its lines, as they come), every other node one record of its own."""

    def __init__(self, names, node2):
        super().__init__(names)
        self.node2 = node2

    async def lines(self, node, path, **_):
        if node == "node2":
            async for line in self.node2():
                yield line
            return
        yield json.dumps({"seq": 1, "time": 1.0, "node": node}).encode() + b"\n"


async def test_json_nested_too_deep_from_one_node_is_that_nodes_error_alone():
    """A node answering JSON nested too deep to read (json.loads raises RecursionError, not
    ValueError) failed the whole gathering: GET /cluster 500 for every node, the cluster's last
    N lost for every node, and the node's followed stream ended unsaid and never followed
    again.  Now that node alone is an error; the others are shown, its stream goes on."""
    from types import SimpleNamespace

    from agentd.daemon import observe_api
    from agentd.daemon.cluster import ClusterView

    class Deep(ClusterView):
        async def get(self, node, path):
            return 200, "application/json", DEEP if node == "node2" else json.dumps({"node": {"name": node}}).encode()

    view = Deep("node1", lambda: {"node2": "192.0.2.2", "node3": "192.0.2.3"}, 9098)
    gathered = await view.gather("/status", lambda: {"node": {"name": "node1"}})
    assert gathered == {"node1": {"node": {"name": "node1"}}, "node2": {"error": "node2 answered JSON nested too deep to read"},
                        "node3": {"node": {"name": "node3"}}}

    async def deep():
        yield DEEP + b"\n"

    registry = _Answers(["node1", "node2", "node3"], deep)
    agent = SimpleNamespace(cluster_view=lambda: registry, flows_view=lambda: None, node_name=lambda: "node1")
    handlers = observe_api._Handlers(agent, read_only=False, token_of=lambda: None)
    records, errors = await handlers._gather_last(["node2", "node3"], FlowFilter(), 100, None)
    assert [json.loads(r)["node"] for r in records] == ["node3"]
    assert errors == {"node2": "node2 answered JSON nested too deep to read"}

    follow = _Node([[b'{"lost":' + DEEP + b"}\n", b'{"seq":2,"time":2.0,"node":"node2"}\n']])
    merge = observe_api._Merge()
    task = asyncio.create_task(observe_api._pump_remote(follow, "node2", "/flows?follow=1", merge))
    for _ in range(20):
        await asyncio.sleep(0)
    got = [json.loads(merge.queue.get_nowait()) for _ in range(merge.queue.qsize())]
    assert got[:2] == [{"node": "node2", "error": "node2 answered a line that is not a JSON object: left out "
                                                  "(is that an agentd's cluster listener?)"},
                       {"seq": 2, "time": 2.0, "node": "node2"}]
    assert not task.done() or task.exception() is None  # (asked again after the end: not dead of it)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    for deep_line in (DEEP, b'{"lost":' + DEEP + b"}"):
        assert observe_api._named(deep_line) is None and observe_api._lost_at("node2", deep_line) == (deep_line, 1)


async def test_a_followed_node_that_answers_no_json_lines_is_said_once_and_its_lines_left_out(monkeypatch):
    """Something else answering 200 on a node's cluster port (a web server: no LAST_END header)
    is asked again without its last N, and its lines went into the merged stream as they came:
    the browser's live table was replaced by an error for every node, `agentd flows -A -f`
    exited blaming the local agent.  Now only JSON objects are passed on; the rest is said
    once (per outage: not at every retry) and left out."""
    from agentd.daemon import observe_api
    from agentd.daemon.cluster import UnmarkedStream

    html = [b"<!doctype html>\n", b"<h1>It works</h1>\n", b"[1, 2]\n", b"null\n", b'"text"\n']

    class Squatter:
        asked = 0

        async def lines(self, node, path, *, follow=False, blanks=False, seen=None):
            self.asked += 1
            if blanks:
                raise UnmarkedStream("node2 does not end its last records with an empty line")
            for answered in html:
                yield answered
            if self.asked > 3:
                await asyncio.Event().wait()

    monkeypatch.setattr(observe_api, "RETRY_FIRST", 0.0)
    squatter = Squatter()
    merge = observe_api._Merge()
    task = asyncio.create_task(observe_api._pump_remote(squatter, "node2", "/flows?last=100&follow=1", merge,
                                                        first=observe_api._Snapshot(100), again="/flows?last=0&follow=1"))
    for _ in range(50):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert squatter.asked == 4  # the unmarked one, then asked again three times
    got = [json.loads(merge.queue.get_nowait()) for _ in range(merge.queue.qsize())]  # each a JSON object
    assert all(isinstance(x, dict) for x in got)
    assert got == [{"node": "node2", "error": "node2 answered a line that is not a JSON object: left out "
                                              "(is that an agentd's cluster listener?)"},
                   {"node": "node2", "error": "node2 ended the stream"}]


def test_a_records_addresses_ports_verdict_and_count_are_printed_printable():
    """`agentd flows` printed a (remote) record's ip, port, verdict, suppressed count and
    Service address as they came: a node could forge lines or send terminal escapes."""
    record = {"time": 1.0, "node": "node2", "protocol": "TCP", "verdict": "dropped\x1b[2J", "event": "drop",
              "reason": "policy", "direction": "ingress", "policies": ["x/y"], "suppressed": "3\x1b[31m",
              "src": {"ip": "10.0.0.1\x1b]0;owned\x07", "port": "1\n10:00:00.000  node2  FAKE LINE"},
              "dst": {"ip": "10.0.0.2", "port": 80},
              "service": {"name": "a/s", "ip": "\x1b[1m", "port": "1\r"}}
    text = line(record)
    assert "\x1b" not in text and "\n" not in text and "\r" not in text and "\x07" not in text
    assert "10.0.0.1\\x1b]0;owned\\x07:1\\n10:00:00.000" in text and "DROPPED\\X1B[2J" in text
    assert "(+3\\x1b[31m like it)" in text
    # A time no clock shows is "-", not a crash of the CLI (time.localtime raised).
    for t in (1e400, float("nan"), 1e20, -1e20):
        assert line({**record, "time": t}).startswith("-  node2  ")


async def test_a_gathered_last_n_says_a_record_too_long_to_read_was_lost(monkeypatch):
    """A node's record longer than LINE_MAX is a line saying one record was lost
    (cluster._skipped); the gathered last N (the browser's first 100 rows, `agentd flows -A`)
    left that line out silently: only a followed stream told it."""
    from types import SimpleNamespace

    from agentd.daemon import cluster, observe_api

    monkeypatch.setattr(cluster, "LINE_MAX", 100)
    big = json.dumps({"seq": 7, "time": 5.0, "node": "node2", "src": {"labels": {"k": "v" * 300}}}).encode() + b"\n"
    small = json.dumps({"seq": 8, "time": 6.0, "node": "node2"}).encode() + b"\n"

    async def node2():
        async for part in cluster._lines(_Chunks(big + small, 64), "node2"):  # type: ignore[arg-type]
            yield part

    registry = _Answers(["node1", "node2"], node2)
    agent = SimpleNamespace(cluster_view=lambda: registry, flows_view=lambda: None, node_name=lambda: "node1")
    handlers = observe_api._Handlers(agent, read_only=False, token_of=lambda: None)
    records, errors = await handlers._gather_last(["node2"], FlowFilter(), 100, None)
    assert errors == {}
    assert [json.loads(r) for r in records] == [
        {"seq": 7, "node": "node2", "lost": 1, "why": "a record of more than 100 bytes, not read"}, json.loads(small)]


async def test_a_record_time_that_is_no_time_from_one_node_is_that_nodes_error_alone():
    """Review r10 #2: json.loads takes NaN and Infinity.  One node's record with "time": NaN at
    the top of the cluster's last-N heap made every newer record compare not newer: the last N
    held that record and the OLDEST records of every other node (`agentd flows -A`, the browser's
    first rows); Infinity took a slot for ever; an integer too large for a float (review r13 #1)
    raised OverflowError out of the whole gathering.  Such a record is left out, said as that
    node's error; its other records and the other nodes' newest stay."""
    from types import SimpleNamespace

    from agentd.daemon import observe_api

    class Registry:
        def nodes(self):
            return {"node2": "192.0.2.2", "node3": "192.0.2.3"}

        async def lines(self, node, path, **_):
            if node == "node2":
                for time_ in ("NaN", "Infinity", "-Infinity", "1" + "0" * 400, "108.5"):
                    yield b'{"seq":1,"time":%s,"node":"node2"}\n' % time_.encode()
                return
            for i in range(10):
                yield json.dumps({"seq": i, "time": 100.0 + i, "node": "node3"}).encode() + b"\n"

    agent = SimpleNamespace(cluster_view=Registry, flows_view=lambda: None, node_name=lambda: "node1")
    handlers = observe_api._Handlers(agent, read_only=False, token_of=lambda: None)
    records, errors = await handlers._gather_last(["node2", "node3"], FlowFilter(), 3, None)
    assert [(json.loads(r)["node"], json.loads(r)["time"]) for r in records] == [
        ("node3", 108.0), ("node2", 108.5), ("node3", 109.0)]
    assert errors == {"node2": "node2 answered a record whose time is not a time"}


def test_a_logged_drop_of_a_frame_that_is_no_ip_nor_arp_packet_is_recorded_all_the_same():
    """A frame with a MAC not the pod's of another EtherType (the simplest poisoning of the
    bridge's forwarding table) and a QinQ frame (its payload starts with the inner tag) are
    logged by the kernel: each is a record of its prefix's reason, with the sender and the
    EtherType, no addresses -- counted as drops, not silently discarded.  A payload the agent
    cannot read of a prefix it does not know is heard of (its number), no record."""
    from agentd.daemon.flow_directory import FlowDirectory

    class Directory(FlowDirectory):
        def pod_on(self, ifindex):
            return {7: ("vethclient", CLIENT)}.get(ifindex)

    r = FlowRecorder("node1", Directory(None, None, ()), "/nonexistent", group=143, clock=lambda: 1000.0)

    def feed(prefix: str, hw: int, payload: bytes, seq: int) -> None:
        body = (nl.attr(nflog.NFULA_PACKET_HDR, struct.pack("!HBx", hw, 0)) + nl.attr(nflog.NFULA_PREFIX, prefix.encode() + b"\0")
                + nl.attr(nflog.NFULA_IFINDEX_PHYSINDEV, struct.pack("!I", 7)) + nl.attr(nflog.NFULA_SEQ, struct.pack("!I", seq))
                + nl.attr(nflog.NFULA_PAYLOAD, payload))  # fmt: skip
        msg = nl.encode_nfgen(nflog.MSG_PACKET, 0, 0, 7, body)
        for mtype, _f, _s, _p, start, end in nl.iter_messages(msg):
            r._on_log(mtype, msg, start, end)

    feed("spoofed-mac", 0x88B5, bytes(46), 1)
    feed("spoofed", 0x8100, b"\x00\x05\x08\x00" + P.udp_datagram("10.244.1.2", "10.244.1.3", 1, 2, b"x"), 2)
    feed("spoofed", 0x0800, P.udp_datagram("10.244.1.2", "10.244.1.3", 1, 2, b"x"), 3)
    feed("someone-elses", 0x88B5, bytes(46), 4)
    # 802.3 frames (an LLC one: STP's BPDU; a raw 802.3 one): no EtherType but the kernel's
    # ETH_P_802_2 (4) and ETH_P_802_3 (1) -- no IP protocols (1 is no ICMP)
    feed("spoofed-mac", 0x0004, bytes(46), 5)
    feed("spoofed-mac", 0x0001, bytes(46), 6)
    assert sum(r.drops.values()) == 5 and r.events == 5 and dict(r.lost) == {} and r.malformed == 0
    records = [f.json() for f in list(r.ring)]
    assert [(j["reason"], j["protocol"], j["src"]["ip"], j["sender"]["pod"]) for j in records] == [
        ("spoofed-mac", "0x88b5", "", "shop/client"), ("spoofed", "0x8100", "", "shop/client"),
        ("spoofed", "UDP", "10.244.1.2", "shop/client"), ("spoofed-mac", "0x0004", "", "shop/client"),
        ("spoofed-mac", "0x0001", "", "shop/client")]
    assert "- -> -" in line(records[0])
    assert [f.protocol for f in r.ring if FlowFilter.parse([("protocol", "ICMP")]).matches(f)] == []


def test_an_address_two_records_of_another_node_claim_names_one_pod_whatever_their_order():
    """Another node's stale endpoint file publishes a second record with a live pod's address:
    that node's tables give it to the newer pod, and so does the name here -- whichever record
    came last (a snapshot's etcd key order, an update of the stale one), and when the stale
    record goes the address still names the live pod, not nobody."""
    x = IPv4Address("10.244.1.7")
    new = Pod("ns", "a-new", "node1", (x,), {}, created="2024-05-02T10:00:00Z")
    stale = Pod("ns", "z-stale", "node1", (x,), {}, created="2024-05-01T09:00:00Z")
    for order in ((new, stale), (stale, new), (new, stale, stale)):
        engine = PolicyEngine("node2")
        for i, pod in enumerate(order):
            engine.upsert_pod(pod if i < 2 else Pod(**{**pod.__dict__, "labels": {"again": "1"}}))
        assert engine.by_ip[str(x)] == ("ns", "a-new"), order
        engine.remove_pod(("ns", "z-stale"))
        assert engine.by_ip[str(x)] == ("ns", "a-new")
        engine.upsert_pod(stale)
        engine.remove_pod(("ns", "a-new"))  # the live pod goes: the other claimant has it
        assert engine.by_ip[str(x)] == ("ns", "z-stale")
        engine.remove_pod(("ns", "z-stale"))
        assert str(x) not in engine.by_ip
    # Without creation times: by name, in any order; a record moving off the address gives it back.
    engine = PolicyEngine("node2")
    engine.upsert_pod(Pod("ns", "b", "node1", (x,), {}))
    engine.upsert_pod(Pod("ns", "a", "node1", (x,), {}))
    assert engine.by_ip[str(x)] == ("ns", "b")
    engine.upsert_pod(Pod("ns", "b", "node1", (IPv4Address("10.244.1.8"),), {}))
    assert engine.by_ip[str(x)] == ("ns", "a") and engine.by_ip["10.244.1.8"] == ("ns", "b")
    assert Pod.parse({"metadata": {"namespace": "ns", "name": "a", "creationTimestamp": "2024-05-02T10:00:00Z"},
                      "spec": {"nodeName": "node1"}}).created == "2024-05-02T10:00:00Z"


def test_the_drop_limiter_folds_a_senders_drops_only_with_that_senders():
    """Two pods claiming one address to one destination (two keepalived pods' gratuitous ARP
    for one floating IP) are two records, each naming its own sender: not one pod's drops
    folded into the other's record.  A refusal has no sender: folded as ever."""
    from agentd.daemon.flow_directory import FlowDirectory

    class Directory(FlowDirectory):
        def pod_on(self, ifindex):
            return ({7: "vethX", 8: "vethY"}[ifindex], None)

    r = FlowRecorder("node1", Directory(None, None, ()), "/nonexistent", group=143, agent_rate=1.0, agent_burst=1,
                     clock=lambda: 1000.0)

    def pkt(prefix: str, port: int, t: float) -> nflog.Packet:
        return nflog.Packet(prefix, 7, t, 3, 0, None, "10.244.1.50", "10.96.0.10", 17, 5353, 53, physindev=port)

    out = [r.dropped(pkt("spoofed", 7, 1000.0)), r.dropped(pkt("spoofed", 8, 1000.1)), r.dropped(pkt("spoofed", 8, 1000.2)),
           r.dropped(pkt("spoofed", 7, 1001.5))]
    assert [None if f is None else (f.sender_interface, f.suppressed) for f in out] == [
        ("vethX", 0), ("vethY", 0), None, ("vethX", 0)]
    assert r.dropped(pkt("no-endpoints", 7, 1000.0)) is not None and r.dropped(pkt("no-endpoints", 8, 1000.1)) is None
