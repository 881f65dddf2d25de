"""`AdapterSet`: the LoRA adapters vLLM holds for one in-process `VLLMEngine`.

One job: which adapters are registered in vLLM's workers, which of them is the policy (what
requests started from now on run under), registering a new one from memory, and unloading the
ones nothing uses. The engine owns one and drives it; it never reads the engine's requests.
Requests tell it what they use through `acquire`/`release`, and where room needs requests to
end (`oldest_if_full`), the engine ends them and then calls `unload`: data flows from the
engine into this set and from it into vLLM, never back.

Why adapters outlive the policy: vLLM binds an adapter to a request for the request's whole
life, so an adapter replaced as the policy stays registered (`AdapterState.RETIRED`) until
the last request started under it ends.
"""

from __future__ import annotations

import enum
import logging
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from asyncroll._core.tasks import finish, thread_to_end
from asyncroll.engines.vllm import weights_file
from asyncroll.lora import LoraAdapter, LoraError, adapter_name, peft_config, peft_tensors

Call = Callable[[Awaitable[Any]], Awaitable[Any]]

log = logging.getLogger("asyncroll.engines.vllm.engine")


class AdapterState(enum.Enum):
    """Where a registered adapter stands."""

    POLICY = "policy"  # requests started from now on run under it
    RETIRED = "retired"  # replaced as the policy; unloaded once `users` reaches 0
    UNLOADED = "unloaded"  # removed from vLLM: no request may start under it


class AdapterAdmission(enum.Enum):
    """Whether requests may start under the policy now."""

    OPEN = "open"
    HELD = "held"  # the policy is being unloaded for its successor: requests wait


class Adapter:
    """A LoRA adapter registered in vLLM: the policy of `version`, bound to every request
    started while it was the engine's policy (`users` of them still run)."""

    __slots__ = ("lora_id", "request", "state", "users", "version")

    def __init__(self, lora_id: int, version: int, request: Any) -> None:
        self.lora_id = lora_id  # vLLM's lora_int_id, also the registration's serial
        self.version = version
        self.request = request  # the vLLM LoRARequest every request of this policy carries
        self.state = AdapterState.POLICY
        self.users = 0

    @property
    def unused(self) -> bool:
        return self.users == 0


class AdapterSet:
    """The adapters registered in vLLM for one engine (see the module docstring).

    `call` awaits a vLLM call within the engine's deadline (translating a dead engine's
    errors); `llm` is vLLM's `AsyncLLM`; `where` names the engine in error messages; `folder`
    holds the file an adapter crosses to the workers in (/dev/shm: memory, not disk). The
    caller serialises the updating methods (`check`, `register`, `unload*`), as `VLLMEngine`
    does under its control lock; `acquire`/`release` need no lock.
    """

    def __init__(self, llm: Any, call: Call, where: str, folder: Path) -> None:
        self._llm = llm
        self._call = call
        self._where = where
        self._folder = folder
        self._registered: dict[int, Adapter] = {}  # by lora_int_id, oldest first
        self._policy: Adapter | None = None
        self._policy_tensors: LoraAdapter | None = None  # the policy's adapter, to relabel it
        self._serial = 0  # the last lora_int_id given
        self._admission = AdapterAdmission.OPEN

    @property
    def admitting(self) -> bool:
        """Whether a request may start now (`acquire`); not while an update ends the policy's
        requests to make room for its successor (`hold_admission`)."""
        return self._admission is AdapterAdmission.OPEN

    def hold_admission(self) -> None:
        """No request may start until `admit`: the policy's requests are being ended to
        unload it (its one slot is needed), and a request bound to it would keep it in use."""
        self._admission = AdapterAdmission.HELD

    def admit(self) -> None:
        """Requests may start again (under the policy then registered, if any)."""
        self._admission = AdapterAdmission.OPEN

    @property
    def policy(self) -> LoraAdapter | None:
        """The policy's tensors (None: requests run on the base weights)."""
        return self._policy_tensors

    def acquire(self) -> Adapter | None:
        """The adapter a request starting now runs under (None: the base weights), counted
        as used until `release`."""
        adapter = self._policy
        if adapter is not None:
            adapter.users += 1
        return adapter

    def release(self, adapter: Adapter) -> bool:
        """A request under `adapter` ended. True when that left a retired adapter unused,
        which the caller then unloads (`unload_unused`, under its lock)."""
        adapter.users -= 1
        return adapter.unused and adapter.state is AdapterState.RETIRED

    async def check(self, adapter: LoraAdapter, version: int) -> None:
        """Ask the workers whether they can serve `adapter` (the model's modules and their
        shapes, vLLM's limits), before anything changes: `LoraError` if not. `version` is
        the one the engine serves, named in the error."""
        modules = {m: _features(adapter, m) for m in adapter.modules}
        args = (modules, peft_config(adapter.config))
        problems = await self._call(self._llm.collective_rpc("asyncroll_lora_problem", args=args))
        self._refuse(problems, version)

    def oldest_if_full(self, slots: int) -> Adapter | None:
        """The adapter to unload to make room for one more, with all `slots` taken (its
        requests must end first: the caller aborts them, waits for `unused`, then `unload`s
        it); None when there is room."""
        if len(self._registered) < slots:
            return None
        return self._registered[min(self._registered)]

    async def register(self, adapter: LoraAdapter, version: int, current: int) -> None:
        """Register `adapter` in the workers under a new id and name, and make it the policy
        of `version`; the previous policy retires. `LoraError` (naming `current`, the version
        still served) if a worker refuses it: nothing changes then.

        The tensors cross in a safetensors file in `folder`, which each worker reads
        (`asyncroll_add_lora`; the file is gone once they answer), as full weights do. Passed
        as bytes through vLLM's RPC, which copies them at each hop, a rank-64 adapter of a
        98M model (36.5 MiB) took 266 ms with 218 MiB of extra RSS; this way 62 ms and 23 MiB
        (benchmarks/lora_update.py)."""
        self._serial += 1
        serial = self._serial
        path = self._folder / f"asyncroll-lora-{uuid.uuid4().hex}.safetensors"
        args = (serial, str(path), peft_config(adapter.config))
        try:
            named = list(peft_tensors(adapter).items())
            await thread_to_end(weights_file.write_safetensors, named, path)  # see its doc
            add = self._call(self._llm.collective_rpc("asyncroll_add_lora", args=args))
            call, cancelled = await finish(add)  # once asked, the workers add it regardless
        finally:
            path.unlink(missing_ok=True)
        if cancelled is not None:  # cut by its caller: nothing changes, in the workers too
            if not call.cancelled() and call.exception() is None and not _problems(call.result()):
                removed, _ = await finish(self._call(self._llm.remove_lora(serial)))
                if not removed.cancelled() and removed.exception() is not None:
                    log.warning(
                        "%s: adapter %d, added after its update was cut off, could not be "
                        "removed (%r): it takes one of the workers' adapter slots",
                        self._where, serial, removed.exception(),
                    )  # fmt: skip
            raise cancelled
        self._refuse(call.result(), current)
        from vllm.lora.request import LoRARequest

        name = adapter_name(version, serial)
        # The path is never read (the workers have the adapter by its id) but must be set,
        # and vLLM keys the prefix cache by it too: a fresh one per registration.
        request = LoRARequest(name, serial, f"asyncroll-memory://{name}")
        if self._policy is not None:
            self._policy.state = AdapterState.RETIRED
        self._policy = self._registered[serial] = Adapter(serial, version, request)
        self._policy_tensors = adapter

    async def unload_unused(self) -> None:
        """Unload every retired adapter that no running request uses."""
        for adapter in list(self._registered.values()):
            if adapter.state is AdapterState.RETIRED and adapter.unused:
                await self.unload(adapter)

    def retire_policy(self) -> bool:
        """Serve the base weights from now on (a full-weight update begins): the policy
        retires at once, so no request acquires it from here. True if there was one."""
        had = self._policy is not None
        if self._policy is not None:
            self._policy.state = AdapterState.RETIRED
        self._policy = self._policy_tensors = None
        return had

    async def unload(self, adapter: Adapter) -> None:
        """Remove `adapter` from vLLM (the policy too: then requests run on the base weights
        until the next `register`)."""
        del self._registered[adapter.lora_id]
        adapter.state = AdapterState.UNLOADED
        if adapter is self._policy:
            self._policy = self._policy_tensors = None
        await self._call(self._llm.remove_lora(adapter.lora_id))

    def _refuse(self, problems: Any, version: int) -> None:
        """Raise `LoraError` with the first worker's problem, if any (nothing was loaded)."""
        found = _problems(problems)
        if found:
            raise LoraError(
                f"{self._where}: {found[0]}. Nothing was loaded; the engine still serves "
                f"version {version}"
            )


def _features(adapter: LoraAdapter, module: str) -> list[int]:
    """[out_features, in_features] of an adapted module."""
    a, b = adapter.tensors[f"{module}.lora_A.weight"], adapter.tensors[f"{module}.lora_B.weight"]
    return [int(b.shape[0]), int(a.shape[1])]


def _problems(answers: Any) -> list[str]:
    """The workers' objections to an adapter (each answers "" when it has none)."""
    return [p for p in answers or () if p]
