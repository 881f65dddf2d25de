"""What vLLM says while it reloads weights. Its "<Layer>: Failed to load weights" warning came
on every update for two layers that never get a tensor (the rotary cache, computed; the output
layer tied to the embedding, refreshed by the worker extension): those are silenced. A layer the
trainer's weights really lack is reported as a WARNING in the trainer's process."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from asyncroll.engines.vllm import VLLMEngine
from tests.vllm.conftest import original_weights


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "asyncroll.engines.vllm" and r.levelno == level
    ]


async def test_a_full_update_warns_about_nothing(
    engine: VLLMEngine, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="asyncroll")
    await engine.update_weights(original_weights(tiny_model), version=1)
    assert messages(caplog, logging.WARNING) == []
    (expected,) = messages(caplog, logging.DEBUG)
    assert "RotaryEmbedding" in expected and "ParallelLMHead" in expected


async def test_a_layer_missing_from_the_weights_is_a_warning(
    engine: VLLMEngine, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="asyncroll")
    weights = [(n, t) for n, t in original_weights(tiny_model) if "layers.1.mlp.down_proj" not in n]
    await engine.update_weights(weights, version=1)
    (warning,) = messages(caplog, logging.WARNING)
    assert "RowParallelLinear" in warning and "lack them or name them differently" in warning
