"""The node's CNI configuration: the subnet file, the conflist, and the delegate config.

The agent writes two files at start, as flannel's daemon does:

* the **subnet file** (flannel's ``/run/flannel/subnet.env`` with ``AGENTD_`` names), which tells
  ``agentd-cni`` the cluster network, this node's pod subnet, the pod MTU and whether the
  delegate should masquerade;
* the **conflist** ``<conf_dir>/10-agentd.conflist`` the container runtime reads: the
  ``agentd-cni`` plugin followed by ``portmap``.

``agentd-cni`` turns its own network config plus the subnet file into a config for the
reference ``bridge`` plugin with ``host-local`` IPAM (:func:`delegate_config`) and runs it.

Subnet file format (``KEY=value`` lines; ``#`` comments and blank lines are ignored)::

    AGENTD_NETWORK=10.244.0.0/16    cluster cidr
    AGENTD_SUBNET=10.244.3.1/24     this node's pod subnet, written like flannel's FLANNEL_SUBNET:
                                    the bridge gateway address (the subnet's first address) with
                                    the subnet's prefix length; readers take the network from it
    AGENTD_IPV6_NETWORK=fd00:10:244::/48    dual-stack and IPv6-only clusters: the IPv6 pod
    AGENTD_IPV6_SUBNET=fd00:10:244:3::1/64  network and this node's IPv6 subnet, in the same
                                    form (flannel's FLANNEL_IPV6_NETWORK / FLANNEL_IPV6_SUBNET);
                                    an IPv6-only node writes these two instead of the IPv4 pair
    AGENTD_MTU=1450                 pod interface MTU
    AGENTD_IPMASQ=false             true: the bridge plugin masquerades pod traffic leaving the
                                    node subnet (note: FLANNEL_IPMASQ=true means the opposite,
                                    "flanneld masquerades, the plugin must not")
    AGENTD_BACKEND=vxlan            informational: the node's backend
    AGENTD_DNS=169.254.20.10        optional: the node-local DNS address (Services); pods get it
                                    as nameserver in the ADD result's "dns"
    AGENTD_DNS_V6=fd00:169:254:20::10  optional, instead of AGENTD_DNS on an IPv6-only node: the
                                    node-local DNS address pods without IPv4 get
    AGENTD_CLUSTER_DOMAIN=cluster.local  optional, with AGENTD_DNS(_V6): the search domains' base
    AGENTD_WRITE_CONFLIST=true      not read here: how the agent runs, for `agentd docker-opts`
    AGENTD_MASQUERADE=true          (agentd/daemon/node_files.py); keys not listed are skipped
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Interface, IPv4Network, IPv6Address, IPv6Interface, IPv6Network
from collections.abc import Sequence
from typing import Any

DEFAULT_SUBNET_FILE = "/run/agentd/subnet.env"
DEFAULT_DATA_DIR = "/var/lib/agentd/cni"  # agentd.config.settings's [cni] data_dir default
CONFLIST_NAME = "10-agentd.conflist"
PLUGIN_TYPE = "agentd-cni"
CONFLIST_CNI_VERSION = "1.0.0"
# The runtimeConfig keys agentd-cni reads (agentd/cni/endpoints.py), declared as capabilities in
# its conflist entry: the runtime (libcni) passes a capability argument only to a plugin whose
# entry declares it.  ``labels`` and ``containerPorts``: the pod's identity for network policy
# (agentd's own conventions, docs/policy.md); ``mac``: the pod's MAC (CNI's convention), which
# the bridge delegate sets (runtimeConfig is handed on) and the endpoint file records.  Not
# ``ipRanges`` (host-local puts a runtime's ranges before the node's subnet), nor ``ips``.
PLUGIN_CAPABILITIES = ("labels", "containerPorts", "mac")

# The smallest MTU every IPv4 link must carry (RFC 791, "Fragmentation and Reassembly").
MIN_MTU = 68
MAX_MTU = 65535

_DIGITS_RE = re.compile(r"[0-9]+")

_KEYS = ("AGENTD_NETWORK", "AGENTD_SUBNET", "AGENTD_IPV6_NETWORK", "AGENTD_IPV6_SUBNET", "AGENTD_MTU",
         "AGENTD_IPMASQ", "AGENTD_BACKEND", "AGENTD_DNS", "AGENTD_DNS_V6", "AGENTD_CLUSTER_DOMAIN")
_REQUIRED = ("AGENTD_MTU",)
_PAIRS = (("AGENTD_NETWORK", "AGENTD_SUBNET"), ("AGENTD_IPV6_NETWORK", "AGENTD_IPV6_SUBNET"))


class SubnetFileError(ValueError):
    """The subnet file (or a SubnetFile value) is not usable; the message is one line."""


@dataclass(frozen=True)
class SubnetFile:
    """What the agent tells ``agentd-cni`` about this node: its IPv4 pod subnet, its IPv6 one,
    or both (dual-stack), each with its cluster network."""

    network: IPv4Network | None  # the cluster cidr (None: an IPv6-only node)
    subnet: IPv4Network | None  # this node's pod subnet
    mtu: int
    ipmasq: bool = False
    backend: str = "host-gw"
    dns: IPv4Address | None = None  # Services: the node-local DNS address
    cluster_domain: str = "cluster.local"
    network_v6: IPv6Network | None = None  # the IPv6 pod network (dual-stack, IPv6-only)
    subnet_v6: IPv6Network | None = None  # this node's IPv6 pod subnet
    dns_v6: IPv6Address | None = None  # Services: the node-local DNS address of pods without IPv4

    def __post_init__(self) -> None:
        pairs = [(self.network, self.subnet, IPv4Network, 30), (self.network_v6, self.subnet_v6, IPv6Network, 126)]
        if all(net is None and sub is None for net, sub, _t, _m in pairs):
            raise SubnetFileError("no pod subnet: an IPv4 or an IPv6 network and subnet are needed")
        for network, subnet, kind, longest in pairs:
            if network is None and subnet is None:
                continue
            if not isinstance(network, kind) or not isinstance(subnet, kind):
                raise SubnetFileError(f"network and subnet must be {kind.__name__} values, together")
            if not subnet.subnet_of(network):
                raise SubnetFileError(f"subnet {subnet} is not inside network {network}")
            # The bridge takes the first address as gateway; pods need at least one more.
            if subnet.prefixlen > longest:
                raise SubnetFileError(f"subnet {subnet} is too small for a gateway and pods (max /{longest})")
        if isinstance(self.mtu, bool) or not isinstance(self.mtu, int) or not MIN_MTU <= self.mtu <= MAX_MTU:
            raise SubnetFileError(f"mtu {self.mtu!r} is not an integer in {MIN_MTU}..{MAX_MTU}")
        if not isinstance(self.ipmasq, bool):
            raise SubnetFileError(f"ipmasq {self.ipmasq!r} is not a bool")
        if not isinstance(self.backend, str) or not self.backend or any(c.isspace() for c in self.backend):
            raise SubnetFileError(f"backend {self.backend!r} must be a non-empty word")

    @property
    def gateway(self) -> IPv4Address | None:
        """The bridge's address in the pod subnet (host-local's default gateway: the first host)."""
        return None if self.subnet is None else self.subnet.network_address + 1

    @property
    def gateway_v6(self) -> IPv6Address | None:
        """The bridge's address in the IPv6 pod subnet (the first after the subnet-router anycast)."""
        return None if self.subnet_v6 is None else self.subnet_v6.network_address + 1

    def pools(self) -> list[tuple[IPv4Network | IPv6Network, IPv4Network | IPv6Network, IPv4Address | IPv6Address]]:
        """(cluster network, node subnet, gateway) per family, IPv4 first."""
        out = []
        if self.subnet is not None and self.network is not None and self.gateway is not None:
            out.append((self.network, self.subnet, self.gateway))
        if self.subnet_v6 is not None and self.network_v6 is not None and self.gateway_v6 is not None:
            out.append((self.network_v6, self.subnet_v6, self.gateway_v6))
        return out


def render_subnet_file(sf: SubnetFile) -> str:
    """The subnet file's text (see the module docstring for the format)."""
    v4 = "" if sf.subnet is None else f"AGENTD_NETWORK={sf.network}\nAGENTD_SUBNET={sf.gateway}/{sf.subnet.prefixlen}\n"
    v6 = "" if sf.subnet_v6 is None else (
        f"AGENTD_IPV6_NETWORK={sf.network_v6}\nAGENTD_IPV6_SUBNET={sf.gateway_v6}/{sf.subnet_v6.prefixlen}\n")
    return v4 + v6 + (
        f"AGENTD_MTU={sf.mtu}\n"
        f"AGENTD_IPMASQ={'true' if sf.ipmasq else 'false'}\n"
        f"AGENTD_BACKEND={sf.backend}\n"
    ) + (f"AGENTD_DNS={sf.dns}\n" if sf.dns is not None else "") + (
        f"AGENTD_DNS_V6={sf.dns_v6}\n" if sf.dns_v6 is not None else "") + (
        f"AGENTD_CLUSTER_DOMAIN={sf.cluster_domain}\n" if sf.dns is not None or sf.dns_v6 is not None else "")


def parse_subnet_file(text: str, source: str = "subnet file") -> SubnetFile:
    """Parse the subnet file's text; raises :class:`SubnetFileError` naming ``source`` and the line."""
    values: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise SubnetFileError(f"{source}:{lineno}: expected KEY=value, got {raw.strip()!r}")
        if key not in _KEYS:
            continue  # forward compatible: a newer agent may write more keys
        if key in values:
            raise SubnetFileError(f"{source}:{lineno}: {key} given twice")
        values[key] = value
    missing = [k for k in _REQUIRED if k not in values]
    for pair in _PAIRS:
        if any(k in values for k in pair):
            missing += [k for k in pair if k not in values]
    if not any(k in values for pair in _PAIRS for k in pair):
        missing[:0] = list(_PAIRS[0])
    if missing:
        raise SubnetFileError(f"{source} is missing {', '.join(sorted(missing, key=_KEYS.index))}")
    (network, subnet), (network_v6, subnet_v6) = (
        _pair(values, names, kinds, source) for names, kinds in zip(_PAIRS, (_V4, _V6)))
    mtu_text = values["AGENTD_MTU"]
    # ASCII digits only: str.isdigit() also takes "²" or "٣", which int() then rejects or reads.
    shown = repr(mtu_text if len(mtu_text) <= 20 else mtu_text[:16] + "...")
    if not _DIGITS_RE.fullmatch(mtu_text):
        raise SubnetFileError(f"{source}: AGENTD_MTU {shown} is not an integer")
    if len(mtu_text.lstrip("0")) > len(str(MAX_MTU)):  # out of range, and int() may refuse it
        raise SubnetFileError(f"{source}: AGENTD_MTU {shown} is not an integer in {MIN_MTU}..{MAX_MTU}")
    ipmasq_text = values.get("AGENTD_IPMASQ", "false")
    if ipmasq_text not in ("true", "false"):
        raise SubnetFileError(f"{source}: AGENTD_IPMASQ {ipmasq_text!r} is not true or false")
    try:
        return SubnetFile(
            network=network,  # type: ignore[arg-type]
            subnet=subnet,  # type: ignore[arg-type]
            network_v6=network_v6,  # type: ignore[arg-type]
            subnet_v6=subnet_v6,  # type: ignore[arg-type]
            mtu=int(mtu_text),
            ipmasq=ipmasq_text == "true",
            backend=values.get("AGENTD_BACKEND", "host-gw"),
            dns=_dns(values.get("AGENTD_DNS"), source),
            dns_v6=_dns(values.get("AGENTD_DNS_V6"), source, 6),  # type: ignore[arg-type]
            cluster_domain=values.get("AGENTD_CLUSTER_DOMAIN", "cluster.local"),
        )
    except SubnetFileError as e:
        raise SubnetFileError(f"{source}: {e}") from None


_V4 = (IPv4Network, IPv4Interface, "an IPv4")
_V6 = (IPv6Network, IPv6Interface, "an IPv6")


def _pair(values: dict[str, str], names: tuple[str, str], kinds: tuple, source: str) -> tuple[Any, Any]:
    """(network, subnet) of one family from the file, or (None, None) when it has not that family."""
    net_key, sub_key = names
    network_kind, interface_kind, what = kinds
    if net_key not in values:
        return None, None
    try:
        if "%" in values[net_key] or "%" in values.get(sub_key, ""):  # host-local (Go's net.ParseCIDR) refuses zones
            raise ValueError("an IPv6 zone (%...) has no place in a pod network")
        network = network_kind(values[net_key], strict=True)
    except ValueError as e:
        raise SubnetFileError(f"{source}: {net_key} {values[net_key]!r} is not {what} network: {e}") from None
    if "/" not in values[sub_key]:
        raise SubnetFileError(f"{source}: {sub_key} {values[sub_key]!r} has no prefix length")
    try:
        # Written as gateway/prefixlen (like FLANNEL_SUBNET); the network address is accepted too.
        subnet = interface_kind(values[sub_key]).network
    except ValueError as e:
        raise SubnetFileError(f"{source}: {sub_key} {values[sub_key]!r} is not {what} address/prefix: {e}") from None
    return network, subnet


def _dns(text: str | None, source: str, version: int = 4) -> IPv4Address | IPv6Address | None:
    if not text:
        return None
    try:
        if "%" in text:  # a zone: pods cannot be told of one in resolv.conf's nameserver
            raise ValueError(text)
        return IPv4Address(text) if version == 4 else IPv6Address(text)
    except ValueError:
        key = "AGENTD_DNS" if version == 4 else "AGENTD_DNS_V6"
        raise SubnetFileError(f"{source}: {key} {text!r} is not an IPv{version} address") from None


def dns_config(sf: SubnetFile, namespace: str | None) -> dict[str, Any] | None:
    """The ADD result's "dns" for a pod (CNI spec: nameservers, search, options), as kubelet
    writes a ClusterFirst pod's resolv.conf: the node-local server and the cluster's search path."""
    servers = [str(a) for a in (sf.dns, sf.dns_v6) if a is not None]
    if not servers:
        return None
    domain = sf.cluster_domain
    search = ([f"{namespace}.svc.{domain}"] if namespace else []) + [f"svc.{domain}", domain]
    return {"nameservers": servers, "search": search, "options": ["ndots:5"]}


SUBNET_FILE_MAX = 64 * 1024  # bytes: the agent writes a dozen short lines


def read_subnet_text(path: str) -> str:
    """The subnet file's text, read as the configuration file is (agentd.config.settings): a
    regular file only, opened without waiting (a FIFO would block for ever, /dev/zero be read
    until memory ran out), at most :data:`SUBNET_FILE_MAX` bytes.  :class:`OSError` or
    :class:`UnicodeDecodeError` says why not (FileNotFoundError: none)."""
    with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NONBLOCK | os.O_CLOEXEC)) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        data = f.read(SUBNET_FILE_MAX + 1)
    if len(data) > SUBNET_FILE_MAX:
        raise OSError(errno.EFBIG, f"over {SUBNET_FILE_MAX} bytes, not a subnet file the agent wrote")
    return data.decode("utf-8")


def read_subnet_file(path: str | os.PathLike[str]) -> SubnetFile:
    """Read and parse the subnet file.

    A missing file raises :class:`FileNotFoundError` (the agent has not written it yet: the CNI
    plugin answers "try again later"); any other problem raises :class:`SubnetFileError`.
    """
    try:
        text = read_subnet_text(os.fspath(path))
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as e:
        raise SubnetFileError(f"cannot read subnet file {path}: {getattr(e, 'strerror', None) or e}") from None
    return parse_subnet_file(text, os.fspath(path))


def write_subnet_file(path: str | os.PathLike[str], sf: SubnetFile) -> None:
    """Write the subnet file atomically (temp file + rename), creating its directory."""
    atomic_write(os.fspath(path), render_subnet_file(sf), mode=0o644)


def conflist(
    *,
    name: str = "agentd",
    subnet_file: str | os.PathLike[str],
    data_dir: str | os.PathLike[str],
    bridge: str = "cni0",
    mtu: int | None = None,
    ipam_data_dir: str | os.PathLike[str] | None = None,
    extra: dict[str, Any] | None = None,
    bin_dir: Sequence[str | os.PathLike[str]] = (),
) -> dict[str, Any]:
    """The node's network configuration list (see :func:`write_conflist`)."""
    delegate: dict[str, Any] = {
        "bridge": bridge,
        # A pod reaching itself through a service VIP needs its packet sent back out its own port.
        "hairpinMode": True,
        # The pod's default route goes to the bridge (implies isGateway).
        "isDefaultGateway": True,
        # If the node's subnet ever changes, replace the bridge's old gateway address instead of
        # failing every ADD with "cni0 already has an IP address different from ...".
        "forceAddress": True,
    }
    if mtu is not None:
        delegate["mtu"] = mtu
    if extra:
        for key in ("name", "ipam"):
            if key in extra:
                raise ValueError(f"extra delegate settings must not set {key!r}; agentd-cni sets it")
        delegate.update(extra)
    plugin: dict[str, Any] = {
        "type": PLUGIN_TYPE,
        # libcni (injectRuntimeConfig) hands a plugin only the capability arguments its entry
        # declares: without these the runtimeConfig keys agentd-cni reads never arrive.
        "capabilities": dict.fromkeys(PLUGIN_CAPABILITIES, True),
        "subnetFile": os.fspath(subnet_file),
        "dataDir": os.fspath(data_dir),
    }
    if bin_dir:
        plugin["binDir"] = [os.fspath(d) for d in bin_dir]
    if ipam_data_dir is not None:
        # host-local keeps its leases in <dataDir>/<network name>; several lab nodes on one
        # machine must not share /var/lib/cni/networks/<name>.
        plugin["ipam"] = {"dataDir": os.fspath(ipam_data_dir)}
    plugin["delegate"] = delegate
    return {
        "cniVersion": CONFLIST_CNI_VERSION,
        "name": name,
        "plugins": [
            plugin,
            {"type": "portmap", "capabilities": {"portMappings": True}, "snat": True},
            # The pod's kubernetes.io/ingress-bandwidth and egress-bandwidth annotations, which
            # the runtime passes only to a plugin declaring the capability (as Calico chains it).
            {"type": "bandwidth", "capabilities": {"bandwidth": True}},
        ],
    }


def write_conflist(
    conf_dir: str | os.PathLike[str],
    *,
    name: str = "agentd",
    subnet_file: str | os.PathLike[str],
    data_dir: str | os.PathLike[str],
    bridge: str = "cni0",
    mtu: int | None = None,
    ipam_data_dir: str | os.PathLike[str] | None = None,
    extra: dict[str, Any] | None = None,
    bin_dir: Sequence[str | os.PathLike[str]] = (),
) -> str:
    """Write ``<conf_dir>/10-agentd.conflist`` atomically and return its path.

    ``data_dir`` is where ``agentd-cni`` keeps each container's delegate config;
    ``ipam_data_dir`` is host-local's ``dataDir`` (default ``/var/lib/cni/networks``);
    ``mtu`` overrides the subnet file's MTU; ``extra`` adds or overrides bridge-plugin settings
    in ``delegate`` (it may not set ``name`` or ``ipam``).
    """
    doc = conflist(
        name=name,
        subnet_file=subnet_file,
        data_dir=data_dir,
        bridge=bridge,
        mtu=mtu,
        ipam_data_dir=ipam_data_dir,
        extra=extra,
        bin_dir=bin_dir,
    )
    path = os.path.join(os.fspath(conf_dir), CONFLIST_NAME)
    atomic_write(path, json.dumps(doc, indent=2) + "\n", mode=0o644)
    return path


def delegate_config(netconf: dict[str, Any], sf: SubnetFile) -> dict[str, Any]:
    """The config ``agentd-cni`` hands to its delegate, merged the way flannel's plugin does it.

    Settings in ``netconf["delegate"]`` win over the defaults derived from the subnet file
    (type bridge, ipMasq, mtu, and for bridge: bridge cni0, isGateway, hairpinMode); ``name`` and
    ``cniVersion`` always come from the network config; ``ipam`` is the network config's own
    ``ipam`` (e.g. host-local's ``dataDir``) with type defaulting to host-local, the range set to
    the node subnet and a route to the cluster cidr appended to any routes given there.
    ``netconf`` is not modified.  Validation of ``netconf`` is the caller's job.
    """
    delegate: dict[str, Any] = dict(netconf.get("delegate") or {})
    delegate["name"] = netconf["name"]
    delegate["cniVersion"] = netconf["cniVersion"]
    delegate.setdefault("type", "bridge")
    delegate.setdefault("ipMasq", sf.ipmasq)
    delegate.setdefault("mtu", sf.mtu)
    if delegate["type"] == "bridge":
        delegate.setdefault("bridge", "cni0")
        delegate.setdefault("isGateway", True)
        delegate.setdefault("hairpinMode", True)

    ipam: dict[str, Any] = dict(netconf.get("ipam") or {})
    ipam.setdefault("type", "host-local")
    pools = sf.pools()
    if len(pools) == 1 and sf.subnet is not None:
        ipam["subnet"] = str(sf.subnet)  # an IPv4 node: host-local's single range, as always
    else:
        # Dual-stack (or IPv6-only): one host-local range set per family, IPv4 first, so a pod
        # gets one address of each and the first (its podIP) is IPv4 as Kubernetes orders them.
        ipam.pop("subnet", None)
        ipam["ranges"] = [[{"subnet": str(subnet)}] for _network, subnet, _gw in pools]
    # Pods reach the rest of the cluster through the bridge gateway (the node routes from there);
    # with isDefaultGateway the default route goes there as well, one per family.  The gateway
    # is spelled out because the bridge plugin's CHECK (plugins v1.1) matches routes on dst
    # *and* gw, and would not find a gw-less route that ADD installed via the gateway.
    ipam["routes"] = [*ipam.get("routes", []), *({"dst": str(net), "gw": str(gw)} for net, _sub, gw in pools)]
    delegate["ipam"] = ipam

    if "runtimeConfig" in netconf:
        delegate["runtimeConfig"] = netconf["runtimeConfig"]
    return delegate


def atomic_write(path: str, text: str, *, mode: int) -> None:
    """``text`` in ``path`` with ``mode``: a new file, synced and renamed over the old one, so a
    reader sees the old content or the new, never half of it."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
