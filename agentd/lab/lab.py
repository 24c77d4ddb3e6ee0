"""``agentd lab``: a multi-node cluster on this machine, entirely inside network namespaces.

Topology for ``--name NAME --nodes N --pods K --subnets S --etcd E``::

    ad-NAME-ul        the underlay: one bridge per L2 segment (br0 .. brS-1)
    ad-NAME-rt        a router joining the segments (only when S > 1), 172.30.s.1 on each
    ad-NAME-etcdM     etcd 3.4 member M (1..E) on 172.30.0.(1+M):2379 (segment 0); E members
                      form one cluster, each its own process, data directory and namespace
                      (veth etcdM on br0 in the underlay), so a test can kill one member or
                      cut its link
    ad-NAME-nodeI     node I on segment (I-1) % S, eth0 = 172.30.s.(10+I), running `agentd run`
                      with every etcd member in [etcd] endpoints
    ad-NAME-nodeI-podJ  pod J of node I, attached through agentd-cni + bridge/host-local

``--ip-family dual`` gives every pod an IPv4 and an IPv6 address (fd00:10:244::/48) and every
underlay interface an IPv6 address beside its IPv4 one (node I: fd00:172:30:s::(10+I));
``--ipv4-underlay`` keeps the underlay IPv4-only (IPv6 pods then ride the IPv4 underlay: VXLAN,
or host-gw through the nodes' link-local addresses).  ``--ip-family ipv6``: IPv6 only,
etcd included (fd00:172:30:0::(1+M)).

``lab.etcd`` is the :class:`~agentd.lab.etcd.EtcdCluster`: ``await lab.etcd.leader()``,
``wait_leader()``, ``roles()``, ``lab.etcd.members[i].kill()`` / ``stop()`` / ``start()``;
``lab.network.cut(member)`` / ``lab.network.mend(member)`` take a member's link down and up (a
partition: no resets, packets just vanish); ``await lab.add_node()`` joins another node.
``lab.ready`` waits for each stage (``agents_started``, ``established``, ``routes``,
``reachable``; ``reachability()`` is the pod-to-pod matrix).

The parts: agentd.lab.underlay (the wires: bridges, router, links, neighbour entries),
agentd.lab.runtime (CNI run as a container runtime runs it), agentd.lab.readiness (the
waits); this module holds the nodes and pods, starts and stops them, and saves the lab's state.

Nothing is created in the root network namespace: every veth pair is made with both ends
already inside lab namespaces.  ``down`` kills everything in the lab's namespaces and
removes them; it is idempotent.  The same class backs the pytest fixtures
(agentd.lab.fixtures: ``lab_factory``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentd.lab import bpffs
from agentd.lab.errors import LabError
from agentd.lab.etcd import EtcdCluster
from agentd.lab.netns import Netns, NetnsError, delete_matching, list_names
from agentd.lab.readiness import Readiness, subnets_of
from agentd.lab.runtime import CNI_PLUGIN_DIR, binary, cni, write_resolv_conf
from agentd.lab.speaker_proc import render_toml
from agentd.lab.underlay import UNDERLAY_PREFIX, Underlay, quiet_dad, v6_address
from agentd.lab.wait import auntil
from agentd.resources.validation import Invalid, dns1123_label, dns1123_subdomain

LAB_ROOT = Path(os.environ.get("AGENTD_LAB_ROOT", "/run/agentd-lab"))
ETCD_ADDRESS = f"{UNDERLAY_PREFIX}.0.2"  # member 1; member M is at .(1+M)
ETCD_PORT = 2379
MAX_ETCD_MEMBERS = 7
# Node I is 172.30.s.(10+I) on its segment and holds one /24 of 10.244.0.0/16: 200 leaves room
# for the etcd members (.2-.8), the router (.1) and every node's subnet.
MAX_NODES = 200
STATIC_NEIGHBORS_ABOVE = 16
START_WAVE = 10  # agents started at once; the next wave starts once these hold a subnet
CLUSTER_ID = f"{UNDERLAY_PREFIX}.255.1"  # shared by every route reflector
API_URL = "http://127.0.0.1:9099"
CLIENT_ADDRESS = f"{UNDERLAY_PREFIX}.0.250"  # the underlay namespace's own address (labs with ingress)
CLIENT_ADDRESS_V6 = v6_address(0, 250)  # its IPv6 twin, on an IPv6 underlay
ASN = 64512


@dataclass
class LabSpec:
    name: str
    nodes: int = 3
    pods: int = 2
    bgp: str = "mesh"
    reflectors: int = 2
    backend: str = "host-gw"
    datapath: str = "auto"  # [network] datapath of every node (udp, ipip)
    encap: str = "always"
    subnets: int = 1
    etcd: int = 1  # etcd members (one cluster)
    hold_time: int = 9
    lease_ttl: int = 15
    log_level: str = "info"
    # Permanent ARP entries on the underlay instead of ARP (None: for labs of more than
    # STATIC_NEIGHBORS_ABOVE nodes).  The kernel has ONE ARP table for every namespace, full at
    # net.ipv4.neigh.default.gc_thresh3 entries (1024 by default) machine-wide, and a mesh of N
    # nodes needs N*(N-1): past that, new neighbours fail with ENOBUFS and BGP sessions sit in
    # Connect.  Permanent entries are exempt from that limit (they are never garbage-collected).
    static_neighbors: bool | None = None
    # The Ingress controller on every node ([ingress] enabled), and a client address in the
    # underlay namespace (CLIENT_ADDRESS) from which the nodes' ingress ports are reached.
    ingress: bool = False
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-node config overrides
    # Docker hosts (agentd.lab.docker_hosts): a dockerd per node on its subnet, the pods are
    # containers on docker0, and the agents masquerade what leaves the pod network.
    docker: bool = False
    ip_family: str = "ipv4"  # [network] ip_family of every node: the pods' families
    ipv4_underlay: bool = False  # dual: keep the underlay IPv4-only (no IPv6 addresses on it)

    @property
    def underlay_v4(self) -> bool:
        return self.ip_family != "ipv6"

    @property
    def underlay_v6(self) -> bool:
        return self.ip_family == "ipv6" or (self.ip_family == "dual" and not self.ipv4_underlay)


class LabNode:
    def __init__(self, lab: Lab, index: int) -> None:
        spec = lab.spec
        self.lab = lab
        self.index = index
        self.name = f"node{index}"
        self.segment = (index - 1) % spec.subnets
        self.address: str | None = f"{UNDERLAY_PREFIX}.{self.segment}.{10 + index}" if spec.underlay_v4 else None
        self.address_v6: str | None = v6_address(self.segment, 10 + index) if spec.underlay_v6 else None
        self.ns = Netns(f"ad-{spec.name}-{self.name}")
        self.dir = lab.dir / self.name
        self.reflector = spec.bgp == "route-reflector" and index <= spec.reflectors
        self.proc: subprocess.Popen | None = None
        self.backend = spec.backend

    def __repr__(self) -> str:
        return f"<LabNode {self.name} {self.primary}>"

    @property
    def primary(self) -> str:
        """Its underlay address its sessions and tunnels use (IPv6 in an IPv6-only lab)."""
        return self.address or self.address_v6  # type: ignore[return-value]

    @property
    def config_path(self) -> Path:
        return self.dir / "agentd.toml"

    @property
    def log_path(self) -> Path:
        return self.dir / "agentd.log"

    @property
    def token_path(self) -> Path:
        """The node's API token (``[api] token_file``): POST /leave needs it."""
        return self.dir / "api.token"

    def config(self) -> dict[str, dict[str, Any]]:
        spec = self.lab.spec
        cfg: dict[str, dict[str, Any]] = {
            "node": {
                "name": self.name,
                "address": self.address,
                "address_v6": self.address_v6,
                "asn": ASN,
                "route_reflector": self.reflector,
                "cluster_id": CLUSTER_ID if self.reflector else None,
            },
            "network": {"cidr": "10.244.0.0/16", "backend": self.backend, "encap": spec.encap,
                        "datapath": spec.datapath, "ip_masq": True if spec.docker else None,
                        "ip_family": spec.ip_family},
            "etcd": {"endpoints": self.lab.etcd.endpoints, "lease_ttl": spec.lease_ttl},
            "bgp": {"mode": spec.bgp, "hold_time": spec.hold_time, "connect_retry": 2.0},
            # Every node its own API token (the nodes share this machine's file system).
            "api": {"listen": "127.0.0.1:9099", "token_file": str(self.token_path)},
            "cni": {
                "conf_dir": str(self.dir / "net.d"),
                "bin_dir": [CNI_PLUGIN_DIR],
                "subnet_file": str(self.dir / "subnet.env"),
                "data_dir": str(self.dir / "cni"),
                "ipam_data_dir": str(self.dir / "ipam"),
                # Docker hosts: the subnet is dockerd's, not agentd-cni's (docs/docker.md).
                "write_conflist": False if spec.docker else None,
            },
            "agent": {"state_dir": str(self.dir / "state"), "bpf_dir": str(self.lab.bpffs)},
            "log": {"level": spec.log_level},
        }
        if spec.ingress:
            cfg["ingress"] = {"enabled": True}
        for section, keys in spec.extra.get(self.name, {}).items():
            cfg.setdefault(section, {}).update(keys)
        for section in cfg.values():  # TOML has no null: None means "leave the default"
            for key in [k for k, v in section.items() if v is None]:
                del section[key]
        return cfg

    def write_config(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(render_toml(self.config()))

    # ------------------------------------------------------------ the agent process

    def start_agent(self) -> None:
        self.write_config()
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        log.write(f"--- agentd lab: starting agent at {time.ctime()} ---\n".encode())
        log.flush()
        self.proc = self.ns.popen(
            [binary("agentd"), "run", "--config", str(self.config_path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        (self.dir / "agent.pid").write_text(str(self.proc.pid))

    def agent_pid(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc.pid
        try:
            pid = int((self.dir / "agent.pid").read_text())
        except (OSError, ValueError):
            return None
        return pid if pid in self.ns.pids() else None

    def signal_agent(self, sig: int) -> None:
        pid = self.agent_pid()
        if pid is not None:
            os.kill(pid, sig)

    async def stop_agent(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        pid = self.agent_pid()
        if pid is None:
            return
        os.kill(pid, sig)
        proc = self.proc

        def gone() -> bool:
            return proc.poll() is not None if proc is not None else pid not in self.ns.pids()

        await auntil(gone, timeout, what=f"{self.name}: agent (pid {pid}) to exit after signal {sig}", error=LabError)

    async def kill_agent(self) -> None:
        await self.stop_agent(signal.SIGKILL)

    async def leave(self) -> str:
        """``agentd leave`` on this node (the running agent withdraws, releases and exits):
        what it printed, a line per step and the summary (LabError if a step failed)."""
        rc, out, err = await self.ns.aexec(
            binary("agentd"), "leave", "--config", str(self.config_path), "--timeout", "25", check=False, timeout=30
        )
        if rc != 0:
            said = (out + err).decode(errors="replace").strip()
            raise LabError(f"{self.name}: agentd leave failed: {said}")
        return out.decode(errors="replace")

    def api(self, path: str, *, token: bool = False) -> Any:
        """``GET path`` on the node's API; ``token``: with its API token (what the cluster
        view -- /cluster, another node's /nodes/NODE/..., /flows?cluster=1 -- needs)."""
        headers = {"Authorization": f"Bearer {self.token_path.read_text().strip()}"} if token else None
        return self.ns.http_json(API_URL + path, timeout=5, headers=headers)

    def api_or_none(self, path: str) -> Any:
        try:
            return self.api(path)
        except (OSError, ValueError):
            return None

    def kernel_routes(self) -> list[str]:
        """``ip route show proto <agentd>`` lines in this node's namespace, IPv4 then IPv6."""
        lines = []
        for family in (("-4",) if self.lab.spec.ip_family == "ipv4" else ("-4", "-6")):
            out = self.ns.ip(family, "route", "show", "proto", "143", check=False).stdout.decode()
            lines += [line.strip() for line in out.splitlines() if line.strip()]
        return lines


class LabPod:
    """A pod: ``node1-pod2`` (``--pods``, Kubernetes identity default/node1-pod2) or one added
    with a namespace, a name, labels and named ports (``lab.add_pod``, ``lab pod add``),
    whose lab name is ``NS/NAME``.  agentd-cni gets the identity as a runtime passes it."""

    def __init__(
        self,
        node: LabNode,
        index: int | None = None,
        *,
        namespace: str = "default",
        name: str | None = None,
        labels: dict[str, str] | None = None,
        ports: list[dict[str, Any]] | None = None,
        host_ports: list[dict[str, Any]] | None = None,
        slug: str | None = None,
    ) -> None:
        self.node = node
        self.added = name is not None
        if name is None:
            self.name = f"{node.name}-pod{index}"
            self.namespace, self.k8s_name = "default", self.name
            slug = self.name
        else:
            self.namespace, self.k8s_name = namespace, name
            self.name = f"{namespace}/{name}"
            # "_" is in neither a namespace (a DNS-1123 label) nor a name (a subdomain), so two
            # pods never share a slug ("a-b/c" is p-a-b_c, "a/b-c" is p-a_b-c); nor a node's pod
            # (node1-pod1: no "p-" in front).
            # (``slug``: the one a saved lab recorded, which may be an older scheme's.)
            slug = slug or _slug(f"p-{namespace}_{name}")
        self.slug = slug
        self.labels = dict(labels or {})
        self.ports = list(ports or [])
        # hostPort mappings (CNI runtimeConfig portMappings: hostPort, containerPort, protocol),
        # for the conflist's portmap plugin: a pod with some is attached through the whole chain.
        self.host_ports = list(host_ports or [])
        self.result: dict[str, Any] | None = None  # the chain's ADD result (DEL's prevResult)
        self.ns = Netns(f"ad-{node.lab.spec.name}-{slug}")
        self.container_id = f"{node.lab.spec.name}-{slug}"
        self.ip: str | None = None  # its first address (IPv4 unless the lab is IPv6-only)
        self.ips: list[str] = []  # every address: IPv4 and IPv6 in a dual-stack lab

    def __repr__(self) -> str:
        return f"<LabPod {self.name} {' '.join(self.ips) or self.ip}>"

    def address(self, version: int) -> str | None:
        """Its address of IP ``version``, if it has one."""
        return next((a for a in self.ips if (":" in a) == (version == 6)), None)

    def netconf_extra(self) -> dict[str, Any]:
        """Labels (CNI conventions' args.cni.labels) and named ports, as a runtime passes them."""
        extra: dict[str, Any] = {}
        if self.labels:
            extra["args"] = {"cni": {"labels": [{"key": k, "value": v} for k, v in self.labels.items()]}}
        if self.ports:
            extra["runtimeConfig"] = {"containerPorts": self.ports}
        return extra


def _slug(text: str) -> str:
    """A namespace/container name part: ``text`` up to 60 characters, else its first 48 and a
    hash (65 characters: longer than any unhashed slug, so the two kinds never meet; a network
    namespace name is a file name, and a CNI container ID may have 200)."""
    if len(text) <= 60:
        return text
    import hashlib

    return f"{text[:48]}-{hashlib.sha1(text.encode()).hexdigest()[:16]}"


def _old_slug(namespace: str, name: str) -> str:
    """An added pod's slug before the scheme above (``p-NS-NAME``, hashed past 60 characters to
    its first 40 and 12 hex digits): what a lab made then still has its pods under."""
    text = f"p-{namespace}-{name}"
    if len(text) <= 60:
        return text
    import hashlib

    return f"{text[:40]}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"


class Lab:
    def __init__(self, spec: LabSpec, *, root: Path | None = None, progress: Callable[[str], None] | None = None):
        self.spec = spec
        self.root = Path(root) if root else LAB_ROOT
        self.dir = self.root / spec.name
        # The nodes' BPF pins: a bpffs of the lab's own (agentd.lab.bpffs says why).
        self.bpffs = self.dir / "bpffs"
        self.progress = progress or (lambda line: None)
        if not 1 <= spec.nodes <= MAX_NODES:
            raise LabError(f"nodes: {spec.nodes} is out of range 1..{MAX_NODES}")
        if not 1 <= spec.etcd <= MAX_ETCD_MEMBERS:
            raise LabError(f"etcd members: {spec.etcd} is out of range 1..{MAX_ETCD_MEMBERS}")
        if spec.ip_family not in ("ipv4", "dual", "ipv6"):
            raise LabError(f"ip family {spec.ip_family!r}: one of ipv4, dual, ipv6")
        if spec.ipv4_underlay and spec.ip_family != "dual":
            raise LabError("an IPv4-only underlay goes with --ip-family dual")
        members = range(1, spec.etcd + 1)
        self.etcd = EtcdCluster.create(
            self.dir / "etcd",
            spec.etcd,
            name=f"lab-{spec.name}",
            hosts=[etcd_address(m, 6 if not spec.underlay_v4 else 4) for m in members],
            netns=[Netns(f"ad-{spec.name}-etcd{m}") for m in members],
            client_port=ETCD_PORT,
            peer_port=ETCD_PORT + 1,
            # etcd's own default timers for a cluster: a busy lab machine must not make
            # the members elect a new leader every few seconds.
            **({} if spec.etcd == 1 else {"heartbeat_ms": 100, "election_ms": 1000}),
        )
        self.etcd_ns = self.etcd.members[0].netns  # member 1 (the only one by default)
        self.network = Underlay(spec.name, spec.subnets, self.etcd,
                                ip_family="ipv6" if not spec.underlay_v4 else "dual" if spec.underlay_v6 else "ipv4",
                                host_forwarding=not spec.docker)  # Docker hosts: the agents turn it on
        self.underlay = self.network.ns
        self.router = self.network.router
        self.ready = Readiness(self)  # the waits of each stage: lab.ready.routes(timeout), ...
        self.nodes = [LabNode(self, i) for i in range(1, spec.nodes + 1)]
        self.pods = [LabPod(n, j) for n in self.nodes for j in range(1, spec.pods + 1)]
        self._t0 = time.monotonic()
        self._resources: Any = None  # agentd.lab.resources.LabResources, started on first use
        self.docker: Any = None  # agentd.lab.docker_hosts.DockerHosts with spec.docker
        if spec.docker:
            from agentd.lab.docker_hosts import DockerHosts

            self.docker = DockerHosts(self)

    # ------------------------------------------------------------ lookup

    def node(self, name: str) -> LabNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise LabError(f"no node {name!r} in lab {self.spec.name} (nodes: {', '.join(n.name for n in self.nodes)})")

    def pod(self, name: str) -> LabPod:
        for p in self.pods:
            if p.name == name:
                return p
        raise LabError(f"no pod {name!r} in lab {self.spec.name} (pods: {', '.join(p.name for p in self.pods)})")

    def namespace_of(self, target: str) -> Netns:
        if target in ("etcd", "router", "underlay"):
            return {"etcd": self.etcd_ns, "router": self.router, "underlay": self.underlay}[target]
        for i, m in enumerate(self.etcd.members, start=1):
            if target == f"etcd{i}":
                return m.netns  # type: ignore[return-value]
        for n in self.nodes:
            if n.name == target:
                return n.ns
        return self.pod(target).ns

    # ------------------------------------------------------------ up

    def _stage(self, text: str) -> None:
        self.progress(f"[lab {self.spec.name}] {text} ({time.monotonic() - self._t0:.1f}s)")

    async def up(self, timeout: float = 90.0, *, full: bool = True) -> None:
        """Build and start everything; with ``full`` False stop once BGP is established
        (for labs where not every node can reach every other, e.g. host-gw across segments)."""
        if list_names(f"ad-{self.spec.name}-"):
            raise LabError(
                f"a lab named {self.spec.name} already exists (agentd lab down --name {self.spec.name} removes it)"
            )
        self._t0 = time.monotonic()
        with contextlib.suppress(OSError):  # file systems of labs here that were killed
            bpffs.sweep_dead(self.root)
        stage = "network namespaces"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._save()
            bpffs.umount(self.bpffs)  # a dead lab's of the same name (its pins are not this lab's)
            bpffs.mount(self.bpffs)
            self.network.build(self.nodes, static_neighbors=self.static_neighbors)  # type: ignore[arg-type]
            if self.spec.ingress:
                self.network.add_client(CLIENT_ADDRESS if self.spec.underlay_v4 else None,
                                        CLIENT_ADDRESS_V6 if self.spec.underlay_v6 else None)
            self._stage(f"network namespaces ready ({self.spec.nodes} nodes, {self.spec.subnets} segment(s))")
            stage = "etcd up"
            await self.etcd.start()
            self._stage(f"etcd up on {', '.join(self.etcd.endpoints)}")
            stage = "agents started"
            # In waves: 100 Python processes importing at once starve etcd on a small machine
            # (leases expire, nodes are de-registered and re-registered, sessions churn).
            for i in range(0, len(self.nodes), START_WAVE):
                wave = self.nodes[i : i + START_WAVE]
                for n in wave:
                    n.start_agent()
                await self.ready.agents_started(timeout, wave)
            self._stage("agents started: " + ", ".join(f"{n.name}={self._subnets_text(n)}" for n in self.nodes))
            stage = "peers established"
            await self.ready.established(timeout)
            self._stage("BGP peers established (" + self.spec.bgp + ")")
            if not full:
                return
            stage = "routes installed"
            await self.ready.routes(timeout)
            self._stage("routes installed on every node")
            if self.docker is not None:
                stage = "Docker engines up"
                await self.docker.start(timeout)
                self._stage("a dockerd on every node, docker0 on the node's subnet (agentd docker-opts)")
            stage = "pods attached"
            await self.attach_pods()
            self._save()
            self._stage(f"pods attached ({len(self.pods)}): " + ", ".join(f"{p.name}={'/'.join(p.ips) or p.ip}" for p in self.pods))
            stage = "all pods reachable"
            await self.ready.reachable(timeout)
            families = sorted({6 if ":" in a else 4 for p in self.pods for a in p.ips})
            over = " over " + " and ".join(f"IPv{v}" for v in families) if families else ""
            self._stage(f"all pods reachable ({len(self.pods) * (len(self.pods) - 1)} pod pairs{over})")
        except LabError as err:
            raise LabError(f"stage '{stage}' did not complete: {err}") from None
        except (NetnsError, OSError, RuntimeError, subprocess.SubprocessError) as err:
            # SubprocessError: a command's timeout or check=True failure, neither an OSError
            raise LabError(f"stage '{stage}' failed: {err}") from None

    # ------------------------------------------------------------ changes to a running lab

    @property
    def static_neighbors(self) -> bool:
        on = self.spec.static_neighbors
        return self.spec.nodes > STATIC_NEIGHBORS_ABOVE if on is None else on

    async def add_node(self, timeout: float = 60.0) -> LabNode:
        """Build one more node (no pods), start its agent and wait until it holds a subnet."""
        if len(self.nodes) >= MAX_NODES:
            raise LabError(f"lab {self.spec.name} has {len(self.nodes)} nodes, the most a lab can have")
        node = LabNode(self, len(self.nodes) + 1)
        self.nodes.append(node)
        self.spec.nodes = len(self.nodes)
        self._save()
        try:
            self.network.add(node, self.nodes, static_neighbors=self.static_neighbors)  # type: ignore[arg-type]
        except NetnsError as err:
            raise LabError(f"{node.name}: {err}") from None
        node.start_agent()
        await self.ready.agents_started(timeout)
        self._stage(f"{node.name} joined with subnet {self._subnets_text(node)}")
        return node

    def _subnet(self, node: LabNode) -> str:
        status = node.api_or_none("/status") or {}
        return (status.get("node") or {}).get("subnet") or "-"

    def _subnets_text(self, node: LabNode) -> str:
        """Its pod subnets for a progress line: both families in a dual-stack lab, the IPv6
        one in an IPv6-only lab (where ``subnet`` is empty)."""
        node_status = (node.api_or_none("/status") or {}).get("node") or {}
        return " ".join(dict.fromkeys(s for s in (node_status.get("subnet"), node_status.get("subnet_v6")) if s)) or "-"

    def subnets(self) -> dict[str, str]:
        return {n.name: self._subnet(n) for n in self.nodes}

    def all_subnets(self) -> dict[str, list[str]]:
        """Each node's pod subnets as its /status says: IPv4 and IPv6 in a dual-stack lab."""
        return {n.name: subnets_of(n.api_or_none("/status")) for n in self.nodes}

    # ------------------------------------------------------------ pods

    async def attach_pods(self, parallel: int = 4) -> None:
        """CNI ADD for every pod without an address: a node's pods one after the other (as one
        runtime would), up to ``parallel`` nodes at once."""
        gate = asyncio.Semaphore(parallel)

        async def node_pods(pods: list[LabPod]) -> None:
            async with gate:
                for pod in pods:
                    await self.attach_pod(pod)

        per_node: dict[str, list[LabPod]] = {}
        for pod in self.pods:
            if pod.ip is None:
                per_node.setdefault(pod.node.name, []).append(pod)
        await asyncio.gather(*(node_pods(pods) for pods in per_node.values()))

    async def attach_pod(self, pod: LabPod) -> None:
        if self.docker is not None:  # a container on the node's docker0, no CNI
            pod.ips = await self.docker.run_container(pod)
            pod.ip = pod.ips[0]
            return
        if not pod.ns.exists():
            ns = Netns.create(pod.ns.name)
            if self.spec.ip_family != "ipv4":
                quiet_dad(ns)
        out = await cni(pod, "ADD")
        result = json.loads(out)
        pod.result = result
        pod.ips = [entry["address"].split("/")[0] for entry in result["ips"]]
        pod.ip = pod.ips[0]
        write_resolv_conf(pod, result.get("dns"))

    async def add_pod(
        self,
        node: LabNode | str,
        namespace: str,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        ports: list[dict[str, Any]] | None = None,
        host_ports: list[dict[str, Any]] | None = None,
    ) -> LabPod:
        """Attach one more pod, ``namespace/name`` with ``labels`` and named ``ports``
        (``[{"name": "http", "containerPort": 80, "protocol": "TCP"}]``), to ``node``."""
        node = self.node(node) if isinstance(node, str) else node
        try:
            dns1123_label(namespace, "namespace")
            dns1123_subdomain(name, "name")
        except Invalid as err:
            raise LabError(f"pod {namespace}/{name}: {err}") from None
        if self.docker is not None:
            raise LabError(f"lab {self.spec.name} runs Docker hosts: its pods are containers (`docker run`), not CNI pods")
        if any(p.name == f"{namespace}/{name}" for p in self.pods):
            raise LabError(f"lab {self.spec.name} already has a pod {namespace}/{name}")
        pod = LabPod(node, namespace=namespace, name=name, labels=labels, ports=ports, host_ports=host_ports)
        # Never attach into a namespace (or as a container) that is another's: the clean-up of a
        # failed attach below would delete it.
        if pod.ns.exists() or any(p.container_id == pod.container_id for p in self.pods):
            raise LabError(f"lab {self.spec.name}: pod {pod.name}'s network namespace {pod.ns.name} exists already")
        self.pods.append(pod)
        try:
            await self.attach_pod(pod)
        except BaseException:
            self.pods.remove(pod)
            with contextlib.suppress(Exception):
                await cni(pod, "DEL")
            await asyncio.to_thread(pod.ns.delete)
            raise
        self._save()
        return pod

    async def remove_pod(self, pod: LabPod) -> None:
        """CNI DEL for ``pod`` (as the runtime does when it goes), then its namespace."""
        await cni(pod, "DEL")
        await asyncio.to_thread(pod.ns.delete)
        self.pods.remove(pod)
        self._save()

    async def resources(self) -> Any:
        """Apply/get/delete/label in this lab's etcd (:class:`agentd.lab.resources.LabResources`)."""
        if self._resources is None:
            from agentd.lab.resources import LabResources

            self._resources = await LabResources.start(self.nodes[0])
        return self._resources

    async def ping(self, src: LabPod | LabNode, dst_ip: str, *, count: int = 1, wait: float = 1.0) -> bool:
        """True if ``count`` echo replies come back within ``count * wait + 2`` seconds (ping keeps
        probing once a second until then, so one lost packet on a busy machine is not a failure)."""
        deadline = int(count * wait + 2)
        rc, _, _ = await src.ns.aexec(
            "ping", "-n", "-q", "-c", str(count), "-w", str(deadline), dst_ip, check=False, timeout=deadline + 10
        )
        return rc == 0

    # ------------------------------------------------------------ down, state

    async def down(self, *, keep_files: bool = False) -> list[str]:
        if self._resources is not None:
            with contextlib.suppress(Exception):
                await self._resources.close()
            self._resources = None

        async def stop(n: LabNode) -> None:
            with contextlib.suppress(Exception):
                await n.stop_agent(signal.SIGTERM, timeout=10)
            if n.proc is not None and n.proc.poll() is None:  # not stopped in time: kill and reap it
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    n.proc.kill()
                    await asyncio.to_thread(n.proc.wait, 5)

        await asyncio.gather(*(stop(n) for n in self.nodes))  # all at once: 100 agents stop in seconds
        if self.docker is not None:  # containers and dockerd, before their namespaces go
            await asyncio.to_thread(self.docker.stop)
        with contextlib.suppress(Exception):
            await self.etcd.kill()
        removed = await asyncio.to_thread(delete_matching, f"ad-{self.spec.name}-")
        self._remove_worker_sockets()
        # The nodes' devices went with their namespaces, and their tc filters with them; the
        # pinned programs and maps go with the file system.
        with contextlib.suppress(OSError):
            bpffs.umount(self.bpffs)
        if not keep_files:
            shutil.rmtree(self.dir, ignore_errors=True)
        return removed

    def _remove_worker_sockets(self) -> None:
        """The nodes' state dirs are too deep for a unix socket's path, so their data-plane
        workers' control sockets are in /run/agentd (agentd.dataplane.backends.control_path):
        once the nodes' processes are gone, remove those of this lab's nodes, by exact name (a
        worker that stopped cleanly removed its own; one killed with its namespace did not)."""
        from agentd.dataplane.backends import control_path

        for node in self.nodes:
            for kind in ("udp", "ipip"):
                path = control_path(node.dir / "state", kind)
                if Path(path).is_relative_to(self.dir):
                    continue  # goes with the lab's directory
                for stale in (path, path + ".state"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(stale)

    def _save(self) -> None:
        added = [
            {"node": p.node.name, "namespace": p.namespace, "name": p.k8s_name, "labels": p.labels, "ports": p.ports,
             "host_ports": p.host_ports, "result": p.result, "slug": p.slug}
            for p in self.pods if p.added
        ]  # fmt: skip
        state = {"spec": asdict(self.spec), "pods": {p.name: p.ip for p in self.pods},
                 "pod_ips": {p.name: p.ips for p in self.pods}, "added_pods": added}
        (self.dir / "lab.json").write_text(json.dumps(state, indent=2))

    @classmethod
    def load(cls, name: str, root: Path | None = None) -> Lab:
        root = Path(root) if root else LAB_ROOT
        path = root / name / "lab.json"
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            raise LabError(f"no lab named {name} (no {path}); `agentd lab up --name {name}` makes one") from None
        try:
            lab = cls(LabSpec(**state["spec"]), root=root)
            for extra in state.get("added_pods", []):
                pod = LabPod(lab.node(extra["node"]), namespace=extra["namespace"], name=extra["name"],
                             labels=extra.get("labels"), ports=extra.get("ports"), host_ports=extra.get("host_ports"),
                             slug=extra.get("slug"))  # fmt: skip
                if "slug" not in extra and not pod.ns.exists():
                    # Saved before the slug was (an older agentd): its pod may be under the old
                    # scheme's name (p-NS-NAME), which is the one its namespace and CNI
                    # container ID have.
                    old = LabPod(pod.node, namespace=pod.namespace, name=pod.k8s_name, labels=pod.labels,
                                 ports=pod.ports, host_ports=pod.host_ports,
                                 slug=_old_slug(pod.namespace, pod.k8s_name))  # fmt: skip
                    if old.ns.exists():
                        pod = old
                pod.result = extra.get("result")
                lab.pods.append(pod)
            for p in lab.pods:
                p.ip = state.get("pods", {}).get(p.name)
                p.ips = list(state.get("pod_ips", {}).get(p.name) or ([p.ip] if p.ip else []))
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise LabError(
                f"lab {name}: {path} is not a lab state file ({type(err).__name__}: {err}); "
                f"`agentd lab down --name {name}` removes its namespaces"
            ) from None
        return lab


def stage_timeout(nodes: int) -> float:
    """Default seconds per stage of ``up``: 90, or 3 per node for labs above 30 nodes (a 2-core
    machine starts 100 agents, each a Python process, in about a minute)."""
    return max(90.0, 3.0 * nodes)


def etcd_address(member: int, version: int = 4) -> str:
    """Underlay address of etcd member ``member`` (1-based): IPv4, or IPv6 in an IPv6-only lab."""
    return f"{UNDERLAY_PREFIX}.0.{1 + member}" if version == 4 else v6_address(0, 1 + member)
