"""The MACs of local pods whose endpoint file names none (agentd/policy/podmacs.py and the
policy agent's side of it): read from the other end of the pod's veth off the event loop,
one netlink socket per batch; a failed read tried again at later rescans (said once); the
first MAC taken kept across agent restarts; a MAC that cannot be the pod's own refused, its
port cut off."""

from __future__ import annotations

import errno
import json
import logging
import threading
from pathlib import Path
from typing import Any, ClassVar, Self

from agentd.cni import endpoints
from agentd.datastore.store import Datastore
from agentd.kernel import netlink as nl
from agentd.policy import compiler
from agentd.policy.agent import PolicyAgent
from agentd.policy.podmacs import STATE_FILE, refusal, remove_state

NODE = "node1"
MAC_A, MAC_B, MAC_C = "0a:58:0a:f4:01:05", "0a:58:0a:f4:01:06", "0a:58:0a:f4:01:07"
BRIDGE_MAC = "0a:58:0a:f4:01:01"


def datastore() -> Datastore:
    return Datastore(["http://127.0.0.1:2379"], "/agentd")  # never connected


def endpoint(cid: str, name: str, ip: str, *, pod_mac: str = "", bridge: str = "cni0") -> endpoints.Endpoint:
    return endpoints.Endpoint(cid, "x", name, {"app": name}, [], [ip], f"veth-{cid}", f"02:00:00:00:01:{int(ip.rsplit('.', 1)[1]):02x}",
                              bridge, pod_mac=pod_mac)  # fmt: skip


def sets(agent: PolicyAgent) -> tuple[set[str], set[tuple[str, str]]]:
    """The bridge table's mac-ports and pod-macs as built."""
    rs = agent.engine.build()
    ports = rs.objects[("bridge", compiler.TABLE, "set", compiler.MAC_PORTS)]
    macs = rs.objects[("bridge", compiler.TABLE, "set", compiler.POD_MACS)]
    return {str(e) for e in ports.elements}, {tuple(map(str, e)) for e in macs.elements}  # type: ignore[union-attr]


async def rescan(agent: PolicyAgent) -> None:
    """What the rescan loop does once: read the files, try the MACs not taken yet, record them."""
    agent._rescan()
    await agent._read_pod_macs(retry=True)
    await agent._record_pod_macs()


def interfaces(macs: dict[str, str]) -> tuple[dict[str, str], list[str], Any]:
    """The pods' interfaces' MACs as the agent reads them (``macs``, changed by the test as a
    pod would), the interfaces asked, and the ``peer_mac`` that reads them."""
    asked: list[str] = []

    def peer_mac(interface: str) -> str:
        asked.append(interface)
        return macs[interface]

    return macs, asked, peer_mac


def said(caplog: Any, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


async def test_a_failed_read_is_tried_again_at_later_rescans_and_said_once(tmp_path, caplog):
    """One transient error (EMFILE, ENOBUFS, a timeout) must not leave the pod unchecked until
    it is added again: only a read that worked is kept, a failed one is tried again at the
    next rescans (not at every sync), its warning said once."""
    calls: list[str] = []
    fail = [OSError(errno.EMFILE, "Too many open files"), OSError(errno.ENOBUFS, "No buffer space available")]

    def peer_mac(interface: str) -> str:
        calls.append(interface)
        if fail:
            raise fail.pop(0)
        return MAC_A

    agent = PolicyAgent(NODE, datastore(), str(tmp_path / "cni"), peer_mac=peer_mac)
    endpoints.write(tmp_path / "cni", endpoint("c1", "a", "10.244.1.5"))
    with caplog.at_level(logging.INFO):
        agent._rescan()
        assert calls == []  # never on the event loop's turn of the rescan itself
        await agent._read_pod_macs(retry=False)  # the sync loop: the new pod's MAC, before its build
        assert calls == ["veth-c1"] and agent.unchecked_macs == {"x/a": "[Errno 24] Too many open files"}
        await agent._read_pod_macs(retry=False)  # the next sync: not tried at every sync
        assert calls == ["veth-c1"]
        await rescan(agent)  # tried again: fails again, not said again
        assert calls == ["veth-c1"] * 2 and agent.unchecked_macs == {"x/a": "[Errno 105] No buffer space available"}
        assert agent.engine.local[("x", "a")].pod_mac == ""
        await rescan(agent)  # and now it works
        assert calls == ["veth-c1"] * 3 and agent.engine.local[("x", "a")].pod_mac == MAC_A
        assert agent.unchecked_macs == {} and agent.views.status()["unchecked_macs"] == {}
        assert sets(agent) == ({"veth-c1"}, {("veth-c1", MAC_A)})
        await rescan(agent)
        await agent._read_pod_macs(retry=False)
    assert calls == ["veth-c1"] * 3  # taken: never read again for this file
    assert said(caplog, "its interface's cannot be read") == 1
    assert said(caplog, f"{MAC_A}, read from the other end of veth-c1, is checked") == 1


async def test_the_first_mac_taken_sticks_across_agent_restarts(tmp_path, caplog):
    """A pod (with NET_ADMIN) that sets another pod's MAC on its interface is cut off; an
    agent restarted must not read it anew and trust that MAC on the pod's port.  The first
    MAC taken for a file is kept in the state directory (by container ID and the file's
    ident, written atomically); a new file (a new ADD) is read anew; a file gone is forgotten."""
    cni, state = tmp_path / "cni", tmp_path / "state"
    now, asked, peer_mac = interfaces({"veth-c1": MAC_A})

    agent = PolicyAgent(NODE, datastore(), str(cni), peer_mac=peer_mac, state_dir=state)
    endpoints.write(cni, endpoint("c1", "a", "10.244.1.5"))
    await rescan(agent)
    assert agent.engine.local[("x", "a")].pod_mac == MAC_A

    now["veth-c1"] = MAC_C  # the pod changes its MAC (to another pod's: cut off by the check)...
    again = PolicyAgent(NODE, datastore(), str(cni), peer_mac=peer_mac, state_dir=state)  # ...and the agent restarts
    await rescan(again)
    assert again.engine.local[("x", "a")].pod_mac == MAC_A and asked == ["veth-c1"]
    assert sets(again) == ({"veth-c1"}, {("veth-c1", MAC_A)})
    ident = agent.publisher.endpoints["c1"].ident
    assert json.loads((state / STATE_FILE).read_text()) == {"pods": {"c1": {"ident": ident, "mac": MAC_A}}}
    assert [p.name for p in state.iterdir()] == [STATE_FILE]  # no temporary file left

    # A new ADD of the container (a new file): its interface is read anew.
    endpoints.write(cni, endpoint("c1", "a", "10.244.1.5"))
    await rescan(again)
    assert again.engine.local[("x", "a")].pod_mac == MAC_C and asked == ["veth-c1"] * 2
    assert json.loads((state / STATE_FILE).read_text())["pods"]["c1"]["mac"] == MAC_C
    # Its file gone, it is forgotten (in the state file too).
    endpoints.remove(cni, "c1")
    await rescan(again)
    assert json.loads((state / STATE_FILE).read_text()) == {"pods": {}}

    # A state file that cannot be read is said, and the MACs are read again.
    (state / STATE_FILE).write_text("{not json")
    endpoints.write(cni, endpoint("c1", "a", "10.244.1.5"))
    with caplog.at_level(logging.WARNING):
        third = PolicyAgent(NODE, datastore(), str(cni), peer_mac=peer_mac, state_dir=state)
        await rescan(third)
    assert third.engine.local[("x", "a")].pod_mac == MAC_C and said(caplog, "are read again") == 1


async def test_the_leave_removes_the_state_file_and_it_is_not_written_again(tmp_path):
    """`agentd leave` left pod-macs.json behind: a node that rejoined with the same state
    directory took a departed pod's MAC for a new pod of the same container ID and file.
    The policy agent's leave removes it (a write's temporary file too); a write that comes
    after (a rescan's, its task cancelled while its thread ran) writes nothing."""
    cni, state = tmp_path / "cni", tmp_path / "state"
    _now, _asked, peer_mac = interfaces({"veth-c1": MAC_A, "veth-c2": MAC_B})
    agent = PolicyAgent(NODE, datastore(), str(cni), peer_mac=peer_mac, state_dir=state)
    endpoints.write(cni, endpoint("c1", "a", "10.244.1.5"))
    await rescan(agent)
    (state / f".{STATE_FILE}.tmp").write_text("{")  # a write cut short
    assert (state / STATE_FILE).exists()
    assert await agent.remove_pod_macs() is True
    assert list(state.iterdir()) == []
    endpoints.write(cni, endpoint("c2", "b", "10.244.1.6"))
    await rescan(agent)  # a MAC taken: the write is asked for, and writes nothing
    assert agent.engine.local[("x", "b")].pod_mac == MAC_B and list(state.iterdir()) == []
    assert await agent.remove_pod_macs() is False  # nothing left: done all the same
    # Where no policy agent runs (`agentd leave` without an agent): removed alike.
    (state / STATE_FILE).write_text('{"pods": {}}\n')
    assert remove_state(state) is True and list(state.iterdir()) == []
    assert remove_state(tmp_path / "nowhere") is False


async def test_a_relabelled_file_of_an_older_agentd_cni_is_not_read_anew(tmp_path):
    """A file without a generation (an agentd-cni older than those, which also wrote no
    pod_mac) is told from the next by inode, mtime and size: a relabel (``agentd label pod``)
    gives it a new inode.  Its pod's MAC is not read anew for that (the pod may have changed
    it since); the relabel keeps the file's mtime, which is what the MAC is kept by."""
    cni, state = tmp_path / "cni", tmp_path / "state"
    now, asked, peer_mac = interfaces({"veth-c1": MAC_A})

    old = endpoint("c1", "a", "10.244.1.5")
    directory = Path(endpoints.endpoints_dir(cni))
    directory.mkdir(parents=True)
    (directory / "c1.json").write_text(old.to_json())  # no generation: an older agentd-cni's
    agent = PolicyAgent(NODE, datastore(), str(cni), peer_mac=peer_mac, state_dir=state)
    await rescan(agent)
    ep = agent.publisher.endpoints["c1"]
    assert ep.ident.startswith("s:") and agent.engine.local[("x", "a")].pod_mac == MAC_A
    now["veth-c1"] = MAC_C
    relabelled = endpoints.relabel(cni, ep, {"app": "a", "tier": "x"})
    assert relabelled is not None and relabelled.ident != ep.ident
    await rescan(agent)
    assert agent.publisher.endpoints["c1"].labels == {"app": "a", "tier": "x"}
    assert agent.engine.local[("x", "a")].pod_mac == MAC_A and asked == ["veth-c1"]
    again = PolicyAgent(NODE, datastore(), str(cni), peer_mac=peer_mac, state_dir=state)  # and after a restart
    await rescan(again)
    assert again.engine.local[("x", "a")].pod_mac == MAC_A and asked == ["veth-c1"]


async def test_a_mac_read_that_cannot_be_the_pods_own_is_refused_and_its_port_cut_off(tmp_path, caplog):
    """A MAC read that is a group address, the bridge's, a host-side veth's or another pod's
    of the same bridge (its file's, or read earlier) is refused: the port is checked against
    no MAC (every frame dropped, spoofed-mac) and listed in /status, said once.  Left unchecked
    it could send with that very MAC.  A later read of a MAC of its own is taken; a read that
    fails meanwhile leaves it cut off."""
    cni = tmp_path / "cni"
    now: dict[str, Any] = {}

    def peer_mac(interface: str) -> str:
        got = now[interface]
        if isinstance(got, Exception):
            raise got
        return got

    agent = PolicyAgent(NODE, datastore(), str(cni), peer_mac=peer_mac,
                        bridge_mac=lambda b: BRIDGE_MAC if b == "cni0" else "0a:58:0a:f4:02:01")
    endpoints.write(cni, endpoint("c2", "b", "10.244.1.6", pod_mac=MAC_B))  # b's file names its MAC
    endpoints.write(cni, endpoint("c1", "a", "10.244.1.5"))
    victims = {MAC_B: "pod x/b's", BRIDGE_MAC: "the bridge cni0's", "02:00:00:00:01:06": "the host side of veth-c2's",
               "01:00:5e:00:00:01": "group", "ff:ff:ff:ff:ff:ff": "group"}  # fmt: skip
    with caplog.at_level(logging.WARNING):
        for mac, whose in victims.items():
            now["veth-c1"] = mac
            endpoints.write(cni, endpoint("c1", "a", "10.244.1.5"))  # a new file for each: read anew
            await rescan(agent)
            assert agent.engine.local[("x", "a")].pod_mac == "" and agent.engine.local[("x", "a")].mac_refused, mac
            assert whose in agent.refused_macs["x/a"] and agent.unchecked_macs == {}, mac
            assert sets(agent) == ({"veth-c1", "veth-c2"}, {("veth-c2", MAC_B)}), mac  # a checked against none
            assert agent.views.status()["refused_macs"] == agent.refused_macs
    assert said(caplog, "is refused") == len(victims)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        now["veth-c1"] = LookupError("no device veth-c1")  # a failed read does not undo the refusal
        await rescan(agent)
        assert agent.engine.local[("x", "a")].mac_refused and "group" in agent.refused_macs["x/a"]
        now["veth-c1"] = MAC_B
        await rescan(agent)  # refused again: not said again
    assert caplog.records == []
    now["veth-c1"] = MAC_A  # its own MAC back: taken
    await rescan(agent)
    assert agent.engine.local[("x", "a")].pod_mac == MAC_A and agent.refused_macs == {}
    assert sets(agent) == ({"veth-c1", "veth-c2"}, {("veth-c1", MAC_A), ("veth-c2", MAC_B)})

    # Two pods read in one batch with one MAC: neither's to take.  On another bridge it is not
    # this bridge's (its forwarding database is its own).
    now.update({"veth-c3": MAC_C, "veth-c4": MAC_C, "veth-c5": MAC_A})
    endpoints.write(cni, endpoint("c3", "c", "10.244.1.7"))
    endpoints.write(cni, endpoint("c4", "d", "10.244.1.8"))
    endpoints.write(cni, endpoint("c5", "e", "10.244.1.9", bridge="cni1"))
    await rescan(agent)
    assert set(agent.refused_macs) == {"x/c", "x/d"} and "pod x/d's" in agent.refused_macs["x/c"]
    assert agent.engine.local[("x", "e")].pod_mac == MAC_A
    # A MAC read earlier is another pod's too.
    now["veth-c3"] = MAC_A
    await rescan(agent)
    assert "pod x/a's" in agent.refused_macs["x/c"]


def test_what_a_mac_read_may_not_be():
    assert refusal(MAC_A, {}) == ""
    assert "group" in refusal("33:33:00:00:00:01", {}) and "group" in refusal("FF:FF:FF:FF:FF:FF", {})
    assert "all-zero" in refusal("00:00:00:00:00:00", {})
    assert refusal(MAC_A.upper(), {MAC_A: "pod x/b's"}) == f"{MAC_A.upper()} is pod x/b's"
    assert "no MAC" in refusal("0a:58", {}) and "no MAC" in refusal("zz:58:0a:f4:01:05", {})


class FakeRtnl:
    """The netlink session read_links opens: counted, with the thread it is used on."""

    opened: ClassVar[list[FakeRtnl]] = []

    def __init__(self) -> None:
        self.threads: set[int] = set()
        self.asked: list[str] = []
        self.closed = False
        FakeRtnl.opened.append(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True

    def peer_mac(self, name: str) -> str:
        self.threads.add(threading.get_ident())
        self.asked.append(name)
        if name == "veth-c3":
            raise nl.NetlinkError(errno.ETIMEDOUT, None, "looking up device veth-c3")
        return f"0a:58:0a:f4:01:{int(name[-1]) + 4:02x}"

    def link(self, name: str) -> nl.LinkMessage | None:
        self.threads.add(threading.get_ident())
        return nl.LinkMessage(9, name, 0, address=bytes.fromhex("0a580af40101"))


async def test_macs_are_read_off_the_event_loop_with_one_socket_per_batch(tmp_path, monkeypatch):
    """The reads block (two netlink requests each, up to 10 s): they run in a thread, every
    pod's of one batch with one socket, and what they found is fed in after."""
    from agentd.kernel import rtnl

    FakeRtnl.opened.clear()
    monkeypatch.setattr(rtnl, "Rtnl", FakeRtnl)
    cni = tmp_path / "cni"
    agent = PolicyAgent(NODE, datastore(), str(cni))
    for i in (1, 2, 3):
        endpoints.write(cni, endpoint(f"c{i}", f"p{i}", f"10.244.1.{4 + i}"))
    agent._rescan()
    assert FakeRtnl.opened == []  # the rescan itself reads nothing
    await agent._read_pod_macs(retry=False)
    (rt,) = FakeRtnl.opened
    assert sorted(rt.asked) == ["veth-c1", "veth-c2", "veth-c3"] and rt.closed
    assert threading.get_ident() not in rt.threads and len(rt.threads) == 1
    assert agent.engine.local[("x", "p1")].pod_mac == "0a:58:0a:f4:01:05"
    assert agent.engine.local[("x", "p2")].pod_mac == "0a:58:0a:f4:01:06"
    assert "ETIMEDOUT" in agent.unchecked_macs["x/p3"] or "timed out" in agent.unchecked_macs["x/p3"]
    await agent._read_pod_macs(retry=False)
    assert len(FakeRtnl.opened) == 1  # nothing new to read: no socket
    await agent._read_pod_macs(retry=True)
    assert len(FakeRtnl.opened) == 2 and FakeRtnl.opened[1].asked == ["veth-c3"]


async def test_a_bridge_whose_mac_cannot_be_read_fails_the_reads_of_its_pods(tmp_path):
    """A MAC not checked against its bridge's is not taken: the read is tried again."""
    calls = []

    def bridge_mac(name: str) -> str | None:
        calls.append(name)
        if len(calls) == 1:
            raise OSError(errno.ENOBUFS, "No buffer space available")
        return BRIDGE_MAC

    agent = PolicyAgent(NODE, datastore(), str(tmp_path), peer_mac=lambda i: MAC_A, bridge_mac=bridge_mac)
    endpoints.write(tmp_path, endpoint("c1", "a", "10.244.1.5"))
    await rescan(agent)
    assert "bridge cni0" in agent.unchecked_macs["x/a"] and agent.engine.local[("x", "a")].pod_mac == ""
    await rescan(agent)
    assert agent.engine.local[("x", "a")].pod_mac == MAC_A and calls == ["cni0", "cni0"]


async def test_with_the_mac_check_off_nothing_is_read_or_kept(tmp_path):
    agent = PolicyAgent(NODE, datastore(), str(tmp_path / "cni"), peer_mac=lambda i: 1 / 0,  # type: ignore[arg-type,return-value]
                        check_source_mac=False, state_dir=tmp_path / "state")
    endpoints.write(tmp_path / "cni", endpoint("c1", "a", "10.244.1.5"))
    await rescan(agent)
    assert agent.unchecked_macs == {} and agent.refused_macs == {} and not (tmp_path / "state").exists()


class FastPath:
    """The pod fast path as the agent tells it its pods."""

    def __init__(self) -> None:
        self.pods: dict[str, str] | None = None

    def set_pods(self, wanted: dict[str, str]) -> None:
        self.pods = dict(wanted)


async def test_a_port_cut_off_for_its_mac_is_left_out_of_the_pod_fast_path(tmp_path):
    """The fast path carries a pod's established TCP from its veth past the bridge table:
    a port whose MAC was refused (every frame dropped) must not be in its pod map, nor its
    address handed to an older pod that had it; once its own MAC is taken it is back."""
    cni = tmp_path / "cni"
    now = {"veth-c1": BRIDGE_MAC}
    fast = FastPath()
    agent = PolicyAgent(NODE, datastore(), str(cni), peer_mac=lambda i: now[i], bridge_mac=lambda b: BRIDGE_MAC,
                        fast_path=fast)  # type: ignore[arg-type]
    stale = endpoint("c0", "old", "10.244.1.5", pod_mac=MAC_C)
    endpoints.write(cni, endpoint("c2", "b", "10.244.1.6", pod_mac=MAC_B))
    endpoints.write(cni, stale)
    endpoints.write(cni, endpoint("c1", "a", "10.244.1.5"))  # newer than c0's file: 10.244.1.5 is a's
    await rescan(agent)
    assert agent.engine.local[("x", "a")].mac_refused
    await agent._update_fast_path()
    assert fast.pods == {"10.244.1.6": "veth-c2"}
    now["veth-c1"] = MAC_A
    await rescan(agent)
    await agent._update_fast_path()
    assert fast.pods == {"10.244.1.5": "veth-c1", "10.244.1.6": "veth-c2"}


class Programmer:
    """The nft programmer as the sync loop drives it: keeps the ruleset it was given."""

    current: Any = None

    async def sync(self, rs: Any, keys: Any) -> Any:
        from types import SimpleNamespace

        self.current = rs
        return SimpleNamespace(commands=1, full=keys is None, seconds=0.0)


def programmed_macs(programmer: Programmer) -> set[tuple[str, str]]:
    macs = programmer.current.objects[("bridge", compiler.TABLE, "set", compiler.POD_MACS)]
    return {tuple(map(str, e)) for e in macs.elements}


async def test_a_file_that_comes_while_macs_are_read_is_not_acknowledged_before_its_mac_is_read(tmp_path, monkeypatch):
    """The sync loop reads new pods' MACs, then builds and acknowledges every file there is:
    a file that came (inotify, a rescan) while the read waited would be acknowledged -- its
    ADD returning -- with its port unchecked.  It waits for the next round, which reads it."""
    import asyncio

    cni = tmp_path / "cni"
    loop = asyncio.get_running_loop()
    acked: list[tuple[set[str], set[tuple[str, str]]]] = []  # what each ack marked, and the kernel's pod-macs then
    agent: PolicyAgent

    def peer_mac(interface: str) -> str:
        if interface == "veth-c1":  # a second ADD's file lands while this batch is read
            endpoints.write(cni, endpoint("c2", "b", "10.244.1.6"))
            done = threading.Event()
            loop.call_soon_threadsafe(lambda: (agent._rescan(), done.set()))
            assert done.wait(5)
        return {"veth-c1": MAC_A, "veth-c2": MAC_B}[interface]

    agent = PolicyAgent(NODE, datastore(), str(cni), peer_mac=peer_mac)
    agent.programmer = programmer = Programmer()  # type: ignore[assignment]
    agent._have_snapshot = True
    acknowledge = endpoints.acknowledge

    def recording(data_dir: Any, programmed: set[tuple[str, str]], before: set[tuple[str, str]]) -> Any:
        acked.append(({cid for cid, _ in programmed}, programmed_macs(programmer)))
        return acknowledge(data_dir, programmed, before)

    monkeypatch.setattr(endpoints, "acknowledge", recording)
    endpoints.write(cni, endpoint("c1", "a", "10.244.1.5"))
    agent._rescan()
    task = loop.create_task(agent._sync_loop())
    try:
        async with asyncio.timeout(5):
            while endpoints.unacknowledged(str(cni), {"c1", "c2"}):
                await asyncio.sleep(0)
    finally:
        task.cancel()
    for cids, macs in acked:
        assert {f"veth-{cid}" for cid in cids} <= {port for port, _ in macs}, (cids, macs)  # none acked unchecked
    assert programmed_macs(programmer) == {("veth-c1", MAC_A), ("veth-c2", MAC_B)}


async def test_the_sync_loop_waits_for_no_state_file_write_it_does_not_need(tmp_path, monkeypatch):
    """A write of the state file (an fsync) under way in the rescan loop must not hold up
    the sync loop where it has nothing to record; where it took a MAC, the MAC is in the
    state file before the pod's ADD is acknowledged (relied on across a restart from then)."""
    import asyncio

    cni, state = tmp_path / "cni", tmp_path / "state"
    agent = PolicyAgent(NODE, datastore(), str(cni), peer_mac=lambda i: {"veth-c1": MAC_A, "veth-c3": MAC_C}[i],
                        state_dir=state)
    endpoints.write(cni, endpoint("c1", "a", "10.244.1.5"))
    await rescan(agent)
    agent.programmer = Programmer()  # type: ignore[assignment]
    agent._have_snapshot = True
    recorded: list[tuple[set[str], set[str]]] = []  # what each ack marked, what the state file held then
    acknowledge = endpoints.acknowledge

    def recording(data_dir: Any, programmed: set[tuple[str, str]], before: set[tuple[str, str]]) -> Any:
        recorded.append(({cid for cid, _ in programmed}, set(json.loads((state / STATE_FILE).read_text())["pods"])))
        return acknowledge(data_dir, programmed, before)

    monkeypatch.setattr(endpoints, "acknowledge", recording)
    task = asyncio.get_running_loop().create_task(agent._sync_loop())
    try:
        async with asyncio.timeout(5):
            async with agent._pod_macs_lock:  # the rescan loop's write under way
                endpoints.write(cni, endpoint("c2", "b", "10.244.1.6", pod_mac=MAC_B))
                agent._rescan()
                while endpoints.unacknowledged(str(cni), {"c1", "c2"}):
                    await asyncio.sleep(0)
            endpoints.write(cni, endpoint("c3", "c", "10.244.1.7"))  # its MAC read by the sync loop
            agent._rescan()
            while endpoints.unacknowledged(str(cni), {"c3"}):
                await asyncio.sleep(0)
    finally:
        task.cancel()
    assert all("c3" in held for acked, held in recorded if "c3" in acked), recorded
    assert agent.engine.local[("x", "c")].pod_mac == MAC_C


async def test_a_mac_an_endpoint_file_names_is_refused_as_a_mac_read_would_be(tmp_path, caplog):
    """An ADD may ask for a MAC (runtimeConfig.mac, CNI_ARGS MAC=): one that is a group
    address, the bridge's, a host-side veth's or another pod's must not be taken into
    pod-macs (the pod could then send as that pod, or flood as a group).  Such a port is cut
    off and listed as a refused MAC read's is; of two files naming one MAC the older keeps it."""
    cni = tmp_path / "cni"
    agent = PolicyAgent(NODE, datastore(), str(cni), peer_mac=lambda i: MAC_C, bridge_mac=lambda b: BRIDGE_MAC)
    endpoints.write(cni, endpoint("c1", "a", "10.244.1.5", pod_mac=MAC_A))
    await rescan(agent)
    assert sets(agent) == ({"veth-c1"}, {("veth-c1", MAC_A)}) and agent.refused_macs == {}
    victims = {MAC_A: "pod x/a's", BRIDGE_MAC: "the bridge cni0's", "02:00:00:00:01:05": "the host side of veth-c1's",
               "01:00:5e:00:00:01": "group", "00:00:00:00:00:00": "all-zero", MAC_C: "pod x/c's"}  # fmt: skip
    endpoints.write(cni, endpoint("c3", "c", "10.244.1.7"))  # its MAC read: MAC_C
    with caplog.at_level(logging.WARNING):
        for mac, whose in victims.items():
            endpoints.write(cni, endpoint("c2", "b", "10.244.1.6", pod_mac=mac))  # newer than a's file
            await rescan(agent)
            assert agent.engine.local[("x", "b")].mac_refused and agent.engine.local[("x", "b")].pod_mac == "", mac
            assert whose in agent.refused_macs["x/b"], mac
            assert sets(agent) == ({"veth-c1", "veth-c2", "veth-c3"}, {("veth-c1", MAC_A), ("veth-c3", MAC_C)}), mac
            await rescan(agent)  # said once per file
    assert said(caplog, "the MAC its endpoint file names is refused") == len(victims)
    assert agent.engine.local[("x", "a")].pod_mac == MAC_A and agent.engine.local[("x", "c")].pod_mac == MAC_C
    # The pod that had it gone, the newer file's MAC is its pod's own: taken.
    endpoints.write(cni, endpoint("c2", "b", "10.244.1.6", pod_mac=MAC_A))
    await rescan(agent)
    assert agent.engine.local[("x", "b")].mac_refused
    endpoints.remove(cni, "c1")
    await rescan(agent)
    assert agent.engine.local[("x", "b")].pod_mac == MAC_A and agent.refused_macs == {}


async def test_a_local_pod_whose_file_cannot_be_taken_is_cut_off_not_left_unchecked(tmp_path, caplog, monkeypatch):
    """An endpoint file (or the local pod's record, whose labels it takes) that makes no pod:
    the agent removed the pod from the engine, and its port left every pod-port set -- no
    source address, ARP or MAC check at all.  Its port is kept, cut off: a pod port with no
    address and no MAC.  A file that parses again makes it a pod as ever; one removed, nothing."""
    from agentd.policy import agent as agent_module

    cni = tmp_path / "cni"
    agent = PolicyAgent(NODE, datastore(), str(cni), peer_mac=lambda i: {"veth-c1": MAC_A, "veth-c2": MAC_B}[i])
    endpoints.write(cni, endpoint("c1", "a", "10.244.1.5"))
    endpoints.write(cni, endpoint("c2", "b", "10.244.1.6"))
    good = agent_module.record_for

    def broken(ep: endpoints.Endpoint, node: str, labels: dict[str, str]) -> dict[str, Any]:
        record = good(ep, node, labels)
        return {k: v for k, v in record.items() if k != "metadata"} if ep.name == "b" else record

    monkeypatch.setattr(agent_module, "record_for", broken)
    with caplog.at_level(logging.WARNING):
        await rescan(agent)
    assert said(caplog, "endpoint file of pod x/b unusable") >= 1 and said(caplog, "its port veth-c2 is cut off") >= 1
    assert ("x", "b") not in agent.engine.pods and ("x", "b") in agent.engine.cut_off_ports
    rs = agent.engine.build()
    ports = rs.objects[("bridge", compiler.TABLE, "set", "pod-ports")]
    assert {str(e) for e in ports.elements} == {"veth-c1", "veth-c2"}  # type: ignore[union-attr]
    assert sets(agent) == ({"veth-c1", "veth-c2"}, {("veth-c1", MAC_A)})
    monkeypatch.setattr(agent_module, "record_for", good)
    agent._feed_pod(("x", "b"))
    assert ("x", "b") in agent.engine.pods and agent.engine.cut_off_ports == {}
    await rescan(agent)
    assert sets(agent) == ({"veth-c1", "veth-c2"}, {("veth-c1", MAC_A), ("veth-c2", MAC_B)})
    monkeypatch.setattr(agent_module, "record_for", broken)
    agent._feed_pod(("x", "b"))
    endpoints.remove(cni, "c2")
    await rescan(agent)
    assert agent.engine.cut_off_ports == {} and sets(agent) == ({"veth-c1"}, {("veth-c1", MAC_A)})
