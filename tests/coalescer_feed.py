"""The user-space worker's receive side fed as recvmmsg fills it: shared by the unit tests of
its IPv4 and IPv6 coalescing (pure: no root, no sockets)."""

from __future__ import annotations

import numpy as np

from agentd.dataplane._gro import Coalescer
from proto import packet as P


def batch_writes(packets, chunks, stride=2048):
    """Feed ``packets`` to one Coalescer in batches of the given sizes (2 KB slots, like
    recvmmsg); a batch add_batch refuses goes packet by packet.  Returns the writes (virtio
    header, packet) and how many batches were taken whole."""
    writes = []

    def write(parts):
        blob = b"".join(bytes(p) for p in parts)
        writes.append((P.VirtioNetHdr.decode(blob), blob[10:]))

    c = Coalescer(write)
    i = 0
    for size in chunks:
        chunk = packets[i : i + size]
        i += size
        if not chunk:
            break
        buf = bytearray(stride * len(chunk))
        for j, p in enumerate(chunk):
            buf[j * stride : j * stride + len(p)] = p
        if not c.add_batch(np.frombuffer(buf, np.uint8), 0, stride, np.array([len(p) for p in chunk])):
            for p in chunk:
                c.add(memoryview(p))
    for p in packets[i:]:
        c.add(memoryview(p))
    c.flush()
    return writes, c.batches
