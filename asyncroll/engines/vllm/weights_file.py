"""Trainer weights as one safetensors file: how both vLLM engines hand new weights to vLLM.

`VLLMEngine` writes the file to /dev/shm for its workers to memory-map; `VLLMServerEngine`
writes it under a folder every replica reads, for vLLM's `reload_weights`. One writer means
both engines accept the same tensors (numpy arrays, tensors on any device, tied embeddings).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncroll.engines.base import Weights


def detached(weights: Weights) -> list[tuple[str, Any]]:
    """`weights` as named torch tensors cut off from autograd (numpy arrays are converted).

    A sharded tensor (FSDP2's DTensor) is refused: its `full_tensor()` is a collective that
    every rank must join in one order, which the engine's transfer cannot arrange (pulled
    lazily there, it deadlocked the peers' trainers). `asyncroll.distributed.Ranks
    .update_weights` gathers on every rank first."""
    import torch

    named = []
    for name, t in weights:
        if type(t).__name__ == "DTensor":
            raise TypeError(
                f"{name} is a sharded DTensor (FSDP2): its full tensor needs every rank; "
                "update through asyncroll.distributed.Ranks.update_weights(model, producer), "
                "which gathers on every rank before the engine sees a tensor"
            )
        named.append((name, torch.as_tensor(t).detach()))
    return named


def write_safetensors(named: list[tuple[str, Any]], path: Path) -> None:
    """Write CPU copies of the tensors; tensors sharing storage (tied embeddings) are cloned,
    since safetensors refuses shared storage."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for name, tensor in named:
        cpu = tensor.to("cpu").contiguous()
        if cpu.untyped_storage().data_ptr() in seen:
            cpu = cpu.clone()
        seen.add(cpu.untyped_storage().data_ptr())
        tensors[name] = cpu
    save_file(tensors, str(path))
