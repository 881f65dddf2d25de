"""A sharded model's full weights, gathered on every rank for rank 0's engine.

FSDP2 (`fully_shard`) keeps each parameter as a DTensor whose `full_tensor()` is an all-gather
that every rank must join, in the same order. The peers' deadlock came from doing it lazily: a
generator of `full_tensor()` calls handed to the engine, which pulled it inside its own transfer
(another thread, another collective) while the other ranks gathered in their main loop. Here
the gather is one plain loop over `named_parameters()`, run to its end on every rank before the
engine is handed anything: the engine only ever sees finished CPU tensors (and refuses a
DTensor, see `asyncroll.engines.vllm.weights_file`).

Memory: gathered tensors are held in buckets of at most `bucket_bytes`; at a bucket's end rank 0
copies them to the CPU (the engine reads CPU tensors: the safetensors file in /dev/shm) and
every other rank drops them. The extra accelerator memory of a gather is thus at most one
bucket on every rank, and the largest parameter must fit in one. DDP's parameters are full
replicas: nothing is gathered, rank 0 hands its own tensors on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from asyncroll.lora import LoraAdapter

WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
"""Path parts that wrappers add to parameter names (`torch.compile`, DDP, FSDP1, activation
checkpointing): the engine knows the model's own names."""


class GatherStats(msgspec.Struct, frozen=True, kw_only=True):
    """One gather: how many tensors and bytes, in how many buckets, and the most gathered
    bytes held at once (the bound that `bucket_bytes` sets)."""

    tensors: int
    bytes: int
    buckets: int
    peak_bucket_bytes: int


class Gathered(msgspec.Struct, frozen=True, kw_only=True):
    tensors: list[tuple[str, torch.Tensor]]  # on rank 0 only (empty elsewhere): CPU copies
    stats: GatherStats


def engine_name(name: str) -> str:
    """`name` without the wrappers' path parts (`module.model.x` -> `model.x`)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(f".{prefix}", ".")
        while name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def _is_adapter(name: str) -> bool:
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def _parameters(model: torch.nn.Module, adapter: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in model.named_parameters():
        if not adapter or _is_adapter(name):
            yield engine_name(name), param


def _full_bytes(param: torch.Tensor) -> int:
    """Bytes of the gathered tensor (a DTensor's `numel()` is its global one)."""
    return param.numel() * param.element_size()


def check_same_parameters(model: torch.nn.Module, group: Any) -> None:
    """Refuse a gather that could not match: every rank must see the same names, global
    shapes and dtypes in the same order, or the all-gathers pair different tensors (a wrong
    model on one rank), or one rank gathers fewer and the others wait to the deadline."""
    digest = hashlib.sha256()
    for name, param in _parameters(model, adapter=False):
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
    mine = torch.frombuffer(bytearray(digest.digest()[:8]), dtype=torch.int64).clone()
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    differ = [rank for rank, d in enumerate(every) if not torch.equal(d, every[0])]
    if differ:
        raise ValueError(
            f"ranks {differ} have other parameters than rank 0 (names, shapes, dtypes or their "
            "order): every rank must build the same model and shard it the same way"
        )


def full_weights(
    model: torch.nn.Module, *, keep: bool, bucket_bytes: int, adapter: bool = False
) -> Gathered:
    """Gather every parameter (with `adapter`, only the LoRA adapter's) in `named_parameters`
    order, in buckets of at most `bucket_bytes`; `keep`: return CPU copies (rank 0)."""
    params = list(_parameters(model, adapter))
    if adapter and not params:
        raise ValueError("adapter=True, but the model has no LoRA layers: wrap it with wrap_lora")
    largest = max((_full_bytes(p) for _, p in params), default=0)
    if largest > bucket_bytes:
        name = next(n for n, p in params if _full_bytes(p) == largest)
        raise ValueError(
            f"bucket_bytes={bucket_bytes}: {name} alone has {largest} bytes; a bucket must hold "
            f"the largest tensor (bucket_bytes >= {largest})"
        )
    kept: list[tuple[str, torch.Tensor]] = []
    bucket: list[tuple[str, torch.Tensor]] = []
    held = peak = total = buckets = 0

    def flush() -> None:
        nonlocal held, buckets
        if keep:
            kept.extend((n, t.to("cpu")) for n, t in bucket)
        bucket.clear()
        held, buckets = 0, buckets + 1

    with torch.no_grad():
        for name, param in params:
            size = _full_bytes(param)
            if bucket and held + size > bucket_bytes:
                flush()
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            bucket.append((name, full))
            held += size
            total += size
            peak = max(peak, held)
        if bucket:
            flush()
    stats = GatherStats(tensors=len(params), bytes=total, buckets=buckets, peak_bucket_bytes=peak)
    return Gathered(tensors=kept, stats=stats)


def adapter_from(model: torch.nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> LoraAdapter:
    """The `LoraAdapter` of gathered adapter tensors, with the config of the model's
    `wrap_lora` layers (`asyncroll.train.lora.adapter_of` for an unsharded model)."""
    from asyncroll.train.lora import lora_layers

    configs = {layer.config for _, layer in lora_layers(model)}
    if len(configs) != 1:
        raise ValueError(f"the model's LoRA layers have {len(configs)} configs: need one")
    return LoraAdapter(config=configs.pop(), tensors=dict(tensors))
