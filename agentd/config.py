"""agentd's configuration: a TOML file, AGENTD_<SECTION>_<KEY> environment variables and
command-line overrides, merged in that order (later wins) and validated completely before
the daemon touches anything.

Every problem is a :class:`ConfigError` whose ``str()`` is one line naming where the value came
from and the key, e.g.::

    /etc/agentd/agentd.toml:14: [bgp] hold_time = 2: must be 0 or at least 3
    AGENTD_NETWORK_BACKEND=foo: [network] backend: must be one of host-gw, ipip, vxlan, udp
    --set bgp.listen=1.2.3.4: [bgp] listen: must be host:port, e.g. 0.0.0.0:179

:func:`check_config` returns all problems; :func:`load_config` raises the first one (its
``problems`` attribute holds them all). The keys, their defaults and the reasons for them are
documented in etc/agentd.toml, which the unit tests hold equal to the defaults here.

Reading the system is allowed (the hostname, the default route, TLS files), changing it is not:
this module never writes anything.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import socket
import tomllib
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network
from pathlib import Path
from typing import Any, Protocol

DEFAULT_CONFIG_PATH = "/etc/agentd/agentd.toml"
ENV_PREFIX = "AGENTD_"

# Bytes of encapsulation each backend adds to a pod packet; mtu = "auto" subtracts this
# from the underlay MTU. IPIP: outer IPv4 header (RFC 2003). VXLAN: outer IPv4 + UDP +
# VXLAN header + inner Ethernet (RFC 7348 §5). udp: outer IPv4 + UDP (flannel UDP wire format).
_MTU_OVERHEAD = {"host-gw": 0, "ipip": 20, "vxlan": 50, "udp": 28}
BACKENDS = tuple(_MTU_OVERHEAD)

# Route protocol numbers include/uapi/linux/rtnetlink.h gives to the kernel, administrators and
# other routing daemons: owning routes with one of them would mean deleting someone else's routes.
_RESERVED_PROTOCOLS = {
    0: "unspec", 1: "redirect", 2: "kernel", 3: "boot", 4: "static", 8: "gated", 9: "ra",
    10: "mrt", 11: "zebra", 12: "bird", 13: "dnrouted", 14: "xorp", 15: "ntk", 16: "dhcp",
    17: "mrouted", 18: "keepalived", 42: "babel", 99: "openr", 186: "bgp", 187: "isis",
    188: "ospf", 189: "rip", 192: "eigrp",
}
_AS_TRANS = 23456  # RFC 6793 §9: a placeholder in 2-octet fields, never a real AS
_TCP_MD5_MAX_KEY = 80  # TCP_MD5SIG_MAXKEYLEN in include/uapi/linux/tcp.h
_SECRET_MASK = "********"


def mtu_overhead(backend: str) -> int:
    """Bytes of encapsulation ``backend`` adds to every pod packet."""
    try:
        return _MTU_OVERHEAD[backend]
    except KeyError:
        raise ValueError(f"unknown backend {backend!r}; one of {', '.join(BACKENDS)}") from None


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
        return _one_line(text)


@dataclass(frozen=True)
class HostPort:
    """A listen address: an IP literal and a port (0 = any free port)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> HostPort:
        """Parse "192.0.2.1:179" or "[::]:179"; raises ValueError saying what is wrong."""
        m = re.fullmatch(r"\[([^\]]*)\]:([0-9]{1,5})|([^:\[\]]*):([0-9]{1,5})", text.strip())
        if not m:
            raise ValueError("must be host:port, e.g. 0.0.0.0:179 or [::]:179")
        host, port = (m[1], m[2]) if m[1] is not None else (m[3], m[4])
        try:
            addr = ip_address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IP address (write host:port, e.g. 0.0.0.0:179)") from None
        if int(port) > 65535:
            raise ValueError(f"port {port} is not 0..65535")
        if m[1] is not None and addr.version == 4:
            raise ValueError("brackets are for IPv6 addresses only")
        return cls(str(addr), int(port))


IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network


@dataclass(frozen=True)
class NodeConfig:
    name: str | None  # None only with resolve_defaults=False
    address: IPv4Address | None  # None only with resolve_defaults=False
    asn: int = 64512
    route_reflector: bool = False
    cluster_id: IPv4Address | None = None  # the node address when route_reflector


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
    ipip_mode: str = "auto"

    def pod_mtu(self, underlay_mtu: int) -> int:
        """The MTU for pod interfaces: the configured one, or the underlay's minus the overhead."""
        return self.mtu if self.mtu is not None else underlay_mtu - mtu_overhead(self.backend)


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
    hold_time: int = 90  # [bgp] hold_time unless set
    description: str = ""
    local_address: IPAddress | None = None


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
    peers: tuple[BgpPeerConfig, ...] = ()


@dataclass(frozen=True)
class ApiConfig:
    listen: HostPort = HostPort("127.0.0.1", 9099)


@dataclass(frozen=True)
class CniConfig:
    conf_dir: Path = Path("/etc/cni/net.d")
    bin_dir: tuple[Path, ...] = (Path("/opt/cni/bin"), Path("/usr/lib/cni"))
    subnet_file: Path = Path("/run/agentd/subnet.env")
    data_dir: Path = Path("/var/lib/agentd/cni")
    ipam_data_dir: Path = Path("/var/lib/cni/networks")
    write_conflist: bool = True


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"
    format: str = "text"


@dataclass(frozen=True)
class AgentConfig:
    state_dir: Path = Path("/var/lib/agentd")
    route_resync: float = 30.0


@dataclass(frozen=True)
class Config:
    node: NodeConfig
    network: NetworkConfig = field(default_factory=NetworkConfig)
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    bgp: BgpConfig = field(default_factory=BgpConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    cni: CniConfig = field(default_factory=CniConfig)
    log: LogConfig = field(default_factory=LogConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    source: str | None = None  # the file read, None when only defaults/env/overrides

    def to_dict(self) -> dict[str, Any]:
        """The effective configuration as JSON-able data in the file's shape, secrets masked."""
        out = {s: _jsonable(getattr(self, s)) for s in _SECTIONS}
        out["network"]["mtu"] = "auto" if self.network.mtu is None else self.network.mtu
        out["bgp"]["listen"] = "" if self.bgp.listen is None else str(self.bgp.listen)
        out["cni"]["bin_dir"] = ":".join(str(p) for p in self.cni.bin_dir)
        for d in [out["bgp"], *out["bgp"]["peers"]]:
            d["password"] = _SECRET_MASK if d["password"] else None
        return out


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if dataclasses.is_dataclass(v) and not isinstance(v, HostPort):
        return {f.name: _jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)}
    return str(v)  # addresses, networks, paths, HostPort


# ----------------------------------------------------------------------------------------------
# Value kinds: how a key's value is read from TOML and from text (env / --set), then checked.


class _Bad(Exception):
    """The value is wrong; the message says why, the caller says where it came from."""


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
               list: "an array", dict: "a table"}


def _type_name(v: Any) -> str:
    return _TYPE_NAMES.get(type(v), type(v).__name__)


@dataclass(frozen=True)
class _Kind:
    types: tuple[type, ...]  # TOML/JSON types accepted
    what: str  # "an integer", for "must be an integer, not a string"
    text: Callable[[str], Any]  # text (env, --set) -> a value of one of ``types``
    check: Callable[[Any, Path], Any]  # value, base dir for relative paths -> final value

    def from_value(self, v: Any, base: Path) -> Any:
        if not isinstance(v, self.types) or (isinstance(v, bool) and bool not in self.types):
            raise _Bad(f"must be {self.what}, not {_type_name(v)}")
        return self.check(v, base)

    def from_text(self, s: str, base: Path) -> Any:
        return self.check(self.text(s), base)


def _text_int(s: str) -> int:
    if not re.fullmatch(r"\s*[+-]?[0-9]{1,20}\s*", s):
        raise _Bad("must be an integer")
    return int(s)


def _text_float(s: str) -> float:
    if not re.fullmatch(r"\s*[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?\s*", s):
        raise _Bad("must be a number")
    return float(s)


def _text_bool(s: str) -> bool:
    word = s.strip().lower()
    if word in ("true", "1", "yes", "on"):
        return True
    if word in ("false", "0", "no", "off"):
        return False
    raise _Bad("must be true or false (also 1/0, yes/no, on/off)")


def _text_list(s: str) -> list[str]:
    return [part.strip() for part in s.split(",") if part.strip()]


def _int(lo: int, hi: int, extra: Callable[[int], None] | None = None) -> _Kind:
    def check(n: int, _base: Path) -> int:
        if extra:
            extra(n)
        if not lo <= n <= hi:
            raise _Bad(f"must be {lo}..{hi}")
        return n
    return _Kind((int,), "an integer", _text_int, check)


def _float(lo: float, hi: float) -> _Kind:
    def check(x: float, _base: Path) -> float:
        if not math.isfinite(x) or not lo <= x <= hi:
            raise _Bad(f"must be a number of seconds, {lo:g}..{hi:g}")
        return float(x)
    return _Kind((int, float), "a number", _text_float, check)


def _choice(*choices: str) -> _Kind:
    def check(s: str, _base: Path) -> str:
        if s not in choices:
            raise _Bad(f"must be one of {', '.join(choices)}")
        return s
    return _Kind((str,), "a string", str, check)


def _string(check: Callable[[str], Any]) -> _Kind:
    return _Kind((str,), "a string", str, lambda s, _base: check(s))


def _check_asn(n: int) -> None:
    if n == _AS_TRANS:
        raise _Bad("23456 is AS_TRANS (RFC 6793), not a usable AS number")


def _check_hold_time(n: int) -> None:
    # RFC 4271 §4.2: the Hold Time MUST be either zero or at least three seconds.
    if n in (1, 2) or not 0 <= n <= 65535:
        raise _Bad("must be 0 or at least 3" if n in (1, 2) else "must be 0 or 3..65535")


def _check_protocol(n: int) -> None:
    if n in _RESERVED_PROTOCOLS:
        raise _Bad(f"{n} is the kernel's RTPROT_{_RESERVED_PROTOCOLS[n].upper()}; pick an unassigned "
                   "number so agentd never owns someone else's routes")


def _ipv4(s: str, *, unicast: bool = True) -> IPv4Address | None:
    if not s.strip():  # empty: not set
        return None
    try:
        addr = ip_address(s.strip())
    except ValueError:
        raise _Bad("must be an IPv4 address") from None
    if addr.version != 4:
        raise _Bad("must be an IPv4 address, not IPv6")
    if unicast and (addr.is_unspecified or addr.is_multicast or addr == IPv4Address("255.255.255.255")):
        raise _Bad("must be a unicast address")
    return addr


def _ipv6_or_none(s: str) -> IPv6Address | None:
    if not s.strip():
        return None
    a = _any_ip(s)
    if not isinstance(a, IPv6Address) or a.is_unspecified or a.is_multicast:
        raise _Bad("must be a unicast IPv6 address")
    return a


def _any_ip(s: str) -> IPAddress:
    try:
        addr = ip_address(s.strip())
    except ValueError:
        raise _Bad("must be an IPv4 or IPv6 address") from None
    if addr.is_unspecified or addr.is_multicast:
        raise _Bad("must be a unicast address")
    return addr


def _network(s: str, *, v4_only: bool) -> IPNetwork:
    try:
        net = ip_network(s.strip(), strict=False)
    except ValueError:
        raise _Bad(f"must be {'an IPv4' if v4_only else 'an IP'} network like 10.244.0.0/16") from None
    if v4_only and net.version != 4:
        raise _Bad("must be an IPv4 network")
    if "/" not in s:
        example = f"{net.network_address}/{16 if v4_only else net.max_prefixlen}"
        raise _Bad(f"needs a prefix length, e.g. {example}")
    if net.network_address != ip_address(s.strip().split("/")[0]):
        raise _Bad(f"has host bits set (did you mean {net}?)")
    return net


def _cluster_id(v: int | str, _base: Path) -> IPv4Address | None:
    # RFC 4456 §7: a 4-octet CLUSTER_ID, written as a dotted quad or an integer.
    if isinstance(v, int):
        if not 0 <= v <= 0xFFFFFFFF:
            raise _Bad("must be an IPv4 address or an integer 0..4294967295")
        return IPv4Address(v)
    if re.fullmatch(r"\s*[0-9]{1,10}\s*", v):
        return _cluster_id(int(v), _base)
    return _ipv4(v, unicast=False)


def _mtu(v: int | str, _base: Path) -> int | None:
    if isinstance(v, str):
        if v.strip() == "auto":
            return None
        if not re.fullmatch(r"\s*[0-9]{1,6}\s*", v):
            raise _Bad('must be "auto" or an integer')
        v = int(v)
    if not 576 <= v <= 65535:  # RFC 791: every IPv4 host accepts 576-octet datagrams
        raise _Bad('must be "auto" or 576..65535')
    return v


def _node_name(s: str) -> str | None:
    if not s.strip():
        return None
    if len(s) > 253 or not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", s):
        raise _Bad("must be a host name (letters, digits, '.', '-', '_'; at most 253)")
    return s


def _password(s: str) -> str | None:
    if not s:
        return None
    if len(s.encode()) > _TCP_MD5_MAX_KEY or "\0" in s:
        raise _Bad(f"must be at most {_TCP_MD5_MAX_KEY} bytes (TCP MD5 key) without NUL")
    return s


def _etcd_prefix(s: str) -> str:
    if not re.fullmatch(r"(/[A-Za-z0-9._-]+)+", s):
        raise _Bad('must be a key path like "/agentd" (leading /, no trailing /)')
    return s


def _endpoints(v: list[Any], _base: Path) -> tuple[str, ...]:
    seen: list[str] = []
    for url in v:
        if not isinstance(url, str):
            raise _Bad(f"must be an array of URLs, not of {_type_name(url)}s")
        shown = repr(_hide_userinfo(url))
        try:
            parts = urllib.parse.urlsplit(url.strip())
            parts.port  # noqa: B018 -- raises ValueError on a bad port
        except ValueError as e:
            raise _Bad(f"{shown}: {e}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _Bad(f"{shown} must be an http:// or https:// URL with a host")
        if parts.path not in ("", "/") or parts.query or parts.fragment or "@" in parts.netloc:
            raise _Bad(f"{shown} must be scheme://host:port only (no path, query or credentials)")
        if url.strip().lower() in seen:
            raise _Bad(f"{shown} is listed twice")
        seen.append(url.strip().lower())
    if not seen:
        raise _Bad("needs at least one endpoint")
    return tuple(u.strip() for u in v)


def _path(s: str, base: Path) -> Path:
    if not s.strip() or "\0" in s:
        raise _Bad("must be a path")
    return Path(os.path.normpath(base / s.strip()))  # absolute as given, else relative to base


def _tls_file(s: str, base: Path) -> Path | None:
    if not s.strip():
        return None
    p = _path(s, base)
    try:
        if not p.is_file():
            raise _Bad(f"{p} does not exist or is not a regular file")
    except OSError as e:  # a directory on the way we may not search, a name too long
        raise _Bad(f"{p}: {e.strerror or e}") from None
    if not os.access(p, os.R_OK):
        raise _Bad(f"{p} is not readable")
    return p


def _bin_dir(v: str | list[Any], base: Path) -> tuple[Path, ...]:
    items = v.split(":") if isinstance(v, str) else v
    if not items or any(not isinstance(i, str) or not i.strip() for i in items):
        raise _Bad("must be a search path of directories like /opt/cni/bin:/usr/lib/cni")
    return tuple(_path(i, base) for i in items)


def _originate(v: list[Any], _base: Path) -> tuple[IPNetwork, ...]:
    nets: list[IPNetwork] = []
    for s in v:
        if not isinstance(s, str):
            raise _Bad(f"must be an array of prefixes, not of {_type_name(s)}s")
        net = _network(s, v4_only=False)
        if net in nets:
            raise _Bad(f"{net} is listed twice")
        nets.append(net)
    return tuple(nets)


def _listen(*, allow_empty: bool) -> _Kind:
    def check(s: str, _base: Path) -> HostPort | None:
        if allow_empty and not s.strip():
            return None
        try:
            return HostPort.parse(s)
        except ValueError as e:
            raise _Bad(str(e)) from None
    return _Kind((str,), "a string", str, check)


def _cwd() -> Path:
    """Where relative paths from the environment and the command line start."""
    try:
        return Path.cwd()
    except OSError:  # the working directory was removed under us
        return Path("/")


def _text_json(s: str) -> Any:
    try:
        return json.loads(s) if s.strip() else []
    except (ValueError, RecursionError) as e:  # JSONDecodeError, or absurd numbers and nesting
        raise _Bad(f"must be a JSON array of peer objects ({_shorten(str(e))})") from None


def _peer_list(v: Any, _base: Path) -> list[Any]:
    if not isinstance(v, list):  # JSON text can hold anything
        raise _Bad(f"must be an array of peers, not {_type_name(v)}")
    return v


_BOOL = _Kind((bool,), "a boolean", _text_bool, lambda b, _base: b)
_ASN = _int(1, 4294967295, _check_asn)
_HOLD_TIME = _int(0, 65535, _check_hold_time)
_PORT = _int(1, 65535)
_PASSWORD = _string(_password)
_PATH = _Kind((str,), "a string", str, _path)


@dataclass(frozen=True)
class _Key:
    section: str
    name: str
    kind: _Kind
    default: Any
    secret: bool = False

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"


_KEYS = (
    _Key("node", "name", _string(_node_name), None),
    _Key("node", "address", _string(_ipv4), None),
    _Key("node", "asn", _ASN, 64512),
    _Key("node", "route_reflector", _BOOL, False),
    _Key("node", "cluster_id", _Kind((int, str), "an IPv4 address or an integer", str, _cluster_id), None),
    _Key("network", "cidr", _string(lambda s: _network(s, v4_only=True)), NetworkConfig.cidr),
    _Key("network", "subnet_len", _int(1, 32), 24),
    _Key("network", "backend", _choice(*BACKENDS), "host-gw"),
    _Key("network", "encap", _choice("always", "cross-subnet"), "always"),
    _Key("network", "mtu", _Kind((int, str), '"auto" or an integer', str, _mtu), None),
    _Key("network", "route_protocol", _int(1, 255, _check_protocol), 143),
    _Key("network", "vxlan_vni", _int(1, 16777215), 1),  # 24-bit VNI, RFC 7348 §5
    _Key("network", "vxlan_port", _PORT, 4789),
    _Key("network", "udp_port", _PORT, 8285),
    _Key("network", "ipip_mode", _choice("auto", "kernel", "userspace"), "auto"),
    _Key("etcd", "endpoints", _Kind((list,), "an array", _text_list, _endpoints), EtcdConfig.endpoints),
    _Key("etcd", "prefix", _string(_etcd_prefix), "/agentd"),
    _Key("etcd", "ca", _Kind((str,), "a string", str, _tls_file), None),
    _Key("etcd", "cert", _Kind((str,), "a string", str, _tls_file), None),
    _Key("etcd", "key", _Kind((str,), "a string", str, _tls_file), None),
    _Key("etcd", "lease_ttl", _int(2, 86400), 30),
    _Key("bgp", "mode", _choice("mesh", "route-reflector"), "mesh"),
    _Key("bgp", "listen", _listen(allow_empty=True), BgpConfig.listen),
    _Key("bgp", "router_id", _string(_ipv4), None),
    _Key("bgp", "asn", _ASN, None),
    _Key("bgp", "hold_time", _HOLD_TIME, 90),
    _Key("bgp", "keepalive_time", _int(0, 21845), None),
    _Key("bgp", "connect_retry", _float(0.1, 3600), 5.0),
    _Key("bgp", "password", _PASSWORD, None, secret=True),
    _Key("bgp", "graceful_restart", _BOOL, True),
    _Key("bgp", "restart_time", _int(1, 4095), 120),  # 12-bit field, RFC 4724 §3
    _Key("bgp", "originate", _Kind((list,), "an array", _text_list, _originate), ()),
    _Key("bgp", "next_hop_v6", _string(_ipv6_or_none), None),
    _Key("bgp", "peers", _Kind((list,), "an array of tables", _text_json, _peer_list), ()),
    _Key("api", "listen", _listen(allow_empty=False), ApiConfig.listen),
    _Key("cni", "conf_dir", _PATH, CniConfig.conf_dir),
    _Key("cni", "bin_dir", _Kind((str, list), "a string or an array", str, _bin_dir), CniConfig.bin_dir),
    _Key("cni", "subnet_file", _PATH, CniConfig.subnet_file),
    _Key("cni", "data_dir", _PATH, CniConfig.data_dir),
    _Key("cni", "ipam_data_dir", _PATH, CniConfig.ipam_data_dir),
    _Key("cni", "write_conflist", _BOOL, True),
    _Key("log", "level", _choice("debug", "info", "warning", "error"), "info"),
    _Key("log", "format", _choice("text", "json"), "text"),
    _Key("agent", "state_dir", _PATH, AgentConfig.state_dir),
    _Key("agent", "route_resync", _float(0.1, 3600), 30.0),
)
_BY_PATH = {k.path: k for k in _KEYS}
_SECTIONS = tuple(dict.fromkeys(k.section for k in _KEYS))
CONFIG_KEYS: tuple[str, ...] = tuple(_BY_PATH)

_PEER_KINDS: dict[str, _Kind] = {
    "address": _string(_any_ip),
    "asn": _ASN,
    "password": _PASSWORD,
    "passive": _BOOL,
    "rr_client": _BOOL,
    "port": _PORT,
    "hold_time": _HOLD_TIME,
    "description": _string(lambda s: s),
    "local_address": _string(lambda s: _any_ip(s) if s.strip() else None),
}
PEER_KEYS: tuple[str, ...] = tuple(_PEER_KINDS)


def _suggest(word: str, candidates: list[str] | tuple[str, ...], shape: Callable[[str], str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {shape(close[0])}?)" if close else ""


def _show_value(v: Any, depth: int = 0) -> str:
    """A TOML value as it would be written, shortened to keep errors on one line."""
    if depth > 2 and isinstance(v, (list, dict)):
        text = "..."
    elif isinstance(v, bool):
        text = "true" if v else "false"
    elif isinstance(v, str):
        text = json.dumps(_hide_userinfo(v), ensure_ascii=False)
    elif isinstance(v, list):
        text = "[" + ", ".join(_show_value(x, depth + 1) for x in v[:8]) + "]"
    elif isinstance(v, dict):
        text = "{" + ", ".join(f"{k} = {_show_value(x, depth + 1)}" for k, x in list(v.items())[:8]) + "}"
    else:
        text = str(v)
    return _shorten(text)


def _show_text(s: str) -> str:
    return _shorten(_one_line(_hide_userinfo(s)))


def _hide_userinfo(text: str) -> str:
    """http://user:pw@host -> http://***@host: credentials never reach an error line or a log."""
    return re.sub(r"//[^/@\s]*@", "//***@", text)


def _one_line(text: str) -> str:
    """Escape what would break the line (newlines, U+2028, control characters) in user text."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------------------------
# Where values come from.


@dataclass(frozen=True)
class _Origin:
    rank: int  # 0 default, 1 file, 2 environment, 3 command line: higher wins
    label: str  # the ConfigError source
    line: int | None = None
    shown: str | None = None  # value as written in the file: "[bgp] hold_time = 2"


_DEFAULT = _Origin(0, "default")


class HostFacts(Protocol):
    """What computed defaults read from the host. LocalHost reads this machine; pure tests pass
    their own."""

    def hostname(self) -> str: ...

    def default_address(self) -> IPv4Address | None: ...


class LocalHost:
    """Reads (never changes) the hostname and the IPv4 default route of the current namespace."""

    def hostname(self) -> str:
        return socket.gethostname()

    def default_address(self) -> IPv4Address | None:
        """The source address the kernel uses for the main table's best IPv4 default route."""
        from pyroute2 import IPRoute  # only the daemon needs netlink, not every config reader

        with IPRoute() as ipr:
            defaults = [r for r in ipr.route("dump", family=socket.AF_INET, table=254) if r["dst_len"] == 0]
            if not defaults:
                return None
            best = min(defaults, key=lambda r: r.get("RTA_PRIORITY") or 0)
            src = best.get("RTA_PREFSRC")
            if src is None and best.get("RTA_GATEWAY"):
                # The kernel's own source selection for the gateway, as `ip route get` shows it.
                got = ipr.route("get", dst=best.get("RTA_GATEWAY"))
                src = got[0].get("RTA_PREFSRC") if got else None
            if src is None and best.get("RTA_OIF"):
                addrs = ipr.get_addr(family=socket.AF_INET, index=best.get("RTA_OIF"))
                src = addrs[0].get("IFA_ADDRESS") if addrs else None
        return IPv4Address(src) if src else None


class _Loader:
    """Collects values with their origins and every problem, then builds the Config."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {k.path: k.default for k in _KEYS}
        self.origins: dict[str, _Origin] = {k.path: _DEFAULT for k in _KEYS}
        self.peer_origins: list[tuple[int, dict[str, _Origin]]] = []  # (index in the source, origins)
        self.bad: set[str] = set()
        self.problems: list[ConfigError] = []
        self.file_failed = False
        self.source: str | None = None
        self.lines: list[str] = []

    def problem(self, message: str, origin: _Origin, key: str | None = None, where: str | None = None,
                show: bool = True) -> None:
        if where and show and origin.shown is not None:
            where += f" = {origin.shown}"
        error = ConfigError(message, source=origin.label, key=key, where=where, line=origin.line)
        self.problems.append(error)

    def blame(self, *paths: str) -> str:
        """Of keys that conflict, the one set by the strongest source (the first on a tie)."""
        return max(paths, key=lambda p: self.origins[p].rank)

    def key_problem(self, path: str, message: str) -> None:
        sec, name = path.split(".", 1)
        self.problem(message, self.origins[path], path, f"[{sec}] {name}", show=not _BY_PATH[path].secret)

    def set(self, key: _Key, raw: Any, origin: _Origin, base: Path, from_text: bool) -> None:
        try:
            value = key.kind.from_text(raw, base) if from_text else key.kind.from_value(raw, base)
        except _Bad as e:
            self.bad.add(key.path)
            if key.path == "bgp.peers":  # the peers that were replaced are not the ones to check
                self.values[key.path], self.peer_origins = (), []
            self.problem(str(e), origin, key.path, f"[{key.section}] {key.name}", show=not key.secret)
            return
        self.bad.discard(key.path)
        self.values[key.path], self.origins[key.path] = value, origin
        if key.path == "bgp.peers":
            self.values[key.path] = self.read_peers(value, origin)

    def read_peers(self, raw: list[Any], origin: _Origin) -> tuple[dict[str, Any], ...]:
        """Each [[bgp.peers]] table as {field: value}; problems are reported per field."""
        peers: list[dict[str, Any]] = []
        self.peer_origins = []
        for i, table in enumerate(raw):
            where = f"[[bgp.peers]] #{i + 1}"
            if not isinstance(table, dict):
                self.problem(f"must be a table, not {_type_name(table)}", origin, f"bgp.peers[{i}]", where)
                self.bad.add("bgp.peers")
                continue
            peer: dict[str, Any] = {}
            origins: dict[str, _Origin] = {}
            for name, v in table.items():
                o = origin
                if origin.rank == 1:
                    shown = None if name == "password" else _show_value(v)
                    o = dataclasses.replace(origin, line=self.locate("bgp.peers", name, i), shown=shown)
                origins[name] = o
                if name not in _PEER_KINDS:
                    self.problem(f"unknown key {where} {name}" + _suggest(name, PEER_KEYS, str), o,
                                 f"bgp.peers[{i}].{name}")
                    continue
                if v is None:  # JSON null: not set
                    continue
                try:
                    peer[name] = _PEER_KINDS[name].from_value(v, Path("/"))  # peers hold no paths
                except _Bad as e:
                    self.problem(str(e), o, f"bgp.peers[{i}].{name}", f"{where} {name}",
                                 show=name != "password")
            for required in ("address", "asn"):
                if table.get(required) is None:
                    at = dataclasses.replace(origin, line=self.locate("bgp.peers", None, i))
                    self.problem("is required", at, f"bgp.peers[{i}].{required}", f"{where} {required}")
            if set(peer) >= {"address", "asn"}:
                peers.append(peer)
                self.peer_origins.append((i, origins))
            else:
                self.bad.add("bgp.peers")
        return tuple(peers)

    # -- the file ------------------------------------------------------------------------------

    def read_file(self, path: str, require: bool) -> None:
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            if require:
                self.file_failed = True
                self.problem("no such file", _Origin(1, path))
            return
        except OSError as e:
            self.file_failed = True
            self.problem(f"cannot read: {e.strerror or e}", _Origin(1, path))
            return
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            self.file_failed = True
            self.problem("not valid UTF-8", _Origin(1, path, data[: e.start].count(b"\n") + 1))
            return
        try:
            doc = tomllib.loads(text)
        except (ValueError, RecursionError) as e:  # TOMLDecodeError, or a 5000-digit integer
            self.file_failed = True
            m = re.fullmatch(r"(.*) \(at line (\d+), column (\d+)\)", str(e))
            where = f"line {m[2]}, column {m[3]}" if m else None
            reason = m[1] if m else _shorten(str(e))
            self.problem(f"TOML syntax error: {reason}", _Origin(1, path), where=where)
            return
        self.source, self.lines = path, text.splitlines()
        base = Path(path).resolve().parent  # relative paths in the file are relative to the file
        for sec, table in doc.items():
            here = _Origin(1, path, self.locate(sec, None))
            if sec not in _SECTIONS:
                if isinstance(table, dict):
                    hint = _suggest(sec, _SECTIONS, "[{}]".format)
                    self.problem(f"unknown section [{sec}]{hint}", here, sec)
                else:
                    homes = [k.section for k in _KEYS if k.name == sec]
                    hint = f" (keys belong in a section, e.g. [{homes[0]}] {sec})" if homes else ""
                    self.problem(f"unknown key {sec} at the top level{hint}", here, sec)
                continue
            if not isinstance(table, dict):
                self.problem(f"[{sec}] must be a table, not {_type_name(table)}", here, sec)
                continue
            names = [k.name for k in _KEYS if k.section == sec]
            for name, v in table.items():
                o = _Origin(1, path, self.locate(sec, name))
                if name not in names:
                    hint = _suggest(name, names, str)
                    self.problem(f"unknown key [{sec}] {name}{hint}", o, f"{sec}.{name}")
                    continue
                key = _BY_PATH[f"{sec}.{name}"]
                if key.path == "bgp.peers" and isinstance(v, dict):
                    self.problem("write [[bgp.peers]] (an array of tables), not [bgp.peers]", o, key.path,
                                 "[bgp] peers")
                    continue
                hidden = key.secret or key.path == "bgp.peers"  # peers show their fields instead
                o = dataclasses.replace(o, shown=None if hidden else _show_value(v))
                self.set(key, v, o, base, from_text=False)

    def locate(self, section: str, name: str | None, peer: int | None = None) -> int | None:
        """Best-effort line number of a key (or of a section header) in the file, for errors."""
        current, peers = None, -1
        for no, raw in enumerate(self.lines, 1):
            s = raw.split("#", 1)[0].strip()
            if m := re.fullmatch(r"\[\[\s*([\w.-]+)\s*\]\]|\[\s*([\w.-]+)\s*\]", s):
                current = m[1] or m[2]
                peers += current == "bgp.peers"
                if name is None and current == section and (peer is None or peer == peers):
                    return no
            elif name and current == section and (peer is None or peer == peers):
                if re.match(rf"{re.escape(name)}\s*=", s):
                    return no
        return None

    # -- text sources --------------------------------------------------------------------------

    def read_env(self, env: Mapping[str, str]) -> None:
        for var in sorted(env):
            if not var.upper().startswith(ENV_PREFIX):
                continue
            sec, _, name = var[len(ENV_PREFIX):].lower().partition("_")
            if not name:  # AGENTD_NETWORK, AGENTD_MTU: the subnet file's names, not config keys
                continue
            if sec not in _SECTIONS:
                # AGENTD_CONFIG and the like belong to the command line; a near miss is a typo.
                if difflib.get_close_matches(sec, _SECTIONS, n=1, cutoff=0.8):
                    hint = _suggest(sec, _SECTIONS, lambda s: f"{ENV_PREFIX}{s.upper()}_{name.upper()}")
                    self.problem(f"unknown section [{sec}]{hint}", _Origin(2, var), sec)
                continue
            key = _BY_PATH.get(f"{sec}.{name}")
            shown = var if key and (key.secret or key.name == "peers") else f"{var}={_show_text(env[var])}"
            o = _Origin(2, shown)
            if key is None:
                names = [k.name for k in _KEYS if k.section == sec]
                hint = _suggest(name, names, lambda n: f"{ENV_PREFIX}{sec.upper()}_{n.upper()}")
                self.problem(f"unknown key [{sec}] {name}{hint}", o, f"{sec}.{name}")
                continue
            self.set(key, env[var], o, _cwd(), from_text=True)

    def read_overrides(self, overrides: Mapping[str, str]) -> None:
        for dotted, text in overrides.items():
            text = ("true" if text else "false") if isinstance(text, bool) else str(text)
            key = _BY_PATH.get(dotted)
            secret = key is not None and (key.secret or key.name == "peers")
            o = _Origin(3, f"--set {dotted}" if secret else f"--set {dotted}={_show_text(text)}")
            if key is None:
                sec, dot, name = dotted.partition(".")
                shown = f"[{sec}] {name}" if dot else f"{dotted} (keys are written section.key)"
                self.problem(f"unknown key {shown}" + _suggest(dotted, CONFIG_KEYS, str), o, dotted)
                continue
            self.set(key, text, o, _cwd(), from_text=True)

    # -- computed defaults and checks across keys ----------------------------------------------

    def build(self, host: HostFacts | None) -> Config | None:
        v, ok = self.values, (lambda *paths: not self.bad.intersection(paths))
        if host is not None and v["node.name"] is None and ok("node.name"):
            name = host.hostname()
            try:
                v["node.name"] = _node_name(name)
            except _Bad as e:
                self.key_problem("node.name", f"not set and the hostname {name!r} {e}")
        if host is not None and v["node.address"] is None and ok("node.address"):
            try:
                v["node.address"] = host.default_address()
                reason = "this host has no IPv4 default route to take it from"
            except Exception as e:  # netlink refused: say so in one line rather than a traceback
                reason = f"reading the default route failed ({e})"
            if v["node.address"] is None:
                self.key_problem("node.address", f"not set and {reason}; set [node] address")
        if v["node.cluster_id"] is None and v["node.route_reflector"]:
            v["node.cluster_id"] = v["node.address"]  # RFC 4456 §7: commonly the router's address

        cidr, sublen = v["network.cidr"], v["network.subnet_len"]
        if ok("network.cidr", "network.subnet_len") and not cidr.prefixlen < sublen <= 30:
            self.key_problem(self.blame("network.subnet_len", "network.cidr"),
                             f"node subnets /{sublen} must be longer than the cidr's /{cidr.prefixlen} "
                             "and at most /30")
        if ok("network.encap", "network.backend") and (v["network.encap"], v["network.backend"]) == (
            "cross-subnet", "host-gw"
        ):
            self.key_problem(self.blame("network.encap", "network.backend"),
                             "host-gw never encapsulates, so encap = cross-subnet needs ipip, vxlan or udp")

        if (v["etcd.cert"] is None) != (v["etcd.key"] is None) and ok("etcd.cert", "etcd.key"):
            missing = "etcd.key" if v["etcd.key"] is None else "etcd.cert"
            self.key_problem(self.blame("etcd.cert", "etcd.key"),
                             f"cert and key go together; [etcd] {missing.split('.')[1]} is not set")
        tls = [p for p in ("etcd.ca", "etcd.cert", "etcd.key") if v[p] is not None]
        if tls and ok("etcd.endpoints") and not any(u.startswith("https:") for u in v["etcd.endpoints"]):
            self.key_problem(tls[0], "TLS files are set but no [etcd] endpoints use https://")

        if v["bgp.router_id"] is None:
            v["bgp.router_id"] = v["node.address"]
        if v["bgp.asn"] is None:
            v["bgp.asn"] = v["node.asn"]
        hold, keep = v["bgp.hold_time"], v["bgp.keepalive_time"]
        if keep is None:
            v["bgp.keepalive_time"] = hold // 3  # RFC 4271 §10: one third of the hold time
        elif ok("bgp.hold_time", "bgp.keepalive_time") and (keep >= hold if hold else keep != 0):
            # RFC 4271 §4.4: no KEEPALIVEs at all when the hold time is zero.
            why = f"must be less than hold_time ({hold})" if hold else "must be 0 when hold_time = 0"
            self.key_problem(self.blame("bgp.keepalive_time", "bgp.hold_time"), why)
        bgp_at, api_at = v["bgp.listen"], v["api.listen"]
        if ok("bgp.listen", "api.listen") and bgp_at and bgp_at.port and bgp_at.port == api_at.port and (
            bgp_at.host == api_at.host or ip_address(bgp_at.host).is_unspecified
            or ip_address(api_at.host).is_unspecified
        ):
            self.key_problem(self.blame("api.listen", "bgp.listen"),
                             "[api] listen and [bgp] listen use the same port")
        self.check_peers()

        if self.problems:
            return None
        sections = {}
        for sec, cls in (("node", NodeConfig), ("network", NetworkConfig), ("etcd", EtcdConfig),
                         ("bgp", BgpConfig), ("api", ApiConfig), ("cni", CniConfig), ("log", LogConfig),
                         ("agent", AgentConfig)):
            sections[sec] = cls(**{f.name: v[f"{sec}.{f.name}"] for f in dataclasses.fields(cls)})
        peers = tuple(BgpPeerConfig(**{"hold_time": hold, **p}) for p in v["bgp.peers"])
        sections["bgp"] = dataclasses.replace(sections["bgp"], peers=peers)
        return Config(**sections, source=self.source)

    def check_peers(self) -> None:
        v, seen = self.values, {}
        own = {v["node.address"], v["bgp.router_id"]} - {None}
        for peer, (i, origins) in zip(v["bgp.peers"], self.peer_origins):
            where = f"[[bgp.peers]] #{i + 1}"

            def fail(name: str, message: str) -> None:
                o = origins.get(name, self.origins["bgp.peers"])
                self.problem(message, o, f"bgp.peers[{i}].{name}", f"{where} {name}", show=name != "password")

            addr, local = peer["address"], peer.get("local_address")
            if addr in seen:
                fail("address", f"duplicate of [[bgp.peers]] #{seen[addr] + 1}")
            seen.setdefault(addr, i)
            if addr in own:
                fail("address", "is this node's own address")
            if local is not None and local.version != addr.version:
                fail("local_address", f"must be IPv{addr.version} like the peer address")
            if peer.get("rr_client") and not v["node.route_reflector"]:
                fail("rr_client", "needs [node] route_reflector = true (RFC 4456: reflectors have clients)")
            asn_known = not self.bad & {"node.asn", "bgp.asn"}
            if peer.get("rr_client") and peer["asn"] != v["bgp.asn"] and asn_known:
                fail("rr_client", f"needs an iBGP peer (asn {v['bgp.asn']}); reflection stays in one AS")
            if peer.get("passive") and v["bgp.listen"] is None and "bgp.listen" not in self.bad:
                fail("passive", "a passive peer must connect to us, but [bgp] listen is empty")


def _collect(path: str | os.PathLike[str] | None, env: Mapping[str, str] | None,
             overrides: Mapping[str, str] | None, resolve_defaults: bool, require_file: bool,
             host: HostFacts | None) -> tuple[Config | None, list[ConfigError]]:
    loader = _Loader()
    if path is not None:
        loader.read_file(os.fspath(path), require_file)
    loader.read_env(os.environ if env is None else env)
    loader.read_overrides(overrides or {})
    if loader.file_failed:  # without the file every check across keys would mislead
        return None, loader.problems
    config = loader.build((host or LocalHost()) if resolve_defaults else None)
    return config, loader.problems


def load_config(path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, str] | None = None, resolve_defaults: bool = True,
                require_file: bool = False, host: HostFacts | None = None) -> Config:
    """Read, merge (file < env < overrides) and validate the configuration.

    ``path`` None (or a missing file unless ``require_file``) means defaults, env and overrides
    only. ``env`` defaults to os.environ. ``resolve_defaults=False`` reads nothing from the system:
    node.name and node.address stay None unless configured. ``host`` supplies the hostname and
    default route (default: LocalHost). Raises the first ConfigError; ``.problems`` has them all.
    """
    config, problems = _collect(path, env, overrides, resolve_defaults, require_file, host)
    if problems:
        first = problems[0]
        first.problems = list(problems)
        raise first
    assert config is not None
    return config


def check_config(path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None,
                 overrides: Mapping[str, str] | None = None, resolve_defaults: bool = True,
                 require_file: bool = False, host: HostFacts | None = None) -> list[ConfigError]:
    """Every problem load_config would find, in file, env, override order; [] when valid."""
    return _collect(path, env, overrides, resolve_defaults, require_file, host)[1]
