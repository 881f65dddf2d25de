"""Weight parity, for every engine: after `update_weights`, an engine serves exactly what a
FRESH vLLM engine started on a folder holding the same weights serves. Token for token,
logprobs within 1e-4, every token labelled with the update's version.

Every tensor is perturbed: the embedding (tied to the output head in one model, separate in
the other), q/k/v and gate/up (which vLLM packs into one parameter each and the CPU backend
repacks for its kernels), o/down, the norms, and (in the untied model) every bias. A path that
misses any of them (the tied head's repacked copy was one) serves other tokens.

The reference is a fresh in-process `VLLMEngine` for both engine kinds: the server runs the
same vLLM code, and its requests carry the same per-request seeds (the sampled case uses a
continued sample, whose request id is the same in both engines). References are computed one
engine at a time, before the engines under test start, once a run: the in-process tests run on
the in-process engine's xdist worker, the server tests on the server's, and whichever comes
first writes the perturbed models and their references for both (`made_once`).
"""

from __future__ import annotations

import asyncio
import pickle
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from asyncroll.app.models import build_tiny_model
from asyncroll.engines import SampleOutput, VLLMEngine
from asyncroll.engines.base import Engine
from asyncroll.engines.server.launch import ServerProcess
from asyncroll.engines.vllm.weights_file import write_safetensors
from tests.made_once import made_once
from tests.vllm.conftest import DEADLINE_S, MAX_MODEL_LEN, original_weights
from tests.vllm.helpers import ids, request
from tests.vllm.server import server_engine_on

VERSION = 3
STEPS = 16
PROMPTS = [ids(0, 5, 6, 7), ids(0, 100, 200), ids(0, 1, 2, 3, 4, 5, 6, 7, 8), ids(0, 42)]
SAMPLED_PROMPT, SAMPLED_PREFIX = ids(0, 17, 18, 19), ids(33, 34)
UNTIED: dict[str, Any] = {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}


@dataclass(frozen=True)
class Case:
    """One model: its original folder, every tensor perturbed, and what a fresh engine on
    the perturbed weights serves."""

    model: Path
    weights: list[tuple[str, Any]]
    reference: list[SampleOutput]


def perturbed(model: Path) -> list[tuple[str, Any]]:
    """Every tensor of `model` plus seeded noise (norms and biases included)."""
    import torch

    noise = torch.Generator().manual_seed(7)
    return [
        (name, t + 0.05 * torch.randn(t.shape, generator=noise))
        for name, t in original_weights(model)
    ]


async def serve(engine: Engine, tag: str) -> list[SampleOutput]:
    """Greedy continuations of `PROMPTS` and one seeded sampled continuation (the last; its
    seed derives from its request id, so compared outputs must come from the same `tag`)."""
    requests = [request(f"{tag}-{i}", p, 1, STEPS, temperature=0.0) for i, p in enumerate(PROMPTS)]
    requests.append(
        request(f"{tag}-s", SAMPLED_PROMPT, 1, STEPS, prefixes=[SAMPLED_PREFIX], temperature=1.0,
                seed=11)
    )  # fmt: skip
    async with asyncio.timeout(DEADLINE_S):
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
    return [out for (out,) in results]


def assert_parity(served: list[SampleOutput], reference: list[SampleOutput]) -> None:
    for i, (out, ref) in enumerate(zip(served, reference, strict=True)):
        assert out.tokens.tolist() == ref.tokens.tolist(), f"request {i}: other tokens"
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-4, err_msg=f"request {i}")
        assert out.versions.tolist() == [VERSION] * STEPS, f"request {i}: labels"


REFERENCE = "reference.pickle"


async def make_case(model: Path, folder: Path) -> None:
    """Write the perturbed weights next to a copy of `model`'s config and tokenizer, and
    record what a fresh engine on them serves."""
    shutil.copytree(model, folder)
    write_safetensors(perturbed(model), folder / "model.safetensors")
    async with VLLMEngine(folder, max_model_len=MAX_MODEL_LEN, seed=0) as fresh:
        await fresh.update_weights(None, version=VERSION)  # labels only: nothing is loaded
        reference = await serve(fresh, "parity")
    (folder / REFERENCE).write_bytes(pickle.dumps(reference))


def load_case(model: Path, folder: Path) -> Case:
    """A case `make_case` wrote: the weights the fresh engine loaded, and what it served."""
    reference = pickle.loads((folder / REFERENCE).read_bytes())  # this run's own file
    return Case(model, original_weights(folder), reference)


@pytest_asyncio.fixture(scope="module")
async def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    """The tied model (the session engines') and an untied one with biases."""
    root = await made_once(tmp_path_factory, "weight-parity", make_cases)
    return {name: load_case(model, root / name) for name, model in case_models().items()}


def case_models() -> dict[str, Path]:
    """The tied model (the session engines') and an untied one with biases."""
    return {"tied": build_tiny_model(), "untied": build_tiny_model(**UNTIED)}


async def make_cases(root: Path) -> None:
    """Every case under `root` (once a run: `made_once(..., "weight-parity", make_cases)`;
    tests/vllm/test_ranks_vllm.py reads them too)."""
    for name, model in case_models().items():
        await make_case(model, root / name)


def test_every_tensor_is_perturbed(cases: dict[str, Case]) -> None:
    """Or the parity tests would prove nothing about the tensors left alone."""
    names = {}
    for key, case in cases.items():
        for (name, new), (_, old) in zip(case.weights, original_weights(case.model), strict=True):
            assert not np.allclose(new.numpy(), old.numpy()), f"{key}: {name}"
        names[key] = {n for n, _ in case.weights}
    assert "lm_head.weight" not in names["tied"] and "lm_head.weight" in names["untied"]
    assert {"model.layers.0.self_attn.k_proj.bias", "model.layers.1.mlp.up_proj.bias"} < names[
        "untied"
    ]


async def check_engine(engine: Engine, case: Case) -> None:
    before = await serve(engine, "before")
    assert any(
        a.tokens.tolist() != b.tokens.tolist() for a, b in zip(before, case.reference, strict=True)
    )
    await engine.update_weights(case.weights, version=VERSION)
    assert_parity(await serve(engine, "parity"), case.reference)  # the same ids: seeds


@pytest_asyncio.fixture
async def untied_engine(cases: dict[str, Case]) -> AsyncIterator[VLLMEngine]:
    async with VLLMEngine(cases["untied"].model, max_model_len=MAX_MODEL_LEN, seed=0) as engine:
        yield engine


async def test_in_process_untied(untied_engine: VLLMEngine, cases: dict[str, Case]) -> None:
    await check_engine(untied_engine, cases["untied"])


async def test_server_untied(cases: dict[str, Case], tmp_path: Path) -> None:
    server = ServerProcess.start(cases["untied"].model, max_model_len=MAX_MODEL_LEN)
    try:
        async with server_engine_on(server.url, tmp_path) as engine:
            await check_engine(engine, cases["untied"])
    finally:
        server.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
async def test_in_process_tied(engine: VLLMEngine, cases: dict[str, Case], device: str) -> None:
    """`device="cuda"` sends CUDA tensors: the in-process CUDA IPC path."""
    case = cases["tied"]
    if device == "cuda":
        case = Case(case.model, [(n, t.cuda()) for n, t in case.weights], case.reference)
    await check_engine(engine, case)


@pytest.mark.gpu
async def test_server_nccl_tied(cases: dict[str, Case]) -> None:
    """Weights broadcast over NCCL (GPU only, skipped without CUDA: see test_server_nccl.py
    for why two GPUs). The server runs on GPU 1, this process (the trainer) on GPU 0."""
    import torch

    from asyncroll.engines import VLLMServerEngine
    from asyncroll.engines.server.launch import free_port
    from asyncroll.engines.server.nccl_transfer import NCCLWeightTransfer

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: NCCL refuses two ranks on one device")
    case = cases["tied"]
    server = ServerProcess.start(
        case.model,
        on_cpu=False,
        max_model_len=MAX_MODEL_LEN,
        extra_args=["--weight-transfer-config", '{"backend":"nccl"}'],
        env={"CUDA_VISIBLE_DEVICES": "1"},
    )
    sender = NCCLWeightTransfer("127.0.0.1", free_port(), timeout_s=120.0)
    try:
        async with VLLMServerEngine(
            server.url, vocab_size=512, control_timeout_s=60.0, weight_transfer=sender
        ) as engine:
            await check_engine(engine, Case(case.model, [(n, t.cuda()) for n, t in case.weights],
                                            case.reference))  # fmt: skip
    finally:
        server.stop()


async def test_server_tied(server_engine: Any, server_model: Path, cases: dict[str, Case]) -> None:
    """The session's server (the tied model with more positions: the same tensors)."""
    try:
        await check_engine(server_engine, cases["tied"])
    finally:
        await server_engine.update_weights(original_weights(server_model), version=0)
