"""The in-kernel data path: tc-BPF encapsulation for the udp and ipip backends, and the cluster
member filter for udp, ipip and VXLAN (datapath.c), loaded and attached by the agent itself
through the bpf() system call and rtnetlink.  See datapath.py for the pin layout."""

from . import elf, layout
from .datapath import (
    DEFAULT_BPF_DIR,
    OBJECT,
    BpfDatapath,
    BpfUnavailable,
    pin_dir,
    remove_pinned,
)
from .layout import Config

__all__ = ["DEFAULT_BPF_DIR", "OBJECT", "BpfDatapath", "BpfUnavailable", "Config", "elf", "layout", "pin_dir", "remove_pinned"]
