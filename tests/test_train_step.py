"""The step at real size: every aggregation, the clip-higher and the reference KL against
formulas written out here; `split_batch` over random group sizes and lengths; and the
guarantee the distributed trainer rests on: N ranks x M micro-batches (simulated in one
process, one model copy per rank, gradients averaged as DDP and FSDP2 average them) give the
one-process loss and gradients of the whole batch.

The model is a tiny causal torch model in float64 (an embedding, a running mean over the
positions before each one, a linear head): cheap, and causal as a language model is, so that
padding to the right never changes a real position's logits."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncroll.train import (
    AGGREGATIONS,
    CORRECTIONS,
    LossConfig,
    LossNorm,
    MicroBatch,
    Shard,
    TrainBatch,
    policy_loss,
    split_batch,
    to_batch,
    token_logprobs,
    train_step,
)
from asyncroll.types import RolloutGroup, RolloutState, Status

VOCAB = 23
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tensors of a few hundred elements: a second intra-op thread only adds its handoffs,
    which cost 70x the work itself on this shared 2-core machine (0.46 ms vs 32 ms a step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Tiny(torch.nn.Module):
    """Causal: position t sees the mean of the embeddings of positions <= t."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, 6, generator=generator).double())
        self.head = torch.nn.Linear(6, VOCAB).double()
        with torch.no_grad():  # every weight from `seed`: the same model in every process
            self.head.weight.copy_(torch.randn(VOCAB, 6, generator=generator))
            self.head.bias.copy_(torch.randn(VOCAB, generator=generator))
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.embed[input_ids]
        steps = torch.arange(1, input_ids.shape[1] + 1, dtype=x.dtype)[None, :, None]
        return self.head(torch.tanh(x.cumsum(1) / steps)) * 2.0


def forward_of(model: Tiny) -> Any:
    return lambda ids, mask: model(ids, mask)


def group(uid: int, prompt: int, lengths: list[int], seed: int) -> RolloutGroup:
    rng = np.random.default_rng(seed)
    samples = tuple(
        RolloutState(
            tokens=rng.integers(0, VOCAB, n, dtype=np.int32),
            logprobs=-rng.random(n, dtype=np.float32) * 3,
            versions=np.zeros(n, dtype=np.int32),
            status=Status.COMPLETED,
            finish_reason="length",
            reward=float(rng.integers(0, 3)),
        )
        for n in lengths
    )
    return RolloutGroup(
        uid=uid,
        prompt_id=f"p/{uid}",
        task="t",
        prompt_tokens=rng.integers(0, VOCAB, prompt, dtype=np.int32),
        samples=samples,
        status=Status.COMPLETED,
    )


@st.composite
def batches(draw: st.DrawFn) -> TrainBatch:
    """to_batch of 1-4 groups of one size (1-4 samples), prompts of 1-5 tokens, responses of
    0-7 tokens (a sample with no trained token too)."""
    size = draw(st.integers(1, 4))
    groups = [
        group(
            uid,
            draw(st.integers(1, 5)),
            draw(st.lists(st.integers(0, 7), min_size=size, max_size=size)),
            seed=draw(st.integers(0, 2**16)),
        )
        for uid in range(draw(st.integers(1, 4)))
    ]
    return to_batch(groups, advantage="grpo")


def hand_batch(
    old: list[list[float]], adv: list[float], mask: list[list[bool]] | None = None
) -> TrainBatch:
    """Rows of trained tokens only (no prompt), to check the loss by hand."""
    b, length = len(old), len(old[0])
    loss_mask = torch.tensor(mask) if mask is not None else torch.ones(b, length, dtype=torch.bool)
    return TrainBatch(
        input_ids=torch.zeros(b, length, dtype=torch.int64),
        attention_mask=torch.ones(b, length, dtype=torch.bool),
        loss_mask=loss_mask,
        old_logprobs=torch.tensor(old, dtype=torch.float64) * loss_mask,
        versions=torch.zeros(b, length, dtype=torch.int32),
        advantages=torch.tensor(adv, dtype=torch.float64),
        rewards=torch.zeros(b),
        group_index=torch.zeros(b, dtype=torch.int64),
    )


# -- the loss against formulas written out ---------------------------------------------------


def written_out_loss(
    logp: torch.Tensor,
    batch: TrainBatch,
    *,
    clip: float,
    clip_high: float | None,
    ref: torch.Tensor | None,
    kl_coef: float,
    kl_estimator: str,
    aggregation: str,
    norm_length: int | None,
) -> float:
    """The loss as the recipes define it, token by token in plain Python floats."""
    high = 1 + (clip if clip_high is None else clip_high)
    per_sample: list[list[float]] = []
    for b in range(logp.shape[0]):
        terms = []
        for t in range(logp.shape[1]):
            if not batch.loss_mask[b, t]:
                continue
            lp, old, a = (
                float(logp[b, t]),
                float(batch.old_logprobs[b, t]),
                float(batch.advantages[b]),
            )
            r = math.exp(lp - old)
            term = -min(r * a, min(max(r, 1 - clip), high) * a)
            if ref is not None:
                d = float(ref[b, t]) - lp  # log pi_ref / pi
                kl = -d if kl_estimator == "k1" else math.exp(d) - d - 1
                term += kl_coef * kl
            terms.append(term)
        per_sample.append(terms)
    tokens = sum(len(s) for s in per_sample)
    samples = len(per_sample)
    if aggregation == "token-mean":
        return sum(sum(s) for s in per_sample) / max(tokens, 1)
    if aggregation == "seq-mean-token-mean":
        return sum(sum(s) / len(s) if s else 0.0 for s in per_sample) / samples
    assert norm_length is not None
    return sum(sum(s) for s in per_sample) / (samples * norm_length)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    aggregation=st.sampled_from(AGGREGATIONS),
    clip_high=st.sampled_from([None, 0.28, 0.0]),
    kl=st.sampled_from([None, ("k1", 0.1), ("k3", 0.5), ("k3", 0.0)]),
    rows=st.integers(1, 4),
    length=st.integers(1, 6),
)
def test_policy_loss_is_the_written_out_formula(
    seed: int,
    aggregation: str,
    clip_high: float | None,
    kl: tuple[str, float] | None,
    rows: int,
    length: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, length, generator=g) < 0.7
    old = -torch.rand(rows, length, generator=g, dtype=torch.float64) * 2
    batch = hand_batch(old.tolist(), torch.randn(rows, generator=g).tolist(), mask.tolist())
    logp = batch.old_logprobs + 0.4 * torch.randn(rows, length, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(rows, length, generator=g, dtype=torch.float64)
    estimator, coef = kl or ("k3", 0.0)
    norm_length = 7 if aggregation == "seq-mean-token-sum-norm" else None
    loss, stats = policy_loss(
        logp,
        batch,
        clip=0.2,
        clip_high=clip_high,
        ref_logprobs=ref if kl else None,
        kl_coef=coef,
        kl_estimator=estimator,  # type: ignore[arg-type]
        aggregation=aggregation,  # type: ignore[arg-type]
        norm_length=norm_length,
    )
    expected = written_out_loss(
        logp,
        batch,
        clip=0.2,
        clip_high=clip_high,
        ref=ref if kl else None,
        kl_coef=coef,
        kl_estimator=estimator,
        aggregation=aggregation,
        norm_length=norm_length,
    )
    assert float(loss) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert stats["loss"] == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_clip_higher_by_hand() -> None:
    """Ratio e^0.25 = 1.284 on a positive advantage: clip 0.2 caps it at 1.2, clip_high 0.28
    at 1.28, clip_high 0.3 not at all; ratio e^-0.4 = 0.670 on a negative advantage is
    capped at 1 - clip = 0.8 whatever clip_high."""
    batch = hand_batch([[0.0], [0.0]], [1.0, -1.0])
    logp = torch.tensor([[0.25], [-0.4]], dtype=torch.float64)
    low = -min(math.exp(-0.4) * -1, 0.8 * -1)  # = 0.8
    for clip_high, high in ((None, 1.2), (0.28, 1.28), (0.3, math.exp(0.25))):
        loss, stats = policy_loss(logp, batch, clip=0.2, clip_high=clip_high)
        assert float(loss) == pytest.approx((-high + low) / 2, rel=1e-12)
        assert stats["clip_fraction_low"] == 0.5
        assert stats["clip_fraction_high"] == (0.5 if clip_high != 0.3 else 0.0)
        assert stats["clip_fraction"] == stats["clip_fraction_low"] + stats["clip_fraction_high"]


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_reference_kl_value_and_gradient_by_hand(estimator: str) -> None:
    """log pi = -1, log pi_ref = -2 on one on-policy token with advantage 0: the loss is
    kl_coef * KL with k1 = 1 (gradient kl_coef) and k3 = e^-1 - (-1) - 1 = e^-1 (gradient
    kl_coef * (1 - e^-1)): both push log pi down towards the reference."""
    batch = hand_batch([[-1.0]], [0.0])
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-2.0]], dtype=torch.float64)
    loss, stats = policy_loss(
        logp,
        batch,
        ref_logprobs=ref,
        kl_coef=0.5,
        kl_estimator=estimator,  # type: ignore[arg-type]
    )
    kl, grad = (1.0, 1.0) if estimator == "k1" else (math.exp(-1), 1 - math.exp(-1))
    assert float(loss.detach()) == pytest.approx(0.5 * kl, rel=1e-12)
    assert stats["kl"] == pytest.approx(kl, rel=1e-12)
    loss.backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None and float(logp.grad[0, 0]) == pytest.approx(0.5 * grad)


def test_aggregations_by_hand() -> None:
    """Two samples, advantage 1 and 3, on-policy (every term is -A), with 1 and 3 trained
    tokens: token-mean (-1 - 9) / 4; seq-mean-token-mean (-1 + -3) / 2; Dr. GRPO's
    (-1 - 9) / (2 x 10)."""
    mask = [[True, False, False], [True, True, True]]
    batch = hand_batch([[-1.0] * 3] * 2, [1.0, 3.0], mask)
    logp = batch.old_logprobs.clone()
    for aggregation, extra, expected in (
        ("token-mean", {}, -10 / 4),
        ("seq-mean-token-mean", {}, -4 / 2),
        ("seq-mean-token-sum-norm", {"norm_length": 10}, -10 / 20),
    ):
        loss, _ = policy_loss(logp, batch, aggregation=aggregation, **extra)  # type: ignore[arg-type]
        assert float(loss) == pytest.approx(expected, rel=1e-12), aggregation


def test_a_token_outside_either_nucleus_has_no_kl_and_a_finite_gradient() -> None:
    """A -inf logprob (outside a top-k/top-p set) in the policy or the reference: its KL term
    would be inf (k3's exp(inf)), and masking it after the exp left 0 * inf = NaN in the
    gradient."""
    batch = hand_batch([[-1.0, -1.0, -1.0]], [1.0])
    logp = torch.tensor([[-1.0, -math.inf, -1.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-math.inf, -2.0, -1.0]], dtype=torch.float64)
    for estimator in ("k1", "k3"):
        loss, stats = policy_loss(
            logp,
            batch,
            ref_logprobs=ref,
            kl_coef=1.0,
            kl_estimator=estimator,  # type: ignore[arg-type]
        )
        d = -1.0 - -1.5
        kl = -d if estimator == "k1" else math.exp(d) - d - 1
        assert stats["kl"] == pytest.approx(kl / 3, rel=1e-12)
        loss.backward()  # type: ignore[no-untyped-call]
        assert logp.grad is not None and logp.grad.isfinite().all()
        logp.grad = None


def test_a_slice_with_the_whole_batchs_norm_is_its_share() -> None:
    """Rows 0 and 1 with the norm of all three rows, plus row 2 with it, is the loss of the
    three rows, for every aggregation; with the slices' own norms it is not."""
    batch = hand_batch(
        [[-1.0] * 3] * 3, [1.0, -2.0, 0.5], [[True] * 3, [True, False, False], [True, True, False]]
    )
    logp = batch.old_logprobs + 0.1
    whole = LossNorm.of(batch)
    assert whole == LossNorm(tokens=6, samples=3)
    parts = [_rows(batch, [0, 1]), _rows(batch, [2])]
    for aggregation in AGGREGATIONS:
        extra: dict[str, Any] = {"aggregation": aggregation}
        if aggregation == "seq-mean-token-sum-norm":
            extra["norm_length"] = 4
        full, full_stats = policy_loss(logp, batch, **extra)
        shares = [policy_loss(logp[rows], part, norm=whole, **extra) for rows, part in parts]
        assert sum(float(s[0]) for s in shares) == pytest.approx(float(full), rel=1e-12)
        for name in full_stats:
            assert sum(s[1][name] for s in shares) == pytest.approx(full_stats[name], rel=1e-6)
        own = sum(float(policy_loss(logp[rows], part, **extra)[0]) for rows, part in parts)
        assert own != pytest.approx(float(full), rel=1e-6)


def _rows(batch: TrainBatch, rows: list[int]) -> tuple[list[int], TrainBatch]:
    return rows, TrainBatch(**{f: getattr(batch, f)[rows] for f in batch.__struct_fields__})


@pytest.mark.parametrize(
    ("settings_", "message"),
    [
        ({"aggregation": "seq-mean"}, "use one of token-mean"),
        ({"aggregation": "seq-mean-token-sum-norm"}, "give it, e.g. the sampling's max_new_tokens"),
        ({"norm_length": 512}, "drop it"),
        ({"clip_high": -0.1}, "clip_high=-0.1: must be >= 0"),
        ({"clip": math.nan}, "clip=nan"),
        ({"kl_coef": -1.0}, "kl_coef=-1.0: must be a finite number >= 0"),
        ({"kl_estimator": "k2"}, "use 'k1' or 'k3'"),
        ({"temperature": 0.0}, "greedy has no logprobs"),
        ({"top_k": 0}, "use None to disable"),
    ],
)
def test_loss_config_refuses_settings_that_make_no_loss(
    settings_: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LossConfig(**settings_)
    if "temperature" not in settings_ and "top_k" not in settings_:  # policy_loss checks too
        batch = hand_batch([[-1.0]], [1.0])
        with pytest.raises(ValueError, match=message):
            policy_loss(batch.old_logprobs, batch, **settings_)


def test_loss_config_for_sampling_copies_the_sampling_parameters() -> None:
    from asyncroll import SamplingConfig

    sampling = SamplingConfig(max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=20)
    config = LossConfig.for_sampling(sampling, aggregation="seq-mean-token-sum-norm")
    assert (config.temperature, config.top_p, config.top_k) == (0.7, 0.9, 20)
    assert config.norm_length == 64


# -- the split --------------------------------------------------------------------------------


def lengths_of(batch: TrainBatch) -> list[int]:
    return batch.attention_mask.sum(-1).tolist()  # type: ignore[no-any-return]


@settings(max_examples=80, deadline=None)
@given(batch=batches(), ranks=st.integers(1, 4), max_tokens=st.integers(1, 40))
def test_split_puts_every_sample_on_one_rank_once_within_the_budget(
    batch: TrainBatch, ranks: int, max_tokens: int
) -> None:
    shards = split_batch(batch, ranks, max_tokens=max_tokens)
    assert [s.rank for s in shards] == list(range(ranks))
    assert len({len(s.micro_batches) for s in shards}) == 1  # the same count on every rank
    seen: list[int] = []
    lengths = lengths_of(batch)
    for shard in shards:
        assert shard.norm == LossNorm.of(batch)  # the whole batch's, on every rank
        for micro in shard.micro_batches:
            rows, part = micro.rows.tolist(), micro.batch
            width = part.input_ids.shape[1]
            if micro.padding:
                assert part.num_tokens == 0 and part.input_ids.shape == (1, 1)
                continue
            seen += rows
            assert width == max(lengths[r] for r in rows)  # trimmed to its longest row
            assert len(rows) * width <= max_tokens or (len(rows) == 1 and width > max_tokens)
            for f in part.__struct_fields__:  # the rows as to_batch made them (advantages too)
                whole = getattr(batch, f)[rows]
                assert torch.equal(getattr(part, f), whole[:, :width] if whole.ndim == 2 else whole)
    assert sorted(seen) == list(range(batch.input_ids.shape[0]))
    # Greedy list scheduling's bound: no rank above the mean by more than one row's cost.
    costs = [s.cost for s in shards]
    assert max(costs) <= sum(costs) / ranks + max(lengths) + 1e-9
    assert shards[0].metrics["imbalance"] == pytest.approx(
        max(costs) / (sum(costs) / ranks) if sum(costs) else 1.0
    )


def test_split_balances_by_the_chosen_cost() -> None:
    """Rows of 6, 4, 4 and 4 tokens over 2 ranks: by tokens {6, 4} and {4, 4} (10 vs 8); by
    squared lengths {6} and {4, 4, 4} (36 vs 48): the 6 weighs more than two 4s there."""
    lengths = [6, 4, 4, 4]
    attention = torch.arange(6) < torch.tensor(lengths)[:, None]
    batch = msgspec.structs.replace(
        hand_batch([[-1.0] * 6] * 4, [0.0] * 4), attention_mask=attention, loss_mask=attention
    )
    by_tokens = split_batch(batch, 2, max_tokens=64, cost="tokens")
    by_squares = split_batch(batch, 2, max_tokens=64, cost="squared")
    assert [rows_of(s) for s in by_tokens] == [[0, 3], [1, 2]]
    assert [s.cost for s in by_tokens] == [10, 8]
    assert [rows_of(s) for s in by_squares] == [[0], [1, 2, 3]]
    assert [s.cost for s in by_squares] == [36, 48]
    custom = split_batch(batch, 2, max_tokens=64, cost=lambda n: torch.ones_like(n))
    assert [s.cost for s in custom] == [2, 2]


def rows_of(shard: Shard) -> list[int]:
    return [r for m in shard.micro_batches for r in m.rows.tolist() if r >= 0]


def test_a_row_over_the_budget_gets_a_micro_batch_of_its_own() -> None:
    batch = hand_batch([[-1.0] * 6] * 3, [0.0] * 3)
    shards = split_batch(batch, 1, max_tokens=4)
    assert [m.rows.tolist() for m in shards[0].micro_batches] == [[0], [1], [2]]
    assert shards[0].metrics["oversized_rows"] == 3


def test_split_refuses_what_it_cannot_split() -> None:
    batch = hand_batch([[-1.0] * 3] * 2, [0.0] * 2)
    with pytest.raises(ValueError, match="ranks=0"):
        split_batch(batch, 0, max_tokens=8)
    with pytest.raises(ValueError, match="max_tokens=0"):
        split_batch(batch, 1, max_tokens=0)
    with pytest.raises(ValueError, match="one cost >= 0 per row"):
        split_batch(batch, 1, max_tokens=8, cost=lambda n: n[:1])
    left = msgspec.structs.replace(batch, attention_mask=torch.tensor([[False, True, True]] * 2))
    with pytest.raises(ValueError, match="right-padded"):
        split_batch(left, 1, max_tokens=8)


def test_shards_travel_as_plain_tensors() -> None:
    """`to(device)` moves every tensor; a shard pickles (torch.distributed's object lists)."""
    import pickle

    shard = split_batch(hand_batch([[-1.0] * 3] * 3, [0.0] * 3), 2, max_tokens=3)[1]
    moved = shard.to("meta")
    assert all(m.batch.input_ids.is_meta and m.rows.is_meta for m in moved.micro_batches)
    again = pickle.loads(pickle.dumps(shard))
    assert again.norm == shard.norm and again.metrics == shard.metrics
    assert all(
        isinstance(m, MicroBatch) and torch.equal(m.batch.old_logprobs, n.batch.old_logprobs)
        for m, n in zip(again.micro_batches, shard.micro_batches, strict=True)
    )


# -- the step: N ranks x M micro-batches = one process ---------------------------------------


SAMPLING = {"temperature": 0.8, "top_k": 12}


def one_process(
    model: Tiny, reference: Tiny, batch: TrainBatch, config: LossConfig
) -> tuple[float, dict[str, float], dict[str, torch.Tensor]]:
    """The whole batch in one forward and backward, through policy_loss itself."""
    model = copy.deepcopy(model)
    logp = token_logprobs(model(batch.input_ids, batch.attention_mask), batch.input_ids, **SAMPLING)  # type: ignore[arg-type]
    with torch.no_grad():
        ref = token_logprobs(
            reference(batch.input_ids, batch.attention_mask), batch.input_ids, **SAMPLING
        )  # type: ignore[arg-type]
    loss, stats = policy_loss(
        logp,
        batch,
        clip=config.clip,
        clip_high=config.clip_high,
        correction=config.correction,
        proximal_logprobs=logp.detach() if config.correction is not None else None,
        ref_logprobs=ref,
        kl_coef=config.kl_coef,
        kl_estimator=config.kl_estimator,
        aggregation=config.aggregation,
        norm_length=config.norm_length,
    )
    loss.backward()  # type: ignore[no-untyped-call]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), stats, grads


def simulated_ranks(
    model: Tiny, reference: Tiny, batch: TrainBatch, config: LossConfig, ranks: int, max_tokens: int
) -> tuple[list[dict[str, float]], dict[str, torch.Tensor], list[Shard]]:
    """One model copy per rank, each `train_step` on its shard (an optimizer with lr 0 keeps the
    weights and leaves the gradients in place); gradients averaged as DDP's all-reduce does."""
    shards = split_batch(batch, ranks, max_tokens=max_tokens)
    stats, grads = [], []
    for shard in shards:
        replica = copy.deepcopy(model)
        optimizer = torch.optim.SGD(replica.parameters(), lr=0.0)
        stats.append(
            train_step(
                replica,
                optimizer,
                shard,
                config,
                forward=forward_of(replica),
                reference=forward_of(reference),
                world_size=ranks,
            )
        )
        grads.append({n: p.grad for n, p in replica.named_parameters()})
    averaged = {n: sum(g[n] for g in grads) / ranks for n in grads[0]}  # type: ignore[misc]
    return stats, averaged, shards


@settings(max_examples=40, deadline=None)
@given(
    batch=batches(),
    ranks=st.integers(1, 3),
    max_tokens=st.integers(1, 30),
    aggregation=st.sampled_from(AGGREGATIONS),
    clip_high=st.sampled_from([None, 0.28]),
    kl_coef=st.sampled_from([0.0, 0.2]),
    kl_estimator=st.sampled_from(["k1", "k3"]),
    correction=st.sampled_from([None, "tis"]),
    seed=st.integers(0, 3),
)
def test_ranks_times_micro_batches_equal_the_whole_batch(
    batch: TrainBatch,
    ranks: int,
    max_tokens: int,
    aggregation: str,
    clip_high: float | None,
    kl_coef: float,
    kl_estimator: str,
    correction: str | None,
    seed: int,
) -> None:
    config = LossConfig(
        clip_high=clip_high,
        aggregation=aggregation,  # type: ignore[arg-type]
        norm_length=9 if aggregation == "seq-mean-token-sum-norm" else None,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,  # type: ignore[arg-type]
        correction=CORRECTIONS[correction] if correction else None,
        **SAMPLING,  # type: ignore[arg-type]
    )
    model, reference = Tiny(seed), Tiny(seed + 100)
    loss, stats, grads = one_process(model, reference, batch, config)
    rank_stats, averaged, shards = simulated_ranks(
        model, reference, batch, config, ranks, max_tokens
    )
    assert sum(s["train/loss"] for s in rank_stats) == pytest.approx(loss, rel=1e-9, abs=1e-12)
    for name, value in stats.items():  # each stat is the rank's share of the whole batch's
        total = sum(s[f"train/{name}"] for s in rank_stats)
        assert total == pytest.approx(value, rel=1e-6, abs=1e-9), name
    assert sum(s["train/tokens"] for s in rank_stats) == batch.num_tokens
    assert sum(s["train/samples"] for s in rank_stats) == batch.input_ids.shape[0]
    assert {s["train/micro_batches"] for s in rank_stats} == {len(shards[0].micro_batches)}
    for name, grad in grads.items():
        torch.testing.assert_close(averaged[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_a_padding_micro_batch_runs_and_adds_nothing() -> None:
    """One sample over three ranks: two ranks hold only a padding micro-batch; each still runs
    a forward and a backward (the collectives of FSDP/DDP must match) and its gradient is
    exactly zero."""
    batch = to_batch([group(0, 2, [3], seed=1)], advantage="none")
    shards = split_batch(batch, 3, max_tokens=64)
    idle = [s for s in shards if all(m.padding for m in s.micro_batches)]
    assert len(idle) == 2 and shards[0].metrics["padding_micro_batches"] == 2
    model = Tiny()
    stats = train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.0), idle[0], LossConfig(),
        forward=forward_of(model), world_size=3,
    )  # fmt: skip
    assert model.calls == 1
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert stats["train/loss"] == 0 and stats["train/tokens"] == 0 and stats["train/samples"] == 0


def test_train_step_is_the_plain_step_in_one_process() -> None:
    """split_batch(ranks=1) + train_step with SGD moves the weights as zero_grad, one
    backward of the whole batch's loss, clip_grad_norm_ and step do."""
    batch = to_batch([group(g, 3, [4, 2, 5], seed=g) for g in range(3)])
    config = LossConfig(clip_high=0.28, **SAMPLING)  # type: ignore[arg-type]
    model = Tiny()
    expected = copy.deepcopy(model)
    _, _, grads = one_process(expected, expected, batch, config)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    scale = min(1.0, 0.5 / (float(norm) + 1e-6))
    with torch.no_grad():
        for n, p in expected.named_parameters():
            p -= 0.1 * grads[n] * scale
    for p in model.parameters():  # stale gradients from before: zeroed first
        p.grad = torch.ones_like(p)
    shard = split_batch(batch, 1, max_tokens=12)[0]
    assert len(shard.micro_batches) > 1
    stats = train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), shard, config,
        forward=forward_of(model), max_grad_norm=0.5,
    )  # fmt: skip
    assert stats["train/grad_norm"] == pytest.approx(float(norm), rel=1e-9)
    for (n, p), q in zip(model.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=n)


class Recording(Tiny):
    """Records, per forward, whether the gradient sync was on (FSDP2's or DDP's way)."""

    def __init__(self) -> None:
        super().__init__()
        self.sync = True
        self.seen: list[bool] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.sync)
        return super().forward(input_ids, attention_mask)


class FsdpLike(Recording):
    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self.sync = requires_gradient_sync


class DdpLike(Recording):
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


@pytest.mark.parametrize("kind", [FsdpLike, DdpLike])
def test_gradients_sync_on_the_last_micro_batch_only(kind: type[Recording]) -> None:
    batch = to_batch([group(g, 2, [3, 3], seed=g) for g in range(2)])
    shard = split_batch(batch, 1, max_tokens=5)[0]
    model = kind()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    train_step(model, optimizer, shard, forward=forward_of(model))
    assert model.seen == [False] * (len(shard.micro_batches) - 1) + [True]
    assert model.sync  # left on for whatever runs next
    model.seen.clear()  # FSDP2's sharded accumulation: a reduce-scatter every micro-batch
    train_step(model, optimizer, shard, forward=forward_of(model), gradient_sync="every")
    assert model.seen == [True] * len(shard.micro_batches)


def test_train_step_refuses_a_mismatched_world_or_a_missing_reference() -> None:
    batch = to_batch([group(0, 2, [3, 3], seed=0)])
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    two = split_batch(batch, 2, max_tokens=64)[0]
    with pytest.raises(ValueError, match=r"split_batch\(batch, ranks=1\)"):
        train_step(model, optimizer, two, forward=forward_of(model))
    one = split_batch(batch, 1, max_tokens=64)[0]
    with pytest.raises(ValueError, match="needs a reference"):
        train_step(model, optimizer, one, LossConfig(kl_coef=0.1), forward=forward_of(model))
    with pytest.raises(ValueError, match="use 'last' or 'every'"):
        train_step(model, optimizer, one, forward=forward_of(model), gradient_sync="first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_grad_norm=0"):
        train_step(model, optimizer, one, forward=forward_of(model), max_grad_norm=0)


def test_train_step_on_two_gloo_ranks_under_ddp_and_fsdp2_is_the_one_process_step() -> None:
    """Real torch.distributed (two processes, gloo): DDP and FSDP2 (syncing on the last
    micro-batch and on each) average the ranks' gradients; with each rank's loss times the
    world size, the weights after the step are those of the one-process full-batch step, with
    the clip-higher, the KL and a correction (tests/ranks_train_step.py; `--all` aggregations
    passed too). Two processes that import torch: a rank alone takes 4.6 s, the pair 12-16 s
    under a load of 8-10. Without the world-size factor the gradient norm was half the full
    one (356 against 712) and the check failed."""
    with socket.socket() as s:  # a free port for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.ranks_train_step"],
            env=env | {"RANK": str(rank)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in ranks]
    finally:
        for p in ranks:  # a rank left behind by the other's failure
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, output) in enumerate(zip(ranks, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{output[-3000:]}"
