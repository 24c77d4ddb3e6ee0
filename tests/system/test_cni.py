"""agentd-cni with the real reference plugins (/usr/lib/cni), run the way a container runtime runs it.

A "node" namespace stands in for the host: the runtime runs ``agentd-cni`` inside it
(``ip netns exec NODE agentd-cni``), so the bridge plugin creates cni0 and the host ends of the
veths there.  Each "pod" is another namespace whose path is CNI_NETNS.  The plugin's stdin is its
conflist entry with ``name`` and ``cniVersion`` filled in, as libcni builds it (no cnitool needed).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from ipaddress import IPv4Interface, IPv4Network
from pathlib import Path

import pytest

import agentd
from agentd.cni import endpoints
from agentd.cni import netconf as cni_config
from agentd.cni import plugin as cni_plugin
from agentd.cni.netconf import SubnetFile
from agentd.lab import netns
from agentd.lab.netns import Netns
from agentd.lab.wait import until

AGENTD_CNI = os.path.join(sys.prefix, "bin", "agentd-cni")
CNI_PATH = "/usr/lib/cni"
NETWORK = IPv4Network("10.244.0.0/16")
SUBNET = IPv4Network("10.244.3.0/24")
GATEWAY = "10.244.3.1"
MTU = 1450


@dataclass
class Node:
    ns: Netns
    dir: Path
    conflist: dict

    @property
    def subnet_file(self) -> Path:
        return self.dir / "run" / "subnet.env"

    @property
    def state_dir(self) -> Path:
        return self.dir / "cni-state"

    def stored(self, container_id: str) -> Path:
        """The container's state file (its delegate config): in the plugin's own directory."""
        return self.state_dir / cni_plugin.STATE_SUBDIR / container_id

    @property
    def leases(self) -> Path:
        # host-local keeps one file per allocated address in <dataDir>/<network name>.
        return self.dir / "ipam" / self.conflist["name"]

    def plugin_conf(self, index: int = 0, **extra) -> dict:
        """The conflist entry as libcni hands it to the plugin."""
        entry = self.conflist["plugins"][index]
        return {**entry, "name": self.conflist["name"], "cniVersion": self.conflist["cniVersion"], **extra}

    def cni(
        self,
        command: str,
        container_id: str,
        pod: Netns | None,
        conf: dict | None = None,
        *,
        plugin: str = AGENTD_CNI,
        cni_path: str = CNI_PATH,
        netns_path: str | None = None,
        ifname: str = "eth0",
        cni_args: str | None = None,
    ) -> tuple[int, dict | None, str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": container_id,
            "CNI_IFNAME": ifname,
            "CNI_PATH": cni_path,
        }
        if cni_args is not None:
            env["CNI_ARGS"] = cni_args
        if os.environ.get("PYTHONPATH"):  # the checkout's code, not the venv's (PYTHONPATH=$PWD)
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        if netns_path or pod is not None:
            env["CNI_NETNS"] = netns_path or pod.path
        stdin = json.dumps(conf if conf is not None else self.plugin_conf()).encode()
        proc = subprocess.run(
            ["ip", "netns", "exec", self.ns.name, plugin], input=stdin, env=env, capture_output=True, timeout=120
        )
        stderr = proc.stderr.decode(errors="replace")
        assert "Traceback" not in stderr
        out = json.loads(proc.stdout) if proc.stdout.strip() else None
        return proc.returncode, out, stderr

    def add(self, container_id: str, pod: Netns) -> dict:
        code, out, err = self.cni("ADD", container_id, pod)
        assert code == 0, (out, err)
        return out


@pytest.fixture
def node(netns_factory, tmp_path) -> Node:
    ns = netns_factory("node")
    subnet_file = tmp_path / "run" / "subnet.env"
    sf = SubnetFile(network=NETWORK, subnet=SUBNET, mtu=MTU, backend="vxlan")
    cni_config.write_subnet_file(str(subnet_file), sf)
    path = cni_config.write_conflist(
        str(tmp_path / "net.d"),
        subnet_file=str(subnet_file),
        data_dir=str(tmp_path / "cni-state"),
        ipam_data_dir=str(tmp_path / "ipam"),
    )
    return Node(ns=ns, dir=tmp_path, conflist=json.loads(Path(path).read_text()))


def _addr(ns: Netns, dev: str) -> IPv4Interface:
    (info,) = json.loads(ns.exec("ip", "-j", "-4", "addr", "show", "dev", dev))
    (addr,) = info["addr_info"]
    return IPv4Interface(f"{addr['local']}/{addr['prefixlen']}")


def _links(ns: Netns | None) -> set[str]:
    out = ns.exec("ip", "-j", "link", "show") if ns else netns.run(["ip", "-j", "link", "show"]).stdout.decode()
    return {link["ifname"] for link in json.loads(out)}


def _routes(ns: Netns) -> dict[str, str | None]:
    return {r["dst"]: r.get("gateway") for r in json.loads(ns.exec("ip", "-j", "-4", "route", "show"))}


def _host_veth(result: dict) -> str:
    (veth,) = [i["name"] for i in result["interfaces"] if i["name"] != "cni0" and "sandbox" not in i]
    return veth


def _ping(ns: Netns, dst: str) -> None:
    ns.exec("ping", "-c", "1", "-W", "2", dst)


def test_add_connects_two_pods_through_the_node_bridge(node, netns_factory):
    root_links = _links(None)
    pod_a, pod_b = netns_factory("pa"), netns_factory("pb")
    res_a, res_b = node.add("pod-a", pod_a), node.add("pod-b", pod_b)

    for pod, res in ((pod_a, res_a), (pod_b, res_b)):
        assert res["cniVersion"] == "1.0.0"
        addr = _addr(pod, "eth0")
        assert addr.network == SUBNET and str(addr.ip) != GATEWAY
        assert res["ips"][0]["address"] == str(addr) and res["ips"][0]["gateway"] == GATEWAY
        routes = _routes(pod)
        assert routes[str(NETWORK)] == GATEWAY  # pods reach other nodes' pods via the bridge
        assert routes["default"] == GATEWAY  # isDefaultGateway
        (eth0,) = json.loads(pod.exec("ip", "-j", "link", "show", "dev", "eth0"))
        assert eth0["mtu"] == MTU
        assert (node.leases / str(addr.ip)).read_text().splitlines()[0] in ("pod-a", "pod-b")
    assert _addr(pod_a, "eth0") != _addr(pod_b, "eth0")

    # The bridge and the host ends of the veths live in the node namespace, nowhere else.
    assert _addr(node.ns, "cni0") == IPv4Interface(f"{GATEWAY}/24")
    assert {"cni0", _host_veth(res_a), _host_veth(res_b)} <= _links(node.ns)
    assert _links(None) == root_links

    _ping(pod_a, str(_addr(pod_b, "eth0").ip))
    _ping(pod_b, str(_addr(pod_a, "eth0").ip))
    _ping(pod_a, GATEWAY)
    _ping(node.ns, str(_addr(pod_a, "eth0").ip))

    for pod, res, cid in ((pod_a, res_a, "pod-a"), (pod_b, res_b, "pod-b")):
        code, out, err = node.cni("CHECK", cid, pod, node.plugin_conf(prevResult=res))
        assert (code, out) == (0, None), err


def test_check_fails_when_the_pod_lost_its_route(node, netns_factory):
    pod = netns_factory("pa")
    res = node.add("pod-a", pod)
    pod.ip("route", "del", str(NETWORK))
    code, out, _ = node.cni("CHECK", "pod-a", pod, node.plugin_conf(prevResult=res))
    assert code != 0 and out["code"] == 999 and "10.244.0.0" in out["msg"]


def test_check_fails_once_the_nodes_subnet_moved_away_from_the_pod(node, netns_factory):
    # The bridge plugin's own CHECK looks at the pod alone: it passes.  The node lost its lease
    # and has another subnet now, so the pod's address is routed elsewhere: CHECK says so.
    pod = netns_factory("pa")
    res = node.add("pod-a", pod)
    cni_config.write_subnet_file(str(node.subnet_file), SubnetFile(network=NETWORK, subnet=IPv4Network("10.244.7.0/24"), mtu=MTU))
    code, out, err = node.cni("CHECK", "pod-a", pod, node.plugin_conf(prevResult=res))
    assert code != 0 and out["code"] == 999, (out, err)
    assert "outside this node's IPv4 pod subnet (10.244.7.0/24)" in out["msg"]
    assert res["ips"][0]["address"].split("/")[0] in out["msg"]


K8S_ARGS = "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0"


def test_check_fails_when_the_pods_endpoint_file_is_gone(node, netns_factory):
    # The endpoint file is what the agent programs the pod's network policy from.
    pod = netns_factory("pa")
    conf = node.plugin_conf(policyTimeout=0)
    code, res, err = node.cni("ADD", "pod-a", pod, conf, cni_args=K8S_ARGS)
    assert code == 0, (res, err)
    endpoint = node.state_dir / "endpoints" / "pod-a.json"
    assert json.loads(endpoint.read_text())["name"] == "web-0"
    check = node.plugin_conf(policyTimeout=0, prevResult=res)
    assert node.cni("CHECK", "pod-a", pod, check, cni_args=K8S_ARGS)[:2] == (0, None)
    endpoint.unlink()
    code, out, err = node.cni("CHECK", "pod-a", pod, check, cni_args=K8S_ARGS)
    assert code != 0 and out["code"] == 999 and "endpoint file" in out["msg"], (out, err)


def test_a_second_agentd_interface_is_refused_and_its_clean_up_leaves_the_first(node, netns_factory):
    # Multus attaching agentd to one container twice (CNI_IFNAME net1): refused in one line,
    # and the runtime's clean-up DEL for net1 must not undo eth0.
    pod = netns_factory("pa")
    res = node.add("pod-a", pod)
    ip = res["ips"][0]["address"].split("/")[0]
    code, out, err = node.cni("ADD", "pod-a", pod, ifname="net1")
    assert code != 0 and out["code"] == 7 and "already has an agentd interface (eth0)" in out["msg"], (out, err)
    assert "net1" not in _links(pod)
    assert node.cni("DEL", "pod-a", pod, ifname="net1")[:2] == (0, None)
    assert node.stored("pod-a").exists() and (node.leases / ip).exists()
    assert node.cni("CHECK", "pod-a", pod, node.plugin_conf(prevResult=res))[:2] == (0, None)
    _ping(node.ns, ip)
    code, out, _ = node.cni("CHECK", "pod-a", pod, node.plugin_conf(prevResult=res), ifname="net1")
    assert code != 0 and out["code"] == 3


def test_del_removes_veth_address_and_stored_config_and_is_idempotent(node, netns_factory):
    pod = netns_factory("pa")
    res = node.add("pod-a", pod)
    ip = res["ips"][0]["address"].split("/")[0]
    assert (node.leases / ip).exists()
    assert node.stored("pod-a").exists()

    code, out, err = node.cni("DEL", "pod-a", pod)
    assert (code, out) == (0, None), err
    assert _host_veth(res) not in _links(node.ns)
    assert "eth0" not in _links(pod)
    assert not (node.leases / ip).exists()
    assert not node.stored("pod-a").exists()

    # Again, and once more without CNI_NETNS (the runtime may have removed the namespace).
    assert node.cni("DEL", "pod-a", pod)[:2] == (0, None)
    assert node.cni("DEL", "pod-a", None)[:2] == (0, None)
    # A container the plugin never saw.
    assert node.cni("DEL", "never-added", pod)[:2] == (0, None)

    code, out, _ = node.cni("CHECK", "pod-a", pod, node.plugin_conf(prevResult=res))
    assert code != 0 and out["code"] == 3


def test_del_after_the_pod_namespace_is_gone_frees_the_address(node, netns_factory):
    pod = netns_factory("pa")
    res = node.add("pod-a", pod)
    ip = res["ips"][0]["address"].split("/")[0]
    path = pod.path
    pod.delete()
    code, out, err = node.cni("DEL", "pod-a", None, netns_path=path)
    assert (code, out) == (0, None), err
    assert not (node.leases / ip).exists()
    assert not node.stored("pod-a").exists()


def test_del_uses_the_config_stored_by_add(node, netns_factory):
    pod_a, pod_b, pod_c = netns_factory("pa"), netns_factory("pb"), netns_factory("pc")
    results = {cid: node.add(cid, pod) for cid, pod in (("pod-a", pod_a), ("pod-b", pod_b), ("pod-c", pod_c))}
    stored = json.loads(node.stored("pod-a").read_text())
    assert stored["ipam"]["subnet"] == str(SUBNET) and stored["mtu"] == MTU

    # The agent moved to another subnet: DEL still undoes what ADD did.
    new = SubnetFile(network=NETWORK, subnet=IPv4Network("10.244.7.0/24"), mtu=1400)
    cni_config.write_subnet_file(str(node.subnet_file), new)
    assert node.cni("DEL", "pod-a", pod_a)[:2] == (0, None)
    # A broken subnet file would make a fresh config impossible (code 7); DEL does not need one.
    node.subnet_file.write_text("garbage\n")
    assert node.cni("DEL", "pod-b", pod_b)[:2] == (0, None)
    # Nor does it need the agent to be up at all.
    node.subnet_file.unlink()
    assert node.cni("DEL", "pod-c", pod_c)[:2] == (0, None)

    for cid, pod in (("pod-a", pod_a), ("pod-b", pod_b), ("pod-c", pod_c)):
        ip = results[cid]["ips"][0]["address"].split("/")[0]
        assert not (node.leases / ip).exists()
        assert "eth0" not in _links(pod)
        assert _host_veth(results[cid]) not in _links(node.ns)
    assert os.listdir(node.state_dir) == [cni_plugin.STATE_SUBDIR] and os.listdir(node.stored("")) == []


def test_add_after_subnet_change_moves_the_bridge(node, netns_factory):
    pod_a, pod_b = netns_factory("pa"), netns_factory("pb")
    node.add("pod-a", pod_a)
    assert node.cni("DEL", "pod-a", pod_a)[:2] == (0, None)
    moved = SubnetFile(network=NETWORK, subnet=IPv4Network("10.244.7.0/24"), mtu=MTU)
    cni_config.write_subnet_file(str(node.subnet_file), moved)
    res = node.add("pod-b", pod_b)
    assert IPv4Interface(res["ips"][0]["address"]).network == IPv4Network("10.244.7.0/24")
    assert _addr(node.ns, "cni0") == IPv4Interface("10.244.7.1/24")  # forceAddress
    _ping(pod_b, "10.244.7.1")


def test_add_before_the_agent_wrote_the_subnet_file_is_try_again_later(node, netns_factory):
    pod = netns_factory("pa")
    node.subnet_file.unlink()
    code, out, _ = node.cni("ADD", "pod-a", pod)
    assert code != 0
    assert out["code"] == 11 and out["cniVersion"] == "1.0.0" and str(node.subnet_file) in out["msg"]
    assert "eth0" not in _links(pod) and "cni0" not in _links(node.ns)


def test_add_with_a_bad_subnet_file_is_invalid_config(node, netns_factory):
    pod = netns_factory("pa")
    node.subnet_file.write_text("AGENTD_NETWORK=10.244.0.0/16\nAGENTD_SUBNET=10.99.0.1/24\nAGENTD_MTU=1450\n")
    code, out, _ = node.cni("ADD", "pod-a", pod)
    assert code != 0
    assert out["code"] == 7 and "not inside" in out["msg"] and "\n" not in out["msg"]
    assert "eth0" not in _links(pod) and "cni0" not in _links(node.ns)


def test_delegate_error_is_passed_through_unchanged(node, netns_factory):
    pod = netns_factory("pa")
    node.add("pod-a", pod)
    # A second attachment asking for the same interface name in the same pod.
    code, out, _ = node.cni("ADD", "pod-b", pod)
    assert code != 0
    # The bridge plugin's own error object, not one agentd-cni made (those always carry details).
    assert out["code"] == 999 and "eth0" in out["msg"] and "already exists" in out["msg"] and "details" not in out


def test_del_recovers_from_a_config_the_delegate_rejects(node, netns_factory):
    pod = netns_factory("pa")
    bad = node.plugin_conf()
    bad["delegate"] = {**bad["delegate"], "vlan": 5000}
    code, out, _ = node.cni("ADD", "pod-a", pod, bad)
    assert code != 0 and out["code"] == 999 and "invalid VLAN ID 5000" in out["msg"]
    # ADD stored its delegate config first, so the runtime's clean-up DEL knows what to undo ...
    assert json.loads(node.stored("pod-a").read_text())["vlan"] == 5000
    # ... but the bridge rejects it on DEL too, as long as the config is broken,
    code, out, _ = node.cni("DEL", "pod-a", pod, bad)
    assert code != 0 and "invalid VLAN ID 5000" in out["msg"]
    # and once the config is fixed, DEL succeeds and forgets the stored one.
    assert node.cni("DEL", "pod-a", pod)[:2] == (0, None)
    assert not node.stored("pod-a").exists()
    assert [p.name for p in node.leases.iterdir() if p.name[0].isdigit()] == []


def test_a_hung_delegate_is_killed(node, netns_factory, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    hang = bin_dir / "hang"
    hang.write_text("#!/bin/sh\nsleep 600 &\nexec sleep 600\n")
    hang.chmod(hang.stat().st_mode | stat.S_IXUSR)
    pod = netns_factory("pa")
    conf = node.plugin_conf(delegateTimeout=1)
    conf["delegate"] = {"type": "hang"}
    code, out, _ = node.cni("ADD", "pod-a", pod, conf, cni_path=f"{bin_dir}:{CNI_PATH}")
    assert code != 0 and out["code"] == 999 and "did not finish ADD within 1 s" in out["msg"]
    # The delegate and what it started were killed (SIGKILL lands asynchronously).
    until(lambda: node.ns.pids() == [], 10, what=lambda: f"no process left in {node.ns.name}: {node.ns.pids()}")


def test_conflist_chain_runs_like_a_runtime_runs_it(node, netns_factory):
    # ADD through every plugin of the list in order, each given the previous result (libcni's
    # AddNetworkList); CHECK and DEL in reverse order with the final result.
    def exe(conf: dict) -> str:
        return AGENTD_CNI if conf["type"] == "agentd-cni" else os.path.join(CNI_PATH, conf["type"])

    pod = netns_factory("pa")
    count = len(node.conflist["plugins"])
    # The pod's bandwidth annotations, as the runtime hands them to the plugin declaring the
    # capability (bits per second; bursts in bits).
    limits = {"ingressRate": 10_000_000, "ingressBurst": 1_000_000, "egressRate": 20_000_000, "egressBurst": 1_000_000}
    prev = None
    for index in range(count):
        conf = node.plugin_conf(index, **({"prevResult": prev} if prev else {}))
        if conf["type"] == "bandwidth":
            conf["runtimeConfig"] = {"bandwidth": limits}
        code, prev, err = node.cni("ADD", "pod-a", pod, conf, plugin=exe(conf))
        assert code == 0, (prev, err)
    assert IPv4Interface(prev["ips"][0]["address"]).network == SUBNET
    assert "bandwidth" in [p["type"] for p in node.conflist["plugins"]]
    (veth,) = [i["name"] for i in prev["interfaces"] if i["name"].startswith("veth") and "sandbox" not in i]
    qdiscs = node.ns.exec("tc", "qdisc", "show", "dev", veth)
    assert "qdisc tbf" in qdiscs, qdiscs  # the pod's ingress limit, on the host side of its veth
    # The egress limit: an ifb device the plugin adds (and names in the result), gone with DEL.
    (ifb,) = [i["name"] for i in prev["interfaces"] if i["name"].startswith("bwp")]
    assert ifb in _links(node.ns)
    for command in ("CHECK", "DEL"):
        for index in reversed(range(count)):
            conf = node.plugin_conf(index, prevResult=prev)
            if conf["type"] == "bandwidth":  # libcni hands the capability to every command
                conf["runtimeConfig"] = {"bandwidth": limits}
            code, out, err = node.cni(command, "pod-a", pod, conf, plugin=exe(conf))
            assert (code, out) == (0, None), (command, conf["type"], err)
    assert "eth0" not in _links(pod)
    assert ifb not in _links(node.ns)
    assert not node.stored("pod-a").exists()


def test_the_runtimes_capability_arguments_reach_agentd_cni_as_libcni_passes_them(node, netns_factory):
    """libcni passes a plugin only the capability arguments its conflist entry declares
    (libcni/api.go, injectRuntimeConfig).  With the conflist the agent writes, a pod's MAC
    (podman's --mac-address, Multus) reaches agentd-cni and the bridge plugin, which sets it,
    its labels and named ports the endpoint file; the runtime's ipRanges do not reach
    host-local (the pod's address is the node subnet's)."""
    pod = netns_factory("pa")
    mac = "02:42:0a:f4:03:07"
    capability_args = {
        "mac": mac,
        "labels": {"app": "web"},
        "containerPorts": [{"name": "http", "containerPort": 80, "protocol": "TCP"}],
        "portMappings": [{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}],
        "ipRanges": [[{"subnet": "10.1.0.0/24"}]],
    }
    declared = node.conflist["plugins"][0].get("capabilities") or {}
    runtime = {k: v for k, v in capability_args.items() if declared.get(k) is True}
    conf = node.plugin_conf(policyTimeout=0, **({"runtimeConfig": runtime} if runtime else {}))
    code, res, err = node.cni("ADD", "pod-a", pod, conf, cni_args=K8S_ARGS)
    assert code == 0, (res, err)
    assert [IPv4Interface(i["address"]).network for i in res["ips"]] == [SUBNET]
    assert pod.exec("cat", "/sys/class/net/eth0/address").strip() == mac
    ep = json.loads((node.state_dir / "endpoints" / "pod-a.json").read_text())
    assert (ep["labels"], [p["name"] for p in ep["ports"]], ep["pod_mac"]) == ({"app": "web"}, ["http"], mac), ep
    assert node.cni("DEL", "pod-a", pod, conf, cni_args=K8S_ARGS)[:2] == (0, None)
    assert "eth0" not in _links(pod) and not node.stored("pod-a").exists()


def test_executable_answers_version_and_rejects_bad_env(node):
    proc = subprocess.run([AGENTD_CNI], input=b"", env={"CNI_COMMAND": "VERSION"}, capture_output=True, timeout=60)
    assert proc.returncode == 0
    assert json.loads(proc.stdout) == {
        "cniVersion": "1.0.0",
        "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0"],
    }
    code, out, err = node.cni("ADD", "bad/id", None, netns_path="/var/run/netns/none")
    assert code != 0 and out["code"] == 4 and err == ""


def test_delegates_found_in_the_agents_bin_dir_after_cni_path(node, netns_factory, tmp_path):
    # The agent writes its [cni] bin_dir into the conflist ("binDir"): a runtime whose CNI_PATH
    # lacks bridge and host-local still gets a pod attached, and DEL finds them the same way.
    conf = node.plugin_conf(binDir=[CNI_PATH])
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    pod = netns_factory("pbin")
    code, out, err = node.cni("ADD", "pod-bin", pod, conf, cni_path=str(empty))
    assert code == 0, (out, err)
    assert IPv4Interface(out["ips"][0]["address"]).ip in SUBNET
    assert _addr(pod, "eth0").ip in SUBNET
    code, out, err = node.cni("DEL", "pod-bin", pod, conf, cni_path=str(empty))
    assert code == 0, (out, err)
    # Without binDir the same request cannot find the delegate: a clear CNI error.
    code, out, _ = node.cni("ADD", "pod-bin2", pod, node.plugin_conf(), cni_path=str(empty))
    assert code != 0 and out["code"] != 0 and "bridge" in out["msg"] + out.get("details", "")
    # A malformed binDir is a network-config error (code 7).
    code, out, _ = node.cni("ADD", "pod-bin3", pod, node.plugin_conf(binDir="/usr/lib/cni"))
    assert code != 0 and out["code"] == 7


# An agent of a user of its own (docs/operations.md's User=agentd drop-in) in [cni] data_dir
# (argv[1]), as uid and gid 65534: argv[2] "make" makes its directories as write_cni_files does;
# "use" reads the endpoint files, acknowledges the one pod and writes labels into its file.
# What that user could do against root's plugin (review s55 r1): "replace state" tries to
# replace the one pod's state file (and, failing, puts a directory of its own with that file in
# the state directory's place); "old state" leaves a state file where an older plugin kept them;
# "symlink endpoints" puts a symlink to argv[3] in endpoints/' place.
OWN_USERS_AGENT = r'''
import json, logging, os, sys
logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
from agentd.cni import endpoints
data_dir, what = sys.argv[1:3]
crafted = json.dumps({"type": "tuning", "sysctl": {"net.ipv4.ip_forward": "0"}})
if what == "make":
    endpoints.make_dirs(data_dir)
elif what == "make data_dir":
    os.mkdir(data_dir, 0o755)
elif what == "replace state":
    private = os.path.join(data_dir, ".state")
    for attempt in (lambda: os.unlink(os.path.join(private, "own-1")),
                    lambda: open(os.path.join(private, "own-1.new"), "w"), lambda: os.listdir(private)):
        try:
            attempt()
        except PermissionError:
            pass
        else:
            raise SystemExit("the state directory let uid 65534 in")
    os.rename(private, private + ".root")  # its own data_dir: allowed
    os.mkdir(private, 0o700)
    with open(os.path.join(private, "own-1"), "w") as f:
        f.write(crafted)
elif what == "old state":
    with open(os.path.join(data_dir, "own-2"), "w") as f:
        f.write(crafted)
    os.chmod(os.path.join(data_dir, "own-2"), 0o600)
elif what == "symlink endpoints":
    ep = os.path.join(data_dir, "endpoints")
    os.rename(ep, ep + ".x")
    os.symlink(sys.argv[3], ep)
else:
    (ep,) = endpoints.read_all(data_dir).values()
    assert endpoints.acknowledge(data_dir, {(ep.container_id, ep.ident)}, set()) == {(ep.container_id, ep.ident)}
    assert endpoints.relabel(data_dir, ep, {"app": "relabelled"}) is not None
    print(ep.container_id)
'''
NOBODY = 65534


def _own_users_agent(data_dir: Path, what: str, *more: str) -> subprocess.CompletedProcess:
    # This venv's interpreter may live where another user cannot go: the same code runs on
    # Debian's python3 with the checkout and the venv's packages (as test_cli_lab does).
    path = f"{Path(agentd.__file__).parents[1]}:{sysconfig.get_paths()['purelib']}"
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "env",
                           f"PYTHONPATH={path}", "/usr/bin/python3", "-c", OWN_USERS_AGENT, str(data_dir), what, *more],
                          check=False, capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.mark.parametrize("agent_made", ["make", "make data_dir"])
def test_an_agent_of_its_own_user_uses_what_roots_plugin_made(node, netns_factory, agent_made):
    """Review r12: ADD (root, under the runtime) made endpoints/ and its lock root's, so an agent
    of its own user could read the endpoint files but not acknowledge a pod (every ADD waited
    policyTimeout), write labels back, or open the lock.  The agent makes data_dir, endpoints/
    and endpoints/.programmed first (write_cni_files); where only data_dir is its user's, the
    plugin gives endpoints/ and the lock data_dir's owner.  The state file stays root's, 0600,
    in a directory of root's alone (review s55 r1: in data_dir, the agent's user's, that user
    could replace it and choose what root runs on DEL)."""
    top = Path(tempfile.mkdtemp(prefix="agentd-cni-own-user-"))  # tmp_path's parents are root's, 0700
    try:
        top.chmod(0o755)
        os.chown(top, NOBODY, NOBODY)  # as systemd's StateDirectory= (/var/lib/agentd) is User='s
        data_dir = top / "cni"
        made = _own_users_agent(data_dir, agent_made)
        assert made.returncode == 0 and made.stderr == "", made.stderr
        pod = netns_factory("ownuser")
        conf = node.plugin_conf(dataDir=str(data_dir), policyTimeout=0)
        code, out, err = node.cni("ADD", "own-1", pod, conf, cni_args="IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web")
        assert code == 0, (out, err)

        def owner(relative: str) -> tuple[int, int, int]:
            st = os.stat(data_dir / relative)
            return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)

        assert owner(".") == (NOBODY, NOBODY, 0o755)
        assert owner(endpoints.SUBDIR) == (NOBODY, NOBODY, 0o755)
        assert owner(f"{endpoints.SUBDIR}/{endpoints.LOCK}") == (NOBODY, NOBODY, 0o600)
        # The delegate's config, what root runs at DEL: root's plugin alone reads and writes it.
        assert owner(cni_plugin.STATE_SUBDIR) == (0, 0, 0o700)
        assert owner(f"{cni_plugin.STATE_SUBDIR}/own-1") == (0, 0, 0o600)
        assert not os.path.lexists(data_dir / "own-1")
        assert owner(f"{endpoints.SUBDIR}/own-1{endpoints.SUFFIX}") == (0, 0, 0o644)
        used = _own_users_agent(data_dir, "use")
        assert (used.returncode, used.stdout.strip(), used.stderr) == (0, "own-1", ""), used.stderr
        assert (data_dir / endpoints.SUBDIR / endpoints.PROGRAMMED / "own-1").exists()
        assert endpoints.read(data_dir, "own-1").labels == {"app": "relabelled"}
        code, out, err = node.cni("DEL", "own-1", pod, conf)
        assert (code, out) == (0, None), err
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_agents_own_user_cannot_choose_what_roots_plugin_runs_or_where_it_writes(node, netns_factory):
    """Review s55 r1 #1 and #2, with the agent's user really another uid: it cannot change the
    state directory root's plugin keeps the delegate configs in, and one of its own in that
    place is refused (DEL fails, naming it, and runs nothing) until root's is back; a state file
    it leaves where an older plugin kept them is not run (DEL undoes with the current config);
    a symlink it puts at endpoints/ is refused by ADD, nothing written where it points."""
    top = Path(tempfile.mkdtemp(prefix="agentd-cni-own-user-"))
    try:
        top.chmod(0o755)
        os.chown(top, NOBODY, NOBODY)
        data_dir = top / "cni"
        assert _own_users_agent(data_dir, "make").returncode == 0
        pod = netns_factory("ownuser")
        conf = node.plugin_conf(dataDir=str(data_dir), policyTimeout=0)
        code, out, err = node.cni("ADD", "own-1", pod, conf, cni_args="IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web")
        assert code == 0, (out, err)
        ip = out["ips"][0]["address"].split("/")[0]

        tampered = _own_users_agent(data_dir, "replace state")
        assert tampered.returncode == 0, tampered.stderr
        code, out, err = node.cni("DEL", "own-1", pod, conf)
        assert code == 1 and out["code"] == 5 and "refused" in out["msg"], (out, err)
        assert f"{data_dir / cni_plugin.STATE_SUBDIR} is owned by uid {NOBODY}, not 0" in out["msg"], out
        assert "eth0" in _links(pod) and (node.leases / ip).exists()  # nothing undone, nothing run
        shutil.rmtree(data_dir / cni_plugin.STATE_SUBDIR)  # the operator puts root's back
        os.rename(data_dir / f"{cni_plugin.STATE_SUBDIR}.root", data_dir / cni_plugin.STATE_SUBDIR)
        code, out, err = node.cni("DEL", "own-1", pod, conf)
        assert (code, out) == (0, None), err
        assert "eth0" not in _links(pod) and not (node.leases / ip).exists()

        assert _own_users_agent(data_dir, "old state").returncode == 0
        code, out, err = node.cni("DEL", "own-2", pod, conf)
        assert (code, out) == (0, None), err
        assert "not using the stored delegate config" in err and "tuning" not in err, err
        assert not os.path.lexists(data_dir / "own-2")

        netd = top / "net.d"  # stands for /etc/cni/net.d: root's
        netd.mkdir(mode=0o755)
        assert _own_users_agent(data_dir, "symlink endpoints", str(netd)).returncode == 0
        code, out, err = node.cni("ADD", "own-3", pod, conf, cni_args="IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web")
        assert code == 1 and out["code"] == 5 and "a symlink or no directory: refused" in out["msg"], (out, err)
        assert os.listdir(netd) == []
        code, out, err = node.cni("DEL", "own-3", pod, conf)  # the runtime's clean-up: the delegate's part done
        assert code == 1 and out["code"] == 5, (out, err)
        assert os.listdir(netd) == [] and not (data_dir / cni_plugin.STATE_SUBDIR / "own-3").exists()
        os.unlink(data_dir / endpoints.SUBDIR)
        assert node.cni("DEL", "own-3", pod, conf)[:2] == (0, None)
    finally:
        shutil.rmtree(top, ignore_errors=True)
