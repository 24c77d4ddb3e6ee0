"""State that must stay bounded: maps, dictionaries and tasks that grew with whatever was
ever seen (a MAC flood, namespaces, refused connections, departed pods and nodes)."""

from __future__ import annotations

import errno
import ipaddress
import logging
import random
import struct
from ipaddress import IPv4Address, IPv4Interface, IPv4Network
from types import SimpleNamespace
from typing import ClassVar

from agentd.config.settings import load_config
from agentd.daemon.flow_directory import FlowDirectory
from agentd.dataplane.bpf import datapath, layout
from agentd.dataplane.bpf_backend import BpfPath
from agentd.kernel import netlink as nl
from agentd.kernel.netinfo import Underlay
from agentd.policy.engine import PolicyEngine
from agentd.policy.model import LocalPort, Pod, Policy
from agentd.resources import kinds
from bgp import PeerSettings, Speaker, loglimit
from bgp.settings import LocalSettings

# ------------------------------------------------------------------ the BPF ports map


class _FullMap:
    """A BPF hash map of ``size`` entries: a new key beyond that is E2BIG, as the kernel's."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: dict[bytes, bytes] = {}

    def update(self, fd, key, value, flags=0):
        if key not in self.entries and len(self.entries) >= self.size:
            raise OSError(errno.E2BIG, "map update: Argument list too long")
        self.entries[key] = value

    def delete(self, fd, key):
        return self.entries.pop(key, None) is not None


def _mac(i: int) -> bytes:
    return i.to_bytes(6, "big")


def test_a_mac_flood_that_filled_the_ports_map_does_not_stop_its_sync_for_good(monkeypatch, caplog):
    kmap = _FullMap(64)
    monkeypatch.setattr(datapath.lb, "map_update", kmap.update)
    monkeypatch.setattr(datapath.lb, "map_delete", kmap.delete)
    dp = datapath.BpfDatapath(1, "/nonexistent")
    dp.maps = {layout.PORTS: 3}
    flood = {(7, _mac(0x020000000000 + i)): 100 + i // 2 for i in range(100)}  # 50 ports, 2 MACs each: the map fills
    refusals = []
    update = kmap.update

    def counted(*args):
        try:
            update(*args)
        except OSError as err:
            refusals.append(err.errno)
            raise

    monkeypatch.setattr(datapath.lb, "map_update", counted)
    with caplog.at_level(logging.WARNING, "agentd.bpf"):
        dp.set_ports(flood)
        dp.set_ports(flood)  # still full: not logged again
    assert len(kmap.entries) == 64 and dp.status()["bridge_ports_refused"] == 36
    assert refusals and set(refusals) == {errno.E2BIG}  # the full map's path, not a port's share
    assert len([r for r in caplog.records if "not in the bridge ports map" in r.getMessage()]) == 1
    # The flood's MACs age out of the bridge; a new pod comes: its entry gets in.
    pod = {(7, _mac(0x0A0000000001)): 12}
    dp.set_ports(pod)
    assert dp.ports == pod and len(kmap.entries) == 1
    assert dp.status()["bridge_ports_refused"] == 0


def test_one_ports_mac_flood_takes_its_share_of_the_ports_map_not_the_map(monkeypatch):
    kmap = _FullMap(100)
    monkeypatch.setattr(datapath.lb, "map_update", kmap.update)
    monkeypatch.setattr(datapath.lb, "map_delete", kmap.delete)
    dp = datapath.BpfDatapath(1, "/nonexistent")
    dp.maps = {layout.PORTS: 3}
    flood = {(7, _mac(0x020000000000 + i)): 11 for i in range(300)}
    dp.set_ports(flood)
    share = dict(dp.ports)
    assert len(share) == datapath.PORT_MACS_MAX and dp.status()["bridge_ports_refused"] == 300 - datapath.PORT_MACS_MAX
    # The flood goes on with other MACs; a new pod comes behind another port: it gets in, and
    # the flood's share stays the entries it had (no churn from sync to sync).
    more = {(7, _mac(0x030000000000 + i)): 11 for i in range(300)}
    pod = {(7, _mac(0x0A0000000001)): 12}
    dp.set_ports({**more, **flood, **pod})
    assert dp.ports == {**share, **pod} and len(kmap.entries) == datapath.PORT_MACS_MAX + 1


def test_only_macs_behind_veths_are_mirrored_into_the_ports_map(monkeypatch):
    # A bridge whose port is the node's NIC has the LAN's hosts behind it: over a port's share,
    # they read as refused for good, though deliver_local hands only to pods (veths).
    class Rt:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def learned_macs(self):
            lan = {(20, _mac(0x0C0000000000 + i)): 21 for i in range(100)}  # behind the NIC eth0 (21)
            return {**lan, (7, _mac(0x0A0000000001)): 12}  # a pod's, behind its veth

        def links_of_kind(self, kind):
            return {12, 13} if kind == "veth" else set()

    kmap = _FullMap(4096)
    monkeypatch.setattr(datapath.lb, "map_update", kmap.update)
    monkeypatch.setattr(datapath.lb, "map_delete", kmap.delete)
    monkeypatch.setattr(datapath, "Rtnl", Rt)
    dp = datapath.BpfDatapath(1, "/nonexistent")
    dp.maps = {layout.PORTS: 3}
    assert dp.sync_ports() == 1
    assert dp.ports == {(7, _mac(0x0A0000000001)): 12} and dp.status()["bridge_ports_refused"] == 0


def test_the_bpf_counters_are_read_when_the_ports_sync_fails(caplog):
    class Dp:
        def link_kinds(self):
            return {}

        def guard_bridges(self, links):
            return set()

        def sync_ports(self, links):
            raise OSError(errno.EPERM, "map update: Operation not permitted")

        def counters(self):
            return {"drops": {"martian": {"packets": 3, "bytes": 300}}}

    bpf = BpfPath(load_config(None, env={}, overrides={"node.address": "10.0.0.3", "node.name": "n3"}),
                  Underlay("eth0", 2, IPv4Interface("10.0.0.3/24"), 1500, (IPv4Network("10.0.0.0/24"),)))
    bpf.carried = {"udp"}
    assert bpf.redirecting
    with caplog.at_level(logging.WARNING, "agentd.backends"):
        assert bpf._refresh(Dp())["drops"]["martian"]["packets"] == 3
        assert bpf._refresh(Dp())["drops"]["martian"]["packets"] == 3
    assert len([r for r in caplog.records if "ports map not synced" in r.getMessage()]) == 1


class _HostRtnl(datapath.Rtnl):
    """An Rtnl whose kernel is a list: the host's devices -- eth0 (2), the pods' bridge cni0
    (5), two pods' veths (12, 13) -- and the MACs the bridge learned, a pod's behind veth 12
    and a LAN host's behind eth0; each request's message type is noted in ``asked``."""

    asked: ClassVar[list[int]] = []
    LINKS = ((2, "eth0", None), (5, "cni0", "bridge"), (12, "veth-a", "veth"), (13, "veth-b", "veth"))
    LEARNED = ((12, _mac(0x0A0000000001)), (2, _mac(0x0C0000000001)))

    def __init__(self) -> None:
        self._seq = 0

    def close(self) -> None:
        pass

    def request(self, message: bytes, what: str) -> list[tuple[int, bytes, int, int]]:
        mtype = struct.unpack_from("=IH", message)[1]
        self.asked.append(mtype)
        if mtype == nl.RTM_GETLINK:
            bodies = [struct.pack("=BxHiII", nl.AF_UNSPEC, 0, index, 0, 0)
                      + nl.attr(nl.IFLA_IFNAME, name.encode() + b"\0")
                      + (nl.attr(nl.IFLA_LINKINFO, nl.attr(nl.IFLA_INFO_KIND, kind.encode())) if kind else b"")
                      for index, name, kind in self.LINKS]
            return [(nl.RTM_NEWLINK, b, 0, len(b)) for b in bodies]
        if mtype == nl.RTM_GETNEIGH:
            bodies = [struct.pack("=BxxxiHBB", nl.AF_BRIDGE, port, nl.NUD_REACHABLE, 0, 0) + nl.attr(nl.NDA_LLADDR, mac)
                      + nl.attr(nl.NDA_MASTER, struct.pack("=I", 5)) for port, mac in self.LEARNED]
            return [(nl.RTM_NEWNEIGH, b, 0, len(b)) for b in bodies]
        raise AssertionError(f"not asked in a refresh: {what}")


def test_the_bpf_refresh_dumps_the_hosts_links_once(monkeypatch):
    """The 2 s refresh dumped the host's links twice, once for the bridges to guard and once
    for the veths whose learned MACs it mirrors: one RTM_GETLINK dump serves both now, with
    the same bridges guarded and the same ports mirrored."""
    kmap = _FullMap(4096)
    monkeypatch.setattr(datapath.lb, "map_update", kmap.update)
    monkeypatch.setattr(datapath.lb, "map_delete", kmap.delete)
    monkeypatch.setattr(datapath, "Rtnl", _HostRtnl)
    attached = []
    monkeypatch.setattr(datapath.tc, "attach", lambda ifindex, *_a: attached.append(ifindex) or [])
    monkeypatch.setattr(datapath.tc, "sweep", lambda pins: None)
    dp = datapath.BpfDatapath(1, "/nonexistent")
    dp.maps, dp.progs, dp.hook = {layout.PORTS: 3}, {layout.INGRESS: 99}, "tcx"
    dp.counters = lambda: {"drops": {}}
    bpf = BpfPath(load_config(None, env={}, overrides={"node.address": "10.0.0.3", "node.name": "n3"}),
                  Underlay("eth0", 2, IPv4Interface("10.0.0.3/24"), 1500, (IPv4Network("10.0.0.0/24"),)))
    bpf.carried = {"udp"}
    assert bpf.redirecting  # the ports map is synced at each refresh
    _HostRtnl.asked = []
    assert bpf._refresh(dp) == {"drops": {}}
    assert _HostRtnl.asked.count(nl.RTM_GETLINK) == 1, _HostRtnl.asked
    assert _HostRtnl.asked.count(nl.RTM_GETNEIGH) == 1
    assert attached == [5] and dp.guarded == {5}  # the bridge guarded
    assert dp.ports == {(5, _mac(0x0A0000000001)): 12}  # the pod's MAC mirrored, not the LAN host's
    bpf.carried = set()  # not redirecting: no ports sync, the one dump for the bridges
    _HostRtnl.asked = []
    bpf._refresh(dp)
    assert _HostRtnl.asked == [nl.RTM_GETLINK]


# ------------------------------------------------------------------ the policy engine's indexes


def test_the_policy_engine_keeps_nothing_of_a_namespace_gone():
    eng = PolicyEngine("node1")
    for i in range(20):
        ns = f"ci-{i}"
        pod = Pod(ns, "p", "node1", (ipaddress.ip_address(f"10.0.0.{i + 1}"),), {"app": "x"}, ())
        eng.upsert_pod(pod, LocalPort(f"veth{i}", "02:00:00:00:00:01", "cni0", i))
        eng.upsert_policy(Policy.parse(kinds.validate({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "deny", "namespace": ns},
            "spec": {"podSelector": {}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"run": str(i)}}}]}]}})))
        eng.build()
        assert eng._selected[(ns, "deny")] == {(ns, "p")}
        eng.remove_policy((ns, "deny"))
        eng.remove_pod((ns, "p"))
        eng.build()
    assert (len(eng._ns_pods), len(eng._ns_policies), len(eng._selected), len(eng._sel_refs)) == (0, 0, 0, 0)


# ------------------------------------------------------------------ the BGP log limiter


def test_a_port_179_scan_neither_merges_nor_silences_a_configured_peers_problems(caplog):
    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1")), now=0.0, rng=random.Random(1))
    sp.add_peer(PeerSettings("10.0.0.9", 65001, passive=True), 0.0)
    lim = sp.limiter
    scan = 1500  # more addresses than the limiter keeps
    forget_after = getattr(loglimit, "FORGET_AFTER", 3600.0)
    with caplog.at_level(logging.INFO, "bgp"):
        for i in range(scan):  # a scanner: each address refused once
            lim.log(logging.INFO, "refused", f"198.51.{i // 256}.{i % 256}", 1.0, "refused BGP connection from %s", i)
        # The configured peer's problem is logged (its own pacing, not the scan's) ...
        assert lim.log(logging.WARNING, "session-failed", "10.0.0.9", 2.0, "peer %s: hold timer expired", "10.0.0.9")
        # ... and so is one of its refused connections, however many outsiders' were.
        assert lim.log(logging.INFO, "refused", "10.0.0.9", 2.0, "refused BGP connection from %s", "10.0.0.9")
        for i in range(scan):  # more scanning: the peer's key stays
            lim.log(logging.INFO, "refused", f"198.52.{i // 256}.{i % 256}", 3.0, "refused BGP connection from %s", i)
        assert lim.log(logging.WARNING, "session-failed", "10.0.0.9", 62.0, "peer %s: hold timer expired", "10.0.0.9")
    assert lim.counts[("session-failed", "10.0.0.9")] == 2
    assert lim.counts[("refused", "10.0.0.9")] == 1
    assert ("refused", "*") not in lim.counts and ("session-failed", "*") not in lim.counts
    assert len(lim.counts) <= scan  # the least recently seen outsiders went
    # The scan over, its counts (the metric's series) go after a while; the peer's stay.
    sp.handle_timer(62.0 + forget_after)
    assert dict(lim.counts) == {("session-failed", "10.0.0.9"): 2, ("refused", "10.0.0.9"): 1}
    # A removed peer's count becomes an outsider's: it goes after a while too.
    sp.remove_peer("10.0.0.9", 10.0 + forget_after)
    sp.handle_timer(10.0 + 2 * forget_after)
    assert not lim.counts


def test_connections_from_ever_new_addresses_are_logged_once_a_minute_not_once_each(caplog):
    lim = loglimit.LogLimiter(logging.getLogger("bgp.test"), pinned=lambda subject: subject == "10.0.0.9")
    with caplog.at_level(logging.INFO, "bgp.test"):
        for i in range(5000):  # 5,000 addresses in 50 s, each one new
            lim.log(logging.INFO, "refused", f"2001:db8::{i:x}", 100.0 + i * 0.01, "refused BGP connection from %s", i)
        for i in range(3 * (loglimit.MAX_OTHERS + 1)):  # addresses cycled past the keys kept
            a = f"2001:db8:1::{i % (loglimit.MAX_OTHERS + 1):x}"
            lim.log(logging.INFO, "refused", a, 151.0 + i * 0.001, "refused BGP connection from %s", a)
        assert lim.log(logging.INFO, "refused", "10.0.0.9", 155.0, "refused BGP connection from %s", "10.0.0.9")
        assert lim.log(logging.INFO, "refused", "2001:db8:2::1", 160.0, "refused BGP connection from %s", "2001:db8:2::1")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "refused BGP connection from 0",
        "refused BGP connection from 10.0.0.9",  # a configured peer: its own pacing
        f"refused BGP connection from 2001:db8:2::1 ({4999 + 3 * (loglimit.MAX_OTHERS + 1)} similar suppressed in the last 60s)",
    ]
    assert lim.counts[("refused", "2001:db8:2::1")] == 1  # each address still counted on its own
    assert not any(subject == "*" for _, subject in lim.counts)


def test_a_reconfigured_peer_keeps_its_problem_counts():
    sp = Speaker(LocalSettings(asn=65000, router_id=IPv4Address("10.0.0.1")), now=0.0, rng=random.Random(1))
    sp.set_peers([PeerSettings("10.0.0.9", 65001, passive=True)], 0.0)
    sp.limiter.log(logging.WARNING, "session-failed", "10.0.0.9", 1.0, "peer %s: hold timer expired", "10.0.0.9")
    # SIGHUP with a setting of the same peer changed: removed and added back.
    sp.set_peers([PeerSettings("10.0.0.9", 65001, passive=True, hold_time=30)], 5.0)
    assert "10.0.0.9" in sp.peers
    for i in range(loglimit.MAX_OTHERS + 5):  # outsiders enough to evict the least recent
        sp.limiter.log(logging.INFO, "refused", f"198.51.{i // 256}.{i % 256}", 6.0, "refused %s", i)
    sp.handle_timer(5.0 + loglimit.FORGET_AFTER + 10.0)
    assert dict(sp.limiter.counts) == {("session-failed", "10.0.0.9"): 1}
    # Also if it was listed as an outsider's when its subject was pinned again.
    lim = loglimit.LogLimiter(logging.getLogger("bgp.test"), pinned=lambda subject: subject == "192.0.2.1")
    lim.log(logging.WARNING, "session-failed", "192.0.2.1", 1.0, "x")
    lim.forget("192.0.2.1", 2.0)
    lim.expire(2.0 + loglimit.FORGET_AFTER)
    assert dict(lim.counts) == {("session-failed", "192.0.2.1"): 1}


# ------------------------------------------------------------------ the flow directory's identities


def test_the_flow_directory_forgets_departed_pods_but_still_names_them_as_they_were():
    policy = SimpleNamespace(engine=PolicyEngine("node1"))
    d = FlowDirectory(policy, None, ("192.0.2.1",))  # type: ignore[arg-type]
    engine = policy.engine
    keep = Pod("default", "db", "node2", (ipaddress.ip_address("10.245.9.9"),), {"app": "db"}, ())
    engine.upsert_pod(keep)
    db = d.identity("10.245.9.9")
    count, _ = d.named_before(None)
    for i in range(3000):
        ip = f"10.244.{i // 250}.{i % 250 + 1}"
        key = ("default", f"web-{i:05x}")
        engine.upsert_pod(Pod(key[0], key[1], "node2", (ipaddress.ip_address(ip),), {"app": "web"}, ()))
        assert d.identity(ip).pod == f"default/web-{i:05x}"
        engine.remove_pod(key)
    assert len(d._ids) <= 2 * len(engine.pods) + 65
    assert d.identity("10.245.9.9") is db  # a live pod's identity still shared
    # The recorder names the ends of connections started before a change as they were then.
    _, before = d.named_before(count)
    assert before is not None and len(before) == 3000
    ip, then, _when = before[-1]
    assert (ip, then.pod, then.labels) == ("10.244.11.250", "default/web-00bb7", {"app": "web"})
