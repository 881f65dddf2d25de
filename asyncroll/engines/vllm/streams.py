"""One group's samples as vLLM streams them: the vLLM requests a group becomes, each sample's
tokens as its DELTA outputs arrive, the `SamplingParams` each request is sent with, and the
`SampleOutput` each sample ends as. Pure bookkeeping, apart from vLLM's types: the engine
(`asyncroll.engines.vllm.engine`) owns the streams and the calls into vLLM.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from asyncroll.engines.base import SampleOutput, SamplingConfig
from asyncroll.engines.vllm import groups as vllm_groups
from asyncroll.engines.vllm.lora import Adapter

FINISH_REASONS = frozenset({"stop", "length", "abort"})
INITIAL_LABEL = "default"  # vLLM's weight version label before any update: our version 0


class StreamedSample:
    """One sample's tokens as they stream in."""

    __slots__ = ("experts", "finish", "logprobs", "spans", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str | None = None
        self.spans: list[Any] | None = None
        self.experts: Any = None


class GroupPart:
    """One vLLM request of a group: `n` samples continuing the same prompt + prefix."""

    __slots__ = ("indices", "max_tokens", "prompt", "refusals", "vllm_id")

    def __init__(self, vllm_id: str, prompt: list[int], max_tokens: int, indices: list[int]):
        self.vllm_id = vllm_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.indices = indices  # positions in the group's request.samples
        self.refusals = 0  # times in a row a paused vLLM refused it (`refusals`)


class LiveGroup:
    """A running group: its vLLM requests, its samples as they stream in, the tasks
    streaming them (which `close` cancels, so that no `generate` outlives the engine), and
    the adapter it runs under (None: the base weights)."""

    __slots__ = ("aborted", "adapter", "parts", "refused", "samples", "tasks")

    def __init__(
        self, parts: list[GroupPart], samples: list[StreamedSample], adapter: Adapter | None
    ) -> None:
        self.parts = parts
        self.samples = samples
        self.adapter = adapter
        self.aborted = False
        self.tasks: list[asyncio.Task[None]] = []
        self.refused: str | None = None  # what a paused vLLM last said refusing a part


def aborted(live: LiveGroup) -> bool:
    """`live.aborted`, read through a call: it changes across awaits, which mypy's narrowing
    does not know."""
    return live.aborted


def append(sample: StreamedSample, completion: Any) -> None:
    """Add one DELTA output of a sample."""
    from vllm.logprobs import FlatLogprobs

    tokens = completion.token_ids
    sample.tokens.extend(tokens)
    logprobs = completion.logprobs
    if isinstance(logprobs, FlatLogprobs):
        sample.logprobs.extend(logprobs.logprobs)
    elif logprobs is not None:
        sample.logprobs.extend(pos[t].logprob for t, pos in zip(tokens, logprobs, strict=True))
    if completion.finish_reason is not None:
        sample.finish = str(completion.finish_reason)
        sample.spans = completion.weight_versions
        sample.experts = completion.routed_experts


def sampling_params(
    sampling: SamplingConfig, part: GroupPart, *, stream_interval: int | None, experts: bool
) -> Any:
    """vLLM's `SamplingParams` for one part: DELTA outputs every `stream_interval` tokens (None:
    the first token and the rest at the end), the sampled token's logprob, and with `experts`
    the routed experts from the position that samples the first new token."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    extra: dict[str, Any] = {}
    if sampling.top_k is not None:
        extra["top_k"] = sampling.top_k
    if sampling.seed is not None:
        extra["seed"] = vllm_groups.part_seed(sampling.seed, part.vllm_id)
    if experts:  # rows from the position that samples the first new token
        extra["routed_experts_prompt_start"] = len(part.prompt) - 1
    return SamplingParams(
        n=len(part.indices),
        max_tokens=part.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=0,  # the sampled token's logprob only
        flat_logprobs=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        stream_interval=stream_interval or part.max_tokens,
        **extra,
    )


def sample_output(sample: StreamedSample, request_id: str, version: int | None) -> SampleOutput:
    """The sample's arrays; `version` (the request's adapter's) labels every token, else
    vLLM's version spans do."""
    n = len(sample.tokens)
    finish = sample.finish
    if finish not in FINISH_REASONS:
        raise RuntimeError(f"vLLM finished a sample of {request_id} with reason {finish!r}")
    if len(sample.logprobs) != n:
        raise RuntimeError(
            f"vLLM returned {len(sample.logprobs)} logprobs for {n} tokens ({request_id})"
        )
    versions = vllm_groups.token_versions(sample.spans, n, version_of)
    if versions is None:
        raise RuntimeError(f"vLLM's version spans do not label each of {n} tokens once")
    if version is not None:
        versions = np.full(n, version, dtype=np.int32)
    experts = sample.experts
    return SampleOutput(
        tokens=np.array(sample.tokens, dtype=np.int32),
        logprobs=np.array(sample.logprobs, dtype=np.float32),
        versions=versions,
        finish_reason=finish,
        routed_experts=None if experts is None else np.ascontiguousarray(experts),
    )


def version_of(label: str) -> int:
    """The version a weight-version label stands for: vLLM's initial label is version 0."""
    return 0 if label == INITIAL_LABEL else int(label)
