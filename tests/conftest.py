import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from asyncroll.app.models import build_tiny_model
from asyncroll.engines import VLLMEngine
from asyncroll.types import RolloutGroup
from tests.factories import make_group
from tests.vllm.server import (  # noqa: F401
    server_engine,
    server_model,
    server_weights_dir,
    vllm_server,
)

VLLM_MAX_MODEL_LEN = 256
VLLM_DEADLINE_S = 60.0  # for any single wait on vLLM in tests; generation takes well under 5 s


@pytest.fixture
def group() -> RolloutGroup:
    return make_group()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_tiny_model()


@pytest_asyncio.fixture(scope="session")
async def vllm_engine(tiny_model: Path) -> AsyncIterator[VLLMEngine]:
    """The one real vLLM engine of a test session (each start costs 15-20 s on 2 cores),
    shared by `tests/vllm` and the engine conformance suite."""
    engine = VLLMEngine(tiny_model, max_model_len=VLLM_MAX_MODEL_LEN, dtype="float32", seed=0)
    try:
        yield engine
    finally:
        await asyncio.wait_for(engine.close(), VLLM_DEADLINE_S)
