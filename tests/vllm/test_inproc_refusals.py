"""In-process updates that must be refused, or must not strand a request, without ever
killing or poisoning the engine: a tensor of the wrong shape, an adapter on the embedding or
the output head, one adapter slot under steady traffic, a request started during a
full-weight update; and rsLoRA served at alpha / sqrt(rank).

The LoRA cases share one engine with a single adapter slot (`LoraSlots(slots=1)`), the
setting where an adapter update must unload the policy itself to make room.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import pytest_asyncio

from asyncroll.engines import SampleOutput, VLLMEngine
from asyncroll.engines.vllm.weight_check import WeightLayoutError
from asyncroll.lora import LoraAdapter, LoraConfig, LoraError, LoraSlots
from tests.vllm.conftest import DEADLINE_S, MAX_MODEL_LEN, original_weights
from tests.vllm.helpers import ids, request
from tests.vllm.test_lora_parity import CONFIG, differs, lora_ids, random_adapter
from tests.vllm.test_weight_parity import perturbed, serve

PROMPT = ids(0, 9, 8, 7)
Q = "model.layers.0.self_attn.q_proj.weight"


async def greedy(engine: VLLMEngine, tag: str, steps: int = 8) -> SampleOutput:
    async with asyncio.timeout(DEADLINE_S):
        (out,) = await engine.generate(request(tag, PROMPT, 1, steps, temperature=0.0))
    return out


async def test_a_wrong_shape_update_is_refused_and_the_engine_serves_on(
    engine: VLLMEngine, tiny_model: Path
) -> None:
    """vLLM's reload takes a wrong shape by resizing the parameter, then fails, and every
    later update fails the same way: the engine never served again. Refused before vLLM sees
    it, naming the tensor; the engine serves on, and an honest update then succeeds."""
    before = await greedy(engine, "shape-before")
    bad = [(n, t[:64] if n == Q else t) for n, t in original_weights(tiny_model)]
    with pytest.raises(WeightLayoutError, match=rf"{Q} has shape \(64, 128\); .* \(128, 128\)"):
        await engine.update_weights(bad, version=1)
    assert engine.version == 0
    again = await greedy(engine, "shape-before")
    assert again.tokens.tolist() == before.tokens.tolist()
    await engine.update_weights(perturbed(tiny_model), version=1)
    after = await greedy(engine, "shape-after")
    assert after.versions.tolist() == [1] * 8


@pytest_asyncio.fixture(scope="module")
async def one_slot(tiny_model: Path) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(
        tiny_model,
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        lora=LoraSlots(max_rank=8, slots=1),
        control_timeout_s=30.0,  # an update starved of its slot fails within the test
    )
    try:
        yield engine
    finally:
        await asyncio.wait_for(engine.close(), DEADLINE_S)


def adapter(tiny_model: Path, seed: int, config: LoraConfig = CONFIG) -> LoraAdapter:
    return random_adapter(dict(original_weights(tiny_model)), seed, config)


async def test_rslora_serves_alpha_over_the_square_root_of_the_rank(
    one_slot: VLLMEngine, tiny_model: Path
) -> None:
    """rsLoRA at rank 4, alpha 2 (scale 1) serves what the same A and B serve as plain LoRA
    at alpha 4 (scale 1), which `test_lora_parity` proves equal to the merged weights; plain
    LoRA at alpha 2 (scale 0.5) serves something else."""
    rs = adapter(tiny_model, 7, msgspec.structs.replace(CONFIG, rank=4, alpha=2.0, use_rslora=True))
    plain = LoraConfig(rank=4, alpha=4.0, target_modules=CONFIG.target_modules)
    served = []
    lower = msgspec.structs.replace(plain, alpha=2.0)
    for version, config in ((1, rs.config), (2, plain), (3, lower)):
        await one_slot.update_weights(LoraAdapter(config, rs.tensors), version=version)
        served.append(await serve(one_slot, "rslora"))
    for out, ref in zip(served[0], served[1], strict=True):
        assert out.tokens.tolist() == ref.tokens.tolist()
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-4)
        assert out.versions.tolist() == [1] * len(out.tokens)
    assert differs(served[0], served[2])


async def test_one_slot_adapter_update_under_steady_traffic(
    one_slot: VLLMEngine, tiny_model: Path
) -> None:
    """With one slot the adapter to unload is the policy itself. Requests that keep starting
    used to bind to it, so it never became unused and the update timed out. They now wait for
    the new adapter: the update completes, and every request runs under one adapter."""
    await one_slot.update_weights(adapter(tiny_model, 8), version=10)
    outputs: list[SampleOutput] = []
    stop, newer = asyncio.Event(), asyncio.Event()

    async def traffic(lane: int) -> None:
        serial = 0
        while not stop.is_set():
            serial += 1
            rid = f"lane{lane}-{serial}"
            (out,) = await one_slot.generate(request(rid, PROMPT, 1, 24, temperature=1.0, seed=1))
            outputs.append(out)
            if out.versions[0] == 11:
                newer.set()

    async with asyncio.timeout(4 * DEADLINE_S), asyncio.TaskGroup() as lanes:
        for lane in range(3):
            lanes.create_task(traffic(lane))
        await one_slot.wait_progress(lambda: len(one_slot._live) == 3, DEADLINE_S)
        await one_slot.update_weights(adapter(tiny_model, 9), version=11)
        await newer.wait()
        stop.set()
    for out in outputs:  # one adapter per request
        assert len(set(out.versions.tolist())) == 1, out.versions
    assert {int(out.versions[0]) for out in outputs} == {10, 11}
    assert len(await lora_ids(one_slot)) == 1


async def test_a_request_started_during_a_full_update_runs_on_the_new_weights(
    one_slot: VLLMEngine, tiny_model: Path
) -> None:
    """vLLM's reload drops every adapter in the workers. A request that started between the
    pause and the load used to bind to the outgoing adapter; on resume a worker tried to load
    it from its unreadable path and the engine core died. It now starts on the base weights,
    and runs on the new ones: the same tokens as a request started after the update."""
    await one_slot.update_weights(adapter(tiny_model, 10), version=20)
    load = one_slot._load_checked
    started: list[asyncio.Future[Any]] = []

    async def load_with_requests_arriving(named: Any) -> None:
        started.extend(asyncio.ensure_future(greedy(one_slot, f"midway-{i}")) for i in range(4))
        # Yield (no clock) until each is in vLLM's front end: paused, nothing else runs.
        while one_slot.running_requests < 4:  # noqa: ASYNC110
            await asyncio.sleep(0)
        await load(named)

    patched: Callable[[Any], Awaitable[None]] = load_with_requests_arriving
    one_slot._load_checked = patched  # type: ignore[method-assign]
    try:
        async with asyncio.timeout(DEADLINE_S):
            await one_slot.update_weights(original_weights(tiny_model), version=21)
    finally:
        del one_slot._load_checked  # the class's method again
    midway = await asyncio.gather(*started)
    after = await greedy(one_slot, "after")
    for out in midway:
        assert out.finish_reason == "length"
        assert out.versions.tolist() == [21] * 8
        assert out.tokens.tolist() == after.tokens.tolist()
    assert await lora_ids(one_slot) == [[]]


@pytest.mark.parametrize("module", ["model.embed_tokens", "lm_head"])
async def test_an_embedding_or_head_adapter_is_refused_and_the_engine_serves_on(
    one_slot: VLLMEngine, tiny_model: Path, module: str
) -> None:
    """An adapter on the embedding (or the tied output head), in asyncroll's layout, passed
    every check and its first request killed vLLM (an embedding LoRA is another format to
    vLLM). Refused with `LoraError` naming it; the engine serves on."""
    vocab, hidden = dict(original_weights(tiny_model))["model.embed_tokens.weight"].shape
    base = {f"{module}.weight": np.zeros((vocab, hidden), dtype=np.float32)}
    import torch

    leaf = module.rsplit(".", 1)[-1]
    config = LoraConfig(rank=8, alpha=16.0, target_modules=(leaf,))
    bad = random_adapter({k: torch.from_numpy(v) for k, v in base.items()}, 11, config)
    before = one_slot.version
    with pytest.raises(LoraError, match=f"targets {module}, an embedding or the output head"):
        await one_slot.update_weights(bad, version=before + 1)
    assert one_slot.version == before
    out = await greedy(one_slot, f"after-{leaf}")
    assert out.versions.tolist() == [before] * 8


@pytest.mark.parametrize(
    ("kwargs", "env", "match"),
    [
        ({"data_parallel_size": 2}, {}, "run one `vllm serve` replica per rank"),
        ({}, {"VLLM_RELOAD_MODE": "direct"}, "unset VLLM_RELOAD_MODE"),
        ({"trainer_headroom_bytes": 1 << 30}, {}, "are for GPUs"),
    ],
    ids=["data-parallel", "direct-reload", "headroom-on-cpu"],
)
def test_settings_that_would_silence_a_check_are_refused_before_vllm_starts(
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    kwargs: dict[str, Any],
    env: dict[str, str],
    match: str,
) -> None:
    """In process, vLLM returns the weight reports of its first data-parallel engine core
    only, and its direct reload reports no unloaded layer: with either, an update that
    missed weights would pass. Both are refused before any vLLM process starts (no engine
    here: a start takes 15-20 s), as are GPU headrooms on a CPU build."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        VLLMEngine(tiny_model, **kwargs)
