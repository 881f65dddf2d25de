"""One engine call with a deadline: the only place that turns how an engine call can end into
a group's failure.

Single-turn groups (`attempt`) and every turn of an episode (`episode`) generate through
`generate`, so both fail the same way for the same cause: the engine's own `TimeoutError` is
an engine error, not a deadline; a `CancelledError` the engine raised while nobody cancelled
its caller (a torn-down client session does that) is an engine error, not a cancellation; the
deadline itself aborts the request (best effort, within `abort_timeout_s`) so the engine does
not keep generating for a group that has failed.

The deadline is `asyncio.timeout`, whose explicit state (`expired()`) and cancellation count
tell it apart from a cancellation of the caller, which passes through untouched. Every
exception of the engine is turned into `EngineCallError` inside the deadline, so a
`TimeoutError` leaving it is the deadline's own. (An anyio cancel scope did the same job at
about three times the cost per call, on the path every group takes.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from asyncroll.engines.base import Engine, EngineDeadError, GenerateRequest, SampleOutput
from asyncroll.outcomes import NOT_ABSORBED, FailureReason, GroupFailure, cancelling

__all__ = ["EngineCallError", "generate"]


class EngineCallError(GroupFailure):
    """The engine call failed; `fatal` for a dead engine or a `BaseException` from it."""


async def generate(
    engine: Engine, request: GenerateRequest, *, timeout_s: float, abort_timeout_s: float
) -> Sequence[SampleOutput]:
    """`engine.generate(request)` within `timeout_s`; every failure as `EngineCallError`. Only
    a cancellation of the caller, `KeyboardInterrupt` and `SystemExit` pass through."""
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            return await _call(engine, request)
    except TimeoutError:
        pass  # only the deadline raises it here: `_call` turned the engine's own into errors
    # Abort what the engine may still be generating, best effort.
    with contextlib.suppress(Exception):
        async with asyncio.timeout(abort_timeout_s):
            await engine.abort(request.request_id)
    error = f"engine gave no answer within generate_timeout_s={timeout_s}"
    raise EngineCallError(FailureReason.ENGINE_DEADLINE, error)


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
