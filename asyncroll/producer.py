"""`Producer`: keeps an engine busy generating groups and hands the trainer ready batches.

Data flows one way: prompt -> engine -> reward -> filter -> buffer -> trainer. One scheduler
task admits work (resumed partial groups first, then new prompts) while a slot, the staleness
capacity and `max_inflight_groups` allow; one task per group runs an attempt and lands the
result in the buffer. All of them live in one `asyncio.TaskGroup` owned by `async with
producer:`, which on exit aborts what is in flight (partial samples are kept for resumption),
cancels what does not stop in time, and waits for every task.

Every state change of a group (start, landing, hand-out, expiry) happens in one synchronous step
together with its counters, so the ledger identity (`check_ledger`) holds at every await point.
Failures of one group (engine error or deadline, malformed output, bad prompt, reward error or
deadline) become a FAILED group; only a dead engine, a failing prompt source or a bug stops the
producer, and then `produce_batch` raises `ProducerError` instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from asyncroll import filters, rollout
from asyncroll._signal import Signal
from asyncroll.buffer import PutOutcome, RolloutBuffer
from asyncroll.config import ProducerConfig, make_config
from asyncroll.engines.base import Engine, EngineDeadError, Weights
from asyncroll.progress import LatencyHistogram, ProduceBatchResult, ProduceProgress
from asyncroll.prompts import PromptSource, PromptStream, TaskMix
from asyncroll.state import STATE_FORMAT, CheckpointError, ProducerState, dumps, loads, write_atomic
from asyncroll.types import (
    EMPTY_INT32,
    Prompt,
    RolloutGroup,
    RolloutState,
    Status,
    group_status,
)

RewardFn = Callable[[RolloutGroup], Sequence[float] | Awaitable[Sequence[float]]]
"""Scores a completed group: one reward per sample, in order (sync or async)."""


class ProducerError(RuntimeError):
    """The producer stopped: dead engine, failing prompt source, or an internal error."""


class ProducerExhausted(Exception):
    """Every prompt was produced and every ready group handed out."""


class StalledError(RuntimeError):
    """`produce_batch` would wait forever (e.g. the staleness capacity is used up)."""


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
        return out


class DropRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Who was dropped and why, without the payload: what `on_drop` callbacks receive."""

    uid: int
    prompt_id: str
    task: str
    outcome: PutOutcome
    error: str | None
    samples: int
    tokens: int
    version: int


class _Flight(msgspec.Struct, kw_only=True):
    """A group in flight: what the ledger needs about it, and its task."""

    request_id: str
    samples: int
    tokens: int  # tokens it held when this attempt started
    started_at: float
    task: asyncio.Task[None] | None = None


class Producer:
    """Generates rollout groups with `engine` from `prompts`, scored by `reward_fn`.

    Options are `ProducerConfig` fields, given as `config=` or as keywords. `filter` is a
    `filters` name ("nonzero_std"), a callable returning True to keep a scored group, or None.
    `on_drop` is called with a `DropRecord` (no payload) for every failed, filtered or expired
    group, e.g. to log which prompts failed and why.
    """

    def __init__(
        self,
        engine: Engine,
        prompts: PromptSource | TaskMix,
        reward_fn: RewardFn,
        *,
        config: ProducerConfig | None = None,
        filter: str | filters.GroupFilter | None = None,
        on_drop: Callable[[DropRecord], None] | None = None,
        **options: Any,
    ) -> None:
        self.config = cfg = make_config(config, options)
        if not callable(reward_fn):
            raise ValueError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
        if cfg.pause_mode == "keep" and not engine.supports_keep_pause:
            raise ValueError(
                f"pause_mode='keep' but {type(engine).__name__} cannot pause requests in place: "
                "use pause_mode='abort'"
            )
        payload = engine.payload_bytes(cfg.sampling.max_new_tokens)
        cfg.check_fits(payload)
        self.engine = engine
        self.reward_fn = reward_fn
        self.filter = filters.resolve(filter)
        self.on_drop = on_drop
        self._group_bytes = cfg.group_bytes(payload)
        self.buffer = RolloutBuffer(
            max_groups=cfg.max_buffer_groups,
            max_bytes=cfg.max_buffer_bytes,
            reserve_bytes=self._group_bytes,
            max_staleness=cfg.max_staleness,
            order=cfg.order,
        )
        self.progress = ProduceProgress()
        self._reward_is_async = inspect.iscoroutinefunction(reward_fn) or (
            inspect.iscoroutinefunction(getattr(reward_fn, "__call__", None))  # noqa: B004
        )
        self._prompts = PromptStream(prompts)
        self._version = 0
        self._next_uid = 0
        self._inflight: dict[int, _Flight] = {}
        self._changed = Signal()
        self._pauses = 0
        self._pause_lock = asyncio.Lock()
        self._update_lock = asyncio.Lock()
        self._phase: Literal["new", "running", "stopped"] = "new"
        self._stopping = False
        self._fatal: str | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._scheduler: asyncio.Task[None] | None = None
        self._idle_since: float | None = None  # when the last group in flight landed
        self._executor: ThreadPoolExecutor | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Producer:
        if self._phase != "new":
            raise RuntimeError("a Producer runs once: build a new one and load() its checkpoint")
        self._phase = "running"
        if not self._reward_is_async and self.config.reward_in_thread:
            self._executor = ThreadPoolExecutor(
                self.config.reward_workers, thread_name_prefix="asyncroll-reward"
            )
        tg = asyncio.TaskGroup()
        await tg.__aenter__()
        self._tg = tg
        self._idle_since = time.monotonic()
        try:  # the engine stamps tokens with our version (0, or a checkpoint's), whatever it
            # served before (an engine can outlive a producer)
            await self._engine_call(
                self.engine.update_weights(None, version=self._version),
                self.config.update_timeout_s,
            )
            self._scheduler = tg.create_task(self._schedule(), name="asyncroll-scheduler")
        except BaseException:
            await self._shutdown()
            raise
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await self._shutdown()
        if self._fatal is not None and exc is None:
            raise ProducerError(self._fatal)

    async def _shutdown(self) -> None:
        """Stop admitting, abort what is in flight into resumable partials, wait for all tasks."""
        self._stopping = True
        self._changed.notify()
        try:
            await self._drain()
            self._count_idle()
        finally:
            for flight in self._inflight.values():
                if flight.task is not None:
                    flight.task.cancel()
            if self._scheduler is not None:
                self._scheduler.cancel()
            if self._tg is not None:
                await self._tg.__aexit__(None, None, None)
            # Finished tasks hold their exception, whose traceback holds our frames: let go.
            self._tg = self._scheduler = None
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None
            self._phase = "stopped"

    @property
    def version(self) -> int:
        """Policy version: bumped by every `update_weights`."""
        return self._version

    @property
    def running(self) -> bool:
        return self._phase == "running"

    @property
    def paused(self) -> bool:
        return self._pauses > 0

    # -- the trainer's side ----------------------------------------------------------------------

    async def produce_batch(
        self, n: int | None = None, *, timeout: float | None = None
    ) -> ProduceBatchResult:
        """Wait for `n` ready groups (default `batch_size`) and hand them out with the counters
        since the previous batch. Returns fewer only when the prompts are used up; raises
        `ProducerExhausted` when nothing is left, `ProducerError` if the producer stopped,
        `StalledError` if the batch could never fill, `TimeoutError` after `timeout` seconds
        (nothing is taken then)."""
        self._require_running()
        n = self._batch_n(n)
        start = time.monotonic()
        try:
            await self._changed.wait_until(
                lambda: (
                    self.buffer.num_ready >= n
                    or self._fatal is not None
                    or self._drained()
                    or self._stalled()
                ),
                timeout,
            )
        finally:
            self.progress.counters.wait_s += time.monotonic() - start
        if self._fatal is not None:
            raise ProducerError(self._fatal)
        ready = self.buffer.num_ready
        if ready < n and not self._drained():
            raise StalledError(self._stall_message(n))
        if ready == 0:
            raise ProducerExhausted("every prompt was produced and every ready group handed out")
        groups = self.buffer.take(min(n, ready))
        c = self.progress.counters
        c.consumed_groups += len(groups)
        for g in groups:
            c.consumed_samples += g.num_samples
            c.consumed_tokens += g.num_tokens
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
        expire what became too stale, resume. Returns the new version."""
        self._require_running()
        async with self._update_lock, self.pausing():
            version = self._version + 1
            await self._engine_call(
                self.engine.update_weights(weights, version=version), self.config.update_timeout_s
            )
            self._set_version(version)
        return self._version

    async def pause(self) -> None:
        """Stop starting groups. In "abort" mode abort in-flight requests and wait until they
        have landed (partial samples wait in the buffer to resume); in "keep" mode freeze them
        in the engine. Pauses nest; each needs a `resume`."""
        self._require_running()
        async with self._pause_lock:
            self._pauses += 1
            self._changed.notify()
            if self._pauses > 1:
                return
            if self.config.pause_mode == "keep":
                await self._engine_call(self.engine.pause_generation(), self.config.abort_timeout_s)
            else:
                await self._drain()

    async def resume(self) -> None:
        async with self._pause_lock:
            if self._pauses == 0:
                raise RuntimeError("resume() without a matching pause()")
            if self._pauses == 1 and self.config.pause_mode == "keep" and self.running:
                await self._engine_call(
                    self.engine.resume_generation(), self.config.abort_timeout_s
                )
            self._pauses -= 1
            self._changed.notify()

    @contextlib.asynccontextmanager
    async def pausing(self) -> AsyncIterator[None]:
        """`async with producer.pausing():` pause for the block, resume after it."""
        await self.pause()
        try:
            yield
        finally:
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
            + c.wasted_tokens_expired,
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
        while paused in "abort" mode (or use `save`, which arranges that)."""
        if self._inflight:
            raise RuntimeError(
                f"state_dict() with {len(self._inflight)} groups in flight: pause first "
                "(pause_mode='abort'), or use save()"
            )
        ready, resume = self.buffer.snapshot()
        return ProducerState(
            format=STATE_FORMAT,
            version=self._version,
            next_uid=self._next_uid,
            group_size=self.config.group_size,
            counters=self.progress.counters.copy(),
            latency_counts=self.progress.latency.counts.tolist(),
            cursor=self._prompts.state(),
            ready=ready,
            resume=resume,
        )

    def load_state_dict(self, state: ProducerState) -> None:
        """Continue the run of `state`; only before `async with`. All or nothing."""
        if self._phase != "new":
            raise RuntimeError("load_state_dict() must come before `async with producer`")
        if state.format != STATE_FORMAT:
            raise CheckpointError(f"checkpoint format {state.format}, expected {STATE_FORMAT}")
        if state.group_size != self.config.group_size:
            raise CheckpointError(
                f"checkpoint has group_size={state.group_size}, this producer "
                f"{self.config.group_size}: resume with the same group_size"
            )
        self._prompts.check(state.cursor)
        if len(state.latency_counts) != LatencyHistogram.BUCKETS:
            raise CheckpointError("checkpoint latency histogram has another bucket layout")
        self.buffer.restore(state.version, state.ready, state.resume)
        self._prompts.load(state.cursor)
        self.progress.restore(state.counters, state.latency_counts)
        self._version = state.version
        self._next_uid = state.next_uid

    async def save(self, path: str | os.PathLike[str]) -> None:
        """Write a checkpoint atomically. While running, pauses, aborts what is in flight into
        partial samples (kept in the checkpoint), writes, and resumes."""
        if self.running:
            async with self.pausing():
                await self._drain()
                data = dumps(self.state_dict())
        else:
            data = dumps(self.state_dict())
        await asyncio.to_thread(write_atomic, path, data)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Continue from a checkpoint file written by `save` (before `async with`)."""
        self.load_state_dict(loads(Path(path).read_bytes()))

    # -- scheduling ------------------------------------------------------------------------------

    async def _schedule(self) -> None:
        """Admit work while there is room: resumed groups first, then new prompts."""
        try:
            while True:
                await self._changed.wait_until(self._may_start)
                resumed = self.buffer.take_resume()
                if resumed is not None:
                    self._start(resumed, resumed=True)
                elif self.buffer.try_reserve():
                    await self._start_new()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: surface it rather than stall silently
            self._set_fatal(f"scheduler failed: {type(exc).__name__}: {exc}")

    async def _start_new(self) -> None:
        """Draw a prompt for the slot just reserved and start its group."""
        try:
            async with asyncio.timeout(self.config.prompt_timeout_s):
                prompt = await self._prompts.next()
        except TimeoutError:
            self.buffer.release()
            timeout = self.config.prompt_timeout_s
            self._set_fatal(f"prompt source gave nothing within prompt_timeout_s={timeout}")
            return
        except Exception as exc:
            self.buffer.release()
            self._set_fatal(f"prompt source raised {type(exc).__name__}: {exc}")
            return
        except BaseException:  # cancelled: the slot was never used
            self.buffer.release()
            raise
        if prompt is None:
            self.buffer.release()
            self._changed.notify()
            return
        if self._pauses or self._stopping:  # paused while drawing: start it after resume
            self.buffer.release()
            self._prompts.unread(prompt)
            return
        self._start(self._new_group(prompt), resumed=False)

    def _may_start(self) -> bool:
        if self._fatal is not None or self._pauses or self._stopping:
            return False
        if len(self._inflight) >= self.config.max_inflight_groups:
            return False
        if self.buffer.num_resume:
            return True
        return not self._prompts.exhausted and self._within_capacity() and self.buffer.can_reserve()

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

    def _idle(self) -> bool:
        """Nothing in flight, waiting to resume or about to start (each holds a slot)."""
        return not self.buffer.num_reserved and not self.buffer.num_resume

    def _drained(self) -> bool:
        """Nothing more can become ready: prompts used up and nothing pending."""
        return self._prompts.exhausted and self._idle()

    def _stalled(self) -> bool:
        """Nothing pending and nothing may start though prompts remain: no batch can fill
        until the trainer changes something (bumps the version, resumes)."""
        return self._idle() and not self._prompts.exhausted and not self._may_start()

    def _stall_message(self, n: int) -> str:
        cfg = self.config
        if self._pauses:
            return f"produce_batch({n}) while paused would wait forever: resume() first"
        return (
            f"produce_batch({n}) would wait forever: {self.buffer.num_ready} groups ready and the "
            f"staleness capacity at version {self._version} is used up "
            f"((max_staleness={cfg.max_staleness} + version + 1) x batch_size={cfg.batch_size}); "
            "call update_weights() after each batch, or raise max_staleness"
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
                f"(a group can take {self._group_bytes} B); raise them or ask for fewer groups"
            )
        return n

    def _new_group(self, prompt: Prompt) -> RolloutGroup:
        uid = self._next_uid
        self._next_uid += 1
        try:
            tokens = rollout.prompt_array(
                prompt.tokens, self.engine.vocab_size, self.engine.max_model_len
            )
            error = None
        except rollout.RolloutError as exc:
            tokens, error = EMPTY_INT32, f"bad prompt: {exc}"
        return RolloutGroup(
            uid=uid,
            prompt_id=prompt.prompt_id or f"{prompt.task}/uid{uid}",
            task=prompt.task,
            prompt_tokens=tokens,
            samples=rollout.fresh_samples(self.config.group_size),
            metadata=prompt.metadata,
            start_version=self._version,
            error=error,
        )

    def _start(self, group: RolloutGroup, *, resumed: bool) -> None:
        """Put `group` in flight (one synchronous step with its counters) and run its attempt."""
        flight = _Flight(
            request_id=f"{group.uid}-{group.attempts}",
            samples=group.num_samples,
            tokens=group.num_tokens,
            started_at=time.monotonic(),
        )
        self._inflight[group.uid] = flight
        self._count_idle()
        c = self.progress.counters
        if resumed:
            c.resumed_groups += 1
        else:
            c.started_groups += 1
            c.started_samples += group.num_samples
        if group.error is not None:  # a bad prompt: fails without reaching the engine
            self._land(
                self._finish(group, flight, group.samples, Status.FAILED, group.error), flight
            )
            return
        assert self._tg is not None
        flight.task = self._tg.create_task(
            self._run_group(group, flight), name=f"asyncroll-group-{group.uid}"
        )

    # -- one attempt -----------------------------------------------------------------------------

    async def _run_group(self, group: RolloutGroup, flight: _Flight) -> None:
        try:
            final = await self._attempt(group, flight)
        except asyncio.CancelledError:
            samples = rollout.interrupted(group.samples)
            self._land(self._finish(group, flight, samples, group_status(samples)), flight)
            raise
        except Exception as exc:  # a bug in asyncroll: fail the group, stop the producer
            message = f"internal error in group {group.uid}: {type(exc).__name__}: {exc}"
            self._set_fatal(message)
            final = self._finish(group, flight, group.samples, Status.FAILED, message)
        self._land(final, flight)

    async def _attempt(self, group: RolloutGroup, flight: _Flight) -> RolloutGroup:
        """Generate, check, score and filter one attempt; return the group in its final state."""
        cfg, engine = self.config, self.engine
        budget = rollout.token_budget(group, cfg.sampling, engine.max_model_len)
        request = rollout.build_request(group, flight.request_id, cfg.sampling, budget)
        finish = functools.partial(self._finish, group, flight)
        try:
            async with asyncio.timeout(cfg.generate_timeout_s):
                outputs = await engine.generate(request)
        except TimeoutError:
            await self._abort_request(flight.request_id)
            return finish(
                group.samples, Status.FAILED,
                f"engine gave no answer within generate_timeout_s={cfg.generate_timeout_s}",
            )  # fmt: skip
        except EngineDeadError as exc:
            self._set_fatal(f"engine died: {exc}")
            return finish(group.samples, Status.FAILED, f"engine died: {exc}")
        except Exception as exc:
            error = f"engine error: {type(exc).__name__}: {exc}"
            return finish(group.samples, Status.FAILED, error)
        try:
            samples = rollout.merge_outputs(
                group, request, outputs, vocab_size=engine.vocab_size, version=self._version
            )
        except (ValueError, TypeError) as exc:  # RolloutError, or arrays that do not fit
            return finish(group.samples, Status.FAILED, f"malformed engine output: {exc}")
        status = group_status(samples)
        if status is not Status.COMPLETED:
            return finish(samples, status)
        try:
            rewards = rollout.check_rewards(await self._score(group, samples), len(samples))
        except rollout.RolloutError as exc:
            return finish(samples, Status.FAILED, str(exc))
        except TimeoutError:
            error = f"reward function took longer than reward_timeout_s={cfg.reward_timeout_s}"
            return finish(samples, Status.FAILED, error)
        except Exception as exc:
            error = f"reward function raised {type(exc).__name__}: {exc}"
            return finish(samples, Status.FAILED, error)
        c = self.progress.counters
        c.reward_sum += math.fsum(rewards)
        c.reward_count += len(rewards)
        samples = rollout.with_rewards(samples, rewards)
        if self.filter is None:
            return finish(samples, Status.COMPLETED)
        scored = msgspec.structs.replace(group, samples=samples, status=Status.COMPLETED)
        try:
            keep = bool(self.filter(scored))
        except Exception as exc:
            error = f"filter raised {type(exc).__name__}: {exc}"
            return finish(samples, Status.FAILED, error)
        return finish(samples, Status.COMPLETED if keep else Status.FILTERED)

    async def _score(self, group: RolloutGroup, samples: tuple[RolloutState, ...]) -> Any:
        """Call the reward function on the completed group, within `reward_timeout_s`."""
        cfg = self.config
        scored = msgspec.structs.replace(group, samples=samples, status=Status.COMPLETED)
        pending: Any
        if self._reward_is_async:
            pending = self.reward_fn(scored)
        elif self._executor is not None:
            loop = asyncio.get_running_loop()
            pending = loop.run_in_executor(self._executor, self.reward_fn, scored)
        else:  # inline on the loop: it cannot be interrupted, only judged late
            start = time.monotonic()
            pending = self.reward_fn(scored)
            if not inspect.isawaitable(pending):
                if time.monotonic() - start > cfg.reward_timeout_s:
                    raise TimeoutError
                return pending
        async with asyncio.timeout(cfg.reward_timeout_s):
            result = await pending
            while inspect.isawaitable(result):  # a sync function that returned a coroutine
                result = await result
        return result

    def _finish(
        self,
        group: RolloutGroup,
        flight: _Flight,
        samples: tuple[RolloutState, ...],
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

    def _count_idle(self) -> None:
        """Add the idle time since the last group landed (if none is in flight) to `idle_s`."""
        now = time.monotonic()
        if self._idle_since is not None:
            self.progress.counters.idle_s += now - self._idle_since
        self._idle_since = None if self._inflight else now

    def _land(self, group: RolloutGroup, flight: _Flight) -> None:
        """Hand a finished attempt to the buffer and count it: one synchronous step."""
        del self._inflight[group.uid]
        self._count_idle()
        c = self.progress.counters
        tokens = group.num_tokens
        c.generated_tokens += tokens - flight.tokens
        outcome = self.buffer.put(group)
        match outcome:
            case PutOutcome.STORED_READY:
                c.completed_groups += 1
                c.completed_samples += group.num_samples
                self.progress.latency.record(group.latency_s)
            case PutOutcome.STORED_RESUME:
                c.aborted_groups += 1
                c.aborted_samples += sum(s.status is Status.ABORTED for s in group.samples)
            case PutOutcome.DROPPED_FAILED:
                c.failed_groups += 1
                c.failed_samples += group.num_samples
                c.wasted_tokens_failed += tokens
                self.progress.latency.record(group.latency_s)
            case PutOutcome.DROPPED_FILTERED:
                c.filtered_groups += 1
                c.filtered_samples += group.num_samples
                c.wasted_tokens_filtered += tokens
                self.progress.latency.record(group.latency_s)
            case PutOutcome.DROPPED_EXPIRED:
                self._count_expired(group)
        if outcome not in (PutOutcome.STORED_READY, PutOutcome.STORED_RESUME):
            self._report_drop(group, outcome)
        self._changed.notify()

    def _count_expired(self, group: RolloutGroup) -> None:
        """Count an expired group and queue its prompt again, so no prompt is silently lost."""
        c = self.progress.counters
        c.expired_groups += 1
        c.expired_samples += group.num_samples
        c.wasted_tokens_expired += group.num_tokens
        self._prompts.requeue(
            Prompt(
                tokens=group.prompt_tokens.tolist(),
                task=group.task,
                prompt_id=group.prompt_id,
                metadata={k: _detached(v) for k, v in group.metadata.items()},
            )
        )

    def _report_drop(self, group: RolloutGroup, outcome: PutOutcome) -> None:
        if self.on_drop is None:
            return
        record = DropRecord(
            uid=group.uid,
            prompt_id=group.prompt_id,
            task=group.task,
            outcome=outcome,
            error=group.error,
            samples=group.num_samples,
            tokens=group.num_tokens,
            version=self._version,
        )
        try:
            self.on_drop(record)
        except Exception as exc:  # the accounting is done; a broken callback stops the run
            self._set_fatal(f"on_drop callback raised {type(exc).__name__}: {exc}")

    def _set_version(self, version: int) -> None:
        self._version = version
        for group in self.buffer.set_version(version):
            self._count_expired(group)
            self._report_drop(group, PutOutcome.DROPPED_EXPIRED)
        self._changed.notify()

    # -- engine calls, pausing, errors -----------------------------------------------------------

    async def _engine_call(self, call: Awaitable[None], timeout_s: float) -> None:
        """Await an engine control call within a deadline; a dead engine stops the producer."""
        try:
            async with asyncio.timeout(timeout_s):
                await call
        except EngineDeadError as exc:
            self._set_fatal(f"engine died: {exc}")
            raise ProducerError(self._fatal) from None

    async def _abort_request(self, request_id: str) -> None:
        with contextlib.suppress(ProducerError, TimeoutError):
            await self._engine_call(self.engine.abort(request_id), self.config.abort_timeout_s)

    async def _drain(self) -> None:
        """Abort every in-flight request and wait until each group has landed (as a partial
        waiting to resume, or finished); cancel what does not land within `abort_timeout_s`."""
        if not self._inflight:
            return
        for flight in list(self._inflight.values()):
            await self._abort_request(flight.request_id)
        timeout = self.config.abort_timeout_s
        try:
            await self._changed.wait_until(lambda: not self._inflight, timeout)
        except TimeoutError:
            for flight in self._inflight.values():
                if flight.task is not None:
                    flight.task.cancel()
            await self._changed.wait_until(lambda: not self._inflight, timeout)

    def _set_fatal(self, message: str) -> None:
        if self._fatal is None:
            self._fatal = message
        self._changed.notify()

    def _require_running(self) -> None:
        if self._phase != "running":
            raise RuntimeError(
                "the producer is not running: use `async with producer:`"
                if self._phase == "new"
                else "the producer has stopped"
            )


def _detached(value: Any) -> Any:
    """A copy of an array that may be a view into a decoded group's bytes (so keeping it does
    not keep the whole group alive); anything else as is."""
    return np.array(value) if isinstance(value, np.ndarray) else value
