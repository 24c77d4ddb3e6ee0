"""What the agent writes about this node for others to read: the CNI files on disk (the
subnet file ``agentd-cni`` reads at every ADD, flannel's subnet.env; the conflist a container
runtime reads) and the node record in etcd (addresses, ASN, subnets, reflector role, the
backend's data such as the VTEP MAC)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import Any

from agentd.cni import netconf as cni_config
from agentd.config.settings import Config
from agentd.datastore.store import ClusterConfig, NodeRecord, SubnetLease
from agentd.kernel.netinfo import Underlay

log = logging.getLogger("agentd")


def previous_subnets(cfg: Config) -> dict[int, IPv4Network | IPv6Network]:
    """The subnets this node had, by IP version, from the subnet file a previous run wrote
    ({}: none, or unreadable)."""
    try:
        sf = cni_config.read_subnet_file(cfg.cni.subnet_file)
    except FileNotFoundError:
        return {}
    except cni_config.SubnetFileError as err:
        log.warning("ignoring the subnet file: %s", err)
        return {}
    return {s.version: s for s in (sf.subnet, sf.subnet_v6) if s is not None}


def write_cni_files(cfg: Config, cluster: ClusterConfig, leases: Mapping[int, SubnetLease], mtu: int) -> None:
    """The subnet file, and (``[cni] write_conflist``) the conflist, for this node's subnets
    (one per pod family) of the cluster's pod networks."""
    dns = cfg.dns
    v4, v6 = leases.get(4), leases.get(6)
    sf = cni_config.SubnetFile(
        network=cluster.cidr if v4 else None, subnet=v4.subnet if v4 else None,  # type: ignore[arg-type]
        network_v6=cluster.cidr_v6 if v6 else None, subnet_v6=v6.subnet if v6 else None,  # type: ignore[arg-type]
        mtu=mtu, backend=cfg.network.backend,
        # The node-local DNS address pods reach: the IPv4 one, the IPv6 one for pods without IPv4.
        dns=dns.address if dns.enabled and v4 else None, cluster_domain=dns.cluster_domain,
        dns_v6=dns.address_v6 if dns.enabled and v6 and not v4 else None,
    )  # fmt: skip
    cni_config.write_subnet_file(cfg.cni.subnet_file, sf)
    if cfg.cni.write_conflist:
        cni_config.write_conflist(cfg.cni.conf_dir, mtu=mtu, **_conflist_settings(cfg))


def _conflist_settings(cfg: Config) -> dict[str, Any]:
    return {"subnet_file": str(cfg.cni.subnet_file), "data_dir": str(cfg.cni.data_dir),
            "ipam_data_dir": str(cfg.cni.ipam_data_dir), "bin_dir": cfg.cni.bin_dir}


def remove_conflist(cfg: Config) -> bool:
    """``agentd leave`` (``[cni] write_conflist``): remove ``<[cni] conf_dir>/10-agentd.conflist``
    -- left, the runtime would go on choosing agentd's network (its name sorts first) and every
    new pod's ADD fail with "agent not running" instead of falling through to another network.
    Only the file the agent writes goes (the configuration's, at any MTU); an operator's own of
    that name stays (:class:`ValueError` says so).  False where there is none; an OSError says
    why it stays."""
    path = Path(cfg.cni.conf_dir) / cni_config.CONFLIST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    except UnicodeDecodeError:
        text = ""
    try:
        found = json.loads(text)
        mtu = found["plugins"][0]["delegate"].get("mtu")
    except (ValueError, LookupError, TypeError, AttributeError):
        found, mtu = None, None
    if found != cni_config.conflist(mtu=mtu, **_conflist_settings(cfg)):
        raise ValueError(f"{path} is not the one this agent writes ([cni] write_conflist): left as it is")
    path.unlink()
    return True


def node_record(cfg: Config, name: str, underlay: Underlay, leases: Mapping[int, SubnetLease],
                backend: dict[str, Any]) -> NodeRecord:
    """This node as the others read it: its underlay addresses (the IPv6 ones where its pods
    have IPv6 addresses: the next hops of their routes), its subnets, its BGP role."""
    cid = cfg.node.cluster_id if cfg.node.route_reflector else None
    v4, v6 = leases.get(4), leases.get(6)
    return NodeRecord(
        name=name,
        address=cfg.node.address,
        asn=cfg.node.asn,
        subnet=v4.subnet if v4 else None,  # type: ignore[arg-type]
        route_reflector=cfg.node.route_reflector,
        cluster_id=str(cid) if cid else None,
        backend=backend,
        address_v6=cfg.node.address_v6 if cfg.network.ip_family != "ipv4" else None,
        subnet_v6=v6.subnet if v6 else None,  # type: ignore[arg-type]
        link_local_v6=underlay.link_local if v6 else None,
    )
