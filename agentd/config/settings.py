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
this module never writes anything.  The sections themselves (the dataclasses the daemon reads)
are :mod:`agentd.config.model`; every name of it is importable from here too.
"""

from __future__ import annotations

import dataclasses
import difflib
import grp
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
import hashlib
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from agentd.backend_table import BACKENDS as BACKEND_TABLE
from agentd.config.model import (  # noqa: F401 - re-exported: settings is where callers import them from
    BACKENDS,
    BPF_ATTACH_CHOICES,
    DATAPATH_CHOICES,
    DEFAULT_CONFIG_PATH,
    ENV_PREFIX,
    IP_FAMILIES,
    IPV6_MIN_MTU,
    MAX_CONFIG_BYTES,
    MAX_SUBNET_LEN_V6,
    SECTIONS,
    AgentConfig,
    ApiConfig,
    BgpConfig,
    BgpPeerConfig,
    CniConfig,
    Config,
    ConfigError,
    DnsConfig,
    EtcdConfig,
    FlowsConfig,
    IngressConfig,
    ListenRangeConfig,
    LogConfig,
    NetworkConfig,
    NodeConfig,
    PolicyConfig,
    _jsonable,
)
from agentd.config.values import (
    one_line,
    parse_access_log,
    parse_controller_name,
    parse_listen_addresses,
    parse_object_ref,
    parse_pod_network,
    parse_pod_network_v6,
    parse_service_network_v6,
    parse_node_address_v6,
    parse_dns_address,
    parse_dns_address_v6,
    parse_domain,
    parse_upstreams,
    HostPort,
    ASN,
    BOOL,
    BadValue,
    HOLD_TIME,
    Kind,
    PASSWORD,
    PATH,
    PORT,
    parse_any_ip,
    parse_bin_dir,
    check_protocol,
    choice_kind,
    parse_cluster_id,
    current_dir,
    parse_endpoints,
    parse_etcd_prefix,
    parse_group_name,
    float_kind,
    int_kind,
    parse_ipv4,
    listen_kind,
    parse_mtu,
    parse_network,
    parse_node_address,
    parse_node_name,
    parse_originate,
    parse_peer_list,
    shorten,
    show_text,
    show_value,
    string_kind,
    suggest,
    text_json,
    text_list,
    parse_file_name,
    parse_tls_file,
    parse_token_path,
    type_name,
)

# Keys that are gone, and what took their place (named in the "unknown key" error).
_REPLACED = {
    "network.ipip_mode": "[network] datapath: ipip runs in BPF or in user space, no kernel ipip device",
}


def _replaced_by(dotted: str) -> str:
    return f" (replaced by {_REPLACED[dotted]})" if dotted in _REPLACED else ""


_USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


def _parse_proxy_user(s: str) -> str:
    """``[ingress] user``: a user name (useradd's default rule: lower case, digits, ``_``,
    ``-``, 32 at most), ``root``, or empty (:data:`agentd.ingress.proxy.AUTO_USER` if it can be used).  Whether it exists is the agent's check at run time (the
    proxy is not started without it), not the configuration's: the file may be checked on
    another machine."""
    text = s.strip()
    if text and not _USER_NAME.fullmatch(text):
        raise BadValue('must be a user name such as "haproxy" (lower case letters, digits, "_", "-"), or "root"')
    return text


@dataclass(frozen=True)
class _Key:
    section: str
    name: str
    kind: Kind
    default: Any
    secret: bool = False

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"


_KEYS = (
    _Key("node", "name", string_kind(parse_node_name), None),
    _Key("node", "address", string_kind(parse_node_address), None),
    _Key("node", "asn", ASN, 64512),
    _Key("node", "route_reflector", BOOL, False),
    _Key("node", "cluster_id", Kind((int, str), "an IPv4 address or an integer", str, parse_cluster_id), None),
    _Key("node", "address_v6", string_kind(parse_node_address_v6), None),
    _Key("network", "cidr", string_kind(parse_pod_network), NetworkConfig.cidr),
    _Key("network", "subnet_len", int_kind(1, 32), 24),
    _Key("network", "backend", choice_kind(*BACKENDS), "host-gw"),
    _Key("network", "encap", choice_kind("always", "cross-subnet"), "always"),
    _Key("network", "mtu", Kind((int, str), '"auto" or an integer', str, parse_mtu), None),
    _Key("network", "route_protocol", int_kind(1, 255, check_protocol), 143),
    _Key("network", "vxlan_vni", int_kind(1, 16777215), 1),  # 24-bit VNI, RFC 7348 §5
    _Key("network", "vxlan_port", PORT, 4789),
    _Key("network", "udp_port", PORT, 8285),
    _Key("network", "datapath", choice_kind(*DATAPATH_CHOICES), "auto"),
    _Key("network", "bpf_pod_redirect", BOOL, True),
    _Key("network", "bpf_pod_fast_path", BOOL, True),
    _Key("network", "bpf_attach", choice_kind(*BPF_ATTACH_CHOICES), "auto"),
    _Key("network", "service_cidr", string_kind(parse_pod_network), NetworkConfig.service_cidr),
    _Key("network", "ip_masq", BOOL, False),
    _Key("network", "ip_family", choice_kind(*IP_FAMILIES), "ipv4"),
    _Key("network", "cidr_v6", string_kind(parse_pod_network_v6), NetworkConfig.cidr_v6),
    _Key("network", "subnet_len_v6", int_kind(1, 128), 64),
    _Key("network", "service_cidr_v6", string_kind(parse_service_network_v6), NetworkConfig.service_cidr_v6),
    _Key("etcd", "endpoints", Kind((list,), "an array", text_list, parse_endpoints), EtcdConfig.endpoints),
    _Key("etcd", "prefix", string_kind(parse_etcd_prefix), "/agentd"),
    _Key("etcd", "ca", Kind((str,), "a string", str, parse_tls_file), None),
    _Key("etcd", "cert", Kind((str,), "a string", str, parse_tls_file), None),
    _Key("etcd", "key", Kind((str,), "a string", str, parse_tls_file), None),
    _Key("etcd", "lease_ttl", int_kind(2, 86400), 30),
    _Key("bgp", "mode", choice_kind("mesh", "route-reflector"), "mesh"),
    _Key("bgp", "listen", listen_kind(allow_empty=True), BgpConfig.listen),
    _Key("bgp", "router_id", string_kind(parse_ipv4), None),
    _Key("bgp", "asn", ASN, None),
    _Key("bgp", "hold_time", HOLD_TIME, 90),
    _Key("bgp", "keepalive_time", int_kind(0, 65535), None),  # below hold_time (RFC 4271 §4.4): _build checks
    _Key("bgp", "connect_retry", float_kind(1, 3600), 5.0),
    _Key("bgp", "password", PASSWORD, None, secret=True),
    _Key("bgp", "graceful_restart", BOOL, True),
    _Key("bgp", "restart_time", int_kind(1, 4095), 120),  # 12-bit field, RFC 4724 §3
    _Key("bgp", "originate", Kind((list,), "an array", text_list, parse_originate), ()),
    _Key("bgp", "next_hop_v6", string_kind(parse_node_address_v6), None),
    _Key("bgp", "send_timeout", float_kind(1, 3600), 60.0),
    _Key("bgp", "batch_delay", float_kind(0, 1), 0.01),
    _Key("bgp", "listen_backlog", int_kind(16, 65535), 4096),
    _Key("bgp", "bfd", BOOL, False),
    _Key("bgp", "bfd_interval", float_kind(0.05, 10), 0.3),
    _Key("bgp", "bfd_multiplier", int_kind(1, 255), 3),
    _Key("bgp", "peers", Kind((list,), "an array of tables", text_json, parse_peer_list), ()),
    _Key("bgp", "listen_ranges", Kind((list,), "an array of tables", text_json, parse_peer_list), ()),
    _Key("api", "listen", listen_kind(allow_empty=False), ApiConfig.listen),
    _Key("api", "token_file", Kind((str,), "a string", str, parse_token_path), ApiConfig.token_file),
    _Key("api", "token_group", string_kind(parse_group_name), None),
    _Key("api", "cluster_port", int_kind(0, 65535), 9098),
    _Key("api", "read_token_file", Kind((str,), "a string", str, parse_tls_file), None),
    _Key("cni", "conf_dir", PATH, CniConfig.conf_dir),
    _Key("cni", "bin_dir", Kind((str, list), "a string or an array", str, parse_bin_dir), CniConfig.bin_dir),
    _Key("cni", "subnet_file", PATH, CniConfig.subnet_file),
    _Key("cni", "data_dir", PATH, CniConfig.data_dir),
    _Key("cni", "ipam_data_dir", PATH, CniConfig.ipam_data_dir),
    _Key("cni", "write_conflist", BOOL, True),
    _Key("dns", "enabled", BOOL, True),
    _Key("dns", "address", string_kind(parse_dns_address), DnsConfig.address),
    _Key("dns", "address_v6", string_kind(parse_dns_address_v6), DnsConfig.address_v6),
    _Key("dns", "cluster_domain", string_kind(parse_domain), "cluster.local"),
    _Key("dns", "upstream", Kind((list,), "an array", text_list, parse_upstreams), ()),
    _Key("flows", "enabled", BOOL, True),
    _Key("flows", "connections", BOOL, True),
    _Key("flows", "ring_size", int_kind(100, 1_000_000), 10_000),
    _Key("flows", "log_group", int_kind(1, 65535), 143),
    _Key("flows", "log_rate", int_kind(1, 1_000_000), 100),
    _Key("flows", "record_rate", float_kind(0.1, 100_000, "records a second"), 10.0),
    _Key("policy", "check_source_mac", BOOL, True),
    _Key("ingress", "enabled", BOOL, False),
    _Key("ingress", "http_port", PORT, 80),
    _Key("ingress", "https_port", PORT, 443),
    _Key("ingress", "addresses", Kind((list,), "an array", text_list, parse_listen_addresses), ()),
    _Key("ingress", "controller", string_kind(parse_controller_name), IngressConfig.controller),
    _Key("ingress", "configmap", string_kind(parse_object_ref), IngressConfig.configmap),
    _Key("ingress", "watch_without_class", BOOL, False),
    _Key("ingress", "haproxy", string_kind(lambda s: s.strip() or "haproxy"), "haproxy"),
    _Key("ingress", "access_log", string_kind(parse_access_log), IngressConfig.access_log),
    _Key("ingress", "user", string_kind(_parse_proxy_user), IngressConfig.user),
    _Key("log", "level", choice_kind("debug", "info", "warning", "error"), "info"),
    _Key("log", "format", choice_kind("text", "json"), "text"),
    _Key("agent", "state_dir", PATH, AgentConfig.state_dir),
    _Key("agent", "route_resync", float_kind(0.1, 3600), 30.0),
    _Key("agent", "bpf_dir", PATH, AgentConfig.bpf_dir),
)
_BY_PATH = {k.path: k for k in _KEYS}
# The keys naming files that are opened by the agent alone (TLS files, the read token): a
# command that opens none of them loads with check_files=False and takes their paths as written.
_FILE_KINDS = {**{k.path: Kind(k.kind.types, k.kind.what, k.kind.text, parse_file_name)
                  for k in _KEYS if k.kind.check is parse_tls_file},
               "api.token_file": PATH}  # (the commands that read the token say what is wrong with it)
_SECTIONS = SECTIONS  # [section] names, in the file's order (checked against _KEYS by the unit tests)
CONFIG_KEYS: tuple[str, ...] = tuple(_BY_PATH)

def _printable(s: str) -> str:
    if not s.isprintable():
        raise BadValue("must be printable text (no newlines, tabs or escape codes)")
    return s


_PEER_KINDS: dict[str, Kind] = {
    "address": string_kind(parse_any_ip),
    "asn": ASN,
    "password": PASSWORD,
    "passive": BOOL,
    "rr_client": BOOL,
    "port": PORT,
    "hold_time": HOLD_TIME,
    "description": string_kind(_printable),
    "local_address": string_kind(lambda s: parse_any_ip(s) if s.strip() else None),
    "max_prefixes": int_kind(1, 2**32 - 1),
    "max_prefixes_warning": int_kind(1, 100),
    "max_prefixes_restart": int_kind(1, 86400),
    "ttl_security": BOOL,
    "bfd": BOOL,
}
PEER_KEYS: tuple[str, ...] = tuple(_PEER_KINDS)
_RANGE_KINDS: dict[str, Kind] = {
    "prefix": string_kind(lambda s: parse_network(s, v4_only=False)),
    **{k: _PEER_KINDS[k] for k in ("asn", "rr_client", "password", "hold_time", "description", "max_prefixes",
                                   "max_prefixes_warning", "max_prefixes_restart", "ttl_security", "bfd")},
}
RANGE_KEYS: tuple[str, ...] = tuple(_RANGE_KINDS)
# The keys that hold arrays of tables: their kinds and required fields.
# What agentd writes into the subnet file (agentd.cni.netconf._KEYS, and the two lines saying how
# the agent runs, agentd.daemon.node_files; held equal by a unit test): a shell that sourced it, as
# flannel's users do with subnet.env (or a unit's EnvironmentFile=), has them in its environment.
SUBNET_FILE_NAMES = frozenset(("AGENTD_NETWORK", "AGENTD_SUBNET", "AGENTD_IPV6_NETWORK", "AGENTD_IPV6_SUBNET",
                               "AGENTD_MTU", "AGENTD_IPMASQ", "AGENTD_BACKEND", "AGENTD_DNS", "AGENTD_DNS_V6",
                               "AGENTD_CLUSTER_DOMAIN",
                               "AGENTD_WRITE_CONFLIST", "AGENTD_MASQUERADE"))  # agentd.cni.docker_opts reads these

# The AGENTD_* variables of the project's tools and scripts, not of the configuration; an agent
# a lab starts inherits them (agentd/lab, compose.yaml, docker/, scripts/dev, the dataplane's
# profiler, the CLI's).  A unit test holds this equal to the names the repository reads.
TOOL_ENV_NAMES = frozenset((
    "AGENTD_CONFIG", "AGENTD_STATUS_URL",  # the CLI's
    "AGENTD_BASE_IMAGE", "AGENTD_PIP_OFFLINE", "AGENTD_IMAGE", "AGENTD_IMAGE_CACHE", "AGENTD_LOCAL_BASE",
    "AGENTD_LAB_ROOT", "AGENTD_COMPOSE", "AGENTD_COMPOSE_STATE", "AGENTD_DOCKER_CLIENT", "AGENTD_DOCKER_DATA",
    "AGENTD_DOCKER_RUN",  # the lab's
    "AGENTD_DATAPLANE_PROFILE", "AGENTD_DATAPLANE_PROFILE_CLOCK",  # the user-space data path's profiler
    "AGENTD_TEST_WORKERS", "AGENTD_UI_SCREENSHOTS",  # scripts/dev's and the tests'
))
_ENV_KEYS = tuple(k.replace(".", "_") for k in CONFIG_KEYS)  # "bgp_hold_time": AGENTD_BGP_HOLD_TIME

_TABLE_LISTS = {
    "bgp.peers": (_PEER_KINDS, ("address", "asn")),
    "bgp.listen_ranges": (_RANGE_KINDS, ("prefix", "asn")),
}


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
    """What computed defaults read from the host: :class:`agentd.kernel.netinfo.LocalHost` reads
    this machine (the configuration itself never reaches into the kernel); pure tests pass their
    own."""

    def hostname(self) -> str: ...

    def default_address(self) -> IPv4Address | None: ...

    def default_address_v6(self, beside: IPv4Address | None = None) -> IPv6Address | None: ...


class _Loader:
    """Collects values with their origins (file < environment < --set) and every problem; the
    checks across keys and the Config are :func:`_build`'s."""

    def __init__(self, check_files: bool = True) -> None:
        self.check_files = check_files
        self.values: dict[str, Any] = {k.path: k.default for k in _KEYS}
        self.origins: dict[str, _Origin] = {k.path: _DEFAULT for k in _KEYS}
        # Per array of tables (bgp.peers, bgp.listen_ranges): (index in the source, origins) per table.
        self.table_origins: dict[str, list[tuple[int, dict[str, _Origin]]]] = {p: [] for p in _TABLE_LISTS}
        self.bad: set[str] = set()
        self.problems: list[ConfigError] = []
        self.file_failed = False
        self.source: str | None = None
        self.lines: list[str] = []
        self._lines_index: dict | None = None

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
            if from_text and key.default is None and not raw.strip():
                value = None  # an empty environment or --set value: an optional key not set
            else:
                kind = key.kind if self.check_files else _FILE_KINDS.get(key.path, key.kind)
                value = kind.from_text(raw, base) if from_text else kind.from_value(raw, base)
        except BadValue as e:
            self.bad.add(key.path)
            if key.path in _TABLE_LISTS:  # the tables that were replaced are not the ones to check
                self.values[key.path], self.table_origins[key.path] = (), []
            self.problem(str(e), origin, key.path, f"[{key.section}] {key.name}", show=not key.secret)
            return
        self.bad.discard(key.path)
        self.values[key.path], self.origins[key.path] = value, origin
        if key.path in _TABLE_LISTS:
            self.values[key.path] = self.read_tables(key.path, value, origin)

    def read_tables(self, path: str, raw: list[Any], origin: _Origin) -> tuple[dict[str, Any], ...]:
        """Each [[bgp.peers]] (or [[bgp.listen_ranges]]) table as {field: value}; problems are
        reported per field."""
        kinds, required_keys = _TABLE_LISTS[path]
        out: list[dict[str, Any]] = []
        self.table_origins[path] = []
        for i, table in enumerate(raw):
            where = f"[[{path}]] #{i + 1}"
            if not isinstance(table, dict):
                self.problem(f"must be a table, not {type_name(table)}", origin, f"{path}[{i}]", where)
                self.bad.add(path)
                continue
            item: dict[str, Any] = {}
            origins: dict[str, _Origin] = {}
            for name, v in table.items():
                o = origin
                if origin.rank == 1:
                    shown = None if name == "password" else show_value(v)
                    o = dataclasses.replace(origin, line=self.locate(path, name, i), shown=shown)
                origins[name] = o
                if name not in kinds:
                    self.problem(f"unknown key {where} {name}" + suggest(name, tuple(kinds), str), o,
                                 f"{path}[{i}].{name}")
                    continue
                if v is None:  # JSON null: not set
                    continue
                try:
                    item[name] = kinds[name].from_value(v, Path("/"))  # these tables hold no paths
                except BadValue as e:
                    self.problem(str(e), o, f"{path}[{i}].{name}", f"{where} {name}",
                                 show=name != "password")
            for required in required_keys:
                if table.get(required) is None:
                    at = dataclasses.replace(origin, line=self.locate(path, None, i))
                    self.problem("is required", at, f"{path}[{i}].{required}", f"{where} {required}")
            if set(item) >= set(required_keys):
                out.append(item)
                self.table_origins[path].append((i, origins))
            else:
                self.bad.add(path)
        return tuple(out)

    # -- the file ------------------------------------------------------------------------------

    def read_file(self, path: str, require: bool) -> None:
        try:
            # A regular file of sane size only: /dev/zero or a FIFO would be read forever.
            with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NONBLOCK)) as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    self.file_failed = True
                    self.problem("not a regular file", _Origin(1, path))
                    return
                if st.st_size > MAX_CONFIG_BYTES:
                    self.file_failed = True
                    self.problem(f"{st.st_size} bytes; a configuration file is at most {MAX_CONFIG_BYTES}", _Origin(1, path))
                    return
                data = f.read(MAX_CONFIG_BYTES + 1)
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
            end = re.fullmatch(r"(.*) \(at end of document\)", str(e))
            where = f"line {m[2]}, column {m[3]}" if m else "end of file" if end else None
            reason = m[1] if m else end[1] if end else shorten(str(e))
            self.problem(f"TOML syntax error: {reason}", _Origin(1, path), where=where)
            return
        self.source, self.lines, self._lines_index = path, text.splitlines(), None
        base = Path(path).resolve().parent  # relative paths in the file are relative to the file
        for sec, table in doc.items():
            here = _Origin(1, path, self.locate(sec, None))
            if sec not in _SECTIONS:
                if isinstance(table, dict):
                    hint = suggest(sec, _SECTIONS, "[{}]".format)
                    self.problem(f"unknown section [{sec}]{hint}", here, sec)
                else:
                    homes = [k.section for k in _KEYS if k.name == sec]
                    hint = f" (keys belong in a section, e.g. [{homes[0]}] {sec})" if homes else ""
                    self.problem(f"unknown key {sec} at the top level{hint}", here, sec)
                continue
            if not isinstance(table, dict):
                self.problem(f"[{sec}] must be a table, not {type_name(table)}", here, sec)
                continue
            names = [k.name for k in _KEYS if k.section == sec]
            for name, v in table.items():
                o = _Origin(1, path, self.locate(sec, name))
                if name not in names:
                    hint = _replaced_by(f"{sec}.{name}") or suggest(name, names, str)
                    self.problem(f"unknown key [{sec}] {name}{hint}", o, f"{sec}.{name}")
                    continue
                key = _BY_PATH[f"{sec}.{name}"]
                if key.path in _TABLE_LISTS and isinstance(v, dict):
                    self.problem(f"write [[{key.path}]] (an array of tables), not [{key.path}]", o, key.path,
                                 f"[bgp] {key.name}")
                    continue
                hidden = key.secret or key.path in _TABLE_LISTS  # tables show their fields instead
                o = dataclasses.replace(o, shown=None if hidden else show_value(v))
                self.set(key, v, o, base, from_text=False)

    def locate(self, section: str, name: str | None, table: int | None = None) -> int | None:
        """Best-effort line number of a key (or of a section header) in the file, for errors;
        ``table`` picks one table of an array of tables ([[bgp.peers]] #table+1)."""
        if self._lines_index is None:
            self._lines_index = self._index_lines()
        return self._lines_index.get((section, table, name))

    def _index_lines(self) -> dict[tuple[str | None, int | None, str | None], int]:
        """(section, table number or None, key or None) -> first line, read once (a file with
        thousands of [[bgp.peers]] would otherwise be scanned again for every field)."""
        index: dict[tuple[str | None, int | None, str | None], int] = {}
        current: str | None = None
        seen: dict[str, int] = {}
        for no, raw in enumerate(self.lines, 1):
            s = raw.split("#", 1)[0].strip()
            if m := re.fullmatch(r"\[\[\s*([\w.-]+)\s*\]\]|\[\s*([\w.-]+)\s*\]", s):
                current = m[1] or m[2]
                seen[current] = n = seen.get(current, -1) + 1
                index.setdefault((current, None, None), no)
                index.setdefault((current, n, None), no)
            elif m := re.match(r"([\w.-]+)\s*=", s):
                index.setdefault((current, None, m[1]), no)
                if current is not None:
                    index.setdefault((current, seen[current], m[1]), no)
        return index

    # -- text sources --------------------------------------------------------------------------

    def read_env(self, env: Mapping[str, str]) -> None:
        for var in sorted(env):
            if not var.upper().startswith(ENV_PREFIX):
                continue
            sec, _, name = var[len(ENV_PREFIX):].lower().partition("_")
            if not name or var.upper() in SUBNET_FILE_NAMES or var.upper() in TOOL_ENV_NAMES:
                continue  # the subnet file's names (a shell that sourced it), the tools' own
            if sec not in _SECTIONS:
                # AGENTD_CONFIG and the like belong to the command line or the tools; only a near
                # miss of a whole AGENTD_SECTION_KEY is a typo (AGENTD_PIP_OFFLINE is no [api] key).
                close = difflib.get_close_matches(f"{sec}_{name}", _ENV_KEYS, n=1, cutoff=0.8)
                if close:
                    hint = f" (did you mean {ENV_PREFIX}{close[0].upper()}?)"
                    self.problem(f"unknown section [{sec}]{hint}", _Origin(2, var), sec)
                continue
            key = _BY_PATH.get(f"{sec}.{name}")
            shown = var if key and (key.secret or key.path in _TABLE_LISTS) else f"{var}={show_text(env[var])}"
            o = _Origin(2, shown)
            if key is None:
                names = [k.name for k in _KEYS if k.section == sec]
                hint = _replaced_by(f"{sec}.{name}") or suggest(
                    name, names, lambda n: f"{ENV_PREFIX}{sec.upper()}_{n.upper()}")
                self.problem(f"unknown key [{sec}] {name}{hint}", o, f"{sec}.{name}")
                continue
            self.set(key, env[var], o, current_dir(), from_text=True)

    def read_overrides(self, overrides: Mapping[str, str]) -> None:
        for dotted, text in overrides.items():
            text = ("true" if text else "false") if isinstance(text, bool) else str(text)
            key = _BY_PATH.get(dotted)
            secret = key is not None and (key.secret or key.path in _TABLE_LISTS)  # peers' and ranges' passwords
            o = _Origin(3, f"--set {dotted}" if secret else f"--set {dotted}={show_text(text)}")
            if key is None:
                sec, dot, name = dotted.partition(".")
                shown = f"[{sec}] {name}" if dot else f"{dotted} (keys are written section.key)"
                self.problem(f"unknown key {shown}" + suggest(dotted, CONFIG_KEYS, str), o, dotted)
                continue
            self.set(key, text, o, current_dir(), from_text=True)


# ---------------------------------------------------------------- computed defaults, checks across keys


def _build(ld: _Loader, host: HostFacts | None, need_address: bool = True) -> Config | None:
    """Computed defaults, checks across keys, and the Config (None when anything is wrong)."""
    v, ok = ld.values, (lambda *paths: not ld.bad.intersection(paths))
    if host is not None and v["node.name"] is None and ok("node.name"):
        name = host.hostname()
        try:
            v["node.name"] = parse_node_name(name)
        except BadValue as e:
            ld.key_problem("node.name", f"not set and the hostname {name!r} {e}")
    _node_addresses(ld, host, need_address)
    if v["bgp.router_id"] is None:
        v["bgp.router_id"] = v["node.address"] or _router_id_of(v["node.name"])
    if v["node.cluster_id"] is None and v["node.route_reflector"]:
        # RFC 4456 §7: commonly the router's address (its router ID where it has no IPv4 one).
        v["node.cluster_id"] = v["node.address"] or v["bgp.router_id"]

    cidr, sublen = v["network.cidr"], v["network.subnet_len"]
    if ok("network.cidr", "network.subnet_len") and not cidr.prefixlen < sublen <= 30:
        ld.key_problem(ld.blame("network.subnet_len", "network.cidr"),
                         f"node subnets /{sublen} must be longer than the cidr's /{cidr.prefixlen} "
                         "and at most /30")
    service = v["network.service_cidr"]
    if ok("network.cidr", "network.service_cidr") and service.overlaps(cidr) and service != NetworkConfig.service_cidr:
        # The default range is not refused here: a cluster made before it was checked has it in
        # its etcd record (first writer wins), and refusing would stop its agents after an
        # upgrade; the agent warns at start instead (agentd.daemon.agent.check_cluster).
        ld.key_problem(ld.blame("network.service_cidr", "network.cidr"),
                       f"the service range {service} overlaps the pod network {cidr}: "
                       "set [network] service_cidr to a range outside cidr")
    dns = v["dns.address"]
    if v["dns.enabled"] and ok("dns.enabled") and v["network.ip_family"] != "ipv6":  # ipv6: no IPv4 pods ask it
        for key, net, what in (("network.cidr", cidr, "pod network"), ("network.service_cidr", service, "service range")):
            if ok("dns.address", key, "network.ip_family") and dns in net:
                ld.key_problem(ld.blame("dns.address", key), f"the node-local DNS address {dns} is inside the {what} {net}")
    if v["dns.enabled"] and ok("dns.enabled", "dns.upstream"):
        # The agent answers on both at port 53 (agentd/services/agent.py): forwarding there is
        # forwarding to itself, each query again and again.
        for key, own in (("dns.address", f"{v['dns.address']}:53"), ("dns.address_v6", f"[{v['dns.address_v6']}]:53")):
            if ok(key) and own in v["dns.upstream"]:
                ld.key_problem(ld.blame("dns.upstream", key),
                               f"{own} is the node-local DNS address ([{key.replace('.', '] ')}) itself: the agent "
                               "would forward the queries it cannot answer to itself; name the DNS servers it "
                               "should ask, or leave upstream empty (/etc/resolv.conf's)")
    _check_families(ld)
    if ok("network.encap", "network.backend") and (v["network.encap"], v["network.backend"]) == (
        "cross-subnet", "host-gw"
    ):
        ld.key_problem(ld.blame("network.encap", "network.backend"),
                         "host-gw never encapsulates, so encap = cross-subnet needs ipip, vxlan or udp")

    if (v["etcd.cert"] is None) != (v["etcd.key"] is None) and ok("etcd.cert", "etcd.key"):
        missing = "etcd.key" if v["etcd.key"] is None else "etcd.cert"
        ld.key_problem(ld.blame("etcd.cert", "etcd.key"),
                         f"cert and key go together; [etcd] {missing.split('.')[1]} is not set")
    tls = [p for p in ("etcd.ca", "etcd.cert", "etcd.key") if v[p] is not None]
    if tls and ok("etcd.endpoints") and not any(u.startswith("https:") for u in v["etcd.endpoints"]):
        ld.key_problem(tls[0], "TLS files are set but no [etcd] endpoints use https://")

    if v["bgp.asn"] is None:
        v["bgp.asn"] = v["node.asn"]
    hold, keep = v["bgp.hold_time"], v["bgp.keepalive_time"]
    if keep is None:
        v["bgp.keepalive_time"] = hold // 3  # RFC 4271 §10: one third of the hold time
    elif ok("bgp.hold_time", "bgp.keepalive_time") and (not 0 < keep < hold if hold else keep != 0):
        # RFC 4271 §4.4: no KEEPALIVEs at all when the hold time is zero, and some when it is not.
        why = f"must be 1..{hold - 1} (less than hold_time {hold})" if hold else "must be 0 when hold_time = 0"
        ld.key_problem(ld.blame("bgp.keepalive_time", "bgp.hold_time"), why)
    bgp_at, api_at = v["bgp.listen"], v["api.listen"]
    if ok("bgp.listen", "api.listen") and bgp_at and bgp_at.port and bgp_at.port == api_at.port and (
        bgp_at.host == api_at.host or ip_address(bgp_at.host).is_unspecified
        or ip_address(api_at.host).is_unspecified
    ):
        ld.key_problem(ld.blame("api.listen", "bgp.listen"),
                         "[api] listen and [bgp] listen use the same port")
    cport = v["api.cluster_port"]
    # The agent puts the cluster listener on the node's address: IPv4, or IPv6 in an IPv6-only
    # cluster (agentd/daemon/agent.py, Agent.address), on that one alone.
    cluster_at = v["node.address"] or v["node.address_v6"]
    if ok("api.cluster_port", "api.listen") and cport and cport == api_at.port and (
        ip_address(api_at.host).is_unspecified
        or (cluster_at is not None and ip_address(api_at.host) == cluster_at)
    ):
        ld.key_problem(ld.blame("api.cluster_port", "api.listen"),
                       f"the cluster listener would take [api] listen's port {cport} on the node's address")
    if ok("api.cluster_port", "bgp.listen") and cport and bgp_at and cport == bgp_at.port:
        ld.key_problem(ld.blame("api.cluster_port", "bgp.listen"),
                       f"[api] cluster_port and [bgp] listen use the same port {cport}")
    _check_ingress_ports(ld)
    _check_peers(ld)

    if ld.problems:
        return None
    sections = {}
    for sec, cls in (("node", NodeConfig), ("network", NetworkConfig), ("etcd", EtcdConfig),
                     ("bgp", BgpConfig), ("api", ApiConfig), ("cni", CniConfig), ("dns", DnsConfig), ("flows", FlowsConfig),
                     ("policy", PolicyConfig), ("ingress", IngressConfig), ("log", LogConfig),
                     ("agent", AgentConfig)):
        sections[sec] = cls(**{f.name: v[f"{sec}.{f.name}"] for f in dataclasses.fields(cls)})
    # A peer's or range's hold_time left out stays None ([bgp] hold_time, resolved from the running
    # configuration when the sessions are made): a reload then changes it only with a restart.
    peers = tuple(BgpPeerConfig(**p) for p in v["bgp.peers"])
    ranges = tuple(ListenRangeConfig(**r) for r in v["bgp.listen_ranges"])
    sections["bgp"] = dataclasses.replace(sections["bgp"], peers=peers, listen_ranges=ranges)
    return Config(**sections, source=ld.source)


_NODE = "this node's address"  # an address the configuration leaves to the host, not read (host=None)


def _same_place(a: Any, b: Any) -> bool:
    """Two listen addresses that would take the same port: equal, or either the wildcard
    (0.0.0.0 or ::, of either family: "[::]" may take IPv4 too, as BGP's does)."""
    if _NODE in (a, b):
        return a == b or ip_address(str(b if a == _NODE else a)).is_unspecified
    a, b = ip_address(str(a)), ip_address(str(b))
    return a == b or a.is_unspecified or b.is_unspecified


def _check_ingress_ports(ld: _Loader) -> None:
    """With [ingress] enabled, its two ports differ from each other and from every other
    listener of the agent on the addresses the proxy takes (one line naming both keys)."""
    v, ok = ld.values, (lambda *paths: not ld.bad.intersection(paths))
    if not v["ingress.enabled"] or not ok("ingress.enabled"):
        return
    http, https = v["ingress.http_port"], v["ingress.https_port"]
    if ok("ingress.http_port", "ingress.https_port") and http == https:
        ld.key_problem(ld.blame("ingress.https_port", "ingress.http_port"),
                       f"[ingress] http_port and [ingress] https_port are both {http}")
    if not ok("ingress.addresses", "node.address", "node.address_v6", "network.ip_family"):
        return
    family = v["network.ip_family"]
    node_v4 = v["node.address"] or (_NODE if family != "ipv6" else None)
    node_v6 = v["node.address_v6"] or (_NODE if family == "ipv6" else None)
    # Where the agent puts them (agentd/daemon/agent.py): the listed addresses, else the node's
    # underlay addresses; the cluster listener on the node's address.
    proxy_at = list(v["ingress.addresses"]) or [
        a for a in (node_v4, node_v6 if family != "ipv4" else None) if a is not None]
    cluster_at = node_v4 or node_v6
    api_at, bgp_at, cport = v["api.listen"], v["bgp.listen"], v["api.cluster_port"]
    others = (
        ("api.listen", "[api] listen", api_at.port if api_at else 0, [api_at.host] if api_at else []),
        ("api.cluster_port", "[api] cluster_port", cport, [cluster_at] if cluster_at is not None else []),
        ("bgp.listen", "[bgp] listen", bgp_at.port if bgp_at else 0, [bgp_at.host] if bgp_at else []),
    )
    for name, port in (("http_port", http), ("https_port", https)):
        for other, shown, their_port, their_hosts in others:
            if ok(f"ingress.{name}", other) and port == their_port and any(
                _same_place(a, b) for a in proxy_at for b in their_hosts
            ):
                ld.key_problem(ld.blame(f"ingress.{name}", other),
                               f"[ingress] {name} and {shown} use the same port {port}")


def _node_addresses(ld: _Loader, host: HostFacts | None, need_address: bool = True) -> None:
    """The underlay addresses the families need, from the host where not set: IPv4 (ipv4, dual:
    required) and IPv6 (ipv6: required; dual: where the host has an IPv6 default route);
    ``need_address`` False: none required (None where neither set nor found)."""
    v, ok = ld.values, (lambda *paths: not ld.bad.intersection(paths))
    if not ok("network.ip_family"):
        return
    family = v["network.ip_family"]
    if family == "ipv6" and v["node.address"] is not None and ok("node.address"):
        ld.key_problem("node.address", "is an IPv4 underlay address, which ip_family = ipv6 does not use "
                                       "(remove it, or use [network] ip_family = dual)")
        v["node.address"] = None
    if family == "ipv4" and v["node.address_v6"] is not None and ok("node.address_v6"):
        ld.key_problem(ld.blame("node.address_v6", "network.ip_family"),
                       "is used only with [network] ip_family = dual or ipv6 (pods get IPv4 addresses alone)")
    nh = v["bgp.next_hop_v6"]
    if family != "ipv4" and nh is not None and ok("bgp.next_hop_v6", "node.address_v6"):
        # The other nodes map an IPv6 next hop to a node only through its record's addresses
        # (agentd.kernel.forwarding.next_hop_forms): another one would make this node's IPv6
        # routes an external router's to them.  So a next hop set alone is the node's IPv6
        # address as well (published as its address_v6).
        if v["node.address_v6"] is None:
            v["node.address_v6"] = nh
        elif nh != v["node.address_v6"]:
            ld.key_problem(ld.blame("bgp.next_hop_v6", "node.address_v6"),
                           f"{nh} is not [node] address_v6 {v['node.address_v6']}: the other nodes know this "
                           "node by address_v6 (its node record) and would take its IPv6 routes for an external "
                           "router's; leave next_hop_v6 unset (it defaults to address_v6)")
    wanted = [("node.address", "default_address", "IPv4", True)] if family != "ipv6" else []
    if family != "ipv4":
        wanted.append(("node.address_v6", "default_address_v6", "IPv6", family == "ipv6"))
    for path, method, name, required in wanted:
        if host is None or v[path] is not None or not ok(path):
            continue
        try:
            # IPv6 beside IPv4 (dual): only an address on the IPv4 address's interface.
            beside = (v["node.address"] if ok("node.address") else None,) if path == "node.address_v6" else ()
            v[path] = getattr(host, method)(*beside)
            reason = f"this host has no {name} default route to take it from"
        except Exception as e:  # netlink refused: say so in one line rather than a traceback
            reason = f"reading the {name} default route failed ({e})"
        if v[path] is None and required and need_address:
            ld.key_problem(path, f"not set and {reason}; set [node] {path.split('.')[1]}")


def _router_id_of(name: str | None) -> IPv4Address | None:
    """A node without an IPv4 address (ip_family = ipv6) still needs a 4-octet BGP identifier
    (RFC 4271 §4.2, RFC 6286): derived from its node name, which is unique in the cluster, as
    Calico's CALICO_ROUTER_ID=hash does.  Never 0.0.0.0 (RFC 6286 §2.1)."""
    if name is None:
        return None
    n = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")
    return IPv4Address(n or 1)


def _check_families(ld: _Loader) -> None:
    """What the pod families ask of the other [network] keys (one line per problem)."""
    v, ok = ld.values, (lambda *paths: not ld.bad.intersection(paths))
    if not ok("network.ip_family"):
        return
    family, backend = v["network.ip_family"], v["network.backend"]
    cidr, sublen = v["network.cidr_v6"], v["network.subnet_len_v6"]
    if ok("network.cidr_v6", "network.subnet_len_v6") and not cidr.prefixlen < sublen <= MAX_SUBNET_LEN_V6:
        ld.key_problem(ld.blame("network.subnet_len_v6", "network.cidr_v6"),
                       f"node subnets /{sublen} must be longer than the cidr_v6's /{cidr.prefixlen} "
                       f"and at most /{MAX_SUBNET_LEN_V6}")
    if family == "ipv4":
        return
    service = v["network.service_cidr_v6"]
    if ok("network.cidr_v6", "network.service_cidr_v6") and service.overlaps(cidr):
        ld.key_problem(ld.blame("network.service_cidr_v6", "network.cidr_v6"),
                       f"the IPv6 service range {service} overlaps the IPv6 pod network {cidr}")
    dns = v["dns.address_v6"]
    for key, net, what in (("network.cidr_v6", cidr, "IPv6 pod network"), ("network.service_cidr_v6", service, "IPv6 service range")):
        if v["dns.enabled"] and ok("dns.address_v6", key) and dns in net:
            ld.key_problem(ld.blame("dns.address_v6", key), f"the node-local DNS address {dns} is inside the {what} {net}")
    if family == "ipv6" and ok("network.backend") and not BACKEND_TABLE[backend].outer_ipv6:
        ld.key_problem(ld.blame("network.backend", "network.ip_family"),
                       f"{backend} needs an IPv4 underlay ({BACKEND_TABLE[backend].wire}), which ip_family = ipv6 "
                       "has not: use vxlan or host-gw, or ip_family = dual")
    mtu = v["network.mtu"]
    if ok("network.mtu") and mtu is not None and mtu < IPV6_MIN_MTU:
        ld.key_problem(ld.blame("network.mtu", "network.ip_family"),
                       f"{mtu} is below {IPV6_MIN_MTU}, the least every IPv6 link must carry (RFC 8200 §5)")
    if family == "dual" and ld.origins["bgp.next_hop_v6"].rank == 0:
        # IPv6 routes over the IPv4 sessions: our IPv6 underlay address is their next hop
        # (None: the IPv4-mapped form, which the other nodes map back to this node).
        v["bgp.next_hop_v6"] = v["node.address_v6"]
    if family == "ipv6" and ld.origins["bgp.listen"].rank == 0:
        v["bgp.listen"] = HostPort("::", BgpConfig.listen.port)  # the sessions are IPv6
    # An explicit IPv4 listen address with ip_family = ipv6 is no problem but a warning
    # (config_warnings): earlier versions took it, and sessions this node opens work with it.


def _check_peers(ld: _Loader) -> None:
    v, seen = ld.values, {}
    own = {v["node.address"], v["node.address_v6"], v["bgp.router_id"]} - {None}
    for peer, (i, origins) in zip(v["bgp.peers"], ld.table_origins["bgp.peers"]):
        where = f"[[bgp.peers]] #{i + 1}"

        def fail(name: str, message: str) -> None:
            o = origins.get(name, ld.origins["bgp.peers"])
            ld.problem(message, o, f"bgp.peers[{i}].{name}", f"{where} {name}", show=name != "password")

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
        asn_known = not ld.bad & {"node.asn", "bgp.asn"}
        if peer.get("rr_client") and peer["asn"] != v["bgp.asn"] and asn_known:
            fail("rr_client", f"needs an iBGP peer (asn {v['bgp.asn']}); reflection stays in one AS")
        if peer.get("passive") and v["bgp.listen"] is None and "bgp.listen" not in ld.bad:
            fail("passive", "a passive peer must connect to us, but [bgp] listen is empty")
    _check_ranges(ld)

def _check_ranges(ld: _Loader) -> None:
    v, seen = ld.values, {}
    for rng, (i, origins) in zip(v["bgp.listen_ranges"], ld.table_origins["bgp.listen_ranges"]):
        where = f"[[bgp.listen_ranges]] #{i + 1}"

        def fail(name: str, message: str) -> None:
            o = origins.get(name, ld.origins["bgp.listen_ranges"])
            ld.problem(message, o, f"bgp.listen_ranges[{i}].{name}", f"{where} {name}",
                         show=name != "password")

        prefix = rng["prefix"]
        if prefix in seen:
            fail("prefix", f"duplicate of [[bgp.listen_ranges]] #{seen[prefix] + 1}")
        seen.setdefault(prefix, i)
        if v["bgp.listen"] is None and "bgp.listen" not in ld.bad:
            fail("prefix", "peers from a range connect to us, but [bgp] listen is empty")
        if rng.get("rr_client") and not v["node.route_reflector"]:
            fail("rr_client", "needs [node] route_reflector = true (RFC 4456: reflectors have clients)")
        if rng.get("rr_client") and rng["asn"] != v["bgp.asn"] and not ld.bad & {"node.asn", "bgp.asn"}:
            fail("rr_client", f"needs iBGP peers (asn {v['bgp.asn']}); reflection stays in one AS")


def peer_problems(cfg: Config) -> list[ConfigError]:
    """What the checks of [[bgp.peers]] and [[bgp.listen_ranges]] (_check_peers) find in ``cfg``'s
    peers and ranges against ``cfg``'s own [node] and [bgp] keys: a reload's peers are checked
    with the running values of the keys only a restart changes (:func:`reloaded`),
    as ``agentd run`` checks them with the file's at start."""
    ld = _Loader(check_files=False)
    for section in ("node", "bgp"):
        values = getattr(cfg, section)
        for f in dataclasses.fields(values):
            ld.values[f"{section}.{f.name}"] = getattr(values, f.name)
    origin = _Origin(1, cfg.source or "the configuration")
    for path, tables in (("bgp.peers", cfg.bgp.peers), ("bgp.listen_ranges", cfg.bgp.listen_ranges)):
        ld.values[path] = [dataclasses.asdict(t) for t in tables]
        ld.table_origins[path] = [(i, {}) for i in range(len(tables))]
        ld.origins[path] = origin
    _check_peers(ld)
    return ld.problems


class Reload(NamedTuple):
    """What :func:`reloaded` makes of a reload."""

    config: Config  # the configuration to run with from now
    pending: list[str]  # the keys whose new value waits for a restart ("[bgp] hold_time"), for the log
    refused: str | None  # why the new peers and listen ranges were not applied (one line), or None


# The restart-only keys the peers and listen ranges are checked against (_check_peers): an
# rr_client needs route_reflector, a passive peer or a range the listener, a peer is not the
# node's own address, a reflector's client is iBGP.
_PEER_CONTEXT = ("[node] address", "[node] address_v6", "[node] route_reflector", "[node] asn",
                 "[bgp] asn", "[bgp] router_id", "[bgp] listen")


# [bgp] keys a reload applies beside the peers and listen ranges: BFD's, which the neighbours
# take over without a new BGP session (as in BIRD: started, ended or re-tuned by a Poll Sequence).
LIVE_BGP_KEYS = ("bfd", "bfd_interval", "bfd_multiplier")


def reloaded(running: Config, read: Config, *, also: tuple[str, ...] = ()) -> Reload:
    """What a SIGHUP applies: the external peers, the listen ranges, BFD's settings
    (:data:`LIVE_BGP_KEYS`) and the log settings of ``read``, and the ``[bgp]`` keys named in
    ``also`` (``agentd speaker``: ``originate``); everything else stays as ``running`` has it.  The agent's reload and ``agentd speaker``'s
    both go through here.

    ``read`` was checked against its own [node] and [bgp] keys; the peers run with the running
    ones.  Peers or ranges that those make invalid (an ``rr_client`` peer read with a new
    ``route_reflector = true``, a passive peer with a new ``[bgp] listen``: what a start would
    refuse) are not applied: the running peers and ranges stay, the rest of the reload applies,
    and ``refused`` says why in one line, naming the keys that need a restart."""
    peers = {"peers": read.bgp.peers, "listen_ranges": read.bgp.listen_ranges}
    also_keys = {key: getattr(read.bgp, key) for key in (*LIVE_BGP_KEYS, *also)}
    live = dataclasses.replace(running, bgp=dataclasses.replace(running.bgp, **peers, **also_keys), log=read.log)
    refused = None
    problems = peer_problems(live)
    if problems:
        live = dataclasses.replace(running, bgp=dataclasses.replace(running.bgp, **also_keys), log=read.log)
    pending = []
    for section in SECTIONS:
        now, new = _jsonable(getattr(live, section)), _jsonable(getattr(read, section))
        pending += [f"[{section}] {key}" for key in now if now[key] != new.get(key)]
    if problems:
        keys = [k for k in pending if k in _PEER_CONTEXT]
        shown = "; ".join(f"{p.where}: {p.message}" for p in problems[:3])
        if len(problems) > 3:
            shown += f" (and {len(problems) - 3} more)"
        refused = one_line(
            f"the new [[bgp.peers]] and [[bgp.listen_ranges]] are not applied (the running ones stay): {shown} -- "
            + (f"checked with the running {', '.join(keys)}: the file's new "
               + ("values need a restart, which applies the new peers with them" if len(keys) > 1
                  else "value needs a restart, which applies the new peers with it") if keys
               else "checked with the running configuration"))
    return Reload(live, pending, refused)


class NodeFacts:
    """:class:`HostFacts` that are given, not looked up: [node] name, address and address_v6
    as some running agent has them (:class:`RunningHost`; ``agentd check-config --reload``
    asks the running agent's ``GET /status``)."""

    def __init__(self, name: str, address: IPv4Address | None, address_v6: IPv6Address | None) -> None:
        self.name, self.address, self.address_v6 = name, address, address_v6

    def hostname(self) -> str:
        return self.name

    def default_address(self) -> IPv4Address | None:
        return self.address

    def default_address_v6(self, beside: IPv4Address | None = None) -> IPv6Address | None:
        return self.address_v6


class RunningHost(NodeFacts):
    """:class:`HostFacts` answered from a running configuration: a reload (SIGHUP) computes the
    defaults of [node] name, address and address_v6 as they were at start, never from the
    host again.  Those keys change only with a restart, and a default route gone at the
    moment of a reload (a link flap, a DHCP renewal, an underlay outage) must not fail it
    (nor a netlink dump hold up the event loop)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg.node.name or "", cfg.node.address, cfg.node.address_v6)


def _collect(path: str | os.PathLike[str] | None, env: Mapping[str, str] | None,
             overrides: Mapping[str, str] | None, require_file: bool,
             host: HostFacts | None, check_files: bool = True,
             check_group: bool = False, need_address: bool = True) -> tuple[Config | None, list[ConfigError]]:
    loader = _Loader(check_files)
    if path is not None:
        loader.read_file(os.fspath(path), require_file)
    loader.read_env(os.environ if env is None else env)
    loader.read_overrides(overrides or {})
    if loader.file_failed:  # without the file every check across keys would mislead
        return None, loader.problems
    config = _build(loader, host, need_address)
    group = loader.values["api.token_group"]
    if check_group and group is not None and "api.token_group" not in loader.bad:
        # What `agentd run` refuses at start (agentd.daemon.auth), looked up as it does
        # (grp.getgrnam); only check-config asks: a reload never applies token_group.
        try:
            grp.getgrnam(group)
        except KeyError:
            loader.key_problem("api.token_group", f"no group named {group!r} on this host")
            config = None
    return config, loader.problems


def load_config(path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, str] | None = None, require_file: bool = False,
                host: HostFacts | None = None, check_files: bool = True, need_address: bool = True) -> Config:
    """Read, merge (file < env < overrides) and validate the configuration.

    ``path`` None (or a missing file unless ``require_file``) means defaults, env and overrides
    only. ``env`` defaults to os.environ. ``host`` supplies the hostname and default route for
    the defaults computed from them (the daemon and CLI pass
    :class:`agentd.kernel.netinfo.LocalHost`); None reads nothing from the system: node.name and
    node.address stay None unless configured. ``check_files`` False takes the paths of the files
    only the agent opens ([etcd] ca, cert and key, [api] read_token_file) as written, without
    looking whether they exist and are readable: for the commands that never open them (``agentd
    flows``, ``agentd ui``), which users other than root run. ``need_address`` False takes a
    node address the host cannot give (no default route) for none rather than a problem: for
    ``agentd leave`` without an agent, whose clean-up of the host needs none. Raises the first
    ConfigError; ``.problems`` has them all.
    """
    config, problems = _collect(path, env, overrides, require_file, host, check_files, need_address=need_address)
    if problems:
        first = problems[0]
        first.problems = list(problems)
        raise first
    assert config is not None
    return config


def config_warnings(cfg: Config, *, nodes: bool = True) -> list[str]:
    """What a valid configuration may not do as meant, one line each: ``agentd run`` logs
    them at start, ``agentd check-config`` prints them (neither refuses the configuration).
    ``nodes`` False: for ``agentd speaker``, which has no sessions to the cluster's nodes but
    those configured."""
    out = []
    at = cfg.bgp.listen
    if cfg.network.ip_family == "ipv6" and at is not None:
        host = ip_address(at.host)
        if host.version == 4 or host.ipv4_mapped is not None:
            # An IPv4 socket: every peer's (IPv6) connection to this node is refused.  Earlier
            # versions took it (the sample config had 0.0.0.0:179): sessions this node opens
            # (to external route reflectors) work, so it is not refused.
            out.append(f"[bgp] listen = {at}: an IPv4 address, but with ip_family = ipv6 the BGP sessions are "
                       "IPv6: peers cannot connect to this node (mesh peers, passive peers, listen ranges); "
                       "only sessions it opens itself come up. Listen on an IPv6 address: "
                       f"[bgp] listen = \"[::]:{at.port}\" (or remove the line)")
    elif at is not None:
        out += _listen_family_warnings(cfg, at, nodes=nodes)
    service, cidr = cfg.network.service_cidr, cfg.network.cidr
    if service.overlaps(cidr):
        # The default service range is taken (a cluster made before the check has it in etcd);
        # another is refused (_build). The agent's words at start (agentd.daemon.agent.check_cluster).
        out.append(f"the service range {service} ([network] service_cidr) overlaps the pod network {cidr} ([network] "
                   "cidr): cluster IPs inside a node's pod subnet are routed to that node's pods; a new cluster sets "
                   "[network] service_cidr outside cidr before its first agent starts")
    out += _read_token_file_warnings(cfg)
    return out


def read_token_problem(st: os.stat_result, path: str | Path, agent_uid: int | None = None) -> str | None:
    """Why ``[api] read_token_file`` (its ``st``) must not be taken, or None: not a regular file,
    readable or writable by its group or others, or owned by someone other than root and the
    agent's user (``agent_uid``, this process's by default).  The cluster read token lets whoever
    holds it read every node's flows, routes and status, and the file is the operator's (unlike
    the API token, which the agent writes itself 0600, or 0640 for ``[api] token_group``): the
    same rule as ssh's for a private key."""
    agent_uid = os.geteuid() if agent_uid is None else agent_uid
    if not stat.S_ISREG(st.st_mode):
        return f"[api] read_token_file {path} is not a regular file"
    if st.st_uid not in (0, agent_uid):
        return (f"[api] read_token_file {path} is owned by uid {st.st_uid}, neither root nor the agent's user: "
                "whoever owns it can change the cluster read token (chown root it, chmod 600 it)")
    if st.st_mode & 0o077:
        return (f"[api] read_token_file {path} has mode {stat.S_IMODE(st.st_mode):04o}: its group or other users "
                "can read (or change) the cluster read token, which reads every node's flows, routes and status "
                "(chmod 600 it)")
    return None


def _read_token_file_warnings(cfg: Config) -> list[str]:
    """``[api] read_token_file`` readable by others, or another user's: the agent refuses it
    (the cluster view stays off: agentd/daemon/auth.py read_line_token); said here before it
    runs.  Nothing when the file cannot be looked at (a missing one is a configuration problem)."""
    path = cfg.api.read_token_file
    if path is None:
        return []
    try:
        st = os.stat(path)
    except OSError:
        return []
    problem = read_token_problem(st, path)
    return [f"{problem}: the agent refuses it, and the cluster view stays off here"] if problem else []


def _listen_family_warnings(cfg: Config, at: HostPort, *, nodes: bool = True) -> list[str]:
    """The other nodes (an IPv4 or dual-stack cluster's sessions between nodes are IPv4), passive
    peers and listen ranges of a family the BGP listening socket cannot take: an IPv4 address
    takes IPv4 alone, an IPv6 one IPv6 alone; only [::] takes both (bgp/transport.py clears
    IPV6_V6ONLY).  Their connections are refused: a warning, not a refusal (such a configuration
    ran before, and the sessions this node opens work).  (ip_family = ipv6 with an IPv4 address:
    config_warnings' own warning.)"""
    host = ip_address(at.host)
    if host.version == 6 and host.is_unspecified:
        return []
    v4_socket = host.version == 4 or host.ipv4_mapped is not None
    wanted = 6 if v4_socket else 4  # the family this socket never takes
    them = []
    if wanted == 4 and nodes:  # ip_family ipv4 or dual here: the nodes peer over IPv4 (agentd.daemon.mesh)
        them.append(f"the other nodes (with ip_family = {cfg.network.ip_family} their sessions are IPv4)")
    them += [f"[[bgp.peers]] #{i + 1} {p.address} (passive)" for i, p in enumerate(cfg.bgp.peers)
             if p.passive and p.address.version == wanted]
    them += [f"[[bgp.listen_ranges]] #{i + 1} {r.prefix}" for i, r in enumerate(cfg.bgp.listen_ranges)
             if r.prefix.version == wanted]
    if not them:
        return []
    shown = ", ".join(them[:3]) + (f" and {len(them) - 3} more" if len(them) > 3 else "")
    has, lacks = ("IPv4", "IPv6") if v4_socket else ("IPv6", "IPv4")
    line = (f"[bgp] listen = {at}: an {has} address, which takes no {lacks} connection: {lacks} peers that "
            f"must connect to this node cannot: {shown}. Listen on [bgp] listen = \"[::]:{at.port}\", "
            "which takes both families")
    return [line]


def check_config(path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None,
                 overrides: Mapping[str, str] | None = None, require_file: bool = False,
                 host: HostFacts | None = None, check_files: bool = True,
                 need_address: bool = True, check_group: bool = True) -> list[ConfigError]:
    """Every problem load_config would find, in file, env, override order, and an [api]
    token_group this host has no group of (which ``agentd run`` refuses at start); [] when valid.
    ``need_address`` as load_config's, ``check_group`` False leaves token_group unchecked
    (``agentd check-config --reload``: a reload never applies token_group)."""
    return _collect(path, env, overrides, require_file, host, check_files, check_group=check_group,
                    need_address=need_address)[1]
