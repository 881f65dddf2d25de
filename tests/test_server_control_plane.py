"""`VLLMServerEngine`'s control plane against scripted replicas: one owner per replica, every
caller's wait bounded by its own deadline and ended by its abort, control calls on their own
connections, "no replica serving now" a state and not death, a version's weights fixed when
its label is put on them. Each test is a defect an outside review reproduced with fakes
(docs/server-engine.md has the design that rules each out)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch

from asyncroll._core.wakeup import Signal
from asyncroll.engines import EngineDeadError, GenerateRequest, ReplicaError, VLLMServerEngine
from asyncroll.engines.server.replicas import NoReplicaError, Replica, ReplicaState, pick
from asyncroll.engines.vllm.weight_check import WeightMismatchError, digest
from tests.test_server_engine import (
    GENERATE,
    LIVENESS,
    _model_folder,
    _request,
    _wedge,
    scripted,
)


def _to(engine: VLLMServerEngine, replica: Replica, rid: str) -> GenerateRequest:
    """A request whose session maps to `replica`."""
    session = next(f"s{k}" for k in range(1000) if pick(engine.replicas, f"s{k}") is replica)
    return msgspec.structs.replace(_request(rid), session=session)


async def _until(signal: Signal, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    await asyncio.wait_for(signal.wait_until(predicate), timeout)


async def test_control_calls_reach_replicas_whose_stream_connections_are_all_taken() -> None:
    """Streams and control calls shared one pool of `max_connections`: with that many
    streams open, a keep-mode pause never got a connection for `/pause`, the replica was
    marked down and the pause raised `EngineDeadError` (the producer stopped)."""
    async with scripted(1, max_connections=2, pause_timeout_s=1.0) as (engine, (stub,)):
        await engine.check_replicas()
        (replica,) = engine.replicas
        stub.hang, stub.hanging = asyncio.Event(), {GENERATE}  # streams that stay open
        calls = [asyncio.ensure_future(engine.generate(_request(f"run-{k}-0"))) for k in (0, 1)]
        await engine.wait_progress(lambda: replica.streams == 2, 5.0)
        await asyncio.wait_for(engine.pause_generation(), 10.0)
        assert "/pause" in stub.calls
        assert replica.state is ReplicaState.UP
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)


async def test_a_pause_while_every_replica_resyncs_is_no_dead_engine() -> None:
    """A cut update leaves every replica it reached re-syncing; the producer's next pause
    waited `pause_timeout_s`, found no replica up and raised `EngineDeadError`: the run
    stopped, while the replica was back a moment later. No replica serving now is a state."""
    async with scripted(1, pause_timeout_s=0.2) as (engine, (stub,)):
        await engine.check_replicas()
        (replica,) = engine.replicas
        stub.calls.clear()
        stub.hang, stub.hanging = asyncio.Event(), {"/update_weight_version"}
        update = asyncio.ensure_future(engine.update_weights(None, version=1))
        await _until(stub.progress, lambda: "/update_weight_version" in stub.calls)
        update.cancel()
        await asyncio.gather(update, return_exceptions=True)
        assert replica.state is not ReplicaState.UP
        await asyncio.wait_for(engine.pause_generation(), 5.0)  # its sync still hangs
        stub.hang.set()
        await asyncio.wait_for(engine.resume_generation(), 5.0)
        (sample,) = await asyncio.wait_for(engine.generate(_request("run-0-0")), 5.0)
        assert sample.tokens.tolist() == [7, 8]
        assert stub.label == "0"


async def test_a_resync_is_not_restarted_by_pauses_and_relabels_that_ran_meanwhile() -> None:
    """A re-sync was dropped and started over (a full reload) whenever a pause, resume or
    update ran meanwhile: a replica that reloads more slowly than the gap between them never
    came back. What it loaded still holds after a relabel or a pause: it catches up on the
    label and the pause state, and joins."""
    async with scripted(2) as (engine, stubs):
        await engine.check_replicas()
        late = engine.replicas[1]
        late.mark_unsynced("restarted")
        stubs[1].calls.clear()
        stubs[1].hang, stubs[1].hanging = asyncio.Event(), {"/update_weight_version"}
        sync = asyncio.ensure_future(engine.check_replicas())
        await _until(stubs[1].progress, lambda: "/update_weight_version" in stubs[1].calls)
        stubs[1].hanging = set()  # only its first label call hangs
        for version in (1, 2):
            await asyncio.wait_for(engine.pause_generation(), 5.0)
            await asyncio.wait_for(engine.update_weights(None, version=version), 5.0)
            await asyncio.wait_for(engine.resume_generation(), 5.0)
        stubs[1].hang.set()
        await asyncio.wait_for(sync, 5.0)
        assert late.state is ReplicaState.UP
        assert stubs[1].label == "2"
        assert stubs[1].calls.count("/reset_prefix_cache") == 1  # loaded once


async def test_an_abort_ends_a_request_waiting_for_its_replicas_sync() -> None:
    """A request routed to a replica being re-synced waited for that sync with no deadline
    and no abort: `abort()` returned, `generate` did not (128 groups failed at the
    producer's `generate_timeout_s`)."""
    async with scripted(2) as (engine, stubs):
        await engine.check_replicas()
        syncing = engine.replicas[1]
        request = _to(engine, syncing, "run-0-0")
        syncing.mark_unsynced("restarted")
        stubs[1].hang, stubs[1].hanging = asyncio.Event(), {"/reset_prefix_cache"}
        call = asyncio.ensure_future(engine.generate(request))
        await _until(stubs[1].progress, lambda: "/reset_prefix_cache" in stubs[1].calls)
        await engine.abort("run-0-0")
        (sample,) = await asyncio.wait_for(call, 2.0)
        assert sample.finish_reason == "abort"
        assert stubs[1].generates == 0


async def test_a_request_waiting_for_its_replicas_sync_ends_at_its_deadline() -> None:
    async with scripted(2, request_timeout_s=0.3) as (engine, stubs):
        await engine.check_replicas()
        syncing = engine.replicas[1]
        request = _to(engine, syncing, "run-0-0")
        syncing.mark_unsynced("restarted")
        stubs[1].hang, stubs[1].hanging = asyncio.Event(), {"/reset_prefix_cache"}
        with pytest.raises(NoReplicaError, match="request_timeout_s"):
            await asyncio.wait_for(engine.generate(request), 3.0)


async def test_an_abort_ends_a_request_waiting_for_its_replicas_liveness_check() -> None:
    """A request to a replica whose liveness is being checked waits for the check; the wait
    ignored `abort()`, and `generate` returned only when the check did (seconds later: an
    abort-mode update's drain took 4.2 s instead of 0.1 s)."""
    async with scripted(2, liveness_timeout_s=30.0) as (engine, stubs):
        await engine.check_replicas()
        wedged = engine.replicas[1]
        _wedge(stubs[1])
        stubs[1].calls.clear()
        engine._supervisors[wedged].failed(ReplicaError(wedged.url, "a stream broke"))
        await _until(stubs[1].progress, lambda: LIVENESS in stubs[1].calls)
        call = asyncio.ensure_future(engine.generate(_to(engine, wedged, "run-0-0")))
        await engine.wait_progress(lambda: "run-0-0" in engine._requests.live, 5.0)
        await engine.abort("run-0-0")
        (sample,) = await asyncio.wait_for(call, 2.0)
        assert sample.finish_reason == "abort"


async def test_a_request_past_its_deadline_does_not_wait_for_its_replicas_check() -> None:
    """At `request_timeout_s` a request started its replica's liveness check and waited for
    it: `liveness_timeout_s` more."""
    async with scripted(2, request_timeout_s=0.3, liveness_timeout_s=30.0) as (engine, stubs):
        await engine.check_replicas()
        wedged = engine.replicas[1]
        _wedge(stubs[1])
        with pytest.raises(ReplicaError, match="request_timeout_s"):
            await asyncio.wait_for(engine.generate(_to(engine, wedged, "run-0-0")), 3.0)


async def test_a_request_whose_replica_leaves_before_it_is_sent_goes_to_another() -> None:
    """A request waiting on its replica's liveness check was failed (`engine_error`) when
    the check took the replica out, though it had not been sent and another replica served."""
    async with scripted(2, liveness_timeout_s=0.3) as (engine, stubs):
        await engine.check_replicas()
        wedged = engine.replicas[1]
        _wedge(stubs[1])
        stubs[1].calls.clear()
        engine._supervisors[wedged].failed(ReplicaError(wedged.url, "a stream broke"))
        await _until(stubs[1].progress, lambda: LIVENESS in stubs[1].calls)
        (sample,) = await asyncio.wait_for(engine.generate(_to(engine, wedged, "run-0-0")), 5.0)
        assert sample.tokens.tolist() == [7, 8]
        assert wedged.state is ReplicaState.DOWN
        assert stubs[1].generates == 0


async def test_a_pause_during_a_liveness_probe_does_not_mark_the_replica_hung() -> None:
    """A keep-mode pause freezes a liveness generate sent just before it: the probe ran out
    of `liveness_timeout_s` and a healthy replica left the rotation (a full re-sync). A
    probe that a pause overtook proves nothing; it is tried again after the resume."""
    async with scripted(1, liveness_timeout_s=0.3) as (engine, (stub,)):
        await engine.check_replicas()
        (replica,) = engine.replicas
        ended = Signal()
        probes: list[str] = []
        check_alive = engine._client.check_alive

        async def spy(r: Replica, *, paused: bool) -> None:
            try:
                await check_alive(r, paused=paused)
                probes.append("answered")
            except BaseException as exc:
                probes.append(type(exc).__name__)
                raise
            finally:
                ended.notify()

        engine._client.check_alive = spy  # type: ignore[method-assign]
        stub.hang, stub.hanging = asyncio.Event(), {LIVENESS}  # frozen, as by the pause
        stub.calls.clear()
        engine._supervisors[replica].failed(ReplicaError(replica.url, "a stream broke"))
        await _until(stub.progress, lambda: LIVENESS in stub.calls)
        await asyncio.wait_for(engine.pause_generation(), 5.0)
        await _until(ended, lambda: bool(probes))  # the frozen probe ran out of time
        stub.hang.set()  # the resume unfreezes the replica
        await asyncio.wait_for(engine.resume_generation(), 5.0)
        (sample,) = await asyncio.wait_for(engine.generate(_request("run-0-0")), 5.0)
        assert sample.tokens.tolist() == [7, 8]
        assert replica.state is ReplicaState.UP
        assert "/reset_prefix_cache" not in stub.calls  # never re-synced


def _refuse_w(_path: str, _verify: bool) -> dict[str, Any]:
    return {"expected": ["w", "b"], "unloaded": [], "missing": ["b"]}


async def test_weights_every_replica_refuses_are_a_weight_mismatch_not_death(
    tmp_path: Path,
) -> None:
    """An update missing a tensor was refused by every replica: `EngineDeadError`, and the
    producer stopped, while the replicas could serve the old weights at once. In process,
    the same weights raise `WeightMismatchError` and the run goes on."""
    model = _model_folder(tmp_path / "model")  # what a replica reloads to drop a partial load
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    async with scripted(2, weights_dir=weights_dir) as (engine, stubs):
        await engine.check_replicas()
        for stub in stubs:
            stub.model = str(model)
            stub.report = _refuse_w
        with pytest.raises(WeightMismatchError, match="missing"):
            await asyncio.wait_for(engine.update_weights([("w", torch.ones(2))], version=1), 5)
        assert engine.version == 0
        for stub in stubs:
            stub.report = lambda _p, _v: {"expected": [], "unloaded": [], "missing": []}
        for k in range(4):
            (sample,) = await asyncio.wait_for(engine.generate(_request(f"run-{k}-0")), 5.0)
            assert sample.versions.tolist() == [0, 0]


def _checkpoint(folder: Path, value: float) -> None:
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    save_file({"w": torch.full((4,), value)}, str(folder / "model.safetensors"))


async def test_a_resync_does_not_load_a_rewritten_folder_under_the_old_label(
    tmp_path: Path,
) -> None:
    """`update_weights_from_path` kept only the path: a trainer rewriting one "latest" folder
    each step had a replica re-synced in between load the new weights under the old label
    (248 tokens labelled 1 sampled by weights 2)."""
    latest = tmp_path / "latest"
    _checkpoint(latest, 1.0)
    async with scripted(2) as (engine, stubs):
        await engine.check_replicas()
        await engine.update_weights_from_path(latest, version=1)
        _checkpoint(latest, 2.0)  # the trainer's next step, not yet given to the engine
        restarted = engine.replicas[1]
        restarted.mark_down("restarted", retry_at=0.0)
        stubs[1].loaded.clear()
        await asyncio.wait_for(engine.check_replicas(), 5.0)
        assert restarted.state is not ReplicaState.UP
        assert restarted.error is not None and "changed" in restarted.error
        assert stubs[1].loaded == []  # never told to load the new bytes
        await engine.update_weights_from_path(latest, version=2)
        await asyncio.wait_for(engine.check_replicas(), 5.0)
        assert restarted.state is ReplicaState.UP and stubs[1].label == "2"


async def test_verify_weights_compares_with_the_tensors_as_sent(tmp_path: Path) -> None:
    """`verify_weights` read its reference digests back from the folder it wrote: a bit
    flipped on disk after the write was served under the new label. The reference is the
    trainer's tensors as sent."""
    sent = torch.arange(4, dtype=torch.float32)
    flipped = sent.clone()
    flipped.view(torch.int32)[0] ^= 1

    def corrupt_then_report(path: str, verify: bool) -> dict[str, Any]:
        _checkpoint(Path(path), 0.0)  # replaced below with the flipped tensor
        from safetensors.torch import save_file

        save_file({"w": flipped}, str(Path(path) / "model.safetensors"))
        report: dict[str, Any] = {"expected": ["w"], "unloaded": [], "missing": []}
        if verify:
            report["received"] = {"w": digest(flipped)}
            report["mismatched"] = []
        return report

    async with scripted(1, weights_dir=tmp_path, verify_weights=True) as (engine, (stub,)):
        await engine.check_replicas()
        stub.report = corrupt_then_report
        with pytest.raises(WeightMismatchError, match="other bytes"):
            await asyncio.wait_for(engine.update_weights([("w", sent)], version=1), 5.0)
        assert engine.version == 0


async def test_a_cut_update_leaves_no_replica_paused() -> None:
    """An update cut by its caller (an anyio `move_on_after`, which cancels every await in
    its scope, the cleanup's too) during its pause: the cleanup's `/resume` calls were
    cancelled before they were sent, and the replicas stayed paused while the engine
    counted them up (543 groups failed). The cleanup belongs to each replica's owner."""
    async with scripted(2, pause_timeout_s=5.0) as (engine, stubs):
        await engine.check_replicas()
        stubs[1].hang, stubs[1].hanging = asyncio.Event(), {"/pause"}
        with anyio.move_on_after(0.3):
            await engine.update_weights(None, version=1)
        stubs[1].hang.set()
        for stub in stubs:
            await _until(stub.progress, lambda s=stub: s.calls[-1:] == ["/resume"])  # type: ignore[misc]
        assert engine.version == 0
        for k in range(4):
            (sample,) = await asyncio.wait_for(engine.generate(_request(f"run-{k}-0")), 5.0)
            assert sample.tokens.tolist() == [7, 8]


async def test_no_replica_answering_is_no_death_but_a_wait_bounded_by_the_callers_deadline(
    tmp_path: Path,
) -> None:
    """No replica up is a state: a pause or update records what the replicas must serve when
    they answer, and a request waits for one until its own deadline (then fails, naming each
    replica); only a closed engine is dead."""
    from asyncroll.engines.server.launch import free_port

    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens there
    engine = VLLMServerEngine(urls, vocab_size=512, request_timeout_s=0.5, weights_dir=tmp_path)
    try:
        with pytest.raises(NoReplicaError, match="request_timeout_s") as caught:
            await asyncio.wait_for(engine.generate(_request("r-0")), 5.0)
        assert all(url in str(caught.value) for url in urls)
        with pytest.raises(ValueError, match="vocabulary"):  # checked before any HTTP
            await engine.generate(_request("r-1", prompt=[0, 512]))
        await asyncio.wait_for(engine.pause_generation(), 5.0)
        await asyncio.wait_for(engine.update_weights(None, version=1), 5.0)
        assert engine.version == 1
        await asyncio.wait_for(engine.resume_generation(), 5.0)
    finally:
        await engine.close()
    with pytest.raises(EngineDeadError, match="closed"):
        await engine.generate(_request("r-2"))
    await engine.abort("r-2")  # harmless after close
