"""One engine call with a deadline: the only place that turns how an engine call can end into
a group's failure.

Single-turn groups (`attempt`) and every turn of an episode (`episode`) generate through
`generate`, so both fail the same way for the same cause: the engine's own `TimeoutError` is
an engine error, not a deadline; a `CancelledError` the engine raised while nobody cancelled
its caller (a torn-down client session does that) is an engine error, not a cancellation; the
deadline itself aborts the request (best effort, within `abort_timeout_s`) so the engine does
not keep generating for a group that has failed. A deadline that ran out while vLLM refused the
engine's requests because someone else paused it (the engine's `pause_refusals` grew: vLLM
0.33+ in mode "abort" or "wait") says so, since that pause, not the engine, is what to fix.

The deadline is `asyncio.timeout`, whose explicit state (`expired()`) and cancellation count
tell it apart from a cancellation of the caller, which passes through untouched. Every
exception of the engine is turned into `EngineCallError` inside the deadline, so a
`TimeoutError` leaving it is the deadline's own. (An anyio cancel scope did the same job at
about three times the cost per call, on the path every group takes.)

Time the engine spends frozen (a "keep"-mode pause, a save or a weight update holding it) is
not the request's: `Freezes` stops every deadline of a call into the engine while it is
frozen and restarts each with what it had left, so a pause longer than a request's remaining
time does not fail it. One mechanism for single-turn groups and for turns frozen in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Protocol

from asyncroll.engines.base import Engine, EngineDeadError, GenerateRequest, SampleOutput
from asyncroll.outcomes import NOT_ABSORBED, FailureReason, GroupFailure, cancelling

__all__ = ["EngineCallError", "Freezes", "Stoppable", "generate"]


class EngineCallError(GroupFailure):
    """The engine call failed; `fatal` for a dead engine or a `BaseException` from it."""


class Stoppable(Protocol):
    """A deadline of its own kind that a freeze stops and a thaw restarts (`Parking`'s)."""

    def stop(self) -> None: ...

    def go(self) -> None: ...


class Freezes:
    """Whether the engine is frozen, and the deadlines of the calls into it, each stopped while
    it is: the producer freezes it before a "keep"-mode pause and thaws it once resumed."""

    def __init__(self) -> None:
        self.frozen = False
        self._live: dict[asyncio.Timeout, float | None] = {}  # deadline -> seconds left if frozen
        self._watchers: set[Stoppable] = set()  # other deadlines: the episodes' (`Parking`)

    def freeze(self) -> None:
        if self.frozen:
            return
        self.frozen = True
        now = asyncio.get_running_loop().time()
        for deadline in self._live:
            when = deadline.when()
            if when is not None and not deadline.expired():
                self._live[deadline] = when - now
                deadline.reschedule(None)
        for watcher in list(self._watchers):
            watcher.stop()

    def thaw(self) -> None:
        if not self.frozen:
            return
        self.frozen = False
        now = asyncio.get_running_loop().time()
        for deadline, left in self._live.items():
            if left is not None and not deadline.expired():
                deadline.reschedule(now + left)
            self._live[deadline] = None
        for watcher in list(self._watchers):
            watcher.go()

    def watch(self, watcher: Stoppable) -> None:
        """Stop `watcher` with every freeze (at once if frozen now) until `unwatch`."""
        self._watchers.add(watcher)
        if self.frozen:
            watcher.stop()

    def unwatch(self, watcher: Stoppable) -> None:
        if watcher in self._watchers:
            self._watchers.remove(watcher)
            if self.frozen:
                watcher.go()

    def enter(self, deadline: asyncio.Timeout, timeout_s: float) -> None:
        """Track an entered `deadline` of `timeout_s` (stopped at once if frozen)."""
        self._live[deadline] = None
        if self.frozen:
            self._live[deadline] = timeout_s
            deadline.reschedule(None)

    def exit(self, deadline: asyncio.Timeout) -> None:
        del self._live[deadline]


async def generate(
    engine: Engine,
    request: GenerateRequest,
    *,
    timeout_s: float,
    abort_timeout_s: float,
    freezes: Freezes | None = None,
) -> Sequence[SampleOutput]:
    """`engine.generate(request)` within `timeout_s` (not counting time `freezes` has the engine
    frozen); every failure as `EngineCallError`. Only a cancellation of the caller,
    `KeyboardInterrupt` and `SystemExit` pass through."""
    deadline = asyncio.timeout(timeout_s)
    refused = _pause_refusals(engine)
    try:
        async with deadline:
            if freezes is None:
                return await _call(engine, request)
            freezes.enter(deadline, timeout_s)
            try:
                return await _call(engine, request)
            finally:
                freezes.exit(deadline)
    except TimeoutError:
        pass  # only the deadline raises it here: `_call` turned the engine's own into errors
    # Abort what the engine may still be generating, best effort.
    with contextlib.suppress(Exception):
        async with asyncio.timeout(abort_timeout_s):
            await engine.abort(request.request_id)
    error = f"engine gave no answer within generate_timeout_s={timeout_s}"
    paused = _pause_refusals(engine) - refused
    if paused > 0:
        error += (
            f"; meanwhile vLLM refused {paused} of the engine's requests because someone else"
            ' paused it (mode "abort" or "wait"): resume it, or have whoever pauses it'
            ' use mode="keep"'
        )
    raise EngineCallError(FailureReason.ENGINE_DEADLINE, error)


def _pause_refusals(engine: Engine) -> int:
    """The engine's count of requests a paused vLLM refused (`pause_refusals` of asyncroll's
    vLLM engines, each sent again), 0 for an engine that keeps none: what names a pause by
    someone else as the cause of a deadline."""
    count = getattr(engine, "pause_refusals", 0)
    return count if isinstance(count, int) else 0


async def _call(engine: Engine, request: GenerateRequest) -> Sequence[SampleOutput]:
    """`engine.generate(request)`; anything it raises as `EngineCallError`, except a
    cancellation of the caller (the deadline's included), `KeyboardInterrupt` and `SystemExit`."""
    try:
        return await engine.generate(request)
    except EngineDeadError as exc:
        message = f"engine died: {exc}"
        raise EngineCallError(FailureReason.ENGINE_DEAD, message, message) from None
    except asyncio.CancelledError:
        if cancelling():
            raise
        error = "engine error: it raised CancelledError though nothing cancelled the request"
        raise EngineCallError(FailureReason.ENGINE_ERROR, error) from None
    except Exception as exc:  # its own TimeoutError included: not our deadline
        raise EngineCallError(FailureReason.ENGINE_ERROR, _engine_error(exc)) from None
    except NOT_ABSORBED:
        raise
    except BaseException as exc:
        error = _engine_error(exc)
        fatal = f"the engine raised {type(exc).__name__} (a BaseException): {error}"
        raise EngineCallError(FailureReason.ENGINE_ERROR, error, fatal) from None


def _engine_error(exc: BaseException) -> str:
    return f"engine error: {type(exc).__name__}: {exc}"
