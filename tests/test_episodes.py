"""Multi-turn episodes driven by a `rollout_fn`: token ids end to end, failures and deadlines,
cancellation into user code, pauses and weight updates at every await point, checkpoints of
episodes in flight. Engines here are simulations (`SimEngine` and a scripted `TurnEngine`)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from asyncroll import (
    Episode,
    EpisodeError,
    Producer,
    ProducerError,
    ProducerExhausted,
    SamplingConfig,
    SimEngine,
    single_turn,
)
from asyncroll.engines.base import GenerateRequest, SampleOutput, Weights
from asyncroll.outcomes import FailureReason
from asyncroll.train import to_batch
from asyncroll.types import RolloutGroup, Status
from tests.test_producer import watch_ledger

VOCAB = 100
DEADLINE_S = 30.0  # failure guard for every wait on an event


def prompts(n: int) -> list[list[int]]:
    return [[1 + (i + j) % (VOCAB - 1) for j in range(3)] for i in range(n)]


async def length_reward(group: RolloutGroup) -> list[float]:
    return [float(len(s.tokens) % 3) for s in group.samples]


def position_token(j: int) -> int:
    """The scripted engine's token at response position j: a resubmitted turn that lost or
    repeated a token would show in the ids."""
    return 10 + j % 80


class TurnEngine:
    """A scripted engine: token at response position j is `position_token(j)`, logprob -0.5,
    stamped with the version current when the call returns. A call listed in `hold` waits
    for an abort (returning the first two tokens, "abort") or `release`. Records every
    request and refuses one that starts while `closed` (the producer is paused)."""

    vocab_size = VOCAB
    max_model_len: int | None = None
    supports_keep_pause = False
    adapter_slots: int | None = None
    pause_bound_s: float | None = None

    def __init__(self, hold: Sequence[int] = ()) -> None:
        self.version = 0
        self.requests: list[GenerateRequest] = []
        self.hold = set(hold)  # 1-based numbers of calls that wait
        self.entered = asyncio.Event()  # a held call is in the engine
        self._aborts: dict[str, asyncio.Event] = {}
        self._released = asyncio.Event()
        self.closed = False
        self.started_while_closed: list[str] = []

    def payload_bytes(self, max_new_tokens: int) -> int:
        return 0

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        self.requests.append(request)
        if self.closed:
            self.started_while_closed.append(request.request_id)
        (sample,) = request.samples
        start, budget = len(sample.prefix), sample.max_new_tokens
        n, finish = budget, "length"
        aborted = self._aborts.setdefault(request.request_id, asyncio.Event())
        if len(self.requests) in self.hold:
            self.entered.set()
            waits = [asyncio.ensure_future(e.wait()) for e in (aborted, self._released)]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if aborted.is_set():
                n, finish = min(2, budget), "abort"
        elif aborted.is_set():
            n, finish = 0, "abort"
        tokens = np.array([position_token(start + i) for i in range(n)], dtype=np.int32)
        return [
            SampleOutput(
                tokens=tokens,
                logprobs=np.full(n, -0.5, dtype=np.float32),
                versions=np.full(n, self.version, dtype=np.int32),
                finish_reason=finish,
            )
        ]

    def release(self) -> None:
        self._released.set()

    async def abort(self, request_id: str) -> None:
        self._aborts.setdefault(request_id, asyncio.Event()).set()

    async def pause_generation(self) -> None:
        raise NotImplementedError

    async def resume_generation(self) -> None:
        raise NotImplementedError

    async def update_weights(self, weights: Weights | None, *, version: int) -> None:
        self.version = version

    async def close(self) -> None:
        pass


class Tool:
    """An environment resource the rollout function opens; records that it closed."""

    def __init__(self, log: list[int], index: int) -> None:
        self.log, self.index = log, index

    async def __aenter__(self) -> Tool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.log.append(self.index)


def echo_agent(turns: int = 3, tool_tokens: int = 2) -> Any:
    """Each turn: the policy speaks, the tool answers with `tool_tokens` tokens."""

    async def agent(episode: Episode) -> None:
        for t in range(turns):
            stop = SamplingConfig(max_new_tokens=9, stop_token_ids=(t,))
            turn = await episode.generate(max_new_tokens=4, sampling=stop)
            episode.append(np.full(tool_tokens, 7 + int(turn.tokens[0]) % 5, dtype=np.int32))
        episode.extra["turns"] = turns

    return agent


async def take(producer: Producer, n: int) -> list[RolloutGroup]:
    batch = await producer.produce_batch(n, timeout=DEADLINE_S)
    producer.check_ledger()
    return batch.groups


# -- the data end to end -------------------------------------------------------------------------


async def test_episode_tokens_mask_turns_sessions_and_counters() -> None:
    engine = TurnEngine()
    producer = Producer(
        engine, prompts(4), length_reward, group_size=2, rollout_fn=echo_agent(), batch_size=4
    )
    checks = watch_ledger(producer)
    async with producer:
        groups = await take(producer, 4)
        counters = producer.progress.counters
    assert checks
    for g in groups:
        assert g.status is Status.COMPLETED
        for s in g.samples:
            assert s.loss_mask is not None and s.turn_ends is not None
            assert s.turn_ends.tolist() == [4, 6, 10, 12, 16, 18]
            assert s.loss_mask.tolist() == ([1] * 4 + [0] * 2) * 3
            env = s.loss_mask == 0
            assert (s.logprobs[env] == 0).all() and (s.logprobs[~env] == -0.5).all()
            assert s.tokens[:4].tolist() == [position_token(j) for j in range(4)]
            assert s.extra == {"turns": 3}
            assert (np.diff(s.versions) >= 0).all()
    # Token ids in, token ids out: each turn's prefix is exactly what the episode held.
    by_session: dict[str | None, list[GenerateRequest]] = {}
    for r in engine.requests:
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) == 8 and None not in by_session  # 4 groups x 2 episodes
    for requests in by_session.values():
        assert [len(r.samples[0].prefix) for r in requests] == [0, 6, 12]
        assert [r.sampling.stop_token_ids for r in requests] == [(0,), (1,), (2,)]  # per turn
        assert len({r.request_id for r in requests}) == 3
    assert counters.episodes == 8 and counters.policy_turns == 24
    assert counters.environment_turns == 24
    assert counters.policy_tokens == 8 * 12 and counters.environment_tokens == 8 * 6
    assert counters.generated_tokens == 8 * 18
    batch = to_batch(groups)
    assert batch.num_tokens == 8 * 12  # environment tokens are not trained


async def test_single_turn_rollout_fn_matches_the_default_path() -> None:
    shapes = []
    for rollout_fn in (None, single_turn):
        engine = SimEngine(vocab_size=VOCAB, seed=3)
        producer = Producer(
            engine, prompts(3), length_reward, group_size=2, rollout_fn=rollout_fn,
            sampling=SamplingConfig(max_new_tokens=5),
        )  # fmt: skip
        async with producer:
            groups = await take(producer, 3)
        shapes.append([[(len(s.tokens), s.num_policy_tokens, s.num_turns) for s in g.samples]
                       for g in groups])  # fmt: skip
    assert shapes[0] == shapes[1] == [[(5, 5, 1)] * 2] * 3


# -- failures ------------------------------------------------------------------------------------


async def test_an_environment_step_that_raises_fails_its_group_and_closes_the_others() -> None:
    closed: list[int] = []
    hold = asyncio.Event()
    generated = [asyncio.Event() for _ in range(3)]

    async def agent(episode: Episode) -> None:
        async with Tool(closed, episode.index):
            await episode.generate(max_new_tokens=2)
            generated[episode.index].set()
            if episode.index == 0:
                await asyncio.gather(*(e.wait() for e in generated))
                raise KeyError("the tool crashed")
            await hold.wait()  # never set: only the failure of episode 0 ends this one

    drops: list[Any] = []
    producer = Producer(
        TurnEngine(), prompts(1), length_reward, group_size=3, rollout_fn=agent,
        on_drop=drops.append,
    )  # fmt: skip
    async with producer:
        await asyncio.wait_for(_wait(producer, lambda: bool(drops)), DEADLINE_S)
    (drop,) = drops
    assert drop.reason is FailureReason.ENVIRONMENT_ERROR
    assert "episode 0" in drop.error and "KeyError" in drop.error and "crashed" in drop.error
    assert sorted(closed) == [0, 1, 2]  # cancellation reached the other episodes' tools
    assert drop.tokens == 6  # what they generated counts as wasted
    ledger = producer.check_ledger()
    assert ledger.failed_groups == 1 and ledger.wasted_tokens == 6


async def test_a_hanging_environment_step_passes_the_episode_deadline() -> None:
    closed: list[int] = []

    async def agent(episode: Episode) -> None:
        async with Tool(closed, episode.index):
            await episode.generate(max_new_tokens=2)
            await asyncio.Event().wait()  # a tool that never answers

    drops: list[Any] = []
    producer = Producer(
        TurnEngine(), prompts(1), length_reward, group_size=2, rollout_fn=agent,
        episode_timeout_s=0.2, on_drop=drops.append,
    )  # fmt: skip
    async with producer:
        await asyncio.wait_for(_wait(producer, lambda: bool(drops)), DEADLINE_S)
    (drop,) = drops
    assert drop.reason is FailureReason.EPISODE_DEADLINE
    assert "episode_timeout_s=0.2" in drop.error
    assert "episode 0 in the rollout function after policy turn 1" in drop.error
    assert sorted(closed) == [0, 1]
    producer.check_ledger()


async def test_a_turn_past_its_engine_deadline_fails_the_group() -> None:
    drops: list[Any] = []
    engine = TurnEngine(hold=[2])  # the second turn never answers (until aborted)
    producer = Producer(
        engine, prompts(1), length_reward, group_size=1, rollout_fn=echo_agent(),
        generate_timeout_s=0.2, on_drop=drops.append,
    )  # fmt: skip
    async with producer:
        await asyncio.wait_for(_wait(producer, lambda: bool(drops)), DEADLINE_S)
    (drop,) = drops
    assert drop.reason is FailureReason.ENGINE_DEADLINE
    assert "generate_timeout_s=0.2" in drop.error and "episode 0" in drop.error


async def test_catching_a_failed_turn_does_not_save_the_group() -> None:
    caught: list[EpisodeError] = []

    async def agent(episode: Episode) -> None:
        try:
            await episode.generate()
        except EpisodeError as exc:
            caught.append(exc)
        episode.append([3, 3])  # carries on regardless: refused as well

    drops: list[Any] = []
    engine = SimEngine(vocab_size=VOCAB, fail_rate=1.0)
    producer = Producer(
        engine, prompts(1), length_reward, group_size=1, rollout_fn=agent, on_drop=drops.append
    )
    async with producer:
        await asyncio.wait_for(_wait(producer, lambda: bool(drops)), DEADLINE_S)
    assert caught and caught[0].reason is FailureReason.ENGINE_ERROR
    assert drops[0].reason is FailureReason.ENGINE_ERROR
    assert "simulated failure" in drops[0].error


@pytest.mark.parametrize(
    ("agent_step", "needle"),
    [
        ("turns", "max_turns=2"),
        ("append_long", "max_episode_tokens"),
        ("append_bad_id", "outside the vocabulary"),
    ],
)
async def test_limits_fail_the_group_readably(agent_step: str, needle: str) -> None:
    async def agent(episode: Episode) -> None:
        if agent_step == "turns":
            for _ in range(3):
                await episode.generate(max_new_tokens=1)
        elif agent_step == "append_long":
            episode.append(np.ones(11, dtype=np.int32))
        else:
            episode.append([VOCAB + 5])

    drops: list[Any] = []
    producer = Producer(
        TurnEngine(), prompts(1), length_reward, group_size=1, rollout_fn=agent,
        max_turns=2, max_episode_tokens=10, on_drop=drops.append,
    )  # fmt: skip
    async with producer:
        await asyncio.wait_for(_wait(producer, lambda: bool(drops)), DEADLINE_S)
    assert drops[0].reason is FailureReason.ENVIRONMENT_ERROR
    assert needle in drops[0].error


async def test_a_rollout_function_raising_a_base_exception_stops_the_producer() -> None:
    class Boom(BaseException):
        pass

    async def agent(episode: Episode) -> None:
        await episode.generate(max_new_tokens=1)
        raise Boom("out of band")

    producer = Producer(
        TurnEngine(), prompts(3), length_reward, group_size=1, rollout_fn=agent,
        max_inflight_groups=1,
    )  # fmt: skip
    with pytest.raises(ProducerError, match="rollout function raised Boom"):
        async with producer:
            with pytest.raises(ProducerError, match="Boom"):
                await producer.produce_batch(1, timeout=DEADLINE_S)
    producer.check_ledger()
    assert producer.progress.counters.failed_groups_by_reason == {"environment_error": 1}


async def test_a_cancelled_error_nobody_asked_for_fails_the_group() -> None:
    """A tool's client torn down under it raises CancelledError though nothing cancelled the
    episode: it ended part-way, so its group must fail, not be handed out as complete."""

    async def agent(episode: Episode) -> None:
        await episode.generate(max_new_tokens=2)
        raise asyncio.CancelledError  # the tool's session was closed: the episode ends early

    drops: list[Any] = []
    producer = Producer(
        TurnEngine(), prompts(1), length_reward, group_size=2, rollout_fn=agent,
        on_drop=drops.append,
    )  # fmt: skip
    async with producer:
        with pytest.raises(ProducerExhausted):
            await producer.produce_batch(1, timeout=DEADLINE_S)
    assert [d.reason for d in drops] == [FailureReason.ENVIRONMENT_ERROR]
    assert "raised CancelledError though nothing cancelled it" in drops[0].error
    producer.check_ledger()


async def test_every_episode_failing_stops_the_run_with_the_count_by_reason() -> None:
    async def agent(episode: Episode) -> None:
        raise RuntimeError("no environment")

    producer = Producer(
        TurnEngine(), prompts(50), length_reward, group_size=2, rollout_fn=agent,
        max_dropped_in_a_row=5,
    )  # fmt: skip
    with pytest.raises(ProducerError, match=r"5 groups in a row.*environment_error x5: .*no env"):
        async with producer:
            await producer.produce_batch(1, timeout=DEADLINE_S)
    producer.check_ledger()


def test_a_sync_rollout_function_is_refused_at_construction() -> None:
    def agent(episode: Episode) -> None:
        pass

    with pytest.raises(ValueError, match="rollout_fn must be an async function"):
        Producer(TurnEngine(), prompts(1), length_reward, rollout_fn=agent)  # type: ignore[arg-type]


# -- pauses and weight updates at every await point ----------------------------------------------

# The scripted episode's await points: 0 before its first turn, 1 inside turn 1's engine call,
# 2 in the environment step, 3 inside turn 2's engine call, 4 after its last turn.
USER_POINTS = (0, 2, 4)
EXPECTED = (
    [position_token(j) for j in range(4)] + [7, 7] + [position_token(j) for j in range(6, 10)]
)


class Points:
    """Stops the episode at one user-code await point until the test releases it."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.reached = asyncio.Event()
        self.go = asyncio.Event()
        self.about_to_generate = asyncio.Event()

    async def at(self, point: int) -> None:
        if point == self.target:
            self.reached.set()
            await self.go.wait()


def scripted_agent(points: Points, seen: list[Any]) -> Any:
    async def agent(episode: Episode) -> None:
        await points.at(0)
        t1 = await episode.generate(max_new_tokens=4)
        assert not t1.tokens.flags.writeable and not episode.tokens.flags.writeable
        await points.at(2)
        episode.append([7, 7])
        points.about_to_generate.set()
        t2 = await episode.generate(max_new_tokens=4)
        await points.at(4)
        seen.append((t1, t2))

    return agent


@pytest.mark.parametrize("point", [0, 1, 2, 3, 4])
async def test_pause_and_update_at_every_await_point_is_invisible_to_the_episode(
    point: int,
) -> None:
    points = Points(point)
    engine = TurnEngine(hold=[1] if point == 1 else [2] if point == 3 else [])
    seen: list[Any] = []
    producer = Producer(
        engine, prompts(1), length_reward, group_size=1, rollout_fn=scripted_agent(points, seen)
    )
    checks = watch_ledger(producer)
    async with producer:
        reached = engine.entered if point in (1, 3) else points.reached
        await asyncio.wait_for(reached.wait(), DEADLINE_S)
        await asyncio.wait_for(producer.pause(), DEADLINE_S)  # aborts a turn in the engine
        engine.closed = True  # from here until resume, no engine call may start
        points.go.set()  # user code runs on while paused; its next turn must wait
        if point == 2:  # its next turn starts during the pause (and must park)
            await asyncio.wait_for(points.about_to_generate.wait(), DEADLINE_S)
        await asyncio.wait_for(producer.update_weights(None), DEADLINE_S)
        engine.closed = False
        await producer.resume()
        (group,) = await take(producer, 1)
    assert checks and engine.started_while_closed == []
    (sample,) = group.samples
    assert sample.tokens.tolist() == EXPECTED  # no token lost or repeated by the abort
    ((t1, t2),) = seen  # the episode saw two whole turns, never the abort
    assert len(t1.tokens) == len(t2.tokens) == 4
    # Each token keeps the version that sampled it: 0 before the update, 1 after.
    before = {0: 0, 1: 2, 2: 4, 3: 6, 4: 8}[point]  # policy tokens sampled before the update
    policy = sample.loss_mask == 1 if sample.loss_mask is not None else None
    assert policy is not None
    policy_versions = sample.versions[policy].tolist()
    assert policy_versions == [0] * before + [1] * (8 - before)
    assert sample.versions[4:6].tolist() == [sample.versions[3]] * 2  # the tool's tokens
    sessions = {r.session for r in engine.requests}
    assert len(sessions) == 1  # every call of the episode, resubmissions too
    if point in (1, 3):  # the aborted turn was re-submitted with its partial tokens
        prefixes = [len(r.samples[0].prefix) for r in engine.requests]
        assert prefixes == ([0, 2, 6] if point == 1 else [0, 6, 8])


# -- checkpoints and stops with episodes in flight ----------------------------------------------


async def test_a_checkpoint_restarts_episodes_in_flight_from_their_prompt(tmp_path: Any) -> None:
    points = Points(2)
    seen: list[Any] = []
    engine = TurnEngine()
    producer = Producer(
        engine, prompts(3), length_reward, group_size=1, max_inflight_groups=1,
        rollout_fn=scripted_agent(points, seen),
    )  # fmt: skip
    async with producer:
        await asyncio.wait_for(points.reached.wait(), DEADLINE_S)  # episode of prompt 0
        await producer.save(tmp_path / "ckpt")  # its episode is held in an environment step
        points.go.set()
        ids = [g.prompt_id for g in await take(producer, 3)]
    assert ids == ["default/0", "default/1", "default/2"]

    points2 = Points(-1)
    resumed = Producer(
        TurnEngine(), prompts(3), length_reward, group_size=1, max_inflight_groups=1,
        rollout_fn=scripted_agent(points2, []),
    )  # fmt: skip
    resumed.load(tmp_path / "ckpt", weights=None)
    ledger = resumed.check_ledger()
    assert ledger.resume_groups == 1 and ledger.in_flight_groups == 0
    counters = resumed.progress.counters
    assert counters.wasted_tokens_restarted == 4 and counters.restarted_groups == 1
    async with resumed:
        groups = await take(resumed, 3)
        resumed.check_ledger()
    assert sorted(g.prompt_id for g in groups) == ["default/0", "default/1", "default/2"]
    assert all(g.samples[0].tokens.tolist() == EXPECTED for g in groups)


async def test_stopping_with_episodes_in_flight_keeps_their_prompts_to_restart() -> None:
    points = Points(2)
    closed: list[int] = []

    async def agent(episode: Episode) -> None:
        async with Tool(closed, episode.index):
            await scripted_agent(points, [])(episode)

    producer = Producer(TurnEngine(), prompts(2), length_reward, group_size=2, rollout_fn=agent)
    async with producer:
        await asyncio.wait_for(points.reached.wait(), DEADLINE_S)
    assert closed.count(0) >= 1 and closed.count(1) >= 1  # the stop reached user code
    ledger = producer.check_ledger()
    assert ledger.in_flight_groups == 0 and ledger.resume_groups >= 1
    counters = producer.progress.counters
    assert counters.restarted_groups >= 1 and counters.wasted_tokens_restarted >= 8
    state = producer.state_dict()
    assert len(state.resume) + len(state.cursor.requeued) >= 1


async def _wait(producer: Producer, predicate: Any) -> None:
    await producer._changed.wait_until(predicate)


@pytest.mark.parametrize("mode", ["abort", "keep"])
async def test_weight_updates_during_many_episodes_keep_every_prompt_and_the_ledger(
    mode: str,
) -> None:
    """A simulation with latency and engine failures; a weight update after every batch lands
    in the middle of episodes. Every prompt ends exactly once, the ledger holds at every state
    change, and every sample is well formed with versions that never decrease."""
    engine = SimEngine(
        vocab_size=VOCAB, per_token_latency_s=0.0005, lengths="uniform", fail_rate=0.02, seed=1
    )
    drops: list[Any] = []
    producer = Producer(
        engine, prompts(40), length_reward, group_size=3, rollout_fn=echo_agent(),
        batch_size=4, pause_mode=mode, on_drop=drops.append,
    )  # fmt: skip
    checks = watch_ledger(producer)
    consumed: list[RolloutGroup] = []
    async with producer:
        async for batch in producer.batches(4):
            consumed += batch.groups
            await asyncio.wait_for(producer.update_weights(None), DEADLINE_S)
    ends = [g.prompt_id for g in consumed] + [d.prompt_id for d in drops]
    assert sorted(ends) == sorted(f"default/{i}" for i in range(40))  # each prompt once
    assert checks
    ledger = producer.check_ledger()
    assert ledger.environment_tokens > 0 and ledger.in_flight_groups == 0
    for g in consumed:
        for s in g.samples:
            assert s.loss_mask is not None and s.turn_ends is not None
            assert s.turn_ends[-1] == len(s.tokens) and len(s.turn_ends) == 6
            assert (np.diff(s.versions) >= 0).all()
            assert (s.logprobs[s.loss_mask == 0] == 0).all()


async def test_finished_episodes_are_freed_by_reference_counting() -> None:
    """Episodes completed, failed by an engine error or a raising tool, filtered, aborted by
    weight updates and cancelled by the producer's stop: once their groups land (or the
    producer stops), no episode is left, with the cyclic garbage collector off. An episode and
    its run referred to each other, a raised failure's traceback held the run, and a cancelled
    task's error held its frames: every finished group's episodes and arrays waited for a
    collection."""
    engine = SimEngine(
        vocab_size=VOCAB, per_token_latency_s=0.0005, lengths="uniform", fail_rate=0.03, seed=2
    )
    episodes: list[weakref.ref[Episode]] = []
    stuck = asyncio.Event()  # an episode the stop has to cancel is in flight

    def index(prompt_id: str) -> int:
        return int(prompt_id.rpartition("/")[2])

    async def agent(episode: Episode) -> None:
        episodes.append(weakref.ref(episode))
        for turn in range(3):
            await episode.generate(max_new_tokens=4)
            if turn == 1 and index(episode.prompt_id) % 7 == 3:
                raise KeyError("the tool crashed")
            if index(episode.prompt_id) >= 60:  # ends only by the producer's stop
                stuck.set()
                await asyncio.Event().wait()
            episode.append([7, 8])

    def reward(group: RolloutGroup) -> list[float]:  # every fifth group has no variance
        return [float(i * bool(index(group.prompt_id) % 5)) for i in range(group.num_samples)]

    drops: list[Any] = []
    producer = Producer(
        engine, prompts(200), reward, group_size=3, rollout_fn=agent, filter="nonzero_std",
        on_drop=drops.append,
    )  # fmt: skip
    gc.disable()
    try:
        async with producer:
            for _ in range(5):
                batch = await producer.produce_batch(4, timeout=DEADLINE_S)
                await asyncio.wait_for(producer.update_weights(None), DEADLINE_S)
            del batch
            await asyncio.wait_for(stuck.wait(), DEADLINE_S)
        alive = [e for ref in episodes if (e := ref()) is not None]
        assert not alive, f"{len(alive)} of {len(episodes)} episodes alive"
    finally:
        gc.enable()
    reasons = {d.reason for d in drops}
    assert FailureReason.ENVIRONMENT_ERROR in reasons and FailureReason.ENGINE_ERROR in reasons
    counters = producer.progress.counters
    assert counters.filtered_groups > 0 and counters.restarted_groups > 0


async def test_a_checkpoint_from_before_multi_turn_loads_with_its_ledger_whole(
    tmp_path: Any,
) -> None:
    """Counters written before `policy_tokens` existed: every token was the policy's."""
    import msgspec

    from asyncroll import ProducerState
    from asyncroll._core.state import dumps, loads

    producer = Producer(SimEngine(vocab_size=VOCAB), prompts(6), length_reward, group_size=2)
    async with producer:
        await take(producer, 2)
    state = msgspec.to_builtins(producer.state_dict())
    for name in ("policy_tokens", "environment_tokens", "episodes", "restarted_groups"):
        del state["counters"][name]
    old = msgspec.convert(state, ProducerState)
    assert old.counters.policy_tokens == 0 and old.counters.generated_tokens > 0
    resumed = Producer(SimEngine(vocab_size=VOCAB), prompts(6), length_reward, group_size=2)
    resumed.load_state_dict(loads(dumps(old)))
    ledger = resumed.check_ledger()
    assert ledger.policy_tokens == ledger.generated_tokens > 0


async def test_an_engine_that_dies_mid_episode_stops_the_producer() -> None:
    engine = SimEngine(vocab_size=VOCAB, per_token_latency_s=0.001)
    producer = Producer(
        engine, prompts(20), length_reward, group_size=2, rollout_fn=echo_agent(), batch_size=2
    )
    with pytest.raises(ProducerError, match="engine died"):
        async with producer:
            await engine.wait_generated(1, DEADLINE_S)  # a turn is running in the engine
            await engine.close()
            with pytest.raises(ProducerError, match="engine died"):
                await producer.produce_batch(timeout=DEADLINE_S)
    ledger = producer.check_ledger()
    assert ledger.in_flight_groups == 0
    assert producer.progress.counters.failed_groups_by_reason.get("engine_dead", 0) >= 1


async def test_a_spent_token_budget_gives_empty_turns_without_calling_the_engine() -> None:
    seen: list[Any] = []

    async def agent(episode: Episode) -> None:
        for _ in range(3):
            turn = await episode.generate(max_new_tokens=4)
            seen.append(turn)

    engine = TurnEngine()
    producer = Producer(
        engine, prompts(1), length_reward, group_size=1, rollout_fn=agent, max_turns=3,
        max_episode_tokens=6,
    )  # fmt: skip
    async with producer:
        (group,) = await take(producer, 1)
    assert [len(t.tokens) for t in seen] == [4, 2, 0]  # 6 tokens at most
    assert seen[2].finish_reason == "length" and len(engine.requests) == 2
    (sample,) = group.samples
    assert sample.turn_ends is not None and sample.turn_ends.tolist() == [4, 6, 6]
    assert producer.progress.counters.policy_turns == 3  # the empty turn counts


async def test_the_default_token_budget_leaves_room_for_the_tools_answers() -> None:
    """Without `max_episode_tokens`, every policy turn gets its full `max_new_tokens` even
    with tool answers between turns. The default was max_turns x max_new_tokens, which the
    tool's tokens ate into: this episode's third turn got 1 token and its last answer failed
    the group."""
    seen: list[Any] = []

    async def agent(episode: Episode) -> None:
        for _ in range(3):
            seen.append(await episode.generate())
            episode.append([7, 8, 9])

    producer = Producer(
        TurnEngine(), prompts(1), length_reward, group_size=1, rollout_fn=agent, max_turns=3,
        sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    async with producer:
        (group,) = await take(producer, 1)
    assert [len(t.tokens) for t in seen] == [4, 4, 4]
    assert group.samples[0].turn_ends.tolist() == [4, 7, 11, 14, 18, 21]
    assert producer.config.episode_tokens == 2 * 3 * 4  # as much room for the environment


async def test_an_engine_that_aborts_turns_on_its_own_fails_the_group_instead_of_spinning() -> None:
    class Aborting(TurnEngine):
        async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
            self._aborts.setdefault(request.request_id, asyncio.Event()).set()
            return await super().generate(request)  # "abort" with no token, every time

    drops: list[Any] = []
    engine = Aborting()
    producer = Producer(
        engine, prompts(1), length_reward, group_size=1, rollout_fn=single_turn,
        on_drop=drops.append,
    )  # fmt: skip
    async with producer:
        await asyncio.wait_for(_wait(producer, lambda: bool(drops)), DEADLINE_S)
    assert drops[0].reason is FailureReason.ENGINE_ERROR
    assert "aborted policy turn 1 8 times in a row" in drops[0].error
    assert len(engine.requests) == 8


@pytest.mark.parametrize("second", ["generate", "append"])
async def test_a_call_while_a_turn_is_in_the_engine_fails_the_group(second: str) -> None:
    """A turn samples after what the episode held when it started. A second `generate` or an
    `append` racing it would be stored before or after tokens sampled without it in context:
    the trainer would score those tokens against a context the policy never saw."""
    engine = TurnEngine(hold=[1])

    async def agent(episode: Episode) -> None:
        async def racing() -> None:
            await engine.entered.wait()  # turn 1 is in the engine
            if second == "generate":
                await episode.generate(max_new_tokens=4)
            else:
                episode.append([5, 5])
            engine.release()

        await asyncio.gather(episode.generate(max_new_tokens=4), racing())

    drops: list[Any] = []
    producer = Producer(
        engine, prompts(1), length_reward, group_size=1, rollout_fn=agent, on_drop=drops.append
    )
    async with producer:
        ended = lambda: bool(drops) or producer.buffer.num_ready > 0  # noqa: E731
        await asyncio.wait_for(_wait(producer, ended), DEADLINE_S)
    assert drops and drops[0].reason is FailureReason.ENVIRONMENT_ERROR
    assert f"{second}() while policy turn 1 is still being sampled" in drops[0].error
    assert len(engine.requests) == 1  # the racing turn never reached the engine
    producer.check_ledger()


async def test_an_episode_used_after_its_rollout_function_returned_is_refused() -> None:
    """The episode is its group's sample once the rollout function returns: a task it left
    behind may neither call the engine for it nor change it."""
    engine = TurnEngine()
    kept: list[Episode] = []

    async def agent(episode: Episode) -> None:
        await episode.generate(max_new_tokens=4)
        kept.append(episode)

    producer = Producer(engine, prompts(2), length_reward, group_size=1, rollout_fn=agent)
    async with producer:
        groups = await take(producer, 2)
        with pytest.raises(EpisodeError, match=r"generate\(\) after the rollout function returned"):
            await asyncio.wait_for(kept[0].generate(max_new_tokens=4), DEADLINE_S)
        with pytest.raises(EpisodeError, match=r"append\(\) after the rollout function returned"):
            kept[1].append([5])
    assert len(engine.requests) == 2  # one turn per episode, none after
    assert [g.samples[0].tokens.tolist() for g in groups] == [EXPECTED[:4]] * 2


async def test_a_rollout_function_returning_with_its_turn_still_running_fails_the_group() -> None:
    """A turn left running by a task the rollout function did not await would be missing
    from the sample, and its request would stay in the engine unseen by drains."""
    engine = TurnEngine(hold=[1])
    leaked: list[asyncio.Future[Any]] = []

    async def leaving_a_turn_running(episode: Episode) -> None:
        leaked.append(asyncio.ensure_future(episode.generate(max_new_tokens=4)))
        await engine.entered.wait()  # its turn is in the engine

    drops: list[Any] = []
    producer = Producer(
        engine, prompts(1), length_reward, group_size=1, rollout_fn=leaving_a_turn_running,
        on_drop=drops.append,
    )  # fmt: skip
    async with producer:
        ended = lambda: bool(drops) or producer.buffer.num_ready > 0  # noqa: E731
        await asyncio.wait_for(_wait(producer, ended), DEADLINE_S)
        engine.release()
        await asyncio.wait_for(leaked[0], DEADLINE_S)
    assert drops and drops[0].reason is FailureReason.ENVIRONMENT_ERROR
    assert "returned while policy turn 1 was still being sampled" in drops[0].error


async def test_an_episode_extra_with_a_non_str_key_fails_its_group_not_the_batch() -> None:
    """A group is stored encoded and read back with `extra` as a dict with str keys: one
    stored with an int key failed only when handed out, raising out of `produce_batch` with
    its batch already taken from the buffer (gone from the ledger)."""

    async def agent(episode: Episode) -> None:
        await episode.generate(max_new_tokens=2)
        if episode.prompt_id == "default/0":
            episode.extra[3] = "the tool's exit code, keyed by turn"

    drops: list[Any] = []
    producer = Producer(
        TurnEngine(), prompts(2), length_reward, group_size=2, rollout_fn=agent,
        on_drop=drops.append,
    )  # fmt: skip
    async with producer:
        groups = await take(producer, 1)
    assert [g.prompt_id for g in groups] == ["default/1"]
    assert [d.reason for d in drops] == [FailureReason.UNSTORABLE]
    assert "extra must be a dict with str keys" in drops[0].error
    ledger = producer.check_ledger()
    assert ledger.consumed_groups == ledger.failed_groups == 1


class KeepTurnEngine(TurnEngine):
    """`TurnEngine` that can pause in place (a held call stays held until aborted)."""

    supports_keep_pause = True

    async def pause_generation(self) -> None:
        pass

    async def resume_generation(self) -> None:
        pass


@pytest.mark.parametrize("mode", ["abort", "keep"])
async def test_save_while_episodes_run_checkpoints_them_as_restarts(
    mode: str, tmp_path: Any
) -> None:
    """A save in either pause mode while an episode's turn is in the engine: the live run
    finishes every prompt (the turn re-submitted), and the checkpoint loads with its ledger
    whole and that group to restart, its two sampled tokens counted as wasted."""
    engine = KeepTurnEngine(hold=[1])
    producer = Producer(
        engine, prompts(6), length_reward, group_size=1, rollout_fn=echo_agent(),
        pause_mode=mode, max_inflight_groups=1,
    )  # fmt: skip
    checks = watch_ledger(producer)
    async with producer:
        await asyncio.wait_for(engine.entered.wait(), DEADLINE_S)
        await asyncio.wait_for(producer.save(tmp_path / "ckpt"), DEADLINE_S)
        groups = await take(producer, 6)
    assert checks and [g.prompt_id for g in groups] == [f"default/{i}" for i in range(6)]
    resumed = Producer(
        TurnEngine(), prompts(6), length_reward, group_size=1, rollout_fn=echo_agent(),
        max_inflight_groups=1,
    )  # fmt: skip
    resumed.load(tmp_path / "ckpt", weights=None)
    ledger = resumed.check_ledger()
    assert (ledger.resume_groups, ledger.in_flight_groups, ledger.wasted_tokens) == (1, 0, 2)
    assert resumed.progress.counters.restarted_groups == 1
    async with resumed:
        rest = await take(resumed, 6)
        resumed.check_ledger()
    assert sorted(g.prompt_id for g in rest) == [f"default/{i}" for i in range(6)]
