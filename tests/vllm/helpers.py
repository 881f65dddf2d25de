"""Small builders shared by the vLLM tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncroll.engines import GenerateRequest, SampleRequest, SamplingConfig
from asyncroll.types import Int32Array


def ids(*tokens: int) -> Int32Array:
    return np.array(tokens, dtype=np.int32)


def request(
    request_id: str,
    prompt: Int32Array,
    n: int = 1,
    max_new_tokens: int = 16,
    *,
    prefixes: list[Int32Array] | None = None,
    **sampling: Any,
) -> GenerateRequest:
    """`n` fresh samples, or one sample per prefix, each of up to `max_new_tokens` new tokens
    (eos ignored, so exactly that many)."""
    prefixes = prefixes if prefixes is not None else [ids()] * n
    return GenerateRequest(
        request_id=request_id,
        prompt_tokens=prompt,
        samples=tuple(SampleRequest(p, max_new_tokens) for p in prefixes),
        sampling=SamplingConfig(max_new_tokens=max_new_tokens, ignore_eos=True, **sampling),
    )
