"""Lab nodes as Docker hosts: ``agentd lab up --docker``, flannel's Docker story on agentd's network.

Before CNI, flannel gave each host's Docker daemon its subnet: ``mk-docker-opts.sh`` turned
``/run/flannel/subnet.env`` into ``--bip``/``--mtu``/``--ip-masq`` for dockerd, so ``docker0``
held the host's pod subnet and containers started with plain ``docker run`` reached containers
on every other host.  With ``--docker`` each lab node does the same with agentd: once its agent
holds a subnet, ``agentd docker-opts`` (agentd.cni.docker_opts) reads the node's subnet file and
the node starts a dockerd of its own in its network namespace (agentd.lab.dockerd) with those
options; the lab's pods are then containers (a 2 MB busybox image, agentd.lab.images) started
with ``docker run`` on ``docker0`` -- no CNI.  Each container's network namespace is named
``ad-<lab>-<node>-podJ`` (``ip netns attach``), so the reachability matrix, ``lab exec`` and
``lab down`` treat them like any pod.  The nodes run with ``[cni] write_conflist = false`` (the
subnet is dockerd's, not agentd-cni's) and ``[network] ip_masq = true``:
containers reaching outside the pod network are masqueraded by the agent, container-to-container
traffic never (Docker's own masquerading is off: ``--ip-masq=false``).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentd.cni.docker_opts import docker_options
from agentd.cni.netconf import read_subnet_file
from agentd.lab.dockerd import DATA_ROOT, RUN_ROOT, DockerEngine
from agentd.lab.errors import LabError
from agentd.lab.images import busybox_image
from agentd.lab.netns import Netns, NetnsError


def engine_for(lab_name: str, node: Any) -> DockerEngine:
    """Node ``node``'s engine (not started): in the node's namespace, with paths of its own."""
    name = f"lab-{lab_name}-{node.name}"
    return DockerEngine(name, netns=node.ns, run_root=RUN_ROOT / name, data_root=DATA_ROOT / name, shared_netns=True)


def daemon_args(subnet_file: Path) -> list[str]:
    """dockerd's options from the node's subnet file, exactly as ``agentd docker-opts --format args`` prints them."""
    opts = docker_options(read_subnet_file(subnet_file))
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in opts.items()]


class DockerHosts:
    """The lab's per-node engines and the containers standing in for its pods."""

    def __init__(self, lab: Any) -> None:
        self.lab = lab
        self.engines = {n.name: engine_for(lab.spec.name, n) for n in lab.nodes}

    async def start(self, timeout: float) -> None:
        """Every node's dockerd on its subnet (``agentd docker-opts``), with the busybox image."""

        def start(node: Any) -> None:
            engine = self.engines[node.name]
            engine.daemon_args = daemon_args(node.dir / "subnet.env")
            engine.start(timeout)
            busybox_image(engine)

        await asyncio.gather(*(asyncio.to_thread(start, n) for n in self.lab.nodes))

    async def run_container(self, pod: Any) -> list[str]:
        """``docker run`` on the pod's node, the container's namespace named as the pod's; its
        addresses on the node's subnets (IPv4 first; the IPv6 one where the lab has IPv6: Docker
        gives it from ``--fixed-cidr-v6``, the node's IPv6 subnet)."""
        engine = self.engines[pod.node.name]

        def run() -> str:
            engine.docker("rm", "-f", pod.name, check=False)
            engine.docker("run", "-d", "--name", pod.name, "--hostname", pod.name, "--restart", "no",
                          busybox_image(engine), "sleep", "1000000")  # fmt: skip
            info = engine.inspect(pod.name)[0]
            if pod.ns.exists():
                pod.ns.delete()
            try:  # recorded as a made namespace is: a killed test run's is swept by the next
                Netns.attach(pod.ns.name, info["State"]["Pid"])
            except NetnsError as err:
                raise LabError(f"{pod.name}: ip netns attach failed: {err}") from None
            settings = info["NetworkSettings"]
            family = self.lab.spec.ip_family
            addresses = [a for a, wanted in ((settings.get("IPAddress"), family != "ipv6"),
                                             (settings.get("GlobalIPv6Address"), family != "ipv4")) if wanted and a]
            if len(addresses) != (2 if family == "dual" else 1):
                raise LabError(f"{pod.name}: docker gave the container {addresses or 'no address'} "
                               f"(the lab is {family})")
            return addresses

        return await asyncio.to_thread(run)

    def stop(self) -> list[str]:
        """Every node's containers and dockerd (before the node namespaces go): each engine is
        tried, whatever another's stop raised (one stuck dockerd must not keep the lab's
        teardown -- etcd, namespaces, bpffs, files -- from going on); what failed is said on
        standard error and returned."""
        return _stop_each(self.engines.values())


def _stop_each(engines: Iterable[DockerEngine]) -> list[str]:
    failed = []
    for engine in engines:
        try:
            engine.stop()
        except Exception as err:  # noqa: BLE001 -- teardown: every engine is tried, each failure said
            failed.append(f"{engine.name}: {err}")
            print(f"lab: warning: Docker engine {engine.name} not stopped cleanly: {err}", file=sys.stderr)
    return failed


def stop_leftover_engines(lab_name: str) -> list[str]:
    """Engines of a lab whose state file is gone: found by their run directories.  Each is
    tried (a failure is said on standard error); the names of those stopped."""
    engines = []
    for run_root in sorted(RUN_ROOT.glob(f"lab-{lab_name}-node*")):
        name = run_root.name
        engines.append(DockerEngine(name, netns=Netns(f"ad-{lab_name}-{name.rsplit('-', 1)[1]}"), run_root=run_root,
                                    data_root=DATA_ROOT / name, shared_netns=True))  # fmt: skip
    failed = {f.split(":", 1)[0] for f in _stop_each(engines)}
    return [e.name for e in engines if e.name not in failed]
