"""systemd's notify protocol (sd_notify(3)), without libsystemd.

``Type=notify`` units get ``NOTIFY_SOCKET`` in their environment: a unix datagram
socket (a leading ``@`` means the abstract namespace).  We send ``READY=1`` once the
agent is ready, ``WATCHDOG=1`` every half ``WATCHDOG_USEC`` while the event loop
runs, ``STATUS=...`` lines for ``systemctl status``, and ``STOPPING=1`` on shutdown.
Without NOTIFY_SOCKET every call is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from agentd.digits import whole_number

log = logging.getLogger("agentd.sdnotify")


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET") or ""
        if path.startswith("@"):
            path = "\0" + path[1:]
        self._address = path or None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        self.watchdog_interval: float | None = None
        timeout = whole_number(usec or "", 20)  # a 64-bit number's digits at most
        if timeout and (not pid or pid == str(os.getpid())):
            self.watchdog_interval = timeout / 1e6 / 2  # sd_watchdog_enabled(3): ping at half the timeout
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *lines: str) -> bool:
        if self._address is None:
            return False
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.sendto("\n".join(lines).encode(), self._address)
            return True
        except OSError as err:
            log.warning("sd_notify to %r failed: %s", self._address, err)
            return False

    def ready(self, status: str = "") -> None:
        self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def stopping(self) -> None:
        self.notify("STOPPING=1")

    def extend_timeout(self, seconds: float) -> None:
        """The stop (or start) may take ``seconds`` more from now (sd_notify EXTEND_TIMEOUT_USEC):
        past TimeoutStopSec without it, systemd kills the agent and Restart= starts it again."""
        self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    async def watchdog_loop(self) -> None:
        """Ping the watchdog for as long as the event loop keeps running this task."""
        if self.watchdog_interval is None or self._address is None:
            return
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_interval)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
