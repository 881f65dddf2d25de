"""The `Engine` protocol: what the producer needs from a generation backend, and nothing more.

One call generates the samples of one group. A sample either starts fresh (empty `prefix`) or
continues a partial response (the prefix is re-prefilled after the prompt), so resuming an
aborted group is the same call as starting one. The engine stamps every token it returns with
the policy version it was sampled under; the producer tells it the version in `update_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec
import numpy.typing as npt

from asyncroll.types import Float32Array, Int32Array

Weights = Iterable[tuple[str, Any]]
"""Named tensors (`model.named_parameters()`, a state dict's `.items()`)."""


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more requests (its process died, it was closed)."""


class SamplingConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling parameters shared by every request of a producer."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None  # reproducible sampling; each sample's stream derives from it

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k}: use None to disable or a value >= 1")


class SampleRequest(msgspec.Struct, frozen=True):
    """One sample to generate: continue `prefix` (empty for a fresh sample) by up to
    `max_new_tokens` tokens."""

    prefix: Int32Array
    max_new_tokens: int


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The samples of one group that still need tokens. `request_id` is unique per attempt and
    is what `abort` takes."""

    request_id: str
    prompt_tokens: Int32Array
    samples: tuple[SampleRequest, ...]
    sampling: SamplingConfig


class SampleOutput(msgspec.Struct, frozen=True, kw_only=True):
    """The new tokens of one sample (not including its prefix), in request order.

    `finish_reason` is "stop", "length" or "abort" (the request was aborted; the tokens so far
    are kept and the sample can be continued).
    """

    tokens: Int32Array
    logprobs: Float32Array
    versions: Int32Array
    finish_reason: str
    routed_experts: npt.NDArray[Any] | None = None


@runtime_checkable
class Engine(Protocol):
    """A generation backend driven from the producer's event loop.

    Implementations must answer `abort` promptly: the aborted `generate` call returns the
    partial samples with finish reason "abort". `generate` raises `EngineDeadError` when the
    engine can no longer serve; any other exception fails only that group.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int | None:
        """Longest prompt + response the engine accepts (None: no limit)."""
        ...

    def payload_bytes(self, max_new_tokens: int) -> int:
        """Upper bound of the extra payload (routed experts...) one sample of up to
        `max_new_tokens` tokens carries; the producer sizes buffer reservations with it."""
        ...

    @property
    def supports_keep_pause(self) -> bool:
        """Whether `pause_generation` can freeze requests in place (instead of aborting them)."""
        ...

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def pause_generation(self) -> None:
        """Freeze all running requests in place (only if `supports_keep_pause`)."""
        ...

    async def resume_generation(self) -> None: ...

    async def update_weights(self, weights: Weights | None, *, version: int) -> None:
        """Load `weights` (None: they were loaded out of band) and stamp later tokens `version`.
        Returns once the new weights serve every new token."""
        ...

    async def close(self) -> None: ...
