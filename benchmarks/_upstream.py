"""The upstream trainer's way of holding and persisting a rollout sample, for comparison.

Upstream kept each sample as a pydantic model whose token ids, logprobs and routed experts are
Python lists, and persisted its buffer with `torch.save`. `ListState` mirrors that field layout
(a reconstruction for the benchmark, not upstream's code); `TensorState` is the kinder variant
with torch tensors in the same fields. Both live at module level because pickling (which
`torch.save` does) finds classes by their import path.
"""

from __future__ import annotations

import pydantic
import torch


class ListState(pydantic.BaseModel):
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    routed_experts: list[int] | None
    finish_reason: str | None
    reward: float | None
    status: str


class TensorState(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    routed_experts: torch.Tensor | None
    finish_reason: str | None
    reward: float | None
    status: str
