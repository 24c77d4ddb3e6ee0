"""The nftables programmer: tables the agent owns (policy, Services), desired vs. actual, one transaction per change.

* **Adopt, never flush.**  At start the programmer lists the agent's tables as a previous run
  left them and takes over their objects with "contents unknown"; the tables keep enforcing
  while the agent reads etcd.  The first sync then rewrites every object's contents in ONE
  transaction (flush and refill, atomically), so there is no moment with open pods.
* **Incremental.**  After that it knows what the kernel holds and sends only the difference
  (:func:`agentd.nft.ruleset.plan`): element adds and deletes, changed chains refilled.
* **Atomic.**  A change is one libnftables call, one netlink batch: all of it or nothing.
  If the kernel refuses (someone edited the tables), the programmer adopts again and
  retries with a full rewrite, still in one transaction.
* **Interrupted.**  A sync cancelled while its transaction is under way (its task, not the
  transaction: the nft thread commits that all the same) leaves the kernel with the old
  contents or the new, and the programmer not knowing which: the next sync adopts again.
* **Deleted by someone else.**  ``nft flush ruleset``, ``nft delete table``, a firewall's
  restart: the agents read their tables' counters every few seconds, and a table the
  programmer believes in found gone (:meth:`table_absent`) puts it in doubt, as an
  interrupted sync: the next sync, which the caller wakes, adopts again and rewrites
  everything (a sync with nothing changed would otherwise send nothing: policy unenforced
  until some later change failed).  kube-proxy's canary chains, Felix's refresh timer.
* **Leave.**  :meth:`remove` deletes the tables it owns, and nothing of the agent's stays.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from . import nfnetlink
from .libnftables import Nft, NftError
from .ruleset import NftChain, NftCounter, NftSet, Ruleset, applied, plan

log = logging.getLogger("agentd.nft")
SET_FLAGS = ("dynamic", "interval", "timeout")  # the flags the agent's sets are declared with


@dataclass(frozen=True)
class SyncResult:
    commands: int
    seconds: float
    full: bool  # a rewrite of everything (first sync, or after the kernel refused a change)


class NftProgrammer:
    def __init__(self, nft: Nft, tables: frozenset[tuple[str, str]], what: str) -> None:
        self.nft = nft
        self.tables = tables  # the (family, table) pairs this programmer owns (policy's, Services' own)
        self.what = what
        self.current: Ruleset | None = None  # None: not adopted yet
        self.adopted_objects = 0
        self.last_error: str | None = None
        self.fast = 0  # transactions sent as element batches (nfnetlink), bypassing libnftables
        self._unknown = True
        # A transaction sent whose outcome is not known (the sync cancelled, or failed other
        # than by the kernel's refusal): ``current`` may not be what the kernel holds.
        self._in_doubt = False
        self._gone: set[tuple[str, str]] = set()  # tables believed in, found gone (until adopted again)

    @property
    def in_doubt(self) -> bool:
        """Whether the next sync adopts the tables again and rewrites them (an interrupted sync,
        a table found gone)."""
        return self._in_doubt

    @property
    def gone(self) -> bool:
        """Whether a table it wrote was found gone since it last read them (see :meth:`table_absent`)."""
        return bool(self._gone)

    def table_absent(self, family: str, table: str) -> bool:
        """A read found ``table`` not there (a counters read's :class:`~.nfnetlink.TableAbsent`).
        True if the programmer believed it there: someone else deleted it, and the next sync
        adopts again and rewrites everything (the caller wakes it)."""
        if self.current is None or (family, table) not in self.current.tables:
            return False  # (not written yet, or deleted by a sync of ours)
        if (family, table) not in self._gone:
            log.warning("the %s table %s %s is gone (deleted by someone else?): writing the tables again",
                        self.what, family, table)
        self._gone.add((family, table))
        self._in_doubt = True
        return True

    async def adopt(self) -> Ruleset:
        """Take over what a previous run left (contents to be rewritten on the first sync)."""
        objects: dict[Any, Any] = {}
        tables: set[tuple[str, str]] = set()
        for family, table in sorted(self.tables):
            listing = await self.nft.alist({"table": {"family": family, "name": table}})
            if listing is None:
                continue
            tables.add((family, table))
            for item in listing:
                obj = _parse(item)
                if obj is not None:
                    objects[obj.key] = obj
        self.current = Ruleset(frozenset(tables), objects)
        self._unknown = True  # contents not read: the next sync compares (and rewrites) everything
        self._in_doubt = False
        self._gone = set()
        self.adopted_objects = len(objects)
        if objects:
            log.info("adopted the %s tables (%d objects); they stay in force", self.what, len(objects))
        return self.current

    async def sync(self, desired: Ruleset, keys: set[Any] | None = None) -> SyncResult:
        """Make the kernel hold ``desired``.  ``keys``: the objects that may have changed since
        the last successful sync (None: compare everything)."""
        if self._in_doubt and not self._gone:
            log.warning("an interrupted %s update may or may not have been committed: re-reading the tables "
                        "and rewriting them", self.what)
        if self.current is None or self._in_doubt:
            await self.adopt()
        assert self.current is not None
        full = self._unknown
        if full:
            keys = None
        start = time.perf_counter()
        commands = plan(self.current, desired, keys)
        count = len(commands)
        self._in_doubt = True  # until the kernel's answer is in (a cancelled task does not stop the nft thread)
        try:
            elements = _element_ops(commands, desired, self.current)
            if elements is not None:
                await self.nft.arun_elements(elements)
                self.fast += 1
            elif commands:
                # As text, the command objects go before libnftables parses it: a first sync's
                # (Services' prepared slots) would otherwise sit under libnftables' own peak.
                text = self.nft.encode(commands)
                del commands
                await self.nft.arun_text(text)
        except NftError as err:
            log.warning("nftables refused the %s update (%s); re-reading the tables and rewriting them", self.what, err)
            await self.adopt()
            commands = plan(self.current, desired)
            count = len(commands)
            full = True
            self._in_doubt = True
            try:
                await self.nft.arun(commands)
            except NftError as err2:
                self.last_error = str(err2)
                self._in_doubt = False  # refused: the kernel holds what adopt() just read
                raise
        self.last_error = None
        self.current = applied(desired)
        self._unknown = False
        # A table found gone while the transaction was under way, which it did not go through:
        # still gone (one the transaction deleted is no longer believed in).
        self._gone &= self.current.tables
        self._in_doubt = bool(self._gone)
        return SyncResult(count, time.perf_counter() - start, full)

    async def remove(self) -> bool:
        """Delete the tables this programmer owns (``agentd leave``); True if there were any."""
        found = False
        for family, table in sorted(self.tables):
            if await self.nft.alist({"table": {"family": family, "name": table}}) is not None:
                await self.nft.arun([{"delete": {"table": {"family": family, "name": table}}}])
                found = True
        self.current = Ruleset()
        return found

    async def counters(self) -> dict[tuple[str, str], int]:
        """Packets counted by each named counter, by (family, name).  A table found gone puts
        the programmer in doubt (:meth:`table_absent`, :attr:`gone`)."""
        out: dict[tuple[str, str], int] = {}
        for family, table in sorted(self.tables):
            counts = await self.nft.acounters(family, table)
            if isinstance(counts, nfnetlink.TableAbsent):
                self.table_absent(family, table)
            for name, (packets, _bytes) in counts.items():
                out[(family, name)] = packets
        return out


def _element_ops(commands: list[dict[str, Any]], desired: Ruleset, current: Ruleset) -> list[Any] | None:
    """The plan as element batches for nfnetlink, or None if it holds anything else."""
    ops = []
    for cmd in commands:
        (verb, body), = cmd.items()
        if verb not in ("add", "delete") or "element" not in body:
            return None
        e = body["element"]
        key = (e["family"], e["table"], "set", e["name"])
        obj = desired.objects.get(key) or current.objects.get(key)
        if not isinstance(obj, NftSet) or obj.interval or not nfnetlink.can_encode(obj.type, obj.map):
            return None
        ops.append((verb, e["family"], e["table"], e["name"], obj.type, obj.map, e["elem"]))
    return ops or None


def _parse(item: dict[str, Any]) -> Any:
    """An object of a listed table, with its shape (contents are not read: see adopt)."""
    if "set" in item or "map" in item:
        body = item.get("set") or item.get("map")
        kind = body.get("type")
        types = tuple(kind) if isinstance(kind, list) else (kind,)
        flags = body.get("flags") or []
        return NftSet(
            body["family"], body["table"], body["name"], types,
            map=body.get("map") if "map" in item else None,
            flags=tuple(sorted(f for f in (flags if isinstance(flags, list) else [flags]) if f in SET_FLAGS)),
            contents_known=False,
            timeout=body.get("timeout"),
        )  # fmt: skip
    if "chain" in item:
        body = item["chain"]
        hook = None
        if "hook" in body:
            hook = (body.get("type", "filter"), body["hook"], int(body.get("prio", 0)), body.get("policy", "accept"))
        return NftChain(body["family"], body["table"], body["name"], hook=hook, contents_known=False)
    if "counter" in item:
        body = item["counter"]
        return NftCounter(body["family"], body["table"], body["name"])
    return None
