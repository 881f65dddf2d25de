"""How one `vllm serve` replica loads a checkpoint folder: through the same worker code as the
in-process engine (`asyncroll.engines.vllm.in_worker.WeightLoaderExtension`, which the server
loads with `--worker-extension-cls`), called over `/collective_rpc`.

vLLM's own `/collective_rpc reload_weights` reloads the tensors it is given and nothing else:
an output head tied to the embedding gets no tensor, and on CPU its repacked copy kept serving
the old embedding (issue #24: greedy output matched a fresh engine on 0 of 8 prompts, every
token labelled with the new version). The extension also refreshes a tied head and reports
what the reload missed; a report with a problem fails the load for this replica
(`ReplicaWeightsError`, a `ReplicaError`: the replica leaves the rotation unlabelled).

With `verify`, the reference for the replica's digests is the digests of the tensors as
sent (`server_weights.Checkpoint.digests`: the trainer's tensors for weights the engine
wrote, the folder as read when its label was put on it for `update_weights_from_path`), not
the folder read back at the load: a bit flipped on disk after the write was once served
under the new label.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from asyncroll.engines.server import weights as server_weights
from asyncroll.engines.server.launch import WORKER_EXTENSION
from asyncroll.engines.server.replicas import ReplicaError
from asyncroll.engines.vllm import weight_check

Call = Callable[[str, str, Any], Awaitable[Any]]  # (method, path, json) -> the reply's JSON
_METHOD = "asyncroll_load_path"
_PROCESS = "asyncroll_process"


class ReplicaWeightsError(ReplicaError, weight_check.WeightMismatchError):
    """A replica's reload missed tensors or layers, or (verified) does not serve what the
    folder holds; the message names the replica and the tensors."""


async def load(
    call: Call, url: str, folder: Path, verify: bool, sent: dict[str, str] | None
) -> None:
    """Load `folder` on the replica at `url` (`call` makes one control call to it) and check
    the workers' reports (see the module docstring); `sent`: the reference digests (None:
    the folder's, read now)."""
    body = {"method": _METHOD, "kwargs": {"path": str(folder), "verify": verify}}
    try:
        reply = await call("POST", "/collective_rpc", body)
    except ReplicaError as exc:
        if _METHOD in str(exc):  # vLLM's AttributeError: the worker has no such method
            raise missing_extension(exc) from None
        raise
    results = reply.get("results") if isinstance(reply, dict) else None
    if not isinstance(results, list):
        raise ReplicaError(url, f"POST /collective_rpc {_METHOD} -> {reply!r:.300}")
    if verify and sent is None:
        sent = await asyncio.to_thread(folder_digests, folder)
    try:
        weight_check.check(results, sent if verify else None, "weights")
    except weight_check.WeightMismatchError as exc:
        raise ReplicaWeightsError(url, str(exc)) from None


async def process(call: Call, url: str) -> str:
    """The identity of the processes serving the replica at `url` now (each worker's
    `WeightLoaderExtension.asyncroll_process`, new with every start of `vllm serve`): read
    before a load and after the label it ends with, it tells whether the process that took
    the label is the one that loaded (`WeightUpdates.label`)."""
    try:
        reply = await call("POST", "/collective_rpc", {"method": _PROCESS})
    except ReplicaError as exc:
        if _PROCESS in str(exc):
            raise missing_extension(exc) from None
        raise
    results = reply.get("results") if isinstance(reply, dict) else None
    if not (isinstance(results, list) and results and all(isinstance(r, str) for r in results)):
        raise ReplicaError(url, f"POST /collective_rpc {_PROCESS} -> {reply!r:.300}")
    return " ".join(results)


def missing_extension(exc: Exception) -> ValueError:
    """The error for a replica whose workers lack asyncroll's methods (vLLM answers a
    `/collective_rpc` to a method the worker has not with an AttributeError naming it): a
    setting to change, not a replica failure."""
    return ValueError(
        f"{exc}: start every replica with --worker-extension-cls {WORKER_EXTENSION}"
        " (asyncroll.engines.server.launch.serve_args does)"
    )


async def own_model(call: Call, url: str) -> Path:
    """The model folder the replica at `url` was started from (`vllm serve MODEL`), as
    `/v1/models` names it (its base model's `root`): where it reloads its own weights from.
    A repo id, or a folder this process cannot read, is a `ValueError` saying what to change:
    sent as a path, it would kill the replica's vLLM engine."""
    reply = await call("GET", "/v1/models", None)
    cards = reply.get("data") if isinstance(reply, dict) else None
    roots = [
        c.get("root")
        for c in (cards if isinstance(cards, list) else [])
        if isinstance(c, dict) and c.get("parent") is None  # not a LoRA adapter
    ]
    if not roots or not isinstance(roots[0], str):
        raise ReplicaError(url, f"GET /v1/models names no base model: {reply!r:.300}")
    try:
        return server_weights.checkpoint(roots[0])
    except ValueError:
        raise ValueError(
            f"replica {url}: an update that never committed reached it, and the model it was"
            f" started from, {roots[0]!r}, is no local model folder with *.safetensors to"
            " reload its own weights from: it stays out of the rotation (start vllm serve"
            " with a local model folder, readable here under the same path)"
        ) from None


def folder_digests(folder: Path) -> dict[str, str]:
    """Digests of every tensor in `folder`'s safetensors files, computed once per folder as
    it is now (its files' names, sizes and times key the cache)."""
    files = sorted(folder.glob("*.safetensors"))
    key = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return dict(_digests(str(folder), key))


@functools.lru_cache(maxsize=2)
def _digests(folder: str, key: tuple[tuple[str, int, int], ...]) -> tuple[tuple[str, str], ...]:
    source = weight_check.SafetensorsSource(Path(folder))
    return tuple((name, weight_check.digest(t)) for name, t in source.items())
