"""`VLLMServerEngine`'s LoRA control logic on scripted replicas (no vLLM; the real `vllm
serve` tests, parity included, are in tests/vllm/test_server_lora.py): which replica a failed
adapter load takes out, what a re-synced replica loads, which adapter and label a request
carries, and when an old adapter goes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

from asyncroll.engines import ReplicaError, VLLMServerEngine
from asyncroll.engines.server.launch import serve_args
from asyncroll.engines.server.lora import LOAD, UNLOAD
from asyncroll.engines.server.replicas import Replica, ReplicaState, pick
from asyncroll.lora import LoraAdapter, LoraConfig, LoraError, LoraSlots
from tests.test_server_engine import (
    GENERATE,
    LIVENESS,
    ScriptedStub,
    _choice,
    _request,
    _stream,
    scripted,
)


def written(folder: str) -> bool:
    return Path(folder, "adapter_model.safetensors").is_file()


def adapter(seed: int, rank: int = 4) -> LoraAdapter:
    noise = torch.Generator().manual_seed(seed)
    module = "model.layers.0.self_attn.q_proj"
    tensors = {
        f"{module}.lora_A.weight": torch.randn(rank, 16, generator=noise),
        f"{module}.lora_B.weight": torch.randn(16, rank, generator=noise),
    }
    return LoraAdapter(LoraConfig(rank=rank, alpha=8.0, target_modules=("q_proj",)), tensors)


class LoraStub(ScriptedStub):
    """A scripted replica with vLLM's adapter routes: `adapters` maps the names it loaded to
    their paths; a generate naming an adapter it does not know gets vLLM's 404; `refusal`,
    when set, is the 500 message every load gets (vLLM refusing the adapter); `problem` what
    its workers' check of an adapter reports ("": none), `checked` what they were asked to
    check; `models` lists the adapter each generate named (None: the base model). Without
    `lora_enabled` (no --enable-lora) the check and the load fail as vLLM's do; with
    `dies_at_check` the process goes away when its workers are asked to check an adapter
    (the connection is closed unanswered)."""

    def __init__(self) -> None:
        super().__init__()
        self.adapters: dict[str, str] = {}
        self.refusal: str | None = None
        self.problem = ""
        self.lora_enabled = True  # else its workers have no LoRA manager (no --enable-lora)
        self.dies_at_check = False
        self.checked: list[dict[str, Any]] = []
        self.models: list[str | None] = []

    def app(self) -> web.Application:
        app = super().app()

        async def load(request: web.Request) -> web.Response:
            body = await request.json()
            name = body["lora_name"]
            refusal = self.refusal
            if not self.lora_enabled:  # vLLM's LoRA model runner mixin
                refusal = "LoRA is not enabled. Use --enable-lora to enable LoRA."
            if refusal is not None:
                error = {"error": {"message": refusal, "code": 500}}
                return web.Response(status=500, text=json.dumps(error))
            if name in self.adapters:
                return web.Response(status=400, text=f"'{name}' has already been loaded.")
            assert written(body["lora_path"])
            self.adapters[name] = body["lora_path"]
            return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

        async def unload(request: web.Request) -> web.Response:
            name = (await request.json())["lora_name"]
            if self.adapters.pop(name, None) is None:
                return web.Response(status=404, text=f"'{name}' cannot be found.")
            return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

        @web.middleware
        async def models(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.path == "/collective_rpc":
                body = await request.json()
                if body["method"] == "asyncroll_lora_problem":
                    if self.dies_at_check and request.transport is not None:
                        request.transport.close()
                        return web.Response()
                    if not self.lora_enabled:  # vLLM's answer to the workers' AttributeError
                        message = "'CPUModelRunner' object has no attribute 'lora_manager'"
                        return web.json_response({"error": {"message": message}}, status=500)
                    self.checked.append(body["kwargs"])
                    return web.json_response({"results": [self.problem]})
            if request.path == GENERATE:
                body = await request.json()
                if not body["request_id"].startswith(LIVENESS):
                    model = body.get("model")
                    self.models.append(model)
                    if model is not None and model not in self.adapters:
                        message = f"The model `{model}` does not exist."
                        return web.json_response({"error": {"message": message}}, status=404)
            return await handler(request)  # type: ignore[no-any-return]

        app.middlewares.append(models)
        app.router.add_post(LOAD, load)
        app.router.add_post(UNLOAD, unload)
        return app


def lora_scripted(
    count: int, weights_dir: Path, **kwargs: Any
) -> contextlib.AbstractAsyncContextManager[tuple[VLLMServerEngine, list[LoraStub]]]:
    return scripted(
        count, LoraStub, weights_dir=weights_dir, **{"lora": LoraSlots(max_rank=8), **kwargs}
    )


def folders(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


@pytest.mark.parametrize("failure", ["HTTP 500", "no reply within"])
async def test_a_replica_failing_its_adapter_load_leaves_the_rotation_named(
    tmp_path: Path, failure: str
) -> None:
    """Like a failed full-weight load: that replica is out (its error names it, the route
    and the failure: an error reply, or none within `control_timeout_s`), the update
    commits on the others, which serve the adapter; once it answers again its re-sync loads
    the adapter too."""
    deadline = {"control_timeout_s": 1.0} if failure == "no reply within" else {}
    async with lora_scripted(2, tmp_path, **deadline) as (engine, stubs):
        await engine.check_replicas()
        if failure == "HTTP 500":
            stubs[1].failing.add(LOAD)
        else:
            stubs[1].hang, stubs[1].hanging = asyncio.Event(), {LOAD}
        await engine.update_weights(adapter(1), version=1)
        assert engine.version == 1
        failed = engine.replicas[1]
        assert failed.state is ReplicaState.DOWN
        assert failed.error is not None and failed.url in failed.error and LOAD in failed.error
        assert failure in failed.error
        (name,) = stubs[0].adapters
        assert stubs[1].adapters == {}
        for k in range(6):
            (sample,) = await engine.generate(_request(f"run-{k}-0"))
            assert sample.versions.tolist() == [1, 1]
        assert stubs[0].models == [name] * 6 and stubs[1].models == []
        stubs[1].failing.clear()
        stubs[1].hanging.discard(LOAD)
        await engine.check_replicas()
        assert failed.state is ReplicaState.UP
        assert set(stubs[1].adapters) == {name} and stubs[1].label == "1"


async def test_a_replica_that_restarted_loses_the_rotation_and_its_resync_loads_the_adapter(
    tmp_path: Path,
) -> None:
    """A replica that restarted behind the engine's back knows no adapter: vLLM answers the
    request naming it with a 404, which is no bad request but a replica to re-sync (it
    stayed in the rotation, failing every request of its sessions). The re-sync loads the
    current adapter after the label."""
    async with lora_scripted(1, tmp_path) as (engine, (stub,)):
        await engine.update_weights(adapter(1), version=1)
        (name,) = stub.adapters
        stub.adapters.clear()
        stub.label = "default"  # a fresh process
        with pytest.raises(ReplicaError, match=f"does not know the adapter {name}"):
            await engine.generate(_request("run-0-0"))
        assert engine.replicas[0].state is ReplicaState.UNSYNCED
        (sample,) = await engine.generate(_request("run-1-0"))  # its route re-syncs it
        assert set(stub.adapters) == {name} and stub.label == "1"
        assert sample.versions.tolist() == [1, 1]
        assert stub.models == [name, name]


def restart(stub: LoraStub) -> None:
    """`stub`'s process restarted: no adapter, vLLM's initial label (and `calls` and
    `models` count from the restart on)."""
    stub.adapters.clear()
    stub.label = "default"
    stub.process += "+"  # a new process identity
    stub.calls.clear()
    stub.models.clear()


async def test_a_replica_restarted_before_its_adapter_load_never_serves_under_its_label(
    tmp_path: Path,
) -> None:
    """An adapter is trained on the engine's base weights (v1's here). A replica that
    restarted just before its adapter load serves the adapter over its own base weights: the
    label that followed named v2 on it. It leaves the rotation, and its re-sync loads v1's
    weights, the adapter, and the label."""
    async with lora_scripted(2, tmp_path) as (engine, stubs):
        await engine.update_weights([("w", torch.ones(2))], version=1)
        (v1,) = stubs[1].loaded
        stubs[1].hang, stubs[1].hanging = asyncio.Event(), {LOAD}
        update = asyncio.ensure_future(engine.update_weights(adapter(1), version=2))
        await stubs[1].progress.wait_until(lambda: LOAD in stubs[1].calls, 10.0)
        restart(stubs[1])  # the new process takes the adapter load
        stubs[1].hang.set()
        await asyncio.wait_for(update, 10.0)
        assert engine.replicas[1].state is not ReplicaState.UP
        await engine.check_replicas()
        assert engine.replicas[1].state is ReplicaState.UP
        assert stubs[1].loaded[-1] == v1 and stubs[1].label == "2" and stubs[1].adapters


def session_on(engine: VLLMServerEngine, replica: Replica) -> str:
    """A session the engine routes to `replica` while every replica is in the rotation."""
    return next(f"run-{k}" for k in range(1000) if pick(engine.replicas, f"run-{k}") is replica)


RESTARTS = {  # a replica restarted with other arguments, and what its refusal says
    "another model": ("problem", "the model has no LoRA layer model.layers.0.self_attn.q_proj"),
    "a smaller --max-lora-rank": ("problem", "LoRA rank 4 is greater than max_lora_rank 1."),
    "no --enable-lora": ("lora_enabled", "--enable-lora"),
    "a load vLLM refuses": ("refusal", "LoRA rank 4 is greater than max_lora_rank 1."),
}


@pytest.mark.parametrize("how", list(RESTARTS))
async def test_a_replica_restarted_unable_to_serve_the_adapter_stays_out_of_the_rotation(
    tmp_path: Path, how: str
) -> None:
    """At a re-sync the adapter is already the policy: a replica that restarted with other
    arguments and cannot serve it exactly fails its re-sync (that replica's failure, named,
    not the caller's `LoraError`), stays out of the rotation and never serves the adapter's
    label; the version stays, the other replica serves its sessions. Its workers check the
    adapter as at the first load (a module the model lacks was loaded unchecked, and served
    as another policy under the adapter's label)."""
    async with lora_scripted(2, tmp_path) as (engine, stubs):
        await engine.update_weights(adapter(1), version=1)
        (name,) = stubs[1].adapters
        restarted = engine.replicas[1]
        session = session_on(engine, restarted)
        restart(stubs[1])
        attribute, words = RESTARTS[how]
        setattr(stubs[1], attribute, False if attribute == "lora_enabled" else words)
        with pytest.raises(ReplicaError, match=f"does not know the adapter {name}"):
            await engine.generate(_request(f"{session}-0"))
        assert restarted.state is ReplicaState.UNSYNCED
        (sample,) = await engine.generate(_request(f"{session}-1"))  # its route re-syncs it
        assert sample.versions.tolist() == [1, 1]
        assert stubs[0].models == [name] and stubs[1].models == [name]  # the 404 only
        assert restarted.state is ReplicaState.DOWN
        error = restarted.error
        assert error is not None and error.startswith(f"replica {restarted.url}:")
        assert f"cannot serve the engine's adapter {name} (version 1)" in error
        assert words in error and "LoraError" not in error
        assert stubs[1].adapters == {}
        await engine.check_replicas()  # probed again: refused again, nothing raised
        assert restarted.state is ReplicaState.DOWN and stubs[1].adapters == {}
        assert engine.version == 1 and engine.replicas[0].state is ReplicaState.UP


@pytest.mark.parametrize("failure", ["no reply within", "ServerDisconnectedError"])
async def test_a_resync_whose_adapter_check_fails_is_that_replicas_failure(
    tmp_path: Path, failure: str
) -> None:
    """The re-sync's check hangs (bounded by `control_timeout_s`) or the replica dies while
    its workers check the adapter: that replica stays out, named, and the other replica
    serves meanwhile."""
    async with lora_scripted(2, tmp_path, control_timeout_s=1.0) as (engine, stubs):
        await engine.update_weights(adapter(1), version=1)
        (name,) = stubs[0].adapters
        up, restarted = engine.replicas
        session = session_on(engine, up)
        restart(stubs[1])
        restarted.mark_unsynced("restarted")
        if failure == "no reply within":
            stubs[1].hang, stubs[1].hanging = asyncio.Event(), {"/collective_rpc"}
        else:
            stubs[1].dies_at_check = True
        probe = asyncio.ensure_future(engine.check_replicas())
        await stubs[1].progress.wait_until(lambda: "/collective_rpc" in stubs[1].calls, 10.0)
        (sample,) = await engine.generate(_request(f"{session}-0"))
        assert sample.versions.tolist() == [1, 1] and stubs[0].models == [name]
        await asyncio.wait_for(probe, 10.0)
        assert restarted.state is ReplicaState.DOWN
        error = restarted.error
        assert error is not None and error.startswith(f"replica {restarted.url}:")
        assert failure in error and "/collective_rpc" in error
        assert stubs[1].adapters == {} and LOAD not in stubs[1].calls
        assert engine.version == 1 and up.state is ReplicaState.UP


async def test_an_adapter_update_cut_off_by_its_caller_leaves_nothing_of_it(
    tmp_path: Path,
) -> None:
    """The producer bounds `update_weights` by `update_timeout_s`. Wherever the cut lands
    (the label hangs here; on a busy machine it may land in the load), the version stays,
    the adapter is unloaded and its folder deleted, and the replica serves the old label
    with no adapter once its label answers again."""
    async with lora_scripted(1, tmp_path) as (engine, (stub,)):
        await engine.check_replicas()
        stub.hang, stub.hanging = asyncio.Event(), {"/update_weight_version"}
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(engine.update_weights(adapter(1), version=1), 1.0)
        assert engine.version == 0
        stub.hang.set()
        await engine._lora.settled()
        assert stub.adapters == {} and folders(tmp_path) == []
        (sample,) = await engine.generate(_request("run-0-0"))
        assert sample.versions.tolist() == [0, 0] and stub.label == "0"
        assert stub.models == [None]


async def test_a_request_keeps_its_adapter_and_label_across_an_update_then_it_is_unloaded(
    tmp_path: Path,
) -> None:
    """vLLM binds an adapter to a request for its life: one sent under v1 and kept in place
    across the update to v2 is sampled with v1's adapter to its end, so its tokens carry 1
    (the server's label says otherwise: "0" here). v1 stays loaded, and its folder on disk
    (vLLM reloads an evicted adapter from it), until that request ends; then both go."""
    async with lora_scripted(1, tmp_path) as (engine, (stub,)):
        await engine.update_weights(adapter(1), version=1)
        (v1,) = stub.adapters
        stub.hang, stub.hanging = asyncio.Event(), {GENERATE}
        call = asyncio.ensure_future(engine.generate(_request("run-0-0")))
        await engine.wait_progress(lambda: engine.replicas[0].streams == 1, 10.0)
        await engine.update_weights(adapter(2), version=2)
        (v2,) = set(stub.adapters) - {v1}
        assert folders(tmp_path) == sorted([v1, v2])  # v1 still used
        stub.hang.set()
        (kept,) = await asyncio.wait_for(call, 10.0)
        assert kept.versions.tolist() == [1, 1]
        (fresh,) = await engine.generate(_request("run-1-0"))
        assert fresh.versions.tolist() == [2, 2]
        assert stub.models == [v1, v2]
        await engine._lora.settled()
        assert set(stub.adapters) == {v2}
        assert folders(tmp_path) == [v2]
        assert stub.calls.count(UNLOAD) == 1
    assert folders(tmp_path) == []  # close deletes the current adapter's folder too


async def test_a_request_on_the_base_weights_kept_across_an_adapter_update_keeps_their_label(
    tmp_path: Path,
) -> None:
    """Sent before the first adapter and kept in place across its update, a request goes on
    sampling with the base weights, which the servers label with the adapter's version from
    the update on ("1" here): those tokens are the base weights' (0)."""
    async with lora_scripted(1, tmp_path) as (engine, (stub,)):
        await engine.check_replicas()
        stub.hang, stub.hanging = asyncio.Event(), {GENERATE}
        call = asyncio.ensure_future(engine.generate(_request("run-0-0")))
        await engine.wait_progress(lambda: engine.replicas[0].streams == 1, 10.0)
        await engine.update_weights(adapter(1), version=1)
        stub.stream = _stream(_choice([7, 8], spans=[("0", 0, 1), ("1", 1, 2)]))
        stub.hang.set()
        (kept,) = await asyncio.wait_for(call, 10.0)
        assert kept.versions.tolist() == [0, 0]
        (fresh,) = await engine.generate(_request("run-1-0"))
        assert fresh.versions.tolist() == [1, 1]  # sent with the adapter
        assert stub.models[0] is None and stub.models[1] is not None


@pytest.mark.parametrize(
    "refusal",
    [
        "LoRA rank 16 is greater than max_lora_rank 8.",
        "While loading /x, expected target modules in {'qkv_proj'} but received ['model.w'].",
        "LoRA is not enabled. Use --enable-lora to enable LoRA.",
    ],
)
async def test_an_adapter_vllm_refuses_is_a_lora_error_and_leaves_nothing_loaded(
    tmp_path: Path, refusal: str
) -> None:
    """The adapter's fault, not the replicas': `LoraError`, the version unchanged, every
    replica in the rotation, and the adapter unloaded from the replica that took it."""
    async with lora_scripted(2, tmp_path) as (engine, stubs):
        await engine.check_replicas()
        stubs[1].refusal = refusal
        with pytest.raises(LoraError, match="vLLM refused the adapter"):
            await engine.update_weights(adapter(1), version=1)
        assert engine.version == 0
        assert [r.state for r in engine.replicas] == [ReplicaState.UP] * 2
        await engine._lora.settled()
        assert stubs[0].adapters == {} and folders(tmp_path) == []
        assert [s.label for s in stubs] == ["0", "0"]
        (sample,) = await engine.generate(_request("run-0-0"))
        assert sample.versions.tolist() == [0, 0]
        assert stubs[0].models + stubs[1].models == [None]


async def test_an_adapter_the_workers_refuse_is_a_lora_error_before_any_request_names_it(
    tmp_path: Path,
) -> None:
    """vLLM's loader takes a module the model lacks (ignored: another policy) or of another
    shape (its step would fail, killing the engine): each replica's workers check the loaded
    adapter against the model before it is committed; a problem is `LoraError`, and the
    adapter is unloaded from every replica that had loaded it."""
    async with lora_scripted(2, tmp_path) as (engine, stubs):
        await engine.check_replicas()
        stubs[1].problem = "the model has no LoRA layer model.layers.9.self_attn.q_proj"
        with pytest.raises(LoraError, match=f"{stubs[1].problem}"):
            await engine.update_weights(adapter(1), version=1)
        assert engine.version == 0
        assert [r.state for r in engine.replicas] == [ReplicaState.UP] * 2
        assert stubs[0].checked == stubs[1].checked
        (checked,) = stubs[0].checked
        assert checked["modules"] == {"model.layers.0.self_attn.q_proj": [16, 16]}
        assert checked["config"]["r"] == 4 and checked["config"]["lora_alpha"] == 8.0
        await engine._lora.settled()
        assert stubs[0].adapters == stubs[1].adapters == {} and folders(tmp_path) == []
        (sample,) = await engine.generate(_request("run-0-0"))
        assert sample.versions.tolist() == [0, 0]
        assert stubs[0].models + stubs[1].models == [None]


async def test_a_replica_started_without_lora_is_a_lora_error_naming_the_flags(
    tmp_path: Path,
) -> None:
    async with lora_scripted(2, tmp_path) as (engine, stubs):
        await engine.check_replicas()
        stubs[1].lora_enabled = False
        with pytest.raises(LoraError, match="--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
            await engine.update_weights(adapter(1), version=1)
        assert engine.version == 0 and LOAD not in stubs[1].calls
        assert [r.state for r in engine.replicas] == [ReplicaState.UP] * 2


async def test_adapters_the_engine_can_refuse_are_refused_before_anything_is_sent(
    tmp_path: Path,
) -> None:
    async with lora_scripted(1, tmp_path, lora=None) as (engine, (stub,)):
        with pytest.raises(LoraError, match="started without LoRA: start it with lora="):
            await engine.update_weights(adapter(1), version=1)
    async with lora_scripted(1, tmp_path) as (engine, (stub,)):
        with pytest.raises(LoraError, match="rank 16 is above the engine's max_rank 8"):
            await engine.update_weights(adapter(1, rank=16), version=1)
        assert engine.version == 0 and LOAD not in stub.calls and folders(tmp_path) == []
    async with lora_scripted(1, None) as (engine, (stub,)):  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="needs weights_dir"):
            await engine.update_weights(adapter(1), version=1)


async def test_new_full_weights_abort_the_requests_sent_with_an_adapter_first(
    tmp_path: Path,
) -> None:
    """An adapter over base weights it was not trained on is a policy no version names: a
    request kept in place with it is aborted before the new weights load (as `VLLMEngine`
    does), and its tokens so far keep the adapter's version."""
    async with lora_scripted(1, tmp_path) as (engine, (stub,)):
        await engine.update_weights(adapter(1), version=1)
        stub.hang, stub.hanging = asyncio.Event(), {GENERATE}
        call = asyncio.ensure_future(engine.generate(_request("run-0-0")))
        await engine.wait_progress(lambda: engine.replicas[0].streams == 1, 10.0)
        await engine.update_weights([("model.norm.weight", torch.ones(16))], version=2)
        after = stub.calls[stub.calls.index(GENERATE) :]
        assert "/abort_requests" in after
        assert after.index("/abort_requests") < after.index("/collective_rpc")
        stub.hang.set()
        (kept,) = await asyncio.wait_for(call, 10.0)
        # the stub had not answered it (it hangs before its reply): aborted with no token;
        # any token it has keeps the adapter's version
        assert kept.finish_reason == "abort"
        assert set(kept.versions.tolist()) <= {1}


async def test_full_weights_after_an_adapter_serve_without_it(tmp_path: Path) -> None:
    """A full-weight update makes the new weights the policy: later requests name no
    adapter, and the adapter is unloaded."""
    async with lora_scripted(1, tmp_path) as (engine, (stub,)):
        await engine.update_weights(adapter(1), version=1)
        await engine.update_weights([("model.norm.weight", torch.ones(16))], version=2)
        (sample,) = await engine.generate(_request("run-0-0"))
        assert sample.versions.tolist() == [0, 0]  # the server's label (scripted: "0")
        await engine._lora.settled()
        assert stub.models == [None] and stub.adapters == {}


def test_serve_args_start_a_replica_with_the_engines_lora_slots() -> None:
    args = serve_args("/m", 8000, lora=LoraSlots(max_rank=16, slots=3))
    i = args.index("--enable-lora")
    assert args[i : i + 5] == ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "16"]
    assert "--enable-lora" not in serve_args("/m", 8000)


def test_a_producer_skips_its_pause_for_adapters_and_checks_the_slots() -> None:
    """Adapter updates need no producer pause here (requests keep their adapter), and the
    replicas' slots must hold every version `max_staleness` lets run."""
    from asyncroll import Producer

    plain = VLLMServerEngine("http://127.0.0.1:1", vocab_size=512)
    assert plain.adapter_slots is None
    engine = VLLMServerEngine("http://127.0.0.1:1", vocab_size=512, lora=LoraSlots(slots=2))
    assert engine.adapter_slots == 2
    with pytest.raises(ValueError, match=r"registers 2 LoRA adapters: .*LoraSlots\(slots=3\)"):
        Producer(engine, [[1, 2]], lambda s: 0.0, group_size=2, batch_size=1, max_staleness=2)
    Producer(engine, [[1, 2]], lambda s: 0.0, group_size=2, batch_size=1, max_staleness=1)


async def test_a_producer_pause_during_an_adapter_update_waits_for_it(tmp_path: Path) -> None:
    """The producer does not pause for an adapter, but the engine freezes its replicas while
    they load it, and holds its control lock meanwhile (each load bounded by
    `control_timeout_s`, 120 s by default; `pause_bound_s` holds only while no update runs).
    A keep-mode pause (a user's, a save's) sent to the engine during the load waited there
    past the producer's `abort_timeout_s`; the resume that undoes it waited on the same lock
    and timed out too, and the producer stopped ("the engine could not be resumed (after a
    failed pause)") while the update went on to commit. Now the pause waits in the producer
    for the update to end, then pauses the engine."""
    from asyncroll import Producer

    async with lora_scripted(2, tmp_path, pause_timeout_s=0.3) as (engine, stubs):
        for stub in stubs:  # both samples of a group
            stub.stream = _stream(_choice([7, 8]), _choice([7, 8], index=1))
        await engine.check_replicas()
        pauses_while_updating: list[bool] = []
        engine_pause = engine.pause_generation

        async def pause_generation() -> None:
            pauses_while_updating.append(not update.done())
            await engine_pause()

        engine.pause_generation = pause_generation  # type: ignore[method-assign]
        producer = Producer(
            engine, [[1, 2]] * 64, lambda g: [0.0, 0.0], group_size=2, batch_size=1,
            max_staleness=1, pause_mode="keep", abort_timeout_s=1.0,
        )  # fmt: skip
        async with producer:
            stubs[1].hang, stubs[1].hanging = asyncio.Event(), {LOAD}
            update = asyncio.ensure_future(producer.update_weights(adapter(1)))
            await stubs[1].progress.wait_until(lambda: LOAD in stubs[1].calls, 10.0)
            pausing = asyncio.ensure_future(producer.pause())
            # Three abort_timeout_s for the pause to reach the engine (or, as it did, to fail
            # there); the pause that waits for the update does neither while the load hangs.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(pausing), 3.0)
            assert pauses_while_updating == [] and not pausing.done()
            stubs[1].hang.set()
            assert await asyncio.wait_for(update, 10.0) == 1
            await asyncio.wait_for(pausing, 10.0)
            assert pauses_while_updating == [False] and producer.paused
            await producer.resume()
            assert producer.version == 1 and not producer.paused
