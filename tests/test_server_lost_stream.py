"""A generate stream whose connection is lost while its replica still serves: the request is
sent again there once a liveness generate kept the replica in the rotation (from scratch: the
cut stream's tokens carry no version label yet), or the group goes to another replica when the
replica did not pass, or it fails naming the disconnect. Nothing is left counted as running.

A `pytest -n 4` run saw the keep-pause conformance test on `vllm serve` get
`ServerDisconnectedError` mid-generate as the group's `ReplicaError`, though the replica
answered everything after it (docs/server-engine.md, "A lost stream")."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgspec
import numpy as np
import pytest
from aiohttp import web

from asyncroll.engines import (
    EngineDeadError,
    GenerateRequest,
    ReplicaError,
    SampleRequest,
    SamplingConfig,
    VLLMServerEngine,
)
from asyncroll.engines.server.replicas import Replica, ReplicaState, pick
from asyncroll.engines.server.request_path import MAX_RESENDS
from tests.test_server_engine import (
    GENERATE,
    LIVENESS,
    ScriptedStub,
    _request,
    _sse,
    scripted,
)

TOKENS = [11, 12, 13, 14]  # what an uncut request of 4 tokens (`_request`) returns
LOGPROBS = [-0.25, -0.5, -0.75, -1.0]
DEADLINE_S = 10.0  # every wait's bound: a hang fails the test, a loaded machine does not
CUTS = ["mid-stream", "before-the-reply", "reset", "no-done"]


def _event(tokens: list[int], *, label: str | None) -> bytes:
    """One event of a sample: `tokens` with their logprobs; finished (every token labelled
    `label`) unless `label` is None."""
    first = TOKENS.index(tokens[0])
    choice: dict[str, Any] = {
        "index": 0,
        "token_ids": tokens,
        "logprobs": {
            "content": [
                {"token_id": t, "logprob": lp}
                for t, lp in zip(tokens, LOGPROBS[first:], strict=False)
            ]
        },
    }
    if label is not None:
        choice["finish_reason"] = "length"
        choice["weight_versions"] = [{"version": label, "start": 0, "end": len(TOKENS)}]
    return msgspec.json.encode({"choices": [choice]})


class CuttingStub(ScriptedStub):
    """A replica that loses the connection of its first `cuts` generate streams (not its
    liveness probes) the way `how` says, after streaming their first two tokens; its control
    routes and probes answer throughout. While `gate` is set and not yet open, a stream waits
    for it before its cut (a cut at a moment the test chooses). Every other generate streams
    `TOKENS`, labelled with the replica's current label. `ids`: the request ids of its
    generates, `aborted`: the ids it was asked to abort."""

    def __init__(self) -> None:
        super().__init__()
        self.cuts = 1
        self.how = "mid-stream"
        self.gate: asyncio.Event | None = None
        self.ids: list[str] = []
        self.seeds: dict[str, int | None] = {}  # request id -> its sampling seed
        self.aborted: list[str] = []

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def cutting(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.path == "/abort_requests":
                self.aborted += (await request.json())["request_ids"]
            if request.path != GENERATE:
                return await handler(request)  # type: ignore[no-any-return]
            body = await request.json()
            rid = body["request_id"]
            if rid.startswith(LIVENESS):
                return await handler(request)  # type: ignore[no-any-return]
            self.ids.append(rid)
            self.seeds[rid] = body["sampling_params"].get("seed")
            self.progress.notify()
            if self.cuts > 0:
                self.cuts -= 1
                return await self._cut(request)
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            await reply.write(_sse(_event(TOKENS, label=self.label), b"[DONE]"))
            await reply.write_eof()
            return reply

        app.middlewares.append(cutting)
        return app

    async def _cut(self, request: web.Request) -> web.StreamResponse:
        transport = request.transport
        assert transport is not None
        if self.how == "before-the-reply":  # aiohttp: ServerDisconnectedError
            transport.close()
            return web.Response()
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        await reply.write(_sse(_event(TOKENS[:2], label=None)))
        if self.gate is not None:
            await self.gate.wait()
        if self.how == "no-done":  # a clean end before `[DONE]`
            await reply.write_eof()
        elif self.how == "reset":  # a TCP reset (ClientPayloadError of a ConnectionResetError)
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        else:  # the connection closed mid-body: ClientPayloadError
            transport.close()
        return reply


def _nothing_in_flight(engine: VLLMServerEngine) -> None:
    """The engine's in-flight bookkeeping is empty: no group, stream or held request."""
    requests = engine._requests
    assert (requests.live, requests.open_streams, requests.held) == ({}, 0, 0)
    assert [r.streams for r in engine.replicas] == [0] * len(engine.replicas)


async def _generate(engine: VLLMServerEngine, rid: str = "run-0-0") -> Any:
    return await asyncio.wait_for(engine.generate(_request(rid)), DEADLINE_S)


@pytest.mark.parametrize("how", CUTS)
async def test_a_stream_cut_once_is_sent_again_and_completes_exactly(how: str) -> None:
    """It raised the replica's `ReplicaError` ("generate: ServerDisconnectedError: Server
    disconnected"), failing the group although the replica's liveness generate then kept it
    in the rotation. Now the request is sent again there, under a new id (the cut one is
    aborted: vLLM notices a closed connection only when it next writes), once that check
    passed; its sample is the second request's, exactly."""
    async with scripted(1, stub_type=CuttingStub) as (engine, (stub,)):
        stub.how = how
        await engine.check_replicas()
        (sample,) = await _generate(engine)
        assert sample.tokens.tolist() == TOKENS
        assert sample.logprobs.tolist() == LOGPROBS
        assert sample.versions.tolist() == [0] * len(TOKENS)
        assert sample.finish_reason == "length"
        cut, again = stub.ids
        assert cut != again
        await asyncio.wait_for(
            stub.progress.wait_until(lambda: any(cut in a for a in stub.aborted)), DEADLINE_S
        )
        checked = stub.calls.index(LIVENESS, stub.calls.index(GENERATE))
        assert checked < len(stub.calls) - stub.calls[::-1].index(GENERATE) - 1  # before
        assert engine.replicas[0].state is ReplicaState.UP
        _nothing_in_flight(engine)


async def test_a_replica_that_keeps_cutting_a_stream_fails_its_group_naming_the_disconnect() -> (
    None
):
    """Sent again at most `MAX_RESENDS` times: a replica whose probes pass but whose streams
    are all cut fails the group, with a reason that names the lost connection."""
    async with scripted(1, stub_type=CuttingStub) as (engine, (stub,)):
        stub.cuts = MAX_RESENDS + 1
        await engine.check_replicas()
        lost = rf"stream lost {MAX_RESENDS + 1} times in a row.*: ClientPayloadError"
        with pytest.raises(ReplicaError, match=lost):
            await _generate(engine)
        assert len(stub.ids) == MAX_RESENDS + 1
        _nothing_in_flight(engine)
        stub.cuts = 0
        (sample,) = await _generate(engine, "run-1-0")
        assert sample.tokens.tolist() == TOKENS


async def test_a_stream_cut_during_a_keep_mode_pause_is_sent_again_after_the_resume() -> None:
    """Cut while the engine is paused (keep mode), the request is held like any other, not
    sent into the paused replica nor counted as a running stream; after an update and the
    resume it is sent again and every token carries the new version."""
    async with scripted(1, stub_type=CuttingStub) as (engine, (stub,)):
        stub.gate = asyncio.Event()
        await engine.check_replicas()
        call = asyncio.ensure_future(engine.generate(_request("run-0-0")))
        await engine.wait_generated(2, DEADLINE_S)  # its first two tokens streamed
        await asyncio.wait_for(engine.pause_generation(), DEADLINE_S)
        stub.gate.set()  # the connection is lost now, during the pause
        await engine.wait_held(1, DEADLINE_S)
        assert len(stub.ids) == 1  # not sent again into the paused replica
        assert (engine.running_requests, engine.samples_started("run-0-0")) == (0, 0)
        await asyncio.wait_for(engine.update_weights(None, version=2), DEADLINE_S)
        await asyncio.wait_for(engine.resume_generation(), DEADLINE_S)
        (sample,) = await asyncio.wait_for(call, DEADLINE_S)
        assert sample.tokens.tolist() == TOKENS
        assert sample.logprobs.tolist() == LOGPROBS
        assert sample.versions.tolist() == [2] * len(TOKENS)
        assert len(stub.ids) == 2
        _nothing_in_flight(engine)


async def _cut_while_paused(engine: VLLMServerEngine, stub: CuttingStub) -> asyncio.Future[Any]:
    """A request of group "run-0-0" whose stream is cut while the engine is paused: returned
    once the cut request is held, waiting to be sent again."""
    stub.gate = asyncio.Event()
    await engine.check_replicas()
    call = asyncio.ensure_future(engine.generate(_request("run-0-0")))
    await engine.wait_generated(2, DEADLINE_S)
    await asyncio.wait_for(engine.pause_generation(), DEADLINE_S)
    stub.gate.set()
    await engine.wait_held(1, DEADLINE_S)
    return call


async def test_a_stream_cut_during_a_pause_and_then_aborted_returns_none_of_the_cut() -> None:
    """An abort-mode pause aborts the group while its cut request waits to be sent again:
    it returns an empty sample, finish "abort" (the cut tokens' versions were never sent, so
    they are not returned), and nothing is sent again."""
    async with scripted(1, stub_type=CuttingStub) as (engine, (stub,)):
        call = await _cut_while_paused(engine, stub)
        await asyncio.wait_for(engine.abort("run-0-0"), DEADLINE_S)
        (sample,) = await asyncio.wait_for(call, DEADLINE_S)
        assert (sample.finish_reason, len(sample.tokens), len(sample.versions)) == ("abort", 0, 0)
        _nothing_in_flight(engine)
        await asyncio.wait_for(engine.resume_generation(), DEADLINE_S)
        assert len(stub.ids) == 1


def _to(engine: VLLMServerEngine, replica: Replica, rid: str) -> Any:
    session = next(f"s{k}" for k in range(1000) if pick(engine.replicas, f"s{k}") is replica)
    return msgspec.structs.replace(_request(rid), session=session)


async def test_a_stream_cut_by_a_replica_that_then_fails_its_probe_goes_to_another() -> None:
    """The server went away (its probes fail after the cut): the replica leaves the rotation,
    naming the lost stream, and the group, nothing of it running anywhere, is routed to the
    other replica and completes there."""
    async with scripted(2, stub_type=CuttingStub) as (engine, stubs):
        await engine.check_replicas()
        stubs[0].cuts = 0
        gone = engine.replicas[1]
        stubs[1].failing = {LIVENESS, "/health"}
        request = _to(engine, gone, "run-0-0")
        (sample,) = await asyncio.wait_for(engine.generate(request), DEADLINE_S)
        assert sample.tokens.tolist() == TOKENS
        assert np.array_equal(sample.versions, np.zeros(len(TOKENS), np.int32))
        assert (len(stubs[0].ids), len(stubs[1].ids)) == (1, 1)
        assert gone.state is ReplicaState.DOWN
        assert "ClientPayloadError" in str(gone.error)
        _nothing_in_flight(engine)


async def test_only_the_cut_request_of_a_group_is_sent_again_with_its_seed() -> None:
    """A group of two requests (a fresh sample and a continued one): the one whose stream is
    cut is sent again under an id of its own and the same sampling seed; the other runs
    on undisturbed, sent once."""
    group = GenerateRequest(
        request_id="run-0-0",
        prompt_tokens=np.array([0, 5], np.int32),
        samples=(
            SampleRequest(np.zeros(0, np.int32), 4),
            SampleRequest(np.array([3], np.int32), 4),
        ),
        sampling=SamplingConfig(max_new_tokens=4, seed=7),
    )
    async with scripted(1, stub_type=CuttingStub) as (engine, (stub,)):
        await engine.check_replicas()
        outputs = await asyncio.wait_for(engine.generate(group), DEADLINE_S)
        assert [o.tokens.tolist() for o in outputs] == [TOKENS, TOKENS]
        assert [o.versions.tolist() for o in outputs] == [[0] * len(TOKENS)] * 2
        cut, other, again = stub.ids
        assert again == f"{cut}~1" and other != cut
        assert stub.seeds[again] == stub.seeds[cut] is not None
        _nothing_in_flight(engine)


async def test_the_engine_closing_while_a_cut_request_waits_ends_it_dead() -> None:
    async with scripted(1, stub_type=CuttingStub) as (engine, (stub,)):
        call = await _cut_while_paused(engine, stub)
        await asyncio.wait_for(engine.close(), DEADLINE_S)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(call, DEADLINE_S)
        _nothing_in_flight(engine)
        assert len(stub.ids) == 1
