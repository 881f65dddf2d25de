"""`VLLMServerEngine` sending weights over vLLM's NCCL weight transfer to a real `vllm serve`
(GPU only: skipped without CUDA, and without a second GPU, since NCCL refuses two ranks of
one group on the same device). The server runs on GPU 1, this process (the trainer) on GPU 0.

Not run on the CPU machines this project is developed on: no GPU run is recorded yet.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncroll.engines import VLLMServerEngine
from asyncroll.engines.server.launch import ServerProcess, free_port
from asyncroll.engines.server.nccl_transfer import NCCLWeightTransfer
from tests.vllm.conftest import original_weights
from tests.vllm.helpers import ids, request

pytestmark = [pytest.mark.vllm, pytest.mark.gpu]


async def test_weights_sent_over_nccl_change_greedy_output_and_the_version(
    tiny_model: Path,
) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: NCCL refuses two ranks on one device")
    torch.cuda.set_device(0)
    server = ServerProcess.start(
        tiny_model,
        on_cpu=False,
        extra_args=["--weight-transfer-config", '{"backend":"nccl"}'],
        env={"CUDA_VISIBLE_DEVICES": "1"},
    )
    sender = NCCLWeightTransfer("127.0.0.1", free_port(), timeout_s=120.0)
    try:
        async with (
            asyncio.timeout(300),
            VLLMServerEngine(
                server.url, vocab_size=512, control_timeout_s=60.0, weight_transfer=sender
            ) as engine,
        ):
            prompt = ids(0, 5, 6, 7)
            (before,) = await engine.generate(request("before-0", prompt, temperature=0.0))
            assert before.versions.tolist() == [0] * len(before.tokens)

            weights = original_weights(tiny_model)
            changed = [(n, -t if n == "model.norm.weight" else t) for n, t in weights]
            await engine.update_weights([(n, t.cuda()) for n, t in changed], version=1)
            (after,) = await engine.generate(request("after-0", prompt, temperature=0.0))
            assert after.versions.tolist() == [1] * len(after.tokens)
            assert after.tokens.tolist() != before.tokens.tolist()

            await engine.update_weights([(n, t.cuda()) for n, t in weights], version=2)
            (back,) = await engine.generate(request("back-0", prompt, temperature=0.0))
            assert back.tokens.tolist() == before.tokens.tolist()
            assert back.versions.tolist() == [2] * len(back.tokens)
    finally:
        server.stop()
