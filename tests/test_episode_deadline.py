"""The episode deadline (`episode_timeout_s`) does not count a "keep"-mode pause or update:
episodes frozen mid-turn in the engine are the producer's time, not theirs.

On `SimEngine`, a simulation: what is checked is the producer's deadline bookkeeping. The
pauses below outlast the deadline on purpose (the scenario, not a synchronisation).
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from asyncroll import DropRecord, Producer, RolloutGroup, SamplingConfig, SimEngine, single_turn
from tests.test_producer import consume_all

VOCAB = 1000
GUARD_S = 60.0  # only against hangs


def ones(group: RolloutGroup) -> list[float]:
    return [1.0] * group.num_samples


@pytest.mark.parametrize("hold", ["pause", "update"])
async def test_a_keep_mode_pause_or_update_does_not_count_against_episode_timeout_s(
    hold: str,
) -> None:
    """Every episode is mid-turn (in the engine, ~0.2 s of its 1.0 s used) when a "keep"-mode
    pause, or a full-weight update that takes 1.5 s, freezes it: it was failed as
    `episode_deadline` and its prompt lost, since a turn frozen in the engine never reaches
    the parking gate that stops the deadline."""
    engine = SimEngine(vocab_size=VOCAB, per_token_latency_s=0.005)
    drops: list[DropRecord] = []
    producer = Producer(
        engine, [[3, 4, i] for i in range(8)], ones, group_size=2, pause_mode="keep",
        episode_timeout_s=1.0, generate_timeout_s=30.0, on_drop=drops.append,
        sampling=SamplingConfig(max_new_tokens=40), rollout_fn=single_turn,
    )  # fmt: skip
    async with producer:
        await engine.wait_progress(lambda: engine.running_requests >= 4, GUARD_S)  # in the engine
        if hold == "pause":
            async with producer.pausing():
                await asyncio.sleep(1.5)  # paused past what is left of episode_timeout_s
        else:  # the engine takes 1.5 s to load (set after the producer's entry, which updates)
            engine.config = msgspec.structs.replace(engine.config, update_latency_s=1.5)
            await producer.update_weights(None)
        consumed = await consume_all(producer, 2)
    assert not drops and len(consumed) == 8, [d.error for d in drops]
