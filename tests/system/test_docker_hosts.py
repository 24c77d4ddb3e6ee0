"""Docker hosts on agentd's network (``agentd lab up --docker``): flannel's Docker story.

Per backend (host-gw, vxlan, udp, ipip), two lab nodes, each running its own dockerd in its
network namespace with the options ``agentd docker-opts`` reads from the node's subnet file,
and one container per node started with plain ``docker run`` (no CNI):

* docker0 holds the node's subnet (``--bip``) with the pod MTU (``--mtu``), and Docker's own
  masquerading is off (``--ip-masq=false``);
* the hosts start with IP forwarding off, as fresh hosts do: the agent turns it on before
  dockerd starts, so Docker leaves iptables' FORWARD policy at ACCEPT;
* the containers reach each other across the hosts: ICMP (the lab's matrix) and TCP, and the
  receiving container sees the sender's own address (container-to-container traffic is never
  masqueraded);
* a container reaching an address outside the pod network (the other node's underlay
  address) arrives as its node (``[network] ip_masq``: the agent's nftables table);
* ``agentd leave`` removes the masquerading table (host-gw only: it is the same code for all);
* ``lab down`` leaves no engine, container namespace, mount or file behind;
* on a dual-stack or IPv6-only lab, dockerd gets the node's IPv6 subnet as well, and the
  containers talk over IPv6 across the hosts.
"""

from __future__ import annotations

import os
import socket
import subprocess
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path

import pytest

from agentd.cni.netconf import read_subnet_file
from agentd.lab.dockerd import DOCKER
from agentd.lab.netns import list_names

MESSAGE = "hello across hosts"


def tcp_peer(lab, listen_ns, address: str, src_pod) -> tuple[str, str]:
    """Listen on ``address`` in ``listen_ns``, connect from ``src_pod``'s container with busybox nc;
    (the peer address the listener saw, what it received)."""
    with listen_ns.entered():
        server = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    with server:
        server.bind((address, 0))
        server.listen(1)
        server.settimeout(20)
        port = server.getsockname()[1]
        engine = lab.docker.engines[src_pod.node.name]
        client = subprocess.Popen(
            [DOCKER, "exec", src_pod.name, "sh", "-c", f"echo '{MESSAGE}' | nc {address} {port}"],  # busybox nc: IPv6 too
            env=engine.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            conn, (peer, *_) = server.accept()
            with conn:  # busybox nc sends and waits for us to close
                conn.settimeout(10)
                data = b""
                while not data.endswith(b"\n") and (chunk := conn.recv(4096)):
                    data += chunk
            client.wait(30)
        finally:
            if client.poll() is None:
                client.kill()
                client.wait()
    return peer, data.decode().strip()


@pytest.mark.parametrize("backend", ["host-gw", "vxlan", "udp", "ipip"])
async def test_plain_docker_containers_reach_each_other_across_hosts(lab_factory, backend):
    lab = await lab_factory(nodes=2, pods=1, backend=backend, docker=True)
    node1, node2 = lab.nodes
    pod1, pod2 = lab.pods
    engines = list(lab.docker.engines.values())

    for node in lab.nodes:
        sf = read_subnet_file(node.dir / "subnet.env")
        engine = lab.docker.engines[node.name]
        argv = Path(f"/proc/{engine.running_pid()}/cmdline").read_bytes().split(b"\0")
        assert {f"--bip={sf.gateway}/{sf.subnet.prefixlen}".encode(), f"--mtu={sf.mtu}".encode(), b"--ip-masq=false"} <= set(argv)
        addr = node.ns.ip("-4", "-o", "addr", "show", "dev", "docker0").stdout.decode().split()
        assert addr[addr.index("inet") + 1] == f"{sf.gateway}/{sf.subnet.prefixlen}"
        assert f" mtu {sf.mtu} " in node.ns.ip("link", "show", "docker0").stdout.decode()
        pod = next(p for p in lab.pods if p.node is node)
        assert IPv4Network(f"{pod.ip}/32").subnet_of(sf.subnet)
        assert sf.backend == backend and sf.ipmasq is False
        # The host had forwarding off (as a fresh host has): the agent turned it on before the
        # subnet file was there, so dockerd found it on and left iptables' FORWARD policy alone
        # (a dockerd that turns it on itself sets the policy to DROP, which drops what other
        # hosts' containers open to this host's).
        assert node.ns.exec("sysctl", "-n", "net.ipv4.ip_forward").strip() == "1"
        assert "-P FORWARD ACCEPT" in node.ns.exec("iptables", "-S", "FORWARD").splitlines()

    # ICMP: every container answers every other (lab.up waited for it; once more, to assert it).
    matrix = await lab.ready.reachability()
    assert matrix == {(pod1.name, pod2.name): True, (pod2.name, pod1.name): True}

    # TCP between the containers, both ways, not masqueraded.
    assert tcp_peer(lab, pod2.ns, pod2.ip, pod1) == (pod1.ip, MESSAGE)
    assert tcp_peer(lab, pod1.ns, pod1.ip, pod2) == (pod2.ip, MESSAGE)

    # Leaving the pod network (to node2's own underlay address): masqueraded to node1's address.
    assert tcp_peer(lab, node2.ns, node2.address, pod1) == (node1.address, MESSAGE)

    if backend == "host-gw":  # `agentd leave` takes the masquerading table away with the node
        await node1.leave()
        assert node1.ns.exec("nft", "list", "table", "ip", "agentd-masq", check=False) == ""
        assert "table ip agentd-masq" in node2.ns.exec("nft", "list", "tables")

    await lab.down()
    assert not list_names(f"ad-{lab.spec.name}-")
    for engine in engines:
        assert engine.running_pid() is None and not engine.run_root.exists() and not engine.data_root.exists()
        mounts = Path("/proc/self/mountinfo").read_text()
        assert str(engine.data_root) not in mounts and str(engine.run_root) not in mounts
        assert not [p for p in os.listdir("/proc") if p.isdigit() and _mentions(p, str(engine.run_root))]


@pytest.mark.parametrize("family", ["dual", "ipv6"])
async def test_docker_containers_get_the_nodes_ipv6_subnet(lab_factory, family):
    """A dual-stack or IPv6-only node gives its dockerd the node's IPv6 subnet too (``--ipv6
    --fixed-cidr-v6``, agentd docker-opts): the containers get IPv6 addresses of it and reach
    each other across the hosts over IPv6 (and IPv4 where the lab has it), not masqueraded."""
    lab = await lab_factory(nodes=2, pods=1, docker=True, ip_family=family)
    pod1, pod2 = lab.pods
    for node in lab.nodes:
        sf = read_subnet_file(node.dir / "subnet.env")
        argv = set(Path(f"/proc/{lab.docker.engines[node.name].running_pid()}/cmdline").read_bytes().split(b"\0"))
        assert {b"--ipv6=true", f"--fixed-cidr-v6={sf.subnet_v6}".encode()} <= argv
        assert any(a.startswith(b"--bip=") for a in argv) is (family == "dual")
        assert f"inet6 {sf.gateway_v6}/{sf.subnet_v6.prefixlen} " in node.ns.ip("-6", "addr", "show", "dev", "docker0").stdout.decode()
        pod = next(p for p in lab.pods if p.node is node)
        assert IPv6Network(f"{pod.address(6)}/128").subnet_of(sf.subnet_v6)
        assert (pod.address(4) is not None) is (family == "dual")
    matrix = await lab.ready.reachability()  # every family the lab has
    assert matrix == {(pod1.name, pod2.name): True, (pod2.name, pod1.name): True}
    assert tcp_peer(lab, pod2.ns, pod2.address(6), pod1) == (pod1.address(6), MESSAGE)


def _mentions(pid: str, text: str) -> bool:
    try:
        return text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
