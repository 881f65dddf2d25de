"""LoRA adapters as the policy of `VLLMServerEngine`'s replicas, through vLLM's runtime
adapter routes (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`; the servers are
started with `--enable-lora --max-loras N --max-lora-rank R` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`: `vllm_serve.serve_args(..., lora=LoraSlots(...))`
and `ServerProcess.start` do both; the engine takes the same `lora=` as `VLLMEngine`).

How a version maps to an adapter. `update_weights(adapter, version=k)` writes the adapter once
(PEFT's layout, `asyncroll.lora.write_peft`) into a fresh folder under `weights_dir`, and every
replica loads it under that folder's name ("asyncroll-lora-v<k>-<hex>", random per update:
several engines may share a server, and an update retried under the same version must not
meet a namesake that a failed one left loaded; vLLM gives each name a fresh adapter id, and
keys its prefix cache by it). The base weights stay. Every generate request sent
after the update returned carries `"model": <that name>`. vLLM binds an adapter to a request
for its whole life, so a request sent under version k samples with k's adapter to its end:
each of its tokens is labelled k (what the server labels it is still checked, as for every
request, but not used), also when it is kept in place across a later update. No request
straddles two adapters. A request sent on the base weights before the first adapter, kept in
place across adapter updates, goes on sampling with the base weights while the servers label
its tokens with the adapters' versions: those labels are mapped back to the base weights'
version (`base_of`, kept only while such a request runs). New full weights end the
requests sent with an adapter (aborted, their samples so far returned): over other base
weights an adapter samples with a policy no version names.

When an adapter goes. vLLM's unload route only forgets the name in the API server; the
workers keep adapters in an LRU cache (`max_loras` slots) and load an evicted one again from
its path when a request of it is scheduled. So an adapter's folder stays while it is the
policy, while any request sent with it runs, and while a re-sync loads it; once none of these
holds it is unloaded from every replica that loaded it and its folder deleted (in a task the
engine owns and awaits at `close`).

Whose fault a failed load is. vLLM's loader checks the rank and the modules' leaf names, but not
that a module exists (`model.layers.9...` of a 2-layer model: silently ignored, another policy
served) nor its shape (vLLM copies an adapter into its LoRA slots as it loads it, where a
mismatch is a tensor error naming no adapter). So before the load, each replica's workers check
it against the model (`asyncroll_lora_problem` of asyncroll's worker extension, over
`/collective_rpc`: the same check as `VLLMEngine`'s). A refusal of the adapter itself (a rank
above the servers' `--max-lora-rank`, a module the model lacks, a shape it does not have, a
server started without LoRA) is the caller's: `LoraError` naming what to change, the adapter
unloaded wherever it loaded, the version unchanged, every replica still serving. Anything else
(no answer, a 500 of another kind) is that replica's failure like a failed full-weight load: it
leaves the rotation, named. A replica that answers a generate with "no such model" for the
adapter lost it (it restarted behind the engine's back): it leaves the rotation until re-synced,
and a re-sync loads the current adapter after the base weights and label, checked as at its
first load: a replica restarted with other arguments (another model, a smaller
`--max-lora-rank`, no `--enable-lora`) would otherwise serve the adapter's label with another
policy. There the adapter is already the policy, so a refusal is that replica's failure
(`ReplicaError` naming it and the adapter: out of the rotation, probed again with backoff),
never the caller's `LoraError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncroll._core.tasks import thread_to_end
from asyncroll.engines.server.client import ReplicaClient
from asyncroll.engines.server.replica_load import missing_extension
from asyncroll.engines.server.replicas import Replica, ReplicaError, ReplicaHTTPError
from asyncroll.lora import (
    LoraAdapter,
    LoraError,
    LoraSlots,
    check_servable,
    peft_config,
    write_peft,
)

log = logging.getLogger(__name__)

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"
_NAME_PREFIX = "asyncroll-lora-v"

# vLLM 0.32's messages for an adapter it refuses (worker-side checks, answered as HTTP 500):
# what the caller must change, not a failure of the replica.
_REFUSALS = (
    "greater than max_lora_rank",  # PEFTHelper.validate_legal
    "expected target modules",  # LoRAModel.from_local_checkpoint: a module the model lacks
    "LoRA is not enabled",  # a server started without --enable-lora
    "is not supported",  # PEFTHelper's feature checks (DoRA, bias, ...)
)
_ALREADY_LOADED = "has already been loaded"
_PROBLEM = "asyncroll_lora_problem"  # the worker extension's check of an adapter
_NO_LORA = (
    "start every replica with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
    " (ServerProcess.start(..., lora=LoraSlots(...)) does both)"
)


class ServedAdapterState(enum.Enum):
    LOADING = "loading"  # being loaded by an update that has not committed
    SERVING = "serving"  # the policy: requests sent now carry it
    RETIRED = "retired"  # superseded (or its update failed): goes once nothing holds it


@dataclass(eq=False)
class ServedAdapter:
    """One adapter the engine wrote: its vLLM name, version, folder, and what holds it."""

    name: str
    version: int
    folder: Path
    check: dict[str, Any]  # what the workers check it with (`_PROBLEM`'s arguments)
    state: ServedAdapterState = ServedAdapterState.LOADING
    holds: int = 0  # requests sent with it that have not ended, re-syncs loading it
    loaded_on: set[Replica] = field(default_factory=set)


class ServerAdapters:
    """The adapters of one `VLLMServerEngine` (see the module docstring): `slots` None means
    the engine was built without LoRA. `on_failed(replica, error)` is the engine's reaction to
    a failed call to a replica outside an update (an unload)."""

    def __init__(
        self,
        slots: LoraSlots | None,
        client: ReplicaClient,
        on_failed: Callable[[Replica, ReplicaError], object],
    ) -> None:
        if slots is not None and not isinstance(slots, LoraSlots):
            raise ValueError(f"lora={slots!r}: give a LoraSlots (or None: no LoRA)")
        self.slots = slots
        self.current: ServedAdapter | None = None
        self._client = client
        self._on_failed = on_failed
        self._cleanups: set[asyncio.Task[None]] = set()
        self._written: list[ServedAdapter] = []  # every folder not deleted yet
        self._closed = False
        self.base_of: dict[int, int] = {}  # an adapter's label -> the base weights' version
        self._base: int | None = None  # the base weights' version while an adapter serves
        self._base_requests = 0  # requests sent on the base weights, running now

    def check(self, adapter: LoraAdapter) -> None:
        """What the engine can refuse before anything is written or sent (`LoraError`): no
        LoRA, a rank above `slots.max_rank` (the replicas' `--max-lora-rank` is checked by
        vLLM when they load it)."""
        check_servable(self.slots, adapter, "VLLMServerEngine")

    async def write(self, adapter: LoraAdapter, weights_dir: Path, version: int) -> ServedAdapter:
        """Write `adapter` once, in PEFT's layout, into a fresh folder under `weights_dir`."""
        name = f"{_NAME_PREFIX}{version}-{uuid.uuid4().hex[:8]}"
        modules = {}
        for module in adapter.modules:
            a, b = (adapter.tensors[f"{module}.lora_{x}.weight"] for x in "AB")
            modules[module] = [int(b.shape[0]), int(a.shape[1])]  # out, in features
        check = {"modules": modules, "config": peft_config(adapter.config)}
        record = ServedAdapter(name, version, weights_dir / name, check)
        self._written.append(record)
        try:
            await thread_to_end(write_peft, adapter, record.folder)  # then removed if cut
        except BaseException:
            self._written.remove(record)
            shutil.rmtree(record.folder, ignore_errors=True)
            raise
        return record

    async def load(self, replica: Replica, record: ServedAdapter) -> None:
        """Have `replica`'s workers check `record` against the model, then load it there,
        each call within `control_timeout_s`: `LoraError` when the adapter is refused,
        `ReplicaError` for any other failure. Loading it again (a retried call whose first
        try reached the server, or a re-sync) is harmless."""
        await self._check_on(replica, record)
        body = {"lora_name": record.name, "lora_path": str(record.folder)}
        try:
            await self._client.call(replica, "POST", LOAD, body, text=True)
        except ReplicaHTTPError as exc:
            if exc.status == 400 and _ALREADY_LOADED in exc.text:
                pass  # its name is unique to this update: the same adapter is there
            elif exc.status == 404 and "Not Found" in exc.text:  # FastAPI: no such route
                raise LoraError(f"{exc}: the replica has no {LOAD} route; {_NO_LORA}") from None
            elif any(refusal in exc.text for refusal in _REFUSALS):
                raise LoraError(f"vLLM refused the adapter: {exc}") from None
            else:
                raise
        record.loaded_on.add(replica)

    async def _check_on(self, replica: Replica, record: ServedAdapter) -> None:
        """Before vLLM's loader sees it (see the module docstring)."""
        body = {"method": _PROBLEM, "kwargs": record.check}
        try:
            reply = await self._client.call(replica, "POST", "/collective_rpc", body)
        except ReplicaHTTPError as exc:
            if "lora_manager" in exc.text:  # the workers' AttributeError: no --enable-lora
                raise LoraError(f"{exc}: {_NO_LORA}") from None
            if _PROBLEM in exc.text:  # vLLM's AttributeError: the worker has no such method
                raise missing_extension(exc) from None
            raise
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list) or not all(isinstance(r, str) for r in results):
            raise ReplicaError(replica.url, f"POST /collective_rpc {_PROBLEM} -> {reply!r:.300}")
        problems = [r for r in results if r]
        if problems:
            raise LoraError(f"replica {replica.url} refused the adapter: {problems[0]}")

    def commit(self, record: ServedAdapter | None, previous_version: int) -> None:
        """`record` is the policy from now on (None: new full weights), replacing the policy
        labelled `previous_version`; the adapter before retires."""
        previous, self.current = self.current, record
        if record is None:
            self._base = None
        else:
            record.state = ServedAdapterState.SERVING
            if previous is None:
                self._base = previous_version
            self.relabelled(record.version)
        if previous is not None and previous is not record:
            self.retire(previous)

    def relabelled(self, version: int) -> None:
        """The servers label tokens `version` from now on: while an adapter serves, requests
        still running on the base weights must read it as the base weights' version."""
        if self._base is not None and self._base_requests:
            self.base_of[version] = self._base

    def retire(self, record: ServedAdapter) -> None:
        """`record` serves no new request (superseded, or its update failed): it is unloaded
        and its folder deleted once nothing holds it."""
        record.state = ServedAdapterState.RETIRED
        self._collect(record)

    @contextlib.contextmanager
    def holding(self, record: ServedAdapter) -> Iterator[ServedAdapter]:
        """Keep `record`'s folder and names while a request of it runs or a re-sync loads it."""
        record.holds += 1
        try:
            yield record
        finally:
            self.release(record)

    def bind(self) -> ServedAdapter | None:
        """The adapter a request sent now carries (None: the base weights), held until
        `release`d."""
        record = self.current
        if record is None:
            self._base_requests += 1
        else:
            record.holds += 1
        return record

    def release(self, record: ServedAdapter | None) -> None:
        if record is None:
            self._base_requests -= 1
            if not self._base_requests:
                self.base_of.clear()
            return
        record.holds -= 1
        self._collect(record)

    async def catch_up(self, replica: Replica) -> None:
        """A re-synced replica (after its base weights and label) loads the current adapter:
        one that restarted has none of this engine's adapters. Checked as at its first load:
        a replica may have restarted with other arguments (another model, a smaller
        `--max-lora-rank`, no `--enable-lora`), and unchecked it would serve the adapter's
        label with another policy. The adapter is already the policy here, so a refusal is
        this replica's failure (`ReplicaError`: it stays out of the rotation), not the
        caller's `LoraError`."""
        record = self.current
        if record is None:
            return
        with self.holding(record):
            try:
                await self.load(replica, record)
            except ValueError as exc:  # LoraError, or a replica without asyncroll's extension
                error = ReplicaError(
                    replica.url,
                    f"cannot serve the engine's adapter {record.name} (version"
                    f" {record.version}) that the other replicas serve: {exc}; restart it with"
                    " their model and LoRA arguments",
                )
                log.warning("%s", error)
                raise error from None

    def _collect(self, record: ServedAdapter) -> None:
        if self._closed or record not in self._written:
            return
        if record.state is ServedAdapterState.RETIRED and record.holds == 0:
            self._written.remove(record)
            task = asyncio.ensure_future(self._remove(record))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)

    async def _remove(self, record: ServedAdapter) -> None:
        """Unload `record` from every replica that loaded it, then delete its folder. A
        replica that cannot be reached is that replica's failure (its supervisor checks it);
        one that no longer knows the name (it restarted) has nothing to unload."""
        replicas, record.loaded_on = list(record.loaded_on), set()
        try:
            await asyncio.gather(*(self._unload(r, record.name) for r in replicas))
        finally:
            await asyncio.to_thread(shutil.rmtree, record.folder, True)

    async def _unload(self, replica: Replica, name: str) -> None:
        try:
            await self._client.call(replica, "POST", UNLOAD, {"lora_name": name}, text=True)
        except ReplicaHTTPError as exc:
            if exc.status != 404:
                self._on_failed(replica, exc)
        except ReplicaError as exc:
            self._on_failed(replica, exc)

    async def settled(self) -> None:
        """Wait for the unloads under way; an error of one (none is expected: a replica's
        failure goes to `on_failed`) is raised."""
        while self._cleanups:
            await asyncio.gather(*self._cleanups)

    async def close(self, timeout_s: float) -> None:
        """At the engine's close (its client still open): the unloads under way get
        `timeout_s`, then are cancelled; every folder left is deleted (the replicas keep what
        they loaded; nothing of this engine serves again)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.settled()
        except Exception as exc:  # the deadline, or a bug: close stays harmless
            log.warning("LoRA adapter unloads at close: %r", exc)
        self._closed = True
        for task in list(self._cleanups):
            task.cancel()
        await asyncio.gather(*self._cleanups, return_exceptions=True)
        for record in self._written:
            shutil.rmtree(record.folder, ignore_errors=True)
        self._written.clear()
