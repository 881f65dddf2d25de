"""`VLLMEngine` keeps the `Engine.version` contract when an update is cut off: its `version` is
the label vLLM stamps on every new token, whatever await the caller's cancellation hit."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncroll.engines import VLLMEngine
from asyncroll.engines.vllm.weight_check import WeightMismatchError
from tests.vllm.conftest import DEADLINE_S, MAX_MODEL_LEN, original_weights
from tests.vllm.helpers import ids, request


async def test_an_update_cancelled_while_vllm_takes_the_label_reports_that_label(
    engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM applies a label once it was sent, whether anyone awaits its answer or not: an
    update cancelled between the two (its caller's deadline) left `version` at the old value
    while vLLM stamped every new token with the new one, so the producer stayed at a version
    the engine no longer served. The answer is made late here, so the cancellation lands in
    that window every time."""
    llm: Any = engine._llm
    label = llm.update_weight_version
    taken, answer = asyncio.Event(), asyncio.Event()

    async def late_answer(new_version: str) -> None:
        await label(new_version)  # vLLM's engine core has it now
        taken.set()
        await answer.wait()  # its answer held until the update is cancelled

    monkeypatch.setattr(llm, "update_weight_version", late_answer)
    update = asyncio.create_task(engine.update_weights(None, version=4))
    try:
        async with asyncio.timeout(DEADLINE_S):
            await taken.wait()
        update.cancel()
        answer.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(update, DEADLINE_S)
        async with asyncio.timeout(DEADLINE_S):
            (out,) = await engine.generate(request("after-cut-label", ids(0, 5, 6, 7), 1, 4))
        assert engine.version == 4 and out.versions.tolist() == [4] * 4
    finally:
        monkeypatch.undo()
        await engine.update_weights(None, version=5)  # vLLM and `version` agree; reset after


async def test_an_update_cut_by_an_anyio_scope_leaves_vllm_serving_the_old_label(
    engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An anyio scope (the producer's `update_timeout_s`) cancels every await in it, the
    update's own resume too. Cut before it labelled, the update leaves the old label, and vLLM
    must not stay paused (every later request would wait for its deadline): it takes a control
    call once sent, so the resume reaches it even though its answer is not awaited."""
    llm: Any = engine._llm
    reset = llm.reset_prefix_cache
    scope = anyio.CancelScope()

    async def reset_then_cut(*args: Any, **kwargs: Any) -> bool:
        done: bool = await reset(*args, **kwargs)
        scope.cancel()
        await asyncio.Event().wait()  # never answers: the scope's cancellation ends it
        return done

    monkeypatch.setattr(llm, "reset_prefix_cache", reset_then_cut)
    try:
        with scope:
            await engine.update_weights(None, version=3)
        assert scope.cancelled_caught and engine.version == 0
        monkeypatch.undo()
        async with asyncio.timeout(DEADLINE_S):
            (out,) = await engine.generate(request("after-cut-update", ids(0, 5, 6, 7), 1, 4))
        assert out.versions.tolist() == [0] * 4
    finally:
        monkeypatch.undo()


async def test_an_update_cut_while_the_workers_load_serves_nothing_until_one_succeeds(
    engine: VLLMEngine, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's workers go on loading when the caller stops waiting: an update cut there left
    its weights (all of them, or part) serving under the old label, to new requests and to
    the rest of those running. Until an update succeeds the engine serves nothing: running
    requests end as aborted (their tokens so far sampled by the old weights, labelled so),
    new ones are refused."""
    llm: Any = engine._llm
    rpc = llm.collective_rpc
    loaded, answer = asyncio.Event(), asyncio.Event()

    async def late_answer(method: str, *args: Any, **kwargs: Any) -> Any:
        reports = await rpc(method, *args, **kwargs)
        if method.startswith("asyncroll_load"):
            loaded.set()  # every worker has the weights now
            await answer.wait()  # its answer held until the update is cancelled
        return reports

    prompt = ids(0, 5, 6, 7)
    running = asyncio.create_task(
        engine.generate(request("frozen-through-cut", prompt, 1, MAX_MODEL_LEN - 12))
    )
    update: asyncio.Task[None] | None = None
    try:
        await engine.wait_progress(
            lambda: engine.samples_started("frozen-through-cut") >= 1, DEADLINE_S
        )
        await engine.pause_generation()  # frozen: it cannot end before the update
        monkeypatch.setattr(llm, "collective_rpc", late_answer)
        update = asyncio.create_task(engine.update_weights(original_weights(tiny_model), version=1))
        async with asyncio.timeout(DEADLINE_S):
            await loaded.wait()
        update.cancel()
        answer.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(update, DEADLINE_S)
        monkeypatch.undo()
        await engine.resume_generation()
        assert engine.version == 0
        (out,) = await asyncio.wait_for(running, DEADLINE_S)
        assert out.finish_reason == "abort" and set(out.versions.tolist()) == {0}
        with pytest.raises(WeightMismatchError, match="cut off"):
            await asyncio.wait_for(engine.generate(request("after-cut-load", prompt)), DEADLINE_S)
        await asyncio.wait_for(
            engine.update_weights(original_weights(tiny_model), version=1), DEADLINE_S
        )
        async with asyncio.timeout(DEADLINE_S):
            (out,) = await engine.generate(request("after-good-load", prompt, 1, 4))
        assert out.versions.tolist() == [1] * 4
    finally:
        monkeypatch.undo()
        for task in (running, update):
            if task is not None and not task.done():
                task.cancel()
        await engine.resume_generation()
