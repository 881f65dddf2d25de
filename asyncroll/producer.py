"""`Producer`: keeps an engine busy generating groups and hands the trainer ready batches.

Data flows one way: prompt -> engine -> reward -> filter -> buffer -> trainer. The producer only
orchestrates; each job lives in its own module:

* `lifecycle`: the explicit states (the producer's `Phase`, the admission `Gate` and its
  `Hold`ers, each group's `Stage`) and their allowed transitions.
* `attempt`: one attempt at a group (engine call, checks, reward, filter) -> a `Landing`.
* `rewards`: the reward function's deadline and worker threads.
* `buffer`: bounded storage, drop on arrival; `progress`: every counter, counted by outcome.

Structure. `async with producer:` starts one background task that owns an anyio task group
(the scheduler, the `on_drop` deliveries) and one native task per group in flight (`_tasks`:
cheaper to start, awaited and cancelled with the rest). Nothing runs in the caller's task, so
nothing can cancel the trainer or raise an exception group into it: a failure of the producer itself
(a dead engine, a failing prompt source, a bug) is recorded once and reaches every waiter as
`ProducerError`. On exit the producer drains (aborting generation, letting groups being scored
finish within their deadline), cancels what does not stop in time, and waits for every task.

Every state change of a group (start, landing, hand-out, expiry) happens in one synchronous step
together with its counters, so the ledger identity (`check_ledger`) holds at every await point.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import logging
import math
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np

from asyncroll import codec, engine_call, filters, rollout
from asyncroll._signal import Signal
from asyncroll._tasks import Tasks
from asyncroll.attempt import Attempts, Flight, Landing
from asyncroll.buffer import PutOutcome, RolloutBuffer
from asyncroll.config import ProducerConfig, make_config
from asyncroll.drops import DropCallback, OnDrop
from asyncroll.engines.base import Engine, EngineDeadError, Weights
from asyncroll.episode import Parking, RolloutFn
from asyncroll.lifecycle import Gate, Hold, Phase, Stage, move
from asyncroll.logs import FailureWarnings
from asyncroll.outcomes import NOT_ABSORBED, FailureReason
from asyncroll.progress import (
    LatencyHistogram,
    ProduceBatchResult,
    ProduceProgress,
    ProgressCounters,
)
from asyncroll.prompts import PromptSource, PromptStream, TaskMix
from asyncroll.rewards import RewardFn, RewardRunner
from asyncroll.state import (
    STATE_FORMAT,
    CheckpointError,
    ProducerState,
    dumps,
    fit_to_run,
    loads,
    write_atomic,
)
from asyncroll.types import EMPTY_INT32, Int32Array, Prompt, RolloutGroup, Status

__all__ = [
    "DropRecord",
    "Ledger",
    "LedgerError",
    "Producer",
    "ProducerError",
    "ProducerExhausted",
    "RewardFn",
    "StalledError",
    "UpdateWeightsError",
]

log = logging.getLogger(__name__)


class ProducerError(RuntimeError):
    """The producer stopped: dead engine, failing prompt source, hung reward workers, too many
    dead groups in a row, or an internal error."""


class ProducerExhausted(Exception):
    """Every prompt was produced and every ready group handed out."""


class StalledError(RuntimeError):
    """`produce_batch` would wait forever (paused, or the staleness capacity or the buffer's
    bounds are used up); the message names what to change."""


class UpdateWeightsError(RuntimeError):
    """`update_weights` failed; the producer was rolled back to its previous version and runs."""


class LedgerError(AssertionError):
    """The accounting identity does not hold: a bug, never a user error."""


class Ledger(msgspec.Struct, frozen=True, kw_only=True):
    """Where every started group, sample and generated token is right now."""

    started_groups: int
    in_flight_groups: int
    ready_groups: int
    resume_groups: int
    consumed_groups: int
    filtered_groups: int
    failed_groups: int
    expired_groups: int
    started_samples: int
    in_flight_samples: int
    ready_samples: int
    resume_samples: int
    consumed_samples: int
    filtered_samples: int
    failed_samples: int
    expired_samples: int
    generated_tokens: int
    in_flight_tokens: int
    ready_tokens: int
    resume_tokens: int
    consumed_tokens: int
    wasted_tokens: int
    policy_tokens: int = 0
    environment_tokens: int = 0

    def problems(self) -> list[str]:
        out = []
        for unit in ("groups", "samples"):
            parts = ("in_flight", "ready", "resume", "consumed", "filtered", "failed", "expired")
            total = sum(getattr(self, f"{p}_{unit}") for p in parts)
            started = getattr(self, f"started_{unit}")
            if started != total:
                out.append(f"started_{unit}={started} but the states add up to {total}")
        held = (
            self.in_flight_tokens + self.ready_tokens + self.resume_tokens + self.consumed_tokens
            + self.wasted_tokens
        )  # fmt: skip
        if held != self.generated_tokens:
            out.append(f"generated_tokens={self.generated_tokens} but the states hold {held}")
        if self.policy_tokens + self.environment_tokens != self.generated_tokens:
            out.append(
                f"generated_tokens={self.generated_tokens} but policy_tokens="
                f"{self.policy_tokens} + environment_tokens={self.environment_tokens}"
            )
        return out


class DropRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Who was dropped and why, without the payload: what `on_drop` callbacks receive."""

    uid: int
    prompt_id: str
    task: str
    outcome: PutOutcome
    reason: FailureReason | None  # why it failed (None unless outcome is DROPPED_FAILED)
    error: str | None
    samples: int
    tokens: int
    version: int


class _Scheduler(enum.Enum):
    """What the scheduler is doing: a produce_batch must not call a stall while it draws."""

    WAITING = "waiting"
    DRAWING = "drawing"  # awaiting the prompt source


class _Step(enum.Enum):
    """What the scheduler may do next."""

    RESUME = "resume"  # restart the oldest partial group
    START = "start"  # start the staged prompt's group
    DRAW = "draw"  # draw the next prompt


class _Staged(msgspec.Struct, frozen=True):
    """A drawn prompt whose group waits for room, checked once: its token ids (empty when it
    is bad), why it is bad, and the bytes its group can grow to (0 for a bad prompt, which
    never reaches the engine)."""

    prompt: Prompt
    tokens: Int32Array
    error: str | None
    reserve: int


_UNSET: Any = object()


class Producer:
    """Generates rollout groups with `engine` from `prompts`, scored by `reward_fn`.

    Options are `ProducerConfig` fields, given as `config=` or as keywords. `filter` is a
    `filters` name ("nonzero_std"), a callable returning True to keep a scored group, or None.
    `on_drop` is called with a `DropRecord` (no payload) for every failed, filtered or expired
    group, after the counters include it, e.g. to log which prompts failed and why. It may be
    `async def`: then it is awaited off the landing path, in order, each call within
    `on_drop_timeout_s` (`asyncroll.drops` says what a callback that raises or hangs does).

    `rollout_fn` (`async def rollout_fn(episode: Episode) -> None`) makes each sample a
    multi-turn episode driven by user code (see `asyncroll.episode`); without it each group is
    one engine call, which is what `rollout_fn=single_turn` does one sample at a time.
    """

    def __init__(
        self,
        engine: Engine,
        prompts: PromptSource | TaskMix,
        reward_fn: RewardFn,
        *,
        config: ProducerConfig | None = None,
        filter: str | filters.GroupFilter | None = None,
        on_drop: OnDrop[DropRecord] | None = None,
        rollout_fn: RolloutFn | None = None,
        **options: Any,
    ) -> None:
        self.config = cfg = make_config(config, options)
        if rollout_fn is not None and not (
            inspect.iscoroutinefunction(rollout_fn)
            or inspect.iscoroutinefunction(getattr(rollout_fn, "__call__", None))  # noqa: B004
        ):
            raise ValueError(
                f"rollout_fn must be an async function `async def f(episode) -> None`, got "
                f"{type(rollout_fn).__name__}"
            )
        self._episodes = rollout_fn is not None
        if cfg.pause_mode == "keep" and not engine.supports_keep_pause:
            raise ValueError(
                f"pause_mode='keep' but {type(engine).__name__} cannot pause requests in place: "
                "use pause_mode='abort'"
            )
        self._payload = engine.payload_bytes(cfg.sampling.max_new_tokens)
        cfg.check_fits(self._payload, episodes=self._episodes)
        self.engine = engine
        self.reward_fn = reward_fn
        self._rewards = RewardRunner(
            reward_fn,
            timeout_s=cfg.reward_timeout_s,
            workers=cfg.reward_workers,
            in_thread=cfg.reward_in_thread,
        )
        self.filter = filters.resolve(filter)
        if self.filter is filters.nonzero_std and cfg.group_size < 2:
            raise ValueError(
                "filter='nonzero_std' with group_size=1: one sample has no spread, so "
                "nonzero_std filters every group; raise group_size or drop the filter"
            )
        self.on_drop = on_drop
        self._drops = DropCallback(on_drop, timeout_s=cfg.on_drop_timeout_s)
        self._failure_log = FailureWarnings(log, cfg.failure_log_interval_s)
        self._group_bytes = cfg.group_bytes(self._payload, episodes=self._episodes)
        self.buffer = RolloutBuffer(
            max_groups=cfg.max_buffer_groups,
            max_bytes=cfg.max_buffer_bytes,
            reserve_bytes=self._group_bytes,
            max_staleness=cfg.max_staleness,
            order=cfg.order,
        )
        self.progress = ProduceProgress()
        self._freezes = engine_call.Freezes()  # keep-mode pauses stop the generate deadlines
        self._attempts = Attempts(
            engine, cfg, self._rewards, self.filter, rollout_fn, self._freezes
        )
        self._prompts = PromptStream(prompts)
        self._version = 0
        self._next_uid = 0
        self._run_id = uuid.uuid4().hex[:12]  # request ids stay unique on a shared engine
        self._inflight: dict[int, Flight] = {}
        self._changed = Signal()
        self._phase = Phase.NEW
        self._gate = Gate.OPEN
        self._holds: Counter[Hold] = Counter()
        self._gate_lock = asyncio.Lock()
        self._update_lock = asyncio.Lock()
        self._scheduler = _Scheduler.WAITING
        self._draw_scope: anyio.CancelScope | None = None
        self._staged: _Staged | None = None
        self._error: str | None = None
        self._dropped_in_a_row: Counter[str] = Counter()
        self._entry_weights: Weights | None = None
        self._loaded = False  # from a checkpoint: entering sets the engine to its version
        self._runner: asyncio.Task[None] | None = None
        self._groups = Tasks()  # one per group in flight, owned by `_run`
        self._idle_since: float | None = None  # when the last group in flight landed

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Producer:
        if self._phase is not Phase.NEW:
            raise RuntimeError("a Producer runs once: build a new one and load() its checkpoint")
        label = getattr(self.engine, "version", None)  # what engines that report it serve
        if not self._loaded and isinstance(label, int) and label != self._version:
            raise ValueError(
                f"the engine serves version {label} (set by another producer) and this producer "
                f"starts at version {self._version}: entering would relabel it, and every token "
                "of the producer that set it would look stale. Continue that run from its "
                "checkpoint (load(path, weights=...)), or give this producer an engine of its own"
            )
        self._phase = move(self._phase, Phase.RUNNING)
        weights, self._entry_weights = self._entry_weights, None
        self._idle_since = time.monotonic()
        try:  # the engine serves our version (0, or a checkpoint's with the trainer's weights)
            await self._control(
                self.engine.update_weights(weights, version=self._version),
                self.config.update_timeout_s,
                "update_weights",
            )
        except BaseException:
            self._phase = move(move(self._phase, Phase.STOPPING), Phase.STOPPED)
            raise
        del weights
        self._runner = asyncio.create_task(self._run(), name="asyncroll-producer")
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        # Shielded from the caller's anyio scopes, whose cancellation every await would raise
        # again: the exit would return at its first wait with groups and tasks still running.
        # Each wait of the exit has a deadline of its own.
        with anyio.CancelScope(shield=True):
            await self._stop()
        if self._error is not None and exc is None:
            raise ProducerError(self._error)

    async def _run(self) -> None:
        """The producer's background task: owns the scheduler and every group's task."""
        try:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._schedule, name="asyncroll-scheduler")
                    tg.start_soon(self._drops.run, self._fail, name="asyncroll-on-drop")
            except BaseException:  # cancelled, or a bug: the groups end with it
                self._groups.cancel()
                raise
            finally:
                await self._groups.join()
        except Exception as exc:  # a bug escaped a task: every waiter hears of it
            self._fail(f"internal error: {type(exc).__name__}: {exc}")

    async def _stop(self) -> None:
        """Stop admitting, drain what is in flight into resumable partials (groups being scored
        finish), then end every task."""
        if self._phase is Phase.RUNNING:
            self._phase = move(self._phase, Phase.STOPPING)
        if self._draw_scope is not None:
            self._draw_scope.cancel()
        self._changed.notify()
        try:
            await self._drain()
            self._count_idle()
        finally:
            self._drops.close()
            self._failure_log.flush()
            runner, self._runner = self._runner, None
            if runner is not None:  # the scheduler returns once it sees the stop
                try:
                    await asyncio.wait([runner], timeout=self.config.abort_timeout_s)
                finally:  # a cancelled wait too: the owner insists, the tasks end all the same
                    if not runner.done():  # cancel what is left (groups land as interrupted)
                        runner.cancel()
                        await asyncio.wait([runner])
                runner = None
            self._unstage()
            if self.config.pause_mode == "keep" and self._gate is not Gate.OPEN:
                await self._unfreeze("the producer stopped while paused")
            if self._phase is Phase.STOPPING:
                self._phase = move(self._phase, Phase.STOPPED)

    @property
    def version(self) -> int:
        """Policy version: bumped by every `update_weights`."""
        return self._version

    def _current_version(self) -> int:
        return self._version

    @property
    def running(self) -> bool:
        return self._phase is Phase.RUNNING

    @property
    def paused(self) -> bool:
        return bool(self._holds)

    @property
    def error(self) -> str | None:
        """Why the producer stopped, once it has (also raised as `ProducerError`)."""
        return self._error

    # -- the trainer's side ----------------------------------------------------------------------

    async def produce_batch(
        self, n: int | None = None, *, timeout: float | None = None
    ) -> ProduceBatchResult:
        """Wait for `n` ready groups (default `batch_size`) and hand them out with the counters
        since the previous batch. Returns fewer only when the prompts are used up; raises
        `ProducerExhausted` when nothing is left, `ProducerError` if the producer stopped,
        `StalledError` if the batch could never fill (paused by `pause()`, or a bound is used
        up), `TimeoutError` after `timeout` seconds (nothing is taken then)."""
        self._require_running()
        n = self._batch_n(n)
        start = time.monotonic()
        try:
            await self._changed.wait_until(
                lambda: (
                    self.buffer.num_ready >= n
                    or self._error is not None
                    or not self.running
                    or self._drained()
                    or self._stall() is not None
                ),
                timeout,
            )
        finally:
            self.progress.counters.wait_s += time.monotonic() - start
        if self._error is not None:
            raise ProducerError(self._error)
        self._require_running()
        ready = self.buffer.num_ready
        if ready < n and not self._drained():
            raise StalledError(self._stall() or f"produce_batch({n}) cannot fill")
        if ready == 0:
            raise ProducerExhausted("every prompt was produced and every ready group handed out")
        groups = self.buffer.take(min(n, ready))
        self.progress.count_consumed(groups)
        self._failure_log.tick()
        self._changed.notify()
        self._count_idle()
        delta, totals, latency, window_s = self.progress.consume()
        return ProduceBatchResult(
            groups=groups,
            version=self._version,
            delta=delta,
            totals=totals,
            window_s=window_s,
            latency_p50_s=LatencyHistogram.quantile(latency, 0.5),
            latency_p99_s=LatencyHistogram.quantile(latency, 0.99),
        )

    async def batches(self, n: int | None = None) -> AsyncIterator[ProduceBatchResult]:
        """`produce_batch(n)` until the prompts are used up."""
        while True:
            try:
                yield await self.produce_batch(n)
            except ProducerExhausted:
                return

    async def update_weights(self, weights: Weights | None = None) -> int:
        """Pause, load `weights` into the engine (None: loaded out of band), bump the version,
        expire what became too stale, resume. Returns the new version.

        All or nothing: if the engine fails or passes `update_timeout_s`, its version label is
        set back, the producer resumes at the old version and `UpdateWeightsError` says so (the
        engine may hold partly loaded weights until the next successful update). If the label
        cannot be set back, the producer stops (`ProducerError`)."""
        self._require_running()
        async with self._update_lock, self._holding(Hold.UPDATE):
            old, new = self._version, self._version + 1
            try:
                await self._control(
                    self.engine.update_weights(weights, version=new),
                    self.config.update_timeout_s,
                    "update_weights",
                )
            except ProducerError:
                raise
            except BaseException as exc:
                with anyio.CancelScope(shield=True):  # see `_holding`
                    await self._roll_back_label(old, new)
                if not isinstance(exc, Exception):
                    raise
                raise UpdateWeightsError(
                    f"update_weights to version {new} failed ({type(exc).__name__}: {exc}); the "
                    f"producer stays at version {old} and runs on: call update_weights again"
                ) from None
            self._set_version(new)
        return self._version

    async def _roll_back_label(self, old: int, new: int) -> None:
        try:
            await self._control(
                self.engine.update_weights(None, version=old),
                self.config.abort_timeout_s,
                "update_weights",
            )
        except Exception as exc:
            self._fail(
                f"update_weights to version {new} failed and the engine's version label could "
                f"not be set back to {old} ({type(exc).__name__}: {exc}): tokens could be "
                "stamped with a version the producer never reached"
            )

    async def pause(self) -> None:
        """Stop starting groups. In "abort" mode abort in-flight requests and wait until they
        have landed (partial samples wait in the buffer to resume; groups being scored finish);
        in "keep" mode freeze them in the engine. Pauses nest; each needs a `resume`. If the
        pause fails, it is undone and the error raised: the producer is not left paused."""
        self._require_running()
        await self._acquire(Hold.USER)

    async def resume(self) -> None:
        """Undo one `pause`; the last lets groups start again (in "keep" mode it resumes the
        engine: if that fails, the producer stops with `ProducerError`)."""
        await self._release(Hold.USER)

    @contextlib.asynccontextmanager
    async def pausing(self) -> AsyncIterator[None]:
        """`async with producer.pausing():` pause for the block, resume after it (shielded
        from the caller's anyio scopes, as `_holding` says why)."""
        await self.pause()
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await self.resume()

    # -- accounting ------------------------------------------------------------------------------

    def ledger(self) -> Ledger:
        c, b = self.progress.counters, self.buffer.stats()
        return Ledger(
            started_groups=c.started_groups,
            in_flight_groups=len(self._inflight),
            ready_groups=b.ready_groups,
            resume_groups=b.resume_groups,
            consumed_groups=c.consumed_groups,
            filtered_groups=c.filtered_groups,
            failed_groups=c.failed_groups,
            expired_groups=c.expired_groups,
            started_samples=c.started_samples,
            in_flight_samples=sum(f.samples for f in self._inflight.values()),
            ready_samples=b.ready_samples,
            resume_samples=b.resume_samples,
            consumed_samples=c.consumed_samples,
            filtered_samples=c.filtered_samples,
            failed_samples=c.failed_samples,
            expired_samples=c.expired_samples,
            generated_tokens=c.generated_tokens,
            in_flight_tokens=sum(f.tokens for f in self._inflight.values()),
            ready_tokens=b.ready_tokens,
            resume_tokens=b.resume_tokens,
            consumed_tokens=c.consumed_tokens,
            wasted_tokens=c.wasted_tokens_failed + c.wasted_tokens_filtered
            + c.wasted_tokens_expired + c.wasted_tokens_restarted + c.wasted_tokens_truncated,
            policy_tokens=c.policy_tokens,
            environment_tokens=c.environment_tokens,
        )  # fmt: skip

    def check_ledger(self) -> Ledger:
        """Raise `LedgerError` unless every started group, sample and token is in exactly one
        state; return the ledger."""
        ledger = self.ledger()
        problems = ledger.problems()
        if problems:
            raise LedgerError("; ".join(problems) + f" ({ledger})")
        return ledger

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> ProducerState:
        """The run's state. Needs nothing in flight: call it before `async with`, after it, or
        while paused in "abort" mode (or use `save`, which arranges that).

        Groups of episodes (a `rollout_fn`) may be in flight: their episodes are user code and
        cannot be stored, so the checkpoint holds each such group as one to restart from its
        prompt (same uid) and counts what its episodes generated so far as wasted
        (`wasted_tokens_restarted`). The running producer is not changed by this."""
        if self._inflight and not self._episodes:
            raise RuntimeError(
                f"state_dict() with {len(self._inflight)} groups in flight: pause first "
                "(pause_mode='abort'), or use save()"
            )
        self._unstage()
        ready, resume = self.buffer.snapshot()
        counters = self.progress.counters.copy()
        resume = resume + self._restart_entries(counters)
        return ProducerState(
            format=STATE_FORMAT,
            version=self._version,
            next_uid=self._next_uid,
            group_size=self.config.group_size,
            counters=counters,
            latency_counts=self.progress.latency.counts.tolist(),
            cursor=self._prompts.state(),
            ready=ready,
            resume=resume,
        )

    def _restart_entries(self, counters: ProgressCounters) -> list[bytes]:
        """Groups of episodes in flight, as resume entries that restart from their prompt, with
        `counters` (a copy) counting their tokens as wasted: the checkpoint's ledger holds."""
        entries = []
        for flight in sorted(self._inflight.values(), key=lambda f: f.group.uid):
            group = flight.group
            samples = rollout.interrupted(rollout.fresh_samples(group.num_samples))
            restart = msgspec.structs.replace(group, samples=samples, status=Status.ABORTED)
            entries.append(codec.encode(restart))
            if flight.episodes is not None:  # else it never started: nothing is wasted
                counters.count_restart(*flight.episodes.tokens)
        return entries

    def load_state_dict(self, state: ProducerState, *, weights: Weights | None = _UNSET) -> None:
        """Continue the run of `state`; only before `async with`. All or nothing. Groups too
        stale for this producer's `max_staleness` expire as they load (`on_drop` hears of them).

        A checkpoint past version 0 was trained on: `weights` are the trainer's weights at that
        version (`model.named_parameters()`), loaded into the engine on entry. Pass
        `weights=None` only when the engine already serves them; otherwise the base model's
        tokens would be stamped as the checkpoint's version and look on-policy."""
        if self._phase is not Phase.NEW:
            raise RuntimeError("load_state_dict() must come before `async with producer`")
        if state.format != STATE_FORMAT:
            raise CheckpointError(f"checkpoint format {state.format}, expected {STATE_FORMAT}")
        if state.version > 0 and weights is _UNSET:
            raise ValueError(
                f"the checkpoint is at version {state.version}: pass weights=<the trainer's "
                f"weights at version {state.version}> (e.g. model.named_parameters()) so the "
                "engine serves them, or weights=None if it already does"
            )
        if state.group_size != self.config.group_size:
            raise CheckpointError(
                f"checkpoint has group_size={state.group_size}, this producer "
                f"{self.config.group_size}: resume with the same group_size"
            )
        self._prompts.check(state.cursor)
        if len(state.latency_counts) != LatencyHistogram.BUCKETS:
            raise CheckpointError("checkpoint latency histogram has another bucket layout")
        sampling, max_model_len = self.config.sampling, self.engine.max_model_len
        try:
            state = fit_to_run(
                state,
                lambda group: rollout.token_budget(group, sampling, max_model_len),
                episodes=self._episodes,
            )
            self.buffer.restore(state.version, state.ready, state.resume, self._reservation)
        except codec.CodecError as exc:
            raise CheckpointError(f"corrupt checkpoint: a stored group: {exc}") from None
        self._prompts.load(state.cursor)
        self.progress.restore(state.counters, state.latency_counts)
        self._version = state.version
        self._next_uid = state.next_uid
        self._entry_weights = None if weights is _UNSET else weights
        self._loaded = True
        self._set_version(state.version)  # the checkpoint does not fix max_staleness

    async def save(self, path: str | os.PathLike[str]) -> None:
        """Write a checkpoint atomically. While running, pauses, aborts what is in flight into
        partial samples (kept in the checkpoint), takes the state, resumes, and writes. The
        state is that of the moment it paused: a batch handed out while the file is written
        is not in it, so call `save` between training steps, from the training loop, and the
        trainer's checkpoint and this one describe the same step."""
        if self.running:
            async with self._holding(Hold.SAVE):
                await self._drain()
                data = dumps(self.state_dict())  # resumes before the (slow) write
        else:
            data = dumps(self.state_dict())
        await anyio.to_thread.run_sync(write_atomic, path, data)

    def load(self, path: str | os.PathLike[str], *, weights: Weights | None = _UNSET) -> None:
        """Continue from a checkpoint file written by `save` (before `async with`); `weights`
        as in `load_state_dict`."""
        self.load_state_dict(loads(Path(path).read_bytes()), weights=weights)

    # -- scheduling ------------------------------------------------------------------------------

    async def _schedule(self) -> None:
        """Admit work while there is room: resumed groups first, then new prompts. Returns
        once the producer stops (ending normally, so no cancellation traceback keeps a
        reference to the producer alive)."""
        step: _Step | None = None

        def decided() -> bool:  # the step, decided once per wake-up: the rule is not cheap
            nonlocal step
            step = self._next_step()
            return step is not None or self._phase is not Phase.RUNNING

        try:
            while True:
                # The predicate runs in this task right before `wait_until` returns, so `step`
                # is still what the rule says when it is acted on.
                await self._changed.wait_until(decided)
                match step:
                    case _Step.RESUME:
                        taken = self.buffer.take_resume()
                        if taken is not None:
                            self._start(*taken, resumed=True)
                    case _Step.START:
                        staged = self._staged
                        if staged is not None and self.buffer.try_reserve(staged.reserve):
                            self._staged = None
                            self._start(self._new_group(staged), staged.reserve)
                    case _Step.DRAW:
                        await self._draw()
                    case None:
                        return
        except Exception as exc:  # a bug: surface it rather than stall silently
            self._fail(f"scheduler failed: {type(exc).__name__}: {exc}")

    def _next_step(self) -> _Step | None:
        """What the scheduler may do now, or None: the one admission rule."""
        if not self._admitting() or len(self._inflight) >= self.config.max_inflight_groups:
            return None
        if self.buffer.num_resume:
            return _Step.RESUME if self.buffer.can_resume() else None
        if self._staged is None:  # drawing starts nothing, and tells when the prompts end
            return None if self._prompts.exhausted or not self.buffer.can_reserve(0) else _Step.DRAW
        if not self._within_capacity():
            return None
        return _Step.START if self.buffer.can_reserve(self._staged.reserve) else None

    def _admitting(self) -> bool:
        return self._phase is Phase.RUNNING and self._gate is Gate.OPEN and self._error is None

    async def _draw(self) -> None:
        """Draw the next prompt and stage it; a bad one fails at once instead."""
        self._scheduler = _Scheduler.DRAWING
        try:
            if self._prompts.may_wait:
                prompt = await self._draw_within_deadline()
            else:  # drawing from an iterator cannot wait, and no deadline could cut it short
                prompt = await self._prompts.next()
        except NOT_ABSORBED:
            raise
        except BaseException as exc:  # not only an Exception: anything else would kill the
            # scheduler without a word, and every produce_batch would wait forever
            self._fail(f"prompt source raised {type(exc).__name__}: {exc}")
            return
        finally:
            self._scheduler = _Scheduler.WAITING
            self._draw_scope = None
            self._changed.notify()
        if prompt is None:
            return
        staged = self._stage(prompt)
        # A bad prompt needs no capacity, no bytes and no engine, only a slot for an instant
        # (this draw was decided with one free), so it does not wait: a staged prompt goes back
        # into the stream for a checkpoint, and a bad one may not encode or decode there.
        if staged.error is not None and self.buffer.try_reserve(0):
            self._start(self._new_group(staged), 0)
            # It landed without awaiting, and drawing from an iterator does not await: yield,
            # or a run of bad prompts would keep everything else (the trainer) from running.
            await asyncio.sleep(0)
        else:
            self._staged = staged

    async def _draw_within_deadline(self) -> Prompt | None:
        """The next prompt from a source that may wait, within `prompt_timeout_s`; None when
        the source is used up, when a stop cancelled the draw (the cursor still counts the
        prompt as not drawn), or when the deadline passed (the producer fails)."""
        with anyio.move_on_after(self.config.prompt_timeout_s) as scope:
            self._draw_scope = scope  # a stop cancels the draw
            return await self._prompts.next()
        if self._phase is Phase.RUNNING:
            timeout = self.config.prompt_timeout_s
            self._fail(f"prompt source gave nothing within prompt_timeout_s={timeout}")
        return None

    def _stage(self, prompt: Prompt) -> _Staged:
        """Check `prompt` once: bad ids, no room in the model, names or metadata of types a
        group cannot hold, or metadata that cannot be stored make a bad prompt, whose group
        fails without reaching the engine."""
        try:
            _check_fields(prompt)
            tokens = rollout.prompt_array(
                prompt.tokens, self.engine.vocab_size, self.engine.max_model_len
            )
            metadata = len(codec.encode_value(prompt.metadata))
        except rollout.RolloutError as exc:
            return _Staged(prompt, EMPTY_INT32, f"bad prompt: {exc}", 0)
        except codec.CodecError as exc:
            error = f"bad prompt: its metadata cannot be stored: {exc}"
            return _Staged(prompt, EMPTY_INT32, error, 0)
        reserve = self.config.group_bytes(
            self._payload, len(tokens), metadata, episodes=self._episodes
        )
        return _Staged(prompt, tokens, None, reserve)

    def _unstage(self) -> None:
        """Put a staged prompt back at the front of the stream (for a checkpoint, or on stop),
        with the token array it was checked into: what a source gave as ids (a `range`, an
        array type of its own) need not be something a checkpoint can store."""
        if self._staged is not None:
            staged, self._staged = self._staged, None
            prompt = staged.prompt
            if staged.error is None:
                prompt = msgspec.structs.replace(prompt, tokens=staged.tokens)
            self._prompts.unread(prompt)
            self._changed.notify()

    def _reservation(self, group: RolloutGroup) -> int:
        """The bytes a group reserves while in flight (used for restored partial groups)."""
        metadata = len(codec.encode_value(group.metadata))
        return self.config.group_bytes(
            self._payload, len(group.prompt_tokens), metadata, episodes=self._episodes
        )

    def _within_capacity(self) -> bool:
        """AReaL's rule: accepted + running <= (max_staleness + version + 1) x batch_size, so
        nothing starts that would be too stale by the time the trainer can take it."""
        cfg = self.config
        if cfg.max_staleness is None or cfg.batch_size is None:
            return True
        accepted = self.progress.counters.consumed_groups + self.buffer.num_ready
        running = self.buffer.num_reserved + self.buffer.num_resume  # in flight hold reservations
        extra = math.ceil((cfg.oversample - 1.0) * cfg.batch_size)
        return accepted + running < (cfg.max_staleness + self._version + 1) * cfg.batch_size + extra

    def _drained(self) -> bool:
        """Nothing more can become ready: prompts used up and nothing pending."""
        return (
            self._prompts.exhausted
            and self._staged is None
            and self._scheduler is _Scheduler.WAITING
            and not self._inflight
            and not self.buffer.num_resume
        )

    def _stall(self) -> str | None:
        """Why no more groups can become ready until the caller acts, or None while they can.
        Only a user's pause stalls; an update or a save in progress ends by itself."""
        if self._holds[Hold.USER]:
            return "produce_batch while paused would wait forever: resume() first"
        if (
            self._holds
            or self._inflight
            or self._scheduler is _Scheduler.DRAWING
            or self._drained()
            or not self.running
        ):
            return None
        if len(self._inflight) < self.config.max_inflight_groups and self._next_step() is not None:
            return None
        return self._blocked_by()

    def _blocked_by(self) -> str:
        cfg, b = self.config, self.buffer
        held = f"{b.num_ready} groups ready, {b.num_resume} waiting to resume"
        if b.num_resume or self._within_capacity():
            return (
                f"produce_batch would wait forever: {held} use up the buffer "
                f"(max_buffer_groups={cfg.max_buffer_groups}, max_buffer_bytes="
                f"{cfg.max_buffer_bytes}, holding {b.held_bytes} B; the next group needs "
                f"{self._staged.reserve if self._staged else self._group_bytes} B): raise "
                "max_buffer_bytes / max_buffer_groups, or take batches that fit"
            )
        return (
            f"produce_batch would wait forever: {held} and the staleness capacity at version "
            f"{self._version} is used up ((max_staleness={cfg.max_staleness} + version + 1) x "
            f"batch_size={cfg.batch_size}); call update_weights() after each batch, or raise "
            "max_staleness"
        )

    def _batch_n(self, n: int | None) -> int:
        cfg = self.config
        n = n if n is not None else cfg.batch_size
        if n is None or n < 1:
            raise ValueError(f"produce_batch(n={n}): give n >= 1 or set batch_size")
        if n > cfg.max_buffer_groups or n * self._group_bytes > cfg.max_buffer_bytes:
            raise ValueError(
                f"produce_batch({n}) can never fill: the buffer holds max_buffer_groups="
                f"{cfg.max_buffer_groups} and max_buffer_bytes={cfg.max_buffer_bytes} "
                f"(a group can take {self._group_bytes} B before its prompt); raise them or ask "
                "for fewer groups"
            )
        return n

    def _new_group(self, staged: _Staged) -> RolloutGroup:
        uid, prompt = self._next_uid, staged.prompt
        self._next_uid += 1
        task = str(prompt.task)  # a bad prompt's may be anything: its group's is a str
        return RolloutGroup(
            uid=uid,
            prompt_id=str(prompt.prompt_id) if prompt.prompt_id else f"{task}/uid{uid}",
            task=task,
            prompt_tokens=staged.tokens,
            samples=rollout.fresh_samples(self.config.group_size),
            metadata=prompt.metadata if staged.error is None else {},
            start_version=self._version,
            error=staged.error,
        )

    def _start(self, group: RolloutGroup, reserved: int, *, resumed: bool = False) -> None:
        """Put `group` in flight (one synchronous step with its counters) and run its attempt."""
        flight = Flight(group, f"{self._run_id}-{group.uid}-{group.attempts}", reserved)
        self._inflight[group.uid] = flight
        self.progress.count_start(group, resumed=resumed)
        self._count_idle()
        if group.error is not None:  # a bad prompt: fails without reaching the engine
            self._land(
                self._attempts.failed(group, flight, FailureReason.BAD_PROMPT, group.error), flight
            )
            return
        flight.task = self._groups.spawn(
            self._run_group(group, flight), f"asyncroll-group-{group.uid}"
        )

    async def _run_group(self, group: RolloutGroup, flight: Flight) -> None:
        """Run one attempt and land it exactly once, however the attempt ends (cancelled: by a
        drain whose abort the engine ignored, or by the producer's own end)."""
        try:
            landing = await self._attempts.run(group, flight, self._current_version, self._parking)
        except asyncio.CancelledError:
            self._land(self._attempts.interrupted(group, flight), flight)
            raise
        except BaseException as exc:  # a bug in asyncroll, or KeyboardInterrupt / SystemExit
            message = f"internal error in group {group.uid}: {type(exc).__name__}: {exc}"
            self._land(
                self._attempts.failed(group, flight, FailureReason.INTERNAL, message), flight
            )
            self._fail(message)
            if not isinstance(exc, Exception):
                raise
            return
        self._land(landing, flight)

    # -- landing ---------------------------------------------------------------------------------

    def _land(self, landing: Landing, flight: Flight) -> None:
        """Hand a finished attempt to the buffer and count it: one synchronous step that cannot
        raise (a group that cannot be stored is counted as FAILED instead)."""
        group, reason = landing.group, landing.reason
        del self._inflight[group.uid]
        try:
            outcome = self.buffer.put(group, flight.reserved)
        except Exception as exc:  # put changed nothing: fail the group instead
            if isinstance(exc, codec.CodecError):
                reason = FailureReason.UNSTORABLE
                error = f"the group could not be stored: {exc}"
            else:
                reason = FailureReason.INTERNAL
                error = f"internal error storing group {group.uid}: {type(exc).__name__}: {exc}"
                self._fail(error)
            group = msgspec.structs.replace(group, status=Status.FAILED, error=error)
            outcome = self.buffer.put(group, flight.reserved)  # dropped: nothing to encode
        self.progress.count_landing(group, outcome, reason, flight.tokens, landing.rewards)
        if landing.restart is not None:
            self.progress.count_restart(*landing.restart)
        self._count_idle()
        if outcome is PutOutcome.DROPPED_EXPIRED:
            self._requeue(group)
        if landing.fatal is not None:
            self._fail(landing.fatal)
        self._track_drops(outcome, reason)
        if outcome not in (PutOutcome.STORED_READY, PutOutcome.STORED_RESUME):
            self._report_drop(group, outcome, reason)
        self._changed.notify()

    def _track_drops(self, outcome: PutOutcome, reason: FailureReason | None) -> None:
        """Stop the run when `max_dropped_in_a_row` groups in a row fail, are filtered or
        expire on arrival: an endless source would otherwise burn compute forever without a
        word. (Groups that expire at an update are the trainer's pace, not a storm: they are
        not counted. One that is already too stale when it lands never can be ready.)"""
        limit = self.config.max_dropped_in_a_row
        match outcome:
            case PutOutcome.STORED_READY:
                self._dropped_in_a_row.clear()
                return
            case PutOutcome.DROPPED_FAILED:
                self._dropped_in_a_row[f"failed ({reason.value if reason else 'unknown'})"] += 1
            case PutOutcome.DROPPED_FILTERED:
                self._dropped_in_a_row["filtered"] += 1
            case PutOutcome.DROPPED_EXPIRED:
                self._dropped_in_a_row["expired on arrival"] += 1
            case _:
                return
        total = self._dropped_in_a_row.total()
        if limit is not None and total >= limit:
            counts = ", ".join(f"{k}: {v}" for k, v in self._dropped_in_a_row.most_common())
            self._fail(
                f"{total} groups in a row failed, were filtered or expired on arrival ({counts}) "
                "and none completed: check the reward function, the filter and the engine (a "
                "group expires on arrival when the engine stamps versions older than "
                f"version - max_staleness={self.config.max_staleness}: was its version label "
                "set back by another producer on it?) (max_dropped_in_a_row="
                f"{limit}; raise it, or None, if this is expected)"
            )

    def _requeue(self, group: RolloutGroup) -> None:
        """Queue an expired group's prompt again, so no prompt is silently lost."""
        self._prompts.requeue(
            Prompt(
                tokens=group.prompt_tokens.tolist(),
                task=group.task,
                prompt_id=group.prompt_id,
                metadata={k: _detached(v) for k, v in group.metadata.items()},
            )
        )

    def _report_drop(
        self, group: RolloutGroup, outcome: PutOutcome, reason: FailureReason | None
    ) -> None:
        log.debug("group %s (%s) %s: %s", group.uid, group.prompt_id, outcome.value, group.error)
        if outcome is PutOutcome.DROPPED_FAILED:
            self._failure_log.record(
                (reason or FailureReason.INTERNAL).value, group.task, group.error
            )
        if self.on_drop is None:
            return
        record = DropRecord(
            uid=group.uid,
            prompt_id=group.prompt_id,
            task=group.task,
            outcome=outcome,
            reason=reason,
            error=group.error,
            samples=group.num_samples,
            tokens=group.num_tokens,
            version=self._version,
        )
        self._drops.deliver(record, self._fail)

    def _set_version(self, version: int) -> None:
        """Move to `version`: count every group that expired and re-queue its prompt first,
        then report them, so `on_drop` never sees a half-updated ledger."""
        log.debug("policy version %d -> %d", self._version, version)
        self._version = version
        expired = self.buffer.set_version(version)
        for group in expired:
            self.progress.count_expired(group)
            self._requeue(group)
        for group in expired:
            self._report_drop(group, PutOutcome.DROPPED_EXPIRED, None)
        self._changed.notify()

    def _count_idle(self) -> None:
        """Add the idle time since the last group landed (if none is in flight) to `idle_s`."""
        now = time.monotonic()
        if self._idle_since is not None:
            self.progress.counters.idle_s += now - self._idle_since
        self._idle_since = None if self._inflight else now

    def _parking(self) -> Parking:
        """Where episodes wait while the gate is closed (or the producer stops)."""
        return Parking(
            lambda: self._gate is Gate.OPEN and self._phase is Phase.RUNNING, self._changed
        )

    # -- pausing ---------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _holding(self, hold: Hold) -> AsyncIterator[None]:
        """Hold the gate for the block. What undoes the block (releasing the gate, and a
        failed update's rollback) is shielded from the caller's anyio scopes: a cancelled one
        cancels every await in it, and the engine would keep a paused state or a version
        label the producer left behind. Each such call has a deadline of its own."""
        await self._acquire(hold)
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await self._release(hold)

    async def _acquire(self, hold: Hold) -> None:
        """Add a holder of the gate; the first closes it (drain, or freeze in "keep" mode).
        A close that fails is undone before the error is raised, in the engine too."""
        async with self._gate_lock:
            self._holds[hold] += 1
            self._changed.notify()
            if self._holds.total() > 1:
                return
            self._gate = move(self._gate, Gate.DRAINING)
            try:
                if self.config.pause_mode == "keep":
                    self._freezes.freeze()  # thawed by `_unfreeze`, whatever happens
                    await self._control(
                        self.engine.pause_generation(), self.config.abort_timeout_s, "pause"
                    )
                else:
                    await self._drain()
            except BaseException:
                self._holds[hold] -= 1
                self._holds = +self._holds
                self._gate = move(self._gate, Gate.OPEN)
                self._changed.notify()
                if self.config.pause_mode == "keep":  # it may have paused before it failed
                    with anyio.CancelScope(shield=True):  # see `_holding`
                        await self._unfreeze("after a failed pause")
                raise
            self._gate = move(self._gate, Gate.CLOSED)

    async def _release(self, hold: Hold) -> None:
        """Remove a holder; the last opens the gate (resuming the engine in "keep" mode). A
        resume that fails stops the producer rather than raising: the hold is gone either
        way, and what it closed for (an update, a save) is done, so the caller must not take
        its operation for failed and repeat it."""
        async with self._gate_lock:
            if not self._holds[hold]:
                raise RuntimeError("resume() without a matching pause()")
            self._holds[hold] -= 1
            self._holds = +self._holds
            if self._holds:
                self._changed.notify()
                return
            try:
                if self.config.pause_mode == "keep" and self.running:
                    await self._unfreeze("at the end of a pause")
            finally:
                self._gate = move(self._gate, Gate.OPEN)
                self._changed.notify()

    async def _unfreeze(self, when: str) -> None:
        """Resume the engine ("keep" mode): at the end of a pause, and where no `resume` will,
        after a pause that failed (perhaps once the engine had paused: a late answer) and when
        the producer stops while paused (an engine outlives its producer: a new one on it is
        how a run goes on). Resuming one that is not paused does nothing. If it fails, the
        engine may stay frozen, every request waiting for its deadline: the producer stops."""
        try:
            await self._control(
                self.engine.resume_generation(), self.config.abort_timeout_s, "resume"
            )
        except Exception as exc:
            self._fail(f"the engine could not be resumed ({when}): {type(exc).__name__}: {exc}")
        finally:  # requests frozen in an engine that did not resume fail at their deadline
            self._freezes.thaw()

    async def _drain(self) -> None:
        """Abort every request in flight and wait until each group has landed: as a partial
        waiting to resume, or finished. Groups being scored finish (their reward has its own
        deadline); groups whose engine ignores the abort for `abort_timeout_s` are cancelled."""
        if not self._inflight:
            return
        stopping = self._phase is not Phase.RUNNING
        ids: list[str] = []
        for flight in self._inflight.values():
            episodes = flight.episodes
            if episodes is not None and flight.stage is Stage.GENERATING:
                if stopping:  # episodes cannot resume half-way: the group restarts
                    flight.cancel()
                else:  # their turns park inside episode.generate until the gate opens
                    ids.extend(episodes.open_requests)
                continue
            match flight.stage:
                case Stage.STARTING:
                    flight.move(Stage.CANCELLED)
                case Stage.GENERATING:
                    flight.move(Stage.ABORTING)
                    ids.append(flight.request_id)
        await self._abort(ids)
        generating = (Stage.STARTING, Stage.CANCELLED, Stage.GENERATING, Stage.ABORTING)

        def parked(f: Flight) -> bool:  # episodes with nothing in the engine stay in flight
            return (
                not stopping
                and f.episodes is not None
                and f.stage is Stage.GENERATING
                and f.episodes.quiet
            )

        await self._land_within(
            lambda f: f.stage in generating and not parked(f),
            self.config.abort_timeout_s,
            "generating",
        )
        scoring_s = self.config.reward_timeout_s + self.config.abort_timeout_s
        await self._land_within(
            lambda f: not parked(f), scoring_s, "being scored", futile=self._rewards.stuck_error
        )

    async def _land_within(
        self,
        which: Callable[[Flight], bool],
        timeout: float,
        what: str,
        *,
        futile: Callable[[], str | None] = lambda: None,
    ) -> None:
        """Wait until no flight matches `which`; cancel those left after `timeout`, or as soon
        as `futile()` says waiting cannot help (they land as interrupted), and stop the
        producer if even that does not land them."""

        def settled() -> bool:
            return not any(which(f) for f in self._inflight.values())

        with contextlib.suppress(TimeoutError):
            await self._changed.wait_until(lambda: settled() or futile() is not None, timeout)
        if not settled():
            for flight in self._inflight.values():
                if which(flight):
                    flight.cancel()
        try:
            await self._changed.wait_until(settled, self.config.abort_timeout_s)
        except TimeoutError:
            self._fail(f"groups {what} ignored both abort and cancellation")
            raise ProducerError(self._error) from None

    async def _abort(self, request_ids: list[str]) -> None:
        """Abort requests concurrently, all within one `abort_timeout_s`."""
        if not request_ids:
            return

        async def abort(request_id: str) -> None:
            try:
                await self.engine.abort(request_id)
            except EngineDeadError as exc:
                self._fail(f"engine died: {exc}")
            except Exception as exc:  # the wait that follows still bounds the request
                log.debug("abort of %s raised %s: %s", request_id, type(exc).__name__, str(exc))

        with anyio.move_on_after(self.config.abort_timeout_s):
            async with anyio.create_task_group() as tg:
                for request_id in request_ids:
                    tg.start_soon(abort, request_id)

    # -- engine calls, errors --------------------------------------------------------------------

    async def _control(self, call: Awaitable[None], timeout_s: float, what: str) -> None:
        """Await an engine control call within a deadline; a dead engine stops the producer."""
        with anyio.move_on_after(timeout_s) as scope:
            try:
                await call
            except EngineDeadError as exc:
                self._fail(f"engine died: {exc}")
                raise ProducerError(self._error) from None
        if scope.cancelled_caught:
            raise TimeoutError(f"the engine's {what} did not finish within {timeout_s} s")

    def _fail(self, message: str) -> None:
        """Record the producer's failure (the first one wins) and wake every waiter."""
        if self._error is None:
            self._error = message
            log.error("producer stopped: %s", message)
        self._changed.notify()

    def _require_running(self) -> None:
        if self._phase is not Phase.RUNNING:
            raise RuntimeError(
                "the producer is not running: use `async with producer:`"
                if self._phase is Phase.NEW
                else "the producer has stopped"
            )


def _check_fields(prompt: Prompt) -> None:
    """`RolloutError` unless the prompt's task, id and metadata have the types its group
    holds. `Prompt` does not check them (nor does a mapping a source yields), and the codec
    writes any msgpack type but reads a group back only with these: a group stored with an int
    `prompt_id` would fail only when handed out, taking its batch out of the ledger with it."""
    if not isinstance(prompt.task, str):
        raise rollout.RolloutError(f"its task must be a str, got {type(prompt.task).__name__}")
    if not isinstance(prompt.prompt_id, str | None):
        raise rollout.RolloutError(
            f"its prompt_id must be a str or None, got {type(prompt.prompt_id).__name__}"
        )
    metadata = prompt.metadata
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise rollout.RolloutError("its metadata must be a dict with str keys")


def _detached(value: Any) -> Any:
    """A copy of an array that may be a view into a decoded group's bytes (so keeping it does
    not keep the whole group alive); anything else as is."""
    return np.array(value) if isinstance(value, np.ndarray) else value
