"""Weight updates: after `update_weights`, vLLM serves exactly the new weights.

The reference is a Hugging Face transformers forward pass of the same weights (cheaper than a
second vLLM engine): vLLM's greedy tokens must be the argmax of the reference at every step and
its logprobs must match the reference's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncroll.engines import SampleOutput, VLLMEngine
from asyncroll.types import Int32Array
from tests.vllm.conftest import DEADLINE_S
from tests.vllm.helpers import ids, request

pytestmark = pytest.mark.vllm

PROMPTS = [ids(0, 5, 6, 7), ids(0, 100, 200), ids(0, 1, 2, 3, 4, 5, 6, 7, 8)]
STEPS = 24


def perturbed_model(model: Path, device: str) -> Any:
    """The tiny model with seeded noise added to every weight: clearly another policy."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=noise).to(device))
    return hf


def reference_logprobs(hf: Any, prompt: Int32Array, tokens: Int32Array) -> Any:
    """Log-softmax of the reference model at the positions that predict `tokens`."""
    import torch

    seq = torch.tensor(np.concatenate([prompt, tokens])[None], device=hf.device)
    with torch.no_grad():
        logits = hf(seq).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).cpu().numpy()


async def greedy(engine: VLLMEngine, tag: str) -> list[SampleOutput]:
    async with asyncio.timeout(DEADLINE_S):
        results = await asyncio.gather(
            *(engine.generate(request(f"{tag}-{i}", p, 1, STEPS, temperature=0.0))
              for i, p in enumerate(PROMPTS))
        )  # fmt: skip
    return [out for (out,) in results]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
async def test_update_serves_the_new_weights(
    engine: VLLMEngine, tiny_model: Path, device: str
) -> None:
    """`device="cuda"` sends CUDA tensors, which go to the worker by CUDA IPC (GPU kernels
    differ more from the reference than CPU ones: a looser logprob tolerance there)."""
    hf = perturbed_model(tiny_model, device)
    before = await greedy(engine, "before")
    await engine.update_weights(hf.named_parameters(), version=1)
    after = await greedy(engine, "after")
    assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(after, before, strict=True))
    for prompt, out in zip(PROMPTS, after, strict=True):
        assert (out.versions == 1).all()
        ref = reference_logprobs(hf, prompt, out.tokens)
        np.testing.assert_array_equal(ref.argmax(axis=-1), out.tokens)
        atol = 1e-4 if device == "cpu" else 5e-3
        np.testing.assert_allclose(out.logprobs, ref[np.arange(STEPS), out.tokens], atol=atol)

    await engine.update_weights(None, version=2)  # only the version changes
    again = await greedy(engine, "again")
    for a, b in zip(again, after, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        assert (a.versions == 2).all()
