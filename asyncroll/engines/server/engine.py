"""`VLLMServerEngine`: the `Engine` protocol over `vllm serve` replicas, token ids in and out.

When rollout outgrows one machine, the distributed engine users already run is vLLM itself:
`vllm serve` replicas (each with its own tensor/data parallelism). The producer stays in this
process; this engine speaks to every replica over HTTP (vLLM >= 0.32, servers started as
`launch.serve_args` says; measured in `vllm-serve-cpu.md` of the team's reference notes).
The user's reference (setting up, transports, failures, deadlines) is docs/server-engine.md;
what the code keeps, and why:

* **One HTTP request per group** (`POST /inference/v1/generate`): fresh samples travel
  together as `n`, continued ones one request each. On 2 CPU cores one request carrying a
  group ran at offline speed, while many single-sample requests starved.
* **Versions come from the server.** Each token's version is vLLM's label of the weights
  that sampled it (`/update_weight_version`, set with the weights, on the process that
  loaded them: `updates.WeightUpdates.label`); a label the engine never set (a replica that
  restarted between probes) fails the request and takes the replica out of the rotation
  until it is synced again.
* **No request straddles a weight update.** vLLM queues requests that arrive while it is
  paused and runs them later on whatever weights it then has, so admission stops *here*
  first (`control.Dispatch`).
* **Weights through a shared path** (`weights_dir`, loaded by asyncroll's worker extension,
  `replica_load`), **over NCCL** (`weight_transfer`) or **as a LoRA adapter** (`lora`): the
  update path, `updates`. An update commits only once every replica loaded it; a version's
  weights are immutable (`weights.Checkpoint`).
* **One replica cannot take the others down.** Any error in what a replica sends is that
  replica's failure and fails only the requests it had; its owner (`supervisor`) alone
  probes, re-syncs and readmits it. A stream whose connection is lost is one request's
  failure: sent again once the replica's liveness check passed (`request_path`); so is one
  a replica refused because someone else paused its vLLM (`vllm.refusals`). No replica up
  is a state, not death: a request waits for one within its own deadline
  (`NoReplicaError`); `EngineDeadError` only once closed.
* **Deadlines that compose.** Every wait a caller makes is bounded by its own deadline and
  ends on its abort; a pause or resume takes at most `pause_bound_s`, to keep under the
  producer's `abort_timeout_s`. Control calls have connections of their own (`client`).

This module is a facade: it checks the arguments, composes the rooms (the package's
docstring lists them) and keeps the `Engine` protocol's surface.

aiohttp rather than httpx: it is already a vLLM dependency, and its connection pool is the
cheaper of the two per request (`benchmarks/server_throughput.py` has the numbers).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import yarl

from asyncroll._core.tasks import Tasks
from asyncroll._core.wakeup import Signal
from asyncroll.engines.base import (
    EngineDeadError,
    GenerateRequest,
    SampleOutput,
    Weights,
)
from asyncroll.engines.server import lora as server_lora
from asyncroll.engines.server import nccl_transfer
from asyncroll.engines.server import samples as ss
from asyncroll.engines.server import supervisor as sup
from asyncroll.engines.server import updates as server_updates
from asyncroll.engines.server import weights as server_weights
from asyncroll.engines.server.client import ReplicaClient, Sessions
from asyncroll.engines.server.control import ReplicaControl
from asyncroll.engines.server.replicas import Replica
from asyncroll.engines.server.request_path import RequestPath
from asyncroll.engines.server.samples import attempt_session
from asyncroll.lora import LoraAdapter, LoraSlots

__all__ = ["VLLMServerEngine", "attempt_session"]


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
    or abort (keep `pause_bound_s` under the producer's `abort_timeout_s`);
    `control_timeout_s` a weight load and other control calls; `health_timeout_s` a
    `/health`; `liveness_timeout_s` the one-token generate that tells a live engine core
    from a hung one; `health_interval_s` the first delay before a failed replica's next
    probe (doubling with each failure in a row, to 32 times it).

    `lora`: serve `LoraAdapter`s given to `update_weights` (`asyncroll.lora.LoraSlots`, the
    same argument as `VLLMEngine`'s; every replica must be started with the same slots,
    `launch.serve_args(..., lora=...)`, and `weights_dir` is needed to write them).

    `sessions`: makes the HTTP sessions (`client.Sessions`; the deterministic
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
        self.control_timeout_s = control_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.health_timeout_s = health_timeout_s
        self.health_interval_s = health_interval_s
        self.liveness_timeout_s = liveness_timeout_s
        self.pause_timeout_s = pause_timeout_s
        self.max_connections = max_connections
        # Each piece of state has one writer: `ControlState` the control calls and updates
        # (under its lock), `ReplicaControl.admission` the control calls, what is in flight the
        # request path, each replica's state its supervisor (and the control calls' outcomes,
        # through `ReplicaControl.down`). The supervisors and the rooms need one another (a
        # supervisor re-syncs with the update path's loads; an update runs in the control
        # calls' frame, which starts the supervisors' syncs): their mapping is handed out
        # empty and filled at the end here, before anything can run.
        self._state = sup.ControlState()
        self._progress = Signal()  # something a request or a caller may wait on changed
        self._tasks = Tasks()  # cleanups and aborts that outlive the caller who started them
        self._client = ReplicaClient(
            max_connections=self.max_connections,
            connect_timeout_s=self.connect_timeout_s,
            control_timeout_s=self.control_timeout_s,
            health_timeout_s=self.health_timeout_s,
            liveness_timeout_s=self.liveness_timeout_s,
            sessions=sessions,
        )
        self._folders = server_weights.WeightFolders()
        self._supervisors: dict[Replica, sup.Supervisor] = {}
        control = self._control = ReplicaControl(
            self.replicas,
            self._state,
            self._client,
            self._supervisors,
            self._progress,
            self._tasks,
            pause_timeout_s=self.pause_timeout_s,
            health_interval_s=self.health_interval_s,
        )
        self._lora = server_lora.ServerAdapters(lora, self._client, control.failed)
        requests = self._requests = RequestPath(
            self.replicas,
            self._state,
            self._client,
            self._supervisors,
            control,
            self._lora,
            self._progress,
            self._tasks,
            vocab_size=self._vocab_size,
            session_of=session_of,
            stream_interval=stream_interval,
            request_timeout_s=request_timeout_s,
            pause_timeout_s=self.pause_timeout_s,
        )
        fleet = server_updates.Fleet(
            frozen=control.frozen,
            pause_up=control.pause_up,
            on_every=control.on_every,
            on_every_up=control.on_every_up,
            down=control.down,
            end_adapter_requests=requests.end_adapter_requests,
            states=control.states,
        )
        self._updates = server_updates.WeightUpdates(
            self.replicas,
            self._state,
            self._client,
            self._folders,
            self._lora,
            control.group,
            fleet,
            weights_dir=None if weights_dir is None else Path(weights_dir),
            weight_transfer=weight_transfer,
            verify_weights=verify_weights,
            pause_timeout_s=self.pause_timeout_s,
            health_timeout_s=self.health_timeout_s,
        )
        for replica in self.replicas:
            self._supervisors[replica] = sup.Supervisor(
                replica,
                self._state,
                self._client,
                self._folders,
                self._updates.resync_load,
                self._updates.own_model,
                control.down,
                control.leave_group,
                relabel=self._updates.label,
                on_change=self._progress.notify,
                pause_timeout_s=self.pause_timeout_s,
            )

    # -- settings read by the request path (set between requests by some callers) ---------------

    @property
    def session_of(self) -> Callable[[str], str]:
        """Maps a request id without a session to its session key."""
        return self._requests.session_of

    @session_of.setter
    def session_of(self, session_of: Callable[[str], str]) -> None:
        self._requests.session_of = session_of

    @property
    def stream_interval(self) -> int | None:
        """Also receive a sample's tokens every that many (None: first token, then the end)."""
        return self._requests.stream_interval

    @stream_interval.setter
    def stream_interval(self, tokens: int | None) -> None:
        self._requests.stream_interval = tokens

    @property
    def request_timeout_s(self) -> float:
        """The deadline of one `generate`."""
        return self._requests.request_timeout_s

    @request_timeout_s.setter
    def request_timeout_s(self, seconds: float) -> None:
        self._requests.request_timeout_s = seconds

    # -- how updates reach the replicas (`updates.WeightUpdates` holds these) --------------------

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
        update itself only freezes the replicas (keep mode) while they load it (`lora`)."""
        return None if self._lora.slots is None else self._lora.slots.slots

    @property
    def pause_bound_s(self) -> float:
        """The longest `pause_generation` or `resume_generation` takes while no weight
        update runs, whatever the replicas do: 2 x `pause_timeout_s`. Its longest chain of
        waits: the control lock, held by one of (the end of a control call whose caller gave
        up: one resume on each replica at once; or a replica owner's catch-up after a
        re-sync, `Supervisor._catch_up`: a few calls, `pause_timeout_s` in all), never by
        several in turn (owners let a waiting pause go first, `ControlState.joining`); then
        its own call on each replica at once, `pause_timeout_s` each. It waits for no
        replica's sync (a replica that joins later is paused or resumed as the engine then
        is). Deadlines compose only if this is below the caller's own (the producer's
        `abort_timeout_s`, 30 s by default; it refuses one that is not): a pause that
        outlives its caller is undone and the run stops."""
        return 2 * self.pause_timeout_s

    def payload_bytes(self, max_new_tokens: int) -> int:
        """The bytes a sample's tokens hold here while in flight (`samples.Sample`),
        beyond what the producer counts for its encoded tokens: they are in this process,
        and the buffer's byte bound must cover them."""
        return ss.IN_FLIGHT_BYTES_PER_TOKEN * max_new_tokens + ss.IN_FLIGHT_SAMPLE_BYTES

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        """Route the group, wait (within `request_timeout_s`, ended by `abort`) until its
        replica may be sent to, then stream its requests there. A request not yet sent when
        its replica leaves the rotation is routed again; with no replica up it waits for
        one until its deadline (`NoReplicaError`, naming each replica: no dead engine)."""
        return await self._requests.generate(request)

    async def abort(self, request_id: str) -> None:
        """Abort every request of the group on its replica; its `generate` then returns the
        partial samples, finish reason "abort". A request still held for admission is never
        sent; an id not seen yet is remembered; an ended one is left alone."""
        await self._requests.abort(request_id)

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
        resumed, by a task of the engine's own: the caller is not held."""
        await self._control.pause()

    async def resume_generation(self) -> None:
        """Resume every replica and let held requests go. A replica that fails its `/resume`
        leaves the rotation (and comes back unpaused); none up is no dead engine: requests
        wait for one, each within its own deadline."""
        await self._control.resume()

    async def update_weights(self, weights: Weights | LoraAdapter | None, *, version: int) -> None:
        """Write `weights` under `weights_dir` and load them on every replica (None: weights
        unchanged), and label later tokens `version` there; see `update_weights_from_path`.
        With `weight_transfer`, broadcast them over NCCL instead (see the module docstring).
        A `LoraAdapter` becomes the policy on every replica instead, over the base weights
        (`lora`; the engine needs `lora`)."""
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
        await self._requests.end_all(self.control_timeout_s)
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
        return self._requests.open_streams

    def samples_started(self, request_id: str) -> int:
        """How many samples of the running request `request_id` have received a token."""
        live = self._requests.live.get(request_id)
        return 0 if live is None else sum(1 for s in live.samples if s.tokens)

    @property
    def held_requests(self) -> int:
        """Requests waiting for admission (the engine is paused or updating weights)."""
        return self._requests.held

    @property
    def pause_refusals(self) -> int:
        """Requests a replica refused since the engine started because someone else paused its
        vLLM in mode "abort" or "wait" (each was sent again after a backoff:
        `asyncroll.engines.vllm.refusals`)."""
        return self._requests.pause_refusals

    @property
    def generated_tokens(self) -> int:
        """Tokens received from the replicas since the engine started."""
        return self._requests.generated

    async def wait_generated(self, tokens: int, timeout: float) -> None:
        """Return once `generated_tokens >= tokens`; `TimeoutError` after `timeout` s."""
        await self.wait_progress(lambda: self._requests.generated >= tokens, timeout)

    async def wait_held(self, requests: int, timeout: float) -> None:
        """Return once `held_requests >= requests`; `TimeoutError` after `timeout` s."""
        await self.wait_progress(lambda: self._requests.held >= requests, timeout)

    async def wait_progress(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Return once `predicate()` holds, checked whenever requests are held, sent, stream
        tokens or end (e.g. on `replicas[i].streams`); `TimeoutError` after `timeout` s."""
        await self._progress.wait_until(lambda: predicate() or self._state.closed, timeout)
        self._check_open()

    # -- replica health --------------------------------------------------------------------------

    async def check_replicas(self) -> None:
        """Probe every replica that is not up now (routing does it every `health_interval_s`),
        and bring back those that answer, with the current weights and version label (not,
        while the engine is paused, one whose engine core was seen hung: only a generate,
        after the resume, can show it alive)."""
        self._check_open()
        await self._control.check_replicas()

    def _check_open(self) -> None:
        if self._state.closed:
            raise EngineDeadError("VLLMServerEngine is closed")


def _server(url: str) -> tuple[str | None, int | None, str]:
    """What names one server in a base URL: "http://A:80" and "http://a" are the same one,
    and one server listed twice would be two ranks of one NCCL group."""
    parsed = yarl.URL(url)
    return parsed.host, parsed.port, parsed.path.rstrip("/")
