"""Packaging (the wheel, the Debian package) and the container lab (compose), with the tools they need.

* compose.yaml passes Debian's ``docker-compose config`` (no engine needed), describes etcd
  and three nodes with their pods the way docker/agentd-node expects, and every AGENTD_*
  variable it sets is a real configuration key (``agentd check-config`` accepts them).
* docker/agentd-node, the compose nodes' entrypoint, does its job for real -- minus Docker:
  two node namespaces and two "pod" namespaces stand in for the containers (POD_NETNS),
  a real etcd serves the pod registry, and each entrypoint runs `agentd run`, attaches its
  pod through agentd-cni and pings the other pod.
* A wheel built from the tree (``pip wheel``; build isolation fetches setuptools from the
  package index) carries the agentd and agentd-cni entry points, and installed into a
  fresh virtualenv they run: ``agentd --version``, ``agentd check-config``, ``agentd-cni``
  VERSION.
* docs/architecture.svg is what Graphviz renders from docs/architecture.dot.

``docker build`` and ``docker-compose up`` on a real engine: tests/system/test_compose_lab.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
import zipfile
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

from agentd.lab.etcd import EtcdServer
from agentd.lab.netns import veth
from agentd.lab.wait import auntil

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def compose_config(**env: str) -> dict:
    """``docker-compose -f compose.yaml config``, parsed (Debian's docker-compose brings PyYAML
    to the system Python; the project venv has no YAML parser and needs none)."""
    proc = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "compose.yaml"), "config"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "AGENTD_BACKEND"} | env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    to_json = subprocess.run(
        ["/usr/bin/python3", "-c", "import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))"],
        input=proc.stdout, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(to_json.stdout)


def test_compose_config_passes_and_mirrors_the_lab():
    doc = compose_config()
    services = doc["services"]
    nodes = sorted(n for n in services if n.startswith("node") and not n.endswith("-pod"))
    assert nodes == ["node1", "node2", "node3"]
    assert set(services) == {"etcd", *nodes, *(f"{n}-pod" for n in nodes)}
    subnet = IPv4Network(doc["networks"]["underlay"]["ipam"]["config"][0]["subnet"])
    etcd_ip = services["etcd"]["networks"]["underlay"]["ipv4_address"]
    assert IPv4Address(etcd_ip) in subnet
    assert f"--advertise-client-urls=http://{etcd_ip}:2379" in services["etcd"]["command"]
    addresses = {etcd_ip}
    for name in nodes:
        node = services[name]
        env = node["environment"]
        address = node["networks"]["underlay"]["ipv4_address"]
        assert IPv4Address(address) in subnet and address not in addresses
        addresses.add(address)
        assert env["AGENTD_NODE_NAME"] == name and env["AGENTD_NODE_ADDRESS"] == address
        assert env["AGENTD_ETCD_ENDPOINTS"] == f"http://{etcd_ip}:2379"
        assert env["AGENTD_NETWORK_BACKEND"] == "host-gw"
        assert int(env["EXPECT_PODS"]) == len(nodes)
        assert {"NET_ADMIN", "NET_RAW"} <= set(node["cap_add"])
        assert node["command"] == ["agentd-node"]
        assert node["restart"] == "on-failure" and node["pid"] == f"service:{name}-pod"
        assert "/dev/net/tun" in node["devices"]
        assert node["sysctls"]["net.ipv4.ip_forward"] == "1"
        pod = services[f"{name}-pod"]
        assert pod["network_mode"] == "none" and pod["init"] is True
        assert pod["image"] == node["image"]

    # AGENTD_BACKEND picks the backend; every AGENTD_* the nodes get is a real key.
    vx = compose_config(AGENTD_BACKEND="vxlan")["services"]["node2"]["environment"]
    assert vx["AGENTD_NETWORK_BACKEND"] == "vxlan"
    agentd_env = {k: v for k, v in vx.items() if k.startswith("AGENTD_")}
    proc = subprocess.run(
        [str(VENV_BIN / "agentd"), "check-config", "--config", str(ROOT / "etc" / "agentd.toml")],
        env={k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")} | agentd_env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0 and "configuration OK" in proc.stdout, proc.stderr


# ------------------------------------------------------------------ docker/agentd-node


async def test_compose_entrypoint_attaches_pods_and_pings(netns_factory, tmp_path):
    ul = netns_factory("ul")
    etcd_ns = netns_factory("etcd")
    ul.ip("link", "add", "br0", "type", "bridge")
    ul.ip("link", "set", "br0", "up")
    veth(etcd_ns, "eth0", ul, "etcd0")
    ul.ip("link", "set", "etcd0", "master", "br0")
    etcd_ns.ip("addr", "add", "192.0.2.2/24", "dev", "eth0")
    etcd = EtcdServer(
        str(tmp_path / "etcd"), netns=etcd_ns, host="192.0.2.2", client_port=2379, peer_port=2380,
        log_path=str(tmp_path / "etcd.log"),
    )  # fmt: skip
    await etcd.start()
    procs: dict[str, subprocess.Popen] = {}
    envs: dict[str, dict[str, str]] = {}
    namespaces = {}
    logs: dict[str, Path] = {}
    try:
        for i in (1, 2):
            name = f"node{i}"
            node, pod = netns_factory(name), netns_factory(f"{name}-pod")
            namespaces[name] = node
            veth(node, "eth0", ul, f"n{i}")
            ul.ip("link", "set", f"n{i}", "master", "br0")
            node.ip("addr", "add", f"192.0.2.1{i}/24", "dev", "eth0")
            node.sysctl("net.ipv4.ip_forward", 1)
            d = tmp_path / name
            d.mkdir()
            (d / "agentd.toml").write_text("")  # everything comes from the environment, as in compose.yaml
            env = {
                "PATH": f"{VENV_BIN}:/usr/sbin:/usr/bin:/sbin:/bin",
                "AGENTD_CONFIG": str(d / "agentd.toml"),
                "AGENTD_NODE_NAME": name,
                "AGENTD_NODE_ADDRESS": f"192.0.2.1{i}",
                "AGENTD_ETCD_ENDPOINTS": "http://192.0.2.2:2379",
                "AGENTD_BGP_HOLD_TIME": "9",
                "AGENTD_BGP_CONNECT_RETRY": "2",
                "AGENTD_CNI_CONF_DIR": str(d / "net.d"),
                "AGENTD_CNI_BIN_DIR": "/usr/lib/cni",
                "AGENTD_CNI_SUBNET_FILE": str(d / "subnet.env"),
                "AGENTD_CNI_DATA_DIR": str(d / "cni"),
                "AGENTD_CNI_IPAM_DATA_DIR": str(d / "ipam"),
                "AGENTD_AGENT_STATE_DIR": str(d / "state"),
                "POD_NETNS": pod.path,
                "EXPECT_PODS": "2",
                "GRPC_ENABLE_FORK_SUPPORT": "0",  # the image's ENV
            }
            logs[name] = d / "entrypoint.log"
            with open(logs[name], "wb") as out:
                procs[name] = node.popen(
                    [sys.executable, str(ROOT / "docker" / "agentd-node")],
                    env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            envs[name] = env

        def done() -> bool:
            return all("every pod reaches every other pod" in p.read_text() for p in logs.values())

        def exited() -> str | None:
            if all(p.poll() is None for p in procs.values()):
                return None
            return f"an entrypoint exited: { {n: p.read_text()[-2000:] for n, p in logs.items()} }"

        await auntil(done, 120, interval=0.2, abort=exited,
                     what=lambda: f"every pod reaching every other: { {n: p.read_text()[-2000:] for n, p in logs.items()} }")
        texts = {n: p.read_text() for n, p in logs.items()}
        for name, text in texts.items():
            other = "node2" if name == "node1" else "node1"
            assert f"pod {name}-pod attached: 10.244." in text
            assert f"-> {other}-pod (10.244." in text and ": ok" in text

        # `agentd-node ping` on demand, as `docker-compose exec node1 agentd-node ping`.
        ping = subprocess.run(
            ["ip", "netns", "exec", namespaces["node1"].name, sys.executable, str(ROOT / "docker" / "agentd-node"), "ping"],
            env=envs["node1"], capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert ping.returncode == 0, ping.stdout + ping.stderr
        assert "-> node2-pod" in ping.stdout

        # SIGTERM goes to the agent, which stops gracefully; the entrypoint exits with its status.
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for name, p in procs.items():
            assert p.wait(timeout=30) == 0, logs[name].read_text()
        assert "graceful restart" in logs["node1"].read_text()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        await etcd.stop()


# ------------------------------------------------------------------ the wheel


def test_wheel_has_both_entry_points_and_they_run(tmp_path):
    # Build from a copy of the sources: the build writes build/ and *.egg-info next to them.
    src = tmp_path / "src"
    src.mkdir()
    for item in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / item, src / item)
    for package in ("proto", "bgp", "agentd"):  # not the checkout's in-place build of the C file
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.bpf.o"))
    dist = tmp_path / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(dist), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = dist.glob("agentd-*.whl")
    version = PYPROJECT["project"]["version"]
    # A platform wheel: it carries the data plane's C fast path, built by pip.
    assert re.fullmatch(rf"agentd-{re.escape(version)}-cp3\d+-cp3\d+-linux_\w+\.whl", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = zf.read(f"agentd-{version}.dist-info/entry_points.txt").decode()
    assert "agentd = agentd.entry:agentd" in entry_points
    assert "agentd-cni = agentd.entry:agentd_cni" in entry_points
    for module in ("agentd/entry.py", "agentd/cli.py", "agentd/cni/plugin.py", "agentd/dataplane/worker.py", "bgp/__init__.py", "proto/__init__.py"):
        assert module in names
    assert not [n for n in names if n.startswith("tests/")]
    assert [n for n in names if re.fullmatch(r"agentd/dataplane/_fastpath\.cpython-.*\.so", n)], names
    # ...and the BPF data path, compiled by setup.py with clang for the BPF target.
    assert {"agentd/dataplane/bpf/datapath.bpf.o", "agentd/dataplane/bpf/datapath.c"} <= set(names), names
    # ...and the browser view's assets (/ui/ works offline: nothing comes from elsewhere).
    ui = {"agentd/ui/index.html", "agentd/ui/app.js", "agentd/ui/style.css", "agentd/ui/icon.svg"}
    assert ui <= set(names), sorted(ui - set(names))

    # Installed into a fresh venv (no index: the wheel only; its dependencies are borrowed
    # from the project's venv through a .pth file, since this machine has no general internet).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    deps = subprocess.run(
        [sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index",
         "--quiet", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    Path(purelib, "project-deps.pth").write_text(deps + "\n")
    bin_ = venv / "bin"
    env = {"PATH": f"{bin_}:/usr/sbin:/usr/bin:/sbin:/bin"}

    out = subprocess.run([str(bin_ / "agentd"), "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"agentd {version}", out.stdout + out.stderr
    where = subprocess.run(
        [str(bin_ / "python"), "-c", "import agentd; print(agentd.__path__[0])"],
        capture_output=True, text=True, env=env, check=True, cwd=tmp_path,  # not the checkout's agentd/
    ).stdout.strip()  # fmt: skip
    assert where.startswith(purelib), f"agentd imported from {where}, not the installed wheel"
    fast = subprocess.run(
        [str(bin_ / "python"), "-c", "from agentd.dataplane import _fast; lib, why = _fast.load(); print(lib._name, why)"],
        capture_output=True, text=True, env=env, check=True, cwd=tmp_path,
    ).stdout.strip()  # fmt: skip
    assert fast.startswith(purelib) and "_fastpath" in fast, fast
    check_bpf = ("from agentd.dataplane.bpf import OBJECT, layout, libbpf, podpath\n"
                 "with libbpf.BpfObject(OBJECT) as o: layout.check(o.maps, o.programs)\n"
                 "with libbpf.BpfObject(podpath.OBJECT) as o: podpath.check(o)\n"
                 "print(OBJECT)")
    bpf_object = subprocess.run([str(bin_ / "python"), "-c", check_bpf], capture_output=True, text=True, env=env,
                                check=True, cwd=tmp_path).stdout.strip()
    assert bpf_object.startswith(purelib), bpf_object
    out = subprocess.run(
        [str(bin_ / "agentd"), "check-config", "--config", str(ROOT / "etc" / "agentd.toml"),
         "--set", "node.address=192.0.2.10", "--set", "node.name=n1"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("configuration OK"), out.stdout + out.stderr
    out = subprocess.run(
        [str(bin_ / "agentd-cni")], input="", capture_output=True, text=True, timeout=60,
        env=env | {"CNI_COMMAND": "VERSION"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1.0.0" in json.loads(out.stdout)["supportedVersions"]


# ------------------------------------------------------------------ the architecture picture


def test_architecture_svg_is_rendered_from_its_source(tmp_path):
    out = tmp_path / "architecture.svg"
    proc = subprocess.run(
        ["sh", str(ROOT / "docs" / "architecture.sh"), str(out)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == (ROOT / "docs" / "architecture.svg").read_text(), (
        "docs/architecture.svg is stale: run `sh docs/architecture.sh`"
    )
