"""Builds the data plane's compiled parts; everything else is in pyproject.toml.

* agentd/dataplane/_fastpath.c: the user-space worker's C loops (a CPython extension; optional,
  /status says what runs where it is not built).
* agentd/kernel/_ctevents.c: the flow recorder's per-event loop over conntrack events (a CPython
  extension; optional: the recorder's Python loop does the same where it is not built).
* agentd/dataplane/bpf/datapath.c: the in-kernel data path, compiled with clang for the BPF
  target into datapath.bpf.o, which the agent loads through libbpf (optional: without clang
  there is no object and udp/ipip fall back to the user-space worker, saying so).
* agentd/dataplane/bpf/podpath.c: the pod fast path, into podpath.bpf.o: its reads of
  conntrack's struct nf_conn are CO-RE relocations and its kfunc calls are resolved by libbpf
  (optional: without it pod traffic takes the stack's path, saying so).

Both are standard libbpf objects (BTF-defined maps in ``.maps``, so both carry BTF: -g), which
``bpftool prog loadall`` loads as well.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# (source, object, extra clang flags); -g: BTF, which BTF-defined maps and CO-RE need
BPF_PROGRAMS = (
    (Path("agentd/dataplane/bpf/datapath.c"), "agentd/dataplane/bpf/datapath.bpf.o", ("-g",)),
    (Path("agentd/dataplane/bpf/podpath.c"), "agentd/dataplane/bpf/podpath.bpf.o", ("-g",)),
)


def _clang() -> str | None:
    for name in (os.environ.get("AGENTD_BPF_CC"), "clang-16", "clang", "clang-15", "clang-14"):
        if name and shutil.which(name):
            return name
    return None


def _multiarch_include() -> list[str]:
    """asm/ headers live under the host's multiarch directory, which clang -target bpf does not search."""
    try:
        arch = subprocess.run(["gcc", "-print-multiarch"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return []
    return [f"-I/usr/include/{arch}"] if arch else []


class BuildWithBpf(build_ext):
    def run(self) -> None:
        super().run()
        clang = _clang()
        if clang is None:
            print("warning: no clang: the BPF data path is not built (udp/ipip use the user-space worker)",
                  file=sys.stderr)
            return
        for source, obj, flags in BPF_PROGRAMS:
            out = Path(obj if self.inplace else os.path.join(self.build_lib, obj))
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = [clang, "-O2", *flags, "-target", "bpf", "-mcpu=v3", "-Wall", "-Werror", *_multiarch_include(),
                   "-c", str(source), "-o", str(out)]
            print(" ".join(cmd))
            result = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                print(f"warning: building {source} failed:\n{result.stderr}", file=sys.stderr)


setup(
    cmdclass={"build_ext": BuildWithBpf},
    ext_modules=[
        Extension(
            "agentd.dataplane._fastpath",
            ["agentd/dataplane/_fastpath.c"],
            extra_compile_args=["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
        Extension(
            "agentd.kernel._ctevents",
            ["agentd/kernel/_ctevents.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
    ],
)
