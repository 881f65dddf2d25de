"""Adapter updates without a pause, producer side (a simulation: `SimEngine` told that its
adapter updates need no pause). That the engine keeps each request on the adapter it started
with is `tests/vllm/test_lora_parity.py`'s, on real vLLM."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from asyncroll import Producer, SamplingConfig, SimConfig, SimEngine
from asyncroll.engines.base import Weights
from asyncroll.lora import LoraAdapter, LoraConfig
from tests.test_producer import VOCAB, parity_reward, prompts

torch = pytest.importorskip("torch")


def adapter() -> LoraAdapter:
    q = "model.layers.0.self_attn.q_proj"
    config = LoraConfig(rank=1, alpha=1.0, target_modules=("q_proj",))
    return LoraAdapter(config, {f"{q}.lora_A.weight": torch.ones(1, 4),
                                f"{q}.lora_B.weight": torch.ones(4, 1)})  # fmt: skip


class AdapterSim(SimEngine):
    """A simulated engine that binds adapters to requests, as `VLLMEngine(lora=...)` does:
    it reports its slots, and records how many requests ran as each update began."""

    def __init__(self, slots: int, **sim: Any) -> None:
        super().__init__(SimConfig(vocab_size=VOCAB, **sim))
        self.slots = slots
        self.running_at_update: list[int] = []

    @property
    def adapter_slots(self) -> int:  # type: ignore[override]
        return self.slots

    async def update_weights(self, weights: Weights | LoraAdapter | None, *, version: int) -> None:
        self.running_at_update.append(self.running_requests)
        await super().update_weights(weights, version=version)


def producer_on(engine: SimEngine, **options: Any) -> Producer:
    return Producer(
        engine,
        prompts(40),
        parity_reward,
        sampling=SamplingConfig(max_new_tokens=16),
        group_size=2,
        max_inflight_groups=8,
        **options,
    )


async def test_an_adapter_update_does_not_pause_generation() -> None:
    """Groups in flight run on through adapter updates (nothing aborted, the engine had
    requests running as each began); a full-weight update on the same engine still drains."""
    engine = AdapterSim(slots=2, per_token_latency_s=0.05)  # 0.8 s a request
    producer = producer_on(engine)
    async with producer:
        engine.running_at_update.clear()  # the producer's own label check on entry
        for expected in (1, 2):
            await engine.wait_progress(lambda: engine.running_requests > 0, 10.0)
            assert await producer.update_weights(adapter()) == expected
        assert producer.progress.counters.aborted_groups == 0
        assert len(engine.running_at_update) == 2 and min(engine.running_at_update) > 0
        await producer.update_weights(None)  # a full-weight update: the pause drains first
        assert engine.running_at_update[-1] == 0
        assert producer.progress.counters.aborted_groups > 0
    assert engine.adapter_updates == 2


async def test_an_engine_without_adapter_slots_is_paused_for_an_adapter() -> None:
    """`SimEngine` itself does not say it binds adapters: the producer pauses for them."""
    engine = SimEngine(SimConfig(vocab_size=VOCAB, per_token_latency_s=0.05))
    producer = producer_on(engine)
    async with producer:
        await engine.wait_progress(lambda: engine.running_requests > 0, 10.0)
        await producer.update_weights(adapter())
        assert producer.progress.counters.aborted_groups > 0


def test_adapter_slots_must_cover_the_staleness_window() -> None:
    with pytest.raises(ValueError, match=r"registers 2 LoRA adapters.*LoraSlots\(slots=3\)"):
        producer_on(AdapterSim(slots=2), batch_size=4, max_staleness=2)
    producer_on(AdapterSim(slots=3), batch_size=4, max_staleness=2)
    producer_on(AdapterSim(slots=1))  # no staleness limit: the oldest adapter's groups abort


class HeldAdapterSim(AdapterSim):
    """`AdapterSim` whose adapter update holds until the test lets it go (`finish`), so a
    test can act while the update runs, at a point it chose rather than a timing window."""

    def __init__(self, slots: int, **sim: Any) -> None:
        super().__init__(slots, **sim)
        self.began = asyncio.Event()
        self.finish = asyncio.Event()

    async def update_weights(self, weights: Weights | LoraAdapter | None, *, version: int) -> None:
        if isinstance(weights, LoraAdapter):
            self.began.set()
            await self.finish.wait()
        await super().update_weights(weights, version=version)


async def test_a_batch_waiting_beside_an_adapter_update_is_no_stall() -> None:
    """The staleness capacity is used up after a batch, and the update that frees it runs:
    a `produce_batch` waiting beside it waits for it (as beside a full-weight update, which
    holds the gate), instead of raising "call update_weights() after each batch"."""
    engine = HeldAdapterSim(slots=2)
    producer = producer_on(engine, batch_size=2, max_staleness=0)
    stalls: list[str | None] = []
    judged = asyncio.Event()
    async with producer:
        await producer.produce_batch()
        await producer._changed.wait_until(
            lambda: not producer._inflight and producer._admission.next_step() is None, 10
        )  # the capacity is used up: nothing more starts until an update
        update = asyncio.create_task(producer.update_weights(adapter()))
        await asyncio.wait_for(engine.began.wait(), 10)
        stall = producer._admission.stall

        def judging() -> str | None:
            stalls.append(why := stall())
            judged.set()
            return why

        producer._admission.stall = judging  # type: ignore[method-assign]
        batch = asyncio.create_task(producer.produce_batch())
        await asyncio.wait_for(judged.wait(), 10)  # the waiting batch judged the state once
        engine.finish.set()
        assert await asyncio.wait_for(update, 10) == 1
        result = await asyncio.wait_for(batch, 10)
    assert stalls[0] is None, stalls
    assert len(result.groups) == 2 and {g.start_version for g in result.groups} == {1}


class FreezingAdapterSim(AdapterSim):
    """`AdapterSim` that freezes its running requests while it loads an adapter, as
    `VLLMServerEngine` freezes its replicas (the producer is not told: no pause is asked)."""

    async def update_weights(self, weights: Weights | LoraAdapter | None, *, version: int) -> None:
        if not isinstance(weights, LoraAdapter):
            return await super().update_weights(weights, version=version)
        await self.pause_generation()
        try:
            await super().update_weights(weights, version=version)
        finally:
            await self.resume_generation()


@pytest.mark.parametrize("episodes", [False, True], ids=["single-turn", "episodes"])
async def test_an_adapter_load_that_freezes_the_engine_is_not_the_requests_time(
    episodes: bool,
) -> None:
    """The load takes 1.5 s (the scenario, not a synchronisation) with every request frozen
    in the engine: neither `generate_timeout_s` nor `episode_timeout_s` (1.0 s each) counts it,
    as neither counts a "keep"-mode pause; before, every group in flight failed."""
    from asyncroll import DropRecord, single_turn

    engine = FreezingAdapterSim(slots=2, per_token_latency_s=0.005)
    drops: list[DropRecord] = []
    producer = Producer(
        engine, prompts(8), parity_reward, group_size=2, generate_timeout_s=1.0,
        episode_timeout_s=1.0, on_drop=drops.append, sampling=SamplingConfig(max_new_tokens=40),
        rollout_fn=single_turn if episodes else None,
    )  # fmt: skip
    async with producer:
        await engine.wait_progress(lambda: engine.running_requests >= 4, 60)
        engine.config = msgspec.structs.replace(engine.config, update_latency_s=1.5)  # the load
        assert await producer.update_weights(adapter()) == 1
        groups = [g async for batch in producer.batches(2) for g in batch.groups]
    assert not drops and len(groups) == 8, [d.error for d in drops]
    assert producer.progress.counters.aborted_groups == 0  # nothing was paused for
