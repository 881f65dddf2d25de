"""How `VLLMEngine` loads a full-weight update into vLLM's workers, and whether the weights it
serves can be vouched for afterwards (`WeightsState`; `WeightLoader` is its one writer).

An update's tensors are checked against the served checkpoint before anything is sent, then go
to the workers as one safetensors file in /dev/shm or as CUDA IPC handles, and each worker's
reload report is checked (with `verify_weights`, against digests of the tensors as sent). Once
the workers have an update, a failure leaves weights nobody can name: the state says so and the
engine refuses to generate until an update succeeds. Kept apart from the engine, which owns the
pause, the label and the requests around a load.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import pickle
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from asyncroll._core.tasks import thread_to_end
from asyncroll.engines.base import Weights
from asyncroll.engines.vllm import weight_check, weights_file
from asyncroll.engines.vllm.startup import Transfer

log = logging.getLogger("asyncroll.engines.vllm.engine")  # the engine's log, as before the split

WEIGHTS_DIR = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
"""Where update files (full weights, LoRA adapters) are written for the workers to read."""


class WeightsState(enum.Enum):
    """Whether the engine serves weights it can vouch for."""

    SERVED = "served"  # the start-up checkpoint, or the last update, loaded and checked
    MISMATCHED = "mismatched"  # an update failed its check: vLLM holds weights nobody sent
    PARTIAL = "partial"  # an update was cut off (or failed) once sent: part of it may be loaded


class WeightLoader:
    """Loads full-weight updates into one engine's workers; the one writer of `state`.

    `call` is the engine's wrapper of vLLM control calls (its deadline, its dead-engine
    error); `layout` the served checkpoint's tensors (`weight_check.checkpoint_layout`)."""

    def __init__(
        self,
        llm: Any,
        call: Callable[[Awaitable[Any]], Awaitable[Any]],
        *,
        model: str,
        transfer: Transfer,
        verify_weights: bool,
        world_size: int,
        layout: Any,
    ) -> None:
        self._llm = llm
        self._call = call
        self.model = model
        self.transfer: Transfer = transfer  # both read at each update: callers may switch them
        self.verify_weights = verify_weights
        self._world_size = world_size
        self._layout = layout
        self.state = WeightsState.SERVED

    def check_served(self) -> None:
        """`WeightMismatchError` unless the engine serves weights it can vouch for."""
        if self.state is WeightsState.SERVED:
            return
        why = (
            "failed its check, so the engine holds weights the trainer did not send"
            if self.state is WeightsState.MISMATCHED
            else "was cut off or failed while the workers loaded it, so the engine may hold "
            "part of its weights"
        )
        raise weight_check.WeightMismatchError(
            f"vLLM engine {self.model}: the last weight update {why}; update the weights again"
        )

    def lost_adapter(self) -> None:
        """A full-weight update failed after it ended the adapter policy: the label names an
        adapter that no longer serves, so the weights cannot be vouched for."""
        if self.state is WeightsState.SERVED:
            self.state = WeightsState.PARTIAL

    def fitting(self, weights: Weights) -> list[tuple[str, Any]]:
        """`weights` as named tensors, refused (`WeightLayoutError`, naming each tensor)
        unless every one that the served checkpoint has fits its shape and dtype: checked
        before anything is sent, so a refused update changes nothing."""
        named = weights_file.detached(weights)
        if not named:
            raise ValueError("update_weights got no tensors (use None to only set the version)")
        weight_check.check_layout(named, self._layout, f"vLLM engine {self.model}")
        if self.transfer == "cuda_ipc" and not all(t.is_cuda for _, t in named):
            raise ValueError("transfer='cuda_ipc' needs every tensor on a CUDA device")
        return named

    async def load(self, named: list[tuple[str, Any]]) -> None:
        """Load `named` into every worker and check the reports: `state` is SERVED after, or
        MISMATCHED (a failed check) or PARTIAL (cut off or failed once the workers had it)
        when this raises; a failure before anything was sent leaves it as it was."""
        try:
            await self._load(named)
        except weight_check.WeightMismatchError:
            self.state = WeightsState.MISMATCHED
            raise
        self.state = WeightsState.SERVED

    async def _load_in_workers(
        self, method: str, source: str | bytes, named: list[tuple[str, Any]]
    ) -> None:
        """Have every worker load the update from `source` (`method` of the worker extension)
        and check what each reports. Once the call is sent the workers change weights, and go
        on when the caller stops waiting: cut off or failed from then on (other than by its
        check), the engine holds weights nobody can name (`WeightsState.PARTIAL`)."""
        try:
            args = (source, self.verify_weights)
            reports = await self._call(self._llm.collective_rpc(method, args=args))
            await self._check_reports(reports, named)
        except weight_check.WeightMismatchError:
            raise
        except BaseException:
            self.state = WeightsState.PARTIAL
            raise

    async def _load(self, named: list[tuple[str, Any]]) -> None:
        on_gpu = all(t.is_cuda for _, t in named)
        use_ipc = self.transfer == "cuda_ipc" or (
            self.transfer == "auto" and on_gpu and self._world_size == 1
        )
        if use_ipc:
            await self._load_cuda_ipc(named)
        else:
            await self._load_file(named)

    async def _load_file(self, named: list[tuple[str, Any]]) -> None:
        path = WEIGHTS_DIR / f"asyncroll-weights-{uuid.uuid4().hex}.safetensors"
        try:
            await thread_to_end(weights_file.write_safetensors, named, path)  # see its doc
            await self._load_in_workers("asyncroll_load_path", str(path), named)
        finally:
            path.unlink(missing_ok=True)

    async def _check_reports(self, reports: Any, named: list[tuple[str, Any]]) -> None:
        """Raise `WeightMismatchError` when a worker's reload report shows a problem; with
        `verify_weights`, against digests of the tensors as sent (computed here)."""
        _log_expected(reports)
        sent = await asyncio.to_thread(weight_check.digests, named) if self.verify_weights else None
        weight_check.check(list(reports or ()), sent, f"vLLM engine {self.model}")

    async def _load_cuda_ipc(self, named: list[tuple[str, Any]]) -> None:
        import torch
        from torch.multiprocessing import reductions

        reduce_tensor: Any = reductions.reduce_tensor
        keep = [t.contiguous() for _, t in named]  # alive until the workers have copied them
        handles = [reduce_tensor(t)[1] for t in keep]
        payload = pickle.dumps(([name for name, _ in named], handles))
        await self._load_in_workers("asyncroll_load_cuda_ipc", payload, named)
        del keep
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]  # free what workers let go


def _log_expected(reports: Any) -> None:
    """Log (DEBUG) the layers that never get a tensor on a reload, as expected."""
    expected = sorted(
        {n for r in reports or () if isinstance(r, dict) for n in r.get("expected", ())}
    )
    if expected:
        log.debug(
            "update_weights: no tensor for %s, as expected (computed buffers, or an output "
            "layer tied to the embedding and refreshed from it)",
            ", ".join(expected),
        )
