"""`VLLMServerEngine`: the `Engine` protocol over `vllm serve` replicas, token ids in and out.

When rollout outgrows one machine, the distributed engine users already run is vLLM itself:
`vllm serve` replicas (each with its own tensor/data parallelism). The producer stays in this
process; this engine speaks to every replica over HTTP. What it builds on (vLLM >= 0.32, servers
started with `VLLM_SERVER_DEV_MODE=1 ... --enable-scale-out --logprobs-mode processed_logprobs`,
see `asyncroll.engines.server.launch.serve_args`; measured in `vllm-serve-cpu.md` of the team's
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
  and every replica loads it through asyncroll's worker extension (`replica_load`: the same
  worker code as `VLLMEngine`, which also refreshes a tied output head and reports tensors the
  load missed; servers start with `--worker-extension-cls`, see `vllm_serve.serve_args`). With
  `verify_weights=True` each replica also proves it serves the folder's tensors (digests and
  kernel probes, `weight_check`), or leaves the rotation unlabelled. A reload of a missing
  path kills a vLLM engine, so the folder is checked first.
* **Or weights over NCCL** (GPUs; `weight_transfer=NCCLWeightTransfer(...)`, servers started
  with `--weight-transfer-config '{"backend":"nccl"}'`): this process joins one NCCL group
  with every replica's workers (rank 0; replica i's workers after those of replicas before
  it) and broadcasts the tensors while each replica receives them (`/start_weight_update`,
  `/update_weights`, `/finish_weight_update`), under the same pause. A broadcast cannot be
  given again to a replica that missed it: a replica that left the rotation and answers again
  is STALE, out of the rotation until the next update rebuilds the group with it. A failure
  once weights are moving leaves every member with partial weights: all leave the rotation
  (as STALE ones once they answer) and the update raises, naming the replica and step.
* **Several replicas, one of which cannot take the others down.** Control calls go to every
  replica in the rotation. A group's requests carry a session key (by default the request id
  without its last "-attempt" part, which is how the producer names attempts) and go to one
  replica (rendezvous hashing). Any error from talking to a replica, whatever aiohttp raised,
  is that replica's failure and fails only the requests it had; it leaves the rotation unless
  a one-token generate shows its engine core alive (vLLM's `/health` passes a hung one). A
  request its caller gives up on unfinished has its replica checked too: a wedged engine
  core whose aborts answer fails nothing else. Each
  replica has a supervisor (`server_supervisor`) that alone probes and re-syncs it: paused
  first, given the current weights and label, resumed, tried with a liveness generate, holding
  nothing another replica needs; a failing replica's probes back off (a circuit breaker).
  No replica up is a state, not death: pauses and updates go on (each replica that
  comes back is synced to what the engine serves), a request waits for a replica within
  its own deadline (`NoReplicaError` then); `EngineDeadError` only once the engine is
  closed. The control plane's design, states and deadlines: docs/scaling-out.md.
* **Deadlines that compose.** A pause, resume or abort waits at most `pause_timeout_s` per
  replica call (`pause_bound_s` in all, to keep under the caller's own: the producer's
  `abort_timeout_s`); a generate `request_timeout_s`; other control calls
  `control_timeout_s`. Only idempotent calls are tried twice (never an NCCL step); replies are
  read up to a bound. Control calls have connections of their own (`server_client`).
* **Or a LoRA adapter as the policy** (`lora=LoraSlots(...)`, servers started with it too:
  `vllm_serve.serve_args(..., lora=...)`): `update_weights(adapter, version=k)` writes it once
  under `weights_dir`, loads it on every replica (`/v1/load_lora_adapter`, frozen like a
  weight update) under a name of its own, and every request sent afterwards names it; each
  of a request's tokens is labelled with the version of the adapter it was sent with, which
  vLLM keeps for its whole life. A refused adapter is `LoraError`; see `server_lora`.
* **Updates commit, then clean up.** The new folder and label become what the engine serves
  only once every replica loaded them, and a folder is deleted only when no replica can be
  reading it (`server_weights`): an update cut off at its final resume keeps its weights.

Files: this one is the `Engine` (admission, routing, generate, pause, resume, and the calls
on every replica that they and updates share); `server_updates` the weight updates (a
folder, NCCL, a LoRA adapter: freeze, load, label, commit); `server_supervisor` the
per-replica control plane; `server_client` HTTP to the replicas; `server_samples` what a
request carries and brings back, parsed strictly; `server_lora` the LoRA adapters;
`replica_load` how one replica loads a folder; `server_weights` which weights the replicas
serve; `server_nccl` the NCCL group and its broadcast steps; `replicas` a replica's state
and the wire format.

aiohttp rather than httpx: it is already a vLLM dependency, and its connection pool is the
cheaper of the two per request (`benchmarks/server_throughput.py` has the numbers).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yarl

from asyncroll._core.tasks import Tasks
from asyncroll._core.wakeup import Signal
from asyncroll.engines.base import (
    EngineDeadError,
    GenerateRequest,
    RecentIds,
    SampleOutput,
    SamplingConfig,
    Weights,
)
from asyncroll.engines.server import lora as server_lora
from asyncroll.engines.server import nccl_transfer
from asyncroll.engines.server import replicas as rp
from asyncroll.engines.server import samples as ss
from asyncroll.engines.server import supervisor as sup
from asyncroll.engines.server import updates as server_updates
from asyncroll.engines.server import weights as server_weights
from asyncroll.engines.server.client import ReplicaClient, Sessions
from asyncroll.engines.server.nccl import NcclGroup
from asyncroll.engines.server.replicas import (
    NoReplicaError,
    Replica,
    ReplicaError,
    ReplicaState,
    UnsyncedReplicaError,
)
from asyncroll.engines.server.samples import attempt_session
from asyncroll.engines.vllm import groups as vllm_groups
from asyncroll.engines.vllm.weight_check import WeightMismatchError
from asyncroll.lora import LoraAdapter, LoraSlots

__all__ = ["VLLMServerEngine", "attempt_session"]

_HOMES = frozenset({ReplicaState.UP, ReplicaState.UNSYNCED})  # where a session may live
_SERVER_PREFIX = "generate-tokens-"  # vLLM's id for a request to /inference/v1/generate


class Dispatch(enum.Enum):
    """Whether `generate` may send requests to the replicas now."""

    OPEN = "open"
    HELD = "held"  # paused or updating weights: requests wait here, not in a paused vLLM


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

    Deadlines: `request_timeout_s` a generate; `pause_timeout_s` each replica's pause, resume
    or abort (keep `pause_bound_s`, twice it, under the producer's `abort_timeout_s`);
    `control_timeout_s` a weight load and other control calls; `health_timeout_s` a
    `/health`; `liveness_timeout_s` the one-token generate that tells a live engine core
    from a hung one; `health_interval_s` the first delay before a failed replica's next
    probe (doubling with each failure in a row, to 32 times it).

    `lora`: serve `LoraAdapter`s given to `update_weights` (`asyncroll.lora.LoraSlots`, the
    same argument as `VLLMEngine`'s; every replica must be started with the same slots,
    `vllm_serve.serve_args(..., lora=...)`, and `weights_dir` is needed to write them).

    `sessions`: makes the HTTP sessions (`server_client.Sessions`; the deterministic
    simulation's seam, `benchmarks/control_sim.py`); None: aiohttp's.
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
        liveness_timeout_s: float = 30.0,
        pause_timeout_s: float = 10.0,
        max_connections: int = 512,
        weight_transfer: nccl_transfer.WeightSender | None = None,
        verify_weights: bool = False,
        lora: LoraSlots | None = None,
        sessions: Sessions | None = None,
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
            "liveness_timeout_s": liveness_timeout_s,
            "pause_timeout_s": pause_timeout_s,
        }
        for name, value in timeouts.items():
            if not value > 0:
                raise ValueError(f"{name}={value}: must be > 0")
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections}: must be >= 1")
        if verify_weights and weight_transfer is not None:
            raise ValueError(
                "verify_weights=True covers weights loaded from a folder, not weights sent over"
                " NCCL (weight_transfer): drop one of the two"
            )
        if weights_dir is not None and not Path(weights_dir).is_dir():
            raise ValueError(f"weights_dir={weights_dir}: not a folder (create it first)")
        self.replicas = [Replica(u) for u in cleaned]
        self._vocab_size = vocab_size
        self._max_model_len = max_model_len
        self.session_of = session_of
        self.stream_interval = stream_interval
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.health_timeout_s = health_timeout_s
        self.health_interval_s = health_interval_s
        self.liveness_timeout_s = liveness_timeout_s
        self.pause_timeout_s = pause_timeout_s
        self.max_connections = max_connections
        self._state = sup.ControlState()
        self._client = ReplicaClient(
            max_connections=max_connections,
            connect_timeout_s=connect_timeout_s,
            control_timeout_s=control_timeout_s,
            health_timeout_s=health_timeout_s,
            liveness_timeout_s=liveness_timeout_s,
            sessions=sessions,
        )
        self._folders = server_weights.WeightFolders()
        self._lora = server_lora.ServerAdapters(lora, self._client, self._unload_failed)
        self._group = NcclGroup(self._client, self._on_every, self._down, self._states)
        fleet = server_updates.Fleet(
            frozen=self._frozen,
            pause_up=functools.partial(self._each_replica, "POST", sup.PAUSE),
            on_every=self._on_every,
            on_every_up=self._on_every_up,
            down=self._down,
            end_adapter_requests=self._end_adapter_requests,
            states=self._states,
        )
        self._updates = server_updates.WeightUpdates(
            self.replicas,
            self._state,
            self._client,
            self._folders,
            self._lora,
            self._group,
            fleet,
            weights_dir=None if weights_dir is None else Path(weights_dir),
            weight_transfer=weight_transfer,
            verify_weights=verify_weights,
            pause_timeout_s=pause_timeout_s,
            health_timeout_s=health_timeout_s,
        )
        self._supervisors = {
            r: sup.Supervisor(
                r,
                self._state,
                self._client,
                self._folders,
                self._updates.resync_load,
                self._updates.own_model,
                self._down,
                self._leave_group,
                relabel=self._updates.label,
                on_change=self._notify,
                pause_timeout_s=pause_timeout_s,
            )
            for r in self.replicas
        }
        self._admission = Dispatch.OPEN
        self._live: dict[str, ss.Live] = {}
        self._recent = RecentIds()
        self._generated = 0
        self._open_streams = 0
        self._held = 0
        self._progress = Signal()
        self._tasks = Tasks()  # cleanups and aborts that outlive the caller who started them

    # -- how updates reach the replicas (`server_updates.WeightUpdates` holds these) -------------

    @property
    def weights_dir(self) -> Path | None:
        """The folder `update_weights` writes new weights and adapters under."""
        return self._updates.weights_dir

    @property
    def weight_transfer(self) -> nccl_transfer.WeightSender | None:
        """The NCCL sender `update_weights` broadcasts tensors with (None: a folder)."""
        return self._updates.weight_transfer

    @property
    def verify_weights(self) -> bool:
        """Whether each replica proves it serves a loaded folder's tensors (`weight_check`);
        may be switched between updates."""
        return self._updates.verify_weights

    @verify_weights.setter
    def verify_weights(self, on: bool) -> None:
        self._updates.verify_weights = on

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
        return self._state.version

    @property
    def adapter_slots(self) -> int | None:
        """Adapters each replica holds at once (`LoraSlots.slots`, the replicas'
        `--max-loras`; None: no LoRA). Each request keeps the adapter it was sent with
        (`Engine.adapter_slots`), so the producer need not pause for an adapter update: the
        update itself only freezes the replicas (keep mode) while they load it (`server_lora`)."""
        return None if self._lora.slots is None else self._lora.slots.slots

    @property
    def pause_bound_s(self) -> float:
        """The longest `pause_generation` or `resume_generation` takes while no weight
        update runs, whatever a replica does: waiting for probes when none is up, then one
        call to each replica, `pause_timeout_s` each. Deadlines compose only if it is below
        the caller's own (the producer's `abort_timeout_s`, 30 s by default): a pause that
        outlives its caller is undone and the run stops."""
        return 2 * self.pause_timeout_s

    def payload_bytes(self, max_new_tokens: int) -> int:
        """The bytes a sample's tokens hold here while in flight (`server_samples.Sample`),
        beyond what the producer counts for its encoded tokens: they are in this process,
        and the buffer's byte bound must cover them."""
        return ss.IN_FLIGHT_BYTES_PER_TOKEN * max_new_tokens + ss.IN_FLIGHT_SAMPLE_BYTES

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        """Route the group, wait (within `request_timeout_s`, ended by `abort`) until its
        replica may be sent to, then stream its requests there. A request not yet sent when
        its replica leaves the rotation is routed again; with no replica up it waits for
        one until its deadline (`NoReplicaError`, naming each replica: no dead engine)."""
        self._check_open()
        rid = request.request_id
        if rid in self._live:
            raise ValueError(f"request id {rid!r} is already running")
        parts = self._split(request)
        samples = [ss.Sample() for _ in request.samples]
        if self._recent.take_early_abort(rid):
            self._recent.ended(rid)
            return [ss.aborted_output() for _ in samples]
        # an episode names its session; a single-turn group's attempts share their id's stem
        session = request.session or self.session_of(rid)
        live = self._live[rid] = ss.Live(parts, None, samples)  # from now on `abort` finds it
        self._progress.notify()
        try:
            async with asyncio.timeout(self.request_timeout_s):
                while not await self._sent(live, session, request.sampling):
                    pass  # its replica left the rotation before anything was sent: again
        except TimeoutError:
            self._check_open()
            replica = live.replica
            if replica is None or not any(p.started for p in parts):
                raise NoReplicaError(
                    f"{rid}: no replica took it within request_timeout_s="
                    f"{self.request_timeout_s}: {self._states()}"
                ) from None
            error = ReplicaError(
                replica.url,
                f"{rid} not finished within request_timeout_s={self.request_timeout_s}"
                " (its requests were aborted)",
            )
            self._supervisors[replica].failed(error)  # one that hangs leaves the rotation
            raise error from None
        finally:
            del self._live[rid]
            self._recent.ended(rid)
            base_of = dict(self._lora.base_of)  # as its tokens were labelled, before release
            for part in parts:
                if part.started:  # bound to the policy it was sent with (`_stream`)
                    self._lora.release(part.adapter)
            self._progress.notify()
        url = "" if live.replica is None else live.replica.url
        try:
            return [
                ss.output(s, rid, url, asked.max_new_tokens, base_of)
                for s, asked in zip(samples, request.samples, strict=True)
            ]
        except ReplicaError as exc:  # what the replica answered is wrong: as a failed stream
            if live.replica is not None:
                self._supervisors[live.replica].failed(exc)
            raise

    async def _sent(self, live: ss.Live, session: str, sampling: SamplingConfig) -> bool:
        """Route `live`, wait until its replica may take it, and stream it there. False: its
        replica left the rotation before any of its requests was sent (route it again)."""
        replica = live.replica = await self._ready(live, session)
        if replica is None:  # aborted before anything was sent
            for sample in live.samples:
                sample.finish = "abort"
            return True
        try:
            await self._run_parts(live, live.samples, sampling)
        except _NotSent:
            if any(p.started for p in live.parts):
                raise ReplicaError(
                    replica.url, f"left the rotation while its requests were sent: {replica.error}"
                ) from None
            return False
        return True

    async def _ready(self, live: ss.Live, session: str) -> Replica | None:
        """The replica `session` goes to, once it may be sent to: admission open, no sync of
        the session's own replica and no liveness check of the chosen one under way. Every
        wait is the caller's (its deadline, its abort); nothing here waits on a supervisor's
        task. None: the request was aborted."""
        while True:
            self._check_open()
            if live.aborted:
                return None
            self._revive_due()
            home = rp.pick(self.replicas, session, _HOMES)
            if (
                home is not None
                and home.state is ReplicaState.UNSYNCED
                and _syncing(self._supervisors[home])
            ):
                # its own replica is being synced (new, or restarted): wait for that, not
                # settling elsewhere only because its replica was not synced yet
                await self._wait(live, functools.partial(_idle, self._supervisors[home]))
                continue
            replica = rp.pick(self.replicas, session)
            if replica is None:  # none up now: a state, not death; wait for one
                await self._wait(
                    live,
                    lambda: any(r.state is ReplicaState.UP for r in self.replicas),
                    timeout=self._next_probe_s(),
                )
                continue
            if self._admission is not Dispatch.OPEN:
                await self._admit(live)
                continue
            if self._supervisors[replica].check is not None:  # its liveness is in question
                await self._wait(live, functools.partial(_unchecked, self._supervisors[replica]))
                continue
            return replica

    async def _wait(
        self, live: ss.Live, predicate: Callable[[], bool], timeout: float | None = None
    ) -> None:
        """The one way a request waits: until `predicate()`, its abort, the engine's close
        or `timeout` s (then it returns, for the caller to look again), within whatever
        deadline its caller set (`request_timeout_s`)."""
        with contextlib.suppress(TimeoutError):
            await self._progress.wait_until(
                lambda: predicate() or live.aborted or self._state.closed, timeout
            )

    def _next_probe_s(self) -> float | None:
        """Seconds until the next down replica is due for a probe (None: none is)."""
        now = asyncio.get_running_loop().time()
        due = [r.retry_at - now for r in self.replicas if r.state is ReplicaState.DOWN]
        later = [d for d in due if d > 0]  # those due now are being probed: their end wakes
        return min(later) + 1e-3 if later else None

    async def abort(self, request_id: str) -> None:
        """Abort every request of the group on its replica; its `generate` then returns the
        partial samples, finish reason "abort". A request still held for admission is never
        sent; an id not seen yet is remembered; an ended one is left alone."""
        if self._state.closed:
            return
        live = vllm_groups.claim_abort(self._live, self._recent, request_id)
        if live is None:
            return
        self._progress.notify()  # wakes parts held for admission
        started = [p.server_id for p in live.parts if p.started]
        if started and live.replica is not None:
            await self._abort_on(live.replica, started)

    async def pause_generation(self) -> None:
        """Hold new requests here, then freeze the running ones on every replica (keep mode:
        they keep their tokens and KV cache until resumed).

        Tokens sampled before the freeze may still reach `generate` after this returns: vLLM
        sends nothing that marks the end of a stream's pre-pause tokens. Each carries the
        version label it was sampled under, so none is mistaken for the next weights'.

        A replica that fails its `/pause` leaves the rotation (it is paused before it comes
        back); with none up the pause holds all the same: no replica serving now is a state,
        and those that come back are synced paused. A pause whose caller gives up part-way
        (the producer bounds it by `abort_timeout_s`) is undone, the replicas that paused
        resumed, by a task of the engine's own (`_end_control`): the caller is not held."""
        self._check_open()
        await self._revive_before_control()
        await self._state.acquire()
        paused_before, done = self._state.paused, False
        try:
            self._check_open()
            self._admission = Dispatch.HELD
            self._state.paused = True
            await self._each_replica("POST", sup.PAUSE)
            done = True
        finally:
            undo = done or paused_before or self._state.closed
            await self._end_control(None if undo else self._reopen)

    async def resume_generation(self) -> None:
        """Resume every replica and let held requests go. A replica that fails its `/resume`
        leaves the rotation (and comes back unpaused); none up is no dead engine: requests
        wait for one, each within its own deadline."""
        self._check_open()
        await self._revive_before_control()
        await self._state.acquire()
        done = False
        try:
            self._check_open()
            await self._reopen()
            done = True
        finally:
            await self._end_control(None if done or self._state.closed else self._reopen)

    async def update_weights(self, weights: Weights | LoraAdapter | None, *, version: int) -> None:
        """Write `weights` under `weights_dir` and load them on every replica (None: weights
        unchanged), and label later tokens `version` there; see `update_weights_from_path`.
        With `weight_transfer`, broadcast them over NCCL instead (see the module docstring).
        A `LoraAdapter` becomes the policy on every replica instead, over the base weights
        (`server_lora`; the engine needs `lora`)."""
        self._check_open()
        ss.check_version(version)
        await self._updates.weights(weights, version)

    async def update_weights_from_path(self, path: str | os.PathLike[str], *, version: int) -> None:
        """Load the safetensors checkpoint folder `path` (written by the trainer, readable by
        every replica) on every replica, and label later tokens `version`. Requests are held
        and running ones frozen meanwhile; running ones continue on the new weights (their
        KV cache recomputed), their later tokens labelled `version`."""
        self._check_open()
        ss.check_version(version)
        await self._updates.from_path(server_weights.checkpoint(path), version)

    async def close(self) -> None:
        """Stop serving: running `generate` calls raise `EngineDeadError` (their streams are
        closed, which makes vLLM abort them), later calls too; the replicas keep running."""
        if self._state.closed:
            return
        self._state.closed = self._client.closed = True
        self._progress.notify()
        self._state.changed.notify()  # a check waiting for a resume ends
        # Abort on the replicas first: a closed connection alone reaches vLLM only when it
        # next writes to the stream, which may be at the request's end.
        started = [
            (live.replica, [p.server_id for p in live.parts if p.started])
            for live in self._live.values()
            if live.replica is not None
        ]
        await asyncio.gather(*(self._abort_on(r, ids) for r, ids in started if ids))
        await vllm_groups.end_streams(self._live.values(), self.control_timeout_s)
        await asyncio.gather(*(s.stop() for s in self._supervisors.values()))
        self._tasks.cancel()
        with contextlib.suppress(Exception):
            await self._tasks.join()
        await self._lora.close(self.control_timeout_s)
        await self._client.close()
        self._folders.remove_all()
        if self._updates.weight_transfer is not None:
            self._updates.weight_transfer.leave()

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
        await self._progress.wait_until(
            lambda: self._generated >= tokens or self._state.closed, timeout
        )
        self._check_open()

    async def wait_held(self, requests: int, timeout: float) -> None:
        """Return once `held_requests >= requests`; `TimeoutError` after `timeout` s."""
        await self.wait_progress(lambda: self._held >= requests, timeout)

    async def wait_progress(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Return once `predicate()` holds, checked whenever requests are held, sent, stream
        tokens or end (e.g. on `replicas[i].streams`); `TimeoutError` after `timeout` s."""
        await self._progress.wait_until(lambda: predicate() or self._state.closed, timeout)
        self._check_open()

    # -- routing and replica health --------------------------------------------------------------

    async def check_replicas(self) -> None:
        """Probe every replica that is not up now (routing does it every `health_interval_s`),
        and bring back those that answer, with the current weights and version label (not,
        while the engine is paused, one whose engine core was seen hung: only a generate,
        after the resume, can show it alive)."""
        self._check_open()
        await asyncio.gather(
            *(
                s.sync(now=True)
                for r, s in self._supervisors.items()
                if r.state is not ReplicaState.UP
            )
        )

    def _session(self) -> aiohttp.ClientSession:
        self._check_open()  # never a new session once `close()` closed the last one
        return self._client.session()

    def _revive_due(self) -> None:
        """Start a sync of every new replica and of every down one due for a probe, each in
        its own task (its supervisor's). Nobody waits for them: a request waits for a
        replica's state within its own deadline, a pause or update goes on with the
        replicas that are up (one whose probe or reload hangs stalls nobody)."""
        now = asyncio.get_running_loop().time()
        for supervisor in self._supervisors.values():
            if supervisor.due(now):
                supervisor.start()

    async def _revive_before_control(self) -> None:
        """Before a pause, resume or update: the due syncs started and, when no replica is
        up, waited for up to `pause_timeout_s` (within `pause_bound_s`, and the caller's
        own deadline: cancelling this wait leaves the syncs running), so that a replica
        that is synced quickly (at the engine's start, above all) takes part."""
        self._revive_due()
        syncing = [s.task for s in self._supervisors.values() if s.task is not None]
        if syncing and not any(r.state is ReplicaState.UP for r in self.replicas):
            await asyncio.wait(syncing, timeout=self.pause_timeout_s)

    def _notify(self) -> None:
        self._progress.notify()

    def _down(self, replica: Replica, exc: BaseException) -> None:
        """`replica` leaves the rotation, and the NCCL group: its workers may be new
        processes when it answers again, so the next update rebuilds the group."""
        loop = asyncio.get_running_loop()
        replica.fail(str(exc), loop.time(), self.health_interval_s)
        self._leave_group(replica)
        self._progress.notify()

    def _leave_group(self, replica: Replica) -> None:
        self._group.leave(replica)

    def _failed(self, replica: Replica, exc: ReplicaError) -> None:
        """A request to `replica` failed: its supervisor checks whether the replica stays
        (`Supervisor.failed`); nobody waits for the check (requests sent there later wait
        for its outcome, each within its own deadline)."""
        self._supervisors[replica].failed(exc)

    def _unload_failed(self, replica: Replica, exc: ReplicaError) -> None:
        """An adapter's unload failed: like a failed abort, the supervisor checks the
        replica."""
        self._supervisors[replica].failed(exc)

    def _states(self) -> str:
        return "; ".join(f"{r.url} {r.state.value} ({r.error})" for r in self.replicas)

    # -- the control plane: calls on every replica, the frame of a pause or update ---------------

    async def _call(
        self,
        replica: Replica,
        method: str,
        path: str,
        json: Any = None,
        *,
        timeout_s: float | None = None,
        idempotent: bool = True,
    ) -> Any:
        """A control call (`ReplicaClient.call`)."""
        return await self._client.call(
            replica, method, path, json, timeout_s=timeout_s, idempotent=idempotent
        )

    async def _each_replica(self, method: str, path: str) -> None:
        """A pause or resume on every UP replica at once, within `pause_timeout_s`; one that
        fails leaves the rotation."""
        timeout_s = self.pause_timeout_s
        await self._on_every_up(lambda r: self._call(r, method, path, timeout_s=timeout_s))

    async def _on_every_up(self, call: Callable[[Replica], Awaitable[object]]) -> list[Replica]:
        """`call` on every UP replica at once (`_on_every`); those that succeeded. None up
        is no error: what the replicas must serve is the engine's state, which each one
        that comes back is synced to. When every replica asked refused the weights
        (`WeightMismatchError`), that refusal is raised: the weights are at fault."""
        asked = [r for r in self.replicas if r.state is ReplicaState.UP]
        refusals: list[BaseException] = []
        done = await self._on_every(asked, call, refusals)
        if asked and len(refusals) == len(asked):
            raise WeightMismatchError(
                f"every replica refused the weights: {'; '.join(map(str, refusals))}"
            )
        return done

    async def _on_every(
        self,
        replicas: Sequence[Replica],
        call: Callable[[Replica], Awaitable[object]],
        refusals: list[BaseException] | None = None,
    ) -> list[Replica]:
        """`call` on each of `replicas` at once; one that fails (`ReplicaError`) leaves the
        rotation, any other error is raised. A refusal of the weights
        (`replica_load.ReplicaWeightsError`: it may hold part of them) leaves it UNSYNCED,
        synced again at once with the engine's weights, and is added to `refusals`; so does
        a replica found restarted (`UnsyncedReplicaError`). Those that succeeded, in order."""
        results = await _each(call(r) for r in replicas)
        for replica, result in zip(replicas, results, strict=True):
            refused = isinstance(result, WeightMismatchError)
            if isinstance(result, ReplicaError) and (refused or _restarted(result)):
                if refusals is not None and refused:
                    refusals.append(result)
                replica.mark_unsynced(str(result))
                self._leave_group(replica)
                self._progress.notify()
            elif isinstance(result, ReplicaError):
                self._down(replica, result)
            elif isinstance(result, BaseException):
                raise result
        return [
            r
            for r, result in zip(replicas, results, strict=True)
            if not isinstance(result, BaseException)
        ]

    @contextlib.asynccontextmanager
    async def _frozen(self) -> AsyncIterator[None]:
        """A weight update's frame: under the control lock, admission held; afterwards (also
        after a failure, or its caller giving up) every replica resumed and admission
        released, unless the caller had paused (`_end_control`)."""
        self._check_open()
        await self._revive_before_control()
        await self._state.acquire()
        paused_before = self._state.paused
        try:
            self._check_open()
            self._admission = Dispatch.HELD
            yield
        finally:
            reopen = not paused_before and not self._state.closed
            await self._end_control(self._reopen if reopen else None)

    async def _end_control(self, cleanup: Callable[[], Awaitable[None]] | None) -> None:
        """End a pause, resume or update (the control lock held): `cleanup` (the resume
        that undoes its pause), then the lock given back, in a task of the engine's own.
        The caller waits for it unless it gives up (its deadline: an asyncio timeout, which
        cancels once and is not waited past, or an anyio cancel scope, which cancels every
        await in it): the cleanup still reaches every replica, and the
        next pause or update, waiting for the lock, comes after it. A resume cancelled
        before it was sent once left replicas paused while the engine counted them up."""

        async def end() -> None:
            try:
                if cleanup is not None and not self._state.closed:
                    with contextlib.suppress(EngineDeadError):
                        await cleanup()
            finally:
                self._state.release()

        task = self._tasks.spawn(end(), name="control-cleanup")
        current = asyncio.current_task()
        if current is None or not current.cancelling():  # a caller giving up is not held
            await asyncio.shield(task)

    async def _reopen(self) -> None:
        """Under the control lock: resume every replica that is up and let held requests
        go, whatever the resume did."""
        try:
            await self._each_replica("POST", "/resume")
        finally:
            self._state.paused = False
            self._admission = Dispatch.OPEN
            self._progress.notify()

    # -- generation ------------------------------------------------------------------------------

    def _split(self, request: GenerateRequest) -> list[ss.Part]:
        """Fresh samples of one budget travel together as `n` (not when greedy: vLLM refuses
        n > 1 then), continued samples one request each (see `vllm_groups.split_group`)."""
        together = request.sampling.temperature > 0
        return vllm_groups.split_group(request, self._vocab_size, together=together, part=ss.Part)

    async def _run_parts(
        self, live: ss.Live, samples: list[ss.Sample], sampling: SamplingConfig
    ) -> None:
        """Stream every part; on the first error (or a cancellation) end the others, abort
        what was sent, and raise."""
        replica = live.replica
        assert replica is not None  # routed (`_ready`)
        tasks = live.tasks = [
            asyncio.ensure_future(self._stream(live, part, samples, sampling))
            for part in live.parts
        ]
        gave_up = False
        try:
            error = await vllm_groups.first_error(tasks)
        except asyncio.CancelledError:
            gave_up = True
            self._caller_gave_up(live)
            raise
        finally:
            unfinished = [
                p.server_id
                for p, task in zip(live.parts, tasks, strict=True)
                if p.started and ss.unfinished(task)
            ]
            if unfinished and not self._state.closed:  # do not rely on the disconnect alone
                # in a task of the engine's: a caller that gave up is not held for it
                abort = self._tasks.spawn(self._abort_on(replica, unfinished), name="abort")
                if not gave_up:
                    await asyncio.shield(abort)
        if self._state.closed:
            raise EngineDeadError("VLLMServerEngine is closed")
        if error is not None:
            if isinstance(error, ReplicaError):
                self._failed(replica, error)
            raise error

    def _caller_gave_up(self, live: ss.Live) -> None:
        """`generate` was cancelled (the producer's `generate_timeout_s`, or this engine's
        `request_timeout_s`) while requests it sent were unfinished: the replica is checked
        as after a failed request. A wedged engine core whose `/health` and
        `/abort_requests` answer fails nothing else: every group sent there ran into its
        caller's deadline, and the replica stayed in the rotation (the chaos run's 140 late
        groups)."""
        if self._state.closed or live.replica is None:
            return
        unfinished = [
            p.server_id
            for p, t in zip(live.parts, live.tasks, strict=True)
            if p.started and ss.unfinished(t)
        ]
        if unfinished:
            error = ReplicaError(
                live.replica.url,
                f"{len(unfinished)} requests unfinished when their caller gave up on them",
            )
            self._supervisors[live.replica].failed(error)  # not awaited: the caller is gone

    async def _admit(self, live: ss.Live) -> None:
        """Wait while admission is held (a pause or weight update); an abort or close ends
        the wait."""
        if self._admission is Dispatch.OPEN:
            return
        self._held += 1
        self._progress.notify()
        try:
            await self._wait(live, lambda: self._admission is Dispatch.OPEN)
        finally:
            self._held -= 1

    async def _stream(
        self, live: ss.Live, part: ss.Part, samples: list[ss.Sample], sampling: SamplingConfig
    ) -> None:
        replica = live.replica
        assert replica is not None  # routed (`_ready`)
        supervisor = self._supervisors[replica]
        while self._admission is not Dispatch.OPEN or supervisor.check is not None:
            await self._admit(live)  # a pause may have begun since it was routed
            await self._wait(live, lambda: supervisor.check is None)  # its liveness checked
            if live.aborted or self._state.closed:
                break
        if self._state.closed:
            raise EngineDeadError("VLLMServerEngine is closed")
        if live.aborted:
            for i in part.indices:
                samples[i].finish = "abort"
            return
        if not _up(replica):  # it left the rotation while this waited: routed again
            raise _NotSent(replica.url)
        body: dict[str, Any] = {
            "request_id": part.server_id,
            "token_ids": part.prompt,
            "stream": True,
            "sampling_params": ss.sampling_params(sampling, part, self.stream_interval),
        }
        adapter = part.adapter = self._lora.bind()
        if adapter is not None:  # every token of the request is sampled with it
            body["model"] = adapter.name
            for i in part.indices:
                samples[i].label = self._state.version
        part.started = True
        self._open_streams += 1
        replica.streams += 1
        replica.sent += 1
        self._progress.notify()
        try:
            async with self._answered(live, f"{replica.url}/inference/v1/generate", body) as reply:
                if reply is None:  # aborted before the replica answered: nothing to wait for
                    for i in part.indices:
                        samples[i].finish = "abort"
                    return
                if reply.status != 200:
                    head = await rp.read_at_most(reply, rp.ERROR_BODY_BYTES)
                    text = head.decode(errors="replace")
                    error = ReplicaError(replica.url, f"generate -> HTTP {reply.status}: {text}")
                    if reply.status == 404 and adapter is not None and adapter.name in text:
                        raise UnsyncedReplicaError(
                            replica.url,
                            f"does not know the adapter {adapter.name} (did it restart?): {text}",
                        )
                    if 400 <= reply.status < 500:
                        raise rp.Rejected(str(error))
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
                        sample = samples[part.indices[choice.index]]
                        got = ss.append(sample, choice, replica.url, self._vocab_size)
                        self._generated += got
                    self._progress.notify()
                    if first and _aborted(live):  # the abort may have beaten the request there
                        await self._abort_on(replica, [part.server_id])
                    first = False
        except (rp.Rejected, EngineDeadError):
            raise
        except Exception as exc:  # anything else from talking to the replica is its failure
            self._check_open()  # `close()` closed the session under this stream
            raise rp.replica_failure(replica, "generate", exc) from None
        finally:
            self._open_streams -= 1
            replica.streams -= 1
            self._progress.notify()

    @contextlib.asynccontextmanager
    async def _answered(
        self, live: ss.Live, url: str, body: dict[str, Any]
    ) -> AsyncIterator[aiohttp.ClientResponse | None]:
        """POST a generate and yield the reply once the replica answers, or None when the
        request is aborted first: the POST may wait for one of `max_connections` stream
        connections (streams of a wedged replica hold them), and that wait too ends on the
        caller's abort (the control-plane simulation found aborted requests held there until
        a connection freed). Cancelled before it was answered, the request never reached the
        replica, or its connection closes, which makes vLLM abort it."""
        post = self._session().post(url, json=body)
        request = asyncio.ensure_future(post.__aenter__())
        request.add_done_callback(lambda _: self._progress.notify())
        try:
            await self._wait(live, request.done)
        finally:
            if not request.done():
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)
        if request.cancelled():
            yield None
            return
        reply = request.result()  # the POST's own error, if any
        try:
            yield reply
        finally:
            await post.__aexit__(None, None, None)

    async def _abort_on(self, replica: Replica, server_ids: list[str]) -> None:
        """Abort requests on `replica`, through the RL route that returns once vLLM has
        aborted them (`/inference/v1/abort_requests` only starts a task that will). A failure
        fails no request (the stream's own end or deadline still bounds it), but is a failed
        call to the replica like any other: one whose engine core is not alive either leaves
        the rotation. Often this abort is the last call a hung replica gets (its caller gave
        up on the request), and nothing else would take it out. Within `pause_timeout_s`, and
        not waiting for that check: a caller that gave up (the producer's
        `generate_timeout_s`) is not held past it by a hung replica."""
        ids = [_SERVER_PREFIX + s for s in server_ids]
        try:
            await self._call(
                replica,
                "POST",
                "/abort_requests",
                {"request_ids": ids},
                timeout_s=self.pause_timeout_s,
            )
        except ReplicaError as exc:
            self._supervisors[replica].failed(exc)  # the supervisor owns the check

    async def _end_adapter_requests(self) -> None:
        """Before new full weights (the replicas paused): abort the requests sent with an
        adapter. It was trained on the old base weights; over the new ones they would sample
        with a policy no version names. They return their samples so far, finish "abort"
        (to be continued), labelled with their adapter's version, as `VLLMEngine` does."""
        running = [
            rid
            for rid, live in self._live.items()
            if any(p.adapter is not None for p in live.parts)
        ]
        await asyncio.gather(*(self.abort(rid) for rid in running))

    def _check_open(self) -> None:
        if self._state.closed:
            raise EngineDeadError("VLLMServerEngine is closed")


def _server(url: str) -> tuple[str | None, int | None, str]:
    """What names one server in a base URL: "http://A:80" and "http://a" are the same one,
    and one server listed twice would be two ranks of one NCCL group."""
    parsed = yarl.URL(url)
    return parsed.host, parsed.port, parsed.path.rstrip("/")


class _NotSent(Exception):
    """A request's replica left the rotation before its request was sent."""


async def _each(calls: Iterable[Awaitable[object]]) -> list[object]:
    """Run `calls` at once; each one's result or exception, in order. Not `asyncio.gather`:
    cancelled, a gather raises a `CancelledError` of its own making, which an anyio cancel
    scope (the producer's, around a pause) does not recognise as its own and lets escape
    (the control-plane simulation found it); here the caller's own cancellation is raised,
    and the calls are cancelled."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
            task.add_done_callback(_retrieve)
        raise
    return [_outcome(t) for t in tasks]


def _outcome(task: asyncio.Future[object]) -> object:
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception() or task.result()


def _retrieve(task: asyncio.Future[object]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a call cut with its caller is no unhandled error


def _restarted(error: ReplicaError) -> bool:
    return isinstance(error, UnsyncedReplicaError)


def _syncing(supervisor: sup.Supervisor) -> bool:
    return supervisor.task is not None


def _idle(supervisor: sup.Supervisor) -> bool:
    return supervisor.task is None


def _unchecked(supervisor: sup.Supervisor) -> bool:
    return supervisor.check is None


def _up(replica: Replica) -> bool:
    """Whether `replica` is up, read through a call: its state changes across awaits, which
    mypy's narrowing does not know."""
    return replica.state is ReplicaState.UP


def _aborted(live: ss.Live) -> bool:
    """`live.aborted`, read through a call: it changes across awaits, which mypy's narrowing
    does not know."""
    return live.aborted
