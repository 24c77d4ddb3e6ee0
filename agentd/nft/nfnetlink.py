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

Keys are encoded the way nft lays them out: an address in 4 bytes (IPv6: 16), an interface name in 16,
a concatenation as its parts each padded to 4 bytes (NFT_REG32 granularity); map data is a
verdict (jump to a chain) or a MAC address.  Those encoders, the nf_tables messages and the
decoding of counters are here; the framing (nlmsghdr, nfgenmsg, attributes, error acks) and
the socket are the agent's one netlink stack, ``agentd.kernel.netlink`` and
``agentd.kernel.netlink_socket``.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

from agentd.kernel import netlink as nl
from agentd.kernel.netlink_socket import NetlinkSocket

# --- include/uapi/linux/netfilter/nfnetlink.h, nf_tables.h ------------------------------------

NFNL_SUBSYS_NFTABLES = 10
NFNL_MSG_BATCH_BEGIN = 16
NFNL_MSG_BATCH_END = 17
NFT_MSG_NEWSETELEM = 12
NFT_MSG_DELSETELEM = 14
NFT_MSG_GETTABLE = 1
NFT_MSG_NEWOBJ = 18
NFT_MSG_GETOBJ = 19
NFT_OBJECT_COUNTER = 1
NFTA_TABLE_NAME = 1
NFTA_OBJ_TABLE = 1
NFTA_OBJ_NAME = 2
NFTA_OBJ_TYPE = 3
NFTA_OBJ_DATA = 4
NFTA_COUNTER_BYTES = 1
NFTA_COUNTER_PACKETS = 2

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

FAMILIES = {"inet": 1, "ip": 2, "ipv4": 2, "arp": 3, "netdev": 5, "bridge": 7, "ip6": 10, "ipv6": 10}
IFNAMSIZ = 16
L4 = {"tcp": 6, "udp": 17, "sctp": 132, "icmp": 1}

_BE64 = struct.Struct("!Q")


# ------------------------------------------------------------------ encoding


def _string(text: str) -> bytes:
    return text.encode() + b"\0"


def _field(type_name: str, value: Any) -> bytes:
    """One value of an nft data type, unpadded."""
    if type_name == "ipv4_addr":
        return socket.inet_aton(str(value))
    if type_name == "ipv6_addr":
        return socket.inet_pton(socket.AF_INET6, str(value))
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


FIELD_TYPES = frozenset({"ipv4_addr", "ipv6_addr", "ifname", "inet_proto", "inet_service", "ether_addr"})


def can_encode(types: Sequence[str], map_type: str | None) -> bool:
    """Whether elements of a set of ``types`` (a map to ``map_type``) have an encoding here;
    others (object maps such as ``counter``) go through libnftables."""
    return all(t in FIELD_TYPES for t in types) and (map_type is None or map_type == "verdict" or map_type in FIELD_TYPES)


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
        return nl.nested(
            NFTA_DATA_VERDICT,
            nl.attr(NFTA_VERDICT_CODE, struct.pack("!i", code)),
            nl.attr(NFTA_VERDICT_CHAIN, _string(body["target"])),
        )
    return nl.attr(NFTA_DATA_VALUE, _field(map_type, value))


# An attribute's length is 16 bits (struct nlattr's nla_len, its own 4 bytes included): the
# element list of one message holds ~4,000 IPv4 addresses, ~2,300 IPv6 ones, fewer of wider
# keys.  A larger change of one set is split over several messages of the same batch, as
# libnftables splits one (mnl_nft_setelem_batch): still one transaction.
MAX_ELEMENT_LIST = 0xFFFF - 4  # bytes of NFTA_SET_ELEM_LIST_ELEMENTS' contents


def _element_attrs(op: str, types: Sequence[str], map_type: str | None, elems: list[Any]) -> list[bytes]:
    """One NFTA_LIST_ELEM attribute per element."""
    items = []
    for elem in elems:
        # As in libnftables' JSON: a map's element to add is [key, value]; everything else a key.
        key, value = (elem[0], elem[1]) if map_type is not None and op == "add" else (elem, None)
        parts = [nl.nested(NFTA_SET_ELEM_KEY, nl.attr(NFTA_DATA_VALUE, encode_key(types, key)))]
        if value is not None:
            parts.append(nl.nested(NFTA_SET_ELEM_DATA, _data(map_type, value)))  # type: ignore[arg-type]
        items.append(nl.nested(NFTA_LIST_ELEM, *parts))
    return items


def _element_list_message(op: str, family: str, table: str, name: str, items: list[bytes], seq: int) -> bytes:
    body = (
        nl.attr(NFTA_SET_ELEM_LIST_TABLE, _string(table))
        + nl.attr(NFTA_SET_ELEM_LIST_SET, _string(name))
        + nl.nested(NFTA_SET_ELEM_LIST_ELEMENTS, *items)
    )
    kind = NFT_MSG_NEWSETELEM if op == "add" else NFT_MSG_DELSETELEM
    flags = nl.NLM_F_REQUEST | nl.NLM_F_ACK | (nl.NLM_F_CREATE if op == "add" else 0)
    return nl.encode_nfgen((NFNL_SUBSYS_NFTABLES << 8) | kind, flags, seq, FAMILIES[family], body)


def element_messages(
    op: str, family: str, table: str, name: str, types: Sequence[str], map_type: str | None, elems: list[Any], seq: int
) -> list[bytes]:
    """The NEWSETELEM ("add") or DELSETELEM ("delete") messages for a set of ``types``,
    numbered ``seq`` on: as many as the elements need, each list within MAX_ELEMENT_LIST."""
    chunks: list[list[bytes]] = [[]]
    size = 0
    for item in _element_attrs(op, types, map_type, elems):
        if len(item) > MAX_ELEMENT_LIST:
            raise ValueError(f"an element of set {name} takes {len(item)} bytes, more than a netlink attribute holds")
        if size + len(item) > MAX_ELEMENT_LIST:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += len(item)
    return [_element_list_message(op, family, table, name, items, seq + i) for i, items in enumerate(chunks)]


def element_message(
    op: str, family: str, table: str, name: str, types: Sequence[str], map_type: str | None, elems: list[Any], seq: int
) -> bytes:
    """One NEWSETELEM ("add") or DELSETELEM ("delete") message for a set of ``types``
    (ValueError if the elements need more than one: :func:`element_messages`)."""
    messages = element_messages(op, family, table, name, types, map_type, elems, seq)
    if len(messages) != 1:
        raise ValueError(f"{len(elems)} elements of set {name} need {len(messages)} messages")
    return messages[0]


def batch(messages: list[bytes], seq: int) -> bytes:
    """``messages`` (numbered ``seq + 1`` on) between a batch begin ``seq`` and end: one
    transaction of the nf_tables subsystem (res_id)."""
    begin = nl.encode_nfgen(NFNL_MSG_BATCH_BEGIN, nl.NLM_F_REQUEST, seq, nl.AF_UNSPEC, res_id=NFNL_SUBSYS_NFTABLES)
    end = nl.encode_nfgen(NFNL_MSG_BATCH_END, nl.NLM_F_REQUEST, seq + len(messages) + 1, nl.AF_UNSPEC,
                          res_id=NFNL_SUBSYS_NFTABLES)  # fmt: skip
    return begin + b"".join(messages) + end


def getobj_counters(family: str, table: str, seq: int) -> bytes:
    """An NFT_MSG_GETOBJ dump of the named counters of ``table`` (filtered by the kernel by
    table and object type)."""
    body = nl.attr(NFTA_OBJ_TABLE, _string(table)) + nl.attr(NFTA_OBJ_TYPE, struct.pack("!I", NFT_OBJECT_COUNTER))
    return nl.encode_nfgen((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETOBJ, nl.NLM_F_REQUEST | nl.NLM_F_DUMP, seq,
                           FAMILIES[family], body)  # fmt: skip


def gettable(family: str, table: str, seq: int) -> bytes:
    """An NFT_MSG_GETTABLE request of ``table`` (the kernel answers ENOENT if there is none)."""
    return nl.encode_nfgen((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE, nl.NLM_F_REQUEST, seq, FAMILIES[family],
                           nl.attr(NFTA_TABLE_NAME, _string(table)))  # fmt: skip


# ------------------------------------------------------------------ decoding


def decode_counter(buf: bytes, start: int, end: int) -> tuple[str, int, int]:
    """An NFT_MSG_NEWOBJ body (nfgenmsg + attributes) of a counter as ``(name, packets, bytes)``
    (a missing count is 0).  Malformed input raises nl.NetlinkDecodeError."""
    if end > len(buf) or end - start < nl.NFGENMSG_LEN:
        raise nl.NetlinkDecodeError(f"nf_tables object body is {end - start} bytes, nfgenmsg needs {nl.NFGENMSG_LEN}")
    name, packets, nbytes = "", 0, 0
    for atype, vs, ve in nl.iter_attrs(buf, start + nl.NFGENMSG_LEN, end):
        if atype == NFTA_OBJ_NAME:
            name = nl.read_string(buf, vs, ve)
        elif atype == NFTA_OBJ_DATA:
            for ctype, cs, ce in nl.iter_attrs(buf, vs, ve):
                if ctype in (NFTA_COUNTER_PACKETS, NFTA_COUNTER_BYTES):
                    if ce - cs != _BE64.size:
                        raise nl.NetlinkDecodeError(f"counter attribute {ctype} must be 8 bytes, got {ce - cs}")
                    if ctype == NFTA_COUNTER_PACKETS:
                        packets = _BE64.unpack_from(buf, cs)[0]
                    else:
                        nbytes = _BE64.unpack_from(buf, cs)[0]
    return name, packets, nbytes


# ------------------------------------------------------------------ the socket


class TableAbsent(dict):  # type: ignore[type-arg]
    """The counters of a table that is not there (its lookup's ENOENT): no counters, as an empty
    dict, and saying so -- a table the agent wrote, found gone, was deleted by someone else
    (``nft flush ruleset``, a firewall's restart), and :class:`NftProgrammer` writes it again."""


class ElementWriter:
    """A NETLINK_NETFILTER socket (in the calling thread's network namespace) for element
    batches and counter reads; blocking (callers run it off the event loop)."""

    def __init__(self) -> None:
        self.sock = NetlinkSocket(rcvbuf=1 << 20, protocol=nl.NETLINK_NETFILTER)
        self.seq = int.from_bytes(os.urandom(3), "big")

    def send(self, ops: list[tuple[str, str, str, str, Sequence[str], str | None, list[Any]]]) -> None:
        """Commit ``(op, family, table, set, key types, map type, elements)`` as ONE transaction."""
        if not ops:
            return
        begin = self.seq
        first = begin + 1  # the elements' numbers; the batch end's after them
        messages: list[bytes] = []
        for op, fam, tab, name, types, mtype, elems in ops:
            messages += element_messages(op, fam, tab, name, types, mtype, elems, first + len(messages))
        end = first + len(messages)
        self.seq = end + 1
        self.sock.transact(batch(messages, begin), begin, end, acked=range(first, end),
                           what="nf_tables refused the element batch")  # fmt: skip

    def counters(self, family: str, table: str) -> dict[str, tuple[int, int]]:
        """(packets, bytes) of every named counter of ``table``: an NFT_MSG_GETOBJ dump filtered
        by table and type (libnftables would first fetch the whole ruleset to list them); a
        :class:`TableAbsent` if there is no such table."""
        self.seq += 1
        try:
            answers = self.sock.request(getobj_counters(family, table, self.seq), what="reading counters", dump=True)
        except nl.NetlinkError as err:
            if err.errno == errno.ENOENT:  # no such table
                return TableAbsent()
            raise
        out: dict[str, tuple[int, int]] = {}
        for mtype, buf, start, end in answers:
            if mtype == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWOBJ:
                name, packets, nbytes = decode_counter(buf, start, end)
                out[name] = (packets, nbytes)
        # A dump filtered by a table that is not there is empty (Linux 6.x), as one of a table
        # without counters: which one, the table's own lookup says.
        if not out and not self.table_exists(family, table):
            return TableAbsent()
        return out

    def table_exists(self, family: str, table: str) -> bool:
        self.seq += 1
        try:
            self.sock.request(gettable(family, table, self.seq), what="looking up a table", dump=False)
        except nl.NetlinkError as err:
            if err.errno == errno.ENOENT:
                return False
            raise
        return True

    def close(self) -> None:
        self.sock.close()
