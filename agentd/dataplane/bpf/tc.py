"""Attach the data path's programs to a device: a clsact qdisc and one cls_bpf filter per
direction, in direct-action mode (the program's return value is the verdict), through
pyroute2's rtnetlink -- the same requests ``tc filter replace dev X egress prio P handle H
bpf da fd N name NAME`` makes, without running ``tc``.

Our filters sit at priority :data:`PRIO`, handle :data:`HANDLE`, and carry the program's
name ("agentd_egress", "agentd_ingress"); :func:`attach` replaces ours in place (one
RTM_NEWTFILTER with NLM_F_REPLACE: the kernel swaps the program between two packets, which
is how a restarted or upgraded agent takes over without a gap) and refuses to touch a
filter at that place that is not ours.  :func:`detach` removes ours, and the clsact qdisc
once no filter of anyone is left on it.  Nothing here runs in the event loop: call it
from a thread (pyroute2's synchronous API runs its own loop).
"""

from __future__ import annotations

import contextlib
import errno
from dataclasses import dataclass

PRIO = 0xA6E7  # "agentd" hashed to 16 bits: out of the way of the 1, 2, 49152... others pick
HANDLE = 1
PARENTS = {"ingress": 0xFFFFFFF2, "egress": 0xFFFFFFF3}  # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_*)
CLSACT_HANDLE = 0xFFFF0000
ETH_P_ALL = 0x0003
OURS = ("agentd_egress", "agentd_ingress")


class TcError(RuntimeError):
    """Attaching or detaching failed; one line naming the device and why."""


@dataclass(frozen=True)
class Filter:
    direction: str  # "ingress" | "egress"
    prio: int
    handle: int
    kind: str
    name: str | None  # cls_bpf's TCA_BPF_NAME

    @property
    def ours(self) -> bool:
        return self.prio == PRIO and self.kind == "bpf" and self.name in OURS


def _ipr():
    from pyroute2 import IPRoute

    return IPRoute()


def _netlink_error():
    from pyroute2.netlink.exceptions import NetlinkError

    return NetlinkError


def filters(ifindex: int) -> list[Filter]:
    """Every filter on the device's clsact hooks (anyone's)."""
    out = []
    with _ipr() as ipr:
        for direction, parent in PARENTS.items():
            try:
                msgs = list(ipr.get_filters(index=ifindex, parent=parent))
            except _netlink_error() as err:
                if err.code in (errno.EINVAL, errno.ENOENT, errno.ENODEV):
                    continue  # no clsact qdisc
                raise
            for m in msgs:
                kind = m.get_attr("TCA_KIND")
                if kind is None or not m["handle"]:
                    continue  # the header of a priority's chain, not a filter
                opts = m.get_attr("TCA_OPTIONS")
                name = opts.get_attr("TCA_BPF_NAME") if opts is not None and kind == "bpf" else None
                out.append(Filter(direction, (m["info"] >> 16) & 0xFFFF, m["handle"], kind, name))
    return out


def _ensure_clsact(ipr, ifindex: int) -> None:
    try:
        ipr.tc("add", "clsact", ifindex)
    except _netlink_error() as err:
        if err.code != errno.EEXIST:
            raise


def attach(ifindex: int, direction: str, prog_fd: int, name: str) -> None:
    """Put program ``prog_fd`` (named ``name``) on the device's ``direction`` hook."""
    parent = PARENTS[direction]
    for f in filters(ifindex):
        if f.direction == direction and f.prio == PRIO and f.handle == HANDLE and not f.ours:
            raise TcError(f"device {ifindex} {direction}: priority {PRIO:#x} handle {HANDLE} holds a {f.kind} "
                          f"filter {f.name or ''} that is not agentd's; not replacing it")
    try:
        with _ipr() as ipr:
            _ensure_clsact(ipr, ifindex)
            ipr.tc("replace-filter", "bpf", ifindex, HANDLE, parent=parent, prio=PRIO, protocol=ETH_P_ALL,
                   fd=prog_fd, name=name, direct_action=True)
    except _netlink_error() as err:
        raise TcError(f"device {ifindex} {direction}: cannot attach {name}: {err}") from None


def detach(ifindex: int) -> int:
    """Remove our filters from the device (and the clsact qdisc if nothing else is on it);
    returns how many filters were removed.  A device that is gone has nothing to remove."""
    removed = 0
    try:
        current = filters(ifindex)
    except _netlink_error() as err:
        if err.code == errno.ENODEV:
            return 0
        raise
    with _ipr() as ipr:
        for f in current:
            if not f.ours:
                continue
            with contextlib.suppress(_netlink_error()):
                ipr.tc("del-filter", "bpf", ifindex, f.handle, parent=PARENTS[f.direction], prio=f.prio,
                       protocol=ETH_P_ALL)
                removed += 1
        if not [f for f in current if not f.ours]:
            with contextlib.suppress(_netlink_error()):
                ipr.tc("del", "clsact", ifindex)
    return removed
