"""One real vLLM engine (the tiny local model on CPU, or a GPU) shared by every test here,
and one with LoRA for the LoRA tests.

Starting vLLM takes 15-20 s on 2 cores (with LoRA 20-35 s), so the engines are
session-scoped (`vllm_engine` and `vllm_lora_engine`, in `tests/conftest.py`, shared with
the engine conformance suite); the `engine` and `lora_engine` fixtures hand them to each test
with the original weights and version 0 restored (and, with LoRA, no adapter), so tests do not
depend on each other's order. Tests that kill the engine use `engine_to_kill` and run last;
the LoRA engine is closed before them. The references of the LoRA parity tests (`lora_cases`:
a fresh engine per model) are computed once, for the in-process and the server tests. The
random-weight Qwen3 model with the real tokenizer (`qwen3_model`) has one in-process engine too
(`qwen3_engine`), for the chat and the agent endpoint tests.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import pytest_asyncio

from asyncroll.engines import VLLMEngine
from tests.chat.qwen3_model import build_tiny_qwen3
from tests.conftest import VLLM_DEADLINE_S, VLLM_MAX_MODEL_LEN, closing_first

if TYPE_CHECKING:
    from tests.vllm.test_lora_parity import Case

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
    the tests that close or kill a shared engine after every other test (`closing_order`)."""
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
    items.sort(key=closing_order)


def closing_order(item: pytest.Item) -> int:
    """0 for every test but those that end a shared engine: the test that closes the LoRA
    engine (the conformance suite's closed-engine test) runs after every other, then those
    that kill the plain one (`engine_to_kill`)."""
    if "engine_to_kill" in getattr(item, "fixturenames", ()):
        return 2
    return 1 if item.get_closest_marker("closes_the_lora_engine") else 0


@pytest_asyncio.fixture
async def engine(vllm_engine: VLLMEngine, tiny_model: Path) -> AsyncIterator[VLLMEngine]:
    yield vllm_engine
    if vllm_engine.version != 0:  # a test loaded other weights: put the originals back
        await vllm_engine.update_weights(original_weights(tiny_model), version=0)


# The last adapter id each LoRA engine had registered when `lora_engine` handed it out: tests
# count the ids vLLM's workers hold from there (`test_lora_parity.lora_ids`).
LORA_ID_BASE: weakref.WeakKeyDictionary[VLLMEngine, int] = weakref.WeakKeyDictionary()


@pytest_asyncio.fixture
async def lora_engine(vllm_lora_engine: VLLMEngine, tiny_model: Path) -> VLLMEngine:
    """The session's LoRA engine serving the original weights at version 0, no adapter
    loaded: what an earlier test left ends with a full update (a second or so)."""
    engine = vllm_lora_engine
    if engine._paused:  # an earlier test failed between a pause and its resume
        await engine.resume_generation()
    # Always: a test may have left other base weights at version 0 (the LoRA demo's model).
    await engine.update_weights(original_weights(tiny_model), version=0)
    LORA_ID_BASE[engine] = engine._adapters._serial
    return engine


@pytest_asyncio.fixture(scope="session")
async def lora_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    """`test_lora_parity`'s cases (tied and untied, each with its fresh engine's reference),
    made once for the in-process and the server LoRA parity tests."""
    from tests.vllm.test_lora_parity import make_cases

    return await make_cases(tmp_path_factory.mktemp("lora-parity"))


QWEN3_MAX_LEN = 2048  # a few chat turns of 64 tokens with Qwen3's template around them


@pytest.fixture(scope="session")
def qwen3_model() -> Path:
    return build_tiny_qwen3()


@pytest_asyncio.fixture(scope="session")
async def qwen3_engine(qwen3_model: Path) -> AsyncIterator[VLLMEngine]:
    """The session's in-process engine on `qwen3_model` (its tests never change its weights)."""
    engine = VLLMEngine(qwen3_model, max_model_len=QWEN3_MAX_LEN, dtype="float32", seed=0)
    closing_first.append(engine)
    try:
        yield engine
    finally:
        await asyncio.wait_for(engine.close(), DEADLINE_S)


@pytest_asyncio.fixture
async def engine_to_kill(vllm_engine: VLLMEngine) -> VLLMEngine:
    """The session's engine, the only one left running in this process: its death is
    looked for among this process's engine cores."""
    for shared in closing_first:
        await asyncio.wait_for(shared.close(), DEADLINE_S)
    return vllm_engine


def original_weights(model: Path) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    return list(load_file(model / "model.safetensors").items())
