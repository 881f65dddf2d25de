"""Generation through `VLLMEngine` and through the `Producer`, with real vLLM."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asyncroll import Producer, SamplingConfig, Status
from asyncroll.engines import VLLMEngine
from tests.vllm.conftest import DEADLINE_S, MAX_MODEL_LEN
from tests.vllm.helpers import ids, request

pytestmark = pytest.mark.vllm


async def test_samples_with_logprobs_and_versions(engine: VLLMEngine) -> None:
    async with asyncio.timeout(DEADLINE_S):
        outputs = await engine.generate(request("gen-n4", ids(0, 5, 6, 7), n=4, max_new_tokens=24))
    assert len(outputs) == 4
    for out in outputs:
        assert out.finish_reason == "length"
        assert out.tokens.dtype == np.int32
        assert len(out.tokens) == 24
        assert out.logprobs.dtype == np.float32
        assert len(out.logprobs) == 24
        assert np.isfinite(out.logprobs).all()
        assert (out.logprobs <= 0).all()
        assert out.versions.dtype == np.int32
        assert (out.versions == 0).all()
        assert out.tokens.min() >= 0
        assert out.tokens.max() < engine.vocab_size
        assert out.routed_experts is None  # a dense model has no router
    assert len({out.tokens.tobytes() for out in outputs}) == 4  # sampled independently


async def test_parallel_sampling_mixes_fresh_and_resumed_samples(engine: VLLMEngine) -> None:
    """With `parallel_sampling` the fresh samples go as one vLLM request with n=3, the resumed
    one on its own; outputs come back in request order."""
    engine.parallel_sampling = True
    try:
        async with asyncio.timeout(DEADLINE_S):
            prefixes = [ids(), ids(3, 4, 5), ids(), ids()]
            outputs = await engine.generate(
                request("parallel", ids(0, 9), max_new_tokens=10, prefixes=prefixes)
            )
    finally:
        engine.parallel_sampling = False
    assert [len(o.tokens) for o in outputs] == [10] * 4
    assert all(o.finish_reason == "length" and (o.logprobs <= 0).all() for o in outputs)
    assert len({o.tokens.tobytes() for o in outputs}) == 4


async def test_a_prefix_continues_the_same_greedy_sequence(engine: VLLMEngine) -> None:
    """A resumed sample (prompt + partial response) continues where greedy decoding of the
    whole goes, only its new tokens come back, and fresh samples next to it start over."""
    prompt = ids(0, 40, 41, 42, 43)
    async with asyncio.timeout(DEADLINE_S):
        (full,) = await engine.generate(request("full", prompt, 1, 20, temperature=0.0))
        head = full.tokens[:8]
        outputs = await engine.generate(
            request("mix", prompt, 1, 12, prefixes=[ids(), head, ids()], temperature=0.0)
        )
    fresh, resumed, fresh2 = outputs
    np.testing.assert_array_equal(resumed.tokens, full.tokens[8:20])
    np.testing.assert_allclose(resumed.logprobs, full.logprobs[8:20], atol=1e-4)
    np.testing.assert_array_equal(fresh.tokens, full.tokens[:12])
    np.testing.assert_array_equal(fresh2.tokens, full.tokens[:12])


async def test_concurrent_groups_through_the_producer(engine: VLLMEngine) -> None:
    prompts = [[0, 10 + i, 20 + i, 30 + i] for i in range(12)]
    producer = Producer(
        engine,
        prompts,
        lambda group: [float(len(set(s.tokens.tolist()))) for s in group.samples],
        group_size=4,
        max_inflight_groups=6,
        sampling=SamplingConfig(max_new_tokens=32, ignore_eos=True),
    )
    groups = []
    async with producer:
        async for batch in producer.batches(5):
            producer.check_ledger()
            groups.extend(batch.groups)
        ledger = producer.check_ledger()
    assert sorted(g.prompt_id for g in groups) == sorted(f"default/{i}" for i in range(12))
    assert ledger.consumed_groups == 12
    assert ledger.failed_groups == 0
    assert ledger.generated_tokens == 12 * 4 * 32 == ledger.consumed_tokens
    for group in groups:
        assert group.status is Status.COMPLETED
        for sample in group.samples:
            assert len(sample.tokens) == 32
            assert sample.finish_reason == "length"
            assert (sample.versions == 0).all()
            assert (sample.logprobs <= 0).all()
            assert sample.reward == len(set(sample.tokens.tolist()))


async def test_bad_input_fails_its_group_and_the_engine_keeps_serving(
    engine: VLLMEngine,
) -> None:
    """Bad prompts become FAILED groups through the producer. The engine itself refuses bad
    requests with a plain exception for that request (vLLM without a tokenizer does not check
    token ids, and an out-of-vocabulary id would kill its worker), and serves afterwards."""
    vocab = engine.vocab_size
    too_long = ids(*([7] * (MAX_MODEL_LEN + 10)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await engine.generate(request("oov-prompt", ids(0, vocab), 2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await engine.generate(request("oov-prefix", ids(0, 5), prefixes=[ids(-1)]))
    with pytest.raises(Exception, match="maximum context length"):  # vLLM's own check
        await engine.generate(request("too-long", too_long, 2))

    prompts = [[0, 5, 6], [0, vocab + 3], too_long.tolist(), [0, 8, 9], [0, -2]]
    producer = Producer(
        engine, prompts, lambda g: [0.0] * g.num_samples, group_size=2,
        sampling=SamplingConfig(max_new_tokens=8, ignore_eos=True),
    )  # fmt: skip
    async with producer:
        batch = await producer.produce_batch(2, timeout=DEADLINE_S)
        ledger = producer.check_ledger()
    assert sorted(g.prompt_id for g in batch.groups) == ["default/0", "default/3"]
    assert ledger.failed_groups == 3
    assert batch.delta.failed_groups == 3
    assert all(len(s.tokens) == 8 for g in batch.groups for s in g.samples)
