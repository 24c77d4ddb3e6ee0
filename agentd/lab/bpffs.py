"""A BPF file system for the lab's nodes (and the data-path tests).

Every lab node runs its agent under ``ip netns exec``, which gives the agent a private mount
namespace with a fresh /sys: the machine's /sys/fs/bpf is not there, and a bpffs the agent
mounted itself would vanish with its process -- and the pins with it, which is exactly what
must survive an agent's SIGKILL.  So the lab mounts one bpffs instance of its own, in the
mount namespace it runs in, before it starts any agent: every ``ip netns exec`` copies the
mount, all copies share the one file system, and the pins live until the lab unmounts it
(``down``).  The nodes point ``[agent] bpf_dir`` at it; each agent pins under its own
``netns-<inode>`` directory there.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import time
from pathlib import Path

from agentd.dataplane.bpf.libbpf import is_bpffs
from agentd.lab.netns import list_names

_libc = ctypes.CDLL(None, use_errno=True)
MNT_DETACH = 2


def mount(path: str | os.PathLike, *, owner: int | None = None) -> Path:
    """Mount a new bpffs at ``path`` (made if missing); a no-op if one is there already.
    ``owner``: the process whose file system it is, noted beside it (``<path>.owner``) for
    :func:`sweep_dead` where no lab's ``lab.json`` says whose it is (a test's own)."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        _owner_file(p).write_text(f"{owner}\n")
    if is_bpffs(str(p)) and os.path.ismount(p):
        return p
    if _libc.mount(b"bpf", str(p).encode(), b"bpf", 0, b"mode=0700") != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount -t bpf bpf {p}: {os.strerror(err)}")
    return p


def _owner_file(p: Path) -> Path:
    return p.with_name(p.name + ".owner")


def umount(path: str | os.PathLike) -> None:
    """Unmount the bpffs at ``path`` (pins in it go with it) and remove the directory; idempotent."""
    p = Path(path)
    while os.path.ismount(p) and is_bpffs(str(p)):
        if _libc.umount2(str(p).encode(), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"umount {p}: {os.strerror(err)}")
    with contextlib.suppress(OSError):
        p.rmdir()
    with contextlib.suppress(OSError):
        _owner_file(p).unlink()


def _mount_points(fs_type: str = "bpf") -> list[str]:
    """Where file systems of ``fs_type`` are mounted in this mount namespace (/proc/self/mountinfo,
    its octal escapes undone)."""
    points = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split(" ")
        try:
            sep = fields.index("-")
        except ValueError:
            continue
        if len(fields) > sep + 1 and fields[sep + 1] == fs_type:
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
    return points


def sweep_dead(under: str | os.PathLike, *, min_age: float = 60.0, now: float | None = None) -> list[str]:
    """Unmount lab file systems left behind under ``under`` by labs that are gone: a bpffs at
    ``<lab dir>/bpffs`` whose ``<lab dir>/lab.json`` names a lab with no network namespace left
    (``ad-<name>-*``) and was written more than ``min_age`` seconds ago (a lab being built
    mounts its bpffs just before its namespaces).  A lab whose process was killed (SIGKILL, a
    CI timeout) could not unmount its own, and the pins in it keep programs and maps alive;
    its namespaces outlive it too (their mounts under /run/netns), so the lab counts as gone
    here only once they are removed (``agentd lab down --name``, or by hand).  A lab of the
    same name made meanwhile writes a new ``lab.json`` before it mounts: both are looked at
    again just before the unmount.  A bpffs with no lab beside it but an owner noted
    (:func:`mount`, a test's own) goes once that process is gone.  Returns the mount points
    removed."""
    root = os.path.realpath(under)
    now = time.time() if now is None else now
    removed = []
    for point in _mount_points():
        p = Path(point)
        if p.name != "bpffs" or not (point + "/").startswith(root.rstrip("/") + "/"):
            continue
        if _owner_gone(p):
            with contextlib.suppress(OSError):
                umount(p)
                removed.append(point)
            continue
        state = p.parent / "lab.json"
        try:
            name = json.loads(state.read_text())["spec"]["name"]
            written = state.stat().st_mtime
            age = now - written
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not isinstance(name, str) or not name or age < min_age or list_names(f"ad-{name}-"):
            continue
        try:
            if state.stat().st_mtime != written or list_names(f"ad-{name}-"):
                continue  # a lab of that name is being made there now
            umount(p)
        except OSError:
            continue
        removed.append(point)
    return removed


def _owner_gone(p: Path) -> bool:
    """Whether ``p`` has an owner noted (:func:`mount`) that no longer runs."""
    try:
        pid = int(_owner_file(p).read_text())
    except (OSError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False
