"""The datastore's connection to etcd: one client at a time, retries with backoff, failover
to the next member of the cluster, and the reachable/unreachable state.

Every request of the datastore goes through ``call()``: transient failures (a member down or
cut off from its leader, agentd.datastore.etcd says which) move to the next endpoint and
are retried with capped exponential backoff until the caller's deadline; anything else is
raised at once.  Time comes from the ``clock`` given (deadlines) and asyncio (sleeps).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from agentd.datastore.etcd import (
    Endpoint,
    EtcdClient,
    describe,
    is_transient,
    tls_credentials,
)
from agentd.datastore.records import Backoff, DatastoreError, DatastoreUnavailable, clip

if TYPE_CHECKING:
    import grpc

log = logging.getLogger("agentd.datastore")

T = TypeVar("T")
StateCallback = Callable[[bool], Any]


class EtcdConnection:
    """The client requests go to, its failover, and the callbacks the datastore runs.
    ``endpoints``: the members of one etcd cluster (agentd.datastore.etcd.parse_endpoint).

    ``state_callback()`` returns the callback to run when etcd becomes reachable or
    unreachable (read at each change, so the owner may set it at any time)."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        *,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        clock: Callable[[], float],
        request_timeout: float,
        rng: random.Random,
        state_callback: Callable[[], StateCallback | None] = lambda: None,
    ) -> None:
        self.targets = list(endpoints)
        if not self.targets:
            raise ValueError("etcd endpoints: at least one endpoint is needed")
        if not request_timeout > 0:
            raise ValueError(f"etcd request_timeout must be > 0, got {request_timeout!r}")
        self.request_timeout = float(request_timeout)
        tls = any(e.tls for e in self.targets)
        if (ca or cert or key) and not tls:
            raise ValueError("etcd TLS: ca/cert/key are set but no endpoint is https://")
        # Read at start (a bad file is one line then) and again by new_client when one of the
        # files changed since (a certificate renewed in place): every reconnect uses the newest.
        self._tls_files = (ca, cert, key) if tls else None
        self._tls_stamp = self._tls_stat()
        self._credentials = tls_credentials(ca, cert, key) if tls else None
        self.clock = clock
        self.rng = rng
        self.state_callback = state_callback
        self.state: bool | None = None  # None: not tried yet
        self.closed = False
        # Start at a random member, so that the agents of a cluster spread over its members.
        self.index = rng.randrange(len(self.targets))
        self._current: EtcdClient | None = None
        self._retiring: set[asyncio.Task] = set()
        self.watch_clients: set[EtcdClient] = set()
        self._callback_tasks: set[asyncio.Task] = set()
        self._reported_bad: set[tuple[bytes, int]] = set()

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.targets]

    @property
    def endpoint(self) -> str:
        """The endpoint requests go to now (after a transient failure: the next one)."""
        return self.targets[self.index % len(self.targets)].url

    def client(self) -> EtcdClient:
        if self.closed:
            raise DatastoreError("the datastore is closed")
        if self._current is None:
            self._current = self.new_client(self.index)
        return self._current

    def new_client(self, index: int) -> EtcdClient:
        endpoint = self.targets[index % len(self.targets)]
        credentials = self._tls_current() if endpoint.tls else None
        return EtcdClient(endpoint, timeout=self.request_timeout, credentials=credentials)

    def _tls_stat(self) -> tuple[tuple[int, int, int] | None, ...] | None:
        """What tells a TLS file changed (its mtime, size, inode; None: not readable now)."""
        if self._tls_files is None:
            return None
        out = []
        for path in self._tls_files:
            try:
                st = os.stat(path) if path is not None else None
            except OSError:
                st = None
            out.append(None if st is None else (st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def _tls_current(self) -> grpc.ChannelCredentials | None:
        """The TLS credentials, read again if a file changed since they were read.  A file that
        cannot be read now (mid-renewal) keeps the ones loaded (logged once per change)."""
        stamp = self._tls_stat()
        if stamp != self._tls_stamp and self._tls_files is not None:
            self._tls_stamp = stamp
            try:
                self._credentials = tls_credentials(*self._tls_files)
            except ValueError as err:
                log.warning("etcd TLS files changed but cannot be read: %s; keeping the ones read before", err)
            else:
                log.info("etcd TLS files changed: read again (used from the next connection)")
        return self._credentials

    def failover(self, client: EtcdClient) -> None:
        """After a transient failure, move to the next endpoint (if there is one).  With one, a
        new client all the same if its TLS credentials are not the current files' (a renewed
        certificate: the old client's channel would reconnect with the expired one for ever).
        Decided per client: a watch's new client may have read the renewed files first."""
        if self._current is not client:
            return
        if len(self.targets) >= 2:
            self.index += 1
        elif self._tls_files is None or client._credentials is self._tls_current():
            return
        self._current = None
        # Other coroutines may still be using the old client: close it a little later.
        task = asyncio.get_running_loop().create_task(self._close_later(client))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _close_later(self, client: EtcdClient) -> None:
        try:
            await asyncio.sleep(2 * self.request_timeout)
        finally:
            await close_quietly(client)

    async def shut(self) -> None:
        """Close every client (``closed`` is set already): the last part of Datastore.close()."""
        if self.state:
            self.state = False
            self.notify("on_state_change", self.state_callback(), False)
        if self._callback_tasks:
            await asyncio.wait(list(self._callback_tasks), timeout=1.0)
        clients = [c for c in (self._current, *self.watch_clients) if c is not None]
        self._current = None
        for task in list(self._retiring) + list(self._callback_tasks):
            task.cancel()
        await asyncio.gather(*self._retiring, *self._callback_tasks, return_exceptions=True)
        await asyncio.gather(*(close_quietly(c) for c in clients))

    def set_connected(self, up: bool, reason: str = "") -> None:
        if up is self.state or self.closed:
            return
        self.state = up
        if up:
            log.info("etcd reachable at %s", ", ".join(self.urls))
        else:
            log.warning("etcd unreachable at %s (%s); retrying with backoff", ", ".join(self.urls), reason)
        self.notify("on_state_change", self.state_callback(), up)

    def notify(self, what: str, callback: Callable[..., Any] | None, *args: Any) -> None:
        """Run a user callback; its failure is logged, never raised into our tasks."""
        if callback is None:
            return
        try:
            result = callback(*args)
        except Exception as exc:
            log.error("%s callback failed: %s", what, describe(exc))
            return
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._callback_tasks.add(task)
            task.add_done_callback(lambda t: self._callback_done(what, t))

    def _callback_done(self, what: str, task: asyncio.Future) -> None:
        self._callback_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s callback failed: %s", what, describe(task.exception()))

    def deadline(self, timeout: float | None) -> float | None:
        return None if timeout is None else self.clock() + timeout

    @contextlib.asynccontextmanager
    async def locked(self, lock: asyncio.Lock, deadline: float | None, what: str):
        """``lock`` held, waited for no longer than ``deadline`` (another write holding it --
        one retrying while etcd is unreachable -- must not keep a leave waiting for ever)."""
        if deadline is None:
            async with lock:
                yield
            return
        try:
            async with asyncio.timeout(max(0.0, deadline - self.clock())):
                await lock.acquire()
        except TimeoutError:
            raise DatastoreUnavailable(f"{what}: another etcd write held on past the deadline") from None
        try:
            yield
        finally:
            lock.release()

    def backoff(self, cap: float = 5.0) -> Backoff:
        return Backoff(cap=cap, rng=self.rng)

    async def call(self, what: str, op: Callable[[EtcdClient], Awaitable[T]], deadline: float | None) -> T:
        """Run ``op`` against etcd, retrying transient failures with backoff until ``deadline``."""
        backoff = self.backoff()
        problem = ""
        while True:
            client = self.client()
            remaining = None if deadline is None else deadline - self.clock()
            if remaining is not None and remaining <= 0:
                # Not tried now (the deadline was spent before: waiting for the lock, earlier
                # calls of the same operation, the backoff's sleep): says nothing of etcd, so
                # neither its state nor the endpoint changes.
                if problem:
                    raise DatastoreUnavailable(f"etcd at {', '.join(self.urls)} unreachable ({what}): {problem}")
                raise DatastoreUnavailable(f"{what}: deadline passed before etcd was asked")
            try:
                if remaining is None:
                    result = await op(client)
                else:
                    result = await cancel_kept(asyncio.wait_for(op(client), remaining))
            except asyncio.CancelledError:
                if self.closed_under_us():
                    raise DatastoreError(f"the datastore was closed during {what}") from None
                raise
            except Exception as exc:
                if not is_transient(exc):
                    raise
                if not isinstance(exc, asyncio.TimeoutError) or not problem:
                    problem = describe(exc)  # a deadline cut is less telling than the error before it
                self.set_connected(False, f"{what}: {problem}")
                self.failover(client)
                delay = backoff.next()
                if deadline is not None:
                    remaining = deadline - self.clock()
                    if remaining <= 0:
                        raise DatastoreUnavailable(
                            f"etcd at {', '.join(self.urls)} unreachable ({what}): {problem}"
                        ) from None
                    delay = min(delay, remaining)
                await asyncio.sleep(delay)
            else:
                self.set_connected(True)
                return result

    def closed_under_us(self) -> bool:
        """True if a CancelledError came from close() shutting a channel, not from our caller."""
        task = asyncio.current_task()
        return self.closed and (task is None or task.cancelling() == 0)

    def report_bad(self, key: bytes, mod_revision: int, error: Exception) -> None:
        """Log a malformed record once per key and revision."""
        if (key, mod_revision) in self._reported_bad:
            return
        if len(self._reported_bad) > 10000:
            self._reported_bad.clear()
        self._reported_bad.add((key, mod_revision))
        log.warning("skipping malformed record at %s: %s", clip(key.decode(errors="replace")), error)


async def cancel_kept(awaitable: Awaitable[T]) -> T:
    """``await awaitable``; CancelledError if this task was cancelled meanwhile and the cancel
    was lost on the way.

    Python 3.11's ``asyncio.wait_for`` returns the inner result, dropping the cancel, when the
    inner awaitable completes in the same loop step as its caller is cancelled (CPython
    gh-86296; 3.12 rewrote wait_for).  aetcd waits for a watch to be created that way, and so
    do our requests: a task cancelled at that moment would go on -- a watch waiting for events
    forever, an agent that never exits on SIGTERM.  A cancel asked for during the await that
    raised nothing was lost: raised here (one asked for before, in a task cleaning up after
    it, is not raised again)."""
    task = asyncio.current_task()
    before = task.cancelling() if task is not None else 0
    result = await awaitable
    if task is not None and task.cancelling() > before:
        raise asyncio.CancelledError
    return result


async def close_quietly(client: EtcdClient) -> None:
    """Close an aetcd client; a client whose streams already failed may complain, ignore it.
    A cancel landing as the close ends is kept (cancel_kept): a watch closing its failed
    client when its consumer cancelled it went on watching."""
    with contextlib.suppress(Exception):
        await cancel_kept(asyncio.wait_for(client.close(), 5.0))
