"""Multi-turn episodes: a user's `rollout_fn(episode)` drives the turns of one sample.

```python
async def agent(episode: Episode) -> None:
    async with Calculator() as tool:  # closed however the episode ends
        for _ in range(4):
            turn = await episode.generate(max_new_tokens=32)  # the policy: token ids out
            if turn.finish_reason != "stop":
                break
            episode.append(tool.answer(turn.tokens))  # the environment: token ids in, untrained
```

Token ids go in and out: asyncroll never re-tokenises, so the logprobs the trainer corrects with
belong to exactly the tokens the policy saw. Each `generate` is one policy turn: one engine
request whose prefix is everything the episode holds so far (the engine re-prefills it after the
prompt, reusing its prefix cache), tagged with the episode's `session` key. `append` adds
environment tokens: in the context of later turns, not trained (`loss_mask` 0, logprob 0, the
version of the policy token before them).

What the producer guarantees around user code (`EpisodeRun` runs the episodes of one group):

* **Pauses are invisible.** When the producer drains (pause, weight update or checkpoint in
  "abort" mode) the turn's request is aborted; `generate` keeps the tokens sampled so far, parks
  until the producer runs again, and re-submits them as a prefix under a fresh request id.
  Every token keeps the version that sampled it. A pause never reaches user code.
* **Failures fail the group, readably.** An engine error, a turn past `generate_timeout_s`,
  malformed output, a rollout function that raises, breaks a limit (`max_turns`,
  `max_episode_tokens`), uses its episode out of turn (a call while a turn is being sampled,
  or after it returned) or runs past `episode_timeout_s` (parked time not counted) ends the
  whole group FAILED with a `FailureReason` and an error naming the episode and where it was.
  `generate` raises `EpisodeError` for a failed turn; catching it does not save the group.
* **Cancellation reaches user code.** On a failure of a sibling episode, a deadline or the
  producer's stop, the rollout function's task is cancelled, so its `async with` blocks close.
* **Episodes are not checkpointed** (their state is user code). A group whose episodes are in
  flight when the producer stops or checkpoints restarts from its prompt (same uid) when the run
  resumes; the tokens its episodes had are counted as wasted (`wasted_tokens_restarted`).
"""

from __future__ import annotations

import asyncio
import enum
import math
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import anyio
import msgspec
import numpy as np
import numpy.typing as npt

from asyncroll._core import rollout
from asyncroll._core.engine_call import EngineCallError, Freezes
from asyncroll._core.wakeup import Signal
from asyncroll.config import ProducerConfig
from asyncroll.engines.base import (
    Engine,
    GenerateRequest,
    SampleOutput,
    SampleRequest,
    SamplingConfig,
)
from asyncroll.outcomes import FailureReason, GroupFailure, cancelling
from asyncroll.types import (
    EMPTY_FLOAT32,
    EMPTY_INT32,
    Float32Array,
    Int32Array,
    RolloutGroup,
    RolloutState,
    Status,
)

__all__ = ["Episode", "EpisodeError", "RolloutFn", "Turn", "single_turn", "split_turns"]

RolloutFn = Callable[["Episode"], Awaitable[None]]
"""Drives one episode: `async def rollout_fn(episode: Episode) -> None`."""

Call = Callable[[GenerateRequest], Awaitable[Sequence[SampleOutput]]]
"""One engine call within the turn deadline (`engine_call.generate`); raises `EngineCallError`
for anything that fails."""


# Aborts in a row that bring no token while the gate is open: an engine aborting on its own
# would otherwise have a turn re-submitted forever (until the episode deadline).
_IDLE_ABORTS = 8


class EpisodeError(GroupFailure):
    """The episode's group fails: a turn failed (engine error, deadline, malformed output) or
    the episode broke a limit. Raised by `Episode.generate` / `append`; let it propagate."""


class _Phase(enum.Enum):
    """Where an episode's user code stands. `generate` and `append` act only when READY: a
    turn samples after what the episode held when it started, so a call racing it (another
    turn, an append) would be stored next to tokens sampled without it in context."""

    READY = "ready"  # between calls: the rollout function may generate or append
    IN_TURN = "in_turn"  # a policy turn is being sampled
    RETURNED = "returned"  # the rollout function returned: the episode is its sample now


class Turn(msgspec.Struct, frozen=True):
    """One policy turn: the tokens sampled, their logprobs and the version of each."""

    tokens: Int32Array
    logprobs: Float32Array
    versions: Int32Array
    finish_reason: str  # "stop" or "length"


async def single_turn(episode: Episode) -> None:
    """The default rollout: one policy turn (what a producer without `rollout_fn` does, in one
    engine call for the whole group)."""
    await episode.generate()


class Parking:
    """The producer's admission gate as episodes see it, and the episode deadline it stops.

    The group's episode deadline is stopped while any of its episodes waits here (a pause or
    weight update is not the episode's time) and while `freezes` has the engine frozen (a
    "keep"-mode pause or update: the turns in the engine wait there, and never reach this
    gate); it runs again, with what was left, once neither holds. The stops are counted, so
    a freeze that ends while an episode is still parked (or the reverse) does not restart it
    early."""

    def __init__(
        self, is_open: Callable[[], bool], changed: Signal, freezes: Freezes | None = None
    ) -> None:
        self.is_open = is_open
        self.changed = changed
        self.freezes = freezes
        self._scope: anyio.CancelScope | None = None
        self._stops = 0
        self._left: float | None = None  # seconds left while stopped

    def bind(self, scope: anyio.CancelScope | None) -> None:
        """Stop and restart `scope`'s deadline from now on (None: let go of the one bound)."""
        if scope is None:
            if self.freezes is not None:
                self.freezes.unwatch(self)
            self._scope, self._stops, self._left = None, 0, None
            return
        self._scope = scope
        if self.freezes is not None:
            self.freezes.watch(self)  # stopped at once if the engine is frozen now

    def stop(self) -> None:
        self._stops += 1
        if self._stops == 1 and self._scope is not None:
            self._left = self._scope.deadline - anyio.current_time()
            self._scope.deadline = math.inf

    def go(self) -> None:
        self._stops -= 1
        if self._stops == 0 and self._scope is not None and self._left is not None:
            self._scope.deadline = anyio.current_time() + self._left
            self._left = None

    async def wait(self) -> None:
        if self.is_open():
            return
        self.stop()
        try:
            await self.changed.wait_until(self.is_open)
        finally:
            self.go()


class Episode:
    """One sample's episode, handed to the rollout function. See the module docstring."""

    def __init__(self, run: EpisodeRun, index: int) -> None:
        # Weak: the run holds its episodes, and a cycle would keep a finished group's episodes
        # and arrays alive until the cyclic garbage collector runs. The run lives as long as
        # its group is in flight (the producer holds it); a call after that is refused.
        self._run_ref = weakref.ref(run)
        self.index = index  # which sample of the group
        group = run.group
        self.prompt_tokens: Int32Array = group.prompt_tokens
        self.prompt_id = group.prompt_id
        self.task = group.task
        # The prompt's metadata, read-only: it is the group's own (shared by its episodes).
        self.metadata: Mapping[str, Any] = MappingProxyType(group.metadata)
        self.session = f"{run.request_prefix}-s{index}"
        self.extra: dict[str, Any] = {}  # stored on the sample (e.g. for the reward function)
        self._tokens: Int32Array = EMPTY_INT32  # the response so far, in one array
        self._logprobs: list[Float32Array] = []
        self._versions: list[Int32Array] = []
        self._mask: list[npt.NDArray[np.uint8]] = []
        self._ends: list[int] = []
        self._pending = 0  # tokens of the turn in progress (kept across aborts)
        self._calls = 0
        self.policy_turns = 0
        self.finish_reason: str | None = None
        self.where = "before its first turn"  # for the deadline's error message
        self._phase = _Phase.READY

    @property
    def tokens(self) -> Int32Array:
        """The response so far (policy and environment tokens), read-only."""
        view = self._tokens.view()
        view.flags.writeable = False
        return view

    @property
    def num_tokens(self) -> int:
        """Response tokens held, including those of a turn in progress."""
        return len(self._tokens) + self._pending

    @property
    def policy_tokens(self) -> int:
        return sum(int(m.sum()) for m in self._mask) + self._pending

    @property
    def tokens_left(self) -> int:
        """Response tokens the episode may still hold (`max_episode_tokens`, or what the
        engine's max_model_len leaves after the prompt): for a caller that must refuse a
        request past the budget instead of failing the group. 0 once its group has ended."""
        run = self._run_ref()
        return 0 if run is None else max(0, run.token_limit - len(self._tokens))

    @property
    def turns_left(self) -> int:
        """Policy turns the episode may still take (`max_turns`); 0 once its group has ended."""
        run = self._run_ref()
        return 0 if run is None else max(0, run.config.max_turns - self.policy_turns)

    @property
    def sampling(self) -> SamplingConfig:
        """The producer's sampling config: what `generate()` samples with when given none.
        A caller that adds to it (a chat episode's stop tokens) starts from this, so that
        the behaviour logprobs stay those of the policy the trainer recomputes."""
        run = self._run_ref()
        if run is None:
            raise EpisodeError(
                FailureReason.ENVIRONMENT_ERROR,
                f"episode {self.index}: its group has ended ({self.where}), and the "
                "producer's sampling config with it",
            )
        return run.config.sampling

    async def generate(
        self, max_new_tokens: int | None = None, *, sampling: SamplingConfig | None = None
    ) -> Turn:
        """Run one policy turn: sample up to `max_new_tokens` (default: `sampling`'s) after
        the prompt and everything appended so far. `sampling` overrides the producer's for
        this turn (e.g. its `stop_token_ids`); keep temperature and top-p/k those the trainer
        computes logprobs with, or the behaviour logprobs describe another policy.

        Returns fewer tokens when the episode's token budget (`max_episode_tokens`, policy
        and environment tokens together) runs out: an empty turn with finish reason "length"
        once it is spent, without calling the engine. Raises `EpisodeError` if the turn
        fails."""
        run = self._check_ready("generate()")
        if self.policy_turns >= run.config.max_turns:
            raise run.fail(
                self, FailureReason.ENVIRONMENT_ERROR,
                f"asked for policy turn {self.policy_turns + 1} but max_turns="
                f"{run.config.max_turns}: raise max_turns or end the episode sooner",
            )  # fmt: skip
        self.policy_turns += 1
        sampling = run.config.sampling if sampling is None else sampling
        want = sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
        if not isinstance(want, int) or want < 1:
            raise run.fail(
                self, FailureReason.ENVIRONMENT_ERROR,
                f"generate(max_new_tokens={max_new_tokens!r}): give an int >= 1 or None",
            )  # fmt: skip
        budget = min(want, run.token_limit - len(self._tokens))
        if budget <= 0:  # the budget is spent: an empty turn, still a turn of the sample
            self._commit(EMPTY_INT32, EMPTY_FLOAT32, EMPTY_INT32, np.zeros(0, dtype=np.uint8))
            self.finish_reason = "length"
            return Turn(EMPTY_INT32, EMPTY_FLOAT32, EMPTY_INT32, "length")
        self.where = f"in policy turn {self.policy_turns}"
        self._phase = _Phase.IN_TURN
        try:
            return await self._sample_turn(run, sampling, budget)
        finally:
            if self._phase is _Phase.IN_TURN:  # not RETURNED meanwhile (a task left behind)
                self._phase = _Phase.READY

    async def _sample_turn(self, run: EpisodeRun, sampling: SamplingConfig, budget: int) -> Turn:
        """The engine calls of one policy turn (re-submitted after a drain's abort)."""
        pieces: list[RolloutState] = []
        prefix = self._tokens
        last = self.last_version()
        idle = 0
        while True:
            await run.parking.wait()
            self._calls += 1
            request = GenerateRequest(
                request_id=f"{self.session}-c{self._calls}",
                prompt_tokens=self.prompt_tokens,
                samples=(SampleRequest(prefix, budget),),
                sampling=sampling,
                session=self.session,
            )
            piece = await run.turn(self, request, last)
            pieces.append(piece)
            n = len(piece.tokens)
            if n:
                last = int(piece.versions[-1])
            self._pending += n
            if piece.status is Status.COMPLETED:
                break
            # Aborted by a drain: keep what was sampled, continue from it once running again.
            budget -= n
            if n:
                prefix = np.concatenate([prefix, piece.tokens])
                idle = 0
            elif run.parking.is_open():
                idle += 1  # aborted with nothing, and no drain holds the gate
                if idle >= _IDLE_ABORTS:
                    raise run.fail(
                        self, FailureReason.ENGINE_ERROR,
                        f"the engine aborted policy turn {self.policy_turns} {idle} times in a "
                        "row without a token while the producer was not pausing",
                    )  # fmt: skip
        self._pending = 0
        tokens = _joined([p.tokens for p in pieces], EMPTY_INT32)
        logprobs = _joined([p.logprobs for p in pieces], EMPTY_FLOAT32)
        versions = _joined([p.versions for p in pieces], EMPTY_INT32)
        finish = pieces[-1].finish_reason or "length"
        for arr in (tokens, logprobs, versions):  # the episode keeps them: nobody may write
            arr.flags.writeable = False
        self._commit(tokens, logprobs, versions, np.ones(len(tokens), dtype=np.uint8))
        self.finish_reason = finish
        self.where = f"in the rollout function after policy turn {self.policy_turns}"
        return Turn(tokens, logprobs, versions, finish)

    def append(self, tokens: Any) -> None:
        """Append environment (tool, user) tokens: context for later turns, never trained.
        Raises `EpisodeError` for ids outside the vocabulary or past the token budget."""
        run = self._check_ready("append()")
        try:
            arr = rollout.prompt_array(tokens, run.vocab_size, None)
        except rollout.RolloutError as exc:
            if np.size(tokens) == 0:
                return  # nothing to append
            message = str(exc).replace("prompt", "appended")
            raise run.fail(self, FailureReason.ENVIRONMENT_ERROR, message) from None
        if len(self._tokens) + len(arr) > run.token_limit:
            raise run.fail(
                self, FailureReason.ENVIRONMENT_ERROR,
                f"appending {len(arr)} tokens to {len(self._tokens)} would pass the episode's "
                f"limit of {run.token_limit} tokens (max_episode_tokens, or the engine's "
                "max_model_len): truncate the tool's answer or raise max_episode_tokens",
            )  # fmt: skip
        version = self.last_version() if len(self._tokens) else run.version()
        n = len(arr)
        self._commit(
            arr,
            np.zeros(n, dtype=np.float32),
            np.full(n, version, dtype=np.int32),
            np.zeros(n, dtype=np.uint8),
        )

    def _check_ready(self, call: str) -> EpisodeRun:
        """The episode's run, if it may make `call` now: it is between calls (see `_Phase`)
        and its group has not failed. Otherwise the call is refused and the group fails (one
        that already landed cannot fail any more: the call is refused all the same)."""
        run = self._run_ref()
        match self._phase:
            case _Phase.READY if run is not None:
                run.check_alive(self)
                return run
            case _Phase.READY:
                problem = (
                    f"{call} after its group ended ({self.where}): the producer stopped or "
                    "the group failed, and the episode outlived it in a task it started"
                )
            case _Phase.IN_TURN:
                problem = (
                    f"{call} while policy turn {self.policy_turns} is still being sampled: "
                    "await each generate() before the episode's next call"
                )
            case _Phase.RETURNED:
                problem = (
                    f"{call} after the rollout function returned: the episode is its group's "
                    "sample now (a task the rollout function started outlived it?)"
                )
        if run is None:
            message = f"episode {self.index}: {problem}"
            raise EpisodeError(FailureReason.ENVIRONMENT_ERROR, message)
        raise run.fail(self, FailureReason.ENVIRONMENT_ERROR, problem)

    def _commit(
        self,
        tokens: Int32Array,
        logprobs: Float32Array,
        versions: Int32Array,
        mask: npt.NDArray[np.uint8],
    ) -> None:
        self._tokens = np.concatenate([self._tokens, tokens]) if len(self._tokens) else tokens
        self._logprobs.append(logprobs)
        self._versions.append(versions)
        self._mask.append(mask)
        self._ends.append(len(self._tokens))

    def last_version(self) -> int:
        """Version of the newest token held (0 before any)."""
        for versions in reversed(self._versions):
            if len(versions):
                return int(versions[-1])
        return 0

    def sample(self, status: Status) -> RolloutState:
        """The episode as a sample (COMPLETED, or what it had when its group failed)."""
        return RolloutState(
            tokens=self._tokens,
            logprobs=_joined(self._logprobs, EMPTY_FLOAT32),
            versions=_joined(self._versions, EMPTY_INT32),
            status=status,
            finish_reason=self.finish_reason or ("stop" if status is Status.COMPLETED else None),
            extra=self.extra,
            loss_mask=_joined(self._mask, np.zeros(0, dtype=np.uint8)),
            turn_ends=np.array(self._ends, dtype=np.int32),
        )


def _joined(parts: list[Any], empty: Any) -> Any:
    if not parts:
        return empty
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class EpisodeRun:
    """The episodes of one group in flight: runs them, knows which engine requests they have
    open (for a drain), and ends as the group's samples or one `EpisodeError`."""

    def __init__(
        self,
        *,
        engine: Engine,
        config: ProducerConfig,
        group: RolloutGroup,
        request_prefix: str,
        rollout_fn: RolloutFn,
        call: Call,
        version: Callable[[], int],
        parking: Parking,
    ) -> None:
        self.config = config
        self.group = group
        self.request_prefix = request_prefix
        self.rollout_fn = rollout_fn
        self.call = call
        self.version = version
        self.parking = parking
        self.vocab_size = engine.vocab_size
        limit = config.episode_tokens
        if engine.max_model_len is not None:
            limit = min(limit, engine.max_model_len - len(group.prompt_tokens))
        self.token_limit = limit
        self.open_requests: set[str] = set()  # in the engine right now
        self.episodes = [Episode(self, i) for i in range(group.num_samples)]
        self.failure: EpisodeError | None = None
        self._scope: anyio.CancelScope | None = None
        # A one-sample stand-in of the group, so each turn's output is checked like a group's.
        self._probe = msgspec.structs.replace(group, samples=rollout.fresh_samples(1))

    @property
    def quiet(self) -> bool:
        """No request of this group is in the engine (parked or in user code)."""
        return not self.open_requests

    @property
    def tokens(self) -> tuple[int, int]:
        """(policy, environment) tokens its episodes hold now, turns in progress included."""
        policy = sum(e.policy_tokens for e in self.episodes)
        return policy, sum(e.num_tokens for e in self.episodes) - policy

    def partial_samples(self) -> tuple[RolloutState, ...]:
        """What the episodes hold (finished turns), for counting a failed group's waste."""
        return tuple(e.sample(Status.ABORTED) for e in self.episodes)

    def check_alive(self, episode: Episode) -> None:
        if self.failure is not None:
            raise EpisodeError(self.failure.reason, self.failure.message, self.failure.fatal)

    def fail(
        self, episode: Episode, reason: FailureReason, message: str, fatal: str | None = None
    ) -> EpisodeError:
        """Record the group's failure (the first one wins), cancel the other episodes, and
        return the error to raise in `episode`."""
        if self.failure is None:
            self.failure = EpisodeError(reason, f"episode {episode.index}: {message}", fatal)
            if self._scope is not None:
                self._scope.cancel()
        return EpisodeError(self.failure.reason, self.failure.message, self.failure.fatal)

    async def turn(self, episode: Episode, request: GenerateRequest, previous: int) -> RolloutState:
        """One engine call of a turn, checked: the new tokens as a one-off sample (COMPLETED,
        or ABORTED with what was sampled before a drain's abort)."""
        self.open_requests.add(request.request_id)
        try:
            outputs = await self.call(request)
        except EngineCallError as exc:
            raise self.fail(episode, exc.reason, exc.message, exc.fatal) from None
        finally:
            self.open_requests.discard(request.request_id)
            if not self.parking.is_open():  # a drain waits for this (and only a drain)
                self.parking.changed.notify()
        try:
            (piece,) = rollout.merge_outputs(
                self._probe, request, outputs, vocab_size=self.vocab_size, version=self.version()
            )
            if len(piece.versions) and int(piece.versions[0]) < previous:
                raise rollout.RolloutError(
                    f"engine stamped version {int(piece.versions[0])} after a token of "
                    f"version {previous} in the same episode"
                )
        except (ValueError, TypeError) as exc:
            raise self.fail(
                episode, FailureReason.MALFORMED_OUTPUT, f"malformed engine output: {exc}"
            ) from None
        return piece

    async def run(self) -> tuple[RolloutState, ...]:
        """Run every episode of the group concurrently, within `episode_timeout_s`; the
        group's samples, or `EpisodeError` (the first failure; the others are cancelled)."""
        timeout = self.config.episode_timeout_s
        try:
            with anyio.move_on_after(timeout) as deadline:
                self.parking.bind(deadline)
                async with anyio.create_task_group() as tg:
                    self._scope = tg.cancel_scope
                    for episode in self.episodes:
                        tg.start_soon(self._one, episode, name=f"asyncroll-episode-{episode.index}")
        finally:  # the scopes refer to this task: not kept past the run, however it ends
            self._scope = None
            self.parking.bind(None)
        if self.failure is None and deadline.cancelled_caught:
            late = [e for e in self.episodes if e._phase is not _Phase.RETURNED]
            where = "; ".join(f"episode {e.index} {e.where}" for e in late)
            self.failure = EpisodeError(
                FailureReason.EPISODE_DEADLINE,
                f"episodes ran past episode_timeout_s={timeout} (time parked by pauses not "
                f"counted): {where}",
            )
        if (f := self.failure) is not None:  # a copy: the raised one's traceback holds this run
            raise EpisodeError(f.reason, f.message, f.fatal)
        return tuple(e.sample(Status.COMPLETED) for e in self.episodes)

    async def _one(self, episode: Episode) -> None:
        try:
            await self.rollout_fn(episode)
        except EpisodeError as exc:  # recorded by whoever raised it; else record it now
            self.fail(episode, exc.reason, exc.message, exc.fatal)
        except asyncio.CancelledError:
            if cancelling():  # a deadline, a failed sibling, the producer's stop
                # The episode's task ends here without re-raising: `run` reports why. Handed to
                # the task group, the error would be raised again in its done-callback, whose
                # frame then holds it: a cycle through the traceback to this episode's frames
                # (its run, its arrays), freed only by the cyclic garbage collector.
                return
            # The episode ended part-way: a task group would take this for a cancellation.
            message = (
                "rollout function raised CancelledError though nothing cancelled it "
                f"({episode.where})"
            )
            self.fail(episode, FailureReason.ENVIRONMENT_ERROR, message)
        except Exception as exc:
            message = f"rollout function raised {type(exc).__name__}: {exc} ({episode.where})"
            self.fail(episode, FailureReason.ENVIRONMENT_ERROR, message)
        except BaseException as exc:  # not absorbed by one group: the producer stops too
            message = f"rollout function raised {type(exc).__name__} (a BaseException): {exc}"
            self.fail(episode, FailureReason.ENVIRONMENT_ERROR, message, fatal=message)
        else:
            if episode._phase is _Phase.IN_TURN:  # a task it started still samples a turn
                self.fail(
                    episode, FailureReason.ENVIRONMENT_ERROR,
                    f"the rollout function returned while policy turn {episode.policy_turns} "
                    "was still being sampled (by a task it started and did not await)",
                )  # fmt: skip
            episode.where = "done"
            episode._phase = _Phase.RETURNED


def split_turns(sample: RolloutState) -> list[tuple[bool, Int32Array]]:
    """The turns of a sample in order, each as (policy?, its tokens): what a reward function of
    a multi-turn task reads. A single-turn sample is one policy turn."""
    if sample.turn_ends is None or sample.loss_mask is None:
        return [(True, sample.tokens)]
    out, start = [], 0
    for end in sample.turn_ends.tolist():
        policy = end == start or bool(sample.loss_mask[start])  # an empty turn is the policy's
        out.append((policy, sample.tokens[start:end]))
        start = end
    return out
