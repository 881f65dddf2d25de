"""LoRA adapters over HTTP: `VLLMServerEngine` on a real `vllm serve` started with LoRA.

Parity (the team's rule for every weight path): with every lora_A and lora_B of every
targeted module non-zero random, what the server serves under the adapter equals what a FRESH
in-process `VLLMEngine` serves on `merged_weights(base, adapter)`: tokens exact, logprobs
within 1e-4, every token labelled with the update's version; greedy and seeded sampling; the
tied tiny model and the untied one with biases. The adapter that serves is the second of two
(v1 then v2: the later one serves, not the first one still loaded beside it).

Bad input raises `LoraError`, leaves the version unchanged and every replica serving: a
server started without LoRA, a rank above the server's `--max-lora-rank` (vLLM's loader
refuses it), a module the model lacks and a shape it does not have (vLLM's loader takes both;
the workers' check refuses them before any request names the adapter). A replica that comes
back with a smaller `--max-lora-rank` than the adapter that became the policy meanwhile
fails its re-sync's check: that replica's failure, not a `LoraError`.

The adapters, the reference cases and their prompts are the in-process parity test's
(`test_lora_parity`, `test_weight_parity`). References are computed before any server
starts, one engine at a time; each server is started once (30-60 s here) and stopped by its
process group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from asyncroll import Producer, SamplingConfig
from asyncroll.engines import SampleOutput, VLLMServerEngine
from asyncroll.engines.server.launch import ServerProcess
from asyncroll.engines.server.replicas import ReplicaState
from asyncroll.lora import LoraAdapter, LoraConfig, LoraError, LoraSlots
from tests.stubs import served
from tests.test_server_lora_control import LoraStub
from tests.vllm.conftest import DEADLINE_S, MAX_MODEL_LEN, original_weights
from tests.vllm.server import server_engine_on
from tests.vllm.test_lora_parity import CONFIG, TARGETS, Case, random_adapter
from tests.vllm.test_weight_parity import STEPS, VERSION, assert_parity, serve

pytestmark = pytest.mark.slow

SLOTS = LoraSlots(max_rank=CONFIG.rank)


@pytest.fixture(scope="module")
def cases(lora_cases: dict[str, Case]) -> dict[str, Case]:
    """`test_lora_parity`'s, made once a session."""
    return lora_cases


def other_adapter(model: Path, seed: int, config: LoraConfig = CONFIG) -> LoraAdapter:
    return random_adapter(dict(original_weights(model)), seed, config)


def test_every_targeted_module_has_a_nonzero_adapter(cases: dict[str, Case]) -> None:
    """Or parity would prove nothing about the modules left alone."""
    for key, case in cases.items():
        modules = {m.rsplit(".", 1)[-1] for m in case.adapter.modules}
        assert modules == set(TARGETS), key
        assert len(case.adapter.modules) == 2 * len(TARGETS), key  # both layers
        for name, t in case.adapter.tensors.items():
            assert bool((t != 0).all()), f"{key}: {name}"


@contextlib.contextmanager
def lora_server(model: Path) -> Iterator[ServerProcess]:
    server = ServerProcess.start(model, max_model_len=MAX_MODEL_LEN, lora=SLOTS)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tied_server(cases: dict[str, Case]) -> Iterator[ServerProcess]:
    """The tied model served with LoRA (after the references: one vLLM at a time)."""
    with lora_server(cases["tied"].model) as server:
        yield server


def lora_engine(url: str, weights_dir: Path, **kwargs: object) -> VLLMServerEngine:
    return server_engine_on(url, weights_dir, lora=SLOTS, **kwargs)


async def adapters_on(url: str) -> set[str]:
    """The adapter names the server's API knows (`/v1/models` lists them with a parent)."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/v1/models") as reply:
        assert reply.status == 200
        cards = (await reply.json())["data"]
    return {c["id"] for c in cards if c.get("parent")}


def names_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def differs(served: list[SampleOutput], reference: list[SampleOutput]) -> bool:
    return any(
        a.tokens.tolist() != b.tokens.tolist() for a, b in zip(served, reference, strict=True)
    )


async def check_v1_then_v2(engine: VLLMServerEngine, case: Case, url: str) -> None:
    """Base, then adapter v1, then the case's adapter as v2: v2 serves (parity), v1 is
    unloaded from the server and its folder deleted (no request uses it any more)."""
    known = await adapters_on(url)  # an earlier engine's, on a shared server
    assert differs(await serve(engine, "before"), case.reference)
    await engine.update_weights(other_adapter(case.model, seed=6), version=VERSION - 1)
    first = await serve(engine, "v1")
    assert all(out.versions.tolist() == [VERSION - 1] * STEPS for out in first)
    assert differs(first, case.reference)
    (v1,) = await adapters_on(url) - known
    await engine.update_weights(case.adapter, version=VERSION)
    served = await serve(engine, "parity")  # the reference's request ids: the same seeds
    gap = max(
        float(abs(a.logprobs - b.logprobs).max())
        for a, b in zip(served, case.reference, strict=True)
        if a.tokens.tolist() == b.tokens.tolist()
    )
    print(f"{case.model.name}: max |logprob - reference| = {gap:.2e}")
    assert_parity(served, case.reference)
    assert engine.version == VERSION
    await engine._lora.settled()  # the unload of v1, started when its last request ended
    (v2,) = await adapters_on(url) - known
    assert v2 != v1
    assert names_in(engine.weights_dir) == [v2]  # type: ignore[arg-type]


async def test_a_server_started_without_lora_refuses_it_and_keeps_serving(
    server_model: Path, tmp_path: Path, vllm_server: ServerProcess
) -> None:
    """An engine built for LoRA on a server started without it (the session's: the tied
    model with more positions): `LoraError` naming what to start the server with, the version
    unchanged, the replica serving the base weights. The adapter is one of its own on the
    server's model (no LoRA references: this test runs in the server's lane, where the session's
    `vllm serve` already runs, rather than starting it again in the LoRA references' lane)."""
    async with lora_engine(vllm_server.url, tmp_path) as engine:
        before = await serve(engine, "before")
        with pytest.raises(LoraError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
            await engine.update_weights(other_adapter(server_model, seed=5), version=VERSION)
        assert engine.version == 0
        assert engine.replicas[0].state is ReplicaState.UP
        after = await serve(engine, "before")
        assert [o.tokens.tolist() for o in after] == [o.tokens.tolist() for o in before]
        assert all((o.versions == 0).all() for o in after)
        await engine._lora.settled()
        assert names_in(tmp_path) == []  # the adapter's folder is gone


async def test_untied_v1_then_v2_serves_v2_as_merged_weights(
    cases: dict[str, Case], tmp_path: Path
) -> None:
    """Its own server, before the tied one starts (one vLLM of this module at a time)."""
    with lora_server(cases["untied"].model) as server:
        async with lora_engine(server.url, tmp_path) as engine:
            await check_v1_then_v2(engine, cases["untied"], server.url)


async def test_tied_v1_then_v2_serves_v2_as_merged_weights(
    tied_server: ServerProcess, cases: dict[str, Case], tmp_path: Path
) -> None:
    async with lora_engine(tied_server.url, tmp_path) as engine:
        await check_v1_then_v2(engine, cases["tied"], tied_server.url)


async def test_bad_adapters_are_refused_and_the_replica_keeps_serving(
    tied_server: ServerProcess, cases: dict[str, Case], tmp_path: Path
) -> None:
    """Each is the caller's fault (`LoraError` naming it), not the replica's: it stays in the
    rotation serving the adapter it had, and nothing of the refused ones stays loaded. The
    engine allows rank 16 here, the server only 8: vLLM's loader refuses it. A layer the
    model lacks and a narrower q_proj pass vLLM's loader (the first would be ignored, the
    second kill the engine at its first step): the workers' check refuses them."""
    model = cases["tied"].model
    q, q9 = "model.layers.0.self_attn.q_proj", "model.layers.9.self_attn.q_proj"
    a, b = (cases["tied"].adapter.tensors[f"{q}.lora_{x}.weight"] for x in "AB")
    bad = [
        (other_adapter(model, 1, LoraConfig(rank=16, alpha=16.0, target_modules=TARGETS)),
         "greater than max_lora_rank"),
        (LoraAdapter(CONFIG, {f"{q9}.lora_A.weight": a, f"{q9}.lora_B.weight": b}),
         f"no LoRA layer {q9}"),
        (LoraAdapter(CONFIG, {f"{q}.lora_A.weight": a[:, :64], f"{q}.lora_B.weight": b}),
         "q_proj maps 64 -> 128 features"),
    ]  # fmt: skip
    async with server_engine_on(tied_server.url, tmp_path, lora=LoraSlots(max_rank=16)) as engine:
        await engine.update_weights(other_adapter(model, 6), version=1)
        known = await adapters_on(tied_server.url)
        before = await serve(engine, "v1")
        for adapter, words in bad:
            with pytest.raises(LoraError, match=words):
                await engine.update_weights(adapter, version=2)
            assert engine.version == 1
            assert engine.replicas[0].state is ReplicaState.UP
        after = await serve(engine, "v1")
        assert [o.tokens.tolist() for o in after] == [o.tokens.tolist() for o in before]
        assert all((o.versions == 1).all() for o in after)
        await engine._lora.settled()
        assert await adapters_on(tied_server.url) == known
        assert len(names_in(tmp_path)) == 1  # v1's folder only


async def test_a_producer_updates_adapters_over_http_without_pausing(
    tied_server: ServerProcess, cases: dict[str, Case], tmp_path: Path
) -> None:
    """The engine says adapter updates need no producer pause: groups in flight run on
    through two adapter updates (none aborted), each sample's tokens carry the version of
    the adapter its requests were sent with (never decreasing), and later groups the new
    ones."""
    model = cases["tied"].model
    async with lora_engine(tied_server.url, tmp_path) as engine:
        producer = Producer(
            engine,
            [[0, 5 + i % 100, 6] for i in range(400)],
            lambda group: [0.0] * len(group.samples),
            sampling=SamplingConfig(max_new_tokens=32, ignore_eos=True),
            group_size=2,
            max_inflight_groups=4,
            batch_size=4,
        )
        async with producer:
            for expected in (1, 2):
                await engine.wait_progress(lambda: engine.running_requests > 0, DEADLINE_S)
                adapter = other_adapter(model, 10 + expected)
                assert await producer.update_weights(adapter) == expected
            seen: set[int] = set()
            while 2 not in seen:
                batch = await producer.produce_batch(timeout=DEADLINE_S)
                for group in batch.groups:
                    for sample in group.samples:
                        versions = np.asarray(sample.versions)
                        assert (np.diff(versions) >= 0).all()
                        seen.update(int(v) for v in versions)
            assert producer.progress.counters.aborted_groups == 0
        assert seen <= {0, 1, 2} and 2 in seen


async def test_a_replica_back_with_a_smaller_max_lora_rank_stays_out_of_the_rotation(
    tied_server: ServerProcess, cases: dict[str, Case], tmp_path: Path
) -> None:
    """A rank-16 adapter became the policy while the real replica was out of the rotation
    (a scripted replica, `LoraStub`, served it); the real one is back, started with
    `--max-lora-rank 8`. Its re-sync's check (its workers over `/collective_rpc`) refuses the
    adapter: it stays out of the rotation, named, with nothing loaded, the version unchanged
    and nothing raised to the caller. Unchecked, vLLM's load route would have been the only
    guard (here it refuses too; a module the model lacks it would have taken). Last in the
    module: it leaves the server paused, as any replica whose re-sync failed."""
    model = cases["tied"].model
    wide = other_adapter(model, 1, LoraConfig(rank=16, alpha=16.0, target_modules=TARGETS))
    known = await adapters_on(tied_server.url)
    stub = LoraStub()
    async with (
        served([stub.app()]) as (stub_url,),
        server_engine_on(
            [stub_url, tied_server.url], tmp_path, lora=LoraSlots(max_rank=16)
        ) as engine,
    ):
        real = engine.replicas[1]
        real.mark_down("restarting", float("inf"))  # out of the rotation during the update
        await engine.update_weights(wide, version=1)
        (name,) = stub.adapters
        await engine.check_replicas()  # probes it now: the re-sync
        assert real.state is ReplicaState.DOWN
        error = real.error
        assert error is not None and error.startswith(f"replica {real.url}:")
        assert f"cannot serve the engine's adapter {name} (version 1)" in error
        assert "LoRA rank 16 is greater than max_lora_rank 8" in error
        assert await adapters_on(tied_server.url) == known
        assert engine.version == 1 and engine.replicas[0].state is ReplicaState.UP
