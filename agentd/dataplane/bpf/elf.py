"""Read the BPF object file clang makes of datapath.c: its maps, its programs, and where each
program refers to a map.

Only what that file uses is understood -- maps as ``struct agentd_map_def`` in a ``maps``
section, one function per ``tc/...`` section, map references as ``R_BPF_64_64``
relocations on ``ld_imm64``, calls of kernel functions (kfuncs, ``extern ... __ksym``) as
``R_BPF_64_32`` relocations on ``call`` against an undefined symbol, reads of kernel
structures' fields as CO-RE field-offset records in ``.BTF.ext`` -- and anything else is refused with a clear
:class:`ObjectError` rather than loaded half-understood (libbpf does the general job; the
agent needs no global data, BPF-to-BPF calls or other kinds of CO-RE relocation).  ELF64 little endian,
as ``clang -target bpf`` writes on little-endian hosts.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from . import btf

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_REL = struct.Struct("<QQ")
_MAP_DEF = struct.Struct("<IIIII")  # struct agentd_map_def (datapath.h)

SHT_SYMTAB, SHT_REL = 2, 9
STT_FUNC = 2
R_BPF_64_64 = 1
R_BPF_64_32 = 10
LD_IMM64 = 0x18
CALL = 0x85
PSEUDO_MAP_FD = 1
PSEUDO_KFUNC_CALL = 2
LDX, ST, STX, ALU, ALU64 = 1, 2, 3, 4, 7  # instruction classes
K = 0x00  # BPF_K: the immediate operand
SHN_UNDEF = 0
EM_BPF = 247


class ObjectError(ValueError):
    """The object file is not one this loader understands."""


@dataclass(frozen=True)
class MapDef:
    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int


@dataclass(frozen=True)
class Program:
    name: str  # the function's name, which becomes the kernel's program name
    section: str  # "tc/egress"
    insns: bytes
    map_refs: tuple[tuple[int, str], ...] = field(default=())  # (instruction index, map name)
    kfunc_refs: tuple[tuple[int, str], ...] = field(default=())  # (instruction index, kernel function)
    # (instruction index, struct, member path): reads of a kernel struct's field (CO-RE)
    field_refs: tuple[tuple[int, str, tuple[str, ...]], ...] = field(default=())

    def relocated(self, map_fds: dict[str, int], kfunc_ids: dict[str, int] | None = None,
                  field_offsets: dict[tuple[str, tuple[str, ...]], int] | None = None) -> bytes:
        """The instructions with every map reference turned into ``ld_imm64 rX, map fd``,
        every kfunc call into ``call`` of that function's BTF id in the kernel's own BTF
        (``kfunc_ids``, from :func:`agentd.dataplane.bpf.btf.function_ids`) and every field
        read at the kernel's offset of the field (``field_offsets``, from
        :meth:`agentd.dataplane.bpf.btf.Btf.field_offset`)."""
        code = bytearray(self.insns)
        for index, name in self.map_refs:
            off = index * 8
            code[off + 1] = (code[off + 1] & 0x0F) | (PSEUDO_MAP_FD << 4)  # src_reg = BPF_PSEUDO_MAP_FD
            struct.pack_into("<i", code, off + 4, map_fds[name])
        for index, name in self.kfunc_refs:
            off = index * 8
            code[off + 1] = (code[off + 1] & 0x0F) | (PSEUDO_KFUNC_CALL << 4)
            struct.pack_into("<hi", code, off + 2, 0, (kfunc_ids or {})[name])  # off 0: vmlinux's BTF
        for index, root, path in self.field_refs:
            off, value = index * 8, (field_offsets or {})[(root, path)]
            if code[off] & 0x07 in (LDX, ST, STX):
                struct.pack_into("<h", code, off + 2, value)
            else:
                struct.pack_into("<i", code, off + 4, value)
        return bytes(code)

    @property
    def fields(self) -> frozenset[tuple[str, tuple[str, ...]]]:
        return frozenset((root, path) for _index, root, path in self.field_refs)

    @property
    def kfuncs(self) -> frozenset[str]:
        return frozenset(name for _index, name in self.kfunc_refs)


@dataclass(frozen=True)
class BpfObject:
    maps: dict[str, MapDef]
    programs: dict[str, Program]  # by section name
    license: str


def read_object(data: bytes) -> BpfObject:
    if len(data) < _EHDR.size or data[:4] != b"\x7fELF":
        raise ObjectError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ObjectError("not a little-endian ELF64 file")
    _ident, _etype, machine, _v, _entry, _phoff, shoff, _fl, _eh, _phes, _phn, shentsize, shnum, shstrndx = _EHDR.unpack_from(data)
    if machine != EM_BPF:
        raise ObjectError(f"ELF machine {machine} is not BPF ({EM_BPF})")
    if shentsize != _SHDR.size or shoff + shnum * shentsize > len(data):
        raise ObjectError("truncated section header table")
    sections = [_SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]

    def body(i: int) -> bytes:
        sh = sections[i]
        return data[sh[4] : sh[4] + sh[5]]

    def cstr(table: bytes, off: int) -> str:
        end = table.find(b"\0", off)
        return table[off:end if end >= 0 else len(table)].decode()

    shstr = body(shstrndx)
    names = [cstr(shstr, sh[0]) for sh in sections]
    symtab_i = next((i for i, sh in enumerate(sections) if sh[1] == SHT_SYMTAB), None)
    if symtab_i is None:
        raise ObjectError("no symbol table")
    strtab = body(sections[symtab_i][6])
    raw_syms = body(symtab_i)
    symbols = [_SYM.unpack_from(raw_syms, off) for off in range(0, len(raw_syms), _SYM.size)]

    maps_i = names.index("maps") if "maps" in names else None
    maps: dict[str, MapDef] = {}
    for st_name, _info, _other, shndx, value, size in symbols:
        if maps_i is not None and shndx == maps_i and size == _MAP_DEF.size:
            name = cstr(strtab, st_name)
            maps[name] = MapDef(name, *_MAP_DEF.unpack_from(body(maps_i), value))

    core: dict[str, list[tuple[int, str, tuple[str, ...]]]] = {}
    if ".BTF.ext" in names and ".BTF" in names:
        try:
            core = btf.core_field_relocations(body(names.index(".BTF")), body(names.index(".BTF.ext")))
        except (btf.BtfError, IndexError, struct.error) as err:
            raise ObjectError(f"CO-RE relocations: {err}") from None

    programs: dict[str, Program] = {}
    for i, name in enumerate(names):
        if not name.startswith("tc/"):
            continue
        funcs = [cstr(strtab, s[0]) for s in symbols if s[3] == i and (s[1] & 0xF) == STT_FUNC]
        if len(funcs) != 1:
            raise ObjectError(f"section {name} holds {len(funcs)} functions; one per program section is supported")
        refs, kfuncs = [], []
        for j, sh in enumerate(sections):
            if sh[1] != SHT_REL or sh[7] != i:
                continue
            rel = body(j)
            for off in range(0, len(rel), _REL.size):
                r_offset, r_info = _REL.unpack_from(rel, off)
                sym = symbols[r_info >> 32]
                target = cstr(strtab, sym[0])
                if (r_info & 0xFFFFFFFF) == R_BPF_64_32 and sym[3] == SHN_UNDEF and target:
                    if r_offset % 8 or body(i)[r_offset] != CALL:
                        raise ObjectError(f"{name}: reference to {target} at byte {r_offset} is not a call")
                    kfuncs.append((r_offset // 8, target))
                    continue
                if (r_info & 0xFFFFFFFF) != R_BPF_64_64 or sym[3] != maps_i or target not in maps:
                    raise ObjectError(f"{name}: relocation against {target or 'a section'} is neither a map reference nor a kernel function call")
                if r_offset % 8 or body(i)[r_offset] != LD_IMM64:
                    raise ObjectError(f"{name}: map reference at byte {r_offset} is not an ld_imm64")
                refs.append((r_offset // 8, target))
        fields = core.get(name, [])
        for index, root, path in fields:
            insn = body(i)[index * 8 : index * 8 + 1]
            cls = insn[0] & 0x07 if insn else -1
            if cls not in (LDX, ST, STX) and not (cls in (ALU, ALU64) and insn[0] & 0x08 == K):
                raise ObjectError(f"{name}: CO-RE relocation of {root}.{'.'.join(path)} on an instruction "
                                  "that is neither a memory access nor an immediate")
        programs[name] = Program(funcs[0], name, body(i), tuple(refs), tuple(kfuncs), tuple(fields))
    if not programs:
        raise ObjectError("no tc/ program sections")
    if "license" not in names:
        raise ObjectError("no license section")
    return BpfObject(maps, programs, body(names.index("license")).rstrip(b"\0").decode())
