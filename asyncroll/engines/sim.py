"""`SimEngine`: a seeded *simulation* of an inference engine. It generates no language.

It exists to test the producer's logic (failures, hangs, malformed output, aborts, pauses,
memory) and to measure the producer's own overhead without a model. Tokens are random ids,
logprobs random negatives; latency is simulated with timers. Never present its output as
generation: use `VLLMEngine` for that.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

from asyncroll.engines.base import (
    EngineDeadError,
    GenerateRequest,
    RecentIds,
    SampleOutput,
    SampleRequest,
    Weights,
    check_token_ids,
)
from asyncroll.lora import LoraAdapter

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
    # generate never returns and ignores abort, pause and close: an engine breaking the
    # `Engine` contract, on purpose, so the producer's own deadlines can be tested
    hang_rate: float = 0.0
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


class _SimRequest:
    """A running simulated request and its simulated clock.

    Time only counts while the request runs (`since` is set): a pause, an abort or a version
    change closes the current stretch at once, recording `(tokens by then, version)`, so what
    `generated_tokens` reports and the versions stamped on the output agree to the token.
    `wake` ends the coroutine's current wait (abort, pause, resume).
    """

    __slots__ = ("aborted", "active", "first_s", "per_token_s", "segments", "since",
                 "targets", "version", "wake")  # fmt: skip

    def __init__(self, targets: list[int], first_s: float, per_token_s: float) -> None:
        self.targets = targets
        self.first_s = first_s
        self.per_token_s = per_token_s
        self.aborted = False
        self.wake = asyncio.Event()
        self.active = 0.0  # seconds run so far, not counting the stretch in progress
        self.since: float | None = None  # start of the stretch in progress
        self.version = 0  # the version the stretch in progress samples under
        self.segments: list[tuple[int, int]] = []

    @property
    def longest(self) -> int:
        return max(self.targets, default=0)

    @property
    def duration(self) -> float:
        return self.first_s + self.longest * self.per_token_s

    def run(self, version: int) -> None:
        self.since, self.version = time.monotonic(), version

    def stop(self) -> None:
        """Close the stretch in progress (if any)."""
        if self.since is not None:
            self.active += time.monotonic() - self.since
            self.since = None
            self.segments.append((self.tokens_at(self.active), self.version))

    def tokens_at(self, active_s: float) -> int:
        if self.per_token_s == 0:
            return self.longest if active_s >= self.first_s else 0
        done = (active_s - self.first_s) / self.per_token_s
        return max(0, min(self.longest, int(done)))

    def done(self) -> int:
        """Tokens of the longest sample generated so far."""
        now = self.active + (time.monotonic() - self.since if self.since is not None else 0.0)
        return self.tokens_at(now)

    def generated(self) -> int:
        """Tokens of all samples generated so far."""
        done = self.done()
        return sum(min(t, done) for t in self.targets)

    def samples_started(self) -> int:
        """Samples with a token by now (a zero-token budget never starts)."""
        done = self.done()
        return sum(1 for t in self.targets if min(t, done) > 0)


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
        self._live: dict[str, _SimRequest] = {}
        self._recent = RecentIds()
        self._generated = 0
        self._running = asyncio.Event()  # cleared while paused in place
        self._running.set()
        self._closed = False
        self.calls = 0  # generate calls, for tests and benchmarks
        self.adapter_updates = 0  # LoRA adapters received, for tests

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

    @property
    def adapter_slots(self) -> None:
        """The simulation serves no LoRA adapters."""
        return None

    @property
    def pause_bound_s(self) -> None:
        """A simulated pause is immediate: no bound of its own."""
        return None

    def payload_bytes(self, max_new_tokens: int) -> int:
        return self.config.payload_bytes_per_sample

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        self._check_alive()
        rid = request.request_id
        if rid in self._live:
            raise ValueError(f"request id {rid!r} is already running")
        check_token_ids(request.prompt_tokens, self.config.vocab_size, "prompt")
        for i, sample in enumerate(request.samples):
            check_token_ids(sample.prefix, self.config.vocab_size, f"sample {i} prefix")
        self.calls += 1
        if self._recent.take_early_abort(rid):
            return [_aborted_before_start() for _ in request.samples]
        cfg = self.config
        draw = self._rng.random()
        malformed = draw < cfg.hang_rate + cfg.fail_rate + cfg.malformed_rate
        live = _SimRequest([], cfg.first_token_latency_s, cfg.per_token_latency_s)
        self._live[rid] = live
        try:
            if draw < cfg.hang_rate:
                await asyncio.Event().wait()  # never set: only the caller's cancellation ends it
            if draw < cfg.hang_rate + cfg.fail_rate:
                raise SimEngineError(f"simulated failure of request {rid}")
            live.targets = [self._target_length(s) for s in request.samples]
            await self._run(live)
        finally:
            live.stop()
            del self._live[rid]
            self._recent.ended(rid)
        if self._closed:
            raise EngineDeadError("SimEngine was closed during the request")
        width = -(-cfg.payload_bytes_per_sample // request.sampling.max_new_tokens)
        outputs = self._outputs(live.targets, request.samples, live.segments, width)
        self._generated += sum(len(out.tokens) for out in outputs)
        return self._corrupt(outputs) if malformed else outputs

    async def abort(self, request_id: str) -> None:
        """Abort in any state (see `Engine`): a running request stops at once; an id not seen
        yet is remembered for its coming `generate`; an ended one is left alone."""
        if self._closed:
            return
        live = self._live.get(request_id)
        if live is not None:
            live.aborted = True
            live.stop()
            live.wake.set()
        else:
            self._recent.abort_unknown(request_id)

    async def pause_generation(self) -> None:
        self._check_alive()
        self._running.clear()
        for live in self._live.values():
            live.stop()
            live.wake.set()

    async def resume_generation(self) -> None:
        self._check_alive()
        self._running.set()
        for live in self._live.values():
            live.wake.set()

    async def update_weights(self, weights: Weights | LoraAdapter | None, *, version: int) -> None:
        """Consume `weights`, wait `update_latency_s`, then stamp `version` on every token
        from now on, including the rest of requests running right now. A `LoraAdapter` is
        counted in `adapter_updates` (a simulation: nothing is applied)."""
        self._check_alive()
        if isinstance(weights, LoraAdapter):
            self.adapter_updates += 1
        elif weights is not None:
            for _name, _tensor in weights:
                pass
        if self.config.update_latency_s:
            await asyncio.sleep(self.config.update_latency_s)
            self._check_alive()
        self._version = version
        for live in self._live.values():
            if live.since is not None:  # split its running stretch at the version change
                live.stop()
                live.run(version)

    async def close(self) -> None:
        """Stop serving: running and later requests raise `EngineDeadError` (a dead engine)."""
        self._closed = True
        for live in self._live.values():
            live.aborted = True
            live.stop()
            live.wake.set()

    # -- observables, for tests and benchmarks ---------------------------------------------------

    @property
    def running_requests(self) -> int:
        """Requests inside `generate` (hung ones included)."""
        return len(self._live)

    @property
    def generated_tokens(self) -> int:
        """Tokens generated since the engine started, counting running requests' progress."""
        return self._generated + sum(live.generated() for live in self._live.values())

    def samples_started(self, request_id: str) -> int:
        """How many samples of the running request `request_id` have a token by now."""
        live = self._live.get(request_id)
        return 0 if live is None else live.samples_started()

    async def wait_generated(self, tokens: int, timeout: float) -> None:
        """Return once `generated_tokens >= tokens`; `TimeoutError` after `timeout` s."""
        await self.wait_progress(lambda: self.generated_tokens >= tokens, timeout)

    async def wait_progress(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Return once `predicate()` holds; `TimeoutError` after `timeout` s. Progress is
        simulated time, so this polls it once per simulated token."""
        async with asyncio.timeout(timeout):
            while not predicate():
                self._check_alive()
                await asyncio.sleep(self.config.per_token_latency_s or 1e-3)

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

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("SimEngine is closed")

    async def _run(self, live: _SimRequest) -> None:
        """Advance simulated time until the longest sample is done or the request is aborted.
        Time only runs while the engine is not paused (see `_SimRequest`): a request without
        latency, too, waits for the resume before it is done."""
        while not live.aborted and (live.duration == 0 or live.active < live.duration):
            live.wake.clear()
            if not self._running.is_set():
                await live.wake.wait()  # set again by resume_generation or abort
                continue
            if live.duration == 0:  # done at once, under the version of this moment
                live.segments.append((live.longest, self._version))
                return
            live.run(self._version)
            try:
                async with asyncio.timeout(live.duration - live.active):
                    await live.wake.wait()
            except TimeoutError:
                pass
            live.stop()

    def _outputs(
        self,
        targets: list[int],
        samples: Sequence[SampleRequest],
        segments: list[tuple[int, int]],
        width: int,
    ) -> list[SampleOutput]:
        """The outputs of one request: sample i has `targets[i]` tokens (of its budget), cut
        short if aborted earlier, with `width` payload bytes per token (so a full-length sample
        carries about `payload_bytes_per_sample`).

        One draw from the pools per request, not per sample, so that the simulation's own cost
        stays small next to the producer's it is used to measure; the samples' arrays are views
        into the request's copies."""
        done = segments[-1][0] if segments else 0
        counts = [min(target, done) for target in targets]
        total = sum(counts)
        if total < _POOL:
            start = int(self._rng.integers(0, _POOL - total))
            tokens = self._token_pool[start : start + total].copy()
            logprobs = self._logprob_pool[start : start + total].copy()
        else:  # more than the pools hold: repeat them
            tokens = np.resize(self._token_pool, total)
            logprobs = np.resize(self._logprob_pool, total)
        by_position = self._versions(segments, max(counts, default=0))
        outputs = []
        end = 0
        for n, target, sample in zip(counts, targets, samples, strict=True):
            begin, end = end, end + n
            if n < target:
                finish = "abort"
            elif n < sample.max_new_tokens:
                finish = "stop"
                tokens[end - 1] = self.config.eos_token_id
            else:
                finish = "length"
            outputs.append(
                SampleOutput(
                    tokens=tokens[begin:end],
                    logprobs=logprobs[begin:end],
                    versions=by_position[:n],
                    finish_reason=finish,
                    routed_experts=np.full((n, width), n % 251, np.uint8) if width else None,
                )
            )
        return outputs

    @staticmethod
    def _versions(segments: list[tuple[int, int]], n: int) -> npt.NDArray[np.int32]:
        """The version that sampled each of the first `n` token positions (the same for every
        sample of a request: they advance in lockstep)."""
        if len(segments) == 1:
            return np.full(n, segments[0][1], dtype=np.int32)
        versions = np.empty(n, dtype=np.int32)
        done = 0
        for upto, version in segments:
            end = min(upto, n)
            versions[done:end] = version
            done = max(done, end)
        return versions

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


def _aborted_before_start() -> SampleOutput:
    empty = np.zeros(0, dtype=np.int32)
    return SampleOutput(
        tokens=empty, logprobs=np.zeros(0, dtype=np.float32), versions=empty, finish_reason="abort"
    )
