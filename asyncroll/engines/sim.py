"""`SimEngine`: a seeded *simulation* of an inference engine. It generates no language.

It exists to test the producer's logic (failures, hangs, malformed output, aborts, pauses,
memory) and to measure the producer's own overhead without a model. Tokens are random ids,
logprobs random negatives; latency is simulated with timers. Never present its output as
generation: use `VLLMEngine` for that.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np

from asyncroll.engines.base import (
    EngineDeadError,
    GenerateRequest,
    SampleOutput,
    SampleRequest,
    Weights,
)

_POOL = 1 << 20  # random tokens/logprobs drawn once and sliced, so zero latency costs ~nothing


class SimEngineError(RuntimeError):
    """A failure the simulation injected on purpose (`fail_rate`)."""


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What the simulation does. Rates are per `generate` call; lengths are per sample."""

    vocab_size: int = 32000
    eos_token_id: int = 1
    lengths: Literal["max", "uniform"] = "max"  # "uniform": in [min_new_tokens, max_new_tokens]
    min_new_tokens: int = 1
    first_token_latency_s: float = 0.0
    per_token_latency_s: float = 0.0
    update_latency_s: float = 0.0
    fail_rate: float = 0.0  # generate raises SimEngineError
    hang_rate: float = 0.0  # generate never returns and ignores abort
    malformed_rate: float = 0.0  # generate returns inconsistent arrays or impossible values
    payload_bytes_per_sample: int = 0  # a routed-experts-like uint8 array on every sample
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("fail_rate", "hang_rate", "malformed_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SimConfig.{name}={getattr(self, name)}: must be in [0, 1]")
        if self.fail_rate + self.hang_rate + self.malformed_rate > 1.0:
            raise ValueError("SimConfig: fail_rate + hang_rate + malformed_rate must be <= 1")
        if self.vocab_size < 2 or not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(
                f"SimConfig: vocab_size={self.vocab_size} must be >= 2 and eos_token_id="
                f"{self.eos_token_id} inside it"
            )
        for name in ("first_token_latency_s", "per_token_latency_s", "update_latency_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"SimConfig.{name}: must be >= 0")
        if self.min_new_tokens < 1 or self.payload_bytes_per_sample < 0:
            raise ValueError("SimConfig: min_new_tokens must be >= 1, payload bytes >= 0")


class _Live:
    """A running simulated request. `wake` is set by an abort or a pause, either of which
    ends the current stretch of simulated generation."""

    __slots__ = ("aborted", "wake")

    def __init__(self) -> None:
        self.aborted = False
        self.wake = asyncio.Event()


class SimEngine:
    """Simulated engine implementing the `Engine` protocol (see the module docstring)."""

    def __init__(self, config: SimConfig | None = None, **overrides: object) -> None:
        base = config or SimConfig()
        self.config = msgspec.structs.replace(base, **overrides) if overrides else base
        cfg = self.config
        self._rng = np.random.default_rng(cfg.seed)
        self._token_pool = self._rng.integers(2, cfg.vocab_size, _POOL, dtype=np.int32)
        self._logprob_pool = -self._rng.exponential(2.0, _POOL).astype(np.float32) - 1e-3
        self._version = 0
        self._live: dict[str, _Live] = {}
        self._running = asyncio.Event()  # cleared while paused in place
        self._running.set()
        self._closed = False
        self.calls = 0  # generate calls, for tests and benchmarks

    # -- Engine protocol -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_model_len(self) -> int | None:
        return None

    @property
    def supports_keep_pause(self) -> bool:
        return True

    @property
    def version(self) -> int:
        return self._version

    def payload_bytes(self, max_new_tokens: int) -> int:
        return self.config.payload_bytes_per_sample

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        if self._closed:
            raise EngineDeadError("SimEngine is closed")
        if request.request_id in self._live:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.calls += 1
        cfg = self.config
        draw = self._rng.random()
        if draw < cfg.hang_rate:
            await asyncio.Event().wait()  # never set: only the caller's deadline ends this
        if draw < cfg.hang_rate + cfg.fail_rate:
            raise SimEngineError(f"simulated failure of request {request.request_id}")
        malformed = draw < cfg.hang_rate + cfg.fail_rate + cfg.malformed_rate
        targets = [self._target_length(s) for s in request.samples]
        live = _Live()
        self._live[request.request_id] = live
        try:
            segments = await self._run(live, max(targets, default=0))
        finally:
            del self._live[request.request_id]
        if self._closed:
            raise EngineDeadError("SimEngine was closed during the request")
        width = -(-cfg.payload_bytes_per_sample // request.sampling.max_new_tokens)
        outputs = [
            self._output(target, s.max_new_tokens, segments, width)
            for target, s in zip(targets, request.samples, strict=True)
        ]
        return self._corrupt(outputs) if malformed else outputs

    async def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live.aborted = True
            live.wake.set()

    async def pause_generation(self) -> None:
        self._running.clear()
        for live in self._live.values():
            live.wake.set()

    async def resume_generation(self) -> None:
        self._running.set()
        for live in self._live.values():
            live.wake.set()

    async def update_weights(self, weights: Weights | None, *, version: int) -> None:
        if self._closed:
            raise EngineDeadError("SimEngine is closed")
        if weights is not None:
            for _name, _tensor in weights:
                pass
        if self.config.update_latency_s:
            await asyncio.sleep(self.config.update_latency_s)
        self._version = version

    async def close(self) -> None:
        """Stop serving: running and later requests raise `EngineDeadError` (a dead engine)."""
        self._closed = True
        for live in self._live.values():
            live.aborted = True
            live.wake.set()

    async def __aenter__(self) -> SimEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- simulation ------------------------------------------------------------------------------

    def _target_length(self, sample: SampleRequest) -> int:
        cfg = self.config
        if cfg.lengths == "max":
            return sample.max_new_tokens
        low = min(cfg.min_new_tokens, sample.max_new_tokens)
        return int(self._rng.integers(low, sample.max_new_tokens + 1))

    async def _run(self, live: _Live, longest: int) -> list[tuple[int, int]]:
        """Advance simulated time until the longest sample is done or the request is aborted.

        Returns segments `(tokens generated by then, version)`: time only runs while the engine
        is not paused, and each stretch of running time is sampled under one weight version.
        """
        cfg = self.config
        if cfg.per_token_latency_s == 0 and cfg.first_token_latency_s == 0:
            return [(longest, self._version)]
        duration = cfg.first_token_latency_s + longest * cfg.per_token_latency_s
        active = 0.0
        segments: list[tuple[int, int]] = []
        while active < duration and not live.aborted:
            live.wake.clear()
            if not self._running.is_set():
                await live.wake.wait()  # set again by resume_generation or abort
                continue
            start, version = time.monotonic(), self._version
            try:
                async with asyncio.timeout(duration - active):
                    await live.wake.wait()
            except TimeoutError:
                pass
            active += time.monotonic() - start
            segments.append((self._tokens_at(active, longest), version))
        return segments

    def _tokens_at(self, active_s: float, longest: int) -> int:
        cfg = self.config
        if cfg.per_token_latency_s == 0:
            return longest if active_s >= cfg.first_token_latency_s else 0
        done = (active_s - cfg.first_token_latency_s) / cfg.per_token_latency_s
        return max(0, min(longest, int(done)))

    def _output(
        self, target: int, budget: int, segments: list[tuple[int, int]], width: int
    ) -> SampleOutput:
        """Sample output of `target` tokens (of a `budget`), cut short if aborted earlier, with
        `width` payload bytes per token (so a full-length sample carries about
        `payload_bytes_per_sample`)."""
        n = min(target, segments[-1][0] if segments else 0)
        start = int(self._rng.integers(0, _POOL - n)) if n < _POOL else 0
        tokens = self._token_pool[start : start + n].copy()
        if n < target:
            finish = "abort"
        elif n < budget:
            finish = "stop"
            tokens[-1] = self.config.eos_token_id
        else:
            finish = "length"
        if len(segments) == 1:
            versions = np.full(n, segments[0][1], dtype=np.int32)
        else:
            versions = np.empty(n, dtype=np.int32)
            done = 0
            for upto, version in segments:
                end = min(upto, n)
                versions[done:end] = version
                done = max(done, end)
        experts = np.full((n, width), n % 251, dtype=np.uint8) if width else None
        return SampleOutput(
            tokens=tokens,
            logprobs=self._logprob_pool[start : start + n].copy(),
            versions=versions,
            finish_reason=finish,
            routed_experts=experts,
        )

    def _corrupt(self, outputs: list[SampleOutput]) -> list[SampleOutput]:
        """Break one output in one of the ways a buggy engine could."""
        kind = int(self._rng.integers(0, 4))
        first = outputs[0] if outputs else None
        if first is None or kind == 0:
            return outputs + outputs[:1] if outputs else []  # wrong number of samples
        n = len(first.tokens)
        if kind == 1:
            broken = msgspec.structs.replace(first, logprobs=np.zeros(n + 1, dtype=np.float32))
        elif kind == 2:
            broken = msgspec.structs.replace(
                first, tokens=np.full(max(n, 1), self.config.vocab_size + 7, dtype=np.int32),
                logprobs=np.zeros(max(n, 1), np.float32), versions=np.zeros(max(n, 1), np.int32),
            )  # fmt: skip
        else:
            broken = msgspec.structs.replace(first, logprobs=np.full(n, np.nan, dtype=np.float32))
            if n == 0:
                broken = msgspec.structs.replace(first, finish_reason="exploded")
        return [broken, *outputs[1:]]
