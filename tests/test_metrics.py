"""`ProduceBatchResult.metrics()`: breakdowns by failure reason and by task, and the staleness
histogram (SimEngine: a simulation)."""

from __future__ import annotations

from collections.abc import Sequence

from asyncroll import Producer, Prompt, RolloutGroup, SamplingConfig, SimConfig, SimEngine, TaskMix
from asyncroll._core.state import dumps, loads
from asyncroll.outcomes import FailureReason
from tests.test_producer import VOCAB, make_producer, parity_reward

REASONS = [f"failed_groups_by_reason/{r.value}" for r in FailureReason]


def math_prompts(n: int) -> list[Prompt]:
    """Every fifth prompt has an id outside the vocabulary: a bad prompt."""
    return [Prompt(tokens=[1, 2, VOCAB if i % 5 == 0 else 3 + i], task="math") for i in range(n)]


def code_prompts(n: int) -> list[list[int]]:
    return [[4, 5, 6 + i] for i in range(n)]


async def task_reward(group: RolloutGroup) -> Sequence[float]:
    """ "code" groups whose first sample starts with an even token raise: a reward error."""
    if group.task == "code" and group.samples[0].tokens[0] % 2 == 0:
        raise ValueError("grader crashed")
    return await parity_reward(group)


async def test_failures_are_broken_down_by_reason_and_task() -> None:
    mix = TaskMix({"math": math_prompts(80), "code": code_prompts(80)}, seed=1)
    producer = Producer(
        SimEngine(SimConfig(vocab_size=VOCAB, fail_rate=0.2, seed=4)), mix, task_reward,
        group_size=4, sampling=SamplingConfig(max_new_tokens=16), filter="nonzero_std",
    )  # fmt: skip
    async with producer:
        batches = [batch async for batch in producer.batches(8)]
    c = producer.progress.counters
    reasons = c.failed_groups_by_reason
    assert reasons["bad_prompt"] == 16  # every fifth math prompt
    assert reasons["engine_error"] > 0 and reasons["reward_error"] > 0
    assert sum(reasons.values()) == c.failed_groups
    assert c.failed_groups_by_task["math"] >= 16 and c.failed_groups_by_task["code"] > 0
    for field in ("completed", "consumed", "failed", "filtered"):
        by_task = getattr(c, f"{field}_groups_by_task")
        assert sum(by_task.values()) == getattr(c, f"{field}_groups"), field
    assert sum(c.reward_count_by_task.values()) == c.reward_count

    last = batches[-1].metrics()
    for key in REASONS:  # every reason is present, 0 or not, in the batch and the totals
        assert f"rollout/{key}" in last and f"rollout/total/{key}" in last
    assert last["rollout/total/failed_groups_by_reason/bad_prompt"] == 16
    assert last["rollout/total/failed_groups_by_task/code"] == c.failed_groups_by_task["code"]
    for task in ("math", "code"):
        mean = c.reward_sum_by_task[task] / c.reward_count_by_task[task]
        assert last[f"rollout/total/reward_mean_by_task/{task}"] == mean
    summed = sum(b.metrics().get("rollout/failed_groups_by_reason/bad_prompt", 0) for b in batches)
    assert summed <= 16  # deltas never count a failure twice (some land after the last batch)


async def test_staleness_histogram_counts_every_token_of_the_batch() -> None:
    producer = make_producer(80, batch_size=8, max_staleness=2, sim={"per_token_latency_s": 0.0})
    seen: set[int] = set()
    async with producer:
        for _ in range(6):
            batch = await producer.produce_batch()
            metrics = batch.metrics()
            hist = {
                int(k.rsplit("/", 1)[1]): v
                for k, v in metrics.items()
                if k.startswith("rollout/staleness_tokens/")
            }
            assert hist == batch.staleness_tokens()
            assert sum(hist.values()) == sum(g.num_tokens for g in batch.groups)
            assert max(hist) == metrics["rollout/staleness_max"] <= 2
            seen |= set(hist)
            await producer.update_weights()
    assert seen >= {0, 1}  # the run really overlapped versions


async def test_breakdowns_survive_a_checkpoint() -> None:
    producer = make_producer(40, sim={"fail_rate": 0.3, "seed": 2})
    async with producer:
        await producer.produce_batch(4)
        await producer.pause()
        state = loads(dumps(producer.state_dict()))
        await producer.resume()
    restored = make_producer(40, sim={"fail_rate": 0.3, "seed": 2})
    restored.load_state_dict(state)
    c = restored.progress.counters
    assert c.failed_groups_by_task == state.counters.failed_groups_by_task
    assert sum(c.failed_groups_by_task.values()) == c.failed_groups > 0
    assert c.consumed_groups_by_task == {"default": 4}
