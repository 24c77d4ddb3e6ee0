"""Traffic probes for the lab tests: a pinger that is read while it runs.

``Pinger`` runs ``ping -i INTERVAL`` inside a namespace and records every ``icmp_seq`` that
was answered, so a test can wait for replies (instead of sleeping while pings go out) and
count losses by sequence number.  A request is missing only if one sent after it was
answered: with the round trip longer than the interval, several requests may still be on
their way when ping stops, and they are not losses.  So a test waits for fresh replies after
the disruption before stopping (every request sent during it is then below the highest
answered, and checked)::

    pinger = Pinger(pod.ns, other_pod_ip)
    try:
        pinger.wait_replies(10)          # traffic flows before the disruption
        ...disrupt and recover...
        pinger.wait_replies(10, more=True)
        sent, missing = pinger.stop()
        assert not missing
    finally:
        pinger.close()
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading

from agentd.lab.netns import Netns
from agentd.lab.wait import DEFAULT_TIMEOUT, until

_REPLY = re.compile(r"icmp_seq=(\d+) ttl=")
_SUMMARY = re.compile(r"(\d+) packets transmitted, (\d+) received")


def unanswered(sent: int, answered: set[int]) -> set[int]:
    """The icmp_seq numbers (from 1) lost out of ``sent`` requests of which ``answered`` came
    back: those below the highest answered that never were.  Any after it may still have
    been on their way when ping stopped; with nothing answered, every one sent is lost."""
    return set(range(1, max(answered, default=sent + 1))) - answered


class Pinger:
    """``ping -D -n -i interval -W 1 dst`` in ``ns``; its output is read by a thread as it
    comes (``-D``: each line with its time, to set beside the agents' logs)."""

    def __init__(self, ns: Netns, dst_ip: str, interval: float = 0.05) -> None:
        self.dst_ip = dst_ip
        self.answered: set[int] = set()
        self.lines: list[str] = []
        self.proc = ns.popen(["ping", "-D", "-n", "-i", str(interval), "-W", "1", dst_ip],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, name=f"ping {dst_ip}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := _REPLY.search(line):
                self.answered.add(int(m.group(1)))

    def trouble(self, limit: int = 10) -> list[str]:
        """The first ``limit`` lines of ping's output that are not an echo reply, its header or
        its summary: an ICMP error ("From 10.244.1.1 icmp_seq=12 Destination Net Unreachable"),
        a reply's duplicate or a word of ping's own -- what a lost echo's assertion should show."""
        return [line.strip() for line in self.lines
                if not _REPLY.search(line) and not line.startswith(("PING ", "---", "rtt "))
                and "packets transmitted" not in line and line.strip()][:limit]

    def replies(self) -> int:
        return len(self.answered)

    def wait_replies(self, count: int, timeout: float = DEFAULT_TIMEOUT, *, more: bool = False) -> None:
        """Wait until ``count`` echo replies have come back (``more``: ``count`` more than now)."""
        want = count + (len(self.answered) if more else 0)
        until(lambda: len(self.answered) >= want, timeout,
              what=lambda: f"{want} replies from {self.dst_ip} (have {len(self.answered)}): {self.lines[-3:]}",
              abort=lambda: self.proc.poll() is not None and f"ping exited {self.proc.returncode}: {self.lines[-5:]}")

    def stop(self) -> tuple[int, set[int]]:
        """SIGINT, then ``(echo requests sent, icmp_seq numbers never answered)``.  Only the
        numbers below the highest one answered count: those after it may still have been on
        their way when ping stopped (one or more, as the round trip is shorter or longer than
        the interval).  Nothing answered at all: every request sent is missing."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        self.proc.wait(10)
        self._reader.join(10)
        out = "".join(self.lines)
        m = _SUMMARY.search(out)
        assert m, out[-500:]
        sent = int(m.group(1))
        return sent, unanswered(sent, self.answered)

    def close(self) -> None:
        """Kill and reap ping if it still runs; idempotent (for ``finally`` blocks)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
