"""Starting libFuzzer on a harness, shared by the targets."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable

import atheris


def fuzz(argv: list[str], script: str, test_one_input: Callable[[bytes], None], max_len: int) -> None:
    """Run libFuzzer with ``argv``; ``-max_len`` defaults to ``max_len``.

    libFuzzer re-runs argv[0] through the shell for -merge, -fork and -jobs: it is made the
    interpreter and the script, so those modes work without the script being executable.
    """
    command = f"{shlex.quote(sys.executable)} {shlex.quote(os.path.abspath(script))}"
    args = [command, *argv[1:]]
    if not any(a.startswith("-max_len=") for a in args):
        args.append(f"-max_len={max_len}")
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()
