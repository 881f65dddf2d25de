"""`VLLMEngine`: vLLM's `AsyncLLM` in this process, driven from the caller's event loop.

No HTTP server and no Ray: the engine core and its workers are vLLM's own child processes, and
every request is an async generator in this loop. The pieces of vLLM (>= 0.32) it builds on:

* **Per-token versions.** The engine core labels every step's outputs with its current weight
  version, and a finished output carries the label spans over its tokens. `update_weights`
  changes the label only while the scheduler is paused, so each token's version is the version
  of the weights that sampled it, including tokens sampled before a pause and received after
  it. Versions are exact in both pause modes; nothing is stamped on arrival.
* **Keep-in-place pause.** `pause_generation` freezes running requests inside vLLM
  (`mode="keep"`) with their KV cache. A weight update then preempts them
  (`reset_prefix_cache(reset_running_requests=True)`), so on resume vLLM recomputes their KV
  cache under the new weights: tokens after the update are exactly what the new weights sample
  given the prefix, as after an abort and re-prefill, without leaving vLLM. A pause without an
  update keeps the KV cache.
* **Abort keeps partial samples.** Aborting a request makes vLLM emit a final output with
  every token (and logprob and version span) received so far, finish reason "abort".
* **Weight reload** through `WeightLoaderExtension` (`asyncroll.engines.vllm.in_worker`), mixed
  into vLLM's workers.
* **Routed experts** (MoE router replay), when the engine is built with
  `enable_return_routed_experts=True`: one row of layers x top-k expert ids per new token.
  vLLM 0.32 returns them only with its model runner V2 (`VLLM_USE_V2_MODEL_RUNNER=1`), which
  needs Triton: GPU only.

Samples are streamed as DELTA outputs: the first token, then (by default) everything at the end.
The first-token output makes progress observable (`generated_tokens`, `wait_generated`) and
lets an abort that raced with a request still being added reach it at once. Outputs every
`stream_interval` tokens are available, at a price: on 2 CPU cores with the tiny model, an
output every 32 tokens cost about 5% of throughput.

The engine owns the calls into vLLM, the requests in flight, the pause and the version label;
what vLLM is started with is `startup`, a group's streams and outputs `streams`, the full-weight
load and whether the weights can be vouched for `loading`, the LoRA adapters `lora`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import typing
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from asyncroll import lifetime
from asyncroll._core.tasks import finish
from asyncroll._core.wakeup import Signal
from asyncroll.engines.base import (
    EngineDeadError,
    GenerateRequest,
    RecentIds,
    SampleOutput,
    SamplingConfig,
    Weights,
)
from asyncroll.engines.vllm import compat, refusals, startup, streams, weight_check
from asyncroll.engines.vllm import groups as vllm_groups
from asyncroll.engines.vllm.loading import WEIGHTS_DIR, WeightLoader, WeightsState
from asyncroll.engines.vllm.lora import Adapter, AdapterSet, AdapterState
from asyncroll.engines.vllm.startup import Transfer
from asyncroll.engines.vllm.streams import GroupPart, LiveGroup, StreamedSample
from asyncroll.lora import LoraAdapter, LoraSlots, check_servable

__all__ = ["SHUTDOWN_GRACE_S", "Transfer", "VLLMEngine", "WeightsState"]

# How long vLLM's shutdown waits for its engine core to exit after SIGTERM before it kills it.
# An idle engine core sometimes never runs its SIGTERM handler (CPython runs Python handlers
# only when the main thread runs bytecode, and it sat blocked in `input_queue.get()`): with
# `control_timeout_s` (300 s) as the grace, a close then took 300 s (seen in 1 of 6 LoRA engine
# closes under load; benchmarks/README.md, lora_throughput). vLLM's own default grace is 5 s.
SHUTDOWN_GRACE_S = 30.0


class VLLMEngine:
    """The `Engine` protocol on vLLM `AsyncLLM` (see the module docstring).

    `model` is a Hugging Face model folder (e.g. `asyncroll.app.models.build_tiny_model()`).
    `engine_args` go to `vllm.AsyncEngineArgs` unchanged (`tensor_parallel_size`,
    `data_parallel_size`, `gpu_memory_utilization`, `max_model_len`, `dtype`, `seed`,
    `kv_cache_memory_bytes`, `enable_return_routed_experts`, ...). Defaults fill what the
    caller did not give: `skip_tokenizer_init=True` (prompts are token ids),
    `logprobs_mode="processed_logprobs"` (logprobs of the distribution that sampled),
    `disable_log_stats=True`, and on a CPU build `enforce_eager=True` and a 128 MiB KV cache
    (vLLM's CPU default reserves a share of the NUMA node that can exceed free memory).

    Constructing starts vLLM's processes and blocks while it does (11-20 s on 2 CPU cores); the
    engine then belongs to the event loop that first uses it.

    `parallel_sampling`: True sends the fresh samples of a group as one vLLM request with
    `n=k` (not when greedy: vLLM refuses n > 1 then); False, the default, sends one request per
    sample, as resumed samples need anyway since their prefixes differ. vLLM fans `n=k` out
    into k requests in its front end, so both share the prompt's KV blocks through the prefix
    cache, and `benchmarks/vllm_throughput.py` measures no difference beyond noise (tiny model,
    2 CPU cores); one code path for fresh and resumed samples decides it.

    `stream_interval`: also receive a sample's tokens every that many tokens (None: only its
    first token and the rest at the end, the fastest; see the module docstring).

    `generate_timeout_s` bounds one `generate` call (its vLLM requests are aborted when it
    runs out) and `control_timeout_s` every other call into vLLM: nothing here waits forever.

    `transfer`: how `update_weights` moves tensors into the workers. "file" writes one
    safetensors file to /dev/shm that each worker memory-maps (works for any placement, CPU or
    GPU); "cuda_ipc" shares CUDA tensors with the worker without a copy (needs the tensors on
    the GPU of a single-GPU engine); "auto" picks "cuda_ipc" when that holds, else "file".

    Every update must fit and cover the served checkpoint: a tensor whose shape or dtype is not
    its checkpoint tensor's is refused before anything is sent
    (`weight_check.WeightLayoutError`, naming each; the engine serves on unchanged), and a
    tensor of its files that the update lacks, or a layer that got no tensor, fails it
    (`weight_check.WeightMismatchError`, naming them). `verify_weights=True` also checks, in
    each worker, that every tensor arrived with the bytes sent and that the model serves them
    (see `asyncroll.engines.vllm.weight_check`; its cost is in benchmarks/README.md). After a failed
    check, or an update cut off (or failed) once the workers had it, the engine refuses to
    generate (`WeightMismatchError`; running requests end as aborted) until an update succeeds:
    no token is labelled with weights that are not the trainer's.

    `trainer_headroom_bytes` and `reload_headroom_bytes` (GPU only): the device memory vLLM
    leaves to a trainer's process on the same GPU, and free for reloading weights (None:
    `compat.DEFAULT_RELOAD_HEADROOM_BYTES`, 1 GiB; give at least twice the largest layer). On
    CUDA the engine sets `gpu_memory_utilization` from them unless the caller gives it or
    `kv_cache_memory_bytes` (vLLM 0.34 would otherwise take all free memory for an extensible
    KV cache and refuse reloads short of memory; `asyncroll.engines.vllm.compat`).
    `data_parallel_size > 1` and `VLLM_RELOAD_MODE=direct` are refused (`compat`).

    `devices` (GPU only): the GPUs vLLM's processes use, as the machine numbers them (e.g.
    `[4, 5, 6, 7]` beside a trainer launched on GPUs 0-3); None: the ones this process sees.
    vLLM's workers are processes of their own, so they can use GPUs this process does not
    see; the GPU this process's torch already works on is refused (`startup.visible_devices`).
    The memory settings above assume the machine's GPUs are alike.

    `lora`: serve LoRA adapters (`update_weights` with a `asyncroll.lora.LoraAdapter`), with
    `LoraSlots(max_rank=, slots=)` as vLLM's `max_lora_rank` and `max_loras` (None: no LoRA,
    and an adapter update raises `LoraError`). Each adapter update registers the adapter in
    vLLM's workers (a file in /dev/shm, as full weights), under a new id and name, and every
    request started after it carries it (vLLM binds an adapter to a request for the request's
    life): requests already running finish under the adapter they started with, every token
    of a request is labelled with its adapter's version, and no request straddles two
    adapters. An adapter that is not the policy is unloaded as soon as no running request uses
    it; when all `slots` hold adapters in use, the requests of the oldest are aborted (their
    partial samples can be continued) to make room (`asyncroll.engines.vllm.lora`). With one
    slot that oldest is the policy itself: requests that start while its requests end wait
    for the new adapter (within `control_timeout_s`) instead of binding to the old one.
    A full-weight update ends the adapter policy first (vLLM's reload drops the workers'
    adapters), aborts the requests that run under an adapter (the base weights would change
    under them), and serves the new base weights without an adapter.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        parallel_sampling: bool = False,
        stream_interval: int | None = None,
        transfer: Transfer = "auto",
        generate_timeout_s: float = 3600.0,
        control_timeout_s: float = 300.0,
        verify_weights: bool = False,
        lora: LoraSlots | None = None,
        trainer_headroom_bytes: int = 0,
        reload_headroom_bytes: int | None = None,
        devices: Sequence[int | str] | None = None,
        **engine_args: Any,
    ) -> None:
        from vllm import __version__ as vllm_version
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine import PauseMode
        from vllm.v1.engine.async_llm import AsyncLLM

        startup.require_vllm(vllm_version)
        compat.check_environment()
        compat.refuse_data_parallel(engine_args)
        on_cpu = current_platform.is_cpu()
        visible = startup.visible_devices(devices, engine_args, on_cpu=on_cpu)
        if on_cpu and (trainer_headroom_bytes or reload_headroom_bytes is not None):
            raise ValueError("trainer_headroom_bytes and reload_headroom_bytes are for GPUs")
        if not on_cpu:
            compat.gpu_memory(
                engine_args,
                total_bytes=int(current_platform.get_device_total_memory(0)),
                trainer_headroom_bytes=trainer_headroom_bytes,
                reload_headroom_bytes=reload_headroom_bytes,
            )
        startup.engine_arguments(
            engine_args,
            stream_interval=stream_interval,
            transfer=transfer,
            generate_timeout_s=generate_timeout_s,
            control_timeout_s=control_timeout_s,
            lora=lora,
            on_cpu=on_cpu,
        )
        self.model = str(model)
        self.parallel_sampling = parallel_sampling
        self.stream_interval = stream_interval
        self.generate_timeout_s = generate_timeout_s
        self.control_timeout_s = control_timeout_s
        self.lora = lora
        args = AsyncEngineArgs(model=self.model, **engine_args)
        # vLLM's processes end with this one, however it ends (`asyncroll.lifetime`)
        self._tie = lifetime.tie()
        try:
            with startup.child_environment(on_cpu, visible), self._tie.starting():
                self._llm: Any = AsyncLLM.from_engine_args(args)
        except BaseException:
            self._tie.release()
            raise
        config = self._llm.vllm_config
        self._vocab_size = int(config.model_config.get_vocab_size())
        self._max_model_len = int(config.model_config.max_model_len)
        parallel = config.parallel_config
        self._world_size = int(parallel.world_size) * int(parallel.data_parallel_size)
        experts = bool(args.enable_return_routed_experts)
        self._experts_row_bytes = startup.experts_row_bytes(config) if experts else 0
        self._keep_pause = "keep" in typing.get_args(PauseMode)
        self._version = 0
        self._live: dict[str, LiveGroup] = {}
        self._recent = RecentIds()
        self._generated = 0
        # requests vLLM refused since the start because someone else paused it (each sent
        # again: `asyncroll.engines.vllm.refusals`), read as `pause_refusals`
        self._pause_refusals = 0
        self._progress = Signal()
        self._paused = False
        self._control = asyncio.Lock()
        self._closed = False
        self._adapters = AdapterSet(self._llm, self._call, f"vLLM engine {self.model}", WEIGHTS_DIR)
        self._loader = WeightLoader(
            self._llm,
            self._call,
            model=self.model,
            transfer=transfer,
            verify_weights=verify_weights,
            world_size=self._world_size,
            layout=weight_check.checkpoint_layout(self.model),  # what updates must fit
        )

    @property
    def transfer(self) -> Transfer:
        """How updates move tensors into the workers (see the class docstring)."""
        return self._loader.transfer

    @transfer.setter
    def transfer(self, transfer: Transfer) -> None:
        self._loader.transfer = transfer

    @property
    def verify_weights(self) -> bool:
        """Whether each update is checked in the workers as received and served (see the class
        docstring); it may be switched between updates."""
        return self._loader.verify_weights

    @verify_weights.setter
    def verify_weights(self, on: bool) -> None:
        self._loader.verify_weights = on

    # -- Engine protocol -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def supports_keep_pause(self) -> bool:
        return self._keep_pause

    @property
    def version(self) -> int:
        return self._version

    @property
    def adapter_slots(self) -> int | None:
        """Adapters registered at once (`LoraSlots.slots`, vLLM's `max_loras`; None: no
        LoRA). Each request keeps the adapter it started with (`Engine.adapter_slots`)."""
        return None if self.lora is None else self.lora.slots

    @property
    def pause_bound_s(self) -> None:
        """No bound of its own: a pause waits on the engine core, under the caller's deadline."""
        return None

    def payload_bytes(self, max_new_tokens: int) -> int:
        """Routed experts (one row of layers x top-k expert ids per token) when enabled."""
        return self._experts_row_bytes * max_new_tokens

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        self._check_alive()
        self._check_weights()
        rid = request.request_id
        if rid in self._live:
            raise ValueError(f"request id {rid!r} is already running")
        parts = self._split(request)
        samples = [StreamedSample() for _ in request.samples]
        if not self._adapters.admitting:  # the policy makes room for its successor: wait
            await self._wait_admitting(rid)
        adapter = self._adapters.acquire()
        live = self._live[rid] = LiveGroup(parts, samples, adapter)
        live.aborted = self._recent.take_early_abort(rid)  # aborted before it got here
        try:
            async with asyncio.timeout(self.generate_timeout_s):
                await self._run_parts(live, request.sampling)
        except TimeoutError:
            self._check_alive()
            refused = [p.refusals for p in parts if p.refusals]
            if live.refused is not None and refused:  # a pause elsewhere held it, no failure
                deadline = f"generate_timeout_s={self.generate_timeout_s}"
                reason = refusals.paused_too_long(
                    rid, f"vLLM engine {self.model}", live.refused, sum(refused), deadline
                )
                raise refusals.EnginePausedError(reason) from None
            raise TimeoutError(
                f"vLLM did not finish {rid} within generate_timeout_s={self.generate_timeout_s}"
                " (its requests were aborted)"
            ) from None
        finally:
            del self._live[rid]
            self._recent.ended(rid)
            retired_unused = adapter is not None and self._adapters.release(adapter)
            if adapter is not None:
                self._progress.notify()  # an update may wait for an adapter's requests to end
        if adapter is None:
            return [streams.sample_output(s, rid, None) for s in samples]
        if retired_unused:
            async with self._control:  # not while an update registers adapters
                await self._adapters.unload_unused()
        return [streams.sample_output(s, rid, adapter.version) for s in samples]

    async def abort(self, request_id: str) -> None:
        """Abort every vLLM request of the group. Its `generate` then returns the partial
        samples with finish reason "abort". A vLLM request still being added is aborted when
        its first token arrives; an id not seen yet is remembered, so its `generate` returns
        at once; an ended one is left alone (see `Engine`)."""
        if self._closed:
            return
        live = vllm_groups.claim_abort(self._live, self._recent, request_id)
        if live is not None:
            self._progress.notify()  # ends a part's wait to be sent again (`_stream`)
            await self._call(self._llm.abort([p.vllm_id for p in live.parts]))

    async def pause_generation(self) -> None:
        """Freeze running requests inside vLLM (they keep their KV cache until a weight update
        preempts them)."""
        async with self._control:
            self._check_alive()
            await self._call(self._llm.pause_generation(mode="keep", clear_cache=False))
            self._paused = True

    async def resume_generation(self) -> None:
        async with self._control:
            self._check_alive()
            await self._call(self._llm.resume_generation())
            self._paused = False

    async def update_weights(self, weights: Weights | LoraAdapter | None, *, version: int) -> None:
        """Pause (unless paused already), load `weights`, drop every cached KV block (running
        requests are recomputed under the new weights), label later tokens `version`, resume.
        Returns once new tokens come from the new weights. With no weights and the current
        version there is nothing to change: it returns at once (keeping the prefix cache).

        A `LoraAdapter` (or None while an adapter is the policy) registers the adapter for the
        requests started after this returns, without pausing (see the class docstring); a bad
        one raises `LoraError` and changes nothing."""
        self._check_alive()
        if weights is None and version == self._version:
            return
        policy = self._adapters.policy
        if isinstance(weights, LoraAdapter) or (weights is None and policy is not None):
            await self._update_adapter(weights if weights is not None else policy, version)
            return
        named = None if weights is None else self._loader.fitting(weights)
        # The update has begun: before any await, the adapter policy retires and requests
        # wait (`_retiring`): vLLM's reload drops every adapter in the workers, and a request
        # bound to one would make a worker load it from its (unreadable) path and kill the
        # engine core. By construction no request acquires it from here on.
        had_policy = self._retiring()
        try:
            async with self._control:
                had_policy |= self._retiring()  # one an adapter update registered meanwhile
                self._check_alive()
                pause_here = not self._paused
                if pause_here:
                    await self._call(self._llm.pause_generation(mode="keep", clear_cache=False))
                # From here requests start on the base weights, paused until the new serve.
                self._admit()
                try:
                    await self._adapters.unload_unused()
                    await self._end_adapter_requests()
                    if named is not None:
                        await self._load_checked(named)
                    self._check_weights()
                    if not await self._call(
                        self._llm.reset_prefix_cache(reset_running_requests=True)
                    ):
                        raise RuntimeError("vLLM could not reset its prefix cache after the update")
                    await self._label(version)
                finally:
                    if pause_here and not self._dead():
                        await self._call(self._llm.resume_generation())
        except BaseException:
            if had_policy:
                # The adapter the current label names no longer serves: refuse to generate
                # (its label on the base weights) until an update succeeds.
                self._loader.lost_adapter()
            raise
        finally:
            self._admit()

    def _retiring(self) -> bool:
        """Retire the adapter policy, if any, and then hold new requests until the update's
        pause holds them (they would start on the base weights under the adapter's label);
        True if there was one. Synchronous: nothing can start in between."""
        had = self._adapters.retire_policy()
        if had:
            self._adapters.hold_admission()
        return had

    def _admit(self) -> None:
        self._adapters.admit()
        self._progress.notify()  # requests waiting for admission go on

    async def _label(self, version: int) -> None:
        """Have vLLM label later tokens `version`, then report it as `version`, as one step
        (`Engine.version`): once sent, vLLM applies a label whether its answer is awaited or
        not, so a caller cancelled meanwhile waits for the answer (within the call's own
        `control_timeout_s`) before the cancellation goes on. Otherwise `version` would keep
        the old label while vLLM stamps every new token with the new one."""
        call, cancelled = await finish(self._call(self._llm.update_weight_version(str(version))))
        if not call.cancelled() and call.exception() is None:
            self._version = version
        if cancelled is not None:
            raise cancelled
        call.result()  # vLLM's error, if it failed: the old label stays

    async def close(self) -> None:
        """End what runs, shut vLLM's processes down. Running and later calls raise
        `EngineDeadError`. Running requests are ended by cancelling their streams, which makes
        vLLM abort them, while vLLM still runs: an abort alone misses a request still being
        added, whose stream would then wait out `generate_timeout_s` on a shut-down engine."""
        if self._closed:
            return
        self._closed = True
        await vllm_groups.end_streams(self._live.values(), self.control_timeout_s)
        # Let go of vLLM now: AsyncLLM.__del__ at interpreter exit would shut it down again.
        llm, self._llm = self._llm, None
        # Stop reading its outputs first, or vLLM logs the shutdown as an engine failure.
        handler = llm.output_handler
        if handler is not None:
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler
        await asyncio.to_thread(llm.shutdown, min(self.control_timeout_s, SHUTDOWN_GRACE_S))
        self._tie.release()  # not before: a close that failed leaves them to the reaper

    async def __aenter__(self) -> VLLMEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- progress --------------------------------------------------------------------------------

    @property
    def running_requests(self) -> int:
        """vLLM requests not finished yet (as seen by its front end)."""
        return 0 if self._closed else int(self._llm.get_num_unfinished_requests())

    @property
    def pause_refusals(self) -> int:
        """Requests vLLM refused since the engine started because someone else paused it in
        mode "abort" or "wait" (each was sent again: `asyncroll.engines.vllm.refusals`)."""
        return self._pause_refusals

    @property
    def generated_tokens(self) -> int:
        """Tokens received from vLLM since the engine started (all requests)."""
        return self._generated

    def samples_started(self, request_id: str) -> int:
        """How many samples of the running request `request_id` have received a token."""
        live = self._live.get(request_id)
        return 0 if live is None else sum(1 for s in live.samples if s.tokens)

    async def wait_generated(self, tokens: int, timeout: float) -> None:
        """Return once `generated_tokens >= tokens`; `TimeoutError` after `timeout` s."""
        await self.wait_progress(lambda: self._generated >= tokens, timeout)

    async def wait_progress(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Return once `predicate()` holds, checked whenever tokens arrive (e.g. on
        `samples_started`); `TimeoutError` after `timeout` s."""
        await self._progress.wait_until(lambda: predicate() or self._dead(), timeout)
        self._check_alive()

    # -- generation ------------------------------------------------------------------------------

    def _split(self, request: GenerateRequest) -> list[GroupPart]:
        """The vLLM requests of a group: fresh samples together only with `parallel_sampling`
        (see `vllm_groups.split_group`)."""
        together = self.parallel_sampling and request.sampling.temperature > 0
        return vllm_groups.split_group(request, self._vocab_size, together=together, part=GroupPart)

    async def _run_parts(self, live: LiveGroup, sampling: SamplingConfig) -> None:
        """Stream every part; on the first error abort the others and raise it."""
        live.tasks = [
            asyncio.ensure_future(self._stream(live, part, sampling)) for part in live.parts
        ]
        error = await vllm_groups.first_error(live.tasks)
        if error is not None:
            raise self._translate(error)

    async def _stream(self, live: LiveGroup, part: GroupPart, sampling: SamplingConfig) -> None:
        """Stream one vLLM request of the group (`_generate`). One that vLLM refuses because
        someone else paused it (`RetryableRequestError`, vLLM >= 0.33: a pause in mode "abort"
        or "wait"; `asyncroll.engines.vllm.refusals`) ran nothing: it is sent again after a
        backoff, ended by its abort, within `generate_timeout_s`."""
        while True:
            try:
                await self._generate(live, part, sampling)
                return
            except Exception as exc:
                if not _refused_as_paused(exc) or any(live.samples[i].tokens for i in part.indices):
                    raise
                part.refusals += 1
                self._pause_refusals += 1
                live.refused = str(exc)
                self._progress.notify()
            with contextlib.suppress(TimeoutError):
                await self._progress.wait_until(
                    lambda: live.aborted or self._dead(), refusals.retry_delay_s(part.refusals)
                )

    async def _generate(self, live: LiveGroup, part: GroupPart, sampling: SamplingConfig) -> None:
        from vllm.inputs import TokensPrompt

        if live.aborted:
            for i in part.indices:
                live.samples[i].finish = "abort"
            return
        params = streams.sampling_params(
            sampling,
            part,
            stream_interval=self.stream_interval,
            experts=bool(self._experts_row_bytes),
        )
        lora = None if live.adapter is None else live.adapter.request
        stream: AsyncIterator[Any] = self._llm.generate(
            TokensPrompt(prompt_token_ids=part.prompt), params, part.vllm_id, lora_request=lora
        )
        first = True
        async for out in stream:
            part.refusals = 0  # taken: a later refusal starts the backoff anew
            for completion in out.outputs:
                sample = live.samples[part.indices[completion.index]]
                streams.append(sample, completion)
                self._generated += len(completion.token_ids)
            self._progress.notify()
            if first and streams.aborted(live):  # abort() may have run before vLLM knew it
                await self._call(self._llm.abort(part.vllm_id))  # (a no-op if it did know)
            first = False

    # -- weights ---------------------------------------------------------------------------------

    def _check_weights(self) -> None:
        self._loader.check_served()

    async def _load_checked(self, named: list[tuple[str, Any]]) -> None:
        """Load `named` (`WeightLoader.load`); when it fails its check, or is cut off or fails
        once the workers have it, end what runs (its tokens so far were sampled by the previous
        weights and are labelled so) and refuse to generate until a later update succeeds: the
        label on the old weights must not go on to weights that may be partly new."""
        try:
            await self._loader.load(named)
        except BaseException:
            if self._loader.state is not WeightsState.SERVED:
                await self._end_live()
            raise

    async def _end_live(self) -> None:
        """Abort every running request in one vLLM call: vLLM sends it before its first await,
        so it gets there even while the caller is being cancelled (an anyio scope cancels
        again at every await)."""
        groups = [vllm_groups.claim_abort(self._live, self._recent, r) for r in list(self._live)]
        vllm_ids = [part.vllm_id for group in groups if group is not None for part in group.parts]
        if vllm_ids:
            await self._call(self._llm.abort(vllm_ids))

    # -- LoRA adapters ---------------------------------------------------------------------------

    async def _update_adapter(self, adapter: LoraAdapter | None, version: int) -> None:
        """Make `adapter` the policy of requests started from now on, labelled `version`.
        Checks first what needs no worker (LoRA on, the rank), then the model's modules in
        the worker, before anything changes.

        With a slot free that takes one call into vLLM, the registration, which checks the
        adapter itself: vLLM runs such calls between engine steps, so each waits for the
        step under way, and while requests generate that is often a LoRA prefill step
        (0.4-2 s on CPU on the 98M model, against the call's 2-6 ms in the worker;
        benchmarks/README.md, lora_throughput.py). Only an update that must end an old
        adapter's requests to make room asks the workers first, so that a bad adapter
        aborts nothing."""
        adapter = check_servable(self.lora, adapter, f"vLLM engine {self.model}")
        slots = self.lora.slots if self.lora is not None else 0  # check_servable: not None
        async with self._control:
            self._check_alive()
            self._check_weights()
            await self._adapters.unload_unused()
            if self._adapters.oldest_if_full(slots) is not None:
                await self._adapters.check(adapter, self._version)
            try:
                while (oldest := self._adapters.oldest_if_full(slots)) is not None:
                    if oldest.state is AdapterState.POLICY:
                        # The one slot holds the policy: requests that start now would bind
                        # to it and it would never end. They wait for its successor.
                        self._adapters.hold_admission()
                    await self._end_requests_under(oldest)
                    await self._adapters.unload(oldest)
                await self._adapters.register(adapter, version, self._version)
                self._version = version
            finally:
                self._adapters.admit()
                self._progress.notify()  # requests waiting for admission go on
            await self._adapters.unload_unused()  # the previous policy, unless still in use

    async def _end_requests_under(self, adapter: Adapter) -> None:
        """To make room: abort the requests that run under `adapter` (they end with their
        tokens so far, which can be continued under the new policy) and wait for them to
        end."""
        for request_id, live in list(self._live.items()):
            if live.adapter is adapter:
                await self.abort(request_id)
        try:
            await self.wait_progress(lambda: adapter.unused, self.control_timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"vLLM engine {self.model}: {adapter.users} aborted request(s) under adapter "
                f"version {adapter.version} did not end within control_timeout_s="
                f"{self.control_timeout_s}; the adapter update was not made"
            ) from None

    async def _wait_admitting(self, request_id: str) -> None:
        """Wait while an adapter update ends the policy's requests to make room for its
        successor (`LoraSlots(slots=1)`): this request then starts under the successor; or
        while a full-weight update retiring the policy pauses vLLM: it then starts on the
        base weights, paused until the new ones serve."""
        try:
            await self.wait_progress(lambda: self._adapters.admitting, self.control_timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"vLLM engine {self.model}: {request_id} waited control_timeout_s="
                f"{self.control_timeout_s} for a weight update to let it start"
            ) from None

    async def _end_adapter_requests(self) -> None:
        """Before a full-weight update: abort the requests that run under an adapter (the
        base weights must not change under them)."""
        for request_id, live in list(self._live.items()):
            if live.adapter is not None:
                await self.abort(request_id)

    # -- errors and deadlines --------------------------------------------------------------------

    async def _call(self, awaitable: Any) -> Any:
        """Await a vLLM control call within `control_timeout_s`; a dead engine raises
        `EngineDeadError` instead of whatever vLLM raised (or a timeout)."""
        try:
            async with asyncio.timeout(self.control_timeout_s):
                return await awaitable
        except Exception as exc:
            raise self._translate(exc) from None

    def _dead(self) -> bool:
        return self._closed or bool(self._llm.errored)  # `_llm` is None only once closed

    def _check_alive(self) -> None:
        if self._dead():
            raise EngineDeadError("vLLM engine is closed" if self._closed else "vLLM engine died")

    def _translate(self, exc: BaseException) -> BaseException:
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMDeadError

        if isinstance(exc, EngineDeadError):
            return exc
        if isinstance(exc, VLLMDeadError) or self._dead():
            return EngineDeadError(f"vLLM engine died: {type(exc).__name__}: {exc}")
        return exc


def _refused_as_paused(exc: BaseException) -> bool:
    """Whether `exc` is vLLM's refusal of a new request while paused: `RetryableRequestError`
    (vllm/exceptions.py, in every supported release; raised for a pause from 0.33, by
    `AsyncLLM.generate` once the engine core refused the request on arrival). 0.32 raised it
    only for a multimodal cache miss, which asyncroll never has, and which is retried alike."""
    from vllm.exceptions import RetryableRequestError

    return isinstance(exc, RetryableRequestError)
