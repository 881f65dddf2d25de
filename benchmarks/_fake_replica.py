"""A FAKE `vllm serve` replica for the replica chaos run (`replica_chaos.py`): a simulation.

Real `vllm serve` processes are too heavy to kill and restart dozens of times on 2 shared cores
(2.6 GiB and ~40 s per start), so this small aiohttp app stands in for one. It answers the
routes `VLLMServerEngine` uses with the shapes vLLM 0.32 gives them (see the team's
`vllm-serve-cpu.md` §2-3 and vLLM's `entrypoints/rl/online/api_router.py`):

* `GET /health`; `POST /pause?mode=keep|abort`, `/resume`, `GET /is_paused`;
  `POST /collective_rpc` (`reload_weights` with `kwargs.weights_path`, asyncroll's worker
  extension `asyncroll_load_path` with the path in `args` or `kwargs`, answered with a clean
  load report, and `asyncroll_process`, this process's identity; `compute_weight_checksums`;
  any other method is a 500);
  `/reset_prefix_cache` (`{"success": true}`), `/update_weight_version` (`{"new_version"}`),
  `GET /weight_info`, `/abort_requests` (ids `generate-tokens-<request_id>`), `GET /v1/models`
  (its `root`: the `--model` folder it was started from);
* `POST /inference/v1/generate`, streamed as server-sent events: `choices[].token_ids`,
  `logprobs.content[]`, `finish_reason`, and `weight_versions` spans on a choice's final
  chunk; `n` samples; a paused server freezes running streams and queues new requests.

What makes it useful for chaos: **every token says which weights sampled it.** "Weights" here
are one integer, `chaos.weights_id`, in the safetensors file a reload reads; each token id is
`weights_id * TOKEN_STRIDE + noise`, drawn with the weights loaded at the moment it is sampled,
and labelled with the version label set at that moment (as vLLM labels tokens). The harness
decodes every token it is handed and checks its label against the weights that sampled it.

A fresh process serves the `--model` folder's `weights_id` (0 in the harness) under vLLM's
initial label "default", as a restarted vLLM comes back with its original weights. A reload
of a path that is not a checkpoint answers 500 and the process exits (vLLM's engine dies on
the next request, and the server exits).

Chaos, set by the harness through routes under `/_chaos/` (not vLLM's): `wedged` (generate
never progresses while `/health` and the control routes answer), `slow` (a longer latency per
token), `garbage` (every vLLM route answers
bytes that are not HTTP on the same port; the harness's routes still answer), a one-shot stall
of one control route (to cut off a weight update exactly there; the
step completes late, once released, as a vLLM call the client gave up on still completes).
SIGKILL,
SIGSTOP/SIGCONT and restarts are done to the process from outside. Every generate request that
arrives is appended to `--arrivals` (monotonic time, mode, max_tokens), so the harness can
count requests a bad replica kept receiving. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import json
import logging
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO

from aiohttp import web

TOKEN_STRIDE = 16
"""Token id = weights_id * TOKEN_STRIDE + noise (< TOKEN_STRIDE): the weights that sampled it."""
WEIGHTS_TENSOR = "chaos.weights_id"
INITIAL_LABEL = "default"  # vLLM's label before any /update_weight_version
SERVER_PREFIX = "generate-tokens-"
GARBAGE = b"\x00\xff\xfeSSH-2.0-not-http\r\n\x1b[0m" + bytes(range(256))
PROCESS = uuid.uuid4().hex  # this process's identity, as the worker extension's
STALL_BOUND_S = 30.0  # a stalled route answers by then even if never released


def weights_of(token: int) -> int:
    """The weights id that sampled `token`."""
    return token // TOKEN_STRIDE


class Mode(enum.StrEnum):
    NORMAL = "normal"
    WEDGED = "wedged"
    SLOW = "slow"
    GARBAGE = "garbage"  # every vLLM route answers bytes that are not HTTP


class FakeReplica:
    """The state of one fake replica: its weights, label, pause, mode and running requests."""

    def __init__(self, args: argparse.Namespace, arrivals: TextIO) -> None:
        self.model: Path = args.model.resolve()
        self.weights_id = read_weights(str(self.model))
        self.label = INITIAL_LABEL
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.unwedged = asyncio.Event()
        self.unwedged.set()
        self.mode = Mode.NORMAL
        self.token_latency_s: float = args.token_latency_s
        self.slow_latency_s: float = args.slow_latency_s
        self.seed: int = args.seed
        self.running: dict[str, asyncio.Event] = {}  # server request id -> its abort
        self.stalls: dict[str, asyncio.Event] = {}  # route -> release, for the next call
        self.entered: set[str] = set()  # stalled routes whose call has arrived
        self.arrivals = arrivals

    # -- chaos ----------------------------------------------------------------------------------

    def set_mode(self, mode: Mode) -> None:
        self.mode = mode
        if mode is Mode.WEDGED:
            self.unwedged.clear()
        else:
            self.unwedged.set()

    @web.middleware
    async def garbage(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """In GARBAGE mode, answer every vLLM route with bytes that are not HTTP and close the
        connection (the `/_chaos/` routes still answer, for the harness)."""
        if self.mode is not Mode.GARBAGE or request.path.startswith("/_chaos/"):
            return await handler(request)
        if request.path == "/inference/v1/generate":
            max_tokens = (await request.json()).get("sampling_params", {}).get("max_tokens", -1)
            self.log_arrival(int(max_tokens))
        transport = request.transport
        if transport is not None:
            transport.write(GARBAGE)
            transport.close()
        raise ConnectionResetError("answered garbage")

    def log_arrival(self, max_tokens: int) -> None:
        self.arrivals.write(f"{time.monotonic():.4f} {self.mode.value} {max_tokens}\n")
        self.arrivals.flush()

    @web.middleware
    async def stall(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Hold the next call of an armed route until released (the cut-off point of an
        update), then serve it: its effect lands late, as a real one would."""
        release = self.stalls.pop(request.path, None)
        if release is not None:
            self.entered.add(request.path)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(release.wait(), STALL_BOUND_S)
        return await handler(request)

    # -- routes ---------------------------------------------------------------------------------

    async def health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def pause(self, request: web.Request) -> web.Response:
        self.unpaused.clear()
        if request.query.get("mode", "abort") == "abort":
            for abort in self.running.values():
                abort.set()
        return web.json_response({"status": "paused"})

    async def resume(self, _: web.Request) -> web.Response:
        self.unpaused.set()
        return web.json_response({"status": "resumed"})

    async def is_paused(self, _: web.Request) -> web.Response:
        return web.json_response({"is_paused": not self.unpaused.is_set()})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        method = body.get("method")
        args, kwargs = body.get("args") or [], body.get("kwargs") or {}
        if method == "asyncroll_process":  # the extension's identity of this process
            return web.json_response({"results": [PROCESS]})
        if method == "compute_weight_checksums":
            return web.json_response({"results": [{WEIGHTS_TENSOR: str(self.weights_id)}]})
        if method not in ("reload_weights", "asyncroll_load_path"):
            return web.json_response({"error": f"unknown method {method!r}"}, status=500)
        path = kwargs.get("weights_path") or kwargs.get("path") or (args[0] if args else None)
        try:
            self.weights_id = read_weights(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # vLLM's engine dies after a failed reload and its server exits: so does this one.
            asyncio.get_running_loop().call_later(0.05, os._exit, 1)
            return web.json_response({"error": f"reload of {path!r}: {exc}"}, status=500)
        if method == "asyncroll_load_path":  # the extension's report: nothing missed
            report = {"expected": [], "unloaded": [], "missing": []}
            return web.json_response({"results": [report]})
        return web.json_response({"results": [None]})

    async def reset_prefix_cache(self, _: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        new = (await request.json())["new_version"]
        self.label = str(new)
        return web.json_response({"success": True, "new_version": new})

    async def models(self, _: web.Request) -> web.Response:
        card = {"id": "fake", "object": "model", "root": str(self.model), "parent": None}
        return web.json_response({"object": "list", "data": [card]})

    async def weight_info(self, _: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.label})

    async def abort_requests(self, request: web.Request) -> web.Response:
        ids = (await request.json()).get("request_ids") or list(self.running)
        for rid in ids:
            if rid in self.running:
                self.running[rid].set()
        return web.json_response({"status": "aborted", "aborted": len(ids)})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("sampling_params", {})
        n, max_tokens = int(params.get("n", 1)), int(params["max_tokens"])
        interval = max(1, int(params.get("stream_interval") or 1))
        self.log_arrival(max_tokens)
        rid = SERVER_PREFIX + str(body["request_id"])
        abort = self.running[rid] = asyncio.Event()
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await reply.prepare(request)
            async for event in _Stream(self, rid, n, max_tokens, interval, abort).events():
                await reply.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await reply.write(b"data: [DONE]\n\n")
        except ConnectionError:
            pass  # the client went away (aiohttp's ClientConnectionResetError is one): vLLM aborts
        finally:
            del self.running[rid]
        return reply


class _Stream:
    """One generate request's samples: tokens drawn step by step, each with the weights and
    label of that moment; frozen while paused, stuck while wedged."""

    def __init__(
        self,
        fake: FakeReplica,
        rid: str,
        n: int,
        max_tokens: int,
        interval: int,
        abort: asyncio.Event,
    ) -> None:
        self.fake = fake
        self.rng = random.Random(f"{fake.seed}/{rid}")
        self.lengths = [self.rng.randint(1, max_tokens) for _ in range(n)]
        self.max_tokens = max_tokens
        self.interval = interval
        self.abort = abort
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.labels: list[list[str]] = [[] for _ in range(n)]
        self.sent = [0] * n  # tokens of each sample streamed so far
        self.closed = [False] * n  # its final chunk was streamed
        self.finish: list[str | None] = [None] * n

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """One event per step that has something due, until every sample finished."""
        while not all(self.finish):
            await self._step()
            choices = [c for i in range(len(self.tokens)) if (c := self._choice(i))]
            if choices:
                yield {"choices": choices}

    async def _step(self) -> None:
        """Wait out a pause or a wedge, then sample a token for every unfinished sample with
        the weights and label of that moment (no await between them)."""
        fake = self.fake
        await self._runnable()
        latency = fake.slow_latency_s if fake.mode is Mode.SLOW else fake.token_latency_s
        await asyncio.sleep(latency)
        await self._runnable()  # a pause that came during the step: sample after it
        for i, done in enumerate(self.finish):
            if done:
                continue
            if self.abort.is_set():
                self.finish[i] = "abort"
                continue
            token = fake.weights_id * TOKEN_STRIDE + self.rng.randrange(TOKEN_STRIDE)
            self.tokens[i].append(token)
            self.labels[i].append(fake.label)
            if len(self.tokens[i]) == self.lengths[i]:
                self.finish[i] = "length" if self.lengths[i] == self.max_tokens else "stop"

    async def _runnable(self) -> None:
        if not self.abort.is_set():
            await self.fake.unwedged.wait()
            await _first(self.fake.unpaused.wait(), self.abort.wait())

    def _choice(self, i: int) -> dict[str, Any] | None:
        new = self.tokens[i][self.sent[i] :]
        finish = self.finish[i]
        due = finish is not None or self.sent[i] == 0 or len(new) >= self.interval
        if self.closed[i] or not due or (not new and finish is None):
            return None
        self.sent[i] = len(self.tokens[i])
        self.closed[i] = finish is not None
        choice: dict[str, Any] = {
            "index": i,
            "token_ids": new,
            "finish_reason": finish,
            "logprobs": {
                "content": [
                    {"token_id": t, "logprob": -self.rng.random() * 3, "rank": 1} for t in new
                ]
            },
        }
        if finish is not None:
            choice["weight_versions"] = spans(self.labels[i])
        return choice


async def _first(*waits: Awaitable[Any]) -> None:
    """Return when the first of `waits` does (the others are cancelled)."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def spans(labels: list[str]) -> list[dict[str, Any]]:
    """vLLM's weight-version spans: runs of one label over the output tokens."""
    out: list[dict[str, Any]] = []
    for k, label in enumerate(labels):
        if out and out[-1]["version"] == label:
            out[-1]["end"] = k + 1
        else:
            out.append({"version": label, "start": k, "end": k + 1})
    return out


def read_weights(path: Any) -> int:
    """The weights id in a checkpoint folder (or file), as `reload_weights` would load it."""
    from safetensors.numpy import load_file

    if not isinstance(path, str):
        raise TypeError(f"no path: {path!r}")
    target = Path(path)
    files = sorted(target.glob("*.safetensors")) if target.is_dir() else [target]
    if not files or not files[0].is_file():
        raise ValueError(f"{path}: no *.safetensors")
    return int(load_file(str(files[0]))[WEIGHTS_TENSOR].reshape(-1)[0])


def app(fake: FakeReplica) -> web.Application:
    application = web.Application(middlewares=[fake.garbage, fake.stall])
    r = application.router
    r.add_get("/health", fake.health)
    r.add_post("/pause", fake.pause)
    r.add_post("/resume", fake.resume)
    r.add_get("/is_paused", fake.is_paused)
    r.add_post("/collective_rpc", fake.collective_rpc)
    r.add_post("/reset_prefix_cache", fake.reset_prefix_cache)
    r.add_post("/update_weight_version", fake.update_weight_version)
    r.add_get("/weight_info", fake.weight_info)
    r.add_get("/v1/models", fake.models)
    r.add_post("/abort_requests", fake.abort_requests)
    r.add_post("/inference/v1/generate", fake.generate)

    async def mode(request: web.Request) -> web.Response:
        fake.set_mode(Mode((await request.json())["mode"]))
        return web.json_response({"mode": fake.mode.value})

    async def arm(request: web.Request) -> web.Response:
        route = (await request.json())["route"]
        fake.stalls[route] = asyncio.Event()
        fake.entered.discard(route)
        return web.json_response({"armed": route})

    async def entered(request: web.Request) -> web.Response:
        return web.json_response({"entered": request.query["route"] in fake.entered})

    async def release(_: web.Request) -> web.Response:
        for event in fake.stalls.values():
            event.set()
        fake.stalls.clear()
        return web.json_response({})

    r.add_post("/_chaos/mode", mode)
    r.add_post("/_chaos/stall", arm)
    r.add_get("/_chaos/stall", entered)
    r.add_post("/_chaos/release", release)
    return application


async def serve(args: argparse.Namespace, arrivals: TextIO) -> None:
    # A simulation's own logs are noise in the run's output: aiohttp logs every connection
    # that the garbage mode closes, and every stream whose client went away.
    logging.getLogger("aiohttp").setLevel(logging.CRITICAL)
    fake = FakeReplica(args, arrivals)
    if args.stall:
        fake.stalls[args.stall] = asyncio.Event()
    runner = web.AppRunner(app(fake), access_log=None, handle_signals=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port, reuse_address=True)
    await site.start()
    await asyncio.Event().wait()  # until the harness signals the process


def main() -> None:
    p = argparse.ArgumentParser(description="A fake vllm serve replica (a simulation).")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", type=Path, required=True, help="a checkpoint folder it serves")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-latency-s", type=float, default=0.002)
    p.add_argument("--slow-latency-s", type=float, default=0.05)
    p.add_argument("--arrivals", type=Path, required=True)
    p.add_argument("--stall", help="a route whose first call is held until /_chaos/release")
    args = p.parse_args()
    with args.arrivals.open("a") as arrivals:
        asyncio.run(serve(args, arrivals))


if __name__ == "__main__":
    main()
