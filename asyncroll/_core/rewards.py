"""`RewardRunner`: calls the user's reward function with a deadline that measures running time.

Three ways to call it, fixed when the producer is built:

* ASYNC: awaited on the loop inside a cancel scope with the deadline.
* THREAD (sync functions, the default): at most `workers` calls run at once, each in a thread of
  its own. A call first waits for a worker (queue time, not timed, cancellable, holding nothing
  but its place), then runs with the deadline. A call that passes its deadline is abandoned: its
  group fails, but the call keeps its worker until the function really returns, so the number of
  hung calls, and the payloads they pin, is bounded by `workers`. When every worker is held by a
  hung call, no later group could ever be scored: `stuck_error()` then names the function, and
  the producer stops with it instead of failing every group that queues behind.
* PROCESS (`reward_executor="process"`): each call in a worker process
  (`asyncroll._core.reward_processes`), killed and replaced at its deadline or when it
  crashes; a hung call costs its group, never a worker. A reward that splits itself for
  processes (`split_for_processes()`, as text rewards do: the decode stays here, only text is
  sent) has its first part run in a thread here and its second in the worker.
* INLINE (`reward_in_thread=False`): called on the loop; it cannot be interrupted, only judged
  late.

A sync function that returns an awaitable (a lambda or a sync wrapper around an async judge)
has it awaited on the loop, with a deadline of its own, in either sync mode.

Threads are daemon threads started per call, not a `ThreadPoolExecutor` or anyio's worker
threads: both are joined when the interpreter exits, so one reward function that never returns
would keep the trainer's process alive forever after its run ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import anyio.to_thread

from asyncroll._core.reward_processes import ProcessPool, RewardDeadline, RewardFailure
from asyncroll.types import RolloutGroup

__all__ = ["RewardDeadline", "RewardFailure", "RewardFn", "RewardRunner"]

RewardFn = Callable[[RolloutGroup], Sequence[float] | Awaitable[Sequence[float]]]
"""Scores a completed group: one reward per sample, in order (sync or async)."""


_STUCK = "could not be called: every reward worker is stuck in an earlier call past its deadline"


class _Call(enum.Enum):
    ASYNC = "async"
    THREAD = "thread"
    PROCESS = "process"
    INLINE = "inline"


class RewardRunner:
    def __init__(
        self,
        fn: RewardFn,
        *,
        timeout_s: float,
        workers: int,
        in_thread: bool,
        executor: str = "thread",
        max_calls: int | None = None,
        max_rss_mib: float | None = None,
    ) -> None:
        if not callable(fn):
            raise ValueError(f"reward_fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        self.timeout_s = timeout_s
        self.workers = workers
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004
        )
        if is_async:
            self._mode = _Call.ASYNC  # on the loop, whatever the executor
        elif not in_thread:
            self._mode = _Call.INLINE
        else:
            self._mode = _Call.PROCESS if executor == "process" else _Call.THREAD
        self._prepare: Callable[[RolloutGroup], Any] | None = None
        self.pool: ProcessPool | None = None
        if self._mode is _Call.PROCESS:
            split = getattr(fn, "split_for_processes", None)
            remote: Callable[[Any], Any] = fn
            if callable(split):
                self._prepare, remote = split()
            self.pool = ProcessPool(
                remote, self.name, workers=workers, max_calls=max_calls, max_rss_mib=max_rss_mib
            )
        self._limiter: anyio.CapacityLimiter | None = None  # made on the loop that uses it
        self._hung = 0  # abandoned calls still running in their thread
        self._waiting: set[anyio.CancelScope] = set()  # calls queued for a thread worker

    @property
    def hung_calls(self) -> int:
        """Calls that passed their deadline and have not returned yet (each holds a worker)."""
        return self._hung

    def stuck_error(self) -> str | None:
        """Why no group can be scored any more, or None while one can."""
        if self.pool is not None and self.pool.fatal is not None:
            return f"reward function {self.name!r} {self.pool.fatal}"
        if self._mode is not _Call.THREAD or self._hung < self.workers:
            return None
        return (
            f"every reward worker ({self.workers}) is stuck in reward function {self.name!r}: "
            f"each call ran past reward_timeout_s={self.timeout_s} and never returned, so no "
            "group can be scored; fix the function (or give it a deadline of its own)"
        )

    async def score(self, group: RolloutGroup) -> Any:
        """The function's result for `group` (unchecked); `RewardDeadline` past the deadline,
        whatever the function raised otherwise."""
        match self._mode:
            case _Call.ASYNC:
                return await self._deadline(self._awaited(self.fn(group)))
            case _Call.THREAD:
                result = await self._in_thread(group)
                if inspect.isawaitable(result):  # a sync function that returned a coroutine
                    return await self._deadline(self._awaited(result))
                return result
            case _Call.PROCESS:
                assert self.pool is not None
                payload: Any = group
                n = group.num_samples
                if self._prepare is not None:  # the decode: off the loop, here
                    payload = await anyio.to_thread.run_sync(
                        self._prepare, group, abandon_on_cancel=True
                    )
                del group
                return await self.pool.call(payload, n, self.timeout_s)
            case _Call.INLINE:
                start = time.monotonic()
                result = self.fn(group)
                if inspect.isawaitable(result):  # a sync function that returned a coroutine
                    return await self._deadline(self._awaited(result))
                if time.monotonic() - start > self.timeout_s:
                    raise RewardDeadline(self._late())
                return result

    def _late(self) -> str:
        return f"took longer than reward_timeout_s={self.timeout_s}"

    async def _deadline(self, call: Awaitable[Any]) -> Any:
        with anyio.move_on_after(self.timeout_s) as scope:
            return await call
        if scope.cancelled_caught:
            raise RewardDeadline(self._late())
        raise AssertionError("unreachable: the call neither returned nor timed out")

    @staticmethod
    async def _awaited(result: Any) -> Any:
        while inspect.isawaitable(result):  # a sync function that returned a coroutine
            result = await result
        return result

    def close(self) -> None:
        """Kill the worker processes, if any (a later call starts fresh ones)."""
        if self.pool is not None:
            self.pool.close()

    async def _acquire(self, limiter: anyio.CapacityLimiter, borrower: object) -> None:
        """A thread worker for `borrower`; `RewardFailure` (fatal) once every worker is held
        by a hung call, for this call and every one already queued: none would ever get one."""
        stuck = self.stuck_error()
        if stuck is not None:
            raise RewardFailure(_STUCK, fatal=True)
        with anyio.CancelScope() as scope:
            self._waiting.add(scope)
            try:
                await limiter.acquire_on_behalf_of(borrower)
            finally:
                self._waiting.discard(scope)
        if scope.cancelled_caught:
            raise RewardFailure(_STUCK, fatal=True)

    def _abandoned(self) -> None:
        """One more call hung: if that was the last free worker, wake every queued call, one
        deadline later. The producer stops first, when the group of the call that just hung
        lands as `reward_deadline` (`stuck_error`); woken at once, a queued call's failure
        could land before it and the stop would count that group as interrupted. An
        evaluation, which has no such stop, gets its queued calls back then."""
        self._hung += 1
        if self._hung >= self.workers:
            asyncio.get_running_loop().call_later(self.timeout_s, self._wake_waiting)

    def _wake_waiting(self) -> None:
        if self.stuck_error() is not None:
            for scope in list(self._waiting):
                scope.cancel()

    async def _in_thread(self, group: RolloutGroup) -> Any:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.workers)
        limiter, borrower = self._limiter, object()
        await self._acquire(limiter, borrower)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        call = _ThreadCall(self, limiter, borrower, done)
        thread = threading.Thread(
            target=call.run, args=(self.fn, group), name="asyncroll-reward", daemon=True
        )
        try:
            thread.start()
        except BaseException:  # "can't start new thread": nothing will give the worker back
            limiter.release_on_behalf_of(borrower)
            raise
        del group, thread  # the thread holds the group while the function runs, nobody else
        try:
            return await self._deadline(asyncio.shield(done))
        except BaseException:
            if not done.done():  # timed out or cancelled: the thread keeps its worker
                call.abandon()
            raise


class _ThreadCall:
    """One call in its thread, and how its worker goes back when the function returns."""

    def __init__(
        self,
        runner: RewardRunner,
        limiter: anyio.CapacityLimiter,
        borrower: object,
        done: asyncio.Future[Any],
    ) -> None:
        self._runner = runner
        self._limiter = limiter
        self._borrower = borrower
        self._done = done
        self._loop = done.get_loop()
        self._abandoned = False

    def abandon(self) -> None:
        self._abandoned = True
        self._runner._abandoned()

    def run(self, fn: RewardFn, group: RolloutGroup) -> None:
        try:
            result, error = fn(group), None
        except BaseException as exc:
            result, error = None, exc
        del group
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            self._loop.call_soon_threadsafe(self._settle, result, error)

    def _settle(self, result: Any, error: BaseException | None) -> None:
        self._limiter.release_on_behalf_of(self._borrower)
        if self._abandoned:  # its group has failed already; the result goes nowhere
            self._runner._hung -= 1
        elif not self._done.done():
            if error is None:
                self._done.set_result(result)
            else:
                self._done.set_exception(error)
