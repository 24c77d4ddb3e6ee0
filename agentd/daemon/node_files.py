"""What the agent writes about this node for others to read: the CNI files on disk (the
subnet file ``agentd-cni`` reads at every ADD, flannel's subnet.env; the conflist a container
runtime reads), the record of its subnets that outlives a reboot, and the node record in etcd
(addresses, ASN, subnets, reflector role, the backend's data such as the VTEP MAC).

The subnet file is in /run (a tmpfs: gone at boot) and the subnet leases in etcd expire
``[etcd] lease_ttl`` after the agent stops renewing them, so neither says after a longer
reboot which subnet the node had.  ``[agent] state_dir``/subnets.json (:data:`KEPT_FILE`,
``{"subnets": ["10.244.3.0/24"]}``) does: the next start asks for that subnet first (it gets
it unless another node has taken it meanwhile) -- flannel keeps its subnet file's subnet the
same way, Calico its block affinities.  It is written with the subnet file, kept when the
subnet is lost (the next start warns that the subnet changed), and removed by ``agentd
leave`` (a node that left does not take its old subnet back).

The subnet file also says how the agent runs, for ``agentd docker-opts`` (a Docker unit's
``ExecStartPre=`` does not see the agent's environment, e.g. ``AGENTD_CNI_WRITE_CONFLIST``
set by a drop-in)::

    AGENTD_WRITE_CONFLIST=false     [cni] write_conflist: the agent writes agentd-cni's conflist
    AGENTD_MASQUERADE=true          [network] ip_masq: the agent masquerades what leaves the pod network

(``agentd-cni`` skips keys it does not know.)"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from ipaddress import IPv4Network, IPv6Network, ip_network
from pathlib import Path
from typing import Any

from agentd.cni import endpoints as pod_endpoints
from agentd.cni import netconf as cni_config
from agentd.cni.docker_opts import (
    MASQUERADE_KEY,
    WRITE_CONFLIST_KEY,
    is_agentds_conflist,
)
from agentd.config.settings import Config
from agentd.datastore.store import ClusterConfig, NodeRecord, SubnetLease
from agentd.kernel.netinfo import Underlay

log = logging.getLogger("agentd")

KEPT_FILE = "subnets.json"  # in [agent] state_dir: the subnets this node holds, or last held

Network = IPv4Network | IPv6Network


def previous_subnets(cfg: Config) -> dict[int, Network]:
    """The subnets this node had, by IP version ({}: none known): the subnet file's, which a
    previous run wrote (the one pods' addresses come from); without one (a reboot emptied
    /run, or the subnet was lost and the file removed), the record in ``[agent] state_dir``."""
    try:
        sf = cni_config.read_subnet_file(cfg.cni.subnet_file)
    except FileNotFoundError:
        return kept_subnets(cfg)
    except cni_config.SubnetFileError as err:
        log.warning("ignoring the subnet file: %s", err)
        return kept_subnets(cfg)
    return {s.version: s for s in (sf.subnet, sf.subnet_v6) if s is not None}


def previous_mtu(cfg: Config) -> int | None:
    """The pod MTU the subnet file of a previous run gives (``AGENTD_MTU``: docker0's ``--mtu``,
    agentd-cni's veths), or None (no file: a reboot emptied /run; or one that cannot be read).
    A start whose pod MTU differs (another backend, the underlay's MTU changed) warns: Docker
    keeps the old one until it is restarted, pods until they are created again."""
    try:
        return cni_config.read_subnet_file(cfg.cni.subnet_file).mtu
    except (OSError, cni_config.SubnetFileError):  # previous_subnets says why
        return None


def kept_subnets_path(cfg: Config) -> Path:
    return Path(cfg.agent.state_dir) / KEPT_FILE


def kept_subnets(cfg: Config) -> dict[int, Network]:
    """The subnets ``[agent] state_dir``/subnets.json names, by IP version ({}: no file, or
    one that cannot be read, which is logged)."""
    path = kept_subnets_path(cfg)
    try:
        listed = json.loads(path.read_text(encoding="utf-8"))["subnets"]
        if not isinstance(listed, list):
            raise TypeError("its subnets are not a list")
        nets = [ip_network(s) for s in listed]
        if len({n.version for n in nets}) != len(nets):
            raise ValueError("more than one subnet of an IP version")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, LookupError, TypeError) as err:
        log.warning("ignoring %s: %s", path, getattr(err, "strerror", None) or err)
        return {}
    return {n.version: n for n in nets}


def keep_subnets(cfg: Config, subnets: Mapping[int, Network]) -> None:
    """Record ``subnets`` in ``[agent] state_dir``/subnets.json (a new file renamed over the
    old one: a crash or a reboot leaves the old record or the new, whole); OSError when it
    cannot be written."""
    text = json.dumps({"subnets": [str(s) for _v, s in sorted(subnets.items())]}) + "\n"
    cni_config.atomic_write(str(kept_subnets_path(cfg)), text, mode=0o644)


def forget_subnets(cfg: Config) -> bool:
    """``agentd leave``: remove the record (a node that left must not take its old subnet back
    at its next start); False where there was none."""
    path = kept_subnets_path(cfg)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    log.info("removed %s", path)
    return True


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
    running = (f"{WRITE_CONFLIST_KEY}={str(cfg.cni.write_conflist).lower()}\n"
               f"{MASQUERADE_KEY}={str(cfg.network.ip_masq).lower()}\n")
    make_plugin_dirs(cfg)  # before the subnet file: no ADD gets far without it
    cni_config.atomic_write(str(cfg.cni.subnet_file), cni_config.render_subnet_file(sf) + running, mode=0o644)
    try:
        keep_subnets(cfg, {v: lease.subnet for v, lease in leases.items()})
    except OSError as err:
        log.warning("cannot write %s (%s): after a reboot this node may get another subnet",
                    kept_subnets_path(cfg), err.strerror or err)
    if cfg.cni.write_conflist:
        cni_config.write_conflist(cfg.cni.conf_dir, mtu=mtu, **_conflist_settings(cfg))
        missing = missing_runtime_plugins(cfg.cni.bin_dir)
        if missing:
            log.warning("%s", missing)


def runtime_plugins() -> tuple[str, ...]:
    """The plugin types the conflist names (agentd-cni, then the chained portmap and bandwidth):
    the container runtime runs each from its own CNI bin directory (containerd's ``bin_dir``,
    default /opt/cni/bin) -- the conflist's ``binDir`` only tells agentd-cni where its
    delegates are."""
    return tuple(p["type"] for p in cni_config.conflist(subnet_file="/", data_dir="/")["plugins"])


def _executable(path: str) -> bool:
    try:
        return os.path.isfile(path) and os.access(path, os.X_OK)
    except (OSError, ValueError):
        return False


def missing_runtime_plugins(bin_dir: Sequence[str | os.PathLike[str]]) -> str | None:
    """One line saying which of :func:`runtime_plugins` each directory of ``[cni] bin_dir``
    lacks, when none holds them all (None: one does, or there is no directory to look in).
    The runtime's directory is not known to the agent; an install that put them all in one
    directory (docs/operations.md, Install) and named it in ``[cni] bin_dir`` is not warned
    about.  Debian's containernetworking-plugins puts portmap and bandwidth in /usr/lib/cni,
    an install of agentd-cni in /opt/cni/bin: the runtime then finds one or the other, and
    every pod's ADD fails ("failed to find plugin")."""
    wanted = runtime_plugins()
    lacking = {d: [p for p in wanted if not _executable(os.path.join(d, p))]
               for d in dict.fromkeys(os.fspath(d) for d in bin_dir)}
    if not lacking or not all(lacking.values()):
        return None
    where = "; ".join(f"{d} lacks {', '.join(names)}" for d, names in lacking.items())
    return (f"no directory of [cni] bin_dir holds all of the conflist's plugins {', '.join(wanted)} ({where}): the "
            f"container runtime runs each from its own CNI bin directory (containerd's bin_dir, by default "
            f"/opt/cni/bin) and fails every pod's ADD with one missing there; put them all in that directory and "
            f"name it in [cni] bin_dir (docs/operations.md, Install)")


def make_plugin_dirs(cfg: Config) -> None:
    """``[cni] data_dir``, its endpoints/ and endpoints/.programmed (agentd.cni.endpoints), the
    agent's own and 0755, if they are not there: made by agentd-cni first, under the container
    runtime, they would be root's, and an agent of its own user (docs/operations.md) could
    not acknowledge a pod or hold the lock in them.  Nothing root's plugin acts on is the
    agent's: it keeps its state files in data_dir/.state, root's, 0700, which it makes itself
    (agentd.cni.plugin.STATE_SUBDIR).  One that cannot be made (or an endpoints/ that is a
    symlink) is logged (pods are still attached).  Called before the subnet file is written."""
    try:
        pod_endpoints.make_dirs(cfg.cni.data_dir)
    except OSError as err:
        log.error("cannot make %s (%s): the agent may not see the pods agentd-cni attaches, or not tell it they "
                  "are programmed for network policy (their ADD waits policyTimeout); make %s the agent's "
                  "user's (a directory, %s 0755; not %s, which only root may write)", err.filename or cfg.cni.data_dir,
                  err.strerror or err, pod_endpoints.endpoints_dir(cfg.cni.data_dir), cfg.cni.data_dir,
                  f"{cfg.cni.data_dir}/.state")


def _conflist_settings(cfg: Config) -> dict[str, Any]:
    return {"subnet_file": str(cfg.cni.subnet_file), "data_dir": str(cfg.cni.data_dir),
            "ipam_data_dir": str(cfg.cni.ipam_data_dir), "bin_dir": cfg.cni.bin_dir}


def remove_conflist(cfg: Config) -> bool:
    """``agentd leave`` (``[cni] write_conflist``): remove ``<[cni] conf_dir>/10-agentd.conflist``
    -- left, the runtime would go on choosing agentd's network (its name sorts first) and every
    new pod's ADD fail with "agent not running" instead of falling through to another network.
    Only a file agentd writes goes (:func:`is_agentds_conflist`: whatever version or settings
    wrote it -- an older agent's has fewer plugins, one of other ``[cni]`` paths other keys);
    an operator's own of that name stays (:class:`ValueError` says so).  False where there is
    none; an OSError says why it stays."""
    path = Path(cfg.cni.conf_dir) / cni_config.CONFLIST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    except UnicodeDecodeError:
        text = ""
    try:
        found = json.loads(text)
    except ValueError:
        found = None
    if not is_agentds_conflist(found):
        raise ValueError(f"{path} is not one agentd writes ([cni] write_conflist: its first plugin "
                         f"{cni_config.PLUGIN_TYPE} with subnetFile and dataDir): left as it is")
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
