"""[network] ip_family: IPv4-only, dual-stack and IPv6-only configurations (pure: host facts
are given by the test)."""

from __future__ import annotations

import dataclasses
import os
from ipaddress import IPv4Address, IPv6Address, IPv6Network

import pytest

from agentd.backend_table import mtu_overhead
from agentd.config.settings import HostPort, NetworkConfig, check_config, config_warnings, load_config


@dataclasses.dataclass
class Host:
    name: str = "node-7"
    address: IPv4Address | None = IPv4Address("192.0.2.10")
    address_v6: IPv6Address | None = IPv6Address("2001:db8::10")

    def hostname(self) -> str:
        return self.name

    def default_address(self) -> IPv4Address | None:
        return self.address

    def default_address_v6(self, beside: IPv4Address | None = None) -> IPv6Address | None:
        return self.address_v6


def lines(env: dict[str, str], host: Host | None = None) -> list[str]:
    return [str(e) for e in check_config(env=env, host=host or Host())]


def test_ipv4_is_the_default_and_reads_no_ipv6_address():
    cfg = load_config(env={}, host=Host())
    assert cfg.network.ip_family == "ipv4" and cfg.network.families == (4,)
    assert cfg.node.address_v6 is None and cfg.bgp.next_hop_v6 is None
    assert cfg.network.cidr_v6 == IPv6Network("fd00:10:244::/48") and cfg.network.subnet_len_v6 == 64


def test_dual_takes_both_addresses_from_the_host_and_gives_ipv6_routes_its_next_hop():
    cfg = load_config(env={"AGENTD_NETWORK_IP_FAMILY": "dual"}, host=Host())
    assert cfg.network.families == (4, 6)
    assert cfg.node.address == IPv4Address("192.0.2.10")
    assert cfg.node.address_v6 == IPv6Address("2001:db8::10")
    assert cfg.bgp.next_hop_v6 == IPv6Address("2001:db8::10")
    assert cfg.bgp.router_id == IPv4Address("192.0.2.10") and cfg.bgp.listen == HostPort("0.0.0.0", 179)
    # A dual-stack host without IPv6 default route is fine: IPv6 routes carry the mapped next hop.
    cfg = load_config(env={"AGENTD_NETWORK_IP_FAMILY": "dual"}, host=Host(address_v6=None))
    assert cfg.node.address_v6 is None and cfg.bgp.next_hop_v6 is None
    # A next hop set without address_v6 is the node's IPv6 address too (its node record's
    # address_v6, through which the other nodes map the next hop to this node), in place of
    # the host's.
    for host in (Host(), Host(address_v6=None)):
        cfg = load_config(env={"AGENTD_NETWORK_IP_FAMILY": "dual", "AGENTD_BGP_NEXT_HOP_V6": "2001:db8::99"},
                          host=host)
        assert cfg.bgp.next_hop_v6 == cfg.node.address_v6 == IPv6Address("2001:db8::99")


def test_the_speakers_ipv4_next_hop_over_ipv6_sessions_is_the_nodes_ipv4_address():
    # An external peer at an IPv6 address gets the node's IPv4 routes with the node's IPv4
    # address as next hop; an IPv6-only node has none (and offers no IPv4 unicast).
    from agentd.daemon.speaker import local_settings

    dual = local_settings(load_config(env={"AGENTD_NETWORK_IP_FAMILY": "dual"}, host=Host()))
    assert dual.next_hop_v4 == IPv4Address("192.0.2.10") and dual.next_hop_v6 == IPv6Address("2001:db8::10")
    v6 = local_settings(load_config(env={"AGENTD_NETWORK_IP_FAMILY": "ipv6", "AGENTD_NETWORK_BACKEND": "vxlan"},
                                    host=Host()))
    assert v6.next_hop_v4 is None and v6.families == ((2, 1),)


def test_ipv6_only_has_no_ipv4_address_and_a_router_id_from_the_node_name():
    env = {"AGENTD_NETWORK_IP_FAMILY": "ipv6", "AGENTD_NETWORK_BACKEND": "vxlan"}
    cfg = load_config(env=env, host=Host())
    assert cfg.network.families == (6,)
    assert cfg.node.address is None and cfg.node.address_v6 == IPv6Address("2001:db8::10")
    assert cfg.bgp.listen == HostPort("::", 179)
    rid = cfg.bgp.router_id
    assert isinstance(rid, IPv4Address) and int(rid) != 0
    assert load_config(env=env, host=Host(name="node-8")).bgp.router_id != rid  # from the name
    assert load_config(env=env, host=Host()).bgp.router_id == rid  # and stable
    rr = load_config(env={**env, "AGENTD_NODE_ROUTE_REFLECTOR": "true"}, host=Host())
    assert rr.node.cluster_id == rid
    # A configured listen address is kept.
    assert load_config(env={**env, "AGENTD_BGP_LISTEN": "[2001:db8::10]:1179"}, host=Host()).bgp.listen == \
        HostPort("2001:db8::10", 1179)


@pytest.mark.parametrize(
    "env, host, expected",
    [
        ({"AGENTD_NETWORK_IP_FAMILY": "ipv6"}, Host(address_v6=None),
         "default: [node] address_v6: not set and this host has no IPv6 default route to take it from; "
         "set [node] address_v6"),
        ({"AGENTD_NETWORK_IP_FAMILY": "ipv6", "AGENTD_NETWORK_BACKEND": "ipip"}, None,
         "AGENTD_NETWORK_BACKEND=ipip: [network] backend: ipip needs an IPv4 underlay (IP in IP"),
        ({"AGENTD_NETWORK_IP_FAMILY": "ipv6", "AGENTD_NETWORK_BACKEND": "udp"}, None,
         "AGENTD_NETWORK_BACKEND=udp: [network] backend: udp needs an IPv4 underlay (flannel UDP"),
        ({"AGENTD_NETWORK_IP_FAMILY": "ipv6", "AGENTD_NODE_ADDRESS": "192.0.2.1"}, None,
         "[node] address: is an IPv4 underlay address, which ip_family = ipv6 does not use"),
        ({"AGENTD_NODE_ADDRESS_V6": "2001:db8::1"}, None,
         "[node] address_v6: is used only with [network] ip_family = dual or ipv6"),
        ({"AGENTD_NETWORK_IP_FAMILY": "dual", "AGENTD_NETWORK_MTU": "1200"}, None,
         "[network] mtu: 1200 is below 1280, the least every IPv6 link must carry (RFC 8200 §5)"),
        ({"AGENTD_NETWORK_CIDR_V6": "fd00::/64"}, None,
         "[network] cidr_v6: node subnets /64 must be longer than the cidr_v6's /64 and at most /126"),
        ({"AGENTD_NETWORK_SUBNET_LEN_V6": "127"}, None, "node subnets /127 must be longer than the cidr_v6's /48"),
        ({"AGENTD_NETWORK_CIDR_V6": "10.0.0.0/8"}, None, "must be an IPv6 network like fd00:10:244::/48, not IPv4"),
        ({"AGENTD_NETWORK_CIDR_V6": "fe80::/64"}, None, "overlaps fe80::/10, which pods cannot use"),
        ({"AGENTD_NETWORK_CIDR_V6": "fd00::1/48"}, None, "has host bits set (did you mean fd00::/48?)"),
        ({"AGENTD_NETWORK_IP_FAMILY": "dual", "AGENTD_NODE_ADDRESS_V6": "fe80::1"}, None,
         "must be a global or unique-local address, not link-local"),
        ({"AGENTD_NETWORK_IP_FAMILY": "dual", "AGENTD_BGP_NEXT_HOP_V6": "fe80::10"}, None,
         "AGENTD_BGP_NEXT_HOP_V6=fe80::10: [bgp] next_hop_v6: must be a global or unique-local address, not "
         "link-local or IPv4-mapped"),
        ({"AGENTD_BGP_NEXT_HOP_V6": "::ffff:192.0.2.10"}, None, "not link-local or IPv4-mapped"),
        ({"AGENTD_NETWORK_IP_FAMILY": "dual", "AGENTD_NODE_ADDRESS_V6": "2001:db8::1",
          "AGENTD_BGP_NEXT_HOP_V6": "2001:db8::99"}, None,
         "AGENTD_BGP_NEXT_HOP_V6=2001:db8::99: [bgp] next_hop_v6: 2001:db8::99 is not [node] address_v6 "
         "2001:db8::1: the other nodes know this node by address_v6 (its node record)"),
        ({"AGENTD_NETWORK_IP_FAMILY": "both"}, None, "[network] ip_family: must be one of ipv4, dual, ipv6"),
    ],
)
def test_each_problem_is_one_line(env, host, expected):
    got = lines(env, host)
    assert len(got) == 1 and expected in got[0], got
    assert "\n" not in got[0]


def test_ipip_and_udp_are_fine_in_a_dual_stack_cluster():
    for backend in ("ipip", "udp"):
        assert lines({"AGENTD_NETWORK_IP_FAMILY": "dual", "AGENTD_NETWORK_BACKEND": backend}) == []


def test_mtu_per_underlay_family():
    assert mtu_overhead("vxlan", 6) == 70 and mtu_overhead("vxlan", 4) == 50 and mtu_overhead("host-gw", 6) == 0
    assert NetworkConfig(backend="vxlan", ip_family="ipv6").pod_mtu(1500, 6) == 1430
    assert NetworkConfig(backend="vxlan", ip_family="dual").pod_mtu(1500, 4) == 1450
    assert NetworkConfig(backend="vxlan", ip_family="ipv6", mtu=1400).pod_mtu(1500, 6) == 1400


def test_the_stored_cluster_config_decides_and_a_node_that_cannot_follow_it_stops():
    from agentd.daemon.agent import AgentError, check_cluster, wanted_cluster

    v4 = load_config(env={}, host=Host())
    dual = load_config(env={"AGENTD_NETWORK_IP_FAMILY": "dual"}, host=Host())
    v6 = load_config(env={"AGENTD_NETWORK_IP_FAMILY": "ipv6"}, host=Host())
    assert wanted_cluster(v4).cidr_v6 is None and wanted_cluster(v4).to_json() == (
        b'{"backend":"host-gw","cidr":"10.244.0.0/16","encap":"always","subnet_len":24}')
    assert wanted_cluster(dual).versions == (4, 6) and wanted_cluster(v6).versions == (6,)
    check_cluster(v4, wanted_cluster(dual))  # an IPv4-configured node follows a dual-stack cluster
    check_cluster(dual, wanted_cluster(v4))
    with pytest.raises(AgentError, match="its pods have IPv4 addresses, and this node"):
        check_cluster(v6, wanted_cluster(dual))
    with pytest.raises(AgentError, match="needs an IPv6 underlay address"):
        check_cluster(v4, wanted_cluster(v6))
    # A dual-stack node would keep IPv4 sessions and listen on IPv4: no peer in an IPv6-only cluster.
    with pytest.raises(AgentError, match="configured dual: set \\[network\\] ip_family = ipv6"):
        check_cluster(dual, wanted_cluster(v6))
    check_cluster(v6, wanted_cluster(v6))


def test_a_cluster_whose_service_range_overlaps_its_pod_network_is_named_at_start(caplog):
    # The configuration lets the default service range over cidr pass (a cluster made so has
    # it in etcd); the agent says so at start, from the cluster's record.
    from agentd.daemon.agent import check_cluster, wanted_cluster

    wide = load_config(env={"AGENTD_NETWORK_CIDR": "10.0.0.0/8"}, host=Host())
    check_cluster(wide, wanted_cluster(wide))
    assert "service range 10.96.0.0/12 overlaps its pod network 10.0.0.0/8" in caplog.text
    caplog.clear()
    v4 = load_config(env={}, host=Host())
    check_cluster(v4, wanted_cluster(v4))
    assert "overlaps" not in caplog.text


@pytest.mark.parametrize("listen", ["0.0.0.0:179", "192.0.2.10:1179", "[::ffff:192.0.2.10]:179"])
def test_ipv6_only_with_an_ipv4_bgp_listen_address_starts_with_a_warning(listen, monkeypatch, capsys, tmp_path):
    """An IPv4 socket in an IPv6-only cluster: peers' connections to this node are refused,
    but sessions it opens (to external route reflectors) work, and earlier versions (and
    their sample config, listen = "0.0.0.0:179") took it: a warning, not a refusal."""
    from agentd import cli

    env = {"AGENTD_NETWORK_IP_FAMILY": "ipv6", "AGENTD_NETWORK_BACKEND": "vxlan", "AGENTD_BGP_LISTEN": listen}
    assert lines(env) == []
    cfg = load_config(env=env, host=Host())
    (warning,) = config_warnings(cfg)
    assert warning.startswith("[bgp] listen = ") and "an IPv4 address" in warning and "ip_family = ipv6" in warning
    assert "cannot connect to this node" in warning and "[::]:" in warning
    # IPv6 and dual keep whatever IPv4 or IPv6 listen address is set, without a warning.
    assert config_warnings(load_config(env={**env, "AGENTD_BGP_LISTEN": "[::]:179"}, host=Host())) == []
    assert config_warnings(load_config(env={**env, "AGENTD_NETWORK_IP_FAMILY": "dual"}, host=Host())) == []
    assert config_warnings(load_config(env={"AGENTD_NETWORK_IP_FAMILY": "ipv6", "AGENTD_NETWORK_BACKEND": "vxlan"},
                                       host=Host())) == []  # the default: [::]:179
    # `agentd check-config` prints it and still says the configuration is valid
    monkeypatch.setattr(os, "environ", {**{k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}, **env})
    monkeypatch.setattr(cli, "LocalHost", Host)
    (tmp_path / "agentd.toml").write_text(f"[cni]\nsubnet_file = '{tmp_path}/subnet.env'\n")
    assert cli.main(["check-config", "--config", str(tmp_path / "agentd.toml")]) == 0, capsys.readouterr().err
    assert f"warning: {warning}" in capsys.readouterr().err


PASSIVE6 = '[{"address": "2001:db8::1", "asn": 64513, "passive": true}, {"address": "2001:db8::2", "asn": 64513}]'
RANGE6 = '[{"prefix": "2001:db8:1::/48", "asn": 64514}]'
RANGE4 = '[{"prefix": "10.0.0.0/16", "asn": 64514}]'


def test_passive_peers_and_ranges_of_a_family_the_bgp_listen_socket_refuses_are_a_warning(monkeypatch, capsys, tmp_path):
    """An IPv4 listen address takes no IPv6 connection (and an IPv6 one other than [::] no IPv4
    one): IPv6 passive peers and ranges there never come up. A warning, not a refusal: such a
    configuration ran before, and its other sessions work."""
    from agentd import cli

    env = {"AGENTD_BGP_PEERS": PASSIVE6, "AGENTD_BGP_LISTEN_RANGES": RANGE6}
    assert lines(env) == []
    (warning,) = config_warnings(load_config(env=env, host=Host()))
    assert warning.startswith("[bgp] listen = 0.0.0.0:179: an IPv4 address, which takes no IPv6 connection")
    assert "[[bgp.peers]] #1 2001:db8::1 (passive), [[bgp.listen_ranges]] #1 2001:db8:1::/48." in warning
    assert "#2" not in warning and '[bgp] listen = "[::]:179"' in warning  # it connects out itself
    for listen in ("10.0.0.1:179", "[::ffff:192.0.2.10]:179"):
        assert "takes no IPv6 connection" in config_warnings(load_config(env={**env, "AGENTD_BGP_LISTEN": listen}, host=Host()))[0]
    # [::] takes both; an IPv6 address takes these (but not the other nodes': see the next test);
    # no listener: refused already (check_config).
    assert config_warnings(load_config(env={**env, "AGENTD_BGP_LISTEN": "[::]:179"}, host=Host())) == []
    assert config_warnings(load_config(env={**env, "AGENTD_BGP_LISTEN": "[2001:db8::10]:179"}, host=Host()),
                           nodes=False) == []
    # The reverse: IPv4 peers and ranges with an IPv6 address other than [::].
    env4 = {"AGENTD_BGP_LISTEN": "[2001:db8::10]:179", "AGENTD_BGP_LISTEN_RANGES": RANGE4,
            "AGENTD_BGP_PEERS": '[{"address": "192.0.2.1", "asn": 64513, "passive": true}]'}
    (warning,) = config_warnings(load_config(env=env4, host=Host()))
    assert warning.startswith("[bgp] listen = [2001:db8::10]:179: an IPv6 address, which takes no IPv4 connection")
    assert "cannot: the other nodes (with ip_family = ipv4 their sessions are IPv4), [[bgp.peers]] #1 192.0.2.1 (passive), " \
           "[[bgp.listen_ranges]] #1 10.0.0.0/16." in warning
    assert config_warnings(load_config(env={**env4, "AGENTD_BGP_LISTEN": "[::]:179"}, host=Host())) == []
    # `agentd check-config` prints it and says the configuration is valid.
    monkeypatch.setattr(os, "environ", {**{k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}, **env})
    monkeypatch.setattr(cli, "LocalHost", Host)
    (tmp_path / "agentd.toml").write_text(f"[cni]\nsubnet_file = '{tmp_path}/subnet.env'\n")
    assert cli.main(["check-config", "--config", str(tmp_path / "agentd.toml")]) == 0
    err = capsys.readouterr().err
    assert "warning: [bgp] listen = 0.0.0.0:179: an IPv4 address" in err


@pytest.mark.parametrize("cidr", ["10.96.0.0/16", "10.0.0.0/8"])
def test_a_pod_network_overlapping_the_default_service_range_is_a_warning(cidr, caplog):
    """The default service range overlapping the pod network is taken (clusters made before the
    check have it in etcd) but said, in the agent's words at start (check_cluster)."""
    from agentd.daemon.agent import check_cluster, wanted_cluster

    cfg = load_config(env={"AGENTD_NETWORK_CIDR": cidr}, host=Host())
    (warning,) = config_warnings(cfg)
    assert warning.startswith(f"the service range 10.96.0.0/12 ([network] service_cidr) overlaps the pod network {cidr} "
                              "([network] cidr): ")
    check_cluster(cfg, wanted_cluster(cfg))
    assert warning.split(": ", 1)[1] in caplog.text  # the same consequence and advice as the agent's
    assert config_warnings(load_config(env={}, host=Host())) == []


@pytest.mark.parametrize("family", ["ipv4", "dual"])
def test_an_ipv6_bgp_listen_address_in_a_cluster_whose_nodes_peer_over_ipv4_is_a_warning(family, monkeypatch, capsys,
                                                                                         caplog, tmp_path):
    """With ip_family ipv4 or dual the sessions between nodes are IPv4 (agentd.daemon.mesh): an
    IPv6 listen address other than [::] refuses the other nodes' connections. `agentd
    check-config` prints the warning, `agentd run` logs it, in the same words; `agentd speaker`
    has no sessions to nodes and does not name them."""
    from agentd import cli

    env = {"AGENTD_NETWORK_IP_FAMILY": family, "AGENTD_BGP_LISTEN": "[2001:db8::10]:179"}
    assert lines(env) == []
    (warning,) = config_warnings(load_config(env=env, host=Host()))
    assert warning == (f"[bgp] listen = [2001:db8::10]:179: an IPv6 address, which takes no IPv4 connection: IPv4 peers "
                       f"that must connect to this node cannot: the other nodes (with ip_family = {family} their "
                       "sessions are IPv4). Listen on [bgp] listen = \"[::]:179\", which takes both families")
    # [::] and IPv4 addresses take the nodes' connections; an IPv4-mapped address is an IPv4 socket.
    for listen in ("[::]:179", "0.0.0.0:179", "192.0.2.10:1179", "[::ffff:192.0.2.10]:179"):
        assert config_warnings(load_config(env={**env, "AGENTD_BGP_LISTEN": listen}, host=Host())) == []
    assert config_warnings(load_config(env=env, host=Host()), nodes=False) == []
    # check-config prints it; run logs it (the agent itself not started); the speaker does not.
    monkeypatch.setattr(os, "environ", {**{k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}, **env})
    monkeypatch.setattr(cli, "LocalHost", Host)
    (tmp_path / "agentd.toml").write_text(f"[cni]\nsubnet_file = '{tmp_path}/subnet.env'\n")
    config = ["--config", str(tmp_path / "agentd.toml")]
    assert cli.main(["check-config", *config]) == 0
    assert f"warning: {warning}\n" in capsys.readouterr().err

    async def agent(cfg, **_kw):
        return 0

    class Speaker:
        def __init__(self, cfg):
            pass

        async def run(self, **_kw):
            return 0

    import agentd.daemon.agent
    import agentd.daemon.speaker

    monkeypatch.setattr(agentd.daemon.agent, "run_agent", agent)
    monkeypatch.setattr(agentd.daemon.speaker, "SpeakerRuntime", Speaker)
    for name in ("setup_logging", "tune_gc", "limit_malloc_arenas"):
        monkeypatch.setattr(cli, name, lambda *a, **k: None)
    assert cli.main(["run", *config]) == 0
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [warning]
    caplog.clear()
    assert cli.main(["speaker", *config]) == 0
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
