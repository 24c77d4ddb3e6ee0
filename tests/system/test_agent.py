"""The node agent's own behaviour: signals, reload, external
peers, metrics, MTU, off-link host-gw peers, bad configuration, and the lab CLI."""

import asyncio
import json
import os
import signal
import subprocess
import sys
from ipaddress import ip_address, ip_network
from pathlib import Path


from agentd.cni.netconf import read_subnet_file
from agentd.lab.bird import Bird
from agentd.lab.lab import ETCD_ADDRESS
from agentd.lab.netns import Netns, list_names, veth
from agentd.lab.wait import DEFAULT_TIMEOUT, auntil, until

AGENTD = str(Path(sys.executable).parent / "agentd")


async def wait_for(predicate, timeout, what):
    """Poll a blocking predicate (REST, birdc, ip) in a thread until it holds."""
    return await auntil(predicate, timeout, what=what, interval=0.1, in_thread=True)


def has_route(node, subnet):
    return any(line.startswith(subnet) for line in node.kernel_routes())


async def test_sigterm_with_graceful_restart_keeps_routes_everywhere(lab_factory):
    lab = await lab_factory(nodes=3, pods=0)
    node1, node2, _ = lab.nodes
    subnets = lab.subnets()
    before2 = sorted(node2.kernel_routes())
    await node2.stop_agent(signal.SIGTERM)
    # node1 noticed the session go (graceful restart: it keeps node2's route, marked stale)...
    rib = await wait_for(lambda: [r for r in node1.api("/rib") if r["prefix"] == subnets["node2"] and r["stale"]],
                         DEFAULT_TIMEOUT, "node1 to keep node2's route as stale")
    # ...the stopped node left its kernel routes alone and its peers still route to it.
    assert sorted(node2.kernel_routes()) == before2
    assert has_route(node1, subnets["node2"])
    assert rib and rib[0]["stale"]
    # As an agent whose subnet node1 took leaves it (agent.py _subnet_lost, _shutdown): no
    # subnet file, and the record in state_dir naming the lost subnet.  node2 cannot have it
    # back, keeps the one it holds, and warns that whatever was on the lost subnet must be
    # created again.
    sf = read_subnet_file(node2.dir / "subnet.env")
    other = ip_network(subnets["node1"])
    (node2.dir / "subnet.env").unlink()
    (node2.dir / "state" / "subnets.json").write_text(json.dumps({"subnets": [str(other)]}))
    node2.start_agent()
    await lab.ready.established(30)
    await wait_for(lambda: not [r for r in node1.api("/rib") if r["stale"]], 15, "stale routes refreshed")
    assert lab.subnets()["node2"] == subnets["node2"]
    assert f"this node's subnet changed from {other} to {sf.subnet}" in node2.log_path.read_text()


async def test_a_reboot_longer_than_the_lease_ttl_keeps_the_nodes_subnet(lab_factory):
    """The host down longer than [etcd] lease_ttl: etcd expires the node's lease (revoked
    here), and /run -- the subnet file -- is empty at boot.  The node took a random subnet;
    state_dir/subnets.json gives the old one back."""
    lab = await lab_factory(nodes=2, pods=0)
    node2 = lab.nodes[1]
    before = lab.subnets()["node2"]
    assert json.loads((node2.dir / "state" / "subnets.json").read_text()) == {"subnets": [before]}
    await node2.stop_agent(signal.SIGTERM)
    key = f"/agentd/subnets/{ip_network(before).network_address}-{ip_network(before).prefixlen}"
    revoke = (
        "import asyncio, aetcd\n"
        "async def main():\n"
        f"    async with aetcd.Client('{ETCD_ADDRESS}', 2379) as c:\n"
        f"        await c.revoke_lease((await c.get(b'{key}')).lease)\n"
        "        print(await c.get(b'/agentd/nodes/node2') is None)\n"
        "asyncio.run(main())\n"
    )
    assert lab.etcd_ns.exec(sys.executable, "-c", revoke).strip() == "True"  # the lease and its keys gone
    (node2.dir / "subnet.env").unlink()  # the reboot
    node2.start_agent()
    await lab.ready.established(30)
    assert lab.subnets()["node2"] == before
    assert f"node node2 holds subnet {before} (kept from before)" in node2.log_path.read_text()


async def test_sigterm_without_graceful_restart_withdraws(lab_factory):
    extra = {f"node{i}": {"bgp": {"graceful_restart": False}} for i in range(1, 4)}
    lab = await lab_factory(nodes=3, pods=0, extra=extra)
    node1, node2, node3 = lab.nodes
    subnet2 = lab.subnets()["node2"]
    await node2.stop_agent(signal.SIGTERM)
    await wait_for(lambda: not has_route(node1, subnet2) and not has_route(node3, subnet2), DEFAULT_TIMEOUT, "withdrawal")
    assert node2.kernel_routes() == []  # a non-graceful stop also removes its own routes


async def test_sighup_adds_an_external_peer_that_receives_every_pod_subnet(lab_factory, tmp_path):
    lab = await lab_factory(nodes=3, pods=0)
    node1 = lab.nodes[0]
    tor_ns = Netns.create(f"ad-{lab.spec.name}-tor")  # removed with the lab
    veth(tor_ns, "eth0", lab.underlay, "tor0")
    lab.underlay.ip("link", "set", "tor0", "master", "br0")
    tor_ns.ip("addr", "add", "172.30.0.200/24", "dev", "eth0")
    conf = f"""
router id 172.30.0.200;
protocol device {{}}
protocol bgp node1 {{
  local 172.30.0.200 as 65100;
  neighbor {node1.address} as 64512;
  hold time 9;
  ipv4 {{ import all; export none; }};
}}
"""
    tor = Bird(tor_ns, tmp_path / "tor", conf)
    tor.start()
    try:
        assert "DEBUG" not in node1.log_path.read_text()
        lab.spec.extra["node1"] = {
            "bgp": {"peers": [{"address": "172.30.0.200", "asn": 65100}]},
            "log": {"level": "debug"},
        }
        node1.write_config()
        node1.signal_agent(signal.SIGHUP)
        tor.wait_established("node1", timeout=20)
        subnets = set(lab.subnets().values())
        routes = await wait_for(lambda: (r := tor.routes()) and set(r) >= subnets and r, 15, "pod subnets at the ToR")
        for s in subnets:
            assert routes[s]["BGP.next_hop"].split()[0] == node1.address, routes[s]
            assert routes[s]["BGP.as_path"].strip() == "64512"
        peers = {p["address"]: p for p in node1.api("/peers")}
        assert peers["172.30.0.200"]["description"] == "external"
        assert "debug logging is on" in node1.log_path.read_text()
        # The reload did not disturb the mesh.
        assert all(p["state"] == "Established" for p in peers.values())
        # The file named at start gone for a moment: that reload fails, and nothing changes
        # (rather than the defaults, which a default route makes valid here: no external peer).
        node1.ns.ip("route", "add", "default", "via", "172.30.0.200")
        aside = node1.config_path.rename(node1.config_path.with_suffix(".aside"))
        try:
            node1.signal_agent(signal.SIGHUP)
            await wait_for(lambda: "reload failed, keeping the running configuration" in node1.log_path.read_text(),
                           15, "the failed reload")  # fmt: skip
            assert {p["address"] for p in node1.api("/peers")} == set(peers)  # the external peer too
        finally:
            aside.rename(node1.config_path)
            node1.ns.ip("route", "del", "default", "via", "172.30.0.200")
    finally:
        tor.stop()


async def test_metrics_status_and_mtu(lab_factory):
    lab = await lab_factory(nodes=2, pods=1, backend="vxlan")
    node1 = lab.nodes[0]
    status, text = node1.ns.http_get("http://127.0.0.1:9099/metrics")
    text = text.decode()
    assert status == 200
    for name in (
        "agentd_bgp_peer_up{",
        "agentd_bgp_prefixes_received{",
        "agentd_routes_programmed ",
        "agentd_route_sync_seconds_count",
        "agentd_datastore_up 1.0",
        "agentd_subnet_lease_renewals_total",
        # The BPF member filter guards VXLAN's port: its drop counters are exported.
        'agentd_dataplane_drops_total{backend="",datapath="bpf",reason="non_member_vxlan"}',
    ):
        assert name in text, name
    st = node1.api("/status")
    assert st["node"]["mtu"] == 1450  # 1500 underlay - 50 VXLAN
    assert st["backends"]["active"]["vxlan"]["vtep_mac"]
    pod = lab.pods[0]
    assert "mtu 1450" in pod.ns.ip("link", "show", "eth0").stdout.decode()
    assert "mtu 1450" in node1.ns.ip("link", "show", "agentd.vxlan").stdout.decode()
    healthz = node1.ns.http_get("http://127.0.0.1:9099/healthz")
    readyz = node1.ns.http_get("http://127.0.0.1:9099/readyz")
    assert healthz[0] == 200 and readyz[0] == 200
    # Like flannel, each subnet lease carries its node's backend data (the node record does too).
    read = (
        "import asyncio, json, aetcd\n"
        "async def main():\n"
        f"    async with aetcd.Client('{ETCD_ADDRESS}', 2379) as c:\n"
        "        print(json.dumps([json.loads(kv.value) for kv in await c.get_prefix(b'/agentd/subnets/')]))\n"
        "asyncio.run(main())\n"
    )
    def published():
        leases = json.loads(lab.etcd_ns.exec(sys.executable, "-c", read))
        macs = sorted(lease["backend_data"].get("vtep_mac", "") for lease in leases)
        return len(leases) == 2 and all(macs) and macs

    macs = await wait_for(published, DEFAULT_TIMEOUT, "both leases carrying a VTEP MAC")
    assert st["backends"]["active"]["vxlan"]["vtep_mac"] in macs


async def test_host_gw_peer_off_link_gets_no_route_and_a_reason(lab_factory):
    lab = await lab_factory(nodes=2, pods=0, subnets=2, full=False)
    node1, node2 = lab.nodes
    subnet2 = lab.subnets()["node2"]

    def decided():
        peer = {p["address"]: p for p in node1.api("/peers")}[node2.address]
        learned = any(r["prefix"] == subnet2 for r in node1.api("/rib"))
        return peer["state"] == "Established" and learned and peer["backend"] is not None and peer

    # node2's subnet has arrived and node1 has planned a backend for node2.
    peer = await wait_for(decided, DEFAULT_TIMEOUT, "node2's route learned and a backend planned")
    assert peer["state"] == "Established" and peer["backend"] == "none"
    assert "not on this node's L2 segment" in peer["backend_reason"]
    assert not has_route(node1, subnet2)


def test_bad_configuration_fails_with_one_line_and_touches_nothing(netns_factory, tmp_path):
    ns = netns_factory("bad")
    links_before = ns.ip("-o", "link").stdout
    routes_before = ns.ip("route", "show", "table", "all").stdout
    conf = tmp_path / "agentd.toml"
    conf.write_text(
        f'[node]\nname = "n1"\naddress = "10.1.1.1"\n[bgp]\nhold_time = 2\n'
        f'[cni]\nsubnet_file = "{tmp_path}/subnet.env"\nconf_dir = "{tmp_path}/net.d"\n'
    )
    proc = subprocess.run(["ip", "netns", "exec", ns.name, AGENTD, "run", "--config", str(conf)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "hold_time" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert ns.ip("-o", "link").stdout == links_before
    assert ns.ip("route", "show", "table", "all").stdout == routes_before
    assert not (tmp_path / "subnet.env").exists() and not (tmp_path / "net.d").exists()
    # An unknown key, and a bad command-line argument, are one line too.
    conf.write_text('[node]\nname = "n1"\naddress = "10.1.1.1"\n[bgp]\nhold_tme = 30\n')
    proc = subprocess.run([AGENTD, "check-config", "--config", str(conf)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "did you mean" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    for bad in (["--nodes", "many"], ["--etcd", "9"]):
        proc = subprocess.run([AGENTD, "lab", "up", *bad], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_lab_cli_up_status_exec_down_leaves_nothing(tmp_path):
    env = dict(os.environ, AGENTD_LAB_ROOT=str(tmp_path / "labs"))
    name = "cli" + os.urandom(2).hex()
    up = subprocess.run(
        [AGENTD, "lab", "up", "--name", name, "--nodes", "2", "--pods", "1", "--etcd", "3"],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        for stage in ("etcd up", "agents started", "peers established", "pods attached", "all pods reachable"):
            assert stage in up.stdout, (stage, up.stdout)
        seen = []

        def one_leader():  # one `lab status` may fall in an election (no leader yet): asked again
            status = subprocess.run([AGENTD, "lab", "status", "--name", name], capture_output=True, text=True, env=env,
                                    timeout=60)
            seen[:] = [status.stdout + status.stderr]
            members = [line for line in status.stdout.splitlines() if f"lab-{name}-" in line]
            # (an agent whose call fell in the election shows DISCONNECTED until it reconnects)
            return (status.returncode == 0 and len(members) == 3 and sum("leader" in line for line in members) == 1
                    and status.stdout.count("etcd connected (http://172.30.0.") == 2 and status)

        # Three etcd members, one of them the leader; every agent connected to one of them.
        status = until(one_leader, 30, interval=0.5,
                       what=lambda: f"three etcd members, one the leader, both agents connected: {seen}")
        assert "Established" in status.stdout
        out = subprocess.run([AGENTD, "lab", "exec", "--name", name, "node1", "--", "agentd", "status"], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0 and "node-to-node mesh" in out.stdout, out.stdout + out.stderr
    finally:
        for _ in range(2):  # idempotent
            down = subprocess.run([AGENTD, "lab", "down", "--name", name], capture_output=True, text=True, env=env, timeout=120)
            assert down.returncode == 0, down.stderr
    assert list_names(f"ad-{name}-") == []
    assert not (tmp_path / "labs" / name).exists()
    leftovers = subprocess.run(["pgrep", "-f", f"ad-{name}-"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""


async def test_a_bad_record_in_etcd_at_start_is_one_line_and_leave_cleans_up_without_etcd(netns_factory, tmp_path):
    """Bad input from etcd at start (a cluster config that is no JSON) stops the agent with one
    error line, no traceback; ``agentd leave`` with etcd gone still cleans the host (here a
    VXLAN device a previous run left) and says the etcd step failed."""
    from agentd.lab.etcd import EtcdServer

    ns, other = netns_factory("badrec"), netns_factory("badrec-peer")
    veth(ns, "eth0", other, "eth0")
    ns.ip("addr", "add", "10.1.1.1/24", "dev", "eth0")
    server = EtcdServer(str(tmp_path / "etcd"), netns=ns)
    conf = tmp_path / "agentd.toml"
    conf.write_text(
        f'[node]\nname = "n1"\naddress = "10.1.1.1"\n'
        f'[etcd]\nendpoints = ["http://127.0.0.1:{server.client_port}"]\n'
        f'[api]\nlisten = "127.0.0.1:9099"\ntoken_file = "{tmp_path}/token"\n'
        f'[cni]\nsubnet_file = "{tmp_path}/subnet.env"\nconf_dir = "{tmp_path}/net.d"\n'
        f'[agent]\nstate_dir = "{tmp_path}/state"\nbpf_dir = "{tmp_path}/bpf"\n'
    )
    put = (
        "import asyncio, aetcd\n"
        "async def main():\n"
        f"    async with aetcd.Client('127.0.0.1', {server.client_port}, timeout=5) as c:\n"
        "        await c.put(b'/agentd/config', b'{not json')\n"
        "asyncio.run(main())\n"
    )
    try:
        await server.start()
        await ns.aexec(sys.executable, "-c", put)
        proc = await asyncio.to_thread(subprocess.run, ["ip", "netns", "exec", ns.name, AGENTD, "run", "--config", str(conf)],
                                       capture_output=True, text=True, timeout=90)
        errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert len(errors) == 1 and "cannot start" in errors[0] and "config" in errors[0], proc.stderr
        assert not (tmp_path / "subnet.env").exists()
    finally:
        await server.stop()
    # etcd gone: leave cleans this host all the same, and its exit status says etcd failed.
    ns.ip("link", "add", "agentd.vxlan", "type", "vxlan", "id", "1", "dstport", "4789", "dev", "eth0")
    (tmp_path / "state").mkdir(exist_ok=True)
    (tmp_path / "state" / "pod-macs.json").write_text('{"pods": {}}\n')  # the MACs a previous run read
    proc = await asyncio.to_thread(subprocess.run, ["ip", "netns", "exec", ns.name, AGENTD, "leave", "--config", str(conf)],
                                   capture_output=True, text=True, timeout=90)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    steps = proc.stdout.splitlines()
    assert steps[1].startswith("leaving etcd (releasing the subnets, removing the node record): failed: "), proc.stdout
    assert "removing what is left of the BPF data path, the pod fast path and the tunnels: done" in steps, proc.stdout
    assert steps[-1].startswith("node n1 left, but not cleanly: leaving etcd"), proc.stdout
    assert b"agentd.vxlan" not in ns.ip("-o", "link").stdout
    assert "removing the file of the MACs read from pods' interfaces: done" in steps, proc.stdout
    assert not (tmp_path / "state" / "pod-macs.json").exists()


async def test_a_leave_with_no_agent_removes_the_routes_of_our_protocol_and_no_other(netns_factory, tmp_path):
    """`agentd leave` with no agent running (here after it was killed) removed devices, tables
    and pins, but the kernel routes of [network] route_protocol stayed, forwarding to nodes of
    a cluster this host has left.  Now they go -- every route of that protocol in the main
    table, both families, as the agent's own stop removes them -- and no other protocol's."""
    ns, other = netns_factory("leaveroutes"), netns_factory("leaveroutes-peer")
    veth(ns, "eth0", other, "eth0")
    ns.ip("addr", "add", "10.1.1.1/24", "dev", "eth0")
    ns.ip("-6", "addr", "add", "2001:db8::1/64", "dev", "eth0", "nodad")
    ours = [("10.244.1.0/24", "via", "10.1.1.2"), ("198.51.100.0/24", "via", "10.1.1.2"),
            ("blackhole", "10.244.0.0/24", "metric", "4000")]
    for route in ours:
        ns.ip("route", "add", *route, "proto", "150")
    ns.ip("-6", "route", "add", "fd00:10:244:1::/64", "via", "2001:db8::2", "proto", "150")
    ns.ip("route", "add", "10.244.2.0/24", "via", "10.1.1.2", "proto", "143")  # the default number: not ours here
    ns.ip("route", "add", "10.244.3.0/24", "via", "10.1.1.2", "proto", "static")
    conf = tmp_path / "agentd.toml"
    conf.write_text(
        f'[node]\nname = "n1"\naddress = "10.1.1.1"\n'
        f'[network]\nroute_protocol = 150\n'
        f'[etcd]\nendpoints = ["http://127.0.0.1:9"]\n'  # etcd gone: the host is cleaned up all the same
        f'[api]\nlisten = "127.0.0.1:9099"\ntoken_file = "{tmp_path}/token"\n'
        f'[cni]\nsubnet_file = "{tmp_path}/subnet.env"\nconf_dir = "{tmp_path}/net.d"\n'
        f'[agent]\nstate_dir = "{tmp_path}/state"\nbpf_dir = "{tmp_path}/bpf"\n'
    )
    proc = await asyncio.to_thread(subprocess.run, ["ip", "netns", "exec", ns.name, AGENTD, "leave", "--config", str(conf)],
                                   capture_output=True, text=True, timeout=90)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr  # 1: etcd could not be left
    assert "removed 4 routes of proto 150" in proc.stderr, proc.stderr
    assert ns.ip("route", "show", "proto", "150").stdout.strip() == b""
    assert ns.ip("-6", "route", "show", "proto", "150").stdout.strip() == b""
    left = ns.ip("route", "show").stdout.decode()
    assert "10.244.2.0/24 via 10.1.1.2 dev eth0 proto 143" in left and "10.244.3.0/24 via 10.1.1.2 dev eth0 proto static" in left


async def test_a_leave_with_no_agent_needs_neither_etcds_files_nor_a_node_address(netns_factory, tmp_path):
    """`agentd leave` with no agent loaded the whole configuration first: a missing [etcd] TLS
    file, or no [node] address on a host without a default route (a node being taken out of
    service), made it exit 1 before any step ran, and everything the killed agent left stayed.
    Now only the etcd step fails; the routes, the conflist it wrote and its token file go."""
    from agentd.config.settings import load_config
    from agentd.daemon.node_files import write_cni_files
    from agentd.datastore.records import ClusterConfig, SubnetLease

    ns, other = netns_factory("leavebare"), netns_factory("leavebare-peer")
    veth(ns, "eth0", other, "eth0")
    ns.ip("addr", "add", "10.1.1.1/24", "dev", "eth0")  # and no default route
    ns.ip("route", "add", "10.244.1.0/24", "via", "10.1.1.2", "proto", "143")
    (tmp_path / "token").write_text("a-killed-agents-token\n")
    conf = tmp_path / "agentd.toml"
    conf.write_text(
        f'[node]\nname = "n1"\n'
        f'[etcd]\nendpoints = ["https://127.0.0.1:9"]\nca = "{tmp_path}/gone/ca.pem"\n'
        f'[api]\nlisten = "127.0.0.1:9099"\ntoken_file = "{tmp_path}/token"\n'
        f'[cni]\nsubnet_file = "{tmp_path}/subnet.env"\nconf_dir = "{tmp_path}/net.d"\ndata_dir = "{tmp_path}/cni"\n'
        f'[agent]\nstate_dir = "{tmp_path}/state"\nbpf_dir = "{tmp_path}/bpf"\n'
    )
    cfg = load_config(conf, env={}, check_files=False)  # the CNI files as the killed agent wrote them
    write_cni_files(cfg, ClusterConfig(ip_network("10.244.0.0/16"), 24, "host-gw", "always"),
                    {4: SubnetLease(ip_network("10.244.1.0/24"), "n1", ip_address("10.1.1.1"), "host-gw")}, 1450)
    conflist = tmp_path / "net.d" / "10-agentd.conflist"
    assert conflist.exists()
    proc = await asyncio.to_thread(subprocess.run, ["ip", "netns", "exec", ns.name, AGENTD, "leave", "--config", str(conf)],
                                   capture_output=True, text=True, timeout=90)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr + proc.stdout
    steps = proc.stdout.splitlines()
    failed = [line for line in steps[:-1] if ": failed: " in line]
    assert len(failed) == 1 and failed[0].startswith("leaving etcd (") and "ca.pem" in failed[0], proc.stdout
    assert "removing the kernel routes of proto 143: done" in steps, proc.stdout
    assert ns.ip("route", "show", "proto", "143").stdout.strip() == b""
    assert "removing the CNI network configuration file (10-agentd.conflist): done" in steps, proc.stdout
    assert not conflist.exists() and not (tmp_path / "token").exists()


async def test_a_leave_while_the_agent_waits_for_etcd_cleans_the_host_and_says_etcd_was_not_left(netns_factory, tmp_path):
    """`agentd leave` while the agent waits for an unreachable etcd at start: the parts it had
    not built were skipped (here a VXLAN device a previous run left stayed), and the agent and
    `agentd leave` exited 0.  Now the host is cleaned up and `agentd leave` exits 1, saying
    etcd failed; the agent exits 0 (so Restart=on-failure does not start it again)."""
    ns, other = netns_factory("leavestart"), netns_factory("leavestart-peer")
    veth(ns, "eth0", other, "eth0")
    ns.ip("addr", "add", "10.1.1.1/24", "dev", "eth0")
    ns.ip("link", "add", "agentd.vxlan", "type", "vxlan", "id", "1", "dstport", "4789", "dev", "eth0")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "pod-macs.json").write_text('{"pods": {}}\n')  # the MACs a previous run read
    conf = tmp_path / "agentd.toml"
    conf.write_text(
        f'[node]\nname = "n1"\naddress = "10.1.1.1"\n'
        f'[etcd]\nendpoints = ["http://127.0.0.1:9"]\n'  # nothing listens: start-up waits for it
        f'[api]\nlisten = "127.0.0.1:9099"\ntoken_file = "{tmp_path}/token"\n'
        f'[cni]\nsubnet_file = "{tmp_path}/subnet.env"\nconf_dir = "{tmp_path}/net.d"\n'
        f'[agent]\nstate_dir = "{tmp_path}/state"\nbpf_dir = "{tmp_path}/bpf"\n'
    )
    agent = await asyncio.create_subprocess_exec("ip", "netns", "exec", ns.name, AGENTD, "run", "--config", str(conf),
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        await auntil(lambda: (tmp_path / "token").exists(), 30, what="the agent's API token")
        proc = await asyncio.to_thread(subprocess.run, ["ip", "netns", "exec", ns.name, AGENTD, "leave", "--config",
                                                        str(conf)], capture_output=True, text=True, timeout=90)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        steps = proc.stdout.splitlines()  # every step of the leave, the etcd one failed, then the summary
        assert steps[0] == "closing the BGP sessions: skipped: BGP had not started", proc.stdout
        assert steps[2].startswith("leaving etcd (releasing the subnets, removing the node record): failed: "), steps
        assert "removing what is left of the BPF data path, the pod fast path and the tunnels: done" in steps, steps
        assert not [line for line in steps[:-1] if ": failed: " in line and not line.startswith("leaving etcd")], steps
        assert steps[-1].startswith("node n1 left, but not cleanly: leaving etcd"), steps
        _, err = await asyncio.wait_for(agent.communicate(), 30)
        assert agent.returncode == 0 and b"Traceback" not in err, err.decode()
        assert b"agentd.vxlan" not in ns.ip("-o", "link").stdout
        assert not (tmp_path / "token").exists()
        assert "removing the file of the MACs read from pods' interfaces: done" in steps, steps
        assert not (tmp_path / "state" / "pod-macs.json").exists()
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
