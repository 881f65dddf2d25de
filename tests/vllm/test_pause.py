"""Abort and resume, and the keep-in-place pause, through the `Producer` with real vLLM.

Progress is observed, never slept for: `wait_generated` returns once vLLM has streamed tokens.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from asyncroll import Producer, SamplingConfig, Status
from asyncroll.engines import VLLMEngine
from tests.vllm.conftest import DEADLINE_S, original_weights
from tests.vllm.helpers import ids, request

pytestmark = pytest.mark.vllm

LONG = 200  # tokens per sample: far more than are generated before an abort lands


async def test_abort_returns_partial_samples(engine: VLLMEngine) -> None:
    """Streamed every 8 tokens, the samples are aborted once they hold 27 tokens together
    (only intermediate outputs can show that before they finish); they keep what they had."""
    start = engine.generated_tokens
    engine.stream_interval = 8
    try:
        task = asyncio.create_task(engine.generate(request("to-abort", ids(0, 11, 12), 3, LONG)))
        await engine.wait_generated(start + 3 * 9, timeout=DEADLINE_S)
        await engine.abort("to-abort")
        async with asyncio.timeout(DEADLINE_S):
            outputs = await task
    finally:
        engine.stream_interval = None
    for out in outputs:
        assert out.finish_reason == "abort"
        assert 0 < len(out.tokens) < LONG
        assert len(out.logprobs) == len(out.versions) == len(out.tokens)
        assert (out.versions == 0).all()
    assert sum(len(out.tokens) for out in outputs) >= 3 * 9
    assert engine.running_requests == 0  # vLLM's front end holds none of them any more
    async with asyncio.timeout(DEADLINE_S):  # and the engine still serves
        (after,) = await engine.generate(request("after-abort", ids(0, 11, 12), 1, 4))
    assert len(after.tokens) == 4


async def test_abort_before_generate_starts(engine: VLLMEngine) -> None:
    """The producer may abort a group whose task has not run yet: it must not run to the end."""
    task = asyncio.create_task(engine.generate(request("early", ids(0, 15, 16), 2, LONG)))
    await engine.abort("early")  # the task has not started: nothing here yields to it
    async with asyncio.timeout(DEADLINE_S):
        outputs = await task
    assert [(o.finish_reason, len(o.tokens)) for o in outputs] == [("abort", 0)] * 2
    assert engine.running_requests == 0


async def test_generate_deadline_aborts_its_requests(engine: VLLMEngine) -> None:
    engine.generate_timeout_s = 0.05  # far less than LONG tokens take
    try:
        with pytest.raises(TimeoutError, match="generate_timeout_s"):
            await engine.generate(request("too-slow", ids(0, 13, 14), 2, LONG))
    finally:
        engine.generate_timeout_s = 3600.0
    assert engine.running_requests == 0


@pytest.mark.parametrize("pause_mode", ["abort", "keep"])
async def test_weight_update_mid_generation(
    engine: VLLMEngine, tiny_model: object, pause_mode: str
) -> None:
    """Update to weights with zeroed embeddings (every next token then has logprob exactly
    -ln(vocab)) while a group is generating. The group finishes to its full length; every
    token labelled version 1 was sampled by the new weights and every token labelled 0 by the
    old ones. "abort" mode aborts and re-prefills (two attempts); "keep" mode freezes the
    requests inside vLLM (one attempt)."""
    zeroed = [(n, t * 0 if "embed_tokens" in n else t) for n, t in original_weights(tiny_model)]
    uniform = -math.log(engine.vocab_size)
    producer = Producer(
        engine, [[0, 21, 22, 23]], lambda g: [0.0] * g.num_samples, group_size=2,
        pause_mode=pause_mode, sampling=SamplingConfig(max_new_tokens=LONG, ignore_eos=True),
    )  # fmt: skip
    start = engine.generated_tokens
    async with producer:
        await engine.wait_generated(start + 2, timeout=DEADLINE_S)  # first token of each sample
        assert await producer.update_weights(zeroed) == 1
        batch = await producer.produce_batch(1, timeout=DEADLINE_S)
        ledger = producer.check_ledger()
    (group,) = batch.groups
    assert group.status is Status.COMPLETED
    assert group.attempts == (2 if pause_mode == "abort" else 1)
    assert ledger.consumed_tokens == ledger.generated_tokens == 2 * LONG
    assert batch.delta.aborted_groups == (1 if pause_mode == "abort" else 0)
    assert any(s.versions[0] == 0 for s in group.samples)  # started before the update
    for sample in group.samples:
        assert len(sample.tokens) == LONG
        assert sample.finish_reason == "length"
        assert sample.versions[-1] == 1
        assert (np.diff(sample.versions) >= 0).all()
        looks_new = np.abs(sample.logprobs - uniform) < 1e-5
        old = sample.versions == 0
        assert looks_new[~old].all()  # every token labelled 1 came from the new weights
        assert np.count_nonzero(looks_new[old]) <= 1  # (one coincidence allowed)
