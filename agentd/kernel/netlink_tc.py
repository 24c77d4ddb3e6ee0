"""Traffic control on rtnetlink: clsact qdiscs and cls_bpf filters -- what ``tc qdisc add dev X
clsact`` and ``tc filter replace dev X egress prio P handle H bpf da fd N name NAME`` send.
Built on :mod:`agentd.kernel.netlink` (attribute packer, parser, socket, error acks); the
BPF data path (agentd.dataplane.bpf.tc) says which filters to put where.

Layout (include/uapi/linux/rtnetlink.h, pkt_sched.h, pkt_cls.h)::

    struct tcmsg { u8 family, pad1; u16 pad2; s32 ifindex; u32 handle, parent, info; }   20 bytes

A filter's ``info`` is ``prio << 16 | htons(protocol)`` (TC_H_MAKE(prio << 16, protocol)).
"""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple

from agentd.kernel import netlink as nl

RTM_NEWQDISC = 36
RTM_DELQDISC = 37
RTM_NEWTFILTER = 44
RTM_DELTFILTER = 45
RTM_GETTFILTER = 46

TCA_KIND = 1
TCA_OPTIONS = 2
NLA_F_NESTED = 0x8000

# pkt_cls.h: cls_bpf options (inside TCA_OPTIONS)
TCA_BPF_FD = 6
TCA_BPF_NAME = 7
TCA_BPF_FLAGS = 8
TCA_BPF_ID = 11
TCA_BPF_FLAG_ACT_DIRECT = 1  # direct action: the program's return value is the verdict

# pkt_sched.h
TC_H_CLSACT = 0xFFFFFFF1  # == TC_H_INGRESS: the clsact qdisc's parent
CLSACT_HANDLE = 0xFFFF0000  # TC_H_MAKE(TC_H_CLSACT, 0)

_TCMSG = struct.Struct("=BxxxiIII")
_U32 = struct.Struct("=I")


class TcFilter(NamedTuple):
    """One filter of a dump: ``name`` and ``prog_id`` are cls_bpf's (None for other kinds)."""

    prio: int
    handle: int
    kind: str | None
    name: str | None = None
    prog_id: int | None = None


def _message(mtype: int, seq: int, flags: int, ifindex: int, handle: int, parent: int, info: int,
             attributes: bytes = b"") -> bytes:
    body = _TCMSG.pack(nl.AF_UNSPEC, ifindex, handle, parent, info) + attributes
    return struct.pack("=IHHII", nl.NLMSG_HDRLEN + len(body), mtype, flags, seq, 0) + body


def filter_info(prio: int, protocol: int) -> int:
    """tcm_info of a filter: priority in the upper 16 bits, the ETH_P_* protocol (network byte
    order) in the lower."""
    return (prio << 16) | socket.htons(protocol)


def encode_add_clsact(seq: int, ifindex: int) -> bytes:
    """RTM_NEWQDISC clsact (CREATE|EXCL: EEXIST if the device has one)."""
    return _message(RTM_NEWQDISC, seq, nl.NLM_F_REQUEST | nl.NLM_F_CREATE | nl.NLM_F_EXCL, ifindex,
                    CLSACT_HANDLE, TC_H_CLSACT, 0, nl.attr(TCA_KIND, b"clsact\0"))


def encode_del_clsact(seq: int, ifindex: int) -> bytes:
    return _message(RTM_DELQDISC, seq, nl.NLM_F_REQUEST, ifindex, CLSACT_HANDLE, TC_H_CLSACT, 0)


def encode_replace_bpf_filter(seq: int, ifindex: int, parent: int, prio: int, handle: int, protocol: int,
                              fd: int, name: str) -> bytes:
    """RTM_NEWTFILTER (CREATE|REPLACE) of a direct-action cls_bpf filter running program ``fd``."""
    options = (nl.attr_u32(TCA_BPF_FD, fd) + nl.attr(TCA_BPF_NAME, name.encode() + b"\0")
               + nl.attr_u32(TCA_BPF_FLAGS, TCA_BPF_FLAG_ACT_DIRECT))
    return _message(RTM_NEWTFILTER, seq, nl.NLM_F_REQUEST | nl.NLM_F_CREATE | nl.NLM_F_REPLACE, ifindex, handle,
                    parent, filter_info(prio, protocol),
                    nl.attr(TCA_KIND, b"bpf\0") + nl.attr(TCA_OPTIONS | NLA_F_NESTED, options))


def encode_del_filter(seq: int, ifindex: int, parent: int, prio: int, handle: int, protocol: int, kind: str) -> bytes:
    return _message(RTM_DELTFILTER, seq, nl.NLM_F_REQUEST, ifindex, handle, parent, filter_info(prio, protocol),
                    nl.attr(TCA_KIND, kind.encode() + b"\0"))


def encode_get_filters(seq: int, ifindex: int, parent: int) -> bytes:
    """RTM_GETTFILTER dump of the filters on one hook (``parent``) of a device."""
    return _message(RTM_GETTFILTER, seq, nl.NLM_F_REQUEST | nl.NLM_F_DUMP, ifindex, 0, parent, 0)


def decode_filter(buf: bytes, start: int = 0, end: int | None = None) -> TcFilter:
    """One RTM_NEWTFILTER of a dump (handle 0 is a priority's chain header, not a filter)."""
    if end is None:
        end = len(buf)
    if end > len(buf) or end - start < _TCMSG.size:
        raise nl.NetlinkDecodeError(f"filter message body is {end - start} bytes, tcmsg needs {_TCMSG.size}")
    _family, _ifindex, handle, _parent, info = _TCMSG.unpack_from(buf, start)
    kind = name = prog_id = None
    for atype, vs, ve in nl.iter_attrs(buf, start + _TCMSG.size, end):
        if atype == TCA_KIND:
            kind = nl.read_string(buf, vs, ve)
        elif atype == TCA_OPTIONS and kind == "bpf":  # TCA_KIND comes first; other kinds number theirs apart
            for otype, os_, oe in nl.iter_attrs(buf, vs, ve):
                if otype == TCA_BPF_NAME:
                    name = nl.read_string(buf, os_, oe)
                elif otype == TCA_BPF_ID:
                    prog_id = nl.read_u32(buf, os_, oe, "TCA_BPF_ID")
    return TcFilter(info >> 16, handle, kind, name, prog_id)
