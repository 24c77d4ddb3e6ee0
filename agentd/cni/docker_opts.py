"""``agentd docker-opts``: a Docker daemon's bridge on this node's pod subnet, from the subnet file.

What flannel's ``mk-docker-opts.sh`` does with ``/run/flannel/subnet.env``: a host whose
containers are started by a plain Docker daemon (no CNI) gives that daemon's ``docker0`` the
node's pod subnet, so the containers get cluster addresses that every other node routes to::

    agentd docker-opts                       DOCKER_OPTS="--bip=10.244.3.1/24 --ip-masq=false --mtu=1450"
    agentd docker-opts --format args         --bip=10.244.3.1/24 --ip-masq=false --mtu=1450
    agentd docker-opts --format json         {"bip": "10.244.3.1/24", "ip-masq": false, "mtu": 1450}
                                             (merge into /etc/docker/daemon.json)
    agentd docker-opts --output /run/docker_opts.env   (written atomically; EnvironmentFile= of docker.service)
    agentd docker-opts -i                    DOCKER_OPT_BIP="--bip=10.244.3.1/24"  (mk-docker-opts.sh -i:
                                             DOCKER_OPT_IPMASQ="--ip-masq=false"    a variable per option)
                                             DOCKER_OPT_MTU="--mtu=1450"

* ``--bip``: the subnet file's AGENTD_SUBNET, the bridge's address and the subnet's length
  (none on an IPv6-only node: docker0 keeps Docker's own IPv4 range there).
* ``--ipv6 --fixed-cidr-v6``: AGENTD_IPV6_SUBNET, where the node has one (dual-stack and
  IPv6-only clusters): containers get IPv6 addresses of the node's subnet.
* ``--mtu``: AGENTD_MTU, the pod MTU (the underlay's minus the backend's overhead).
* ``--ip-masq``: AGENTD_IPMASQ -- whether the bridge should masquerade.  agentd writes false:
  a bridge's masquerading covers everything that leaves the node's subnet, containers on other
  nodes included; with ``[network] ip_masq = true`` the agent masquerades only what leaves the
  pod network itself (agentd.nft.masquerade).  With ``ip_masq`` off nothing does, and the
  command warns (the subnet file's ``AGENTD_MASQUERADE=false``; from an older agent's file
  without it, the configuration's ``ip_masq`` where the command read it).
* ``--allow-direct-routing`` (only with the flag of that name): Docker 28 drops packets from
  outside the host addressed straight to a container's address -- every connection a
  container on another node opens to one here -- unless this daemon option (Docker 28.2+;
  ``"allow-direct-routing": true`` in daemon.json) is set.  Older daemons (20.10) refuse the
  unknown option, so it is never given unasked.

Docker's own address pools: the networks Docker makes itself (``docker network create``,
docker-compose) take subnets of 172.17.0.0/16-172.31.0.0/16 and 192.168.0.0/16; a cluster
network that overlaps them (192.168.0.0/16, Calico's default) is warned of in one line, and
``--format json`` adds ``default-address-pools``: Docker's pools without the cluster network.

One or the other: Docker's bridge and agentd-cni's ``cni0`` would both take the node's whole
subnet, both hold its gateway and both hand out its addresses.  It refuses, in one line, a
node whose agent writes agentd-cni's conflist (the subnet file's ``AGENTD_WRITE_CONFLIST=true``,
with ``--subnet-file`` too; ``[cni] write_conflist``, on by default, for an older agent's file);
where it reads the configuration (no ``--subnet-file``), also one whose ``[cni] conf_dir``
still holds agentd's conflist (a CNI node turned Docker host: nothing removes the file an
earlier run wrote) or that has CNI pods attached (endpoint files in ``[cni] data_dir``).

What the agent runs with, not what this command's configuration says: the subnet file's
``AGENTD_WRITE_CONFLIST`` and ``AGENTD_MASQUERADE`` (agentd.daemon.node_files) give the
agent's ``[cni] write_conflist`` and ``[network] ip_masq`` -- set in its unit's environment
(``AGENTD_CNI_WRITE_CONFLIST=false``), they are not in this command's, run by docker.service.
The configuration's are taken only from a subnet file without them (an older agent's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from ipaddress import IPv4Network
from typing import Any

from agentd.cni.endpoints import SUFFIX, endpoints_dir
from agentd.cni.netconf import (
    CONFLIST_NAME,
    PLUGIN_TYPE,
    SubnetFile,
    SubnetFileError,
    atomic_write,
    parse_subnet_file,
    read_subnet_text,
)

FORMATS = ("env", "args", "json")
# The subnet file's lines saying how the agent runs (agentd.daemon.node_files writes them).
WRITE_CONFLIST_KEY = "AGENTD_WRITE_CONFLIST"  # [cni] write_conflist
MASQUERADE_KEY = "AGENTD_MASQUERADE"  # [network] ip_masq


def docker_options(sf: SubnetFile, allow_direct_routing: bool = False) -> dict[str, Any]:
    """The daemon's options, as daemon.json names them: ``bip`` for the node's IPv4 subnet,
    ``ipv6`` and ``fixed-cidr-v6`` for its IPv6 one (dual-stack and IPv6-only nodes; Docker
    gives the bridge the subnet's first address, as agentd's CNI does); with
    ``allow_direct_routing``, Docker 28.2's ``allow-direct-routing``."""
    out: dict[str, Any] = {}
    if sf.subnet is not None:
        out["bip"] = f"{sf.gateway}/{sf.subnet.prefixlen}"
    if sf.subnet_v6 is not None:
        out["ipv6"] = True
        out["fixed-cidr-v6"] = str(sf.subnet_v6)
    out.update({"ip-masq": sf.ipmasq, "mtu": sf.mtu})
    if allow_direct_routing:
        out["allow-direct-routing"] = True
    return out


# Docker's own default address pools (libnetwork's ipamutils, daemon.json's
# "default-address-pools" when not given): what `docker network create`, docker-compose and
# docker0 without --bip take their subnets from.
DOCKER_DEFAULT_POOLS: tuple[tuple[IPv4Network, int], ...] = (
    *((IPv4Network(f"172.{n}.0.0/16"), 16) for n in range(17, 32)),
    (IPv4Network("192.168.0.0/16"), 20),
)


def pools_outside(network: IPv4Network) -> tuple[list[dict[str, Any]], bool]:
    """Docker's default address pools without ``network`` (the cluster's), as daemon.json's
    ``default-address-pools`` names them, and whether any overlapped it.  A pool the network
    lies inside keeps the pieces around it that still hold whole networks of the pool's size
    (192.168.0.0/16's /20s around a 192.168.64.0/18; none of a /16 pool's)."""
    pools: list[dict[str, Any]] = []
    overlap = False
    for base, size in DOCKER_DEFAULT_POOLS:
        if not base.overlaps(network):
            pools.append({"base": str(base), "size": size})
            continue
        overlap = True
        if network.supernet_of(base):
            continue  # all of it is the cluster's
        pools += [{"base": str(piece), "size": size} for piece in sorted(base.address_exclude(network))
                  if piece.prefixlen <= size]  # fmt: skip
    return pools, overlap


def pools_warning(network: IPv4Network, pools: list[dict[str, Any]], fmt: str) -> str:
    said = ("--format json adds them as default-address-pools" if fmt == "json" and pools
            else "give dockerd default-address-pools outside it (agentd docker-opts --format json prints them)"
            if pools else "give dockerd default-address-pools outside it")
    return (f"agentd docker-opts: warning: the cluster network {network} overlaps Docker's default address pools "
            f"(172.17.0.0/16-172.31.0.0/16, 192.168.0.0/16 in /20s): a network Docker makes (docker network "
            f"create, docker-compose) could take other nodes' pod addresses; {said} (docs/docker.md)")


def render(options: dict[str, Any], fmt: str, key: str = "DOCKER_OPTS") -> str:
    if fmt == "json":
        return json.dumps(options, indent=2) + "\n"
    args = " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items())
    return f'{key}="{args}"\n' if fmt == "env" else args + "\n"


# --individual: flannel's mk-docker-opts.sh -i names (DOCKER_OPT_IPMASQ, not _IP_MASQ).
INDIVIDUAL_PREFIX = "DOCKER_OPT_"
INDIVIDUAL_NAMES = {"ip-masq": "IPMASQ"}


def render_individual(options: dict[str, Any]) -> str:
    """Each option a variable of its own, as ``mk-docker-opts.sh -i`` writes them::

        DOCKER_OPT_BIP="--bip=10.244.3.1/24"
        DOCKER_OPT_IPMASQ="--ip-masq=false"
        DOCKER_OPT_MTU="--mtu=1450"

    (``ipv6``, ``fixed-cidr-v6`` and ``allow-direct-routing``, where given:
    ``DOCKER_OPT_IPV6``, ``DOCKER_OPT_FIXED_CIDR_V6``, ``DOCKER_OPT_ALLOW_DIRECT_ROUTING``)."""
    lines = []
    for k, v in options.items():
        name = INDIVIDUAL_PREFIX + INDIVIDUAL_NAMES.get(k, k.upper().replace("-", "_"))
        lines.append(f'{name}="--{k}={str(v).lower() if isinstance(v, bool) else v}"\n')
    return "".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--subnet-file",
        help="the agent's subnet file (default: [cni] subnet_file of the configuration: --config, "
             "$AGENTD_CONFIG or the default file, and AGENTD_CNI_SUBNET_FILE)",
    )
    p.add_argument("--format", choices=FORMATS, default="env",
                   help="env: KEY=\"--bip=...\" (default); args: the options alone; json: a daemon.json fragment")
    p.add_argument("--key", default="DOCKER_OPTS", help="the variable's name with --format env")
    p.add_argument("--individual", "-i", action="store_true",
                   help="with --format env (--key unused): each option a variable of its own (DOCKER_OPT_BIP, DOCKER_OPT_MTU, "
                        "DOCKER_OPT_IPMASQ, ...), as flannel's mk-docker-opts.sh -i writes them")  # fmt: skip
    p.add_argument("--output", "-o", help="write to this file (atomically) instead of standard output")
    p.add_argument("--allow-direct-routing", action="store_true",
                   help="add Docker 28.2's allow-direct-routing (needed from Docker 28 on for containers on other "
                        "nodes to reach this node's; Docker before 28.2 refuses it)")  # fmt: skip


def agent_settings(text: str, source: str) -> dict[str, bool]:
    """What the subnet file says of how the agent runs: :data:`WRITE_CONFLIST_KEY` and
    :data:`MASQUERADE_KEY`, those it has; a value other than true or false is a
    :class:`SubnetFileError`."""
    found: dict[str, bool] = {}
    for raw in text.splitlines():
        key, sep, value = raw.strip().partition("=")
        if sep and key.strip() in (WRITE_CONFLIST_KEY, MASQUERADE_KEY):
            if value.strip() not in ("true", "false"):
                raise SubnetFileError(f"{source}: {key.strip()} {value.strip()[:20]!r} is not true or false")
            found[key.strip()] = value.strip() == "true"
    return found


def is_agentds_conflist(doc: Any) -> bool:
    """Whether a conflist is one agentd wrote: its first plugin is ``agentd-cni`` with the keys
    every version of it has written (``subnetFile``, ``dataDir``).  Not compared with what this
    agent would write: one an older agentd wrote (before ``binDir``, before the bandwidth
    plugin) or one written under other ``[cni]`` paths is agentd's network all the same."""
    try:
        first = doc["plugins"][0]
        return (first["type"] == PLUGIN_TYPE and isinstance(first["subnetFile"], str)
                and isinstance(first["dataDir"], str))
    except (LookupError, TypeError):
        return False


def agentds_conflist_in(conf_dir: str | os.PathLike[str]) -> str | None:
    """``<conf_dir>/10-agentd.conflist`` where it is there and agentd's (:func:`is_agentds_conflist`),
    else None."""
    path = os.path.join(conf_dir, CONFLIST_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.loads(f.read(1 << 20))
    except (OSError, ValueError):  # none, not ours to read, not JSON (UnicodeDecodeError too)
        return None
    return path if is_agentds_conflist(doc) else None


def cni_in_use(write_conflist: bool, data_dir: str | os.PathLike[str] | None, source: str = "",
               conf_dir: str | os.PathLike[str] | None = None) -> str | None:
    """Why agentd-cni hands out this node's subnet already -- the agent writes its conflist
    (``source``: where that is said; the configuration by default), agentd's conflist is
    still in ``conf_dir`` (a CNI node turned Docker host: nothing removes the file an earlier
    run wrote, and container runtimes go on running agentd-cni with it), or pods are attached
    (their endpoint files in ``data_dir``) --, or None."""
    if write_conflist:
        return f"the agent writes agentd-cni's conflist ({source or '[cni] write_conflist = true'})"
    if conf_dir is not None and (conflist := agentds_conflist_in(conf_dir)) is not None:
        return (f"agentd-cni's conflist {conflist} is still there (container runtimes run agentd-cni with it; "
                f"remove it once no CNI pod is left)")
    if data_dir is None:
        return None
    directory = endpoints_dir(data_dir)
    try:
        pods = [n for n in os.listdir(directory) if n.endswith(SUFFIX) and not n.startswith(".")]
    except OSError:  # none yet, or not ours to read
        return None
    return f"{len(pods)} CNI pod(s) are attached ({directory})" if pods else None


SHARED = ("agentd docker-opts: {why}: Docker and agentd-cni cannot share a node's subnet (two bridges would hold "
          "its gateway and both would hand out its addresses); on a Docker host set [cni] write_conflist = false "
          "and run no CNI pods, or leave Docker off the subnet (docs/docker.md)")

IP_MASQ_OFF = ("agentd docker-opts: warning: [network] ip_masq is off and Docker's masquerading is switched off "
               "(--ip-masq=false): containers cannot reach addresses outside the cluster; set ip_masq = true")


def run(args: argparse.Namespace, agent_masquerades: bool | None = None, cni: Any = None) -> int:
    """``args.subnet_file``: the flag's, or the configuration's (the CLI puts it there, with
    ``agent_masquerades``, its ``[network] ip_masq``: False warns that nothing masquerades,
    and ``cni``, its ``[cni]`` section: a node of agentd-cni's is refused).  Where the subnet
    file says how the agent runs (:func:`agent_settings`), that is taken instead of the
    configuration's ``write_conflist`` and ``ip_masq``."""
    # The arguments first: a bad one is named (exit 2) whatever the node's state, before the
    # subnet file is read (a unit's ExecStartPre runs before the agent has written it).
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", args.key):  # a shell's name (str.isidentifier took é)
        print(f"agentd docker-opts: --key {args.key!r} is not a variable name (letters A-Z, a-z, digits and _)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.individual and args.format != "env":
        print(f"agentd docker-opts: --individual writes variables: it goes with --format env, not {args.format}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.output is not None and not args.output.strip():
        print("agentd docker-opts: --output: empty path (leave it out for standard output)", file=sys.stderr)
        return 2
    path = args.subnet_file
    try:
        text: str | None = read_subnet_text(path)
        said = agent_settings(text, path)
    except FileNotFoundError:
        text, said = None, {}
    except (OSError, UnicodeDecodeError) as err:
        print(f"agentd docker-opts: cannot read subnet file {path}: {getattr(err, 'strerror', None) or err}",
              file=sys.stderr)
        return 1
    except SubnetFileError as err:
        print(f"agentd docker-opts: {err}", file=sys.stderr)
        return 1
    # The subnet file's word on how the agent runs counts with --subnet-file too (no configuration
    # read: nothing else says it).
    conflist = said.get(WRITE_CONFLIST_KEY, cni.write_conflist if cni is not None else False)
    source = f"{WRITE_CONFLIST_KEY}=true in {path}" if WRITE_CONFLIST_KEY in said else ""
    if cni is not None:
        why = cni_in_use(conflist, cni.data_dir, source, conf_dir=cni.conf_dir)
    else:
        why = cni_in_use(conflist, None, source)
    if why is not None:
        print(SHARED.format(why=why), file=sys.stderr)
        return 1
    agent_masquerades = said.get(MASQUERADE_KEY, agent_masquerades)
    if text is None:
        print(f"agentd docker-opts: no subnet file at {path} (is agentd running and holding a subnet?)",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        sf = parse_subnet_file(text, source=path)
    except SubnetFileError as err:
        print(f"agentd docker-opts: {err}", file=sys.stderr)
        return 1
    if agent_masquerades is False:
        print(IP_MASQ_OFF, file=sys.stderr)
    options = docker_options(sf, args.allow_direct_routing)
    if sf.network is not None:
        pools, overlap = pools_outside(sf.network)
        if overlap:
            print(pools_warning(sf.network, pools, args.format), file=sys.stderr)
            if args.format == "json" and pools:
                options["default-address-pools"] = pools
    text = render_individual(options) if args.individual else render(options, args.format, args.key)
    if args.output is not None:
        try:
            atomic_write(args.output, text, mode=0o644)
        except OSError as err:
            print(f"agentd docker-opts: cannot write {args.output}: {err.strerror or err}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0
