"""systemd/agentd.service under a real systemd: PID 1 of a container (docker/systemd.Dockerfile:
the agent's image plus systemd, the unit copied in unchanged -- its ExecStart= path,
/usr/local/bin/agentd, is where the image links the agent, so not even that is adapted).

Two such containers and an etcd container on one Docker network of the run's shared engine
(agentd.lab.fixtures' ``docker_engine``), each with its own /etc/agentd/agentd.toml (the udp
backend), run with the engine's ``runc-bpf-caps`` runtime: Docker 20.10 can add neither CAP_BPF
nor CAP_PERFMON to a container, and without them in the container's bounding set the unit
could not keep them:

* ``systemctl start agentd`` returns once the agent sent READY=1: /readyz answers 200 and the
  blackhole route of its subnet is in the kernel at that moment; ``StatusText`` says
  ``ready: subnet ...``; the two nodes peer with each other and route to each other's subnet;
* the hardening holds: the agent runs with exactly the unit's bounding set, no_new_privs and
  a seccomp filter, carries the udp backend in BPF (CAP_BPF, bpf(), pins in the bpffs the
  test gives the container), wrote its conflist into /etc/cni/net.d, and in its mount
  namespace a write to /etc/agentd is refused;
* the pod fast path is on (CAP_PERFMON, which the unit gives): two pods attached by
  agentd-cni, as a container runtime attaches them, and a TCP transfer between them that the
  fast path carries;
* ``systemctl reload`` re-reads the configuration as docs/operations.md says: the log level
  changes live, a changed hold time is named as applied only by a restart, the PID stays;
* ``kill -9`` of the main PID: ``Restart=on-failure`` starts it again, with the same subnet,
  and the routes on both nodes are the ones before (kept through graceful restart); the new
  agent takes its predecessor's BPF programs over (the member filter on, new programs in
  place of the old; the pod fast path on, its pods adopted), with the unit's capabilities;
* SIGSTOP: past ``WatchdogSec=`` (30 s, the unit's) systemd kills it (SIGABRT, with SIGCONT)
  and restarts it;
* ``systemctl stop``: a clean exit (status 0, result success), no agent process and no API
  left, while what docs/operations.md says a graceful stop keeps stays: the kernel routes
  and /run/agentd/subnet.env;
* docs/operations.md's drop-in that takes CAP_PERFMON away, installed as ``systemctl edit``
  would: the agent starts without it (bounding and ambient sets) and the pod fast path is
  off, saying why;
* docs/operations.md's drop-in for a dedicated user in its place: the agent runs as that user
  below a root-owned, mode 0700 bpffs (as systemd mounts /sys/fs/bpf), and the BPF data path
  (taking over the root agents' pins), the member filter and the pod fast path are on; and
  /etc/cni/net.d, removed before that start, is made again by the unit, root's (not the user's).

A second test runs the unit with docs/ingress.md's drop-in for ``[ingress] enabled = true`` (the
image has Debian's haproxy, whose own service is masked): HAProxy's master root, its workers
the haproxy user's without capabilities, a request from the other node through the Ingress to
a pod and its access-log line in the agent's journal, ``systemctl reload`` and ``restart``
(the proxy adopted), and a killed master replaced without its worker left behind.
"""

from __future__ import annotations

import json
import os
import re
from ipaddress import IPv4Network
from pathlib import Path

import pytest

from agentd.lab import bpffs
from agentd.lab.dockerd import BPF_CAPS_RUNTIME, DockerEngine
from agentd.lab.netns import unique_tag
from agentd.lab.speaker_proc import render_toml
from agentd.lab.wait import until

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "172.28.61"  # the test's Docker network, inside the engine's own namespace
ETCD = f"{SUBNET}.2"
NODES = {"sd1": f"{SUBNET}.11", "sd2": f"{SUBNET}.12"}
WATCHDOG_SEC = 30
UNIT_CAPS = {"CAP_NET_ADMIN": 12, "CAP_NET_RAW": 13, "CAP_NET_BIND_SERVICE": 10, "CAP_BPF": 39, "CAP_PERFMON": 38}

# Two pods on a node, attached as a container runtime attaches them (CNI ADD through
# agentd-cni, with the pod's identity in CNI_ARGS); prints their addresses.
PODS = r'''
import json, os, subprocess
conflist = json.load(open("/etc/cni/net.d/10-agentd.conflist"))
netconf = json.dumps(dict(conflist["plugins"][0], name=conflist["name"], cniVersion=conflist["cniVersion"]))
out = {}
for name in ("pa", "pb"):
    subprocess.run(["ip", "netns", "add", name], check=True)
    env = dict(os.environ, CNI_COMMAND="ADD", CNI_CONTAINERID=name, CNI_NETNS=f"/run/netns/{name}", CNI_IFNAME="eth0",
               CNI_PATH="/opt/cni/bin:/usr/lib/cni", CNI_ARGS=f"IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name}")
    proc = subprocess.run(["agentd-cni"], input=netconf.encode(), env=env, capture_output=True)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    out[name] = json.loads(proc.stdout)["ips"][0]["address"].split("/")[0]
print(json.dumps(out))
'''
# A TCP sink in one pod, and 16 MiB sent to it from the other (connecting until the sink listens).
SINK = "import socket\ns = socket.create_server(('0.0.0.0', 5201))\nwhile True:\n    c, _ = s.accept()\n    while c.recv(1 << 16): pass\n    c.close()"
SEND = r'''
import socket, sys, time
deadline = time.monotonic() + 30
while True:
    try:
        s = socket.create_connection((sys.argv[1], 5201), timeout=5)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
s.sendall(bytes(16 << 20))
s.close()
'''


def drop_in(marker: str) -> str:
    """The docs/operations.md drop-in that holds ``marker``, exactly as the page shows it."""
    blocks = re.findall(r"    # systemctl edit agentd\n((?:    [^\n]*\n)+)", (ROOT / "docs" / "operations.md").read_text())
    (block,) = [b for b in blocks if marker in b]
    return "".join(line[4:] + "\n" for line in block.splitlines())


def perfmon_drop_in() -> str:
    """docs/operations.md's drop-in that takes CAP_PERFMON away."""
    return drop_in("~CAP_PERFMON")


class SystemdNode:
    """One container running systemd, with agentd.service installed."""

    def __init__(self, engine: DockerEngine, name: str, container: str) -> None:
        self.engine, self.name, self.container = engine, name, container

    def sh(self, *argv: str, check: bool = True, timeout: float = 120) -> str:
        return self.engine.docker("exec", self.container, *argv, check=check, timeout=timeout).stdout

    def show(self, *props: str) -> dict[str, str]:
        out = self.sh("systemctl", "show", "agentd", *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def main_pid(self) -> int:
        return int(self.show("MainPID")["MainPID"])

    def api(self, path: str) -> tuple[int, dict]:
        code = (
            "import json, sys, urllib.request, urllib.error\n"
            "try:\n"
            f"    r = urllib.request.urlopen('http://127.0.0.1:9099{path}', timeout=5); print(r.status, r.read().decode())\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.code, e.read().decode())\n"
        )
        status, _, body = self.sh("python3", "-c", code).partition(" ")
        return int(status), json.loads(body)

    def routes(self) -> set[str]:
        return {line.strip() for line in self.sh("ip", "route", "show", "proto", "143").splitlines() if line.strip()}

    def journal(self) -> str:
        return self.sh("journalctl", "-u", "agentd", "--no-pager", "-o", "cat")


@pytest.fixture
def systemd_nodes(docker_engine, tmp_path):
    engine, images = docker_engine.engine, docker_engine.images
    tag = unique_tag("")
    network = f"sd{tag}"
    made: list[str] = []
    # The nodes' /sys/fs/bpf: a bpffs of the test's own (systemd in a container mounts none).
    fs = bpffs.mount(tmp_path / "bpffs", owner=os.getpid())
    engine.docker("network", "create", "--subnet", f"{SUBNET}.0/24", network)
    try:
        etcd = f"sd{tag}-etcd"
        engine.docker(
            "run", "-d", "--name", etcd, "--network", network, "--ip", ETCD, images.etcd,
            "etcd", "--name=etcd", "--data-dir=/var/lib/etcd", "--listen-client-urls=http://0.0.0.0:2379",
            f"--advertise-client-urls=http://{ETCD}:2379",
        )  # fmt: skip
        made.append(etcd)
        nodes = {}
        for name, address in NODES.items():
            config = tmp_path / f"{name}.toml"
            config.write_text(node_config(name, address))
            container = f"sd{tag}-{name}"
            engine.docker(
                "run", "-d", "--name", container, "--hostname", name, "--network", network, "--ip", address,
                # systemd as PID 1 (the recipe), and what the agent needs of the host
                "--cap-add", "SYS_ADMIN", "--tmpfs", "/run", "--tmpfs", "/run/lock",
                "-v", "/sys/fs/cgroup:/sys/fs/cgroup:ro",
                "--cap-add", "NET_ADMIN", "--device", "/dev/net/tun", "--sysctl", "net.ipv4.ip_forward=1",
                # CAP_BPF and CAP_PERFMON, which Docker 20.10 cannot add (docker/runc-bpf-caps),
                # and a bpffs
                "--runtime", BPF_CAPS_RUNTIME, "-v", f"{fs}:/sys/fs/bpf",
                "-v", f"{config}:/etc/agentd/agentd.toml:ro",
                images.systemd,
            )  # fmt: skip
            made.append(container)
            nodes[name] = SystemdNode(engine, name, container)
        for node in nodes.values():
            until(lambda n=node: n.sh("systemctl", "is-system-running", check=False).strip() in ("running", "degraded"),
                  90, what=f"{node.name}: systemd booted", interval=0.3)  # fmt: skip
            state = node.sh("systemctl", "is-system-running", check=False).strip()
            assert state == "running", node.sh("systemctl", "--failed", "--no-pager", check=False)
        yield nodes
    finally:
        if made:
            engine.docker("rm", "-f", "-v", *made, check=False)
        engine.docker("network", "rm", network, check=False)
        bpffs.umount(fs)


def diagnose(*nodes: SystemdNode) -> str:
    out = []
    for n in nodes:
        try:
            status = n.api("/status")[1]
            out.append(f"{n.name}: routes {sorted(n.routes())} peers {[(p['address'], p['state'], p.get('backend'), p.get('datapath')) for p in status['bgp']['peers']]} "
                       f"active {status['backends'].get('active')} journal tail {n.journal()[-1500:]}")
        except Exception as err:  # noqa: BLE001 - a diagnosis
            out.append(f"{n.name}: {err}")
    return "\n".join(out)


def node_config(name: str, address: str, **extra: dict) -> str:
    cfg = {
        "node": {"name": name, "address": address},
        "etcd": {"endpoints": [f"http://{ETCD}:2379"]},
        "network": {"backend": "vxlan"},  # with the BPF member filter: the unit's CAP_BPF and bpf() at work
        "bgp": {"hold_time": 9, "connect_retry": 2.0},
        "log": {"level": "info"},
    }
    for section, keys in extra.items():
        cfg.setdefault(section, {}).update(keys)
    return render_toml(cfg)


# The first test of a run builds the images (a cold cache: mmdebstrap, about a minute).
@pytest.mark.timeout(900)
def test_the_unit_under_systemd(systemd_nodes, tmp_path):
    sd1, sd2 = systemd_nodes["sd1"], systemd_nodes["sd2"]
    unit = sd1.sh("cat", "/etc/systemd/system/agentd.service")
    assert unit == (ROOT / "systemd" / "agentd.service").read_text()  # as shipped, ExecStart included

    # -- start: returns once READY=1 is in, the node routable at that moment
    sd2.sh("systemctl", "start", "agentd")
    sd1.sh("systemctl", "start", "agentd")
    code, ready = sd1.api("/readyz")
    props = sd1.show("ActiveState", "SubState", "StatusText", "NRestarts")
    assert code == 200 and ready["ready"], ready
    assert props["ActiveState"] == "active" and props["SubState"] == "running", props
    subnet = sd1.api("/status")[1]["node"]["subnet"]
    assert props["StatusText"] == f"ready: subnet {subnet}", props
    assert any(r.startswith(f"blackhole {subnet}") for r in sd1.routes()), sd1.routes()

    # -- the two nodes peer and route to each other's subnet
    subnets = {n.name: n.api("/status")[1]["node"]["subnet"] for n in (sd1, sd2)}

    def peered() -> bool:
        return all(
            [p["state"] for p in n.api("/peers")[1]] == ["Established"]
            and any(r.startswith(subnets[o.name]) and "dev agentd.vxlan" in r for r in n.routes())
            for n, o in ((sd1, sd2), (sd2, sd1))
        )  # fmt: skip

    until(peered, 60, what="sd1 and sd2 Established, each with a route to the other's subnet", interval=0.3)

    # -- the hardening holds
    pid = sd1.main_pid()
    status = dict(line.split(":\t", 1) for line in sd1.sh("cat", f"/proc/{pid}/status").splitlines() if ":\t" in line)
    assert int(status["CapBnd"], 16) == sum(1 << c for c in UNIT_CAPS.values()), status["CapBnd"]
    backends = sd1.api("/status")[1]["backends"]
    assert backends["active"]["vxlan"]["datapath"] == "vxlan-device" and backends["bpf"]["active"], backends
    assert backends["member_filter"]["bpf"] == ["vxlan"] and not backends["member_filter"]["missing"], backends
    programs = backends["bpf"]["programs"]
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2", status
    assert "10-agentd.conflist" in sd1.sh("ls", "/etc/cni/net.d")
    write = sd1.engine.docker(
        "exec", sd1.container, "nsenter", f"--target={pid}", "--mount", "sh", "-c", "echo x > /etc/agentd/written-by-test",
        check=False,
    )  # fmt: skip
    assert write.returncode != 0 and "Read-only file system" in write.stderr, write
    assert "written-by-test" not in sd1.sh("ls", "/etc/agentd")

    # -- the pod fast path, which reads conntrack's nf_conn (CAP_PERFMON): on, carrying pod TCP
    fast = sd1.api("/status")[1]["policy"]["fast_path"]
    assert fast["on"] and fast["between_nodes"]["on"], fast
    pods = json.loads(sd1.sh("python3", "-c", PODS))
    until(lambda: sd1.api("/status")[1]["policy"]["fast_path"]["pods"] == 2, 30, what="sd1's fast path on both pods",
          interval=0.3)  # fmt: skip
    sd1.engine.docker("exec", "-d", sd1.container, "ip", "netns", "exec", "pb", "python3", "-c", SINK)
    sd1.sh("ip", "netns", "exec", "pa", "python3", "-c", SEND, pods["pb"])

    def carried() -> int:
        return sd1.api("/status")[1]["policy"]["fast_path"]["packets"].get("carried", 0)

    until(lambda: carried() > 100, 30, what=lambda: f"the transfer carried by the fast path: {carried()}", interval=0.3)

    # -- reload: SIGHUP re-reads the file; [log] live, the rest named for a restart
    (tmp_path / "sd1.toml").write_text(
        node_config("sd1", NODES["sd1"], log={"level": "debug"}, bgp={"hold_time": 12})
    )  # same inode: the bind mount sees it
    sd1.sh("systemctl", "reload", "agentd")
    until(lambda: "debug logging is on" in sd1.journal(), 30, what="the reload in sd1's journal", interval=0.3)
    journal = sd1.journal()
    assert "changed but applied only by a restart: [bgp] hold_time" in journal, journal[-3000:]
    assert sd1.main_pid() == pid and sd1.show("ActiveState")["ActiveState"] == "active"
    # A file with a problem: ExecReload='s check-config fails `systemctl reload` with it, and no
    # SIGHUP goes to the agent.
    good = node_config("sd1", NODES["sd1"], log={"level": "debug"}, bgp={"hold_time": 12})
    (tmp_path / "sd1.toml").write_text(node_config("sd1", NODES["sd1"], bgp={"hold_time": 2}))
    refused = sd1.engine.docker("exec", sd1.container, "systemctl", "reload", "agentd", check=False, timeout=120)
    assert refused.returncode != 0, (refused.stdout, refused.stderr)
    journal = sd1.journal()
    assert "[bgp] hold_time = 2: must be 0 or at least 3" in journal, journal[-3000:]
    assert "reload failed" not in journal and sd1.main_pid() == pid
    # Peers valid in the file but not with the running [node] route_reflector (restart-only): the
    # reload goes through, the peers are not applied, and `systemctl status` says so until a
    # reload succeeds.
    (tmp_path / "sd1.toml").write_text(node_config(
        "sd1", NODES["sd1"], node={"route_reflector": True}, log={"level": "debug"},
        bgp={"hold_time": 12, "peers": [{"address": f"{SUBNET}.99", "asn": 64512, "rr_client": True}]}))
    sd1.sh("systemctl", "reload", "agentd")
    until(lambda: "; last reload failed: the new [[bgp.peers]]" in sd1.show("StatusText")["StatusText"], 30,
          what=lambda: f"the refused peers in sd1's STATUS=: {sd1.show('StatusText')}", interval=0.3)
    assert f"{SUBNET}.99" not in json.dumps(sd1.api("/status")[1])
    (tmp_path / "sd1.toml").write_text(good)
    sd1.sh("systemctl", "reload", "agentd")
    until(lambda: sd1.show("StatusText")["StatusText"] == f"ready: subnet {subnet}", 30,
          what=lambda: f"sd1's STATUS= cleared by a good reload: {sd1.show('StatusText')}", interval=0.3)
    assert sd1.main_pid() == pid

    # -- kill -9: Restart= brings it back with the same subnet; the routes stay throughout
    routes = {n.name: n.routes() for n in (sd1, sd2)}
    restarts = int(sd1.show("NRestarts")["NRestarts"])
    sd1.sh("kill", "-9", str(pid))
    assert sd1.routes() == routes["sd1"] and sd2.routes() == routes["sd2"]  # agent dead: the kernel keeps them

    def restarted() -> bool:
        p = sd1.show("ActiveState", "NRestarts", "MainPID")
        return p["ActiveState"] == "active" and int(p["NRestarts"]) > restarts and int(p["MainPID"]) not in (0, pid)

    until(restarted, 60, what="sd1's agent restarted by Restart=on-failure", interval=0.2)
    until(lambda: sd1.api("/readyz")[0] == 200, 90, what="sd1 ready again (peers' End-of-RIB)", interval=0.3)
    assert sd1.api("/status")[1]["node"]["subnet"] == subnet
    until(peered, 60, what=lambda: f"sd1 and sd2 Established again: {diagnose(sd1, sd2)}", interval=0.3)
    assert sd1.routes() == routes["sd1"] and sd2.routes() == routes["sd2"]
    # The new agent took its predecessor's programs over with the unit's capabilities: by the
    # pins of their tcx links, not by their ids (which would take CAP_SYS_ADMIN).
    backends = sd1.api("/status")[1]["backends"]
    assert backends["member_filter"] == {"bpf": ["vxlan"], "userspace": [], "missing": {}}, backends
    assert backends["bpf"]["hook"] == "tcx" and backends["bpf"]["unidentified_programs"] == [], backends["bpf"]
    assert {p["id"] for p in backends["bpf"]["programs"].values()}.isdisjoint(p["id"] for p in programs.values())
    view = sd1.api("/status")[1]["policy"]["fast_path"]
    assert view["on"] and view["pods"] == 2 and view["adopted_maps"] and view["program"]["id"] != fast["program"]["id"], view

    # -- SIGSTOP: no watchdog pings; past WatchdogSec systemd kills it and starts it again
    assert sd1.show("WatchdogUSec")["WatchdogUSec"] == f"{WATCHDOG_SEC}s"
    pid, restarts = sd1.main_pid(), int(sd1.show("NRestarts")["NRestarts"])
    sd1.sh("kill", "-STOP", str(pid))
    until(restarted, WATCHDOG_SEC + 60, what="sd1's frozen agent killed by the watchdog and restarted", interval=0.5)
    journal = sd1.journal()
    assert "Watchdog timeout" in journal, journal[-3000:]
    until(lambda: sd1.api("/readyz")[0] == 200, 90, what="sd1 ready after the watchdog restart", interval=0.3)

    # -- stop: a clean exit; the graceful stop keeps routes and the subnet file, as documented
    pid = sd1.main_pid()
    sd1.sh("systemctl", "stop", "agentd")
    props = sd1.show("ActiveState", "Result", "ExecMainStatus")
    assert props["ActiveState"] == "inactive" and props["Result"] == "success", props
    assert props["ExecMainStatus"] == "0", props
    assert "agentd.service: Deactivated successfully." in sd1.sh("journalctl", "--no-pager", "-o", "cat")
    assert sd1.sh("sh", "-c", f"test -e /proc/{pid} && echo alive || echo gone").strip() == "gone"
    assert not re.search(r"agentd run", sd1.sh("ps", "-eo", "args"))
    assert sd1.sh("sh", "-c", "ss -ltn | grep -c ':9099 ' || true").strip() == "0"
    assert any(r.startswith(subnets["sd2"]) for r in sd1.routes()), sd1.routes()
    gateway = IPv4Network(subnet).network_address + 1
    assert f"AGENTD_SUBNET={gateway}/" in sd1.sh("cat", "/run/agentd/subnet.env")

    # -- docs/operations.md's drop-in takes CAP_PERFMON away: the fast path is off, saying why
    sd1.engine.docker("exec", "-i", sd1.container, "sh", "-c",
                      "mkdir -p /etc/systemd/system/agentd.service.d && "
                      "cat > /etc/systemd/system/agentd.service.d/override.conf", input=perfmon_drop_in())  # fmt: skip
    sd1.sh("systemctl", "daemon-reload")
    sd1.sh("systemctl", "start", "agentd")
    status = dict(line.split(":\t", 1) for line in sd1.sh("cat", f"/proc/{sd1.main_pid()}/status").splitlines()
                  if ":\t" in line)  # fmt: skip
    without = sum(1 << c for name, c in UNIT_CAPS.items() if name != "CAP_PERFMON")
    assert (int(status["CapBnd"], 16), int(status["CapAmb"], 16)) == (without, without), status
    fast = sd1.api("/status")[1]["policy"]["fast_path"]
    assert not fast["on"] and fast["error"].startswith("the pod fast path needs CAP_PERFMON, which this agent lacks"), fast

    # -- docs/operations.md's drop-in for a dedicated user, in place of that one: the agent runs
    #    as the user, and the BPF parts stay on (the bpffs is root's, mode 0700, as systemd
    #    mounts it), taking over the pins the root agents left
    sd1.sh("systemctl", "stop", "agentd")
    sd1.sh("useradd", "--system", "--user-group", "--no-create-home", "agentd")
    # A node whose CNI directory is not there yet (the agent started before the runtime made
    # it): the unit makes it, and root's, not the agent user's (ConfigurationDirectory= would
    # chown a directory it makes to User=, handing every CNI network's configuration to it).
    sd1.sh("rm", "-rf", "/etc/cni/net.d")
    sd1.engine.docker("exec", "-i", sd1.container, "sh", "-c",
                      "cat > /etc/systemd/system/agentd.service.d/override.conf", input=drop_in("User=agentd"))  # fmt: skip
    sd1.sh("systemctl", "daemon-reload")
    sd1.sh("systemctl", "start", "agentd")
    assert sd1.sh("stat", "-c", "%U %a", "/sys/fs/bpf").split() == ["root", "1700"]
    assert sd1.sh("stat", "-c", "%U %G %a", "/etc/cni/net.d").split() == ["root", "root", "755"]
    status = dict(line.split(":\t", 1) for line in sd1.sh("cat", f"/proc/{sd1.main_pid()}/status").splitlines()
                  if ":\t" in line)  # fmt: skip
    assert status["Uid"].split()[1] == sd1.sh("id", "-u", "agentd").strip(), status["Uid"]
    state = sd1.api("/status")[1]
    backends, fast = state["backends"], state["policy"]["fast_path"]
    assert backends["bpf"]["active"] and backends["member_filter"]["bpf"] == ["vxlan"], (backends, sd1.journal()[-3000:])
    assert fast["on"] and fast["pods"] == 2, fast  # (the agent before had none: no CAP_PERFMON)
    opened = [line for line in sd1.journal().splitlines() if "BPF data path on" in line]
    assert "adopted the pinned maps" in opened[-1], opened
    assert sd1.api("/readyz")[0] == 200


# -- Ingress under the unit ---------------------------------------------------------------

CAP_KILL, CAP_SETGID, CAP_SETUID = 5, 6, 7
# A pod of the Service, attached by agentd-cni with its labels and named port as a runtime
# passes them (args.cni.labels, runtimeConfig.containerPorts); prints its address.
WEB_POD = r'''
import json, os, subprocess
conflist = json.load(open("/etc/cni/net.d/10-agentd.conflist"))
netconf = dict(conflist["plugins"][0], name=conflist["name"], cniVersion=conflist["cniVersion"],
               args={"cni": {"labels": [{"key": "app", "value": "web"}]}},
               runtimeConfig={"containerPorts": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]})
subprocess.run(["ip", "netns", "add", "web"], check=True)
env = dict(os.environ, CNI_COMMAND="ADD", CNI_CONTAINERID="web", CNI_NETNS="/run/netns/web", CNI_IFNAME="eth0",
           CNI_PATH="/opt/cni/bin:/usr/lib/cni", CNI_ARGS="IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-1")
proc = subprocess.run(["agentd-cni"], input=json.dumps(netconf).encode(), env=env, capture_output=True)
assert proc.returncode == 0, (proc.stdout, proc.stderr)
print(json.loads(proc.stdout)["ips"][0]["address"].split("/")[0])
'''
WEB_MANIFESTS = [
    {"apiVersion": "networking.k8s.io/v1", "kind": "IngressClass", "metadata": {"name": "agentd"},
     "spec": {"controller": "agentd.io/ingress-controller"}},
    {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "shop"},
     "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}},
    {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": "web", "namespace": "shop"},
     "spec": {"ingressClassName": "agentd", "rules": [{"host": "web.example", "http": {"paths": [
         {"path": "/", "pathType": "Prefix", "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}]}},
    {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "agentd-ingress", "namespace": "kube-system"},
     "data": {"enable-access-log": "true"}},
]  # fmt: skip
# The pod's HTTP server: the same answer to every GET.
WEB = r'''
import http.server
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"served-by-web-1\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("0.0.0.0", 8080), Handler).serve_forever()
'''
# One request to the node's Ingress address (from the other node): status and body.
GET = r'''
import sys, urllib.request
r = urllib.request.urlopen(urllib.request.Request(sys.argv[1], headers={"Host": "web.example"}), timeout=10)
print(r.status, r.read().decode().strip())
'''


def ingress_drop_in() -> str:
    """docs/ingress.md's drop-in for a node with [ingress] enabled, exactly as the page shows it."""
    (block,) = re.findall(r"    # /etc/systemd/system/agentd\.service\.d/ingress\.conf\n((?:    [^\n]*\n)+)",
                          (ROOT / "docs" / "ingress.md").read_text())  # fmt: skip
    return "".join(line[4:] + "\n" for line in block.splitlines())


def proc_status(node: SystemdNode, pid: int) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in node.sh("cat", f"/proc/{pid}/status").splitlines())}


@pytest.mark.timeout(900)
def test_ingress_under_the_unit(systemd_nodes, tmp_path):
    """docs/ingress.md's drop-in ("Under the systemd unit") on the shipped unit, [ingress]
    enabled, [ingress] user not set (the haproxy user of Debian's package): HAProxy's master
    runs as root, its workers as haproxy with no capability; a request through the Ingress
    reaches the pod, and its access-log line the agent, through the socket in the proxy's
    directory (0710, the haproxy group's); ``systemctl reload`` keeps the proxy, and ``systemctl
    restart`` leaves it serving for the next agent, which adopts it."""
    sd1, sd2 = systemd_nodes["sd1"], systemd_nodes["sd2"]
    (tmp_path / "sd1.toml").write_text(node_config("sd1", NODES["sd1"], ingress={"enabled": True}))
    sd1.engine.docker("exec", "-i", sd1.container, "sh", "-c",
                      "mkdir -p /etc/systemd/system/agentd.service.d && "
                      "cat > /etc/systemd/system/agentd.service.d/ingress.conf", input=ingress_drop_in())  # fmt: skip
    sd1.sh("systemctl", "daemon-reload")
    sd1.sh("systemctl", "start", "agentd")
    assert sd1.api("/readyz")[0] == 200

    address = sd1.sh("python3", "-c", WEB_POD).strip()
    sd1.engine.docker("exec", "-d", sd1.container, "ip", "netns", "exec", "web", "python3", "-c", WEB)
    manifests = "\n---\n".join(json.dumps(m) for m in WEB_MANIFESTS)
    sd1.engine.docker("exec", "-i", sd1.container, "agentd", "apply", "-f", "-", input=manifests)

    def view() -> dict:
        return sd1.api("/ingress")[1]

    def serving() -> bool:
        v = view()
        return v["running"] and any(b["servers"] == [f"{address}:8080"] for b in v["backends"])

    until(serving, 60, what=lambda: f"sd1's proxy serving web-1: {view()} {sd1.journal()[-3000:]}", interval=0.3)
    url = f"http://{NODES['sd1']}/via-systemd"
    assert sd2.sh("python3", "-c", GET, url).split() == ["200", "served-by-web-1"]

    # -- the processes: the master root (the unit's capabilities and the drop-in's), the
    #    workers haproxy's with none; both under the unit's seccomp filter and no_new_privs
    v = view()
    assert v["error"] is None and v["access_log"]["error"] is None, v
    master, worker = proc_status(sd1, v["pid"]), proc_status(sd1, v["worker"])
    haproxy_uid, haproxy_gid = sd1.sh("id", "-u", "haproxy").strip(), sd1.sh("id", "-g", "haproxy").strip()
    bounding = sum(1 << c for c in UNIT_CAPS.values()) | 1 << CAP_SETUID | 1 << CAP_SETGID | 1 << CAP_KILL
    assert master["Uid"].split() == ["0"] * 4 and int(master["CapBnd"], 16) == bounding, master
    assert worker["Uid"].split() == [haproxy_uid] * 4 and worker["Gid"].split() == [haproxy_gid] * 4, worker
    assert worker["Groups"] == "", worker  # the agent's supplementary group (haproxy) dropped too
    for caps in ("CapEff", "CapPrm", "CapAmb"):
        assert int(worker[caps], 16) == 0, (caps, worker)
    # The inheritable set keeps what the unit's AmbientCapabilities= put there (a set uid
    # does not clear it): under no_new_privs no exec can make a capability of it again, and
    # with none permitted none can be raised to ambient (docs/ingress.md).
    assert int(worker["CapInh"], 16) == int(master["CapInh"], 16) == sum(1 << c for c in UNIT_CAPS.values()), worker
    for st in (master, worker):
        assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2", st
    assert sd1.sh("stat", "-c", "%U %G %a", "/var/lib/agentd/ingress").split() == ["root", "haproxy", "710"]
    assert sd1.sh("stat", "-c", "%U %a", "/var/lib/agentd/ingress/log.sock").split() == ["root", "622"]

    # -- the access log: the worker's line through the socket into the agent's journal
    def logged(path: str) -> bool:
        return any(f"GET {path} " in line for line in sd1.journal().splitlines())

    until(lambda: logged("/via-systemd"), 20, what=lambda: f"the access-log line in sd1's journal: {sd1.journal()[-2000:]}",
          interval=0.3)  # fmt: skip
    def requests_2xx() -> float:
        text = sd1.sh("python3", "-c", "import urllib.request; "
                      "print(urllib.request.urlopen('http://127.0.0.1:9099/metrics').read().decode())")  # fmt: skip
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("agentd_ingress_requests_total{") and 'code="2xx"' in line and 'service="web"' in line)  # fmt: skip

    until(lambda: requests_2xx() >= 1, 20, what=lambda: f"agentd_ingress_requests_total 2xx of web: {requests_2xx()}",
          interval=0.5)  # fmt: skip
    journal = sd1.journal()
    assert "HAProxy's workers run as root" not in journal and "cannot" not in journal.split("Started agentd")[-1], journal[-3000:]

    # -- reload: the agent re-reads its file, the proxy (master and worker) stays
    pid, reloads = sd1.main_pid(), sd1.journal().count("configuration reloaded")
    sd1.sh("systemctl", "reload", "agentd")
    until(lambda: sd1.journal().count("configuration reloaded") > reloads, 20,
          what=lambda: f"the reload in sd1's journal: {sd1.journal()[-1500:]}", interval=0.3)  # fmt: skip
    assert sd1.main_pid() == pid and (view()["pid"], view()["worker"]) == (v["pid"], v["worker"])
    assert sd2.sh("python3", "-c", GET, url + "-reloaded").split() == ["200", "served-by-web-1"]

    # -- restart: the proxy serves on (KillMode=process) and the next agent adopts it
    sd1.sh("systemctl", "restart", "agentd")
    assert sd1.main_pid() != pid
    after = view()
    assert after["running"] and after["adopted"] and (after["pid"], after["worker"]) == (v["pid"], v["worker"]), after
    assert sd2.sh("python3", "-c", GET, url + "-restarted").split() == ["200", "served-by-web-1"]
    until(lambda: logged("/via-systemd-restarted"), 20, what="the access-log line after the restart in sd1's journal",
          interval=0.3)  # fmt: skip
    assert "adopted the running HAProxy" in sd1.journal()

    # -- the master killed: the agent starts a new one; the old worker does not stay on the
    #    listening sockets (ended by the agent, CAP_KILL, or by itself once its master is gone)
    sd1.sh("kill", "-9", str(v["pid"]))
    until(lambda: view()["running"] and view()["pid"] not in (None, v["pid"]), 60,
          what=lambda: f"a new HAProxy on sd1: {view()}", interval=0.3)  # fmt: skip
    until(lambda: sd1.sh("sh", "-c", f"test -d /proc/{v['worker']} && echo alive || echo gone").strip() == "gone", 20,
          what="the dead master's worker gone", interval=0.3)  # fmt: skip
    assert proc_status(sd1, view()["worker"])["Uid"].split()[0] == haproxy_uid
    until(lambda: serving() and view()["error"] is None, 30, what=lambda: f"sd1's new proxy serving: {view()}",
          interval=0.3)  # fmt: skip
    assert sd2.sh("python3", "-c", GET, url + "-new-master").split() == ["200", "served-by-web-1"]
