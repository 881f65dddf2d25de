"""`VLLMServerEngine`: the `Engine` protocol over `vllm serve` replicas, token ids in and out.

When rollout outgrows one machine, the distributed engine users already run is vLLM itself:
`vllm serve` replicas (each with its own tensor/data parallelism). The producer stays in this
process; this engine speaks to every replica over HTTP. What it builds on (vLLM >= 0.32, servers
started with `VLLM_SERVER_DEV_MODE=1 ... --enable-scale-out --logprobs-mode processed_logprobs`,
see `asyncroll.engines.vllm_serve.serve_args`; measured in `vllm-serve-cpu.md` of the team's
reference notes):

* **One HTTP request per group** (`POST /inference/v1/generate`, token ids in, streamed token
  ids, logprobs and per-token weight-version spans out): fresh samples travel together as `n`,
  continued samples (their prefixes differ) one request each. On 2 CPU cores one request
  carrying a group ran at offline speed, while many single-sample requests starved.
* **Versions come from the server.** Every replica is given the version label
  (`/update_weight_version`) with its weights, and each token's version is the label of the
  weights that sampled it, as vLLM reports it. A label the engine never set (a replica that
  restarted between health probes) fails the request instead of being trusted, and takes the
  replica out of the rotation until the next route syncs it. Before an NCCL broadcast every
  member's label is read (`/weight_info`): one that restarted is in no group any more, so the
  group is rebuilt with it.
* **No request straddles a weight update.** vLLM queues requests that arrive while it is paused
  and runs them later on whatever weights it then has. So admission stops *here* first: while
  paused (or updating), `generate` holds new requests before they are sent, and lets them go
  after the resume.
* **Weights through a shared path.** `update_weights` writes one safetensors file under
  `weights_dir` (a folder every replica can read: the same machine, or a shared filesystem),
  and every replica reloads it (`/collective_rpc reload_weights`). A reload of a missing path
  kills a vLLM engine, so the folder is checked first.
* **Or weights over NCCL** (GPUs; `weight_transfer=NCCLWeightTransfer(...)`, servers started
  with `--weight-transfer-config '{"backend":"nccl"}'`): this process joins one NCCL group
  with every replica's workers (rank 0; replica i's workers after those of replicas before
  it) and broadcasts the tensors while each replica receives them (`/start_weight_update`,
  `/update_weights`, `/finish_weight_update`), under the same pause. A broadcast cannot be
  given again to a replica that missed it: a replica that left the rotation and answers again
  is STALE, out of the rotation until the next update rebuilds the group with it. A failure
  once weights are moving leaves every member with partial weights: all leave the rotation
  (as STALE ones once they answer) and the update raises, naming the replica and step.
* **Several replicas.** Control calls go to every replica. A group's requests carry a session
  key (by default the request id without its last "-attempt" part, which is how the producer
  names attempts) and go to one replica (rendezvous hashing). A replica that fails leaves the
  rotation and fails only the requests it had; it is probed again every `health_interval_s`,
  given the current weights and label, and comes back. With no replica up, `EngineDeadError`.
* **A bounded client.** One aiohttp session with at most `max_connections` connections, a
  deadline on every request (`request_timeout_s` for a generate, `control_timeout_s` for the
  rest), errors that name the replica (`ReplicaError`).

aiohttp rather than httpx: it is already a vLLM dependency, and its connection pool is the
cheaper of the two per request (`benchmarks/server_throughput.py` has the numbers).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yarl

from asyncroll._signal import Signal
from asyncroll.engines import nccl_transfer, vllm_groups, weights_file
from asyncroll.engines import replicas as rp
from asyncroll.engines.base import (
    EngineDeadError,
    GenerateRequest,
    RecentIds,
    SampleOutput,
    SamplingConfig,
    Weights,
)
from asyncroll.engines.replicas import Replica, ReplicaError, ReplicaState, UnsyncedReplicaError

_FINISH_REASONS = frozenset({"stop", "length", "abort"})
_SERVER_PREFIX = "generate-tokens-"  # vLLM's id for a request to /inference/v1/generate
_PAUSE = "/pause?mode=keep&clear_cache=false"
_NOT_CONFIGURED = "Weight transfer not configured"  # vLLM without --weight-transfer-config


class Broadcast(enum.Enum):
    """Weights the replicas received over NCCL: unlike a folder, not there to load again."""

    SENT = "sent"


class Admission(enum.Enum):
    """Whether `generate` may send requests to the replicas now."""

    OPEN = "open"
    HELD = "held"  # paused or updating weights: requests wait here, not in a paused vLLM


def attempt_session(request_id: str) -> str:
    """The default session key: the request id without its last "-" part. The producer names
    attempts `<run>-<group uid>-<attempt>`, so every attempt of a group meets the same replica
    (and its prefix cache)."""
    return request_id.rsplit("-", 1)[0]


class _Sample:
    __slots__ = ("finish", "logprobs", "spans", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str | None = None
        self.spans: list[rp.Span] | None = None


class _Part:
    """One HTTP request of a group: `n` samples continuing the same prompt + prefix."""

    __slots__ = ("indices", "max_tokens", "prompt", "server_id", "started")

    def __init__(self, server_id: str, prompt: list[int], max_tokens: int, indices: list[int]):
        self.server_id = server_id  # the request_id sent; vLLM prefixes it (_SERVER_PREFIX)
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.indices = indices  # positions in the group's request.samples
        self.started = False  # sent to the replica (so an abort has to reach it there)


class _Live:
    """A running group: its replica, its requests and the tasks streaming them."""

    __slots__ = ("aborted", "parts", "replica", "samples", "tasks")

    def __init__(self, parts: list[_Part], replica: Replica, samples: list[_Sample]) -> None:
        self.parts = parts
        self.samples = samples
        self.replica = replica
        self.aborted = False
        self.tasks: list[asyncio.Task[None]] = []


class VLLMServerEngine:
    """The `Engine` protocol on `vllm serve` replicas (see the module docstring).

    `urls`: the replicas' base URLs (`http://host:port`), each a `vllm serve` started with
    `VLLM_SERVER_DEV_MODE=1` and `--enable-scale-out`. `vocab_size` (the model's; token ids
    are checked against it before anything is sent) and `max_model_len` are the served model's.

    `weights_dir`: a folder that this process writes and every replica reads, where
    `update_weights` puts the new weights (None: only `update_weights(None, ...)` and
    `update_weights_from_path` are available). A request's `session` (every turn of an
    episode carries one) picks its replica; without one, `session_of` maps the request id to
    a session key (default `attempt_session`). `stream_interval`: also receive a sample's
    tokens every that many tokens (None: its first token, then the rest at the end, the
    fastest). `weight_transfer`: send `update_weights`' tensors over NCCL instead (an
    `nccl_transfer.NCCLWeightTransfer`, GPUs only; the servers need
    `--weight-transfer-config '{"backend":"nccl"}'`, which the first update checks).
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        vocab_size: int,
        max_model_len: int | None = None,
        weights_dir: str | os.PathLike[str] | None = None,
        session_of: Callable[[str], str] = attempt_session,
        stream_interval: int | None = None,
        request_timeout_s: float = 3600.0,
        control_timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        health_timeout_s: float = 5.0,
        health_interval_s: float = 5.0,
        max_connections: int = 512,
        weight_transfer: nccl_transfer.WeightSender | None = None,
        verify_weights: bool = False,
    ) -> None:
        url_list = [urls] if isinstance(urls, str) else list(urls)
        if not url_list:
            raise ValueError("urls is empty: give at least one `vllm serve` base URL")
        for url in url_list:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"url {url!r}: give a base URL like http://127.0.0.1:8000")
        cleaned = [u.rstrip("/") for u in url_list]
        if len({_server(u) for u in cleaned}) != len(cleaned):
            raise ValueError(f"urls {url_list}: each replica must appear once")
        if vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size}: must be the served model's (>= 1)")
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len}: must be the served model's (>= 1)")
        if stream_interval is not None and stream_interval < 1:
            raise ValueError(f"stream_interval={stream_interval}: must be >= 1 (or None)")
        timeouts = {
            "request_timeout_s": request_timeout_s,
            "control_timeout_s": control_timeout_s,
            "connect_timeout_s": connect_timeout_s,
            "health_timeout_s": health_timeout_s,
            "health_interval_s": health_interval_s,
        }
        for name, value in timeouts.items():
            if not value > 0:
                raise ValueError(f"{name}={value}: must be > 0")
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections}: must be >= 1")
        if weights_dir is not None and not Path(weights_dir).is_dir():
            raise ValueError(f"weights_dir={weights_dir}: not a folder (create it first)")
        self.replicas = [Replica(u) for u in cleaned]
        self._vocab_size = vocab_size
        self._max_model_len = max_model_len
        self.weights_dir = None if weights_dir is None else Path(weights_dir)
        self.session_of = session_of
        self.stream_interval = stream_interval
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.health_timeout_s = health_timeout_s
        self.health_interval_s = health_interval_s
        self.max_connections = max_connections
        self.weight_transfer = weight_transfer
        self.verify_weights = verify_weights
        self._group: tuple[Replica, ...] | None = None  # the NCCL group's replicas, rank order
        self._http: aiohttp.ClientSession | None = None  # made in the loop that first uses it
        self._version = 0
        self._weights: Path | Broadcast | None = None  # what every replica serves (None: its own)
        self._written: Path | None = None  # the last folder this engine wrote (deleted later)
        self._admission = Admission.OPEN
        self._paused = False
        self._live: dict[str, _Live] = {}
        self._recent = RecentIds()
        self._generated = 0
        self._open_streams = 0
        self._held = 0
        self._progress = Signal()
        self._control = asyncio.Lock()
        self._probes: dict[Replica, asyncio.Task[None]] = {}  # of down replicas, by routing
        self._closed = False

    # -- Engine protocol -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    @property
    def supports_keep_pause(self) -> bool:
        return True

    @property
    def version(self) -> int:
        return self._version

    def payload_bytes(self, max_new_tokens: int) -> int:
        return 0

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        self._check_open()
        rid = request.request_id
        if rid in self._live:
            raise ValueError(f"request id {rid!r} is already running")
        parts = self._split(request)
        aborted_early = self._recent.take_early_abort(rid)
        samples = [_Sample() for _ in request.samples]
        if aborted_early:
            self._recent.ended(rid)
            return [self._aborted_output() for _ in samples]
        # an episode names its session; a single-turn group's attempts share their id's stem
        replica = await self._route(request.session or self.session_of(rid))
        if rid in self._live:  # started by another call while this one was routed
            raise ValueError(f"request id {rid!r} is already running")
        live = self._live[rid] = _Live(parts, replica, samples)
        live.aborted = self._recent.take_early_abort(rid)  # aborted while it was routed
        try:
            async with asyncio.timeout(self.request_timeout_s):
                await self._run_parts(live, samples, request.sampling)
        except TimeoutError:
            self._check_open()
            error = ReplicaError(
                replica.url,
                f"{rid} not finished within request_timeout_s={self.request_timeout_s}"
                " (its requests were aborted)",
            )
            await self._failed(replica, error)  # one that hangs, /health too, leaves the rotation
            raise error from None
        finally:
            del self._live[rid]
            self._recent.ended(rid)
            self._progress.notify()
        try:
            return [
                self._output(s, rid, replica, asked.max_new_tokens)
                for s, asked in zip(samples, request.samples, strict=True)
            ]
        except ReplicaError as exc:  # what the replica answered is wrong: as a failed stream
            await self._failed(replica, exc)
            raise

    async def abort(self, request_id: str) -> None:
        """Abort every request of the group on its replica; its `generate` then returns the
        partial samples, finish reason "abort". A request still held for admission is never
        sent; an id not seen yet is remembered; an ended one is left alone."""
        if self._closed:
            return
        live = vllm_groups.claim_abort(self._live, self._recent, request_id)
        if live is None:
            return
        self._progress.notify()  # wakes parts held for admission
        started = [p.server_id for p in live.parts if p.started]
        if started:
            await self._abort_on(live.replica, started)

    async def pause_generation(self) -> None:
        """Hold new requests here, then freeze the running ones on every replica (keep mode:
        they keep their tokens and KV cache until resumed).

        Tokens sampled before the freeze may still reach `generate` after this returns: vLLM
        sends nothing that marks the end of a stream's pre-pause tokens. Each carries the
        version label it was sampled under, so none is mistaken for the next weights'.

        A pause that fails (no replica answers, or its caller gives up part-way: the producer
        bounds it by `abort_timeout_s`) is undone, the replicas that paused resumed, before
        the error is raised: a caller that gives up on a pause does not resume, and a held
        engine would hold every later request until its deadline."""
        async with self._control:
            self._check_open()
            paused_before = self._paused
            self._admission = Admission.HELD
            self._paused = True
            try:
                await self._each_replica("POST", _PAUSE)
            except BaseException:
                if not paused_before and not self._closed:
                    with contextlib.suppress(EngineDeadError):
                        await self._reopen()
                raise

    async def resume_generation(self) -> None:
        """Resume every replica and let held requests go. Even when that fails (no replica
        answers: `EngineDeadError`), the engine is no longer paused: the caller goes on as
        resumed (the producer does), and replicas that come back are synced unpaused."""
        async with self._control:
            self._check_open()
            await self._reopen()

    async def update_weights(self, weights: Weights | None, *, version: int) -> None:
        """Write `weights` under `weights_dir` and load them on every replica (None: weights
        unchanged), and label later tokens `version` there; see `update_weights_from_path`.
        With `weight_transfer`, broadcast them over NCCL instead (see the module docstring)."""
        self._check_open()
        if weights is None:
            await self._update(None, version)
            return
        if self.weight_transfer is not None:
            named = await asyncio.to_thread(weights_file.detached, weights)
            await self._update_nccl(self.weight_transfer, named, version)
            return
        if self.weights_dir is None:
            raise ValueError(
                "update_weights with tensors needs weights_dir (a folder every replica reads);"
                " or write the checkpoint yourself and call update_weights_from_path"
            )
        folder = self.weights_dir / f"asyncroll-v{version}-{uuid.uuid4().hex[:8]}"
        folder.mkdir()
        try:
            await asyncio.to_thread(_write_weights, list(weights), folder)
            await self._update(folder, version)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        previous, self._written = self._written, folder
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)

    async def update_weights_from_path(self, path: str | os.PathLike[str], *, version: int) -> None:
        """Load the safetensors checkpoint folder `path` (written by the trainer, readable by
        every replica) on every replica, and label later tokens `version`. Requests are held
        and running ones frozen meanwhile; running ones continue on the new weights (their
        KV cache recomputed), their later tokens labelled `version`."""
        self._check_open()
        await self._update(_checkpoint(path), version)

    async def close(self) -> None:
        """Stop serving: running `generate` calls raise `EngineDeadError` (their streams are
        closed, which makes vLLM abort them), later calls too; the replicas keep running."""
        if self._closed:
            return
        self._closed = True
        self._progress.notify()
        # Abort on the replicas first: a closed connection alone reaches vLLM only when it
        # next writes to the stream, which may be at the request's end.
        started = [
            (live.replica, [p.server_id for p in live.parts if p.started])
            for live in self._live.values()
        ]
        await asyncio.gather(*(self._abort_on(r, ids) for r, ids in started if ids))
        await vllm_groups.end_streams(self._live.values(), self.control_timeout_s)
        probes = list(self._probes.values())
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._written is not None:
            shutil.rmtree(self._written, ignore_errors=True)
        if self.weight_transfer is not None:
            self.weight_transfer.leave()

    async def __aenter__(self) -> VLLMServerEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- progress --------------------------------------------------------------------------------

    @property
    def running_requests(self) -> int:
        """HTTP generate requests open now (sent, not ended)."""
        return self._open_streams

    def samples_started(self, request_id: str) -> int:
        """How many samples of the running request `request_id` have received a token."""
        live = self._live.get(request_id)
        return 0 if live is None else sum(1 for s in live.samples if s.tokens)

    @property
    def held_requests(self) -> int:
        """Requests waiting for admission (the engine is paused or updating weights)."""
        return self._held

    @property
    def generated_tokens(self) -> int:
        """Tokens received from the replicas since the engine started."""
        return self._generated

    async def wait_generated(self, tokens: int, timeout: float) -> None:
        """Return once `generated_tokens >= tokens`; `TimeoutError` after `timeout` s."""
        await self._progress.wait_until(lambda: self._generated >= tokens or self._closed, timeout)
        self._check_open()

    async def wait_held(self, requests: int, timeout: float) -> None:
        """Return once `held_requests >= requests`; `TimeoutError` after `timeout` s."""
        await self.wait_progress(lambda: self._held >= requests, timeout)

    async def wait_progress(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Return once `predicate()` holds, checked whenever requests are held, sent, stream
        tokens or end (e.g. on `replicas[i].streams`); `TimeoutError` after `timeout` s."""
        await self._progress.wait_until(lambda: predicate() or self._closed, timeout)
        self._check_open()

    # -- routing and replica health --------------------------------------------------------------

    async def check_replicas(self) -> None:
        """Probe every replica that is not up now (routing does it every `health_interval_s`),
        and bring back those that answer, with the current weights and version label."""
        self._check_open()
        await asyncio.gather(
            *(self._sync(r, now=True) for r in self.replicas if r.state is not ReplicaState.UP)
        )

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._check_open()  # never a new session once `close()` closed the last one
            connector = aiohttp.TCPConnector(
                limit=self.max_connections, limit_per_host=self.max_connections
            )
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
            self._http = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self._http

    async def _route(self, session: str) -> Replica:
        """The replica for `session`, after syncing replicas due for it."""
        await self._revive_due()
        replica = rp.pick(self.replicas, session)
        if replica is None:
            raise EngineDeadError(f"no replica is up: {self._states()}")
        return replica

    async def _revive_due(self) -> None:
        """Sync every new replica, and start a probe of every down one due for it. Routing
        waits for the new ones (a session must not settle elsewhere only because its replica
        was not synced yet), but for the probes only when no replica is up: a down replica
        whose probe hangs (its host unreachable) must not stall, once every
        `health_interval_s`, the requests of the replicas that serve."""
        new = [r for r in self.replicas if r.state is ReplicaState.UNSYNCED]
        if new:
            await asyncio.gather(*(self._sync(r) for r in new))
        now = asyncio.get_running_loop().time()
        for replica in self.replicas:
            due = replica.state is ReplicaState.DOWN and replica.retry_at <= now
            if due and replica not in self._probes:
                probe = self._probes[replica] = asyncio.ensure_future(self._sync(replica))
                probe.add_done_callback(functools.partial(self._probed, replica))
        if self._probes and not any(r.state is ReplicaState.UP for r in self.replicas):
            await asyncio.gather(*map(asyncio.shield, list(self._probes.values())))

    def _probed(self, replica: Replica, _: asyncio.Task[None]) -> None:
        """A routing probe of `replica` ended (its outcome is the replica's state): the next
        one may start when it is due again."""
        del self._probes[replica]

    async def _sync(self, replica: Replica, *, now: bool = False) -> None:
        """Bring `replica` into the rotation: healthy, serving the current weights under the
        current label, paused if the engine is. Any failure leaves it down until the next
        probe (`now`: probe even before `retry_at`). Concurrent callers wait for the one sync
        in progress rather than route without it. Under the control lock, so that no update
        runs half-way through it."""
        async with replica.syncing:
            due = now or asyncio.get_running_loop().time() >= replica.retry_at
            if replica.state is ReplicaState.UP or self._closed:
                return
            if replica.state is ReplicaState.DOWN and not due:
                return  # probed while this caller waited
            async with self._control:
                if _up(replica) or self._closed:  # synced by an update that held the lock
                    return
                try:
                    if not await self._healthy(replica):
                        raise ReplicaError(replica.url, "GET /health failed")
                    if self._paused:
                        await self._call(replica, "POST", _PAUSE)
                    state = await self._catch_up(replica)
                    if state is ReplicaState.UP and not self._paused:  # a `/pause` that
                        await self._call(replica, "POST", "/resume")  # answered late: paused
                except ReplicaError as exc:
                    self._down(replica, exc)
                    return
                replica.state = state
                replica.error = None

    def _down(self, replica: Replica, exc: BaseException) -> None:
        """`replica` leaves the rotation, and the NCCL group: its workers may be new
        processes when it answers again, so the next update rebuilds the group."""
        loop = asyncio.get_running_loop()
        replica.mark_down(str(exc), loop.time() + self.health_interval_s)
        self._leave_group(replica)

    def _leave_group(self, replica: Replica) -> None:
        if self._group is not None and replica in self._group:
            self._group = tuple(r for r in self._group if r is not replica)

    async def _failed(self, replica: Replica, exc: ReplicaError) -> None:
        """A request to `replica` failed: it leaves the rotation unless it still answers its
        health probe (then only the request failed). One that served weights this engine
        never gave it is a new process: it leaves the rotation (and the NCCL group) until the
        next request's route syncs it again, whatever its health probe says."""
        if isinstance(exc, UnsyncedReplicaError):
            if replica.state is ReplicaState.UP:
                replica.mark_unsynced(str(exc))
                self._leave_group(replica)
        elif replica.state is ReplicaState.UP and not await self._healthy(replica):
            self._down(replica, exc)

    def _states(self) -> str:
        return "; ".join(f"{r.url} {r.state.value} ({r.error})" for r in self.replicas)

    # -- control calls ---------------------------------------------------------------------------

    async def _call(
        self,
        replica: Replica,
        method: str,
        path: str,
        json: Any = None,
        *,
        timeout_s: float | None = None,
    ) -> Any:
        """A control call within `timeout_s` (default `control_timeout_s`)."""
        timeout = self.control_timeout_s if timeout_s is None else timeout_s
        with self._dead_if_closed():
            return await rp.control(
                self._session(), replica, method, path, timeout_s=timeout, json=json
            )

    async def _healthy(self, replica: Replica) -> bool:
        with self._dead_if_closed():
            return await rp.healthy(self._session(), replica, self.health_timeout_s)

    @contextlib.contextmanager
    def _dead_if_closed(self) -> Iterator[None]:
        """Around an HTTP call: `close()` closes the session under the calls in flight,
        which aiohttp reports as `RuntimeError("Session is closed")`. That is the engine's
        death, raised as such, not an error of the call or the replica."""
        try:
            yield
        except RuntimeError as exc:
            if self._closed and not isinstance(exc, ReplicaError):
                raise EngineDeadError("VLLMServerEngine is closed") from None
            raise

    async def _each_replica(self, method: str, path: str, json: Any = None) -> None:
        """One control call on every UP replica at once; one that fails leaves the rotation.
        None up afterwards: `EngineDeadError`."""
        await self._revive_due_locked()
        await self._on_every_up(lambda r: self._call(r, method, path, json))

    async def _on_every_up(self, call: Callable[[Replica], Awaitable[object]]) -> None:
        """`call` on every UP replica at once; one that fails (`ReplicaError`) leaves the
        rotation, any other error is raised. None up afterwards: `EngineDeadError`."""
        await self._on_every([r for r in self.replicas if r.state is ReplicaState.UP], call)
        if not any(r.state is ReplicaState.UP for r in self.replicas):
            raise EngineDeadError(f"no replica is up: {self._states()}")

    async def _on_every(
        self, replicas: Sequence[Replica], call: Callable[[Replica], Awaitable[object]]
    ) -> list[Replica]:
        """`call` on each of `replicas` at once; one that fails (`ReplicaError`) leaves the
        rotation, any other error is raised. Those that succeeded, in order."""
        results = await asyncio.gather(*(call(r) for r in replicas), return_exceptions=True)
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, ReplicaError):
                self._down(replica, result)
            elif isinstance(result, BaseException):
                raise result
        return [
            r
            for r, result in zip(replicas, results, strict=True)
            if not isinstance(result, BaseException)
        ]

    async def _revive_due_locked(self) -> None:
        """`_revive_due` for callers that hold the control lock: new (and stale) replicas are
        synced inline (under the held lock), down ones wait for the next request's probe."""
        for replica in self.replicas:
            if replica.state not in (ReplicaState.UNSYNCED, ReplicaState.STALE):
                continue
            try:
                if not await self._healthy(replica):
                    raise ReplicaError(replica.url, "GET /health failed")
                replica.state = await self._catch_up(replica)
            except ReplicaError as exc:
                self._down(replica, exc)

    async def _catch_up(self, replica: Replica) -> ReplicaState:
        """Give an answering replica the current weights and label: UP then, or STALE when
        they came over NCCL (nothing to load: it receives the next broadcast)."""
        if self._weights is Broadcast.SENT:
            return ReplicaState.STALE
        await self._load_on(replica, self._weights, self._version)
        return ReplicaState.UP

    @contextlib.asynccontextmanager
    async def _frozen(self) -> AsyncIterator[None]:
        """A weight update's frame: under the control lock, admission held; afterwards (also
        after a failure) every replica resumed and admission released, unless the caller had
        paused."""
        async with self._control:
            self._check_open()
            paused_before = self._paused
            self._admission = Admission.HELD
            try:
                yield
            finally:
                if not paused_before and not self._closed:
                    with contextlib.suppress(EngineDeadError):
                        await self._reopen()

    async def _reopen(self) -> None:
        """Under the control lock: resume every replica that is up and let held requests go,
        whatever the resume did (none up: `EngineDeadError`, once they are let go)."""
        try:
            await self._each_replica("POST", "/resume")
        finally:
            self._paused = False
            self._admission = Admission.OPEN
            self._progress.notify()

    async def _update(self, folder: Path | None, version: int) -> None:
        """Hold admission, freeze every replica, load `folder` (None: keep the weights),
        recompute running requests' KV cache, label `version`, resume (unless the caller
        paused), release admission."""
        if folder is None and version == self._version:
            return
        async with self._frozen():
            if not self._paused:
                await self._each_replica("POST", _PAUSE)
            weights = folder if folder is not None else self._weights
            loading = [r for r in self.replicas if r.state is ReplicaState.UP]
            with self._resync_if_interrupted(loading):
                await self._on_every_up(lambda r: self._load_on(r, folder, version))
            self._weights = weights
            self._version = version

    @contextlib.contextmanager
    def _resync_if_interrupted(self, replicas: list[Replica]) -> Iterator[None]:
        """Around an update's loads and labels: if it ends by an exception other than a
        replica's failure (a cancellation at the caller's deadline, above all), any of
        `replicas` may already carry the new weights or label while the engine keeps the old
        ones, and a roll back to the old version would be a no-op (`_update` skips an
        unchanged one). Those still up leave the rotation until synced again with the
        engine's weights and label (at once: the update's own resume syncs them)."""
        try:
            yield
        except BaseException as exc:
            for replica in replicas:
                if replica.state is ReplicaState.UP:
                    replica.mark_unsynced(f"an update was interrupted: {exc!r}")
            raise

    async def _update_nccl(
        self, sender: nccl_transfer.WeightSender, named: list[tuple[str, Any]], version: int
    ) -> None:
        """`_update` with the tensors broadcast over NCCL: the members (the UP replicas and
        the STALE ones that answer) are frozen, the group is (re)built when they changed,
        then every member receives while the trainer sends, finishes, and takes the label."""
        async with self._frozen():
            await self._revive_due_locked()
            members = [r for r in self.replicas if r.state in (ReplicaState.UP, ReplicaState.STALE)]
            members = await self._on_every(members, lambda r: self._call(r, "POST", _PAUSE))
            members = await self._on_every(members, self._leave_group_if_restarted)
            if not members:
                raise EngineDeadError(f"no replica is up: {self._states()}")
            if self._group != tuple(members):
                members = await self._form_group(sender, members)
            await self._transfer(sender, members, named, version)
            with self._resync_if_interrupted(members):
                members = await self._on_every(members, lambda r: self._load_on(r, None, version))
            if not members:
                raise EngineDeadError(f"no replica is up: {self._states()}")
            for replica in members:
                replica.state = ReplicaState.UP
            self._version = version

    async def _leave_group_if_restarted(self, replica: Replica) -> None:
        """Take `replica` out of the NCCL group if it does not carry this engine's weight
        label (vLLM's initial one: it restarted between probes, and its new workers are in no
        group), so that the group is rebuilt with it instead of broadcasting to ranks that
        are not there (a broadcast that would hang until its timeout)."""
        reply = await self._call(replica, "GET", "/weight_info")
        if not isinstance(reply, dict) or reply.get("weight_version") != str(self._version):
            self._leave_group(replica)

    async def _form_group(
        self, sender: nccl_transfer.WeightSender, members: list[Replica]
    ) -> list[Replica]:
        """Leave the old group (members still in it shut their end), and join a new one of
        `members`: the trainer at rank 0, each replica's workers (`/get_world_size`, data
        parallel included) after the previous replica's. No weights move here, so a failure
        leaves every replica serving what it had; a replica started without
        `--weight-transfer-config` fails the update with a `ValueError` saying so, and one
        that fails to join leaves the rotation (else every later update would fail on it
        again). The members that joined."""
        old, self._group = self._group or (), None
        staying = [r for r in members if r in old]
        shut = await self._on_every(
            staying, lambda r: self._call(r, "POST", "/shutdown_weight_transfer_engine")
        )
        members = [r for r in members if r not in staying or r in shut]
        sizes: dict[Replica, int] = {}

        async def world_size(replica: Replica) -> None:
            reply = await self._call(replica, "GET", "/get_world_size")
            size = reply.get("world_size") if isinstance(reply, dict) else None
            if not isinstance(size, int) or size < 1:
                raise ReplicaError(replica.url, f"GET /get_world_size -> {reply!r}")
            sizes[replica] = size

        members = await self._on_every(members, world_size)
        if not members:
            raise EngineDeadError(f"no replica is up: {self._states()}")
        offsets = np.cumsum([1] + [sizes[r] for r in members]).tolist()
        init_info = sender.new_group(offsets[-1])

        async def init(replica: Replica, offset: int) -> None:
            body = {"init_info": {**init_info, "rank_offset": offset}}
            await self._call(
                replica,
                "POST",
                "/init_weight_transfer_engine",
                body,
                timeout_s=sender.timeout_s,
            )

        joins = [sender.join(), *map(init, members, offsets[:-1])]
        error = await vllm_groups.first_error([asyncio.ensure_future(j) for j in joins])
        if error is not None:
            sender.leave()
            if _NOT_CONFIGURED in str(error):
                raise ValueError(
                    f"{error}: start every replica with"
                    """ --weight-transfer-config '{"backend":"nccl"}' to use weight_transfer"""
                ) from None
            for replica in members:  # it leaves: the next update forms the group without it
                if isinstance(error, ReplicaError) and error.url == replica.url:
                    self._down(replica, error)
            raise error
        self._group = tuple(members)
        return members

    async def _transfer(
        self,
        sender: nccl_transfer.WeightSender,
        members: list[Replica],
        named: list[tuple[str, Any]],
        version: int,
    ) -> None:
        """Start an update on every member, receive on every member while the trainer sends
        (a broadcast needs every rank), finish. Any failure here leaves every member with
        partial weights: the group is dropped, every member leaves the rotation, the error is
        raised (it names the replica and the step)."""
        body = {"update_info": nccl_transfer.update_info(named)}

        def calls(path: str, json: Any = None) -> list[Awaitable[Any]]:
            return [self._call(r, "POST", path, json, timeout_s=sender.timeout_s) for r in members]

        steps: list[Callable[[], list[Awaitable[Any]]]] = [
            lambda: calls("/start_weight_update"),
            lambda: [sender.send(named), *calls("/update_weights", body)],
            lambda: calls("/finish_weight_update"),
        ]
        self._weights = Broadcast.SENT  # from here on, the old weights are gone everywhere
        try:
            for step in steps:
                error = await vllm_groups.first_error([asyncio.ensure_future(c) for c in step()])
                if error is not None:
                    raise error
        except BaseException as exc:
            self._group = None
            sender.leave()
            partial = RuntimeError(
                f"left with partial weights: the update to version {version} failed: {exc}"
            )
            for replica in members:
                mine = isinstance(exc, ReplicaError) and exc.url == replica.url
                self._down(replica, exc if mine else partial)
            raise

    async def _load_on(self, replica: Replica, folder: Path | None, version: int) -> None:
        """Reload `folder` on one (paused or idle) replica, drop its KV cache (running requests
        are recomputed under the new weights), and set its label to `version`."""
        if folder is not None:
            from asyncroll.engines import server_weights

            _checkpoint(folder)  # a reload of a missing path would kill the vLLM engine
            await server_weights.load(
                functools.partial(self._call, replica), replica.url, folder, self.verify_weights
            )
        reply = await self._call(replica, "POST", "/reset_prefix_cache?reset_running_requests=true")
        if not (isinstance(reply, dict) and reply.get("success")):
            raise ReplicaError(replica.url, f"could not reset its prefix cache: {reply}")
        await self._call(replica, "POST", "/update_weight_version", {"new_version": str(version)})

    async def _abort_on(self, replica: Replica, server_ids: list[str]) -> None:
        """Abort requests on `replica`, through the RL route that returns once vLLM has
        aborted them (`/inference/v1/abort_requests` only starts a task that will). A failure
        fails no request (the stream's own end or deadline still bounds it), but is a failed
        call to the replica like any other: one that does not answer its health probe either
        leaves the rotation. Often this abort is the last call a hung replica gets (its caller
        gave up on the request), and nothing else would take it out."""
        ids = [_SERVER_PREFIX + s for s in server_ids]
        try:
            await self._call(replica, "POST", "/abort_requests", {"request_ids": ids})
        except ReplicaError as exc:
            await self._failed(replica, exc)

    # -- generation ------------------------------------------------------------------------------

    def _split(self, request: GenerateRequest) -> list[_Part]:
        """Fresh samples of one budget travel together as `n` (not when greedy: vLLM refuses
        n > 1 then), continued samples one request each (see `vllm_groups.split_group`)."""
        together = request.sampling.temperature > 0
        return vllm_groups.split_group(request, self._vocab_size, together=together, part=_Part)

    async def _run_parts(
        self, live: _Live, samples: list[_Sample], sampling: SamplingConfig
    ) -> None:
        """Stream every part; on the first error (or a cancellation) end the others, abort
        what was sent, and raise."""
        tasks = live.tasks = [
            asyncio.ensure_future(self._stream(live, part, samples, sampling))
            for part in live.parts
        ]
        try:
            error = await vllm_groups.first_error(tasks)
        finally:
            unfinished = [
                p.server_id
                for p, task in zip(live.parts, tasks, strict=True)
                if p.started and _unfinished(task)
            ]
            if unfinished and not self._closed:  # do not rely on the disconnect alone
                await asyncio.shield(self._abort_on(live.replica, unfinished))
        if self._closed:
            raise EngineDeadError("VLLMServerEngine is closed")
        if error is not None:
            if isinstance(error, ReplicaError):
                await self._failed(live.replica, error)
            raise error

    async def _admit(self, live: _Live) -> None:
        """Wait while admission is held (a pause or weight update); an abort or close ends
        the wait."""
        if self._admission is Admission.OPEN:
            return
        self._held += 1
        self._progress.notify()
        try:
            await self._progress.wait_until(
                lambda: self._admission is Admission.OPEN or live.aborted or self._closed
            )
        finally:
            self._held -= 1

    async def _stream(
        self, live: _Live, part: _Part, samples: list[_Sample], sampling: SamplingConfig
    ) -> None:
        await self._admit(live)
        if self._closed:
            raise EngineDeadError("VLLMServerEngine is closed")
        if live.aborted:
            for i in part.indices:
                samples[i].finish = "abort"
            return
        replica = live.replica
        if not _up(replica):  # a pause, update or resume failed there while this was held
            raise ReplicaError(
                replica.url,
                f"left the rotation before {part.server_id} was sent: {replica.error}",
            )
        body = {
            "request_id": part.server_id,
            "token_ids": part.prompt,
            "stream": True,
            "sampling_params": self._sampling_params(sampling, part),
        }
        part.started = True
        self._open_streams += 1
        replica.streams += 1
        replica.sent += 1
        self._progress.notify()
        try:
            async with self._session().post(
                f"{replica.url}/inference/v1/generate", json=body
            ) as reply:
                if reply.status != 200:
                    text = (await reply.read())[:500].decode(errors="replace")
                    error = ReplicaError(replica.url, f"generate -> HTTP {reply.status}: {text}")
                    if 400 <= reply.status < 500:
                        raise ValueError(str(error))
                    raise error
                first = True
                tokens = part.max_tokens * len(part.indices)
                async for event in rp.events(reply, replica.url, tokens):
                    for choice in event.choices:
                        if not 0 <= choice.index < len(part.indices):  # not -1: Python's last
                            raise ReplicaError(
                                replica.url,
                                f"streamed choice {choice.index} of a request of"
                                f" {len(part.indices)} samples",
                            )
                        got = _append(samples[part.indices[choice.index]], choice, replica.url)
                        self._generated += got
                    self._progress.notify()
                    if first and _aborted(live):  # the abort may have beaten the request there
                        await self._abort_on(replica, [part.server_id])
                    first = False
        except rp.TRANSPORT_ERRORS as exc:
            raise ReplicaError(replica.url, f"generate: {type(exc).__name__}: {exc}") from None
        finally:
            self._open_streams -= 1
            replica.streams -= 1
            self._progress.notify()

    def _sampling_params(self, sampling: SamplingConfig, part: _Part) -> dict[str, Any]:
        params: dict[str, Any] = {
            "n": len(part.indices),
            "max_tokens": part.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stop_token_ids": list(sampling.stop_token_ids),
            "ignore_eos": sampling.ignore_eos,
            "logprobs": 0,  # the sampled token's logprob only
            "stream_interval": self.stream_interval or part.max_tokens,
        }
        if sampling.top_k is not None:
            params["top_k"] = sampling.top_k
        if sampling.seed is not None:
            params["seed"] = vllm_groups.part_seed(sampling.seed, part.server_id)
        return params

    def _output(
        self, sample: _Sample, request_id: str, replica: Replica, max_new_tokens: int
    ) -> SampleOutput:
        """One sample as the `Engine` contract has it; a replica's answer that breaks the
        contract (more tokens than asked for, a finish reason, logprobs or version labels that
        do not fit) fails the request instead of reaching the trainer."""
        n = len(sample.tokens)
        if n > max_new_tokens:
            raise ReplicaError(
                replica.url,
                f"returned {n} tokens for a sample of {request_id} that asked for at most"
                f" {max_new_tokens}",
            )
        if sample.finish not in _FINISH_REASONS:
            raise ReplicaError(
                replica.url, f"finished a sample of {request_id} with reason {sample.finish!r}"
            )
        if len(sample.logprobs) != n:
            raise ReplicaError(
                replica.url, f"returned {len(sample.logprobs)} logprobs for {n} tokens"
            )
        versions = vllm_groups.token_versions(
            sample.spans, n, lambda label: self._label(label, replica)
        )
        if versions is None:
            raise ReplicaError(
                replica.url,
                f"its version spans do not label each of the {n} tokens of {request_id} once,"
                " in order",
            )
        return SampleOutput(
            tokens=np.array(sample.tokens, dtype=np.int32),
            logprobs=np.array(sample.logprobs, dtype=np.float32),
            versions=versions,
            finish_reason=sample.finish,
        )

    def _label(self, label: str, replica: Replica) -> int:
        """A version label as this engine set it; anything else (vLLM's initial "default":
        a replica restarted behind the engine's back) fails the request."""
        try:
            return int(label)
        except ValueError:
            raise UnsyncedReplicaError(
                replica.url,
                f"served tokens labelled {label!r}, a version this engine never set "
                "(did it restart without the current weights?)",
            ) from None

    @staticmethod
    def _aborted_output() -> SampleOutput:
        empty = np.zeros(0, dtype=np.int32)
        return SampleOutput(
            tokens=empty,
            logprobs=np.zeros(0, dtype=np.float32),
            versions=empty.copy(),
            finish_reason="abort",
        )

    def _check_open(self) -> None:
        if self._closed:
            raise EngineDeadError("VLLMServerEngine is closed")


def _server(url: str) -> tuple[str | None, int | None, str]:
    """What names one server in a base URL: "http://A:80" and "http://a" are the same one,
    and one server listed twice would be two ranks of one NCCL group."""
    parsed = yarl.URL(url)
    return parsed.host, parsed.port, parsed.path.rstrip("/")


def _up(replica: Replica) -> bool:
    """Whether `replica` is up, read through a call: its state changes across awaits, which
    mypy's narrowing does not know."""
    return replica.state is ReplicaState.UP


def _aborted(live: _Live) -> bool:
    """`live.aborted`, read through a call: it changes across awaits, which mypy's narrowing
    does not know."""
    return live.aborted


def _unfinished(task: asyncio.Task[None]) -> bool:
    """Whether a part's stream ended without finishing (an error or a cancellation), or has
    not ended yet."""
    return not task.done() or task.cancelled() or task.exception() is not None


def _append(sample: _Sample, choice: rp.StreamChoice, url: str) -> int:
    """Add one streamed delta of a sample; the number of new tokens."""
    tokens = choice.token_ids or []
    entries = choice.logprobs.content if choice.logprobs is not None else []
    if len(entries) != len(tokens) or any(
        e.token_id != t for e, t in zip(entries, tokens, strict=True)
    ):
        raise ReplicaError(url, "streamed logprobs do not line up with the token ids")
    sample.tokens.extend(tokens)
    sample.logprobs.extend(e.logprob for e in entries)
    if choice.finish_reason is not None:
        sample.finish = choice.finish_reason
        sample.spans = choice.weight_versions
    return len(tokens)


def _checkpoint(path: str | os.PathLike[str]) -> Path:
    """`path` resolved, once checked to be a folder with safetensors files: vLLM treats a
    missing path as a Hugging Face repo id, fails, and its engine dies on the next request."""
    folder = Path(path)
    if not folder.is_dir() or not any(folder.glob("*.safetensors")):
        raise ValueError(f"{folder}: not a folder with *.safetensors files")
    return folder.resolve()


def _write_weights(weights: Weights, folder: Path) -> None:
    """One `model.safetensors` in `folder`, the only file vLLM's `reload_weights` needs."""
    weights_file.write_safetensors(weights_file.detached(weights), folder / "model.safetensors")
