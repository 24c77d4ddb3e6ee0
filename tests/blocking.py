"""A call that must not block: files that are no regular files (a FIFO nobody writes, /dev/zero)
handed to a reader, checked from a thread with a bound (the unit tests of the token and subnet
files and of check-config; pure)."""

from __future__ import annotations

import os
import threading
from typing import Any


class Raised:
    """What a call raised (``within`` returns it instead of the call's value)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def within(seconds: float, call: Any, *args: Any) -> Any:
    """``call(*args)``'s value, or :class:`Raised` with its exception, which must come within
    ``seconds``: a call still blocked then fails the test (its daemon thread is left; the
    caller's :func:`unblock` of the FIFO lets it end)."""
    done: list[Any] = []

    def run() -> None:
        try:
            done.append(call(*args))
        except BaseException as err:  # noqa: BLE001 -- handed to the test (SystemExit too)
            done.append(Raised(err))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(call, '__name__', call)} still blocked after {seconds} s"
    return done[0]


def unblock(fifo: str | os.PathLike[str]) -> None:
    """Let a reader blocked opening ``fifo`` go on: a writer opens it and closes it (EOF)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader waiting (ENXIO)
        pass
