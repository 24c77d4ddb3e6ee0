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
import os
from pathlib import Path

from agentd.dataplane.bpf.libbpf import is_bpffs

_libc = ctypes.CDLL(None, use_errno=True)
MNT_DETACH = 2


def mount(path: str | os.PathLike) -> Path:
    """Mount a new bpffs at ``path`` (made if missing); a no-op if one is there already."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    if is_bpffs(str(p)) and os.path.ismount(p):
        return p
    if _libc.mount(b"bpf", str(p).encode(), b"bpf", 0, b"mode=0700") != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount -t bpf bpf {p}: {os.strerror(err)}")
    return p


def umount(path: str | os.PathLike) -> None:
    """Unmount the bpffs at ``path`` (pins in it go with it) and remove the directory; idempotent."""
    p = Path(path)
    while os.path.ismount(p) and is_bpffs(str(p)):
        if _libc.umount2(str(p).encode(), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"umount {p}: {os.strerror(err)}")
    with contextlib.suppress(OSError):
        p.rmdir()
