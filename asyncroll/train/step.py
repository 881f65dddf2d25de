"""One optimizer step over a shard of micro-batches, the same code for one process and N ranks.

`train_step` runs every micro-batch of a `Shard` (from `split_batch`) through forward,
`token_logprobs`, the reference's logprobs when there is a KL penalty, `policy_loss` with the
whole batch's denominators, and backward (the gradients accumulate), then clips the gradient
norm, steps the optimizer, and returns the stats summed exactly over micro-batches and ranks.
The loop a user writes stays `split_batch(batch, ranks, max_tokens=...)` + `train_step(...)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import torch

from asyncroll.train.loss import (
    Aggregation,
    Correction,
    KlEstimator,
    check_loss_settings,
    check_sampling,
    loss_terms,
    token_logprobs,
)
from asyncroll.train.micro import Shard

if TYPE_CHECKING:
    from asyncroll.engines.base import SamplingConfig

GradientSync = Literal["last", "every"]
"""When `train_step` lets gradients sync over ranks: on the last micro-batch, or on each."""
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""`forward(input_ids, attention_mask) -> logits` ([B, L] int64 and bool in, [B, L, V] out)."""


class LossConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The settings of `policy_loss` and `token_logprobs` that `train_step` applies to every
    micro-batch (see `policy_loss` for each), checked at construction.

    `temperature`, `top_p` and `top_k` must be the sampling's (the distribution vLLM drew the
    tokens from): `LossConfig.for_sampling(producer_sampling, ...)` copies them."""

    clip: float = 0.2
    clip_high: float | None = None
    correction: Correction | None = None
    aggregation: Aggregation = "token-mean"
    norm_length: int | None = None
    kl_coef: float = 0.0
    kl_estimator: KlEstimator = "k3"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None

    def __post_init__(self) -> None:
        check_loss_settings(
            clip=self.clip,
            clip_high=self.clip_high,
            aggregation=self.aggregation,
            norm_length=self.norm_length,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
        )
        check_sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    @classmethod
    def for_sampling(cls, sampling: SamplingConfig, **settings: Any) -> LossConfig:
        """A config with the sampling's temperature, top_p and top_k; with
        "seq-mean-token-sum-norm", `norm_length` defaults to its max_new_tokens."""
        if settings.get("aggregation") == "seq-mean-token-sum-norm":
            settings.setdefault("norm_length", sampling.max_new_tokens)
        return cls(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, **settings
        )


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    shard: Shard,
    loss: LossConfig | None = None,
    *,
    forward: Forward | None = None,
    reference: torch.nn.Module | Forward | None = None,
    max_grad_norm: float | None = None,
    world_size: int | None = None,
    gradient_sync: GradientSync = "last",
) -> dict[str, float]:
    """One optimizer step of `model` on this process's `shard`; returns `train/...` stats.

    Zeroes the gradients, then for each micro-batch: the reference's logprobs without gradient
    (when `reference` is given: a model called as `model` is, or a `Forward`; it is needed when
    `loss.kl_coef` > 0, and with kl_coef 0 it only reports the KL), the model's logits
    (`forward`, or `model(input_ids, attention_mask=...).logits`), `token_logprobs` at the
    config's sampling parameters, `policy_loss` with `shard.norm` (the whole batch's
    denominators; with a correction the proximal policy is `logprobs.detach()`: one optimizer
    step per batch), and backward. Then `clip_grad_norm_` when `max_grad_norm` is given,
    `optimizer.step()`.

    Ranks: DDP and FSDP2 AVERAGE gradients over ranks, while the whole batch's gradient is the
    SUM of the ranks' (each rank's loss is its share of the whole batch's). So each rank
    backpropagates its loss times `world_size` (None: torch.distributed's world size when it
    is initialized, else 1); the average is then the whole batch's gradient, as one process
    would compute it. With `gradient_sync="last"` a model that offers it skips the gradient
    sync on all but the last micro-batch (FSDP2's `set_requires_gradient_sync`, DDP's
    `no_sync`): DDP saves an all-reduce per micro-batch at no memory cost, FSDP2 saves a
    reduce-scatter per micro-batch but holds *unsharded* gradients in between (a full
    gradient per rank); `"every"` syncs every micro-batch (FSDP2's own default: sharded
    gradients, the least memory). Every rank has the same number of micro-batches
    (`split_batch` sees to it), so the collectives match.

    Stats, each the whole batch's (summed exactly over micro-batches, all-reduced over ranks
    when `world_size` > 1 and torch.distributed is initialized; ranks simulated in one process
    get their own shares, which add up to the whole batch's): `train/loss`,
    `train/clip_fraction` (and `_high`, `_low`), `train/ratio_mean`, `train/kl` (with a
    reference), `train/tokens`, `train/samples`. As they are: `train/grad_norm` (with
    clipping, before it), `train/micro_batches` (per rank), and the split's
    `train/imbalance`, `train/padding_share`, `train/padding_micro_batches` and
    `train/oversized_rows` (see `split_batch`).
    """
    config = loss or LossConfig()
    world = world_size if world_size is not None else _world_size()
    if world < 1:
        raise ValueError(f"world_size={world_size}: must be >= 1 (None: torch.distributed's)")
    if world != shard.ranks:
        raise ValueError(
            f"world_size={world} but the shard is one of {shard.ranks}: split_batch(batch, "
            f"ranks={world}) so that the gradients average to the whole batch's"
        )
    if config.kl_coef > 0 and reference is None:
        raise ValueError(f"kl_coef={config.kl_coef} needs a reference (model or forward)")
    if gradient_sync not in ("last", "every"):
        raise ValueError(f"gradient_sync={gradient_sync!r}: use 'last' or 'every'")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm={max_grad_norm}: must be > 0 (None: no clipping)")
    policy = forward or _logits_of(model)
    ref = _logits_of(reference) if isinstance(reference, torch.nn.Module) else reference
    device = next(model.parameters()).device
    optimizer.zero_grad()
    sums: dict[str, torch.Tensor] = {}
    last = len(shard.micro_batches) - 1
    for i, micro in enumerate(shard.micro_batches):
        batch = micro.batch.to(device)
        ref_logprobs = None
        if ref is not None:  # first: its logits are gone before the policy's activations
            with torch.no_grad():
                ref_logprobs = _logprobs(ref, batch.input_ids, batch.attention_mask, config)
        with _gradient_sync(model, gradient_sync == "every" or i == last):
            logprobs = _logprobs(policy, batch.input_ids, batch.attention_mask, config)
            value, stats = loss_terms(
                logprobs,
                batch,
                clip=config.clip,
                clip_high=config.clip_high,
                correction=config.correction,
                proximal_logprobs=logprobs.detach() if config.correction is not None else None,
                ref_logprobs=ref_logprobs,
                kl_coef=config.kl_coef,
                kl_estimator=config.kl_estimator,
                aggregation=config.aggregation,
                norm_length=config.norm_length,
                norm=shard.norm,
            )
            (value * world).backward()  # type: ignore[no-untyped-call]
        stats["tokens"] = batch.loss_mask.sum()
        stats["samples"] = (micro.rows >= 0).sum()
        for name, v in stats.items():
            sums[name] = sums[name] + v.double() if name in sums else v.double()
    out: dict[str, float] = {}
    if max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        full = getattr(norm, "full_tensor", None)  # FSDP2: a DTensor
        out["train/grad_norm"] = float(full() if full is not None else norm)
    optimizer.step()
    names = sorted(sums)
    totals = torch.stack([sums[n].to(device) for n in names])
    if world > 1 and _distributed():
        torch.distributed.all_reduce(totals)
    out |= {f"train/{n}": v for n, v in zip(names, totals.tolist(), strict=True)}
    out["train/micro_batches"] = float(len(shard.micro_batches))
    out |= {f"train/{n}": v for n, v in shard.metrics.items() if n != "micro_batches"}
    return out


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _world_size() -> int:
    return torch.distributed.get_world_size() if _distributed() else 1


def _logits_of(model: torch.nn.Module) -> Forward:
    """A Hugging Face causal LM's forward: the logits of `model(input_ids, attention_mask=)`."""

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids, attention_mask=attention_mask.long()).logits
        return logits

    return forward


def _logprobs(
    forward: Forward, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: LossConfig
) -> torch.Tensor:
    logits = forward(input_ids, attention_mask)
    return token_logprobs(
        logits, input_ids, temperature=config.temperature, top_p=config.top_p, top_k=config.top_k
    )


@contextlib.contextmanager
def _gradient_sync(model: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Around one micro-batch's forward and backward: let the gradients sync over ranks only
    when `sync` (the last micro-batch), for a model that can skip it (FSDP2, DDP)."""
    setter = getattr(model, "set_requires_gradient_sync", None)  # FSDP2's FSDPModule
    if setter is not None:
        setter(sync)
        yield
        return
    no_sync = getattr(model, "no_sync", None)  # DDP
    if no_sync is not None and not sync:
        with no_sync():
            yield
        return
    yield
