"""`VLLMServerEngine` on the session's real `vllm serve` (the tiny model on CPU): what the
conformance suite does not cover. Weights reach the server through the shared folder, and a
request made while the engine is paused is held here, never sent to the paused server (which
would queue it and run it later on whatever weights it then has)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from asyncroll.engines import VLLMServerEngine
from asyncroll.engines.server.launch import ServerProcess
from tests.vllm.conftest import DEADLINE_S, original_weights
from tests.vllm.helpers import ids, request

PROMPT = ids(0, 17, 18, 19, 20)


def changed_weights(model: Path) -> list[tuple[str, object]]:
    """The original weights with the final norm negated: greedy samples change completely."""
    return [(n, -t if n == "model.norm.weight" else t) for n, t in original_weights(model)]


async def greedy(engine: VLLMServerEngine, rid: str) -> np.ndarray:
    (out,) = await engine.generate(request(rid, PROMPT, max_new_tokens=12, temperature=0.0))
    assert out.finish_reason == "length"
    return out.tokens


async def tracked_by_server(url: str) -> int:
    """How many requests the server's front end tracks, read by aborting all of them (the
    count is exact and immediate, unlike /metrics)."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/abort_requests", json={}) as reply,
    ):
        assert reply.status == 200
        return int((await reply.json())["aborted"])


async def test_request_made_while_paused_is_held_and_runs_on_the_new_weights(
    server_engine: VLLMServerEngine, vllm_server: ServerProcess, server_model: Path
) -> None:
    engine = server_engine
    before = await greedy(engine, "before-update")
    # Forget what earlier tests left tracked: vLLM 0.32 keeps the parent entry of an aborted
    # n > 1 request until everything is aborted (measured; the requests themselves are gone).
    await tracked_by_server(vllm_server.url)
    try:
        await engine.pause_generation()
        try:
            task = asyncio.ensure_future(
                engine.generate(request("while-paused", PROMPT, max_new_tokens=12, temperature=0.0))
            )
            await engine.wait_held(1, DEADLINE_S)
            assert await tracked_by_server(vllm_server.url) == 0  # nothing reached the server
            await engine.update_weights(changed_weights(server_model), version=1)
        finally:
            await engine.resume_generation()
        async with asyncio.timeout(DEADLINE_S):
            (held,) = await task
        assert (held.finish_reason, len(held.tokens)) == ("length", 12)
        assert (held.versions == 1).all()
        after = await greedy(engine, "after-update")
        assert not np.array_equal(after, before)  # the new weights serve
        assert np.array_equal(held.tokens, after)  # and served the held request, all of it
        assert len(list(engine.weights_dir.iterdir())) == 1  # type: ignore[union-attr]
    finally:
        await engine.update_weights(original_weights(server_model), version=0)
    assert np.array_equal(await greedy(engine, "restored"), before)
    assert len(list(engine.weights_dir.iterdir())) == 1  # type: ignore[union-attr]


async def weight_label(url: str) -> object:
    """The server's weight version label, as the engine reads it before an NCCL broadcast."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/weight_info") as reply:
        assert reply.status == 200
        return (await reply.json())["weight_version"]


async def test_update_from_a_path_the_trainer_wrote(
    server_engine: VLLMServerEngine,
    vllm_server: ServerProcess,
    server_model: Path,
    tmp_path: Path,
) -> None:
    """The trainer writes the checkpoint folder itself; a folder without safetensors is refused
    before vLLM sees it (a failed reload kills a vLLM engine). The label the engine set is
    what `/weight_info` reports (the engine finds a restarted replica by it)."""
    from safetensors.torch import save_file

    engine = server_engine
    before = await greedy(engine, "path-before")
    with pytest.raises(ValueError, match="safetensors"):
        await engine.update_weights_from_path(tmp_path / "missing", version=4)
    save_file(dict(changed_weights(server_model)), str(tmp_path / "model.safetensors"))  # type: ignore[arg-type]
    try:
        await engine.update_weights_from_path(tmp_path, version=4)
        (out,) = await engine.generate(
            request("path-after", PROMPT, max_new_tokens=12, temperature=0.0)
        )
        assert (out.versions == 4).all() and not np.array_equal(out.tokens, before)
        assert await weight_label(vllm_server.url) == "4"
    finally:
        await engine.update_weights(original_weights(server_model), version=0)


async def test_many_first_requests_at_once_wait_for_the_replica_sync(
    vllm_server: ServerProcess, server_weights_dir: Path
) -> None:
    """A fresh engine's first requests arrive together (a producer admits many groups at once):
    all wait for the one sync of the replica instead of finding no replica up."""
    from tests.vllm.server import server_engine_on

    engine = server_engine_on(vllm_server.url, server_weights_dir)
    try:
        async with asyncio.timeout(DEADLINE_S):
            results = await asyncio.gather(
                *(
                    engine.generate(request(f"first{i}-0", PROMPT, n=2, max_new_tokens=4))
                    for i in range(16)
                )
            )
        assert all(o.finish_reason == "length" and len(o.tokens) == 4 for r in results for o in r)
    finally:
        await engine.close()
