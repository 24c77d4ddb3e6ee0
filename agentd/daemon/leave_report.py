"""What ``agentd leave`` did, step by step, and how it reads to an operator.

A leave is a list of steps (leaving etcd, closing the BGP sessions, removing the kernel
routes, the nftables tables, the BPF data path, the devices, the state files, ...), each
``done``, ``failed`` with the reason, or ``skipped`` with why (a part this host never ran).
The running agent keeps one :class:`LeaveReport` while it leaves: ``GET /leave`` serves it
while the API is up, and it is written to ``<state_dir>/leave.json`` after every step -- a
new file renamed over the old one, so a reader sees a whole report, never half of one --
since the agent exits at the end of a leave and ``agentd leave`` reads the last steps there.
``agentd leave`` with no agent running fills in the same report.

Pure: no asyncio, no sockets; :func:`write_report` and :func:`read_report` are the only IO.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DONE, FAILED, SKIPPED = "done", "failed", "skipped"
RESULTS = (DONE, FAILED, SKIPPED)
REPORT_FILE = "leave.json"  # in [agent] state_dir


class StepSkipped(Exception):  # a step's outcome, not an error
    """Raised by a leave step that had nothing to do here; the message says why."""


class ReportError(ValueError):
    """A report file (or GET /leave answer) that cannot be read or is not a report; one line.
    ``missing``: there is no file (yet): a leave writes one soon, unlike one it cannot read."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class LeaveStep:
    name: str
    result: str  # DONE, FAILED or SKIPPED
    reason: str = ""  # why it failed, or why it was skipped

    def line(self) -> str:
        """``NAME: done``, ``NAME: failed: REASON``, ``NAME: skipped: WHY``."""
        return f"{self.name}: {self.result}" + (f": {self.reason}" if self.reason else "")


@dataclass
class LeaveReport:
    """``id``: this leave's (POST /leave answers with it, so ``agentd leave`` never takes an
    older leave's file for this one); ``agent``: a running agent left (False: ``agentd leave``
    with none); ``finished``: every step has run (the agent exits next)."""

    node: str
    id: str
    agent: bool = True
    steps: list[LeaveStep] = field(default_factory=list)
    finished: bool = False

    def done(self, name: str) -> None:
        self.steps.append(LeaveStep(name, DONE))

    def failed(self, name: str, reason: str) -> None:
        self.steps.append(LeaveStep(name, FAILED, reason or "unknown error"))

    def skipped(self, name: str, why: str) -> None:
        self.steps.append(LeaveStep(name, SKIPPED, why))

    def failures(self) -> list[LeaveStep]:
        return [s for s in self.steps if s.result == FAILED]

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "id": self.id, "agent": self.agent, "finished": self.finished,
                "steps": [{"name": s.name, "result": s.result, "reason": s.reason} for s in self.steps]}

    @classmethod
    def from_json(cls, data: Any) -> LeaveReport:
        """The report ``to_json`` made; :class:`ReportError` for anything else."""
        try:
            steps = [LeaveStep(str(s["name"]), s["result"], str(s.get("reason") or "")) for s in data["steps"]]
            report = cls(str(data["node"]), str(data["id"]), bool(data.get("agent", True)), steps,
                         data["finished"] is True)
        except (KeyError, TypeError, AttributeError):
            raise ReportError("not a leave report (node, id, finished and steps expected)") from None
        bad = [s.result for s in steps if s.result not in RESULTS]
        if bad:
            raise ReportError(f"not a leave report (a step's result is {bad[0]!r}, not one of {', '.join(RESULTS)})")
        return report


def summary(report: LeaveReport) -> str:
    """The last line ``agentd leave`` prints."""
    failed = report.failures()
    counts = ", ".join(f"{n} {r}" for r in RESULTS if (n := sum(s.result == r for s in report.steps)))
    if not report.finished:
        last = report.steps[-1].name if report.steps else "none"
        return f"node {report.node}: the leave did not finish ({counts or 'no step done'}; last step: {last})"
    if failed:
        return (f"node {report.node} left, but not cleanly: {', '.join(s.name for s in failed)} failed ({counts}); "
                "fix what the reasons say and run `agentd leave` again")
    return f"node {report.node} left the cluster and this host is cleaned up ({counts})"


def exit_code(report: LeaveReport) -> int:
    """0 only when every step ran and none failed."""
    return 0 if report.finished and not report.failures() else 1


def render(report: LeaveReport) -> str:
    """Every step's line, then the summary."""
    return "".join(f"{s.line()}\n" for s in report.steps) + summary(report) + "\n"


def write_report(path: Path, report: LeaveReport) -> None:
    """Atomically: a new file (mode 0644: a leave's steps are no secret, and ``agentd leave``
    may run as a member of ``[api] token_group``) renamed over the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(report.to_json(), f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # whatever the umask took away
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_report(path: Path) -> LeaveReport:
    """The report at ``path``; :class:`ReportError` saying why not."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ReportError(f"there is no leave report at {path}", missing=True) from None
    except OSError as err:
        raise ReportError(f"cannot read the leave report {path}: {err.strerror or err}") from None
    try:
        return LeaveReport.from_json(json.loads(text))
    except ValueError as err:  # ReportError is one too
        msg = str(err) if isinstance(err, ReportError) else "not JSON"
        raise ReportError(f"{path}: {msg}") from None
