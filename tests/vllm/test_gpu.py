"""GPU-only checks (skipped without CUDA): CUDA IPC weight transfer keeps no GPU memory, and
routed experts of a MoE model come back one row per new token.

Not run on the CPU machines this project is developed on; see the report of issue 3.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from asyncroll.engines import VLLMEngine
from tests.vllm.conftest import DEADLINE_S, MAX_MODEL_LEN, original_weights
from tests.vllm.helpers import ids, request

pytestmark = [pytest.mark.vllm, pytest.mark.gpu]


async def test_cuda_ipc_updates_leave_no_gpu_memory(engine: VLLMEngine, tiny_model: Path) -> None:
    """Non-contiguous CUDA tensors make `update_weights` copy them for IPC; once the workers
    have loaded them, neither the copies nor the workers' mappings may stay behind."""
    import torch

    weights = [(n, t.cuda().T.contiguous().T) for n, t in original_weights(tiny_model)]
    await engine.update_weights(weights, version=1)
    torch.cuda.synchronize()
    allocated, (free, _) = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()
    for version in range(2, 12):
        await engine.update_weights(weights, version=version)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert free - torch.cuda.mem_get_info()[0] < 4 << 20


async def test_routed_experts_one_row_per_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.32 returns routed experts only with its model runner V2 (which needs Triton,
    so not on CPU)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mixtral", vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    import vllm

    if tuple(int(x) for x in vllm.__version__.split(".")[:2]) < (0, 34):  # 0.34: V2 only
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    async with VLLMEngine(
        tmp_path, max_model_len=MAX_MODEL_LEN, enable_return_routed_experts=True,
        gpu_memory_utilization=0.2,
    ) as moe:  # fmt: skip
        assert moe.payload_bytes(10) == 10 * 2 * 2  # uint8 ids, 2 layers x top-2
        async with asyncio.timeout(DEADLINE_S):
            fresh = await moe.generate(request("moe", ids(0, 5, 6, 7), 2, 10))
            (resumed,) = await moe.generate(
                request("moe-resume", ids(0, 5, 6, 7), 1, 6, prefixes=[fresh[0].tokens[:4]])
            )
    for out, n in ((fresh[0], 10), (fresh[1], 10), (resumed, 6)):
        experts = out.routed_experts
        assert experts is not None
        assert experts.shape == (n, 2, 2)
        assert experts.dtype == np.uint8
        assert experts.max() < 4
