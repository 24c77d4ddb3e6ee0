"""What the agent writes about this node for others to read: the CNI files on disk (the
subnet file ``agentd-cni`` reads at every ADD, flannel's subnet.env; the conflist a container
runtime reads) and the node record in etcd (address, ASN, subnet, reflector role, the
backend's data such as the VTEP MAC)."""

from __future__ import annotations

import logging
from ipaddress import IPv4Address, IPv4Network
from typing import Any

from agentd.cni import netconf as cni_config
from agentd.config.settings import Config
from agentd.datastore.store import NodeRecord

log = logging.getLogger("agentd")


def previous_subnet(cfg: Config) -> IPv4Network | None:
    """The subnet this node had, from the subnet file a previous run wrote (None: none, or unreadable)."""
    try:
        sf = cni_config.read_subnet_file(cfg.cni.subnet_file)
    except FileNotFoundError:
        return None
    except cni_config.SubnetFileError as err:
        log.warning("ignoring the subnet file: %s", err)
        return None
    return sf.subnet


def write_cni_files(cfg: Config, network: IPv4Network, subnet: IPv4Network, mtu: int) -> None:
    """The subnet file, and (``[cni] write_conflist``) the conflist, for ``subnet`` of ``network``."""
    dns = cfg.dns
    sf = cni_config.SubnetFile(
        network=network, subnet=subnet, mtu=mtu, backend=cfg.network.backend,
        dns=dns.address if dns.enabled else None, cluster_domain=dns.cluster_domain,
    )  # fmt: skip
    cni_config.write_subnet_file(cfg.cni.subnet_file, sf)
    if cfg.cni.write_conflist:
        cni_config.write_conflist(
            cfg.cni.conf_dir,
            subnet_file=str(cfg.cni.subnet_file),
            data_dir=str(cfg.cni.data_dir),
            ipam_data_dir=str(cfg.cni.ipam_data_dir),
            mtu=mtu,
            bin_dir=cfg.cni.bin_dir,
        )


def node_record(cfg: Config, name: str, address: IPv4Address, subnet: IPv4Network, backend: dict[str, Any]) -> NodeRecord:
    cid = cfg.node.cluster_id if cfg.node.route_reflector else None
    return NodeRecord(
        name=name,
        address=address,
        asn=cfg.node.asn,
        subnet=subnet,
        route_reflector=cfg.node.route_reflector,
        cluster_id=str(cid) if cid else None,
        backend=backend,
    )
