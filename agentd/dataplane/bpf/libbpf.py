"""libbpf, the kernel community's BPF loader (Debian: libbpf1), through ctypes: what the agent
needs of it and no more.

* :class:`BpfObject` is one object file as libbpf reads it: its maps (BTF-defined, ``.maps``)
  and programs (``SEC("tc")``), then :meth:`BpfObject.load`, which is libbpf's whole job --
  maps created or, where pinned by name, reused from the pins; CO-RE relocations against the
  kernel's BTF (module BTF included); kfuncs resolved to the kernel's (or a module's) BTF ids;
  programs loaded.  The agent points the pinned maps at its own directory first
  (:meth:`BpfObject.pin_maps_in`).
* The rest are libbpf's thin wrappers of single bpf() commands -- map elements, pins, object
  info, test runs -- and the tcx hook: BPF links (``bpf_link_create`` with the tcx attach
  types, ``bpf_link_update``, ``bpf_link_detach``), which is how the agent attaches, and a
  plain BPF_PROG_ATTACH (``bpf_prog_attach_opts``), which is how agents before links did.
  libbpf 1.1 (Debian 12) has no ``bpf_program__attach_tcx`` (1.3), and its query and detach
  wrappers predate tcx's fields (the revision, the link ids, detaching by position): those
  two commands are made directly (:func:`tcx_query`, :func:`tcx_detach_at`), the ABI of
  ``union bpf_attr`` as Linux 6.6 has it.

What the unit's capabilities allow (CAP_BPF, CAP_NET_ADMIN; no CAP_SYS_ADMIN): all of the
above on objects the agent holds a file descriptor or a pin of.  Opening an object by its id
(:func:`prog_fd_by_id`, BPF_PROG_GET_FD_BY_ID) is CAP_SYS_ADMIN's alone, so nothing the agent
needs to do may depend on it.

Errors: every call returns a plain int (a file descriptor, an id) or bytes, and raises
:class:`BpfError` (an OSError with the errno, what was asked and, for a load, libbpf's own
words or the end of the verifier's log).  libbpf's messages go to the ``agentd.bpf`` logger at
debug level.  Written against the ABI of libbpf 1.1 (``LIBBPF_1.0.0`` and earlier symbols);
every ``*_opts`` struct carries its size, so newer libbpf takes these calls as they are.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentd.kernel.heap import malloc_trim

log = logging.getLogger("agentd.bpf")

# enum bpf_attach_type: tcx, the qdisc-less tc hooks (Linux 6.6)
TCX_INGRESS, TCX_EGRESS = 46, 47
# attach_flags for the multi-program hooks (tcx)
BPF_F_REPLACE = 1 << 2
BPF_F_BEFORE = 1 << 3
BPF_F_AFTER = 1 << 4
BPF_F_ID = 1 << 5  # the relative program is named by its id, not a file descriptor
LINK_TYPE_TCX = 11  # enum bpf_link_type
# enum bpf_cmd, for the two commands made directly
_BPF_PROG_DETACH, _BPF_PROG_QUERY = 9, 16
# bpf(2)'s number by machine (asm/unistd.h); the agent's hosts are the first two
_SYS_BPF = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "ppc64le": 361, "s390x": 351, "armv7l": 386, "i686": 357}
# enum bpf_map_type
MAP_TYPE_HASH, MAP_TYPE_ARRAY = 1, 2
MAP_TYPE_PERCPU_HASH, MAP_TYPE_PERCPU_ARRAY = 5, 6
MAP_TYPE_LRU_HASH = 9
MAP_TYPE_LPM_TRIE = 11
MAP_TYPE_RINGBUF = 27
PROG_TYPE_SCHED_CLS = 3
BPF_ANY, BPF_NOEXIST, BPF_EXIST = 0, 1, 2
BPF_F_NO_PREALLOC = 1
BPF_FS_MAGIC = 0xCAFE4A11
LIBBPF_WARN, LIBBPF_INFO, LIBBPF_DEBUG = 0, 1, 2
_LOG_SIZE = 1 << 20  # a program's verifier log, kept for the error (the kernel keeps its end)

_c_u32_p = ctypes.POINTER(ctypes.c_uint32)


class BpfError(OSError):
    """A libbpf call failed; ``str()`` names what was asked and the kernel's (or libbpf's) reason."""

    def __init__(self, err: int, what: str, detail: str = "") -> None:
        super().__init__(err, f"{what}: {_strerror(err)}" + (f" ({detail})" if detail else ""))
        self.what = what
        self.detail = detail


# ------------------------------------------------------------------ the library


class _AttachOpts(ctypes.Structure):  # struct bpf_prog_attach_opts (libbpf 1.1)
    _fields_ = [("sz", ctypes.c_size_t), ("flags", ctypes.c_uint), ("replace_prog_fd", ctypes.c_int)]


class _LinkCreateOpts(ctypes.Structure):  # struct bpf_link_create_opts, as far as tcx needs it
    _fields_ = [("sz", ctypes.c_size_t), ("flags", ctypes.c_uint32)]


class _LinkUpdateOpts(ctypes.Structure):  # struct bpf_link_update_opts (libbpf 1.1)
    _fields_ = [("sz", ctypes.c_size_t), ("flags", ctypes.c_uint32), ("old_prog_fd", ctypes.c_uint32)]


class _MprogAttr(ctypes.Structure):  # union bpf_attr for BPF_PROG_ATTACH / BPF_PROG_DETACH (Linux 6.6)
    _fields_ = [("target_ifindex", ctypes.c_uint32), ("attach_bpf_fd", ctypes.c_uint32),
                ("attach_type", ctypes.c_uint32), ("attach_flags", ctypes.c_uint32),
                ("replace_bpf_fd", ctypes.c_uint32), ("relative_id", ctypes.c_uint32),
                ("expected_revision", ctypes.c_uint64)]


class _QueryAttr(ctypes.Structure):  # union bpf_attr for BPF_PROG_QUERY (Linux 6.6)
    _fields_ = [("target_ifindex", ctypes.c_uint32), ("attach_type", ctypes.c_uint32),
                ("query_flags", ctypes.c_uint32), ("attach_flags", ctypes.c_uint32),
                ("prog_ids", ctypes.c_uint64), ("count", ctypes.c_uint32), ("_pad", ctypes.c_uint32),
                ("prog_attach_flags", ctypes.c_uint64), ("link_ids", ctypes.c_uint64),
                ("link_attach_flags", ctypes.c_uint64), ("revision", ctypes.c_uint64)]


class _TestRunOpts(ctypes.Structure):  # struct bpf_test_run_opts (libbpf 1.1)
    _fields_ = [("sz", ctypes.c_size_t), ("data_in", ctypes.c_void_p), ("data_out", ctypes.c_void_p),
                ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32),
                ("ctx_in", ctypes.c_void_p), ("ctx_out", ctypes.c_void_p),
                ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
                ("retval", ctypes.c_uint32), ("repeat", ctypes.c_int), ("duration", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32), ("batch_size", ctypes.c_uint32)]


_P, _I, _U32, _STR = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_char_p
# int (*ring_buffer_sample_fn)(void *ctx, void *data, size_t size)
_SAMPLE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
# name: (result, arguments)
_SIGNATURES = {
    "bpf_object__open_file": (_P, [_STR, _P]),
    "bpf_object__load": (_I, [_P]),
    "bpf_object__close": (None, [_P]),
    "bpf_object__next_map": (_P, [_P, _P]),
    "bpf_object__next_program": (_P, [_P, _P]),
    "bpf_map__name": (_STR, [_P]),
    "bpf_map__type": (_I, [_P]),
    "bpf_map__key_size": (_U32, [_P]),
    "bpf_map__value_size": (_U32, [_P]),
    "bpf_map__max_entries": (_U32, [_P]),
    "bpf_map__map_flags": (_U32, [_P]),
    "bpf_map__pin_path": (_STR, [_P]),
    "bpf_map__is_internal": (ctypes.c_bool, [_P]),
    "bpf_map__set_pin_path": (_I, [_P, _STR]),
    "bpf_map__fd": (_I, [_P]),
    "bpf_program__name": (_STR, [_P]),
    "bpf_program__section_name": (_STR, [_P]),
    "bpf_program__type": (_I, [_P]),
    "bpf_program__fd": (_I, [_P]),
    "bpf_program__set_log_buf": (_I, [_P, _P, ctypes.c_size_t]),
    "bpf_map_lookup_elem": (_I, [_I, _P, _P]),
    "bpf_map_update_elem": (_I, [_I, _P, _P, ctypes.c_uint64]),
    "bpf_map_delete_elem": (_I, [_I, _P]),
    "bpf_map_lookup_and_delete_elem": (_I, [_I, _P, _P]),
    "bpf_map_get_next_key": (_I, [_I, _P, _P]),
    "bpf_obj_pin": (_I, [_I, _STR]),
    "bpf_obj_get": (_I, [_STR]),
    "bpf_obj_get_info_by_fd": (_I, [_I, _P, _c_u32_p]),
    "bpf_prog_get_fd_by_id": (_I, [_U32]),
    "bpf_prog_attach_opts": (_I, [_I, _I, _I, ctypes.POINTER(_AttachOpts)]),
    "bpf_link_create": (_I, [_I, _I, _I, ctypes.POINTER(_LinkCreateOpts)]),
    "bpf_link_update": (_I, [_I, _I, ctypes.POINTER(_LinkUpdateOpts)]),
    "bpf_link_detach": (_I, [_I]),
    "bpf_prog_test_run_opts": (_I, [_I, ctypes.POINTER(_TestRunOpts)]),
    "ring_buffer__new": (_P, [_I, _SAMPLE_FN, _P, _P]),
    "ring_buffer__consume": (_I, [_P]),
    "ring_buffer__free": (None, [_P]),
    "libbpf_num_possible_cpus": (_I, []),
    "libbpf_strerror": (_I, [_I, ctypes.c_char_p, ctypes.c_size_t]),
}

# int (*libbpf_print_fn_t)(enum libbpf_print_level, const char *, va_list): the va_list is
# passed on to vsnprintf untouched (a pointer on x86-64 and arm64, where it is an array or a
# struct passed by reference).
_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]
_libc.vsnprintf.restype = ctypes.c_int
_captured = threading.local()  # the messages of the call in progress on this thread
_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _on_message(level: int, fmt: bytes, args: int) -> int:
    if level == LIBBPF_DEBUG:
        return 0
    buf = ctypes.create_string_buffer(4096)
    _libc.vsnprintf(buf, len(buf), fmt, args)
    text = buf.value.decode(errors="replace").strip()
    log.debug("libbpf: %s", text)
    lines = getattr(_captured, "lines", None)
    if lines is not None and level == LIBBPF_WARN:
        lines.append(text.removeprefix("libbpf: "))
    return 0


_print_callback = None  # referenced for as long as libbpf may call it


def library() -> ctypes.CDLL:
    """libbpf.so.1, opened once; :class:`BpfError` (ENOENT) where it is not installed."""
    global _lib, _print_callback
    with _lib_lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
            except OSError:
                raise BpfError(errno.ENOENT, "opening libbpf",
                               "libbpf.so.1 is not installed (Debian: apt-get install libbpf1)") from None
            for fn, (restype, argtypes) in _SIGNATURES.items():
                f = getattr(lib, fn)
                f.restype, f.argtypes = restype, argtypes
            lib.libbpf_set_print.restype = ctypes.c_void_p
            lib.libbpf_set_print.argtypes = [_PRINT_FN]
            try:
                _print_callback = _PRINT_FN(_on_message)
            except (MemoryError, OSError):  # no executable trampoline for libffi: libbpf prints to stderr
                log.debug("libbpf's messages go to stderr: no callback could be made for them")
            else:
                lib.libbpf_set_print(_print_callback)
            _lib = lib
        return _lib


@contextlib.contextmanager
def _capturing() -> Iterator[list[str]]:
    lines: list[str] = []
    _captured.lines = lines
    try:
        yield lines
    finally:
        _captured.lines = None


def _strerror(err: int) -> str:
    """libbpf's own error numbers (from 4000: LIBBPF_ERRNO__FORMAT, ...) in libbpf's words."""
    if err < 4000 or _lib is None:
        return os.strerror(err)
    buf = ctypes.create_string_buffer(128)
    _lib.libbpf_strerror(err, buf, len(buf))
    return buf.value.decode(errors="replace")


def _check(ret: int, what: str, detail: str = "") -> int:
    """libbpf's convention: a negative errno on failure (and errno set)."""
    if ret < 0:
        raise BpfError(-ret, what, detail)
    return ret


def _buf(data: bytes) -> ctypes.Array:
    return ctypes.create_string_buffer(data, len(data))


# ------------------------------------------------------------------ object files


@dataclass(frozen=True)
class MapDef:
    """A map of an object file, as libbpf read its definition."""

    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    pinned: bool = False  # ``__uint(pinning, LIBBPF_PIN_BY_NAME)``

    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.type, self.key_size, self.value_size, self.max_entries, self.flags)


@dataclass(frozen=True)
class Program:
    name: str  # the function's name, which is the kernel's program name (up to 15 bytes)
    section: str
    type: int  # enum bpf_prog_type, from the section name


class BpfObject:
    """One BPF object file, opened by libbpf: :attr:`maps` and :attr:`programs` as libbpf reads
    them (nothing is in the kernel yet), then :meth:`load`.  :attr:`maps` leaves out libbpf's
    internal maps (a ``.rodata`` of the compiler's constants: made afresh with each load).  Closing it closes every file
    descriptor of its maps and programs; what is pinned or attached stays in the kernel."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        lib = library()
        with _capturing() as said:
            ptr = lib.bpf_object__open_file(str(self.path).encode(), None)
            if not ptr:
                err = ctypes.get_errno() or errno.EINVAL
                raise BpfError(err, f"opening {self.path}", "; ".join(said[:2]))
        self._obj: int | None = ptr
        self._maps: dict[str, int] = {}
        self._progs: dict[str, int] = {}
        m = lib.bpf_object__next_map(ptr, None)
        while m:
            self._maps[lib.bpf_map__name(m).decode()] = m
            m = lib.bpf_object__next_map(ptr, m)
        p = lib.bpf_object__next_program(ptr, None)
        while p:
            self._progs[lib.bpf_program__name(p).decode()] = p
            p = lib.bpf_object__next_program(ptr, p)
        self.maps = {name: MapDef(name, lib.bpf_map__type(m), lib.bpf_map__key_size(m), lib.bpf_map__value_size(m),
                                  lib.bpf_map__max_entries(m), lib.bpf_map__map_flags(m),
                                  lib.bpf_map__pin_path(m) is not None)
                     for name, m in self._maps.items() if not lib.bpf_map__is_internal(m)}
        self.programs = {name: Program(name, lib.bpf_program__section_name(p).decode(), lib.bpf_program__type(p))
                         for name, p in self._progs.items()}
        self.loaded = False

    def __enter__(self) -> BpfObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pin_maps_in(self, directory: str | os.PathLike) -> None:
        """Pin the maps the object pins by name in ``directory`` (libbpf's default is the root
        of /sys/fs/bpf): :meth:`load` reuses a map pinned there, and pins the others there."""
        for name, mdef in self.maps.items():
            if mdef.pinned:
                _check(library().bpf_map__set_pin_path(self._maps[name], str(Path(directory) / name).encode()),
                       f"pin path of map {name}")

    def load(self) -> None:
        """Everything into the kernel, as libbpf does it; :class:`BpfError` with libbpf's reason
        (a kfunc or a struct field the kernel lacks, the verifier's last words, ...)."""
        lib = library()
        # Anonymous pages rather than create_string_buffer, which zeroes (so touches) all of
        # it: the kernel writes a log only when a load fails, so a good load costs no memory
        # (1 MB a program at the agent's start-up peak otherwise, beside libbpf's BTF).
        logs = {name: _log_buffer() for name in self._progs}
        for name, p in self._progs.items():
            # Read by the kernel only when a load fails (libbpf then retries with the log on).
            lib.bpf_program__set_log_buf(p, ctypes.addressof(logs[name]), _LOG_SIZE)
        # libbpf reads the kernel's BTF (5.5 MB, copied once more while parsing) for CO-RE
        # and kfuncs, the agent's start-up peak: put it on a trimmed heap, and trim after.
        malloc_trim()
        try:
            with _capturing() as said:
                ret = lib.bpf_object__load(self._obj)
            if ret < 0:
                raise BpfError(-ret, f"loading {self.path.name}", _load_detail(said, logs))
        finally:
            for p in self._progs.values():
                lib.bpf_program__set_log_buf(p, None, 0)
            malloc_trim()
        self.loaded = True

    def map_fd(self, name: str) -> int:
        return _check(library().bpf_map__fd(self._maps[name]), f"map {name}")

    def prog_fd(self, name: str) -> int:
        return _check(library().bpf_program__fd(self._progs[name]), f"program {name}")

    def close(self) -> None:
        if self._obj is not None:
            library().bpf_object__close(self._obj)
            self._obj = None


def _log_buffer() -> ctypes.Array:
    """A zeroed ``char[_LOG_SIZE]`` whose pages are real only where written."""
    return (ctypes.c_char * _LOG_SIZE).from_buffer(mmap.mmap(-1, _LOG_SIZE))


def _load_detail(said: list[str], logs: dict[str, ctypes.Array]) -> str:
    """Why a load failed, in a line: libbpf's first word on it and the verifier's last."""
    words = [s.splitlines()[0] for s in said if s and "PROG LOAD LOG" not in s and not s.startswith("failed to load object")]
    detail = words[:1]
    for name, buf in logs.items():
        lines = [x for x in buf.value.decode(errors="replace").splitlines() if x.strip()]
        if lines:
            detail.append(f"verifier on {name}: " + " | ".join(lines[-3:]))
    return "; ".join(detail)


# ------------------------------------------------------------------ single commands


def map_lookup(fd: int, key: bytes, value_size: int) -> bytes | None:
    """The value under ``key`` (``value_size`` bytes; per-CPU maps: times the possible CPUs)."""
    value = ctypes.create_string_buffer(value_size)
    ret = library().bpf_map_lookup_elem(fd, _buf(key), value)
    if ret == -errno.ENOENT:
        return None
    _check(ret, "map lookup")
    return value.raw


def map_update(fd: int, key: bytes, value: bytes, flags: int = BPF_ANY) -> None:
    _check(library().bpf_map_update_elem(fd, _buf(key), _buf(value), flags), "map update")


def map_delete(fd: int, key: bytes) -> bool:
    """Delete ``key``; False if it was not there."""
    ret = library().bpf_map_delete_elem(fd, _buf(key))
    if ret == -errno.ENOENT:
        return False
    _check(ret, "map delete")
    return True


def map_take(fd: int, key: bytes, value_size: int) -> bytes | None:
    """The value under ``key``, removed from the map in the same step
    (BPF_MAP_LOOKUP_AND_DELETE_ELEM: hash maps since Linux 5.14); None if it was not there."""
    value = ctypes.create_string_buffer(value_size)
    ret = library().bpf_map_lookup_and_delete_elem(fd, _buf(key), value)
    if ret == -errno.ENOENT:
        return None
    _check(ret, "map lookup and delete")
    return value.raw


def map_keys(fd: int, key_size: int) -> list[bytes]:
    """Every key of a hash or trie map (BPF_MAP_GET_NEXT_KEY from no key)."""
    lib = library()
    keys: list[bytes] = []
    nxt = ctypes.create_string_buffer(key_size)
    cur: ctypes.Array | None = None
    while True:
        ret = lib.bpf_map_get_next_key(fd, cur, nxt)
        if ret == -errno.ENOENT:
            return keys
        _check(ret, "map get next key")
        keys.append(nxt.raw)
        cur = _buf(nxt.raw)
        if len(keys) > 1 << 20:  # a map changing under us faster than we walk it
            return keys


def obj_pin(fd: int, path: str) -> None:
    _check(library().bpf_obj_pin(fd, path.encode()), f"pinning {path}")


def obj_get(path: str) -> int:
    return _check(library().bpf_obj_get(path.encode()), f"opening pinned {path}")


def _info(fd: int, size: int) -> bytes:
    buf = ctypes.create_string_buffer(size)
    length = ctypes.c_uint32(size)
    _check(library().bpf_obj_get_info_by_fd(fd, buf, ctypes.byref(length)), "object info")
    return buf.raw


def map_info(fd: int) -> dict:
    """The leading fields of struct bpf_map_info."""
    raw = _info(fd, 64)
    mtype, mid, key_size, value_size, max_entries, flags = (int.from_bytes(raw[i : i + 4], "little") for i in range(0, 24, 4))
    return {"type": mtype, "id": mid, "key_size": key_size, "value_size": value_size, "max_entries": max_entries,
            "flags": flags, "name": raw[24:40].rstrip(b"\0").decode()}


def prog_info(fd: int) -> dict:
    """type, id, tag and name of struct bpf_prog_info."""
    raw = _info(fd, 96)
    return {"type": int.from_bytes(raw[0:4], "little"), "id": int.from_bytes(raw[4:8], "little"),
            "tag": raw[8:16].hex(), "name": raw[64:80].rstrip(b"\0").decode()}


def link_info(fd: int) -> dict:
    """type, id and program id of struct bpf_link_info, and for a tcx link its device and hook
    (``ifindex`` 0 once the device is gone: the link outlives it, holding nothing)."""
    raw = _info(fd, 64)
    ltype, lid, prog_id = (int.from_bytes(raw[i : i + 4], "little") for i in range(0, 12, 4))
    out = {"type": ltype, "id": lid, "prog_id": prog_id}
    if ltype == LINK_TYPE_TCX:  # the union after the three u32s is 8-aligned: offset 16
        out["ifindex"], out["attach_type"] = (int.from_bytes(raw[i : i + 4], "little") for i in (16, 20))
    return out


def prog_fd_by_id(prog_id: int) -> int:
    """A new file descriptor for the loaded program ``prog_id``: CAP_SYS_ADMIN only."""
    return _check(library().bpf_prog_get_fd_by_id(prog_id), f"opening program {prog_id}")


def tcx_attach(ifindex: int, attach_type: int, fd: int) -> None:
    """Put program ``fd`` first on the device's tcx hook, with no link: how agents before
    links attached (kept to make their state in tests).  The attachment outlives this process
    until detached or the device goes, and nothing but its id names it."""
    opts = _AttachOpts(ctypes.sizeof(_AttachOpts), BPF_F_BEFORE, 0)
    _check(library().bpf_prog_attach_opts(fd, ifindex, attach_type, ctypes.byref(opts)),
           f"attaching a program to device {ifindex} (tcx)")


def link_create(prog_fd: int, ifindex: int, attach_type: int, *, last: bool = False) -> int:
    """Attach program ``prog_fd`` first (``last``: last) on the device's tcx hook through a new
    BPF link; returns the link's file descriptor.  The attachment lasts as long as the link: pin
    it to keep it beyond this process (the kernel detaches a link whose last descriptor and pin
    are gone)."""
    opts = _LinkCreateOpts(ctypes.sizeof(_LinkCreateOpts), BPF_F_AFTER if last else BPF_F_BEFORE)
    return _check(library().bpf_link_create(prog_fd, ifindex, attach_type, ctypes.byref(opts)),
                  f"attaching a program to device {ifindex} (tcx link)")


def link_update(link_fd: int, prog_fd: int) -> None:
    """Swap the link's program for ``prog_fd`` in place: one pointer exchange, between two
    packets, the position on the hook kept."""
    opts = _LinkUpdateOpts(ctypes.sizeof(_LinkUpdateOpts), 0, 0)
    _check(library().bpf_link_update(link_fd, prog_fd, ctypes.byref(opts)), "replacing the program of a link")


def link_detach(link_fd: int) -> None:
    """Take the link's program off its hook now (the link stays, holding nothing)."""
    _check(library().bpf_link_detach(link_fd), "detaching a link")


@dataclass(frozen=True)
class TcxHook:
    """What runs on one tcx hook, in order: program ids, the link of each (0: attached without
    one), and the hook's revision (every change counts it up)."""

    prog_ids: tuple[int, ...]
    link_ids: tuple[int, ...]
    revision: int


def _sys_bpf(cmd: int, attr: ctypes.Structure) -> int:
    """bpf(2) itself, for the commands whose fields libbpf 1.1 does not pass."""
    machine = os.uname().machine
    if machine not in _SYS_BPF:
        raise BpfError(errno.ENOSYS, f"bpf() on {machine}", "its system call number is not known here")
    ret = _libc.syscall(ctypes.c_long(_SYS_BPF[machine]), ctypes.c_int(cmd), ctypes.byref(attr),
                        ctypes.c_uint(ctypes.sizeof(attr)))
    return -ctypes.get_errno() if ret < 0 else ret


def tcx_query(ifindex: int, attach_type: int) -> TcxHook:
    """The programs on the device's tcx hook (BPF_PROG_QUERY: CAP_NET_ADMIN)."""
    what = f"listing the programs on device {ifindex} (tcx)"
    count = 16
    for _ in range(4):  # the list may grow between two calls
        ids, links = (ctypes.c_uint32 * count)(), (ctypes.c_uint32 * count)()
        attr = _QueryAttr(ifindex, attach_type, prog_ids=ctypes.addressof(ids), count=count,
                          link_ids=ctypes.addressof(links))
        ret = _sys_bpf(_BPF_PROG_QUERY, attr)
        if ret == -errno.ENOENT:  # no tcx entry on the device yet (Linux 6.6 says so)
            return TcxHook((), (), attr.revision)
        if ret == -errno.ENOSPC:
            count = attr.count + 8
            continue
        _check(ret, what)
        n = attr.count
        return TcxHook(tuple(ids[:n]), tuple(links[:n]), attr.revision)
    raise BpfError(errno.EAGAIN, what, "the list kept changing")


def tcx_detach_at(ifindex: int, attach_type: int, hook: TcxHook, index: int) -> None:
    """Detach the program at ``index`` of ``hook`` (as :func:`tcx_query` returned it) without a
    file descriptor of it: named by its position -- before the next program or after the one
    before, both by id (BPF_F_ID), or the hook's only one -- and refused (ESTALE) if the hook
    changed since the query (kernel/bpf/mprog.c, bpf_mprog_detach).  A program attached
    through a link cannot be detached this way (EBUSY)."""
    ids = hook.prog_ids
    if index + 1 < len(ids):
        flags, relative = BPF_F_BEFORE | BPF_F_ID, ids[index + 1]
    elif index > 0:
        flags, relative = BPF_F_AFTER | BPF_F_ID, ids[index - 1]
    else:
        flags, relative = BPF_F_BEFORE, 0  # the first, which is the only one
    attr = _MprogAttr(ifindex, 0, attach_type, flags, 0, relative, hook.revision)
    _check(_sys_bpf(_BPF_PROG_DETACH, attr), f"detaching program {ids[index]} from device {ifindex} (tcx)")


SKB_CTX_INGRESS_IFINDEX = 36  # offsetof(struct __sk_buff, ingress_ifindex); ifindex follows


def prog_test_run(fd: int, data: bytes, repeat: int = 1, *, ifindex: int = 0) -> tuple[int, bytes]:
    """Run a program on ``data`` (BPF_PROG_TEST_RUN); returns (its return value, the packet
    as it left).  ``ifindex``: the device the packet is on and came in by (the loopback
    device if 0), given to the kernel as the run's ``struct __sk_buff`` context."""
    din = _buf(data)
    dout = ctypes.create_string_buffer(len(data) + 256)
    opts = _TestRunOpts(ctypes.sizeof(_TestRunOpts), ctypes.addressof(din), ctypes.addressof(dout), len(data),
                        len(dout), repeat=repeat)
    if ifindex:
        ctx = _buf(bytes(SKB_CTX_INGRESS_IFINDEX) + struct.pack("<II", ifindex, ifindex))
        opts.ctx_in, opts.ctx_size_in = ctypes.addressof(ctx), len(ctx)
    _check(library().bpf_prog_test_run_opts(fd, ctypes.byref(opts)), "test run")
    return opts.retval, dout.raw[: opts.data_size_out]


def _c_sample() -> tuple[Any, Any] | None:
    """agentd/kernel/_ctevents.c's ring buffer record function (``agentd_ring_sample``, as
    libbpf calls it) and its module; None where it is not built."""
    try:
        from agentd.kernel import _ctevents
    except ImportError:
        return None
    address = ctypes.cast(ctypes.CDLL(_ctevents.__file__).agentd_ring_sample, ctypes.c_void_p).value
    return _SAMPLE_FN(address), _ctevents


class RingBuffer:
    """A BPF ring buffer map (BPF_MAP_TYPE_RINGBUF), read through libbpf's consumer (the
    map's pages mapped into this process: reading costs no system call per record).  libbpf
    hands it each record through a function: agentd/kernel/_ctevents.c's, which copies them
    into a buffer of its own (Python then takes them in one call), or where that is not built
    a Python one (a call through ctypes per record)."""

    def __init__(self, map_fd: int) -> None:
        self._records: list[bytes] = []
        c = _c_sample()
        self._c = None if c is None else c[1]
        self._sink: int | None = None
        if c is not None:
            self._sample, self._sink = c[0], c[1].ring_sink()
        else:
            self._sample = _SAMPLE_FN(self._on_sample)  # kept alive as long as the ring
        with _capturing() as said:
            ptr = library().ring_buffer__new(map_fd, self._sample, self._sink, None)
        if not ptr:
            self._free_sink()
            raise BpfError(ctypes.get_errno() or errno.EINVAL, "opening a ring buffer", "; ".join(said[:1]))
        self._rb: int | None = ptr

    def _on_sample(self, _ctx: int, data: int, size: int) -> int:
        self._records.append(ctypes.string_at(data, size))
        return 0

    def drain(self) -> list[bytes]:
        """Every record written since the last call, oldest first (never waits)."""
        if self._rb is None:
            return []
        ret = library().ring_buffer__consume(self._rb)
        if self._c is not None:
            out = self._c.ring_take(self._sink)  # what was taken before an error too
        else:
            out, self._records = self._records, []
        if ret < 0:
            _check(ret, "reading a ring buffer")
        return out

    def drain_fixed(self, size: int) -> tuple[bytes, int, int, set[bytes]]:
        """Every record of ``size`` bytes written since the last call, side by side in one
        bytes object, oldest first; how many; how many of another length (left out); the
        distinct 4-byte values at their offsets 0 and 4 (never waits).  One object, not one
        per record (agentd/kernel/_ctevents.c's ring_take_fixed, or here)."""
        if self._rb is None:
            return b"", 0, 0, set()
        ret = library().ring_buffer__consume(self._rb)
        if self._c is not None:
            out = self._c.ring_take_fixed(self._sink, size)
        else:
            records, self._records = self._records, []
            out = fixed_records(records, size)
        if ret < 0:
            _check(ret, "reading a ring buffer")
        return out

    def close(self) -> None:
        if self._rb is not None:
            library().ring_buffer__free(self._rb)
            self._rb = None
        self._free_sink()

    def _free_sink(self) -> None:
        if self._c is not None and self._sink is not None:
            self._c.ring_sink_free(self._sink)
            self._sink = None


def fixed_records(records: list[bytes], size: int) -> tuple[bytes, int, int, set[bytes]]:
    """What agentd/kernel/_ctevents.c's ring_take_fixed makes of ``records``, in Python."""
    good = [r for r in records if len(r) == size]
    return b"".join(good), len(good), len(records) - len(good), {r[i : i + 4] for r in good for i in (0, 4)}


def possible_cpus() -> int:
    """How many values a per-CPU map holds per key: the possible CPUs, not the online ones."""
    return _check(library().libbpf_num_possible_cpus(), "counting the possible CPUs")


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]  # struct statfs: 120 bytes


def is_bpffs(path: str) -> bool:
    """True if ``path`` lies on a BPF file system (statfs f_type == BPF_FS_MAGIC): where pins go."""
    buf = _Statfs()
    if _libc.statfs(path.encode(), ctypes.byref(buf)) != 0:
        return False
    return (buf.f_type & 0xFFFFFFFF) == BPF_FS_MAGIC
