"""The admission gate and what closes it: holds (a user's pause, an update, a save), the drain
that lands what is in flight, the freeze of a "keep"-mode pause, and aborts.

The gate is OPEN, DRAINING or CLOSED (`lifecycle.Gate`); holders nest, the first closes it and
the last opens it. Closing drains in "abort" mode (requests are aborted and land as partial
groups that resume later; groups being scored finish) or freezes requests in the engine in
"keep" mode (their generate deadlines stop with them: `engine_call.Freezes`). Whatever undoes a
close (opening the gate, resuming the engine) is shielded from the caller's anyio scopes, and
every wait has a deadline of its own.

Guests (an evaluator's requests, `guest_generate`) use the same engine under the same gate but
are none of the run's: they start only while the gate is open, a drain aborts them with the
groups (they end "abort" and their caller runs them again), a "keep"-mode freeze stops their
deadlines too, and nothing of the run (counters, versions, the buffer) hears of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence

import anyio

from asyncroll._core import engine_call
from asyncroll._core.attempt import Flight
from asyncroll._core.core import Core, ProducerError
from asyncroll._core.engine_call import Freezes
from asyncroll._core.lifecycle import Gate, Hold, Phase, Stage, move
from asyncroll.engines.base import EngineDeadError, GenerateRequest, SampleOutput
from asyncroll.episode import Parking

log = logging.getLogger("asyncroll.producer")


class Control:
    """The gate, its holders, and the drain (see the module docstring)."""

    def __init__(self, core: Core, freezes: Freezes, stuck: Callable[[], str | None]) -> None:
        self.core = core
        self.freezes = freezes
        self.stuck = stuck  # why no reward can finish (every worker hung), or None
        self.gate = Gate.OPEN
        self.holds: Counter[Hold] = Counter()
        self.guests: set[str] = set()  # request ids of guest requests in the engine
        self.updating = 0  # `steady` blocks running (adapter updates without a pause)
        self._lock = asyncio.Lock()

    @property
    def keep(self) -> bool:
        return self.core.config.pause_mode == "keep"

    def parking(self) -> Parking:
        """Where episodes wait while the gate is closed (or the producer stops)."""
        core = self.core
        return Parking(
            lambda: self.gate is Gate.OPEN and core.phase is Phase.RUNNING,
            core.changed,
            self.freezes,
        )

    @contextlib.asynccontextmanager
    async def holding(self, hold: Hold) -> AsyncIterator[None]:
        """Hold the gate for the block. What undoes the block (releasing the gate) is shielded
        from the caller's anyio scopes: a cancelled one cancels every await in it, and the
        engine would keep a paused state. Each such call has a deadline of its own."""
        await self.acquire(hold)
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await self.release(hold)

    @contextlib.asynccontextmanager
    async def steady(self) -> AsyncIterator[None]:
        """Keep the gate as it is for the block: no pause or resume reaches the engine while
        it runs. An adapter update needs no pause (requests keep their adapter), but the
        engine may freeze its replicas while they load it (`VLLMServerEngine`), and a pause
        sent meanwhile would wait inside its own `abort_timeout_s` for the whole load, then
        fail, and so would the resume that undoes it. A pause asked for during the block
        waits for it here instead (the block has the update's deadline).

        `updating` says the block runs: the gate stays open through it, so this is how a
        waiting `produce_batch` knows an update is under way (it frees the staleness
        capacity once it lands), as the closed gate of a full-weight update tells it.

        The deadlines of the calls in the engine (and the episodes') are stopped for the
        block, as a "keep"-mode pause stops them: an engine may freeze its requests while it
        loads the adapter without the producer being told, and the load is the update's time
        (it has `update_timeout_s`), not theirs. Unless a pause froze them already: its own
        end restarts them, and the lock keeps that end out of this block."""
        self.updating += 1
        self.core.changed.notify()
        try:
            async with self._lock:
                froze = not self.freezes.frozen
                if froze:
                    self.freezes.freeze()
                try:
                    yield
                finally:
                    if froze:
                        self.freezes.thaw()
        finally:
            self.updating -= 1
            self.core.changed.notify()

    async def acquire(self, hold: Hold) -> None:
        """Add a holder of the gate; the first closes it (drain, or freeze in "keep" mode).
        A close that fails is undone before the error is raised, in the engine too."""
        core = self.core
        async with self._lock:
            self.holds[hold] += 1
            core.changed.notify()
            if self.holds.total() > 1:
                return
            self.gate = move(self.gate, Gate.DRAINING)
            try:
                if self.keep:
                    self.freezes.freeze()  # thawed by `unfreeze`, whatever happens
                    await core.control_call(
                        core.engine.pause_generation(), core.config.abort_timeout_s, "pause"
                    )
                else:
                    await self.drain()
            except BaseException:
                self.holds[hold] -= 1
                self.holds = +self.holds
                self.gate = move(self.gate, Gate.OPEN)
                core.changed.notify()
                if self.keep:  # it may have paused before it failed
                    with anyio.CancelScope(shield=True):  # see `holding`
                        await self.unfreeze("after a failed pause")
                raise
            self.gate = move(self.gate, Gate.CLOSED)

    async def release(self, hold: Hold) -> None:
        """Remove a holder; the last opens the gate (resuming the engine in "keep" mode). A
        resume that fails stops the producer rather than raising: the hold is gone either
        way, and what it closed for (an update, a save) is done, so the caller must not take
        its operation for failed and repeat it."""
        async with self._lock:
            if not self.holds[hold]:
                raise RuntimeError("resume() without a matching pause()")
            self.holds[hold] -= 1
            self.holds = +self.holds
            if self.holds:
                self.core.changed.notify()
                return
            try:
                if self.keep and self.core.running:
                    await self.unfreeze("at the end of a pause")
            finally:
                self.gate = move(self.gate, Gate.OPEN)
                self.core.changed.notify()

    async def unfreeze(self, when: str) -> None:
        """Resume the engine ("keep" mode): at the end of a pause, and where no `resume` will,
        after a pause that failed (perhaps once the engine had paused: a late answer) and when
        the producer stops while paused (an engine outlives its producer: a new one on it is
        how a run goes on). Resuming one that is not paused does nothing. If it fails, the
        engine may stay frozen, every request waiting for its deadline: the producer stops."""
        core = self.core
        try:
            await core.control_call(
                core.engine.resume_generation(), core.config.abort_timeout_s, "resume"
            )
        except Exception as exc:
            core.fail(f"the engine could not be resumed ({when}): {type(exc).__name__}: {exc}")
        finally:  # requests frozen in an engine that did not resume fail at their deadline
            self.freezes.thaw()

    async def guest_generate(
        self, request: GenerateRequest, timeout_s: float
    ) -> Sequence[SampleOutput]:
        """Generate `request` for a guest of the run (see the module docstring): once the gate
        is open, within `timeout_s` of engine time (`engine_call.generate`: every failure an
        `EngineCallError`). `RuntimeError` once the producer has stopped. A gate that stays
        closed is waited for without a deadline here: the guest's caller bounds its own wait."""
        core = self.core
        await core.changed.wait_until(lambda: self.gate is Gate.OPEN or not core.running)
        if not core.running:
            raise RuntimeError("the producer has stopped: nothing more runs on its engine")
        self.guests.add(request.request_id)  # no await since the gate was seen open
        try:
            return await engine_call.generate(
                core.engine,
                request,
                timeout_s=timeout_s,
                abort_timeout_s=core.config.abort_timeout_s,
                freezes=self.freezes,
            )
        finally:
            self.guests.discard(request.request_id)
            core.changed.notify()

    async def drain(self) -> None:
        """Abort every request in flight and wait until each group has landed: as a partial
        waiting to resume, or finished. Groups being scored finish (their reward has its own
        deadline); groups whose engine ignores the abort for `abort_timeout_s` are cancelled."""
        core = self.core
        if not core.inflight and not self.guests:
            return
        stopping = core.phase is not Phase.RUNNING
        ids: list[str] = list(self.guests)
        for flight in core.inflight.values():
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
        await self._guests_gone()
        generating = (Stage.STARTING, Stage.CANCELLED, Stage.GENERATING, Stage.ABORTING)

        def parked(f: Flight) -> bool:  # episodes with nothing in the engine stay in flight
            return (
                not stopping
                and f.episodes is not None
                and f.stage is Stage.GENERATING
                and f.episodes.quiet
            )

        cfg = core.config
        await self._land_within(
            lambda f: f.stage in generating and not parked(f), cfg.abort_timeout_s, "generating"
        )
        scoring_s = cfg.reward_timeout_s + cfg.abort_timeout_s
        await self._land_within(
            lambda f: not parked(f), scoring_s, "being scored", futile=self.stuck
        )

    async def _guests_gone(self) -> None:
        """Wait (within `abort_timeout_s`) for the aborted guest requests to end. One that
        ignores its abort is its caller's to end (its own deadline); the update that follows
        stamps the tokens it samples later with the new version, and the guest tells so."""
        core = self.core
        try:
            await core.changed.wait_until(lambda: not self.guests, core.config.abort_timeout_s)
        except TimeoutError:
            log.warning(
                "%d guest request(s) ignored their abort for abort_timeout_s=%s; going on",
                len(self.guests), core.config.abort_timeout_s,
            )  # fmt: skip

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
        core = self.core

        def settled() -> bool:
            return not any(which(f) for f in core.inflight.values())

        with contextlib.suppress(TimeoutError):
            await core.changed.wait_until(lambda: settled() or futile() is not None, timeout)
        if not settled():
            for flight in core.inflight.values():
                if which(flight):
                    flight.cancel()
        try:
            await core.changed.wait_until(settled, core.config.abort_timeout_s)
        except TimeoutError:
            core.fail(f"groups {what} ignored both abort and cancellation")
            raise ProducerError(core.error) from None

    async def _abort(self, request_ids: list[str]) -> None:
        """Abort requests concurrently, all within one `abort_timeout_s`."""
        if not request_ids:
            return
        core = self.core

        async def abort(request_id: str) -> None:
            try:
                await core.engine.abort(request_id)
            except EngineDeadError as exc:
                core.fail(f"engine died: {exc}")
            except Exception as exc:  # the wait that follows still bounds the request
                log.debug("abort of %s raised %s: %s", request_id, type(exc).__name__, str(exc))

        with anyio.move_on_after(core.config.abort_timeout_s):
            async with anyio.create_task_group() as tg:
                for request_id in request_ids:
                    tg.start_soon(abort, request_id)
