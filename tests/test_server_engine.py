"""`VLLMServerEngine` without a server: configuration errors, routing, and replicas that are
not there, hang or answer garbage (scripted aiohttp stubs; the real `vllm serve` tests are in
tests/vllm/test_server*.py)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import socket
import subprocess
import sys
import threading
import tracemalloc
import types
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
from aiohttp import web

from asyncroll._core.wakeup import Signal
from asyncroll.engines import (
    EngineDeadError,
    GenerateRequest,
    ReplicaError,
    SampleRequest,
    SamplingConfig,
    VLLMServerEngine,
)
from asyncroll.engines.server import launch as vllm_serve
from asyncroll.engines.server.engine import attempt_session
from asyncroll.engines.server.launch import ServerProcess, ServerStartError
from asyncroll.engines.server.replicas import (
    MAX_BACKOFF_DOUBLINGS,
    NoReplicaError,
    Replica,
    ReplicaState,
    backoff_s,
    control,
    pick,
)
from tests.stubs import not_http, served


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"urls": []}, "at least one"),
        ({"urls": "127.0.0.1:8000"}, "base URL like http://"),
        ({"urls": ["http://a:1", "http://a:1/"]}, "appear once"),
        ({"urls": ["http://A:1", "http://a:1"]}, "appear once"),  # host names ignore case
        ({"urls": ["http://a", "http://a:80"]}, "appear once"),  # the default port
        ({"vocab_size": 0}, "vocab_size"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"max_model_len": -256}, "max_model_len"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
        ({"max_connections": 0}, "max_connections"),
        ({"pause_timeout_s": 0}, "pause_timeout_s"),
        ({"liveness_timeout_s": -1}, "liveness_timeout_s"),
        ({"weights_dir": "/nonexistent/asyncroll"}, "weights_dir"),
    ],
)
def test_bad_config_fails_at_construction_saying_what_to_change(
    kwargs: dict[str, object], message: str
) -> None:
    args: dict[str, object] = {"urls": "http://127.0.0.1:1", "vocab_size": 512, **kwargs}
    with pytest.raises(ValueError, match=message):
        VLLMServerEngine(**args)  # type: ignore[arg-type]


def test_verify_weights_is_refused_with_weights_sent_over_nccl() -> None:
    """Verification reads the folder a replica loaded; a broadcast leaves none to read, so the
    pair would promise a check that never runs."""
    with pytest.raises(ValueError, match=r"verify_weights=True .* NCCL"):
        VLLMServerEngine(
            "http://127.0.0.1:1",
            vocab_size=512,
            verify_weights=True,
            weight_transfer=types.SimpleNamespace(),  # type: ignore[arg-type]
        )


def test_a_producer_refuses_an_engine_whose_pause_can_outlast_its_wait() -> None:
    """Deadlines compose: the producer waits `abort_timeout_s` for a pause; an engine whose
    pause may take longer (`pause_bound_s`) would stop the run while its pause still ran."""
    from asyncroll import Producer

    engine = VLLMServerEngine("http://127.0.0.1:1", vocab_size=512, pause_timeout_s=20.0)
    assert engine.pause_bound_s >= 30.0
    with pytest.raises(ValueError, match=r"abort_timeout_s=30.0 .*pause_bound_s"):
        Producer(engine, [[1, 2]], lambda s: 0.0, group_size=2, batch_size=1)
    Producer(engine, [[1, 2]], lambda s: 0.0, group_size=2, batch_size=1, abort_timeout_s=90.0)


def test_sessions_stay_put_and_only_a_down_replicas_sessions_move() -> None:
    replicas = [Replica(f"http://r{i}:1") for i in range(3)]
    for r in replicas:
        r.state = ReplicaState.UP
    sessions = [f"run-{k}" for k in range(300)]
    before = {s: pick(replicas, s) for s in sessions}
    assert {pick(replicas, s) for s in sessions for _ in range(3)} == set(replicas)  # spread
    assert all(pick(replicas, s) is before[s] for s in sessions)  # deterministic
    replicas[1].mark_down("killed", retry_at=0.0)
    after = {s: pick(replicas, s) for s in sessions}
    moved = [s for s in sessions if after[s] is not before[s]]
    assert moved and all(before[s] is replicas[1] for s in moved)
    assert all(after[s] is not replicas[1] for s in sessions)
    for r in replicas:
        r.mark_down("gone", retry_at=0.0)
    assert pick(replicas, "run-0") is None


def test_attempts_of_a_group_share_a_session() -> None:
    assert attempt_session("abc123-7-0") == attempt_session("abc123-7-3") == "abc123-7"
    assert attempt_session("abc123-7-0") != attempt_session("abc123-8-0")


def _request(rid: str, prompt: list[int] | None = None) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        prompt_tokens=np.array(prompt or [0, 5], np.int32),
        samples=(SampleRequest(np.zeros(0, np.int32), 4),),
        sampling=SamplingConfig(max_new_tokens=4),
    )


class PausableStub:
    """A stand-in for a replica's control routes: answers health, pause, resume, cache reset
    and version label, and remembers whether it is paused."""

    def __init__(self) -> None:
        self.paused = True  # as a `/pause` left it that answered after the engine gave up
        self.label = "default"

    def app(self) -> web.Application:
        async def pause(_: web.Request) -> web.Response:
            self.paused = True
            return web.json_response({"status": "paused"})

        async def resume(_: web.Request) -> web.Response:
            self.paused = False
            return web.json_response({"status": "resumed"})

        async def ok(_: web.Request) -> web.Response:
            return web.json_response({"success": True})

        async def generate(_: web.Request) -> web.Response:  # the liveness probe's
            return web.Response(body=_stream(_choice([7])), content_type="text/event-stream")

        async def weight_info(_: web.Request) -> web.Response:
            return web.json_response({"weight_version": self.label})

        async def label(request: web.Request) -> web.Response:
            self.label = (await request.json())["new_version"]
            return web.json_response({"success": True})

        async def process(request: web.Request) -> web.Response | None:
            return await _process(request, "stub")

        app = web.Application()
        app.router.add_post("/collective_rpc", process)
        app.router.add_get("/health", ok)
        app.router.add_get("/weight_info", weight_info)
        app.router.add_post(GENERATE, generate)
        app.router.add_post("/pause", pause)
        app.router.add_post("/resume", resume)
        app.router.add_post("/reset_prefix_cache", ok)
        app.router.add_post("/update_weight_version", label)
        return app


async def test_a_rejoining_replica_takes_the_engines_pause_state(tmp_path: Path) -> None:
    """A replica that left the rotation may still be paused (a `/pause` that answered after
    `control_timeout_s`): when it rejoins an engine that is not paused it must serve again,
    and when it rejoins a paused engine it must be paused."""
    stub = PausableStub()
    async with served([stub.app()]) as urls:
        engine = VLLMServerEngine(urls, vocab_size=512, weights_dir=tmp_path)
        try:
            (replica,) = engine.replicas
            for engine_paused in (False, True, False):
                await (engine.pause_generation if engine_paused else engine.resume_generation)()
                replica.mark_down("its /pause answered late", retry_at=0.0)
                stub.paused = not engine_paused
                await engine.check_replicas()
                assert replica.state is ReplicaState.UP
                assert stub.paused is engine_paused
        finally:
            await engine.close()


class _Body:
    """A reply's body that counts the bytes read from it."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.taken = 0

    async def read(self, n: int = -1) -> bytes:
        n = len(self.data) if n < 0 else n
        chunk, self.data = self.data[:n], self.data[n:]
        self.taken += len(chunk)
        return chunk


class _Reply:
    def __init__(self, status: int = 200, body: bytes = b'{"ok": true}') -> None:
        self.status = status
        self.content = _Body(body)

    async def read(self) -> bytes:  # aiohttp's: the whole body
        return await self.content.read()


class _Session:
    """A stand-in for `aiohttp.ClientSession.request`: each call first raises the next of
    `errors` (None: hangs until cancelled), then answers 200 once they are used up."""

    closed = False

    def __init__(self, *errors: BaseException | None, reply: _Reply | None = None) -> None:
        self.errors = list(errors)
        self.calls = 0
        self.reply = reply or _Reply()

    @contextlib.asynccontextmanager
    async def request(self, method: str, url: str, **kwargs: Any) -> AsyncIterator[_Reply]:
        self.calls += 1
        if self.errors:
            error = self.errors.pop(0)
            if error is None:
                await asyncio.Event().wait()
            raise error
        yield self.reply


def control_on(session: _Session, timeout_s: float = 60.0) -> Any:
    fake: Any = session
    return control(fake, Replica("http://r:1"), "POST", "/pause", timeout_s=timeout_s)


async def test_aiohttps_own_timeout_is_a_transport_error_retried_not_the_deadline() -> None:
    """aiohttp's connect timeout is a `TimeoutError` too: it was once taken for the control
    deadline ("no reply within 600 s" after 10 s) and not retried."""
    session = _Session(aiohttp.ConnectionTimeoutError("connect timed out"))
    assert await control_on(session) == {"ok": True}
    assert session.calls == 2
    twice = _Session(*[aiohttp.ConnectionTimeoutError("connect timed out")] * 2)
    with pytest.raises(ReplicaError, match="POST /pause: ConnectionTimeoutError") as raised:
        await control_on(twice)
    assert "no reply within" not in str(raised.value)


async def test_a_retried_control_call_keeps_one_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of a retried call's two tries had a `timeout_s` of its own: a connection dropped
    late in the first left the second a whole `timeout_s` more, and a pause could take twice
    its bound (`pause_bound_s`). Both tries now run under one deadline."""
    deadlines: list[float] = []
    timeout = asyncio.timeout

    def spy(delay: float | None) -> asyncio.Timeout:
        deadlines.append(float("inf") if delay is None else delay)
        return timeout(delay)

    monkeypatch.setattr(asyncio, "timeout", spy)
    session = _Session(aiohttp.ServerDisconnectedError(), None)
    with pytest.raises(ReplicaError, match=r"POST /pause: no reply within 0.5 s"):
        await control_on(session, timeout_s=0.5)
    assert session.calls == 2 and deadlines == [0.5]


async def test_an_error_reply_is_read_only_as_far_as_it_is_quoted() -> None:
    """An error reply was read whole, then cut to 500 bytes: a replica (or a proxy) answering
    a 500 with a gigabyte held a gigabyte here."""
    reply = _Reply(500, b"x" * (64 << 20))
    with pytest.raises(ReplicaError, match="HTTP 500"):
        await control_on(_Session(reply=reply))
    assert reply.content.taken <= 500


async def test_a_control_call_past_its_deadline_says_so() -> None:
    with pytest.raises(ReplicaError, match=r"POST /pause: no reply within 0.05 s"):
        await control_on(_Session(None), timeout_s=0.05)


def _choice(
    tokens: list[int], *, index: int = 0, spans: list[tuple[str, int, int]] | None = None
) -> dict[str, Any]:
    """One finished sample of a generate stream: `tokens`, labelled version "0" unless
    `spans` says otherwise."""
    return {
        "index": index,
        "token_ids": tokens,
        "finish_reason": "length",
        "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in tokens]},
        "weight_versions": [
            {"version": v, "start": s, "end": e}
            for v, s, e in (spans if spans is not None else [("0", 0, len(tokens))])
        ],
    }


GENERATE = "/inference/v1/generate"
LIVENESS = "asyncroll-liveness"
PROCESS = "asyncroll_process"  # the extension's process identity, read around loads and labels


async def _process(request: web.Request, process: str) -> web.Response | None:
    """The worker extension's answer to `/collective_rpc asyncroll_process` (None: another
    method): a stub's process identity, which a test changes to restart it."""
    if (await request.json())["method"] != PROCESS:
        return None
    return web.json_response({"results": [process]})


def _sse(*events: bytes) -> bytes:
    return b"".join(b"data: " + e + b"\n\n" for e in events)


def _stream(*choices: dict[str, Any]) -> bytes:
    return _sse(*(json.dumps({"choices": [c]}).encode() for c in choices), b"[DONE]")


class ScriptedStub:
    """A replica whose answers the test scripts: the control routes answer as vLLM's do,
    `/health` answers `health` (vLLM's is empty), every generate answers the raw server-sent
    events `stream`. While `hang` is set, the routes in `hanging` wait for it to be set;
    those in `failing` answer 500. `calls` lists every route called (`progress` is notified
    at each call and reply), `label` is the version label last set."""

    def __init__(self) -> None:
        self.health = b""
        self.stream = _stream(_choice([7, 8]))
        self.hang: asyncio.Event | None = None
        self.hanging = {"/health", "/abort_requests", GENERATE, LIVENESS}
        self.failing: set[str] = set()
        self.calls: list[str] = []
        self.progress = Signal()
        self.label = "default"
        self.not_http = False  # generates (not liveness probes) answer bytes that are not HTTP
        self.model = "/nonexistent/model"  # the model it was started from (`/v1/models` root)
        self.loaded: list[str] = []  # the folders its worker extension was told to load
        self.process = "stub"  # its process identity (`asyncroll_process`)
        # the extension's report on a load (path, verify) -> report; default: a clean one
        self.report: Callable[[str, bool], dict[str, Any]] = lambda _p, _v: {
            "expected": [],
            "unloaded": [],
            "missing": [],
        }

    @property
    def generates(self) -> int:
        return self.calls.count(GENERATE)

    def app(self) -> web.Application:
        async def health(_: web.Request) -> web.Response:
            return web.Response(body=self.health)

        async def ok(_: web.Request) -> web.Response:
            return web.json_response({"success": True})

        async def version(request: web.Request) -> web.Response:
            self.label = (await request.json())["new_version"]
            return web.json_response({"success": True})

        async def weight_info(_: web.Request) -> web.Response:
            return web.json_response({"weight_version": self.label})

        async def generate(request: web.Request) -> web.StreamResponse:
            live = (await request.json())["request_id"].startswith(LIVENESS)
            if self.not_http and not live:  # another service's bytes, then hang up
                assert request.transport is not None
                request.transport.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
                request.transport.close()
                return web.Response()
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            await reply.write(_stream(_choice([7])) if live else self.stream)
            await reply.write_eof()
            return reply

        @web.middleware
        async def script(request: web.Request, handler: Any) -> web.StreamResponse:
            path = request.path
            if path == GENERATE and (await request.json())["request_id"].startswith(LIVENESS):
                path = LIVENESS  # the engine's liveness probe, not a request of the test's
            if path == "/collective_rpc" and (await request.json())["method"] == PROCESS:
                path = PROCESS  # the process identity, not a load
            self.calls.append(path)
            self.progress.notify()
            try:
                if self.hang is not None and path in self.hanging:
                    await self.hang.wait()
                if path in self.failing:
                    return web.Response(status=500, text="scripted failure")
                return await handler(request)  # type: ignore[no-any-return]
            finally:
                self.progress.notify()

        async def load(request: web.Request) -> web.Response:  # the extension's report
            identity = await _process(request, self.process)
            if identity is not None:
                return identity
            kwargs = (await request.json())["kwargs"]
            self.loaded.append(kwargs["path"])
            return web.json_response({"results": [self.report(kwargs["path"], kwargs["verify"])]})

        async def models(_: web.Request) -> web.Response:  # vLLM's, trimmed to what is read
            card = {"id": "served", "object": "model", "root": self.model, "parent": None}
            return web.json_response({"object": "list", "data": [card]})

        app = web.Application(middlewares=[script])
        app.router.add_get("/health", health)
        for path in ("/pause", "/resume", "/reset_prefix_cache", "/abort_requests"):
            app.router.add_post(path, ok)
        app.router.add_post("/collective_rpc", load)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/update_weight_version", version)
        app.router.add_get("/weight_info", weight_info)
        app.router.add_post(GENERATE, generate)
        return app


@contextlib.asynccontextmanager
async def scripted(
    count: int, stub_type: type[ScriptedStub] = ScriptedStub, **kwargs: Any
) -> AsyncIterator[tuple[VLLMServerEngine, list[Any]]]:
    """`count` scripted replicas (of `stub_type`) and an engine over them (`kwargs` for the
    engine)."""
    stubs = [stub_type() for _ in range(count)]
    async with served([stub.app() for stub in stubs]) as urls:
        engine = VLLMServerEngine(urls, vocab_size=512, **kwargs)
        try:
            yield engine, stubs
        finally:
            for stub in stubs:
                if stub.hang is not None:
                    stub.hang.set()
            await engine.close()


async def test_a_replica_answering_garbage_to_its_health_probe_leaves_the_rotation() -> None:
    """A 200 whose body is not JSON (a proxy's error page) was a `msgspec.DecodeError`, not
    a `ReplicaError`: it escaped the probe, and every `generate` raised it, the other
    replica's sessions included."""
    async with scripted(2) as (engine, stubs):
        stubs[1].health = b"<html>502 Bad Gateway</html>"
        for k in range(10):
            (sample,) = await engine.generate(_request(f"run-{k}-0"))
            assert sample.tokens.tolist() == [7, 8]
        assert engine.replicas[1].state is ReplicaState.DOWN
        assert stubs[1].generates == 0


@pytest.mark.parametrize("event", [b"{not json", b'{"choices": "none"}'])
async def test_a_malformed_stream_event_fails_the_request_naming_the_replica(event: bytes) -> None:
    async with scripted(1) as (engine, (stub,)):
        stub.stream = _sse(event, b"[DONE]")
        with pytest.raises(ReplicaError, match="malformed event") as caught:
            await engine.generate(_request("run-0-0"))
        assert caught.value.url == engine.replicas[0].url


async def test_more_tokens_than_a_sample_asked_for_fail_the_request() -> None:
    """The `Engine` contract: never more than a sample's `max_new_tokens`. A replica that
    streams more (a wrong `max_tokens` on its side) was passed through."""
    async with scripted(1) as (engine, (stub,)):
        stub.stream = _stream(_choice([1, 2, 3, 4, 5]))  # `_request` asks for 4
        with pytest.raises(ReplicaError, match=r"5 tokens .* at most 4") as caught:
            await engine.generate(_request("run-0-0"))
        assert caught.value.url == engine.replicas[0].url
        stub.stream = _stream(_choice([1, 2, 3, 4]))
        (sample,) = await engine.generate(_request("run-1-0"))
        assert sample.tokens.tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "spans",
    [
        [("0", 0, 2), ("0", 0, 1)],  # token 0 twice, token 2 never: lengths add up to 3
        [("0", -1, 2)],  # a negative start: an empty slice whose length is 3
        [("0", 0, 3), ("1", 0, 1)],  # token 0 labelled twice, differently
        [("0", 0, 2)],  # token 2 never
    ],
)
async def test_version_spans_that_do_not_label_each_token_once_fail_the_request(
    spans: list[tuple[str, int, int]],
) -> None:
    """Only the spans' lengths were checked against the token count: the first two passed,
    and the unlabelled token got whatever `np.empty` held for its version."""
    async with scripted(1) as (engine, (stub,)):
        stub.stream = _stream(_choice([1, 2, 3], spans=spans))
        with pytest.raises(ReplicaError, match="do not label each of the 3 tokens"):
            await engine.generate(_request("run-0-0"))
        stub.stream = _stream(_choice([1, 2, 3], spans=[("0", 0, 1), ("0", 1, 1), ("0", 1, 3)]))
        (sample,) = await engine.generate(_request("run-1-0"))
        assert sample.versions.tolist() == [0, 0, 0]


async def test_a_hung_replica_leaves_the_rotation_when_a_request_times_out() -> None:
    """A replica that stops answering (generate and `/health` alike) failed a request at
    `request_timeout_s` but stayed UP: every later request of its sessions was sent there to
    wait out the deadline too (only a DOWN replica is probed, and nothing took it down)."""
    deadlines = {
        "request_timeout_s": 0.2,
        "health_timeout_s": 0.2,
        "control_timeout_s": 0.2,
        "liveness_timeout_s": 0.2,
        "pause_timeout_s": 0.2,
    }
    async with scripted(2, **deadlines) as (engine, stubs):
        await engine.check_replicas()  # both synced and UP
        hung = engine.replicas[1]
        stubs[1].hang = asyncio.Event()  # never set while the engine runs
        session = next(f"s{k}" for k in range(1000) if pick(engine.replicas, f"s{k}") is hung)
        request = msgspec.structs.replace(_request("run-0-0"), session=session)
        with pytest.raises(ReplicaError, match="request_timeout_s"):
            await engine.generate(request)
        await engine.wait_progress(lambda: hung.state is ReplicaState.DOWN, 10.0)
        (sample,) = await engine.generate(msgspec.structs.replace(request, request_id="run-1-0"))
        assert sample.tokens.tolist() == [7, 8]  # served by the other replica
        assert stubs[1].generates == 1


async def test_an_oversized_stream_line_fails_the_request_naming_the_replica() -> None:
    """A line longer than any event of the request's tokens can be raised aiohttp's
    `LineTooLong`, which is neither a `ReplicaError` nor a transport error: it named no
    replica and skipped the replica's health check."""
    async with scripted(1) as (engine, (stub,)):
        stub.stream = _sse(b'{"choices": [], "pad": "' + b"x" * (1 << 20) + b'"}', b"[DONE]")
        with pytest.raises(ReplicaError, match="line") as caught:
            await engine.generate(_request("run-0-0"))
        assert caught.value.url == engine.replicas[0].url


@pytest.mark.parametrize("index", [1, -1])
async def test_a_stream_choice_index_outside_the_request_fails_it_naming_the_replica(
    index: int,
) -> None:
    """A request of `n` samples has choices 0..n-1. Index n raised a bare `IndexError`;
    index -1 was taken, by Python's negative indexing, for the last sample."""
    async with scripted(1) as (engine, (stub,)):
        stub.stream = _stream(_choice([7, 8], index=index))
        with pytest.raises(ReplicaError, match=f"choice {index}") as caught:
            await engine.generate(_request("run-0-0"))
        assert caught.value.url == engine.replicas[0].url


async def test_a_hung_replica_leaves_the_rotation_when_its_caller_gives_up() -> None:
    """The producer's deadline (`generate_timeout_s`, 600 s by default) cancels a `generate`
    long before `request_timeout_s` (3600 s). The abort sent on the way out got no answer
    either, and was ignored: the replica stayed UP, and every group of its sessions waited
    out the producer's deadline in turn."""
    deadlines = {
        "health_timeout_s": 0.2,
        "control_timeout_s": 0.2,
        "liveness_timeout_s": 0.2,
        "pause_timeout_s": 0.2,
    }
    async with scripted(2, **deadlines) as (engine, stubs):
        await engine.check_replicas()
        hung = engine.replicas[1]
        stubs[1].hang = asyncio.Event()  # never set while the engine runs
        request = await _give_up_on_a_request_to(engine, hung, stubs[1])
        await engine.wait_progress(lambda: hung.state is ReplicaState.DOWN, 10.0)
        (sample,) = await engine.generate(msgspec.structs.replace(request, request_id="run-1-0"))
        assert sample.tokens.tolist() == [7, 8]  # served by the other replica


async def test_a_held_request_is_not_sent_to_a_replica_that_left_the_rotation_meanwhile() -> None:
    """A request is routed, then held while the engine is paused. If its replica fails the
    weight update meanwhile (it leaves the rotation: not resumed, maybe half loaded), the
    request was still sent there when admission reopened: into a paused vLLM it waits out
    its deadline, and one that answers serves it with weights the engine never confirmed.
    Not sent yet, it goes to a replica that serves."""
    async with scripted(2) as (engine, stubs):
        await engine.check_replicas()
        left = engine.replicas[1]
        session = next(f"s{k}" for k in range(1000) if pick(engine.replicas, f"s{k}") is left)
        await engine.pause_generation()
        request = msgspec.structs.replace(_request("run-0-0"), session=session)
        call = asyncio.ensure_future(engine.generate(request))
        await engine.wait_held(1, 5.0)
        stubs[1].failing.add("/update_weight_version")
        await engine.update_weights(None, version=1)
        assert left.state is ReplicaState.DOWN
        await engine.resume_generation()
        (sample,) = await asyncio.wait_for(call, 5.0)
        assert sample.tokens.tolist() == [7, 8]  # served by the other replica
        assert stubs[1].generates == 0


async def test_an_update_cancelled_part_way_leaves_no_replica_serving_its_label() -> None:
    """The producer bounds `update_weights` by `update_timeout_s`, and when it passes before
    the engine committed (`engine.version` still old) it calls nothing more. A replica
    relabelled before the cancellation kept the new label (a roll back to the old version,
    which the producer then made, was a no-op: the engine's own version had not moved), and
    stamped tokens with a version the producer never reached. Every replica the update
    touched must serve the engine's label again, with no further call."""
    async with scripted(2) as (engine, stubs):
        await engine.check_replicas()
        assert [s.label for s in stubs] == ["0", "0"]
        stubs[1].hang, stubs[1].hanging = asyncio.Event(), {"/update_weight_version"}
        update = asyncio.ensure_future(engine.update_weights(None, version=1))
        await asyncio.wait_for(stubs[0].progress.wait_until(lambda: stubs[0].label == "1"), 5)
        await asyncio.wait_for(
            stubs[1].progress.wait_until(lambda: "/update_weight_version" in stubs[1].calls), 5
        )
        stubs[1].hanging = set()  # only that call hangs, to the end: its label never lands
        update.cancel()
        with pytest.raises(asyncio.CancelledError):
            await update
        (sample,) = await engine.generate(_request("run-0-0"))
        assert sample.versions.tolist() == [0, 0]
        assert engine.version == 0
        assert [s.label for s in stubs] == ["0", "0"]


async def test_a_replica_failing_its_pause_leaves_and_comes_back_with_the_engines_state() -> None:
    """No replica answers `/pause`: it leaves the rotation, and the pause holds (no replica
    serving is a state, not death: the producer once stopped there). After the resume the
    replica comes back unpaused and requests flow."""
    async with scripted(1) as (engine, (stub,)):
        await engine.check_replicas()
        stub.failing.add("/pause")
        await engine.pause_generation()
        assert engine.replicas[0].state is ReplicaState.DOWN
        stub.failing.clear()
        await engine.resume_generation()
        await engine.check_replicas()  # back (as the next route's probe would bring it)
        (sample,) = await asyncio.wait_for(engine.generate(_request("run-0-0")), 5.0)
        assert sample.tokens.tolist() == [7, 8]
        assert stub.calls[-3:] == ["/resume", LIVENESS, GENERATE]


async def test_a_pause_cancelled_part_way_is_undone() -> None:
    """The producer bounds `pause_generation` by `abort_timeout_s` (30 s), under a hung
    replica's `control_timeout_s` (120 s). Cancelled there, the pause left admission held
    and the replicas whose `/pause` had answered paused: nothing ran again."""
    async with scripted(2) as (engine, stubs):
        await engine.check_replicas()
        stubs[1].hang, stubs[1].hanging = asyncio.Event(), {"/pause"}
        pause = asyncio.ensure_future(engine.pause_generation())
        await asyncio.wait_for(
            stubs[0].progress.wait_until(lambda: stubs[0].calls[-1:] == ["/pause"]), 5.0
        )
        await asyncio.wait_for(stubs[1].progress.wait_until(lambda: "/pause" in stubs[1].calls), 5)
        stubs[1].hanging = set()  # only that `/pause` hangs, to the end
        pause.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pause
        for stub in stubs:  # undone by the engine's own task: the caller is not held for it
            await asyncio.wait_for(
                stub.progress.wait_until(lambda s=stub: s.calls[-1] == "/resume"), 5
            )
        for k in range(4):
            (sample,) = await asyncio.wait_for(engine.generate(_request(f"run-{k}-0")), 5.0)
            assert sample.tokens.tolist() == [7, 8]


async def test_a_resume_that_fails_still_lets_requests_go() -> None:
    """No replica answers `/resume`: it leaves the rotation, and the engine is resumed all
    the same (it once stayed paused, admission held, while the producer went on); the
    replica comes back unpaused."""
    async with scripted(1) as (engine, (stub,)):
        await engine.check_replicas()  # in the rotation (a pause waits for no sync)
        await engine.pause_generation()
        stub.failing.add("/resume")
        await engine.resume_generation()
        assert engine.replicas[0].state is ReplicaState.DOWN
        stub.failing.clear()
        await engine.check_replicas()  # back (as the next route's probe would bring it)
        (sample,) = await asyncio.wait_for(engine.generate(_request("run-0-0")), 5.0)
        assert sample.tokens.tolist() == [7, 8]
        assert stub.calls[-3:] == ["/resume", LIVENESS, GENERATE]


async def test_a_resume_while_every_replica_is_resynced_is_no_dead_engine() -> None:
    """An update cut off part-way leaves every replica it reached out of the rotation until
    re-synced; the producer then resumes. The resume waits `pause_timeout_s` for the syncs
    (its bound), and one longer than that (a reload on a loaded machine) made the resume
    raise `EngineDeadError`: the producer stopped (the chaos run's cut_reset, once). No
    replica up while one is being synced is no dead engine: requests wait for the sync."""
    async with scripted(1, pause_timeout_s=0.2) as (engine, (stub,)):
        await engine.check_replicas()
        await engine.pause_generation()  # the producer's keep-mode pause around an update
        stub.hang, stub.hanging = asyncio.Event(), {"/update_weight_version"}
        update = asyncio.ensure_future(engine.update_weights(None, version=1))
        await asyncio.wait_for(
            stub.progress.wait_until(lambda: "/update_weight_version" in stub.calls), 5.0
        )
        update.cancel()
        with pytest.raises(asyncio.CancelledError):
            await update
        (replica,) = engine.replicas
        assert replica.state is ReplicaState.UNSYNCED
        await asyncio.wait_for(engine.resume_generation(), 5.0)  # its sync hangs at the label
        assert replica.state is ReplicaState.UNSYNCED
        request = asyncio.ensure_future(engine.generate(_request("run-0-0")))
        stub.hang.set()
        (sample,) = await asyncio.wait_for(request, 5.0)
        assert sample.tokens.tolist() == [7, 8]
        assert replica.state is ReplicaState.UP


def test_a_server_start_on_a_port_in_use_fails_instead_of_trusting_its_health(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`ServerProcess.start(port=...)` waits for `/health` on the port. When another server
    holds it (an earlier replica still stopping), that one answered, and `start` returned
    at once a replica whose own process could never bind. No vLLM here: the spawned process
    is replaced by one that only waits to be stopped."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    squatter = http.server.HTTPServer(("127.0.0.1", 0), Health)
    port = squatter.server_address[1]
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    spawned: list[list[str]] = []

    def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        spawned.append(args)
        # a stand-in server that never exits by itself: the launcher must stop it (no wait)
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], **kwargs)

    fake = types.SimpleNamespace(Popen=popen, DEVNULL=subprocess.DEVNULL, STDOUT=subprocess.STDOUT)
    monkeypatch.setattr(vllm_serve, "subprocess", fake)
    try:
        with pytest.raises(ServerStartError, match=f"port {port} .* in use"):
            ServerProcess.start("no-model", port=port, ready_timeout_s=60.0).stop()
    finally:
        squatter.shutdown()
        squatter.server_close()
    assert spawned == []


# A stand-in `vllm serve`: binds its --port as vLLM's API server does (exiting on "Address
# already in use" with vLLM's traceback's last line), then answers /health.
STAND_IN_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
port = int(sys.argv[sys.argv.index("--port") + 1])
try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as exc:
    sys.exit(f"OSError: {exc}")
server.serve_forever()
"""


def test_a_port_taken_before_the_server_binds_it_is_replaced_by_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The port `start` chose was free when chosen, but in the seconds before the server
    bound it another process took it (seen in a full suite run: vLLM's API server exited
    with `OSError: [Errno 98] Address already in use`, and the test failed). `start` starts
    the server again on a new port; a port the caller named is not replaced."""
    taker = socket.socket()
    taker.bind(("127.0.0.1", 0))
    taker.listen()
    taken = taker.getsockname()[1]
    ports = iter([taken, vllm_serve.free_port()])
    monkeypatch.setattr(vllm_serve, "free_port", lambda: next(ports))
    monkeypatch.setattr(vllm_serve, "_in_use", lambda port: False)  # taken after the check
    spawned: list[list[str]] = []

    def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        spawned.append(args)
        return subprocess.Popen([sys.executable, "-c", STAND_IN_SERVER, *args], **kwargs)

    fake = types.SimpleNamespace(Popen=popen, DEVNULL=subprocess.DEVNULL, STDOUT=subprocess.STDOUT)
    monkeypatch.setattr(vllm_serve, "subprocess", fake)
    try:
        server = ServerProcess.start("no-model", ready_timeout_s=60.0)
        try:
            assert server.url != f"http://127.0.0.1:{taken}"
            assert [a[a.index("--port") + 1] for a in spawned] == [
                str(taken),
                server.url.rsplit(":", 1)[1],
            ]
        finally:
            server.stop()
        with pytest.raises(ServerStartError, match="Address already in use"):
            ServerProcess.start("no-model", port=taken, ready_timeout_s=60.0)
        assert len(spawned) == 3
    finally:
        taker.close()


async def test_an_update_running_when_the_engine_closes_raises_engine_dead() -> None:
    """`close()` closes the HTTP session under the calls in flight; aiohttp then says
    `RuntimeError("Session is closed")`, which escaped `update_weights` (and a probe inside
    `generate`'s routing) instead of the `EngineDeadError` a closed engine raises."""
    async with scripted(2) as (engine, stubs):
        await engine.check_replicas()
        stubs[1].hang, stubs[1].hanging = asyncio.Event(), {"/pause"}
        update = asyncio.ensure_future(engine.update_weights(None, version=1))
        await asyncio.wait_for(stubs[1].progress.wait_until(lambda: "/pause" in stubs[1].calls), 5)
        await engine.close()
        with pytest.raises(EngineDeadError, match="closed"):
            await update


async def test_a_down_replica_whose_probe_hangs_does_not_stall_the_others_requests() -> None:
    """Routing probed every down replica due for it, and every request waited for the probe:
    with a replica's host unreachable (its `/health` hangs until `health_timeout_s`), every
    request to the replicas that serve stalled for that long, once every
    `health_interval_s`."""
    async with scripted(2, health_timeout_s=60.0) as (engine, stubs):
        await engine.check_replicas()
        down = engine.replicas[1]
        stubs[1].hang = asyncio.Event()  # set only at teardown
        down.mark_down("went away", retry_at=0.0)  # due for a probe now
        session = next(f"s{k}" for k in range(1000) if pick(engine.replicas, f"s{k}") is not down)
        request = msgspec.structs.replace(_request("run-0-0"), session=session)
        (sample,) = await asyncio.wait_for(engine.generate(request), 5.0)
        assert sample.tokens.tolist() == [7, 8]
        assert stubs[1].calls[-1] == "/health"  # probed, and the probe still waits
        assert down.state is ReplicaState.DOWN


async def test_a_replica_port_answering_not_http_fails_only_that_replica() -> None:
    """aiohttp's `ClientResponseError` (a bad status line) was neither a `ReplicaError` nor a
    transport error: it escaped every call to that replica, so the replica never left the
    rotation and every generate, pause and update failed, the healthy replica's included.
    Any error from talking to a replica is that replica's failure."""
    stub = ScriptedStub()
    async with served([stub.app()]) as (good,), not_http() as bad:
        engine = VLLMServerEngine([good, bad], vocab_size=512, health_timeout_s=5.0)
        try:
            for k in range(8):
                (sample,) = await asyncio.wait_for(engine.generate(_request(f"run-{k}-0")), 10)
                assert sample.tokens.tolist() == [7, 8]
            down = engine.replicas[1]
            assert down.state is ReplicaState.DOWN
            assert down.error is not None and "Bad status line" in down.error
            await asyncio.wait_for(engine.pause_generation(), 10)
            await asyncio.wait_for(engine.update_weights(None, version=1), 10)
            await asyncio.wait_for(engine.resume_generation(), 10)
            await asyncio.wait_for(engine.check_replicas(), 10)  # probed again: still down
            assert down.state is ReplicaState.DOWN
            (sample,) = await asyncio.wait_for(engine.generate(_request("run-9-0")), 10)
            assert sample.versions.tolist() == [0, 0]  # the stub's own label
        finally:
            await engine.close()


async def test_a_probe_of_a_down_replica_holds_nothing_a_pause_needs() -> None:
    """A probe of a down replica ran its `/health` and its whole re-sync (reload, cache
    reset, label: up to `control_timeout_s` each) under the engine-wide control lock. The
    producer bounds a pause by `abort_timeout_s` (30 s < 120 s): it timed out waiting for the
    lock, its undo waited on the same lock, and the run stopped while the other replica
    served."""
    async with scripted(2, control_timeout_s=60.0) as (engine, stubs):
        await engine.check_replicas()
        down = engine.replicas[1]
        stubs[1].hang, stubs[1].hanging = asyncio.Event(), {"/reset_prefix_cache"}
        down.mark_down("went away", retry_at=0.0)  # due for a probe now
        session = next(f"s{k}" for k in range(1000) if pick(engine.replicas, f"s{k}") is not down)
        request = msgspec.structs.replace(_request("run-0-0"), session=session)
        await asyncio.wait_for(engine.generate(request), 5.0)  # starts the probe
        await asyncio.wait_for(
            stubs[1].progress.wait_until(lambda: "/reset_prefix_cache" in stubs[1].calls), 5.0
        )
        await asyncio.wait_for(engine.pause_generation(), 5.0)
        await asyncio.wait_for(engine.update_weights(None, version=1), 5.0)
        await asyncio.wait_for(engine.resume_generation(), 5.0)
        assert stubs[0].label == "1"
        assert down.state is ReplicaState.DOWN  # its probe still waits


async def test_a_replica_is_paused_before_it_is_resynced() -> None:
    """A replica that left the rotation may still be streaming requests (it failed a
    control call, not its generates). Its re-sync reloaded, reset and relabelled it without a
    `/pause`: tokens the new weights sampled carried the old label."""
    async with scripted(1) as (engine, (stub,)):
        await engine.check_replicas()
        (replica,) = engine.replicas
        replica.mark_down("its /resume failed", retry_at=0.0)
        stub.calls.clear()
        await engine.check_replicas()
        assert replica.state is ReplicaState.UP
        resync = [c for c in stub.calls if c != "/health"]
        assert resync[0] == "/pause"
        assert resync.index("/reset_prefix_cache") > 0
        assert resync[-2:] == ["/resume", LIVENESS]  # then its engine core is tried


async def test_an_update_cancelled_at_its_resume_keeps_the_weights_it_committed(
    tmp_path: Path,
) -> None:
    """`update_weights` recorded the new folder and version before its final `/resume`; cut
    off there (the producer's `update_timeout_s`, a user's `wait_for`, Ctrl-C), its
    `except BaseException` deleted that folder. Every later re-sync of a replica then raised
    a bare `ValueError` (the folder was gone), and every request and update failed."""
    import torch

    async with scripted(2, weights_dir=tmp_path, pause_timeout_s=0.5) as (engine, stubs):
        await engine.check_replicas()
        stubs[1].calls.clear()
        stubs[1].hang, stubs[1].hanging = asyncio.Event(), {"/resume"}
        update = asyncio.ensure_future(engine.update_weights([("w", torch.ones(2))], version=1))
        await asyncio.wait_for(stubs[1].progress.wait_until(lambda: "/resume" in stubs[1].calls), 5)
        stubs[1].hanging = set()  # only that `/resume` hangs, to the end
        update.cancel()
        with pytest.raises(asyncio.CancelledError):
            await update
        served_folders = list(tmp_path.glob("asyncroll-v*"))  # noqa: ASYNC240
        assert engine.version == 1  # loaded and labelled everywhere: committed
        assert len(served_folders) == 1 and any(served_folders[0].glob("*.safetensors"))
        for replica in engine.replicas:
            replica.mark_down("restarted", retry_at=0.0)
        await asyncio.wait_for(engine.check_replicas(), 5.0)
        assert [r.state for r in engine.replicas] == [ReplicaState.UP] * 2
        assert [s.label for s in stubs] == [str(engine.version)] * 2


async def _cut_first_update_after_one_load(
    engine: VLLMServerEngine, stubs: list[ScriptedStub]
) -> None:
    """The engine's first update with new weights, cut off by its caller while replica 1
    loads them (replica 0 has), then the producer's roll back to version 0."""
    import torch

    stubs[1].hang, stubs[1].hanging = asyncio.Event(), {"/collective_rpc"}
    update = asyncio.ensure_future(engine.update_weights([("w", torch.ones(2))], version=1))
    await asyncio.wait_for(stubs[1].progress.wait_until(lambda: bool(stubs[0].loaded)), 5)
    await asyncio.wait_for(
        stubs[1].progress.wait_until(lambda: "/collective_rpc" in stubs[1].calls), 5
    )
    stubs[1].hanging = set()  # only that load hangs, to the end: it never lands
    update.cancel()
    with pytest.raises(asyncio.CancelledError):
        await update
    await engine.update_weights(None, version=0)  # the producer's roll back
    assert engine.version == 0


def _model_folder(path: Path) -> Path:
    """A checkpoint folder standing for the model a replica was started from."""
    import torch

    from asyncroll.engines.server import weights as server_weights

    path.mkdir()
    server_weights.write([("w", torch.zeros(2))], path, digest=False)
    return path.resolve()


async def test_a_first_update_cut_after_a_replica_loaded_leaves_it_serving_its_own_weights(
    tmp_path: Path,
) -> None:
    """Before any update commits, the engine serves "each replica's own" weights. A first
    update cut off after one replica loaded its folder left that replica (re-synced with
    nothing to reload) serving the cut update's weights under label 0: the chaos run's
    cut_load, cut_reset and cut_label (55-82 mislabelled tokens). It must reload the model
    it was started from (`/v1/models` names it)."""
    model = _model_folder(tmp_path / "model")
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    async with scripted(2, weights_dir=weights_dir) as (engine, stubs):
        for stub in stubs:
            stub.model = str(model)
        await engine.check_replicas()
        assert [s.loaded for s in stubs] == [[], []]  # nothing to reload at the first sync
        await _cut_first_update_after_one_load(engine, stubs)
        await asyncio.wait_for(engine.check_replicas(), 5.0)
        assert [r.state for r in engine.replicas] == [ReplicaState.UP] * 2
        assert stubs[0].loaded[-1] == str(model)  # its own weights again
        assert stubs[1].loaded[-1] == str(model)  # whatever its cut load did
        assert [s.label for s in stubs] == ["0", "0"]


async def test_a_first_update_cut_on_a_replica_whose_model_is_no_folder_keeps_it_out(
    tmp_path: Path,
) -> None:
    """A replica started from a Hugging Face repo id names no folder to reload its own
    weights from: after a cut first update reached it, it stays out of the rotation, its
    error naming the model and what to change, rather than serve the cut update's weights
    under label 0 (a repo id sent as a path would kill its vLLM engine)."""
    async with scripted(2, weights_dir=tmp_path) as (engine, stubs):
        for stub in stubs:
            stub.model = "org/some-model"
        await engine.check_replicas()
        await _cut_first_update_after_one_load(engine, stubs)
        await asyncio.wait_for(engine.check_replicas(), 5.0)
        assert [r.state for r in engine.replicas] == [ReplicaState.DOWN] * 2
        assert not any("org/some-model" in path for s in stubs for path in s.loaded)
        engine.request_timeout_s = 0.3  # no replica up: it waits for one to its deadline
        with pytest.raises(NoReplicaError, match=r"org/some-model.*local model folder"):
            await engine.generate(_request("run-0-0"))


@pytest.mark.parametrize(
    ("tokens", "label", "message"),
    [
        ([7, 2**31], "0", "token id 2147483648"),  # a bare OverflowError named no replica
        ([7, 512], "0", "token id 512"),  # outside the vocabulary
        ([7, -1], "0", "token id -1"),
        ([7, 8], str(2**31), "labelled '2147483648'"),  # a bare OverflowError too
        ([7, 8], "1_0", "labelled '1_0'"),  # int() read it as 10
        ([7, 8], "\u0663", "labelled '\u0663'"),  # an Arabic-Indic 3: int() read it as 3
        ([7, 8], " 1", "labelled ' 1'"),
    ],
)
async def test_token_ids_and_labels_are_parsed_strictly_naming_the_replica(
    tokens: list[int], label: str, message: str
) -> None:
    async with scripted(1) as (engine, (stub,)):
        stub.stream = _stream(_choice(tokens, spans=[(label, 0, 2)]))
        with pytest.raises(ReplicaError, match=message) as caught:
            await engine.generate(_request("run-0-0"))
        assert caught.value.url == engine.replicas[0].url
        with pytest.raises(ValueError, match="int32"):  # never set a label it cannot read
            await engine.update_weights(None, version=2**31)


async def test_a_wedged_replica_whose_health_answers_leaves_the_rotation_and_stays_out() -> None:
    """vLLM's `/health` reports a dead engine core, not a hung one. A replica whose generates
    and aborts hang while `/health` answers failed each group sent there (after the
    producer's deadline and the abort's), then passed its health check and stayed in the
    rotation: 48 groups failed in a row. Liveness now exercises the engine core."""
    deadlines = {
        "health_timeout_s": 0.2,
        "control_timeout_s": 0.2,
        "liveness_timeout_s": 0.2,
        "pause_timeout_s": 0.2,
    }
    async with scripted(2, **deadlines) as (engine, stubs):
        await engine.check_replicas()
        wedged = engine.replicas[1]
        stubs[1].hang = asyncio.Event()  # never set while the engine runs
        stubs[1].hanging = {GENERATE, LIVENESS, "/abort_requests"}  # `/health` answers
        request = await _give_up_on_a_request_to(engine, wedged, stubs[1])
        await engine.wait_progress(lambda: wedged.state is ReplicaState.DOWN, 10.0)
        await engine.check_replicas()  # its probe: `/health` answers, the engine core does not
        assert wedged.state is ReplicaState.DOWN
        assert wedged.failures == 2  # the circuit stays open, its next probe further off
        (sample,) = await engine.generate(msgspec.structs.replace(request, request_id="run-1-0"))
        assert sample.tokens.tolist() == [7, 8]  # served by the other replica
        assert stubs[1].generates == 1


def test_a_failing_replicas_probes_back_off_to_a_bound() -> None:
    waits = [backoff_s(5.0, failures) for failures in range(1, 10)]
    assert waits[:4] == [5.0, 10.0, 20.0, 40.0]
    assert max(waits) == waits[-1] == 5.0 * 2**MAX_BACKOFF_DOUBLINGS


def test_tokens_in_flight_are_within_the_payload_the_engine_declares() -> None:
    """A sample's streamed tokens wait here until its request ends, outside the buffer's
    byte bound unless `payload_bytes` counts them: it said 0, while Python lists of ints
    and floats held ~70 B a token."""
    from asyncroll.engines.server import replicas as rp
    from asyncroll.engines.server import samples as server_samples

    n, vocab = 5_000, 50_000
    event = json.dumps({"choices": [_choice([300 + (t % 40_000) for t in range(n)])]}).encode()
    engine = VLLMServerEngine("http://127.0.0.1:1", vocab_size=vocab)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        sample = server_samples.Sample()
        decoded = msgspec.json.decode(event, type=rp.StreamEvent)
        server_samples.append(sample, decoded.choices[0], "http://r:1", vocab)
        del decoded
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(sample.tokens) == n
    assert 0 < held <= engine.payload_bytes(n)


async def test_a_replica_hung_in_its_pause_leaves_the_rotation_within_the_pause_bound() -> None:
    """A pause waited `control_timeout_s` (120 s) for a replica whose `/pause` hung, past
    the producer's `abort_timeout_s` (30 s) that bounds it: the pause was undone and the run
    stopped while the other replica served. A pause now waits `pause_timeout_s` per call,
    and the engine states its bound (`pause_bound_s`) for the caller to compare."""
    async with scripted(2, control_timeout_s=60.0, pause_timeout_s=0.2) as (engine, stubs):
        await engine.check_replicas()
        stubs[1].hang, stubs[1].hanging = asyncio.Event(), {"/pause"}
        assert engine.pause_bound_s == 0.4
        await asyncio.wait_for(engine.pause_generation(), 30.0)  # not the 60 s control call
        assert [r.state for r in engine.replicas] == [ReplicaState.UP, ReplicaState.DOWN]
        await asyncio.wait_for(engine.resume_generation(), 30.0)
        (sample,) = await asyncio.wait_for(engine.generate(_request("run-0-0")), 30.0)
        assert sample.tokens.tolist() == [7, 8]


async def test_a_restarted_replicas_resync_holds_only_its_own_sessions() -> None:
    """A replica found serving a label the engine never set (restarted) is synced again, a
    full reload. Every route waited for every such sync, so the sessions of the replicas
    that served stalled behind one replica's reload (up to `control_timeout_s`)."""
    async with scripted(2, control_timeout_s=60.0) as (engine, stubs):
        await engine.check_replicas()
        restarted = engine.replicas[1]
        stubs[1].hang, stubs[1].hanging = asyncio.Event(), {"/reset_prefix_cache"}
        others = [f"s{k}" for k in range(1000) if pick(engine.replicas, f"s{k}") is not restarted]
        restarted.mark_unsynced("served tokens labelled 'default'")
        for k, session in enumerate(others[:4]):
            request = msgspec.structs.replace(_request(f"run-{k}-0"), session=session)
            (sample,) = await asyncio.wait_for(engine.generate(request), 5.0)
            assert sample.tokens.tolist() == [7, 8]
        assert "/reset_prefix_cache" in stubs[1].calls  # its re-sync started, and waits
        assert restarted.state is ReplicaState.UNSYNCED


async def test_a_generate_answered_with_bytes_that_are_not_http_fails_only_its_request() -> None:
    """The generate path had its own list of errors that count as the replica's
    (`TRANSPORT_ERRORS`); aiohttp's `ClientResponseError` for a bad status line was not on it
    and escaped bare, naming no replica. Its engine core answers (the liveness probe), so the
    replica stays: only the request failed."""
    async with scripted(2) as (engine, stubs):
        await engine.check_replicas()
        odd = engine.replicas[1]
        stubs[1].not_http = True
        session = next(f"s{k}" for k in range(1000) if pick(engine.replicas, f"s{k}") is odd)
        request = msgspec.structs.replace(_request("run-0-0"), session=session)
        with pytest.raises(ReplicaError, match="Bad status line") as caught:
            await asyncio.wait_for(engine.generate(request), 10.0)
        assert caught.value.url == odd.url
        await engine.wait_progress(lambda: engine._supervisors[odd].check is None, 10.0)
        assert odd.state is ReplicaState.UP  # alive: a liveness generate answered
        assert stubs[1].calls.count(LIVENESS) == 2  # its sync's, and the check after


async def test_a_request_failing_during_an_update_is_checked_by_a_generate_after_it() -> None:
    """An update pauses the replicas without pausing the engine. A request that failed then
    had its replica's liveness tried with a generate, which a paused vLLM queues until the
    resume: past `liveness_timeout_s` (a long reload), a healthy replica left the rotation.
    Asking `/health` instead let a hung engine core pass. The check now waits for the
    update's end and tries a generate; the replica stays meanwhile (the update needs it)."""
    deadlines = {"liveness_timeout_s": 1.0, "pause_timeout_s": 1.0}  # room for a loaded machine
    async with scripted(1, **deadlines) as (engine, (stub,)):
        await engine.check_replicas()
        (replica,) = engine.replicas
        stub.hang, stub.hanging = asyncio.Event(), {"/reset_prefix_cache"}
        update = asyncio.ensure_future(engine.update_weights(None, version=1))
        await asyncio.wait_for(
            stub.progress.wait_until(lambda: "/reset_prefix_cache" in stub.calls), 5.0
        )
        stub.calls.clear()
        failed = engine._supervisors[replica].failed(ReplicaError(replica.url, "a stream broke"))
        assert failed is not None
        stub.hang.set()
        await asyncio.wait_for(update, 5.0)
        await asyncio.wait_for(failed, 5.0)
        assert replica.state is ReplicaState.UP
        assert engine.version == 1
        assert "/health" not in stub.calls
        assert stub.calls.index(LIVENESS) > stub.calls.index("/resume")


async def _give_up_on_a_request_to(
    engine: VLLMServerEngine, replica: Replica, stub: ScriptedStub
) -> GenerateRequest:
    """Send a request to `replica` (by its session) and cancel it once `stub` (the replica)
    has it, as the producer does at its `generate_timeout_s`; returns the request."""
    session = next(f"s{k}" for k in range(1000) if pick(engine.replicas, f"s{k}") is replica)
    request = msgspec.structs.replace(_request("run-0-0"), session=session)
    sent = stub.generates
    call = asyncio.ensure_future(engine.generate(request))
    await asyncio.wait_for(stub.progress.wait_until(lambda: stub.generates > sent), 5.0)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    return request


def _wedge(stub: ScriptedStub) -> None:
    """Its generates hang (the liveness probe's too) while `/health`, `/abort_requests` and
    the other control routes answer: an engine core that never schedules."""
    stub.hang, stub.hanging = asyncio.Event(), {GENERATE, LIVENESS}


async def test_a_wedged_replica_leaves_the_rotation_when_callers_give_up_on_its_requests() -> None:
    """A wedged replica whose `/abort_requests` answers failed nothing the engine saw: the
    producer cancels each group at its `generate_timeout_s` (before the engine's own
    `request_timeout_s`), the abort answered, and a cancellation was no failure. It stayed
    in the rotation and got every group of its sessions (the chaos run's 140 late groups).
    A request its caller gives up on unfinished now has its replica checked."""
    deadlines = {"liveness_timeout_s": 1.0, "pause_timeout_s": 1.0}  # room for a loaded machine
    async with scripted(2, **deadlines) as (engine, stubs):
        await engine.check_replicas()
        wedged = engine.replicas[1]
        _wedge(stubs[1])
        request = await _give_up_on_a_request_to(engine, wedged, stubs[1])
        await asyncio.wait_for(  # sent after its caller gave up, not waited for
            stubs[1].progress.wait_until(lambda: "/abort_requests" in stubs[1].calls), 5.0
        )
        await engine.wait_progress(lambda: wedged.state is ReplicaState.DOWN, 10.0)
        assert "liveness generate" in str(wedged.error)
        (sample,) = await engine.generate(msgspec.structs.replace(request, request_id="run-1-0"))
        assert sample.tokens.tolist() == [7, 8]  # served by the other replica
        assert stubs[1].generates == 1


async def test_a_wedged_replica_failing_during_an_update_is_not_kept_on_its_health() -> None:
    """A failure check made while an update ran asked `/health` (a generate would wait for
    the resume), which a hung engine core passes: the wedged replica stayed. The check now
    waits for the update's end, then generates."""
    deadlines = {"liveness_timeout_s": 1.0, "pause_timeout_s": 1.0}  # room for a loaded machine
    async with scripted(2, **deadlines) as (engine, stubs):
        await engine.check_replicas()
        wedged = engine.replicas[1]
        stubs[0].hang, stubs[0].hanging = asyncio.Event(), {"/reset_prefix_cache"}
        update = asyncio.ensure_future(engine.update_weights(None, version=1))
        await asyncio.wait_for(
            stubs[0].progress.wait_until(lambda: "/reset_prefix_cache" in stubs[0].calls), 5.0
        )
        _wedge(stubs[1])
        failed = engine._supervisors[wedged].failed(ReplicaError(wedged.url, "a stream broke"))
        assert failed is not None
        stubs[0].hang.set()
        await asyncio.wait_for(update, 5.0)
        await asyncio.wait_for(failed, 5.0)
        assert wedged.state is ReplicaState.DOWN
        assert stubs[1].calls[-1] == LIVENESS


async def test_a_replica_seen_hung_does_not_come_back_on_its_health_while_paused() -> None:
    """A paused engine's replicas cannot generate, so a re-sync while paused tried only
    `/health`: a replica whose liveness generate had failed (a wedged engine core) came back
    at every pause. It now stays out until the resume lets a generate try it."""
    deadlines = {"liveness_timeout_s": 1.0, "pause_timeout_s": 1.0}  # room for a loaded machine
    async with scripted(2, **deadlines) as (engine, stubs):
        await engine.check_replicas()
        wedged = engine.replicas[1]
        _wedge(stubs[1])
        check = engine._supervisors[wedged].failed(ReplicaError(wedged.url, "a stream broke"))
        assert check is not None
        await check
        assert wedged.state is ReplicaState.DOWN
        await engine.pause_generation()
        wedged.retry_at = 0.0
        await engine.check_replicas()
        assert wedged.state is ReplicaState.DOWN  # `/health` answers; that is not enough
        assert stubs[1].hang is not None
        stubs[1].hang.set()  # its engine core serves again
        await engine.resume_generation()
        wedged.retry_at = 0.0
        await engine.check_replicas()
        assert wedged.state is ReplicaState.UP
        assert stubs[1].calls[-1] == LIVENESS  # back in on a generate
