import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from asyncroll.app.models import build_tiny_model
from asyncroll.engines import VLLMEngine
from asyncroll.lora import LoraSlots
from asyncroll.types import RolloutGroup
from tests.factories import make_group
from tests.vllm.server import (  # noqa: F401
    server_engine,
    server_model,
    server_weights_dir,
    vllm_server,
)

# Under `pytest -n` (pytest-xdist with `--dist loadgroup`: the Makefile's test command) each
# worker starts the session engines its own tests ask for. Lanes keep the tests that share
# session engines on one worker each, so each engine starts once a run: the in-process engines
# (plain and LoRA, and the LoRA parity references) in one lane, the session's `vllm serve` in
# another, the Qwen3 model's in a third; the modules that start engines of their own, the
# benchmark smoke runs and the rest of the suite fill in beside them. A module whose tests use
# both the server and the plain in-process engine is split between their lanes (its costly
# module fixtures are made once a run: `tests/made_once.py`).
LORA_FIXTURES = frozenset({"vllm_lora_engine", "lora_engine", "lora_cases"})
IN_PROCESS_FIXTURES = frozenset({"vllm_engine", "engine", "engine_to_kill"})
SERVER_FIXTURES = frozenset({"vllm_server", "server_engine", "server_weights_dir"})
QWEN3_FIXTURES = frozenset({"qwen3_model", "qwen3_engine"})
# The two lanes a module may be split between, test by test (`pytest_collection_modifyitems`).
SPLIT_LANES = frozenset({"in-process", "serve"})
# The demos train for minutes on the plain in-process engine and use no other session engine:
# a lane of their own, at the cost of one more start of that engine (~25 s), takes ~250 s of
# tests off the in-process lane, which otherwise ran on alone at the end of the run.
DEMO_MODULES = frozenset(
    {"vllm/test_demo.py", "vllm/test_demo_chat.py", "vllm/test_demo_openai.py",
     "vllm/test_getting_started.py"}
)  # fmt: skip


def lane(fixtures: set[str], params: set[str]) -> str | None:
    """The lane of a module whose tests use `fixtures` and the engine-kind parameters `params`
    (the conformance suite looks its engines up at run time). A module that uses both kinds
    goes where its costliest fixture lives: the LoRA references, then the server (an
    in-process engine starts in a third of a server's time)."""
    if fixtures & LORA_FIXTURES:
        return "in-process"
    if fixtures & SERVER_FIXTURES or "server" in params:
        return "serve"
    if fixtures & IN_PROCESS_FIXTURES or "vllm" in params:
        return "in-process"
    if fixtures & QWEN3_FIXTURES:
        return "qwen3"
    return None


def engine_uses(item: pytest.Item) -> tuple[set[str], set[str]]:
    """The fixtures and the parameter values of `item` that may name a session engine. A
    module's own fixture of the same name (an `engine` on another model) shadows the
    session's: it does not tie the test to a lane."""
    own = vars(getattr(item, "module", None) or object)
    fixtures = {n for n in getattr(item, "fixturenames", ()) if n not in own}
    callspec = getattr(item, "callspec", None)
    params = set(map(str, callspec.params.values())) if callspec is not None else set()
    return fixtures, params


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks into its work units
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put each module that uses a session engine in its lane, except its tests that use only
    the plain in-process engine where the module's lane is the server's (they go to the
    in-process lane) and its tests that use only the server where the module's lane is the
    in-process one (they go to the server's lane), so that the plain engine and the session's
    `vllm serve` start once each (not once more for the other lane).
    Keep every other module under tests/vllm (and the benchmark smoke runs) together, so that
    a module's own engines and subprocesses start once; the rest is spread test by test."""
    modules: dict[Path, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    here = Path(__file__).parent
    for path, module_items in modules.items():
        if any(item.get_closest_marker("xdist_group") for item in module_items):
            continue  # the module chose its group itself
        uses = [engine_uses(item) for item in module_items]
        group = lane(set().union(*(f for f, _ in uses)), set().union(*(p for _, p in uses)))
        if group == "in-process" and path.relative_to(here).as_posix() in DEMO_MODULES:
            group = "demos"
        if group is None and (
            path.is_relative_to(here / "vllm") or path.name == "test_benchmarks.py"
        ):
            group = path.stem
        if group is None:
            continue
        for item, (fixtures, params) in zip(module_items, uses, strict=True):
            own = lane(fixtures, params) if group in SPLIT_LANES else None
            item.add_marker(pytest.mark.xdist_group(own if own in SPLIT_LANES else group))


VLLM_MAX_MODEL_LEN = 256
VLLM_DEADLINE_S = 60.0  # for any single wait on vLLM in tests; generation takes well under 5 s


@pytest.fixture
def group() -> RolloutGroup:
    return make_group()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_tiny_model()


# The session's LoRA engine: the largest rank and the most slots any LoRA test asks for (the
# producer test: a slot per update in flight).
LORA_SLOTS = LoraSlots(max_rank=8, slots=4)
closing_first: list[VLLMEngine] = []  # shared engines `engine_to_kill` closes before its test


@pytest_asyncio.fixture(scope="session")
async def vllm_lora_engine(tiny_model: Path) -> AsyncIterator[VLLMEngine]:
    """The session's in-process engine with LoRA (`LORA_SLOTS`) on the tied tiny model, for
    tests/vllm's LoRA tests; then the engine that the conformance suite's closed-engine test
    closes (marked `closes_the_lora_engine`: it runs after every test that uses it), so that
    closing costs no engine start of its own. Here, not in tests/vllm/conftest.py, so that the
    conformance suite sees it."""
    engine = VLLMEngine(tiny_model, max_model_len=VLLM_MAX_MODEL_LEN, seed=0, lora=LORA_SLOTS)
    closing_first.append(engine)
    try:
        yield engine
    finally:
        await asyncio.wait_for(engine.close(), VLLM_DEADLINE_S)


@pytest_asyncio.fixture(scope="session")
async def vllm_engine(tiny_model: Path) -> AsyncIterator[VLLMEngine]:
    """The one real vLLM engine of a test session (each start costs 15-20 s on 2 cores),
    shared by `tests/vllm` and the engine conformance suite."""
    engine = VLLMEngine(tiny_model, max_model_len=VLLM_MAX_MODEL_LEN, dtype="float32", seed=0)
    try:
        yield engine
    finally:
        await asyncio.wait_for(engine.close(), VLLM_DEADLINE_S)
