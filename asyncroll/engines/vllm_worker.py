"""vLLM worker extension: loads new weights inside each vLLM worker process.

vLLM mixes this class into its worker class (`worker_extension_cls`), so its methods run in the
worker processes and are called with `collective_rpc`. It must stay importable without vLLM
running in this process and must not import anything heavy at module level: every worker
imports it at start-up.

Weights are loaded with the worker's `reload_weights(weights_iterator=...)`, not with
`model.load_weights`: after start-up the CPU backend has repacked its linear weights for its
kernels (their parameters have shape 0), and `reload_weights` is the path that re-runs the
loader's processing. It is the same call on GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class WeightLoaderExtension:
    """Methods vLLM adds to its worker. Names carry an `asyncroll_` prefix because vLLM refuses
    an extension attribute that the worker class already has."""

    def asyncroll_load_file(self, path: str) -> int:
        """Load every tensor of a safetensors file (written by the trainer's process to
        /dev/shm: reading it is a memory copy, not disk I/O). Returns the tensor count."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        self._asyncroll_reload(iter(tensors.items()))
        return len(tensors)

    def asyncroll_load_cuda_ipc(self, payload: bytes) -> int:
        """Load tensors the trainer's process shared with CUDA IPC: `payload` pickles the
        names and `reduce_tensor` arguments of each (pickled by us, in the trainer's process,
        because vLLM's RPC encoding does not carry classes and dtypes). The device index in
        each handle is the sender's; it is replaced by this worker's device, which must be the
        same physical GPU."""
        import pickle

        import torch
        from torch.multiprocessing import reductions

        rebuild_cuda_tensor: Any = reductions.rebuild_cuda_tensor
        names, handles = pickle.loads(payload)
        device = torch.cuda.current_device()

        def tensors() -> Iterator[tuple[str, Any]]:
            for name, args in zip(names, handles, strict=True):
                fixed = list(args)
                fixed[6] = device  # position of the device index in reduce_tensor's args
                yield name, rebuild_cuda_tensor(*fixed)

        self._asyncroll_reload(tensors())
        torch.cuda.synchronize()
        return len(names)

    def _asyncroll_reload(self, weights: Iterator[tuple[str, Any]]) -> None:
        self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
        self._asyncroll_refresh_tied_head()

    def _asyncroll_refresh_tied_head(self) -> None:
        """Re-run the output layer's weight processing when it shares the input embedding.

        A tied `lm_head` receives no tensor of its own, so `reload_weights` leaves it alone;
        on CPU its processing made a packed copy of the weight for the GEMM kernel, which would
        keep serving the old embedding (vLLM 0.32: greedy tokens then differ from the new
        weights'). Processing it again repacks from the shared, now reloaded, weight; on GPU
        it is a no-op.
        """
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        head = getattr(model, "lm_head", None)
        weight = getattr(head, "weight", None)
        if head is None or weight is None:
            return
        tied = any(m is not head and getattr(m, "weight", None) is weight for m in model.modules())
        if tied:
            head.quant_method.process_weights_after_loading(head)
