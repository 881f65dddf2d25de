"""Requests a paused vLLM refuses: both vLLM engines send them again after the pause.

From vLLM 0.33 a pause in mode "abort" or "wait" makes the engine core refuse every new request
until the resume instead of queueing it (vllm/v1/engine/core.py, `_reject_add_while_paused`:
`RequestError(code="engine_paused", retryable=True)`). In process, `AsyncLLM.generate` raises
`vllm.exceptions.RetryableRequestError`; `vllm serve` sends that error in the stream, as an
event after the HTTP 200 a stream begins with, and to a request that does not stream as HTTP
503; both read `{"error": {"message": "Generation is paused. Please retry after it resumes.",
"type": "ServiceUnavailableError", "param": null, "code": 503}}` (the code "engine_paused" does
not reach the client). asyncroll pauses only in keep mode, which queues, so a refusal means
someone else paused the engine: another client of the same `vllm serve`, an operator.

A refused request ran nothing (it was turned away on arrival), so it is sent again as if never
sent, after a backoff (`retry_delay_s`), until the engine's deadline for the request
(`request_timeout_s`, `generate_timeout_s`), which the producer's deadlines bound in turn;
then its group fails with `EnginePausedError`, which names the pause. The re-send is itself
the probe: vLLM's `/is_paused` route exists only in dev mode and reports asyncroll's own keep
pause too, under which requests are taken (queued), while a request refused again costs the
engine core nothing. The engines count each refusal (`pause_refusals`).
"""

from __future__ import annotations

RETRY_FIRST_S = 0.05
"""The wait before the first re-send: a pause for a weight update lasts a reload or more."""

RETRY_MAX_S = 1.0
"""The longest wait between re-sends: a request is taken at most this long after a resume."""


def retry_delay_s(refusals: int) -> float:
    """How long a request refused `refusals` times in a row waits before it is sent again:
    doubling from `RETRY_FIRST_S` to `RETRY_MAX_S`."""
    return float(min(RETRY_FIRST_S * 2.0 ** max(refusals - 1, 0), RETRY_MAX_S))


class EnginePausedError(RuntimeError):
    """vLLM kept refusing a request because it was paused (by someone else: asyncroll pauses
    only in keep mode, which queues) until the request's deadline. No engine failed: its
    group fails with this as its reason, and the engine serves on after the resume."""


def paused_too_long(request_id: str, where: str, message: str, times: int, deadline: str) -> str:
    """The reason of a group whose request `where` refused `times` times as paused, saying
    `message`, until `deadline` (the deadline's name and value) ran out."""
    return (
        f"{request_id}: {where} refused it as paused {times} time(s) (vLLM: {message!r}) until "
        f"{deadline} ran out: someone paused vLLM in mode 'abort' or 'wait' (asyncroll pauses "
        "in 'keep' mode only) and did not resume it in time"
    )
