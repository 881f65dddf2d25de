"""Native asyncio tasks owned by one owner, which `join` awaits: the producer's group tasks.

One task runs each group in flight, so starting one is on the hot path. An anyio task-group
task costs about six times a native task to start and finish (17 µs against 2.7 µs on one
core), which at thousands of groups a second is a large share of a group's cost. These tasks
are as structured as a task group's: every one is owned here, `join` waits for all of them,
and `join` (or `cancel`) cancelling is how an owner that is itself cancelled ends them first.
A task that ends with an exception makes `join` raise it, as a task group would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio

T = TypeVar("T")
log = logging.getLogger(__name__)


class Tasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._error: BaseException | None = None

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            # A cancelled task keeps its CancelledError until asked for it, and through its
            # traceback every frame it passed: the group's (its flight, which holds this task).
            # Taken here, the cycle never forms; the owner is freed by reference counting.
            with contextlib.suppress(asyncio.CancelledError):
                task.result()
        elif self._error is None:
            self._error = task.exception()  # the first one only: None while all succeed

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def join(self) -> None:
        """Wait until every task has ended and raise the first exception one ended with. If
        this wait is cancelled, cancel the tasks, wait for them all the same, then re-raise."""
        try:
            while self._tasks:
                await asyncio.wait(list(self._tasks))
        except asyncio.CancelledError:
            self.cancel()
            while self._tasks:
                await asyncio.wait(list(self._tasks))
            raise
        error, self._error = self._error, None
        if error is not None:
            raise error


async def finish(
    awaitable: Awaitable[T], *, defer_scopes: bool = False
) -> tuple[asyncio.Future[T], asyncio.CancelledError | None]:
    """Await `awaitable` to its end even if the caller is cancelled meanwhile: its future
    (done) and the cancellation absorbed (None: none), which the caller raises once it has
    acted on the result. For calls whose effect lands whether their answer is awaited or not
    (vLLM applies a label, or registers an adapter, once asked): a caller that stopped waiting
    could not know what was done. The wait is the call's own deadline; anyio scopes cancel
    again at each await, so every cancellation is absorbed until the call is done.

    With `defer_scopes`, an anyio scope's cancellation is not absorbed but waits, shielded,
    for the caller's next await (where the scope delivers it again): the scope then does not
    cancel the wait at every turn of the loop while the call runs (a long write's time, spent
    spinning). Only native cancellations (`Task.cancel`, `asyncio.timeout`) come back then."""
    call = asyncio.ensure_future(awaitable)
    cancelled: asyncio.CancelledError | None = None
    while not call.done():
        try:
            with anyio.CancelScope(shield=defer_scopes):
                await asyncio.wait({call})  # cancelling this wait leaves `call` running
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc
    return call, cancelled


async def to_end(awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, awaited to its end even if the caller is cancelled meanwhile
    (the cancellation is raised once it has ended; an anyio scope's reaches the caller at its
    next await): `finish` with `defer_scopes`, for work that must not be left half-done."""
    call, cancelled = await finish(awaitable, defer_scopes=True)
    if cancelled is not None:
        if not call.cancelled() and call.exception() is not None:
            log.warning("%r failed after its caller was cancelled: %r", call, call.exception())
        raise cancelled
    return call.result()


async def thread_to_end(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a worker thread, awaited with `to_end`. For a thread that writes a
    file: a thread cannot be stopped, so a caller let go at once would clean up (unlink the
    file, or take the old one for current) while the thread still writes, and the thread
    would re-create the file after it. Native asyncio cancellation passes through anyio's
    shielded scopes, so `anyio.to_thread.run_sync`'s own wait does not hold it."""
    return await to_end(asyncio.to_thread(fn, *args))
