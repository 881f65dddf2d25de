"""A deterministic SIMULATION of `VLLMServerEngine`'s control plane: the real engine against N
simulated `vllm serve` replicas on a virtual clock, no sockets, no sleeps.

The engine runs unchanged; its HTTP sessions (`server_client.Sessions`, the seam) answer as
simulated replicas, in process. The event loop's clock is virtual: when nothing is ready, it
jumps to the next timer (`_Selector.select`), so a run of minutes of replica time takes
milliseconds, and a run is a function of its seed (one thread, FIFO callbacks, no I/O).
Nothing ready and nothing scheduled is itself a failure: some caller waits with no deadline.

Each seed draws a schedule (`_Schedule`): replicas (1-3), requests of several sessions with
caller deadlines and aborts, a trainer loop of keep-mode pauses, updates from fresh or
rewritten ("latest") folders, relabels and updates cut at random points, and faults: crashes,
restarts (vLLM's label "default", its own weights), wedged engine cores, slow reloads,
refused loads; with `--paused-elsewhere` also pauses by another client of the replica (mode
"wait": vLLM >= 0.33 refuses every new request until the resume, `asyncroll.engines.vllm.refusals`).
The invariants (`_check`, after every request and control call, and at the end):

* every token's label names the weights that sampled it (a token id encodes its weights);
* no prompt is lost or sent twice (each request id reaches at most one replica, once);
* no caller waits past its deadline (its own, or `request_timeout_s` / `pause_bound_s`);
* a request refused by a replica paused elsewhere fails only once the pause outlasted its
  deadline (`EnginePausedError`, within one backoff of a refusal), never as the replica's
  failure, and the replica stays in the rotation;
* the run stops only when no replica can ever serve (`EngineDeadError` never, unclosed);
* once faults heal, every replica is back within its bound, unpaused, under the engine's
  label (a replica the engine counts up but left paused fails here).

    python benchmarks/control_sim.py --seeds 10000        # seeds/s, failures with their seed
    python benchmarks/control_sim.py --replay 1234 -v     # one seed, its event trace
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import multiprocessing
import os
import random
import selectors
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import numpy as np

from asyncroll.engines import (
    EngineDeadError,
    GenerateRequest,
    ReplicaError,
    SampleRequest,
    SamplingConfig,
    VLLMServerEngine,
)
from asyncroll.engines.server.replicas import NoReplicaError
from asyncroll.engines.vllm.refusals import RETRY_MAX_S, EnginePausedError
from asyncroll.engines.vllm.weight_check import WeightMismatchError

STRIDE = 16  # token id = weights * STRIDE + noise: which weights sampled it
TOKEN_S = 0.01  # virtual seconds per sampled token
SLACK_S = 1e-6
# asyncio's own constants, as `VirtualLoop._run_once` copies `BaseEventLoop._run_once`
_MIN_SCHEDULED_TIMER_HANDLES = asyncio.base_events._MIN_SCHEDULED_TIMER_HANDLES  # type: ignore[attr-defined]
_MIN_CANCELLED_TIMER_HANDLES_FRACTION = asyncio.base_events._MIN_CANCELLED_TIMER_HANDLES_FRACTION  # type: ignore[attr-defined]
_MAX_SELECT_S = asyncio.base_events.MAXIMUM_SELECT_TIMEOUT  # type: ignore[attr-defined]


class Stuck(RuntimeError):
    """Nothing ready, nothing scheduled: a caller waits with no deadline."""


class _Selector(selectors.BaseSelector):
    """A selector with no I/O: `select` moves the virtual clock to the next timer."""

    def __init__(self, clock: list[float]) -> None:
        self._clock = clock
        self._map: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._map[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._map.pop(fd)

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise Stuck("nothing ready and nothing scheduled: a wait with no deadline")
        self._clock[0] += max(timeout, 0.0)
        return []

    def get_map(self) -> Any:
        return self._map

    def close(self) -> None:
        self._map.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._now = [0.0]
        super().__init__(_Selector(self._now))

    def time(self) -> float:
        return self._now[0]

    def _run_once(self) -> None:
        """CPython 3.11's `BaseEventLoop._run_once` step for step, its I/O poll the virtual
        clock's jump (`_Selector.select`), no debug branch: the same callbacks in the same
        order, less of the generic loop's overhead (the simulation's hottest frame)."""
        scheduled = self._scheduled
        sched_count = len(scheduled)
        if (
            sched_count > _MIN_SCHEDULED_TIMER_HANDLES
            and self._timer_cancelled_count / sched_count > _MIN_CANCELLED_TIMER_HANDLES_FRACTION
        ):
            kept = []
            for handle in scheduled:
                if handle._cancelled:
                    handle._scheduled = False
                else:
                    kept.append(handle)
            heapq.heapify(kept)
            self._scheduled = scheduled = kept
            self._timer_cancelled_count = 0
        else:
            while scheduled and scheduled[0]._cancelled:
                self._timer_cancelled_count -= 1
                heapq.heappop(scheduled)._scheduled = False
        ready = self._ready
        now = self._now
        if not (ready or self._stopping):
            if not scheduled:
                raise Stuck("nothing ready and nothing scheduled: a wait with no deadline")
            timeout = min(max(0, scheduled[0]._when - now[0]), _MAX_SELECT_S)
            now[0] += max(timeout, 0.0)  # as `_Selector.select`
        end_time = now[0] + self._clock_resolution
        while scheduled:
            handle = scheduled[0]
            if handle._when >= end_time:
                break
            handle = heapq.heappop(scheduled)
            handle._scheduled = False
            ready.append(handle)
        popleft = ready.popleft
        for _ in range(len(ready)):
            handle = popleft()
            if not handle._cancelled:
                handle._run()
        handle = None  # breaks a cycle when an exception occurs (as asyncio)


# -- simulated replicas -----------------------------------------------------------------------


class World:
    """What the trainer wrote: folder -> the weights id it holds now (the sim's file
    content), and the trace of a run."""

    def __init__(self, root: Path, verbose: bool) -> None:
        self.root = root
        self.content: dict[str, int] = {}
        self.trace: list[str] = []
        self.verbose = verbose
        self.loop: VirtualLoop | None = None

    def log(self, what: str) -> None:
        assert self.loop is not None
        line = f"{self.loop.time():9.3f} {what}"
        self.trace.append(line)
        if self.verbose:
            print(line)

    def folder(self, name: str, weights: int) -> Path:
        """A checkpoint folder holding `weights` (a real file: the engine seals it)."""
        path = self.root / name
        path.mkdir(exist_ok=True)
        file = path / "model.safetensors"
        file.write_bytes(b"sim" + str(weights).encode())
        self.content[str(path.resolve())] = weights
        return path


class SimReplica:
    def __init__(self, world: World, name: str, own: Path, rng: random.Random) -> None:
        self.world, self.name, self.own, self.rng = world, name, own, rng
        self.weights, self.label, self.paused = 0, "default", False
        self.crashed = self.wedged = False
        self.refuse = False  # its next load reports a missing tensor
        self.sluggish = False  # its control calls take up to 0.45 s (within every deadline)
        self.lives = 0  # restarts so far: a call the last process took dies with it
        self.reload_s = 0.05
        self.changed = asyncio.Event()  # pause, resume, wedge or abort changes: streams look
        self.aborted: set[str] = set()
        self.arrivals: list[str] = []
        self.faulty = False  # a fault was injected: it may leave the rotation
        # paused by another client in mode "wait" (vLLM >= 0.33): new requests are refused
        self.refusing = False
        self.refused_at = -1.0  # loop time of its last refusal

    def poke(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def come_back(self) -> None:
        """The end of a restart's downtime (unless the harness brought it back already)."""
        if self.crashed:
            self.restart()

    def restart(self) -> None:
        self.lives += 1
        self.weights, self.label, self.paused = 0, "default", False
        self.crashed = self.wedged = self.refuse = False
        self.poke()

    async def handle(self, method: str, path: str, body: Any) -> tuple[int, bytes]:
        if self.world.verbose:
            self.world.log(f"  {self.name} <- {method} {path} {json.dumps(body)[:80]}")
        life = self.lives
        await asyncio.sleep(self.rng.choice([0.0, 0.001, 0.005]))  # a call takes a moment
        if self.sluggish:  # within every deadline
            await asyncio.sleep(self.rng.uniform(0.0, 0.45))
        if self.crashed or self.lives != life:  # a restart meanwhile: its connection is gone
            raise aiohttp.ClientConnectionError(f"{self.name}: connection refused")
        route = path.split("?")[0]
        if route == "/health":
            return 200, b""
        if route == "/pause":  # keep mode, which takes new requests again (vLLM: core.py
            self.paused, self.refusing = True, False  # reject_new_requests = mode != "keep")
            self.poke()
            return 200, b"{}"
        if route == "/resume":
            self.paused, self.refusing = False, False
            self.poke()
            return 200, b"{}"
        if route == "/update_weight_version":
            self.label = str(body["new_version"])
            return 200, b'{"success": true}'
        if route == "/weight_info":
            return 200, json.dumps({"weight_version": self.label}).encode()
        if route == "/reset_prefix_cache":
            return 200, b'{"success": true}'
        if route == "/abort_requests":
            self.aborted.update(body["request_ids"])
            self.poke()
            return 200, b"{}"
        if route == "/v1/models":
            card = {"id": "sim", "root": str(self.own), "parent": None}
            return 200, json.dumps({"data": [card]}).encode()
        if route == "/collective_rpc" and body["method"] == "asyncroll_process":
            return 200, json.dumps({"results": [f"{self.name}.{self.lives}"]}).encode()
        if route == "/collective_rpc":
            await asyncio.sleep(self.reload_s)
            if self.crashed:
                raise aiohttp.ClientConnectionError(f"{self.name}: died in its reload")
            report: dict[str, Any] = {"expected": ["w"], "unloaded": [], "missing": []}
            if self.refuse:
                self.refuse = False
                report["missing"] = ["w"]
                self.weights = -1  # partly loaded: no version names these weights
            else:
                self.weights = self.world.content[body["kwargs"]["path"]]
            return 200, json.dumps({"results": [report]}).encode()
        return 404, b"no such route"

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        rid = "generate-tokens-" + body["request_id"]
        live = body["request_id"].startswith("asyncroll-liveness")
        if self.refusing:  # vLLM 0.33/0.34's refusal in a stream: nothing runs
            self.refused_at = asyncio.get_running_loop().time()
            if self.world.verbose:
                self.world.log(f"  {self.name} <- generate {rid}: refused, paused elsewhere")
            error = {
                "message": "Generation is paused. Please retry after it resumes.",
                "type": "ServiceUnavailableError",
                "param": None,
                "code": 503,
            }
            yield b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
        if not live:
            self.arrivals.append(rid)
        if self.world.verbose:
            self.world.log(f"  {self.name} <- generate {rid} (w={self.weights} {self.label})")
        params = body["sampling_params"]
        n, max_tokens = int(params["n"]), int(params["max_tokens"])
        lengths = [self.rng.randint(1, max_tokens) for _ in range(n)]
        tokens: list[list[int]] = [[] for _ in range(n)]
        labels: list[list[str]] = [[] for _ in range(n)]
        done = [False] * n
        await asyncio.sleep(self.rng.choice([0.0, 0.1, 0.3]))  # queued behind others' work
        while not all(done):
            while (self.paused or self.wedged or self.crashed) and rid not in self.aborted:
                if self.crashed:
                    raise aiohttp.ClientPayloadError(f"{self.name}: connection lost")
                await self.changed.wait()
            await asyncio.sleep(TOKEN_S)
            if self.crashed:
                raise aiohttp.ClientPayloadError(f"{self.name}: connection lost")
            if (self.paused or self.wedged) and rid not in self.aborted:
                continue  # frozen: sample after the resume (an abort ends it, as vLLM's)
            choices = []
            for i in range(n):
                if done[i]:
                    continue
                finish = None
                if rid in self.aborted:
                    finish = "abort"
                else:
                    tokens[i].append(self.weights * STRIDE + self.rng.randrange(STRIDE))
                    labels[i].append(self.label)
                    if len(tokens[i]) == lengths[i]:
                        finish = "length" if lengths[i] == max_tokens else "stop"
                if finish is not None:
                    done[i] = True
                    choices.append(_choice(i, tokens[i], labels[i], finish))
            if choices:
                yield b"data: " + json.dumps({"choices": choices}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"


def _choice(i: int, tokens: list[int], labels: list[str], finish: str) -> dict[str, Any]:
    spans: list[dict[str, Any]] = []
    for k, label in enumerate(labels):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = k + 1
        else:
            spans.append({"version": label, "start": k, "end": k + 1})
    return {
        "index": i,
        "token_ids": tokens,
        "finish_reason": finish,
        "logprobs": {"content": [{"token_id": t, "logprob": -1.0} for t in tokens]},
        "weight_versions": spans,
    }


class _Content:
    def __init__(self, body: bytes, lines: AsyncIterator[bytes] | None) -> None:
        self._body, self._lines, self._buffer = body, lines, b""

    async def read(self, n: int) -> bytes:
        chunk, self._body = self._body[:n], self._body[n:]
        return chunk

    async def readline(self, max_line_length: int = 0) -> bytes:
        while b"\n" not in self._buffer:
            if self._lines is None:
                line, self._buffer = self._buffer, b""
                return line
            try:
                self._buffer += await anext(self._lines)
            except StopAsyncIteration:
                self._lines = None
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line + b"\n"


class _Reply:
    def __init__(self, status: int, content: _Content) -> None:
        self.status, self.content = status, content


class SimSession:
    """An `aiohttp.ClientSession` as far as the engine uses one, answered by `replicas`."""

    def __init__(self, replicas: dict[str, SimReplica], limit: int) -> None:
        self._replicas = replicas
        self.closed = False
        # aiohttp's pool: at most `limit` connections (0: no limit), a stream holding one
        self._pool = asyncio.Semaphore(limit) if limit else None

    def _replica(self, url: str) -> tuple[SimReplica, str]:
        host, _, path = url.removeprefix("http://").partition("/")
        return self._replicas[host], "/" + path

    def request(self, method: str, url: str, json: Any = None, headers: Any = None) -> _Request:
        return _Request(self, method, url, json)

    def post(self, url: str, json: Any = None) -> _Post:
        return _Post(self, url, json)

    async def close(self) -> None:
        self.closed = True


# `SimSession`'s calls as plain async context managers (no generator per call; the same awaits
# in the same order as `contextlib.asynccontextmanager` ran them, so the same schedule)


class _Request:
    """A control call: a connection from the pool while the replica answers, then its reply."""

    __slots__ = ("_json", "_method", "_session", "_url")

    def __init__(self, session: SimSession, method: str, url: str, json: Any) -> None:
        self._session, self._method, self._url, self._json = session, method, url, json

    async def __aenter__(self) -> _Reply:
        session = self._session
        if session.closed:
            raise RuntimeError("Session is closed")
        replica, path = session._replica(self._url)
        pool = session._pool
        if pool is not None:
            await pool.acquire()
        try:
            await asyncio.sleep(0)
            status, body = await replica.handle(self._method, path, self._json)
        finally:
            if pool is not None:
                pool.release()
        return _Reply(status, _Content(body, None))

    async def __aexit__(self, *exc: object) -> None:
        return None


class _Post:
    """A generate stream: holds a connection from the pool until the stream is closed."""

    __slots__ = ("_json", "_lines", "_session", "_url")

    def __init__(self, session: SimSession, url: str, json: Any) -> None:
        self._session, self._url, self._json = session, url, json
        self._lines: Any = None

    async def __aenter__(self) -> _Reply:
        session = self._session
        if session.closed:
            raise RuntimeError("Session is closed")
        replica, _ = session._replica(self._url)
        pool = session._pool
        if pool is not None:
            await pool.acquire()
        try:
            if replica.crashed:
                raise aiohttp.ClientConnectionError(f"{replica.name}: connection refused")
            await asyncio.sleep(0)
        except BaseException:
            if pool is not None:
                pool.release()
            raise
        self._lines = replica.stream(self._json)
        return _Reply(200, _Content(b"", self._lines))

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self._lines.aclose()
        finally:
            if self._session._pool is not None:
                self._session._pool.release()


# -- one seed ---------------------------------------------------------------------------------


class Violation(AssertionError):
    pass


class Run:
    """One seed's schedule and its invariant checks."""

    def __init__(
        self,
        seed: int,
        root: Path,
        verbose: bool = False,
        sluggish: bool = False,
        paused_elsewhere: bool = False,
    ) -> None:
        self.seed = seed
        self.sluggish = sluggish  # draw the sluggish fault too (`--sluggish`)
        self.paused_elsewhere = paused_elsewhere  # and pauses by others (`--paused-elsewhere`)
        self.rng = random.Random(seed)
        self.world = World(root, verbose)
        self.n = self.rng.choice([1, 2, 2, 3])
        own = self.world.folder("own", 0)
        self.replicas = {
            f"r{i}": SimReplica(self.world, f"r{i}", own, random.Random(f"{seed}/{i}"))
            for i in range(self.n)
        }
        self.version_weights: dict[int, int] = {0: 0}  # label -> weights it was put on
        self.first: Violation | None = None
        self.next_version = 1
        self.request_timeout_s = 3.0
        self.engine = VLLMServerEngine(
            [f"http://{name}" for name in self.replicas],
            vocab_size=STRIDE * 1024,
            request_timeout_s=self.request_timeout_s,
            control_timeout_s=2.0,
            health_timeout_s=0.5,
            health_interval_s=0.05,
            liveness_timeout_s=0.5,
            pause_timeout_s=0.5,
            max_connections=self.rng.choice([2, 4, 512]),
            sessions=lambda limit: SimSession(self.replicas, limit),  # type: ignore[arg-type,return-value]
        )

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            violation = Violation(f"seed {self.seed}: {what}")
            if self.first is None:  # the cause: what follows it may be its consequences
                self.first = violation
            raise violation

    def invariants(self) -> None:
        """What holds after every request and control call: a replica never given a fault
        stays in the rotation (a healthy one marked down or hung is a control-plane fault);
        with no pause or update under way, no replica the engine counts up is paused."""
        state = self.engine._state
        for replica, sim in zip(self.engine.replicas, self.replicas.values(), strict=True):
            self.check(
                sim.faulty or replica.state.value != "down",
                f"{sim.name}, never faulty, left the rotation: {replica.error}",
            )
            if not (state.busy or state.paused or state.closed) and replica.state.value == "up":
                self.check(not sim.paused, f"{sim.name} is counted up but paused")

    async def timed(
        self,
        what: str,
        deadline: float,
        call: Callable[[], Any],
        *,
        control: bool = True,
        bound: bool = False,
    ) -> Any:
        """`call()` under the caller's `deadline`, as the producer bounds it: a `generate`
        by asyncio's timeout (which cancels once), a `control` call by asyncio's or anyio's
        cancel scope (which cancels every await after it, cleanups included); checks it
        ended by then. `bound`: the deadline is the engine's own bound on the call
        (`pause_bound_s`), which it must end within, never be cut at."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.world.log(f"{what}: called")
        try:
            if control and self.rng.random() < 0.5:
                with anyio.move_on_after(deadline):
                    return await call()
                self.world.log(f"{what}: cut by its caller's scope at {deadline:.3f} s")
                self.check(not bound, f"{what} outlasted the engine's bound, {deadline:.3f} s")
                return None
            async with asyncio.timeout(deadline):
                return await call()
        except TimeoutError:
            self.world.log(f"{what}: cut by its caller at {deadline:.3f} s")
            self.check(not bound, f"{what} outlasted the engine's bound, {deadline:.3f} s")
            return None
        except EngineDeadError as exc:
            self.check(False, f"{what}: the run stopped: {exc}")
        finally:
            took = loop.time() - start
            self.check(took <= deadline + SLACK_S, f"{what} took {took:.3f} s > {deadline:.3f}")
            self.invariants()

    async def request(self, k: int) -> None:
        rng = self.rng
        await asyncio.sleep(rng.uniform(0, 2.0))
        rid = f"g{k}-0"
        tokens = rng.randint(1, 6)
        request = GenerateRequest(
            request_id=rid,
            prompt_tokens=np.array([1, 2], np.int32),
            samples=tuple(SampleRequest(np.zeros(0, np.int32), tokens) for _ in range(2)),
            sampling=SamplingConfig(max_new_tokens=tokens, temperature=1.0),
            session=f"s{rng.randrange(4)}",
        )
        deadline = rng.choice([0.3, 1.0, 5.0, 5.0])
        aborted: list[float] = []
        loop = asyncio.get_running_loop()

        async def abort() -> None:  # within one control call (`pause_timeout_s`) itself
            aborted.append(loop.time())
            await self.engine.abort(rid)
            took = loop.time() - aborted[0]
            bound = self.engine.pause_timeout_s + SLACK_S
            self.check(took <= bound, f"abort({rid}) took {took:.3f} s > {bound:.3f} s")

        abort_after = rng.uniform(0, 0.5) if rng.random() < 0.3 else None
        if abort_after is not None:  # its timer runs from the call on
            loop.call_later(abort_after, lambda: asyncio.ensure_future(abort()))

        async def call() -> Any:
            try:
                return await self.engine.generate(request)
            except EnginePausedError:
                now = loop.time()
                late = min(now - r.refused_at for r in self.replicas.values())
                self.check(late <= RETRY_MAX_S + SLACK_S, f"{rid}: paused error {late:.3f} s late")
                self.world.log(f"{rid}: failed: paused elsewhere past its deadline")
                return None
            except (ReplicaError, NoReplicaError, WeightMismatchError) as exc:
                if isinstance(exc, ReplicaError):  # only a faulty replica fails a request
                    sim = self.replicas[exc.url.removeprefix("http://")]
                    self.check(sim.faulty, f"{rid} failed on {sim.name}, never faulty: {exc}")
                self.world.log(f"{rid}: failed: {type(exc).__name__}")
                return None

        outputs = await self.timed(rid, min(deadline, self.request_timeout_s), call, control=False)
        if aborted:  # an abort ends a request within one control call and a token's time
            late = loop.time() - aborted[0]
            bound = self.engine.pause_timeout_s + 2 * TOKEN_S
            self.check(late <= bound, f"{rid} ended {late:.3f} s after its abort")
        for sample in outputs or ():
            for token, version in zip(
                sample.tokens.tolist(), sample.versions.tolist(), strict=True
            ):
                weights = self.version_weights.get(version)
                self.check(
                    weights == token // STRIDE,
                    f"{rid}: a token of weights {token // STRIDE} labelled {version}"
                    f" (put on weights {weights})",
                )
        self.world.log(f"{rid}: ended ({'ok' if outputs else 'none'})")

    async def trainer(self) -> None:
        rng, engine = self.rng, self.engine
        bound = engine.pause_bound_s + SLACK_S
        for step in range(rng.randint(2, 5)):
            await asyncio.sleep(rng.uniform(0.05, 0.6))
            kind = rng.choice(["fresh", "latest", "relabel", "pause"])
            version = self.next_version
            self.next_version += 1
            cut = rng.choice([None, None, rng.uniform(0.0, 0.3)])
            if kind == "pause":
                pause = engine.pause_generation
                await self.timed("pause", cut or bound, pause, bound=cut is None)
                await asyncio.sleep(rng.uniform(0, 1.0))  # longer than a liveness probe
                await self.timed("resume", bound, engine.resume_generation, bound=True)
                continue
            if kind == "relabel":
                self.version_weights[version] = self.version_weights[engine.version]

                async def relabel(v: int = version) -> None:
                    await engine.update_weights(None, version=v)

                await self.timed(f"relabel v{version}", cut or 30.0, relabel)
                continue
            weights = 100 + step if kind == "fresh" else 200 + step
            name = f"v{version}" if kind == "fresh" else "latest"
            if name == "latest" and (self.world.root / name).exists():
                # the trainer breaks the contract (a served folder rewritten): a replica that
                # re-syncs meanwhile is refused until the next update, never mislabelled
                for replica in self.replicas.values():
                    replica.faulty = True
            folder = self.world.folder(name, weights)
            self.version_weights[version] = weights
            keep = rng.random() < 0.5
            if keep:
                await self.timed("pause", bound, engine.pause_generation)

            async def update(path: Path = folder, v: int = version) -> None:
                try:
                    await engine.update_weights_from_path(path, version=v)
                except WeightMismatchError:
                    self.world.log(f"update v{v}: refused")

            await self.timed(f"update v{version} ({name})", cut or 30.0, update)
            if keep:
                await self.timed("resume", bound, engine.resume_generation)

    async def faults(self) -> None:
        rng = self.rng
        for _ in range(rng.randint(0, 4)):
            await asyncio.sleep(rng.uniform(0, 1.5))
            replica = self.replicas[rng.choice(list(self.replicas))]
            kinds = ["crash", "restart", "wedge", "slow", "refuse"]
            kinds += ["sluggish"] if self.sluggish else []
            kinds += ["paused elsewhere"] if self.paused_elsewhere else []
            kind = rng.choice(kinds)
            self.world.log(f"fault: {replica.name} {kind}")
            if kind == "paused elsewhere":  # no fault of the replica's: it must stay in
                replica.refusing = True

                def resumed(replica: SimReplica = replica) -> None:  # by the one who paused
                    replica.refusing = False

                asyncio.get_running_loop().call_later(rng.uniform(0.05, 4.0), resumed)
                continue
            replica.faulty = True
            if kind == "crash":
                replica.crashed = True
                replica.poke()
            elif kind == "restart":  # a process restart: down a while, then back as new
                replica.crashed = True
                replica.poke()
                asyncio.get_running_loop().call_later(rng.uniform(0.05, 0.5), replica.come_back)
            elif kind == "wedge":
                replica.wedged = True
                replica.poke()
            elif kind == "slow":
                replica.reload_s = rng.uniform(0.3, 2.0)
            elif kind == "sluggish":
                replica.sluggish = True
            else:
                replica.refuse = True

    async def run(self) -> None:
        engine = self.engine
        try:
            await asyncio.gather(
                self.trainer(), self.faults(), *(self.request(k) for k in range(8))
            )
            await self.heal()
        finally:
            await engine.close()
        arrivals = [rid for r in self.replicas.values() for rid in r.arrivals]
        self.check(len(arrivals) == len(set(arrivals)), f"a request sent twice: {arrivals}")

    async def heal(self) -> None:
        """Faults end (restarts bring crashed replicas back); a fresh update (a trainer's
        next step); then every replica must be back within its bound."""
        engine = self.engine
        for replica in self.replicas.values():
            if replica.crashed or replica.wedged:
                replica.restart()
            replica.reload_s, replica.refuse, replica.sluggish = 0.05, False, False
            replica.refusing = False
        version = self.next_version
        self.version_weights[version] = 999
        folder = self.world.folder(f"v{version}", 999)
        await self.timed(
            "final update", 30.0, lambda: engine.update_weights_from_path(folder, version=version)
        )
        bound = 32 * engine.health_interval_s + 2.0  # the breaker's longest delay, a sync
        restarted = self.replicas[self.rng.choice(list(self.replicas))]
        restarted.restart()  # between probes: found by the next relabel, then re-synced
        restarted.faulty = True
        for replica in self.replicas.values():
            replica.reload_s = self.rng.choice([0.05, 0.5])  # slower than the relabels' gap
        end = asyncio.get_running_loop().time() + bound
        while asyncio.get_running_loop().time() < end:  # the trainer goes on meanwhile
            await asyncio.sleep(0.3)
            relabel = self.next_version
            self.next_version += 1
            self.version_weights[relabel] = 999
            await self.timed(
                f"relabel v{relabel}",
                30.0,
                lambda v=relabel: engine.update_weights(None, version=v),
            )
        for replica, sim in zip(engine.replicas, self.replicas.values(), strict=True):
            self.check(replica.state.value == "up", f"{sim.name} not back: {replica!r}")
            self.check(not sim.paused, f"{sim.name} counted up but paused")
            self.check(sim.label == str(engine.version), f"{sim.name} labelled {sim.label}")
            self.check(sim.weights == 999, f"{sim.name} serves weights {sim.weights}")


async def _drain(tasks: set[asyncio.Task[Any]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


def run_seed(
    seed: int,
    root: Path,
    verbose: bool = False,
    sluggish: bool = False,
    paused_elsewhere: bool = False,
) -> list[str]:
    """Run one seed; its trace. A broken invariant raises `Violation` (or `Stuck`)."""
    loop = VirtualLoop()
    run = Run(seed, root, verbose, sluggish, paused_elsewhere)
    run.world.loop = loop
    try:
        loop.run_until_complete(run.run())
    finally:
        pending = asyncio.all_tasks(loop)  # aborts whose timers fired after the run
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(_drain(pending))
        loop.close()
        if run.first is not None:
            raise run.first
    return run.world.trace


def _scratch() -> tempfile.TemporaryDirectory[str]:
    """The folder the seeds' checkpoints are written to: in memory where the system has one
    (`/dev/shm`): a seed writes a few files, which on this machine's disk cost 2 ms each, as
    much as a tenth of a seed's time."""
    shm = Path("/dev/shm")
    memory = shm.is_dir() and os.access(shm, os.W_OK)
    return tempfile.TemporaryDirectory(prefix="control-sim-", dir=shm if memory else None)


def _slice(args: tuple[int, int, int, bool, bool]) -> tuple[list[tuple[int, str]], float]:
    """Run seeds `first`, `first + step`, ... below `stop` in one process: its failures, and
    the CPU seconds it took (on a shared machine wall time says more of the neighbours)."""
    first, step, stop, sluggish, paused_elsewhere = args
    failures = []
    cpu = time.process_time()
    with _scratch() as tmp:
        for seed in range(first, stop, step):
            try:
                run_seed(seed, Path(tmp), sluggish=sluggish, paused_elsewhere=paused_elsewhere)
            except Exception as exc:  # a broken invariant, anything that escaped the run
                failures.append((seed, f"{exc!r:.400}"))
            except asyncio.CancelledError as exc:
                failures.append((seed, f"{exc!r} escaped the run"))
    return failures, time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, default=1000)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="processes (seeds split among them)")
    p.add_argument("--replay", type=int, help="run one seed and print its trace")
    p.add_argument(
        "--sluggish",
        action="store_true",
        help="also draw replicas whose control calls take up to 0.45 s, within every"
        " deadline (.ci/run runs 2,000 such seeds after the 10,000 without)",
    )
    p.add_argument(
        "--paused-elsewhere",
        action="store_true",
        help="also draw pauses by another client of a replica (mode 'wait', which vLLM >= 0.33"
        " answers new requests with a refusal; .ci/run runs 2,000 such seeds)",
    )
    args = p.parse_args()
    if args.replay is not None:
        with _scratch() as tmp:
            run_seed(
                args.replay,
                Path(tmp),
                verbose=True,
                sluggish=args.sluggish,
                paused_elsewhere=args.paused_elsewhere,
            )
        print(f"seed {args.replay}: every invariant held")
        return
    stop = args.start + args.seeds
    slices = [
        (args.start + j, args.jobs, stop, args.sluggish, args.paused_elsewhere)
        for j in range(args.jobs)
    ]
    start = time.perf_counter()
    if args.jobs == 1:
        results = [_slice(slices[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            results = pool.map(_slice, slices)
    took = time.perf_counter() - start
    failures = sorted(f for part, _ in results for f in part)
    cpu = sum(cpu_s for _, cpu_s in results)
    for seed, what in failures[:20]:
        print(f"FAIL {what}  (replay: --replay {seed})")
    print(
        f"{args.seeds} seeds in {took:.1f} s ({args.seeds / took:.0f} seeds/s, {args.jobs}"
        f" processes; {cpu:.1f} CPU s, {args.seeds / cpu:.0f} seeds per CPU s),"
        f" {len(failures)} failed: {[seed for seed, _ in failures[:20]]}"
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
