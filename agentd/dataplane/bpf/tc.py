"""Attach the data path's programs to a device, one per direction, where the program's return
value is the verdict -- without running ``tc`` or ``bpftool``.

* **tcx** (Linux 6.6 and later), the first choice: BPF_PROG_ATTACH with BPF_TCX_INGRESS /
  BPF_TCX_EGRESS puts the program on the device's hook with no qdisc at all.  That matters on
  a device that carries traffic: adding a clsact qdisc *grafts* it, and the kernel deactivates
  the device's transmit queues for an RCU grace period while it does (``qdisc_graft`` calls
  ``dev_deactivate``): every packet sent out of the device meanwhile is dropped
  (SKB_DROP_REASON_QDISC_DROP).  A pods' bridge the CNI plugin made a moment ago, or an
  underlay device, would lose packets each time an agent took it over.  :func:`attach`
  replaces our program in place (BPF_F_REPLACE: between two packets), which is how a
  restarted or upgraded agent takes over without a gap.
* **clsact + cls_bpf** in direct-action mode (agentd.kernel.netlink_tc on the agent's one
  netlink codec), where the kernel has no tcx: the
  requests ``tc filter replace dev X egress prio P handle H bpf da fd N name NAME`` makes.
  Our filters sit at priority :data:`PRIO`, handle :data:`HANDLE`; a filter at that place that
  is not ours is never touched.  The qdisc is added once per device (the one moment the
  device may drop a packet); later replacements are one RTM_NEWTFILTER with NLM_F_REPLACE.

Our programs are known by name (:data:`OURS`).  :func:`detach` removes ours from both kinds of
hook, and the clsact qdisc once no filter of anyone is left on it.  An agent that finds a
cls_bpf filter of an older agent on a device it attaches to by tcx removes that filter (and
leaves the qdisc: removing it would graft again).  Blocking calls: run them off the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass

from agentd.kernel import netlink_tc as tcm
from agentd.kernel.netlink import NetlinkError
from agentd.kernel.rtnl import Rtnl

from . import syscall as sc

PRIO = 0xA6E7  # "agentd" hashed to 16 bits: out of the way of the 1, 2, 49152... others pick
HANDLE = 1
PARENTS = {"ingress": 0xFFFFFFF2, "egress": 0xFFFFFFF3}  # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_*)
ETH_P_ALL = 0x0003
OURS = ("agentd_egress", "agentd_ingress")  # the data path (datapath.c)
POD_FAST_PATH = "agentd_pod_fast"  # on pods' veths (podpath.c)
POD_WIRE = "agentd_pod_wire"  # on the underlay device (podpath.c)
PROGRAMS = (*OURS, POD_FAST_PATH, POD_WIRE)  # every program of ours, by name
TCX = {"ingress": sc.TCX_INGRESS, "egress": sc.TCX_EGRESS}
_tcx: bool | None = None  # whether this kernel has tcx; learned on first use


class TcError(RuntimeError):
    """Attaching or detaching failed; one line naming the device and why."""


@dataclass(frozen=True)
class Filter:
    direction: str  # "ingress" | "egress"
    prio: int
    handle: int
    kind: str | None
    name: str | None  # cls_bpf's TCA_BPF_NAME, or the tcx program's name
    prog_id: int | None = None  # cls_bpf's TCA_BPF_ID, or the tcx program's id

    @property
    def ours(self) -> bool:
        if self.kind == "tcx":
            return self.name in PROGRAMS
        return self.prio == PRIO and self.kind == "bpf" and self.name in PROGRAMS


def tcx_available() -> bool:
    """Whether this kernel has tcx hooks (asked once: a query on the loopback device)."""
    global _tcx
    if _tcx is None:
        try:
            sc.tcx_query(1, sc.TCX_INGRESS)
            _tcx = True
        except sc.BpfError as err:
            if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            _tcx = False
    return _tcx


def _tcx_programs(ifindex: int, direction: str) -> list[tuple[int, str]]:
    """(id, name) of every program on the device's tcx hook for ``direction``."""
    out = []
    for prog_id in sc.tcx_query(ifindex, TCX[direction]):
        try:
            fd = sc.prog_fd_by_id(prog_id)
        except sc.BpfError as err:
            if err.errno == errno.ENOENT:  # detached and freed since the query
                continue
            raise
        try:
            out.append((prog_id, sc.prog_info(fd)["name"]))
        finally:
            os.close(fd)
    return out


def filters(ifindex: int) -> list[Filter]:
    """Every program on the device's tcx hooks and every filter on its clsact hooks (anyone's)."""
    out = []
    if tcx_available():
        for direction in TCX:
            out += [Filter(direction, 0, 0, "tcx", name, pid) for pid, name in _tcx_programs(ifindex, direction)]
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


def _add_clsact(rt: Rtnl, ifindex: int) -> bool:
    """Add the device's clsact qdisc; False if it has one already."""
    try:
        rt.request(tcm.encode_add_clsact(rt.next_seq(), ifindex), f"clsact on device {ifindex}")
    except NetlinkError as err:
        if err.errno == errno.EEXIST:
            return False
        raise
    return True


def attach(ifindex: int, direction: str, prog_fd: int, name: str) -> None:
    """Put program ``prog_fd`` (named ``name``) on the device's ``direction`` hook: by tcx where
    the kernel has it (in place of ours if there), else as our cls_bpf filter."""
    if tcx_available():
        try:
            _attach_tcx(ifindex, direction, prog_fd, name)
        except sc.BpfError as err:
            raise TcError(f"device {ifindex} {direction}: cannot attach {name}: {err.strerror}") from None
        except NetlinkError as err:
            raise TcError(f"device {ifindex} {direction}: cannot attach {name}: {err}") from None
        return
    try:
        for f in filters(ifindex):
            if f.direction == direction and f.prio == PRIO and f.handle == HANDLE and not f.ours:
                raise TcError(f"device {ifindex} {direction}: priority {PRIO:#x} handle {HANDLE} holds a {f.kind} "
                              f"filter {f.name or ''} that is not agentd's; not replacing it")
        with Rtnl() as rt:
            _add_clsact(rt, ifindex)
            rt.request(tcm.encode_replace_bpf_filter(rt.next_seq(), ifindex, PARENTS[direction], PRIO, HANDLE,
                                                     ETH_P_ALL, prog_fd, name),
                       f"attaching {name} to device {ifindex}")
    except NetlinkError as err:
        raise TcError(f"device {ifindex} {direction}: cannot attach {name}: {err}") from None


def _attach_tcx(ifindex: int, direction: str, prog_fd: int, name: str) -> None:
    mine = [pid for pid, pname in _tcx_programs(ifindex, direction) if pname == name]
    if mine == [sc.prog_info(prog_fd)["id"]]:
        pass  # already there
    elif mine:
        old = sc.prog_fd_by_id(mine[0])
        try:
            sc.tcx_attach(ifindex, TCX[direction], prog_fd, replace_fd=old)
        finally:
            os.close(old)
        for extra in mine[1:]:  # only ever one of ours; more would run for nothing
            _detach_tcx(ifindex, direction, extra)
    else:
        sc.tcx_attach(ifindex, TCX[direction], prog_fd)
    # An older agent's cls_bpf filter: ours now runs first and decides; the filter goes (the
    # qdisc stays: deleting it would graft, see above).
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
            if f.handle and f.prio == PRIO and f.kind == "bpf" and f.name in PROGRAMS:
                with contextlib.suppress(NetlinkError):
                    rt.request(tcm.encode_del_filter(rt.next_seq(), ifindex, PARENTS[direction], f.prio, f.handle,
                                                     ETH_P_ALL, "bpf"), f"deleting a filter of device {ifindex}")


def _detach_tcx(ifindex: int, direction: str, prog_id: int) -> bool:
    try:
        fd = sc.prog_fd_by_id(prog_id)
    except sc.BpfError as err:
        if err.errno == errno.ENOENT:
            return False
        raise
    try:
        sc.tcx_detach(ifindex, TCX[direction], fd)
        return True
    except sc.BpfError as err:
        if err.errno in (errno.ENOENT, errno.ENODEV):
            return False
        raise
    finally:
        os.close(fd)


def detach(ifindex: int, names: tuple[str, ...] = PROGRAMS) -> int:
    """Remove our programs (those named ``names``) from the device: tcx ones, cls_bpf filters
    (and the clsact qdisc if nothing else is on it); returns how many were removed.  A device
    that is gone has nothing to remove."""
    try:
        current = filters(ifindex)
    except (NetlinkError, sc.BpfError) as err:
        if err.errno == errno.ENODEV:
            return 0
        raise
    removed = 0
    for f in current:
        if f.ours and f.name in names and f.kind == "tcx" and f.prog_id is not None:
            with contextlib.suppress(sc.BpfError):
                removed += _detach_tcx(ifindex, f.direction, f.prog_id)
    legacy = [f for f in current if f.kind != "tcx"]
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
