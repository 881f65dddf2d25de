"""Checkpoints of a multi-rank run: the trainer's sharded state and the producer's, at one
version, in one folder that is either complete or absent.

The trainer's state (model and optimizer, FSDP2's DTensor shards or DDP's replicas) goes
through `torch.distributed.checkpoint` (each rank writes its own shards, in parallel); rank 0
adds the producer's (`Producer.save`: the prompt cursor, ready and partial groups, counters)
and `meta.json` last (the version, the step, the world size). It is all written under a
temporary name and renamed into place once every rank has finished, so a run killed while
saving leaves the previous checkpoint whole.

Resuming with another number of ranks continues: `torch.distributed.checkpoint` reshards the
trainer's state to the new world (FSDP2 shards by dim 0, DDP keeps full copies), and the
producer's state does not depend on the ranks. What does differ is said in the log, and a
checkpoint of another model (names or shapes) is refused by torch naming the tensor.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from asyncroll.distributed import gather
from asyncroll.distributed.ranks import Ranks

if TYPE_CHECKING:
    from asyncroll.producer import Producer

log = logging.getLogger("asyncroll.distributed")
META = "meta.json"


class CheckpointMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What a checkpoint folder holds besides the state: the version the trainer's weights
    and the producer are at, the trainer's step, the ranks that wrote it."""

    version: int
    step: int
    world_size: int


async def save(
    ranks: Ranks,
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    producer: Producer | None,
    step: int,
) -> CheckpointMeta:
    """Write the checkpoint (every rank calls it, rank 0 with its producer). Call it right
    after `ranks.update_weights`: the trainer's weights are then those the producer's
    version names."""
    final = Path(path)
    partial = final.with_name(final.name + ".partial")
    if ranks.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    await ranks.run(dist.barrier)
    model_state, optim_state = get_state_dict(model, optimizer)
    await ranks.run(
        dcp_save,
        {"model": model_state, "optim": optim_state},
        checkpoint_id=str(partial / "trainer"),
    )

    async def producer_side() -> int:
        assert producer is not None
        await producer.save(partial / "producer")
        return producer.version

    version = await ranks.alone("checkpoint", producer_side if ranks.rank == 0 else None)
    meta = CheckpointMeta(
        version=int(version or 0) if ranks.rank == 0 else ranks.last_version,
        step=step,
        world_size=ranks.world_size,
    )
    if ranks.rank == 0:
        (partial / META).write_bytes(msgspec.json.encode(meta))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
    await ranks.run(dist.barrier)  # every rank returns once the folder is in place
    return meta


async def load(
    ranks: Ranks,
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    producer: Producer | None,
    bucket_bytes: int = 1 << 30,
) -> CheckpointMeta:
    """Continue from `save`'s folder (every rank, before rank 0 enters `async with
    producer`): the trainer's state into `model` and `optimizer` (resharded to this world),
    the producer's state with the checkpoint's weights, gathered from the shards, to load
    into its engine on entry. Returns what the checkpoint says (its `step`: where to go on)."""
    folder = Path(path)
    if not (folder / META).exists():
        raise FileNotFoundError(
            f"{folder} is not a complete checkpoint (no {META}): a save that was cut off "
            "leaves only its .partial folder; give the last complete one"
        )
    meta = msgspec.json.decode((folder / META).read_bytes(), type=CheckpointMeta)
    if meta.world_size != ranks.world_size:
        log.info(
            "checkpoint %s was written by %d ranks, this run has %d: the trainer's state is "
            "resharded (torch.distributed.checkpoint), the producer's does not depend on ranks",
            folder, meta.world_size, ranks.world_size,
        )  # fmt: skip
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    await ranks.run(dcp_load, state, checkpoint_id=str(folder / "trainer"))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    full = await ranks.run(
        gather.full_weights, model, keep=ranks.rank == 0, bucket_bytes=bucket_bytes
    )
    if ranks.rank == 0:
        if producer is None:
            raise ValueError("rank 0 owns the rollouts: give it the producer")
        producer.load(folder / "producer", weights=full.tensors)
        if producer.version != meta.version:
            raise ValueError(
                f"{folder}: the producer's state is at version {producer.version}, the "
                f"checkpoint says {meta.version}: the folder was not written by save()"
            )
    ranks.last_version = meta.version
    return meta
