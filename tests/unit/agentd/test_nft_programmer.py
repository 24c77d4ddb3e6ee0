"""NftProgrammer (agentd/nft/programmer.py) against a fake kernel, pure: the real Nft and
ElementWriter code paths (libnftables' JSON, the netlink element encoding), with the kernel's
side a model of its sets.  libnftables' text goes to :meth:`Kernel.run` instead of the
library; the element batches' bytes to :meth:`Kernel.transact` instead of the socket.  The
nft thread is an executor the test runs by hand: a transaction can be held in flight."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import socket
from collections.abc import Callable
from ipaddress import ip_address
from typing import Any

import pytest

from agentd.kernel import netlink as nl
from agentd.nft import nfnetlink as nf
from agentd.nft.libnftables import Nft, NftError
from agentd.nft.programmer import NftProgrammer
from agentd.nft.ruleset import NftChain, NftSet, Ruleset, rule_text

TABLES = frozenset({("inet", "agentd-policy")})
FAMILY_NAMES = {number: name for name, number in nf.FAMILIES.items() if name in ("inet", "ip", "ip6")}


class Kernel:
    """The sets (and chains) of the agent's tables, changed one transaction at a time."""

    def __init__(self) -> None:
        self.tables: set[tuple[str, str]] = set()
        self.sets: dict[tuple[str, str, str], tuple[str, set[str]]] = {}  # -> (type, elements)
        self.chains: set[tuple[str, str, str]] = set()
        self.batches = 0  # element batches (netlink transactions)

    # libnftables' JSON (Nft._run)
    def run(self, text: str) -> str:
        commands = [c for c in json.loads(text)["nftables"] if "metainfo" not in c]
        for command in commands:
            (verb, body), = command.items()
            (kind, obj), = body.items()
            if verb == "list":
                return self._list(obj["family"], obj["name"])
            key = (obj["family"], obj.get("table"), obj.get("name"))
            if kind == "table":
                (self.tables.add if verb == "add" else self.tables.discard)((obj["family"], obj["name"]))
            elif kind == "set" and verb == "add":
                self.sets.setdefault(key, (obj["type"], set()))
            elif kind == "set" and verb == "flush":
                self.sets[key][1].clear()
            elif kind == "element":
                self._elements(verb, key, [str(e) for e in obj["elem"]])
            elif kind == "chain" and verb == "add":
                self.chains.add(key)
        return ""

    def _list(self, family: str, name: str) -> str:
        if (family, name) not in self.tables:
            raise NftError("Error: No such file or directory; did you mean table 'x' in family inet?")
        items: list[dict[str, Any]] = [{"table": {"family": family, "name": name}}]
        items += [{"set": {"family": f, "table": t, "name": n, "type": kind}}
                  for (f, t, n), (kind, _e) in self.sets.items() if (f, t) == (family, name)]  # fmt: skip
        items += [{"chain": {"family": f, "table": t, "name": n}} for f, t, n in self.chains if (f, t) == (family, name)]
        return json.dumps({"nftables": [{"metainfo": {"json_schema_version": 1}}, *items]})

    def _elements(self, verb: str, key: tuple[str, str, str], elems: list[str]) -> None:
        if key not in self.sets:
            raise NftError(f"Error: Could not process rule: No such file or directory ({key[2]})")
        elems = [str(ip_address(e)) for e in elems]  # as the kernel lists them
        (self.sets[key][1].update if verb == "add" else self.sets[key][1].difference_update)(elems)

    # the element batches' bytes (ElementWriter.sock.transact)
    def transact(self, data: bytes, begin: int, end: int, *, acked: Any, what: str) -> None:
        self.batches += 1
        messages = list(nl.iter_messages(data))
        assert [messages[0][:3:2], messages[-1][:3:2]] == [(nf.NFNL_MSG_BATCH_BEGIN, begin), (nf.NFNL_MSG_BATCH_END, end)]
        assert list(acked) == [seq for _t, _f, seq, *_r in messages[1:-1]] == list(range(begin + 1, end))
        for mtype, _flags, _seq, _pid, ms, me in messages[1:-1]:
            family = FAMILY_NAMES[data[ms]]
            top = {a: (vs, ve) for a, vs, ve in nl.iter_attrs(data, ms + nl.NFGENMSG_LEN, me)}
            key = (family, nl.read_string(data, *top[nf.NFTA_SET_ELEM_LIST_TABLE]),
                   nl.read_string(data, *top[nf.NFTA_SET_ELEM_LIST_SET]))  # fmt: skip
            elems = []
            for _e, s, e in nl.iter_attrs(data, *top[nf.NFTA_SET_ELEM_LIST_ELEMENTS]):
                parts = {a: (vs, ve) for a, vs, ve in nl.iter_attrs(data, s, e)}
                (_v, ks, ke), = nl.iter_attrs(data, *parts[nf.NFTA_SET_ELEM_KEY])
                elems.append(socket.inet_ntop(socket.AF_INET if ke - ks == 4 else socket.AF_INET6, data[ks:ke]))
            self._elements("add" if mtype & 0xFF == nf.NFT_MSG_NEWSETELEM else "delete", key, elems)

    # a counters read (ElementWriter.sock.request): a GETOBJ dump (none counted here; of a
    # table that is not there, empty too, as Linux 6.x answers), a GETTABLE (ENOENT: none)
    def request(self, data: bytes, *, what: str, dump: bool) -> list[Any]:
        (mtype, _f, _seq, _pid, ms, me), = nl.iter_messages(data)
        top = {a: (vs, ve) for a, vs, ve in nl.iter_attrs(data, ms + nl.NFGENMSG_LEN, me)}
        if mtype & 0xFF == nf.NFT_MSG_GETOBJ:
            assert dump
            return []
        assert mtype & 0xFF == nf.NFT_MSG_GETTABLE and not dump
        if (FAMILY_NAMES[data[ms]], nl.read_string(data, *top[nf.NFTA_TABLE_NAME])) not in self.tables:
            raise nl.NetlinkError(errno.ENOENT, None, what)
        return []

    def elements(self, name: str) -> set[str]:
        return set(self.sets[("inet", "agentd-policy", name)][1])


def _canonical(addresses: set[str]) -> set[str]:
    return {str(ip_address(a)) for a in addresses}


class NftThread(concurrent.futures.Executor):
    """The Nft's one worker thread, run by the test: a call runs when submitted, or, while
    ``hold``, when :meth:`release` says -- already running, so cancelling whoever awaits it
    does not stop it (as a ThreadPoolExecutor's thread commits a transaction it has begun)."""

    def __init__(self) -> None:
        self.hold = False
        self.held: list[tuple[concurrent.futures.Future, Callable[..., Any], tuple]] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        if self.hold:
            self.held.append((future, fn, args))
        else:
            self._run(future, fn, args)
        return future

    @staticmethod
    def _run(future: concurrent.futures.Future, fn: Callable[..., Any], args: tuple) -> None:
        try:
            future.set_result(fn(*args))
        except Exception as err:  # noqa: BLE001 (handed to whoever awaits it)
            future.set_exception(err)

    def release(self) -> None:
        self.hold = False
        held, self.held = self.held, []
        for future, fn, args in held:
            self._run(future, fn, args)


def _nft(kernel: Kernel) -> tuple[Nft, NftThread]:
    """An Nft whose libnftables and netlink socket are ``kernel``."""
    nft = Nft.__new__(Nft)
    nft.netns, nft.calls, nft._ctx = None, 0, 1
    nft._executor = thread = NftThread()
    nft._run = kernel.run  # type: ignore[method-assign]
    writer = nf.ElementWriter.__new__(nf.ElementWriter)
    writer.sock, writer.seq = kernel, 1  # type: ignore[assignment]
    nft._elements = writer
    return nft, thread


def _policy(name: str, kind: str, members: set[str]) -> Ruleset:
    s = NftSet("inet", "agentd-policy", name, (kind,), elements=frozenset(members))
    c = NftChain("inet", "agentd-policy", "np-in/ns/p", (rule_text([{"accept": None}]),))
    return Ruleset(TABLES, {s.key: s, c.key: c})


async def test_a_large_element_only_change_syncs_in_one_transaction():
    """A namespace selector edited to match a namespace of 2,400 pods: 10 IPv6 members out,
    2,400 in, element-only (the netlink path).  One NFTA_SET_ELEM_LIST_ELEMENTS holds ~2,340
    IPv6 keys: the encoding raised struct.error, which is no NftError -- it escaped sync (the
    policy loop's run() crashed, the change was lost or crashed it again).  Now the elements
    go in several messages of one batch and the kernel's set is the desired one."""
    kernel = Kernel()
    nft, _thread = _nft(kernel)
    prog = NftProgrammer(nft, TABLES, "policy")
    before = {f"fd00:1::{i:x}" for i in range(10)}
    assert (await prog.sync(_policy("np-in/ns/p/0/pods6", "ipv6_addr", before))).full
    assert kernel.elements("np-in/ns/p/0/pods6") == _canonical(before)
    after = {f"fd00:2::{i:x}" for i in range(2400)}
    result = await prog.sync(_policy("np-in/ns/p/0/pods6", "ipv6_addr", after))
    assert not result.full and prog.fast == 1 and kernel.batches == 1  # one element transaction
    assert kernel.elements("np-in/ns/p/0/pods6") == _canonical(after)
    assert prog.last_error is None


async def test_a_sync_cancelled_mid_transaction_is_followed_by_a_full_rewrite():
    """The policy task cancelled (a sibling task crashed) while its element batch is in
    flight: the nft thread commits it all the same, but ``current`` stayed what it was, so a
    pod added in that sync and removed in the next stayed in the kernel's set (have and want
    agreed on the stale contents): a stale allow.  A sync whose outcome is not known makes
    the next one adopt the tables again and rewrite them, in one transaction."""
    kernel = Kernel()
    nft, thread = _nft(kernel)
    prog = NftProgrammer(nft, TABLES, "policy")
    await prog.sync(_policy("np-in/ns/p/0/pods", "ipv4_addr", {"10.0.0.1"}))
    thread.hold = True
    task = asyncio.create_task(prog.sync(_policy("np-in/ns/p/0/pods", "ipv4_addr", {"10.0.0.1", "10.0.0.66"})))
    for _ in range(10):
        if thread.held:
            break
        await asyncio.sleep(0)
    assert thread.held, "the element batch never reached the nft thread"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    thread.release()  # the batch was under way: committed
    assert kernel.elements("np-in/ns/p/0/pods") == {"10.0.0.1", "10.0.0.66"}
    result = await prog.sync(_policy("np-in/ns/p/0/pods", "ipv4_addr", {"10.0.0.1"}))  # .66 lost its label
    assert kernel.elements("np-in/ns/p/0/pods") == {"10.0.0.1"}
    assert result.full
    # Known again: the next change is an element batch.
    fast = prog.fast
    result = await prog.sync(_policy("np-in/ns/p/0/pods", "ipv4_addr", {"10.0.0.1", "10.0.0.7"}))
    assert not result.full and prog.fast == fast + 1
    assert kernel.elements("np-in/ns/p/0/pods") == {"10.0.0.1", "10.0.0.7"}


async def test_a_sync_cancelled_before_its_transaction_commits_nothing_is_lost():
    """The same with the batch never committed (refused once the task had gone, say): the
    rewrite after it brings the kernel to the desired contents all the same."""
    kernel = Kernel()
    nft, thread = _nft(kernel)
    prog = NftProgrammer(nft, TABLES, "policy")
    await prog.sync(_policy("np-in/ns/p/0/pods", "ipv4_addr", {"10.0.0.1", "10.0.0.2"}))
    thread.hold = True
    task = asyncio.create_task(prog.sync(_policy("np-in/ns/p/0/pods", "ipv4_addr", {"10.0.0.1"})))
    for _ in range(10):
        if thread.held:
            break
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    thread.held.clear()  # never ran
    thread.hold = False
    result = await prog.sync(_policy("np-in/ns/p/0/pods", "ipv4_addr", {"10.0.0.1"}))
    assert result.full and kernel.elements("np-in/ns/p/0/pods") == {"10.0.0.1"}


def _sets(members: dict[str, set[str]]) -> Ruleset:
    rs = Ruleset(TABLES, {})
    for name, addresses in members.items():
        rs.add(NftSet("inet", "agentd-policy", name, ("ipv4_addr",), elements=frozenset(addresses)))
    return rs


async def test_the_rewrite_after_a_cancelled_sync_covers_every_object_whatever_keys_say():
    """After a sync cancelled mid-transaction the tables are adopted again (every object's
    contents unknown).  The caller's ``keys`` (Services always pass theirs) name only what it
    changed since: a rewrite of those alone would leave the others as the cancelled
    transaction left them, believed to be as wanted, for good."""
    kernel = Kernel()
    nft, thread = _nft(kernel)
    prog = NftProgrammer(nft, TABLES, "policy")
    await prog.sync(_sets({"a": {"10.0.0.1"}, "b": {"10.0.0.1"}}))
    thread.hold = True
    task = asyncio.create_task(prog.sync(_sets({"a": {"10.0.0.1", "10.0.0.2"}, "b": {"10.0.0.1", "10.0.0.3"}})))
    for _ in range(10):
        if thread.held:
            break
        await asyncio.sleep(0)
    assert thread.held, "the element batch never reached the nft thread"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    thread.release()  # committed all the same
    assert kernel.elements("b") == {"10.0.0.1", "10.0.0.3"}
    desired = _sets({"a": {"10.0.0.1"}, "b": {"10.0.0.1"}})
    result = await prog.sync(desired, keys={("inet", "agentd-policy", "set", "a")})
    assert result.full
    assert kernel.elements("a") == kernel.elements("b") == {"10.0.0.1"}


async def test_a_table_deleted_by_someone_else_is_written_again_by_the_next_sync():
    """``nft flush ruleset`` or ``nft delete table inet agentd-policy`` (an admin, a firewall's
    restart): the counters read every 2 s got ENOENT, taken for "no counters"; the programmer
    kept believing its tables there and a sync with nothing changed sent nothing -- network
    policy unenforced until some later change failed.  The read finding a table it wrote
    gone puts it in doubt: the next sync adopts again and writes everything."""
    kernel = Kernel()
    nft, _thread = _nft(kernel)
    prog = NftProgrammer(nft, TABLES, "policy")
    desired = _policy("np-in/ns/p/0/pods", "ipv4_addr", {"10.0.0.1"})
    await prog.sync(desired)
    assert await prog.counters() == {} and not prog.gone and not prog.in_doubt
    kernel.tables.clear()  # nft flush ruleset
    kernel.sets.clear()
    kernel.chains.clear()
    assert await prog.counters() == {}
    assert prog.gone and prog.in_doubt  # the caller (the policy agent's counters loop) wakes its sync
    result = await prog.sync(desired, keys=set())  # nothing changed since
    assert result.full and result.commands > 0
    assert kernel.tables == set(TABLES) and kernel.elements("np-in/ns/p/0/pods") == {"10.0.0.1"}
    assert ("inet", "agentd-policy", "np-in/ns/p") in kernel.chains
    assert not prog.gone and not prog.in_doubt
    # A table it never wrote (not there yet) is no news.
    fresh = NftProgrammer(_nft(Kernel())[0], TABLES, "policy")
    await fresh.adopt()
    assert await fresh.counters() == {} and not fresh.gone and not fresh.in_doubt
