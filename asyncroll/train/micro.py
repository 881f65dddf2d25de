"""Split a batch over ranks and into micro-batches whose losses add up to the whole batch's.

A batch from `to_batch` (advantages already computed over whole groups: a split never changes
them) is dealt out row by row: every sample goes to exactly one rank, chosen by a cost model
so that the ranks finish their forward and backward passes at about the same time. Within a
rank, rows are packed into micro-batches whose padded size (rows x the longest row) stays
within a token budget, and each micro-batch is trimmed to its own longest row. Every rank gets
the same number of micro-batches, as FSDP and DDP need (each micro-batch's backward runs the
same collectives on every rank; a rank with one fewer would leave the others waiting): a rank
with less work gets padding micro-batches of one untrained token, which run a forward and a
backward and add exactly nothing. Every shard carries the whole batch's `LossNorm`, so that
`policy_loss(..., norm=shard.norm)` of all micro-batches of all ranks sums to the one-process
loss of the whole batch.

Cost models (`cost=`): "tokens", a row's length; "squared", its length squared (attention's
share, TRL's balance); or a function of the lengths. Which predicts a micro-batch's time on
the tiny model is measured in benchmarks/split_cost.py.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Literal

import msgspec
import torch

from asyncroll.train.loss import LossNorm, TrainBatch

CostModel = Literal["tokens", "squared"]
COSTS: tuple[CostModel, ...] = ("tokens", "squared")
CostFn = Callable[[torch.Tensor], torch.Tensor]
"""A cost model as a function: [B] float64 row lengths in, [B] costs >= 0 out."""


class MicroBatch(msgspec.Struct, frozen=True, kw_only=True):
    """Rows of one forward and backward pass, trimmed to their longest row.

    `rows[i]` is the index in the whole batch of row i (-1: a padding row, which has one
    untrained token: `loss_mask` all False, advantage 0)."""

    batch: TrainBatch
    rows: torch.Tensor  # [b] int64

    @property
    def padding(self) -> bool:
        """A padding micro-batch: it adds nothing to the loss and the gradients."""
        return bool((self.rows < 0).all())

    @property
    def num_tokens(self) -> int:
        """Positions it computes (rows x longest row), padding included."""
        return int(self.batch.input_ids.numel())

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(batch=self.batch.to(device), rows=self.rows.to(device))


class Shard(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's part of a batch: its micro-batches (as many as every other rank's), the
    whole batch's loss denominators, and the split's metrics (the same on every shard)."""

    rank: int
    ranks: int
    micro_batches: tuple[MicroBatch, ...]
    norm: LossNorm
    cost: float  # this rank's share of the cost model's total
    metrics: dict[str, float]

    def to(self, device: torch.device | str) -> Shard:
        return msgspec.structs.replace(
            self, micro_batches=tuple(m.to(device) for m in self.micro_batches)
        )


def row_costs(lengths: torch.Tensor, cost: CostModel | CostFn) -> torch.Tensor:
    """The cost of each row ([B] float64) from its length in tokens."""
    lengths = lengths.to(torch.float64)
    if callable(cost):
        values = torch.as_tensor(cost(lengths), dtype=torch.float64)
        if values.shape != lengths.shape or not (values >= 0).all():
            raise ValueError("a cost function must return one cost >= 0 per row")
        return values
    if cost == "tokens":
        return lengths
    if cost == "squared":
        return lengths.square()
    raise ValueError(f"cost={cost!r}: use one of {', '.join(COSTS)} or a function of lengths")


def split_batch(
    batch: TrainBatch,
    ranks: int,
    *,
    max_tokens: int,
    cost: CostModel | CostFn = "tokens",
) -> list[Shard]:
    """`ranks` shards of `batch`, one per rank, each a list of micro-batches of at most
    `max_tokens` padded positions (rows x longest row).

    Rows go to ranks longest-processing-time first: by falling cost, each to the rank with the
    least cost so far (within 4/3 of the best balance; ties to the lower rank, so the split is
    deterministic and every rank computes the same one). Within a rank, rows are packed by
    falling length, each micro-batch taking rows while (rows + 1) x its first (longest) row
    fits the budget. A row longer than `max_tokens` gets a micro-batch of its own (one row is
    the smallest pass there is; refusing it would drop a batch that was paid for), counted in
    `metrics["oversized_rows"]`: raise `max_tokens` to the longest row the engine can produce
    (prompt + max_new_tokens) if that micro-batch does not fit in memory.

    `metrics`: `imbalance` (max over mean of the ranks' costs; 1 is perfect), `padding_share`
    (the share of computed positions that are padding, padding micro-batches included),
    `micro_batches` (per rank), `padding_micro_batches` (over all ranks), `oversized_rows`.
    """
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: must be >= 1")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: must be >= 1 (padded tokens per micro-batch)")
    lengths = batch.attention_mask.sum(-1)
    positions = torch.arange(batch.attention_mask.shape[1], device=lengths.device)
    if not torch.equal(batch.attention_mask, positions < lengths[:, None]):
        raise ValueError(
            "split_batch needs right-padded rows (real tokens first, as to_batch makes them): "
            "a micro-batch is trimmed to its longest row"
        )
    costs = row_costs(lengths.cpu(), cost)
    owners = _assign(costs, ranks)
    norm = LossNorm.of(batch)
    packed = [_pack(owned, lengths.cpu(), max_tokens) for owned in owners]
    count = max(1, *(len(p) for p in packed))
    loads = [float(costs[owned].sum()) for owned in owners]
    shards: list[list[MicroBatch]] = []
    for groups in packed:
        micro = [_micro_batch(batch, torch.tensor(rows), lengths) for rows in groups]
        micro += [_padding(batch)] * (count - len(micro))
        shards.append(micro)
    computed = sum(m.num_tokens for micro in shards for m in micro)
    metrics = {
        "imbalance": max(loads) / (sum(loads) / ranks) if sum(loads) else 1.0,
        "padding_share": 1 - int(lengths.sum()) / computed,
        "micro_batches": float(count),
        "padding_micro_batches": float(sum(m.padding for micro in shards for m in micro)),
        "oversized_rows": float(int((lengths > max_tokens).sum())),
    }
    return [
        Shard(
            rank=rank,
            ranks=ranks,
            micro_batches=tuple(micro),
            norm=norm,
            cost=loads[rank],
            metrics=dict(metrics),
        )
        for rank, micro in enumerate(shards)
    ]


def _assign(costs: torch.Tensor, ranks: int) -> list[torch.Tensor]:
    """Row indices per rank, longest processing time first (see `split_batch`)."""
    order = sorted(range(costs.numel()), key=lambda i: (-float(costs[i]), i))
    heap = [(0.0, rank) for rank in range(ranks)]
    owned: list[list[int]] = [[] for _ in range(ranks)]
    for row in order:
        load, rank = heapq.heappop(heap)
        owned[rank].append(row)
        heapq.heappush(heap, (load + float(costs[row]), rank))
    return [torch.tensor(sorted(rows), dtype=torch.int64) for rows in owned]


def _pack(rows: torch.Tensor, lengths: torch.Tensor, max_tokens: int) -> list[list[int]]:
    """Rows packed into micro-batches of at most `max_tokens` padded positions, by falling
    length (a row over the budget alone); each micro-batch's rows in batch order."""
    order = sorted(rows.tolist(), key=lambda i: (-int(lengths[i]), i))
    groups: list[list[int]] = []
    for row in order:
        if groups and (len(groups[-1]) + 1) * int(lengths[groups[-1][0]]) <= max_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
    return [sorted(g) for g in groups]


def _micro_batch(batch: TrainBatch, rows: torch.Tensor, lengths: torch.Tensor) -> MicroBatch:
    """`rows` of `batch`, trimmed to the longest of them."""
    index = rows.to(batch.input_ids.device)
    width = int(lengths[index].max())
    fields = {f: getattr(batch, f)[index] for f in batch.__struct_fields__}
    for f in ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "versions"):
        fields[f] = fields[f][:, :width].contiguous()
    return MicroBatch(batch=TrainBatch(**fields), rows=rows)


def _padding(batch: TrainBatch) -> MicroBatch:
    """One row of one token that adds nothing: attended (a row with no attended token makes
    NaN in some attention kernels) but not trained, advantage 0. Its token is the batch's
    first, so it is a valid id for the model."""
    one = torch.ones((1, 1), dtype=torch.bool, device=batch.input_ids.device)
    return MicroBatch(
        batch=TrainBatch(
            input_ids=batch.input_ids[:1, :1].clone(),
            attention_mask=one,
            loss_mask=~one,
            old_logprobs=torch.zeros_like(batch.old_logprobs[:1, :1]),
            versions=torch.full_like(batch.versions[:1, :1], -1),
            advantages=torch.zeros_like(batch.advantages[:1]),
            rewards=torch.zeros_like(batch.rewards[:1]),
            group_index=torch.full_like(batch.group_index[:1], -1),
        ),
        rows=torch.tensor([-1]),
    )
