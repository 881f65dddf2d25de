"""What every part of the producer shares: its configuration, engine, buffer, counters, prompt
stream, the groups in flight, its phase and version, its change signal and its one error path.

The parts (`admission`, `flights`, `control`, `checkpoint`) each own one job and read or change
this state; `Producer` builds one `Core` and wires the parts to it. Nothing here awaits except
`control_call`, so a state change made through it is one synchronous step with its counters.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable

import anyio

from asyncroll._core.attempt import Flight
from asyncroll._core.lifecycle import Phase
from asyncroll._core.progress import ProduceProgress
from asyncroll._core.wakeup import Signal
from asyncroll.buffer import RolloutBuffer
from asyncroll.config import ProducerConfig
from asyncroll.engines.base import Engine, EngineDeadError
from asyncroll.prompts import PromptStream

log = logging.getLogger("asyncroll.producer")


class ProducerError(RuntimeError):
    """The producer stopped: dead engine, failing prompt source, hung reward workers, too many
    dead groups in a row, or an internal error."""


class Core:
    """The producer's shared state (see the module docstring)."""

    def __init__(
        self,
        config: ProducerConfig,
        engine: Engine,
        buffer: RolloutBuffer,
        prompts: PromptStream,
        *,
        payload: int,
        group_bytes: int,
        episodes: bool,
    ) -> None:
        self.config = config
        self.engine = engine
        self.buffer = buffer
        self.prompts = prompts
        self.progress = ProduceProgress()
        self.payload = payload  # bytes of engine payload per sample (routed experts)
        self.group_bytes = group_bytes  # what a group can take before its prompt
        self.episodes = episodes  # groups are multi-turn episodes (a rollout function)
        self.changed = Signal()  # notified at every state change; waiters re-check
        self.inflight: dict[int, Flight] = {}
        self.phase = Phase.NEW
        self.version = 0
        self.error: str | None = None

    @property
    def running(self) -> bool:
        return self.phase is Phase.RUNNING

    def current_version(self) -> int:
        return self.version

    def fail(self, message: str) -> None:
        """Record the producer's failure (the first one wins) and wake every waiter: the one
        error path of everything no group can absorb."""
        if self.error is None:
            self.error = message
            log.error("producer stopped: %s", message)
        self.changed.notify()

    async def control_call(self, call: Awaitable[None], timeout_s: float, what: str) -> None:
        """Await an engine control call within a deadline; a dead engine stops the producer."""
        with anyio.move_on_after(timeout_s) as scope:
            try:
                await call
            except EngineDeadError as exc:
                self.fail(f"engine died: {exc}")
                raise ProducerError(self.error) from None
        if scope.cancelled_caught:
            raise TimeoutError(f"the engine's {what} did not finish within {timeout_s} s")
