"""One real vLLM engine (the tiny local model on CPU, or a GPU) shared by every test here.

Starting vLLM takes 15-20 s on 2 cores, so the engine is session-scoped (`vllm_engine`, in
`tests/conftest.py`, shared with the engine conformance suite); the `engine` fixture
hands it to each test with the original weights and version 0 restored afterwards, so tests do
not depend on each other's order. Tests that kill the engine use `engine_to_kill` and run last.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from asyncroll.engines.vllm import VLLMEngine
from tests.conftest import VLLM_DEADLINE_S, VLLM_MAX_MODEL_LEN

try:
    import vllm  # noqa: F401
except Exception as exc:  # missing, or broken (e.g. a CUDA torchvision next to the CPU torch)
    VLLM_MISSING: str | None = f"vllm is not importable: {type(exc).__name__}: {exc}"
else:
    VLLM_MISSING = None

MAX_MODEL_LEN = VLLM_MAX_MODEL_LEN
DEADLINE_S = VLLM_DEADLINE_S


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: `-m "not vllm"` leaves all of these out
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test here `vllm`; skip them without vLLM, and GPU tests without CUDA; run
    the tests that kill the shared engine after every other test."""
    here = Path(__file__).parent
    ours = [item for item in items if item.path.is_relative_to(here)]
    for item in ours:
        item.add_marker(pytest.mark.vllm)
    if VLLM_MISSING is not None:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=VLLM_MISSING))
        return
    import torch

    if not torch.cuda.is_available():
        for item in ours:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
    items.sort(key=lambda item: "engine_to_kill" in getattr(item, "fixturenames", ()))


@pytest_asyncio.fixture
async def engine(vllm_engine: VLLMEngine, tiny_model: Path) -> AsyncIterator[VLLMEngine]:
    yield vllm_engine
    if vllm_engine.version != 0:  # a test loaded other weights: put the originals back
        await vllm_engine.update_weights(original_weights(tiny_model), version=0)


@pytest_asyncio.fixture
async def engine_to_kill(vllm_engine: VLLMEngine) -> VLLMEngine:
    return vllm_engine


def original_weights(model: Path) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    return list(load_file(model / "model.safetensors").items())
