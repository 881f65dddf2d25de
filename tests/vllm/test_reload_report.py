"""What vLLM says while it reloads weights. Its "<Layer>: Failed to load weights" warning came
on every update for two layers that never get a tensor (the rotary cache, computed; the output
layer tied to the embedding, refreshed by the worker extension): those are silenced. A tensor
the trainer's weights really lack fails the update, naming it (both engines load through the
same worker code; `VLLMServerEngine`'s side is in test_verify_weights.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from asyncroll.engines import VLLMEngine
from asyncroll.engines.vllm.weight_check import WeightMismatchError
from tests.vllm.conftest import DEADLINE_S, original_weights
from tests.vllm.helpers import ids, request


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "asyncroll.engines.vllm.engine" and r.levelno == level
    ]


async def test_a_full_update_warns_about_nothing(
    engine: VLLMEngine, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="asyncroll")
    await engine.update_weights(original_weights(tiny_model), version=1)
    assert messages(caplog, logging.WARNING) == []
    (expected,) = messages(caplog, logging.DEBUG)
    assert "RotaryEmbedding" in expected and "ParallelLMHead" in expected


async def test_a_tensor_missing_from_the_weights_fails_the_update(
    engine: VLLMEngine, tiny_model: Path
) -> None:
    """Before, a warning: the layer kept its old weights and the tokens carried the new label.
    Now the update fails naming the tensor and the layer, and the engine generates nothing
    until an update succeeds."""
    weights = [(n, t) for n, t in original_weights(tiny_model) if "layers.1.mlp.down_proj" not in n]
    with pytest.raises(WeightMismatchError) as caught:
        await engine.update_weights(weights, version=1)
    assert "model.layers.1.mlp.down_proj.weight" in str(caught.value)
    assert "RowParallelLinear" in str(caught.value)
    assert engine.version == 0
    with pytest.raises(WeightMismatchError, match="update the weights again"):
        await engine.generate(request("refused", ids(0, 5, 6), max_new_tokens=2))
    await engine.update_weights(original_weights(tiny_model), version=1)
    async with asyncio.timeout(DEADLINE_S):
        (out,) = await engine.generate(request("served", ids(0, 5, 6), max_new_tokens=2))
    assert out.versions.tolist() == [1, 1]
