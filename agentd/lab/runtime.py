"""The container runtime's side of CNI, for the lab's pods.

A runtime (containerd, CRI-O) reads the node's conflist and runs each plugin with the CNI
environment (``CNI_COMMAND``, ``CNI_NETNS``, ``CNI_ARGS`` with ``K8S_POD_NAMESPACE`` and
``K8S_POD_NAME``...) and the network configuration on stdin; ADD goes down the chain, each
plugin after the first given the previous result, DEL goes up it with the ADD result as
``prevResult``.  :func:`cni` does that, inside the node's namespace, for one pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

from agentd.lab.errors import LabError

CNI_PLUGIN_DIR = "/usr/lib/cni"
PLUGIN_TIMEOUT = 60.0  # seconds a plugin may take (a runtime gives up on one as well)


class Pod(Protocol):
    """What the runtime needs of a lab pod (agentd.lab.lab.LabPod)."""

    name: str
    namespace: str
    k8s_name: str
    container_id: str
    node: Any  # .dir (its conflist is in net.d/) and .ns.name
    ns: Any  # .path: the pod's network namespace; .etc: its /etc/netns directory
    host_ports: list[dict[str, Any]]
    result: dict[str, Any] | None

    def netconf_extra(self) -> dict[str, Any]: ...


def binary(name: str) -> str:
    """``name`` next to this Python (the venv's scripts), else as found on PATH."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


async def cni(pod: Pod, command: str) -> bytes:
    """Run the node's conflist as a container runtime would (K8S_POD_* in CNI_ARGS): agentd-cni,
    then - for a pod with host ports - portmap with the portMappings and the previous result
    (DEL in the reverse order, with the ADD result as prevResult).  Returns the last output."""
    conflist = json.loads((pod.node.dir / "net.d" / "10-agentd.conflist").read_text())
    head = {"name": conflist["name"], "cniVersion": conflist["cniVersion"]}
    netconf = dict(conflist["plugins"][0], **head)
    netconf.update(pod.netconf_extra())
    chain: list[tuple[str, dict[str, Any]]] = [("agentd-cni", netconf)]
    if pod.host_ports:
        portmap = dict(conflist["plugins"][1], **head)
        portmap["runtimeConfig"] = {"portMappings": pod.host_ports}
        chain.append((os.path.join(CNI_PLUGIN_DIR, portmap["type"]), portmap))
    if command == "DEL":
        chain.reverse()
    out = b""
    previous = pod.result if command == "DEL" else None
    for plugin, conf in chain:
        if previous is not None and plugin != "agentd-cni":
            conf = dict(conf, prevResult=previous)
        out = await _plugin(pod, plugin, conf, command)
        if command == "ADD":
            previous = json.loads(out)
    return out


def write_resolv_conf(pod: Pod, dns: dict[str, Any] | None) -> None:
    """The pod's /etc/resolv.conf, as kubelet writes a ClusterFirst pod's, from the DNS of the
    ADD result (agentd-cni gives the node-local DNS address, the search domains
    ``<ns>.svc.<domain> svc.<domain> <domain>`` and ``ndots:5``), into /etc/netns/<pod ns>/,
    which `ip netns exec` (`agentd lab exec`) mounts over /etc/resolv.conf."""
    if not dns or not dns.get("nameservers"):
        return
    lines = [f"nameserver {ns}" for ns in dns["nameservers"]]
    if dns.get("search"):
        lines.append("search " + " ".join(dns["search"]))
    if dns.get("options"):
        lines.append("options " + " ".join(dns["options"]))
    directory = Path(pod.ns.etc)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "resolv.conf").write_text("\n".join(lines) + "\n")


async def _plugin(pod: Pod, plugin: str, netconf: dict[str, Any], command: str) -> bytes:
    env = {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": pod.container_id,
        "CNI_NETNS": pod.ns.path,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": CNI_PLUGIN_DIR,
        "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE={pod.namespace};K8S_POD_NAME={pod.k8s_name}",
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
    }
    exe = binary("agentd-cni") if plugin == "agentd-cni" else plugin
    proc = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", pod.node.ns.name, exe,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    name = os.path.basename(plugin)
    try:
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(netconf).encode()), PLUGIN_TIMEOUT)
    except TimeoutError:  # a hung plugin: killed and reaped, and one line saying so
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise LabError(f"{name} {command} for {pod.name} timed out after {PLUGIN_TIMEOUT:.0f}s") from None
    if proc.returncode != 0:
        raise LabError(f"{name} {command} for {pod.name} failed: {out.decode().strip()} {err.decode().strip()}")
    return out
