"""The few rtnetlink requests the BPF data path makes, on a plain NETLINK_ROUTE socket.

clsact qdiscs and cls_bpf filters (RTM_{NEW,DEL}QDISC, RTM_{NEW,DEL,GET}TFILTER: what ``tc``
sends), the kernel's route to one address (RTM_GETROUTE: ``ip route get``) and the bridges'
learned MACs (RTM_GETNEIGH, AF_BRIDGE: ``bridge fdb show``).  Synchronous
and small on purpose: every agent loads the data path at start, and a netlink library's
import would cost each of them more than all of this (pyroute2: ~0.2 s and ~10 MB).
Message layouts from include/uapi/linux/{netlink,rtnetlink,pkt_sched,pkt_cls}.h.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterator

NETLINK_ROUTE = 0
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_ACK = 0x1, 0x2, 0x4
NLM_F_DUMP = 0x300
NLM_F_REPLACE, NLM_F_EXCL, NLM_F_CREATE = 0x100, 0x200, 0x400
NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_NEWROUTE, RTM_GETROUTE = 24, 26
RTM_GETLINK = 18
RTM_GETNEIGH = 30
IFLA_LINKINFO, IFLA_INFO_KIND = 18, 1
AF_BRIDGE = 7
NDA_LLADDR, NDA_MASTER = 2, 9
NUD_PERMANENT = 0x80
RTM_NEWQDISC, RTM_DELQDISC = 36, 37
RTM_NEWTFILTER, RTM_DELTFILTER, RTM_GETTFILTER = 44, 45, 46
TCA_KIND, TCA_OPTIONS = 1, 2
TCA_BPF_FD, TCA_BPF_NAME, TCA_BPF_FLAGS, TCA_BPF_ID = 6, 7, 8, 11
TCA_BPF_FLAG_ACT_DIRECT = 1
RTA_DST, RTA_OIF, RTA_GATEWAY = 1, 4, 5
NLA_F_NESTED = 0x8000
TC_H_CLSACT = 0xFFFFFFF1
CLSACT_HANDLE = 0xFFFF0000

_NLMSG = struct.Struct("=IHHII")
_TCMSG = struct.Struct("=BBHiIII")  # family, pad, pad, ifindex, handle, parent, info
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, protocol, scope, type, flags
_NDMSG = struct.Struct("=BBHiHBB")  # family, pad, pad, ifindex, state, flags, type
_IFINFOMSG = struct.Struct("=BBHiII")  # family, pad, type, index, flags, change


class RtnlError(OSError):
    pass


def _attr(kind: int, value: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(value), kind) + value
    return raw + b"\0" * (-len(raw) % 4)


def _attrs(buf: bytes, start: int = 0, end: int | None = None) -> Iterator[tuple[int, bytes]]:
    end = len(buf) if end is None else end
    while start + 4 <= end:
        length, kind = struct.unpack_from("=HH", buf, start)
        if length < 4:
            return
        yield kind & ~NLA_F_NESTED, buf[start + 4 : start + length]
        start += (length + 3) & ~3


class Rtnl:
    """One NETLINK_ROUTE socket in the calling thread's network namespace."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        self.sock.bind((0, 0))
        self.seq = 0

    def __enter__(self) -> Rtnl:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def request(self, mtype: int, flags: int, body: bytes, what: str) -> list[tuple[int, bytes]]:
        """Send one request; returns the (type, payload) replies (a dump's parts), raising on error."""
        self.seq += 1
        seq = self.seq
        self.sock.send(_NLMSG.pack(_NLMSG.size + len(body), mtype, NLM_F_REQUEST | flags, seq, 0) + body)
        out: list[tuple[int, bytes]] = []
        while True:
            data = self.sock.recv(1 << 16)
            off = 0
            while off + _NLMSG.size <= len(data):
                length, rtype, rflags, rseq, _pid = _NLMSG.unpack_from(data, off)
                if length < _NLMSG.size:
                    raise RtnlError(errno.EBADMSG, f"{what}: malformed netlink reply")
                payload = data[off + _NLMSG.size : off + length]
                off += (length + 3) & ~3
                if rseq != seq:
                    continue
                if rtype == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", payload)
                    if code:
                        raise RtnlError(-code, f"{what}: {os.strerror(-code)}")
                    return out  # the ACK
                if rtype == NLMSG_DONE:
                    return out
                out.append((rtype, payload))
                if not rflags & NLM_F_MULTI and not flags & NLM_F_ACK:
                    return out

    # ------------------------------------------------------------------ tc

    def add_clsact(self, ifindex: int) -> bool:
        """Add the device's clsact qdisc; False if it has one already."""
        body = _TCMSG.pack(0, 0, 0, ifindex, CLSACT_HANDLE, TC_H_CLSACT, 0) + _attr(TCA_KIND, b"clsact\0")
        try:
            self.request(RTM_NEWQDISC, NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL, body, f"clsact on device {ifindex}")
        except RtnlError as err:
            if err.errno == errno.EEXIST:
                return False
            raise
        return True

    def del_clsact(self, ifindex: int) -> None:
        body = _TCMSG.pack(0, 0, 0, ifindex, CLSACT_HANDLE, TC_H_CLSACT, 0)
        self.request(RTM_DELQDISC, NLM_F_ACK, body, f"deleting clsact on device {ifindex}")

    def replace_bpf_filter(self, ifindex: int, parent: int, prio: int, handle: int, protocol: int, fd: int,
                           name: str) -> None:
        """``tc filter replace dev IF PARENT prio PRIO handle HANDLE protocol P bpf da fd FD name NAME``."""
        opts = (_attr(TCA_BPF_FD, struct.pack("=I", fd)) + _attr(TCA_BPF_NAME, name.encode() + b"\0")
                + _attr(TCA_BPF_FLAGS, struct.pack("=I", TCA_BPF_FLAG_ACT_DIRECT)))
        body = (_TCMSG.pack(0, 0, 0, ifindex, handle, parent, (prio << 16) | socket.htons(protocol))
                + _attr(TCA_KIND, b"bpf\0") + _attr(TCA_OPTIONS | NLA_F_NESTED, opts))
        self.request(RTM_NEWTFILTER, NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE, body,
                     f"attaching {name} to device {ifindex}")

    def del_filter(self, ifindex: int, parent: int, prio: int, handle: int, protocol: int, kind: str) -> None:
        body = (_TCMSG.pack(0, 0, 0, ifindex, handle, parent, (prio << 16) | socket.htons(protocol))
                + _attr(TCA_KIND, kind.encode() + b"\0"))
        self.request(RTM_DELTFILTER, NLM_F_ACK, body, f"deleting a filter of device {ifindex}")

    def filters(self, ifindex: int, parent: int) -> list[dict]:
        """The filters on one hook: {prio, handle, kind, name, prog_id} (name/prog_id: cls_bpf)."""
        body = _TCMSG.pack(0, 0, 0, ifindex, 0, parent, 0)
        out = []
        for _mtype, payload in self.request(RTM_GETTFILTER, NLM_F_DUMP, body, f"listing filters of device {ifindex}"):
            _f, _p1, _p2, _ifi, handle, _parent, info = _TCMSG.unpack_from(payload)
            item: dict = {"prio": info >> 16, "handle": handle, "kind": None, "name": None, "prog_id": None}
            for kind, value in _attrs(payload, _TCMSG.size):
                if kind == TCA_KIND:
                    item["kind"] = value.rstrip(b"\0").decode()
                elif kind == TCA_OPTIONS:
                    for okind, ovalue in _attrs(value):
                        if okind == TCA_BPF_NAME:
                            item["name"] = ovalue.rstrip(b"\0").decode(errors="replace")
                        elif okind == TCA_BPF_ID and len(ovalue) >= 4:
                            item["prog_id"] = struct.unpack_from("=I", ovalue)[0]
            if handle:  # handle 0: the header of a priority's chain, not a filter
                out.append(item)
        return out

    # ------------------------------------------------------------------ bridges

    def bridges(self) -> set[int]:
        """The ifindexes of the bridge devices here (the pods' bridges: ``ip link show type bridge``)."""
        out = set()
        body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0, 0)
        for _mtype, payload in self.request(RTM_GETLINK, NLM_F_DUMP, body, "listing the devices"):
            index = _IFINFOMSG.unpack_from(payload)[3]
            for kind, value in _attrs(payload, _IFINFOMSG.size):
                if kind & ~NLA_F_NESTED == IFLA_LINKINFO:
                    for ikind, ivalue in _attrs(value):
                        if ikind == IFLA_INFO_KIND and ivalue.rstrip(b"\0") == b"bridge":
                            out.add(index)
        return out

    def learned_macs(self) -> dict[tuple[int, bytes], int]:
        """(bridge ifindex, MAC) -> port ifindex, for every MAC the bridges here learned on a
        port (not the ports' own permanent addresses)."""
        out = {}
        body = _NDMSG.pack(AF_BRIDGE, 0, 0, 0, 0, 0, 0)
        for _mtype, payload in self.request(RTM_GETNEIGH, NLM_F_DUMP, body, "listing the bridges' MACs"):
            _f, _p1, _p2, port, state, _flags, _type = _NDMSG.unpack_from(payload)
            if state & NUD_PERMANENT:
                continue
            mac = bridge = None
            for kind, value in _attrs(payload, _NDMSG.size):
                if kind == NDA_LLADDR and len(value) == 6:
                    mac = value
                elif kind == NDA_MASTER and len(value) >= 4:
                    bridge = struct.unpack_from("=i", value)[0]
            if mac is not None and bridge:
                out[(bridge, mac)] = port
        return out

    # ------------------------------------------------------------------ routes

    def route_get(self, address: str) -> tuple[int | None, str | None]:
        """(output interface, gateway) of the kernel's route to ``address`` (``ip route get``)."""
        body = _RTMSG.pack(socket.AF_INET, 32, 0, 0, 0, 0, 0, 0, 0) + _attr(RTA_DST, socket.inet_aton(address))
        oif = gateway = None
        for mtype, payload in self.request(RTM_GETROUTE, 0, body, f"route to {address}"):
            if mtype != RTM_NEWROUTE:
                continue
            for kind, value in _attrs(payload, _RTMSG.size):
                if kind == RTA_OIF:
                    oif = struct.unpack_from("=i", value)[0]
                elif kind == RTA_GATEWAY and len(value) == 4:
                    gateway = socket.inet_ntoa(value)
        return oif, gateway
