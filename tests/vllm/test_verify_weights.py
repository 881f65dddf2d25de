"""`verify_weights`: after an update, each engine (each replica) is checked to serve what was
sent, and refuses to label otherwise; the error names the replica and the tensor. Real vLLM:
the session's in-process engine and the session's `vllm serve` (the tied tiny model)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from asyncroll.engines import VLLMEngine, VLLMServerEngine
from asyncroll.engines.server.launch import ServerProcess
from asyncroll.engines.vllm import weight_check
from asyncroll.engines.vllm.weights_file import write_safetensors
from tests.vllm.conftest import DEADLINE_S
from tests.vllm.helpers import ids, request
from tests.vllm.server import restore_session_server, server_engine_on
from tests.vllm.test_weight_parity import perturbed

LEFT_OUT = "model.layers.0.self_attn.k_proj.weight"  # packed into qkv_proj with q and v


async def test_in_process_verified_update(engine: VLLMEngine, tiny_model: Path) -> None:
    """A full update passes the check (no false alarm from packed, repacked or tied layers);
    one that leaves out k (its layer still gets q and v: vLLM raises nothing) fails naming it."""
    engine.verify_weights = True
    try:
        await engine.update_weights(perturbed(tiny_model), version=1)
        partial = [(n, t) for n, t in perturbed(tiny_model) if n != LEFT_OUT]
        with pytest.raises(weight_check.WeightMismatchError, match=LEFT_OUT):
            await engine.update_weights(partial, version=2)
        assert engine.version == 1
    finally:
        engine.verify_weights = False


@pytest_asyncio.fixture
async def verified(
    vllm_server: ServerProcess, server_weights_dir: Path, server_model: Path
) -> AsyncIterator[VLLMServerEngine]:
    """An engine with `verify_weights` on the session's server; the server gets its original
    weights and label 0 back afterwards (the session's engine expects them)."""
    async with server_engine_on(vllm_server.url, server_weights_dir, verify_weights=True) as engine:
        yield engine
    await restore_session_server(vllm_server, server_weights_dir, server_model)


async def test_server_verified_update_and_a_replica_that_misses_a_tensor(
    verified: VLLMServerEngine, server_model: Path, vllm_server: ServerProcess
) -> None:
    await verified.update_weights(perturbed(server_model), version=1)
    (out,) = await verified.generate(request("verified", ids(0, 5, 6), max_new_tokens=3))
    assert out.versions.tolist() == [1, 1, 1]

    partial = [(n, t) for n, t in perturbed(server_model) if n != LEFT_OUT]
    # Refused before anything is written (the served layout lacks nothing the update has,
    # the update lacks k): the weights are wrong, not the engine dead (as in process).
    with pytest.raises(weight_check.WeightMismatchError) as caught:
        await verified.update_weights(partial, version=2)
    assert vllm_server.url in str(caught.value) and LEFT_OUT in str(caught.value)
    assert verified.version == 1
    # the replica is re-synced to version 1's weights and serves them again
    async with asyncio.timeout(DEADLINE_S):
        (out,) = await verified.generate(request("after", ids(0, 5, 6), max_new_tokens=3))
    assert out.versions.tolist() == [1, 1, 1]


async def test_the_served_value_check_finds_issue_24s_stale_tied_head(
    verified: VLLMServerEngine, server_model: Path, vllm_server: ServerProcess, tmp_path: Path
) -> None:
    """vLLM's own `reload_weights` (the server path before the fix) leaves the tied head's
    repacked copy at the old embedding. Every parameter's bytes are new (vLLM's checksums
    would pass); the head's kernel, run on a probe, is not."""
    await verified.update_weights(None, version=1)  # syncs the replica to this engine
    write_safetensors(perturbed(server_model), tmp_path / "model.safetensors")

    async def rpc(method: str, kwargs: dict[str, object]) -> list[object]:
        body = {"method": method, "kwargs": kwargs}
        async with (
            asyncio.timeout(DEADLINE_S),
            aiohttp.ClientSession() as http,
            http.post(f"{vllm_server.url}/collective_rpc", json=body) as reply,
        ):
            assert reply.status == 200, await reply.text()
            return list((await reply.json())["results"])

    await rpc("reload_weights", {"weights_path": str(tmp_path)})
    reports = await rpc("asyncroll_verify_path", {"path": str(tmp_path)})
    with pytest.raises(weight_check.WeightMismatchError) as caught:
        weight_check.check(reports, weight_check.digests(perturbed(server_model)), "replica")
    message = str(caught.value)
    assert "not served as sent: model.embed_tokens.weight (output off by" in message
    assert "other bytes" not in message and "layers" not in message  # only the head
