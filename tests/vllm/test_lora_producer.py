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
