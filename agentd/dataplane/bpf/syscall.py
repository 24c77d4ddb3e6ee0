"""The bpf(2) system call, through ctypes: just the commands agentd's loader needs.

Every call returns a plain int (a file descriptor, an id) or bytes, and raises
:class:`BpfError` (an OSError with the errno and what was asked) on failure.  File
descriptors are the caller's to close (``os.close``).  The ``union bpf_attr`` layouts are
packed with :mod:`struct` from include/uapi/linux/bpf.h; the kernel requires the bytes
past the fields a command uses to be zero, which a fresh buffer is.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

# __NR_bpf per architecture (arch/*/include/asm/unistd*.h; the generic table for the rest).
_NR_BPF = {"x86_64": 321, "i386": 357, "i686": 357, "aarch64": 280, "armv7l": 386, "armv6l": 386,
           "ppc64le": 361, "ppc64": 361, "s390x": 351, "riscv64": 280, "loongarch64": 280}

# enum bpf_cmd
MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY, PROG_LOAD = range(6)
OBJ_PIN, OBJ_GET = 6, 7
PROG_ATTACH, PROG_DETACH = 8, 9
PROG_TEST_RUN = 10
PROG_GET_FD_BY_ID = 13
OBJ_GET_INFO_BY_FD = 15
PROG_QUERY = 16

# enum bpf_attach_type: tcx, the qdisc-less tc hooks (Linux 6.6)
TCX_INGRESS, TCX_EGRESS = 46, 47
# attach_flags of BPF_PROG_ATTACH for multi-program hooks (tcx)
BPF_F_REPLACE = 1 << 2
BPF_F_BEFORE = 1 << 3

# enum bpf_map_type / bpf_prog_type
MAP_TYPE_HASH, MAP_TYPE_ARRAY = 1, 2
MAP_TYPE_PERCPU_HASH, MAP_TYPE_PERCPU_ARRAY = 5, 6
MAP_TYPE_LPM_TRIE = 11
PERCPU_TYPES = frozenset({MAP_TYPE_PERCPU_HASH, MAP_TYPE_PERCPU_ARRAY})
PROG_TYPE_SCHED_CLS = 3

BPF_ANY, BPF_NOEXIST, BPF_EXIST = 0, 1, 2
BPF_F_NO_PREALLOC = 1
BPF_FS_MAGIC = 0xCAFE4A11
OBJ_NAME_LEN = 16
_LOG_SIZE = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class BpfError(OSError):
    """A bpf() command failed; ``str()`` names the command and the kernel's reason."""

    def __init__(self, err: int, what: str, detail: str = "") -> None:
        super().__init__(err, f"{what}: {os.strerror(err)}" + (f" ({detail})" if detail else ""))
        self.what = what
        self.detail = detail


def _nr() -> int:
    machine = platform.machine()
    try:
        return _NR_BPF[machine]
    except KeyError:
        raise BpfError(errno.ENOSYS, f"bpf() on {machine}", "no syscall number known for this architecture") from None


def _syscall(cmd: int, attr: ctypes.Array) -> int:
    # syscall(2) is variadic: every argument goes as a C long / pointer, never a default int.
    return _libc.syscall(ctypes.c_long(_nr()), ctypes.c_long(cmd), ctypes.c_void_p(ctypes.addressof(attr)),
                         ctypes.c_long(len(attr)))


def _bpf(cmd: int, attr: ctypes.Array, what: str) -> int:
    ret = _syscall(cmd, attr)
    if ret < 0:
        raise BpfError(ctypes.get_errno(), what)
    return ret


def _attr(fmt: str, *values) -> ctypes.Array:
    buf = ctypes.create_string_buffer(128)
    struct.pack_into(fmt, buf, 0, *values)
    return buf


def _addr(buf: ctypes.Array | None) -> int:
    return ctypes.addressof(buf) if buf is not None else 0


def _name(name: str) -> bytes:
    raw = name.encode()
    if len(raw) >= OBJ_NAME_LEN:
        raise ValueError(f"BPF object name longer than {OBJ_NAME_LEN - 1} bytes: {name!r}")
    return raw


def map_create(map_type: int, key_size: int, value_size: int, max_entries: int, flags: int, name: str) -> int:
    attr = _attr("<IIIIIII16s", map_type, key_size, value_size, max_entries, flags, 0, 0, _name(name))
    return _bpf(MAP_CREATE, attr, f"creating map {name}")


def _elem(cmd: int, fd: int, key: bytes, value: ctypes.Array | None, flags: int, what: str) -> int:
    kbuf = ctypes.create_string_buffer(key, len(key))
    attr = _attr("<IIQQQ", fd, 0, ctypes.addressof(kbuf), _addr(value), flags)
    return _bpf(cmd, attr, what)


def map_lookup(fd: int, key: bytes, value_size: int) -> bytes | None:
    """The value under ``key`` (``value_size`` bytes; per-CPU maps: times the possible CPUs)."""
    value = ctypes.create_string_buffer(value_size)
    try:
        _elem(MAP_LOOKUP_ELEM, fd, key, value, 0, "map lookup")
    except BpfError as err:
        if err.errno == errno.ENOENT:
            return None
        raise
    return value.raw


def map_update(fd: int, key: bytes, value: bytes, flags: int = BPF_ANY) -> None:
    vbuf = ctypes.create_string_buffer(value, len(value))
    _elem(MAP_UPDATE_ELEM, fd, key, vbuf, flags, "map update")


def map_delete(fd: int, key: bytes) -> bool:
    """Delete ``key``; False if it was not there."""
    try:
        _elem(MAP_DELETE_ELEM, fd, key, None, 0, "map delete")
    except BpfError as err:
        if err.errno == errno.ENOENT:
            return False
        raise
    return True


def map_keys(fd: int, key_size: int) -> list[bytes]:
    """Every key of a hash or trie map (MAP_GET_NEXT_KEY from no key)."""
    keys: list[bytes] = []
    nxt = ctypes.create_string_buffer(key_size)
    cur: ctypes.Array | None = None
    while True:
        attr = _attr("<IIQQ", fd, 0, _addr(cur), ctypes.addressof(nxt))
        try:
            _bpf(MAP_GET_NEXT_KEY, attr, "map get next key")
        except BpfError as err:
            if err.errno == errno.ENOENT:
                return keys
            raise
        keys.append(nxt.raw)
        cur = ctypes.create_string_buffer(nxt.raw, key_size)
        if len(keys) > 1 << 20:  # a map changing under us faster than we walk it
            return keys


def prog_load(prog_type: int, insns: bytes, license: str, name: str) -> int:
    """Load a program; a verifier rejection raises with the end of the verifier's log."""
    ibuf = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license.encode())
    fmt = "<IIQQIIQII16sII"
    attr = _attr(fmt, prog_type, len(insns) // 8, ctypes.addressof(ibuf), ctypes.addressof(lic),
                 0, 0, 0, 0, 0, _name(name), 0, 0)
    try:
        return _bpf(PROG_LOAD, attr, f"loading program {name}")
    except BpfError as err:
        if err.errno not in (errno.EACCES, errno.EINVAL):
            raise
    # Again with the verifier's log, to say why.
    log = ctypes.create_string_buffer(_LOG_SIZE)
    attr = _attr(fmt, prog_type, len(insns) // 8, ctypes.addressof(ibuf), ctypes.addressof(lic),
                 1, _LOG_SIZE, ctypes.addressof(log), 0, 0, _name(name), 0, 0)
    ret = _syscall(PROG_LOAD, attr)
    if ret >= 0:  # passed with the log on (it should not): take it
        return ret
    err_no = ctypes.get_errno()
    lines = [x for x in log.value.decode(errors="replace").splitlines() if x.strip()]
    raise BpfError(err_no, f"loading program {name}", "verifier: " + " | ".join(lines[-3:]) if lines else "")


def obj_pin(fd: int, path: str) -> None:
    p = ctypes.create_string_buffer(path.encode())
    _bpf(OBJ_PIN, _attr("<QII", ctypes.addressof(p), fd, 0), f"pinning {path}")


def obj_get(path: str) -> int:
    p = ctypes.create_string_buffer(path.encode())
    return _bpf(OBJ_GET, _attr("<QII", ctypes.addressof(p), 0, 0), f"opening pinned {path}")


# struct bpf_map_info (the leading fields) and struct bpf_prog_info (the ones we read).
_MAP_INFO = struct.Struct("<IIIIII16s")
_PROG_INFO_SIZE = 96


def _info(fd: int, size: int) -> bytes:
    buf = ctypes.create_string_buffer(size)
    _bpf(OBJ_GET_INFO_BY_FD, _attr("<IIQ", fd, size, ctypes.addressof(buf)), "object info")
    return buf.raw


def map_info(fd: int) -> dict:
    mtype, mid, key_size, value_size, max_entries, flags, name = _MAP_INFO.unpack_from(_info(fd, 64))
    return {"type": mtype, "id": mid, "key_size": key_size, "value_size": value_size,
            "max_entries": max_entries, "flags": flags, "name": name.rstrip(b"\0").decode()}


def prog_info(fd: int) -> dict:
    raw = _info(fd, _PROG_INFO_SIZE)
    ptype, pid = struct.unpack_from("<II", raw, 0)
    tag = raw[8:16].hex()
    name = raw[64:80].rstrip(b"\0").decode()
    return {"type": ptype, "id": pid, "tag": tag, "name": name}


def prog_fd_by_id(prog_id: int) -> int:
    """A new file descriptor for the loaded program ``prog_id`` (BPF_PROG_GET_FD_BY_ID)."""
    return _bpf(PROG_GET_FD_BY_ID, _attr("<III", prog_id, 0, 0), f"opening program {prog_id}")


# BPF_PROG_ATTACH / BPF_PROG_DETACH: target_ifindex, attach_bpf_fd, attach_type, attach_flags,
# replace_bpf_fd, relative_fd|id, expected_revision.
_ATTACH = "<IIIIIIQ"


def tcx_attach(ifindex: int, attach_type: int, fd: int, replace_fd: int | None = None) -> None:
    """Put program ``fd`` on the device's tcx hook (no qdisc): in place of ``replace_fd``
    (atomically, between two packets), else first in the hook's list.  The attachment
    outlives this process, as a tc filter does, until detached or the device goes."""
    if replace_fd is None:
        attr = _attr(_ATTACH, ifindex, fd, attach_type, BPF_F_BEFORE, 0, 0, 0)
    else:
        attr = _attr(_ATTACH, ifindex, fd, attach_type, BPF_F_REPLACE, replace_fd, 0, 0)
    _bpf(PROG_ATTACH, attr, f"attaching a program to device {ifindex} (tcx)")


def tcx_detach(ifindex: int, attach_type: int, fd: int) -> None:
    _bpf(PROG_DETACH, _attr(_ATTACH, ifindex, fd, attach_type, 0, 0, 0, 0), f"detaching a program from device {ifindex} (tcx)")


def tcx_query(ifindex: int, attach_type: int) -> list[int]:
    """The ids of the programs on the device's tcx hook, in the order they run."""
    # target_ifindex, attach_type, query_flags, attach_flags, prog_ids, count, pad,
    # prog_attach_flags, link_ids, link_attach_flags, revision
    fmt = "<IIIIQIIQQQQ"
    for _ in range(4):  # the list may grow between the two calls
        attr = _attr(fmt, ifindex, attach_type, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        _bpf(PROG_QUERY, attr, f"listing the programs on device {ifindex} (tcx)")
        (count,) = struct.unpack_from("<I", attr, 24)
        if count == 0:
            return []
        ids = (ctypes.c_uint32 * count)()
        attr = _attr(fmt, ifindex, attach_type, 0, 0, ctypes.addressof(ids), count, 0, 0, 0, 0, 0)
        ret = _syscall(PROG_QUERY, attr)
        if ret == 0:
            (got,) = struct.unpack_from("<I", attr, 24)
            return list(ids)[:got]
        if ctypes.get_errno() != errno.ENOSPC:
            raise BpfError(ctypes.get_errno(), f"listing the programs on device {ifindex} (tcx)")
    raise BpfError(errno.EAGAIN, f"listing the programs on device {ifindex} (tcx)", "the list kept changing")


def prog_test_run(fd: int, data: bytes, repeat: int = 1) -> tuple[int, bytes]:
    """Run a program on ``data`` (BPF_PROG_TEST_RUN); returns (its return value, the packet
    as it left)."""
    din = ctypes.create_string_buffer(data, len(data))
    dout = ctypes.create_string_buffer(len(data) + 256)
    attr = _attr("<IIIIQQIIII", fd, 0, len(data), len(dout), ctypes.addressof(din), ctypes.addressof(dout),
                 repeat, 0, 0, 0)
    _bpf(PROG_TEST_RUN, attr, "test run")
    (retval,) = struct.unpack_from("<I", attr, 4)
    (size_out,) = struct.unpack_from("<I", attr, 12)
    return retval, dout.raw[:size_out]


def possible_cpus() -> int:
    """How many values a per-CPU map holds per key: the possible CPUs, not the online ones."""
    try:
        with open("/sys/devices/system/cpu/possible") as f:
            text = f.read().strip()
    except OSError:
        return os.cpu_count() or 1
    count = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]  # struct statfs: 120 bytes


def is_bpffs(path: str) -> bool:
    """True if ``path`` lies on a BPF file system (statfs f_type == BPF_FS_MAGIC)."""
    buf = _Statfs()
    if _libc.statfs(path.encode(), ctypes.byref(buf)) != 0:
        return False
    return (buf.f_type & 0xFFFFFFFF) == BPF_FS_MAGIC
