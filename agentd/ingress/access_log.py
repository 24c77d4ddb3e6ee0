"""The ingress access log in a file of its own (``[ingress] access_log = "/path"``).

HAProxy sends a line per request to the agent's datagram socket (:class:`agentd.ingress.proxy.AccessLog`);
with a file configured the socket's reader hands each batch of lines to a :class:`FileWriter`,
whose thread appends them: a slow or full disk holds up that thread, never the event loop.

* **appended**, one line per request, to a file opened with ``O_APPEND`` (mode 0640 when the
  agent creates it), so ``copytruncate`` rotation works as it is;
* **opened again** on SIGHUP (:meth:`FileWriter.reopen`: the file is closed at once, before the
  next line) and when the path no longer names the open file -- renamed away or deleted, the
  way logrotate's default ``create`` rotates -- which is checked at most once a second, as a
  line is written (``stat`` of the path against ``fstat`` of the open file): logrotate needs
  no ``postrotate`` for it;
* **never in the way**: a file that cannot be opened or written (a full disk, a read-only or
  missing directory) drops its lines, says so once, then at most once a minute with the
  count of lines dropped, and once more when writing works again; it is tried again at most
  once a second.  The lines waiting for the thread are bounded (:data:`QUEUE_LIMIT` bytes):
  past that, new ones are dropped and counted the same way.

:class:`AccessFile` is the file's part without the thread (time passed in): what the unit
tests drive.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("agentd.ingress")

CHECK_EVERY = 1.0  # seconds: how often the path is compared with the open file, and a failed open tried again
WARN_EVERY = 60.0  # seconds between two warnings of a file that cannot be written
QUEUE_LIMIT = 8 << 20  # bytes of lines waiting for the writer thread; past it new lines are dropped
MODE = 0o640
_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK  # (NONBLOCK: a FIFO's open returns)


def _why(err: OSError) -> str:
    return err.strerror or str(err) or type(err).__name__


class AccessFile:
    """One access log file: :meth:`write` appends lines (each ends with a newline), opening
    the file again when its path names another file or none, and warns -- rate-limited --
    when it cannot."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.fd: int | None = None
        self.opened: tuple[int, int] | None = None  # (st_dev, st_ino) of the open file
        self.checked_at = float("-inf")  # when the path was last compared with the open file (or an open failed)
        self.failing: str | None = None  # why the last write or open failed; None: writing works
        self.warned_at = float("-inf")
        self.dropped = 0  # lines dropped since the last warning
        self.dropped_total = 0
        self.written = 0  # lines written
        self._cut = False  # a write failed midway: the next one starts on a line of its own
        self._behind = 0  # lines dropped before the file (dropped_elsewhere) since its last warning
        self._behind_warned_at = float("-inf")

    def write(self, data: bytes, now: float, lines: int | None = None) -> bool:
        """Append ``data`` (whole lines); False if they were dropped.  ``lines``: how many
        lines ``data`` holds (counted if not given)."""
        count = data.count(b"\n") if lines is None else lines
        if self.fd is not None and now - self.checked_at >= CHECK_EVERY:
            self.checked_at = now
            if not self._still_the_file():
                log.info("ingress: access log %s was moved away or deleted: opening it again", self.path)
                self.close()
        if self.fd is None:
            if self.failing is not None and now - self.checked_at < CHECK_EVERY:
                self._drop(count, self.failing, now)
                return False
            self.checked_at = now
            try:
                self._open()
            except OSError as err:
                self._drop(count, f"cannot open it: {_why(err)}", now)
                return False
        if self._cut:
            data = b"\n" + data
        try:
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)  # type: ignore[arg-type]
                view = view[n:]
        except OSError as err:  # ENOSPC, EIO, EDQUOT; EAGAIN of a FIFO nobody reads
            self._cut = self._cut or len(view) != len(data)
            self._drop(count, f"cannot write it: {_why(err)}", now)
            self.close()  # opened again (at most once a second) for the next lines
            return False
        self._cut = False
        self.written += count
        if self.failing is not None:
            log.warning("ingress: access log %s: writing again (%d lines dropped since the last warning)", self.path,
                        self.dropped)  # fmt: skip
            self.failing, self.dropped, self.warned_at = None, 0, float("-inf")
        return True

    def dropped_elsewhere(self, count: int, why: str, now: float) -> None:
        """Lines that never reached the file (the writer thread fell behind): counted, and
        warned about at most once a minute."""
        self.dropped_total += count
        self._behind += count
        if now - self._behind_warned_at >= WARN_EVERY:
            log.warning("ingress: access log %s: %s: %d lines dropped (said at most once a minute)", self.path, why,
                        self._behind)  # fmt: skip
            self._behind, self._behind_warned_at = 0, now

    def _drop(self, count: int, why: str, now: float) -> None:
        self.dropped += count
        self.dropped_total += count
        first = self.failing is None
        self.failing = why
        if first or now - self.warned_at >= WARN_EVERY:
            if first:
                log.warning("ingress: access log %s: %s; its lines are dropped until it works again "
                            "(said again at most once a minute)", self.path, why)  # fmt: skip
            else:
                log.warning("ingress: access log %s: %s; %d lines dropped since the last warning", self.path, why,
                            self.dropped)  # fmt: skip
            self.warned_at = now
            self.dropped = 0

    def _open(self) -> None:
        fd = os.open(self.path, _FLAGS, MODE)
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        self.fd, self.opened = fd, (st.st_dev, st.st_ino)
        if st.st_size == 0:  # a new file: no line of the old one to end
            self._cut = False

    def _still_the_file(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:  # gone (or unreachable): open it again, which says why if it cannot
            return False
        return (st.st_dev, st.st_ino) == self.opened

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd, self.opened = None, None


_REOPEN = object()
_STOP = object()


class FileWriter:
    """An :class:`AccessFile` written by a thread of its own: :meth:`put` (from the event
    loop) only queues, under a lock held for a deque append."""

    def __init__(self, path: Path | str, limit: int = QUEUE_LIMIT) -> None:
        self.file = AccessFile(path)
        self.limit = limit
        self._items: collections.deque[object] = collections.deque()
        self._queued = 0  # bytes in _items
        self._overflow = 0  # lines dropped by put() that the thread has not counted yet
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> Path:
        return self.file.path

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ingress-access-log", daemon=True)
            self._thread.start()

    def put(self, lines: list[bytes]) -> None:
        """Queue ``lines`` (each without its newline, or with one)."""
        data = b"".join(line.rstrip(b"\n") + b"\n" for line in lines)
        with self._cond:
            if self._queued + len(data) > self.limit:
                self._overflow += len(lines)
            else:
                self._items.append((data, len(lines)))
                self._queued += len(data)
            self._cond.notify()

    def reopen(self) -> None:
        """SIGHUP: close the file now (in the thread, in order) and open it again for the next line."""
        self._send(_REOPEN)

    def stop(self, timeout: float = 5.0) -> None:
        """Write what is queued, close the file, end the thread (blocking: from a thread)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._send(_STOP)
            thread.join(timeout)
        else:
            self.file.close()

    def _send(self, item: object) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._overflow:
                    self._cond.wait()
                items = list(self._items)
                self._items.clear()
                self._queued = 0
                overflow, self._overflow = self._overflow, 0
            now = time.monotonic()
            if overflow:
                self.file.dropped_elsewhere(overflow, "the disk does not keep up with the lines", now)
            for item in items:
                if item is _STOP:
                    self.file.close()
                    return
                if item is _REOPEN:
                    self.file.close()
                    continue
                data, count = item  # type: ignore[misc]
                self.file.write(data, now, count)
