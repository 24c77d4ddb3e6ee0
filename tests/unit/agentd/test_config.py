"""agentd.config.settings: sources, precedence, defaults, and one clear line per bad input.

Pure: files live in tmp_path, the environment is passed in, and the host facts (hostname,
default route) come from StaticHost instead of the machine.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agentd.backend_table import mtu_overhead
from agentd.config.settings import (
    CONFIG_KEYS,
    DEFAULT_CONFIG_PATH,
    PEER_KEYS,
    RANGE_KEYS,
    SECTIONS,
    AgentConfig,
    ApiConfig,
    BgpConfig,
    BgpPeerConfig,
    DnsConfig,
    FlowsConfig,
    IngressConfig,
    ListenRangeConfig,
    CniConfig,
    Config,
    ConfigError,
    EtcdConfig,
    HostPort,
    LogConfig,
    NetworkConfig,
    NodeConfig,
    PolicyConfig,
    check_config,
    load_config,
)

EXAMPLE = Path(__file__).resolve().parents[3] / "etc" / "agentd.toml"
SECTION_CLASSES = {
    "node": NodeConfig, "network": NetworkConfig, "etcd": EtcdConfig, "bgp": BgpConfig,
    "api": ApiConfig, "cni": CniConfig, "dns": DnsConfig, "flows": FlowsConfig, "policy": PolicyConfig,
    "ingress": IngressConfig, "log": LogConfig, "agent": AgentConfig,
}


@dataclasses.dataclass
class StaticHost:
    """Host facts for computed defaults, fixed by the test."""

    name: str = "node-7"
    address: IPv4Address | None = IPv4Address("192.0.2.10")
    address_v6: IPv6Address | None = None

    def hostname(self) -> str:
        return self.name

    def default_address(self) -> IPv4Address | None:
        return self.address

    def default_address_v6(self, beside: IPv4Address | None = None) -> IPv6Address | None:
        return self.address_v6


def write(tmp_path: Path, text: str, name: str = "agentd.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def pure(path=None, **kw) -> Config:
    kw.setdefault("env", {})
    return load_config(path, **kw)


def problems(path=None, **kw) -> list[ConfigError]:
    kw.setdefault("env", {})
    return check_config(path, **kw)


def shown_key(key: str) -> str:
    """How an error line names a key: [bgp] hold_time, [[bgp.peers]] #2 asn, [netwrok]."""
    if m := re.fullmatch(r"bgp\.(peers|listen_ranges)\[(\d+)\](?:\.(\w+))?", key):
        return f"[[bgp.{m[1]}]] #{int(m[2]) + 1}" + (f" {m[3]}" if m[3] else "")
    section, dot, name = key.partition(".")
    return f"[{section}] {name}" if dot else f"[{section}]"


# -- defaults ----------------------------------------------------------------------------------


def test_defaults_without_reading_the_host():
    cfg = pure()
    assert cfg.source is None
    assert cfg.node == NodeConfig(name=None, address=None, asn=64512, route_reflector=False, cluster_id=None)
    assert cfg.network == NetworkConfig(
        cidr=IPv4Network("10.244.0.0/16"), subnet_len=24, backend="host-gw", encap="always", mtu=None,
        route_protocol=143, vxlan_vni=1, vxlan_port=4789, udp_port=8285, datapath="auto", bpf_pod_redirect=True,
        bpf_pod_fast_path=True, bpf_attach="auto", service_cidr=IPv4Network("10.96.0.0/12"),
    )
    assert cfg.etcd == EtcdConfig(endpoints=("http://127.0.0.1:2379",), prefix="/agentd", ca=None, cert=None,
                                  key=None, lease_ttl=30)
    assert cfg.bgp == BgpConfig(
        mode="mesh", listen=HostPort("0.0.0.0", 179), router_id=None, asn=64512, hold_time=90,
        keepalive_time=30, connect_retry=5.0, password=None, graceful_restart=True, restart_time=120,
        originate=(), peers=(),
    )
    assert cfg.api == ApiConfig(listen=HostPort("127.0.0.1", 9099))
    assert cfg.cni == CniConfig(
        conf_dir=Path("/etc/cni/net.d"), bin_dir=(Path("/opt/cni/bin"), Path("/usr/lib/cni")),
        subnet_file=Path("/run/agentd/subnet.env"), data_dir=Path("/var/lib/agentd/cni"),
        ipam_data_dir=Path("/var/lib/cni/networks"), write_conflist=True,
    )
    assert cfg.log == LogConfig(level="info", format="text")
    assert cfg.agent == AgentConfig(state_dir=Path("/var/lib/agentd"), route_resync=30.0,
                                    bpf_dir=Path("/sys/fs/bpf/agentd"))
    assert DEFAULT_CONFIG_PATH == "/etc/agentd/agentd.toml"


def test_computed_defaults_come_from_the_host():
    cfg = load_config(env={}, host=StaticHost())
    assert cfg.node.name == "node-7"
    assert cfg.node.address == IPv4Address("192.0.2.10")
    assert cfg.bgp.router_id == IPv4Address("192.0.2.10")
    assert cfg.node.cluster_id is None  # only reflectors have one
    rr = load_config(env={"AGENTD_NODE_ROUTE_REFLECTOR": "yes"}, host=StaticHost())
    assert rr.node.cluster_id == IPv4Address("192.0.2.10")


def test_configured_values_win_over_host_facts():
    env = {"AGENTD_NODE_NAME": "n1", "AGENTD_NODE_ADDRESS": "198.51.100.1", "AGENTD_BGP_ROUTER_ID": "1.1.1.1"}
    cfg = load_config(env=env, host=StaticHost(name="ignored", address=None))
    assert (cfg.node.name, cfg.node.address, cfg.bgp.router_id) == (
        "n1", IPv4Address("198.51.100.1"), IPv4Address("1.1.1.1"))


def test_no_default_route_and_no_address_names_node_address():
    errs = check_config(env={}, host=StaticHost(address=None))
    assert len(errs) == 1
    assert errs[0].key == "node.address"
    assert str(errs[0]) == ("default: [node] address: not set and this host has no IPv4 default route "
                            "to take it from; set [node] address")


def test_unusable_hostname_names_node_name():
    (err,) = check_config(env={}, host=StaticHost(name="bad host"))
    assert err.key == "node.name" and "'bad host'" in str(err)


def test_derived_defaults_follow_their_source_keys():
    cfg = pure(env={"AGENTD_NODE_ASN": "65010", "AGENTD_BGP_HOLD_TIME": "9",
                    "AGENTD_NODE_ADDRESS": "10.0.0.1"})
    assert cfg.bgp.asn == 65010
    assert cfg.bgp.keepalive_time == 3
    assert cfg.bgp.router_id == IPv4Address("10.0.0.1")
    assert pure(env={"AGENTD_BGP_HOLD_TIME": "0"}).bgp.keepalive_time == 0


# -- the file ----------------------------------------------------------------------------------

EVERY_KEY = """
[node]
name = "edge-1"
address = "192.0.2.20"
asn = 4200000000
route_reflector = true
cluster_id = 16909060

[network]
cidr = "172.16.0.0/12"
subnet_len = 26
backend = "vxlan"
encap = "cross-subnet"
mtu = 1400
route_protocol = 201
vxlan_vni = 4096
vxlan_port = 8472
udp_port = 9000
datapath = "userspace"
bpf_attach = "clsact"

[etcd]
endpoints = ["https://etcd-1:2379", "https://10.0.0.2:2379"]
prefix = "/cluster/agentd"
ca = "tls/ca.pem"
cert = "tls/cert.pem"
key = "tls/key.pem"
lease_ttl = 5

[bgp]
mode = "route-reflector"
listen = "[::]:1179"
router_id = "10.255.0.1"
asn = 4200000000
hold_time = 30
keepalive_time = 7
connect_retry = 2.5
password = "s3cret"
graceful_restart = false
restart_time = 300
originate = ["203.0.113.0/24", "2001:db8::/32"]

[[bgp.peers]]
address = "192.0.2.1"
asn = 65001
password = "tor"
passive = true
port = 1179
hold_time = 0
description = "top of rack"
local_address = "192.0.2.20"

[[bgp.peers]]
address = "2001:db8::2"
asn = 4200000000
rr_client = true

[api]
listen = "0.0.0.0:19099"

[cni]
conf_dir = "/tmp/cni/net.d"
bin_dir = ["/usr/local/cni", "bin"]
subnet_file = "/tmp/run/subnet.env"
data_dir = "/tmp/agentd/cni"
ipam_data_dir = "/tmp/cni/networks"
write_conflist = false

[log]
level = "debug"
format = "json"

[agent]
state_dir = "state"
route_resync = 2
"""


def test_every_key_from_the_file(tmp_path):
    (tmp_path / "tls").mkdir()
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (tmp_path / "tls" / name).write_text("PEM")
    path = write(tmp_path, EVERY_KEY)
    cfg = pure(path)
    assert cfg.source == str(path)
    assert cfg.node == NodeConfig("edge-1", IPv4Address("192.0.2.20"), 4200000000, True,
                                  IPv4Address("1.2.3.4"))
    assert cfg.network == NetworkConfig(IPv4Network("172.16.0.0/12"), 26, "vxlan", "cross-subnet", 1400, 201,
                                        4096, 8472, 9000, "userspace", bpf_attach="clsact")
    assert cfg.etcd == EtcdConfig(("https://etcd-1:2379", "https://10.0.0.2:2379"), "/cluster/agentd",
                                  tmp_path / "tls/ca.pem", tmp_path / "tls/cert.pem",
                                  tmp_path / "tls/key.pem", 5)
    assert cfg.bgp.mode == "route-reflector"
    assert cfg.bgp.listen == HostPort("::", 1179) and str(cfg.bgp.listen) == "[::]:1179"
    assert cfg.bgp.router_id == IPv4Address("10.255.0.1")
    assert (cfg.bgp.asn, cfg.bgp.hold_time, cfg.bgp.keepalive_time, cfg.bgp.connect_retry) == (
        4200000000, 30, 7, 2.5)
    assert (cfg.bgp.password, cfg.bgp.graceful_restart, cfg.bgp.restart_time) == ("s3cret", False, 300)
    assert cfg.bgp.originate == (IPv4Network("203.0.113.0/24"), IPv6Network("2001:db8::/32"))
    assert cfg.bgp.peers == (
        BgpPeerConfig(IPv4Address("192.0.2.1"), 65001, "tor", True, False, 1179, 0, "top of rack",
                      IPv4Address("192.0.2.20")),
        BgpPeerConfig(IPv6Address("2001:db8::2"), 4200000000, None, False, True, 179, None, "", None),
    )
    assert cfg.api.listen == HostPort("0.0.0.0", 19099)
    # Relative paths in the file are relative to the file's directory.
    assert cfg.cni == CniConfig(Path("/tmp/cni/net.d"), (Path("/usr/local/cni"), tmp_path / "bin"),
                                Path("/tmp/run/subnet.env"), Path("/tmp/agentd/cni"),
                                Path("/tmp/cni/networks"),
                                False)
    assert cfg.log == LogConfig("debug", "json")
    assert cfg.agent == AgentConfig(tmp_path / "state", 2.0)


def test_every_dataclass_field_is_a_config_key():
    fields = {f"{s}.{f.name}" for s, cls in SECTION_CLASSES.items() for f in dataclasses.fields(cls)}
    assert fields == set(CONFIG_KEYS)
    assert set(PEER_KEYS) == {f.name for f in dataclasses.fields(BgpPeerConfig)}
    assert set(RANGE_KEYS) == {f.name for f in dataclasses.fields(ListenRangeConfig)}
    # The sections in the file's order are Config's fields, in the same order as the keys' table.
    assert SECTIONS == tuple(dict.fromkeys(key.split(".")[0] for key in CONFIG_KEYS)) == tuple(SECTION_CLASSES)


def test_missing_file_means_defaults_unless_required(tmp_path):
    missing = tmp_path / "nope.toml"
    assert pure(missing).source is None
    (err,) = problems(missing, require_file=True)
    assert str(err) == f"{missing}: no such file"


def test_directory_instead_of_file(tmp_path):
    (err,) = problems(tmp_path, require_file=True)
    assert str(err).startswith(f"{tmp_path}: cannot read: ") and err.key is None


def test_toml_syntax_error_gives_line_and_column(tmp_path):
    path = write(tmp_path, '[network]\nbackend = "vxlan"\n[bgp]\nhold_time = \n')
    (err,) = problems(path)
    assert str(err) == f"{path}: line 4, column 13: TOML syntax error: Invalid value"
    assert err.key is None and err.source == str(path)


def test_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "agentd.toml"
    path.write_bytes(b'[node]\nname = "caf\xe9"\n')
    (err,) = problems(path)
    assert str(err) == f"{path}:2: not valid UTF-8"


def test_file_errors_carry_the_line(tmp_path):
    path = write(tmp_path, "# agentd\n[network]\nbackend = 'vxlan'\n\n[bgp]\nmode = 'mesh'\nhold_time = 2\n")
    (err,) = problems(path)
    assert str(err) == f"{path}:7: [bgp] hold_time = 2: must be 0 or at least 3"
    assert (err.key, err.source, err.line, err.message) == (
        "bgp.hold_time", str(path), 7, "must be 0 or at least 3")


# -- environment and command line --------------------------------------------------------------


def test_env_sets_every_kind_of_value():
    env = {
        "AGENTD_NODE_ADDRESS": "10.1.0.5",
        "AGENTD_NETWORK_BACKEND": "vxlan",
        "AGENTD_NETWORK_MTU": "1450",
        "AGENTD_NETWORK_CIDR": "10.128.0.0/9",  # outside the default service range 10.96.0.0/12
        "AGENTD_NODE_CLUSTER_ID": "7",
        "AGENTD_ETCD_ENDPOINTS": "http://a:2379, http://b:2379",
        "AGENTD_BGP_HOLD_TIME": "30",
        "AGENTD_BGP_CONNECT_RETRY": "1.5",
        "AGENTD_BGP_LISTEN": "",
        "AGENTD_BGP_ORIGINATE": "10.9.0.0/16,fd00::/8",
        "AGENTD_BGP_PEERS": json.dumps([{"address": "10.1.0.1", "asn": 65001, "port": 1790, "password": None},
                                        {"address": "10.1.0.2", "asn": 64512, "hold_time": 9}]),
        "AGENTD_CNI_BIN_DIR": "/a:/b",
        "AGENTD_LOG_LEVEL": "warning",
        "AGENTD_AGENT_ROUTE_RESYNC": "0.25",
    }
    cfg = pure(env=env)
    assert cfg.node.address == IPv4Address("10.1.0.5")
    assert (cfg.network.backend, cfg.network.mtu) == ("vxlan", 1450)
    assert cfg.network.cidr == IPv4Network("10.128.0.0/9")
    assert cfg.node.cluster_id == IPv4Address("0.0.0.7")
    assert cfg.etcd.endpoints == ("http://a:2379", "http://b:2379")
    assert (cfg.bgp.hold_time, cfg.bgp.keepalive_time, cfg.bgp.connect_retry) == (30, 10, 1.5)
    assert cfg.bgp.listen is None
    assert cfg.bgp.originate == (IPv4Network("10.9.0.0/16"), IPv6Network("fd00::/8"))
    assert cfg.bgp.peers == (
        BgpPeerConfig(IPv4Address("10.1.0.1"), 65001, port=1790),  # hold_time: [bgp] hold_time's (None)
        BgpPeerConfig(IPv4Address("10.1.0.2"), 64512, hold_time=9),
    )
    assert cfg.cni.bin_dir == (Path("/a"), Path("/b"))
    assert cfg.log.level == "warning"
    assert cfg.agent.route_resync == 0.25


@pytest.mark.parametrize(("text", "value"), [
    ("true", True), ("false", False), ("1", True), ("0", False), ("yes", True), ("no", False),
    ("on", True), ("OFF", False), (" True ", True),
])
def test_env_booleans(text, value):
    cfg = pure(env={"AGENTD_BGP_GRACEFUL_RESTART": text, "AGENTD_CNI_WRITE_CONFLIST": text,
                    "AGENTD_FLOWS_CONNECTIONS": text})
    assert cfg.bgp.graceful_restart is value and cfg.cni.write_conflist is value
    assert cfg.flows.connections is value and cfg.flows.enabled is True


def test_policy_check_source_mac():
    """[policy] check_source_mac: on by default, off from the file or the environment (a
    non-boolean: one problem naming the key, in BAD)."""
    assert pure().policy == PolicyConfig(check_source_mac=True)
    assert pure(env={"AGENTD_POLICY_CHECK_SOURCE_MAC": "false"}).policy.check_source_mac is False


def test_empty_env_value_means_not_set():
    cfg = pure(env={"AGENTD_NODE_ADDRESS": "", "AGENTD_BGP_PASSWORD": "", "AGENTD_BGP_PEERS": "",
                    "AGENTD_BGP_ORIGINATE": "", "AGENTD_ETCD_CA": ""})
    assert (cfg.node.address, cfg.bgp.password, cfg.bgp.peers, cfg.bgp.originate, cfg.etcd.ca) == (
        None, None, (), (), None)


def test_env_names_outside_the_sections_are_left_alone():
    # AGENTD_NETWORK, AGENTD_SUBNET, ... are the subnet file's names (agentd.cni.netconf), if sourced.
    cfg = pure(env={"AGENTD_CONFIG": "/x.toml", "AGENTD": "1", "HOME": "/root", "agentd_log_level": "debug",
                    "AGENTD_NETWORK": "10.244.0.0/16", "AGENTD_SUBNET": "10.244.3.1/24", "AGENTD_MTU": "1450",
                    "AGENTD_IPMASQ": "false", "AGENTD_BACKEND": "vxlan"})
    assert cfg.log.level == "debug"  # names are matched case-insensitively


def test_precedence_file_then_env_then_overrides(tmp_path):
    path = write(tmp_path, "[bgp]\nhold_time = 60\n[network]\nbackend = 'ipip'\nmtu = 1300\n"
                           "[log]\nlevel = 'error'\n")
    env = {"AGENTD_BGP_HOLD_TIME": "45", "AGENTD_NETWORK_BACKEND": "udp"}
    overrides = {"bgp.hold_time": "15"}
    cfg = pure(path, env=env, overrides=overrides)
    assert cfg.bgp.hold_time == 15  # override beats env beats file
    assert cfg.network.backend == "udp"  # env beats file
    assert (cfg.network.mtu, cfg.log.level) == (1300, "error")  # file beats defaults
    assert pure(path, env=env).bgp.hold_time == 45
    assert pure(path).bgp.hold_time == 60


def test_env_peers_replace_file_peers(tmp_path):
    path = write(tmp_path, "[[bgp.peers]]\naddress = '10.0.0.1'\nasn = 1\n")
    cfg = pure(path, env={"AGENTD_BGP_PEERS": '[{"address": "10.0.0.9", "asn": 9}]'})
    assert [p.address for p in cfg.bgp.peers] == [IPv4Address("10.0.0.9")]


def test_bad_value_is_reported_even_when_a_stronger_source_replaces_it():
    # A bad lower-precedence value is still a problem: the operator must see it.
    errs = problems(env={"AGENTD_BGP_HOLD_TIME": "2"}, overrides={"bgp.hold_time": "30"})
    assert [e.key for e in errs] == ["bgp.hold_time"]


# -- one clear line per bad input --------------------------------------------------------------

BAD = [
    # (id, where: file|env|set, payload, key, fragment of the line)
    ("unknown-key", "file", "[bgp]\nhold_tme = 30\n", "bgp.hold_tme",
     "unknown key [bgp] hold_tme (did you mean hold_time?)"),
    ("unknown-section", "file", "[netwrok]\nbackend = 'vxlan'\n", "netwrok",
     "unknown section [netwrok] (did you mean [network]?)"),
    ("top-level-key", "file", "backend = 'vxlan'\n", "backend",
     "unknown key backend at the top level (keys belong in a section, e.g. [network] backend)"),
    ("section-not-table", "file", "bgp = 5\n", "bgp", "[bgp] must be a table, not an integer"),
    ("peers-not-array", "file", "[bgp.peers]\naddress = '10.0.0.1'\nasn = 1\n", "bgp.peers",
     "write [[bgp.peers]] (an array of tables)"),
    ("wrong-type-int", "file", "[bgp]\nhold_time = '90'\n",
     "bgp.hold_time", "must be an integer, not a string"),
    ("wrong-type-float", "file", "[network]\nsubnet_len = 24.0\n", "network.subnet_len",
     "must be an integer, not a float"),
    ("wrong-type-bool", "file", "[node]\nroute_reflector = 1\n", "node.route_reflector",
     "must be a boolean, not an integer"),
    ("wrong-type-list", "file", "[etcd]\nendpoints = 'http://a:2379'\n", "etcd.endpoints",
     "must be an array, not a string"),
    ("hold-time-1", "file", "[bgp]\nhold_time = 1\n", "bgp.hold_time", "= 1: must be 0 or at least 3"),
    ("hold-time-2", "env", {"AGENTD_BGP_HOLD_TIME": "2"}, "bgp.hold_time",
     "AGENTD_BGP_HOLD_TIME=2: [bgp] hold_time: must be 0 or at least 3"),
    ("hold-time-big", "file", "[bgp]\nhold_time = 65536\n", "bgp.hold_time", "must be 0 or 3..65535"),
    ("peer-hold-time", "file", "[[bgp.peers]]\naddress = '10.0.0.1'\nasn = 1\nhold_time = 2\n",
     "bgp.peers[0].hold_time", "must be 0 or at least 3"),
    ("keepalive-ge-hold", "file", "[bgp]\nhold_time = 9\nkeepalive_time = 9\n", "bgp.keepalive_time",
     "must be 1..8 (less than hold_time 9)"),
    ("keepalive-zero-with-hold", "file", "[bgp]\nhold_time = 9\nkeepalive_time = 0\n", "bgp.keepalive_time",
     "must be 1..8 (less than hold_time 9)"),
    ("keepalive-no-hold", "file", "[bgp]\nhold_time = 0\nkeepalive_time = 5\n", "bgp.keepalive_time",
     "must be 0 when hold_time = 0"),
    ("bad-ip", "file", "[node]\naddress = '10.0.0.300'\n", "node.address", "must be an IPv4 address"),
    ("ipv6-node-address", "env", {"AGENTD_NODE_ADDRESS": "2001:db8::1"}, "node.address", "not IPv6"),
    ("multicast-address", "file", "[node]\naddress = '224.0.0.5'\n",
     "node.address", "must be a unicast address"),
    ("loopback-node-address", "env", {"AGENTD_NODE_ADDRESS": "127.0.1.1"}, "node.address",
     "must not be a loopback address: the other nodes reach this node at it"),
    ("router-id-zero", "file", "[bgp]\nrouter_id = '0.0.0.0'\n",
     "bgp.router_id", "must be a unicast address"),
    ("cidr-host-bits", "file", "[network]\ncidr = '10.244.1.0/16'\n", "network.cidr",
     "has host bits set (did you mean 10.244.0.0/16?)"),
    ("cidr-no-prefix", "file", "[network]\ncidr = '10.244.0.0'\n", "network.cidr", "needs a prefix length"),
    ("cidr-ipv6", "env", {"AGENTD_NETWORK_CIDR": "fd00::/48"}, "network.cidr", "must be an IPv4 network"),
    ("subnet-len-equal", "file", "[network]\ncidr = '10.0.0.0/24'\n", "network.cidr",
     "node subnets /24 must be longer than the cidr's /24 and at most /30"),
    ("subnet-len-short", "set", {"network.subnet_len": "16"}, "network.subnet_len",
     "--set network.subnet_len=16: [network] subnet_len: node subnets /16 must be longer"),
    ("subnet-len-31", "file", "[network]\nsubnet_len = 31\n", "network.subnet_len", "at most /30"),
    ("bad-backend", "env", {"AGENTD_NETWORK_BACKEND": "foo"}, "network.backend",
     "AGENTD_NETWORK_BACKEND=foo: [network] backend: must be one of host-gw, ipip, vxlan, udp"),
    ("bad-mode", "file", "[bgp]\nmode = 'full-mesh'\n", "bgp.mode", "must be one of mesh, route-reflector"),
    ("bad-encap", "set", {"network.encap": "never"}, "network.encap", "must be one of always, cross-subnet"),
    ("cross-subnet-host-gw", "file", "[network]\nencap = 'cross-subnet'\n", "network.encap",
     "host-gw never encapsulates"),
    ("bad-datapath", "file", "[network]\ndatapath = 'fast'\n",
     "network.datapath", "auto, bpf, userspace"),
    ("bad-bpf-attach", "env", {"AGENTD_NETWORK_BPF_ATTACH": "xdp"}, "network.bpf_attach",
     "AGENTD_NETWORK_BPF_ATTACH=xdp: [network] bpf_attach: must be one of auto, tcx, clsact"),
    ("mtu-small", "file", "[network]\nmtu = 100\n", "network.mtu", 'must be "auto" or 576..65535'),
    ("mtu-word", "env", {"AGENTD_NETWORK_MTU": "big"}, "network.mtu", 'must be "auto" or an integer'),
    ("route-protocol-bird", "file", "[network]\nroute_protocol = 12\n", "network.route_protocol",
     "12 is the kernel's RTPROT_BIRD"),
    ("route-protocol-static", "file", "[network]\nroute_protocol = 4\n",
     "network.route_protocol", "RTPROT_STATIC"),
    ("route-protocol-256", "file", "[network]\nroute_protocol = 256\n",
     "network.route_protocol", "must be 1..255"),
    ("vni-zero", "file", "[network]\nvxlan_vni = 0\n", "network.vxlan_vni", "must be 1..16777215"),
    ("udp-port-big", "env", {"AGENTD_NETWORK_UDP_PORT": "70000"}, "network.udp_port", "must be 1..65535"),
    ("asn-zero", "file", "[node]\nasn = 0\n", "node.asn", "must be 1..4294967295"),
    ("asn-too-big", "file", "[bgp]\nasn = 4294967296\n", "bgp.asn", "must be 1..4294967295"),
    ("asn-trans", "file", "[node]\nasn = 23456\n", "node.asn", "AS_TRANS"),
    ("asn-not-number", "env", {"AGENTD_NODE_ASN": "AS64512"}, "node.asn", "must be an integer"),
    ("cluster-id-word", "file", "[node]\ncluster_id = 'cluster-a'\n",
     "node.cluster_id", "must be an IPv4 address"),
    ("cluster-id-big", "file", "[node]\ncluster_id = 4294967296\n", "node.cluster_id", "0..4294967295"),
    ("node-name-slash", "file", "[node]\nname = 'a/b'\n", "node.name", "must be a host name"),
    ("listen-no-port", "file", "[bgp]\nlisten = '0.0.0.0'\n", "bgp.listen", "must be host:port"),
    ("listen-bad-port", "file", "[bgp]\nlisten = '0.0.0.0:70000'\n",
     "bgp.listen", "port 70000 is not 0..65535"),
    ("listen-hostname", "set", {"api.listen": "localhost:9099"},
     "api.listen", "'localhost' is not an IP address"),
    ("listen-ipv6-no-brackets", "file", "[api]\nlisten = '::1:9099'\n", "api.listen", "must be host:port"),
    ("api-empty", "file", "[api]\nlisten = ''\n", "api.listen", "must be host:port"),
    ("same-port", "file", "[api]\nlisten = '127.0.0.1:179'\n", "api.listen",
     "[api] listen and [bgp] listen use the same port"),
    ("endpoint-scheme", "file", "[etcd]\nendpoints = ['ftp://a:2379']\n", "etcd.endpoints",
     "'ftp://a:2379' must be an http:// or https:// URL"),
    ("endpoint-path", "env", {"AGENTD_ETCD_ENDPOINTS": "http://a:2379/v3"}, "etcd.endpoints", "no path"),
    ("endpoint-port", "file", "[etcd]\nendpoints = ['http://a:99999']\n", "etcd.endpoints", "out of range"),
    ("endpoint-credentials", "env", {"AGENTD_ETCD_ENDPOINTS": "http://root:pw@a:2379"}, "etcd.endpoints",
     "no path, query or credentials"),
    ("bin-dir-number", "file", "[cni]\nbin_dir = 5\n", "cni.bin_dir",
     "must be a string or an array, not an integer"),
    ("endpoint-twice", "file", "[etcd]\nendpoints = ['http://a:1', 'http://A:1']\n", "etcd.endpoints",
     "is listed twice"),
    ("no-endpoints", "env", {"AGENTD_ETCD_ENDPOINTS": ""}, "etcd.endpoints", "needs at least one endpoint"),
    ("etcd-prefix", "file", "[etcd]\nprefix = 'agentd/'\n",
     "etcd.prefix", 'must be a key path like "/agentd"'),
    ("lease-ttl", "file", "[etcd]\nlease_ttl = 1\n", "etcd.lease_ttl", "must be 2..86400"),
    ("ring-size", "file", "[flows]\nring_size = 1000001\n", "flows.ring_size", "must be 100..1000000"),
    ("flows-connections", "file", "[flows]\nconnections = 'some'\n", "flows.connections", "must be a boolean, not a string"),
    ("check-source-mac", "file", "[policy]\ncheck_source_mac = 'no'\n", "policy.check_source_mac",
     "must be a boolean, not a string"),
    ("missing-tls-file", "file", "[etcd]\nendpoints = ['https://a:2379']\nca = '/nonexistent/ca.pem'\n",
     "etcd.ca", "/nonexistent/ca.pem does not exist"),
    ("password-too-long", "file", "[bgp]\npassword = '" + "p" * 81 + "'\n", "bgp.password",
     "[bgp] password: must be at most 80 bytes"),
    ("restart-time", "file", "[bgp]\nrestart_time = 4096\n", "bgp.restart_time", "must be 1..4095"),
    ("connect-retry", "env", {"AGENTD_BGP_CONNECT_RETRY": "fast"}, "bgp.connect_retry", "must be a number"),
    ("connect-retry-zero", "file", "[bgp]\nconnect_retry = 0\n", "bgp.connect_retry", "1..3600"),
    ("route-resync-nan", "file", "[agent]\nroute_resync = nan\n", "agent.route_resync", "0.1..3600"),
    # An integer too large for a float: one line, not math.isfinite's OverflowError.
    ("connect-retry-huge", "file", "[bgp]\nconnect_retry = " + "9" * 400 + "\n", "bgp.connect_retry", "1..3600"),
    ("record-rate-huge-negative", "file", "[flows]\nrecord_rate = -" + "9" * 400 + "\n", "flows.record_rate",
     "0.1..100000"),
    ("connect-retry-huge-env", "env", {"AGENTD_BGP_CONNECT_RETRY": "9" * 400}, "bgp.connect_retry", "1..3600"),
    ("originate-host-bits", "file", "[bgp]\noriginate = ['10.1.2.3/16']\n", "bgp.originate",
     "has host bits set (did you mean 10.1.0.0/16?)"),
    ("originate-twice", "env", {"AGENTD_BGP_ORIGINATE": "10.0.0.0/8,10.0.0.0/8"},
     "bgp.originate", "listed twice"),
    ("bad-log-level", "env", {"AGENTD_LOG_LEVEL": "verbose"}, "log.level", "debug, info, warning, error"),
    ("bad-bool", "env", {"AGENTD_BGP_GRACEFUL_RESTART": "maybe"},
     "bgp.graceful_restart", "must be true or false"),
    ("bin-dir-empty-part", "file", "[cni]\nbin_dir = '/opt/cni/bin::/x'\n", "cni.bin_dir", "search path"),
    ("duplicate-peer", "file", "[[bgp.peers]]\naddress = '10.0.0.1'\nasn = 1\n"
     "[[bgp.peers]]\naddress = '10.0.0.1'\nasn = 2\n", "bgp.peers[1].address",
     "duplicate of [[bgp.peers]] #1"),
    ("peer-missing-asn", "file", "[[bgp.peers]]\naddress = '10.0.0.1'\n", "bgp.peers[0].asn", "is required"),
    ("peer-link-local", "file", "[[bgp.peers]]\naddress = 'fe80::1'\nasn = 1\n", "bgp.peers[0].address",
     "must not be link-local (fe80::/10) or carry a %zone: link-local peers are not supported"),
    ("peer-zoned", "file", "[[bgp.peers]]\naddress = 'fe80::1%eth0'\nasn = 1\n", "bgp.peers[0].address",
     "link-local peers are not supported, use a global address"),
    ("peer-unknown-key", "file", "[[bgp.peers]]\nadress = '10.0.0.1'\naddress = '10.0.0.2'\nasn = 1\n",
     "bgp.peers[0].adress", "unknown key [[bgp.peers]] #1 adress (did you mean address?)"),
    ("peer-bad-address", "env", {"AGENTD_BGP_PEERS": '[{"address": "x", "asn": 1}]'}, "bgp.peers[0].address",
     "AGENTD_BGP_PEERS: [[bgp.peers]] #1 address: must be an IPv4 or IPv6 address"),
    ("peers-json-syntax", "env", {"AGENTD_BGP_PEERS": "[{"},
     "bgp.peers", "must be a JSON array of peer objects"),
    ("peers-json-object", "env", {"AGENTD_BGP_PEERS": '{"address": "10.0.0.1"}'}, "bgp.peers",
     "must be an array of peers, not a table"),
    ("peer-not-table", "env", {"AGENTD_BGP_PEERS": '["10.0.0.1"]'}, "bgp.peers[0]", "must be a table"),
    ("peer-own-address", "file",
     "[node]\naddress = '10.0.0.1'\n[[bgp.peers]]\naddress = '10.0.0.1'\nasn = 1\n",
     "bgp.peers[0].address", "is this node's own address"),
    ("peer-local-family", "file",
     "[[bgp.peers]]\naddress = '2001:db8::1'\nasn = 1\nlocal_address = '10.0.0.1'\n",
     "bgp.peers[0].local_address", "must be IPv6 like the peer address"),
    ("rr-client-not-reflector", "file",
     "[[bgp.peers]]\naddress = '10.0.0.1'\nasn = 64512\nrr_client = true\n",
     "bgp.peers[0].rr_client", "needs [node] route_reflector = true"),
    ("rr-client-ebgp", "file", "[node]\nroute_reflector = true\n[[bgp.peers]]\naddress = '10.0.0.1'\n"
     "asn = 65000\nrr_client = true\n", "bgp.peers[0].rr_client", "needs an iBGP peer (asn 64512)"),
    ("passive-without-listen", "file", "[bgp]\nlisten = ''\n[[bgp.peers]]\naddress = '10.0.0.1'\nasn = 1\n"
     "passive = true\n", "bgp.peers[0].passive", "[bgp] listen is empty"),
    ("cert-without-key", "file", "[etcd]\nendpoints = ['https://a:2379']\ncert = 'agentd.toml'\n",
     "etcd.cert",
     "cert and key go together; [etcd] key is not set"),
    ("tls-without-https", "file", "[etcd]\nca = 'agentd.toml'\n", "etcd.ca",
     "TLS files are set but no [etcd] endpoints use https://"),
    ("env-unknown-key", "env", {"AGENTD_BGP_HOLDTIME": "30"}, "bgp.holdtime",
     "AGENTD_BGP_HOLDTIME=30: unknown key [bgp] holdtime (did you mean AGENTD_BGP_HOLD_TIME?)"),
    ("env-section-typo", "env", {"AGENTD_NETWROK_MTU": "1400"}, "netwrok",
     "unknown section [netwrok] (did you mean AGENTD_NETWORK_MTU?)"),
    ("set-unknown-key", "set", {"bgp.holdtime": "30"}, "bgp.holdtime",
     "--set bgp.holdtime=30: unknown key [bgp] holdtime (did you mean bgp.hold_time?)"),
    ("set-no-section", "set", {"hold_time": "30"}, "hold_time", "(did you mean bgp.hold_time?)"),
]


@pytest.mark.parametrize(("where", "payload", "key", "fragment"), [c[1:] for c in BAD],
                         ids=[c[0] for c in BAD])
def test_bad_input_gives_one_line_naming_the_key(tmp_path, where, payload, key, fragment):
    path, env, overrides = None, {}, {}
    if where == "file":
        path = write(tmp_path, payload)
    elif where == "env":
        env = payload
    else:
        overrides = payload
    errs = problems(path, env=env, overrides=overrides)
    assert len(errs) == 1, [str(e) for e in errs]
    (err,) = errs
    line = str(err)
    assert "\n" not in line
    assert err.key == key
    assert fragment in line
    if key not in ("backend", "hold_time"):  # top-level mistakes are named inside the message
        assert shown_key(key) in line
    if where == "file":
        assert line.startswith(f"{path}:") and err.source == str(path)
    # load_config refuses with the same line.
    with pytest.raises(ConfigError) as raised:
        pure(path, env=env, overrides=overrides)
    assert str(raised.value) == line


def test_at_least_25_distinct_bad_inputs():
    assert len({c[0] for c in BAD}) == len(BAD) >= 25


def test_secrets_are_never_echoed(tmp_path):
    secret = "x" * 81
    path = write(tmp_path, f"[bgp]\npassword = '{secret}'\n[[bgp.peers]]\naddress = '10.0.0.1'\nasn = 1\n"
                           f"password = '{secret}'\n")
    peers = json.dumps([{"asn": 2, "password": secret}])
    errs = problems(path, env={"AGENTD_BGP_PASSWORD": secret},
                    overrides={"bgp.password": secret, "bgp.peers": peers})
    assert len(errs) == 6  # four passwords, and the override peer also lacks its address
    for err in errs:
        assert secret not in str(err)
    # Credentials in an etcd URL are refused without being repeated.
    (err,) = problems(env={"AGENTD_ETCD_ENDPOINTS": "http://root:hunter2@a:2379"})
    assert "hunter2" not in str(err) and "//***@a:2379" in str(err)
    (err,) = problems(write(tmp_path, "[etcd]\nendpoints = ['http://u:hunter2@a:2379']\n", "creds.toml"))
    assert "hunter2" not in str(err) and "//***@a:2379" in str(err)


def test_check_config_returns_every_problem_of_a_file(tmp_path):
    path = write(tmp_path, """
[node]
asn = 0
[network]
backend = "geneve"
cidr = "10.244.0.1/16"
[bgp]
hold_time = 2
mode = "mesh"
hold_tme = 5
[[bgp.peers]]
address = "10.0.0.1"
asn = 1
[[bgp.peers]]
address = "10.0.0.1"
asn = 2
[logging]
level = "info"
""")
    errs = problems(path, env={"AGENTD_LOG_FORMAT": "xml"}, overrides={"api.listen": "nowhere"})
    assert [(e.key, e.line) for e in errs] == [
        ("node.asn", 3),
        ("network.backend", 5),
        ("network.cidr", 6),
        ("bgp.hold_time", 8),
        ("bgp.hold_tme", 10),
        ("logging", 17),
        ("log.format", None),
        ("api.listen", None),
        ("bgp.peers[1].address", 15),
    ]
    with pytest.raises(ConfigError) as raised:
        pure(path, env={"AGENTD_LOG_FORMAT": "xml"}, overrides={"api.listen": "nowhere"})
    assert [str(e) for e in raised.value.problems[1:]] == [str(e) for e in errs[1:]]
    assert str(raised.value) == (f"{path}:3: [node] asn = 0: must be 1..4294967295 "
                                 "(and 8 more problems; see agentd check-config)")
    assert "\n" not in str(raised.value)


def test_valid_config_has_no_problems(tmp_path):
    assert problems(EXAMPLE) == []
    assert check_config(env={}, host=StaticHost()) == []


# -- the example file cannot drift -------------------------------------------------------------


def test_example_parses_to_the_defaults():
    cfg = pure(EXAMPLE)
    assert cfg.source == str(EXAMPLE)
    assert dataclasses.replace(cfg, source=None) == pure()
    assert tomllib.loads(EXAMPLE.read_text())  # plain TOML, no agentd-specific syntax


def test_example_documents_every_key():
    sections: dict[str, set[str]] = {}
    current = None
    for raw in EXAMPLE.read_text().splitlines():
        line = raw.strip()
        if m := re.fullmatch(r"#?\s*\[\[?([\w.]+)\]\]?", line):
            current = m[1]
        elif m := re.match(r"#?\s*(\w+)\s*=", line):
            sections.setdefault(current, set()).add(m[1])
    for section, cls in SECTION_CLASSES.items():
        documented = sections.get(section, set()) | ({"peers"} if "bgp.peers" in sections else set()) | (
            {"listen_ranges"} if "bgp.listen_ranges" in sections else set()
        )
        missing = {f.name for f in dataclasses.fields(cls)} - documented
        assert not missing, f"etc/agentd.toml does not document [{section}] {sorted(missing)}"
    assert set(PEER_KEYS) <= sections["bgp.peers"]
    assert set(RANGE_KEYS) <= sections["bgp.listen_ranges"]
    sections.pop(None, None)  # the header's prose mentions AGENTD_X=... examples
    assert set(sections) == set(SECTION_CLASSES) | {"bgp.peers", "bgp.listen_ranges"}


# -- paths, output and helpers -----------------------------------------------------------------


def test_tls_files_relative_to_the_file(tmp_path):
    for name in ("ca.pem", "c.pem", "k.pem"):
        (tmp_path / name).write_text("PEM")
    path = write(tmp_path, "[etcd]\nendpoints = ['https://e:2379']\n"
                           "ca = 'ca.pem'\ncert = 'c.pem'\nkey = 'k.pem'\n")
    cfg = pure(path)
    assert (cfg.etcd.ca, cfg.etcd.cert, cfg.etcd.key) == (
        tmp_path / "ca.pem", tmp_path / "c.pem", tmp_path / "k.pem")
    # From the environment an absolute path works the same.
    env_cfg = pure(env={"AGENTD_ETCD_ENDPOINTS": "https://e:2379",
                        "AGENTD_ETCD_CA": str(tmp_path / "ca.pem")})
    assert env_cfg.etcd.ca == tmp_path / "ca.pem"


def test_to_dict_is_json_and_masks_secrets(tmp_path):
    env = {"AGENTD_BGP_PASSWORD": "hunter2", "AGENTD_BGP_LISTEN": "",
           "AGENTD_BGP_PEERS": json.dumps([{"address": "10.0.0.2", "asn": 7, "password": "p"},
                                           {"address": "::2", "asn": 8}])}
    data = load_config(env=env, host=StaticHost()).to_dict()
    text = json.dumps(data)
    assert "hunter2" not in text and '"p"' not in text
    assert data["bgp"]["password"] == "********"
    assert [p["password"] for p in data["bgp"]["peers"]] == ["********", None]
    assert data["bgp"]["peers"][1]["address"] == "::2"
    assert data["bgp"]["listen"] == "" and data["api"]["listen"] == "127.0.0.1:9099"
    assert data["network"]["mtu"] == "auto" and data["network"]["cidr"] == "10.244.0.0/16"
    assert data["node"] == {"name": "node-7", "address": "192.0.2.10", "asn": 64512, "route_reflector": False,
                            "cluster_id": None, "address_v6": None}
    assert data["cni"]["bin_dir"] == "/opt/cni/bin:/usr/lib/cni"
    assert set(data) == set(SECTION_CLASSES)


def test_to_dict_feeds_back_as_overrides():
    env = {"AGENTD_NETWORK_BACKEND": "vxlan", "AGENTD_NETWORK_MTU": "1400"}
    cfg = load_config(env=env, host=StaticHost())
    flat = {f"{s}.{k}": v for s, table in cfg.to_dict().items() for k, v in table.items() if k != "peers"}
    text = {k: ",".join(v) if isinstance(v, list) else "" if v is None else str(v) for k, v in flat.items()}
    again = load_config(env={}, overrides=text, host=StaticHost(name="other", address=None))
    assert again == cfg


@pytest.mark.parametrize(("text", "hp"), [
    ("0.0.0.0:179", HostPort("0.0.0.0", 179)),
    ("[::]:179", HostPort("::", 179)),
    ("[2001:DB8::1]:0", HostPort("2001:db8::1", 0)),
    (" 127.0.0.1:9099 ", HostPort("127.0.0.1", 9099)),
])
def test_host_port(text, hp):
    assert HostPort.parse(text) == hp
    assert HostPort.parse(str(hp)) == hp


@pytest.mark.parametrize("text", ["", "179", "host:179", "[1.2.3.4]:1", "1.2.3.4:", "1.2.3.4:65536", "::1:1"])
def test_host_port_rejects(text):
    with pytest.raises(ValueError):
        HostPort.parse(text)


def test_mtu_overhead_and_auto_mtu():
    assert {b: mtu_overhead(b) for b in ("host-gw", "ipip", "vxlan", "udp")} == {
        "host-gw": 0, "ipip": 20, "vxlan": 50, "udp": 28}
    with pytest.raises(ValueError):
        mtu_overhead("gre")
    assert NetworkConfig(backend="vxlan").pod_mtu(1500) == 1450
    assert NetworkConfig(backend="udp").pod_mtu(9000) == 8972
    assert NetworkConfig(backend="ipip", mtu=1300).pod_mtu(1500) == 1300


def test_config_error_is_a_value_error():
    (err,) = problems(env={"AGENTD_LOG_LEVEL": "loud"})
    assert isinstance(err, ValueError)
    assert (err.source, err.key) == ("AGENTD_LOG_LEVEL=loud", "log.level")
    assert err.message == "must be one of debug, info, warning, error"


def test_long_or_unprintable_values_stay_on_one_line():
    (err,) = problems(env={"AGENTD_LOG_LEVEL": "a\nb" + "c" * 200})
    assert "\n" not in str(err) and len(str(err)) < 200


# -- any input: a list of ConfigErrors, never a traceback -------------------------------------


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(CONFIG_KEYS), text=st.text(max_size=40))
def test_any_text_for_any_key_is_a_clean_result(key, text):
    errs = problems(overrides={key: text})
    assert all(isinstance(e, ConfigError) and "\n" not in str(e) for e in errs)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from([*PEER_KEYS, "x"]), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(value=json_values)
def test_any_json_peers_is_a_clean_result(value):
    errs = problems(env={"AGENTD_BGP_PEERS": json.dumps(value)})
    assert all(isinstance(e, ConfigError) and "\n" not in str(e) for e in errs)


toml_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats()
                | st.text(max_size=12))


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(CONFIG_KEYS), value=st.recursive(toml_scalars, lambda i: st.lists(i, max_size=3),
                                                             max_leaves=6))
def test_any_toml_value_for_any_key_is_a_clean_result(tmp_path_factory, key, value):
    section, name = key.split(".")
    assume("null" not in json.dumps(value))  # TOML has no null
    body = json.dumps(value) if not isinstance(value, bool) else str(value).lower()
    body = re.sub(r"\bNaN\b", "nan", re.sub(r"-?Infinity", "inf", body))
    path = tmp_path_factory.mktemp("cfg") / "agentd.toml"
    path.write_text(f"[{section}]\n{name} = {body}\n")
    errs = problems(path)
    assert all(isinstance(e, ConfigError) and "\n" not in str(e) for e in errs)


def test_odd_key_names_and_huge_numbers_stay_one_line(tmp_path):
    path = write(tmp_path, '[bgp]\n"hold\\ntime\\u2028" = 1\n')
    (err,) = problems(path)
    assert err.key == "bgp.hold\ntime\u2028"
    assert str(err).splitlines() == [str(err)] and "hold\\ntime\\u2028" in str(err)
    (err,) = problems(write(tmp_path, "[node]\nasn = " + "9" * 5000 + "\n", "big.toml"))
    assert "TOML syntax error" in str(err) and len(str(err)) < 300
    (err,) = problems(env={"AGENTD_BGP_PEERS": "[" * 100000})
    assert err.key == "bgp.peers" and "JSON" in str(err)
    (err,) = problems(env={"AGENTD_NODE_ASN": "9" * 5000})
    assert err.message == "must be an integer"
    (err,) = problems(env={"AGENTD_ETCD_ENDPOINTS": "https://e:1", "AGENTD_ETCD_CA": "/" + "x" * 5000})
    assert err.key == "etcd.ca" and "File name too long" in str(err)


def test_external_peers_use_only_their_own_md5_key(tmp_path):
    # [bgp] password is for the node-to-node sessions; a top-of-rack router configured without a
    # password must not suddenly be asked for the mesh's key (Calico keeps these apart too).
    from agentd.daemon.speaker import local_settings, peer_settings

    path = tmp_path / "agentd.toml"
    path.write_text(
        "[node]\naddress = '10.0.0.1'\n[bgp]\npassword = 'mesh-key'\nconnect_retry = 2\n"
        "[[bgp.peers]]\naddress = '192.0.2.1'\nasn = 64513\n"
        "[[bgp.peers]]\naddress = '192.0.2.2'\nasn = 64513\npassword = 'tor-key'\n"
    )
    cfg = pure(path)
    assert [peer_settings(p, cfg).password for p in cfg.bgp.peers] == [None, "tor-key"]
    assert local_settings(cfg).connect_retry_time == 2.0


def test_sighup_applies_only_peers_and_log_settings(tmp_path):
    from agentd.config.settings import reloaded

    path = tmp_path / "agentd.toml"
    path.write_text("[node]\naddress = '10.0.0.1'\n[bgp]\nhold_time = 90\n")
    running = pure(path)
    path.write_text(
        "[node]\naddress = '10.0.0.1'\n[bgp]\nhold_time = 30\n[network]\nbackend = 'ipip'\n"
        "[log]\nlevel = 'debug'\n[[bgp.peers]]\naddress = '192.0.2.1'\nasn = 64513\n"
    )
    live, pending, refused = reloaded(running, pure(path))
    assert live.log.level == "debug" and [str(p.address) for p in live.bgp.peers] == ["192.0.2.1"]
    assert (live.bgp.hold_time, live.network.backend) == (90, running.network.backend)
    assert "[bgp] hold_time" in pending and "[network] backend" in pending
    assert not any("peers" in k or "[log]" in k for k in pending) and refused is None


def test_sighup_with_only_bgp_hold_time_changed_leaves_the_external_sessions_alone():
    """[bgp] hold_time waits for a restart: the peers and ranges that inherit it keep offering
    the running one after a reload, so the speaker sees no changed settings and resets no session
    (bgp/speaker.py set_peers: Cease/Other Configuration Change)."""
    from agentd.config.settings import reloaded
    from agentd.daemon.speaker import listen_ranges, peer_settings

    peers = json.dumps([{"address": "192.0.2.1", "asn": 64513}, {"address": "192.0.2.2", "asn": 64513, "hold_time": 9}])
    ranges = json.dumps([{"prefix": "10.1.0.0/16", "asn": 64513}])
    env = {"AGENTD_NODE_ADDRESS": "10.0.0.1", "AGENTD_BGP_PEERS": peers, "AGENTD_BGP_LISTEN_RANGES": ranges}
    running = pure(env=env)
    live, pending, refused = reloaded(running, pure(env={**env, "AGENTD_BGP_HOLD_TIME": "30"}))
    assert live.bgp.hold_time == 90
    assert [peer_settings(p, live) for p in live.bgp.peers] == [peer_settings(p, running) for p in running.bgp.peers]
    assert [peer_settings(p, live).hold_time for p in live.bgp.peers] == [90, 9]
    assert [r.template for r in listen_ranges(live)] == [r.template for r in listen_ranges(running)]
    assert [r.template.hold_time for r in listen_ranges(live)] == [90]
    assert pending == ["[bgp] hold_time", "[bgp] keepalive_time"] and refused is None
    # A restart (the new file read afresh) gives them the new one.
    fresh = pure(env={**env, "AGENTD_BGP_HOLD_TIME": "30"})
    assert [peer_settings(p, fresh).hold_time for p in fresh.bgp.peers] == [30, 9]
    assert [r.template.hold_time for r in listen_ranges(fresh)] == [30]


def test_empty_environment_values_unset_optional_keys():
    cfg = pure(env={"AGENTD_BGP_ASN": "", "AGENTD_BGP_KEEPALIVE_TIME": " ", "AGENTD_BGP_ROUTER_ID": "",
                    "AGENTD_NETWORK_MTU": ""})
    assert cfg.bgp.keepalive_time == cfg.bgp.hold_time // 3 and cfg.network.mtu is None
    assert cfg.bgp.asn is None or cfg.bgp.asn == cfg.node.asn
    # A key with a real default keeps checking its text: empty is not a backend.
    assert [e.key for e in problems(env={"AGENTD_NETWORK_BACKEND": ""})] == ["network.backend"]


# -- listen ranges (dynamic neighbours) --------------------------------------------------------


def test_listen_ranges_are_read_with_the_peer_defaults(tmp_path):
    path = write(tmp_path, """
[node]
route_reflector = true
address = "192.0.2.10"
[bgp]
hold_time = 30
[[bgp.listen_ranges]]
prefix = "10.1.0.0/16"
asn = 64512
rr_client = true
password = "s3cret"
max_prefixes = 5
""")
    cfg = pure(path)
    (r,) = cfg.bgp.listen_ranges
    assert (str(r.prefix), r.asn, r.rr_client, r.hold_time, r.max_prefixes) == ("10.1.0.0/16", 64512, True, None, 5)
    assert cfg.to_dict()["bgp"]["listen_ranges"][0]["password"] != "s3cret"
    assert cfg.to_dict()["bgp"]["listen_ranges"][0]["hold_time"] == 30  # the effective one: [bgp] hold_time
    from agentd.daemon.speaker import listen_ranges
    assert [lr.template.hold_time for lr in listen_ranges(cfg)] == [30]


def test_listen_range_problems_name_the_table_and_key(tmp_path):
    path = write(tmp_path, """
[bgp]
listen = ""
[[bgp.listen_ranges]]
prefix = "10.1.0.1/16"
asn = 64512
[[bgp.listen_ranges]]
prefix = "10.2.0.0/16"
asn = 64512
rr_client = true
colour = "red"
""")
    lines = [str(e) for e in problems(path)]
    assert any("[[bgp.listen_ranges]] #1 prefix" in x and "host bits" in x for x in lines), lines
    assert any("[[bgp.listen_ranges]] #2 rr_client" in x and "route_reflector" in x for x in lines), lines
    assert any("unknown key [[bgp.listen_ranges]] #2 colour" in x for x in lines), lines
    assert any("[[bgp.listen_ranges]] #2 prefix" in x and "listen is empty" in x for x in lines), lines
    assert all("\n" not in x for x in lines)


# -- checks across keys a review found missing ---------------------------------------------------


def test_a_service_range_set_over_the_pod_network_is_refused():
    """docs/services.md: service_cidr must not overlap cidr.  The default range is not refused
    (a cluster made with it has it in etcd: its agents would not start after an upgrade);
    the agent warns at start (test_agent_lifecycle)."""
    assert problems(overrides={"network.cidr": "10.0.0.0/8"}) == []
    (err,) = problems(overrides={"network.cidr": "10.0.0.0/8", "network.service_cidr": "10.96.0.0/16"})
    assert err.key == "network.service_cidr"
    assert str(err).endswith("the service range 10.96.0.0/16 overlaps the pod network 10.0.0.0/8: "
                             "set [network] service_cidr to a range outside cidr"), str(err)
    (err,) = problems(env={"AGENTD_NETWORK_SERVICE_CIDR": "10.244.128.0/20"})
    assert err.key == "network.service_cidr" and "outside cidr" in str(err)
    cfg = pure(overrides={"network.cidr": "10.0.0.0/8", "network.service_cidr": "172.30.0.0/16"})
    assert cfg.network.service_cidr == IPv4Network("172.30.0.0/16")


ROOT = Path(__file__).resolve().parents[3]


def _env_names_read_by_the_project() -> set[str]:
    """The AGENTD_* names the project's code, scripts and images read from the environment."""
    found: set[str] = set()
    read = re.compile(r"""(?:environ(?:\.get)?\(|environ\[|getenv\(|setdefault\()\s*["'](AGENTD_\w+)["']""")
    for path in [*ROOT.joinpath("agentd").rglob("*.py"), *ROOT.joinpath("bench").rglob("*.py"),
                 *ROOT.joinpath("tests").rglob("*.py")]:
        found |= set(read.findall(path.read_text(errors="replace")))
    shell = re.compile(r"\$\{?(AGENTD_\w+)|^\s*ARG (AGENTD_\w+)", re.MULTILINE)
    for path in [ROOT / "compose.yaml", ROOT / "scripts" / "dev", ROOT / ".ci" / "run",
                 *ROOT.joinpath("docker").rglob("*")]:
        if path.is_file():
            found |= {a or b for a, b in shell.findall(path.read_text(errors="replace"))}
    return found


def test_the_projects_own_variables_are_not_configuration_typos():
    """AGENTD_PIP_OFFLINE, AGENTD_IMAGE_CACHE...: the lab's, the scripts', the CLI's. A lab's
    agents inherit them; they were once "unknown section [pip] (did you mean AGENTD_API_...)"."""
    from agentd.config.settings import SUBNET_FILE_NAMES, TOOL_ENV_NAMES

    read = _env_names_read_by_the_project()
    assert {"AGENTD_PIP_OFFLINE", "AGENTD_IMAGE_CACHE", "AGENTD_LAB_ROOT", "AGENTD_STATUS_URL"} <= read
    config_names = {"AGENTD_" + k.replace(".", "_").upper() for k in CONFIG_KEYS}
    unknown = sorted(read - config_names - SUBNET_FILE_NAMES - TOOL_ENV_NAMES)
    assert unknown == [], "add these to agentd.config.settings.TOOL_ENV_NAMES"
    for name in sorted(TOOL_ENV_NAMES | {"AGENTD_PIP_OFFLINE", "AGENTD_IMAGE_CACHE"}):
        assert problems(env={name: "1", "AGENTD_NODE_NAME": "n1"}) == [], name
    # Typos of real variables are still caught, by the whole name.
    (err,) = problems(env={"AGENTD_BPG_HOLD_TIME": "30"})
    assert "unknown section [bpg] (did you mean AGENTD_BGP_HOLD_TIME?)" in str(err)
    (err,) = problems(env={"AGENTD_APII_LISTEN": "127.0.0.1:1"})
    assert "did you mean AGENTD_API_LISTEN?" in str(err)


@pytest.mark.parametrize("overrides, key, message", [
    ({"ingress.https_port": "80"}, "ingress.https_port", "[ingress] http_port and [ingress] https_port are both 80"),
    ({"ingress.http_port": "443"}, "ingress.http_port", "are both 443"),
    ({"api.listen": "0.0.0.0:443"}, "api.listen", "[ingress] https_port and [api] listen use the same port 443"),
    ({"api.listen": "192.0.2.1:8080", "ingress.http_port": "8080"}, "ingress.http_port",
     "[ingress] http_port and [api] listen use the same port 8080"),
    ({"ingress.http_port": "9098"}, "ingress.http_port", "[ingress] http_port and [api] cluster_port use the same port 9098"),
    ({"ingress.https_port": "179"}, "ingress.https_port", "[ingress] https_port and [bgp] listen use the same port 179"),
    ({"ingress.addresses": "::", "bgp.listen": "192.0.2.1:8443", "ingress.https_port": "8443"}, "ingress.https_port",
     "[bgp] listen use the same port 8443"),
])  # fmt: skip
def test_ingress_ports_clash_with_nothing(overrides, key, message):
    base = {"node.name": "n1", "node.address": "192.0.2.1", "ingress.enabled": "true"}
    (err,) = problems(overrides={**base, **overrides})
    assert err.key == key and message in str(err), str(err)
    assert problems(overrides=overrides) == []  # with [ingress] off


def test_ingress_ports_may_meet_other_listeners_elsewhere():
    base = {"node.name": "n1", "node.address": "192.0.2.1", "ingress.enabled": "true"}
    # The API on loopback and the proxy on the node's address do not meet; nor do disabled ports.
    assert problems(overrides={**base, "api.listen": "127.0.0.1:8080", "ingress.http_port": "8080"}) == []
    assert problems(overrides={**base, "ingress.addresses": "127.0.0.2", "ingress.https_port": "9098"}) == []
    assert problems(overrides={**base, "api.cluster_port": "0", "ingress.https_port": "9098"}) == []
    assert problems(overrides={"ingress.http_port": "443"}) == []  # [ingress] is off


def test_cluster_port_on_bgps_port_names_both_keys():
    (err,) = problems(overrides={"bgp.listen": "0.0.0.0:9098"})
    assert str(err) == ('--set bgp.listen=0.0.0.0:9098: [bgp] listen: [api] cluster_port and [bgp] listen use '
                        'the same port 9098')


@pytest.mark.parametrize(("node", "listen"), [
    ({"node.address": "192.0.2.10"}, "192.0.2.10:9098"),
    # IPv6-only: the cluster listener is on address_v6 (the agent's address has no IPv4 one)
    ({"node.address_v6": "2001:db8::10", "network.ip_family": "ipv6", "network.backend": "vxlan"}, "[2001:db8::10]:9098"),
    ({"node.address_v6": "2001:db8::10", "network.ip_family": "ipv6", "network.backend": "vxlan"}, "[2001:db8:0::10]:9098"),
    ({"node.address_v6": "2001:db8::10", "network.ip_family": "ipv6", "network.backend": "vxlan"}, "[::]:9098"),
])
def test_cluster_port_on_api_listens_port_and_address_is_refused(node, listen):
    (err,) = problems(overrides={"node.name": "n1", **node, "api.listen": listen})
    assert err.key == "api.listen" and "the cluster listener would take [api] listen's port 9098" in str(err)
    # Another port, or (dual stack: the listener is on the IPv4 address alone) the other address: no clash.
    assert problems(overrides={"node.name": "n1", **node, "api.listen": listen.replace("9098", "9097")}) == []
    dual = {"node.name": "n1", "node.address": "192.0.2.10", "node.address_v6": "2001:db8::10",
            "network.ip_family": "dual", "network.backend": "vxlan"}
    assert problems(overrides={**dual, "api.listen": "[2001:db8::10]:9098"}) == []


def test_toml_error_at_the_end_of_the_file_is_not_cut(tmp_path):
    path = write(tmp_path, "[network]\n[x")
    (err,) = problems(path)
    assert str(err) == f"{path}: end of file: TOML syntax error: Expected ']' at the end of a table declaration"


def test_keepalive_time_is_anything_below_the_hold_time():
    """RFC 4271 §4.4/§10: KEEPALIVEs below the hold time (a third of it is only the suggestion);
    etc/agentd.toml says 1..hold_time-1."""
    cfg = pure(overrides={"bgp.hold_time": "65535", "bgp.keepalive_time": "65534"})
    assert cfg.bgp.keepalive_time == 65534
    (err,) = problems(overrides={"bgp.hold_time": "65535", "bgp.keepalive_time": "65535"})
    assert err.key == "bgp.keepalive_time" and "must be 1..65534 (less than hold_time 65535)" in str(err)


def test_commands_that_open_no_tls_file_load_without_reading_them(tmp_path, monkeypatch):
    """`agentd flows` and `agentd ui` run as users who cannot read etcd's key (mode 0600): the
    paths are taken as written, everything else is still checked."""
    from agentd.config import values

    for name in ("ca.pem", "c.pem", "k.pem"):
        (tmp_path / name).write_text("PEM")
    path = write(tmp_path, "[etcd]\nendpoints = ['https://e:2379']\nca = 'ca.pem'\ncert = 'c.pem'\nkey = 'k.pem'\n"
                           "[api]\nread_token_file = '/nonexistent/read-token'\n")
    monkeypatch.setattr(values.os, "access", lambda p, mode: not str(p).endswith("k.pem"))
    assert sorted(e.key for e in problems(path)) == ["api.read_token_file", "etcd.key"]
    cfg = pure(path, check_files=False)
    assert (cfg.etcd.key, cfg.api.read_token_file) == (tmp_path / "k.pem", Path("/nonexistent/read-token"))
    (err,) = problems(path, check_files=False, overrides={"api.listen": "127.0.0.1:0"})
    assert err.key == "api.listen"  # the rest is still checked


def test_the_environment_examples_in_the_docs_load():
    """Every AGENTD_<SECTION>_<KEY>=value the docs show is a value the loader takes (an array in
    the environment is comma-separated, not JSON: docs/operations.md showed '["http://…",…]')."""
    root = EXAMPLE.parents[1]
    found = {}
    for doc in [root / "README.md", EXAMPLE, *sorted((root / "docs").glob("*.md"))]:
        for m in re.finditer(r"\bAGENTD_([A-Z0-9_]+)=('[^']*'|\"[^\"]*\"|[^\s`]+)", doc.read_text()):
            name, value = m[1].lower(), m[2]
            if value[0] in "'\"":
                value = value[1:-1]  # the shell's quotes
            else:
                value = value.rstrip(".,;)")  # the sentence's
            if name.replace("_", ".", 1) in CONFIG_KEYS:
                found[f"{doc.name}: AGENTD_{m[1]}={value}"] = (f"AGENTD_{m[1]}", value)
    assert any("ETCD_ENDPOINTS" in k for k in found) and len(found) >= 4, found
    for where, (var, value) in found.items():
        assert problems(env={var: value}) == [], where


def test_check_config_refuses_a_token_group_this_host_has_not(monkeypatch, tmp_path):
    """`agentd run` refuses [api] token_group naming no group of the host at start
    (agentd.daemon.auth); check-config says so too, looking it up as run does (grp.getgrnam).
    load_config (run, reloads) keeps its behaviour: the group is looked up only when the token
    is written."""
    import grp

    groups = {"agentd-readers": grp.struct_group(("agentd-readers", "x", 1234, []))}

    def getgrnam(name):
        return groups[name]

    monkeypatch.setattr(grp, "getgrnam", getgrnam)
    path = write(tmp_path, '[api]\ntoken_group = "nosuchgroup"\n')
    (err,) = problems(path)
    assert str(err) == f"{path}:2: [api] token_group = \"nosuchgroup\": no group named 'nosuchgroup' on this host"
    assert err.key == "api.token_group"
    assert pure(path).api.token_group == "nosuchgroup"  # run's own check stays at the token's writing
    assert problems(env={"AGENTD_API_TOKEN_GROUP": "agentd-readers"}) == []
    assert problems(env={"AGENTD_API_TOKEN_GROUP": ""}) == []  # none


def test_many_originated_prefixes_are_checked_for_duplicates_by_hash(monkeypatch, tmp_path):
    """[bgp] originate's duplicate check is a set's: a list's `in` compared every prefix with
    every one before it (16,000 prefixes took 28 s, a SIGHUP reload blocking the agent's loop).
    Counted, not timed: the prefixes' equality tests stay linear in their number."""
    from ipaddress import ip_network

    from agentd.config import values

    compared = 0

    class Counted(IPv4Network):
        __hash__ = IPv4Network.__hash__

        def __eq__(self, other):
            nonlocal compared
            compared += 1
            return super().__eq__(other)

    parse = values.parse_network
    monkeypatch.setattr(values, "parse_network", lambda s, **kw: Counted(str(parse(s, **kw))))
    nets = [str(ip_network((0x0A000000 + (i << 8), 24))) for i in range(20_000)]
    path = write(tmp_path, "[bgp]\noriginate = [" + ", ".join(f'"{n}"' for n in nets) + "]\n")
    assert [str(n) for n in pure(path).bgp.originate] == nets
    assert compared < 1000, compared  # (a list: 200 million)
    path = write(tmp_path, f'[bgp]\noriginate = ["{nets[0]}", "{nets[1]}", "{nets[0]}"]\n')
    assert "10.0.0.0/24 is listed twice" in str(problems(path)[0])


def test_many_etcd_endpoints_are_checked_for_duplicates_by_hash(tmp_path):
    """[etcd] endpoints: the same set, not a list (40,000 endpoints: 8 s compared pairwise,
    0.4 s by hash; the bound is generous)."""
    import time

    urls = [f"http://h{i}:1" for i in range(40_000)]  # (the file's 1 MiB at most)
    path = write(tmp_path, "[etcd]\nendpoints = [" + ", ".join(f'"{u}"' for u in urls) + "]\n")
    start = time.monotonic()
    assert pure(path).etcd.endpoints == tuple(urls)
    assert time.monotonic() - start < 4
