"""etcd as a cluster (member loss, quorum loss, failover): the datastore and the agents against 3 real etcd members.

The datastore tests run a 3-member cluster on loopback (no namespaces); the lab test runs
``agentd lab`` with ``etcd=3``: three members, each its own process and namespace on the
underlay, three agents listing every member in ``[etcd] endpoints``.  Members are killed
with SIGKILL (a crash: no goodbye to the cluster or the clients) or cut off the underlay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys
import time
from ipaddress import IPv4Address, IPv4Network

import aetcd
import pytest

from agentd.datastore.store import ClusterConfig, Datastore, DatastoreUnavailable, NodeEvent, NodeRecord
from agentd.lab.etcd import EtcdCluster, etcd_cluster
from agentd.lab.interop import Watch
from agentd.lab.traffic import Pinger
from agentd.lab.wait import aholds, apause, auntil

CLUSTER = ClusterConfig(IPv4Network("10.244.0.0/16"), 24, "host-gw", "always")
TTL = 3
WRITER_TTL = 60  # the other writers' leases: they only make events for the watch
LOG = "agentd.datastore"


async def until(check, timeout: float, what: str, interval: float = 0.05):
    """:func:`agentd.lab.wait.auntil` with the deadline and what it waits for in this file's order."""
    return await auntil(check, timeout, what=what, interval=interval)


def record(name: str, subnet: IPv4Network | None, address: str = "192.0.2.10") -> NodeRecord:
    return NodeRecord(name, IPv4Address(address), 64512, subnet, False, None, {})


class Events:
    """``watch_nodes()`` of one datastore in a task; every event kept."""

    def __init__(self, ds: Datastore) -> None:
        self.events: list[NodeEvent] = []
        self._task = asyncio.get_running_loop().create_task(self._run(ds))

    async def _run(self, ds: Datastore) -> None:
        async for event in ds.watch_nodes():
            self.events.append(event)

    def kinds(self) -> list[tuple[str, str | None]]:
        return [(e.kind, e.name) for e in self.events]

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@contextlib.asynccontextmanager
async def stores(cluster: EtcdCluster, **kwargs):
    made: list[Datastore] = []

    def make(**kw) -> Datastore:
        ds = Datastore(cluster.endpoints, **{"lease_ttl": TTL, **kwargs, **kw})
        made.append(ds)
        return ds

    try:
        yield make
    finally:
        await asyncio.gather(*(ds.close() for ds in made))


async def raw_keys(cluster: EtcdCluster) -> dict[str, tuple[dict, int, int]]:
    """{key: (value, lease, remaining ttl)} under /agentd/, read from the leader."""
    leader = await cluster.wait_leader()
    async with aetcd.Client(leader.host, leader.client_port, timeout=5) as client:
        out = {}
        for kv in await client.get_prefix(b"/agentd/"):
            ttl = (await client.get_lease_info(kv.lease, keys=False)).TTL if kv.lease else -1
            out[kv.key.decode()] = (json.loads(kv.value), kv.lease, ttl)
        return out


# -- the datastore against a 3-member cluster (loopback) -----------------------------------------


async def test_datastore_rides_through_every_member_loss_and_a_quorum_loss(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    async with etcd_cluster(tmp_path, 3, heartbeat_ms=100, election_ms=1000) as cluster, stores(cluster) as make:
        agent = make()
        changes: list[bool] = []
        agent.on_state_change = changes.append
        lease = await agent.acquire_subnet("alpha", IPv4Address("192.0.2.10"), "host-gw", {}, cluster=CLUSTER, timeout=20)
        await agent.register_node(record("alpha", lease.subnet), timeout=20)
        lease_id = agent.lease_id
        watch = Events(agent)
        await until(lambda: watch.kinds() == [("snapshot", None)], 20, "the first snapshot")

        # Kill each member in turn (SIGKILL), one at a time; the agent's requests, lease
        # keep-alives and watch must move to the members that are left, whichever they use.
        expected = [("snapshot", None)]
        for i, member in enumerate(cluster.members):
            was_leader = member is await cluster.wait_leader()  # not None during an election
            renewals = agent.lease_renewals
            await member.kill()
            if was_leader:
                await cluster.wait_leader(other_than=member)
            name = f"n{i}"
            # An event while the member is down, from a writer whose lease outlives the test (at
            # TTL, its keep-alives failing over on a loaded machine could let its record expire
            # and add a delete the watch rightly reports).
            await make(lease_ttl=WRITER_TTL).register_node(record(name, None), timeout=20)
            expected.append(("put", name))
            await until(lambda: watch.kinds() == expected, 20,
                        lambda: f"the event for {name} with member {i + 1} down (have {watch.kinds()})")
            await until(lambda: agent.lease_renewals >= renewals + 2, 20, "two lease keep-alives")
            # The agent's own lease was kept alive: same lease, keys still on it.
            other = await agent.acquire_subnet(
                "alpha", IPv4Address("192.0.2.10"), "host-gw", {}, cluster=CLUSTER, timeout=20
            )
            assert other.subnet == lease.subnet and agent.lease_id == lease_id
            await member.start()

        # Quorum lost: two of three killed.  Every call fails (with a deadline: quickly);
        # nothing the agent holds is given up.
        leader = await cluster.wait_leader()
        survivor = next(m for m in cluster.members if m is not leader)
        lost = [m for m in cluster.members if m is not survivor]
        await asyncio.gather(*(m.kill() for m in lost))
        t_lost = time.monotonic()
        await until(lambda: not agent.connected, 20, "the datastore to report etcd unreachable")
        with pytest.raises(DatastoreUnavailable):
            await agent.list_nodes(timeout=2)
        await apause(max(0.0, t_lost + 2 * TTL - time.monotonic()),
                     "the outage lasts two lease TTLs: without a leader, etcd expires no lease")
        assert not agent.connected
        assert agent.lease_id == lease_id and agent.subnet_lease.subnet == lease.subnet

        restart = asyncio.gather(*(m.start() for m in lost))
        await cluster.wait_leader()  # polled while the members start: the moment quorum is back
        t_back = time.monotonic()
        await restart
        await until(lambda: agent.connected, 30, "the datastore to reconnect")
        reconnect = time.monotonic() - t_back
        await make(lease_ttl=WRITER_TTL).register_node(record("after", None), timeout=20)
        expected.append(("put", "after"))
        await until(lambda: watch.kinds() == expected, 20,
                    lambda: f"the event written after quorum came back (have {watch.kinds()})")
        renewals = agent.lease_renewals
        await until(lambda: agent.lease_renewals >= renewals + 2, 20, "two lease keep-alives after quorum")
        stored = await raw_keys(cluster)
        subnet_key = f"/agentd/subnets/{lease.subnet.network_address}-24"
        for key in ("/agentd/nodes/alpha", subnet_key):
            value, on_lease, ttl = stored[key]
            assert on_lease == lease_id and 0 < ttl <= TTL + 1, (key, on_lease, ttl)  # + a leader's extension
        assert agent.lease_id == lease_id
        # The watch resumed every time from where it stopped: one snapshot, no event lost or repeated.
        assert watch.kinds() == expected
        assert "node watch resumed at revision" in caplog.text
        assert "is gone" not in caplog.text and "expired or was revoked" not in caplog.text
        assert changes[-1] is True
        await watch.stop()
        print(f"quorum lost for {t_back - t_lost:.1f}s; datastore reconnected {reconnect:.2f}s after a leader was elected")


# -- the lab: 3 agents, 3 etcd members ----------------------------------------------------------

DUMP = (
    "import asyncio, json, sys, aetcd\n"
    "async def main():\n"
    "    async with aetcd.Client(sys.argv[1], 2379, timeout=5) as c:\n"
    "        out = {}\n"
    "        for kv in await c.get_prefix(b'/agentd/'):\n"
    "            ttl = (await c.get_lease_info(kv.lease, keys=False)).TTL if kv.lease else -1\n"
    "            out[kv.key.decode()] = {'value': json.loads(kv.value), 'lease': kv.lease, 'ttl': ttl}\n"
    "        print(json.dumps(out))\n"
    "asyncio.run(main())\n"
)


async def lab_keys(lab) -> dict[str, dict]:
    """Every key under /agentd/ with its lease and remaining TTL, read inside the leader's namespace
    (again if an election gets in the way)."""

    async def dump():
        leader = await lab.etcd.wait_leader()
        rc, out, _ = await leader.netns.aexec(sys.executable, "-c", DUMP, leader.host, check=False, timeout=30)
        return json.loads(out) if rc == 0 else None

    return await until(dump, 30, "a read of every key from the etcd leader", interval=0.2)


def renewals(node) -> float:
    """The agent's agentd_subnet_lease_renewals_total (successful lease keep-alives)."""
    _, text = node.ns.http_get("http://127.0.0.1:9099/metrics")
    for line in text.decode().splitlines():
        if line.startswith("agentd_subnet_lease_renewals_total "):
            return float(line.split()[1])
    raise AssertionError("no agentd_subnet_lease_renewals_total in /metrics")


def connected(node) -> bool:
    return bool(node.api("/status")["datastore"]["connected"])


def http_status(node, path: str) -> int:
    return node.ns.http_get(f"http://127.0.0.1:9099{path}")[0]


def probe(lab):
    """What the background poller records for every node: its proto-143 routes and whether its
    datastore says etcd is connected (None if the API does not answer)."""

    def sample() -> dict[str, tuple[frozenset[str], bool | None]]:
        return {n.name: (frozenset(n.kernel_routes()), _connected_or_none(n)) for n in lab.nodes}

    return sample


def _connected_or_none(node) -> bool | None:
    status = node.api_or_none("/status")
    return None if status is None else bool(status["datastore"]["connected"])


def disconnected_spans(samples, t0: float) -> dict[str, list[tuple[float, float]]]:
    """Per node, the (from, to) seconds after t0 during which its datastore reported etcd unreachable."""
    spans: dict[str, list[tuple[float, float]]] = {}
    start: dict[str, float] = {}
    for t, sample in samples:
        for name, (_, up) in sample.items():
            if up is False and name not in start:
                start[name] = t
            elif up and name in start:
                spans.setdefault(name, []).append((round(start.pop(name) - t0, 2), round(t - t0, 2)))
    for name, t in start.items():
        spans.setdefault(name, []).append((round(t - t0, 2), float("inf")))
    return spans


async def every_agent(lab, check, timeout: float, what: str) -> float:
    """Wait until ``check(node)`` holds on every node; returns the seconds it took."""
    t0 = time.monotonic()
    await until(lambda: all(check(n) for n in lab.nodes), timeout, what, interval=0.1)
    return time.monotonic() - t0


async def test_lab_loses_no_route_through_leader_loss_and_quorum_loss(lab_factory):
    ttl = 10
    lab = await lab_factory(nodes=3, pods=1, etcd=3, lease_ttl=ttl)
    assert len(lab.etcd.members) == 3 and all(m.netns is not None for m in lab.etcd.members)
    for n in lab.nodes:  # every agent knows every member
        assert n.api("/status")["datastore"]["endpoints"] == lab.etcd.endpoints
    subnets = lab.subnets()
    routes = {n.name: frozenset(n.kernel_routes()) for n in lab.nodes}
    assert all(len(r) == 3 for r in routes.values()), routes  # a blackhole and two peers' subnets
    keys = await lab_keys(lab)
    held = {k: (v["value"], v["lease"]) for k, v in keys.items()}
    assert len([k for k in held if k.startswith("/agentd/nodes/")]) == 3
    assert len([k for k in held if k.startswith("/agentd/subnets/")]) == 3
    timings: dict[str, float] = {}

    pods = lab.pods
    pingers = [Pinger(a.ns, b.ip, interval=0.2) for a, b in zip(pods, pods[1:] + pods[:1])]
    monitors = [
        subprocess.Popen(["ip", "-n", n.ns.name, "monitor", "route"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for n in lab.nodes
    ]
    try:
        with Watch(probe(lab), interval=0.15) as kernel:
            # 1. The leader crashes: a new one is elected, the agents on it move on.
            before = {n.name: renewals(n) for n in lab.nodes}
            leader = await lab.etcd.wait_leader()  # not None by chance: an election may be going on
            t = t0 = time.monotonic()
            await leader.kill()
            second = await lab.etcd.wait_leader(other_than=leader)
            timings["leader killed -> new leader"] = time.monotonic() - t
            await every_agent(lab, lambda n: renewals(n) >= before[n.name] + 2, 30, "two lease keep-alives on every agent")
            timings["leader killed -> every agent renewed its lease twice"] = time.monotonic() - t
            assert lab.subnets() == subnets
            assert all((await lab.ready.reachability()).values())
            assert {k: (v["value"], v["lease"]) for k, v in (await lab_keys(lab)).items()} == held

            # 2. The new leader crashes too: 1 of 3 left, quorum lost.
            await second.kill()
            t_lost = time.monotonic()
            timings["quorum lost -> every agent reports etcd disconnected"] = await every_agent(
                lab, lambda n: not connected(n), 30, "every agent to report the datastore disconnected"
            )
            # Hold the outage longer than the lease TTL: nothing may expire, move or be withdrawn.
            # (An agent may briefly read "connected" again: a member that has not yet noticed it
            # lost its leader accepts a watch for up to an election timeout. What matters is that
            # nothing is lost or renumbered while quorum is gone, and that it comes back.)
            async def nothing_lost() -> bool:
                return (all(http_status(n, "/healthz") == 200 and http_status(n, "/readyz") == 200 for n in lab.nodes)
                        and all((await lab.ready.reachability()).values()) and lab.subnets() == subnets)

            await aholds(nothing_lost, max(0.0, t_lost + 1.5 * ttl - time.monotonic()), interval=1.0,
                         what="every node healthy, ready, reachable and on its subnet without quorum")

            # 3. Both come back: quorum again; the agents reconnect and refresh their leases.
            before = {n.name: renewals(n) for n in lab.nodes}
            t_restart = time.monotonic()
            timings["quorum lost at"] = t_lost - t0
            restart = asyncio.gather(leader.start(), second.start())  # each returns once healthy
            await lab.etcd.wait_leader()  # polled while the members start: the moment quorum is back
            t_back = time.monotonic()
            await restart
            timings["quorum back at"] = t_back - t0
            timings["members restarted -> leader elected"] = t_back - t_restart
            await every_agent(lab, connected, 30, "every agent to report the datastore connected")
            timings["quorum back -> every agent reconnected (at most)"] = time.monotonic() - t_back
            await every_agent(lab, lambda n: renewals(n) >= before[n.name] + 2, 30, "two lease keep-alives after quorum")
            timings["quorum back -> every agent renewed its lease twice"] = time.monotonic() - t_back
            await every_agent(lab, lambda n: http_status(n, "/readyz") == 200, 30, "/readyz 200")
        for p in pingers:  # answers after quorum is back: every echo sent before is checked
            await asyncio.to_thread(p.wait_replies, 5, more=True)
        results = [p.stop() for p in pingers]
    finally:
        for p in pingers:
            p.close()
        deleted = []
        for m in monitors:
            m.terminate()
            out, _ = m.communicate(timeout=5)
            deleted += [line for line in out.splitlines() if line.startswith("Deleted")]

    # 0 routes lost, at any time, on any node; and none deleted, even for a moment.
    assert kernel.samples and not kernel.errors, kernel.errors
    changed = [
        (round(t - t0, 2), name, sorted(got))
        for t, sample in kernel.samples
        for name, (got, _) in sample.items()
        if got != routes[name]
    ]
    assert not changed, changed[:3]
    assert not deleted, deleted
    for sent, missing in results:  # echoes after the last answer may still have been on their way
        assert sent > 50 and not missing, results
    # 0 subnets renumbered; the same node keys and subnet keys on the same leases, refreshed.
    assert lab.subnets() == subnets
    keys = await lab_keys(lab)
    assert {k: (v["value"], v["lease"]) for k, v in keys.items()} == held
    # Keep-alives every ttl/3 keep the remaining TTL above half of it (etcd may add an election
    # timeout on top after a leader change).
    assert all(v["ttl"] > ttl / 2 for v in keys.values() if v["lease"]), keys

    # A node joining afterwards gets a fresh subnet that overlaps none, and routes everywhere.
    node4 = await lab.add_node()
    new = IPv4Network(lab.subnets()[node4.name])
    assert all(not new.overlaps(IPv4Network(s)) for s in subnets.values())
    await lab.ready.routes(30)
    assert len([k for k in await lab_keys(lab) if k.startswith("/agentd/subnets/")]) == 4

    print(f"\nkernel route samples: {len(kernel.samples)} per node (every 0.15 s); pings {results}")
    for what, seconds in timings.items():
        print(f"  {what}: {seconds:.2f}s")
    print(f"  datastore disconnected (s after the leader kill): {disconnected_spans(kernel.samples, t0)}")


async def test_lab_agents_move_off_an_etcd_member_cut_off_the_network(lab_factory):
    """A partition, not a crash: the member's link goes down, nothing is reset, its packets
    vanish.  The agent talking to it must notice by itself (request deadline, gRPC keepalive),
    move to another member and keep its lease; no route changes anywhere."""
    ttl = 10
    lab = await lab_factory(nodes=3, pods=0, etcd=3, lease_ttl=ttl)
    node1 = lab.nodes[0]
    routes = {n.name: frozenset(n.kernel_routes()) for n in lab.nodes}
    held = {k: (v["value"], v["lease"]) for k, v in (await lab_keys(lab)).items()}
    used = node1.api("/status")["datastore"]["endpoint"]
    member = next(m for m in lab.etcd.members if m.endpoint == used)
    with Watch(probe(lab), interval=0.15) as kernel:
        before = {n.name: renewals(n) for n in lab.nodes}
        t0 = time.monotonic()
        lab.network.cut(member)
        moved = await every_agent(
            lab, lambda n: n is not node1 or n.api("/status")["datastore"]["endpoint"] != used, 30, "node1 to move"
        )
        await every_agent(lab, lambda n: renewals(n) >= before[n.name] + 2, 30, "two lease keep-alives on every agent")
        renewed = time.monotonic() - t0
        leader = await lab.etcd.wait_leader(other_than=member)
        # The others go on without it; a node joining meanwhile is seen by every agent.
        node4 = await lab.add_node()
        await lab.ready.routes(60, nodes=lab.nodes[:3])
        lab.network.mend(member)
        # etcd 3.4 runs without pre-vote: the member comes back with a higher term and forces
        # an election; the agents ride through that too.
        await until(lambda: _rejoined(lab, member), 30, "the cut member to rejoin the cluster")
        await every_agent(lab, connected, 30, "every agent connected")
    assert not kernel.errors, kernel.errors
    changed = [
        (round(t - t0, 2), name, sorted(got))
        for t, sample in kernel.samples
        for name, (got, _) in sample.items()
        if name in routes and not routes[name] <= got  # node4's route may only be added
    ]
    assert not changed, changed[:3]
    now = {k: (v["value"], v["lease"]) for k, v in (await lab_keys(lab)).items()}
    assert {k: v for k, v in now.items() if k in held} == held
    assert lab.subnets()[node4.name] not in {v[0].get("subnet") for v in held.values()}
    print(
        f"\ncut {member.name} (leader now {leader.name}); node1 moved off it after {moved:.2f}s, "
        f"every agent renewed twice after {renewed:.2f}s; "
        f"datastore disconnected: {disconnected_spans(kernel.samples, t0)}"
    )


async def _rejoined(lab, member) -> bool:
    roles = await lab.etcd.roles()
    return roles[member.name] != "down" and "leader" in roles.values()
