"""Attach the data path's programs to a device: a clsact qdisc and one cls_bpf filter per
direction, in direct-action mode (the program's return value is the verdict), through
rtnetlink (agentd.kernel.netlink_tc on the agent's one netlink codec) -- the requests ``tc filter replace dev X egress prio P handle H bpf da
fd N name NAME`` makes, without running ``tc``.

Our filters sit at priority :data:`PRIO`, handle :data:`HANDLE`, and carry the program's
name ("agentd_egress", "agentd_ingress"); :func:`attach` replaces ours in place (one
RTM_NEWTFILTER with NLM_F_REPLACE: the kernel swaps the program between two packets, which
is how a restarted or upgraded agent takes over without a gap) and refuses to touch a
filter at that place that is not ours.  :func:`detach` removes ours, and the clsact qdisc
once no filter of anyone is left on it.  Blocking calls: run them off the event loop.
"""

from __future__ import annotations

import contextlib
import errno
from dataclasses import dataclass

from agentd.kernel import netlink_tc as tcm
from agentd.kernel.netlink import NetlinkError
from agentd.kernel.rtnl import Rtnl

PRIO = 0xA6E7  # "agentd" hashed to 16 bits: out of the way of the 1, 2, 49152... others pick
HANDLE = 1
PARENTS = {"ingress": 0xFFFFFFF2, "egress": 0xFFFFFFF3}  # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_*)
ETH_P_ALL = 0x0003
OURS = ("agentd_egress", "agentd_ingress")


class TcError(RuntimeError):
    """Attaching or detaching failed; one line naming the device and why."""


@dataclass(frozen=True)
class Filter:
    direction: str  # "ingress" | "egress"
    prio: int
    handle: int
    kind: str | None
    name: str | None  # cls_bpf's TCA_BPF_NAME
    prog_id: int | None = None  # cls_bpf's TCA_BPF_ID

    @property
    def ours(self) -> bool:
        return self.prio == PRIO and self.kind == "bpf" and self.name in OURS


def filters(ifindex: int) -> list[Filter]:
    """Every filter on the device's clsact hooks (anyone's); none without a clsact qdisc."""
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
    """Put program ``prog_fd`` (named ``name``) on the device's ``direction`` hook."""
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


def detach(ifindex: int) -> int:
    """Remove our filters from the device (and the clsact qdisc if nothing else is on it);
    returns how many filters were removed.  A device that is gone has nothing to remove."""
    try:
        current = filters(ifindex)
    except NetlinkError as err:
        if err.errno == errno.ENODEV:
            return 0
        raise
    removed = 0
    with Rtnl() as rt:
        for f in current:
            if f.ours:
                with contextlib.suppress(NetlinkError):
                    rt.request(tcm.encode_del_filter(rt.next_seq(), ifindex, PARENTS[f.direction], f.prio, f.handle,
                                                     ETH_P_ALL, "bpf"), f"deleting a filter of device {ifindex}")
                    removed += 1
        if removed and all(f.ours for f in current):  # we were there, and nobody else is: ours to remove
            with contextlib.suppress(NetlinkError):
                rt.request(tcm.encode_del_clsact(rt.next_seq(), ifindex), f"deleting clsact on device {ifindex}")
    return removed
