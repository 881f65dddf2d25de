"""The producer at its edges: each test is a scenario that broke a guarantee once (hardening
issue, defects 1-12 and 17), written against SimEngine (a simulation) or a hostile engine built
on it. Waits are on the producer's own signals; deadlines only guard against hangs."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import numpy as np
import pytest

from asyncroll import (
    DropRecord,
    Producer,
    ProducerError,
    ProducerExhausted,
    ProducerState,
    ProgressCounters,
    PutOutcome,
    RolloutGroup,
    SamplingConfig,
    SimEngine,
    StalledError,
    single_turn,
)
from asyncroll._core import rollout
from asyncroll._core.lifecycle import Phase
from asyncroll._core.progress import LatencyHistogram
from asyncroll._core.state import STATE_FORMAT, dumps, loads
from asyncroll.codec import encode
from asyncroll.engines.base import GenerateRequest, SampleOutput, Weights
from asyncroll.lora import LoraError
from asyncroll.outcomes import FailureReason
from asyncroll.producer import UpdateWeightsError
from asyncroll.prompts import PromptStream
from asyncroll.types import Prompt, Status
from tests.factories import make_sample
from tests.test_producer import VOCAB, consume_all, make_producer, parity_reward, prompts

GUARD_S = 60.0  # only against hangs: every wait below ends on an event long before


async def wait_for(producer: Producer, predicate: Any) -> None:
    """Wait until `predicate()` holds, re-checked at every state change of the producer."""
    await producer._changed.wait_until(predicate, GUARD_S)


def ones(group: RolloutGroup) -> list[float]:
    return [1.0] * group.num_samples


# -- 1. sync rewards that never return ---------------------------------------------------------


async def test_hung_reward_calls_neither_starve_nor_fail_healthy_groups() -> None:
    """Two calls hang for good, three workers: the healthy groups queue behind each other on
    the one free worker far longer than reward_timeout_s, and none of them fails (the deadline
    measures running time, not queue time)."""
    release = threading.Event()
    calls = Counter[str]()
    lock = threading.Lock()

    def judge(group: RolloutGroup) -> list[float]:
        with lock:
            calls["all"] += 1
            hang = calls["all"] <= 2
        if hang:
            release.wait(GUARD_S)  # a judge that never answers (released when the test ends)
        else:
            time.sleep(0.3)  # honest work (the thing under test): 10 queue 3 s on one worker
        return ones(group)

    drops: list[DropRecord] = []
    producer = make_producer(
        12, reward=judge, group_size=2, reward_workers=3, reward_timeout_s=2.0,
        on_drop=drops.append,
    )  # fmt: skip
    try:
        async with producer:
            consumed = await consume_all(producer, 4)
    finally:
        release.set()
    assert len(consumed) == 10
    assert [d.reason for d in drops] == [FailureReason.REWARD_DEADLINE] * 2
    producer.check_ledger()


async def test_every_reward_worker_stuck_stops_the_run_naming_the_function() -> None:
    release = threading.Event()

    def never_answers(group: RolloutGroup) -> list[float]:
        release.wait(GUARD_S)
        return ones(group)

    producer = make_producer(
        12, reward=never_answers, group_size=2, reward_workers=2, reward_timeout_s=0.2,
        abort_timeout_s=3600,
    )  # fmt: skip
    try:  # the stop cannot wait for groups no worker will ever score
        with pytest.raises(ProducerError, match="never_answers"):
            async with asyncio.timeout(GUARD_S), producer:
                await producer.produce_batch(1)
    finally:
        release.set()
    ledger = producer.check_ledger()
    by_reason = producer.progress.counters.failed_groups_by_reason
    assert by_reason["reward_deadline"] == 2  # only the calls that really ran past it
    assert by_reason == {"reward_deadline": 2, "interrupted": ledger.failed_groups - 2}


def test_the_process_exits_while_a_reward_call_hangs(tmp_path: Path) -> None:
    script = tmp_path / "hung.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, threading
            from asyncroll import Producer, SimEngine, SamplingConfig, ProducerExhausted

            def never(group):
                threading.Event().wait()  # never returns

            async def main():
                producer = Producer(
                    SimEngine(vocab_size=100), [[1, 2]], never, group_size=2,
                    sampling=SamplingConfig(max_new_tokens=2), reward_timeout_s=0.1,
                )
                async with producer:
                    try:
                        await producer.produce_batch(1)
                    except ProducerExhausted:
                        print("exhausted")

            asyncio.run(main())
            """
        )
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, str(script)], cwd=root, capture_output=True, text=True,
        timeout=GUARD_S, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exhausted"


# -- 2. what the landing path must absorb ------------------------------------------------------


async def test_unstorable_metadata_fails_its_group_and_numpy_metadata_is_stored() -> None:
    source = [
        Prompt(tokens=[1, 2], metadata={"label": np.int64(7), "ids": np.arange(3)}),
        Prompt(tokens=[3, 4], metadata={"handle": object()}),  # the codec cannot encode it
        Prompt(tokens=[5, 6], metadata={"score": np.float32(0.5)}),
    ]
    drops: list[DropRecord] = []
    producer = Producer(
        SimEngine(vocab_size=VOCAB), source, ones, group_size=2, on_drop=drops.append,
        sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    async with producer:
        consumed = await consume_all(producer, 2)
    assert [d.reason for d in drops] == [FailureReason.BAD_PROMPT]
    assert "cannot be stored" in (drops[0].error or "")
    label = next(g for g in consumed if "label" in g.metadata).metadata["label"]
    assert int(label) == 7 and len(consumed) == 2
    producer.check_ledger()


class BaseExceptionEngine(SimEngine):
    """Raises a `BaseException` subclass (not an `Exception`) from its third request."""

    class Boom(BaseException):
        pass

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        if self.calls >= 2:
            self.calls += 1
            raise self.Boom("from the engine")
        return await super().generate(request)


async def test_base_exception_from_the_engine_reaches_the_trainer_as_producer_error() -> None:
    producer = Producer(
        BaseExceptionEngine(vocab_size=VOCAB), prompts(20), ones, group_size=2,
        max_inflight_groups=1, sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    trainer = asyncio.current_task()
    assert trainer is not None
    with pytest.raises(ProducerError, match="Boom"):
        async with producer:
            while True:  # the error, not an ExceptionGroup or a cancellation, ends this
                await producer.produce_batch(1, timeout=GUARD_S)
    assert trainer.cancelling() == 0
    ledger = producer.check_ledger()
    assert ledger.in_flight_groups == 0 and ledger.failed_groups == 1


async def test_an_exit_cancelled_by_an_anyio_scope_still_drains_and_ends_every_task() -> None:
    """anyio's cancellation is level-triggered: inside a cancelled scope every await raises.
    An exit whose awaits were not shielded returned at its first wait, with the groups being
    scored still in flight and their tasks and the producer's own still running after
    `async with` (and `state_dict` refusing to run)."""
    never = asyncio.Event()
    calls: list[int] = []
    all_scoring = asyncio.Event()

    async def judge(group: RolloutGroup) -> list[float]:
        calls.append(group.uid)
        if len(calls) == 4:
            all_scoring.set()
        await never.wait()  # a judge that does not answer: the reward deadline ends it
        return ones(group)

    producer = make_producer(4, reward=judge, reward_timeout_s=0.5)
    with anyio.CancelScope() as scope:
        async with producer:
            await asyncio.wait_for(all_scoring.wait(), GUARD_S)  # every group is being scored
            scope.cancel()
            await anyio.lowlevel.checkpoint()
    assert scope.cancelled_caught
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("asyncroll")]
    ledger = producer.check_ledger()
    assert ledger.in_flight_groups == 0 and ledger.failed_groups == 4
    assert producer.progress.counters.failed_groups_by_reason == {"reward_deadline": 4}
    producer.state_dict()


async def test_an_exit_cancelled_twice_still_ends_every_task(tmp_path: Path) -> None:
    """The owner's first cancellation cuts the drain short, its second the wait for the
    producer's task: the exit then returned with that task and every group's still running,
    instead of cancelling them and waiting for them (as `Tasks.join` does). What the run holds
    besides is released all the same: the record's writer process ended (its last lines
    written), the reward workers closed, the producer stopped."""
    never = asyncio.Event()
    calls: list[int] = []
    all_scoring = asyncio.Event()

    async def judge(group: RolloutGroup) -> list[float]:
        calls.append(group.uid)
        if len(calls) == 4:
            all_scoring.set()
        await never.wait()  # never answers: only a cancellation ends the groups
        return ones(group)

    producer = make_producer(
        4, reward=judge, reward_timeout_s=GUARD_S, abort_timeout_s=GUARD_S,
        record=tmp_path / "record",
    )  # fmt: skip

    async def owner() -> None:
        async with producer:
            await asyncio.wait_for(all_scoring.wait(), GUARD_S)  # every group is being scored

    task = asyncio.create_task(owner())
    await wait_for(producer, lambda: producer._phase is Phase.STOPPING)  # waits for the scoring
    task.cancel()
    drops = producer._drops  # closed (and so notified) once the cancelled drain gives up
    await drops._changed.wait_until(lambda: drops.pending == 0 and drops._closed, GUARD_S)
    task.cancel()  # now the exit waits for the producer's task
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("asyncroll")]
    ledger = producer.check_ledger()
    assert ledger.in_flight_groups == 0 and ledger.failed_groups == 4  # interrupted scoring
    assert producer._phase is Phase.STOPPED
    assert producer.record.pid is None  # the writer was closed, not left running


# -- 3. stalls: raised when real, never while an update or a save runs -------------------------


async def test_produce_batch_after_a_pause_with_partials_is_a_stall() -> None:
    producer = make_producer(8, sim={"per_token_latency_s": 1.0}, max_new_tokens=8)
    async with producer:
        engine = producer.engine
        assert isinstance(engine, SimEngine)
        await engine.wait_progress(lambda: engine.running_requests == 8, GUARD_S)
        await producer.pause()
        assert producer.buffer.num_resume == 8
        with pytest.raises(StalledError, match="resume"):
            await producer.produce_batch(1, timeout=GUARD_S)
        await producer.resume()
        producer.check_ledger()


class HeldUpdateEngine(SimEngine):
    """An engine whose weight update waits until the test lets it finish."""

    def __init__(self, **overrides: Any) -> None:
        super().__init__(**overrides)
        self.updating = asyncio.Event()
        self.finish_update = asyncio.Event()

    async def update_weights(self, weights: Weights | None, *, version: int) -> None:
        if version > 0:
            self.updating.set()
            await self.finish_update.wait()
        await super().update_weights(weights, version=version)


async def test_a_waiting_produce_batch_is_no_stall_while_update_or_save_run(
    tmp_path: Path,
) -> None:
    engine = HeldUpdateEngine(vocab_size=VOCAB, per_token_latency_s=1.0)
    producer = Producer(
        engine, prompts(8), ones, group_size=2, sampling=SamplingConfig(max_new_tokens=8)
    )
    async with producer:
        prefetch = asyncio.create_task(producer.produce_batch(8))  # cannot fill for 8 s
        update = asyncio.create_task(producer.update_weights())
        await asyncio.wait_for(engine.updating.wait(), GUARD_S)
        assert producer.paused and not prefetch.done()
        engine.finish_update.set()
        assert await asyncio.wait_for(update, GUARD_S) == 1
        await producer.save(tmp_path / "ckpt")
        assert not prefetch.done()  # still waiting, not failed with a StalledError
        prefetch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await prefetch
        producer.check_ledger()


class HeldResumeEngine(SimEngine):
    """A keep-mode engine whose resume waits until the test lets it finish."""

    def __init__(self, **overrides: Any) -> None:
        super().__init__(**overrides)
        self.resuming = asyncio.Event()
        self.finish_resume = asyncio.Event()

    @property
    def supports_keep_pause(self) -> bool:
        return True

    async def resume_generation(self) -> None:
        self.resuming.set()
        await self.finish_resume.wait()
        await super().resume_generation()


async def test_a_produce_batch_is_no_stall_while_the_engine_resumes_after_an_update() -> None:
    """Keep mode, nothing in flight (max_staleness 0: the batch used the capacity up, the
    update gives it back). While the update's closing resume ran, the gate was still closed
    with no hold left: `produce_batch` raised `StalledError` "the buffer is full" with the
    buffer empty (seen in the chaos run's events)."""
    engine = HeldResumeEngine(vocab_size=VOCAB)
    producer = Producer(
        engine, prompts(8), ones, group_size=2, batch_size=2, max_staleness=0,
        pause_mode="keep", sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    async with producer:
        assert len((await producer.produce_batch()).groups) == 2
        update = asyncio.create_task(producer.update_weights())
        await asyncio.wait_for(engine.resuming.wait(), GUARD_S)
        batch = asyncio.create_task(producer.produce_batch())
        with contextlib.suppress(TimeoutError):  # a stall would be raised at once
            await asyncio.wait_for(asyncio.shield(batch), 1.0)
        assert not batch.done()
        engine.finish_resume.set()
        assert await asyncio.wait_for(update, GUARD_S) == 1
        assert len((await asyncio.wait_for(batch, GUARD_S)).groups) == 2
        producer.check_ledger()


# -- 4. a pause keeps finished generations ------------------------------------------------------


async def test_pause_waits_for_groups_being_scored_instead_of_regenerating_them() -> None:
    """A pause waits for a group being scored, however much longer than abort_timeout_s the
    judge takes: it keeps the finished generation instead of aborting it."""
    scoring = asyncio.Event()
    answer = asyncio.Event()

    async def slow_judge(group: RolloutGroup) -> list[float]:
        scoring.set()
        await answer.wait()  # answers once the test has seen the pause wait for it
        return ones(group)

    producer = make_producer(1, reward=slow_judge, group_size=2, abort_timeout_s=0.1)
    async with producer:
        await asyncio.wait_for(scoring.wait(), GUARD_S)
        pause = asyncio.create_task(producer.pause())
        # 5 x abort_timeout_s: a pause that gave up on the judge would be done by now (on a
        # busy machine it may not be yet, so a broken pause can pass, never a working fail)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(pause), 0.5)
        assert not pause.done()  # the judge has not answered: the pause still waits
        answer.set()
        await asyncio.wait_for(pause, GUARD_S)
        assert producer.buffer.num_ready == 1 and producer.buffer.num_resume == 0
        await producer.resume()
        batch = await producer.produce_batch(1)
    assert producer.engine.calls == 1  # type: ignore[attr-defined]  # never regenerated
    c = producer.progress.counters
    assert c.generated_tokens == c.consumed_tokens == 2 * 16
    assert batch.groups[0].rewards().tolist() == [1.0, 1.0]


# -- 5. the byte bound counts the prompt --------------------------------------------------------


async def test_long_prompts_stay_within_the_byte_bound() -> None:
    long_prompts = [[(i + j) % VOCAB for j in range(1000)] for i in range(10)]
    limit = 7000  # one group with its 1,000-token prompt fits, two do not
    producer = Producer(
        SimEngine(vocab_size=VOCAB), long_prompts, ones, group_size=2,
        max_buffer_bytes=limit, sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    peaks: list[int] = []
    notify = producer._changed.notify

    def checked() -> None:
        stats = producer.buffer.stats()
        peaks.append(stats.held_bytes + stats.reserved_bytes)
        notify()

    producer._changed.notify = checked  # type: ignore[method-assign]
    async with producer:
        consumed = await consume_all(producer, 1)
    assert len(consumed) == 10
    assert max(peaks) <= limit and max(peaks) > 4000  # the prompt's bytes were counted


# -- 8. aborts reach requests in every state; ids never repeat ----------------------------------


class RecordingEngine(SimEngine):
    """Records every request id it is asked to generate, and what each one returned."""

    def __init__(self, **overrides: Any) -> None:
        super().__init__(**overrides)
        self.ids: list[str] = []
        self.finishes: list[str] = []

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        self.ids.append(request.request_id)
        outputs = await super().generate(request)
        self.finishes += [o.finish_reason for o in outputs]
        return outputs


async def test_a_group_paused_before_its_engine_call_never_reaches_the_engine() -> None:
    engine = RecordingEngine(vocab_size=VOCAB)
    producer: Producer
    seen_at_pause: list[int] = []

    async def source() -> AsyncIterator[list[int]]:
        yield [1, 2]
        # the first group's task is started but has not run: pause right now
        await producer.pause()
        seen_at_pause.append(len(engine.ids))
        yield [3, 4]

    producer = Producer(
        engine, source(), ones, group_size=2, sampling=SamplingConfig(max_new_tokens=4)
    )
    async with producer:
        await wait_for(producer, lambda: producer.buffer.num_resume == 1)
        await producer.resume()
        consumed = await consume_all(producer, 1)
    assert seen_at_pause == [0]  # the pause came first: nothing was generated, then aborted
    assert len(consumed) == 2 and "abort" not in engine.finishes
    producer.check_ledger()


async def test_request_ids_are_unique_across_producers_on_one_engine() -> None:
    engine = RecordingEngine(vocab_size=VOCAB, per_token_latency_s=1.0)
    for _ in range(2):  # the same prompts, so the same uids and attempts
        producer = Producer(
            engine, prompts(4), ones, group_size=2, sampling=SamplingConfig(max_new_tokens=8)
        )
        async with producer:
            await engine.wait_progress(lambda: engine.running_requests == 4, GUARD_S)
            await producer.pause()  # aborts, some of them maybe before the engine saw them
        assert producer.buffer.num_resume == 4
    assert len(engine.ids) == len(set(engine.ids))


async def test_a_fresh_producer_is_not_poisoned_by_an_earlier_runs_aborts() -> None:
    """An earlier run on this engine aborted requests that never started (a drain does that):
    the engine remembers those ids, so a new run must never use them again."""
    engine = RecordingEngine(vocab_size=VOCAB)
    for uid in range(4):  # what an earlier run with per-run ids "<uid>-<attempt>" left behind
        for attempt in range(2):
            await engine.abort(f"{uid}-{attempt}")
    producer = Producer(
        engine, prompts(4), ones, group_size=2, sampling=SamplingConfig(max_new_tokens=4)
    )
    async with producer:
        consumed = await consume_all(producer, 4)
    assert len(consumed) == 4 and engine.finishes == ["length"] * 8


# -- 9. pause and update_weights are all or nothing ---------------------------------------------


class FailingControlEngine(SimEngine):
    """`pause_generation` raises; `update_weights` with weights hangs while it loads, before
    it labels (as the `Engine.version` contract has it: load, then label). `asked` records
    the version of every update it was asked for."""

    def __init__(self, **overrides: Any) -> None:
        super().__init__(**overrides)
        self.asked: list[int] = []

    @property
    def supports_keep_pause(self) -> bool:
        return True

    async def pause_generation(self) -> None:
        raise RuntimeError("pause refused")

    async def update_weights(self, weights: Weights | None, *, version: int) -> None:
        self.asked.append(version)
        if weights is not None:
            await asyncio.Event().wait()  # still loading: the label never changes
        await super().update_weights(None, version=version)


async def test_a_failed_pause_leaves_the_producer_running() -> None:
    producer = Producer(
        FailingControlEngine(vocab_size=VOCAB), prompts(6), ones, group_size=2,
        pause_mode="keep", sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    async with producer:
        with pytest.raises(RuntimeError, match="pause refused"):
            await producer.pause()
        assert not producer.paused
        consumed = await consume_all(producer, 2)
    assert len(consumed) == 6


class HalfPausingEngine(SimEngine):
    """`pause_generation` pauses, then fails (a server that paused, then timed out answering)."""

    async def pause_generation(self) -> None:
        await super().pause_generation()
        raise RuntimeError("pause answered too late")


async def test_a_pause_that_failed_after_pausing_the_engine_is_undone_in_the_engine() -> None:
    engine = HalfPausingEngine(vocab_size=VOCAB, per_token_latency_s=0.001)
    producer = Producer(
        engine, prompts(6), ones, group_size=2, pause_mode="keep",
        sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    async with producer:
        with pytest.raises(RuntimeError, match="too late"):
            await producer.pause()
        assert not producer.paused and engine._running.is_set()
        async with asyncio.timeout(GUARD_S):
            assert len(await consume_all(producer, 2)) == 6


class FailingResumeEngine(SimEngine):
    """`resume_generation` fails (the engine may stay paused)."""

    async def resume_generation(self) -> None:
        raise RuntimeError("resume refused")


async def test_an_update_whose_engine_fails_to_resume_is_not_reported_as_failed() -> None:
    """In "keep" mode the update's last step resumes the engine. When that failed, the update
    had been made (version bumped) yet `update_weights` raised the engine's error, so a
    trainer retrying it bumped the version twice, and the producer ran on a paused engine."""
    producer = Producer(
        FailingResumeEngine(vocab_size=VOCAB), prompts(6), ones, group_size=2,
        pause_mode="keep", sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    with pytest.raises(ProducerError, match="could not be resumed"):
        async with producer:
            assert await producer.update_weights(None) == 1
            await producer.produce_batch(1, timeout=GUARD_S)
    assert producer.version == 1


async def test_a_run_ended_while_paused_in_keep_mode_leaves_the_engine_running() -> None:
    """The documented way on after an error is a new producer on the same engine; one that
    ended while paused in "keep" mode left the engine frozen, so every group of the next run
    waited for its generate deadline and failed."""
    engine = SimEngine(vocab_size=VOCAB, per_token_latency_s=0.001)

    def producer() -> Producer:
        return Producer(
            engine, prompts(4), ones, group_size=2, pause_mode="keep",
            sampling=SamplingConfig(max_new_tokens=4),
        )  # fmt: skip

    first = producer()
    async with first:
        await first.produce_batch(1, timeout=GUARD_S)
        await first.pause()
    assert engine._running.is_set()
    second = producer()
    async with second, asyncio.timeout(GUARD_S):
        assert len(await consume_all(second, 2)) == 4


async def test_an_update_cut_before_the_engine_committed_leaves_both_at_the_old_version() -> None:
    """Cut while the engine still loads (at `update_timeout_s`), the engine keeps its old label
    (load, then label), so there is nothing to set back; the producer used to relabel it all
    the same, a call that on an engine which had committed mislabelled every later token."""
    engine = FailingControlEngine(vocab_size=VOCAB)
    drops: list[DropRecord] = []
    producer = Producer(
        engine, prompts(6), ones, group_size=2, update_timeout_s=0.2, on_drop=drops.append,
        sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    async with producer:
        with pytest.raises(UpdateWeightsError, match="stays at version 0"):
            await producer.update_weights([("w", np.zeros(2))])
        assert producer.version == 0 and engine.version == 0 and not producer.paused
        assert engine.asked == [0, 1]  # entry, the update: no call relabels the engine
        consumed = await consume_all(producer, 2)
    assert len(consumed) == 6 and not drops  # no group fails a version check
    assert all(int(s.versions.max()) == 0 for g in consumed for s in g.samples)


class RefusingUpdateEngine(SimEngine):
    """Refuses every update before loading anything, as an engine does with weights (or an
    adapter) the model cannot take: its error names the tensor."""

    async def update_weights(self, weights: Weights | None, *, version: int) -> None:
        if weights is not None:
            raise LoraError("adapter tensor 'layers.0.q_proj.lora_A' is float8: not servable")
        await super().update_weights(weights, version=version)


async def test_a_refused_update_keeps_the_engines_reason_as_its_cause() -> None:
    """The caller gets one type for "not committed, the run goes on" (`UpdateWeightsError`),
    with the engine's own error (a `LoraError` naming the tensor, say) as its cause: it used
    to be raised `from None`, and the reason was only in the message."""
    engine = RefusingUpdateEngine(vocab_size=VOCAB)
    producer = Producer(
        engine, prompts(4), ones, group_size=2, sampling=SamplingConfig(max_new_tokens=4)
    )
    async with producer:
        with pytest.raises(UpdateWeightsError, match="float8") as caught:
            await producer.update_weights([("w", np.zeros(2))])
        assert isinstance(caught.value.__cause__, LoraError)
        assert producer.version == 0 and len(await consume_all(producer, 2)) == 4


class CancellingUpdateEngine(SimEngine):
    """`update_weights` with weights has its caller's anyio scope cancelled (a trainer's
    deadline passing) while it still loads, before it labels. Its control calls await, as a
    real engine's do. `asked` records the version of every update it was asked for."""

    scope: anyio.CancelScope | None = None
    pause_scope: anyio.CancelScope | None = None

    def __init__(self, **overrides: Any) -> None:
        super().__init__(**overrides)
        self.asked: list[int] = []

    async def update_weights(self, weights: Weights | None, *, version: int) -> None:
        self.asked.append(version)
        if weights is not None and self.scope is not None:
            self.scope.cancel()
            await asyncio.Event().wait()
        await super().update_weights(None, version=version)

    async def pause_generation(self) -> None:
        await super().pause_generation()
        if self.pause_scope is not None:  # paused, then cancelled before it answered
            self.pause_scope.cancel()
            await asyncio.Event().wait()

    async def resume_generation(self) -> None:
        # a real suspension point, as a real engine's resume has (where a cancelled scope
        # strikes); no wait for anything
        await asyncio.sleep(0.001)
        await super().resume_generation()


@pytest.mark.parametrize("pause_mode", ["abort", "keep"])
async def test_an_update_cancelled_by_an_anyio_scope_before_it_committed_changes_nothing(
    pause_mode: str,
) -> None:
    """A cancelled anyio scope cancels every await in it, those after the update's too: in
    "keep" mode the engine stayed paused, after the update as after a pause cancelled once the
    engine had paused. Cancelled before the engine labelled, both stay at the old version and
    nothing relabels the engine."""
    engine = CancellingUpdateEngine(vocab_size=VOCAB, update_latency_s=0.001)
    producer = Producer(
        engine, prompts(6), ones, group_size=2, pause_mode=pause_mode,
        sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    async with producer:
        with anyio.CancelScope() as engine.scope:
            await producer.update_weights([("w", np.zeros(2))])
        assert engine.scope.cancelled_caught
        assert producer.version == 0 and engine.version == 0 and not producer.paused
        assert engine.asked == [0, 1] and engine._running.is_set()
        if pause_mode == "keep":  # a pause cancelled once the engine had paused
            with anyio.CancelScope() as engine.pause_scope:
                await producer.pause()
            assert engine.pause_scope.cancelled_caught
            assert not producer.paused and engine._running.is_set()
        consumed = await consume_all(producer, 2)
    assert len(consumed) == 6
    assert all(int(s.versions.max()) == 0 for g in consumed for s in g.samples)


class CommitThenCutEngine(SimEngine):
    """Commits an update (loads, then labels), then is cut before `update_weights` returns,
    as `VLLMServerEngine` cut at its final `/resume`: by an error (`how="error"`), by hanging
    past `update_timeout_s` ("hang") or by its caller's anyio scope ("cancel"). With `third`,
    it reports that version after the cut instead: a label on neither the old nor the new
    weights, which breaks the `Engine.version` contract."""

    scope: anyio.CancelScope | None = None

    def __init__(self, how: str, third: int | None = None, **overrides: Any) -> None:
        super().__init__(**overrides)
        self.how, self.third = how, third
        self.asked: list[int] = []

    async def update_weights(self, weights: Weights | None, *, version: int) -> None:
        self.asked.append(version)
        await super().update_weights(weights, version=version)
        if weights is None:  # the producer's entry
            return
        if self.third is not None:
            self._version = self.third
        match self.how:
            case "error":
                raise RuntimeError("resume answered too late")
            case "hang":
                await asyncio.Event().wait()
            case "cancel":
                assert self.scope is not None
                self.scope.cancel()
                await asyncio.Event().wait()


@pytest.mark.parametrize("pause_mode", ["abort", "keep"])
@pytest.mark.parametrize("how", ["error", "hang", "cancel"])
async def test_an_update_cut_after_the_engine_committed_it_is_adopted(
    how: str, pause_mode: str
) -> None:
    """Issue 24 (`cut_resume`): an update cut once the engine had committed it (weights loaded
    and labelled) was "rolled back" by relabelling the new weights with the old version, so
    every later token was mislabelled. The producer adopts what the engine committed: it moves
    to the new version and expires what became too stale, as after any update; an error or a
    timeout after the commit is no failed update (a caller would repeat it), a cancellation
    still reaches its scope."""
    engine = CommitThenCutEngine(how, vocab_size=VOCAB, per_token_latency_s=0.001)
    drops: list[DropRecord] = []
    producer = Producer(
        engine, prompts(8), ones, group_size=2, batch_size=2, pause_mode=pause_mode,
        max_staleness=0, update_timeout_s=0.2, on_drop=drops.append,
        sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    async with producer:
        await wait_for(producer, lambda: producer.buffer.num_ready >= 1)
        if how == "cancel":
            with anyio.CancelScope() as engine.scope:
                await producer.update_weights([("w", np.zeros(2))])
            assert engine.scope.cancelled_caught
        else:
            assert await producer.update_weights([("w", np.zeros(2))]) == 1
        assert producer.version == 1 and engine.version == 1 and not producer.paused
        assert engine.asked == [0, 1] and engine._running.is_set()
        assert any(d.outcome is PutOutcome.DROPPED_EXPIRED for d in drops)  # too stale now
        batch = await producer.produce_batch(2, timeout=GUARD_S)  # max_staleness=0: all new
    assert [int(s.versions.min()) for g in batch.groups for s in g.samples] == [1] * 4


@pytest.mark.parametrize("how", ["error", "cancel"])
async def test_an_engine_that_reports_a_third_label_after_a_cut_update_stops_the_run(
    how: str,
) -> None:
    """After a cut update the engine's label must be the old version or the new one; any other
    is on weights nobody can name, and every later token would carry it."""
    engine = CommitThenCutEngine(how, third=7, vocab_size=VOCAB)
    producer = Producer(
        engine, prompts(6), ones, group_size=2, update_timeout_s=0.2,
        sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    with pytest.raises(ProducerError, match=r"version 7.*neither 0 .*nor 1"):
        async with producer:
            with anyio.CancelScope() as engine.scope:
                await producer.update_weights([("w", np.zeros(2))])
            await producer.produce_batch(1, timeout=GUARD_S)
    assert producer.version == 0 and engine.asked == [0, 1] and not producer.running


async def test_a_pausing_block_cancelled_by_an_anyio_scope_resumes_the_engine() -> None:
    """`pausing()` resumes in a `finally`, whose await a cancelled anyio scope cancelled at
    once: in "keep" mode the gate opened on a frozen engine."""
    engine = CancellingUpdateEngine(vocab_size=VOCAB)
    producer = Producer(
        engine, prompts(6), ones, group_size=2, pause_mode="keep",
        sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    async with producer:
        with anyio.CancelScope() as scope:
            async with producer.pausing():
                scope.cancel()
                await anyio.lowlevel.checkpoint()
        assert scope.cancelled_caught and not producer.paused
        assert engine._running.is_set()
        assert len(await consume_all(producer, 2)) == 6


# -- 10. engine errors are named for what they are ----------------------------------------------


class RaisingEngine(SimEngine):
    def __init__(self, error: BaseException, **overrides: Any) -> None:
        super().__init__(**overrides)
        self.error = error

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        self.calls += 1
        await asyncio.sleep(0)  # raises after a suspension, as a real engine's call does
        raise self.error


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (TimeoutError("http read timed out"), "TimeoutError: http read timed out"),
        (asyncio.CancelledError(), "CancelledError though nothing cancelled"),
    ],
)
async def test_engine_errors_are_reported_as_raised_and_not_retried(
    error: BaseException, message: str
) -> None:
    engine = RaisingEngine(error, vocab_size=VOCAB)
    drops: list[DropRecord] = []
    producer = Producer(
        engine, prompts(5), ones, group_size=2, on_drop=drops.append,
        sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    async with producer:
        with pytest.raises(ProducerExhausted):
            await producer.produce_batch(1, timeout=GUARD_S)
    assert engine.calls == 5  # one attempt per group: never a loop of "partials"
    assert [d.reason for d in drops] == [FailureReason.ENGINE_ERROR] * 5
    assert all(message in (d.error or "") for d in drops)
    assert "generate_timeout_s" not in (drops[0].error or "")


# -- 11. a run where every group dies stops with the counts -------------------------------------


def endless() -> Iterator[list[int]]:
    i = 0
    while True:
        yield [i % VOCAB, 1]
        i += 1


async def test_every_group_filtered_on_an_endless_source_stops_with_counts() -> None:
    producer = Producer(
        SimEngine(vocab_size=VOCAB), endless(), ones, group_size=2, filter=lambda g: False,
        max_dropped_in_a_row=50, sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    with pytest.raises(ProducerError, match=r"filtered x50") as raised:
        async with producer:
            await producer.produce_batch(1, timeout=GUARD_S)
    assert "max_dropped_in_a_row=50" in str(raised.value)
    assert 50 <= producer.progress.counters.filtered_groups < 50 + 64  # stopped near the bound


async def test_a_reward_that_always_raises_stops_with_the_reason() -> None:
    def broken(group: RolloutGroup) -> list[float]:
        raise KeyError("answer")

    producer = Producer(
        SimEngine(vocab_size=VOCAB), endless(), broken, group_size=2, max_dropped_in_a_row=20,
        max_reward_failures_at_start=None, sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    with pytest.raises(ProducerError, match=r"reward_error x20: .*raised KeyError: 'answer'"):
        async with producer:
            await producer.produce_batch(1, timeout=GUARD_S)
    producer.check_ledger()


async def test_one_completed_group_resets_the_count_of_dead_ones() -> None:
    def every_third(group: RolloutGroup) -> list[float]:
        if group.uid % 3 == 2:
            return ones(group)
        raise ValueError("flaky judge")

    producer = make_producer(
        30, reward=every_third, group_size=2, max_dropped_in_a_row=3, max_inflight_groups=1
    )
    async with producer:
        consumed = await consume_all(producer, 1)
    assert len(consumed) == 10 and producer.progress.counters.failed_groups == 20


# -- 12. on_drop sees the ledger after every drop of a step is counted --------------------------


async def test_on_drop_sees_a_complete_ledger_when_several_groups_expire_at_once() -> None:
    producer: Producer
    seen: list[tuple[int, int]] = []

    def on_drop(record: DropRecord) -> None:
        producer.check_ledger()
        seen.append((record.uid, producer.progress.counters.expired_groups))

    producer = make_producer(
        8, group_size=2, reward=parity_reward, batch_size=4, max_staleness=0, on_drop=on_drop
    )
    async with producer:
        await wait_for(producer, lambda: producer.buffer.num_ready == 4)
        await producer.update_weights()
        assert sorted(uid for uid, _ in seen) == [0, 1, 2, 3]
        assert {expired for _, expired in seen} == {4}  # all counted before the first report
        consumed = await consume_all(producer, 4)
    assert len(consumed) == 8 and len({g.prompt_id for g in consumed}) == 8  # re-queued once


# -- 17. resuming names the weights the engine serves -------------------------------------------


async def test_resuming_a_trained_checkpoint_needs_the_weights(tmp_path: Path) -> None:
    producer = make_producer(4, group_size=2, reward=ones)
    async with producer:
        await producer.produce_batch(1)
        await producer.update_weights()
        await producer.save(tmp_path / "ckpt")
    fresh = make_producer(4, group_size=2, reward=ones)
    with pytest.raises(ValueError, match="weights="):
        fresh.load(tmp_path / "ckpt")
    fresh.load(tmp_path / "ckpt", weights=[("w", np.zeros(2))])
    async with fresh:
        assert fresh.version == 1 and fresh.engine.version == 1  # type: ignore[attr-defined]
        rest = await consume_all(fresh, 1)
    assert len(rest) == 3


# -- a pause at every await point ---------------------------------------------------------------


async def test_an_update_at_every_state_change_loses_nothing(tmp_path: Path) -> None:
    """Each state change of the producer starts a save (the first of every five) or an
    update_weights, one at a time: pauses land at every point of a group's life (starting,
    generating, scoring, landing). Every prompt ends exactly once; the ledger holds throughout."""
    drops: list[DropRecord] = []
    producer = make_producer(
        40, sim={"per_token_latency_s": 0.0005, "lengths": "uniform", "fail_rate": 0.1},
        max_new_tokens=16, on_drop=drops.append, max_inflight_groups=6,
    )  # fmt: skip
    busy: list[asyncio.Task[Any]] = []
    done = Counter[str]()
    notify = producer._changed.notify

    async def interrupt(kind: str) -> None:
        if kind == "save":
            await producer.save(tmp_path / "ckpt")
        else:
            await producer.update_weights()
        done[kind] += 1

    def interrupting_notify() -> None:
        producer.check_ledger()
        notify()
        if producer.running and producer.error is None and not any(not t.done() for t in busy):
            kind = "save" if len(busy) % 5 == 0 else "update"
            busy.append(asyncio.create_task(interrupt(kind)))

    producer._changed.notify = interrupting_notify  # type: ignore[method-assign]
    async with producer:
        consumed = await consume_all(producer, 4)
        await asyncio.gather(*busy)
    ends = Counter(g.prompt_id for g in consumed)
    ends.update(d.prompt_id for d in drops)
    assert len(ends) == 40 and set(ends.values()) == {1}
    assert done["save"] >= 1 and done["update"] >= 1 and producer.version == done["update"]
    producer.check_ledger()


# -- issue 25: the last edges ------------------------------------------------------------------


class RecordingBudgetEngine(SimEngine):
    """Records each sample's `max_new_tokens` it was handed."""

    budgets: list[int]

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        self.budgets = getattr(self, "budgets", []) + [s.max_new_tokens for s in request.samples]
        return await super().generate(request)


def partial_checkpoint(lengths: Sequence[int]) -> ProducerState:
    """A checkpoint holding one partial group whose samples have `lengths` tokens each (cut
    off by a pause), with counters that balance its ledger."""
    samples = tuple(
        msgspec.structs.replace(
            make_sample(n, status=Status.ABORTED, finish="abort", reward=None, seed=i),
            extra={},
        )
        for i, n in enumerate(lengths)
    )
    group = RolloutGroup(
        uid=0, prompt_id="default/0", task="default", prompt_tokens=np.arange(3, dtype=np.int32),
        samples=samples, status=Status.ABORTED, attempts=1,
    )  # fmt: skip
    counters = ProgressCounters(
        started_groups=1, started_samples=len(lengths), generated_tokens=sum(lengths),
        policy_tokens=sum(lengths),
    )  # fmt: skip
    cursor = msgspec.structs.replace(PromptStream(prompts(4)).state(), drawn={"default": 1})
    return ProducerState(
        format=STATE_FORMAT, version=0, next_uid=1, group_size=len(lengths), counters=counters,
        latency_counts=[0] * LatencyHistogram.BUCKETS, cursor=cursor, ready=[],
        resume=[encode(group)],
    )  # fmt: skip


async def test_a_resume_with_a_smaller_budget_finishes_long_partials_as_length() -> None:
    """Issue 25: a checkpoint of max_new_tokens=64 resumed with 8 handed the engine negative
    budgets; every partial group failed as engine_error and its prompt was gone."""
    engine = RecordingBudgetEngine(vocab_size=VOCAB)
    producer = Producer(
        engine, prompts(4), ones, group_size=3, sampling=SamplingConfig(max_new_tokens=8)
    )
    producer.load_state_dict(loads(dumps(partial_checkpoint([20, 8, 5]))))
    async with producer, asyncio.timeout(GUARD_S):
        consumed = await consume_all(producer, 1)
    producer.check_ledger()
    assert all(b >= 1 for b in engine.budgets) and 3 in engine.budgets  # 8 - 5 tokens left
    resumed = next(g for g in consumed if g.uid == 0)
    assert [len(s.tokens) for s in resumed.samples] == [8, 8, 8]
    assert [s.finish_reason for s in resumed.samples] == ["length", "length", "length"]
    assert producer.progress.counters.failed_groups == 0
    assert producer.progress.counters.wasted_tokens_truncated == 12  # the 20's last 12 tokens


def test_build_request_never_hands_the_engine_a_budget_below_one() -> None:
    group = RolloutGroup(
        uid=0, prompt_id="p", task="t", prompt_tokens=np.arange(3, dtype=np.int32),
        samples=(make_sample(9, status=Status.ABORTED, finish="abort"),), status=Status.ABORTED,
    )  # fmt: skip
    with pytest.raises(ValueError, match="budget"):
        rollout.build_request(group, "r", SamplingConfig(max_new_tokens=8), 8)


async def test_a_fresh_producer_refuses_to_rewind_a_trained_engines_label() -> None:
    """Issue 25: a second producer on an engine at version 2 relabelled it 0 on entry, and the
    training producer on it expired every group from then on."""
    engine = SimEngine(vocab_size=VOCAB)
    trainer = Producer(
        engine, prompts(8), ones, group_size=2, sampling=SamplingConfig(max_new_tokens=4)
    )
    async with trainer:
        await trainer.update_weights(None)
        await trainer.update_weights(None)
    evaluation = Producer(
        engine, prompts(4), ones, group_size=2, sampling=SamplingConfig(max_new_tokens=4)
    )
    with pytest.raises(ValueError, match="serves version 2"):
        async with evaluation:
            pass
    assert engine.version == 2 and not evaluation.running


class StuckLabelEngine(SimEngine):
    """Stamps version 0 whatever it is told: an engine whose label another producer rewound."""

    async def update_weights(self, weights: Weights | None, *, version: int) -> None:
        await super().update_weights(weights, version=0)


async def test_an_expiry_storm_stops_the_run_with_its_reason() -> None:
    """Issue 25: groups that expired on arrival did not count toward max_dropped_in_a_row; a
    producer whose engine stamped a rewound label expired thousands without a word."""
    producer = Producer(
        StuckLabelEngine(vocab_size=VOCAB), endless(), ones, group_size=2, batch_size=2,
        max_staleness=1, max_dropped_in_a_row=20, sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    with pytest.raises(ProducerError, match=r"expired.*version label"):
        async with producer:
            await producer.update_weights(None)
            await producer.update_weights(None)
            await producer.produce_batch(2, timeout=GUARD_S)


@pytest.mark.parametrize("episodes", [False, True], ids=["single-turn", "episodes"])
async def test_a_keep_mode_pause_does_not_count_against_generate_timeout_s(episodes: bool) -> None:
    """Issue 25: a pause longer than a request's remaining time failed every group in flight
    as engine_deadline (and every turn of an episode frozen in the engine). The pause below
    outlasts the deadline on purpose (the scenario, not a synchronisation): the requests frozen
    in the engine through it must not fail."""
    engine = SimEngine(vocab_size=VOCAB, per_token_latency_s=0.005)
    drops: list[DropRecord] = []
    producer = Producer(
        engine, prompts(8), ones, group_size=2, pause_mode="keep", generate_timeout_s=1.0,
        on_drop=drops.append, sampling=SamplingConfig(max_new_tokens=40),
        rollout_fn=single_turn if episodes else None,
    )  # fmt: skip
    async with producer:
        await engine.wait_progress(lambda: engine.running_requests >= 4, GUARD_S)  # in the engine
        async with producer.pausing():
            await asyncio.sleep(1.5)  # paused past generate_timeout_s
        consumed = await consume_all(producer, 2)
    assert not drops and len(consumed) == 8, [d.error for d in drops]


class RefusedWhilePaused(SimEngine):
    """A simulated engine whose vLLM someone else paused: its request is refused and sent
    again (counted in `pause_refusals`, as asyncroll's vLLM engines count each refusal) and
    never answered, or (`refusals=0`) simply never answered."""

    def __init__(self, refusals: int) -> None:
        super().__init__(vocab_size=VOCAB)
        self.refusals = refusals
        self.pause_refusals = 0

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        self.pause_refusals += self.refusals
        await asyncio.Event().wait()
        raise AssertionError("never answered")


@pytest.mark.parametrize("refusals", [0, 3])
async def test_a_deadline_run_out_while_vllm_was_paused_by_someone_else_says_so(
    refusals: int,
) -> None:
    """With the defaults the producer's `generate_timeout_s` runs out before the engine's own
    request deadline: a group whose requests a paused vLLM kept refusing failed as
    engine_deadline with nothing that named the pause. It names it, with what to do."""
    drops: list[DropRecord] = []
    producer = Producer(
        RefusedWhilePaused(refusals), prompts(1), ones, group_size=2, generate_timeout_s=0.1,
        on_drop=drops.append,
    )  # fmt: skip
    async with producer, asyncio.timeout(GUARD_S):
        assert await consume_all(producer, 1) == []
    (drop,) = drops
    assert drop.reason is FailureReason.ENGINE_DEADLINE
    assert "generate_timeout_s=0.1" in drop.error
    if refusals:
        assert f"vLLM refused {refusals} of the engine's requests" in drop.error
        assert 'mode="keep"' in drop.error
    else:
        assert "paused" not in drop.error


async def test_a_single_turn_checkpoint_resumed_with_episodes_counts_its_tokens_wasted() -> None:
    """Issue 25 (suspected, confirmed): episodes restart a group from its prompt, so a single-
    turn partial's tokens are not continued: they are wasted, and the ledger must say so."""
    producer = Producer(
        SimEngine(vocab_size=VOCAB), prompts(4), ones, group_size=2, rollout_fn=single_turn,
        sampling=SamplingConfig(max_new_tokens=8),
    )  # fmt: skip
    producer.load_state_dict(loads(dumps(partial_checkpoint([5, 3]))))
    async with producer, asyncio.timeout(GUARD_S):
        consumed = await consume_all(producer, 1)
    producer.check_ledger()
    resumed = next(g for g in consumed if g.uid == 0)
    assert [len(s.tokens) for s in resumed.samples] == [8, 8]
    assert producer.progress.counters.wasted_tokens_restarted == 8
