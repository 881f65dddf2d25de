"""One engine call with a deadline: the only place that turns how an engine call can end into
a group's failure.

Single-turn groups (`attempt`) and every turn of an episode (`episode`) generate through
`generate`, so both fail the same way for the same cause: the engine's own `TimeoutError` is
an engine error, not a deadline; a `CancelledError` the engine raised while nobody cancelled
its caller (a torn-down client session does that) is an engine error, not a cancellation; the
deadline itself aborts the request (best effort, within `abort_timeout_s`) so the engine does
not keep generating for a group that has failed.

The deadline is an anyio cancel scope, so it is told apart from anything the engine raises by
the scope's own state, and a real cancellation of the caller passes through untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import anyio

from asyncroll.engines.base import Engine, EngineDeadError, GenerateRequest, SampleOutput
from asyncroll.outcomes import NOT_ABSORBED, FailureReason, GroupFailure

__all__ = ["EngineCallError", "generate"]


class EngineCallError(GroupFailure):
    """The engine call failed; `fatal` for a dead engine or a `BaseException` from it."""


async def generate(
    engine: Engine, request: GenerateRequest, *, timeout_s: float, abort_timeout_s: float
) -> Sequence[SampleOutput]:
    """`engine.generate(request)` within `timeout_s`; every failure as `EngineCallError`. Only
    a cancellation of the caller, `KeyboardInterrupt` and `SystemExit` pass through."""
    with anyio.move_on_after(timeout_s) as scope:
        try:
            return await engine.generate(request)
        except EngineDeadError as exc:
            message = f"engine died: {exc}"
            raise EngineCallError(FailureReason.ENGINE_DEAD, message, message) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if scope.cancel_called or (task is not None and task.cancelling()):
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
    # Only the scope's own deadline gets here: abort what the engine may still be generating.
    with anyio.move_on_after(abort_timeout_s), contextlib.suppress(Exception):
        await engine.abort(request.request_id)
    error = f"engine gave no answer within generate_timeout_s={timeout_s}"
    raise EngineCallError(FailureReason.ENGINE_DEADLINE, error)


def _engine_error(exc: BaseException) -> str:
    return f"engine error: {type(exc).__name__}: {exc}"
