"""A broken verifier is seen at once and said plainly: the error that stops a run carries the
most frequent cause with its message and where it came from, only the hints that fit, and a
run whose groups all fail for one reason stops within `max_reward_failures_at_start` groups, while
filtering keeps the larger `max_dropped_in_a_row`. Written against SimEngine (a simulation:
the producer's logic, not an engine's, is under test)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest

from asyncroll import Producer, ProducerError, RolloutGroup, SamplingConfig, SimEngine

VOCAB = 64
GUARD_S = 60.0  # only against hangs
INFLIGHT = 4


def endless() -> Iterator[list[int]]:
    i = 0
    while True:
        yield [i % VOCAB, 1]
        i += 1


def ones(group: RolloutGroup) -> list[float]:
    return [1.0] * group.num_samples


def three(group: RolloutGroup) -> list[float]:
    return [1.0, 1.0, 1.0]


def raises(group: RolloutGroup) -> list[float]:
    answer: dict[str, str] = {}
    return [float(answer["answer"])] * group.num_samples


def nan(group: RolloutGroup) -> list[float]:
    return [math.nan] * group.num_samples


def text(group: RolloutGroup) -> Any:
    return "1.0"


def slow(group: RolloutGroup) -> list[float]:
    time.sleep(0.2)  # past its 0.05 s deadline, back soon after: no worker stays held
    return ones(group)


def producer_for(reward: Any, **options: Any) -> Producer:
    options.setdefault("max_inflight_groups", INFLIGHT)
    return Producer(
        SimEngine(vocab_size=VOCAB), endless(), reward, group_size=4,
        sampling=SamplingConfig(max_new_tokens=4), **options,
    )  # fmt: skip


async def stopped(producer: Producer) -> str:
    with pytest.raises(ProducerError) as raised:
        async with producer:
            await producer.produce_batch(1, timeout=GUARD_S)
    producer.check_ledger()
    return str(raised.value)


CASES = [
    (three, {}, "reward_error", r"returned 3 rewards for 4 samples"),
    (raises, {}, "reward_error", r"raised KeyError: 'answer' \(at test_verifier_failures\.py:\d+"),
    (nan, {}, "reward_error", r"reward nan is not finite"),
    (text, {}, "reward_error", r"returned str, not 4 numbers"),
    (slow, {"reward_timeout_s": 0.05, "reward_workers": 64}, "reward_deadline", r"timeout_s"),
]


@pytest.mark.parametrize(("reward", "options", "reason", "message"), CASES, ids=lambda c: "")
async def test_a_verifier_that_fails_every_group_stops_early_with_its_cause(
    reward: Any, options: dict[str, Any], reason: str, message: str
) -> None:
    producer = producer_for(reward, **options)
    error = await stopped(producer)
    assert f"{reason} x16" in error, error
    assert producer.config.max_reward_failures_at_start == 16
    assert f"reward function {reward.__qualname__!r}" in error, error
    assert __import__("re").search(message, error), error
    # only the hints that fit: nothing about filters, version labels or the engine
    for unrelated in ("version label", "filter", "engine"):
        assert unrelated not in error, error
    # stopped within the bound: the 16 that made the streak, plus what was in flight then
    failed = producer.progress.counters.failed_groups_by_reason[reason]
    assert 16 <= failed <= 16 + INFLIGHT, failed


async def test_filtering_keeps_its_own_larger_bound() -> None:
    """DAPO-style filtering drops most groups early in training: not a broken verifier."""
    producer = producer_for(ones, filter=lambda g: False, max_dropped_in_a_row=40)
    error = await stopped(producer)
    assert "filtered x40" in error and "filter" in error, error
    assert "reward function" not in error, error
    assert producer.progress.counters.filtered_groups >= 40


async def test_after_a_first_scored_group_failures_get_the_larger_bound() -> None:
    """A verifier that breaks mid-run (a judge that goes down) is not the run's first
    impression: the streak is judged by max_dropped_in_a_row."""
    calls = {"n": 0}

    def works_once(group: RolloutGroup) -> list[float]:
        calls["n"] += 1
        if calls["n"] == 1:
            return ones(group)
        raise RuntimeError("judge unreachable")

    producer = producer_for(works_once, max_dropped_in_a_row=40, max_inflight_groups=1)
    with pytest.raises(ProducerError) as raised:
        async with producer:
            await producer.produce_batch(1, timeout=GUARD_S)
            await producer.produce_batch(1, timeout=GUARD_S)
    error = str(raised.value)
    assert "reward_error x40" in error and "judge unreachable" in error, error
    assert producer.progress.counters.failed_groups == 40


async def test_the_early_stop_can_be_turned_off() -> None:
    producer = producer_for(three, max_reward_failures_at_start=None, max_dropped_in_a_row=30)
    error = await stopped(producer)
    assert "reward_error x30" in error, error


async def test_failures_are_counted_by_reason_with_their_most_frequent_message() -> None:
    def every_other(group: RolloutGroup) -> list[float]:
        if group.uid % 2:
            return ones(group)
        raise ValueError(f"flaky judge ({'timeout' if group.uid % 4 else 'refused'})")

    producer = producer_for(every_other, max_inflight_groups=1)
    async with producer:
        batch = await producer.produce_batch(4, timeout=GUARD_S)
    causes = batch.failure_causes
    assert set(causes) == {"reward_error"}
    cause = causes["reward_error"]
    assert cause.groups == batch.delta.failed_groups_by_reason["reward_error"] >= 3
    assert "flaky judge (refused)" in cause.message and cause.message_groups >= 2
    assert "(at test_verifier_failures.py:" in cause.message
    assert batch.metrics()["rollout/failed_groups_by_reason/reward_error"] == cause.groups


# -- the evaluator says when prompts fail ---------------------------------------------------------


async def test_an_evaluation_whose_every_prompt_fails_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """48 of 48 prompts failing gave eval/pass@1 = NaN, no log line and no error."""
    from asyncroll.evaluation import Evaluator

    producer = producer_for(ones)
    evaluator = Evaluator(producer, [[1, 2 + i] for i in range(48)], three)
    with caplog.at_level(logging.WARNING, logger="asyncroll"):
        async with producer:
            result = await evaluator.run()
    assert len(result.failed) == 48 and result.metrics()["eval/failed_prompts"] == 48
    assert result.error is not None and result.metrics()["eval/error"] == 1.0
    assert result.error.startswith("every prompt failed (48 of 48); the first: reward_error: ")
    assert "returned 3 rewards for 1 samples" in result.error
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("48 of 48 prompts failed" in w and "returned 3 rewards" in w for w in warnings)


async def test_an_evaluation_with_some_failed_prompts_warns_without_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from asyncroll.evaluation import Evaluator

    def odd_fails(group: RolloutGroup) -> list[float]:
        if int(group.prompt_id.rpartition("/")[2]) % 2:
            raise ValueError("no verifier for this one")
        return ones(group)

    producer = producer_for(ones)
    evaluator = Evaluator(producer, [[1, 2 + i] for i in range(6)], odd_fails)
    with caplog.at_level(logging.WARNING, logger="asyncroll"):
        async with producer:
            result = await evaluator.run()
    assert result.error is None and len(result.failed) == 3 and result.scores.prompts == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("3 of 6 prompts failed" in w and "no verifier" in w for w in warnings), warnings
