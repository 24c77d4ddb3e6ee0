"""Entering a named network namespace from this thread (setns(2) through ctypes).

The agent itself runs in one namespace; the route programmer can be pointed at another
(``RouteProgrammer(netns=NAME)``, used by the lab and tests) and opens its netlink sockets
there.  Sockets opened inside :func:`entered` stay bound to the namespace after it ends.
The lab's ``Netns.entered`` is this same helper.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

NETNS_DIR = "/var/run/netns"  # where ``ip netns add`` binds named namespaces
CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


def netns_path(name: str) -> str:
    """The bind mount of the named namespace ``name``."""
    return f"{NETNS_DIR}/{name}"


@contextlib.contextmanager
def entered(path: str) -> Iterator[None]:
    """Run the block with the *calling thread* inside the namespace bound at ``path``.

    Keep the block short and free of awaits: the whole thread moves."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(path, os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")
