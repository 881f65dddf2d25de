"""Adapter updates without a pause, on real vLLM: a `Producer` on a `VLLMEngine` with LoRA
updates the adapter while groups generate. Nothing is aborted, and every sample is one vLLM
request under one adapter, so all its tokens carry one version."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from asyncroll import Producer, RolloutGroup, SamplingConfig
from asyncroll.engines import VLLMEngine
from asyncroll.lora import LoraSlots
from tests.vllm.conftest import DEADLINE_S, original_weights
from tests.vllm.helpers import ids, request
from tests.vllm.test_lora_parity import lora_ids, random_adapter


async def reward(group: RolloutGroup) -> list[float]:
    return [float(len(s.tokens)) for s in group.samples]


async def test_adapter_updates_without_a_pause(tiny_model: Path, lora_engine: VLLMEngine) -> None:
    base = dict(original_weights(tiny_model))
    prompts = [[0, 5 + i, 6, 7] for i in range(40)]
    # A slot per update: no update has to make room by aborting an old adapter's requests.
    # Admission (max_staleness=1, batch_size=8) starts at most 8 x (version + 2) groups by a
    # version, so groups are still waiting to start at each update (something runs then), and
    # the last 8 prompts start under version 3.
    engine = lora_engine  # the session's
    assert engine.lora == LoraSlots(max_rank=8, slots=4)
    assert engine.adapter_slots == 4
    producer = Producer(
        engine,
        prompts,
        reward,
        sampling=SamplingConfig(max_new_tokens=24, temperature=1.0, seed=3),
        group_size=2,
        max_inflight_groups=2,
        batch_size=8,
        max_staleness=1,
        generate_timeout_s=DEADLINE_S,
    )
    consumed: list[RolloutGroup] = []
    running_at_update = []
    async with producer:
        for seed in (1, 2, 3):
            consumed += (await producer.produce_batch(2, timeout=4 * DEADLINE_S)).groups
            await engine.wait_progress(lambda: engine.running_requests > 0, DEADLINE_S)
            running_at_update.append(engine.running_requests)
            await producer.update_weights(random_adapter(base, seed))
        async with asyncio.timeout(10 * DEADLINE_S):  # the rest of the prompts
            async for batch in producer.batches(4):
                consumed += batch.groups
        aborted = producer.progress.counters.aborted_groups  # (leaving drains, aborting)
    assert min(running_at_update) > 0  # (read just before each update began)
    assert producer.version == 3
    assert aborted == 0
    samples = [s for g in consumed for s in g.samples]
    assert all(len(set(s.versions.tolist())) == 1 for s in samples), "a request straddled"
    assert len(consumed) == len(prompts)
    assert max(int(np.max(s.versions)) for s in samples) == 3
    ids = (await lora_ids(engine))[0]
    assert 1 <= len(ids) <= 4 and max(ids) == 3


async def test_a_request_started_as_a_full_update_begins_never_binds_the_retiring_adapter(
    tiny_model: Path, lora_engine: VLLMEngine
) -> None:
    """A full-weight update retires the adapter policy: a request that starts once the update
    has begun must not bind to that adapter (vLLM's reload drops it in the workers). The
    update's steps are interleaved deterministically: the request starts inside the update's
    own pause call, the await at which it used to bind (it was aborted, or served by the new
    weights, or neither, by timing). Now it waits until the pause holds it, starts on the base
    weights, and every token it gets is the new weights'."""
    engine = lora_engine
    base = dict(original_weights(tiny_model))
    await engine.update_weights(random_adapter(base, seed=3), version=1)
    adapters = engine._adapters
    acquired: list[object] = []
    reached = asyncio.Event()  # the request bound, or waits for admission
    acquire, wait_admitting = adapters.acquire, engine._wait_admitting

    def recording_acquire() -> object:
        acquired.append(got := acquire())
        reached.set()
        return got

    async def recording_wait(request_id: str) -> None:
        reached.set()
        await wait_admitting(request_id)

    llm = engine._llm
    pause = llm.pause_generation
    late: list[asyncio.Future[object]] = []

    async def pause_with_a_request_starting(*args: object, **kwargs: object) -> object:
        if not late:  # the update has begun: a request starts here, and gets as far as it can
            late.append(asyncio.ensure_future(engine.generate(request("late", ids(0, 9, 8), 1, 8))))
            await asyncio.wait_for(reached.wait(), DEADLINE_S)
        return await pause(*args, **kwargs)

    adapters.acquire = recording_acquire  # type: ignore[method-assign]
    engine._wait_admitting = recording_wait  # type: ignore[method-assign]
    llm.pause_generation = pause_with_a_request_starting
    try:
        await asyncio.wait_for(engine.update_weights(list(base.items()), version=2), 4 * DEADLINE_S)
        (sample,) = await asyncio.wait_for(late[0], DEADLINE_S)  # type: ignore[misc]
    finally:
        del adapters.acquire, engine._wait_admitting, llm.pause_generation
    assert acquired == [None], "the request bound to the adapter the update retires"
    assert sample.versions.tolist() == [2] * len(sample.tokens) and len(sample.tokens) == 8
    assert await lora_ids(engine) == [[]]  # the retired adapter is unloaded
