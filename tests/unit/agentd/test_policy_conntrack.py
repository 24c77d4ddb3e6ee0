"""The conntrack entries of a local pod's former addresses go when its endpoint file goes
(agentd/policy/conntrack.py): which addresses, which entries, the DELETE sent for one, and
the policy agent flushing them after the sync that took the pod out.  Pure; the kernel's
side is tests/system/test_netpol.py."""

from __future__ import annotations

import asyncio
import os
import socket
from types import SimpleNamespace

from agentd.cni import endpoints
from agentd.datastore.store import Datastore
from agentd.kernel import netlink as nl
from agentd.kernel.netlink_ct import (
    CTA_ID,
    CTA_TUPLE_ORIG,
    CTA_TUPLE_REPLY,
    IPCTNL_MSG_CT_DELETE,
    MSG_NEW,
    CtTuple,
    decode_event,
    encode_tuple,
    message,
)
from agentd.policy import agent as policy_agent
from agentd.policy import conntrack
from agentd.policy.agent import PolicyAgent


def ep(cid: str, name: str, *ips: str, written: int = 0) -> endpoints.Endpoint:
    return endpoints.Endpoint(cid, "x", name, {}, [], list(ips), f"veth-{cid}", "02:00:00:00:00:02", "cni0", written=written)


def test_a_pod_going_releases_its_addresses_both_families():
    before = conntrack.owners([ep("c1", "a", "10.244.1.5", "fd00:10:244:1:0::5"), ep("c2", "b", "10.244.1.6")])
    assert before == {"10.244.1.5": "c1", "fd00:10:244:1::5": "c1", "10.244.1.6": "c2"}  # normalised
    after = conntrack.owners([ep("c2", "b", "10.244.1.6")])
    assert conntrack.released(before, after) == {"10.244.1.5", "fd00:10:244:1::5"}
    assert conntrack.released(after, after) == set()


def test_an_address_handed_to_a_new_pod_in_one_rescan_is_released():
    before = conntrack.owners([ep("c1", "a", "10.244.1.5", written=1)])
    after = conntrack.owners([ep("c9", "new", "10.244.1.5", written=2)])
    assert conntrack.released(before, after) == {"10.244.1.5"}
    # A pod's addresses changing releases the old one only.
    assert conntrack.released(before, conntrack.owners([ep("c1", "a", "10.244.1.7")])) == {"10.244.1.5"}


def test_a_stale_file_going_releases_nothing_the_newer_pod_has():
    stale, fresh = ep("c1", "old", "10.244.1.5", written=1), ep("c9", "new", "10.244.1.5", written=2)
    before = conntrack.owners([stale, fresh])
    assert before == {"10.244.1.5": "c9"}
    assert conntrack.released(before, conntrack.owners([fresh])) == set()
    # The newer pod going while the stale file stays: its flows go all the same.
    assert conntrack.released(before, conntrack.owners([stale])) == {"10.244.1.5"}


def _dumped(orig: CtTuple, reply: CtTuple, ident: int) -> tuple[int, bytes, int, int]:
    """One dump answer as the socket hands it: (type, buf, body start, body end)."""
    body = encode_tuple(CTA_TUPLE_ORIG, orig) + encode_tuple(CTA_TUPLE_REPLY, reply) + nl.attr(CTA_ID, ident.to_bytes(4, "big"))
    msg = message(0, 1, nl.NLM_F_MULTI, body, socket.AF_INET)
    return MSG_NEW, msg, nl.NLMSG_HDRLEN, len(msg)


def test_entries_with_the_address_at_either_end_either_way_go():
    gone = {"10.244.1.5"}
    udp_to = _dumped(CtTuple("10.244.2.9", "10.244.1.5", 17, 5000, 53), CtTuple("10.244.1.5", "10.244.2.9", 17, 53, 5000), 1)
    dnat_to = _dumped(CtTuple("10.244.2.9", "10.96.0.10", 17, 5000, 53), CtTuple("10.244.1.5", "10.244.2.9", 17, 53, 5000), 2)
    snat_from = _dumped(CtTuple("10.244.1.5", "1.1.1.1", 6, 4000, 443), CtTuple("1.1.1.1", "192.168.1.1", 6, 443, 4000), 3)
    other = _dumped(CtTuple("10.244.2.9", "10.244.1.6", 17, 5000, 53), CtTuple("10.244.1.6", "10.244.2.9", 17, 53, 5000), 4)
    got = [conntrack.touches(decode_event(*d), gone) for d in (udp_to, dnat_to, snat_from, other)]
    assert got == [True, True, True, False]


def test_a_delete_names_the_entry_by_its_dumped_tuple_and_id():
    orig = CtTuple("10.244.2.9", "10.244.1.5", 17, 5000, 53)
    _, buf, start, end = _dumped(orig, CtTuple("10.244.1.5", "10.244.2.9", 17, 53, 5000), 77)
    body = conntrack.delete_body(buf, start, end)
    assert body is not None
    request = message(IPCTNL_MSG_CT_DELETE, 2, nl.NLM_F_REQUEST, body, socket.AF_INET)
    attrs = {atype: bytes(request[vs:ve]) for atype, vs, ve in nl.iter_attrs(request, nl.NLMSG_HDRLEN + nl.NFGENMSG_LEN, len(request))}
    assert set(attrs) == {CTA_TUPLE_ORIG, CTA_ID}  # never without a tuple: that would flush the table
    assert attrs[CTA_ID] == (77).to_bytes(4, "big")
    assert attrs[CTA_TUPLE_ORIG] == encode_tuple(CTA_TUPLE_ORIG, orig)[4:]


class Programmer:
    current = None

    async def sync(self, rs, keys):
        self.current = rs
        return SimpleNamespace(commands=1, full=keys is None, seconds=0.0)


async def test_the_agent_flushes_a_removed_pods_addresses_after_the_sync(tmp_path, monkeypatch):
    flushed: list[list[str]] = []
    monkeypatch.setattr(policy_agent.conntrack, "flush_addresses", lambda gone: flushed.append(list(gone)) or 3)
    agent = PolicyAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"), str(tmp_path))
    agent.programmer = Programmer()  # type: ignore[assignment]
    agent._have_snapshot = True
    task = asyncio.get_running_loop().create_task(agent._sync_loop())

    async def synced() -> None:
        syncs = agent.syncs
        agent._wake.set()
        while agent.syncs == syncs:
            await asyncio.sleep(0)

    try:
        endpoints.write(tmp_path, ep("c1", "a", "10.244.1.5"))
        endpoints.write(tmp_path, ep("c2", "b", "10.244.1.6"))
        agent._rescan()
        await synced()
        async with asyncio.timeout(5):  # the sync's last step (after any flush): both pods acknowledged
            while not {"c1", "c2"} <= {cid for cid, _ in agent._acked}:
                await asyncio.sleep(0)
        assert flushed == [] and agent.conntrack_flushed == 0  # first sight of the files: nothing was anyone's
        os.unlink(os.path.join(endpoints.endpoints_dir(tmp_path), "c1.json"))
        agent._rescan()
        await synced()
        async with asyncio.timeout(5):
            while agent.conntrack_flushed == 0:  # the flush runs in a thread, after the sync
                await asyncio.sleep(0)
        assert flushed == [["10.244.1.5"]] and agent.conntrack_flushed == 3
        assert not agent.engine.local.get(("x", "a"))  # out of the tables in that sync
    finally:
        task.cancel()


async def test_a_failed_flush_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    def broken(gone):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(policy_agent.conntrack, "flush_addresses", broken)
    agent = PolicyAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"), str(tmp_path))
    await agent._flush_released({"10.244.1.5"})
    assert "not deleted" in caplog.text and "10.244.1.5" in caplog.text


class SlowProgrammer(Programmer):
    """A sync that waits until the test lets it finish."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def sync(self, rs, keys):
        self.entered.set()
        await self.release.wait()
        self.release.clear()  # one sync per release
        return await super().sync(rs, keys)


async def test_an_address_released_while_a_sync_runs_waits_for_the_sync_that_takes_it_out(tmp_path, monkeypatch):
    # The file goes while the previous build is being applied: that build still gives the
    # address to the old pod, so its flows are flushed only after the next sync.
    flushed: list[list[str]] = []
    monkeypatch.setattr(policy_agent.conntrack, "flush_addresses", lambda gone: flushed.append(list(gone)) or 1)
    agent = PolicyAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"), str(tmp_path))
    agent.programmer = programmer = SlowProgrammer()  # type: ignore[assignment]
    agent._have_snapshot = True
    endpoints.write(tmp_path, ep("c1", "a", "10.244.1.5"))
    endpoints.write(tmp_path, ep("c2", "b", "10.244.1.6"))
    agent._rescan()
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        async with asyncio.timeout(5):
            await programmer.entered.wait()  # the first build (both pods) is being applied
            programmer.entered.clear()
            os.unlink(os.path.join(endpoints.endpoints_dir(tmp_path), "c1.json"))
            agent._rescan()  # released now, mid-sync
            programmer.release.set()
            await programmer.entered.wait()  # the next build (without c1) waits to be applied
            assert agent.syncs == 1 and flushed == []  # nothing flushed after the build that still had c1
            programmer.release.set()
            while agent.conntrack_flushed == 0:
                await asyncio.sleep(0)
        assert flushed == [["10.244.1.5"]] and agent.syncs == 2
    finally:
        task.cancel()


async def test_a_failed_fast_path_update_is_retried_without_another_change(tmp_path):
    """set_pods failing (a tc attach error) as a new pod takes an address left the map
    pointing at the old pod's veth until some unrelated change: the rescan retries it."""

    class FastPath:
        def __init__(self) -> None:
            self.calls: list[dict[str, str]] = []
            self.fail = True

        def set_pods(self, pods: dict[str, str]) -> None:
            self.calls.append(dict(pods))
            if self.fail:
                raise OSError("attaching agentd_pod_fast to veth-c1: No such device")

    fast = FastPath()
    agent = PolicyAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"), str(tmp_path), fast_path=fast)  # type: ignore[arg-type]
    agent.programmer = Programmer()  # type: ignore[assignment]
    agent._have_snapshot = True
    tasks = [asyncio.get_running_loop().create_task(agent._sync_loop())]
    try:
        endpoints.write(tmp_path, ep("c1", "a", "10.244.1.5"))
        agent._rescan()
        agent._wake.set()
        async with asyncio.timeout(5):
            while agent.fast_path_error is None:
                await asyncio.sleep(0)
        assert fast.calls == [{"10.244.1.5": "veth-c1"}]
        fast.fail = False
        tasks.append(asyncio.get_running_loop().create_task(agent._rescan_loop()))  # nothing changed: only the retry
        async with asyncio.timeout(5):
            while agent.fast_path_error is not None:
                await asyncio.sleep(0)
        assert fast.calls[-1] == {"10.244.1.5": "veth-c1"} and agent.syncs == 1
    finally:
        for t in tasks:
            t.cancel()


async def test_a_held_endpoints_lock_skips_the_acknowledgement_not_the_agent(tmp_path, monkeypatch):
    """Anyone holding endpoints/.lock must not stop the event loop: the build goes on, its
    pods are acknowledged once the lock is free again (the loop woken after ACK_RETRY)."""
    import fcntl
    import threading

    monkeypatch.setattr(endpoints, "AGENT_LOCK_PAUSE", 0.0, raising=False)
    monkeypatch.setattr(policy_agent, "ACK_RETRY", 0.0, raising=False)
    agent = PolicyAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"), str(tmp_path))
    agent.programmer = Programmer()  # type: ignore[assignment]
    agent._have_snapshot = True
    endpoints.write(tmp_path, ep("c1", "a", "10.244.1.5"))
    fd = os.open(os.path.join(endpoints.endpoints_dir(tmp_path), endpoints.LOCK), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    timer = threading.Timer(5.0, fcntl.flock, (fd, fcntl.LOCK_UN))  # a blocking agent fails, not hangs
    timer.start()
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        agent._rescan()
        agent._wake.set()
        async with asyncio.timeout(5):
            while agent._ack_pending is None:
                await asyncio.sleep(0)
        assert agent.syncs == 1 and agent._acked == set()
        assert endpoints.unacknowledged(str(tmp_path), {"c1"}) == {"c1"}
        fcntl.flock(fd, fcntl.LOCK_UN)
        async with asyncio.timeout(5):
            while agent._ack_pending is not None:
                await asyncio.sleep(0)
        assert {cid for cid, _ in agent._acked} == {"c1"} and agent.syncs == 1  # no second build
        assert endpoints.unacknowledged(str(tmp_path), {"c1"}) == set()
    finally:
        timer.cancel()
        os.close(fd)
        task.cancel()


async def test_a_new_file_with_the_same_content_is_acknowledged_without_a_build(tmp_path):
    """DEL and ADD of one container ID, the new file saying what the old one did (within one
    mtime tick, too): the tables need no change, so no build comes -- but the ADD waits for
    its file's acknowledgement (write() removed the old one's) and must get it at once, not
    after its policyTimeout."""
    agent = PolicyAgent("node1", Datastore(["http://127.0.0.1:2379"], "/agentd"), str(tmp_path))
    agent.programmer = Programmer()  # type: ignore[assignment]
    agent._have_snapshot = True
    path = os.path.join(endpoints.endpoints_dir(tmp_path), "c1.json")
    endpoints.write(tmp_path, ep("c1", "a", "10.244.1.5"))
    os.utime(path, ns=(1_000, 1_000))
    agent._rescan()
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        async with asyncio.timeout(5):
            while endpoints.unacknowledged(str(tmp_path), {"c1"}):
                await asyncio.sleep(0)
        assert agent.syncs == 1
        for mtime in (1_000, 2_000):  # the same tick, and a later one
            endpoints.remove(tmp_path, "c1")
            endpoints.write(tmp_path, ep("c1", "a", "10.244.1.5"))
            os.utime(path, ns=(mtime, mtime))
            assert endpoints.unacknowledged(str(tmp_path), {"c1"}) == {"c1"}  # ADD waits
            agent._rescan()
            async with asyncio.timeout(5):
                while endpoints.unacknowledged(str(tmp_path), {"c1"}):
                    await asyncio.sleep(0)
            assert {cid for cid, _ in agent._acked} == {"c1"}
    finally:
        task.cancel()
