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
    """`weights` as named torch tensors cut off from autograd (numpy arrays are converted)."""
    import torch

    return [(name, torch.as_tensor(t).detach()) for name, t in weights]


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
