"""The in-kernel data path: tc-BPF encapsulation for the udp and ipip backends, and the cluster
member filter for udp, ipip and VXLAN (datapath.c); the pod fast path (podpath.c).  libbpf
loads the objects (libbpf.py: ctypes over the system's libbpf.so.1); the agent pins, attaches
(tc.py: tcx or clsact, through rtnetlink) and fills the maps.  See datapath.py for the pin
layout."""

from . import layout, libbpf
from .datapath import (
    DEFAULT_BPF_DIR,
    OBJECT,
    BpfDatapath,
    BpfUnavailable,
    for_log,
    pin_dir,
    remove_pinned,
)
from .layout import Config

__all__ = ["DEFAULT_BPF_DIR", "OBJECT", "BpfDatapath", "BpfUnavailable", "Config", "for_log", "layout", "libbpf",
           "pin_dir", "remove_pinned"]
