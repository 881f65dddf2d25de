"""One attempt at a group: the engine call, the checks of its output, the reward and the filter.

`Attempts.run` returns a `Landing`: the group in its final state for this attempt (built once,
with its status) and, when it failed, the `FailureReason`. It never raises for anything a group
can absorb. Engine errors (its own `TimeoutError` included), a deadline, malformed output, a
reward or filter that raises, hangs or returns nonsense: each ends this group as FAILED with a
readable error. Only what no group can absorb also sets `Landing.fatal` (a dead engine, a
`BaseException` from user code, every reward worker hung): the producer then stops.

The engine call itself, its deadline and how each way it can end becomes a failure, is
`engine_call.generate`'s job, shared with the turns of episodes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec

from asyncroll._core import engine_call, rollout
from asyncroll._core.causes import described
from asyncroll._core.engine_call import EngineCallError
from asyncroll._core.lifecycle import Stage, move
from asyncroll._core.rewards import RewardDeadline, RewardFailure, RewardRunner
from asyncroll.config import ProducerConfig
from asyncroll.engines.base import Engine, GenerateRequest, SampleOutput
from asyncroll.episode import EpisodeError, EpisodeRun, Parking, RolloutFn
from asyncroll.filters import BadVerdict, GroupFilter, verdict
from asyncroll.outcomes import NOT_ABSORBED, FailureReason, cancelling
from asyncroll.types import RolloutGroup, RolloutState, Status, group_status

Samples = tuple[RolloutState, ...]


class Flight:
    """A group in flight: what the ledger needs about it, its stage, its request id, the bytes
    it reserved, and the task that runs it, which a drain cancels when its engine ignores an
    abort (the task is the group's only cancel scope: it lands as interrupted when cancelled).
    """

    __slots__ = (
        "episodes",
        "generated",
        "group",
        "request_id",
        "reserved",
        "samples",
        "stage",
        "started_at",
        "task",
        "tokens",
    )

    def __init__(self, group: RolloutGroup, request_id: str, reserved: int) -> None:
        self.request_id = request_id
        self.reserved = reserved
        self.samples = group.num_samples
        self.tokens = group.num_tokens  # held when this attempt started
        self.started_at = time.monotonic()
        self.stage = Stage.STARTING
        self.task: asyncio.Task[None] | None = None  # None: it lands without awaiting
        self.generated: Samples | None = None  # the samples once generation finished
        self.group = group  # as it started (a checkpoint restarts episode groups from it)
        self.episodes: EpisodeRun | None = None  # its episodes, with a rollout function

    def move(self, to: Stage) -> None:
        self.stage = move(self.stage, to)

    def cancel(self) -> None:
        """Cut the attempt short: it lands as interrupted. A group that has not called the
        engine (STARTING, CANCELLED) lands without calling it once its task first runs, so its
        task is not cancelled: a task cancelled before its first step would never land."""
        if self.task is not None and self.stage not in (Stage.STARTING, Stage.CANCELLED):
            self.task.cancel()


class Landing(NamedTuple):
    group: RolloutGroup
    reason: FailureReason | None = None
    fatal: str | None = None
    rewards: list[float] | None = None  # the valid rewards it was scored with, if any
    # Episodes cut off: the group restarts from its prompt; (policy, environment) tokens wasted.
    restart: tuple[int, int] | None = None


class Attempts:
    def __init__(
        self,
        engine: Engine,
        config: ProducerConfig,
        rewards: RewardRunner,
        group_filter: GroupFilter | None,
        rollout_fn: RolloutFn | None = None,
        freezes: engine_call.Freezes | None = None,
    ) -> None:
        self.engine = engine
        self.freezes = freezes
        self.config = config
        self.rewards = rewards
        self.filter = group_filter
        self.rollout_fn = rollout_fn

    async def run(
        self,
        group: RolloutGroup,
        flight: Flight,
        version: Callable[[], int],
        parking: Callable[[], Parking] | None = None,
    ) -> Landing:
        """The attempt's landing; `version()` is the policy version when the outputs arrive;
        `parking()` is where episodes wait while the producer is paused (with `rollout_fn`).
        Both are passed per call, not kept: the producer owns this object, not the reverse."""
        cfg, engine = self.config, self.engine
        if flight.stage is Stage.CANCELLED:  # drained before it could call the engine
            return self.interrupted(group, flight)
        flight.move(Stage.GENERATING)
        if self.rollout_fn is not None:
            if parking is None:
                raise ValueError("episodes need the producer's parking gate")
            return await self._episodes(group, flight, version, parking())
        if rollout.unfinished(group):
            budget = rollout.token_budget(group, cfg.sampling, engine.max_model_len)
            request = rollout.build_request(group, flight.request_id, cfg.sampling, budget)
            try:
                outputs = await self._generate(request)
            except EngineCallError as exc:
                return self.failed(group, flight, exc.reason, exc.message, fatal=exc.fatal)
            try:
                samples = rollout.merge_outputs(
                    group, request, outputs, vocab_size=engine.vocab_size, version=version()
                )
            except (ValueError, TypeError) as exc:  # RolloutError, or arrays that do not fit
                error = f"malformed engine output: {exc}"
                return self.failed(group, flight, FailureReason.MALFORMED_OUTPUT, error)
            del outputs
        else:  # finished at a smaller budget on resume (`state.fit_to_run`): only scoring left
            samples = group.samples
        status = group_status(samples)
        if status is not Status.COMPLETED:
            return Landing(self._finish(group, flight, samples, status))
        flight.move(Stage.SCORING)
        flight.generated = samples
        return await self._score(group, flight, samples)

    async def _episodes(
        self, group: RolloutGroup, flight: Flight, version: Callable[[], int], parking: Parking
    ) -> Landing:
        """The group's samples from its episodes (see `asyncroll.episode`), then scored."""
        assert self.rollout_fn is not None
        run = EpisodeRun(
            engine=self.engine,
            config=self.config,
            group=group,
            request_prefix=flight.request_id,
            rollout_fn=self.rollout_fn,
            call=self._generate,
            version=version,
            parking=parking,
        )
        flight.episodes = run
        try:
            samples = await run.run()
        except EpisodeError as exc:
            partial = run.partial_samples()
            return self.failed(group, flight, exc.reason, exc.message, partial, fatal=exc.fatal)
        flight.move(Stage.SCORING)
        flight.generated = samples
        return await self._score(group, flight, samples)

    async def _generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        """One engine call (a group's, or a turn of one of its episodes) within
        `generate_timeout_s`, not counting time the engine is frozen by a "keep"-mode pause;
        every failure as `EngineCallError`."""
        return await engine_call.generate(
            self.engine,
            request,
            timeout_s=self.config.generate_timeout_s,
            abort_timeout_s=self.config.abort_timeout_s,
            freezes=self.freezes,
        )

    async def _score(self, group: RolloutGroup, flight: Flight, samples: Samples) -> Landing:
        scored = msgspec.structs.replace(group, samples=samples, status=Status.COMPLETED)
        name = self.rewards.name
        try:
            values = await self.rewards.score(scored)
            rewards = rollout.check_rewards(values, len(samples))
        except RewardDeadline as exc:
            error = f"reward function {name!r} {exc}"
            return self.failed(
                group, flight, FailureReason.REWARD_DEADLINE, error, samples,
                fatal=self.rewards.stuck_error(),
            )  # fmt: skip
        except RewardFailure as exc:  # raised in, or crashed, its worker process
            error = f"reward function {name!r} {exc}"
            fatal = self.rewards.stuck_error() if exc.fatal else None
            return self.failed(
                group, flight, FailureReason.REWARD_ERROR, error, samples, fatal=fatal
            )
        except rollout.RolloutError as exc:
            error = f"{exc} (reward function {name!r})"
            return self.failed(group, flight, FailureReason.REWARD_ERROR, error, samples)
        except Exception as exc:
            error = f"reward function {name!r} raised {described(exc)}"
            return self.failed(group, flight, FailureReason.REWARD_ERROR, error, samples)
        except asyncio.CancelledError:
            if cancelling():
                raise
            error = f"reward function {name!r} raised CancelledError though nothing cancelled it"
            return self.failed(group, flight, FailureReason.REWARD_ERROR, error, samples)
        except NOT_ABSORBED:
            raise
        except BaseException as exc:
            error = f"reward function {name!r} raised {described(exc)}"
            return self.failed(
                group, flight, FailureReason.REWARD_ERROR, error, samples, fatal=error
            )
        del values, scored
        samples = rollout.with_rewards(samples, rewards)
        if self.filter is None:
            return Landing(self._finish(group, flight, samples, Status.COMPLETED), rewards=rewards)
        scored = msgspec.structs.replace(group, samples=samples, status=Status.COMPLETED)
        try:
            keep = verdict(self.filter(scored))
        except BadVerdict as exc:
            failed = self.failed(group, flight, FailureReason.FILTER_ERROR, str(exc), samples)
            return failed._replace(rewards=rewards)
        except Exception as exc:
            error = f"filter raised {type(exc).__name__}: {exc}"
            failed = self.failed(group, flight, FailureReason.FILTER_ERROR, error, samples)
            return failed._replace(rewards=rewards)
        except asyncio.CancelledError:
            if cancelling():
                raise
            error = "filter raised CancelledError though nothing cancelled it"
            failed = self.failed(group, flight, FailureReason.FILTER_ERROR, error, samples)
            return failed._replace(rewards=rewards)
        except NOT_ABSORBED:
            raise
        except BaseException as exc:
            error = f"filter raised {type(exc).__name__}: {exc}"
            failed = self.failed(
                group, flight, FailureReason.FILTER_ERROR, error, samples, fatal=error
            )
            return failed._replace(rewards=rewards)
        status = Status.COMPLETED if keep else Status.FILTERED
        return Landing(self._finish(group, flight, samples, status), rewards=rewards)

    def failed(
        self,
        group: RolloutGroup,
        flight: Flight,
        reason: FailureReason,
        error: str,
        samples: Samples | None = None,
        *,
        fatal: str | None = None,
    ) -> Landing:
        """The group FAILED with `error`, keeping `samples` (default: those it started with)
        so the tokens it generated are counted as wasted, not lost."""
        chosen = group.samples if samples is None else samples
        return Landing(self._finish(group, flight, chosen, Status.FAILED, error), reason, fatal)

    def interrupted(self, group: RolloutGroup, flight: Flight) -> Landing:
        """The group after an attempt cut off: during generation, what had not finished is
        ABORTED with the tokens it had before, so it resumes later; during scoring, its
        finished generation FAILED, so its tokens count as wasted instead of vanishing."""
        if flight.generated is not None:
            error = "the run stopped while the group was being scored"
            return self.failed(group, flight, FailureReason.INTERRUPTED, error, flight.generated)
        if self.rollout_fn is not None:  # episodes cannot resume half-way: restart the group
            # No episode started (drained before it could): nothing was wasted, nothing restarts.
            restart = None if flight.episodes is None else flight.episodes.tokens
            samples = rollout.interrupted(rollout.fresh_samples(group.num_samples))
            return Landing(self._finish(group, flight, samples, Status.ABORTED), restart=restart)
        samples = rollout.interrupted(group.samples)
        return Landing(self._finish(group, flight, samples, group_status(samples)))

    @staticmethod
    def _finish(
        group: RolloutGroup,
        flight: Flight,
        samples: Samples,
        status: Status,
        error: str | None = None,
    ) -> RolloutGroup:
        """The group after this attempt, built once with its final status."""
        return msgspec.structs.replace(
            group,
            samples=samples,
            status=status,
            error=error,
            attempts=group.attempts + 1,
            latency_s=group.latency_s + (time.monotonic() - flight.started_at),
        )
