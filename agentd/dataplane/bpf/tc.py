"""Attach the BPF programs to a device, one per hook, where the program's return value is the
verdict -- without running ``tc`` or ``bpftool``.  Two kinds of hook, chosen by
``[network] bpf_attach`` (:func:`resolve`):

* **tcx** (Linux 6.6 and later, CONFIG_NET_XGRESS): BPF_PROG_ATTACH with BPF_TCX_INGRESS /
  BPF_TCX_EGRESS puts the program on the device's hook with no qdisc at all.  That matters on
  a device that carries traffic: adding a clsact qdisc *grafts* it, and the kernel deactivates
  the device's transmit queues for an RCU grace period while it does (``qdisc_graft`` calls
  ``dev_deactivate``): every packet sent out of the device meanwhile is dropped
  (SKB_DROP_REASON_QDISC_DROP).  A pods' bridge the CNI plugin made a moment ago, or an
  underlay device, would lose packets each time an agent took it over.  :func:`attach`
  replaces our program in place (BPF_F_REPLACE: between two packets), which is how a
  restarted or upgraded agent takes over without a gap.
* **clsact + cls_bpf** in direct-action mode (agentd.kernel.netlink_tc on the agent's one
  netlink codec), for kernels without tcx (Debian 12's 6.1): the requests
  ``tc filter replace dev X ingress prio P handle H bpf da fd N name NAME`` makes.  Our
  filters sit at priority :data:`PRIO`, one handle per program (:data:`HANDLES`: the data
  path's ingress program and the pod fast path's share the underlay's ingress hook); a
  filter at that place that is not ours is never touched.  The qdisc is added once per
  device (the one moment the device may drop a packet); later replacements are one
  RTM_NEWTFILTER with NLM_F_REPLACE, between two packets as well.

Our programs are known by name (:data:`PROGRAMS`).  :func:`detach` removes ours from both kinds
of hook, and the clsact qdisc once no filter of anyone is left on it.  An agent that attaches
by one kind takes ours off the other kind of hook on that device after its own is on (a
change of ``bpf_attach``, or an older agent's cls_bpf filters): never a moment without, never
two of ours deciding; removing a cls_bpf filter leaves the qdisc (removing it would graft
again).  Blocking calls: run them off the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass

from agentd.kernel import netlink_tc as tcm
from agentd.kernel.netlink import NetlinkError
from agentd.kernel.rtnl import Rtnl

from . import libbpf as lb

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


def _tcx_programs(ifindex: int, direction: str) -> list[tuple[int, str]]:
    """(id, name) of every program on the device's tcx hook for ``direction``."""
    out = []
    for prog_id in lb.tcx_query(ifindex, TCX[direction]):
        try:
            fd = lb.prog_fd_by_id(prog_id)
        except lb.BpfError as err:
            if err.errno == errno.ENOENT:  # detached and freed since the query
                continue
            raise
        try:
            out.append((prog_id, lb.prog_info(fd)["name"]))
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


def attach(ifindex: int, direction: str, prog_fd: int, name: str, hook: str) -> None:
    """Put program ``prog_fd`` (named ``name``) on the device's ``direction`` hook of kind
    ``hook`` (from :func:`resolve`), in place of ours if there; then take ours of that name off
    the other kind of hook."""
    what = f"device {ifindex} {direction}: cannot attach {name}"
    try:
        if hook == "tcx":
            _attach_tcx(ifindex, direction, prog_fd, name)
            _remove_filter(ifindex, direction, name)
        else:
            _attach_clsact(ifindex, direction, prog_fd, name)
            if tcx_available():
                for prog_id, pname in _tcx_programs(ifindex, direction):
                    if pname == name:
                        _detach_tcx(ifindex, direction, prog_id)
    except lb.BpfError as err:
        raise TcError(f"{what}: {err.strerror}") from None
    except NetlinkError as err:
        raise TcError(f"{what}: {err}") from None


def _attach_clsact(ifindex: int, direction: str, prog_fd: int, name: str) -> None:
    place = handle(name)
    for f in filters(ifindex):
        if f.direction == direction and f.prio == PRIO and f.handle == place and not (f.ours and f.name == name):
            raise TcError(f"device {ifindex} {direction}: priority {PRIO:#x} handle {place} holds a {f.kind} "
                          f"filter {f.name or ''} that is not this one of agentd's; not replacing it")
    with Rtnl() as rt:
        _add_clsact(rt, ifindex)
        rt.request(tcm.encode_replace_bpf_filter(rt.next_seq(), ifindex, PARENTS[direction], PRIO, place,
                                                 ETH_P_ALL, prog_fd, name),
                   f"attaching {name} to device {ifindex}")


def _attach_tcx(ifindex: int, direction: str, prog_fd: int, name: str) -> None:
    mine = [pid for pid, pname in _tcx_programs(ifindex, direction) if pname == name]
    if mine == [lb.prog_info(prog_fd)["id"]]:
        return  # already there
    if mine:
        old = lb.prog_fd_by_id(mine[0])
        try:
            lb.tcx_attach(ifindex, TCX[direction], prog_fd, replace_fd=old)
        finally:
            os.close(old)
        for extra in mine[1:]:  # only ever one of ours; more would run for nothing
            _detach_tcx(ifindex, direction, extra)
    else:
        lb.tcx_attach(ifindex, TCX[direction], prog_fd)


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


def _detach_tcx(ifindex: int, direction: str, prog_id: int) -> bool:
    try:
        fd = lb.prog_fd_by_id(prog_id)
    except lb.BpfError as err:
        if err.errno == errno.ENOENT:
            return False
        raise
    try:
        lb.tcx_detach(ifindex, TCX[direction], fd)
        return True
    except lb.BpfError as err:
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
    except (NetlinkError, lb.BpfError) as err:
        if err.errno == errno.ENODEV:
            return 0
        raise
    removed = 0
    for f in current:
        if f.ours and f.name in names and f.kind == "tcx" and f.prog_id is not None:
            with contextlib.suppress(lb.BpfError):
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
