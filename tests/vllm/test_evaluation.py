"""`Evaluator` on the real engine the run trains with: greedy results equal the engine's own
greedy answer, and an update that lands mid-evaluation is run again, labelled exactly."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import numpy as np
import pytest

from asyncroll import Producer, Prompt, RolloutGroup, SamplingConfig
from asyncroll.engines import VLLMEngine
from asyncroll.evaluation import Evaluator
from tests.vllm.conftest import DEADLINE_S, original_weights
from tests.vllm.helpers import ids, request

pytestmark = pytest.mark.vllm

LONG = 120  # tokens per evaluation sample: far more than are generated before the update lands


def held_out() -> list[Prompt]:
    return [Prompt(tokens=[0, 20 + i, 30 + i], task="held_out") for i in range(3)]


def first_token_even(group: RolloutGroup) -> list[float]:
    return [float(int(s.tokens[0]) % 2 == 0) if len(s.tokens) else 0.0 for s in group.samples]


async def test_evaluation_on_the_training_engine(engine: VLLMEngine, tiny_model: Path) -> None:
    producer = Producer(
        engine,
        itertools.cycle([[0, 11, 12], [0, 13, 14]]),
        first_token_even,
        group_size=2,
        batch_size=2,
        sampling=SamplingConfig(max_new_tokens=8),
    )
    evaluator = Evaluator(
        producer, held_out(), first_token_even,
        sampling=SamplingConfig(max_new_tokens=LONG, temperature=0.0, ignore_eos=True),
    )  # fmt: skip
    engine.stream_interval = 8  # so the test sees tokens arrive before the samples finish
    try:
        async with producer:
            batch = await producer.produce_batch()
            start = engine.generated_tokens
            task = asyncio.create_task(evaluator.run())
            await producer._changed.wait_until(lambda: len(producer._control.guests) == 3, 10)
            await engine.wait_generated(start + 3 * 16, timeout=DEADLINE_S)
            # the same weights under a new label: the greedy answers must not change
            assert await producer.update_weights(original_weights(tiny_model)) == 1
            result = await asyncio.wait_for(task, DEADLINE_S)
            again = await asyncio.wait_for(evaluator.run(), DEADLINE_S)
            producer.check_ledger()
    finally:
        engine.stream_interval = None
    assert batch.version == 0
    assert result.error is None and not result.failed and result.version == 1
    assert result.reruns >= 1  # the update's drain aborted at least one request in flight
    assert again.version == 1 and again.reruns == 0
    for got, also in zip(result.groups, again.groups, strict=True):
        (sample,) = got.samples
        assert len(sample.tokens) == LONG and set(sample.versions.tolist()) == {1}
        assert np.array_equal(sample.tokens, also.samples[0].tokens)  # greedy: exactly again
    # the engine's own greedy answer to the first prompt, outside any producer
    (direct,) = await asyncio.wait_for(
        engine.generate(request("direct", ids(0, 20, 30), 1, LONG, temperature=0.0)), DEADLINE_S
    )
    assert np.array_equal(direct.tokens, result.groups[0].samples[0].tokens)
    assert result.metrics()["eval/version"] == 1
