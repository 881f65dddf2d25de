"""`Producer`: keeps an engine busy generating groups and hands the trainer ready batches.

Data flows one way: prompt -> engine -> reward -> filter -> buffer -> trainer. The producer owns
the run and wires the parts that do its jobs, each a module of its own:

* `core`: the state the parts share (groups in flight, phase, version, the change signal) and
  the one error path, `Core.fail`.
* `admission`: the scheduler and the one admission rule (draw, stage, capacity, stall).
* `flights`: start a group, run its attempt, land it (buffer, counters, `on_drop`), expire.
* `control`: the gate and its holds (pause, update, save), the drain and aborts.
* `checkpoint` (and `state`): what a checkpoint holds and how it loads; `ledger`: the identity.
* `attempt`: one attempt at a group (engine call, checks, reward, filter) -> a `Landing`.
* `lifecycle`: the explicit states; `rewards`, `buffer`, `progress`: as named.

Structure. `async with producer:` starts one background task that owns an anyio task group
(the scheduler, the `on_drop` deliveries) and one native task per group in flight (`_tasks`:
cheaper to start, awaited and cancelled with the rest). Nothing runs in the caller's task, so
nothing can cancel the trainer or raise an exception group into it: a failure of the producer itself
(a dead engine, a failing prompt source, a bug) is recorded once and reaches every waiter as
`ProducerError`. On exit the producer drains (aborting generation, letting groups being scored
finish within their deadline), cancels what does not stop in time, and waits for every task.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio

from asyncroll import filters
from asyncroll._core import checkpoint, engine_call, ledger, rollout
from asyncroll._core.admission import Admission, Staged
from asyncroll._core.attempt import Attempts, Flight
from asyncroll._core.control import Control
from asyncroll._core.core import Core, ProducerError
from asyncroll._core.drops import DropCallback, OnDrop
from asyncroll._core.flights import DropRecord, Flights
from asyncroll._core.ledger import Ledger, LedgerError
from asyncroll._core.lifecycle import Gate, Hold, Phase, move
from asyncroll._core.logs import FailureWarnings
from asyncroll._core.progress import LatencyHistogram, ProduceBatchResult, ProduceProgress
from asyncroll._core.rewards import RewardFn, RewardRunner
from asyncroll._core.state import ProducerState, dumps, loads, write_atomic
from asyncroll._core.tasks import thread_to_end, to_end
from asyncroll._core.wakeup import Signal
from asyncroll.buffer import RolloutBuffer
from asyncroll.config import ProducerConfig, make_config
from asyncroll.engines.base import (
    Engine,
    GenerateRequest,
    SampleOutput,
    Weights,
    engine_options,
)
from asyncroll.episode import RolloutFn
from asyncroll.lora import LoraAdapter
from asyncroll.prompts import PromptSource, PromptStream, TaskMix
from asyncroll.record.writer import Record, RecordOption

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


class ProducerExhausted(Exception):
    """Every prompt was produced and every ready group handed out."""


class StalledError(RuntimeError):
    """`produce_batch` would wait forever (paused, or the staleness capacity or the buffer's
    bounds are used up); the message names what to change."""


class UpdateWeightsError(RuntimeError):
    """`update_weights` failed before the engine committed the new weights; the producer stays
    at its previous version and runs."""


class CutUpdate(enum.Enum):
    """What an update cut off (an error, `update_timeout_s`, a cancellation) left in the
    engine, as its `version` tells (see `Engine.version`)."""

    NOT_COMMITTED = "not committed"  # the old label: nothing to undo
    COMMITTED = "committed"  # the new label: the update was made
    UNNAMED = "unnamed"  # any other label: weights nobody can name


_UNSET: Any = object()


class Producer:
    """Generates rollout groups with `engine` from `prompts`, scored by `reward_fn`.

    Options are `ProducerConfig` fields, given as `config=` or as keywords. `filter` is a
    `filters` name ("nonzero_std"), a callable returning True to keep a scored group, or None.
    `on_drop` is called with a `DropRecord` (no payload) for every failed, filtered or expired
    group, after the counters include it, e.g. to log which prompts failed and why. It may be
    `async def`: then it is awaited off the landing path, in order, each call within
    `on_drop_timeout_s` (`asyncroll._core.drops` says what a callback that raises or hangs does).

    `record` (a run folder, or an `asyncroll.record.RecordConfig`) writes every handed-out
    group token by token, a sample of the dropped ones and each step's metrics to
    `<folder>/record/`, off the event loop (`asyncroll.record.writer`); the trainer adds its
    logprobs and metrics through `producer.record`.

    `rollout_fn` (`async def rollout_fn(episode: Episode) -> None`) makes each sample a
    multi-turn episode driven by user code (see `asyncroll.episode`); without it each group is
    one engine call, which is what `rollout_fn=single_turn` does one sample at a time.

    The engine's version label belongs to one producer at a time: a producer loaded from a
    checkpoint sets it to the checkpoint's version on entry; one that was not refuses an engine
    labelled with a version other than its own 0 (`ValueError`), since relabelling it would
    make every token of the producer that set it look stale.
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
        record: RecordOption = None,
        **options: Any,
    ) -> None:
        # Required members checked and optional ones read (or defaulted) once: an engine
        # written before a member was added runs, and one missing a member is named here.
        self._engine_options = optional = engine_options(engine)
        self.config = cfg = make_config(config, options)
        if rollout_fn is not None and not (
            inspect.iscoroutinefunction(rollout_fn)
            or inspect.iscoroutinefunction(getattr(rollout_fn, "__call__", None))  # noqa: B004
        ):
            raise ValueError(
                f"rollout_fn must be an async function `async def f(episode) -> None`, got "
                f"{type(rollout_fn).__name__}"
            )
        episodes = rollout_fn is not None
        if cfg.pause_mode == "keep" and not engine.supports_keep_pause:
            raise ValueError(
                f"pause_mode='keep' but {type(engine).__name__} cannot pause requests in place: "
                "use pause_mode='abort'"
            )
        # An engine that states how long its pause or resume can take (VLLMServerEngine:
        # per-replica deadlines) must fit inside the producer's own wait for it, or a pause
        # that is still going stops the run as a timeout and its undo waits behind it.
        bound = optional.pause_bound_s
        if bound is not None and bound >= cfg.abort_timeout_s:
            raise ValueError(
                f"abort_timeout_s={cfg.abort_timeout_s} does not outlast the engine's pause "
                f"bound ({type(engine).__name__}.pause_bound_s={bound}): raise abort_timeout_s "
                "above it, or lower the engine's pause_timeout_s"
            )
        _check_adapter_slots(engine, optional.adapter_slots, cfg.max_staleness)
        if (warning := rollout.budget_warning(cfg.sampling, engine.max_model_len)) is not None:
            log.warning("Producer: %s", warning)
        payload = engine.payload_bytes(cfg.sampling.max_new_tokens)
        cfg.check_fits(payload, episodes=episodes)
        self.engine = engine
        self.reward_fn = reward_fn
        self._rewards = rewards = RewardRunner(
            reward_fn,
            timeout_s=cfg.reward_timeout_s,
            workers=cfg.reward_workers,
            in_thread=cfg.reward_in_thread,
            executor=cfg.reward_executor,
            max_calls=cfg.reward_worker_max_calls,
            max_rss_mib=cfg.reward_worker_max_mib,
        )
        self.filter = filters.resolve(filter)
        if self.filter is filters.nonzero_std and cfg.group_size < 2:
            raise ValueError(
                "filter='nonzero_std' with group_size=1: one sample has no spread, so "
                "nonzero_std filters every group; raise group_size or drop the filter"
            )
        self.on_drop = on_drop
        group_bytes = cfg.group_bytes(payload, episodes=episodes)
        buffer = RolloutBuffer(
            max_groups=cfg.max_buffer_groups,
            max_bytes=cfg.max_buffer_bytes,
            reserve_bytes=group_bytes,
            max_staleness=cfg.max_staleness,
            order=cfg.order,
        )
        self._core = core = Core(
            cfg, engine, buffer, PromptStream(prompts),
            payload=payload, group_bytes=group_bytes, episodes=episodes,
        )  # fmt: skip
        self._drops = DropCallback(on_drop, timeout_s=cfg.on_drop_timeout_s)
        self.record = Record(record)  # a folder it cannot write is refused here
        self._failure_log = FailureWarnings(log, cfg.failure_log_interval_s)
        freezes = engine_call.Freezes()  # keep-mode pauses stop the generate deadlines
        self._control = Control(core, freezes, rewards.stuck_error)
        attempts = Attempts(engine, cfg, rewards, self.filter, rollout_fn, freezes)
        self._flights = Flights(
            core, attempts, self._drops, self._failure_log, reporting=on_drop is not None,
            parking=self._control.parking, run_id=uuid.uuid4().hex[:12], record=self.record,
        )  # fmt: skip
        self._admission = Admission(core, self._control, self._flights.start)
        self._update_lock = asyncio.Lock()
        self._entry_weights: Weights | LoraAdapter | None = None
        self._loaded = False  # from a checkpoint: entering sets the engine to its version
        self._runner: asyncio.Task[None] | None = None

    @property
    def buffer(self) -> RolloutBuffer:
        """The buffer every part of the producer uses (a benchmark may wrap it before entry)."""
        return self._core.buffer

    @buffer.setter
    def buffer(self, buffer: RolloutBuffer) -> None:
        self._core.buffer = buffer

    @property
    def progress(self) -> ProduceProgress:
        return self._core.progress

    # Shared state the tests watch.

    @property
    def _changed(self) -> Signal:
        return self._core.changed

    @property
    def _inflight(self) -> dict[int, Flight]:
        return self._core.inflight

    @property
    def _phase(self) -> Phase:
        return self._core.phase

    @property
    def _staged(self) -> Staged | None:
        return self._admission.staged

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Producer:
        core = self._core
        if core.phase is not Phase.NEW:
            raise RuntimeError("a Producer runs once: build a new one and load() its checkpoint")
        label = self.engine.version
        if not self._loaded and label != core.version:
            raise ValueError(
                f"the engine serves version {label} (set by another producer) and this producer "
                f"starts at version {core.version}: entering would relabel it, and every token "
                "of the producer that set it would look stale. Continue that run from its "
                "checkpoint (load(path, weights=...)), or give this producer an engine of its own"
            )
        self.record.start(resumed=self._loaded, model=_model_name(self.engine), settings={
            "group_size": self.config.group_size,
            "batch_size": self.config.batch_size,
            "max_staleness": self.config.max_staleness,
            "max_new_tokens": self.config.sampling.max_new_tokens,
            "engine": type(self.engine).__name__,
        })  # fmt: skip
        core.phase = move(core.phase, Phase.RUNNING)
        weights, self._entry_weights = self._entry_weights, None
        self._flights.idle_since = time.monotonic()
        try:  # the engine serves our version (0, or a checkpoint's with the trainer's weights)
            await core.control_call(
                self.engine.update_weights(weights, version=core.version),
                self.config.update_timeout_s,
                "update_weights",
            )
            if self.record.enabled:  # its process started beside the update: now it is up
                await anyio.to_thread.run_sync(self.record.started)
        except BaseException:
            core.phase = move(move(core.phase, Phase.STOPPING), Phase.STOPPED)
            self.record.close(0)  # nothing but its run line can wait: the writer is killed
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
        if self._core.error is not None and exc is None:
            raise ProducerError(self._core.error)

    async def _run(self) -> None:
        """The producer's background task: owns the scheduler and every group's task."""
        groups = self._flights.tasks
        try:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._admission.schedule, name="asyncroll-scheduler")
                    tg.start_soon(self._drops.run, self._core.fail, name="asyncroll-on-drop")
            except BaseException:  # cancelled, or a bug: the groups end with it
                groups.cancel()
                raise
            finally:
                await groups.join()
        except Exception as exc:  # a bug escaped a task: every waiter hears of it
            self._core.fail(f"internal error: {type(exc).__name__}: {exc}")

    async def _stop(self) -> None:
        """Stop admitting, drain what is in flight into resumable partials (groups being scored
        finish), then end every task."""
        core = self._core
        if core.phase is Phase.RUNNING:
            core.phase = move(core.phase, Phase.STOPPING)
        self._admission.cancel_draw()
        core.changed.notify()
        try:
            await self._control.drain()
            self._flights.count_idle()
        finally:
            self._drops.close()
            self._failure_log.flush()
            try:
                await self._end_runner()
            finally:  # cut by another cancellation or not: each step has a deadline of its own
                await to_end(self._release())

    async def _end_runner(self) -> None:
        """Wait for the producer's task (the scheduler returns once it sees the stop); cancel
        what is left after `abort_timeout_s` (groups land as interrupted)."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        try:
            await asyncio.wait([runner], timeout=self.config.abort_timeout_s)
        finally:  # a cancelled wait too: the owner insists, the tasks end all the same
            if not runner.done():
                runner.cancel()
                await asyncio.wait([runner])

    async def _release(self) -> None:
        """What the run holds besides its tasks: the staged prompt, the reward workers, the
        record's writer, a frozen engine. Awaited to its end by `_stop`, whose own waits the
        owner's cancellations may cut short: this runs after them all the same (a writer left
        running would lose the record's last lines, a frozen engine stay paused)."""
        core = self._core
        self._admission.unstage()
        self._rewards.close()  # no worker process outlives the run
        if self.record.enabled:  # the last lines written and flushed, off the loop
            await anyio.to_thread.run_sync(self.record.close, self.config.abort_timeout_s)
        if self.config.pause_mode == "keep" and self._control.gate is not Gate.OPEN:
            await self._control.unfreeze("the producer stopped while paused")
        if core.phase is Phase.STOPPING:
            core.phase = move(core.phase, Phase.STOPPED)

    @property
    def version(self) -> int:
        """Policy version: bumped by every `update_weights`."""
        return self._core.version

    @property
    def running(self) -> bool:
        return self._core.running

    @property
    def paused(self) -> bool:
        return bool(self._control.holds)

    @property
    def error(self) -> str | None:
        """Why the producer stopped, once it has (also raised as `ProducerError`)."""
        return self._core.error

    # -- the trainer's side ----------------------------------------------------------------------

    async def produce_batch(
        self, n: int | None = None, *, timeout: float | None = None
    ) -> ProduceBatchResult:
        """Wait for `n` ready groups (default `batch_size`) and hand them out with the counters
        since the previous batch. Returns fewer only when the prompts are used up (a short
        last batch logs a warning); raises `ProducerExhausted` when nothing is left,
        `ProducerError` if the producer stopped, `StalledError` if the batch could never fill
        (paused by `pause()`, or a bound is used up), `TimeoutError` after `timeout` seconds
        (nothing is taken then)."""
        self._require_running()
        core, admission = self._core, self._admission
        n = admission.batch_n(n)
        start = time.monotonic()
        try:
            await core.changed.wait_until(
                lambda: (
                    self.buffer.num_ready >= n
                    or core.error is not None
                    or not core.running
                    or admission.drained()
                    or admission.stall() is not None
                ),
                timeout,
            )
        finally:
            core.progress.counters.wait_s += time.monotonic() - start
        if core.error is not None:
            raise ProducerError(core.error)
        self._require_running()
        ready = self.buffer.num_ready
        if ready < n and not admission.drained():
            raise StalledError(admission.stall() or f"produce_batch({n}) cannot fill")
        if ready == 0:
            raise ProducerExhausted(self._exhausted())
        groups = self.buffer.take(min(n, ready))
        if len(groups) < n:
            log.warning(
                "produce_batch returns %d of the %d groups asked for: the prompts are used up "
                "and this is the last batch (the next call raises ProducerExhausted); for full "
                "batches to the end, cycle the prompts (itertools.cycle) or stop before",
                len(groups), n,
            )  # fmt: skip
        core.progress.count_consumed(groups)
        self._failure_log.tick()
        core.changed.notify()
        self._flights.count_idle()
        delta, totals, latency, window_s = core.progress.consume()
        result = ProduceBatchResult(
            groups=groups,
            version=core.version,
            delta=delta,
            totals=totals,
            window_s=window_s,
            latency_p50_s=LatencyHistogram.quantile(latency, 0.5),
            latency_p99_s=LatencyHistogram.quantile(latency, 0.99),
            failure_causes=core.progress.take_causes(),
        )
        self.record.handed_out(result)
        return result

    def _exhausted(self) -> str:
        """Why there is nothing left: a run that never had a group ready says what became of
        its groups, which would otherwise read as an empty dataset."""
        c = self._core.progress.counters
        if c.consumed_groups:
            return "every prompt was produced and every ready group handed out"
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(c.failed_groups_by_reason.items()))
        return (
            f"the prompts ran out and no group was ever ready: {c.started_groups} started, "
            f"{c.failed_groups} failed ({reasons or 'none'}), {c.filtered_groups} filtered, "
            f"{c.expired_groups} expired; on_drop or logging at WARNING shows each failure's "
            "cause"
        )

    async def batches(self, n: int | None = None) -> AsyncIterator[ProduceBatchResult]:
        """`produce_batch(n)` until the prompts are used up."""
        while True:
            try:
                yield await self.produce_batch(n)
            except ProducerExhausted:
                return

    async def update_weights(self, weights: Weights | LoraAdapter | None = None) -> int:
        """Pause, load `weights` into the engine (None: loaded out of band), bump the version,
        expire what became too stale, resume. Returns the new version.

        All or nothing, as the engine committed it (`Engine.version`: it labels only weights
        that serve). If the engine fails, passes `update_timeout_s` or is cancelled before it
        committed, its label is still the old version: the producer stays there, runs on, and
        `UpdateWeightsError` says so (an engine whose load was cut part way serves nothing
        until an update succeeds: call this again). Cut once it had committed (at its final
        resume, say), the update was made: the producer moves to the new version as after any
        update and, unless it was cancelled, returns it (a caller must not repeat it). An
        engine reporting any other label after a cut stops the producer (`ProducerError`).

        An adapter sent to an engine that serves adapters (`Engine.adapter_slots`) is not
        paused for: the engine binds an adapter to each request, so running groups finish
        under the version they started with (labelled so) while new ones take the new one. A
        `pause` or `save` asked for meanwhile waits for the update (`Control.steady`)."""
        self._require_running()
        core = self._core
        hold: contextlib.AbstractAsyncContextManager[None] = (
            self._control.steady()
            if isinstance(weights, LoraAdapter) and self._engine_options.adapter_slots is not None
            else self._control.holding(Hold.UPDATE)
        )
        async with self._update_lock, hold:
            old, new = core.version, core.version + 1
            try:
                await core.control_call(
                    self.engine.update_weights(weights, version=new),
                    self.config.update_timeout_s,
                    "update_weights",
                )
            except ProducerError:
                raise
            except BaseException as exc:
                cut = self._cut(exc, old, new)
                if cut is CutUpdate.COMMITTED:
                    self._flights.set_version(new)
                if not isinstance(exc, Exception):
                    raise  # a cancellation goes on, to the scope that ends it
                match cut:
                    case CutUpdate.COMMITTED:
                        return new
                    case CutUpdate.NOT_COMMITTED:
                        raise UpdateWeightsError(
                            f"update_weights to version {new} failed ({type(exc).__name__}: "
                            f"{exc}); the producer stays at version {old} and runs on: call "
                            "update_weights again"
                        ) from exc  # the engine's reason (a LoraError, say) stays attached
                    case CutUpdate.UNNAMED:
                        raise ProducerError(core.error) from None
            self._flights.set_version(new)
        return core.version

    def _cut(self, exc: BaseException, old: int, new: int) -> CutUpdate:
        """What the update to `new` that `exc` cut off left in the engine. Committed, it is
        logged (the producer adopts it); a label that is neither `old` nor `new` stops the
        producer: every later token would carry it, on weights nobody can name."""
        why = f"{type(exc).__name__}: {exc}"
        label = self.engine.version
        if label == old:
            return CutUpdate.NOT_COMMITTED
        if label == new:
            log.warning(
                "update_weights to version %d was cut off (%s) after the engine had committed "
                "it: the producer moves to version %d",
                new, why, new,
            )  # fmt: skip
            return CutUpdate.COMMITTED
        self._core.fail(
            f"update_weights to version {new} was cut off ({why}) and the engine then "
            f"reported version {label}, neither {old} (not committed) nor {new} (committed): "
            "its weights cannot be named, so no later token could be trusted"
        )
        return CutUpdate.UNNAMED

    async def pause(self) -> None:
        """Stop starting groups. In "abort" mode abort in-flight requests and wait until they
        have landed (partial samples wait in the buffer to resume; groups being scored finish);
        in "keep" mode freeze them in the engine. Pauses nest; each needs a `resume`. If the
        pause fails, it is undone and the error raised: the producer is not left paused."""
        self._require_running()
        await self._control.acquire(Hold.USER)

    async def resume(self) -> None:
        """Undo one `pause`; the last lets groups start again (in "keep" mode it resumes the
        engine: if that fails, the producer stops with `ProducerError`)."""
        await self._control.release(Hold.USER)

    @contextlib.asynccontextmanager
    async def pausing(self) -> AsyncIterator[None]:
        """`async with producer.pausing():` pause for the block, resume after it (shielded
        from the caller's anyio scopes, as `Control.holding` says why)."""
        await self.pause()
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await self.resume()

    async def guest_generate(
        self, request: GenerateRequest, *, timeout_s: float | None = None
    ) -> Sequence[SampleOutput]:
        """Generate `request` on this producer's engine for a caller outside the run (an
        `asyncroll.evaluation.Evaluator`), leaving the run untouched: no counter, version,
        buffer or ledger entry hears of it. It starts only while no pause, update or save
        holds the engine, and a drain (in "abort" mode) aborts it like the run's own requests:
        it then returns samples finished "abort", and each token's version says which weights
        sampled it (`Engine`), so the caller can tell a request an update cut. Within
        `timeout_s` of engine time (default `generate_timeout_s`); every failure of the engine
        raises `engine_call.EngineCallError`, `RuntimeError` once the producer has stopped.
        The wait for a closed gate has no deadline of its own: bound it from the caller."""
        self._require_running()
        timeout = self.config.generate_timeout_s if timeout_s is None else timeout_s
        return await self._control.guest_generate(request, timeout)

    # -- accounting ------------------------------------------------------------------------------

    def ledger(self) -> Ledger:
        return ledger.ledger_of(self._core)

    def check_ledger(self) -> Ledger:
        """Raise `LedgerError` unless every started group, sample and token is in exactly one
        state; return the ledger."""
        return ledger.check(self._core)

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> ProducerState:
        """The run's state. Needs nothing in flight: call it before `async with`, after it, or
        while paused in "abort" mode (or use `save`, which arranges that).

        Groups of episodes (a `rollout_fn`) may be in flight: their episodes are user code and
        cannot be stored, so the checkpoint holds each such group as one to restart from its
        prompt (same uid) and counts what its episodes generated so far as wasted
        (`wasted_tokens_restarted`). The running producer is not changed by this."""
        return checkpoint.snapshot(self._core, self._admission)

    def load_state_dict(
        self, state: ProducerState, *, weights: Weights | LoraAdapter | None = _UNSET
    ) -> None:
        """Continue the run of `state`; only before `async with`. All or nothing. Groups too
        stale for this producer's `max_staleness` expire as they load (`on_drop` hears of them).
        Partial samples at or past this producer's token budget (a smaller `max_new_tokens` or
        `max_model_len`) finish as "length", truncated to it; with a `rollout_fn`, partial
        groups restart from their prompt (`state.fit_to_run`).

        Every other `ProducerConfig` field may differ from the saved run's, except
        `group_size` (stored groups hold that many samples) and a `max_buffer_groups` below
        the groups the checkpoint holds: those are refused, naming the field, before anything
        loads. A new `batch_size` continues the staleness schedule from the checkpoint (the
        groups it expected taken by its version), `batch_size` more per version from there
        (`tests/test_resume_config.py` changes each field).

        A checkpoint past version 0 was trained on: `weights` are the trainer's weights at that
        version (`model.named_parameters()`), loaded into the engine on entry. Pass
        `weights=None` only when the engine already serves them; otherwise the base model's
        tokens would be stamped as the checkpoint's version and look on-policy."""
        if self._core.phase is not Phase.NEW:
            raise RuntimeError("load_state_dict() must come before `async with producer`")
        checkpoint.restore(self._core, self._admission, state, weights_given=weights is not _UNSET)
        self._entry_weights = None if weights is _UNSET else weights
        self._loaded = True
        self._flights.set_version(state.version)  # the checkpoint does not fix max_staleness

    async def save(self, path: str | os.PathLike[str]) -> None:
        """Write a checkpoint atomically. While running, pauses, aborts what is in flight into
        partial samples (kept in the checkpoint), takes the state, resumes, and writes. The
        state is that of the moment it paused: a batch handed out while the file is written
        is not in it, so call `save` between training steps, from the training loop, and the
        trainer's checkpoint and this one describe the same step. Cancelled while the file is
        written, it returns once the write has ended: the file is then the old one or the new
        one, and nothing changes it later."""
        if self.running:
            async with self._control.holding(Hold.SAVE):
                await self._control.drain()
                data = dumps(self.state_dict())  # resumes before the (slow) write
        else:
            data = dumps(self.state_dict())
        await thread_to_end(write_atomic, path, data)  # cancelled, the file is settled

    def load(
        self, path: str | os.PathLike[str], *, weights: Weights | LoraAdapter | None = _UNSET
    ) -> None:
        """Continue from a checkpoint file written by `save` (before `async with`); `weights`
        as in `load_state_dict`."""
        self.load_state_dict(loads(Path(path).read_bytes()), weights=weights)

    def _require_running(self) -> None:
        phase = self._core.phase
        if phase is not Phase.RUNNING:
            raise RuntimeError(
                "the producer is not running: use `async with producer:`"
                if phase is Phase.NEW
                else "the producer has stopped"
            )


def _model_name(engine: Engine) -> str | None:
    """The engine's model (a path or name), when it says: for the record's header."""
    model = getattr(engine, "model", None)
    return model if isinstance(model, str) else None


def _check_adapter_slots(engine: Engine, slots: int | None, max_staleness: int | None) -> None:
    """Updating adapters without a pause leaves the adapters of up to `max_staleness` older
    versions in use beside the new one: an engine that registers fewer (`adapter_slots`) would
    abort the groups of the oldest at each update."""
    if slots is not None and max_staleness is not None and slots < max_staleness + 1:
        raise ValueError(
            f"max_staleness={max_staleness} lets groups of {max_staleness + 1} versions run at "
            f"once, but {type(engine).__name__} registers {slots} LoRA adapters: start it with "
            f"LoraSlots(slots={max_staleness + 1}) or more, or lower max_staleness"
        )
