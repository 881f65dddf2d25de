"""Delivering `on_drop` records to the user's callback, sync or async, without ever blocking a
landing.

Landing a group is one synchronous step (the ledger holds at every await), so nothing in it may
wait. What happens depends on the callback, fixed when the producer is built:

* **Sync** (`def on_drop(record)`): called inside the landing, after the counters include the
  group, as it always was. It must be quick; it runs on the event loop.
* **Async** (`async def on_drop(record)`): the record is queued and one task the producer owns
  awaits the callback, one record at a time, in landing order. Each call has a deadline,
  `on_drop_timeout_s`. Queuing keeps no group alive: a `DropRecord` holds ids, counts and the
  error string, never the payload.

What goes wrong, and what it does:

* The callback **raises** (sync or async; any exception but `KeyboardInterrupt`, `SystemExit`
  and a cancellation, a `BaseException` subclass included): the producer stops with
  `ProducerError` naming it, as a sync callback always did. A broken callback is a bug to fix,
  and a run whose drop log is silently incomplete is worse than a stopped one.
* An async call **passes its deadline**: it is cancelled, its record skipped, and a WARNING says
  so; delivery goes on with the next record. One slow call (a network hiccup) costs one record,
  not the run.
* An async call **ignores its cancellation** (it catches `CancelledError` and keeps going): after
  a second `on_drop_timeout_s` it is abandoned, delivery stops and the producer stops with
  `ProducerError`: nothing could bound such a callback, and waiting on it would hang the
  producer's exit.
* The queue holds at most `MAX_PENDING` records; beyond that, records are skipped and counted in
  a WARNING (a callback far slower than the drop rate cannot grow memory without bound).
* At the end of the run the queued records are delivered while the producer drains (within its
  `abort_timeout_s`); what is left then is skipped, and the WARNING counts it.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from asyncroll._core.wakeup import Signal
from asyncroll.outcomes import NOT_ABSORBED

log = logging.getLogger(__name__)

R = TypeVar("R")
OnDrop = Callable[[R], None] | Callable[[R], Awaitable[None]]

MAX_PENDING = 10_000


class _Kind(enum.Enum):
    NONE = "none"
    SYNC = "sync"
    ASYNC = "async"


class DropCallback(Generic[R]):
    """The user's `on_drop`, called as its kind requires. `fail` (stopping the producer) is
    passed to each call rather than kept: holding the producer's bound method would make a
    reference cycle, which only the garbage collector could free."""

    def __init__(self, fn: OnDrop[R] | None, *, timeout_s: float) -> None:
        if fn is not None and not callable(fn):
            raise ValueError(f"on_drop must be callable or None, got {type(fn).__name__}")
        self.fn = fn
        self.timeout_s = timeout_s
        self._name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004
        )
        self._mode = _Kind.NONE if fn is None else _Kind.ASYNC if is_async else _Kind.SYNC
        self._pending: collections.deque[R] = collections.deque()
        self._changed = Signal()
        self._closed = False
        self._broken = False  # a call raised or ignored its cancellation: deliver no more
        self.skipped = 0  # records never delivered (deadline, overflow, end of run)
        self.delivered = 0
        self._abandoned: set[asyncio.Task[None]] = set()  # calls that ignored cancellation

    @property
    def pending(self) -> int:
        return len(self._pending)

    def deliver(self, record: R, fail: Callable[[str], None]) -> None:
        """Hand `record` to the callback: now (sync), or queued for the delivery task (async).
        Never waits and never raises."""
        match self._mode:
            case _Kind.NONE:
                return
            case _Kind.SYNC:
                self._call_sync(record, fail)
            case _Kind.ASYNC:
                if self._broken or self._closed:
                    self.skipped += 1
                elif len(self._pending) >= MAX_PENDING:
                    self.skipped += 1
                    if self.skipped == 1 or self.skipped % MAX_PENDING == 0:
                        log.warning(
                            "on_drop %s falls behind: %d records queued, %d skipped so far",
                            self._name, len(self._pending), self.skipped,
                        )  # fmt: skip
                else:
                    self._pending.append(record)
                    self._changed.notify()

    def _call_sync(self, record: R, fail: Callable[[str], None]) -> None:
        assert self.fn is not None
        try:
            result = self.fn(record)
        except NOT_ABSORBED:
            raise
        except BaseException as exc:  # the accounting is done; a broken callback stops the run
            # (an exception that escaped would end the landing half-way instead)
            fail(f"on_drop callback {self._name} raised {type(exc).__name__}: {exc}")
            return
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()
            fail(
                f"on_drop callback {self._name} returned an awaitable from a plain function: "
                "declare it `async def` so the producer awaits it with a deadline"
            )
            return
        self.delivered += 1

    def close(self) -> None:
        """No more records will come: the delivery task returns once the queue is empty."""
        self._closed = True
        self._changed.notify()

    async def run(self, fail: Callable[[str], None]) -> None:
        """The delivery task (async callbacks only): one record at a time, each within
        `timeout_s`, until closed and empty. Cancelled at the end of the run, it counts what
        is left as skipped."""
        if self._mode is not _Kind.ASYNC:
            return
        try:
            while True:
                await self._changed.wait_until(lambda: bool(self._pending) or self._closed)
                if not self._pending or self._broken:
                    return
                record = self._pending.popleft()
                await self._call_async(record, fail)
                del record
        finally:
            self.skipped += len(self._pending)
            self._pending.clear()
            if self.skipped:
                log.warning("on_drop %s: %d records were not delivered", self._name, self.skipped)

    async def _call_async(self, record: R, fail: Callable[[str], None]) -> None:
        """Await one call within the deadline, in a task of its own so that a call that
        ignores its cancellation can be abandoned instead of hanging delivery."""
        fn = self.fn
        assert fn is not None
        call = asyncio.ensure_future(_awaited(fn, record))
        call.set_name(f"asyncroll-on-drop-{self._name}")
        del record
        late = False
        try:
            done, _ = await asyncio.wait([call], timeout=self.timeout_s)
            if not done:  # past the deadline: cancel it, and give it as long again to end
                late = True
                call.cancel()
                await asyncio.wait([call], timeout=self.timeout_s)
        except BaseException:  # delivery itself was cancelled (the run ended): end the call too
            call.cancel()
            raise
        if not call.done():  # it swallowed the cancellation: nothing can bound it
            self._abandoned.add(call)
            call.add_done_callback(self._abandoned.discard)
            self._broken = True
            fail(
                f"on_drop callback {self._name} ignored its cancellation after "
                f"on_drop_timeout_s={self.timeout_s}: delivery stopped"
            )
        elif late or call.cancelled():
            self.skipped += 1
            log.warning(
                "on_drop %s passed on_drop_timeout_s=%g: cancelled, record skipped",
                self._name, self.timeout_s,
            )  # fmt: skip
        elif (exc := call.exception()) is not None:
            self._broken = True
            fail(f"on_drop callback {self._name} raised {type(exc).__name__}: {exc}")
        else:
            self.delivered += 1


async def _awaited(fn: Callable[[R], Awaitable[None]] | Callable[[R], None], record: R) -> None:
    result = fn(record)
    if inspect.isawaitable(result):
        await result
