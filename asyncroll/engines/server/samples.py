"""What a group's HTTP requests to a `vllm serve` replica carry out and bring back, for
`VLLMServerEngine`: the sampling parameters sent, the streamed tokens kept while in flight,
and the samples that leave as the `Engine` contract has them.

Everything a replica sends is parsed strictly here, and any answer that breaks the contract
fails the request with a `ReplicaError` naming the replica, before anything reaches the
trainer: a token id outside the vocabulary, a label the engine could not have set, more
tokens than asked for, logprobs or version spans that do not line up.
"""

from __future__ import annotations

import array
import asyncio
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from asyncroll.engines.base import SampleOutput, SamplingConfig
from asyncroll.engines.server import replicas as rp
from asyncroll.engines.server.lora import ServedAdapter
from asyncroll.engines.server.replicas import (
    PausedRefusal,
    Replica,
    ReplicaError,
    UnsyncedReplicaError,
)
from asyncroll.engines.vllm import groups as vllm_groups

IN_FLIGHT_BYTES_PER_TOKEN = 10  # a token id and a logprob, 4 B each, and the arrays' growth
IN_FLIGHT_SAMPLE_BYTES = 512  # a `Sample` and its two arrays, empty
FINISH_REASONS = frozenset({"stop", "length", "abort"})
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_LABEL = re.compile(r"-?(0|[1-9][0-9]{0,9})")  # `str(version)`, ASCII digits only


def attempt_session(request_id: str) -> str:
    """The default session key: the request id without its last "-" part. The producer names
    attempts `<run>-<group uid>-<attempt>`, so every attempt of a group meets the same replica
    (and its prefix cache)."""
    return request_id.rsplit("-", 1)[0]


def check_version(version: int) -> None:
    """A version becomes every token's label and comes back as int32 (`SampleOutput`)."""
    if not INT32_MIN <= version <= INT32_MAX:
        raise ValueError(f"version={version}: must fit in int32 (every token carries it)")


class Sample:
    """A sample's tokens as they stream in, in C arrays (8 B a token, counted by the
    engine's `payload_bytes`): Python lists of ints and floats held ~70."""

    __slots__ = ("finish", "label", "logprobs", "spans", "tokens")

    def __init__(self) -> None:
        self.tokens = array.array("i")  # int32, as `SampleOutput` has them
        self.logprobs = array.array("f")
        self.finish: str | None = None
        self.spans: list[rp.Span] | None = None
        self.label: int | None = None  # sent with an adapter: every token's version

    def clear(self) -> None:
        """Back to no token: its request's stream was lost, and it is sent again."""
        self.tokens = array.array("i")
        self.logprobs = array.array("f")
        self.finish = self.spans = self.label = None


class Part:
    """One HTTP request of a group: `n` samples continuing the same prompt + prefix."""

    __slots__ = (
        "adapter",
        "indices",
        "max_tokens",
        "name",
        "prompt",
        "refusals",
        "resends",
        "started",
    )

    def __init__(self, name: str, prompt: list[int], max_tokens: int, indices: list[int]):
        self.name = name  # its id in the group ("<request id>/<sample>"); seeds its sampling
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.indices = indices  # positions in the group's request.samples
        self.started = False  # sent to the replica (so an abort has to reach it there)
        self.adapter: ServedAdapter | None = None  # the LoRA adapter it was sent with
        self.resends = 0  # times sent again after its stream was lost (`request_path`)
        self.refusals = 0  # times refused in a row by a paused replica (`refusals`)

    @property
    def server_id(self) -> str:
        """The request_id sent (vLLM prefixes it, "generate-tokens-"): one of each send, as
        a lost stream's request may still run on its replica when it is sent again."""
        return self.name if self.resends == 0 else f"{self.name}~{self.resends}"


class Live:
    """A running group: its replica (None until routed), its requests and the tasks
    streaming them."""

    __slots__ = ("aborted", "parts", "refused", "replica", "samples", "tasks")

    def __init__(self, parts: list[Part], replica: Replica | None, samples: list[Sample]) -> None:
        self.parts = parts
        self.samples = samples
        self.replica = replica
        self.aborted = False
        self.refused: PausedRefusal | None = None  # the last refusal of a paused replica
        self.tasks: list[asyncio.Task[None]] = []


def sampling_params(
    sampling: SamplingConfig, part: Part, stream_interval: int | None
) -> dict[str, Any]:
    """vLLM's sampling parameters for one part (`stream_interval` None: its first token,
    then the rest at the end)."""
    params: dict[str, Any] = {
        "n": len(part.indices),
        "max_tokens": part.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "logprobs": 0,  # the sampled token's logprob only
        "stream_interval": stream_interval or part.max_tokens,
    }
    if sampling.top_k is not None:
        params["top_k"] = sampling.top_k
    if sampling.seed is not None:
        params["seed"] = vllm_groups.part_seed(sampling.seed, part.name)
    return params


def append(sample: Sample, choice: rp.StreamChoice, url: str, vocab_size: int) -> int:
    """Add one streamed delta of a sample; the number of new tokens. A token id outside the
    vocabulary (beyond int32 it was a bare `OverflowError` naming no replica) fails it."""
    tokens = choice.token_ids or []
    for token in tokens:
        if not 0 <= token < vocab_size:
            raise ReplicaError(url, f"streamed token id {token}, outside [0, {vocab_size})")
    entries = choice.logprobs.content if choice.logprobs is not None else []
    if len(entries) != len(tokens) or any(
        e.token_id != t for e, t in zip(entries, tokens, strict=True)
    ):
        raise ReplicaError(url, "streamed logprobs do not line up with the token ids")
    sample.tokens.extend(tokens)
    sample.logprobs.extend(e.logprob for e in entries)
    if choice.finish_reason is not None:
        sample.finish = choice.finish_reason
        sample.spans = choice.weight_versions
    return len(tokens)


def output(
    sample: Sample,
    request_id: str,
    url: str,
    max_new_tokens: int,
    base_of: Mapping[int, int] = MappingProxyType({}),
) -> SampleOutput:
    """One sample as the `Engine` contract has it; a replica's answer that breaks the
    contract (more tokens than asked for, a finish reason, logprobs or version labels that
    do not fit) fails the request instead of reaching the trainer. `base_of`: labels that
    stand for the base weights' version in a sample sent without an adapter
    (`server_lora`)."""
    n = len(sample.tokens)
    if n > max_new_tokens:
        raise ReplicaError(
            url,
            f"returned {n} tokens for a sample of {request_id} that asked for at most"
            f" {max_new_tokens}",
        )
    if sample.finish not in FINISH_REASONS:
        raise ReplicaError(url, f"finished a sample of {request_id} with reason {sample.finish!r}")
    if len(sample.logprobs) != n:
        raise ReplicaError(url, f"returned {len(sample.logprobs)} logprobs for {n} tokens")
    versions = vllm_groups.token_versions(sample.spans, n, lambda label: parse_label(label, url))
    if versions is None:
        raise ReplicaError(
            url,
            f"its version spans do not label each of the {n} tokens of {request_id} once, in order",
        )
    if sample.label is not None:  # an adapter bound to the request sampled every token
        versions.fill(sample.label)
    else:
        for label, base in base_of.items():
            versions[versions == label] = base
    return SampleOutput(
        tokens=np.array(sample.tokens, dtype=np.int32),
        logprobs=np.array(sample.logprobs, dtype=np.float32),
        versions=versions,
        finish_reason=sample.finish,
    )


def parse_label(label: str, url: str) -> int:
    """A version label as the engine sets it (`str(version)` of an int32); anything else
    (vLLM's initial "default": a replica restarted behind the engine's back) fails the
    request. Strictly: `int()` also reads "1_0" as 10, "\\u0663" as 3 and " 1" as 1."""
    value = int(label) if _LABEL.fullmatch(label) else None
    if value is None or not INT32_MIN <= value <= INT32_MAX:
        raise UnsyncedReplicaError(
            url,
            f"served tokens labelled {label!r}, a version this engine never set "
            "(did it restart without the current weights?)",
        )
    return value


def aborted_output() -> SampleOutput:
    empty = np.zeros(0, dtype=np.int32)
    return SampleOutput(
        tokens=empty,
        logprobs=np.zeros(0, dtype=np.float32),
        versions=empty.copy(),
        finish_reason="abort",
    )


def unfinished(task: asyncio.Task[None]) -> bool:
    """Whether a part's stream ended without finishing (an error or a cancellation), or has
    not ended yet."""
    return not task.done() or task.cancelled() or task.exception() is not None
