"""NetworkPolicy on the real kernel: a truth table in the style of the upstream e2e suite.

One lab for the module (3 nodes, host-gw): namespaces x, y, z with pods a, b, c each (a on
node1, b on node2, c on node3, so every pair is tested on one node and across nodes), each
serving TCP 80/81 and UDP 80/81 with named ports.  For every scenario the policies are
applied as Kubernetes manifests (through the same validation as ``agentd apply``), every
node is waited for until it reports the etcd revision applied (GET /policy), the full probe
matrix runs from every pod to every other on every port, and the result must equal what
tests/netpol_model.py - an independent model of the v1 rules - says.  Then the scenario's
objects are deleted and the next one runs on the same lab.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import pytest_asyncio
from netpol_lab import NAMES, NAMESPACES, NS_LABELS, Grid, check, close_grid, converged, make_grid, namespace, np

from agentd.lab.lab import Lab, LabSpec
from agentd.lab.netns import unique_tag
from agentd.lab.probe import Prober
from agentd.lab.wait import apause, auntil

pytestmark = pytest.mark.asyncio(loop_scope="module")

@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def grid(tmp_path_factory):
    lab = Lab(LabSpec(name="np" + unique_tag("")[:6], nodes=3, pods=0), root=tmp_path_factory.mktemp("labs"))
    g = None
    try:
        await lab.up(timeout=90)
        g = await make_grid(lab, [(i, ns, name) for ns in NAMESPACES for i, name in enumerate(NAMES)], NS_LABELS)
        yield g
    finally:
        if g is not None:
            await close_grid(g)
        await lab.down(keep_files=True)


# ------------------------------------------------------------------ the scenarios

Spec = Callable[[Grid], list[dict[str, Any]]]


def fixed(*policies: dict[str, Any]) -> Spec:
    return lambda g: list(policies)


SCENARIOS: dict[str, Spec] = {
    # isolation and the defaults of policyTypes
    "no policy: everything open": fixed(),
    "default deny ingress": fixed(np("deny", "x", {"podSelector": {}})),
    "default deny egress": fixed(np("deny", "x", {"podSelector": {}, "policyTypes": ["Egress"]})),
    "default deny both ways": fixed(np("deny", "y", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})),
    "deny ingress to one pod only": fixed(np("deny-a", "x", {"podSelector": {"matchLabels": {"pod": "a"}}})),
    # empty rules vs absent rules
    "empty ingress rule allows everything": fixed(np("all", "x", {"podSelector": {}, "ingress": [{}]})),
    "empty egress list is not an Egress policy": fixed(np("p", "x", {"podSelector": {}, "egress": [], "ingress": [{"ports": [{"port": 81}]}]})),
    "empty egress rule allows all egress": fixed(np("p", "x", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"], "egress": [{}]})),
    "empty from list means every source": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"from": [], "ports": [{"port": 80, "protocol": "UDP"}]}]})),
    "policyTypes Ingress ignores egress rules": fixed(np("p", "x", {"podSelector": {}, "policyTypes": ["Ingress"], "egress": [{"ports": [{"port": 81}]}]})),
    # peers
    "podSelector peer: own namespace only": fixed(np("p", "x", {"podSelector": {"matchLabels": {"pod": "a"}},
                                                                "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}]}]})),
    "namespaceSelector peer": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}]}]})),
    "namespace and pod selector in one peer": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"ns": "y"}}, "podSelector": {"matchLabels": {"pod": "c"}}}]}]})),
    "namespace and pod selector as two peers": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"ns": "y"}}}, {"podSelector": {"matchLabels": {"pod": "c"}}}]}]})),
    "matchExpressions In and NotIn": fixed(np("p", "x", {"podSelector": {"matchExpressions": [{"key": "pod", "operator": "In", "values": ["a", "b"]}]},
        "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": {"matchExpressions": [{"key": "pod", "operator": "NotIn", "values": ["c"]}]}}]}]})),
    "matchExpressions Exists and DoesNotExist": fixed(np("p", "z", {"podSelector": {"matchExpressions": [{"key": "pod", "operator": "Exists"}]},
        "ingress": [{"from": [{"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "DoesNotExist"}]}}]}]})),
    "namespace name label": fixed(np("p", "z", {"podSelector": {}, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "x"}}}]}]})),
    "ipBlock": lambda g: [np("p", "x", {"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": g.subnet_of("node2")}}]}]})],
    "ipBlock with except": lambda g: [np("p", "x", {"podSelector": {}, "ingress": [{"from": [{"ipBlock": {
        "cidr": "10.244.0.0/16", "except": [g.subnet_of("node3"), f"{g.pods['y/a'].ip}/32"]}}]}]})],
    "egress podSelector and namespaceSelector": fixed(np("p", "x", {"podSelector": {}, "egress": [{"to": [
        {"namespaceSelector": {"matchLabels": {"ns": "z"}}, "podSelector": {"matchLabels": {"pod": "b"}}}, {"podSelector": {"matchLabels": {"pod": "a"}}}]}]})),
    "egress ipBlock with except": lambda g: [np("p", "y", {"podSelector": {"matchLabels": {"pod": "b"}}, "policyTypes": ["Egress"], "egress": [
        {"to": [{"ipBlock": {"cidr": "10.244.0.0/16", "except": [g.subnet_of("node1")]}}]}]})],
    # ports
    "TCP port 80 only": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"port": 80}]}]})),
    "UDP port 81 only": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"port": 81, "protocol": "UDP"}]}]})),
    "port range with endPort": fixed(np("p", "y", {"podSelector": {}, "ingress": [{"ports": [{"port": 79, "endPort": 80, "protocol": "TCP"}, {"port": 81, "endPort": 90, "protocol": "UDP"}]}]})),
    "protocol without port": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"protocol": "UDP"}]}]})),
    "SCTP only allows no TCP or UDP": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"protocol": "SCTP", "port": 80}]}]})),
    "named port ingress": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"port": "serve-81-tcp"}, {"port": "serve-80-udp", "protocol": "UDP"}]}]})),
    "named port with the wrong protocol matches nothing": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"ports": [{"port": "serve-80-udp", "protocol": "TCP"}]}]})),
    "named port egress": fixed(np("p", "z", {"podSelector": {}, "egress": [{"to": [{"namespaceSelector": {}}], "ports": [{"port": "serve-81-udp", "protocol": "UDP"}]}]})),
    "peers and ports together": fixed(np("p", "x", {"podSelector": {}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}, "namespaceSelector": {}}],
                                                                                 "ports": [{"port": 80}, {"port": 80, "protocol": "UDP"}]}]})),
    # several policies
    "policies are a union": fixed(
        np("p1", "x", {"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}], "ports": [{"port": 80}]}]}),
        np("p2", "x", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "z"}}}]}]}),
        np("p3", "x", {"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [{"ports": [{"port": 81, "protocol": "UDP"}]}]}),
    ),
    "ingress and egress policies in several namespaces": fixed(
        np("in", "y", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "x"}}}]}]}),
        np("out", "x", {"podSelector": {"matchLabels": {"pod": "c"}}, "policyTypes": ["Egress"], "egress": [{"to": [{"namespaceSelector": {"matchLabels": {"team": "red"}}}]}]}),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_truth_table(grid: Grid, name: str):
    policies = SCENARIOS[name](grid)
    try:
        if policies:
            await converged(grid.lab, await grid.res.apply(policies))
        await check(grid, policies)
    finally:
        for p in policies:
            await grid.res.delete("NetworkPolicy", p["metadata"]["namespace"], p["metadata"]["name"])


# ------------------------------------------------------------------ selector changes, cluster-wide


async def test_a_label_added_takes_effect_everywhere(grid: Grid):
    policy = np("p", "x", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"role": "client"}}}]}]})
    await converged(grid.lab, await grid.res.apply(policy))
    try:
        await check(grid, [policy])
        rev = await grid.res.label("Pod", "z", "b", {"role": "client"})  # z/b lives on node2, x/* everywhere
        grid.labels["z/b"]["role"] = "client"
        await converged(grid.lab, rev)
        await check(grid, [policy])
    finally:
        await grid.res.label("Pod", "z", "b", {"role": None})
        grid.labels["z/b"].pop("role", None)
        await grid.res.delete("NetworkPolicy", "x", "p")


async def test_a_namespace_relabelled_takes_effect_everywhere(grid: Grid):
    policy = np("p", "y", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"trusted": "yes"}}}]}]})
    await converged(grid.lab, await grid.res.apply(policy))
    try:
        rev = await grid.res.apply(namespace("z", {**NS_LABELS["z"], "trusted": "yes"}))
        grid.ns_labels["z"]["trusted"] = "yes"
        await converged(grid.lab, rev)
        await check(grid, [policy])
    finally:
        await grid.res.apply(namespace("z", NS_LABELS["z"]))
        grid.ns_labels["z"] = dict(NS_LABELS["z"])
        await grid.res.delete("NetworkPolicy", "y", "p")


async def test_a_new_pod_on_another_node_is_allowed_and_its_delete_removes_it(grid: Grid):
    policy = np("p", "x", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "client"}}}]}]})
    await converged(grid.lab, await grid.res.apply(policy))
    new = await grid.lab.add_pod("node3", "y", "client", labels={"app": "client"})
    # agentd-cni's ADD returned only once node3's agent had the pod in its tables.
    endpoint = json.loads((new.node.dir / "cni" / "endpoints" / f"{new.container_id}.json").read_text())
    ports = json.loads(await asyncio.to_thread(new.node.ns.exec, "nft", "-j", "list", "set", "bridge", "agentd-policy", "pod-ports"))
    (s,) = [i["set"] for i in ports["nftables"] if "set" in i]
    assert endpoint["interface"] in s["elem"]
    prober = await Prober.start(new, [])
    try:
        record = await grid.res.get("Pod", "y", "client")
        assert record is not None and record["spec"]["nodeName"] == "node3" and record["status"]["podIP"] == new.ip
        assert record["metadata"]["labels"] == {"app": "client"}
        await converged(grid.lab, int(record["metadata"]["resourceVersion"]))
        targets = [(p.ip, "tcp", 80) for p in grid.pods.values()]
        ok = await prober.probe(targets, 2.0)
        assert all(ok), ok  # x's pods allow it now; y's and z's are open
        # Removed (CNI DEL): the record goes, and x's pods no longer know its address.
        await grid.lab.remove_pod(new)
        await auntil(lambda: _is_none(grid.res.get("Pod", "y", "client")), 10, what="the deleted pod's record gone")
        view = await asyncio.to_thread(grid.lab.nodes[0].api, "/policy?pod=x/a")
        (rule,) = view["pods"][0]["ingress"]
        assert new.ip not in rule["peer_addresses"]
    finally:
        await prober.close()
        if new in grid.lab.pods:
            await grid.lab.remove_pod(new)
        await grid.res.delete("NetworkPolicy", "x", "p")


def _ct_entries(node: Any, address: str) -> list[Any]:
    """node's conntrack entries with ``address`` at an end (a ctnetlink dump in its namespace)."""
    import socket

    from agentd.kernel import netlink as nl
    from agentd.kernel.netlink_ct import decode_event
    from agentd.kernel.netlink_socket import NetlinkSocket
    from agentd.policy.conntrack import encode_dump, touches

    with node.ns.entered():
        sock = NetlinkSocket(protocol=nl.NETLINK_NETFILTER)
    try:
        answers = sock.request(encode_dump(1, socket.AF_INET), what="listing conntrack entries", dump=True)
    finally:
        sock.close()
    events = [decode_event(t, b, s, e) for t, b, s, e in answers]
    return [ev for ev in events if ev is not None and touches(ev, {address})]


async def test_a_removed_pods_conntrack_entries_go_with_its_endpoint_file(grid: Grid):
    """A UDP flow to a pod (isolated, so its traffic goes through conntrack; allowed) leaves an
    established entry in its node; when the pod goes (CNI DEL removes its endpoint file) the
    agent deletes it, so a sender that keeps sending is judged anew by whoever has the address
    next instead of passing as established."""
    node1 = grid.lab.nodes[0]
    victim = await grid.lab.add_pod(node1, "y", "victim", labels={"app": "victim"})
    server = await Prober.start(victim, [("udp", 80)])
    closed = False
    try:
        policy = np("victim", "y", {"podSelector": {"matchLabels": {"app": "victim"}}, "ingress": [{}]})
        await converged(grid.lab, await grid.res.apply(policy))
        assert await grid.probers["x/a"].probe([(victim.ip, "udp", 80)], 2.0) == [True]  # x/a: node1 too
        entries = await asyncio.to_thread(_ct_entries, node1, victim.ip)
        assert any(e.orig.proto == 17 and e.orig.dport == 80 for e in entries), entries
        await server.close()
        closed = True
        await grid.lab.remove_pod(victim)
        await auntil(lambda: _no_entries(node1, victim.ip), 10, interval=0.2,
                     what="the removed pod's conntrack entries to be deleted")
    finally:
        if not closed:
            await server.close()
        if victim in grid.lab.pods:
            await grid.lab.remove_pod(victim)
        await grid.res.delete("NetworkPolicy", "y", "victim")


async def _no_entries(node: Any, address: str) -> bool:
    return not await asyncio.to_thread(_ct_entries, node, address)


async def _is_none(value) -> bool:
    return await value is None


async def _empty(value) -> bool:
    return not await value


async def _equals(value, expected) -> bool:
    return await value == expected


# ------------------------------------------------------------------ visibility


async def test_policy_view_metrics_and_status(grid: Grid):
    policy = np("deny-a", "x", {"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}], "ports": [{"port": "serve-80-tcp"}]}]})
    await converged(grid.lab, await grid.res.apply(policy))
    try:
        node1 = grid.lab.nodes[0]
        assert not any(await grid.probers["y/a"].probe([(grid.pods["x/a"].ip, "tcp", 81)] * 3, 0.5))
        view = await asyncio.to_thread(node1.api, "/policy?pod=x/a")
        (pod,) = view["pods"]
        assert pod["policies"] == ["x/deny-a"] and pod["isolated"] == {"ingress": True, "egress": False}
        (rule,) = pod["ingress"]
        assert rule["peer_addresses"] == [grid.pods["x/b"].ip]
        assert rule["named_ports"] == [f"{grid.pods['x/a'].ip} tcp/80"]
        await auntil(lambda: node1.api("/policy?pod=x/a")["pods"][0]["dropped"]["ingress"] >= 3, 10, interval=0.2,
                     in_thread=True, what=lambda: f"3 drops counted: {node1.api('/policy?pod=x/a')['pods'][0]['dropped']}")
        text = await asyncio.to_thread(lambda: node1.ns.http_get("http://127.0.0.1:9099/metrics")[1].decode())
        assert 'agentd_policy_dropped_packets_total{direction="ingress",namespace="x"}' in text and 'pod="' not in text
        assert 'agentd_policy_isolated_pods{direction="ingress"} 1.0' in text
        rc, out, _ = await node1.ns.aexec(str(Path(sys.executable).parent / "agentd"), "status")
        assert "Policy" in out.decode() and "isolated 1 (ingress 1, egress 0)" in out.decode(), out.decode()
    finally:
        await grid.res.delete("NetworkPolicy", "x", "deny-a")


# ------------------------------------------------------------------ the command line


def agentd_cli(node: Any, *argv: str, stdin: str | None = None) -> tuple[int, str, str]:
    """``agentd ARGV`` inside a node, finding the lab's etcd the way `agentd lab exec` does."""
    import os
    import subprocess

    env = dict(os.environ, AGENTD_CONFIG=str(node.config_path))
    proc = subprocess.run(
        ["ip", "netns", "exec", node.ns.name, str(Path(sys.executable).parent / "agentd"), *argv],
        input=stdin, capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


MANIFEST = """\
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: cli, namespace: z}
spec:
  podSelector: {matchLabels: {pod: c}}
  ingress:
  - from: [{podSelector: {matchLabels: {tier: web}}}]
    ports: [{port: serve-80-tcp}]
"""


async def test_the_command_line_applies_gets_labels_and_deletes(grid: Grid):
    node = grid.lab.nodes[1]
    bad = MANIFEST.replace("serve-80-tcp", "Serve_80")
    rc, out, err = await asyncio.to_thread(agentd_cli, node, "apply", "-f", "-", stdin=bad)
    assert rc == 1 and err.count("\n") == 1 and "spec.ingress[0].ports[0].port: Invalid value" in err, err
    assert await grid.res.get("NetworkPolicy", "z", "cli") is None  # nothing written
    rc, out, err = await asyncio.to_thread(agentd_cli, node, "apply", "-f", "-", stdin=MANIFEST)
    assert (rc, out) == (0, "networkpolicy.networking.k8s.io/cli created\n"), err
    try:
        rc, out, _ = await asyncio.to_thread(agentd_cli, node, "get", "netpol", "-n", "z")
        assert rc == 0 and out.splitlines()[1].split()[:4] == ["z", "cli", "pod=c", "Ingress"], out
        rc, out, _ = await asyncio.to_thread(agentd_cli, node, "get", "netpol", "z/cli", "-o", "json")
        assert rc == 0 and '"port": "serve-80-tcp"' in out and '"protocol": "TCP"' in out
        rc, out, err = await asyncio.to_thread(agentd_cli, node, "label", "pod", "z/a", "tier=web")
        assert (rc, out) == (0, "pod/a labeled\n"), err
        grid.labels["z/a"]["tier"] = "web"
        record = await grid.res.get("Pod", "z", "a")
        await converged(grid.lab, int(record["metadata"]["resourceVersion"]))
        policy = await grid.res.get("NetworkPolicy", "z", "cli")
        await check(grid, [policy])
        rc, out, _ = await asyncio.to_thread(agentd_cli, node, "get", "pods", "-n", "z")
        assert "tier=web" in out and grid.pods["z/a"].ip in out, out
    finally:
        await asyncio.to_thread(agentd_cli, node, "label", "pod", "z/a", "tier-")
        grid.labels["z/a"].pop("tier", None)
        rc, out, err = await asyncio.to_thread(agentd_cli, node, "delete", "netpol", "z/cli")
        assert (rc, out) == (0, "networkpolicy.networking.k8s.io/cli deleted\n"), err


# ------------------------------------------------------------------ no windows: changes, restarts


GUARD = np("guard", "x", {"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [
    {"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}], "ports": [{"port": 80}, {"port": 80, "protocol": "UDP"}]}]})  # fmt: skip


def guard_variant(i: int) -> dict[str, Any]:
    """A rewrite of GUARD that still never lets z/a or y/c reach x/a."""
    rules: list[dict[str, Any]] = [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}],
                                    "ports": [{"port": 80}, {"port": 80, "protocol": "UDP"}]}]  # fmt: skip
    if i % 2:
        rules.append({"from": [{"namespaceSelector": {"matchLabels": {"ns": "x"}}, "podSelector": {"matchLabels": {"pod": "c"}}}],
                      "ports": [{"port": 81}, {"port": "serve-81-udp", "protocol": "UDP"}]})  # fmt: skip
    if i % 3 == 0:
        rules.append({"from": [{"namespaceSelector": {"matchLabels": {"nobody": "here"}}}]})
    return np("guard", "x", {"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": rules})


# The hammers: z/a and y/c are denied x/a (a probe every 10 ms, given 0.3 s), x/b is allowed
# (every 50 ms, given 3 s); each probes x/a's TCP 80 and UDP 80.
HAMMERS = (("z/a", 0.01, 0.3), ("y/c", 0.01, 0.3), ("x/b", 0.05, 3.0))


async def _hammer_denied_and_allowed(grid: Grid, seconds: float) -> tuple[list[dict], dict]:
    """The three hammers for ``seconds`` at most (``_stop_hammers`` ends them sooner)."""
    x_a = grid.pods["x/a"].ip
    runs = [grid.probers[name].hammer([(x_a, "tcp", 80), (x_a, "udp", 80)], seconds, interval=interval,
                                      timeout=timeout) for name, interval, timeout in HAMMERS]  # fmt: skip
    *denied_results, allowed_result = await asyncio.gather(*runs)
    return denied_results, allowed_result


async def _probed(grid: Grid, hammer: asyncio.Future, what: str) -> None:
    """Every hammer has ended, for every target, a probe it started after now."""
    waits = asyncio.ensure_future(asyncio.gather(*(grid.probers[name].wait_probed(what) for name, _, _ in HAMMERS)))
    done, _ = await asyncio.wait({waits, hammer}, return_when=asyncio.FIRST_COMPLETED)
    if waits not in done:
        waits.cancel()
        await asyncio.gather(waits, return_exceptions=True)
        raise AssertionError(f"the hammers ended while waiting for {what}")
    waits.result()


def _stop_hammers(grid: Grid) -> None:
    for name, _, _ in HAMMERS:
        grid.probers[name].stop_hammer()


ROUNDS = 12  # every combination of the rewrites below (round mod 2, round mod 3), twice


async def test_rewriting_policies_under_traffic_never_opens_a_window(grid: Grid):
    await converged(grid.lab, await grid.res.apply(GUARD))
    hammer = asyncio.ensure_future(_hammer_denied_and_allowed(grid, 300.0))  # stopped after the rounds
    try:
        await _probed(grid, hammer, "the hammers' first probes")
        for i in range(1, ROUNDS + 1):
            await grid.res.apply(guard_variant(i))  # the guarding policy itself, rewritten
            if i % 2:
                await grid.res.apply(np("other", "x", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "x"}}}]}]}))
            else:
                await grid.res.delete("NetworkPolicy", "x", "other")
            await grid.res.label("Pod", "y", "b", {"round": str(i)})  # selector members change elsewhere
            await grid.res.apply(namespace("z", {**NS_LABELS["z"], "round": str(i)}))
            # Every flow is probed between two rounds of changes (a probe sent after these ended).
            await _probed(grid, hammer, f"every flow probed after round {i}")
        _stop_hammers(grid)
        denied, allowed_result = await hammer
        for result in denied:
            assert sum(result["ok"]) == 0, f"a denied flow got through during {ROUNDS} rounds of changes: {result}"
        assert sum(allowed_result["failed"]) == 0, allowed_result
    finally:
        if not hammer.done():
            _stop_hammers(grid)
            await asyncio.gather(hammer, return_exceptions=True)
        await grid.res.delete("NetworkPolicy", "x", "guard")
        await grid.res.apply(namespace("z", NS_LABELS["z"]))
        await grid.res.label("Pod", "y", "b", {"round": None})
        if await grid.res.get("NetworkPolicy", "x", "other") is not None:
            await grid.res.delete("NetworkPolicy", "x", "other")


def table_handles(node: Any) -> dict[str, int]:
    import json

    out = {}
    for family in ("inet", "bridge"):
        listing = json.loads(node.ns.exec("nft", "-j", "list", "table", family, "agentd-policy"))
        out[family] = next(i["table"]["handle"] for i in listing["nftables"] if "table" in i)
    return out


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
async def test_agent_restart_keeps_enforcement(grid: Grid, how: str):
    import signal

    node1 = grid.lab.nodes[0]  # x/a and z/a live here
    await converged(grid.lab, await grid.res.apply(GUARD))
    hammer: asyncio.Future | None = None
    try:
        before = await asyncio.to_thread(table_handles, node1)
        hammer = asyncio.ensure_future(_hammer_denied_and_allowed(grid, 300.0))  # stopped below
        await _probed(grid, hammer, "the hammers' first probes, against the agent's tables before it goes")
        await node1.stop_agent(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
        await asyncio.gather(apause(1.0, "no agent at all for a while: the kernel enforces alone"),
                             _probed(grid, hammer, "every flow probed while no agent runs"))
        node1.start_agent()
        await grid.lab.ready.agents_started(60)
        await _probed(grid, hammer, "every flow probed against the restarted agent")
        _stop_hammers(grid)
        denied, allowed_result = await hammer
        for result in denied:
            assert sum(result["ok"]) == 0, f"a denied flow got through around the restart: {result}"
        assert sum(allowed_result["failed"]) == 0, allowed_result
        assert await asyncio.to_thread(table_handles, node1) == before  # adopted, not re-created
        # The restarted agent follows changes: z/a allowed now.
        rev = await grid.res.apply(np("guard", "x", {"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [
            {"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}, {"namespaceSelector": {"matchLabels": {"ns": "z"}}, "podSelector": {"matchLabels": {"pod": "a"}}}]}]}))  # fmt: skip
        await converged(grid.lab, rev)
        assert await grid.probers["z/a"].probe([(grid.pods["x/a"].ip, "tcp", 80)], 3.0) == [True]
    finally:
        if hammer is not None and not hammer.done():
            _stop_hammers(grid)
            await asyncio.gather(hammer, return_exceptions=True)
        await grid.res.delete("NetworkPolicy", "x", "guard")


async def test_records_of_a_dead_node_expire_with_its_lease_and_come_back(grid: Grid):
    node2 = grid.lab.nodes[1]
    on_node2 = {p.name for p in grid.pods.values() if p.node is node2}

    async def recorded() -> set[str]:
        pods = await grid.res.list("pods")
        return {f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods if p["spec"]["nodeName"] == "node2"}

    assert await recorded() == on_node2
    await node2.kill_agent()  # no leave: the node just disappears
    await auntil(lambda: _empty(recorded()), grid.lab.spec.lease_ttl + 15, interval=0.2,
                 what="the records of a dead node's pods to go with its lease")
    view = await asyncio.to_thread(grid.lab.nodes[0].api, "/policy")
    assert view["revision"] > 0
    node2.start_agent()
    await grid.lab.ready.agents_started(60)
    await auntil(lambda: _equals(recorded(), on_node2), 30, interval=0.2,
                 what="a restarted agent to publish its pods again")
    await grid.lab.ready.established(60)


# ------------------------------------------------------------------ leave (last: node3 goes)


async def test_leave_removes_everything(grid: Grid):
    node3 = grid.lab.nodes[2]
    await converged(grid.lab, await grid.res.apply(np("deny", "x", {"podSelector": {}})))
    assert "agentd-policy" in await asyncio.to_thread(node3.ns.exec, "nft", "list", "tables")
    on_node3 = {p.name for p in grid.pods.values() if p.node is node3}
    await node3.leave()  # asks the running agent, which withdraws, cleans up and exits
    await auntil(lambda: node3.agent_pid() is None and "agentd-policy" not in node3.ns.exec("nft", "list", "tables"),
                 20, in_thread=True, what="the agent to exit and take its policy tables with it")

    async def none_left() -> tuple[list] | None:
        pods = await grid.res.list("pods")
        return None if any(p["spec"]["nodeName"] == "node3" for p in pods) else (pods,)

    (pods,) = await auntil(none_left, 10, what="the records of node3's pods to go")
    assert on_node3 and not on_node3 & {f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods}
