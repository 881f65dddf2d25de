"""Scenario tests of the Producer with SimEngine (a simulation: no model, random tokens)."""

from __future__ import annotations

import asyncio
import gc
import math
import threading
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from asyncroll import (
    DropRecord,
    Producer,
    ProducerConfig,
    ProducerError,
    ProducerExhausted,
    Prompt,
    PutOutcome,
    RolloutGroup,
    SamplingConfig,
    SimConfig,
    SimEngine,
    StalledError,
    Status,
)
from asyncroll._core.state import dumps, loads
from asyncroll.engines.base import GenerateRequest, SampleOutput
from asyncroll.outcomes import FailureReason

VOCAB = 1000


def prompts(n: int, length: int = 3) -> list[list[int]]:
    return [[(i * 7 + j) % VOCAB for j in range(length)] for i in range(n)]


async def parity_reward(group: RolloutGroup) -> list[float]:
    """Reward 1 for an even first token: random under SimEngine, so groups differ."""
    return [float(s.tokens[0] % 2 == 0) if len(s.tokens) else 0.0 for s in group.samples]


def make_producer(
    n_prompts: int = 50,
    *,
    sim: dict[str, Any] | None = None,
    reward: Any = parity_reward,
    max_new_tokens: int = 16,
    **options: Any,
) -> Producer:
    engine = SimEngine(SimConfig(vocab_size=VOCAB, **(sim or {})))
    options.setdefault("group_size", 4)
    return Producer(
        engine,
        prompts(n_prompts),
        reward,
        sampling=SamplingConfig(max_new_tokens=max_new_tokens),
        **options,
    )


async def freeze_mid_sample(engine: Any) -> None:
    """Stop simulated time (pause the `SimEngine`) with a request part-way through a sample, so
    that what comes next (an abort, an update) finds it there however late it comes. Without
    it the test is a wall-clock window: on a busy machine one loop turn can outlast a whole
    request, which then finishes before any update reaches it. The caller resumes the engine
    (or the producer does, at the end of a keep-mode update)."""
    assert isinstance(engine, SimEngine)

    def mid_sample() -> bool:
        return any(0 < live.done() < live.longest for live in engine._live.values())

    while True:
        await engine.wait_progress(mid_sample, 60)
        await engine.pause_generation()
        if mid_sample():  # still (simulated time ran on until the pause)
            return
        await engine.resume_generation()


def watch_ledger(producer: Producer) -> list[int]:
    """Check the ledger at every state change of the producer (each one ends with a notify of
    its change signal); returns a list whose length counts the checks."""
    checks: list[int] = []
    notify = producer._changed.notify

    def checked_notify() -> None:
        producer.check_ledger()
        checks.append(1)
        notify()

    producer._changed.notify = checked_notify  # type: ignore[method-assign]
    return checks


async def consume_all(producer: Producer, n: int) -> list[RolloutGroup]:
    groups: list[RolloutGroup] = []
    async for batch in producer.batches(n):
        producer.check_ledger()
        assert len(batch.groups) <= n
        groups += batch.groups
    return groups


def terminal_by_prompt(consumed: Sequence[RolloutGroup], drops: list[DropRecord]) -> Counter[str]:
    """How many terminal states each prompt reached (expired ones are re-queued, not terminal)."""
    ends = Counter(g.prompt_id for g in consumed)
    ends.update(d.prompt_id for d in drops if d.outcome is not PutOutcome.DROPPED_EXPIRED)
    return ends


# -- the main scenario ---------------------------------------------------------------------------


async def test_thousands_of_groups_with_failures_and_filtering() -> None:
    drops: list[DropRecord] = []
    producer = make_producer(
        3000,
        sim={"fail_rate": 0.1, "malformed_rate": 0.05, "lengths": "uniform", "seed": 3},
        filter="nonzero_std",
        on_drop=drops.append,
        max_inflight_groups=32,
    )
    checks = watch_ledger(producer)
    async with producer:
        consumed = await consume_all(producer, 64)
    ledger = producer.check_ledger()
    c = producer.progress.counters
    assert len(checks) >= 3000 + len(consumed) // 64  # at every landing and every hand-out
    assert ledger.started_groups == 3000 and ledger.in_flight_groups == 0
    assert c.failed_groups > 300 and c.filtered_groups > 100  # both paths really ran
    assert ledger.consumed_groups == len(consumed) == c.completed_groups
    assert c.failed_groups + c.filtered_groups == len(drops)
    ends = terminal_by_prompt(consumed, drops)
    assert len(ends) == 3000 and set(ends.values()) == {1}  # every prompt ends exactly once
    assert all(len(set(g.rewards().tolist())) > 1 for g in consumed)  # the filter held
    errors = Counter(
        (d.error or "").split(":")[0] for d in drops if d.outcome is PutOutcome.DROPPED_FAILED
    )
    assert "engine error" in errors  # SimEngineError
    assert any("malformed" in k or "engine returned" in k for k in errors)
    assert c.reward_count == 4 * (3000 - c.failed_groups)  # every group that was scored
    assert (
        c.generated_tokens == c.consumed_tokens + c.wasted_tokens_failed + c.wasted_tokens_filtered
    )


async def test_batch_metrics_are_a_flat_dict_of_numbers() -> None:
    producer = make_producer(20, filter="nonzero_std")
    async with producer:
        batch = await producer.produce_batch(4)
    metrics = batch.metrics()
    assert all(k.startswith("rollout/") for k in metrics)
    assert all(isinstance(v, (int, float)) for v in metrics.values())
    assert metrics["rollout/batch_groups"] == 4
    assert metrics["rollout/consumed_groups"] == 4
    assert metrics["rollout/total/started_groups"] >= 4
    assert 0 <= metrics["rollout/reward_mean"] <= 1
    assert metrics["rollout/staleness_max"] == 0
    assert batch.staleness_tokens() == {0: sum(g.num_tokens for g in batch.groups)}


async def test_delta_counters_reset_between_batches_and_add_up_to_totals() -> None:
    producer = make_producer(40)
    async with producer:
        deltas = [batch.delta async for batch in producer.batches(8)]
    assert [d.consumed_groups for d in deltas] == [8] * 5
    totals = producer.progress.counters
    for field in totals.__struct_fields__:
        if field in ("wait_s", "idle_s"):  # also counted after the last batch
            continue
        if isinstance(getattr(totals, field), dict):  # the breakdowns, by reason or task
            summed: Counter[str] = Counter()
            for d in deltas:
                summed.update(getattr(d, field))
            assert summed == Counter(getattr(totals, field)), field
        else:
            assert sum(getattr(d, field) for d in deltas) == getattr(totals, field), field


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([], "non-empty"),
        ([1, -2, 3], "outside the vocabulary"),
        ([1, VOCAB], "outside the vocabulary"),
        ([1.5, 2.0], "integers"),
        (["a", "b"], "integers"),
        ([[1, 2], [3]], "not an array|non-empty 1-D"),
        (Prompt(tokens="hello"), "a str, not token ids: tokenize"),  # a source of text stops
    ],
)
async def test_bad_prompt_fails_its_group_and_the_run_continues(bad: Any, message: str) -> None:
    drops: list[DropRecord] = []
    engine = SimEngine(vocab_size=VOCAB)
    good = prompts(5)
    producer = Producer(
        engine, [*good[:2], bad, *good[2:]], parity_reward, group_size=2, on_drop=drops.append
    )
    async with producer:
        consumed = await consume_all(producer, 5)
    assert len(consumed) == 5
    assert len(drops) == 1 and drops[0].outcome is PutOutcome.DROPPED_FAILED
    assert drops[0].prompt_id == "default/2"
    assert drops[0].error is not None and "bad prompt" in drops[0].error
    import re

    assert re.search(message, drops[0].error)
    assert engine.calls == 5  # the bad prompt never reached the engine


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"tokens": [1, 2], "prompt_id": 7}, "prompt_id must be a str or None, got int"),
        ({"tokens": [1, 2], "task": 3}, "task must be a str, got int"),
        ({"tokens": [1, 2], "metadata": {0: "label"}}, "metadata must be a dict with str keys"),
        ({"tokens": [1, 2], "metadata": ["label"]}, "metadata must be a dict with str keys"),
    ],
)
async def test_prompt_fields_a_group_cannot_hold_fail_its_group(
    bad: dict[str, Any], message: str
) -> None:
    """`Prompt` checks no types, and the codec writes what it cannot read back as a group: such
    a group was stored, then `produce_batch` raised `CodecError` decoding it, and the batch it
    was taken with vanished from the ledger."""
    drops: list[DropRecord] = []
    good = prompts(3)
    producer = Producer(
        SimEngine(vocab_size=VOCAB), [good[0], bad, *good[1:]], parity_reward, group_size=2,
        on_drop=drops.append,
    )  # fmt: skip
    async with producer:
        consumed = await consume_all(producer, 4)
    assert len(consumed) == 3
    assert [d.reason for d in drops] == [FailureReason.BAD_PROMPT]
    assert message in (drops[0].error or "")
    assert isinstance(drops[0].prompt_id, str) and isinstance(drops[0].task, str)
    producer.check_ledger()
    loads(dumps(producer.state_dict()))  # its counters (by task) still make a checkpoint


async def test_a_run_of_bad_prompts_does_not_starve_the_event_loop() -> None:
    """A bad prompt's group fails without awaiting anything, and drawing from an iterator
    does not await either: a long run of bad prompts kept the scheduler from ever yielding,
    so nothing else ran (the trainer, its timeouts); an endless one, with
    `max_dropped_in_a_row=None`, hung the process."""
    ticks = [0]
    seen: list[int] = []

    def source() -> Any:
        for _ in range(200):
            seen.append(ticks[0])  # how often the rest of the loop ran, by this draw
            yield []

    async def ticker() -> None:  # counts loop turns: a yield, the thing measured, not a wait
        while True:
            ticks[0] += 1
            await asyncio.sleep(0)

    producer = Producer(
        SimEngine(vocab_size=VOCAB), source(), parity_reward, group_size=2,
        max_dropped_in_a_row=None,
    )  # fmt: skip
    task = asyncio.create_task(ticker())
    try:
        async with producer:
            with pytest.raises(ProducerExhausted):
                await producer.produce_batch(1)
    finally:
        task.cancel()
    assert producer.progress.counters.failed_groups == 200
    assert seen[-1] >= seen[0] + 100  # the loop ran between the draws


def test_prompt_longer_than_max_model_len_fails() -> None:
    from asyncroll._core.rollout import RolloutError, prompt_array

    with pytest.raises(RolloutError, match="max_model_len=4"):
        prompt_array([1, 2, 3, 4], 10, 4)
    assert prompt_array([1, 2, 3], 10, 4).dtype == np.int32


def _reward_cases() -> list[tuple[Any, str]]:
    async def raises(g: RolloutGroup) -> list[float]:
        raise RuntimeError("judge is down")

    def sync_raises(g: RolloutGroup) -> list[float]:
        raise KeyError("label")

    async def torn_down(g: RolloutGroup) -> list[float]:
        raise asyncio.CancelledError  # the judge's client session was closed under it

    return [
        (raises, "'_reward_cases.<locals>.raises' raised RuntimeError: judge is down"),
        (sync_raises, "reward function '_reward_cases.<locals>.sync_raises' raised KeyError"),
        (torn_down, "raised CancelledError though nothing cancelled it"),
        (lambda g: [math.nan] * g.num_samples, "not finite"),
        (lambda g: [math.inf] * g.num_samples, "not finite"),
        (lambda g: ["1"] * g.num_samples, "not a number"),
        (lambda g: [True] * g.num_samples, "not a number"),
        (lambda g: [1.0], "1 rewards for 2 samples"),
        (lambda g: 1.0, "not 2 numbers"),
        (lambda g: None, "not 2 numbers"),
    ]


@pytest.mark.parametrize(("reward", "message"), _reward_cases())
async def test_reward_errors_fail_the_group(reward: Any, message: str) -> None:
    drops: list[DropRecord] = []
    producer = make_producer(6, reward=reward, group_size=2, on_drop=drops.append)
    async with producer:
        with pytest.raises(ProducerExhausted):
            await producer.produce_batch(1)
    assert len(drops) == 6
    assert all(d.outcome is PutOutcome.DROPPED_FAILED for d in drops)
    assert drops[0].error is not None and message in drops[0].error
    producer.check_ledger()
    assert producer.progress.counters.reward_count == 0


async def test_async_reward_timeout_fails_the_group() -> None:
    never = asyncio.Event()

    async def slow(group: RolloutGroup) -> list[float]:
        await never.wait()
        return [0.0] * group.num_samples

    drops: list[DropRecord] = []
    producer = make_producer(3, reward=slow, reward_timeout_s=0.05, on_drop=drops.append)
    async with producer:
        with pytest.raises(ProducerExhausted):
            await producer.produce_batch(1)
    assert [d.error for d in drops] == [
        "reward function 'test_async_reward_timeout_fails_the_group.<locals>.slow' took longer "
        "than reward_timeout_s=0.05"
    ] * 3


async def test_sync_reward_that_hangs_in_its_thread_fails_the_group() -> None:
    release = threading.Event()

    def stuck(group: RolloutGroup) -> list[float]:
        release.wait(30)  # a hung judge; released at the end so the thread can exit
        return [0.0] * group.num_samples

    drops: list[DropRecord] = []
    producer = make_producer(2, reward=stuck, reward_timeout_s=0.05, on_drop=drops.append)
    try:
        async with producer:
            with pytest.raises(ProducerExhausted):
                await producer.produce_batch(1)
    finally:
        release.set()
    assert len(drops) == 2 and all("reward_timeout_s" in (d.error or "") for d in drops)


async def test_a_reward_thread_that_cannot_start_gives_its_worker_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Starting a thread can fail ("can't start new thread" at the process's limit): the
    group failed, but its worker was never given back, so with one worker every later group
    waited for it forever and produce_batch never returned."""
    start = threading.Thread.start
    failures = [RuntimeError("can't start new thread")]

    def start_or_fail(thread: threading.Thread) -> None:
        if thread.name == "asyncroll-reward" and failures:
            raise failures.pop()
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_or_fail)
    drops: list[DropRecord] = []
    producer = make_producer(
        3, reward=lambda g: [1.0] * g.num_samples, reward_workers=1, max_inflight_groups=1,
        on_drop=drops.append,
    )  # fmt: skip
    async with producer:
        batch = await producer.produce_batch(2, timeout=30)  # a guard: it hung before
    assert len(batch.groups) == 2
    assert len(drops) == 1
    assert "' raised RuntimeError: can't start new thread (at " in (drops[0].error or "")


async def test_inline_sync_reward_runs_on_the_loop() -> None:
    seen: list[str] = []

    def reward(group: RolloutGroup) -> list[float]:
        seen.append(threading.current_thread().name)
        return [1.0, 0.0]

    producer = make_producer(3, reward=reward, group_size=2, reward_in_thread=False)
    async with producer:
        consumed = await consume_all(producer, 3)
    assert len(consumed) == 3 and seen == [threading.current_thread().name] * 3


@pytest.mark.parametrize("in_thread", [True, False])
async def test_a_sync_reward_returning_a_coroutine_is_awaited(in_thread: bool) -> None:
    """A plain function returning a coroutine (a lambda or a sync wrapper around an async
    judge) scores groups whichever way sync reward functions are called."""

    async def judge(group: RolloutGroup) -> list[float]:
        return [1.0, 0.0]

    drops: list[DropRecord] = []
    producer = make_producer(
        3, reward=lambda g: judge(g), group_size=2, reward_in_thread=in_thread,
        on_drop=drops.append,
    )  # fmt: skip
    async with producer:
        consumed = await consume_all(producer, 3)
    assert [d.error for d in drops] == []
    assert [g.rewards().tolist() for g in consumed] == [[1.0, 0.0]] * 3


async def test_hanging_engine_is_cut_by_the_generate_deadline() -> None:
    drops: list[DropRecord] = []
    producer = make_producer(
        40, sim={"hang_rate": 0.5, "seed": 1}, generate_timeout_s=0.05, on_drop=drops.append
    )
    async with producer:
        consumed = await consume_all(producer, 10)
    assert drops and all("generate_timeout_s=0.05" in (d.error or "") for d in drops)
    assert len(consumed) + len(drops) == 40
    producer.check_ledger()


async def test_malformed_outputs_fail_with_the_reason() -> None:
    drops: list[DropRecord] = []
    producer = make_producer(60, sim={"malformed_rate": 1.0, "seed": 2}, on_drop=drops.append)
    async with producer:
        with pytest.raises(ProducerExhausted):
            await producer.produce_batch(1)
    errors = [d.error or "" for d in drops]
    assert len(drops) == 60
    assert all(e.startswith("malformed engine output: ") for e in errors)
    assert any("samples for" in e for e in errors)  # wrong number of outputs
    assert any("logprob" in (d.error or "") for d in drops)
    assert any("vocabulary" in (d.error or "") for d in drops)


class NotSampleOutputEngine(SimEngine):
    """Returns, for its second request, something in place of one `SampleOutput`."""

    def __init__(self, odd: Any, **overrides: Any) -> None:
        super().__init__(**overrides)
        self.odd = odd

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        outputs = await super().generate(request)
        return [*outputs[:-1], self.odd] if self.calls == 2 else outputs


@pytest.mark.parametrize("odd", [None, {"tokens": [1, 2], "finish_reason": "stop"}])
async def test_an_output_that_is_not_a_sample_output_fails_its_group(odd: Any) -> None:
    """An engine's `None` (a server's `null`) or dict where a `SampleOutput` belongs raised
    `AttributeError` in the checks of its output, which no group absorbs: the producer
    stopped with an "internal error" blaming asyncroll, for one bad output."""
    drops: list[DropRecord] = []
    producer = Producer(
        NotSampleOutputEngine(odd, vocab_size=VOCAB), prompts(4), parity_reward, group_size=2,
        on_drop=drops.append,
    )  # fmt: skip
    async with producer:
        consumed = await consume_all(producer, 4)
    assert len(consumed) == 3 and [d.reason for d in drops] == [FailureReason.MALFORMED_OUTPUT]
    assert "SampleOutput" in (drops[0].error or "")
    producer.check_ledger()


# -- memory: drop on arrival, bounded bytes ------------------------------------------------------


class RecordingEngine(SimEngine):
    """SimEngine that keeps weak references to every array it hands out."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.refs: list[weakref.ref[Any]] = []

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        outputs = await super().generate(request)
        for out in outputs:
            self.refs += [weakref.ref(out.tokens), weakref.ref(out.logprobs)]
            if out.routed_experts is not None:
                self.refs.append(weakref.ref(out.routed_experts))
        return outputs


async def test_no_payload_survives_once_groups_land() -> None:
    """Every array the engine produced is freed by reference counting once its group landed:
    ready groups live on as encoded bytes, dropped ones not at all."""
    engine = RecordingEngine(vocab_size=VOCAB, fail_rate=0.2, payload_bytes_per_sample=4096)
    producer = Producer(
        engine, prompts(300), parity_reward, group_size=4, filter="nonzero_std",
        sampling=SamplingConfig(max_new_tokens=32),
    )  # fmt: skip
    gc.disable()
    try:
        async with producer:
            batch = await producer.produce_batch(10)
            await producer.pause()
            assert not producer.ledger().in_flight_groups
            assert engine.refs and all(r() is None for r in engine.refs)
            await producer.resume()
            rest = await consume_all(producer, 50)
        assert all(r() is None for r in engine.refs)
    finally:
        gc.enable()
    c = producer.progress.counters
    assert c.failed_groups > 20 and c.filtered_groups > 10
    assert len(batch.groups) + len(rest) == c.consumed_groups


async def test_bytes_stay_bounded_under_a_slow_consumer() -> None:
    """The consumer takes one small batch at a time while the producer could run far ahead:
    held + reserved bytes never pass max_buffer_bytes, and production stops at the bound."""
    producer = make_producer(
        400, sim={"payload_bytes_per_sample": 8192}, max_new_tokens=64, group_size=4,
        max_buffer_bytes=400_000, max_inflight_groups=64,
    )  # fmt: skip
    bound = producer.config.max_buffer_bytes
    peaks: list[int] = []
    put = producer.buffer.put

    def checked_put(group: RolloutGroup, reserved_for_it: int | None = None) -> PutOutcome:
        outcome = put(group, reserved_for_it)
        held = producer.buffer.held_bytes
        reserved = producer.buffer.stats().reserved_bytes
        assert held + reserved <= bound, (held, reserved, bound)
        peaks.append(held)
        return outcome

    producer.buffer.put = checked_put  # type: ignore[method-assign]
    async with producer:
        taken = 0
        while taken < 400:
            batch = await producer.produce_batch(2)
            taken += len(batch.groups)
            assert producer.ledger().ready_groups * producer.buffer.reserve_bytes <= bound
    assert max(peaks) > bound // 2  # the bound, not the workload, limited it
    assert producer.buffer.reserve_bytes * 12 > bound  # ~10 groups fit: far fewer than 64


# -- pause, resume, abort, versions --------------------------------------------------------------


async def test_pause_resume_storm_loses_nothing() -> None:
    drops: list[DropRecord] = []
    producer = make_producer(
        120,
        sim={"per_token_latency_s": 0.0005, "lengths": "uniform", "min_new_tokens": 4},
        max_new_tokens=32,
        max_inflight_groups=16,
        on_drop=drops.append,
    )
    checks = watch_ledger(producer)
    consumed: list[RolloutGroup] = []
    async with producer:
        for cycle in range(100):
            await producer.pause()
            ledger = producer.check_ledger()
            assert ledger.in_flight_groups == 0  # abort mode: everything landed
            await producer.resume()
            if cycle % 5 == 4:
                try:
                    consumed += (await producer.produce_batch(4)).groups
                except ProducerExhausted:
                    break
        consumed += await consume_all(producer, 8)
    c = producer.progress.counters
    assert c.aborted_groups > 20 and c.resumed_groups > 20  # the storm really cut groups
    assert c.idle_s > 0  # paused stretches, with nothing in flight, count as idle
    assert not drops and len(consumed) == 120
    assert {g.prompt_id for g in consumed} == {f"default/{i}" for i in range(120)}
    for g in consumed:
        for s in g.samples:
            assert s.status is Status.COMPLETED and s.finish_reason in ("stop", "length")
            assert len(s.tokens) == len(s.logprobs) == len(s.versions) <= 32
            assert s.finish_reason == "stop" or len(s.tokens) == 32
    assert any(g.attempts > 1 for g in consumed)
    assert len(checks) >= c.aborted_groups + c.completed_groups  # checked at every landing


async def test_update_weights_stamps_versions_and_resumes_partials() -> None:
    producer = make_producer(
        40, sim={"per_token_latency_s": 0.002, "lengths": "uniform", "min_new_tokens": 4},
        max_new_tokens=32, max_inflight_groups=8,
    )  # fmt: skip
    consumed: list[RolloutGroup] = []
    async with producer:
        for _ in range(4):
            batch = await producer.produce_batch(4)
            consumed += batch.groups
            await freeze_mid_sample(producer.engine)
            assert await producer.update_weights(None) == batch.version + 1  # aborts it
            await producer.engine.resume_generation()
        consumed += await consume_all(producer, 4)
    assert producer.version == 4
    mixed = [
        s for g in consumed for s in g.samples if len(set(s.versions.tolist())) > 1
    ]  # continued under a newer version after an abort
    assert mixed, "expected some samples to span a weight update"
    for s in mixed:
        assert (np.diff(s.versions) >= 0).all()
        assert s.finish_reason == "stop" or len(s.tokens) == 32
    assert len({g.prompt_id for g in consumed}) == 40


async def test_keep_mode_freezes_in_place_and_stamps_new_tokens() -> None:
    producer = make_producer(
        40, sim={"per_token_latency_s": 0.002, "lengths": "uniform", "min_new_tokens": 4},
        max_new_tokens=32, pause_mode="keep", max_inflight_groups=8,
    )  # fmt: skip
    consumed: list[RolloutGroup] = []
    async with producer:
        for _ in range(4):
            consumed += (await producer.produce_batch(4)).groups
            in_flight = producer.ledger().in_flight_groups
            await producer.pause()
            assert producer.ledger().in_flight_groups == in_flight  # nothing aborted
            await producer.resume()
            await freeze_mid_sample(producer.engine)
            await producer.update_weights(None)  # and resumes the engine: it continues
        consumed += await consume_all(producer, 4)
    c = producer.progress.counters
    assert c.aborted_groups == 0 and c.resumed_groups == 0
    spans = [s for g in consumed for s in g.samples if len(set(s.versions.tolist())) > 1]
    assert spans  # frozen mid-sample, continued under the next version
    assert all((np.diff(s.versions) >= 0).all() for s in spans)
    assert max(int(s.versions[-1]) for s in spans) <= producer.version


async def test_keep_mode_needs_an_engine_that_supports_it() -> None:
    class NoKeep(SimEngine):
        @property
        def supports_keep_pause(self) -> bool:
            return False

    with pytest.raises(ValueError, match="pause_mode='abort'"):
        Producer(NoKeep(), [], parity_reward, pause_mode="keep")


# -- staleness -----------------------------------------------------------------------------------


async def test_staleness_zero_trains_only_on_policy_tokens() -> None:
    producer = make_producer(
        64, sim={"per_token_latency_s": 0.0005}, batch_size=4, max_staleness=0,
        max_inflight_groups=16,
    )  # fmt: skip
    async with producer:
        async for batch in producer.batches():
            assert batch.staleness_tokens().keys() <= {0}
            assert producer.ledger().in_flight_groups + producer.ledger().ready_groups <= 4
            await producer.update_weights(None)
    assert producer.progress.counters.consumed_groups == 64


async def test_staleness_one_overlaps_and_expires_what_is_too_old() -> None:
    drops: list[DropRecord] = []
    producer = make_producer(
        80, sim={"per_token_latency_s": 0.001, "lengths": "uniform"}, max_new_tokens=32,
        batch_size=4, max_staleness=1, oversample=2.0, max_inflight_groups=16,
        on_drop=drops.append,
    )  # fmt: skip
    consumed: list[RolloutGroup] = []
    async with producer:
        async for batch in producer.batches():
            assert max(batch.staleness_tokens(), default=0) <= 1
            consumed += batch.groups
            await producer.update_weights(None)
            producer.check_ledger()
    expired = [d for d in drops if d.outcome is PutOutcome.DROPPED_EXPIRED]
    assert producer.progress.counters.expired_groups == len(expired)
    ends = terminal_by_prompt(consumed, drops)
    assert len(ends) == 80 and set(ends.values()) == {1}  # expired prompts came back


async def test_stall_is_reported_instead_of_waiting_forever() -> None:
    producer = make_producer(20, batch_size=4, max_staleness=0)
    async with producer:
        await producer.produce_batch()
        with pytest.raises(StalledError, match="update_weights"):
            await producer.produce_batch()
        await producer.update_weights(None)
        assert len((await producer.produce_batch()).groups) == 4


async def test_produce_batch_while_paused_is_a_stall() -> None:
    producer = make_producer(20)
    async with producer:
        await producer.pause()
        with pytest.raises(StalledError, match="resume"):
            await producer.produce_batch(4)
        await producer.resume()
        assert len((await producer.produce_batch(4)).groups) == 4


async def test_idle_time_is_bounded_by_the_run() -> None:
    producer = make_producer(30, sim={"per_token_latency_s": 0.0005})
    start = asyncio.get_running_loop().time()
    async with producer:
        await consume_all(producer, 5)
    wall = asyncio.get_running_loop().time() - start
    assert 0 < producer.progress.counters.idle_s <= wall


async def test_timeout_takes_nothing() -> None:
    producer = make_producer(
        8, sim={"per_token_latency_s": 0.05}, max_new_tokens=100, max_inflight_groups=1
    )
    async with producer:
        with pytest.raises(TimeoutError):
            await producer.produce_batch(8, timeout=0.01)
        assert producer.ledger().consumed_groups == 0


# -- lifecycle, death, cancellation --------------------------------------------------------------


async def test_engine_death_surfaces_as_an_error() -> None:
    engine = SimEngine(vocab_size=VOCAB, per_token_latency_s=0.001)
    producer = Producer(engine, prompts(100), parity_reward, group_size=2)
    with pytest.raises(ProducerError, match="engine died"):
        async with producer:
            await producer.produce_batch(2)
            await engine.close()
            await asyncio.wait_for(consume_all(producer, 2), 10)
    producer.check_ledger()
    assert not producer.running


async def test_cancelling_the_owner_leaves_no_task_and_no_reference() -> None:
    engine = RecordingEngine(vocab_size=VOCAB, per_token_latency_s=0.001)
    producer = Producer(engine, prompts(200), parity_reward, group_size=4)
    started = asyncio.Event()

    async def owner(p: Producer) -> None:
        async with p:
            await p.produce_batch(2)
            started.set()
            await consume_all(p, 2)

    task = asyncio.ensure_future(owner(producer))
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    try:  # not pytest.raises: its ExceptionInfo would keep the traceback (and the producer)
        await task
    except asyncio.CancelledError:
        pass
    else:
        pytest.fail("the owner was not cancelled")
    names = [t.get_name() for t in asyncio.all_tasks()]
    assert not [n for n in names if n.startswith("asyncroll")]
    producer.check_ledger()
    assert producer.ledger().in_flight_groups == 0 and producer.ledger().resume_groups > 0
    ref = weakref.ref(producer)
    gc.disable()
    try:
        del producer, task
        # The loop still holds the cancelled task's last wake-up callback (asyncio internals);
        # one turn of the loop runs it. Not a timing wait: nothing else is pending.
        await asyncio.sleep(0)
        assert ref() is None  # no task, callback or cycle kept it alive
        assert all(r() is None for r in engine.refs)
    finally:
        gc.enable()


async def test_exception_in_the_body_stops_cleanly_and_keeps_partials() -> None:
    producer = make_producer(100, sim={"per_token_latency_s": 0.001}, max_inflight_groups=8)
    with pytest.raises(KeyError):
        async with producer:
            await producer.produce_batch(2)
            raise KeyError("trainer crashed")
    ledger = producer.check_ledger()
    assert ledger.in_flight_groups == 0
    assert ledger.resume_groups + ledger.ready_groups > 0  # kept for a checkpoint
    state = producer.state_dict()
    assert len(state.ready) + len(state.resume) == ledger.ready_groups + ledger.resume_groups


async def test_producer_runs_once_and_needs_its_context() -> None:
    producer = make_producer(4)
    with pytest.raises(RuntimeError, match="async with"):
        await producer.produce_batch(1)
    async with producer:
        await producer.produce_batch(1)
    with pytest.raises(RuntimeError, match="stopped"):
        await producer.produce_batch(1)
    with pytest.raises(RuntimeError, match="runs once"):
        async with producer:
            pass


async def test_failing_prompt_source_stops_the_producer() -> None:
    def source() -> Any:
        yield [1, 2]
        raise OSError("dataset file vanished")

    producer = Producer(SimEngine(vocab_size=VOCAB), source(), parity_reward, group_size=2)
    with pytest.raises(ProducerError, match="prompt source raised OSError"):
        async with producer:
            await producer.produce_batch(1)
            await producer.produce_batch(1)


async def test_prompt_source_raising_a_base_exception_stops_the_producer() -> None:
    """A `BaseException` subclass that is not an `Exception` (a library's own abort signal)
    must reach the trainer as `ProducerError` like any failure of the source: it used to kill
    the scheduler silently, and `produce_batch` waited forever."""

    class Abort(BaseException):
        pass

    def source() -> Any:
        yield [1, 2]
        raise Abort("dataset reader aborted")

    producer = Producer(SimEngine(vocab_size=VOCAB), source(), parity_reward, group_size=2)
    with pytest.raises(ProducerError, match="prompt source raised Abort"):
        async with producer:
            await producer.produce_batch(1, timeout=30)
            await producer.produce_batch(1, timeout=30)
    producer.check_ledger()


async def test_async_prompt_source_and_its_deadline() -> None:
    async def source() -> Any:
        for p in prompts(6):
            yield p

    producer = Producer(SimEngine(vocab_size=VOCAB), source(), parity_reward, group_size=2)
    async with producer:
        assert len(await consume_all(producer, 4)) == 6

    async def stuck() -> Any:
        yield [1, 2]
        await asyncio.Event().wait()
        yield [3, 4]

    producer = Producer(
        SimEngine(vocab_size=VOCAB), stuck(), parity_reward, group_size=2, prompt_timeout_s=0.05
    )
    with pytest.raises(ProducerError, match="prompt_timeout_s"):
        async with producer:
            await producer.produce_batch(1)
            await producer.produce_batch(1)


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"group_size": 0}, "group_size=0"),
        ({"max_staleness": -1, "batch_size": 4}, "max_staleness=-1"),
        ({"max_staleness": 1}, "needs batch_size"),
        ({"max_buffer_bytes": 1000}, "max_buffer_bytes=1000 is smaller than one group"),
        ({"batch_size": 10, "max_buffer_groups": 5}, "raise max_buffer_groups"),
        ({"filter": "top_k"}, "filter='top_k' is unknown"),
        # one sample has no spread: every group would be filtered, silently or after
        # max_dropped_in_a_row groups of wasted generation
        ({"filter": "nonzero_std", "group_size": 1}, "nonzero_std filters every group"),
        ({"reward_timeout_s": 0}, "reward_timeout_s=0"),
        ({"oversample": 0.5}, "oversample"),
        ({"pause_mode": "freeze"}, "pause_mode"),
        ({"groupsize": 8}, "unknown producer option"),
        ({"reward_fn_typo": 1}, "valid are"),
    ],
)
def test_bad_config_names_the_field_and_the_fix(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_producer(4, **options)


def test_a_buffer_that_cannot_hold_one_batch_is_refused_at_construction() -> None:
    """One group fitted, `batch_size` groups did not: construction accepted it and the first
    `produce_batch` raised "can never fill" (with episodes, any max_buffer_bytes under
    batch_size x 11,392 B built fine). Refused now where the fields are set, naming them."""
    probe = make_producer(4)
    one_group = probe.config.group_bytes(probe.engine.payload_bytes(16))
    with pytest.raises(ValueError, match=r"max_buffer_bytes=\d+ cannot hold one batch"):
        make_producer(4, batch_size=8, max_buffer_bytes=4 * one_group)
    assert make_producer(4, batch_size=8, max_buffer_bytes=8 * one_group).config.batch_size == 8


async def keep_none(group: RolloutGroup) -> bool:
    return False


async def test_a_filter_returning_none_fails_its_groups_instead_of_filtering_them() -> None:
    """A filter without its `return` rejected every group as FILTERED (no error), burning
    max_dropped_in_a_row groups of compute before the run said anything."""

    def forgot_return(group: RolloutGroup) -> bool:
        len(set(group.rewards().tolist())) > 1  # noqa: B015

    drops: list[DropRecord] = []
    producer = make_producer(2, filter=forgot_return, on_drop=drops.append)
    async with producer:
        with pytest.raises(ProducerExhausted):
            await producer.produce_batch(2)
    assert [d.reason for d in drops] == [FailureReason.FILTER_ERROR] * 2
    assert "filter returned None, not a bool" in (drops[0].error or "")


def test_an_async_filter_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="filter must be a plain function"):
        make_producer(4, filter=keep_none)


async def test_a_filter_returning_a_coroutine_fails_its_groups() -> None:
    """`bool()` of a coroutine is True: nobody awaiting it, it would keep every group."""
    drops: list[DropRecord] = []
    producer = make_producer(2, filter=lambda g: keep_none(g), on_drop=drops.append)
    async with producer:
        with pytest.raises(ProducerExhausted):
            await producer.produce_batch(2)
    assert [d.reason for d in drops] == [FailureReason.FILTER_ERROR] * 2
    assert "filter returned a coroutine, not a bool" in (drops[0].error or "")


async def test_a_filter_raising_a_cancelled_error_nobody_asked_for_fails_its_groups() -> None:
    def torn_down(group: RolloutGroup) -> bool:
        raise asyncio.CancelledError

    drops: list[DropRecord] = []
    producer = make_producer(2, filter=torn_down, on_drop=drops.append)
    async with producer:
        with pytest.raises(ProducerExhausted):
            await producer.produce_batch(2)
    assert [d.reason for d in drops] == [FailureReason.FILTER_ERROR] * 2
    assert "filter raised CancelledError though nothing cancelled it" in (drops[0].error or "")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_staleness": False, "batch_size": 4}, "max_staleness=False"),  # was 0: on-policy
        ({"group_size": True}, "group_size=True"),  # was 1
        ({"max_turns": True}, "max_turns=True"),
    ],
)
def test_a_bool_for_a_count_is_refused(options: dict[str, Any], message: str) -> None:
    """bool is an int subclass: False passed as a count of 0, so max_staleness=False (meant as
    'off', which is None) made the run strictly on-policy without a word."""
    with pytest.raises(ValueError, match=message):
        ProducerConfig(**options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"max_new_tokens": 2.5}, "max_new_tokens=2.5"),  # a fractional token budget
        ({"max_new_tokens": math.nan}, "max_new_tokens=nan"),  # NaN < 1 is False
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"temperature": math.nan}, "temperature=nan"),  # NaN < 0 is False
        ({"temperature": math.inf}, "temperature=inf"),
        ({"top_p": math.nan}, "top_p=nan"),
        ({"top_k": 0}, "top_k=0"),
        ({"top_k": 2.5}, "top_k=2.5"),
    ],
)
def test_bad_sampling_names_the_field(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**options)


def test_reward_fn_must_be_callable() -> None:
    with pytest.raises(ValueError, match="reward_fn must be callable"):
        Producer(SimEngine(), [], "not a function")  # type: ignore[arg-type]


async def test_batch_that_can_never_fill_is_refused() -> None:
    producer = make_producer(4, max_buffer_groups=8)
    async with producer:
        with pytest.raises(ValueError, match="can never fill"):
            await producer.produce_batch(9)


# -- routed experts (MoE router replay payload) --------------------------------------------------


async def test_routed_experts_survive_abort_and_resume_one_row_per_token() -> None:
    sim = {"per_token_latency_s": 0.002, "payload_bytes_per_sample": 32 * 16, "lengths": "uniform"}
    producer = make_producer(40, sim=sim, max_new_tokens=32, max_inflight_groups=8)
    async with producer:
        consumed = []
        for _ in range(3):
            consumed += (await producer.produce_batch(4)).groups
            await producer.update_weights(None)  # aborts mid-sample: partials resume
        consumed += await consume_all(producer, 4)
    assert producer.progress.counters.resumed_groups > 0
    for g in consumed:
        for s in g.samples:
            assert s.routed_experts is not None
            assert s.routed_experts.shape == (len(s.tokens), 16)


class BadExpertsEngine(SimEngine):
    """Continues samples with routed experts of another width: malformed output."""

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        outputs = await super().generate(request)
        if any(len(s.prefix) for s in request.samples):
            return [
                msgspec_replace(o, routed_experts=np.zeros((len(o.tokens), 3), np.uint8))
                for o in outputs
            ]
        return outputs


async def test_malformed_continuation_fails_the_group_not_the_producer() -> None:
    drops: list[DropRecord] = []
    engine = BadExpertsEngine(
        vocab_size=VOCAB, per_token_latency_s=0.05, payload_bytes_per_sample=32 * 16,
        lengths="uniform", min_new_tokens=8,
    )  # fmt: skip
    producer = Producer(
        engine, prompts(24), parity_reward, group_size=2, max_inflight_groups=8,
        sampling=SamplingConfig(max_new_tokens=32), on_drop=drops.append,
    )  # fmt: skip

    async with producer:
        for _ in range(3):
            await producer.produce_batch(2)
            await freeze_mid_sample(engine)
            await producer.update_weights(None)  # aborts it mid-sample: it continues later
            await engine.resume_generation()
        await consume_all(producer, 2)
    failed = [d for d in drops if d.outcome is PutOutcome.DROPPED_FAILED]
    assert failed and all("routed experts" in (d.error or "") for d in failed)
    producer.check_ledger()


def test_routed_experts_merge_rules() -> None:
    from asyncroll._core.rollout import RolloutError
    from asyncroll.types import RolloutState
    from tests.test_rollout import extend_one

    def _extend(sample: RolloutState, out: SampleOutput) -> RolloutState:
        return extend_one(sample, out, vocab_size=VOCAB, version=0, budget=8)

    def out(n: int, experts: Any) -> SampleOutput:
        return SampleOutput(
            tokens=np.ones(n, np.int32), logprobs=np.full(n, -1.0, np.float32),
            versions=np.zeros(n, np.int32), finish_reason="length", routed_experts=experts,
        )  # fmt: skip

    fresh = _extend(RolloutState(), out(3, np.ones((3, 2), np.uint8)))
    assert fresh.routed_experts is not None and fresh.routed_experts.shape == (3, 2)
    partial = msgspec_replace(fresh, status=Status.ABORTED)
    more = _extend(partial, out(2, np.zeros((2, 2), np.uint8)))
    assert more.routed_experts is not None and more.routed_experts.shape == (5, 2)
    with pytest.raises(RolloutError, match="only part"):
        _extend(partial, out(2, None))
    with pytest.raises(RolloutError, match="change shape"):
        _extend(partial, out(2, np.zeros((2, 5), np.uint8)))
    with pytest.raises(RolloutError, match="for 1 of 2 tokens"):
        _extend(partial, out(2, np.zeros((1, 2), np.uint8)))
    assert _extend(partial, out(0, None)).routed_experts.shape == (3, 2)


def msgspec_replace(obj: Any, **changes: Any) -> Any:
    import msgspec

    return msgspec.structs.replace(obj, **changes)


async def test_a_reward_that_writes_into_sample_extra_touches_only_its_own_samples() -> None:
    """Samples are frozen but their `extra` dict is not: a reward function may annotate it.
    Every sample must own its dict, so what one group's reward writes never shows up on the
    samples of another group."""
    seen: list[dict[str, Any]] = []

    def annotating_reward(group: RolloutGroup) -> list[float]:
        for s in group.samples:
            seen.append(dict(s.extra))
            s.extra["scored_in"] = group.uid
        return [float(i % 2) for i in range(group.num_samples)]

    producer = make_producer(60, reward=annotating_reward, max_inflight_groups=8)
    async with producer:
        consumed = await consume_all(producer, 8)
    assert len(consumed) == 60 and len(seen) == 4 * 60  # the hostile path ran on every group
    assert seen == [{}] * len(seen)  # no sample arrived carrying another group's annotation
    assert all(s.extra == {"scored_in": g.uid} for g in consumed for s in g.samples)
