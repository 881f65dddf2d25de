"""LoRA parity, in-process: after `update_weights(adapter)`, a `VLLMEngine` serves exactly what
a FRESH engine started on the base weights merged with that adapter serves. Token for token,
logprobs within 1e-4, every token labelled with the update's version, greedy and seeded.

Every targeted module (q/k/v and gate/up, which vLLM packs; o and down) of every layer gets
non-zero random A and B, on the tied tiny model and on an untied one with biases. References
are computed one engine at a time, before the engines under test start (one vLLM at a time).
The prompts, the sampled case and the comparison are `test_weight_parity`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncroll.app.models import build_tiny_model
from asyncroll.engines import SampleOutput, VLLMEngine
from asyncroll.engines.vllm.weights_file import write_safetensors
from asyncroll.lora import LoraAdapter, LoraConfig, LoraError, LoraSlots, merged_weights
from tests.vllm.conftest import DEADLINE_S, LORA_ID_BASE, MAX_MODEL_LEN, original_weights
from tests.vllm.helpers import ids, request
from tests.vllm.test_weight_parity import UNTIED, VERSION, assert_parity, serve

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG = LoraConfig(rank=8, alpha=16.0, target_modules=TARGETS)
SLOTS = LoraSlots(max_rank=8, slots=2)
# Under `pytest -n --dist loadgroup`: the worker that makes `lora_cases` (two engine starts)
# for test_server_lora too.
pytestmark = pytest.mark.xdist_group("lora_cases")


def random_adapter(base: Mapping[str, Any], seed: int, config: LoraConfig = CONFIG) -> LoraAdapter:
    """Non-zero A and B for every targeted linear of `base` (a zero B, PEFT's start, would
    prove nothing)."""
    import torch

    noise = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in config.target_modules:
            out_features, in_features = weight.shape
            a = 0.1 * torch.randn(config.rank, in_features, generator=noise)
            b = 0.1 * torch.randn(out_features, config.rank, generator=noise)
            tensors[f"{module}.lora_A.weight"] = a
            tensors[f"{module}.lora_B.weight"] = b
    return LoraAdapter(config, tensors)


@dataclass(frozen=True)
class Case:
    """One model: its folder, an adapter over every target, what a fresh engine on the merged
    weights serves."""

    model: Path
    adapter: LoraAdapter
    reference: list[SampleOutput]
    without_lora: str  # the error of an adapter sent to the reference engine (no LoRA)


async def make_case(model: Path, folder: Path) -> Case:
    """The reference engine is started without LoRA: an adapter sent to it must be refused
    before anything changes, and the reference is served after that refusal."""
    base = dict(original_weights(model))
    adapter = random_adapter(base, seed=5)
    shutil.copytree(model, folder)
    write_safetensors(list(merged_weights(base, adapter).items()), folder / "model.safetensors")
    async with VLLMEngine(folder, max_model_len=MAX_MODEL_LEN, seed=0) as fresh:
        await fresh.update_weights(None, version=VERSION)  # labels only: nothing is loaded
        with pytest.raises(LoraError) as refused:
            await fresh.update_weights(adapter, version=VERSION + 1)
        assert fresh.version == VERSION
        reference = await serve(fresh, "parity")
    return Case(model, adapter, reference, str(refused.value))


async def make_cases(root: Path) -> dict[str, Case]:
    """The tied model (the session engines') and an untied one with biases."""
    made = {}
    for name, overrides in (("tied", {}), ("untied", UNTIED)):
        made[name] = await make_case(build_tiny_model(**overrides), root / name)
    return made


@pytest.fixture(scope="module")
def cases(lora_cases: dict[str, Case]) -> dict[str, Case]:
    """Made once a session (`lora_cases`), for this module and `test_server_lora`."""
    return lora_cases


@pytest.fixture
def shared_lora_engine(request: pytest.FixtureRequest, name: str) -> VLLMEngine | None:
    """The session's LoRA engine (`lora_engine`) for the tied model, None for another (the
    test starts one of its own)."""
    return request.getfixturevalue("lora_engine") if name == "tied" else None


def lora_engine_on(
    shared: VLLMEngine | None, model: Path
) -> contextlib.AbstractAsyncContextManager[VLLMEngine]:
    if shared is not None:
        return contextlib.nullcontext(shared)
    return VLLMEngine(model, max_model_len=MAX_MODEL_LEN, seed=0, lora=SLOTS)


def test_engine_without_lora_refuses_an_adapter(cases: dict[str, Case]) -> None:
    """(The refusal happened in `make_case`, on the engine that then served the reference.)"""
    for case in cases.values():
        assert "started without LoRA" in case.without_lora
        assert "lora=LoraSlots(" in case.without_lora


def test_every_target_is_adapted(cases: dict[str, Case]) -> None:
    """7 modules x 2 layers, each with its A and B: the parity tests cover every target."""
    for case in cases.values():
        assert len(case.adapter.modules) == 14
        assert {m.rsplit(".", 1)[-1] for m in case.adapter.modules} == set(TARGETS)


async def lora_ids(engine: VLLMEngine) -> list[list[int]]:
    """The adapter ids each vLLM worker holds, counted from the test's start (the session's
    LoRA engine registered adapters for earlier tests: `LORA_ID_BASE`)."""
    rpc = engine._llm.collective_rpc("asyncroll_lora_ids")
    base = LORA_ID_BASE.get(engine, 0)
    return [[i - base for i in held] for held in await asyncio.wait_for(rpc, DEADLINE_S)]


@contextlib.contextmanager
def worker_calls(engine: VLLMEngine) -> Iterator[list[str]]:
    """The calls `engine` makes into vLLM's workers meanwhile (collective RPCs by method,
    and `remove_lora`), in order."""
    llm, calls = engine._llm, []
    rpc, remove = llm.collective_rpc, llm.remove_lora

    def spy_rpc(method: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(method)
        return rpc(method, *args, **kwargs)

    def spy_remove(lora_id: int) -> Any:
        calls.append("remove_lora")
        return remove(lora_id)

    llm.collective_rpc, llm.remove_lora = spy_rpc, spy_remove
    try:
        yield calls
    finally:
        del llm.collective_rpc, llm.remove_lora  # the class's methods again


def differs(a: list[SampleOutput], b: list[SampleOutput]) -> bool:
    return any(x.tokens.tolist() != y.tokens.tolist() for x, y in zip(a, b, strict=True))


def max_logprob_difference(a: list[SampleOutput], b: list[SampleOutput]) -> float:
    return max(float(np.abs(x.logprobs - y.logprobs).max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", ["tied", "untied"])
async def test_in_process_parity(
    cases: dict[str, Case], name: str, shared_lora_engine: VLLMEngine | None
) -> None:
    """Another adapter first, under the same version number: the second update must serve
    its own adapter, not a cached one of the same version (vLLM caches adapters by id and the
    prefix cache by name), and the first adapter is unloaded once unused."""
    case = cases[name]
    other = random_adapter(dict(original_weights(case.model)), seed=6)
    async with lora_engine_on(shared_lora_engine, case.model) as engine:
        assert differs(await serve(engine, "before"), case.reference)
        await engine.update_weights(other, version=VERSION)
        assert differs(await serve(engine, "parity"), case.reference)  # the same ids: seeds
        with worker_calls(engine) as calls:
            await engine.update_weights(case.adapter, version=VERSION)
        # With a slot free, one call into vLLM: each waits for the engine's step under way,
        # which while requests generate is up to a LoRA prefill step (0.4-2 s on the 98M
        # model); the registration checks the adapter itself. Then "other", retired and
        # unused, is unloaded.
        assert calls == ["asyncroll_add_lora", "remove_lora"]
        served = await serve(engine, "parity")
        difference = max_logprob_difference(served, case.reference)
        print(f"{name}: max |logprob - reference| = {difference:.3g}")
        assert_parity(served, case.reference)
        assert await lora_ids(engine) == [[2]]  # the first adapter, unused, was unloaded
        await check_bad_adapters(engine, case)


async def check_bad_adapters(engine: VLLMEngine, case: Case) -> None:
    """A rank above the engine's max, modules the model lacks (a leaf it has no LoRA layer
    for; a layer index beyond its layers): `LoraError` naming it, nothing loaded, the version
    unchanged, and the engine still serves the adapter it had."""
    base = dict(original_weights(case.model))
    too_big = random_adapter(base, 1, LoraConfig(rank=16, alpha=16.0, target_modules=TARGETS))
    q = "model.layers.0.self_attn.q_proj"
    a, b = case.adapter.tensors[f"{q}.lora_A.weight"], case.adapter.tensors[f"{q}.lora_B.weight"]
    layer9 = "model.layers.9.self_attn.q_proj"
    no_layer = LoraAdapter(CONFIG, {f"{layer9}.lora_A.weight": a, f"{layer9}.lora_B.weight": b})
    narrow = LoraAdapter(CONFIG, {f"{q}.lora_A.weight": a[:, :64], f"{q}.lora_B.weight": b})
    no_leaf = LoraAdapter(
        LoraConfig(rank=8, alpha=16.0, target_modules=("qkv",)),
        {"model.layers.0.self_attn.qkv.lora_A.weight": a,
         "model.layers.0.self_attn.qkv.lora_B.weight": b},
    )  # fmt: skip
    for adapter, words in (
        (too_big, "rank 16 is above the engine's max_rank 8"),
        (no_layer, "no LoRA layer model.layers.9.self_attn.q_proj"),
        (no_leaf, "no LoRA layer model.layers.0.self_attn.qkv "),
        (narrow, r"q_proj maps 64 -> 128 features, but .* has shape \(128, 128\)"),
    ):
        with pytest.raises(LoraError, match=words):
            await engine.update_weights(adapter, version=VERSION + 1)
        assert engine.version == VERSION
    assert await lora_ids(engine) == [[2]]
    assert_parity(await serve(engine, "parity"), case.reference)


LONG = 64
PROMPT = ids(0, 9, 8, 7)


async def test_requests_keep_the_adapter_they_started_with(
    cases: dict[str, Case], lora_engine: VLLMEngine
) -> None:
    """vLLM binds an adapter to a request for its life, so the labels follow the request:
    frozen across an update (keep mode), a request finishes under its adapter, every token
    labelled with its version; aborted (abort mode), its tokens keep their version and its
    continuation runs under the new adapter. The old adapter is unloaded once unused."""
    case = cases["tied"]
    first = random_adapter(dict(original_weights(case.model)), seed=6)
    greedy = {"temperature": 0.0}
    engine = lora_engine  # the tied model's
    await engine.update_weights(first, version=1)
    async with asyncio.timeout(4 * DEADLINE_S):  # three requests and an update
        (alone,) = await engine.generate(request("alone", PROMPT, 1, LONG, **greedy))
        cut = asyncio.ensure_future(engine.generate(request("cut", PROMPT, 1, LONG, **greedy)))
        await engine.wait_progress(lambda: engine.samples_started("cut") > 0, DEADLINE_S)
        await engine.abort("cut")
        (aborted,) = await cut
        kept = asyncio.ensure_future(engine.generate(request("kept", PROMPT, 1, LONG, **greedy)))
        await engine.wait_progress(lambda: engine.samples_started("kept") > 0, DEADLINE_S)
        await engine.pause_generation()
        await engine.update_weights(case.adapter, version=VERSION)
        await engine.resume_generation()
        (frozen,) = await kept
        continued = request("cont", PROMPT, 1, 8, prefixes=[aborted.tokens], **greedy)
        (after,) = await engine.generate(continued)
    assert alone.versions.tolist() == [1] * LONG
    n = len(aborted.tokens)
    assert aborted.finish_reason == "abort" or n == LONG
    assert aborted.tokens.tolist() == alone.tokens[:n].tolist()
    assert aborted.versions.tolist() == [1] * n
    assert frozen.tokens.tolist() == alone.tokens.tolist()  # all of it under the first
    assert frozen.versions.tolist() == [1] * LONG
    assert after.versions.tolist() == [VERSION] * 8
    assert_parity(await serve(engine, "parity"), case.reference)
    assert await lora_ids(engine) == [[2]]
