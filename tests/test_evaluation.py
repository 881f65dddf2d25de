"""`Evaluator`: pass@k maths, isolation from the run, evaluation across updates, failures.

The run's side uses `SimEngine`, a simulation: it checks the producer's logic, not language.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import re
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from asyncroll import Producer, Prompt, RolloutGroup, SamplingConfig, SimEngine
from asyncroll.engines.base import GenerateRequest, SampleOutput
from asyncroll.evaluation import EvalResult, Evaluator, pass_at_k

VOCAB = 64


def prompts(n: int, task: str = "t") -> list[Prompt]:
    return [
        Prompt(tokens=[3, 4, 5 + i % 50], task=task, prompt_id=f"{task}/{i}",
               metadata={"level": i % 2, "answer": i % 3})
        for i in range(n)
    ]  # fmt: skip


def sample_index_reward(group: RolloutGroup) -> list[float]:
    """Rewards that depend on neither tokens nor timing: sample i of every group scores i % 2."""
    return [float(i % 2) for i in range(len(group.samples))]


def answer_reward(group: RolloutGroup) -> list[float]:
    """1 for prompts whose answer is 0 (a third of them), on every sample."""
    return [float(group.metadata["answer"] == 0)] * len(group.samples)


def make_producer(engine: Any, **options: Any) -> Producer:
    return Producer(
        engine,
        itertools.cycle(prompts(16)),
        sample_index_reward,
        group_size=4,
        batch_size=4,
        max_staleness=1,
        sampling=SamplingConfig(max_new_tokens=6),
        **options,
    )


# -- pass@k ---------------------------------------------------------------------------------------


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of k-subsets of n samples (c of them passing) that hold a pass."""
    subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_is_stable_for_large_n_and_checks_its_arguments() -> None:
    # math.comb would need exact integers of hundreds of digits; the product needs none
    exact = 1 - math.comb(1000 - 3, 100) / math.comb(1000, 100)
    assert pass_at_k(1000, 3, 100) == pytest.approx(exact, rel=1e-12)
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 6, 5) == 1.0
    for bad in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass_at_k needs"):
            pass_at_k(*bad)


# -- results ----------------------------------------------------------------------------------


async def test_scores_pass_at_k_and_breakdowns_land_in_flat_metrics() -> None:
    async with SimEngine(vocab_size=VOCAB) as engine, make_producer(engine) as producer:
        evaluator = Evaluator(
            producer, prompts(12), answer_reward, samples=4, k=(1, 4), by=["level"],
            sampling=SamplingConfig(max_new_tokens=3, temperature=1.0),
        )  # fmt: skip
        result = await evaluator.run()
    assert result.error is None and not result.failed and result.incomplete == 0
    assert result.version == 0 and len(result.groups) == 12
    assert all(len(s.tokens) == 3 for g in result.groups for s in g.samples)
    m = result.metrics()
    assert m["eval/pass@1"] == pytest.approx(4 / 12) and m["eval/pass@4"] == pytest.approx(4 / 12)
    assert m["eval/reward_mean"] == pytest.approx(4 / 12)
    assert m["eval/reward_mean_by_task/t"] == pytest.approx(4 / 12)
    # answers 0 are at i = 0, 3, 6, 9: levels 0, 1, 0, 1 of six prompts each
    assert m["eval/pass@1_by_level/0"] == pytest.approx(2 / 6)
    assert m["eval/version"] == 0 and m["eval/prompts"] == 12 and m["eval/error"] == 0


async def test_greedy_by_default_and_settings_checked_at_construction() -> None:
    async with SimEngine(vocab_size=VOCAB) as engine:
        producer = make_producer(engine)
        assert Evaluator(producer, prompts(2), answer_reward).sampling.temperature == 0.0
        with pytest.raises(ValueError, match="greedy samples are all the same"):
            Evaluator(producer, prompts(2), answer_reward, samples=4, k=(1,),
                      sampling=SamplingConfig(temperature=0.0))  # fmt: skip
        with pytest.raises(ValueError, match="1 <= k <= samples=2"):
            Evaluator(producer, prompts(2), answer_reward, samples=2, k=(1, 4))
        with pytest.raises(ValueError, match="at least one prompt"):
            Evaluator(producer, [], answer_reward)
        with pytest.raises(ValueError, match="metrics prefix"):
            Evaluator(producer, prompts(2), answer_reward, name="a/b")
        with pytest.raises(RuntimeError, match="inside `async with producer:`"):
            await Evaluator(producer, prompts(2), answer_reward).run()


# -- isolation ----------------------------------------------------------------------------------


class Trace(msgspec.Struct, frozen=True):
    ledgers: list[Any]
    versions: list[int]
    staleness: list[dict[int, int]]
    uids: list[list[int]]
    totals: Any


async def settle(producer: Producer) -> None:
    """Wait until the producer can start nothing more (its staleness capacity is used up) and
    nothing is in flight: a state that does not depend on how long the trainer took, so a run
    is the same run however its event loop interleaves with anything else."""
    await producer._changed.wait_until(
        lambda: not producer._inflight and producer._admission.next_step() is None, 30
    )


async def traced_run(seed: int, eval_every: int, results: list[EvalResult]) -> Trace:
    ledgers, versions, staleness, uids = [], [], [], []
    async with SimEngine(vocab_size=VOCAB, seed=seed) as engine:
        producer = make_producer(engine)
        evaluator = Evaluator(
            producer, prompts(6, task="held_out"), answer_reward, samples=2, k=(1, 2),
            sampling=SamplingConfig(max_new_tokens=5, temperature=1.0),
        )  # fmt: skip
        async with producer:
            for step in range(1, 9):
                batch = await producer.produce_batch()
                await settle(producer)
                if eval_every and step % eval_every == 0:
                    result = await evaluator.run()
                    assert result.version == producer.version
                    results.append(result)
                await settle(producer)
                ledgers.append(producer.check_ledger())
                versions.append(batch.version)
                staleness.append(batch.staleness_tokens())
                uids.append([g.uid for g in batch.groups])
                await producer.update_weights()
            totals = msgspec.structs.replace(
                producer.progress.counters.copy(), wait_s=0.0, idle_s=0.0
            )
    return Trace(ledgers, versions, staleness, uids, totals)


@pytest.mark.parametrize("seed", [0, 1])
async def test_evaluation_leaves_the_run_identical(seed: int) -> None:
    """Evaluating every 2 steps changes nothing of the training producer's: ledger, versions,
    staleness figures, which groups each batch holds, every counter. (The simulation draws
    every request's random tokens from one stream, the evaluator's too, so the run's lengths
    are fixed ("max") and its rewards read no token: what is compared is the producer's.)"""
    results: list[EvalResult] = []
    baseline = await traced_run(seed, 0, [])
    evaluated = await traced_run(seed, 2, results)
    assert [r.version for r in results] == [1, 3, 5, 7]  # evaluated at the step's version
    assert all(r.error is None and r.scores.prompts == 6 for r in results)
    assert evaluated == baseline
    assert baseline.versions == list(range(8))
    assert any(1 in s for s in baseline.staleness)  # the run does go off-policy


# -- evaluation across updates ------------------------------------------------------------------


@pytest.mark.parametrize("pause_mode", ["abort", "keep"])
async def test_an_update_during_evaluation_reruns_what_it_cut(pause_mode: str) -> None:
    """An update lands while every evaluation request is in the engine: what it cut is run
    again, and the result is labelled with the version each of its tokens was sampled at."""
    engine = SimEngine(vocab_size=VOCAB, per_token_latency_s=0.02)
    async with engine, make_producer(engine, pause_mode=pause_mode) as producer:
        evaluator = Evaluator(
            producer, prompts(4), answer_reward, sampling=SamplingConfig(max_new_tokens=50)
        )
        task = asyncio.create_task(evaluator.run())
        await producer._changed.wait_until(lambda: len(producer._control.guests) == 4, 10)
        assert await producer.update_weights() == 1
        result = await asyncio.wait_for(task, 30)
        ledger = producer.check_ledger()
    assert result.error is None and result.version == 1 and result.reruns == 4
    assert all(set(s.versions.tolist()) == {1} for g in result.groups for s in g.samples)
    assert all(len(s.tokens) == 50 for g in result.groups for s in g.samples)
    assert ledger.started_groups > 0  # the run went on beside it


async def test_a_policy_that_keeps_moving_ends_the_evaluation_with_an_error() -> None:
    engine = SimEngine(vocab_size=VOCAB, per_token_latency_s=0.02)
    async with engine, make_producer(engine) as producer:
        evaluator = Evaluator(
            producer, prompts(2), answer_reward, max_reruns=1,
            sampling=SamplingConfig(max_new_tokens=50),
        )  # fmt: skip
        task = asyncio.create_task(evaluator.run())
        for _ in range(2):  # each round is cut
            await producer._changed.wait_until(lambda: len(producer._control.guests) == 2, 10)
            await producer.update_weights()
        result = await asyncio.wait_for(task, 30)
    assert result.error is not None and "max_reruns=1" in result.error
    assert result.version is None and result.incomplete == 2
    assert math.isnan(result.metrics()["eval/version"]) and result.metrics()["eval/error"] == 1


async def test_evaluation_waits_for_a_pause() -> None:
    async with SimEngine(vocab_size=VOCAB) as engine, make_producer(engine) as producer:
        evaluator = Evaluator(producer, prompts(3), answer_reward)
        await producer.pause()
        asked: list[str] = []
        all_asked = asyncio.Event()
        guest_generate = producer.guest_generate

        async def asking(request: GenerateRequest, **kwargs: Any) -> Sequence[SampleOutput]:
            asked.append(request.request_id)
            if len(asked) == 3:
                all_asked.set()  # the waiter runs after this call has reached its own wait
            return await guest_generate(request, **kwargs)

        producer.guest_generate = asking  # type: ignore[method-assign]
        task = asyncio.create_task(evaluator.run())
        calls = engine.calls
        await asyncio.wait_for(all_asked.wait(), 10)  # every prompt has asked for the engine
        assert engine.calls == calls and not task.done()  # nothing reached the engine
        await producer.resume()
        result = await asyncio.wait_for(task, 10)
    assert result.error is None and result.scores.prompts == 3


# -- failures -----------------------------------------------------------------------------------


class FailingEvalEngine(SimEngine):
    """Raises for the evaluator's requests (ids start with "eval"), serves the run's."""

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        if request.request_id.startswith("eval"):
            raise RuntimeError("injected engine failure")
        return await super().generate(request)


async def test_failures_are_the_results_not_the_runs() -> None:
    def reward(group: RolloutGroup) -> list[float]:
        if group.metadata["answer"] == 1:
            raise ValueError("verifier broke")
        if group.metadata["answer"] == 2:
            return [float("nan")] * len(group.samples)
        return [1.0] * len(group.samples)

    bad = Prompt(tokens=[VOCAB + 5], task="t", prompt_id="bad")
    async with SimEngine(vocab_size=VOCAB) as engine, make_producer(engine) as producer:
        result = await Evaluator(producer, [*prompts(6), bad], reward).run()
        batch = await producer.produce_batch()  # the run goes on
    assert result.error is None and result.scores.prompts == 2
    assert result.scores.reward_mean == 1.0
    assert result.failed["bad"].startswith("bad_prompt:")
    assert "verifier broke" in result.failed["t/1"]
    assert result.failed["t/2"].startswith("reward_error:") and "not finite" in result.failed["t/2"]
    assert result.metrics()["eval/failed_prompts"] == 5
    assert len(batch.groups) == 4


async def test_engine_failures_and_deadlines_give_a_result() -> None:
    async with FailingEvalEngine(vocab_size=VOCAB) as engine, make_producer(engine) as producer:
        result = await Evaluator(producer, prompts(3), answer_reward).run()
        assert producer.running and producer.error is None
    assert result.scores.prompts == 0 and math.isnan(result.scores.reward_mean)
    assert all("injected engine failure" in why for why in result.failed.values())

    engine = SimEngine(vocab_size=VOCAB, per_token_latency_s=1.0)
    async with engine, make_producer(engine) as producer:
        evaluator = Evaluator(
            producer, prompts(2), answer_reward, timeout_s=0.2,
            sampling=SamplingConfig(max_new_tokens=50),
        )  # fmt: skip
        result = await evaluator.run()
        assert producer.running and not producer._control.guests
    assert result.error == "the evaluation did not finish within timeout_s=0.2"
    assert result.incomplete == 2


async def test_a_hung_reward_fails_its_prompt_within_the_deadline() -> None:
    async def hangs(group: RolloutGroup) -> list[float]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async with (
        SimEngine(vocab_size=VOCAB) as engine,
        make_producer(engine, reward_timeout_s=0.1) as producer,
    ):
        result = await Evaluator(producer, prompts(2), hangs).run()
    assert all(why.startswith("reward_deadline") for why in result.failed.values())
    assert len(result.failed) == 2


async def test_a_producer_that_stops_ends_the_evaluation_with_an_error() -> None:
    engine = SimEngine(vocab_size=VOCAB, per_token_latency_s=0.02)
    async with engine:
        producer = make_producer(engine)
        evaluator = Evaluator(
            producer, prompts(3), answer_reward, sampling=SamplingConfig(max_new_tokens=50)
        )
        async with producer:
            task = asyncio.create_task(evaluator.run())
            await producer._changed.wait_until(lambda: len(producer._control.guests) == 3, 10)
        # the stop's drain aborted the evaluation's requests with the run's
        result = await asyncio.wait_for(task, 10)
    assert result.error == "the producer stopped during the evaluation"
    assert result.version is None and result.incomplete == 3


# -- what the evaluator refuses -------------------------------------------------------------------


async def test_samples_on_a_greedy_producer_are_refused_as_with_greedy_sampling() -> None:
    """Without `sampling=`, `samples > 1` samples at the producer's temperature: a greedy
    producer would send n identical samples and report pass@n = pass@1."""
    async with SimEngine(vocab_size=VOCAB) as engine:
        producer = Producer(
            engine, prompts(4), answer_reward, group_size=2, batch_size=2,
            sampling=SamplingConfig(temperature=0.0),
        )  # fmt: skip
        with pytest.raises(ValueError, match="greedy samples are all the same"):
            Evaluator(producer, prompts(2), answer_reward, samples=4)
        assert Evaluator(producer, prompts(2), answer_reward).samples == 1  # greedy pass@1 is fine


async def test_prompts_sharing_an_id_are_refused() -> None:
    """Two prompt sets built with the same task share ids ("t/0", ...): `failed` is keyed by
    id, so one id's failure would hide the other's and the accounting would not add up."""
    async with SimEngine(vocab_size=VOCAB) as engine:
        producer = make_producer(engine)
        with pytest.raises(ValueError, match=r"'t/0' \(prompts 0 and 3\).*task="):
            Evaluator(producer, [*prompts(3), *prompts(2)], answer_reward)
        # ids the evaluator gives (by position) never collide with each other
        Evaluator(producer, [[3, 4], [3, 4], {"tokens": [5]}], answer_reward)


class BadEvalOutputEngine(SimEngine):
    """Serves the run, and answers the evaluator's requests with output the training path
    refuses: `mode` "ahead" stamps a version the engine never had, "vocab" a token id outside
    the vocabulary, "logprob" a positive logprob."""

    mode = "ahead"

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        outputs = await super().generate(request)
        if not request.request_id.startswith("eval"):
            return outputs
        out = outputs[0]
        tokens, logprobs, versions = out.tokens.copy(), out.logprobs.copy(), out.versions.copy()
        if self.mode == "ahead":
            versions[:] = self.version + 5
        elif self.mode == "vocab":
            tokens[-1] = VOCAB + 3
        else:
            logprobs[0] = 0.5
        bad = msgspec.structs.replace(out, tokens=tokens, logprobs=logprobs, versions=versions)
        return [bad, *outputs[1:]]


@pytest.mark.parametrize(
    ("mode", "why"),
    [("ahead", "outside \\[0, 0\\]"), ("vocab", "outside the vocabulary"), ("logprob", "NaN")],
)
async def test_output_the_training_path_refuses_fails_the_prompt(mode: str, why: str) -> None:
    seen: list[RolloutGroup] = []

    def reward(group: RolloutGroup) -> list[float]:
        seen.append(group)
        return [1.0] * len(group.samples)

    engine = BadEvalOutputEngine(vocab_size=VOCAB)
    engine.mode = mode
    async with engine, make_producer(engine) as producer:
        result = await Evaluator(producer, prompts(2), reward).run()
    assert not seen  # the verifier never saw the malformed output
    assert result.version is None and result.scores.prompts == 0
    assert sorted(result.failed) == ["t/0", "t/1"]
    assert all(v.startswith("malformed_output:") for v in result.failed.values())
    assert all(re.search(why, v) for v in result.failed.values()), result.failed


async def test_a_prompt_with_bad_metadata_fails_alone_with_by_set() -> None:
    """`metadata=None` (or a non-dict) fails that prompt as the producer does, before the
    engine; the others are scored and broken down (the reward reads no metadata)."""
    bad = Prompt(tokens=[3, 4], task="t", prompt_id="none", metadata=None)  # type: ignore[arg-type]
    listed = Prompt(tokens=[3, 4], task="t", prompt_id="list", metadata=[1])  # type: ignore[arg-type]
    async with SimEngine(vocab_size=VOCAB) as engine, make_producer(engine) as producer:
        result = await Evaluator(
            producer, [*prompts(4), bad, listed], sample_index_reward, by=["level"]
        ).run()
    assert result.error is None and result.scores.prompts == 4 and result.incomplete == 0
    assert sorted(result.failed) == ["list", "none"]
    assert all("metadata must be a dict" in why for why in result.failed.values()), result.failed
    assert result.metrics()["eval/prompts"] == 4
    assert set(result.by["level"]) == {"0", "1"}
