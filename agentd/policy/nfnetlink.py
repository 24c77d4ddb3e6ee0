"""Set elements straight to nf_tables over netlink: one batch, one transaction, no cache;
and the named counters of a table, read the same way.

libnftables evaluates every command list against a cache of the kernel's ruleset and, once
the ruleset has changed, fetches it again first: every set and chain of the table, and the
elements of its interval sets.  With a thousand policies that is tens of milliseconds for
adding one address to one set.  Most policy changes are exactly that (a pod appearing, a
label changing), so they take this path instead: the element commands the plan produced are
encoded as ``NFT_MSG_NEWSETELEM`` / ``NFT_MSG_DELSETELEM`` messages between a batch begin and
end (include/uapi/linux/netfilter/nf_tables.h), which the kernel commits as one transaction,
all or nothing, exactly like the batch libnftables would have sent.  Anything else (rules,
chains, new sets) still goes through libnftables.

Keys are encoded the way nft lays them out: an address in 4 bytes, an interface name in 16,
a concatenation as its parts each padded to 4 bytes (NFT_REG32 granularity); map data is a
verdict (jump to a chain) or a MAC address.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFNL_MSG_BATCH_BEGIN = 16
NFNL_MSG_BATCH_END = 17
NFT_MSG_NEWSETELEM = 12
NFT_MSG_DELSETELEM = 14
NFT_MSG_NEWOBJ = 18
NFT_MSG_GETOBJ = 19
NFT_OBJECT_COUNTER = 1
NFTA_OBJ_TABLE = 1
NFTA_OBJ_NAME = 2
NFTA_OBJ_TYPE = 3
NFTA_OBJ_DATA = 4
NFTA_COUNTER_BYTES = 1
NFTA_COUNTER_PACKETS = 2
NLMSG_DONE = 3
NLM_F_DUMP = 0x300

NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_CREATE = 0x400
NLMSG_ERROR = 2
NLA_F_NESTED = 0x8000

NFTA_SET_ELEM_LIST_TABLE = 1
NFTA_SET_ELEM_LIST_SET = 2
NFTA_SET_ELEM_LIST_ELEMENTS = 3
NFTA_LIST_ELEM = 1
NFTA_SET_ELEM_KEY = 1
NFTA_SET_ELEM_DATA = 2
NFTA_DATA_VALUE = 1
NFTA_DATA_VERDICT = 2
NFTA_VERDICT_CODE = 1
NFTA_VERDICT_CHAIN = 2
NFT_JUMP = -3
NFT_GOTO = -4

FAMILIES = {"inet": 1, "ip": 2, "ipv4": 2, "arp": 3, "netdev": 5, "bridge": 7, "ipv6": 10}
IFNAMSIZ = 16
L4 = {"tcp": 6, "udp": 17, "sctp": 132, "icmp": 1}


class NetlinkError(OSError):
    pass


# ------------------------------------------------------------------ encoding


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _nested(kind: int, *parts: bytes) -> bytes:
    return _attr(kind | NLA_F_NESTED, b"".join(parts))


def _string(text: str) -> bytes:
    return text.encode() + b"\0"


def _field(type_name: str, value: Any) -> bytes:
    """One value of an nft data type, unpadded."""
    if type_name == "ipv4_addr":
        return socket.inet_aton(str(value))
    if type_name == "ifname":
        raw = str(value).encode()
        if len(raw) >= IFNAMSIZ:
            raise ValueError(f"interface name {value!r} is too long")
        return raw + b"\0" * (IFNAMSIZ - len(raw))
    if type_name == "inet_proto":
        return bytes([L4[value] if isinstance(value, str) else int(value)])
    if type_name == "inet_service":
        return struct.pack("!H", int(value))
    if type_name == "ether_addr":
        return bytes.fromhex(str(value).replace(":", ""))
    raise ValueError(f"no netlink encoding for nft type {type_name}")


def encode_key(types: Sequence[str], value: Any) -> bytes:
    if len(types) == 1:
        return _field(types[0], value)
    parts = value["concat"] if isinstance(value, dict) else value
    if len(parts) != len(types):
        raise ValueError(f"{value!r} does not match {'.'.join(types)}")
    out = b""
    for t, v in zip(types, parts):
        raw = _field(t, v)
        out += raw + b"\0" * (-len(raw) % 4)
    return out


def _data(map_type: str, value: Any) -> bytes:
    if map_type == "verdict":
        (kind, body), = value.items()
        code = {"jump": NFT_JUMP, "goto": NFT_GOTO}[kind]
        return _nested(
            NFTA_DATA_VERDICT,
            _attr(NFTA_VERDICT_CODE, struct.pack("!i", code)),
            _attr(NFTA_VERDICT_CHAIN, _string(body["target"])),
        )
    return _attr(NFTA_DATA_VALUE, _field(map_type, value))


def element_message(
    op: str, family: str, table: str, name: str, types: Sequence[str], map_type: str | None, elems: list[Any], seq: int
) -> bytes:
    """One NEWSETELEM ("add") or DELSETELEM ("delete") message for a set of ``types``."""
    items = []
    for elem in elems:
        # As in libnftables' JSON: a map's element to add is [key, value]; everything else a key.
        key, value = (elem[0], elem[1]) if map_type is not None and op == "add" else (elem, None)
        parts = [_nested(NFTA_SET_ELEM_KEY, _attr(NFTA_DATA_VALUE, encode_key(types, key)))]
        if value is not None:
            parts.append(_nested(NFTA_SET_ELEM_DATA, _data(map_type, value)))  # type: ignore[arg-type]
        items.append(_nested(NFTA_LIST_ELEM, *parts))
    body = (
        _attr(NFTA_SET_ELEM_LIST_TABLE, _string(table))
        + _attr(NFTA_SET_ELEM_LIST_SET, _string(name))
        + _nested(NFTA_SET_ELEM_LIST_ELEMENTS, *items)
    )
    kind = NFT_MSG_NEWSETELEM if op == "add" else NFT_MSG_DELSETELEM
    flags = NLM_F_REQUEST | NLM_F_ACK | (NLM_F_CREATE if op == "add" else 0)
    return _message((NFNL_SUBSYS_NFTABLES << 8) | kind, flags, seq, FAMILIES[family], body)


def _message(kind: int, flags: int, seq: int, family: int, body: bytes, res_id: int = 0) -> bytes:
    payload = struct.pack("=BBH", family, 0, socket.htons(res_id)) + body
    return struct.pack("=IHHII", 16 + len(payload), kind, flags, seq, 0) + payload


def batch(messages: list[bytes], seq: int) -> bytes:
    begin = _message(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, seq, 0, b"", NFNL_SUBSYS_NFTABLES)
    end = _message(NFNL_MSG_BATCH_END, NLM_F_REQUEST, seq + len(messages) + 1, 0, b"", NFNL_SUBSYS_NFTABLES)
    return begin + b"".join(messages) + end


# ------------------------------------------------------------------ the socket


class ElementWriter:
    """A NETLINK_NETFILTER socket (in the calling thread's network namespace) for element batches."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.sock.bind((0, 0))
        self.sock.settimeout(10.0)
        self.seq = int.from_bytes(os.urandom(3), "big")

    def send(self, ops: list[tuple[str, str, str, str, Sequence[str], str | None, list[Any]]]) -> None:
        """Commit ``(op, family, table, set, key types, map type, elements)`` as ONE transaction."""
        if not ops:
            return
        first = self.seq + 1
        messages = [element_message(op, fam, tab, name, types, mtype, elems, first + i)
                    for i, (op, fam, tab, name, types, mtype, elems) in enumerate(ops)]  # fmt: skip
        data = batch(messages, self.seq)
        self.seq += len(messages) + 2
        self.sock.sendall(data)
        pending = set(range(first, first + len(messages)))
        while pending:
            reply = self.sock.recv(1 << 16)
            offset = 0
            while offset + 16 <= len(reply):
                length, kind, _flags, seq, _pid = struct.unpack_from("=IHHII", reply, offset)
                if kind == NLMSG_ERROR:
                    (error,) = struct.unpack_from("=i", reply, offset + 16)
                    if error != 0:
                        raise NetlinkError(-error, f"nf_tables refused the element batch: {os.strerror(-error)}")
                    pending.discard(seq)
                offset += max(16, (length + 3) & ~3)

    def counters(self, family: str, table: str) -> dict[str, tuple[int, int]]:
        """(packets, bytes) of every named counter of ``table``: an NFT_MSG_GETOBJ dump filtered
        by table and type (libnftables would first fetch the whole ruleset to list them)."""
        self.seq += 1
        body = _attr(NFTA_OBJ_TABLE, _string(table)) + _attr(NFTA_OBJ_TYPE, struct.pack("!I", NFT_OBJECT_COUNTER))
        self.sock.sendall(_message((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETOBJ, NLM_F_REQUEST | NLM_F_DUMP,
                                   self.seq, FAMILIES[family], body))  # fmt: skip
        out: dict[str, tuple[int, int]] = {}
        while True:
            reply = self.sock.recv(1 << 20)
            offset = 0
            while offset + 16 <= len(reply):
                length, kind, _flags, seq, _pid = struct.unpack_from("=IHHII", reply, offset)
                if kind == NLMSG_DONE:
                    return out
                if kind == NLMSG_ERROR:
                    (error,) = struct.unpack_from("=i", reply, offset + 16)
                    if error == -2:  # ENOENT: no such table
                        return out
                    if error != 0:
                        raise NetlinkError(-error, f"reading counters: {os.strerror(-error)}")
                elif kind == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWOBJ:
                    attrs = _parse_attrs(reply[offset + 20 : offset + length])
                    name = attrs.get(NFTA_OBJ_NAME, b"").rstrip(b"\0").decode(errors="replace")
                    data = _parse_attrs(attrs.get(NFTA_OBJ_DATA, b""))
                    packets = struct.unpack("!Q", data[NFTA_COUNTER_PACKETS])[0] if NFTA_COUNTER_PACKETS in data else 0
                    nbytes = struct.unpack("!Q", data[NFTA_COUNTER_BYTES])[0] if NFTA_COUNTER_BYTES in data else 0
                    out[name] = (packets, nbytes)
                offset += max(16, (length + 3) & ~3)

    def close(self) -> None:
        self.sock.close()


def _parse_attrs(data: bytes) -> dict[int, bytes]:
    out = {}
    offset = 0
    while offset + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, offset)
        if length < 4:
            break
        out[kind & ~NLA_F_NESTED] = data[offset + 4 : offset + length]
        offset += (length + 3) & ~3
    return out
