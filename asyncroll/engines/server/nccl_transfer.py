"""The trainer's side of vLLM's NCCL weight transfer, for `VLLMServerEngine` on GPUs.

vLLM (>= 0.32, `vllm serve ... --weight-transfer-config '{"backend":"nccl"}'`) can receive
weights over NCCL instead of reading them from disk: the trainer process is rank 0 of an NCCL
group whose other ranks are the replicas' workers, and it broadcasts every tensor to all of
them at once. `VLLMServerEngine` drives the replicas' side over HTTP (`/init_weight_transfer_
engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`); this module is
the trainer's side: joining the group and broadcasting, through vLLM's own functions
(`nccl_common.trainer_init`, `packed_tensor.packed_nccl_broadcast_producer`), so the two ends
agree on the wire format.

GPU only (NCCL): on the CPU machines this project is developed on it is imported, never run.
torch and vLLM are imported when a group is joined, not before.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

# vLLM's defaults (`vllm.distributed.weight_transfer.packed_tensor`), not imported so that
# this module imports without vLLM.
PACKED_BUFFER_SIZE_BYTES = 1 << 30
PACKED_NUM_BUFFERS = 2


class WeightSender(Protocol):
    """The trainer's side as `VLLMServerEngine` uses it: prepare a group, join it while the
    replicas join, broadcast, leave. `NCCLWeightTransfer` is the real one; the CPU tests give
    a simulation."""

    timeout_s: float  # the deadline of a join, a send, and the replicas' calls that pair with them

    def new_group(self, world_size: int) -> dict[str, Any]:
        """Leave the group this process is in, prepare one of `world_size` ranks with this
        process as rank 0, and return the replicas' `init_info` for it (each replica adds its
        `rank_offset`)."""
        ...

    async def join(self) -> None:
        """Join the group prepared last; returns once every rank has joined."""
        ...

    async def send(self, named: list[tuple[str, Any]]) -> None:
        """Broadcast the tensors, in order, to every rank of the group."""
        ...

    def leave(self) -> None:
        """Leave the group (aborting a broadcast stuck in it); safe to call when not in one."""
        ...


class NCCLWeightTransfer:
    """The trainer's end of vLLM's NCCL weight transfer (give it to `VLLMServerEngine` as
    `weight_transfer=`).

    `master_address`: an address of this machine the replicas' GPUs can reach; the group's
    TCP rendezvous listens there, on `master_port` for the first group and `master_port + k`
    for the k-th rebuilt one (a group is rebuilt when a replica leaves or rejoins; a port is
    not reused because vLLM's rendezvous store may outlive its group). The broadcast runs on
    the CUDA device current when the group is joined. `packed`: send in
    `packed_buffer_size_bytes` chunks, `packed_num_buffers` at a time (vLLM's trainer
    default), else tensor by tensor. `timeout_s`: the deadline of a join and of a send; a
    send that misses it is aborted (the group is then rebuilt by the next update).
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        *,
        packed: bool = True,
        packed_buffer_size_bytes: int = PACKED_BUFFER_SIZE_BYTES,
        packed_num_buffers: int = PACKED_NUM_BUFFERS,
        timeout_s: float = 600.0,
    ) -> None:
        if not 0 < master_port < 65536:
            raise ValueError(f"master_port={master_port}: not a TCP port")
        if packed_buffer_size_bytes < 1 or packed_num_buffers < 1:
            raise ValueError("packed_buffer_size_bytes and packed_num_buffers must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        self.master_address = master_address
        self.master_port = master_port
        self.packed = packed
        self.packed_buffer_size_bytes = packed_buffer_size_bytes
        self.packed_num_buffers = packed_num_buffers
        self.timeout_s = timeout_s
        self._groups = 0  # groups prepared so far (the next one's port offset)
        self._rendezvous: dict[str, Any] | None = None  # the group prepared last
        self._device: int | None = None
        self._communicator: Any = None  # vLLM's PyNcclCommunicator while in a group

    def new_group(self, world_size: int) -> dict[str, Any]:
        if world_size < 2:
            raise ValueError(f"world_size={world_size}: the trainer and at least one worker")
        self.leave()
        port = self.master_port + self._groups
        if port >= 65536:
            raise RuntimeError(f"group {self._groups}: master_port + {self._groups} > 65535")
        self._groups += 1
        self._rendezvous = {
            "master_address": self.master_address,
            "master_port": port,
            "world_size": world_size,
        }
        return {
            **self._rendezvous,
            "packed": self.packed,
            "packed_buffer_size_bytes": self.packed_buffer_size_bytes,
            "packed_num_buffers": self.packed_num_buffers,
        }

    async def join(self) -> None:
        """Join as rank 0 (blocks in a thread until every worker has joined). On a timeout
        the thread is left behind; the group is then never used."""
        import torch

        if self._rendezvous is None:
            raise RuntimeError("join before new_group")
        rendezvous, self._device = self._rendezvous, torch.cuda.current_device()
        self._communicator = await _within(
            self.timeout_s, "NCCL join", self._join, rendezvous, self._device
        )

    async def send(self, named: list[tuple[str, Any]]) -> None:
        """Broadcast `named` from rank 0; on an error or timeout the group is aborted."""
        communicator, device = self._communicator, self._device
        if communicator is None or device is None:
            raise RuntimeError("send before join")
        try:
            await _within(self.timeout_s, "NCCL send", self._broadcast, communicator, device, named)
        except BaseException:
            self.leave()  # ncclCommAbort: a broadcast stuck in the thread returns
            raise

    def leave(self) -> None:
        communicator, self._communicator = self._communicator, None
        if communicator is not None:
            communicator.destroy()

    @staticmethod
    def _join(rendezvous: dict[str, Any], device: int) -> Any:
        import torch
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        torch.cuda.set_device(device)  # the current device is per thread
        return trainer_init(rendezvous, rank=0)

    def _broadcast(self, communicator: Any, device: int, named: list[tuple[str, Any]]) -> None:
        """vLLM's trainer broadcast (`NCCLTrainerWeightTransferEngine._broadcast`): packed
        chunks, or one contiguous tensor at a time; then wait until it has left."""
        import torch

        torch.cuda.set_device(device)
        on_device = ((name, t.to(device)) for name, t in named)
        if self.packed:
            from vllm.distributed.weight_transfer.packed_tensor import (
                packed_nccl_broadcast_producer,
            )

            packed_nccl_broadcast_producer(
                iterator=on_device,
                group=communicator,
                src=0,
                post_iter_func=lambda item: item[1],
                buffer_size_bytes=self.packed_buffer_size_bytes,
                num_buffers=self.packed_num_buffers,
            )
        else:
            stream = torch.cuda.current_stream()
            for _, tensor in on_device:
                communicator.broadcast(tensor.contiguous(), src=0, stream=stream)
        torch.cuda.current_stream().synchronize()


async def _within(timeout_s: float, what: str, blocking: Any, *args: Any) -> Any:
    """`blocking(*args)` in a thread, `TimeoutError` naming `what` after `timeout_s`."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(blocking, *args), timeout_s)
    except TimeoutError:
        raise TimeoutError(f"{what} not done within timeout_s={timeout_s}") from None


def update_info(named: list[tuple[str, Any]]) -> dict[str, Any]:
    """The replicas' `/update_weights` body for `named` (vLLM's
    `NCCLWeightTransferUpdateInfo`: names, dtype names as torch attributes, shapes)."""
    return {
        "names": [name for name, _ in named],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
    }
