"""The MACs of local pods whose endpoint file names none (``pod_mac``: a delegate that gave
none, a file of an older agentd-cni), read from the other end of their veth.

* Only a read that worked is kept; one that failed (the veth gone, EMFILE, ENOBUFS, a
  timeout) is tried again at the agent's later rescans, its warning said once per file.
* The first MAC taken for a file sticks, across agent restarts too: it is kept in
  ``<[agent] state_dir>/pod-macs.json`` by container ID and the file's ident (which write
  of it this is; :func:`version`), written atomically; ``agentd leave`` removes it
  (:meth:`PodMacs.remove`, :func:`remove_state`).  A pod (with ``NET_ADMIN``) that
  changes its interface's MAC later is cut off (its frames carry a MAC not its own), never
  trusted with the new one.
* A MAC read is refused where it cannot be the pod's own: a group (multicast, broadcast)
  or all-zero address, its bridge's, or one a port of that bridge has already (another
  pod's, as its file or an earlier read names it; a host-side veth's).  Such a port is
  checked against no MAC at all: every frame from it is dropped (``spoofed-mac``).  Left
  unchecked it would be free to send with that very MAC.  A MAC an endpoint file names
  (``pod_mac``: the delegate's, or the one the ADD asked for) gets the same refusal
  (:meth:`PodMacs.file_refusals`; of two files naming one MAC, the newer is refused).

The reads block (netlink): :func:`read_links` runs them all with one socket, off the event
loop (``asyncio.to_thread``); :class:`PodMacs` keeps what was read and decides, without IO.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from agentd.cni.endpoints import Endpoint

log = logging.getLogger("agentd.policy")

STATE_FILE = "pod-macs.json"  # in [agent] state_dir


def version(ep: Endpoint) -> str:
    """Which file of the pod ``ep`` is, as far as its MAC goes: its ident (new at every ADD,
    kept by a relabel); for a file without a generation (of an agentd-cni older than those:
    its ident is inode, mtime and size), its mtime alone, which a relabel keeps (``agentd
    label pod``: a new inode, a new ident) -- a MAC taken must not be read anew for that --
    while a new ADD writes a file with a generation."""
    if ep.ident.startswith("g:") or not ep.written:
        return ep.ident
    return f"w:{ep.written}"


def refusal(mac: str, others: Mapping[str, str]) -> str:
    """Why ``mac``, read from a pod's interface, cannot be taken as its own ("" where it can).
    ``others``: the MACs of its bridge that are someone else's -> whose."""
    try:
        octets = bytes.fromhex(mac.replace(":", ""))
    except ValueError:
        return f"{mac!r} is no MAC"
    if len(octets) != 6:
        return f"{mac!r} is no MAC"
    if octets[0] & 1:
        return f"{mac} is a group (multicast or broadcast) address"
    if not any(octets):
        return f"{mac} is the all-zero address"
    whose = others.get(mac.lower())
    return f"{mac} is {whose}" if whose else ""


@dataclass(frozen=True)
class Trouble:
    """Why a file's pod has no MAC taken: its read failed (the port is not MAC-checked), or
    the MAC read was refused (the port is checked against none: cut off)."""

    ident: str
    why: str
    refused: bool


class PodMacs:
    """What was read of local pods' own interfaces, by container ID, for one file ident each."""

    def __init__(self, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(state_dir) / STATE_FILE if state_dir is not None else None
        self.known: dict[str, tuple[str, str]] = {}  # container -> (ident, MAC): the first taken
        self.trouble: dict[str, Trouble] = {}  # container -> the last read's failure or refusal
        self.loaded = self.path is None
        # Each bridge's MAC as last read (None: no such device; why it could not be read), for
        # the MACs endpoint files name (:meth:`file_refusals`); read again at each rescan.
        self.bridges: dict[str, str | None | BaseException] = {}
        # Changes to ``known`` made, and how many of them the state file holds (a write that
        # worked): the file differs from ``known`` while ``recorded < changes``.
        self.changes = 0
        self.recorded = 0
        self._write_failed = False
        # A write (off the event loop) and the leave's removal of the file, one at a time: a
        # write under way when the leave cancelled its task ends before the file is removed.
        self._file_lock = threading.Lock()
        self.removed = False  # the node left (:meth:`remove`): the file is written no more

    # ------------------------------------------------------------------ lookups (no IO)

    def mac(self, ep: Endpoint) -> str:
        """The MAC taken for this file of the pod ("" where none is)."""
        known = self.known.get(ep.container_id)
        return known[1] if known is not None and known[0] == version(ep) else ""

    def refused(self, ep: Endpoint) -> bool:
        t = self.trouble.get(ep.container_id)
        return t is not None and t.ident == version(ep) and t.refused

    def why(self, ep: Endpoint) -> str:
        t = self.trouble.get(ep.container_id)
        return t.why if t is not None and t.ident == version(ep) else ""

    def wanted(self, eps: Iterable[Endpoint], *, retry: bool) -> list[Endpoint]:
        """The files whose pod's MAC is to be read: no ``pod_mac``, none taken yet; with
        ``retry`` those whose last read failed or was refused too, else only the new."""
        return [ep for ep in eps if not ep.pod_mac and not self.mac(ep)
                and (retry or (t := self.trouble.get(ep.container_id)) is None or t.ident != version(ep))]  # fmt: skip

    def prune(self, containers: Iterable[str]) -> None:
        """Forget the containers not among ``containers`` (their files are gone)."""
        keep = set(containers)
        for cid in self.trouble.keys() - keep:
            del self.trouble[cid]
        if self.loaded:  # (not before the file was read: the next prune takes them)
            for cid in self.known.keys() - keep:
                del self.known[cid]
                self.changes += 1

    def take(self, ep: Endpoint, read: str | BaseException, others: Mapping[str, str]) -> bool:
        """Take what was read of ``ep``'s pod's interface (a MAC, or why it could not be read),
        ``others`` the MACs of its bridge that are someone else's; logs what changed, once per
        file.  True where what the port is checked against changed."""
        name = f"{ep.namespace}/{ep.name}"
        if self.mac(ep):
            return False  # the first MAC taken for the file sticks (another batch's read came first)
        before = self.trouble.get(ep.container_id)
        if before is not None and before.ident != version(ep):
            before = None
        if isinstance(read, str):
            why = refusal(read, others)
            if not why:
                self.known[ep.container_id] = (version(ep), read.lower())
                self.trouble.pop(ep.container_id, None)
                self.changes += 1
                log.info("pod %s: its endpoint file names no MAC; %s, read from the other end of %s, is checked",
                         name, read.lower(), ep.interface)
                return True
            trouble = Trouble(version(ep), why, True)
        elif before is not None and before.refused:
            return False  # a read that fails now does not undo a refusal: the port stays cut off
        else:
            trouble = Trouble(version(ep), str(read) or type(read).__name__, False)
        self.trouble[ep.container_id] = trouble
        if before is not None and before.refused == trouble.refused:
            return False  # said already (a retry that failed again)
        if trouble.refused:
            log.warning("pod %s: its endpoint file names no MAC and the one its interface has is refused (%s): "
                        "every frame from its port %s is dropped (spoofed-mac)", name, trouble.why, ep.interface)
        else:
            log.warning("pod %s: its endpoint file names no MAC and its interface's cannot be read (%s): "
                        "source MACs from its port %s are not checked (tried again at every rescan)",
                        name, trouble.why, ep.interface)
        return True

    def file_refusals(self, eps: Iterable[Endpoint]) -> dict[str, str]:
        """The files whose ``pod_mac`` cannot be their pod's own (container -> why), by the
        refusal a MAC read gets: a group or all-zero address, the bridge's (as last read), a
        host-side veth's on that bridge, or another pod's there -- a MAC read taken, or one an
        older file names (by mtime, then container ID): of two files naming one MAC the older
        keeps it and the newer is refused, so that an ADD asking for a running pod's MAC
        (``runtimeConfig.mac``) cuts off the new pod, never the one that had it."""
        groups: dict[str, list[Endpoint]] = {}
        for ep in eps:
            groups.setdefault(ep.bridge, []).append(ep)
        out: dict[str, str] = {}
        for name, group in groups.items():  # (each bridge's forwarding database is its own)
            base: dict[str, str] = {}  # as others() has them, but each pod's own MAC left to below
            for other in group:
                if other.mac:
                    base.setdefault(other.mac.lower(), f"the host side of {other.interface}'s")
            pods = {taken: other for other in group if (taken := self.mac(other))}  # MACs read and taken
            bridge = self.bridges.get(name)
            for ep in sorted((e for e in group if e.pod_mac), key=lambda e: (e.written, e.container_id)):
                mac = ep.pod_mac.lower()
                owner = pods.get(mac)
                whose = ({mac: f"the bridge {name}'s"} if isinstance(bridge, str) and bridge.lower() == mac
                         else {mac: f"pod {owner.namespace}/{owner.name}'s"} if owner is not None and owner.container_id != ep.container_id
                         else {mac: base[mac]} if mac in base else {})  # fmt: skip
                why = refusal(ep.pod_mac, whose)
                if why:
                    out[ep.container_id] = why
                else:
                    pods.setdefault(mac, ep)  # the older file keeps it
        return out

    @staticmethod
    def others(ep: Endpoint, eps: Iterable[Endpoint], taken: Callable[[Endpoint], str],
               bridge_mac: str | None) -> dict[str, str]:
        """The MACs on ``ep``'s bridge that are not its pod's to take -> whose: the bridge's, the
        host-side veths', the other pods' (``taken``: the MAC each has, "" where none)."""
        out: dict[str, str] = {}
        for other in eps:
            if other.bridge != ep.bridge:
                continue  # another bridge's forwarding database: not this one's
            if other.mac:
                out.setdefault(other.mac.lower(), f"the host side of {other.interface}'s")
            if other.container_id != ep.container_id and (mac := taken(other)):
                out[mac.lower()] = f"pod {other.namespace}/{other.name}'s"
        if bridge_mac:
            out[bridge_mac.lower()] = f"the bridge {ep.bridge}'s"
        return out

    # ------------------------------------------------------------------ the state file

    def read_state(self) -> dict[str, tuple[str, str]]:
        """Blocking: the MACs an earlier run took (container -> (ident, MAC)); a file that
        cannot be read is said and taken as empty (those MACs are read again)."""
        if self.path is None:
            return {}
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            log.warning("cannot read %s (%s): the MACs earlier runs read from pods' interfaces are read again",
                        self.path, err)
            return {}
        entries = raw.get("pods") if isinstance(raw, dict) else None
        if not isinstance(entries, dict):
            log.warning("%s holds no pods' MACs: the MACs earlier runs read from pods' interfaces are read again", self.path)
            return {}
        return {cid: (entry["ident"], entry["mac"].lower()) for cid, entry in entries.items()
                if isinstance(entry, dict) and isinstance(entry.get("ident"), str) and isinstance(entry.get("mac"), str)
                and not refusal(entry["mac"], {})}  # fmt: skip

    def loaded_state(self, state: Mapping[str, tuple[str, str]]) -> None:
        """Take what :meth:`read_state` found: an earlier run's first MAC of a file is its MAC."""
        self.known.update(state)
        self.loaded = True

    @property
    def unrecorded(self) -> bool:
        """Whether the state file lacks changes made to ``known`` (never without a file)."""
        return self.path is not None and self.recorded < self.changes

    def to_write(self) -> tuple[int, dict[str, dict[str, str]]]:
        """What the state file is to hold now: (the changes it then holds, its pods)."""
        return self.changes, {cid: {"ident": ident, "mac": mac} for cid, (ident, mac) in sorted(self.known.items())}

    def write(self, pods: Mapping[str, Mapping[str, str]]) -> bool:
        """Blocking: write ``pods`` (:meth:`to_write`) to the state file, atomically (a
        temporary file renamed over the old); False where that failed (said once; the caller
        tries again later)."""
        assert self.path is not None
        with self._file_lock:
            if self.removed:
                return True  # the node left: nothing is kept for a next run
            return self._write(self.path, pods)

    def _write(self, path: Path, pods: Mapping[str, Mapping[str, str]]) -> bool:
        tmp = _temporary(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as f:
                f.write(json.dumps({"pods": pods}, indent=1) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if not self._write_failed:
                log.warning("cannot write %s (%s): after a restart the agent would read the MACs of pods "
                            "without one in their endpoint file again", path, err)
            self._write_failed = True
            return False
        self._write_failed = False
        return True

    def remove(self) -> bool:
        """Blocking: ``agentd leave`` removes the state file (:func:`remove_state`) once a write
        under way has ended, and none is written after it.  True where there was a file; an
        OSError other than its absence is raised (the leave's step failed)."""
        with self._file_lock:
            self.removed = True
            return self.path is not None and _remove(self.path)


def remove_state(state_dir: str | os.PathLike[str]) -> bool:
    """Blocking: remove ``<state_dir>/pod-macs.json`` (and a write's temporary file) where no
    policy agent runs to do it (:meth:`PodMacs.remove`): ``agentd leave`` without an agent, or
    before the agent's network policy started.  True where there was a file."""
    return _remove(Path(state_dir) / STATE_FILE)


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _remove(path: Path) -> bool:
    with contextlib.suppress(FileNotFoundError):
        _temporary(path).unlink()  # a write that failed half-way (removed after it, as a rule)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


# What :func:`read_links` found: each interface's peer MAC, each bridge's MAC (None: no such
# device), or why it could not be read.
Read = tuple[dict[str, str | BaseException], dict[str, str | None | BaseException]]


def read_links(interfaces: Iterable[str], bridges: Iterable[str],
               peer_mac: Callable[[str], str] | None = None,
               link_mac: Callable[[str], str | None] | None = None) -> Read:
    """Blocking: the MAC of the other end of each veth of ``interfaces`` and each bridge's MAC
    (None: no such device), or why it cannot be read, with one netlink socket (or
    ``peer_mac``/``link_mac``, tests')."""
    interfaces, bridges = list(interfaces), list(bridges)
    if peer_mac is not None:
        return _read_all(interfaces, bridges, peer_mac, link_mac or (lambda _name: None))
    from agentd.kernel.rtnl import Rtnl

    try:
        rt = Rtnl()
    except OSError as err:  # EMFILE, ENOBUFS: every read fails, each tried again later
        return dict.fromkeys(interfaces, err), dict.fromkeys(bridges, err)
    with rt:
        def bridge(name: str) -> str | None:
            link = rt.link(name)
            if link is None:
                return None
            if link.address is None or len(link.address) != 6:
                raise LookupError(f"{name} has no Ethernet address")
            return ":".join(f"{b:02x}" for b in link.address)

        return _read_all(interfaces, bridges, rt.peer_mac, bridge)


def _read_all(interfaces: list[str], bridges: list[str], peer_mac: Callable[[str], str],
              link_mac: Callable[[str], str | None]) -> Read:
    macs: dict[str, str | BaseException] = {}
    bridge_macs: dict[str, str | None | BaseException] = {}
    for name in dict.fromkeys(bridges):
        try:
            bridge_macs[name] = link_mac(name)
        except (LookupError, OSError, ValueError) as err:  # ValueError: an answer that could not be decoded
            bridge_macs[name] = err
    for name in dict.fromkeys(interfaces):
        try:
            macs[name] = peer_mac(name)
        except (LookupError, OSError, ValueError) as err:
            macs[name] = err
    return macs, bridge_macs
