"""Admission: which group starts next, and why none can (a stall).

The scheduler admits work while there is room (`Admission.next_step`, the one admission rule):
below `max_inflight_groups`, resumable partial groups first (oldest first), then new prompts
within the staleness capacity and the buffer's bounds. One prompt is drawn ahead and staged,
checked once, with the bytes its group can reach (so the end of the prompts is known before the
next batch is awaited); it starts once the capacity and that reservation allow. A bad prompt
fails without reaching the engine and reserves nothing.
"""

from __future__ import annotations

import asyncio
import enum
import math
from typing import Protocol

import anyio
import msgspec

from asyncroll import codec
from asyncroll._core import rollout
from asyncroll._core.control import Control
from asyncroll._core.core import Core
from asyncroll._core.lifecycle import Gate, Hold, Phase
from asyncroll.outcomes import NOT_ABSORBED
from asyncroll.types import EMPTY_INT32, Int32Array, Prompt, RolloutGroup


class Start(Protocol):
    """What starts an admitted group (`Flights.start`)."""

    def __call__(self, group: RolloutGroup, reserved: int, *, resumed: bool = False) -> None: ...


class _Scheduler(enum.Enum):
    """What the scheduler is doing: a produce_batch must not call a stall while it draws."""

    WAITING = "waiting"
    DRAWING = "drawing"  # awaiting the prompt source


class _Step(enum.Enum):
    """What the scheduler may do next."""

    RESUME = "resume"  # restart the oldest partial group
    START = "start"  # start the staged prompt's group
    DRAW = "draw"  # draw the next prompt


class Staged(msgspec.Struct, frozen=True):
    """A drawn prompt whose group waits for room, checked once: its token ids (empty when it
    is bad), why it is bad, and the bytes its group can grow to (0 for a bad prompt, which
    never reaches the engine)."""

    prompt: Prompt
    tokens: Int32Array
    error: str | None
    reserve: int


class Admission:
    """The scheduler and the admission rule (see the module docstring)."""

    def __init__(self, core: Core, control: Control, start: Start) -> None:
        self.core = core
        self.control = control
        self.start = start
        self.scheduler = _Scheduler.WAITING
        self.draw_scope: anyio.CancelScope | None = None
        self.staged: Staged | None = None
        self.next_uid = 0
        # The staleness schedule's anchor: the groups the trainer is expected to have taken by
        # version `anchor_version` (0 at 0; a checkpoint's on load), `batch_size` more a version
        # after it. Anchored, not `version x batch_size`: a run resumed with another batch_size
        # counted its past versions at the old size.
        self.anchor_groups = 0
        self.anchor_version = 0

    async def schedule(self) -> None:
        """Admit work while there is room: resumed groups first, then new prompts. Returns
        once the producer stops (ending normally, so no cancellation traceback keeps a
        reference to the producer alive)."""
        core = self.core
        step: _Step | None = None

        def decided() -> bool:  # the step, decided once per wake-up: the rule is not cheap
            nonlocal step
            step = self.next_step()
            return step is not None or core.phase is not Phase.RUNNING

        try:
            while True:
                # The predicate runs in this task right before `wait_until` returns, so `step`
                # is still what the rule says when it is acted on.
                await core.changed.wait_until(decided)
                match step:
                    case _Step.RESUME:
                        taken = core.buffer.take_resume()
                        if taken is not None:
                            self.start(*taken, resumed=True)
                    case _Step.START:
                        staged = self.staged
                        if staged is not None and core.buffer.try_reserve(staged.reserve):
                            self.staged = None
                            self.start(self._new_group(staged), staged.reserve)
                    case _Step.DRAW:
                        await self._draw()
                    case None:
                        return
        except Exception as exc:  # a bug: surface it rather than stall silently
            core.fail(f"scheduler failed: {type(exc).__name__}: {exc}")

    def next_step(self) -> _Step | None:
        """What the scheduler may do now, or None: the one admission rule."""
        core = self.core
        if not self._admitting() or len(core.inflight) >= core.config.max_inflight_groups:
            return None
        buffer = core.buffer
        if buffer.num_resume:
            return _Step.RESUME if buffer.can_resume() else None
        if self.staged is None:  # drawing starts nothing, and tells when the prompts end
            return None if core.prompts.exhausted or not buffer.can_reserve(0) else _Step.DRAW
        if not self.within_capacity():
            return None
        return _Step.START if buffer.can_reserve(self.staged.reserve) else None

    def _admitting(self) -> bool:
        core = self.core
        return core.phase is Phase.RUNNING and self.control.gate is Gate.OPEN and core.error is None

    async def _draw(self) -> None:
        """Draw the next prompt and stage it; a bad one fails at once instead."""
        core = self.core
        self.scheduler = _Scheduler.DRAWING
        try:
            if core.prompts.may_wait:
                prompt = await self._draw_within_deadline()
            else:  # drawing from an iterator cannot wait, and no deadline could cut it short
                prompt = await core.prompts.next()
        except NOT_ABSORBED:
            raise
        except BaseException as exc:  # not only an Exception: anything else would kill the
            # scheduler without a word, and every produce_batch would wait forever
            core.fail(f"prompt source raised {type(exc).__name__}: {exc}")
            return
        finally:
            self.scheduler = _Scheduler.WAITING
            self.draw_scope = None
            core.changed.notify()
        if prompt is None:
            return
        staged = self._stage(prompt)
        # A bad prompt needs no capacity, no bytes and no engine, only a slot for an instant
        # (this draw was decided with one free), so it does not wait: a staged prompt goes back
        # into the stream for a checkpoint, and a bad one may not encode or decode there.
        if staged.error is not None and core.buffer.try_reserve(0):
            self.start(self._new_group(staged), 0)
            # It landed without awaiting, and drawing from an iterator does not await: yield,
            # or a run of bad prompts would keep everything else (the trainer) from running.
            await asyncio.sleep(0)
        else:
            self.staged = staged

    async def _draw_within_deadline(self) -> Prompt | None:
        """The next prompt from a source that may wait, within `prompt_timeout_s`; None when
        the source is used up, when a stop cancelled the draw (the cursor still counts the
        prompt as not drawn), or when the deadline passed (the producer fails)."""
        core = self.core
        with anyio.move_on_after(core.config.prompt_timeout_s) as scope:
            self.draw_scope = scope  # a stop cancels the draw
            return await core.prompts.next()
        if core.phase is Phase.RUNNING:
            timeout = core.config.prompt_timeout_s
            core.fail(f"prompt source gave nothing within prompt_timeout_s={timeout}")
        return None

    def cancel_draw(self) -> None:
        if self.draw_scope is not None:
            self.draw_scope.cancel()

    def _stage(self, prompt: Prompt) -> Staged:
        """Check `prompt` once: bad ids, no room in the model, names or metadata of types a
        group cannot hold, or metadata that cannot be stored make a bad prompt, whose group
        fails without reaching the engine."""
        core = self.core
        try:
            rollout.check_prompt_fields(prompt)
            tokens = rollout.prompt_array(
                prompt.tokens, core.engine.vocab_size, core.engine.max_model_len
            )
            metadata = len(codec.encode_value(prompt.metadata))
        except rollout.RolloutError as exc:
            return Staged(prompt, EMPTY_INT32, f"bad prompt: {exc}", 0)
        except codec.CodecError as exc:
            error = f"bad prompt: its metadata cannot be stored: {exc}"
            return Staged(prompt, EMPTY_INT32, error, 0)
        reserve = core.config.group_bytes(
            core.payload, len(tokens), metadata, episodes=core.episodes
        )
        return Staged(prompt, tokens, None, reserve)

    def unstage(self) -> None:
        """Put a staged prompt back at the front of the stream (for a checkpoint, or on stop),
        with the token array it was checked into: what a source gave as ids (a `range`, an
        array type of its own) need not be something a checkpoint can store."""
        if self.staged is not None:
            staged, self.staged = self.staged, None
            prompt = staged.prompt
            if staged.error is None:
                prompt = msgspec.structs.replace(prompt, tokens=staged.tokens)
            self.core.prompts.unread(prompt)
            self.core.changed.notify()

    def reservation(self, group: RolloutGroup) -> int:
        """The bytes a group reserves while in flight (used for restored partial groups)."""
        core = self.core
        metadata = len(codec.encode_value(group.metadata))
        return core.config.group_bytes(
            core.payload, len(group.prompt_tokens), metadata, episodes=core.episodes
        )

    def scheduled(self) -> int | None:
        """The groups the trainer is expected to have taken by the current version, at
        `batch_size` a version since the anchor (None without a `batch_size`)."""
        batch_size = self.core.config.batch_size
        if batch_size is None:
            return None
        return self.anchor_groups + (self.core.version - self.anchor_version) * batch_size

    def anchor(self, groups: int, version: int) -> None:
        """Restart the schedule at `groups` taken by `version` (a checkpoint's)."""
        self.anchor_groups, self.anchor_version = groups, version

    def capacity(self) -> int | None:
        """How many groups may be accepted or running in all (None: no limit). AReaL's rule,
        accepted + running <= (max_staleness + version + 1) x batch_size, with the groups
        expected taken by this version counted from the anchor (`scheduled`) instead of as
        version x batch_size: nothing starts that would be too stale by the time the trainer
        can take it."""
        cfg = self.core.config
        scheduled = self.scheduled()
        if cfg.max_staleness is None or cfg.batch_size is None or scheduled is None:
            return None
        extra = math.ceil((cfg.oversample - 1.0) * cfg.batch_size)
        return scheduled + (cfg.max_staleness + 1) * cfg.batch_size + extra

    def within_capacity(self) -> bool:
        """Whether one more group fits in the staleness capacity (`capacity`)."""
        capacity = self.capacity()
        if capacity is None:
            return True
        core = self.core
        accepted = core.progress.counters.consumed_groups + core.buffer.num_ready
        running = core.buffer.num_reserved + core.buffer.num_resume  # in flight hold reservations
        return accepted + running < capacity

    def drained(self) -> bool:
        """Nothing more can become ready: prompts used up and nothing pending."""
        core = self.core
        return (
            core.prompts.exhausted
            and self.staged is None
            and self.scheduler is _Scheduler.WAITING
            and not core.inflight
            and not core.buffer.num_resume
        )

    def stall(self) -> str | None:
        """Why no more groups can become ready until the caller acts, or None while they can.
        Only a user's pause stalls; an update or a save in progress ends by itself (an adapter
        update with the gate open too), and so does the gate's opening (in "keep" mode the
        last hold is gone while the engine resumes)."""
        core, holds = self.core, self.control.holds
        if holds[Hold.USER]:
            return "produce_batch while paused would wait forever: resume() first"
        if (
            self.control.gate is not Gate.OPEN  # a hold, or the gate still opening
            or self.control.updating
            or core.inflight
            or self.scheduler is _Scheduler.DRAWING
            or self.drained()
            or not core.running
        ):
            return None
        if len(core.inflight) < core.config.max_inflight_groups and self.next_step() is not None:
            return None
        return self._blocked_by()

    def _blocked_by(self) -> str:
        core = self.core
        cfg, b = core.config, core.buffer
        held = f"{b.num_ready} groups ready, {b.num_resume} waiting to resume"
        if b.num_resume or self.within_capacity():
            return (
                f"produce_batch would wait forever: {held} use up the buffer "
                f"(max_buffer_groups={cfg.max_buffer_groups}, max_buffer_bytes="
                f"{cfg.max_buffer_bytes}, holding {b.held_bytes} B; the next group needs "
                f"{self.staged.reserve if self.staged else core.group_bytes} B): raise "
                "max_buffer_bytes / max_buffer_groups, or take batches that fit"
            )
        return (
            f"produce_batch would wait forever: {held} and the staleness capacity at version "
            f"{core.version} is used up ({self.capacity()} groups accepted or running: the "
            f"{self.scheduled()} the trainer is expected to have taken by now, at batch_size="
            f"{cfg.batch_size} a version, + (max_staleness={cfg.max_staleness} + 1) x "
            "batch_size); call update_weights() after each batch, or raise max_staleness"
        )

    def batch_n(self, n: int | None) -> int:
        """The number of groups `produce_batch(n)` waits for, or `ValueError` if it never could."""
        core = self.core
        cfg = core.config
        n = n if n is not None else cfg.batch_size
        if n is None or n < 1:
            raise ValueError(f"produce_batch(n={n}): give n >= 1 or set batch_size")
        if n > cfg.max_buffer_groups or n * core.group_bytes > cfg.max_buffer_bytes:
            raise ValueError(
                f"produce_batch({n}) can never fill: the buffer holds max_buffer_groups="
                f"{cfg.max_buffer_groups} and max_buffer_bytes={cfg.max_buffer_bytes} "
                f"(a group can take {core.group_bytes} B before its prompt); raise them or ask "
                "for fewer groups"
            )
        return n

    def _new_group(self, staged: Staged) -> RolloutGroup:
        uid, prompt = self.next_uid, staged.prompt
        self.next_uid += 1
        task = str(prompt.task)  # a bad prompt's may be anything: its group's is a str
        return RolloutGroup(
            uid=uid,
            prompt_id=str(prompt.prompt_id) if prompt.prompt_id else f"{task}/uid{uid}",
            task=task,
            prompt_tokens=staged.tokens,
            samples=rollout.fresh_samples(self.core.config.group_size),
            metadata=prompt.metadata if staged.error is None else {},
            start_version=self.core.version,
            error=staged.error,
        )
