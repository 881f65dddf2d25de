"""One rank of a real torch.distributed group (gloo) running `train_step` under DDP and
FSDP2; driven by tests/test_train_step.py, which starts two of them.

Each rank trains its own shard of `split_batch(batch, ranks=world)` with SGD, with
"seq-mean-token-mean" (every aggregation with `--all`; the simulated ranks of the test module
check them all, cheaper), the clip-higher, the reference KL and the `tis` correction, and
checks that
the weights after the step equal those of one process's full-batch step (computed here too,
through `policy_loss` on the whole batch), that the all-reduced loss is the whole batch's, and
that the gradient norm is the full one. It exits non-zero with the difference if not.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python -m tests.ranks_train_step [--all]
"""

from __future__ import annotations

import copy
import datetime
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from asyncroll.train import AGGREGATIONS, CORRECTIONS, LossConfig, split_batch, to_batch, train_step
from tests.test_train_step import SAMPLING, Tiny, forward_of, group, one_process

LR = 0.1


class Sgd:
    """Plain SGD with `train_step`'s two calls: `torch.optim`'s first use imports dynamo, 4.5 s
    of each rank's start on this machine."""

    def __init__(self, parameters: Any) -> None:
        self.parameters = list(parameters)

    def zero_grad(self) -> None:
        for p in self.parameters:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p in self.parameters:
            p -= LR * p.grad


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = to_batch([group(g, 3, [5, 1, 7, 2], seed=g) for g in range(3)])
    for aggregation in AGGREGATIONS if "--all" in sys.argv else ("seq-mean-token-mean",):
        config = LossConfig(
            clip_high=0.28,
            aggregation=aggregation,
            norm_length=9 if aggregation == "seq-mean-token-sum-norm" else None,
            kl_coef=0.1,
            correction=CORRECTIONS["tis"],
            **SAMPLING,  # type: ignore[arg-type]
        )
        model, reference = Tiny(0), Tiny(7)
        loss, _, grads = one_process(model, reference, batch, config)
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])))
        expected = {n: p.detach() - LR * grads[n] for n, p in model.named_parameters()}
        shard = split_batch(batch, world, max_tokens=12)[rank]
        for kind in ("ddp", "fsdp2", "fsdp2-every"):
            replica = copy.deepcopy(model)
            wrapped: Any = (
                torch.nn.parallel.DistributedDataParallel(replica)
                if kind == "ddp"
                else fully_shard(replica)
            )
            stats = train_step(
                wrapped,
                Sgd(wrapped.parameters()),  # type: ignore[arg-type]
                shard,
                config,
                forward=lambda ids, mask, m=wrapped: m(ids, mask),
                reference=forward_of(reference),
                max_grad_norm=1e9,  # reports the norm, clips nothing
                gradient_sync="every" if kind == "fsdp2-every" else "last",
            )
            where = f"rank {rank}, {kind}, {aggregation}"
            assert abs(stats["train/loss"] - loss) <= 1e-9 * abs(loss), (where, stats, loss)
            assert abs(stats["train/grad_norm"] - norm) <= 1e-9 * norm, (where, stats, norm)
            for name, p in wrapped.named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                name = name.removeprefix("module.")
                torch.testing.assert_close(
                    full.detach(), expected[name], rtol=1e-9, atol=1e-12, msg=f"{where}, {name}"
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
