"""The one way the lab and the system tests run a daemon: :class:`LabProcess`.

BIRD (agentd.lab.bird), ``agentd speaker`` (speaker_proc), the BFD process (bfd_proc),
GoBGP (gobgp) and etcd (etcd) are each a subclass that says how to start it (its argv) and
how to tell it is ready; this base does the rest the same way for all of them:

* started inside a lab namespace (or, with ``ns=None``, here), in a session of its own, with
  its output appended to a file in its work directory behind a ``--- agentd lab: starting ...``
  line;
* waited for with a deadline (:meth:`LabProcess.wait_until`), and a wait gives up at once,
  with the end of the log, when the process has exited;
* stopped with SIGCONT (a frozen process cannot act on SIGTERM), SIGTERM, and SIGKILL after
  a grace period (:meth:`LabProcess.stop`), or killed at once (:meth:`LabProcess.kill`);
  either way it is reaped and its log closed, and both are idempotent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from agentd.lab.netns import Netns, stop_process, tied
from agentd.lab.wait import until

STOP_GRACE = 10.0
KILL_WAIT = 5.0
LOG_TAIL_LINES = 40


class LabProcessError(RuntimeError):
    """A lab process could not be started, stopped or queried; the message carries its log tail."""


class LabProcess:
    """One daemon in a lab namespace.  Subclasses set :attr:`label` and :attr:`error` and call
    :meth:`spawn` from their ``start``."""

    label = "process"  #: what messages call it ("bird", "agentd speaker", ...)
    error: type[Exception] = LabProcessError  #: raised when a start or a wait fails

    def __init__(self, ns: Netns | None, output_path: str | os.PathLike[str]) -> None:
        self.ns = ns
        self.output_path = Path(output_path)  #: its stdout and stderr, appended run after run
        self.output_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = self.output_path  #: its log (a daemon that writes its own says where)
        self._proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    def __repr__(self) -> str:
        where = self.ns.name if self.ns is not None else "here"
        return f"{type(self).__name__}({where}, pid={self.pid})"

    # ------------------------------------------------------------ state

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------ lifecycle

    def spawn(self, argv: Sequence[str]) -> None:
        """Start ``argv`` (returns at once; then wait for readiness with :meth:`wait_until`)."""
        self._close_log()
        self._log = open(self.output_path, "ab")  # noqa: SIM115 - kept open while the process runs
        self._log.write(f"--- agentd lab: starting {self.label} at {time.ctime()} ---\n".encode())
        self._log.flush()
        kwargs: dict[str, Any] = dict(stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)  # fmt: skip
        # In a test run, tied to it (agentd.lab.netns.tie_children_to_this_process): it dies with
        # the run even when the run is SIGKILLed and stops nothing.
        self._proc = self.ns.popen(list(argv), **kwargs) if self.ns is not None else subprocess.Popen(argv, **tied(kwargs))

    def stop(self, timeout: float = STOP_GRACE) -> int | None:
        """SIGCONT, SIGTERM and wait; SIGKILL after ``timeout``.  Returns the exit status."""
        proc = self._proc
        if proc is None:
            return None
        code = stop_process(proc, timeout)
        self._forget()
        return code

    def kill(self) -> None:
        """SIGKILL (a crash: the kernel closes its sockets) and wait."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(KILL_WAIT)
        self._forget()

    def signal(self, sig: int) -> None:
        if not self.running:
            raise self.error(f"{self.label} is not running (signal {sig}):\n{self.log_tail()}")
        assert self._proc is not None
        self._proc.send_signal(sig)

    def freeze(self) -> None:
        """SIGSTOP: its sockets stay open but it neither reads, sends nor times out (a hung router)."""
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    # ------------------------------------------------------------ waiting

    def exited(self) -> str | None:
        """None while it runs (or was never started); else what to say about its exit."""
        if self._proc is None or self._proc.poll() is None:
            return None
        return f"{self.label} exited with status {self._proc.returncode}:\n{self.log_tail()}"

    def wait_until(self, predicate: Callable[[], Any], timeout: float, *, what: str | Callable[[], str] = "condition",
                   interval: float = 0.1, ignore: tuple[type[BaseException], ...] = ()) -> Any:
        """Poll ``predicate`` until it returns something truthy (returned); :attr:`error`, with
        the end of the log, on timeout or as soon as the process exits."""
        return until(predicate, timeout, interval=interval, ignore=ignore, abort=self.exited, error=self.error,
                     what=lambda: f"{what() if callable(what) else what}\n{self.log_tail()}")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with open(self.output_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    # ------------------------------------------------------------ internals

    def _forget(self) -> None:
        self._proc = None
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
