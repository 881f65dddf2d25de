"""One attempt at a group: the engine call, the checks of its output, the reward and the filter.

`Attempts.run` returns a `Landing`: the group in its final state for this attempt (built once,
with its status) and, when it failed, the `FailureReason`. It never raises for anything a group
can absorb. Engine errors (its own `TimeoutError` included), a deadline, malformed output, a
reward or filter that raises, hangs or returns nonsense: each ends this group as FAILED with a
readable error. Only what no group can absorb also sets `Landing.fatal` (a dead engine, a
`BaseException` from user code, every reward worker hung): the producer then stops.

Deadlines are anyio cancel scopes, so a deadline is told apart from an engine that raises
`TimeoutError` itself, and a `CancelledError` the engine raised while nobody cancelled it (a
torn-down client session does that) is an engine error rather than a cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import anyio
import msgspec

from asyncroll import rollout
from asyncroll.config import ProducerConfig
from asyncroll.engines.base import Engine, EngineDeadError, GenerateRequest, SampleOutput
from asyncroll.episode import EpisodeError, EpisodeRun, Parking, RolloutFn
from asyncroll.filters import GroupFilter
from asyncroll.lifecycle import Stage, move
from asyncroll.outcomes import FailureReason
from asyncroll.rewards import RewardDeadline, RewardRunner
from asyncroll.types import RolloutGroup, RolloutState, Status, group_status

Samples = tuple[RolloutState, ...]


class Flight:
    """A group in flight: what the ledger needs about it, its stage, its request id, the bytes
    it reserved, and a cancel scope a drain can use when its engine ignores an abort."""

    __slots__ = (
        "episodes",
        "generated",
        "group",
        "request_id",
        "reserved",
        "samples",
        "scope",
        "stage",
        "started_at",
        "tokens",
    )

    def __init__(self, group: RolloutGroup, request_id: str, reserved: int) -> None:
        self.request_id = request_id
        self.reserved = reserved
        self.samples = group.num_samples
        self.tokens = group.num_tokens  # held when this attempt started
        self.started_at = time.monotonic()
        self.stage = Stage.STARTING
        self.scope = anyio.CancelScope()
        self.generated: Samples | None = None  # the samples once generation finished
        self.group = group  # as it started (a checkpoint restarts episode groups from it)
        self.episodes: EpisodeRun | None = None  # its episodes, with a rollout function

    def move(self, to: Stage) -> None:
        self.stage = move(self.stage, to)


class Landing(NamedTuple):
    group: RolloutGroup
    reason: FailureReason | None = None
    fatal: str | None = None
    rewards: list[float] | None = None  # the valid rewards it was scored with, if any
    # Episodes cut off: the group restarts from its prompt; (policy, environment) tokens wasted.
    restart: tuple[int, int] | None = None


class _SpuriousCancel(Exception):
    """The engine raised `CancelledError` though nothing cancelled its caller."""


class _Deadline(Exception):
    """`generate_timeout_s` passed (not a `TimeoutError` the engine raised itself)."""


_NOT_ABSORBED = (KeyboardInterrupt, SystemExit, asyncio.CancelledError)


class Attempts:
    def __init__(
        self,
        engine: Engine,
        config: ProducerConfig,
        rewards: RewardRunner,
        group_filter: GroupFilter | None,
        rollout_fn: RolloutFn | None = None,
    ) -> None:
        self.engine = engine
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
        budget = rollout.token_budget(group, cfg.sampling, engine.max_model_len)
        request = rollout.build_request(group, flight.request_id, cfg.sampling, budget)
        try:
            outputs = await self._generate(request)
        except EngineDeadError as exc:
            message = f"engine died: {exc}"
            return self.failed(group, flight, FailureReason.ENGINE_DEAD, message, fatal=message)
        except _SpuriousCancel:
            error = "engine error: it raised CancelledError though nothing cancelled the request"
            return self.failed(group, flight, FailureReason.ENGINE_ERROR, error)
        except _Deadline:
            await self._abort(request.request_id)
            error = f"engine gave no answer within generate_timeout_s={cfg.generate_timeout_s}"
            return self.failed(group, flight, FailureReason.ENGINE_DEADLINE, error)
        except Exception as exc:
            return self.failed(group, flight, FailureReason.ENGINE_ERROR, _engine_error(exc))
        except _NOT_ABSORBED:
            raise
        except BaseException as exc:
            error = _engine_error(exc)
            fatal = f"the engine raised {type(exc).__name__} (a BaseException): {error}"
            return self.failed(group, flight, FailureReason.ENGINE_ERROR, error, fatal=fatal)
        try:
            samples = rollout.merge_outputs(
                group, request, outputs, vocab_size=engine.vocab_size, version=version()
            )
        except (ValueError, TypeError) as exc:  # RolloutError, or arrays that do not fit
            error = f"malformed engine output: {exc}"
            return self.failed(group, flight, FailureReason.MALFORMED_OUTPUT, error)
        del outputs
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
            call=self._turn,
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

    async def _turn(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        """One engine call of an episode's turn; every failure as an `EpisodeError` with the
        reason a single-turn group would get."""
        try:
            return await self._generate(request)
        except EngineDeadError as exc:
            message = f"engine died: {exc}"
            raise EpisodeError(FailureReason.ENGINE_DEAD, message, fatal=message) from None
        except _SpuriousCancel:
            error = "engine error: it raised CancelledError though nothing cancelled the request"
            raise EpisodeError(FailureReason.ENGINE_ERROR, error) from None
        except _Deadline:
            await self._abort(request.request_id)
            error = (
                f"engine gave no answer within generate_timeout_s={self.config.generate_timeout_s}"
            )
            raise EpisodeError(FailureReason.ENGINE_DEADLINE, error) from None
        except Exception as exc:
            raise EpisodeError(FailureReason.ENGINE_ERROR, _engine_error(exc)) from None
        except _NOT_ABSORBED:
            raise
        except BaseException as exc:
            error = _engine_error(exc)
            fatal = f"the engine raised {type(exc).__name__} (a BaseException): {error}"
            raise EpisodeError(FailureReason.ENGINE_ERROR, error, fatal=fatal) from None

    async def _generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        with anyio.move_on_after(self.config.generate_timeout_s) as scope:
            try:
                return await self.engine.generate(request)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if scope.cancel_called or (task is not None and task.cancelling()):
                    raise
                raise _SpuriousCancel from None
        raise _Deadline  # only the scope's own deadline gets here

    async def _abort(self, request_id: str) -> None:
        """Abort a request whose deadline passed, within `abort_timeout_s` (best effort: its
        group fails either way, and a dead engine shows on the next call)."""
        with anyio.move_on_after(self.config.abort_timeout_s), contextlib.suppress(Exception):
            await self.engine.abort(request_id)

    async def _score(self, group: RolloutGroup, flight: Flight, samples: Samples) -> Landing:
        cfg = self.config
        scored = msgspec.structs.replace(group, samples=samples, status=Status.COMPLETED)
        try:
            values = await self.rewards.score(scored)
            rewards = rollout.check_rewards(values, len(samples))
        except RewardDeadline:
            error = f"reward function took longer than reward_timeout_s={cfg.reward_timeout_s}"
            return self.failed(
                group, flight, FailureReason.REWARD_DEADLINE, error, samples,
                fatal=self.rewards.stuck_error(),
            )  # fmt: skip
        except rollout.RolloutError as exc:
            return self.failed(group, flight, FailureReason.REWARD_ERROR, str(exc), samples)
        except Exception as exc:
            error = f"reward function raised {type(exc).__name__}: {exc}"
            return self.failed(group, flight, FailureReason.REWARD_ERROR, error, samples)
        except _NOT_ABSORBED:
            raise
        except BaseException as exc:
            error = f"reward function raised {type(exc).__name__}: {exc}"
            return self.failed(
                group, flight, FailureReason.REWARD_ERROR, error, samples, fatal=error
            )
        del values, scored
        samples = rollout.with_rewards(samples, rewards)
        if self.filter is None:
            return Landing(self._finish(group, flight, samples, Status.COMPLETED), rewards=rewards)
        scored = msgspec.structs.replace(group, samples=samples, status=Status.COMPLETED)
        try:
            keep = bool(self.filter(scored))
        except Exception as exc:
            error = f"filter raised {type(exc).__name__}: {exc}"
            failed = self.failed(group, flight, FailureReason.FILTER_ERROR, error, samples)
            return failed._replace(rewards=rewards)
        except _NOT_ABSORBED:
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


def _engine_error(exc: BaseException) -> str:
    return f"engine error: {type(exc).__name__}: {exc}"
