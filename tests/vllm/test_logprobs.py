"""vLLM's logprobs are the behaviour policy's, and `token_logprobs` computes the same policy."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncroll.engines import VLLMEngine
from asyncroll.train import token_logprobs
from tests.vllm.conftest import DEADLINE_S
from tests.vllm.helpers import ids, request

pytestmark = pytest.mark.vllm


async def test_logprobs_are_the_sampling_distribution_s_and_the_trainer_s(
    engine: VLLMEngine, tiny_model: Path
) -> None:
    """At temperature 0.7 and top-p 0.9 vLLM's logprob of each sampled token equals the
    trainer's under the same temperature and nucleus; the raw model logprob (what vLLM returns
    by default, and what `token_logprobs` gave before it took sampling parameters) does not."""
    from transformers import AutoModelForCausalLM

    prompt = ids(0, 40, 41, 42, 43)
    async with asyncio.timeout(DEADLINE_S):
        outputs = await engine.generate(
            request("lp-t07", prompt, n=4, max_new_tokens=24, temperature=0.7, top_p=0.9, seed=0)
        )
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    seqs = torch.tensor(np.stack([np.concatenate([prompt, o.tokens]) for o in outputs]))
    with torch.no_grad():
        logits = model(input_ids=seqs).logits
    ours = token_logprobs(logits, seqs, temperature=0.7, top_p=0.9)[:, len(prompt) :]
    raw = token_logprobs(logits, seqs)[:, len(prompt) :]
    vllm = torch.tensor(np.stack([o.logprobs for o in outputs]))
    assert torch.isfinite(ours).all()  # every sampled token lies in the trainer's nucleus
    assert (ours - vllm).abs().max() < 1e-4, (ours - vllm).abs().max()
    assert (raw - vllm).abs().mean() > 0.05, (raw - vllm).abs().mean()
