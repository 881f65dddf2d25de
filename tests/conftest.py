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

# Under `pytest -n` (pytest-xdist with `--dist loadgroup`: the Makefile's test command) each
# worker starts the session engines its own tests ask for. Every module that uses a session
# engine (in process or `vllm serve`) runs on one worker, so each engine starts once per run;
# the modules that start engines of their own, the benchmark smoke runs and the rest of the
# suite fill the other workers.
SESSION_ENGINE_FIXTURES = frozenset(
    {
        "vllm_engine",
        "engine",
        "vllm_lora_engine",
        "lora_engine",
        "lora_cases",
        "engine_to_kill",
        "vllm_server",
        "server_engine",
        "server_weights_dir",
    }
)
ENGINE_KIND_PARAMS = frozenset({"vllm", "server"})  # conformance: engines looked up at run time


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks into its work units
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group each module's tests for xdist: every module that uses a session engine in one
    group, each other module under tests/vllm (and the benchmark smoke runs) in its own, so a
    module's own engines and subprocesses start once; the rest is spread test by test."""
    modules: dict[Path, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    here = Path(__file__).parent
    for path, module_items in modules.items():
        if any(item.get_closest_marker("xdist_group") for item in module_items):
            continue  # the module chose its group itself
        uses_session_engine = any(
            SESSION_ENGINE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
            or ENGINE_KIND_PARAMS.intersection(map(str, _params(item)))
            for item in module_items
        )
        if uses_session_engine:
            group = "session-engines"
        elif path.is_relative_to(here / "vllm") or path.name == "test_benchmarks.py":
            group = path.stem
        else:
            continue
        for item in module_items:
            item.add_marker(pytest.mark.xdist_group(group))


def _params(item: pytest.Item) -> list[object]:
    callspec = getattr(item, "callspec", None)
    return list(callspec.params.values()) if callspec is not None else []


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
