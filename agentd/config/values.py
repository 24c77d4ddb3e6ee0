"""Value kinds and parsers of agentd's configuration (used by agentd.config.settings).

Each key of the configuration has a ``Kind``: the TOML/JSON types it accepts, how text from
the environment or ``--set`` becomes one of them, and the check that turns it into the final
value or raises ``BadValue`` with the reason.  agentd.config.settings says *where* a bad value came from.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import difflib
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network
from pathlib import Path
from typing import Any

from proto import AS_TRANS  # RFC 6793 §9: a placeholder in 2-octet fields, never a real AS

# Route protocol numbers include/uapi/linux/rtnetlink.h gives to the kernel, administrators and
# other routing daemons: owning routes with one of them would mean deleting someone else's routes.
RESERVED_PROTOCOLS = {
    0: "unspec", 1: "redirect", 2: "kernel", 3: "boot", 4: "static", 8: "gated", 9: "ra",
    10: "mrt", 11: "zebra", 12: "bird", 13: "dnrouted", 14: "xorp", 15: "ntk", 16: "dhcp",
    17: "mrouted", 18: "keepalived", 42: "babel", 99: "openr", 186: "bgp", 187: "isis",
    188: "ospf", 189: "rip", 192: "eigrp",
}
_TCP_MD5_MAX_KEY = 80  # TCP_MD5SIG_MAXKEYLEN in include/uapi/linux/tcp.h

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network



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




class BadValue(Exception):
    """The value is wrong; the message says why, the caller says where it came from."""


TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
               list: "an array", dict: "a table"}


def type_name(v: Any) -> str:
    return TYPE_NAMES.get(type(v), type(v).__name__)


@dataclass(frozen=True)
class Kind:
    types: tuple[type, ...]  # TOML/JSON types accepted
    what: str  # "an integer", for "must be an integer, not a string"
    text: Callable[[str], Any]  # text (env, --set) -> a value of one of ``types``
    check: Callable[[Any, Path], Any]  # value, base dir for relative paths -> final value

    def from_value(self, v: Any, base: Path) -> Any:
        if not isinstance(v, self.types) or (isinstance(v, bool) and bool not in self.types):
            raise BadValue(f"must be {self.what}, not {type_name(v)}")
        return self.check(v, base)

    def from_text(self, s: str, base: Path) -> Any:
        return self.check(self.text(s), base)


def text_int(s: str) -> int:
    if not re.fullmatch(r"[ \t]*[+-]?[0-9]{1,20}[ \t]*", s):
        raise BadValue("must be an integer")
    return int(s)


def text_float(s: str) -> float:
    if not re.fullmatch(r"[ \t]*[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?[ \t]*", s):
        raise BadValue("must be a number")
    return float(s)


def text_bool(s: str) -> bool:
    word = s.strip().lower()
    if word in ("true", "1", "yes", "on"):
        return True
    if word in ("false", "0", "no", "off"):
        return False
    raise BadValue("must be true or false (also 1/0, yes/no, on/off)")


def text_list(s: str) -> list[str]:
    return [part.strip() for part in s.split(",") if part.strip()]


def int_kind(lo: int, hi: int, extra: Callable[[int], None] | None = None) -> Kind:
    def check(n: int, _base: Path) -> int:
        if extra:
            extra(n)
        if not lo <= n <= hi:
            raise BadValue(f"must be {lo}..{hi}")
        return n
    return Kind((int,), "an integer", text_int, check)


def float_kind(lo: float, hi: float, unit: str = "seconds") -> Kind:
    def check(x: float, _base: Path) -> float:
        # The range first: an integer too large for a float (400 digits) compares exactly but
        # makes math.isfinite raise OverflowError.
        if not lo <= x <= hi or not math.isfinite(x):
            raise BadValue(f"must be a number of {unit}, {lo:g}..{hi:g}")
        return float(x)
    return Kind((int, float), "a number", text_float, check)


def choice_kind(*choices: str) -> Kind:
    def check(s: str, _base: Path) -> str:
        if s not in choices:
            raise BadValue(f"must be one of {', '.join(choices)}")
        return s
    return Kind((str,), "a string", str, check)


def string_kind(check: Callable[[str], Any]) -> Kind:
    return Kind((str,), "a string", str, lambda s, _base: check(s))


def check_asn(n: int) -> None:
    if n == AS_TRANS:
        raise BadValue("23456 is AS_TRANS (RFC 6793), not a usable AS number")


def check_hold_time(n: int) -> None:
    # RFC 4271 §4.2: the Hold Time MUST be either zero or at least three seconds.
    if n in (1, 2) or not 0 <= n <= 65535:
        raise BadValue("must be 0 or at least 3" if n in (1, 2) else "must be 0 or 3..65535")


def check_protocol(n: int) -> None:
    if n in RESERVED_PROTOCOLS:
        raise BadValue(f"{n} is the kernel's RTPROT_{RESERVED_PROTOCOLS[n].upper()}; pick an unassigned "
                   "number so agentd never owns someone else's routes")


def _no_zone(s: str) -> str:
    """``s`` stripped; ValueError if it names an IPv6 zone (``%eth0``): Python's ipaddress takes
    one, but a network or an address other hosts route to has none (Go's net.ParseCIDR, host-local
    and the API server refuse it), and ``fd00::5%eth0`` would be a second spelling of fd00::5."""
    s = s.strip()
    if "%" in s:
        raise ValueError("an IPv6 zone (%...) has no place here")
    return s


def parse_ipv4(s: str, *, unicast: bool = True) -> IPv4Address | None:
    if not s.strip():  # empty: not set
        return None
    try:
        addr = ip_address(s.strip())
    except ValueError:
        raise BadValue("must be an IPv4 address") from None
    if addr.version != 4:
        raise BadValue("must be an IPv4 address, not IPv6")
    if unicast and (addr.is_unspecified or addr.is_multicast or addr == IPv4Address("255.255.255.255")):
        raise BadValue("must be a unicast address")
    return addr


def parse_node_address(s: str) -> IPv4Address | None:
    """This node's underlay address: other nodes reach it there, so never loopback."""
    addr = parse_ipv4(s)
    if addr is not None and addr.is_loopback:
        raise BadValue("must not be a loopback address: the other nodes reach this node at it")
    return addr


def parse_node_address_v6(s: str) -> IPv6Address | None:
    """This node's underlay IPv6 address: global or unique-local unicast, never loopback or
    link-local (the other nodes reach this node at it, across routers too)."""
    addr = parse_ipv6_or_none(s)
    if addr is not None and (addr.is_link_local or addr.ipv4_mapped is not None):
        raise BadValue("must be a global or unique-local address, not link-local or IPv4-mapped: "
                       "the other nodes reach this node at it")
    return addr


def parse_dns_address(s: str) -> IPv4Address:
    """The node-local DNS address (Services): unicast, not loopback (pods send to it)."""
    addr = parse_ipv4(s)
    if addr is None:
        raise BadValue("must be an IPv4 address")
    if addr.is_loopback:
        raise BadValue("must not be a loopback address: pods send their queries to it")
    return addr


def parse_dns_address_v6(s: str) -> IPv6Address:
    """The node-local DNS address of pods without IPv4: IPv6 unicast that pods can route to the
    node (not loopback, link-local, multicast or unspecified)."""
    try:
        addr = ip_address(_no_zone(s))
    except ValueError:
        raise BadValue("must be an IPv6 address") from None
    if addr.version != 6:
        raise BadValue("must be an IPv6 address ([dns] address is the IPv4 one)")
    if addr.is_loopback or addr.is_link_local or addr.is_multicast or addr.is_unspecified:
        raise BadValue("must be a unicast address pods route to their node (not loopback, link-local or multicast)")
    return addr


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def parse_domain(s: str) -> str:
    """A DNS domain (the cluster domain): RFC 1123 labels, lower case, no trailing dot."""
    name = s.strip().lower().rstrip(".")
    if not name or len(name) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in name.split(".")):
        raise BadValue("must be a domain name like cluster.local (letters, digits, hyphens; dot-separated)")
    return name


def parse_upstreams(v: list[Any], _base: Path) -> tuple[str, ...]:
    """DNS servers to forward to: "IPv4", "IPv4:PORT", "IPv6" or "[IPv6]:PORT"; empty: the
    host's /etc/resolv.conf.  Kept as "IPv4:PORT" and "[IPv6]:PORT"."""
    out = []
    for item in v:
        if not isinstance(item, str):
            raise BadValue(f"must be an array of strings, not of {type_name(item)}s")
        text = item.strip()
        shown = shorten(repr(item))  # a value may be thousands of characters
        m = re.fullmatch(r"\[([^\]]*)\](?::([0-9]*))?|([^:\[\]]*)(?::([0-9]*))?|([0-9A-Fa-f:.]*)", text)
        if not m:
            raise BadValue(f"{shown}: must be IPv4, IPv4:PORT, IPv6 or [IPv6]:PORT")
        host, port = (m[1], m[2]) if m[1] is not None else (m[3], m[4]) if m[3] is not None else (m[5], None)
        try:
            addr = ip_address(_no_zone(host))
        except ValueError:
            raise BadValue(f"{shown}: must be IPv4, IPv4:PORT, IPv6 or [IPv6]:PORT") from None
        if addr.is_unspecified or addr.is_multicast:
            raise BadValue(f"{shown}: must be a unicast address")
        # (no int() of more digits than a port has: it refuses over 4300 of them)
        if port is not None and (not port.isdigit() or len(port) > 5 or not 1 <= int(port) <= 65535):
            raise BadValue(f"{shown}: the port must be 1..65535")
        where = f"[{addr}]" if addr.version == 6 else str(addr)
        out.append(f"{where}:{int(port) if port else 53}")
    return tuple(out)


def parse_listen_addresses(v: list[Any], _base: Path) -> tuple[IPAddress, ...]:
    """Addresses to listen on (IPv4 or IPv6); empty: the node's address."""
    out = []
    for item in v:
        if not isinstance(item, str):
            raise BadValue(f"must be an array of strings, not of {type_name(item)}s")
        try:
            out.append(ip_address(item.strip()))
        except ValueError:
            raise BadValue(f"{item!r}: must be an IP address") from None
    return tuple(out)


_QUALIFIED_PATH = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9/_.-]+")


def parse_controller_name(s: str) -> str:
    """An IngressClass controller name: a domain-prefixed path such as agentd.io/ingress-controller."""
    if len(s) > 250 or not _QUALIFIED_PATH.fullmatch(s):
        raise BadValue("must be a domain-prefixed path such as agentd.io/ingress-controller")
    return s


def parse_object_ref(s: str) -> str:
    """NAMESPACE/NAME of an object (lower-case RFC 1123 names)."""
    ns, slash, name = s.partition("/")
    if not slash or not _DNS_LABEL.fullmatch(ns) or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name):
        raise BadValue("must be NAMESPACE/NAME, e.g. kube-system/agentd-ingress")
    return s


def parse_ipv6_or_none(s: str) -> IPv6Address | None:
    if not s.strip():
        return None
    try:
        a = ip_address(s.strip())
    except ValueError:
        raise BadValue("must be an IPv6 address") from None
    if not isinstance(a, IPv6Address) or a.is_unspecified or a.is_multicast or a.is_loopback or a.scope_id:
        raise BadValue("must be a global or unique-local unicast IPv6 address (no ::1, no %zone)")
    return a


def parse_any_ip(s: str) -> IPAddress:
    try:
        addr = ip_address(s.strip())
    except ValueError:
        raise BadValue("must be an IPv4 or IPv6 address") from None
    if isinstance(addr, IPv6Address):
        if addr.scope_id or addr.is_link_local:
            # A link-local address means nothing without its interface (RFC 4007 §6), and the
            # transport names none: such a peer would never connect.
            raise BadValue("must not be link-local (fe80::/10) or carry a %zone: link-local peers are not "
                           "supported, use a global address")
        if addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped  # one peer, one spelling: ::ffff:192.0.2.1 is 192.0.2.1
    if addr.is_unspecified or addr.is_multicast or addr == IPv4Address("255.255.255.255"):
        raise BadValue("must be a unicast address")
    return addr


def parse_network(s: str, *, v4_only: bool) -> IPNetwork:
    try:
        net = ip_network(_no_zone(s), strict=False)
    except ValueError:
        raise BadValue(f"must be {'an IPv4' if v4_only else 'an IP'} network like 10.244.0.0/16") from None
    if v4_only and net.version != 4:
        raise BadValue("must be an IPv4 network")
    if "/" not in s:
        example = f"{net.network_address}/{16 if v4_only else net.max_prefixlen}"
        raise BadValue(f"needs a prefix length, e.g. {example}")
    if net.network_address != ip_address(s.strip().split("/")[0]):
        raise BadValue(f"has host bits set (did you mean {net}?)")
    return net


_NOT_POD_SPACE = [ip_network(n) for n in ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4")]


def parse_pod_network(s: str) -> IPNetwork:
    """The cluster network: an IPv4 network pods can have addresses in (unicast, not loopback)."""
    net = parse_network(s, v4_only=True)
    clash = next((n for n in _NOT_POD_SPACE if net.overlaps(n)), None)
    if clash is not None:
        raise BadValue(f"overlaps {clash}, which pods cannot use (loopback, link-local, multicast or reserved)")
    return net


# RFC 4291 §2.4: what pods cannot have addresses in (loopback, link-local, multicast, the
# IPv4-mapped and unspecified space).
_NOT_POD_SPACE_V6 = [ip_network(n) for n in ("::/8", "fe80::/10", "ff00::/8")]


SERVICE_PREFIX_V6 = (64, 124)  # an IPv6 service range: at most a /64, at least 16 addresses


def parse_service_network_v6(s: str) -> IPv6Network:
    """The IPv6 service range: unicast like a pod network, from /64 to /124."""
    net = parse_pod_network_v6(s)
    low, high = SERVICE_PREFIX_V6
    if not low <= net.prefixlen <= high:
        raise BadValue(f"must be a /{low} to a /{high} (e.g. fd00:10:96::/112), not a /{net.prefixlen}")
    return net


def parse_pod_network_v6(s: str) -> IPv6Network:
    """The cluster's IPv6 pod network: unicast, outside loopback, link-local and multicast."""
    try:
        net = ip_network(_no_zone(s), strict=False)
    except ValueError:
        raise BadValue("must be an IPv6 network like fd00:10:244::/48") from None
    if net.version != 6:
        raise BadValue("must be an IPv6 network like fd00:10:244::/48, not IPv4 ([network] cidr is the IPv4 one)")
    if "/" not in s:
        raise BadValue(f"needs a prefix length, e.g. {net.network_address}/48")
    if net.network_address != ip_address(s.strip().split("/")[0]):
        raise BadValue(f"has host bits set (did you mean {net}?)")
    clash = next((n for n in _NOT_POD_SPACE_V6 if net.overlaps(n)), None)
    if clash is not None:
        raise BadValue(f"overlaps {clash}, which pods cannot use (loopback, IPv4-mapped, link-local or multicast)")
    return net


def parse_cluster_id(v: int | str, _base: Path) -> IPv4Address | None:
    # RFC 4456 §7: a 4-octet CLUSTER_ID, written as a dotted quad or an integer.
    if isinstance(v, int):
        if not 0 <= v <= 0xFFFFFFFF:
            raise BadValue(f"{v} is out of range: a cluster id is an IPv4 address or an integer 0..4294967295")
        return IPv4Address(v)
    if re.fullmatch(r"[ \t]*[0-9]{1,20}[ \t]*", v):
        return parse_cluster_id(int(v), _base)
    return parse_ipv4(v, unicast=False)


def parse_mtu(v: int | str, _base: Path) -> int | None:
    if isinstance(v, str):
        if v.strip() == "auto":
            return None
        if not re.fullmatch(r"[ \t]*[0-9]{1,6}[ \t]*", v):
            raise BadValue('must be "auto" or an integer')
        v = int(v)
    if not 576 <= v <= 65535:  # RFC 791: every IPv4 host accepts 576-octet datagrams
        raise BadValue('must be "auto" or 576..65535')
    return v


def parse_node_name(s: str) -> str | None:
    if not s.strip():
        return None
    if len(s) > 253 or not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", s):
        raise BadValue("must be a host name (letters, digits, '.', '-', '_'; at most 253)")
    return s


def parse_password(s: str) -> str | None:
    if not s:
        return None
    if len(s.encode()) > _TCP_MD5_MAX_KEY or "\0" in s:
        raise BadValue(f"must be at most {_TCP_MD5_MAX_KEY} bytes (TCP MD5 key) without NUL")
    return s


def parse_group_name(s: str) -> str | None:
    """A local group's name (useradd's default NAME_REGEX), or "" for none."""
    if not s:
        return None
    if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,30}\$?", s):
        raise BadValue("must be a group name (lowercase letters, digits, '_', '-'; at most 32) or \"\"")
    return s


def parse_etcd_prefix(s: str) -> str:
    if not re.fullmatch(r"(/[A-Za-z0-9._-]+)+", s):
        raise BadValue('must be a key path like "/agentd" (leading /, no trailing /)')
    return s


def parse_endpoints(v: list[Any], _base: Path) -> tuple[str, ...]:
    seen: set[str] = set()  # a set: a list's `in` made thousands of endpoints quadratic
    for url in v:
        if not isinstance(url, str):
            raise BadValue(f"must be an array of URLs, not of {type_name(url)}s")
        shown = repr(hide_userinfo(url))
        try:
            parts = urllib.parse.urlsplit(url.strip())
            parts.port  # noqa: B018 -- raises ValueError on a bad port
        except ValueError as e:
            raise BadValue(f"{shown}: {e}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadValue(f"{shown} must be an http:// or https:// URL with a host")
        if parts.port == 0 or any(c.isspace() or not c.isprintable() for c in url.strip()):
            raise BadValue(f"{shown} must have a port 1..65535 (or none: 2379) and no spaces")
        if parts.path not in ("", "/") or parts.query or parts.fragment or "@" in parts.netloc:
            raise BadValue(f"{shown} must be scheme://host:port only (no path, query or credentials)")
        if url.strip().lower() in seen:
            raise BadValue(f"{shown} is listed twice")
        seen.add(url.strip().lower())
    if not seen:
        raise BadValue("needs at least one endpoint")
    return tuple(u.strip() for u in v)


def parse_path(s: str, base: Path) -> Path:
    if not s.strip() or "\0" in s:
        raise BadValue("must be a path")
    return Path(os.path.normpath(base / s.strip()))  # absolute as given, else relative to base


ACCESS_LOG_WORDS = ("agent", "off")


def parse_access_log(s: str) -> str:
    """``[ingress] access_log``: "agent", "off", or the absolute path of a file (appended to;
    not looked at beyond refusing a directory: its directory may come later, and a file the
    agent cannot write is a warning at run time, not a refused configuration)."""
    text = s.strip()
    if text in ACCESS_LOG_WORDS:
        return text
    if not text.startswith("/") or not text.isprintable() or text.endswith("/"):
        raise BadValue('must be "agent", "off" or the absolute path of a file, e.g. /var/log/agentd/ingress-access.log')
    path = os.path.normpath(text)
    if os.path.isdir(path):  # (False for a name too long, a directory it may not search: said at run time)
        raise BadValue(f"{path} is a directory, not a file")
    return path


def parse_file_name(s: str, base: Path) -> Path | None:
    """A file's path, not looked at: what parse_tls_file checks is the reader's (commands that
    never open the file, run by users who may not read it)."""
    return parse_path(s, base) if s.strip() else None


def parse_tls_file(s: str, base: Path) -> Path | None:
    if not s.strip():
        return None
    p = parse_path(s, base)
    try:
        if not p.is_file():
            raise BadValue(f"{p} does not exist or is not a regular file")
    except OSError as e:  # a directory on the way we may not search, a name too long
        raise BadValue(f"{p}: {e.strerror or e}") from None
    if not os.access(p, os.R_OK):
        raise BadValue(f"{p} is not readable")
    return p


def parse_token_path(s: str, base: Path) -> Path:
    """``[api] token_file``: a path the agent writes its API token to (renaming a new file over
    what is there) and the commands read it from: what is there already must be a regular file.
    A device (/dev/zero), a FIFO or a directory is refused: the commands would read for ever or
    block, and the agent would rename its file over a device node."""
    p = parse_path(s, base)
    try:
        mode = os.stat(p).st_mode
    except OSError:  # none yet (the agent writes it), or not ours to look at
        return p
    if not stat.S_ISREG(mode):
        raise BadValue(f"{p} exists and is not a regular file (the agent writes its API token there)")
    return p


def parse_bin_dir(v: str | list[Any], base: Path) -> tuple[Path, ...]:
    items = v.split(":") if isinstance(v, str) else v
    if not items or any(not isinstance(i, str) or not i.strip() for i in items):
        raise BadValue("must be a search path of directories like /opt/cni/bin:/usr/lib/cni")
    return tuple(parse_path(i, base) for i in items)


def parse_originate(v: list[Any], _base: Path) -> tuple[IPNetwork, ...]:
    nets: list[IPNetwork] = []
    seen: set[IPNetwork] = set()  # the duplicate check by hash: a list's `in` took 28 s for 16,000
    # prefixes, at a SIGHUP reload on the agent's loop
    for s in v:
        if not isinstance(s, str):
            raise BadValue(f"must be an array of prefixes, not of {type_name(s)}s")
        net = parse_network(s, v4_only=False)
        if net in seen:
            raise BadValue(f"{net} is listed twice")
        seen.add(net)
        nets.append(net)
    return tuple(nets)


def listen_kind(*, allow_empty: bool) -> Kind:
    def check(s: str, _base: Path) -> HostPort | None:
        if allow_empty and not s.strip():
            return None
        try:
            at = HostPort.parse(s)
        except ValueError as e:
            raise BadValue(str(e)) from None
        if not allow_empty and at.port == 0:
            # The API must be findable: `agentd status` and `agentd leave` go to this port.
            raise BadValue("needs a fixed port (1..65535), not 0")
        return at
    return Kind((str,), "a string", str, check)


def current_dir() -> Path:
    """Where relative paths from the environment and the command line start."""
    try:
        return Path.cwd()
    except OSError:  # the working directory was removed under us
        return Path("/")


def text_json(s: str) -> Any:
    try:
        return json.loads(s) if s.strip() else []
    except (ValueError, RecursionError) as e:  # JSONDecodeError, or absurd numbers and nesting
        raise BadValue(f"must be a JSON array of peer objects ({shorten(str(e))})") from None


def parse_peer_list(v: Any, _base: Path) -> list[Any]:
    if not isinstance(v, list):  # JSON text can hold anything
        raise BadValue(f"must be an array of peers, not {type_name(v)}")
    return v


BOOL = Kind((bool,), "a boolean", text_bool, lambda b, _base: b)
ASN = int_kind(1, 4294967295, check_asn)
HOLD_TIME = int_kind(0, 65535, check_hold_time)
PORT = int_kind(1, 65535)
PASSWORD = string_kind(parse_password)
PATH = Kind((str,), "a string", str, parse_path)


def suggest(word: str, candidates: list[str] | tuple[str, ...], shape: Callable[[str], str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {shape(close[0])}?)" if close else ""


def show_value(v: Any, depth: int = 0) -> str:
    """A TOML value as it would be written, shortened to keep errors on one line."""
    if depth > 2 and isinstance(v, (list, dict)):
        text = "..."
    elif isinstance(v, bool):
        text = "true" if v else "false"
    elif isinstance(v, str):
        text = json.dumps(hide_userinfo(v), ensure_ascii=False)
    elif isinstance(v, list):
        text = "[" + ", ".join(show_value(x, depth + 1) for x in v[:8]) + "]"
    elif isinstance(v, dict):
        text = "{" + ", ".join(f"{k} = {show_value(x, depth + 1)}" for k, x in list(v.items())[:8]) + "}"
    else:
        text = str(v)
    return shorten(text)


def show_text(s: str) -> str:
    return shorten(one_line(hide_userinfo(s)))


def hide_userinfo(text: str) -> str:
    """http://user:pw@host -> http://***@host: credentials never reach an error line or a log."""
    return re.sub(r"//[^/@\s]*@", "//***@", text)


def one_line(text: str) -> str:
    """Escape what would break the line (newlines, U+2028, control characters) in user text."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


