"""BTF, read for what the loader needs of it: the kernel's own (``/sys/kernel/btf/vmlinux``)
and the object file's (its ``.BTF`` and ``.BTF.ext`` sections).

* A call of a kernel function (a *kfunc*, e.g. ``bpf_skb_ct_lookup``) is ``call`` with
  ``src_reg = BPF_PSEUDO_KFUNC_CALL`` and the FUNC's type id in the kernel's BTF in ``imm``;
  clang leaves it as a relocation against an undefined symbol (:func:`function_ids`).
* A read of a kernel structure's field (``ct->proto.tcp.state``) names the field in the
  object's BTF and a CO-RE relocation record (``.BTF.ext``); the loader finds the field by
  name in the kernel's BTF and writes the kernel's byte offset into the instruction
  (:func:`core_field_relocations`, :meth:`Btf.field_offset`).  Only field byte offsets are
  understood -- what podpath.c uses -- and any other kind of relocation is refused.

Format: include/uapi/linux/btf.h -- a header, then the type section (type ids count from 1
in order, each record's size follows from its kind), then the string section.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

VMLINUX = Path("/sys/kernel/btf/vmlinux")

_HEADER = struct.Struct("<HBBIIIII")  # magic, version, flags, hdr_len, type_off, type_len, str_off, str_len
_TYPE = struct.Struct("<III")  # name_off, info, size_or_type
MAGIC = 0xEB9F
KIND_FUNC = 12

# Bytes after the 12-byte common record, by kind: fixed, and per member (vlen).
_EXTRA = {1: (4, 0), 2: (0, 0), 3: (12, 0), 4: (0, 12), 5: (0, 12), 6: (0, 8), 7: (0, 0), 8: (0, 0),
          9: (0, 0), 10: (0, 0), 11: (0, 0), 12: (0, 0), 13: (0, 8), 14: (4, 0), 15: (0, 12),
          16: (0, 0), 17: (4, 0), 18: (0, 0), 19: (0, 12)}


class BtfError(ValueError):
    """The BTF is missing, or not in a format this reader knows."""


KIND_STRUCT, KIND_UNION = 4, 5
_MODIFIERS = frozenset({8, 9, 10, 11, 18})  # typedef, volatile, const, restrict, type tag
_MEMBER = struct.Struct("<III")  # name_off, type, offset (bits; with kind_flag: bitfield size << 24)


class Btf:
    """Types by id, walked once; members are read when asked for."""

    def __init__(self, data: bytes) -> None:
        if len(data) < _HEADER.size:
            raise BtfError("BTF shorter than its header")
        magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise BtfError(f"BTF magic {magic:#x}, not {MAGIC:#x} (big-endian BTF is not read)")
        self.data = data
        self.strings = hdr_len + str_off
        self.strings_end = self.strings + str_len
        start, end = hdr_len + type_off, hdr_len + type_off + type_len
        if end > len(data) or self.strings_end > len(data):
            raise BtfError("BTF sections run past its end")
        self.pos: list[int] = [0]  # type id -> record position (id 0 is void)
        pos = start
        while pos < end:
            _name, info, _size = _TYPE.unpack_from(data, pos)
            kind = (info >> 24) & 0x1F
            try:
                fixed, per_member = _EXTRA[kind]
            except KeyError:
                raise BtfError(f"BTF type {len(self.pos)} has kind {kind}, unknown to this reader") from None
            self.pos.append(pos)
            pos += _TYPE.size + fixed + per_member * (info & 0xFFFF)

    @classmethod
    def kernel(cls) -> Btf:
        try:
            return cls(VMLINUX.read_bytes())
        except OSError as err:
            raise BtfError(f"cannot read the kernel's BTF at {VMLINUX} ({err.strerror}): "
                           "the kernel needs CONFIG_DEBUG_INFO_BTF") from None

    def string(self, off: int) -> str:
        start = self.strings + off
        end = self.data.find(b"\0", start, self.strings_end)
        return self.data[start:end if end >= 0 else self.strings_end].decode()

    def _record(self, type_id: int) -> tuple[int, int, int]:
        if not 0 < type_id < len(self.pos):
            raise BtfError(f"no BTF type {type_id}")
        return _TYPE.unpack_from(self.data, self.pos[type_id])

    def kind(self, type_id: int) -> int:
        return (self._record(type_id)[1] >> 24) & 0x1F

    def name(self, type_id: int) -> str:
        return self.string(self._record(type_id)[0])

    def resolve(self, type_id: int) -> int:
        """Through typedefs and qualifiers to the type itself."""
        for _ in range(32):
            name_off, info, ref = self._record(type_id)
            if (info >> 24) & 0x1F not in _MODIFIERS:
                return type_id
            type_id = ref
        raise BtfError(f"BTF type {type_id}: a loop of typedefs or qualifiers")

    def members(self, type_id: int) -> list[tuple[str, int, int]]:
        """(name, type id, bit offset) of a struct's or union's members."""
        name_off, info, _size = self._record(type_id)
        if (info >> 24) & 0x1F not in (KIND_STRUCT, KIND_UNION):
            raise BtfError(f"BTF type {type_id} ({self.string(name_off) or 'anonymous'}) is not a struct or union")
        bitfields = bool(info >> 31)
        out = []
        base = self.pos[type_id] + _TYPE.size
        for i in range(info & 0xFFFF):
            m_name, m_type, m_off = _MEMBER.unpack_from(self.data, base + i * _MEMBER.size)
            out.append((self.string(m_name), m_type, m_off & 0xFFFFFF if bitfields else m_off))
        return out

    def find(self, name: str, kinds: frozenset[int] = frozenset({KIND_STRUCT, KIND_UNION})) -> int:
        raw = name.encode() + b"\0"
        for type_id in range(1, len(self.pos)):
            name_off, info, _size = _TYPE.unpack_from(self.data, self.pos[type_id])
            if name_off and (info >> 24) & 0x1F in kinds and self.data.startswith(raw, self.strings + name_off):
                return type_id
        raise BtfError(f"the kernel's BTF has no struct or union {name}")

    def field_offset(self, root: str, path: tuple[str, ...]) -> int:
        """Byte offset of ``root.path[0].path[1]...`` (names of members, through nested
        structs and unions) in this BTF."""
        type_id = self.resolve(self.find(root))
        bits = 0
        for i, name in enumerate(path):
            for m_name, m_type, m_off in self.members(type_id):
                if m_name == name:
                    bits += m_off
                    type_id = self.resolve(m_type)
                    break
            else:
                raise BtfError(f"the kernel's struct {root} has no field {'.'.join(path[: i + 1])}")
        if bits % 8:
            raise BtfError(f"{root}.{'.'.join(path)} is a bitfield")
        return bits // 8


FIELD_BYTE_OFFSET = 0  # enum bpf_core_relo_kind
_EXT_HEADER = struct.Struct("<HBBIIIIIII")  # magic, version, flags, hdr_len, func/line info, core_relo off, len
_RELO = struct.Struct("<IIII")  # insn_off, type_id, access_str_off, kind


def core_field_relocations(btf_data: bytes, ext_data: bytes) -> dict[str, list[tuple[int, str, tuple[str, ...]]]]:
    """The object's CO-RE relocations, by section name: (instruction index, root struct name,
    member names along the access path).  ``struct nf_conn___x`` is ``nf_conn``, as libbpf
    reads such names."""
    if len(ext_data) < _EXT_HEADER.size:
        return {}
    magic, _v, _f, hdr_len, _fo, _fl, _lo, _ll, relo_off, relo_len = _EXT_HEADER.unpack_from(ext_data)
    if magic != MAGIC:
        raise BtfError(f".BTF.ext magic {magic:#x}, not {MAGIC:#x}")
    if hdr_len < _EXT_HEADER.size or not relo_len:
        return {}
    local = Btf(btf_data)
    pos, end = hdr_len + relo_off, hdr_len + relo_off + relo_len
    if end > len(ext_data):
        raise BtfError(".BTF.ext CO-RE records run past its end")
    rec_size = struct.unpack_from("<I", ext_data, pos)[0]
    if rec_size < _RELO.size:
        raise BtfError(f".BTF.ext CO-RE record size {rec_size}")
    pos += 4
    out: dict[str, list[tuple[int, str, tuple[str, ...]]]] = {}
    while pos < end:
        sec_off, count = struct.unpack_from("<II", ext_data, pos)
        pos += 8
        section = local.string(sec_off)
        for _ in range(count):
            insn_off, type_id, access_off, kind = _RELO.unpack_from(ext_data, pos)
            pos += rec_size
            if kind != FIELD_BYTE_OFFSET:
                raise BtfError(f"{section}: CO-RE relocation of kind {kind}; only field offsets are understood")
            spec = local.string(access_off).split(":")
            root_id = local.resolve(type_id)
            if spec[0] != "0":
                raise BtfError(f"{section}: CO-RE access {':'.join(spec)} indexes an array of structs")
            names, t = [], root_id
            for index in spec[1:]:
                members = local.members(t)
                m_name, m_type, _off = members[int(index)]
                if not m_name:
                    raise BtfError(f"{section}: CO-RE access through an anonymous member")
                names.append(m_name)
                t = local.resolve(m_type)
            root = local.name(root_id).split("___")[0]
            out.setdefault(section, []).append((insn_off // 8, root, tuple(names)))
    return out


def function_ids(names: Iterable[str], btf: Btf | None = None) -> dict[str, int]:
    """Type ids of the kernel FUNCs named ``names`` (all of them, or :class:`BtfError` naming
    those missing) in ``btf``, else in the running kernel's."""
    wanted = set(names)
    if not wanted:
        return {}
    btf = btf or Btf.kernel()
    encoded = {name.encode() + b"\0": name for name in wanted}
    found: dict[str, int] = {}
    data, strings = btf.data, btf.strings
    for type_id in range(1, len(btf.pos)):
        name_off, info, _size = _TYPE.unpack_from(data, btf.pos[type_id])
        if (info >> 24) & 0x1F == KIND_FUNC and name_off:
            for raw, name in encoded.items():
                if data.startswith(raw, strings + name_off):
                    found[name] = type_id
    missing = wanted - found.keys()
    if missing:
        raise BtfError(f"the kernel has no function {', '.join(sorted(missing))} in its BTF")
    return found
