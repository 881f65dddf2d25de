"""A sample's `extra` (what a reward function or an episode writes on it) is inside the byte
bound: each sample may carry `max_extra_bytes` of it, reserved with its group before the group
starts; a group whose samples carry more fails (`unstorable`), its cause named, instead of
being stored past `max_buffer_bytes`.

On `SimEngine`, a simulation: what is checked is the producer's byte accounting.
"""

from __future__ import annotations

from typing import Any

import pytest

from asyncroll import DropRecord, Producer, RolloutGroup, SamplingConfig, SimEngine, single_turn
from asyncroll.outcomes import FailureReason
from tests.test_producer import consume_all

VOCAB = 1000


def writing(size: int) -> Any:
    def reward(group: RolloutGroup) -> list[float]:
        for i, s in enumerate(group.samples):
            s.extra["blob"] = bytes(size)
            s.extra["i"] = i
        return [float(i % 2) for i in range(group.num_samples)]

    return reward


def producer(size: int, drops: list[DropRecord], **options: Any) -> Producer:
    return Producer(
        SimEngine(vocab_size=VOCAB), [[3, 4, i] for i in range(12)], writing(size),
        group_size=2, batch_size=2, on_drop=drops.append, max_extra_bytes=4096,
        sampling=SamplingConfig(max_new_tokens=8), **options,
    )  # fmt: skip


@pytest.mark.parametrize("episodes", [False, True], ids=["single-turn", "episodes"])
async def test_extra_past_max_extra_bytes_fails_its_group_and_the_buffer_stays_bounded(
    episodes: bool,
) -> None:
    """200 kB written on each sample under a 24 kB buffer: it held 3.2 MB (131x). Now every
    group fails with the cause, and the buffer never holds more than its bound."""
    drops: list[DropRecord] = []
    bound = 48_000 if episodes else 24_000  # an episode's reservation is larger
    p = producer(200_000, drops, max_buffer_bytes=bound, max_turns=2,
                 rollout_fn=single_turn if episodes else None)  # fmt: skip
    held: list[int] = []
    async with p.engine, p:
        put = p.buffer.put

        def watched(*args: Any, **kwargs: Any) -> Any:
            out = put(*args, **kwargs)
            held.append(p.buffer.held_bytes + p.buffer._reserved_bytes)
            return out

        p.buffer.put = watched  # type: ignore[method-assign]
        stored = len(await consume_all(p, 2))
    assert stored == 0 and len(drops) == 12, f"{stored} groups stored past the bound"
    assert {d.reason for d in drops} == {FailureReason.UNSTORABLE}
    error = drops[0].error or ""
    assert "extra ('blob', 'i') encodes to 200" in error and "4096 B" in error, error
    assert "max_extra_bytes" in error
    assert held and max(held) <= bound, f"held {max(held)} B under max_buffer_bytes={bound}"


async def test_extra_within_max_extra_bytes_is_kept_and_reserved() -> None:
    drops: list[DropRecord] = []
    p = producer(1000, drops, max_buffer_bytes=24_000)
    async with p.engine, p:
        groups = await consume_all(p, 2)
    assert not drops and len(groups) == 12
    assert all(len(s.extra["blob"]) == 1000 for g in groups for s in g.samples)
    assert p.config.group_bytes(0) >= 2 * 4096  # reserved per sample


def test_by_default_a_sample_may_carry_its_replys_text_twice() -> None:
    from asyncroll import ProducerConfig

    config = ProducerConfig(sampling=SamplingConfig(max_new_tokens=100), max_turns=2)
    assert config.extra_bytes() == 800
    assert config.extra_bytes(episodes=True) == 8 * config.episode_tokens
    assert ProducerConfig(max_extra_bytes=0).extra_bytes() == 0
