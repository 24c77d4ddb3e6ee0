"""agentd/dataplane/bpf/btf.py on BTF built here byte by byte (include/uapi/linux/btf.h): type
ids of kernel functions, field offsets through nested structs, unions and typedefs, the CO-RE
records of an object's .BTF.ext, and refusals of what it does not read."""

import struct

import pytest

from agentd.dataplane.bpf import btf

INT, PTR, STRUCT, UNION, ENUM, TYPEDEF, CONST, FUNC, FUNC_PROTO = 1, 2, 4, 5, 6, 8, 10, 12, 13


class Builder:
    """Raw BTF: types appended in id order, names in one string table."""

    def __init__(self) -> None:
        self.strings = bytearray(b"\0")
        self.types = bytearray()
        self.count = 0

    def s(self, text: str) -> int:
        off = len(self.strings)
        self.strings += text.encode() + b"\0"
        return off

    def add(self, kind: int, name: str, size_or_type: int, vlen: int = 0, extra: bytes = b"") -> int:
        self.types += struct.pack("<III", self.s(name) if name else 0, kind << 24 | vlen, size_or_type) + extra
        self.count += 1
        return self.count

    def struct(self, kind: int, name: str, size: int, members: list[tuple[str, int, int]]) -> int:
        extra = b"".join(struct.pack("<III", self.s(m), t, bits) for m, t, bits in members)
        return self.add(kind, name, size, len(members), extra)

    def bytes(self) -> bytes:
        header = struct.pack("<HBBIIIII", btf.MAGIC, 1, 0, 24, 0, len(self.types), len(self.types), len(self.strings))
        return header + bytes(self.types) + bytes(self.strings)


def conntrack_like() -> tuple[Builder, dict[str, int]]:
    b = Builder()
    ids = {}
    ids["int"] = b.add(INT, "int", 4, extra=struct.pack("<I", 32))
    ids["u8"] = b.add(TYPEDEF, "u8", ids["int"])
    ids["tcp"] = b.struct(STRUCT, "ip_ct_tcp", 8, [("seen", ids["int"], 0), ("state", ids["u8"], 32)])
    ids["const_tcp"] = b.add(CONST, "", ids["tcp"])
    ids["proto"] = b.struct(UNION, "nf_conntrack_proto", 8, [("dccp", ids["int"], 0), ("tcp", ids["const_tcp"], 0)])
    ids["enum"] = b.add(ENUM, "colour", 4, 2, struct.pack("<iIiI", b.s("RED"), 0, b.s("BLUE"), 1))
    ids["nf_conn"] = b.struct(STRUCT, "nf_conn", 32, [("timeout", ids["int"], 0), ("status", ids["int"], 64),
                                                      ("proto", ids["proto"], 128)])
    ids["proto_fn"] = b.add(FUNC_PROTO, "", ids["int"], 1, struct.pack("<II", 0, ids["int"]))
    ids["lookup"] = b.add(FUNC, "bpf_skb_ct_lookup", ids["proto_fn"])
    ids["release"] = b.add(FUNC, "bpf_ct_release", ids["proto_fn"])
    return b, ids


def test_function_ids_are_found_by_name():
    b, ids = conntrack_like()
    parsed = btf.Btf(b.bytes())
    assert btf.function_ids(["bpf_ct_release", "bpf_skb_ct_lookup"], parsed) == {
        "bpf_ct_release": ids["release"], "bpf_skb_ct_lookup": ids["lookup"]}
    assert btf.function_ids([], parsed) == {}


def test_a_missing_function_is_named():
    b, _ = conntrack_like()
    with pytest.raises(btf.BtfError, match="no function bpf_ct_change_timeout"):
        btf.function_ids(["bpf_ct_release", "bpf_ct_change_timeout"], btf.Btf(b.bytes()))


def test_field_offsets_follow_structs_unions_typedefs_and_qualifiers():
    b, _ = conntrack_like()
    parsed = btf.Btf(b.bytes())
    assert parsed.field_offset("nf_conn", ("status",)) == 8
    assert parsed.field_offset("nf_conn", ("proto", "tcp", "state")) == 16 + 4
    with pytest.raises(btf.BtfError, match="no field proto.udp"):
        parsed.field_offset("nf_conn", ("proto", "udp"))
    with pytest.raises(btf.BtfError, match="no struct or union nf_conntrack"):
        parsed.field_offset("nf_conntrack", ("status",))


def test_a_bitfield_has_no_byte_offset():
    b = Builder()
    i = b.add(INT, "int", 4, extra=struct.pack("<I", 32))
    b.struct(STRUCT, "flags", 4, [("low", i, 0), ("high", i, 3)])
    with pytest.raises(btf.BtfError, match="bitfield"):
        btf.Btf(b.bytes()).field_offset("flags", ("high",))


@pytest.mark.parametrize("mangle, message", [
    (lambda d: b"\x00\x00" + d[2:], "magic"),
    (lambda d: d[:10], "shorter than its header"),
    (lambda d: d[:40], "run past its end"),
])  # fmt: skip
def test_what_is_not_btf_is_refused(mangle, message):
    b, _ = conntrack_like()
    with pytest.raises(btf.BtfError, match=message):
        btf.Btf(mangle(b.bytes()))


def test_an_unknown_kind_is_refused():
    b = Builder()
    b.add(31, "future", 0)
    with pytest.raises(btf.BtfError, match="kind 31"):
        btf.Btf(b.bytes())


def ext(b: Builder, records: list[tuple[int, int, str, int]], section: str = "tc/ingress") -> bytes:
    """A .BTF.ext with only CO-RE records (insn byte offset, type id, access string, kind)."""
    sec = b.s(section)
    body = struct.pack("<I", 16) + struct.pack("<II", sec, len(records))
    body += b"".join(struct.pack("<IIII", off, t, b.s(access), kind) for off, t, access, kind in records)
    return struct.pack("<HBBIIIIIII", btf.MAGIC, 1, 0, 32, 0, 0, 0, 0, 0, len(body)) + body


def test_core_records_name_the_fields_by_path():
    b, ids = conntrack_like()
    records = [(8 * 12, ids["nf_conn"], "0:1", 0), (8 * 20, ids["nf_conn"], "0:2:1:1", 0)]
    extdata = ext(b, records)
    relos = btf.core_field_relocations(b.bytes(), extdata)
    assert relos == {"tc/ingress": [(12, "nf_conn", ("status",)), (20, "nf_conn", ("proto", "tcp", "state"))]}


def test_a_local_flavour_name_is_the_kernel_struct():
    b = Builder()
    i = b.add(INT, "int", 4, extra=struct.pack("<I", 32))
    local = b.struct(STRUCT, "nf_conn___agentd", 8, [("status", i, 0)])
    extdata = ext(b, [(0, local, "0:0", 0)])
    assert btf.core_field_relocations(b.bytes(), extdata) == {"tc/ingress": [(0, "nf_conn", ("status",))]}


@pytest.mark.parametrize("access, kind, message", [
    ("0:1", 2, "kind 2"),  # FIELD_EXISTS: not understood
    ("1:1", 0, "array"),
])  # fmt: skip
def test_core_records_not_understood_are_refused(access, kind, message):
    b, ids = conntrack_like()
    extdata = ext(b, [(0, ids["nf_conn"], access, kind)])
    with pytest.raises(btf.BtfError, match=message):
        btf.core_field_relocations(b.bytes(), extdata)
