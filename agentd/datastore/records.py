"""What the datastore keeps in etcd, as plain values: records, keys, subnet arithmetic.

Pure: no asyncio, no etcd, no clock.  Every record is a frozen dataclass with
``to_json() -> bytes`` and ``from_json(...)``; bad input raises ``RecordError`` with
one line naming the record and the field.  Unknown JSON keys are ignored so that a
newer agent can add fields without breaking older ones (forward compatibility).

Keys (docs/operations.md, "What agentd keeps in etcd"; prefix default ``/agentd``)::

    <prefix>/config               ClusterConfig, first writer wins
    <prefix>/nodes/<name>         NodeRecord, under the node's liveness lease
    <prefix>/subnets/<ip>-<len>   SubnetLease, under the same lease; IPv6 subnets as their
                                  RFC 5952 text (``fd00:10:244:3::-64``): one spelling per
                                  subnet, so the key's existence decides who holds it
"""

from __future__ import annotations

import bisect
import json
import random
import reprlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network
from typing import Any, Literal, Self

from agentd.backend_table import NAMES as BACKENDS
from agentd.digits import whole_number

ENCAPS = ("always", "cross-subnet")
# A pod subnet needs room for the bridge gateway and at least one pod: /30 is the
# smallest that has two usable addresses.
MAX_SUBNET_LEN = 30
MAX_SUBNET_LEN_V6 = 126  # the same for IPv6: a gateway and one pod (::0 is the subnet-router anycast)
IP_FAMILIES = ("ipv4", "dual", "ipv6")
VERSIONS = {"ipv4": (4,), "dual": (4, 6), "ipv6": (6,)}  # the IP versions of each ip_family
ASN_MAX = 2**32 - 1  # 4-octet AS numbers (RFC 6793)
NODE_NAME_MAX = 253  # a DNS name, as Kubernetes node names are


class RecordError(ValueError):
    """A record in etcd (or given to the datastore) is malformed; the message is one line."""


class NonCanonicalSubnetKey(RecordError):
    """A subnet key naming ``subnet`` in another spelling than ``subnet_key`` gives (someone
    else's ``etcdctl put``, a migration script): a bad record, but the subnet stays taken."""

    def __init__(self, message: str, subnet: IPv4Network | IPv6Network) -> None:
        super().__init__(message)
        self.subnet = subnet


class DatastoreError(RuntimeError):
    """Base class of the datastore's operational errors."""


class DatastoreUnavailable(DatastoreError):
    """etcd could not be reached before the caller's deadline."""


class SubnetExhausted(DatastoreError):
    """Every subnet of the cluster network is leased."""


class HistoryCompacted(DatastoreError):
    """etcd no longer keeps the revision asked for (compacted away)."""


# -- field checks (one line each, naming the record and the field) ---------------


# A record's field may be megabytes (etcd takes values up to 1.5 MiB): what an error (and the
# log line it becomes) quotes of it is shortened to about this many characters.
QUOTED_MAX = 64
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = QUOTED_MAX


def _q(value: Any) -> str:
    """``repr(value)``, shortened to about QUOTED_MAX characters ("'aaaa...aaaa'")."""
    return _SHORT.repr(value)


def clip(text: str) -> str:
    """``text``, or its start and end around "..." when longer than QUOTED_MAX (a key in a log line)."""
    if len(text) <= QUOTED_MAX:
        return text
    half = (QUOTED_MAX - 3) // 2
    return f"{text[:half]}...{text[-half:]}"


def _why(err: ValueError, text: str) -> str:
    """ipaddress's reason for refusing ``text``, without a long ``text`` it repeats (the
    message quotes it already, shortened)."""
    msg = str(err)
    if len(text) > QUOTED_MAX:
        msg = msg.replace(repr(text), "it").replace(text, "it")
    return msg if len(msg) <= 2 * QUOTED_MAX else msg[: 2 * QUOTED_MAX - 3] + "..."


def _load(kind: str, data: bytes | str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise RecordError(f"{kind}: not valid JSON ({type(e).__name__}: {e})" if isinstance(e, RecursionError)
                          else f"{kind}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise RecordError(f"{kind}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _field(kind: str, obj: Mapping[str, Any], name: str) -> Any:
    if name not in obj:
        raise RecordError(f"{kind}: missing field {name!r}")
    return obj[name]


def _str(kind: str, name: str, value: Any, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise RecordError(f"{kind}: field {name!r} must be a string, got {_typename(value)}")
    return value


def _int(kind: str, name: str, value: Any, lo: int, hi: int) -> int:
    # bool is an int in Python; JSON true is not a number.
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordError(f"{kind}: field {name!r} must be an integer, got {_typename(value)}")
    if not lo <= value <= hi:
        raise RecordError(f"{kind}: field {name!r} = {_q(value)} is outside {lo}..{hi}")
    return value


def _bool(kind: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RecordError(f"{kind}: field {name!r} must be true or false, got {_typename(value)}")
    return value


def _dict(kind: str, name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RecordError(f"{kind}: field {name!r} must be an object, got {_typename(value)}")
    return dict(value)


_FAMILY_NAMES = {4: "an IPv4", 6: "an IPv6", None: "an IP"}


def _address(kind: str, name: str, value: Any, version: int | None = 4) -> IPv4Address | IPv6Address:
    """An address of IP ``version`` (None: either)."""
    if isinstance(value, (IPv4Address, IPv6Address)) and version in (None, value.version):
        return value
    text = _str(kind, name, str(value) if isinstance(value, (IPv4Address, IPv6Address)) else value)
    try:
        addr = ip_address(text) if "%" not in text else None  # a zone: no address other hosts route to
    except ValueError:
        addr = None
    if addr is None or version not in (None, addr.version):
        raise RecordError(f"{kind}: field {name!r} = {_q(text)} is not {_FAMILY_NAMES[version]} address") from None
    return addr


def _network(kind: str, name: str, value: Any, version: int | None = 4) -> IPv4Network | IPv6Network:
    """A network (no host bits) of IP ``version`` (None: either)."""
    if isinstance(value, (IPv4Network, IPv6Network)) and version in (None, value.version):
        return value
    text = _str(kind, name, str(value) if isinstance(value, (IPv4Network, IPv6Network)) else value)
    try:
        if "%" in text:
            raise ValueError("an IPv6 zone (%...) has no place in a network")
        net = ip_network(text)
    except ValueError as e:
        raise RecordError(f"{kind}: field {name!r} = {_q(text)} is not {_FAMILY_NAMES[version]} network ({_why(e, text)})") from None
    if version not in (None, net.version):
        raise RecordError(f"{kind}: field {name!r} = {_q(text)} is not {_FAMILY_NAMES[version]} network")
    return net


def _typename(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _dumps(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def check_node_name(name: Any, kind: str = "node record", field: str = "name") -> str:
    """A node name usable as the last element of an etcd key."""
    _str(kind, field, name)
    if not name or len(name) > NODE_NAME_MAX:
        raise RecordError(f"{kind}: field {field!r} must be 1..{NODE_NAME_MAX} characters, got {_q(name)}")
    if "/" in name or any(c.isspace() or not c.isprintable() for c in name):
        raise RecordError(f"{kind}: field {field!r} = {_q(name)} must not contain '/', spaces or control characters")
    return name


# -- records -------------------------------------------------------------------


DEFAULT_SERVICE_CIDR = IPv4Network("10.96.0.0/12")  # kube-apiserver's --service-cluster-ip-range default
DEFAULT_SERVICE_CIDR_V6 = IPv6Network("fd00:10:96::/112")  # [network] service_cidr_v6's default


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster network, stored once at ``<prefix>/config``; the first writer wins."""

    cidr: IPv4Network
    subnet_len: int
    backend: str
    encap: str
    # Services: the cluster IP range; records written before it have the default.
    service_cidr: IPv4Network = IPv4Network("10.96.0.0/12")  # DEFAULT_SERVICE_CIDR
    # The families pods have addresses in, and the IPv6 pod network (dual, ipv6).  Records
    # written before them are "ipv4".  ``cidr`` is kept in every record (older agents read
    # it), but with "ipv6" nobody leases from it.
    ip_family: str = "ipv4"
    cidr_v6: IPv6Network | None = None
    subnet_len_v6: int | None = None
    # Services' IPv6 range (a cluster with IPv6; records without it have the default).
    service_cidr_v6: IPv6Network | None = None

    _KIND = "cluster config"

    def __post_init__(self) -> None:
        kind = self._KIND
        cidr = self.cidr
        if not isinstance(cidr, IPv4Network):
            try:
                cidr = IPv4Network(_str(kind, "cidr", cidr))
            except ValueError as e:
                raise RecordError(f"{kind}: field 'cidr' = {_q(self.cidr)} is not an IPv4 network ({_why(e, str(self.cidr))})") from None
            object.__setattr__(self, "cidr", cidr)
        _int(kind, "subnet_len", self.subnet_len, cidr.prefixlen, MAX_SUBNET_LEN)
        if _str(kind, "backend", self.backend) not in BACKENDS:
            raise RecordError(f"{kind}: field 'backend' = {_q(self.backend)} is not one of {', '.join(BACKENDS)}")
        if _str(kind, "encap", self.encap) not in ENCAPS:
            raise RecordError(f"{kind}: field 'encap' = {_q(self.encap)} is not one of {', '.join(ENCAPS)}")
        # Not checked against cidr: records written before the field have the default, whatever cidr is.
        object.__setattr__(self, "service_cidr", _network(kind, "service_cidr", self.service_cidr))
        if _str(kind, "ip_family", self.ip_family) not in IP_FAMILIES:
            raise RecordError(f"{kind}: field 'ip_family' = {_q(self.ip_family)} is not one of {', '.join(IP_FAMILIES)}")
        if self.ip_family != "ipv4" or self.cidr_v6 is not None:
            if self.cidr_v6 is None or self.subnet_len_v6 is None:
                raise RecordError(f"{kind}: ip_family {self.ip_family} needs the fields 'cidr_v6' and 'subnet_len_v6'")
            cidr_v6 = _network(kind, "cidr_v6", self.cidr_v6, 6)
            object.__setattr__(self, "cidr_v6", cidr_v6)
            _int(kind, "subnet_len_v6", self.subnet_len_v6, cidr_v6.prefixlen, MAX_SUBNET_LEN_V6)
        if self.service_cidr_v6 is not None:
            object.__setattr__(self, "service_cidr_v6", _network(kind, "service_cidr_v6", self.service_cidr_v6, 6))

    @property
    def versions(self) -> tuple[int, ...]:
        """The IP versions nodes lease subnets of: (4,), (4, 6) or (6,)."""
        return VERSIONS[self.ip_family]

    def service_ranges(self) -> dict[str, IPv4Network | IPv6Network]:
        """The range Services get cluster IPs from, of each family of the cluster ("IPv4",
        "IPv6"), the primary first."""
        ranges: dict[int, IPv4Network | IPv6Network] = {4: self.service_cidr, 6: self.service_cidr_v6 or DEFAULT_SERVICE_CIDR_V6}
        return {f"IPv{v}": ranges[v] for v in self.versions}

    def pool(self, version: int) -> tuple[IPv4Network | IPv6Network, int]:
        """(the pod network, the node subnets' prefix length) of IP ``version``."""
        if version == 6:
            assert self.cidr_v6 is not None and self.subnet_len_v6 is not None, "no IPv6 pod network"
            return self.cidr_v6, self.subnet_len_v6
        return self.cidr, self.subnet_len

    @property
    def subnet_count(self) -> int:
        return subnet_count(self.cidr, self.subnet_len)

    def to_json(self) -> bytes:
        obj: dict[str, Any] = {"cidr": str(self.cidr), "subnet_len": self.subnet_len, "backend": self.backend, "encap": self.encap}
        if self.service_cidr != DEFAULT_SERVICE_CIDR:  # optional: the record docs/operations.md lists, plus this when set
            obj["service_cidr"] = str(self.service_cidr)
        if self.ip_family != "ipv4" or self.cidr_v6 is not None:  # an IPv4 cluster's record is as it was
            obj.update(ip_family=self.ip_family, cidr_v6=str(self.cidr_v6), subnet_len_v6=self.subnet_len_v6)
        if self.service_cidr_v6 is not None:
            obj["service_cidr_v6"] = str(self.service_cidr_v6)
        return _dumps(obj)

    @classmethod
    def from_json(cls, data: bytes | str) -> Self:
        kind = cls._KIND
        obj = _load(kind, data)
        return cls(
            cidr=_network(kind, "cidr", _field(kind, obj, "cidr")),
            subnet_len=_int(kind, "subnet_len", _field(kind, obj, "subnet_len"), 0, 32),
            backend=_str(kind, "backend", _field(kind, obj, "backend")),
            encap=_str(kind, "encap", _field(kind, obj, "encap")),
            service_cidr=_network(kind, "service_cidr", obj.get("service_cidr", str(DEFAULT_SERVICE_CIDR))),
            ip_family=_str(kind, "ip_family", obj.get("ip_family", "ipv4")),
            cidr_v6=None if obj.get("cidr_v6") is None else _network(kind, "cidr_v6", obj["cidr_v6"], 6),
            subnet_len_v6=None if obj.get("subnet_len_v6") is None
            else _int(kind, "subnet_len_v6", obj["subnet_len_v6"], 0, 128),
            service_cidr_v6=None if obj.get("service_cidr_v6") is None
            else _network(kind, "service_cidr_v6", obj["service_cidr_v6"], 6),
        )


@dataclass(frozen=True)
class NodeRecord:
    """A live node, at ``<prefix>/nodes/<name>`` under the node's liveness lease.

    ``address`` is its IPv4 underlay address (None only in an IPv6-only cluster),
    ``address_v6`` its IPv6 one where it has one, ``link_local_v6`` the fe80:: address of its
    underlay interface (host-gw's IPv6 next hop where the segment has no IPv6 addresses),
    ``subnet`` / ``subnet_v6`` its pod subnets.  ``create_revision``: etcd's create_revision of
    the record's key where it was read from etcd (0: not read from etcd, or not known) -- not
    part of the JSON, and not compared: a put of the key (a re-publish, a new lease's) keeps it,
    only a key deleted and made again gets a new one.  Of two records publishing one VTEP MAC
    the one made first keeps it (agentd.kernel.forwarding.vxlan_vtep_refusals)."""

    name: str
    address: IPv4Address | None
    asn: int
    subnet: IPv4Network | None
    route_reflector: bool
    cluster_id: str | None
    backend: dict[str, Any] = field(default_factory=dict, hash=False)
    address_v6: IPv6Address | None = None
    subnet_v6: IPv6Network | None = None
    link_local_v6: IPv6Address | None = None
    create_revision: int = field(default=0, compare=False)

    _KIND = "node record"

    def __post_init__(self) -> None:
        kind = self._KIND
        check_node_name(self.name, kind)
        if self.address is None and self.address_v6 is None:
            raise RecordError(f"{kind}: field 'address' must be an IPv4 address (null only beside an 'address_v6')")
        for name, version in (("address", 4), ("address_v6", 6), ("link_local_v6", 6)):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _address(kind, name, getattr(self, name), version))
        # The other nodes map a route's next hop to the node by these (forwarding.next_hop_forms):
        # a record naming another node's IPv4-mapped form (::ffff:<its address>) or an address of
        # every segment (link-local) would take that node's routes.  The agent writes what its
        # config allows ([node] address_v6: never link-local or mapped) and its interface's fe80::.
        if self.address_v6 is not None and (self.address_v6.is_link_local or self.address_v6.ipv4_mapped is not None):
            raise RecordError(f"{kind}: field 'address_v6' = '{self.address_v6}' is link-local or IPv4-mapped, "
                              "not an address the other nodes reach this node at")  # fmt: skip
        if self.link_local_v6 is not None and not self.link_local_v6.is_link_local:
            raise RecordError(f"{kind}: field 'link_local_v6' = '{self.link_local_v6}' is not a link-local (fe80::/10) address")
        _int(kind, "asn", self.asn, 1, ASN_MAX)
        for name, version in (("subnet", 4), ("subnet_v6", 6)):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _network(kind, name, getattr(self, name), version))
        _bool(kind, "route_reflector", self.route_reflector)
        _str(kind, "cluster_id", self.cluster_id, optional=True)
        object.__setattr__(self, "backend", _dict(kind, "backend", self.backend))

    @property
    def peer_address(self) -> IPv4Address | IPv6Address:
        """Where its BGP sessions and tunnels go: its IPv4 address, or its IPv6 one in an
        IPv6-only cluster."""
        return self.address if self.address is not None else self.address_v6  # type: ignore[return-value]

    def to_json(self) -> bytes:
        obj: dict[str, Any] = {
            "name": self.name,
            "address": None if self.address is None else str(self.address),
            "asn": self.asn,
            "subnet": None if self.subnet is None else str(self.subnet),
            "route_reflector": self.route_reflector,
            "cluster_id": self.cluster_id,
            "backend": self.backend,
        }
        for name in ("address_v6", "subnet_v6", "link_local_v6"):  # only when set: an IPv4 node's record is as it was
            if getattr(self, name) is not None:
                obj[name] = str(getattr(self, name))
        return _dumps(obj)

    @classmethod
    def from_json(cls, data: bytes | str, create_revision: int = 0) -> Self:
        kind = cls._KIND
        obj = _load(kind, data)
        subnet = _field(kind, obj, "subnet")
        address = _field(kind, obj, "address")

        def optional(name: str, parse: Any) -> Any:
            return None if obj.get(name) is None else parse(kind, name, obj[name], 6)

        return cls(
            name=check_node_name(_field(kind, obj, "name"), kind),
            address=None if address is None and obj.get("address_v6") is not None
            else _address(kind, "address", address),
            asn=_int(kind, "asn", _field(kind, obj, "asn"), 1, ASN_MAX),
            subnet=None if subnet is None else _network(kind, "subnet", subnet),
            route_reflector=_bool(kind, "route_reflector", _field(kind, obj, "route_reflector")),
            cluster_id=_str(kind, "cluster_id", obj.get("cluster_id"), optional=True),
            backend=_dict(kind, "backend", obj.get("backend", {})),
            address_v6=optional("address_v6", _address),
            subnet_v6=optional("subnet_v6", _network),
            link_local_v6=optional("link_local_v6", _address),
            create_revision=create_revision,
        )


@dataclass(frozen=True)
class SubnetLease:
    """A node's pod subnet, at ``<prefix>/subnets/<ip>-<len>`` under the node's lease.

    The subnet is the key, not part of the JSON value (docs/operations.md, "What agentd keeps in etcd"); ``lease_id``
    is the etcd lease the key is attached to, when known.
    """

    subnet: IPv4Network | IPv6Network
    node: str
    public_ip: IPv4Address | IPv6Address  # the node's underlay address (IPv6 in an IPv6-only cluster)
    backend_type: str
    backend_data: dict[str, Any] = field(default_factory=dict, hash=False)
    lease_id: int | None = None

    _KIND = "subnet lease"

    def __post_init__(self) -> None:
        kind = self._KIND
        object.__setattr__(self, "subnet", _network(kind, "subnet", self.subnet, None))
        check_node_name(self.node, kind, "node")
        object.__setattr__(self, "public_ip", _address(kind, "public_ip", self.public_ip, None))
        _str(kind, "backend_type", self.backend_type)
        object.__setattr__(self, "backend_data", _dict(kind, "backend_data", self.backend_data))

    def to_json(self) -> bytes:
        return _dumps(
            {
                "node": self.node,
                "public_ip": str(self.public_ip),
                "backend_type": self.backend_type,
                "backend_data": self.backend_data,
            }
        )

    @classmethod
    def from_json(cls, data: bytes | str, subnet: IPv4Network | IPv6Network | str, lease_id: int | None = None) -> Self:
        kind = f"{cls._KIND} {subnet}"
        obj = _load(kind, data)
        node = _field(kind, obj, "node")
        check_node_name(node, kind, "node")
        return cls(
            subnet=_network(kind, "subnet", subnet, None),
            node=node,
            public_ip=_address(kind, "public_ip", _field(kind, obj, "public_ip"), None),
            backend_type=_str(kind, "backend_type", _field(kind, obj, "backend_type")),
            backend_data=_dict(kind, "backend_data", obj.get("backend_data", {})),
            lease_id=lease_id or None,
        )


@dataclass(frozen=True)
class NodeEvent:
    """One item of ``Datastore.watch_nodes()``.

    ``snapshot`` carries every node (``nodes``); ``put`` carries ``name`` and ``record``;
    ``delete`` carries ``name`` (the key vanished: removed, or its lease expired).
    """

    kind: Literal["snapshot", "put", "delete"]
    name: str | None = None
    record: NodeRecord | None = None
    nodes: dict[str, NodeRecord] | None = field(default=None, hash=False)


# -- keys ------------------------------------------------------------------------


def normalize_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.rstrip("/") == "":
        raise ValueError(f"etcd prefix must be an absolute key path like '/agentd', got {_q(prefix)}")
    return prefix.rstrip("/")


def config_key(prefix: str) -> bytes:
    return f"{prefix}/config".encode()


def read_token_key(prefix: str) -> bytes:
    """Where the cluster read token is kept (agentd/daemon/cluster.py)."""
    return f"{prefix}/cluster/read-token".encode()


def parse_read_token(key: bytes, raw: bytes) -> str:
    """``{"token": "..."}``, the token; RecordError saying what to do otherwise."""
    try:
        stored = json.loads(raw)["token"]
    except (ValueError, KeyError, TypeError, RecursionError):
        stored = None
    if not isinstance(stored, str) or not stored.strip():
        raise RecordError(f'{key.decode()} is not {{"token": "..."}}: delete it and an agent stores a new one')
    return stored.strip()


def nodes_prefix(prefix: str) -> bytes:
    return f"{prefix}/nodes/".encode()


def node_key(prefix: str, name: str) -> bytes:
    return nodes_prefix(prefix) + check_node_name(name).encode()


def subnets_prefix(prefix: str) -> bytes:
    return f"{prefix}/subnets/".encode()


def subnet_key(prefix: str, subnet: IPv4Network | IPv6Network) -> bytes:
    """``/agentd/subnets/10.244.3.0-24`` (flannel's key format), ``/agentd/subnets/fd00:10:244:3::-64``
    (the address as RFC 5952 writes it, which ipaddress does: one key per subnet; ':' is an
    ordinary byte in an etcd key)."""
    return subnets_prefix(prefix) + f"{subnet.network_address}-{subnet.prefixlen}".encode()


def parse_subnet_key(prefix: str, key: bytes | str) -> IPv4Network | IPv6Network:
    """The subnet named by a ``<prefix>/subnets/<ip>-<len>`` key; RecordError if it is not one,
    NonCanonicalSubnetKey if it names a subnet but is not that subnet's ``subnet_key`` (every
    compare and delete uses ``subnet_key``: one subnet, one key)."""
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    head = subnets_prefix(prefix).decode()
    if not text.startswith(head):
        raise RecordError(f"subnet key {_q(text)} is not under {head!r}")
    ip, sep, length = text[len(head) :].rpartition("-")
    bits = whole_number(length, 10) if sep else None
    if bits is None:
        raise RecordError(f"subnet key {_q(text)} is not of the form <ip>-<len>")
    try:
        subnet = ip_network(f"{ip}/{bits}")
    except ValueError as e:
        raise RecordError(f"subnet key {_q(text)} does not name a subnet ({_why(e, f'{ip}/{length}')})") from None
    canonical = subnet_key(prefix, subnet).decode()
    if text != canonical:
        raise NonCanonicalSubnetKey(
            f"subnet key {_q(text)} spells {subnet} other than agentd's {canonical!r}: the subnet stays "
            "taken, by no node, until this key is deleted", subnet)
    return subnet


def parse_node_key(prefix: str, key: bytes | str) -> str:
    """The node name of a ``<prefix>/nodes/<name>`` key; RecordError if it is not one."""
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    head = nodes_prefix(prefix).decode()
    if not text.startswith(head):
        raise RecordError(f"node key {_q(text)} is not under {head!r}")
    return check_node_name(text[len(head) :], f"node key under {head}")


def parse_node(prefix: str, key: bytes | str, value: bytes, create_revision: int = 0) -> NodeRecord:
    """A node record whose name must match its key (``create_revision``: its key's, from etcd)."""
    name = parse_node_key(prefix, key)
    record = NodeRecord.from_json(value, create_revision)
    if record.name != name:
        raise RecordError(f"node record at key {_q(name)} names itself {_q(record.name)}")
    return record


# -- subnet arithmetic -------------------------------------------------------------


Network = IPv4Network | IPv6Network


def subnet_count(cidr: Network, subnet_len: int) -> int:
    """How many /subnet_len subnets the cluster network holds."""
    if not cidr.prefixlen <= subnet_len <= cidr.max_prefixlen:
        raise ValueError(f"subnet_len {subnet_len} does not fit in {cidr}")
    return 1 << (subnet_len - cidr.prefixlen)


def subnet_at(cidr: Network, subnet_len: int, index: int) -> Network:
    """The index-th /subnet_len subnet of cidr (0 is the one at cidr's own address)."""
    count = subnet_count(cidr, subnet_len)
    if not 0 <= index < count:
        raise IndexError(f"subnet index {index} is outside 0..{count - 1} for /{subnet_len} in {cidr}")
    base = int(cidr.network_address) + (index << (cidr.max_prefixlen - subnet_len))
    return type(cidr)((base, subnet_len))


def subnet_index(cidr: Network, subnet_len: int, subnet: Network) -> int:
    """Inverse of subnet_at; ValueError if subnet is not one of cidr's /subnet_len subnets."""
    if subnet.version != cidr.version or subnet.prefixlen != subnet_len or not subnet.subnet_of(cidr):
        raise ValueError(f"{subnet} is not a /{subnet_len} subnet of {cidr}")
    return (int(subnet.network_address) - int(cidr.network_address)) >> (cidr.max_prefixlen - subnet_len)


def is_cluster_subnet(cluster: ClusterConfig, subnet: Network) -> bool:
    """A subnet of the cluster's pod network of its family, of the nodes' prefix length."""
    if subnet.version not in cluster.versions:
        return False
    cidr, subnet_len = cluster.pool(subnet.version)
    return subnet.prefixlen == subnet_len and subnet.subnet_of(cidr)  # type: ignore[arg-type]


def taken_spans(cidr: Network, subnet_len: int, taken: Collection[Network]) -> list[tuple[int, int]]:
    """The indexes (:func:`subnet_at`) of cidr's /subnet_len subnets that overlap a network of
    ``taken`` -- of whatever prefix length: a wider lease (one taken while the cluster's
    subnet_len was shorter, a stray key) holds every subnet inside it, a narrower one the
    subnet around it -- as sorted, merged ``[start, end)`` spans."""
    shift = cidr.max_prefixlen - subnet_len
    base = int(cidr.network_address)
    top = base + cidr.num_addresses
    spans = []
    for s in taken:
        if s.version != cidr.version or not s.overlaps(cidr):  # type: ignore[arg-type]
            continue
        first = max(int(s.network_address), base)
        last = min(int(s.broadcast_address), top - 1)
        spans.append(((first - base) >> shift, ((last - base) >> shift) + 1))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def pick_free_subnet(
    cidr: Network, subnet_len: int, taken: Collection[Network], rng: random.Random
) -> Network | None:
    """A pseudo-random subnet of cidr overlapping none of ``taken`` (leases of any prefix
    length), or None if every one is taken.

    Random rather than lowest-free so that many nodes allocating at the same time
    mostly pick different subnets and rarely lose the etcd transaction race.  Probing
    finds a free one in a few tries while the network is less than half full; past
    that (or for small networks) the free ones are listed and one is chosen.
    """
    count = subnet_count(cidr, subnet_len)
    spans = taken_spans(cidr, subnet_len, taken)
    used = sum(end - start for start, end in spans)
    if used >= count:
        return None
    starts = [start for start, _ in spans]

    def free(index: int) -> bool:
        at = bisect.bisect_right(starts, index) - 1
        return at < 0 or index >= spans[at][1]

    if count > 4096 and used * 2 < count:
        for _ in range(64):
            index = rng.randrange(count)
            if free(index):
                return subnet_at(cidr, subnet_len, index)
    # The k-th free index, k chosen at random: the gaps between the spans, in order.
    k = rng.randrange(count - used)
    previous_end = 0
    for start, end in [*spans, (count, count)]:
        gap = start - previous_end
        if k < gap:
            return subnet_at(cidr, subnet_len, previous_end + k)
        k -= gap
        previous_end = end
    return None


# -- retry pacing ------------------------------------------------------------------


class Backoff:
    """Exponential backoff with jitter: initial, doubling, capped (0.1 s .. 5 s by default).

    The jitter (a random fraction of each delay, up to ``jitter``) keeps many agents
    that lost etcd at the same moment from reconnecting in lockstep.
    """

    def __init__(
        self,
        initial: float = 0.1,
        cap: float = 5.0,
        factor: float = 2.0,
        jitter: float = 0.2,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < initial <= cap or factor < 1 or not 0 <= jitter < 1:
            raise ValueError("backoff needs 0 < initial <= cap, factor >= 1, 0 <= jitter < 1")
        self.initial = initial
        self.cap = cap
        self.factor = factor
        self.jitter = jitter
        self._rng = rng or random.Random()
        self._next = initial

    def next(self) -> float:
        """The delay to wait now; each call doubles the following one, up to the cap."""
        delay = self._next
        self._next = min(self.cap, self._next * self.factor)
        return delay * (1.0 - self.jitter * self._rng.random())

    def reset(self) -> None:
        self._next = self.initial
