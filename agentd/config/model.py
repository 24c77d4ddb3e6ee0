"""agentd's configuration as the daemon uses it: one frozen dataclass per section of the file
(:class:`Config` holds them) and the error every problem with it is.  How it is read and
validated from the file, the environment and the command line, and what a reload applies
(:func:`agentd.config.settings.reloaded`), is :mod:`agentd.config.settings`, which also exports
every name here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path
from typing import Any

from agentd.backend_table import NAMES, mtu_overhead
from agentd.config.values import HostPort, IPAddress, IPNetwork, one_line

DEFAULT_CONFIG_PATH = "/etc/agentd/agentd.toml"
MAX_CONFIG_BYTES = 1 << 20  # a configuration file larger than this is a mistake
ENV_PREFIX = "AGENTD_"

# The backends, their MTU overhead (mtu = "auto" subtracts it from the underlay MTU) and data
# paths: one table, agentd.backend_table.
BACKENDS = NAMES
DATAPATH_CHOICES = ("auto", "bpf", "userspace")
# How the BPF programs go on a device: tcx (Linux 6.6), cls_bpf on a clsact qdisc, or the first
# where the kernel has it.
BPF_ATTACH_CHOICES = ("auto", "tcx", "clsact")
# Which families pods have addresses in: IPv4 only (the default), both, or IPv6 only.
IP_FAMILIES = ("ipv4", "dual", "ipv6")
IPV6_MIN_MTU = 1280  # RFC 8200 §5: every link that carries IPv6
# A node's IPv6 pod subnet needs a gateway and at least one pod (::0 is the subnet-router
# anycast address, RFC 4291 §2.6.1): /126 is the smallest, as /30 is for IPv4.
MAX_SUBNET_LEN_V6 = 126

_SECRET_MASK = "********"


class ConfigError(ValueError):
    """One problem in the configuration.

    ``key`` is the dotted key ("bgp.hold_time", "bgp.peers[0].asn") or None for a problem with
    the file itself; ``source`` the file path, "AGENTD_X=value", "--set k=v" or "default";
    ``line`` the line in the file when known; ``message`` what is wrong. ``problems`` lists every
    problem found when load_config raised this one (itself first).
    """

    def __init__(self, message: str, *, source: str, key: str | None = None,
                 where: str | None = None, line: int | None = None) -> None:
        self.message, self.source, self.key, self.where, self.line = message, source, key, where, line
        self.problems: list[ConfigError] = [self]
        super().__init__(message)

    def __str__(self) -> str:
        head = f"{self.source}:{self.line}" if self.line else self.source
        text = f"{head}: {self.where}: {self.message}" if self.where else f"{head}: {self.message}"
        more = len(self.problems) - 1
        if more:
            text += f" (and {more} more problem{'s' * (more > 1)}; see agentd check-config)"
        return one_line(text)




@dataclass(frozen=True)
class NodeConfig:
    name: str | None  # None only when loaded without host facts (host=None)
    address: IPv4Address | None  # None only when loaded without host facts (host=None)
    asn: int = 64512
    route_reflector: bool = False
    cluster_id: IPv4Address | None = None  # the node address when route_reflector
    address_v6: IPv6Address | None = None  # underlay IPv6 (dual, ipv6); None: none (dual) or not computed


@dataclass(frozen=True)
class NetworkConfig:
    cidr: IPv4Network = IPv4Network("10.244.0.0/16")
    subnet_len: int = 24
    backend: str = "host-gw"
    encap: str = "always"
    mtu: int | None = None  # None: auto
    route_protocol: int = 143
    vxlan_vni: int = 1
    vxlan_port: int = 4789
    udp_port: int = 8285
    datapath: str = "auto"  # udp and ipip: "bpf" (tc-BPF), "userspace" (TUN worker), "auto" (bpf where it loads)
    bpf_pod_redirect: bool = True  # BPF: decapsulated packets go straight to the pod's bridge port
    bpf_pod_fast_path: bool = True  # BPF: accepted TCP between two pods of this node goes pod to pod
    bpf_attach: str = "auto"  # BPF programs' hook: "tcx", "clsact", "auto" (tcx where the kernel has it)
    service_cidr: IPv4Network = IPv4Network("10.96.0.0/12")  # Services: the cluster IP range
    ip_masq: bool = False  # masquerade traffic from the pod network to outside it (flannel's ipMasq)
    ip_family: str = "ipv4"  # "ipv4", "dual" or "ipv6": the families pods have addresses in
    # A ULA /48 as RFC 4193 §3.1 lays it out (40-bit global ID, 16-bit subnet ID): one /64
    # per node for 65,536 nodes, the most kube-controller-manager allows (node mask - cluster
    # mask <= 16).
    cidr_v6: IPv6Network = IPv6Network("fd00:10:244::/48")
    subnet_len_v6: int = 64  # kube-controller-manager's --node-cidr-mask-size-ipv6 default
    # Services' IPv6 cluster IPs (dual, ipv6): a ULA range of 65,536 addresses, kubeadm's
    # dual-stack example (fd00:10:96::/112 beside 10.96.0.0/12).
    service_cidr_v6: IPv6Network = IPv6Network("fd00:10:96::/112")

    @property
    def families(self) -> tuple[int, ...]:
        """The IP versions pods have addresses in: (4,), (4, 6) or (6,)."""
        return {"ipv4": (4,), "dual": (4, 6), "ipv6": (6,)}[self.ip_family]

    def pod_mtu(self, underlay_mtu: int, underlay_family: int = 4) -> int:
        """The MTU for pod interfaces: the configured one, or the underlay's minus the overhead
        of the backend's outer headers in the underlay's family (an IPv6 outer header is 20
        bytes longer than an IPv4 one)."""
        return self.mtu if self.mtu is not None else underlay_mtu - mtu_overhead(self.backend, underlay_family)


@dataclass(frozen=True)
class EtcdConfig:
    endpoints: tuple[str, ...] = ("http://127.0.0.1:2379",)
    prefix: str = "/agentd"
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    lease_ttl: int = 30


@dataclass(frozen=True)
class BgpPeerConfig:
    address: IPAddress
    asn: int
    password: str | None = None
    passive: bool = False
    rr_client: bool = False
    port: int = 179
    # None: [bgp] hold_time, taken when the session is made from the running configuration
    # (agentd.daemon.speaker.peer_settings), so a reload that changes only [bgp] hold_time (applied by
    # a restart) leaves the sessions alone.
    hold_time: int | None = None
    description: str = ""
    local_address: IPAddress | None = None
    max_prefixes: int | None = None  # RFC 4486 Cease/1 beyond this many prefixes of a family
    max_prefixes_warning: int = 75  # percent of max_prefixes that logs a warning
    max_prefixes_restart: int | None = None  # seconds until the peer is tried again; None: reconfigure
    ttl_security: bool = False  # RFC 5082 GTSM, directly connected peer
    bfd: bool | None = None  # None: [bgp] bfd


@dataclass(frozen=True)
class ListenRangeConfig:
    """[[bgp.listen_ranges]]: accept any peer from ``prefix`` (dynamic neighbours)."""

    prefix: IPNetwork
    asn: int
    rr_client: bool = False
    password: str | None = None
    hold_time: int | None = None  # None: [bgp] hold_time (as for BgpPeerConfig)
    description: str = ""
    max_prefixes: int | None = None
    max_prefixes_warning: int = 75
    max_prefixes_restart: int | None = None
    ttl_security: bool = False
    bfd: bool | None = None


@dataclass(frozen=True)
class BgpConfig:
    mode: str = "mesh"
    listen: HostPort | None = HostPort("0.0.0.0", 179)  # None: do not listen
    router_id: IPv4Address | None = None  # node.address unless set
    asn: int = 64512  # node.asn unless set
    hold_time: int = 90
    keepalive_time: int = 30  # hold_time // 3 unless set
    connect_retry: float = 5.0
    password: str | None = None
    graceful_restart: bool = True
    restart_time: int = 120
    originate: tuple[IPNetwork, ...] = ()
    # Our next hop for IPv6 routes sent over IPv4 sessions; None: the IPv4-mapped IPv6 address.
    next_hop_v6: IPv6Address | None = None
    send_timeout: float = 60.0
    batch_delay: float = 0.01
    listen_backlog: int = 4096
    bfd: bool = False
    bfd_interval: float = 0.3
    bfd_multiplier: int = 3
    peers: tuple[BgpPeerConfig, ...] = ()
    listen_ranges: tuple[ListenRangeConfig, ...] = ()


@dataclass(frozen=True)
class ApiConfig:
    listen: HostPort = HostPort("127.0.0.1", 9099)
    # The bearer token that POST /leave (every request that changes something) must carry;
    # `agentd run` writes a new one at every start (agentd/daemon/auth.py).
    token_file: Path = Path("/run/agentd/api.token")
    token_group: str | None = None  # a group that may read it too (mode 0640)
    # The read-only listener other nodes gather the cluster view from: the node's address and
    # this port (0: none), its GET endpoints only, each with the cluster read token.
    cluster_port: int = 9098
    read_token_file: Path | None = None  # the token; default: the one the agents keep in etcd


@dataclass(frozen=True)
class FlowsConfig:
    """Flow records (docs/observability.md): conntrack events and logged drops."""

    enabled: bool = True
    # Connection records (conntrack events, the fast path's counts); false: drops only, which
    # costs the data path nothing per connection (docs/observability.md).
    connections: bool = True
    ring_size: int = 10_000  # records kept per node
    log_group: int = 143  # the NFLOG group of the drop rules (per network namespace)
    log_rate: int = 100  # drops a second each drop rule logs at most (nft limit)
    record_rate: float = 10.0  # drop records a second the agent keeps per (reason, source, destination, port)


@dataclass(frozen=True)
class PolicyConfig:
    """NetworkPolicy on the pod bridges (docs/policy.md)."""

    # A pod port's frames must carry the pod's MAC as agentd-cni's delegate reported it (a pod
    # sending another's MAC would move the bridge's forwarding entry for it to its own port).
    # False: no source-MAC check, for pods whose MAC changes after agentd-cni's ADD.
    check_source_mac: bool = True


@dataclass(frozen=True)
class CniConfig:
    conf_dir: Path = Path("/etc/cni/net.d")
    bin_dir: tuple[Path, ...] = (Path("/opt/cni/bin"), Path("/usr/lib/cni"))
    subnet_file: Path = Path("/run/agentd/subnet.env")
    data_dir: Path = Path("/var/lib/agentd/cni")
    ipam_data_dir: Path = Path("/var/lib/cni/networks")
    write_conflist: bool = True


@dataclass(frozen=True)
class DnsConfig:
    """Service DNS: the agent answers <svc>.<ns>.svc.<cluster_domain> on a node-local address."""

    enabled: bool = True
    address: IPv4Address = IPv4Address("169.254.20.10")  # NodeLocal DNSCache's usual address
    # Where pods without IPv4 ask (clusters with IPv6): a ULA address, as NodeLocal DNSCache
    # advises for IPv6, spelling 169.254.20.10 in its groups.
    address_v6: IPv6Address = IPv6Address("fd00:169:254:20::10")
    cluster_domain: str = "cluster.local"
    upstream: tuple[str, ...] = ()  # "IP:PORT" to forward other names to; empty: /etc/resolv.conf's


@dataclass(frozen=True)
class IngressConfig:
    """The Ingress controller: a HAProxy on this node's addresses, routing by the Ingresses of
    ``controller``'s IngressClasses (docs/ingress.md)."""

    enabled: bool = False
    http_port: int = 80
    https_port: int = 443
    addresses: tuple[IPAddress, ...] = ()  # empty: [node] address
    controller: str = "agentd.io/ingress-controller"
    configmap: str = "kube-system/agentd-ingress"
    watch_without_class: bool = False
    haproxy: str = "haproxy"
    # The user HAProxy's workers run as (with its primary group); "root": as root (not advised);
    # "" (the default): "haproxy" where the agent may switch to it, else root with a warning
    # (a node upgraded without the drop-in's new lines keeps its proxy running).
    user: str = ""
    # Where HAProxy's access log lines go: "agent" (the agent's own log, as
    # agentd.ingress.access), "off" (HAProxy logs nothing), or the absolute path of a file
    # appended to (agentd.ingress.access_log).  Whether HAProxy logs requests at all is the
    # ConfigMap's enable-access-log.
    access_log: str = "agent"


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"
    format: str = "text"


@dataclass(frozen=True)
class AgentConfig:
    state_dir: Path = Path("/var/lib/agentd")
    route_resync: float = 30.0
    bpf_dir: Path = Path("/sys/fs/bpf/agentd")  # pins of the BPF data path (a bpffs)


@dataclass(frozen=True)
class Config:
    node: NodeConfig
    network: NetworkConfig = field(default_factory=NetworkConfig)
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    bgp: BgpConfig = field(default_factory=BgpConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    cni: CniConfig = field(default_factory=CniConfig)
    dns: DnsConfig = field(default_factory=DnsConfig)
    flows: FlowsConfig = field(default_factory=FlowsConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    ingress: IngressConfig = field(default_factory=IngressConfig)
    log: LogConfig = field(default_factory=LogConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    source: str | None = None  # the file read, None when only defaults/env/overrides

    def to_dict(self) -> dict[str, Any]:
        """The effective configuration as JSON-able data in the file's shape, secrets masked."""
        out = {s: _jsonable(getattr(self, s)) for s in SECTIONS}
        out["network"]["mtu"] = "auto" if self.network.mtu is None else self.network.mtu
        out["bgp"]["listen"] = "" if self.bgp.listen is None else str(self.bgp.listen)
        out["cni"]["bin_dir"] = ":".join(str(p) for p in self.cni.bin_dir)
        for d in [out["bgp"], *out["bgp"]["peers"], *out["bgp"]["listen_ranges"]]:
            d["password"] = _SECRET_MASK if d["password"] else None
        for d in [*out["bgp"]["peers"], *out["bgp"]["listen_ranges"]]:
            if d["hold_time"] is None:  # the hold time the session offers: [bgp] hold_time
                d["hold_time"] = self.bgp.hold_time
        return out


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if dataclasses.is_dataclass(v) and not isinstance(v, HostPort):
        return {f.name: _jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)}
    return str(v)  # addresses, networks, paths, HostPort


#: The sections of the file, in its order: Config's fields but ``source``.
SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.name != "source")
