"""Attach the BPF programs to a device, one per hook, where the program's return value is the
verdict -- without running ``tc`` or ``bpftool``.  Two kinds of hook, chosen by
``[network] bpf_attach`` (:func:`resolve`):

* **tcx** (Linux 6.6 and later, CONFIG_NET_XGRESS): the program goes on the device's hook
  with no qdisc at all.  That matters on a device that carries traffic: adding a clsact qdisc
  *grafts* it, and the kernel deactivates the device's transmit queues for an RCU grace
  period while it does (``qdisc_graft`` calls ``dev_deactivate``): every packet sent out of
  the device meanwhile is dropped (SKB_DROP_REASON_QDISC_DROP).  A pods' bridge the CNI
  plugin made a moment ago, or an underlay device, would lose packets each time an agent
  took it over.  Each of our attachments is a BPF link (BPF_LINK_CREATE), pinned as
  ``links/<program>-<ifindex>`` in the namespace's pin directory (:class:`Pins`): the pin
  keeps the program on the hook when the agent exits, and is how the next agent finds it --
  BPF_OBJ_GET on a file it owns, where naming a program by its id would take CAP_SYS_ADMIN,
  which the unit does not give.  A restarted or upgraded agent swaps its new program into the
  link (BPF_LINK_UPDATE: one pointer exchange, between two packets, in the same place on the
  hook); removing is BPF_LINK_DETACH and the pin's unlink.
* **clsact + cls_bpf** in direct-action mode (agentd.kernel.netlink_tc on the agent's one
  netlink codec), for kernels without tcx (Debian 12's 6.1): the requests
  ``tc filter replace dev X ingress prio P handle H bpf da fd N name NAME`` makes.  Our
  filters sit at priority :data:`PRIO`, one handle per program (:data:`HANDLES`: the data
  path's ingress program and the pod fast path's share the underlay's ingress hook), and are
  found again by that place and their name in the filter dump (no file descriptor needed); a
  filter at that place that is not ours is never touched.  The qdisc is added once per
  device (the one moment the device may drop a packet); later replacements are one
  RTM_NEWTFILTER with NLM_F_REPLACE, between two packets as well.

Agents before links put their programs on tcx hooks without one (BPF_PROG_ATTACH), which an
id alone names.  Such a program is recognised as ours by the program pins the agent started
with (``<pins>/agentd_egress``, ...: :attr:`Pins.programs`, read before the new programs are
pinned), or, where the agent has CAP_SYS_ADMIN, by its name; it is removed after ours is on,
by its position on the hook (BPF_PROG_DETACH with BPF_F_ID and the hook's revision: no file
descriptor of it needed, and refused if the hook changed meanwhile).  A program on our hook
that neither names is left alone and reported (:func:`attach` returns the line; the log
says it once): it might be anyone's.

:func:`detach` removes ours from both kinds of hook, and the clsact qdisc once no filter of
anyone is left on it.  An agent that attaches by one kind takes ours off the other kind of
hook on that device after its own is on (a change of ``bpf_attach``, or an older agent's
cls_bpf filters): never a moment without, never two of ours deciding; removing a cls_bpf
filter leaves the qdisc (removing it would graft again).  Blocking calls: run them off the
event loop.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agentd.digits import whole_number
from agentd.kernel import netlink_tc as tcm
from agentd.kernel.netlink import NetlinkError
from agentd.kernel.rtnl import Rtnl

from . import libbpf as lb

log = logging.getLogger("agentd.bpf")

PRIO = 0xA6E7  # "agentd" hashed to 16 bits: out of the way of the 1, 2, 49152... others pick
HANDLE = 1
PARENTS = {"ingress": 0xFFFFFFF2, "egress": 0xFFFFFFF3}  # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_*)
ETH_P_ALL = 0x0003
OURS = ("agentd_egress", "agentd_ingress")  # the data path (datapath.c)
POD_FAST_PATH = "agentd_pod_fast"  # on pods' veths (podpath.c)
POD_WIRE = "agentd_pod_wire"  # on the underlay device (podpath.c)
PROGRAMS = (*OURS, POD_FAST_PATH, POD_WIRE)  # every program of ours, by name
HANDLES = {POD_WIRE: 2}  # cls_bpf handle by program (HANDLE for the rest): the wire's hook is shared
TCX = {"ingress": lb.TCX_INGRESS, "egress": lb.TCX_EGRESS}
HOOKS = ("tcx", "clsact")
SETTINGS = ("auto", *HOOKS)  # [network] bpf_attach
LINKS = "links"  # under a namespace's pin directory: one pinned BPF link per tcx attachment of ours
_tcx: bool | None = None  # whether this kernel has tcx; learned on first use
_by_id: bool | None = None  # whether this process may open programs by id (CAP_SYS_ADMIN); learned on first use


class TcError(RuntimeError):
    """Attaching or detaching failed; one line naming the device and why."""


@dataclass(frozen=True)
class Pins:
    """How the agent tells its programs on the hooks from anyone else's with CAP_BPF and
    CAP_NET_ADMIN alone: the namespace's pin directory ``dir`` (our tcx links are pinned in
    ``dir/links``) and ``programs``, the ids of the programs pinned there by name when the agent
    started (:meth:`read`) -- the previous agent's, which is what an agent before links left
    on tcx hooks without a link."""

    dir: Path
    programs: Mapping[int, str] = field(default_factory=dict)  # program id -> its name

    @classmethod
    def read(cls, directory: str | os.PathLike) -> Pins:
        programs = {}
        for name in PROGRAMS:
            for path in (Path(directory) / name, Path(directory) / f"{name}_new"):
                try:
                    fd = lb.obj_get(str(path))
                except lb.BpfError:
                    continue  # not pinned (or not ours to open)
                try:
                    programs[lb.prog_info(fd)["id"]] = name
                finally:
                    os.close(fd)
        return cls(Path(directory), programs)

    def link(self, name: str, ifindex: int) -> Path:
        """Where the link of program ``name`` on device ``ifindex`` is pinned."""
        return self.dir / LINKS / f"{name}-{ifindex}"

    def links(self) -> dict[Path, tuple[str, int]]:
        """Every link pin here: path -> (program name, ifindex it was made for)."""
        out = {}
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for path in (self.dir / LINKS).iterdir():
                name, _, ifindex = path.name.rpartition("-")
                index = whole_number(ifindex, 10)
                if name in PROGRAMS and index is not None:
                    out[path] = (name, index)
        return out


@dataclass(frozen=True)
class Filter:
    direction: str  # "ingress" | "egress"
    prio: int
    handle: int
    kind: str | None
    name: str | None  # cls_bpf's TCA_BPF_NAME, or the tcx program's name (None: not known)
    prog_id: int | None = None  # cls_bpf's TCA_BPF_ID, or the tcx program's id
    link_id: int = 0  # tcx: the link holding it (0: attached without one)

    @property
    def ours(self) -> bool:
        if self.kind == "tcx":
            return self.name in PROGRAMS
        return self.prio == PRIO and self.kind == "bpf" and self.name in PROGRAMS


def tcx_available() -> bool:
    """Whether this kernel has tcx hooks (asked once: a query on the loopback device)."""
    global _tcx
    if _tcx is None:
        lb.library()  # nothing of ours runs without it: say so first (what to install)
        try:
            lb.tcx_query(1, lb.TCX_INGRESS)
            _tcx = True
        except lb.BpfError as err:
            if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            _tcx = False
    return _tcx


def resolve(setting: str) -> str:
    """The hook ``[network] bpf_attach = setting`` means on this kernel: "auto" is tcx where the
    kernel has it, else clsact; "tcx" on a kernel without it is a :class:`TcError` saying so."""
    if setting == "auto":
        return "tcx" if tcx_available() else "clsact"
    if setting == "tcx" and not tcx_available():
        raise TcError('[network] bpf_attach = "tcx": this kernel has no tcx hooks (Linux 6.6 and '
                      'CONFIG_NET_XGRESS); "clsact" or "auto" attaches by cls_bpf instead')
    if setting not in HOOKS:
        raise TcError(f"[network] bpf_attach = {setting!r}: not one of {', '.join(SETTINGS)}")
    return setting


def handle(name: str) -> int:
    """The cls_bpf handle of program ``name`` under :data:`PRIO`."""
    return HANDLES.get(name, HANDLE)


def _name_by_id(prog_id: int) -> str | None:
    """The program's name where this process may open it by id (CAP_SYS_ADMIN), else None;
    "" if it is gone."""
    global _by_id
    if _by_id is False:
        return None
    try:
        fd = lb.prog_fd_by_id(prog_id)
    except lb.BpfError as err:
        if err.errno == errno.ENOENT:  # detached and freed since the query
            return ""
        if err.errno == errno.EPERM:
            _by_id = False
            return None
        raise
    _by_id = True
    try:
        return lb.prog_info(fd)["name"]
    finally:
        os.close(fd)


def _open_link(path: Path) -> tuple[int, dict] | None:
    """(file descriptor, lb.link_info) of the link pinned at ``path``; None if none is."""
    try:
        fd = lb.obj_get(str(path))
    except lb.BpfError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise
    try:
        return fd, lb.link_info(fd)
    except BaseException:
        os.close(fd)
        raise


def _tcx_programs(ifindex: int, direction: str, pins: Pins | None) -> list[tuple[int, int, str | None]]:
    """(program id, link id, name or None) of every program on the device's tcx hook."""
    hook = lb.tcx_query(ifindex, TCX[direction])
    links: dict[int, str] = {}
    if pins is not None and any(hook.link_ids):
        for path, (name, _) in pins.links().items():
            got = _open_link(path)
            if got is not None:
                os.close(got[0])
                links[got[1]["id"]] = name
    out = []
    for prog_id, link_id in zip(hook.prog_ids, hook.link_ids):
        name = links.get(link_id) or (pins.programs.get(prog_id) if pins else None) or _name_by_id(prog_id)
        if name != "":
            out.append((prog_id, link_id, name))
    return out


def _cls_filters(ifindex: int) -> list[Filter]:
    """Every filter on the device's clsact hooks (anyone's)."""
    out = []
    with Rtnl() as rt:
        for direction, parent in PARENTS.items():
            try:
                answers = rt.request(tcm.encode_get_filters(rt.next_seq(), ifindex, parent),
                                     f"listing filters of device {ifindex}")
            except NetlinkError as err:
                if err.errno in (errno.EINVAL, errno.ENOENT):
                    continue  # no clsact qdisc
                raise
            for mtype, buf, start, end in answers:
                if mtype != tcm.RTM_NEWTFILTER:
                    continue
                f = tcm.decode_filter(buf, start, end)
                if f.handle:  # handle 0: the header of a priority's chain, not a filter
                    out.append(Filter(direction, f.prio, f.handle, f.kind, f.name, f.prog_id))
    return out


def filters(ifindex: int, pins: Pins | None = None) -> list[Filter]:
    """Every program on the device's tcx hooks and every filter on its clsact hooks (anyone's).
    A tcx program is named by our link pins and program pins (``pins``), else by its id where
    this process may (CAP_SYS_ADMIN); otherwise its name is None."""
    out = []
    if tcx_available():
        for direction in TCX:
            out += [Filter(direction, 0, 0, "tcx", name, pid, lid)
                    for pid, lid, name in _tcx_programs(ifindex, direction, pins)]
    return out + _cls_filters(ifindex)


def _add_clsact(rt: Rtnl, ifindex: int) -> bool:
    """Add the device's clsact qdisc; False if it has one already."""
    try:
        rt.request(tcm.encode_add_clsact(rt.next_seq(), ifindex), f"clsact on device {ifindex}")
    except NetlinkError as err:
        if err.errno == errno.EEXIST:
            return False
        raise
    return True


def attach(ifindex: int, direction: str, prog_fd: int, name: str, hook: str, pins: Pins, *,
           last: bool = False) -> list[str]:
    """Put program ``prog_fd`` (named ``name``) on the device's ``direction`` hook of kind
    ``hook`` (from :func:`resolve`), in place of ours if there; then take ours of that name off
    the other kind of hook, and an older agent's from tcx without a link.  Returns a line for
    each program without a link on that tcx hook that is neither ours nor known to be anyone
    else's (none, as a rule; see the module's docstring).  A program new on a tcx hook goes
    first in its list, or ``last``; a new cls_bpf filter runs before those at its priority."""
    what = f"device {ifindex} {direction}: cannot attach {name}"
    try:
        if hook == "tcx":
            _attach_tcx(ifindex, direction, prog_fd, name, pins, last)
            _remove_filter(ifindex, direction, name)
        else:
            _attach_clsact(ifindex, direction, prog_fd, name)
            if not tcx_available():
                return []
            _remove_link(pins, name, ifindex)
        return _remove_unlinked(ifindex, direction, {name}, pins)[1]
    except lb.BpfError as err:
        raise TcError(f"{what}: {err.strerror}") from None
    except NetlinkError as err:
        raise TcError(f"{what}: {err}") from None


def _attach_clsact(ifindex: int, direction: str, prog_fd: int, name: str) -> None:
    place = handle(name)
    for f in _cls_filters(ifindex):
        if f.direction == direction and f.prio == PRIO and f.handle == place and not (f.ours and f.name == name):
            raise TcError(f"device {ifindex} {direction}: priority {PRIO:#x} handle {place} holds a {f.kind} "
                          f"filter {f.name or ''} that is not this one of agentd's; not replacing it")
    with Rtnl() as rt:
        _add_clsact(rt, ifindex)
        rt.request(tcm.encode_replace_bpf_filter(rt.next_seq(), ifindex, PARENTS[direction], PRIO, place,
                                                 ETH_P_ALL, prog_fd, name),
                   f"attaching {name} to device {ifindex}")


def _attach_tcx(ifindex: int, direction: str, prog_fd: int, name: str, pins: Pins, last: bool = False) -> None:
    """Ours by its pinned link: the new program swapped in, or a new link made (first on the
    hook, or ``last``) and pinned."""
    path = pins.link(name, ifindex)
    got = _open_link(path)
    if got is not None:
        fd, info = got
        try:
            if info.get("ifindex") == ifindex and info.get("attach_type") == TCX[direction]:
                lb.link_update(fd, prog_fd)  # the same program again: the kernel leaves it be
                return
            if info.get("ifindex"):
                lb.link_detach(fd)
        finally:
            os.close(fd)
        # The device it was made for went (the link holds nothing now) and this ifindex is
        # another device's.
        path.unlink()
    path.parent.mkdir(mode=0o700, exist_ok=True)
    fd = lb.link_create(prog_fd, ifindex, TCX[direction], last=last)
    try:
        lb.obj_pin(fd, str(path))
    finally:
        os.close(fd)  # had the pin failed, the link would go with this: nothing left attached


def _remove_link(pins: Pins, name: str, ifindex: int) -> int:
    """Our link of ``name`` on device ``ifindex`` detached and unpinned; 1 if it was attached."""
    path = pins.link(name, ifindex)
    got = _open_link(path)
    if got is None:
        return 0
    fd, info = got
    try:
        attached = bool(info.get("ifindex"))
        if attached:
            lb.link_detach(fd)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return int(attached)


_reported: set[tuple[int, str, int]] = set()


def _remove_unlinked(ifindex: int, direction: str, names: set[str] | tuple[str, ...], pins: Pins) -> tuple[int, list[str]]:
    """Ours named one of ``names`` on the device's tcx hook without a link (an agent before
    links attached them) detached by their position.  Returns how many, and a line for each
    program without a link there that we can name neither ours nor anyone's."""
    removed = 0
    for _ in range(8):
        hook = lb.tcx_query(ifindex, TCX[direction])
        unnamed, target = [], None
        for index, (prog_id, link_id) in enumerate(zip(hook.prog_ids, hook.link_ids)):
            if link_id:
                continue  # ours by their pins (handled above), or anyone's: a link is its owner's to remove
            name = pins.programs.get(prog_id) or _name_by_id(prog_id)
            if name in names:
                target = index
                break
            if name is None:
                unnamed.append(prog_id)
        if target is None:
            return removed, [_unnamed(ifindex, direction, prog_id) for prog_id in unnamed]
        try:
            lb.tcx_detach_at(ifindex, TCX[direction], hook, target)
        except lb.BpfError as err:
            if err.errno != errno.ESTALE:
                raise
            continue  # the hook changed since the query: look again
        removed += 1
    raise lb.BpfError(errno.EAGAIN, f"detaching from device {ifindex} (tcx)", "the hook kept changing")


def _unnamed(ifindex: int, direction: str, prog_id: int) -> str:
    try:
        device = socket.if_indextoname(ifindex)
    except OSError:
        device = f"device {ifindex}"
    line = (f"{device} {direction} (tcx): program {prog_id}, attached without a link, is not agentd's by any "
            "pin, and naming it by its id takes CAP_SYS_ADMIN: it stays, after ours (it sees what ours passes "
            f"on). If an agentd before links left it (`bpftool prog show id {prog_id}` as root names it), an "
            "agent with CAP_SYS_ADMIN removes it, or remove the device's tcx programs as root")
    if (ifindex, direction, prog_id) not in _reported:
        _reported.add((ifindex, direction, prog_id))
        log.warning("%s", line)
    return line


def _remove_filter(ifindex: int, direction: str, name: str) -> None:
    """Our cls_bpf filter named ``name`` off the device's hook, if there (ours by tcx runs
    first and decides already); the qdisc stays: deleting it would graft, see above."""
    with Rtnl() as rt:
        try:
            answers = rt.request(tcm.encode_get_filters(rt.next_seq(), ifindex, PARENTS[direction]),
                                 f"listing filters of device {ifindex}")
        except NetlinkError as err:
            if err.errno in (errno.EINVAL, errno.ENOENT):
                return  # no clsact qdisc
            raise
        for mtype, buf, start, end in answers:
            if mtype != tcm.RTM_NEWTFILTER:
                continue
            f = tcm.decode_filter(buf, start, end)
            if f.handle and f.prio == PRIO and f.kind == "bpf" and f.name == name:
                with contextlib.suppress(NetlinkError):
                    rt.request(tcm.encode_del_filter(rt.next_seq(), ifindex, PARENTS[direction], f.prio, f.handle,
                                                     ETH_P_ALL, "bpf"), f"deleting a filter of device {ifindex}")


def detach(ifindex: int, names: tuple[str, ...], pins: Pins) -> int:
    """Remove our programs (those named ``names``) from the device: our tcx links, an older
    agent's tcx programs without one, cls_bpf filters (and the clsact qdisc if nothing else is
    on it); returns how many were removed.  A device that is gone has nothing to remove."""
    removed = sum(_remove_link(pins, name, ifindex) for name in names)
    try:
        if tcx_available():
            for direction in TCX:
                removed += _remove_unlinked(ifindex, direction, set(names), pins)[0]
        legacy = _cls_filters(ifindex)
    except (NetlinkError, lb.BpfError) as err:
        if err.errno == errno.ENODEV:
            return removed
        raise
    with Rtnl() as rt:
        gone = 0
        for f in legacy:
            if f.ours and f.name in names:
                with contextlib.suppress(NetlinkError):
                    rt.request(tcm.encode_del_filter(rt.next_seq(), ifindex, PARENTS[f.direction], f.prio, f.handle,
                                                     ETH_P_ALL, "bpf"), f"deleting a filter of device {ifindex}")
                    gone += 1
        if gone and all(f.ours and f.name in names for f in legacy):  # we were there, and nobody else is
            with contextlib.suppress(NetlinkError):
                rt.request(tcm.encode_del_clsact(rt.next_seq(), ifindex), f"deleting clsact on device {ifindex}")
    return removed + gone


def sweep(pins: Pins) -> int:
    """Unpin our links whose device is gone (a pod's veth, a bridge: the link outlived it and
    holds only the program); returns how many.  Tidying only: a pin it cannot open stays."""
    n = 0
    for path in pins.links():
        try:
            got = _open_link(path)
        except lb.BpfError:
            continue
        if got is None:
            continue
        os.close(got[0])
        if not got[1].get("ifindex"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                n += 1
    return n


def remove_links(pins: Pins, names: tuple[str, ...]) -> int:
    """Detach and unpin every link of ours of ``names``, whatever device (gone ones too); the
    links directory goes once empty.  Returns how many were attached."""
    n = sum(_remove_link(pins, name, ifindex) for name, ifindex in pins.links().values() if name in names)
    with contextlib.suppress(OSError):
        (pins.dir / LINKS).rmdir()
    return n
